//! Launch and copy overhead of the compute backend: an empty kernel's launch to completion and
//! host-to-device / device-to-host copies at a few sizes, called directly through the trait and
//! through the VM's executor thread (one request, its reply, and for launches the group's two
//! events).
//!
//! The backend is `NvCuda` when `VGPU_COMPUTE=nvcuda` is set and the driver loads, else the
//! CPU backend. The benchmark names carry which one ran.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use mdev_backend::compute::backend::{ContextId, DEFAULT_STREAM, FunctionId, KernelLaunch};
use mdev_backend::compute::{
    ComputeBackend, CpuConfig, Executor, ExecutorConfig, backend_from_env,
};

const EMPTY: &str = ".version 7.0\n.target sm_70\n.address_size 64\n\
                     .visible .entry empty()\n{\n    ret;\n}\n";

/// Copy sizes measured.
const SIZES: &[usize] = &[4 << 10, 1 << 20, 16 << 20];

fn make_backend() -> (&'static str, Box<dyn ComputeBackend>) {
    backend_from_env(CpuConfig {
        memory_per_context: 256 << 20,
        ..CpuConfig::default()
    })
}

/// A context with the empty kernel loaded and two buffers of the largest size.
fn setup(b: &mut dyn ComputeBackend) -> (ContextId, FunctionId, u64) {
    let c = b.context_create().expect("context");
    let m = b.module_load(c, EMPTY.as_bytes()).expect("module");
    let f = b.function(c, m, "empty").expect("function").0;
    let max = *SIZES.iter().max().expect("sizes") as u64;
    let dev = b.mem_alloc(c, max).expect("buffer");
    (c, f, dev)
}

fn empty_launch(f: FunctionId) -> KernelLaunch<'static> {
    KernelLaunch {
        function: f,
        grid: [1; 3],
        block: [32, 1, 1],
        shared_bytes: 0,
        stream: DEFAULT_STREAM,
        params: &[],
        cooperative: false,
    }
}

fn direct(c: &mut Criterion) {
    let (name, mut b) = make_backend();
    let (ctx, f, dev) = setup(b.as_mut());
    let mut g = c.benchmark_group(format!("{name}/trait"));
    g.bench_function("launch_empty_kernel", |it| {
        it.iter(|| {
            b.launch(ctx, &empty_launch(f)).expect("launch");
            b.stream_synchronize(ctx, DEFAULT_STREAM).expect("sync");
        })
    });
    for &size in SIZES {
        let mut host = vec![1u8; size];
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("htod", size), &size, |it, _| {
            it.iter(|| b.copy_htod(ctx, dev, &host, DEFAULT_STREAM).expect("htod"))
        });
        g.bench_with_input(BenchmarkId::new("dtoh", size), &size, |it, _| {
            it.iter(|| {
                b.copy_dtoh(ctx, &mut host, dev, DEFAULT_STREAM)
                    .expect("dtoh");
                black_box(&host);
            })
        });
    }
    g.finish();
}

fn executor(c: &mut Criterion) {
    let (name, backend) = make_backend();
    let mut slot = Some(backend);
    let ex = Executor::spawn(
        "compute-bench",
        ExecutorConfig::default(),
        move || Ok(slot.take().expect("made once")),
        Box::new(|done| {
            black_box(done);
        }),
    )
    .expect("executor");
    let (ctx, f, dev) = ex.call(None, |b| Ok(setup(b))).expect("setup");
    let mut g = c.benchmark_group(format!("{name}/executor"));
    g.bench_function("launch_empty_kernel_group", |it| {
        it.iter(|| {
            ex.group(ctx, DEFAULT_STREAM, 1, move |b| {
                b.launch(ctx, &empty_launch(f))
            })
            .expect("launch")
        })
    });
    for &size in SIZES {
        let host = Arc::new(vec![1u8; size]);
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("htod", size), &size, |it, _| {
            it.iter(|| {
                let data = Arc::clone(&host);
                ex.call(Some(ctx), move |b| {
                    b.copy_htod(ctx, dev, &data, DEFAULT_STREAM)
                })
                .expect("htod")
            })
        });
        g.bench_with_input(BenchmarkId::new("dtoh", size), &size, |it, &n| {
            it.iter(|| {
                let out = ex
                    .call(Some(ctx), move |b| {
                        let mut v = vec![0u8; n];
                        b.copy_dtoh(ctx, &mut v, dev, DEFAULT_STREAM)?;
                        Ok(v)
                    })
                    .expect("dtoh");
                black_box(out);
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = direct, executor
}
criterion_main!(benches);
