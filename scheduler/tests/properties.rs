//! Property tests over random workloads: invariants every policy family must keep.
//!
//! A small driver plays the GPU: it runs the groups on the GPU-online list one at a time in
//! dispatch order (non-preemptive, like the simulator's engine), completes them after their
//! cost, delivers due timers, and checks an invariant after every scheduler call.

use proptest::prelude::*;
use vgpu_scheduler::model::{CpuHint, Enforcement, NS_PER_MS, NS_PER_US, Reserve};
use vgpu_scheduler::{
    CommandGroup, Decision, Event, GroupKind, PolicyConfig, Scheduler, Time, VgpuId, VgpuParams,
};

/// One vGPU of a random workload: its parameters and its groups as (arrival, cost).
#[derive(Debug, Clone)]
struct Tenant {
    params: VgpuParams,
    groups: Vec<(Time, Time)>,
    /// A backlogged tenant instead: (groups kept outstanding, cost of each). It submits the
    /// next group when one completes, as a guest with a bounded command queue does.
    closed_loop: Option<(usize, Time)>,
    /// CPU hints as (time, vCPUs running), in time order; none: the tenant never sends one.
    hints: Vec<(Time, bool)>,
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
    /// When each group id was submitted.
    submitted_at: std::collections::BTreeMap<u64, Time>,
    /// Per dispatched group: (vGPU, how long it waited in its queue).
    waits: Vec<(VgpuId, Time)>,
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
    for (t, ten) in tenants.iter().enumerate() {
        if let Some((depth, cost)) = ten.closed_loop {
            arrivals.extend((0..depth).map(|i| (0, t, i, cost)));
        }
    }
    arrivals.sort();
    let mut closed_next: Vec<usize> = tenants
        .iter()
        .map(|t| t.closed_loop.map_or(0, |(depth, _)| depth))
        .collect();
    let mut next_arrival = 0;
    // CPU hints in time order: (time, tenant, running).
    let mut hints: Vec<(Time, usize, bool)> = tenants
        .iter()
        .enumerate()
        .flat_map(|(t, ten)| ten.hints.iter().map(move |&(at, running)| (at, t, running)))
        .collect();
    hints.sort();
    let mut next_hint = 0;
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
        let hint = hints.get(next_hint).map(|h| h.0);
        let timer = s.next_deadline();
        let Some(t) = [finish, arrival, hint, timer].into_iter().flatten().min() else {
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
            let ten = v.index();
            if let Some((_, cost)) = tenants[ten].closed_loop {
                // The next group arrives as this one completes; keep `arrivals` sorted.
                let at = arrivals[next_arrival..].partition_point(|a| a.0 <= end) + next_arrival;
                arrivals.insert(at, (end, ten, closed_next[ten], cost));
                closed_next[ten] += 1;
            }
        } else if arrival == Some(t) {
            let (_, ten, i, cost) = arrivals[next_arrival];
            next_arrival += 1;
            let id = (ten as u64) << 32 | i as u64;
            costs.insert(id, cost);
            let g = CommandGroup::new(id, ids[ten], GroupKind::Load, cost / NS_PER_US);
            trace.submitted.push(id);
            trace.submitted_at.insert(id, now);
            record(&mut s, now, Event::Submitted(g), &mut out, &mut trace);
        } else if hint == Some(t) {
            let (_, ten, running) = hints[next_hint];
            next_hint += 1;
            let h = CpuHint {
                weight: 100,
                running,
                runnable: running,
                usage: 0,
            };
            record(
                &mut s,
                now,
                Event::CpuHint(ids[ten], h),
                &mut out,
                &mut trace,
            );
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
            let submitted = trace.submitted_at.get(&group.0).copied().unwrap_or(now);
            trace.waits.push((*vgpu, now - submitted));
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
            closed_loop: None,
            hints: Vec::new(),
        });
    prop::collection::vec(tenant, 1..max_vgpus)
}

fn config(toml_text: &str) -> PolicyConfig {
    toml::from_str(toml_text).unwrap()
}

/// Policies that never leave the GPU idle while a runnable vGPU has work queued. (Fair queuing
/// is left out on purpose: an idle vGPU within its grace holds t_sys down and may keep a busy
/// one suspended for up to the grace.)
const WORK_CONSERVING: &[&str] = &[
    "policy = \"none\"",
    "policy = \"timegraph\"\nsched = \"prt\"",
    "policy = \"timegraph\"\nsched = \"ht\"",
    "policy = \"pegasus\"\nmode = \"rr\"",
    "policy = \"pegasus\"\nmode = \"accc\"",
    "policy = \"vgris\"\nmode = \"sla\"",
];

/// Every policy family: each must complete every group of a finite workload (no starvation).
const ALL: &[&str] = &[
    "policy = \"none\"",
    "policy = \"timegraph\"\nsched = \"prt\"",
    "policy = \"timegraph\"\nsched = \"ht\"",
    "policy = \"pegasus\"\nmode = \"rr\"",
    "policy = \"pegasus\"\nmode = \"accc\"",
    "policy = \"pegasus\"\nmode = \"slaf\"",
    "policy = \"pegasus\"\nmode = \"cosched\"",
    "policy = \"vgris\"\nmode = \"sla\"",
    "policy = \"vgris\"\nmode = \"share\"",
    "policy = \"fair\"",
    "policy = \"fair\"\naccounting = \"sampling\"",
];

/// Long enough for any generated workload to drain under any policy.
const LIMIT: Time = 60_000 * NS_PER_MS;

fn completed(s: &Scheduler, i: usize) -> u64 {
    s.vgpu(VgpuId(i as u32)).unwrap().account().completed
}

/// Backlogged tenants, each keeping `depth` groups of its own cost outstanding.
fn backlogged(weights: &[u32], costs_us: &[u64], depth: usize) -> Vec<Tenant> {
    weights
        .iter()
        .zip(costs_us)
        .map(|(&weight, &cost)| Tenant {
            params: VgpuParams {
                weight,
                ..VgpuParams::default()
            },
            groups: Vec::new(),
            closed_loop: Some((depth, cost * NS_PER_US)),
            hints: Vec::new(),
        })
        .collect()
}

/// Closed-loop tenants for the bounded wait: 2 to 5 of them, each keeping 1 to 3 groups of
/// 50 µs to 2 ms outstanding (at most 30 ms in all, one credit period), with CPU hints that
/// flip at random times in the first two seconds; a tenant whose flips are all `false` never
/// runs.
fn cpu_tenants() -> impl Strategy<Value = Vec<Tenant>> {
    let tenant = (
        1usize..=3,
        50u64..=2_000,
        any::<bool>(),
        prop::collection::vec((0u64..2_000, any::<bool>()), 0..20),
    )
        .prop_map(|(depth, cost_us, never, flips)| {
            let mut hints: Vec<(Time, bool)> = flips
                .into_iter()
                .map(|(at_ms, running)| (at_ms * NS_PER_MS, running && !never))
                .collect();
            hints.sort();
            Tenant {
                params: VgpuParams::default(),
                groups: Vec::new(),
                closed_loop: Some((depth, cost_us * NS_PER_US)),
                hints,
            }
        });
    prop::collection::vec(tenant, 2..=5)
}

/// GPU time shares of the tenants at the end of a run.
fn shares(s: &Scheduler, n: usize) -> Vec<f64> {
    let times: Vec<f64> = (0..n)
        .map(|i| s.vgpu(VgpuId(i as u32)).unwrap().account().gpu_time as f64)
        .collect();
    let total: f64 = times.iter().sum();
    times.iter().map(|t| t / total).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn work_conserving_policies_never_idle_with_work(ts in tenants(6, 40)) {
        for text in WORK_CONSERVING {
            let (_, trace) = drive(&config(text), &ts, LIMIT);
            prop_assert!(trace.idle_with_work.is_empty(), "{text}: idle at {:?}", trace.idle_with_work);
        }
    }

    #[test]
    fn no_policy_starves_a_vgpu(ts in tenants(6, 40)) {
        for text in ALL {
            let (s, _) = drive(&config(text), &ts, LIMIT);
            for (i, t) in ts.iter().enumerate() {
                prop_assert_eq!(completed(&s, i), t.groups.len() as u64, "{}: vGPU {}", text, i);
            }
        }
    }

    #[test]
    fn pegasus_cosched_bounds_every_wait(ts in cpu_tenants(), always in 0usize..5) {
        // One tenant is on a CPU from the start and never leaves it.
        let mut ts = ts;
        let n = ts.len();
        ts[always % n].hints = vec![(0, true)];
        let limit_ms = 50;
        let text = format!("policy = \"pegasus\"\nmode = \"cosched\"\nmax_wait = {}", limit_ms * NS_PER_MS);
        let (_, trace) = drive(&config(&text), &ts, 3_000 * NS_PER_MS);
        // The limit, plus the group on the GPU when it expires, plus one tick (10 ms, the
        // default) per tenant: an overdue tenant holds the GPU for a tick, the holder's tick
        // may run when the limit expires, and every other tenant may be overdue first.
        let tick_ms = 10;
        let bound = (limit_ms + tick_ms * n as u64) * NS_PER_MS + 2 * NS_PER_MS;
        for &(v, wait) in &trace.waits {
            prop_assert!(wait <= bound, "{v:?} waited {wait} ns > {bound}");
        }
        prop_assert!(trace.waits.len() > 100);
    }

    #[test]
    fn fcfs_dispatches_in_arrival_order(ts in tenants(6, 40)) {
        let (_, trace) = drive(&config("policy = \"none\""), &ts, LIMIT);
        prop_assert_eq!(&trace.dispatched, &trace.submitted);
        // Runs never overlap on the non-preemptive GPU.
        let mut all: Vec<(Time, Time)> = trace.runs.iter().flatten().copied().collect();
        all.sort();
        for pair in all.windows(2) {
            prop_assert!(pair[0].1 <= pair[1].0);
        }
    }

    #[test]
    fn timegraph_never_dispatches_below_a_waiting_higher_priority(ts in tenants(6, 40)) {
        for sched in ["prt", "ht"] {
            let text = format!("policy = \"timegraph\"\nsched = \"{sched}\"");
            let (_, trace) = drive(&config(&text), &ts, LIMIT);
            for (at, v, waiting) in &trace.dispatches {
                let mine = ts[v.index()].params.priority;
                for w in waiting {
                    let theirs = ts[w.index()].params.priority;
                    prop_assert!(mine >= theirs, "{sched} at {at}: {v:?} ({mine}) went before {w:?} ({theirs})");
                }
            }
        }
    }

    #[test]
    fn posterior_enforcement_overruns_by_at_most_one_group(
        ts in tenants(5, 40),
        c_ms in 1u64..10,
        t_extra_ms in 0u64..40,
    ) {
        // Every tenant holds a PE reserve C every T; admission may send some to Background,
        // so the limit is generous enough to admit them all.
        let (c, t) = (c_ms * NS_PER_MS, (c_ms + t_extra_ms) * NS_PER_MS);
        let ts: Vec<Tenant> = ts
            .into_iter()
            .map(|mut ten| {
                ten.params.reserve = Some(Reserve { c, t, enforcement: Enforcement::Pe, shared: None });
                ten
            })
            .collect();
        let text = "policy = \"timegraph\"\nsched = \"prt\"\nadmission_limit = 1000.0";
        let (_, trace) = drive(&config(text), &ts, LIMIT);
        for (i, runs) in trace.runs.iter().enumerate() {
            let max_cost = ts[i].groups.iter().map(|g| g.1).max().unwrap_or(0);
            let mut used: Time = 0;
            for &(start, finish) in runs {
                // Everything that started by `start` fits the budget handed out by then
                // (one C at attach plus one per elapsed period) plus one group's overrun.
                used += finish - start;
                let budget = (start / t + 1) * c;
                prop_assert!(used <= budget + max_cost, "vGPU {i}: used {used} > {budget} + {max_cost}");
            }
        }
    }

    #[test]
    fn fair_queuing_holds_weighted_shares(
        weights in prop::collection::vec(1u32..5, 2..5),
        costs in prop::collection::vec(50u64..3_000, 4),
    ) {
        let weights: Vec<u32> = weights.iter().map(|w| w * 256).collect();
        let ts = backlogged(&weights, &costs[..weights.len()], 2);
        let limit = 4_000 * NS_PER_MS;
        let (s, _) = drive(&config("policy = \"fair\""), &ts, limit);
        let total: u32 = weights.iter().sum();
        for (i, share) in shares(&s, ts.len()).into_iter().enumerate() {
            let want = f64::from(weights[i]) / f64::from(total);
            prop_assert!((share - want).abs() <= 0.02, "vGPU {i}: {share:.4} vs {want:.4}");
        }
    }

    #[test]
    fn pegasus_credits_give_proportional_shares(
        weights in prop::collection::vec(1u32..5, 2..5),
        cost in 100u64..3_000,
    ) {
        let weights: Vec<u32> = weights.iter().map(|w| w * 256).collect();
        let ts = backlogged(&weights, &vec![cost; weights.len()], 2);
        let limit = 4_000 * NS_PER_MS;
        let (s, _) = drive(&config("policy = \"pegasus\"\nmode = \"accc\""), &ts, limit);
        let total: u32 = weights.iter().sum();
        for (i, share) in shares(&s, ts.len()).into_iter().enumerate() {
            let want = f64::from(weights[i]) / f64::from(total);
            prop_assert!((share - want).abs() <= 0.02, "vGPU {i}: {share:.4} vs {want:.4}");
        }
    }
}
