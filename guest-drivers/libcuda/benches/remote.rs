//! What remoting costs: the guest library's `Driver` over a Unix socket to a served backend
//! (the path of `vgpu-cuda-host`), against the same backend called directly. The backend is
//! the PTX executor, or `NvCuda` with `VGPU_COMPUTE=nvcuda` where the driver loads.
//! Empty-kernel launches from the guest call to completion (p50/p99; a launch and the
//! synchronisation that sends it), launches batched as a launch-heavy app issues them, and
//! host↔device copy bandwidth. Prints a table
//! and writes JSON (default `target/vgpu-bench/cuda-remote.json`, or `$VGPU_BENCH_OUT`).
//!
//!   cargo bench -p vgpu-libcuda --bench remote

use std::os::unix::net::UnixStream;
use std::time::Instant;

use cuda::driver::{Driver, LaunchParams};
use cuda::transport::SocketTransport;
use mdev_backend::compute::backend::{DEFAULT_STREAM, KernelLaunch};
use mdev_backend::compute::remote::serve;
use mdev_backend::compute::{CpuConfig, backend_from_env};

const LAUNCHES: usize = 5000;
const COPY_BYTES: usize = 64 << 20;
const COPY_ROUNDS: usize = 8;

const EMPTY: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
    .visible .entry empty(.param .u64 p)\n{\nret;\n}\n";

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// (p50, p99, mean) in µs of `n` timed runs of `f`, after a warm-up.
fn latency(n: usize, mut f: impl FnMut()) -> (f64, f64, f64) {
    for _ in 0..n / 10 {
        f();
    }
    let mut t: Vec<f64> = (0..n)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    let mean = t.iter().sum::<f64>() / n as f64;
    (percentile(&t, 50.0), percentile(&t, 99.0), mean)
}

/// GiB/s of `rounds` calls of `f` each moving `bytes`.
fn bandwidth(bytes: usize, rounds: usize, mut f: impl FnMut()) -> f64 {
    f();
    let s = Instant::now();
    for _ in 0..rounds {
        f();
    }
    (bytes * rounds) as f64 / s.elapsed().as_secs_f64() / f64::from(1 << 30)
}

fn config() -> CpuConfig {
    CpuConfig {
        threads: 1,
        ..CpuConfig::default()
    }
}

fn main() {
    // Remote: the driver in this thread, the served backend in another.
    let (a, mut b) = UnixStream::pair().expect("socket pair");
    let host = std::thread::spawn(move || {
        let (_, mut be) = backend_from_env(config());
        serve(&mut b, be.as_mut()).0
    });
    let mut d = Driver::new(SocketTransport::over(a).expect("transport")).expect("driver");
    let ctx = d.context_create().expect("context");
    let m = d
        .module_load(ctx, cuda::driver::Image::Single(EMPTY.as_bytes().to_vec()))
        .expect("module");
    let f = d.function(m, "empty").expect("function");
    let launch = |d: &mut Driver<SocketTransport>| {
        d.launch(
            ctx,
            f,
            [1, 1, 1],
            [32, 1, 1],
            0,
            0,
            LaunchParams::Packed(vec![0; 8]),
        )
        .expect("launch")
    };
    // Guest call to completion: a launch and the synchronisation that sends it.
    let remote_launch = latency(LAUNCHES, || {
        launch(&mut d);
        d.synchronize(ctx).expect("synchronize")
    });
    // A launch-heavy app: launches deferred and sent in batches, one synchronisation.
    let start = Instant::now();
    for _ in 0..LAUNCHES {
        launch(&mut d);
    }
    d.synchronize(ctx).expect("synchronize");
    let batched_us = start.elapsed().as_secs_f64() * 1e6 / LAUNCHES as f64;
    let buf = d.mem_alloc(ctx, COPY_BYTES as u64).expect("alloc");
    let data = vec![0xa5u8; COPY_BYTES];
    let remote_htod = bandwidth(COPY_BYTES, COPY_ROUNDS, || {
        d.copy_htod(ctx, buf, &data, 0).expect("htod");
        d.flush().expect("flush")
    });
    let mut back = vec![0u8; COPY_BYTES];
    let remote_dtoh = bandwidth(COPY_BYTES, COPY_ROUNDS, || {
        d.copy_dtoh(ctx, &mut back, buf, 0).expect("dtoh")
    });
    drop(d);
    let stats = host.join().expect("host thread");

    // Direct: the same backend calls in this thread.
    let (backend, mut be) = backend_from_env(config());
    let c = be.context_create().expect("context");
    let m = be.module_load(c, EMPTY.as_bytes()).expect("module");
    let (f, _) = be.function(c, m, "empty").expect("function");
    let params = [0u8; 8];
    let l = KernelLaunch {
        function: f,
        grid: [1, 1, 1],
        block: [32, 1, 1],
        shared_bytes: 0,
        stream: DEFAULT_STREAM,
        params: &params,
        cooperative: false,
    };
    let direct_launch = latency(LAUNCHES, || be.launch(c, &l).expect("launch"));
    let buf = be.mem_alloc(c, COPY_BYTES as u64).expect("alloc");
    let direct_htod = bandwidth(COPY_BYTES, COPY_ROUNDS, || {
        be.copy_htod(c, buf, &data, DEFAULT_STREAM).expect("htod")
    });
    let direct_dtoh = bandwidth(COPY_BYTES, COPY_ROUNDS, || {
        be.copy_dtoh(c, &mut back, buf, DEFAULT_STREAM)
            .expect("dtoh")
    });

    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "CUDA remoting over a Unix socket vs the backend ({backend}) called directly ({cpus} CPUs)"
    );
    println!("| path | launch p50 / p99 / mean (µs) | HtoD GiB/s | DtoH GiB/s |");
    println!("|---|---:|---:|---:|");
    for (name, (p50, p99, mean), h, dh) in [
        (
            "guest library → socket → backend",
            remote_launch,
            remote_htod,
            remote_dtoh,
        ),
        ("backend direct", direct_launch, direct_htod, direct_dtoh),
    ] {
        println!("| {name} | {p50:.1} / {p99:.1} / {mean:.1} | {h:.2} | {dh:.2} |");
    }
    println!(
        "batched: {LAUNCHES} launches then one synchronisation: {batched_us:.2} µs per launch"
    );
    println!(
        "ratios remote/direct: launch p50 ×{:.1}, HtoD ×{:.2}, DtoH ×{:.2}; host served {} requests",
        remote_launch.0 / direct_launch.0,
        remote_htod / direct_htod,
        remote_dtoh / direct_dtoh,
        stats.requests
    );
    let lat = |(p50, p99, mean): (f64, f64, f64)| {
        format!("{{\"p50_us\":{p50:.2},\"p99_us\":{p99:.2},\"mean_us\":{mean:.2}}}")
    };
    let json = format!(
        "{{\"benchmark\":\"cuda-remote\",\"backend\":\"{backend}\",\"cpus\":{cpus},\"launches\":{LAUNCHES},\"copy_bytes\":{COPY_BYTES},\
         \"remote\":{{\"launch\":{},\"batched_launch_us\":{batched_us:.3},\"htod_gib_s\":{remote_htod:.3},\"dtoh_gib_s\":{remote_dtoh:.3}}},\
         \"direct\":{{\"launch\":{},\"htod_gib_s\":{direct_htod:.3},\"dtoh_gib_s\":{direct_dtoh:.3}}}}}\n",
        lat(remote_launch),
        lat(direct_launch),
    );
    let out = std::env::var_os("VGPU_BENCH_OUT").map_or_else(
        || {
            std::path::PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../target/vgpu-bench/cuda-remote.json"
            ))
        },
        std::path::PathBuf::from,
    );
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).expect("output directory");
    }
    std::fs::write(&out, json).expect("writing the JSON result");
    println!("JSON: {}", out.display());
}
