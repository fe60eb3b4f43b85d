//! [`CpuBackend`]: the compute backend on the host's CPUs, kernels run by the PTX executor
//! against each context's checked [`DeviceMemory`].
//!
//! The device it reports is virtual: a plausible Hopper-class part (compute capability 9.0,
//! 1024 threads per block, 48 KiB of shared memory per block by default) whose memory is the
//! context budget of the configuration. Streams are in-order queues executed at enqueue: every
//! call has finished when it returns, so stream and event queries are always complete and an
//! event records the [`Instant`] at which the work before it finished.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use super::backend::{
    ComputeBackend, ComputeConfig, ContextId, DeviceAttributes, EventId, FunctionId, FunctionInfo,
    LaunchArgs, MAX_CONTEXTS, MAX_COPY_BYTES, MAX_EVENTS, MAX_FUNCTIONS_PER_CONTEXT,
    MAX_MODULE_IMAGE_BYTES, MAX_MODULES_PER_CONTEXT, MAX_STREAMS, MemInfo, ModuleId, ParamLayout,
    StreamId,
};
use super::memory::{DeviceMemory, GlobalMemory};
use super::ptx::{self, Launch};
use super::{ComputeError, ComputeResult};

/// Shared memory per block the virtual device reports (the CUDA default without opt-in).
const SHARED_PER_BLOCK: u32 = 48 * 1024;
/// Chunk in which memsets and device-to-device copies move data.
const CHUNK: usize = 64 * 1024;

/// A loaded module: the parsed PTX and the device addresses of its variables.
#[derive(Debug)]
struct LoadedModule {
    module: ptx::Module,
    symbols: HashMap<String, u64>,
}

/// A function handle: its module and kernel name.
#[derive(Debug)]
struct Function {
    module: ModuleId,
    name: String,
    param_bytes: u32,
    static_shared_bytes: u32,
}

/// One guest context.
#[derive(Debug)]
struct Context {
    memory: DeviceMemory,
    modules: BTreeMap<ModuleId, LoadedModule>,
    functions: BTreeMap<FunctionId, Function>,
    streams: BTreeMap<StreamId, ()>,
    /// Completion time of each event's last record (`None`: never recorded).
    events: BTreeMap<EventId, Option<Instant>>,
    /// Why the context is unusable, after a sticky error.
    broken: Option<String>,
}

/// The compute backend on the CPU (see the module documentation).
#[derive(Debug)]
pub struct CpuBackend {
    config: ComputeConfig,
    contexts: BTreeMap<ContextId, Context>,
    next_id: u32,
}

impl CpuBackend {
    /// A backend with no contexts.
    pub fn new(config: ComputeConfig) -> Self {
        CpuBackend {
            config: ComputeConfig {
                threads: config.threads.max(1),
                ..config
            },
            contexts: BTreeMap::new(),
            next_id: 1,
        }
    }

    fn fresh_id(&mut self) -> ComputeResult<u32> {
        let id = self.next_id;
        self.next_id = id
            .checked_add(1)
            .ok_or_else(|| ComputeError::OutOfMemory("object ids exhausted".into()))?;
        Ok(id)
    }

    /// The context, unless unknown or broken.
    fn ctx(&mut self, ctx: ContextId) -> ComputeResult<&mut Context> {
        let c = self
            .contexts
            .get_mut(&ctx)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("context {}", ctx.0)))?;
        if let Some(why) = &c.broken {
            return Err(ComputeError::ContextBroken(why.clone()));
        }
        Ok(c)
    }

    /// Runs `f` on a usable context; a sticky error it returns breaks the context.
    fn with_ctx<T>(
        &mut self,
        ctx: ContextId,
        f: impl FnOnce(&mut Context) -> ComputeResult<T>,
    ) -> ComputeResult<T> {
        let c = self.ctx(ctx)?;
        let r = f(c);
        if let Err(e) = &r
            && e.is_sticky()
        {
            log::warn!("compute context {}: {e}; the context is broken", ctx.0);
            c.broken = Some(e.to_string());
        }
        r
    }
}

impl Context {
    fn stream(&self, stream: StreamId) -> ComputeResult<()> {
        if stream == StreamId::DEFAULT || self.streams.contains_key(&stream) {
            Ok(())
        } else {
            Err(ComputeError::InvalidHandle(format!("stream {}", stream.0)))
        }
    }

    fn event(&mut self, event: EventId) -> ComputeResult<&mut Option<Instant>> {
        self.events
            .get_mut(&event)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("event {}", event.0)))
    }

    /// Checks that `[addr, addr + len)` lies inside one allocation (not sticky: the driver
    /// refuses such a copy before running it).
    fn range(&self, addr: u64, len: u64) -> ComputeResult<()> {
        if len > MAX_COPY_BYTES {
            return Err(ComputeError::InvalidValue(format!(
                "{len} bytes, past {MAX_COPY_BYTES}"
            )));
        }
        match self.memory.range_of(addr) {
            Some((base, size)) if addr - base <= size && size - (addr - base) >= len => Ok(()),
            _ => Err(ComputeError::InvalidValue(format!(
                "{len} bytes at {addr:#x} are not inside one allocation"
            ))),
        }
    }

    fn free_module(&mut self, id: ModuleId) -> ComputeResult<()> {
        let m = self
            .modules
            .remove(&id)
            .ok_or_else(|| ComputeError::InvalidHandle(format!("module {}", id.0)))?;
        for addr in m.symbols.values() {
            self.memory.free(*addr)?;
        }
        self.functions.retain(|_, f| f.module != id);
        Ok(())
    }
}

/// Decodes a module image: PTX text (NUL-terminated or not).
fn ptx_text(image: &[u8]) -> ComputeResult<&str> {
    let text = match image.iter().position(|&b| b == 0) {
        Some(n) => &image[..n],
        None => image,
    };
    std::str::from_utf8(text)
        .ok()
        .filter(|t| t.contains(".version"))
        .ok_or_else(|| ComputeError::InvalidImage("not PTX text".into()))
}

fn fault(e: super::Fault) -> ComputeError {
    ComputeError::IllegalAddress(e.to_string())
}

impl ComputeBackend for CpuBackend {
    fn attributes(&self) -> DeviceAttributes {
        DeviceAttributes {
            name: "vgpu virtual compute device (CPU)".into(),
            total_memory: self.config.context_memory,
            compute_capability: (9, 0),
            multiprocessor_count: self.config.threads as u32,
            max_threads_per_block: ptx::MAX_THREADS_PER_BLOCK,
            max_block_dim: [1024, 1024, 64],
            max_grid_dim: [i32::MAX as u32, 65535, 65535],
            shared_memory_per_block: SHARED_PER_BLOCK,
            warp_size: 32,
            clock_rate_khz: 1_000_000,
        }
    }

    fn ctx_create(&mut self) -> ComputeResult<ContextId> {
        if self.contexts.len() >= MAX_CONTEXTS {
            return Err(ComputeError::OutOfMemory(format!(
                "{MAX_CONTEXTS} contexts"
            )));
        }
        let id = ContextId(self.fresh_id()?);
        self.contexts.insert(
            id,
            Context {
                memory: DeviceMemory::new(self.config.context_memory),
                modules: BTreeMap::new(),
                functions: BTreeMap::new(),
                streams: BTreeMap::new(),
                events: BTreeMap::new(),
                broken: None,
            },
        );
        log::debug!("compute context {} created", id.0);
        Ok(id)
    }

    fn ctx_destroy(&mut self, ctx: ContextId) -> ComputeResult<()> {
        self.contexts
            .remove(&ctx)
            .map(|_| log::debug!("compute context {} destroyed", ctx.0))
            .ok_or_else(|| ComputeError::InvalidHandle(format!("context {}", ctx.0)))
    }

    fn ctx_synchronize(&mut self, ctx: ContextId) -> ComputeResult<()> {
        self.ctx(ctx).map(|_| ())
    }

    fn module_load(&mut self, ctx: ContextId, image: &[u8]) -> ComputeResult<ModuleId> {
        if image.len() > MAX_MODULE_IMAGE_BYTES {
            return Err(ComputeError::InvalidValue(format!(
                "module image of {} bytes",
                image.len()
            )));
        }
        let id = ModuleId(self.fresh_id()?);
        self.with_ctx(ctx, |c| {
            if c.modules.len() >= MAX_MODULES_PER_CONTEXT {
                return Err(ComputeError::OutOfMemory(format!(
                    "{MAX_MODULES_PER_CONTEXT} modules"
                )));
            }
            let module = ptx::Module::parse(ptx_text(image)?)?;
            let mut symbols = HashMap::new();
            for g in module.globals() {
                let placed = c.memory.alloc(g.size.max(1)).and_then(|addr| {
                    symbols.insert(g.name.clone(), addr);
                    c.memory.write(addr, &g.init).map_err(fault)
                });
                if let Err(e) = placed {
                    for addr in symbols.values() {
                        c.memory.free(*addr)?;
                    }
                    return Err(e);
                }
            }
            c.modules.insert(id, LoadedModule { module, symbols });
            Ok(id)
        })
    }

    fn module_unload(&mut self, ctx: ContextId, module: ModuleId) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| c.free_module(module))
    }

    fn function_get(
        &mut self,
        ctx: ContextId,
        module: ModuleId,
        name: &str,
    ) -> ComputeResult<FunctionInfo> {
        let id = FunctionId(self.fresh_id()?);
        self.with_ctx(ctx, |c| {
            let m = c
                .modules
                .get(&module)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("module {}", module.0)))?;
            let k = m
                .module
                .kernel(name)
                .ok_or_else(|| ComputeError::NotFound(format!("kernel {name:?}")))?;
            let info = FunctionInfo {
                id,
                params: k
                    .params
                    .iter()
                    .map(|p| ParamLayout {
                        offset: p.offset,
                        size: p.size,
                        align: p.align,
                    })
                    .collect(),
                param_bytes: k.param_bytes,
            };
            // A repeated lookup hands out the handle it gave before.
            if let Some((old, _)) = c
                .functions
                .iter()
                .find(|(_, f)| f.module == module && f.name == name)
            {
                return Ok(FunctionInfo { id: *old, ..info });
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
                    name: name.to_owned(),
                    param_bytes: k.param_bytes,
                    static_shared_bytes: k.static_shared_bytes,
                },
            );
            Ok(info)
        })
    }

    fn mem_alloc(&mut self, ctx: ContextId, size: u64) -> ComputeResult<u64> {
        self.with_ctx(ctx, |c| c.memory.alloc(size))
    }

    fn mem_free(&mut self, ctx: ContextId, addr: u64) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| {
            if c.modules
                .values()
                .any(|m| m.symbols.values().any(|&a| a == addr))
            {
                return Err(ComputeError::InvalidValue(format!(
                    "{addr:#x} is a module variable"
                )));
            }
            c.memory.free(addr)
        })
    }

    fn mem_get_info(&mut self, ctx: ContextId) -> ComputeResult<MemInfo> {
        let total = self.config.context_memory;
        self.with_ctx(ctx, |c| {
            Ok(MemInfo {
                free: total.saturating_sub(c.memory.used()),
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
        self.with_ctx(ctx, |c| {
            c.stream(stream)?;
            if count == 0 {
                return Ok(());
            }
            c.range(dst, count)?;
            c.memory.fill(dst, value, count).map_err(fault)
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
        self.with_ctx(ctx, |c| {
            c.stream(stream)?;
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
            let pattern: Vec<u8> = value.to_le_bytes().repeat(CHUNK / 4);
            let mut done = 0;
            while done < bytes {
                let n = (bytes - done).min(CHUNK as u64);
                c.memory
                    .write(dst + done, &pattern[..n as usize])
                    .map_err(fault)?;
                done += n;
            }
            Ok(())
        })
    }

    fn copy_htod(
        &mut self,
        ctx: ContextId,
        dst: u64,
        src: &[u8],
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| {
            c.stream(stream)?;
            if src.is_empty() {
                return Ok(());
            }
            c.range(dst, src.len() as u64)?;
            c.memory.write(dst, src).map_err(fault)
        })
    }

    fn copy_dtoh(
        &mut self,
        ctx: ContextId,
        dst: &mut [u8],
        src: u64,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| {
            c.stream(stream)?;
            if dst.is_empty() {
                return Ok(());
            }
            c.range(src, dst.len() as u64)?;
            c.memory.read(src, dst).map_err(fault)
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
        self.with_ctx(ctx, |c| {
            c.stream(stream)?;
            if bytes == 0 {
                return Ok(());
            }
            c.range(src, bytes)?;
            c.range(dst, bytes)?;
            // memmove semantics: copy backwards when the destination overlaps the source's tail.
            let mut buf = vec![0u8; CHUNK.min(bytes as usize)];
            let backwards = dst > src && dst < src + bytes;
            let mut done = 0;
            while done < bytes {
                let n = (bytes - done).min(CHUNK as u64);
                let off = if backwards { bytes - done - n } else { done };
                let b = &mut buf[..n as usize];
                c.memory.read(src + off, b).map_err(fault)?;
                c.memory.write(dst + off, b).map_err(fault)?;
                done += n;
            }
            Ok(())
        })
    }

    fn stream_create(&mut self, ctx: ContextId) -> ComputeResult<StreamId> {
        let id = StreamId(self.fresh_id()?);
        self.with_ctx(ctx, |c| {
            if c.streams.len() >= MAX_STREAMS {
                return Err(ComputeError::OutOfMemory(format!("{MAX_STREAMS} streams")));
            }
            c.streams.insert(id, ());
            Ok(id)
        })
    }

    fn stream_destroy(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| {
            c.streams
                .remove(&stream)
                .ok_or_else(|| ComputeError::InvalidHandle(format!("stream {}", stream.0)))
        })
    }

    fn stream_synchronize(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| c.stream(stream))
    }

    fn stream_query(&mut self, ctx: ContextId, stream: StreamId) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| c.stream(stream))
    }

    fn event_create(&mut self, ctx: ContextId) -> ComputeResult<EventId> {
        let id = EventId(self.fresh_id()?);
        self.with_ctx(ctx, |c| {
            if c.events.len() >= MAX_EVENTS {
                return Err(ComputeError::OutOfMemory(format!("{MAX_EVENTS} events")));
            }
            c.events.insert(id, None);
            Ok(id)
        })
    }

    fn event_destroy(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| {
            c.events
                .remove(&event)
                .map(|_| ())
                .ok_or_else(|| ComputeError::InvalidHandle(format!("event {}", event.0)))
        })
    }

    fn event_record(
        &mut self,
        ctx: ContextId,
        event: EventId,
        stream: StreamId,
    ) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| {
            c.stream(stream)?;
            *c.event(event)? = Some(Instant::now());
            Ok(())
        })
    }

    fn event_synchronize(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| c.event(event).map(|_| ()))
    }

    fn event_query(&mut self, ctx: ContextId, event: EventId) -> ComputeResult<()> {
        self.with_ctx(ctx, |c| c.event(event).map(|_| ()))
    }

    fn event_elapsed_ms(
        &mut self,
        ctx: ContextId,
        start: EventId,
        end: EventId,
    ) -> ComputeResult<f32> {
        self.with_ctx(ctx, |c| {
            let s = *c.event(start)?;
            let e = *c.event(end)?;
            match (s, e) {
                (Some(s), Some(e)) => {
                    let ms = if e >= s {
                        (e - s).as_secs_f64() * 1e3
                    } else {
                        -((s - e).as_secs_f64() * 1e3)
                    };
                    Ok(ms as f32)
                }
                _ => Err(ComputeError::InvalidHandle(
                    "elapsed time of an event never recorded".into(),
                )),
            }
        })
    }

    fn launch(&mut self, ctx: ContextId, args: &LaunchArgs<'_>) -> ComputeResult<()> {
        let attrs = self.attributes();
        let budget = self.config.instruction_budget;
        let threads = self.config.threads;
        self.with_ctx(ctx, |c| {
            c.stream(args.stream)?;
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
            let threads_per_block = args.block.iter().product::<u32>();
            if threads_per_block > attrs.max_threads_per_block {
                return Err(ComputeError::LaunchOutOfResources(format!(
                    "{threads_per_block} threads per block"
                )));
            }
            if u64::from(args.shared_bytes) + u64::from(f.static_shared_bytes)
                > u64::from(attrs.shared_memory_per_block)
            {
                return Err(ComputeError::LaunchOutOfResources(format!(
                    "{} bytes of dynamic shared memory",
                    args.shared_bytes
                )));
            }
            let m = &c.modules[&f.module];
            let stats = ptx::launch(
                &m.module,
                &f.name,
                &Launch {
                    grid: args.grid,
                    block: args.block,
                    dynamic_shared_bytes: args.shared_bytes,
                    params: args.params,
                    symbols: &m.symbols,
                    instruction_budget: budget,
                    threads,
                },
                &c.memory,
            )?;
            log::trace!(
                "compute context {}: {} ran {} blocks, {} warp-instructions",
                ctx.0,
                f.name,
                stats.blocks,
                stats.warp_instructions
            );
            if !stats.output.is_empty() {
                log::info!(
                    "compute context {} printf: {}",
                    ctx.0,
                    stats.output.trim_end()
                );
            }
            Ok(())
        })
    }
}

#[cfg(test)]
pub(crate) mod tests;
