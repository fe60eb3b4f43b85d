//! Device memory of one compute context on the CPU executor, and the interface a kernel
//! executes against.
//!
//! Every access is checked against the context's allocations: an access that does not lie
//! wholly inside one allocation is a [`Fault`] (reported as CUDA_ERROR_ILLEGAL_ADDRESS), so a
//! kernel or a copy can never reach host memory or another context. Allocations are arrays of
//! `AtomicU64` words, so the blocks of a launch may run on several host threads at once without
//! unsafe code: plain loads and stores are relaxed word accesses (a partial word is merged with
//! a compare-exchange loop, so neighbouring bytes written by other threads survive), and the
//! PTX `atom`/`red` instructions are compare-exchange loops on one word.
//!
//! Every allocation is charged to the VM's [`MemoryBudget`] before its words are made, and
//! gives its bytes back when it is freed (or its context destroyed): a guest's device memory
//! is host memory of its device process and counts against the same budget as its other
//! resources.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use thiserror::Error;

use crate::budget::{Charge, MemoryBudget};
use crate::compute::{ComputeError, ComputeResult};

/// Device addresses start here, as on the real driver (a null or small pointer is never valid).
pub const DEVICE_ADDRESS_BASE: u64 = 0x7f00_0000_0000;
/// Generic addresses the PTX executor gives what is not global memory: shared memory
/// (`SHARED_WINDOW`), a thread's local memory (`LOCAL_WINDOW`), each decoded 4 GiB wide, and
/// function addresses (`FUNC_WINDOW`, 64 GiB). No device allocation may lie here, or a generic
/// access to it would reach shared or local memory instead: a placed window that overlaps this
/// range is refused ([`DeviceMemory::in_window`]), and the default window lies above it.
pub const GENERIC_RESERVED: Range<u64> = 0x1000_0000_0000..0x4000_0000_0000;
const _: () = assert!(DEVICE_ADDRESS_BASE >= GENERIC_RESERVED.end);
/// Host bytes an allocation's entry in its context's table takes beside its words (the entry,
/// its share of the table's nodes, the words' heap header), charged with it so that
/// [`MAX_ALLOCATIONS`] tiny allocations count for what they hold too.
pub const ALLOCATION_RECORD_BYTES: u64 = 128;
/// Allocation granularity and alignment (the driver's `cuMemAlloc` alignment).
pub const ALLOCATION_ALIGN: u64 = 256;
/// Unmapped bytes kept after every allocation, so running just past its end faults.
pub const GUARD_BYTES: u64 = 64 * 1024;
/// Most live allocations of one context: bounds the allocation table a guest can grow.
pub const MAX_ALLOCATIONS: usize = 65_536;

/// The device heap of a context (`malloc` in kernels): the driver's default
/// `cudaLimitMallocHeapSize`, 8 MiB.
pub const DEVICE_HEAP_BYTES: u64 = 8 << 20;
/// Largest device heap a program may ask for (`cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE)`):
/// the heap is device memory of its context, charged to the VM's budget when it is made, and
/// this bounds what one request can make the host set aside for it (1 GiB).
pub const MAX_DEVICE_HEAP_BYTES: u64 = 1 << 30;

/// Checks a device heap size a program asked for against [`MAX_DEVICE_HEAP_BYTES`].
pub fn check_heap_size(bytes: u64) -> ComputeResult<()> {
    if bytes > MAX_DEVICE_HEAP_BYTES {
        return Err(ComputeError::InvalidValue(format!(
            "a device heap of {bytes} bytes: the most is {MAX_DEVICE_HEAP_BYTES}"
        )));
    }
    Ok(())
}
/// Alignment of what device `malloc` returns (the driver's is 16 bytes).
pub const HEAP_ALIGN: u64 = 16;
/// Most live device-`malloc` blocks of one context: bounds the host-side bookkeeping.
pub const MAX_HEAP_BLOCKS: usize = 65_536;

/// Device-side `malloc`/`free` of a context: blocks carved out of one device allocation. The
/// bookkeeping lives on the host, out of the kernels' reach, so a kernel that writes past its
/// block corrupts only its own data, never the allocator; a `free` of anything `malloc` did
/// not return is refused.
#[derive(Debug)]
pub struct DeviceHeap {
    base: u64,
    size: u64,
    /// Live blocks: start → length.
    blocks: Mutex<BTreeMap<u64, u64>>,
}

impl DeviceHeap {
    /// A heap over the device allocation `[base, base + size)`.
    pub fn new(base: u64, size: u64) -> Self {
        DeviceHeap {
            base,
            size,
            blocks: Mutex::new(BTreeMap::new()),
        }
    }

    /// The device allocation the heap lives in.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// A block of `size` bytes (first fit), or 0 (NULL) when none is free, as on the device.
    pub fn malloc(&self, size: u64) -> u64 {
        let Some(size) = size.checked_next_multiple_of(HEAP_ALIGN) else {
            return 0;
        };
        if size == 0 || size > self.size {
            return 0;
        }
        let mut blocks = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        if blocks.len() >= MAX_HEAP_BLOCKS {
            return 0;
        }
        let mut at = self.base;
        for (&start, &len) in blocks.iter() {
            if start - at >= size {
                break;
            }
            at = start + len;
        }
        if self.base + self.size - at < size {
            return 0;
        }
        blocks.insert(at, size);
        at
    }

    /// Frees a block `malloc` returned; false if `addr` is not one.
    pub fn free(&self, addr: u64) -> bool {
        let mut blocks = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        blocks.remove(&addr).is_some()
    }
}

/// Why a device access failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Not inside one allocation of this context.
    OutOfRange,
    /// An atomic (or vector) access not aligned to its size.
    Misaligned,
}

/// A device access that was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("{kind:?} access of {size} bytes at {addr:#x}")]
pub struct Fault {
    pub kind: FaultKind,
    pub addr: u64,
    pub size: u64,
}

impl Fault {
    fn out_of_range(addr: u64, size: u64) -> Self {
        Fault {
            kind: FaultKind::OutOfRange,
            addr,
            size,
        }
    }
}

/// What a kernel executes against: global memory (and module globals/constants, which live in
/// it). Implementations check every access; none may panic on any address or size.
pub trait GlobalMemory: Sync {
    /// Copies `buf.len()` bytes at `addr` into `buf`.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), Fault>;
    /// Writes `data` at `addr`.
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), Fault>;
    /// Atomically replaces the `width`-byte (4 or 8) little-endian value at `addr` (aligned to
    /// `width`) by `update(old)` and returns `old`. `update` may be called several times.
    fn atomic_update(
        &self,
        addr: u64,
        width: u8,
        update: &mut dyn FnMut(u64) -> u64,
    ) -> Result<u64, Fault>;

    /// The allocation holding `addr` as host memory, for compiled kernels, which check their
    /// accesses against its bounds themselves; `None` where memory has no such place (then
    /// every access goes through the methods above).
    fn host_span(&self, addr: u64) -> Option<HostSpan> {
        let _ = addr;
        None
    }
}

/// An allocation as host memory: `len` bytes at `ptr` are device addresses `base..base + len`.
/// Valid while the memory is borrowed (an allocation is only freed through `&mut`); the bytes
/// are 8-byte words that other threads access atomically, so whoever writes through `ptr`
/// writes whole aligned words or smaller aligned pieces, never tearing another's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostSpan {
    pub base: u64,
    pub len: u64,
    pub ptr: *mut u8,
}

/// One allocation: its words, its length in bytes, and what it holds of the budget.
#[derive(Debug)]
struct Allocation {
    len: u64,
    words: Box<[AtomicU64]>,
    /// Given back when the allocation is dropped (freed, or its context destroyed).
    _charge: Charge,
}

/// The allocations of one context.
#[derive(Debug)]
pub struct DeviceMemory {
    allocations: BTreeMap<u64, Allocation>,
    /// Start of the address window.
    start: u64,
    /// End of the address window (exclusive): allocations never reach past it.
    end: u64,
    used: u64,
    /// Most bytes this context may hold (rounded allocation sizes counted).
    limit: u64,
    /// The VM's budget, charged for every allocation.
    budget: Arc<MemoryBudget>,
}

impl DeviceMemory {
    /// A context memory of at most `limit` bytes with a budget of its own, room for `limit`
    /// and the records of [`MAX_ALLOCATIONS`] allocations (a test's or a benchmark's memory;
    /// a backend's contexts share their VM's through [`DeviceMemory::charged_to`]).
    pub fn new(limit: u64) -> Self {
        let records = MAX_ALLOCATIONS as u64 * ALLOCATION_RECORD_BYTES;
        Self::charged_to(limit, &MemoryBudget::new(limit.saturating_add(records)))
    }

    /// A context memory of at most `limit` bytes, every allocation charged to `budget`, at
    /// addresses from [`DEVICE_ADDRESS_BASE`] up.
    pub fn charged_to(limit: u64, budget: &Arc<MemoryBudget>) -> Self {
        DeviceMemory {
            allocations: BTreeMap::new(),
            start: DEVICE_ADDRESS_BASE,
            end: u64::MAX,
            used: 0,
            limit,
            budget: Arc::clone(budget),
        }
    }

    /// As [`DeviceMemory::charged_to`], every allocation (and its guard) inside
    /// `[base, base + size)`: a placed context, whose window the guest library reserved. A
    /// window that wraps around or overlaps [`GENERIC_RESERVED`] is refused.
    pub fn in_window(
        base: u64,
        size: u64,
        limit: u64,
        budget: &Arc<MemoryBudget>,
    ) -> ComputeResult<Self> {
        let window = |why: &str| {
            ComputeError::InvalidValue(format!("device window {base:#x}+{size:#x} {why}"))
        };
        let end = base
            .checked_add(size)
            .ok_or_else(|| window("wraps around"))?;
        if base < GENERIC_RESERVED.end && GENERIC_RESERVED.start < end {
            return Err(window(
                "overlaps the generic addresses of shared and local memory",
            ));
        }
        Ok(DeviceMemory {
            start: base,
            end,
            ..Self::charged_to(limit, budget)
        })
    }

    /// Bytes allocated (rounded to [`ALLOCATION_ALIGN`]).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Allocates `size` zeroed bytes; returns the device address. `size` 0 is refused, as by
    /// `cuMemAlloc`. The rounded size and [`ALLOCATION_RECORD_BYTES`] are charged to the budget
    /// before the words are made; past the budget or the context's limit it is
    /// [`ComputeError::OutOfMemory`].
    pub fn alloc(&mut self, size: u64) -> ComputeResult<u64> {
        if size == 0 {
            return Err(ComputeError::InvalidValue("allocation of 0 bytes".into()));
        }
        let rounded = size
            .checked_next_multiple_of(ALLOCATION_ALIGN)
            .ok_or_else(|| ComputeError::OutOfMemory(format!("{size} bytes")))?;
        if self.allocations.len() >= MAX_ALLOCATIONS {
            return Err(ComputeError::OutOfMemory(format!(
                "{MAX_ALLOCATIONS} allocations"
            )));
        }
        let used = self.used.saturating_add(rounded);
        if used > self.limit {
            return Err(ComputeError::OutOfMemory(format!(
                "{size} bytes past the context's {} byte limit ({} in use)",
                self.limit, self.used
            )));
        }
        // The lowest gap of the window that holds the block and its guard (first fit: freed
        // ranges are reused, so a context that allocates and frees in a loop stays inside its
        // window; at most MAX_ALLOCATIONS steps).
        let need = rounded
            .checked_add(GUARD_BYTES)
            .ok_or_else(|| ComputeError::OutOfMemory(format!("{size} bytes")))?;
        let mut base = self.start;
        for (&at, a) in &self.allocations {
            if base.checked_add(need).is_some_and(|end| end <= at) {
                break;
            }
            base = at
                .saturating_add(a.len.next_multiple_of(ALLOCATION_ALIGN))
                .saturating_add(GUARD_BYTES);
        }
        if base.checked_add(need).is_none_or(|end| end > self.end) {
            return Err(ComputeError::OutOfMemory("device address window".into()));
        }
        let words = usize::try_from(rounded / 8)
            .map_err(|_| ComputeError::OutOfMemory(format!("{size} bytes")))?;
        let charge = rounded
            .checked_add(ALLOCATION_RECORD_BYTES)
            .and_then(|bytes| self.budget.charge(bytes).ok())
            .ok_or_else(|| {
                ComputeError::OutOfMemory(format!(
                    "{size} bytes past the VM's memory budget ({} of {} in use)",
                    self.budget.used(),
                    self.budget.limit()
                ))
            })?;
        // Charged: now the words (zero-filled, so committed at once).
        let words: Box<[AtomicU64]> = (0..words).map(|_| AtomicU64::new(0)).collect();
        self.allocations.insert(
            base,
            Allocation {
                len: size,
                words,
                _charge: charge,
            },
        );
        self.used = used;
        Ok(base)
    }

    /// Frees the allocation that starts at `addr`, giving its bytes back to the budget.
    pub fn free(&mut self, addr: u64) -> ComputeResult<()> {
        let alloc = self
            .allocations
            .remove(&addr)
            .ok_or_else(|| ComputeError::InvalidValue(format!("{addr:#x} is not an allocation")))?;
        self.used -= alloc.len.next_multiple_of(ALLOCATION_ALIGN);
        Ok(())
    }

    /// The allocation holding `[addr, addr + size)`, and the offset of `addr` in it.
    fn find(&self, addr: u64, size: u64) -> Result<(&Allocation, u64), Fault> {
        let (base, alloc) = self
            .allocations
            .range(..=addr)
            .next_back()
            .ok_or(Fault::out_of_range(addr, size))?;
        let offset = addr - base;
        match offset.checked_add(size) {
            Some(end) if end <= alloc.len => Ok((alloc, offset)),
            _ => Err(Fault::out_of_range(addr, size)),
        }
    }

    /// Checks that `[addr, addr + size)` lies wholly inside one allocation (no arithmetic
    /// wraps): what a copy or a memset checks of each range before it moves a byte.
    pub fn check(&self, addr: u64, size: u64) -> Result<(), Fault> {
        self.find(addr, size).map(drop)
    }

    /// Sets `count` bytes at `addr` to `value` (`cuMemsetD8`).
    pub fn fill(&self, addr: u64, value: u8, count: u64) -> Result<(), Fault> {
        self.check(addr, count)?;
        const CHUNK: u64 = 64 * 1024;
        let pattern = [value; CHUNK as usize];
        let mut done = 0;
        while done < count {
            let n = (count - done).min(CHUNK);
            self.write(addr + done, &pattern[..n as usize])?;
            done += n;
        }
        Ok(())
    }
}

/// Merges `bytes` (at byte `shift` of the word) into `old`.
fn merge(old: u64, shift: usize, bytes: &[u8]) -> u64 {
    let mut le = old.to_le_bytes();
    le[shift..shift + bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(le)
}

impl GlobalMemory for DeviceMemory {
    fn host_span(&self, addr: u64) -> Option<HostSpan> {
        let (base, alloc) = self.allocations.range(..=addr).next_back()?;
        (addr - base < alloc.len).then(|| HostSpan {
            base: *base,
            len: alloc.len,
            // Atomics are interior-mutable: writing through this pointer is writing through
            // `AtomicU64::as_ptr`.
            ptr: alloc.words.as_ptr().cast::<u8>().cast_mut(),
        })
    }

    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), Fault> {
        let (alloc, offset) = self.find(addr, buf.len() as u64)?;
        let mut pos = offset as usize;
        let mut out = 0;
        while out < buf.len() {
            let shift = pos % 8;
            let n = (8 - shift).min(buf.len() - out);
            let word = alloc.words[pos / 8].load(Ordering::Relaxed).to_le_bytes();
            buf[out..out + n].copy_from_slice(&word[shift..shift + n]);
            out += n;
            pos += n;
        }
        Ok(())
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<(), Fault> {
        let (alloc, offset) = self.find(addr, data.len() as u64)?;
        let mut pos = offset as usize;
        let mut done = 0;
        while done < data.len() {
            let shift = pos % 8;
            let n = (8 - shift).min(data.len() - done);
            let word = &alloc.words[pos / 8];
            let part = &data[done..done + n];
            if n == 8 {
                word.store(
                    u64::from_le_bytes(part.try_into().expect("8 bytes")),
                    Ordering::Relaxed,
                );
            } else {
                let mut old = word.load(Ordering::Relaxed);
                while let Err(now) = word.compare_exchange_weak(
                    old,
                    merge(old, shift, part),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    old = now;
                }
            }
            done += n;
            pos += n;
        }
        Ok(())
    }

    fn atomic_update(
        &self,
        addr: u64,
        width: u8,
        update: &mut dyn FnMut(u64) -> u64,
    ) -> Result<u64, Fault> {
        let size = u64::from(width);
        if !matches!(width, 4 | 8) || addr % size != 0 {
            return Err(Fault {
                kind: FaultKind::Misaligned,
                addr,
                size,
            });
        }
        let (alloc, offset) = self.find(addr, size)?;
        let word = &alloc.words[offset as usize / 8];
        let shift = (offset % 8) as u32 * 8;
        let mask = if width == 8 { u64::MAX } else { 0xffff_ffff };
        let mut old = word.load(Ordering::Relaxed);
        loop {
            let value = (old >> shift) & mask;
            let new = (update(value) & mask) << shift | (old & !(mask << shift));
            match word.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(value),
                Err(now) => old = now,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_heap_reuses_freed_blocks_and_refuses_what_it_did_not_hand_out() {
        let heap = DeviceHeap::new(0x1000, 256);
        let a = heap.malloc(100);
        let b = heap.malloc(100);
        assert_eq!((a, b), (0x1000, 0x1070));
        assert_eq!(heap.malloc(100), 0, "only 32 bytes left");
        assert_eq!(heap.malloc(0), 0);
        assert_eq!(heap.malloc(u64::MAX), 0);
        assert!(heap.free(a));
        assert!(!heap.free(a), "twice");
        assert!(!heap.free(b + 16), "inside a block");
        assert_eq!(heap.malloc(50), 0x1000, "first fit");
        assert_eq!(heap.malloc(48), 0x1040);
        assert_eq!(heap.malloc(16), 0x10e0, "the gap is full, the tail is not");
    }

    #[test]
    fn accesses_inside_an_allocation_round_trip_at_every_alignment() {
        let mut mem = DeviceMemory::new(1 << 20);
        let a = mem.alloc(100).unwrap();
        assert_eq!(a % ALLOCATION_ALIGN, 0);
        let data: Vec<u8> = (0..37).collect();
        for start in 0..(100 - 37) {
            mem.write(a + start, &data).unwrap();
            let mut back = vec![0; 37];
            mem.read(a + start, &mut back).unwrap();
            assert_eq!(back, data);
        }
    }

    /// Reads and writes of every size up to three words at every offset in a word leave the
    /// allocation as a plain byte array would: the piece written, its neighbours kept, and
    /// any piece read back as the array holds it.
    #[test]
    fn pieces_of_words_read_and_write_as_bytes_do() {
        let mut mem = DeviceMemory::new(1 << 20);
        let a = mem.alloc(64).unwrap();
        let mut model: Vec<u8> = (0..64).map(|i| 0x80 | i as u8).collect();
        mem.write(a, &model).unwrap();
        let mut stamp = 0u8;
        for size in 1..=24usize {
            for start in 0..16usize {
                let piece: Vec<u8> = (0..size)
                    .map(|_| {
                        stamp = stamp.wrapping_add(37);
                        stamp
                    })
                    .collect();
                mem.write(a + start as u64, &piece).unwrap();
                model[start..start + size].copy_from_slice(&piece);
                let mut all = vec![0; 64];
                mem.read(a, &mut all).unwrap();
                assert_eq!(all, model, "write of {size} at {start}");
                for from in 0..16usize {
                    let mut back = vec![0; size];
                    mem.read(a + from as u64, &mut back).unwrap();
                    assert_eq!(back, model[from..from + size], "read of {size} at {from}");
                }
            }
        }
    }

    #[test]
    fn accesses_outside_every_allocation_fault_and_touch_nothing() {
        let mut mem = DeviceMemory::new(1 << 20);
        let a = mem.alloc(100).unwrap();
        let b = mem.alloc(8).unwrap();
        assert!(b >= a + 100 + GUARD_BYTES);
        let mut buf = [0u8; 4];
        for addr in [0, a - 1, a + 97, a + 100, b + 5, u64::MAX - 2] {
            assert_eq!(
                mem.read(addr, &mut buf).unwrap_err().kind,
                FaultKind::OutOfRange
            );
            assert_eq!(
                mem.write(addr, &buf).unwrap_err().kind,
                FaultKind::OutOfRange
            );
        }
        mem.free(a).unwrap();
        assert!(mem.read(a, &mut buf).is_err(), "a freed allocation is gone");
        assert!(mem.free(a).is_err());
    }

    #[test]
    fn atomics_need_natural_alignment_and_keep_neighbours() {
        let mut mem = DeviceMemory::new(1 << 20);
        let a = mem.alloc(16).unwrap();
        mem.write(a, &[0xff; 16]).unwrap();
        let old = mem
            .atomic_update(a + 4, 4, &mut |v| v.wrapping_add(2))
            .unwrap();
        assert_eq!(old, 0xffff_ffff);
        let mut back = [0u8; 16];
        mem.read(a, &mut back).unwrap();
        assert_eq!(&back[..4], &[0xff; 4]);
        assert_eq!(&back[4..8], &1u32.to_le_bytes());
        assert_eq!(&back[8..], &[0xff; 8]);
        assert_eq!(
            mem.atomic_update(a + 2, 4, &mut |v| v).unwrap_err().kind,
            FaultKind::Misaligned
        );
        assert_eq!(
            mem.atomic_update(a + 4, 8, &mut |v| v).unwrap_err().kind,
            FaultKind::Misaligned
        );
    }

    #[test]
    fn concurrent_byte_writes_to_one_word_all_survive() {
        let mut mem = DeviceMemory::new(1 << 20);
        let a = mem.alloc(8).unwrap();
        std::thread::scope(|s| {
            for i in 0..8u8 {
                let mem = &mem;
                s.spawn(move || {
                    for _ in 0..1000 {
                        mem.write(a + u64::from(i), &[i + 1]).unwrap();
                    }
                });
            }
        });
        let mut back = [0u8; 8];
        mem.read(a, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn freed_ranges_are_reused_so_a_window_serves_an_alloc_free_loop() {
        let base = 0x5555_0000_0000;
        let window = 4 * 65536;
        let budget = MemoryBudget::new(1 << 30);
        let mut m = DeviceMemory::in_window(base, window, 1 << 30, &budget).unwrap();
        // The same block allocated and freed far more often than the window holds blocks.
        for _ in 0..1000 {
            let a = m.alloc(65536).unwrap();
            assert_eq!(a, base);
            m.free(a).unwrap();
        }
        // A freed range in the middle goes to the next block that fits there.
        let a = m.alloc(100).unwrap();
        let b = m.alloc(100).unwrap();
        let c = m.alloc(100).unwrap();
        assert!(a < b && b < c && c + 100 + GUARD_BYTES <= base + window);
        m.free(b).unwrap();
        assert_eq!(m.alloc(50).unwrap(), b);
        // Every block keeps its guard: nothing fits past the window's end.
        assert!(m.alloc(65536).is_err());
        m.check(a + 99, 1).unwrap();
        assert!(
            m.check(a + 256, 1).is_err(),
            "the guard after a block is no block's"
        );
    }

    #[test]
    fn the_budget_and_the_table_bound_allocations() {
        let mut mem = DeviceMemory::new(1024);
        assert!(mem.alloc(0).is_err());
        let a = mem.alloc(1000).unwrap();
        assert!(mem.alloc(1).is_err(), "1024 rounded bytes used");
        mem.free(a).unwrap();
        assert_eq!(mem.used(), 0);
        assert!(mem.alloc(u64::MAX).is_err());
        let b = mem.alloc(300).unwrap();
        mem.fill(b, 7, 300).unwrap();
        assert_eq!(mem.fill(b, 7, 301).unwrap_err().kind, FaultKind::OutOfRange);
    }

    #[test]
    fn allocations_are_charged_to_the_shared_budget_and_give_it_back() {
        let budget = MemoryBudget::new(1 << 20);
        let mut one = DeviceMemory::charged_to(1 << 30, &budget);
        let mut two = DeviceMemory::charged_to(1 << 30, &budget);
        let a = one.alloc(1000).unwrap();
        assert_eq!(budget.used(), 1024 + ALLOCATION_RECORD_BYTES);
        // The other context shares the budget: what is left, and not a byte more.
        let left = budget.limit() - budget.used() - ALLOCATION_RECORD_BYTES;
        assert!(matches!(
            two.alloc(left + 1),
            Err(ComputeError::OutOfMemory(_))
        ));
        assert_eq!(
            budget.used(),
            1024 + ALLOCATION_RECORD_BYTES,
            "refused: nothing held"
        );
        let b = two.alloc(left).unwrap();
        assert_eq!(budget.used(), budget.limit());
        assert!(matches!(one.alloc(1), Err(ComputeError::OutOfMemory(_))));
        two.free(b).unwrap();
        one.free(a).unwrap();
        assert_eq!(budget.used(), 0);
        // Dropping a memory (a destroyed context) gives back all it held.
        for _ in 0..10 {
            one.alloc(4096).unwrap();
        }
        drop(one);
        assert_eq!(budget.used(), 0);
        // Sizes that would wrap when rounded or charged are refused.
        for size in [u64::MAX, u64::MAX - ALLOCATION_ALIGN, u64::MAX - 100] {
            assert!(matches!(two.alloc(size), Err(ComputeError::OutOfMemory(_))));
        }
    }

    #[test]
    fn a_placed_window_never_overlaps_the_generic_reserved_addresses() {
        let budget = MemoryBudget::new(1 << 20);
        let (start, end) = (GENERIC_RESERVED.start, GENERIC_RESERVED.end);
        for (base, size) in [
            (start, 1 << 16),
            (start - (1 << 16), 2 << 16),
            (end - (1 << 16), 1 << 16),
            (start - (1 << 16), end - start + (2 << 16)),
            (0x2000_0000_0000, 1 << 16),
            (u64::MAX - 0xffff, 1 << 16),
        ] {
            assert!(
                matches!(
                    DeviceMemory::in_window(base, size, 1 << 20, &budget),
                    Err(ComputeError::InvalidValue(_))
                ),
                "{base:#x}+{size:#x}"
            );
        }
        // Room for a block and its guard, just outside.
        for (base, size) in [(start - (2 << 16), 2 << 16), (end, 2 << 16)] {
            let mut m = DeviceMemory::in_window(base, size, 1 << 20, &budget).unwrap();
            let a = m.alloc(64).unwrap();
            assert!(a + 64 <= start || a >= end, "{a:#x}");
        }
        // The default window lies above it.
        let a = DeviceMemory::charged_to(1 << 20, &budget)
            .alloc(64)
            .unwrap();
        assert!(a >= end);
    }

    #[test]
    fn ranges_that_wrap_around_2_64_are_faults_not_panics() {
        let mut mem = DeviceMemory::new(1 << 20);
        let a = mem.alloc(4096).unwrap();
        mem.fill(a, 5, 4096).unwrap();
        let wrap = 0u64.wrapping_sub(16);
        for (addr, size) in [
            (a + 16, wrap),
            (a + 16, u64::MAX),
            (a, u64::MAX),
            (u64::MAX, 1),
            (u64::MAX - 3, 8),
            (u64::MAX, u64::MAX),
        ] {
            assert_eq!(
                mem.check(addr, size).unwrap_err().kind,
                FaultKind::OutOfRange
            );
            assert_eq!(
                mem.fill(addr, 9, size).unwrap_err().kind,
                FaultKind::OutOfRange
            );
        }
        let mut back = vec![0; 4096];
        mem.read(a, &mut back).unwrap();
        assert!(back.iter().all(|&v| v == 5));
    }
}
