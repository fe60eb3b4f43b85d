//! The C entry points of `libcuda.so.1`: arguments read from and results written through the
//! caller's pointers (the only unsafe code of the library), then [`Driver`] does the work.
//! Every entry point catches panics, checks pointers for NULL, and returns a `CUresult`;
//! entry points the driver does not implement return `CUDA_ERROR_NOT_SUPPORTED` and say so
//! on standard error, once each.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::collections::{BTreeSet, HashSet};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

use mdev_backend::compute::ptx::MAX_PTX_BYTES;

use crate::array::Memory;
use crate::driver::{CuResult, Driver, Image, LINK_TOKEN_MAGIC, LaunchParams, StreamSettings};
use crate::status::*;
use crate::symbols::Resolution;
use crate::transport::Transport;

pub(crate) type CUresult = c_uint;
pub(crate) type Handle = *mut c_void;

/// The one device this driver presents.
const DEVICE: c_int = 0;
/// Largest image `cuModuleLoadData` reads through a pointer of unknown extent.
const MAX_IMAGE_BYTES: u64 = 256 << 20;
/// Environment variable: when set, every entry point called is written to standard error,
/// with how long it took.
const TRACE_ENV: &str = "VGPU_CUDA_TRACE";
/// Whether [`TRACE_ENV`] is set, read at the first call (every entry point asks).
static TRACING: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var_os(TRACE_ENV).is_some());

static DRIVER: Mutex<Option<Driver<Box<dyn Transport>>>> = Mutex::new(None);
static UNSUPPORTED_SEEN: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
static REFUSED_SEEN: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
/// Different refusals said on standard error (each once); later ones are not said.
const MAX_REFUSALS_SAID: usize = 256;
/// The texts `cuGetErrorString` gives for errors the host explained: kept for the process's
/// life (a caller may hold the pointer), so at most [`MAX_REFUSALS_SAID`] different ones; past
/// that the standard text is given.
static EXPLAINED: Mutex<Vec<std::ffi::CString>> = Mutex::new(Vec::new());

/// The statuses by which the device refuses work rather than fails running it: an invalid
/// image, no binary it runs, invalid PTX, launch out of resources, not supported.
const REFUSAL_STATUSES: [CUresult; 5] = [200, 209, 218, 701, 801];

thread_local! {
    /// The last error the host explained on this thread: its status and its text in
    /// [`EXPLAINED`] (a pointer that stays valid: those texts are never freed).
    static EXPLANATION: Cell<Option<(CUresult, usize)>> = const { Cell::new(None) };
}

/// Contexts one thread may have pushed (`cuCtxPushCurrent`).
const MAX_CONTEXT_STACK: usize = 32;

/// A thread's context stack; the last is current. Plain `Copy` data, so the thread-local
/// needs no destructor and stays usable while the process exits (libgomp's exit handlers
/// call the driver).
#[derive(Clone, Copy)]
struct Stack {
    items: [u64; MAX_CONTEXT_STACK],
    len: usize,
}

thread_local! {
    static CURRENT: Cell<Stack> = const {
        Cell::new(Stack {
            items: [0; MAX_CONTEXT_STACK],
            len: 0,
        })
    };
}

fn stack<R>(f: impl FnOnce(&mut Stack) -> R) -> R {
    CURRENT.with(|c| {
        let mut s = c.get();
        let r = f(&mut s);
        c.set(s);
        r
    })
}

fn push_current(ctx: u64) -> CuResult<()> {
    stack(|s| {
        if s.len == MAX_CONTEXT_STACK {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.items[s.len] = ctx;
        s.len += 1;
        Ok(())
    })
}

fn pop_current() -> Option<u64> {
    stack(|s| {
        s.len = s.len.checked_sub(1)?;
        Some(s.items[s.len])
    })
}

fn top() -> Option<u64> {
    stack(|s| s.len.checked_sub(1).map(|i| s.items[i]))
}

impl Transport for Box<dyn Transport> {
    fn call(
        &mut self,
        req: &mdev_backend::compute::wire::Request,
    ) -> Result<mdev_backend::compute::wire::Reply, crate::transport::TransportError> {
        (**self).call(req)
    }

    fn shared(&mut self) -> Option<crate::transport::Shared<'_>> {
        (**self).shared()
    }

    fn pinned(&mut self) -> Option<crate::transport::Pinned<'_>> {
        (**self).pinned()
    }
}

pub(crate) fn with<R>(
    f: impl FnOnce(&mut Driver<Box<dyn Transport>>) -> CuResult<R>,
) -> CuResult<R> {
    let mut guard = DRIVER.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.as_mut().ok_or(CUDA_ERROR_NOT_INITIALIZED)?)
}

pub(crate) fn current() -> CuResult<u64> {
    top().ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

/// Replaces the current context (the top of the stack).
fn set_current(ctx: Option<u64>) -> CuResult<()> {
    pop_current();
    ctx.map_or(Ok(()), push_current)
}

/// The context of a stream or event handle (the current one for the NULL stream).
pub(crate) fn owner(handle: Handle) -> CuResult<u64> {
    let h = handle as u64;
    if h <= 2 {
        return current();
    }
    with(|d| d.owner(h).ok_or(CUDA_ERROR_INVALID_HANDLE))
}

/// A status from one of our own entry points as a result.
pub(crate) fn status(r: CUresult) -> CuResult<()> {
    match r {
        CUDA_SUCCESS => Ok(()),
        e => Err(e),
    }
}

pub(crate) fn finish(r: std::thread::Result<CuResult<()>>) -> CUresult {
    match r {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(status)) => status,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// A failure of `name` that the host explained (the refused PTX construct and its line, the
/// limit a launch hit): until the next one on this thread its message is what
/// `cuGetErrorString` answers for that status, after the standard text; a refusal
/// ([`REFUSAL_STATUSES`]) is also said once on standard error.
/// `CUDA_ERROR_NOT_READY` is an answer, not a failure.
pub(crate) fn explain(name: &str, status: CUresult) {
    if status == CUDA_SUCCESS || status == CUDA_ERROR_NOT_READY {
        return;
    }
    // Never waits: a host callback running inside another entry point holds the driver.
    let taken = match DRIVER.try_lock() {
        Ok(mut d) => d.as_mut().and_then(|d| d.take_host_error()),
        Err(_) => None,
    };
    let Some((code, message)) = taken else { return };
    if code != status || message.is_empty() {
        return;
    }
    // Said on standard error when the device refused the work (an image or PTX construct it
    // does not run, a limit, a missing feature); a program's own faults and timeouts are its
    // to report.
    if REFUSAL_STATUSES.contains(&code) {
        refused(&format!("{name} -> {code}: {message}"));
    }
    let Some((_, standard)) = describe(code) else {
        return;
    };
    let text = format!("{}: {message}", standard.to_string_lossy()).replace('\0', " ");
    let Ok(text) = std::ffi::CString::new(text) else {
        return;
    };
    let mut kept = EXPLAINED.lock().unwrap_or_else(|p| p.into_inner());
    let at = match kept.iter().position(|k| *k == text) {
        Some(at) => at,
        None if kept.len() < MAX_REFUSALS_SAID => {
            kept.push(text);
            kept.len() - 1
        }
        None => return,
    };
    EXPLANATION.with(|e| e.set(Some((code, at))));
}

/// With [`TRACE_ENV`] set, the time a call starts (for [`trace`]).
pub(crate) fn trace_start() -> Option<std::time::Instant> {
    TRACING.then(std::time::Instant::now)
}

/// With [`TRACE_ENV`] set: each call on standard error, with how long it took (from
/// `started`) and its status when it failed.
pub(crate) fn trace(name: &str, started: Option<std::time::Instant>, status: CUresult) {
    if let Some(t) = started {
        let us = t.elapsed().as_micros();
        match status {
            CUDA_SUCCESS => eprintln!("vgpu libcuda: {name} ({us} us)"),
            s => eprintln!("vgpu libcuda: {name} -> {s} ({us} us)"),
        }
    }
}

pub(crate) fn unsupported(name: &'static str) -> CuResult<()> {
    let mut seen = UNSUPPORTED_SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.get_or_insert_with(HashSet::new).insert(name) {
        eprintln!("vgpu libcuda: {name} is not supported (CUDA_ERROR_NOT_SUPPORTED)");
    }
    Err(CUDA_ERROR_NOT_SUPPORTED)
}

/// Says once on standard error that a request was refused, naming what was refused.
fn refused(what: &str) {
    let mut seen = REFUSED_SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.len() < MAX_REFUSALS_SAID && seen.insert(what.to_owned()) {
        eprintln!("vgpu libcuda: refused: {what}");
    }
}

/// Writes a result through a caller's out-pointer.
pub(crate) fn put<T>(p: *mut T, v: T) -> CuResult<()> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the driver API's contract: a non-NULL out-pointer points to writable memory for
    // a value of the parameter's type; `write_unaligned` needs no alignment.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// Like [`put`], for out-pointers the API allows to be NULL.
fn put_opt<T>(p: *mut T, v: T) -> CuResult<()> {
    if p.is_null() { Ok(()) } else { put(p, v) }
}

/// `n` bytes the caller passed.
pub(crate) fn bytes<'a>(p: *const c_void, n: usize) -> CuResult<&'a [u8]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller passes `n` readable bytes at `p` (the copy and link calls' contract).
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n) })
}

/// Element `i` of a caller's array of `T`.
fn read_at<T: Copy>(array: *const T, i: usize) -> CuResult<T> {
    if array.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller's array has at least `i + 1` elements (the count it passed, or up to
    // its terminator); `read_unaligned` needs no alignment.
    Ok(unsafe { array.add(i).read_unaligned() })
}

/// The pointer-sized entry `i` of a caller's array of pointers.
fn entry_at(array: *mut *mut c_void, i: usize) -> CuResult<usize> {
    read_at(array.cast_const(), i).map(|p| p as usize)
}

/// `n` bytes the caller lets the driver write.
pub(crate) fn bytes_mut<'a>(p: *mut c_void, n: usize) -> CuResult<&'a mut [u8]> {
    if n == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller passes `n` writable bytes at `p` that nothing else accesses during
    // the call (the device-to-host copies' contract).
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), n) })
}

/// A NUL-terminated name.
fn name<'a>(p: *const c_char) -> CuResult<&'a str> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller passes a NUL-terminated string.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)
}

/// Copies a string into a caller's buffer of `len` bytes, NUL-terminated and cut to fit.
fn put_str(p: *mut c_char, len: c_int, s: &str) -> CuResult<()> {
    let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    if len == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let out = bytes_mut(p.cast(), len)?;
    let n = s.len().min(len - 1);
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
    out[n] = 0;
    Ok(())
}

/// The bytes of a module image given by pointer only, as `cuModuleLoadData` gets it: its
/// extent read from its own header (fat binary, fat-binary wrapper, ELF) or its terminating
/// NUL (PTX), at most [`MAX_IMAGE_BYTES`].
fn image_at<'a>(p: *const c_void) -> CuResult<&'a [u8]> {
    let word = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4"));
    let long = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8"));
    let mut p = p;
    let mut head = bytes(p, 16)?;
    // nvcc's wrapper struct { magic, version, data pointer, ... }: the fat binary it points
    // at (followed once: a wrapper of a wrapper is no image).
    if word(head, 0) == 0x4662_43B1 {
        p = long(head, 8) as *const c_void;
        head = bytes(p, 16)?;
    }
    let len = match word(head, 0) {
        // A fat binary: 16-byte header, then its size.
        0xBA55_ED50 => long(head, 8).checked_add(16),
        0x464C_457F => {
            let h = bytes(p, 64)?;
            let shoff = long(h, 0x28);
            let entsize = u64::from(u16::from_le_bytes([h[0x3a], h[0x3b]]));
            let shnum = u64::from(u16::from_le_bytes([h[0x3c], h[0x3d]]));
            shnum
                .checked_mul(entsize)
                .and_then(|t| t.checked_add(shoff))
        }
        _ => {
            // PTX text: up to its NUL.
            let mut n = 0usize;
            loop {
                if n >= MAX_PTX_BYTES {
                    return Err(CUDA_ERROR_INVALID_IMAGE);
                }
                // SAFETY: PTX passed to cuModuleLoadData is NUL-terminated, so every byte up
                // to the NUL is readable.
                if unsafe { *p.cast::<u8>().add(n) } == 0 {
                    break;
                }
                n += 1;
            }
            Some(n as u64)
        }
    }
    .filter(|&n| n <= MAX_IMAGE_BYTES)
    .ok_or(CUDA_ERROR_INVALID_IMAGE)?;
    bytes(p, len as usize)
}

/// The image at `p`: a completed link's token (what it linked), or an image.
fn image(p: *const c_void) -> CuResult<Image> {
    let head = bytes(p, 8)?;
    if head == LINK_TOKEN_MAGIC {
        let token: [u8; 16] = bytes(p, 16)?.try_into().expect("16 bytes");
        return with(|d| d.linked_image(&token));
    }
    Ok(Image::Single(image_at(p)?.to_vec()))
}

/// Loads the image at `p` into the current context.
fn load_image(p: *const c_void) -> CuResult<u64> {
    let ctx = current()?;
    let image = image(p)?;
    with(|d| d.module_load(ctx, image))
}

/// The function a `CUfunction` argument means (a `CUkernel` stands for its function in the
/// current context).
fn function(f: Handle) -> CuResult<u64> {
    let ctx = top();
    with(|d| d.resolve_function(f as u64, ctx))
}

macro_rules! entry {
    ($name:ident ($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            let started = $crate::api::trace_start();
            let status = finish(std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                || -> CuResult<()> { $body },
            )));
            $crate::api::explain(stringify!($name), status);
            trace(stringify!($name), started, status);
            status
        }
    };
    ($name:ident | $alias:ident ($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        entry!($name ($($arg: $ty),*) $body);

        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $alias($($arg: $ty),*) -> CUresult {
            // SAFETY: the same contract as the entry point this name stands for.
            unsafe { $name($($arg),*) }
        }
    };
}
pub(crate) use entry;

// Initialisation, version, device.

entry!(cuInit(_flags: c_uint) {
    let mut guard = DRIVER.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_some() {
        return Ok(());
    }
    let t = crate::transport::connect().map_err(|why| {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| eprintln!("vgpu libcuda: no device: {why}"));
        CUDA_ERROR_NO_DEVICE
    })?;
    *guard = Some(Driver::new(t)?.with_host_view(Box::new(ProcessMemory)));
    Ok(())
});

entry!(cuDriverGetVersion(v: *mut c_int) { put(v, crate::attributes::DRIVER_VERSION) });

entry!(cuDeviceGetCount(n: *mut c_int) {
    with(|_| Ok(()))?;
    put(n, 1)
});

entry!(cuDeviceGet(dev: *mut c_int, ordinal: c_int) {
    with(|_| Ok(()))?;
    if ordinal != DEVICE {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    put(dev, DEVICE)
});

fn device(dev: c_int) -> CuResult<()> {
    if dev == DEVICE {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_DEVICE)
    }
}

entry!(cuDeviceGetName(out: *mut c_char, len: c_int, dev: c_int) {
    device(dev)?;
    let n = with(|d| Ok(d.attributes().name.clone()))?;
    put_str(out, len, &n)
});

entry!(cuDeviceTotalMem_v2 | cuDeviceTotalMem(bytes: *mut usize, dev: c_int) {
    device(dev)?;
    let total = with(|d| Ok(d.attributes().total_memory))?;
    put(bytes, total as usize)
});

entry!(cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: c_int) {
    device(dev)?;
    let (a, b) = with(|d| Ok(d.attributes().compute_capability))?;
    put(major, a as c_int)?;
    put(minor, b as c_int)
});

entry!(cuDeviceGetAttribute(v: *mut c_int, attribute: c_int, dev: c_int) {
    device(dev)?;
    let value = with(|d| crate::attributes::device_attribute(d.attributes(), attribute))?;
    put(v, value)
});

/// `CUdevprop`: the device's properties of CUDA 1.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DevProp {
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

entry!(cuDeviceGetProperties(prop: *mut DevProp, dev: c_int) {
    device(dev)?;
    // Each field is the answer of the device attribute of the same meaning.
    let props = with(|d| {
        let a = |n| crate::attributes::device_attribute(d.attributes(), n);
        Ok(DevProp {
            max_threads_per_block: a(1)?,
            max_threads_dim: [a(2)?, a(3)?, a(4)?],
            max_grid_size: [a(5)?, a(6)?, a(7)?],
            shared_mem_per_block: a(8)?,
            total_constant_memory: a(9)?,
            simd_width: a(10)?,
            mem_pitch: a(11)?,
            regs_per_block: a(12)?,
            clock_rate: a(13)?,
            texture_align: a(14)?,
        })
    })?;
    put(prop, props)
});

entry!(cuDeviceGetUuid(uuid: *mut [u8; 16], dev: c_int) {
    device(dev)?;
    put(uuid, crate::attributes::DEVICE_UUID)
});

entry!(cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: c_int) {
    // SAFETY: same arguments as cuDeviceGetUuid.
    status(unsafe { cuDeviceGetUuid(uuid, dev) })
});

/// The device's PCI bus id as `cuDeviceGetPCIBusId` writes it.
const PCI_BUS_ID: &str = "0000:00:00.0";

entry!(cuDeviceGetPCIBusId(out: *mut c_char, len: c_int, dev: c_int) {
    device(dev)?;
    put_str(out, len, PCI_BUS_ID)
});

entry!(cuDeviceGetByPCIBusId(dev: *mut c_int, id: *const c_char) {
    with(|_| Ok(()))?;
    // `domain:bus:device.function` or `bus:device.function`, hexadecimal, any case.
    let want = name(id)?.to_ascii_lowercase();
    let ours = PCI_BUS_ID.strip_prefix("0000:").unwrap_or(PCI_BUS_ID);
    if want != PCI_BUS_ID && want != ours {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    put(dev, DEVICE)
});

// Contexts.

entry!(cuDevicePrimaryCtxRetain(pctx: *mut Handle, dev: c_int) {
    device(dev)?;
    let ctx = with(|d| d.primary_context())?;
    put(pctx, ctx as Handle)
});

entry!(cuDevicePrimaryCtxRelease_v2 | cuDevicePrimaryCtxRelease(dev: c_int) { device(dev) });

entry!(cuDevicePrimaryCtxSetFlags_v2 | cuDevicePrimaryCtxSetFlags(dev: c_int, flags: c_uint) {
    device(dev)?;
    let flags = context_flags(flags)?;
    with(|d| d.set_primary_flags(flags))
});

entry!(cuDevicePrimaryCtxGetState(dev: c_int, flags: *mut c_uint, active: *mut c_int) {
    device(dev)?;
    let (f, on) = with(|d| Ok(d.primary_state()))?;
    put(flags, f)?;
    put(active, c_int::from(on))
});

/// `CU_CTX_SCHED_MASK`: the scheduling field of the context flags, one of auto (0), spin (1),
/// yield (2) or blocking sync (4).
const CTX_SCHED_MASK: c_uint = 0x07;
/// `CU_CTX_FLAGS_MASK`: every context flag (scheduling, map host, local memory resize,
/// coredumps, synchronous memory operations).
const CTX_FLAGS_MASK: c_uint = 0xFF;

/// Context flags as given, checked.
fn context_flags(flags: c_uint) -> CuResult<u32> {
    if flags & !CTX_FLAGS_MASK != 0 || !matches!(flags & CTX_SCHED_MASK, 0 | 1 | 2 | 4) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(flags)
}

/// `CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY`: execution affinity (SM-count limits) needs MPS on
/// a Volta or newer GPU; this device has none.
const CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY: CUresult = 224;
/// `CUDA_ERROR_UNSUPPORTED_LIMIT`: a limit the device does not have.
const CUDA_ERROR_UNSUPPORTED_LIMIT: CUresult = 215;

/// A new context with checked flags, made current (pushed) as `cuCtxCreate` does.
fn create_context(pctx: *mut Handle, flags: c_uint, dev: c_int) -> CuResult<()> {
    device(dev)?;
    let flags = context_flags(flags)?;
    if pctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = with(|d| {
        let c = d.context_create()?;
        d.settings_mut(c)?.flags = flags;
        Ok(c)
    })?;
    push_current(ctx)?;
    put(pctx, ctx as Handle)
}

entry!(cuCtxCreate_v2 | cuCtxCreate(pctx: *mut Handle, flags: c_uint, dev: c_int) {
    create_context(pctx, flags, dev)
});

/// Refuses execution-affinity parameters: none can be honoured without MPS.
fn no_exec_affinity(params: *const c_void, count: c_int) -> CuResult<()> {
    match (params.is_null(), count) {
        (true, 0) => Ok(()),
        (false, 1..) => {
            refused("cuCtxCreate with execution affinity (needs MPS)");
            Err(CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY)
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

entry!(cuCtxCreate_v3(
    pctx: *mut Handle,
    params: *mut c_void,
    count: c_int,
    flags: c_uint,
    dev: c_int,
) {
    no_exec_affinity(params, count)?;
    create_context(pctx, flags, dev)
});

/// `CUctxCreateParams` of CUDA 12.5.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CtxCreateParams {
    exec_affinity: *const c_void,
    exec_affinity_count: c_int,
    cig: *const c_void,
}

entry!(cuCtxCreate_v4(pctx: *mut Handle, params: *const CtxCreateParams, flags: c_uint, dev: c_int) {
    if !params.is_null() {
        let p = read_at(params, 0)?;
        no_exec_affinity(p.exec_affinity, p.exec_affinity_count)?;
        if !p.cig.is_null() {
            // CUDA in Graphics shares a D3D12 or Vulkan client's context: there is none.
            refused("cuCtxCreate with CIG parameters (no graphics client)");
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
    }
    create_context(pctx, flags, dev)
});

entry!(cuCtxDestroy_v2 | cuCtxDestroy(ctx: Handle) {
    let ctx = ctx as u64;
    with(|d| d.context_destroy(ctx))?;
    forget_context(ctx);
    Ok(())
});

/// Takes a destroyed context off this thread's context stack.
fn forget_context(ctx: u64) {
    stack(|s| {
        let mut kept = 0;
        for i in 0..s.len {
            if s.items[i] != ctx {
                s.items[kept] = s.items[i];
                kept += 1;
            }
        }
        s.len = kept;
    });
}

/// `cuCtxAttach` flags: none are defined.
const CTX_ATTACH_FLAGS: c_uint = 0;

entry!(cuCtxAttach(pctx: *mut Handle, flags: c_uint) {
    let ctx = current()?;
    if flags != CTX_ATTACH_FLAGS || pctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    with(|d| d.context_attach(ctx))?;
    put(pctx, ctx as Handle)
});

entry!(cuCtxDetach(ctx: Handle) {
    // The context must be current, as cuCtxAttach left it.
    let ctx = ctx as u64;
    if top() != Some(ctx) {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    if with(|d| d.context_detach(ctx))? {
        forget_context(ctx);
    }
    Ok(())
});

entry!(cuCtxGetCurrent(pctx: *mut Handle) {
    put(pctx, top().unwrap_or(0) as Handle)
});

entry!(cuCtxSetCurrent(ctx: Handle) {
    let ctx = ctx as u64;
    if ctx == 0 {
        return set_current(None);
    }
    if !with(|d| Ok(d.is_context(ctx)))? {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    set_current(Some(ctx))
});

entry!(cuCtxPushCurrent_v2 | cuCtxPushCurrent(ctx: Handle) {
    let ctx = ctx as u64;
    if !with(|d| Ok(d.is_context(ctx)))? {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    push_current(ctx)
});

entry!(cuCtxPopCurrent_v2 | cuCtxPopCurrent(pctx: *mut Handle) {
    let top = pop_current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    put_opt(pctx, top as Handle)
});

/// A context argument: the given context, checked, or the current one for NULL.
fn context_or_current(ctx: Handle) -> CuResult<u64> {
    if ctx.is_null() {
        return current();
    }
    let ctx = ctx as u64;
    if with(|d| Ok(d.is_context(ctx)))? {
        Ok(ctx)
    } else {
        Err(CUDA_ERROR_INVALID_CONTEXT)
    }
}

entry!(cuCtxGetDevice(dev: *mut c_int) {
    current()?;
    put(dev, DEVICE)
});

entry!(cuCtxGetDevice_v2(dev: *mut c_int, ctx: Handle) {
    context_or_current(ctx)?;
    put(dev, DEVICE)
});

entry!(cuCtxSynchronize() {
    let ctx = current()?;
    graphs::check_sync(None)?;
    with(|d| d.synchronize(ctx))
});

entry!(cuCtxSynchronize_v2(ctx: Handle) {
    let ctx = context_or_current(ctx)?;
    graphs::check_sync(None)?;
    with(|d| d.synchronize(ctx))
});

entry!(cuCtxGetFlags(flags: *mut c_uint) {
    let ctx = current()?;
    let s = with(|d| d.settings(ctx))?;
    put(flags, s.flags)
});

entry!(cuCtxSetFlags(flags: c_uint) {
    let ctx = current()?;
    let flags = context_flags(flags)?;
    with(|d| {
        d.settings_mut(ctx)?.flags = flags;
        Ok(())
    })
});

/// `CUlimit` values.
const LIMIT_STACK_SIZE: c_int = 0;
const LIMIT_PRINTF_FIFO_SIZE: c_int = 1;
const LIMIT_MALLOC_HEAP_SIZE: c_int = 2;
const LIMIT_DEV_RUNTIME_SYNC_DEPTH: c_int = 3;
const LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT: c_int = 4;
const LIMIT_MAX_L2_FETCH_GRANULARITY: c_int = 5;
const LIMIT_PERSISTING_L2_CACHE_SIZE: c_int = 6;
/// Largest L2 fetch granularity hint (bytes).
const MAX_L2_FETCH_GRANULARITY: u64 = 128;

/// The most each settable limit may be: what the host's executor provides (a thread's local
/// memory, the printf buffer of a launch, the device heap), or `None` for a limit this device
/// does not have: device-runtime limits (no dynamic parallelism) and persisting L2 (Turing
/// has none).
fn limit_ceiling(limit: c_int) -> CuResult<Option<u64>> {
    use mdev_backend::compute::{memory, ptx};
    Ok(match limit {
        LIMIT_STACK_SIZE => Some(u64::from(ptx::MAX_LOCAL_BYTES_PER_THREAD)),
        LIMIT_PRINTF_FIFO_SIZE => Some(ptx::MAX_PRINTF_BYTES as u64),
        LIMIT_MALLOC_HEAP_SIZE => Some(memory::MAX_DEVICE_HEAP_BYTES),
        LIMIT_MAX_L2_FETCH_GRANULARITY => Some(MAX_L2_FETCH_GRANULARITY),
        LIMIT_DEV_RUNTIME_SYNC_DEPTH
        | LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT
        | LIMIT_PERSISTING_L2_CACHE_SIZE => None,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

/// The field of a context's settings that holds `limit` (one [`limit_ceiling`] allows).
fn limit_field(s: &mut crate::driver::ContextSettings, limit: c_int) -> &mut u64 {
    match limit {
        LIMIT_STACK_SIZE => &mut s.stack_bytes,
        LIMIT_PRINTF_FIFO_SIZE => &mut s.printf_bytes,
        LIMIT_MALLOC_HEAP_SIZE => &mut s.heap_bytes,
        _ => &mut s.l2_fetch_granularity,
    }
}

entry!(cuCtxSetLimit(limit: c_int, value: usize) {
    let ctx = current()?;
    let value = value as u64;
    match limit_ceiling(limit)? {
        // The heap lives on the host, which refuses a new size once the heap exists.
        Some(max) if value <= max && limit == LIMIT_MALLOC_HEAP_SIZE => {
            with(|d| d.set_heap_size(ctx, value))
        }
        Some(max) if value <= max => with(|d| {
            *limit_field(d.settings_mut(ctx)?, limit) = value;
            Ok(())
        }),
        Some(max) => {
            refused(&format!("cuCtxSetLimit({limit}) to {value} bytes: the executor provides {max}"));
            Err(CUDA_ERROR_INVALID_VALUE)
        }
        // Zero persisting L2 is what the device has.
        None if limit == LIMIT_PERSISTING_L2_CACHE_SIZE && value == 0 => Ok(()),
        None => {
            refused(&format!("cuCtxSetLimit({limit}): no such limit on this device"));
            Err(CUDA_ERROR_UNSUPPORTED_LIMIT)
        }
    }
});

entry!(cuCtxGetLimit(value: *mut usize, limit: c_int) {
    let ctx = current()?;
    let v = match limit_ceiling(limit)? {
        Some(_) => with(|d| Ok(*limit_field(&mut d.settings(ctx)?, limit)))?,
        None if limit == LIMIT_PERSISTING_L2_CACHE_SIZE => 0,
        None => return Err(CUDA_ERROR_UNSUPPORTED_LIMIT),
    };
    put(value, v as usize)
});

/// `CUfunc_cache`: prefer none, shared, L1, equal.
const MAX_FUNC_CACHE: c_int = 3;

entry!(cuCtxGetCacheConfig(config: *mut c_int) {
    let ctx = current()?;
    let s = with(|d| d.settings(ctx))?;
    put(config, s.cache_config as c_int)
});

entry!(cuCtxSetCacheConfig(config: c_int) {
    let ctx = current()?;
    if !(0..=MAX_FUNC_CACHE).contains(&config) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    with(|d| {
        d.settings_mut(ctx)?.cache_config = config as u32;
        Ok(())
    })
});

/// `CU_SHARED_MEM_CONFIG_FOUR_BYTE_BANK_SIZE`: Turing's shared memory banks are four bytes
/// wide and not configurable (a setting is accepted and has no effect, as on the hardware).
const SHARED_MEM_CONFIG_FOUR_BYTE: c_int = 1;
/// `CUsharedconfig` values: default, four-byte, eight-byte banks.
const MAX_SHARED_MEM_CONFIG: c_int = 2;

entry!(cuCtxGetSharedMemConfig(config: *mut c_int) {
    current()?;
    put(config, SHARED_MEM_CONFIG_FOUR_BYTE)
});

entry!(cuCtxSetSharedMemConfig(config: c_int) {
    current()?;
    if !(0..=MAX_SHARED_MEM_CONFIG).contains(&config) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
});

entry!(cuFuncSetSharedMemConfig(f: Handle, config: c_int) {
    let f = function(f)?;
    if !(0..=MAX_SHARED_MEM_CONFIG).contains(&config) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    with(|d| d.params(f).map(drop))
});

/// Stream priorities of a Turing GPU: 0 is the least, -5 the greatest.
const LEAST_STREAM_PRIORITY: c_int = 0;
const GREATEST_STREAM_PRIORITY: c_int = -5;

entry!(cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) {
    current()?;
    put_opt(least, LEAST_STREAM_PRIORITY)?;
    put_opt(greatest, GREATEST_STREAM_PRIORITY)
});

entry!(cuCtxGetId(ctx: Handle, id: *mut u64) {
    let ctx = if ctx.is_null() { current()? } else { ctx as u64 };
    if !with(|d| Ok(d.is_context(ctx)))? {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    put(id, ctx)
});

entry!(cuCtxGetApiVersion(_ctx: Handle, version: *mut c_uint) { put(version, 3020) });

// Modules, functions, linking.

entry!(cuModuleLoadData(module: *mut Handle, image: *const c_void) {
    let m = load_image(image)?;
    put(module, m as Handle)
});

entry!(cuModuleLoadFatBinary(module: *mut Handle, fat_cubin: *const c_void) {
    // A fat binary is one of the images cuModuleLoadData takes.
    let m = load_image(fat_cubin)?;
    put(module, m as Handle)
});

entry!(cuModuleLoadDataEx(
    module: *mut Handle,
    image: *const c_void,
    _n: c_uint,
    _options: *mut c_int,
    _values: *mut *mut c_void,
) {
    let m = load_image(image)?;
    put(module, m as Handle)
});

/// The image in the file named `path`.
fn file_image(path: *const c_char) -> CuResult<Image> {
    let image = std::fs::read(name(path)?).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
    Ok(Image::Single(image))
}

entry!(cuModuleLoad(module: *mut Handle, path: *const c_char) {
    let ctx = current()?;
    let image = file_image(path)?;
    let m = with(|d| d.module_load(ctx, image))?;
    put(module, m as Handle)
});

/// `CU_MODULE_EAGER_LOADING`: a module's functions exist on the host once it is loaded.
const MODULE_EAGER_LOADING: c_int = 1;

entry!(cuModuleGetLoadingMode(mode: *mut c_int) { put(mode, MODULE_EAGER_LOADING) });

// Libraries (CUDA 12): what cudart 12 and 13 load fat binaries with. JIT and library options
// are accepted and not needed: the host compiles PTX itself, and loading is eager per context.

entry!(cuLibraryLoadData(
    library: *mut Handle,
    code: *const c_void,
    _jit_options: *mut c_int,
    _jit_values: *mut *mut c_void,
    _jit_count: c_uint,
    _library_options: *mut c_int,
    _library_values: *mut *mut c_void,
    _library_count: c_uint,
) {
    load_library(library, image(code)?)
});

entry!(cuLibraryLoadFromFile(
    library: *mut Handle,
    path: *const c_char,
    _jit_options: *mut c_int,
    _jit_values: *mut *mut c_void,
    _jit_count: c_uint,
    _library_options: *mut c_int,
    _library_values: *mut *mut c_void,
    _library_count: c_uint,
) {
    load_library(library, file_image(path)?)
});

/// A library of `image`, loaded into the current context if there is one.
fn load_library(library: *mut Handle, image: Image) -> CuResult<()> {
    let ctx = top();
    let l = with(|d| d.library_load(image, ctx))?;
    put(library, l as Handle)
}

entry!(cuLibraryUnload(library: Handle) { with(|d| d.library_unload(library as u64)) });

entry!(cuLibraryGetKernel(kernel: *mut Handle, library: Handle, kname: *const c_char) {
    let n = name(kname)?;
    let ctx = top();
    let k = with(|d| d.kernel(library as u64, n, ctx))?;
    put(kernel, k as Handle)
});

entry!(cuLibraryGetModule(module: *mut Handle, library: Handle) {
    let ctx = current()?;
    let m = with(|d| d.library_module(library as u64, ctx))?;
    put(module, m as Handle)
});

entry!(cuLibraryGetGlobal(dptr: *mut u64, bytes: *mut usize, library: Handle, vname: *const c_char) {
    let (n, ctx) = (name(vname)?, current()?);
    let (addr, size) = with(|d| d.library_global(library as u64, n, ctx))?;
    put_opt(dptr, addr)?;
    put_opt(bytes, size as usize)
});

entry!(cuKernelGetFunction(f: *mut Handle, kernel: Handle) {
    let ctx = current()?;
    let h = with(|d| d.kernel_function(kernel as u64, ctx))?;
    put(f, h as Handle)
});

entry!(cuKernelGetAttribute(v: *mut c_int, attribute: c_int, kernel: Handle, dev: c_int) {
    device(dev)?;
    // SAFETY: our own entry point; a kernel handle stands for its function there.
    status(unsafe { cuFuncGetAttribute(v, attribute, kernel) })
});

entry!(cuKernelSetAttribute(attribute: c_int, value: c_int, kernel: Handle, dev: c_int) {
    device(dev)?;
    // SAFETY: our own entry point; a kernel handle stands for its function there.
    status(unsafe { cuFuncSetAttribute(kernel, attribute, value) })
});

entry!(cuKernelSetCacheConfig(kernel: Handle, _config: c_int, dev: c_int) {
    device(dev)?;
    function(kernel).map(drop)
});

entry!(cuModuleUnload(module: Handle) {
    with(|d| {
        let ctx = d.module_context(module as u64)?;
        d.module_unload(ctx, module as u64)
    })
});

entry!(cuModuleGetFunction(f: *mut Handle, module: Handle, fname: *const c_char) {
    let n = name(fname)?;
    let h = with(|d| d.function(module as u64, n))?;
    put(f, h as Handle)
});

entry!(cuModuleGetGlobal_v2 | cuModuleGetGlobal(
    dptr: *mut u64,
    bytes: *mut usize,
    module: Handle,
    vname: *const c_char,
) {
    let n = name(vname)?;
    let (addr, size) = with(|d| d.global(module as u64, n))?;
    put_opt(dptr, addr)?;
    put_opt(bytes, size as usize)
});

entry!(cuFuncGetAttribute(v: *mut c_int, attribute: c_int, f: Handle) {
    let f = function(f)?;
    let answer = with(|d| {
        let a = d.function_attributes(f)?;
        let s = d.function_settings(f)?;
        crate::attributes::function_attribute(attribute, &a, &s, d.attributes())
    })?;
    put(v, answer)
});

entry!(cuFuncSetCacheConfig(f: Handle, _config: c_int) {
    let f = function(f)?;
    with(|d| d.params(f).map(drop))
});

entry!(cuFuncSetAttribute(f: Handle, attribute: c_int, value: c_int) {
    let f = function(f)?;
    with(|d| d.set_function_attribute(f, attribute, value))
});

// Occupancy: from the function's attributes (its registers and static shared memory as the
// executor reports them) and the multiprocessor limits of the device's compute capability.

/// `CU_OCCUPANCY_DEFAULT` and `CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE` (caching has no effect
/// on the calculation here).
const OCCUPANCY_FLAGS: c_uint = 1;

/// What occupancy is computed from: the device's limits, its multiprocessors, the function's
/// attributes and settings.
fn occupancy_inputs(
    f: Handle,
    flags: c_uint,
) -> CuResult<(
    crate::attributes::SmLimits,
    u32,
    mdev_backend::compute::backend::FunctionAttributes,
    crate::attributes::FunctionSettings,
)> {
    if flags & !OCCUPANCY_FLAGS != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let f = function(f)?;
    with(|d| {
        let sm = crate::attributes::limits(d.attributes())?;
        Ok((
            sm,
            d.attributes().multiprocessors,
            d.function_attributes(f)?,
            d.function_settings(f)?,
        ))
    })
}

/// A non-negative `int` argument.
fn count(n: c_int) -> CuResult<u32> {
    u32::try_from(n).map_err(|_| CUDA_ERROR_INVALID_VALUE)
}

/// A dynamic shared memory size: more than a block can have is answered as 0 blocks.
fn shared_size(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn max_active_blocks(
    blocks: *mut c_int,
    f: Handle,
    block_size: c_int,
    dynamic_shared: usize,
    flags: c_uint,
) -> CuResult<()> {
    let (sm, _, a, _) = occupancy_inputs(f, flags)?;
    let n =
        crate::attributes::active_blocks(&sm, &a, count(block_size)?, shared_size(dynamic_shared));
    put(blocks, n as c_int)
}

entry!(cuOccupancyMaxActiveBlocksPerMultiprocessor(
    blocks: *mut c_int,
    f: Handle,
    block_size: c_int,
    dynamic_shared: usize,
) {
    max_active_blocks(blocks, f, block_size, dynamic_shared, 0)
});

entry!(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    blocks: *mut c_int,
    f: Handle,
    block_size: c_int,
    dynamic_shared: usize,
    flags: c_uint,
) {
    max_active_blocks(blocks, f, block_size, dynamic_shared, flags)
});

/// `CUoccupancyB2DSize`: the dynamic shared memory a block of the given size needs.
type BlockToShared = Option<unsafe extern "C" fn(c_int) -> usize>;

fn max_potential_block_size(
    grid: *mut c_int,
    block: *mut c_int,
    f: Handle,
    to_shared: BlockToShared,
    dynamic_shared: usize,
    limit: c_int,
    flags: c_uint,
) -> CuResult<()> {
    if grid.is_null() || block.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (sm, multiprocessors, a, _) = occupancy_inputs(f, flags)?;
    let (g, b) =
        crate::attributes::best_block_size(&sm, multiprocessors, &a, count(limit)?, |size| {
            match to_shared {
                // SAFETY: the caller's callback, called with a block size as the API documents.
                Some(cb) => shared_size(unsafe { cb(size as c_int) }),
                None => shared_size(dynamic_shared),
            }
        });
    put(grid, g.min(c_int::MAX as u32) as c_int)?;
    put(block, b as c_int)
}

entry!(cuOccupancyMaxPotentialBlockSize(
    grid: *mut c_int,
    block: *mut c_int,
    f: Handle,
    to_shared: BlockToShared,
    dynamic_shared: usize,
    limit: c_int,
) {
    max_potential_block_size(grid, block, f, to_shared, dynamic_shared, limit, 0)
});

entry!(cuOccupancyMaxPotentialBlockSizeWithFlags(
    grid: *mut c_int,
    block: *mut c_int,
    f: Handle,
    to_shared: BlockToShared,
    dynamic_shared: usize,
    limit: c_int,
    flags: c_uint,
) {
    max_potential_block_size(grid, block, f, to_shared, dynamic_shared, limit, flags)
});

entry!(cuOccupancyAvailableDynamicSMemPerBlock(size: *mut usize, f: Handle, blocks: c_int, block_size: c_int) {
    let (sm, _, a, s) = occupancy_inputs(f, 0)?;
    let n = crate::attributes::available_dynamic_shared(&sm, &a, &s, count(blocks)?, count(block_size)?);
    put(size, n as usize)
});

/// Thread block clusters need compute capability 9.0: refused on this device.
fn no_clusters(f: Handle, what: &str) -> CuResult<()> {
    function(f)?;
    refused(&format!(
        "{what}: thread block clusters need compute capability 9.0"
    ));
    Err(CUDA_ERROR_NOT_SUPPORTED)
}

entry!(cuOccupancyMaxActiveClusters(_clusters: *mut c_int, f: Handle, _config: *const c_void) {
    no_clusters(f, "cuOccupancyMaxActiveClusters")
});

entry!(cuOccupancyMaxPotentialClusterSize(_size: *mut c_int, f: Handle, _config: *const c_void) {
    no_clusters(f, "cuOccupancyMaxPotentialClusterSize")
});

/// `CUjit_option` values that carry a log buffer and its size.
const JIT_ERROR_LOG_BUFFER: c_int = 5;
const JIT_ERROR_LOG_BUFFER_SIZE_BYTES: c_int = 6;
const JIT_INFO_LOG_BUFFER: c_int = 3;
const JIT_INFO_LOG_BUFFER_SIZE_BYTES: c_int = 4;
/// Options of one `cuLinkCreate`/`cuModuleLoadDataEx`.
const MAX_JIT_OPTIONS: c_uint = 64;

entry!(cuLinkCreate_v2 | cuLinkCreate(
    n: c_uint,
    options: *mut c_int,
    values: *mut *mut c_void,
    state: *mut Handle,
) {
    if n > MAX_JIT_OPTIONS {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // Log buffers are left empty (a link error is the status); make them empty strings.
    let (mut info, mut error) = ((None, 0usize), (None, 0usize));
    for i in 0..n as usize {
        let value = entry_at(values, i)?;
        match read_at::<c_int>(options, i)? {
            JIT_INFO_LOG_BUFFER => info.0 = Some(value),
            JIT_INFO_LOG_BUFFER_SIZE_BYTES => info.1 = value,
            JIT_ERROR_LOG_BUFFER => error.0 = Some(value),
            JIT_ERROR_LOG_BUFFER_SIZE_BYTES => error.1 = value,
            _ => {}
        }
    }
    for (buf, size) in [info, error] {
        if let Some(b) = buf
            && size > 0
        {
            put_str(b as *mut c_char, size.min(c_int::MAX as usize) as c_int, "")?;
        }
    }
    let h = with(|d| Ok(d.link_create()))?;
    put(state, h as Handle)
});

/// `CUjitInputType` values.
const JIT_INPUT_PTX: c_int = 1;
const JIT_INPUT_FATBINARY: c_int = 3;

entry!(cuLinkAddData_v2 | cuLinkAddData(
    state: Handle,
    kind: c_int,
    data: *mut c_void,
    size: usize,
    _name: *const c_char,
    _n: c_uint,
    _options: *mut c_int,
    _values: *mut *mut c_void,
) {
    if kind != JIT_INPUT_PTX && kind != JIT_INPUT_FATBINARY {
        return unsupported("cuLinkAddData of other than PTX or a fat binary");
    }
    if size as u64 > MAX_IMAGE_BYTES {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut image = bytes(data, size)?.to_vec();
    while image.last() == Some(&0) {
        image.pop();
    }
    with(|d| {
        d.link(state as u64)?.images.push(image);
        Ok(())
    })
});

entry!(cuLinkAddFile_v2 | cuLinkAddFile(
    state: Handle,
    _kind: c_int,
    path: *const c_char,
    _n: c_uint,
    _options: *mut c_int,
    _values: *mut *mut c_void,
) {
    let image = std::fs::read(name(path)?).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
    with(|d| {
        d.link(state as u64)?.images.push(image);
        Ok(())
    })
});

entry!(cuLinkComplete(state: Handle, cubin: *mut *mut c_void, size: *mut usize) {
    let token = with(|d| Ok(d.link_complete(state as u64)?.as_ptr() as usize))?;
    put(cubin, token as *mut c_void)?;
    put_opt(size, 16)
});

entry!(cuLinkDestroy(state: Handle) { with(|d| d.link_destroy(state as u64)) });

// Memory.

entry!(cuMemAlloc_v2 | cuMemAlloc(dptr: *mut u64, bytes: usize) {
    let ctx = current()?;
    let a = with(|d| d.mem_alloc(ctx, bytes as u64))?;
    put(dptr, a)
});

entry!(cuMemFree_v2 | cuMemFree(dptr: u64) {
    let ctx = current()?;
    let shadow = with(|d| d.shadow_release(Some(dptr), None))?;
    match shadow {
        Some(s) if s.managed => {
            unmap_view(s.host, s.size)?;
            with(|d| d.mem_free(s.ctx, s.alloc))
        }
        Some(s) => {
            // Mapped host memory is freed with cuMemFreeHost or unregistered: keep it.
            with(|d| d.shadow_create(s))?;
            Err(CUDA_ERROR_INVALID_VALUE)
        }
        None if graphs::free_graph_alloc(dptr)? => Ok(()),
        None => with(|d| d.mem_free(ctx, dptr)),
    }
});

// Managed and mapped memory: a device range and a host view kept coherent by the driver at
// synchronisation points (driver.rs `Shadow`). The host view of managed memory, and of
// mapped memory the driver allocates, is mapped at the device address inside the context's
// window, so one pointer serves both sides (unified addressing).

/// The host views' memory: this process's.
struct ProcessMemory;

impl crate::driver::HostView for ProcessMemory {
    fn read(&self, addr: u64, out: &mut [u8]) {
        // SAFETY: `addr` is a host view the driver keeps (pages this library mapped, or a
        // range the program registered and must keep until it unregisters it) of at least
        // `out.len()` bytes; the program does not touch it while the device may use it, as
        // CUDA requires without concurrent managed access.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
    }

    fn write(&self, addr: u64, data: &[u8]) {
        // SAFETY: as in `read`, for writing `data.len()` bytes at a synchronisation point.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
    }
}

/// The process's page size.
fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// Makes the pages of `[addr, addr + size)` readable and writable host memory (zeros). They
/// lie in a device allocation of a context's window, reserved in this process.
fn map_view(addr: u64, size: u64) -> CuResult<()> {
    let len = usize::try_from(size.next_multiple_of(page_size()))
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    // SAFETY: MAP_FIXED over pages of the window this library reserved (inaccessible, nothing
    // of the program lives there) inside one device allocation the driver just made.
    let p = unsafe {
        libc::mmap(
            addr as *mut c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(())
}

/// Returns the pages of a host view to the window's inaccessible reservation.
fn unmap_view(addr: u64, size: u64) -> CuResult<()> {
    let len = usize::try_from(size.next_multiple_of(page_size()))
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    // SAFETY: the pages `map_view` mapped for a host view the driver no longer keeps; they
    // become the reservation they were.
    let p = unsafe {
        libc::mmap(
            addr as *mut c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_UNKNOWN);
    }
    Ok(())
}

/// Device memory with a host view at the same address in the current context: (context,
/// address). Needs a device whose memory the host places in this process's windows.
fn unified_alloc(bytes: usize, what: &str) -> CuResult<(u64, u64)> {
    let ctx = current()?;
    if !with(|d| Ok(d.attributes().placement))? {
        refused(&format!(
            "{what}: the device's memory is not in this process's address space"
        ));
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let bytes = bytes as u64;
    let (addr, alloc) = with(|d| d.managed_reserve(ctx, bytes, page_size()))?;
    let shadow = crate::driver::ShadowInfo {
        ctx,
        device: addr,
        host: addr,
        size: bytes,
        alloc,
        managed: what == "cuMemAllocManaged",
    };
    let made = map_view(addr, bytes).and_then(|()| with(|d| d.shadow_create(shadow)));
    if let Err(e) = made {
        let _ = unmap_view(addr, bytes);
        let _ = with(|d| d.mem_free(ctx, alloc));
        return Err(e);
    }
    Ok((ctx, addr))
}

/// `CU_MEM_ATTACH_GLOBAL`, `_HOST`, `_SINGLE`.
const MEM_ATTACH_GLOBAL: c_uint = 1;
const MEM_ATTACH_HOST: c_uint = 2;
const MEM_ATTACH_SINGLE: c_uint = 4;

entry!(cuMemAllocManaged(dptr: *mut u64, bytes: usize, flags: c_uint) {
    if dptr.is_null() || bytes == 0 || !matches!(flags, MEM_ATTACH_GLOBAL | MEM_ATTACH_HOST) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (_, addr) = unified_alloc(bytes, "cuMemAllocManaged")?;
    put(dptr, addr)
});

/// A managed range `[ptr, ptr + count)` of the current context, checked.
fn managed_range(ptr: u64, count: usize) -> CuResult<()> {
    current()?;
    let s = with(|d| Ok(d.shadow_at(ptr, false)))?.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let end = ptr
        .checked_add(count as u64)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if !s.managed || count == 0 || end > s.device + s.size {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// `CUmemLocation` of CUDA 12.2: a type (device 1, host 2, host NUMA 3, host NUMA current 4)
/// and an id.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemLocation {
    kind: c_int,
    id: c_int,
}

/// A prefetch or advice target: this device, or the host (`CU_DEVICE_CPU`, -1).
fn location(kind: c_int, id: c_int) -> CuResult<()> {
    match (kind, id) {
        (1, DEVICE) | (2, _) | (3, 0) | (4, _) => Ok(()),
        (1, -1) => Ok(()),
        _ => Err(CUDA_ERROR_INVALID_DEVICE),
    }
}

// Prefetching and advice are hints: the driver moves a managed range at synchronisation
// points whatever they say. They are checked and accepted.

entry!(cuMemPrefetchAsync(ptr: u64, count: usize, device: c_int, stream: Handle) {
    owner(stream)?;
    managed_range(ptr, count)?;
    location(1, device)
});

entry!(cuMemPrefetchAsync_v2(ptr: u64, count: usize, loc: MemLocation, flags: c_uint, stream: Handle) {
    owner(stream)?;
    managed_range(ptr, count)?;
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    location(loc.kind, loc.id)
});

/// `CUmem_advise`: set/unset read mostly, preferred location, accessed by.
const MAX_MEM_ADVICE: c_int = 6;

entry!(cuMemAdvise(ptr: u64, count: usize, advice: c_int, device: c_int) {
    managed_range(ptr, count)?;
    if !(1..=MAX_MEM_ADVICE).contains(&advice) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    location(1, device)
});

entry!(cuMemAdvise_v2(ptr: u64, count: usize, advice: c_int, loc: MemLocation) {
    managed_range(ptr, count)?;
    if !(1..=MAX_MEM_ADVICE).contains(&advice) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    location(loc.kind, loc.id)
});

entry!(cuStreamAttachMemAsync(stream: Handle, ptr: u64, length: usize, flags: c_uint) {
    owner(stream)?;
    if !matches!(flags, MEM_ATTACH_GLOBAL | MEM_ATTACH_HOST | MEM_ATTACH_SINGLE) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // Length 0 means the whole allocation; a context's work runs in order, so which stream a
    // range is attached to changes nothing.
    let s = with(|d| Ok(d.shadow_at(ptr, false)))?.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if !s.managed || (length != 0 && (ptr != s.device || length as u64 > s.size)) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
});

entry!(cuMemHostGetDevicePointer_v2 | cuMemHostGetDevicePointer(dptr: *mut u64, p: *mut c_void, flags: c_uint) {
    current()?;
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let s = with(|d| Ok(d.shadow_at(p as u64, true)))?.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if s.managed {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    put(dptr, s.device + (p as u64 - s.host))
});

entry!(cuMemGetInfo_v2 | cuMemGetInfo(free: *mut usize, total: *mut usize) {
    let ctx = current()?;
    let (f, t) = with(|d| d.mem_info(ctx))?;
    put(free, usize::try_from(f).unwrap_or(usize::MAX))?;
    put(total, usize::try_from(t).unwrap_or(usize::MAX))
});

entry!(cuMemGetAddressRange_v2 | cuMemGetAddressRange(base: *mut u64, size: *mut usize, dptr: u64) {
    let ctx = current()?;
    let (b, n) = with(|d| d.address_range(ctx, dptr))?;
    put_opt(base, b)?;
    put_opt(size, n as usize)
});

/// `CU_MEMHOSTALLOC_*` flags: portable, device-mapped, write-combined.
const MEMHOSTALLOC_FLAGS: c_uint = 0x07;
/// `CU_MEMHOSTREGISTER_*` flags: portable, device-mapped, I/O memory, read-only.
const MEMHOSTREGISTER_FLAGS: c_uint = 0x0F;
/// `CU_MEMHOSTALLOC_DEVICEMAP` and `CU_MEMHOSTREGISTER_DEVICEMAP`: mapped into the device's
/// address space.
const MEMHOSTALLOC_DEVICEMAP: c_uint = 0x02;
const MEMHOSTREGISTER_DEVICEMAP: c_uint = 0x02;
/// `CU_MEMHOSTREGISTER_IOMEMORY`: the range is a device's I/O memory.
const MEMHOSTREGISTER_IOMEMORY: c_uint = 0x04;

/// Page-locked host memory, recorded so that it can be freed, asked about and told from other
/// memory. Where the transport shares memory with the host (the host socket), its pages are a
/// memory file the host maps, which copies move to and from with no copy here; else plain
/// host memory (the copies go through the transport).
fn host_alloc(pp: *mut *mut c_void, bytes: usize, flags: c_uint) -> CuResult<()> {
    let ctx = current()?;
    if flags & !MEMHOSTALLOC_FLAGS != 0 || pp.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if bytes == 0 {
        return put(pp, std::ptr::null_mut());
    }
    // With unified addressing every page-locked allocation is mapped, at one address for
    // host and device (CUDA's rule: kernels may use the pointer as it is), whatever the flags.
    if flags & MEMHOSTALLOC_DEVICEMAP != 0 || with(|d| Ok(d.attributes().placement))? {
        let (ctx, addr) = unified_alloc(bytes, "cuMemHostAlloc(CU_MEMHOSTALLOC_DEVICEMAP)")?;
        let added = share_view(addr, bytes)
            .and_then(|()| with(|d| d.host_memory_add(addr, bytes as u64, flags, ctx, false)));
        if let Err(e) = added {
            release_mapped(addr)?;
            with(|d| d.pinned_free(addr))?;
            return Err(e);
        }
        return put(pp, addr as *mut c_void);
    }
    if let Some(p) = with(|d| d.pinned_alloc(ctx, bytes as u64, flags))? {
        return put(pp, p as *mut c_void);
    }
    // SAFETY: malloc of a non-zero size; a NULL result is handled.
    let p = unsafe { libc::malloc(bytes) };
    if p.is_null() {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    if let Err(e) = with(|d| d.host_memory_add(p as u64, bytes as u64, flags, ctx, false)) {
        // SAFETY: the block malloc just returned, handed to no one.
        unsafe { libc::free(p) };
        return Err(e);
    }
    put(pp, p)
}

entry!(cuMemAllocHost_v2 | cuMemAllocHost(pp: *mut *mut c_void, bytes: usize) {
    host_alloc(pp, bytes, 0)
});

entry!(cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, flags: c_uint) {
    host_alloc(pp, bytes, flags)
});

/// Makes the host view of mapped page-locked memory at `addr` (`bytes`, its pages) memory
/// shared with the host, where the transport shares memory with it: a memory file mapped over
/// the view's pages (zeros, as they were).
fn share_view(addr: u64, bytes: usize) -> CuResult<()> {
    let len = (bytes as u64).next_multiple_of(page_size());
    let size = usize::try_from(len).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    let place = |fd: std::os::fd::BorrowedFd<'_>| {
        use std::os::fd::AsRawFd;
        // SAFETY: MAP_FIXED over the pages `map_view` mapped for this allocation's host view
        // (inside its device allocation in a context's window, nothing of the program there
        // yet), with a memory file of exactly `size` bytes.
        let p = unsafe {
            libc::mmap(
                addr as *mut c_void,
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    with(|d| d.pinned_share(addr, len, place)).map(drop)
}

/// Stops shadowing the mapped host memory whose host view starts at `host`, and frees its
/// device allocation (and its pages, when the driver mapped them): whether there was one.
fn release_mapped(host: u64) -> CuResult<bool> {
    let Some(s) = with(|d| d.shadow_release(None, Some(host)))? else {
        return Ok(false);
    };
    if s.host == s.device {
        unmap_view(s.host, s.size)?;
    }
    with(|d| d.mem_free(s.ctx, s.alloc))?;
    Ok(true)
}

entry!(cuMemFreeHost(p: *mut c_void) {
    if p.is_null() {
        return Ok(());
    }
    with(|d| d.host_memory_remove(p as u64, false))?;
    let mapped = release_mapped(p as u64)?;
    if with(|d| d.pinned_free(p as u64))? || mapped {
        return Ok(());
    }
    // SAFETY: `p` is the start of a block host_alloc got from malloc and recorded, and its
    // record is gone: it is freed once.
    unsafe { libc::free(p) };
    Ok(())
});

entry!(cuMemHostRegister_v2 | cuMemHostRegister(p: *mut c_void, bytes: usize, flags: c_uint) {
    let ctx = current()?;
    if flags & !MEMHOSTREGISTER_FLAGS != 0 || p.is_null() || bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if flags & MEMHOSTREGISTER_IOMEMORY != 0 {
        refused("cuMemHostRegister of I/O memory (no device's I/O memory is reachable)");
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    with(|d| d.host_memory_add(p as u64, bytes as u64, flags, ctx, true))?;
    if flags & MEMHOSTREGISTER_DEVICEMAP == 0 {
        // Nothing else changes: every copy goes through the transport.
        return Ok(());
    }
    // Mapped: a device allocation shadows the range (another address: the program's memory is
    // not in the device's address space; cuMemHostGetDevicePointer gives it).
    let mapped = with(|d| {
        let device = d.mem_alloc(ctx, bytes as u64)?;
        let s = crate::driver::ShadowInfo {
            ctx,
            device,
            host: p as u64,
            size: bytes as u64,
            alloc: device,
            managed: false,
        };
        d.shadow_create(s).inspect_err(|_| {
            let _ = d.mem_free(ctx, device);
        })
    });
    if let Err(e) = mapped {
        let _ = with(|d| d.host_memory_remove(p as u64, true));
        return Err(e);
    }
    Ok(())
});

entry!(cuMemHostUnregister(p: *mut c_void) {
    with(|d| d.host_memory_remove(p as u64, true))?;
    release_mapped(p as u64).map(drop)
});

entry!(cuMemHostGetFlags(flags: *mut c_uint, p: *mut c_void) {
    let memory = with(|d| Ok(d.host_memory(p as u64)))?;
    match memory {
        Some(m) if !m.registered => put(flags, m.flags),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
});

/// Writes a pointer attribute's value at its type's width.
fn put_pointer_value(data: *mut c_void, v: crate::attributes::PointerValue) -> CuResult<()> {
    use crate::attributes::PointerValue::{Bool, Int, Word};
    match v {
        Word(w) => put(data.cast::<u64>(), w),
        Int(i) => put(data.cast::<u32>(), i),
        Bool(b) => put(data.cast::<u8>(), u8::from(b)),
    }
}

entry!(cuPointerGetAttribute(data: *mut c_void, attribute: c_int, ptr: u64) {
    let info = with(|d| Ok(d.pointer_info(ptr)))?;
    let v = crate::attributes::pointer_attribute(attribute, ptr, info.as_ref(), false)?;
    put_pointer_value(data, v)
});

/// Attributes one `cuPointerGetAttributes` may ask for (each of CUDA 13's at most a few times).
const MAX_POINTER_ATTRIBUTES: c_uint = 64;

entry!(cuPointerGetAttributes(n: c_uint, attributes: *const c_int, data: *mut *mut c_void, ptr: u64) {
    if n == 0 || n > MAX_POINTER_ATTRIBUTES {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let info = with(|d| Ok(d.pointer_info(ptr)))?;
    // Every attribute and out-pointer is checked before anything is written.
    let mut values = Vec::with_capacity(n as usize);
    for i in 0..n as usize {
        let a = read_at(attributes, i)?;
        let out = read_at(data.cast_const(), i)?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        values.push((out, crate::attributes::pointer_attribute(a, ptr, info.as_ref(), true)?));
    }
    for (out, v) in values {
        put_pointer_value(out, v)?;
    }
    Ok(())
});

entry!(cuMemcpyHtoD_v2 | cuMemcpyHtoD(dst: u64, src: *const c_void, n: usize) {
    let ctx = current()?;
    let data = bytes(src, n)?;
    with(|d| d.copy_htod(ctx, dst, data, 0))
});

entry!(cuMemcpyHtoDAsync_v2 | cuMemcpyHtoDAsync(dst: u64, src: *const c_void, n: usize, stream: Handle) {
    graphs::copy_async(Memory::Device(dst), Memory::Host(src as u64), n, stream)
});

entry!(cuMemcpyDtoH_v2 | cuMemcpyDtoH(dst: *mut c_void, src: u64, n: usize) {
    let ctx = current()?;
    let out = bytes_mut(dst, n)?;
    with(|d| d.copy_dtoh(ctx, out, src, 0))
});

entry!(cuMemcpyDtoHAsync_v2 | cuMemcpyDtoHAsync(dst: *mut c_void, src: u64, n: usize, stream: Handle) {
    graphs::copy_async(Memory::Host(dst as u64), Memory::Device(src), n, stream)
});

entry!(cuMemcpyDtoD_v2 | cuMemcpyDtoD(dst: u64, src: u64, n: usize) {
    let ctx = current()?;
    with(|d| d.copy_dtod(ctx, dst, src, n as u64, 0))
});

entry!(cuMemcpyDtoDAsync_v2 | cuMemcpyDtoDAsync(dst: u64, src: u64, n: usize, stream: Handle) {
    graphs::copy_async(Memory::Device(dst), Memory::Device(src), n, stream)
});

/// `cuMemcpy` with unified addressing: the direction from which side is device memory.
fn copy_unified(dst: u64, src: u64, n: usize, stream: Handle) -> CuResult<()> {
    let ctx = owner(stream)?;
    let (dd, sd) = with(|d| {
        Ok((
            d.is_device(ctx, dst, n as u64),
            d.is_device(ctx, src, n as u64),
        ))
    })?;
    match (dd, sd) {
        (true, true) => with(|d| d.copy_dtod(ctx, dst, src, n as u64, stream as u64)),
        (true, false) => {
            let data = bytes(src as *const c_void, n)?;
            with(|d| d.copy_htod(ctx, dst, data, stream as u64))
        }
        (false, true) => {
            let out = bytes_mut(dst as *mut c_void, n)?;
            with(|d| d.copy_dtoh(ctx, out, src, stream as u64))
        }
        (false, false) => {
            let data = bytes(src as *const c_void, n)?.to_vec();
            bytes_mut(dst as *mut c_void, n)?.copy_from_slice(&data);
            Ok(())
        }
    }
}

entry!(cuMemcpy(dst: u64, src: u64, n: usize) { copy_unified(dst, src, n, std::ptr::null_mut()) });

/// Bytes a copy between two contexts moves through the library per step (bounds its buffer).
const PEER_CHUNK: usize = 1 << 20;

/// `cuMemcpyPeer`: device memory of one context to another's. The contexts' memories are apart
/// on the host, so the bytes go through the library, a chunk at a time, after the work queued
/// before on `stream` in the source context (a device-to-host copy is synchronous) and before
/// later work on it in the destination's.
fn copy_peer(
    dst: u64,
    dst_ctx: u64,
    src: u64,
    src_ctx: u64,
    n: usize,
    stream: Handle,
) -> CuResult<()> {
    if !with(|d| Ok(d.is_context(dst_ctx) && d.is_context(src_ctx)))? {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    let span = |at: u64| at.checked_add(n as u64).ok_or(CUDA_ERROR_INVALID_VALUE);
    span(dst)?;
    span(src)?;
    if dst_ctx == src_ctx {
        return with(|d| d.copy_dtod(dst_ctx, dst, src, n as u64, stream as u64));
    }
    let mut buf = vec![0u8; n.min(PEER_CHUNK)];
    let mut done = 0usize;
    while done < n {
        let len = (n - done).min(PEER_CHUNK);
        let at = done as u64;
        with(|d| d.copy_dtoh(src_ctx, &mut buf[..len], src + at, 0))?;
        with(|d| d.copy_htod(dst_ctx, dst + at, &buf[..len], 0))?;
        done += len;
    }
    Ok(())
}

entry!(cuMemcpyPeer(dst: u64, dst_ctx: Handle, src: u64, src_ctx: Handle, n: usize) {
    copy_peer(dst, dst_ctx as u64, src, src_ctx as u64, n, std::ptr::null_mut())
});

entry!(cuMemcpyPeerAsync(
    dst: u64,
    dst_ctx: Handle,
    src: u64,
    src_ctx: Handle,
    n: usize,
    stream: Handle,
) {
    // The copy waits for the stream's work and is done when it returns: to a capture it is a
    // synchronisation of the stream (refused, as CUDA refuses those).
    owner(stream)?;
    graphs::check_sync(Some(stream))?;
    copy_peer(dst, dst_ctx as u64, src, src_ctx as u64, n, stream)
});

entry!(cuMemcpyAsync(dst: u64, src: u64, n: usize, stream: Handle) {
    graphs::copy_async(Memory::Unified(dst), Memory::Unified(src), n, stream)
});

entry!(cuMemsetD8_v2 | cuMemsetD8(dst: u64, value: u8, n: usize) {
    let ctx = current()?;
    with(|d| d.memset_d8(ctx, dst, value, n as u64, 0))
});

entry!(cuMemsetD8Async(dst: u64, value: u8, n: usize, stream: Handle) {
    graphs::memset_async(dst, value.into(), 1, n, stream)
});

entry!(cuMemsetD32_v2 | cuMemsetD32(dst: u64, value: c_uint, n: usize) {
    let ctx = current()?;
    with(|d| d.memset_d32(ctx, dst, value, n as u64, 0))
});

entry!(cuMemsetD32Async(dst: u64, value: c_uint, n: usize, stream: Handle) {
    graphs::memset_async(dst, value, 4, n, stream)
});

// Streams and events.

/// `CU_STREAM_NON_BLOCKING`, the only stream flag besides the default (0).
const STREAM_NON_BLOCKING: c_uint = 1;

/// A stream with checked flags and a priority clamped to the device's range, as the driver
/// clamps it. The host runs a context's work in order, so a priority is kept and reported but
/// orders nothing.
fn create_stream(stream: *mut Handle, flags: c_uint, priority: c_int) -> CuResult<()> {
    let ctx = current()?;
    if flags & !STREAM_NON_BLOCKING != 0 || stream.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let settings = StreamSettings {
        flags,
        priority: priority.clamp(GREATEST_STREAM_PRIORITY, LEAST_STREAM_PRIORITY),
    };
    let s = with(|d| d.stream_create(ctx, settings))?;
    put(stream, s as Handle)
}

entry!(cuStreamCreate(stream: *mut Handle, flags: c_uint) {
    create_stream(stream, flags, LEAST_STREAM_PRIORITY)
});

entry!(cuStreamCreateWithPriority(stream: *mut Handle, flags: c_uint, priority: c_int) {
    create_stream(stream, flags, priority)
});

/// The settings of a stream argument (the NULL stream's for 0 and the two default streams).
fn stream_settings(stream: Handle) -> CuResult<StreamSettings> {
    let ctx = owner(stream)?;
    with(|d| d.stream_settings(ctx, stream as u64))
}

entry!(cuStreamGetPriority(stream: Handle, priority: *mut c_int) {
    put(priority, stream_settings(stream)?.priority)
});

entry!(cuStreamGetFlags(stream: Handle, flags: *mut c_uint) {
    put(flags, stream_settings(stream)?.flags)
});

entry!(cuStreamGetId(stream: Handle, id: *mut u64) {
    // The handle is unique for the process's life (0, 1 and 2 are the NULL stream, the
    // legacy and the per-thread default stream).
    stream_settings(stream)?;
    put(id, stream as u64)
});

entry!(cuStreamGetCtx(stream: Handle, pctx: *mut Handle) {
    let ctx = owner(stream)?;
    with(|d| d.stream_settings(ctx, stream as u64))?;
    put(pctx, ctx as Handle)
});

entry!(cuStreamGetCtx_v2(stream: Handle, pctx: *mut Handle, green: *mut Handle) {
    // SAFETY: our own entry point with the caller's out-pointer.
    status(unsafe { cuStreamGetCtx(stream, pctx) })?;
    // No green contexts: every stream belongs to an ordinary context.
    put_opt(green, std::ptr::null_mut())
});

entry!(cuStreamDestroy_v2 | cuStreamDestroy(stream: Handle) {
    let ctx = owner(stream)?;
    with(|d| d.stream_destroy(ctx, stream as u64))
});

entry!(cuStreamSynchronize(stream: Handle) {
    let ctx = owner(stream)?;
    graphs::check_sync(Some(stream))?;
    with(|d| d.stream_synchronize(ctx, stream as u64))
});

entry!(cuStreamQuery(stream: Handle) {
    let ctx = owner(stream)?;
    graphs::check_sync(Some(stream))?;
    with(|d| d.stream_query(ctx, stream as u64))
});

entry!(cuStreamWaitEvent(stream: Handle, event: Handle, _flags: c_uint) {
    // The host runs a context's work in order, so the event has happened once recorded.
    owner(stream)?;
    owner(event)?;
    graphs::wait_in_capture(stream, event).map(drop)
});

type StreamCallback = Option<unsafe extern "C" fn(Handle, CUresult, *mut c_void)>;

entry!(cuStreamAddCallback(stream: Handle, callback: StreamCallback, data: *mut c_void, _flags: c_uint) {
    let ctx = owner(stream)?;
    graphs::check_sync(Some(stream))?;
    let cb = callback.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let status = match with(|d| d.stream_synchronize(ctx, stream as u64)) {
        Ok(()) => CUDA_SUCCESS,
        Err(e) => e,
    };
    // SAFETY: the caller's callback with its own data, called once after the stream's work,
    // as the API promises (here on the calling thread, which the API allows).
    unsafe { cb(stream, status, data) };
    Ok(())
});

entry!(cuEventCreate(event: *mut Handle, _flags: c_uint) {
    let ctx = current()?;
    let e = with(|d| d.event_create(ctx))?;
    put(event, e as Handle)
});

entry!(cuEventDestroy_v2 | cuEventDestroy(event: Handle) {
    let ctx = owner(event)?;
    with(|d| d.event_destroy(ctx, event as u64))
});

entry!(cuEventRecord(event: Handle, stream: Handle) {
    let ctx = owner(event)?;
    if graphs::record_in_capture(event, stream)? {
        return Ok(());
    }
    with(|d| d.event_record(ctx, event as u64, stream as u64))
});

entry!(cuEventSynchronize(event: Handle) {
    let ctx = owner(event)?;
    with(|d| d.event_synchronize(ctx, event as u64))
});

entry!(cuEventQuery(event: Handle) {
    let ctx = owner(event)?;
    with(|d| d.event_query(ctx, event as u64))
});

entry!(cuEventElapsedTime_v2 | cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) {
    let ctx = owner(start)?;
    let v = with(|d| d.event_elapsed(ctx, start as u64, end as u64))?;
    put(ms, v)
});

// Launches.

/// `CU_LAUNCH_PARAM_*` markers of a launch's `extra` list.
const LAUNCH_PARAM_END: usize = 0;
const LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const LAUNCH_PARAM_BUFFER_SIZE: usize = 2;
/// Entries of an `extra` list read before giving up on finding its end.
const MAX_EXTRA_ENTRIES: usize = 64;

entry!(cuLaunchKernel(
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
) {
    launch_kernel(f, [gx, gy, gz], [bx, by, bz], shared, stream, params, extra, false)
});

entry!(cuLaunchCooperativeKernel(
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
) {
    launch_kernel(f, [gx, gy, gz], [bx, by, bz], shared, stream, params, std::ptr::null_mut(), true)
});

/// `CUlaunchConfig`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: Handle,
    attrs: *const LaunchAttribute,
    num_attrs: c_uint,
}

/// `CUlaunchAttribute`: an id, padding to 8 bytes, and a 64-byte value (an `int` first for
/// the attributes read here).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LaunchAttribute {
    id: c_uint,
    _pad: c_uint,
    value: [u64; 8],
}

/// `CUlaunchAttributeID`s a launch may carry here: `IGNORE`, `COOPERATIVE`, and hints that
/// change nothing on this device (`ACCESS_POLICY_WINDOW`: it has no persisting L2;
/// `PRIORITY`: a context's work runs in order; `MEM_SYNC_DOMAIN_MAP` and `MEM_SYNC_DOMAIN`:
/// one domain before Hopper; `PREFERRED_SHARED_MEMORY_CARVEOUT`).
const LAUNCH_ATTRIBUTE_IGNORE: c_uint = 0;
const LAUNCH_ATTRIBUTE_COOPERATIVE: c_uint = 2;
const LAUNCH_ATTRIBUTE_HINTS: [c_uint; 5] = [1, 8, 9, 10, 14];
/// Attributes of one `cuLaunchKernelEx` (cuda.h defines 19).
const MAX_LAUNCH_ATTRIBUTES: c_uint = 64;

entry!(cuLaunchKernelEx(
    config: *const LaunchConfig,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) {
    let c: LaunchConfig = read_at(config, 0)?;
    if c.num_attrs > MAX_LAUNCH_ATTRIBUTES || (c.num_attrs > 0 && c.attrs.is_null()) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut cooperative = false;
    for i in 0..c.num_attrs as usize {
        let a: LaunchAttribute = read_at(c.attrs, i)?;
        match a.id {
            LAUNCH_ATTRIBUTE_IGNORE => {}
            // The value's first member is an `int`.
            LAUNCH_ATTRIBUTE_COOPERATIVE => cooperative = a.value[0] as u32 != 0,
            id if LAUNCH_ATTRIBUTE_HINTS.contains(&id) => {}
            id => {
                // Clusters need compute capability 9.0; programmatic launches and launch
                // completion events are not implemented.
                refused(&format!("cuLaunchKernelEx: launch attribute {id}"));
                return Err(CUDA_ERROR_NOT_SUPPORTED);
            }
        }
    }
    launch_kernel(f, c.grid, c.block, c.shared, c.stream, params, extra, cooperative)
});

/// A kernel launch on `stream` (captured when it captures).
#[allow(clippy::too_many_arguments)]
fn launch_kernel(
    f: Handle,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    cooperative: bool,
) -> CuResult<()> {
    let f = function(f)?;
    let launch_params = launch_params(f, params, extra)?;
    graphs::submit(stream, |ctx| {
        Ok(crate::graph::Op::Kernel {
            ctx,
            function: f,
            grid,
            block,
            shared,
            params: launch_params,
            cooperative,
        })
    })
}

/// A launch's parameters from `kernelParams` or `extra` (one of them), for function `f`.
fn launch_params(
    f: u64,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult<LaunchParams> {
    let layout: Vec<(usize, usize)> = with(|d| {
        Ok(d.params(f)?
            .iter()
            .map(|p| (p.offset as usize, p.size as usize))
            .collect())
    })?;
    Ok(if !params.is_null() {
        let mut each = Vec::with_capacity(layout.len());
        for (i, &(_, size)) in layout.iter().enumerate() {
            each.push(bytes(entry_at(params, i)? as *const c_void, size)?.to_vec());
        }
        LaunchParams::Each(each)
    } else if !extra.is_null() {
        let (mut buf, mut size) = (None, None);
        let mut i = 0;
        loop {
            if i >= MAX_EXTRA_ENTRIES {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            match entry_at(extra, i)? {
                LAUNCH_PARAM_END => break,
                LAUNCH_PARAM_BUFFER_POINTER => buf = Some(entry_at(extra, i + 1)?),
                LAUNCH_PARAM_BUFFER_SIZE => {
                    size = Some(read_at(entry_at(extra, i + 1)? as *const usize, 0)?);
                }
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
            i += 2;
        }
        let (Some(b), Some(n)) = (buf, size) else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        LaunchParams::Packed(bytes(b as *const c_void, n)?.to_vec())
    } else if layout.is_empty() {
        LaunchParams::Each(Vec::new())
    } else {
        return Err(CUDA_ERROR_INVALID_VALUE);
    })
}

// The launch API of CUDA 1, deprecated and still in cuda.h: a function's block shape, dynamic
// shared memory and parameter buffer are set on it, then cuLaunch/cuLaunchGrid launch it.

entry!(cuFuncSetBlockShape(f: Handle, x: c_int, y: c_int, z: c_int) {
    let f = function(f)?;
    let block = [count(x)?, count(y)?, count(z)?];
    with(|d| {
        d.legacy_launch(f)?.block = block;
        Ok(())
    })
});

entry!(cuFuncSetSharedSize(f: Handle, bytes: c_uint) {
    let f = function(f)?;
    with(|d| {
        d.legacy_launch(f)?.shared_bytes = bytes;
        Ok(())
    })
});

entry!(cuParamSetSize(f: Handle, bytes: c_uint) {
    let f = function(f)?;
    if bytes > crate::driver::MAX_LEGACY_PARAM_BYTES {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    with(|d| {
        d.legacy_launch(f)?.params.resize(bytes as usize, 0);
        Ok(())
    })
});

/// Writes `value` at `offset` of a function's parameter buffer (within its set size).
fn set_param(f: Handle, offset: c_int, value: &[u8]) -> CuResult<()> {
    let f = function(f)?;
    let at = usize::try_from(offset).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    with(|d| {
        let params = &mut d.legacy_launch(f)?.params;
        let end = at.checked_add(value.len()).filter(|&e| e <= params.len());
        let end = end.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        params[at..end].copy_from_slice(value);
        Ok(())
    })
}

entry!(cuParamSeti(f: Handle, offset: c_int, value: c_uint) {
    set_param(f, offset, &value.to_le_bytes())
});

entry!(cuParamSetf(f: Handle, offset: c_int, value: f32) {
    set_param(f, offset, &value.to_le_bytes())
});

entry!(cuParamSetv(f: Handle, offset: c_int, p: *mut c_void, n: c_uint) {
    set_param(f, offset, bytes(p.cast_const(), n as usize)?)
});

/// Launches `f` over a `width` × `height` grid with what the deprecated API set on it, as
/// cuLaunchKernel with a packed parameter buffer.
fn legacy_launch(f: Handle, width: c_int, height: c_int, stream: Handle) -> CuResult<()> {
    let (w, h) = (count(width)?, count(height)?);
    let fid = function(f)?;
    let l = with(|d| Ok(d.legacy_launch(fid)?.clone()))?;
    let [bx, by, bz] = l.block;
    let mut size = l.params.len();
    let mut extra = [
        LAUNCH_PARAM_BUFFER_POINTER as *mut c_void,
        l.params.as_ptr().cast_mut().cast(),
        LAUNCH_PARAM_BUFFER_SIZE as *mut c_void,
        (&raw mut size).cast(),
        LAUNCH_PARAM_END as *mut c_void,
    ];
    // SAFETY: our own entry point with a function handle, a grid and block, and an `extra`
    // list naming the buffer (alive for the call) and its size.
    status(unsafe {
        cuLaunchKernel(
            f,
            w,
            h,
            1,
            bx,
            by,
            bz,
            l.shared_bytes,
            stream,
            std::ptr::null_mut(),
            extra.as_mut_ptr(),
        )
    })
}

entry!(cuLaunch(f: Handle) { legacy_launch(f, 1, 1, std::ptr::null_mut()) });

entry!(cuLaunchGrid(f: Handle, width: c_int, height: c_int) {
    legacy_launch(f, width, height, std::ptr::null_mut())
});

entry!(cuLaunchGridAsync(f: Handle, width: c_int, height: c_int, stream: Handle) {
    legacy_launch(f, width, height, stream)
});

// Errors.

entry!(cuGetErrorString(status: c_uint, out: *mut *const c_char) {
    let (_, text) = describe(status).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let explained = EXPLANATION.with(|e| e.get()).and_then(|(code, at)| {
        let kept = EXPLAINED.lock().unwrap_or_else(|p| p.into_inner());
        // The text lives as long as the process: EXPLAINED never drops or moves a CString's
        // heap buffer (only the Vec of them grows).
        (code == status).then(|| kept.get(at).map(|t| t.as_ptr())).flatten()
    });
    put(out, explained.unwrap_or(text.as_ptr()))
});

entry!(cuGetErrorName(status: c_uint, out: *mut *const c_char) {
    let (n, _) = describe(status).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    put(out, n.as_ptr())
});

// Profiler control: no profiler is attached, so starting and stopping collection succeed
// and collect nothing, as on a driver run without a profiling tool.

entry!(cuProfilerInitialize(_config: *const c_char, _output: *const c_char, _mode: c_int) {
    current().map(drop)
});

entry!(cuProfilerStart() { current().map(drop) });

entry!(cuProfilerStop() { current().map(drop) });

// Entry-point lookup (the CUDA runtime resolves everything through these).

/// `CUdriverProcAddressQueryResult`: found, symbol not found, version not sufficient.
const PROC_ADDRESS_SUCCESS: c_int = 0;
const PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;
const PROC_ADDRESS_VERSION_NOT_SUFFICIENT: c_int = 2;
/// `CUdriverProcAddress_flags`: legacy default stream (also what 0, the default, means to a
/// driver that cannot see how the caller was compiled), per-thread default stream.
const PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
const PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// This library's own handle: found through the path of one of its functions and opened
/// again without loading anything, so the lookup works however the library was loaded (libgomp
/// and cudart `dlopen` it with local symbols) and never finds a real driver loaded beside it.
fn own_handle() -> Option<usize> {
    static HANDLE: OnceLock<Option<usize>> = OnceLock::new();
    *HANDLE.get_or_init(|| {
        let mut info = libc::Dl_info {
            dli_fname: std::ptr::null(),
            dli_fbase: std::ptr::null_mut(),
            dli_sname: std::ptr::null(),
            dli_saddr: std::ptr::null_mut(),
        };
        // SAFETY: dladdr of one of our own functions, writing `info`.
        if unsafe { libc::dladdr(cuInit as *const c_void, &mut info) } == 0
            || info.dli_fname.is_null()
        {
            return None;
        }
        // SAFETY: the path dladdr gave (NUL-terminated, owned by the loader); RTLD_NOLOAD only
        // takes another reference to the library already loaded, which is never released (the
        // library stays loaded for the process's life).
        let h = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        (!h.is_null()).then_some(h as usize)
    })
}

/// Our own exported symbol `symbol`.
fn own_symbol(symbol: &str) -> Option<*mut c_void> {
    let handle = own_handle()? as *mut c_void;
    let c = std::ffi::CString::new(symbol).ok()?;
    // SAFETY: dlsym in our own library's handle with a NUL-terminated name; it only reads.
    let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// What `cuGetProcAddress` answers for `name` asked by a caller of CUDA `version`: the symbol
/// of the version's signature (`symbols.rs`). A per-thread default stream variant this library
/// does not export is answered with the legacy one: every context's work runs in order on the
/// host, so the two default streams are the same stream here.
fn lookup(name: &str, version: u32, per_thread: bool) -> Result<*mut c_void, c_int> {
    let found = match crate::symbols::resolve(name, version, per_thread) {
        Resolution::Symbol { symbol, legacy } => {
            own_symbol(symbol).or_else(|| legacy.and_then(own_symbol))
        }
        Resolution::VersionNotSufficient => return Err(PROC_ADDRESS_VERSION_NOT_SUFFICIENT),
        Resolution::Unknown => own_symbol(name),
    };
    found.ok_or(PROC_ADDRESS_SYMBOL_NOT_FOUND)
}

entry!(cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut c_int,
) {
    let n = name(symbol)?;
    let version = u32::try_from(cuda_version).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    if flags & !(PROC_ADDRESS_LEGACY_STREAM | PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let per_thread = flags & PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    match lookup(n, version, per_thread) {
        Ok(p) => {
            put_opt(status, PROC_ADDRESS_SUCCESS)?;
            put(pfn, p)
        }
        Err(why) => {
            if *TRACING {
                eprintln!("vgpu libcuda: cuGetProcAddress: no {n} for CUDA {version} ({why})");
            }
            put_opt(status, why)?;
            put(pfn, std::ptr::null_mut())?;
            Err(CUDA_ERROR_NOT_FOUND)
        }
    }
});

entry!(cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: u64) {
    // SAFETY: the same arguments, without the optional status.
    status(unsafe { cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, std::ptr::null_mut()) })
});

entry!(cuGetExportTable(table: *mut *const c_void, id: *const [u8; 16]) {
    let uuid = read_at(id, 0)?;
    match crate::export::lookup(&uuid) {
        Some(t) => put(table, t),
        None => {
            if *TRACING {
                eprintln!("vgpu libcuda: no export table {uuid:02x?}");
            }
            put(table, std::ptr::null())?;
            Err(CUDA_ERROR_NOT_FOUND)
        }
    }
});

// Graphs and stream capture; memory pools and stream-ordered allocation; virtual memory
// management.
/// The array module's copies and memsets become nodes of a capturing stream through this.
pub(crate) use graphs::record as record_in_capture;
mod graphs;
mod pools;
mod refused;
mod vmm;
