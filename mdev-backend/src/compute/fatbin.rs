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
//! Every size and offset is untrusted: checked arithmetic, named limits, no panic.

use std::io::Read;

use super::{ComputeError, ComputeResult};

/// Largest image accepted (an executable with its fat binaries).
pub const MAX_IMAGE_BYTES: usize = 256 << 20;
/// Largest entry once decompressed (the PTX executor's own text limit).
pub const MAX_DECOMPRESSED_BYTES: usize = super::ptx::MAX_PTX_BYTES;
/// Entries read from one image.
pub const MAX_ENTRIES: usize = 4096;

const FATBIN_MAGIC: u32 = 0xBA55_ED50;
const FATBIN_HEADER_BYTES: usize = 16;
const ENTRY_HEADER_MIN_BYTES: usize = 64;
const KIND_PTX: u16 = 1;
const FLAG_LZ4: u64 = 0x2000;
const FLAG_ZSTD: u64 = 0x8000;

/// One PTX text found in an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxImage {
    /// The SM architecture it was generated for (75 for `compute_75`); 0 when unknown.
    pub arch: u32,
    pub text: String,
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

/// Every PTX text of every image, in order: what a link of those images takes.
pub fn ptx_of_all(images: &[&[u8]]) -> ComputeResult<Vec<String>> {
    let mut texts = Vec::new();
    for image in images {
        texts.extend(extract_ptx(image)?.into_iter().map(|p| p.text));
    }
    Ok(texts)
}

/// Every PTX text in `image` (PTX itself, fat binaries, an ELF host binary with `.nv_fatbin`,
/// or an ELF holding GCC nvptx offload PTX), lowest architecture first (the most portable).
pub fn extract_ptx(image: &[u8]) -> ComputeResult<Vec<PtxImage>> {
    if image.len() > MAX_IMAGE_BYTES {
        return Err(bad(format!(
            "{} bytes, more than {MAX_IMAGE_BYTES}",
            image.len()
        )));
    }
    let mut out = if image.starts_with(b"\x7fELF") {
        from_elf(image)?
    } else if u32_at(image, 0) == Some(FATBIN_MAGIC) {
        fatbins(image)?
    } else if looks_like_ptx(image) {
        let text = std::str::from_utf8(trim_nul(image)).map_err(|_| bad("PTX is not UTF-8"))?;
        vec![PtxImage {
            arch: target_arch(text),
            text: text.to_string(),
        }]
    } else {
        return Err(bad("neither PTX, a fat binary nor an ELF file"));
    };
    if out.is_empty() {
        return Err(bad("no PTX in the image"));
    }
    out.sort_by_key(|p| p.arch);
    Ok(out)
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
fn fatbins(mut b: &[u8]) -> ComputeResult<Vec<PtxImage>> {
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
            out.extend(ptx);
            e = rest;
        }
        b = &b[end..];
    }
    Ok(out)
}

/// One entry: its PTX (when it is PTX) and the bytes after it.
fn entry(e: &[u8]) -> ComputeResult<(Option<PtxImage>, &[u8])> {
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
    if kind != KIND_PTX {
        return Ok((None, rest));
    }
    let payload = &e[header..end];
    let arch = u32_at(e, 28).unwrap_or(0);
    let flags = u64_at(e, 40).unwrap_or(0);
    let stored = u32_at(e, 16).unwrap_or(0) as usize;
    let full = u64_at(e, 56).unwrap_or(0);
    let data = if flags & (FLAG_LZ4 | FLAG_ZSTD) != 0 {
        let full = usize::try_from(full)
            .ok()
            .filter(|&f| f <= MAX_DECOMPRESSED_BYTES)
            .ok_or_else(|| bad(format!("entry of {full} bytes when decompressed")))?;
        let stored = payload
            .get(..stored)
            .ok_or_else(|| bad("compressed size past the entry"))?;
        if flags & FLAG_LZ4 != 0 {
            lz4_flex::block::decompress(stored, full).map_err(|e| bad(format!("LZ4: {e}")))?
        } else {
            let mut out = Vec::new();
            let decoder = ruzstd::decoding::StreamingDecoder::new(stored)
                .map_err(|e| bad(format!("Zstandard: {e}")))?;
            decoder
                .take(MAX_DECOMPRESSED_BYTES as u64 + 1)
                .read_to_end(&mut out)
                .map_err(|e| bad(format!("Zstandard: {e}")))?;
            if out.len() > MAX_DECOMPRESSED_BYTES {
                return Err(bad("Zstandard entry past its limit"));
            }
            out
        }
    } else {
        payload.to_vec()
    };
    let text =
        String::from_utf8(trim_nul(&data).to_vec()).map_err(|_| bad("PTX entry is not UTF-8"))?;
    Ok((Some(PtxImage { arch, text }), rest))
}

/// The fat binaries of an ELF64 executable or library (`.nv_fatbin`), or the PTX texts GCC's
/// nvptx offloading embeds in it as strings.
fn from_elf(b: &[u8]) -> ComputeResult<Vec<PtxImage>> {
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
            out.extend(fatbins(data)?);
        } else if out.is_empty() && name == b".rodata" {
            out.extend(embedded_ptx(data));
        }
    }
    Ok(out)
}

/// NUL-terminated PTX texts inside a data section (GCC's `mkoffload` embeds each offload
/// image's PTX as a string; each starts with a `// BEGIN PREAMBLE` comment or `.version`).
fn embedded_ptx(data: &[u8]) -> Vec<PtxImage> {
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
                out.push(PtxImage {
                    arch: target_arch(text),
                    text: text.to_string(),
                });
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
}
