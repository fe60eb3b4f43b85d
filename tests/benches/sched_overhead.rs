//! Scheduling overhead for a standalone high-rate load through the device: the raw vfio-user
//! client (`vgpu_tests::raw_guest`, no QEMU: a qtest guest would add a 70-90 µs round trip
//! per access and hide the overhead) drives the in-process server (the `vgpu-server` library
//! code) with one group in flight at a time, each with a fence, for [`DURATION`], in two
//! workloads:
//!
//! - `occupy`: a load context (capset 20) submitting OCCUPY groups of [`OCCUPY_US`] µs, which
//!   the daemon's simulated engine runs (the local engine without a daemon);
//! - `virgl`: a virgl context submitting a one-dword SUBMIT_3D, a device-executed group with a
//!   renderer fence: the path a guest's GL takes (grant or lease, `Completed`), with next to no
//!   GPU time, so what each mode adds per group shows undiluted.
//!
//! Modes: no daemon, and a real `vgpu-schedd` process (started by the test harness's
//! `vgpu_tests::daemon::Schedd`, which finds or builds the binary) under policy none,
//! timegraph PRT, timegraph HT (its lease: a lone VM streams), HT asking for every group
//! (`ht_lease = false`), and fair (leases); HT and fair also with the daemon's busy polling off
//! (`--busy-poll-us 0`). Reports groups/s, p50/p99 submit-to-fence latency and the overhead of
//! each mode against no daemon (medians of [`RUNS`] runs); JSON to
//! `target/vgpu-bench/sched_overhead.json` and its figure beside it. Progress goes to stderr (a
//! bar on a terminal).
//!
//! virglrenderer may be initialised once per process, so every run is a child process of this
//! bench (the same binary, selected by [`CHILD_ENV`]).
//!
//! With `--guest` (and a guest image) a second table runs a real GL workload: one TCG guest on
//! the `vgpu-server` binary runs glmark2's `build` scene off-screen (a high rate of small virgl
//! submits, each a scheduled group) for [`GUEST_SCENE_S`] s per slot, [`GUEST_MODES`] x
//! `--rounds` slots in one boot. Before each slot the guest waits [`GUEST_SETTLE_S`] s while the
//! bench puts the next mode in force (kills the daemon for "no daemon", starts it again and
//! installs the mode's policy with `vgpuctl set-policy`, waits until the device is connected),
//! rotating the order every round; the overhead is the frame rate lost against the no-daemon
//! slot of the same round (median over rounds), so boot-to-boot differences do not enter it.
//!
//! `cargo bench -p vgpu-tests --bench sched_overhead [-- --guest [--rounds N]]`

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vgpu_bench_report::stats::{median, percentile};

use vfio_bindings::bindings::vfio::VFIO_PCI_MSIX_IRQ_INDEX;
use vgpu_cli::progress::Progress;
use vgpu_guest_drivers::virtio_gpu::{self, CAPSET_LOAD, LOAD_OP_OCCUPY};
use vgpu_schedd::proto::VmName;
use vgpu_server::sched_client::SchedConfig;
use vgpu_tests::daemon::Schedd;
use vgpu_tests::guest::{GuestImage, RunningGuest};
use vgpu_tests::raw_guest::{FEATURES_3D, RawGuest};
use vgpu_tests::server::TestServer;
use vmm_sys_util::eventfd::EventFd;

/// Environment variable that makes this binary run one measurement (`MODE:WORKLOAD`) and
/// print it.
const CHILD_ENV: &str = "VGPU_SCHED_OVERHEAD_CHILD";
/// GPU time of one OCCUPY group: short, so that the per-group cost of asking shows.
const OCCUPY_US: u64 = 50;
/// How long one run submits groups.
const DURATION: Duration = Duration::from_secs(2);
/// Runs per mode; the table shows their medians.
const RUNS: usize = 5;
/// Longest wait for one group, or for the daemon to start.
const TIMEOUT: Duration = Duration::from_secs(10);
const RESP_OK_NODATA: u32 = 0x1100;
const LOAD_CTX: u32 = 7;
const GL_CTX: u32 = 1;
const VM: &str = "vm-overhead";

/// What the raw client submits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Workload {
    /// Load-capset OCCUPY groups of [`OCCUPY_US`], run by the daemon's engine.
    Occupy,
    /// One-dword virgl SUBMIT_3Ds, device-executed with a renderer fence.
    Virgl,
}

impl Workload {
    const ALL: [Workload; 2] = [Workload::Occupy, Workload::Virgl];

    fn name(self) -> &'static str {
        match self {
            Workload::Occupy => "occupy",
            Workload::Virgl => "virgl",
        }
    }
}

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

const MODES: [Mode; 8] = [
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
        name: "ht, asking",
        policy: Some("policy = \"timegraph\"\nsched = \"ht\"\nht_lease = false\n"),
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

/// The modes of the guest table (indices into [`MODES`]): those a running daemon switches
/// between with `set-policy`, and no daemon.
const GUEST_MODES: [usize; 6] = [0, 1, 2, 3, 4, 6];

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
fn child(mode: Mode, workload: Workload) -> Option<Run> {
    let schedd = mode.daemon().transpose().expect("vgpu-schedd");
    let server = match &schedd {
        None => TestServer::start_3d(),
        Some(daemon) => TestServer::start_3d_scheduled(SchedConfig {
            socket: daemon.socket(),
            vm_name: VmName::new(VM).expect("name"),
            fallback: Default::default(),
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
    let (create, submit) = match workload {
        Workload::Occupy => (
            virtio_gpu::ctx_create(LOAD_CTX, CAPSET_LOAD, b"load"),
            virtio_gpu::load_submit(LOAD_CTX, &[(LOAD_OP_OCCUPY, 0, OCCUPY_US)]),
        ),
        Workload::Virgl => (
            virtio_gpu::ctx_create(GL_CTX, 0, b"gl"),
            virtio_gpu::submit_3d(GL_CTX, &[0]),
        ),
    };
    call(&mut guest, &irq, &create);
    let mut fence = 0u64;
    let mut latencies = Vec::new();
    let start = Instant::now();
    while start.elapsed() < DURATION {
        fence += 1;
        latencies.push(call(
            &mut guest,
            &irq,
            &virtio_gpu::with_fence(submit.clone(), fence),
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
fn measure(mode: usize, workload: Workload) -> Option<Run> {
    let out = Command::new(std::env::current_exe().expect("own path"))
        .env(CHILD_ENV, format!("{mode}:{}", workload.name()))
        .stderr(Stdio::inherit())
        .output()
        .expect("child runs");
    assert!(out.status.success(), "child failed: {:?}", out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("RESULT "))?;
    let mut f = line
        .split_whitespace()
        .map(|x| x.parse::<f64>().expect("number"));
    Some(Run {
        groups_per_s: f.next().expect("rate"),
        p50_us: f.next().expect("p50"),
        p99_us: f.next().expect("p99"),
    })
}

/// Scheduling overhead per mode: raw vfio-user client, and a TCG guest's glmark2 with --guest.
#[derive(Debug, clap::Parser)]
struct Cli {
    /// Also run glmark2's build scene in a TCG guest per mode (needs the guest image; minutes).
    #[arg(long)]
    guest: bool,
    /// Rounds of the guest table: each runs every guest mode once, in one boot.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=20))]
    rounds: u32,
    #[command(flatten)]
    _cargo: vgpu_bench_report::CargoBench,
}

/// Seconds of glmark2's build scene per guest slot.
const GUEST_SCENE_S: u32 = 8;
/// Seconds the guest waits before each slot's glmark2 while the bench puts the mode in force:
/// the device reconnects to a restarted daemon within its 1 s retry.
const GUEST_SETTLE_S: u32 = 3;
/// Longest wait for the device to show up at a (re)started daemon.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(2500);

/// The guest mode of slot `slot`: every round runs each of [`GUEST_MODES`] once, the order
/// rotated by one per round.
fn slot_mode(slot: usize) -> usize {
    let n = GUEST_MODES.len();
    GUEST_MODES[(slot % n + slot / n) % n]
}

/// Puts `mode` in force for the guest's device: no daemon, or the daemon (started again if
/// it was killed) with the mode's policy and the device connected. Returns the VM's
/// (submitted, dispatched) counters at the start.
fn apply(daemon: &mut Schedd, mode: Mode, slot: usize) -> Result<Option<(u64, u64)>, String> {
    let Some(policy) = mode.policy else {
        daemon.kill();
        return Ok(None);
    };
    if daemon.pid().is_none() {
        daemon.restart().map_err(|e| e.to_string())?;
    }
    let file = daemon
        .write(&format!("slot-{slot}.toml"), policy)
        .map_err(|e| e.to_string())?;
    let path = file.to_str().ok_or("policy path is not UTF-8")?;
    daemon
        .ctl(&["set-policy", path])
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    loop {
        let stats = daemon.vm_stats(VM).map_err(|e| e.to_string())?;
        if stats["connected"] == true {
            let n = |k: &str| stats[k].as_u64().unwrap_or(0);
            return Ok(Some((n("submitted"), n("dispatched"))));
        }
        if start.elapsed() > CONNECT_TIMEOUT {
            return Err(format!("{VM} not connected after {CONNECT_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The VM's groups asked for and leased since `at_start` (the counters [`apply`] returned).
fn groups_since(daemon: &Schedd, at_start: (u64, u64)) -> Option<(u64, u64)> {
    let stats = daemon.vm_stats(VM).ok()?;
    let submitted = stats["submitted"].as_u64()?.checked_sub(at_start.0)?;
    let dispatched = stats["dispatched"].as_u64()?.checked_sub(at_start.1)?;
    Some((submitted, dispatched.saturating_sub(submitted)))
}

/// One guest slot's outcome.
#[derive(Clone, Debug, Default)]
struct Slot {
    fps: Option<f64>,
    /// Groups asked for and leased during the slot (daemon modes).
    groups: Option<(u64, u64)>,
}

/// The guest table: one boot, `rounds` x [`GUEST_MODES`] slots of glmark2's build scene,
/// the mode switched before each; JSON rows. The steps are counted in `progress`.
fn guest_overhead(
    image: &GuestImage,
    rounds: usize,
    progress: &Progress,
) -> Vec<serde_json::Value> {
    let slots = rounds * GUEST_MODES.len();
    let mut daemon = match Schedd::start_with(None, "warn", &[]) {
        Ok(d) => d,
        Err(e) => {
            progress.note(&format!("guest table: vgpu-schedd: {e}"));
            return Vec::new();
        }
    };
    let job = format!(
        "for i in $(seq 0 {last}); do echo VGPU-SLOT $i; sleep {GUEST_SETTLE_S}; \
         glmark2-es2-drm --off-screen --visual-config alpha=0 -b build:duration={GUEST_SCENE_S} 2>&1 | grep 'FPS:'; done; echo VGPU-SLOT end",
        last = slots - 1
    );
    let mut config = daemon.guest_config(image, VM, job);
    config.timeout = Duration::from_secs(180 + 30 * slots as u64);
    let mut results = vec![Slot::default(); slots];
    let outcome = (|| -> Result<String, String> {
        let mut guest = RunningGuest::launch(&config).map_err(|e| e.to_string())?;
        let mut open: Option<(usize, (u64, u64))> = None;
        for slot in 0..=slots {
            let marker = if slot == slots {
                "VGPU-SLOT end".to_owned()
            } else {
                format!("VGPU-SLOT {slot}")
            };
            let seen = guest
                .wait_for_serial(|l| l.trim() == marker, |_| {})
                .map_err(|e| e.to_string())?;
            if !seen {
                return Err(format!("the guest ended before {marker}"));
            }
            if let Some((prev, at_start)) = open.take() {
                results[prev].groups = groups_since(&daemon, at_start);
                progress.advance();
            }
            if slot == slots {
                break;
            }
            let mode = MODES[slot_mode(slot)];
            progress.step(&format!(
                "TCG guest, slot {}/{slots}: {}",
                slot + 1,
                mode.name
            ));
            match apply(&mut daemon, mode, slot) {
                Ok(Some(at_start)) => open = Some((slot, at_start)),
                Ok(None) => {}
                Err(e) => progress.note(&format!("slot {slot} ({}): {e}", mode.name)),
            }
        }
        let run = guest.wait(|_| {}).map_err(|e| e.to_string())?;
        Ok(run.serial)
    })();
    daemon.kill();
    let serial = match outcome {
        Ok(serial) => serial,
        Err(e) => {
            progress.note(&format!("guest table failed: {e}"));
            return Vec::new();
        }
    };
    let mut slot = None;
    for line in serial.lines() {
        if let Some(n) = line.trim().strip_prefix("VGPU-SLOT ") {
            slot = n.parse::<usize>().ok();
        } else if let (Some(i), Some((_, rest))) = (slot, line.split_once("FPS: ")) {
            let fps = rest.split_whitespace().next().and_then(|f| f.parse().ok());
            if let Some(r) = results.get_mut(i) {
                r.fps = r.fps.or(fps);
            }
        }
    }
    guest_table(&results, rounds)
}

/// Prints the guest table and returns its JSON rows: per mode the median fps, and the
/// overhead as the median over rounds of the loss against that round's no-daemon slot.
fn guest_table(results: &[Slot], rounds: usize) -> Vec<serde_json::Value> {
    let n = GUEST_MODES.len();
    // fps[round][mode position in GUEST_MODES]
    let at = |round: usize, mode: usize| {
        (0..n)
            .map(|j| round * n + j)
            .find(|&slot| slot_mode(slot) == mode)
            .and_then(|slot| results.get(slot))
    };
    println!(
        "TCG guest, glmark2 build ({GUEST_SCENE_S} s, off-screen), one boot, {rounds} rounds, medians\n\
         {:<15} {:>8} {:>10} {:>16} {:>10} {:>10}",
        "mode", "fps", "overhead", "(min – max)", "asked/s", "leased/s"
    );
    let mut rows = Vec::new();
    for &mode in &GUEST_MODES {
        let name = MODES[mode].name;
        let fps: Vec<f64> = (0..rounds).filter_map(|r| at(r, mode)?.fps).collect();
        let paired: Vec<f64> = (0..rounds)
            .filter_map(|r| {
                let base = at(r, 0)?.fps?;
                let f = at(r, mode)?.fps?;
                Some((base / f - 1.0) * 100.0)
            })
            .collect();
        let rate = |pick: fn((u64, u64)) -> u64| {
            let per_s: Vec<f64> = (0..rounds)
                .filter_map(|r| at(r, mode)?.groups)
                .map(|g| pick(g) as f64 / f64::from(GUEST_SCENE_S + GUEST_SETTLE_S))
                .collect();
            (!per_s.is_empty()).then(|| median(per_s))
        };
        let (asked, leased) = (rate(|g| g.0), rate(|g| g.1));
        let m = median(fps.clone());
        let overhead = median(paired.clone());
        let lo = paired.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = paired.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let show = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
        println!(
            "{name:<15} {m:>8.1} {overhead:>9.1}% {:>16} {:>10} {:>10}",
            format!("({lo:.1} – {hi:.1})"),
            show(asked),
            show(leased)
        );
        rows.push(serde_json::json!({
            "mode": name, "fps": m, "overhead_pct": overhead, "runs": fps,
            "paired_overhead_pct": paired, "asked_per_s": asked, "leased_per_s": leased,
        }));
    }
    rows
}

/// The raw client's table for `workload` (medians of `runs`): printed, and its JSON rows.
fn raw_table(workload: Workload, measured: &[Vec<Run>]) -> Vec<serde_json::Value> {
    let what = match workload {
        Workload::Occupy => format!("{OCCUPY_US} µs OCCUPY groups (daemon engine)"),
        Workload::Virgl => "one-dword virgl SUBMIT_3Ds (device-executed, fenced)".to_owned(),
    };
    println!(
        "sched overhead: back-to-back {what} for {DURATION:?}, {RUNS} runs, medians\n\
         {:<15} {:>10} {:>9} {:>9} {:>10} {:>14}",
        "mode", "groups/s", "p50 µs", "p99 µs", "overhead", "µs per group"
    );
    let mut rows = Vec::new();
    let mut base: Option<f64> = None;
    for (Mode { name, .. }, runs) in MODES.iter().zip(measured) {
        let gps = median(runs.iter().map(|r| r.groups_per_s).collect());
        let p50 = median(runs.iter().map(|r| r.p50_us).collect());
        let p99 = median(runs.iter().map(|r| r.p99_us).collect());
        // Overhead: extra time per group against no daemon, as a share and in µs.
        let overhead = base.map_or(0.0, |b| (b / gps - 1.0) * 100.0);
        let added = base.map_or(0.0, |b| (1.0 / gps - 1.0 / b) * 1e6);
        base.get_or_insert(gps);
        println!("{name:<15} {gps:>10.0} {p50:>9.1} {p99:>9.1} {overhead:>9.1}% {added:>+14.1}");
        rows.push(serde_json::json!({
            "mode": name,
            "groups_per_s": gps,
            "p50_us": p50,
            "p99_us": p99,
            "overhead_pct": overhead,
            "added_us_per_group": added,
            "runs": runs.iter().map(|r| serde_json::json!({
                "groups_per_s": r.groups_per_s, "p50_us": r.p50_us, "p99_us": r.p99_us,
            })).collect::<Vec<_>>(),
        }));
    }
    rows
}

fn main() {
    if let Some(spec) = std::env::var_os(CHILD_ENV) {
        let spec = spec.to_str().expect("child spec").to_owned();
        let (mode, workload) = spec.split_once(':').expect("MODE:WORKLOAD");
        let mode = mode
            .parse::<usize>()
            .ok()
            .and_then(|m| MODES.get(m))
            .copied();
        let workload = Workload::ALL.into_iter().find(|w| w.name() == workload);
        match child(mode.expect("known mode"), workload.expect("known workload")) {
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
    let rounds = cli.rounds as usize;
    let guest_steps = if image.is_some() {
        rounds * GUEST_MODES.len()
    } else {
        0
    };
    let raw_steps = Workload::ALL.len() * MODES.len() * RUNS;
    let progress = Progress::new("sched_overhead", (raw_steps + guest_steps) as u64);
    let mut tables = Vec::new();
    for workload in Workload::ALL {
        let mut measured: Vec<Vec<Run>> = Vec::new();
        for (i, Mode { name, .. }) in MODES.iter().enumerate() {
            let mut runs = Vec::new();
            for run in 1..=RUNS {
                progress.step(&format!(
                    "raw client, {}, run {run}/{RUNS}: {name}",
                    workload.name()
                ));
                let Some(r) = measure(i, workload) else {
                    progress.note("SKIPPED: no virglrenderer on this host");
                    return;
                };
                progress.advance();
                runs.push(r);
            }
            measured.push(runs);
        }
        tables.push(measured);
    }
    let rows: Vec<Vec<serde_json::Value>> = Workload::ALL
        .iter()
        .zip(&tables)
        .map(|(&w, m)| raw_table(w, m))
        .collect();
    let guest_rows = image
        .as_ref()
        .map_or_else(Vec::new, |image| guest_overhead(image, rounds, &progress));
    drop(progress);
    let doc = serde_json::json!({
        "bench": "sched_overhead",
        "machine": vgpu_bench_report::machine(),
        "occupy_us": OCCUPY_US,
        "duration_s": DURATION.as_secs_f64(),
        "modes": rows[0],
        "virgl_modes": rows[1],
        "guest_glmark2_build": guest_rows,
        "guest_rounds": if image.is_some() { rounds } else { 0 },
    });
    let out = vgpu_bench_report::out_path(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/vgpu-bench/sched_overhead.json"
    )));
    vgpu_bench_report::write_results(&out, &doc).expect("writing the results");
}
