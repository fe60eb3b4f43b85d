//! Disengaged fair queuing (NEON, Menychtas et al.; LoGA, SYSTOR 2017 §2.3–§4; DESIGN §5).
//!
//! Every vGPU that is not suspended holds an unbounded lease, so its groups reach the GPU
//! without a grant round trip. The policy keeps a virtual time per vGPU, advanced by the GPU
//! time its groups used divided by its weight, and a system virtual time `t_sys`: the smallest
//! virtual time over the active vGPUs. A vGPU more than `threshold_ns` ahead of `t_sys` is
//! suspended (its lease is withdrawn) until `t_sys` catches up. A vGPU that was idle is brought
//! up to `t_sys` when it becomes active again, so idling does not save up GPU time.
//!
//! Accounting is exact by default: each completion carries the group's start and finish times
//! from its fence. The `sampling` variant models NEON's accounting, which cannot see
//! per-group times: after every free-run period it drains the GPU, gives each active vGPU the
//! GPU alone for a sampling window to measure its mean group cost, and charges that estimate
//! for every group it completes while free-running. The drain and the exclusive windows leave
//! the GPU idle or under-used; that overhead is what LoGA measured against.

use std::collections::{BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::core::{Cx, VgpuState};
use crate::model::{Budget, DEFAULT_WEIGHT, NS_PER_MS, NS_PER_US, Nanos, Time, VgpuId};
use crate::policy::ready::ReadySet;
use crate::policy::{Completion, Policy, earliest};

/// Shortest sampling period or sampling window accepted (longer configured values are kept).
/// A zero-length phase would make the phase machine ask for a timer at the current time after
/// every timer, so the caller could spin without time passing.
pub const MIN_PHASE_NS: Nanos = 100 * NS_PER_US;

/// How the policy learns the GPU time each vGPU used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Accounting {
    /// Exact per-group cost from each completion's fence start and finish times (LoGA's goal
    /// reached directly): no draining, no sampling.
    #[default]
    Exact,
    /// NEON's sampling accounting: drain, sample each vGPU alone, charge estimates.
    Sampling,
}

/// Global parameters of the fair-queuing policy (`policy = "fair"`). All times are in
/// nanoseconds. Virtual time is measured in GPU nanoseconds of a vGPU with the default weight
/// (256): a vGPU of weight `w` advances by `cost * 256 / w`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FairConfig {
    /// `accounting`: `"exact"` (default) or `"sampling"`.
    pub accounting: Accounting,
    /// `threshold_ns`: how far (virtual ns) a vGPU may run ahead of `t_sys` before it is
    /// suspended. Bounds the unfairness; keep it well above `idle_grace_ns`, or a vGPU can be
    /// held back while another sits idle within its grace. Default 5 ms.
    pub threshold_ns: Nanos,
    /// `idle_grace_ns`: how long a vGPU with nothing queued or in flight still counts as active
    /// (holds `t_sys` and keeps its virtual time). Covers the round trip between a completion
    /// and the guest's next submission; shorter than the think time of light loads, which then
    /// drop out and cannot stall others. Default 500 µs.
    pub idle_grace_ns: Nanos,
    /// `sampling_period_ns`: free-run time between two sampling phases (sampling only; at least
    /// [`MIN_PHASE_NS`]). Default 50 ms.
    pub sampling_period_ns: Nanos,
    /// `sampling_window_ns`: how long each active vGPU runs alone per sampling phase; also the
    /// longest the policy waits for the GPU to drain (sampling only; at least
    /// [`MIN_PHASE_NS`]). Default 5 ms.
    pub sampling_window_ns: Nanos,
}

impl Default for FairConfig {
    fn default() -> Self {
        FairConfig {
            accounting: Accounting::Exact,
            threshold_ns: 5 * NS_PER_MS,
            idle_grace_ns: 500 * NS_PER_US,
            sampling_period_ns: 50 * NS_PER_MS,
            sampling_window_ns: 5 * NS_PER_MS,
        }
    }
}

/// Per-vGPU state.
#[derive(Debug, Clone, Default)]
struct Slot {
    /// Virtual time (weighted GPU ns).
    vtime: u64,
    /// GPU time the accounting charged (unweighted ns): exact, or estimated when sampling.
    charged: Nanos,
    /// Suspended for running more than the threshold ahead of `t_sys`.
    over: bool,
    /// Idle, but active until this time (the idle grace).
    idle_until: Option<Time>,
    /// Sampling: the mean group cost measured in the last useful sampling window.
    estimate: Option<Nanos>,
    /// Sampling: groups completed before any estimate existed, charged once one does.
    unestimated: u64,
    /// Sampling: had work since the last sampling phase began (it gets a window).
    busy: bool,
    /// Sampling: GPU time of the groups completed in the current window.
    window_cost: Nanos,
    /// Sampling: groups completed in the current window.
    window_groups: u64,
}

/// Where the sampling cycle stands. Exact accounting stays in `Free` forever.
#[derive(Debug, Clone)]
enum Phase {
    /// Every vGPU within the threshold runs under its lease.
    Free {
        /// When the next sampling phase starts (`None`: never, or not yet scheduled).
        next_sample: Option<Time>,
    },
    /// Every vGPU is suspended until the GPU runs empty or `until`; then the next window.
    Drain {
        /// Give up waiting for the GPU to empty at this time.
        until: Time,
        /// vGPUs still to sample.
        queue: VecDeque<VgpuId>,
    },
    /// One vGPU has the GPU alone, engaged, until `until`.
    Window {
        /// The vGPU being sampled.
        vgpu: VgpuId,
        /// The end of its window.
        until: Time,
        /// vGPUs still to sample after it.
        queue: VecDeque<VgpuId>,
    },
}

/// The disengaged fair-queuing policy.
#[derive(Debug)]
pub struct Fair {
    config: FairConfig,
    slots: Vec<Option<Slot>>,
    /// Active vGPUs by virtual time: its first key is the candidate for `t_sys`.
    active: ReadySet<u64>,
    /// vGPUs suspended for being ahead, by virtual time: released from the front.
    over: ReadySet<u64>,
    /// vGPUs with queued groups that may dispatch, by virtual time (engaged `pick`).
    ready: ReadySet<u64>,
    /// Idle-grace expiries.
    grace: BTreeSet<(Time, VgpuId)>,
    /// System virtual time; never decreases.
    t_sys: u64,
    phase: Phase,
    /// Sampling: the vGPU whose completions are being measured.
    sampled: Option<VgpuId>,
}

impl Fair {
    /// A policy with `config`; sampling phases shorter than [`MIN_PHASE_NS`] are lengthened.
    pub fn new(mut config: FairConfig) -> Self {
        config.sampling_period_ns = config.sampling_period_ns.max(MIN_PHASE_NS);
        config.sampling_window_ns = config.sampling_window_ns.max(MIN_PHASE_NS);
        Fair {
            config,
            slots: Vec::new(),
            active: ReadySet::default(),
            over: ReadySet::default(),
            ready: ReadySet::default(),
            grace: BTreeSet::new(),
            t_sys: 0,
            phase: Phase::Free { next_sample: None },
            sampled: None,
        }
    }

    fn slot(&self, v: VgpuId) -> Option<&Slot> {
        self.slots.get(v.index()).and_then(Option::as_ref)
    }

    fn slot_mut(&mut self, v: VgpuId) -> Option<&mut Slot> {
        self.slots.get_mut(v.index()).and_then(Option::as_mut)
    }

    fn sampling(&self) -> bool {
        self.config.accounting == Accounting::Sampling
    }

    fn limit(&self) -> u64 {
        self.t_sys.saturating_add(self.config.threshold_ns)
    }

    /// True if the vGPU may dispatch now: within the threshold and let through by the phase.
    fn allowed(&self, v: VgpuId) -> bool {
        let Some(slot) = self.slot(v) else {
            return false;
        };
        !slot.over
            && match &self.phase {
                Phase::Free { .. } => true,
                Phase::Drain { .. } => false,
                Phase::Window { vgpu, .. } => *vgpu == v,
            }
    }

    /// Makes the core's suspension and lease of `v` match what the policy allows.
    fn sync(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        if self.slot(v).is_none() {
            return;
        }
        if self.allowed(v) {
            cx.resume(v);
            if matches!(self.phase, Phase::Free { .. }) {
                cx.lease(v, None, None);
            } else {
                // Sampling windows trap every submission (engaged).
                cx.revoke(v);
            }
        } else {
            cx.suspend(v);
        }
        self.reindex(cx, v);
    }

    /// Puts `v` in the engaged ready set iff it has queued groups and may dispatch.
    fn reindex(&mut self, cx: &Cx<'_>, v: VgpuId) {
        let runnable = cx.vgpu(v).is_some_and(|s| s.queued() > 0 && !s.suspended());
        match self.slot(v) {
            Some(slot) if runnable => self.ready.insert(v, slot.vtime),
            _ => {
                self.ready.remove(v);
            }
        }
    }

    /// Raises `t_sys` to the smallest active virtual time and releases the vGPUs it caught up.
    /// With no active vGPU nobody is held back by anyone: every suspended vGPU is released
    /// (`t_sys` stays, so the others keep their place when they come back). A suspended device
    /// holds its work without asking, so it never becomes active by itself; without this it
    /// would wait for another VM to come back before it could run again.
    fn refresh(&mut self, cx: &mut Cx<'_>) {
        if let Some((min, _)) = self.active.first() {
            self.t_sys = self.t_sys.max(min);
        }
        let limit = if self.active.is_empty() {
            u64::MAX
        } else {
            self.limit()
        };
        // Each turn removes one entry: bounded by the number of vGPUs.
        while let Some((vtime, v)) = self.over.first() {
            if vtime > limit {
                break;
            }
            self.over.remove(v);
            if let Some(slot) = self.slot_mut(v) {
                slot.over = false;
            }
            self.sync(cx, v);
        }
    }

    /// Re-evaluates everything that depends on `v`'s virtual time or activity.
    fn settle(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        let Some(slot) = self.slot(v) else {
            self.refresh(cx);
            return;
        };
        let (vtime, over) = (slot.vtime, slot.over);
        if self.active.contains(v) {
            self.active.insert(v, vtime);
        }
        if over {
            self.over.insert(v, vtime);
        }
        self.refresh(cx);
        if !over && vtime > self.limit() {
            if let Some(slot) = self.slot_mut(v) {
                slot.over = true;
            }
            self.over.insert(v, vtime);
            self.sync(cx, v);
        }
        self.reindex(cx, v);
    }

    /// Charges `gpu` ns of GPU time to `v`: virtual time advances by `gpu * 256 / weight`.
    fn charge(&mut self, cx: &Cx<'_>, v: VgpuId, gpu: Nanos) {
        let weight = cx.vgpu(v).map_or(DEFAULT_WEIGHT, |s| s.params().weight);
        let scaled = u128::from(gpu) * u128::from(DEFAULT_WEIGHT) / u128::from(weight.max(1));
        let delta = u64::try_from(scaled).unwrap_or(u64::MAX);
        if let Some(slot) = self.slot_mut(v) {
            slot.vtime = slot.vtime.saturating_add(delta);
            slot.charged = slot.charged.saturating_add(gpu);
        }
    }

    /// `v` has work: cancel its idle grace, or bring it up to `t_sys` if it was inactive.
    fn activate(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        let t_sys = self.t_sys;
        let was_active = self.active.contains(v);
        let Some(slot) = self.slot_mut(v) else { return };
        slot.busy = true;
        let grace = slot.idle_until.take();
        if !was_active {
            slot.vtime = slot.vtime.max(t_sys);
        }
        let vtime = slot.vtime;
        if let Some(t) = grace {
            self.grace.remove(&(t, v));
        }
        if !was_active {
            self.active.insert(v, vtime);
        }
        self.settle(cx, v);
    }

    /// Starts `v`'s idle grace (or drops it from the active set) if it has nothing to do.
    fn maybe_idle(&mut self, cx: &Cx<'_>, v: VgpuId) {
        let idle = cx
            .vgpu(v)
            .is_none_or(|s| s.queued() == 0 && s.in_flight() == 0);
        if !idle || !self.active.contains(v) {
            return;
        }
        let until = cx.now().saturating_add(self.config.idle_grace_ns);
        let Some(slot) = self.slot_mut(v) else { return };
        if slot.idle_until.is_some() {
            return;
        }
        if until <= cx.now() {
            self.active.remove(v);
        } else {
            slot.idle_until = Some(until);
            self.grace.insert((until, v));
        }
    }

    /// Ends the idle graces that ran out: those vGPUs stop holding `t_sys`.
    fn expire(&mut self, cx: &mut Cx<'_>) {
        let now = cx.now();
        // Each turn removes one entry: bounded by the number of vGPUs.
        while let Some(&(t, v)) = self.grace.first() {
            if t > now {
                break;
            }
            self.grace.remove(&(t, v));
            if let Some(slot) = self.slot_mut(v) {
                slot.idle_until = None;
            }
            self.active.remove(v);
        }
        self.refresh(cx);
    }

    /// Sampling: the free-run period ended; suspend everyone and drain the GPU. Every vGPU
    /// that had work since the last sampling phase and is within the threshold gets a window.
    fn start_sampling(&mut self, cx: &mut Cx<'_>) {
        let now = cx.now();
        let ids = cx.vgpu_ids();
        let mut queue = VecDeque::new();
        for &v in &ids {
            let active = self.active.contains(v);
            if let Some(slot) = self.slot_mut(v) {
                if (slot.busy || active) && !slot.over {
                    queue.push_back(v);
                }
                slot.busy = false;
            }
        }
        if queue.is_empty() {
            self.phase = Phase::Free {
                next_sample: Some(now.saturating_add(self.config.sampling_period_ns)),
            };
            return;
        }
        self.phase = Phase::Drain {
            until: now.saturating_add(self.config.sampling_window_ns),
            queue,
        };
        for v in ids {
            self.sync(cx, v);
        }
        self.advance(cx);
    }

    /// Sampling: the current window is over; suspend its vGPU and drain.
    fn end_window(&mut self, cx: &mut Cx<'_>) {
        let until = cx.now().saturating_add(self.config.sampling_window_ns);
        let free = Phase::Free { next_sample: None };
        match std::mem::replace(&mut self.phase, free) {
            Phase::Window { vgpu, queue, .. } => {
                self.phase = Phase::Drain { until, queue };
                self.sync(cx, vgpu);
                self.advance(cx);
            }
            other => self.phase = other,
        }
    }

    /// Sampling: once the GPU is drained (or the drain timed out), open the next window or
    /// return to free-running.
    fn advance(&mut self, cx: &mut Cx<'_>) {
        let now = cx.now();
        match &self.phase {
            Phase::Drain { until, .. } if cx.online().is_empty() || now >= *until => {}
            _ => return,
        }
        self.finish_sample(cx);
        let free = Phase::Free { next_sample: None };
        let Phase::Drain { mut queue, .. } = std::mem::replace(&mut self.phase, free) else {
            return;
        };
        let next = std::iter::from_fn(|| queue.pop_front()).find(|&v| self.slot(v).is_some());
        match next {
            Some(vgpu) => {
                if let Some(slot) = self.slot_mut(vgpu) {
                    slot.window_cost = 0;
                    slot.window_groups = 0;
                }
                self.sampled = Some(vgpu);
                self.phase = Phase::Window {
                    vgpu,
                    until: now.saturating_add(self.config.sampling_window_ns),
                    queue,
                };
                self.sync(cx, vgpu);
            }
            None => {
                self.phase = Phase::Free {
                    next_sample: Some(now.saturating_add(self.config.sampling_period_ns)),
                };
                for v in cx.vgpu_ids() {
                    self.sync(cx, v);
                }
            }
        }
    }

    /// Sampling: turn the finished window's measurements into the vGPU's estimate and charge
    /// the groups that completed before it had one.
    fn finish_sample(&mut self, cx: &mut Cx<'_>) {
        let Some(v) = self.sampled.take() else { return };
        let Some(slot) = self.slot_mut(v) else { return };
        if slot.window_groups == 0 {
            return;
        }
        let estimate = slot.window_cost / slot.window_groups;
        slot.estimate = Some(estimate);
        let owed = estimate.saturating_mul(std::mem::take(&mut slot.unestimated));
        if owed > 0 {
            self.charge(cx, v, owed);
            self.settle(cx, v);
        }
    }
}

impl Policy for Fair {
    fn name(&self) -> &'static str {
        "fair"
    }

    fn attach(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        let i = v.index();
        if self.slots.len() <= i {
            self.slots.resize(i + 1, None);
        }
        self.slots[i] = Some(Slot::default());
        if self.sampling()
            && let Phase::Free { next_sample } = &mut self.phase
            && next_sample.is_none()
        {
            *next_sample = Some(cx.now().saturating_add(self.config.sampling_period_ns));
        }
        self.sync(cx, v);
        let busy = cx
            .vgpu(v)
            .is_some_and(|s| s.queued() > 0 || s.in_flight() > 0);
        if busy {
            self.activate(cx, v);
        }
    }

    fn detach(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        if let Some(Some(slot)) = self.slots.get_mut(v.index()).map(Option::take)
            && let Some(t) = slot.idle_until
        {
            self.grace.remove(&(t, v));
        }
        self.active.remove(v);
        self.over.remove(v);
        self.ready.remove(v);
        if self.sampled == Some(v) {
            self.sampled = None;
        }
        match &mut self.phase {
            Phase::Drain { queue, .. } | Phase::Window { queue, .. } => queue.retain(|&q| q != v),
            Phase::Free { .. } => {}
        }
        if matches!(self.phase, Phase::Window { vgpu, .. } if vgpu == v) {
            self.end_window(cx);
        }
        self.refresh(cx);
        self.advance(cx);
    }

    fn params_changed(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        // The weight applies to future charges; the virtual time earned so far stays.
        if self.slot(v).is_none() {
            self.attach(cx, v);
        } else {
            self.sync(cx, v);
        }
    }

    fn submitted(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.expire(cx);
        self.activate(cx, v);
    }

    fn dispatched(&mut self, cx: &mut Cx<'_>, v: VgpuId, _leased: bool) {
        self.expire(cx);
        self.activate(cx, v);
    }

    fn withdrawn(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.expire(cx);
        self.reindex(cx, v);
        self.maybe_idle(cx, v);
        self.refresh(cx);
        self.advance(cx);
    }

    fn completed(&mut self, cx: &mut Cx<'_>, done: &Completion) {
        self.expire(cx);
        let v = done.vgpu;
        let cost = done.cost();
        if !self.sampling() {
            self.charge(cx, v, cost);
        } else if self.sampled == Some(v) {
            // Measured while running alone: charged exactly and fed into the estimate.
            if let Some(slot) = self.slot_mut(v) {
                slot.window_cost = slot.window_cost.saturating_add(cost);
                slot.window_groups = slot.window_groups.saturating_add(1);
            }
            self.charge(cx, v, cost);
        } else {
            // Free-running: the per-group time is not seen; charge the estimate.
            match self.slot(v).map(|s| s.estimate) {
                Some(Some(estimate)) => self.charge(cx, v, estimate),
                Some(None) => {
                    if let Some(slot) = self.slot_mut(v) {
                        slot.unestimated = slot.unestimated.saturating_add(1);
                    }
                }
                None => {}
            }
        }
        self.settle(cx, v);
        self.maybe_idle(cx, v);
        self.refresh(cx);
        self.advance(cx);
    }

    fn timer(&mut self, cx: &mut Cx<'_>) {
        self.expire(cx);
        let now = cx.now();
        match self.phase {
            Phase::Free {
                next_sample: Some(t),
            } if t <= now => self.start_sampling(cx),
            Phase::Window { until, .. } if until <= now => self.end_window(cx),
            Phase::Drain { .. } => self.advance(cx),
            _ => {}
        }
    }

    fn pick(&mut self, _cx: &mut Cx<'_>) -> Option<VgpuId> {
        self.ready.first().map(|(_, v)| v)
    }

    /// An idle grace running out needs the timer only while a vGPU is suspended for being
    /// ahead: the expiry may raise `t_sys` and release it. Otherwise nothing waits on it, and
    /// it is applied at the next event (each one expires the graces that ran out before it
    /// acts), or at the daemon's next statistics snapshot. A streaming vGPU goes idle between
    /// every two groups, so timing its grace meant re-arming the daemon's timer around every
    /// group (a grace at each completion, none at the next submission): on a virtualised host
    /// about 12 µs per group (`sched_overhead`, OCCUPY groups, docs/PERFORMANCE.md).
    fn next_deadline(&self) -> Option<Time> {
        let phase = match &self.phase {
            Phase::Free { next_sample } => *next_sample,
            Phase::Drain { until, .. } | Phase::Window { until, .. } => Some(*until),
        };
        let grace = if self.over.is_empty() {
            None
        } else {
            self.grace.first().map(|&(t, _)| t)
        };
        earliest([grace, phase])
    }

    /// The GPU time the vGPU may still use before it runs more than `threshold_ns` ahead of
    /// `t_sys` and is suspended, and the threshold itself, both in real GPU time at its weight
    /// (`virtual * weight / 256`). It grows back as the others catch up, not by period. An
    /// inactive vGPU counts from `t_sys`, where activation puts it.
    fn budget(&self, v: VgpuId, state: &VgpuState, _now: Time) -> Option<Budget> {
        let slot = self.slot(v)?;
        let weight = i128::from(state.params().weight.max(1));
        let real = |virtual_ns: i128| virtual_ns * weight / i128::from(DEFAULT_WEIGHT);
        let lead = i128::from(slot.vtime.max(self.t_sys) - self.t_sys);
        let threshold = i128::from(self.config.threshold_ns);
        let left = real(threshold - lead);
        let remaining_ns =
            i64::try_from(left).unwrap_or(if left < 0 { i64::MIN } else { i64::MAX });
        Some(Budget {
            remaining_ns,
            capacity_ns: u64::try_from(real(threshold)).unwrap_or(u64::MAX),
            period_ns: None,
        })
    }

    fn figures(&self, v: VgpuId) -> Vec<(&'static str, f64)> {
        let Some(slot) = self.slot(v) else {
            return Vec::new();
        };
        let ms = |ns: u64| ns as f64 / NS_PER_MS as f64;
        let mut figures = vec![
            ("vtime_ms", ms(slot.vtime)),
            ("lag_ms", ms(slot.vtime.saturating_sub(self.t_sys))),
            ("charged_ms", ms(slot.charged)),
            ("over", if slot.over { 1.0 } else { 0.0 }),
        ];
        if let Some(e) = slot.estimate {
            figures.push(("estimate_us", e as f64 / NS_PER_US as f64));
        }
        figures
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, VecDeque};

    use super::*;
    use crate::core::Scheduler;
    use crate::model::{CommandGroup, Decision, Event, GroupId, GroupKind, VgpuParams};
    use crate::policy::PolicyConfig;
    use crate::testkit::{self, dispatch, lease, submit};

    const MS: Nanos = NS_PER_MS;

    fn config(threshold_ns: Nanos, idle_grace_ns: Nanos) -> FairConfig {
        FairConfig {
            threshold_ns,
            idle_grace_ns,
            ..FairConfig::default()
        }
    }

    fn sched(config: FairConfig, weights: &[u32]) -> (Scheduler, Vec<VgpuId>, Vec<Decision>) {
        let mut s = Scheduler::new(PolicyConfig::Fair(config).build(), 1);
        let mut out = Vec::new();
        let ids = weights
            .iter()
            .enumerate()
            .map(|(i, &weight)| {
                let params = VgpuParams {
                    weight,
                    ..VgpuParams::named(&format!("vm{i}"))
                };
                s.add_vgpu(0, params, &mut out).unwrap()
            })
            .collect();
        (s, ids, out)
    }

    /// Completes group `id` of `v` that ran from `start` to `finish` (handled at `finish`).
    fn complete(s: &mut Scheduler, v: VgpuId, id: u64, start: Time, finish: Time) -> Vec<Decision> {
        testkit::complete(s, finish, v, id, start)
    }

    fn timer(s: &mut Scheduler, now: Time) -> Vec<Decision> {
        testkit::event(s, now, Event::Timer)
    }

    fn figure(s: &Scheduler, v: VgpuId, name: &str) -> f64 {
        let f = s.figures(v);
        f.iter().find(|(n, _)| *n == name).map(|&(_, x)| x).unwrap()
    }

    #[test]
    fn vgpus_hold_a_lease_and_their_groups_go_straight_to_the_gpu() {
        let (mut s, v, out) = sched(FairConfig::default(), &[256, 256]);
        assert_eq!(out, vec![lease(v[0]), lease(v[1])]);
        // Leased groups bypass the capacity of 1.
        assert_eq!(submit(&mut s, 1, v[0], 1), vec![dispatch(v[0], 1, true)]);
        assert_eq!(submit(&mut s, 2, v[1], 2), vec![dispatch(v[1], 2, true)]);
        assert_eq!(submit(&mut s, 3, v[0], 3), vec![dispatch(v[0], 3, true)]);
        assert_eq!(s.online().len(), 3);
        assert_eq!(s.next_deadline(), None);
        // Nobody asks: the daemon need not hurry for them.
        assert!(!s.may_ask());
    }

    #[test]
    fn virtual_time_advances_by_cost_over_weight() {
        let (mut s, v, _) = sched(config(100 * MS, 100 * MS), &[256, 512, 128]);
        for (i, &vg) in v.iter().enumerate() {
            submit(&mut s, 0, vg, i as u64);
        }
        for (i, &vg) in v.iter().enumerate() {
            let start = i as u64 * 4 * MS;
            complete(&mut s, vg, i as u64, start, start + 4 * MS);
        }
        assert_eq!(figure(&s, v[0], "vtime_ms"), 4.0);
        assert_eq!(figure(&s, v[1], "vtime_ms"), 2.0);
        assert_eq!(figure(&s, v[2], "vtime_ms"), 8.0);
        // What was charged is the exact GPU time, whatever the weight.
        for &vg in &v {
            assert_eq!(figure(&s, vg, "charged_ms"), 4.0);
            assert_eq!(s.vgpu(vg).unwrap().account().gpu_time, 4 * MS);
        }
        // t_sys is the smallest active virtual time: vm1's.
        assert_eq!(figure(&s, v[1], "lag_ms"), 0.0);
        assert_eq!(figure(&s, v[2], "lag_ms"), 6.0);
    }

    #[test]
    fn a_vgpu_ahead_by_more_than_the_threshold_is_suspended_until_t_sys_catches_up() {
        let (mut s, v, _) = sched(config(MS, 0), &[256, 256]);
        submit(&mut s, 0, v[0], 1);
        submit(&mut s, 0, v[1], 2);
        submit(&mut s, 0, v[1], 3);
        // 1.5 ms ahead of vm1 (still active, t_sys = 0) exceeds the 1 ms threshold.
        let out = complete(&mut s, v[0], 1, 0, 3 * MS / 2);
        assert_eq!(
            out,
            vec![
                Decision::Revoke { vgpu: v[0] },
                Decision::Suspend { vgpu: v[0] }
            ]
        );
        assert_eq!(figure(&s, v[0], "over"), 1.0);
        // Suspended, it does not ask either.
        assert!(!s.may_ask());
        // Suspended: its groups queue instead of going to the GPU.
        assert!(submit(&mut s, 3 * MS / 2, v[0], 4).is_empty());
        // vm1 reaches 0.4 ms: 1.1 ms behind, vm0 stays suspended.
        assert!(complete(&mut s, v[1], 2, 3 * MS / 2, 19 * MS / 10).is_empty());
        // vm1 reaches 0.6 ms: t_sys + threshold = 1.6 ms >= 1.5 ms, vm0 resumes and its queued
        // group is dispatched (engaged, within the capacity).
        let out = complete(&mut s, v[1], 3, 19 * MS / 10, 21 * MS / 10);
        assert_eq!(
            out,
            vec![
                Decision::Resume { vgpu: v[0] },
                lease(v[0]),
                dispatch(v[0], 4, false)
            ]
        );
    }

    #[test]
    fn the_budget_query_is_the_lead_left_before_suspension_at_the_vgpus_weight() {
        let (mut s, v, _) = sched(config(2 * MS, 0), &[512, 256, 256]);
        // Weight 512: the 2 ms virtual threshold is 4 ms of real GPU time.
        let budget = |s: &Scheduler, vg, left| {
            let capacity_ns = if vg == v[0] { 4 * MS } else { 2 * MS };
            let want = Budget {
                remaining_ns: left,
                capacity_ns,
                period_ns: None,
            };
            assert_eq!(s.budget(vg, s.now()), Some(want));
        };
        budget(&s, v[0], 4_000_000);
        submit(&mut s, 0, v[0], 1);
        submit(&mut s, 0, v[1], 2);
        submit(&mut s, 0, v[1], 3);
        complete(&mut s, v[0], 1, 0, 3 * MS);
        budget(&s, v[0], 1_000_000);
        submit(&mut s, 3 * MS, v[0], 4);
        complete(&mut s, v[0], 4, 3 * MS, 6 * MS);
        assert_eq!(figure(&s, v[0], "over"), 1.0);
        budget(&s, v[0], -2_000_000);
        // vm1 catches up by 1.5 ms virtual: vm0 gets 3 ms of its lead back and resumes.
        complete(&mut s, v[1], 2, 6 * MS, 7 * MS + MS / 2);
        budget(&s, v[0], 1_000_000);
        budget(&s, v[1], 2_000_000);
        // vm2 never ran: it would start at t_sys with the whole threshold.
        budget(&s, v[2], 2_000_000);
        assert_eq!(s.budget(VgpuId(9), s.now()), None);
    }

    #[test]
    fn an_idle_vgpu_is_brought_up_to_t_sys_and_cannot_save_up() {
        let (mut s, v, _) = sched(config(MS, 0), &[256, 256]);
        // vm1 runs 10 ms while vm0 is idle: t_sys follows vm1 alone, nobody is suspended.
        for i in 0..10 {
            let out = submit(&mut s, i * MS, v[1], i);
            assert_eq!(out, vec![dispatch(v[1], i, true)]);
            assert!(complete(&mut s, v[1], i, i * MS, (i + 1) * MS).is_empty());
        }
        assert_eq!(figure(&s, v[0], "vtime_ms"), 0.0);
        // vm0 wakes up at t_sys = 10 ms, not 10 ms behind.
        assert_eq!(
            submit(&mut s, 10 * MS, v[0], 100),
            vec![dispatch(v[0], 100, true)]
        );
        assert_eq!(figure(&s, v[0], "vtime_ms"), 10.0);
        // So vm1 may run on: 1 ms ahead is within the threshold, 2 ms is not.
        submit(&mut s, 10 * MS, v[1], 101);
        assert!(complete(&mut s, v[1], 101, 10 * MS, 11 * MS).is_empty());
        submit(&mut s, 11 * MS, v[1], 102);
        let out = complete(&mut s, v[1], 102, 11 * MS, 12 * MS);
        assert_eq!(out.last(), Some(&Decision::Suspend { vgpu: v[1] }));
    }

    #[test]
    fn a_suspended_vgpu_is_released_when_nobody_holds_t_sys() {
        let (mut s, v, _) = sched(config(MS, 2 * MS), &[256, 256]);
        submit(&mut s, 0, v[1], 1);
        // vm0 has work queued behind vm1's group: active at virtual time 0.
        submit(&mut s, MS / 10, v[0], 2);
        // vm1 used 1.5 ms while vm0 holds t_sys at 0: vm1 is suspended, and its device holds
        // its further work without asking (it is idle to the scheduler).
        let out = complete(&mut s, v[1], 1, 0, 15 * MS / 10);
        assert!(out.contains(&Decision::Suspend { vgpu: v[1] }), "{out:?}");
        // vm1's idle grace ends at 3.5 ms: it stops being active; vm0 still holds t_sys.
        let out = timer(&mut s, 35 * MS / 10);
        assert!(!out.contains(&Decision::Resume { vgpu: v[1] }), "{out:?}");
        // vm0's group used 0.1 ms of GPU by 5 ms; vm0 idles, its grace ends at 7 ms.
        complete(&mut s, v[0], 2, 49 * MS / 10, 5 * MS);
        // Then nobody is active: vm1 must not wait for vm0 to come back.
        let out = timer(&mut s, 7 * MS);
        assert!(out.contains(&Decision::Resume { vgpu: v[1] }), "{out:?}");
    }

    #[test]
    fn an_idle_vgpu_stays_active_within_its_grace_then_stops_holding_t_sys() {
        let (mut s, v, _) = sched(config(MS, 2 * MS), &[256, 256]);
        submit(&mut s, 0, v[0], 1);
        submit(&mut s, 0, v[1], 2);
        // vm0 finishes a short group and goes idle at 0.1 ms: its grace ends at 2.1 ms, but
        // nobody waits for that, so it needs no timer.
        complete(&mut s, v[0], 1, 0, MS / 10);
        assert_eq!(s.next_deadline(), None);
        // Within the grace vm0 still holds t_sys at 0.1 ms: vm1 at 1.4 ms is suspended, and
        // now the grace's end matters.
        let out = complete(&mut s, v[1], 2, MS / 10, 15 * MS / 10);
        assert_eq!(out.last(), Some(&Decision::Suspend { vgpu: v[1] }));
        assert_eq!(s.next_deadline(), Some(21 * MS / 10));
        // When the grace ends, t_sys moves to vm1 and vm1 resumes.
        let out = timer(&mut s, 21 * MS / 10);
        assert_eq!(out, vec![Decision::Resume { vgpu: v[1] }, lease(v[1])]);
        // vm1 itself is idle since 1.5 ms (grace until 3.5 ms); nobody is suspended.
        assert_eq!(s.next_deadline(), None);
        // vm0 comes back before vm1's grace ends and is brought up to t_sys (vm1 at 1.4 ms).
        submit(&mut s, 3 * MS, v[0], 3);
        assert_eq!(figure(&s, v[0], "vtime_ms"), 1.4);
        // vm0 runs 2 ms and idles (grace until 7 ms); vm1's grace ran out at 3.5 ms without a
        // timer: the next event applies it, so vm1 no longer holds t_sys and vm0 (3.4 ms) is
        // not suspended.
        let out = complete(&mut s, v[0], 3, 3 * MS, 5 * MS);
        assert!(!out.contains(&Decision::Suspend { vgpu: v[0] }), "{out:?}");
        assert_eq!(figure(&s, v[0], "lag_ms"), 0.0);
        // vm1 comes back: brought up to t_sys, not left 2 ms behind with credit it saved.
        submit(&mut s, 6 * MS, v[1], 4);
        assert_eq!(figure(&s, v[1], "vtime_ms"), 3.4);
    }

    #[test]
    fn engaged_pick_serves_the_lowest_virtual_time_first() {
        let (mut s, v, _) = sched(config(MS, 0), &[256, 256, 256]);
        submit(&mut s, 0, v[0], 1);
        submit(&mut s, 0, v[1], 2);
        submit(&mut s, 0, v[2], 3);
        // vm2 holds t_sys at 0 while vm0 (3 ms) and vm1 (2 ms) run ahead and are suspended.
        complete(&mut s, v[0], 1, 0, 3 * MS);
        complete(&mut s, v[1], 2, 3 * MS, 5 * MS);
        assert!(submit(&mut s, 5 * MS, v[0], 10).is_empty());
        assert!(submit(&mut s, 5 * MS, v[1], 11).is_empty());
        // vm2 finishes and goes idle: t_sys = 2 ms releases both; vm1 (2 ms) goes first.
        let out = complete(&mut s, v[2], 3, 5 * MS, 5 * MS);
        let dispatches: Vec<_> = out
            .iter()
            .filter(|d| matches!(d, Decision::Dispatch { .. }))
            .collect();
        assert_eq!(dispatches, vec![&dispatch(v[1], 11, false)]);
        let out = complete(&mut s, v[1], 11, 5 * MS, 6 * MS);
        assert!(out.contains(&dispatch(v[0], 10, false)));
    }

    fn sampling(period: Nanos, window: Nanos) -> FairConfig {
        FairConfig {
            accounting: Accounting::Sampling,
            threshold_ns: 100 * MS,
            idle_grace_ns: 0,
            sampling_period_ns: period,
            sampling_window_ns: window,
        }
    }

    #[test]
    fn sampling_drains_the_gpu_then_runs_each_active_vgpu_alone() {
        let (mut s, v, _) = sched(sampling(10 * MS, 2 * MS), &[256, 256]);
        assert_eq!(s.next_deadline(), Some(10 * MS));
        submit(&mut s, 0, v[0], 1);
        submit(&mut s, 0, v[1], 2);
        // The period ends with both groups on the GPU: everyone is suspended to drain it.
        let out = timer(&mut s, 10 * MS);
        let suspended = [
            Decision::Revoke { vgpu: v[0] },
            Decision::Suspend { vgpu: v[0] },
            Decision::Revoke { vgpu: v[1] },
            Decision::Suspend { vgpu: v[1] },
        ];
        assert_eq!(out, suspended);
        assert!(submit(&mut s, 10 * MS, v[0], 3).is_empty());
        assert!(submit(&mut s, 10 * MS, v[1], 4).is_empty());
        assert!(complete(&mut s, v[0], 1, 0, 11 * MS).is_empty());
        // Drained: vm0 runs alone, engaged (no lease); vm1 stays suspended.
        let out = complete(&mut s, v[1], 2, 11 * MS, 12 * MS);
        assert_eq!(
            out,
            vec![Decision::Resume { vgpu: v[0] }, dispatch(v[0], 3, false)]
        );
        assert_eq!(s.next_deadline(), Some(14 * MS));
        assert!(complete(&mut s, v[0], 3, 12 * MS, 13 * MS).is_empty());
        // Its window ends; the GPU is empty, so vm1's window opens at once.
        let out = timer(&mut s, 14 * MS);
        assert_eq!(
            out,
            vec![
                Decision::Suspend { vgpu: v[0] },
                Decision::Resume { vgpu: v[1] },
                dispatch(v[1], 4, false)
            ]
        );
        assert!(complete(&mut s, v[1], 4, 14 * MS, 15 * MS).is_empty());
        // After the last window everyone free-runs again under a lease.
        let out = timer(&mut s, 16 * MS);
        assert_eq!(
            out,
            vec![
                Decision::Suspend { vgpu: v[1] },
                Decision::Resume { vgpu: v[0] },
                lease(v[0]),
                Decision::Resume { vgpu: v[1] },
                lease(v[1])
            ]
        );
        assert_eq!(s.next_deadline(), Some(26 * MS));
        assert_eq!(figure(&s, v[1], "estimate_us"), 1000.0);
    }

    #[test]
    fn sampling_charges_estimated_costs_while_free_running() {
        let (mut s, v, _) = sched(sampling(10 * MS, 2 * MS), &[256]);
        // Before any sample the cost of free-run groups is unknown: nothing is charged yet.
        submit(&mut s, 0, v[0], 1);
        complete(&mut s, v[0], 1, 0, 4 * MS);
        submit(&mut s, 5 * MS, v[0], 2);
        assert_eq!(figure(&s, v[0], "charged_ms"), 0.0);
        // Sampling: drain, then vm0 alone measures 1 ms and 3 ms groups: estimate 2 ms.
        timer(&mut s, 10 * MS);
        assert_eq!(figure(&s, v[0], "charged_ms"), 0.0);
        complete(&mut s, v[0], 2, 5 * MS, 11 * MS);
        submit(&mut s, 11 * MS, v[0], 3);
        complete(&mut s, v[0], 3, 11 * MS, 12 * MS);
        submit(&mut s, 12 * MS, v[0], 4);
        complete(&mut s, v[0], 4, 12 * MS, 15 * MS);
        // The two groups completed without an estimate are charged 2 ms each at the end.
        timer(&mut s, 15 * MS);
        assert_eq!(figure(&s, v[0], "estimate_us"), 2000.0);
        assert_eq!(figure(&s, v[0], "charged_ms"), 4.0 + 4.0);
        // Free-running again: a 7 ms group is charged its 2 ms estimate.
        assert_eq!(
            submit(&mut s, 16 * MS, v[0], 5),
            vec![dispatch(v[0], 5, true)]
        );
        complete(&mut s, v[0], 5, 16 * MS, 23 * MS);
        assert_eq!(figure(&s, v[0], "charged_ms"), 10.0);
        assert_eq!(s.vgpu(v[0]).unwrap().account().gpu_time, 21 * MS);
    }

    /// What one vGPU's guest does in [`Sim`].
    #[derive(Debug, Clone, Copy)]
    struct Load {
        /// GPU cost of each group.
        cost: Nanos,
        /// Groups kept submitted and not completed.
        depth: usize,
        /// Sleep after each completion before submitting again (Throttle).
        sleep: Nanos,
    }

    const fn backlog(cost: Nanos) -> Load {
        Load {
            cost,
            depth: 2,
            sleep: 0,
        }
    }

    /// A tiny GPU: runs dispatched groups one at a time in dispatch order, each for its cost.
    struct Sim {
        s: Scheduler,
        ids: Vec<VgpuId>,
        loads: Vec<Load>,
        now: Time,
        fifo: VecDeque<(usize, GroupId)>,
        running: Option<(usize, GroupId, Time, Time)>,
        next_submit: Vec<Option<Time>>,
        outstanding: Vec<usize>,
        next_group: u64,
        submitted: BTreeMap<GroupId, Time>,
        max_wait: Vec<Nanos>,
        busy: Nanos,
    }

    impl Sim {
        fn new(policy: Box<dyn Policy>, loads: &[(Load, u32)]) -> Sim {
            let mut s = Scheduler::new(policy, 1);
            let mut out = Vec::new();
            let ids = loads
                .iter()
                .map(|&(_, weight)| {
                    let params = VgpuParams {
                        weight,
                        ..VgpuParams::default()
                    };
                    s.add_vgpu(0, params, &mut out).unwrap()
                })
                .collect();
            let n = loads.len();
            Sim {
                s,
                ids,
                loads: loads.iter().map(|&(l, _)| l).collect(),
                now: 0,
                fifo: VecDeque::new(),
                running: None,
                next_submit: vec![Some(0); n],
                outstanding: vec![0; n],
                next_group: 0,
                submitted: BTreeMap::new(),
                max_wait: vec![0; n],
                busy: 0,
            }
        }

        fn apply(&mut self, out: Vec<Decision>) {
            for d in out {
                if let Decision::Dispatch { vgpu, group, .. } = d {
                    let i = self.ids.iter().position(|&v| v == vgpu).unwrap();
                    let wait = self.now - self.submitted[&group];
                    self.max_wait[i] = self.max_wait[i].max(wait);
                    self.fifo.push_back((i, group));
                }
            }
            if self.running.is_none()
                && let Some((i, g)) = self.fifo.pop_front()
            {
                let finish = self.now + self.loads[i].cost;
                self.running = Some((i, g, self.now, finish));
            }
        }

        fn run(&mut self, end: Time) {
            loop {
                let done = self.running.map(|(_, _, _, f)| f);
                let arrival = self.next_submit.iter().flatten().min().copied();
                let deadline = self.s.next_deadline();
                let Some(t) = earliest([done, arrival, deadline]) else {
                    break;
                };
                if t > end {
                    break;
                }
                self.now = t;
                let mut out = Vec::new();
                if done == Some(t) {
                    let (i, group, start, finish) = self.running.take().unwrap();
                    let ev = Event::Completed {
                        vgpu: self.ids[i],
                        group,
                        start,
                        finish,
                    };
                    self.s.handle(t, ev, &mut out).unwrap();
                    self.busy += finish - start;
                    self.outstanding[i] -= 1;
                    self.next_submit[i] = Some(t + self.loads[i].sleep);
                } else if arrival == Some(t) {
                    for i in 0..self.ids.len() {
                        if self.next_submit[i] != Some(t) {
                            continue;
                        }
                        self.next_submit[i] = None;
                        while self.outstanding[i] < self.loads[i].depth {
                            self.outstanding[i] += 1;
                            self.next_group += 1;
                            let g =
                                CommandGroup::new(self.next_group, self.ids[i], GroupKind::Load, 1);
                            self.submitted.insert(g.id, t);
                            self.s.handle(t, Event::Submitted(g), &mut out).unwrap();
                        }
                    }
                } else {
                    self.s.handle(t, Event::Timer, &mut out).unwrap();
                }
                self.apply(out);
            }
        }

        fn gpu_time(&self, i: usize) -> Nanos {
            self.s.vgpu(self.ids[i]).unwrap().account().gpu_time
        }

        fn shares(&self) -> Vec<f64> {
            let total: Nanos = (0..self.ids.len()).map(|i| self.gpu_time(i)).sum();
            (0..self.ids.len())
                .map(|i| self.gpu_time(i) as f64 / total as f64)
                .collect()
        }
    }

    fn fair(config: FairConfig) -> Box<dyn Policy> {
        PolicyConfig::Fair(config).build()
    }

    #[test]
    fn backlogged_vgpus_with_equal_weights_get_equal_shares_in_the_long_run() {
        let loads = [
            (backlog(MS), 256),
            (backlog(3 * MS / 10), 256),
            (backlog(MS / 20), 256),
        ];
        let mut sim = Sim::new(fair(FairConfig::default()), &loads);
        sim.run(2_000 * MS);
        for share in sim.shares() {
            assert!((share - 1.0 / 3.0).abs() < 0.02, "{:?}", sim.shares());
        }
        // Without fair queuing the long groups take most of the GPU.
        let mut fcfs = Sim::new(PolicyConfig::None.build(), &loads);
        fcfs.run(2_000 * MS);
        assert!(fcfs.shares()[0] > 0.5, "{:?}", fcfs.shares());
    }

    #[test]
    fn weights_give_proportional_shares_in_the_long_run() {
        let loads = [(backlog(MS / 10), 256), (backlog(2 * MS), 768)];
        let mut sim = Sim::new(fair(FairConfig::default()), &loads);
        sim.run(2_000 * MS);
        let shares = sim.shares();
        assert!((shares[0] - 0.25).abs() < 0.02, "{shares:?}");
        assert!((shares[1] - 0.75).abs() < 0.02, "{shares:?}");
    }

    #[test]
    fn a_suspended_vgpu_with_queued_groups_is_not_starved() {
        // vm1's long groups get it suspended again and again; its groups then queue behind
        // vm0's leased ones and must still be dispatched within a bounded wait.
        let loads = [
            (
                Load {
                    cost: MS / 10,
                    depth: 4,
                    sleep: 0,
                },
                256,
            ),
            (
                Load {
                    cost: 3 * MS,
                    depth: 4,
                    sleep: 0,
                },
                256,
            ),
        ];
        let mut sim = Sim::new(fair(config(MS, MS / 2)), &loads);
        sim.run(1_000 * MS);
        for share in sim.shares() {
            assert!((share - 0.5).abs() < 0.02, "{:?}", sim.shares());
        }
        assert!(
            sim.max_wait.iter().all(|&w| w < 40 * MS),
            "{:?}",
            sim.max_wait
        );
        let completed = sim.s.vgpu(sim.ids[1]).unwrap().account().completed;
        assert!(completed > 150, "{completed}");
    }

    fn throttle(kernel: Nanos, sleep: Nanos) -> Load {
        Load {
            cost: kernel,
            depth: 1,
            sleep,
        }
    }

    #[test]
    fn throttle_loads_are_measured_at_their_intended_load() {
        // LoGA §5.4: kernel then sleep; 1/(1 + 9.1) = 9.9 % and 1/(1 + 0.1) = 90.9 %.
        for (load, intended) in [
            (throttle(MS, 91 * MS / 10), 0.099),
            (throttle(MS, MS / 10), 0.909),
        ] {
            let mut sim = Sim::new(fair(FairConfig::default()), &[(load, 256)]);
            let end = 10_000 * MS;
            sim.run(end);
            let measured = figure(&sim.s, sim.ids[0], "charged_ms") * MS as f64 / end as f64;
            assert!(
                (measured - intended).abs() / intended < 0.025,
                "{measured} vs {intended}"
            );
        }
    }

    #[test]
    fn sampling_costs_throughput_that_exact_accounting_does_not() {
        let loads = [(throttle(MS, 91 * MS / 10), 256); 4];
        let end = 2_000 * MS;
        let mut exact = Sim::new(fair(FairConfig::default()), &loads);
        exact.run(end);
        let mut sampled = Sim::new(fair(sampling(50 * MS, 5 * MS)), &loads);
        sampled.run(end);
        // Exact accounting delivers the intended 4 x 9.9 % ...
        let load = exact.busy as f64 / end as f64;
        assert!((load - 4.0 * 0.099).abs() < 0.02, "{load}");
        // ... while the drains and exclusive windows leave the GPU idle.
        assert!(
            sampled.busy as f64 <= 0.95 * exact.busy as f64,
            "{} vs {}",
            sampled.busy,
            exact.busy
        );
    }

    #[test]
    fn sampling_phases_are_never_shorter_than_the_minimum() {
        let (s, _, _) = sched(sampling(0, 0), &[256]);
        assert_eq!(s.next_deadline(), Some(MIN_PHASE_NS));
        let d = FairConfig::default();
        assert_eq!(d.accounting, Accounting::Exact);
        assert_eq!((d.threshold_ns, d.idle_grace_ns), (5 * MS, 500 * NS_PER_US));
    }

    #[test]
    fn removing_the_sampled_vgpu_moves_on_to_the_next_window() {
        let (mut s, v, _) = sched(sampling(10 * MS, 2 * MS), &[256, 256]);
        submit(&mut s, 0, v[0], 1);
        submit(&mut s, 0, v[1], 2);
        timer(&mut s, 10 * MS);
        submit(&mut s, 10 * MS, v[1], 3);
        complete(&mut s, v[0], 1, 0, 11 * MS);
        complete(&mut s, v[1], 2, 11 * MS, 12 * MS);
        // vm0 has the window; it goes away and vm1's window opens at once.
        let mut out = Vec::new();
        s.remove_vgpu(12 * MS, v[0], &mut out).unwrap();
        assert_eq!(
            out,
            vec![Decision::Resume { vgpu: v[1] }, dispatch(v[1], 3, false)]
        );
        assert_eq!(s.next_deadline(), Some(14 * MS));
        assert!(s.figures(v[0]).is_empty());
    }
}
