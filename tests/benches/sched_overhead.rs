//! Scheduling overhead for a standalone load through the device: a qtest VM with the vGPU (the
//! in-process server, the `vgpu-server` library code) and a load context (capset 20) that
//! submits back-to-back OCCUPY groups of [`OCCUPY_US`] µs, one in flight at a time, for
//! [`DURATION`]. Modes: no daemon (the device's local engine), and a real `vgpu-schedd`
//! process (started by the test harness's `vgpu_tests::daemon::Schedd`, which finds or builds
//! the binary) under policy none, timegraph PRT and timegraph HT.
//! Reports groups/s, p50/p99 submit-to-fence latency and the overhead of each mode against
//! no daemon (medians of [`RUNS`] runs); JSON to `target/vgpu-bench/sched_overhead.json`.
//!
//! virglrenderer may be initialised once per process, so every run is a child process of this
//! bench (the same binary, selected by [`CHILD_ENV`]).
//!
//! `cargo bench -p vgpu-tests --bench sched_overhead`

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_guest_drivers::virtio_gpu::{
    self, CAPSET_LOAD, CONTROL_QUEUE, CTRL_HDR_SIZE, LOAD_OP_OCCUPY,
};
use vgpu_schedd::proto::VmName;
use vgpu_server::sched_client::SchedConfig;
use vgpu_tests::daemon::Schedd;
use vgpu_tests::server::{TestServer, VgpuGuest};
use vgpu_tests::skip_without_qemu;

/// Environment variable that makes this binary run one measurement (`MODE`) and print it.
const CHILD_ENV: &str = "VGPU_SCHED_OVERHEAD_CHILD";
/// GPU time of one OCCUPY group.
const OCCUPY_US: u64 = 200;
/// How long one run submits groups.
const DURATION: Duration = Duration::from_secs(2);
/// Runs per mode; the table shows their medians.
const RUNS: usize = 3;
/// Longest wait for one group, or for the daemon to start.
const TIMEOUT: Duration = Duration::from_secs(10);
const RESP_OK_NODATA: u32 = 0x1100;
const LOAD_CTX: u32 = 7;
const VM: &str = "vm-overhead";
/// Modes: name and the daemon's policy file (none: no daemon).
const MODES: [(&str, Option<&str>); 4] = [
    ("no daemon", None),
    ("none", Some("policy = \"none\"\n")),
    (
        "timegraph prt",
        Some("policy = \"timegraph\"\nsched = \"prt\"\n"),
    ),
    (
        "timegraph ht",
        Some("policy = \"timegraph\"\nsched = \"ht\"\n"),
    ),
];

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
fn call(guest: &mut VgpuGuest, request: &[u8]) -> f64 {
    let qt = guest.vm.qtest();
    let start = Instant::now();
    let done = guest
        .dev
        .transact(
            qt,
            CONTROL_QUEUE,
            &[request],
            &[CTRL_HDR_SIZE as u32],
            TIMEOUT,
        )
        .expect("request completes");
    let us = start.elapsed().as_secs_f64() * 1e6;
    let reply = done.writable.expect("our chain").remove(0);
    let hdr = virtio_gpu::CtrlHeader::parse(&reply).expect("header");
    assert_eq!(hdr.ctrl_type, RESP_OK_NODATA, "request refused");
    us
}

/// One measurement in this process; `None` when this host has no virglrenderer.
fn child(policy: Option<&str>) -> Option<Run> {
    let schedd = policy.map(|p| Schedd::start_logging(Some(p), "warn").expect("vgpu-schedd"));
    let server = match &schedd {
        None => TestServer::start_3d(),
        Some(daemon) => TestServer::start_3d_scheduled(SchedConfig {
            socket: daemon.socket(),
            vm_name: VmName::new(VM).expect("name"),
        }),
    };
    let mut guest = VgpuGuest::start(&server);
    let features = guest.virgl_features()?;
    guest.bring_up_with(features);
    call(
        &mut guest,
        &virtio_gpu::ctx_create(LOAD_CTX, CAPSET_LOAD, b"load"),
    );
    let mut fence = 0u64;
    let mut latencies = Vec::new();
    let start = Instant::now();
    while start.elapsed() < DURATION {
        fence += 1;
        let submit = virtio_gpu::load_submit(LOAD_CTX, &[(LOAD_OP_OCCUPY, 0, OCCUPY_US)]);
        latencies.push(call(&mut guest, &virtio_gpu::with_fence(submit, fence)));
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    if let Some(mode) = std::env::var_os(CHILD_ENV) {
        let mode: usize = mode.to_str().and_then(|m| m.parse().ok()).expect("mode");
        let (_, policy) = MODES.get(mode).copied().expect("known mode");
        match child(policy) {
            Some(r) => println!("RESULT {} {} {}", r.groups_per_s, r.p50_us, r.p99_us),
            None => eprintln!("SKIPPED: no virglrenderer on this host"),
        }
        return;
    }
    if skip_without_qemu() {
        return;
    }
    println!(
        "sched overhead: back-to-back {OCCUPY_US} µs OCCUPY groups for {DURATION:?}, {RUNS} runs, medians\n\
         {:<15} {:>10} {:>9} {:>9} {:>10}",
        "mode", "groups/s", "p50 µs", "p99 µs", "overhead"
    );
    let mut rows = Vec::new();
    let mut base: Option<f64> = None;
    for (i, (name, _)) in MODES.iter().enumerate() {
        let Some(runs) = (0..RUNS).map(|_| measure(i)).collect::<Option<Vec<Run>>>() else {
            eprintln!("SKIPPED: no virglrenderer on this host");
            return;
        };
        let gps = median(runs.iter().map(|r| r.groups_per_s).collect());
        let p50 = median(runs.iter().map(|r| r.p50_us).collect());
        let p99 = median(runs.iter().map(|r| r.p99_us).collect());
        // Overhead: extra time per group against no daemon.
        let overhead = base.map_or(0.0, |b| (b / gps - 1.0) * 100.0);
        base.get_or_insert(gps);
        println!("{name:<15} {gps:>10.0} {p50:>9.1} {p99:>9.1} {overhead:>9.1}%");
        let each: Vec<String> = runs
            .iter()
            .map(|r| {
                format!(
                    "{{\"groups_per_s\": {:.1}, \"p50_us\": {:.1}, \"p99_us\": {:.1}}}",
                    r.groups_per_s, r.p50_us, r.p99_us
                )
            })
            .collect();
        rows.push(format!(
            "    {{\"mode\": \"{name}\", \"groups_per_s\": {gps:.1}, \"p50_us\": {p50:.1}, \
             \"p99_us\": {p99:.1}, \"overhead_pct\": {overhead:.2}, \"runs\": [{}]}}",
            each.join(", ")
        ));
    }
    let out = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/vgpu-bench/sched_overhead.json"
    ));
    let doc = format!(
        "{{\n  \"bench\": \"sched_overhead\",\n  \"occupy_us\": {OCCUPY_US},\n  \"duration_s\": {},\n  \"modes\": [\n{}\n  ]\n}}\n",
        DURATION.as_secs_f64(),
        rows.join(",\n")
    );
    if let Some(parent) = out.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    match std::fs::write(&out, doc) {
        Ok(()) => println!("wrote {}", out.display()),
        Err(e) => eprintln!("could not write {}: {e}", out.display()),
    }
}
