//! The CUDA corpus (tests/cuda, built by qemu-scripts/cuda-corpus.sh with nvcc's default
//! options) run through the compute backend trait on the CPU backend: each program's own
//! executable is the module image (its fat binary is found, decompressed and its PTX parsed),
//! its kernel is launched as the program's host code launches it, and the results are checked
//! against host computations. The faulting and the never-ending kernels must be contained.
//! The GCC OpenMP offloading programs have all their PTX images (region, libgomp, newlib)
//! linked into one module and their target region launched as libgomp's nvptx plugin does.
//!
//! With VGPU_COMPUTE=nvcuda the same programs and checks run on the real driver instead (the
//! differential check, `qemu-scripts/cuda-differential.sh`); the CPU-only expectations (printf
//! capture, the instruction budget) are then skipped.
//!
//! Without a corpus the tests skip, unless VGPU_REQUIRE_CUDA_CORPUS=1 (the README's test
//! command builds the corpus and sets it), when they fail.

use std::path::PathBuf;

use mdev_backend::compute::backend::*;
use mdev_backend::compute::corpus::corpus_for_tests;
use mdev_backend::compute::fatbin::extract_ptx;
use mdev_backend::compute::{ComputeBackend, ComputeError, CpuBackend, CpuConfig, NvCuda};

fn corpus() -> Option<PathBuf> {
    corpus_for_tests("vector_add")
}

/// Whether the tests run on the real driver.
fn on_nvcuda() -> bool {
    std::env::var("VGPU_COMPUTE").is_ok_and(|v| v == "nvcuda")
}

struct Program {
    be: Box<dyn ComputeBackend>,
    ctx: ContextId,
    function: FunctionId,
    params: Vec<ParamInfo>,
}

/// Programs whose device printf a test reads back (on the real driver, the test process's
/// standard output is then captured).
const PRINTF_PROGRAMS: &[&str] = &["hello"];

impl Program {
    fn load(program: &str, kernel: &str, config: CpuConfig) -> Option<Program> {
        Program::open(program, kernel, config, false)
    }

    /// Loads a corpus program (linking all its PTX images when `link`) on the backend under
    /// test, ready to launch `kernel`.
    fn open(program: &str, kernel: &str, config: CpuConfig, link: bool) -> Option<Program> {
        let image = std::fs::read(corpus()?.join(program)).expect("corpus program");
        let mut be: Box<dyn ComputeBackend> = if on_nvcuda() {
            let mut nv =
                NvCuda::new(0).expect("VGPU_COMPUTE=nvcuda needs a CUDA driver and device");
            if PRINTF_PROGRAMS.contains(&program) {
                // The driver prints on this process's stdout: captured, as vgpu-cuda-host does.
                nv.capture_printf().unwrap();
            }
            Box::new(nv)
        } else {
            Box::new(CpuBackend::new(config))
        };
        let ctx = be.context_create().unwrap();
        let module = if link {
            be.module_link(ctx, &[&image])
        } else {
            be.module_load(ctx, &image)
        }
        .unwrap_or_else(|e| panic!("{program}: {e}"));
        let (function, params) = be.function(ctx, module, kernel).unwrap();
        Some(Program {
            be,
            ctx,
            function,
            params,
        })
    }

    fn buffer(&mut self, bytes: &[u8]) -> u64 {
        let a = self.be.mem_alloc(self.ctx, bytes.len() as u64).unwrap();
        self.be
            .copy_htod(self.ctx, a, bytes, DEFAULT_STREAM)
            .unwrap();
        a
    }

    fn zeroed(&mut self, n: u64) -> u64 {
        let a = self.be.mem_alloc(self.ctx, n).unwrap();
        self.be
            .memset_d8(self.ctx, a, 0, n, DEFAULT_STREAM)
            .unwrap();
        a
    }

    fn read(&mut self, addr: u64, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.be
            .copy_dtoh(self.ctx, &mut v, addr, DEFAULT_STREAM)
            .unwrap();
        v
    }

    /// Packs `args` (raw little-endian values) at the kernel's parameter layout.
    fn pack(&self, args: &[u64]) -> Vec<u8> {
        assert_eq!(args.len(), self.params.len());
        pack_params(&self.params, args)
    }

    fn launch(
        &mut self,
        grid: [u32; 3],
        block: [u32; 3],
        args: &[u64],
        stream: StreamId,
    ) -> Result<(), ComputeError> {
        let params = self.pack(args);
        let l = KernelLaunch {
            function: self.function,
            grid,
            block,
            shared_bytes: 0,
            stream,
            params: &params,
            cooperative: false,
        };
        self.be.launch(self.ctx, &l)
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn words<T: Copy>(b: &[u8], f: fn([u8; 4]) -> T) -> Vec<T> {
    b.chunks(4).map(|c| f(c.try_into().unwrap())).collect()
}

#[test]
fn vector_add_in_every_compression_mode() {
    for program in [
        "vector_add",
        "vector_add.compress-none",
        "vector_add.compress-speed",
        "vector_add.compress-size",
    ] {
        let Some(mut p) = Program::load(program, "_Z6vecAddPKfS0_Pfi", CpuConfig::default()) else {
            return;
        };
        let n = 100_000usize;
        let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..n).map(|i| 1.0 / (i as f32 + 1.0)).collect();
        let (da, db, dc) = (
            p.buffer(&f32s(&a)),
            p.buffer(&f32s(&b)),
            p.zeroed(n as u64 * 4),
        );
        p.launch(
            [(n as u32).div_ceil(256), 1, 1],
            [256, 1, 1],
            &[da, db, dc, n as u64],
            DEFAULT_STREAM,
        )
        .unwrap();
        let c = words(&p.read(dc, n * 4), f32::from_le_bytes);
        assert!(
            (0..n).all(|i| c[i].to_bits() == (a[i] + b[i]).to_bits()),
            "{program}"
        );
    }
}

#[test]
fn every_compression_mode_holds_the_same_ptx() {
    let Some(dir) = corpus() else { return };
    let texts: Vec<String> = [
        "vector_add",
        "vector_add.compress-none",
        "vector_add.compress-speed",
        "vector_add.compress-size",
    ]
    .iter()
    .map(|p| {
        extract_ptx(&std::fs::read(dir.join(p)).unwrap())
            .unwrap()
            .remove(0)
            .text
    })
    .collect();
    assert!(texts[0].contains(".entry _Z6vecAddPKfS0_Pfi"));
    assert!(texts.iter().all(|t| *t == texts[0]));
}

#[test]
fn tiled_matrix_multiply() {
    let Some(mut p) = Program::load("matmul", "_Z6matmulPKfS0_Pfi", CpuConfig::default()) else {
        return;
    };
    let n = 128usize;
    let a: Vec<f32> = (0..n * n).map(|i| (i * 7 % 13) as f32 - 6.0).collect();
    let b: Vec<f32> = (0..n * n).map(|i| (i * 5 % 11) as f32 * 0.25).collect();
    let (da, db, dc) = (
        p.buffer(&f32s(&a)),
        p.buffer(&f32s(&b)),
        p.zeroed((n * n * 4) as u64),
    );
    p.launch(
        [8, 8, 1],
        [16, 16, 1],
        &[da, db, dc, n as u64],
        DEFAULT_STREAM,
    )
    .unwrap();
    let c = words(&p.read(dc, n * n * 4), f32::from_le_bytes);
    for r in 0..n {
        for col in 0..n {
            let s = (0..n).fold(0f32, |s, k| a[r * n + k].mul_add(b[k * n + col], s));
            assert_eq!(c[r * n + col].to_bits(), s.to_bits(), "{r},{col}");
        }
    }
}

#[test]
fn reduction_with_shuffles_and_atomics() {
    let Some(mut p) = Program::load("reduce", "_Z9reduceSumPKjPji", CpuConfig::default()) else {
        return;
    };
    let n = 1usize << 20;
    let v: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) >> 20)
        .collect();
    let want = v.iter().fold(0u32, |s, x| s.wrapping_add(*x));
    let din = p.buffer(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>());
    let dout = p.zeroed(4);
    p.launch(
        [(n / 256) as u32, 1, 1],
        [256, 1, 1],
        &[din, dout, n as u64],
        DEFAULT_STREAM,
    )
    .unwrap();
    assert_eq!(words(&p.read(dout, 4), u32::from_le_bytes), [want]);
}

#[test]
fn block_scan() {
    let Some(mut p) = Program::load("scan", "_Z10scanBlocksPKiPii", CpuConfig::default()) else {
        return;
    };
    let n = 5000usize;
    let h: Vec<i32> = (0..n as i32).map(|i| (i * 37) % 101 - 50).collect();
    let din = p.buffer(&h.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>());
    let dout = p.zeroed(n as u64 * 4);
    p.launch(
        [(n as u32).div_ceil(256), 1, 1],
        [256, 1, 1],
        &[din, dout, n as u64],
        DEFAULT_STREAM,
    )
    .unwrap();
    let got = words(&p.read(dout, n * 4), i32::from_le_bytes);
    let mut s = 0;
    for i in 0..n {
        s = if i % 256 == 0 { h[i] } else { s + h[i] };
        assert_eq!(got[i], s, "element {i}");
    }
}

#[test]
fn shared_memory_histogram() {
    let Some(mut p) = Program::load("histogram", "_Z9histogramPKhPji", CpuConfig::default()) else {
        return;
    };
    let n = 1usize << 18;
    let data: Vec<u8> = (0..n).map(|i| ((i * i + 7 * i) & 0xff) as u8).collect();
    let mut want = [0u32; 256];
    for b in &data {
        want[usize::from(*b)] += 1;
    }
    let dd = p.buffer(&data);
    let bins = p.zeroed(1024);
    p.launch(
        [64, 1, 1],
        [256, 1, 1],
        &[dd, bins, n as u64],
        DEFAULT_STREAM,
    )
    .unwrap();
    assert_eq!(words(&p.read(bins, 1024), u32::from_le_bytes), want);
}

#[test]
fn vector_copy_after_memset() {
    let Some(mut p) = Program::load(
        "bandwidth",
        "_Z8copyVec4PK6float4PS_i",
        CpuConfig::default(),
    ) else {
        return;
    };
    let n = 1u64 << 16;
    let a = p.be.mem_alloc(p.ctx, n * 16).unwrap();
    let b = p.zeroed(n * 16);
    p.be.memset_d32(p.ctx, a, 0x3f80_0000, n * 4, DEFAULT_STREAM)
        .unwrap();
    p.launch([64, 1, 1], [256, 1, 1], &[a, b, n], DEFAULT_STREAM)
        .unwrap();
    assert!(
        words(&p.read(b, (n * 16) as usize), f32::from_le_bytes)
            .iter()
            .all(|&x| x == 1.0)
    );
}

#[test]
fn device_query_kernel_sees_the_launch_geometry() {
    let Some(mut p) = Program::load("device_query", "_Z5queryPi", CpuConfig::default()) else {
        return;
    };
    let attrs = p.be.attributes();
    assert_eq!((attrs.warp_size, attrs.max_threads_per_block), (32, 1024));
    let out = p.zeroed(16);
    p.launch([3, 1, 1], [64, 1, 1], &[out], DEFAULT_STREAM)
        .unwrap();
    assert_eq!(words(&p.read(out, 16), i32::from_le_bytes), [32, 64, 3, 5]);
}

#[test]
fn streams_and_events() {
    let Some(mut p) = Program::load("streams_events", "_Z5scalePffi", CpuConfig::default()) else {
        return;
    };
    let n = 1usize << 16;
    let half = n / 2;
    let h: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let d = p.zeroed(n as u64 * 4);
    let mut out = vec![0u8; n * 4];
    for k in 0..2 {
        let s = p.be.stream_create(p.ctx).unwrap();
        let (start, stop) = (
            p.be.event_create(p.ctx).unwrap(),
            p.be.event_create(p.ctx).unwrap(),
        );
        let base = d + (k * half * 4) as u64;
        p.be.copy_htod(p.ctx, base, &f32s(&h[k * half..(k + 1) * half]), s)
            .unwrap();
        p.be.event_record(p.ctx, start, s).unwrap();
        let scale = if k == 1 { 3.0f32 } else { 2.0 };
        p.launch(
            [(half / 256) as u32, 1, 1],
            [256, 1, 1],
            &[base, u64::from(scale.to_bits()), half as u64],
            s,
        )
        .unwrap();
        p.be.event_record(p.ctx, stop, s).unwrap();
        p.be.copy_dtoh(p.ctx, &mut out[k * half * 4..(k + 1) * half * 4], base, s)
            .unwrap();
        p.be.stream_synchronize(p.ctx, s).unwrap();
        assert!(p.be.event_elapsed_ms(p.ctx, start, stop).unwrap() >= 0.0);
        p.be.stream_destroy(p.ctx, s).unwrap();
        assert!(
            p.be.stream_synchronize(p.ctx, s).is_err(),
            "a destroyed stream is gone"
        );
    }
    let got = words(&out, f32::from_le_bytes);
    assert!((0..n).all(|i| got[i] == i as f32 * if i < half { 2.0 } else { 3.0 }));
}

#[test]
fn printf_reaches_the_context_output() {
    let Some(mut p) = Program::load("hello", "_Z5helloi", CpuConfig::default()) else {
        return;
    };
    p.launch([2, 1, 1], [32, 1, 1], &[2], DEFAULT_STREAM)
        .unwrap();
    p.be.context_synchronize(p.ctx).unwrap();
    let want = "block 0 thread 0 value 0.00\nblock 0 thread 1 value 1.50\nblock 1 thread 0 value 0.00\nblock 1 thread 1 value 1.50\n";
    let got = p.be.take_output(p.ctx).unwrap();
    if on_nvcuda() {
        // A GPU runs blocks in no set order: the same lines.
        let mut got: Vec<&str> = got.lines().collect();
        got.sort_unstable();
        assert_eq!(got, want.lines().collect::<Vec<_>>());
    } else {
        // The executor prints in block order.
        assert_eq!(got, want);
    }
}

#[test]
fn a_faulting_kernel_breaks_its_context_only_or_the_process_on_the_real_driver() {
    let Some(mut p) = Program::load("fault", "_Z3oobPi", CpuConfig::default()) else {
        return;
    };
    let other = p.be.context_create().unwrap();
    let keep = p.be.mem_alloc(other, 64).unwrap();
    p.be.copy_htod(other, keep, &[7; 64], DEFAULT_STREAM)
        .unwrap();
    let d = p.zeroed(256);
    // The executor reports the fault at the launch; the real driver at the synchronisation.
    let err = p
        .launch([1, 1, 1], [32, 1, 1], &[d], DEFAULT_STREAM)
        .and_then(|()| p.be.context_synchronize(p.ctx))
        .unwrap_err();
    assert_eq!(err.cuda_status(), 700, "{err}");
    // Sticky for its context, as on the real driver ...
    let again = p.be.mem_alloc(p.ctx, 16).unwrap_err();
    assert!(matches!(again, ComputeError::ContextBroken(_)), "{again:?}");
    if p.be.faults_are_process_wide() {
        // The real driver: CUDA's state is per process, so the other context is broken too.
        let other = p.be.copy_dtoh(other, &mut [0u8; 64], keep, DEFAULT_STREAM);
        assert!(
            matches!(other, Err(ComputeError::ContextBroken(_))),
            "{other:?}"
        );
        return;
    }
    // ... and nothing for the other one.
    let mut back = [0u8; 64];
    p.be.copy_dtoh(other, &mut back, keep, DEFAULT_STREAM)
        .unwrap();
    assert_eq!(back, [7; 64]);
    p.be.context_destroy(p.ctx).unwrap();
}

#[test]
fn a_never_ending_kernel_is_a_launch_timeout() {
    if on_nvcuda() {
        // A real GPU without a display watchdog would spin until the process ends.
        return;
    }
    let config = CpuConfig {
        instruction_budget: 5_000_000,
        ..CpuConfig::default()
    };
    let Some(mut p) = Program::load("spin", "_Z4spinPVi", config) else {
        return;
    };
    let flag = p.zeroed(4);
    let start = std::time::Instant::now();
    let err = p
        .launch([2, 1, 1], [64, 1, 1], &[flag], DEFAULT_STREAM)
        .unwrap_err();
    assert_eq!(err.cuda_status(), 702, "{err}");
    assert!(start.elapsed() < std::time::Duration::from_secs(60));
    assert!(matches!(
        p.be.context_synchronize(p.ctx),
        Err(ComputeError::ContextBroken(_))
    ));
}

#[test]
fn gcc_offload_programs_hold_their_ptx() {
    let Some(dir) = corpus() else { return };
    for program in ["omp_saxpy", "omp_reduction"] {
        let images = extract_ptx(&std::fs::read(dir.join(program)).unwrap()).unwrap();
        assert!(
            images
                .iter()
                .all(|p| p.arch == 30 && p.text.contains(".version")),
            "{program}"
        );
        assert!(
            images.iter().any(|p| p.text.contains("main$_omp_fn$0")),
            "{program}: the offloaded region"
        );
    }
}

/// Per-warp soft stack libgomp's nvptx plugin gives an OpenMP target region (GCC 12).
const OMP_STACK_BYTES: u64 = 128 * 1024;

/// Runs the target region of a GCC offloading program as libgomp's nvptx plugin does: every
/// PTX image linked into one module, `main$_omp_fn$0` launched on `teams` blocks of 32 ×
/// `warps` threads with (mapped-variable table, soft stacks, stack size) as its parameters.
/// `vars` are the device addresses of the mapped variables, in the region's order.
fn run_omp_region(p: &mut Program, teams: u32, warps: u32, vars: &[u64]) {
    let table: Vec<u8> = vars.iter().flat_map(|v| v.to_le_bytes()).collect();
    let table = p.buffer(&table);
    let stacks = p.zeroed(OMP_STACK_BYTES * u64::from(teams * warps));
    p.launch(
        [teams, 1, 1],
        [32, warps, 1],
        &[table, stacks, OMP_STACK_BYTES],
        DEFAULT_STREAM,
    )
    .unwrap_or_else(|e| panic!("OpenMP target region: {e}"));
}

#[test]
fn gcc_offload_saxpy_runs_on_the_linked_module() {
    const N: usize = 4096;
    let Some(mut p) = Program::open("omp_saxpy", "main$_omp_fn$0", CpuConfig::default(), true)
    else {
        return;
    };
    let x: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let x = p.buffer(&f32s(&x));
    let y = p.buffer(&f32s(&[1.0; N]));
    for (teams, warps) in [(1, 1), (3, 4)] {
        p.be.memset_d32(p.ctx, y, 1.0f32.to_bits(), N as u64, DEFAULT_STREAM)
            .unwrap();
        run_omp_region(&mut p, teams, warps, &[x, y]);
        let got = words(&p.read(y, N * 4), f32::from_le_bytes);
        for (i, v) in got.iter().enumerate() {
            assert_eq!(
                *v,
                2.0 * i as f32 + 1.0,
                "y[{i}] with {teams} teams of {warps} warps"
            );
        }
    }
}

#[test]
fn gcc_offload_reduction_runs_on_the_linked_module() {
    let Some(mut p) = Program::open(
        "omp_reduction",
        "main$_omp_fn$0",
        CpuConfig::default(),
        true,
    ) else {
        return;
    };
    let n: i64 = 100_000;
    let want = (n - 1) * n * (2 * n - 1) / 6;
    for (teams, warps) in [(1, 1), (2, 4), (4, 8)] {
        let sum = p.zeroed(8);
        run_omp_region(&mut p, teams, warps, &[sum]);
        let got = i64::from_le_bytes(p.read(sum, 8).try_into().unwrap());
        assert_eq!(got, want, "{teams} teams of {warps} warps");
    }
}
