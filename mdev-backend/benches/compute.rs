//! The PTX executor's speed on the CPU backend, over the CUDA corpus's own nvcc output (run
//! qemu-scripts/cuda-corpus.sh first; VGPU_CUDA_CORPUS names another corpus directory):
//!
//! - `executor/matmul/T`: the 128×128 tiled matrix multiply (8×8 blocks of 16×16 threads) on T
//!   host threads; throughput in warp-instructions (counted by the executor), so the speed-up
//!   with cores is the ratio of the rates.
//!
//! Launch and copy costs through the trait and the executor: `benches/compute_backend.rs`.
//!
//! Besides criterion's own output, the means go to `target/compute-bench.json` and its figure
//! `.svg` (time per launch against the threads).
//!
//! `cargo bench -p mdev-backend --bench compute`

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use mdev_backend::compute::backend::*;
use mdev_backend::compute::fatbin::extract_ptx;
use mdev_backend::compute::ptx::{Launch, Module, launch};
use mdev_backend::compute::{CpuBackend, CpuConfig, DeviceMemory, GlobalMemory};

const MATMUL: &str = "_Z6matmulPKfS0_Pfi";
const N: u64 = 128;

fn corpus_program(name: &str) -> Option<Vec<u8>> {
    std::fs::read(mdev_backend::compute::corpus::corpus_dir()?.join(name)).ok()
}

/// The warp-instructions one matmul launch executes, as the executor counts them.
fn matmul_warp_instructions(program: &[u8]) -> u64 {
    let text = extract_ptx(program).expect("ptx").remove(0).text;
    let module = Module::parse(&text).expect("parse");
    let mut mem = DeviceMemory::new(1 << 20);
    let bufs: Vec<u64> = (0..3)
        .map(|_| mem.alloc(N * N * 4).expect("alloc"))
        .collect();
    let params = module.kernel(MATMUL).expect("kernel").params.clone();
    let args = pack_params(&params, &[bufs[0], bufs[1], bufs[2], N]);
    let l = Launch {
        grid: [8, 8, 1],
        block: [16, 16, 1],
        dynamic_shared_bytes: 0,
        params: &args,
        symbols: &[],
        heap: None,
        interrupt: None,
        instruction_budget: u64::MAX,
        threads: 1,
        budget: &mdev_backend::budget::MemoryBudget::new(u64::MAX),
        engine: mdev_backend::compute::ptx::Engine::Interpreter,
        cooperative: None,
    };
    launch(&module, MATMUL, &l, &mem as &dyn GlobalMemory)
        .expect("launch")
        .warp_instructions
}

fn executor(c: &mut Criterion) {
    let Some(program) = corpus_program("matmul") else {
        eprintln!("no CUDA corpus: run qemu-scripts/cuda-corpus.sh");
        return;
    };
    let per_launch = matmul_warp_instructions(&program);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut group = c.benchmark_group("executor/matmul");
    group.sample_size(10);
    group.throughput(Throughput::Elements(per_launch));
    let mut threads = 1;
    while threads <= cores {
        let mut be = CpuBackend::new(CpuConfig {
            threads,
            ..CpuConfig::default()
        });
        let ctx = be.context_create().expect("context");
        let module = be.module_load(ctx, &program).expect("module");
        let (f, params) = be.function(ctx, module, MATMUL).expect("kernel");
        let bufs: Vec<u64> = (0..3)
            .map(|_| be.mem_alloc(ctx, N * N * 4).expect("alloc"))
            .collect();
        let args = pack_params(&params, &[bufs[0], bufs[1], bufs[2], N]);
        let l = KernelLaunch {
            function: f,
            grid: [8, 8, 1],
            block: [16, 16, 1],
            shared_bytes: 0,
            stream: DEFAULT_STREAM,
            params: &args,
            cooperative: false,
        };
        group.bench_with_input(BenchmarkId::from_parameter(threads), &threads, |b, _| {
            b.iter(|| be.launch(ctx, &l).expect("launch"))
        });
        threads *= 2;
    }
    group.finish();
}

criterion_group!(benches, executor);

/// criterion's `criterion_main!`, then the summary JSON and figure.
fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    let summary = vgpu_bench_report::criterion::Summary {
        name: "compute-bench",
        prefix: "executor/matmul",
        title: "PTX executor: the corpus's 128x128 tiled matmul (8x8 blocks of 16x16 threads) on the CPU backend",
        x_label: "host threads",
        y_label: "ms per launch (mean)",
        unit_ns: 1e6,
    };
    if let Err(e) = vgpu_bench_report::criterion::write_summary(&summary) {
        eprintln!("no summary: {e}");
    }
}
