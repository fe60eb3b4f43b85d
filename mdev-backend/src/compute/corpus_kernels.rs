//! The launches of the nvcc corpus's kernels (`tests/cuda/*.cu`, built by
//! `qemu-scripts/cuda-corpus.sh`) as data: for each, the program whose PTX holds it, the grid
//! and block its program launches it with, and its buffers filled as that program's `main`
//! fills them. The differential test of the PTX engines (`tests/ptx_differential.rs`) and their
//! benchmark (`benches/ptx_engines.rs`) run them on [`DeviceMemory`] through
//! [`ptx::launch`](super::ptx::launch), with either [`Engine`].
//!
//! Texture and surface objects are descriptors in device memory, laid out as the guest
//! driver lays out arrays (rows of texels, no padding) and pitched memory (rows aligned to 32
//! bytes). Left out: `spin` (it waits for the host to write mapped memory).

use std::path::Path;
use std::sync::Arc;

use log::debug;
use thiserror::Error;

use super::backend::pack_params;
use super::fatbin::extract_ptx;
use super::ptx::texture::{
    AddressMode, DESCRIPTOR_BYTES, Descriptor, FLAG_LAYERED, FLAG_LINEAR, FLAG_NORMALIZED,
    FLAG_READ_NORMALIZED, Format, Mip,
};
use super::ptx::{self, Engine, Launch, LaunchStats, Module};
use super::{ComputeError, DeviceMemory, Fault, GlobalMemory};
use crate::budget::MemoryBudget;

/// Device memory one setup may allocate: the largest (`bandwidth`'s two 64 MiB vectors) with
/// room for the module's variables.
pub const MAX_SETUP_BYTES: u64 = 192 << 20;

/// Cost units one launch may spend: far above the largest corpus kernel's (`reduce`, `bandwidth`:
/// tens of millions), so only a runaway kernel reaches it.
pub const INSTRUCTION_BUDGET: u64 = 1 << 36;

/// What can go wrong setting up or running a corpus kernel.
#[derive(Debug, Error)]
pub enum CorpusKernelError {
    #[error("reading corpus program {0}: {1}")]
    Read(String, std::io::Error),
    #[error("corpus program {0} holds no PTX")]
    NoPtx(String),
    #[error("corpus program {program}: {count} kernels named {kernel} (expected one)")]
    Kernel {
        program: String,
        kernel: String,
        count: usize,
    },
    #[error("kernel {kernel}: {args} arguments for {params} parameters")]
    Arity {
        kernel: String,
        args: usize,
        params: usize,
    },
    #[error("kernel {0}: argument names buffer {1}, which it does not have")]
    NoBuffer(String, usize),
    #[error("setup of more than {MAX_SETUP_BYTES} bytes of device memory")]
    TooLarge,
    #[error("device memory: {0}")]
    Fault(#[from] Fault),
    #[error(transparent)]
    Compute(#[from] ComputeError),
}

pub type Result<T> = std::result::Result<T, CorpusKernelError>;

/// One kernel parameter's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// The device address of the setup's buffer with this index.
    Buffer(usize),
    /// An integer (`int`), packed in the parameter's size.
    Int(i64),
    /// A `float`.
    F32(f32),
    /// A texture or surface object over the setup's buffer `resource`: `descriptor` (its
    /// `base` set to that buffer's address) written to device memory, the handle its address.
    Object {
        resource: usize,
        descriptor: Descriptor,
    },
}

/// One launch of a corpus program, as its `main` makes it.
#[derive(Debug, Clone, Copy)]
pub struct CorpusKernel {
    /// The corpus program (file name in the corpus directory).
    pub program: &'static str,
    /// The kernel's source name (its PTX name is the one mangled name starting with it).
    pub kernel: &'static str,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dynamic_shared_bytes: u32,
    /// The initial contents of its buffers.
    pub buffers: fn() -> Vec<Vec<u8>>,
    pub args: &'static [Arg],
    /// Whether the launch must fail (with the same error on both engines).
    pub faults: bool,
}

impl CorpusKernel {
    /// `program/kernel`, naming it in test and benchmark output.
    pub fn name(&self) -> String {
        format!("{}/{}", self.program, self.kernel)
    }
}

const fn plain(
    program: &'static str,
    kernel: &'static str,
    grid: u32,
    block: u32,
    buffers: fn() -> Vec<Vec<u8>>,
    args: &'static [Arg],
) -> CorpusKernel {
    CorpusKernel {
        program,
        kernel,
        grid: [grid, 1, 1],
        block: [block, 1, 1],
        dynamic_shared_bytes: 0,
        buffers,
        args,
        faults: false,
    }
}

use Arg::{Buffer as B, F32, Int};

/// Every kernel the corpus programs launch but `spin`, with its first launch's data.
pub const KERNELS: [CorpusKernel; 29] = [
    plain(
        "vector_add",
        "vecAdd",
        100_000usize.div_ceil(256) as u32,
        256,
        vector_add,
        &[B(0), B(1), B(2), Int(100_000)],
    ),
    CorpusKernel {
        grid: [MATMUL_N / 16, MATMUL_N / 16, 1],
        block: [16, 16, 1],
        ..plain(
            "matmul",
            "matmul",
            0,
            0,
            matmul,
            &[B(0), B(1), B(2), Int(MATMUL_N as i64)],
        )
    },
    plain(
        "reduce",
        "reduceSum",
        REDUCE_N / 256,
        256,
        reduce,
        &[B(0), B(1), Int(REDUCE_N as i64)],
    ),
    plain(
        "scan",
        "scanBlocks",
        SCAN_N.div_ceil(256),
        256,
        scan,
        &[B(0), B(1), Int(SCAN_N as i64)],
    ),
    plain(
        "histogram",
        "histogram",
        64,
        256,
        histogram,
        &[B(0), B(1), Int(HISTOGRAM_N as i64)],
    ),
    plain("hello", "hello", 2, 32, no_buffers, &[Int(2)]),
    plain(
        "streams_events",
        "scale",
        STREAMS_N / 2 / 256,
        256,
        ramp_f32::<STREAMS_N>,
        &[B(0), F32(2.0), Int(STREAMS_N as i64 / 2)],
    ),
    plain(
        "bandwidth",
        "copyVec4",
        1024,
        256,
        bandwidth,
        &[B(0), B(1), Int(BANDWIDTH_N as i64)],
    ),
    plain("device_query", "query", 3, 64, zeros::<16>, &[B(0)]),
    CorpusKernel {
        faults: true,
        ..plain("fault", "oob", 1, 32, zeros::<256>, &[B(0)])
    },
    plain(
        "graphs",
        "scale",
        GRAPHS_N / 2 / 128,
        128,
        ramp_f32::<GRAPHS_N>,
        &[B(0), F32(2.0), Int(GRAPHS_N as i64 / 2)],
    ),
    plain(
        "graphs",
        "add",
        GRAPHS_N / 2 / 128,
        128,
        graphs_second_half,
        &[B(0), F32(5.0), Int(GRAPHS_N as i64 / 2)],
    ),
    plain(
        "managed",
        "affine",
        MANAGED_N.div_ceil(256),
        256,
        managed,
        &[B(0), Int(3), Int(1), Int(MANAGED_N as i64)],
    ),
    plain(
        "mempool",
        "fill",
        MEMPOOL_N / 128,
        128,
        zeros::<{ MEMPOOL_N as usize * 4 }>,
        &[B(0), Int(7), Int(MEMPOOL_N as i64)],
    ),
    plain(
        "vmm",
        "ramp",
        VMM_N / 128,
        128,
        zeros::<{ VMM_N as usize * 4 }>,
        &[B(0), Int(100), Int(VMM_N as i64)],
    ),
    plain(
        "vmm",
        "twice",
        VMM_N / 2 / 128,
        128,
        vmm_moved,
        &[B(0), Int(VMM_N as i64 / 2)],
    ),
    plain(
        "zero_copy",
        "saxpy",
        ZERO_COPY_N.div_ceil(256),
        256,
        zero_copy,
        &[B(0), B(1), F32(2.0), Int(ZERO_COPY_N as i64)],
    ),
    plain(
        "ptx_classes",
        "crc64",
        CRC_CHUNKS / 64,
        64,
        crc64,
        &[B(0), B(1), Int(CRC_CHUNKS as i64)],
    ),
    plain(
        "ptx_classes",
        "layer_norm",
        LN_ROWS,
        256,
        layer_norm,
        &[B(0), B(1), B(2), B(3)],
    ),
    plain("ptx_classes", "scan1024", 1, 1024, scan1024, &[B(0), B(1)]),
    plain(
        "ptx_classes",
        "trig",
        1,
        TRIG_N,
        trig,
        &[B(0), B(1), B(2), Int(TRIG_N as i64)],
    ),
    plain(
        "ptx_classes",
        "bit_ops",
        2,
        64,
        bit_ops,
        &[B(0), B(1), B(2), Int(BIT_OPS_N as i64)],
    ),
    plain(
        "texture",
        "fetch_float",
        1,
        TEX_N,
        texture_float,
        &[
            Arg::Object {
                resource: 0,
                descriptor: tex_descriptor(Format::F32, 1, FLAG_LINEAR, AddressMode::Clamp, 1),
            },
            B(1),
            B(2),
        ],
    ),
    plain(
        "texture",
        "fetch_uchar4",
        1,
        TEX_N,
        texture_uchar4,
        &[
            Arg::Object {
                resource: 0,
                descriptor: tex_descriptor(
                    Format::U8,
                    4,
                    FLAG_NORMALIZED | FLAG_READ_NORMALIZED,
                    AddressMode::Wrap,
                    1,
                ),
            },
            B(1),
            B(2),
        ],
    ),
    plain(
        "texture",
        "fetch_int",
        1,
        TEX_N,
        texture_int,
        &[
            Arg::Object {
                resource: 0,
                descriptor: tex_descriptor(Format::S32, 1, 0, AddressMode::Border, 1),
            },
            B(1),
            B(2),
        ],
    ),
    plain(
        "texture",
        "fetch_layered",
        1,
        TEX_N,
        texture_layered,
        &[
            Arg::Object {
                resource: 0,
                descriptor: tex_descriptor(Format::F32, 1, FLAG_LAYERED, AddressMode::Clamp, 3),
            },
            B(1),
            B(2),
        ],
    ),
    CorpusKernel {
        grid: [2, SURF_H, 1],
        ..plain(
            "surface",
            "paint",
            0,
            32,
            zeros::<{ (SURF_W * SURF_H) as usize * 4 }>,
            &[SURFACE],
        )
    },
    plain(
        "surface",
        "probe",
        SURF_H + 2,
        SURF_W + 8,
        surface_painted,
        &[SURFACE, B(1)],
    ),
    plain(
        "half",
        "halves",
        HALF_N.div_ceil(128),
        128,
        half,
        &[B(0), B(1), B(2), B(3), B(4), Int(HALF_N as i64)],
    ),
];

const MATMUL_N: u32 = 128;
const REDUCE_N: u32 = 1 << 20;
const SCAN_N: u32 = 5000;
const HISTOGRAM_N: u32 = 1 << 18;
const STREAMS_N: u32 = 1 << 16;
const BANDWIDTH_N: u32 = 1 << 22;
const GRAPHS_N: u32 = 4096;
const MANAGED_N: u32 = 100_000;
const MEMPOOL_N: u32 = 2048;
const VMM_N: u32 = 4096;
const ZERO_COPY_N: u32 = 50_000;
const CRC_CHUNKS: u32 = 256;
const CRC_BYTES: u32 = 64;
const LN_ROWS: u32 = 4;
const LN_ROW: u32 = 1024;
const TRIG_N: u32 = 64;
const BIT_OPS_N: u32 = 128;
/// `half.cu`'s edge values, whose pairs come first.
const HALF_EDGES: [u16; 21] = [
    0x0000, 0x8000, 0x3c00, 0xbc00, 0x3c01, 0x3bff, 0x4200, 0x2e66, 0x0001, 0x8001, 0x03ff, 0x0400,
    0x8400, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00, 0x6bff, 0x1400, 0x5bff,
];
const HALF_N: u32 = 21 * 21 + 4096;
/// `texture.cu`'s image and its fetches.
const TEX_W: u32 = 24;
const TEX_H: u32 = 10;
const TEX_N: u32 = 64;
/// Row alignment of pitched memory (the guest driver's `cudaMallocPitch`).
const PITCH_ALIGN: u32 = 32;
/// Bytes of a row of each `texture.cu` resource: `TEX_W` texels of 4 bytes, tightly packed in
/// its arrays and, being a multiple of [`PITCH_ALIGN`], also the pitch of its pitched one.
const TEX_ROW: u32 = TEX_W * 4;
const _: () = assert!(TEX_ROW % PITCH_ALIGN == 0);
/// `surface.cu`'s array.
const SURF_W: u32 = 40;
const SURF_H: u32 = 12;

/// A texture over a `TEX_W` x `TEX_H` (x `layers`) resource of `TEX_ROW`-byte rows.
const fn tex_descriptor(
    format: Format,
    channels: u32,
    flags: u8,
    mode: AddressMode,
    layers: u32,
) -> Descriptor {
    Descriptor {
        surface: false,
        format,
        channels,
        flags,
        address: [mode; 3],
        extent: [TEX_W, TEX_H, layers],
        base: 0,
        pitch: TEX_ROW as u64,
        slice: (TEX_ROW * TEX_H) as u64,
        border: [0.0; 4],
        mip: Mip::NONE,
    }
}

/// `surface.cu`'s surface: a `SURF_W` x `SURF_H` array of floats.
const SURFACE: Arg = Arg::Object {
    resource: 0,
    descriptor: Descriptor {
        surface: true,
        format: Format::F32,
        channels: 1,
        flags: 0,
        address: [AddressMode::Clamp; 3],
        extent: [SURF_W, SURF_H, 1],
        base: 0,
        pitch: SURF_W as u64 * 4,
        slice: (SURF_W * SURF_H) as u64 * 4,
        border: [0.0; 4],
        mip: Mip::NONE,
    },
};
/// Results `halves` writes per element.
const HALF_RESULTS: usize = 19;

fn bytes<T: Copy, const N: usize>(v: impl IntoIterator<Item = T>, to: fn(T) -> [u8; N]) -> Vec<u8> {
    v.into_iter().flat_map(to).collect()
}

fn f32s(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    bytes(v, f32::to_le_bytes)
}

fn i32s(v: impl IntoIterator<Item = i32>) -> Vec<u8> {
    bytes(v, i32::to_le_bytes)
}

fn u32s(v: impl IntoIterator<Item = u32>) -> Vec<u8> {
    bytes(v, u32::to_le_bytes)
}

fn no_buffers() -> Vec<Vec<u8>> {
    Vec::new()
}

fn zeros<const N: usize>() -> Vec<Vec<u8>> {
    vec![vec![0; N]]
}

/// `x[i] = i` as floats (`streams_events`, `graphs`).
fn ramp_f32<const N: u32>() -> Vec<Vec<u8>> {
    vec![f32s((0..N).map(|i| i as f32))]
}

/// The second half of `graphs`' vector, which `add` is launched on: `x[i] = n/2 + i`.
fn graphs_second_half() -> Vec<Vec<u8>> {
    vec![f32s((GRAPHS_N / 2..GRAPHS_N).map(|i| i as f32))]
}

fn vector_add() -> Vec<Vec<u8>> {
    let n = 100_000u32;
    vec![
        f32s((0..n).map(|i| i as f32 * 0.5)),
        f32s((0..n).map(|i| 1.0 / (i + 1) as f32)),
        vec![0; n as usize * 4],
    ]
}

fn matmul() -> Vec<Vec<u8>> {
    let n = MATMUL_N * MATMUL_N;
    vec![
        f32s((0..n).map(|i| (i * 7 % 13) as f32 - 6.0)),
        f32s((0..n).map(|i| (i * 5 % 11) as f32 * 0.25)),
        vec![0; n as usize * 4],
    ]
}

fn reduce() -> Vec<Vec<u8>> {
    vec![
        u32s((0..REDUCE_N).map(|i| i.wrapping_mul(2_654_435_761) >> 20)),
        vec![0; 4],
    ]
}

fn scan() -> Vec<Vec<u8>> {
    vec![
        i32s((0..SCAN_N as i32).map(|i| (i * 37) % 101 - 50)),
        vec![0; SCAN_N as usize * 4],
    ]
}

fn histogram() -> Vec<Vec<u8>> {
    vec![
        (0..HISTOGRAM_N)
            .map(|i| (i.wrapping_mul(i).wrapping_add(7 * i) & 0xff) as u8)
            .collect(),
        vec![0; 1024],
    ]
}

fn bandwidth() -> Vec<Vec<u8>> {
    let bytes = BANDWIDTH_N as usize * 16;
    vec![vec![0x3f; bytes], vec![0; bytes]]
}

fn managed() -> Vec<Vec<u8>> {
    vec![i32s((0..MANAGED_N as i32).map(|i| i % 1000))]
}

/// What `ramp` left in the mapping `twice` then reads: `100 + n/2 + i`.
fn vmm_moved() -> Vec<Vec<u8>> {
    let half = VMM_N as i32 / 2;
    vec![i32s((0..half).map(|i| 100 + half + i))]
}

fn zero_copy() -> Vec<Vec<u8>> {
    vec![
        f32s((0..ZERO_COPY_N).map(|i| i as f32 * 0.5)),
        f32s((0..ZERO_COPY_N).map(|_| 1.0)),
    ]
}

/// `texture.cu`'s fetch coordinates.
fn texture_at() -> Vec<(f32, f32)> {
    (0..TEX_N)
        .map(|i| (-3.0 + i as f32 * 0.4791, -1.5 + (i % 13) as f32 * 0.9137))
        .collect()
}

fn float2s(v: impl IntoIterator<Item = (f32, f32)>) -> Vec<u8> {
    f32s(v.into_iter().flat_map(|(x, y)| [x, y]))
}

/// A fetch kernel's buffers: the resource, the coordinates and the output (`float4`s).
fn fetches(resource: Vec<u8>, at: Vec<(f32, f32)>) -> Vec<Vec<u8>> {
    vec![resource, float2s(at), vec![0; TEX_N as usize * 16]]
}

fn texture_float() -> Vec<Vec<u8>> {
    let img = (0..TEX_W * TEX_H).map(|i| ((i * 37) % 101) as f32 * 0.75 - 20.0);
    fetches(f32s(img), texture_at())
}

fn texture_uchar4() -> Vec<Vec<u8>> {
    let px = (0..TEX_W * TEX_H)
        .flat_map(|i| [i & 255, (i * 3) & 255, 255 - (i & 255), (i * 7) & 255].map(|c| c as u8));
    let at = texture_at()
        .into_iter()
        .map(|(x, y)| (x / TEX_W as f32 * 3.0, y / TEX_H as f32 * 2.0))
        .collect();
    fetches(px.collect(), at)
}

fn texture_int() -> Vec<Vec<u8>> {
    let ints = (0..(TEX_W * TEX_H) as i32).map(|i| i * 1000 - 7);
    fetches(i32s(ints), texture_at())
}

fn texture_layered() -> Vec<Vec<u8>> {
    fetches(f32s((0..3 * TEX_W * TEX_H).map(|i| i as f32)), texture_at())
}

/// What `paint` leaves in the surface (`x * 0.5 + y * 100`), and `probe`'s output.
fn surface_painted() -> Vec<Vec<u8>> {
    let values =
        (0..SURF_H).flat_map(|y| (0..SURF_W).map(move |x| x as f32 * 0.5 + y as f32 * 100.0));
    vec![
        f32s(values),
        vec![0; ((SURF_W + 8) * (SURF_H + 2) * 2) as usize * 4],
    ]
}

/// `ptx_classes.cu`'s generator: `seed = seed * 1103515245 + 12345`.
fn classes_next(seed: &mut u32) -> u32 {
    *seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
    *seed
}

/// The CRC input bytes, and the generator's state after them (where `bit_ops`'s data starts).
fn crc_bytes() -> (Vec<u8>, u32) {
    let mut seed = 12345;
    let data = (0..CRC_CHUNKS * CRC_BYTES)
        .map(|_| (classes_next(&mut seed) >> 16) as u8)
        .collect();
    (data, seed)
}

fn crc64() -> Vec<Vec<u8>> {
    vec![crc_bytes().0, vec![0; CRC_CHUNKS as usize * 8]]
}

fn layer_norm() -> Vec<Vec<u8>> {
    vec![
        f32s(
            (0..LN_ROWS * LN_ROW)
                .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 3.0 + (i / LN_ROW) as f32),
        ),
        f32s((0..LN_ROW).map(|i| 0.5 + (i % 7) as f32 * 0.25)),
        f32s((0..LN_ROW).map(|i| (i % 5) as f32 * 0.1 - 0.2)),
        vec![0; (LN_ROWS * LN_ROW) as usize * 4],
    ]
}

fn scan1024() -> Vec<Vec<u8>> {
    vec![
        i32s((0..1024).map(|i| (i * 37) % 101 - 50)),
        vec![0; 1024 * 4],
    ]
}

fn trig() -> Vec<Vec<u8>> {
    let x = (0..TRIG_N).map(|i| {
        let big = if i % 2 == 1 { 1e6 } else { 0.37 };
        let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
        big * f64::from(i + 1) * sign
    });
    let zeros = vec![0; TRIG_N as usize * 8];
    vec![bytes(x, f64::to_le_bytes), zeros.clone(), zeros]
}

fn bit_ops() -> Vec<Vec<u8>> {
    let mut seed = crc_bytes().1;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..BIT_OPS_N {
        a.push(classes_next(&mut seed));
        b.push(classes_next(&mut seed));
    }
    (a[0], b[0], a[1], b[1]) = (0, 0, !0, 32);
    vec![u32s(a), u32s(b), vec![0; BIT_OPS_N as usize * 64]]
}

/// `half.cu`'s operands, its generator's calls taken left to right.
fn half() -> Vec<Vec<u8>> {
    let mut seed = 12345u32;
    let mut next = || {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        seed
    };
    let ne = HALF_EDGES.len();
    let (mut a, mut b, mut f, mut k) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..HALF_N as usize {
        if i < ne * ne {
            a.push(HALF_EDGES[i / ne]);
            b.push(HALF_EDGES[i % ne]);
        } else {
            for v in [&mut a, &mut b] {
                let mantissa = next() & 0x83ff;
                v.push((mantissa | ((6 + next() % 20) << 10)) as u16);
            }
        }
        let low = next() & 0x807f_ffff;
        let mut bits = low | ((0x60 + next() % 48) << 23);
        if i % 97 == 0 {
            bits = 0x477f_f000 + (i as u32 & 0xfff);
        }
        f.push(bits);
        let value = next() as i32;
        k.push(value >> (next() % 24));
    }
    vec![
        bytes(a, u16::to_le_bytes),
        bytes(b, u16::to_le_bytes),
        u32s(f),
        i32s(k),
        vec![0; HALF_N as usize * HALF_RESULTS * 4],
    ]
}

/// The PTX of a corpus program: its first image's text.
pub fn program_ptx(dir: &Path, program: &str) -> Result<String> {
    let image = std::fs::read(dir.join(program))
        .map_err(|e| CorpusKernelError::Read(program.to_string(), e))?;
    extract_ptx(&image)?
        .into_iter()
        .next()
        .map(|p| p.text)
        .ok_or_else(|| CorpusKernelError::NoPtx(program.to_string()))
}

/// The mangled PTX name of `kernel`: the one kernel of `module` whose name is `_Z`, the
/// source name's length and the source name, then its parameter types.
pub fn ptx_name<'m>(module: &'m Module, program: &str, kernel: &str) -> Result<&'m str> {
    let prefix = format!("_Z{}{kernel}", kernel.len());
    let found: Vec<&str> = module
        .kernels()
        .filter(|k| k.starts_with(&prefix))
        .collect();
    match found[..] {
        [one] => Ok(one),
        _ => Err(CorpusKernelError::Kernel {
            program: program.to_string(),
            kernel: kernel.to_string(),
            count: found.len(),
        }),
    }
}

/// A kernel's launch made ready: its buffers and the module's variables in device memory,
/// the packed parameters.
#[derive(Debug)]
pub struct Setup {
    pub kernel: CorpusKernel,
    /// The kernel's PTX name.
    pub ptx_name: String,
    pub memory: DeviceMemory,
    /// Device address and length of each buffer.
    pub buffers: Vec<(u64, u64)>,
    pub params: Vec<u8>,
    /// Device address of each module variable, in [`Module::globals`] order.
    pub symbols: Vec<u64>,
}

/// What one run of a setup left: its buffers' bytes, its printf output and the launch's
/// statistics, or the launch's error.
#[derive(Debug)]
pub struct Outcome {
    pub result: std::result::Result<LaunchStats, ComputeError>,
    pub buffers: Vec<Vec<u8>>,
}

/// Allocates and fills `kernel`'s buffers and `module`'s variables (initialisers with the
/// addresses they name) in a fresh [`DeviceMemory`] and packs the parameters.
pub fn setup(module: &Module, kernel: &CorpusKernel) -> Result<Setup> {
    let name = ptx_name(module, kernel.program, kernel.kernel)?;
    let info = module
        .kernel(name)
        .ok_or_else(|| CorpusKernelError::Kernel {
            program: kernel.program.to_string(),
            kernel: kernel.kernel.to_string(),
            count: 0,
        })?;
    if info.params.len() != kernel.args.len() {
        return Err(CorpusKernelError::Arity {
            kernel: name.to_string(),
            args: kernel.args.len(),
            params: info.params.len(),
        });
    }
    let contents = (kernel.buffers)();
    let globals = module.globals();
    let total = contents
        .iter()
        .map(|b| b.len() as u64)
        .chain(globals.iter().map(|g| g.size))
        .try_fold(0u64, u64::checked_add)
        .filter(|&t| t <= MAX_SETUP_BYTES)
        .ok_or(CorpusKernelError::TooLarge)?;
    debug!("{}: {total} bytes of device memory", kernel.name());
    let mut memory = DeviceMemory::new(MAX_SETUP_BYTES);
    let mut buffers = Vec::with_capacity(contents.len());
    for c in &contents {
        let addr = memory.alloc(c.len() as u64)?;
        memory.write(addr, c)?;
        buffers.push((addr, c.len() as u64));
    }
    let symbols = globals
        .iter()
        .map(|g| memory.alloc(g.size.max(1)))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    for (g, &addr) in globals.iter().zip(&symbols) {
        let mut init = g.init.clone();
        for &(offset, target) in &g.relocs {
            let at = offset as usize;
            let address = symbols.get(target as usize);
            let slot = at.checked_add(8).and_then(|end| init.get_mut(at..end));
            let (Some(address), Some(slot)) = (address, slot) else {
                return Err(ComputeError::InvalidPtx(format!(
                    "variable {}: relocation at {offset} to variable {target}",
                    g.name
                ))
                .into());
            };
            slot.copy_from_slice(&address.to_le_bytes());
        }
        memory.write(addr, &init)?;
    }
    let args = kernel
        .args
        .iter()
        .map(|a| match *a {
            Arg::Buffer(i) => buffers
                .get(i)
                .map(|b| b.0)
                .ok_or_else(|| CorpusKernelError::NoBuffer(name.to_string(), i)),
            Arg::Int(v) => Ok(v as u64),
            Arg::F32(v) => Ok(u64::from(v.to_bits())),
            Arg::Object {
                resource,
                descriptor,
            } => {
                let base = buffers
                    .get(resource)
                    .ok_or_else(|| CorpusKernelError::NoBuffer(name.to_string(), resource))?
                    .0;
                let d = Descriptor { base, ..descriptor };
                d.validate().map_err(|e| {
                    ComputeError::InvalidValue(format!("{}: descriptor: {e}", kernel.name()))
                })?;
                let at = memory.alloc(DESCRIPTOR_BYTES as u64)?;
                memory.write(at, &d.encode())?;
                Ok(at)
            }
        })
        .collect::<Result<Vec<u64>>>()?;
    Ok(Setup {
        kernel: *kernel,
        ptx_name: name.to_string(),
        memory,
        buffers,
        params: pack_params(&info.params, &args),
        symbols,
    })
}

/// Launches a setup's kernel with `engine` on `threads` host threads. Its buffers keep what
/// the kernel wrote, so a second run starts from them.
pub fn launch_setup(
    module: &Module,
    setup: &Setup,
    engine: Engine,
    threads: usize,
) -> std::result::Result<LaunchStats, ComputeError> {
    let budget: Arc<MemoryBudget> = MemoryBudget::new(u64::MAX);
    let l = Launch {
        grid: setup.kernel.grid,
        block: setup.kernel.block,
        dynamic_shared_bytes: setup.kernel.dynamic_shared_bytes,
        params: &setup.params,
        symbols: &setup.symbols,
        heap: None,
        interrupt: None,
        instruction_budget: INSTRUCTION_BUDGET,
        threads,
        budget: &budget,
        engine,
        cooperative: None,
    };
    ptx::launch(
        module,
        &setup.ptx_name,
        &l,
        &setup.memory as &dyn GlobalMemory,
    )
}

/// Sets `kernel` up afresh and runs it once with `engine` on `threads` host threads: its
/// buffers' bytes afterwards, its printf output and statistics (or its error).
pub fn run(
    module: &Module,
    kernel: &CorpusKernel,
    engine: Engine,
    threads: usize,
) -> Result<Outcome> {
    let s = setup(module, kernel)?;
    let result = launch_setup(module, &s, engine, threads);
    let buffers = s
        .buffers
        .iter()
        .map(|&(addr, len)| {
            let mut b = vec![0; len as usize];
            s.memory.read(addr, &mut b).map(|()| b)
        })
        .collect::<std::result::Result<Vec<_>, Fault>>()?;
    Ok(Outcome { result, buffers })
}
