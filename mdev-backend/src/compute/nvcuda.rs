//! `NvCuda`: the compute backend on NVIDIA's driver, `libcuda.so.1` loaded at run time (no
//! build-time dependency; absent library or device = `ComputeError::NoDevice`, and the device
//! then offers no compute). One `CUcontext` per guest context, made current before each call,
//! so the backend may live on any one thread (the executor thread of its VM). The unsafe code
//! of the compute backends lives in this file.
//!
//! Guest-supplied device addresses are checked against the context's own allocation table
//! before any copy or memset reaches the driver (with unified addressing the driver would
//! accept another context's pointer); kernels are confined by the GPU's per-context address
//! spaces. Module images go to the driver as PTX text extracted by `fatbin`, the same text
//! the CPU executor runs, so the two backends execute the same code.
//!
//! A sticky error (an illegal address, a kernel past its time) breaks CUDA for the whole
//! process, every context of it, as NVIDIA documents and as the H100 check showed: the
//! backend then refuses every context with `ContextBroken`, and the isolation unit on the
//! real driver is the process ([`ComputeBackend::faults_are_process_wide`]).
//!
//! Every wait is bounded: synchronisations poll `cuStreamQuery`/`cuEventQuery` for at most
//! [`SYNC_TIMEOUT`] instead of blocking in the driver, and answer `LaunchTimeout` (the context
//! is then broken), so a hung kernel never holds the VM's executor thread longer.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, c_char, c_int, c_uint, c_void};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use libloading::Library;
use log::{info, warn};

use super::backend::*;
use super::fatbin::{ptx_entries, ptx_of_all};
use super::memory::check_heap_size;
use super::ptx::Stop;
use super::{ComputeError, ComputeResult};
use crate::budget::{Charge, MemoryBudget};

type CuResult = c_int;
type Handle = *mut c_void;

/// `CU_LAUNCH_PARAM_BUFFER_POINTER`, `CU_LAUNCH_PARAM_BUFFER_SIZE`, `CU_LAUNCH_PARAM_END`:
/// kernel parameters passed as one packed buffer (the layout the guest already uses).
const LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const LAUNCH_PARAM_BUFFER_SIZE: usize = 2;
const LAUNCH_PARAM_END: usize = 0;
/// `CUresult` values the backend maps specially.
const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_NOT_READY: c_int = 600;
/// Device attributes (`CUdevice_attribute`).
/// `CU_JIT_INPUT_PTX`.
const JIT_INPUT_PTX: c_int = 1;
const ATTR_MAX_THREADS_PER_BLOCK: c_int = 1;
const ATTR_MAX_BLOCK_DIM_X: c_int = 2;
const ATTR_MAX_GRID_DIM_X: c_int = 5;
const ATTR_MAX_SHARED_MEMORY_PER_BLOCK: c_int = 8;
const ATTR_WARP_SIZE: c_int = 10;
const ATTR_CLOCK_RATE: c_int = 13;
const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
const ATTR_PAGEABLE_MEMORY_ACCESS: c_int = 88;
const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;
/// `CU_LIMIT_MALLOC_HEAP_SIZE`.
const LIMIT_MALLOC_HEAP_SIZE: c_int = 2;

/// The driver entry points used, resolved once, and the interrupt every wait in the driver
/// looks at.
struct Api {
    _lib: Library,
    /// The backend's [`Interrupt`]: the driver cannot stop a running kernel, but a wait for
    /// one ([`wait`]) ends as soon as its request is cancelled.
    interrupt: Arc<Interrupt>,
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, c_int) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult,
    ctx_create: unsafe extern "C" fn(*mut Handle, c_uint, c_int) -> CuResult,
    ctx_destroy: unsafe extern "C" fn(Handle) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(Handle) -> CuResult,
    ctx_set_limit: unsafe extern "C" fn(c_int, usize) -> CuResult,
    module_load_data: unsafe extern "C" fn(*mut Handle, *const c_void) -> CuResult,
    module_unload: unsafe extern "C" fn(Handle) -> CuResult,
    link_create:
        unsafe extern "C" fn(c_uint, *mut c_int, *mut *mut c_void, *mut Handle) -> CuResult,
    #[allow(clippy::type_complexity)]
    link_add_data: unsafe extern "C" fn(
        Handle,
        c_int,
        *mut c_void,
        usize,
        *const c_char,
        c_uint,
        *mut c_int,
        *mut *mut c_void,
    ) -> CuResult,
    link_complete: unsafe extern "C" fn(Handle, *mut *mut c_void, *mut usize) -> CuResult,
    link_destroy: unsafe extern "C" fn(Handle) -> CuResult,
    module_get_function: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> CuResult,
    module_get_global:
        unsafe extern "C" fn(*mut u64, *mut usize, Handle, *const c_char) -> CuResult,
    func_get_param_info: unsafe extern "C" fn(Handle, usize, *mut usize, *mut usize) -> CuResult,
    func_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, Handle) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(u64) -> CuResult,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    memset_d8_async: unsafe extern "C" fn(u64, u8, usize, Handle) -> CuResult,
    memset_d32_async: unsafe extern "C" fn(u64, c_uint, usize, Handle) -> CuResult,
    memcpy_htod_async: unsafe extern "C" fn(u64, *const c_void, usize, Handle) -> CuResult,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, u64, usize, Handle) -> CuResult,
    memcpy_dtod_async: unsafe extern "C" fn(u64, u64, usize, Handle) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(Handle) -> CuResult,
    stream_query: unsafe extern "C" fn(Handle) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(Handle) -> CuResult,
    event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult,
    event_destroy: unsafe extern "C" fn(Handle) -> CuResult,
    event_record: unsafe extern "C" fn(Handle, Handle) -> CuResult,
    event_query: unsafe extern "C" fn(Handle) -> CuResult,
    event_elapsed_time: unsafe extern "C" fn(*mut f32, Handle, Handle) -> CuResult,
    #[allow(clippy::type_complexity)]
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
    #[allow(clippy::type_complexity)]
    launch_cooperative_kernel: unsafe extern "C" fn(
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
    ) -> CuResult,
}

impl Api {
    fn load() -> ComputeResult<Api> {
        // SAFETY: loading the NVIDIA driver library runs its initialisers, which is what every
        // CUDA program does; the library stays loaded as long as the returned `Api`.
        let lib = unsafe { Library::new("libcuda.so.1") }
            .map_err(|e| ComputeError::NoDevice(format!("libcuda.so.1: {e}")))?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol is the driver API function of that name, and the field it
                // is stored in has the function's C signature from cuda.h; the pointer does
                // not outlive `_lib`, which the `Api` keeps.
                let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| ComputeError::NoDevice(format!("{}: {e}", $name)))?;
                *s
            }};
        }
        Ok(Api {
            init: sym!("cuInit"),
            device_get: sym!("cuDeviceGet"),
            device_get_name: sym!("cuDeviceGetName"),
            device_total_mem: sym!("cuDeviceTotalMem_v2"),
            device_get_attribute: sym!("cuDeviceGetAttribute"),
            ctx_create: sym!("cuCtxCreate_v2"),
            ctx_destroy: sym!("cuCtxDestroy_v2"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            ctx_set_limit: sym!("cuCtxSetLimit"),
            module_load_data: sym!("cuModuleLoadData"),
            module_unload: sym!("cuModuleUnload"),
            link_create: sym!("cuLinkCreate_v2"),
            link_add_data: sym!("cuLinkAddData_v2"),
            link_complete: sym!("cuLinkComplete"),
            link_destroy: sym!("cuLinkDestroy"),
            module_get_function: sym!("cuModuleGetFunction"),
            module_get_global: sym!("cuModuleGetGlobal_v2"),
            func_get_param_info: sym!("cuFuncGetParamInfo"),
            func_get_attribute: sym!("cuFuncGetAttribute"),
            mem_alloc: sym!("cuMemAlloc_v2"),
            mem_free: sym!("cuMemFree_v2"),
            mem_get_info: sym!("cuMemGetInfo_v2"),
            memset_d8_async: sym!("cuMemsetD8Async"),
            memset_d32_async: sym!("cuMemsetD32Async"),
            memcpy_htod_async: sym!("cuMemcpyHtoDAsync_v2"),
            memcpy_dtoh_async: sym!("cuMemcpyDtoHAsync_v2"),
            memcpy_dtod_async: sym!("cuMemcpyDtoDAsync_v2"),
            stream_create: sym!("cuStreamCreate"),
            stream_destroy: sym!("cuStreamDestroy_v2"),
            stream_query: sym!("cuStreamQuery"),
            stream_synchronize: sym!("cuStreamSynchronize"),
            event_create: sym!("cuEventCreate"),
            event_destroy: sym!("cuEventDestroy_v2"),
            event_record: sym!("cuEventRecord"),
            event_query: sym!("cuEventQuery"),
            event_elapsed_time: sym!("cuEventElapsedTime"),
            launch_kernel: sym!("cuLaunchKernel"),
            launch_cooperative_kernel: sym!("cuLaunchCooperativeKernel"),
            _lib: lib,
            interrupt: Interrupt::new(SYNC_TIMEOUT),
        })
    }
}

/// A driver status as the backend's error (the guest sees the same `CUresult`).
/// Longest synchronisation (stream, event, context, copy) before the context is declared hung:
/// [`ComputeError::LaunchTimeout`], and the context is broken. Waits poll the driver's query
/// calls instead of blocking in it, so a hung kernel never holds the executor thread longer.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(5);

/// Polls `query` until it stops answering NOT_READY, at most [`SYNC_TIMEOUT`], or until the
/// request is cancelled ([`Interrupt::stop`]): then `Busy`, not sticky, for the kernel was not
/// faulted and runs on on the GPU (the driver cannot stop it; destroying its context does).
fn wait(api: &Api, what: &str, query: impl Fn() -> CuResult) -> ComputeResult<()> {
    let start = Instant::now();
    loop {
        match query() {
            CUDA_ERROR_NOT_READY => {}
            r => return check(what, r),
        }
        if api
            .interrupt
            .flag()
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Err(ComputeError::Busy(format!(
                "{what}: wait cancelled; the kernel is left to its context's destruction"
            )));
        }
        let waited = start.elapsed();
        if waited >= SYNC_TIMEOUT {
            return Err(ComputeError::LaunchTimeout(format!(
                "{what}: not complete after {SYNC_TIMEOUT:?}"
            )));
        }
        if waited < Duration::from_micros(200) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Waits, bounded, for a stream's work (`s` null: the context's default stream).
fn wait_stream(api: &Api, s: Handle) -> ComputeResult<()> {
    // SAFETY: `s` is null or a live stream of the context current on this thread.
    wait(api, "cuStreamQuery", || unsafe { (api.stream_query)(s) })?;
    // The stream is idle, so the driver's own synchronisation returns at once; it is made
    // for its side effects: device printf is flushed there, not at queries.
    // SAFETY: as above.
    check("cuStreamSynchronize", unsafe {
        (api.stream_synchronize)(s)
    })
}

/// PTX texts NUL-terminated for the driver, the copies charged to `budget` while held.
fn driver_texts(
    texts: &[&str],
    budget: &Arc<MemoryBudget>,
) -> ComputeResult<(Vec<CString>, Charge)> {
    let bytes = texts
        .iter()
        .try_fold(0u64, |total, t| total.checked_add(t.len() as u64 + 1))
        .unwrap_or(u64::MAX);
    let held = budget
        .charge(bytes)
        .map_err(|e| Stop::OverBudget(e).error())?;
    let texts = texts
        .iter()
        .map(|&t| CString::new(t).map_err(|_| ComputeError::InvalidPtx("NUL inside PTX".into())))
        .collect::<ComputeResult<_>>()?;
    Ok((texts, held))
}

fn check(what: &str, r: CuResult) -> ComputeResult<()> {
    match r {
        CUDA_SUCCESS => Ok(()),
        CUDA_ERROR_NOT_READY => Err(ComputeError::NotReady),
        1 => Err(ComputeError::InvalidValue(what.into())),
        2 => Err(ComputeError::OutOfMemory(what.into())),
        200 => Err(ComputeError::InvalidImage(what.into())),
        218 => Err(ComputeError::InvalidPtx(what.into())),
        400 => Err(ComputeError::InvalidHandle(what.into())),
        500 => Err(ComputeError::NotFound(what.into())),
        700 => Err(ComputeError::IllegalAddress(what.into())),
        701 => Err(ComputeError::LaunchOutOfResources(what.into())),
        702 => Err(ComputeError::LaunchTimeout(what.into())),
        715 => Err(ComputeError::IllegalInstruction(what.into())),
        716 => Err(ComputeError::MisalignedAddress(what.into())),
        720 => Err(ComputeError::CooperativeLaunchTooLarge(what.into())),
        code => Err(ComputeError::Driver {
            code: code as u32,
            what: what.into(),
        }),
    }
}

/// Driver handles are kept as integers so the backend is `Send`; they are only used on the
/// thread that currently owns the backend, with the context made current first.
#[derive(Debug, Default)]
struct Context {
    handle: usize,
    modules: HashMap<u32, usize>,
    /// Function handle, the length of its parameter buffer and each parameter's offset in it.
    functions: HashMap<u32, (usize, usize, Vec<u32>)>,
    streams: HashMap<u32, usize>,
    events: HashMap<u32, usize>,
    /// Device address → size of every allocation of this context, and its charge to the
    /// budget (given back when it is freed or the context destroyed).
    allocations: BTreeMap<u64, (u64, Charge)>,
    /// Device address → (size, module) of every module global the guest looked up: memory
    /// of this context that copies may name too (as libgomp does to set its variables).
    globals: BTreeMap<u64, (u64, u32)>,
    /// Bytes of those allocations, at most the device's `total_memory` (the per-context limit).
    used: u64,
    broken: Option<ComputeError>,
    next_id: u32,
}

impl Context {
    fn id(&mut self) -> u32 {
        next_id(&mut self.next_id)
    }

    fn stream(&self, s: StreamId) -> ComputeResult<Handle> {
        if s == DEFAULT_STREAM {
            return Ok(std::ptr::null_mut());
        }
        self.streams
            .get(&s.0)
            .map(|&h| h as Handle)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("stream {}", s.0)))
    }

    fn event(&self, e: EventId) -> ComputeResult<Handle> {
        self.events
            .get(&e.0)
            .map(|&h| h as Handle)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("event {}", e.0)))
    }

    /// `[addr, addr + bytes)` lies inside one allocation, or one looked-up module global, of
    /// this context.
    fn owns(&self, addr: u64, bytes: u64) -> ComputeResult<()> {
        let within = |base: u64, len: u64| {
            addr.checked_add(bytes)
                .is_some_and(|end| end <= base.saturating_add(len))
        };
        let allocated = self
            .allocations
            .range(..=addr)
            .next_back()
            .is_some_and(|(&base, &(len, _))| within(base, len));
        let global = self
            .globals
            .range(..=addr)
            .next_back()
            .is_some_and(|(&base, &(len, _))| within(base, len));
        if allocated || global {
            Ok(())
        } else {
            Err(ComputeError::InvalidValue(format!(
                "{addr:#x}+{bytes} is not memory of this context"
            )))
        }
    }
}

/// Most device `printf` bytes held between two collections (the driver's default device
/// printf buffer is 1 MiB too).
const PRINTF_PIPE_BYTES: usize = 1 << 20;

/// The compute backend on the NVIDIA driver.
pub struct NvCuda {
    api: Api,
    device: c_int,
    attributes: DeviceAttributes,
    contexts: ContextTable<Context>,
    /// The first sticky error: CUDA in this process is unusable from then on.
    poisoned: Option<ComputeError>,
    /// When device printf is captured: the read end of the pipe standard output goes to,
    /// and the standard output it replaced (put back when the backend is dropped).
    printf: Option<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)>,
    /// What every allocation is charged to: the VM's budget ([`NvCuda::charged_to`]), or one
    /// of the device's memory.
    budget: Arc<MemoryBudget>,
}

impl std::fmt::Debug for NvCuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvCuda")
            .field("device", &self.attributes.name)
            .finish()
    }
}

// SAFETY: NvCuda holds driver handles as integers and calls the driver only through `&mut self`
// after making the context current on the calling thread, which the driver allows from any
// thread; no handle is shared between threads at the same time.
unsafe impl Send for NvCuda {}

impl NvCuda {
    /// Loads the driver and opens device `ordinal`; each context may allocate up to the
    /// device's memory.
    pub fn new(ordinal: i32) -> ComputeResult<NvCuda> {
        NvCuda::with_memory_per_context(ordinal, u64::MAX)
    }

    /// As [`NvCuda::new`], each context allocating at most `memory_per_context` bytes (and the
    /// device's memory), so one guest cannot take the whole GPU's memory from the others.
    pub fn with_memory_per_context(ordinal: i32, memory_per_context: u64) -> ComputeResult<NvCuda> {
        let api = Api::load()?;
        // SAFETY: cuInit takes flags 0 and may be called more than once.
        check("cuInit", unsafe { (api.init)(0) })
            .map_err(|e| ComputeError::NoDevice(e.to_string()))?;
        let mut device = 0;
        // SAFETY: `device` is a valid out-pointer for the call.
        check("cuDeviceGet", unsafe {
            (api.device_get)(&mut device, ordinal)
        })
        .map_err(|e| ComputeError::NoDevice(e.to_string()))?;
        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer is 256 bytes and its length is passed.
        check("cuDeviceGetName", unsafe {
            (api.device_get_name)(name.as_mut_ptr(), 256, device)
        })?;
        let name: String = name
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| char::from(c as u8))
            .collect();
        let mut total = 0usize;
        // SAFETY: `total` is a valid out-pointer.
        check("cuDeviceTotalMem", unsafe {
            (api.device_total_mem)(&mut total, device)
        })?;
        let attr = |a: c_int| -> ComputeResult<u32> {
            let mut v = 0;
            // SAFETY: `v` is a valid out-pointer; `a` is a documented attribute.
            check("cuDeviceGetAttribute", unsafe {
                (api.device_get_attribute)(&mut v, a, device)
            })?;
            Ok(v.max(0) as u32)
        };
        if attr(ATTR_PAGEABLE_MEMORY_ACCESS)? != 0 {
            warn!(
                "CUDA device {name:?} can access pageable host memory (HMM/ATS): a guest kernel \
                 holding a host address of this process could reach it (see docs/COMPUTE.md)"
            );
        }
        let attributes = DeviceAttributes {
            name,
            // The driver chooses its own addresses.
            placement: false,
            total_memory: (total as u64).min(memory_per_context),
            compute_capability: (
                attr(ATTR_COMPUTE_CAPABILITY_MAJOR)?,
                attr(ATTR_COMPUTE_CAPABILITY_MINOR)?,
            ),
            multiprocessors: attr(ATTR_MULTIPROCESSOR_COUNT)?,
            max_threads_per_block: attr(ATTR_MAX_THREADS_PER_BLOCK)?,
            max_block: [
                attr(ATTR_MAX_BLOCK_DIM_X)?,
                attr(ATTR_MAX_BLOCK_DIM_X + 1)?,
                attr(ATTR_MAX_BLOCK_DIM_X + 2)?,
            ],
            max_grid: [
                attr(ATTR_MAX_GRID_DIM_X)?,
                attr(ATTR_MAX_GRID_DIM_X + 1)?,
                attr(ATTR_MAX_GRID_DIM_X + 2)?,
            ],
            shared_memory_per_block: attr(ATTR_MAX_SHARED_MEMORY_PER_BLOCK)?,
            warp_size: attr(ATTR_WARP_SIZE)?,
            clock_khz: attr(ATTR_CLOCK_RATE)?,
        };
        info!(
            "CUDA device {ordinal}: {}, {} MiB",
            attributes.name,
            total >> 20
        );
        Ok(NvCuda {
            api,
            device,
            budget: MemoryBudget::new(attributes.total_memory),
            attributes,
            contexts: ContextTable::new(),
            poisoned: None,
            printf: None,
        })
    }

    /// Charges every allocation to `budget` (the VM's, shared with all else it holds) from now
    /// on; a context may then allocate at most the budget's limit too.
    pub fn charged_to(mut self, budget: &Arc<MemoryBudget>) -> NvCuda {
        self.budget = Arc::clone(budget);
        self.attributes.total_memory = self.attributes.total_memory.min(budget.limit());
        self
    }

    /// Captures device `printf`, which the driver writes to the process's standard output at
    /// synchronisation points, for [`ComputeBackend::take_output`]: standard output becomes a
    /// non-blocking pipe of [`PRINTF_PIPE_BYTES`] (the driver's writes past that are lost, as
    /// past a full device printf buffer; they never block the executor), until the backend is
    /// dropped. For a process that serves one guest only: the output of every context goes to
    /// whichever asks first.
    pub fn capture_printf(&mut self) -> ComputeResult<()> {
        use rustix::pipe::{PipeFlags, fcntl_setpipe_size, pipe_with};
        let io = |e: rustix::io::Errno| ComputeError::InvalidValue(format!("printf pipe: {e}"));
        let (read, write) = pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC).map_err(io)?;
        // Smaller where the system's limit is lower; the pipe works either way.
        let _ = fcntl_setpipe_size(&write, PRINTF_PIPE_BYTES);
        let saved = std::os::fd::AsFd::as_fd(&std::io::stdout())
            .try_clone_to_owned()
            .map_err(|e| ComputeError::InvalidValue(format!("standard output: {e}")))?;
        rustix::stdio::dup2_stdout(&write).map_err(io)?;
        self.printf = Some((read, saved));
        Ok(())
    }

    /// Refuses every call once a sticky error broke CUDA for the process.
    fn usable(&self) -> ComputeResult<()> {
        match &self.poisoned {
            Some(e) => Err(ComputeError::ContextBroken(format!(
                "CUDA is broken for this process since: {e}"
            ))),
            None => Ok(()),
        }
    }

    /// The context, made current on this thread, unless unknown or broken.
    fn ctx(&mut self, ctx: ContextId) -> ComputeResult<&mut Context> {
        self.usable()?;
        let c = self.contexts.get_mut(ctx)?;
        if let Some(e) = &c.broken {
            return Err(ComputeError::ContextBroken(e.to_string()));
        }
        // SAFETY: the handle is a live context created by this backend.
        check("cuCtxSetCurrent", unsafe {
            (self.api.ctx_set_current)(c.handle as Handle)
        })?;
        Ok(c)
    }

    /// Runs `call` on a context and marks the context, and CUDA for the process, broken when
    /// the driver reports a sticky error.
    fn on<T>(
        &mut self,
        ctx: ContextId,
        call: impl FnOnce(&Api, &mut Context) -> ComputeResult<T>,
    ) -> ComputeResult<T> {
        self.ctx(ctx)?;
        let c = self.contexts.get_mut(ctx)?;
        let r = call(&self.api, c);
        if let Err(e) = &r {
            if e.is_sticky() {
                warn!(
                    "CUDA context {}: {e}; the context and every other one of this process are broken",
                    ctx.0
                );
                c.broken = Some(e.clone());
                self.poisoned.get_or_insert_with(|| e.clone());
            }
        }
        r
    }
}

impl ComputeBackend for NvCuda {
    fn attributes(&self) -> DeviceAttributes {
        self.attributes.clone()
    }

    fn context_create(&mut self) -> ComputeResult<ContextId> {
        self.usable()?;
        self.contexts.check_room()?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `handle` is a valid out-pointer; flags 0 (automatic scheduling).
        check("cuCtxCreate", unsafe {
            (self.api.ctx_create)(&mut handle, 0, self.device)
        })?;
        Ok(self.contexts.insert(Context {
            handle: handle as usize,
            ..Context::default()
        }))
    }

    fn context_destroy(&mut self, ctx: ContextId) -> ComputeResult<()> {
        let c = self.contexts.remove(ctx)?;
        // SAFETY: the context was created by this backend and is destroyed once; destroying it
        // frees its modules, memory, streams and events.
        check("cuCtxDestroy", unsafe {
            (self.api.ctx_destroy)(c.handle as Handle)
        })
    }

    fn context_synchronize(&mut self, ctx: ContextId) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            // The default stream, then every stream of the context, each wait bounded.
            wait_stream(api, std::ptr::null_mut())?;
            c.streams
                .values()
                .try_for_each(|&s| wait_stream(api, s as Handle))
        })
    }

    fn set_heap_size(&mut self, ctx: ContextId, bytes: u64) -> ComputeResult<()> {
        check_heap_size(bytes)?;
        // Bounded by the check above, so it fits a usize.
        let bytes = bytes as usize;
        self.on(ctx, |api, _| {
            // SAFETY: the context is current (`on`); the call takes its arguments by value.
            check("cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE)", unsafe {
                (api.ctx_set_limit)(LIMIT_MALLOC_HEAP_SIZE, bytes)
            })
        })
    }

    fn module_load(&mut self, ctx: ContextId, image: &[u8]) -> ComputeResult<ModuleId> {
        // The newest architecture's PTX, the only entry decompressed; the driver's own load
        // is not cancellable, so neither is this.
        let never = AtomicBool::new(false);
        let entries = ptx_entries(image)?;
        let newest = entries.last().expect("ptx_entries returns at least one");
        let ptx = newest.text(&self.budget, &never)?;
        let (texts, _held) = driver_texts(&[&ptx], &self.budget)?;
        drop(ptx);
        let text = &texts[0];
        self.on(ctx, |api, c| {
            room_for_module(c.modules.len())?;
            let mut m: Handle = std::ptr::null_mut();
            // SAFETY: `text` is NUL-terminated PTX that lives across the call; `m` is a valid
            // out-pointer.
            check("cuModuleLoadData", unsafe {
                (api.module_load_data)(&mut m, text.as_ptr().cast())
            })?;
            let id = c.id();
            c.modules.insert(id, m as usize);
            Ok(ModuleId(id))
        })
    }

    fn module_link(&mut self, ctx: ContextId, images: &[&[u8]]) -> ComputeResult<ModuleId> {
        let never = AtomicBool::new(false);
        let ptx = ptx_of_all(images, &self.budget, &never)?;
        let ptx: Vec<&str> = ptx.iter().map(|t| &**t).collect();
        let (texts, _held) = driver_texts(&ptx, &self.budget)?;
        self.on(ctx, |api, c| {
            room_for_module(c.modules.len())?;
            let mut state: Handle = std::ptr::null_mut();
            // SAFETY: no options; `state` is a valid out-pointer.
            check("cuLinkCreate", unsafe {
                (api.link_create)(0, std::ptr::null_mut(), std::ptr::null_mut(), &mut state)
            })?;
            let linked = (|| {
                for (i, text) in texts.iter().enumerate() {
                    let name = CString::new(format!("image{i}")).expect("no NUL");
                    let bytes = text.as_bytes_with_nul();
                    // SAFETY: a live link state; the PTX is NUL-terminated, `bytes.len()` long
                    // and outlives the call (the driver copies it); no options.
                    check("cuLinkAddData", unsafe {
                        (api.link_add_data)(
                            state,
                            JIT_INPUT_PTX,
                            bytes.as_ptr().cast_mut().cast(),
                            bytes.len(),
                            name.as_ptr(),
                            0,
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                        )
                    })?;
                }
                let mut cubin: *mut c_void = std::ptr::null_mut();
                let mut size = 0usize;
                // SAFETY: a live link state; valid out-pointers.
                check("cuLinkComplete", unsafe {
                    (api.link_complete)(state, &mut cubin, &mut size)
                })?;
                let mut m: Handle = std::ptr::null_mut();
                // SAFETY: `cubin` is the image the link state owns until cuLinkDestroy below;
                // `m` is a valid out-pointer.
                check("cuModuleLoadData", unsafe {
                    (api.module_load_data)(&mut m, cubin)
                })?;
                Ok(m)
            })();
            // SAFETY: the state created above, destroyed once, after its image was loaded.
            let _ = unsafe { (api.link_destroy)(state) };
            let m = linked?;
            let id = c.id();
            c.modules.insert(id, m as usize);
            Ok(ModuleId(id))
        })
    }

    fn module_unload(&mut self, ctx: ContextId, module: ModuleId) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            let m = c
                .modules
                .remove(&module.0)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("module {}", module.0)))?;
            c.globals.retain(|_, &mut (_, owner)| owner != module.0);
            // SAFETY: a live module of the current context, unloaded once.
            check("cuModuleUnload", unsafe {
                (api.module_unload)(m as Handle)
            })
        })
    }

    fn module_global(
        &mut self,
        ctx: ContextId,
        module: ModuleId,
        name: &str,
    ) -> ComputeResult<(u64, u64)> {
        let cname =
            CString::new(name).map_err(|_| ComputeError::InvalidValue("NUL in a name".into()))?;
        self.on(ctx, |api, c| {
            let m = *c
                .modules
                .get(&module.0)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("module {}", module.0)))?;
            let (mut addr, mut size) = (0u64, 0usize);
            // SAFETY: a live module of the current context; a NUL-terminated name; valid
            // out-pointers.
            check("cuModuleGetGlobal", unsafe {
                (api.module_get_global)(&mut addr, &mut size, m as Handle, cname.as_ptr())
            })?;
            // Bounded by the globals the module has: the driver finds no others.
            c.globals.insert(addr, (size as u64, module.0));
            Ok((addr, size as u64))
        })
    }

    fn function_attributes(
        &mut self,
        ctx: ContextId,
        f: FunctionId,
    ) -> ComputeResult<FunctionAttributes> {
        self.on(ctx, |api, c| {
            let &(handle, ..) = c
                .functions
                .get(&f.0)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("function {}", f.0)))?;
            let attr = |a: c_int| -> ComputeResult<u32> {
                let mut v = 0;
                // SAFETY: a live function of the current context; `v` a valid out-pointer;
                // `a` one of the documented CUfunction_attribute values 0..=4.
                check("cuFuncGetAttribute", unsafe {
                    (api.func_get_attribute)(&mut v, a, handle as Handle)
                })?;
                Ok(v.max(0) as u32)
            };
            Ok(FunctionAttributes {
                max_threads_per_block: attr(0)?,
                shared_size_bytes: attr(1)?,
                const_size_bytes: attr(2)?,
                local_size_bytes: attr(3)?,
                num_regs: attr(4)?,
            })
        })
    }

    fn function(
        &mut self,
        ctx: ContextId,
        module: ModuleId,
        name: &str,
    ) -> ComputeResult<(FunctionId, Vec<ParamInfo>)> {
        let cname = CString::new(name)
            .map_err(|_| ComputeError::NotFound("NUL in a kernel name".into()))?;
        self.on(ctx, |api, c| {
            let m = *c
                .modules
                .get(&module.0)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("module {}", module.0)))?;
            if c.functions.len() >= MAX_FUNCTIONS_PER_CONTEXT {
                return Err(ComputeError::OutOfMemory(format!(
                    "{MAX_FUNCTIONS_PER_CONTEXT} functions"
                )));
            }
            let mut f: Handle = std::ptr::null_mut();
            // SAFETY: `cname` is NUL-terminated; `m` a live module; `f` a valid out-pointer.
            check("cuModuleGetFunction", unsafe {
                (api.module_get_function)(&mut f, m as Handle, cname.as_ptr())
            })?;
            let mut params = Vec::new();
            for index in 0..4096 {
                let (mut offset, mut size) = (0usize, 0usize);
                // SAFETY: valid out-pointers; an index past the last parameter is an error.
                let r = unsafe { (api.func_get_param_info)(f, index, &mut offset, &mut size) };
                if r != CUDA_SUCCESS {
                    break;
                }
                let align = (size as u32).clamp(1, 8).next_power_of_two();
                params.push(ParamInfo {
                    offset: offset as u32,
                    size: size as u32,
                    align,
                });
            }
            let param_bytes = params
                .iter()
                .map(|p| p.offset as usize + p.size as usize)
                .max()
                .unwrap_or(0);
            let id = c.id();
            let offsets = params.iter().map(|p| p.offset).collect();
            c.functions.insert(id, (f as usize, param_bytes, offsets));
            Ok((FunctionId(id), params))
        })
    }

    fn mem_alloc(&mut self, ctx: ContextId, bytes: u64) -> ComputeResult<u64> {
        let limit = self.attributes.total_memory;
        let budget = Arc::clone(&self.budget);
        self.on(ctx, |api, c| {
            if c.used.saturating_add(bytes) > limit {
                return Err(ComputeError::OutOfMemory(format!(
                    "{bytes} bytes past the context limit of {limit}"
                )));
            }
            if bytes == 0 || c.allocations.len() >= super::memory::MAX_ALLOCATIONS {
                return Err(ComputeError::InvalidValue(format!(
                    "allocation of {bytes} bytes"
                )));
            }
            let size = usize::try_from(bytes)
                .map_err(|_| ComputeError::OutOfMemory(format!("{bytes}")))?;
            let charge = budget
                .charge(bytes)
                .map_err(|e| ComputeError::OutOfMemory(format!("{bytes} bytes: {e}")))?;
            let mut addr = 0u64;
            // SAFETY: `addr` is a valid out-pointer.
            check("cuMemAlloc", unsafe { (api.mem_alloc)(&mut addr, size) })?;
            c.allocations.insert(addr, (bytes, charge));
            c.used += bytes;
            Ok(addr)
        })
    }

    fn mem_info(&mut self, ctx: ContextId) -> ComputeResult<(u64, u64)> {
        let total = self.attributes.total_memory;
        let budget_room = self.budget.limit().saturating_sub(self.budget.used());
        self.on(ctx, |api, c| {
            let (mut free, mut device_total) = (0usize, 0usize);
            // SAFETY: both are valid out-pointers; the context is current.
            check("cuMemGetInfo", unsafe {
                (api.mem_get_info)(&mut free, &mut device_total)
            })?;
            let room = total.saturating_sub(c.used).min(budget_room);
            Ok(((free as u64).min(room), total))
        })
    }

    fn mem_free(&mut self, ctx: ContextId, addr: u64) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            let (bytes, _charge) = c.allocations.remove(&addr).ok_or_else(|| {
                ComputeError::InvalidValue(format!("{addr:#x} is not an allocation"))
            })?;
            c.used -= bytes;
            // SAFETY: `addr` is an allocation of the current context, freed once.
            check("cuMemFree", unsafe { (api.mem_free)(addr) })
        })
    }

    fn memset_d8(
        &mut self,
        ctx: ContextId,
        addr: u64,
        value: u8,
        count: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            c.owns(addr, count)?;
            let s = c.stream(stream)?;
            // SAFETY: the range lies in an allocation of the current context.
            check("cuMemsetD8", unsafe {
                (api.memset_d8_async)(addr, value, count as usize, s)
            })
        })
    }

    fn memset_d32(
        &mut self,
        ctx: ContextId,
        addr: u64,
        value: u32,
        count: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            c.owns(
                addr,
                count
                    .checked_mul(4)
                    .ok_or_else(|| ComputeError::InvalidValue("count".into()))?,
            )?;
            let s = c.stream(stream)?;
            // SAFETY: the range lies in an allocation of the current context.
            check("cuMemsetD32", unsafe {
                (api.memset_d32_async)(addr, value, count as usize, s)
            })
        })
    }

    fn copy_htod(
        &mut self,
        ctx: ContextId,
        dst: u64,
        src: &[u8],
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            c.owns(dst, src.len() as u64)?;
            let s = c.stream(stream)?;
            // SAFETY: `src` is readable for its length until the stream synchronises below;
            // the destination lies in an allocation of the current context.
            check("cuMemcpyHtoD", unsafe {
                (api.memcpy_htod_async)(dst, src.as_ptr().cast(), src.len(), s)
            })?;
            wait_stream(api, s)
        })
    }

    fn copy_dtoh(
        &mut self,
        ctx: ContextId,
        dst: &mut [u8],
        src: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            c.owns(src, dst.len() as u64)?;
            let s = c.stream(stream)?;
            // Earlier work first, bounded: a copy into pageable memory returns only once done,
            // so it must not queue behind a hung kernel.
            wait_stream(api, s)?;
            // SAFETY: `dst` is writable for its length until the stream synchronises below;
            // the source lies in an allocation of the current context.
            check("cuMemcpyDtoH", unsafe {
                (api.memcpy_dtoh_async)(dst.as_mut_ptr().cast(), src, dst.len(), s)
            })?;
            wait_stream(api, s)
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
        self.on(ctx, |api, c| {
            c.owns(src, bytes)?;
            c.owns(dst, bytes)?;
            let s = c.stream(stream)?;
            // SAFETY: both ranges lie in allocations of the current context.
            check("cuMemcpyDtoD", unsafe {
                (api.memcpy_dtod_async)(dst, src, bytes as usize, s)
            })
        })
    }

    fn stream_create(&mut self, ctx: ContextId) -> ComputeResult<StreamId> {
        self.on(ctx, |api, c| {
            if c.streams.len() >= MAX_STREAMS_PER_CONTEXT {
                return Err(ComputeError::OutOfMemory(format!(
                    "{MAX_STREAMS_PER_CONTEXT} streams"
                )));
            }
            let mut s: Handle = std::ptr::null_mut();
            // SAFETY: `s` is a valid out-pointer; flags 0.
            check("cuStreamCreate", unsafe { (api.stream_create)(&mut s, 0) })?;
            let id = c.id();
            c.streams.insert(id, s as usize);
            Ok(StreamId(id))
        })
    }

    fn stream_destroy(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            let s = c
                .streams
                .remove(&stream.0)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("stream {}", stream.0)))?;
            // SAFETY: a live stream of the current context, destroyed once.
            check("cuStreamDestroy", unsafe {
                (api.stream_destroy)(s as Handle)
            })
        })
    }

    fn stream_synchronize(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            let s = c.stream(stream)?;
            wait_stream(api, s)
        })
    }

    fn stream_query(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            let s = c.stream(stream)?;
            // SAFETY: a live stream (or the default one) of the current context.
            check("cuStreamQuery", unsafe { (api.stream_query)(s) })
        })
    }

    fn event_create(&mut self, ctx: ContextId) -> ComputeResult<EventId> {
        self.on(ctx, |api, c| {
            if c.events.len() >= MAX_EVENTS_PER_CONTEXT {
                return Err(ComputeError::OutOfMemory(format!(
                    "{MAX_EVENTS_PER_CONTEXT} events"
                )));
            }
            let mut e: Handle = std::ptr::null_mut();
            // SAFETY: `e` is a valid out-pointer; flags 0 (timing enabled).
            check("cuEventCreate", unsafe { (api.event_create)(&mut e, 0) })?;
            let id = c.id();
            c.events.insert(id, e as usize);
            Ok(EventId(id))
        })
    }

    fn event_destroy(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            let e = c
                .events
                .remove(&event.0)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("event {}", event.0)))?;
            // SAFETY: a live event of the current context, destroyed once.
            check("cuEventDestroy", unsafe {
                (api.event_destroy)(e as Handle)
            })
        })
    }

    fn event_record(
        &mut self,
        ctx: ContextId,
        event: EventId,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            let (e, s) = (c.event(event)?, c.stream(stream)?);
            // SAFETY: a live event and stream of the current context.
            check("cuEventRecord", unsafe { (api.event_record)(e, s) })
        })
    }

    fn event_synchronize(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            let e = c.event(event)?;
            // SAFETY: a live event of the current context.
            wait(api, "cuEventQuery", || unsafe { (api.event_query)(e) })
        })
    }

    fn event_query(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            let e = c.event(event)?;
            // SAFETY: a live event of the current context.
            check("cuEventQuery", unsafe { (api.event_query)(e) })
        })
    }

    fn event_elapsed_ms(
        &mut self,
        ctx: ContextId,
        start: EventId,
        end: EventId,
    ) -> ComputeResult<f32> {
        self.on(ctx, |api, c| {
            let (a, b) = (c.event(start)?, c.event(end)?);
            let mut ms = 0f32;
            // SAFETY: live events of the current context; `ms` a valid out-pointer.
            check("cuEventElapsedTime", unsafe {
                (api.event_elapsed_time)(&mut ms, a, b)
            })?;
            Ok(ms)
        })
    }

    fn launch(&mut self, ctx: ContextId, l: &KernelLaunch<'_>) -> ComputeResult<()> {
        self.on(ctx, |api, c| {
            let (f, param_bytes, offsets) = c
                .functions
                .get(&l.function.0)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("function {}", l.function.0)))?;
            let f = *f;
            // Checked here rather than left to the driver: a short buffer would launch the
            // kernel with whatever follows it as arguments.
            if l.params.len() != *param_bytes {
                return Err(ComputeError::InvalidValue(format!(
                    "parameter buffer of {} bytes for a kernel taking {param_bytes}",
                    l.params.len()
                )));
            }
            let s = c.stream(l.stream)?;
            let [gx, gy, gz] = l.grid;
            let [bx, by, bz] = l.block;
            if l.cooperative {
                // cuLaunchCooperativeKernel takes each parameter's address (no packed
                // buffer): offsets the driver reported, inside the buffer checked above.
                let mut each: Vec<*mut c_void> = offsets
                    .iter()
                    .map(|&o| l.params[o as usize..].as_ptr() as *mut c_void)
                    .collect();
                // SAFETY: `f` and `s` are live handles of the current context; `each` holds
                // one pointer per parameter of `f`, into `l.params`, which outlives the call
                // (the driver copies the parameters at launch).
                return check("cuLaunchCooperativeKernel", unsafe {
                    (api.launch_cooperative_kernel)(
                        f as Handle,
                        gx,
                        gy,
                        gz,
                        bx,
                        by,
                        bz,
                        l.shared_bytes,
                        s,
                        each.as_mut_ptr(),
                    )
                });
            }
            let mut size = l.params.len();
            let mut extra: [*mut c_void; 5] = [
                LAUNCH_PARAM_BUFFER_POINTER as *mut c_void,
                l.params.as_ptr() as *mut c_void,
                LAUNCH_PARAM_BUFFER_SIZE as *mut c_void,
                (&mut size as *mut usize).cast(),
                LAUNCH_PARAM_END as *mut c_void,
            ];
            // SAFETY: `f` and `s` are live handles of the current context; `extra` is the
            // documented packed-parameter list whose buffer and size outlive the call (the
            // driver copies the parameters at launch).
            check("cuLaunchKernel", unsafe {
                (api.launch_kernel)(
                    f as Handle,
                    gx,
                    gy,
                    gz,
                    bx,
                    by,
                    bz,
                    l.shared_bytes,
                    s,
                    std::ptr::null_mut(),
                    extra.as_mut_ptr(),
                )
            })
        })
    }

    fn interrupt(&self) -> Option<Arc<Interrupt>> {
        Some(Arc::clone(&self.api.interrupt))
    }

    fn take_output(&mut self, ctx: ContextId) -> ComputeResult<String> {
        // The driver prints device printf on the process's stdout at synchronisation points:
        // captured per process (`capture_printf`), else not at all.
        self.ctx(ctx)?;
        let mut out = Vec::new();
        if let Some((read, _)) = &self.printf {
            let mut buf = [0u8; 16 << 10];
            while out.len() < PRINTF_PIPE_BYTES {
                match rustix::io::read(read, &mut buf) {
                    Ok(n) if n > 0 => out.extend_from_slice(&buf[..n]),
                    _ => break,
                }
            }
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    fn faults_are_process_wide(&self) -> bool {
        true
    }
}

impl Drop for NvCuda {
    fn drop(&mut self) {
        for c in self.contexts.drain() {
            // SAFETY: every remaining context was created by this backend and is destroyed once.
            let r = unsafe { (self.api.ctx_destroy)(c.handle as Handle) };
            if r != CUDA_SUCCESS {
                warn!("cuCtxDestroy: {r}");
            }
        }
        // Contexts destroyed, the driver prints no more: standard output is put back.
        if let Some((_, saved)) = self.printf.take()
            && let Err(e) = rustix::stdio::dup2_stdout(&saved)
        {
            warn!("restoring standard output: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_it_is_no_device_and_no_panic() {
        match NvCuda::new(0) {
            Err(e) => assert_eq!(e.cuda_status(), 100, "{e}"),
            Ok(be) => eprintln!("a CUDA driver is present: {}", be.attributes().name),
        }
        assert!(matches!(NvCuda::new(9999), Err(ComputeError::NoDevice(_))));
    }
}
