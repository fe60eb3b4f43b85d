//! Scheduling overhead for a standalone high-rate load through the device: the raw vfio-user
//! client (`vgpu_tests::raw_guest`, no QEMU: a qtest guest would add a 70-90 µs round trip
//! per access and hide the overhead) drives the in-process server (the `vgpu-server` library
//! code) with a load context (capset 20) that submits back-to-back OCCUPY groups of
//! [`OCCUPY_US`] µs, one in flight at a time, each with a fence, for [`DURATION`]. Modes: no
//! daemon (the device's local engine), and a real `vgpu-schedd` process (started by the test
//! harness's `vgpu_tests::daemon::Schedd`, which finds or builds the binary) under policy
//! none, timegraph PRT, timegraph HT and fair (the device holds a lease), HT and fair also with
//! the daemon's busy polling off (`--busy-poll-us 0`: on a host with few CPUs its spinning
//! competes with the device path).
//! Reports groups/s, p50/p99 submit-to-fence latency and the overhead of each mode against
//! no daemon (medians of [`RUNS`] runs); JSON to `target/vgpu-bench/sched_overhead.json` and
//! its figure (overhead, latency and rate per mode) beside it. Progress goes to stderr (a bar
//! on a terminal).
//!
//! virglrenderer may be initialised once per process, so every run is a child process of this
//! bench (the same binary, selected by [`CHILD_ENV`]).
//!
//! With `--guest` (and a guest image) a second table runs a real GL workload the same ways: a
//! TCG guest on the `vgpu-server` binary runs glmark2's `build` scene off-screen for
//! [`GUEST_SCENE_S`] s (a high rate of small virgl submits, each a scheduled group), once per
//! mode per run; the overhead is the frame rate lost against no daemon.
//!
//! `cargo bench -p vgpu-tests --bench sched_overhead [-- --guest]`

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::VFIO_PCI_MSIX_IRQ_INDEX;
use vgpu_cli::progress::Progress;
use vgpu_guest_drivers::virtio_gpu::{self, CAPSET_LOAD, LOAD_OP_OCCUPY};
use vgpu_schedd::proto::VmName;
use vgpu_server::sched_client::SchedConfig;
use vgpu_tests::daemon::Schedd;
use vgpu_tests::guest::{GuestConfig, GuestImage, RunningGuest};
use vgpu_tests::raw_guest::{FEATURES_3D, RawGuest};
use vgpu_tests::server::TestServer;
use vmm_sys_util::eventfd::EventFd;

/// Environment variable that makes this binary run one measurement (`MODE`) and print it.
const CHILD_ENV: &str = "VGPU_SCHED_OVERHEAD_CHILD";
/// GPU time of one OCCUPY group: short, so that the per-group cost of asking shows.
const OCCUPY_US: u64 = 50;
/// How long one run submits groups.
const DURATION: Duration = Duration::from_secs(2);
/// Runs per mode; the table shows their medians.
const RUNS: usize = 3;
/// Longest wait for one group, or for the daemon to start.
const TIMEOUT: Duration = Duration::from_secs(10);
const RESP_OK_NODATA: u32 = 0x1100;
const LOAD_CTX: u32 = 7;
const VM: &str = "vm-overhead";
/// One way to run the device: its name, the daemon's policy file (none: no daemon) and the
/// daemon's further arguments.
#[derive(Clone, Copy, Debug)]
struct Mode {
    name: &'static str,
    policy: Option<&'static str>,
    daemon_args: &'static [&'static str],
}

const HT: &str = "policy = \"timegraph\"\nsched = \"ht\"\n";
const FAIR: &str = "policy = \"fair\"\n";
/// The daemon without busy polling: on a host with few CPUs its spinning competes with the
/// device path for them.
const NO_POLL: &[&str] = &["--busy-poll-us", "0"];

const MODES: [Mode; 7] = [
    Mode {
        name: "no daemon",
        policy: None,
        daemon_args: &[],
    },
    Mode {
        name: "none",
        policy: Some("policy = \"none\"\n"),
        daemon_args: &[],
    },
    Mode {
        name: "timegraph prt",
        policy: Some("policy = \"timegraph\"\nsched = \"prt\"\n"),
        daemon_args: &[],
    },
    Mode {
        name: "timegraph ht",
        policy: Some(HT),
        daemon_args: &[],
    },
    Mode {
        name: "ht, no poll",
        policy: Some(HT),
        daemon_args: NO_POLL,
    },
    Mode {
        name: "fair (lease)",
        policy: Some(FAIR),
        daemon_args: &[],
    },
    Mode {
        name: "fair, no poll",
        policy: Some(FAIR),
        daemon_args: NO_POLL,
    },
];

impl Mode {
    /// The daemon of this mode, if it has one.
    fn daemon(&self) -> Option<Result<Schedd, String>> {
        self.policy.map(|p| {
            Schedd::start_with(Some(p), "warn", self.daemon_args).map_err(|e| e.to_string())
        })
    }
}

/// One run's figures.
#[derive(Clone, Copy, Debug)]
struct Run {
    groups_per_s: f64,
    p50_us: f64,
    p99_us: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * (sorted.len().saturating_sub(1)) as f64).round() as usize;
    sorted
        .get(rank.min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(f64::NAN)
}

/// Sends one request and waits for it; returns its latency in µs.
fn call(guest: &mut RawGuest, irq: &EventFd, request: &[u8]) -> f64 {
    let start = Instant::now();
    let reply = guest
        .call(request, irq, TIMEOUT)
        .expect("request completes");
    let us = start.elapsed().as_secs_f64() * 1e6;
    assert_eq!(reply, RESP_OK_NODATA, "request refused");
    us
}

/// One measurement in this process; `None` when this host has no virglrenderer.
fn child(mode: Mode) -> Option<Run> {
    let schedd = mode.daemon().transpose().expect("vgpu-schedd");
    let server = match &schedd {
        None => TestServer::start_3d(),
        Some(daemon) => TestServer::start_3d_scheduled(SchedConfig {
            socket: daemon.socket(),
            vm_name: VmName::new(VM).expect("name"),
        }),
    };
    let mut guest = RawGuest::connect_with(server.socket(), 1, FEATURES_3D).expect("client");
    let irq = EventFd::new(0).expect("eventfd");
    guest
        .set_trigger(VFIO_PCI_MSIX_IRQ_INDEX, 1, &irq)
        .expect("MSI-X");
    if guest.status().expect("status") != 0xf {
        // The device offers no 3D (no virglrenderer): FEATURES_OK was refused.
        return None;
    }
    call(
        &mut guest,
        &irq,
        &virtio_gpu::ctx_create(LOAD_CTX, CAPSET_LOAD, b"load"),
    );
    let mut fence = 0u64;
    let mut latencies = Vec::new();
    let start = Instant::now();
    while start.elapsed() < DURATION {
        fence += 1;
        let submit = virtio_gpu::load_submit(LOAD_CTX, &[(LOAD_OP_OCCUPY, 0, OCCUPY_US)]);
        latencies.push(call(
            &mut guest,
            &irq,
            &virtio_gpu::with_fence(submit, fence),
        ));
    }
    let elapsed = start.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    let run = Run {
        groups_per_s: latencies.len() as f64 / elapsed,
        p50_us: percentile(&latencies, 50.0),
        p99_us: percentile(&latencies, 99.0),
    };
    drop(guest);
    let _ = server.wait(TIMEOUT);
    Some(run)
}

/// Runs one measurement in a child process; `None` when it was skipped.
fn measure(mode: usize) -> Option<Run> {
    let out = Command::new(std::env::current_exe().expect("own path"))
        .env(CHILD_ENV, mode.to_string())
        .stderr(Stdio::inherit())
        .output()
        .expect("child runs");
    assert!(out.status.success(), "child failed: {:?}", out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("RESULT "))?;
    let v: Vec<f64> = line.split(' ').filter_map(|x| x.parse().ok()).collect();
    match v[..] {
        [groups_per_s, p50_us, p99_us] => Some(Run {
            groups_per_s,
            p50_us,
            p99_us,
        }),
        _ => panic!("bad child output {line:?}"),
    }
}

/// Scheduling overhead per mode: raw vfio-user client, and a TCG guest's glmark2 with --guest.
#[derive(Debug, clap::Parser)]
struct Cli {
    /// Also run glmark2's build scene in a TCG guest per mode (needs the guest image; minutes).
    #[arg(long)]
    guest: bool,
    #[command(flatten)]
    _cargo: vgpu_bench_report::CargoBench,
}

/// Seconds of glmark2's build scene per guest run.
const GUEST_SCENE_S: u32 = 10;

/// glmark2's build scene fps in a TCG guest whose server asks the daemon of `mode` (if any).
fn guest_fps(image: &GuestImage, mode: Mode) -> Result<f64, String> {
    let schedd = mode.daemon().transpose()?;
    let job = format!(
        "glmark2-es2-drm --off-screen --visual-config alpha=0 -b build:duration={GUEST_SCENE_S} 2>&1 | grep 'FPS:'"
    );
    let mut config = GuestConfig::new(image.clone(), job).timeout(Duration::from_secs(300));
    if let Some(daemon) = &schedd {
        config.server_args = vec![
            "--scheduler".into(),
            daemon.socket().display().to_string(),
            "--vm-name".into(),
            VM.into(),
        ];
    }
    let run = RunningGuest::run(&config).map_err(|e| e.to_string())?;
    run.output
        .lines()
        .find_map(|l| {
            l.split_once("FPS: ")?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .ok_or_else(|| format!("no FPS line; exit {:?}: {}", run.exit_code, run.output))
}

/// The guest table: glmark2 build fps per mode (medians of [`RUNS`], modes alternating) and the
/// loss against no daemon; JSON rows. The steps are counted in `progress`.
fn guest_overhead(image: &GuestImage, progress: &Progress) -> Vec<serde_json::Value> {
    let mut fps: Vec<Vec<f64>> = vec![Vec::new(); MODES.len()];
    for run in 1..=RUNS {
        for (i, mode) in MODES.iter().enumerate() {
            let name = mode.name;
            progress.step(&format!("TCG guest, run {run}/{RUNS}: {name}"));
            match guest_fps(image, *mode) {
                Ok(f) => fps[i].push(f),
                Err(e) => progress.note(&format!("guest run {run}: {name} failed: {e}")),
            }
            progress.advance();
        }
    }
    println!(
        "TCG guest, glmark2 build ({GUEST_SCENE_S} s, off-screen), {RUNS} runs, medians\n{:<15} {:>8} {:>10}",
        "mode", "fps", "overhead"
    );
    let base = median(fps[0].clone());
    MODES
        .iter()
        .zip(&fps)
        .map(|(Mode { name, .. }, f)| {
            let m = median(f.clone());
            let overhead = (base / m - 1.0) * 100.0;
            println!("{name:<15} {m:>8.1} {overhead:>9.1}%");
            serde_json::json!({"mode": name, "fps": m, "overhead_pct": overhead, "runs": f})
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    if let Some(mode) = std::env::var_os(CHILD_ENV) {
        let mode: usize = mode.to_str().and_then(|m| m.parse().ok()).expect("mode");
        let mode = MODES.get(mode).copied().expect("known mode");
        match child(mode) {
            Some(r) => println!("RESULT {} {} {}", r.groups_per_s, r.p50_us, r.p99_us),
            None => eprintln!("SKIPPED: no virglrenderer on this host"),
        }
        return;
    }
    let cli: Cli = clap::Parser::parse();
    let image = if cli.guest {
        GuestImage::locate()
            .map_err(|e| eprintln!("SKIPPED: guest section: {e}"))
            .ok()
    } else {
        None
    };
    let guest_steps = if image.is_some() {
        MODES.len() * RUNS
    } else {
        0
    };
    let progress = Progress::new("sched_overhead", (MODES.len() * RUNS + guest_steps) as u64);
    let mut measured: Vec<Vec<Run>> = Vec::new();
    for (i, Mode { name, .. }) in MODES.iter().enumerate() {
        let mut runs = Vec::new();
        for run in 1..=RUNS {
            progress.step(&format!("raw client, run {run}/{RUNS}: {name}"));
            let Some(r) = measure(i) else {
                progress.note("SKIPPED: no virglrenderer on this host");
                return;
            };
            progress.advance();
            runs.push(r);
        }
        measured.push(runs);
    }
    println!(
        "sched overhead: back-to-back {OCCUPY_US} µs OCCUPY groups for {DURATION:?}, {RUNS} runs, medians\n\
         {:<15} {:>10} {:>9} {:>9} {:>10}",
        "mode", "groups/s", "p50 µs", "p99 µs", "overhead"
    );
    let mut rows = Vec::new();
    let mut base: Option<f64> = None;
    for (Mode { name, .. }, runs) in MODES.iter().zip(&measured) {
        let gps = median(runs.iter().map(|r| r.groups_per_s).collect());
        let p50 = median(runs.iter().map(|r| r.p50_us).collect());
        let p99 = median(runs.iter().map(|r| r.p99_us).collect());
        // Overhead: extra time per group against no daemon.
        let overhead = base.map_or(0.0, |b| (b / gps - 1.0) * 100.0);
        base.get_or_insert(gps);
        println!("{name:<15} {gps:>10.0} {p50:>9.1} {p99:>9.1} {overhead:>9.1}%");
        rows.push(serde_json::json!({
            "mode": name,
            "groups_per_s": gps,
            "p50_us": p50,
            "p99_us": p99,
            "overhead_pct": overhead,
            "runs": runs.iter().map(|r| serde_json::json!({
                "groups_per_s": r.groups_per_s, "p50_us": r.p50_us, "p99_us": r.p99_us,
            })).collect::<Vec<_>>(),
        }));
    }
    let guest_rows = image
        .as_ref()
        .map_or_else(Vec::new, |image| guest_overhead(image, &progress));
    drop(progress);
    let doc = serde_json::json!({
        "bench": "sched_overhead",
        "machine": vgpu_bench_report::machine(),
        "occupy_us": OCCUPY_US,
        "duration_s": DURATION.as_secs_f64(),
        "modes": rows,
        "guest_glmark2_build": guest_rows,
    });
    let out = vgpu_bench_report::out_path(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/vgpu-bench/sched_overhead.json"
    )));
    vgpu_bench_report::write_results(&out, &doc).expect("writing the results");
}
