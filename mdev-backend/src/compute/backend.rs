//! The compute backend trait: what a guest's CUDA driver calls become on the host. Ids are
//! chosen by the backend and validated on every call (a guest may send any value); every size
//! is bounded; an error that breaks a context (a kernel's illegal address, a runaway kernel)
//! leaves that context answering `ContextBroken` until it is destroyed, as the real driver's
//! sticky errors do, and never touches another context.

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

pub use super::ptx::ParamInfo;
use super::{ComputeError, ComputeResult};

/// Contexts of one backend (one VM's guest contexts).
pub const MAX_CONTEXTS: usize = 64;
/// Modules loaded in one context.
pub const MAX_MODULES_PER_CONTEXT: usize = 256;
/// Function handles of one context.
pub const MAX_FUNCTIONS_PER_CONTEXT: usize = 4096;
/// Streams of one context.
pub const MAX_STREAMS_PER_CONTEXT: usize = 256;
/// Events of one context.
pub const MAX_EVENTS_PER_CONTEXT: usize = 4096;

macro_rules! id {
    ($name:ident) => {
        /// A handle a backend hands out; any value may come back from a guest.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u32);
    };
}
id!(ContextId);
id!(ModuleId);
id!(FunctionId);
id!(StreamId);
id!(EventId);

/// The default (NULL) stream of a context.
pub const DEFAULT_STREAM: StreamId = StreamId(0);

/// What `cuFuncGetAttribute` reports of a kernel: what occupancy calculators (and GCC's
/// libgomp, choosing its number of teams) read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FunctionAttributes {
    pub max_threads_per_block: u32,
    pub shared_size_bytes: u32,
    pub const_size_bytes: u32,
    pub local_size_bytes: u32,
    pub num_regs: u32,
}

/// Alignment of a placed context's window (a guest library reserves whole pages, and the
/// allocations' guard gaps are this size).
pub const WINDOW_ALIGN: u64 = 64 << 10;
/// Largest window of a placed context.
pub const MAX_WINDOW_BYTES: u64 = 1 << 40;
/// Where a window may lie: above the first 4 GiB (a program's own image and heap) and below
/// the end of x86-64 user space.
pub const WINDOW_RANGE: std::ops::Range<u64> = (1 << 32)..0x7fff_ffff_0000;

/// Checks a requested window: aligned, sized, inside [`WINDOW_RANGE`].
pub fn check_window(base: u64, size: u64) -> ComputeResult<()> {
    let end = base.checked_add(size);
    let ok = base % WINDOW_ALIGN == 0
        && size % WINDOW_ALIGN == 0
        && (WINDOW_ALIGN..=MAX_WINDOW_BYTES).contains(&size)
        && base >= WINDOW_RANGE.start
        && end.is_some_and(|e| e <= WINDOW_RANGE.end);
    if ok {
        Ok(())
    } else {
        Err(ComputeError::InvalidValue(format!(
            "device window {base:#x}+{size:#x}"
        )))
    }
}

/// Registers per thread the PTX executor reports for every kernel (it has no register file;
/// a middle figure for compiled sm_70+ code).
pub const EXECUTOR_REGISTERS_PER_THREAD: u32 = 32;

/// What `cuDeviceGetAttribute` and `cuDeviceGetName` report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttributes {
    pub name: String,
    /// The backend places a context's device memory where the client asks
    /// ([`ComputeBackend::context_create_at`]): a guest library can then reserve that range in
    /// its process and report unified addressing.
    pub placement: bool,
    pub total_memory: u64,
    pub compute_capability: (u32, u32),
    pub multiprocessors: u32,
    pub max_threads_per_block: u32,
    pub max_block: [u32; 3],
    pub max_grid: [u32; 3],
    pub shared_memory_per_block: u32,
    pub warp_size: u32,
    pub clock_khz: u32,
}

/// One kernel launch.
#[derive(Debug, Clone)]
pub struct KernelLaunch<'a> {
    pub function: FunctionId,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub stream: StreamId,
    /// The packed parameter buffer, laid out as the function's `ParamInfo`s say.
    pub params: &'a [u8],
    /// A cooperative launch (`cuLaunchCooperativeKernel`): every block is resident at once,
    /// so blocks may wait for each other (a grid barrier); refused with
    /// `CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE` when the grid has more blocks than
    /// [`occupancy::co_resident_blocks`](super::occupancy::co_resident_blocks) allows.
    pub cooperative: bool,
}

/// A compute device: the CPU executor or the real driver.
pub trait ComputeBackend: Send {
    fn attributes(&self) -> DeviceAttributes;

    fn context_create(&mut self) -> ComputeResult<ContextId>;
    /// A context whose device addresses all lie in `[base, base + size)` (checked by
    /// [`check_window`]); backends without [`DeviceAttributes::placement`] refuse.
    fn context_create_at(&mut self, base: u64, size: u64) -> ComputeResult<ContextId> {
        let _ = (base, size);
        Err(ComputeError::InvalidValue(
            "this backend does not place device memory".into(),
        ))
    }
    fn context_destroy(&mut self, ctx: ContextId) -> ComputeResult<()>;
    /// Waits for all work of the context (`cuCtxSynchronize`).
    fn context_synchronize(&mut self, ctx: ContextId) -> ComputeResult<()>;

    /// Loads PTX text or a fat binary (or an executable holding them).
    fn module_load(&mut self, ctx: ContextId, image: &[u8]) -> ComputeResult<ModuleId>;
    /// Links every PTX image of `images` (PTX text, or the PTX held by fat binaries and
    /// executables) into one module: `.extern` names of one resolve to another's definitions
    /// (`cuLinkAddData` for each, `cuLinkComplete`, `cuModuleLoadData`), as GCC's OpenMP
    /// offloading loads its program with libgomp's and newlib's device code.
    fn module_link(&mut self, ctx: ContextId, images: &[&[u8]]) -> ComputeResult<ModuleId>;
    fn module_unload(&mut self, ctx: ContextId, module: ModuleId) -> ComputeResult<()>;
    /// A module variable's device address and size (`cuModuleGetGlobal`).
    fn module_global(
        &mut self,
        ctx: ContextId,
        module: ModuleId,
        name: &str,
    ) -> ComputeResult<(u64, u64)>;
    /// The attributes of function `f` of `ctx`.
    fn function_attributes(
        &mut self,
        ctx: ContextId,
        f: FunctionId,
    ) -> ComputeResult<FunctionAttributes>;
    /// A kernel of a module and its parameter layout.
    fn function(
        &mut self,
        ctx: ContextId,
        module: ModuleId,
        name: &str,
    ) -> ComputeResult<(FunctionId, Vec<ParamInfo>)>;

    /// Device memory: returns the device address.
    fn mem_alloc(&mut self, ctx: ContextId, bytes: u64) -> ComputeResult<u64>;
    fn mem_free(&mut self, ctx: ContextId, addr: u64) -> ComputeResult<()>;
    /// `cuMemGetInfo`: `(free, total)`, the bytes the context could allocate now (the
    /// smaller of its own limit's room and its VM budget's room) and the total
    /// [`DeviceAttributes::total_memory`] reports.
    fn mem_info(&mut self, ctx: ContextId) -> ComputeResult<(u64, u64)>;
    fn memset_d8(
        &mut self,
        ctx: ContextId,
        addr: u64,
        value: u8,
        count: u64,
        stream: StreamId,
    ) -> ComputeResult<()>;
    fn memset_d32(
        &mut self,
        ctx: ContextId,
        addr: u64,
        value: u32,
        count: u64,
        stream: StreamId,
    ) -> ComputeResult<()>;
    fn copy_htod(
        &mut self,
        ctx: ContextId,
        dst: u64,
        src: &[u8],
        stream: StreamId,
    ) -> ComputeResult<()>;
    fn copy_dtoh(
        &mut self,
        ctx: ContextId,
        dst: &mut [u8],
        src: u64,
        stream: StreamId,
    ) -> ComputeResult<()>;
    fn copy_dtod(
        &mut self,
        ctx: ContextId,
        dst: u64,
        src: u64,
        bytes: u64,
        stream: StreamId,
    ) -> ComputeResult<()>;

    fn stream_create(&mut self, ctx: ContextId) -> ComputeResult<StreamId>;
    fn stream_destroy(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()>;
    fn stream_synchronize(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()>;
    /// `Ok(())` when the stream's work is done, `Err(NotReady)` when not.
    fn stream_query(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()>;

    fn event_create(&mut self, ctx: ContextId) -> ComputeResult<EventId>;
    fn event_destroy(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()>;
    fn event_record(
        &mut self,
        ctx: ContextId,
        event: EventId,
        stream: StreamId,
    ) -> ComputeResult<()>;
    fn event_synchronize(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()>;
    fn event_query(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()>;
    /// Milliseconds between two recorded events (`cuEventElapsedTime`).
    fn event_elapsed_ms(
        &mut self,
        ctx: ContextId,
        start: EventId,
        end: EventId,
    ) -> ComputeResult<f32>;

    fn launch(&mut self, ctx: ContextId, launch: &KernelLaunch<'_>) -> ComputeResult<()>;
    /// Sizes the context's device `malloc` heap (`CU_LIMIT_MALLOC_HEAP_SIZE`), at most
    /// [`MAX_DEVICE_HEAP_BYTES`](super::memory::MAX_DEVICE_HEAP_BYTES). As on the driver, the
    /// size is fixed once a kernel that uses the heap has run: setting it then is
    /// [`ComputeError::InvalidValue`].
    fn set_heap_size(&mut self, ctx: ContextId, bytes: u64) -> ComputeResult<()>;
    /// Device `printf` output of the context since the last call.
    fn take_output(&mut self, ctx: ContextId) -> ComputeResult<String>;

    /// What bounds the backend's requests in time and stops them from another thread (see
    /// [`Interrupt`]): whoever serves the backend calls [`Interrupt::begin`] and
    /// [`Interrupt::end`] around each request, and the backend's long work (a kernel, waiting
    /// for one) checks it. `None` where the backend cannot be interrupted; its requests are
    /// then bounded by its own watchdog only.
    fn interrupt(&self) -> Option<Arc<Interrupt>> {
        None
    }

    /// Whether a sticky error (a fault, a runaway kernel) breaks every context of the
    /// process, not only its own: true on the real driver, whose state is per process, so
    /// isolating guests there takes a process each (`vgpu-cuda-host` serves every
    /// connection in its own process).
    fn faults_are_process_wide(&self) -> bool {
        false
    }
}

/// Longest a request may run by default ([`Interrupt::begin`] to its deadline): under the
/// scheduler daemon's default group timeout (2 s, `vgpu-schedd --group-timeout-ms`) by half a
/// second, so a compute group ends, answered, before the daemon would drop the device for
/// holding the GPU. The guest corpus' longest request, `bandwidth`'s 64 MiB copy kernel,
/// takes 0.6 to 0.9 s on one host thread of a loaded 2-core host (a VM's share there).
pub const DEFAULT_REQUEST_TIME: Duration = Duration::from_millis(1500);

/// Longest an operator may let one request run (`vgpu-cuda-host --request-time`,
/// `vgpu-server --compute-request-time`): an hour, so that a mistyped value still ends (a
/// real GPU without a display has no watchdog at all; ours always has one). Long requests of
/// a scheduled device are time-sliced, so the scheduler never waits for one this long.
pub const MAX_REQUEST_TIME: Duration = Duration::from_secs(3600);

/// Parses a request time given in seconds (`1.5`, `120`): more than zero and at most
/// [`MAX_REQUEST_TIME`].
pub fn parse_request_time(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text
        .trim()
        .parse()
        .map_err(|e| format!("{text:?} is not a number of seconds: {e}"))?;
    if !(seconds > 0.0 && seconds <= MAX_REQUEST_TIME.as_secs_f64()) {
        return Err(format!(
            "{text:?}: a request time is more than 0 and at most {} seconds",
            MAX_REQUEST_TIME.as_secs()
        ));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// Bounds each request of a backend in time and stops its work from another thread: a
/// device reset, a VM or a client that went away, a destroyed guest context.
///
/// Whoever serves the backend marks each request with [`Interrupt::begin`] and
/// [`Interrupt::end`]: its deadline is [`Interrupt::time_limit`] after `begin` (a `Batch` is
/// one request: its launches share the deadline and the instruction budget
/// ([`Interrupt::spend`])). A running kernel calls [`Interrupt::check`] every few thousand
/// warp-instructions' worth of cost, so it stops within a millisecond or so of
/// [`Interrupt::stop`] or of its deadline. A backend used directly (a benchmark, a test, a
/// fuzz target) makes each launch a request of its own without a deadline
/// ([`Interrupt::scope`]): bounded by its instruction budget, deterministically.
///
/// A request begun with [`Interrupt::begin_sliced`] is time-sliced, as a GPU preempts one
/// context's compute for another's: once it has run its slice, the first check to see it
/// pauses the request and calls its [`Slicing::on_yield`] hook (once per slice), and every
/// thread of the request that reaches a check waits there (on a condition variable) until
/// [`Interrupt::resume`] starts its next slice, or a stop or close ends it with the usual
/// error. Paused time does not count against the deadline.
#[derive(Debug)]
pub struct Interrupt {
    /// The running request is to stop; cleared when the next one begins.
    stop: AtomicBool,
    /// Every request, running and later, is to stop: the owner went away for good.
    closed: AtomicBool,
    time_limit: Duration,
    origin: Instant,
    /// The running request's deadline in nanoseconds after `origin`; 0 while none runs,
    /// [`NO_DEADLINE`] for a request without one.
    deadline_ns: AtomicU64,
    /// Cost units (warp-instructions and their equivalents) the running request has spent.
    spent: AtomicU64,
    /// When the running request's slice ends, ns after `origin`; 0 when it is not sliced.
    slice_end_ns: AtomicU64,
    /// The running request's slicing and pause.
    pause: Mutex<Pause>,
    /// Signalled when a paused request resumes or is stopped.
    resumed: Condvar,
}

/// What a time-sliced request does when its slice is over (see [`Interrupt::begin_sliced`]).
#[derive(Clone)]
pub struct Slicing {
    /// How long it runs before it yields.
    pub slice: Duration,
    /// Called once per slice, by the first thread to find it over, when the request pauses:
    /// whoever serves the backend hands the device to other work and calls
    /// [`Interrupt::resume`] when the request's turn comes again. It must not block.
    pub on_yield: Arc<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for Slicing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slicing")
            .field("slice", &self.slice)
            .finish_non_exhaustive()
    }
}

/// The slicing state of the running request.
#[derive(Debug, Default)]
struct Pause {
    /// Its slicing; `None` when it is not sliced.
    slicing: Option<Slicing>,
    /// When it paused (ns after `origin`); `None` while it runs.
    since: Option<u64>,
    /// Threads waiting for it to resume.
    waiting: usize,
}

/// [`Interrupt`]'s deadline of a request that has none.
const NO_DEADLINE: u64 = u64::MAX;

/// Why [`Interrupt::check`] stopped a request: as the driver reports a kernel its watchdog
/// ended (sticky: the context's state is unknown once a kernel stopped midway).
fn interrupted(why: &str) -> ComputeError {
    ComputeError::LaunchTimeout(why.into())
}

impl Interrupt {
    /// An interrupt whose requests may each run `time_limit`.
    pub fn new(time_limit: Duration) -> Arc<Interrupt> {
        Arc::new(Interrupt {
            stop: Default::default(),
            closed: Default::default(),
            time_limit,
            origin: Instant::now(),
            deadline_ns: Default::default(),
            spent: Default::default(),
            slice_end_ns: Default::default(),
            pause: Default::default(),
            resumed: Condvar::new(),
        })
    }

    fn lock_pause(&self) -> MutexGuard<'_, Pause> {
        self.pause.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How long one request may run.
    pub fn time_limit(&self) -> Duration {
        self.time_limit
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// A request begins: not stopped, nothing spent, its deadline [`Interrupt::time_limit`]
    /// from now.
    pub fn begin(&self) {
        let limit = u64::try_from(self.time_limit.as_nanos()).unwrap_or(u64::MAX);
        // Never 0, which means "no request".
        self.begin_until(self.now_ns().saturating_add(limit).max(1));
    }

    /// A request begins as [`Interrupt::begin`] does, time-sliced: it yields every
    /// `slicing.slice` of running time (see [`Interrupt`]).
    pub fn begin_sliced(&self, slicing: Slicing) {
        self.begin();
        let slice = u64::try_from(slicing.slice.as_nanos()).unwrap_or(u64::MAX);
        let mut p = self.lock_pause();
        p.slicing = Some(slicing);
        self.slice_end_ns
            .store(self.now_ns().saturating_add(slice).max(1), Release);
    }

    /// Forgets the slicing of the request that ended (or of the one before a new one).
    fn unslice(&self) {
        let mut p = self.lock_pause();
        p.slicing = None;
        p.since = None;
        self.slice_end_ns.store(0, Release);
    }

    /// A request begins, its deadline `deadline_ns` after `origin`.
    fn begin_until(&self, deadline_ns: u64) {
        self.unslice();
        self.spent.store(0, Relaxed);
        // A closed interrupt stays stopped.
        self.stop.store(self.closed.load(Acquire), Release);
        self.deadline_ns.store(deadline_ns, Release);
    }

    /// The running request ended.
    pub fn end(&self) {
        self.deadline_ns.store(0, Release);
        self.unslice();
    }

    /// Whether a request is running (begun, not ended).
    pub fn in_request(&self) -> bool {
        self.deadline_ns.load(Acquire) != 0
    }

    /// Runs `f` in the running request, or as a request of its own without a deadline where
    /// none runs: what a backend does around each launch, so that one used directly is
    /// bounded by its instruction budget alone (deterministic, whatever the host's load).
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.in_request() {
            return f();
        }
        self.begin_until(NO_DEADLINE);
        let r = f();
        self.end();
        r
    }

    /// Runs `f` as one request (its deadline [`Interrupt::time_limit`] from now): what
    /// whoever serves the backend does around each request.
    pub fn request<R>(&self, f: impl FnOnce() -> R) -> R {
        self.begin();
        let r = f();
        self.end();
        r
    }

    /// Stops the running request at its next check (a paused one at once); the next request
    /// runs.
    pub fn stop(&self) {
        self.stop.store(true, Release);
        // Under the lock, so that a thread about to wait sees the flag or gets the signal.
        drop(self.lock_pause());
        self.resumed.notify_all();
    }

    /// Stops the running request and every later one: the owner went away.
    pub fn close(&self) {
        self.closed.store(true, Release);
        self.stop();
    }

    /// A flag that is set whenever the running request is to stop, for work that looks at a
    /// flag only (a module parse). Its deadline is not in it: see [`Interrupt::check`].
    pub fn flag(&self) -> &AtomicBool {
        &self.stop
    }

    /// `LaunchTimeout` when the running request was stopped.
    fn stopped(&self) -> ComputeResult<()> {
        if self.closed.load(Relaxed) {
            return Err(interrupted("cancelled: its owner went away"));
        }
        if self.stop.load(Relaxed) {
            return Err(interrupted(
                "cancelled: a device reset, its context destroyed or its caller gone",
            ));
        }
        Ok(())
    }

    /// `LaunchTimeout` when the running request was stopped or is past its deadline. A
    /// sliced request whose slice is over pauses here until it resumes (see [`Interrupt`]).
    pub fn check(&self) -> ComputeResult<()> {
        self.stopped()?;
        let slice_end = self.slice_end_ns.load(Relaxed);
        if slice_end != 0 && self.now_ns() >= slice_end {
            self.pause()?;
        }
        let deadline = self.deadline_ns.load(Relaxed);
        if deadline != 0 && deadline != NO_DEADLINE && self.now_ns() >= deadline {
            return Err(interrupted(&format!(
                "request ran past its time limit of {:?}",
                self.time_limit
            )));
        }
        Ok(())
    }

    /// The running request's slice is over: the first thread here pauses it and calls its
    /// hook; every thread waits until it resumes (`Ok`) or is stopped (the stop's error).
    fn pause(&self) -> ComputeResult<()> {
        let mut p = self.lock_pause();
        if p.since.is_none() {
            // Under the lock: a resume may have begun the next slice since this thread looked.
            let now = self.now_ns();
            let end = self.slice_end_ns.load(Acquire);
            if end == 0 || now < end {
                return Ok(());
            }
            let Some(on_yield) = p.slicing.as_ref().map(|s| Arc::clone(&s.on_yield)) else {
                return Ok(());
            };
            p.since = Some(now);
            on_yield();
        }
        p.waiting += 1;
        while p.since.is_some() && self.stopped().is_ok() {
            p = self.resumed.wait(p).unwrap_or_else(PoisonError::into_inner);
        }
        p.waiting -= 1;
        drop(p);
        self.stopped()
    }

    /// Starts the next slice of the paused request: its threads go on, and its deadline moves
    /// by the time it was paused. False when no request is paused (or it was stopped).
    pub fn resume(&self) -> bool {
        let mut p = self.lock_pause();
        if self.stopped().is_err() {
            return false;
        }
        let Some(since) = p.since.take() else {
            return false;
        };
        let now = self.now_ns();
        let paused = now.saturating_sub(since);
        let _ = self.deadline_ns.fetch_update(AcqRel, Acquire, |d| {
            (d != 0 && d != NO_DEADLINE).then(|| d.saturating_add(paused))
        });
        let slice = p.slicing.as_ref().map_or(Duration::ZERO, |s| s.slice);
        let slice = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
        self.slice_end_ns
            .store(now.saturating_add(slice).max(1), Release);
        drop(p);
        self.resumed.notify_all();
        true
    }

    /// Whether the running request is paused at the end of a slice.
    pub fn paused(&self) -> bool {
        self.lock_pause().since.is_some()
    }

    /// How many threads of the running request wait for it to resume.
    pub fn paused_threads(&self) -> usize {
        self.lock_pause().waiting
    }

    /// Cost units the running request spent so far.
    pub fn spent(&self) -> u64 {
        self.spent.load(Relaxed)
    }

    /// Adds `units` to what the running request spent.
    pub fn spend(&self, units: u64) {
        // Saturating: a request never wraps back under its budget.
        let _ = self
            .spent
            .fetch_update(Relaxed, Relaxed, |s| Some(s.saturating_add(units)));
    }
}

/// Refuses a module load when a context already holds [`MAX_MODULES_PER_CONTEXT`].
pub(crate) fn room_for_module(loaded: usize) -> ComputeResult<()> {
    if loaded >= MAX_MODULES_PER_CONTEXT {
        return Err(ComputeError::OutOfMemory(format!(
            "{MAX_MODULES_PER_CONTEXT} modules"
        )));
    }
    Ok(())
}

/// The next handle from a per-context counter: wrapping, never 0 (0 is the default stream).
pub(crate) fn next_id(counter: &mut u32) -> u32 {
    *counter = counter.wrapping_add(1).max(1);
    *counter
}

/// Packs kernel arguments (little-endian values, one per parameter) at the layout a kernel's
/// `ParamInfo`s give, as a launch's parameter buffer.
pub fn pack_params(params: &[ParamInfo], args: &[u64]) -> Vec<u8> {
    let end = params.iter().map(|p| p.offset + p.size).max().unwrap_or(0);
    let mut buf = vec![0u8; end as usize];
    for (p, v) in params.iter().zip(args) {
        let (o, n) = (p.offset as usize, (p.size as usize).min(8));
        buf[o..o + n].copy_from_slice(&v.to_le_bytes()[..n]);
    }
    buf
}

/// A backend's contexts by handle, at most [`MAX_CONTEXTS`].
#[derive(Debug)]
pub(crate) struct ContextTable<C> {
    contexts: std::collections::HashMap<u32, C>,
    next: u32,
}

impl<C> ContextTable<C> {
    pub fn new() -> Self {
        ContextTable {
            contexts: Default::default(),
            next: 0,
        }
    }

    /// Refuses a context past the bound before the backend creates anything.
    pub fn check_room(&self) -> ComputeResult<()> {
        if self.contexts.len() >= MAX_CONTEXTS {
            return Err(ComputeError::OutOfMemory(format!(
                "{MAX_CONTEXTS} contexts"
            )));
        }
        Ok(())
    }

    /// Adds a context under a handle no live context has.
    pub fn insert(&mut self, c: C) -> ContextId {
        while self.contexts.contains_key(&next_id(&mut self.next)) {}
        self.contexts.insert(self.next, c);
        ContextId(self.next)
    }

    pub fn get_mut(&mut self, ctx: ContextId) -> ComputeResult<&mut C> {
        self.contexts
            .get_mut(&ctx.0)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("context {}", ctx.0)))
    }

    pub fn remove(&mut self, ctx: ContextId) -> ComputeResult<C> {
        self.contexts
            .remove(&ctx.0)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("context {}", ctx.0)))
    }

    pub fn drain(&mut self) -> impl Iterator<Item = C> + '_ {
        self.contexts.drain().map(|(_, c)| c)
    }
}
