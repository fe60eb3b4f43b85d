//! Decision cost inside the daemon: `Daemon::receive` of one `Submit{exec: Device}` and its
//! `Completed` (plus draining the outbox), with 4 and 64 connected fake devices taking turns,
//! under the policies none, timegraph PRT, timegraph HT and fair. Pure core: no sockets, time
//! is an input.
//!
//! Besides criterion's own output, the means go to `target/daemon-decision-bench.json` and its
//! figure `.svg` (a line per policy against the devices).
//!
//! `cargo bench -p vgpu-schedd --bench decision`

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group};
use vgpu_schedd::daemon::{ConnId, Daemon, DaemonConfig, Peer};
use vgpu_schedd::proto::{self, Exec, Msg, PROTOCOL_VERSION, VmName};
use vgpu_scheduler::model::PrioPolicy;
use vgpu_scheduler::policy::fair::FairConfig;
use vgpu_scheduler::policy::timegraph::TimeGraphConfig;
use vgpu_scheduler::{CostSignature, GroupId, GroupKind, PolicyConfig};

/// Simulated time between two groups, ns.
const STEP_NS: u64 = 2_000;
/// Simulated GPU time of one group, ns.
const BUSY_NS: u64 = 1_000;

fn bytes(msg: &Msg) -> Vec<u8> {
    let mut b = Vec::new();
    proto::encode(msg, &mut b);
    b
}

fn policies() -> Vec<(&'static str, PolicyConfig)> {
    let tg = |sched| {
        PolicyConfig::TimeGraph(TimeGraphConfig {
            sched,
            ..TimeGraphConfig::default()
        })
    };
    vec![
        ("none", PolicyConfig::None),
        ("timegraph_prt", tg(PrioPolicy::Prt)),
        ("timegraph_ht", tg(PrioPolicy::Ht)),
        ("fair", PolicyConfig::Fair(FairConfig::default())),
    ]
}

/// A daemon with `devices` connected devices; returns it and their connections.
fn setup(policy: PolicyConfig, devices: u32) -> (Daemon, Vec<ConnId>) {
    let config = DaemonConfig {
        policy,
        ..DaemonConfig::default()
    };
    let mut d = Daemon::new(0, config).expect("daemon");
    let mut conns = Vec::new();
    for i in 0..devices {
        let pid = 1000 + i;
        let c = d.connect(0, Peer { pid, uid: 0 });
        let hello = Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new(&format!("vm{i}")).expect("name"),
            device_pid: pid,
            qemu_pid: 0,
        };
        d.receive(0, c, &bytes(&hello));
        let out = d.drain();
        assert!(
            matches!(out.messages.first(), Some((to, Msg::Welcome { .. })) if *to == c),
            "no Welcome"
        );
        conns.push(c);
    }
    (d, conns)
}

fn bench(c: &mut Criterion) {
    let submit = bytes(&Msg::Submit {
        group: GroupId(1),
        context: 0,
        kind: GroupKind::Render,
        signature: CostSignature(1),
        cost_ns: 0,
        exec: Exec::Device,
    });
    let mut group = c.benchmark_group("daemon_receive_submit_completed");
    for (name, policy) in policies() {
        for devices in [4u32, 64] {
            let (mut d, conns) = setup(policy.clone(), devices);
            let mut now = 0u64;
            let mut turn = 0usize;
            group.bench_function(BenchmarkId::new(name, devices), |b| {
                b.iter(|| {
                    let conn = conns[turn % conns.len()];
                    turn = turn.wrapping_add(1);
                    now += STEP_NS;
                    d.receive(now, conn, black_box(&submit));
                    black_box(d.drain());
                    let completed = bytes(&Msg::Completed {
                        group: GroupId(1),
                        start: now,
                        finish: now + BUSY_NS,
                    });
                    d.receive(now + BUSY_NS, conn, black_box(&completed));
                    black_box(d.drain());
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);

/// criterion's `criterion_main!`, then the summary JSON and figure.
fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    let summary = vgpu_bench_report::criterion::Summary {
        name: "daemon-decision-bench",
        prefix: "daemon_receive_submit_completed",
        title: "vgpu-schedd's core: Submit + Completed received and the outbox drained, per policy",
        x_label: "connected devices (taking turns)",
        y_label: "µs per group (mean)",
        unit_ns: 1e3,
    };
    if let Err(e) = vgpu_bench_report::criterion::write_summary(&summary) {
        eprintln!("no summary: {e}");
    }
}
