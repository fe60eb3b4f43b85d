//! The PTX compiler: kernels as native code, for speed on a host without a GPU.
//!
//! A kernel compiles (with Cranelift) to a function that runs ONE thread until it exits or
//! reaches an instruction that needs the other threads of its warp or block (`bar.sync`,
//! `shfl.sync`, `vote.sync`, `activemask`, `bar.warp.sync`): there it saves its registers and
//! returns where to resume. The block runtime here runs each thread of a block in turn until
//! every one is waiting or has exited, then executes the warp-collective instructions whose
//! lanes have all arrived and releases the barriers whose threads have, and goes on (see
//! `docs/PTX.md`). Registers live in machine registers between those points; memory accesses
//! are bounds-checked inline against the thread's areas and the allocation it last touched,
//! and everything else goes through the interpreter's own functions (`lane`), so both engines
//! compute the same bits.
//!
//! Kernels compile lazily, once per module, on their first launch; a kernel the compiler
//! refuses (see [`codegen::refusal`]) runs on the interpreter, the reason logged once.

mod codegen;
mod lane;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cranelift_jit::JITModule;
use cranelift_module::FuncId;
use log::{debug, info};

use super::exec::{self, BARRIERS, BLOCK_SETUP_COST, LaunchRegisters, WARP};
use super::ir::{BarRedOp, Op, Src, SymRef};
use super::{Launch, LaunchStats, Module};
use crate::compute::{ComputeError, ComputeResult, GlobalMemory};

/// Thread-instructions a compiled thread runs between two looks at the launch's stop flag,
/// interrupt and budget: about 0.1 ms of compiled code, so a cancelled launch stops well
/// within 10 ms.
pub(super) const FUEL_CHECK: i64 = 1 << 17;
/// Thread-instructions one cost unit of the budget stands for: a warp-instruction of the
/// interpreter is 32 of them, so a launch is charged what the interpreter would be charged.
const THREAD_INSTRUCTIONS_PER_UNIT: u64 = WARP as u64;
/// Largest function the compiler takes (instructions): Cranelift's time and memory grow
/// with a function's size; past it the kernel runs on the interpreter.
pub(super) const MAX_COMPILED_INSTRUCTIONS: usize = 64 * 1024;
/// Most Cranelift instructions a kernel (with the functions it calls) may translate to.
/// Compiling takes 0.3 to 4 us per instruction on a 2-core host (the most where memory
/// accesses dominate: each is some 25 to 60 instructions with its checks and helper call),
/// and it runs inside one request that has [`DEFAULT_REQUEST_TIME`] in all: at this limit a
/// compile takes at most about 0.6 s. Past it the kernel runs on the interpreter (the largest
/// of NVIDIA's samples, CUB's radix-sort kernels, translate to some 370 Ki; the next largest, 80 Ki, compile in 0.15 s).
///
/// [`DEFAULT_REQUEST_TIME`]: crate::compute::backend::DEFAULT_REQUEST_TIME
pub(super) const MAX_COMPILED_IR: usize = 128 * 1024;
/// Most registers of a compiled function: each is a variable of the SSA builder.
pub(super) const MAX_COMPILED_REGISTERS: usize = 16 * 1024;

/// What a compiled kernel function returns.
pub(super) const EXITED: u32 = 0;
pub(super) const YIELDED: u32 = 1;
pub(super) const FAILED: u32 = 2;
/// What a compiled `.func` returns besides FAILED: it returned, or its thread exited.
pub(super) const RETURNED: u32 = 0;
pub(super) const THREAD_EXITED: u32 = 1;

/// One thread's state as compiled code sees it (`codegen` reads fields at their offsets).
#[repr(C)]
pub(super) struct Thread {
    /// This thread's registers, in launch slot order.
    pub regs: *mut u64,
    /// Where the kernel function resumes (0: its start).
    pub resume: u32,
    /// The instruction a yielding thread waits at.
    pub stop_pc: u32,
    /// Thread-instructions run and not yet charged.
    pub fuel: u64,
    pub local: *mut u8,
    pub local_len: u64,
    pub fparam: *mut u8,
    pub fparam_len: u64,
    pub shared: *mut u8,
    pub shared_len: u64,
    pub params: *const u8,
    pub params_len: u64,
    /// [`SPAN_SLOTS`] allocations global accesses reached through the helper (`len` 0:
    /// none): a load or store at `pc` checks entry `pc % SPAN_SLOTS` inline.
    pub spans: *mut Span,
    /// The texture and surface objects the host thread decoded during the launch.
    pub objects: *mut lane::KnownObjects,
    /// tid.xyz, ntid.xyz, ctaid.xyz, nctaid.xyz, laneid, warpid, nwarpid, dynamic shared bytes.
    pub sreg: [u32; 16],
    /// The carry flag of `add.cc` and the like.
    pub carry: u32,
    pub symbols: *const u64,
    /// The launch: for the helpers.
    pub env: *const Env<'static>,
}

/// An allocation as host memory, as the inline checks of global accesses read it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct Span {
    pub base: u64,
    pub len: u64,
    pub ptr: *mut u8,
}

/// Entries of a host thread's span cache (24 bytes each, on the worker's stack): kernels
/// touch a few allocations each, from a few instructions each, but a loop's loads and stores
/// of different allocations must not share an entry (each would evict the other's and take
/// the helper's path every time, as alignedTypes' unrolled copies of 32-byte structures did
/// with 16), so instructions share one only 256 apart.
pub(super) const SPAN_SLOTS: usize = 256;

/// Index of the special-register words in [`Thread::sreg`].
pub(super) const SREG_TID: usize = 0;
pub(super) const SREG_NTID: usize = 3;
pub(super) const SREG_CTAID: usize = 6;
pub(super) const SREG_NCTAID: usize = 9;
pub(super) const SREG_LANE: usize = 12;
pub(super) const SREG_WARP: usize = 13;
pub(super) const SREG_NWARP: usize = 14;
pub(super) const SREG_DYN_SHARED: usize = 15;

/// What the helpers of a launch share.
pub(super) struct Env<'a> {
    pub m: &'a super::parse::Parsed,
    pub memory: &'a dyn GlobalMemory,
    pub l: &'a Launch<'a>,
    pub regs: &'a LaunchRegisters,
    pub executed: AtomicU64,
    /// Times [`Env::charge`] ran.
    pub checks: AtomicU64,
    pub stop: AtomicBool,
    pub error: Mutex<Option<ComputeError>>,
    pub started: Instant,
}

impl Env<'_> {
    /// Records the launch's first error and stops every thread at its next check.
    pub fn fail(&self, e: ComputeError) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Charges `fuel` thread-instructions; whether the launch may go on (stopped, cancelled,
    /// past its deadline or its budget: no).
    pub fn charge(&self, fuel: u64) -> ComputeResult<()> {
        self.checks.fetch_add(1, Ordering::Relaxed);
        let units = fuel.div_ceil(THREAD_INSTRUCTIONS_PER_UNIT);
        let total = self
            .executed
            .fetch_add(units, Ordering::Relaxed)
            .saturating_add(units);
        if self.stop.load(Ordering::Relaxed) {
            return Err(ComputeError::LaunchTimeout("launch stopped".into()));
        }
        if let Some(i) = self.l.interrupt {
            i.check()?;
        }
        if total > self.l.instruction_budget {
            return Err(ComputeError::LaunchTimeout(format!(
                "kernel ran past its budget of {} cost units ({:.1} s)",
                self.l.instruction_budget,
                self.started.elapsed().as_secs_f64()
            )));
        }
        Ok(())
    }

    /// Where register `r` is in a thread's registers.
    pub fn slot(&self, r: u32) -> usize {
        self.regs.slots[(r - self.regs.base) as usize] as usize
    }
}

/// A compiled kernel.
enum Kernel {
    /// One thread, resumable at its collective instructions.
    Resumable(unsafe extern "C" fn(*mut Thread) -> u32),
    /// Every thread of a block in turn, each to its end (a kernel without collectives).
    Looped(unsafe extern "C" fn(*mut Thread, u32) -> u32),
}

/// The compiled code of one module: filled kernel by kernel.
#[derive(Default)]
pub(super) struct Cache {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    jit: Option<JITModule>,
    /// Cranelift functions of the module's PTX functions, declared once.
    funcs: HashMap<u32, FuncId>,
    /// Kernels by function index: compiled, or why not.
    kernels: HashMap<u32, Result<Arc<Kernel>, String>>,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("jit::Cache")
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(jit) = state.jit.take() {
            // SAFETY: the cache is dropped with its module; a launch borrows the module, so no
            // compiled function runs now, and the kernels' pointers go with the cache.
            unsafe { jit.free_memory() };
        }
    }
}

impl Cache {
    /// The compiled kernel of function `f`, compiled now if it was not; `Err` the reason the
    /// compiler refuses it (logged once).
    fn kernel(
        &self,
        m: &super::parse::Parsed,
        f: u32,
        regs: &LaunchRegisters,
    ) -> Result<Arc<Kernel>, String> {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let State {
            jit,
            funcs,
            kernels,
        } = &mut *guard;
        if let Some(k) = kernels.get(&f) {
            return k.clone();
        }
        let started = Instant::now();
        let result = codegen::compile(jit, funcs, m, f, regs).map(|(entry, looped)| {
            Arc::new(if looped {
                // SAFETY: `compile` returns the finalized entry of a function with this
                // signature when it says the kernel is looped.
                Kernel::Looped(unsafe {
                    std::mem::transmute::<*const u8, unsafe extern "C" fn(*mut Thread, u32) -> u32>(
                        entry,
                    )
                })
            } else {
                // SAFETY: as above, for a resumable kernel.
                Kernel::Resumable(unsafe {
                    std::mem::transmute::<*const u8, unsafe extern "C" fn(*mut Thread) -> u32>(
                        entry,
                    )
                })
            })
        });
        let name = &m.funcs[f as usize].name;
        match &result {
            Ok(_) => debug!("kernel {name} compiled in {:?}", started.elapsed()),
            Err(why) => info!("kernel {name} runs on the interpreter: {why}"),
        }
        kernels.insert(f, result.clone());
        result
    }
}

/// Runs `kernel` compiled; `None` when the compiler refuses it.
pub(super) fn launch(
    module: &Module,
    kernel: &str,
    l: &Launch<'_>,
    memory: &dyn GlobalMemory,
) -> Option<ComputeResult<LaunchStats>> {
    let plan = match exec::plan(module, kernel, l) {
        Ok(p) => p,
        Err(e) => return Some(Err(e)),
    };
    let m = &module.parsed;
    if module.lockstep {
        return None;
    }
    let compiled = module.jit.kernel(m, plan.f, &plan.regs).ok()?;
    Some(run(m, &compiled, plan, l, memory))
}

/// Host bytes one block of the compiled engine holds: per thread its registers, local and
/// `.param` memory and its state; the shared memory.
fn block_bytes(m: &super::parse::Parsed, regs: u64, threads: u64, shared: u32) -> u64 {
    let thread = regs
        .saturating_mul(8)
        .saturating_add(u64::from(m.local_bytes))
        .saturating_add(u64::from(m.fparam_bytes))
        .saturating_add((size_of::<Thread>() + size_of::<Wait>()) as u64);
    thread
        .saturating_mul(threads)
        .saturating_add(u64::from(shared))
}

fn run(
    m: &super::parse::Parsed,
    k: &Kernel,
    plan: exec::Plan,
    l: &Launch<'_>,
    memory: &dyn GlobalMemory,
) -> ComputeResult<LaunchStats> {
    let nregs = plan.regs.held.len() as u64;
    let bytes = block_bytes(m, nregs, u64::from(plan.nthreads), plan.shared);
    let (threads, _held) = exec::charge_blocks(l, plan.blocks, bytes)?;
    let env = Env {
        m,
        memory,
        l,
        regs: &plan.regs,
        executed: AtomicU64::new(0),
        checks: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        error: Mutex::new(None),
        started: Instant::now(),
    };
    let next = AtomicU64::new(0);
    // A block's setup is charged what the interpreter charges for it, so a launch costs the
    // same units of the budget on either engine.
    let nwarps = u64::from(plan.nthreads.div_ceil(WARP as u32));
    let setup = BLOCK_SETUP_COST.saturating_mul(nwarps).saturating_add(
        exec::block_bytes(m, nregs, nwarps, plan.shared) / exec::SETUP_BYTES_PER_UNIT,
    );
    let worker = || {
        let mut spans = [Span {
            base: 0,
            len: 0,
            ptr: std::ptr::null_mut(),
        }; SPAN_SLOTS];
        let mut objects = lane::KnownObjects::default();
        let mut block = None;
        loop {
            if env.stop.load(Ordering::Relaxed) {
                return;
            }
            let b = next.fetch_add(1, Ordering::Relaxed);
            if b >= plan.blocks {
                return;
            }
            let r = env
                .charge(setup.saturating_mul(THREAD_INSTRUCTIONS_PER_UNIT))
                .and_then(|()| {
                    let block = block.get_or_insert_with(|| {
                        Block::new(&env, &plan, spans.as_mut_ptr(), &mut objects)
                    });
                    block.start(b);
                    block.run(k)
                });
            if let Err(e) = r {
                env.fail(e);
                return;
            }
        }
    };
    debug!(
        "compiled launch of {} blocks of {bytes} host bytes on {threads} threads",
        plan.blocks
    );
    exec::spread(threads, l.cooperative.is_some(), worker, |e| env.fail(e));
    if let Some(e) = env.error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(LaunchStats {
        warp_instructions: env.executed.load(Ordering::Relaxed),
        blocks: plan.blocks,
        threads,
        block_bytes: bytes,
        output: String::new(),
        compiled: true,
        checks: env.checks.load(Ordering::Relaxed),
    })
}

/// What a thread of a block is doing between two runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    Ready,
    Exited,
    /// At a `bar.sync` (barrier id) or a warp-collective instruction (its pc).
    Barrier(u8),
    Warp(u32),
}

struct Block<'e, 'a> {
    env: &'e Env<'a>,
    threads: Vec<Thread>,
    wait: Vec<Wait>,
    regs: Vec<u64>,
    /// The threads' memory areas (their pointers point into these).
    local: Vec<u8>,
    fparam: Vec<u8>,
    shared: Vec<u8>,
    /// Per barrier: the thread count it was used with (`None`: the whole block).
    expected: [Option<u32>; BARRIERS],
    /// Per barrier: the warps that arrived with `bar.arrive` (which does not wait) since it
    /// last completed.
    arrived: [u32; BARRIERS],
    /// Per barrier: the warps with a thread waiting at it.
    waiting: [u32; BARRIERS],
    /// Per barrier: how many threads arriving at it by `bar.red` had a false and a true
    /// predicate.
    votes: [[u32; 2]; BARRIERS],
    /// The warps with a thread waiting at a warp-collective instruction.
    at_collective: u32,
    /// Per warp: its threads that have not exited.
    running: [u8; WARP],
    nregs: usize,
}

impl<'e, 'a> Block<'e, 'a> {
    /// A host thread's block, made once and [`start`](Self::start)ed for each block it runs:
    /// registers need no clearing (compiled code defines a register before it reads it, and
    /// stores what it saves), the memory areas are cleared per block.
    fn new(
        env: &'e Env<'a>,
        plan: &exec::Plan,
        spans: *mut Span,
        objects: *mut lane::KnownObjects,
    ) -> Self {
        let l = env.l;
        let [gx, gy, gz] = l.grid;
        let [bx, by, bz] = l.block;
        let n = plan.nthreads as usize;
        let nregs = plan.regs.held.len();
        let (lb, fb) = (env.m.local_bytes as usize, env.m.fparam_bytes as usize);
        let mut regs = vec![0u64; nregs * n];
        let mut local = vec![0u8; lb * n];
        let mut fparam = vec![0u8; fb * n];
        let mut shared = vec![0u8; plan.shared as usize];
        let nwarps = plan.nthreads.div_ceil(WARP as u32);
        let threads = (0..n)
            .map(|t| {
                let tu = t as u32;
                let mut sreg = [0u32; 16];
                sreg[SREG_TID..SREG_TID + 3].copy_from_slice(&[
                    tu % bx,
                    (tu / bx) % by,
                    tu / (bx * by),
                ]);
                sreg[SREG_NTID..SREG_NTID + 3].copy_from_slice(&[bx, by, bz]);
                sreg[SREG_NCTAID..SREG_NCTAID + 3].copy_from_slice(&[gx, gy, gz]);
                sreg[SREG_LANE] = tu % WARP as u32;
                sreg[SREG_WARP] = tu / WARP as u32;
                sreg[SREG_NWARP] = nwarps;
                sreg[SREG_DYN_SHARED] = l.dynamic_shared_bytes;
                Thread {
                    regs: regs[t * nregs..].as_mut_ptr(),
                    resume: 0,
                    stop_pc: 0,
                    fuel: 0,
                    local: local[t * lb..].as_mut_ptr(),
                    local_len: lb as u64,
                    fparam: fparam[t * fb..].as_mut_ptr(),
                    fparam_len: fb as u64,
                    shared: shared.as_mut_ptr(),
                    shared_len: shared.len() as u64,
                    params: l.params.as_ptr(),
                    params_len: l.params.len() as u64,
                    spans,
                    objects,
                    sreg,
                    carry: 0,
                    symbols: l.symbols.as_ptr(),
                    env: (env as *const Env<'a>).cast(),
                }
            })
            .collect();
        Block {
            env,
            threads,
            wait: vec![Wait::Ready; n],
            regs,
            local,
            fparam,
            shared,
            expected: [None; BARRIERS],
            arrived: [0; BARRIERS],
            waiting: [0; BARRIERS],
            votes: [[0; 2]; BARRIERS],
            at_collective: 0,
            running: [0; WARP],
            nregs,
        }
    }

    /// Sets the block up as block `linear` of the grid.
    fn start(&mut self, linear: u64) {
        let [gx, gy, _] = self.env.l.grid;
        let ctaid = [
            (linear % u64::from(gx)) as u32,
            ((linear / u64::from(gx)) % u64::from(gy)) as u32,
            (linear / (u64::from(gx) * u64::from(gy))) as u32,
        ];
        for t in &mut self.threads {
            t.sreg[SREG_CTAID..SREG_CTAID + 3].copy_from_slice(&ctaid);
            t.resume = 0;
            t.fuel = 0;
            t.carry = 0;
        }
        self.wait.fill(Wait::Ready);
        self.local.fill(0);
        self.fparam.fill(0);
        self.shared.fill(0);
        self.expected = [None; BARRIERS];
        self.arrived = [0; BARRIERS];
        self.waiting = [0; BARRIERS];
        self.votes = [[0; 2]; BARRIERS];
        self.at_collective = 0;
        let n = self.threads.len();
        for (w, r) in self.running.iter_mut().enumerate() {
            *r = n.saturating_sub(w * WARP).min(WARP) as u8;
        }
    }

    fn run(&mut self, k: &Kernel) -> ComputeResult<()> {
        let entry = match *k {
            Kernel::Resumable(entry) => entry,
            Kernel::Looped(block) => {
                let n = self.threads.len() as u32;
                // SAFETY: as for a resumable kernel (below), for all the block's threads: the
                // function reads `n` consecutive threads from the pointer.
                let r = unsafe { block(self.threads.as_mut_ptr(), n) };
                let fuel = self
                    .threads
                    .iter_mut()
                    .map(|t| std::mem::take(&mut t.fuel))
                    .sum();
                if r != EXITED {
                    return Err(self.failure());
                }
                return self.env.charge(fuel);
            }
        };
        loop {
            let mut fuel = 0u64;
            let mut ran = false;
            for t in 0..self.threads.len() {
                if self.wait[t] != Wait::Ready {
                    continue;
                }
                ran = true;
                let th = &mut self.threads[t];
                // SAFETY: the entry is a compiled kernel of this launch's module, called with a
                // thread whose pointers point into this block's live buffers, sized as
                // recorded; the compiled code checks every access against those sizes.
                let r = unsafe { entry(th) };
                fuel += std::mem::take(&mut th.fuel);
                self.wait[t] = match r {
                    EXITED => {
                        self.running[t / WARP] -= 1;
                        Wait::Exited
                    }
                    YIELDED => self.arrive(t)?,
                    _ => return Err(self.failure()),
                };
            }
            self.env.charge(fuel)?;
            if self.wait.iter().all(|w| *w == Wait::Exited) {
                return Ok(());
            }
            let progressed = self.release()?;
            if !progressed && !ran {
                return Err(ComputeError::LaunchTimeout(
                    "every warp of a block waits at a barrier that cannot complete".into(),
                ));
            }
        }
    }

    /// The error a failed run of compiled code recorded.
    fn failure(&self) -> ComputeError {
        let e = self
            .env
            .error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        e.unwrap_or_else(|| ComputeError::LaunchTimeout("launch stopped".into()))
    }

    /// The value of `src` for thread `t` (registers as it saved them at its yield).
    fn val(&self, t: usize, src: Src) -> u64 {
        match src {
            Src::Reg(r) => self.regs[t * self.nregs + self.env.slot(r)],
            Src::Imm(v) => v,
            Src::Special(s) => lane::special(&self.threads[t], s),
            Src::Sym(SymRef::Global(i), off) => {
                self.env.l.symbols[i as usize].wrapping_add_signed(off)
            }
            Src::Sym(_, off) => off as u64,
        }
    }

    fn set(&mut self, t: usize, d: u32, v: u64) {
        if d != super::ir::SINK {
            let bits = self.env.m.reg_bits[d as usize];
            let mask = if bits >= 64 {
                u64::MAX
            } else {
                (1u64 << bits) - 1
            };
            let i = t * self.nregs + self.env.slot(d);
            self.regs[i] = v & mask;
        }
    }

    /// A thread stopped at its `stop_pc`: what it now waits for.
    fn arrive(&mut self, t: usize) -> ComputeResult<Wait> {
        let pc = self.threads[t].stop_pc;
        let m = self.env.m;
        let bad = |what: String| ComputeError::IllegalInstruction(what);
        match m.code[pc as usize].op {
            Op::Bar { id, count, .. } | Op::BarRed { id, count, .. } => {
                let (wait, vote) = match m.code[pc as usize].op {
                    Op::Bar { wait, .. } => (wait, None),
                    Op::BarRed { p, negate, .. } => (true, Some((self.val(t, p) != 0) != negate)),
                    _ => unreachable!("a barrier"),
                };
                let id = self.val(t, id);
                if id >= BARRIERS as u64 {
                    return Err(bad(format!("barrier {id}")));
                }
                let block_threads = (self.threads.len() as u32).next_multiple_of(WARP as u32);
                let expected = match count {
                    Some(c) => {
                        let c = self.val(t, c);
                        if c == 0 || c % WARP as u64 != 0 || c > u64::from(block_threads) {
                            return Err(bad(format!("barrier thread count {c}")));
                        }
                        Some(c as u32)
                    }
                    None => None,
                };
                let id = id as usize;
                let in_use = self.arrived[id] != 0 || self.waiting[id] != 0;
                if in_use && self.expected[id] != expected {
                    return Err(bad(format!(
                        "barrier {id} used with different thread counts"
                    )));
                }
                self.expected[id] = expected;
                if let Some(v) = vote {
                    // `bar.red`: the thread's predicate counted for the reduction.
                    self.votes[id][usize::from(v)] += 1;
                }
                if wait {
                    self.waiting[id] |= 1 << (t / WARP);
                    Ok(Wait::Barrier(id as u8))
                } else {
                    // `bar.arrive` counts the thread's warp without waiting.
                    self.arrived[id] |= 1 << (t / WARP);
                    Ok(Wait::Ready)
                }
            }
            _ => {
                self.at_collective |= 1 << (t / WARP);
                Ok(Wait::Warp(pc))
            }
        }
    }

    /// Executes the warp-collective instructions whose lanes are all there and releases the
    /// complete barriers; whether anything moved. When nothing can, the lowest waiting
    /// instruction of the first warp with one goes on with the lanes it has (as the
    /// interpreter does for a warp whose lanes wait at different ones).
    fn release(&mut self) -> ComputeResult<bool> {
        let mut moved = false;
        let n = self.threads.len();
        let nwarps = n.div_ceil(WARP);
        for w in 0..nwarps {
            if self.at_collective & (1 << w) != 0 {
                moved |= self.collectives(w, false)?;
            }
        }
        // Barriers: complete when the warps at it (each counted whole, as the hardware
        // counts) reach the expected count or every warp still running.
        let live_warps = self.running[..nwarps].iter().filter(|&&r| r != 0).count() as u32;
        for id in 0..BARRIERS {
            if self.arrived[id] | self.waiting[id] == 0 {
                continue;
            }
            // A warp has arrived once every lane of it still running waits here: lanes that
            // diverged before the barrier reach it before the warp counts, as a warp in lock
            // step reaches it only once they have reconverged.
            let mut warps = self.arrived[id];
            for w in 0..nwarps {
                if self.waiting[id] & (1 << w) == 0 {
                    continue;
                }
                let lanes = w * WARP..((w + 1) * WARP).min(n);
                let here = lanes
                    .filter(|&t| self.wait[t] == Wait::Barrier(id as u8))
                    .count();
                if here == usize::from(self.running[w]) {
                    warps |= 1 << w;
                }
            }
            let warps = warps.count_ones();
            let need = self.expected[id].unwrap_or(live_warps * WARP as u32);
            if warps * WARP as u32 >= need {
                self.arrived[id] = 0;
                self.waiting[id] = 0;
                let [falses, trues] = std::mem::take(&mut self.votes[id]);
                for t in 0..n {
                    if self.wait[t] != Wait::Barrier(id as u8) {
                        continue;
                    }
                    self.wait[t] = Wait::Ready;
                    if let Op::BarRed { op, d, .. } =
                        self.env.m.code[self.threads[t].stop_pc as usize].op
                    {
                        let v = match op {
                            BarRedOp::Popc => u64::from(trues),
                            BarRedOp::And => u64::from(falses == 0),
                            BarRedOp::Or => u64::from(trues != 0),
                        };
                        self.set(t, d, v);
                    }
                }
                moved = true;
            }
        }
        if !moved && self.wait.iter().all(|w| !matches!(w, Wait::Ready)) {
            for w in 0..nwarps {
                if self.collectives(w, true)? {
                    return Ok(true);
                }
            }
        }
        Ok(moved)
    }

    /// Runs the collectives of warp `w` whose member lanes are all waiting at them (`force`:
    /// the lowest one, with the lanes there); whether one ran.
    fn collectives(&mut self, w: usize, force: bool) -> ComputeResult<bool> {
        let n = self.threads.len();
        let lanes = w * WARP..((w + 1) * WARP).min(n);
        let mut live = 0u32;
        let mut pcs: Vec<u32> = Vec::new();
        for t in lanes.clone() {
            if self.wait[t] != Wait::Exited {
                live |= 1 << (t - w * WARP);
            }
            if let Wait::Warp(pc) = self.wait[t]
                && !pcs.contains(&pc)
            {
                pcs.push(pc);
            }
        }
        pcs.sort_unstable();
        let mut ran = false;
        for pc in pcs {
            let mut here = 0u32;
            for t in lanes.clone() {
                if self.wait[t] == Wait::Warp(pc) {
                    here |= 1 << (t - w * WARP);
                }
            }
            let first = w * WARP + here.trailing_zeros() as usize;
            let op = &self.env.m.code[pc as usize].op;
            let members = match *op {
                Op::Shfl { mask, .. } | Op::Vote { mask, .. } | Op::WarpSync { mask } => {
                    self.val(first, mask) as u32 & live
                }
                _ => here,
            };
            if members & !here != 0 && !force {
                continue;
            }
            self.collective(w, pc, here);
            ran = true;
            if force {
                break;
            }
        }
        if !lanes.clone().any(|t| matches!(self.wait[t], Wait::Warp(_))) {
            self.at_collective &= !(1 << w);
        }
        Ok(ran)
    }

    /// Executes the collective at `pc` for lanes `exec` of warp `w` and lets them go on.
    fn collective(&mut self, w: usize, pc: u32, exec: u32) {
        let base = w * WARP;
        let lanes = (0..WARP).filter(move |l| exec & (1 << l) != 0);
        match self.env.m.code[pc as usize].op {
            Op::Shfl {
                mode,
                d,
                p,
                a,
                b,
                c,
                ..
            } => {
                let mut vals = [0u64; WARP];
                for lane in lanes.clone() {
                    vals[lane] = self.val(base + lane, a);
                }
                for lane in lanes {
                    let t = base + lane;
                    let (b, c) = (self.val(t, b), self.val(t, c));
                    let (src, ok) = exec::shfl_source(mode, lane, b, c);
                    self.set(t, d, vals[src]);
                    self.set(t, p, u64::from(ok));
                }
            }
            Op::Vote {
                mode, d, a, negate, ..
            } => {
                let mut ballot = 0u32;
                for lane in lanes.clone() {
                    if (self.val(base + lane, a) != 0) != negate {
                        ballot |= 1 << lane;
                    }
                }
                let r = exec::vote(mode, ballot, exec);
                for lane in lanes {
                    self.set(base + lane, d, r);
                }
            }
            Op::Activemask { d } => {
                for lane in lanes {
                    self.set(base + lane, d, u64::from(exec));
                }
            }
            _ => {}
        }
        for lane in 0..WARP {
            if exec & (1 << lane) != 0 {
                self.wait[base + lane] = Wait::Ready;
            }
        }
    }
}
