//! Grant round trip through a real `vgpu-schedd` process: one fake device over
//! SOCK_SEQPACKET sends `Hello`, then for every group `Submit{exec: Device}`, waits for
//! `Grant` and reports `Completed`, under the policies none, timegraph PRT, timegraph HT, HT
//! asking for every group (`ht_lease = false`) and fair. Under fair, and under HT (alone, the
//! device streams after its first grant), the device holds a lease and reports `Dispatched` +
//! `Completed` without waiting (no round trip; the latency columns cover the groups that
//! asked); one final `Submit` (granted at once under the lease) makes sure the daemon has
//! handled everything before the clock stops.
//!
//! Every policy runs with the daemon's busy polling off (`--busy-poll-us 0`: the daemon sleeps
//! in `epoll_wait` between messages, so each Submit costs it a wake-up) and at its default.
//!
//! Prints a table (p50/p99 µs of Submit -> Grant, µs per group) of the median of
//! `--runs` runs (default [`RUNS`]) and writes the same as JSON to `target/grant-bench.json`
//! and its figure to `target/grant-bench.svg`. Progress goes to stderr (a bar on a terminal).
//!
//! `cargo bench -p vgpu-schedd --bench grant [-- [--runs N] [--groups N] [POLICY...]]`
//! (POLICY: a substring of a policy's name)

mod common;

use std::time::Instant;
use vgpu_bench_report::stats::median;

use clap::builder::TypedValueParser as _;
use serde_json::json;
use tempfile::TempDir;
use vgpu_schedd::busy_poll;
use vgpu_schedd::proto::Msg;

use common::{Device, Schedd};
use vgpu_cli::progress::Progress;

/// Groups per run by default, after [`WARMUP`] unmeasured ones.
const GROUPS: u64 = 5_000;
/// Unmeasured groups at the start of every run.
const WARMUP: u64 = 200;
/// Runs per policy by default; the table shows their medians.
const RUNS: usize = 3;

/// Grant round trip through a real vgpu-schedd, per policy and busy polling.
#[derive(Debug, clap::Parser)]
struct Cli {
    /// Runs per configuration (the table shows their medians).
    #[arg(long, default_value_t = RUNS, value_parser = clap::value_parser!(u16).range(1..=100).map(usize::from))]
    runs: usize,
    /// Measured groups per run.
    #[arg(long, default_value_t = GROUPS, value_parser = clap::value_parser!(u64).range(10..=10_000_000))]
    groups: u64,
    /// Policies to measure: substrings of their names (all when none is given).
    filter: Vec<String>,
    #[command(flatten)]
    _cargo: vgpu_bench_report::CargoBench,
}

/// One group that must not stay suspended past [`common::WAIT`].
fn group(dev: &mut Device, id: u64, lease: bool) -> u64 {
    dev.group_until(id, lease, Instant::now() + common::WAIT)
        .expect("resumed in time")
}

/// One run's figures in µs.
#[derive(Clone, Copy)]
struct Run {
    p50: f64,
    p99: f64,
    per_group: f64,
    /// The daemon's CPU time per group.
    cpu_per_group: f64,
}

fn run(policy: &str, lease: bool, busy_poll_us: u64, groups: u64) -> Run {
    let dir = TempDir::new().expect("temporary directory");
    let schedd = Schedd::start(dir.path(), policy, busy_poll_us);
    let mut dev = Device::connect(&schedd, "bench", lease);
    let mut id = 0;
    for _ in 0..WARMUP {
        id += 1;
        group(&mut dev, id, lease);
    }
    let mut rtt = Vec::with_capacity(usize::try_from(groups).unwrap_or(0));
    let cpu_before = schedd.cpu_time();
    let start = Instant::now();
    for _ in 0..groups {
        id += 1;
        rtt.push(group(&mut dev, id, lease));
    }
    if lease {
        // Everything sent before this Submit is handled once its Grant arrives.
        id += 1;
        dev.submit(id);
        dev.wait_grant(id);
    }
    let total = start.elapsed();
    let cpu = schedd.cpu_time().saturating_sub(cpu_before);
    dev.send(&Msg::Bye);
    let (p50, p99) = common::asked_percentiles(&rtt);
    Run {
        p50,
        p99,
        per_group: total.as_secs_f64() * 1e6 / groups as f64,
        cpu_per_group: cpu.as_secs_f64() * 1e6 / groups as f64,
    }
}

fn main() {
    let cli: Cli = clap::Parser::parse();
    let policies = common::policies(&cli.filter);
    let polls = [0, busy_poll::DEFAULT_MAX.as_micros() as u64];
    let mut table = vec![format!(
        "grant round trip: {} groups x {} runs, medians (µs)\n{:<15} {:>9} {:>8} {:>8} {:>10} {:>12}",
        cli.groups, cli.runs, "policy", "busy poll", "p50", "p99", "per group", "daemon CPU"
    )];
    let steps = policies.len() * polls.len() * cli.runs;
    let progress = Progress::new("grant", steps as u64);
    let mut rows = Vec::new();
    for (name, text, lease) in policies {
        for busy_poll_us in polls {
            let runs: Vec<Run> = (1..=cli.runs)
                .map(|i| {
                    progress.step(&format!(
                        "{name}, busy poll {busy_poll_us} µs, run {i}/{}",
                        cli.runs
                    ));
                    let r = run(text, lease, busy_poll_us, cli.groups);
                    progress.advance();
                    r
                })
                .collect();
            let p50 = median(runs.iter().map(|r| r.p50).collect());
            let p99 = median(runs.iter().map(|r| r.p99).collect());
            let per = median(runs.iter().map(|r| r.per_group).collect());
            let cpu = median(runs.iter().map(|r| r.cpu_per_group).collect());
            table.push(format!(
                "{name:<15} {:>9} {:>8} {:>8} {:>10} {:>12}",
                format!("{busy_poll_us} µs"),
                common::fmt(p50),
                common::fmt(p99),
                common::fmt(per),
                common::fmt(cpu)
            ));
            progress.note(&table[table.len() - 1]);
            let all: Vec<_> = runs
                .iter()
                .map(|r| {
                    json!({"p50_us": r.p50, "p99_us": r.p99, "per_group_us": r.per_group,
                           "daemon_cpu_per_group_us": r.cpu_per_group})
                })
                .collect();
            rows.push(json!({
                "policy": name,
                "busy_poll_us": busy_poll_us,
                "lease": lease,
                "p50_us": if p50.is_nan() { None } else { Some(p50) },
                "p99_us": if p99.is_nan() { None } else { Some(p99) },
                "per_group_us": per,
                "daemon_cpu_per_group_us": cpu,
                "runs": all,
            }));
        }
    }
    drop(progress);
    println!("{}", table.join("\n"));
    common::write_results(
        "grant-bench",
        &json!({
            "bench": "grant",
            "groups": cli.groups,
            "runs": cli.runs,
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "machine": vgpu_bench_report::machine(),
            "policies": rows,
        }),
    );
}
