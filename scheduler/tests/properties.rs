//! Property tests over random workloads: invariants every policy family must keep.
//!
//! A small driver plays the GPU: it runs the groups on the GPU-online list one at a time in
//! dispatch order (non-preemptive, like the simulator's engine), completes them after their
//! cost, delivers due timers, and checks an invariant after every scheduler call.

use proptest::prelude::*;
use vgpu_scheduler::model::{NS_PER_MS, NS_PER_US};
use vgpu_scheduler::{
    CommandGroup, Decision, Event, GroupKind, PolicyConfig, Scheduler, Time, VgpuId, VgpuParams,
};

/// One vGPU of a random workload: its parameters and its groups as (arrival, cost).
#[derive(Debug, Clone)]
struct Tenant {
    params: VgpuParams,
    groups: Vec<(Time, Time)>,
}

/// What the driver saw: every dispatch with the scheduler's state just before it.
#[derive(Debug, Default)]
struct Trace {
    /// (time, dispatched vGPU, vGPUs that had queued work and were not suspended just before).
    dispatches: Vec<(Time, VgpuId, Vec<VgpuId>)>,
    /// Group ids in the order they were submitted.
    submitted: Vec<u64>,
    /// Group ids in the order they were dispatched.
    dispatched: Vec<u64>,
    /// Per vGPU: (start, finish) of each completed group.
    runs: Vec<Vec<(Time, Time)>>,
    /// Times at which the GPU sat idle while a runnable vGPU had queued work.
    idle_with_work: Vec<Time>,
}

/// Runs `tenants` under `config` until every group completed or `limit` passed.
fn drive(config: &PolicyConfig, tenants: &[Tenant], limit: Time) -> (Scheduler, Trace) {
    let mut s = Scheduler::new(config.build(), 1);
    let mut out = Vec::new();
    let ids: Vec<VgpuId> = tenants
        .iter()
        .map(|t| s.add_vgpu(0, t.params.clone(), &mut out).unwrap())
        .collect();
    let mut trace = Trace {
        runs: vec![Vec::new(); tenants.len()],
        ..Trace::default()
    };
    // Arrivals in time order: (arrival, tenant, group index, cost).
    let mut arrivals: Vec<(Time, usize, usize, Time)> = tenants
        .iter()
        .enumerate()
        .flat_map(|(t, ten)| {
            ten.groups
                .iter()
                .enumerate()
                .map(move |(i, &(at, cost))| (at, t, i, cost))
        })
        .collect();
    arrivals.sort();
    let mut next_arrival = 0;
    let mut costs = std::collections::BTreeMap::new();
    let mut gpu_free_at: Time = 0;
    let mut running: Option<(u64, VgpuId, Time, Time)> = None;
    let mut now: Time = 0;
    let mut steps = 0;
    loop {
        steps += 1;
        assert!(steps < 1_000_000, "driver did not terminate");
        // Start the next online group if the GPU is free.
        if running.is_none()
            && let Some(o) = s.online().first()
        {
            let cost = costs[&o.group.id.0];
            let start = now.max(gpu_free_at);
            running = Some((o.group.id.0, o.group.vgpu, start, start + cost));
        }
        let finish = running.map(|r| r.3);
        let arrival = arrivals.get(next_arrival).map(|a| a.0);
        let timer = s.next_deadline();
        let Some(t) = [finish, arrival, timer].into_iter().flatten().min() else {
            break;
        };
        if t > limit {
            break;
        }
        now = now.max(t);
        out.clear();
        if finish == Some(t) {
            let (id, v, start, end) = running.take().unwrap();
            let ev = Event::Completed {
                vgpu: v,
                group: vgpu_scheduler::GroupId(id),
                start,
                finish: end,
            };
            record(&mut s, now, ev, &mut out, &mut trace);
            trace.runs[v.index()].push((start, end));
            gpu_free_at = end;
        } else if arrival == Some(t) {
            let (_, ten, i, cost) = arrivals[next_arrival];
            next_arrival += 1;
            let id = (ten as u64) << 32 | i as u64;
            costs.insert(id, cost);
            let g = CommandGroup::new(id, ids[ten], GroupKind::Load, cost / NS_PER_US);
            trace.submitted.push(id);
            record(&mut s, now, Event::Submitted(g), &mut out, &mut trace);
        } else {
            record(&mut s, now, Event::Timer, &mut out, &mut trace);
        }
        if running.is_none() && s.online().is_empty() && runnable_with_work(&s).next().is_some() {
            trace.idle_with_work.push(now);
        }
    }
    (s, trace)
}

fn runnable_with_work(s: &Scheduler) -> impl Iterator<Item = VgpuId> + '_ {
    (0..64u32).map(VgpuId).filter(|&v| {
        s.vgpu(v)
            .is_some_and(|st| st.queued() > 0 && !st.suspended())
    })
}

fn record(s: &mut Scheduler, now: Time, ev: Event, out: &mut Vec<Decision>, trace: &mut Trace) {
    let waiting: Vec<VgpuId> = runnable_with_work(s).collect();
    s.handle(now, ev, out).unwrap();
    for d in out.iter() {
        if let Decision::Dispatch { vgpu, group, .. } = d {
            trace.dispatches.push((now, *vgpu, waiting.clone()));
            trace.dispatched.push(group.0);
        }
    }
}

fn tenants(max_vgpus: usize, max_groups: usize) -> impl Strategy<Value = Vec<Tenant>> {
    let tenant = (
        0u32..4,
        1u32..4,
        prop::collection::vec((0u64..50, 50u64..5_000), 1..max_groups),
    )
        .prop_map(|(priority, weight, groups)| Tenant {
            params: VgpuParams {
                priority,
                weight: weight * 256,
                ..VgpuParams::default()
            },
            groups: groups
                .into_iter()
                .map(|(at_ms, cost_us)| (at_ms * NS_PER_MS, cost_us * NS_PER_US))
                .collect(),
        });
    prop::collection::vec(tenant, 1..max_vgpus)
}

fn config(toml_text: &str) -> PolicyConfig {
    toml::from_str(toml_text).unwrap()
}

/// Work-conserving policies never leave the GPU idle while a runnable vGPU has work queued, and
/// complete every group.
const WORK_CONSERVING: &[&str] = &["policy = \"none\""];

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn work_conserving_policies_never_idle_with_work(ts in tenants(6, 40)) {
        for text in WORK_CONSERVING {
            let (s, trace) = drive(&config(text), &ts, 10_000 * NS_PER_MS);
            prop_assert!(trace.idle_with_work.is_empty(), "{text}: idle at {:?}", trace.idle_with_work);
            for (i, t) in ts.iter().enumerate() {
                let done = s.vgpu(VgpuId(i as u32)).unwrap().account().completed;
                prop_assert_eq!(done, t.groups.len() as u64, "{}", text);
            }
        }
    }

    #[test]
    fn fcfs_dispatches_in_arrival_order(ts in tenants(6, 40)) {
        let (_, trace) = drive(&config("policy = \"none\""), &ts, 10_000 * NS_PER_MS);
        prop_assert_eq!(&trace.dispatched, &trace.submitted);
        // Runs never overlap on the non-preemptive GPU.
        let mut all: Vec<(Time, Time)> = trace.runs.iter().flatten().copied().collect();
        all.sort();
        for pair in all.windows(2) {
            prop_assert!(pair[0].1 <= pair[1].0);
        }
    }
}
