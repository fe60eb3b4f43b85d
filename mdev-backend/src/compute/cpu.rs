//! `CpuBackend`: the compute backend on the host's CPUs, executing PTX with the `ptx`
//! interpreter over each context's checked [`DeviceMemory`]. Work runs when it is enqueued,
//! in order, so every stream is always complete and events record when the work before them
//! finished.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use log::{debug, warn};

use super::backend::*;
use super::fatbin::{ptx_entries, ptx_of_all};
use super::memory::{
    DEVICE_HEAP_BYTES, DeviceHeap, DeviceMemory, MAX_HEAP_BLOCKS, check_heap_size,
};
use super::ptx::{self, Launch, MAX_PRINTF_BYTES};
use super::{ComputeError, ComputeResult, GlobalMemory, occupancy};
use crate::budget::{Charge, MemoryBudget};

/// Bytes moved per step of a device-to-device copy or a memset (bounds the host buffer).
const COPY_CHUNK: u64 = 1 << 20;

/// The memory budget of a backend not given its VM's ([`CpuConfig::default`]: a benchmark,
/// a test, a `vgpu-cuda-host` connection): 1 GiB, the device process's default
/// `--resource-memory-mb`, so a backend made without one holds no more than a VM may.
pub const DEFAULT_MEMORY_BUDGET_BYTES: u64 = 1 << 30;
/// Most device memory one context may hold by default: the whole default budget (the VM's
/// budget bounds all contexts together; this bounds one, and is the `total_memory` reported).
pub const DEFAULT_MEMORY_PER_CONTEXT: u64 = DEFAULT_MEMORY_BUDGET_BYTES;
/// Host bytes of one entry of a context's tables (a stream, an event, a function handle, a
/// device-`malloc` block) with the tables' slack.
const TABLE_ENTRY_BYTES: u64 = 48;
/// Host memory a context holds besides its allocations, charged to the budget when it is
/// created: its `printf` output ([`MAX_PRINTF_BYTES`]) and its tables at their limits (about
/// 4.4 MiB; 281 MiB for the [`MAX_CONTEXTS`] a backend may hold).
pub const CONTEXT_RESERVE_BYTES: u64 = MAX_PRINTF_BYTES as u64
    + (MAX_STREAMS_PER_CONTEXT
        + MAX_EVENTS_PER_CONTEXT
        + MAX_FUNCTIONS_PER_CONTEXT
        + MAX_HEAP_BLOCKS) as u64
        * TABLE_ENTRY_BYTES;

/// The instruction budget of a request given [`DEFAULT_REQUEST_TIME`]: far more warp-instructions
/// than the executor runs in that time, so the deadline binds first and the budget is the
/// deterministic backstop ([`CpuConfig::with_request_time`] scales it with the time).
pub const DEFAULT_INSTRUCTION_BUDGET: u64 = 1 << 30;

/// How the CPU backend runs.
#[derive(Debug, Clone)]
pub struct CpuConfig {
    /// The VM's memory budget, shared with everything else the VM holds: every context's
    /// reserve and allocations (memory allocations, module variables, the device heap) are
    /// charged to it; past it they fail with CUDA_ERROR_OUT_OF_MEMORY.
    pub budget: Arc<MemoryBudget>,
    /// Most device memory one context may hold (within the budget).
    pub memory_per_context: u64,
    /// Cost units (warp-instructions, and what `printf` and block setup cost in them: see
    /// `ptx::exec`) one request may spend on launches before it is a launch timeout: the
    /// deterministic bound, shared by the launches of a `Batch`.
    pub instruction_budget: u64,
    /// Host threads a launch spreads its blocks over ([`vm_share_of_host_threads`] by
    /// default).
    pub threads: usize,
    /// Wall-clock time one request may run (the CPU's counterpart of the driver's watchdog):
    /// past it, its running kernel stops with CUDA_ERROR_LAUNCH_TIMEOUT. Requests are what
    /// whoever serves the backend marks (`Executor`, `remote::serve`); a backend used
    /// directly is bounded by `instruction_budget` alone.
    pub request_time: std::time::Duration,
    /// What runs kernels: compiled code by default, the interpreter where the compiler refuses.
    pub engine: ptx::Engine,
}

/// Most multiprocessors the executor reports (one per host thread a launch spreads its blocks
/// over): a cooperative launch may have as many blocks as the occupancy model fits on each (16
/// on Turing), every one a host thread of its own, and 64 × 16 is
/// [`ptx::MAX_COOPERATIVE_BLOCKS`], so every grid the occupancy queries promise can run.
pub const MAX_MULTIPROCESSORS: u32 = 64;

/// How many of the host's CPUs one VM's device process holds at most by default:
/// `1 / VM_SHARE_DIVISOR` of them.
pub const VM_SHARE_DIVISOR: usize = 2;

/// The host threads one VM's launches may use by default: half the host's CPUs, at least 1,
/// so that one guest's kernels leave the other half to its neighbours and the host.
pub fn vm_share_of_host_threads() -> usize {
    let host = std::thread::available_parallelism().map_or(1, |n| n.get());
    (host / VM_SHARE_DIVISOR).max(1)
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            budget: MemoryBudget::new(DEFAULT_MEMORY_BUDGET_BYTES),
            memory_per_context: DEFAULT_MEMORY_PER_CONTEXT,
            instruction_budget: DEFAULT_INSTRUCTION_BUDGET,
            threads: vm_share_of_host_threads(),
            request_time: DEFAULT_REQUEST_TIME,
            engine: ptx::Engine::default(),
        }
    }
}

impl CpuConfig {
    /// This configuration with requests bounded by `time` instead of [`DEFAULT_REQUEST_TIME`],
    /// and the instruction budget scaled with it (never below [`DEFAULT_INSTRUCTION_BUDGET`]),
    /// so the deadline stays the bound an operator chose.
    pub fn with_request_time(mut self, time: std::time::Duration) -> Self {
        let scale = time.as_secs_f64() / DEFAULT_REQUEST_TIME.as_secs_f64();
        // f64 to u64 saturates; at MAX_REQUEST_TIME the scale is 2400 (2^41 units).
        let scaled = (DEFAULT_INSTRUCTION_BUDGET as f64 * scale) as u64;
        self.instruction_budget = scaled.max(DEFAULT_INSTRUCTION_BUDGET);
        self.request_time = time;
        self
    }
}

#[derive(Debug)]
struct LoadedModule {
    ptx: ptx::Module,
    /// Device address of each module variable, in `globals()` order.
    symbols: Vec<u64>,
    /// The host bytes the parsed module holds, given back to the budget when it is unloaded
    /// or its context destroyed.
    _charge: Charge,
}

#[derive(Debug)]
struct Context {
    memory: DeviceMemory,
    modules: HashMap<u32, LoadedModule>,
    functions: HashMap<u32, (u32, String)>,
    streams: HashSet<u32>,
    events: HashMap<u32, Option<Instant>>,
    broken: Option<ComputeError>,
    /// The device `malloc` heap, allocated at the first launch of a module that uses it.
    heap: Option<DeviceHeap>,
    /// The size the heap is made with (`CU_LIMIT_MALLOC_HEAP_SIZE`), fixed once it exists.
    heap_bytes: u64,
    output: String,
    next_id: u32,
    /// [`CONTEXT_RESERVE_BYTES`] of the budget, given back when the context is destroyed.
    _reserve: Charge,
}

impl Context {
    /// Allocates and initialises a parsed module's variables (patching the addresses that
    /// initialisers name) and keeps the module with the charge for its host bytes.
    fn install(
        &mut self,
        ctx: ContextId,
        module: ptx::Module,
        charge: Charge,
    ) -> ComputeResult<ModuleId> {
        let mut symbols = Vec::with_capacity(module.globals().len());
        let placed = (|| {
            for g in module.globals() {
                symbols.push(self.memory.alloc(g.size.max(1))?);
            }
            for (g, &addr) in module.globals().iter().zip(&symbols) {
                let mut init = g.init.clone();
                for &(offset, target) in &g.relocs {
                    let at = offset as usize;
                    init[at..at + 8].copy_from_slice(&symbols[target as usize].to_le_bytes());
                }
                self.memory.write(addr, &init).map_err(fault)?;
            }
            Ok(())
        })();
        if let Err(e) = placed {
            for a in &symbols {
                let _ = self.memory.free(*a);
            }
            return Err(e);
        }
        let id = self.id();
        debug!(
            "context {}: module {id} loaded, kernels {:?}",
            ctx.0,
            module.kernels().collect::<Vec<_>>()
        );
        self.modules.insert(
            id,
            LoadedModule {
                ptx: module,
                symbols,
                _charge: charge,
            },
        );
        Ok(ModuleId(id))
    }

    fn id(&mut self) -> u32 {
        next_id(&mut self.next_id)
    }

    fn stream(&self, s: StreamId) -> ComputeResult<()> {
        if s == DEFAULT_STREAM || self.streams.contains(&s.0) {
            Ok(())
        } else {
            Err(ComputeError::InvalidHandle(format!("stream {}", s.0)))
        }
    }

    fn event(&mut self, e: EventId) -> ComputeResult<&mut Option<Instant>> {
        self.events
            .get_mut(&e.0)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("event {}", e.0)))
    }
}

fn fault(f: super::Fault) -> ComputeError {
    ComputeError::InvalidValue(format!("copy outside the context's allocations: {f}"))
}

/// The CPU compute backend.
#[derive(Debug)]
pub struct CpuBackend {
    config: CpuConfig,
    contexts: ContextTable<Context>,
    /// Bounds each request in time and stops its kernels from another thread.
    interrupt: Arc<Interrupt>,
}

impl CpuBackend {
    /// A new context over `memory`, its reserve charged to the budget.
    fn context_with(&mut self, memory: DeviceMemory) -> ComputeResult<ContextId> {
        self.contexts.check_room()?;
        let reserve = self
            .config
            .budget
            .charge(CONTEXT_RESERVE_BYTES)
            .map_err(|e| ComputeError::OutOfMemory(format!("a context's reserve: {e}")))?;
        Ok(self.contexts.insert(Context {
            memory,
            modules: HashMap::new(),
            functions: HashMap::new(),
            streams: HashSet::new(),
            events: HashMap::new(),
            broken: None,
            heap: None,
            heap_bytes: DEVICE_HEAP_BYTES,
            output: String::new(),
            next_id: 0,
            _reserve: reserve,
        }))
    }

    pub fn new(config: CpuConfig) -> Self {
        CpuBackend {
            interrupt: Interrupt::new(config.request_time),
            config,
            contexts: ContextTable::new(),
        }
    }

    /// Most device memory one context may hold: the configured limit, within the budget.
    fn memory_per_context(&self) -> u64 {
        self.config
            .memory_per_context
            .min(self.config.budget.limit())
    }

    /// The context, unless it is unknown or broken by an earlier fault.
    fn ctx(&mut self, ctx: ContextId) -> ComputeResult<&mut Context> {
        let c = self.contexts.get_mut(ctx)?;
        match &c.broken {
            Some(e) => Err(ComputeError::ContextBroken(e.to_string())),
            None => Ok(c),
        }
    }
}

impl ComputeBackend for CpuBackend {
    fn attributes(&self) -> DeviceAttributes {
        DeviceAttributes {
            name: "vgpu PTX executor (CPU)".into(),
            placement: true,
            total_memory: self.memory_per_context(),
            compute_capability: (7, 5),
            multiprocessors: u32::try_from(self.config.threads)
                .unwrap_or(u32::MAX)
                .clamp(1, MAX_MULTIPROCESSORS),
            max_threads_per_block: ptx::MAX_THREADS_PER_BLOCK,
            max_block: [1024, 1024, 64],
            max_grid: [i32::MAX as u32, 65535, 65535],
            shared_memory_per_block: ptx::MAX_SHARED_BYTES,
            warp_size: 32,
            clock_khz: 1_000_000,
        }
    }

    fn context_create(&mut self) -> ComputeResult<ContextId> {
        let memory = DeviceMemory::charged_to(self.memory_per_context(), &self.config.budget);
        self.context_with(memory)
    }

    fn context_create_at(&mut self, base: u64, size: u64) -> ComputeResult<ContextId> {
        check_window(base, size)?;
        let memory =
            DeviceMemory::in_window(base, size, self.memory_per_context(), &self.config.budget)?;
        self.context_with(memory)
    }

    fn context_destroy(&mut self, ctx: ContextId) -> ComputeResult<()> {
        self.contexts.remove(ctx).map(drop)
    }

    fn context_synchronize(&mut self, ctx: ContextId) -> ComputeResult<()> {
        self.ctx(ctx).map(drop)
    }

    fn set_heap_size(&mut self, ctx: ContextId, bytes: u64) -> ComputeResult<()> {
        let c = self.ctx(ctx)?;
        check_heap_size(bytes)?;
        if c.heap.is_some() {
            return Err(ComputeError::InvalidValue(
                "the device heap's size after a kernel using malloc has run".into(),
            ));
        }
        debug!("context {}: device heap of {bytes} bytes", ctx.0);
        c.heap_bytes = bytes;
        Ok(())
    }

    fn module_load(&mut self, ctx: ContextId, image: &[u8]) -> ComputeResult<ModuleId> {
        let (budget, interrupt) = (Arc::clone(&self.config.budget), Arc::clone(&self.interrupt));
        let cancel = interrupt.flag();
        let c = self.ctx(ctx)?;
        room_for_module(c.modules.len())?;
        // The most portable PTX the executor accepts: each entry decompressed (and charged)
        // only once the ones before it failed to parse, and given back before the next.
        let mut last = None;
        for entry in ptx_entries(image)? {
            let text = entry.text(&budget, cancel)?;
            match ptx::Module::load(&[&text], &budget, cancel) {
                Ok((module, charge)) => return c.install(ctx, module, charge),
                Err(e @ ComputeError::InvalidPtx(_)) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| ComputeError::InvalidImage("no PTX".into())))
    }

    fn module_link(&mut self, ctx: ContextId, images: &[&[u8]]) -> ComputeResult<ModuleId> {
        let (budget, interrupt) = (Arc::clone(&self.config.budget), Arc::clone(&self.interrupt));
        let cancel = interrupt.flag();
        let c = self.ctx(ctx)?;
        room_for_module(c.modules.len())?;
        let texts = ptx_of_all(images, &budget, cancel)?;
        let texts: Vec<&str> = texts.iter().map(|t| &**t).collect();
        let (module, charge) = ptx::Module::load(&texts, &budget, cancel)?;
        c.install(ctx, module, charge)
    }

    fn module_unload(&mut self, ctx: ContextId, module: ModuleId) -> ComputeResult<()> {
        let c = self.ctx(ctx)?;
        let m = c
            .modules
            .remove(&module.0)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("module {}", module.0)))?;
        for a in &m.symbols {
            let _ = c.memory.free(*a);
        }
        c.functions.retain(|_, (m, _)| *m != module.0);
        Ok(())
    }

    fn module_global(
        &mut self,
        ctx: ContextId,
        module: ModuleId,
        name: &str,
    ) -> ComputeResult<(u64, u64)> {
        let c = self.ctx(ctx)?;
        let m = c
            .modules
            .get(&module.0)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("module {}", module.0)))?;
        m.ptx
            .globals()
            .iter()
            .zip(&m.symbols)
            .find(|(g, _)| g.name == name)
            .map(|(g, &addr)| (addr, g.size))
            .ok_or_else(|| ComputeError::NotFound(format!("variable {name}")))
    }

    fn function(
        &mut self,
        ctx: ContextId,
        module: ModuleId,
        name: &str,
    ) -> ComputeResult<(FunctionId, Vec<ParamInfo>)> {
        let c = self.ctx(ctx)?;
        let m = c
            .modules
            .get(&module.0)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("module {}", module.0)))?;
        let params = m
            .ptx
            .kernel(name)
            .ok_or_else(|| ComputeError::NotFound(format!("kernel {name}")))?
            .params
            .clone();
        if c.functions.len() >= MAX_FUNCTIONS_PER_CONTEXT {
            return Err(ComputeError::OutOfMemory(format!(
                "{MAX_FUNCTIONS_PER_CONTEXT} functions"
            )));
        }
        let id = c.id();
        c.functions.insert(id, (module.0, name.to_string()));
        Ok((FunctionId(id), params))
    }

    fn function_attributes(
        &mut self,
        ctx: ContextId,
        f: FunctionId,
    ) -> ComputeResult<FunctionAttributes> {
        let max_threads_per_block = self.attributes().max_threads_per_block;
        let c = self.ctx(ctx)?;
        let missing = || ComputeError::InvalidHandle(format!("function {}", f.0));
        let (module, name) = c.functions.get(&f.0).ok_or_else(missing)?;
        let m = c.modules.get(module).ok_or_else(missing)?;
        let k = m.ptx.kernel(name).ok_or_else(missing)?;
        // The module's `.const` variables: what a GPU keeps in its constant bank.
        let const_bytes = m
            .ptx
            .globals()
            .iter()
            .filter(|g| g.space == ptx::VarSpace::Const)
            .fold(0u64, |n, g| n.saturating_add(g.size));
        Ok(FunctionAttributes {
            max_threads_per_block,
            shared_size_bytes: k.static_shared_bytes,
            const_size_bytes: u32::try_from(const_bytes).unwrap_or(u32::MAX),
            local_size_bytes: k.local_bytes,
            num_regs: EXECUTOR_REGISTERS_PER_THREAD,
        })
    }

    fn mem_alloc(&mut self, ctx: ContextId, bytes: u64) -> ComputeResult<u64> {
        self.ctx(ctx)?.memory.alloc(bytes)
    }

    fn mem_free(&mut self, ctx: ContextId, addr: u64) -> ComputeResult<()> {
        self.ctx(ctx)?.memory.free(addr)
    }

    fn mem_info(&mut self, ctx: ContextId) -> ComputeResult<(u64, u64)> {
        let total = self.memory_per_context();
        let used = self.ctx(ctx)?.memory.used();
        let budget = &self.config.budget;
        let budget_room = budget.limit().saturating_sub(budget.used());
        Ok((total.saturating_sub(used).min(budget_room), total))
    }

    fn memset_d8(
        &mut self,
        ctx: ContextId,
        addr: u64,
        value: u8,
        count: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        let c = self.ctx(ctx)?;
        c.stream(stream)?;
        c.memory.fill(addr, value, count).map_err(fault)
    }

    fn memset_d32(
        &mut self,
        ctx: ContextId,
        addr: u64,
        value: u32,
        count: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        let c = self.ctx(ctx)?;
        c.stream(stream)?;
        if addr % 4 != 0 {
            return Err(ComputeError::InvalidValue(
                "memset_d32 of an unaligned address".into(),
            ));
        }
        let bytes = count
            .checked_mul(4)
            .ok_or_else(|| ComputeError::InvalidValue("count".into()))?;
        // The whole range is checked before a byte is written.
        c.memory.check(addr, bytes).map_err(fault)?;
        let chunk: Vec<u8> = value.to_le_bytes().repeat((COPY_CHUNK / 4) as usize);
        let mut done = 0;
        while done < bytes {
            let n = (bytes - done).min(COPY_CHUNK);
            c.memory
                .write(addr + done, &chunk[..n as usize])
                .map_err(fault)?;
            done += n;
        }
        Ok(())
    }

    fn copy_htod(
        &mut self,
        ctx: ContextId,
        dst: u64,
        src: &[u8],
        stream: StreamId,
    ) -> ComputeResult<()> {
        let c = self.ctx(ctx)?;
        c.stream(stream)?;
        c.memory.write(dst, src).map_err(fault)
    }

    fn copy_dtoh(
        &mut self,
        ctx: ContextId,
        dst: &mut [u8],
        src: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        let c = self.ctx(ctx)?;
        c.stream(stream)?;
        c.memory.read(src, dst).map_err(fault)
    }

    fn copy_dtod(
        &mut self,
        ctx: ContextId,
        dst: u64,
        src: u64,
        bytes: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        let c = self.ctx(ctx)?;
        c.stream(stream)?;
        // Both ranges are checked whole before a byte moves.
        for (a, what) in [(src, "source"), (dst, "destination")] {
            c.memory.check(a, bytes).map_err(|f| {
                ComputeError::InvalidValue(format!("copy {what} outside an allocation: {f}"))
            })?;
        }
        let mut buf = vec![0u8; bytes.min(COPY_CHUNK) as usize];
        let mut done = 0;
        while done < bytes {
            let n = (bytes - done).min(COPY_CHUNK) as usize;
            c.memory.read(src + done, &mut buf[..n]).map_err(fault)?;
            c.memory.write(dst + done, &buf[..n]).map_err(fault)?;
            done += n as u64;
        }
        Ok(())
    }

    fn stream_create(&mut self, ctx: ContextId) -> ComputeResult<StreamId> {
        let c = self.ctx(ctx)?;
        if c.streams.len() >= MAX_STREAMS_PER_CONTEXT {
            return Err(ComputeError::OutOfMemory(format!(
                "{MAX_STREAMS_PER_CONTEXT} streams"
            )));
        }
        let id = c.id();
        c.streams.insert(id);
        Ok(StreamId(id))
    }

    fn stream_destroy(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        let c = self.ctx(ctx)?;
        if stream == DEFAULT_STREAM || !c.streams.remove(&stream.0) {
            return Err(ComputeError::InvalidHandle(format!("stream {}", stream.0)));
        }
        Ok(())
    }

    fn stream_synchronize(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.ctx(ctx)?.stream(stream)
    }

    fn stream_query(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.ctx(ctx)?.stream(stream)
    }

    fn event_create(&mut self, ctx: ContextId) -> ComputeResult<EventId> {
        let c = self.ctx(ctx)?;
        if c.events.len() >= MAX_EVENTS_PER_CONTEXT {
            return Err(ComputeError::OutOfMemory(format!(
                "{MAX_EVENTS_PER_CONTEXT} events"
            )));
        }
        let id = c.id();
        c.events.insert(id, None);
        Ok(EventId(id))
    }

    fn event_destroy(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.ctx(ctx)?
            .events
            .remove(&event.0)
            .map(drop)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("event {}", event.0)))
    }

    fn event_record(
        &mut self,
        ctx: ContextId,
        event: EventId,
        stream: StreamId,
    ) -> ComputeResult<()> {
        let c = self.ctx(ctx)?;
        c.stream(stream)?;
        *c.event(event)? = Some(Instant::now());
        Ok(())
    }

    fn event_synchronize(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.ctx(ctx)?.event(event).map(drop)
    }

    fn event_query(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.ctx(ctx)?.event(event).map(drop)
    }

    fn event_elapsed_ms(
        &mut self,
        ctx: ContextId,
        start: EventId,
        end: EventId,
    ) -> ComputeResult<f32> {
        let c = self.ctx(ctx)?;
        let a = *c.event(start)?;
        let b = *c.event(end)?;
        match (a, b) {
            (Some(a), Some(b)) => Ok(match b.checked_duration_since(a) {
                Some(d) => d.as_secs_f32() * 1000.0,
                None => -(a - b).as_secs_f32() * 1000.0,
            }),
            _ => Err(ComputeError::InvalidHandle("event never recorded".into())),
        }
    }

    fn launch(&mut self, ctx: ContextId, l: &KernelLaunch<'_>) -> ComputeResult<()> {
        let interrupt = Arc::clone(&self.interrupt);
        interrupt.scope(|| self.launch_in_request(ctx, l, &interrupt))
    }

    fn interrupt(&self) -> Option<Arc<Interrupt>> {
        Some(Arc::clone(&self.interrupt))
    }

    fn take_output(&mut self, ctx: ContextId) -> ComputeResult<String> {
        Ok(std::mem::take(&mut self.contexts.get_mut(ctx)?.output))
    }
}

impl CpuBackend {
    /// A launch inside its request: what the request has left of the instruction budget,
    /// stopped by the request's interrupt; a request already stopped launches nothing.
    fn launch_in_request(
        &mut self,
        ctx: ContextId,
        l: &KernelLaunch<'_>,
        interrupt: &Interrupt,
    ) -> ComputeResult<()> {
        let budget = self
            .config
            .instruction_budget
            .saturating_sub(interrupt.spent());
        let (threads, memory_budget) = (self.config.threads, Arc::clone(&self.config.budget));
        let engine = self.config.engine;
        interrupt.check()?;
        if l.cooperative {
            self.check_co_resident(ctx, l)?;
        }
        let c = self.ctx(ctx)?;
        c.stream(l.stream)?;
        let (module, name) = c
            .functions
            .get(&l.function.0)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("function {}", l.function.0)))?;
        if c.heap.is_none() && c.modules[module].ptx.uses_heap() {
            // A heap of 0 bytes (every `malloc` answers NULL) still has an address.
            let base = c.memory.alloc(c.heap_bytes.max(1))?;
            c.heap = Some(DeviceHeap::new(base, c.heap_bytes));
        }
        // A cooperative launch's grid workspace, zeroed, for this launch only.
        let workspace = if l.cooperative {
            let at = c.memory.alloc(ptx::GRID_WORKSPACE_BYTES)?;
            let size = u32::try_from(ptx::GRID_WORKSPACE_BYTES).unwrap_or(u32::MAX);
            if let Err(f) = c.memory.write(at, &size.to_le_bytes()) {
                c.memory.free(at)?;
                return Err(fault(f));
            }
            Some(at)
        } else {
            None
        };
        let m = &c.modules[module];
        let launch = Launch {
            grid: l.grid,
            block: l.block,
            dynamic_shared_bytes: l.shared_bytes,
            params: l.params,
            symbols: &m.symbols,
            heap: c.heap.as_ref(),
            interrupt: Some(interrupt),
            instruction_budget: budget,
            threads,
            budget: &memory_budget,
            engine,
            cooperative: workspace,
        };
        let result = ptx::launch(&m.ptx, name, &launch, &c.memory as &dyn GlobalMemory);
        if let Some(at) = workspace {
            c.memory.free(at)?;
        }
        match result {
            Ok(stats) => {
                interrupt.spend(stats.warp_instructions);
                let room = MAX_PRINTF_BYTES.saturating_sub(c.output.len());
                let mut cut = stats.output.len().min(room);
                while !stats.output.is_char_boundary(cut) {
                    cut -= 1;
                }
                c.output.push_str(&stats.output[..cut]);
                Ok(())
            }
            Err(e) => {
                if e.is_sticky() {
                    warn!(
                        "context {}: kernel {name} failed, the context is broken: {e}",
                        ctx.0
                    );
                    c.broken = Some(e.clone());
                }
                Err(e)
            }
        }
    }
}

impl CpuBackend {
    /// Refuses a cooperative launch whose grid cannot be resident at once: more blocks than
    /// the occupancy model of the device this backend presents (what the guest's occupancy
    /// queries answer) fits on its multiprocessors. A block or shared memory past the
    /// executor's limits is left to the launch to refuse.
    fn check_co_resident(&mut self, ctx: ContextId, l: &KernelLaunch<'_>) -> ComputeResult<()> {
        let a = self.attributes();
        let block = l.block.iter().fold(1u32, |n, &d| n.saturating_mul(d));
        if block == 0 || block > a.max_threads_per_block || l.shared_bytes > ptx::MAX_SHARED_BYTES {
            return Ok(());
        }
        let f = self.function_attributes(ctx, l.function)?;
        let sm = occupancy::sm_limits(a.compute_capability).ok_or_else(|| {
            ComputeError::InvalidValue(format!(
                "no occupancy model of compute capability {:?}",
                a.compute_capability
            ))
        })?;
        let most = occupancy::co_resident_blocks(&sm, &f, block, l.shared_bytes, a.multiprocessors);
        let blocks = l
            .grid
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(u64::from(d)));
        if blocks > most {
            return Err(ComputeError::CooperativeLaunchTooLarge(format!(
                "{blocks} blocks of {block} threads with {} bytes of dynamic shared memory, \
                 more than the {most} resident at once ({} multiprocessors)",
                l.shared_bytes, a.multiprocessors
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod cooperative_tests;
#[cfg(test)]
pub(crate) mod validation_tests;

#[cfg(test)]
mod tests {
    use super::*;

    const KERNEL: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
        .visible .entry put(.param .u64 p, .param .u32 v)\n{\n.reg .b32 %r<2>;\n.reg .b64 %rd<2>;\n\
        ld.param.u64 %rd1, [p];\nld.param.u32 %r1, [v];\nst.global.u32 [%rd1], %r1;\nret;\n}\n";

    fn backend() -> (CpuBackend, ContextId) {
        let mut be = CpuBackend::new(CpuConfig {
            memory_per_context: 1 << 20,
            ..CpuConfig::default()
        });
        let ctx = be.context_create().unwrap();
        (be, ctx)
    }

    /// `cuMemGetInfo` through the trait: an allocation takes at least its size from the
    /// context's free memory and from another context's (they share the VM's budget), the
    /// total stays, a free gives it back, and an unknown context is refused.
    #[test]
    fn mem_info_counts_allocations_against_the_context_and_the_vm_budget() {
        let mut be = CpuBackend::new(CpuConfig {
            budget: MemoryBudget::new(48 << 20),
            memory_per_context: 32 << 20,
            ..CpuConfig::default()
        });
        let (a, b) = (be.context_create().unwrap(), be.context_create().unwrap());
        let (free, total) = be.mem_info(a).unwrap();
        assert_eq!(total, 32 << 20);
        assert_eq!(total, be.attributes().total_memory);
        assert!(free <= total && free > 24 << 20, "{free}");
        const N: u64 = 24 << 20;
        let addr = be.mem_alloc(a, N).unwrap();
        let (after, total_after) = be.mem_info(a).unwrap();
        assert_eq!(total_after, total);
        assert!(free - after >= N, "{free} -> {after}");
        // The other context's room is the budget's: what is left of 48 MiB, not 32 MiB.
        let (other, _) = be.mem_info(b).unwrap();
        assert!(other < 24 << 20, "{other}");
        assert!(be.mem_alloc(b, other + 1).is_err(), "past what it was told");
        be.mem_free(a, addr).unwrap();
        assert_eq!(be.mem_info(a).unwrap(), (free, total));
        let bad = ContextId(999);
        assert!(matches!(
            be.mem_info(bad),
            Err(ComputeError::InvalidHandle(_))
        ));
    }

    #[test]
    fn an_operators_request_time_bounds_requests_and_scales_the_instruction_budget() {
        let be = CpuBackend::new(CpuConfig::default());
        assert_eq!(be.interrupt().unwrap().time_limit(), DEFAULT_REQUEST_TIME);
        let long = std::time::Duration::from_secs(120);
        let config = CpuConfig::default().with_request_time(long);
        assert_eq!(config.instruction_budget, DEFAULT_INSTRUCTION_BUDGET * 80);
        assert_eq!(
            CpuBackend::new(config).interrupt().unwrap().time_limit(),
            long
        );
        // A shorter time keeps the default budget: the deadline is what binds.
        let short = CpuConfig::default().with_request_time(std::time::Duration::from_millis(100));
        assert_eq!(short.instruction_budget, DEFAULT_INSTRUCTION_BUDGET);
        let most = CpuConfig::default().with_request_time(MAX_REQUEST_TIME);
        assert_eq!(most.instruction_budget, DEFAULT_INSTRUCTION_BUDGET * 2400);
    }

    #[test]
    fn request_times_are_seconds_within_the_named_bound() {
        for (text, ms) in [
            ("1.5", 1500),
            ("120", 120_000),
            ("0.25", 250),
            ("3600", 3_600_000),
        ] {
            assert_eq!(
                parse_request_time(text),
                Ok(std::time::Duration::from_millis(ms)),
                "{text}"
            );
        }
        for bad in ["0", "-1", "3600.5", "1e9", "nan", "inf", "", "ten", "1s"] {
            assert!(parse_request_time(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_placed_context_allocates_inside_its_window_only() {
        let mut be = CpuBackend::new(CpuConfig {
            memory_per_context: 1 << 20,
            ..CpuConfig::default()
        });
        assert!(be.attributes().placement);
        let base = 0x5555_0000_0000u64;
        for (b, size) in [
            (base + 4096, 1 << 20),
            (base, (1 << 20) + 4096),
            (base, 0),
            (0x1000_0000, 1 << 20),
            (0x7fff_fff0_0000, 1 << 20),
            (base, MAX_WINDOW_BYTES + WINDOW_ALIGN),
        ] {
            assert!(
                matches!(
                    be.context_create_at(b, size),
                    Err(ComputeError::InvalidValue(_))
                ),
                "{b:#x}+{size:#x}"
            );
        }
        let window = 4 * WINDOW_ALIGN;
        let ctx = be.context_create_at(base, window).unwrap();
        let a = be.mem_alloc(ctx, 1000).unwrap();
        let b = be.mem_alloc(ctx, WINDOW_ALIGN).unwrap();
        assert!(
            a >= base && b + WINDOW_ALIGN <= base + window,
            "{a:#x} {b:#x}"
        );
        // The window, not the budget, ends it: a third block and its guard do not fit.
        assert!(matches!(
            be.mem_alloc(ctx, WINDOW_ALIGN),
            Err(ComputeError::OutOfMemory(_))
        ));
        be.mem_free(ctx, a).unwrap();
        be.copy_htod(ctx, b, &[1; 16], DEFAULT_STREAM).unwrap();
    }

    #[test]
    fn a_launch_with_a_wrong_parameter_buffer_is_refused_and_not_sticky() {
        let (mut be, ctx) = backend();
        let m = be.module_load(ctx, KERNEL.as_bytes()).unwrap();
        let (f, params) = be.function(ctx, m, "put").unwrap();
        assert_eq!(
            params
                .iter()
                .map(|p| (p.offset, p.size))
                .collect::<Vec<_>>(),
            [(0, 8), (8, 4)]
        );
        let a = be.mem_alloc(ctx, 4).unwrap();
        let short = a.to_le_bytes();
        let full = [&a.to_le_bytes()[..], &42u32.to_le_bytes()].concat();
        let launch = |params| KernelLaunch {
            function: f,
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_bytes: 0,
            stream: DEFAULT_STREAM,
            params,
            cooperative: false,
        };
        assert_eq!(
            be.launch(ctx, &launch(&short)).unwrap_err().cuda_status(),
            1
        );
        be.launch(ctx, &launch(&full)).unwrap();
        let mut back = [0u8; 4];
        be.copy_dtoh(ctx, &mut back, a, DEFAULT_STREAM).unwrap();
        assert_eq!(u32::from_le_bytes(back), 42);
        be.module_unload(ctx, m).unwrap();
        assert_eq!(
            be.launch(ctx, &launch(&full)).unwrap_err().cuda_status(),
            400,
            "functions go with their module"
        );
    }

    #[test]
    fn a_vm_takes_its_share_of_the_host_cpus_by_default() {
        let host = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = CpuConfig::default().threads;
        assert_eq!(threads, (host / VM_SHARE_DIVISOR).max(1));
        assert!(threads < host || host == 1, "{threads} of {host} CPUs");
        assert_eq!(
            CpuBackend::new(CpuConfig::default())
                .attributes()
                .multiprocessors,
            (threads as u32).min(MAX_MULTIPROCESSORS)
        );
    }
}
