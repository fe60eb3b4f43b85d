//! Fat-binary unpacking: the PTX of a CUDA program, whatever form it arrives in.
//!
//! nvcc places device code in a *fat binary*: a 16-byte header (magic `0xBA55ED50`, version,
//! header size, size of the entries) followed by entries, each with its own header (kind 1 =
//! PTX, 2 = ELF/SASS; header and payload sizes; PTX ISA version; SM architecture; flags) and a
//! payload. Flag `0x2000` marks an LZ4 block, `0x8000` a Zstandard frame, both with the
//! uncompressed size in the entry header; nvcc 13 compresses PTX with Zstandard by default
//! (`-compress-mode=speed` gives LZ4, `none` plain text). A host executable keeps its fat
//! binaries back to back in the ELF section `.nv_fatbin`. Layout facts: docs/PTX.md.
//!
//! Every size and offset is untrusted: checked arithmetic, named limits, no panic. An image
//! is read in two steps so that a small request cannot make the host decompress a lot: the
//! headers first ([`ptx_entries`]: the declared sizes of all PTX entries together are bounded
//! before a byte is decompressed), then one entry at a time ([`PtxEntry::text`]: its bytes
//! charged to the VM's budget before they are made, the decompressor unable to make more than
//! the entry declared, the cancel flag looked at as it goes).

use std::borrow::Cow;
use std::io::Read;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::ptx::Stop;
use super::{ComputeError, ComputeResult};
use crate::budget::{Charge, MemoryBudget};

/// Largest image accepted (an executable with its fat binaries).
pub const MAX_IMAGE_BYTES: usize = 256 << 20;
/// Largest entry once decompressed (the PTX executor's own text limit).
pub const MAX_DECOMPRESSED_BYTES: usize = super::ptx::MAX_PTX_BYTES;
/// PTX bytes of one module load or link, every entry of every image together, as their
/// headers declare them: what one link may parse. Checked before anything is decompressed,
/// it bounds the decompression and parsing a request can ask for, whatever it holds.
pub const MAX_MODULE_PTX_BYTES: usize = super::ptx::MAX_PTX_BYTES;
/// Entries read from one image.
pub const MAX_ENTRIES: usize = 4096;
/// Bytes decompressed between two looks at the cancel flag (well under a millisecond).
const DECOMPRESS_STEP: usize = 64 << 10;

const FATBIN_MAGIC: u32 = 0xBA55_ED50;
const FATBIN_HEADER_BYTES: usize = 16;
const ENTRY_HEADER_MIN_BYTES: usize = 64;
const KIND_PTX: u16 = 1;
/// ELF `e_machine` of NVIDIA's cubins.
const EM_CUDA: u16 = 190;
const FLAG_LZ4: u64 = 0x2000;
const FLAG_ZSTD: u64 = 0x8000;

/// One PTX text found in an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxImage {
    /// The SM architecture it was generated for (75 for `compute_75`); 0 when unknown.
    pub arch: u32,
    pub text: String,
}

/// How an entry's bytes are stored.
#[derive(Debug, Clone, Copy)]
enum Payload<'a> {
    Plain(&'a [u8]),
    Lz4(&'a [u8]),
    Zstd(&'a [u8]),
}

/// A PTX entry of an image, found from the headers alone: nothing is decompressed yet.
#[derive(Debug, Clone, Copy)]
pub struct PtxEntry<'a> {
    /// The SM architecture it was generated for (75 for `compute_75`); 0 when unknown.
    pub arch: u32,
    /// Its bytes once decompressed, as declared: decompression never makes more.
    pub size: usize,
    payload: Payload<'a>,
}

/// An entry's PTX text: borrowed from the image when it was stored plain, else decompressed
/// and charged to the budget for as long as it is held.
#[derive(Debug)]
pub struct PtxText<'a> {
    text: Cow<'a, str>,
    _charge: Option<Charge>,
}

impl Deref for PtxText<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        &self.text
    }
}

fn bad(msg: impl Into<String>) -> ComputeError {
    ComputeError::InvalidImage(msg.into())
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        b.get(off..off.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(off..off.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(off..off.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// Adds the declared sizes of `entries` to `total`, refusing past [`MAX_MODULE_PTX_BYTES`].
fn add_sizes(total: &mut usize, entries: &[PtxEntry<'_>]) -> ComputeResult<()> {
    for e in entries {
        *total = total
            .checked_add(e.size)
            .filter(|&t| t <= MAX_MODULE_PTX_BYTES)
            .ok_or_else(|| {
                bad(format!(
                    "PTX entries declare more than {MAX_MODULE_PTX_BYTES} bytes together"
                ))
            })?;
    }
    Ok(())
}

/// Every PTX text of every image, in order: what a link of those images takes. The declared
/// sizes of all of them are checked together before any is decompressed; each decompressed
/// text is charged to `budget` while it is held.
pub fn ptx_of_all<'a>(
    images: &[&'a [u8]],
    budget: &Arc<MemoryBudget>,
    cancel: &AtomicBool,
) -> ComputeResult<Vec<PtxText<'a>>> {
    let mut entries = Vec::new();
    let mut total = 0;
    for image in images {
        let found = ptx_entries_unsorted(image)?;
        add_sizes(&mut total, &found)?;
        entries.extend(found);
    }
    entries.iter().map(|e| e.text(budget, cancel)).collect()
}

/// Every PTX entry in `image` (PTX itself, fat binaries, an ELF host binary with
/// `.nv_fatbin`, or an ELF holding GCC nvptx offload PTX), lowest architecture first (the
/// most portable), from the headers alone. Their declared sizes together are at most
/// [`MAX_MODULE_PTX_BYTES`].
pub fn ptx_entries(image: &[u8]) -> ComputeResult<Vec<PtxEntry<'_>>> {
    let mut out = ptx_entries_unsorted(image)?;
    add_sizes(&mut 0, &out)?;
    out.sort_by_key(|p| p.arch);
    Ok(out)
}

/// Every PTX text in `image`, as [`ptx_entries`] orders them, decompressed: for tools and
/// tests (the bytes are bounded by [`MAX_MODULE_PTX_BYTES`] but charged to no VM).
pub fn extract_ptx(image: &[u8]) -> ComputeResult<Vec<PtxImage>> {
    let budget = MemoryBudget::new(u64::MAX);
    let never = AtomicBool::new(false);
    ptx_entries(image)?
        .iter()
        .map(|e| {
            Ok(PtxImage {
                arch: e.arch,
                text: e.text(&budget, &never)?.text.into_owned(),
            })
        })
        .collect()
}

fn ptx_entries_unsorted(image: &[u8]) -> ComputeResult<Vec<PtxEntry<'_>>> {
    if image.len() > MAX_IMAGE_BYTES {
        return Err(bad(format!(
            "{} bytes, more than {MAX_IMAGE_BYTES}",
            image.len()
        )));
    }
    let mut machine = Vec::new();
    let out = if image.starts_with(b"\x7fELF") {
        if u16_at(image, 0x12) == Some(EM_CUDA) {
            return Err(ComputeError::NoBinaryForGpu(
                "the image is a cubin (machine code), and the PTX executor runs PTX only".into(),
            ));
        }
        from_elf(image, &mut machine)?
    } else if u32_at(image, 0) == Some(FATBIN_MAGIC) {
        fatbins(image, &mut machine)?
    } else if looks_like_ptx(image) {
        let text = std::str::from_utf8(trim_nul(image)).map_err(|_| bad("PTX is not UTF-8"))?;
        vec![plain(text)]
    } else {
        return Err(bad("neither PTX, a fat binary nor an ELF file"));
    };
    if out.is_empty() && !machine.is_empty() {
        machine.sort_unstable();
        machine.dedup();
        let archs: Vec<String> = machine.iter().map(|a| format!("sm_{a}")).collect();
        return Err(ComputeError::NoBinaryForGpu(format!(
            "the image holds machine code for {} and no PTX, and the PTX executor runs PTX \
             only (build with PTX, e.g. -gencode arch=compute_75,code=compute_75; relocatable \
             device code, as dynamic parallelism needs, is linked to machine code only)",
            archs.join(", ")
        )));
    }
    if out.is_empty() {
        return Err(bad("no PTX in the image"));
    }
    Ok(out)
}

fn plain(text: &str) -> PtxEntry<'_> {
    PtxEntry {
        arch: target_arch(text),
        size: text.len(),
        payload: Payload::Plain(text.as_bytes()),
    }
}

impl<'a> PtxEntry<'a> {
    /// The entry's text. A compressed entry's bytes are charged to `budget` before they are
    /// made (an `OutOfMemory` error when they do not fit), the decompressor stops at the
    /// declared size (an entry that would make more is invalid), and `cancel` stops it
    /// within a step of [`DECOMPRESS_STEP`] bytes (Zstandard; an LZ4 block, at most
    /// [`MAX_DECOMPRESSED_BYTES`], is one call).
    pub fn text(
        &self,
        budget: &Arc<MemoryBudget>,
        cancel: &AtomicBool,
    ) -> ComputeResult<PtxText<'a>> {
        let check = || -> ComputeResult<()> {
            if cancel.load(std::sync::atomic::Ordering::Relaxed) {
                Err(Stop::Cancelled.error())
            } else {
                Ok(())
            }
        };
        check()?;
        let charge = |bytes: usize| {
            budget
                .charge(bytes as u64)
                .map_err(|e| Stop::OverBudget(e).error())
        };
        let (data, charge) = match self.payload {
            Payload::Plain(b) => {
                let text =
                    std::str::from_utf8(trim_nul(b)).map_err(|_| bad("PTX entry is not UTF-8"))?;
                return Ok(PtxText {
                    text: Cow::Borrowed(text),
                    _charge: None,
                });
            }
            Payload::Lz4(stored) => {
                let charge = charge(self.size)?;
                let mut out = vec![0u8; self.size];
                let n = lz4_flex::block::decompress_into(stored, &mut out)
                    .map_err(|e| bad(format!("LZ4: {e}")))?;
                out.truncate(n);
                (out, charge)
            }
            Payload::Zstd(stored) => {
                // The decoder keeps a window of what it made: at most as much again.
                let mut charge = charge(self.size.saturating_mul(2))?;
                let mut decoder = ruzstd::decoding::StreamingDecoder::new(stored)
                    .map_err(|e| bad(format!("Zstandard: {e}")))?;
                let mut out = Vec::with_capacity(self.size);
                let mut step = vec![0u8; DECOMPRESS_STEP];
                loop {
                    check()?;
                    let n = decoder
                        .read(&mut step)
                        .map_err(|e| bad(format!("Zstandard: {e}")))?;
                    if n == 0 {
                        break;
                    }
                    if n > self.size - out.len() {
                        return Err(bad(format!(
                            "Zstandard entry makes more than the {} bytes it declares",
                            self.size
                        )));
                    }
                    out.extend_from_slice(&step[..n]);
                }
                drop(decoder);
                charge.shrink(self.size as u64);
                (out, charge)
            }
        };
        let mut data = data;
        data.truncate(trim_nul(&data).len());
        let text = String::from_utf8(data).map_err(|_| bad("PTX entry is not UTF-8"))?;
        Ok(PtxText {
            text: Cow::Owned(text),
            _charge: Some(charge),
        })
    }
}

fn trim_nul(b: &[u8]) -> &[u8] {
    &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())]
}

fn looks_like_ptx(b: &[u8]) -> bool {
    let head = &b[..b.len().min(64 * 1024)];
    head.windows(9).any(|w| w == b".version ") && head.windows(8).any(|w| w == b".target ")
}

/// `.target sm_75` → 75.
fn target_arch(text: &str) -> u32 {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(".target"))
        .and_then(|t| t.trim().strip_prefix("sm_"))
        .map(|t| {
            t.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .and_then(|d| d.parse().ok())
        .unwrap_or(0)
}

/// Fat binaries back to back (a `.nv_fatbin` section holds one per translation unit).
/// The architecture of each machine-code entry goes to `machine` (for the error naming them
/// when there is no PTX).
fn fatbins<'a>(mut b: &'a [u8], machine: &mut Vec<u32>) -> ComputeResult<Vec<PtxEntry<'a>>> {
    let mut out = Vec::new();
    let mut entries = 0;
    while b.len() >= FATBIN_HEADER_BYTES {
        if u32_at(b, 0) != Some(FATBIN_MAGIC) {
            // Padding between fat binaries.
            if u64_at(b, 0) == Some(0) {
                b = &b[8..];
                continue;
            }
            return Err(bad("bytes after a fat binary that are not one"));
        }
        let header = usize::from(u16_at(b, 6).unwrap_or(0));
        let size = u64_at(b, 8).and_then(|s| usize::try_from(s).ok());
        let end = size
            .and_then(|s| s.checked_add(header))
            .filter(|&e| e <= b.len() && header >= FATBIN_HEADER_BYTES);
        let Some(end) = end else {
            return Err(bad("fat binary header past the image"));
        };
        let mut e = &b[header..end];
        while !e.is_empty() {
            entries += 1;
            if entries > MAX_ENTRIES {
                return Err(bad(format!("more than {MAX_ENTRIES} entries")));
            }
            let (ptx, rest) = entry(e)?;
            match ptx {
                Ok(ptx) => out.push(ptx),
                Err(arch) => machine.push(arch),
            }
            e = rest;
        }
        b = &b[end..];
    }
    Ok(out)
}

/// One entry's header: its PTX (else, machine code, its architecture) and the bytes after it.
fn entry(e: &[u8]) -> ComputeResult<(Result<PtxEntry<'_>, u32>, &[u8])> {
    let (Some(kind), Some(header), Some(size)) = (u16_at(e, 0), u32_at(e, 4), u64_at(e, 8)) else {
        return Err(bad("truncated entry header"));
    };
    let header = header as usize;
    let end = usize::try_from(size)
        .ok()
        .and_then(|s| s.checked_add(header))
        .filter(|&end| end <= e.len() && header >= ENTRY_HEADER_MIN_BYTES);
    let Some(end) = end else {
        return Err(bad("entry past its fat binary"));
    };
    let rest = &e[end..];
    let arch = u32_at(e, 28).unwrap_or(0);
    if kind != KIND_PTX {
        return Ok((Err(arch), rest));
    }
    let payload = &e[header..end];
    let flags = u64_at(e, 40).unwrap_or(0);
    let stored = u32_at(e, 16).unwrap_or(0) as usize;
    let full = u64_at(e, 56).unwrap_or(0);
    let ptx = if flags & (FLAG_LZ4 | FLAG_ZSTD) != 0 {
        let size = usize::try_from(full)
            .ok()
            .filter(|&f| f <= MAX_DECOMPRESSED_BYTES)
            .ok_or_else(|| bad(format!("entry of {full} bytes when decompressed")))?;
        let stored = payload
            .get(..stored)
            .ok_or_else(|| bad("compressed size past the entry"))?;
        PtxEntry {
            arch,
            size,
            payload: if flags & FLAG_LZ4 != 0 {
                Payload::Lz4(stored)
            } else {
                Payload::Zstd(stored)
            },
        }
    } else {
        let payload = trim_nul(payload);
        if payload.len() > MAX_DECOMPRESSED_BYTES {
            return Err(bad(format!("entry of {} bytes", payload.len())));
        }
        PtxEntry {
            arch,
            size: payload.len(),
            payload: Payload::Plain(payload),
        }
    };
    Ok((Ok(ptx), rest))
}

/// The fat binaries of an ELF64 executable or library (`.nv_fatbin`), or the PTX texts GCC's
/// nvptx offloading embeds in it as strings.
fn from_elf<'a>(b: &'a [u8], machine: &mut Vec<u32>) -> ComputeResult<Vec<PtxEntry<'a>>> {
    if b.get(4) != Some(&2) || b.get(5) != Some(&1) {
        return Err(bad("not a 64-bit little-endian ELF file"));
    }
    let shoff = u64_at(b, 0x28).and_then(|o| usize::try_from(o).ok());
    let shentsize = u16_at(b, 0x3a).map(usize::from);
    let shnum = u16_at(b, 0x3c).map(usize::from);
    let shstrndx = u16_at(b, 0x3e).map(usize::from);
    let (Some(shoff), Some(shentsize), Some(shnum), Some(shstrndx)) =
        (shoff, shentsize, shnum, shstrndx)
    else {
        return Err(bad("truncated ELF header"));
    };
    if shentsize < 64 {
        return Err(bad("bad ELF section header size"));
    }
    let section = |i: usize| -> Option<(u32, &[u8])> {
        let h = shoff.checked_add(i.checked_mul(shentsize)?)?;
        let name = u32_at(b, h)?;
        let kind = u32_at(b, h.checked_add(4)?)?;
        let off = usize::try_from(u64_at(b, h.checked_add(24)?)?).ok()?;
        let size = usize::try_from(u64_at(b, h.checked_add(32)?)?).ok()?;
        // SHT_NOBITS has no bytes in the file.
        let data = if kind == 8 {
            &[][..]
        } else {
            b.get(off..off.checked_add(size)?)?
        };
        Some((name, data))
    };
    let (_, names) = section(shstrndx).ok_or_else(|| bad("ELF section names past the file"))?;
    let mut out = Vec::new();
    for i in 0..shnum {
        let (name, data) = section(i).ok_or_else(|| bad("ELF section past the file"))?;
        let name = names.get(name as usize..).map(trim_nul).unwrap_or_default();
        if name == b".nv_fatbin" {
            out.extend(fatbins(data, machine)?);
        } else if out.is_empty() && name == b".rodata" {
            out.extend(embedded_ptx(data));
        }
    }
    Ok(out)
}

/// NUL-terminated PTX texts inside a data section (GCC's `mkoffload` embeds each offload
/// image's PTX as a string; each starts with a `// BEGIN PREAMBLE` comment or `.version`).
fn embedded_ptx(data: &[u8]) -> Vec<PtxEntry<'_>> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(pos) = find(&data[at..], b"// BEGIN PREAMBLE") {
        let start = at + pos;
        let len = data[start..]
            .iter()
            .position(|&c| c == 0)
            .unwrap_or(data.len() - start);
        if len > MAX_DECOMPRESSED_BYTES || out.len() >= MAX_ENTRIES {
            break;
        }
        if let Ok(text) = std::str::from_utf8(&data[start..start + len]) {
            if looks_like_ptx(text.as_bytes()) {
                out.push(plain(text));
            }
        }
        at = start + len;
    }
    out
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str =
        ".version 8.5\n.target sm_75\n.address_size 64\n.visible .entry k() { ret; }\n";

    fn entry_bytes(kind: u16, arch: u32, flags: u64, payload: &[u8], full: u64) -> Vec<u8> {
        let padded = payload.len().next_multiple_of(8);
        let mut e = vec![0u8; 64];
        e[0..2].copy_from_slice(&kind.to_le_bytes());
        e[2..4].copy_from_slice(&0x101u16.to_le_bytes());
        e[4..8].copy_from_slice(&64u32.to_le_bytes());
        e[8..16].copy_from_slice(&(padded as u64).to_le_bytes());
        e[16..20].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        e[28..32].copy_from_slice(&arch.to_le_bytes());
        e[40..48].copy_from_slice(&(flags | 0x11).to_le_bytes());
        e[56..64].copy_from_slice(&full.to_le_bytes());
        e.extend_from_slice(payload);
        e.resize(64 + padded, 0);
        e
    }

    fn fatbin(entries: &[Vec<u8>]) -> Vec<u8> {
        let body: Vec<u8> = entries.concat();
        let mut f = Vec::new();
        f.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        f.extend_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&16u16.to_le_bytes());
        f.extend_from_slice(&(body.len() as u64).to_le_bytes());
        f.extend_from_slice(&body);
        f
    }

    #[test]
    fn an_image_of_machine_code_only_has_no_binary_for_the_device() {
        // A fat binary of cubins alone (what relocatable device code links to).
        let f = fatbin(&[
            entry_bytes(2, 86, 0, b"\x7fELF-sass", 0),
            entry_bytes(2, 75, 0, b"\x7fELF-sass", 0),
        ]);
        let err = extract_ptx(&f).unwrap_err();
        assert_eq!(err.cuda_status(), 209, "{err}");
        assert!(err.to_string().contains("sm_75, sm_86"), "{err}");
        // A bare cubin: an ELF file of NVIDIA's machine type.
        let mut cubin = vec![0u8; 64];
        cubin[..4].copy_from_slice(b"\x7fELF");
        cubin[4] = 2;
        cubin[5] = 1;
        cubin[0x12..0x14].copy_from_slice(&EM_CUDA.to_le_bytes());
        let err = extract_ptx(&cubin).unwrap_err();
        assert_eq!(err.cuda_status(), 209, "{err}");
        // Nothing at all is still an invalid image.
        let err = extract_ptx(&fatbin(&[])).unwrap_err();
        assert_eq!(err.cuda_status(), 200, "{err}");
    }

    #[test]
    fn plain_lz4_and_zstd_entries_give_their_ptx_lowest_arch_first() {
        let lz4 = lz4_flex::block::compress(PTX.as_bytes());
        let zstd = ruzstd::encoding::compress_to_vec(
            PTX.as_bytes(),
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        let f = fatbin(&[
            entry_bytes(2, 75, 0, b"\x7fELF-sass", 0),
            entry_bytes(1, 90, FLAG_ZSTD, &zstd, PTX.len() as u64),
            entry_bytes(1, 80, FLAG_LZ4, &lz4, PTX.len() as u64),
            entry_bytes(1, 75, 0, PTX.as_bytes(), 0),
        ]);
        let two = [f.clone(), vec![0; 8], f].concat();
        let got = extract_ptx(&two).unwrap();
        assert_eq!(got.len(), 6);
        assert_eq!(
            got.iter().map(|p| p.arch).collect::<Vec<_>>(),
            [75, 75, 80, 80, 90, 90]
        );
        assert!(got.iter().all(|p| p.text == PTX));
        assert_eq!(
            extract_ptx(PTX.as_bytes()).unwrap(),
            [PtxImage {
                arch: 75,
                text: PTX.into()
            }]
        );
    }

    #[test]
    fn lying_sizes_and_garbage_are_invalid_images_never_panics() {
        let good = fatbin(&[entry_bytes(
            1,
            75,
            FLAG_LZ4,
            &lz4_flex::block::compress(PTX.as_bytes()),
            PTX.len() as u64,
        )]);
        let mut cases: Vec<Vec<u8>> = vec![b"hello".to_vec(), vec![], b"\x7fELF".to_vec()];
        for at in [8, 16 + 4, 16 + 8, 16 + 16, 16 + 56] {
            for v in [0u8, 0x7f, 0xff] {
                let mut c = good.clone();
                for b in &mut c[at..at + 4] {
                    *b = v;
                }
                cases.push(c);
            }
        }
        for cut in 0..good.len() {
            cases.push(good[..cut].to_vec());
        }
        // A decompressed size past the limit is refused before any allocation.
        let mut huge = good.clone();
        huge[16 + 56..16 + 64].copy_from_slice(&u64::MAX.to_le_bytes());
        cases.push(huge);
        for c in cases {
            if let Err(e) = extract_ptx(&c) {
                assert_eq!(e.cuda_status(), 200, "{e}");
            }
        }
        let mut huge = good;
        huge[16 + 56..16 + 64].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(extract_ptx(&huge).is_err());
    }

    /// A Zstandard frame of RLE blocks (128 KiB each, 4 bytes in the frame) that makes
    /// `bytes` bytes of `fill`: about 2 KiB of frame per 64 MiB.
    fn zstd_rle_frame(bytes: usize, fill: u8) -> Vec<u8> {
        const BLOCK: usize = 128 << 10;
        // Magic; a frame header without content size or checksum; a 64 MiB window.
        let mut f = vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, 16 << 3];
        let mut left = bytes;
        loop {
            let n = left.min(BLOCK);
            left -= n;
            let last = u32::from(left == 0);
            let header = (n as u32) << 3 | 1 << 1 | last;
            f.extend_from_slice(&header.to_le_bytes()[..3]);
            f.push(fill);
            if left == 0 {
                return f;
            }
        }
    }

    /// The bomb: `entries` PTX entries, each a frame that makes 64 MiB.
    fn zstd_bomb(entries: usize) -> Vec<u8> {
        let frame = zstd_rle_frame(64 << 20, b' ');
        let entry = entry_bytes(1, 75, FLAG_ZSTD, &frame, 64 << 20);
        fatbin(&vec![entry; entries])
    }

    #[test]
    fn a_zstd_bomb_is_refused_from_its_headers_before_a_byte_is_decompressed() {
        let bomb = zstd_bomb(48);
        assert!(bomb.len() < 128 << 10, "{} bytes", bomb.len());
        let e = ptx_entries(&bomb).unwrap_err();
        assert!(
            matches!(&e, ComputeError::InvalidImage(m) if m.contains("together")),
            "{e}"
        );
        assert!(extract_ptx(&bomb).is_err());
        // Through the backend: refused, and the budget as it was.
        let budget = MemoryBudget::new(u64::MAX);
        let mut be = crate::compute::CpuBackend::new(crate::compute::CpuConfig {
            budget: Arc::clone(&budget),
            ..Default::default()
        });
        use crate::compute::ComputeBackend;
        let ctx = be.context_create().unwrap();
        let before = budget.used();
        assert_eq!(be.module_load(ctx, &bomb).unwrap_err().cuda_status(), 200);
        assert_eq!(budget.used(), before);
    }

    #[test]
    fn an_entry_is_charged_before_it_is_decompressed_and_never_makes_more_than_it_declares() {
        let never = AtomicBool::new(false);
        // One entry of 64 MiB fits the module limit, but not a 16 MiB budget.
        let one = zstd_bomb(1);
        let entries = ptx_entries(&one).unwrap();
        let small = MemoryBudget::new(16 << 20);
        let e = entries[0].text(&small, &never).unwrap_err();
        assert_eq!(e.cuda_status(), 2, "{e}");
        assert_eq!(small.used(), 0);
        // An entry that declares 4 KiB and would make 64 MiB stops at 4 KiB.
        for flags in [FLAG_ZSTD, FLAG_LZ4] {
            let frame = if flags == FLAG_ZSTD {
                zstd_rle_frame(64 << 20, b' ')
            } else {
                lz4_flex::block::compress(&vec![b' '; 1 << 20])
            };
            let lying = fatbin(&[entry_bytes(1, 75, flags, &frame, 4096)]);
            let entries = ptx_entries(&lying).unwrap();
            assert_eq!(entries[0].size, 4096);
            let budget = MemoryBudget::new(1 << 20);
            let e = entries[0].text(&budget, &never).unwrap_err();
            assert_eq!(e.cuda_status(), 200, "{e}");
            assert_eq!(budget.used(), 0);
        }
        // A text that fits is charged while it is held.
        let zstd = ruzstd::encoding::compress_to_vec(
            PTX.as_bytes(),
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        let f = fatbin(&[entry_bytes(1, 90, FLAG_ZSTD, &zstd, PTX.len() as u64)]);
        let budget = MemoryBudget::new(1 << 20);
        let text = ptx_entries(&f).unwrap()[0].text(&budget, &never).unwrap();
        assert_eq!(&*text, PTX);
        assert_eq!(budget.used(), PTX.len() as u64);
        drop(text);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_load_decompresses_only_the_entries_it_needs() {
        // The most portable entry parses: the broken one after it is never decompressed.
        let f = fatbin(&[
            entry_bytes(1, 90, FLAG_ZSTD, b"not a Zstandard frame", 1 << 20),
            entry_bytes(1, 75, 0, PTX.as_bytes(), 0),
        ]);
        let entries = ptx_entries(&f).unwrap();
        assert_eq!(entries.iter().map(|e| e.arch).collect::<Vec<_>>(), [75, 90]);
        use crate::compute::ComputeBackend;
        let mut be = crate::compute::CpuBackend::new(crate::compute::CpuConfig::default());
        let ctx = be.context_create().unwrap();
        let m = be.module_load(ctx, &f).unwrap();
        be.function(ctx, m, "k").unwrap();
    }

    #[test]
    fn a_cancelled_load_stops_and_gives_its_bytes_back() {
        let cancel = AtomicBool::new(true);
        let budget = MemoryBudget::new(u64::MAX);
        let f = zstd_bomb(1);
        let e = ptx_entries(&f).unwrap()[0]
            .text(&budget, &cancel)
            .unwrap_err();
        assert_eq!(e, Stop::Cancelled.error());
        assert_eq!(budget.used(), 0);
    }
}
