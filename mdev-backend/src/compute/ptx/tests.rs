//! Executor tests: kernels written as nvcc writes PTX, run over [`DeviceMemory`], results
//! checked against host computations.

use super::*;
use crate::compute::backend::Interrupt;
use crate::compute::memory::DeviceHeap;
use crate::compute::{DeviceMemory, Fault, GlobalMemory};

const HEADER: &str = ".version 8.5\n.target sm_75\n.address_size 64\n";

fn module(body: &str) -> Module {
    Module::parse(&format!("{HEADER}{body}")).unwrap_or_else(|e| panic!("{e}"))
}

/// The engines a [`Run`]'s launches run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engines {
    /// The interpreter over the reference memory, then compiled code over its twin: both
    /// must give the same result, output and memory ([`Run::launch_with`]).
    Both,
    /// The interpreter alone: for what only it defines (its cost units, its block bytes,
    /// timing).
    InterpreterOnly,
}

/// One engine's device memory and heap, set up as every other's.
struct Side {
    mem: DeviceMemory,
    heap: DeviceHeap,
}

impl Side {
    /// Memory with the module's variables (initialised, relocated) and a heap; the
    /// variables' addresses.
    fn new(m: &Module) -> (Side, Vec<u64>) {
        let mut mem = DeviceMemory::new(64 << 20);
        let symbols: Vec<u64> = m
            .globals()
            .iter()
            .map(|g| mem.alloc(g.size.max(1)).unwrap())
            .collect();
        for (g, &a) in m.globals().iter().zip(&symbols) {
            let mut init = g.init.clone();
            for &(at, target) in &g.relocs {
                let at = at as usize;
                init[at..at + 8].copy_from_slice(&symbols[target as usize].to_le_bytes());
            }
            mem.write(a, &init).unwrap();
        }
        let heap = DeviceHeap::new(mem.alloc(HEAP_BYTES).unwrap(), HEAP_BYTES);
        (Side { mem, heap }, symbols)
    }
}

/// The device heap of a [`Run`].
const HEAP_BYTES: u64 = 1 << 16;

/// The engines of [`Engines::Both`], in the order they run: the reference first.
const ENGINES: [Engine; 2] = [Engine::Interpreter, Engine::Compiled];

struct Run<'m> {
    m: &'m Module,
    /// Per engine of [`ENGINES`], identical memories; the interpreter's is the one tests read.
    sides: [Side; 2],
    symbols: Vec<u64>,
    /// Every allocation made, as (address, bytes): compared between the engines after each
    /// launch.
    allocations: Vec<(u64, u64)>,
    /// Launches run over [`Contended`] memory watching this address.
    contended: Option<u64>,
    /// Where launches charge their blocks' host memory.
    budget: Arc<MemoryBudget>,
    /// What stops launches besides their instruction budget.
    interrupt: Option<Arc<Interrupt>>,
    /// What runs the launches.
    engines: Engines,
}

impl<'m> Run<'m> {
    /// Launches on both engines, compared.
    fn new(m: &'m Module) -> Self {
        let (interpreted, symbols) = Side::new(m);
        let (compiled, twin_symbols) = Side::new(m);
        assert_eq!(symbols, twin_symbols, "both memories allocate alike");
        assert_eq!(interpreted.heap.base(), compiled.heap.base());
        let mut allocations: Vec<(u64, u64)> = symbols
            .iter()
            .zip(m.globals())
            .map(|(&a, g)| (a, g.size))
            .collect();
        allocations.push((interpreted.heap.base(), HEAP_BYTES));
        Run {
            m,
            sides: [interpreted, compiled],
            symbols,
            allocations,
            contended: None,
            budget: MemoryBudget::new(u64::MAX),
            interrupt: None,
            engines: Engines::Both,
        }
    }

    /// Launches on the interpreter alone: for tests of what only the interpreter defines
    /// (cost units, block bytes, timing).
    fn interpreter_only(m: &'m Module) -> Self {
        Run {
            engines: Engines::InterpreterOnly,
            ..Run::new(m)
        }
    }

    /// The device address of module variable `name`.
    fn symbol(&self, name: &str) -> u64 {
        let i = self
            .m
            .globals()
            .iter()
            .position(|g| g.name == name)
            .unwrap();
        self.symbols[i]
    }

    /// A new allocation holding `bytes`, in every engine's memory.
    fn buffer(&mut self, bytes: &[u8]) -> u64 {
        let len = bytes.len().max(1) as u64;
        let [a, b] = &mut self.sides;
        let addr = a.mem.alloc(len).unwrap();
        assert_eq!(
            b.mem.alloc(len).unwrap(),
            addr,
            "both memories allocate alike"
        );
        self.allocations.push((addr, len));
        self.write(addr, bytes);
        addr
    }

    /// Writes `bytes` at `addr` in every engine's memory.
    fn write(&self, addr: u64, bytes: &[u8]) {
        for side in &self.sides {
            side.mem.write(addr, bytes).unwrap();
        }
    }

    /// `n` bytes at `addr` of the interpreter's memory (the engines' agree after each launch).
    fn read(&self, addr: u64, n: usize) -> Vec<u8> {
        read_all(&self.sides[0].mem, addr, n)
    }

    fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        params: &[u8],
        threads: usize,
    ) -> ComputeResult<LaunchStats> {
        self.launch_with(kernel, grid, block, 0, params, threads, 1 << 30)
    }

    /// Runs the launch on the interpreter and, unless [`Engines::InterpreterOnly`], on
    /// compiled code over the twin memory, asserting the same result ([`agree`]) and the same
    /// bytes in every allocation; the interpreter's result. After a failure on several host
    /// threads the memories are not compared: how far the other blocks got is a race on
    /// either engine.
    #[allow(clippy::too_many_arguments)]
    fn launch_with(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        dynamic_shared_bytes: u32,
        params: &[u8],
        threads: usize,
        instruction_budget: u64,
    ) -> ComputeResult<LaunchStats> {
        let (reference, _) = self.launch_pair(
            kernel,
            grid,
            block,
            dynamic_shared_bytes,
            params,
            threads,
            instruction_budget,
        );
        reference
    }

    /// [`Run::launch_with`], returning both engines' results (the compiled side's `None`
    /// when [`Engines::InterpreterOnly`]).
    #[allow(clippy::too_many_arguments)]
    fn launch_pair(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        dynamic_shared_bytes: u32,
        params: &[u8],
        threads: usize,
        instruction_budget: u64,
    ) -> (
        ComputeResult<LaunchStats>,
        Option<ComputeResult<LaunchStats>>,
    ) {
        let on = |side: &Side, engine: Engine| {
            let l = Launch {
                grid,
                block,
                dynamic_shared_bytes,
                params,
                symbols: &self.symbols,
                heap: Some(&side.heap),
                interrupt: self.interrupt.as_deref(),
                instruction_budget,
                threads,
                budget: &self.budget,
                engine,
                cooperative: None,
            };
            match self.contended {
                Some(watched) => {
                    let contended = Contended {
                        mem: &side.mem,
                        watched,
                    };
                    launch(self.m, kernel, &l, &contended)
                }
                None => launch(self.m, kernel, &l, &side.mem),
            }
        };
        let reference = on(&self.sides[0], ENGINES[0]);
        if self.engines == Engines::InterpreterOnly {
            return (reference, None);
        }
        let compiled = on(&self.sides[1], ENGINES[1]);
        if let Err(why) = agree(&reference, &compiled, threads) {
            panic!("kernel {kernel}: {why}");
        }
        if reference.is_ok() || threads == 1 {
            for &(addr, len) in &self.allocations {
                if let Err(why) = same_memory(&self.sides[0].mem, &self.sides[1].mem, addr, len) {
                    panic!("kernel {kernel}: {why}");
                }
            }
        }
        (reference, Some(compiled))
    }
}

/// `n` bytes at `addr` of `mem`.
fn read_all(mem: &DeviceMemory, addr: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0; n];
    mem.read(addr, &mut v).unwrap();
    v
}

/// An error as the engines must agree on it: its variant and message, less the elapsed
/// seconds a launch timeout names (`(0.3 s)`), which are the host's timing.
pub(super) fn comparable(e: &ComputeError) -> String {
    let text = format!("{e:?}");
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(open) = rest.find('(') {
        let (before, from) = rest.split_at(open);
        out.push_str(before);
        let figure = from[1..].find(" s)").filter(|&end| {
            let n = &from[1..1 + end];
            !n.is_empty() && n.chars().all(|c| c.is_ascii_digit() || c == '.')
        });
        match figure {
            Some(end) => rest = &from[end + 4..],
            None => {
                out.push('(');
                rest = &from[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Whether the interpreter's and compiled code's results of one launch on `threads` host
/// threads agree: both succeed with the same `printf` output, or both fail with the same
/// error ([`comparable`]). On several threads which block faults first is a race on either
/// engine, so there the errors need only be of the same kind.
pub(super) fn agree(
    interpreted: &ComputeResult<LaunchStats>,
    compiled: &ComputeResult<LaunchStats>,
    threads: usize,
) -> Result<(), String> {
    let same = match (interpreted, compiled) {
        (Ok(a), Ok(b)) => a.output == b.output,
        (Err(a), Err(b)) if threads > 1 => {
            std::mem::discriminant(a) == std::mem::discriminant(b)
                && a.cuda_status() == b.cuda_status()
        }
        (Err(a), Err(b)) => comparable(a) == comparable(b),
        _ => false,
    };
    if same {
        Ok(())
    } else {
        Err(format!(
            "the interpreter gave {interpreted:?}, compiled code {compiled:?}"
        ))
    }
}

/// Whether `len` bytes at `addr` are the same in the interpreter's memory `a` and compiled
/// code's `b`; else where they first differ.
pub(super) fn same_memory(
    a: &DeviceMemory,
    b: &DeviceMemory,
    addr: u64,
    len: u64,
) -> Result<(), String> {
    let n = usize::try_from(len).unwrap();
    let (x, y) = (read_all(a, addr, n), read_all(b, addr, n));
    match x.iter().zip(&y).position(|(p, q)| p != q) {
        None => Ok(()),
        Some(i) => {
            let to = n.min(i + 16);
            Err(format!(
                "memory differs at {:#x} (offset {i} of the allocation at {addr:#x}): \
                 the interpreter wrote {:02x?}, compiled code {:02x?}",
                addr + i as u64,
                &x[i..to],
                &y[i..to]
            ))
        }
    }
}

/// Packs kernel arguments at the layout the module gives.
fn pack(m: &Module, kernel: &str, args: &[u64]) -> Vec<u8> {
    crate::compute::backend::pack_params(&m.kernel(kernel).unwrap().params, args)
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn to_u32s(b: &[u8]) -> Vec<u32> {
    b.chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

const VECADD: &str = r#"
.visible .entry _Z6vecAddPKfS0_Pfi(
	.param .u64 _Z6vecAddPKfS0_Pfi_param_0,
	.param .u64 _Z6vecAddPKfS0_Pfi_param_1,
	.param .u64 _Z6vecAddPKfS0_Pfi_param_2,
	.param .u32 _Z6vecAddPKfS0_Pfi_param_3
)
{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<6>;
	.reg .f32 	%f<4>;
	.reg .b64 	%rd<11>;

	ld.param.u64 	%rd1, [_Z6vecAddPKfS0_Pfi_param_0];
	ld.param.u64 	%rd2, [_Z6vecAddPKfS0_Pfi_param_1];
	ld.param.u64 	%rd3, [_Z6vecAddPKfS0_Pfi_param_2];
	ld.param.u32 	%r2, [_Z6vecAddPKfS0_Pfi_param_3];
	mov.u32 	%r3, %ctaid.x;
	mov.u32 	%r4, %ntid.x;
	mov.u32 	%r5, %tid.x;
	mad.lo.s32 	%r1, %r3, %r4, %r5;
	setp.ge.s32 	%p1, %r1, %r2;
	@%p1 bra 	$L__BB0_2;

	cvta.to.global.u64 	%rd4, %rd1;
	mul.wide.s32 	%rd5, %r1, 4;
	add.s64 	%rd6, %rd4, %rd5;
	cvta.to.global.u64 	%rd7, %rd2;
	add.s64 	%rd8, %rd7, %rd5;
	ld.global.nc.f32 	%f1, [%rd8];
	ld.global.nc.f32 	%f2, [%rd6];
	add.f32 	%f3, %f2, %f1;
	cvta.to.global.u64 	%rd9, %rd3;
	add.s64 	%rd10, %rd9, %rd5;
	st.global.f32 	[%rd10], %f3;

$L__BB0_2:
	ret;

}
"#;

#[test]
fn vector_add_matches_the_host_on_any_number_of_threads() {
    let m = module(VECADD);
    assert_eq!(m.kernels().collect::<Vec<_>>(), ["_Z6vecAddPKfS0_Pfi"]);
    let k = m.kernel("_Z6vecAddPKfS0_Pfi").unwrap();
    assert_eq!(k.param_bytes, 28);
    assert_eq!(
        k.params[3],
        ParamInfo {
            offset: 24,
            size: 4,
            align: 4
        }
    );
    let n = 1000usize;
    let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f32> = (0..n).map(|i| 1.0 / (i as f32 + 1.0)).collect();
    for threads in [1, 3] {
        let mut r = Run::new(&m);
        let (da, db) = (r.buffer(&f32s(&a)), r.buffer(&f32s(&b)));
        let dc = r.buffer(&vec![0; n * 4]);
        let params = pack(&m, "_Z6vecAddPKfS0_Pfi", &[da, db, dc, n as u64]);
        let stats = r
            .launch(
                "_Z6vecAddPKfS0_Pfi",
                [4, 1, 1],
                [256, 1, 1],
                &params,
                threads,
            )
            .unwrap();
        assert_eq!(stats.blocks, 4);
        assert!(stats.warp_instructions > 0);
        let c = to_f32s(&r.read(dc, n * 4));
        for i in 0..n {
            assert_eq!(c[i].to_bits(), (a[i] + b[i]).to_bits(), "element {i}");
        }
    }
}

#[test]
fn an_out_of_range_store_is_an_illegal_address_and_touches_nothing_else() {
    let m = module(VECADD);
    let mut r = Run::new(&m);
    let n = 64usize;
    let da = r.buffer(&f32s(&vec![1.0; n]));
    let dc = r.buffer(&vec![0; n * 4]);
    let neighbour = r.buffer(&[0xaa; 4096]);
    // n larger than the buffers: lanes past 64 fault.
    let params = pack(&m, "_Z6vecAddPKfS0_Pfi", &[da, da, dc, 10_000]);
    let err = r
        .launch("_Z6vecAddPKfS0_Pfi", [40, 1, 1], [256, 1, 1], &params, 2)
        .unwrap_err();
    assert!(matches!(err, ComputeError::IllegalAddress(_)), "{err:?}");
    assert_eq!(err.cuda_status(), 700);
    assert_eq!(r.read(neighbour, 4096), vec![0xaa; 4096]);
}

const MATMUL: &str = r#"
.visible .entry matmul(
	.param .u64 matmul_param_0,
	.param .u64 matmul_param_1,
	.param .u64 matmul_param_2,
	.param .u32 matmul_param_3
)
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<32>;
	.reg .f32 	%f<8>;
	.reg .b64 	%rd<16>;
	// __shared__ float As[16][16], Bs[16][16];
	.shared .align 4 .b8 _ZZ6matmulE2As[1024];
	.shared .align 4 .b8 _ZZ6matmulE2Bs[1024];

	ld.param.u64 	%rd1, [matmul_param_0];
	ld.param.u64 	%rd2, [matmul_param_1];
	ld.param.u64 	%rd3, [matmul_param_2];
	ld.param.u32 	%r1, [matmul_param_3];
	cvta.to.global.u64 	%rd1, %rd1;
	cvta.to.global.u64 	%rd2, %rd2;
	cvta.to.global.u64 	%rd3, %rd3;
	mov.u32 	%r2, %tid.x;
	mov.u32 	%r3, %tid.y;
	mov.u32 	%r4, %ctaid.x;
	mov.u32 	%r5, %ctaid.y;
	shl.b32 	%r6, %r5, 4;
	add.s32 	%r6, %r6, %r3;          // row
	shl.b32 	%r7, %r4, 4;
	add.s32 	%r7, %r7, %r2;          // col
	mov.f32 	%f1, 0f00000000;        // sum
	mov.u32 	%r8, 0;                 // tile start
	mov.u32 	%r20, _ZZ6matmulE2As;
	mov.u32 	%r21, _ZZ6matmulE2Bs;
	shl.b32 	%r22, %r3, 6;           // ty*64
	shl.b32 	%r23, %r2, 2;           // tx*4
	add.s32 	%r24, %r20, %r22;
	add.s32 	%r24, %r24, %r23;       // &As[ty][tx]
	add.s32 	%r25, %r21, %r22;
	add.s32 	%r25, %r25, %r23;       // &Bs[ty][tx]
$L__tile:
	setp.ge.s32 	%p1, %r8, %r1;
	@%p1 bra 	$L__done;
	// As[ty][tx] = A[row*n + t + tx]
	mad.lo.s32 	%r9, %r6, %r1, %r8;
	add.s32 	%r9, %r9, %r2;
	mul.wide.s32 	%rd4, %r9, 4;
	add.s64 	%rd5, %rd1, %rd4;
	ld.global.f32 	%f2, [%rd5];
	st.shared.f32 	[%r24], %f2;
	// Bs[ty][tx] = B[(t + ty)*n + col]
	add.s32 	%r10, %r8, %r3;
	mad.lo.s32 	%r10, %r10, %r1, %r7;
	mul.wide.s32 	%rd6, %r10, 4;
	add.s64 	%rd7, %rd2, %rd6;
	ld.global.f32 	%f3, [%rd7];
	st.shared.f32 	[%r25], %f3;
	bar.sync 	0;
	mov.u32 	%r11, 0;
$L__k:
	// sum += As[ty][k] * Bs[k][tx]
	shl.b32 	%r12, %r11, 2;
	add.s32 	%r13, %r20, %r22;
	add.s32 	%r13, %r13, %r12;
	ld.shared.f32 	%f4, [%r13];
	shl.b32 	%r14, %r11, 6;
	add.s32 	%r15, %r21, %r14;
	add.s32 	%r15, %r15, %r23;
	ld.shared.f32 	%f5, [%r15];
	fma.rn.f32 	%f1, %f4, %f5, %f1;
	add.s32 	%r11, %r11, 1;
	setp.lt.u32 	%p2, %r11, 16;
	@%p2 bra 	$L__k;
	bar.sync 	0;
	add.s32 	%r8, %r8, 16;
	bra.uni 	$L__tile;
$L__done:
	mad.lo.s32 	%r16, %r6, %r1, %r7;
	mul.wide.s32 	%rd8, %r16, 4;
	add.s64 	%rd9, %rd3, %rd8;
	st.global.f32 	[%rd9], %f1;
	ret;
}
"#;

#[test]
fn tiled_matrix_multiply_with_shared_memory_and_barriers() {
    let m = module(MATMUL);
    assert_eq!(m.kernel("matmul").unwrap().static_shared_bytes, 2048);
    let n = 48usize;
    let a: Vec<f32> = (0..n * n).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i * 5) % 11) as f32 * 0.25).collect();
    let mut expect = vec![0f32; n * n];
    for row in 0..n {
        for col in 0..n {
            let mut sum = 0f32;
            for t in (0..n).step_by(16) {
                for k in 0..16 {
                    sum = a[row * n + t + k].mul_add(b[(t + k) * n + col], sum);
                }
            }
            expect[row * n + col] = sum;
        }
    }
    let mut r = Run::new(&m);
    let (da, db) = (r.buffer(&f32s(&a)), r.buffer(&f32s(&b)));
    let dc = r.buffer(&vec![0; n * n * 4]);
    let params = pack(&m, "matmul", &[da, db, dc, n as u64]);
    r.launch("matmul", [3, 3, 1], [16, 16, 1], &params, 4)
        .unwrap();
    let c = to_f32s(&r.read(dc, n * n * 4));
    for i in 0..n * n {
        assert_eq!(c[i].to_bits(), expect[i].to_bits(), "element {i}");
    }
}

const REDUCE: &str = r#"
.visible .entry reduce(
	.param .u64 reduce_param_0,
	.param .u64 reduce_param_1,
	.param .u32 reduce_param_2
)
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<20>;
	.reg .b64 	%rd<8>;

	ld.param.u64 	%rd1, [reduce_param_0];
	ld.param.u64 	%rd2, [reduce_param_1];
	ld.param.u32 	%r1, [reduce_param_2];
	cvta.to.global.u64 	%rd1, %rd1;
	cvta.to.global.u64 	%rd2, %rd2;
	mov.u32 	%r2, %ctaid.x;
	mov.u32 	%r3, %ntid.x;
	mov.u32 	%r4, %tid.x;
	mad.lo.s32 	%r5, %r2, %r3, %r4;
	mov.u32 	%r6, 0;
	setp.ge.s32 	%p1, %r5, %r1;
	@%p1 bra 	$L__skip;
	mul.wide.s32 	%rd3, %r5, 4;
	add.s64 	%rd4, %rd1, %rd3;
	ld.global.u32 	%r6, [%rd4];
$L__skip:
	shfl.sync.down.b32 	%r7, %r6, 16, 31, -1;
	add.s32 	%r6, %r6, %r7;
	shfl.sync.down.b32 	%r7, %r6, 8, 31, -1;
	add.s32 	%r6, %r6, %r7;
	shfl.sync.down.b32 	%r7, %r6, 4, 31, -1;
	add.s32 	%r6, %r6, %r7;
	shfl.sync.down.b32 	%r7, %r6, 2, 31, -1;
	add.s32 	%r6, %r6, %r7;
	shfl.sync.down.b32 	%r7|%p3, %r6, 1, 31, -1;
	add.s32 	%r6, %r6, %r7;
	mov.u32 	%r8, %laneid;
	setp.ne.s32 	%p2, %r8, 0;
	@%p2 bra 	$L__end;
	atom.global.add.u32 	%r9, [%rd2], %r6;
$L__end:
	ret;
}
"#;

#[test]
fn warp_shuffle_reduction_with_atomics() {
    let m = module(REDUCE);
    let n = 10_000usize;
    let v: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) >> 20)
        .collect();
    let want: u32 = v.iter().fold(0u32, |s, x| s.wrapping_add(*x));
    for threads in [1, 4] {
        let mut r = Run::new(&m);
        let dv = r.buffer(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>());
        let dsum = r.buffer(&[0; 4]);
        let params = pack(&m, "reduce", &[dv, dsum, n as u64]);
        r.launch(
            "reduce",
            [(n as u32).div_ceil(256), 1, 1],
            [256, 1, 1],
            &params,
            threads,
        )
        .unwrap();
        assert_eq!(to_u32s(&r.read(dsum, 4)), [want]);
    }
}

#[test]
fn divergent_lanes_reconverge_and_vote_sees_the_whole_warp() {
    // Each lane loops tid times (per-lane trip counts), odd lanes take another path, then all
    // lanes vote and write the ballot and their own count.
    let m = module(
        r#"
.visible .entry diverge(.param .u64 out)
{
	.reg .pred %p<4>;
	.reg .b32 %r<12>;
	.reg .b64 %rd<6>;
	ld.param.u64 %rd1, [out];
	cvta.to.global.u64 %rd1, %rd1;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, 0;
	mov.u32 %r3, 0;
$L__loop:
	setp.ge.u32 %p1, %r3, %r1;
	@%p1 bra $L__after;
	add.s32 %r2, %r2, 3;
	add.s32 %r3, %r3, 1;
	bra.uni $L__loop;
$L__after:
	and.b32 %r4, %r1, 1;
	setp.eq.s32 %p2, %r4, 1;
	@!%p2 bra $L__even;
	mul.lo.s32 %r2, %r2, 10;
	bra.uni $L__join;
$L__even:
	add.s32 %r2, %r2, 1000;
$L__join:
	setp.gt.u32 %p3, %r2, 500;
	vote.sync.ballot.b32 %r5, %p3, -1;
	activemask.b32 %r6;
	mul.wide.u32 %rd2, %r1, 8;
	add.s64 %rd3, %rd1, %rd2;
	st.global.v2.u32 [%rd3], {%r2, %r5};
	setp.eq.s32 %p1, %r1, 0;
	@!%p1 bra $L__end;
	st.global.u32 [%rd1+512], %r6;
$L__end:
	ret;
}
"#,
    );
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 516]);
    let params = pack(&m, "diverge", &[out]);
    r.launch("diverge", [1, 1, 1], [32, 1, 1], &params, 1)
        .unwrap();
    let words = to_u32s(&r.read(out, 516));
    let mut ballot = 0u32;
    let vals: Vec<u32> = (0..32u32)
        .map(|t| if t % 2 == 1 { 3 * t * 10 } else { 3 * t + 1000 })
        .collect();
    for (t, v) in vals.iter().enumerate() {
        if *v > 500 {
            ballot |= 1 << t;
        }
    }
    for t in 0..32 {
        assert_eq!(words[2 * t], vals[t], "lane {t}");
        assert_eq!(words[2 * t + 1], ballot, "lane {t} ballot");
    }
    assert_eq!(
        words[128],
        u32::MAX,
        "every lane is active again at the join"
    );
}

#[test]
fn printf_goes_to_the_launch_output_in_block_order() {
    let m = module(
        r#"
.extern .func (.param .b32 func_retval0) vprintf
(
	.param .b64 vprintf_param_0,
	.param .b64 vprintf_param_1
)
;
.global .align 1 .b8 $str[24] = {98, 108, 111, 99, 107, 32, 37, 100, 32, 116, 104, 114, 101, 97, 100, 32, 37, 100, 32, 37, 102, 10, 0};

.visible .entry hello()
{
	.local .align 8 .b8 	__local_depot0[16];
	.reg .b64 	%SP;
	.reg .b64 	%SPL;
	.reg .pred 	%p<2>;
	.reg .b32 	%r<5>;
	.reg .f64 	%fd<2>;
	.reg .b64 	%rd<5>;

	mov.u64 	%SPL, __local_depot0;
	cvta.local.u64 	%SP, %SPL;
	mov.u32 	%r1, %tid.x;
	setp.gt.u32 	%p1, %r1, 1;
	@%p1 bra 	$L__end;
	add.u64 	%rd1, %SP, 0;
	add.u64 	%rd2, %SPL, 0;
	mov.u32 	%r2, %ctaid.x;
	st.local.v2.u32 	[%rd2], {%r2, %r1};
	cvt.rn.f64.u32 	%fd1, %r1;
	st.local.f64 	[%rd2+8], %fd1;
	mov.u64 	%rd3, $str;
	cvta.global.u64 	%rd4, %rd3;
	{ // callseq 0, 0
	.param .b64 param0;
	st.param.b64 	[param0], %rd4;
	.param .b64 param1;
	st.param.b64 	[param1], %rd1;
	.param .b32 retval0;
	call.uni (retval0), vprintf, (param0, param1);
	ld.param.b32 	%r3, [retval0];
	} // callseq 0
$L__end:
	ret;
}
"#,
    );
    let r = Run::new(&m);
    let stats = r.launch("hello", [3, 1, 1], [64, 1, 1], &[], 3).unwrap();
    assert_eq!(
        stats.output,
        "block 0 thread 0 0.000000\nblock 0 thread 1 1.000000\nblock 1 thread 0 0.000000\n\
         block 1 thread 1 1.000000\nblock 2 thread 0 0.000000\nblock 2 thread 1 1.000000\n"
    );
}

#[test]
fn a_runaway_kernel_stops_at_its_budget_as_a_launch_timeout() {
    let m = module(
        r#"
.visible .entry spin(.param .u64 flag)
{
	.reg .pred %p<2>;
	.reg .b32 %r<3>;
	.reg .b64 %rd<3>;
	ld.param.u64 %rd1, [flag];
	cvta.to.global.u64 %rd2, %rd1;
$L__wait:
	ld.volatile.global.u32 %r1, [%rd2];
	setp.eq.s32 %p1, %r1, 0;
	@%p1 bra $L__wait;
	ret;
}
"#,
    );
    let mut r = Run::new(&m);
    let flag = r.buffer(&[0; 4]);
    let params = pack(&m, "spin", &[flag]);
    let start = std::time::Instant::now();
    let err = r
        .launch_with("spin", [64, 1, 1], [128, 1, 1], 0, &params, 2, 2_000_000)
        .unwrap_err();
    assert!(matches!(err, ComputeError::LaunchTimeout(_)), "{err:?}");
    assert_eq!(err.cuda_status(), 702);
    assert!(start.elapsed() < std::time::Duration::from_secs(30));
    // With the flag set it finishes.
    r.write(flag, &1u32.to_le_bytes());
    r.launch_with("spin", [64, 1, 1], [128, 1, 1], 0, &params, 2, 2_000_000)
        .unwrap();
}

#[test]
fn a_huge_grid_of_empty_blocks_stops_at_the_budget_too() {
    // Found by the compute_wire fuzz target: 2^31 blocks that each run one instruction never
    // reached the budget check inside a block.
    let m = module(".visible .entry nothing()\n{\nret;\n}\n");
    let r = Run::new(&m);
    let start = std::time::Instant::now();
    let err = r
        .launch_with(
            "nothing",
            [i32::MAX as u32, 1, 1],
            [1, 1, 1],
            0,
            &[],
            2,
            100_000,
        )
        .unwrap_err();
    assert!(matches!(err, ComputeError::LaunchTimeout(_)), "{err:?}");
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
    // A small grid of the same kernel fits.
    r.launch_with("nothing", [1000, 1, 1], [1, 1, 1], 0, &[], 2, 100_000)
        .unwrap();
}

/// Device memory where another block adds 1 to the word at `watched` before every read of
/// it, as a block running on another host thread may between any two reads.
struct Contended<'a> {
    mem: &'a DeviceMemory,
    watched: u64,
}

impl GlobalMemory for Contended<'_> {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), Fault> {
        if addr == self.watched {
            self.mem.atomic_update(addr, 4, &mut |v| v + 1)?;
        }
        self.mem.read(addr, buf)
    }
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), Fault> {
        self.mem.write(addr, data)
    }
    fn atomic_update(
        &self,
        addr: u64,
        width: u8,
        update: &mut dyn FnMut(u64) -> u64,
    ) -> Result<u64, Fault> {
        self.mem.atomic_update(addr, width, update)
    }
}

#[test]
fn the_lanes_of_one_load_see_one_value_while_another_block_writes_it() {
    // GCC's uniform-SIMT code (OpenMP offloading) has every lane load a shared variable, one
    // lane's atomic compare-exchange decide, and every lane compare its own loaded value with
    // the result: lanes that saw two values of one load split where the code assumes they
    // cannot (omp_features hung at a barrier about once in 300 runs). Each thread stores the
    // value its load of the contended word returned.
    let m = module(
        r#"
.visible .entry k(.param .u64 word, .param .u64 out)
{
	.reg .b32 %r<3>;
	.reg .b64 %rd<6>;
	ld.param.u64 %rd1, [word];
	ld.param.u64 %rd2, [out];
	mov.u32 %r1, %tid.x;
	ld.global.u32 %r2, [%rd1];
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd2, %rd3;
	st.global.u32 [%rd4], %r2;
	ret;
}
"#,
    );
    // Lock-step semantics (one value per load for a warp): the interpreter's alone; the
    // compiled engine runs such code (GCC's uniform SIMT) on the interpreter too.
    let mut r = Run::interpreter_only(&m);
    let word = r.buffer(&[0; 4]);
    let out = r.buffer(&[0; 64 * 4]);
    let params = pack(&m, "k", &[word, out]);
    r.contended = Some(word);
    r.launch("k", [1, 1, 1], [64, 1, 1], &params, 1).unwrap();
    let seen = to_u32s(&r.read(out, 64 * 4));
    // One read per warp: the first warp's lanes all saw 1, the second warp's all 2.
    assert_eq!(seen[..32], [1; 32], "{seen:?}");
    assert_eq!(seen[32..], [2; 32], "{seen:?}");
}

/// Runs a one-thread kernel `body` with `%r1..` loaded from `inputs` (u64 words at param
/// `in`) and returns the u64 words it stores to `out`.
fn scalar(body: &str, regs: &str, inputs: &[u64], outputs: usize) -> Vec<u64> {
    let m = module(&format!(
        ".visible .entry k(.param .u64 in, .param .u64 out)\n{{\n.reg .b64 %rdin, %rdout;\n{regs}\n\
         ld.param.u64 %rdin, [in];\nld.param.u64 %rdout, [out];\n{body}\nret;\n}}\n"
    ));
    let mut r = Run::new(&m);
    let input = r.buffer(
        &inputs
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>(),
    );
    let out = r.buffer(&vec![0; outputs * 8]);
    let params = pack(&m, "k", &[input, out]);
    r.launch("k", [1, 1, 1], [1, 1, 1], &params, 1).unwrap();
    r.read(out, outputs * 8)
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn integer_semantics_at_the_edges() {
    let out = scalar(
        r#"
	ld.global.u32 %r1, [%rdin];
	ld.global.u32 %r2, [%rdin+8];
	mul.hi.s32 %r3, %r1, %r2;
	mul.hi.u32 %r4, %r1, %r2;
	mul.wide.s32 %rd1, %r1, %r2;
	shr.s32 %r5, %r1, 40;
	shr.u32 %r6, %r1, 4;
	div.s32 %r7, %r1, %r2;
	rem.s32 %r8, %r1, %r2;
	div.u32 %r9, %r1, 0;
	bfe.s32 %r10, %r1, 4, 8;
	brev.b32 %r11, %r2;
	popc.b32 %r12, %r1;
	clz.b32 %r13, %r2;
	add.sat.s32 %r14, %r1, -2147483648;
	prmt.b32 %r15, %r1, %r2, 0x7250;
	cvt.u64.u32 %rd2, %r3;
	st.global.u64 [%rdout], %rd2;
	cvt.u64.u32 %rd2, %r4;
	st.global.u64 [%rdout+8], %rd2;
	st.global.u64 [%rdout+16], %rd1;
	st.global.v2.u32 [%rdout+24], {%r5, %r6};
	st.global.v4.u32 [%rdout+32], {%r7, %r8, %r9, %r10};
	st.global.v4.u32 [%rdout+48], {%r11, %r12, %r13, %r14};
	st.global.u32 [%rdout+64], %r15;
"#,
        ".reg .b32 %r<16>;\n.reg .b64 %rd<3>;",
        &[(-123_456_789i32) as u32 as u64, 987_654_321],
        9,
    );
    let (a, b) = (-123_456_789i32, 987_654_321i32);
    assert_eq!(out[0] as u32, ((i64::from(a) * i64::from(b)) >> 32) as u32);
    assert_eq!(
        out[1] as u32,
        ((u64::from(a as u32) * u64::from(b as u32)) >> 32) as u32
    );
    assert_eq!(out[2] as i64, i64::from(a) * i64::from(b));
    assert_eq!(
        out[3] as u32,
        (a >> 31) as u32,
        "shr.s32 past the width fills with the sign"
    );
    assert_eq!((out[3] >> 32) as u32, (a as u32) >> 4);
    assert_eq!(out[4] as u32, (a / b) as u32);
    assert_eq!((out[4] >> 32) as u32, (a % b) as u32);
    assert_eq!(
        out[5] as u32,
        u32::MAX,
        "unsigned division by zero gives all ones"
    );
    assert_eq!(
        (out[5] >> 32) as u32,
        (((a as u32) << 20) as i32 >> 24) as u32
    );
    assert_eq!(out[6] as u32, (b as u32).reverse_bits());
    assert_eq!((out[6] >> 32) as u32, (a as u32).count_ones());
    assert_eq!(out[7] as u32, (b as u32).leading_zeros());
    assert_eq!((out[7] >> 32) as u32, i32::MIN as u32, "add.sat clamps");
    let bytes = (u64::from(b as u32) << 32) | u64::from(a as u32);
    let sel = |s: u64| (bytes >> (s * 8)) & 0xff;
    assert_eq!(
        out[8] as u32,
        (sel(0) | sel(5) << 8 | sel(2) << 16 | sel(7) << 24) as u32
    );
}

#[test]
fn float_semantics_fma_rounding_and_conversions() {
    let x = 1.0f32 + f32::EPSILON;
    let y = 3.0f32.sqrt();
    let out = scalar(
        r#"
	ld.global.f32 %f1, [%rdin];
	ld.global.f32 %f2, [%rdin+8];
	fma.rn.f32 %f3, %f1, %f2, 0fBF800000;
	mul.rz.f32 %f4, %f2, %f2;
	mul.rp.f32 %f5, %f2, %f2;
	add.rm.f32 %f6, %f1, 0f33000000;
	add.rp.f32 %f7, %f1, 0f33000000;
	cvt.rzi.s32.f32 %r1, 0fC0600000;
	cvt.rni.s32.f32 %r2, 0f40200000;
	cvt.rmi.s32.f32 %r3, 0fC0600000;
	cvt.rpi.s32.f32 %r4, 0f4f000000;
	cvt.rn.f32.s32 %f8, %r2;
	cvt.rz.f32.u32 %f9, -1;
	cvt.rn.f32.u32 %f10, -1;
	div.rn.f32 %f11, %f1, %f2;
	sqrt.rn.f32 %f12, %f2;
	min.f32 %f13, %f2, 0f7FC00000;
	setp.gtu.f32 %p1, %f2, 0f7FC00000;
	selp.u32 %r5, 1, 0, %p1;
	cvt.sat.f32.f32 %f14, 0f40000000;
	st.global.v2.f32 [%rdout], {%f3, %f4};
	st.global.v2.f32 [%rdout+8], {%f5, %f6};
	st.global.v2.f32 [%rdout+16], {%f7, %f8};
	st.global.v4.u32 [%rdout+32], {%r1, %r2, %r3, %r4};
	st.global.v2.f32 [%rdout+48], {%f9, %f10};
	st.global.v2.f32 [%rdout+56], {%f11, %f12};
	st.global.v2.f32 [%rdout+64], {%f13, %f14};
	st.global.u32 [%rdout+72], %r5;
"#,
        ".reg .pred %p<2>;\n.reg .b32 %r<6>;\n.reg .f32 %f<15>;",
        &[u64::from(x.to_bits()), u64::from(y.to_bits())],
        10,
    );
    let out = [&out[..3], &out[4..]].concat();
    let f = |i: usize, hi: bool| {
        f32::from_bits(if hi {
            (out[i] >> 32) as u32
        } else {
            out[i] as u32
        })
    };
    let i = |k: usize, hi: bool| {
        if hi {
            (out[k] >> 32) as u32 as i32
        } else {
            out[k] as u32 as i32
        }
    };
    assert_eq!(
        f(0, false).to_bits(),
        x.mul_add(y, -1.0).to_bits(),
        "one rounding"
    );
    let exact = f64::from(y) * f64::from(y);
    assert!(f64::from(f(0, true)) <= exact && f64::from(f(1, false)) >= exact);
    assert_eq!(
        f(1, false).to_bits() - f(0, true).to_bits(),
        1,
        "rz and rp bracket the product"
    );
    let tiny = f32::from_bits(0x3300_0000); // 2^-25: below half an ulp of 1+eps
    assert_eq!(f(1, true), x, "rm keeps 1+eps");
    assert_eq!(f(2, false).to_bits(), x.to_bits() + 1, "rp moves up");
    assert!(tiny > 0.0);
    assert_eq!(
        (i(3, false), i(3, true), i(4, false), i(4, true)),
        (-3, 2, -4, i32::MAX)
    );
    assert_eq!(f(2, true), 2.0);
    assert_eq!(f(5, false).to_bits(), 0x4f7f_ffff, "u32::MAX toward zero");
    assert_eq!(f(5, true), 4_294_967_296.0);
    assert_eq!(f(6, false).to_bits(), (x / y).to_bits());
    assert_eq!(f(6, true).to_bits(), y.sqrt().to_bits());
    assert_eq!(f(7, false), y, "min ignores a NaN operand");
    assert_eq!(f(7, true), 1.0);
    assert_eq!(out[8] as u32, 1, "unordered compare with NaN is true");
}

#[test]
fn device_functions_are_called_with_parameters_and_return_values() {
    let m = module(
        r#"
.func  (.param .b32 func_retval0) _Z3sqri(
	.param .b32 _Z3sqri_param_0
)
{
	.reg .b32 	%r<3>;
	ld.param.u32 	%r1, [_Z3sqri_param_0];
	mul.lo.s32 	%r2, %r1, %r1;
	st.param.b32 	[func_retval0+0], %r2;
	ret;
}

.visible .entry k(.param .u64 out)
{
	.reg .b32 	%r<4>;
	.reg .b64 	%rd<4>;
	ld.param.u64 	%rd1, [out];
	mov.u32 	%r1, %tid.x;
	{
	.reg .b32 temp_param_reg;
	.param .b32 param0;
	st.param.b32 	[param0+0], %r1;
	.param .b32 retval0;
	call.uni (retval0), _Z3sqri, (param0);
	ld.param.b32 	%r2, [retval0+0];
	}
	mul.wide.u32 	%rd2, %r1, 4;
	add.s64 	%rd3, %rd1, %rd2;
	st.u32 	[%rd3], %r2;
	ret;
}
"#,
    );
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 64 * 4]);
    let params = pack(&m, "k", &[out]);
    r.launch("k", [1, 1, 1], [64, 1, 1], &params, 1).unwrap();
    assert_eq!(
        to_u32s(&r.read(out, 256)),
        (0..64u32).map(|t| t * t).collect::<Vec<_>>()
    );
}

#[test]
fn dynamic_shared_memory_and_globals_with_initialisers() {
    let m = module(
        r#"
.const .align 4 .b8 table[16] = {1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0};
.global .align 4 .u32 counter = 100;
.extern .shared .align 16 .b8 smem[];
.visible .entry k(.param .u64 out)
{
	.reg .pred %p<2>;
	.reg .b32 %r<10>;
	.reg .b64 %rd<6>;
	ld.param.u64 %rd1, [out];
	mov.u32 %r1, %tid.x;
	and.b32 %r2, %r1, 3;
	shl.b32 %r3, %r2, 2;
	mov.u64 %rd2, table;
	cvt.u64.u32 %rd3, %r3;
	add.s64 %rd4, %rd2, %rd3;
	ld.const.u32 %r4, [%rd4];
	mov.u32 %r5, smem;
	shl.b32 %r6, %r1, 2;
	add.s32 %r7, %r5, %r6;
	st.shared.u32 [%r7], %r4;
	bar.sync 0;
	// thread t reads smem[(t+1) % ntid]
	add.s32 %r8, %r1, 1;
	mov.u32 %r9, %ntid.x;
	rem.u32 %r8, %r8, %r9;
	shl.b32 %r8, %r8, 2;
	add.s32 %r8, %r5, %r8;
	ld.shared.u32 %r4, [%r8];
	atom.global.add.u32 %r9, [counter], %r4;
	mul.wide.u32 %rd5, %r1, 4;
	add.s64 %rd5, %rd1, %rd5;
	st.global.u32 [%rd5], %r4;
	ret;
}
"#,
    );
    assert_eq!(m.globals().len(), 2);
    assert_eq!(m.globals()[1].init, 100u32.to_le_bytes());
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 256]);
    let params = pack(&m, "k", &[out]);
    let err = r
        .launch_with("k", [1, 1, 1], [64, 1, 1], 300 * 1024, &params, 1, 1 << 20)
        .unwrap_err();
    assert!(matches!(err, ComputeError::LaunchOutOfResources(_)));
    // 64 threads need 256 bytes of dynamic shared memory; with less, the stores fault.
    let err = r
        .launch_with("k", [1, 1, 1], [64, 1, 1], 128, &params, 1, 1 << 20)
        .unwrap_err();
    assert!(matches!(err, ComputeError::IllegalAddress(_)), "{err:?}");
    let r = {
        let mut r = Run::new(&m);
        let out = r.buffer(&[0; 256]);
        let params = pack(&m, "k", &[out]);
        r.launch_with("k", [1, 1, 1], [64, 1, 1], 256, &params, 1, 1 << 20)
            .unwrap();
        let got = to_u32s(&r.read(out, 256));
        assert_eq!(
            got,
            (0..64u32).map(|t| (t + 1) % 64 % 4 + 1).collect::<Vec<_>>()
        );
        r
    };
    let counter = r.symbol("counter");
    let total: u32 = 100 + (0..64u32).map(|t| (t + 1) % 64 % 4 + 1).sum::<u32>();
    assert_eq!(to_u32s(&r.read(counter, 4)), [total]);
}

#[test]
fn launch_arguments_are_validated_before_anything_runs() {
    let m = module(VECADD);
    let r = Run::new(&m);
    let params = pack(&m, "_Z6vecAddPKfS0_Pfi", &[0, 0, 0, 0]);
    let k = "_Z6vecAddPKfS0_Pfi";
    for (grid, block) in [
        ([0, 1, 1], [32, 1, 1]),
        ([1, 1, 1], [0, 1, 1]),
        ([1, 1, 1], [1025, 1, 1]),
        ([1, 1, 1], [32, 32, 2]),
        ([1, 1, 1], [1, 1, 65]),
        ([1, 65536, 1], [1, 1, 1]),
    ] {
        let err = r.launch(k, grid, block, &params, 1).unwrap_err();
        assert!(
            matches!(err, ComputeError::InvalidValue(_)),
            "{grid:?} {block:?}: {err:?}"
        );
    }
    assert!(matches!(
        r.launch(k, [1, 1, 1], [1, 1, 1], &params[..20], 1),
        Err(ComputeError::InvalidValue(_))
    ));
    assert!(matches!(
        r.launch("nope", [1, 1, 1], [1, 1, 1], &params, 1),
        Err(ComputeError::NotFound(_))
    ));
}

#[test]
fn errors_name_the_line_of_their_instruction_after_comments_and_blank_lines() {
    // Line 4 (after the three-line header) holds the entry; the faulting store is on line 11.
    let m = module(
        ".visible .entry k(.param .u64 p)\n{\n.reg .b64 %rd<2>;\nld.param.u64 %rd1, [p];\n\
         // a comment line\n\n// #APP\nst.global.u32 [%rd1], 1;\nret;\n}\n",
    );
    let r = Run::new(&m);
    let err = r
        .launch("k", [1, 1, 1], [1, 1, 1], &pack(&m, "k", &[0x10]), 1)
        .unwrap_err();
    assert!(
        matches!(&err, ComputeError::IllegalAddress(msg) if msg.ends_with("(PTX line 11)")),
        "{err:?}"
    );
    let err = Module::parse(&format!(
        "{HEADER}.visible .entry k()\n{{\n.reg .b32 %r1;\n// why\n\nfrobnicate.b32 %r1;\n}}\n"
    ))
    .unwrap_err();
    assert!(
        matches!(&err, ComputeError::InvalidPtx(msg) if msg.starts_with("line 9:")),
        "{err:?}"
    );
}

#[test]
fn malformed_or_unsupported_ptx_is_refused_with_its_line_and_never_panics() {
    for (text, what) in [
        (
            ".visible .entry k() { bra $L__nowhere; }",
            "undefined label",
        ),
        (
            ".visible .entry k() { .reg .b32 %r1; add.s32 %r1, %r2, 1; }",
            "undefined name",
        ),
        (
            ".visible .entry k() { .reg .b32 %r1; frobnicate.b32 %r1; }",
            "unsupported instruction",
        ),
        (
            ".visible .entry k() { .reg .b32 %r1; suq.memory_layout.b32 %r1, [%r1]; }",
            "suq.memory_layout is not supported",
        ),
        (
            ".visible .entry k() { .reg .b32 %r1; tex.2d.v4.f32.f32 %r1, [%r1, {%r1, %r1}]; }",
            "vector width and operand count differ",
        ),
        (
            ".extern .global .u32 v[1];\n.visible .entry k() { .reg .b64 %rd; mov.u64 %rd, v; }",
            "declared but never defined",
        ),
        (
            ".visible .func f() { ret; }\n.visible .func f() { ret; }",
            "defined twice",
        ),
        (
            ".visible .entry k() { .reg .b64 %rd; { .param .u32 %a; call %rd, (%a); } }",
            "names a prototype",
        ),
        (
            ".visible .entry k() { .reg .b32 %r<99999999>; }",
            "too many registers",
        ),
        (".global .b8 big[99999999999];", "too large"),
        (
            ".visible .entry k() { .reg .b64 %rd; .reg .b32 %r; mov.b64 %rd, {%r}; }",
            "bad vector mov",
        ),
        (
            ".visible .entry k() { .reg .b64 %rd; .reg .b32 %r; mov.b64 {%r, %r, %r}, %rd; }",
            "bad vector mov",
        ),
        (".visible .entry k(", "end of text"),
    ] {
        let err = Module::parse(&format!("{HEADER}{text}")).unwrap_err();
        let ComputeError::InvalidPtx(msg) = &err else {
            panic!("{err:?}")
        };
        assert!(
            msg.contains(what) && msg.starts_with("line "),
            "{text}: {msg}"
        );
        assert_eq!(err.cuda_status(), 218);
    }
    // Every prefix and some byte mutations of real kernels: errors, never a panic.
    for src in [VECADD, MATMUL, REDUCE] {
        let full = format!("{HEADER}{src}");
        for cut in (0..full.len()).step_by(7) {
            if full.is_char_boundary(cut) {
                let _ = Module::parse(&full[..cut]);
            }
        }
        let bytes = full.as_bytes();
        for i in (0..bytes.len()).step_by(13) {
            for b in [b'{', b'}', b'[', b'%', b'-', b'9', b'.', b';', 0xff] {
                let mut m = bytes.to_vec();
                m[i] = b;
                let _ = Module::parse(&String::from_utf8_lossy(&m));
            }
        }
    }
}

/// Runs kernel `k` of a linked module on one block and returns the words of its `.param .u64
/// out` buffer.
fn run_linked(images: &[&str], block: u32, words: usize) -> ComputeResult<Vec<u32>> {
    let texts: Vec<String> = images.iter().map(|t| format!("{HEADER}{t}")).collect();
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    let m = Module::link(&texts)?;
    let mut r = Run::new(&m);
    let out = r.buffer(&vec![0; words * 4]);
    let params = pack(&m, "k", &[out]);
    r.launch_with("k", [1, 1, 1], [block, 1, 1], 0, &params, 1, 1 << 22)?;
    Ok(to_u32s(&r.read(out, words * 4)))
}

#[test]
fn linked_images_share_what_has_linkage_and_keep_their_own_internal_names() {
    // Image 0 calls and reads what image 1 defines; both have an internal `helper` and `$LC0`.
    let user = r#"
.extern .func (.param .u32 ret) twice (.param .u32 x);
.extern .global .align 4 .u32 base[1];
.global .align 4 .u32 $LC0[1] = { 7 };
.func (.param .u32 r) helper () { .reg .u32 %v; ld.global.u32 %v, [$LC0]; st.param.u32 [r], %v; ret; }
.visible .entry k(.param .u64 out)
{
    .reg .u32 %a<4>; .reg .u64 %p;
    ld.param.u64 %p, [out];
    { .param .u32 %value_in; call (%value_in), helper; ld.param.u32 %a0, [%value_in]; }
    ld.global.u32 %a1, [base];
    { .param .u32 %value_in; .param .u32 %arg; st.param.u32 [%arg], %a1;
      call (%value_in), twice, (%arg); ld.param.u32 %a2, [%value_in]; }
    st.global.u32 [%p], %a0;
    st.global.u32 [%p+4], %a2;
    ret;
}
"#;
    let lib = r#"
.global .align 4 .u32 $LC0[1] = { 100 };
.visible .global .align 4 .u32 base[1] = { 21 };
.func (.param .u32 r) helper () { .reg .u32 %v; ld.global.u32 %v, [$LC0]; st.param.u32 [r], %v; ret; }
.visible .func (.param .u32 ret) twice (.param .u32 x)
{
    .reg .u32 %v<2>;
    ld.param.u32 %v0, [x];
    { .param .u32 %value_in; call (%value_in), helper; ld.param.u32 %v1, [%value_in]; }
    mad.lo.u32 %v0, %v0, 2, %v1;
    st.param.u32 [ret], %v0;
    ret;
}
.weak .func (.param .u32 ret) twice (.param .u32 x) { st.param.u32 [ret], 0; ret; }
"#;
    assert_eq!(run_linked(&[user, lib], 1, 2).unwrap(), [7, 21 * 2 + 100]);
    assert_eq!(run_linked(&[lib, user], 1, 2).unwrap(), [7, 21 * 2 + 100]);
    let err = run_linked(&[user], 1, 2).unwrap_err();
    assert!(
        matches!(&err, ComputeError::InvalidPtx(m) if m.contains("never defined")),
        "{err:?}"
    );
    let err = run_linked(&[user, lib, lib], 1, 2).unwrap_err();
    assert!(
        matches!(&err, ComputeError::InvalidPtx(m) if m.starts_with("image 2, line")),
        "{err:?}"
    );
}

#[test]
fn function_pointers_from_code_and_initialisers_are_called_and_bad_ones_fault() {
    let text = r#"
.global .align 4 .u32 seven[1] = { 7 };
.func (.param .u32 r) add1 (.param .u32 x) { .reg .u32 %v; ld.param.u32 %v, [x]; add.u32 %v, %v, 1; st.param.u32 [r], %v; ret; }
.func (.param .u32 r) dbl (.param .u32 x) { .reg .u32 %v; ld.param.u32 %v, [x]; shl.b32 %v, %v, 1; st.param.u32 [r], %v; ret; }
.global .align 8 .u64 table[3] = { add1, dbl, generic(seven) };
.visible .entry k(.param .u64 out)
{
    .reg .u32 %t, %v; .reg .u64 %f, %p, %q, %s; .reg .pred %odd;
    ld.param.u64 %p, [out];
    mov.u32 %t, %tid.x;
    and.b32 %t, %t, 1;
    setp.ne.u32 %odd, %t, 0;
    mov.u64 %f, add1;
    @%odd ld.global.u64 %f, [table+8];
    ld.global.u64 %s, [table+16];
    ld.u32 %v, [%s];
    mov.u32 %t, %tid.x;
    add.u32 %v, %v, %t;
    {
        .param .u32 %value_in; .param .u32 %arg;
        $LCT0: .callprototype (.param .u32 _) _ (.param .u32 _);
        st.param.u32 [%arg], %v;
        call (%value_in), %f, (%arg), $LCT0;
        ld.param.u32 %v, [%value_in];
    }
    mul.wide.u32 %q, %t, 4;
    add.u64 %q, %p, %q;
    st.global.u32 [%q], %v;
    ret;
}
"#;
    let got = run_linked(&[text], 32, 32).unwrap();
    let want: Vec<u32> = (0..32)
        .map(|t| if t % 2 == 1 { (7 + t) * 2 } else { 7 + t + 1 })
        .collect();
    assert_eq!(got, want);
    // A pointer to data, or to a kernel, is not a function.
    for target in ["seven", "k"] {
        let bad = text.replace("mov.u64 %f, add1;", &format!("mov.u64 %f, {target};"));
        let err = run_linked(&[&bad], 32, 32).unwrap_err();
        assert!(
            matches!(err, ComputeError::IllegalAddress(_)),
            "{target}: {err:?}"
        );
    }
}

#[test]
fn recursion_loads_but_is_refused_when_it_happens() {
    let text = r#"
.func (.param .u32 r) down (.param .u32 x)
{
    .reg .u32 %v, %w; .reg .pred %z;
    ld.param.u32 %v, [x];
    setp.eq.u32 %z, %v, 0;
    @%z bra $done;
    sub.u32 %w, %v, 1;
    { .param .u32 %value_in; .param .u32 %arg; st.param.u32 [%arg], %w;
      call (%value_in), down, (%arg); ld.param.u32 %v, [%value_in]; }
$done:
    st.param.u32 [r], %v;
    ret;
}
.visible .entry k(.param .u64 out)
{
    .reg .u32 %v; .reg .u64 %p;
    ld.param.u64 %p, [out];
    ld.global.u32 %v, [%p];
    { .param .u32 %value_in; .param .u32 %arg; st.param.u32 [%arg], %v;
      call (%value_in), down, (%arg); ld.param.u32 %v, [%value_in]; }
    st.global.u32 [%p], %v;
    ret;
}
"#;
    // Depth 0 never recurses; the first word of `out` is 0.
    assert_eq!(run_linked(&[text], 1, 1).unwrap(), [0]);
    let m = module(text);
    let mut r = Run::new(&m);
    let out = r.buffer(&3u32.to_le_bytes());
    let err = r
        .launch("k", [1, 1, 1], [1, 1, 1], &pack(&m, "k", &[out]), 1)
        .unwrap_err();
    assert!(
        matches!(&err, ComputeError::IllegalInstruction(m) if m.contains("recursive")),
        "{err:?}"
    );
}

#[test]
fn named_barriers_with_counts_order_producer_and_consumer_warps() {
    // Warp 0 produces into shared memory and arrives at barrier 1 (64 threads); warp 1 waits
    // there, then reads. Warp 2 never takes part; barrier 0 (whole block) closes the kernel.
    let text = r#"
.shared .align 4 .u32 buf[32];
.visible .entry k(.param .u64 out)
{
    .reg .u32 %t, %w, %v, %lane; .reg .u64 %p, %q, %s; .reg .pred %is0, %is1;
    ld.param.u64 %p, [out];
    mov.u32 %t, %tid.x;
    shr.u32 %w, %t, 5;
    and.b32 %lane, %t, 31;
    mul.wide.u32 %q, %lane, 4;
    mov.u64 %s, buf;
    add.u64 %s, %s, %q;
    setp.eq.u32 %is0, %w, 0;
    setp.eq.u32 %is1, %w, 1;
    @!%is0 bra $consumer;
    mul.lo.u32 %v, %lane, 3;
    st.shared.u32 [%s], %v;
    bar.arrive 1, 64;
    bra $end;
$consumer:
    @!%is1 bra $end;
    bar.sync 1, 64;
    ld.shared.u32 %v, [%s];
    add.u64 %q, %p, %q;
    st.global.u32 [%q], %v;
$end:
    barrier.sync 0;
    ret;
}
"#;
    let want: Vec<u32> = (0..32).map(|l| l * 3).collect();
    assert_eq!(run_linked(&[text], 96, 32).unwrap(), want);
    // A barrier that cannot complete (64 threads, one warp arrives) is a hang, reported as
    // one at once.
    let stuck = text.replace("bar.arrive 1, 64;", "");
    let err = run_linked(&[&stuck], 96, 32).unwrap_err();
    assert!(matches!(err, ComputeError::LaunchTimeout(_)), "{err:?}");
    let bad = text.replace("bar.arrive 1, 64;", "bar.arrive 1, 48;");
    let err = run_linked(&[&bad], 96, 32).unwrap_err();
    assert!(
        matches!(err, ComputeError::IllegalInstruction(_)),
        "{err:?}"
    );
}

#[test]
fn a_warp_spinning_on_a_flag_lets_the_warp_that_sets_it_run() {
    // Warp 1 spins until warp 0, after a long loop, sets a shared flag.
    let text = r#"
.shared .align 4 .u32 flag[1];
.visible .entry k(.param .u64 out)
{
    .reg .u32 %t, %i, %v; .reg .u64 %p; .reg .pred %w0, %more, %unset;
    ld.param.u64 %p, [out];
    mov.u32 %t, %tid.x;
    setp.lt.u32 %w0, %t, 32;
    @!%w0 bra $spin;
    mov.u32 %i, 0;
$work:
    add.u32 %i, %i, 1;
    setp.lt.u32 %more, %i, 5000;
    @%more bra $work;
    st.volatile.shared.u32 [flag], %i;
    bra $end;
$spin:
    ld.volatile.shared.u32 %v, [flag];
    setp.eq.u32 %unset, %v, 0;
    @%unset bra $spin;
    st.global.u32 [%p], %v;
$end:
    ret;
}
"#;
    assert_eq!(run_linked(&[text], 64, 1).unwrap(), [5000]);
}

#[test]
fn device_malloc_and_free_use_the_context_heap_and_refuse_foreign_pointers() {
    let text = r#"
.extern .func (.param .u64 r) malloc (.param .u64 n);
.extern .func free (.param .u64 p);
.visible .entry k(.param .u64 out)
{
    .reg .u64 %p, %m, %m2, %n; .reg .u32 %v;
    ld.param.u64 %p, [out];
    mov.u64 %n, 64;
    { .param .u64 %value_in; .param .u64 %a; st.param.u64 [%a], %n;
      call (%value_in), malloc, (%a); ld.param.u64 %m, [%value_in]; }
    mov.u32 %v, 41;
    st.u32 [%m+60], %v;
    ld.u32 %v, [%m+60];
    add.u32 %v, %v, 1;
    st.global.u32 [%p], %v;
    { .param .u64 %a; st.param.u64 [%a], %m; call free, (%a); }
    { .param .u64 %value_in; .param .u64 %a; st.param.u64 [%a], %n;
      call (%value_in), malloc, (%a); ld.param.u64 %m2, [%value_in]; }
    setp.eq.u64 %q, %m, %m2;
    selp.u32 %v, 1, 0, %q;
    st.global.u32 [%p+4], %v;
    mov.u64 %n, 1099511627776;
    { .param .u64 %value_in; .param .u64 %a; st.param.u64 [%a], %n;
      call (%value_in), malloc, (%a); ld.param.u64 %m, [%value_in]; }
    setp.eq.u64 %q, %m, 0;
    selp.u32 %v, 1, 0, %q;
    st.global.u32 [%p+8], %v;
    { .param .u64 %a; st.param.u64 [%a], %p; call free, (%a); }
    ret;
}
"#
    .replace(".reg .u32 %v;", ".reg .u32 %v; .reg .pred %q;");
    let err = run_linked(&[&text], 1, 3).unwrap_err();
    assert!(
        matches!(&err, ComputeError::IllegalAddress(m) if m.contains("free of")),
        "{err:?}"
    );
    let ok = text.replace(
        "{ .param .u64 %a; st.param.u64 [%a], %p; call free, (%a); }",
        "",
    );
    // 41 + 1 read back, the freed block handed out again, 1 TiB refused with NULL.
    assert_eq!(run_linked(&[&ok], 1, 3).unwrap(), [42, 1, 1]);
}

#[test]
fn vector_registers_parameterized_names_and_video_ops() {
    let text = r#"
.func (.param .u32 r) seven () { st.param.u32 [r], 7; ret; }
.visible .entry k(.param .u64 out)
{
    .reg .v2 .u32 %pair; .reg .u32 %a, %b; .reg .u64 %p;
    ld.param.u64 %p, [out];
    mov.v2.u32 %pair, { 5, -1 };
    mov.u32 %pair.x, 9;
    st.v2.u32 [%p], %pair;
    { .param .u32 %P<2>; call (%P1), seven; ld.param.u32 %a, [%P1]; }
    vsub.u32.u32.u32.add %b, %a, 10, 100;
    st.global.u32 [%p+8], %b;
    vabsdiff.s32.s32.s32 %b, %a, 10;
    st.global.u32 [%p+12], %b;
    vsub.s32.s32.s32.sat.max %b, 0x7fffffff, -5, 3;
    st.global.u32 [%p+16], %b;
    ret;
}
"#;
    assert_eq!(
        run_linked(&[text], 1, 5).unwrap(),
        [9, u32::MAX, 97, 3, i32::MAX as u32]
    );
}

#[test]
fn warp_synchronous_instructions_wait_for_their_whole_member_mask() {
    // Lane 0 takes an out-of-line branch placed after the reduction (as GCC lays out cold
    // blocks); the others reach `shfl.sync` first, at a lower PC, and must wait for it, as
    // Volta's `.sync` semantics say, or the sum misses lane 0.
    let text = r#"
.visible .entry k(.param .u64 out)
{
    .reg .u32 %lane, %v, %o, %step; .reg .u64 %p; .reg .pred %first, %more;
    ld.param.u64 %p, [out];
    mov.u32 %lane, %laneid;
    add.u32 %v, %lane, 1;
    setp.eq.u32 %first, %lane, 0;
    @%first bra $cold;
$back:
    mov.u32 %step, 1;
$reduce:
    shfl.sync.bfly.b32 %o, %v, %step, 31, 0xffffffff;
    add.u32 %v, %v, %o;
    shl.b32 %step, %step, 1;
    setp.lt.u32 %more, %step, 32;
    @%more bra $reduce;
    bar.warp.sync 0xffffffff;
    @%first st.global.u32 [%p], %v;
    ret;
$cold:
    mul.lo.u32 %v, %v, 100;
    bra $back;
}
"#;
    // Lane 0 contributes 100 instead of 1: 2 + 3 + ... + 32 + 100.
    assert_eq!(
        run_linked(&[text], 32, 1).unwrap(),
        [(2..=32).sum::<u32>() + 100]
    );
}

/// A kernel that never ends: one warp spinning on a branch to itself.
const SPIN: &str = ".visible .entry spin()\n{\n$L__spin:\nbra $L__spin;\n}\n";

#[test]
fn a_spin_kernel_stops_at_its_requests_deadline() {
    let m = module(SPIN);
    // The interpreter alone: this measures how soon its checks see a deadline.
    let mut r = Run::interpreter_only(&m);
    let interrupt = Interrupt::new(std::time::Duration::from_millis(200));
    r.interrupt = Some(Arc::clone(&interrupt));
    interrupt.begin();
    let start = std::time::Instant::now();
    // No instruction budget to speak of: only the deadline ends it.
    let err = r
        .launch_with("spin", [4, 1, 1], [64, 1, 1], 0, &[], 2, u64::MAX)
        .unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(&err, ComputeError::LaunchTimeout(m) if m.contains("time limit")),
        "{err:?}"
    );
    assert!(took < std::time::Duration::from_secs(20), "{took:?}");
    println!("spin kernel with a 200 ms deadline stopped after {took:?}");
    // Stopped from another thread: within a few check intervals.
    interrupt.begin();
    let stopper = {
        let interrupt = Arc::clone(&interrupt);
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            interrupt.stop();
            std::time::Instant::now()
        })
    };
    let err = r
        .launch_with("spin", [1, 1, 1], [32, 1, 1], 0, &[], 1, u64::MAX)
        .unwrap_err();
    let stopped = stopper.join().unwrap().elapsed();
    assert!(
        matches!(&err, ComputeError::LaunchTimeout(m) if m.contains("cancelled")),
        "{err:?}"
    );
    println!("spin kernel stopped {stopped:?} after Interrupt::stop");
}

/// A kernel printing `fmt` with the argument buffer `args` once per thread.
const PRINTF_ARGS: &str = r#"
.extern .func (.param .b32 func_retval0) vprintf
(
	.param .b64 vprintf_param_0,
	.param .b64 vprintf_param_1
)
;
.visible .entry print(.param .u64 fmt, .param .u64 args)
{
	.reg .b32 	%r<2>;
	.reg .b64 	%rd<3>;
	ld.param.u64 	%rd1, [fmt];
	ld.param.u64 	%rd2, [args];
	{
	.param .b64 param0;
	st.param.b64 	[param0], %rd1;
	.param .b64 param1;
	st.param.b64 	[param1], %rd2;
	.param .b32 retval0;
	call.uni (retval0), vprintf, (param0, param1);
	ld.param.b32 	%r1, [retval0];
	}
	ret;
}
"#;

#[test]
fn a_printf_is_charged_by_the_bytes_it_reads_and_formats() {
    let m = module(PRINTF_ARGS);
    // The interpreter alone: its cost units of a printf.
    let mut r = Run::interpreter_only(&m);
    // 64 `%s` of a 4000-byte string in each of 32 lanes: 8 MB read for one instruction.
    let fmt = r.buffer(&[b"%s".repeat(64), vec![0]].concat());
    let string = r.buffer(&[vec![b'a'; 4000], vec![0]].concat());
    let args = r.buffer(&string.to_le_bytes().repeat(64));
    let params = pack(&m, "print", &[fmt, args]);
    let read = 32 * 64 * 4001;
    let start = std::time::Instant::now();
    let stats = r
        .launch_with("print", [1, 1, 1], [32, 1, 1], 0, &params, 1, u64::MAX)
        .unwrap();
    println!(
        "32 lanes x 64 %s of 4000 bytes: {:?}, {} cost units",
        start.elapsed(),
        stats.warp_instructions
    );
    assert!(
        stats.warp_instructions >= read / exec::PRINTF_BYTES_PER_UNIT,
        "{} cost units",
        stats.warp_instructions
    );
    // Under a budget smaller than its cost it stops, inside the instruction.
    let err = r
        .launch_with("print", [1, 1, 1], [32, 1, 1], 0, &params, 1, 100_000)
        .unwrap_err();
    assert!(matches!(err, ComputeError::LaunchTimeout(_)), "{err:?}");
}

/// A kernel of 64 KiB of local memory per thread that does nothing.
const FAT_BLOCK: &str = ".visible .entry fat()\n{\n.local .align 4 .b8 depot[65536];\nret;\n}\n";

#[test]
fn a_blocks_host_memory_is_charged_to_the_budget_and_as_cost() {
    let m = module(FAT_BLOCK);
    // The interpreter alone: its block bytes and their cost.
    let mut r = Run::interpreter_only(&m);
    let stats = r
        .launch_with("fat", [2, 1, 1], [1024, 1, 1], 0, &[], 1, u64::MAX)
        .unwrap();
    // 1024 threads x 64 KiB of local memory.
    assert!(stats.block_bytes >= 64 << 20, "{}", stats.block_bytes);
    assert!(
        stats.warp_instructions >= 2 * (64 << 20) / exec::SETUP_BYTES_PER_UNIT,
        "{} cost units",
        stats.warp_instructions
    );
    // Two blocks at once do not fit 100 MiB: one thread runs them.
    r.budget = MemoryBudget::new(100 << 20);
    let stats = r
        .launch_with("fat", [8, 1, 1], [1024, 1, 1], 0, &[], 4, u64::MAX)
        .unwrap();
    assert_eq!(stats.threads, 1);
    assert_eq!(r.budget.used(), 0, "given back after the launch");
    // One block does not fit 32 MiB.
    r.budget = MemoryBudget::new(32 << 20);
    let err = r
        .launch_with("fat", [1, 1, 1], [1024, 1, 1], 0, &[], 1, u64::MAX)
        .unwrap_err();
    assert!(matches!(err, ComputeError::OutOfMemory(_)), "{err:?}");
}

#[test]
fn a_launch_runs_on_at_most_its_threads() {
    let m = module(VECADD);
    let r = Run::new(&m);
    let params = pack(&m, "_Z6vecAddPKfS0_Pfi", &[0, 0, 0, 0]);
    for threads in [1, 2, 3] {
        let stats = r
            .launch(
                "_Z6vecAddPKfS0_Pfi",
                [64, 1, 1],
                [32, 1, 1],
                &params,
                threads,
            )
            .unwrap();
        assert_eq!(stats.threads, threads);
    }
}

#[test]
fn a_kernel_holds_its_own_registers_and_its_callees_not_the_modules() {
    // 200 kernels of 200 registers each, then one that calls a function declared between
    // them: 40,000 registers in the module, more than 1024 threads may hold (4 M values a
    // block), while each kernel needs at most 400.
    let filler: String = (0..200)
        .map(|i| {
            format!(
                ".visible .entry f{i}(.param .u64 p)\n{{\n.reg .b32 %r<200>;\n\
                 mov.u32 %r199, {i};\nret;\n}}\n"
            )
        })
        .collect();
    let m = module(&format!(
        r#"
.func (.param .b32 r) twice(.param .b32 a)
{{
	.reg .b32 %t<200>;
	ld.param.u32 %t1, [a];
	add.u32 %t199, %t1, %t1;
	st.param.b32 [r], %t199;
	ret;
}}
{filler}
.visible .entry k(.param .u64 out)
{{
	.reg .b32 %r<200>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [out];
	mov.u32 %r1, %tid.x;
	{{
	.param .b32 a0;
	st.param.b32 [a0], %r1;
	.param .b32 r0;
	call.uni (r0), twice, (a0);
	ld.param.b32 %r199, [r0];
	}}
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.u32 [%rd3], %r199;
	ret;
}}
"#
    ));
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 1024 * 4]);
    let params = pack(&m, "k", &[out]);
    r.launch("k", [1, 1, 1], [1024, 1, 1], &params, 1).unwrap();
    assert_eq!(
        to_u32s(&r.read(out, 1024 * 4)),
        (0..1024u32).map(|t| 2 * t).collect::<Vec<_>>()
    );
    let params = pack(&m, "f7", &[out]);
    r.launch("f7", [1, 1, 1], [1024, 1, 1], &params, 1).unwrap();
}

/// Every modifier an instruction is not implemented with is refused at load, naming it: none
/// is ignored (a CRC or a layer norm computed with a dropped modifier would be silently wrong).
#[test]
fn modifiers_the_executor_does_not_implement_are_refused_by_name() {
    for (inst, what) in [
        ("fma.cc.f32 %f1, %f1, %f1, %f1;", "fma.cc is not supported"),
        ("addc.f32 %f1, %f1, %f1;", "addc.f32 is not supported"),
        ("min.NaN.f32 %f1, %f1, %f1;", "min.NaN is not supported"),
        (
            "max.xorsign.abs.f32 %f1, %f1, %f1;",
            "max.xorsign is not supported",
        ),
        ("ex2.approx.f16 %r1, %r1;", "ex2.f16 is not supported"),
        (
            "fma.rm.f64 %fd1, %fd1, %fd1, %fd1;",
            "fma.f64 with directed rounding",
        ),
        (
            "rcp.approx.rn.f32 %f1, %f1;",
            "rcp.approx with a rounding modifier",
        ),
        ("neg.rn.f32 %f1, %f1;", "neg.rn is not supported"),
        (
            "cvt.rn.s32.f32 %r1, %f1;",
            "rounding modifier its types do not take",
        ),
        ("cvt.s32.f32 %r1, %f1;", "needs a rounding modifier"),
        ("cvt.f32.f64 %f1, %fd1;", "needs a rounding modifier"),
        (
            "cvt.rni.f32.s32 %f1, %r1;",
            "rounding modifier its types do not take",
        ),
        ("atom.global.min.f32 %f1, [%rd1], %f1;", "not supported"),
        ("atom.global.inc.u64 %rd1, [%rd1], %rd1;", "not supported"),
        ("add.rn.s32 %r1, %r1, %r1;", "does not exist"),
        (
            "add.ftz.f64 %fd1, %fd1, %fd1;",
            "add.ftz.f64 does not exist",
        ),
        ("mul.lo.sat.s32 %r1, %r1, %r1;", "mul.sat on .S32"),
        ("sin.rn.f32 %f1, %f1;", "sin.rn is not supported"),
        ("ld.global.L1::no_allocate.u32 %r1, [%rd1];", "line 10"),
        (
            "shfl.sync.bfly.b64 %rd1, %rd1, 1, 31, -1;",
            "shfl.b64 is not supported",
        ),
        (
            "vote.sync.all.u32 %r1, %p1, -1;",
            "vote.u32 is not supported",
        ),
        ("bar.red.popc.b32 %r1, 0, %p1;", "bar.b32 is not supported"),
    ] {
        let text = format!(
            "{HEADER}.visible .entry k() {{\n.reg .b32 %r1;\n.reg .f32 %f1;\n\
             .reg .f64 %fd1;\n.reg .b64 %rd1;\n.reg .pred %p1;\n{inst}\n}}\n"
        );
        let err = Module::parse(&text).unwrap_err();
        let ComputeError::InvalidPtx(msg) = &err else {
            panic!("{err:?}")
        };
        assert!(msg.contains(what), "{inst}: {msg}");
        assert_eq!(err.cuda_status(), 218);
    }
}

/// `match.any.sync` gives each lane the lanes holding its value; `match.all.sync` the member
/// mask and true when all hold one value, else 0 and false (a partial warp of 24 lanes).
#[test]
fn match_sync_finds_the_lanes_sharing_a_value() {
    let m = module(
        ".visible .entry k(.param .u64 out)\n{\n.reg .b32 %r<8>;\n.reg .b64 %rd<4>;\n\
         .reg .pred %p<3>;\nld.param.u64 %rd1, [out];\nmov.u32 %r1, %tid.x;\n\
         rem.u32 %r2, %r1, 5;\nactivemask.b32 %r7;\nmatch.any.sync.b32 %r3, %r2, %r7;\n\
         match.all.sync.b32 %r4|%p1, %r2, %r7;\nmov.u32 %r6, 7;\n\
         match.all.sync.b32 %r5|%p2, %r6, %r7;\nselp.u32 %r6, 1, 0, %p2;\n\
         selp.u32 %r2, 1, 0, %p1;\nadd.u32 %r6, %r6, %r2;\n\
         mul.wide.u32 %rd2, %r1, 16;\nadd.s64 %rd3, %rd1, %rd2;\n\
         st.global.v4.u32 [%rd3], {%r3, %r4, %r5, %r6};\nret;\n}\n",
    );
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 24 * 16]);
    let params = pack(&m, "k", &[out]);
    r.launch("k", [1, 1, 1], [24, 1, 1], &params, 1).unwrap();
    let got = to_u32s(&r.read(out, 24 * 16));
    for lane in 0..24u32 {
        let same = (0..24)
            .filter(|l| l % 5 == lane % 5)
            .fold(0, |m, l| m | 1 << l);
        let row = &got[lane as usize * 4..][..4];
        assert_eq!(row, [same, 0, 0xff_ffff, 1], "lane {lane}");
    }
    let err = Module::parse(&format!(
        "{HEADER}.visible .entry k() {{ .reg .b32 %r1; match.any.b32 %r1, %r1, -1; }}"
    ))
    .unwrap_err();
    assert!(err.to_string().contains("match needs .sync"), "{err}");
}

/// A failed device `assert` (nvcc's call of `__assertfail`) stops the kernel with
/// CUDA_ERROR_ASSERT and the driver's line for each asserting thread; the error is sticky.
#[test]
fn a_failed_device_assert_stops_the_kernel_with_the_drivers_message() {
    let m = module(
        ".extern .func __assertfail(.param .b64 a0, .param .b64 a1, .param .b32 a2, \
         .param .b64 a3, .param .b64 a4);\n\
         .global .align 1 .b8 msg[6] = {120, 32, 60, 32, 50, 0};\n\
         .global .align 1 .b8 file[7] = {107, 46, 99, 117, 0, 0, 0};\n\
         .global .align 1 .b8 func[5] = {109, 97, 105, 110, 0};\n\
         .visible .entry k()\n{\n.reg .b32 %r<3>;\n.reg .b64 %rd<4>;\n.reg .pred %p;\n\
         mov.u32 %r1, %tid.x;\nsetp.ne.u32 %p, %r1, 3;\n@%p bra $L_ok;\n\
         mov.u64 %rd1, msg;\ncvta.global.u64 %rd1, %rd1;\nmov.u64 %rd2, file;\n\
         cvta.global.u64 %rd2, %rd2;\nmov.u64 %rd3, func;\ncvta.global.u64 %rd3, %rd3;\n\
         { .param .b64 p0; st.param.b64 [p0], %rd1; .param .b64 p1; st.param.b64 [p1], %rd2;\n\
         .param .b32 p2; st.param.b32 [p2], 42; .param .b64 p3; st.param.b64 [p3], %rd3;\n\
         .param .b64 p4; st.param.b64 [p4], 1;\n\
         call.uni __assertfail, (p0, p1, p2, p3, p4); }\n$L_ok:\nret;\n}\n",
    );
    let r = Run::new(&m);
    let err = r.launch("k", [2, 1, 1], [8, 1, 1], &[], 1).unwrap_err();
    assert_eq!(err.cuda_status(), 710);
    assert!(err.is_sticky());
    let ComputeError::Assert(text) = &err else {
        panic!("{err:?}")
    };
    assert!(
        text.starts_with("k.cu:42: main: block: [")
            && text.contains("], thread: [3,0,0] Assertion `x < 2` failed.\n"),
        "{text}"
    );
}

/// `nvcc -lineinfo` (as cuda-samples build) adds `.loc` with inlining and a `.debug_str`
/// section: both are skipped; a section that is not DWARF is refused.
#[test]
fn line_info_sections_are_skipped_and_other_sections_refused() {
    let m = module(
        ".file 1 \"k.cu\"\n.visible .entry k()\n{\n.loc 1 2 3, function_name $L__info_string0, \
         inlined_at 1 4 5\nret;\n}\n.section .debug_str\n{\n$L__info_string0:\n.b8 107,0\n}\n",
    );
    Run::new(&m)
        .launch("k", [1, 1, 1], [1, 1, 1], &[], 1)
        .unwrap();
    let err = Module::parse(&format!("{HEADER}.section .nv.info\n{{\n}}\n")).unwrap_err();
    assert!(
        err.to_string().contains("sections other than DWARF"),
        "{err}"
    );
}

/// `bar.red` (`__syncthreads_count/and/or`): every thread of the block gets the count, the
/// and and the or of all threads' predicates, after all of them arrived.
#[test]
fn barrier_reductions_combine_the_whole_blocks_predicates() {
    let m = module(
        ".visible .entry k(.param .u64 out)\n{\n.reg .b32 %r<6>;\n.reg .b64 %rd<4>;\n\
         .reg .pred %p<5>;\nld.param.u64 %rd1, [out];\nmov.u32 %r1, %tid.x;\n\
         rem.u32 %r2, %r1, 3;\nsetp.eq.u32 %p1, %r2, 0;\n\
         bar.red.popc.u32 %r3, 0, %p1;\nbar.red.and.pred %p2, 1, !%p1;\n\
         setp.lt.u32 %p3, %r1, 100;\nbarrier.red.and.pred %p4, 0, %p3;\n\
         bar.red.or.pred %p3, 0, %p1;\n\
         selp.u32 %r4, 1, 0, %p2;\nselp.u32 %r5, 2, 0, %p4;\nadd.u32 %r4, %r4, %r5;\n\
         selp.u32 %r5, 4, 0, %p3;\nadd.u32 %r4, %r4, %r5;\n\
         mul.wide.u32 %rd2, %r1, 8;\nadd.s64 %rd3, %rd1, %rd2;\n\
         st.global.v2.u32 [%rd3], {%r3, %r4};\nret;\n}\n",
    );
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 70 * 8]);
    let params = pack(&m, "k", &[out]);
    r.launch("k", [1, 1, 1], [70, 1, 1], &params, 1).unwrap();
    let got = to_u32s(&r.read(out, 70 * 8));
    let trues = (0..70).filter(|t| t % 3 == 0).count() as u32;
    for t in 0..70 {
        // and of !p is false (some p true), and of t < 100 true, or of p true.
        assert_eq!(got[t * 2..t * 2 + 2], [trues, 2 | 4], "thread {t}");
    }
}

/// A kernel's own shared variables share their place with other kernels' own (one kernel
/// runs per launch), after the module's: 25 kernels of 100 KiB each load, and a module
/// variable declared between them overlaps none of them.
#[test]
fn each_kernel_has_its_own_shared_memory_limit() {
    let mut text = String::from(".shared .align 4 .b8 common[16];\n");
    for k in 0..25 {
        text += &format!(
            ".visible .entry k{k}(.param .u64 out)\n{{\n.shared .align 4 .b8 own[102400];\n\
             .reg .b64 %rd<3>;\n.reg .b32 %r<3>;\nld.param.u64 %rd1, [out];\n\
             mov.u64 %rd2, own;\ncvt.u32.u64 %r1, %rd2;\nmov.u64 %rd2, common;\n\
             cvt.u32.u64 %r2, %rd2;\nst.global.v2.u32 [%rd1], {{%r1, %r2}};\nret;\n}}\n"
        );
        if k == 3 {
            text += ".shared .align 4 .b8 late[8];\n.visible .entry l(.param .u64 out)\n{\n\
                     .reg .b64 %rd<3>;\nld.param.u64 %rd1, [out];\nmov.u64 %rd2, late;\n\
                     st.global.u64 [%rd1], %rd2;\nret;\n}\n";
        }
    }
    let m = module(&text);
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 8]);
    let params = pack(&m, "k7", &[out]);
    r.launch("k7", [1, 1, 1], [1, 1, 1], &params, 1).unwrap();
    let own_common = to_u32s(&r.read(out, 8));
    r.launch("l", [1, 1, 1], [1, 1, 1], &params, 1).unwrap();
    let late = u64::from_le_bytes(r.read(out, 8).try_into().unwrap());
    assert_eq!(own_common[1], 0, "the module's variable comes first");
    assert!(own_common[0] >= 16, "a kernel's own variable follows it");
    assert!(
        late >= 16 + 102_400,
        "a later module variable follows every kernel's own"
    );
    let too_big = format!(
        "{HEADER}.visible .entry k()\n{{\n.shared .align 4 .b8 own[{}];\nret;\n}}\n",
        super::MAX_SHARED_BYTES + 1
    );
    assert!(Module::parse(&too_big).is_err());
}

#[path = "conformance.rs"]
mod conformance;

/// `isspacep` answers for generic addresses of shared, local and global variables, each in
/// its own space only; one without a space is refused.
#[test]
fn isspacep_tells_the_space_of_a_generic_address() {
    let m = module(
        ".visible .entry k(.param .u64 out)\n{\n.reg .b64 %rd<8>;\n.reg .b32 %r<2>;\n\
         .reg .pred %p;\n.shared .align 4 .b32 s[4];\n.local .align 4 .b32 l[4];\n\
         ld.param.u64 %rd1, [out];\nmov.u64 %rd2, s;\ncvta.shared.u64 %rd2, %rd2;\n\
         mov.u64 %rd3, l;\ncvta.local.u64 %rd3, %rd3;\n\
         isspacep.shared %p, %rd2;\nselp.u32 %r1, 1, 0, %p;\nst.global.u32 [%rd1], %r1;\n\
         isspacep.local %p, %rd2;\nselp.u32 %r1, 1, 0, %p;\nst.global.u32 [%rd1+4], %r1;\n\
         isspacep.local %p, %rd3;\nselp.u32 %r1, 1, 0, %p;\nst.global.u32 [%rd1+8], %r1;\n\
         isspacep.global %p, %rd3;\nselp.u32 %r1, 1, 0, %p;\nst.global.u32 [%rd1+12], %r1;\n\
         isspacep.global %p, %rd1;\nselp.u32 %r1, 1, 0, %p;\nst.global.u32 [%rd1+16], %r1;\n\
         isspacep.shared %p, %rd1;\nselp.u32 %r1, 1, 0, %p;\nst.global.u32 [%rd1+20], %r1;\n\
         ret;\n}\n",
    );
    let mut r = Run::new(&m);
    let out = r.buffer(&[0xff; 24]);
    let params = pack(&m, "k", &[out]);
    r.launch("k", [1, 1, 1], [1, 1, 1], &params, 1).unwrap();
    let got: Vec<u32> = r
        .read(out, 24)
        .chunks(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got, [1, 0, 1, 0, 1, 0]);
    for bad in ["isspacep %p, %rd1;", "isspacep.const %p, %rd1;"] {
        let e = Module::parse(&format!(
            "{HEADER}.visible .entry k()\n{{\n.reg .b64 %rd1;\n.reg .pred %p;\n{bad}\nret;\n}}\n"
        ))
        .expect_err(bad);
        assert!(e.to_string().contains("isspacep"), "{bad}: {e}");
    }
}

/// The harness compares errors less the elapsed time a timeout names, and nothing else.
#[test]
fn the_harness_compares_errors_without_their_timing() {
    let timeout = |s: &str| ComputeError::LaunchTimeout(s.into());
    assert_eq!(
        comparable(&timeout(
            "kernel ran past its budget of 5 cost units (0.3 s)"
        )),
        comparable(&timeout(
            "kernel ran past its budget of 5 cost units (12.0 s)"
        ))
    );
    for (a, b) in [
        (
            timeout("budget of 5 (0.3 s)"),
            timeout("budget of 6 (0.3 s)"),
        ),
        (timeout("(x s)"), timeout("(y s)")),
        (
            ComputeError::IllegalAddress("at 0x10 (PTX line 4)".into()),
            ComputeError::IllegalAddress("at 0x10 (PTX line 5)".into()),
        ),
        (
            ComputeError::IllegalAddress("(1.0 s)".into()),
            ComputeError::LaunchTimeout("(1.0 s)".into()),
        ),
    ] {
        assert_ne!(comparable(&a), comparable(&b), "{a:?} {b:?}");
    }
}

#[test]
fn a_kernel_parameters_address_reads_it_through_a_register_and_cannot_write_it() {
    // nvcc indexes a large by-value parameter through its address: `mov.b64 %rd, param`, then
    // `ld.param [%rd + i]` in a loop.
    let m = module(
        r#"
.visible .entry k(.param .align 4 .b8 big[64], .param .u64 out)
{
    .reg .pred %p<2>;
    .reg .b32 %r<5>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [out];
    mov.b64 %rd2, big;
    mov.u32 %r1, 0;
    mov.u32 %r2, 0;
$L_sum:
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd2, %rd3;
    ld.param.u32 %r3, [%rd4];
    add.u32 %r2, %r2, %r3;
    add.u32 %r1, %r1, 1;
    setp.lt.u32 %p1, %r1, 16;
    @%p1 bra $L_sum;
    st.global.u32 [%rd1], %r2;
    ret;
}
.visible .entry w(.param .align 4 .b8 big[64])
{
    .reg .b64 %rd<2>;
    mov.b64 %rd1, big;
    st.param.u32 [%rd1+8], 7;
    ret;
}
"#,
    );
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 4]);
    let mut params: Vec<u8> = (1..=16u32).flat_map(|v| v.to_le_bytes()).collect();
    params.extend_from_slice(&out.to_le_bytes());
    r.launch("k", [1, 1, 1], [32, 1, 1], &params, 1).unwrap();
    assert_eq!(to_u32s(&r.read(out, 4)), [136]);
    let err = r
        .launch("w", [1, 1, 1], [1, 1, 1], &params[..64], 1)
        .unwrap_err();
    assert!(
        matches!(&err, ComputeError::IllegalInstruction(m) if m.contains("kernel parameter")),
        "{err:?}"
    );
}

#[test]
fn a_shuffle_reads_zero_from_lanes_outside_its_member_mask() {
    // NVIDIA's `reduction` (kernel 7) sums its last warp with member mask 0xff and offsets
    // 16 down to 1: lanes 0-7 read lanes 8-23, which hold their own partial sums but do not
    // take part. Each engine gives 0 for them, so lane 0 sums exactly lanes 0-7.
    let m = module(
        r#"
.visible .entry k(.param .u64 out)
{
    .reg .pred %p<4>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    add.u32 %r2, %r1, 100;
    setp.ge.u32 %p1, %r1, 8;
    @%p1 bra $L_end;
    mov.u32 %r3, 16;
$L_down:
    shfl.sync.down.b32 %r4|%p2, %r2, %r3, 31, 255;
    add.u32 %r2, %r2, %r4;
    shr.u32 %r3, %r3, 1;
    setp.ne.u32 %p3, %r3, 0;
    @%p3 bra $L_down;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r2;
$L_end:
    ret;
}
"#,
    );
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 32]);
    r.launch("k", [1, 1, 1], [32, 1, 1], &pack(&m, "k", &[out]), 1)
        .unwrap();
    let got = to_u32s(&r.read(out, 32));
    // Lane 0: 100 + ... + 107; the others add the in-mask part of their tree alone.
    assert_eq!(got[0], (100..108).sum::<u32>(), "{got:?}");
    assert_eq!(got[7], 107, "{got:?}");
}

#[test]
fn a_barrier_waits_for_the_lanes_of_a_warp_still_at_a_partial_shuffle() {
    // Lanes 0-7 of the last warp shuffle among themselves (mask 0xff, width 8) before the
    // block's barrier; the rest of their warp is already there. The barrier completes only
    // once they have written their results, so thread 0 (which runs first) reads all eight.
    let m = module(
        r#"
.visible .entry k(.param .u64 out)
{
    .reg .pred %p<4>;
    .reg .b32 %r<9>;
    .reg .b64 %rd<4>;
    .shared .align 4 .b32 s[8];
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    setp.lt.u32 %p1, %r1, 224;
    @%p1 bra $L_wait;
    setp.ge.u32 %p1, %r1, 232;
    @%p1 bra $L_wait;
    mov.u32 %r2, 1;
    shfl.sync.up.b32 %r3|%p2, %r2, 1, 6144, 255;
    @%p2 add.u32 %r2, %r2, %r3;
    sub.u32 %r7, %r1, 224;
    mul.wide.u32 %rd2, %r7, 4;
    mov.u64 %rd3, s;
    add.s64 %rd3, %rd3, %rd2;
    st.shared.u32 [%rd3], %r2;
$L_wait:
    bar.sync 0;
    setp.ne.u32 %p3, %r1, 0;
    @%p3 bra $L_end;
    mov.u32 %r4, 0;
    mov.u32 %r5, 0;
    mov.u64 %rd3, s;
$L_sum:
    ld.shared.u32 %r6, [%rd3];
    add.u32 %r5, %r5, %r6;
    add.s64 %rd3, %rd3, 4;
    add.u32 %r4, %r4, 1;
    setp.lt.u32 %p1, %r4, 8;
    @%p1 bra $L_sum;
    st.global.u32 [%rd1], %r5;
$L_end:
    ret;
}
"#,
    );
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 4]);
    r.launch("k", [1, 1, 1], [256, 1, 1], &pack(&m, "k", &[out]), 1)
        .unwrap();
    // Lane 0 keeps 1, lanes 1-7 add their neighbour's 1.
    assert_eq!(to_u32s(&r.read(out, 4)), [15]);
}

/// A kernel whose translation passes the compiler's size limit runs on the interpreter, with
/// the same result; a function it calls, declared for it but never defined, is translated
/// again for a smaller kernel calling it, which compiles.
#[cfg(feature = "jit")]
#[test]
fn a_kernel_past_the_compile_limit_runs_on_the_interpreter() {
    use super::jit::MAX_COMPILED_IR;
    // Each global load is some 25 Cranelift instructions with its check and helper path.
    let loads = MAX_COMPILED_IR / 16;
    let body = "ld.global.u32 %r2, [%rd1];\nadd.u32 %r3, %r3, %r2;\n".repeat(loads);
    let m = module(&format!(
        r#"
.func (.param .b32 ret) twice(.param .b32 x)
{{
	.reg .b32 %v;
	ld.param.u32 %v, [x];
	add.u32 %v, %v, %v;
	st.param.b32 [ret], %v;
	ret;
}}
.visible .entry big(.param .u64 p)
{{
	.reg .b32 %r<5>;
	.reg .b64 %rd<2>;
	ld.param.u64 %rd1, [p];
	mov.u32 %r3, 0;
	{{ .param .b32 rv; .param .b32 a; st.param.b32 [a], %r3;
	  call (rv), twice, (a); ld.param.u32 %r4, [rv]; }}
{body}	add.u32 %r3, %r3, %r4;
	st.global.u32 [%rd1+4], %r3;
	ret;
}}
.visible .entry small(.param .u64 p)
{{
	.reg .b32 %r<3>;
	.reg .b64 %rd<2>;
	ld.param.u64 %rd1, [p];
	ld.global.u32 %r1, [%rd1];
	{{ .param .b32 rv; .param .b32 a; st.param.b32 [a], %r1;
	  call (rv), twice, (a); ld.param.u32 %r2, [rv]; }}
	st.global.u32 [%rd1+8], %r2;
	ret;
}}
"#
    ));
    let mut r = Run::new(&m);
    let buf = r.buffer(&[3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let params = pack(&m, "big", &[buf]);
    let (reference, compiled) = r.launch_pair("big", [1, 1, 1], [1, 1, 1], 0, &params, 1, 1 << 30);
    assert!(!reference.unwrap().compiled);
    assert!(!compiled.unwrap().unwrap().compiled, "past the limit");
    let params = pack(&m, "small", &[buf]);
    let (_, compiled) = r.launch_pair("small", [1, 1, 1], [1, 1, 1], 0, &params, 1, 1 << 30);
    assert!(
        compiled.unwrap().unwrap().compiled,
        "twice translated again"
    );
    let out = to_u32s(&r.read(buf, 12));
    assert_eq!(out, [3, 3 * loads as u32, 6]);
}

/// Registers the compiler keeps as floats (those its float instructions name most) hold
/// their bits wherever integer instructions, helpers and loads and stores of another type
/// meet them: a NaN's payload survives moves, `neg`, `abs`, stores and a helper's spill, an
/// integer written into one reads back as the same bits, arithmetic gives the canonical NaN.
#[test]
fn float_registers_keep_their_bits_through_integer_uses_and_helpers() {
    let payload = 0x7fc0_1234u32;
    let out = scalar(
        r#"
	ld.global.u32 %f1, [%rdin];
	ld.global.f32 %f2, [%rdin+8];
	ld.global.f64 %fd1, [%rdin+16];
	neg.f32 %f3, %f1;
	abs.f32 %f4, %f3;
	add.f32 %f5, %f1, %f2;
	mov.b32 %r1, %f3;
	add.u32 %r1, %r1, 1;
	mov.b32 %f6, %r1;
	setp.nan.f32 %p1, %f6, %f6;
	selp.u32 %r2, 7, 9, %p1;
	sin.approx.f32 %f7, %f2;
	add.f32 %f8, %f7, %f2;
	mul.f32 %f9, %f2, %f2;
	fma.rn.f32 %f9, %f9, %f2, %f4;
	neg.f64 %fd2, %fd1;
	add.f64 %fd3, %fd1, 0d3FF0000000000000;
	cvt.rzi.s32.f32 %r3, %f2;
	st.global.u32 [%rdout], %f3;
	st.global.f32 [%rdout+4], %f4;
	st.global.v2.f32 [%rdout+8], {%f5, %f6};
	st.global.v2.u32 [%rdout+16], {%r2, %r3};
	st.global.v2.f32 [%rdout+24], {%f8, %f9};
	st.global.f64 [%rdout+32], %fd2;
	st.global.u64 [%rdout+40], %fd3;
"#,
        ".reg .pred %p1;\n.reg .f32 %f<10>;\n.reg .b32 %r<4>;\n.reg .f64 %fd<4>;",
        &[
            u64::from(payload),
            u64::from(1.5f32.to_bits()),
            0x7ff8_0000_0000_0abc,
        ],
        6,
    );
    let lo = |w: u64| w as u32;
    let hi = |w: u64| (w >> 32) as u32;
    assert_eq!(lo(out[0]), payload | 1 << 31, "neg keeps the payload");
    assert_eq!(hi(out[0]), payload, "abs keeps the payload");
    assert_eq!(
        lo(out[1]),
        0x7fff_ffff,
        "arithmetic gives the canonical NaN"
    );
    assert_eq!(
        hi(out[1]),
        (payload | 1 << 31) + 1,
        "integer bits into a float"
    );
    assert_eq!(lo(out[2]), 7, "setp.nan of the moved bits");
    assert_eq!(hi(out[2]), 1, "cvt.rzi of 1.5");
    assert!(
        !f32::from_bits(lo(out[3])).is_nan(),
        "sin's result plus 1.5 is a number"
    );
    assert_eq!(hi(out[3]), 0x7fff_ffff, "fma with a NaN addend");
    assert_eq!(out[4], 0xfff8_0000_0000_0abc, "neg.f64 keeps the payload");
    assert_eq!(
        out[5], 0x7fff_ffff_ffff_ffff,
        "f64 arithmetic's canonical NaN"
    );
}

/// A kernel whose only collective instruction is the block's barrier runs as passes over
/// its threads: threads that exit early are left out of later passes and the barrier still
/// completes for the others, each resuming with its registers (here: a ring of 40 of a
/// block's 64 threads passing sums through shared memory over five rounds).
#[test]
fn block_barriers_with_early_exits_run_as_passes_over_the_threads() {
    let m = module(
        r#"
.visible .entry ring(.param .u64 out)
{
	.reg .pred %p<3>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<6>;
	.shared .align 4 .b8 sh[256];
	ld.param.u64 %rd1, [out];
	cvta.to.global.u64 %rd1, %rd1;
	mov.u32 %r1, %tid.x;
	setp.ge.u32 %p1, %r1, 40;
	@%p1 bra $L_end;
	mov.u64 %rd2, sh;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd2, %rd3;
	add.u32 %r2, %r1, 1;
	rem.u32 %r2, %r2, 40;
	mul.wide.u32 %rd3, %r2, 4;
	add.s64 %rd5, %rd2, %rd3;
	mov.u32 %r3, %r1;
	mov.u32 %r4, 0;
$L_round:
	st.shared.u32 [%rd4], %r3;
	bar.sync 0;
	ld.shared.u32 %r5, [%rd5];
	bar.sync 0;
	mad.lo.s32 %r3, %r3, 3, %r5;
	add.u32 %r4, %r4, 1;
	setp.lt.u32 %p2, %r4, 5;
	@%p2 bra $L_round;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd3, %rd1, %rd3;
	st.global.u32 [%rd3], %r3;
$L_end:
	ret;
}
.visible .entry spin()
{
$L_again:
	bar.sync 0;
	bra $L_again;
}
"#,
    );
    let mut r = Run::new(&m);
    let out = r.buffer(&[0; 64 * 4]);
    let params = pack(&m, "ring", &[out]);
    let (reference, compiled) =
        r.launch_pair("ring", [2, 1, 1], [64, 1, 1], 0, &params, 2, 1 << 30);
    reference.unwrap();
    assert!(compiled.unwrap().unwrap().compiled);
    let mut v: Vec<u32> = (0..40).collect();
    for _ in 0..5 {
        v = (0..40)
            .map(|i| v[i].wrapping_mul(3).wrapping_add(v[(i + 1) % 40]))
            .collect();
    }
    v.resize(64, 0);
    assert_eq!(to_u32s(&r.read(out, 64 * 4)), v);
    // A kernel looping over the barrier forever stops at its budget.
    let err = r
        .launch_with("spin", [8, 1, 1], [128, 1, 1], 0, &[], 2, 200_000)
        .unwrap_err();
    assert!(matches!(err, ComputeError::LaunchTimeout(_)), "{err:?}");
}

/// A looped kernel's passes look at the launch's stop flag, interrupt and budget (each a
/// read of the clock) once their threads' work or the threads gone by since the last look
/// call for it, not every few threads: here 17 passes over 1024 threads doing a few
/// instructions each between barriers made some 270 checks a block at one per 64 threads.
#[test]
fn barrier_passes_check_the_launch_by_work_not_by_thread() {
    let m = module(
        r#"
.visible .entry rounds(.param .u64 out)
{
	.reg .pred %p<2>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<6>;
	.shared .align 4 .b8 sh[4096];
	ld.param.u64 %rd1, [out];
	cvta.to.global.u64 %rd1, %rd1;
	mov.u32 %r1, %tid.x;
	mov.u64 %rd2, sh;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd2, %rd3;
	xor.b32 %r2, %r1, 1;
	mul.wide.u32 %rd3, %r2, 4;
	add.s64 %rd5, %rd2, %rd3;
	mov.u32 %r3, %r1;
	mov.u32 %r4, 0;
$L_round:
	st.shared.u32 [%rd4], %r3;
	bar.sync 0;
	ld.shared.u32 %r5, [%rd5];
	bar.sync 0;
	add.u32 %r3, %r3, %r5;
	add.u32 %r4, %r4, 1;
	setp.lt.u32 %p1, %r4, 8;
	@%p1 bra $L_round;
	mov.u32 %r6, %ctaid.x;
	mad.lo.u32 %r6, %r6, 1024, %r1;
	mul.wide.u32 %rd3, %r6, 4;
	add.s64 %rd3, %rd1, %rd3;
	st.global.u32 [%rd3], %r3;
	ret;
}
"#,
    );
    const BLOCKS: u32 = 4;
    let mut r = Run::new(&m);
    let out = r.buffer(&vec![0; BLOCKS as usize * 1024 * 4]);
    let params = pack(&m, "rounds", &[out]);
    let (reference, compiled) = r.launch_pair(
        "rounds",
        [BLOCKS, 1, 1],
        [1024, 1, 1],
        0,
        &params,
        1,
        1 << 30,
    );
    reference.unwrap();
    let compiled = compiled.unwrap().unwrap();
    assert!(compiled.compiled);
    // Per block: its setup, its end, a look per THREADS_PER_CHECK threads of its 17 passes
    // and per FUEL_CHECK thread-instructions of its some 130 Ki.
    assert!(
        compiled.checks <= u64::from(BLOCKS) * 8,
        "{} checks for {BLOCKS} blocks",
        compiled.checks
    );
    let expect: Vec<u32> = (0..BLOCKS * 1024)
        .map(|i| {
            let t = i % 1024;
            (t + (t ^ 1)) << 7
        })
        .collect();
    assert_eq!(to_u32s(&r.read(out, expect.len() * 4)), expect);
}

/// The registers a barrier in a loop stores are those the loop may have changed, and a
/// thread resuming there loads those it uses: values written before the loop (stored there,
/// once), written in the loop only under a guard (stored at the barrier from what was loaded
/// when the guard is false), or under a guard before it, all come back intact after each
/// barrier, on blocks that reuse
/// one host thread's saved registers (the previous block's values still in them), with the
/// block's barrier alone (passes over the threads) and with a warp shuffle (threads resumed
/// one by one).
#[test]
fn registers_kept_across_barriers_in_a_loop_come_back_on_every_block() {
    let kernel = |name: &str, exchange: &str| {
        format!(
            r#"
.visible .entry {name}(.param .u64 out)
{{
	.reg .pred %p<4>;
	.reg .b32 %r<12>;
	.reg .b64 %rd<6>;
	.shared .align 4 .b8 sh_{name}[256];
	ld.param.u64 %rd1, [out];
	cvta.to.global.u64 %rd1, %rd1;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ctaid.x;
	mad.lo.s32 %r3, %r2, 1000, %r1;
	setp.eq.u32 %p1, %r1, 3;
	@%p1 add.u32 %r3, %r3, 77;
	mov.u32 %r4, 0;
	add.u32 %r6, %r2, 5;
	add.u32 %r10, %r2, 9;
	mov.u64 %rd2, sh_{name};
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd2, %rd3;
	xor.b32 %r7, %r1, 1;
	mul.wide.u32 %rd3, %r7, 4;
	add.s64 %rd5, %rd2, %rd3;
$L_loop:
{exchange}
	setp.gt.u32 %p2, %r5, %r3;
	@%p2 add.u32 %r6, %r6, %r2;
	@%p2 mov.u32 %r10, %r4;
	bar.sync 0;
	add.u32 %r3, %r3, %r5;
	add.u32 %r4, %r4, 1;
	setp.lt.u32 %p3, %r4, 4;
	@%p3 bra $L_loop;
	add.u32 %r8, %r3, %r6;
	mad.lo.s32 %r8, %r7, 100000, %r8;
	mad.lo.s32 %r8, %r10, 7, %r8;
	mad.lo.s32 %r9, %r2, 64, %r1;
	mul.wide.u32 %rd3, %r9, 4;
	add.s64 %rd3, %rd1, %rd3;
	st.global.u32 [%rd3], %r8;
	ret;
}}
"#
        )
    };
    let shared = "\tst.shared.u32 [%rd4], %r3;\n\tbar.sync 0;\n\tld.shared.u32 %r5, [%rd5];";
    let shuffle = "\tshfl.sync.bfly.b32 %r5, %r3, 1, 31, -1;";
    let m = module(&(kernel("passes", shared) + &kernel("resumed", shuffle)));
    let (blocks, threads) = (4usize, 64usize);
    let mut want = Vec::new();
    for b in 0..blocks as u32 {
        let mut r3: Vec<u32> = (0..threads as u32)
            .map(|t| b * 1000 + t + if t == 3 { 77 } else { 0 })
            .collect();
        let mut r6 = vec![b + 5; threads];
        let mut r10 = vec![b + 9; threads];
        for k in 0..4 {
            let r5: Vec<u32> = (0..threads).map(|t| r3[t ^ 1]).collect();
            for t in 0..threads {
                if r5[t] > r3[t] {
                    r6[t] += b;
                    r10[t] = k;
                }
                r3[t] = r3[t].wrapping_add(r5[t]);
            }
        }
        want.extend((0..threads).map(|t| {
            let r7 = t as u32 ^ 1;
            r7.wrapping_mul(100_000)
                .wrapping_add(r3[t])
                .wrapping_add(r6[t])
                .wrapping_add(r10[t].wrapping_mul(7))
        }));
    }
    for name in ["passes", "resumed"] {
        let mut r = Run::new(&m);
        let out = r.buffer(&vec![0; blocks * threads * 4]);
        let params = pack(&m, name, &[out]);
        let (reference, compiled) = r.launch_pair(
            name,
            [blocks as u32, 1, 1],
            [threads as u32, 1, 1],
            0,
            &params,
            1,
            1 << 30,
        );
        reference.unwrap();
        assert!(compiled.unwrap().unwrap().compiled, "{name}");
        assert_eq!(to_u32s(&r.read(out, blocks * threads * 4)), want, "{name}");
    }
}

#[test]
fn a_texture_descriptor_rewritten_between_and_within_launches_is_fetched_anew() {
    // Thread 0 fetches texel (2.5, 0.5), points the descriptor at other texels and fetches
    // again; `corrupt` gives it three channels between two fetches instead.
    let m = module(
        r#"
.visible .entry retex(.param .u64 t, .param .u64 o, .param .u64 other)
{
    .reg .f32 %f<12>; .reg .b64 %rd<4>; .reg .b32 %r<2>;
    ld.param.u64 %rd1, [t]; ld.param.u64 %rd2, [o]; ld.param.u64 %rd3, [other];
    mov.f32 %f1, 0f40200000; mov.f32 %f2, 0f3F000000;
    tex.2d.v4.f32.f32 {%f3, %f4, %f5, %f6}, [%rd1, {%f1, %f2}];
    st.global.f32 [%rd2], %f3;
    mov.b64 {%r0, %r1}, %rd3;
    st.global.u32 [%rd1+24], %r0;
    st.global.u32 [%rd1+28], %r1;
    tex.2d.v4.f32.f32 {%f7, %f8, %f9, %f10}, [%rd1, {%f1, %f2}];
    st.global.f32 [%rd2+4], %f7;
    ret;
}
.visible .entry corrupt(.param .u64 t, .param .u64 o, .param .u64 other)
{
    .reg .f32 %f<12>; .reg .b64 %rd<4>; .reg .b16 %h;
    ld.param.u64 %rd1, [t]; ld.param.u64 %rd2, [o];
    mov.f32 %f1, 0f40200000; mov.f32 %f2, 0f3F000000;
    tex.2d.v4.f32.f32 {%f3, %f4, %f5, %f6}, [%rd1, {%f1, %f2}];
    st.global.f32 [%rd2], %f3;
    mov.b16 %h, 3;
    st.global.u8 [%rd1+5], %h;
    tex.2d.v4.f32.f32 {%f7, %f8, %f9, %f10}, [%rd1, {%f1, %f2}];
    st.global.f32 [%rd2+4], %f7;
    ret;
}
"#,
    );
    let floats = |v: [f32; 4]| v.map(f32::to_le_bytes).concat();
    let mut r = Run::new(&m);
    let first = r.buffer(&floats([1.0, 2.0, 3.0, 4.0]));
    let other = r.buffer(&floats([10.0, 20.0, 30.0, 40.0]));
    let desc = |w: u32, h: u32| {
        texture::Descriptor {
            surface: false,
            format: texture::Format::F32,
            channels: 1,
            flags: 0,
            address: [texture::AddressMode::Clamp; 3],
            extent: [w, h, 1],
            base: first,
            pitch: u64::from(w) * 4,
            slice: u64::from(w * h) * 4,
            border: [0.0; 4],
            mip: texture::Mip::NONE,
        }
        .encode()
    };
    // The descriptor at a word boundary, then 4 bytes past one (its bytes in 11 words).
    let space = r.buffer(&[0; texture::DESCRIPTOR_BYTES + 8]);
    let out = r.buffer(&[0; 8]);
    for handle in [space, space + 4] {
        let launch = |r: &Run, kernel: &str| {
            let params = pack(&m, kernel, &[handle, out, other]);
            let (reference, compiled) =
                r.launch_pair(kernel, [1, 1, 1], [1, 1, 1], 0, &params, 1, 1 << 30);
            if let Ok(compiled) = compiled.unwrap() {
                assert!(compiled.compiled, "{kernel} ran compiled");
            }
            reference.map(|_| to_f32s(&r.read(out, 8)))
        };
        // 2 x 2: x 2.5 clamps to texel 1 of row 0.
        r.write(handle, &desc(2, 2));
        assert_eq!(launch(&r, "retex").unwrap(), [2.0, 20.0], "{handle:#x}");
        // The same handle, now one row of 4 over the first texels: texel 2.
        r.write(handle, &desc(4, 1));
        assert_eq!(launch(&r, "retex").unwrap(), [3.0, 30.0], "{handle:#x}");
        // A descriptor corrupted after a fetch is refused at the next, on both engines alike.
        r.write(handle, &desc(4, 1));
        let err = launch(&r, "corrupt").unwrap_err();
        assert_eq!(err.cuda_status(), 700, "{err}");
        assert_eq!(to_f32s(&r.read(out, 4)), [3.0]);
    }
}

#[test]
fn integers_convert_to_single_to_nearest_ties_to_even() {
    // Each input word through cvt.rn.f32.s32, .u32 and .s64 (compiled inline), against Rust's
    // `as`, which rounds once to nearest, ties to even.
    let inputs: [u64; 8] = [
        (1 << 24) + 1,
        (1 << 24) + 3,
        (-(1i64 << 24) - 1) as u64,
        i32::MAX as u64,
        0x8000_0001,
        i64::MAX as u64,
        i64::MIN as u64,
        (1 << 53) + 1,
    ];
    let body: String = (0..inputs.len())
        .map(|i| {
            format!(
                "ld.global.u64 %rd1, [%rdin+{o}];\ncvt.u32.u64 %r1, %rd1;\n\
                 cvt.rn.f32.s32 %f1, %r1;\ncvt.rn.f32.u32 %f2, %r1;\ncvt.rn.f32.s64 %f3, %rd1;\n\
                 st.global.v2.f32 [%rdout+{a}], {{%f1, %f2}};\nst.global.f32 [%rdout+{b}], %f3;\n",
                o = 8 * i,
                a = 16 * i,
                b = 16 * i + 8
            )
        })
        .collect();
    let out = scalar(
        &body,
        ".reg .b64 %rd1;\n.reg .b32 %r1;\n.reg .f32 %f<4>;",
        &inputs,
        2 * inputs.len(),
    );
    for (i, &x) in inputs.iter().enumerate() {
        let w = x as u32;
        let want = [
            u64::from((w as i32 as f32).to_bits()) | u64::from((w as f32).to_bits()) << 32,
            u64::from((x as i64 as f32).to_bits()),
        ];
        assert_eq!([out[2 * i], out[2 * i + 1] & 0xffff_ffff], want, "{x:#x}");
    }
}
