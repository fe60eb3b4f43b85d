//! Structure-aware generators for the compute targets (docs/FUZZING.md, "Modes"): inputs
//! that libFuzzer's byte mutations rarely grow by themselves, built from a few fuzz-chosen
//! numbers, so that a small input reaches depth (thousands of nested batches, deeply nested
//! PTX scopes) and bombs (compressed entries that would decompress to far more than the
//! memory budget, declared sizes that lie).

use crate::Input;

/// Largest message [`nested_batches`] builds: 20,000 nested batches in 200 KB overflowed the
/// decoding thread's stack before the fix (commit 21c22a3); a u16 depth of up to 65,535
/// fits here with small leaves, and an execution stays within milliseconds.
pub const MAX_NESTED_MESSAGE_BYTES: usize = 4 << 20;

/// Largest PTX text [`deep_ptx`] writes: enough for thousands of nested scopes and
/// thousands of instructions, small enough that an execution stays within about 50 ms. The
/// instrumented parse makes about 5 MB/s (coverage tracing of its comparisons is four fifths
/// of it), mutations of the sizes reach the limit often, and at 1 MiB the target slowed to 7
/// executions a second. Bigger texts come from bombs ([`fatbin`]) and raw inputs.
pub const MAX_GENERATED_PTX_BYTES: usize = 256 << 10;

/// Largest decompressed size a bomb entry of [`fatbin`] is built for: four times the most a
/// module may hold (`fatbin::MAX_MODULE_PTX_BYTES`, 64 MiB), and far past the targets'
/// memory budget. An LZ4 bomb of this size is about 1 MiB (LZ4 expands at most 255 times).
pub const MAX_BOMB_BYTES: u32 = 256 << 20;

/// Most entries [`fatbin`] writes into one fat binary.
pub const MAX_FATBIN_ENTRIES: u8 = 8;

/// Opcode of a `Batch` request on the compute wire.
const BATCH_OPCODE: u16 = 29;
const FATBIN_MAGIC: u32 = 0xBA55_ED50;
const ENTRY_HEADER_BYTES: u32 = 64;
const KIND_PTX: u16 = 1;
const KIND_ELF: u16 = 2;
const FLAG_LZ4: u64 = 0x2000;
const FLAG_ZSTD: u64 = 0x8000;
/// Zstandard's largest block (its `Block_Maximum_Size`).
const ZSTD_BLOCK_BYTES: usize = 128 << 10;
const PTX_HEADER: &str = ".version 8.5\n.target sm_75\n.address_size 64\n";

/// One compute-wire message (4-byte length, then the body) holding a `Batch` nested `depth`
/// levels deep (fuzz-chosen, up to 65,535, fewer when the message would pass
/// [`MAX_NESTED_MESSAGE_BYTES`]). Every level holds the same fuzz-chosen requests (any
/// opcode, any fields) with the nested batch among them at a fuzz-chosen place, and may
/// declare more items than it holds; the innermost batch holds the requests alone.
///
/// Layout read from `input`: depth (u16), requests per level (u8, 0 to 3), place of the
/// nested batch (u8), extra items declared (u8, 0 to 2), then each request: opcode (u16) and
/// its fields (a length-prefixed chunk).
pub fn nested_batches(input: &mut Input<'_>) -> Vec<u8> {
    let depth = usize::from(input.u16());
    let leaves = usize::from(input.u8() % 4);
    let at = usize::from(input.u8()) % (leaves + 1);
    let lie = u32::from(input.u8() % 3);
    let mut items = Vec::with_capacity(leaves);
    for _ in 0..leaves {
        let mut body = input.u16().to_le_bytes().to_vec();
        body.extend_from_slice(input.chunk());
        items.push(body);
    }
    let framed = |bodies: &[Vec<u8>]| -> Vec<u8> {
        let mut out = Vec::new();
        for b in bodies {
            out.extend_from_slice(&len_u32(b.len()).to_le_bytes());
            out.extend_from_slice(b);
        }
        out
    };
    let (before, after) = (framed(&items[..at]), framed(&items[at..]));
    let count = |n: usize| len_u32(n).saturating_add(lie).to_le_bytes();
    let mut innermost = BATCH_OPCODE.to_le_bytes().to_vec();
    innermost.extend_from_slice(&count(leaves));
    innermost.extend_from_slice(&before);
    innermost.extend_from_slice(&after);
    // Opcode, count, the requests and the nested batch's length: what each level adds.
    let per_level = 2 + 4 + before.len() + 4 + after.len();
    let room = MAX_NESTED_MESSAGE_BYTES.saturating_sub(4 + innermost.len());
    let depth = depth.min(room / per_level);
    // Written outermost first, each level's length known from the levels inside it, so the
    // message is built in one pass whatever the depth.
    let sizes: Vec<usize> = (0..=depth)
        .map(|level| innermost.len() + level * per_level)
        .collect();
    let mut out = Vec::with_capacity(4 + sizes[depth]);
    out.extend_from_slice(&len_u32(sizes[depth]).to_le_bytes());
    for level in (1..=depth).rev() {
        out.extend_from_slice(&BATCH_OPCODE.to_le_bytes());
        out.extend_from_slice(&count(leaves + 1));
        out.extend_from_slice(&before);
        out.extend_from_slice(&len_u32(sizes[level - 1]).to_le_bytes());
    }
    out.extend_from_slice(&innermost);
    for _ in 0..depth {
        out.extend_from_slice(&after);
    }
    out
}

/// A length as the wire and fat binaries write it (every length here is far below 4 GiB).
fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Instructions [`deep_ptx`] picks from; `{L}` is the enclosing scope's label. Each is one
/// the executor runs, so a generated kernel parses and launches (a branch back to the
/// scope's label loops until the instruction budget stops it).
const INSTRUCTIONS: [&str; 12] = [
    "mov.u32 %r1, %tid.x;",
    "add.s32 %r2, %r2, %r1;",
    "mul.lo.s32 %r3, %r2, 3;",
    "shl.b32 %r3, %r3, 1;",
    "and.b32 %r2, %r3, 255;",
    "setp.ge.u32 %p1, %r2, 7;",
    "@%p1 bra {L};",
    "bra {L};",
    "ld.param.u64 %rd1, [p];",
    "cvt.u64.u32 %rd2, %r1;",
    "add.s64 %rd3, %rd1, %rd2;",
    "bar.sync 0;",
];

/// The kernel names [`deep_ptx`] gives its kernels: `k0`, `k1`, ...
pub fn kernel_name(i: usize) -> String {
    format!("k{i}")
}

/// A PTX module of 1 to 4 kernels (named by [`kernel_name`]), each a body of fuzz-chosen
/// instructions nested in fuzz-chosen depth of `{ }` scopes (each with its own register and
/// label), repeated a fuzz-chosen number of times, at most [`MAX_GENERATED_PTX_BYTES`].
///
/// Layout read from `input`: kernels (u8), then per kernel: depth (u16), repeats (u16),
/// instructions per scope (u8, up to 15) and their picks (one byte each).
pub fn deep_ptx(input: &mut Input<'_>) -> String {
    /// What ends a kernel once its scopes are closed.
    const END: &str = "ret;\n}\n";
    /// What closes one scope.
    const CLOSE: &str = "}\n";
    let kernels = usize::from(input.u8() % 4) + 1;
    let mut out = String::from(PTX_HEADER);
    // Whether `more` bytes fit with `opened` scopes and the kernel still to close.
    let fits = |out: &str, more: usize, opened: usize| {
        out.len() + more + opened * CLOSE.len() + END.len() <= MAX_GENERATED_PTX_BYTES
    };
    for k in 0..kernels {
        let depth = usize::from(input.u16());
        let repeats = usize::from(input.u16()).max(1);
        let picks: Vec<usize> = (0..input.u8() % 16)
            .map(|_| usize::from(input.u8()) % INSTRUCTIONS.len())
            .collect();
        let head = format!(
            ".visible .entry {}(.param .u64 p)\n{{\n\
             .reg .pred %p<2>;\n.reg .b32 %r<4>;\n.reg .b64 %rd<4>;\n",
            kernel_name(k)
        );
        if !fits(&out, head.len(), 0) {
            break;
        }
        out.push_str(&head);
        let mut opened = 0;
        'levels: for level in 0..=depth {
            let label = format!("$L{k}_{level}");
            let scope = if level == 0 {
                format!("{label}:\n")
            } else {
                format!("{{\n.reg .b32 %s{level};\n{label}:\n")
            };
            let opens = usize::from(level > 0);
            if !fits(&out, scope.len(), opened + opens) {
                break;
            }
            out.push_str(&scope);
            opened += opens;
            for _ in 0..if picks.is_empty() { 0 } else { repeats } {
                for &p in &picks {
                    let line = INSTRUCTIONS[p].replace("{L}", &label);
                    if !fits(&out, line.len() + 1, opened) {
                        break 'levels;
                    }
                    out.push_str(&line);
                    out.push('\n');
                }
            }
        }
        out.push_str(&CLOSE.repeat(opened));
        out.push_str(END);
    }
    out
}

/// How a [`fatbin`] entry stores its bytes.
#[derive(Debug, Clone, Copy)]
enum Compression {
    Plain,
    Lz4,
    Zstd,
}

/// A fat binary of 1 to [`MAX_FATBIN_ENTRIES`] entries built from `input`: PTX entries
/// (a [`deep_ptx`] module, or a bomb: a PTX header followed by a fuzz-chosen run of up to
/// [`MAX_BOMB_BYTES`] spaces) stored plain, as an LZ4 block or as a Zstandard frame (a real
/// compressor's for generated PTX; hand-made runs, RLE blocks for Zstandard, for bombs), and
/// ELF entries of fuzz bytes; every entry's declared decompressed size and stored size may
/// lie.
///
/// Layout read from `input`: entries (u8), then per entry: a selector byte (bit 0 ELF, bits
/// 1-2 compression, bit 3 bomb, bits 4-5 how the declared size lies, bit 6 a stored size
/// past the payload), the architecture (u8), then the entry's own bytes (a [`deep_ptx`]
/// layout, a bomb length u32, or an ELF chunk) and the lie (u32) when it needs one.
pub fn fatbin(input: &mut Input<'_>) -> Vec<u8> {
    let entries = input.u8() % MAX_FATBIN_ENTRIES + 1;
    let mut body = Vec::new();
    for _ in 0..entries {
        let sel = input.u8();
        let arch = u32::from(input.u8());
        if sel & 1 != 0 {
            let payload = input.chunk();
            push_entry(
                &mut body,
                KIND_ELF,
                arch,
                0,
                payload,
                payload.len(),
                payload.len(),
            );
            continue;
        }
        let compression = match (sel >> 1) % 4 {
            1 => Compression::Lz4,
            2 | 3 => Compression::Zstd,
            _ => Compression::Plain,
        };
        let (stored, size) = if sel & 8 != 0 {
            let run = input.u32() % (MAX_BOMB_BYTES + 1);
            let run = usize::try_from(run).unwrap_or(usize::MAX);
            let stored = match compression {
                // A plain bomb is as big as it claims: kept to what a message may carry.
                Compression::Plain => {
                    let mut t = PTX_HEADER.as_bytes().to_vec();
                    t.resize(PTX_HEADER.len() + run.min(MAX_GENERATED_PTX_BYTES), b' ');
                    t
                }
                Compression::Lz4 => lz4_run(PTX_HEADER.as_bytes(), b' ', run),
                Compression::Zstd => zstd_run(PTX_HEADER.as_bytes(), b' ', run),
            };
            (stored, PTX_HEADER.len() + run)
        } else {
            let text = deep_ptx(input);
            let stored = match compression {
                Compression::Plain => text.clone().into_bytes(),
                Compression::Lz4 => lz4_flex::block::compress(text.as_bytes()),
                Compression::Zstd => ruzstd::encoding::compress_to_vec(
                    text.as_bytes(),
                    ruzstd::encoding::CompressionLevel::Fastest,
                ),
            };
            (stored, text.len())
        };
        let declared = match (sel >> 4) & 3 {
            0 => size,
            1 => size.saturating_add(usize::from(input.u16())),
            2 => size.saturating_sub(usize::from(input.u16())),
            _ => usize::try_from(input.u32()).unwrap_or(usize::MAX),
        };
        let stored_len = if sel & 0x40 != 0 {
            stored.len().saturating_add(usize::from(input.u8()) + 1)
        } else {
            stored.len()
        };
        let flags = match compression {
            Compression::Plain => 0x11,
            Compression::Lz4 => 0x11 | FLAG_LZ4,
            Compression::Zstd => 0x11 | FLAG_ZSTD,
        };
        push_entry(
            &mut body, KIND_PTX, arch, flags, &stored, stored_len, declared,
        );
    }
    let mut out = FATBIN_MAGIC.to_le_bytes().to_vec();
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Appends one fat-binary entry: its 64-byte header (kind, header size, payload size padded
/// to 8, stored size, architecture, flags, decompressed size) and its payload.
fn push_entry(
    out: &mut Vec<u8>,
    kind: u16,
    arch: u32,
    flags: u64,
    payload: &[u8],
    stored: usize,
    full: usize,
) {
    let padded = payload.len().next_multiple_of(8);
    let mut h = Vec::with_capacity(ENTRY_HEADER_BYTES as usize);
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&0x101u16.to_le_bytes());
    h.extend_from_slice(&ENTRY_HEADER_BYTES.to_le_bytes());
    h.extend_from_slice(&(padded as u64).to_le_bytes());
    h.extend_from_slice(&len_u32(stored).to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&5u16.to_le_bytes());
    h.extend_from_slice(&8u16.to_le_bytes());
    h.extend_from_slice(&arch.to_le_bytes());
    h.extend_from_slice(&[0; 8]);
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&[0; 8]);
    h.extend_from_slice(&(full as u64).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(payload);
    out.resize(out.len() + padded - payload.len(), 0);
}

/// An LZ4 length past its 4-bit token field: 255s, then the rest.
fn lz4_len(out: &mut Vec<u8>, mut n: usize) {
    while n >= 255 {
        out.push(255);
        n -= 255;
    }
    out.push(n as u8);
}

/// An LZ4 block that decompresses to `head`, then `run` bytes of `byte`: the head and one
/// byte as literals, the rest one match at offset 1 (LZ4's best ratio, 255 to 1), then five
/// literal bytes of `byte` as the format's last sequence wants.
fn lz4_run(head: &[u8], byte: u8, run: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(run / 255 + head.len() + 32);
    if run < 1 + 4 + 5 {
        // Too short for a match: all literals.
        let lits = head.len() + run;
        out.push(if lits >= 15 { 0xf0 } else { (lits as u8) << 4 });
        if lits >= 15 {
            lz4_len(&mut out, lits - 15);
        }
        out.extend_from_slice(head);
        out.resize(out.len() + run, byte);
        return out;
    }
    let lits = head.len() + 1;
    let matched = run - 1 - 5;
    let lit_nibble = lits.min(15) as u8;
    let match_nibble = (matched - 4).min(15) as u8;
    out.push(lit_nibble << 4 | match_nibble);
    if lits >= 15 {
        lz4_len(&mut out, lits - 15);
    }
    out.extend_from_slice(head);
    out.push(byte);
    out.extend_from_slice(&1u16.to_le_bytes());
    if matched - 4 >= 15 {
        lz4_len(&mut out, matched - 4 - 15);
    }
    out.push(5 << 4);
    out.extend_from_slice(&[byte; 5]);
    out
}

/// A Zstandard frame (no checksum, no content size, a 1 MiB window) that decompresses to
/// `head` (a raw block), then `run` bytes of `byte` (RLE blocks of at most 128 KiB, four
/// bytes each).
fn zstd_run(head: &[u8], byte: u8, run: usize) -> Vec<u8> {
    const RAW: u32 = 0;
    const RLE: u32 = 1;
    let block = |out: &mut Vec<u8>, kind: u32, size: usize, last: bool| {
        let h = u32::from(last) | kind << 1 | len_u32(size) << 3;
        out.extend_from_slice(&h.to_le_bytes()[..3]);
    };
    let mut out = 0xFD2F_B528u32.to_le_bytes().to_vec();
    // Frame header descriptor (no single segment, checksum, dictionary or content size),
    // then the window descriptor: 2^(10 + 10) bytes.
    out.extend_from_slice(&[0x00, 10 << 3]);
    block(&mut out, RAW, head.len(), run == 0);
    out.extend_from_slice(head);
    let mut left = run;
    while left > 0 {
        let n = left.min(ZSTD_BLOCK_BYTES);
        left -= n;
        block(&mut out, RLE, n, left == 0);
        out.push(byte);
    }
    out
}

#[cfg(test)]
mod tests {
    use mdev_backend::compute::fatbin::extract_ptx;
    use mdev_backend::compute::ptx::Module;

    use super::*;

    /// [`deep_ptx`]'s layout for one kernel.
    fn deep(depth: u16, repeats: u16, picks: &[u8]) -> Vec<u8> {
        let mut v = depth.to_le_bytes().to_vec();
        v.extend_from_slice(&repeats.to_le_bytes());
        v.push(picks.len() as u8);
        v.extend_from_slice(picks);
        v
    }

    #[test]
    fn generated_ptx_parses_with_its_depth_and_names() {
        let mut input = vec![1];
        input.extend(deep(1500, 1, &[0, 1, 5, 6]));
        input.extend(deep(2, 100, &[0, 1, 2, 3, 4, 7, 8, 9, 10, 11]));
        let text = deep_ptx(&mut Input::new(&input));
        assert_eq!(text.matches("{\n.reg .b32 %s").count(), 1502);
        let module = Module::parse(&text).expect("generated PTX parses");
        let names: Vec<&str> = module.kernels().collect();
        assert_eq!(names, [kernel_name(0), kernel_name(1)]);
    }

    #[test]
    fn fatbin_entries_hold_the_generated_ptx() {
        let ptx = deep(40, 3, &[0, 1, 6]);
        let mut input = vec![2];
        for sel in [0x00, 0x02, 0x04] {
            input.extend([sel, 75, 0]);
            input.extend(&ptx);
        }
        let image = fatbin(&mut Input::new(&input));
        let want = deep_ptx(&mut Input::new(&[&[0][..], &ptx].concat()));
        let texts: Vec<String> = extract_ptx(&image)
            .expect("a fat binary")
            .into_iter()
            .map(|p| p.text)
            .collect();
        assert_eq!(texts, [want.clone(), want.clone(), want]);
    }

    #[test]
    fn bombs_decompress_to_what_they_say() {
        let head = PTX_HEADER.as_bytes();
        for run in [0, 3, 9, 10, 300, 200_000] {
            let mut want = head.to_vec();
            want.resize(head.len() + run, b' ');
            let lz4 = lz4_run(head, b' ', run);
            let got = lz4_flex::block::decompress(&lz4, want.len()).expect("LZ4");
            assert_eq!(got, want, "LZ4 run {run}");
            let (mut got, frame) = (Vec::new(), zstd_run(head, b' ', run));
            let mut zstd = ruzstd::decoding::StreamingDecoder::new(&frame[..]).expect("Zstandard");
            std::io::Read::read_to_end(&mut zstd, &mut got).expect("Zstandard");
            assert_eq!(got, want, "Zstandard run {run}");
        }
    }

    #[test]
    fn nested_batches_nest_as_deep_as_asked() {
        // Depth 3, one request (opcode 4, ContextSynchronize of context 1) before the nest.
        let input = [3, 0, 1, 1, 0, 4, 0, 4, 1, 0, 0, 0];
        let msg = nested_batches(&mut Input::new(&input));
        assert_eq!(
            msg.len() - 4,
            u32::from_le_bytes(msg[..4].try_into().unwrap()) as usize
        );
        let batches = msg.windows(2).filter(|w| w == &[29, 0]).count();
        assert_eq!(batches, 4);
        // A depth past what fits is cut to the message limit.
        let msg = nested_batches(&mut Input::new(&[0xff, 0xff, 3, 0, 2, 4, 0, 255]));
        assert!(msg.len() <= MAX_NESTED_MESSAGE_BYTES);
    }

    #[test]
    fn deep_ptx_stays_whole_at_its_limit() {
        let text = deep_ptx(&mut Input::new(&[0, 0xff, 0xff, 0xff, 0xff, 15, 1, 2, 3]));
        assert!(text.len() <= MAX_GENERATED_PTX_BYTES);
        assert_eq!(text.matches('{').count(), text.matches('}').count());
        Module::parse(&text).expect("a text cut at the limit is still whole PTX");
    }
}
