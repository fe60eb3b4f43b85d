//! Cost of one scheduling decision per policy family at 4, 16, 64 and 256 vGPUs.
//!
//! Every vGPU is kept backlogged. One iteration is one group's life at steady state: the oldest
//! group on the GPU completes (the policy accounts it and picks the next dispatch), its vGPU
//! submits a new group, and a due timer (replenishment, credit period, controller) is delivered.
//! That is two or three events and one dispatch decision. The GPU is simulated by completing
//! groups in dispatch order after a fixed cost.
//!
//! Besides criterion's own output, the means go to `target/decision-bench.json` and its figure
//! `.svg` (a line per policy against the vGPUs).
//!
//! `cargo bench -p vgpu-scheduler --bench decision`

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group};
use vgpu_scheduler::model::{Enforcement, NS_PER_MS, NS_PER_US, Reserve};
use vgpu_scheduler::{
    CommandGroup, Decision, Event, GroupKind, PolicyConfig, Scheduler, Time, VgpuId, VgpuParams,
};

/// GPU time of every group.
const COST: Time = 500 * NS_PER_US;
/// Groups each vGPU keeps submitted.
const BACKLOG: u64 = 2;

/// The policies measured, as the scenario files write them.
const POLICIES: &[(&str, &str)] = &[
    ("none", "policy = \"none\""),
    ("timegraph-prt", "policy = \"timegraph\"\nsched = \"prt\""),
    ("timegraph-ht", "policy = \"timegraph\"\nsched = \"ht\""),
    ("pegasus-accc", "policy = \"pegasus\"\nmode = \"accc\""),
    (
        "pegasus-cosched",
        "policy = \"pegasus\"\nmode = \"cosched\"",
    ),
    ("pegasus-slaf", "policy = \"pegasus\"\nmode = \"slaf\""),
    ("pegasus-augc", "policy = \"pegasus\"\nmode = \"augc\""),
    ("vgris-sla", "policy = \"vgris\"\nmode = \"sla\""),
    ("vgris-share", "policy = \"vgris\"\nmode = \"share\""),
    ("fair-exact", "policy = \"fair\""),
    (
        "fair-sampling",
        "policy = \"fair\"\naccounting = \"sampling\"",
    ),
];

struct Bench {
    sched: Scheduler,
    now: Time,
    next_id: u64,
    out: Vec<Decision>,
}

/// Parameters of vGPU `i` of `n`: mixed priorities and weights, and every other vGPU holds a
/// TimeGraph reserve (PE or AE) so that budgets, replenishment and prediction are exercised.
fn params(i: usize, n: usize) -> VgpuParams {
    let period = 100 * NS_PER_MS;
    let reserve = |enforcement| Reserve {
        c: period / (2 * n as u64),
        t: period,
        enforcement,
        shared: None,
    };
    VgpuParams {
        reserve: match i % 4 {
            0 => Some(reserve(Enforcement::Pe)),
            2 => Some(reserve(Enforcement::Ae)),
            _ => None,
        },
        name: format!("vm{i}"),
        priority: (i % 8) as u32,
        weight: 128 << (i % 4),
        target_fps: Some(30.0),
        slo: Some(1_000_000),
        ..VgpuParams::default()
    }
}

impl Bench {
    fn new(config: &PolicyConfig, vgpus: usize) -> Self {
        let mut sched = Scheduler::new(config.build(), 1);
        let mut out = Vec::new();
        let mut next_id = 0;
        for i in 0..vgpus {
            let v = sched
                .add_vgpu(0, params(i, vgpus), &mut out)
                .expect("add vGPU");
            for _ in 0..BACKLOG {
                let g = CommandGroup::new(next_id, v, GroupKind::Load, 1);
                next_id += 1;
                sched
                    .handle(0, Event::Submitted(g), &mut out)
                    .expect("submit");
            }
        }
        let mut b = Bench {
            sched,
            now: 0,
            next_id,
            out,
        };
        // Let budgets, credits and virtual times settle before measuring.
        for _ in 0..vgpus * 8 {
            b.step();
        }
        b
    }

    fn step(&mut self) {
        self.out.clear();
        let due = self.sched.next_deadline().filter(|&t| t <= self.now + COST);
        if let Some(t) = due {
            self.now = self.now.max(t);
            self.sched
                .handle(self.now, Event::Timer, &mut self.out)
                .expect("timer");
        }
        let Some(head) = self.sched.online().first().map(|o| o.group.clone()) else {
            // Every vGPU is out of budget: jump to the next deadline.
            if let Some(t) = self.sched.next_deadline() {
                self.now = self.now.max(t);
                self.sched
                    .handle(self.now, Event::Timer, &mut self.out)
                    .expect("timer");
            }
            return;
        };
        let start = self.now;
        self.now += COST;
        let done = Event::Completed {
            vgpu: head.vgpu,
            group: head.id,
            start,
            finish: self.now,
        };
        self.sched
            .handle(self.now, done, &mut self.out)
            .expect("complete");
        self.resubmit(head.vgpu);
    }

    fn resubmit(&mut self, v: VgpuId) {
        let g = CommandGroup::new(self.next_id, v, GroupKind::Load, 1);
        self.next_id += 1;
        self.sched
            .handle(self.now, Event::Submitted(g), &mut self.out)
            .expect("submit");
    }
}

fn decision_cost(c: &mut Criterion) {
    for (label, toml) in POLICIES {
        let config: PolicyConfig = toml::from_str(toml).expect("policy config");
        let mut group = c.benchmark_group(format!("decision/{label}"));
        for vgpus in [4, 16, 64, 256] {
            let mut bench = Bench::new(&config, vgpus);
            group.bench_with_input(BenchmarkId::from_parameter(vgpus), &vgpus, |b, _| {
                b.iter(|| {
                    bench.step();
                    black_box(bench.out.len())
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, decision_cost);

/// criterion's `criterion_main!`, then the summary JSON and figure.
fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    let summary = vgpu_bench_report::criterion::Summary {
        name: "decision-bench",
        prefix: "decision/",
        title: "one scheduling decision at steady state (a completion, a submit, a due timer), per policy",
        x_label: "backlogged vGPUs",
        y_label: "µs per decision (mean)",
        unit_ns: 1e3,
    };
    if let Err(e) = vgpu_bench_report::criterion::write_summary(&summary) {
        eprintln!("no summary: {e}");
    }
}
