//! Where the CUDA test corpus lies (`qemu-scripts/cuda-corpus.sh` builds it): the tests and
//! benchmarks of several crates look it up here.

use std::path::PathBuf;

/// Names the corpus directory instead of the cache's.
pub const CORPUS_ENV: &str = "VGPU_CUDA_CORPUS";
/// When set (the README's test command sets it), a missing corpus fails the tests.
pub const REQUIRE_ENV: &str = "VGPU_REQUIRE_CUDA_CORPUS";

/// `$VGPU_CUDA_CORPUS`, else `cuda-corpus` in the cache (`$VGPU_CACHE`, else
/// `~/.cache/vgpu`), as the corpus script writes it.
pub fn corpus_dir() -> Option<PathBuf> {
    std::env::var_os(CORPUS_ENV).map(PathBuf::from).or_else(|| {
        let cache = std::env::var_os("VGPU_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/vgpu")))?;
        Some(cache.join("cuda-corpus"))
    })
}

/// For tests: the corpus directory when it holds `program`; otherwise `None` (the test
/// skips, saying so on standard error), or a panic when [`REQUIRE_ENV`] is set.
pub fn corpus_for_tests(program: &str) -> Option<PathBuf> {
    let dir = corpus_dir()?;
    if dir.join(program).exists() {
        return Some(dir);
    }
    assert!(
        std::env::var_os(REQUIRE_ENV).is_none(),
        "no CUDA corpus in {} (run qemu-scripts/cuda-corpus.sh)",
        dir.display()
    );
    eprintln!(
        "skipped: no CUDA corpus in {} (qemu-scripts/cuda-corpus.sh builds it)",
        dir.display()
    );
    None
}

/// The nvcc-built programs of the corpus that run unmodified on the guest driver library
/// (`guest-drivers/libcuda`), with the kernels each launches. Each ends its output with a line
/// starting `PASS`. All but two link cudart 13 statically (nvcc's default); the
/// `.cudart-shared` one loads [`SHARED_CUDART`] next to it, the `.cudart12` one links the
/// static cudart 12.9.
pub const NVCC_PROGRAMS: [(&str, u64); 25] = [
    ("vector_add", 1),
    ("vector_add.compress-none", 1),
    ("vector_add.compress-speed", 1),
    ("vector_add.compress-size", 1),
    ("vector_add.cudart-shared", 1),
    ("vector_add.cudart12", 1),
    ("hello", 1),
    ("device_query", 1),
    ("matmul", 1),
    ("reduce", 1),
    ("scan", 1),
    ("histogram", 1),
    ("streams_events", 2),
    ("bandwidth", 1),
    // Its kernel faults; the program checks that the error is the illegal address.
    ("fault", 1),
    // Texture objects (arrays, pitched, layered) and surface objects, checked against the
    // Programming Guide's texture fetching formulas.
    ("texture", 4),
    ("surface", 2),
    // Graphs captured from two streams and built node by node (changed, cloned, updated),
    // capture misuse refused; stream-ordered allocation, pools and graph allocations.
    ("graphs", 10),
    ("mempool", 4),
    // Physical allocations mapped into reservations (driver entry points through cudart).
    ("vmm", 2),
    // Managed memory and mapped page-locked host memory, coherent at synchronisation points.
    ("managed", 4),
    ("zero_copy", 2),
    // Kernel classes that once gave silent wrong answers (CRC-64, f32 layer norm, a
    // 1024-thread scan, double sin/cos through the carry chain, bit intrinsics).
    ("ptx_classes", 5),
    // Half precision (cuda_fp16.h) scalar and packed, bit for bit against binary16.
    ("half", 1),
    // The device heap sized by cudaDeviceSetLimit before first use, malloc/free, new/delete.
    ("heap", 2),
];

/// The shared CUDA runtime in the corpus (from NVIDIA's wheel, never committed).
pub const SHARED_CUDART: &str = "libcudart.so.13";

/// The corpus program the guest library does not run, and the line it must end with: `spin`
/// polls mapped pinned host memory while its kernel runs, waiting for the host to write it;
/// behind a VM the device sees mapped memory only at synchronisation points, so the kernel runs
/// into the request's deadline and the program reports that error (docs/CUDA-GUEST.md).
pub const NVCC_REFUSED: (&str, &str) = ("spin", "FAIL cudaStreamQuery");
