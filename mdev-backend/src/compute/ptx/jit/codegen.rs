//! PTX functions to Cranelift IR: one native function per PTX function, running one thread.
//!
//! Registers are SSA variables (64-bit, masked to their declared width as the interpreter
//! keeps them; f32 or f64 for the registers float instructions mostly use, which then stay
//! in float registers). The kernel's function starts with a jump table over its resume points: entry,
//! and the instruction after each warp- or block-collective one, where it stored every
//! register and returned [`YIELDED`]. Loads and stores check their bounds inline against the
//! thread's areas and the last allocation it reached, and take the helper's path (which faults
//! or refreshes that allocation) when a check fails. Each labelled block adds its length to
//! the thread's fuel; a backward branch with [`FUEL_CHECK`] spent calls `h_check`.

use std::collections::{HashMap, HashSet};
use std::mem::offset_of;

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::immediates::{Ieee32, Ieee64};
use cranelift_codegen::ir::{
    AbiParam, AtomicRmwOp, Block, InstBuilder, JumpTableData, MemFlagsData as MemFlags, Signature,
    Type, Value, types,
};
use cranelift_codegen::settings::{self, Configurable};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext, Variable};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{FuncId, Linkage, Module as _};

use super::super::exec::{
    BARRIERS, CANONICAL_NAN_F32, CANONICAL_NAN_F64, KPARAM_WINDOW, LOCAL_WINDOW, LaunchRegisters,
    SHARED_WINDOW, WINDOW_BYTES,
};
use super::super::ir::*;
use super::super::parse::Parsed;
use super::lane::{self, span_slot};
use super::{
    EXITED, FAILED, FUEL_CHECK, MAX_COMPILED_INSTRUCTIONS, MAX_COMPILED_IR, MAX_COMPILED_REGISTERS,
    RETURNED, SREG_CTAID, SREG_DYN_SHARED, SREG_LANE, SREG_NCTAID, SREG_NTID, SREG_NWARP, SREG_TID,
    SREG_WARP, Span, THREAD_EXITED, Thread, YIELDED,
};

const I64: Type = types::I64;
/// A looped kernel's resume index of a thread that has exited (past its jump table).
const DONE: u32 = u32::MAX;

/// Threads a looped kernel's loop goes on to (runs, resumes at its barrier, or skips having
/// exited) between two of the launch's checks when their fuel has not reached [`FUEL_CHECK`]
/// first: a thread that waited or exited costs a few nanoseconds and no fuel, so this bounds
/// the time between checks of a block whose threads do little each (a pass of up to 1024
/// exited threads around one that loops over the barrier), to some 10 to 40 us. A check
/// reads the clock and the launch's shared counters, so one per 64 threads, as before, took
/// 9% of NVIDIA's `scan`, whose threads run a few instructions between barriers. A power of
/// two: the loop masks its count of threads with it.
const THREADS_PER_CHECK: u32 = 4096;
const _: () = assert!(THREADS_PER_CHECK.is_power_of_two());
const I32: Type = types::I32;

/// Whether an instruction needs the other lanes of its warp or threads of its block: the
/// thread stops there and the block runtime executes it.
fn collective(op: &Op) -> bool {
    matches!(
        op,
        Op::Bar { .. }
            | Op::BarRed { .. }
            | Op::Shfl { .. }
            | Op::Vote { .. }
            | Op::Activemask { .. }
            | Op::WarpSync { .. }
    )
}

/// Whether the only collective instructions of `code` (if any) are `bar.sync` of the whole
/// block (no thread count) at one barrier, named by a constant below [`BARRIERS`]: once
/// every thread of a block still running has run until it waits there or exits, the
/// barrier is complete (the block runtime would release it then, every warp counted), so a
/// looped kernel's passes over its threads run it without the runtime.
fn block_barrier_only(code: &[Inst]) -> bool {
    let mut id = None;
    code.iter()
        .filter(|i| collective(&i.op))
        .all(|i| match i.op {
            Op::Bar {
                id: Src::Imm(b),
                count: None,
                wait: true,
            } if b < BARRIERS as u64 => *id.get_or_insert(b) == b,
            _ => false,
        })
}

/// Why the compiler does not take the kernel `f` (and every function it calls), if it does
/// not: what it has no code for yet, or what is past its size limits.
pub(super) fn refusal(m: &Parsed, f: u32) -> Option<String> {
    let mut seen = HashSet::new();
    let mut stack = vec![(f, 0usize)];
    // Depth-first over the call graph: a function met again on the current path is recursion.
    let mut path: Vec<u32> = Vec::new();
    while let Some((g, depth)) = stack.pop() {
        path.truncate(depth);
        if path.contains(&g) {
            return Some(format!("recursion through {}", m.funcs[g as usize].name));
        }
        path.push(g);
        if !seen.insert(g) {
            continue;
        }
        let func = &m.funcs[g as usize];
        if func.start == func.end {
            return Some(format!("{} has no body", func.name));
        }
        if (func.end - func.start) as usize > MAX_COMPILED_INSTRUCTIONS {
            return Some(format!(
                "{} has more than {MAX_COMPILED_INSTRUCTIONS} instructions",
                func.name
            ));
        }
        if func.regs.len() > MAX_COMPILED_REGISTERS {
            return Some(format!(
                "{} has more than {MAX_COMPILED_REGISTERS} registers",
                func.name
            ));
        }
        for inst in &m.code[func.start as usize..func.end as usize] {
            let why = match &inst.op {
                Op::Call {
                    callee: Callee::Func(c),
                    ..
                } => {
                    stack.push((*c, depth + 1));
                    None
                }
                Op::Call {
                    callee: Callee::Indirect(_),
                    ..
                } => Some("calls through a pointer"),
                Op::Call {
                    callee: Callee::Vprintf,
                    ..
                } => Some("printf"),
                Op::Call {
                    callee: Callee::AssertFail,
                    ..
                } => Some("assert"),
                Op::Call {
                    callee: Callee::Malloc | Callee::Free,
                    ..
                } => Some("the device heap"),
                Op::Match { .. } => Some("match.sync"),
                op if collective(op) && g != f => {
                    Some("a collective instruction in a called function")
                }
                _ => None,
            };
            if let Some(why) = why {
                return Some(format!("{why} (PTX line {})", inst.line));
            }
        }
    }
    None
}

/// A new code module for the host.
fn new_module() -> Result<JITModule, String> {
    let mut flags = settings::builder();
    flags.set("opt_level", "speed").map_err(|e| e.to_string())?;
    // The translation is checked by construction and by the differential tests; the
    // verifier would double the compile time.
    flags
        .set("enable_verifier", "false")
        .map_err(|e| e.to_string())?;
    flags
        .set("use_colocated_libcalls", "false")
        .map_err(|e| e.to_string())?;
    flags.set("is_pic", "false").map_err(|e| e.to_string())?;
    let isa = cranelift_native::builder()
        .map_err(|e| e.to_string())?
        .finish(settings::Flags::new(flags))
        .map_err(|e| e.to_string())?;
    Ok(JITModule::new(JITBuilder::with_isa(
        isa,
        cranelift_module::default_libcall_names(),
    )))
}

/// Compiles kernel `f` (and the functions it calls that are not compiled yet) into `jit`;
/// the address of its finalized entry, and whether it is the looped kind (`(threads, count)`:
/// a kernel without collective instructions) rather than one thread's resumable function.
pub(super) fn compile(
    jit: &mut Option<JITModule>,
    funcs: &mut HashMap<u32, FuncId>,
    m: &Parsed,
    f: u32,
    regs: &LaunchRegisters,
) -> Result<(*const u8, bool), String> {
    if let Some(why) = refusal(m, f) {
        return Err(why);
    }
    if jit.is_none() {
        *jit = Some(new_module()?);
    }
    let module = jit.as_mut().expect("made above");
    let ptr = module.target_config().pointer_type();
    let mut sig = module.make_signature();
    sig.params.push(AbiParam::new(ptr));
    sig.returns.push(AbiParam::new(I32));
    // Every function the kernel reaches, callees first.
    let mut order = Vec::new();
    let mut todo = vec![f];
    let mut seen = HashSet::new();
    while let Some(g) = todo.pop() {
        if !seen.insert(g) {
            continue;
        }
        order.push(g);
        let func = &m.funcs[g as usize];
        for inst in &m.code[func.start as usize..func.end as usize] {
            if let Op::Call {
                callee: Callee::Func(c),
                ..
            } = inst.op
            {
                todo.push(c);
            }
        }
    }
    // A kernel without collective instructions but the block's barrier runs its threads
    // to their ends (or the barrier) one after the other: its function loops over the
    // block's threads itself, `(threads, count)`.
    let kernel_func = &m.funcs[f as usize];
    let looped = block_barrier_only(&m.code[kernel_func.start as usize..kernel_func.end as usize]);
    let mut looped_sig = sig.clone();
    looped_sig.params.push(AbiParam::new(I32));
    let mut declared = Vec::new();
    let result = define(
        module,
        funcs,
        &mut declared,
        m,
        f,
        &order,
        (&sig, &looped_sig, looped),
        regs,
    );
    if result.is_err() {
        // Functions declared but not defined are forgotten, so that a later kernel calling
        // one of them translates it again instead of linking to nothing.
        for key in declared {
            funcs.remove(&key);
        }
    }
    result?;
    Ok((
        module.get_finalized_function(funcs[&(u32::MAX - f)]),
        looped,
    ))
}

/// Translates and defines the functions of `order` that `funcs` does not hold yet (the keys
/// added to `declared`), callees first, then finalizes them: refused when their Cranelift
/// instructions, all together, pass [`MAX_COMPILED_IR`] (checked before any is compiled).
#[allow(clippy::too_many_arguments)]
fn define(
    module: &mut JITModule,
    funcs: &mut HashMap<u32, FuncId>,
    declared: &mut Vec<u32>,
    m: &Parsed,
    f: u32,
    order: &[u32],
    (sig, looped_sig, looped): (&Signature, &Signature, bool),
    regs: &LaunchRegisters,
) -> Result<(), String> {
    let ptr = module.target_config().pointer_type();
    let frontend = module.target_config();
    let mut fctx = FunctionBuilderContext::new();
    let mut translated = Vec::new();
    let mut ir = 0usize;
    let too_large = || {
        format!(
            "{} translates to more than {MAX_COMPILED_IR} Cranelift instructions",
            m.funcs[f as usize].name
        )
    };
    for &g in order.iter().rev() {
        let kernel = g == f;
        // A kernel's function is its own (it has resume points); a `.func` is shared.
        let key = if kernel { u32::MAX - g } else { g };
        if funcs.contains_key(&key) {
            continue;
        }
        let name = format!("ptx{}_{g}", if kernel { "k" } else { "f" });
        let fsig = if kernel && looped { looped_sig } else { sig };
        let id = module
            .declare_function(&name, Linkage::Local, fsig)
            .map_err(|e| e.to_string())?;
        funcs.insert(key, id);
        declared.push(key);
        let mut ctx = module.make_context();
        ctx.func.signature = fsig.clone();
        {
            let mut b = FunctionBuilder::new(&mut ctx.func, &mut fctx);
            let mut callees = HashMap::new();
            for inst in
                &m.code[m.funcs[g as usize].start as usize..m.funcs[g as usize].end as usize]
            {
                if let Op::Call {
                    callee: Callee::Func(c),
                    ..
                } = inst.op
                {
                    let cid = funcs[&c];
                    callees
                        .entry(c)
                        .or_insert_with(|| module.declare_func_in_func(cid, b.func));
                }
            }
            let mut t = Translator::new(&mut b, m, g, kernel, regs, ptr, callees);
            t.looped = kernel && looped;
            t.ir_allowance = MAX_COMPILED_IR - ir;
            match t.function() {
                Err(why) if why == TOO_LARGE => return Err(too_large()),
                other => other?,
            }
            b.seal_all_blocks();
            b.finalize(frontend);
        }
        ir = ir.saturating_add(ctx.func.dfg.num_insts());
        if ir > MAX_COMPILED_IR {
            return Err(too_large());
        }
        translated.push((id, ctx));
    }
    for (id, mut ctx) in translated {
        module
            .define_function(id, &mut ctx)
            .map_err(|e| format!("code generation: {e:?}"))?;
    }
    module.finalize_definitions().map_err(|e| e.to_string())?;
    log::debug!(
        "kernel {} compiled from {ir} Cranelift instructions",
        m.funcs[f as usize].name
    );
    Ok(())
}

/// Where a load or store's bytes are, for the inline checks.
#[derive(Clone, Copy)]
enum Area {
    Global,
    Shared,
    Local,
    KParam,
    FParam,
}

impl Area {
    /// Offsets of the area's (pointer, length) in [`Thread`] (global: in [`Span`]).
    fn fields(self) -> (i32, i32) {
        let o = |x: usize| x as i32;
        match self {
            // In the thread's span cache entry.
            Area::Global => (o(offset_of!(Span, ptr)), o(offset_of!(Span, len))),
            Area::Shared => (
                o(offset_of!(Thread, shared)),
                o(offset_of!(Thread, shared_len)),
            ),
            Area::Local => (
                o(offset_of!(Thread, local)),
                o(offset_of!(Thread, local_len)),
            ),
            Area::KParam => (
                o(offset_of!(Thread, params)),
                o(offset_of!(Thread, params_len)),
            ),
            Area::FParam => (
                o(offset_of!(Thread, fparam)),
                o(offset_of!(Thread, fparam_len)),
            ),
        }
    }
}

struct Translator<'b, 'f, 'm> {
    b: &'b mut FunctionBuilder<'f>,
    m: &'m Parsed,
    func: u32,
    kernel: bool,
    regs: &'m LaunchRegisters,
    ptr: Type,
    callees: HashMap<u32, cranelift_codegen::ir::FuncRef>,
    /// The variable of each register of the function (index: register − first).
    vars: Vec<Variable>,
    /// Each variable's type (see [`register_types`]): I64 (the register's bits), or F32 or
    /// F64 for a register the function uses mostly as a float of its width, whose value then
    /// stays in a float register between its float instructions.
    var_types: Vec<Type>,
    first_reg: u32,
    fuel: Variable,
    thread: Value,
    /// The block of each instruction that starts one (branch targets, resume continuations).
    labels: HashMap<u32, Block>,
    /// Length of the straight run each label starts (what it adds to the fuel).
    lengths: HashMap<u32, i64>,
    fail: Block,
    /// The kernel's resume blocks (index 1.., in order) and the instruction each continues at.
    resumes: Vec<(Block, u32)>,
    sig_lane: Option<cranelift_codegen::ir::SigRef>,
    sig_check: Option<cranelift_codegen::ir::SigRef>,
    /// Whether the current block has ended (a jump, branch or return was emitted).
    ended: bool,
    /// The registers live before each instruction (see [`liveness`]), for a kernel's yields.
    live: Option<Vec<Vec<u64>>>,
    /// Which registers a kernel's yields store and which its instructions store as they
    /// write them (see [`saves`]); without it a yield stores every register live after it.
    saves: Option<Saves>,
    /// Whether the kernel's function loops over a block's threads (no collectives), and
    /// where a thread that ends goes on to the next.
    looped: bool,
    /// The latch, and the variable counting the threads of the pass that wait at the
    /// barrier.
    latch: Option<(Block, Variable)>,
    /// Cranelift instructions this function may have before its translation stops
    /// ([`TOO_LARGE`]): what [`MAX_COMPILED_IR`] leaves after the functions before it.
    ir_allowance: usize,
}

/// What a translation past its [`Translator::ir_allowance`] fails with.
const TOO_LARGE: &str = "too large";

fn flags() -> MemFlags {
    MemFlags::trusted()
}

/// Flags of a load of a thread field that stays as it is while its code runs.
fn constant() -> MemFlags {
    MemFlags::trusted().with_readonly().with_can_move()
}

impl<'b, 'f, 'm> Translator<'b, 'f, 'm> {
    fn new(
        b: &'b mut FunctionBuilder<'f>,
        m: &'m Parsed,
        func: u32,
        kernel: bool,
        regs: &'m LaunchRegisters,
        ptr: Type,
        callees: HashMap<u32, cranelift_codegen::ir::FuncRef>,
    ) -> Self {
        let f = &m.funcs[func as usize];
        let var_types = register_types(m, func);
        let vars = var_types.iter().map(|&t| b.declare_var(t)).collect();
        let fuel = b.declare_var(I64);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        let thread = b.block_params(entry)[0];
        let fail = b.create_block();
        Translator {
            first_reg: f.regs.start,
            b,
            m,
            func,
            kernel,
            regs,
            ptr,
            callees,
            vars,
            var_types,
            fuel,
            thread,
            labels: HashMap::new(),
            lengths: HashMap::new(),
            fail,
            resumes: Vec::new(),
            sig_lane: None,
            sig_check: None,
            ended: false,
            live: None,
            saves: None,
            looped: false,
            latch: None,
            ir_allowance: MAX_COMPILED_IR,
        }
    }

    fn f(&self) -> &'m Function {
        &self.m.funcs[self.func as usize]
    }

    /// The whole function.
    fn function(&mut self) -> Result<(), String> {
        let (start, end) = (self.f().start, self.f().end);
        // Labels: the targets of branches and the instructions after branches and after
        // collective ones.
        let mut starts: Vec<u32> = vec![start];
        for pc in start..end {
            match &self.m.code[pc as usize].op {
                Op::Bra { target } => {
                    if !(start..end).contains(target) {
                        return Err(format!(
                            "a branch out of its function (PTX line {})",
                            self.m.code[pc as usize].line
                        ));
                    }
                    // The code after a branch starts a run of its own, so each run's length
                    // is what a thread executes of it.
                    starts.extend([*target, pc + 1]);
                }
                op if collective(op) => starts.push(pc + 1),
                _ => {}
            }
        }
        starts.sort_unstable();
        starts.dedup();
        for (i, &s) in starts.iter().enumerate() {
            let next = starts.get(i + 1).copied().unwrap_or(end);
            self.lengths
                .insert(s, i64::from(next.saturating_sub(s)).max(1));
            if s < end {
                let blk = self.b.create_block();
                self.labels.insert(s, blk);
            }
        }
        if self.kernel {
            let f = self.f();
            let nregs = f.regs.len();
            self.live = liveness(self.m, start, end, f.regs.start, nregs);
            if let Some(live) = &mut self.live {
                // Past the end nothing lives.
                live.truncate((end - start) as usize + 1);
            }
            let yields = (start..end).any(|pc| collective(&self.m.code[pc as usize].op));
            if yields && let Some(live) = &self.live {
                self.saves = saves(self.m, start, end, f.regs.start, nregs, live);
            }
        }
        let zero = self.b.ins().iconst(I64, 0);
        self.b.def_var(self.fuel, zero);
        self.zero_registers();
        if self.kernel {
            // Resume points: one per collective instruction.
            for pc in start..end {
                if collective(&self.m.code[pc as usize].op) {
                    let blk = self.b.create_block();
                    self.resumes.push((blk, pc + 1));
                }
            }
        }
        if self.looped {
            self.thread_loop(start);
        } else if self.kernel {
            let resume = self.load(I32, self.thread, offset_of!(Thread, resume));
            let first = self.labels[&start];
            let mut calls = Vec::new();
            let dfg = &mut self.b.func.dfg;
            for (blk, _) in &self.resumes {
                calls.push(dfg.block_call(*blk, &[]));
            }
            let mut all = vec![dfg.block_call(first, &[])];
            all.extend(calls);
            let default = dfg.block_call(self.fail, &[]);
            let jt = self.b.create_jump_table(JumpTableData::new(default, &all));
            self.b.ins().br_table(resume, jt);
            self.resume_blocks();
        } else {
            let first = self.labels[&start];
            self.b.ins().jump(first, &[]);
        }
        self.ended = true;
        let mut resume_index = 0u32;
        for pc in start..end {
            if let Some(&blk) = self.labels.get(&pc) {
                if !self.ended {
                    self.b.ins().jump(blk, &[]);
                }
                self.b.switch_to_block(blk);
                self.ended = false;
                let n = self.lengths[&pc];
                let fuel = self.b.use_var(self.fuel);
                let fuel = self.b.ins().iadd_imm_s(fuel, n);
                self.b.def_var(self.fuel, fuel);
            } else if self.ended {
                // Unreachable code after a jump: give it a block of its own.
                let blk = self.b.create_block();
                self.b.switch_to_block(blk);
                self.ended = false;
            }
            if self.b.func.dfg.num_insts() > self.ir_allowance {
                return Err(TOO_LARGE.to_string());
            }
            let inst = &self.m.code[pc as usize];
            if collective(&inst.op) {
                resume_index += 1;
            }
            self.instruction(pc, inst, resume_index)?;
        }
        if !self.ended {
            // Falling off the end returns.
            self.ret_normal();
        }
        self.b.switch_to_block(self.fail);
        self.flush_fuel();
        let code = self.b.ins().iconst(I32, i64::from(FAILED));
        self.b.ins().return_(&[code]);
        Ok(())
    }

    /// A field of the thread that does not change while its code runs (pointers, lengths,
    /// special registers): free to be shared and hoisted.
    fn load(&mut self, ty: Type, base: Value, offset: usize) -> Value {
        self.b.ins().load(ty, constant(), base, offset as i32)
    }

    fn reg_offset(&self, r: u32) -> i32 {
        (self.regs.slots[(r - self.regs.base) as usize] as i32) * 8
    }

    fn var(&self, r: u32) -> Result<Variable, String> {
        r.checked_sub(self.first_reg)
            .and_then(|i| self.vars.get(i as usize).copied())
            .ok_or_else(|| format!("register {r} of another function"))
    }

    /// Every register zero, as a thread starts.
    fn zero_registers(&mut self) {
        for k in 0..self.vars.len() {
            let zero = match self.var_types[k] {
                types::F32 => self.b.ins().f32const(0.0),
                types::F64 => self.b.ins().f64const(0.0),
                _ => self.b.ins().iconst(I64, 0),
            };
            self.b.def_var(self.vars[k], zero);
        }
    }

    /// The type of register `r`'s variable.
    fn var_type(&self, r: u32) -> Type {
        r.checked_sub(self.first_reg)
            .and_then(|i| self.var_types.get(i as usize).copied())
            .unwrap_or(I64)
    }

    /// Register `r`'s bits (zero above its width).
    fn reg_bits(&mut self, r: u32) -> Result<Value, String> {
        let v = self.var(r)?;
        let x = self.b.use_var(v);
        Ok(match self.var_type(r) {
            types::F32 => self.f32_bits(x),
            types::F64 => self.f64_bits(x),
            _ => x,
        })
    }

    /// Register `r` set to bits `v` (zero above its width).
    fn def_bits(&mut self, r: u32, v: Value) -> Result<(), String> {
        let var = self.var(r)?;
        let x = match self.var_type(r) {
            types::F32 => self.f32_of(v),
            types::F64 => self.f64_of(v),
            _ => v,
        };
        self.b.def_var(var, x);
        Ok(())
    }

    /// Operand `s` as a float of `ty` (f32 or f64): a float register's value as it is.
    fn fval(&mut self, ty: Ty, s: Src) -> Result<Value, String> {
        let want = if ty == Ty::F32 {
            types::F32
        } else {
            types::F64
        };
        if let Src::Reg(r) = s
            && self.var_type(r) == want
        {
            let v = self.var(r)?;
            return Ok(self.b.use_var(v));
        }
        let x = self.val(s)?;
        Ok(self.float_of(ty, x))
    }

    /// Register `d` set to float `f`'s bits (f32 or f64).
    fn set_float(&mut self, d: u32, f: Value) -> Result<(), String> {
        if d == SINK {
            return Ok(());
        }
        let ty = self.b.func.dfg.value_type(f);
        if self.var_type(d) == ty {
            let var = self.var(d)?;
            self.b.def_var(var, f);
            return Ok(());
        }
        let (bits, width) = if ty == types::F32 {
            (self.f32_bits(f), 32)
        } else {
            (self.f64_bits(f), 64)
        };
        self.set_bits(d, bits, width)
    }

    /// Stores register `r` to the thread's saved registers.
    fn spill(&mut self, r: u32) -> Result<(), String> {
        let val = self.reg_bits(r)?;
        let regs = self.load(self.ptr, self.thread, offset_of!(Thread, regs));
        let off = self.reg_offset(r);
        self.b.ins().store(flags(), val, regs, off);
        Ok(())
    }

    fn reload(&mut self, r: u32) -> Result<(), String> {
        let regs = self.load(self.ptr, self.thread, offset_of!(Thread, regs));
        let off = self.reg_offset(r);
        let val = self.b.ins().load(I64, flags(), regs, off);
        self.def_bits(r, val)
    }

    /// The registers live before instruction `pc` (every register without a liveness
    /// analysis).
    fn live_at(&self, pc: u32) -> Vec<u32> {
        let f = self.f();
        match &self.live {
            Some(live) => {
                let bits = &live[(pc - f.start) as usize];
                f.regs
                    .clone()
                    .filter(|r| {
                        let i = (r - f.regs.start) as usize;
                        bits[i / 64] & (1 << (i % 64)) != 0
                    })
                    .collect()
            }
            None => f.regs.clone().collect(),
        }
    }

    /// Before a yield at `pc`: what the collective reads and what lives on after it, of
    /// which (with [`saves`]) only the registers whose saved copy may be out of date.
    fn spill_for_yield(&mut self, pc: u32, op: &Op) -> Result<(), String> {
        let mut regs = self.live_at(pc + 1);
        if let Some((reads, _)) = operands(op) {
            regs.extend(reads);
        }
        regs.sort_unstable();
        regs.dedup();
        self.keep_marked(&mut regs, pc, |s| &s.unsaved);
        for r in regs {
            self.spill(r)?;
        }
        Ok(())
    }

    /// Keeps of `regs` those of this function whose bit is set in `set(saves)` at `pc`
    /// (every one without [`Saves`]).
    fn keep_marked(&self, regs: &mut Vec<u32>, pc: u32, set: fn(&Saves) -> &Vec<Vec<u64>>) {
        if let Some(saves) = &self.saves {
            let first = self.f().regs.start;
            let bits = &set(saves)[(pc - self.f().start) as usize];
            regs.retain(|&r| {
                r.checked_sub(first)
                    .is_none_or(|i| bit_set(bits, i as usize))
            });
        }
    }

    /// At a resume point continuing at `pc`: the registers that live there (with [`saves`],
    /// those of them whose value the code on uses).
    fn reload_live(&mut self, pc: u32) {
        let mut regs = self.live_at(pc);
        self.keep_marked(&mut regs, pc, |s| &s.wanted);
        for r in regs {
            self.reload(r).expect("own register");
        }
    }

    /// Adds the fuel spent to the thread's.
    fn flush_fuel(&mut self) {
        let fuel = self.b.use_var(self.fuel);
        let off = offset_of!(Thread, fuel) as i32;
        let old = self.b.ins().load(I64, flags(), self.thread, off);
        let sum = self.b.ins().iadd(old, fuel);
        self.b.ins().store(flags(), sum, self.thread, off);
        let zero = self.b.ins().iconst(I64, 0);
        self.b.def_var(self.fuel, zero);
    }

    /// The kernel's resume blocks: each loads the registers live where it continues and
    /// goes on there.
    fn resume_blocks(&mut self) {
        for k in 0..self.resumes.len() {
            let (blk, cont) = self.resumes[k];
            self.b.switch_to_block(blk);
            self.reload_live(cont);
            if !self.looped {
                // A looped kernel's fuel runs on over its threads.
                let zero = self.b.ins().iconst(I64, 0);
                self.b.def_var(self.fuel, zero);
            }
            let target = self.labels.get(&cont).copied();
            match target {
                Some(t) => {
                    self.b.ins().jump(t, &[]);
                }
                None => self.ret_exit(),
            }
        }
    }

    /// The loop of a looped kernel over its block's threads: thread `i` of `count` at
    /// `threads + i · size_of::<Thread>()`, its registers zero, then its first instruction;
    /// a thread's end goes to the latch, which goes on with the next. With barriers (see
    /// [`block_barrier_only`]) the loop makes passes: a thread runs until it exits or waits
    /// at the barrier (its live registers stored and its resume point recorded, as a
    /// resumable kernel's yield), and a pass in which any thread waited, after which every
    /// thread still running waits there, completes the barrier and starts the next pass,
    /// each thread resuming where it stopped; an exited thread is skipped.
    fn thread_loop(&mut self, start: u32) {
        let entry = self.b.current_block().expect("in the entry block");
        let params = self.b.block_params(entry).to_vec();
        let (base, count) = (params[0], params[1]);
        let i = self.b.declare_var(I32);
        let waited = self.b.declare_var(I32);
        let visits = self.b.declare_var(I32);
        let zero32 = self.b.ins().iconst(I32, 0);
        self.b.def_var(visits, zero32);
        let (pass, head, body, done, latch) = (
            self.b.create_block(),
            self.b.create_block(),
            self.b.create_block(),
            self.b.create_block(),
            self.b.create_block(),
        );
        self.b.ins().jump(pass, &[]);
        self.b.switch_to_block(pass);
        let zero32 = self.b.ins().iconst(I32, 0);
        self.b.def_var(i, zero32);
        self.b.def_var(waited, zero32);
        self.b.ins().jump(head, &[]);
        self.b.switch_to_block(head);
        let iv = self.b.use_var(i);
        let finished = self
            .b
            .ins()
            .icmp(IntCC::UnsignedGreaterThanOrEqual, iv, count);
        self.b.ins().brif(finished, done, &[], body, &[]);
        self.b.switch_to_block(done);
        let again = self.b.use_var(waited);
        let last = self.b.create_block();
        self.b.ins().brif(again, pass, &[], last, &[]);
        self.b.switch_to_block(last);
        // The fuel not yet charged, to the block's first thread (`self.thread` is still
        // the threads' base), which the runtime charges.
        self.flush_fuel();
        let code = self.b.ins().iconst(I32, i64::from(EXITED));
        self.b.ins().return_(&[code]);
        self.b.switch_to_block(body);
        let index = self.b.ins().uextend(self.ptr, iv);
        let offset = self.b.ins().imul_imm_s(index, size_of::<Thread>() as i64);
        self.thread = self.b.ins().iadd(base, offset);
        self.zero_registers();
        self.latch = Some((latch, waited));
        let first = self.labels[&start];
        if self.resumes.is_empty() {
            self.b.ins().jump(first, &[]);
        } else {
            // Where the thread goes on: its start, a resume point, or (DONE, past the
            // table) nowhere, having exited. The field changes between passes.
            let resume =
                self.b
                    .ins()
                    .load(I32, flags(), self.thread, offset_of!(Thread, resume) as i32);
            let dfg = &mut self.b.func.dfg;
            let mut all = vec![dfg.block_call(first, &[])];
            for (blk, _) in &self.resumes {
                all.push(dfg.block_call(*blk, &[]));
            }
            let default = dfg.block_call(latch, &[]);
            let jt = self.b.create_jump_table(JumpTableData::new(default, &all));
            self.b.ins().br_table(resume, jt);
            self.resume_blocks();
        }
        // The launch's check, charged the fuel the threads since the last one spent, once
        // that fuel reaches FUEL_CHECK (as at a loop's back edge) or THREADS_PER_CHECK
        // threads (of this pass and the ones before) went by: a thread runs at most
        // FUEL_CHECK thread-instructions between checks of its own loops plus its
        // function's length, so a block stops within a few milliseconds, and one looping
        // over a barrier at its budget.
        self.b.switch_to_block(latch);
        let seen = self.b.use_var(visits);
        let seen = self.b.ins().iadd_imm_s(seen, 1);
        self.b.def_var(visits, seen);
        let low = self
            .b
            .ins()
            .band_imm_s(seen, i64::from(THREADS_PER_CHECK - 1));
        let lap = self.b.ins().icmp_imm_s(IntCC::Equal, low, 0);
        let fuel = self.b.use_var(self.fuel);
        let over = self
            .b
            .ins()
            .icmp_imm_s(IntCC::SignedGreaterThanOrEqual, fuel, FUEL_CHECK);
        let due = self.b.ins().bor(lap, over);
        let (check, next) = (self.b.create_block(), self.b.create_block());
        self.b.ins().brif(due, check, &[], next, &[]);
        self.b.switch_to_block(check);
        self.fuel_check_now();
        self.b.ins().jump(next, &[]);
        self.b.switch_to_block(next);
        let iv = self.b.use_var(i);
        let following = self.b.ins().iadd_imm_s(iv, 1);
        self.b.def_var(i, following);
        self.b.ins().jump(head, &[]);
    }

    /// Records where the thread goes on (a resume index, or [`DONE`]).
    fn set_resume(&mut self, index: u32) {
        let idx = self.b.ins().iconst(I32, i64::from(index));
        self.b
            .ins()
            .store(flags(), idx, self.thread, offset_of!(Thread, resume) as i32);
    }

    fn ret_code(&mut self, code: u32) {
        if let (Some((latch, _)), EXITED) = (self.latch, code) {
            if !self.resumes.is_empty() {
                self.set_resume(DONE);
            }
            self.b.ins().jump(latch, &[]);
            self.ended = true;
            return;
        }
        self.flush_fuel();
        let c = self.b.ins().iconst(I32, i64::from(code));
        self.b.ins().return_(&[c]);
        self.ended = true;
    }

    /// The thread exits (from a kernel or from inside a call).
    fn ret_exit(&mut self) {
        self.ret_code(if self.kernel { EXITED } else { THREAD_EXITED });
    }

    /// `ret`: a function returns, a kernel's thread exits.
    fn ret_normal(&mut self) {
        self.ret_code(if self.kernel { EXITED } else { RETURNED });
    }

    fn sig(&mut self, params: &[Type], ret: Type) -> cranelift_codegen::ir::SigRef {
        let mut s = Signature::new(self.b.func.signature.call_conv);
        for &p in params {
            s.params.push(AbiParam::new(p));
        }
        s.returns.push(AbiParam::new(ret));
        self.b.import_signature(s)
    }

    /// Calls helper `f(thread, arg) -> u32`; on a non-zero answer, fails the function.
    fn call_helper(&mut self, f: extern "C" fn(*mut Thread, u32) -> u32, arg: u32) {
        let sig = match self.sig_lane {
            Some(s) => s,
            None => {
                let s = self.sig(&[self.ptr, I32], I32);
                self.sig_lane = Some(s);
                s
            }
        };
        let callee = self.b.ins().iconst(self.ptr, f as usize as i64);
        let a = self.b.ins().iconst(I32, i64::from(arg));
        let call = self.b.ins().call_indirect(sig, callee, &[self.thread, a]);
        let rc = self.b.inst_results(call)[0];
        self.fail_unless_zero(rc);
    }

    fn fail_unless_zero(&mut self, rc: Value) {
        let ok = self.b.create_block();
        let fail = self.fail;
        self.b.ins().brif(rc, fail, &[], ok, &[]);
        self.b.switch_to_block(ok);
    }

    /// The whole instruction through `h_lane`, its registers stored before and loaded after.
    fn via_helper(&mut self, pc: u32, op: &Op) -> Result<(), String> {
        let (reads, writes) = operands(op).ok_or_else(|| format!("no operand list for {op:?}"))?;
        for r in reads {
            self.spill(r)?;
        }
        self.call_helper(lane::h_lane, pc);
        for r in writes {
            if r != SINK {
                self.reload(r)?;
            }
        }
        Ok(())
    }

    fn val(&mut self, s: Src) -> Result<Value, String> {
        Ok(match s {
            Src::Reg(r) => self.reg_bits(r)?,
            Src::Imm(v) => self.b.ins().iconst(I64, v as i64),
            Src::Special(sr) => self.special(sr),
            Src::Sym(sym, off) => {
                let base = self.sym(sym);
                self.b.ins().iadd_imm_s(base, off)
            }
        })
    }

    fn sym(&mut self, s: SymRef) -> Value {
        match s {
            SymRef::Global(i) => {
                let table = self.load(self.ptr, self.thread, offset_of!(Thread, symbols));
                self.b.ins().load(I64, flags(), table, (i * 8) as i32)
            }
            SymRef::Shared(o)
            | SymRef::Local(o)
            | SymRef::KernelParam(o)
            | SymRef::FuncParam(o) => self.b.ins().iconst(I64, i64::from(o)),
            SymRef::DynShared => self
                .b
                .ins()
                .iconst(I64, i64::from(self.m.shared_bytes.next_multiple_of(16))),
        }
    }

    fn sreg_word(&mut self, i: usize) -> Value {
        let off = offset_of!(Thread, sreg) + 4 * i;
        let w = self.load(I32, self.thread, off);
        self.b.ins().uextend(I64, w)
    }

    fn special(&mut self, s: Sreg) -> Value {
        match s {
            Sreg::Tid(d) => self.sreg_word(SREG_TID + usize::from(d)),
            Sreg::Ntid(d) => self.sreg_word(SREG_NTID + usize::from(d)),
            Sreg::Ctaid(d) => self.sreg_word(SREG_CTAID + usize::from(d)),
            Sreg::Nctaid(d) => self.sreg_word(SREG_NCTAID + usize::from(d)),
            Sreg::LaneId => self.sreg_word(SREG_LANE),
            Sreg::WarpId => self.sreg_word(SREG_WARP),
            Sreg::NWarpId => self.sreg_word(SREG_NWARP),
            Sreg::SmId | Sreg::GridId => self.b.ins().iconst(I64, 0),
            Sreg::NSmId => self.b.ins().iconst(I64, 1),
            Sreg::DynamicSmemSize => self.sreg_word(SREG_DYN_SHARED),
            Sreg::TotalSmemSize => self.load(I64, self.thread, offset_of!(Thread, shared_len)),
            Sreg::LaneMaskEq
            | Sreg::LaneMaskLt
            | Sreg::LaneMaskLe
            | Sreg::LaneMaskGt
            | Sreg::LaneMaskGe => {
                let lane = self.sreg_word(SREG_LANE);
                let one = self.b.ins().iconst(I64, 1);
                let bit = self.b.ins().ishl(one, lane);
                let below = self.b.ins().iadd_imm_s(bit, -1);
                let upto = {
                    let two = self.b.ins().ishl_imm_s(bit, 1);
                    let v = self.b.ins().iadd_imm_s(two, -1);
                    self.b.ins().band_imm_s(v, 0xffff_ffff)
                };
                match s {
                    Sreg::LaneMaskEq => bit,
                    Sreg::LaneMaskLt => below,
                    Sreg::LaneMaskLe => upto,
                    Sreg::LaneMaskGt => {
                        let n = self.b.ins().bnot(upto);
                        self.b.ins().band_imm_s(n, 0xffff_ffff)
                    }
                    _ => {
                        let n = self.b.ins().bnot(below);
                        self.b.ins().band_imm_s(n, 0xffff_ffff)
                    }
                }
            }
            Sreg::Clock | Sreg::Clock64 | Sreg::GlobalTimer | Sreg::EnvReg(_) => {
                let sig = self.sig(&[self.ptr, I32], I64);
                let f: extern "C" fn(*mut Thread, u32) -> u64 = lane::h_special;
                let callee = self.b.ins().iconst(self.ptr, f as usize as i64);
                let which = match s {
                    Sreg::GlobalTimer => 1,
                    Sreg::EnvReg(n) => 2 + i64::from(n),
                    _ => 0,
                };
                let which = self.b.ins().iconst(I32, which);
                let call = self
                    .b
                    .ins()
                    .call_indirect(sig, callee, &[self.thread, which]);
                self.b.inst_results(call)[0]
            }
        }
    }

    /// Writes `v` to register `d`, masked to its width.
    fn set(&mut self, d: u32, v: Value) -> Result<(), String> {
        self.set_bits(d, v, 64)
    }

    /// [`set`](Self::set) of a value known to have no bits above its lowest `width`: no
    /// mask where the register holds them all.
    fn set_bits(&mut self, d: u32, v: Value, width: u32) -> Result<(), String> {
        if d == SINK {
            return Ok(());
        }
        let bits = self.m.reg_bits[d as usize];
        let v = if u32::from(bits) >= width {
            v
        } else {
            self.b.ins().band_imm_s(v, ((1u64 << bits) - 1) as i64)
        };
        self.def_bits(d, v)
    }

    fn int_type(bits: u32) -> Type {
        match bits {
            8 => types::I8,
            16 => types::I16,
            32 => I32,
            _ => I64,
        }
    }

    /// `v` narrowed to `ty`'s width (an integer type of 8 to 64 bits).
    fn narrow(&mut self, v: Value, ty: Ty) -> Value {
        let t = Self::int_type(ty.bits());
        if t == I64 {
            v
        } else {
            self.b.ins().ireduce(t, v)
        }
    }

    /// A narrowed value back to 64 bits: zero-extended (the register keeps the type's bits).
    fn widen(&mut self, v: Value) -> Value {
        if self.b.func.dfg.value_type(v) == I64 {
            v
        } else {
            self.b.ins().uextend(I64, v)
        }
    }

    fn f32_of(&mut self, v: Value) -> Value {
        let w = self.b.ins().ireduce(I32, v);
        self.b.ins().bitcast(types::F32, MemFlags::new(), w)
    }

    fn f32_bits(&mut self, v: Value) -> Value {
        let w = self.b.ins().bitcast(I32, MemFlags::new(), v);
        self.b.ins().uextend(I64, w)
    }

    /// An arithmetic result (f32 or f64) with a NaN as the canonical one, as the interpreter
    /// gives it. The choice stays among float registers (a branch the host predicts), off
    /// the chain of a sum's dependencies.
    fn arithmetic(&mut self, r: Value) -> Value {
        let canonical = if self.b.func.dfg.value_type(r) == types::F32 {
            self.b
                .ins()
                .f32const(Ieee32::with_bits(CANONICAL_NAN_F32 as u32))
        } else {
            self.b.ins().f64const(Ieee64::with_bits(CANONICAL_NAN_F64))
        };
        let nan = self.b.ins().fcmp(FloatCC::Unordered, r, r);
        self.b.ins().select(nan, canonical, r)
    }

    /// A register's bits as a float of `ty` (f32 or f64).
    fn float_of(&mut self, ty: Ty, v: Value) -> Value {
        if ty == Ty::F32 {
            self.f32_of(v)
        } else {
            self.f64_of(v)
        }
    }

    fn f64_of(&mut self, v: Value) -> Value {
        self.b.ins().bitcast(types::F64, MemFlags::new(), v)
    }

    fn f64_bits(&mut self, v: Value) -> Value {
        self.b.ins().bitcast(I64, MemFlags::new(), v)
    }

    /// One instruction, its guard applied.
    fn instruction(&mut self, pc: u32, inst: &'m Inst, resume_index: u32) -> Result<(), String> {
        if let Op::Bra { target } = inst.op {
            let to = self.labels[&target];
            let backward = target <= pc;
            match inst.guard {
                Some((p, neg)) => {
                    let c = self.val(Src::Reg(p))?;
                    let next = self.b.create_block();
                    let taken = if backward { self.b.create_block() } else { to };
                    if neg {
                        self.b.ins().brif(c, next, &[], taken, &[]);
                    } else {
                        self.b.ins().brif(c, taken, &[], next, &[]);
                    }
                    if backward {
                        self.b.switch_to_block(taken);
                        self.fuel_check();
                        self.b.ins().jump(to, &[]);
                    }
                    self.b.switch_to_block(next);
                }
                None => {
                    if backward {
                        self.fuel_check();
                    }
                    self.b.ins().jump(to, &[]);
                    self.ended = true;
                }
            }
            return Ok(());
        }
        let cont = match inst.guard {
            Some((p, neg)) => {
                let c = self.val(Src::Reg(p))?;
                let run = self.b.create_block();
                let cont = self.b.create_block();
                if neg {
                    self.b.ins().brif(c, cont, &[], run, &[]);
                } else {
                    self.b.ins().brif(c, run, &[], cont, &[]);
                }
                self.b.switch_to_block(run);
                Some(cont)
            }
            None => None,
        };
        self.op(pc, &inst.op, resume_index)?;
        if !self.ended
            && let Some(saves) = &self.saves
        {
            // Registers a later yield would store, written where they are written once.
            let at_def = saves.at_def[(pc - self.f().start) as usize].clone();
            for r in at_def {
                self.spill(r)?;
            }
        }
        if let Some(cont) = cont {
            if !self.ended {
                self.b.ins().jump(cont, &[]);
            }
            self.b.switch_to_block(cont);
            self.ended = false;
        }
        Ok(())
    }

    /// At a backward branch: past [`FUEL_CHECK`] thread-instructions, the launch's checks.
    fn fuel_check(&mut self) {
        let fuel = self.b.use_var(self.fuel);
        let over = self
            .b
            .ins()
            .icmp_imm_s(IntCC::SignedGreaterThanOrEqual, fuel, FUEL_CHECK);
        let check = self.b.create_block();
        let go = self.b.create_block();
        self.b.ins().brif(over, check, &[], go, &[]);
        self.b.switch_to_block(check);
        self.fuel_check_now();
        self.b.ins().jump(go, &[]);
        self.b.switch_to_block(go);
    }

    /// Calls the launch's check with the fuel spent (added to what the thread holds), then
    /// goes on with the fuel at zero, or fails.
    fn fuel_check_now(&mut self) {
        let fuel = self.b.use_var(self.fuel);
        let sig = match self.sig_check {
            Some(s) => s,
            None => {
                let s = self.sig(&[self.ptr, I64], I32);
                self.sig_check = Some(s);
                s
            }
        };
        let f: extern "C" fn(*mut Thread, u64) -> u32 = lane::h_check;
        let callee = self.b.ins().iconst(self.ptr, f as usize as i64);
        let call = self
            .b
            .ins()
            .call_indirect(sig, callee, &[self.thread, fuel]);
        let rc = self.b.inst_results(call)[0];
        let zero = self.b.ins().iconst(I64, 0);
        self.b.def_var(self.fuel, zero);
        let fail = self.fail;
        let go = self.b.create_block();
        self.b.ins().brif(rc, fail, &[], go, &[]);
        self.b.switch_to_block(go);
    }

    fn op(&mut self, pc: u32, op: &'m Op, resume_index: u32) -> Result<(), String> {
        match op {
            Op::Mov { d, a, .. } => {
                let v = self.val(*a)?;
                self.set(*d, v)?;
            }
            Op::MovVec { ty, n, ds, srcs } => {
                let mut vals = Vec::new();
                for s in srcs.iter().take(usize::from(*n)) {
                    let v = self.val(*s)?;
                    vals.push(self.b.ins().band_imm_s(v, ty.mask() as i64));
                }
                for (d, v) in ds.iter().zip(vals) {
                    self.set(*d, v)?;
                }
            }
            Op::Pack {
                part_bits,
                d,
                parts,
            } => {
                let mut acc = self.b.ins().iconst(I64, 0);
                for (i, p) in parts.iter().enumerate() {
                    let v = self.val(*p)?;
                    let v = self.b.ins().band_imm_s(v, ((1u64 << part_bits) - 1) as i64);
                    let v = self.b.ins().ishl_imm_s(v, i64::from(i as u32 * part_bits));
                    acc = self.b.ins().bor(acc, v);
                }
                self.set(*d, acc)?;
            }
            Op::Unpack { part_bits, ds, a } => {
                let v = self.val(*a)?;
                for (i, d) in ds.iter().enumerate() {
                    let s = self.b.ins().ushr_imm_s(v, i64::from(i as u32 * part_bits));
                    let s = self.b.ins().band_imm_s(s, ((1u64 << part_bits) - 1) as i64);
                    self.set(*d, s)?;
                }
            }
            Op::Cvta { to, space, d, a } => {
                let window = match space {
                    Space::Shared => SHARED_WINDOW,
                    Space::Local => LOCAL_WINDOW,
                    _ => 0,
                } as i64;
                let v = self.val(*a)?;
                let r = self
                    .b
                    .ins()
                    .iadd_imm_s(v, if *to { window.wrapping_neg() } else { window });
                self.set(*d, r)?;
            }
            Op::IsSpace { space, p, a } => {
                let v = self.val(*a)?;
                let in_window = |t: &mut Self, w: u64| {
                    let off = t.b.ins().iadd_imm_s(v, (w as i64).wrapping_neg());
                    t.b.ins()
                        .icmp_imm_s(IntCC::UnsignedLessThan, off, WINDOW_BYTES as i64)
                };
                let r = match space {
                    Space::Shared => in_window(self, SHARED_WINDOW),
                    Space::Local => in_window(self, LOCAL_WINDOW),
                    _ => {
                        let s = in_window(self, SHARED_WINDOW);
                        let l = in_window(self, LOCAL_WINDOW);
                        let either = self.b.ins().bor(s, l);
                        self.b.ins().bxor_imm_s(either, 1)
                    }
                };
                let r = self.b.ins().uextend(I64, r);
                self.set(*p, r)?;
            }
            Op::Ld { .. } | Op::St { .. } => self.memory(pc, op)?,
            Op::Atom {
                space: Space::Global | Space::Shared,
                op: aop,
                ty,
                ..
            } if atomic_inline(*aop, *ty) => self.memory(pc, op)?,
            Op::Bin {
                op: bop,
                ty,
                d,
                a,
                b,
                ftz,
                sat,
                rnd,
            } => {
                if !self.binary(*bop, *ty, *d, *a, *b, *ftz, *sat, *rnd)? {
                    self.via_helper(pc, op)?;
                }
            }
            Op::Un {
                op: uop,
                ty,
                d,
                a,
                ftz,
                ..
            } => {
                if matches!(uop, UnOp::Neg | UnOp::Abs)
                    && (*ty == Ty::F64 || (*ty == Ty::F32 && !ftz))
                {
                    // Sign-bit operations, no NaN made canonical.
                    let f = self.fval(*ty, *a)?;
                    let r = if *uop == UnOp::Neg {
                        self.b.ins().fneg(f)
                    } else {
                        self.b.ins().fabs(f)
                    };
                    return self.set_float(*d, r);
                }
                let x = self.val(*a)?;
                let r = match (uop, ty) {
                    (UnOp::Neg, t) if !t.float() && *t != Ty::Pred => {
                        let n = self.narrow(x, *t);
                        let n = self.b.ins().ineg(n);
                        Some(self.widen(n))
                    }
                    (UnOp::Not, t) if !t.float() && *t != Ty::Pred => {
                        let n = self.narrow(x, *t);
                        let n = self.b.ins().bnot(n);
                        Some(self.widen(n))
                    }
                    _ => None,
                };
                match r {
                    Some(r) => self.set(*d, r)?,
                    None => self.via_helper(pc, op)?,
                }
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
                let r = match (mode, ty) {
                    (MadMode::Lo, t) if !sat && !t.float() && *t != Ty::Pred => {
                        let (x, y, z) = (self.val(*a)?, self.val(*b)?, self.val(*c)?);
                        let (x, y, z) =
                            (self.narrow(x, *t), self.narrow(y, *t), self.narrow(z, *t));
                        let p = self.b.ins().imul(x, y);
                        let s = self.b.ins().iadd(p, z);
                        Some(self.widen(s))
                    }
                    (MadMode::Wide, Ty::S32 | Ty::U32) if !sat => {
                        let (x, y, z) = (self.val(*a)?, self.val(*b)?, self.val(*c)?);
                        let p = self.wide_product(*ty, x, y);
                        Some(self.b.ins().iadd(p, z))
                    }
                    // f64 `fma` is `.rn` (the parser refuses the others), and ignores `.ftz`.
                    (MadMode::Float, Ty::F32 | Ty::F64)
                        if !sat && (*ty == Ty::F64 || (!ftz && *rnd == Rnd::Rn)) =>
                    {
                        let (x, y, z) = (
                            self.fval(*ty, *a)?,
                            self.fval(*ty, *b)?,
                            self.fval(*ty, *c)?,
                        );
                        let r = self.b.ins().fma(x, y, z);
                        let r = self.arithmetic(r);
                        return self.set_float(*d, r);
                    }
                    _ => None,
                };
                match r {
                    Some(r) => self.set(*d, r)?,
                    None => self.via_helper(pc, op)?,
                }
            }
            Op::Setp {
                cmp,
                ty,
                to: CmpResult::Pred,
                p,
                q,
                a,
                b,
                combine,
                ftz,
            } if !ftz && *ty != Ty::Pred && !ty.half() => {
                let t = self.compare(*cmp, *ty, *a, *b)?;
                let nt = self.b.ins().bxor_imm_s(t, 1);
                let (tp, tq) = match combine {
                    Some((bop, c, neg)) => {
                        let c = self.val(*c)?;
                        let c = self.b.ins().icmp_imm_s(IntCC::NotEqual, c, 0);
                        let c = if *neg {
                            self.b.ins().bxor_imm_s(c, 1)
                        } else {
                            c
                        };
                        let f = |tr: &mut Self, v: Value| match bop {
                            BoolOp::And => tr.b.ins().band(v, c),
                            BoolOp::Or => tr.b.ins().bor(v, c),
                            BoolOp::Xor => tr.b.ins().bxor(v, c),
                        };
                        (f(self, t), f(self, nt))
                    }
                    None => (t, nt),
                };
                let tp = self.b.ins().uextend(I64, tp);
                let tq = self.b.ins().uextend(I64, tq);
                self.set_bits(*p, tp, 1)?;
                self.set_bits(*q, tq, 1)?;
            }
            Op::Selp { d, a, b, c, .. } => {
                let (x, y, c) = (self.val(*a)?, self.val(*b)?, self.val(*c)?);
                let r = self.b.ins().select(c, x, y);
                self.set(*d, r)?;
            }
            Op::Cvt {
                dty,
                sty,
                d,
                a,
                sat: false,
                rnd: None,
                irnd: None,
                ..
            } if !dty.float() && !sty.float() && *dty != Ty::Pred && *sty != Ty::Pred => {
                let x = self.val(*a)?;
                let n = self.narrow(x, *sty);
                let wide = if self.b.func.dfg.value_type(n) == I64 {
                    n
                } else if sty.signed() {
                    self.b.ins().sextend(I64, n)
                } else {
                    self.b.ins().uextend(I64, n)
                };
                let r = self.b.ins().band_imm_s(wide, dty.mask() as i64);
                self.set(*d, r)?;
            }
            Op::Cvt {
                dty,
                sty,
                d,
                a,
                sat: false,
                rnd,
                irnd,
                ftz,
            } if let Some(r) = self.convert(*dty, *sty, *a, *rnd, *irnd, *ftz)? => {
                self.set(*d, r)?;
            }
            Op::Nop => {}
            Op::Exit => self.ret_exit(),
            Op::Ret => self.ret_normal(),
            Op::Call {
                callee: Callee::Func(f),
                args,
                ret,
            } => {
                if !args.is_empty() {
                    self.call_helper(lane::h_enter, pc);
                }
                self.flush_fuel();
                let fref = self.callees[f];
                let call = self.b.ins().call(fref, &[self.thread]);
                let rc = self.b.inst_results(call)[0];
                let exited = self.b.create_block();
                let back = self.b.create_block();
                let fail = self.fail;
                let is_fail = self.b.ins().icmp_imm_s(IntCC::Equal, rc, i64::from(FAILED));
                let not_fail = self.b.create_block();
                self.b.ins().brif(is_fail, fail, &[], not_fail, &[]);
                self.b.switch_to_block(not_fail);
                self.b.ins().brif(rc, exited, &[], back, &[]);
                self.b.switch_to_block(exited);
                self.ret_exit();
                self.b.switch_to_block(back);
                self.ended = false;
                if ret.is_some() {
                    self.call_helper(lane::h_leave, pc);
                }
            }
            op if collective(op) => {
                self.spill_for_yield(pc, op)?;
                self.set_resume(resume_index);
                if let Some((latch, waited)) = self.latch {
                    // A looped kernel's barrier: the thread waits for the pass's end.
                    let w = self.b.use_var(waited);
                    let w = self.b.ins().iadd_imm_s(w, 1);
                    self.b.def_var(waited, w);
                    self.b.ins().jump(latch, &[]);
                    self.ended = true;
                    return Ok(());
                }
                let at = self.b.ins().iconst(I32, i64::from(pc));
                self.b
                    .ins()
                    .store(flags(), at, self.thread, offset_of!(Thread, stop_pc) as i32);
                self.ret_code(YIELDED);
                // The code after a guarded collective continues in the instruction's own
                // continuation block; its resume block enters at the next label.
            }
            _ => self.via_helper(pc, op)?,
        }
        Ok(())
    }

    /// The conversions compiled code makes itself (exact ones, and those whose rounding the
    /// host's instruction makes as the ISA does); `None` for the others.
    fn convert(
        &mut self,
        dty: Ty,
        sty: Ty,
        a: Src,
        rnd: Option<Rnd>,
        irnd: Option<IRnd>,
        ftz: bool,
    ) -> Result<Option<Value>, String> {
        let int = |t: Ty| !t.float() && t != Ty::Pred && t.bits() >= 32;
        let nearest = matches!(rnd, None | Some(Rnd::Rn));
        Ok(Some(match (dty, sty) {
            // Integers to double: `as f64` of the integer, to nearest.
            (Ty::F64, s) if int(s) && nearest && irnd.is_none() => {
                let x = self.val(a)?;
                let n = self.narrow(x, s);
                let f = if s.signed() {
                    self.b.ins().fcvt_from_sint(types::F64, n)
                } else {
                    self.b.ins().fcvt_from_uint(types::F64, n)
                };
                self.f64_bits(f)
            }
            // 32-bit and signed 64-bit integers to single, to nearest: the host's conversion
            // rounds once, as `as f32` does (no integer converts to a subnormal, so `.ftz`
            // changes nothing).
            (Ty::F32, s)
                if int(s) && (s.bits() == 32 || s.signed()) && nearest && irnd.is_none() =>
            {
                let x = self.val(a)?;
                let n = self.narrow(x, s);
                let f = if s.signed() {
                    self.b.ins().fcvt_from_sint(types::F32, n)
                } else {
                    self.b.ins().fcvt_from_uint(types::F32, n)
                };
                self.f32_bits(f)
            }
            // Single to double: exact.
            (Ty::F64, Ty::F32) if !ftz && irnd.is_none() => {
                let f = self.fval(Ty::F32, a)?;
                let r = self.b.ins().fpromote(types::F64, f);
                self.f64_bits(r)
            }
            // Floats to integers toward zero: saturating, NaN to 0.
            (d, Ty::F32 | Ty::F64) if int(d) && irnd == Some(IRnd::Rzi) => {
                let f = self.fval(sty, a)?;
                let t = Self::int_type(d.bits());
                let r = if d.signed() {
                    self.b.ins().fcvt_to_sint_sat(t, f)
                } else {
                    self.b.ins().fcvt_to_uint_sat(t, f)
                };
                self.widen(r)
            }
            _ => return Ok(None),
        }))
    }

    /// Integer `div` or `rem` of `ty` (32 or 64 bits) as the interpreter defines them: by zero
    /// all ones and the dividend, the most negative by −1 wrapping; zero-extended.
    fn divide(&mut self, div: bool, ty: Ty, x: Value, y: Value) -> Value {
        let t = Self::int_type(ty.bits());
        let (x, y) = (self.narrow(x, ty), self.narrow(y, ty));
        let zero = self.b.ins().icmp_imm_s(IntCC::Equal, y, 0);
        // A divisor the hardware divides by without trapping: 1 for 0, and for a signed
        // division by −1 (whose result is the negation) too.
        let minus_one = self.b.ins().icmp_imm_s(IntCC::Equal, y, -1);
        let one = self.b.ins().iconst(t, 1);
        let unsafe_divisor = if ty.signed() {
            self.b.ins().bor(zero, minus_one)
        } else {
            zero
        };
        let safe = self.b.ins().select(unsafe_divisor, one, y);
        let q = match (div, ty.signed()) {
            (true, true) => self.b.ins().sdiv(x, safe),
            (true, false) => self.b.ins().udiv(x, safe),
            (false, true) => self.b.ins().srem(x, safe),
            (false, false) => self.b.ins().urem(x, safe),
        };
        let q = if ty.signed() {
            let by_minus_one = if div {
                self.b.ins().ineg(x)
            } else {
                self.b.ins().iconst(t, 0)
            };
            self.b.ins().select(minus_one, by_minus_one, q)
        } else {
            q
        };
        let by_zero = if div { self.b.ins().iconst(t, -1) } else { x };
        let r = self.b.ins().select(zero, by_zero, q);
        self.widen(r)
    }

    /// The 64-bit product of two 32-bit operands of `ty`'s signedness.
    fn wide_product(&mut self, ty: Ty, x: Value, y: Value) -> Value {
        let (x, y) = (self.b.ins().ireduce(I32, x), self.b.ins().ireduce(I32, y));
        let (x, y) = if ty.signed() {
            (self.b.ins().sextend(I64, x), self.b.ins().sextend(I64, y))
        } else {
            (self.b.ins().uextend(I64, x), self.b.ins().uextend(I64, y))
        };
        self.b.ins().imul(x, y)
    }

    /// A comparison as an `i8` 0 or 1.
    fn compare(&mut self, cmp: Cmp, ty: Ty, x: Src, y: Src) -> Result<Value, String> {
        if ty.float() {
            let (a, b) = (self.fval(ty, x)?, self.fval(ty, y)?);
            let cc = match cmp {
                Cmp::Eq => FloatCC::Equal,
                Cmp::Ne => FloatCC::OrderedNotEqual,
                Cmp::Lt | Cmp::Lo => FloatCC::LessThan,
                Cmp::Le | Cmp::Ls => FloatCC::LessThanOrEqual,
                Cmp::Gt | Cmp::Hi => FloatCC::GreaterThan,
                Cmp::Ge | Cmp::Hs => FloatCC::GreaterThanOrEqual,
                Cmp::Equ => FloatCC::UnorderedOrEqual,
                Cmp::Neu => FloatCC::NotEqual,
                Cmp::Ltu => FloatCC::UnorderedOrLessThan,
                Cmp::Leu => FloatCC::UnorderedOrLessThanOrEqual,
                Cmp::Gtu => FloatCC::UnorderedOrGreaterThan,
                Cmp::Geu => FloatCC::UnorderedOrGreaterThanOrEqual,
                Cmp::Num => FloatCC::Ordered,
                Cmp::Nan => FloatCC::Unordered,
            };
            return Ok(self.b.ins().fcmp(cc, a, b));
        }
        let (x, y) = (self.val(x)?, self.val(y)?);
        let (a, b) = (self.narrow(x, ty), self.narrow(y, ty));
        let s = ty.signed();
        let cc = match cmp {
            Cmp::Eq | Cmp::Equ => IntCC::Equal,
            Cmp::Ne | Cmp::Neu => IntCC::NotEqual,
            Cmp::Lt | Cmp::Ltu if s => IntCC::SignedLessThan,
            Cmp::Le | Cmp::Leu if s => IntCC::SignedLessThanOrEqual,
            Cmp::Gt | Cmp::Gtu if s => IntCC::SignedGreaterThan,
            Cmp::Ge | Cmp::Geu if s => IntCC::SignedGreaterThanOrEqual,
            Cmp::Lt | Cmp::Ltu | Cmp::Lo => IntCC::UnsignedLessThan,
            Cmp::Le | Cmp::Leu | Cmp::Ls => IntCC::UnsignedLessThanOrEqual,
            Cmp::Gt | Cmp::Gtu | Cmp::Hi => IntCC::UnsignedGreaterThan,
            Cmp::Ge | Cmp::Geu | Cmp::Hs => IntCC::UnsignedGreaterThanOrEqual,
            Cmp::Num => return Ok(self.b.ins().iconst(types::I8, 1)),
            Cmp::Nan => return Ok(self.b.ins().iconst(types::I8, 0)),
        };
        Ok(self.b.ins().icmp(cc, a, b))
    }

    /// A binary operation inline where the compiler has code for it; whether it had.
    #[allow(clippy::too_many_arguments)]
    fn binary(
        &mut self,
        op: BinOp,
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
        ftz: bool,
        sat: bool,
        rnd: Rnd,
    ) -> Result<bool, String> {
        if matches!(ty, Ty::F32 | Ty::F64) {
            // `.ftz` flushes f32 operands only; the interpreter's f64 ignores it.
            if (ftz && ty == Ty::F32)
                || sat
                || rnd != Rnd::Rn
                || !matches!(op, BinOp::Add | BinOp::Sub | BinOp::MulLo | BinOp::Div)
            {
                return Ok(false);
            }
            let (x, y) = (self.fval(ty, a)?, self.fval(ty, b)?);
            let r = match op {
                BinOp::Add => self.b.ins().fadd(x, y),
                BinOp::Sub => self.b.ins().fsub(x, y),
                BinOp::MulLo => self.b.ins().fmul(x, y),
                _ => self.b.ins().fdiv(x, y),
            };
            let r = self.arithmetic(r);
            self.set_float(d, r)?;
            return Ok(true);
        }
        if ty.float() || ty == Ty::Pred || sat {
            return Ok(false);
        }
        let bits = ty.bits();
        let (x, y) = (self.val(a)?, self.val(b)?);
        let r = match op {
            BinOp::Add
            | BinOp::Sub
            | BinOp::MulLo
            | BinOp::And
            | BinOp::Or
            | BinOp::Xor
            | BinOp::Min
            | BinOp::Max => {
                let (nx, ny) = (self.narrow(x, ty), self.narrow(y, ty));
                let r = match op {
                    BinOp::Add => self.b.ins().iadd(nx, ny),
                    BinOp::Sub => self.b.ins().isub(nx, ny),
                    BinOp::MulLo => self.b.ins().imul(nx, ny),
                    BinOp::And => self.b.ins().band(nx, ny),
                    BinOp::Or => self.b.ins().bor(nx, ny),
                    BinOp::Xor => self.b.ins().bxor(nx, ny),
                    BinOp::Min if ty.signed() => self.b.ins().smin(nx, ny),
                    BinOp::Max if ty.signed() => self.b.ins().smax(nx, ny),
                    BinOp::Min => self.b.ins().umin(nx, ny),
                    _ => self.b.ins().umax(nx, ny),
                };
                self.widen(r)
            }
            BinOp::Shl | BinOp::Shr => {
                let n = self.b.ins().band_imm_s(y, 0xffff_ffff);
                let nx = self.narrow(x, ty);
                let t = Self::int_type(bits);
                let big =
                    self.b
                        .ins()
                        .icmp_imm_s(IntCC::UnsignedGreaterThanOrEqual, n, i64::from(bits));
                let amount = if t == I64 {
                    n
                } else {
                    self.b.ins().ireduce(t, n)
                };
                let r = if op == BinOp::Shr && ty.signed() {
                    let max = self.b.ins().iconst(t, i64::from(bits - 1));
                    let amount = self.b.ins().select(big, max, amount);
                    self.b.ins().sshr(nx, amount)
                } else {
                    let shifted = if op == BinOp::Shl {
                        self.b.ins().ishl(nx, amount)
                    } else {
                        self.b.ins().ushr(nx, amount)
                    };
                    let zero = self.b.ins().iconst(t, 0);
                    self.b.ins().select(big, zero, shifted)
                };
                self.widen(r)
            }
            BinOp::MulWide if bits == 32 => self.wide_product(ty, x, y),
            BinOp::Div | BinOp::Rem if bits == 32 || bits == 64 => {
                self.divide(op == BinOp::Div, ty, x, y)
            }
            BinOp::MulHi if bits == 32 || bits == 64 => {
                let (nx, ny) = (self.narrow(x, ty), self.narrow(y, ty));
                let r = if ty.signed() {
                    self.b.ins().smulhi(nx, ny)
                } else {
                    self.b.ins().umulhi(nx, ny)
                };
                self.widen(r)
            }
            _ => return Ok(false),
        };
        // Results narrowed to the type and zero-extended; the wide product fills 64 bits.
        let width = if op == BinOp::MulWide { 64 } else { bits };
        self.set_bits(d, r, width)?;
        Ok(true)
    }

    /// A load or store: inline when its bytes lie in the area its space names (or, generic,
    /// the area its address falls in), else through the helper.
    fn memory(&mut self, pc: u32, op: &'m Op) -> Result<(), String> {
        let (space, ty, n, addr) = match op {
            Op::Ld {
                space, ty, n, addr, ..
            }
            | Op::St {
                space, ty, n, addr, ..
            } => (*space, *ty, *n, *addr),
            Op::Atom {
                space, ty, addr, ..
            } => (*space, *ty, 1, *addr),
            _ => unreachable!("memory of a load, store or atomic"),
        };
        let size = ty.bytes();
        let total = i64::from(size) * i64::from(n);
        let base = match addr.base {
            AddrBase::Reg(r) => self.val(Src::Reg(r))?,
            AddrBase::Sym(s) => self.sym(s),
            AddrBase::Abs => self.b.ins().iconst(I64, 0),
        };
        let a = self.b.ins().iadd_imm_s(base, addr.offset);
        let slow = self.b.create_block();
        let done = self.b.create_block();
        let store = matches!(op, Op::St { .. });
        match space {
            Space::Global | Space::Const => {
                self.fast(pc, op, Area::Global, a, total, slow, done)?
            }
            Space::Shared => self.fast(pc, op, Area::Shared, a, total, slow, done)?,
            Space::Local => self.fast(pc, op, Area::Local, a, total, slow, done)?,
            Space::Param => match addr.base {
                AddrBase::Sym(SymRef::KernelParam(_)) if !store => {
                    self.fast(pc, op, Area::KParam, a, total, slow, done)?
                }
                AddrBase::Sym(SymRef::KernelParam(_)) => {
                    self.b.ins().jump(slow, &[]);
                }
                // Through a register: a kernel parameter's address (its window) or one of
                // the function-parameter scratch.
                _ => {
                    let kernel_off = self
                        .b
                        .ins()
                        .iadd_imm_s(a, (KPARAM_WINDOW as i64).wrapping_neg());
                    let in_kernel = self.b.ins().icmp_imm_s(
                        IntCC::UnsignedLessThan,
                        kernel_off,
                        WINDOW_BYTES as i64,
                    );
                    let (kb, fb) = (self.b.create_block(), self.b.create_block());
                    self.b.ins().brif(in_kernel, kb, &[], fb, &[]);
                    self.b.switch_to_block(kb);
                    if store {
                        self.b.ins().jump(slow, &[]);
                    } else {
                        self.fast(pc, op, Area::KParam, kernel_off, total, slow, done)?;
                    }
                    self.b.switch_to_block(fb);
                    self.fast(pc, op, Area::FParam, a, total, slow, done)?;
                }
            },
            Space::Generic => {
                let shared_off = self
                    .b
                    .ins()
                    .iadd_imm_s(a, (SHARED_WINDOW as i64).wrapping_neg());
                let local_off = self
                    .b
                    .ins()
                    .iadd_imm_s(a, (LOCAL_WINDOW as i64).wrapping_neg());
                let in_shared = self.b.ins().icmp_imm_s(
                    IntCC::UnsignedLessThan,
                    shared_off,
                    WINDOW_BYTES as i64,
                );
                let in_local = self.b.ins().icmp_imm_s(
                    IntCC::UnsignedLessThan,
                    local_off,
                    WINDOW_BYTES as i64,
                );
                let (sb, nb, lb, gb) = (
                    self.b.create_block(),
                    self.b.create_block(),
                    self.b.create_block(),
                    self.b.create_block(),
                );
                self.b.ins().brif(in_shared, sb, &[], nb, &[]);
                self.b.switch_to_block(sb);
                self.fast(pc, op, Area::Shared, shared_off, total, slow, done)?;
                self.b.switch_to_block(nb);
                self.b.ins().brif(in_local, lb, &[], gb, &[]);
                self.b.switch_to_block(lb);
                self.fast(pc, op, Area::Local, local_off, total, slow, done)?;
                self.b.switch_to_block(gb);
                self.fast(pc, op, Area::Global, a, total, slow, done)?;
            }
        }
        self.b.switch_to_block(slow);
        self.via_helper(pc, op)?;
        self.b.ins().jump(done, &[]);
        self.b.switch_to_block(done);
        Ok(())
    }

    /// The inline access of `op` at offset (global: address) `a` of `area`, `total` bytes:
    /// checked, then done, then on to `done`; a failed check goes to `slow`.
    #[allow(clippy::too_many_arguments)]
    fn fast(
        &mut self,
        pc: u32,
        op: &'m Op,
        area: Area,
        a: Value,
        total: i64,
        slow: Block,
        done: Block,
    ) -> Result<(), String> {
        let (ptr_field, len_field) = area.fields();
        // Where the area's pointer and length are: the thread, or its span cache entry.
        let holder = match area {
            Area::Global => {
                let spans = self.load(self.ptr, self.thread, offset_of!(Thread, spans));
                let entry = (span_slot(pc) * size_of::<Span>()) as i64;
                self.b.ins().iadd_imm_s(spans, entry)
            }
            _ => self.thread,
        };
        let fixed = match area {
            Area::Global => flags(),
            _ => constant(),
        };
        let len = self.b.ins().load(I64, fixed, holder, len_field);
        let off = match area {
            Area::Global => {
                let base = self
                    .b
                    .ins()
                    .load(I64, flags(), holder, offset_of!(Span, base) as i32);
                self.b.ins().isub(a, base)
            }
            _ => a,
        };
        // One comparison for bounds and alignment (`total` is a power of two, 2^k, and
        // every area starts aligned to it): rotating the offset right by k brings a
        // misaligned offset's low bits to the top, past any limit, and an aligned offset j·2^k
        // is in bounds, j·2^k + 2^k <= len, exactly when j < len >> k.
        let k = total.trailing_zeros() as i64;
        let rotated = if k == 0 {
            off
        } else {
            self.b.ins().rotr_imm_s(off, k)
        };
        let limit = self.b.ins().ushr_imm_s(len, k);
        let ok = self.b.ins().icmp(IntCC::UnsignedLessThan, rotated, limit);
        let go = self.b.create_block();
        self.b.ins().brif(ok, go, &[], slow, &[]);
        self.b.switch_to_block(go);
        let base = self.b.ins().load(self.ptr, fixed, holder, ptr_field);
        let p = self.b.ins().iadd(base, off);
        let mf = MemFlags::trusted();
        match op {
            Op::Ld { ty, n, ds, .. } => {
                let size = ty.bytes() as i32;
                for (i, d) in ds.iter().take(usize::from(*n)).enumerate() {
                    if *d == SINK {
                        continue;
                    }
                    let at = i as i32 * size;
                    // A float register of the access's width takes the bytes as they are.
                    let vt = self.var_type(*d);
                    if vt.is_float() && vt.bytes() == size as u32 {
                        let v = self.b.ins().load(vt, mf, p, at);
                        let var = self.var(*d)?;
                        self.b.def_var(var, v);
                        continue;
                    }
                    let v = match (size, ty.signed()) {
                        (1, false) => self.b.ins().uload8(I64, mf, p, at),
                        (1, true) => self.b.ins().sload8(I64, mf, p, at),
                        (2, false) => self.b.ins().uload16(I64, mf, p, at),
                        (2, true) => self.b.ins().sload16(I64, mf, p, at),
                        (4, false) => self.b.ins().uload32(mf, p, at),
                        (4, true) => self.b.ins().sload32(mf, p, at),
                        _ => self.b.ins().load(I64, mf, p, at),
                    };
                    let width = if ty.signed() { 64 } else { 8 * size as u32 };
                    self.set_bits(*d, v, width)?;
                }
            }
            Op::St { ty, n, srcs, .. } => {
                let size = ty.bytes() as i32;
                for (i, s) in srcs.iter().take(usize::from(*n)).enumerate() {
                    let at = i as i32 * size;
                    if let Src::Reg(r) = *s
                        && self.var_type(r).is_float()
                        && self.var_type(r).bytes() == size as u32
                    {
                        let var = self.var(r)?;
                        let v = self.b.use_var(var);
                        self.b.ins().store(mf, v, p, at);
                        continue;
                    }
                    let v = self.val(*s)?;
                    match size {
                        1 => self.b.ins().istore8(mf, v, p, at),
                        2 => self.b.ins().istore16(mf, v, p, at),
                        4 => self.b.ins().istore32(mf, v, p, at),
                        _ => self.b.ins().store(mf, v, p, at),
                    };
                }
            }
            Op::Atom {
                op: aop,
                ty,
                d,
                b,
                c,
                ..
            } => {
                let t = Self::int_type(ty.bits());
                let x = self.val(*b)?;
                let x = self.narrow(x, *ty);
                let old = if *aop == AtomOp::Cas {
                    let y = self.val(*c)?;
                    let y = self.narrow(y, *ty);
                    self.b.ins().atomic_cas(mf, p, x, y)
                } else {
                    let rmw = match aop {
                        AtomOp::Add => AtomicRmwOp::Add,
                        AtomOp::And => AtomicRmwOp::And,
                        AtomOp::Or => AtomicRmwOp::Or,
                        AtomOp::Xor => AtomicRmwOp::Xor,
                        AtomOp::Exch => AtomicRmwOp::Xchg,
                        AtomOp::Min if ty.signed() => AtomicRmwOp::Smin,
                        AtomOp::Max if ty.signed() => AtomicRmwOp::Smax,
                        AtomOp::Min => AtomicRmwOp::Umin,
                        _ => AtomicRmwOp::Umax,
                    };
                    self.b.ins().atomic_rmw(t, mf, rmw, p, x)
                };
                let old = self.widen(old);
                self.set_bits(*d, old, ty.bits())?;
            }
            _ => unreachable!("fast of a load, store or atomic"),
        }
        self.b.ins().jump(done, &[]);
        Ok(())
    }
}

/// The type of each register's variable in function `func` (index: register − first): F32
/// or F64 for a register of that width that the function's float instructions (arithmetic,
/// comparisons, conversions, loads, stores and moves of f32 or f64) name at least as often
/// as its other instructions do, else I64. Either way the variable holds the register's
/// bits; the type only decides where they stay between instructions.
fn register_types(m: &Parsed, func: u32) -> Vec<Type> {
    let f = &m.funcs[func as usize];
    let n = f.regs.len();
    // (float uses, other uses) of each register.
    let mut uses = vec![(0u32, 0u32); n];
    let mut count = |r: u32, float: bool| {
        if let Some(u) = r
            .checked_sub(f.regs.start)
            .and_then(|i| uses.get_mut(i as usize))
        {
            if float {
                u.0 += 1;
            } else {
                u.1 += 1;
            }
        }
    };
    let reg = |s: &Src| match s {
        Src::Reg(r) => Some(*r),
        _ => None,
    };
    for inst in &m.code[f.start as usize..f.end as usize] {
        // The registers the instruction names as floats.
        let float: Vec<u32> = match &inst.op {
            Op::Bin { ty, d, a, b, .. } if ty.float() => {
                [Some(*d), reg(a), reg(b)].into_iter().flatten().collect()
            }
            Op::Un { ty, d, a, .. } | Op::Mov { ty, d, a } if ty.float() => {
                [Some(*d), reg(a)].into_iter().flatten().collect()
            }
            Op::Mad { ty, d, a, b, c, .. } if ty.float() => [Some(*d), reg(a), reg(b), reg(c)]
                .into_iter()
                .flatten()
                .collect(),
            Op::Setp { ty, a, b, .. } if ty.float() => {
                [reg(a), reg(b)].into_iter().flatten().collect()
            }
            Op::Cvt { dty, sty, d, a, .. } => {
                let mut v = Vec::new();
                if dty.float() {
                    v.push(*d);
                }
                if sty.float() {
                    v.extend(reg(a));
                }
                v
            }
            Op::Ld { ty, n, ds, .. } if ty.float() => {
                ds.iter().take(usize::from(*n)).copied().collect()
            }
            Op::St { ty, n, srcs, .. } if ty.float() => {
                srcs.iter().take(usize::from(*n)).filter_map(reg).collect()
            }
            _ => Vec::new(),
        };
        if let Some((reads, writes)) = operands(&inst.op) {
            for r in reads.into_iter().chain(writes) {
                count(r, float.contains(&r));
            }
        }
    }
    f.regs
        .clone()
        .zip(uses)
        .map(|(r, (float, other))| match m.reg_bits.get(r as usize) {
            Some(32) if float > 0 && float >= other => types::F32,
            Some(64) if float > 0 && float >= other => types::F64,
            _ => I64,
        })
        .collect()
}

/// Whether compiled code does atomic `op` on `ty` itself: the integer ones the host's
/// atomic instructions do as the ISA defines them (not `inc`/`dec`, not floats).
fn atomic_inline(op: AtomOp, ty: Ty) -> bool {
    !ty.float() && matches!(ty.bits(), 32 | 64) && !matches!(op, AtomOp::Inc | AtomOp::Dec)
}

/// The registers an instruction reads and writes (`SINK` among the writes is no register).
fn operands(op: &Op) -> Option<(Vec<u32>, Vec<u32>)> {
    let mut reads = Vec::new();
    let src = |s: &Src, reads: &mut Vec<u32>| {
        if let Src::Reg(r) = s {
            reads.push(*r);
        }
    };
    let addr = |a: &Addr, reads: &mut Vec<u32>| {
        if let AddrBase::Reg(r) = a.base {
            reads.push(r);
        }
    };
    let writes = match op {
        Op::Ld { ds, n, addr: a, .. } => {
            addr(a, &mut reads);
            ds[..usize::from(*n)].to_vec()
        }
        Op::St {
            srcs, n, addr: a, ..
        } => {
            addr(a, &mut reads);
            for s in &srcs[..usize::from(*n)] {
                src(s, &mut reads);
            }
            vec![]
        }
        Op::Atom {
            d, addr: a, b, c, ..
        } => {
            addr(a, &mut reads);
            src(b, &mut reads);
            src(c, &mut reads);
            vec![*d]
        }
        Op::Bin { d, a, b, .. } => {
            src(a, &mut reads);
            src(b, &mut reads);
            vec![*d]
        }
        Op::Un { d, a, .. } | Op::Cvt { d, a, .. } => {
            src(a, &mut reads);
            vec![*d]
        }
        Op::Mad { d, a, b, c, .. }
        | Op::Slct { d, a, b, c, .. }
        | Op::Bfe { d, a, b, c, .. }
        | Op::Prmt { d, a, b, c }
        | Op::Video { d, a, b, c, .. }
        | Op::Carry { d, a, b, c, .. } => {
            for s in [a, b, c] {
                src(s, &mut reads);
            }
            vec![*d]
        }
        Op::Setp {
            p,
            q,
            a,
            b,
            combine,
            ..
        } => {
            src(a, &mut reads);
            src(b, &mut reads);
            if let Some((_, c, _)) = combine {
                src(c, &mut reads);
            }
            vec![*p, *q]
        }
        Op::Bits { d, srcs, .. } => {
            for s in srcs {
                src(s, &mut reads);
            }
            vec![*d]
        }
        Op::Bfi { d, f, b, c, e, .. } => {
            for s in [f, b, c, e] {
                src(s, &mut reads);
            }
            vec![*d]
        }
        Op::Mov { d, a, .. } | Op::Cvta { d, a, .. } => {
            src(a, &mut reads);
            vec![*d]
        }
        Op::IsSpace { p, a, .. } => {
            src(a, &mut reads);
            vec![*p]
        }
        Op::Selp { d, a, b, c, .. } => {
            for s in [a, b, c] {
                src(s, &mut reads);
            }
            vec![*d]
        }
        Op::MovVec { n, ds, srcs, .. } => {
            for s in &srcs[..usize::from(*n)] {
                src(s, &mut reads);
            }
            ds[..usize::from(*n)].to_vec()
        }
        Op::Pack { d, parts, .. } => {
            for s in parts {
                src(s, &mut reads);
            }
            vec![*d]
        }
        Op::Unpack { ds, a, .. } => {
            src(a, &mut reads);
            ds.clone()
        }
        Op::Shfl {
            d,
            p,
            a,
            b,
            c,
            mask,
            ..
        } => {
            for s in [a, b, c, mask] {
                src(s, &mut reads);
            }
            vec![*d, *p]
        }
        Op::Vote { d, a, mask, .. } => {
            src(a, &mut reads);
            src(mask, &mut reads);
            vec![*d]
        }
        Op::Activemask { d } => vec![*d],
        Op::WarpSync { mask } => {
            src(mask, &mut reads);
            vec![]
        }
        Op::BarRed {
            d, id, count, p, ..
        } => {
            src(id, &mut reads);
            src(p, &mut reads);
            if let Some(c) = count {
                src(c, &mut reads);
            }
            vec![*d]
        }
        Op::Bar { id, count, .. } => {
            src(id, &mut reads);
            if let Some(c) = count {
                src(c, &mut reads);
            }
            vec![]
        }
        Op::Tex {
            lod,
            ds,
            handle,
            coords,
            ..
        } => {
            src(handle, &mut reads);
            for c in coords {
                src(c, &mut reads);
            }
            match lod {
                Lod::Implicit => {}
                Lod::Level(l) => src(l, &mut reads),
                Lod::Grad(x, y) => {
                    for s in x.iter().chain(y) {
                        src(s, &mut reads);
                    }
                }
            }
            ds.to_vec()
        }
        Op::Query(q) => {
            src(&q.handle, &mut reads);
            vec![q.d]
        }
        Op::Surf {
            store,
            n,
            vals,
            handle,
            coords,
            ..
        } => {
            src(handle, &mut reads);
            for c in coords {
                src(c, &mut reads);
            }
            let vals = &vals[..usize::from(*n)];
            if *store {
                for v in vals {
                    src(v, &mut reads);
                }
                vec![]
            } else {
                vals.iter()
                    .filter_map(|v| if let Src::Reg(r) = v { Some(*r) } else { None })
                    .collect()
            }
        }
        Op::Bra { .. } | Op::Ret | Op::Exit | Op::Nop | Op::Trap | Op::Call { .. } => vec![],
        _ => return None,
    };
    Some((reads, writes))
}

/// For each instruction of the function `start..end`, the registers (bit `r − first`) live
/// before it: read on some path before they are written. `None` where the function has an
/// instruction whose operands are not known here (then every register is treated as live).
fn liveness(m: &Parsed, start: u32, end: u32, first: u32, nregs: usize) -> Option<Vec<Vec<u64>>> {
    let words = nregs.div_ceil(64);
    let n = (end - start) as usize;
    let mut ops = Vec::with_capacity(n);
    for inst in &m.code[start as usize..end as usize] {
        let (mut reads, writes) = operands(&inst.op)?;
        if let Some((p, _)) = inst.guard {
            reads.push(p);
        }
        let bit = |r: u32| {
            r.checked_sub(first)
                .map(|i| i as usize)
                .filter(|&i| i < nregs)
        };
        let reads: Vec<usize> = reads.into_iter().filter_map(bit).collect();
        // A guarded write may not happen: it does not end a value's life.
        let writes: Vec<usize> = if inst.guard.is_some() {
            Vec::new()
        } else {
            writes
                .into_iter()
                .filter(|&w| w != SINK)
                .filter_map(bit)
                .collect()
        };
        ops.push((reads, writes));
    }
    let mut live = vec![vec![0u64; words]; n + 1];
    // Backward passes until nothing changes; each pass is linear, and values only grow, so
    // the passes are bounded by the loop nesting depth in practice and by `n · nregs` at worst.
    let mut changed = true;
    let mut passes = 0usize;
    while changed {
        changed = false;
        passes += 1;
        if passes > MAX_LIVENESS_PASSES {
            return None;
        }
        for i in (0..n).rev() {
            let inst = &m.code[start as usize + i];
            let mut out = match inst.op {
                Op::Ret | Op::Exit if inst.guard.is_none() => vec![0u64; words],
                Op::Bra { target } if inst.guard.is_none() => {
                    live[(target - start) as usize].clone()
                }
                Op::Bra { target } => {
                    let mut v = live[i + 1].clone();
                    for (a, b) in v.iter_mut().zip(&live[(target - start) as usize]) {
                        *a |= b;
                    }
                    v
                }
                _ => live[i + 1].clone(),
            };
            let (reads, writes) = &ops[i];
            for &w in writes {
                out[w / 64] &= !(1 << (w % 64));
            }
            for &r in reads {
                out[r / 64] |= 1 << (r % 64);
            }
            if out != live[i] {
                live[i] = out;
                changed = true;
            }
        }
    }
    Some(live)
}

/// Backward passes the liveness analysis makes before it gives up (every register then
/// counts as live at a yield): a bound on the compiler's time for a hostile module.
const MAX_LIVENESS_PASSES: usize = 64;

/// Whether bit `i` of the bit set `bits` is set.
fn bit_set(bits: &[u64], i: usize) -> bool {
    bits.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
}

/// What a kernel's yields store of its registers (bits `r − first`), so that a barrier in a
/// loop stores what the loop changed rather than everything live.
struct Saves {
    /// Per instruction (and past the end): the registers whose variable may differ from the
    /// thread's saved copy before it. A yield stores the registers it needs saved that are
    /// in this set; the others' saved copies already hold their values.
    unsaved: Vec<Vec<u64>>,
    /// Per instruction: the registers it writes that a yield needs saved, stored as soon as
    /// they are written because the instruction is in no loop (it runs at most once per
    /// thread, so the store costs no more than a yield's would).
    at_def: Vec<Vec<u32>>,
    /// Per instruction (and past the end): the registers whose value from before it some
    /// path on uses (reads, or stores at a yield) before writing them; a resume point loads
    /// only these of its live registers.
    wanted: Vec<Vec<u64>>,
}

/// [`Saves`] of the kernel `start..end` from its registers' liveness (`live`, as
/// [`liveness`] gives it). The saved copy of a register is out of date from the thread's
/// start (it holds another block's value) and wherever an instruction writes the register
/// without storing it; it is up to date after a store ([`Saves::at_def`]) and, for the
/// registers live at a resume point, after a yield (which stored those out of date). A
/// forward analysis: "may be out of date" joined over every path, so a register is left out
/// of a yield's stores only where every path there leaves its copy up to date. Then, from
/// those stores, a backward one of the values each resume point needs loaded
/// ([`Saves::wanted`]): a live register whose saved value nothing reads before the next
/// write or yield stays unloaded. `None` past [`MAX_LIVENESS_PASSES`] passes of either (then
/// a yield stores, and a resume point loads, every register live there).
fn saves(
    m: &Parsed,
    start: u32,
    end: u32,
    first: u32,
    nregs: usize,
    live: &[Vec<u64>],
) -> Option<Saves> {
    let words = nregs.div_ceil(64);
    let n = (end - start) as usize;
    let code = &m.code[start as usize..end as usize];
    let index = |r: u32| {
        r.checked_sub(first)
            .map(|i| i as usize)
            .filter(|&i| i < nregs)
    };
    let mut ops = Vec::with_capacity(n);
    for inst in code {
        let (reads, writes) = operands(&inst.op)?;
        let reads: Vec<usize> = reads.into_iter().filter_map(index).collect();
        let writes: Vec<usize> = writes
            .into_iter()
            .filter(|&w| w != SINK)
            .filter_map(index)
            .collect();
        ops.push((reads, writes));
    }
    // The instructions inside a loop: every instruction on a cycle lies between a backward
    // branch and its target (follow the cycle from it to the first instruction at or before
    // it: the edge there is a backward branch from at or after it).
    let mut depth = vec![0i64; n + 1];
    for (i, inst) in code.iter().enumerate() {
        if let Op::Bra { target } = inst.op
            && let Some(t) = target.checked_sub(start).map(|t| t as usize)
            && t <= i
        {
            depth[t] += 1;
            depth[i + 1] -= 1;
        }
    }
    let mut in_loop = Vec::with_capacity(n);
    let mut open = 0i64;
    for d in &depth[..n] {
        open += d;
        in_loop.push(open > 0);
    }
    // The registers some yield needs saved: live after it, or read by its collective.
    let mut needed = vec![0u64; words];
    for (i, inst) in code.iter().enumerate() {
        if collective(&inst.op) {
            for (a, b) in needed.iter_mut().zip(&live[i + 1]) {
                *a |= b;
            }
            for &r in &ops[i].0 {
                needed[r / 64] |= 1 << (r % 64);
            }
        }
    }
    let at_def: Vec<Vec<u32>> = code
        .iter()
        .enumerate()
        .map(|(i, inst)| {
            if in_loop[i] || collective(&inst.op) {
                return Vec::new();
            }
            ops[i]
                .1
                .iter()
                .filter(|&&w| bit_set(&needed, w))
                .map(|&w| first + w as u32)
                .collect()
        })
        .collect();
    let mut unsaved = vec![vec![0u64; words]; n + 1];
    unsaved[0] = vec![u64::MAX; words];
    let mut changed = true;
    let mut passes = 0usize;
    while changed {
        changed = false;
        passes += 1;
        if passes > MAX_LIVENESS_PASSES {
            return None;
        }
        for (i, inst) in code.iter().enumerate() {
            let guarded = inst.guard.is_some();
            let mut out = unsaved[i].clone();
            if collective(&inst.op) {
                // After the yield the resume point loads the registers live there; the
                // others' variables are not their saved copies. A guarded collective may
                // also go on without yielding, its registers as they were.
                let reloaded: Vec<u64> = live[i + 1].iter().map(|w| !w).collect();
                if guarded {
                    for (a, b) in out.iter_mut().zip(&reloaded) {
                        *a |= b;
                    }
                } else {
                    out = reloaded;
                }
            } else {
                let stored = &at_def[i];
                for &w in &ops[i].1 {
                    let w_reg = first + w as u32;
                    if !stored.contains(&w_reg) {
                        out[w / 64] |= 1 << (w % 64);
                    } else if !guarded {
                        out[w / 64] &= !(1 << (w % 64));
                    }
                }
            }
            let (next, target) = match inst.op {
                Op::Bra { target } => (
                    guarded,
                    target
                        .checked_sub(start)
                        .map(|t| t as usize)
                        .filter(|&t| t < n),
                ),
                Op::Ret | Op::Exit => (guarded, None),
                _ => (true, None),
            };
            for succ in [next.then_some(i + 1), target].into_iter().flatten() {
                for (a, b) in unsaved[succ].iter_mut().zip(&out) {
                    if *a | b != *a {
                        *a |= b;
                        changed = true;
                    }
                }
            }
        }
    }
    // The registers a resume point loads: those live there that some path from it reads
    // before writing them, or stores at the next yield (which ends what flows on, but for
    // a guarded collective's path that goes on without yielding).
    let mut wanted = vec![vec![0u64; words]; n + 1];
    changed = true;
    passes = 0;
    while changed {
        changed = false;
        passes += 1;
        if passes > MAX_LIVENESS_PASSES {
            return None;
        }
        for (i, inst) in code.iter().enumerate().rev() {
            let guarded = inst.guard.is_some();
            let (reads, writes) = &ops[i];
            let mut v = if collective(&inst.op) {
                let mut stores = live[i + 1].clone();
                for &r in reads {
                    stores[r / 64] |= 1 << (r % 64);
                }
                for (a, b) in stores.iter_mut().zip(&unsaved[i]) {
                    *a &= b;
                }
                if guarded {
                    for (a, b) in stores.iter_mut().zip(&wanted[i + 1]) {
                        *a |= b;
                    }
                }
                stores
            } else {
                let mut out = match inst.op {
                    Op::Ret | Op::Exit if !guarded => vec![0u64; words],
                    Op::Bra { target } => {
                        let t = target
                            .checked_sub(start)
                            .map(|t| t as usize)
                            .filter(|&t| t < n)
                            .map_or_else(|| vec![0u64; words], |t| wanted[t].clone());
                        if guarded {
                            t.iter().zip(&wanted[i + 1]).map(|(a, b)| a | b).collect()
                        } else {
                            t
                        }
                    }
                    _ => wanted[i + 1].clone(),
                };
                if !guarded {
                    for &w in writes {
                        out[w / 64] &= !(1 << (w % 64));
                    }
                }
                for &r in reads {
                    out[r / 64] |= 1 << (r % 64);
                }
                out
            };
            if let Some(p) = inst.guard.and_then(|(p, _)| index(p)) {
                v[p / 64] |= 1 << (p % 64);
            }
            if v != wanted[i] {
                wanted[i] = v;
                changed = true;
            }
        }
    }
    Some(Saves {
        unsaved,
        at_def,
        wanted,
    })
}
