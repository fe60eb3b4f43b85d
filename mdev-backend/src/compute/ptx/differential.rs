//! Differential fuzzing of the two engines: random valid kernels (straight-line code, bounded
//! loops uniform and divergent, if/else, over `.u32`, `.s32`, `.u64`, `.f32`, `.f64` and
//! predicate registers: integer and float arithmetic (division, square roots and bit counts
//! among it), logic, shifts, comparisons, selects,
//! predicated instructions, conversions, global loads and stores, barriers with shared memory,
//! warp shuffles and ballots, global atomics, and at most one store that faults) run on the
//! interpreter and on compiled code over identical memories; both must give the same error, or
//! succeed with the same bytes in every buffer.
//!
//! A kernel is built from a stream of random choices, so proptest shrinks a failure to a short
//! program. Only what is deterministic on a GPU is generated: each thread loads and stores its
//! own slot of the buffer, atomics only add integers (their old values are never stored),
//! warp-wide and block-wide instructions run only where the whole block does (not under
//! divergent branches), and the faulting store has one address, so whichever thread reaches
//! it first the error is the same. After an error memory is not compared: a faulted context
//! is lost on a GPU, and how far the other threads got is the engine's schedule.

use proptest::prelude::*;

use super::tests::{agree, same_memory};
use super::*;
use crate::compute::{DeviceMemory, GlobalMemory};

/// Registers of each type a kernel computes with.
const REGS: usize = 4;
/// Threads of a block: two warps, so barriers order something.
const BLOCK: u32 = 64;
/// Blocks of the grid.
const GRID: u32 = 2;
/// Threads in all.
const THREADS: u32 = BLOCK * GRID;
/// Bytes of a thread's slot: its registers' initial and final values by type (u32, s32, u64,
/// f32, f64, predicates as u32), then scratch words.
const SLOT: u32 = 160;
/// Where a thread's scratch words start in its slot, and how many there are.
const SCRATCH: u32 = 128;
const SCRATCH_WORDS: u32 = 4;
/// Atomic counters (u32 then u64 words) the threads add to.
const COUNTERS: u32 = 4;
const COUNTER_BYTES: u32 = COUNTERS * 4 + COUNTERS * 8;
/// Statements of a kernel at most, and loop nesting at most.
const MAX_STATEMENTS: usize = 48;
const MAX_DEPTH: u32 = 2;
/// Iterations of a loop at most.
const MAX_TRIPS: u32 = 4;
/// Kernels tried per run: enough for breadth, few enough to run in seconds.
const CASES: u32 = 64;

/// The register types, their PTX names, register prefixes and slot offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ty {
    U32,
    S32,
    U64,
    F32,
    F64,
}

const TYPES: [Ty; 5] = [Ty::U32, Ty::S32, Ty::U64, Ty::F32, Ty::F64];

impl Ty {
    fn name(self) -> &'static str {
        match self {
            Ty::U32 => "u32",
            Ty::S32 => "s32",
            Ty::U64 => "u64",
            Ty::F32 => "f32",
            Ty::F64 => "f64",
        }
    }
    /// The untyped bits type of the same size (logic, shuffles).
    fn bits(self) -> &'static str {
        match self {
            Ty::U32 | Ty::S32 | Ty::F32 => "b32",
            Ty::U64 | Ty::F64 => "b64",
        }
    }
    fn prefix(self) -> &'static str {
        match self {
            Ty::U32 => "u",
            Ty::S32 => "s",
            Ty::U64 => "d",
            Ty::F32 => "f",
            Ty::F64 => "g",
        }
    }
    fn bytes(self) -> u32 {
        match self {
            Ty::U32 | Ty::S32 | Ty::F32 => 4,
            Ty::U64 | Ty::F64 => 8,
        }
    }
    /// Where the type's registers are in a thread's slot.
    fn offset(self) -> u32 {
        match self {
            Ty::U32 => 0,
            Ty::S32 => 16,
            Ty::U64 => 32,
            Ty::F32 => 64,
            Ty::F64 => 80,
        }
    }
    fn float(self) -> bool {
        matches!(self, Ty::F32 | Ty::F64)
    }
}

/// Where predicates are stored in a slot (as u32 0 or 1).
const PRED_OFFSET: u32 = 112;

/// Builds a kernel from a stream of choices (zero once the stream ends).
struct Gen<'c> {
    choices: std::slice::Iter<'c, u32>,
    out: String,
    labels: u32,
    statements: usize,
}

impl Gen<'_> {
    fn pick(&mut self, n: u32) -> u32 {
        self.choices.next().map_or(0, |c| c % n)
    }
    fn reg(&mut self, t: Ty) -> String {
        format!("%{}{}", t.prefix(), self.pick(REGS as u32))
    }
    fn pred(&mut self) -> String {
        format!("%p{}", self.pick(REGS as u32))
    }
    fn label(&mut self) -> u32 {
        self.labels += 1;
        self.labels
    }
    fn line(&mut self, s: &str) {
        self.out.push_str(s);
        self.out.push('\n');
    }

    /// Statements until the stream ends or the kernel is long enough. `uniform`: the whole
    /// block runs this code (collectives allowed).
    fn block(&mut self, depth: u32, uniform: bool) {
        let n = 1 + self.pick(6);
        for _ in 0..n {
            if self.choices.len() == 0 || self.statements >= MAX_STATEMENTS {
                return;
            }
            self.statements += 1;
            self.statement(depth, uniform);
        }
    }

    fn statement(&mut self, depth: u32, uniform: bool) {
        let guard = match self.pick(4) {
            0 => format!("@{} ", self.pred()),
            1 => format!("@!{} ", self.pred()),
            _ => String::new(),
        };
        match self.pick(16) {
            0..=4 => {
                let s = self.arith();
                self.line(&format!("{guard}{s}"));
            }
            5 => {
                let s = self.compare();
                self.line(&format!("{guard}{s}"));
            }
            6 => {
                let s = self.select();
                self.line(&format!("{guard}{s}"));
            }
            7 => {
                let s = self.convert();
                self.line(&format!("{guard}{s}"));
            }
            8 => self.memory(&guard),
            9 => self.atomic(&guard),
            10 if depth < MAX_DEPTH => self.uniform_loop(depth, uniform),
            11 if depth < MAX_DEPTH => self.divergent_loop(depth),
            12 if depth < MAX_DEPTH => self.branch(depth),
            13 if uniform => self.exchange(),
            14 if uniform => self.shuffle(),
            15 if uniform => self.ballot(),
            _ => {
                let s = self.arith();
                self.line(&s);
            }
        }
    }

    /// One arithmetic, logic or shift instruction on a random type.
    fn arith(&mut self) -> String {
        let t = TYPES[self.pick(5) as usize];
        let (d, a, b, c) = (self.reg(t), self.reg(t), self.reg(t), self.reg(t));
        let n = t.name();
        if t.float() {
            return match self.pick(11) {
                0 => format!("add.{n} {d}, {a}, {b};"),
                1 => format!("sub.{n} {d}, {a}, {b};"),
                2 => format!("mul.{n} {d}, {a}, {b};"),
                3 => format!("fma.rn.{n} {d}, {a}, {b}, {c};"),
                4 => format!("min.{n} {d}, {a}, {b};"),
                5 => format!("max.{n} {d}, {a}, {b};"),
                6 => format!("div.rn.{n} {d}, {a}, {b};"),
                7 => format!("sqrt.rn.{n} {d}, {a};"),
                8 => format!("rcp.rn.{n} {d}, {a};"),
                9 => format!("abs.{n} {d}, {a};"),
                _ => format!("neg.{n} {d}, {a};"),
            };
        }
        let amount = self.reg(Ty::U32);
        let bits = t.bits();
        let count = self.reg(Ty::U32);
        match self.pick(18) {
            0 => format!("add.{n} {d}, {a}, {b};"),
            1 => format!("sub.{n} {d}, {a}, {b};"),
            2 => format!("mul.lo.{n} {d}, {a}, {b};"),
            3 => format!("mul.hi.{n} {d}, {a}, {b};"),
            4 => format!("mad.lo.{n} {d}, {a}, {b}, {c};"),
            5 => format!("min.{n} {d}, {a}, {b};"),
            6 => format!("max.{n} {d}, {a}, {b};"),
            7 => format!("and.{bits} {d}, {a}, {b};"),
            8 => format!("or.{bits} {d}, {a}, {b};"),
            9 => format!("xor.{bits} {d}, {a}, {b};"),
            10 => format!("shl.{bits} {d}, {a}, {amount};"),
            11 => format!("shr.{n} {d}, {a}, {amount};"),
            // Division by zero gives what the executor defines (docs/PTX.md), on both engines.
            12 => format!("div.{n} {d}, {a}, {b};"),
            13 => format!("rem.{n} {d}, {a}, {b};"),
            14 => format!("popc.{bits} {count}, {a};"),
            15 => format!("clz.{bits} {count}, {a};"),
            16 => format!("brev.{bits} {d}, {a};"),
            _ if t == Ty::S32 => format!("abs.{n} {d}, {a};"),
            _ => format!("not.{bits} {d}, {a};"),
        }
    }

    fn compare(&mut self) -> String {
        let t = TYPES[self.pick(5) as usize];
        let ops: &[&str] = if t.float() {
            &[
                "eq", "ne", "lt", "le", "gt", "ge", "equ", "neu", "ltu", "geu", "num", "nan",
            ]
        } else {
            &["eq", "ne", "lt", "le", "gt", "ge"]
        };
        let op = ops[self.pick(ops.len() as u32) as usize];
        let (p, a, b) = (self.pred(), self.reg(t), self.reg(t));
        format!("setp.{op}.{} {p}, {a}, {b};", t.name())
    }

    fn select(&mut self) -> String {
        let t = TYPES[self.pick(5) as usize];
        let (d, a, b, p) = (self.reg(t), self.reg(t), self.reg(t), self.pred());
        format!("selp.{} {d}, {a}, {b}, {p};", t.name())
    }

    /// A conversion between two types, with the rounding the pair needs.
    fn convert(&mut self) -> String {
        let to = TYPES[self.pick(5) as usize];
        let from = TYPES[self.pick(5) as usize];
        let (d, a) = (self.reg(to), self.reg(from));
        let rounding = match (to.float(), from.float()) {
            (true, false) => ".rn",
            (false, true) => [".rzi", ".rni", ".rmi", ".rpi"][self.pick(4) as usize],
            (true, true) if to.bytes() < from.bytes() => ".rn",
            _ => "",
        };
        format!("cvt{rounding}.{}.{} {d}, {a};", to.name(), from.name())
    }

    /// A store to or load from the thread's scratch words.
    fn memory(&mut self, guard: &str) {
        let t = [Ty::U32, Ty::U64, Ty::F32][self.pick(3) as usize];
        let word = self.pick(SCRATCH_WORDS / 2) * 8;
        let at = SCRATCH + word;
        let r = self.reg(t);
        let n = t.name();
        if self.pick(2) == 0 {
            self.line(&format!("{guard}st.global.{n} [%slot+{at}], {r};"));
        } else {
            self.line(&format!("{guard}ld.global.{n} {r}, [%slot+{at}];"));
        }
    }

    /// An atomic add to a counter; its old value goes to a register never stored (its order
    /// among threads is the schedule's).
    fn atomic(&mut self, guard: &str) {
        let k = self.pick(COUNTERS);
        if self.pick(2) == 0 {
            let v = self.reg(Ty::U32);
            self.line(&format!(
                "{guard}atom.global.add.u32 %sink32, [%counters+{}], {v};",
                k * 4
            ));
        } else {
            let v = self.reg(Ty::U64);
            self.line(&format!(
                "{guard}atom.global.add.u64 %sink64, [%counters+{}], {v};",
                COUNTERS * 4 + k * 8
            ));
        }
    }

    /// A loop every thread runs the same number of times (a constant count).
    fn uniform_loop(&mut self, depth: u32, uniform: bool) {
        let trips = 1 + self.pick(MAX_TRIPS);
        let l = self.label();
        self.line(&format!("mov.u32 %trip{depth}, {trips};"));
        self.line(&format!("$L_loop{l}:"));
        self.block(depth + 1, uniform);
        self.line(&format!("sub.u32 %trip{depth}, %trip{depth}, 1;"));
        self.line(&format!("setp.ne.u32 %again{depth}, %trip{depth}, 0;"));
        self.line(&format!("@%again{depth} bra $L_loop{l};"));
    }

    /// A loop each thread runs 1 to [`MAX_TRIPS`] times, by its own data.
    fn divergent_loop(&mut self, depth: u32) {
        let l = self.label();
        let by = self.reg(Ty::U32);
        self.line(&format!("and.b32 %trip{depth}, {by}, {};", MAX_TRIPS - 1));
        self.line(&format!("add.u32 %trip{depth}, %trip{depth}, 1;"));
        self.line(&format!("$L_loop{l}:"));
        self.block(depth + 1, false);
        self.line(&format!("sub.u32 %trip{depth}, %trip{depth}, 1;"));
        self.line(&format!("setp.ne.u32 %again{depth}, %trip{depth}, 0;"));
        self.line(&format!("@%again{depth} bra $L_loop{l};"));
    }

    /// If/else on a data-dependent predicate.
    fn branch(&mut self, depth: u32) {
        let l = self.label();
        let p = self.pred();
        self.line(&format!("@{p} bra $L_else{l};"));
        self.block(depth + 1, false);
        self.line(&format!("bra $L_end{l};"));
        self.line(&format!("$L_else{l}:"));
        self.block(depth + 1, false);
        self.line(&format!("$L_end{l}:"));
    }

    /// A value through shared memory: each thread stores one, a barrier, each reads another
    /// thread's of the block, a barrier (so the next exchange's stores wait for these reads).
    fn exchange(&mut self) {
        let (d, a) = (self.reg(Ty::U32), self.reg(Ty::U32));
        let other = 1 + self.pick(BLOCK - 1);
        self.line(&format!("st.shared.u32 [%mine], {a};"));
        self.line("bar.sync 0;");
        self.line(&format!("xor.b32 %other, %tid, {other};"));
        self.line("mul.wide.u32 %at, %other, 4;");
        self.line("mov.u64 %base, xchg;");
        self.line("add.u64 %at, %base, %at;");
        self.line(&format!("ld.shared.u32 {d}, [%at];"));
        self.line("bar.sync 0;");
    }

    fn shuffle(&mut self) {
        let (d, a) = (self.reg(Ty::U32), self.reg(Ty::U32));
        let lanes = 1 << self.pick(5);
        self.line(&format!(
            "shfl.sync.bfly.b32 {d}, {a}, {lanes}, 0x1f, 0xffffffff;"
        ));
    }

    fn ballot(&mut self) {
        let (d, p) = (self.reg(Ty::U32), self.pred());
        self.line(&format!("vote.sync.ballot.b32 {d}, {p}, 0xffffffff;"));
    }
}

/// Where the one faulting store of a kernel writes: past the buffer, or misaligned in it.
#[derive(Debug, Clone, Copy)]
enum Wild {
    OutOfRange,
    Misaligned,
}

/// The kernel `fuzz(buf, counters)` the choices make, with the faulting store `wild` after
/// top-level statement `at` under a data-dependent predicate.
fn kernel(choices: &[u32], wild: Option<(Wild, usize)>) -> String {
    let mut g = Gen {
        choices: choices.iter(),
        out: String::new(),
        labels: 0,
        statements: 0,
    };
    let mut body = String::new();
    let mut top = 0;
    while g.choices.len() > 0 && g.statements < MAX_STATEMENTS {
        g.block(0, true);
        top += 1;
        if let Some((kind, at)) = wild
            && at == top
        {
            let p = g.pred();
            let address = match kind {
                Wild::OutOfRange => "%wild_far",
                Wild::Misaligned => "%wild_odd",
            };
            g.line(&format!("@{p} st.global.u32 [{address}], %u0;"));
        }
        body.push_str(&std::mem::take(&mut g.out));
    }
    let mut decl = String::new();
    let mut load = String::new();
    let mut store = String::new();
    for t in TYPES {
        decl += &format!(".reg .{} %{}<{REGS}>;\n", t.name(), t.prefix());
        for i in 0..REGS as u32 {
            let at = t.offset() + i * t.bytes();
            load += &format!("ld.global.{} %{}{i}, [%slot+{at}];\n", t.name(), t.prefix());
            store += &format!("st.global.{} [%slot+{at}], %{}{i};\n", t.name(), t.prefix());
        }
    }
    for i in 0..REGS as u32 {
        let at = PRED_OFFSET + i * 4;
        load += &format!("ld.global.u32 %w, [%slot+{at}];\nsetp.ne.u32 %p{i}, %w, 0;\n");
        store += &format!("selp.u32 %w, 1, 0, %p{i};\nst.global.u32 [%slot+{at}], %w;\n");
    }
    let far = u64::from(THREADS * SLOT) + 4096;
    format!(
        ".visible .entry fuzz(.param .u64 buf, .param .u64 counters)\n{{\n{decl}\
         .reg .pred %p<{REGS}>;\n.reg .pred %again<{MAX_DEPTH}>;\n.reg .u32 %trip<{MAX_DEPTH}>;\n\
         .reg .u32 %tid, %ctaid, %gid, %w, %other, %sink32;\n\
         .reg .u64 %slot, %counters, %mine, %at, %base, %sink64, %wild_far, %wild_odd;\n\
         .shared .align 4 .b32 xchg[{BLOCK}];\n\
         mov.u32 %tid, %tid.x;\nmov.u32 %ctaid, %ctaid.x;\n\
         mad.lo.u32 %gid, %ctaid, {BLOCK}, %tid;\n\
         ld.param.u64 %slot, [buf];\nld.param.u64 %counters, [counters];\n\
         add.u64 %wild_far, %slot, {far};\nadd.u64 %wild_odd, %slot, 2;\n\
         mul.wide.u32 %at, %gid, {SLOT};\nadd.u64 %slot, %slot, %at;\n\
         mul.wide.u32 %at, %tid, 4;\nmov.u64 %mine, xchg;\nadd.u64 %mine, %mine, %at;\n\
         {load}{body}{store}ret;\n}}\n"
    )
}

/// A fixed-seed generator (xorshift64*), so a case reproduces from its seed.
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    // Any state but zero, which xorshift keeps.
    let mut x = (seed ^ 0x9e37_79b9_7f4a_7c15).max(1);
    move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Initial contents of the buffer: per 32-bit word a small integer, a float of a moderate
/// exponent, an edge value or random bits, chosen by `seed`.
fn contents(seed: u64, bytes: u32) -> Vec<u8> {
    let mut next = xorshift(seed);
    (0..bytes / 4)
        .flat_map(|_| {
            let r = next();
            let w = match r % 5 {
                0 => (r >> 8) as u32 % 16,
                1 => ((r >> 8) as u32 & 0x807f_ffff) | (0x78 + (r >> 40) as u32 % 16) << 23,
                2 => [
                    0,
                    1,
                    u32::MAX,
                    0x8000_0000,
                    0x7f80_0000,
                    0x7fc0_0000,
                    31,
                    32,
                ][(r >> 8) as usize % 8],
                _ => (r >> 16) as u32,
            };
            w.to_le_bytes()
        })
        .collect()
}

/// One engine's memory with the buffer and counters; their addresses.
fn memory(init: &[u8]) -> (DeviceMemory, u64, u64) {
    let mut mem = DeviceMemory::new(1 << 20);
    let buf = mem.alloc(init.len() as u64).unwrap();
    mem.write(buf, init).unwrap();
    let counters = mem.alloc(u64::from(COUNTER_BYTES)).unwrap();
    mem.write(counters, &[0; COUNTER_BYTES as usize]).unwrap();
    (mem, buf, counters)
}

/// A generated kernel as a module.
fn parse(ptx: &str) -> Result<Module, String> {
    Module::parse(&format!(
        ".version 8.5\n.target sm_75\n.address_size 64\n{ptx}"
    ))
    .map_err(|e| format!("the generated kernel does not parse: {e}"))
}

/// What one engine's launch of `fuzz` gave: its result, its memory, and the (address, bytes)
/// of the buffer and the counters.
type Outcome = (ComputeResult<LaunchStats>, DeviceMemory, [(u64, u64); 2]);

/// Launches `fuzz` of `m` on each engine (the interpreter first) over its own memory holding
/// `init`, on `threads` host threads.
fn run_both(m: &Module, init: &[u8], threads: usize) -> [Outcome; 2] {
    let budget = MemoryBudget::new(u64::MAX);
    [Engine::Interpreter, Engine::Compiled].map(|engine| {
        let (mem, buf, counters) = memory(init);
        let params = crate::compute::backend::pack_params(
            &m.kernel("fuzz").expect("the kernel").params,
            &[buf, counters],
        );
        let l = Launch {
            grid: [GRID, 1, 1],
            block: [BLOCK, 1, 1],
            dynamic_shared_bytes: 0,
            params: &params,
            symbols: &[],
            heap: None,
            instruction_budget: 1 << 30,
            threads,
            interrupt: None,
            budget: &budget,
            engine,
            cooperative: None,
        };
        let result = launch(m, "fuzz", &l, &mem);
        let regions = [
            (buf, init.len() as u64),
            (counters, u64::from(COUNTER_BYTES)),
        ];
        (result, mem, regions)
    })
}

/// Runs the kernel on both engines; whether compiled code ran it (else the compiler refused
/// it and the interpreter did), or how the engines differ.
fn differ(ptx: &str, seed: u64, threads: usize) -> Result<bool, String> {
    let m = parse(ptx)?;
    let [(interpreted, a, regions), (compiled, b, _)] =
        run_both(&m, &contents(seed, THREADS * SLOT), threads);
    agree(&interpreted, &compiled, threads)?;
    if interpreted.is_ok() {
        for (addr, len) in regions {
            same_memory(&a, &b, addr, len)?;
        }
    }
    Ok(compiled.is_ok_and(|s| s.compiled))
}

fn wild() -> impl Strategy<Value = Option<(Wild, usize)>> {
    prop::option::of((
        prop_oneof![Just(Wild::OutOfRange), Just(Wild::Misaligned)],
        1usize..8,
    ))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

    #[test]
    fn both_engines_agree_on_random_kernels(
        choices in prop::collection::vec(any::<u32>(), 1..400),
        seed in any::<u64>(),
        threads in 1usize..=2,
        wild in wild(),
    ) {
        let ptx = kernel(&choices, wild);
        if let Err(why) = differ(&ptx, seed, threads) {
            panic!("{why}\n{ptx}");
        }
    }
}

/// A stream of `n` choices from `seed` (xorshift64*).
fn stream(seed: u64, n: usize) -> Vec<u32> {
    let mut next = xorshift(seed);
    (0..n).map(|_| (next() >> 32) as u32).collect()
}

/// The generator's kernels parse, compile, and run alike on both engines, and between them
/// use every construct it has.
#[test]
fn the_generated_kernels_are_valid_and_cover_every_construct() {
    let mut all = String::new();
    for seed in 0..32 {
        let ptx = kernel(&stream(seed, 400), None);
        match differ(&ptx, seed, 1) {
            Ok(compiled) => assert!(compiled, "the compiler refused\n{ptx}"),
            Err(why) => panic!("{why}\n{ptx}"),
        }
        all += &ptx;
    }
    for construct in [
        "add.u32",
        "sub.s32",
        "mul.lo.u64",
        "mul.hi.",
        "mad.lo.",
        "min.",
        "max.",
        "and.b64",
        "or.b32",
        "xor.",
        "shl.b64",
        "shr.s32",
        "fma.rn.f64",
        "div.rn.f32",
        "sqrt.rn.f64",
        "rcp.rn.f32",
        "rem.u64",
        "popc.b64",
        "clz.b32",
        "brev.",
        "abs.s32",
        "not.b64",
        "neg.f32",
        "setp.nan.f32",
        "selp.f64",
        "@!%p",
        "cvt.rn.f32.u64",
        "cvt.rzi.s32.f64",
        "cvt.f64.f32",
        "cvt.u64.s32",
        "st.global.f32 [%slot+1",
        "ld.global.u64 %d",
        "atom.global.add.u32",
        "atom.global.add.u64",
        "bar.sync",
        "shfl.sync.bfly",
        "vote.sync.ballot",
        "$L_else",
        "and.b32 %trip",
        "mov.u32 %trip",
    ] {
        assert!(all.contains(construct), "no {construct} in 32 kernels");
    }
}

/// The faulting store faults as meant on both engines: past the buffer an illegal address,
/// in it a misaligned one.
#[test]
fn a_wild_store_faults_alike() {
    for (wild, want) in [(Wild::OutOfRange, 700), (Wild::Misaligned, 716)] {
        // The store alone, under %p0, true in every thread (its word is 1).
        let ptx = kernel(&[0], Some((wild, 1)));
        assert!(ptx.contains("@%p0 st.global.u32 [%wild_"), "{ptx}");
        let m = parse(&ptx).unwrap();
        let [(a, ..), (b, ..)] = run_both(&m, &vec![1; (THREADS * SLOT) as usize], 1);
        agree(&a, &b, 1).unwrap();
        let e = a.unwrap_err();
        assert_eq!(e.cuda_status(), want, "{e:?}");
    }
}
