//! The decoded form of a PTX module: what the parser produces and the interpreter executes.
//! Registers, labels, symbols and functions are resolved to indices here, so execution never
//! looks a name up and never meets an undefined one.

/// A PTX scalar type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ty {
    B8,
    B16,
    B32,
    B64,
    U8,
    U16,
    U32,
    U64,
    S8,
    S16,
    S32,
    S64,
    F32,
    F64,
    /// IEEE 754 binary16 in a 16-bit register.
    F16,
    /// Two binary16 values in a 32-bit register (the first in the low half).
    F16x2,
    Pred,
}

impl Ty {
    pub fn parse(s: &str) -> Option<Ty> {
        Some(match s {
            "b8" => Ty::B8,
            "b16" => Ty::B16,
            "b32" => Ty::B32,
            "b64" => Ty::B64,
            "u8" => Ty::U8,
            "u16" => Ty::U16,
            "u32" => Ty::U32,
            "u64" => Ty::U64,
            "s8" => Ty::S8,
            "s16" => Ty::S16,
            "s32" => Ty::S32,
            "s64" => Ty::S64,
            "f32" => Ty::F32,
            "f64" => Ty::F64,
            "f16" => Ty::F16,
            "f16x2" => Ty::F16x2,
            "pred" => Ty::Pred,
            _ => return None,
        })
    }

    pub fn bits(self) -> u32 {
        match self {
            Ty::B8 | Ty::U8 | Ty::S8 => 8,
            Ty::B16 | Ty::U16 | Ty::S16 | Ty::F16 => 16,
            Ty::B32 | Ty::U32 | Ty::S32 | Ty::F32 | Ty::F16x2 => 32,
            Ty::B64 | Ty::U64 | Ty::S64 | Ty::F64 => 64,
            Ty::Pred => 1,
        }
    }

    pub fn bytes(self) -> u32 {
        self.bits().div_ceil(8)
    }

    pub fn signed(self) -> bool {
        matches!(self, Ty::S8 | Ty::S16 | Ty::S32 | Ty::S64)
    }

    pub fn float(self) -> bool {
        matches!(self, Ty::F32 | Ty::F64 | Ty::F16 | Ty::F16x2)
    }

    /// Half precision, scalar or a packed pair.
    pub fn half(self) -> bool {
        matches!(self, Ty::F16 | Ty::F16x2)
    }

    /// The mask of the bits a value of this type occupies in a register.
    pub fn mask(self) -> u64 {
        match self.bits() {
            64 => u64::MAX,
            b => (1u64 << b) - 1,
        }
    }
}

/// A state space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Space {
    Generic,
    Global,
    Const,
    Shared,
    Local,
    Param,
}

/// Special registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sreg {
    Tid(u8),
    Ntid(u8),
    Ctaid(u8),
    Nctaid(u8),
    LaneId,
    WarpId,
    NWarpId,
    SmId,
    NSmId,
    GridId,
    Clock,
    Clock64,
    GlobalTimer,
    LaneMaskEq,
    LaneMaskLt,
    LaneMaskLe,
    LaneMaskGt,
    LaneMaskGe,
    DynamicSmemSize,
    TotalSmemSize,
    /// `%envreg0` to `%envreg31` (see [`Launch::envreg`](super::Launch::envreg)).
    EnvReg(u8),
}

/// A source operand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Src {
    Reg(u32),
    Imm(u64),
    Special(Sreg),
    /// The address of a variable in its own state space, plus an offset (`var + 8`).
    Sym(SymRef, i64),
}

/// A variable an address or `mov` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SymRef {
    /// A module `.global`/`.const` variable: index into `Module::globals`.
    Global(u32),
    /// Offset in the block's shared memory.
    Shared(u32),
    /// The start of the block's dynamic shared memory (`.extern .shared` arrays), after the
    /// static shared variables.
    DynShared,
    /// Offset in the thread's local memory.
    Local(u32),
    /// Offset in the kernel's parameter buffer.
    KernelParam(u32),
    /// Offset in the thread's function-parameter scratch area.
    FuncParam(u32),
}

/// Where a memory operand points.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum AddrBase {
    Reg(u32),
    Sym(SymRef),
    Abs,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Addr {
    pub base: AddrBase,
    pub offset: i64,
}

/// Up to four registers of a vector load/store; `u32::MAX` is the sink `_`.
pub(crate) type RegVec = [u32; 4];
pub(crate) const SINK: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BinOp {
    Add,
    Sub,
    MulLo,
    MulHi,
    MulWide,
    Div,
    Rem,
    And,
    Or,
    Xor,
    Shl,
    Shr,
    Min,
    Max,
    CopySign,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnOp {
    Neg,
    Abs,
    Not,
    CNot,
    Popc,
    Clz,
    Brev,
    Rcp,
    Sqrt,
    Rsqrt,
    Sin,
    Cos,
    Ex2,
    Lg2,
}

/// What a comparison writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CmpResult {
    /// `setp`: a predicate.
    Pred,
    /// `set` to `.u32`/`.s32`: all ones for true.
    Mask,
    /// `set` to `.f32`: 1.0 for true.
    One,
}

/// Mad/fma forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MadMode {
    Lo,
    Hi,
    Wide,
    Float,
    /// `mad24.lo`/`mul24.lo`: the low 32 bits of the 48-bit product of 24-bit operands.
    Lo24,
    /// `mad24.hi`/`mul24.hi`: bits 47..16 of that product.
    Hi24,
    /// `sad`: the absolute difference of the first two plus the third.
    Sad,
}

/// Floating-point rounding of an arithmetic result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rnd {
    /// `.rn` or none: to nearest, ties to even.
    Rn,
    Rz,
    Rm,
    Rp,
}

/// Integer rounding of a float (`cvt.rni` etc.).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IRnd {
    Rni,
    Rzi,
    Rmi,
    Rpi,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Lo,
    Ls,
    Hi,
    Hs,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
    Num,
    Nan,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BoolOp {
    And,
    Or,
    Xor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AtomOp {
    Add,
    Min,
    Max,
    Inc,
    Dec,
    And,
    Or,
    Xor,
    Exch,
    Cas,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShflMode {
    Up,
    Down,
    Bfly,
    Idx,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VoteMode {
    All,
    Any,
    Uni,
    Ballot,
}

/// A function a `call` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Callee {
    /// A `.func` of the module: index into `Module::funcs`.
    Func(u32),
    /// The function whose address (see [`func_address`]) the register holds.
    Indirect(u32),
    /// The CUDA runtime's device-side `vprintf(fmt, args)`.
    Vprintf,
    /// `__assertfail(message, file, line, function, char_size)`: a failed device `assert`.
    AssertFail,
    /// The device heap's `malloc(size)` and `free(ptr)`, which the driver provides.
    Malloc,
    Free,
}

/// Where function addresses live: not memory, so a load or store through one faults. A
/// function's address is `FUNC_WINDOW + index * FUNC_ADDRESS_STRIDE`.
pub(crate) const FUNC_WINDOW: u64 = 0x0000_3000_0000_0000;
pub(crate) const FUNC_ADDRESS_STRIDE: u64 = 16;

/// The address `mov` or an initializer gives function `index`.
pub(crate) fn func_address(index: u32) -> u64 {
    FUNC_WINDOW + u64::from(index) * FUNC_ADDRESS_STRIDE
}

/// The function an address names, if it names one.
pub(crate) fn func_at(addr: u64) -> Option<u32> {
    let off = addr.checked_sub(FUNC_WINDOW)?;
    if off % FUNC_ADDRESS_STRIDE != 0 {
        return None;
    }
    u32::try_from(off / FUNC_ADDRESS_STRIDE).ok()
}

/// Scalar video instructions (`vadd`, `vsub`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VideoOp {
    Add,
    Sub,
    AbsDiff,
    Min,
    Max,
}

/// Extended-precision arithmetic through the carry flag (`add.cc`, `addc`, `sub.cc`, `subc`,
/// `mad.cc`, `madc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CarryOp {
    Add,
    /// The flag is a borrow: `subc` computes `a - (b + CF)`.
    Sub,
    /// `a * b` (its low or high half) `+ c`.
    Mad {
        hi: bool,
    },
}

/// `bar.red`'s reductions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BarRedOp {
    Popc,
    And,
    Or,
}

/// `prmt`'s modes besides the general byte selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrmtMode {
    F4e,
    B4e,
    Rc8,
    Ecl,
    Ecr,
    Rc16,
}

/// Lane-local bit and integer instructions computed from up to four operands (see
/// `exec::bits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BitOp {
    /// `lop3.b32 d, a, b, c, lut`.
    Lop3,
    /// `shf.{l,r}.{clamp,wrap}.b32 d, a, b, c`: funnel shift of `b:a` by `c`.
    Shf { left: bool, clamp: bool },
    /// `bfind{.shiftamt}.ty d, a`: the most significant non-sign bit.
    Bfind { shiftamt: bool },
    /// `bmsk.{clamp,wrap}.b32 d, a, b`: `b` ones from bit `a`.
    Bmsk { clamp: bool },
    /// `prmt.b32.mode d, a, b, c`.
    Prmt(PrmtMode),
    /// `testp.class.{f32,f64} p, a`.
    Testp(FloatClass),
    /// `dp4a.atype.btype d, a, b, c` (signedness of a and b).
    Dp4a { sa: bool, sb: bool },
    /// `dp2a.{lo,hi}.atype.btype d, a, b, c`.
    Dp2a { hi: bool, sa: bool, sb: bool },
}

/// The classes `testp` tests for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FloatClass {
    Finite,
    Infinite,
    Number,
    NotANumber,
    Normal,
    Subnormal,
}

/// One decoded instruction.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Op {
    /// `match.any.sync.ty d, a, mask` (`all` false: the lanes holding this lane's value) and
    /// `match.all.sync.ty d{|p}, a, mask` (the member mask if all hold one value, else 0).
    Match {
        all: bool,
        d: u32,
        p: u32,
        a: Src,
        mask: Src,
    },
    /// See [`CarryOp`]: `carry_in` reads the lane's carry flag, `carry_out` sets it.
    Carry {
        op: CarryOp,
        carry_in: bool,
        carry_out: bool,
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
        c: Src,
    },
    /// See [`BitOp`]; `ty` the operand type.
    Bits {
        op: BitOp,
        ty: Ty,
        d: u32,
        srcs: [Src; 4],
    },
    Mov {
        ty: Ty,
        d: u32,
        a: Src,
    },
    /// `mov.b64 %rd, {%r1, %r2}`: pack parts, lowest first.
    Pack {
        part_bits: u32,
        d: u32,
        parts: Vec<Src>,
    },
    /// `mov.b64 {%r1, %r2}, %rd`: unpack.
    Unpack {
        part_bits: u32,
        ds: Vec<u32>,
        a: Src,
    },
    Ld {
        space: Space,
        ty: Ty,
        n: u8,
        ds: RegVec,
        addr: Addr,
    },
    St {
        space: Space,
        ty: Ty,
        n: u8,
        srcs: [Src; 4],
        addr: Addr,
    },
    /// `cvta.SPACE` (to generic) or `cvta.to.SPACE` (from generic).
    Cvta {
        to: bool,
        space: Space,
        d: u32,
        a: Src,
    },
    /// `isspacep`: whether a generic address falls in `space` (global, shared or local).
    IsSpace {
        space: Space,
        p: u32,
        a: Src,
    },
    Bin {
        op: BinOp,
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
        ftz: bool,
        sat: bool,
        rnd: Rnd,
    },
    Un {
        op: UnOp,
        ty: Ty,
        d: u32,
        a: Src,
        ftz: bool,
        rnd: Rnd,
    },
    Mad {
        mode: MadMode,
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
        c: Src,
        ftz: bool,
        sat: bool,
        rnd: Rnd,
    },
    /// `setp` (predicates `p` and its complement `q`) and `set` (`p` a register, `q` none).
    Setp {
        cmp: Cmp,
        ty: Ty,
        to: CmpResult,
        p: u32,
        q: u32,
        a: Src,
        b: Src,
        combine: Option<(BoolOp, Src, bool)>,
        ftz: bool,
    },
    Selp {
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
        c: Src,
    },
    /// `slct`: `a` where `c` (an s32, or an f32 flushed by `ftz`) is at least zero, else `b`.
    Slct {
        float: bool,
        ftz: bool,
        d: u32,
        a: Src,
        b: Src,
        c: Src,
    },
    Cvt {
        dty: Ty,
        sty: Ty,
        d: u32,
        a: Src,
        rnd: Option<Rnd>,
        irnd: Option<IRnd>,
        sat: bool,
        ftz: bool,
    },
    Bfe {
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
        c: Src,
    },
    Bfi {
        ty: Ty,
        d: u32,
        f: Src,
        b: Src,
        c: Src,
        e: Src,
    },
    Prmt {
        d: u32,
        a: Src,
        b: Src,
        c: Src,
    },
    Bra {
        target: u32,
    },
    Call {
        callee: Callee,
        ret: Option<(u32, u32)>,
        args: Vec<(u32, u32)>,
    },
    /// `mov.v2`/`mov.v4` between vector registers and lists.
    MovVec {
        ty: Ty,
        n: u8,
        ds: RegVec,
        srcs: [Src; 4],
    },
    /// `vop.dtype.atype.btype{.sat}{.secop} d, a, b{, c}` on whole 32-bit words.
    Video {
        op: VideoOp,
        /// Signedness of d, a and b.
        signed: [bool; 3],
        sat: bool,
        sec: Option<BinOp>,
        d: u32,
        a: Src,
        b: Src,
        c: Src,
    },
    Ret,
    Exit,
    /// `bar.sync`/`bar.arrive` (`barrier.*`) on one of the block's 16 barriers, for `count`
    /// threads (all of the block's when absent).
    Bar {
        id: Src,
        count: Option<Src>,
        wait: bool,
    },
    /// `bar.red.{popc.u32,and.pred,or.pred} d, id{, count}, {!}p`: a `bar.sync` whose
    /// arriving threads' predicates are counted, and-ed or or-ed into `d` of each of them.
    BarRed {
        op: BarRedOp,
        d: u32,
        id: Src,
        count: Option<Src>,
        p: Src,
        negate: bool,
    },
    /// Instructions with no effect in this model (memory fences, prefetch).
    Nop,
    /// `bar.warp.sync mask`: the lanes of `mask` wait for each other.
    WarpSync {
        mask: Src,
    },
    Atom {
        space: Space,
        op: AtomOp,
        ty: Ty,
        d: u32,
        addr: Addr,
        b: Src,
        c: Src,
    },
    Shfl {
        mode: ShflMode,
        d: u32,
        p: u32,
        a: Src,
        b: Src,
        c: Src,
        mask: Src,
    },
    Vote {
        mode: VoteMode,
        d: u32,
        a: Src,
        negate: bool,
        mask: Src,
    },
    Activemask {
        d: u32,
    },
    Trap,
    /// `tex{.level,.grad}.geom.v4.dtype.ctype d, [handle, {coords}]{, lod}{, dx, dy}`
    /// (unified mode) and `tld4.comp.2d` (`gather`, the channel): see `texture::sample`;
    /// `int` for `.s32` coordinates.
    Tex {
        geom: super::texture::Geom,
        int: bool,
        gather: Option<u8>,
        lod: Lod,
        ds: RegVec,
        handle: Src,
        coords: [Src; 4],
    },
    /// `suld.b.geom{.vN}.bK.oob` (`store` false, `vals` the destinations) and
    /// `sust.b.geom{.vN}.bK.oob` (`store`, `vals` the sources): `n` elements of `ty`.
    Surf {
        store: bool,
        geom: super::texture::Geom,
        ty: Ty,
        n: u8,
        oob: super::texture::Oob,
        vals: [Src; 4],
        handle: Src,
        coords: [Src; 4],
    },
    Query(ObjectQuery),
}

/// `txq.q.b32 d, [handle]` and `suq.q.b32 d, [handle]` (`surface`): see `texture::query`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ObjectQuery {
    pub surface: bool,
    pub q: super::texture::Query,
    pub d: u32,
    pub handle: Src,
}

/// Where a texture fetch's level of detail comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Lod {
    /// `tex`: none given.
    Implicit,
    /// `tex.level`: this operand.
    Level(Src),
    /// `tex.grad`: the coordinates' gradients along x and y (unused elements 0).
    Grad([Src; 3], [Src; 3]),
}

/// An instruction with its guard predicate.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Inst {
    pub guard: Option<(u32, bool)>,
    pub op: Op,
    pub line: u32,
}

/// A function or kernel: its instructions are `Module::code[start..end]`.
#[derive(Debug, Clone)]
pub(crate) struct Function {
    pub name: String,
    pub entry: bool,
    pub start: u32,
    pub end: u32,
    /// The registers its body declares (each function's are its own, numbered in a row).
    pub regs: std::ops::Range<u32>,
    /// Formal parameters: offsets in the kernel parameter buffer (kernels) or in the thread's
    /// function-parameter scratch (functions), with sizes.
    pub params: Vec<(u32, u32, u32)>,
    /// Return parameter slot of a `.func` (offset, size).
    pub ret: Option<(u32, u32)>,
}
