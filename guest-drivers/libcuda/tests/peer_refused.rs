//! Copies between two contexts (`cuMemcpyPeer`), `cuModuleLoadFatBinary`, and the entry points a
//! real driver exports that this device refuses (texture references, IPC): they resolve and
//! answer CUDA_ERROR_NOT_SUPPORTED. Against a served CPU backend; one test (the driver is
//! process-global).

use std::ffi::{CStr, c_int, c_uint, c_void};
use std::ptr::null_mut;

// The entry points are this crate's `#[no_mangle]` functions: link it.
extern crate cuda;

mod support;

type Handle = *mut c_void;

/// `CUipcMemHandle`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcMemHandle([u8; 64]);

unsafe extern "C" {
    fn cuInit(flags: c_uint) -> c_uint;
    fn cuCtxCreate_v2(ctx: *mut Handle, flags: c_uint, dev: c_int) -> c_uint;
    fn cuCtxSetCurrent(ctx: Handle) -> c_uint;
    fn cuCtxDestroy_v2(ctx: Handle) -> c_uint;
    fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> c_uint;
    fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> c_uint;
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> c_uint;
    fn cuMemcpyPeer(dst: u64, dst_ctx: Handle, src: u64, src_ctx: Handle, n: usize) -> c_uint;
    fn cuMemcpyPeerAsync(
        dst: u64,
        dst_ctx: Handle,
        src: u64,
        src_ctx: Handle,
        n: usize,
        stream: Handle,
    ) -> c_uint;
    fn cuModuleLoadFatBinary(module: *mut Handle, image: *const c_void) -> c_uint;
    fn cuModuleGetFunction(f: *mut Handle, module: Handle, name: *const i8) -> c_uint;
    fn cuModuleGetTexRef(tex: *mut Handle, module: Handle, name: *const i8) -> c_uint;
    fn cuTexRefSetArray(tex: Handle, array: Handle, flags: c_uint) -> c_uint;
    fn cuGetErrorString(status: c_uint, out: *mut *const std::ffi::c_char) -> c_uint;
    fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> c_uint;
    fn cuGraphicsUnregisterResource(resource: Handle) -> c_uint;
    fn cuIpcGetMemHandle(handle: *mut IpcMemHandle, dptr: u64) -> c_uint;
    fn cuIpcOpenMemHandle_v2(dptr: *mut u64, handle: IpcMemHandle, flags: c_uint) -> c_uint;
}

const PUT: &CStr = c".version 8.5\n.target sm_75\n.address_size 64\n\
    .visible .entry put(.param .u64 p)\n{\n.reg .b64 %rd<2>;\n\
    ld.param.u64 %rd1, [p];\nst.global.u32 [%rd1], 7;\nret;\n}\n";

/// A kernel using `redux.sync` (sm_80; the executor advertises sm_75), on line 7.
const REDUX: &CStr = c".version 8.5\n.target sm_75\n.address_size 64\n\
    .visible .entry r()\n{\n.reg .b32 %r<2>;\nredux.sync.add.u32 %r1, %r0, 0xffffffff;\nret;\n}\n";

/// What `cuGetErrorString` answers for `status` on this thread.
fn error_string(status: c_uint) -> String {
    let mut text = std::ptr::null();
    // SAFETY: a live out-pointer; the answer is a NUL-terminated string the library keeps.
    unsafe {
        assert_eq!(cuGetErrorString(status, &mut text), 0);
        CStr::from_ptr(text).to_string_lossy().into_owned()
    }
}

/// The bytes copied between contexts: more than one step of the library's bounce buffer.
const BYTES: usize = (1 << 20) + 4096 + 3;

#[test]
fn peer_copies_fat_binaries_and_refused_entry_points() {
    let host = support::serve_cpu_backend("peer");
    // SAFETY: the driver's C entry points, called as a C program calls them, with live
    // pointers to locals of the right types.
    unsafe {
        assert_eq!(cuInit(0), 0);
        let (mut a, mut b) = (null_mut(), null_mut());
        assert_eq!(cuCtxCreate_v2(&mut a, 0, 0), 0);
        let mut in_a = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut in_a, BYTES), 0);
        let data: Vec<u8> = (0..BYTES).map(|i| (i * 7 + i / 4096) as u8).collect();
        assert_eq!(cuMemcpyHtoD_v2(in_a, data.as_ptr().cast(), BYTES), 0);
        assert_eq!(cuCtxCreate_v2(&mut b, 0, 0), 0);
        let mut in_b = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut in_b, BYTES), 0);

        assert_eq!(cuMemcpyPeer(in_b, b, in_a, a, BYTES), 0);
        let mut back = vec![0u8; BYTES];
        assert_eq!(cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), in_b, BYTES), 0);
        assert!(back == data, "the peer copy moved other bytes");
        // The async form on the NULL stream, the other way, a part only.
        assert_eq!(fill_first_page(in_b), 0);
        assert_eq!(cuMemcpyPeerAsync(in_a, a, in_b, b, 4096, null_mut()), 0);
        assert_eq!(cuCtxSetCurrent(a), 0);
        assert_eq!(cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), in_a, 4096), 0);
        assert!(back[..4096].iter().all(|&x| x == 0x5a));
        assert_eq!(back[4096..], data[4096..]);

        // What a buggy program passes: no context, a destroyed one, a span past its end or
        // wrapping around, a source outside the source context.
        assert_eq!(cuMemcpyPeer(in_b, null_mut(), in_a, a, 16), 201);
        assert_eq!(cuMemcpyPeer(in_b, b, in_a, 0x1234 as Handle, 16), 201);
        assert_eq!(cuMemcpyPeer(in_b, b, in_a, a, BYTES + 1), 1);
        assert_eq!(cuMemcpyPeer(in_b, b, u64::MAX - 8, a, 16), 1);
        assert_eq!(cuMemcpyPeer(in_b, b, in_b, a, 16), 1);
        assert_eq!(cuCtxDestroy_v2(b), 0);
        assert_eq!(cuMemcpyPeer(in_b, b, in_a, a, 16), 201);

        // A fat binary is an image cuModuleLoadData takes (PTX text here).
        assert_eq!(cuCtxSetCurrent(a), 0);
        let (mut m, mut f) = (null_mut(), null_mut());
        assert_eq!(cuModuleLoadFatBinary(&mut m, PUT.as_ptr().cast()), 0);
        assert_eq!(cuModuleGetFunction(&mut f, m, c"put".as_ptr()), 0);
        assert_eq!(
            cuModuleLoadFatBinary(&mut m, c"not an image".as_ptr().cast()),
            200
        );

        // A refusal names what was refused: the host's message comes with its status and is
        // what cuGetErrorString says for it on this thread (not on another one).
        let standard = error_string(218);
        assert_eq!(cuModuleLoadData(&mut m, REDUX.as_ptr().cast()), 218);
        let explained = error_string(218);
        assert!(
            explained.starts_with(&standard)
                && explained.contains("redux")
                && explained.contains("line 7"),
            "{explained}"
        );
        assert_eq!(
            std::thread::spawn(|| error_string(218)).join().unwrap(),
            standard
        );
        assert_eq!(error_string(1), error_string(1));

        // Exported, refused whatever they are given.
        let mut tex = null_mut();
        assert_eq!(cuModuleGetTexRef(&mut tex, m, c"t".as_ptr()), 801);
        assert_eq!(cuTexRefSetArray(null_mut(), null_mut(), 0), 801);
        assert_eq!(cuGraphicsUnregisterResource(null_mut()), 801);
        let mut handle = IpcMemHandle([0; 64]);
        assert_eq!(cuIpcGetMemHandle(&mut handle, in_a), 801);
        let mut opened = 0u64;
        assert_eq!(cuIpcOpenMemHandle_v2(&mut opened, handle, 1), 801);
        assert_eq!(opened, 0);
    }
    host.close();
}

/// Fills the first 4 KiB at `dptr` (in the current context) with 0x5a through a host buffer.
unsafe fn fill_first_page(dptr: u64) -> c_uint {
    let fill = [0x5au8; 4096];
    // SAFETY: a live local buffer of the size passed.
    unsafe { cuMemcpyHtoD_v2(dptr, fill.as_ptr().cast(), fill.len()) }
}
