//! `cuMemGetInfo` through the C entry points against a served CPU backend: the host's count,
//! not the total twice. An allocation takes at least its size from what is free, the total
//! stays `cuDeviceTotalMem`'s, a free gives it back, and without a current context the call
//! is refused. One test (the driver is process-global).

use std::ffi::{c_int, c_uint, c_void};
use std::ptr::null_mut;

// The entry points are this crate's `#[no_mangle]` functions: link it.
extern crate cuda;

mod support;

type Handle = *mut c_void;

unsafe extern "C" {
    fn cuInit(flags: c_uint) -> c_uint;
    fn cuCtxCreate_v2(ctx: *mut Handle, flags: c_uint, dev: c_int) -> c_uint;
    fn cuCtxDestroy_v2(ctx: Handle) -> c_uint;
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> c_uint;
    fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> c_uint;
    fn cuMemFree_v2(dptr: u64) -> c_uint;
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> c_uint;
}

/// Bytes allocated between the two looks.
const N: usize = 8 << 20;

/// `cuMemGetInfo`'s status and answer.
fn mem_info() -> (c_uint, usize, usize) {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: two live out-pointers.
    let status = unsafe { cuMemGetInfo_v2(&mut free, &mut total) };
    (status, free, total)
}

#[test]
fn mem_get_info_tells_what_the_host_counts() {
    let host = support::serve_cpu_backend("meminfo");
    // SAFETY: the driver's C entry points, called as a C program calls them, with live
    // pointers to locals of the right types.
    unsafe {
        assert_eq!(cuInit(0), 0);
        let mut ctx = null_mut();
        assert_eq!(cuCtxCreate_v2(&mut ctx, 0, 0), 0);
        let mut device_total = 0usize;
        assert_eq!(cuDeviceTotalMem_v2(&mut device_total, 0), 0);

        let (status, free, total) = mem_info();
        assert_eq!(status, 0);
        assert_eq!(total, device_total);
        assert!(free > N && free <= total, "{free} of {total}");

        let mut dptr = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut dptr, N), 0);
        let (status, after, total_after) = mem_info();
        assert_eq!(status, 0);
        assert_eq!(total_after, total);
        assert!(free - after >= N, "{free} -> {after} after {N} bytes");

        assert_eq!(cuMemFree_v2(dptr), 0);
        assert_eq!(mem_info(), (0, free, total));

        // No current context: CUDA_ERROR_INVALID_CONTEXT.
        assert_eq!(cuCtxDestroy_v2(ctx), 0);
        assert_eq!(mem_info().0, 201);
    }
    host.close();
}
