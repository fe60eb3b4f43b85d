//! The warp-level interpreter.
//!
//! A block runs on one host thread; its warps take turns, each running until it reaches a
//! `bar.sync`, exits, has run its time slice, or the launch stops. Inside a warp every lane has
//! its own program counter: each step executes the instruction at the lowest PC among the live
//! lanes deepest in calls, for the lanes at that PC (guard predicate permitting); lanes at a
//! warp-synchronous instruction wait there for the rest of its member mask. Lanes that diverge run their paths one after
//! the other and are together again at the first instruction both paths reach (the
//! reconvergence point of structured control flow, without a stack of masks). Warp-collective
//! instructions (`shfl`, `vote`, `activemask`) see the lanes executing them together.
//!
//! Blocks are independent: host threads take the next block from a shared counter. The first
//! error (a memory fault, a trap, the instruction budget) stops every thread at its next check.
//!
//! Cost model: the budget and the checks count cost units. An instruction costs one per
//! warp step; what costs more host time is charged what it costs: a `printf` by the bytes it
//! reads and formats ([`PRINTF_BYTES_PER_UNIT`]), a block's setup by the host bytes it
//! allocates and clears ([`SETUP_BYTES_PER_UNIT`]). Every [`CHECK_EVERY`] units (and inside a
//! `printf`, after each string) a block looks at the stop flag, the launch's interrupt and
//! the budget, so no stretch between two checks costs more than a fraction of a millisecond.

use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use log::debug;

use super::ir::*;
use super::parse::{Parsed, wide};
use super::texture;
use super::{Launch, LaunchStats, Module};
use super::{
    MAX_CALL_DEPTH, MAX_COOPERATIVE_BLOCKS, MAX_PRINTF_BYTES, MAX_SHARED_BYTES,
    MAX_THREADS_PER_BLOCK,
};
use crate::budget::Charge;
use crate::compute::memory::{Fault, FaultKind};
use crate::compute::{ComputeError, ComputeResult, GlobalMemory};

/// Generic addresses of shared memory: `cvta.shared` adds this to a shared offset. Below every
/// device allocation, so the windows never overlap global memory.
pub const SHARED_WINDOW: u64 = 0x0000_1000_0000_0000;
/// Generic addresses of the thread's local memory.
pub const LOCAL_WINDOW: u64 = 0x0000_2000_0000_0000;
/// Addresses of kernel parameters (`mov.u64 %rd, param`, which nvcc emits for a large
/// parameter it indexes): read with `ld.param` through a register.
pub const KPARAM_WINDOW: u64 = 0x0000_4000_0000_0000;
/// Size of each window.
pub(super) const WINDOW_BYTES: u64 = 1 << 32;
/// Longest `printf` format string read from device memory.
const MAX_FORMAT_BYTES: usize = 4096;
/// Register values of one block (registers × threads), bounding a block's host memory at
/// 32 MiB. PTX names virtual registers, so the hardware's 64 Ki per block does not apply.
pub const MAX_BLOCK_REGISTER_VALUES: u64 = 4 << 20;
/// Cost units charged per warp for setting a block up besides its bytes, so that a grid of
/// empty blocks is bounded by the budget too.
pub(super) const BLOCK_SETUP_COST: u64 = 16;
/// Host bytes a block's setup allocates and clears per cost unit: a warp-instruction of the
/// interpreter takes about 100 ns, clearing fresh memory about 0.65 ns a byte (measured on a
/// 2-core x86-64 host: a block of 64 MiB takes 43 ms to set up, charged 52 ms).
pub const SETUP_BYTES_PER_UNIT: u64 = 128;
/// Bytes a `printf` reads (format string, arguments, `%s` strings, byte by byte through the
/// checked memory) or writes per cost unit: about a quarter of a warp-instruction's time
/// each (measured: 64 `%s` of 4000 bytes in 32 lanes, 8 MB read and formatted, took 0.49 s
/// and is charged 4.1 M units, about 0.41 s of instructions).
pub const PRINTF_BYTES_PER_UNIT: u64 = 4;
/// Cost units a block spends between checks of the launch's budget, stop flag and
/// interrupt: about 0.4 ms of the interpreter (measured: a cancelled spin kernel stops
/// 0.3-0.4 ms after the cancel), so a cancelled or timed-out launch stops well within 10 ms.
pub const CHECK_EVERY: u64 = 4096;
/// Alignment of dynamic shared memory after the static variables.
const DYN_SHARED_ALIGN: u32 = 16;

pub(super) const WARP: usize = 32;

fn invalid(msg: impl Into<String>) -> ComputeError {
    ComputeError::InvalidValue(msg.into())
}

/// A launch's configuration, checked against the kernel and the executor's limits.
pub(super) struct Plan {
    /// The kernel's function.
    pub f: u32,
    pub regs: LaunchRegisters,
    pub nthreads: u32,
    pub blocks: u64,
    /// Shared memory of a block: the static variables, then the dynamic part at `dyn_start`.
    pub shared: u32,
    pub dyn_start: u32,
}

/// Checks a launch's grid, block, shared memory, registers, parameters and variables.
pub(super) fn plan(module: &Module, kernel: &str, l: &Launch<'_>) -> ComputeResult<Plan> {
    let f = module
        .function_of(kernel)
        .ok_or_else(|| ComputeError::NotFound(format!("kernel {kernel}")))?;
    let m = &module.parsed;
    let regs = launch_registers(m, f);
    let info = module.kernel(kernel).expect("kernel of function_of");
    let [gx, gy, gz] = l.grid;
    let [bx, by, bz] = l.block;
    if gx == 0 || gy == 0 || gz == 0 || gx > i32::MAX as u32 || gy > 65535 || gz > 65535 {
        return Err(invalid(format!("grid {:?}", l.grid)));
    }
    if bx == 0 || by == 0 || bz == 0 || bx > 1024 || by > 1024 || bz > 64 {
        return Err(invalid(format!("block {:?}", l.block)));
    }
    let nthreads = bx * by * bz;
    if nthreads > MAX_THREADS_PER_BLOCK {
        return Err(invalid(format!("{nthreads} threads per block")));
    }
    let dyn_start = m.shared_bytes.next_multiple_of(DYN_SHARED_ALIGN);
    let shared = dyn_start
        .checked_add(l.dynamic_shared_bytes)
        .filter(|&s| s <= MAX_SHARED_BYTES)
        .ok_or_else(|| {
            ComputeError::LaunchOutOfResources(format!(
                "{} bytes of shared memory",
                u64::from(dyn_start) + u64::from(l.dynamic_shared_bytes)
            ))
        })?;
    let lanes = u64::from(nthreads.next_multiple_of(WARP as u32));
    if lanes * regs.held.len() as u64 > MAX_BLOCK_REGISTER_VALUES {
        return Err(ComputeError::LaunchOutOfResources(format!(
            "{} registers × {nthreads} threads",
            regs.held.len()
        )));
    }
    if l.params.len() != info.param_bytes as usize {
        return Err(invalid(format!(
            "{} parameter bytes for a kernel taking {}",
            l.params.len(),
            info.param_bytes
        )));
    }
    if l.symbols.len() != m.globals.len() {
        return Err(invalid(format!(
            "{} variable addresses for a module of {}",
            l.symbols.len(),
            m.globals.len()
        )));
    }
    Ok(Plan {
        f,
        regs,
        nthreads,
        blocks: u64::from(gx) * u64::from(gy) * u64::from(gz),
        shared,
        dyn_start,
    })
}

/// Charges the host memory of the blocks running at once to the VM's budget for the
/// launch, before any is made: `block_bytes` for each of up to `l.threads` host threads,
/// with fewer threads when all of them would not fit. A cooperative launch runs every block
/// at once, a host thread each: at most [`MAX_COOPERATIVE_BLOCKS`] of them, all charged.
/// The threads and the charge.
pub(super) fn charge_blocks(
    l: &Launch<'_>,
    blocks: u64,
    block_bytes: u64,
) -> ComputeResult<(usize, Charge)> {
    if l.cooperative.is_some() {
        if blocks > MAX_COOPERATIVE_BLOCKS {
            return Err(ComputeError::CooperativeLaunchTooLarge(format!(
                "{blocks} blocks, more than the {MAX_COOPERATIVE_BLOCKS} the executor runs at once"
            )));
        }
        let charge = l
            .budget
            .charge(block_bytes.saturating_mul(blocks))
            .map_err(|e| {
                ComputeError::OutOfMemory(format!(
                    "{block_bytes} bytes of host memory for each of {blocks} blocks: {e}"
                ))
            })?;
        return Ok((blocks as usize, charge));
    }
    let mut threads = l.threads.clamp(1, blocks.min(MAX_LAUNCH_THREADS) as usize);
    loop {
        match l.budget.charge(block_bytes.saturating_mul(threads as u64)) {
            Ok(charge) => return Ok((threads, charge)),
            Err(e) if threads == 1 => {
                return Err(ComputeError::OutOfMemory(format!(
                    "{block_bytes} bytes of host memory for a block: {e}"
                )));
            }
            Err(_) => threads /= 2,
        }
    }
}

/// Runs `worker`, which takes blocks until none is left, on `threads` host threads (on the
/// calling one when that is 1). A thread the host cannot start (its task limit, its memory)
/// leaves the blocks to the others, but a cooperative launch needs every one of its blocks
/// running: it fails with `CooperativeLaunchTooLarge` (`fail`, which stops the started ones).
pub(super) fn spread(
    threads: usize,
    cooperative: bool,
    worker: impl Fn() + Sync,
    fail: impl Fn(ComputeError) + Sync,
) {
    if threads == 1 {
        worker();
        return;
    }
    std::thread::scope(|s| {
        let mut started = 0;
        for _ in 0..threads {
            match std::thread::Builder::new().spawn_scoped(s, &worker) {
                Ok(_) => started += 1,
                Err(e) if cooperative => {
                    fail(ComputeError::CooperativeLaunchTooLarge(format!(
                        "a host thread for each of its {threads} blocks: {started} started, \
                         then {e}"
                    )));
                    return;
                }
                Err(e) => {
                    debug!("{started} of {threads} host threads for a launch: {e}");
                    break;
                }
            }
        }
        if started == 0 {
            worker();
        }
    });
}

/// Runs `kernel` of `module` over the launch's grid on the interpreter.
pub(super) fn launch(
    module: &Module,
    kernel: &str,
    l: &Launch<'_>,
    memory: &dyn GlobalMemory,
) -> ComputeResult<LaunchStats> {
    let Plan {
        f,
        regs,
        nthreads,
        blocks,
        shared,
        dyn_start,
    } = plan(module, kernel, l)?;
    let m = &module.parsed;
    let nwarps = u64::from(nthreads.div_ceil(WARP as u32));
    let block_bytes = block_bytes(m, regs.held.len() as u64, nwarps, shared);
    let (threads, _held) = charge_blocks(l, blocks, block_bytes)?;
    let shared_launch = Shared {
        m,
        l,
        memory,
        entry: m.funcs[f as usize].start,
        sym_addr: l.symbols,
        shared_bytes: shared,
        dyn_start,
        reg_mask: regs
            .held
            .iter()
            .map(|&r| m.reg_bits[r as usize])
            .map(|b| if b >= 64 { u64::MAX } else { (1u64 << b) - 1 })
            .collect(),
        regs,
        nthreads,
        next_block: AtomicU64::new(0),
        executed: AtomicU64::new(0),
        checks: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        error: Mutex::new(None),
        output: Mutex::new(Vec::new()),
        output_bytes: AtomicUsize::new(0),
        started: Instant::now(),
        setup_cost: BLOCK_SETUP_COST
            .saturating_mul(nwarps)
            .saturating_add(block_bytes / SETUP_BYTES_PER_UNIT),
    };
    debug!("launch of {blocks} blocks of {block_bytes} host bytes on {threads} threads");
    spread(
        threads,
        l.cooperative.is_some(),
        || shared_launch.worker(blocks),
        |e| shared_launch.fail(e),
    );
    if let Some(e) = shared_launch
        .error
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
    {
        return Err(e);
    }
    let mut outputs = shared_launch
        .output
        .into_inner()
        .unwrap_or_else(|p| p.into_inner());
    outputs.sort_by_key(|(b, _)| *b);
    Ok(LaunchStats {
        warp_instructions: shared_launch.executed.load(Ordering::Relaxed),
        blocks,
        threads,
        block_bytes,
        output: outputs.into_iter().map(|(_, s)| s).collect(),
        compiled: false,
        checks: shared_launch.checks.load(Ordering::Relaxed),
    })
}

/// The registers a launch of kernel `f` holds: those of the functions its code can reach
/// (through direct calls; through a function pointer, every function of the module). Each
/// function's registers are its own, so a kernel of a module with many functions holds its own
/// and its callees' only, not the module's.
pub(super) struct LaunchRegisters {
    /// The first register of the functions reached.
    pub base: u32,
    /// Where register `base + i` is in a warp's registers (`u32::MAX` for registers of
    /// functions not reached, which the launch's code never names).
    pub slots: Vec<u32>,
    /// The registers held, in slot order.
    pub held: Vec<u32>,
}

pub(super) fn launch_registers(m: &Parsed, f: u32) -> LaunchRegisters {
    let mut seen = vec![false; m.funcs.len()];
    let mut todo = vec![f];
    while let Some(g) = todo.pop() {
        if std::mem::replace(&mut seen[g as usize], true) {
            continue;
        }
        let func = &m.funcs[g as usize];
        for inst in &m.code[func.start as usize..func.end as usize] {
            match &inst.op {
                Op::Call {
                    callee: Callee::Func(c),
                    ..
                } => todo.push(*c),
                Op::Call {
                    callee: Callee::Indirect(_),
                    ..
                } => seen.fill(true),
                _ => {}
            }
        }
    }
    let mut ranges: Vec<std::ops::Range<u32>> = m
        .funcs
        .iter()
        .zip(&seen)
        .filter(|(func, reached)| **reached && !func.regs.is_empty())
        .map(|(func, _)| func.regs.clone())
        .collect();
    ranges.sort_by_key(|r| r.start);
    let base = ranges.first().map_or(0, |r| r.start);
    let end = ranges.iter().map(|r| r.end).max().unwrap_or(base);
    let mut slots = vec![u32::MAX; (end - base) as usize];
    let mut held = Vec::new();
    for reg in ranges.into_iter().flatten() {
        slots[(reg - base) as usize] = held.len() as u32;
        held.push(reg);
    }
    LaunchRegisters { base, slots, held }
}

/// Most host threads one launch runs on, whatever its configuration asks.
pub(super) const MAX_LAUNCH_THREADS: u64 = 1024;

/// Host bytes one block holds while it runs: per warp its registers (8 bytes a lane), local
/// and `.param` memory and its lanes' call stacks; its shared memory.
pub(super) fn block_bytes(m: &Parsed, regs: u64, warps: u64, shared: u32) -> u64 {
    let lane = regs
        .saturating_mul(8)
        .saturating_add(u64::from(m.local_bytes))
        .saturating_add(u64::from(m.fparam_bytes))
        .saturating_add(std::mem::size_of::<Vec<Frame>>() as u64);
    let warp = lane
        .saturating_mul(WARP as u64)
        .saturating_add(std::mem::size_of::<Warp>() as u64);
    warp.saturating_mul(warps).saturating_add(u64::from(shared))
}

/// What every block of a launch shares.
struct Shared<'a> {
    m: &'a Parsed,
    l: &'a Launch<'a>,
    memory: &'a dyn GlobalMemory,
    entry: u32,
    sym_addr: &'a [u64],
    shared_bytes: u32,
    dyn_start: u32,
    /// The registers the launch holds ([`launch_registers`]): a warp holds those only.
    regs: LaunchRegisters,
    reg_mask: Vec<u64>,
    nthreads: u32,
    next_block: AtomicU64,
    executed: AtomicU64,
    /// Times [`Shared::check`] ran.
    checks: AtomicU64,
    stop: AtomicBool,
    error: Mutex<Option<ComputeError>>,
    output: Mutex<Vec<(u64, String)>>,
    output_bytes: AtomicUsize,
    started: Instant,
    /// What setting one block up costs, in cost units.
    setup_cost: u64,
}

impl Shared<'_> {
    /// Where register `r` (of a function this launch can reach) starts in a warp's registers.
    #[inline(always)]
    fn slot(&self, r: u32) -> usize {
        self.regs.slots[(r - self.regs.base) as usize] as usize * WARP
    }

    /// Records the launch's first error and stops every thread at its next check.
    fn fail(&self, e: ComputeError) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Fails once another thread of the launch failed, or its request was cancelled or is
    /// past its deadline.
    fn interrupted(&self) -> ComputeResult<()> {
        if self.stop.load(Ordering::Relaxed) {
            return Err(ComputeError::LaunchTimeout("launch stopped".into()));
        }
        self.l.interrupt.map_or(Ok(()), |i| i.check())
    }

    /// Whether the launch may go on with `total` cost units spent: not interrupted, within
    /// its budget.
    fn check(&self, total: u64) -> ComputeResult<()> {
        self.checks.fetch_add(1, Ordering::Relaxed);
        self.interrupted()?;
        if total > self.l.instruction_budget {
            return Err(ComputeError::LaunchTimeout(format!(
                "kernel ran past its budget of {} cost units ({:.1} s)",
                self.l.instruction_budget,
                self.started.elapsed().as_secs_f64()
            )));
        }
        Ok(())
    }

    /// Adds `cost` to what the launch spent; the new total.
    fn spend(&self, cost: u64) -> u64 {
        self.executed
            .fetch_add(cost, Ordering::Relaxed)
            .saturating_add(cost)
    }

    fn worker(&self, blocks: u64) {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let b = self.next_block.fetch_add(1, Ordering::Relaxed);
            if b >= blocks {
                return;
            }
            // Setting a block up is work too: charged, and checked, before its memory is
            // made, so a huge grid of trivial blocks ends at the budget like a long kernel.
            let mut result = self.check(self.spend(self.setup_cost));
            if result.is_ok() {
                result = Block::new(self, b).and_then(|mut block| {
                    let mut r = block.run();
                    let total = self.spend(block.unflushed.get());
                    if r.is_ok() {
                        r = self.check(total);
                    }
                    if !block.out.is_empty() {
                        self.output
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((b, block.out));
                    }
                    r
                });
            }
            if let Err(e) = result {
                self.fail(e);
                return;
            }
        }
    }
}

/// A call frame of one lane: where to return and what to copy back.
#[derive(Debug, Clone, Copy)]
struct Frame {
    /// The function called.
    func: u32,
    ret_pc: u32,
    /// (callee's return slot, caller's slot, bytes).
    copy_back: Option<(u32, u32, u32)>,
}

struct Warp {
    regs: Vec<u64>,
    pc: [u32; WARP],
    /// Lanes that exist (the last warp of a block may be partial).
    valid: u32,
    exited: u32,
    frames: Vec<Vec<Frame>>,
    local: Vec<u8>,
    fparam: Vec<u8>,
    /// Lanes inside a call (a non-empty frame stack).
    calling: u32,
    /// Lanes waiting at a warp-synchronous instruction (`shfl.sync`, `vote.sync`,
    /// `bar.warp.sync`) for the rest of its member mask.
    parked: u32,
    /// The lanes waiting at a `bar.sync`, or 0, and the barrier.
    at_barrier: u32,
    barrier: usize,
    /// The reduction a `bar.red` the warp waits at delivers, and its destination.
    reduction: Option<(BarRedOp, u32)>,
    /// Each lane's carry flag (`CC.CF`), which `add.cc` and the like set and `addc` reads.
    carry: u32,
}

/// Barriers of a block (`bar.sync 0..15`).
pub(super) const BARRIERS: usize = 16;
/// Warp-instructions a warp runs before the block's other warps get their turn.
const SLICE: u32 = 1024;

/// One of the block's barriers: threads arrived (counted per warp, as the hardware does) and
/// the count that completes it (`None`: every thread of the block that has not exited); for
/// `bar.red`, how many arriving threads' predicates were true and whether any was false.
#[derive(Debug, Clone, Copy, Default)]
struct Barrier {
    arrived: u32,
    expected: Option<u32>,
    trues: u32,
    falses: u32,
}

struct Block<'s, 'a> {
    s: &'s Shared<'a>,
    ctaid: [u32; 3],
    warps: Vec<Warp>,
    barriers: [Barrier; BARRIERS],
    shared: Vec<u8>,
    out: String,
    /// Cost units spent since the last check.
    unflushed: Cell<u64>,
}

/// A lane's value of a 32-bit float register, with `.ftz` applied.
fn f32_of(bits: u64, ftz: bool) -> f32 {
    let v = f32::from_bits(bits as u32);
    if ftz && v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    }
}

/// The canonical NaN of each width: what the hardware's arithmetic gives for a NaN result
/// (the payloads of NaN operands are not propagated, so the result does not depend on which
/// operand a compiler put first).
pub(super) const CANONICAL_NAN_F32: u64 = 0x7fff_ffff;
pub(super) const CANONICAL_NAN_F64: u64 = 0x7fff_ffff_ffff_ffff;

/// The bits of an arithmetic result (`canonical`: a NaN as the canonical one).
fn arithmetic_f32(r: f32, ftz: bool, canonical: bool) -> u64 {
    if canonical && r.is_nan() {
        CANONICAL_NAN_F32
    } else {
        f32_bits(r, ftz)
    }
}

fn arithmetic_f64(r: f64, canonical: bool) -> u64 {
    if canonical && r.is_nan() {
        CANONICAL_NAN_F64
    } else {
        r.to_bits()
    }
}

fn f32_bits(v: f32, ftz: bool) -> u64 {
    let v = if ftz && v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    };
    u64::from(v.to_bits())
}

pub(super) fn sext(v: u64, bits: u32) -> i64 {
    if bits >= 64 {
        v as i64
    } else {
        let shift = 64 - bits;
        ((v << shift) as i64) >> shift
    }
}

/// The next f32 towards +∞ / −∞.
fn f32_up(v: f32) -> f32 {
    if v.is_nan() || v == f32::INFINITY {
        return v;
    }
    if v == 0.0 {
        return f32::from_bits(1);
    }
    let b = v.to_bits();
    f32::from_bits(if v > 0.0 { b + 1 } else { b - 1 })
}

fn f32_down(v: f32) -> f32 {
    -f32_up(-v)
}

/// Rounds toward `rnd` given `r` (the nearest f32) and how the exact value compares to it.
fn directed(r: f32, exact_vs_r: std::cmp::Ordering, rnd: Rnd) -> f32 {
    use std::cmp::Ordering::*;
    match (rnd, exact_vs_r) {
        (_, Equal) | (Rnd::Rn, _) => r,
        (Rnd::Rm, Less) => f32_down(r),
        (Rnd::Rp, Greater) => f32_up(r),
        (Rnd::Rz, Less) if r > 0.0 => f32_down(r),
        (Rnd::Rz, Greater) if r < 0.0 => f32_up(r),
        _ => r,
    }
}

/// An f64 value (plus a tiny error term `e`) rounded to f32 in mode `rnd`.
fn round_f64(x: f64, e: f64, rnd: Rnd) -> f32 {
    let r = x as f32;
    if x.is_nan() {
        return r;
    }
    let d = x - f64::from(r);
    let ord = if d != 0.0 {
        d.partial_cmp(&0.0)
    } else {
        e.partial_cmp(&0.0)
    };
    directed(r, ord.unwrap_or(std::cmp::Ordering::Equal), rnd)
}

/// An integer rounded to f32 in mode `rnd`.
fn round_int_f32(x: i128, rnd: Rnd) -> f32 {
    let r = x as f32;
    directed(r, x.cmp(&(r as i128)), rnd)
}

/// How an exact result compares to `r`, its nearest f32, given `t`: a value (computed in f64
/// from f32 operands, so its sign is exact) with the sign of `exact - r`, or `None` where `r`
/// is no rounding of a finite exact value (an infinite or NaN operand, division by zero).
fn f32_order(r: f32, t: f64, exact_finite: bool) -> std::cmp::Ordering {
    use std::cmp::Ordering::*;
    if !exact_finite || r.is_nan() {
        Equal
    } else if r.is_infinite() {
        // Past the largest finite value: the exact result lies on its side of infinity.
        if r > 0.0 { Less } else { Greater }
    } else {
        t.partial_cmp(&0.0).unwrap_or(Equal)
    }
}

/// The next f64 towards +∞ / −∞.
fn f64_up(v: f64) -> f64 {
    if v.is_nan() || v == f64::INFINITY {
        return v;
    }
    if v == 0.0 {
        return f64::from_bits(1);
    }
    let b = v.to_bits();
    f64::from_bits(if v > 0.0 { b + 1 } else { b - 1 })
}

fn f64_down(v: f64) -> f64 {
    -f64_up(-v)
}

/// [`directed`] for f64: `r` the nearest f64, `exact_vs_r` where the exact value lies.
fn directed64(r: f64, exact_vs_r: std::cmp::Ordering, rnd: Rnd) -> f64 {
    use std::cmp::Ordering::*;
    match (rnd, exact_vs_r) {
        (_, Equal) | (Rnd::Rn, _) => r,
        (Rnd::Rm, Less) => f64_down(r),
        (Rnd::Rp, Greater) => f64_up(r),
        (Rnd::Rz, Less) if r > 0.0 => f64_down(r),
        (Rnd::Rz, Greater) if r < 0.0 => f64_up(r),
        _ => r,
    }
}

/// Scale (2^600, applied to both operands) that brings a product of tiny f64 values into the
/// normal range, so its rounding error is itself representable.
const TINY_PRODUCT_SCALE: f64 = f64::from_bits((1023 + 600) << 52);
/// Products smaller than this (2^-900) are scaled by [`TINY_PRODUCT_SCALE`] first.
const TINY_PRODUCT: f64 = f64::from_bits((1023 - 900) << 52);

/// An f64 sum, difference or product rounded in mode `rnd`: the nearest result corrected by
/// the sign of its exact error (TwoSum; TwoProd through fma, scaled out of the subnormal
/// range where the error would not be representable).
fn f64_rounded(op: BinOp, a: f64, b: f64, rnd: Rnd) -> f64 {
    use std::cmp::Ordering::*;
    let finite = a.is_finite() && b.is_finite();
    let (r, err) = match op {
        BinOp::Add | BinOp::Sub => {
            let b = if op == BinOp::Sub { -b } else { b };
            let s = a + b;
            let bb = s - a;
            (s, (a - (s - bb)) + (b - bb))
        }
        _ => {
            let p = a * b;
            if p.abs() < TINY_PRODUCT && p != 0.0 || (p == 0.0 && a != 0.0 && b != 0.0) {
                // Both operands scaled: a product of two tiny ones underflows past one scale.
                let (sa, sb) = (a * TINY_PRODUCT_SCALE, b * TINY_PRODUCT_SCALE);
                let sp = p * TINY_PRODUCT_SCALE * TINY_PRODUCT_SCALE;
                let ps = sa * sb;
                (p, (ps - sp) + sa.mul_add(sb, -ps))
            } else {
                (p, a.mul_add(b, -p))
            }
        }
    };
    let ord = if !finite || r.is_nan() {
        Equal
    } else if r.is_infinite() {
        if r > 0.0 { Less } else { Greater }
    } else {
        err.partial_cmp(&0.0).unwrap_or(Equal)
    };
    directed64(r, ord, rnd)
}

/// `x * 2^n`, exactly when the result is normal or `x` is being scaled up out of the
/// subnormal range (steps of at most 2^1000, each exact on the way).
fn scale(mut x: f64, mut n: i32) -> f64 {
    while n != 0 {
        let k = n.clamp(-1000, 1000);
        x *= f64::from_bits(((1023 + k) as u64) << 52);
        n -= k;
    }
    x
}

/// A finite nonzero f64 as `m * 2^e` with `m` in [1, 2).
fn split(x: f64) -> (f64, i32) {
    let (x, bias) = if x.is_subnormal() {
        (x * f64::from_bits((1023 + 64) << 52), 64)
    } else {
        (x, 0)
    };
    let e = ((x.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let m = f64::from_bits((x.to_bits() & !(0x7ff << 52)) | (1023 << 52));
    (m, e - bias)
}

/// f64 division, square root or reciprocal rounded in mode `rnd`: the nearest result `r`,
/// stepped by the sign of `exact - r`. That sign is a residual's (`a - r*b`, `a - r*r`) at
/// operands scaled near 1, where one fma gives it exactly.
fn f64_div_sqrt(a: f64, b: Option<f64>, rnd: Rnd) -> f64 {
    use std::cmp::Ordering::*;
    let r = match b {
        Some(b) => a / b,
        None => a.sqrt(),
    };
    let exact_finite = a.is_finite()
        && a != 0.0
        && match b {
            Some(b) => b.is_finite() && b != 0.0,
            None => a > 0.0,
        };
    if rnd == Rnd::Rn || !exact_finite || r.is_nan() {
        return r;
    }
    let ord = if r.is_infinite() {
        if r > 0.0 { Less } else { Greater }
    } else {
        let (ma, ea) = split(a);
        let residual = match b {
            Some(b) => {
                let (mb, eb) = split(b);
                let r1 = scale(r, eb - ea);
                (-r1).mul_add(mb, ma) * mb.signum()
            }
            None => {
                // An even exponent keeps the square root's scale a power of two.
                let (ma, ea) = if ea % 2 == 0 {
                    (ma, ea)
                } else {
                    (ma * 2.0, ea - 1)
                };
                let r1 = scale(r, -ea / 2);
                (-r1).mul_add(r1, ma)
            }
        };
        residual.partial_cmp(&0.0).unwrap_or(Equal)
    };
    directed64(r, ord, rnd)
}

/// The NaN every half-precision operation returns, as the GPU does.
const F16_NAN: u16 = 0x7FFF;
/// The bits of binary16's +infinity; a rounded magnitude at or past it overflows.
const F16_INF: u16 = 0x7C00;
/// The bits of binary16's largest finite value.
const F16_MAX: u16 = 0x7BFF;
/// The bits of binary16's 1.0, the top of `.sat`'s range.
const F16_ONE: u16 = 0x3C00;
/// The exponent of binary16's least subnormal, 2^-24: every finite value is a multiple.
const F16_QUANTUM: i32 = -24;

fn f16_nan(h: u16) -> bool {
    h & 0x7FFF > F16_INF
}

/// `.ftz`: a subnormal becomes a zero of its sign.
fn f16_flush(h: u16, ftz: bool) -> u16 {
    if ftz && h & F16_INF == 0 {
        h & 0x8000
    } else {
        h
    }
}

/// A finite binary16 exactly, as a signed count of 2^-24.
fn f16_units(h: u16) -> i128 {
    let e = i32::from((h >> 10) & 0x1F);
    let f = i128::from(h & 0x3FF);
    let m = if e == 0 { f } else { f | 0x400 };
    let v = m << (e.max(1) - 1);
    if h & 0x8000 != 0 { -v } else { v }
}

/// A binary16 exactly as an f64 (f64 holds every binary16 value).
fn f16_to_f64(h: u16) -> f64 {
    let neg = h & 0x8000 != 0;
    if f16_nan(h) {
        return f64::NAN;
    }
    let v = if h & 0x7FFF == F16_INF {
        f64::INFINITY
    } else {
        // |units| < 2^41, exact in f64; the scaling by a power of two is exact too.
        f16_units(h & 0x7FFF) as f64 * scale(1.0, F16_QUANTUM)
    };
    if neg { -v } else { v }
}

/// `mag * 2^exp` (exact) rounded once to binary16 in `rnd`, with IEEE 754's overflow rules.
fn round_f16(neg: bool, mag: u128, exp: i32, rnd: Rnd) -> u16 {
    let sign = if neg { 0x8000 } else { 0 };
    if mag == 0 {
        return sign;
    }
    let lead = exp + (127 - mag.leading_zeros() as i32);
    // The quantum of the result: 10 bits below the leading one, or the subnormal quantum.
    let q = (lead - 10).max(F16_QUANTUM);
    let n = if q <= exp {
        // Exact: at most 11 significant bits.
        mag << (exp - q)
    } else {
        let s = (q - exp) as u32;
        let kept = mag.checked_shr(s).unwrap_or(0);
        let rem = if s >= 128 {
            mag
        } else {
            mag & ((1u128 << s) - 1)
        };
        // A remainder against half a quantum; with s past 128 the whole is below half.
        let half = if s > 128 {
            None
        } else {
            Some(1u128 << (s - 1))
        };
        let up = match rnd {
            Rnd::Rn => half.is_some_and(|h| rem > h || rem == h && kept & 1 == 1),
            Rnd::Rz => false,
            Rnd::Rm => neg && rem != 0,
            Rnd::Rp => !neg && rem != 0,
        };
        kept + u128::from(up)
    };
    // Exponent field and significand in one sum: a carry into 2^11 steps the exponent.
    let bits = (((q - F16_QUANTUM) as u128) << 10) + n;
    if bits >= u128::from(F16_INF) {
        let inf = match rnd {
            Rnd::Rn => true,
            Rnd::Rz => false,
            Rnd::Rm => neg,
            Rnd::Rp => !neg,
        };
        return sign | if inf { F16_INF } else { F16_MAX };
    }
    sign | bits as u16
}

/// An f64 rounded once to binary16.
fn f16_from_f64(v: f64, rnd: Rnd) -> u16 {
    if v.is_nan() {
        return F16_NAN;
    }
    let b = v.to_bits();
    let neg = b >> 63 != 0;
    if v.is_infinite() {
        return if neg { 0x8000 | F16_INF } else { F16_INF };
    }
    let e = ((b >> 52) & 0x7FF) as i32;
    let f = b & ((1 << 52) - 1);
    let m = if e == 0 { f } else { f | 1 << 52 };
    round_f16(neg, u128::from(m), e.max(1) - 1075, rnd)
}

/// `a * b + c` in binary16 with one rounding from the exact value (`c` absent: a product,
/// whose zero keeps the product's sign); every term is a multiple of 2^-48 below 2^81,
/// so the sum is exact in an i128.
fn f16_fma(a: u16, b: u16, c: Option<u16>, ftz: bool, sat: bool, rnd: Rnd) -> u16 {
    let (a, b) = (f16_flush(a, ftz), f16_flush(b, ftz));
    let c = c.map(|c| f16_flush(c, ftz));
    let cz = c.unwrap_or((a ^ b) & 0x8000);
    let (fa, fb, fc) = (f16_to_f64(a), f16_to_f64(b), f16_to_f64(cz));
    let r = if !(fa.is_finite() && fb.is_finite() && fc.is_finite()) {
        let v = fa.mul_add(fb, fc);
        if v.is_nan() {
            F16_NAN
        } else if v < 0.0 {
            0x8000 | F16_INF
        } else {
            F16_INF
        }
    } else {
        let p = f16_units(a) * f16_units(b);
        let s = p + (f16_units(cz) << -F16_QUANTUM);
        if s == 0 {
            let (ps, cs) = ((a ^ b) & 0x8000, cz & 0x8000);
            if p == 0 && f16_units(cz) == 0 && ps == cs {
                ps
            } else if rnd == Rnd::Rm {
                0x8000
            } else {
                0
            }
        } else {
            round_f16(s < 0, s.unsigned_abs(), 2 * F16_QUANTUM, rnd)
        }
    };
    let r = f16_flush(r, ftz);
    if !sat {
        r
    } else if f16_nan(r) || r & 0x8000 != 0 {
        0
    } else if r > F16_ONE {
        F16_ONE
    } else {
        r
    }
}

/// Applies `f` to each binary16 of `ty`'s operands: one, or both halves of an f16x2.
fn half_lanes(ty: Ty, xs: [u64; 3], f: impl Fn([u16; 3]) -> u16) -> u64 {
    let lane = |shift: u32| u64::from(f(xs.map(|x| (x >> shift) as u16)));
    if ty == Ty::F16x2 {
        lane(0) | lane(16) << 16
    } else {
        lane(0)
    }
}

fn saturate01(v: f64) -> f64 {
    if v.is_nan() { 0.0 } else { v.clamp(0.0, 1.0) }
}

impl<'s, 'a> Block<'s, 'a> {
    /// A block's warps, made one after the other with a look at the launch's interrupt
    /// between two (a warp's memory takes up to a few milliseconds to clear).
    fn new(s: &'s Shared<'a>, linear: u64) -> ComputeResult<Self> {
        let [gx, gy, _] = s.l.grid;
        let ctaid = [
            (linear % u64::from(gx)) as u32,
            ((linear / u64::from(gx)) % u64::from(gy)) as u32,
            (linear / (u64::from(gx) * u64::from(gy))) as u32,
        ];
        let nregs = s.reg_mask.len();
        let nwarps = s.nthreads.div_ceil(WARP as u32);
        let warps = (0..nwarps)
            .map(|w| {
                s.interrupted()?;
                let lanes = (s.nthreads - w * WARP as u32).min(WARP as u32);
                Ok(Warp {
                    regs: vec![0; nregs * WARP],
                    pc: [s.entry; WARP],
                    valid: if lanes == 32 {
                        u32::MAX
                    } else {
                        (1u32 << lanes) - 1
                    },
                    exited: 0,
                    frames: vec![Vec::new(); WARP],
                    local: vec![0; s.m.local_bytes as usize * WARP],
                    fparam: vec![0; s.m.fparam_bytes as usize * WARP],
                    calling: 0,
                    parked: 0,
                    at_barrier: 0,
                    barrier: 0,
                    carry: 0,
                    reduction: None,
                })
            })
            .collect::<ComputeResult<_>>()?;
        Ok(Block {
            s,
            ctaid,
            warps,
            barriers: [Barrier::default(); BARRIERS],
            shared: vec![0; s.shared_bytes as usize],
            out: String::new(),
            unflushed: Cell::new(0),
        })
    }

    fn run(&mut self) -> ComputeResult<()> {
        loop {
            let mut live = 0u32;
            let mut ran = false;
            for w in 0..self.warps.len() {
                let warp = &self.warps[w];
                if warp.valid & !warp.exited == 0 {
                    continue;
                }
                live += 1;
                if warp.at_barrier != 0 {
                    continue;
                }
                ran = true;
                self.run_warp(w)?;
            }
            if live == 0 {
                return Ok(());
            }
            if !self.release_barriers() && !ran {
                return Err(ComputeError::LaunchTimeout(
                    "every warp of a block waits at a barrier that cannot complete".into(),
                ));
            }
        }
    }

    /// Restarts the warps of every barrier whose count has arrived; whether any did.
    fn release_barriers(&mut self) -> bool {
        let live_warps = self
            .warps
            .iter()
            .filter(|w| w.valid & !w.exited != 0)
            .count() as u32;
        let mut released = false;
        for id in 0..BARRIERS {
            let b = self.barriers[id];
            if b.arrived == 0 || b.arrived < b.expected.unwrap_or(live_warps * WARP as u32) {
                continue;
            }
            self.barriers[id] = Barrier::default();
            released = true;
            for warp in &mut self.warps {
                if warp.barrier != id || warp.at_barrier == 0 {
                    continue;
                }
                let mask = std::mem::take(&mut warp.at_barrier);
                let reduction = warp.reduction.take().map(|(op, d)| {
                    let v = match op {
                        BarRedOp::Popc => u64::from(b.trues),
                        BarRedOp::And => u64::from(b.falses == 0),
                        BarRedOp::Or => u64::from(b.trues != 0),
                    };
                    (self.s.slot(d), v & self.s.reg_mask[self.s.slot(d) / WARP])
                });
                for lane in 0..WARP {
                    if mask & (1 << lane) != 0 {
                        warp.pc[lane] += 1;
                        if let Some((slot, v)) = reduction {
                            warp.regs[slot + lane] = v;
                        }
                    }
                }
            }
        }
        released
    }

    /// A warp's arrival at barrier `id` (the value of the first executing lane, as barrier
    /// operands are uniform) for `count` threads.
    fn arrive(
        &mut self,
        w: usize,
        lane: usize,
        id: Src,
        count: Option<Src>,
    ) -> ComputeResult<usize> {
        let bad = |what: String| ComputeError::IllegalInstruction(what);
        let id = self.val(w, lane, id);
        if id >= BARRIERS as u64 {
            return Err(bad(format!("barrier {id}")));
        }
        let id = id as usize;
        let block_threads = self.s.nthreads.next_multiple_of(WARP as u32);
        let expected = match count {
            Some(c) => {
                let c = self.val(w, lane, c);
                if c == 0 || c % WARP as u64 != 0 || c > u64::from(block_threads) {
                    return Err(bad(format!("barrier thread count {c}")));
                }
                Some(c as u32)
            }
            None => None,
        };
        let b = &mut self.barriers[id];
        if b.arrived != 0 && b.expected != expected {
            return Err(bad(format!(
                "barrier {id} used with different thread counts"
            )));
        }
        b.expected = expected;
        b.arrived += WARP as u32;
        Ok(id)
    }

    /// Charges `cost` units; every [`CHECK_EVERY`] units, checks that the launch may go on.
    fn count(&self, cost: u64) -> ComputeResult<()> {
        let unflushed = self.unflushed.get().saturating_add(cost);
        if unflushed < CHECK_EVERY {
            self.unflushed.set(unflushed);
            return Ok(());
        }
        self.unflushed.set(0);
        self.s.check(self.s.spend(unflushed))
    }

    /// Charges `bytes` a `printf` read or wrote.
    fn count_bytes(&self, bytes: usize) -> ComputeResult<()> {
        self.count((bytes as u64).div_ceil(PRINTF_BYTES_PER_UNIT))
    }

    /// Runs warp `w` until it is done, parks at a barrier, or has run its time slice (it may
    /// be spinning on a flag another warp sets); then it is the next warp's turn.
    fn run_warp(&mut self, w: usize) -> ComputeResult<()> {
        let s = self.s;
        let mut slice = 0u32;
        loop {
            let warp = &self.warps[w];
            let live = warp.valid & !warp.exited;
            if live == 0 {
                return Ok(());
            }
            if slice == SLICE && self.warps.len() > 1 {
                return Ok(());
            }
            slice += 1;
            // The lanes deepest in calls first, then the lowest PC: a lane that called a
            // function finishes it before the others move past the call, wherever the callee's
            // code lies, so they meet again after the call. Lanes parked at a warp-synchronous
            // instruction wait, unless every live lane is parked (then the lowest goes on, so
            // a warp whose lanes wait at different ones still makes progress).
            let runnable = match live & !warp.parked {
                0 => live,
                r => r,
            };
            let forced = runnable == live && warp.parked != 0;
            let mut key = (0usize, u32::MAX);
            let mut mask = 0u32;
            if runnable & warp.calling == 0 {
                // No lane in a call (the common case): the lowest PC.
                for lane in 0..WARP {
                    if runnable & (1 << lane) == 0 {
                        continue;
                    }
                    let pc = warp.pc[lane];
                    if pc < key.1 {
                        key.1 = pc;
                        mask = 1 << lane;
                    } else if pc == key.1 {
                        mask |= 1 << lane;
                    }
                }
            } else {
                for lane in 0..WARP {
                    if runnable & (1 << lane) == 0 {
                        continue;
                    }
                    let k = (warp.frames[lane].len(), warp.pc[lane]);
                    if k.0 > key.0 || (k.0 == key.0 && k.1 < key.1) {
                        key = k;
                        mask = 1 << lane;
                    } else if k == key {
                        mask |= 1 << lane;
                    }
                }
            }
            let min = key.1;
            let inst = &s.m.code[min as usize];
            self.count(1)?;
            // Volta's `.sync` semantics: the lanes of the member mask execute a
            // warp-synchronous instruction together, however they got to it.
            if let Op::Shfl { mask: m, .. }
            | Op::Vote { mask: m, .. }
            | Op::Match { mask: m, .. }
            | Op::WarpSync { mask: m } = inst.op
            {
                let members = self.val(w, mask.trailing_zeros() as usize, m) as u32 & live;
                let mut here = 0u32;
                for lane in 0..WARP {
                    if live & (1 << lane) != 0 && self.warps[w].pc[lane] == min {
                        here |= 1 << lane;
                    }
                }
                if members & !here != 0 && !forced {
                    self.warps[w].parked |= here;
                    continue;
                }
                self.warps[w].parked &= !here;
                mask = here;
            }
            let warp = &self.warps[w];
            let mut exec = mask;
            if let Some((p, neg)) = inst.guard {
                exec = 0;
                for lane in 0..WARP {
                    if mask & (1 << lane) != 0 && ((warp.regs[self.s.slot(p) + lane] != 0) != neg) {
                        exec |= 1 << lane;
                    }
                }
            }
            let sync = match inst.op {
                Op::Bar {
                    id,
                    count,
                    wait: true,
                } => Some((id, count)),
                Op::BarRed { id, count, .. } => Some((id, count)),
                _ => None,
            };
            if let Some((id, count)) = sync
                && exec != 0
            {
                let id = self.arrive(w, exec.trailing_zeros() as usize, id, count)?;
                if let Op::BarRed {
                    op, d, p, negate, ..
                } = inst.op
                {
                    let mut trues = 0;
                    for lane in 0..WARP {
                        if exec & (1 << lane) != 0 && (self.val(w, lane, p) != 0) != negate {
                            trues += 1;
                        }
                    }
                    let b = &mut self.barriers[id];
                    b.trues += trues;
                    b.falses += exec.count_ones() - trues;
                    self.warps[w].reduction = Some((op, d));
                }
                // Lanes whose guard is false skip the barrier.
                let warp = &mut self.warps[w];
                for lane in 0..WARP {
                    if mask & !exec & (1 << lane) != 0 {
                        warp.pc[lane] += 1;
                    }
                }
                warp.at_barrier = exec;
                warp.barrier = id;
                return Ok(());
            }
            {
                let warp = &mut self.warps[w];
                for lane in 0..WARP {
                    if mask & (1 << lane) != 0 {
                        warp.pc[lane] += 1;
                    }
                }
            }
            if exec != 0 {
                self.execute(w, min, exec).map_err(|e| match e {
                    ComputeError::IllegalAddress(m) => {
                        ComputeError::IllegalAddress(format!("{m} (PTX line {})", inst.line))
                    }
                    ComputeError::MisalignedAddress(m) => {
                        ComputeError::MisalignedAddress(format!("{m} (PTX line {})", inst.line))
                    }
                    e => e,
                })?;
            }
        }
    }

    #[inline(never)]
    /// A lane's call of function `f`: arguments copied by position into its parameters, a
    /// frame pushed, the lane at its first instruction.
    fn enter(
        &mut self,
        w: usize,
        lane: usize,
        f: u32,
        ret: Option<(u32, u32)>,
        args: &[(u32, u32)],
    ) -> ComputeResult<()> {
        let func = &self.s.m.funcs[f as usize];
        for (k, &(from, size)) in args.iter().enumerate() {
            let Some(&(to, to_size, _)) = func.params.get(k) else {
                break;
            };
            let mut buf = [0u8; 256];
            let n = size.min(to_size) as usize;
            if n > buf.len() {
                let mut big = vec![0u8; n];
                self.read(w, lane, Loc::FParam(u64::from(from)), &mut big)?;
                self.write(w, lane, Loc::FParam(u64::from(to)), &big)?;
            } else {
                self.read(w, lane, Loc::FParam(u64::from(from)), &mut buf[..n])?;
                self.write(w, lane, Loc::FParam(u64::from(to)), &buf[..n])?;
            }
        }
        let warp = &mut self.warps[w];
        let frames = &mut warp.frames[lane];
        if frames.len() >= MAX_CALL_DEPTH {
            return Err(ComputeError::LaunchOutOfResources(
                "call stack overflow".into(),
            ));
        }
        // Parameters and registers have one place per function: a function already on the
        // stack (reached through a pointer; direct recursion is refused at load) cannot run.
        if frames.iter().any(|fr| fr.func == f) {
            return Err(ComputeError::IllegalInstruction(format!(
                "recursive call of {}",
                func.name
            )));
        }
        let copy_back = match (ret, func.ret) {
            (Some((to, size)), Some((from, fsize))) => Some((from, to, size.min(fsize))),
            _ => None,
        };
        frames.push(Frame {
            func: f,
            ret_pc: warp.pc[lane],
            copy_back,
        });
        warp.calling |= 1 << lane;
        warp.pc[lane] = func.start;
        Ok(())
    }

    /// A call argument's value as a 64-bit integer.
    fn param_u64(&self, w: usize, lane: usize, (slot, size): (u32, u32)) -> ComputeResult<u64> {
        let mut b = [0u8; 8];
        let n = (size as usize).min(8);
        self.read(w, lane, Loc::FParam(u64::from(slot)), &mut b[..n])?;
        Ok(u64::from_le_bytes(b))
    }

    fn special(&self, w: usize, lane: usize, s: Sreg) -> u64 {
        let [bx, by, _] = self.s.l.block;
        let t = (w * WARP + lane) as u32;
        let tid = [t % bx, (t / bx) % by, t / (bx * by)];
        let lane_bit = 1u64 << lane;
        match s {
            Sreg::Tid(d) => u64::from(tid[usize::from(d)]),
            Sreg::Ntid(d) => u64::from(self.s.l.block[usize::from(d)]),
            Sreg::Ctaid(d) => u64::from(self.ctaid[usize::from(d)]),
            Sreg::Nctaid(d) => u64::from(self.s.l.grid[usize::from(d)]),
            Sreg::LaneId => lane as u64,
            Sreg::WarpId => w as u64,
            Sreg::NWarpId => self.warps.len() as u64,
            Sreg::SmId | Sreg::GridId => 0,
            Sreg::NSmId => 1,
            Sreg::Clock | Sreg::Clock64 => {
                self.s.executed.load(Ordering::Relaxed) + self.unflushed.get()
            }
            Sreg::GlobalTimer => self.s.started.elapsed().as_nanos() as u64,
            Sreg::LaneMaskEq => lane_bit,
            Sreg::LaneMaskLt => lane_bit - 1,
            Sreg::LaneMaskLe => (lane_bit << 1).wrapping_sub(1) & 0xffff_ffff,
            Sreg::LaneMaskGt => !((lane_bit << 1).wrapping_sub(1)) & 0xffff_ffff,
            Sreg::LaneMaskGe => !(lane_bit - 1) & 0xffff_ffff,
            Sreg::DynamicSmemSize => u64::from(self.s.l.dynamic_shared_bytes),
            Sreg::TotalSmemSize => u64::from(self.s.shared_bytes),
            Sreg::EnvReg(n) => self.s.l.envreg(n),
        }
    }

    /// The address of a variable in its own state space (parameters never reach here: the
    /// parser refuses taking their address).
    #[inline]
    fn sym(&self, s: SymRef) -> u64 {
        match s {
            SymRef::Global(i) => self.s.sym_addr[i as usize],
            SymRef::Shared(o) | SymRef::Local(o) => u64::from(o),
            SymRef::DynShared => u64::from(self.s.dyn_start),
            SymRef::KernelParam(o) | SymRef::FuncParam(o) => u64::from(o),
        }
    }

    #[inline(always)]
    fn val(&self, w: usize, lane: usize, src: Src) -> u64 {
        match src {
            Src::Reg(r) => self.warps[w].regs[self.s.slot(r) + lane],
            Src::Imm(v) => v,
            Src::Special(s) => self.special(w, lane, s),
            Src::Sym(s, offset) => self.sym(s).wrapping_add_signed(offset),
        }
    }

    fn set(&mut self, w: usize, lane: usize, d: u32, v: u64) {
        if d != SINK {
            let i = self.s.slot(d);
            self.warps[w].regs[i + lane] = v & self.s.reg_mask[i / WARP];
        }
    }

    /// The effective address of a memory operand for one lane (in the operand's own space).
    #[inline]
    fn address(&self, w: usize, lane: usize, a: Addr) -> u64 {
        let base = match a.base {
            AddrBase::Reg(r) => self.warps[w].regs[self.s.slot(r) + lane],
            AddrBase::Sym(s) => self.sym(s),
            AddrBase::Abs => 0,
        };
        base.wrapping_add(a.offset as u64)
    }

    fn read(&self, w: usize, lane: usize, loc: Loc, buf: &mut [u8]) -> ComputeResult<()> {
        let n = buf.len() as u64;
        let mut slice = |area: &[u8], off: u64| -> ComputeResult<()> {
            let end = off.checked_add(n).filter(|&e| e <= area.len() as u64);
            match end {
                Some(end) => {
                    buf.copy_from_slice(&area[off as usize..end as usize]);
                    Ok(())
                }
                None => Err(fault(Fault {
                    kind: FaultKind::OutOfRange,
                    addr: off,
                    size: n,
                })),
            }
        };
        match loc {
            Loc::Global(a) => self.s.memory.read(a, buf).map_err(fault),
            Loc::Shared(o) => slice(&self.shared, o),
            Loc::Local(o) => slice(
                self.lane_area(&self.warps[w].local, self.s.m.local_bytes, lane),
                o,
            ),
            Loc::KParam(o) => slice(self.s.l.params, o),
            Loc::FParam(o) => slice(
                self.lane_area(&self.warps[w].fparam, self.s.m.fparam_bytes, lane),
                o,
            ),
        }
    }

    fn lane_area<'v>(&self, v: &'v [u8], per_lane: u32, lane: usize) -> &'v [u8] {
        let n = per_lane as usize;
        &v[lane * n..(lane + 1) * n]
    }

    fn write(&mut self, w: usize, lane: usize, loc: Loc, data: &[u8]) -> ComputeResult<()> {
        let n = data.len() as u64;
        let put = |area: &mut [u8], off: u64| -> ComputeResult<()> {
            match off.checked_add(n).filter(|&e| e <= area.len() as u64) {
                Some(end) => {
                    area[off as usize..end as usize].copy_from_slice(data);
                    Ok(())
                }
                None => Err(fault(Fault {
                    kind: FaultKind::OutOfRange,
                    addr: off,
                    size: n,
                })),
            }
        };
        match loc {
            Loc::Global(a) => self.s.memory.write(a, data).map_err(fault),
            Loc::Shared(o) => put(&mut self.shared, o),
            Loc::Local(o) => {
                let n = self.s.m.local_bytes as usize;
                put(&mut self.warps[w].local[lane * n..(lane + 1) * n], o)
            }
            Loc::FParam(o) => {
                let n = self.s.m.fparam_bytes as usize;
                put(&mut self.warps[w].fparam[lane * n..(lane + 1) * n], o)
            }
            Loc::KParam(_) => Err(ComputeError::IllegalInstruction(
                "store to a kernel parameter".into(),
            )),
        }
    }

    fn execute(&mut self, w: usize, pc: u32, exec: u32) -> ComputeResult<()> {
        let inst = &self.s.m.code[pc as usize];
        let lanes = (0..WARP).filter(move |l| exec & (1 << l) != 0);
        if lane_local(&inst.op) {
            for lane in lanes {
                lane_op(
                    &mut WarpLane {
                        block: self,
                        w,
                        lane,
                    },
                    &inst.op,
                )?;
            }
            return Ok(());
        }
        match &inst.op {
            Op::Mov { d, a, .. } => {
                for lane in lanes {
                    let v = self.val(w, lane, *a);
                    self.set(w, lane, *d, v);
                }
            }
            Op::Pack {
                part_bits,
                d,
                parts,
            } => {
                let mask = (1u64 << part_bits) - 1;
                for lane in lanes {
                    let mut v = 0u64;
                    for (i, p) in parts.iter().enumerate() {
                        v |= (self.val(w, lane, *p) & mask) << (i as u32 * part_bits);
                    }
                    self.set(w, lane, *d, v);
                }
            }
            Op::Unpack { part_bits, ds, a } => {
                let mask = (1u64 << part_bits) - 1;
                for lane in lanes {
                    let v = self.val(w, lane, *a);
                    for (i, d) in ds.iter().enumerate() {
                        self.set(w, lane, *d, (v >> (i as u32 * part_bits)) & mask);
                    }
                }
            }
            Op::Ld {
                space,
                ty,
                n,
                ds,
                addr,
            } => {
                let size = ty.bytes() as usize;
                let total = size * usize::from(*n);
                // A lane that loads the global address the lane before it loaded gets the same
                // bytes, as on the hardware, which serves an address once per instruction:
                // the lanes of one load never see two values of a location that another block
                // writes meanwhile. GCC's uniform-SIMT code relies on it (every lane loads a
                // shared variable, one lane's atomic decides, every lane compares), and lanes
                // that saw different values would split where the code assumes they cannot.
                let mut buf = [0u8; 32];
                // The global address whose bytes `buf` holds, if it holds some.
                let mut held: Option<u64> = None;
                for lane in lanes {
                    let a = self.address(w, lane, *addr);
                    if held != Some(a) {
                        check_align(a, total as u64)?;
                        let loc = locate(*space, a, *addr);
                        self.read(w, lane, loc, &mut buf[..total])?;
                        held = matches!(loc, Loc::Global(_)).then_some(a);
                    }
                    for (i, d) in ds.iter().take(usize::from(*n)).enumerate() {
                        let mut le = [0u8; 8];
                        le[..size].copy_from_slice(&buf[i * size..(i + 1) * size]);
                        let raw = u64::from_le_bytes(le);
                        let v = if ty.signed() {
                            sext(raw, ty.bits()) as u64
                        } else {
                            raw
                        };
                        self.set(w, lane, *d, v);
                    }
                }
            }
            Op::St {
                space,
                ty,
                n,
                srcs,
                addr,
            } => {
                let size = ty.bytes() as usize;
                for lane in lanes {
                    let a = self.address(w, lane, *addr);
                    check_align(a, size as u64 * u64::from(*n))?;
                    let loc = locate(*space, a, *addr);
                    let mut buf = [0u8; 32];
                    for (i, s) in srcs.iter().take(usize::from(*n)).enumerate() {
                        let v = self.val(w, lane, *s);
                        buf[i * size..(i + 1) * size].copy_from_slice(&v.to_le_bytes()[..size]);
                    }
                    self.write(w, lane, loc, &buf[..size * usize::from(*n)])?;
                }
            }
            Op::IsSpace { space, p, a } => {
                for lane in lanes {
                    let v = self.val(w, lane, *a);
                    self.set(w, lane, *p, u64::from(generic_space(v) == *space));
                }
            }
            Op::Cvta { to, space, d, a } => {
                let window = match space {
                    Space::Shared => SHARED_WINDOW,
                    Space::Local => LOCAL_WINDOW,
                    _ => 0,
                };
                for lane in lanes {
                    let v = self.val(w, lane, *a);
                    let r = if *to {
                        v.wrapping_sub(window)
                    } else {
                        v.wrapping_add(window)
                    };
                    self.set(w, lane, *d, r);
                }
            }
            Op::Bra { target } => {
                for lane in lanes {
                    self.warps[w].pc[lane] = *target;
                }
            }
            Op::Call {
                callee: Callee::Vprintf,
                ret,
                args,
            } => {
                for lane in lanes {
                    let n = self.printf(w, lane, args[0].0, args[1].0)?;
                    if let Some((slot, size)) = ret {
                        let bytes = (n as u32).to_le_bytes();
                        let size = (*size as usize).min(4);
                        self.write(w, lane, Loc::FParam(u64::from(*slot)), &bytes[..size])?;
                    }
                }
            }
            Op::Call {
                callee: Callee::AssertFail,
                args,
                ..
            } => {
                let mut text = String::new();
                for lane in lanes {
                    text += &self.assertion(w, lane, args)?;
                }
                return Err(ComputeError::Assert(text));
            }
            Op::Call {
                callee: Callee::Func(f),
                ret,
                args,
            } => {
                for lane in lanes {
                    self.enter(w, lane, *f, *ret, args)?;
                }
            }
            Op::Call {
                callee: Callee::Indirect(r),
                ret,
                args,
            } => {
                for lane in lanes {
                    let addr = self.warps[w].regs[self.s.slot(*r) + lane];
                    let f = func_at(addr)
                        .filter(|&f| {
                            self.s
                                .m
                                .funcs
                                .get(f as usize)
                                .is_some_and(|func| !func.entry && func.start != func.end)
                        })
                        .ok_or_else(|| {
                            ComputeError::IllegalAddress(format!(
                                "call through {addr:#x}, which is not a function"
                            ))
                        })?;
                    self.enter(w, lane, f, *ret, args)?;
                }
            }
            Op::Call {
                callee: Callee::Malloc,
                ret,
                args,
            } => {
                for lane in lanes {
                    let size = self.param_u64(w, lane, args[0])?;
                    let addr = self.s.l.heap.map_or(0, |h| h.malloc(size));
                    if let Some((slot, bytes)) = ret {
                        let v = addr.to_le_bytes();
                        let n = (*bytes as usize).min(8);
                        self.write(w, lane, Loc::FParam(u64::from(*slot)), &v[..n])?;
                    }
                }
            }
            Op::Call {
                callee: Callee::Free,
                args,
                ..
            } => {
                for lane in lanes {
                    let addr = self.param_u64(w, lane, args[0])?;
                    if addr != 0 && !self.s.l.heap.is_some_and(|h| h.free(addr)) {
                        return Err(ComputeError::IllegalAddress(format!(
                            "free of {addr:#x}, which malloc did not return"
                        )));
                    }
                }
            }
            Op::Ret => {
                for lane in lanes {
                    match self.warps[w].frames[lane].pop() {
                        Some(frame) => {
                            if let Some((from, to, size)) = frame.copy_back {
                                let mut buf = vec![0u8; size as usize];
                                self.read(w, lane, Loc::FParam(u64::from(from)), &mut buf)?;
                                self.write(w, lane, Loc::FParam(u64::from(to)), &buf)?;
                            }
                            let warp = &mut self.warps[w];
                            warp.pc[lane] = frame.ret_pc;
                            if warp.frames[lane].is_empty() {
                                warp.calling &= !(1 << lane);
                            }
                        }
                        None => self.warps[w].exited |= 1 << lane,
                    }
                }
            }
            Op::Exit => self.warps[w].exited |= exec,
            // `bar.arrive` (`bar.sync` stops the warp before it gets here).
            Op::Bar { id, count, .. } => {
                let lane = exec.trailing_zeros() as usize;
                self.arrive(w, lane, *id, *count)?;
            }
            // `bar.red` stops the warp before it gets here, like `bar.sync`.
            Op::Nop | Op::WarpSync { .. } | Op::BarRed { .. } => {}
            Op::MovVec { ty, n, ds, srcs } => {
                let mask = ty.mask();
                for lane in lanes {
                    let mut v = [0u64; 4];
                    for i in 0..usize::from(*n) {
                        v[i] = self.val(w, lane, srcs[i]) & mask;
                    }
                    for i in 0..usize::from(*n) {
                        if ds[i] != SINK {
                            self.set(w, lane, ds[i], v[i]);
                        }
                    }
                }
            }
            Op::Atom {
                space,
                op,
                ty,
                d,
                addr,
                b,
                c,
            } => {
                for lane in lanes {
                    let a = self.address(w, lane, *addr);
                    let x = self.val(w, lane, *b);
                    let y = self.val(w, lane, *c);
                    let width = ty.bytes();
                    let mut update = |old: u64| atomic(*op, *ty, old, x, y);
                    let old = match locate(*space, a, *addr) {
                        Loc::Global(g) => self
                            .s
                            .memory
                            .atomic_update(g, width as u8, &mut update)
                            .map_err(fault)?,
                        loc @ Loc::Shared(_) => {
                            check_align(a, u64::from(width))?;
                            let mut buf = [0u8; 8];
                            self.read(w, lane, loc, &mut buf[..width as usize])?;
                            let old = u64::from_le_bytes(buf);
                            let new = update(old);
                            self.write(w, lane, loc, &new.to_le_bytes()[..width as usize])?;
                            old
                        }
                        _ => {
                            return Err(ComputeError::IllegalAddress(format!(
                                "atomic on a local address {a:#x}"
                            )));
                        }
                    };
                    self.set(w, lane, *d, old);
                }
            }
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
                    vals[lane] = self.val(w, lane, *a);
                }
                for lane in lanes {
                    let (b, c) = (self.val(w, lane, *b), self.val(w, lane, *c));
                    let (src, ok) = shfl_source(*mode, lane, b, c);
                    self.set(w, lane, *d, vals[src]);
                    self.set(w, lane, *p, u64::from(ok));
                }
            }
            Op::Vote {
                mode, d, a, negate, ..
            } => {
                let mut ballot = 0u32;
                for lane in lanes.clone() {
                    if (self.val(w, lane, *a) != 0) != *negate {
                        ballot |= 1 << lane;
                    }
                }
                let r = vote(*mode, ballot, exec);
                for lane in lanes {
                    self.set(w, lane, *d, r);
                }
            }
            Op::Match { all, d, p, a, .. } => {
                let mut vals = [0u64; WARP];
                for lane in lanes.clone() {
                    vals[lane] = self.val(w, lane, *a);
                }
                let same = |v: u64| {
                    lanes
                        .clone()
                        .filter(|&l| vals[l] == v)
                        .fold(0u32, |m, l| m | 1 << l)
                };
                let first = vals[exec.trailing_zeros() as usize];
                let uniform = same(first) == exec;
                for lane in lanes.clone() {
                    let r = if !*all {
                        same(vals[lane])
                    } else if uniform {
                        exec
                    } else {
                        0
                    };
                    self.set(w, lane, *d, u64::from(r));
                    self.set(w, lane, *p, u64::from(uniform));
                }
            }
            Op::Activemask { d } => {
                for lane in lanes {
                    self.set(w, lane, *d, u64::from(exec));
                }
            }
            Op::Trap => {
                return Err(ComputeError::IllegalInstruction(format!(
                    "trap at PTX line {}",
                    inst.line
                )));
            }
            // Executed above.
            op => {
                return Err(ComputeError::IllegalInstruction(format!(
                    "{op:?} reached the warp's own instructions"
                )));
            }
        }
        Ok(())
    }

    /// CUDA's device `printf`: formats `fmt` (a generic address) with the argument buffer at
    /// `args` (a generic address) and appends it to the block's output. Returns the number of
    /// arguments consumed.
    fn printf(
        &mut self,
        w: usize,
        lane: usize,
        fmt_slot: u32,
        args_slot: u32,
    ) -> ComputeResult<usize> {
        let mut slot = [0u8; 8];
        self.read(w, lane, Loc::FParam(u64::from(fmt_slot)), &mut slot)?;
        let fmt_addr = u64::from_le_bytes(slot);
        self.read(w, lane, Loc::FParam(u64::from(args_slot)), &mut slot)?;
        let args_addr = u64::from_le_bytes(slot);
        let fmt = self.c_string(w, lane, fmt_addr)?;
        self.count_bytes(fmt.len() + 1)?;
        let mut args = ArgReader {
            block: self,
            w,
            lane,
            addr: args_addr,
            count: 0,
        };
        let text = super::printf::format(&fmt, &mut args)?;
        let count = args.count;
        self.count_bytes(text.len())?;
        let room = MAX_PRINTF_BYTES
            .saturating_sub(self.s.output_bytes.fetch_add(text.len(), Ordering::Relaxed));
        let mut cut = text.len().min(room);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        self.out.push_str(&text[..cut]);
        Ok(count)
    }

    /// The line the driver prints for a failed `assert` of one lane: "file:line: function:
    /// block: [x,y,z], thread: [x,y,z] Assertion `message` failed."
    fn assertion(&self, w: usize, lane: usize, args: &[(u32, u32)]) -> ComputeResult<String> {
        let [message, file, line, function, ..] = args else {
            return Err(ComputeError::InvalidPtx(
                "__assertfail takes five parameters".into(),
            ));
        };
        let mut word = [0u8; 8];
        let mut text = |slot: u32| -> ComputeResult<String> {
            self.read(w, lane, Loc::FParam(u64::from(slot)), &mut word)?;
            let s = self.c_string(w, lane, u64::from_le_bytes(word))?;
            Ok(String::from_utf8_lossy(&s).into_owned())
        };
        let (message, file, function) = (text(message.0)?, text(file.0)?, text(function.0)?);
        let mut n = [0u8; 4];
        self.read(w, lane, Loc::FParam(u64::from(line.0)), &mut n)?;
        let tid = [0, 1, 2].map(|d| self.special(w, lane, Sreg::Tid(d)));
        Ok(format!(
            "{file}:{}: {function}: block: [{},{},{}], thread: [{},{},{}] Assertion `{message}` failed.\n",
            u32::from_le_bytes(n),
            self.ctaid[0],
            self.ctaid[1],
            self.ctaid[2],
            tid[0],
            tid[1],
            tid[2],
        ))
    }

    fn c_string(&self, w: usize, lane: usize, addr: u64) -> ComputeResult<Vec<u8>> {
        let mut out = Vec::new();
        let mut byte = [0u8; 1];
        while out.len() < MAX_FORMAT_BYTES {
            let a = addr.wrapping_add(out.len() as u64);
            let loc = locate(
                Space::Generic,
                a,
                Addr {
                    base: AddrBase::Abs,
                    offset: 0,
                },
            );
            self.read(w, lane, loc, &mut byte)?;
            if byte[0] == 0 {
                break;
            }
            out.push(byte[0]);
        }
        Ok(out)
    }
}

/// Reads `printf` arguments from the argument buffer: each aligned to its own size.
pub(crate) struct ArgReader<'b, 's, 'a> {
    block: &'b Block<'s, 'a>,
    w: usize,
    lane: usize,
    addr: u64,
    count: usize,
}

impl super::printf::Args for ArgReader<'_, '_, '_> {
    fn next(&mut self, size: u64) -> ComputeResult<u64> {
        let a = self
            .addr
            .checked_next_multiple_of(size)
            .ok_or_else(|| ComputeError::IllegalAddress("printf argument buffer".into()))?;
        let mut buf = [0u8; 8];
        let loc = locate(
            Space::Generic,
            a,
            Addr {
                base: AddrBase::Abs,
                offset: 0,
            },
        );
        self.block
            .read(self.w, self.lane, loc, &mut buf[..size as usize])?;
        self.addr = a + size;
        self.count += 1;
        self.block.count_bytes(size as usize)?;
        Ok(u64::from_le_bytes(buf))
    }

    fn string(&mut self, addr: u64) -> ComputeResult<Vec<u8>> {
        let s = self.block.c_string(self.w, self.lane, addr)?;
        self.block.count_bytes(s.len() + 1)?;
        Ok(s)
    }
}

/// Where a memory operand's bytes are.
#[derive(Debug, Clone, Copy)]
pub(super) enum Loc {
    Global(u64),
    Shared(u64),
    Local(u64),
    KParam(u64),
    FParam(u64),
}

/// One lane's registers, carry flag and global memory (with the texture and surface objects
/// in it), as an instruction executed for that lane alone sees them: the interpreter's lane
/// of a warp, the compiled engine's thread.
pub(super) trait LaneState: texture::Objects {
    fn val(&self, s: Src) -> u64;
    fn set(&mut self, d: u32, v: u64);
    fn carry(&self) -> bool;
    fn set_carry(&mut self, c: bool);
}

/// Whether [`lane_op`] executes `op`: the instructions that compute a lane's registers from
/// its registers alone (and texture and surface accesses, from global memory).
pub(super) fn lane_local(op: &Op) -> bool {
    matches!(
        op,
        Op::Bin { .. }
            | Op::Un { .. }
            | Op::Mad { .. }
            | Op::Setp { .. }
            | Op::Selp { .. }
            | Op::Slct { .. }
            | Op::Cvt { .. }
            | Op::Carry { .. }
            | Op::Bits { .. }
            | Op::Bfe { .. }
            | Op::Bfi { .. }
            | Op::Prmt { .. }
            | Op::Video { .. }
            | Op::Tex { .. }
            | Op::Query(_)
            | Op::Surf { .. }
    )
}

/// Executes a [`lane_local`] instruction for one lane (its guard already true).
pub(super) fn lane_op(l: &mut impl LaneState, op: &Op) -> ComputeResult<()> {
    match op {
        Op::Bin {
            op,
            ty,
            d,
            a,
            b,
            ftz,
            sat,
            rnd,
        } => {
            let r = binary(*op, *ty, l.val(*a), l.val(*b), *ftz, *sat, *rnd);
            l.set(*d, r);
        }
        Op::Un {
            op,
            ty,
            d,
            a,
            ftz,
            rnd,
        } => {
            let r = unary(*op, *ty, l.val(*a), *ftz, *rnd);
            l.set(*d, r);
        }
        Op::Mad {
            mode,
            ty,
            d,
            a,
            b,
            c,
            ftz,
            sat,
            rnd,
        } => {
            let v = [*a, *b, *c].map(|s| l.val(s));
            l.set(*d, mad(*mode, *ty, v, *ftz, *sat, *rnd));
        }
        Op::Setp {
            cmp,
            ty,
            to,
            p,
            q,
            a,
            b,
            combine,
            ftz,
        } => {
            let t = compare(*cmp, *ty, l.val(*a), l.val(*b), *ftz);
            let (tp, tq) = match combine {
                Some((op, c, neg)) => {
                    let c = (l.val(*c) != 0) != *neg;
                    let f = |v: bool| match op {
                        BoolOp::And => v && c,
                        BoolOp::Or => v || c,
                        BoolOp::Xor => v != c,
                    };
                    (f(t), f(!t))
                }
                None => (t, !t),
            };
            let v = match to {
                CmpResult::Pred => u64::from(tp),
                CmpResult::Mask if tp => 0xffff_ffff,
                CmpResult::One if tp => u64::from(1f32.to_bits()),
                _ => 0,
            };
            l.set(*p, v);
            l.set(*q, u64::from(tq));
        }
        Op::Selp { d, a, b, c, .. } => {
            let v = if l.val(*c) != 0 { l.val(*a) } else { l.val(*b) };
            l.set(*d, v);
        }
        Op::Slct {
            float,
            ftz,
            d,
            a,
            b,
            c,
        } => {
            let c = l.val(*c);
            // A NaN selector is not at least zero; -0.0 is.
            let first = if *float {
                f32_of(c, *ftz) >= 0.0
            } else {
                sext(c, 32) >= 0
            };
            let v = l.val(if first { *a } else { *b });
            l.set(*d, v);
        }
        Op::Cvt {
            dty,
            sty,
            d,
            a,
            rnd,
            irnd,
            sat,
            ftz,
        } => {
            let r = convert(*dty, *sty, l.val(*a), *rnd, *irnd, *sat, *ftz);
            l.set(*d, r);
        }
        Op::Carry {
            op,
            carry_in,
            carry_out,
            ty,
            d,
            a,
            b,
            c,
        } => {
            let cin = *carry_in && l.carry();
            let v = [*a, *b, *c].map(|s| l.val(s));
            let (r, cout) = carry(*op, *ty, v, cin);
            l.set(*d, r);
            if *carry_out {
                l.set_carry(cout);
            }
        }
        Op::Bits { op, ty, d, srcs } => {
            let v = srcs.map(|s| l.val(s));
            l.set(*d, bits(*op, *ty, v));
        }
        Op::Bfe { ty, d, a, b, c } => {
            let (x, pos, len) = (l.val(*a), l.val(*b) & 0xff, l.val(*c) & 0xff);
            l.set(*d, bfe(*ty, x, pos as u32, len as u32));
        }
        Op::Bfi { ty, d, f, b, c, e } => {
            let v = [*f, *b, *c, *e].map(|s| l.val(s));
            l.set(*d, bfi(*ty, v));
        }
        Op::Prmt { d, a, b, c } => {
            let v = [*a, *b, *c].map(|s| l.val(s));
            l.set(*d, prmt(v));
        }
        Op::Video {
            op,
            signed,
            sat,
            sec,
            d,
            a,
            b,
            c,
        } => {
            let word = |v: u64, s: bool| if s { sext(v, 32) } else { (v as u32).into() };
            let x = word(l.val(*a), signed[1]);
            let y = word(l.val(*b), signed[2]);
            let z = word(l.val(*c), signed[0]);
            l.set(*d, video(*op, signed[0], *sat, *sec, x, y, z));
        }
        Op::Tex {
            geom,
            int,
            gather,
            lod,
            ds,
            handle,
            coords,
        } => {
            let h = l.val(*handle);
            let raw = coords.map(|c| l.val(c) as u32);
            let f = |s: Src| f32::from_bits(l.val(s) as u32);
            let lod = match *lod {
                Lod::Implicit => texture::Lod::Implicit,
                Lod::Level(x) => texture::Lod::Level(f(x)),
                Lod::Grad(x, y) => texture::Lod::Grad(x.map(f), y.map(f)),
            };
            let gather = gather.map(usize::from);
            let v = texture::sample(l, h, *geom, *int, gather, lod, raw).map_err(texture_fault)?;
            for (d, v) in ds.iter().zip(v) {
                l.set(*d, u64::from(v));
            }
        }
        Op::Query(q) => {
            let h = l.val(q.handle);
            let v = texture::query(l, h, q.surface, q.q).map_err(texture_fault)?;
            l.set(q.d, u64::from(v));
        }
        Op::Surf {
            store,
            geom,
            ty,
            n,
            oob,
            vals,
            handle,
            coords,
        } => {
            let size = ty.bytes() as usize;
            let total = size * usize::from(*n);
            let h = l.val(*handle);
            let raw = coords.map(|c| l.val(c) as u32);
            let mut buf = [0u8; 16];
            if *store {
                for (i, s) in vals.iter().take(usize::from(*n)).enumerate() {
                    let v = l.val(*s).to_le_bytes();
                    buf[i * size..(i + 1) * size].copy_from_slice(&v[..size]);
                }
                texture::surface_store(l, h, *geom, raw, *oob, &buf[..total])
                    .map_err(texture_fault)?;
            } else {
                texture::surface_load(l, h, *geom, raw, *oob, &mut buf[..total])
                    .map_err(texture_fault)?;
                for (i, s) in vals.iter().take(usize::from(*n)).enumerate() {
                    let mut le = [0u8; 8];
                    le[..size].copy_from_slice(&buf[i * size..(i + 1) * size]);
                    if let Src::Reg(d) = s {
                        l.set(*d, u64::from_le_bytes(le));
                    }
                }
            }
        }
        op => {
            return Err(ComputeError::IllegalInstruction(format!(
                "{op:?} is not executed lane by lane"
            )));
        }
    }
    Ok(())
}

/// A lane of a warp of the interpreter's block.
struct WarpLane<'b, 's, 'a> {
    block: &'b mut Block<'s, 'a>,
    w: usize,
    lane: usize,
}

impl LaneState for WarpLane<'_, '_, '_> {
    fn val(&self, s: Src) -> u64 {
        self.block.val(self.w, self.lane, s)
    }
    fn set(&mut self, d: u32, v: u64) {
        self.block.set(self.w, self.lane, d, v);
    }
    fn carry(&self) -> bool {
        self.block.warps[self.w].carry & (1 << self.lane) != 0
    }
    fn set_carry(&mut self, c: bool) {
        let warp = &mut self.block.warps[self.w];
        warp.carry = (warp.carry & !(1 << self.lane)) | (u32::from(c) << self.lane);
    }
}

/// The interpreter reads every object as the reference does.
impl texture::Objects for WarpLane<'_, '_, '_> {
    fn memory(&self) -> &dyn GlobalMemory {
        self.block.s.memory
    }
}

/// `bfi.ty d, f, b, c, e`: `e` bits of `f` inserted into `b` at bit `c`.
fn bfi(ty: Ty, [ins, base, pos, len]: [u64; 4]) -> u64 {
    let (pos, len) = ((pos & 0xff) as u32, (len & 0xff) as u32);
    let mut r = base;
    for i in 0..len.min(ty.bits().saturating_sub(pos)) {
        let bit = (ins >> i) & 1;
        r = (r & !(1 << (pos + i))) | (bit << (pos + i));
    }
    r
}

/// `prmt.b32 d, a, b, c` (the general byte selection).
fn prmt([a, b, sel]: [u64; 3]) -> u64 {
    let bytes = ((b & 0xffff_ffff) << 32) | (a & 0xffff_ffff);
    let mut r = 0u64;
    for i in 0..4 {
        let s = (sel >> (4 * i)) & 0xf;
        let mut byte = (bytes >> ((s & 7) * 8)) & 0xff;
        if s & 8 != 0 {
            byte = if byte & 0x80 != 0 { 0xff } else { 0 };
        }
        r |= byte << (8 * i);
    }
    r
}

/// The lane `shfl.sync` reads for `lane` (and whether it is in range, else the lane's own
/// value): `b` the lane operand, `c` the clamp and segment mask. A source lane that does not
/// take part in the shuffle (outside the member mask, or not arrived) gives 0 in both
/// engines: PTX leaves its value undefined, and a register read from a lane that is elsewhere
/// in its code would depend on how far each engine ran it; 0 is what NVIDIA's `reduction`
/// sample's last-warp sum (member mask of 8 lanes, offsets up to 16) needs to be right.
pub(super) fn shfl_source(mode: ShflMode, lane: usize, b: u64, c: u64) -> (usize, bool) {
    let bval = (b & 0x1f) as i64;
    let clamp = (c & 0x1f) as i64;
    let seg = ((c >> 8) & 0x1f) as i64;
    let l = lane as i64;
    let max_lane = (l & seg) | (clamp & !seg);
    let min_lane = l & seg;
    let (j, ok) = match mode {
        ShflMode::Up => (l - bval, l - bval >= max_lane),
        ShflMode::Down => (l + bval, l + bval <= max_lane),
        ShflMode::Bfly => (l ^ bval, (l ^ bval) <= max_lane),
        ShflMode::Idx => {
            let j = min_lane | (bval & !seg);
            (j, j <= max_lane)
        }
    };
    (if ok { j as usize & 31 } else { lane }, ok)
}

/// What `vote.sync` gives the lanes `exec` of whose predicates `ballot` holds the true ones.
pub(super) fn vote(mode: VoteMode, ballot: u32, exec: u32) -> u64 {
    match mode {
        VoteMode::Ballot => u64::from(ballot),
        VoteMode::All => u64::from(ballot == exec),
        VoteMode::Any => u64::from(ballot != 0),
        VoteMode::Uni => u64::from(ballot == exec || ballot == 0),
    }
}

/// A scalar video instruction on sign- or zero-extended words.
fn video(op: VideoOp, dsigned: bool, sat: bool, sec: Option<BinOp>, x: i64, y: i64, z: i64) -> u64 {
    let mut t = match op {
        VideoOp::Add => x + y,
        VideoOp::Sub => x - y,
        VideoOp::AbsDiff => (x - y).abs(),
        VideoOp::Min => x.min(y),
        VideoOp::Max => x.max(y),
    };
    if sat {
        t = if dsigned {
            t.clamp(i64::from(i32::MIN), i64::from(i32::MAX))
        } else {
            t.clamp(0, i64::from(u32::MAX))
        };
    }
    let r = match sec {
        Some(BinOp::Add) => t.wrapping_add(z),
        Some(BinOp::Min) => t.min(z),
        Some(BinOp::Max) => t.max(z),
        _ => t,
    };
    r as u64 & 0xffff_ffff
}

/// A refused texture or surface access: a fault of the context, as the hardware's for a bad
/// descriptor or an out-of-range `.trap` surface access.
fn texture_fault(e: texture::TextureError) -> ComputeError {
    ComputeError::IllegalAddress(e.to_string())
}

pub(super) fn fault(f: Fault) -> ComputeError {
    match f.kind {
        FaultKind::OutOfRange => ComputeError::IllegalAddress(f.to_string()),
        FaultKind::Misaligned => ComputeError::MisalignedAddress(f.to_string()),
    }
}

/// Resolves a (space, address) of an operand `a` to where the bytes are.
pub(super) fn locate(space: Space, addr: u64, a: Addr) -> Loc {
    match space {
        Space::Global | Space::Const => Loc::Global(addr),
        Space::Shared => Loc::Shared(addr),
        Space::Local => Loc::Local(addr),
        Space::Param => match a.base {
            AddrBase::Sym(SymRef::KernelParam(_)) => Loc::KParam(addr),
            _ if addr.wrapping_sub(KPARAM_WINDOW) < WINDOW_BYTES => {
                Loc::KParam(addr - KPARAM_WINDOW)
            }
            _ => Loc::FParam(addr),
        },
        Space::Generic => match generic_space(addr) {
            Space::Shared => Loc::Shared(addr - SHARED_WINDOW),
            Space::Local => Loc::Local(addr - LOCAL_WINDOW),
            _ => Loc::Global(addr),
        },
    }
}

/// The space a generic address points into: the shared or local window, else global memory.
pub(super) fn generic_space(addr: u64) -> Space {
    if addr.wrapping_sub(SHARED_WINDOW) < WINDOW_BYTES {
        Space::Shared
    } else if addr.wrapping_sub(LOCAL_WINDOW) < WINDOW_BYTES {
        Space::Local
    } else {
        Space::Global
    }
}

pub(super) fn check_align(addr: u64, size: u64) -> ComputeResult<()> {
    if size > 1 && addr % size != 0 {
        return Err(fault(Fault {
            kind: FaultKind::Misaligned,
            addr,
            size,
        }));
    }
    Ok(())
}

fn sat_s32(v: i64) -> u64 {
    v.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as u64
}

/// `min`/`max` of two floats of `ty` (bits in, bits out) as the ISA defines them: a NaN
/// operand gives the other one, two give the canonical NaN, and −0 is below +0.
fn min_max(op: BinOp, ty: Ty, x: u64, y: u64) -> u64 {
    let (a, b, canonical) = if ty == Ty::F32 {
        let (a, b) = (f32::from_bits(x as u32), f32::from_bits(y as u32));
        (f64::from(a), f64::from(b), 0x7fff_ffff)
    } else {
        (f64::from_bits(x), f64::from_bits(y), 0x7fff_ffff_ffff_ffff)
    };
    match (a.is_nan(), b.is_nan()) {
        (true, true) => canonical,
        (true, false) => y,
        (false, true) => x,
        _ => {
            let a_first = if a == b {
                // Equal values differ at most in the sign of zero.
                a.is_sign_negative() == (op == BinOp::Min)
            } else {
                (a < b) == (op == BinOp::Min)
            };
            if a_first { x } else { y }
        }
    }
}

fn binary(op: BinOp, ty: Ty, x: u64, y: u64, ftz: bool, sat: bool, rnd: Rnd) -> u64 {
    if ty.half() {
        // The parser admits add, sub and mul only.
        return half_lanes(ty, [x, y, 0], |[a, b, _]| match op {
            BinOp::MulLo => f16_fma(a, b, None, ftz, sat, rnd),
            BinOp::Sub => f16_fma(a, F16_ONE, Some(b ^ 0x8000), ftz, sat, rnd),
            _ => f16_fma(a, F16_ONE, Some(b), ftz, sat, rnd),
        });
    }
    let bits = ty.bits();
    let mask = ty.mask();
    if ty == Ty::F32 {
        let (a, b) = (f32_of(x, ftz), f32_of(y, ftz));
        let r = match op {
            BinOp::Add | BinOp::Sub | BinOp::MulLo if rnd != Rnd::Rn => {
                let (a, b) = (f64::from(a), f64::from(b));
                match op {
                    BinOp::MulLo => round_f64(a * b, 0.0, rnd),
                    _ => {
                        let b = if op == BinOp::Sub { -b } else { b };
                        let s = a + b;
                        let bb = s - a;
                        let e = (a - (s - bb)) + (b - bb);
                        round_f64(s, e, rnd)
                    }
                }
            }
            BinOp::Div if rnd != Rnd::Rn => {
                let r = a / b;
                let t = (f64::from(a) - f64::from(r) * f64::from(b)) * f64::from(b).signum();
                let finite = a.is_finite() && b.is_finite() && b != 0.0;
                directed(r, f32_order(r, t, finite), rnd)
            }
            BinOp::Add => a + b,
            BinOp::Sub => a - b,
            BinOp::MulLo => a * b,
            BinOp::Div => a / b,
            BinOp::Min | BinOp::Max => {
                return u64::from(min_max(op, ty, a.to_bits().into(), b.to_bits().into()) as u32);
            }
            BinOp::CopySign => b.copysign(a),
            _ => f32::from_bits(0),
        };
        let r = if sat {
            saturate01(f64::from(r)) as f32
        } else {
            r
        };
        return arithmetic_f32(r, ftz, !matches!(op, BinOp::CopySign));
    }
    if ty == Ty::F64 {
        let (a, b) = (f64::from_bits(x), f64::from_bits(y));
        let r = match op {
            BinOp::Add | BinOp::Sub | BinOp::MulLo => f64_rounded(op, a, b, rnd),
            BinOp::Div => f64_div_sqrt(a, Some(b), rnd),
            BinOp::Min | BinOp::Max => return min_max(op, ty, x, y),
            BinOp::CopySign => b.copysign(a),
            _ => 0.0,
        };
        return arithmetic_f64(if sat { saturate01(r) } else { r }, op != BinOp::CopySign);
    }
    if ty == Ty::Pred {
        let (a, b) = (x != 0, y != 0);
        return u64::from(match op {
            BinOp::And => a && b,
            BinOp::Or => a || b,
            BinOp::Xor => a != b,
            _ => false,
        });
    }
    let (ux, uy) = (x & mask, y & mask);
    let (sx, sy) = (sext(x, bits), sext(y, bits));
    let signed = ty.signed();
    let r = match op {
        BinOp::Add if sat => sat_s32(sx + sy),
        BinOp::Sub if sat => sat_s32(sx - sy),
        BinOp::Add => ux.wrapping_add(uy),
        BinOp::Sub => ux.wrapping_sub(uy),
        BinOp::MulLo => ux.wrapping_mul(uy),
        BinOp::MulHi | BinOp::MulWide => {
            let p: i128 = if signed {
                i128::from(sx) * i128::from(sy)
            } else {
                // u64 × u64 exceeds i128: its bits are those of the u128 product.
                (u128::from(ux) * u128::from(uy)) as i128
            };
            if op == BinOp::MulHi {
                (p >> bits) as u64
            } else {
                return p as u64 & wide(ty).mask();
            }
        }
        BinOp::Div => {
            if uy == 0 {
                mask
            } else if signed {
                sx.wrapping_div(sy) as u64
            } else {
                ux / uy
            }
        }
        BinOp::Rem => {
            if uy == 0 {
                ux
            } else if signed {
                sx.wrapping_rem(sy) as u64
            } else {
                ux % uy
            }
        }
        BinOp::And => ux & uy,
        BinOp::Or => ux | uy,
        BinOp::Xor => ux ^ uy,
        BinOp::Shl => {
            let n = y & 0xffff_ffff;
            if n >= u64::from(bits) { 0 } else { ux << n }
        }
        BinOp::Shr => {
            let n = (y & 0xffff_ffff).min(u64::from(bits) - 1) as u32;
            if signed {
                (sx >> n) as u64
            } else if y & 0xffff_ffff >= u64::from(bits) {
                0
            } else {
                ux >> n
            }
        }
        BinOp::Min => {
            if signed {
                sx.min(sy) as u64
            } else {
                ux.min(uy)
            }
        }
        BinOp::Max => {
            if signed {
                sx.max(sy) as u64
            } else {
                ux.max(uy)
            }
        }
        BinOp::CopySign => ux,
    };
    r & mask
}

fn unary(op: UnOp, ty: Ty, x: u64, ftz: bool, rnd: Rnd) -> u64 {
    if ty.half() {
        // The parser admits neg and abs only.
        return half_lanes(ty, [x, 0, 0], |[a, _, _]| {
            // Sign operations on the bits (a NaN's payload is unspecified, and kept).
            let a = f16_flush(a, ftz);
            if op == UnOp::Neg {
                a ^ 0x8000
            } else {
                a & 0x7FFF
            }
        });
    }
    let bits = ty.bits();
    let mask = ty.mask();
    if ty == Ty::F32 {
        let a = f32_of(x, ftz);
        let r = match op {
            UnOp::Neg => -a,
            UnOp::Abs => a.abs(),
            UnOp::Rcp if rnd != Rnd::Rn => {
                let r = 1.0 / a;
                let t = (1.0 - f64::from(r) * f64::from(a)) * f64::from(a).signum();
                directed(r, f32_order(r, t, a.is_finite() && a != 0.0), rnd)
            }
            UnOp::Sqrt if rnd != Rnd::Rn => {
                let r = a.sqrt();
                let t = f64::from(a) - f64::from(r) * f64::from(r);
                directed(r, f32_order(r, t, a.is_finite() && a >= 0.0), rnd)
            }
            UnOp::Rcp => 1.0 / a,
            UnOp::Sqrt => a.sqrt(),
            UnOp::Rsqrt => 1.0 / a.sqrt(),
            UnOp::Sin => a.sin(),
            UnOp::Cos => a.cos(),
            UnOp::Ex2 => a.exp2(),
            UnOp::Lg2 => a.log2(),
            _ => a,
        };
        return f32_bits(r, ftz);
    }
    if ty == Ty::F64 {
        // Only the `.approx.ftz` reciprocals take `.ftz` on f64.
        let flush = |v: f64| {
            if ftz && v.is_subnormal() {
                0.0f64.copysign(v)
            } else {
                v
            }
        };
        let a = flush(f64::from_bits(x));
        let r = match op {
            UnOp::Neg => -a,
            UnOp::Abs => a.abs(),
            UnOp::Rcp => f64_div_sqrt(1.0, Some(a), rnd),
            UnOp::Sqrt => f64_div_sqrt(a, None, rnd),
            UnOp::Rsqrt => 1.0 / a.sqrt(),
            UnOp::Sin => a.sin(),
            UnOp::Cos => a.cos(),
            UnOp::Ex2 => a.exp2(),
            UnOp::Lg2 => a.log2(),
            _ => a,
        };
        return flush(r).to_bits();
    }
    if ty == Ty::Pred {
        return u64::from(match op {
            UnOp::Not => x == 0,
            _ => x != 0,
        });
    }
    let ux = x & mask;
    match op {
        UnOp::Neg => ux.wrapping_neg() & mask,
        UnOp::Abs => sext(x, bits).unsigned_abs() & mask,
        UnOp::Not => !ux & mask,
        UnOp::CNot => u64::from(ux == 0),
        UnOp::Popc => u64::from(ux.count_ones()),
        UnOp::Clz => u64::from(ux.leading_zeros() - (64 - bits)),
        UnOp::Brev => ux.reverse_bits() >> (64 - bits),
        _ => ux,
    }
}

fn mad(mode: MadMode, ty: Ty, [x, y, z]: [u64; 3], ftz: bool, sat: bool, rnd: Rnd) -> u64 {
    let bits = ty.bits();
    match mode {
        MadMode::Float if ty.half() => half_lanes(ty, [x, y, z], |[a, b, c]| {
            f16_fma(a, b, Some(c), ftz, sat, rnd)
        }),
        MadMode::Float if ty == Ty::F32 => {
            let (a, b, c) = (f32_of(x, ftz), f32_of(y, ftz), f32_of(z, ftz));
            let r = a.mul_add(b, c);
            let r = if rnd == Rnd::Rn {
                r
            } else {
                // The product is exact in f64; TwoSum adds the addend without error.
                let (p, c) = (f64::from(a) * f64::from(b), f64::from(c));
                let s = p + c;
                let cc = s - p;
                let e = (p - (s - cc)) + (c - cc);
                let finite = a.is_finite() && b.is_finite() && c.is_finite();
                directed(r, f32_order(r, (s - f64::from(r)) + e, finite), rnd)
            };
            let r = if sat {
                saturate01(f64::from(r)) as f32
            } else {
                r
            };
            arithmetic_f32(r, ftz, true)
        }
        MadMode::Float => {
            let r = f64::from_bits(x).mul_add(f64::from_bits(y), f64::from_bits(z));
            arithmetic_f64(if sat { saturate01(r) } else { r }, true)
        }
        MadMode::Lo => {
            if sat && ty == Ty::S32 {
                sat_s32(
                    sext(x, 32)
                        .wrapping_mul(sext(y, 32))
                        .wrapping_add(sext(z, 32)),
                ) & 0xffff_ffff
            } else {
                x.wrapping_mul(y).wrapping_add(z) & ty.mask()
            }
        }
        MadMode::Hi => {
            let hi = binary(BinOp::MulHi, ty, x, y, false, false, Rnd::Rn);
            if sat && ty == Ty::S32 {
                sat_s32(sext(hi, 32) + sext(z, 32)) & 0xffff_ffff
            } else {
                hi.wrapping_add(z) & ty.mask()
            }
        }
        MadMode::Lo24 | MadMode::Hi24 => {
            let v = |x: u64| {
                if ty.signed() {
                    sext(x, 24)
                } else {
                    (x & 0xff_ffff) as i64
                }
            };
            // At most 48 bits: exact in an i64.
            let t = v(x) * v(y);
            let part = if mode == MadMode::Hi24 { t >> 16 } else { t };
            if sat {
                sat_s32(sext(part as u64, 32) + sext(z, 32)) & 0xffff_ffff
            } else {
                (part as u64).wrapping_add(z) & ty.mask()
            }
        }
        MadMode::Sad => {
            let v = |x: u64| {
                if ty.signed() {
                    i128::from(sext(x, bits))
                } else {
                    i128::from(x & ty.mask())
                }
            };
            ((v(x) - v(y)).unsigned_abs() as u64).wrapping_add(z) & ty.mask()
        }
        MadMode::Wide => {
            let p = binary(BinOp::MulWide, ty, x, y, false, false, Rnd::Rn);
            p.wrapping_add(z) & wide(ty).mask().max(if bits == 64 { u64::MAX } else { 0 })
        }
    }
}

fn compare(cmp: Cmp, ty: Ty, x: u64, y: u64, ftz: bool) -> bool {
    if ty.float() {
        let (a, b) = if ty == Ty::F32 {
            (f64::from(f32_of(x, ftz)), f64::from(f32_of(y, ftz)))
        } else if ty == Ty::F16 {
            (
                f16_to_f64(f16_flush(x as u16, ftz)),
                f16_to_f64(f16_flush(y as u16, ftz)),
            )
        } else {
            (f64::from_bits(x), f64::from_bits(y))
        };
        let nan = a.is_nan() || b.is_nan();
        return match cmp {
            Cmp::Eq => !nan && a == b,
            Cmp::Ne => !nan && a != b,
            Cmp::Lt | Cmp::Lo => !nan && a < b,
            Cmp::Le | Cmp::Ls => !nan && a <= b,
            Cmp::Gt | Cmp::Hi => !nan && a > b,
            Cmp::Ge | Cmp::Hs => !nan && a >= b,
            Cmp::Equ => nan || a == b,
            Cmp::Neu => nan || a != b,
            Cmp::Ltu => nan || a < b,
            Cmp::Leu => nan || a <= b,
            Cmp::Gtu => nan || a > b,
            Cmp::Geu => nan || a >= b,
            Cmp::Num => !nan,
            Cmp::Nan => nan,
        };
    }
    let bits = ty.bits();
    let (ux, uy) = (x & ty.mask(), y & ty.mask());
    let (sx, sy) = (sext(x, bits), sext(y, bits));
    let signed = ty.signed();
    match cmp {
        Cmp::Eq | Cmp::Equ => ux == uy,
        Cmp::Ne | Cmp::Neu => ux != uy,
        Cmp::Lt | Cmp::Ltu if signed => sx < sy,
        Cmp::Le | Cmp::Leu if signed => sx <= sy,
        Cmp::Gt | Cmp::Gtu if signed => sx > sy,
        Cmp::Ge | Cmp::Geu if signed => sx >= sy,
        Cmp::Lt | Cmp::Ltu | Cmp::Lo => ux < uy,
        Cmp::Le | Cmp::Leu | Cmp::Ls => ux <= uy,
        Cmp::Gt | Cmp::Gtu | Cmp::Hi => ux > uy,
        Cmp::Ge | Cmp::Geu | Cmp::Hs => ux >= uy,
        Cmp::Num => true,
        Cmp::Nan => false,
    }
}

/// A [`CarryOp`] on one lane: the result and the carry (or, for `Sub`, borrow) out.
fn carry(op: CarryOp, ty: Ty, [a, b, c]: [u64; 3], cin: bool) -> (u64, bool) {
    let bits = ty.bits();
    let mask = ty.mask();
    let (ua, ub, cin) = (u128::from(a & mask), u128::from(b & mask), u128::from(cin));
    let sum = |x: u128, y: u128| {
        let s = x + y + cin;
        ((s as u64) & mask, s >> bits != 0)
    };
    match op {
        CarryOp::Add => sum(ua, ub),
        CarryOp::Sub => {
            let s = ua.wrapping_sub(ub).wrapping_sub(cin);
            ((s as u64) & mask, ua < ub + cin)
        }
        CarryOp::Mad { hi } => {
            let half = if ty.signed() {
                let p = i128::from(sext(a, bits)) * i128::from(sext(b, bits));
                if hi { (p >> bits) as u128 } else { p as u128 }
            } else {
                let p = ua * ub;
                if hi { p >> bits } else { p }
            };
            sum(half & u128::from(mask), u128::from(c & mask))
        }
    }
}

/// The byte `prmt` mode `mode` puts in each byte of its result (lowest first) for selector
/// `s`, from the ISA's table; bytes 0-3 are `a`'s, 4-7 `b`'s.
fn prmt_mode_bytes(mode: PrmtMode, s: u64) -> [u64; 4] {
    match mode {
        PrmtMode::F4e => [s, s + 1, s + 2, s + 3].map(|b| b % 8),
        PrmtMode::B4e => [s, s + 7, s + 6, s + 5].map(|b| b % 8),
        PrmtMode::Rc8 => [s; 4],
        PrmtMode::Ecl => [s, s.max(1), s.max(2), 3],
        PrmtMode::Ecr => [0, s.min(1), s.min(2), s],
        PrmtMode::Rc16 => {
            let lo = (s & 1) * 2;
            [lo, lo + 1, lo, lo + 1]
        }
    }
}

/// [`BitOp`]s, from the ISA's definitions; `a`, `b`, `c`, `e` the operands in order.
fn bits(op: BitOp, ty: Ty, [a, b, c, e]: [u64; 4]) -> u64 {
    let (a32, b32, c32) = (a & 0xffff_ffff, b & 0xffff_ffff, c & 0xffff_ffff);
    match op {
        BitOp::Lop3 => {
            let mut r = 0;
            for i in 0..32 {
                let idx = ((a32 >> i) & 1) << 2 | ((b32 >> i) & 1) << 1 | ((c32 >> i) & 1);
                r |= ((e >> idx) & 1) << i;
            }
            r
        }
        BitOp::Shf { left, clamp } => {
            let n = if clamp { c32.min(32) } else { c32 & 31 };
            let wide = (b32 << 32) | a32;
            if left {
                ((wide << n) >> 32) & 0xffff_ffff
            } else {
                (wide >> n) & 0xffff_ffff
            }
        }
        BitOp::Bfind { shiftamt } => {
            let bits = ty.bits();
            let v = a & ty.mask();
            // A negative signed value's most significant 0 is found instead.
            let v = if ty.signed() && (v >> (bits - 1)) & 1 == 1 {
                !v & ty.mask()
            } else {
                v
            };
            if v == 0 {
                0xffff_ffff
            } else {
                let msb = 63 - u64::from(v.leading_zeros());
                if shiftamt {
                    u64::from(bits) - 1 - msb
                } else {
                    msb
                }
            }
        }
        BitOp::Bmsk { clamp } => {
            let (pos, width) = if clamp {
                (a32.min(32), b32.min(32))
            } else {
                (a32 & 31, b32 & 31)
            };
            (((1u64 << width) - 1) << pos) & 0xffff_ffff
        }
        BitOp::Prmt(mode) => {
            let pool = (b32 << 32) | a32;
            prmt_mode_bytes(mode, c & 3)
                .iter()
                .enumerate()
                .map(|(i, &s)| ((pool >> (s * 8)) & 0xff) << (8 * i))
                .sum()
        }
        BitOp::Testp(class) => {
            let v = if ty == Ty::F32 {
                f64::from(f32::from_bits(a as u32))
            } else {
                f64::from_bits(a)
            };
            // Classes of the operand's own format: an f32 subnormal is normal in f64.
            let subnormal = if ty == Ty::F32 {
                f32::from_bits(a as u32).is_subnormal()
            } else {
                v.is_subnormal()
            };
            u64::from(match class {
                FloatClass::Finite => v.is_finite(),
                FloatClass::Infinite => v.is_infinite(),
                FloatClass::Number => !v.is_nan(),
                FloatClass::NotANumber => v.is_nan(),
                FloatClass::Normal => v.is_finite() && v != 0.0 && !subnormal,
                FloatClass::Subnormal => subnormal,
            })
        }
        BitOp::Dp4a { sa, sb } => {
            let part = |v: u64, i: u64, signed: bool| {
                let byte = (v >> (8 * i)) & 0xff;
                if signed { sext(byte, 8) } else { byte as i64 }
            };
            let dot: i64 = (0..4).map(|i| part(a, i, sa) * part(b, i, sb)).sum();
            (c32 as i64).wrapping_add(dot) as u64 & 0xffff_ffff
        }
        BitOp::Dp2a { hi, sa, sb } => {
            let half = |i: u64| {
                let h = (a >> (16 * i)) & 0xffff;
                if sa { sext(h, 16) } else { h as i64 }
            };
            let byte = |i: u64| {
                let v = (b >> (8 * i)) & 0xff;
                if sb { sext(v, 8) } else { v as i64 }
            };
            let base = if hi { 2 } else { 0 };
            let dot = half(0) * byte(base) + half(1) * byte(base + 1);
            (c32 as i64).wrapping_add(dot) as u64 & 0xffff_ffff
        }
    }
}

fn bfe(ty: Ty, x: u64, pos: u32, len: u32) -> u64 {
    let msb = ty.bits() - 1;
    let sbit = if !ty.signed() || len == 0 {
        0
    } else {
        (x >> (pos + len - 1).min(msb)) & 1
    };
    let mut r = 0u64;
    for i in 0..=msb {
        let bit = if i < len && pos + i <= msb {
            (x >> (pos + i)) & 1
        } else {
            sbit
        };
        r |= bit << i;
    }
    r
}

fn int_range(ty: Ty) -> (i128, i128) {
    let bits = ty.bits();
    if ty.signed() {
        (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1)
    } else {
        (0, (1i128 << bits) - 1)
    }
}

fn round_int(v: f64, irnd: Option<IRnd>) -> f64 {
    match irnd.unwrap_or(IRnd::Rzi) {
        IRnd::Rni => v.round_ties_even(),
        IRnd::Rzi => v.trunc(),
        IRnd::Rmi => v.floor(),
        IRnd::Rpi => v.ceil(),
    }
}

/// A `cvt` source of a float type, exactly as an f64.
fn float_source(sty: Ty, x: u64, ftz: bool) -> f64 {
    match sty {
        Ty::F32 => f64::from(f32_of(x, ftz)),
        Ty::F16 => f16_to_f64(x as u16),
        _ => f64::from_bits(x),
    }
}

fn convert(
    dty: Ty,
    sty: Ty,
    x: u64,
    rnd: Option<Rnd>,
    irnd: Option<IRnd>,
    sat: bool,
    ftz: bool,
) -> u64 {
    let rnd = rnd.unwrap_or(Rnd::Rn);
    match (dty.float(), sty.float()) {
        (false, false) => {
            let v: i128 = if sty.signed() {
                i128::from(sext(x, sty.bits()))
            } else {
                i128::from(x & sty.mask())
            };
            if sat {
                let (lo, hi) = int_range(dty);
                (v.clamp(lo, hi) as u64) & dty.mask()
            } else {
                (v as u64) & dty.mask()
            }
        }
        (true, false) => {
            let v: i128 = if sty.signed() {
                i128::from(sext(x, sty.bits()))
            } else {
                i128::from(x & sty.mask())
            };
            if dty == Ty::F16 {
                let h = round_f16(v < 0, v.unsigned_abs(), 0, rnd);
                u64::from(if sat {
                    f16_from_f64(saturate01(f16_to_f64(h)), rnd)
                } else {
                    h
                })
            } else if dty == Ty::F32 {
                let r = round_int_f32(v, rnd);
                f32_bits(
                    if sat {
                        saturate01(f64::from(r)) as f32
                    } else {
                        r
                    },
                    ftz,
                )
            } else {
                let r = v as f64;
                let r = directed64(r, v.cmp(&(r as i128)), rnd);
                (if sat { saturate01(r) } else { r }).to_bits()
            }
        }
        (false, true) => {
            let f = float_source(sty, x, ftz);
            if f.is_nan() {
                return 0;
            }
            let (lo, hi) = int_range(dty);
            let r = round_int(f, irnd);
            let v = if r <= lo as f64 {
                lo
            } else if r >= hi as f64 {
                hi
            } else {
                r as i128
            };
            (v as u64) & dty.mask()
        }
        (true, true) => {
            let f = float_source(sty, x, ftz);
            let f = if irnd.is_some() {
                round_int(f, irnd)
            } else {
                f
            };
            let f = if sat { saturate01(f) } else { f };
            if dty == Ty::F16 {
                u64::from(f16_from_f64(f, rnd))
            } else if dty == Ty::F32 {
                let r = if sty == Ty::F32 {
                    f as f32
                } else {
                    round_f64(f, 0.0, rnd)
                };
                f32_bits(r, ftz)
            } else {
                f.to_bits()
            }
        }
    }
}

pub(super) fn atomic(op: AtomOp, ty: Ty, old: u64, x: u64, y: u64) -> u64 {
    let mask = ty.mask();
    match op {
        // The ISA's atom.add.f32 flushes subnormal inputs and results to zero.
        AtomOp::Add if ty == Ty::F32 => f32_bits(f32_of(old, true) + f32_of(x, true), true),
        AtomOp::Add if ty == Ty::F64 => (f64::from_bits(old) + f64::from_bits(x)).to_bits(),
        AtomOp::Add => old.wrapping_add(x) & mask,
        AtomOp::Min | AtomOp::Max => {
            let less = compare(Cmp::Lt, ty, x, old, false);
            let take_new = if op == AtomOp::Min {
                less
            } else {
                compare(Cmp::Gt, ty, x, old, false)
            };
            if take_new { x & mask } else { old }
        }
        AtomOp::Inc => {
            if (old & mask) >= (x & mask) {
                0
            } else {
                (old + 1) & mask
            }
        }
        AtomOp::Dec => {
            if old & mask == 0 || (old & mask) > (x & mask) {
                x & mask
            } else {
                (old - 1) & mask
            }
        }
        AtomOp::And => old & x & mask,
        AtomOp::Or => (old | x) & mask,
        AtomOp::Xor => (old ^ x) & mask,
        AtomOp::Exch => x & mask,
        AtomOp::Cas => {
            if old & mask == x & mask {
                y & mask
            } else {
                old
            }
        }
    }
}
