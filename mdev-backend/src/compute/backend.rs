//! The compute backend trait: what the device asks of a CUDA-like executor for one VM.
//!
//! Every id a call takes comes from the guest and may hold any value: backends look each one
//! up in their own tables (and check it belongs to the context named) before using it. Sizes,
//! counts and launch dimensions are checked against the named limits below and the device's
//! [`DeviceAttributes`]; device addresses of copies and memsets must lie inside one allocation
//! of the context. A kernel's out-of-range access is [`ComputeError::IllegalAddress`] for that
//! context, which then answers [`ComputeError::ContextBroken`] to everything but
//! [`ComputeBackend::ctx_destroy`].

use super::ComputeResult;

/// Contexts one backend (one VM) may hold at once.
pub const MAX_CONTEXTS: usize = 64;
/// Modules loaded in one context at once.
pub const MAX_MODULES_PER_CONTEXT: usize = 256;
/// Function handles handed out in one context (over all its modules).
pub const MAX_FUNCTIONS_PER_CONTEXT: usize = 4096;
/// Streams of one context, the default stream not counted.
pub const MAX_STREAMS: usize = 256;
/// Events of one context.
pub const MAX_EVENTS: usize = 4096;
/// Largest module image (PTX text or fat binary) accepted by a load.
pub const MAX_MODULE_IMAGE_BYTES: usize = 64 << 20;
/// Largest copy or memset, in bytes.
pub const MAX_COPY_BYTES: u64 = 1 << 30;
/// Default device memory budget of one context.
pub const DEFAULT_CONTEXT_MEMORY: u64 = 1 << 30;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u32);
    };
}

id_type!(
    /// A context, chosen by the backend.
    ContextId
);
id_type!(
    /// A loaded module of a context.
    ModuleId
);
id_type!(
    /// A kernel of a loaded module.
    FunctionId
);
id_type!(
    /// A stream of a context; [`StreamId::DEFAULT`] is the context's default stream.
    StreamId
);
id_type!(
    /// An event of a context.
    EventId
);

impl StreamId {
    /// The default (null) stream every context has.
    pub const DEFAULT: StreamId = StreamId(0);
}

/// What a backend's device reports (`cuDeviceGetAttribute` and friends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttributes {
    pub name: String,
    /// Device memory a guest context may allocate, in bytes (its budget, not the board's).
    pub total_memory: u64,
    pub compute_capability: (u32, u32),
    pub multiprocessor_count: u32,
    pub max_threads_per_block: u32,
    pub max_block_dim: [u32; 3],
    pub max_grid_dim: [u32; 3],
    pub shared_memory_per_block: u32,
    pub warp_size: u32,
    pub clock_rate_khz: u32,
}

/// Backend settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeConfig {
    /// Device memory budget of each context, in bytes.
    pub context_memory: u64,
    /// Warp-instructions one launch may execute on the CPU backend (past it: `LaunchTimeout`).
    pub instruction_budget: u64,
    /// Host threads a CPU-backend launch spreads its blocks over.
    pub threads: usize,
}

impl Default for ComputeConfig {
    fn default() -> Self {
        ComputeConfig {
            context_memory: DEFAULT_CONTEXT_MEMORY,
            instruction_budget: 1 << 32,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// One kernel parameter's place in the packed parameter buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamLayout {
    pub offset: u32,
    pub size: u32,
    pub align: u32,
}

/// A function handle and the layout its launches' parameter buffers must have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionInfo {
    pub id: FunctionId,
    pub params: Vec<ParamLayout>,
    /// Length of the packed parameter buffer.
    pub param_bytes: u32,
}

/// Free and total device memory of a context (`cuMemGetInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    pub free: u64,
    pub total: u64,
}

/// One kernel launch.
#[derive(Debug, Clone)]
pub struct LaunchArgs<'a> {
    pub function: FunctionId,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub stream: StreamId,
    /// The packed parameter buffer, exactly the function's `param_bytes` long.
    pub params: &'a [u8],
}

/// A CUDA-like device executing one VM's compute work. Every call is bounded by the limits of
/// this module and validates every argument; none panics on any input.
///
/// Host-side buffers of copies belong to the caller for the duration of the call: a copy
/// returns after the data has been read from (HtoD) or written to (DtoH) them, in stream order.
/// Launches, memsets and device-to-device copies are queued on their stream.
pub trait ComputeBackend: Send {
    /// The device's attributes.
    fn attributes(&self) -> DeviceAttributes;

    /// Creates a context (with its default stream).
    fn ctx_create(&mut self) -> ComputeResult<ContextId>;
    /// Destroys a context and everything in it; a broken context can be destroyed.
    fn ctx_destroy(&mut self, ctx: ContextId) -> ComputeResult<()>;
    /// Waits for all work of the context.
    fn ctx_synchronize(&mut self, ctx: ContextId) -> ComputeResult<()>;

    /// Loads a module from PTX text or a fat binary (at most [`MAX_MODULE_IMAGE_BYTES`]).
    fn module_load(&mut self, ctx: ContextId, image: &[u8]) -> ComputeResult<ModuleId>;
    /// Unloads a module; its function handles become invalid.
    fn module_unload(&mut self, ctx: ContextId, module: ModuleId) -> ComputeResult<()>;
    /// Looks a kernel of a module up by name.
    fn function_get(
        &mut self,
        ctx: ContextId,
        module: ModuleId,
        name: &str,
    ) -> ComputeResult<FunctionInfo>;

    /// Allocates `size` bytes of device memory; returns its device address.
    fn mem_alloc(&mut self, ctx: ContextId, size: u64) -> ComputeResult<u64>;
    /// Frees the allocation starting at `addr`.
    fn mem_free(&mut self, ctx: ContextId, addr: u64) -> ComputeResult<()>;
    /// Free and total memory of the context.
    fn mem_get_info(&mut self, ctx: ContextId) -> ComputeResult<MemInfo>;
    /// Sets `count` bytes at `dst` to `value`.
    fn memset_d8(
        &mut self,
        ctx: ContextId,
        dst: u64,
        value: u8,
        count: u64,
        stream: StreamId,
    ) -> ComputeResult<()>;
    /// Sets `count` 32-bit words at `dst` (4-aligned) to `value`.
    fn memset_d32(
        &mut self,
        ctx: ContextId,
        dst: u64,
        value: u32,
        count: u64,
        stream: StreamId,
    ) -> ComputeResult<()>;
    /// Copies `src` to device address `dst`.
    fn copy_htod(
        &mut self,
        ctx: ContextId,
        dst: u64,
        src: &[u8],
        stream: StreamId,
    ) -> ComputeResult<()>;
    /// Copies `dst.len()` bytes at device address `src` into `dst`.
    fn copy_dtoh(
        &mut self,
        ctx: ContextId,
        dst: &mut [u8],
        src: u64,
        stream: StreamId,
    ) -> ComputeResult<()>;
    /// Copies `bytes` bytes between device addresses.
    fn copy_dtod(
        &mut self,
        ctx: ContextId,
        dst: u64,
        src: u64,
        bytes: u64,
        stream: StreamId,
    ) -> ComputeResult<()>;

    /// Creates a stream.
    fn stream_create(&mut self, ctx: ContextId) -> ComputeResult<StreamId>;
    /// Destroys a stream (its queued work still runs); the default stream cannot be destroyed.
    fn stream_destroy(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()>;
    /// Waits for the stream's work.
    fn stream_synchronize(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()>;
    /// `Ok` when the stream's work is done, [`super::ComputeError::NotReady`] otherwise.
    fn stream_query(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()>;

    /// Creates an event.
    fn event_create(&mut self, ctx: ContextId) -> ComputeResult<EventId>;
    /// Destroys an event.
    fn event_destroy(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()>;
    /// Records the event after the stream's work queued so far.
    fn event_record(
        &mut self,
        ctx: ContextId,
        event: EventId,
        stream: StreamId,
    ) -> ComputeResult<()>;
    /// Waits for the event's recorded work (an event never recorded is complete).
    fn event_synchronize(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()>;
    /// `Ok` when the event has completed, [`super::ComputeError::NotReady`] otherwise.
    fn event_query(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()>;
    /// Milliseconds between two completed events (`cuEventElapsedTime`).
    fn event_elapsed_ms(
        &mut self,
        ctx: ContextId,
        start: EventId,
        end: EventId,
    ) -> ComputeResult<f32>;

    /// Queues a kernel launch.
    fn launch(&mut self, ctx: ContextId, args: &LaunchArgs<'_>) -> ComputeResult<()>;
}
