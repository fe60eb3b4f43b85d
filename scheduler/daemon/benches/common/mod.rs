//! What the daemon benchmarks share: a `vgpu-schedd` child and a fake device speaking the
//! device protocol over SOCK_SEQPACKET.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vgpu_bench_report::stats::percentile;

use vgpu_schedd::proto::{
    self, Exec, MAX_MESSAGE_BYTES, Msg, PROTOCOL_VERSION, RefuseCode, VmName,
};
use vgpu_schedd::seqpacket::{SeqStream, monotonic_ns};
use vgpu_scheduler::{CostSignature, GroupId, GroupKind};

pub const SCHEDD: &str = env!("CARGO_BIN_EXE_vgpu-schedd");
/// Longest wait for the daemon to start or answer.
pub const WAIT: Duration = Duration::from_secs(10);

/// The policies measured: name, policy file text, whether devices may hold a lease (HT leases
/// to a vGPU alone at its priority, fair to everyone).
pub const POLICIES: [(&str, &str, bool); 5] = [
    ("none", "policy = \"none\"\n", false),
    (
        "timegraph prt",
        "policy = \"timegraph\"\nsched = \"prt\"\n",
        false,
    ),
    (
        "timegraph ht",
        "policy = \"timegraph\"\nsched = \"ht\"\n",
        true,
    ),
    (
        "ht, asking",
        "policy = \"timegraph\"\nsched = \"ht\"\nht_lease = false\n",
        false,
    ),
    ("fair (lease)", "policy = \"fair\"\n", true),
];

/// The policies whose name contains one of `filter` (all when it is empty).
pub fn policies(filter: &[String]) -> Vec<(&'static str, &'static str, bool)> {
    POLICIES
        .into_iter()
        .filter(|(name, _, _)| {
            filter.is_empty() || filter.iter().any(|f| name.contains(f.as_str()))
        })
        .collect()
}

/// Writes a bench's results as JSON beside the profile folders (`target/`, found from the
/// daemon binary in `target/<profile>/`) and its figure next to it.
pub fn write_results(name: &str, doc: &serde_json::Value) {
    let out = Path::new(SCHEDD)
        .parent()
        .and_then(Path::parent)
        .unwrap_or(Path::new("."))
        .join(format!("{name}.json"));
    if let Err(e) = vgpu_bench_report::write_results(&out, doc) {
        eprintln!("{e}");
    }
}

/// The p50 and p99 in µs of the Submit -> Grant times (ns) of the groups that asked; a leased
/// group counts 0 ns (no round trip) and is left out. NaN when no group asked.
pub fn asked_percentiles(latencies: &[u64]) -> (f64, f64) {
    let mut asked: Vec<f64> = latencies
        .iter()
        .filter(|&&ns| ns > 0)
        .map(|&ns| ns as f64 / 1_000.0)
        .collect();
    asked.sort_by(f64::total_cmp);
    (percentile(&asked, 50.0), percentile(&asked, 99.0))
}

/// A figure with one decimal, `-` when there is none.
pub fn fmt(x: f64) -> String {
    if x.is_nan() {
        "-".to_string()
    } else {
        format!("{x:.1}")
    }
}

/// A daemon child, killed and reaped on drop.
pub struct Schedd {
    child: Child,
    socket: PathBuf,
}

impl Schedd {
    pub fn start(dir: &Path, policy: &str, busy_poll_us: u64) -> Schedd {
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
            .arg("--busy-poll-us")
            .arg(busy_poll_us.to_string())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("vgpu-schedd starts");
        Schedd { child, socket }
    }
}

impl Schedd {
    /// The daemon's CPU time so far, all its threads, in ns: the first field of each
    /// `/proc/PID/task/TID/schedstat` (the scheduler's run time; `/proc/PID/stat` counts in
    /// clock ticks of 10 ms, too coarse for a run of a few milliseconds).
    pub fn cpu_time(&self) -> Duration {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.child.id()))
            .expect("the daemon's threads");
        let ns: u64 = tasks
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        Duration::from_nanos(ns)
    }
}

impl Drop for Schedd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The fake device. Like the server's scheduler client it follows leases: while it holds one
/// it reports `Dispatched` + `Completed` without asking; a `Revoke` sends it back to asking;
/// between `Suspend` and `Resume` it dispatches nothing.
pub struct Device {
    s: SeqStream,
    buf: Vec<u8>,
    out: Vec<u8>,
    leased: bool,
    suspended: bool,
    /// Groups the daemon refused as dispatched without a lease: a thread of this process ran
    /// too late to see the Revoke in time (past the daemon's grace, on an overloaded host).
    pub refused: usize,
}

impl Device {
    /// Connects (retrying while the daemon starts) and says Hello; returns the device and
    /// whether a lease came with the Welcome.
    pub fn connect(schedd: &Schedd, name: &str, lease: bool) -> Device {
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
            leased: false,
            suspended: false,
            refused: 0,
        };
        d.send(&Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new(name).expect("name"),
            device_pid: std::process::id(),
            qemu_pid: 0,
        });
        assert!(matches!(d.recv(), Msg::Welcome { .. }), "no Welcome");
        if lease {
            // Fair leases at once (in the Welcome's round); HT after the first grant.
            d.drain();
        }
        d
    }

    pub fn send(&mut self, m: &Msg) {
        self.out.clear();
        proto::encode(m, &mut self.out);
        self.s.send(&self.out).expect("send");
    }

    pub fn recv(&mut self) -> Msg {
        let n = self
            .s
            .recv(&mut self.buf)
            .expect("recv")
            .expect("answer in time");
        proto::decode(&self.buf[..n]).expect("valid message")
    }

    pub fn submit(&mut self, id: u64) {
        self.send(&Msg::Submit {
            group: GroupId(id),
            context: 0,
            kind: GroupKind::Render,
            signature: CostSignature(1),
            cost_ns: 0,
            exec: Exec::Device,
        });
    }

    pub fn wait_grant(&mut self, id: u64) {
        loop {
            match self.recv() {
                Msg::Grant { group } if group == GroupId(id) => return,
                other if self.follow(&other) => {}
                other => panic!("expected Grant {id}, got {other:?}"),
            }
        }
    }

    /// Takes a lease or suspension change, or a refused dispatch (the lease was gone: ask
    /// from now on); false for any other message.
    fn follow(&mut self, m: &Msg) -> bool {
        match m {
            Msg::Lease { .. } => self.leased = true,
            Msg::Revoke => self.leased = false,
            Msg::Refused {
                code: RefuseCode::NotLeased,
                ..
            } => {
                self.leased = false;
                self.refused += 1;
            }
            Msg::Suspend => self.suspended = true,
            Msg::Resume => self.suspended = false,
            _ => return false,
        }
        true
    }

    /// Reads the lease changes the daemon sent since the last look, without waiting.
    fn drain(&mut self) {
        self.s.set_nonblocking(true).expect("non-blocking");
        while let Some(n) = self.s.recv(&mut self.buf).expect("recv") {
            let m = proto::decode(&self.buf[..n]).expect("valid message");
            assert!(self.follow(&m), "unexpected {m:?} between groups");
        }
        self.s.set_nonblocking(false).expect("blocking");
    }

    pub fn complete(&mut self, id: u64, start: u64) {
        self.send(&Msg::Completed {
            group: GroupId(id),
            start,
            finish: monotonic_ns(),
        });
    }

    /// One group; returns its Submit -> Grant time in ns (0 under a lease), or `None` when the
    /// device is still suspended at `deadline`. With `lease` (a policy that hands out leases)
    /// it first reads the lease changes sent meanwhile.
    pub fn group_until(&mut self, id: u64, lease: bool, deadline: Instant) -> Option<u64> {
        if lease {
            self.drain();
            while self.suspended {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return None;
                }
                self.s.set_read_timeout(Some(left)).expect("read timeout");
                let got = self.s.recv(&mut self.buf).expect("recv");
                self.s.set_read_timeout(Some(WAIT)).expect("read timeout");
                if let Some(n) = got {
                    let m = proto::decode(&self.buf[..n]).expect("valid message");
                    assert!(self.follow(&m), "unexpected {m:?} while suspended");
                }
            }
        }
        let t0 = monotonic_ns();
        if self.leased {
            self.send(&Msg::Dispatched {
                group: GroupId(id),
                context: 0,
                kind: GroupKind::Render,
                signature: CostSignature(1),
            });
            self.complete(id, t0);
            return Some(0);
        }
        self.submit(id);
        self.wait_grant(id);
        let t1 = monotonic_ns();
        self.complete(id, t1);
        Some(t1.saturating_sub(t0))
    }
}
