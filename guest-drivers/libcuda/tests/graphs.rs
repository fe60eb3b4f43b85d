//! Graphs and stream capture through the C entry points, as a C program calls them, against a
//! served CPU backend: a graph built node by node runs its nodes in dependency order, changes
//! in its executable form, clones and updates; a capture records stream work instead of
//! running it; and what CUDA refuses (cycles, foreign nodes, bad handles, a synchronisation in
//! a capture, legacy-stream work beside one, an unjoined fork, an outside event, capturing the
//! NULL stream) is refused with CUDA's errors. One test: the driver is process-global, as in a
//! real process.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::ptr::{null, null_mut};

extern crate cuda;

mod support;

type Handle = *mut c_void;

#[repr(C)]
struct KernelParams {
    func: Handle,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
    kern: Handle,
    ctx: Handle,
}

#[repr(C)]
struct MemsetParams {
    dst: u64,
    pitch: usize,
    value: c_uint,
    element_size: c_uint,
    width: usize,
    height: usize,
}

#[repr(C)]
struct HostParams {
    func: unsafe extern "C" fn(*mut c_void),
    data: *mut c_void,
}

/// `CUDA_MEMCPY3D`.
#[repr(C)]
#[derive(Default)]
struct Memcpy3d {
    src_x: usize,
    src_y: usize,
    src_z: usize,
    src_lod: usize,
    src_type: c_uint,
    src_host: usize,
    src_device: u64,
    src_array: usize,
    reserved0: usize,
    src_pitch: usize,
    src_height: usize,
    dst_x: usize,
    dst_y: usize,
    dst_z: usize,
    dst_lod: usize,
    dst_type: c_uint,
    dst_host: usize,
    dst_device: u64,
    dst_array: usize,
    reserved1: usize,
    dst_pitch: usize,
    dst_height: usize,
    width: usize,
    height: usize,
    depth: usize,
}

unsafe extern "C" {
    fn cuInit(flags: c_uint) -> c_uint;
    fn cuCtxCreate_v2(ctx: *mut Handle, flags: c_uint, dev: c_int) -> c_uint;
    fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> c_uint;
    fn cuModuleGetFunction(f: *mut Handle, module: Handle, name: *const c_char) -> c_uint;
    fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> c_uint;
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> c_uint;
    fn cuMemsetD32_v2(dst: u64, value: c_uint, n: usize) -> c_uint;
    fn cuMemsetD32Async(dst: u64, value: c_uint, n: usize, stream: Handle) -> c_uint;
    fn cuStreamCreate(s: *mut Handle, flags: c_uint) -> c_uint;
    fn cuStreamSynchronize(s: Handle) -> c_uint;
    fn cuStreamWaitEvent(s: Handle, e: Handle, flags: c_uint) -> c_uint;
    fn cuEventCreate(e: *mut Handle, flags: c_uint) -> c_uint;
    fn cuEventRecord(e: Handle, s: Handle) -> c_uint;
    #[allow(clippy::too_many_arguments)]
    fn cuLaunchKernel(
        f: Handle,
        gx: c_uint,
        gy: c_uint,
        gz: c_uint,
        bx: c_uint,
        by: c_uint,
        bz: c_uint,
        shared: c_uint,
        stream: Handle,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> c_uint;
    fn cuGraphCreate(g: *mut Handle, flags: c_uint) -> c_uint;
    fn cuGraphDestroy(g: Handle) -> c_uint;
    fn cuGraphAddKernelNode_v2(
        out: *mut Handle,
        g: Handle,
        deps: *const Handle,
        n: usize,
        p: *const KernelParams,
    ) -> c_uint;
    fn cuGraphAddMemsetNode(
        out: *mut Handle,
        g: Handle,
        deps: *const Handle,
        n: usize,
        p: *const MemsetParams,
        ctx: Handle,
    ) -> c_uint;
    fn cuGraphAddMemcpyNode(
        out: *mut Handle,
        g: Handle,
        deps: *const Handle,
        n: usize,
        p: *const Memcpy3d,
        ctx: Handle,
    ) -> c_uint;
    fn cuGraphAddHostNode(
        out: *mut Handle,
        g: Handle,
        deps: *const Handle,
        n: usize,
        p: *const HostParams,
    ) -> c_uint;
    fn cuGraphAddEmptyNode(out: *mut Handle, g: Handle, deps: *const Handle, n: usize) -> c_uint;
    fn cuGraphAddChildGraphNode(
        out: *mut Handle,
        g: Handle,
        deps: *const Handle,
        n: usize,
        child: Handle,
    ) -> c_uint;
    fn cuGraphAddDependencies(
        g: Handle,
        from: *const Handle,
        to: *const Handle,
        n: usize,
    ) -> c_uint;
    fn cuGraphGetNodes(g: Handle, out: *mut Handle, n: *mut usize) -> c_uint;
    fn cuGraphGetRootNodes(g: Handle, out: *mut Handle, n: *mut usize) -> c_uint;
    fn cuGraphGetEdges(g: Handle, from: *mut Handle, to: *mut Handle, n: *mut usize) -> c_uint;
    fn cuGraphNodeGetType(node: Handle, kind: *mut c_int) -> c_uint;
    fn cuGraphDestroyNode(node: Handle) -> c_uint;
    fn cuGraphClone(out: *mut Handle, g: Handle) -> c_uint;
    fn cuGraphNodeFindInClone(out: *mut Handle, node: Handle, clone: Handle) -> c_uint;
    fn cuGraphKernelNodeSetParams_v2(node: Handle, p: *const KernelParams) -> c_uint;
    fn cuGraphInstantiateWithFlags(out: *mut Handle, g: Handle, flags: u64) -> c_uint;
    fn cuGraphLaunch(exec: Handle, stream: Handle) -> c_uint;
    fn cuGraphExecDestroy(exec: Handle) -> c_uint;
    fn cuGraphExecKernelNodeSetParams_v2(
        exec: Handle,
        node: Handle,
        p: *const KernelParams,
    ) -> c_uint;
    fn cuGraphExecUpdate(
        exec: Handle,
        g: Handle,
        error_node: *mut Handle,
        result: *mut c_int,
    ) -> c_uint;
    fn cuStreamBeginCapture_v2(s: Handle, mode: c_int) -> c_uint;
    fn cuStreamEndCapture(s: Handle, g: *mut Handle) -> c_uint;
    fn cuStreamIsCapturing(s: Handle, status: *mut c_int) -> c_uint;
    fn cuStreamGetCaptureInfo_v2(
        s: Handle,
        status: *mut c_int,
        id: *mut u64,
        g: *mut Handle,
        deps: *mut *const Handle,
        n: *mut usize,
    ) -> c_uint;
    fn cuStreamUpdateCaptureDependencies(
        s: Handle,
        deps: *const Handle,
        n: usize,
        flags: c_uint,
    ) -> c_uint;
    fn cuLaunchHostFunc(
        s: Handle,
        f: unsafe extern "C" fn(*mut c_void),
        data: *mut c_void,
    ) -> c_uint;
    fn cuThreadExchangeStreamCaptureMode(mode: *mut c_int) -> c_uint;
    fn cuGetErrorName(status: c_uint, out: *mut *const c_char) -> c_uint;
    fn cuMemsetD2D32Async(
        dst: u64,
        pitch: usize,
        value: c_uint,
        w: usize,
        h: usize,
        stream: Handle,
    ) -> c_uint;
    fn cuGraphInstantiate_v2(
        out: *mut Handle,
        g: Handle,
        error_node: *mut Handle,
        log: *mut c_char,
        log_bytes: usize,
    ) -> c_uint;
    fn cuStreamBeginCaptureToGraph(
        s: Handle,
        g: Handle,
        deps: *const Handle,
        edges: *const [u8; 8],
        n: usize,
        mode: c_int,
    ) -> c_uint;
    fn cuGraphNodeSetEnabled(exec: Handle, node: Handle, enabled: c_uint) -> c_uint;
    fn cuGraphNodeGetEnabled(exec: Handle, node: Handle, enabled: *mut c_uint) -> c_uint;
    fn cuGraphDebugDotPrint(g: Handle, path: *const c_char, flags: c_uint) -> c_uint;
    fn cuGraphAddNode_v2(
        out: *mut Handle,
        g: Handle,
        deps: *const Handle,
        edges: *const [u8; 8],
        n: usize,
        p: *mut NodeParams,
    ) -> c_uint;
}

/// `CUgraphNodeParams`: the node type, then its parameters at offset 16 (256 bytes in all).
#[repr(C, align(8))]
struct NodeParams {
    kind: c_int,
    reserved: [c_int; 3],
    params: [u8; 240],
}

const PUT: &CStr = c".version 8.5\n.target sm_75\n.address_size 64\n\
    .visible .entry put(.param .u64 p, .param .u32 v)\n{\n.reg .b32 %r<2>;\n.reg .b64 %rd<2>;\n\
    ld.param.u64 %rd1, [p];\nld.param.u32 %r1, [v];\nst.global.u32 [%rd1], %r1;\nret;\n}\n";

/// A host node's function: adds one to the counter it is given.
unsafe extern "C" fn bump(p: *mut c_void) {
    // SAFETY: the tests pass a pointer to a live u32 they own.
    unsafe { *p.cast::<u32>() += 1 };
}

/// Reads `n` words of device memory.
fn words(a: u64, n: usize) -> Vec<u32> {
    let mut out = vec![0u32; n];
    // SAFETY: a buffer of n words.
    let status = unsafe { cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), a, n * 4) };
    assert_eq!(status, 0);
    out
}

#[test]
fn graphs_run_in_dependency_order_and_capture_records_stream_work() {
    let host = support::serve_cpu_backend("graphs");
    // SAFETY: every call passes arguments as the driver API documents them, or NULL and wrong
    // handles where the test checks that they are refused.
    unsafe {
        assert_eq!(cuInit(0), 0);
        let mut ctx: Handle = null_mut();
        assert_eq!(cuCtxCreate_v2(&mut ctx, 0, 0), 0);
        let (mut m, mut f): (Handle, Handle) = (null_mut(), null_mut());
        assert_eq!(cuModuleLoadData(&mut m, PUT.as_ptr().cast()), 0);
        assert_eq!(cuModuleGetFunction(&mut f, m, c"put".as_ptr()), 0);
        let mut a = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut a, 64), 0);
        let mut stream: Handle = null_mut();
        assert_eq!(cuStreamCreate(&mut stream, 0), 0);

        // A graph: memset(a, 16 words of 9) → put(a + 4, value) → copy a to host → host node.
        let mut g: Handle = null_mut();
        assert_eq!(cuGraphCreate(&mut g, 1), 1, "flags must be 0");
        assert_eq!(cuGraphCreate(&mut g, 0), 0);
        let ms = MemsetParams {
            dst: a,
            pitch: 0,
            value: 9,
            element_size: 4,
            width: 16,
            height: 1,
        };
        let mut set: Handle = null_mut();
        assert_eq!(
            cuGraphAddMemsetNode(&mut set, g, null(), 0, &ms, null_mut()),
            0
        );
        let bad = MemsetParams {
            element_size: 3,
            ..ms
        };
        let mut none: Handle = null_mut();
        assert_eq!(
            cuGraphAddMemsetNode(&mut none, g, null(), 0, &bad, null_mut()),
            1,
            "3-byte elements"
        );
        let (mut addr, mut value) = (a + 4, 7u32);
        let mut args = [
            (&raw mut addr).cast::<c_void>(),
            (&raw mut value).cast::<c_void>(),
        ];
        let kp = |args: *mut *mut c_void| KernelParams {
            func: f,
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared: 0,
            kernel_params: args,
            extra: null_mut(),
            kern: null_mut(),
            ctx: null_mut(),
        };
        let mut kern: Handle = null_mut();
        assert_eq!(
            cuGraphAddKernelNode_v2(&mut kern, g, &set, 1, &kp(args.as_mut_ptr())),
            0
        );
        let mut out = [0u32; 16];
        let copy = Memcpy3d {
            src_type: 2,
            src_device: a,
            dst_type: 1,
            dst_host: out.as_mut_ptr() as usize,
            width: 64,
            height: 1,
            depth: 1,
            ..Memcpy3d::default()
        };
        let mut cp: Handle = null_mut();
        assert_eq!(
            cuGraphAddMemcpyNode(&mut cp, g, &kern, 1, &copy, null_mut()),
            0
        );
        let narrow = Memcpy3d {
            src_pitch: 8,
            dst_pitch: 64,
            height: 2,
            ..copy
        };
        assert_eq!(
            cuGraphAddMemcpyNode(&mut none, g, null(), 0, &narrow, null_mut()),
            1,
            "a pitch narrower than the rows"
        );
        let mut calls = 0u32;
        let hp = HostParams {
            func: bump,
            data: (&raw mut calls).cast(),
        };
        let mut hn: Handle = null_mut();
        assert_eq!(cuGraphAddHostNode(&mut hn, g, &cp, 1, &hp), 0);

        // Structure, and what it refuses.
        assert_eq!(cuGraphAddDependencies(g, &hn, &set, 1), 1, "a cycle");
        assert_eq!(
            cuGraphAddDependencies(g, &set, &kern, 1),
            1,
            "an edge twice"
        );
        assert_eq!(cuGraphAddEmptyNode(&mut none, g, &ctx, 1), 1, "not a node");
        let mut other: Handle = null_mut();
        assert_eq!(cuGraphCreate(&mut other, 0), 0);
        assert_eq!(
            cuGraphAddEmptyNode(&mut none, other, &set, 1),
            1,
            "a node of another graph"
        );
        let (mut n, mut kind) = (0usize, -1);
        assert_eq!(cuGraphGetNodes(g, null_mut(), &mut n), 0);
        assert_eq!(n, 4);
        let mut roots = [null_mut(); 4];
        n = 4;
        assert_eq!(cuGraphGetRootNodes(g, roots.as_mut_ptr(), &mut n), 0);
        assert_eq!((n, roots[0]), (1, set));
        assert_eq!(cuGraphGetEdges(g, null_mut(), null_mut(), &mut n), 0);
        assert_eq!(n, 3);
        assert_eq!(cuGraphNodeGetType(kern, &mut kind), 0);
        assert_eq!(kind, 0);
        assert_eq!(cuGraphNodeGetType(g, &mut kind), 1, "a graph is not a node");

        let mut exec: Handle = null_mut();
        assert_eq!(
            cuGraphInstantiateWithFlags(&mut exec, g, 4),
            801,
            "device launch"
        );
        assert_eq!(cuGraphInstantiateWithFlags(&mut exec, g, 0), 0);
        assert_eq!(cuGraphLaunch(exec, stream), 0);
        assert_eq!(cuStreamSynchronize(stream), 0);
        let mut want = [9u32; 16];
        want[1] = 7;
        assert_eq!(out, want, "memset, then the kernel, then the copy");
        assert_eq!(calls, 1);
        assert_eq!(cuGraphLaunch(g, stream), 1, "a graph is not executable");

        // The executable graph's kernel node changes; the graph's does not.
        (&raw mut value).write(8);
        assert_eq!(
            cuGraphExecKernelNodeSetParams_v2(exec, kern, &kp(args.as_mut_ptr())),
            0
        );
        assert_eq!(
            cuGraphExecKernelNodeSetParams_v2(exec, set, &kp(args.as_mut_ptr())),
            1,
            "not a kernel node"
        );
        assert_eq!(cuGraphLaunch(exec, stream), 0);
        assert_eq!(cuStreamSynchronize(stream), 0);
        assert_eq!(out[1], 8);
        // A disabled kernel node does nothing; enabled again, it runs.
        let mut on = 9;
        assert_eq!(cuGraphNodeSetEnabled(exec, kern, 0), 0);
        assert_eq!(cuGraphNodeGetEnabled(exec, kern, &mut on), 0);
        assert_eq!(on, 0);
        assert_eq!(cuGraphNodeSetEnabled(exec, hn, 0), 1, "a host node");
        assert_eq!(cuGraphLaunch(exec, stream), 0);
        assert_eq!(cuStreamSynchronize(stream), 0);
        assert_eq!(out[1], 9, "the memset's value, not the kernel's");
        assert_eq!(cuGraphNodeSetEnabled(exec, kern, 1), 0);
        assert_eq!(cuGraphNodeGetEnabled(exec, kern, &mut on), 0);
        assert_eq!(on, 1);
        // A clone, its kernel node set to 5, updates the executable graph.
        let mut clone: Handle = null_mut();
        assert_eq!(cuGraphClone(&mut clone, g), 0);
        let mut ck: Handle = null_mut();
        assert_eq!(cuGraphNodeFindInClone(&mut ck, kern, clone), 0);
        (&raw mut value).write(5);
        assert_eq!(cuGraphKernelNodeSetParams_v2(ck, &kp(args.as_mut_ptr())), 0);
        let (mut at, mut result): (Handle, c_int) = (null_mut(), -1);
        assert_eq!(cuGraphExecUpdate(exec, clone, &mut at, &mut result), 0);
        assert_eq!(result, 0);
        // The program's graph may go; the executable graph keeps its copy.
        assert_eq!(cuGraphDestroy(g), 0);
        assert_eq!(cuGraphDestroy(g), 1, "destroyed twice");
        assert_eq!(cuGraphLaunch(exec, stream), 0);
        assert_eq!(cuStreamSynchronize(stream), 0);
        assert_eq!(out[1], 5);
        assert_eq!(calls, 4);
        // A clone with a node less no longer matches.
        assert_eq!(cuGraphDestroyNode(ck), 0);
        assert_eq!(
            cuGraphExecUpdate(exec, clone, &mut at, &mut result),
            910,
            "topology changed"
        );
        assert_eq!(result, 2);
        assert_eq!(cuGraphExecDestroy(exec), 0);
        assert_eq!(cuGraphExecDestroy(exec), 1);

        // A child graph: the clone's memset and copy, run inside another graph.
        let mut parent: Handle = null_mut();
        assert_eq!(cuGraphCreate(&mut parent, 0), 0);
        let mut child: Handle = null_mut();
        assert_eq!(
            cuGraphAddChildGraphNode(&mut child, parent, null(), 0, parent),
            1,
            "a graph inside itself"
        );
        assert_eq!(
            cuGraphAddChildGraphNode(&mut child, parent, null(), 0, clone),
            0
        );
        assert_eq!(cuGraphInstantiateWithFlags(&mut exec, parent, 0), 0);
        out = [0; 16];
        assert_eq!(cuGraphLaunch(exec, stream), 0);
        assert_eq!(cuStreamSynchronize(stream), 0);
        assert_eq!(out, [9u32; 16], "the child's memset and copy");
        assert_eq!(cuGraphExecDestroy(exec), 0);

        // The generic form: a memset node; conditional nodes are refused.
        let mut np = NodeParams {
            kind: 2,
            reserved: [0; 3],
            params: [0; 240],
        };
        np.params[..8].copy_from_slice(&a.to_le_bytes());
        np.params[16..20].copy_from_slice(&11u32.to_le_bytes());
        np.params[20..24].copy_from_slice(&4u32.to_le_bytes());
        np.params[24..32].copy_from_slice(&16u64.to_le_bytes());
        np.params[32..40].copy_from_slice(&1u64.to_le_bytes());
        let mut generic: Handle = null_mut();
        assert_eq!(cuGraphCreate(&mut generic, 0), 0);
        let mut node: Handle = null_mut();
        let edge = [1u8, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(
            cuGraphAddNode_v2(&mut node, generic, null(), &edge, 0, &mut np),
            0,
            "no edges, no edge data read"
        );
        assert_eq!(
            cuGraphAddNode_v2(&mut node, generic, &node, &edge, 1, &mut np),
            801,
            "a programmatic edge"
        );
        // The CUDA 11 form, with its log buffer.
        let (mut log, mut at_fault) = ([1 as c_char; 8], ctx);
        assert_eq!(
            cuGraphInstantiate_v2(&mut exec, generic, &mut at_fault, log.as_mut_ptr(), 8),
            0
        );
        assert!(at_fault.is_null());
        assert_eq!(log[0], 0, "an empty log");
        assert_eq!(cuGraphLaunch(exec, stream), 0);
        assert_eq!(words(a, 16), [11; 16]);
        assert_eq!(cuGraphExecDestroy(exec), 0);
        np.kind = 13;
        assert_eq!(
            cuGraphAddNode_v2(&mut node, generic, null(), null(), 0, &mut np),
            801,
            "a conditional node"
        );
        np.kind = 8;
        assert_eq!(
            cuGraphAddNode_v2(&mut node, generic, null(), null(), 0, &mut np),
            801,
            "an external semaphore node"
        );
        np.kind = 99;
        assert_eq!(
            cuGraphAddNode_v2(&mut node, generic, null(), null(), 0, &mut np),
            1,
            "no such node type"
        );
        assert_eq!(cuGraphDestroy(generic), 0);

        // Capture: stream work becomes nodes and runs only when the graph does.
        let mut st = -1;
        assert_eq!(
            cuStreamBeginCapture_v2(null_mut(), 0),
            900,
            "the NULL stream"
        );
        assert_eq!(cuStreamBeginCapture_v2(stream, 7), 1, "no such mode");
        assert_eq!(cuStreamBeginCapture_v2(stream, 0), 0);
        assert_eq!(cuStreamBeginCapture_v2(stream, 0), 401, "already capturing");
        assert_eq!(cuStreamIsCapturing(stream, &mut st), 0);
        assert_eq!(st, 1);
        assert_eq!(cuMemsetD32_v2(a, 1, 16), 0);
        assert_eq!(cuMemsetD32Async(a, 2, 16, stream), 0);
        (&raw mut addr).write(a);
        (&raw mut value).write(3);
        assert_eq!(
            cuLaunchKernel(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream,
                args.as_mut_ptr(),
                null_mut()
            ),
            0
        );
        assert_eq!(cuLaunchHostFunc(stream, bump, (&raw mut calls).cast()), 0);
        let (mut id, mut cg, mut deps, mut count) = (0u64, null_mut(), null(), 0usize);
        assert_eq!(
            cuStreamGetCaptureInfo_v2(stream, &mut st, &mut id, &mut cg, &mut deps, &mut count),
            0
        );
        assert_eq!((st, count), (1, 1));
        assert_eq!(words(a, 2), [1, 1], "captured work has not run");
        assert_eq!(calls, 5, "four launches of the graph, one of the child");
        let mut captured: Handle = null_mut();
        assert_eq!(cuStreamEndCapture(stream, &mut captured), 0);
        assert_eq!(captured, cg);
        let mut again: Handle = null_mut();
        assert_eq!(cuStreamEndCapture(stream, &mut again), 401, "not capturing");
        assert_eq!(cuGraphGetNodes(captured, null_mut(), &mut n), 0);
        assert_eq!(n, 3);
        assert_eq!(cuGraphInstantiateWithFlags(&mut exec, captured, 0), 0);
        assert_eq!(cuGraphLaunch(exec, stream), 0);
        assert_eq!(cuStreamSynchronize(stream), 0);
        assert_eq!(words(a, 2), [3, 2]);
        assert_eq!(calls, 6);

        // Capture misuse.
        assert_eq!(cuStreamBeginCapture_v2(stream, 0), 0);
        assert_eq!(cuMemsetD32Async(a, 4, 16, stream), 0);
        assert_eq!(cuStreamSynchronize(stream), 900, "synchronising a capture");
        let mut name = null();
        assert_eq!(cuGetErrorName(900, &mut name), 0);
        assert_eq!(
            CStr::from_ptr(name).to_str(),
            Ok("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        );
        assert_eq!(cuStreamIsCapturing(stream, &mut st), 0);
        assert_eq!(st, 2, "invalidated");
        assert_eq!(cuMemsetD32Async(a, 4, 16, stream), 901);
        assert_eq!(cuStreamEndCapture(stream, &mut captured), 901);
        assert!(captured.is_null());
        // A fork that never joins back.
        let mut s2: Handle = null_mut();
        assert_eq!(cuStreamCreate(&mut s2, 0), 0);
        let (mut fork, mut outside): (Handle, Handle) = (null_mut(), null_mut());
        assert_eq!(cuEventCreate(&mut fork, 0), 0);
        assert_eq!(cuEventCreate(&mut outside, 0), 0);
        assert_eq!(cuEventRecord(outside, null_mut()), 0);
        assert_eq!(cuStreamBeginCapture_v2(stream, 0), 0);
        assert_eq!(cuEventRecord(fork, stream), 0);
        assert_eq!(cuStreamWaitEvent(s2, fork, 0), 0);
        assert_eq!(cuMemsetD32Async(a, 5, 16, s2), 0);
        assert_eq!(cuStreamIsCapturing(s2, &mut st), 0);
        assert_eq!(st, 1, "the forked stream captures");
        assert_eq!(
            cuStreamEndCapture(s2, &mut captured),
            903,
            "ended elsewhere"
        );
        assert_eq!(cuStreamEndCapture(stream, &mut captured), 901);
        assert_eq!(cuStreamBeginCapture_v2(stream, 0), 0);
        assert_eq!(cuEventRecord(fork, stream), 0);
        assert_eq!(cuStreamWaitEvent(s2, fork, 0), 0);
        assert_eq!(cuMemsetD32Async(a, 5, 16, s2), 0);
        assert_eq!(cuStreamEndCapture(stream, &mut captured), 904, "unjoined");
        assert_eq!(cuStreamIsCapturing(s2, &mut st), 0);
        assert_eq!(st, 0, "the sequence is over on every stream");
        // The legacy stream synchronises with the capturing (blocking) stream: refused.
        assert_eq!(cuStreamBeginCapture_v2(stream, 0), 0);
        assert_eq!(cuMemsetD32Async(a, 7, 16, null_mut()), 906);
        assert_eq!(cuStreamEndCapture(stream, &mut captured), 901);
        // An event recorded outside the capture cannot be waited on inside it.
        assert_eq!(cuStreamBeginCapture_v2(stream, 0), 0);
        assert_eq!(cuStreamWaitEvent(stream, outside, 0), 905);
        assert_eq!(cuStreamEndCapture(stream, &mut captured), 901);
        // Dependencies replaced: the next node is a root.
        assert_eq!(cuStreamBeginCapture_v2(stream, 2), 0);
        assert_eq!(cuMemsetD32Async(a, 6, 16, stream), 0);
        assert_eq!(cuStreamUpdateCaptureDependencies(stream, null(), 0, 1), 0);
        assert_eq!(cuStreamUpdateCaptureDependencies(stream, null(), 0, 9), 1);
        assert_eq!(cuMemsetD32Async(a, 6, 16, stream), 0);
        assert_eq!(cuStreamEndCapture(stream, &mut captured), 0);
        assert_eq!(cuGraphGetRootNodes(captured, null_mut(), &mut n), 0);
        assert_eq!(n, 2);
        // Captured into a graph of the program's, after one of its nodes.
        let mut into: Handle = null_mut();
        assert_eq!(cuGraphCreate(&mut into, 0), 0);
        let mut first: Handle = null_mut();
        assert_eq!(cuGraphAddEmptyNode(&mut first, into, null(), 0), 0);
        assert_eq!(
            cuStreamBeginCaptureToGraph(stream, into, &set, null(), 1, 0),
            1,
            "a node of another graph"
        );
        assert_eq!(
            cuStreamBeginCaptureToGraph(stream, into, &first, null(), 1, 0),
            0
        );
        assert_eq!(cuMemsetD32Async(a, 8, 16, stream), 0);
        let mut ended: Handle = null_mut();
        assert_eq!(cuStreamEndCapture(stream, &mut ended), 0);
        assert_eq!(ended, into);
        assert_eq!(cuGraphGetEdges(into, null_mut(), null_mut(), &mut n), 0);
        assert_eq!(n, 1, "after the program's node");
        // A failed capture into it leaves the program's graph.
        assert_eq!(
            cuStreamBeginCaptureToGraph(stream, into, null(), null(), 0, 0),
            0
        );
        assert_eq!(cuStreamSynchronize(stream), 900);
        assert_eq!(cuStreamEndCapture(stream, &mut ended), 901);
        assert_eq!(cuGraphGetNodes(into, null_mut(), &mut n), 0);
        assert_eq!(n, 2);
        assert_eq!(cuGraphDestroy(into), 0);
        // The per-thread default stream may be captured, the legacy one not.
        let per_thread = 2usize as Handle;
        assert_eq!(cuStreamBeginCapture_v2(1usize as Handle, 0), 900);
        assert_eq!(cuStreamBeginCapture_v2(per_thread, 0), 0);
        assert_eq!(cuMemsetD32Async(a, 9, 16, per_thread), 0);
        assert_eq!(
            cuMemsetD32Async(a, 9, 16, null_mut()),
            906,
            "the legacy stream"
        );
        assert_eq!(cuStreamEndCapture(per_thread, &mut ended), 901);
        // A 2D memset of the array module is captured like the rest.
        assert_eq!(cuMemsetD32_v2(a, 0, 16), 0);
        assert_eq!(cuStreamBeginCapture_v2(stream, 0), 0);
        assert_eq!(cuMemsetD2D32Async(a, 16, 12, 2, 2, stream), 0);
        let mut rows: Handle = null_mut();
        assert_eq!(cuStreamEndCapture(stream, &mut rows), 0);
        assert_eq!(words(a, 6), [0; 6], "not run while captured");
        assert_eq!(cuGraphInstantiateWithFlags(&mut exec, rows, 0), 0);
        assert_eq!(cuGraphLaunch(exec, stream), 0);
        assert_eq!(cuStreamSynchronize(stream), 0);
        assert_eq!(
            words(a, 6),
            [12, 12, 0, 0, 12, 12],
            "two rows 16 bytes apart"
        );
        assert_eq!(cuGraphExecDestroy(exec), 0);
        assert_eq!(cuGraphDestroy(rows), 0);
        let mut mode = 2;
        assert_eq!(cuThreadExchangeStreamCaptureMode(&mut mode), 0);
        assert_eq!(mode, 0, "global by default");
        mode = 5;
        assert_eq!(cuThreadExchangeStreamCaptureMode(&mut mode), 1);
        let dot = std::env::temp_dir().join(format!("vgpu-graph-{}.dot", std::process::id()));
        let dot_path = std::ffi::CString::new(dot.to_str().unwrap()).unwrap();
        assert_eq!(cuGraphDebugDotPrint(captured, dot_path.as_ptr(), 0), 0);
        let text = std::fs::read_to_string(&dot).unwrap();
        std::fs::remove_file(&dot).unwrap();
        assert!(text.starts_with("digraph") && text.contains("n0 [label=\"0: memset\"]"));
        assert_eq!(
            cuGraphDebugDotPrint(captured, c"/nonexistent/x.dot".as_ptr(), 0),
            304
        );
        assert_eq!(
            cuGraphDebugDotPrint(ctx, dot_path.as_ptr(), 0),
            1,
            "not a graph"
        );
        assert_eq!(cuGraphDestroy(captured), 0);
        assert_eq!(cuGraphDestroy(clone), 0);
        assert_eq!(cuGraphDestroy(parent), 0);
        assert_eq!(cuGraphDestroy(other), 0);
    }
    host.close();
}
