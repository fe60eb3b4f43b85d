//! Memory pools, stream-ordered allocation and virtual memory management through the C entry
//! points, as a C program
//! calls them, against a served CPU backend: allocations usable by later work on the stream,
//! blocks kept up to the release threshold and reused, trimmed, the pool attributes that count
//! them, explicit pools, allocations captured into a graph as allocation nodes, physical
//! allocations mapped into reservations; and what CUDA refuses (zero sizes, bad pools, a
//! double free, IPC pools, taking the device's own access away, sizes off the granularity,
//! mappings past a reservation, unmapping what is not mapped). One test: the driver is
//! process-global, as in a real process.

use std::ffi::{c_int, c_uint, c_void};
use std::ptr::null_mut;

extern crate cuda;

mod support;

type Handle = *mut c_void;

/// `CUmemPoolProps` (88 bytes): pinned device memory on device 0, no handle types.
#[repr(C)]
struct PoolProps {
    alloc_type: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    rest: [u8; 72],
}

#[repr(C)]
struct AccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int,
}

unsafe extern "C" {
    fn cuInit(flags: c_uint) -> c_uint;
    fn cuCtxCreate_v2(ctx: *mut Handle, flags: c_uint, dev: c_int) -> c_uint;
    fn cuStreamCreate(s: *mut Handle, flags: c_uint) -> c_uint;
    fn cuStreamSynchronize(s: Handle) -> c_uint;
    fn cuMemsetD32Async(dst: u64, value: c_uint, n: usize, stream: Handle) -> c_uint;
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> c_uint;
    fn cuMemAllocAsync(dptr: *mut u64, bytes: usize, stream: Handle) -> c_uint;
    fn cuMemAllocFromPoolAsync(
        dptr: *mut u64,
        bytes: usize,
        pool: Handle,
        stream: Handle,
    ) -> c_uint;
    fn cuMemFreeAsync(dptr: u64, stream: Handle) -> c_uint;
    fn cuMemFree_v2(dptr: u64) -> c_uint;
    fn cuDeviceGetDefaultMemPool(pool: *mut Handle, dev: c_int) -> c_uint;
    fn cuDeviceGetMemPool(pool: *mut Handle, dev: c_int) -> c_uint;
    fn cuDeviceSetMemPool(dev: c_int, pool: Handle) -> c_uint;
    fn cuDeviceGetAttribute(v: *mut c_int, attribute: c_int, dev: c_int) -> c_uint;
    fn cuMemPoolCreate(pool: *mut Handle, props: *const PoolProps) -> c_uint;
    fn cuMemPoolDestroy(pool: Handle) -> c_uint;
    fn cuMemPoolSetAttribute(pool: Handle, attribute: c_int, value: *mut c_void) -> c_uint;
    fn cuMemPoolGetAttribute(pool: Handle, attribute: c_int, value: *mut c_void) -> c_uint;
    fn cuMemPoolTrimTo(pool: Handle, keep: usize) -> c_uint;
    fn cuMemPoolSetAccess(pool: Handle, descs: *const AccessDesc, count: usize) -> c_uint;
    fn cuMemPoolGetAccess(flags: *mut c_int, pool: Handle, location: *const [c_int; 2]) -> c_uint;
    fn cuStreamBeginCapture_v2(s: Handle, mode: c_int) -> c_uint;
    fn cuStreamEndCapture(s: Handle, g: *mut Handle) -> c_uint;
    fn cuGraphGetNodes(g: Handle, out: *mut Handle, n: *mut usize) -> c_uint;
    fn cuGraphNodeGetType(node: Handle, kind: *mut c_int) -> c_uint;
    fn cuGraphInstantiateWithFlags(out: *mut Handle, g: Handle, flags: u64) -> c_uint;
    fn cuGraphLaunch(exec: Handle, stream: Handle) -> c_uint;
    fn cuGraphExecDestroy(exec: Handle) -> c_uint;
    fn cuGraphDestroy(g: Handle) -> c_uint;
    fn cuDeviceGetGraphMemAttribute(dev: c_int, attribute: c_int, value: *mut u64) -> c_uint;
    fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> c_uint;
    fn cuMemGetAllocationGranularity(
        out: *mut usize,
        prop: *const AllocProp,
        option: c_int,
    ) -> c_uint;
    fn cuMemAddressReserve(
        ptr: *mut u64,
        size: usize,
        align: usize,
        addr: u64,
        flags: u64,
    ) -> c_uint;
    fn cuMemAddressFree(ptr: u64, size: usize) -> c_uint;
    fn cuMemCreate(handle: *mut u64, size: usize, prop: *const AllocProp, flags: u64) -> c_uint;
    fn cuMemRelease(handle: u64) -> c_uint;
    fn cuMemMap(ptr: u64, size: usize, offset: usize, handle: u64, flags: u64) -> c_uint;
    fn cuMemUnmap(ptr: u64, size: usize) -> c_uint;
    fn cuMemSetAccess(ptr: u64, size: usize, descs: *const AccessDesc, count: usize) -> c_uint;
    fn cuMemGetAccess(flags: *mut u64, location: *const [c_int; 2], ptr: u64) -> c_uint;
    fn cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) -> c_uint;
    fn cuMemGetAllocationPropertiesFromHandle(prop: *mut AllocProp, handle: u64) -> c_uint;
}

/// `CUmemAllocationProp`: pinned memory on device 0 (the handle types as given).
#[repr(C)]
struct AllocProp {
    kind: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32: usize,
    flags: [u8; 8],
}

fn alloc_prop(handle_types: c_int) -> AllocProp {
    AllocProp {
        kind: 1,
        handle_types,
        location_type: 1,
        location_id: 0,
        win32: 0,
        flags: [0; 8],
    }
}

/// `CUmemPool_attribute`: release threshold, reserved now, used now, used at most.
const RELEASE_THRESHOLD: c_int = 4;
const RESERVED_CURRENT: c_int = 5;
const USED_CURRENT: c_int = 7;
const USED_HIGH: c_int = 8;

fn attribute(pool: Handle, attribute: c_int) -> u64 {
    let mut v = 0u64;
    // SAFETY: a u64 out-value, as the counting attributes take.
    let status = unsafe { cuMemPoolGetAttribute(pool, attribute, (&raw mut v).cast()) };
    assert_eq!(status, 0);
    v
}

fn pinned_props(handle_types: c_int) -> PoolProps {
    PoolProps {
        alloc_type: 1,
        handle_types,
        location_type: 1,
        location_id: 0,
        rest: [0; 72],
    }
}

#[test]
fn stream_ordered_allocations_come_from_pools_that_count_and_keep_them() {
    let host = support::serve_cpu_backend("memory-ext");
    // SAFETY: every call passes arguments as the driver API documents them, or NULL and wrong
    // handles where the test checks that they are refused.
    unsafe {
        assert_eq!(cuInit(0), 0);
        let mut v = 0;
        assert_eq!(cuDeviceGetAttribute(&mut v, 115, 0), 0);
        assert_eq!(v, 1, "memory pools supported");
        let mut ctx: Handle = null_mut();
        assert_eq!(cuCtxCreate_v2(&mut ctx, 0, 0), 0);
        let mut s: Handle = null_mut();
        assert_eq!(cuStreamCreate(&mut s, 0), 0);
        let mut pool: Handle = null_mut();
        assert_eq!(cuDeviceGetDefaultMemPool(&mut pool, 1), 101);
        assert_eq!(cuDeviceGetDefaultMemPool(&mut pool, 0), 0);
        let mut current: Handle = null_mut();
        assert_eq!(cuDeviceGetMemPool(&mut current, 0), 0);
        assert_eq!(current, pool);

        // An allocation is usable by later work on its stream.
        let mut a = 0u64;
        assert_eq!(cuMemAllocAsync(&mut a, 0, s), 1, "zero bytes");
        assert_eq!(cuMemAllocAsync(null_mut(), 64, s), 1);
        assert_eq!(cuMemAllocAsync(&mut a, 4096, s), 0);
        assert_eq!(cuMemsetD32Async(a, 0xABCD, 1024, s), 0);
        let mut out = [0u32; 4];
        assert_eq!(
            cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), a + 4092 - 12, 16),
            0
        );
        assert_eq!(out, [0xABCD; 4]);
        assert_eq!(attribute(pool, USED_CURRENT), 4096);
        assert_eq!(cuMemFreeAsync(a, s), 0);
        assert_eq!(cuStreamSynchronize(s), 0);
        // Threshold 0: the freed block went back.
        assert_eq!(attribute(pool, USED_CURRENT), 0);
        assert_eq!(attribute(pool, RESERVED_CURRENT), 0);
        assert_eq!(attribute(pool, USED_HIGH), 4096);
        assert_eq!(cuMemFreeAsync(a, s), 1, "a double free");

        // With a threshold the pool keeps freed blocks and hands them out again.
        let mut keep = u64::MAX;
        assert_eq!(
            cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD, (&raw mut keep).cast()),
            0
        );
        assert_eq!(cuMemAllocAsync(&mut a, 8192, s), 0);
        assert_eq!(cuMemFreeAsync(a, s), 0);
        assert_eq!(attribute(pool, RESERVED_CURRENT), 8192);
        assert_eq!(attribute(pool, USED_CURRENT), 0);
        let mut b = 0u64;
        assert_eq!(cuMemAllocAsync(&mut b, 8000, s), 0);
        assert_eq!(b, a, "the kept block is reused");
        assert_eq!(attribute(pool, USED_CURRENT), 8192);
        assert_eq!(cuMemFreeAsync(b, s), 0);
        assert_eq!(cuMemPoolTrimTo(pool, 0), 0);
        assert_eq!(attribute(pool, RESERVED_CURRENT), 0);
        let mut zero = 0u64;
        assert_eq!(
            cuMemPoolSetAttribute(pool, USED_HIGH, (&raw mut zero).cast()),
            0
        );
        assert_eq!(attribute(pool, USED_HIGH), 0);
        let mut one = 1u64;
        assert_eq!(
            cuMemPoolSetAttribute(pool, USED_HIGH, (&raw mut one).cast()),
            1,
            "only reset to 0"
        );
        assert_eq!(
            cuMemPoolSetAttribute(pool, USED_CURRENT, (&raw mut zero).cast()),
            1,
            "read-only"
        );

        // An explicit pool.
        let mut mine: Handle = null_mut();
        assert_eq!(
            cuMemPoolCreate(&mut mine, &pinned_props(1)),
            801,
            "IPC handles"
        );
        let mut wrong = pinned_props(0);
        wrong.location_id = 3;
        assert_eq!(cuMemPoolCreate(&mut mine, &wrong), 101);
        assert_eq!(cuMemPoolCreate(&mut mine, &pinned_props(0)), 0);
        assert_eq!(cuMemAllocFromPoolAsync(&mut b, 256, mine, s), 0);
        assert_eq!(
            cuMemAllocFromPoolAsync(&mut b, 256, ctx, s),
            1,
            "not a pool"
        );
        assert_eq!(attribute(mine, USED_CURRENT), 256);
        assert_eq!(attribute(pool, USED_CURRENT), 0);
        assert_eq!(cuDeviceSetMemPool(0, mine), 0);
        assert_eq!(cuMemAllocAsync(&mut a, 128, s), 0);
        assert_eq!(attribute(mine, USED_CURRENT), 384);
        let rw = AccessDesc {
            location_type: 1,
            location_id: 0,
            flags: 3,
        };
        assert_eq!(cuMemPoolSetAccess(mine, &rw, 1), 0);
        let none = AccessDesc { flags: 0, ..rw };
        assert_eq!(
            cuMemPoolSetAccess(mine, &none, 1),
            1,
            "the own device's access"
        );
        let mut flags = 0;
        assert_eq!(cuMemPoolGetAccess(&mut flags, mine, &[1, 0]), 0);
        assert_eq!(flags, 3);
        assert_eq!(cuMemPoolDestroy(pool), 1, "the default pool");
        assert_eq!(cuMemPoolDestroy(mine), 0);
        assert_eq!(cuMemPoolDestroy(mine), 1);
        // Its allocations outlive it until freed.
        assert_eq!(cuMemsetD32Async(b, 1, 64, s), 0);
        assert_eq!(cuMemFreeAsync(b, s), 0);
        assert_eq!(cuMemFreeAsync(a, s), 0);
        assert_eq!(cuDeviceGetMemPool(&mut current, 0), 0);
        assert_eq!(current, pool, "back to the default pool");

        // Captured: an allocation node and a free node; the memory lives with the graph.
        assert_eq!(cuStreamBeginCapture_v2(s, 0), 0);
        assert_eq!(cuMemAllocAsync(&mut a, 1024, s), 0);
        assert_eq!(cuMemsetD32Async(a, 5, 256, s), 0);
        assert_eq!(cuMemFreeAsync(a, s), 0);
        let mut g: Handle = null_mut();
        assert_eq!(cuStreamEndCapture(s, &mut g), 0);
        let mut nodes = [null_mut(); 3];
        let mut n = 3usize;
        assert_eq!(cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n), 0);
        let mut kinds = [0; 3];
        for (k, node) in kinds.iter_mut().zip(nodes) {
            assert_eq!(cuGraphNodeGetType(node, k), 0);
        }
        assert_eq!(kinds, [10, 2, 11], "allocation, memset, free");
        let mut used = 0u64;
        assert_eq!(cuDeviceGetGraphMemAttribute(0, 0, &mut used), 0);
        assert_eq!(used, 1024);
        let mut exec: Handle = null_mut();
        assert_eq!(cuGraphInstantiateWithFlags(&mut exec, g, 0), 0);
        assert_eq!(cuGraphDestroy(g), 0);
        assert_eq!(cuGraphLaunch(exec, s), 0);
        assert_eq!(cuStreamSynchronize(s), 0);
        assert_eq!(cuGraphExecDestroy(exec), 0);
        assert_eq!(cuDeviceGetGraphMemAttribute(0, 0, &mut used), 0);
        assert_eq!(used, 0, "freed with the last graph holding it");
        assert_eq!(cuDeviceGetGraphMemAttribute(0, 9, &mut used), 1);
        // An allocation the graph does not free: freed outside it before each next launch
        // (cuMemFree or in stream order), its address the graph's throughout.
        assert_eq!(cuStreamBeginCapture_v2(s, 0), 0);
        assert_eq!(cuMemAllocAsync(&mut a, 1024, s), 0);
        assert_eq!(cuMemsetD32Async(a, 7, 256, s), 0);
        assert_eq!(cuStreamEndCapture(s, &mut g), 0);
        assert_eq!(cuGraphInstantiateWithFlags(&mut exec, g, 0), 0);
        assert_eq!(cuMemFree_v2(a), 1, "not allocated before a launch");
        assert_eq!(cuGraphLaunch(exec, s), 0);
        assert_eq!(cuStreamSynchronize(s), 0);
        let mut word = 0u32;
        assert_eq!(cuMemcpyDtoH_v2((&raw mut word).cast(), a + 1020, 4), 0);
        assert_eq!(word, 7, "usable outside the graph until freed");
        assert_eq!(cuGraphLaunch(exec, s), 1, "its allocation is not freed yet");
        assert_eq!(cuMemFree_v2(a), 0);
        assert_eq!(cuMemFree_v2(a), 1, "a double free");
        assert_eq!(cuGraphLaunch(exec, s), 0);
        assert_eq!(cuMemFreeAsync(a, s), 0);
        assert_eq!(cuGraphLaunch(exec, s), 0);
        assert_eq!(cuStreamSynchronize(s), 0);
        assert_eq!(cuGraphExecDestroy(exec), 0);
        assert_eq!(cuGraphDestroy(g), 0);
        assert_eq!(cuDeviceGetGraphMemAttribute(0, 0, &mut used), 0);
        assert_eq!(used, 0, "gone with its graphs");
        // An allocation in an invalidated capture is refused and holds nothing.
        assert_eq!(cuStreamBeginCapture_v2(s, 0), 0);
        assert_eq!(cuStreamSynchronize(s), 900);
        assert_eq!(cuMemAllocAsync(&mut a, 1024, s), 901);
        assert_eq!(cuStreamEndCapture(s, &mut g), 901);
        assert_eq!(cuDeviceGetGraphMemAttribute(0, 0, &mut used), 0);
        assert_eq!(used, 0);

        // Virtual memory management: a physical allocation mapped into a reservation keeps
        // its contents across an unmap and a map elsewhere.
        assert_eq!(cuDeviceGetAttribute(&mut v, 102, 0), 0);
        assert_eq!(v, 1, "virtual memory management supported");
        let mut gran = 0usize;
        let prop = alloc_prop(0);
        assert_eq!(cuMemGetAllocationGranularity(&mut gran, &prop, 0), 0);
        assert_eq!(gran, 2 << 20);
        assert_eq!(
            cuMemGetAllocationGranularity(&mut gran, &alloc_prop(2), 0),
            801
        );
        let (mut r1, mut r2) = (0u64, 0u64);
        assert_eq!(
            cuMemAddressReserve(&mut r1, gran + 1, 0, 0, 0),
            1,
            "not granular"
        );
        assert_eq!(cuMemAddressReserve(&mut r1, 2 * gran, 0, 0, 0), 0);
        assert_eq!(cuMemAddressReserve(&mut r2, gran, 0, 0, 0), 0);
        let mut h = 0u64;
        assert_eq!(cuMemCreate(&mut h, 100, &prop, 0), 1, "not granular");
        assert_eq!(cuMemCreate(&mut h, gran, &alloc_prop(1), 0), 801, "IPC");
        assert_eq!(cuMemCreate(&mut h, gran, &prop, 0), 0);
        assert_eq!(cuMemMap(r1 + 4096, gran, 0, h, 0), 1, "not at a granule");
        assert_eq!(cuMemMap(r1, gran, 4096, h, 0), 1, "an offset");
        assert_eq!(
            cuMemMap(r1 + gran as u64, 2 * gran, 0, h, 0),
            1,
            "past the reservation"
        );
        assert_eq!(cuMemMap(r1, gran, 0, h + 1, 0), 1, "not a handle");
        assert_eq!(cuMemMap(r1, gran, 0, h, 0), 0);
        assert_eq!(cuMemMap(r2, gran, 0, h, 0), 801, "mapped twice");
        let mut access = 9u64;
        assert_eq!(cuMemGetAccess(&mut access, &[1, 0], r1), 0);
        assert_eq!(access, 0, "no access before cuMemSetAccess");
        let rw = AccessDesc {
            location_type: 1,
            location_id: 0,
            flags: 3,
        };
        assert_eq!(cuMemSetAccess(r1, gran, &rw, 1), 0);
        assert_eq!(
            cuMemSetAccess(r1 + gran as u64, gran, &rw, 1),
            1,
            "unmapped"
        );
        assert_eq!(cuMemGetAccess(&mut access, &[1, 0], r1 + 100), 0);
        assert_eq!(access, 3);
        let data: Vec<u32> = (0..1024).collect();
        assert_eq!(cuMemcpyHtoD_v2(r1 + 64, data.as_ptr().cast(), 4096), 0);
        let mut again = 0u64;
        assert_eq!(
            cuMemRetainAllocationHandle(&mut again, (r1 + 8) as *mut c_void),
            0
        );
        assert_eq!(again, h);
        assert_eq!(cuMemRelease(again), 0);
        let mut p = alloc_prop(5);
        assert_eq!(cuMemGetAllocationPropertiesFromHandle(&mut p, h), 0);
        assert_eq!((p.kind, p.handle_types, p.location_id), (1, 0, 0));
        assert_eq!(cuMemUnmap(r1, 2 * gran), 1, "not all mapped");
        assert_eq!(cuMemAddressFree(r1, 2 * gran), 1, "still mapped");
        assert_eq!(cuMemUnmap(r1, gran), 0);
        assert_eq!(cuMemMap(r2, gran, 0, h, 0), 0, "mapped elsewhere now");
        let mut back = vec![0u32; 1024];
        assert_eq!(cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), r2 + 64, 4096), 0);
        assert_eq!(back, data, "the contents moved with the mapping");
        assert_eq!(cuMemRelease(h), 0, "the mapping still holds it");
        assert_eq!(cuMemUnmap(r2, gran), 0);
        assert_eq!(cuMemRelease(h), 1, "gone with its last mapping");
        assert_eq!(cuMemAddressFree(r1, gran), 1, "not the whole reservation");
        assert_eq!(cuMemAddressFree(r1, 2 * gran), 0);
        assert_eq!(cuMemAddressFree(r2, gran), 0);
        assert_eq!(cuMemAddressFree(r2, gran), 1, "freed twice");
    }
    host.close();
}
