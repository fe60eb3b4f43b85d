//! `cuGetExportTable`: the driver's private tables that the CUDA runtime (cudart, linked
//! statically into every nvcc-built program by default) asks for by UUID before anything else.
//! Their layout (a table's first word is its size in bytes, then function pointers by slot) and
//! the meaning of the slots used here were learnt from the projects that run unmodified CUDA
//! programs on other drivers (ZLUDA among them); the code is this project's.
//!
//! Tables not known here answer `CUDA_ERROR_NOT_FOUND`, which cudart takes as "not provided"
//! (for the CUDA 13 bootstrap-bypass table that is what makes it take the ordinary path).

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

use crate::api;
use crate::integrity;
use crate::status::*;

type CUresult = c_uint;
type Uuid = [u8; 16];

/// cudart's interface to the driver: modules from embedded fat binaries, the primary context.
const CUDART_INTERFACE: Uuid = [
    0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9,
];

/// Profiler hooks cudart brackets its calls with: no tool is attached, so they do nothing,
/// but they must exist and be callable.
const TOOLS_RUNTIME_CALLBACK_HOOKS: Uuid = [
    0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66,
];
/// Thread-local tool state.
const TOOLS_TLS: Uuid = [
    0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc,
];
/// Per-context key–value storage cudart keeps its state in.
const CONTEXT_LOCAL_STORAGE: Uuid = [
    0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93,
];
/// Context checks cudart asks before using a context.
const CONTEXT_CHECKS: Uuid = [
    0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e,
];

/// Context identity: cudart asks for a context's unique id through slot 4 (what `cuCtxGetId`
/// answers); the other slots are not provided.
const CONTEXT_IDENTITY: Uuid = [
    0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2,
];

/// cudart's integrity check: slot 1 answers a token over the process, the tables and the
/// devices that cudart verifies (`integrity.rs`).
const INTEGRITY_CHECK: Uuid = [
    0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2,
];

/// The `__fatbinwrap` struct nvcc emits and `__cudaRegisterFatBinary` passes on.
#[repr(C)]
struct FatbinWrapper {
    magic: c_uint,
    version: c_uint,
    data: *const c_void,
    filename_or_fatbins: *const c_void,
}

/// Magic of [`FatbinWrapper`].
const FATBIN_WRAPPER_MAGIC: c_uint = 0x4662_43b1;

fn wrapped_fatbin(wrapper: *const FatbinWrapper) -> Option<*const c_void> {
    if wrapper.is_null() {
        return None;
    }
    // SAFETY: cudart passes the wrapper nvcc emitted into the program's data, readable for its
    // size; `read_unaligned` needs no alignment.
    let w = unsafe { wrapper.read_unaligned() };
    (w.magic == FATBIN_WRAPPER_MAGIC && !w.data.is_null()).then_some(w.data)
}

/// Slot 1: a module from a fat-binary wrapper, in the current context.
extern "C" fn module_from_wrapper(
    module: *mut *mut c_void,
    wrapper: *const FatbinWrapper,
) -> CUresult {
    match wrapped_fatbin(wrapper) {
        // SAFETY: our own entry point, with the caller's out-pointer and a fat binary.
        Some(fatbin) => unsafe { api::cuModuleLoadData(module, fatbin) },
        None => CUDA_ERROR_INVALID_IMAGE,
    }
}

/// Slot 2: the device's primary context.
extern "C" fn primary_context(pctx: *mut *mut c_void, device: c_int) -> CUresult {
    // SAFETY: our own entry point with the caller's out-pointer.
    unsafe { api::cuDevicePrimaryCtxRetain(pctx, device) }
}

/// Slot 6: as slot 1, with arguments this driver does not need.
extern "C" fn module_from_wrapper_ext(
    module: *mut *mut c_void,
    wrapper: *const FatbinWrapper,
    _a: *mut c_void,
    _b: *mut c_void,
    _c: c_uint,
) -> CUresult {
    module_from_wrapper(module, wrapper)
}

/// Slot 7: a notification with nothing to do here.
extern "C" fn ignore(_arg: usize) {}

/// Slot 8: a module from a fat binary itself (the module pointer comes second).
extern "C" fn module_from_fatbin(
    fatbin: *const c_void,
    module: *mut *mut c_void,
    _a: *mut c_void,
    _b: *mut c_void,
    _c: c_uint,
) -> CUresult {
    if fatbin.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: our own entry point with the caller's out-pointer and fat binary.
    unsafe { api::cuModuleLoadData(module, fatbin) }
}

/// Slot 12: load the JIT compilers (the host's executor needs none).
extern "C" fn load_compilers() -> CUresult {
    CUDA_SUCCESS
}

/// Bytes of the tools' scratch buffers cudart asks for (slots 2 and 6 of the hooks table).
const TOOLS_BUFFER_BYTES: [usize; 2] = [1024, 14];

extern "C" fn tools_event(_event: c_uint, _data: *mut c_void) {}

extern "C" fn tools_span(_a: *mut c_void, _b: *mut c_void) {}

fn tools_buffer(which: usize, ptr: *mut *mut c_void, size: *mut usize) {
    static BUFFERS: [OnceLock<usize>; 2] = [OnceLock::new(), OnceLock::new()];
    let n = TOOLS_BUFFER_BYTES[which];
    let p = *BUFFERS[which]
        .get_or_init(|| Box::leak(vec![0u8; n].into_boxed_slice()).as_mut_ptr() as usize);
    if !ptr.is_null() {
        // SAFETY: cudart's out-pointer for the buffer's address.
        unsafe { ptr.write_unaligned(p as *mut c_void) };
    }
    if !size.is_null() {
        // SAFETY: cudart's out-pointer for the buffer's size.
        unsafe { size.write_unaligned(n) };
    }
}

extern "C" fn tools_buffer_large(ptr: *mut *mut c_void, size: *mut usize) {
    tools_buffer(0, ptr, size)
}

extern "C" fn tools_buffer_small(ptr: *mut *mut c_void, size: *mut usize) {
    tools_buffer(1, ptr, size)
}

extern "C" fn tools_tls(_record: *mut c_void) {}

/// (context, key) → value of [`CONTEXT_LOCAL_STORAGE`].
fn storage() -> &'static Mutex<HashMap<(usize, usize), usize>> {
    static S: OnceLock<Mutex<HashMap<(usize, usize), usize>>> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// Most entries the context storage keeps (cudart stores a handful per context).
const MAX_STORAGE_ENTRIES: usize = 4096;

/// The context a storage call means: the given one, or the current one for NULL.
fn storage_context(ctx: *mut c_void) -> Result<usize, CUresult> {
    if !ctx.is_null() {
        return Ok(ctx as usize);
    }
    let mut cur: *mut c_void = std::ptr::null_mut();
    // SAFETY: our own entry point with a valid out-pointer.
    match unsafe { api::cuCtxGetCurrent(&mut cur) } {
        CUDA_SUCCESS if !cur.is_null() => Ok(cur as usize),
        CUDA_SUCCESS => Err(CUDA_ERROR_INVALID_CONTEXT),
        e => Err(e),
    }
}

extern "C" fn storage_put(
    ctx: *mut c_void,
    key: *mut c_void,
    value: *mut c_void,
    _dtor: *mut c_void,
) -> CUresult {
    let ctx = match storage_context(ctx) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let mut s = storage().lock().unwrap_or_else(|p| p.into_inner());
    if s.len() >= MAX_STORAGE_ENTRIES && !s.contains_key(&(ctx, key as usize)) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    s.insert((ctx, key as usize), value as usize);
    CUDA_SUCCESS
}

extern "C" fn storage_delete(ctx: *mut c_void, key: *mut c_void) -> CUresult {
    let ctx = match storage_context(ctx) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let mut s = storage().lock().unwrap_or_else(|p| p.into_inner());
    match s.remove(&(ctx, key as usize)) {
        Some(_) => CUDA_SUCCESS,
        None => CUDA_ERROR_NOT_FOUND,
    }
}

extern "C" fn storage_get(value: *mut *mut c_void, ctx: *mut c_void, key: *mut c_void) -> CUresult {
    if value.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let ctx = match storage_context(ctx) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let s = storage().lock().unwrap_or_else(|p| p.into_inner());
    let (v, status) = match s.get(&(ctx, key as usize)) {
        Some(&v) => (v, CUDA_SUCCESS),
        None => (0, CUDA_ERROR_NOT_FOUND),
    };
    // SAFETY: checked non-NULL above; cudart's out-pointer.
    unsafe { value.write_unaligned(v as *mut c_void) };
    status
}

/// Slot 2 of [`CONTEXT_CHECKS`]: the context is fine (result 0).
extern "C" fn context_check(
    _ctx: *mut c_void,
    result: *mut c_uint,
    _detail: *mut *const c_void,
) -> CUresult {
    if !result.is_null() {
        // SAFETY: cudart's out-pointer.
        unsafe { result.write_unaligned(0) };
    }
    CUDA_SUCCESS
}

extern "C" fn context_check_flags() -> c_uint {
    0
}

extern "C" fn not_supported() -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

extern "C" fn context_id(ctx: *mut c_void, id: *mut u64) -> CUresult {
    // SAFETY: our own entry point with cudart's arguments.
    unsafe { api::cuCtxGetId(ctx, id) }
}

/// CUdevice_attribute numbers of the PCI domain, bus and device ids.
const PCI_ATTRIBUTES: [c_int; 3] = [50, 33, 34];

/// What the integrity check says about device `dev`, from this library's own answers (the
/// ones cudart hashes on its side).
fn device_identity(dev: c_int) -> Result<integrity::DeviceIdentity, CUresult> {
    let mut uuid = [0u8; 16];
    // SAFETY: our own entry point with a valid out-pointer.
    api::status(unsafe { api::cuDeviceGetUuid_v2(&mut uuid, dev) })?;
    let mut pci = [0 as c_int; 3];
    for (value, attribute) in pci.iter_mut().zip(PCI_ATTRIBUTES) {
        // SAFETY: as above.
        api::status(unsafe { api::cuDeviceGetAttribute(value, attribute, dev) })?;
    }
    Ok(integrity::DeviceIdentity {
        uuid,
        pci_domain: pci[0],
        pci_bus: pci[1],
        pci_device: pci[2],
    })
}

/// The integrity check's inputs from this library's own answers, and its token.
fn integrity_token(runtime_version: c_uint, unix_seconds: u64) -> Result<[u8; 16], CUresult> {
    let (mut driver_version, mut count) = (0 as c_int, 0 as c_int);
    // SAFETY: our own entry points with valid out-pointers.
    api::status(unsafe { api::cuDriverGetVersion(&mut driver_version) })?;
    // SAFETY: as above.
    api::status(unsafe { api::cuDeviceGetCount(&mut count) })?;
    let devices = (0..count)
        .map(device_identity)
        .collect::<Result<Vec<_>, _>>()?;
    let record = integrity::Record {
        driver_version: driver_version as u32,
        runtime_version,
        // SAFETY: getpid cannot fail and touches no memory.
        process: unsafe { libc::getpid() } as u32,
        // SAFETY: nor does pthread_self; the check covers the low half of the handle.
        thread: unsafe { libc::pthread_self() } as u32,
        cudart_table: cudart_interface() as u64,
        integrity_table: integrity_table() as u64,
        check_function: integrity_check as *const () as u64,
        unix_seconds,
    };
    Ok(integrity::answer(&record, &devices))
}

/// Slot 1 of [`INTEGRITY_CHECK`].
extern "C" fn integrity_check(
    runtime_version: c_uint,
    unix_seconds: u64,
    result: *mut [u8; 16],
) -> CUresult {
    if result.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match integrity_token(runtime_version, unix_seconds) {
        Ok(token) => {
            // SAFETY: checked non-NULL above; cudart's 16-byte out-buffer.
            unsafe { result.write_unaligned(token) };
            CUDA_SUCCESS
        }
        Err(e) => e,
    }
}

/// Builds a table: its size in bytes first, then the slots.
fn table<const N: usize>(slots: [usize; N]) -> [usize; N] {
    let mut t = slots;
    t[0] = N * std::mem::size_of::<usize>();
    t
}

fn cudart_interface() -> *const c_void {
    static T: OnceLock<[usize; 13]> = OnceLock::new();
    T.get_or_init(|| {
        table([
            0,
            module_from_wrapper as *const () as usize,
            primary_context as *const () as usize,
            0,
            0,
            0,
            module_from_wrapper_ext as *const () as usize,
            ignore as *const () as usize,
            module_from_fatbin as *const () as usize,
            0,
            0,
            0,
            load_compilers as *const () as usize,
        ])
    })
    .as_ptr()
    .cast()
}

fn tools_hooks() -> *const c_void {
    static T: OnceLock<[usize; 7]> = OnceLock::new();
    T.get_or_init(|| {
        table([
            0,
            tools_event as *const () as usize,
            tools_buffer_large as *const () as usize,
            0,
            tools_span as *const () as usize,
            0,
            tools_buffer_small as *const () as usize,
        ])
    })
    .as_ptr()
    .cast()
}

fn tools_tls_table() -> *const c_void {
    static T: OnceLock<[usize; 4]> = OnceLock::new();
    T.get_or_init(|| table([0, 0, tools_tls as *const () as usize, 0]))
        .as_ptr()
        .cast()
}

/// This table has no size word: its slots start at once.
fn context_storage() -> *const c_void {
    static T: OnceLock<[usize; 4]> = OnceLock::new();
    T.get_or_init(|| {
        [
            storage_put as *const () as usize,
            storage_delete as *const () as usize,
            storage_get as *const () as usize,
            0,
        ]
    })
    .as_ptr()
    .cast()
}

fn context_checks() -> *const c_void {
    static T: OnceLock<[usize; 4]> = OnceLock::new();
    T.get_or_init(|| {
        table([
            0,
            0,
            context_check as *const () as usize,
            context_check_flags as *const () as usize,
        ])
    })
    .as_ptr()
    .cast()
}

/// Slots of the context identity table: cudart 13's `cudaGraphLaunch` on a created stream
/// calls slot 51 (and, when that succeeds, slot 39), so the table reaches past it; every
/// slot but the id answers not supported, which cudart takes as "nothing to do".
const CONTEXT_IDENTITY_SLOTS: usize = 52;

fn context_identity() -> *const c_void {
    static T: OnceLock<[usize; CONTEXT_IDENTITY_SLOTS]> = OnceLock::new();
    T.get_or_init(|| {
        let mut slots = [not_supported as *const () as usize; CONTEXT_IDENTITY_SLOTS];
        slots[4] = context_id as *const () as usize;
        table(slots)
    })
    .as_ptr()
    .cast()
}

fn integrity_table() -> *const c_void {
    static T: OnceLock<[usize; 3]> = OnceLock::new();
    T.get_or_init(|| table([0, integrity_check as *const () as usize, 0]))
        .as_ptr()
        .cast()
}

/// The table for `uuid`, if this driver has it.
pub fn lookup(uuid: &Uuid) -> Option<*const c_void> {
    match *uuid {
        CUDART_INTERFACE => Some(cudart_interface()),
        TOOLS_RUNTIME_CALLBACK_HOOKS => Some(tools_hooks()),
        TOOLS_TLS => Some(tools_tls_table()),
        CONTEXT_LOCAL_STORAGE => Some(context_storage()),
        CONTEXT_CHECKS => Some(context_checks()),
        CONTEXT_IDENTITY => Some(context_identity()),
        INTEGRITY_CHECK => Some(integrity_table()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slot `i` of a table as a function pointer value.
    fn slot(t: *const c_void, i: usize) -> usize {
        // SAFETY: the tables above are arrays of at least `i + 1` words that live forever.
        unsafe { t.cast::<usize>().add(i).read() }
    }

    #[test]
    fn tables_start_with_their_size_and_unknown_uuids_are_not_found() {
        for (uuid, words) in [
            (CUDART_INTERFACE, 13),
            (TOOLS_RUNTIME_CALLBACK_HOOKS, 7),
            (TOOLS_TLS, 4),
            (CONTEXT_CHECKS, 4),
            (CONTEXT_IDENTITY, CONTEXT_IDENTITY_SLOTS),
            (INTEGRITY_CHECK, 3),
        ] {
            let t = lookup(&uuid).unwrap();
            assert_eq!(slot(t, 0), words * 8, "{uuid:02x?}");
        }
        assert_eq!(
            slot(lookup(&CUDART_INTERFACE).unwrap(), 2),
            primary_context as *const () as usize
        );
        assert!(lookup(&[0; 16]).is_none());
    }

    #[test]
    fn context_storage_keeps_values_per_context_and_key() {
        let (c1, c2) = (0x1000 as *mut c_void, 0x2000 as *mut c_void);
        let (k, v) = (0x77 as *mut c_void, 0x99 as *mut c_void);
        let mut out: *mut c_void = std::ptr::null_mut();
        assert_eq!(storage_put(c1, k, v, std::ptr::null_mut()), CUDA_SUCCESS);
        assert_eq!(storage_get(&mut out, c1, k), CUDA_SUCCESS);
        assert_eq!(out, v);
        assert_eq!(storage_get(&mut out, c2, k), CUDA_ERROR_NOT_FOUND);
        assert!(out.is_null());
        assert_eq!(
            storage_get(std::ptr::null_mut(), c1, k),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(storage_delete(c1, k), CUDA_SUCCESS);
        assert_eq!(storage_delete(c1, k), CUDA_ERROR_NOT_FOUND);
        // No current context (the driver is not initialised in this process).
        assert_eq!(
            storage_get(&mut out, std::ptr::null_mut(), k),
            CUDA_ERROR_INVALID_CONTEXT
        );
    }
}
