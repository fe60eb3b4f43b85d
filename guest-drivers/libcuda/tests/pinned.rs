//! Page-locked memory on the host socket through the C entry points, as cudart calls them:
//! `cuMemAllocHost` and `cuMemHostAlloc` give memory shared with the host, which copies to and
//! from it itself (sync, and in order on a stream), charged to the connection's budget until
//! `cuMemFreeHost`, refused past it with `CUDA_ERROR_OUT_OF_MEMORY`; mapped page-locked memory
//! keeps its device pointer. One test (the driver is process-global).

use std::ffi::{c_int, c_uint, c_void};
use std::os::unix::net::UnixListener;
use std::ptr::null_mut;
use std::sync::Arc;

use mdev_backend::budget::MemoryBudget;
use mdev_backend::compute::remote::{Limits, serve};
use mdev_backend::compute::{CpuBackend, CpuConfig};

// The entry points are this crate's `#[no_mangle]` functions: link it.
extern crate cuda;

type Handle = *mut c_void;

unsafe extern "C" {
    fn cuInit(flags: c_uint) -> c_uint;
    fn cuCtxCreate_v2(ctx: *mut Handle, flags: c_uint, dev: c_int) -> c_uint;
    fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> c_uint;
    fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> c_uint;
    fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, flags: c_uint) -> c_uint;
    fn cuMemFreeHost(p: *mut c_void) -> c_uint;
    fn cuMemHostGetFlags(flags: *mut c_uint, p: *mut c_void) -> c_uint;
    fn cuMemHostGetDevicePointer_v2(dptr: *mut u64, p: *mut c_void, flags: c_uint) -> c_uint;
    fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> c_uint;
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> c_uint;
    fn cuMemcpyHtoDAsync_v2(dst: u64, src: *const c_void, n: usize, s: Handle) -> c_uint;
    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: u64, n: usize, s: Handle) -> c_uint;
    fn cuStreamCreate(s: *mut Handle, flags: c_uint) -> c_uint;
    fn cuStreamSynchronize(s: Handle) -> c_uint;
}

/// The connection's budget: room for the test's allocations, not for [`TOO_MUCH`].
const BUDGET: u64 = 256 << 20;
const TOO_MUCH: usize = 300 << 20;
/// `CU_MEMHOSTALLOC_PORTABLE`, `CU_MEMHOSTALLOC_DEVICEMAP`.
const PORTABLE: c_uint = 1;
const DEVICEMAP: c_uint = 2;
const CUDA_ERROR_OUT_OF_MEMORY: c_uint = 2;

/// Serves a CPU backend charged to a budget of [`BUDGET`] at a fresh socket and points the
/// library at it: the budget.
fn serve_budgeted() -> Arc<MemoryBudget> {
    let dir = std::env::temp_dir().join(format!("vgpu-libcuda-pinned-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("host.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let budget = MemoryBudget::new(BUDGET);
    let config = CpuConfig {
        budget: Arc::clone(&budget),
        ..CpuConfig::default()
    };
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let limits = Limits::new(&config.budget);
        let mut be = CpuBackend::new(config);
        let _ = serve(&mut s, &mut be, &limits);
    });
    // SAFETY: the test's own environment, set before the driver reads it (at cuInit).
    unsafe { std::env::set_var("VGPU_CUDA_SOCKET", &socket) };
    budget
}

/// The file mapped at `addr` in this process (`/proc/self/maps`), if any.
fn mapping_of(addr: u64) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|l| {
        let (range, rest) = l.split_once(' ')?;
        let (start, end) = range.split_once('-')?;
        let (start, end) = (
            u64::from_str_radix(start, 16).ok()?,
            u64::from_str_radix(end, 16).ok()?,
        );
        (start <= addr && addr < end)
            .then(|| rest.split_whitespace().nth(4).unwrap_or("").to_string())
    })
}

#[test]
fn pinned_memory_is_shared_with_the_host_and_copied_in_place() {
    let budget = serve_budgeted();
    // SAFETY: the driver's C entry points, called as a C program calls them, with live
    // out-pointers; each page-locked allocation is read and written within its size, and
    // only when no copy into or out of it is in flight (after the copy or the stream's
    // synchronisation).
    unsafe {
        assert_eq!(cuInit(0), 0);
        let mut ctx = null_mut();
        assert_eq!(cuCtxCreate_v2(&mut ctx, 0, 0), 0);
        let mut stream = null_mut();
        assert_eq!(cuStreamCreate(&mut stream, 0), 0);
        let largest = (3 << 20) + 777;
        let mut buf = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut buf, largest), 0);
        let idle = budget.used();
        for round in 0..2u8 {
            for n in [1, 4095, 4096, 100_003, 1 << 20, largest] {
                let (mut up, mut down) = (null_mut(), null_mut());
                assert_eq!(cuMemAllocHost_v2(&mut up, n), 0);
                assert_eq!(cuMemHostAlloc(&mut down, n, PORTABLE), 0);
                assert!(budget.used() >= idle + 2 * n as u64, "{n}: charged");
                // Memory files the host maps too.
                for p in [up, down] {
                    let file = mapping_of(p as u64).unwrap_or_default();
                    assert!(file.starts_with("/memfd:vgpu-cuda-shared"), "{file}");
                }
                let mut flags = 9;
                assert_eq!(cuMemHostGetFlags(&mut flags, down), 0);
                assert_eq!(flags, PORTABLE);
                let up_bytes = std::slice::from_raw_parts_mut(up.cast::<u8>(), n);
                let down_bytes = std::slice::from_raw_parts_mut(down.cast::<u8>(), n);
                // Synchronous copies.
                for (i, b) in up_bytes.iter_mut().enumerate() {
                    *b = (i % 251) as u8 ^ round;
                }
                let want = up_bytes.to_vec();
                assert_eq!(cuMemcpyHtoD_v2(buf, up, n), 0);
                // The source is the program's again once the copy returns.
                up_bytes.fill(0);
                assert_eq!(cuMemcpyDtoH_v2(down, buf, n), 0);
                assert!(*down_bytes == want[..], "{n} bytes, synchronous");
                // On a stream: the results are there at its synchronisation.
                for (i, b) in up_bytes.iter_mut().enumerate() {
                    *b = (i % 241) as u8 ^ !round;
                }
                let want = up_bytes.to_vec();
                assert_eq!(cuMemcpyHtoDAsync_v2(buf, up, n, stream), 0);
                assert_eq!(cuMemcpyDtoHAsync_v2(down, buf, n, stream), 0);
                assert_eq!(cuStreamSynchronize(stream), 0);
                assert!(*down_bytes == want[..], "{n} bytes, on a stream");
                // Part of an allocation, at an offset, into the other.
                if n > 2 {
                    let part = up.cast::<u8>().add(1).cast::<c_void>();
                    assert_eq!(cuMemcpyDtoHAsync_v2(part, buf + 1, n - 2, stream), 0);
                    assert_eq!(cuStreamSynchronize(stream), 0);
                    assert!(up_bytes[1..n - 1] == want[1..n - 1]);
                    // The device's view of the mapped allocation (its own pointer) agrees.
                    let mut seen = vec![0u8; n];
                    let out = seen.as_mut_ptr().cast::<c_void>();
                    assert_eq!(cuMemcpyDtoH_v2(out, up as u64, n), 0);
                    assert!(seen == *up_bytes, "{n}: the device side is coherent");
                    assert_eq!(up_bytes[0], want[0], "untouched");
                }
                // Past the device allocation: the copy's error.
                if n == largest {
                    assert_ne!(cuMemcpyHtoD_v2(buf + 1, up, n), 0);
                    assert_ne!(cuMemcpyDtoH_v2(down, buf + 1, n), 0);
                }
                assert_eq!(cuMemFreeHost(up), 0);
                assert_eq!(cuMemFreeHost(down), 0);
                assert_ne!(cuMemFreeHost(up), 0, "freed once");
                assert_eq!(budget.used(), idle, "{n}: the charge is given back");
            }
        }
        // Past the budget.
        let mut p = null_mut();
        assert_eq!(
            cuMemAllocHost_v2(&mut p, TOO_MUCH),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(
            cuMemHostAlloc(&mut p, TOO_MUCH, PORTABLE),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        // Mapped page-locked memory keeps its device pointer, and a kernel's view of it.
        let mut mapped = null_mut();
        assert_eq!(cuMemHostAlloc(&mut mapped, 4096, DEVICEMAP), 0);
        let mut device = 0u64;
        assert_eq!(cuMemHostGetDevicePointer_v2(&mut device, mapped, 0), 0);
        std::slice::from_raw_parts_mut(mapped.cast::<u8>(), 4096).fill(7);
        let mut seen = [0u8; 4096];
        let out = seen.as_mut_ptr().cast::<c_void>();
        assert_eq!(cuMemcpyDtoH_v2(out, device, 4096), 0);
        assert!(seen.iter().all(|&b| b == 7));
        assert_eq!(cuMemFreeHost(mapped), 0);
    }
}
