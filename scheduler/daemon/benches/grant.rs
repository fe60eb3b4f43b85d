//! Grant round trip through a real `vgpu-schedd` process: one fake device over
//! SOCK_SEQPACKET sends `Hello`, then for every group `Submit{exec: Device}`, waits for
//! `Grant` and reports `Completed`, under the policies none, timegraph PRT, timegraph HT and
//! fair. Under fair the device holds a lease and reports `Dispatched` + `Completed` without
//! waiting (no round trip); one final `Submit` (granted at once under the lease) makes sure
//! the daemon has handled everything before the clock stops.
//!
//! Prints a table (p50/p99 µs of Submit -> Grant, µs per group) of the median of
//! [`RUNS`] runs and writes the same as JSON to `target/grant-bench.json`.
//!
//! `cargo bench -p vgpu-schedd --bench grant`

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use tempfile::TempDir;
use vgpu_schedd::proto::{self, Exec, MAX_MESSAGE_BYTES, Msg, PROTOCOL_VERSION, VmName};
use vgpu_schedd::seqpacket::{SeqStream, monotonic_ns};
use vgpu_scheduler::{CostSignature, GroupId, GroupKind};

const SCHEDD: &str = env!("CARGO_BIN_EXE_vgpu-schedd");
/// Groups per run, after [`WARMUP`] unmeasured ones.
const GROUPS: u64 = 5_000;
/// Unmeasured groups at the start of every run.
const WARMUP: u64 = 200;
/// Runs per policy; the table shows their medians.
const RUNS: usize = 3;
/// Longest wait for the daemon to start or answer.
const WAIT: Duration = Duration::from_secs(10);

/// The policies measured: name, policy file text, whether the device holds a lease.
const POLICIES: [(&str, &str, bool); 4] = [
    ("none", "policy = \"none\"\n", false),
    (
        "timegraph prt",
        "policy = \"timegraph\"\nsched = \"prt\"\n",
        false,
    ),
    (
        "timegraph ht",
        "policy = \"timegraph\"\nsched = \"ht\"\n",
        false,
    ),
    ("fair (lease)", "policy = \"fair\"\n", true),
];

/// A daemon child, killed and reaped on drop.
struct Schedd {
    child: Child,
    socket: PathBuf,
}

impl Schedd {
    fn start(dir: &Path, policy: &str) -> Schedd {
        let file = dir.join("policy.toml");
        std::fs::write(&file, policy).expect("policy file");
        let socket = dir.join("sched.sock");
        let child = Command::new(SCHEDD)
            .arg("--socket")
            .arg(&socket)
            .arg("--control")
            .arg(dir.join("control.sock"))
            .arg("--policy")
            .arg(&file)
            .args(["--log-level", "warn"])
            .stderr(Stdio::inherit())
            .spawn()
            .expect("vgpu-schedd starts");
        Schedd { child, socket }
    }
}

impl Drop for Schedd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The fake device.
struct Device {
    s: SeqStream,
    buf: Vec<u8>,
    out: Vec<u8>,
}

impl Device {
    /// Connects (retrying while the daemon starts) and says Hello; returns the device and
    /// whether a lease came with the Welcome.
    fn connect(schedd: &Schedd, lease: bool) -> Device {
        let start = Instant::now();
        let s = loop {
            match SeqStream::connect(&schedd.socket) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(start.elapsed() < WAIT, "daemon did not start: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        s.set_read_timeout(Some(WAIT)).expect("read timeout");
        let mut d = Device {
            s,
            buf: vec![0; MAX_MESSAGE_BYTES + 1],
            out: Vec::new(),
        };
        d.send(&Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new("bench").expect("name"),
            device_pid: std::process::id(),
            qemu_pid: 0,
        });
        assert!(matches!(d.recv(), Msg::Welcome { .. }), "no Welcome");
        if lease {
            assert!(matches!(d.recv(), Msg::Lease { .. }), "no Lease");
        }
        d
    }

    fn send(&mut self, m: &Msg) {
        self.out.clear();
        proto::encode(m, &mut self.out);
        self.s.send(&self.out).expect("send");
    }

    fn recv(&mut self) -> Msg {
        let n = self
            .s
            .recv(&mut self.buf)
            .expect("recv")
            .expect("answer in time");
        proto::decode(&self.buf[..n]).expect("valid message")
    }

    fn submit(&mut self, id: u64) {
        self.send(&Msg::Submit {
            group: GroupId(id),
            context: 0,
            kind: GroupKind::Render,
            signature: CostSignature(1),
            cost_ns: 0,
            exec: Exec::Device,
        });
    }

    fn wait_grant(&mut self, id: u64) {
        match self.recv() {
            Msg::Grant { group } if group == GroupId(id) => {}
            other => panic!("expected Grant {id}, got {other:?}"),
        }
    }

    fn complete(&mut self, id: u64, start: u64) {
        self.send(&Msg::Completed {
            group: GroupId(id),
            start,
            finish: monotonic_ns(),
        });
    }

    /// One group; returns its Submit -> Grant time in ns (0 under a lease).
    fn group(&mut self, id: u64, lease: bool) -> u64 {
        let t0 = monotonic_ns();
        if lease {
            self.send(&Msg::Dispatched {
                group: GroupId(id),
                context: 0,
                kind: GroupKind::Render,
                signature: CostSignature(1),
            });
            self.complete(id, t0);
            return 0;
        }
        self.submit(id);
        self.wait_grant(id);
        let t1 = monotonic_ns();
        self.complete(id, t1);
        t1.saturating_sub(t0)
    }
}

/// One run's figures in µs.
#[derive(Clone, Copy)]
struct Run {
    p50: f64,
    p99: f64,
    per_group: f64,
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64 / 1_000.0
}

fn run(policy: &str, lease: bool) -> Run {
    let dir = TempDir::new().expect("temporary directory");
    let schedd = Schedd::start(dir.path(), policy);
    let mut dev = Device::connect(&schedd, lease);
    let mut id = 0;
    for _ in 0..WARMUP {
        id += 1;
        dev.group(id, lease);
    }
    let mut rtt = Vec::with_capacity(GROUPS as usize);
    let start = Instant::now();
    for _ in 0..GROUPS {
        id += 1;
        rtt.push(dev.group(id, lease));
    }
    if lease {
        // Everything sent before this Submit is handled once its Grant arrives.
        id += 1;
        dev.submit(id);
        dev.wait_grant(id);
    }
    let total = start.elapsed();
    dev.send(&Msg::Bye);
    rtt.sort_unstable();
    let (p50, p99) = if lease {
        (f64::NAN, f64::NAN)
    } else {
        (percentile(&rtt, 0.5), percentile(&rtt, 0.99))
    };
    Run {
        p50,
        p99,
        per_group: total.as_secs_f64() * 1e6 / GROUPS as f64,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn fmt(x: f64) -> String {
    if x.is_nan() {
        "-".to_string()
    } else {
        format!("{x:.1}")
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument selects policies by substring.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let mut rows = Vec::new();
    println!(
        "grant round trip: {GROUPS} groups x {RUNS} runs, medians (µs)\n{:<15} {:>8} {:>8} {:>10}",
        "policy", "p50", "p99", "per group"
    );
    for (name, text, lease) in POLICIES {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let runs: Vec<Run> = (0..RUNS).map(|_| run(text, lease)).collect();
        let p50 = median(runs.iter().map(|r| r.p50).collect());
        let p99 = median(runs.iter().map(|r| r.p99).collect());
        let per = median(runs.iter().map(|r| r.per_group).collect());
        println!(
            "{name:<15} {:>8} {:>8} {:>10}",
            fmt(p50),
            fmt(p99),
            fmt(per)
        );
        let all: Vec<_> = runs
            .iter()
            .map(|r| json!({"p50_us": r.p50, "p99_us": r.p99, "per_group_us": r.per_group}))
            .collect();
        rows.push(json!({
            "policy": name,
            "lease": lease,
            "p50_us": if p50.is_nan() { None } else { Some(p50) },
            "p99_us": if p99.is_nan() { None } else { Some(p99) },
            "per_group_us": per,
            "runs": all,
        }));
    }
    // The binary lives in target/<profile>/: the JSON goes next to the profile folders.
    let target = Path::new(SCHEDD)
        .parent()
        .and_then(Path::parent)
        .unwrap_or(Path::new("."));
    let out = target.join("grant-bench.json");
    let doc = json!({
        "bench": "grant",
        "groups": GROUPS,
        "runs": RUNS,
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "policies": rows,
    });
    match std::fs::write(&out, format!("{doc:#}\n")) {
        Ok(()) => println!("wrote {}", out.display()),
        Err(e) => eprintln!("could not write {}: {e}", out.display()),
    }
}
