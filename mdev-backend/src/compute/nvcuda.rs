//! [`NvCuda`]: the compute backend on the real CUDA driver, `libcuda.so.1` loaded at run time.
//!
//! The driver entry points are resolved with `libloading` (already used for virglrenderer)
//! rather than a driver-bindings crate: about thirty C functions of a stable ABI are needed,
//! the build needs no CUDA toolkit and no new dependency, and every raw call stays in this one
//! module with its safety argument next to it.
//!
//! Isolation: each guest context is its own `CUcontext` (`cuCtxCreate`), not a share of the
//! primary context, so a sticky fault (illegal address, trap) poisons only that guest context
//! and its allocations live in a separate GPU address space. Guest-supplied values never reach
//! the driver as handles: every id is looked up in this backend's tables, device addresses of
//! copies and memsets must lie inside one allocation of the context, and module images are
//! passed only as validated, NUL-terminated PTX text (the driver parses binary images with no
//! length, so a guest's cubin is never handed to it).
//!
//! Every wait is bounded: synchronisations poll `cuStreamQuery`/`cuEventQuery` up to
//! [`NvCudaConfig::sync_timeout`] and answer [`ComputeError::LaunchTimeout`] (the context is
//! then broken) rather than block in the driver. All calls are made from the VM's executor
//! thread, each after making the guest context's `CUcontext` current.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::time::{Duration, Instant};

use libloading::Library;

use super::backend::{
    ComputeBackend, ContextId, DeviceAttributes, EventId, FunctionId, FunctionInfo, LaunchArgs,
    MAX_CONTEXTS, MAX_COPY_BYTES, MAX_EVENTS, MAX_FUNCTIONS_PER_CONTEXT, MAX_MODULE_IMAGE_BYTES,
    MAX_MODULES_PER_CONTEXT, MAX_STREAMS, MemInfo, ModuleId, ParamLayout, StreamId,
};
use super::{ComputeError, ComputeResult, ptx};

type CuResult = c_uint;
type CuDevice = c_int;
type Handle = *mut c_void;
type DevPtr = u64;

const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_NOT_READY: CuResult = 600;

// CUdevice_attribute values (cuda.h).
const ATTR_MAX_THREADS_PER_BLOCK: c_int = 1;
const ATTR_MAX_BLOCK_DIM_X: c_int = 2;
const ATTR_MAX_GRID_DIM_X: c_int = 5;
const ATTR_SHARED_MEMORY_PER_BLOCK: c_int = 8;
const ATTR_WARP_SIZE: c_int = 10;
const ATTR_CLOCK_RATE: c_int = 13;
const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
const ATTR_CC_MAJOR: c_int = 75;
const ATTR_CC_MINOR: c_int = 76;
const ATTR_PAGEABLE_MEMORY_ACCESS: c_int = 88;

// cuLaunchKernel `extra` keys.
const LAUNCH_PARAM_END: usize = 0;
const LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const LAUNCH_PARAM_BUFFER_SIZE: usize = 2;

/// Settings of the real-driver backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvCudaConfig {
    /// The driver library to load.
    pub library: String,
    /// Device ordinal.
    pub device: i32,
    /// Device memory budget of each guest context, in bytes.
    pub context_memory: u64,
    /// Longest synchronisation before a context is declared hung (`LaunchTimeout`).
    pub sync_timeout: Duration,
    /// Run even when the device can access the process's pageable host memory (HMM or ATS):
    /// a guest kernel could then read and write this process's memory through host pointers.
    pub allow_pageable_memory_access: bool,
}

impl Default for NvCudaConfig {
    fn default() -> Self {
        NvCudaConfig {
            library: "libcuda.so.1".into(),
            device: 0,
            context_memory: super::backend::DEFAULT_CONTEXT_MEMORY,
            sync_timeout: Duration::from_secs(5),
            allow_pageable_memory_access: false,
        }
    }
}

/// The driver entry points.
struct Driver {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    ctx_create: unsafe extern "C" fn(*mut Handle, c_uint, CuDevice) -> CuResult,
    ctx_destroy: unsafe extern "C" fn(Handle) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(Handle) -> CuResult,
    module_load_data: unsafe extern "C" fn(*mut Handle, *const c_void) -> CuResult,
    module_unload: unsafe extern "C" fn(Handle) -> CuResult,
    module_get_function: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> CuResult,
    /// CUDA 12.4+; older drivers get the layout from the PTX alone.
    func_get_param_info:
        Option<unsafe extern "C" fn(Handle, usize, *mut usize, *mut usize) -> CuResult>,
    launch_kernel: unsafe extern "C" fn(
        Handle,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Handle,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut DevPtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(DevPtr) -> CuResult,
    memset_d8: unsafe extern "C" fn(DevPtr, u8, usize, Handle) -> CuResult,
    memset_d32: unsafe extern "C" fn(DevPtr, c_uint, usize, Handle) -> CuResult,
    memcpy_htod: unsafe extern "C" fn(DevPtr, *const c_void, usize, Handle) -> CuResult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, DevPtr, usize, Handle) -> CuResult,
    memcpy_dtod: unsafe extern "C" fn(DevPtr, DevPtr, usize, Handle) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(Handle) -> CuResult,
    stream_query: unsafe extern "C" fn(Handle) -> CuResult,
    event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult,
    event_destroy: unsafe extern "C" fn(Handle) -> CuResult,
    event_record: unsafe extern "C" fn(Handle, Handle) -> CuResult,
    event_query: unsafe extern "C" fn(Handle) -> CuResult,
    event_elapsed: unsafe extern "C" fn(*mut f32, Handle, Handle) -> CuResult,
    _lib: Library,
}

impl Driver {
    fn load(name: &str) -> ComputeResult<Driver> {
        // SAFETY: loading the CUDA driver runs its ELF constructors, which only set up the
        // library's own state; the library stays loaded as long as `Driver` (`_lib`).
        let lib = unsafe { Library::new(name) }
            .map_err(|e| ComputeError::NoDevice(format!("cannot load {name}: {e}")))?;
        macro_rules! sym {
            ($symbol:literal) => {{
                // SAFETY: the field's type is the C signature of `$symbol` in cuda.h; the
                // copied pointer stays valid because `_lib` is kept with it.
                let f = unsafe { lib.get($symbol.as_bytes()) };
                *f.map_err(|e| ComputeError::NoDevice(format!("{name}: {}: {e}", $symbol)))?
            }};
        }
        // SAFETY: as for `sym!`; a missing symbol is `None`.
        let func_get_param_info = unsafe { lib.get(b"cuFuncGetParamInfo") }.ok().map(|f| *f);
        Ok(Driver {
            init: sym!("cuInit"),
            device_get_count: sym!("cuDeviceGetCount"),
            device_get: sym!("cuDeviceGet"),
            device_get_name: sym!("cuDeviceGetName"),
            device_total_mem: sym!("cuDeviceTotalMem_v2"),
            device_get_attribute: sym!("cuDeviceGetAttribute"),
            get_error_name: sym!("cuGetErrorName"),
            ctx_create: sym!("cuCtxCreate_v2"),
            ctx_destroy: sym!("cuCtxDestroy_v2"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            module_load_data: sym!("cuModuleLoadData"),
            module_unload: sym!("cuModuleUnload"),
            module_get_function: sym!("cuModuleGetFunction"),
            func_get_param_info,
            launch_kernel: sym!("cuLaunchKernel"),
            mem_alloc: sym!("cuMemAlloc_v2"),
            mem_free: sym!("cuMemFree_v2"),
            memset_d8: sym!("cuMemsetD8Async"),
            memset_d32: sym!("cuMemsetD32Async"),
            memcpy_htod: sym!("cuMemcpyHtoDAsync_v2"),
            memcpy_dtoh: sym!("cuMemcpyDtoHAsync_v2"),
            memcpy_dtod: sym!("cuMemcpyDtoDAsync_v2"),
            stream_create: sym!("cuStreamCreate"),
            stream_destroy: sym!("cuStreamDestroy_v2"),
            stream_query: sym!("cuStreamQuery"),
            event_create: sym!("cuEventCreate"),
            event_destroy: sym!("cuEventDestroy_v2"),
            event_record: sym!("cuEventRecord"),
            event_query: sym!("cuEventQuery"),
            event_elapsed: sym!("cuEventElapsedTime"),
            _lib: lib,
        })
    }

    /// The driver's name of a status.
    fn error_name(&self, r: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `p` is a valid out-pointer; the driver stores a static string or fails.
        let ok = unsafe { (self.get_error_name)(r, &mut p) } == CUDA_SUCCESS;
        if ok && !p.is_null() {
            // SAFETY: a successful cuGetErrorName points at a static NUL-terminated string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            format!("CUresult {r}")
        }
    }

    /// `Ok` for success, the status as a [`ComputeError`] otherwise.
    fn check(&self, r: CuResult, what: &str) -> ComputeResult<()> {
        if r == CUDA_SUCCESS {
            return Ok(());
        }
        let msg = format!("{what}: {}", self.error_name(r));
        Err(match r {
            1 => ComputeError::InvalidValue(msg),
            2 => ComputeError::OutOfMemory(msg),
            100 | 101 => ComputeError::NoDevice(msg),
            200 | 209 => ComputeError::InvalidImage(msg),
            218 => ComputeError::InvalidPtx(msg),
            400 => ComputeError::InvalidHandle(msg),
            500 => ComputeError::NotFound(msg),
            CUDA_ERROR_NOT_READY => ComputeError::NotReady,
            700 => ComputeError::IllegalAddress(msg),
            701 => ComputeError::LaunchOutOfResources(msg),
            702 => ComputeError::LaunchTimeout(msg),
            715 => ComputeError::IllegalInstruction(msg),
            716 => ComputeError::MisalignedAddress(msg),
            719 => ComputeError::ContextBroken(msg),
            code => ComputeError::Driver { code, what: msg },
        })
    }

    fn attribute(&self, attr: c_int, dev: CuDevice) -> ComputeResult<u32> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer; `dev` came from cuDeviceGet.
        let r = unsafe { (self.device_get_attribute)(&mut v, attr, dev) };
        self.check(r, "cuDeviceGetAttribute")?;
        Ok(v.max(0) as u32)
    }
}

/// A kernel handle and its parameter buffer length.
#[derive(Debug)]
struct Function {
    module: ModuleId,
    handle: Handle,
    param_bytes: u32,
}

/// A loaded module and, when the executor's parser accepts it, its parsed PTX (for layouts).
#[derive(Debug)]
struct LoadedModule {
    handle: Handle,
    parsed: Option<ptx::Module>,
}

/// One guest context: its CUcontext and the handles it owns.
#[derive(Debug)]
struct Context {
    cu: Handle,
    /// Allocations, base to length.
    allocations: BTreeMap<u64, u64>,
    used: u64,
    modules: BTreeMap<ModuleId, LoadedModule>,
    functions: BTreeMap<FunctionId, Function>,
    streams: BTreeMap<StreamId, Handle>,
    events: BTreeMap<EventId, Handle>,
    broken: Option<String>,
}

impl Context {
    fn stream(&self, s: StreamId) -> ComputeResult<Handle> {
        if s == StreamId::DEFAULT {
            return Ok(std::ptr::null_mut());
        }
        self.streams
            .get(&s)
            .copied()
            .ok_or_else(|| ComputeError::InvalidHandle(format!("stream {}", s.0)))
    }

    fn event(&self, e: EventId) -> ComputeResult<Handle> {
        self.events
            .get(&e)
            .copied()
            .ok_or_else(|| ComputeError::InvalidHandle(format!("event {}", e.0)))
    }

    /// Checks that `[addr, addr + len)` lies inside one allocation.
    fn range(&self, addr: u64, len: u64) -> ComputeResult<()> {
        if len > MAX_COPY_BYTES {
            return Err(ComputeError::InvalidValue(format!(
                "{len} bytes, past {MAX_COPY_BYTES}"
            )));
        }
        match self.allocations.range(..=addr).next_back() {
            Some((&base, &size)) if addr - base < size && size - (addr - base) >= len => Ok(()),
            _ => Err(ComputeError::InvalidValue(format!(
                "{len} bytes at {addr:#x} are not inside one allocation"
            ))),
        }
    }
}

/// The compute backend on the real driver (see the module documentation).
pub struct NvCuda {
    drv: Driver,
    device: CuDevice,
    attributes: DeviceAttributes,
    config: NvCudaConfig,
    contexts: BTreeMap<ContextId, Context>,
    next_id: u32,
}

// SAFETY: the raw driver handles NvCuda holds are not tied to the thread that created them (a
// CUcontext is made current on the calling thread before each use), and NvCuda is used by one
// thread at a time (`&mut self`), in practice always the VM's executor thread.
unsafe impl Send for NvCuda {}

impl std::fmt::Debug for NvCuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvCuda")
            .field("attributes", &self.attributes)
            .field("contexts", &self.contexts.len())
            .finish_non_exhaustive()
    }
}

impl NvCuda {
    /// Loads the driver and opens the configured device. Without the library or a device the
    /// answer is [`ComputeError::NoDevice`], and the device offers no compute.
    pub fn new(config: NvCudaConfig) -> ComputeResult<NvCuda> {
        let drv = Driver::load(&config.library)?;
        // SAFETY: plain flags argument (must be 0).
        drv.check(unsafe { (drv.init)(0) }, "cuInit")?;
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer.
        let r = unsafe { (drv.device_get_count)(&mut count) };
        drv.check(r, "cuDeviceGetCount")?;
        if config.device < 0 || config.device >= count {
            return Err(ComputeError::NoDevice(format!(
                "device {} of {count}",
                config.device
            )));
        }
        let mut device: CuDevice = 0;
        // SAFETY: `device` is a valid out-pointer; the ordinal was checked against the count.
        let r = unsafe { (drv.device_get)(&mut device, config.device) };
        drv.check(r, "cuDeviceGet")?;
        let mut name = [0 as c_char; 256];
        // SAFETY: `name` is valid for 256 bytes; the driver writes a NUL-terminated string.
        let r = unsafe { (drv.device_get_name)(name.as_mut_ptr(), 256, device) };
        drv.check(r, "cuDeviceGetName")?;
        // SAFETY: the buffer is NUL-terminated within its 256 bytes (zeroed, driver-filled).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut total: usize = 0;
        // SAFETY: `total` is a valid out-pointer.
        let r = unsafe { (drv.device_total_mem)(&mut total, device) };
        drv.check(r, "cuDeviceTotalMem")?;
        if drv.attribute(ATTR_PAGEABLE_MEMORY_ACCESS, device)? != 0 {
            if !config.allow_pageable_memory_access {
                return Err(ComputeError::NoDevice(format!(
                    "{name} can access pageable host memory (HMM/ATS): a guest kernel could \
                     reach this process's memory; refused unless allowed in the configuration"
                )));
            }
            log::warn!("compute: {name} can access pageable host memory; allowed by configuration");
        }
        let a = |attr| drv.attribute(attr, device);
        let attributes = DeviceAttributes {
            name,
            total_memory: config.context_memory.min(total as u64),
            compute_capability: (a(ATTR_CC_MAJOR)?, a(ATTR_CC_MINOR)?),
            multiprocessor_count: a(ATTR_MULTIPROCESSOR_COUNT)?,
            max_threads_per_block: a(ATTR_MAX_THREADS_PER_BLOCK)?,
            max_block_dim: [
                a(ATTR_MAX_BLOCK_DIM_X)?,
                a(ATTR_MAX_BLOCK_DIM_X + 1)?,
                a(ATTR_MAX_BLOCK_DIM_X + 2)?,
            ],
            max_grid_dim: [
                a(ATTR_MAX_GRID_DIM_X)?,
                a(ATTR_MAX_GRID_DIM_X + 1)?,
                a(ATTR_MAX_GRID_DIM_X + 2)?,
            ],
            shared_memory_per_block: a(ATTR_SHARED_MEMORY_PER_BLOCK)?,
            warp_size: a(ATTR_WARP_SIZE)?,
            clock_rate_khz: a(ATTR_CLOCK_RATE)?,
        };
        log::info!(
            "compute: {} (sm_{}{}, {} MiB) on the CUDA driver",
            attributes.name,
            attributes.compute_capability.0,
            attributes.compute_capability.1,
            total >> 20
        );
        Ok(NvCuda {
            drv,
            device,
            attributes,
            config,
            contexts: BTreeMap::new(),
            next_id: 1,
        })
    }

    fn fresh_id(&mut self) -> ComputeResult<u32> {
        let id = self.next_id;
        self.next_id = id
            .checked_add(1)
            .ok_or_else(|| ComputeError::OutOfMemory("object ids exhausted".into()))?;
        Ok(id)
    }

    /// Runs `f` with the context current; a sticky error breaks the context.
    fn with_ctx<T>(
        &mut self,
        ctx: ContextId,
        f: impl FnOnce(&Driver, &mut Context, Duration) -> ComputeResult<T>,
    ) -> ComputeResult<T> {
        let timeout = self.config.sync_timeout;
        let drv = &self.drv;
        let c = self
            .contexts
            .get_mut(&ctx)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("context {}", ctx.0)))?;
        if let Some(why) = &c.broken {
            return Err(ComputeError::ContextBroken(why.clone()));
        }
        // SAFETY: `c.cu` is a live context created by cuCtxCreate and not yet destroyed.
        drv.check(unsafe { (drv.ctx_set_current)(c.cu) }, "cuCtxSetCurrent")?;
        let r = f(drv, c, timeout);
        if let Err(e) = &r
            && e.is_sticky()
        {
            log::warn!("compute context {}: {e}; the context is broken", ctx.0);
            c.broken = Some(e.to_string());
        }
        r
    }
}

/// Polls `query` until it stops answering NOT_READY, at most `timeout`.
fn wait(
    drv: &Driver,
    timeout: Duration,
    what: &str,
    query: impl Fn() -> CuResult,
) -> ComputeResult<()> {
    let start = Instant::now();
    loop {
        match query() {
            CUDA_ERROR_NOT_READY => {}
            r => return drv.check(r, what),
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(ComputeError::LaunchTimeout(format!(
                "{what} not complete after {timeout:?}"
            )));
        }
        if waited < Duration::from_micros(200) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Waits for a stream's work, bounded.
fn wait_stream(drv: &Driver, timeout: Duration, s: Handle) -> ComputeResult<()> {
    // SAFETY: `s` is null (the context's default stream) or a live stream of the current
    // context.
    wait(drv, timeout, "stream", || unsafe { (drv.stream_query)(s) })
}

/// The image as NUL-terminated PTX text, the only form handed to the driver.
fn ptx_image(image: &[u8]) -> ComputeResult<CString> {
    let text = match image.iter().position(|&b| b == 0) {
        Some(n) => &image[..n],
        None => image,
    };
    std::str::from_utf8(text)
        .ok()
        .filter(|t| t.contains(".version"))
        .and_then(|t| CString::new(t).ok())
        .ok_or_else(|| ComputeError::InvalidImage("not PTX text".into()))
}

/// Parameter layout from the driver (offsets and sizes; alignment is the largest power of two
/// dividing the offset, at most 16, or the size's for the first).
fn driver_layout(
    drv: &Driver,
    f: Handle,
    get: unsafe extern "C" fn(Handle, usize, *mut usize, *mut usize) -> CuResult,
) -> ComputeResult<Vec<ParamLayout>> {
    let mut params = Vec::new();
    for i in 0..=(ptx::MAX_PARAM_BYTES as usize) {
        let (mut off, mut size) = (0usize, 0usize);
        // SAFETY: `f` is a live function of the current context; both out-pointers are valid.
        let r = unsafe { get(f, i, &mut off, &mut size) };
        if r != CUDA_SUCCESS {
            if r == 1 {
                break;
            }
            drv.check(r, "cuFuncGetParamInfo")?;
        }
        let (offset, size) = (off as u32, size as u32);
        let align = if offset == 0 {
            size.next_power_of_two().min(16)
        } else {
            (1 << offset.trailing_zeros()).min(16)
        };
        params.push(ParamLayout {
            offset,
            size,
            align,
        });
    }
    Ok(params)
}

impl ComputeBackend for NvCuda {
    fn attributes(&self) -> DeviceAttributes {
        self.attributes.clone()
    }

    fn ctx_create(&mut self) -> ComputeResult<ContextId> {
        if self.contexts.len() >= MAX_CONTEXTS {
            return Err(ComputeError::OutOfMemory(format!(
                "{MAX_CONTEXTS} contexts"
            )));
        }
        let id = ContextId(self.fresh_id()?);
        let mut cu: Handle = std::ptr::null_mut();
        // SAFETY: `cu` is a valid out-pointer; flags 0 (automatic scheduling); `device` came
        // from cuDeviceGet.
        let r = unsafe { (self.drv.ctx_create)(&mut cu, 0, self.device) };
        self.drv.check(r, "cuCtxCreate")?;
        self.contexts.insert(
            id,
            Context {
                cu,
                allocations: BTreeMap::new(),
                used: 0,
                modules: BTreeMap::new(),
                functions: BTreeMap::new(),
                streams: BTreeMap::new(),
                events: BTreeMap::new(),
                broken: None,
            },
        );
        log::debug!("compute context {} created (CUcontext)", id.0);
        Ok(id)
    }

    fn ctx_destroy(&mut self, ctx: ContextId) -> ComputeResult<()> {
        let c = self
            .contexts
            .remove(&ctx)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("context {}", ctx.0)))?;
        // SAFETY: `c.cu` is live and no longer reachable from the table; destroying it frees
        // every module, stream, event and allocation made in it.
        let r = unsafe { (self.drv.ctx_destroy)(c.cu) };
        self.drv.check(r, "cuCtxDestroy")
    }

    fn ctx_synchronize(&mut self, ctx: ContextId) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, t| {
            wait_stream(drv, t, std::ptr::null_mut())?;
            c.streams.values().try_for_each(|&s| wait_stream(drv, t, s))
        })
    }

    fn module_load(&mut self, ctx: ContextId, image: &[u8]) -> ComputeResult<ModuleId> {
        if image.len() > MAX_MODULE_IMAGE_BYTES {
            return Err(ComputeError::InvalidValue(format!(
                "module image of {} bytes",
                image.len()
            )));
        }
        let id = ModuleId(self.fresh_id()?);
        self.with_ctx(ctx, |drv, c, _| {
            if c.modules.len() >= MAX_MODULES_PER_CONTEXT {
                return Err(ComputeError::OutOfMemory(format!(
                    "{MAX_MODULES_PER_CONTEXT} modules"
                )));
            }
            let text = ptx_image(image)?;
            let parsed = text.to_str().ok().and_then(|t| ptx::Module::parse(t).ok());
            let mut handle: Handle = std::ptr::null_mut();
            // SAFETY: `handle` is a valid out-pointer; `text` is NUL-terminated PTX that lives
            // across the call (the driver copies what it keeps).
            let r = unsafe { (drv.module_load_data)(&mut handle, text.as_ptr().cast()) };
            drv.check(r, "cuModuleLoadData")?;
            c.modules.insert(id, LoadedModule { handle, parsed });
            Ok(id)
        })
    }

    fn module_unload(&mut self, ctx: ContextId, module: ModuleId) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, _| {
            let m = c
                .modules
                .remove(&module)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("module {}", module.0)))?;
            c.functions.retain(|_, f| f.module != module);
            // SAFETY: `m.handle` is a live module of the current context, now unreachable.
            drv.check(unsafe { (drv.module_unload)(m.handle) }, "cuModuleUnload")
        })
    }

    fn function_get(
        &mut self,
        ctx: ContextId,
        module: ModuleId,
        name: &str,
    ) -> ComputeResult<FunctionInfo> {
        let id = FunctionId(self.fresh_id()?);
        self.with_ctx(ctx, |drv, c, _| {
            let m = c
                .modules
                .get(&module)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("module {}", module.0)))?;
            let cname = CString::new(name)
                .map_err(|_| ComputeError::InvalidValue("function name with NUL".into()))?;
            let mut handle: Handle = std::ptr::null_mut();
            // SAFETY: `handle` is a valid out-pointer, `m.handle` a live module of the current
            // context, `cname` NUL-terminated.
            let r = unsafe { (drv.module_get_function)(&mut handle, m.handle, cname.as_ptr()) };
            drv.check(r, "cuModuleGetFunction")?;
            let params = match (
                m.parsed.as_ref().and_then(|p| p.kernel(name)),
                drv.func_get_param_info,
            ) {
                (Some(k), _) => k
                    .params
                    .iter()
                    .map(|p| ParamLayout {
                        offset: p.offset,
                        size: p.size,
                        align: p.align,
                    })
                    .collect(),
                (None, Some(get)) => driver_layout(drv, handle, get)?,
                (None, None) => {
                    return Err(ComputeError::NotFound(format!(
                        "parameter layout of {name:?} (driver before CUDA 12.4)"
                    )));
                }
            };
            let param_bytes = params.iter().map(|p| p.offset + p.size).max().unwrap_or(0);
            if let Some((old, _)) = c
                .functions
                .iter()
                .find(|(_, f)| f.module == module && f.handle == handle)
            {
                return Ok(FunctionInfo {
                    id: *old,
                    params,
                    param_bytes,
                });
            }
            if c.functions.len() >= MAX_FUNCTIONS_PER_CONTEXT {
                return Err(ComputeError::OutOfMemory(format!(
                    "{MAX_FUNCTIONS_PER_CONTEXT} functions"
                )));
            }
            c.functions.insert(
                id,
                Function {
                    module,
                    handle,
                    param_bytes,
                },
            );
            Ok(FunctionInfo {
                id,
                params,
                param_bytes,
            })
        })
    }

    fn mem_alloc(&mut self, ctx: ContextId, size: u64) -> ComputeResult<u64> {
        let budget = self.config.context_memory;
        self.with_ctx(ctx, |drv, c, _| {
            if size == 0 {
                return Err(ComputeError::InvalidValue("allocation of 0 bytes".into()));
            }
            if c.allocations.len() >= super::memory::MAX_ALLOCATIONS
                || c.used.saturating_add(size) > budget
            {
                return Err(ComputeError::OutOfMemory(format!(
                    "{size} bytes past the context budget of {budget}"
                )));
            }
            let mut p: DevPtr = 0;
            // SAFETY: `p` is a valid out-pointer; the size was bounded by the budget.
            let r = unsafe { (drv.mem_alloc)(&mut p, size as usize) };
            drv.check(r, "cuMemAlloc")?;
            c.allocations.insert(p, size);
            c.used += size;
            Ok(p)
        })
    }

    fn mem_free(&mut self, ctx: ContextId, addr: u64) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, _| {
            let size = c.allocations.remove(&addr).ok_or_else(|| {
                ComputeError::InvalidValue(format!("{addr:#x} is not an allocation"))
            })?;
            c.used -= size;
            // SAFETY: `addr` is the base of a live allocation of the current context.
            drv.check(unsafe { (drv.mem_free)(addr) }, "cuMemFree")
        })
    }

    fn mem_get_info(&mut self, ctx: ContextId) -> ComputeResult<MemInfo> {
        let total = self.attributes.total_memory;
        self.with_ctx(ctx, |_, c, _| {
            Ok(MemInfo {
                free: total.saturating_sub(c.used),
                total,
            })
        })
    }

    fn memset_d8(
        &mut self,
        ctx: ContextId,
        dst: u64,
        value: u8,
        count: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, _| {
            let s = c.stream(stream)?;
            if count == 0 {
                return Ok(());
            }
            c.range(dst, count)?;
            // SAFETY: the range lies inside one live allocation; `s` is a stream of the context.
            let r = unsafe { (drv.memset_d8)(dst, value, count as usize, s) };
            drv.check(r, "cuMemsetD8Async")
        })
    }

    fn memset_d32(
        &mut self,
        ctx: ContextId,
        dst: u64,
        value: u32,
        count: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, _| {
            let s = c.stream(stream)?;
            if dst % 4 != 0 {
                return Err(ComputeError::InvalidValue(format!(
                    "memset of words at {dst:#x}"
                )));
            }
            if count == 0 {
                return Ok(());
            }
            let bytes = count
                .checked_mul(4)
                .ok_or_else(|| ComputeError::InvalidValue(format!("{count} words")))?;
            c.range(dst, bytes)?;
            // SAFETY: the range lies inside one live allocation; `s` is a stream of the context.
            let r = unsafe { (drv.memset_d32)(dst, value, count as usize, s) };
            drv.check(r, "cuMemsetD32Async")
        })
    }

    fn copy_htod(
        &mut self,
        ctx: ContextId,
        dst: u64,
        src: &[u8],
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, t| {
            let s = c.stream(stream)?;
            if src.is_empty() {
                return Ok(());
            }
            c.range(dst, src.len() as u64)?;
            // The stream's earlier work first, bounded; the copy then cannot wait on a hang.
            wait_stream(drv, t, s)?;
            // SAFETY: the destination lies inside one live allocation; `src` is valid for its
            // length and, being pageable memory, is consumed before the call returns; the
            // stream wait below finishes the copy before `src` is given back.
            let r = unsafe { (drv.memcpy_htod)(dst, src.as_ptr().cast(), src.len(), s) };
            drv.check(r, "cuMemcpyHtoDAsync")?;
            wait_stream(drv, t, s)
        })
    }

    fn copy_dtoh(
        &mut self,
        ctx: ContextId,
        dst: &mut [u8],
        src: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, t| {
            let s = c.stream(stream)?;
            if dst.is_empty() {
                return Ok(());
            }
            c.range(src, dst.len() as u64)?;
            wait_stream(drv, t, s)?;
            // SAFETY: the source lies inside one live allocation; `dst` is valid for writes of
            // its length, and a copy into pageable memory has completed when the call returns
            // (the stream wait below makes sure of it before `dst` is given back).
            let r = unsafe { (drv.memcpy_dtoh)(dst.as_mut_ptr().cast(), src, dst.len(), s) };
            drv.check(r, "cuMemcpyDtoHAsync")?;
            wait_stream(drv, t, s)
        })
    }

    fn copy_dtod(
        &mut self,
        ctx: ContextId,
        dst: u64,
        src: u64,
        bytes: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, _| {
            let s = c.stream(stream)?;
            if bytes == 0 {
                return Ok(());
            }
            c.range(src, bytes)?;
            c.range(dst, bytes)?;
            // SAFETY: both ranges lie inside live allocations of the current context.
            let r = unsafe { (drv.memcpy_dtod)(dst, src, bytes as usize, s) };
            drv.check(r, "cuMemcpyDtoDAsync")
        })
    }

    fn stream_create(&mut self, ctx: ContextId) -> ComputeResult<StreamId> {
        let id = StreamId(self.fresh_id()?);
        self.with_ctx(ctx, |drv, c, _| {
            if c.streams.len() >= MAX_STREAMS {
                return Err(ComputeError::OutOfMemory(format!("{MAX_STREAMS} streams")));
            }
            let mut s: Handle = std::ptr::null_mut();
            // SAFETY: `s` is a valid out-pointer; flags 0 (ordered with the default stream).
            drv.check(unsafe { (drv.stream_create)(&mut s, 0) }, "cuStreamCreate")?;
            c.streams.insert(id, s);
            Ok(id)
        })
    }

    fn stream_destroy(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, _| {
            let s = c
                .streams
                .remove(&stream)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("stream {}", stream.0)))?;
            // SAFETY: `s` is a live stream of the current context, now unreachable; queued
            // work still completes.
            drv.check(unsafe { (drv.stream_destroy)(s) }, "cuStreamDestroy")
        })
    }

    fn stream_synchronize(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, t| wait_stream(drv, t, c.stream(stream)?))
    }

    fn stream_query(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, _| {
            let s = c.stream(stream)?;
            // SAFETY: `s` is null or a live stream of the current context.
            drv.check(unsafe { (drv.stream_query)(s) }, "cuStreamQuery")
        })
    }

    fn event_create(&mut self, ctx: ContextId) -> ComputeResult<EventId> {
        let id = EventId(self.fresh_id()?);
        self.with_ctx(ctx, |drv, c, _| {
            if c.events.len() >= MAX_EVENTS {
                return Err(ComputeError::OutOfMemory(format!("{MAX_EVENTS} events")));
            }
            let mut e: Handle = std::ptr::null_mut();
            // SAFETY: `e` is a valid out-pointer; flags 0 (timing enabled).
            drv.check(unsafe { (drv.event_create)(&mut e, 0) }, "cuEventCreate")?;
            c.events.insert(id, e);
            Ok(id)
        })
    }

    fn event_destroy(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, _| {
            let e = c
                .events
                .remove(&event)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("event {}", event.0)))?;
            // SAFETY: `e` is a live event of the current context, now unreachable.
            drv.check(unsafe { (drv.event_destroy)(e) }, "cuEventDestroy")
        })
    }

    fn event_record(
        &mut self,
        ctx: ContextId,
        event: EventId,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, _| {
            let (e, s) = (c.event(event)?, c.stream(stream)?);
            // SAFETY: `e` and `s` are live handles of the current context (`s` may be null).
            drv.check(unsafe { (drv.event_record)(e, s) }, "cuEventRecord")
        })
    }

    fn event_synchronize(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, t| {
            let e = c.event(event)?;
            // SAFETY: `e` is a live event of the current context.
            wait(drv, t, "event", || unsafe { (drv.event_query)(e) })
        })
    }

    fn event_query(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.with_ctx(ctx, |drv, c, _| {
            let e = c.event(event)?;
            // SAFETY: `e` is a live event of the current context.
            drv.check(unsafe { (drv.event_query)(e) }, "cuEventQuery")
        })
    }

    fn event_elapsed_ms(
        &mut self,
        ctx: ContextId,
        start: EventId,
        end: EventId,
    ) -> ComputeResult<f32> {
        self.with_ctx(ctx, |drv, c, _| {
            let (s, e) = (c.event(start)?, c.event(end)?);
            let mut ms = 0f32;
            // SAFETY: `ms` is a valid out-pointer; both events are live in the current context.
            let r = unsafe { (drv.event_elapsed)(&mut ms, s, e) };
            drv.check(r, "cuEventElapsedTime")?;
            Ok(ms)
        })
    }

    fn launch(&mut self, ctx: ContextId, args: &LaunchArgs<'_>) -> ComputeResult<()> {
        let attrs = self.attributes.clone();
        self.with_ctx(ctx, |drv, c, _| {
            let s = c.stream(args.stream)?;
            let f = c.functions.get(&args.function).ok_or_else(|| {
                ComputeError::InvalidHandle(format!("function {}", args.function.0))
            })?;
            if args.params.len() != f.param_bytes as usize {
                return Err(ComputeError::InvalidValue(format!(
                    "parameter buffer of {} bytes for a kernel taking {}",
                    args.params.len(),
                    f.param_bytes
                )));
            }
            let dims_ok =
                |d: [u32; 3], max: [u32; 3]| d.iter().zip(max).all(|(&v, m)| v >= 1 && v <= m);
            if !dims_ok(args.grid, attrs.max_grid_dim) || !dims_ok(args.block, attrs.max_block_dim)
            {
                return Err(ComputeError::InvalidValue(format!(
                    "grid {:?} block {:?}",
                    args.grid, args.block
                )));
            }
            // The driver reads the buffer during the call; it is copied into a local so its
            // pointer is aligned for any parameter.
            let mut buf = vec![0u64; args.params.len().div_ceil(8)];
            // SAFETY: `buf` holds at least `params.len()` bytes; u64 has no invalid bytes.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<u8>(), args.params.len())
            };
            bytes.copy_from_slice(args.params);
            let mut size = args.params.len();
            let mut extra: [*mut c_void; 5] = [
                LAUNCH_PARAM_BUFFER_POINTER as *mut c_void,
                buf.as_mut_ptr().cast(),
                LAUNCH_PARAM_BUFFER_SIZE as *mut c_void,
                (&mut size as *mut usize).cast(),
                LAUNCH_PARAM_END as *mut c_void,
            ];
            let [gx, gy, gz] = args.grid;
            let [bx, by, bz] = args.block;
            // SAFETY: `f.handle` is a live function of the current context, `s` a stream of
            // it; `extra` is the END-terminated key/value list the driver reads during the
            // call, pointing at `buf` (exactly the function's parameter bytes) and `size`.
            let r = unsafe {
                (drv.launch_kernel)(
                    f.handle,
                    gx,
                    gy,
                    gz,
                    bx,
                    by,
                    bz,
                    args.shared_bytes,
                    s,
                    std::ptr::null_mut(),
                    extra.as_mut_ptr(),
                )
            };
            drv.check(r, "cuLaunchKernel")
        })
    }
}

impl Drop for NvCuda {
    fn drop(&mut self) {
        for (id, c) in std::mem::take(&mut self.contexts) {
            // SAFETY: each context is live and dropped from the table here, once.
            let r = unsafe { (self.drv.ctx_destroy)(c.cu) };
            if let Err(e) = self.drv.check(r, "cuCtxDestroy") {
                log::warn!("compute context {}: {e}", id.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::conformance;

    #[test]
    fn a_missing_driver_is_no_device() {
        let r = NvCuda::new(NvCudaConfig {
            library: "libcuda-not-here.so.1".into(),
            ..NvCudaConfig::default()
        });
        match r {
            Err(ComputeError::NoDevice(msg)) => assert!(msg.contains("libcuda-not-here"), "{msg}"),
            other => panic!("expected NoDevice, got {other:?}"),
        }
    }

    /// The trait-level sequence on the real driver, when it loads (skipped with the reason
    /// otherwise). `VGPU_COMPUTE_ALLOW_HMM=1` lets it run on a device with pageable memory
    /// access.
    #[test]
    fn the_conformance_sequence_on_the_real_driver() {
        let config = NvCudaConfig {
            allow_pageable_memory_access: std::env::var_os("VGPU_COMPUTE_ALLOW_HMM").is_some(),
            ..NvCudaConfig::default()
        };
        match NvCuda::new(config) {
            Ok(mut b) => {
                println!("running on {:?}", b.attributes());
                conformance::run(&mut b, false);
            }
            Err(e) => println!("skipped: NvCuda unavailable: {e}"),
        }
    }
}
