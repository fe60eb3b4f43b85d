//! The library's C entry points called as a C program calls them, against a served CPU backend
//! on a Unix socket: the calls libgomp and cudart make, and what a buggy program passes
//! (NULL out-pointers, handles of the wrong kind, a destroyed context, an empty context stack).
//! One test: the driver is process-global, as in a real process.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::ptr::{null, null_mut};

// The entry points are this crate's `#[no_mangle]` functions: link it.
extern crate cuda;

mod support;

type Handle = *mut c_void;

unsafe extern "C" {
    fn cuInit(flags: c_uint) -> c_uint;
    fn cuDriverGetVersion(v: *mut c_int) -> c_uint;
    fn cuDeviceGetCount(n: *mut c_int) -> c_uint;
    fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> c_uint;
    fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> c_uint;
    fn cuDeviceGetAttribute(v: *mut c_int, attribute: c_int, dev: c_int) -> c_uint;
    fn cuCtxCreate_v2(ctx: *mut Handle, flags: c_uint, dev: c_int) -> c_uint;
    fn cuCtxDestroy(ctx: Handle) -> c_uint;
    fn cuCtxPopCurrent(ctx: *mut Handle) -> c_uint;
    fn cuCtxGetCurrent(ctx: *mut Handle) -> c_uint;
    fn cuCtxSetCurrent(ctx: Handle) -> c_uint;
    fn cuCtxSynchronize() -> c_uint;
    fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> c_uint;
    fn cuModuleGetFunction(f: *mut Handle, module: Handle, name: *const c_char) -> c_uint;
    fn cuMemAlloc(dptr: *mut u64, bytes: usize) -> c_uint;
    fn cuMemFree(dptr: u64) -> c_uint;
    fn cuMemGetAddressRange(base: *mut u64, size: *mut usize, dptr: u64) -> c_uint;
    fn cuMemcpyHtoD(dst: u64, src: *const c_void, n: usize) -> c_uint;
    fn cuMemcpyDtoH(dst: *mut c_void, src: u64, n: usize) -> c_uint;
    fn cuMemsetD32(dst: u64, value: c_uint, n: usize) -> c_uint;
    fn cuStreamCreate(s: *mut Handle, flags: c_uint) -> c_uint;
    fn cuStreamSynchronize(s: Handle) -> c_uint;
    fn cuEventCreate(e: *mut Handle, flags: c_uint) -> c_uint;
    fn cuEventRecord(e: Handle, s: Handle) -> c_uint;
    fn cuEventElapsedTime(ms: *mut f32, a: Handle, b: Handle) -> c_uint;
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
    fn cuGetErrorName(status: c_uint, out: *mut *const c_char) -> c_uint;
    fn cuModuleGetLoadingMode(mode: *mut c_int) -> c_uint;
    #[allow(clippy::too_many_arguments)]
    fn cuLibraryLoadData(
        library: *mut Handle,
        code: *const c_void,
        jit_options: *mut c_int,
        jit_values: *mut *mut c_void,
        jit_count: c_uint,
        library_options: *mut c_int,
        library_values: *mut *mut c_void,
        library_count: c_uint,
    ) -> c_uint;
    fn cuLibraryGetKernel(kernel: *mut Handle, library: Handle, name: *const c_char) -> c_uint;
    fn cuLibraryGetModule(module: *mut Handle, library: Handle) -> c_uint;
    fn cuLibraryUnload(library: Handle) -> c_uint;
    fn cuKernelGetFunction(f: *mut Handle, kernel: Handle) -> c_uint;
    fn cuGetExportTable(table: *mut *const c_void, id: *const [u8; 16]) -> c_uint;
}

const PUT: &CStr = c".version 8.5\n.target sm_75\n.address_size 64\n\
    .visible .entry put(.param .u64 p, .param .u32 v)\n{\n.reg .b32 %r<2>;\n.reg .b64 %rd<2>;\n\
    ld.param.u64 %rd1, [p];\nld.param.u32 %r1, [v];\nst.global.u32 [%rd1], %r1;\nret;\n}\n";

#[test]
fn the_c_entry_points_work_and_refuse_bad_arguments() {
    let host = support::serve_cpu_backend("c-api");

    // SAFETY: every call below passes arguments as the driver API documents them (valid
    // out-pointers, buffers of the stated sizes), or NULL and wrong handles where the test
    // checks that they are refused.
    unsafe {
        let mut v = 0;
        assert_eq!(
            cuDeviceGetCount(&mut v),
            3,
            "before cuInit: not initialised"
        );
        assert_eq!(cuInit(0), 0);
        assert_eq!(cuDriverGetVersion(&mut v), 0);
        assert!(v >= 12000);
        assert_eq!(cuDeviceGetCount(&mut v), 0);
        assert_eq!(v, 1);
        assert_eq!(cuDeviceGetCount(null_mut()), 1, "NULL out-pointer");
        let mut dev = -1;
        assert_eq!(cuDeviceGet(&mut dev, 1), 101, "no second device");
        assert_eq!(cuDeviceGet(&mut dev, 0), 0);
        let mut name = [0 as c_char; 8];
        assert_eq!(cuDeviceGetName(name.as_mut_ptr(), 8, dev), 0);
        assert_eq!(
            CStr::from_ptr(name.as_ptr()).to_bytes().len(),
            7,
            "cut to fit"
        );
        assert_eq!(cuDeviceGetAttribute(&mut v, 10, dev), 0);
        assert_eq!(v, 32, "warp size");
        assert_eq!(cuDeviceGetAttribute(&mut v, 100_000, dev), 1);

        let mut none: Handle = null_mut();
        assert_eq!(cuCtxPopCurrent(&mut none), 201, "empty context stack");
        let mut a: u64 = 0;
        assert_eq!(cuMemAlloc(&mut a, 16), 201, "no current context");

        let mut ctx: Handle = null_mut();
        assert_eq!(cuCtxCreate_v2(&mut ctx, 0, dev), 0);
        let mut cur: Handle = null_mut();
        assert_eq!(cuCtxGetCurrent(&mut cur), 0);
        assert_eq!(cur, ctx);
        let mut m: Handle = null_mut();
        assert_eq!(cuModuleLoadData(&mut m, PUT.as_ptr().cast()), 0);
        assert_eq!(cuModuleLoadData(&mut m, c"not ptx".as_ptr().cast()), 200);
        let mut f: Handle = null_mut();
        assert_eq!(cuModuleGetFunction(&mut f, m, c"nope".as_ptr()), 500);
        assert_eq!(
            cuModuleGetFunction(&mut f, ctx, c"put".as_ptr()),
            400,
            "a context"
        );
        assert_eq!(cuModuleGetFunction(&mut f, m, c"put".as_ptr()), 0);

        assert_eq!(cuMemAlloc(&mut a, 16), 0);
        let (mut base, mut size) = (0u64, 0usize);
        assert_eq!(cuMemGetAddressRange(&mut base, &mut size, a + 5), 0);
        assert_eq!((base, size), (a, 16));
        assert_eq!(cuMemsetD32(a, 0x0101_0101, 4), 0);
        let mut value: u32 = 42;
        let mut addr = a + 4;
        let mut params = [
            (&raw mut addr).cast::<c_void>(),
            (&raw mut value).cast::<c_void>(),
        ];
        let mut stream: Handle = null_mut();
        assert_eq!(cuStreamCreate(&mut stream, 0), 0);
        let (mut e0, mut e1): (Handle, Handle) = (null_mut(), null_mut());
        assert_eq!(cuEventCreate(&mut e0, 0), 0);
        assert_eq!(cuEventCreate(&mut e1, 0), 0);
        assert_eq!(cuEventRecord(e0, stream), 0);
        let launch = |grid: c_uint, params: *mut *mut c_void| {
            cuLaunchKernel(f, grid, 1, 1, 1, 1, 1, 0, stream, params, null_mut())
        };
        assert_eq!(launch(1, params.as_mut_ptr()), 0);
        assert_eq!(launch(0, params.as_mut_ptr()), 1, "empty grid");
        assert_eq!(
            launch(1, null_mut()),
            1,
            "no parameters for a kernel that takes two"
        );
        assert_eq!(cuEventRecord(e1, stream), 0);
        assert_eq!(
            cuEventRecord(stream, stream),
            400,
            "a stream is not an event"
        );
        assert_eq!(cuStreamSynchronize(stream), 0);
        let mut ms = -1.0f32;
        assert_eq!(cuEventElapsedTime(&mut ms, e0, e1), 0);
        assert!(ms >= 0.0);
        let src = 7u32.to_le_bytes();
        assert_eq!(cuMemcpyHtoD(a, src.as_ptr().cast(), 4), 0);
        assert_eq!(cuMemcpyHtoD(a, null(), 4), 1, "NULL source");
        let mut out = [0u8; 16];
        assert_eq!(cuMemcpyDtoH(out.as_mut_ptr().cast(), a, 16), 0);
        let words: Vec<u32> = out
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(words, [7, 42, 0x0101_0101, 0x0101_0101]);
        assert_eq!(
            cuMemcpyDtoH(out.as_mut_ptr().cast(), a + 8, 16),
            1,
            "past the end"
        );

        // Libraries, as cudart 12 and 13 load their fat binaries: a kernel handle launches.
        let mut mode = 0;
        assert_eq!(cuModuleGetLoadingMode(&mut mode), 0);
        assert_eq!(mode, 1, "eager");
        let load = |lib: *mut Handle, image: *const c_void| {
            cuLibraryLoadData(
                lib,
                image,
                null_mut(),
                null_mut(),
                0,
                null_mut(),
                null_mut(),
                0,
            )
        };
        let mut lib: Handle = null_mut();
        assert_eq!(load(&mut lib, c"not ptx".as_ptr().cast()), 200);
        assert_eq!(load(null_mut(), PUT.as_ptr().cast()), 1, "NULL out-pointer");
        assert_eq!(load(&mut lib, PUT.as_ptr().cast()), 0);
        let mut kernel: Handle = null_mut();
        assert_eq!(cuLibraryGetKernel(&mut kernel, lib, c"nope".as_ptr()), 500);
        assert_eq!(
            cuLibraryGetKernel(&mut kernel, m, c"put".as_ptr()),
            400,
            "a module"
        );
        assert_eq!(cuLibraryGetKernel(&mut kernel, lib, c"put".as_ptr()), 0);
        let (mut kf, mut lm): (Handle, Handle) = (null_mut(), null_mut());
        assert_eq!(cuKernelGetFunction(&mut kf, kernel), 0);
        assert_eq!(cuKernelGetFunction(&mut kf, lib), 400, "a library");
        assert_eq!(cuLibraryGetModule(&mut lm, lib), 0);
        assert!(!kf.is_null() && !lm.is_null() && kf != kernel);
        value = 9;
        let by_kernel = cuLaunchKernel(
            kernel,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            null_mut(),
        );
        assert_eq!(by_kernel, 0);
        assert_eq!(cuMemcpyDtoH(out.as_mut_ptr().cast(), a + 4, 4), 0);
        assert_eq!(u32::from_le_bytes(out[..4].try_into().unwrap()), 9);
        assert_eq!(cuLibraryUnload(lib), 0);
        assert_eq!(cuLibraryUnload(lib), 400, "twice");
        assert_eq!(
            cuKernelGetFunction(&mut kf, kernel),
            400,
            "gone with its library"
        );

        // cudart's integrity check: slot 1 of its table writes 16 bytes; fixed for versions
        // ending in 0, keyed (and so different) otherwise.
        const INTEGRITY: [u8; 16] = [
            0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66,
            0xe1, 0xf2,
        ];
        let mut table: *const c_void = null();
        assert_eq!(cuGetExportTable(&mut table, &INTEGRITY), 0);
        let slots = table.cast::<usize>();
        assert_eq!(*slots, 3 * 8, "the table's size");
        type Check = unsafe extern "C" fn(c_uint, u64, *mut [u8; 16]) -> c_uint;
        let check: Check = std::mem::transmute::<usize, Check>(*slots.add(1));
        let (mut fixed, mut keyed) = ([0u8; 16], [0u8; 16]);
        assert_eq!(check(13050, 1_790_000_000, &mut fixed), 0);
        assert_eq!(&fixed[..8], &0x3341_181c_03cb_675cu64.to_le_bytes());
        assert_eq!(check(13052, 1_790_000_000, &mut keyed), 0);
        assert_ne!(keyed, fixed);
        assert_eq!(check(13052, 1_790_000_000, null_mut()), 1, "NULL result");

        // A fault breaks the context: reported at the next synchronisation, sticky after.
        let mut wild = a + (1 << 30);
        let mut faulting = [
            (&raw mut wild).cast::<c_void>(),
            (&raw mut value).cast::<c_void>(),
        ];
        assert_eq!(launch(1, faulting.as_mut_ptr()), 0, "asynchronous");
        assert_eq!(cuCtxSynchronize(), 700);
        assert_eq!(cuCtxSynchronize(), 719);
        let mut text: *const c_char = null();
        assert_eq!(cuGetErrorName(700, &mut text), 0);
        assert_eq!(CStr::from_ptr(text), c"CUDA_ERROR_ILLEGAL_ADDRESS");
        assert_eq!(cuGetErrorName(12345, &mut text), 1);

        assert_eq!(
            cuMemFree(a),
            719,
            "the broken context answers only its error"
        );
        assert_eq!(cuCtxDestroy(ctx), 0);
        assert_eq!(cuCtxDestroy(ctx), 201, "twice");
        assert_eq!(cuCtxSetCurrent(ctx), 201, "destroyed");
        assert_eq!(cuCtxGetCurrent(&mut cur), 0);
        assert!(cur.is_null());
    }
    host.close();
}
