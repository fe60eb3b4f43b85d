//! Cooperative launch through the library's C entry points against a served CPU backend: the
//! device attributes, `cuLaunchCooperativeKernel` and `cuLaunchKernelEx` with the cooperative
//! attribute running a grid barrier as CUDA's cooperative groups make it, and the grid the
//! occupancy queries promise as the most a cooperative launch may have (one block more is
//! `CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`, at the call), and a graph's kernel node made
//! cooperative by its attribute. One test: the driver is process-global.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::ptr::null_mut;

// The entry points are this crate's `#[no_mangle]` functions: link it.
extern crate cuda;

mod support;

type Handle = *mut c_void;

/// `CUlaunchAttribute`.
#[repr(C)]
struct LaunchAttribute {
    id: c_uint,
    pad: c_uint,
    value: [u64; 8],
}

/// `CUlaunchConfig`.
#[repr(C)]
struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: Handle,
    attrs: *const LaunchAttribute,
    num_attrs: c_uint,
}

/// `CUDA_KERNEL_NODE_PARAMS_v2`.
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

unsafe extern "C" {
    fn cuGraphCreate(g: *mut Handle, flags: c_uint) -> c_uint;
    fn cuGraphAddKernelNode_v2(
        out: *mut Handle,
        g: Handle,
        deps: *const Handle,
        n: usize,
        p: *const KernelParams,
    ) -> c_uint;
    fn cuGraphKernelNodeSetParams_v2(node: Handle, p: *const KernelParams) -> c_uint;
    fn cuGraphKernelNodeGetAttribute(node: Handle, attribute: c_int, out: *mut [u64; 8]) -> c_uint;
    fn cuGraphKernelNodeSetAttribute(
        node: Handle,
        attribute: c_int,
        value: *const [u64; 8],
    ) -> c_uint;
    fn cuGraphKernelNodeCopyAttributes(dst: Handle, src: Handle) -> c_uint;
    fn cuGraphInstantiateWithFlags(out: *mut Handle, g: Handle, flags: u64) -> c_uint;
    fn cuGraphLaunch(exec: Handle, stream: Handle) -> c_uint;
    fn cuInit(flags: c_uint) -> c_uint;
    fn cuDeviceGetAttribute(v: *mut c_int, attribute: c_int, dev: c_int) -> c_uint;
    fn cuCtxCreate_v2(ctx: *mut Handle, flags: c_uint, dev: c_int) -> c_uint;
    fn cuCtxSynchronize() -> c_uint;
    fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> c_uint;
    fn cuModuleGetFunction(f: *mut Handle, module: Handle, name: *const c_char) -> c_uint;
    fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> c_uint;
    fn cuMemsetD32_v2(dst: u64, value: c_uint, n: usize) -> c_uint;
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> c_uint;
    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
        blocks: *mut c_int,
        f: Handle,
        block_size: c_int,
        dynamic_shared: usize,
    ) -> c_uint;
    #[allow(clippy::too_many_arguments)]
    fn cuLaunchCooperativeKernel(
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
    ) -> c_uint;
    fn cuLaunchKernelEx(
        config: *const LaunchConfig,
        f: Handle,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> c_uint;
    fn cuGetErrorName(status: c_uint, out: *mut *const c_char) -> c_uint;
}

/// `meet(counter, out)`: every block's first thread adds 1 to `*counter`, the blocks meet at
/// the grid barrier (the workspace `%envreg1`/`%envreg2` give: the first block's arrival
/// counts `0x80000000 - (blocks - 1)`, the others' 1, until the top bit flips), then each
/// block's first thread stores the counter, now the grid's block count, in `out[ctaid]`.
const MEET: &CStr = c"
.version 8.5
.target sm_75
.address_size 64
.visible .entry meet(.param .u64 counter, .param .u64 out)
{
.reg .pred %p<4>;
.reg .b32 %r<16>;
.reg .b64 %rd<10>;
mov.u32 %r1, %envreg1;
mov.u32 %r2, %envreg2;
cvt.u64.u32 %rd1, %r1;
cvt.u64.u32 %rd2, %r2;
shl.b64 %rd1, %rd1, 32;
or.b64 %rd1, %rd1, %rd2;
ld.param.u64 %rd3, [counter];
ld.param.u64 %rd4, [out];
mov.u32 %r3, %ctaid.x;
mov.u32 %r4, %nctaid.x;
mov.u32 %r5, %tid.x;
setp.ne.u32 %p1, %r5, 0;
@%p1 bra WAIT;
atom.global.add.u32 %r6, [%rd3], 1;
setp.eq.u32 %p2, %r3, 0;
sub.u32 %r7, %r4, 1;
mov.u32 %r8, 0x80000000;
sub.u32 %r8, %r8, %r7;
selp.u32 %r9, %r8, 1, %p2;
atom.add.release.gpu.u32 %r10, [%rd1+4], %r9;
SPIN:
ld.acquire.gpu.u32 %r11, [%rd1+4];
xor.b32 %r12, %r11, %r10;
and.b32 %r12, %r12, 0x80000000;
setp.eq.u32 %p3, %r12, 0;
@%p3 bra SPIN;
WAIT:
bar.sync 0;
@%p1 bra DONE;
ld.global.u32 %r13, [%rd3];
mul.wide.u32 %rd5, %r3, 4;
add.u64 %rd6, %rd4, %rd5;
st.global.u32 [%rd6], %r13;
DONE:
ret;
}
";

/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`, `_COOPERATIVE_LAUNCH`,
/// `_COOPERATIVE_MULTI_DEVICE_LAUNCH`.
const MULTIPROCESSORS: c_int = 16;
const COOPERATIVE_LAUNCH: c_int = 95;
const COOPERATIVE_MULTI_DEVICE_LAUNCH: c_int = 96;
/// `CU_LAUNCH_ATTRIBUTE_COOPERATIVE`, `_CLUSTER_DIMENSION`.
const ATTRIBUTE_COOPERATIVE: c_uint = 2;
const ATTRIBUTE_CLUSTER_DIMENSION: c_uint = 4;
const THREADS: c_uint = 128;

#[test]
fn cooperative_launches_meet_at_a_grid_barrier_up_to_the_occupancy_the_queries_report() {
    let host = support::serve_cpu_backend("cooperative");
    // SAFETY: every call passes arguments as the driver API documents them: valid
    // out-pointers, buffers of the stated sizes, parameter arrays of the kernel's parameters.
    unsafe {
        assert_eq!(cuInit(0), 0);
        let mut v = -1;
        assert_eq!(cuDeviceGetAttribute(&mut v, COOPERATIVE_LAUNCH, 0), 0);
        assert_eq!(v, 1, "cooperative launch");
        assert_eq!(
            cuDeviceGetAttribute(&mut v, COOPERATIVE_MULTI_DEVICE_LAUNCH, 0),
            0
        );
        assert_eq!(v, 0, "one device: no multi-device launch");
        let mut sms = 0;
        assert_eq!(cuDeviceGetAttribute(&mut sms, MULTIPROCESSORS, 0), 0);

        let mut ctx: Handle = null_mut();
        assert_eq!(cuCtxCreate_v2(&mut ctx, 0, 0), 0);
        let mut m: Handle = null_mut();
        assert_eq!(cuModuleLoadData(&mut m, MEET.as_ptr().cast()), 0);
        let mut f: Handle = null_mut();
        assert_eq!(cuModuleGetFunction(&mut f, m, c"meet".as_ptr()), 0);
        let mut per_sm = 0;
        assert_eq!(
            cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, f, THREADS as c_int, 0),
            0
        );
        // Turing: 1024 threads per multiprocessor, 8 blocks of 128.
        assert_eq!(per_sm, 8);
        let most = (per_sm * sms) as c_uint;

        let (mut counter, mut out) = (0u64, 0u64);
        assert_eq!(cuMemAlloc_v2(&mut counter, 4), 0);
        assert_eq!(cuMemAlloc_v2(&mut out, 4 * most as usize), 0);
        let mut args = [
            (&raw mut counter).cast::<c_void>(),
            (&raw mut out).cast::<c_void>(),
        ];
        let read = |n: usize| {
            let mut words = vec![0u32; n];
            assert_eq!(cuMemcpyDtoH_v2(words.as_mut_ptr().cast(), out, 4 * n), 0);
            words
        };

        // The whole grid the queries promise meets at the barrier.
        assert_eq!(cuMemsetD32_v2(counter, 0, 1), 0);
        let r = cuLaunchCooperativeKernel(
            f,
            most,
            1,
            1,
            THREADS,
            1,
            1,
            0,
            null_mut(),
            args.as_mut_ptr(),
        );
        assert_eq!(r, 0);
        assert_eq!(cuCtxSynchronize(), 0);
        assert_eq!(read(most as usize), vec![most; most as usize]);

        // One block more cannot be resident at once: refused at the call, not sticky.
        let r = cuLaunchCooperativeKernel(
            f,
            most + 1,
            1,
            1,
            THREADS,
            1,
            1,
            0,
            null_mut(),
            args.as_mut_ptr(),
        );
        assert_eq!(r, 720);
        let mut name: *const c_char = null_mut();
        assert_eq!(cuGetErrorName(r, &mut name), 0);
        assert_eq!(
            CStr::from_ptr(name).to_str(),
            Ok("CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE")
        );
        assert_eq!(cuCtxSynchronize(), 0);

        // cuLaunchKernelEx with the cooperative attribute, as cudart launches one.
        assert_eq!(cuMemsetD32_v2(counter, 0, 1), 0);
        let blocks = most.min(3);
        let cooperative = LaunchAttribute {
            id: ATTRIBUTE_COOPERATIVE,
            pad: 0,
            value: [1, 0, 0, 0, 0, 0, 0, 0],
        };
        let config = LaunchConfig {
            grid: [blocks, 1, 1],
            block: [THREADS, 1, 1],
            shared: 0,
            stream: null_mut(),
            attrs: &cooperative,
            num_attrs: 1,
        };
        assert_eq!(
            cuLaunchKernelEx(&config, f, args.as_mut_ptr(), null_mut()),
            0
        );
        assert_eq!(cuCtxSynchronize(), 0);
        assert_eq!(read(blocks as usize), vec![blocks; blocks as usize]);
        let too_many = LaunchConfig {
            grid: [most + 1, 1, 1],
            ..config
        };
        assert_eq!(
            cuLaunchKernelEx(&too_many, f, args.as_mut_ptr(), null_mut()),
            720
        );
        // Thread block clusters need compute capability 9.0.
        let cluster = LaunchAttribute {
            id: ATTRIBUTE_CLUSTER_DIMENSION,
            pad: 0,
            value: [1 | 1 << 32, 1, 0, 0, 0, 0, 0, 0],
        };
        let clustered = LaunchConfig {
            attrs: &cluster,
            ..config
        };
        assert_eq!(
            cuLaunchKernelEx(&clustered, f, args.as_mut_ptr(), null_mut()),
            801
        );
        assert_eq!(cuCtxSynchronize(), 0);

        // A graph's kernel node is cooperative by its attribute, which it keeps when its
        // parameters change and which another node may copy.
        let mut g: Handle = null_mut();
        assert_eq!(cuGraphCreate(&mut g, 0), 0);
        let params = KernelParams {
            func: f,
            grid: [most, 1, 1],
            block: [THREADS, 1, 1],
            shared: 0,
            kernel_params: args.as_mut_ptr(),
            extra: null_mut(),
            kern: null_mut(),
            ctx: null_mut(),
        };
        let (mut node, mut other) = (null_mut(), null_mut());
        assert_eq!(
            cuGraphAddKernelNode_v2(&mut node, g, null_mut(), 0, &params),
            0
        );
        assert_eq!(cuGraphAddKernelNode_v2(&mut other, g, &node, 1, &params), 0);
        let mut value = [7u64; 8];
        assert_eq!(
            cuGraphKernelNodeGetAttribute(node, ATTRIBUTE_COOPERATIVE as c_int, &mut value),
            0
        );
        assert_eq!(value, [0; 8], "not cooperative until set");
        let on = [1u64, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(
            cuGraphKernelNodeSetAttribute(node, ATTRIBUTE_COOPERATIVE as c_int, &on),
            0
        );
        assert_eq!(cuGraphKernelNodeSetParams_v2(node, &params), 0);
        assert_eq!(
            cuGraphKernelNodeGetAttribute(node, ATTRIBUTE_COOPERATIVE as c_int, &mut value),
            0
        );
        assert_eq!(value, on, "kept across new parameters");
        assert_eq!(cuGraphKernelNodeCopyAttributes(other, node), 0);
        assert_eq!(
            cuGraphKernelNodeGetAttribute(other, ATTRIBUTE_COOPERATIVE as c_int, &mut value),
            0
        );
        assert_eq!(value, on, "copied");
        // Priority is a hint a launch may carry; a node has no such attribute here.
        assert_eq!(cuGraphKernelNodeGetAttribute(node, 8, &mut value), 801);
        let mut exec: Handle = null_mut();
        assert_eq!(cuGraphInstantiateWithFlags(&mut exec, g, 0), 0);
        assert_eq!(cuMemsetD32_v2(counter, 0, 1), 0);
        assert_eq!(cuGraphLaunch(exec, null_mut()), 0);
        assert_eq!(cuCtxSynchronize(), 0);
        // Both nodes met at their barriers: the second counted the grid again.
        assert_eq!(read(most as usize), vec![2 * most; most as usize]);
    }
    host.close();
}
