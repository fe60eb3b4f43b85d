//! The C entry points of memory pools and stream-ordered allocation (`cuMemAllocAsync`,
//! `cuMemFreeAsync`). An allocation is device memory of the stream's context made when the
//! call is made; every stream of a context runs on the host's one in-order executor, so it
//! is usable by all work issued after it, and a stream-ordered free takes effect after the
//! work issued before it (the free request follows that work). A pool keeps freed blocks
//! for reuse up to its release threshold, and counts what it holds for its attributes.

use std::collections::HashMap;
use std::sync::Mutex;

use super::graphs::{ALLOCATION_PINNED, LOCATION_DEVICE, capture_alloc, capture_free};
use super::*;

/// Pools a process may create (`cuMemPoolCreate`), besides the device's default pool: each
/// is guest bookkeeping.
const MAX_POOLS: usize = 64;
/// Handle tag of pools.
const POOL_TAG: u64 = 0x504F << 48;

/// `CUmemPool_attribute`: the three reuse flags (follow event dependencies, allow
/// opportunistic reuse, allow internal dependencies) are 1 to 3.
const ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: c_int = 1;
const ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: c_int = 3;
const ATTR_RELEASE_THRESHOLD: c_int = 4;
const ATTR_RESERVED_MEM_CURRENT: c_int = 5;
const ATTR_RESERVED_MEM_HIGH: c_int = 6;
const ATTR_USED_MEM_CURRENT: c_int = 7;
const ATTR_USED_MEM_HIGH: c_int = 8;
/// `CUmemAccess_flags`: read-write.
const ACCESS_READWRITE: c_int = 3;

/// A free block kept by a pool: its context, address, size and the stream that freed it.
#[derive(Debug, Clone, Copy)]
struct Block {
    ctx: u64,
    dptr: u64,
    bytes: u64,
    stream: u64,
}

#[derive(Debug)]
struct Pool {
    threshold: u64,
    /// The three reuse flags (attributes 1 to 3), each 0 or 1.
    reuse: [c_int; 3],
    used: u64,
    used_high: u64,
    reserved: u64,
    reserved_high: u64,
    free: Vec<Block>,
}

impl Default for Pool {
    fn default() -> Self {
        Pool {
            threshold: 0,
            reuse: [1; 3],
            used: 0,
            used_high: 0,
            reserved: 0,
            reserved_high: 0,
            free: Vec::new(),
        }
    }
}

impl Pool {
    /// Takes free blocks out until at most `keep` bytes are reserved; they are returned for
    /// the caller to free outside the lock.
    fn trim(&mut self, keep: u64) -> Vec<Block> {
        let mut out = Vec::new();
        // Largest first: the fewest blocks released.
        self.free.sort_by_key(|b| std::cmp::Reverse(b.bytes));
        while self.reserved > keep
            && let Some(b) = self.free.first().copied()
        {
            self.free.remove(0);
            self.reserved -= b.bytes;
            out.push(b);
        }
        out
    }
}

#[derive(Default)]
struct Pools {
    pools: HashMap<u64, Pool>,
    next: u64,
    default: Option<u64>,
    /// `cuDeviceSetMemPool`'s pool (the default one when `None`).
    current: Option<u64>,
    /// Live stream-ordered allocations: address → (pool, block size). The pool may have been
    /// destroyed since (then the free releases the memory).
    live: HashMap<u64, (u64, u64)>,
}

static POOLS: Mutex<Option<Pools>> = Mutex::new(None);

fn pools<R>(f: impl FnOnce(&mut Pools) -> CuResult<R>) -> CuResult<R> {
    let mut guard = POOLS.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(Pools::default))
}

impl Pools {
    fn create(&mut self) -> CuResult<u64> {
        if self.pools.len() > MAX_POOLS {
            refused(&format!("more than {MAX_POOLS} memory pools"));
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        self.next += 1;
        let h = POOL_TAG | self.next;
        self.pools.insert(h, Pool::default());
        Ok(h)
    }

    fn default_pool(&mut self) -> CuResult<u64> {
        match self.default {
            Some(p) => Ok(p),
            None => {
                let p = self.create()?;
                self.default = Some(p);
                Ok(p)
            }
        }
    }

    fn pool(&mut self, h: Handle) -> CuResult<&mut Pool> {
        self.pools
            .get_mut(&(h as u64))
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }
}

/// Frees blocks a pool let go of.
fn release(blocks: Vec<Block>) -> CuResult<()> {
    blocks
        .into_iter()
        .try_for_each(|b| with(|d| d.mem_free(b.ctx, b.dptr)))
}

/// A stream-ordered allocation of `bytes` from `pool` (the device's current pool for NULL).
fn alloc_async(dptr: *mut u64, bytes: usize, pool: Option<Handle>, stream: Handle) -> CuResult<()> {
    if dptr.is_null() || bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bytes = bytes as u64;
    if let Some(p) = capture_alloc(stream, bytes)? {
        return put(dptr, p);
    }
    let ctx = owner(stream)?;
    let (pool, reused) = pools(|ps| {
        let pool = match pool {
            Some(h) => {
                ps.pool(h)?;
                h as u64
            }
            None => match ps.current {
                Some(p) => p,
                None => ps.default_pool()?,
            },
        };
        let p = ps.pools.get_mut(&pool).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // The smallest free block of the context that fits and wastes at most its size; one
        // freed on another stream only where the reuse attributes allow reuse across streams
        // (always safe here: a context's streams run on one in-order executor).
        let across = p.reuse.contains(&1);
        let best = p
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.ctx == ctx && b.bytes >= bytes && b.bytes / 2 <= bytes)
            .filter(|(_, b)| across || b.stream == stream as u64)
            .min_by_key(|(_, b)| b.bytes)
            .map(|(i, _)| i);
        let reused = best.map(|i| p.free.swap_remove(i));
        if let Some(b) = reused {
            p.used += b.bytes;
            p.used_high = p.used_high.max(p.used);
            ps.live.insert(b.dptr, (pool, b.bytes));
        }
        Ok((pool, reused))
    })?;
    if let Some(b) = reused {
        return put(dptr, b.dptr);
    }
    let a = with(|d| d.mem_alloc(ctx, bytes))?;
    pools(|ps| {
        if let Some(p) = ps.pools.get_mut(&pool) {
            p.used += bytes;
            p.used_high = p.used_high.max(p.used);
            p.reserved += bytes;
            p.reserved_high = p.reserved_high.max(p.reserved);
        }
        ps.live.insert(a, (pool, bytes));
        Ok(())
    })?;
    put(dptr, a)
}

entry!(cuMemAllocAsync(dptr: *mut u64, bytes: usize, stream: Handle) {
    alloc_async(dptr, bytes, None, stream)
});

entry!(cuMemAllocFromPoolAsync(dptr: *mut u64, bytes: usize, pool: Handle, stream: Handle) {
    alloc_async(dptr, bytes, Some(pool), stream)
});

entry!(cuMemFreeAsync(dptr: u64, stream: Handle) {
    if capture_free(stream, dptr)? || graphs::free_graph_alloc(dptr)? {
        return Ok(());
    }
    let ctx = owner(stream)?;
    let back = pools(|ps| {
        let Some((pool, bytes)) = ps.live.remove(&dptr) else {
            return Ok(None);
        };
        let Some(p) = ps.pools.get_mut(&pool) else {
            // Its pool was destroyed: the memory goes.
            return Ok(Some(vec![Block { ctx, dptr, bytes, stream: stream as u64 }]));
        };
        p.used -= bytes;
        p.free.push(Block { ctx, dptr, bytes, stream: stream as u64 });
        let keep = p.threshold;
        Ok(Some(p.trim(keep)))
    })?;
    match back {
        Some(blocks) => release(blocks),
        // Memory from cuMemAlloc may be freed in stream order too; anything else is refused
        // by the host (a double free among it).
        None => with(|d| d.mem_free(ctx, dptr)),
    }
});

/// The start of `CUmemPoolProps`: allocation type, handle types, location.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct PoolProps {
    alloc_type: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
}

entry!(cuMemPoolCreate(pool: *mut Handle, props: *const PoolProps) {
    let p = read_at(props, 0)?;
    if pool.is_null() || p.alloc_type != ALLOCATION_PINNED || p.location_type != LOCATION_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    device(p.location_id)?;
    if p.handle_types != 0 {
        refused("memory pools with shareable handles (IPC)");
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    current()?;
    let h = pools(|ps| ps.create())?;
    put(pool, h as Handle)
});

entry!(cuMemPoolDestroy(pool: Handle) {
    let blocks = pools(|ps| {
        if ps.default == Some(pool as u64) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut p = ps.pools.remove(&(pool as u64)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if ps.current == Some(pool as u64) {
            ps.current = None;
        }
        // Live allocations stay until freed (then released, their pool being gone).
        Ok(p.trim(0))
    })?;
    release(blocks)
});

entry!(cuDeviceGetDefaultMemPool(pool: *mut Handle, dev: c_int) {
    device(dev)?;
    let h = pools(|ps| ps.default_pool())?;
    put(pool, h as Handle)
});

entry!(cuDeviceGetMemPool(pool: *mut Handle, dev: c_int) {
    device(dev)?;
    let h = pools(|ps| match ps.current {
        Some(p) => Ok(p),
        None => ps.default_pool(),
    })?;
    put(pool, h as Handle)
});

entry!(cuDeviceSetMemPool(dev: c_int, pool: Handle) {
    device(dev)?;
    pools(|ps| {
        ps.pool(pool)?;
        ps.current = Some(pool as u64);
        Ok(())
    })
});

entry!(cuMemPoolSetAttribute(pool: Handle, attribute: c_int, value: *mut c_void) {
    let blocks = pools(|ps| {
        let p = ps.pool(pool)?;
        match attribute {
            ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                let v: c_int = read_at(value.cast_const().cast(), 0)?;
                if !(0..=1).contains(&v) {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                p.reuse[(attribute - 1) as usize] = v;
                Ok(Vec::new())
            }
            ATTR_RELEASE_THRESHOLD => {
                p.threshold = read_at(value.cast_const().cast(), 0)?;
                let keep = p.threshold;
                Ok(p.trim(keep))
            }
            // The high watermarks may be reset, to 0 only.
            ATTR_RESERVED_MEM_HIGH | ATTR_USED_MEM_HIGH => {
                if read_at::<u64>(value.cast_const().cast(), 0)? != 0 {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                if attribute == ATTR_RESERVED_MEM_HIGH {
                    p.reserved_high = p.reserved;
                } else {
                    p.used_high = p.used;
                }
                Ok(Vec::new())
            }
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    })?;
    release(blocks)
});

entry!(cuMemPoolGetAttribute(pool: Handle, attribute: c_int, value: *mut c_void) {
    let (flag, count) = pools(|ps| {
        let p = ps.pool(pool)?;
        Ok(match attribute {
            ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                (Some(p.reuse[(attribute - 1) as usize]), 0)
            }
            ATTR_RELEASE_THRESHOLD => (None, p.threshold),
            ATTR_RESERVED_MEM_CURRENT => (None, p.reserved),
            ATTR_RESERVED_MEM_HIGH => (None, p.reserved_high),
            ATTR_USED_MEM_CURRENT => (None, p.used),
            ATTR_USED_MEM_HIGH => (None, p.used_high),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        })
    })?;
    match flag {
        Some(f) => put(value.cast::<c_int>(), f),
        None => put(value.cast::<u64>(), count),
    }
});

entry!(cuMemPoolTrimTo(pool: Handle, keep: usize) {
    let blocks = pools(|ps| Ok(ps.pool(pool)?.trim(keep as u64)))?;
    release(blocks)
});

/// `CUmemAccessDesc`: a location (type, id) and its access flags.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int,
}

/// Most access descriptors one call may pass: one per device, and there is one.
const MAX_ACCESS_DESCS: usize = 1;

entry!(cuMemPoolSetAccess(pool: Handle, descs: *const AccessDesc, count: usize) {
    pools(|ps| ps.pool(pool).map(drop))?;
    if count > MAX_ACCESS_DESCS {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    for i in 0..count {
        let d = read_at(descs, i)?;
        if d.location_type != LOCATION_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        device(d.location_id)?;
        // The pool's own device always has read-write access; it cannot be taken away.
        if d.flags != ACCESS_READWRITE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    }
    Ok(())
});

entry!(cuMemPoolGetAccess(flags: *mut c_int, pool: Handle, location: *const [c_int; 2]) {
    pools(|ps| ps.pool(pool).map(drop))?;
    let [kind, id] = read_at(location, 0)?;
    if kind != LOCATION_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    device(id)?;
    put(flags, ACCESS_READWRITE)
});
