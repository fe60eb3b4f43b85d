//! Scale: one real `vgpu-schedd` process and 64 or 256 fake devices (threads of this process,
//! each its own SOCK_SEQPACKET connection and VM name), every one submitting groups back to
//! back at its maximum rate (`Submit{exec: Device}` -> `Grant` -> `Completed`, no GPU work)
//! for [`SECONDS`] s, under the policies none, timegraph PRT, timegraph HT (a lease only for a
//! vGPU alone at its priority, so among equals every group asks), HT asking always, and fair
//! (leases: `Dispatched` + `Completed`, no waiting).
//!
//! Each runs with the daemon's busy polling off and at its default: with it on, a loaded daemon
//! spins between messages, so its CPU use says little about what deciding costs; with it off,
//! the CPU use is the work.
//!
//! Reports per configuration: decisions/s (groups completed per second, all devices
//! together), Submit -> Grant p50/p99 over every group that asked (under a capacity of one GPU, a group
//! waits for the groups of the other devices granted before it: that is queueing, not
//! overhead), the daemon's CPU use (user + system from `/proc`) and its CPU time per decision.
//! Prints a table and writes `target/scale-bench.json` and its figure `target/scale-bench.svg`
//! (lines against the number of devices). Progress goes to stderr (a bar on a terminal).
//!
//! `cargo bench -p vgpu-schedd --bench scale [-- [--seconds S] [--devices 16,64] [FILTER...]]`
//! (FILTER: a substring of the policy; `--seconds 1 --devices 16,64` is a quick look)

mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::builder::TypedValueParser as _;
use serde_json::json;
use tempfile::TempDir;

use common::{Device, Schedd};
use vgpu_cli::progress::Progress;
use vgpu_schedd::busy_poll;
use vgpu_schedd::proto::Msg;

/// Devices per configuration, by default.
const DEVICES: [usize; 3] = [16, 64, 256];
/// Most fake devices: the daemon refuses connections beyond its limit.
const MAX_DEVICES: i64 = vgpu_schedd::daemon::MAX_CONNECTIONS as i64;
/// Seconds every configuration runs, by default.
const SECONDS: u64 = 3;

/// The daemon under many fake devices, per policy, device count and busy polling.
#[derive(Debug, clap::Parser)]
struct Cli {
    /// Seconds each configuration runs.
    #[arg(long, default_value_t = SECONDS, value_parser = clap::value_parser!(u64).range(1..=600))]
    seconds: u64,
    /// Numbers of devices to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = DEVICES,
          value_parser = clap::value_parser!(u16).range(1..=MAX_DEVICES).map(usize::from))]
    devices: Vec<usize>,
    /// Policies to measure: substrings of their names (all when none is given).
    filter: Vec<String>,
    #[command(flatten)]
    _cargo: vgpu_bench_report::CargoBench,
}

struct Outcome {
    /// Devices still waiting for a Resume when the window closed.
    suspended_at_end: usize,
    /// Groups refused as dispatched after the lease had ended (see `Device::refused`).
    refused: usize,
    decisions_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    daemon_cpu_percent: f64,
    cpu_per_decision_us: f64,
}

fn run(devices: usize, policy: &str, lease: bool, busy_poll_us: u64, seconds: u64) -> Outcome {
    let dir = TempDir::new().expect("temporary directory");
    let schedd = Schedd::start(dir.path(), policy, busy_poll_us);
    let connected: Vec<Device> = (0..devices)
        .map(|i| Device::connect(&schedd, &format!("scale-{i}"), lease))
        .collect();
    let start = Arc::new(Barrier::new(devices + 1));
    let window = Duration::from_secs(seconds);
    let threads: Vec<_> = connected
        .into_iter()
        .map(|mut dev| {
            let start = start.clone();
            std::thread::spawn(move || {
                let mut latencies = Vec::new();
                start.wait();
                let end = Instant::now() + window;
                let mut id = 0;
                let mut suspended_at_end = false;
                while Instant::now() < end {
                    id += 1;
                    match dev.group_until(id, lease, end) {
                        Some(ns) => latencies.push(ns),
                        None => suspended_at_end = true,
                    }
                }
                dev.send(&Msg::Bye);
                (latencies, suspended_at_end, dev.refused)
            })
        })
        .collect();
    let cpu_before = schedd.cpu_time();
    let began = Instant::now();
    start.wait();
    let mut all: Vec<u64> = Vec::new();
    let (mut suspended, mut refused) = (0, 0);
    for t in threads {
        let (latencies, suspended_at_end, refused_here) = t.join().expect("device thread");
        all.extend(latencies);
        suspended += usize::from(suspended_at_end);
        refused += refused_here;
    }
    let wall = began.elapsed();
    let cpu = schedd.cpu_time().saturating_sub(cpu_before);
    // A refused group was not run: it is no decision.
    let decisions = all.len().saturating_sub(refused) as f64;
    let (p50_us, p99_us) = common::asked_percentiles(&all);
    Outcome {
        suspended_at_end: suspended,
        refused,
        decisions_per_s: decisions / wall.as_secs_f64(),
        p50_us,
        p99_us,
        daemon_cpu_percent: 100.0 * cpu.as_secs_f64() / wall.as_secs_f64(),
        cpu_per_decision_us: cpu.as_secs_f64() * 1e6 / decisions.max(1.0),
    }
}

fn main() {
    let cli: Cli = clap::Parser::parse();
    let policies = common::policies(&cli.filter);
    let polls = [0, busy_poll::DEFAULT_MAX.as_micros() as u64];
    let mut table = vec![format!(
        "daemon scale: devices submitting back to back for {} s each\n{:<15} {:>9} {:>7} {:>12} {:>9} {:>9} {:>11} {:>13}",
        cli.seconds,
        "policy",
        "busy poll",
        "devices",
        "decisions/s",
        "p50 µs",
        "p99 µs",
        "daemon CPU",
        "CPU/decision"
    )];
    let steps = policies.len() * cli.devices.len() * polls.len();
    let progress = Progress::new("scale", steps as u64);
    let mut rows = Vec::new();
    for (name, text, lease) in policies {
        for (&devices, busy_poll_us) in cli.devices.iter().flat_map(|d| polls.map(|p| (d, p))) {
            progress.step(&format!(
                "{name}, {devices} devices, busy poll {busy_poll_us} µs"
            ));
            let o = run(devices, text, lease, busy_poll_us, cli.seconds);
            progress.advance();
            table.push(format!(
                "{name:<15} {:>9} {devices:>7} {:>12.0} {:>9} {:>9} {:>10.0}% {:>10} µs",
                format!("{busy_poll_us} µs"),
                o.decisions_per_s,
                common::fmt(o.p50_us),
                common::fmt(o.p99_us),
                o.daemon_cpu_percent,
                common::fmt(o.cpu_per_decision_us)
            ));
            progress.note(&table[table.len() - 1]);
            if o.suspended_at_end > 0 {
                table.push(format!(
                    "  {} of {devices} devices were still suspended when the window closed",
                    o.suspended_at_end
                ));
            }
            if o.refused > 0 {
                table.push(format!(
                    "  {} groups refused: dispatched after their lease ended and the daemon's grace \
                     (device threads starved on this host)",
                    o.refused
                ));
            }
            rows.push(json!({
                "policy": name,
                "devices": devices,
                "busy_poll_us": busy_poll_us,
                "lease": lease,
                "decisions_per_s": o.decisions_per_s,
                "grant_p50_us": if o.p50_us.is_nan() { None } else { Some(o.p50_us) },
                "grant_p99_us": if o.p99_us.is_nan() { None } else { Some(o.p99_us) },
                "daemon_cpu_percent": o.daemon_cpu_percent,
                "daemon_cpu_per_decision_us": o.cpu_per_decision_us,
                "suspended_at_end": o.suspended_at_end,
                "dispatches_refused": o.refused,
            }));
        }
    }
    drop(progress);
    println!("{}", table.join("\n"));
    common::write_results(
        "scale-bench",
        &json!({
            "bench": "scale",
            "seconds": cli.seconds,
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "machine": vgpu_bench_report::machine(),
            "configurations": rows,
        }),
    );
}
