//! The C entry points of CUDA graphs and stream capture. A graph ([`crate::graph`]) is kept in
//! the guest; launching its executable form issues its nodes, in a topological order, on the
//! launch's stream, through the same calls a program's own stream work goes through
//! ([`issue`]). While a stream captures, that work becomes nodes of the capture's graph
//! instead ([`submit`] is the one place stream work passes through).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use super::*;
use crate::array::{Copy3D, MEMCPY3D_BYTES, Memory, Side};
use crate::graph::{Graph, HostFn, MAX_DEPTH, MAX_NODES, Op};

/// `CUresult` values of stream capture and graph update.
pub(super) const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
pub(super) const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
pub(super) const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CUresult = 901;
pub(super) const CUDA_ERROR_STREAM_CAPTURE_MERGE: CUresult = 902;
pub(super) const CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: CUresult = 903;
pub(super) const CUDA_ERROR_STREAM_CAPTURE_UNJOINED: CUresult = 904;
pub(super) const CUDA_ERROR_STREAM_CAPTURE_ISOLATION: CUresult = 905;
pub(super) const CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: CUresult = 908;
pub(super) const CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE: CUresult = 910;

/// Graphs and executable graphs alive at once in the process (child graphs included): each
/// is guest bookkeeping, and a program holding more is leaking them.
const MAX_GRAPHS: usize = 4096;

/// Handle tags: a graph, an executable graph and a node handle never look alike.
const GRAPH_TAG: u64 = 0x4752 << 48;
const EXEC_TAG: u64 = 0x4558 << 48;
const NODE_TAG: u64 = 0x4E44 << 48;
/// A node handle is its graph's serial above this many bits of node index.
const NODE_INDEX_BITS: u32 = 17;
const _: () = assert!(MAX_NODES < 1 << NODE_INDEX_BITS);
/// Largest graph serial, so a node handle keeps its tag.
const MAX_SERIAL: u64 = (1 << (48 - NODE_INDEX_BITS)) - 1;

/// `CUstreamCaptureStatus` and `CUstreamCaptureMode`.
const CAPTURE_STATUS_NONE: c_int = 0;
const CAPTURE_STATUS_ACTIVE: c_int = 1;
const CAPTURE_STATUS_INVALIDATED: c_int = 2;
const CAPTURE_MODE_GLOBAL: c_int = 0;
const CAPTURE_MODE_RELAXED: c_int = 2;
/// `cuStreamUpdateCaptureDependencies` flags: add to, or replace, the dependencies.
const CAPTURE_ADD: c_uint = 0;
const CAPTURE_SET: c_uint = 1;

/// An executable graph: a copy of its graph, child graphs inlined.
struct Exec {
    /// The graph it was made from: its node handles name the nodes here too.
    source: u64,
    graph: Graph,
    flags: u64,
    /// Nodes disabled (`cuGraphNodeSetEnabled`): they do nothing when the graph runs.
    disabled: HashSet<usize>,
}

/// A capture sequence as one of its streams sees it.
struct Capture {
    id: u64,
    graph: u64,
    /// The nodes the stream's next work depends on.
    deps: Vec<usize>,
    mode: c_int,
    /// The stream the capture began on (only it may end it).
    origin: bool,
    /// Whether the capture made its graph (not `cuStreamBeginCaptureToGraph`'s): a failed
    /// capture destroys only a graph of its own.
    own_graph: bool,
    thread: std::thread::ThreadId,
    invalidated: bool,
    /// What `cuStreamGetCaptureInfo` last handed out (valid until the next call on the stream).
    handed: Box<[u64]>,
    zero_edges: Box<[[u8; 8]]>,
}

/// An event recorded in a capturing stream: the capture and the nodes it stands for.
struct CapturedEvent {
    id: u64,
    nodes: Vec<usize>,
}

/// A graph allocation: freed when no graph or executable graph holds its node any more. Its
/// address is the graph's for that long; to the program it is allocated from a launch that
/// runs its node until a free node, `cuMemFree` or `cuMemFreeAsync` frees it.
struct GraphAlloc {
    ctx: u64,
    bytes: u64,
    holders: usize,
    /// Allocated by a launch and not freed since.
    live: bool,
}

#[derive(Default)]
struct State {
    next: u64,
    graphs: HashMap<u64, Graph>,
    /// Graphs owned by a child-graph node (not the program's to destroy).
    children: HashSet<u64>,
    execs: HashMap<u64, Exec>,
    /// Capturing streams.
    captures: HashMap<u64, Capture>,
    events: HashMap<u64, CapturedEvent>,
    allocs: HashMap<u64, GraphAlloc>,
    /// `CU_GRAPH_MEM_ATTR_USED_MEM_*`: bytes held by graph allocations, now and at most.
    used: u64,
    used_high: u64,
    /// The `kernelParams` arrays `cuGraphKernelNodeGetParams` handed out, by node.
    handed_args: HashMap<u64, Vec<usize>>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

thread_local! {
    /// `cuThreadExchangeStreamCaptureMode`'s mode of this thread.
    static THREAD_MODE: std::cell::Cell<c_int> = const { std::cell::Cell::new(CAPTURE_MODE_GLOBAL) };
}

fn state<R>(f: impl FnOnce(&mut State) -> CuResult<R>) -> CuResult<R> {
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(State::default))
}

fn node_handle(graph: u64, index: usize) -> u64 {
    NODE_TAG | (graph & !GRAPH_TAG) << NODE_INDEX_BITS | index as u64
}

/// The graph and index a node handle names.
fn node_of(node: Handle) -> CuResult<(u64, usize)> {
    let h = node as u64;
    if h & (0xFFFF << 48) != NODE_TAG {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let index = (h & ((1 << NODE_INDEX_BITS) - 1)) as usize;
    Ok((GRAPH_TAG | (h & !NODE_TAG) >> NODE_INDEX_BITS, index))
}

impl State {
    fn serial(&mut self) -> CuResult<u64> {
        if self.graphs.len() + self.execs.len() >= MAX_GRAPHS || self.next >= MAX_SERIAL {
            refused(&format!(
                "more than {MAX_GRAPHS} graphs and executable graphs at once"
            ));
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        self.next += 1;
        Ok(self.next)
    }

    fn insert(&mut self, g: Graph) -> CuResult<u64> {
        let h = GRAPH_TAG | self.serial()?;
        self.graphs.insert(h, g);
        Ok(h)
    }

    fn graph(&self, h: u64) -> CuResult<&Graph> {
        self.graphs.get(&h).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    fn graph_mut(&mut self, h: u64) -> CuResult<&mut Graph> {
        self.graphs.get_mut(&h).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    fn exec_mut(&mut self, h: Handle) -> CuResult<&mut Exec> {
        self.execs
            .get_mut(&(h as u64))
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// What a launch of `op` does to its graph allocations: an allocation node allocates
    /// (refused with CUDA_ERROR_INVALID_VALUE, as by CUDA, while the last launch's allocation
    /// is not freed yet), a free node frees. Checked in full before anything changes.
    fn run_allocations(&mut self, op: &Op) -> CuResult<()> {
        fn walk(op: &Op, f: &mut impl FnMut(&Op) -> CuResult<()>) -> CuResult<()> {
            match op {
                Op::Inline(ops) => ops.iter().try_for_each(|o| walk(o, f)),
                o => f(o),
            }
        }
        walk(op, &mut |o| match o {
            Op::MemAlloc { dptr, .. } if self.allocs.get(dptr).is_some_and(|a| a.live) => {
                refused(&format!(
                    "graph launch: its allocation {dptr:#x} is not freed since the last launch"
                ));
                Err(CUDA_ERROR_INVALID_VALUE)
            }
            _ => Ok(()),
        })?;
        walk(op, &mut |o| {
            let (dptr, live) = match o {
                Op::MemAlloc { dptr, .. } => (dptr, true),
                Op::MemFree { dptr } => (dptr, false),
                _ => return Ok(()),
            };
            if let Some(a) = self.allocs.get_mut(dptr) {
                a.live = live;
            }
            Ok(())
        })
    }

    /// A new holder of the allocations in `op`.
    fn retain(&mut self, op: &Op) {
        match op {
            Op::MemAlloc { dptr, .. } => {
                if let Some(a) = self.allocs.get_mut(dptr) {
                    a.holders += 1;
                }
            }
            Op::Inline(ops) => ops.iter().for_each(|o| self.retain(o)),
            _ => {}
        }
    }

    /// Lets go of what `op` holds: child graphs are destroyed, allocations without holders
    /// are returned as (context, address) for the caller to free outside the lock.
    fn release(&mut self, op: Op, frees: &mut Vec<(u64, u64)>) {
        match op {
            Op::MemAlloc { dptr, .. } => {
                if let Some(a) = self.allocs.get_mut(&dptr) {
                    a.holders -= 1;
                    if a.holders == 0 {
                        let a = self.allocs.remove(&dptr).expect("present");
                        self.used -= a.bytes;
                        frees.push((a.ctx, dptr));
                    }
                }
            }
            Op::Child(h) => {
                self.children.remove(&h);
                self.destroy(h, frees);
            }
            Op::Inline(ops) => ops.into_iter().for_each(|o| self.release(o, frees)),
            _ => {}
        }
    }

    fn release_graph(&mut self, g: Graph, frees: &mut Vec<(u64, u64)>) {
        let mut g = g;
        for i in g.nodes() {
            if let Ok(op) = g.remove(i) {
                self.release(op, frees);
            }
        }
    }

    fn destroy(&mut self, h: u64, frees: &mut Vec<(u64, u64)>) {
        if let Some(g) = self.graphs.remove(&h) {
            self.release_graph(g, frees);
        }
        self.handed_args
            .retain(|&n, _| node_of(n as Handle).map(|(g, _)| g) != Ok(h));
    }

    /// A deep copy of graph `h`: its child graphs copied into graphs of their own.
    fn clone_graph(&mut self, h: u64, depth: usize) -> CuResult<Graph> {
        if depth > MAX_DEPTH {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut g = self.graph(h)?.clone();
        for i in g.nodes() {
            let op = g.op(i)?.clone();
            match op {
                Op::Child(c) => {
                    let copy = self.clone_graph(c, depth + 1)?;
                    let ch = self.insert(copy)?;
                    self.children.insert(ch);
                    *g.op_mut(i)? = Op::Child(ch);
                }
                op => self.retain(&op),
            }
        }
        Ok(g)
    }

    /// The nodes of graph `h` in issue order, child graphs inlined.
    fn flatten(&self, h: u64, depth: usize) -> CuResult<Vec<Op>> {
        let g = self.graph(h)?;
        g.order()
            .into_iter()
            .map(|i| self.inline(g.op(i)?, depth))
            .collect()
    }

    fn inline(&self, op: &Op, depth: usize) -> CuResult<Op> {
        match op {
            Op::Child(c) if depth < MAX_DEPTH => Ok(Op::Inline(self.flatten(*c, depth + 1)?)),
            Op::Child(_) => Err(CUDA_ERROR_INVALID_VALUE),
            op => Ok(op.clone()),
        }
    }

    /// Graph `h` as an executable graph holds it: its own nodes and edges, each child graph
    /// replaced by its nodes in issue order.
    fn instantiate(&mut self, h: u64) -> CuResult<Graph> {
        let mut g = self.graph(h)?.clone();
        for i in g.nodes() {
            let op = self.inline(g.op(i)?, 0)?;
            self.retain(&op);
            *g.op_mut(i)? = op;
        }
        Ok(g)
    }

    /// Ends every capture of sequence `id`, returning its graph handle.
    fn end_sequence(&mut self, id: u64) -> Option<u64> {
        let streams: Vec<u64> = self
            .captures
            .iter()
            .filter(|(_, c)| c.id == id)
            .map(|(&s, _)| s)
            .collect();
        let graph = streams
            .iter()
            .find_map(|s| self.captures.get(s).map(|c| c.graph));
        for s in streams {
            self.captures.remove(&s);
        }
        self.events.retain(|_, e| e.id != id);
        graph
    }

    fn invalidate(&mut self, id: u64) {
        for c in self.captures.values_mut().filter(|c| c.id == id) {
            c.invalidated = true;
        }
    }
}

/// Frees graph allocations no graph holds any more.
fn free_all(frees: Vec<(u64, u64)>) -> CuResult<()> {
    let mut first = Ok(());
    for (ctx, dptr) in frees {
        if let Err(e) = with(|d| d.mem_free(ctx, dptr)) {
            first = first.and(Err(e));
        }
    }
    first
}

// Issuing work, and capturing it.

/// The largest handle of the legacy NULL stream: 0, and `CU_STREAM_LEGACY` (1). The
/// per-thread default stream (`CU_STREAM_PER_THREAD`, 2) is a stream of its own that may be
/// captured (and that the legacy stream synchronises with).
const LEGACY_STREAM: u64 = 1;

/// `CU_STREAM_NON_BLOCKING`: a stream the legacy NULL stream does not synchronise with.
const STREAM_NON_BLOCKING: u32 = 1;

/// Work on the legacy NULL stream synchronises with every blocking stream of its context, so
/// it cannot be issued while one of them captures (outside relaxed mode): CUDA invalidates
/// those captures and answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`.
fn check_implicit(stream: Handle) -> CuResult<()> {
    if stream as u64 > LEGACY_STREAM {
        return Ok(());
    }
    let capturing: Vec<(u64, u64)> = state(|s| {
        Ok(s.captures
            .iter()
            .filter(|(_, c)| c.mode != CAPTURE_MODE_RELAXED)
            .map(|(&st, c)| (st, c.id))
            .collect())
    })?;
    let mut hit = Vec::new();
    for (st, id) in capturing {
        if stream_settings(st as Handle)?.flags & STREAM_NON_BLOCKING == 0 {
            hit.push(id);
        }
    }
    if hit.is_empty() {
        return Ok(());
    }
    state(|s| {
        hit.into_iter().for_each(|id| s.invalidate(id));
        Ok(())
    })?;
    refused("work on the legacy stream while a blocking stream captures");
    Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
}

/// Stream work: recorded as a node when `stream` captures, else issued now.
pub(super) fn submit(stream: Handle, op: impl FnOnce(u64) -> CuResult<Op>) -> CuResult<()> {
    let ctx = owner(stream)?;
    check_implicit(stream)?;
    let op = op(ctx)?;
    match capture(stream, op)? {
        Some(op) => issue(&op, stream),
        None => Ok(()),
    }
}

/// Adds `op` to the capture of `stream` (after the stream's current dependencies), or gives
/// it back when the stream does not capture.
fn capture(stream: Handle, op: Op) -> CuResult<Option<Op>> {
    let added = state(|s| {
        let Some(c) = s.captures.get(&(stream as u64)) else {
            return Ok(None);
        };
        if c.invalidated {
            return Ok(Some(Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)));
        }
        let (graph, deps) = (c.graph, c.deps.clone());
        let node = match s.graph_mut(graph)?.add(op.clone(), &deps) {
            Ok(n) => n,
            Err(e) => return Ok(Some(Err(e))),
        };
        s.retain(&op);
        if let Some(c) = s.captures.get_mut(&(stream as u64)) {
            c.deps = vec![node];
        }
        Ok(Some(Ok(())))
    })?;
    match added {
        None => Ok(Some(op)),
        Some(Ok(())) => Ok(None),
        Some(Err(e)) => {
            // Not added (an invalidated capture, a full graph): what the op holds goes.
            discard(op)?;
            Err(e)
        }
    }
}

/// Issues one node's work on `stream`.
fn issue(op: &Op, stream: Handle) -> CuResult<()> {
    let s = stream as u64;
    match op {
        Op::Kernel {
            ctx,
            function,
            grid,
            block,
            shared,
            params,
            cooperative,
        } => with(|d| {
            d.launch(
                *ctx,
                *function,
                *grid,
                *block,
                *shared,
                s,
                params.clone(),
                *cooperative,
            )
        }),
        Op::Copy { copy } => crate::array_api::copy(*copy, stream),
        Op::Memset {
            dst,
            pitch,
            value,
            element_size,
            width,
            height,
        } => crate::array_api::memset_2d(
            *dst,
            *pitch,
            *value,
            *element_size,
            *width,
            *height,
            stream,
        ),
        Op::Host { func, data } => {
            let ctx = owner(stream)?;
            with(|d| d.stream_synchronize(ctx, s))?;
            // SAFETY: the program's host function with its own argument, called once when
            // the work before it on the stream is done, as a host node or
            // `cuLaunchHostFunc` promises (here on the launching thread, with no lock held).
            unsafe { func(*data as *mut c_void) };
            Ok(())
        }
        // The memory of a graph allocation exists for as long as a graph holds its node,
        // and a free node returns nothing before that; one in-order stream needs no wait.
        Op::Empty | Op::EventWait { .. } | Op::MemAlloc { .. } | Op::MemFree { .. } => Ok(()),
        Op::EventRecord { ctx, event } => with(|d| d.event_record(*ctx, *event, s)),
        Op::Inline(ops) => ops.iter().try_for_each(|o| issue(o, stream)),
        // Executable graphs hold their children inlined.
        Op::Child(_) => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

// Hooks of the stream entry points.

/// `cuEventRecord` on a capturing stream: the event stands for the stream's current
/// dependencies (no work is recorded). Returns whether it was captured.
pub(super) fn record_in_capture(event: Handle, stream: Handle) -> CuResult<bool> {
    state(|s| {
        let (e, st) = (event as u64, stream as u64);
        let Some(c) = s.captures.get(&st) else {
            s.events.remove(&e);
            return Ok(false);
        };
        if c.invalidated {
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        let captured = CapturedEvent {
            id: c.id,
            nodes: c.deps.clone(),
        };
        s.events.insert(e, captured);
        Ok(true)
    })
}

/// `cuStreamWaitEvent`: waiting on an event captured in a sequence joins `stream` to it (a
/// stream of that sequence gains the event's nodes as dependencies). Returns whether the
/// wait was part of a capture.
pub(super) fn wait_in_capture(stream: Handle, event: Handle) -> CuResult<bool> {
    state(|s| {
        let (st, e) = (stream as u64, event as u64);
        let captured = s.events.get(&e).map(|c| (c.id, c.nodes.clone()));
        match (s.captures.get_mut(&st), captured) {
            (Some(c), Some((id, nodes))) if c.id == id => {
                for n in nodes {
                    if !c.deps.contains(&n) {
                        c.deps.push(n);
                    }
                }
                Ok(true)
            }
            (Some(c), Some(_)) => {
                let id = c.id;
                s.invalidate(id);
                Err(CUDA_ERROR_STREAM_CAPTURE_MERGE)
            }
            (Some(c), None) => {
                // An event from outside the capture: a graph cannot depend on it.
                let id = c.id;
                s.invalidate(id);
                refused("cuStreamWaitEvent in a capture on an event recorded outside it");
                Err(CUDA_ERROR_STREAM_CAPTURE_ISOLATION)
            }
            (None, Some((id, nodes))) => {
                if st <= LEGACY_STREAM {
                    // The legacy stream cannot be captured.
                    s.invalidate(id);
                    return Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
                }
                let origin = s
                    .captures
                    .values()
                    .find(|c| c.id == id)
                    .map(|c| (c.graph, c.mode, c.thread))
                    .ok_or(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)?;
                s.captures.insert(
                    st,
                    Capture {
                        id,
                        graph: origin.0,
                        deps: nodes,
                        mode: origin.1,
                        origin: false,
                        own_graph: false,
                        thread: origin.2,
                        invalidated: false,
                        handed: Box::new([]),
                        zero_edges: Box::new([]),
                    },
                );
                Ok(true)
            }
            (None, None) => Ok(false),
        }
    })
}

/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`: the legacy stream touched a capture.
pub(super) const CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: CUresult = 906;

/// A synchronisation of `stream` (or, for `None`, of the whole context): refused while what it
/// would wait for captures, which invalidates the capture, as CUDA does.
pub(super) fn check_sync(stream: Option<Handle>) -> CuResult<()> {
    state(|s| {
        let ids: Vec<u64> = match stream {
            Some(st) => s
                .captures
                .get(&(st as u64))
                .map(|c| c.id)
                .into_iter()
                .collect(),
            // A thread in relaxed mode may synchronise the context.
            None if THREAD_MODE.with(|m| m.get()) == CAPTURE_MODE_RELAXED => Vec::new(),
            None => s
                .captures
                .values()
                .filter(|c| c.mode != CAPTURE_MODE_RELAXED)
                .map(|c| c.id)
                .collect(),
        };
        if ids.is_empty() {
            return Ok(());
        }
        ids.into_iter().for_each(|id| s.invalidate(id));
        refused("a synchronisation of a capturing stream");
        Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    })
}

/// A stream-ordered allocation on a capturing stream becomes a graph allocation node; the
/// memory is made now (so the address can be handed out) and lives as long as a graph
/// holds the node. `None` when the stream does not capture.
pub(super) fn capture_alloc(stream: Handle, bytes: u64) -> CuResult<Option<u64>> {
    if !state(|s| Ok(s.captures.contains_key(&(stream as u64))))? {
        return Ok(None);
    }
    let ctx = owner(stream)?;
    let dptr = new_graph_alloc(ctx, bytes)?;
    capture(stream, Op::MemAlloc { dptr, bytes }).map(|_| Some(dptr))
}

/// A stream-ordered free on a capturing stream: a graph free node. Whether it was captured.
pub(super) fn capture_free(stream: Handle, dptr: u64) -> CuResult<bool> {
    capture(stream, Op::MemFree { dptr }).map(|back| back.is_none())
}

/// A graph allocation of `bytes`, held by nobody yet.
fn new_graph_alloc(ctx: u64, bytes: u64) -> CuResult<u64> {
    let dptr = with(|d| d.mem_alloc(ctx, bytes))?;
    state(|s| {
        s.allocs.insert(
            dptr,
            GraphAlloc {
                ctx,
                bytes,
                holders: 0,
                live: false,
            },
        );
        s.used = s.used.saturating_add(bytes);
        s.used_high = s.used_high.max(s.used);
        Ok(())
    })?;
    Ok(dptr)
}

// Reading node parameters.

/// `CUDA_KERNEL_NODE_PARAMS` (v1), the start of the v2 and v3 forms.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct KernelParams {
    func: Handle,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
}

/// `CUDA_KERNEL_NODE_PARAMS_v2`: a `CUkernel` when `func` is NULL, and its context.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct KernelParamsV2 {
    base: KernelParams,
    kern: Handle,
    ctx: Handle,
}

/// `CUDA_MEMCPY3D`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Memcpy3dParams {
    src_x: usize,
    src_y: usize,
    src_z: usize,
    src_lod: usize,
    src_type: c_uint,
    src_host: *const c_void,
    src_device: u64,
    src_array: Handle,
    reserved0: Handle,
    src_pitch: usize,
    src_height: usize,
    dst_x: usize,
    dst_y: usize,
    dst_z: usize,
    dst_lod: usize,
    dst_type: c_uint,
    dst_host: *mut c_void,
    dst_device: u64,
    dst_array: Handle,
    reserved1: Handle,
    dst_pitch: usize,
    dst_height: usize,
    width: usize,
    height: usize,
    depth: usize,
}

/// `CUDA_MEMSET_NODE_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MemsetParams {
    dst: u64,
    pitch: usize,
    value: c_uint,
    element_size: c_uint,
    width: usize,
    height: usize,
}

/// `CUDA_HOST_NODE_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct HostParams {
    func: Option<HostFn>,
    data: *mut c_void,
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (v1 and v2 alike): the pool properties start with the
/// allocation type and the location.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MemAllocParams {
    alloc_type: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    pool_rest: [u8; 72],
    access: *const c_void,
    access_count: usize,
    bytes: usize,
    dptr: u64,
}

/// `CUmemorytype`.
const MEMORYTYPE_HOST: c_uint = 1;
const MEMORYTYPE_DEVICE: c_uint = 2;
const MEMORYTYPE_ARRAY: c_uint = 3;
const MEMORYTYPE_UNIFIED: c_uint = 4;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`, `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(super) const ALLOCATION_PINNED: c_int = 1;
pub(super) const LOCATION_DEVICE: c_int = 1;

/// A context argument of a node: the given one, else the current one.
fn node_context(ctx: Handle) -> CuResult<u64> {
    if ctx.is_null() {
        return current();
    }
    let c = ctx as u64;
    if with(|d| Ok(d.is_context(c)))? {
        Ok(c)
    } else {
        Err(CUDA_ERROR_INVALID_CONTEXT)
    }
}

fn kernel_op(p: &KernelParams, kern: Handle, ctx: Handle) -> CuResult<Op> {
    let (handle, ctx) = if p.func.is_null() {
        (kern, node_context(ctx)?)
    } else {
        (p.func, current()?)
    };
    if handle.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let function = with(|d| d.resolve_function(handle as u64, Some(ctx)))?;
    let params = launch_params(function, p.kernel_params, p.extra)?;
    Ok(Op::Kernel {
        ctx,
        function,
        grid: p.grid,
        block: p.block,
        shared: p.shared,
        params,
        cooperative: false,
    })
}

/// A copy node's op from the `CUDA_MEMCPY3D` at `p`, checked as `cuMemcpy3D` checks one
/// (both sides inside their host range, allocation or array).
fn copy_op(p: *const c_void, ctx: Handle) -> CuResult<Op> {
    let ctx = node_context(ctx)?;
    let copy = Copy3D::from_3d(bytes(p, MEMCPY3D_BYTES)?)?;
    crate::array_api::check_copy(ctx, &copy)?;
    Ok(Op::Copy { copy })
}

fn memset_op(p: &MemsetParams, ctx: Handle) -> CuResult<Op> {
    node_context(ctx)?;
    let row = (p.width as u64)
        .checked_mul(u64::from(p.element_size))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if !matches!(p.element_size, 1 | 2 | 4)
        || p.dst % u64::from(p.element_size) != 0
        || (p.height > 1 && (p.pitch as u64) < row)
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(Op::Memset {
        dst: p.dst,
        pitch: p.pitch,
        value: p.value,
        element_size: u64::from(p.element_size),
        width: p.width,
        height: p.height,
    })
}

fn host_op(p: &HostParams) -> CuResult<Op> {
    Ok(Op::Host {
        func: p.func.ok_or(CUDA_ERROR_INVALID_VALUE)?,
        data: p.data as usize,
    })
}

fn event_record_op(event: Handle) -> CuResult<Op> {
    let ctx = owner(event)?;
    if (event as u64) <= 2 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(Op::EventRecord {
        ctx,
        event: event as u64,
    })
}

fn event_wait_op(event: Handle) -> CuResult<Op> {
    if (event as u64) <= 2 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    owner(event)?;
    Ok(Op::EventWait {
        event: event as u64,
    })
}

/// A graph allocation node's op and the address of its memory.
fn mem_alloc_op(p: &MemAllocParams) -> CuResult<(Op, u64)> {
    if p.alloc_type != ALLOCATION_PINNED
        || p.location_type != LOCATION_DEVICE
        || p.location_id != DEVICE
        || p.handle_types != 0
        || p.bytes == 0
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = current()?;
    let bytes = p.bytes as u64;
    let dptr = new_graph_alloc(ctx, bytes)?;
    Ok((Op::MemAlloc { dptr, bytes }, dptr))
}

// Graphs and nodes.

/// The nodes of `graph` in a caller's array of `n` node handles.
fn node_list(graph: u64, nodes: *const Handle, n: usize) -> CuResult<Vec<usize>> {
    if n > MAX_NODES {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    (0..n)
        .map(|i| {
            let (g, index) = node_of(read_at(nodes, i)?)?;
            if g != graph {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            Ok(index)
        })
        .collect()
}

/// Adds the node `op` to `graph` after `deps`, its handle written to `out`. Whatever the op
/// holds is let go again when it cannot be added.
fn add_node(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    op: Op,
) -> CuResult<()> {
    let g = graph as u64;
    let added = (|| {
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let deps = node_list(g, deps, n)?;
        state(|s| {
            let i = s.graph_mut(g)?.add(op.clone(), &deps)?;
            s.retain(&op);
            Ok(i)
        })
    })();
    match added {
        Ok(i) => put(out, node_handle(g, i) as Handle),
        Err(e) => {
            discard(op)?;
            Err(e)
        }
    }
}

/// Lets go of an op no graph holds: its child graph, its allocation.
fn discard(op: Op) -> CuResult<()> {
    let mut frees = Vec::new();
    state(|s| {
        s.retain(&op);
        s.release(op, &mut frees);
        Ok(())
    })?;
    free_all(frees)
}

entry!(cuGraphCreate(out: *mut Handle, flags: c_uint) {
    if flags != 0 || out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let h = state(|s| s.insert(Graph::default()))?;
    put(out, h as Handle)
});

entry!(cuGraphDestroy(graph: Handle) {
    let mut frees = Vec::new();
    state(|s| {
        let h = graph as u64;
        if s.children.contains(&h) || !s.graphs.contains_key(&h) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.destroy(h, &mut frees);
        Ok(())
    })?;
    free_all(frees)
});

entry!(cuGraphAddKernelNode_v2(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    params: *const KernelParamsV2,
) {
    let p = read_at(params, 0)?;
    add_node(out, graph, deps, n, kernel_op(&p.base, p.kern, p.ctx)?)
});

entry!(cuGraphAddKernelNode(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    params: *const KernelParams,
) {
    let p = read_at(params, 0)?;
    add_node(out, graph, deps, n, kernel_op(&p, std::ptr::null_mut(), std::ptr::null_mut())?)
});

entry!(cuGraphAddMemcpyNode(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    params: *const Memcpy3dParams,
    ctx: Handle,
) {
    add_node(out, graph, deps, n, copy_op(params.cast(), ctx)?)
});

entry!(cuGraphAddMemsetNode(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    params: *const MemsetParams,
    ctx: Handle,
) {
    add_node(out, graph, deps, n, memset_op(&read_at(params, 0)?, ctx)?)
});

entry!(cuGraphAddHostNode(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    params: *const HostParams,
) {
    add_node(out, graph, deps, n, host_op(&read_at(params, 0)?)?)
});

entry!(cuGraphAddEmptyNode(out: *mut Handle, graph: Handle, deps: *const Handle, n: usize) {
    add_node(out, graph, deps, n, Op::Empty)
});

entry!(cuGraphAddEventRecordNode(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    event: Handle,
) {
    add_node(out, graph, deps, n, event_record_op(event)?)
});

entry!(cuGraphAddEventWaitNode(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    event: Handle,
) {
    add_node(out, graph, deps, n, event_wait_op(event)?)
});

/// A child-graph node's op: a copy of `child`, owned by the node.
fn child_op(child: Handle) -> CuResult<Op> {
    state(|s| {
        let copy = s.clone_graph(child as u64, 1)?;
        let h = s.insert(copy)?;
        s.children.insert(h);
        Ok(Op::Child(h))
    })
}

entry!(cuGraphAddChildGraphNode(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    child: Handle,
) {
    if child == graph {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let op = child_op(child)?;
    add_node(out, graph, deps, n, op)
});

entry!(cuGraphAddMemAllocNode(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    params: *mut MemAllocParams,
) {
    let mut p = read_at(params, 0)?;
    // Checks the graph before making memory for it.
    state(|s| s.graph(graph as u64).map(drop))?;
    let (op, dptr) = mem_alloc_op(&p)?;
    add_node(out, graph, deps, n, op)?;
    p.dptr = dptr;
    put(params, p)
});

entry!(cuGraphAddMemFreeNode(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    dptr: u64,
) {
    let ctx = current()?;
    with(|d| d.address_range(ctx, dptr))?;
    add_node(out, graph, deps, n, Op::MemFree { dptr })
});

/// `CUgraphNodeParams`: the node type, then its parameters at offset 16.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct NodeParams {
    kind: c_int,
    reserved0: [c_int; 3],
    params: [u8; 232],
    reserved2: i64,
}

/// The op a `CUgraphNodeParams` describes.
fn op_of(p: &NodeParams) -> CuResult<Op> {
    let at = p.params.as_ptr().cast::<c_void>();
    match p.kind {
        0 => {
            let k: KernelParamsV2 = read_at(at.cast(), 0)?;
            kernel_op(&k.base, k.kern, k.ctx)
        }
        1 => {
            // CUDA_MEMCPY_NODE_PARAMS: flags, reserved, context, then the copy.
            let ctx: Handle = read_at(at.cast::<u8>().wrapping_add(8).cast(), 0)?;
            copy_op(at.cast::<u8>().wrapping_add(16).cast(), ctx)
        }
        2 => {
            let m: MemsetParams = read_at(at.cast(), 0)?;
            let ctx: Handle = read_at(at.cast::<u8>().wrapping_add(40).cast(), 0)?;
            memset_op(&m, ctx)
        }
        3 => host_op(&read_at(at.cast(), 0)?),
        4 => child_op(read_at(at.cast(), 0)?),
        5 => Ok(Op::Empty),
        6 => event_wait_op(read_at(at.cast(), 0)?),
        7 => event_record_op(read_at(at.cast(), 0)?),
        10 => mem_alloc_op(&read_at(at.cast(), 0)?).map(|(op, _)| op),
        11 => {
            let dptr: u64 = read_at(at.cast(), 0)?;
            let ctx = current()?;
            with(|d| d.address_range(ctx, dptr))?;
            Ok(Op::MemFree { dptr })
        }
        13 => {
            refused("graph conditional nodes (they need device-side cudaGraphSetConditional)");
            Err(CUDA_ERROR_NOT_SUPPORTED)
        }
        // External semaphores, batch memory operations, batch copies, the reserved, external
        // engine and fabric copy types.
        k @ (8 | 9 | 12 | 14 | 16..=18) => {
            refused(&format!(
                "graph nodes of type {k} (external semaphores, batch memory operations or copies)"
            ));
            Err(CUDA_ERROR_NOT_SUPPORTED)
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// `cuGraphAddNode` with the new node's allocation address written back.
fn add_generic(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    params: *mut NodeParams,
) -> CuResult<()> {
    let mut p = read_at(params, 0)?;
    state(|s| s.graph(graph as u64).map(drop))?;
    let op = op_of(&p)?;
    let dptr = match op {
        Op::MemAlloc { dptr, .. } => Some(dptr),
        _ => None,
    };
    add_node(out, graph, deps, n, op)?;
    if let Some(dptr) = dptr {
        // CUDA_MEM_ALLOC_NODE_PARAMS's dptr, at 112 in the union.
        p.params[112..120].copy_from_slice(&dptr.to_le_bytes());
        put(params, p)?;
    }
    Ok(())
}

/// Edge data must be absent or all default (zero): only full dependencies exist here.
fn default_edges(edges: *const [u8; 8], n: usize) -> CuResult<()> {
    if edges.is_null() {
        return Ok(());
    }
    for i in 0..n.min(MAX_NODES) {
        if read_at(edges, i)? != [0; 8] {
            refused("graph edges other than full dependencies (programmatic ports)");
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
    }
    Ok(())
}

entry!(cuGraphAddNode(out: *mut Handle, graph: Handle, deps: *const Handle, n: usize, params: *mut NodeParams) {
    add_generic(out, graph, deps, n, params)
});

// CUDA 13's `_v3` takes what `_v2` takes (edge data added in 12.3).
entry!(cuGraphAddNode_v2 | cuGraphAddNode_v3(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    edges: *const [u8; 8],
    n: usize,
    params: *mut NodeParams,
) {
    default_edges(edges, n)?;
    add_generic(out, graph, deps, n, params)
});

/// Replaces the op of `node` (in its graph) with `op`, of the same kind; the old one is let go.
fn set_op(node: Handle, op: Op) -> CuResult<()> {
    let (g, i) = node_of(node)?;
    let mut frees = Vec::new();
    state(|s| {
        let old = s.graph(g)?.op(i)?;
        if old.kind() != op.kind() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.retain(&op);
        let old = std::mem::replace(s.graph_mut(g)?.op_mut(i)?, op);
        s.release(old, &mut frees);
        Ok(())
    })?;
    free_all(frees)
}

/// The op of `node`.
fn op_at(node: Handle) -> CuResult<Op> {
    let (g, i) = node_of(node)?;
    state(|s| s.graph(g)?.op(i).cloned())
}

entry!(cuGraphNodeSetParams(node: Handle, params: *mut NodeParams) {
    let p = read_at(params, 0)?;
    if matches!(p.kind, 4 | 10 | 11) {
        // Child graphs and memory nodes cannot change after creation.
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    set_op(node, op_of(&p)?)
});

entry!(cuGraphNodeSetParams_v2(node: Handle, params: *mut NodeParams) {
    // SAFETY: the same arguments; the 13.4 form differs only in node types not supported here.
    status(unsafe { cuGraphNodeSetParams(node, params) })
});

entry!(cuGraphNodeGetType(node: Handle, kind: *mut c_int) {
    let op = op_at(node)?;
    put(kind, op.kind())
});

/// Writes `n` node handles of `graph` through `out` (up to `*count`) and the count; with a
/// NULL `out`, only the count.
fn put_nodes(graph: u64, nodes: &[usize], out: *mut Handle, count: *mut usize) -> CuResult<()> {
    let room = read_at(count.cast_const(), 0)?;
    if !out.is_null() {
        for (i, &n) in nodes.iter().take(room).enumerate() {
            // SAFETY: the caller's array has `*count` entries (the API's contract).
            put(unsafe { out.add(i) }, node_handle(graph, n) as Handle)?;
        }
        for i in nodes.len()..room {
            // SAFETY: as above; entries past the nodes are set to NULL, as CUDA does.
            put(unsafe { out.add(i) }, std::ptr::null_mut())?;
        }
        put(count, nodes.len().min(room))
    } else {
        put(count, nodes.len())
    }
}

entry!(cuGraphGetNodes(graph: Handle, out: *mut Handle, count: *mut usize) {
    let nodes = state(|s| Ok(s.graph(graph as u64)?.nodes()))?;
    put_nodes(graph as u64, &nodes, out, count)
});

entry!(cuGraphGetRootNodes(graph: Handle, out: *mut Handle, count: *mut usize) {
    let nodes = state(|s| Ok(s.graph(graph as u64)?.roots()))?;
    put_nodes(graph as u64, &nodes, out, count)
});

/// The edges of `graph` through `from`/`to` (up to `*count`), zero edge data through `edges`.
fn get_edges(
    graph: Handle,
    from: *mut Handle,
    to: *mut Handle,
    edges: *mut [u8; 8],
    count: *mut usize,
) -> CuResult<()> {
    let g = graph as u64;
    let all = state(|s| Ok(s.graph(g)?.edges()))?;
    if from.is_null() != to.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if from.is_null() {
        return put(count, all.len());
    }
    let room = read_at(count.cast_const(), 0)?;
    for (i, &(a, b)) in all.iter().take(room).enumerate() {
        // SAFETY: the caller's arrays have `*count` entries (the API's contract).
        unsafe {
            put(from.add(i), node_handle(g, a) as Handle)?;
            put(to.add(i), node_handle(g, b) as Handle)?;
            if !edges.is_null() {
                put(edges.add(i), [0; 8])?;
            }
        }
    }
    put(count, all.len().min(room))
}

entry!(cuGraphGetEdges(graph: Handle, from: *mut Handle, to: *mut Handle, count: *mut usize) {
    get_edges(graph, from, to, std::ptr::null_mut(), count)
});

entry!(cuGraphGetEdges_v2(
    graph: Handle,
    from: *mut Handle,
    to: *mut Handle,
    edges: *mut [u8; 8],
    count: *mut usize,
) {
    get_edges(graph, from, to, edges, count)
});

/// The dependencies (`up`) or dependents of `node`.
fn neighbours(
    node: Handle,
    up: bool,
    out: *mut Handle,
    edges: *mut [u8; 8],
    count: *mut usize,
) -> CuResult<()> {
    let (g, i) = node_of(node)?;
    let nodes = state(|s| {
        let graph = s.graph(g)?;
        if up {
            graph.dependencies(i)
        } else {
            graph.dependents(i)
        }
    })?;
    if !out.is_null() && !edges.is_null() {
        let room = read_at(count.cast_const(), 0)?;
        for i in 0..nodes.len().min(room) {
            // SAFETY: the caller's edge array has `*count` entries.
            put(unsafe { edges.add(i) }, [0; 8])?;
        }
    }
    put_nodes(g, &nodes, out, count)
}

entry!(cuGraphNodeGetDependencies(node: Handle, out: *mut Handle, count: *mut usize) {
    neighbours(node, true, out, std::ptr::null_mut(), count)
});

entry!(cuGraphNodeGetDependencies_v2(node: Handle, out: *mut Handle, edges: *mut [u8; 8], count: *mut usize) {
    neighbours(node, true, out, edges, count)
});

entry!(cuGraphNodeGetDependentNodes(node: Handle, out: *mut Handle, count: *mut usize) {
    neighbours(node, false, out, std::ptr::null_mut(), count)
});

entry!(cuGraphNodeGetDependentNodes_v2(node: Handle, out: *mut Handle, edges: *mut [u8; 8], count: *mut usize) {
    neighbours(node, false, out, edges, count)
});

/// Adds (or removes) `n` edges; all or nothing.
fn change_edges(
    graph: Handle,
    from: *const Handle,
    to: *const Handle,
    n: usize,
    add: bool,
) -> CuResult<()> {
    let g = graph as u64;
    let (a, b) = (node_list(g, from, n)?, node_list(g, to, n)?);
    state(|s| {
        let graph = s.graph_mut(g)?;
        let mut changed = graph.clone();
        for (&x, &y) in a.iter().zip(&b) {
            if add {
                changed.add_edge(x, y)?;
            } else {
                changed.remove_edge(x, y)?;
            }
        }
        *graph = changed;
        Ok(())
    })
}

entry!(cuGraphAddDependencies(graph: Handle, from: *const Handle, to: *const Handle, n: usize) {
    change_edges(graph, from, to, n, true)
});

entry!(cuGraphAddDependencies_v2(
    graph: Handle,
    from: *const Handle,
    to: *const Handle,
    edges: *const [u8; 8],
    n: usize,
) {
    default_edges(edges, n)?;
    change_edges(graph, from, to, n, true)
});

entry!(cuGraphRemoveDependencies(graph: Handle, from: *const Handle, to: *const Handle, n: usize) {
    change_edges(graph, from, to, n, false)
});

entry!(cuGraphRemoveDependencies_v2(
    graph: Handle,
    from: *const Handle,
    to: *const Handle,
    edges: *const [u8; 8],
    n: usize,
) {
    default_edges(edges, n)?;
    change_edges(graph, from, to, n, false)
});

entry!(cuGraphDestroyNode(node: Handle) {
    let (g, i) = node_of(node)?;
    let mut frees = Vec::new();
    state(|s| {
        let op = s.graph_mut(g)?.remove(i)?;
        s.release(op, &mut frees);
        s.handed_args.remove(&(node as u64));
        Ok(())
    })?;
    free_all(frees)
});

/// `CUDA_ERROR_OPERATING_SYSTEM`: the DOT file could not be written.
const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;

/// A graph in Graphviz's DOT language: a node per line with its index and type, then the
/// edges.
fn dot(g: &Graph) -> String {
    const KINDS: [&str; 12] = [
        "kernel",
        "memcpy",
        "memset",
        "host",
        "graph",
        "empty",
        "wait event",
        "event record",
        "",
        "",
        "mem alloc",
        "mem free",
    ];
    let mut out = String::from("digraph cuda_graph {\n");
    for i in g.nodes() {
        let kind = g.op(i).map_or(-1, Op::kind);
        let label = usize::try_from(kind)
            .ok()
            .and_then(|k| KINDS.get(k))
            .unwrap_or(&"");
        out.push_str(&format!("  n{i} [label=\"{i}: {label}\"];\n"));
    }
    for (from, to) in g.edges() {
        out.push_str(&format!("  n{from} -> n{to};\n"));
    }
    out.push_str("}\n");
    out
}

entry!(cuGraphDebugDotPrint(graph: Handle, path: *const c_char, _flags: c_uint) {
    // The verbosity flags choose what a node's label shows; every label here is its type.
    let path = name(path)?;
    let text = state(|s| Ok(dot(s.graph(graph as u64)?)))?;
    std::fs::write(path, text).map_err(|_| CUDA_ERROR_OPERATING_SYSTEM)
});

entry!(cuGraphClone(out: *mut Handle, graph: Handle) {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let h = state(|s| {
        let copy = s.clone_graph(graph as u64, 0)?;
        s.insert(copy)
    })?;
    put(out, h as Handle)
});

entry!(cuGraphNodeFindInClone(out: *mut Handle, node: Handle, clone: Handle) {
    let (_, i) = node_of(node)?;
    let c = clone as u64;
    if !state(|s| Ok(s.graph(c)?.contains(i)))? {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    put(out, node_handle(c, i) as Handle)
});

entry!(cuGraphChildGraphNodeGetGraph(node: Handle, out: *mut Handle) {
    match op_at(node)? {
        Op::Child(h) => put(out, h as Handle),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
});

// Node parameters, read back and changed.

/// The `CUDA_KERNEL_NODE_PARAMS` of a kernel op; `kernelParams` point at copies the node
/// holds until it changes.
fn kernel_params_of(node: Handle) -> CuResult<KernelParamsV2> {
    let Op::Kernel {
        ctx,
        function,
        grid,
        block,
        shared,
        ..
    } = op_at(node)?
    else {
        return Err(CUDA_ERROR_INVALID_VALUE);
    };
    let (g, i) = node_of(node)?;
    let args = state(|s| {
        // Addresses of the argument values the graph's node holds (stable until it changes).
        let Op::Kernel {
            params: LaunchParams::Each(values),
            ..
        } = s.graph(g)?.op(i)?
        else {
            return Ok(std::ptr::null_mut());
        };
        let ptrs: Vec<usize> = values.iter().map(|v| v.as_ptr() as usize).collect();
        let slot = s.handed_args.entry(node as u64).or_default();
        *slot = ptrs;
        Ok(slot.as_mut_ptr().cast::<*mut c_void>())
    })?;
    Ok(KernelParamsV2 {
        base: KernelParams {
            func: function as Handle,
            grid,
            block,
            shared,
            kernel_params: args,
            extra: std::ptr::null_mut(),
        },
        kern: std::ptr::null_mut(),
        ctx: ctx as Handle,
    })
}

entry!(cuGraphKernelNodeGetParams_v2(node: Handle, out: *mut KernelParamsV2) {
    put(out, kernel_params_of(node)?)
});

entry!(cuGraphKernelNodeGetParams(node: Handle, out: *mut KernelParams) {
    put(out, kernel_params_of(node)?.base)
});

entry!(cuGraphKernelNodeSetParams_v2(node: Handle, params: *const KernelParamsV2) {
    let p = read_at(params, 0)?;
    set_op(node, with_attributes(&op_at(node)?, kernel_op(&p.base, p.kern, p.ctx)?))
});

entry!(cuGraphKernelNodeSetParams(node: Handle, params: *const KernelParams) {
    let p = read_at(params, 0)?;
    let op = kernel_op(&p, std::ptr::null_mut(), std::ptr::null_mut())?;
    set_op(node, with_attributes(&op_at(node)?, op))
});

// Kernel node attributes: the cooperative flag (`CU_KERNEL_NODE_ATTRIBUTE_COOPERATIVE`), which
// a node keeps when its parameters change; the others a launch takes are hints this device
// ignores, so a node has none to keep.

/// `CUlaunchAttributeValue`: 64 bytes, an `int` first for the cooperative flag.
type AttributeValue = [u64; 8];
/// `CU_KERNEL_NODE_ATTRIBUTE_COOPERATIVE`.
const KERNEL_NODE_ATTRIBUTE_COOPERATIVE: c_int = 2;

/// `op` (a kernel op) with the attributes of `old` (the node's op before it).
fn with_attributes(old: &Op, mut op: Op) -> Op {
    if let (
        Op::Kernel { cooperative, .. },
        Op::Kernel {
            cooperative: new, ..
        },
    ) = (old, &mut op)
    {
        *new = *cooperative;
    }
    op
}

/// The cooperative flag of kernel node `node`; other attributes are refused.
fn node_cooperative(node: Handle, attribute: c_int, what: &str) -> CuResult<bool> {
    if attribute != KERNEL_NODE_ATTRIBUTE_COOPERATIVE {
        refused(&format!("{what}: kernel node attribute {attribute}"));
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    match op_at(node)? {
        Op::Kernel { cooperative, .. } => Ok(cooperative),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Makes kernel node `node` cooperative or not.
fn set_node_cooperative(node: Handle, value: bool) -> CuResult<()> {
    let mut op = op_at(node)?;
    let Op::Kernel { cooperative, .. } = &mut op else {
        return Err(CUDA_ERROR_INVALID_VALUE);
    };
    *cooperative = value;
    set_op(node, op)
}

entry!(cuGraphKernelNodeGetAttribute(node: Handle, attribute: c_int, out: *mut AttributeValue) {
    let cooperative = node_cooperative(node, attribute, "cuGraphKernelNodeGetAttribute")?;
    put(out, [u64::from(cooperative), 0, 0, 0, 0, 0, 0, 0])
});

entry!(cuGraphKernelNodeSetAttribute(node: Handle, attribute: c_int, value: *const AttributeValue) {
    node_cooperative(node, attribute, "cuGraphKernelNodeSetAttribute")?;
    // The value's first member is an `int`.
    let v = read_at(value, 0)?;
    set_node_cooperative(node, v[0] as u32 != 0)
});

entry!(cuGraphKernelNodeCopyAttributes(dst: Handle, src: Handle) {
    let cooperative = node_cooperative(src, KERNEL_NODE_ATTRIBUTE_COOPERATIVE, "cuGraphKernelNodeCopyAttributes")?;
    node_cooperative(dst, KERNEL_NODE_ATTRIBUTE_COOPERATIVE, "cuGraphKernelNodeCopyAttributes")?;
    set_node_cooperative(dst, cooperative)
});

/// The `CUDA_MEMCPY3D` of a copy op (offsets folded into the pointers).
fn copy_params_of(copy: &Copy3D) -> Memcpy3dParams {
    // (type, host, device, array) of a side.
    let side = |m: Memory| match m {
        Memory::Host(a) => (MEMORYTYPE_HOST, a, 0, 0),
        Memory::Device(a) => (MEMORYTYPE_DEVICE, 0, a, 0),
        Memory::Array(h) => (MEMORYTYPE_ARRAY, 0, 0, h),
        Memory::Unified(a) => (MEMORYTYPE_UNIFIED, 0, a, 0),
    };
    let (st, sh, sd, sa) = side(copy.src.memory);
    let (dt, dh, dd, da) = side(copy.dst.memory);
    Memcpy3dParams {
        src_x: copy.src.x as usize,
        src_y: copy.src.y as usize,
        src_z: copy.src.z as usize,
        src_lod: 0,
        src_type: st,
        src_host: sh as *const c_void,
        src_device: sd,
        src_array: sa as Handle,
        reserved0: std::ptr::null_mut(),
        src_pitch: copy.src.pitch as usize,
        src_height: copy.src.height as usize,
        dst_x: copy.dst.x as usize,
        dst_y: copy.dst.y as usize,
        dst_z: copy.dst.z as usize,
        dst_lod: 0,
        dst_type: dt,
        dst_host: dh as *mut c_void,
        dst_device: dd,
        dst_array: da as Handle,
        reserved1: std::ptr::null_mut(),
        dst_pitch: copy.dst.pitch as usize,
        dst_height: copy.dst.height as usize,
        width: copy.width as usize,
        height: copy.height as usize,
        depth: copy.depth as usize,
    }
}

entry!(cuGraphMemcpyNodeGetParams(node: Handle, out: *mut Memcpy3dParams) {
    match op_at(node)? {
        Op::Copy { copy, .. } => put(out, copy_params_of(&copy)),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
});

entry!(cuGraphMemcpyNodeSetParams(node: Handle, params: *const Memcpy3dParams) {
    set_op(node, copy_op(params.cast(), std::ptr::null_mut())?)
});

entry!(cuGraphMemsetNodeGetParams(node: Handle, out: *mut MemsetParams) {
    match op_at(node)? {
        Op::Memset { dst, pitch, value, element_size, width, height } => put(out, MemsetParams {
            dst,
            pitch,
            value,
            element_size: element_size as c_uint,
            width,
            height,
        }),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
});

entry!(cuGraphMemsetNodeSetParams(node: Handle, params: *const MemsetParams) {
    set_op(node, memset_op(&read_at(params, 0)?, std::ptr::null_mut())?)
});

entry!(cuGraphHostNodeGetParams(node: Handle, out: *mut HostParams) {
    match op_at(node)? {
        Op::Host { func, data } => put(out, HostParams { func: Some(func), data: data as *mut c_void }),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
});

entry!(cuGraphHostNodeSetParams(node: Handle, params: *const HostParams) {
    set_op(node, host_op(&read_at(params, 0)?)?)
});

entry!(cuGraphEventRecordNodeGetEvent(node: Handle, out: *mut Handle) {
    match op_at(node)? {
        Op::EventRecord { event, .. } => put(out, event as Handle),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
});

entry!(cuGraphEventRecordNodeSetEvent(node: Handle, event: Handle) {
    set_op(node, event_record_op(event)?)
});

entry!(cuGraphEventWaitNodeGetEvent(node: Handle, out: *mut Handle) {
    match op_at(node)? {
        Op::EventWait { event } => put(out, event as Handle),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
});

entry!(cuGraphEventWaitNodeSetEvent(node: Handle, event: Handle) {
    set_op(node, event_wait_op(event)?)
});

entry!(cuGraphMemAllocNodeGetParams(node: Handle, out: *mut MemAllocParams) {
    match op_at(node)? {
        Op::MemAlloc { dptr, bytes, .. } => put(out, MemAllocParams {
            alloc_type: ALLOCATION_PINNED,
            handle_types: 0,
            location_type: LOCATION_DEVICE,
            location_id: DEVICE,
            pool_rest: [0; 72],
            access: std::ptr::null(),
            access_count: 0,
            bytes: bytes as usize,
            dptr,
        }),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
});

entry!(cuGraphMemFreeNodeGetParams(node: Handle, out: *mut u64) {
    match op_at(node)? {
        Op::MemFree { dptr } => put(out, dptr),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
});

// Executable graphs.

/// `CUgraphInstantiate_flags`: free allocations at launch, upload, device launch, node
/// priorities.
const INSTANTIATE_AUTO_FREE_ON_LAUNCH: u64 = 1;
const INSTANTIATE_UPLOAD: u64 = 2;
const INSTANTIATE_DEVICE_LAUNCH: u64 = 4;
const INSTANTIATE_USE_NODE_PRIORITY: u64 = 8;

fn instantiate(out: *mut Handle, graph: Handle, flags: u64) -> CuResult<()> {
    let known = INSTANTIATE_AUTO_FREE_ON_LAUNCH
        | INSTANTIATE_UPLOAD
        | INSTANTIATE_DEVICE_LAUNCH
        | INSTANTIATE_USE_NODE_PRIORITY;
    if out.is_null() || flags & !known != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if flags & INSTANTIATE_DEVICE_LAUNCH != 0 {
        refused(
            "cuGraphInstantiate for device launch (no device-side graph launch on this device)",
        );
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let h = state(|s| {
        let g = graph as u64;
        let exec = s.instantiate(g)?;
        let h = EXEC_TAG | s.serial()?;
        s.execs.insert(
            h,
            Exec {
                source: g,
                graph: exec,
                flags,
                disabled: HashSet::new(),
            },
        );
        Ok(h)
    })?;
    put(out, h as Handle)
}

entry!(cuGraphInstantiateWithFlags(out: *mut Handle, graph: Handle, flags: u64) {
    instantiate(out, graph, flags)
});

/// The CUDA 10 and 11 form: no flags; the node at fault (none: instantiation fails only for
/// bad arguments here) and a log, left empty.
fn instantiate_logged(
    out: *mut Handle,
    graph: Handle,
    error_node: *mut Handle,
    log: *mut c_char,
    log_bytes: usize,
) -> CuResult<()> {
    put_opt(error_node, std::ptr::null_mut())?;
    if !log.is_null() && log_bytes > 0 {
        put_str(log, log_bytes.min(c_int::MAX as usize) as c_int, "")?;
    }
    instantiate(out, graph, 0)
}

entry!(cuGraphInstantiate_v2 | cuGraphInstantiate(
    out: *mut Handle,
    graph: Handle,
    error_node: *mut Handle,
    log: *mut c_char,
    log_bytes: usize,
) {
    instantiate_logged(out, graph, error_node, log, log_bytes)
});

/// `CUDA_GRAPH_INSTANTIATE_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct InstantiateParams {
    flags: u64,
    upload_stream: Handle,
    error_node: Handle,
    result: c_int,
}

/// `CUgraphInstantiateResult`: success, error.
const INSTANTIATE_SUCCESS: c_int = 0;
const INSTANTIATE_ERROR: c_int = 1;

entry!(cuGraphInstantiateWithParams(out: *mut Handle, graph: Handle, params: *mut InstantiateParams) {
    let mut p = read_at(params, 0)?;
    let r = instantiate(out, graph, p.flags);
    p.error_node = std::ptr::null_mut();
    p.result = if r.is_ok() { INSTANTIATE_SUCCESS } else { INSTANTIATE_ERROR };
    put(params, p)?;
    r
});

entry!(cuGraphExecGetFlags(exec: Handle, flags: *mut u64) {
    let f = state(|s| Ok(s.exec_mut(exec)?.flags))?;
    put(flags, f)
});

entry!(cuGraphExecDestroy(exec: Handle) {
    let mut frees = Vec::new();
    state(|s| {
        let e = s.execs.remove(&(exec as u64)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        s.release_graph(e.graph, &mut frees);
        Ok(())
    })?;
    free_all(frees)
});

entry!(cuGraphUpload(exec: Handle, stream: Handle) {
    // Nothing to upload: the guest issues the nodes at launch.
    owner(stream)?;
    state(|s| s.exec_mut(exec).map(drop))
});

entry!(cuGraphLaunch(exec: Handle, stream: Handle) {
    owner(stream)?;
    let ops = state(|s| {
        let e = s.exec_mut(exec)?;
        let g = &e.graph;
        g.order()
            .into_iter()
            .filter(|i| !e.disabled.contains(i))
            .map(|i| g.op(i).cloned())
            .collect::<CuResult<Vec<Op>>>()
    })?;
    // Inside a capture, the whole graph is one child-graph node.
    match capture(stream, Op::Inline(ops))? {
        Some(op) => {
            state(|s| s.run_allocations(&op))?;
            issue(&op, stream)
        }
        None => Ok(()),
    }
});

/// Frees a graph allocation outside its graph (`cuMemFree`, `cuMemFreeAsync`): its memory
/// stays the graph's, for the next launch. Whether `dptr` is a graph allocation; one that is
/// not allocated now is CUDA_ERROR_INVALID_VALUE, as a double free.
pub(super) fn free_graph_alloc(dptr: u64) -> CuResult<bool> {
    state(|s| match s.allocs.get_mut(&dptr) {
        None => Ok(false),
        Some(a) if a.live => {
            a.live = false;
            Ok(true)
        }
        Some(_) => {
            refused(&format!(
                "free of graph allocation {dptr:#x}: not allocated now"
            ));
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    })
}

/// The node of an executable graph that `node` (of the graph it was made from) names.
fn exec_node(exec: Handle, node: Handle) -> CuResult<usize> {
    let (g, i) = node_of(node)?;
    state(|s| {
        let e = s.exec_mut(exec)?;
        if e.source != g || !e.graph.contains(i) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(i)
    })
}

/// Changes one node's op in an executable graph (kind and context unchanged; a kernel keeps
/// its attributes).
fn exec_set(exec: Handle, node: Handle, op: Op) -> CuResult<()> {
    let i = exec_node(exec, node)?;
    state(|s| {
        let e = s.exec_mut(exec)?;
        let old = e.graph.op_mut(i)?;
        if old.kind() != op.kind() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *old = with_attributes(old, op);
        Ok(())
    })
}

entry!(cuGraphExecKernelNodeSetParams_v2(exec: Handle, node: Handle, params: *const KernelParamsV2) {
    let p = read_at(params, 0)?;
    exec_set(exec, node, kernel_op(&p.base, p.kern, p.ctx)?)
});

entry!(cuGraphExecKernelNodeSetParams(exec: Handle, node: Handle, params: *const KernelParams) {
    let p = read_at(params, 0)?;
    exec_set(exec, node, kernel_op(&p, std::ptr::null_mut(), std::ptr::null_mut())?)
});

entry!(cuGraphExecMemcpyNodeSetParams(exec: Handle, node: Handle, params: *const Memcpy3dParams, ctx: Handle) {
    exec_set(exec, node, copy_op(params.cast(), ctx)?)
});

entry!(cuGraphExecMemsetNodeSetParams(exec: Handle, node: Handle, params: *const MemsetParams, ctx: Handle) {
    exec_set(exec, node, memset_op(&read_at(params, 0)?, ctx)?)
});

entry!(cuGraphExecHostNodeSetParams(exec: Handle, node: Handle, params: *const HostParams) {
    exec_set(exec, node, host_op(&read_at(params, 0)?)?)
});

entry!(cuGraphExecEventRecordNodeSetEvent(exec: Handle, node: Handle, event: Handle) {
    exec_set(exec, node, event_record_op(event)?)
});

entry!(cuGraphExecEventWaitNodeSetEvent(exec: Handle, node: Handle, event: Handle) {
    exec_set(exec, node, event_wait_op(event)?)
});

entry!(cuGraphExecNodeSetParams(exec: Handle, node: Handle, params: *mut NodeParams) {
    let p = read_at(params, 0)?;
    if matches!(p.kind, 4 | 10 | 11) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    exec_set(exec, node, op_of(&p)?)
});

/// Enables or disables a kernel, memcpy or memset node of an executable graph (what CUDA
/// allows to be disabled).
fn set_enabled(exec: Handle, node: Handle, enabled: bool) -> CuResult<()> {
    let i = exec_node(exec, node)?;
    state(|s| {
        let e = s.exec_mut(exec)?;
        if !matches!(
            e.graph.op(i)?,
            Op::Kernel { .. } | Op::Copy { .. } | Op::Memset { .. }
        ) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if enabled {
            e.disabled.remove(&i);
        } else {
            e.disabled.insert(i);
        }
        Ok(())
    })
}

entry!(cuGraphNodeSetEnabled(exec: Handle, node: Handle, enabled: c_uint) {
    set_enabled(exec, node, enabled != 0)
});

entry!(cuGraphNodeGetEnabled(exec: Handle, node: Handle, enabled: *mut c_uint) {
    let i = exec_node(exec, node)?;
    let off = state(|s| Ok(s.exec_mut(exec)?.disabled.contains(&i)))?;
    put(enabled, c_uint::from(!off))
});

/// `CUgraphExecUpdateResult`: not supported (graphs with memory nodes).
const UPDATE_ERROR_NOT_SUPPORTED: c_int = 6;

/// Updates `exec` in place from `graph` when both have the same nodes, edges and node
/// kinds; else (result, node at fault).
fn exec_update(exec: Handle, graph: Handle) -> CuResult<Result<(), (c_int, u64)>> {
    let g = graph as u64;
    state(|s| {
        let fresh = s.graph(g)?.clone();
        let holds_memory = |gr: &Graph| {
            gr.nodes().into_iter().find(|&i| {
                gr.op(i)
                    .is_ok_and(|o| matches!(o, Op::MemAlloc { .. } | Op::MemFree { .. }))
            })
        };
        if let Some(i) = holds_memory(&fresh) {
            return Ok(Err((UPDATE_ERROR_NOT_SUPPORTED, node_handle(g, i))));
        }
        let e = s.exec_mut(exec)?;
        if let Err((i, why)) = e.graph.same_shape(&fresh) {
            return Ok(Err((why, node_handle(g, i))));
        }
        if let Some(i) = holds_memory(&e.graph) {
            return Ok(Err((UPDATE_ERROR_NOT_SUPPORTED, node_handle(g, i))));
        }
        let updated = s.instantiate(g)?;
        let e = s.exec_mut(exec)?;
        e.graph = updated;
        e.source = g;
        Ok(Ok(()))
    })
}

/// `CUgraphExecUpdateResultInfo`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct UpdateResultInfo {
    result: c_int,
    error_node: Handle,
    error_from: Handle,
}

entry!(cuGraphExecUpdate_v2(exec: Handle, graph: Handle, info: *mut UpdateResultInfo) {
    let (result, node) = match exec_update(exec, graph)? {
        Ok(()) => (0, 0),
        Err(e) => e,
    };
    put(info, UpdateResultInfo { result, error_node: node as Handle, error_from: std::ptr::null_mut() })?;
    if result == 0 { Ok(()) } else { Err(CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE) }
});

entry!(cuGraphExecUpdate(exec: Handle, graph: Handle, error_node: *mut Handle, result: *mut c_int) {
    let (r, node) = match exec_update(exec, graph)? {
        Ok(()) => (0, 0),
        Err(e) => e,
    };
    put_opt(error_node, node as Handle)?;
    put(result, r)?;
    if r == 0 { Ok(()) } else { Err(CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE) }
});

entry!(cuGraphConditionalHandleCreate(
    _out: *mut u64,
    _graph: Handle,
    _ctx: Handle,
    _default: c_uint,
    _flags: c_uint,
) {
    refused("graph conditional nodes (they need device-side cudaGraphSetConditional)");
    Err(CUDA_ERROR_NOT_SUPPORTED)
});

// Graph memory.

/// `CUgraphMem_attribute`: used now, used at most, reserved now, reserved at most.
const GRAPH_MEM_USED_CURRENT: c_int = 0;
const GRAPH_MEM_USED_HIGH: c_int = 1;
const GRAPH_MEM_RESERVED_CURRENT: c_int = 2;
const GRAPH_MEM_RESERVED_HIGH: c_int = 3;

entry!(cuDeviceGetGraphMemAttribute(dev: c_int, attribute: c_int, value: *mut u64) {
    device(dev)?;
    // Graph allocations are made whole: what is reserved is what is used.
    let v = state(|s| match attribute {
        GRAPH_MEM_USED_CURRENT | GRAPH_MEM_RESERVED_CURRENT => Ok(s.used),
        GRAPH_MEM_USED_HIGH | GRAPH_MEM_RESERVED_HIGH => Ok(s.used_high),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    })?;
    put(value, v)
});

entry!(cuDeviceSetGraphMemAttribute(dev: c_int, attribute: c_int, value: *mut u64) {
    device(dev)?;
    // Only the high watermarks may be set, and only to 0 (reset to the current use).
    if read_at(value.cast_const(), 0)? != 0
        || !matches!(attribute, GRAPH_MEM_USED_HIGH | GRAPH_MEM_RESERVED_HIGH)
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    state(|s| {
        s.used_high = s.used;
        Ok(())
    })
});

entry!(cuDeviceGraphMemTrim(dev: c_int) {
    // Nothing is cached beyond what graphs hold.
    device(dev)
});

// Stream capture.

/// Begins a capture on `stream`: into a new graph, or into graph `into` after its nodes
/// given.
fn begin_capture(stream: Handle, mode: c_int, into: Option<(u64, Vec<usize>)>) -> CuResult<()> {
    owner(stream)?;
    if !(CAPTURE_MODE_GLOBAL..=CAPTURE_MODE_RELAXED).contains(&mode) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if (stream as u64) <= LEGACY_STREAM {
        // The per-thread default stream may be captured; the legacy one may not.
        refused("stream capture of the legacy NULL stream");
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    state(|s| {
        if s.captures.contains_key(&(stream as u64)) {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        let own_graph = into.is_none();
        let (graph, deps) = match into {
            Some((g, deps)) => {
                if s.children.contains(&g) {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                s.graph(g)?;
                (g, deps)
            }
            None => (s.insert(Graph::default())?, Vec::new()),
        };
        s.next += 1;
        let id = s.next;
        s.captures.insert(
            stream as u64,
            Capture {
                id,
                graph,
                deps,
                mode,
                origin: true,
                own_graph,
                thread: std::thread::current().id(),
                invalidated: false,
                handed: Box::new([]),
                zero_edges: Box::new([]),
            },
        );
        Ok(())
    })
}

entry!(cuStreamBeginCapture_v2(stream: Handle, mode: c_int) { begin_capture(stream, mode, None) });

entry!(cuStreamBeginCapture(stream: Handle) { begin_capture(stream, CAPTURE_MODE_GLOBAL, None) });

entry!(cuStreamBeginCaptureToGraph(
    stream: Handle,
    graph: Handle,
    deps: *const Handle,
    edges: *const [u8; 8],
    n: usize,
    mode: c_int,
) {
    default_edges(edges, n)?;
    let nodes = node_list(graph as u64, deps, n)?;
    begin_capture(stream, mode, Some((graph as u64, nodes)))
});

entry!(cuStreamEndCapture(stream: Handle, out: *mut Handle) {
    owner(stream)?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut frees = Vec::new();
    let result = state(|s| {
        let c = s
            .captures
            .get(&(stream as u64))
            .ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        if !c.origin {
            let id = c.id;
            s.invalidate(id);
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
        }
        if c.mode != CAPTURE_MODE_RELAXED && c.thread != std::thread::current().id() {
            return Err(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
        }
        let (id, graph, ends, own) = (c.id, c.graph, c.deps.clone(), c.own_graph);
        let mut status = if c.invalidated {
            Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        } else {
            Ok(())
        };
        // Every stream the capture forked into must have joined back: its last work must
        // come before the origin stream's.
        let g = s.graph(graph)?;
        let unjoined = s.captures.values().filter(|o| o.id == id && !o.origin).any(|o| {
            o.deps.iter().any(|&n| !ends.iter().any(|&e| g.reaches(n, e)))
        });
        if unjoined && status.is_ok() {
            status = Err(CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
        }
        s.end_sequence(id);
        match status {
            Ok(()) => Ok(graph),
            Err(e) => {
                if own {
                    s.destroy(graph, &mut frees);
                }
                Err(e)
            }
        }
    });
    free_all(frees)?;
    match result {
        Ok(graph) => put(out, graph as Handle),
        Err(e) => {
            put(out, std::ptr::null_mut())?;
            Err(e)
        }
    }
});

/// The capture status of `stream`, its sequence id and graph.
fn capture_status(stream: Handle) -> CuResult<(c_int, u64, u64)> {
    owner(stream)?;
    state(|s| {
        Ok(match s.captures.get(&(stream as u64)) {
            None => (CAPTURE_STATUS_NONE, 0, 0),
            Some(c) if c.invalidated => (CAPTURE_STATUS_INVALIDATED, c.id, c.graph),
            Some(c) => (CAPTURE_STATUS_ACTIVE, c.id, c.graph),
        })
    })
}

entry!(cuStreamIsCapturing(stream: Handle, out: *mut c_int) {
    put(out, capture_status(stream)?.0)
});

/// `cuStreamGetCaptureInfo` in all its forms: the optional outputs the caller passed.
fn capture_info(
    stream: Handle,
    status_out: *mut c_int,
    id_out: *mut u64,
    graph_out: *mut Handle,
    deps_out: *mut *const Handle,
    edges_out: *mut *const [u8; 8],
    count_out: *mut usize,
) -> CuResult<()> {
    let (st, id, graph) = capture_status(stream)?;
    put(status_out, st)?;
    put_opt(id_out, id)?;
    if st == CAPTURE_STATUS_NONE {
        put_opt(graph_out, std::ptr::null_mut())?;
        put_opt(deps_out, std::ptr::null())?;
        put_opt(edges_out, std::ptr::null())?;
        return put_opt(count_out, 0);
    }
    put_opt(graph_out, graph as Handle)?;
    let (deps, edges, n) = state(|s| {
        let c = s
            .captures
            .get_mut(&(stream as u64))
            .ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        c.handed = c.deps.iter().map(|&i| node_handle(graph, i)).collect();
        c.zero_edges = vec![[0u8; 8]; c.deps.len()].into_boxed_slice();
        Ok((
            c.handed.as_ptr().cast::<Handle>(),
            c.zero_edges.as_ptr(),
            c.deps.len(),
        ))
    })?;
    put_opt(deps_out, deps)?;
    put_opt(edges_out, edges)?;
    put_opt(count_out, n)
}

entry!(cuStreamGetCaptureInfo(stream: Handle, status_out: *mut c_int, id_out: *mut u64) {
    let null = std::ptr::null_mut();
    capture_info(stream, status_out, id_out, null, null.cast(), null.cast(), null.cast())
});

entry!(cuStreamGetCaptureInfo_v2(
    stream: Handle,
    status_out: *mut c_int,
    id_out: *mut u64,
    graph_out: *mut Handle,
    deps_out: *mut *const Handle,
    count_out: *mut usize,
) {
    capture_info(stream, status_out, id_out, graph_out, deps_out, std::ptr::null_mut(), count_out)
});

entry!(cuStreamGetCaptureInfo_v3(
    stream: Handle,
    status_out: *mut c_int,
    id_out: *mut u64,
    graph_out: *mut Handle,
    deps_out: *mut *const Handle,
    edges_out: *mut *const [u8; 8],
    count_out: *mut usize,
) {
    capture_info(stream, status_out, id_out, graph_out, deps_out, edges_out, count_out)
});

fn update_capture_deps(
    stream: Handle,
    deps: *const Handle,
    n: usize,
    flags: c_uint,
) -> CuResult<()> {
    owner(stream)?;
    if flags != CAPTURE_ADD && flags != CAPTURE_SET {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let graph = state(|s| {
        s.captures
            .get(&(stream as u64))
            .map(|c| c.graph)
            .ok_or(CUDA_ERROR_ILLEGAL_STATE)
    })?;
    let nodes = node_list(graph, deps, n)?;
    state(|s| {
        let c = s
            .captures
            .get_mut(&(stream as u64))
            .ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        if flags == CAPTURE_SET {
            c.deps.clear();
        }
        for n in nodes {
            if !c.deps.contains(&n) {
                c.deps.push(n);
            }
        }
        Ok(())
    })
}

entry!(cuStreamUpdateCaptureDependencies(stream: Handle, deps: *const Handle, n: usize, flags: c_uint) {
    update_capture_deps(stream, deps, n, flags)
});

entry!(cuStreamUpdateCaptureDependencies_v2(
    stream: Handle,
    deps: *const Handle,
    edges: *const [u8; 8],
    n: usize,
    flags: c_uint,
) {
    default_edges(edges, n)?;
    update_capture_deps(stream, deps, n, flags)
});

entry!(cuThreadExchangeStreamCaptureMode(mode: *mut c_int) {
    let new = read_at(mode.cast_const(), 0)?;
    if !(CAPTURE_MODE_GLOBAL..=CAPTURE_MODE_RELAXED).contains(&new) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let old = THREAD_MODE.with(|m| m.replace(new));
    put(mode, old)
});

// Host functions in stream order.

fn launch_host_func(stream: Handle, func: Option<HostFn>, data: *mut c_void) -> CuResult<()> {
    let func = func.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    submit(stream, |_| {
        Ok(Op::Host {
            func,
            data: data as usize,
        })
    })
}

entry!(cuLaunchHostFunc(stream: Handle, func: Option<HostFn>, data: *mut c_void) {
    launch_host_func(stream, func, data)
});

/// `cuLaunchHostFunc_v2`'s sync modes: blocking (0) and spin (1) differ only in how a
/// driver thread waits; both call the function after the stream's earlier work.
const MAX_HOST_FUNC_SYNC_MODE: c_uint = 1;

entry!(cuLaunchHostFunc_v2(stream: Handle, func: Option<HostFn>, data: *mut c_void, sync_mode: c_uint) {
    if sync_mode > MAX_HOST_FUNC_SYNC_MODE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    launch_host_func(stream, func, data)
});

// The stream entry points' work.

/// `n` bytes copied in stream order (`cuMemcpy*Async`).
pub(super) fn copy_async(dst: Memory, src: Memory, n: usize, stream: Handle) -> CuResult<()> {
    let side = |memory| Side {
        memory,
        x: 0,
        y: 0,
        z: 0,
        pitch: n as u64,
        height: 1,
    };
    submit(stream, |_| {
        Ok(Op::Copy {
            copy: Copy3D {
                src: side(src),
                dst: side(dst),
                width: n as u64,
                height: 1,
                depth: 1,
            },
        })
    })
}

/// `n` elements of `size` bytes set in stream order (`cuMemsetD*Async`).
pub(super) fn memset_async(
    dst: u64,
    value: u32,
    size: u64,
    n: usize,
    stream: Handle,
) -> CuResult<()> {
    submit(stream, |_| {
        Ok(Op::Memset {
            dst,
            pitch: 0,
            value,
            element_size: size,
            width: n,
            height: 1,
        })
    })
}

/// Stream work the array module issues itself (its copies and memsets): recorded as the node
/// `op` when `stream` captures. Whether it was.
pub(crate) fn record(stream: Handle, op: impl FnOnce() -> Op) -> CuResult<bool> {
    owner(stream)?;
    check_implicit(stream)?;
    if !state(|s| Ok(s.captures.contains_key(&(stream as u64))))? {
        return Ok(false);
    }
    // Given back only when the capture ended meanwhile: then the caller issues the work.
    capture(stream, op()).map(|back| back.is_none())
}
