//! What a CUDA client pays through the vGPU: the corpus's `driver_bench` (plain C on the
//! driver API: an empty kernel's launch to completion p50/p99, launches back to back with one
//! synchronisation, 16 MiB copies each way) run twice on our `libcuda.so.1`:
//!   - in a TCG guest, through the DRM transport, the device and its executor (PTX executor);
//!   - on this host, over a Unix socket to `vgpu-cuda-host` (the same backend, no VM).
//!
//! Prints a table with the ratios and writes JSON (default `target/vgpu-bench/cuda-guest.json`,
//! or `$VGPU_BENCH_OUT`) and its figure beside it. The guest's clock runs under TCG, so its
//! figures include emulation. Progress goes to stderr (a bar on a terminal).
//!
//!   cargo bench -p vgpu-tests --bench cuda_guest [-- --quick]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mdev_backend::compute::corpus::corpus_dir;
use vgpu_cli::progress::Progress;
use vgpu_tests::TempDir;
use vgpu_tests::daemon::workspace_binary;
use vgpu_tests::guest::{self, GuestConfig, GuestImage, RunningGuest};

const KEYS: [&str; 5] = [
    "launch_p50_us",
    "launch_p99_us",
    "batched_launch_us",
    "htod_gib_s",
    "dtoh_gib_s",
];

/// The `RESULT key value` lines of a run.
fn results(output: &str) -> BTreeMap<String, f64> {
    output
        .lines()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_owned(), v.trim().parse().ok()?))
        })
        .collect()
}

fn on_host(bench: &Path, lib: &Path, args: &[String]) -> BTreeMap<String, f64> {
    let dir = TempDir::new("cuda-bench").expect("temp dir");
    std::os::unix::fs::symlink(lib, dir.path().join("libcuda.so.1")).expect("symlink");
    let socket = dir.path().join("host.sock");
    let mut host = Command::new(workspace_binary("vgpu-cuda-host").expect("vgpu-cuda-host"))
        .arg("--socket")
        .arg(&socket)
        .arg("--once")
        .stderr(Stdio::null())
        .spawn()
        .expect("vgpu-cuda-host");
    let start = Instant::now();
    while !socket.exists() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = Command::new(bench)
        .args(args)
        .env("LD_LIBRARY_PATH", dir.path())
        .env("VGPU_CUDA_SOCKET", &socket)
        .output()
        .expect("driver_bench");
    let _ = host.kill();
    let _ = host.wait();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("PASS"), "driver_bench on the host:\n{text}");
    results(&text)
}

fn in_guest(image: GuestImage, bench: &Path, lib: &Path, args: &[String]) -> BTreeMap<String, f64> {
    let dir = TempDir::new("cuda-bench-guest").expect("temp dir");
    let corpus = bench.parent().expect("the corpus directory");
    let (qemu, prologue) = guest::cuda_payload(dir.path(), lib, corpus, &["driver_bench"]);
    let job = format!(
        "{prologue}{}/driver_bench {}\n",
        guest::CUDA_DIR,
        args.join(" ")
    );
    let mut config = GuestConfig::new(image, job).timeout(Duration::from_secs(600));
    config.extra_qemu_args = qemu;
    let run = RunningGuest::run(&config).expect("guest run");
    assert!(
        run.output.contains("PASS"),
        "driver_bench in the guest:\n{}\n{}",
        run.output,
        run.logs()
    );
    eprintln!("guest: {}", run.timing());
    results(&run.output)
}

/// The corpus's driver_bench in a TCG guest and on the host, on our libcuda.
#[derive(Debug, clap::Parser)]
struct Cli {
    /// 200 launches and 4 MiB copies instead of 2000 and 16 MiB.
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    _cargo: vgpu_bench_report::CargoBench,
}

fn main() {
    let cli: Cli = clap::Parser::parse();
    let args: Vec<String> = if cli.quick {
        vec!["200".into(), "4".into()]
    } else {
        vec!["2000".into(), "16".into()]
    };
    let Some(bench) = corpus_dir()
        .map(|d| d.join("driver_bench"))
        .filter(|p| p.exists())
    else {
        eprintln!("skipped: no driver_bench in the CUDA corpus (qemu-scripts/cuda-corpus.sh)");
        return;
    };
    let Ok(image) = GuestImage::locate() else {
        eprintln!("skipped: no guest image (qemu-scripts/build-guest-image.sh)");
        return;
    };
    let lib = workspace_binary("libcuda.so").expect("libcuda.so of guest-drivers/libcuda");
    let progress = Progress::new("cuda_guest", 2);
    progress.step("on the host over a socket");
    let host = on_host(&bench, &lib, &args);
    progress.advance();
    progress.step("in a TCG guest through the vGPU");
    let guest = in_guest(image, &bench, &lib, &args);
    progress.advance();
    drop(progress);

    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "CUDA driver calls from a client: TCG guest through the vGPU vs host over a socket \
         ({cpus} CPUs; {} launches, {} MiB copies)",
        args[0], args[1]
    );
    println!(
        "| path | launch p50 / p99 (µs) | per launch, batched (µs) | HtoD GiB/s | DtoH GiB/s |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (name, r) in [
        ("TCG guest → virtio-gpu → device → executor", &guest),
        ("host → socket → vgpu-cuda-host", &host),
    ] {
        println!(
            "| {name} | {:.1} / {:.1} | {:.2} | {:.3} | {:.3} |",
            r["launch_p50_us"],
            r["launch_p99_us"],
            r["batched_launch_us"],
            r["htod_gib_s"],
            r["dtoh_gib_s"]
        );
    }
    let ratio = |k: &str| guest[k] / host[k];
    println!(
        "guest/host: launch p50 ×{:.1}, batched ×{:.1}, HtoD ×{:.2}, DtoH ×{:.2}",
        ratio("launch_p50_us"),
        ratio("batched_launch_us"),
        ratio("htod_gib_s"),
        ratio("dtoh_gib_s")
    );
    let obj = |r: &BTreeMap<String, f64>| {
        KEYS.iter()
            .map(|k| (k.to_string(), serde_json::json!(r[*k])))
            .collect::<serde_json::Map<_, _>>()
    };
    let doc = serde_json::json!({
        "benchmark": "cuda-guest",
        "cpus": cpus,
        "machine": vgpu_bench_report::machine(),
        "launches": args[0].parse::<u64>().ok(),
        "copy_mib": args[1].parse::<u64>().ok(),
        "guest": obj(&guest),
        "host": obj(&host),
    });
    let out = vgpu_bench_report::out_path(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/vgpu-bench/cuda-guest.json"
    )));
    vgpu_bench_report::write_results(&out, &doc).expect("writing the results");
}
