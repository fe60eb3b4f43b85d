//! The driver's state in the guest, with no unsafe code and no raw pointers: handle tables
//! (contexts, modules, functions with their parameter layouts, streams, events, link states,
//! allocations), answers given locally, and the requests forwarded to the host over a
//! [`Transport`]. `api.rs` turns the C calls into calls of [`Driver`].

use std::collections::{BTreeMap, HashMap};

use mdev_backend::compute::backend::{
    ContextId, DeviceAttributes, EventId, FunctionAttributes, FunctionId, ModuleId, ParamInfo,
    StreamId,
};
use mdev_backend::compute::shm::{MIN_SHARED_COPY_BYTES, PinnedMemory};
use mdev_backend::compute::wire::{MAX_BATCH, MAX_COPY_BYTES, Reply, Request};

use crate::attributes::{self, FunctionSettings};
use crate::status::*;
use crate::transport::{Shared, Transport, TransportError};

/// A driver call's failure: the `CUresult` returned.
pub type CuResult<T> = Result<T, u32>;

/// Handles are `kind << KIND_SHIFT | serial`, never 0, so a handle of one kind passed where
/// another is expected is refused.
const KIND_SHIFT: u32 = 40;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Kind {
    Context = 1,
    Module = 2,
    Function = 3,
    Stream = 4,
    Event = 5,
    Link = 6,
    Library = 7,
    Kernel = 8,
}

#[derive(Debug)]
struct Context {
    remote: ContextId,
    /// The range its device addresses lie in, reserved in this process (placed contexts).
    _window: Option<crate::window::Window>,
    /// Device allocations: start → size (`cuMemGetAddressRange`, `cuMemcpy` directions).
    allocations: BTreeMap<u64, u64>,
    /// Its usage count: 1 at creation, one more for each `cuCtxAttach`.
    usage: u32,
    /// Each `cuMemAlloc` allocation's buffer id (`CU_POINTER_ATTRIBUTE_BUFFER_ID`).
    buffer_ids: HashMap<u64, u64>,
    settings: ContextSettings,
}

/// What a program told a context: its `CU_CTX_*` flags, its cache preference and the limits
/// it set (`cuCtxSetLimit`), each at most what the host's executor provides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextSettings {
    pub flags: u32,
    /// `CUfunc_cache`: a preference the hardware may ignore, kept to be reported.
    pub cache_config: u32,
    /// `CU_LIMIT_STACK_SIZE`, `CU_LIMIT_PRINTF_FIFO_SIZE`, `CU_LIMIT_MALLOC_HEAP_SIZE` and
    /// `CU_LIMIT_MAX_L2_FETCH_GRANULARITY`, in bytes.
    pub stack_bytes: u64,
    pub printf_bytes: u64,
    pub heap_bytes: u64,
    pub l2_fetch_granularity: u64,
}

/// A context's stack size before a program sets one: CUDA's default per-thread stack.
pub const DEFAULT_STACK_BYTES: u64 = 1024;
/// The L2 fetch granularity reported before a program sets one (a hint on every GPU).
pub const DEFAULT_L2_FETCH_GRANULARITY: u64 = 64;

impl Default for ContextSettings {
    fn default() -> Self {
        ContextSettings {
            flags: 0,
            cache_config: 0,
            stack_bytes: DEFAULT_STACK_BYTES,
            printf_bytes: mdev_backend::compute::ptx::MAX_PRINTF_BYTES as u64,
            heap_bytes: mdev_backend::compute::memory::DEVICE_HEAP_BYTES,
            l2_fetch_granularity: DEFAULT_L2_FETCH_GRANULARITY,
        }
    }
}

/// Page-locked host memory: from `cuMemHostAlloc`/`cuMemAllocHost` or registered with
/// `cuMemHostRegister`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    pub size: u64,
    /// `CU_MEMHOSTALLOC_*` or `CU_MEMHOSTREGISTER_*` flags.
    pub flags: u32,
    /// The context current when it was allocated or registered.
    pub ctx: u64,
    pub registered: bool,
    pub buffer_id: u64,
}

/// Most page-locked host ranges a process may hold (allocated and registered together).
pub const MAX_HOST_RANGES: usize = 65_536;

/// What `cuPointerGetAttribute` knows of an address: the allocation holding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointerInfo {
    /// Device memory of a context: its start, size and buffer id; managed memory too.
    Device {
        ctx: u64,
        start: u64,
        size: u64,
        buffer_id: u64,
        managed: bool,
    },
    /// Page-locked host memory, with its device address when it is mapped.
    Host {
        start: u64,
        memory: HostMemory,
        device: Option<u64>,
    },
}

/// The process memory holding the host views of managed and mapped memory, which only
/// `api.rs` reads and writes (tests give a fake).
pub trait HostView: Send {
    /// Copies `out.len()` bytes of this process at `addr` into `out`.
    fn read(&self, addr: u64, out: &mut [u8]);
    /// Copies `data` into this process at `addr`.
    fn write(&self, addr: u64, data: &[u8]);
}

/// Memory seen at two places, a device range and its host view (managed memory, mapped
/// page-locked host memory), made coherent at the synchronisation points CUDA defines for a
/// device without concurrent managed access: before device work the host view's changes go to
/// the device, after a synchronisation the device's contents come back.
#[derive(Debug)]
struct Shadow {
    ctx: u64,
    host: u64,
    size: u64,
    /// The device allocation holding the range (freed with it).
    alloc: u64,
    /// The host view as last made coherent: an upload sends only the chunks that changed.
    clean: Vec<u8>,
    managed: bool,
}

impl Shadow {
    /// What it is, at device address `device`.
    fn info(&self, device: u64) -> ShadowInfo {
        ShadowInfo {
            ctx: self.ctx,
            device,
            host: self.host,
            size: self.size,
            alloc: self.alloc,
            managed: self.managed,
        }
    }
}

/// What a shadowed range is, for pointer attributes and for its release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShadowInfo {
    pub ctx: u64,
    pub device: u64,
    pub host: u64,
    pub size: u64,
    pub alloc: u64,
    pub managed: bool,
}

/// Bytes compared and sent as one piece when a host view is made coherent.
const COHERENCE_CHUNK: usize = 64 << 10;

/// A created stream's `CU_STREAM_*` flags and priority (`cuStreamCreateWithPriority`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamSettings {
    pub flags: u32,
    pub priority: i32,
}

#[derive(Debug)]
struct Function {
    ctx: u64,
    remote: FunctionId,
    params: Vec<ParamInfo>,
    /// Asked of the host once, at the first `cuFuncGetAttribute` or launch with dynamic
    /// shared memory.
    attributes: Option<FunctionAttributes>,
    settings: FunctionSettings,
    /// What the launch API of CUDA 1 (`cuFuncSetBlockShape`, `cuParamSet*`) set for `cuLaunch`.
    legacy: LegacyLaunch,
}

/// A function's launch configuration and parameter buffer as the deprecated launch API builds
/// them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LegacyLaunch {
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub params: Vec<u8>,
}

/// Most bytes of a `cuParamSetSize` buffer: the most a kernel's parameters may take.
pub const MAX_LEGACY_PARAM_BYTES: u32 = mdev_backend::compute::ptx::MAX_PARAM_BYTES;

/// A `cuLinkCreate` state: the images added, and once complete the token `cuLinkComplete`
/// handed out as the "cubin" (what `cuModuleLoadData` then receives).
#[derive(Debug, Default)]
pub struct Link {
    pub images: Vec<Vec<u8>>,
    pub completed: Option<Box<[u8; 16]>>,
}

/// What a module is made of: one image, or the images of a completed link.
#[derive(Debug, Clone)]
pub enum Image {
    Single(Vec<u8>),
    Linked(Vec<Vec<u8>>),
}

/// A library (`cuLibraryLoadData`, what cudart 12 and 13 load their fat binaries with): not
/// bound to a context, it becomes a module in each context at that context's first use.
#[derive(Debug)]
struct Library {
    image: Image,
    /// context → module handle.
    modules: HashMap<u64, u64>,
}

/// A kernel of a library (`cuLibraryGetKernel`): a function in each context that uses it.
#[derive(Debug)]
struct Kernel {
    library: u64,
    name: String,
    /// context → function handle.
    functions: HashMap<u64, u64>,
}

/// Magic at the start of a completed link's token.
pub const LINK_TOKEN_MAGIC: &[u8; 8] = b"VGPULNK\0";

/// A launch's parameters as the C call gave them, read by `api.rs`.
#[derive(Debug, Clone)]
pub enum LaunchParams {
    /// `kernelParams`: one value per parameter, each `ParamInfo::size` bytes.
    Each(Vec<Vec<u8>>),
    /// `extra` with `CU_LAUNCH_PARAM_BUFFER_POINTER`: the packed buffer.
    Packed(Vec<u8>),
}

/// Bytes of deferred work (mostly copy payloads) sent in one batch: half a message's limit.
pub const MAX_PENDING_BYTES: usize = 32 << 20;
/// Framing counted for a deferred request besides its payload.
const REQUEST_OVERHEAD: usize = 64;

impl<T: Transport> std::fmt::Debug for Driver<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("contexts", &self.contexts.len())
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

/// The driver of one process.
///
/// Asynchronous work (launches, host-to-device and device-to-device copies, memsets, event
/// records) is validated here, then deferred and sent as one batch at the next call that needs
/// an answer from the host (a synchronisation, a device-to-host copy, a query, an allocation),
/// as a GPU driver queues work and reports its errors later; each batch is one round trip.
pub struct Driver<T: Transport> {
    t: T,
    pending: Vec<Request>,
    pending_bytes: usize,
    /// Where device printf output goes (the process's standard output).
    output: Box<dyn std::io::Write + Send>,
    attributes: DeviceAttributes,
    contexts: HashMap<u64, Context>,
    /// Module, stream and event handles: (owning context, remote id).
    objects: HashMap<u64, (u64, u32)>,
    functions: HashMap<u64, Function>,
    links: HashMap<u64, Link>,
    libraries: HashMap<u64, Library>,
    kernels: HashMap<u64, Kernel>,
    streams: HashMap<u64, StreamSettings>,
    /// Page-locked host memory handed out or registered: start → what it is.
    host_memory: BTreeMap<u64, HostMemory>,
    /// Page-locked allocations shared with the host (a memory file each): start → it.
    pinned: BTreeMap<u64, PinnedMemory>,
    /// The last buffer id given (ids are never reused in a process).
    last_buffer_id: u64,
    /// Managed and mapped ranges: device address → the range.
    shadows: BTreeMap<u64, Shadow>,
    /// Bytes of all shadows, at most the device's memory (each is device memory too).
    shadow_bytes: u64,
    host_view: Option<Box<dyn HostView>>,
    /// Device work was sent since the shadows were last brought back.
    device_touched: bool,
    primary: Option<u64>,
    /// The primary context's flags (`cuDevicePrimaryCtxSetFlags`), kept across its creation.
    primary_flags: u32,
    next: u64,
    /// The host's message with the last error it answered (its status and why: the refused
    /// PTX construct and line, the limit hit), until [`Driver::take_host_error`] takes it.
    host_error: Option<(u32, String)>,
}

impl<T: Transport> Driver<T> {
    /// Connects: asks the host for the device's attributes (`cuInit`).
    pub fn new(mut t: T) -> CuResult<Self> {
        let attributes = match t.call(&Request::Attributes) {
            Ok(Reply::Attributes(a)) => a,
            Ok(Reply::Error { status, .. }) => return Err(status),
            _ => return Err(CUDA_ERROR_NO_DEVICE),
        };
        Ok(Driver {
            t,
            pending: Vec::new(),
            pending_bytes: 0,
            output: Box::new(std::io::stdout()),
            attributes,
            contexts: HashMap::new(),
            objects: HashMap::new(),
            functions: HashMap::new(),
            links: HashMap::new(),
            libraries: HashMap::new(),
            kernels: HashMap::new(),
            streams: HashMap::new(),
            host_memory: BTreeMap::new(),
            pinned: BTreeMap::new(),
            last_buffer_id: 0,
            shadows: BTreeMap::new(),
            shadow_bytes: 0,
            host_view: None,
            device_touched: false,
            primary: None,
            primary_flags: 0,
            next: 0,
            host_error: None,
        })
    }

    /// Sends device printf output to `w` instead of standard output.
    pub fn with_output(mut self, w: Box<dyn std::io::Write + Send>) -> Self {
        self.output = w;
        self
    }

    /// The transport requests go through.
    pub fn transport(&self) -> &T {
        &self.t
    }

    pub fn attributes(&self) -> &DeviceAttributes {
        &self.attributes
    }

    fn handle(&mut self, kind: Kind) -> u64 {
        self.next += 1;
        (kind as u64) << KIND_SHIFT | self.next
    }

    /// Sends a request that needs its answer now, after the deferred work.
    fn call(&mut self, req: Request) -> CuResult<Reply> {
        self.flush()?;
        self.send(&req)
    }

    /// Sends `req`; with shadowed ranges, device work is preceded by the host views' changes
    /// and a synchronisation is followed by the device's contents.
    fn send(&mut self, req: &Request) -> CuResult<Reply> {
        if self.shadows.is_empty() {
            return self.exchange(req);
        }
        // The host's changes go first, also before a synchronisation: what comes back after
        // it must not undo them.
        let device_work = touches_device(req);
        let sync = synchronizes(req);
        if device_work || sync {
            self.upload_shadows()?;
        }
        let reply = self.exchange(req)?;
        self.device_touched |= device_work && self.writes_shadows(req);
        // A batch that failed is reported as it is: its context is broken, nothing comes back.
        let failed = matches!(&reply, Reply::Batch { error: Some(_), .. });
        if sync && !failed {
            self.download_shadows()?;
        }
        Ok(reply)
    }

    /// The host's message with the last error it answered, with its status: taken once.
    pub fn take_host_error(&mut self) -> Option<(u32, String)> {
        self.host_error.take()
    }

    fn exchange(&mut self, req: &Request) -> CuResult<Reply> {
        let r = self.t.call(req);
        self.answer(r)
    }

    /// What the host answered, as this driver reports it: its error kept for
    /// [`Driver::take_host_error`], a lost connection as `CUDA_ERROR_DEINITIALIZED`.
    fn answer(&mut self, r: Result<Reply, TransportError>) -> CuResult<Reply> {
        match r {
            Ok(Reply::Error { status, message }) => {
                let status = if status == 0 {
                    CUDA_ERROR_UNKNOWN
                } else {
                    status
                };
                self.host_error = Some((status, message));
                Err(status)
            }
            Ok(r) => Ok(r),
            Err(_) => Err(CUDA_ERROR_DEINITIALIZED),
        }
    }

    /// Defers asynchronous work to the next batch.
    fn defer(&mut self, req: Request) -> CuResult<()> {
        let bytes = REQUEST_OVERHEAD
            + match &req {
                Request::CopyHtoD { data, .. } => data.len(),
                Request::Launch { params, .. } => params.len(),
                _ => 0,
            };
        if self.pending.len() >= MAX_BATCH || self.pending_bytes + bytes > MAX_PENDING_BYTES {
            self.flush()?;
        }
        self.pending.push(req);
        self.pending_bytes += bytes;
        Ok(())
    }

    /// Sends the deferred work; the first failure among it is this call's error.
    pub fn flush(&mut self) -> CuResult<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch = Request::Batch(std::mem::take(&mut self.pending));
        self.pending_bytes = 0;
        let reply = self.send(&batch)?;
        self.batch_result(reply)
    }

    /// Defers `req` when the guest could check it (`checked`), else sends it now so the host's
    /// answer is this call's.
    fn defer_if(&mut self, checked: bool, req: Request) -> CuResult<()> {
        if checked {
            self.defer(req)
        } else {
            self.done(req)
        }
    }

    fn done(&mut self, req: Request) -> CuResult<()> {
        match self.call(req)? {
            Reply::Done => Ok(()),
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }

    fn id(&mut self, req: Request) -> CuResult<u32> {
        match self.call(req)? {
            Reply::Id(id) => Ok(id),
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }

    fn ctx(&self, ctx: u64) -> CuResult<&Context> {
        self.contexts.get(&ctx).ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    fn remote(&self, ctx: u64) -> CuResult<ContextId> {
        self.ctx(ctx).map(|c| c.remote)
    }

    /// The remote id of a module, stream or event handle of `ctx`.
    fn object(&self, ctx: u64, kind: Kind, handle: u64) -> CuResult<u32> {
        if handle >> KIND_SHIFT != kind as u64 {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        match self.objects.get(&handle) {
            Some(&(c, id)) if c == ctx => Ok(id),
            Some(_) => Err(CUDA_ERROR_INVALID_CONTEXT),
            None => Err(CUDA_ERROR_INVALID_HANDLE),
        }
    }

    fn stream(&self, ctx: u64, stream: u64) -> CuResult<StreamId> {
        // 0 is the NULL stream; 1 and 2 are CU_STREAM_LEGACY and CU_STREAM_PER_THREAD, which
        // behave as it here (all work of a context runs in order).
        if stream <= 2 {
            return Ok(StreamId(0));
        }
        self.object(ctx, Kind::Stream, stream).map(StreamId)
    }

    // Contexts.

    /// A context. Where the host places device memory, its addresses lie in a window reserved
    /// in this process, so they never alias a host address (unified addressing); a window that
    /// cannot be reserved fails the creation rather than the promise.
    pub fn context_create(&mut self) -> CuResult<u64> {
        let (remote, window) = if self.attributes.placement {
            let window = crate::window::Window::reserve(context_window_bytes(&self.attributes))
                .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
            let req = Request::ContextCreateAt {
                base: window.base(),
                size: window.size(),
            };
            (self.id(req)?, Some(window))
        } else {
            (self.id(Request::ContextCreate)?, None)
        };
        let h = self.handle(Kind::Context);
        self.contexts.insert(
            h,
            Context {
                remote: ContextId(remote),
                _window: window,
                allocations: BTreeMap::new(),
                usage: 1,
                buffer_ids: HashMap::new(),
                settings: ContextSettings::default(),
            },
        );
        Ok(h)
    }

    pub fn context_destroy(&mut self, ctx: u64) -> CuResult<()> {
        let remote = self.remote(ctx)?;
        // Its shadows' host views go with its window.
        let gone: u64 = self
            .shadows
            .values()
            .filter(|s| s.ctx == ctx)
            .map(|s| s.size)
            .sum();
        self.shadows.retain(|_, s| s.ctx != ctx);
        self.shadow_bytes -= gone;
        self.host_memory.retain(|_, m| m.ctx != ctx || m.registered);
        self.contexts.remove(&ctx);
        self.objects.retain(|_, (c, _)| *c != ctx);
        self.streams.retain(|s, _| self.objects.contains_key(s));
        self.functions.retain(|_, f| f.ctx != ctx);
        if self.primary == Some(ctx) {
            self.primary = None;
        }
        self.done(Request::ContextDestroy { ctx: remote })
    }

    /// `cuCtxAttach`: one more user of the context.
    pub fn context_attach(&mut self, ctx: u64) -> CuResult<()> {
        let c = self
            .contexts
            .get_mut(&ctx)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        c.usage = c.usage.checked_add(1).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(())
    }

    /// `cuCtxDetach`: one user fewer; the last one destroys it. Whether it was destroyed.
    pub fn context_detach(&mut self, ctx: u64) -> CuResult<bool> {
        let c = self
            .contexts
            .get_mut(&ctx)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        c.usage -= 1;
        if c.usage > 0 {
            return Ok(false);
        }
        self.context_destroy(ctx)?;
        Ok(true)
    }

    pub fn is_context(&self, ctx: u64) -> bool {
        self.contexts.contains_key(&ctx)
    }

    /// The device's primary context, created at its first retain with the flags set for it.
    pub fn primary_context(&mut self) -> CuResult<u64> {
        match self.primary {
            Some(c) => Ok(c),
            None => {
                let c = self.context_create()?;
                self.settings_mut(c)?.flags = self.primary_flags;
                self.primary = Some(c);
                Ok(c)
            }
        }
    }

    /// The primary context's flags and whether it is active (created).
    pub fn primary_state(&self) -> (u32, bool) {
        match self.primary.and_then(|c| self.contexts.get(&c)) {
            Some(c) => (c.settings.flags, true),
            None => (self.primary_flags, false),
        }
    }

    /// Sets the primary context's flags, for it now and if it is created again.
    pub fn set_primary_flags(&mut self, flags: u32) -> CuResult<()> {
        self.primary_flags = flags;
        if let Some(c) = self.primary {
            self.settings_mut(c)?.flags = flags;
        }
        Ok(())
    }

    pub fn settings(&self, ctx: u64) -> CuResult<ContextSettings> {
        self.ctx(ctx).map(|c| c.settings)
    }

    /// Sizes the context's device heap on the host (`CU_LIMIT_MALLOC_HEAP_SIZE`), then
    /// records it: the host refuses it once a kernel that uses the heap has run.
    pub fn set_heap_size(&mut self, ctx: u64, bytes: u64) -> CuResult<()> {
        let remote = self.remote(ctx)?;
        self.done(Request::SetHeapSize { ctx: remote, bytes })?;
        self.settings_mut(ctx)?.heap_bytes = bytes;
        Ok(())
    }

    pub fn settings_mut(&mut self, ctx: u64) -> CuResult<&mut ContextSettings> {
        self.contexts
            .get_mut(&ctx)
            .map(|c| &mut c.settings)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    /// Sends the deferred work with the synchronisation at its end: one round trip.
    pub fn synchronize(&mut self, ctx: u64) -> CuResult<()> {
        let ctx = self.remote(ctx)?;
        self.defer(Request::ContextSynchronize { ctx })?;
        self.flush()
    }

    // Modules and functions.

    pub fn module_load(&mut self, ctx: u64, image: Image) -> CuResult<u64> {
        let remote = self.remote(ctx)?;
        let id = self.id(match image {
            Image::Single(image) => Request::ModuleLoad { ctx: remote, image },
            Image::Linked(images) => Request::ModuleLink {
                ctx: remote,
                images,
            },
        })?;
        let h = self.handle(Kind::Module);
        self.objects.insert(h, (ctx, id));
        Ok(h)
    }

    /// What a completed link produced, named by its token.
    pub fn linked_image(&self, token: &[u8; 16]) -> CuResult<Image> {
        let link = self
            .links
            .values()
            .find(|l| l.completed.as_deref() == Some(token))
            .ok_or(CUDA_ERROR_INVALID_IMAGE)?;
        Ok(Image::Linked(link.images.clone()))
    }

    pub fn module_unload(&mut self, ctx: u64, module: u64) -> CuResult<()> {
        let id = self.object(ctx, Kind::Module, module)?;
        let remote = self.remote(ctx)?;
        self.objects.remove(&module);
        self.done(Request::ModuleUnload {
            ctx: remote,
            module: ModuleId(id),
        })
    }

    /// The context a module handle belongs to.
    pub fn module_context(&self, module: u64) -> CuResult<u64> {
        match self.objects.get(&module) {
            Some(&(ctx, _)) if module >> KIND_SHIFT == Kind::Module as u64 => Ok(ctx),
            _ => Err(CUDA_ERROR_INVALID_HANDLE),
        }
    }

    pub fn function(&mut self, module: u64, name: &str) -> CuResult<u64> {
        let ctx = self.module_context(module)?;
        let id = self.object(ctx, Kind::Module, module)?;
        let remote = self.remote(ctx)?;
        let (fid, params) = match self.call(Request::Function {
            ctx: remote,
            module: ModuleId(id),
            name: name.to_string(),
        })? {
            Reply::Function { id, params } => (id, params),
            _ => return Err(CUDA_ERROR_UNKNOWN),
        };
        let h = self.handle(Kind::Function);
        self.functions.insert(
            h,
            Function {
                ctx,
                remote: fid,
                params,
                attributes: None,
                settings: FunctionSettings::default(),
                legacy: LegacyLaunch::default(),
            },
        );
        Ok(h)
    }

    /// A function's parameter layout.
    /// The function's attributes on the host's backend (its registers, sizes).
    pub fn function_attributes(&mut self, function: u64) -> CuResult<FunctionAttributes> {
        let f = self
            .functions
            .get(&function)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if let Some(a) = f.attributes {
            return Ok(a);
        }
        let (ctx, id) = (f.ctx, f.remote);
        let remote = self.remote(ctx)?;
        let a = match self.call(Request::FunctionAttributes {
            ctx: remote,
            function: id,
        })? {
            Reply::FunctionAttributes(a) => a,
            _ => return Err(CUDA_ERROR_UNKNOWN),
        };
        if let Some(f) = self.functions.get_mut(&function) {
            f.attributes = Some(a);
        }
        Ok(a)
    }

    /// What the program set on the function.
    pub fn function_settings(&self, function: u64) -> CuResult<FunctionSettings> {
        self.functions
            .get(&function)
            .map(|f| f.settings)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// `cuFuncSetAttribute`, checked against the function's attributes and the device.
    pub fn set_function_attribute(
        &mut self,
        function: u64,
        attribute: i32,
        value: i32,
    ) -> CuResult<()> {
        let a = self.function_attributes(function)?;
        let device = self.attributes.clone();
        let f = self
            .functions
            .get_mut(&function)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        attributes::set_function_attribute(attribute, value, &a, &mut f.settings, &device)
    }

    /// The deprecated launch API's state of a function, to change.
    pub fn legacy_launch(&mut self, function: u64) -> CuResult<&mut LegacyLaunch> {
        self.functions
            .get_mut(&function)
            .map(|f| &mut f.legacy)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    pub fn params(&self, function: u64) -> CuResult<&[ParamInfo]> {
        self.functions
            .get(&function)
            .map(|f| f.params.as_slice())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    pub fn global(&mut self, module: u64, name: &str) -> CuResult<(u64, u64)> {
        let ctx = self.module_context(module)?;
        let id = self.object(ctx, Kind::Module, module)?;
        let remote = self.remote(ctx)?;
        match self.call(Request::Global {
            ctx: remote,
            module: ModuleId(id),
            name: name.to_string(),
        })? {
            Reply::Global { addr, size } => {
                // Copies to module variables are checked like those to allocations.
                let id = self.next_buffer_id();
                if size > 0
                    && let Some(c) = self.contexts.get_mut(&ctx)
                {
                    c.allocations.insert(addr, size);
                    c.buffer_ids.entry(addr).or_insert(id);
                }
                Ok((addr, size))
            }
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }

    // Libraries and their kernels.

    /// A library; with a context, its module is loaded there at once, so a bad image fails
    /// the call that brought it.
    pub fn library_load(&mut self, image: Image, ctx: Option<u64>) -> CuResult<u64> {
        let mut modules = HashMap::new();
        if let Some(ctx) = ctx {
            modules.insert(ctx, self.module_load(ctx, image.clone())?);
        }
        let h = self.handle(Kind::Library);
        self.libraries.insert(h, Library { image, modules });
        Ok(h)
    }

    /// The library's module in `ctx`, loaded at the context's first use.
    pub fn library_module(&mut self, library: u64, ctx: u64) -> CuResult<u64> {
        let lib = self
            .libraries
            .get(&library)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        // A module of a context destroyed since is gone from `objects`.
        if let Some(&m) = lib.modules.get(&ctx)
            && self.objects.contains_key(&m)
        {
            return Ok(m);
        }
        let image = lib.image.clone();
        let m = self.module_load(ctx, image)?;
        if let Some(lib) = self.libraries.get_mut(&library) {
            lib.modules.insert(ctx, m);
        }
        Ok(m)
    }

    /// Unloads the library from every context it was loaded into; its kernels go with it.
    pub fn library_unload(&mut self, library: u64) -> CuResult<()> {
        let lib = self
            .libraries
            .remove(&library)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        self.kernels.retain(|_, k| k.library != library);
        for (ctx, module) in lib.modules {
            if self.objects.contains_key(&module) {
                self.module_unload(ctx, module)?;
            }
        }
        Ok(())
    }

    /// A kernel of the library; with a context, its function is looked up there at once, so
    /// an unknown name fails this call.
    pub fn kernel(&mut self, library: u64, name: &str, ctx: Option<u64>) -> CuResult<u64> {
        if !self.libraries.contains_key(&library) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let h = self.handle(Kind::Kernel);
        self.kernels.insert(
            h,
            Kernel {
                library,
                name: name.to_string(),
                functions: HashMap::new(),
            },
        );
        if let Some(ctx) = ctx
            && let Err(e) = self.kernel_function(h, ctx)
        {
            self.kernels.remove(&h);
            return Err(e);
        }
        Ok(h)
    }

    /// The kernel's function in `ctx`.
    pub fn kernel_function(&mut self, kernel: u64, ctx: u64) -> CuResult<u64> {
        let k = self.kernels.get(&kernel).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if let Some(&f) = k.functions.get(&ctx)
            && self.functions.contains_key(&f)
        {
            return Ok(f);
        }
        let (library, name) = (k.library, k.name.clone());
        let module = self.library_module(library, ctx)?;
        let f = self.function(module, &name)?;
        if let Some(k) = self.kernels.get_mut(&kernel) {
            k.functions.insert(ctx, f);
        }
        Ok(f)
    }

    /// The function a `CUfunction` argument means: itself, or for a kernel handle (CUDA 12
    /// lets one stand for a function) the kernel's function in the current context.
    pub fn resolve_function(&mut self, handle: u64, current: Option<u64>) -> CuResult<u64> {
        if handle >> KIND_SHIFT == Kind::Kernel as u64 {
            self.kernel_function(handle, current.ok_or(CUDA_ERROR_INVALID_CONTEXT)?)
        } else {
            Ok(handle)
        }
    }

    /// A library variable's address and size in `ctx`.
    pub fn library_global(&mut self, library: u64, name: &str, ctx: u64) -> CuResult<(u64, u64)> {
        let module = self.library_module(library, ctx)?;
        self.global(module, name)
    }

    // Linking: kept in the guest until the module is loaded.

    pub fn link_create(&mut self) -> u64 {
        let h = self.handle(Kind::Link);
        self.links.insert(h, Link::default());
        h
    }

    pub fn link(&mut self, link: u64) -> CuResult<&mut Link> {
        self.links.get_mut(&link).ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// Completes a link: its token, which lives until `link_destroy`.
    pub fn link_complete(&mut self, link: u64) -> CuResult<&[u8; 16]> {
        let l = self.links.get_mut(&link).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if l.images.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut token = [0u8; 16];
        token[..8].copy_from_slice(LINK_TOKEN_MAGIC);
        token[8..].copy_from_slice(&link.to_le_bytes());
        Ok(l.completed.insert(Box::new(token)))
    }

    pub fn link_destroy(&mut self, link: u64) -> CuResult<()> {
        self.links
            .remove(&link)
            .map(drop)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    // Memory.

    pub fn mem_alloc(&mut self, ctx: u64, bytes: u64) -> CuResult<u64> {
        let remote = self.remote(ctx)?;
        let addr = match self.call(Request::MemAlloc { ctx: remote, bytes })? {
            Reply::Address(a) => a,
            _ => return Err(CUDA_ERROR_UNKNOWN),
        };
        let id = self.next_buffer_id();
        if let Some(c) = self.contexts.get_mut(&ctx) {
            c.allocations.insert(addr, bytes);
            c.buffer_ids.insert(addr, id);
        }
        Ok(addr)
    }

    pub fn mem_free(&mut self, ctx: u64, addr: u64) -> CuResult<()> {
        let remote = self.remote(ctx)?;
        self.done(Request::MemFree { ctx: remote, addr })?;
        if let Some(c) = self.contexts.get_mut(&ctx) {
            c.allocations.remove(&addr);
            c.buffer_ids.remove(&addr);
        }
        Ok(())
    }

    /// `cuMemGetInfo` of the context: `(free, total)` as the host counts them (its limit and
    /// its VM's budget).
    pub fn mem_info(&mut self, ctx: u64) -> CuResult<(u64, u64)> {
        let remote = self.remote(ctx)?;
        match self.call(Request::MemInfo { ctx: remote })? {
            Reply::MemInfo { free, total } => Ok((free, total)),
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }

    /// The VM's device time: `(busy, elapsed)` nanoseconds since one origin
    /// ([`Request::Usage`]); two samples give its utilisation between them.
    pub fn usage(&mut self) -> CuResult<(u64, u64)> {
        match self.call(Request::Usage)? {
            Reply::Usage {
                busy_ns,
                elapsed_ns,
            } => Ok((busy_ns, elapsed_ns)),
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }

    fn next_buffer_id(&mut self) -> u64 {
        self.last_buffer_id += 1;
        self.last_buffer_id
    }

    /// Where the host views of shadowed ranges are read and written (`api.rs`).
    pub fn with_host_view(mut self, v: Box<dyn HostView>) -> Self {
        self.host_view = Some(v);
        self
    }

    /// A device allocation for managed memory of `bytes`: (the page-aligned address the range
    /// starts at, the allocation). The allocation has a page to spare, so the pages of the
    /// host view, `[address, address + bytes rounded to pages)`, lie inside it.
    pub fn managed_reserve(&mut self, ctx: u64, bytes: u64, page: u64) -> CuResult<(u64, u64)> {
        let len = bytes
            .checked_next_multiple_of(page)
            .and_then(|l| l.checked_add(page))
            .filter(|_| bytes > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if self.shadow_bytes.saturating_add(len) > self.attributes.total_memory {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let alloc = self.mem_alloc(ctx, len)?;
        let addr = alloc.next_multiple_of(page);
        // The range is known by its own start (cuMemGetAddressRange, copies' checks).
        self.move_allocation(ctx, alloc, addr);
        Ok((addr, alloc))
    }

    /// Moves the record of the allocation starting at `from` to start at `to` inside it (or
    /// back), keeping its end and buffer id.
    fn move_allocation(&mut self, ctx: u64, from: u64, to: u64) {
        if let Some(c) = self.contexts.get_mut(&ctx)
            && let Some(size) = c.allocations.remove(&from)
        {
            let end = from + size;
            c.allocations.insert(to, end - to);
            if let Some(id) = c.buffer_ids.remove(&from) {
                c.buffer_ids.insert(to, id);
            }
        }
    }

    /// Starts keeping `[device, device + size)` of allocation `alloc` coherent with the host
    /// view at `host` (the same address for managed memory and mapped memory in a context's
    /// window): the host view's contents go to the device now. The total is bounded by the
    /// device's memory.
    pub fn shadow_create(&mut self, s: ShadowInfo) -> CuResult<()> {
        self.ctx(s.ctx)?;
        if self.host_view.is_none() || s.size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let total = self
            .shadow_bytes
            .checked_add(s.size)
            .filter(|&t| t <= self.attributes.total_memory)
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let ends = |a: u64| a.checked_add(s.size).ok_or(CUDA_ERROR_INVALID_VALUE);
        let (device_end, host_end) = (ends(s.device)?, ends(s.host)?);
        let taken = self
            .shadows
            .range(..device_end)
            .next_back()
            .is_some_and(|(&d, o)| d + o.size > s.device)
            || self
                .shadows
                .values()
                .any(|o| o.host < host_end && s.host < o.host + o.size);
        if taken {
            return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
        }
        // Flush what is pending first: it ran before the range was shadowed.
        self.flush()?;
        self.shadows.insert(
            s.device,
            Shadow {
                ctx: s.ctx,
                host: s.host,
                size: s.size,
                alloc: s.alloc,
                clean: Vec::new(),
                managed: s.managed,
            },
        );
        self.shadow_bytes = total;
        self.upload_shadows()
    }

    /// Stops shadowing the range that starts at `device` (or whose host view starts at
    /// `host`), after bringing the device's contents back: what it was.
    pub fn shadow_release(
        &mut self,
        device: Option<u64>,
        host: Option<u64>,
    ) -> CuResult<Option<ShadowInfo>> {
        let key = self
            .shadows
            .iter()
            .find(|(d, s)| Some(**d) == device || Some(s.host) == host)
            .map(|(&d, _)| d);
        let Some(key) = key else {
            return Ok(None);
        };
        self.flush()?;
        self.download_shadows()?;
        let s = self.shadows.remove(&key).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        self.shadow_bytes -= s.size;
        if s.host == key {
            self.move_allocation(s.ctx, key, s.alloc);
        }
        Ok(Some(s.info(key)))
    }

    /// The shadowed range holding `addr` on the device side or, with `host`, on the host side.
    pub fn shadow_at(&self, addr: u64, host: bool) -> Option<ShadowInfo> {
        self.shadows.iter().find_map(|(&device, s)| {
            let start = if host { s.host } else { device };
            (addr >= start && addr - start < s.size).then(|| s.info(device))
        })
    }

    /// Whether `req` may write a shadowed range on the device: a launch may write anything, a
    /// copy or memset where its destination meets one; reads, waits and bookkeeping write
    /// none.
    fn writes_shadows(&self, req: &Request) -> bool {
        let meets = |addr, len| self.meets_shadows(addr, len);
        match req {
            Request::Batch(items) => items.iter().any(|r| self.writes_shadows(r)),
            Request::CopyHtoD { dst, data, .. } => meets(*dst, data.len() as u64),
            Request::CopyDtoD { dst, bytes, .. } => meets(*dst, *bytes),
            Request::MemsetD8 { addr, count, .. } => meets(*addr, *count),
            Request::MemsetD32 { addr, count, .. } => meets(*addr, count.saturating_mul(4)),
            Request::CopyDtoH { .. } => false,
            r => touches_device(r),
        }
    }

    /// Whether device range `[addr, addr + len)` meets a shadowed range.
    fn meets_shadows(&self, addr: u64, len: u64) -> bool {
        let end = addr.saturating_add(len);
        self.shadows
            .iter()
            .any(|(&d, s)| d < end && addr < d.saturating_add(s.size))
    }

    /// Sends the chunks of each host view that changed since it was last made coherent.
    fn upload_shadows(&mut self) -> CuResult<()> {
        let Some(view) = self.host_view.take() else {
            return Ok(());
        };
        let r = self.upload_with(view.as_ref());
        self.host_view = Some(view);
        r
    }

    fn upload_with(&mut self, view: &dyn HostView) -> CuResult<()> {
        let keys: Vec<u64> = self.shadows.keys().copied().collect();
        // One chunk of a host view at a time: a range is never copied whole.
        let mut now = vec![0u8; COHERENCE_CHUNK];
        for device in keys {
            let Some(info) = self.shadows.get(&device).map(|s| s.info(device)) else {
                continue;
            };
            let remote = self.remote(info.ctx)?;
            let mut clean = self
                .shadows
                .get_mut(&device)
                .map(|s| std::mem::take(&mut s.clean))
                .unwrap_or_default();
            let r = self.upload_range(view, remote, info, &mut clean, &mut now);
            if let Some(s) = self.shadows.get_mut(&device) {
                s.clean = clean;
            }
            r?;
        }
        Ok(())
    }

    /// Sends the chunks of the host view of shadow `s` that differ from `clean`, its contents
    /// when last coherent (empty: never, all go), in batches; `clean` becomes the host view's
    /// contents. `now` is a chunk's room.
    fn upload_range(
        &mut self,
        view: &dyn HostView,
        remote: ContextId,
        s: ShadowInfo,
        clean: &mut Vec<u8>,
        now: &mut [u8],
    ) -> CuResult<()> {
        let (device, host, size) = (s.device, s.host, s.size as usize);
        let first = clean.is_empty();
        if first {
            *clean = vec![0u8; size];
        }
        // Both sides may have written since the range was last coherent (the host touched it
        // while device work was pending, which CUDA leaves undefined without concurrent
        // managed access): the device's bytes are kept where the host left them alone; a
        // byte both changed is refused.
        let merge = self.device_touched && !first;
        let mut batch = Vec::new();
        let mut batch_bytes = 0;
        for at in (0..size).step_by(COHERENCE_CHUNK) {
            let end = (at + COHERENCE_CHUNK).min(size);
            let now = &mut now[..end - at];
            view.read(host + at as u64, now);
            if !first && clean[at..end] == *now {
                continue;
            }
            if merge {
                if let Err(e) = self.merge(remote, device + at as u64, &clean[at..end], now) {
                    // The chunks merged before it still go: their clean copies say they went.
                    self.send_batch(batch)?;
                    return Err(e);
                }
                view.write(host + at as u64, now);
            }
            clean[at..end].copy_from_slice(now);
            if batch.len() >= MAX_BATCH || batch_bytes + now.len() > MAX_PENDING_BYTES {
                self.send_batch(std::mem::take(&mut batch))?;
                batch_bytes = 0;
            }
            batch_bytes += now.len();
            batch.push(Request::CopyHtoD {
                ctx: remote,
                dst: device + at as u64,
                data: now.to_vec(),
                stream: StreamId(0),
            });
        }
        self.send_batch(batch)
    }

    /// Sends `items` as one batch (nothing when empty), past the shadows: its first failure
    /// is the result.
    fn send_batch(&mut self, items: Vec<Request>) -> CuResult<()> {
        if items.is_empty() {
            return Ok(());
        }
        let reply = self.exchange(&Request::Batch(items))?;
        self.batch_result(reply)
    }

    /// A batch's reply: its printf output written out, its first failure (kept as the host's
    /// last error) the result.
    fn batch_result(&mut self, reply: Reply) -> CuResult<()> {
        match reply {
            Reply::Batch { output, error, .. } => {
                if !output.is_empty() {
                    let _ = self.output.write_all(output.as_bytes());
                    let _ = self.output.flush();
                }
                error.map_or(Ok(()), |(status, message)| {
                    let status = status.max(1);
                    self.host_error = Some((status, message));
                    Err(status)
                })
            }
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }

    /// Merges the device's contents at `device` into `now`, the host's changed chunk whose
    /// contents when last coherent were `clean`: bytes the host did not change take the
    /// device's; `CUDA_ERROR_ILLEGAL_STATE` where both changed one byte (even to one value: two
    /// read-modify-writes of one word, as concurrent atomics do, would otherwise count once).
    fn merge(
        &mut self,
        remote: ContextId,
        device: u64,
        clean: &[u8],
        now: &mut [u8],
    ) -> CuResult<()> {
        let theirs = match self.exchange(&Request::CopyDtoH {
            ctx: remote,
            src: device,
            bytes: now.len() as u64,
            stream: StreamId(0),
        })? {
            Reply::Data(d) if d.len() == now.len() => d,
            _ => return Err(CUDA_ERROR_UNKNOWN),
        };
        for ((mine, &base), &d) in now.iter_mut().zip(clean).zip(&theirs) {
            match (*mine != base, d != base) {
                (true, true) => return Err(CUDA_ERROR_ILLEGAL_STATE),
                (false, true) => *mine = d,
                _ => {}
            }
        }
        Ok(())
    }

    /// Brings every shadowed range's device contents back to its host view, when device work
    /// was sent since the last time.
    fn download_shadows(&mut self) -> CuResult<()> {
        if !self.device_touched {
            return Ok(());
        }
        let Some(view) = self.host_view.take() else {
            return Ok(());
        };
        let r = self.download_with(view.as_ref());
        self.host_view = Some(view);
        r
    }

    fn download_with(&mut self, view: &dyn HostView) -> CuResult<()> {
        let keys: Vec<u64> = self.shadows.keys().copied().collect();
        for device in keys {
            let (ctx, host, size) = match self.shadows.get(&device) {
                Some(s) => (s.ctx, s.host, s.size),
                None => continue,
            };
            let remote = self.remote(ctx)?;
            // The device's contents land in the range's clean copy, kept allocated.
            let mut data = self
                .shadows
                .get_mut(&device)
                .map(|s| std::mem::take(&mut s.clean))
                .unwrap_or_default();
            data.resize(size as usize, 0);
            let mut at = 0;
            let mut r = Ok(());
            while at < size && r.is_ok() {
                let n = (size - at).min(MAX_COPY_BYTES);
                r = match self.exchange(&Request::CopyDtoH {
                    ctx: remote,
                    src: device + at,
                    bytes: n,
                    stream: StreamId(0),
                }) {
                    Ok(Reply::Data(d)) if d.len() as u64 == n => {
                        data[at as usize..(at + n) as usize].copy_from_slice(&d);
                        Ok(())
                    }
                    Ok(_) => Err(CUDA_ERROR_UNKNOWN),
                    Err(e) => Err(e),
                };
                at += n;
            }
            if r.is_ok() {
                view.write(host, &data);
            } else {
                // Not coherent: the next upload sends the whole host view.
                data.clear();
            }
            if let Some(s) = self.shadows.get_mut(&device) {
                s.clean = data;
            }
            r?;
        }
        self.device_touched = false;
        Ok(())
    }

    /// Page-locked memory of `bytes` shared with the host (`cuMemAllocHost`,
    /// `cuMemHostAlloc`), recorded as allocated in `ctx` with `flags`: its address, or `None`
    /// where the transport shares no memory with the host. The host's refusal (its limit, the
    /// budget: `CUDA_ERROR_OUT_OF_MEMORY`) is the result.
    pub fn pinned_alloc(&mut self, ctx: u64, bytes: u64, flags: u32) -> CuResult<Option<u64>> {
        self.ctx(ctx)?;
        let r = match self.t.pinned() {
            Some(p) => p.alloc(bytes),
            None => return Ok(None),
        };
        let Some(start) = self.pinned_record(r)? else {
            return Ok(None);
        };
        if let Err(e) = self.host_memory_add(start, bytes, flags, ctx, false) {
            self.pinned_free(start)?;
            return Err(e);
        }
        Ok(Some(start))
    }

    /// Makes the host view of `[start, start + bytes)` (mapped page-locked memory in a
    /// context's window, whose pages `bytes` covers) memory shared with the host: a memory
    /// file that `place` maps over the view's pages. Whether it is (not where the transport
    /// shares no memory); the host's refusal is the result.
    pub fn pinned_share(
        &mut self,
        start: u64,
        bytes: u64,
        place: impl FnOnce(std::os::fd::BorrowedFd<'_>) -> std::io::Result<()>,
    ) -> CuResult<bool> {
        let r = match self.t.pinned() {
            Some(p) => p.alloc_at(start, bytes, place),
            None => return Ok(false),
        };
        Ok(self.pinned_record(r)?.is_some())
    }

    /// Keeps the allocation the host took: its start.
    fn pinned_record(
        &mut self,
        r: Result<Result<PinnedMemory, Reply>, TransportError>,
    ) -> CuResult<Option<u64>> {
        let memory = match r {
            Ok(Ok(m)) => m,
            Ok(Err(reply)) => return self.answer(Ok(reply)).and(Err(CUDA_ERROR_UNKNOWN)),
            Err(e) => return self.answer(Err(e)).and(Err(CUDA_ERROR_UNKNOWN)),
        };
        let start = memory.start();
        self.pinned.insert(start, memory);
        Ok(Some(start))
    }

    /// Gives the page-locked allocation at `start` back to the host and unmaps it: whether
    /// there was one.
    pub fn pinned_free(&mut self, start: u64) -> CuResult<bool> {
        let Some(memory) = self.pinned.remove(&start) else {
            return Ok(false);
        };
        let r = match self.t.pinned() {
            Some(p) => p.free(memory),
            None => return Err(CUDA_ERROR_UNKNOWN),
        };
        match self.answer(r)? {
            Reply::Done => Ok(true),
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }

    /// A copy between `[host, host + bytes)`, which must lie wholly in a page-locked
    /// allocation shared with the host, and device memory at `device`: to the device with
    /// `to_device`, else from it.
    pub fn copy_pinned(
        &mut self,
        ctx: u64,
        host: u64,
        bytes: u64,
        device: u64,
        stream: u64,
        to_device: bool,
    ) -> CuResult<()> {
        let (remote, stream) = (self.remote(ctx)?, self.stream(ctx, stream)?);
        self.pinned_copy(remote, stream, host, bytes, device, to_device)
            .unwrap_or(Err(CUDA_ERROR_INVALID_VALUE))
    }

    /// A copy whose host side `[host, host + bytes)` lies wholly in a page-locked allocation
    /// shared with the host: one message, the host copying between the allocation and device
    /// memory at `device`, after the deferred work (in stream order) and answered once done,
    /// so the range is the program's again when this returns. `None` where it does not lie
    /// in one.
    #[allow(clippy::too_many_arguments)]
    fn pinned_copy(
        &mut self,
        remote: ContextId,
        stream: StreamId,
        host: u64,
        bytes: u64,
        device: u64,
        to_device: bool,
    ) -> Option<CuResult<()>> {
        let (&start, memory) = self.pinned.range(..=host).next_back()?;
        let offset = memory.offset_of(host, bytes).filter(|_| bytes > 0)?;
        Some((|| {
            self.flush()?;
            // Shadowed ranges stay coherent: a copy reading one's device side sees the host
            // view's changes, one writing it brings it back at the next synchronisation.
            if to_device {
                self.device_touched |= self.meets_shadows(device, bytes);
            } else if self.meets_shadows(device, bytes) {
                self.upload_shadows()?;
            }
            let memory = self.pinned.get(&start).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let Some(p) = self.t.pinned() else {
                return Err(CUDA_ERROR_UNKNOWN);
            };
            let r = p.copy(memory, remote, stream, to_device, device, offset, bytes);
            match self.answer(r)? {
                Reply::Done if to_device => Ok(()),
                Reply::Done => self.shadow_written(remote, stream, host, bytes, device),
                _ => Err(CUDA_ERROR_UNKNOWN),
            }
        })())
    }

    /// After the host wrote `[host, host + bytes)` from device address `src`: where that lies
    /// in a shadowed host view (mapped page-locked memory), its device side gets the same
    /// bytes, copied by the host, and the view's clean copy takes them, so nothing is sent
    /// back up and nothing has to come back.
    fn shadow_written(
        &mut self,
        remote: ContextId,
        stream: StreamId,
        host: u64,
        bytes: u64,
        src: u64,
    ) -> CuResult<()> {
        let Some(s) = self.shadow_at(host, true) else {
            return Ok(());
        };
        let offset = host - s.host;
        if offset.checked_add(bytes).is_none_or(|e| e > s.size) {
            return Ok(());
        }
        // Past the shadows' bookkeeping: this makes the device side what the view holds, so
        // nothing has to come back at the next synchronisation.
        self.send_batch(vec![Request::CopyDtoD {
            ctx: remote,
            dst: s.device + offset,
            src,
            bytes,
            stream,
        }])?;
        let Some(view) = self.host_view.take() else {
            return Ok(());
        };
        if let Some(clean) = self
            .shadows
            .get_mut(&s.device)
            .map(|o| &mut o.clean)
            .filter(|c| c.len() as u64 == s.size)
        {
            // Within the shadow's size, checked above.
            let at = offset as usize;
            view.read(host, &mut clean[at..at + bytes as usize]);
        }
        self.host_view = Some(view);
        Ok(())
    }

    /// The page-locked host range holding `addr`: (start, what it is).
    fn host_range(&self, addr: u64) -> Option<(u64, HostMemory)> {
        self.host_memory
            .range(..=addr)
            .next_back()
            .filter(|&(&start, m)| addr - start < m.size)
            .map(|(&start, &m)| (start, m))
    }

    /// Records page-locked host memory at `[start, start + size)`: refused where it overlaps
    /// a range already recorded (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`), or past
    /// [`MAX_HOST_RANGES`].
    pub fn host_memory_add(
        &mut self,
        start: u64,
        size: u64,
        flags: u32,
        ctx: u64,
        registered: bool,
    ) -> CuResult<()> {
        self.ctx(ctx)?;
        let end = start
            .checked_add(size)
            .filter(|_| size > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let overlaps =
            self.host_range(start).is_some() || self.host_memory.range(start..end).next().is_some();
        if overlaps {
            return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
        }
        if self.host_memory.len() >= MAX_HOST_RANGES {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let buffer_id = self.next_buffer_id();
        self.host_memory.insert(
            start,
            HostMemory {
                size,
                flags,
                ctx,
                registered,
                buffer_id,
            },
        );
        Ok(())
    }

    /// Forgets the page-locked host memory starting at `start`, allocated (`registered`
    /// false) or registered: its record, or `CUDA_ERROR_INVALID_VALUE` /
    /// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED` when there is none of that kind.
    pub fn host_memory_remove(&mut self, start: u64, registered: bool) -> CuResult<HostMemory> {
        match self.host_memory.get(&start) {
            Some(m) if m.registered == registered => {
                let m = *m;
                self.host_memory.remove(&start);
                Ok(m)
            }
            _ if registered => Err(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

    /// The page-locked host memory holding `addr`, if any.
    pub fn host_memory(&self, addr: u64) -> Option<HostMemory> {
        self.host_range(addr).map(|(_, m)| m)
    }

    /// What `addr` is: managed memory, page-locked host memory (mapped or not), or device
    /// memory of any context.
    pub fn pointer_info(&self, addr: u64) -> Option<PointerInfo> {
        if let Some(s) = self.shadow_at(addr, false).filter(|s| s.managed) {
            let buffer_id = self
                .contexts
                .get(&s.ctx)
                .and_then(|c| c.buffer_ids.get(&s.device))
                .copied()
                .unwrap_or(0);
            return Some(PointerInfo::Device {
                ctx: s.ctx,
                start: s.device,
                size: s.size,
                buffer_id,
                managed: true,
            });
        }
        if let Some((start, memory)) = self.host_range(addr) {
            let device = self
                .shadow_at(start, true)
                .map(|s| s.device + (start - s.host));
            return Some(PointerInfo::Host {
                start,
                memory,
                device,
            });
        }
        for (&ctx, c) in &self.contexts {
            if let Some((&start, &size)) = c.allocations.range(..=addr).next_back()
                && addr - start < size
            {
                return Some(PointerInfo::Device {
                    ctx,
                    start,
                    size,
                    buffer_id: c.buffer_ids.get(&start).copied().unwrap_or(0),
                    managed: false,
                });
            }
        }
        None
    }

    /// The allocation holding `addr`: (start, size).
    pub fn address_range(&self, ctx: u64, addr: u64) -> CuResult<(u64, u64)> {
        let c = self.ctx(ctx)?;
        c.allocations
            .range(..=addr)
            .next_back()
            .filter(|&(&start, &size)| addr - start < size)
            .map(|(&s, &n)| (s, n))
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// Whether `[addr, addr + bytes)` lies in one device allocation of `ctx`.
    pub fn is_device(&self, ctx: u64, addr: u64, bytes: u64) -> bool {
        self.address_range(ctx, addr)
            .is_ok_and(|(s, n)| addr - s <= n && bytes <= n - (addr - s))
    }

    pub fn memset_d8(
        &mut self,
        ctx: u64,
        addr: u64,
        value: u8,
        count: u64,
        stream: u64,
    ) -> CuResult<()> {
        let (remote, stream) = (self.remote(ctx)?, self.stream(ctx, stream)?);
        let checked = self.is_device(ctx, addr, count);
        self.defer_if(
            checked,
            Request::MemsetD8 {
                ctx: remote,
                addr,
                value,
                count,
                stream,
            },
        )
    }

    pub fn memset_d32(
        &mut self,
        ctx: u64,
        addr: u64,
        value: u32,
        count: u64,
        stream: u64,
    ) -> CuResult<()> {
        let (remote, stream) = (self.remote(ctx)?, self.stream(ctx, stream)?);
        let checked = count
            .checked_mul(4)
            .is_some_and(|n| self.is_device(ctx, addr, n));
        self.defer_if(
            checked,
            Request::MemsetD32 {
                ctx: remote,
                addr,
                value,
                count,
                stream,
            },
        )
    }

    /// A copy of `bytes` through the region the transport shares with the host, after the
    /// deferred work: `None` where it goes in messages instead (no region, a copy under
    /// [`MIN_SHARED_COPY_BYTES`], or shadowed ranges, which the messages' path keeps
    /// coherent).
    fn shared_copy(
        &mut self,
        bytes: usize,
        copy: impl FnOnce(Shared<'_>) -> Result<Reply, TransportError>,
    ) -> Option<CuResult<()>> {
        if bytes < MIN_SHARED_COPY_BYTES || !self.shadows.is_empty() {
            return None;
        }
        self.t.shared()?;
        Some(self.flush().and_then(|()| {
            let Some(shared) = self.t.shared() else {
                return Err(CUDA_ERROR_UNKNOWN);
            };
            let r = copy(shared);
            match self.answer(r)? {
                Reply::Done => Ok(()),
                _ => Err(CUDA_ERROR_UNKNOWN),
            }
        }))
    }

    /// Host to device: from a page-locked allocation shared with the host, by the host;
    /// else through the region shared with the host where there is one, else in messages of
    /// at most [`MAX_COPY_BYTES`].
    pub fn copy_htod(&mut self, ctx: u64, dst: u64, src: &[u8], stream: u64) -> CuResult<()> {
        let (remote, stream) = (self.remote(ctx)?, self.stream(ctx, stream)?);
        let (host, bytes) = (src.as_ptr() as u64, src.len() as u64);
        if let Some(r) = self.pinned_copy(remote, stream, host, bytes, dst, true) {
            return r;
        }
        if let Some(r) = self.shared_copy(src.len(), |s| s.htod(remote, dst, src, stream)) {
            return r;
        }
        let mut at = dst;
        for chunk in src.chunks(MAX_COPY_BYTES as usize) {
            let checked = self.is_device(ctx, at, chunk.len() as u64);
            self.defer_if(
                checked,
                Request::CopyHtoD {
                    ctx: remote,
                    dst: at,
                    data: chunk.to_vec(),
                    stream,
                },
            )?;
            at = at
                .checked_add(chunk.len() as u64)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        }
        Ok(())
    }

    /// Device to host: into a page-locked allocation shared with the host, by the host;
    /// else through the region shared with the host where there is one, else in messages of
    /// at most [`MAX_COPY_BYTES`]. The first message makes the shadowed ranges
    /// coherent; nothing runs between it and the rest but this copy, whose writes into a host
    /// view go up with the next device work.
    pub fn copy_dtoh(&mut self, ctx: u64, dst: &mut [u8], src: u64, stream: u64) -> CuResult<()> {
        let (remote, stream) = (self.remote(ctx)?, self.stream(ctx, stream)?);
        let (host, bytes) = (dst.as_ptr() as u64, dst.len() as u64);
        if let Some(r) = self.pinned_copy(remote, stream, host, bytes, src, false) {
            return r;
        }
        if let Some(s) = self.shadow_holding(ctx, dst.as_ptr() as u64, dst.len() as u64) {
            return self.copy_into_shadow(remote, stream, s, dst.as_ptr() as u64, src, dst.len());
        }
        let bytes = dst.len();
        if let Some(r) = self.shared_copy(bytes, |s| s.dtoh(remote, dst, src, stream)) {
            return r;
        }
        let mut at = src;
        for (i, chunk) in dst.chunks_mut(MAX_COPY_BYTES as usize).enumerate() {
            let req = Request::CopyDtoH {
                ctx: remote,
                src: at,
                bytes: chunk.len() as u64,
                stream,
            };
            let reply = if i == 0 {
                self.call(req)?
            } else {
                self.exchange(&req)?
            };
            match reply {
                Reply::Data(d) if d.len() == chunk.len() => chunk.copy_from_slice(&d),
                _ => return Err(CUDA_ERROR_UNKNOWN),
            }
            at = at
                .checked_add(chunk.len() as u64)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        }
        Ok(())
    }

    /// The shadowed range of context `ctx` whose host view holds all of `[host, host +
    /// bytes)`.
    fn shadow_holding(&self, ctx: u64, host: u64, bytes: u64) -> Option<ShadowInfo> {
        self.shadow_at(host, true).filter(|s| {
            s.ctx == ctx
                && bytes > 0
                && (host - s.host)
                    .checked_add(bytes)
                    .is_some_and(|e| e <= s.size)
        })
    }

    /// Device to host where the destination lies in a shadowed host view `s` (mapped
    /// page-locked memory, managed memory): the copy is made on the host into the view's device
    /// side, then comes back through the view, which stays coherent (its clean copy too, so
    /// the next upload does not send it back up). When device work may have written the
    /// shadows, all of them come back, as after any synchronisation; else only the bytes this
    /// copy wrote.
    fn copy_into_shadow(
        &mut self,
        remote: ContextId,
        stream: StreamId,
        s: ShadowInfo,
        host: u64,
        src: u64,
        bytes: usize,
    ) -> CuResult<()> {
        let offset = host - s.host;
        self.flush()?;
        // The host's changes go first where the copy reads a shadow's device side, or where
        // all shadows come back after it; else they wait for the next device work.
        if self.device_touched || self.meets_shadows(src, bytes as u64) {
            self.upload_shadows()?;
        }
        self.send_batch(vec![
            Request::CopyDtoD {
                ctx: remote,
                dst: s.device + offset,
                src,
                bytes: bytes as u64,
                stream,
            },
            Request::StreamSynchronize {
                ctx: remote,
                stream,
            },
        ])?;
        if self.device_touched {
            return self.download_shadows();
        }
        let Some(view) = self.host_view.take() else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        let r = self.read_back(view.as_ref(), remote, s, offset, bytes as u64);
        self.host_view = Some(view);
        r
    }

    /// Brings `[offset, offset + bytes)` of shadow `s` from the device to its host view and
    /// its clean copy.
    fn read_back(
        &mut self,
        view: &dyn HostView,
        remote: ContextId,
        s: ShadowInfo,
        offset: u64,
        bytes: u64,
    ) -> CuResult<()> {
        let mut at = 0;
        while at < bytes {
            let n = (bytes - at).min(MAX_COPY_BYTES);
            let data = match self.exchange(&Request::CopyDtoH {
                ctx: remote,
                src: s.device + offset + at,
                bytes: n,
                stream: StreamId(0),
            })? {
                Reply::Data(d) if d.len() as u64 == n => d,
                _ => return Err(CUDA_ERROR_UNKNOWN),
            };
            view.write(s.host + offset + at, &data);
            let start = (offset + at) as usize;
            if let Some(clean) = self
                .shadows
                .get_mut(&s.device)
                .map(|o| &mut o.clean)
                .filter(|c| c.len() as u64 == s.size)
            {
                clean[start..start + data.len()].copy_from_slice(&data);
            }
            at += n;
        }
        Ok(())
    }

    pub fn copy_dtod(
        &mut self,
        ctx: u64,
        dst: u64,
        src: u64,
        bytes: u64,
        stream: u64,
    ) -> CuResult<()> {
        let (remote, stream) = (self.remote(ctx)?, self.stream(ctx, stream)?);
        let checked = self.is_device(ctx, dst, bytes) && self.is_device(ctx, src, bytes);
        self.defer_if(
            checked,
            Request::CopyDtoD {
                ctx: remote,
                dst,
                src,
                bytes,
                stream,
            },
        )
    }

    // Streams and events.

    fn create(&mut self, ctx: u64, kind: Kind) -> CuResult<u64> {
        let remote = self.remote(ctx)?;
        let id = self.id(match kind {
            Kind::Stream => Request::StreamCreate { ctx: remote },
            _ => Request::EventCreate { ctx: remote },
        })?;
        let h = self.handle(kind);
        self.objects.insert(h, (ctx, id));
        Ok(h)
    }

    pub fn stream_create(&mut self, ctx: u64, settings: StreamSettings) -> CuResult<u64> {
        let s = self.create(ctx, Kind::Stream)?;
        self.streams.insert(s, settings);
        Ok(s)
    }

    /// A stream's flags and priority: those it was created with, or the NULL stream's (0, 0)
    /// for 0, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`.
    pub fn stream_settings(&self, ctx: u64, stream: u64) -> CuResult<StreamSettings> {
        self.stream(ctx, stream)?;
        Ok(self.streams.get(&stream).copied().unwrap_or_default())
    }

    /// The context a stream or event handle belongs to (0 for the NULL stream).
    pub fn owner(&self, handle: u64) -> Option<u64> {
        self.objects.get(&handle).map(|&(ctx, _)| ctx)
    }

    pub fn stream_destroy(&mut self, ctx: u64, stream: u64) -> CuResult<()> {
        let id = self.object(ctx, Kind::Stream, stream)?;
        let remote = self.remote(ctx)?;
        self.objects.remove(&stream);
        self.streams.remove(&stream);
        self.done(Request::StreamDestroy {
            ctx: remote,
            stream: StreamId(id),
        })
    }

    pub fn stream_synchronize(&mut self, ctx: u64, stream: u64) -> CuResult<()> {
        let (remote, stream) = (self.remote(ctx)?, self.stream(ctx, stream)?);
        self.defer(Request::StreamSynchronize {
            ctx: remote,
            stream,
        })?;
        self.flush()
    }

    pub fn stream_query(&mut self, ctx: u64, stream: u64) -> CuResult<()> {
        let (remote, stream) = (self.remote(ctx)?, self.stream(ctx, stream)?);
        self.done(Request::StreamQuery {
            ctx: remote,
            stream,
        })
    }

    pub fn event_create(&mut self, ctx: u64) -> CuResult<u64> {
        self.create(ctx, Kind::Event)
    }

    pub fn event_destroy(&mut self, ctx: u64, event: u64) -> CuResult<()> {
        let id = self.object(ctx, Kind::Event, event)?;
        let remote = self.remote(ctx)?;
        self.objects.remove(&event);
        self.done(Request::EventDestroy {
            ctx: remote,
            event: EventId(id),
        })
    }

    pub fn event_record(&mut self, ctx: u64, event: u64, stream: u64) -> CuResult<()> {
        let id = self.object(ctx, Kind::Event, event)?;
        let (remote, stream) = (self.remote(ctx)?, self.stream(ctx, stream)?);
        self.defer(Request::EventRecord {
            ctx: remote,
            event: EventId(id),
            stream,
        })
    }

    pub fn event_synchronize(&mut self, ctx: u64, event: u64) -> CuResult<()> {
        let id = self.object(ctx, Kind::Event, event)?;
        let remote = self.remote(ctx)?;
        self.defer(Request::EventSynchronize {
            ctx: remote,
            event: EventId(id),
        })?;
        self.flush()
    }

    pub fn event_query(&mut self, ctx: u64, event: u64) -> CuResult<()> {
        let id = self.object(ctx, Kind::Event, event)?;
        let remote = self.remote(ctx)?;
        self.done(Request::EventQuery {
            ctx: remote,
            event: EventId(id),
        })
    }

    pub fn event_elapsed(&mut self, ctx: u64, start: u64, end: u64) -> CuResult<f32> {
        let s = self.object(ctx, Kind::Event, start)?;
        let e = self.object(ctx, Kind::Event, end)?;
        let remote = self.remote(ctx)?;
        match self.call(Request::EventElapsed {
            ctx: remote,
            start: EventId(s),
            end: EventId(e),
        })? {
            Reply::Elapsed(ms) => Ok(ms),
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }

    // Launches.

    /// Launches `function` (of `ctx`): checked against the device's limits and the kernel's
    /// parameter layout here, then deferred; device `printf` output appears when the batch is
    /// sent. A `cooperative` launch (`cuLaunchCooperativeKernel`) is refused with
    /// `CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE` when its grid has more blocks than can be
    /// resident at once: the occupancy queries' answer times the multiprocessors, the rule the
    /// host enforces too.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &mut self,
        ctx: u64,
        function: u64,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        stream: u64,
        params: LaunchParams,
        cooperative: bool,
    ) -> CuResult<()> {
        if self.functions.get(&function).map(|f| f.ctx) != Some(ctx) {
            return Err(if self.functions.contains_key(&function) {
                CUDA_ERROR_INVALID_CONTEXT
            } else {
                CUDA_ERROR_INVALID_HANDLE
            });
        }
        // Dynamic shared memory past the function's maximum (48 KiB beside its static
        // memory unless raised with cuFuncSetAttribute) is refused, as a GPU refuses it.
        if shared_bytes > 0 {
            let a = self.function_attributes(function)?;
            let s = self.function_settings(function)?;
            if shared_bytes > attributes::max_dynamic_shared(&a, &s) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
        let f = self
            .functions
            .get(&function)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let size = f
            .params
            .iter()
            .map(|p| p.offset + p.size)
            .max()
            .unwrap_or(0) as usize;
        let a = &self.attributes;
        let threads = block.iter().try_fold(1u32, |t, &d| t.checked_mul(d));
        if grid.iter().zip(a.max_grid).any(|(&g, m)| g == 0 || g > m)
            || block.iter().zip(a.max_block).any(|(&b, m)| b == 0 || b > m)
            || threads.is_none_or(|t| t > a.max_threads_per_block)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if cooperative {
            let threads = threads.unwrap_or(0);
            self.check_co_resident(function, grid, threads, shared_bytes)?;
        }
        let f = self
            .functions
            .get(&function)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let buffer = match params {
            LaunchParams::Packed(b) if b.len() == size => b,
            LaunchParams::Packed(_) => return Err(CUDA_ERROR_INVALID_VALUE),
            LaunchParams::Each(values) => {
                if values.len() != f.params.len() {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                let mut b = vec![0u8; size];
                for (p, v) in f.params.iter().zip(&values) {
                    let (o, n) = (p.offset as usize, p.size as usize);
                    if v.len() != n {
                        return Err(CUDA_ERROR_INVALID_VALUE);
                    }
                    b[o..o + n].copy_from_slice(v);
                }
                b
            }
        };
        let (fid, remote, stream) = (f.remote, self.remote(ctx)?, self.stream(ctx, stream)?);
        self.defer(Request::Launch {
            ctx: remote,
            function: fid,
            grid,
            block,
            shared_bytes,
            stream,
            params: buffer,
            cooperative,
        })
    }

    /// Refuses a cooperative grid of more blocks than can be resident at once.
    fn check_co_resident(
        &mut self,
        function: u64,
        grid: [u32; 3],
        threads: u32,
        shared_bytes: u32,
    ) -> CuResult<()> {
        let sm = attributes::limits(&self.attributes)?;
        let multiprocessors = self.attributes.multiprocessors;
        let f = self.function_attributes(function)?;
        let most = mdev_backend::compute::occupancy::co_resident_blocks(
            &sm,
            &f,
            threads,
            shared_bytes,
            multiprocessors,
        );
        let blocks = grid
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(u64::from(d)));
        if blocks > most {
            return Err(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
        }
        Ok(())
    }
}

/// The address window of a placed context: room for its whole memory budget twice over plus
/// the guard gap after each of the most allocations a context may hold.
fn context_window_bytes(a: &DeviceAttributes) -> u64 {
    let guards = (mdev_backend::compute::memory::MAX_ALLOCATIONS as u64)
        .saturating_mul(mdev_backend::compute::memory::GUARD_BYTES);
    a.total_memory.saturating_mul(2).saturating_add(guards)
}

/// Whether `req` may read or write device memory (everything but bookkeeping, waiting and
/// queries).
fn touches_device(req: &Request) -> bool {
    if let Request::Batch(items) = req {
        return items.iter().any(touches_device);
    }
    !matches!(
        req,
        Request::Attributes
            | Request::ContextSynchronize { .. }
            | Request::StreamSynchronize { .. }
            | Request::StreamQuery { .. }
            | Request::EventRecord { .. }
            | Request::EventSynchronize { .. }
            | Request::EventQuery { .. }
            | Request::ContextCreate
            | Request::ContextCreateAt { .. }
            | Request::ContextDestroy { .. }
            | Request::ModuleUnload { .. }
            | Request::Function { .. }
            | Request::FunctionAttributes { .. }
            | Request::MemAlloc { .. }
            | Request::MemFree { .. }
            | Request::StreamCreate { .. }
            | Request::StreamDestroy { .. }
            | Request::EventCreate { .. }
            | Request::EventDestroy { .. }
            | Request::EventElapsed { .. }
            | Request::TakeOutput { .. }
            | Request::SetHeapSize { .. }
            | Request::MemInfo { .. }
            | Request::Usage
    )
}

/// Whether the host may touch managed and mapped memory after `req` (when it succeeds): a
/// synchronisation of the context, a stream or an event, a query that finds the work done, or
/// a synchronous copy to the host.
fn synchronizes(req: &Request) -> bool {
    match req {
        Request::Batch(items) => items.iter().any(synchronizes),
        Request::ContextSynchronize { .. }
        | Request::StreamSynchronize { .. }
        | Request::EventSynchronize { .. }
        | Request::StreamQuery { .. }
        | Request::EventQuery { .. }
        | Request::CopyDtoH { .. } => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::TransportError;
    use mdev_backend::compute::remote::{Owned, Stats, dispatch};
    use mdev_backend::compute::{CpuBackend, CpuConfig};

    /// The host in-process: the backend behind the same dispatch a socket connection uses.
    struct Local {
        be: CpuBackend,
        owned: Owned,
        stats: Stats,
        /// Requests answered before the "connection" breaks.
        budget: usize,
    }

    impl Transport for Local {
        fn call(&mut self, req: &Request) -> Result<Reply, TransportError> {
            if self.budget == 0 {
                return Err(TransportError::Io(std::io::ErrorKind::BrokenPipe.into()));
            }
            self.budget -= 1;
            Ok(dispatch(
                &mut self.be,
                &mut self.owned,
                &mut self.stats,
                req.clone(),
            ))
        }
    }

    fn driver() -> Driver<Local> {
        Driver::new(Local {
            be: CpuBackend::new(CpuConfig::default()),
            owned: Owned::default(),
            stats: Stats::default(),
            budget: usize::MAX,
        })
        .unwrap()
    }

    const PTX: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
        .visible .entry put(.param .u64 p, .param .u32 v)\n{\n.reg .b32 %r<2>;\n\
        .reg .b64 %rd<2>;\nld.param.u64 %rd1, [p];\nld.param.u32 %r1, [v];\n\
        st.global.u32 [%rd1], %r1;\nret;\n}\n";

    fn launch(d: &mut Driver<Local>, ctx: u64, f: u64, params: LaunchParams) -> CuResult<()> {
        d.launch(ctx, f, [1, 1, 1], [1, 1, 1], 0, 0, params, false)
    }

    /// The permissions of the mapping of this process that holds `addr` (/proc/self/maps).
    fn mapping_of(addr: u64) -> Option<String> {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines().find_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms) = (f.next()?, f.next()?);
            let (a, b) = range.split_once('-')?;
            let (a, b) = (
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            );
            (a <= addr && addr < b).then(|| perms.to_owned())
        })
    }

    #[test]
    fn device_addresses_lie_in_a_window_reserved_in_this_process() {
        let mut d = driver();
        assert!(d.attributes().placement);
        assert_eq!(
            crate::attributes::device_attribute(d.attributes(), 41),
            Ok(1)
        );
        let (c1, c2) = (d.context_create().unwrap(), d.context_create().unwrap());
        let a = d.mem_alloc(c1, 4096).unwrap();
        let b = d.mem_alloc(c2, 4096).unwrap();
        // Each is inside an inaccessible reservation of this process: no host pointer of the
        // client can equal it, and the two contexts' windows differ.
        assert_eq!(mapping_of(a).as_deref(), Some("---p"), "{a:#x}");
        assert_eq!(mapping_of(b).as_deref(), Some("---p"), "{b:#x}");
        assert_ne!(a, b);
        d.context_destroy(c1).unwrap();
    }

    #[test]
    fn a_kernel_runs_with_either_parameter_form_and_wrong_forms_are_refused() {
        let mut d = driver();
        let ctx = d.context_create().unwrap();
        let m = d
            .module_load(ctx, Image::Single(PTX.as_bytes().to_vec()))
            .unwrap();
        let f = d.function(m, "put").unwrap();
        let a = d.mem_alloc(ctx, 8).unwrap();
        let each = LaunchParams::Each(vec![a.to_le_bytes().to_vec(), 5u32.to_le_bytes().to_vec()]);
        launch(&mut d, ctx, f, each).unwrap();
        let mut out = [0u8; 4];
        d.copy_dtoh(ctx, &mut out, a, 0).unwrap();
        assert_eq!(u32::from_le_bytes(out), 5);
        let packed = [a.to_le_bytes().as_slice(), &6u32.to_le_bytes()].concat();
        launch(&mut d, ctx, f, LaunchParams::Packed(packed)).unwrap();
        d.copy_dtoh(ctx, &mut out, a, 0).unwrap();
        assert_eq!(u32::from_le_bytes(out), 6);
        // One value short, a value of the wrong size, a buffer of the wrong size.
        let short = LaunchParams::Each(vec![a.to_le_bytes().to_vec()]);
        assert_eq!(launch(&mut d, ctx, f, short), Err(CUDA_ERROR_INVALID_VALUE));
        let wide = LaunchParams::Each(vec![a.to_le_bytes().to_vec(), vec![0; 8]]);
        assert_eq!(launch(&mut d, ctx, f, wide), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(
            launch(&mut d, ctx, f, LaunchParams::Packed(vec![0; 4])),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
    }

    #[test]
    fn a_library_becomes_a_module_in_each_context_that_uses_it() {
        let mut d = driver();
        // Loaded before any context (as cudart does): nothing reaches the host yet.
        let sent = d.transport().stats.requests;
        let lib = d
            .library_load(Image::Single(PTX.as_bytes().to_vec()), None)
            .unwrap();
        let k = d.kernel(lib, "put", None).unwrap();
        assert_eq!(d.transport().stats.requests, sent);
        let (c1, c2) = (d.context_create().unwrap(), d.context_create().unwrap());
        // A kernel handle stands for its function in the current context.
        let f1 = d.resolve_function(k, Some(c1)).unwrap();
        let f2 = d.resolve_function(k, Some(c2)).unwrap();
        assert_ne!(f1, f2);
        assert_eq!(
            d.kernel_function(k, c1),
            Ok(f1),
            "looked up once per context"
        );
        assert_eq!(
            d.resolve_function(f1, Some(c2)),
            Ok(f1),
            "functions are themselves"
        );
        assert_eq!(d.resolve_function(k, None), Err(CUDA_ERROR_INVALID_CONTEXT));
        for (ctx, f, v) in [(c1, f1, 3u32), (c2, f2, 4)] {
            let a = d.mem_alloc(ctx, 4).unwrap();
            let packed = [a.to_le_bytes().as_slice(), &v.to_le_bytes()].concat();
            launch(&mut d, ctx, f, LaunchParams::Packed(packed)).unwrap();
            let mut out = [0u8; 4];
            d.copy_dtoh(ctx, &mut out, a, 0).unwrap();
            assert_eq!(u32::from_le_bytes(out), v);
        }
        // A context destroyed and a new one: the library is loaded again there.
        d.context_destroy(c1).unwrap();
        let c3 = d.context_create().unwrap();
        let f3 = d.kernel_function(k, c3).unwrap();
        assert!(f3 != f1 && f3 != f2);
        // With a context, an unknown kernel name or a bad image fails the call itself.
        assert_eq!(d.kernel(lib, "nope", Some(c3)), Err(500));
        assert_eq!(
            d.library_load(Image::Single(b"not an image".to_vec()), Some(c3)),
            Err(CUDA_ERROR_INVALID_IMAGE)
        );
        // Unloading takes its kernels along; a kernel handle is not a library handle.
        assert_eq!(d.library_unload(k), Err(CUDA_ERROR_INVALID_HANDLE));
        d.library_unload(lib).unwrap();
        assert_eq!(d.kernel_function(k, c3), Err(CUDA_ERROR_INVALID_HANDLE));
        assert_eq!(d.library_module(lib, c3), Err(CUDA_ERROR_INVALID_HANDLE));
        assert_eq!(d.library_unload(lib), Err(CUDA_ERROR_INVALID_HANDLE));
    }

    #[test]
    fn handles_of_another_kind_or_context_are_refused() {
        let mut d = driver();
        let (c1, c2) = (d.context_create().unwrap(), d.context_create().unwrap());
        let m = d
            .module_load(c1, Image::Single(PTX.as_bytes().to_vec()))
            .unwrap();
        let f = d.function(m, "put").unwrap();
        let s = d.stream_create(c1, StreamSettings::default()).unwrap();
        let e = d.event_create(c1).unwrap();
        let params = || LaunchParams::Packed(vec![0; 12]);
        assert_eq!(
            launch(&mut d, c2, f, params()),
            Err(CUDA_ERROR_INVALID_CONTEXT)
        );
        assert_eq!(d.stream_synchronize(c1, m), Err(CUDA_ERROR_INVALID_HANDLE));
        assert_eq!(d.stream_synchronize(c2, s), Err(CUDA_ERROR_INVALID_CONTEXT));
        assert_eq!(d.event_record(c1, s, 0), Err(CUDA_ERROR_INVALID_HANDLE));
        assert_eq!(d.event_record(c1, e, e), Err(CUDA_ERROR_INVALID_HANDLE));
        assert_eq!(d.function(s, "put"), Err(CUDA_ERROR_INVALID_HANDLE));
        assert_eq!(d.synchronize(m), Err(CUDA_ERROR_INVALID_CONTEXT));
        assert_eq!(d.function(m, "nope"), Err(500));
        d.context_destroy(c1).unwrap();
        assert_eq!(d.function(m, "put"), Err(CUDA_ERROR_INVALID_HANDLE));
        assert_eq!(d.params(f), Err(CUDA_ERROR_INVALID_HANDLE));
        assert_eq!(d.context_destroy(c1), Err(CUDA_ERROR_INVALID_CONTEXT));
    }

    #[test]
    fn big_copies_are_split_and_address_ranges_answered_locally() {
        let mut d = driver();
        let ctx = d.context_create().unwrap();
        let n = 2 * MAX_COPY_BYTES as usize + 12_345;
        let a = d.mem_alloc(ctx, n as u64).unwrap();
        let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        d.copy_htod(ctx, a, &data, 0).unwrap();
        let mut back = vec![0u8; n];
        d.copy_dtoh(ctx, &mut back, a, 0).unwrap();
        assert!(back == data);
        assert_eq!(d.address_range(ctx, a + 100), Ok((a, n as u64)));
        assert!(d.is_device(ctx, a + 1, n as u64 - 1));
        assert!(!d.is_device(ctx, a + 1, n as u64));
        assert_eq!(
            d.address_range(ctx, a + n as u64),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        // Past the allocation: the host refuses, nothing is written.
        assert_eq!(d.copy_htod(ctx, a + 8, &data, 0), Err(1));
        d.mem_free(ctx, a).unwrap();
        assert_eq!(d.address_range(ctx, a), Err(CUDA_ERROR_INVALID_VALUE));
    }

    #[test]
    fn a_link_is_loaded_by_its_token_until_destroyed() {
        let mut d = driver();
        let ctx = d.context_create().unwrap();
        let l = d.link_create();
        assert_eq!(
            d.link_complete(l).err(),
            Some(CUDA_ERROR_INVALID_VALUE),
            "empty"
        );
        let lib = ".version 8.5\n.target sm_75\n.address_size 64\n\
            .visible .func (.param .u32 r) seven () { st.param.u32 [r], 7; ret; }\n";
        let user = PTX.replace(
            "ld.param.u32 %r1, [v];",
            "{ .param .u32 %x; call (%x), seven; ld.param.u32 %r1, [%x]; }",
        );
        let user = user.replace(
            ".visible .entry",
            ".extern .func (.param .u32 r) seven ();\n.visible .entry",
        );
        d.link(l).unwrap().images.push(user.into_bytes());
        d.link(l).unwrap().images.push(lib.as_bytes().to_vec());
        let token = *d.link_complete(l).unwrap();
        assert_eq!(&token[..8], LINK_TOKEN_MAGIC);
        let m = d.module_load(ctx, d.linked_image(&token).unwrap()).unwrap();
        let f = d.function(m, "put").unwrap();
        let a = d.mem_alloc(ctx, 4).unwrap();
        let packed = [a.to_le_bytes().as_slice(), &0u32.to_le_bytes()].concat();
        launch(&mut d, ctx, f, LaunchParams::Packed(packed)).unwrap();
        let mut out = [0u8; 4];
        d.copy_dtoh(ctx, &mut out, a, 0).unwrap();
        assert_eq!(u32::from_le_bytes(out), 7);
        d.link_destroy(l).unwrap();
        assert_eq!(
            d.linked_image(&token).map(drop),
            Err(CUDA_ERROR_INVALID_IMAGE)
        );
        assert_eq!(d.link_destroy(l), Err(CUDA_ERROR_INVALID_HANDLE));
    }

    #[test]
    fn device_printf_output_comes_back_with_the_launch() {
        let ptx = ".version 8.5\n.target sm_75\n.address_size 64\n\
            .extern .func (.param .b32 r) vprintf (.param .b64 f, .param .b64 a);\n\
            .global .align 1 .b8 msg[7] = {104, 105, 32, 37, 100, 10, 0};\n\
            .visible .entry hi(.param .u64 buf)\n{\n.reg .b64 %rd<3>;\n\
            mov.u64 %rd1, msg;\ncvta.global.u64 %rd1, %rd1;\nld.param.u64 %rd2, [buf];\n\
            { .param .b64 p0; st.param.b64 [p0], %rd1; .param .b64 p1; st.param.b64 [p1], %rd2;\n\
            .param .b32 r; call.uni (r), vprintf, (p0, p1); }\nret;\n}\n";
        let mut d = driver();
        let ctx = d.context_create().unwrap();
        let m = d
            .module_load(ctx, Image::Single(ptx.as_bytes().to_vec()))
            .unwrap();
        let f = d.function(m, "hi").unwrap();
        let args = d.mem_alloc(ctx, 8).unwrap();
        d.copy_htod(ctx, args, &42u32.to_le_bytes(), 0).unwrap();
        let out = Captured::default();
        let mut d = d.with_output(Box::new(out.clone()));
        for _ in 0..3 {
            d.launch(
                ctx,
                f,
                [1, 1, 1],
                [2, 1, 1],
                0,
                0,
                LaunchParams::Packed(args.to_le_bytes().to_vec()),
                false,
            )
            .unwrap();
        }
        assert_eq!(out.text(), "", "deferred until a synchronisation");
        let before = d.t.stats.requests;
        d.synchronize(ctx).unwrap();
        assert_eq!(out.text(), "hi 42\n".repeat(6));
        // One message: the batch (the argument copy, the three launches and the
        // synchronisation).
        assert_eq!(d.t.stats.requests - before, 1);
        assert_eq!(d.t.stats.launches, 3);
    }

    /// Printf output shared with the test.
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    impl std::io::Write for Captured {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn deferred_work_keeps_its_order_and_its_first_failure_is_reported_at_the_next_call() {
        let mut d = driver();
        let ctx = d.context_create().unwrap();
        let m = d
            .module_load(ctx, Image::Single(PTX.as_bytes().to_vec()))
            .unwrap();
        let f = d.function(m, "put").unwrap();
        let a = d.mem_alloc(ctx, 8).unwrap();
        let before = d.t.stats.requests;
        d.memset_d32(ctx, a, 1, 2, 0).unwrap();
        let packed = |p: u64, v: u32| {
            LaunchParams::Packed([p.to_le_bytes().as_slice(), &v.to_le_bytes()].concat())
        };
        launch(&mut d, ctx, f, packed(a + 4, 9)).unwrap();
        d.copy_htod(ctx, a, &5u32.to_le_bytes(), 0).unwrap();
        assert_eq!(d.t.stats.requests, before, "nothing sent yet");
        let mut out = [0u8; 8];
        d.copy_dtoh(ctx, &mut out, a, 0).unwrap();
        assert_eq!(
            out,
            [5, 0, 0, 0, 9, 0, 0, 0],
            "memset, launch, copy in order"
        );
        // Checked before deferring: limits and the parameter layout.
        assert_eq!(
            d.launch(ctx, f, [1, 1, 1], [2048, 1, 1], 0, 0, packed(a, 1), false),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(
            d.launch(ctx, f, [0, 1, 1], [1, 1, 1], 0, 0, packed(a, 1), false),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        // A kernel that faults: the launch returns, the next call reports the fault, and the
        // work deferred behind it did not run.
        launch(&mut d, ctx, f, packed(a + (1 << 30), 1)).unwrap();
        d.copy_htod(ctx, a, &7u32.to_le_bytes(), 0).unwrap();
        assert_eq!(d.synchronize(ctx), Err(700));
        assert_eq!(d.t.stats.failed, 1);
        // A copy the guest cannot check (outside what it knows) goes at once: its error is its own.
        assert_eq!(
            d.copy_htod(ctx, 0x10, &[1], 0),
            Err(719),
            "the context is broken"
        );
    }

    #[test]
    fn a_lost_host_is_an_error_not_a_hang_or_a_panic() {
        let mut d = driver();
        let ctx = d.context_create().unwrap();
        d.t.budget = 0;
        assert_eq!(d.mem_alloc(ctx, 8), Err(CUDA_ERROR_DEINITIALIZED));
        assert_eq!(d.synchronize(ctx), Err(CUDA_ERROR_DEINITIALIZED));
    }

    /// Host memory of the test: one range at [`FAKE_HOST`].
    #[derive(Clone, Default)]
    struct FakeHost(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    const FAKE_HOST: u64 = 0x10_0000;

    impl HostView for FakeHost {
        fn read(&self, addr: u64, out: &mut [u8]) {
            let at = (addr - FAKE_HOST) as usize;
            out.copy_from_slice(&self.0.lock().unwrap()[at..at + out.len()]);
        }
        fn write(&self, addr: u64, data: &[u8]) {
            let at = (addr - FAKE_HOST) as usize;
            self.0.lock().unwrap()[at..at + data.len()].copy_from_slice(data);
        }
    }

    #[test]
    fn shadowed_memory_moves_at_synchronisation_points_and_only_what_changed_goes_up() {
        let n = 3 * COHERENCE_CHUNK + 100;
        let host = FakeHost::default();
        *host.0.lock().unwrap() = (0..n).map(|i| (i % 251) as u8).collect();
        let mut d = driver().with_host_view(Box::new(host.clone()));
        let ctx = d.context_create().unwrap();
        let device = d.mem_alloc(ctx, n as u64).unwrap();
        let shadow = ShadowInfo {
            ctx,
            device,
            host: FAKE_HOST,
            size: n as u64,
            alloc: device,
            managed: false,
        };
        let before = d.t.stats.requests;
        d.shadow_create(shadow).unwrap();
        assert_eq!(
            d.t.stats.requests - before,
            1,
            "all four chunks go up at once, in one batch"
        );
        assert_eq!(
            d.shadow_create(shadow),
            Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
        );
        // Nothing changed on the host: a synchronisation after device work sends no chunk and
        // brings the range back in one copy.
        d.memset_d8(ctx, device + 10, 0xAB, 2, 0).unwrap();
        let before = d.t.stats.requests;
        d.synchronize(ctx).unwrap();
        assert_eq!(
            d.t.stats.requests - before,
            2,
            "the batch, then one copy back"
        );
        assert_eq!(host.0.lock().unwrap()[10..13], [0xAB, 0xAB, 12]);
        // One byte changed on the host: that chunk goes up before the device work.
        host.0.lock().unwrap()[2 * COHERENCE_CHUNK + 1] = 7;
        d.memset_d8(ctx, device, 1, 1, 0).unwrap();
        let before = d.t.stats.requests;
        d.synchronize(ctx).unwrap();
        assert_eq!(
            d.t.stats.requests - before,
            3,
            "the changed chunk in a batch of its own, the batch, one copy back"
        );
        let mut back = vec![0u8; n];
        d.copy_dtoh(ctx, &mut back, device, 0).unwrap();
        assert_eq!(back[2 * COHERENCE_CHUNK + 1], 7);
        assert_eq!(back[0], 1);
        assert_eq!(host.0.lock().unwrap()[0], 1);
        // Without device work since, a synchronisation brings nothing back.
        let before = d.t.stats.requests;
        d.synchronize(ctx).unwrap();
        assert_eq!(d.t.stats.requests - before, 1);
        // Released: the last contents came back, and nothing moves any more.
        assert_eq!(
            d.shadow_release(None, Some(FAKE_HOST)).unwrap(),
            Some(shadow)
        );
        assert_eq!(d.shadow_release(None, Some(FAKE_HOST)), Ok(None));
        d.memset_d8(ctx, device, 9, 1, 0).unwrap();
        d.synchronize(ctx).unwrap();
        assert_eq!(host.0.lock().unwrap()[0], 1);
    }

    #[test]
    fn shadows_are_bounded_by_the_device_memory_and_need_a_host_view() {
        let mut d = driver();
        let ctx = d.context_create().unwrap();
        let s = ShadowInfo {
            ctx,
            device: 0x1000,
            host: FAKE_HOST,
            size: 8,
            alloc: 0x1000,
            managed: false,
        };
        assert_eq!(
            d.shadow_create(s),
            Err(CUDA_ERROR_INVALID_VALUE),
            "no host view"
        );
        let mut d = d.with_host_view(Box::new(FakeHost::default()));
        let huge = ShadowInfo {
            size: d.attributes().total_memory + 1,
            ..s
        };
        assert_eq!(d.shadow_create(huge), Err(CUDA_ERROR_OUT_OF_MEMORY));
        let wrapping = ShadowInfo {
            device: u64::MAX - 4,
            ..s
        };
        assert_eq!(d.shadow_create(wrapping), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(
            d.managed_reserve(ctx, 0, 4096),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(
            d.managed_reserve(ctx, u64::MAX - 10, 4096),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
    }

    /// A host view at a real buffer's address (where a copy's destination slice lies), whose
    /// contents are kept apart.
    #[derive(Clone)]
    struct Mirror {
        base: u64,
        mem: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    }

    impl HostView for Mirror {
        fn read(&self, addr: u64, out: &mut [u8]) {
            let at = (addr - self.base) as usize;
            out.copy_from_slice(&self.mem.lock().unwrap()[at..at + out.len()]);
        }
        fn write(&self, addr: u64, data: &[u8]) {
            let at = (addr - self.base) as usize;
            self.mem.lock().unwrap()[at..at + data.len()].copy_from_slice(data);
        }
    }

    #[test]
    fn a_copy_into_a_shadowed_host_view_arrives_through_it_and_is_not_sent_back_up() {
        let n = 4 * COHERENCE_CHUNK;
        // The view is the first `n` bytes; 8 more lie past it.
        let mut scratch = vec![0u8; n + 8];
        let view = Mirror {
            base: scratch.as_ptr() as u64,
            mem: std::sync::Arc::new(std::sync::Mutex::new(vec![0u8; n])),
        };
        let mut d = driver().with_host_view(Box::new(view.clone()));
        let ctx = d.context_create().unwrap();
        let device = d.mem_alloc(ctx, n as u64).unwrap();
        let shadow = ShadowInfo {
            ctx,
            device,
            host: view.base,
            size: n as u64,
            alloc: device,
            managed: false,
        };
        d.shadow_create(shadow).unwrap();
        let src = d.mem_alloc(ctx, n as u64).unwrap();
        let pattern: Vec<u8> = (0..n).map(|i| (i % 253) as u8 + 1).collect();
        d.copy_htod(ctx, src, &pattern, 0).unwrap();
        d.synchronize(ctx).unwrap();

        // Without device work since the last synchronisation only the copied bytes come back,
        // into the view, and the view's device side holds them too.
        let (at, len) = (COHERENCE_CHUNK + 10, COHERENCE_CHUNK);
        d.copy_dtoh(ctx, &mut scratch[at..at + len], src, 0)
            .unwrap();
        assert_eq!(view.mem.lock().unwrap()[at..at + len], pattern[..len]);
        assert_eq!(view.mem.lock().unwrap()[..at], vec![0u8; at][..]);
        let mut back = vec![0u8; len];
        d.copy_dtoh(ctx, &mut back, device + at as u64, 0).unwrap();
        assert_eq!(back, pattern[..len]);
        // The view is coherent: a synchronisation sends nothing up and brings nothing back.
        let before = d.t.stats.requests;
        d.synchronize(ctx).unwrap();
        assert_eq!(d.t.stats.requests - before, 1);
        // A copy from memory no shadow holds, with no device work pending, leaves the host's
        // change elsewhere in the view for the next device work (the copy and its bytes
        // back: two messages), which sends it.
        view.mem.lock().unwrap()[3 * COHERENCE_CHUNK] = 0x55;
        let before = d.t.stats.requests;
        d.copy_dtoh(ctx, &mut scratch[..8], src, 0).unwrap();
        assert_eq!(d.t.stats.requests - before, 2);
        let before = d.t.stats.requests;
        d.synchronize(ctx).unwrap();
        assert_eq!(
            d.t.stats.requests - before,
            2,
            "the changed chunk, the batch"
        );
        let mut one = [0u8; 1];
        d.copy_dtoh(ctx, &mut one, device + 3 * COHERENCE_CHUNK as u64, 0)
            .unwrap();
        assert_eq!(one, [0x55]);
        assert_eq!(view.mem.lock().unwrap()[..8], pattern[..8]);

        // After device work on the view's device side, all of it comes back with the copy.
        d.memset_d8(ctx, device, 0xEE, 4, 0).unwrap();
        d.copy_dtoh(ctx, &mut scratch[n - 8..n], src, 0).unwrap();
        let mem = view.mem.lock().unwrap().clone();
        assert_eq!(mem[..4], [0xEE; 4]);
        assert_eq!(mem[at..at + len], pattern[..len]);
        assert_eq!(mem[n - 8..], pattern[..8]);

        // A source that is no device memory is refused and the view keeps its contents.
        assert_eq!(
            d.copy_dtoh(ctx, &mut scratch[..8], 8, 0),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(view.mem.lock().unwrap()[..], mem[..]);
        // A destination running past the view's end takes the ordinary way: into the buffer.
        d.copy_dtoh(ctx, &mut scratch[n - 4..], src, 0).unwrap();
        assert_eq!(scratch[n - 4..], pattern[..12]);
        assert_eq!(view.mem.lock().unwrap()[..], mem[..]);
    }

    #[test]
    fn writes_of_both_sides_between_synchronisations_merge_or_are_refused() {
        let host = FakeHost::default();
        *host.0.lock().unwrap() = vec![0; 256];
        let mut d = driver().with_host_view(Box::new(host.clone()));
        let ctx = d.context_create().unwrap();
        let device = d.mem_alloc(ctx, 256).unwrap();
        let shadow = ShadowInfo {
            ctx,
            device,
            host: FAKE_HOST,
            size: 256,
            alloc: device,
            managed: true,
        };
        d.shadow_create(shadow).unwrap();
        // Device work reaches the device (a synchronous copy sends it), then the host writes
        // other bytes before the next synchronisation: both are kept.
        d.memset_d8(ctx, device, 9, 1, 0).unwrap();
        d.flush().unwrap();
        host.0.lock().unwrap()[100] = 7;
        d.synchronize(ctx).unwrap();
        let mut back = [0u8; 256];
        d.copy_dtoh(ctx, &mut back, device, 0).unwrap();
        assert_eq!((back[0], back[100]), (9, 7));
        assert_eq!(host.0.lock().unwrap()[..1], [9]);
        // Both write the same byte differently: refused, not a silent choice.
        d.memset_d8(ctx, device + 5, 1, 1, 0).unwrap();
        d.flush().unwrap();
        host.0.lock().unwrap()[5] = 2;
        assert_eq!(d.synchronize(ctx), Err(CUDA_ERROR_ILLEGAL_STATE));
    }
}
