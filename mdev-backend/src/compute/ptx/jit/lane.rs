//! What compiled code calls: one thread's instruction where the compiler emits no inline
//! code (computed by the interpreter's own functions, so both engines give the same bits),
//! memory accesses that missed the inline checks, calls' parameter copies and the launch's
//! checks. Each takes the thread's state; registers are read from and written to its saved
//! registers, which the compiled code stores before and loads after the call.

use std::sync::atomic::{AtomicU64, Ordering};

use super::super::exec::{
    self, LaneState, Loc, check_align, fault, lane_local, lane_op, locate, sext,
};
use super::super::ir::*;
use super::super::texture::{self, DESCRIPTOR_BYTES, Descriptor, TextureError};
use super::{
    Env, FAILED, SPAN_SLOTS, SREG_CTAID, SREG_DYN_SHARED, SREG_LANE, SREG_NCTAID, SREG_NTID,
    SREG_NWARP, SREG_TID, SREG_WARP, Span, Thread,
};
use crate::compute::memory::{Fault, FaultKind};
use crate::compute::{ComputeError, ComputeResult, GlobalMemory};

/// A special register's value for a thread (the clocks through the launch's counters).
pub(super) fn special(t: &Thread, s: Sreg) -> u64 {
    let lane = t.sreg[SREG_LANE];
    let lane_bit = 1u64 << lane;
    let w = |i: usize| u64::from(t.sreg[i]);
    match s {
        Sreg::Tid(d) => w(SREG_TID + usize::from(d)),
        Sreg::Ntid(d) => w(SREG_NTID + usize::from(d)),
        Sreg::Ctaid(d) => w(SREG_CTAID + usize::from(d)),
        Sreg::Nctaid(d) => w(SREG_NCTAID + usize::from(d)),
        Sreg::LaneId => w(SREG_LANE),
        Sreg::WarpId => w(SREG_WARP),
        Sreg::NWarpId => w(SREG_NWARP),
        Sreg::SmId | Sreg::GridId => 0,
        Sreg::NSmId => 1,
        Sreg::Clock | Sreg::Clock64 => {
            env(t).executed.load(Ordering::Relaxed) + t.fuel / super::THREAD_INSTRUCTIONS_PER_UNIT
        }
        Sreg::GlobalTimer => env(t).started.elapsed().as_nanos() as u64,
        Sreg::LaneMaskEq => lane_bit,
        Sreg::LaneMaskLt => lane_bit - 1,
        Sreg::LaneMaskLe => (lane_bit << 1).wrapping_sub(1) & 0xffff_ffff,
        Sreg::LaneMaskGt => !((lane_bit << 1).wrapping_sub(1)) & 0xffff_ffff,
        Sreg::LaneMaskGe => !(lane_bit - 1) & 0xffff_ffff,
        Sreg::DynamicSmemSize => w(SREG_DYN_SHARED),
        Sreg::TotalSmemSize => t.shared_len,
        Sreg::EnvReg(n) => env(t).l.envreg(n),
    }
}

fn env<'e>(t: &Thread) -> &'e Env<'static> {
    // SAFETY: a thread's `env` points at its launch's `Env`, which outlives every run of the
    // launch's threads (the block runtime calls compiled code inside the launch's scope), and
    // the helpers keep the reference no longer than their call.
    unsafe { &*t.env }
}

/// One thread, for the duration of a helper call.
struct Lane<'t> {
    t: &'t mut Thread,
    env: &'t Env<'static>,
    /// The span cache entry of the instruction.
    slot: usize,
}

impl Lane<'_> {
    fn reg(&self, r: u32) -> u64 {
        // SAFETY: `regs` holds the launch's registers of this thread, and `slot` is below
        // their count for every register of the functions the kernel reaches.
        unsafe { *self.t.regs.add(self.env.slot(r)) }
    }

    fn val(&self, s: Src) -> u64 {
        match s {
            Src::Reg(r) => self.reg(r),
            Src::Imm(v) => v,
            Src::Special(sr) => special(self.t, sr),
            Src::Sym(sym, off) => self.sym(sym).wrapping_add_signed(off),
        }
    }

    fn sym(&self, s: SymRef) -> u64 {
        match s {
            SymRef::Global(i) => self.env.l.symbols[i as usize],
            SymRef::Shared(o) | SymRef::Local(o) => u64::from(o),
            SymRef::DynShared => u64::from(self.env.m.shared_bytes.next_multiple_of(16)),
            SymRef::KernelParam(o) | SymRef::FuncParam(o) => u64::from(o),
        }
    }

    fn set(&mut self, d: u32, v: u64) {
        if d == SINK {
            return;
        }
        let bits = self.env.m.reg_bits[d as usize];
        let mask = if bits >= 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        // SAFETY: as in `reg`.
        unsafe { *self.t.regs.add(self.env.slot(d)) = v & mask };
    }

    fn address(&self, a: Addr) -> u64 {
        let base = match a.base {
            AddrBase::Reg(r) => self.reg(r),
            AddrBase::Sym(s) => self.sym(s),
            AddrBase::Abs => 0,
        };
        base.wrapping_add(a.offset as u64)
    }

    /// The area a non-global location is in: (start, length, writable).
    fn area(&self, loc: Loc) -> (*mut u8, u64, u64, bool) {
        let t = &*self.t;
        match loc {
            Loc::Shared(o) => (t.shared, t.shared_len, o, true),
            Loc::Local(o) => (t.local, t.local_len, o, true),
            Loc::FParam(o) => (t.fparam, t.fparam_len, o, true),
            Loc::KParam(o) => (t.params.cast_mut(), t.params_len, o, false),
            Loc::Global(_) => (std::ptr::null_mut(), 0, 0, false),
        }
    }

    /// Remembers the allocation holding `addr` for the inline checks.
    fn cache_span(&mut self, addr: u64) {
        if let Some(span) = self.env.memory.host_span(addr) {
            // SAFETY: `spans` points at the worker's SPAN_SLOTS entries, which outlive the
            // block, and `slot` is below SPAN_SLOTS.
            let entry = unsafe { &mut *self.t.spans.add(self.slot) };
            *entry = Span {
                base: span.base,
                len: span.len,
                ptr: span.ptr,
            };
        }
    }

    fn read(&mut self, loc: Loc, buf: &mut [u8]) -> ComputeResult<()> {
        if let Loc::Global(a) = loc {
            self.env.memory.read(a, buf).map_err(fault)?;
            self.cache_span(a);
            return Ok(());
        }
        let (ptr, len, off, _) = self.area(loc);
        let n = buf.len() as u64;
        match off.checked_add(n).filter(|&e| e <= len) {
            Some(_) => {
                // SAFETY: `[off, off + n)` lies inside the area of `len` bytes at `ptr`,
                // which the block keeps alive while its threads run.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        ptr.add(off as usize),
                        buf.as_mut_ptr(),
                        buf.len(),
                    )
                };
                Ok(())
            }
            None => Err(fault(Fault {
                kind: FaultKind::OutOfRange,
                addr: off,
                size: n,
            })),
        }
    }

    fn write(&mut self, loc: Loc, data: &[u8]) -> ComputeResult<()> {
        if let Loc::Global(a) = loc {
            self.env.memory.write(a, data).map_err(fault)?;
            self.cache_span(a);
            return Ok(());
        }
        let (ptr, len, off, writable) = self.area(loc);
        if !writable {
            return Err(ComputeError::IllegalInstruction(
                "store to a kernel parameter".into(),
            ));
        }
        let n = data.len() as u64;
        match off.checked_add(n).filter(|&e| e <= len) {
            Some(_) => {
                // SAFETY: as in `read`; the area is this thread's or its block's, written by
                // the one host thread that runs the block.
                unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.add(off as usize), data.len())
                };
                Ok(())
            }
            None => Err(fault(Fault {
                kind: FaultKind::OutOfRange,
                addr: off,
                size: n,
            })),
        }
    }

    /// One instruction for this thread (its guard already true).
    fn execute(&mut self, op: &Op) -> ComputeResult<()> {
        if lane_local(op) {
            return lane_op(self, op);
        }
        match op {
            Op::Ld {
                space,
                ty,
                n,
                ds,
                addr,
            } => {
                let size = ty.bytes() as usize;
                let total = size * usize::from(*n);
                let a = self.address(*addr);
                check_align(a, total as u64)?;
                let loc = locate(*space, a, *addr);
                let mut buf = [0u8; 32];
                self.read(loc, &mut buf[..total])?;
                for (i, d) in ds.iter().take(usize::from(*n)).enumerate() {
                    let mut le = [0u8; 8];
                    le[..size].copy_from_slice(&buf[i * size..(i + 1) * size]);
                    let raw = u64::from_le_bytes(le);
                    let v = if ty.signed() {
                        sext(raw, ty.bits()) as u64
                    } else {
                        raw
                    };
                    self.set(*d, v);
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
                let a = self.address(*addr);
                check_align(a, size as u64 * u64::from(*n))?;
                let loc = locate(*space, a, *addr);
                let mut buf = [0u8; 32];
                for (i, s) in srcs.iter().take(usize::from(*n)).enumerate() {
                    let v = self.val(*s);
                    buf[i * size..(i + 1) * size].copy_from_slice(&v.to_le_bytes()[..size]);
                }
                self.write(loc, &buf[..size * usize::from(*n)])?;
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
                let a = self.address(*addr);
                let (x, y) = (self.val(*b), self.val(*c));
                let width = ty.bytes();
                let mut update = |old: u64| exec::atomic(*op, *ty, old, x, y);
                let old = match locate(*space, a, *addr) {
                    Loc::Global(g) => {
                        let old = self
                            .env
                            .memory
                            .atomic_update(g, width as u8, &mut update)
                            .map_err(fault)?;
                        self.cache_span(g);
                        old
                    }
                    loc @ Loc::Shared(_) => {
                        check_align(a, u64::from(width))?;
                        let mut buf = [0u8; 8];
                        self.read(loc, &mut buf[..width as usize])?;
                        let old = u64::from_le_bytes(buf);
                        let new = update(old);
                        self.write(loc, &new.to_le_bytes()[..width as usize])?;
                        old
                    }
                    _ => {
                        return Err(ComputeError::IllegalAddress(format!(
                            "atomic on a local address {a:#x}"
                        )));
                    }
                };
                self.set(*d, old);
            }
            Op::Trap => {
                return Err(ComputeError::IllegalInstruction("trap".into()));
            }
            op => {
                return Err(ComputeError::IllegalInstruction(format!(
                    "the compiled engine has no helper for {op:?}"
                )));
            }
        }
        Ok(())
    }

    /// A call of `.func` `f`: arguments copied by position into its parameters.
    fn enter(&mut self, f: u32, args: &[(u32, u32)]) -> ComputeResult<()> {
        let func = &self.env.m.funcs[f as usize];
        for (k, &(from, size)) in args.iter().enumerate() {
            let Some(&(to, to_size, _)) = func.params.get(k) else {
                break;
            };
            self.copy_param(from, to, size.min(to_size))?;
        }
        Ok(())
    }

    /// Copies `size` bytes of the thread's `.param` scratch from `from` to `to`.
    fn copy_param(&mut self, from: u32, to: u32, size: u32) -> ComputeResult<()> {
        let mut buf = vec![0u8; size as usize];
        self.read(Loc::FParam(u64::from(from)), &mut buf)?;
        self.write(Loc::FParam(u64::from(to)), &buf)
    }
}

/// Word `w` (from the allocation's start) of `span`; `None` past its end.
fn span_word(span: &Span, w: u64) -> Option<u64> {
    if w >= span.len.div_ceil(8) {
        return None;
    }
    // SAFETY: a span is an allocation's words, valid while the launch borrows the memory
    // (allocations are freed through `&mut` only); `w` is below their count, and they are
    // `AtomicU64`s, so aligned, which other threads also access atomically.
    let word = unsafe { &*span.ptr.add(8 * w as usize).cast::<AtomicU64>() };
    Some(word.load(Ordering::Relaxed))
}

/// Bytes of the largest texel read at once (two texels of 4 channels of 4 bytes).
const SPAN_READ_BYTES: usize = 32;

/// Copies `buf.len()` (at most [`SPAN_READ_BYTES`]) bytes at device address `addr` out of
/// `span` when they all lie inside it, as [`GlobalMemory::read`] would (whole words loaded
/// atomically); `false`, nothing read, when they do not.
fn read_span(span: &Span, addr: u64, buf: &mut [u8]) -> bool {
    let n = buf.len();
    let Some(off) = addr.checked_sub(span.base).filter(|off| {
        n <= SPAN_READ_BYTES && off.checked_add(n as u64).is_some_and(|e| e <= span.len)
    }) else {
        return false;
    };
    let shift = (off % 8) as usize;
    let mut bytes = [0u8; SPAN_READ_BYTES + 8];
    for (w, out) in bytes
        .chunks_exact_mut(8)
        .take((shift + n).div_ceil(8))
        .enumerate()
    {
        let Some(word) = span_word(span, off / 8 + w as u64) else {
            return false;
        };
        out.copy_from_slice(&word.to_le_bytes());
    }
    buf.copy_from_slice(&bytes[shift..shift + n]);
    true
}

/// Most texture and surface objects a host thread keeps decoded during a launch: a kernel
/// uses a few; one that picks among more has them decoded again as they come back.
const KNOWN_OBJECTS: usize = 8;

/// Words a descriptor's bytes lie in (11 where it does not start at a word).
const DESCRIPTOR_WORDS: usize = DESCRIPTOR_BYTES / 8 + 1;

/// The texture and surface descriptors a host thread decoded during a launch, each with the
/// words of memory it was decoded from and the allocation that holds them. A fetch compares
/// its handle's words there with those and uses the decoded descriptor while they are the
/// same (a kernel, or a copy between launches, may rewrite a descriptor: words that differ
/// are decoded and validated anew), so it sees what [`Descriptor::load`] would give.
#[derive(Default)]
pub(in crate::compute::ptx) struct KnownObjects {
    known: [Option<Known>; KNOWN_OBJECTS],
    /// The entry the next object not known replaces.
    next: usize,
}

struct Known {
    handle: u64,
    surface: bool,
    /// The allocation holding the descriptor.
    span: Span,
    /// The words holding the descriptor's bytes, from the allocation's word `first`.
    first: u64,
    count: usize,
    words: [u64; DESCRIPTOR_WORDS],
    /// The descriptor those words hold.
    d: Descriptor,
}

impl Known {
    /// The descriptor's words as they are now; `None` if they are not all in the span.
    fn words_now(span: &Span, first: u64, count: usize) -> Option<[u64; DESCRIPTOR_WORDS]> {
        let mut words = [0u64; DESCRIPTOR_WORDS];
        for (i, w) in words.iter_mut().take(count).enumerate() {
            *w = span_word(span, first + i as u64)?;
        }
        Some(words)
    }
}

/// The descriptor (validated) of the handle's bytes among `words`, the words they lie in.
fn decode_words(
    handle: u64,
    surface: bool,
    words: &[u64; DESCRIPTOR_WORDS],
) -> Result<Descriptor, TextureError> {
    let mut all = [0u8; 8 * DESCRIPTOR_WORDS];
    for (out, w) in all.chunks_exact_mut(8).zip(words) {
        out.copy_from_slice(&w.to_le_bytes());
    }
    let shift = (handle % 8) as usize;
    let bytes: &[u8; DESCRIPTOR_BYTES] = all[shift..shift + DESCRIPTOR_BYTES]
        .try_into()
        .expect("a descriptor's bytes");
    Descriptor::decode(handle, surface, bytes)
}

impl KnownObjects {
    /// The validated descriptor of the object at `handle`: [`Descriptor::load`]'s.
    fn descriptor(
        &mut self,
        memory: &dyn GlobalMemory,
        handle: u64,
        surface: bool,
    ) -> Result<Descriptor, TextureError> {
        if let Some(k) = self
            .known
            .iter_mut()
            .flatten()
            .find(|k| k.handle == handle && k.surface == surface)
        {
            let mut same = true;
            for (i, w) in k.words.iter().take(k.count).enumerate() {
                same &= span_word(&k.span, k.first + i as u64) == Some(*w);
            }
            if same {
                return Ok(k.d);
            }
            if let Some(words) = Known::words_now(&k.span, k.first, k.count) {
                k.d = decode_words(handle, surface, &words)?;
                k.words = words;
                return Ok(k.d);
            }
        }
        let at = memory.host_span(handle).and_then(|h| {
            let span = Span {
                base: h.base,
                len: h.len,
                ptr: h.ptr,
            };
            let off = handle
                .checked_sub(span.base)
                .filter(|off| off + DESCRIPTOR_BYTES as u64 <= span.len)?;
            let count = (off % 8 + DESCRIPTOR_BYTES as u64).div_ceil(8) as usize;
            let words = Known::words_now(&span, off / 8, count)?;
            Some((span, off / 8, count, words))
        });
        let Some((span, first, count, words)) = at else {
            // Not inside one allocation: the reference's read, and its fault.
            return Descriptor::load(memory, handle, surface);
        };
        let d = decode_words(handle, surface, &words)?;
        self.known[self.next] = Some(Known {
            handle,
            surface,
            span,
            first,
            count,
            words,
            d,
        });
        self.next = (self.next + 1) % KNOWN_OBJECTS;
        Ok(d)
    }
}

/// Texture and surface instructions of compiled code: descriptors through the host thread's
/// [`KnownObjects`], texels out of the instruction's span cache entry where they lie in it
/// (else through the context's memory, the entry then caching their allocation).
impl texture::Objects for Lane<'_> {
    fn memory(&self) -> &dyn GlobalMemory {
        self.env.memory
    }

    fn descriptor(&mut self, handle: u64, surface: bool) -> Result<Descriptor, TextureError> {
        // SAFETY: `objects` points at the worker's objects, which outlive the block and which
        // only the host thread running the block (this call) touches.
        let objects = unsafe { &mut *self.t.objects };
        objects.descriptor(self.env.memory, handle, surface)
    }

    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), Fault> {
        // SAFETY: as in `cache_span`.
        let span = unsafe { *self.t.spans.add(self.slot) };
        if read_span(&span, addr, buf) {
            return Ok(());
        }
        self.env.memory.read(addr, buf)?;
        self.cache_span(addr);
        Ok(())
    }
}

/// The span cache entry of the memory instruction at `pc`.
pub(super) fn span_slot(pc: u32) -> usize {
    pc as usize % SPAN_SLOTS
}

impl LaneState for Lane<'_> {
    fn val(&self, s: Src) -> u64 {
        Lane::val(self, s)
    }
    fn set(&mut self, d: u32, v: u64) {
        Lane::set(self, d, v);
    }
    fn carry(&self) -> bool {
        self.t.carry != 0
    }
    fn set_carry(&mut self, c: bool) {
        self.t.carry = u32::from(c);
    }
}

/// Runs `f` on the thread; a failure is recorded in the launch (with the instruction's PTX
/// line for a memory fault) and answered with [`FAILED`].
fn guarded(
    t: *mut Thread,
    pc: u32,
    f: impl FnOnce(&mut Lane<'_>, &Inst) -> ComputeResult<()>,
) -> u32 {
    // SAFETY: compiled code passes the thread it runs, which the block runtime owns and
    // does not touch during the call.
    let t = unsafe { &mut *t };
    let env = env(t);
    let inst = &env.m.code[pc as usize];
    let mut lane = Lane {
        t,
        env,
        slot: span_slot(pc),
    };
    match f(&mut lane, inst) {
        Ok(()) => 0,
        Err(e) => {
            env.fail(match e {
                ComputeError::IllegalAddress(m) => {
                    ComputeError::IllegalAddress(format!("{m} (PTX line {})", inst.line))
                }
                ComputeError::MisalignedAddress(m) => {
                    ComputeError::MisalignedAddress(format!("{m} (PTX line {})", inst.line))
                }
                ComputeError::IllegalInstruction(m) if m == "trap" => {
                    ComputeError::IllegalInstruction(format!("trap at PTX line {}", inst.line))
                }
                e => e,
            });
            FAILED
        }
    }
}

/// The instruction at `pc` for one thread, through the interpreter's functions.
pub(super) extern "C" fn h_lane(t: *mut Thread, pc: u32) -> u32 {
    guarded(t, pc, |lane, inst| lane.execute(&inst.op))
}

/// Before a call at `pc`: the arguments into the callee's parameters.
pub(super) extern "C" fn h_enter(t: *mut Thread, pc: u32) -> u32 {
    guarded(t, pc, |lane, inst| match &inst.op {
        Op::Call {
            callee: Callee::Func(f),
            args,
            ..
        } => lane.enter(*f, args),
        _ => Ok(()),
    })
}

/// After a call at `pc` returned: its return value into the caller's slot.
pub(super) extern "C" fn h_leave(t: *mut Thread, pc: u32) -> u32 {
    guarded(t, pc, |lane, inst| match &inst.op {
        Op::Call {
            callee: Callee::Func(f),
            ret: Some((to, size)),
            ..
        } => match lane.env.m.funcs[*f as usize].ret {
            Some((from, fsize)) => lane.copy_param(from, *to, (*size).min(fsize)),
            None => Ok(()),
        },
        _ => Ok(()),
    })
}

/// Charges `fuel` thread-instructions; 0 when the launch may go on, else [`FAILED`] (the
/// reason recorded).
pub(super) extern "C" fn h_check(t: *mut Thread, fuel: u64) -> u32 {
    // SAFETY: as in `guarded`.
    let t = unsafe { &mut *t };
    let fuel = fuel.saturating_add(std::mem::take(&mut t.fuel));
    let env = env(t);
    match env.charge(fuel) {
        Ok(()) => 0,
        Err(e) => {
            env.fail(e);
            FAILED
        }
    }
}

/// A special register compiled code does not compute itself: the clocks (`which` 0 and 1)
/// and `%envreg<which - 2>`.
pub(super) extern "C" fn h_special(t: *mut Thread, which: u32) -> u64 {
    // SAFETY: as in `guarded`.
    let t = unsafe { &*t };
    special(
        t,
        match which {
            0 => Sreg::Clock64,
            1 => Sreg::GlobalTimer,
            n => Sreg::EnvReg(u8::try_from(n - 2).unwrap_or(u8::MAX)),
        },
    )
}
