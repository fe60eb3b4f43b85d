//! The core driver API's C entry points against a served CPU backend: entry-point lookup by
//! CUDA version, contexts (`_v3`/`_v4`, flags, limits, cache and shared-memory settings),
//! stream priorities and properties, profiler control, `cuDeviceGetProperties`; each with the
//! arguments a buggy program passes. One test of the
//! driver (it is process-global), and one of lookups in the built shared library.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::ptr::null_mut;

// The entry points are this crate's `#[no_mangle]` functions: link it.
extern crate cuda;

mod support;

type Handle = *mut c_void;

/// `CUdevprop`.
#[repr(C)]
#[derive(Default)]
struct DevProp {
    max_threads_per_block: c_int,
    max_threads_dim: [c_int; 3],
    max_grid_size: [c_int; 3],
    shared_mem_per_block: c_int,
    total_constant_memory: c_int,
    simd_width: c_int,
    mem_pitch: c_int,
    regs_per_block: c_int,
    clock_rate: c_int,
    texture_align: c_int,
}

/// `CUctxCreateParams`.
#[repr(C)]
struct CtxCreateParams {
    exec_affinity: *const c_void,
    exec_affinity_count: c_int,
    cig: *const c_void,
}

unsafe extern "C" {
    fn cuInit(flags: c_uint) -> c_uint;
    fn cuCtxCreate_v3(
        ctx: *mut Handle,
        params: *mut c_void,
        count: c_int,
        flags: c_uint,
        dev: c_int,
    ) -> c_uint;
    fn cuCtxCreate_v4(
        ctx: *mut Handle,
        params: *const CtxCreateParams,
        flags: c_uint,
        dev: c_int,
    ) -> c_uint;
    fn cuCtxDestroy_v2(ctx: Handle) -> c_uint;
    fn cuCtxPopCurrent_v2(ctx: *mut Handle) -> c_uint;
    fn cuCtxGetFlags(flags: *mut c_uint) -> c_uint;
    fn cuCtxSetFlags(flags: c_uint) -> c_uint;
    fn cuCtxGetDevice_v2(dev: *mut c_int, ctx: Handle) -> c_uint;
    fn cuCtxSynchronize_v2(ctx: Handle) -> c_uint;
    fn cuCtxSetLimit(limit: c_int, value: usize) -> c_uint;
    fn cuCtxGetLimit(value: *mut usize, limit: c_int) -> c_uint;
    fn cuCtxGetCacheConfig(config: *mut c_int) -> c_uint;
    fn cuCtxSetCacheConfig(config: c_int) -> c_uint;
    fn cuCtxGetSharedMemConfig(config: *mut c_int) -> c_uint;
    fn cuCtxSetSharedMemConfig(config: c_int) -> c_uint;
    fn cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) -> c_uint;
    fn cuDevicePrimaryCtxSetFlags_v2(dev: c_int, flags: c_uint) -> c_uint;
    fn cuDevicePrimaryCtxGetState(dev: c_int, flags: *mut c_uint, active: *mut c_int) -> c_uint;
    fn cuDevicePrimaryCtxRetain(ctx: *mut Handle, dev: c_int) -> c_uint;
    fn cuDeviceGetProperties(prop: *mut DevProp, dev: c_int) -> c_uint;
    fn cuStreamCreate(s: *mut Handle, flags: c_uint) -> c_uint;
    fn cuStreamCreateWithPriority(s: *mut Handle, flags: c_uint, priority: c_int) -> c_uint;
    fn cuStreamGetPriority(s: Handle, priority: *mut c_int) -> c_uint;
    fn cuStreamGetFlags(s: Handle, flags: *mut c_uint) -> c_uint;
    fn cuStreamGetId(s: Handle, id: *mut u64) -> c_uint;
    fn cuStreamGetCtx(s: Handle, ctx: *mut Handle) -> c_uint;
    fn cuStreamGetCtx_v2(s: Handle, ctx: *mut Handle, green: *mut Handle) -> c_uint;
    fn cuStreamDestroy_v2(s: Handle) -> c_uint;
    fn cuDeviceGetAttribute(v: *mut c_int, attribute: c_int, dev: c_int) -> c_uint;
    fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> c_uint;
    fn cuModuleGetFunction(f: *mut Handle, module: Handle, name: *const c_char) -> c_uint;
    fn cuFuncGetAttribute(v: *mut c_int, attribute: c_int, f: Handle) -> c_uint;
    fn cuFuncSetAttribute(f: Handle, attribute: c_int, value: c_int) -> c_uint;
    fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> c_uint;
    #[allow(clippy::too_many_arguments)]
    fn cuLaunchKernel(
        f: Handle,
        gx: c_uint,
        gy: c_uint,
        gz: c_uint,
        bx: c_uint,
        by: c_uint,
        bz: c_uint,
        shared: c_uint,
        stream: Handle,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> c_uint;
    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
        blocks: *mut c_int,
        f: Handle,
        block_size: c_int,
        dynamic_shared: usize,
    ) -> c_uint;
    fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
        blocks: *mut c_int,
        f: Handle,
        block_size: c_int,
        dynamic_shared: usize,
        flags: c_uint,
    ) -> c_uint;
    fn cuOccupancyMaxPotentialBlockSize(
        grid: *mut c_int,
        block: *mut c_int,
        f: Handle,
        to_shared: Option<extern "C" fn(c_int) -> usize>,
        dynamic_shared: usize,
        limit: c_int,
    ) -> c_uint;
    fn cuOccupancyAvailableDynamicSMemPerBlock(
        size: *mut usize,
        f: Handle,
        blocks: c_int,
        block_size: c_int,
    ) -> c_uint;
    fn cuOccupancyMaxActiveClusters(n: *mut c_int, f: Handle, config: *const c_void) -> c_uint;
    fn cuMemAllocHost_v2(p: *mut *mut c_void, bytes: usize) -> c_uint;
    fn cuMemHostAlloc(p: *mut *mut c_void, bytes: usize, flags: c_uint) -> c_uint;
    fn cuMemFreeHost(p: *mut c_void) -> c_uint;
    fn cuMemHostRegister_v2(p: *mut c_void, bytes: usize, flags: c_uint) -> c_uint;
    fn cuMemHostUnregister(p: *mut c_void) -> c_uint;
    fn cuMemHostGetFlags(flags: *mut c_uint, p: *mut c_void) -> c_uint;
    fn cuPointerGetAttribute(data: *mut c_void, attribute: c_int, ptr: u64) -> c_uint;
    fn cuPointerGetAttributes(
        n: c_uint,
        attributes: *const c_int,
        data: *mut *mut c_void,
        ptr: u64,
    ) -> c_uint;
    fn cuMemAllocManaged(dptr: *mut u64, bytes: usize, flags: c_uint) -> c_uint;
    fn cuMemFree_v2(dptr: u64) -> c_uint;
    fn cuMemPrefetchAsync(ptr: u64, count: usize, device: c_int, stream: Handle) -> c_uint;
    fn cuMemAdvise(ptr: u64, count: usize, advice: c_int, device: c_int) -> c_uint;
    fn cuStreamAttachMemAsync(stream: Handle, ptr: u64, length: usize, flags: c_uint) -> c_uint;
    fn cuMemHostGetDevicePointer_v2(dptr: *mut u64, p: *mut c_void, flags: c_uint) -> c_uint;
    fn cuDeviceGetByPCIBusId(dev: *mut c_int, id: *const c_char) -> c_uint;
    fn cuCtxAttach(ctx: *mut Handle, flags: c_uint) -> c_uint;
    fn cuCtxDetach(ctx: Handle) -> c_uint;
    fn cuFuncSetBlockShape(f: Handle, x: c_int, y: c_int, z: c_int) -> c_uint;
    fn cuFuncSetSharedSize(f: Handle, bytes: c_uint) -> c_uint;
    fn cuParamSetSize(f: Handle, bytes: c_uint) -> c_uint;
    fn cuParamSeti(f: Handle, offset: c_int, value: c_uint) -> c_uint;
    fn cuParamSetv(f: Handle, offset: c_int, p: *mut c_void, bytes: c_uint) -> c_uint;
    fn cuLaunch(f: Handle) -> c_uint;
    fn cuLaunchGrid(f: Handle, width: c_int, height: c_int) -> c_uint;
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> c_uint;
    fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> c_uint;
    fn cuProfilerStart() -> c_uint;
    fn cuProfilerStop() -> c_uint;
}

type GetProcAddress =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_uint;

/// The built `libcuda.so` itself, for what only a shared
/// library has: its exported symbols, which `cuGetProcAddress` answers from.
struct Shared(*mut c_void);

impl Shared {
    fn open() -> Shared {
        // Cargo builds it beside the test (deps/), and copies it one level up for `cargo
        // build`.
        let exe = std::env::current_exe().unwrap();
        let dir = exe.parent().unwrap();
        let path = [dir, dir.parent().unwrap()]
            .iter()
            .map(|d| d.join("libcuda.so"))
            .find(|p| p.exists())
            .expect("the built libcuda.so");
        let path = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: dlopen of the library this crate builds, with a NUL-terminated path.
        let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!h.is_null(), "the built libcuda.so");
        Shared(h)
    }

    fn symbol(&self, name: &CStr) -> usize {
        // SAFETY: dlsym in the handle opened above with a NUL-terminated name.
        unsafe { libc::dlsym(self.0, name.as_ptr()) as usize }
    }

    /// Its `cuGetProcAddress_v2` of `name` for CUDA `version` with `flags`: (result,
    /// pointer, status).
    fn lookup(&self, name: &CStr, version: c_int, flags: u64) -> (c_uint, usize, c_int) {
        let f = self.symbol(c"cuGetProcAddress_v2");
        assert_ne!(f, 0);
        // SAFETY: the library's cuGetProcAddress_v2, of this signature.
        let f: GetProcAddress = unsafe { std::mem::transmute::<usize, GetProcAddress>(f) };
        let (mut p, mut status) = (null_mut(), -1);
        // SAFETY: a NUL-terminated name and valid out-pointers.
        let r = unsafe { f(name.as_ptr(), &mut p, version, flags, &mut status) };
        (r, p as usize, status)
    }
}

#[test]
fn entry_points_are_looked_up_by_the_callers_cuda_version() {
    let lib = Shared::open();
    // Each caller gets the symbol of the signature it was built for.
    for (name, version, symbol) in [
        (c"cuCtxCreate", 13000, c"cuCtxCreate_v4"),
        (c"cuCtxCreate", 12000, c"cuCtxCreate_v3"),
        (c"cuCtxCreate", 4000, c"cuCtxCreate_v2"),
        (c"cuCtxSynchronize", 12090, c"cuCtxSynchronize"),
        (c"cuCtxSynchronize", 13000, c"cuCtxSynchronize_v2"),
        (c"cuEventElapsedTime", 13000, c"cuEventElapsedTime_v2"),
        (c"cuMemAlloc", 13000, c"cuMemAlloc_v2"),
    ] {
        let want = lib.symbol(symbol);
        assert_ne!(want, 0, "{symbol:?} exported");
        assert_eq!(
            lib.lookup(name, version, 0),
            (0, want, 0),
            "{name:?} {version}"
        );
    }
    // The per-thread default stream's variant is the legacy one here (in-order contexts).
    assert_eq!(
        lib.lookup(c"cuStreamGetCtx", 12050, 2),
        (0, lib.symbol(c"cuStreamGetCtx_v2"), 0)
    );
    assert_eq!(lib.lookup(c"cuCtxCreate", 1000, 0), (500, 0, 2), "too old");
    assert_eq!(lib.lookup(c"cuNoSuchEntry", 13000, 0), (500, 0, 1));
    assert_eq!(lib.lookup(c"cuCtxCreate", 13000, 4).0, 1, "unknown flag");
    assert_eq!(lib.lookup(c"cuCtxCreate", -1, 0).0, 1, "negative version");
}

/// A kernel with 1 KiB of static shared memory that copies its argument through it.
const STAGE: &CStr = c".version 8.5\n.target sm_75\n.address_size 64\n\
    .shared .align 4 .b8 buf[1024];\n\
    .visible .entry stage(.param .u64 p)\n{\n.reg .b32 %r<2>;\n.reg .b64 %rd<2>;\n\
    ld.param.u64 %rd1, [p];\nmov.u32 %r1, 5;\nst.shared.u32 [buf], %r1;\n\
    ld.shared.u32 %r1, [buf];\nst.global.u32 [%rd1], %r1;\nret;\n}\n";

/// `CUoccupancyB2DSize` of the test: 64 bytes of dynamic shared memory per thread.
extern "C" fn shared_per_thread(block_size: c_int) -> usize {
    block_size as usize * 64
}

#[test]
fn the_core_entry_points_tell_the_truth_and_refuse_bad_arguments() {
    let host = support::serve_cpu_backend("core-api");
    // SAFETY: every call below passes arguments as the driver API documents them, or NULL,
    // wrong handles and out-of-range values where the test checks that they are refused.
    unsafe {
        assert_eq!(cuInit(0), 0);

        // The primary context keeps the flags set before it exists.
        let (mut flags, mut active) = (0u32, -1);
        assert_eq!(cuDevicePrimaryCtxSetFlags_v2(0, 4), 0);
        assert_eq!(cuDevicePrimaryCtxSetFlags_v2(0, 3), 1, "no such schedule");
        assert_eq!(cuDevicePrimaryCtxSetFlags_v2(1, 4), 101);
        assert_eq!(cuDevicePrimaryCtxGetState(0, &mut flags, &mut active), 0);
        assert_eq!((flags, active), (4, 0));
        let mut primary: Handle = null_mut();
        assert_eq!(cuDevicePrimaryCtxRetain(&mut primary, 0), 0);
        assert_eq!(cuDevicePrimaryCtxGetState(0, &mut flags, &mut active), 0);
        assert_eq!((flags, active), (4, 1));

        // Contexts of CUDA 11.4 and 12.5: execution affinity needs MPS, CIG a graphics client.
        let mut ctx: Handle = null_mut();
        let affinity = [0u8; 16];
        assert_eq!(
            cuCtxCreate_v3(&mut ctx, affinity.as_ptr() as *mut c_void, 1, 0, 0),
            224
        );
        assert_eq!(
            cuCtxCreate_v3(&mut ctx, null_mut(), 1, 0, 0),
            1,
            "count, no array"
        );
        let cig = CtxCreateParams {
            exec_affinity: null_mut(),
            exec_affinity_count: 0,
            cig: affinity.as_ptr().cast(),
        };
        assert_eq!(cuCtxCreate_v4(&mut ctx, &cig, 0, 0), 801);
        assert_eq!(
            cuCtxCreate_v4(&mut ctx, std::ptr::null(), 0x100, 0),
            1,
            "flags"
        );
        assert_eq!(cuCtxCreate_v4(null_mut(), std::ptr::null(), 0, 0), 1);
        assert_eq!(cuCtxCreate_v4(&mut ctx, std::ptr::null(), 0, 1), 101);
        let plain = CtxCreateParams {
            exec_affinity: null_mut(),
            exec_affinity_count: 0,
            cig: null_mut(),
        };
        assert_eq!(cuCtxCreate_v4(&mut ctx, &plain, 0x04 | 0x80, 0), 0);
        assert_eq!(cuCtxGetFlags(&mut flags), 0);
        assert_eq!(flags, 0x84);
        assert_eq!(cuCtxSetFlags(0x02), 0);
        assert_eq!(cuCtxSetFlags(0x05), 1);
        assert_eq!(cuCtxGetFlags(&mut flags), 0);
        assert_eq!(flags, 0x02);
        let mut dev = -1;
        assert_eq!(cuCtxGetDevice_v2(&mut dev, ctx), 0);
        assert_eq!(dev, 0);
        assert_eq!(cuCtxGetDevice_v2(&mut dev, 0x1234 as Handle), 201);
        assert_eq!(cuCtxSynchronize_v2(null_mut()), 0, "the current context");
        assert_eq!(cuCtxSynchronize_v2(primary), 0);
        assert_eq!(cuCtxSynchronize_v2(0x1234 as Handle), 201);

        // Limits: up to what the executor provides; device-runtime limits and persisting L2
        // do not exist on this device.
        let mut v = 0usize;
        assert_eq!(cuCtxGetLimit(&mut v, 0), 0);
        assert_eq!(v, 1024, "CUDA's default stack");
        assert_eq!(cuCtxSetLimit(0, 4096), 0);
        assert_eq!(cuCtxGetLimit(&mut v, 0), 0);
        assert_eq!(v, 4096);
        assert_eq!(cuCtxSetLimit(0, 1 << 30), 1, "more stack than a thread has");
        assert_eq!(cuCtxGetLimit(&mut v, 2), 0);
        assert_eq!(v, 8 << 20, "the device heap");
        assert_eq!(cuCtxSetLimit(2, usize::MAX), 1);
        assert_eq!(
            cuCtxSetLimit(2, (1 << 30) + 1),
            1,
            "more heap than the host gives"
        );
        assert_eq!(
            cuCtxSetLimit(2, 128 << 20),
            0,
            "sized on the host before first use"
        );
        assert_eq!(cuCtxGetLimit(&mut v, 2), 0);
        assert_eq!(v, 128 << 20);
        assert_eq!(cuCtxGetLimit(&mut v, 3), 215);
        assert_eq!(cuCtxSetLimit(4, 16), 215);
        assert_eq!(cuCtxGetLimit(&mut v, 6), 0);
        assert_eq!(v, 0, "no persisting L2 on Turing");
        assert_eq!(cuCtxSetLimit(6, 0), 0);
        assert_eq!(cuCtxSetLimit(6, 1 << 20), 215);
        assert_eq!(cuCtxGetLimit(&mut v, 99), 1);
        assert_eq!(cuCtxGetLimit(null_mut(), 0), 1);

        let mut config = -1;
        assert_eq!(cuCtxGetCacheConfig(&mut config), 0);
        assert_eq!(config, 0);
        assert_eq!(cuCtxSetCacheConfig(1), 0);
        assert_eq!(cuCtxGetCacheConfig(&mut config), 0);
        assert_eq!(config, 1);
        assert_eq!(cuCtxSetCacheConfig(4), 1);
        assert_eq!(cuCtxSetSharedMemConfig(2), 0);
        assert_eq!(cuCtxSetSharedMemConfig(3), 1);
        assert_eq!(cuCtxGetSharedMemConfig(&mut config), 0);
        assert_eq!(config, 1, "four-byte banks, not configurable");

        // Stream priorities: Turing's range, clamped into it, kept per stream.
        let (mut least, mut greatest) = (1, 1);
        assert_eq!(cuCtxGetStreamPriorityRange(&mut least, &mut greatest), 0);
        assert_eq!((least, greatest), (0, -5));
        let (mut s1, mut s2): (Handle, Handle) = (null_mut(), null_mut());
        assert_eq!(cuStreamCreateWithPriority(&mut s1, 1, -100), 0);
        assert_eq!(cuStreamCreateWithPriority(&mut s2, 0, 3), 0);
        assert_eq!(cuStreamCreateWithPriority(&mut s2, 2, 0), 1, "no such flag");
        assert_eq!(cuStreamCreate(null_mut(), 0), 1);
        let mut priority = 1;
        assert_eq!(cuStreamGetPriority(s1, &mut priority), 0);
        assert_eq!(priority, -5);
        assert_eq!(cuStreamGetPriority(s2, &mut priority), 0);
        assert_eq!(priority, 0);
        assert_eq!(cuStreamGetPriority(null_mut(), &mut priority), 0);
        assert_eq!(priority, 0, "the NULL stream");
        assert_eq!(cuStreamGetFlags(s1, &mut flags), 0);
        assert_eq!(flags, 1);
        let (mut id1, mut id2) = (0u64, 0u64);
        assert_eq!(cuStreamGetId(s1, &mut id1), 0);
        assert_eq!(cuStreamGetId(s2, &mut id2), 0);
        assert_ne!(id1, id2);
        let (mut owner, mut green): (Handle, Handle) = (null_mut(), 1 as Handle);
        assert_eq!(cuStreamGetCtx(s1, &mut owner), 0);
        assert_eq!(owner, ctx);
        assert_eq!(cuStreamGetCtx_v2(s1, &mut owner, &mut green), 0);
        assert!(green.is_null());
        assert_eq!(cuStreamGetPriority(ctx, &mut priority), 400, "a context");
        assert_eq!(cuStreamGetPriority(s1, null_mut()), 1);
        assert_eq!(cuStreamDestroy_v2(s1), 0);
        assert_eq!(cuStreamGetFlags(s1, &mut flags), 400, "destroyed");

        // Function attributes: every one of CUDA 13's, from what the executor reports.
        let (mut m, mut f): (Handle, Handle) = (null_mut(), null_mut());
        assert_eq!(cuModuleLoadData(&mut m, STAGE.as_ptr().cast()), 0);
        assert_eq!(cuModuleGetFunction(&mut f, m, c"stage".as_ptr()), 0);
        let mut v = -1;
        for attribute in 0..18 {
            assert_eq!(cuFuncGetAttribute(&mut v, attribute, f), 0, "{attribute}");
        }
        assert_eq!(cuFuncGetAttribute(&mut v, 18, f), 1);
        assert_eq!(cuFuncGetAttribute(&mut v, 1, f), 0);
        assert_eq!(v, 1024, "static shared memory");
        assert_eq!(cuFuncGetAttribute(&mut v, 8, f), 0);
        assert_eq!(v, 47 * 1024, "dynamic shared memory beside it");
        assert_eq!(cuFuncGetAttribute(&mut v, 4, f), 0);
        let registers = v;
        assert!(registers > 0);
        assert_eq!(cuFuncGetAttribute(null_mut(), 0, f), 1);
        assert_eq!(cuFuncGetAttribute(&mut v, 0, ctx), 400, "a context");

        // Dynamic shared memory past the maximum is refused at launch, up to the opt-in limit
        // once raised.
        let mut out = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut out, 4), 0);
        let mut params = [(&raw mut out).cast::<c_void>()];
        let launch = |shared: c_uint, params: *mut *mut c_void| {
            cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, shared, null_mut(), params, null_mut())
        };
        assert_eq!(launch(47 * 1024 + 1, params.as_mut_ptr()), 1);
        assert_eq!(
            cuFuncSetAttribute(f, 8, 63 * 1024 + 1),
            1,
            "past the opt-in limit"
        );
        assert_eq!(cuFuncSetAttribute(f, 0, 128), 1, "read-only");
        assert_eq!(cuFuncSetAttribute(f, 8, 60 * 1024), 0);
        assert_eq!(launch(60 * 1024, params.as_mut_ptr()), 0);
        assert_eq!(cuCtxSynchronize_v2(null_mut()), 0);
        assert_eq!(cuFuncGetAttribute(&mut v, 8, f), 0);
        assert_eq!(v, 60 * 1024);

        // Occupancy on a Turing multiprocessor.
        let mut sms = 0;
        assert_eq!(cuDeviceGetAttribute(&mut sms, 16, 0), 0);
        assert_eq!(cuDeviceGetAttribute(&mut v, 39, 0), 0);
        assert_eq!(v, 1024, "threads per multiprocessor");
        let mut blocks = -1;
        assert_eq!(
            cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, f, 256, 0),
            0
        );
        assert_eq!(blocks, 4, "32 warps of 8");
        assert_eq!(
            cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, f, 256, 20 * 1024),
            0
        );
        assert_eq!(blocks, 3, "21 KiB each in 64 KiB");
        assert_eq!(
            cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&mut blocks, f, 256, 0, 1),
            0
        );
        assert_eq!(
            cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&mut blocks, f, 256, 0, 2),
            1
        );
        assert_eq!(
            cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, f, -1, 0),
            1
        );
        assert_eq!(
            cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, m, 256, 0),
            400
        );
        let (mut grid, mut block) = (0, 0);
        assert_eq!(
            cuOccupancyMaxPotentialBlockSize(&mut grid, &mut block, f, None, 0, 0),
            0
        );
        assert_eq!((grid, block), (sms, 1024));
        // 64 bytes a thread beside 1 KiB: 992 threads (63 KiB) is the most that fits.
        assert_eq!(
            cuOccupancyMaxPotentialBlockSize(
                &mut grid,
                &mut block,
                f,
                Some(shared_per_thread),
                0,
                0
            ),
            0
        );
        assert_eq!((grid, block), (sms, 992));
        assert_eq!(
            cuOccupancyMaxPotentialBlockSize(null_mut(), &mut block, f, None, 0, 0),
            1
        );
        let mut room = 0usize;
        assert_eq!(
            cuOccupancyAvailableDynamicSMemPerBlock(&mut room, f, 2, 256),
            0
        );
        assert_eq!(room, 31 * 1024);
        assert_eq!(
            cuOccupancyAvailableDynamicSMemPerBlock(&mut room, f, 5, 256),
            0
        );
        assert_eq!(room, 0, "only 4 fit");
        assert_eq!(
            cuOccupancyMaxActiveClusters(&mut blocks, f, std::ptr::null()),
            801
        );

        // Page-locked host memory and pointer attributes, from the library's own tables.
        let (mut h, mut h2): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
        assert_eq!(cuMemAllocHost_v2(&mut h, 64), 0);
        assert_eq!(cuMemHostAlloc(&mut h2, 32, 1), 0);
        assert_eq!(cuMemHostAlloc(&mut h2, 32, 8), 1, "no such flag");
        assert_eq!(cuMemHostGetFlags(&mut flags, h), 0);
        assert_eq!(flags, 0);
        assert_eq!(cuMemHostGetFlags(&mut flags, h2), 0);
        assert_eq!(flags, 1, "portable");
        let word = |attribute: c_int, ptr: u64| {
            let mut v = 0u64;
            (
                cuPointerGetAttribute((&raw mut v).cast(), attribute, ptr),
                v,
            )
        };
        let int = |attribute: c_int, ptr: u64| {
            let mut v = 0u32;
            (
                cuPointerGetAttribute((&raw mut v).cast(), attribute, ptr),
                v,
            )
        };
        let (hp, dp) = (h as u64, out);
        assert_eq!(int(2, hp + 8), (0, 1), "host memory");
        assert_eq!(word(4, hp + 8), (0, hp + 8));
        assert_eq!(
            word(3, hp + 8),
            (0, hp + 8),
            "mapped, at one address: unified addressing"
        );
        assert_eq!(word(11, hp + 8), (0, hp));
        assert_eq!(word(12, hp + 8), (0, 64));
        assert_eq!(word(1, hp), (0, ctx as u64));
        assert_eq!(int(2, dp), (0, 2), "device memory");
        assert_eq!(word(3, dp + 2), (0, dp + 2));
        assert_eq!(word(4, dp).0, 1, "no host pointer");
        let (host_id, device_id) = (word(7, hp).1, word(7, dp).1);
        assert!(host_id != 0 && device_id != 0 && host_id != device_id);
        let mut managed = 7u8;
        assert_eq!(cuPointerGetAttribute((&raw mut managed).cast(), 8, dp), 0);
        assert_eq!(managed, 0, "a boolean, one byte");
        assert_eq!(word(5, dp).0, 801, "P2P tokens");
        assert_eq!(word(99, dp).0, 1);
        assert_eq!(int(2, 0x10).0, 1, "not this driver's memory");
        assert_eq!(cuPointerGetAttribute(null_mut(), 2, dp), 1);
        // Several at once; memory not the driver's answers zeros.
        let (mut kind, mut owner) = (9u32, 1 as Handle);
        let wanted = [2, 1];
        let mut outs = [(&raw mut kind).cast::<c_void>(), (&raw mut owner).cast()];
        assert_eq!(
            cuPointerGetAttributes(2, wanted.as_ptr(), outs.as_mut_ptr(), dp),
            0
        );
        assert_eq!((kind, owner), (2, ctx));
        assert_eq!(
            cuPointerGetAttributes(2, wanted.as_ptr(), outs.as_mut_ptr(), 0x10),
            0
        );
        assert_eq!((kind, owner), (0, null_mut()));
        assert_eq!(
            cuPointerGetAttributes(0, wanted.as_ptr(), outs.as_mut_ptr(), dp),
            1
        );
        let mut partial = [(&raw mut kind).cast::<c_void>(), null_mut()];
        kind = 9;
        assert_eq!(
            cuPointerGetAttributes(2, wanted.as_ptr(), partial.as_mut_ptr(), dp),
            1
        );
        assert_eq!(kind, 9, "nothing written");
        // Registered memory: once, whole, and unregistered once.
        let mut buf = vec![0u8; 8192];
        let b = buf.as_mut_ptr().cast::<c_void>();
        assert_eq!(cuMemHostRegister_v2(b, 4096, 0), 0);
        assert_eq!(cuMemHostRegister_v2(b, 4096, 0), 712, "twice");
        assert_eq!(cuMemHostRegister_v2(b.add(4095), 8, 0), 712, "overlapping");
        assert_eq!(
            cuMemHostRegister_v2(b.add(4096), 4096, 4),
            801,
            "I/O memory"
        );
        assert_eq!(cuMemHostRegister_v2(b.add(4096), 0, 0), 1, "empty");
        assert_eq!(int(2, b as u64 + 100), (0, 1));
        assert_eq!(
            cuMemHostGetFlags(&mut flags, b),
            1,
            "registered, not allocated"
        );
        assert_eq!(cuMemHostUnregister(b), 0);
        assert_eq!(cuMemHostUnregister(b), 713);
        assert_eq!(cuMemFreeHost(b), 1, "not the driver's to free");
        assert_eq!(cuMemFreeHost(h), 0);
        assert_eq!(cuMemFreeHost(h), 1, "twice");
        assert_eq!(int(2, hp).0, 1, "gone");
        assert_eq!(cuMemFreeHost(h2), 0);
        assert_eq!(cuMemFreeHost(null_mut()), 0);

        // Managed memory: one pointer on both sides, coherent at synchronisation points.
        let run_stage = |p: u64| {
            let mut arg = p;
            let mut args = [(&raw mut arg).cast::<c_void>()];
            let r = cuLaunchKernel(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                null_mut(),
                args.as_mut_ptr(),
                null_mut(),
            );
            (r, cuCtxSynchronize_v2(null_mut()))
        };
        let mut mp = 0u64;
        assert_eq!(cuMemAllocManaged(&mut mp, 3 * 4096 + 5, 1), 0);
        let host = mp as *mut u32;
        for i in 0..3072 {
            *host.add(i) = i as u32;
        }
        assert_eq!(run_stage(mp + 8), (0, 0));
        assert_eq!(
            *host.add(2),
            5,
            "the kernel's write, after the synchronisation"
        );
        assert_eq!(
            *host.add(3),
            3,
            "the host's writes reached the device and came back"
        );
        assert_eq!(*host.add(3071), 3071);
        let mut byte = 0u8;
        assert_eq!(cuPointerGetAttribute((&raw mut byte).cast(), 8, mp + 4), 0);
        assert_eq!(byte, 1, "managed");
        assert_eq!(word(4, mp + 4), (0, mp + 4), "a host pointer");
        assert_eq!(int(2, mp), (0, 2));
        let mut other = 0u64;
        assert_eq!(cuMemAllocManaged(&mut other, 0, 1), 1, "empty");
        assert_eq!(
            cuMemAllocManaged(&mut other, 64, 4),
            1,
            "single is for streams"
        );
        assert_eq!(cuMemAllocManaged(null_mut(), 64, 1), 1);
        assert_eq!(cuMemPrefetchAsync(mp, 4096, 0, null_mut()), 0);
        assert_eq!(
            cuMemPrefetchAsync(mp, 4096, -1, null_mut()),
            0,
            "to the host"
        );
        assert_eq!(cuMemPrefetchAsync(mp, 4096, 3, null_mut()), 101);
        assert_eq!(cuMemPrefetchAsync(out, 4, 0, null_mut()), 1, "not managed");
        assert_eq!(
            cuMemPrefetchAsync(mp, 1 << 30, 0, null_mut()),
            1,
            "past its end"
        );
        assert_eq!(cuMemAdvise(mp, 16, 1, 0), 0);
        assert_eq!(cuMemAdvise(mp, 16, 9, 0), 1, "no such advice");
        assert_eq!(cuStreamAttachMemAsync(null_mut(), mp, 0, 2), 0);
        assert_eq!(cuStreamAttachMemAsync(null_mut(), mp, 0, 3), 1);
        assert_eq!(
            cuStreamAttachMemAsync(null_mut(), out, 0, 1),
            1,
            "not managed"
        );
        let mut dm = 0u64;
        assert_eq!(
            cuMemHostGetDevicePointer_v2(&mut dm, host.cast(), 0),
            1,
            "not mapped"
        );
        assert_eq!(cuMemFree_v2(mp), 0);
        assert_eq!(
            cuPointerGetAttribute((&raw mut byte).cast(), 8, mp),
            1,
            "gone"
        );

        // Mapped host memory: allocated (one address) and registered (a device address of
        // its own), coherent at synchronisation points.
        let mut hm: *mut c_void = null_mut();
        assert_eq!(cuMemHostAlloc(&mut hm, 64, 2), 0);
        assert_eq!(cuMemHostGetDevicePointer_v2(&mut dm, hm, 0), 0);
        assert_eq!(dm, hm as u64, "unified");
        assert_eq!(cuMemHostGetDevicePointer_v2(&mut dm, hm, 1), 1, "flags");
        assert_eq!(run_stage(dm + 4), (0, 0));
        assert_eq!(*hm.cast::<u32>().add(1), 5);
        assert_eq!(int(2, dm), (0, 1), "host memory");
        assert_eq!(word(3, dm + 4), (0, dm + 4));
        assert_eq!(cuMemFree_v2(dm), 1, "freed with cuMemFreeHost");
        assert_eq!(cuMemFreeHost(hm), 0);
        let mut regs = vec![0u32; 8];
        let r = regs.as_mut_ptr().cast::<c_void>();
        assert_eq!(cuMemHostRegister_v2(r, 32, 2), 0);
        let mut dr = 0u64;
        assert_eq!(cuMemHostGetDevicePointer_v2(&mut dr, r.byte_add(4), 0), 0);
        assert_ne!(dr, r as u64 + 4, "its own device address");
        assert_eq!(word(3, r as u64 + 4), (0, dr));
        assert_eq!(run_stage(dr), (0, 0));
        assert_eq!(regs[1], 5, "through the device pointer");
        assert_eq!(cuMemHostUnregister(r), 0);
        assert_eq!(
            cuMemHostGetDevicePointer_v2(&mut dr, r, 0),
            1,
            "unregistered"
        );

        // The launch API of CUDA 1: shape, parameters, then a grid.
        assert_eq!(cuFuncSetBlockShape(f, 32, 1, 1), 0);
        assert_eq!(cuFuncSetBlockShape(f, -1, 1, 1), 1);
        assert_eq!(cuFuncSetSharedSize(f, 0), 0);
        assert_eq!(
            cuParamSetSize(f, 1 << 20),
            1,
            "past any kernel's parameters"
        );
        assert_eq!(cuParamSetSize(f, 8), 0);
        let mut target = out;
        assert_eq!(cuParamSetv(f, 0, (&raw mut target).cast(), 8), 0);
        assert_eq!(cuParamSeti(f, 6, 1), 1, "past the buffer");
        assert_eq!(cuParamSeti(f, -4, 1), 1);
        let zero = 0u32;
        assert_eq!(cuMemcpyHtoD_v2(out, (&raw const zero).cast(), 4), 0);
        assert_eq!(cuLaunchGrid(f, 2, 1), 0);
        let mut got = 0u32;
        assert_eq!(cuMemcpyDtoH_v2((&raw mut got).cast(), out, 4), 0);
        assert_eq!(got, 5, "the kernel ran with the parameters set");
        assert_eq!(cuLaunchGrid(f, 0, 1), 1, "an empty grid");
        assert_eq!(cuLaunch(m), 400, "a module");
        assert_eq!(cuParamSetSize(f, 4), 0);
        assert_eq!(cuLaunch(f), 1, "a buffer of the wrong size");

        // Contexts of CUDA 1: attached and detached; the PCI bus id finds the device.
        let mut attached: Handle = null_mut();
        assert_eq!(cuCtxAttach(&mut attached, 1), 1, "no flags are defined");
        assert_eq!(cuCtxAttach(&mut attached, 0), 0);
        assert_eq!(attached, ctx);
        assert_eq!(cuCtxDetach(primary), 201, "not current");
        assert_eq!(cuCtxDetach(ctx), 0, "still created, still current");
        assert_eq!(cuCtxGetFlags(&mut flags), 0);
        let mut found = -1;
        assert_eq!(
            cuDeviceGetByPCIBusId(&mut found, c"0000:00:00.0".as_ptr()),
            0
        );
        assert_eq!(found, 0);
        assert_eq!(cuDeviceGetByPCIBusId(&mut found, c"00:00.0".as_ptr()), 0);
        assert_eq!(
            cuDeviceGetByPCIBusId(&mut found, c"0000:01:00.0".as_ptr()),
            101
        );
        assert_eq!(cuDeviceGetByPCIBusId(&mut found, std::ptr::null()), 1);

        // Profiler control: no profiler attached, so it succeeds and collects nothing.
        assert_eq!(cuProfilerStart(), 0);
        assert_eq!(cuProfilerStop(), 0);

        let mut prop = DevProp::default();
        assert_eq!(cuDeviceGetProperties(&mut prop, 0), 0);
        assert_eq!(prop.max_threads_per_block, 1024);
        assert_eq!(prop.simd_width, 32);
        assert_eq!(prop.max_threads_dim, [1024, 1024, 64]);
        assert_eq!(prop.regs_per_block, 65536);
        assert_eq!(cuDeviceGetProperties(&mut prop, 1), 101);
        assert_eq!(cuDeviceGetProperties(null_mut(), 0), 1);

        assert_eq!(cuCtxDestroy_v2(ctx), 0);
        let mut top: Handle = null_mut();
        assert_eq!(cuCtxPopCurrent_v2(&mut top), 201, "the stack is empty");
        assert_eq!(cuProfilerStart(), 201, "no context");
    }
    host.close();
}
