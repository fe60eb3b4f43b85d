//! What remoting costs: the guest library's `Driver` over the host transport to a served
//! backend (the path of `vgpu-cuda-host`), with its copies through the region it shares with
//! the host (`compute::shm`) and, as before it, in socket messages alone, against the same
//! backend called directly. The backend is the PTX executor, or `NvCuda` with
//! `VGPU_COMPUTE=nvcuda` where the driver loads. Empty-kernel launches from the guest call to
//! completion (p50/p99; a launch and the synchronisation that sends it), launches batched as a
//! launch-heavy app issues them, and bandwidthTest-style host↔device copies of 4 KiB, 1 MiB
//! and 16 MiB from pageable memory and from page-locked memory the library allocated
//! (`cuMemAllocHost`: shared with the host, which copies to and from it itself; the
//! socket-only path has none, its pinned rows are pageable copies). Prints a
//! table and writes JSON (default `target/vgpu-bench/cuda-remote.json`, or `$VGPU_BENCH_OUT`).
//!
//!   cargo bench -p vgpu-libcuda --bench remote

use std::os::unix::net::UnixStream;
use std::time::Instant;

use cuda::driver::{Driver, LaunchParams};
use cuda::transport::{Offer, SocketTransport};
use mdev_backend::compute::backend::{ComputeBackend, ContextId, DEFAULT_STREAM, KernelLaunch};
use mdev_backend::compute::remote::{Limits, serve};
use mdev_backend::compute::{CpuConfig, backend_from_env};

const LAUNCHES: usize = 5000;
/// Copy sizes, and the copies timed of each.
const COPIES: [(usize, usize); 3] = [(4 << 10, 2000), (1 << 20, 64), (16 << 20, 8)];

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

/// One copy measurement: size, page-locked or not, GiB/s each way.
#[derive(Clone, Copy)]
struct CopyRate {
    bytes: usize,
    pinned: bool,
    htod: f64,
    dtoh: f64,
}

/// What one path measured.
struct Path {
    name: &'static str,
    key: &'static str,
    launch: (f64, f64, f64),
    batched_us: Option<f64>,
    copies: Vec<CopyRate>,
}

/// Host memory of a copy: pageable (a buffer of the program's), or page-locked at an address
/// the library gave.
enum Host<'a> {
    Pageable(&'a mut [u8]),
    Pinned(u64, usize),
}

/// The copies of [`COPIES`] through `htod` and `dtoh` (each given the host memory; the device
/// buffer is of the largest size), from pageable and from page-locked memory (`pin` allocates
/// it, `None` where the path has none: its pageable buffer is used; `unpin` frees it).
fn copies(
    mut pin: impl FnMut(usize) -> Option<u64>,
    mut unpin: impl FnMut(u64),
    mut htod: impl FnMut(&mut Host<'_>),
    mut dtoh: impl FnMut(&mut Host<'_>),
) -> Vec<CopyRate> {
    let mut out = Vec::new();
    for pinned in [false, true] {
        for (bytes, rounds) in COPIES {
            let mut buffer = vec![0xa5u8; bytes];
            let page_locked = if pinned { pin(bytes) } else { None };
            let mut host = match page_locked {
                Some(start) => Host::Pinned(start, bytes),
                None => Host::Pageable(&mut buffer),
            };
            let h = bandwidth(bytes, rounds, || htod(&mut host));
            let d = bandwidth(bytes, rounds, || dtoh(&mut host));
            if let Some(start) = page_locked {
                unpin(start);
            }
            out.push(CopyRate {
                bytes,
                pinned,
                htod: h,
                dtoh: d,
            });
        }
    }
    out
}

/// The guest library over a socket pair to a served backend in another thread, its copies
/// through a shared region when `shared`.
fn remote(shared: bool) -> (Path, u64) {
    let (a, mut b) = UnixStream::pair().expect("socket pair");
    let host = std::thread::spawn(move || {
        let config = config();
        let limits = Limits::new(&config.budget);
        let (_, mut be) = backend_from_env(config);
        serve(&mut b, be.as_mut(), &limits).0
    });
    let t = if shared {
        let offered = SocketTransport::over_shared(a).expect("transport");
        assert_eq!(offered.offer, Offer::Taken, "the host takes the region");
        offered.transport
    } else {
        SocketTransport::over(a).expect("transport")
    };
    let mut d = Driver::new(t).expect("driver");
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
            false,
        )
        .expect("launch")
    };
    // Guest call to completion: a launch and the synchronisation that sends it.
    let launch_latency = latency(LAUNCHES, || {
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
    let largest = COPIES.iter().map(|c| c.0).max().unwrap_or(0);
    let buf = d.mem_alloc(ctx, largest as u64).expect("alloc");
    let d = std::cell::RefCell::new(d);
    let measured = copies(
        |bytes| {
            d.borrow_mut()
                .pinned_alloc(ctx, bytes as u64, 0)
                .expect("page-locked memory")
        },
        |start| {
            let mut d = d.borrow_mut();
            d.host_memory_remove(start, false).expect("recorded");
            assert!(d.pinned_free(start).expect("freed"));
        },
        |host| {
            let mut d = d.borrow_mut();
            match host {
                Host::Pageable(b) => d.copy_htod(ctx, buf, b, 0).expect("htod"),
                Host::Pinned(start, n) => d
                    .copy_pinned(ctx, *start, *n as u64, buf, 0, true)
                    .expect("htod"),
            }
            // Small copies are deferred: each is timed to the host.
            d.flush().expect("flush")
        },
        |host| {
            let mut d = d.borrow_mut();
            match host {
                Host::Pageable(b) => d.copy_dtoh(ctx, b, buf, 0).expect("dtoh"),
                Host::Pinned(start, n) => d
                    .copy_pinned(ctx, *start, *n as u64, buf, 0, false)
                    .expect("dtoh"),
            }
        },
    );
    drop(d);
    let stats = host.join().expect("host thread");
    let (name, key) = if shared {
        (
            "library → host transport, shared memory → backend",
            "shared",
        )
    } else {
        ("library → host transport, socket only → backend", "socket")
    };
    let path = Path {
        name,
        key,
        launch: launch_latency,
        batched_us: Some(batched_us),
        copies: measured,
    };
    (path, stats.requests)
}

/// The same backend calls in this thread.
fn direct() -> (&'static str, Path) {
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
    let launch = latency(LAUNCHES, || be.launch(c, &l).expect("launch"));
    let largest = COPIES.iter().map(|c| c.0).max().unwrap_or(0);
    let buf = be.mem_alloc(c, largest as u64).expect("alloc");
    let be = std::cell::RefCell::new(be);
    let call =
        |f: &mut dyn FnMut(&mut dyn ComputeBackend, ContextId)| f(be.borrow_mut().as_mut(), c);
    // The backend has no page-locked memory of its own: both kinds are the caller's buffer.
    let measured = copies(
        |_| None,
        |_| {},
        |host| {
            if let Host::Pageable(b) = host {
                call(&mut |be, c| be.copy_htod(c, buf, b, DEFAULT_STREAM).expect("htod"));
            }
        },
        |host| {
            if let Host::Pageable(b) = host {
                call(&mut |be, c| be.copy_dtoh(c, b, buf, DEFAULT_STREAM).expect("dtoh"));
            }
        },
    );
    let path = Path {
        name: "backend direct",
        key: "direct",
        launch,
        batched_us: None,
        copies: measured,
    };
    (backend, path)
}

fn size(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn main() {
    let (shared, shared_requests) = remote(true);
    let (socket, _) = remote(false);
    let (backend, direct) = direct();
    let paths = [&direct, &shared, &socket];

    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "CUDA host transport vs the backend ({backend}) called directly ({cpus} CPUs); \
         copies in GiB/s, HtoD / DtoH"
    );
    print!("| path | launch p50 / p99 / mean (µs) |");
    for c in &direct.copies {
        let kind = if c.pinned { "pinned" } else { "pageable" };
        print!(" {} {kind} |", size(c.bytes));
    }
    println!();
    println!("|---|---:|{}", "---:|".repeat(direct.copies.len()));
    for p in paths {
        let (p50, p99, mean) = p.launch;
        print!("| {} | {p50:.1} / {p99:.1} / {mean:.1} |", p.name);
        for c in &p.copies {
            print!(" {:.2} / {:.2} |", c.htod, c.dtoh);
        }
        println!();
    }
    for p in [&shared, &socket] {
        if let Some(b) = p.batched_us {
            println!(
                "{}: {LAUNCHES} launches then one synchronisation: {b:.2} µs per launch",
                p.key
            );
        }
        print!(
            "{} / direct: launch p50 +{:.1} µs;",
            p.key,
            p.launch.0 - direct.launch.0
        );
        for (c, d) in p.copies.iter().zip(&direct.copies) {
            let kind = if c.pinned { "pinned" } else { "pageable" };
            print!(
                " {} {kind} ×{:.2}/×{:.2}",
                size(c.bytes),
                c.htod / d.htod,
                c.dtoh / d.dtoh
            );
        }
        println!();
    }
    println!("the shared-memory host served {shared_requests} requests");

    let lat = |(p50, p99, mean): (f64, f64, f64)| {
        format!("{{\"p50_us\":{p50:.2},\"p99_us\":{p99:.2},\"mean_us\":{mean:.2}}}")
    };
    let path_json = |p: &Path| {
        let copies: Vec<String> = p
            .copies
            .iter()
            .map(|c| {
                format!(
                    "{{\"bytes\":{},\"memory\":\"{}\",\"htod_gib_s\":{:.3},\"dtoh_gib_s\":{:.3}}}",
                    c.bytes,
                    if c.pinned { "pinned" } else { "pageable" },
                    c.htod,
                    c.dtoh
                )
            })
            .collect();
        let batched = p
            .batched_us
            .map_or(String::new(), |b| format!("\"batched_launch_us\":{b:.3},"));
        format!(
            "\"{}\":{{\"launch\":{},{batched}\"copies\":[{}]}}",
            p.key,
            lat(p.launch),
            copies.join(",")
        )
    };
    let json = format!(
        "{{\"benchmark\":\"cuda-remote\",\"backend\":\"{backend}\",\"cpus\":{cpus},\"launches\":{LAUNCHES},{}}}\n",
        paths.map(path_json).join(",")
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
