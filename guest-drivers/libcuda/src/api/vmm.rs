//! The C entry points of virtual memory management: address reservations, physical
//! allocations (`cuMemCreate`) and the mappings between them.
//!
//! A reservation is device memory of its whole size, made when it is reserved (the executor's
//! memory has no address space apart from its allocations, so an address a kernel can use is
//! an allocation's). Mapping a physical allocation at a reserved address puts its contents
//! there: a physical allocation lives in the reservation while mapped, and in device memory of
//! its own only while it is unmapped and still held (its contents are copied out at the unmap
//! and back at the next map). One physical allocation mapped at two addresses at once would
//! need the executor to alias memory, which it cannot: that second mapping is refused with
//! `CUDA_ERROR_NOT_SUPPORTED`. The reservation's memory stays addressable when unmapped (a
//! kernel reading there does not fault as on a GPU); copies and memsets are checked by the
//! library like any device memory.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::graphs::{ALLOCATION_PINNED, LOCATION_DEVICE};
use super::*;

/// Granularity of reservations, physical allocations and mappings: a GPU's 2 MiB large page,
/// what CUDA reports for a Turing GPU (minimum and recommended alike).
const GRANULARITY: u64 = 2 << 20;
/// Physical allocations alive at once: each is guest bookkeeping.
const MAX_HANDLES: usize = 4096;
/// Handle tag of physical allocations.
const HANDLE_TAG: u64 = 0x564D << 48;
/// `CUmemAccess_flags`: none, read, read-write.
const ACCESS_NONE: c_int = 0;
const ACCESS_READ: c_int = 1;
const ACCESS_READWRITE: c_int = 3;
/// `CUmemAllocationGranularity_flags`: minimum, recommended.
const GRANULARITY_RECOMMENDED: c_int = 1;

struct Reservation {
    ctx: u64,
    size: u64,
}

/// A physical allocation (`CUmemGenericAllocationHandle`).
struct Physical {
    size: u64,
    /// The program's hold (until `cuMemRelease`) and one per mapping.
    holds: usize,
    /// Where its contents are while unmapped (device memory of its own), once it was mapped
    /// and unmapped.
    saved: Option<(u64, u64)>,
    /// The address it is mapped at.
    mapped: Option<u64>,
}

struct Mapping {
    size: u64,
    handle: u64,
    access: c_int,
}

#[derive(Default)]
struct Vmm {
    /// Start → reservation.
    reservations: BTreeMap<u64, Reservation>,
    handles: HashMap<u64, Physical>,
    /// Start → mapping.
    mappings: BTreeMap<u64, Mapping>,
    next: u64,
    /// Bytes of all physical allocations alive (at most the device's memory).
    physical: u64,
}

static VMM: Mutex<Option<Vmm>> = Mutex::new(None);

fn vmm<R>(f: impl FnOnce(&mut Vmm) -> CuResult<R>) -> CuResult<R> {
    let mut guard = VMM.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(Vmm::default))
}

impl Vmm {
    /// The reservation holding `[addr, addr + size)`, and its start.
    fn reservation(&self, addr: u64, size: u64) -> CuResult<(u64, &Reservation)> {
        self.reservations
            .range(..=addr)
            .next_back()
            .filter(|&(&s, r)| {
                addr.checked_add(size)
                    .is_some_and(|end| end <= s.saturating_add(r.size))
            })
            .map(|(&s, r)| (s, r))
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// The mapping holding `addr`, and its start.
    fn mapping(&self, addr: u64) -> CuResult<(u64, &Mapping)> {
        self.mappings
            .range(..=addr)
            .next_back()
            .filter(|&(&s, m)| addr - s < m.size)
            .map(|(&s, m)| (s, m))
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// The mappings that make up `[addr, addr + size)` exactly, by start.
    fn mappings_of(&self, addr: u64, size: u64) -> CuResult<Vec<u64>> {
        let end = addr.checked_add(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut at = addr;
        let mut out = Vec::new();
        while at < end {
            let m = self.mappings.get(&at).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            out.push(at);
            at = at.checked_add(m.size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        }
        if at != end || out.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(out)
    }

    fn physical(&mut self, h: u64) -> CuResult<&mut Physical> {
        self.handles.get_mut(&h).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// Lets go of one hold of `h`; its saved contents, when it goes, are returned for the
    /// caller to free.
    fn drop_hold(&mut self, h: u64) -> Option<(u64, u64)> {
        let p = self.handles.get_mut(&h)?;
        p.holds -= 1;
        if p.holds > 0 {
            return None;
        }
        let p = self.handles.remove(&h)?;
        self.physical -= p.size;
        p.saved
    }
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AllocationProp {
    kind: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32: *mut c_void,
    flags: [u8; 8],
}

/// Checks a `CUmemAllocationProp`: pinned memory on this device, no shareable handles.
fn check_prop(p: *const AllocationProp) -> CuResult<()> {
    let p = read_at(p, 0)?;
    if p.kind != ALLOCATION_PINNED || p.location_type != LOCATION_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    device(p.location_id)?;
    if p.handle_types != 0 {
        refused("physical allocations with shareable handles (IPC)");
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    Ok(())
}

/// A size that is a positive multiple of [`GRANULARITY`].
fn granular(size: usize) -> CuResult<u64> {
    let s = size as u64;
    if s == 0 || s % GRANULARITY != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(s)
}

entry!(cuMemGetAllocationGranularity(out: *mut usize, prop: *const AllocationProp, option: c_int) {
    check_prop(prop)?;
    if !(0..=GRANULARITY_RECOMMENDED).contains(&option) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    put(out, GRANULARITY as usize)
});

entry!(cuMemAddressReserve(ptr: *mut u64, size: usize, alignment: usize, _addr: u64, flags: u64) {
    let size = granular(size)?;
    // The address is a hint a driver may ignore; alignments past the allocator's are not
    // offered.
    if ptr.is_null() || flags != 0 || !(alignment == 0 || alignment.is_power_of_two()) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if alignment as u64 > mdev_backend::compute::memory::ALLOCATION_ALIGN {
        refused("cuMemAddressReserve with an alignment past 256 bytes");
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let ctx = current()?;
    let start = with(|d| d.mem_alloc(ctx, size)).inspect_err(|&e| {
        if e == CUDA_ERROR_OUT_OF_MEMORY {
            refused("a reservation past the device memory (reservations are backed here)");
        }
    })?;
    vmm(|v| {
        v.reservations.insert(start, Reservation { ctx, size });
        Ok(())
    })?;
    put(ptr, start)
});

entry!(cuMemAddressFree(ptr: u64, size: usize) {
    let ctx = vmm(|v| {
        let r = v.reservations.get(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if r.size != size as u64 || v.mappings.range(ptr..ptr + r.size).next().is_some() {
            // Not a whole reservation, or still mapped.
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = r.ctx;
        v.reservations.remove(&ptr);
        Ok(ctx)
    })?;
    with(|d| d.mem_free(ctx, ptr))
});

entry!(cuMemCreate(handle: *mut u64, size: usize, prop: *const AllocationProp, flags: u64) {
    check_prop(prop)?;
    let size = granular(size)?;
    if handle.is_null() || flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let total = with(|d| Ok(d.attributes().total_memory))?;
    let h = vmm(|v| {
        if v.handles.len() >= MAX_HANDLES || v.physical.saturating_add(size) > total {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        v.next += 1;
        let h = HANDLE_TAG | v.next;
        v.physical += size;
        v.handles.insert(h, Physical { size, holds: 1, saved: None, mapped: None });
        Ok(h)
    })?;
    put(handle, h)
});

entry!(cuMemRelease(handle: u64) {
    let saved = vmm(|v| {
        v.physical(handle)?;
        Ok(v.drop_hold(handle))
    })?;
    match saved {
        Some((ctx, at)) => with(|d| d.mem_free(ctx, at)),
        None => Ok(()),
    }
});

entry!(cuMemMap(ptr: u64, size: usize, offset: usize, handle: u64, flags: u64) {
    // CUDA: the offset must currently be zero.
    if offset != 0 || flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let size = granular(size)?;
    let (ctx, saved) = vmm(|v| {
        let (start, r) = v.reservation(ptr, size)?;
        let ctx = r.ctx;
        if (ptr - start) % GRANULARITY != 0
            || v.mappings.range(..ptr.saturating_add(size)).next_back().is_some_and(|(&s, m)| {
                s.saturating_add(m.size) > ptr
            })
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = v.physical(handle)?;
        if p.mapped.is_some() {
            refused("one physical allocation mapped at two addresses (the executor's memory cannot alias)");
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        if size != p.size {
            refused("a mapping of part of a physical allocation");
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        p.mapped = Some(ptr);
        p.holds += 1;
        let saved = p.saved.take();
        v.mappings.insert(ptr, Mapping { size, handle, access: ACCESS_NONE });
        Ok((ctx, saved))
    })?;
    // Its contents, if it had any, come back where it is mapped now.
    if let Some((owner_ctx, at)) = saved {
        with(|d| {
            d.copy_dtod(ctx, ptr, at, size, 0)?;
            d.mem_free(owner_ctx, at)
        })?;
    }
    Ok(())
});

entry!(cuMemUnmap(ptr: u64, size: usize) {
    let (ctx, starts) = vmm(|v| {
        let (_, r) = v.reservation(ptr, size as u64)?;
        Ok((r.ctx, v.mappings_of(ptr, size as u64)?))
    })?;
    for start in starts {
        let (handle, bytes, kept) = vmm(|v| {
            let m = v.mappings.get(&start).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let (handle, bytes) = (m.handle, m.size);
            // Held by more than this mapping: its contents move to memory of its own.
            Ok((handle, bytes, v.physical(handle)?.holds > 1))
        })?;
        let saved = if kept {
            let at = with(|d| d.mem_alloc(ctx, bytes))?;
            with(|d| d.copy_dtod(ctx, at, start, bytes, 0))?;
            Some((ctx, at))
        } else {
            None
        };
        vmm(|v| {
            v.mappings.remove(&start);
            if let Ok(p) = v.physical(handle) {
                p.mapped = None;
                p.saved = saved;
            }
            v.drop_hold(handle);
            Ok(())
        })?;
    }
    Ok(())
});

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int,
}

/// Access descriptors one call may pass: one per device, and there is one.
const MAX_ACCESS_DESCS: usize = 1;

entry!(cuMemSetAccess(ptr: u64, size: usize, descs: *const AccessDesc, count: usize) {
    if count == 0 || count > MAX_ACCESS_DESCS {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let d = read_at(descs, 0)?;
    if d.location_type != LOCATION_DEVICE
        || !matches!(d.flags, ACCESS_NONE | ACCESS_READ | ACCESS_READWRITE)
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    device(d.location_id)?;
    if d.flags != ACCESS_READWRITE {
        // The executor's memory has no page protection to enforce less.
        refused("cuMemSetAccess to less than read-write (no page protection on this device)");
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    vmm(|v| {
        for start in v.mappings_of(ptr, size as u64)? {
            if let Some(m) = v.mappings.get_mut(&start) {
                m.access = d.flags;
            }
        }
        Ok(())
    })
});

entry!(cuMemGetAccess(flags: *mut u64, location: *const [c_int; 2], ptr: u64) {
    let [kind, id] = read_at(location, 0)?;
    if kind != LOCATION_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    device(id)?;
    let access = vmm(|v| Ok(v.mapping(ptr)?.1.access))?;
    put(flags, access as u64)
});

entry!(cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) {
    if handle.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let h = vmm(|v| {
        let h = v.mapping(addr as u64)?.1.handle;
        v.physical(h)?.holds += 1;
        Ok(h)
    })?;
    put(handle, h)
});

entry!(cuMemGetAllocationPropertiesFromHandle(prop: *mut AllocationProp, handle: u64) {
    vmm(|v| v.physical(handle).map(drop))?;
    put(prop, AllocationProp {
        kind: ALLOCATION_PINNED,
        handle_types: 0,
        location_type: LOCATION_DEVICE,
        location_id: DEVICE,
        win32: std::ptr::null_mut(),
        flags: [0; 8],
    })
});

entry!(cuDeviceCanAccessPeer(can: *mut c_int, dev: c_int, peer: c_int) {
    // Which devices may access another's memory (what VMM programs ask before setting access
    // for "peers"): there is one device, and a device is not its own peer.
    device(dev)?;
    device(peer)?;
    put(can, 0)
});
