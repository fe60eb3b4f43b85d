//! TimeGraph (Kato et al., USENIX ATC 2011, §3–§5): priority scheduling at command group
//! boundaries (PRT, HT), GPU reservations (PE, AE, Shared, Background) with admission control,
//! history-based cost prediction, spec lines and automatic priority assignment by focus.
//!
//! Order of the wait queue: higher effective priority first; at equal priority, vGPUs with an
//! admitted reserve before Background ones (vGPUs without a reserve or refused by admission
//! control), then the older head group. Priorities rank, reserves cap: a reserved vGPU out of
//! budget leaves the wait queue until its reserve is replenished, whatever its priority.
//! Unspecified vGPUs have the default priority 0, the lowest, as the paper gives them.

pub mod predictor;
pub mod spec;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::core::{Cx, VgpuState};
use crate::model::{Budget, Enforcement, Nanos, PrioPolicy, Reserve, Time, VgpuId, VgpuParams};
use crate::policy::ready::ReadySet;
use crate::policy::{Completion, Policy};

use predictor::{MAX_PREDICTOR_ENTRIES, Predictor};
use spec::{MAX_NAME_LEN, Spec, SpecError, SpecPriority, SpecReserve, parse_spec};

/// Most spec lines a configuration may hold: one per VM name is plenty, and it bounds the
/// table looked up at every attach.
pub const MAX_SPECS: usize = 4096;
/// Most Shared reserves a configuration may define.
pub const MAX_SHARED: usize = 256;
/// History table size when none is configured: the paper's evaluation setting (§6).
pub const DEFAULT_PREDICTOR_ENTRIES: usize = 100;
/// Utilization unit for admission control: parts per million of one GPU, so that the sum of
/// C/T is exact integer arithmetic.
const PPM: u64 = 1_000_000;

/// A Shared reserve that several vGPUs draw from (config `shared`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedReserve {
    /// The name vGPUs join it by (`VgpuParams::reserve.shared` or a spec line's `resv`).
    pub name: String,
    /// Budget per period, in nanoseconds.
    pub c: Nanos,
    /// Replenishment period, in nanoseconds.
    pub t: Nanos,
    /// How the budget is enforced (default `pe`).
    #[serde(default = "default_enforcement")]
    pub enforcement: Enforcement,
}

fn default_enforcement() -> Enforcement {
    Enforcement::Pe
}

/// The TimeGraph policy family's configuration (`policy = "timegraph"`). Every field has a
/// default. Durations are plain u64 nanoseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeGraphConfig {
    /// `sched`: the priority policy of vGPUs that name none (`"prt"` or `"ht"`; default `"ht"`).
    pub sched: PrioPolicy,
    /// `admission_limit`: the most the sum of C/T over admitted reserves may reach (default
    /// 1.0 = the whole GPU). Negative or NaN admits nothing.
    pub admission_limit: f64,
    /// `predictor_entries`: history table records before the least recently used is dropped
    /// (default 100, clamped to 1..=[`MAX_PREDICTOR_ENTRIES`]).
    pub predictor_entries: usize,
    /// `preemption_cost`: nanoseconds a context switch is assumed to add to a group's cost
    /// until the predictor has measured one (default 0).
    pub preemption_cost: Nanos,
    /// `wildcard_priority`: the priority of vGPUs whose spec line says `*` while they do not
    /// have focus (default 0); the focused one gets `u32::MAX`.
    pub wildcard_priority: u32,
    /// `shared`: the Shared reserves (at most [`MAX_SHARED`]; invalid entries are ignored).
    pub shared: Vec<SharedReserve>,
    /// `specs`: spec lines `<name:sched:resv:prio:C:T>` applied to vGPUs by name when they
    /// attach; they override the vGPU's own priority, sched and reserve. At most
    /// [`MAX_SPECS`]; malformed lines are ignored (see [`TimeGraphConfig::validate`]).
    pub specs: Vec<String>,
    /// `ht_lease`: the HT vGPU that owns the GPU holds a lease while no other vGPU waits at
    /// its priority or above, so its groups reach the GPU without a round trip each (default
    /// true; false asks for every group, as the paper's scheduler decides each one).
    pub ht_lease: bool,
}

impl Default for TimeGraphConfig {
    fn default() -> Self {
        TimeGraphConfig {
            sched: PrioPolicy::Ht,
            admission_limit: 1.0,
            predictor_entries: DEFAULT_PREDICTOR_ENTRIES,
            preemption_cost: 0,
            wildcard_priority: 0,
            shared: Vec::new(),
            specs: Vec::new(),
            ht_lease: true,
        }
    }
}

/// A configuration problem found by [`TimeGraphConfig::validate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `admission_limit` is negative, NaN or infinite.
    #[error("admission_limit must be a finite number >= 0")]
    AdmissionLimit,
    /// `predictor_entries` is 0 or above [`MAX_PREDICTOR_ENTRIES`].
    #[error("predictor_entries must be in 1..={MAX_PREDICTOR_ENTRIES}")]
    PredictorEntries,
    /// More than [`MAX_SHARED`] Shared reserves.
    #[error("more than {MAX_SHARED} shared reserves")]
    TooManyShared,
    /// A Shared reserve that cannot be used.
    #[error("shared reserve {index}: {reason}")]
    BadShared {
        /// Its position in `shared`.
        index: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// More than [`MAX_SPECS`] spec lines.
    #[error("more than {MAX_SPECS} spec lines")]
    TooManySpecs,
    /// A malformed spec line.
    #[error("spec line {index}: {source}")]
    Spec {
        /// Its position in `specs`.
        index: usize,
        /// Why it was refused.
        source: SpecError,
    },
    /// A second spec line for a name (only the first applies).
    #[error("spec line {0} repeats an earlier line's name")]
    DuplicateSpec(usize),
}

/// Why a Shared reserve entry is unusable, if it is.
fn shared_problem(s: &SharedReserve) -> Option<&'static str> {
    if s.name.is_empty() || s.name.len() > MAX_NAME_LEN {
        Some("the name must have 1 to 128 bytes")
    } else if s.t == 0 || s.c == 0 || s.c > s.t {
        Some("it needs 0 < c <= t")
    } else {
        None
    }
}

impl TimeGraphConfig {
    /// Checks the whole configuration; the policy itself ignores what this refuses.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.admission_limit.is_finite() && self.admission_limit >= 0.0) {
            return Err(ConfigError::AdmissionLimit);
        }
        if !(1..=MAX_PREDICTOR_ENTRIES).contains(&self.predictor_entries) {
            return Err(ConfigError::PredictorEntries);
        }
        if self.shared.len() > MAX_SHARED {
            return Err(ConfigError::TooManyShared);
        }
        let mut names = BTreeSet::new();
        for (index, s) in self.shared.iter().enumerate() {
            if let Some(reason) = shared_problem(s) {
                return Err(ConfigError::BadShared { index, reason });
            }
            if !names.insert(s.name.as_str()) {
                let reason = "its name repeats an earlier reserve's";
                return Err(ConfigError::BadShared { index, reason });
            }
        }
        if self.specs.len() > MAX_SPECS {
            return Err(ConfigError::TooManySpecs);
        }
        let mut names = BTreeSet::new();
        for (index, line) in self.specs.iter().enumerate() {
            let spec = parse_spec(line).map_err(|source| ConfigError::Spec { index, source })?;
            if !names.insert(spec.name) {
                return Err(ConfigError::DuplicateSpec(index));
            }
        }
        Ok(())
    }
}

/// The wait-queue order: higher priority, then admitted reserves, then older head.
type Key = (Reverse<u32>, Reverse<bool>, u64);

/// One reserve, private or Shared.
#[derive(Debug, Clone)]
struct ReserveState {
    /// The Shared reserve's name; `None` for a private reserve.
    name: Option<String>,
    c: Nanos,
    t: Nanos,
    enforcement: Enforcement,
    /// Budget left; negative after an overrun.
    budget: i128,
    /// The next replenishment.
    next: Time,
    /// C/T in parts per million, counted against the admission limit.
    util: u64,
    members: BTreeSet<VgpuId>,
    /// Members with queued work taken out of the wait queue for lack of budget.
    throttled: BTreeSet<VgpuId>,
}

/// What the policy keeps per vGPU.
#[derive(Debug, Clone, Default)]
struct Member {
    attached: bool,
    /// Scheduled under HT (else PRT).
    ht: bool,
    /// Its priority comes from a `*` spec line.
    wildcard: bool,
    /// Its static priority (the wildcard default for wildcard vGPUs).
    priority: u32,
    /// Asked for a reserve.
    wants_reserve: bool,
    /// The admitted reserve's slot; `None` = Background.
    reserve: Option<usize>,
    /// Out of the wait queue until its reserve is replenished.
    throttled: bool,
}

/// The TimeGraph policy.
#[derive(Debug)]
pub struct TimeGraph {
    default_sched: PrioPolicy,
    limit_ppm: u64,
    wildcard_priority: u32,
    shared_config: BTreeMap<String, SharedReserve>,
    specs: BTreeMap<String, Spec>,
    members: Vec<Member>,
    reserves: Vec<Option<ReserveState>>,
    shared_active: BTreeMap<String, usize>,
    /// Replenishment deadlines: (time, reserve slot).
    deadlines: BTreeSet<(Time, usize)>,
    used_ppm: u64,
    ready: ReadySet<Key>,
    focused: Option<VgpuId>,
    predictor: Predictor,
    /// The (vGPU, context) of the group that completed last.
    last_done: Option<(VgpuId, u32)>,
    /// Whether HT vGPUs stream under a lease (`ht_lease`).
    ht_lease: bool,
    /// The HT vGPU streaming under a lease: at most one, so that a lower priority never
    /// streams beside a higher one.
    lessee: Option<VgpuId>,
}

impl TimeGraph {
    /// The policy for `config`; entries [`TimeGraphConfig::validate`] would refuse are skipped
    /// and out-of-range numbers clamped.
    pub fn new(config: &TimeGraphConfig) -> Self {
        let mut shared_config = BTreeMap::new();
        for s in config.shared.iter().take(MAX_SHARED) {
            if shared_problem(s).is_none() {
                shared_config
                    .entry(s.name.clone())
                    .or_insert_with(|| s.clone());
            }
        }
        let mut specs = BTreeMap::new();
        for line in config.specs.iter().take(MAX_SPECS) {
            if let Ok(spec) = parse_spec(line) {
                specs.entry(spec.name.clone()).or_insert(spec);
            }
        }
        // `as` saturates: NaN and negative limits become 0, huge ones u64::MAX.
        let limit_ppm = (config.admission_limit * PPM as f64).round() as u64;
        TimeGraph {
            default_sched: config.sched,
            limit_ppm,
            wildcard_priority: config.wildcard_priority,
            shared_config,
            specs,
            members: Vec::new(),
            reserves: Vec::new(),
            shared_active: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            used_ppm: 0,
            ready: ReadySet::default(),
            focused: None,
            predictor: Predictor::new(config.predictor_entries, config.preemption_cost),
            last_done: None,
            ht_lease: config.ht_lease,
            lessee: None,
        }
    }

    fn member(&self, v: VgpuId) -> Option<&Member> {
        self.members.get(v.index()).filter(|m| m.attached)
    }

    fn reserve(&self, slot: usize) -> Option<&ReserveState> {
        self.reserves.get(slot).and_then(Option::as_ref)
    }

    fn effective_priority(&self, v: VgpuId, m: &Member) -> u32 {
        if m.wildcard && self.focused == Some(v) {
            u32::MAX
        } else {
            m.priority
        }
    }

    /// Puts `v` in the wait queue under its current key, or takes it out when it has nothing
    /// queued or is throttled.
    fn index(&mut self, cx: &Cx<'_>, v: VgpuId) {
        let head = cx.vgpu(v).and_then(|s| s.head_seq());
        let key = match (self.member(v), head) {
            (Some(m), Some(seq)) if !m.throttled => Some((
                Reverse(self.effective_priority(v, m)),
                Reverse(m.reserve.is_some()),
                seq,
            )),
            _ => None,
        };
        match key {
            Some(k) => self.ready.insert(v, k),
            None => {
                self.ready.remove(v);
            }
        }
    }

    /// Re-keys `v` if it waits (its priority changed).
    fn rekey(&mut self, cx: &Cx<'_>, v: VgpuId) {
        if self.ready.contains(v) {
            self.index(cx, v);
        }
    }

    /// Takes `v` out of the policy's tables, but not its lease.
    fn forget(&mut self, v: VgpuId) {
        self.ready.remove(v);
        if let Some(m) = self.members.get_mut(v.index()) {
            let reserve = m.reserve;
            *m = Member::default();
            if let Some(slot) = reserve {
                self.leave(slot, v);
            }
        }
        if self.focused == Some(v) {
            self.focused = None;
        }
    }

    /// True if `v` may stream under HT's lease: an HT vGPU without a reserve (reserved ones
    /// run PRT, §5) and no other vGPU waiting at its priority or above (the paper's HT
    /// condition (ii), §4.1). A waiter at the same priority counts, so that equal priorities
    /// still take turns at group boundaries.
    fn may_stream(&self, v: VgpuId) -> bool {
        let Some(m) = self.member(v) else {
            return false;
        };
        if !m.ht || m.reserve.is_some() {
            return false;
        }
        let p = self.effective_priority(v, m);
        // At most two entries are looked at: `v` itself and the next one.
        let rival = self
            .ready
            .iter()
            .take_while(|((Reverse(q), _, _), _)| *q >= p)
            .any(|(_, w)| w != v);
        !rival
    }

    /// Brings the lease in line with HT's condition: the lessee loses it as soon as a rival
    /// waits (its groups in flight finish, the next ones ask) or another vGPU's group runs
    /// while it has none in flight; otherwise the vGPU that alone
    /// owns the GPU-online list gets it when it may stream (the paper's condition (i): the
    /// group executing is its own).
    fn settle_lease(&mut self, cx: &mut Cx<'_>) {
        // The GPU moved on to another vGPU while the lessee had nothing in flight: condition
        // (i) no longer holds, and an idle lessee must not keep the lease from the new owner.
        let passed = |h: VgpuId| {
            cx.vgpu(h).is_some_and(|s| s.in_flight() == 0)
                && cx.online().first().is_some_and(|o| o.group.vgpu != h)
        };
        if let Some(h) = self.lessee
            && (!self.may_stream(h) || passed(h))
        {
            cx.revoke(h);
            self.lessee = None;
        }
        if self.lessee.is_some() || !self.ht_lease {
            return;
        }
        let online = cx.online();
        let Some(owner) = online.first().map(|o| o.group.vgpu) else {
            return;
        };
        if online.iter().all(|o| o.group.vgpu == owner) && self.may_stream(owner) {
            cx.lease(owner, None, None);
            self.lessee = Some(owner);
        }
    }

    /// Joins `v` to the reserve it asks for; `None` when admission control refuses it.
    fn join(&mut self, now: Time, v: VgpuId, want: &Reserve) -> Option<usize> {
        if let Some(name) = &want.shared
            && let Some(&slot) = self.shared_active.get(name)
            && let Some(Some(r)) = self.reserves.get_mut(slot)
        {
            r.members.insert(v);
            return Some(slot);
        }
        let (c, t, enforcement) = match want.shared.as_ref().and_then(|n| self.shared_config.get(n))
        {
            Some(s) => (s.c, s.t, s.enforcement),
            None => (want.c, want.t, want.enforcement),
        };
        if t == 0 || c == 0 || c > t {
            return None;
        }
        // C/T rounded up, so that admitted reserves never exceed the limit.
        let util = (u128::from(c) * u128::from(PPM)).div_ceil(u128::from(t));
        let util = u64::try_from(util).unwrap_or(u64::MAX);
        let used = self.used_ppm.checked_add(util)?;
        if used > self.limit_ppm {
            return None;
        }
        self.used_ppm = used;
        let next = now.saturating_add(t);
        let state = ReserveState {
            name: want.shared.clone(),
            c,
            t,
            enforcement,
            budget: i128::from(c),
            next,
            util,
            members: BTreeSet::from([v]),
            throttled: BTreeSet::new(),
        };
        let slot = match self.reserves.iter().position(Option::is_none) {
            Some(slot) => {
                self.reserves[slot] = Some(state);
                slot
            }
            None => {
                self.reserves.push(Some(state));
                self.reserves.len() - 1
            }
        };
        if let Some(name) = &want.shared {
            self.shared_active.insert(name.clone(), slot);
        }
        self.deadlines.insert((next, slot));
        Some(slot)
    }

    /// Takes `v` out of reserve `slot`; the last member to leave frees it.
    fn leave(&mut self, slot: usize, v: VgpuId) {
        let Some(Some(r)) = self.reserves.get_mut(slot) else {
            return;
        };
        r.members.remove(&v);
        r.throttled.remove(&v);
        if !r.members.is_empty() {
            return;
        }
        if let Some(r) = self.reserves[slot].take() {
            self.used_ppm = self.used_ppm.saturating_sub(r.util);
            self.deadlines.remove(&(r.next, slot));
            if let Some(name) = r.name {
                self.shared_active.remove(&name);
            }
        }
    }

    /// The predicted cost of `v`'s head group, with the preemption impact when running it
    /// will switch the GPU's context.
    fn predict_head(&mut self, cx: &Cx<'_>, v: VgpuId) -> Nanos {
        let Some(head) = cx.vgpu(v).and_then(|s| s.head()) else {
            return 0;
        };
        let before = cx.online().last().map(|o| (o.group.vgpu, o.group.context));
        let before = before.or(self.last_done);
        let switch = before.is_some_and(|b| b != (v, head.context));
        self.predictor.predict(head.signature, switch)
    }

    /// True if `v`'s reserve lets its head group go: PE while e > 0, AE while the predicted
    /// cost x <= e (and e > 0). Background vGPUs are not limited.
    fn within_budget(&mut self, cx: &Cx<'_>, v: VgpuId) -> bool {
        let Some(slot) = self.member(v).and_then(|m| m.reserve) else {
            return true;
        };
        let Some(r) = self.reserve(slot) else {
            return true;
        };
        let (budget, enforcement) = (r.budget, r.enforcement);
        match enforcement {
            Enforcement::Pe => budget > 0,
            Enforcement::Ae => budget > 0 && i128::from(self.predict_head(cx, v)) <= budget,
        }
    }

    /// Takes `v` out of the wait queue until its reserve is replenished.
    fn throttle(&mut self, v: VgpuId) {
        self.ready.remove(v);
        let Some(m) = self.members.get_mut(v.index()) else {
            return;
        };
        m.throttled = true;
        if let Some(slot) = m.reserve
            && let Some(Some(r)) = self.reserves.get_mut(slot)
        {
            r.throttled.insert(v);
        }
    }

    /// Replenishes reserve `slot` for every period boundary up to `now` and wakes its
    /// throttled members.
    fn replenish(&mut self, cx: &Cx<'_>, slot: usize, now: Time) {
        let Some(r) = self.reserve(slot) else { return };
        let (c, t, enforcement) = (r.c, r.t, r.enforcement);
        // Boundaries passed: the one at `next` and every full period after it.
        let periods = (now.saturating_sub(r.next) / t.max(1)).saturating_add(1);
        let next = r.next.saturating_add(periods.saturating_mul(t));
        let members: Vec<VgpuId> = r.members.iter().copied().collect();
        // AE replenishes by the predicted cost x of what waits: the largest head of a member.
        let x = match enforcement {
            Enforcement::Pe => 0,
            Enforcement::Ae => members
                .iter()
                .map(|&v| self.predict_head(cx, v))
                .max()
                .unwrap_or(0),
        };
        let Some(Some(r)) = self.reserves.get_mut(slot) else {
            return;
        };
        let c = i128::from(c);
        let x = i128::from(x);
        // Applying e = min(cap, e + C) k times gives min(cap, e + kC).
        let grown = r
            .budget
            .saturating_add(c.saturating_mul(i128::from(periods)));
        r.budget = match enforcement {
            Enforcement::Ae if x > c => grown.min(x),
            _ => grown.min(c),
        };
        r.next = next;
        self.deadlines.insert((next, slot));
        let woken = std::mem::take(&mut r.throttled);
        for v in woken {
            if let Some(m) = self.members.get_mut(v.index()) {
                m.throttled = false;
            }
            self.index(cx, v);
        }
    }
}

impl Policy for TimeGraph {
    fn name(&self) -> &'static str {
        "timegraph"
    }

    fn attach(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        let i = v.index();
        if self.members.len() <= i {
            self.members.resize(i + 1, Member::default());
        }
        let params = cx.params(v);
        let (sched, wildcard, priority, want) = match self.specs.get(&params.name) {
            Some(s) => {
                let (wildcard, priority) = match s.priority {
                    SpecPriority::Static(p) => (false, p),
                    SpecPriority::Wildcard => (true, self.wildcard_priority),
                };
                let reserve = |enforcement, shared| Reserve {
                    c: s.c,
                    t: s.t,
                    enforcement,
                    shared,
                };
                let want = match &s.reserve {
                    SpecReserve::None => None,
                    SpecReserve::Pe => Some(reserve(Enforcement::Pe, None)),
                    SpecReserve::Ae => Some(reserve(Enforcement::Ae, None)),
                    SpecReserve::Shared(n) => Some(reserve(Enforcement::Pe, Some(n.clone()))),
                };
                (s.sched, wildcard, priority, want)
            }
            None => (
                params.sched.unwrap_or(self.default_sched),
                false,
                params.priority,
                params.reserve,
            ),
        };
        let reserve = want.as_ref().and_then(|w| self.join(cx.now(), v, w));
        self.members[i] = Member {
            attached: true,
            ht: sched == PrioPolicy::Ht,
            wildcard,
            priority,
            wants_reserve: want.is_some(),
            reserve,
            throttled: false,
        };
        self.index(cx, v);
    }

    fn detach(&mut self, _cx: &mut Cx<'_>, v: VgpuId) {
        self.forget(v);
        if self.lessee == Some(v) {
            self.lessee = None;
        }
    }

    fn params_changed(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        let focused = self.focused == Some(v);
        self.forget(v);
        self.attach(cx, v);
        if focused && self.member(v).is_some_and(|m| m.wildcard) {
            self.focused = Some(v);
            self.rekey(cx, v);
        }
        self.settle_lease(cx);
    }

    fn submitted(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        if !self.ready.contains(v) {
            self.index(cx, v);
            self.settle_lease(cx);
        }
    }

    fn withdrawn(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.index(cx, v);
        self.settle_lease(cx);
    }

    fn dispatched(&mut self, cx: &mut Cx<'_>, v: VgpuId, _leased: bool) {
        self.index(cx, v);
        self.settle_lease(cx);
    }

    fn completed(&mut self, _cx: &mut Cx<'_>, done: &Completion) {
        let cost = done.cost();
        self.predictor
            .record(done.signature, cost, done.context_switch);
        self.last_done = Some((done.vgpu, done.context));
        if let Some(slot) = self.member(done.vgpu).and_then(|m| m.reserve)
            && let Some(Some(r)) = self.reserves.get_mut(slot)
        {
            r.budget = r.budget.saturating_sub(i128::from(cost));
        }
    }

    fn timer(&mut self, cx: &mut Cx<'_>) {
        let now = cx.now();
        let mut due = Vec::new();
        // Each reserve has one deadline, so this pops at most one entry per reserve.
        while let Some(&(t, slot)) = self.deadlines.first()
            && t <= now
        {
            self.deadlines.pop_first();
            due.push(slot);
        }
        for slot in due {
            self.replenish(cx, slot, now);
        }
        self.settle_lease(cx);
    }

    fn focus(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        let old = self.focused.take();
        if self.member(v).is_some_and(|m| m.wildcard) {
            self.focused = Some(v);
        }
        if let Some(o) = old
            && o != v
        {
            self.rekey(cx, o);
        }
        self.rekey(cx, v);
        self.settle_lease(cx);
    }

    fn pick(&mut self, cx: &mut Cx<'_>) -> Option<VgpuId> {
        // Every pass either returns or throttles one vGPU out of the queue, so this is bounded
        // and each throttle pays for the insert that put the vGPU in.
        for _ in 0..=self.ready.len() {
            let (key, v) = self.ready.first()?;
            if !self.within_budget(cx, v) {
                self.throttle(v);
                continue;
            }
            let online = cx.online();
            let Some(first) = online.first() else {
                // PRT and HT: the highest-priority waiter goes when the GPU is idle.
                return Some(v);
            };
            // HT: the vGPU that owns everything on the GPU may add to it while no waiter has a
            // higher priority. Reserved vGPUs stay PRT: reservations regulate PRT tasks
            // (§5), which bounds an overrun to one group.
            let owner = first.group.vgpu;
            if online.iter().any(|o| o.group.vgpu != owner) {
                return None;
            }
            let streams = self
                .member(owner)
                .is_some_and(|m| m.ht && m.reserve.is_none());
            let owner_key = self.ready.key(owner);
            return match owner_key {
                Some(k) if streams && k.0 == key.0 && k.1 == key.1 => Some(owner),
                _ => None,
            };
        }
        None
    }

    fn next_deadline(&self) -> Option<Time> {
        self.deadlines.first().map(|&(t, _)| t)
    }

    /// The budget left of the vGPU's admitted reserve (a Shared reserve's pool is its
    /// members' together), with C and T. At or after the replenishment the timer will carry
    /// out, the refill is included: `min(C, e + kC)`, or the budget left if it is larger (an
    /// AE refill by a larger predicted cost). Background vGPUs have none.
    fn budget(&self, v: VgpuId, _state: &VgpuState, now: Time) -> Option<Budget> {
        let r = self
            .member(v)?
            .reserve
            .and_then(|slot| self.reserve(slot))?;
        let c = i128::from(r.c);
        let mut left = r.budget;
        if now >= r.next {
            let periods = ((now - r.next) / r.t.max(1)).saturating_add(1);
            let grown = left.saturating_add(c.saturating_mul(i128::from(periods)));
            left = grown.min(c.max(left));
        }
        let remaining_ns =
            i64::try_from(left).unwrap_or(if left < 0 { i64::MIN } else { i64::MAX });
        Some(Budget {
            remaining_ns,
            capacity_ns: r.c,
            period_ns: Some(r.t),
        })
    }

    /// What TimeGraph applies, spec line or not: the effective priority (`u32::MAX` for the
    /// focused vGPU of a `*` line), the priority policy it runs under (the policy's default
    /// where neither a spec line nor the vGPU names one; PRT for every admitted reserve, §5)
    /// and the reserve in force (a Shared reserve's C, T and enforcement are the pool's; none
    /// for the Background, which includes a reserve admission control refused). The other
    /// fields are the vGPU's own.
    fn effective_params(&self, v: VgpuId, state: &VgpuState) -> VgpuParams {
        let mut params = state.params().clone();
        let Some(m) = self.member(v) else {
            return params;
        };
        params.priority = self.effective_priority(v, m);
        params.sched = Some(if m.ht && m.reserve.is_none() {
            PrioPolicy::Ht
        } else {
            PrioPolicy::Prt
        });
        params.reserve = m
            .reserve
            .and_then(|slot| self.reserve(slot))
            .map(|r| Reserve {
                c: r.c,
                t: r.t,
                enforcement: r.enforcement,
                shared: r.name.clone(),
            });
        params
    }

    fn figures(&self, v: VgpuId) -> Vec<(&'static str, f64)> {
        let Some(m) = self.member(v) else {
            return Vec::new();
        };
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let mut figures = vec![
            ("priority", f64::from(self.effective_priority(v, m))),
            ("ht", flag(m.ht && m.reserve.is_none())),
            ("reserved", flag(m.wants_reserve)),
            ("admitted", flag(m.reserve.is_some())),
            ("background", flag(m.reserve.is_none())),
            ("throttled", flag(m.throttled)),
        ];
        if let Some(r) = m.reserve.and_then(|slot| self.reserve(slot)) {
            figures.push(("budget_ns", r.budget as f64));
            figures.push(("capacity_ns", r.c as f64));
            figures.push(("period_ns", r.t as f64));
        }
        figures
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::Scheduler;
    use crate::model::{CommandGroup, ConfigChange, Decision, Event, GroupKind, NS_PER_US};
    use crate::policy::PolicyConfig;
    use crate::policy::fcfs::Fcfs;
    use crate::testkit::{complete, dispatch, event, lease, submit};

    fn sched(config: TimeGraphConfig, capacity: usize) -> Scheduler {
        Scheduler::new(PolicyConfig::TimeGraph(config).build(), capacity)
    }

    fn prt() -> TimeGraphConfig {
        TimeGraphConfig {
            sched: PrioPolicy::Prt,
            ..TimeGraphConfig::default()
        }
    }

    /// HT without its lease: every group asks.
    fn asking() -> TimeGraphConfig {
        TimeGraphConfig {
            ht_lease: false,
            ..TimeGraphConfig::default()
        }
    }

    /// A vGPU that names PRT for itself.
    fn prt_vm(name: &str, priority: u32) -> VgpuParams {
        VgpuParams {
            sched: Some(PrioPolicy::Prt),
            ..vm(name, priority)
        }
    }

    fn vm(name: &str, priority: u32) -> VgpuParams {
        VgpuParams {
            priority,
            ..VgpuParams::named(name)
        }
    }

    fn reserved(name: &str, priority: u32, c: Nanos, t: Nanos, e: Enforcement) -> VgpuParams {
        VgpuParams {
            reserve: Some(Reserve {
                c,
                t,
                enforcement: e,
                shared: None,
            }),
            ..vm(name, priority)
        }
    }

    fn add(s: &mut Scheduler, params: VgpuParams) -> VgpuId {
        let mut out = Vec::new();
        s.add_vgpu(s.now(), params, &mut out).unwrap()
    }

    fn submit_sig(s: &mut Scheduler, now: Time, v: VgpuId, id: u64, sig: u64) -> Vec<Decision> {
        let mut out = Vec::new();
        let g = CommandGroup::new(id, v, GroupKind::Render, sig);
        s.handle(now, Event::Submitted(g), &mut out).unwrap();
        out
    }

    fn d(v: VgpuId, id: u64) -> Vec<Decision> {
        vec![dispatch(v, id, false)]
    }

    fn fig(s: &Scheduler, v: VgpuId, name: &str) -> Option<f64> {
        s.figures(v)
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|f| f.1)
    }

    #[test]
    fn prt_waits_for_an_idle_gpu_and_wakes_the_highest_priority_waiter() {
        let mut s = sched(prt(), 2);
        let lo = add(&mut s, vm("lo", 1));
        let mid = add(&mut s, vm("mid", 3));
        let hi = add(&mut s, vm("hi", 5));
        let hi2 = add(&mut s, vm("hi2", 5));
        assert_eq!(submit(&mut s, 0, lo, 1), d(lo, 1));
        // The online list has room, but PRT waits for it to be empty.
        assert!(submit(&mut s, 1, lo, 2).is_empty());
        assert!(submit(&mut s, 2, mid, 3).is_empty());
        assert!(submit(&mut s, 3, hi2, 4).is_empty());
        assert!(submit(&mut s, 4, hi, 5).is_empty());
        // Equal priorities go by arrival: hi2 came first.
        assert_eq!(complete(&mut s, 10, lo, 1, 0), d(hi2, 4));
        assert_eq!(complete(&mut s, 20, hi2, 4, 10), d(hi, 5));
        assert_eq!(complete(&mut s, 30, hi, 5, 20), d(mid, 3));
        assert_eq!(complete(&mut s, 40, mid, 3, 30), d(lo, 2));
        assert_eq!(s.vgpu(mid).unwrap().account().wait_time, 28);
    }

    #[test]
    fn ht_lets_the_owner_go_back_to_back_until_a_higher_priority_waits() {
        // Every group asks here; the lease that spares the asking is tested below.
        let mut s = sched(asking(), 4);
        let a = add(&mut s, vm("a", 1));
        let b = add(&mut s, vm("b", 5));
        let c = add(&mut s, prt_vm("c", 1));
        assert_eq!(submit(&mut s, 0, a, 1), d(a, 1));
        assert_eq!(submit(&mut s, 1, a, 2), d(a, 2));
        // c waits; its equal priority does not stop the owner a.
        assert!(submit(&mut s, 2, c, 10).is_empty());
        assert_eq!(submit(&mut s, 3, a, 3), d(a, 3));
        // A higher-priority waiter stops it.
        assert!(submit(&mut s, 4, b, 20).is_empty());
        assert!(submit(&mut s, 5, a, 4).is_empty());
        // Waiters are woken only when the online list is empty.
        assert!(complete(&mut s, 6, a, 1, 0).is_empty());
        assert!(complete(&mut s, 7, a, 2, 6).is_empty());
        assert_eq!(complete(&mut s, 8, a, 3, 7), d(b, 20));
        assert_eq!(complete(&mut s, 9, b, 20, 8), d(c, 10));
        // c's own sched (PRT) overrides the default HT: it does not stream.
        assert!(submit(&mut s, 10, c, 11).is_empty());
        assert_eq!(fig(&s, c, "ht"), Some(0.0));
        assert_eq!(fig(&s, a, "ht"), Some(1.0));
        assert_eq!(complete(&mut s, 12, c, 10, 9), d(a, 4));
    }

    #[test]
    fn the_ht_owner_streams_under_a_lease_until_a_rival_at_its_priority_or_above_waits() {
        let mut s = sched(TimeGraphConfig::default(), 4);
        let a = add(&mut s, vm("a", 1));
        let b = add(&mut s, vm("b", 5));
        let low = add(&mut s, vm("low", 0));
        let c = add(&mut s, prt_vm("c", 1));
        // a owns the GPU and nobody waits: its first group is granted with a lease, and the
        // next ones go without asking.
        assert_eq!(submit(&mut s, 0, a, 1), vec![d(a, 1)[0].clone(), lease(a)]);
        assert_eq!(submit(&mut s, 1, a, 2), vec![dispatch(a, 2, true)]);
        // A lower priority waiting does not end it (HT's condition (ii)), and does not get a
        // lease of its own when the GPU goes idle for a moment.
        assert!(submit(&mut s, 2, low, 30).is_empty());
        assert_eq!(submit(&mut s, 3, a, 3), vec![dispatch(a, 3, true)]);
        // A higher priority waiting ends it; a's groups in flight finish first.
        assert_eq!(submit(&mut s, 4, b, 20), vec![Decision::Revoke { vgpu: a }]);
        assert!(submit(&mut s, 5, a, 4).is_empty());
        assert!(complete(&mut s, 6, a, 1, 0).is_empty());
        assert!(complete(&mut s, 7, a, 2, 6).is_empty());
        // b goes, alone at its priority: it streams now.
        assert_eq!(
            complete(&mut s, 8, a, 3, 7),
            vec![d(b, 20)[0].clone(), lease(b)]
        );
        // b leaves; a (older than low, higher priority) goes next, but c (PRT, priority 1)
        // waits beside it at the same priority: no lease, equal priorities take turns.
        // b's lease ends when the GPU goes to another vGPU while b has nothing in flight.
        assert!(submit(&mut s, 9, c, 10).is_empty());
        assert_eq!(
            complete(&mut s, 10, b, 20, 8),
            vec![d(a, 4)[0].clone(), Decision::Revoke { vgpu: b }]
        );
        assert_eq!(complete(&mut s, 11, a, 4, 10), d(c, 10));
        // c is PRT: it never streams, even alone.
        assert!(submit(&mut s, 12, c, 11).is_empty());
        assert_eq!(complete(&mut s, 13, c, 10, 11), d(c, 11));
        // low, alone now, streams.
        assert_eq!(
            complete(&mut s, 14, c, 11, 13),
            vec![d(low, 30)[0].clone(), lease(low)]
        );
    }

    #[test]
    fn a_rival_at_the_same_priority_ends_the_lease_and_a_reserve_never_gets_one() {
        let mut s = sched(TimeGraphConfig::default(), 4);
        let a = add(&mut s, vm("a", 3));
        let b = add(&mut s, vm("b", 3));
        let r = add(&mut s, reserved("r", 9, 50, 100, Enforcement::Pe));
        assert_eq!(submit(&mut s, 0, a, 1), vec![d(a, 1)[0].clone(), lease(a)]);
        assert_eq!(submit(&mut s, 1, b, 10), vec![Decision::Revoke { vgpu: a }]);
        // a has nothing queued: b streams once it has the GPU.
        assert_eq!(
            complete(&mut s, 2, a, 1, 0),
            vec![d(b, 10)[0].clone(), lease(b)]
        );
        assert!(complete(&mut s, 3, b, 10, 2).is_empty());
        // a waiting beside it ends b's lease, and a streams once it has the GPU.
        assert_eq!(
            submit(&mut s, 4, a, 2),
            vec![Decision::Revoke { vgpu: b }, d(a, 2)[0].clone(), lease(a)]
        );
        // Parameters that make a PRT take the lease away.
        let mut out = Vec::new();
        let prt = Event::Config(ConfigChange::Params(a, prt_vm("a", 3)));
        s.handle(5, prt, &mut out).unwrap();
        assert_eq!(out, vec![Decision::Revoke { vgpu: a }]);
        assert_eq!(complete(&mut s, 6, a, 2, 4), Vec::<Decision>::new());
        // A reserved vGPU runs PRT: granted group by group, never leased.
        assert_eq!(submit(&mut s, 7, r, 30), d(r, 30));
        assert!(submit(&mut s, 8, r, 31).is_empty());
        assert_eq!(complete(&mut s, 9, r, 30, 7), d(r, 31));
        assert!(s.vgpu(r).and_then(|st| st.lease().copied()).is_none());
    }

    #[test]
    fn without_ht_lease_every_group_asks() {
        let mut s = sched(asking(), 4);
        let a = add(&mut s, vm("a", 1));
        assert_eq!(submit(&mut s, 0, a, 1), d(a, 1));
        assert_eq!(submit(&mut s, 1, a, 2), d(a, 2));
        assert!(s.vgpu(a).and_then(|st| st.lease().copied()).is_none());
        assert!(s.may_ask());
    }

    #[test]
    fn a_lone_ht_vgpu_streams_and_nobody_asks_until_another_vgpu_comes() {
        let mut s = sched(TimeGraphConfig::default(), 1);
        let a = add(&mut s, vm("a", 1));
        assert!(s.may_ask());
        assert_eq!(submit(&mut s, 0, a, 1), vec![d(a, 1)[0].clone(), lease(a)]);
        assert!(!s.may_ask());
        add(&mut s, vm("b", 0));
        assert!(s.may_ask());
    }

    #[test]
    fn pe_charges_actual_cost_overruns_by_one_group_and_replenishes_per_period() {
        // HT and room for 4 groups: a reserve still dispatches one group at a time.
        let mut s = sched(TimeGraphConfig::default(), 4);
        let a = add(&mut s, reserved("a", 0, 10, 100, Enforcement::Pe));
        assert_eq!(fig(&s, a, "budget_ns"), Some(10.0));
        assert_eq!(submit(&mut s, 0, a, 1), d(a, 1));
        assert!(submit(&mut s, 0, a, 2).is_empty());
        assert!(submit(&mut s, 0, a, 3).is_empty());
        // The group overran: budget -5, and the GPU stays idle.
        assert!(complete(&mut s, 15, a, 1, 0).is_empty());
        assert_eq!(fig(&s, a, "budget_ns"), Some(-5.0));
        assert_eq!(fig(&s, a, "throttled"), Some(1.0));
        assert_eq!(s.next_deadline(), Some(100));
        // e = min(C, e + C) = 5.
        assert_eq!(event(&mut s, 100, Event::Timer), d(a, 2));
        assert_eq!(fig(&s, a, "budget_ns"), Some(5.0));
        assert!(complete(&mut s, 108, a, 2, 100).is_empty());
        assert_eq!(fig(&s, a, "budget_ns"), Some(-3.0));
        assert_eq!(s.next_deadline(), Some(200));
        // A late timer replenishes for both boundaries passed (200 and 300), capped at C.
        assert_eq!(event(&mut s, 350, Event::Timer), d(a, 3));
        assert_eq!(fig(&s, a, "budget_ns"), Some(10.0));
        assert_eq!(s.next_deadline(), Some(400));
    }

    #[test]
    fn ae_dispatches_only_predicted_costs_that_fit_and_replenishes_up_to_x() {
        let config = TimeGraphConfig {
            preemption_cost: 5,
            ..prt()
        };
        let mut s = sched(config, 1);
        let a = add(&mut s, reserved("a", 1, 10, 100, Enforcement::Ae));
        let b = add(&mut s, vm("b", 0));
        // No history: the worst case seen so far (none) is predicted.
        assert_eq!(submit_sig(&mut s, 0, a, 1, 7), d(a, 1));
        assert!(complete(&mut s, 8, a, 1, 0).is_empty());
        // x = 8 > e = 2: it waits although the GPU is idle.
        assert!(submit_sig(&mut s, 9, a, 2, 7).is_empty());
        assert_eq!(fig(&s, a, "throttled"), Some(1.0));
        // x <= C: e = min(C, e + C) = 10.
        assert_eq!(event(&mut s, 100, Event::Timer), d(a, 2));
        assert_eq!(fig(&s, a, "budget_ns"), Some(10.0));
        assert!(complete(&mut s, 108, a, 2, 100).is_empty());
        // b teaches the predictor a 30 ns signature.
        assert_eq!(submit_sig(&mut s, 109, b, 3, 9), d(b, 3));
        assert!(complete(&mut s, 139, b, 3, 109).is_empty());
        // a's next group switches contexts after b: x = 30 + 5 (preemption impact) > C, so
        // e = min(x, e + C) grows by C per period until it covers x.
        assert!(submit_sig(&mut s, 140, a, 4, 9).is_empty());
        for (now, budget) in [(200, 12.0), (300, 22.0), (400, 32.0)] {
            assert!(event(&mut s, now, Event::Timer).is_empty());
            assert_eq!(fig(&s, a, "budget_ns"), Some(budget));
        }
        assert_eq!(event(&mut s, 500, Event::Timer), d(a, 4));
        assert_eq!(fig(&s, a, "budget_ns"), Some(35.0));
    }

    #[test]
    fn the_budget_query_follows_the_reserve_down_by_cost_and_up_each_period() {
        let mut s = sched(prt(), 1);
        let a = add(&mut s, reserved("a", 0, 10, 100, Enforcement::Pe));
        let bg = add(&mut s, vm("bg", 0));
        let budget = |s: &Scheduler, now, left| {
            let want = Budget {
                remaining_ns: left,
                capacity_ns: 10,
                period_ns: Some(100),
            };
            assert_eq!(s.budget(a, now), Some(want), "at {now}");
        };
        budget(&s, 0, 10);
        assert_eq!(s.budget(bg, 0), None);
        assert_eq!(submit(&mut s, 0, a, 1), d(a, 1));
        complete(&mut s, 4, a, 1, 0);
        budget(&s, 4, 6);
        assert_eq!(submit(&mut s, 5, a, 2), d(a, 2));
        complete(&mut s, 15, a, 2, 5);
        budget(&s, 15, -4);
        // Due but not yet delivered: the refill the timer will make is shown already.
        budget(&s, 99, -4);
        budget(&s, 100, 6);
        budget(&s, 200, 10);
        event(&mut s, 100, Event::Timer);
        budget(&s, 100, 6);
        // Leaving the reserve (parameters without one) leaves no budget.
        let ev = Event::Config(ConfigChange::Params(a, vm("a", 0)));
        event(&mut s, 101, ev);
        assert_eq!(s.budget(a, 101), None);
    }

    #[test]
    fn background_runs_only_when_reserved_vgpus_of_its_priority_cannot() {
        let mut s = sched(prt(), 1);
        let r = add(&mut s, reserved("r", 0, 10, 100, Enforcement::Pe));
        let b = add(&mut s, vm("b", 0));
        assert_eq!(fig(&s, b, "background"), Some(1.0));
        assert_eq!(fig(&s, b, "budget_ns"), None);
        assert_eq!(submit(&mut s, 0, r, 1), d(r, 1));
        assert!(submit(&mut s, 1, b, 2).is_empty());
        assert!(submit(&mut s, 2, r, 3).is_empty());
        // At equal priority r goes first despite its younger group.
        assert_eq!(complete(&mut s, 6, r, 1, 0), d(r, 3));
        // r is out of budget (-2): the Background vGPU gets the GPU.
        assert_eq!(complete(&mut s, 12, r, 3, 6), d(b, 2));
        assert!(submit(&mut s, 13, r, 4).is_empty());
        assert!(submit(&mut s, 14, b, 5).is_empty());
        assert_eq!(complete(&mut s, 20, b, 2, 12), d(b, 5));
        // r's group stays queued on an idle GPU until replenishment.
        assert!(complete(&mut s, 30, b, 5, 20).is_empty());
        assert_eq!(s.vgpu(r).unwrap().queued(), 1);
        assert_eq!(event(&mut s, 100, Event::Timer), d(r, 4));
        assert_eq!(fig(&s, r, "budget_ns"), Some(8.0));
        assert_eq!(s.vgpu(r).unwrap().account().gpu_time, 12);
    }

    #[test]
    fn shared_reserves_pool_one_budget() {
        let config = TimeGraphConfig {
            shared: vec![SharedReserve {
                name: "bombs".into(),
                c: 10,
                t: 100,
                enforcement: Enforcement::Pe,
            }],
            ..prt()
        };
        let mut s = sched(config, 1);
        let join = |name: &str| VgpuParams {
            reserve: Some(Reserve {
                c: 50,
                t: 100,
                enforcement: Enforcement::Ae,
                shared: Some("bombs".into()),
            }),
            ..vm(name, 0)
        };
        let x = add(&mut s, join("x"));
        let y = add(&mut s, join("y"));
        // The configured C wins over the members' own.
        assert_eq!(fig(&s, x, "capacity_ns"), Some(10.0));
        assert_eq!(submit(&mut s, 0, x, 1), d(x, 1));
        assert!(submit(&mut s, 1, y, 2).is_empty());
        assert_eq!(complete(&mut s, 6, x, 1, 0), d(y, 2));
        assert!(complete(&mut s, 12, y, 2, 6).is_empty());
        assert_eq!(fig(&s, x, "budget_ns"), Some(-2.0));
        assert_eq!(fig(&s, y, "budget_ns"), Some(-2.0));
        assert!(submit(&mut s, 13, x, 3).is_empty());
        assert!(submit(&mut s, 14, y, 4).is_empty());
        assert_eq!(event(&mut s, 100, Event::Timer), d(x, 3));
        assert_eq!(complete(&mut s, 102, x, 3, 100), d(y, 4));
        assert_eq!(fig(&s, y, "budget_ns"), Some(6.0));
    }

    #[test]
    fn admission_control_sends_excess_reserves_to_background() {
        let config = TimeGraphConfig {
            admission_limit: 0.5,
            ..prt()
        };
        let mut s = sched(config, 1);
        let a = add(&mut s, reserved("a", 0, 2, 10, Enforcement::Pe));
        let b = add(&mut s, reserved("b", 0, 3, 10, Enforcement::Pe));
        // 0.2 + 0.3 reaches the limit exactly; 0.1 more does not fit.
        let c = add(&mut s, reserved("c", 0, 1, 10, Enforcement::Ae));
        assert_eq!(fig(&s, b, "admitted"), Some(1.0));
        assert_eq!(fig(&s, c, "reserved"), Some(1.0));
        assert_eq!(fig(&s, c, "admitted"), Some(0.0));
        assert_eq!(fig(&s, c, "background"), Some(1.0));
        assert_eq!(fig(&s, c, "budget_ns"), None);
        assert_eq!(fig(&s, c, "priority"), Some(0.0));
        // At equal priority the refused vGPU runs below the admitted ones.
        assert_eq!(submit(&mut s, 0, b, 1), d(b, 1));
        assert!(submit(&mut s, 1, c, 2).is_empty());
        assert!(submit(&mut s, 2, a, 3).is_empty());
        assert_eq!(complete(&mut s, 3, b, 1, 0), d(a, 3));
        // a leaving frees its share: a new reserve of 0.2 fits again.
        let mut out = Vec::new();
        s.remove_vgpu(4, a, &mut out).unwrap();
        assert_eq!(out, d(c, 2));
        let e = add(&mut s, reserved("e", 0, 2, 10, Enforcement::Pe));
        assert_eq!(fig(&s, e, "admitted"), Some(1.0));
        // So does a parameter change that drops b's reserve.
        let ev = Event::Config(ConfigChange::Params(b, vm("b", 0)));
        event(&mut s, 5, ev);
        assert_eq!(fig(&s, b, "admitted"), Some(0.0));
        let f = add(&mut s, reserved("f", 0, 3, 10, Enforcement::Pe));
        assert_eq!(fig(&s, f, "admitted"), Some(1.0));
    }

    #[test]
    fn spec_lines_apply_by_name_and_focus_raises_wildcard_priorities() {
        let config = TimeGraphConfig {
            wildcard_priority: 2,
            specs: vec![
                "<game:prt:none:*:0:0>".into(),
                "<video:prt:none:*:0:0>".into(),
                "<desk:prt:none:5:0:0>".into(),
            ],
            ..TimeGraphConfig::default()
        };
        let mut s = sched(config, 1);
        // The spec overrides the vGPU's own priority.
        let game = add(&mut s, vm("game", 100));
        let video = add(&mut s, vm("video", 0));
        let desk = add(&mut s, vm("desk", 0));
        assert_eq!(fig(&s, game, "priority"), Some(2.0));
        assert_eq!(fig(&s, desk, "priority"), Some(5.0));
        assert_eq!(fig(&s, game, "ht"), Some(0.0));
        assert_eq!(submit(&mut s, 0, desk, 1), d(desk, 1));
        assert!(submit(&mut s, 1, game, 2).is_empty());
        assert!(submit(&mut s, 2, video, 3).is_empty());
        assert!(submit(&mut s, 3, desk, 4).is_empty());
        assert!(event(&mut s, 4, Event::Config(ConfigChange::Focus(video))).is_empty());
        assert_eq!(fig(&s, video, "priority"), Some(f64::from(u32::MAX)));
        assert_eq!(complete(&mut s, 5, desk, 1, 0), d(video, 3));
        // Focus moves to game; video falls back to the wildcard default.
        event(&mut s, 6, Event::Config(ConfigChange::Focus(game)));
        assert_eq!(fig(&s, video, "priority"), Some(2.0));
        assert!(submit(&mut s, 7, video, 5).is_empty());
        assert_eq!(complete(&mut s, 8, video, 3, 5), d(game, 2));
        assert_eq!(complete(&mut s, 9, game, 2, 8), d(desk, 4));
        // Focusing a vGPU without a wildcard takes focus from the wildcard one.
        event(&mut s, 10, Event::Config(ConfigChange::Focus(desk)));
        assert_eq!(fig(&s, game, "priority"), Some(2.0));
        assert_eq!(fig(&s, desk, "priority"), Some(5.0));
    }

    #[test]
    fn spec_lines_give_reserves_and_bad_lines_are_reported() {
        let config = TimeGraphConfig {
            specs: vec![
                "<bomb:ht:pe:1:10:100>".into(),
                "<b2:prt:bombs:0:20:100>".into(),
                "<b3:prt:bombs:0:50:100>".into(),
                "<broken:prt:pe:1:10>".into(),
            ],
            ..TimeGraphConfig::default()
        };
        assert_eq!(
            config.validate(),
            Err(ConfigError::Spec {
                index: 3,
                source: SpecError::FieldCount(5)
            })
        );
        let mut s = sched(config, 1);
        let bomb = add(&mut s, vm("bomb", 7));
        assert_eq!(fig(&s, bomb, "capacity_ns"), Some((10 * NS_PER_US) as f64));
        assert_eq!(fig(&s, bomb, "period_ns"), Some((100 * NS_PER_US) as f64));
        assert_eq!(fig(&s, bomb, "priority"), Some(1.0));
        // A Shared reserve the config does not define is created by its first member's line.
        let b2 = add(&mut s, vm("b2", 0));
        let b3 = add(&mut s, vm("b3", 0));
        assert_eq!(fig(&s, b3, "capacity_ns"), Some((20 * NS_PER_US) as f64));
        assert_eq!(fig(&s, b2, "admitted"), Some(1.0));
        // No line for this name: its own parameters apply.
        let other = add(&mut s, reserved("broken", 4, 5, 10, Enforcement::Pe));
        assert_eq!(fig(&s, other, "capacity_ns"), Some(5.0));
        assert_eq!(fig(&s, other, "priority"), Some(4.0));
    }

    #[test]
    fn effective_params_show_what_spec_lines_focus_and_admission_apply() {
        let config = TimeGraphConfig {
            wildcard_priority: 3,
            admission_limit: 0.85,
            specs: vec![
                "<game:ht:none:10:1:1>".into(),
                "<video:prt:none:*:0:0>".into(),
                "<bomb:ht:pe:1:10:100>".into(),
                "<b2:prt:pool:0:20:100>".into(),
            ],
            ..TimeGraphConfig::default()
        };
        let mut s = sched(config, 1);
        let own = |name: &str| VgpuParams {
            sched: Some(PrioPolicy::Prt),
            weight: 512,
            target_fps: Some(30.0),
            ..reserved(name, 4, 5, 10, Enforcement::Ae)
        };
        let game = add(&mut s, own("game"));
        let video = add(&mut s, own("video"));
        let bomb = add(&mut s, own("bomb"));
        let b2 = add(&mut s, vm("b2", 9));
        let plain = add(&mut s, own("plain"));
        let refused = add(&mut s, reserved("refused", 1, 50, 100, Enforcement::Pe));
        let eff = |s: &Scheduler, v| s.effective_params(v).unwrap();
        // The spec line replaces priority, sched and reserve; the rest stays the VM's.
        let want = VgpuParams {
            priority: 10,
            sched: Some(PrioPolicy::Ht),
            reserve: None,
            ..own("game")
        };
        assert_eq!(eff(&s, game), want);
        assert_eq!(s.vgpu(game).unwrap().params(), &own("game"));
        // A wildcard line: the default priority, the highest while focused.
        assert_eq!(eff(&s, video).priority, 3);
        event(&mut s, 1, Event::Config(ConfigChange::Focus(video)));
        assert_eq!(eff(&s, video).priority, u32::MAX);
        event(&mut s, 2, Event::Config(ConfigChange::Focus(game)));
        assert_eq!(eff(&s, video).priority, 3);
        // A private reserve from the line, in µs; reserved vGPUs run PRT whatever they ask.
        let want = Reserve {
            c: 10 * NS_PER_US,
            t: 100 * NS_PER_US,
            enforcement: Enforcement::Pe,
            shared: None,
        };
        assert_eq!(eff(&s, bomb).reserve, Some(want));
        assert_eq!(eff(&s, bomb).sched, Some(PrioPolicy::Prt));
        assert_eq!(eff(&s, b2).reserve.unwrap().shared.as_deref(), Some("pool"));
        assert_eq!(eff(&s, b2).priority, 0);
        // No line: its own parameters are in force.
        assert_eq!(eff(&s, plain), own("plain"));
        // Refused by admission control (0.8 of 0.85 is taken): Background, its default sched.
        let e = eff(&s, refused);
        assert_eq!(
            (e.reserve, e.sched, e.priority),
            (None, Some(PrioPolicy::Ht), 1)
        );
        assert_eq!(s.effective_params(VgpuId(99)), None);
        // Back to no scheduling: the VMs' own parameters again.
        let mut out = Vec::new();
        s.set_policy(3, PolicyConfig::None.build(), &mut out);
        assert_eq!(eff(&s, game), own("game"));
        assert_eq!(eff(&s, b2), vm("b2", 9));
    }

    #[test]
    fn config_validation_refuses_unusable_values() {
        assert_eq!(TimeGraphConfig::default().validate(), Ok(()));
        let bad = |f: fn(&mut TimeGraphConfig)| {
            let mut c = TimeGraphConfig::default();
            f(&mut c);
            c.validate().unwrap_err()
        };
        assert_eq!(
            bad(|c| c.admission_limit = f64::NAN),
            ConfigError::AdmissionLimit
        );
        assert_eq!(
            bad(|c| c.predictor_entries = 0),
            ConfigError::PredictorEntries
        );
        fn shared(c: Nanos, t: Nanos) -> SharedReserve {
            SharedReserve {
                name: "s".into(),
                c,
                t,
                enforcement: Enforcement::Pe,
            }
        }
        assert!(matches!(
            bad(|c| c.shared = vec![shared(20, 10)]),
            ConfigError::BadShared { index: 0, .. }
        ));
        assert!(matches!(
            bad(|c| c.shared = vec![shared(1, 10), shared(2, 10)]),
            ConfigError::BadShared { index: 1, .. }
        ));
        assert!(matches!(
            bad(|c| c.specs = vec!["<a:prt:pe:1:20:10>".into()]),
            ConfigError::Spec { index: 0, .. }
        ));
        let c = TimeGraphConfig {
            specs: vec!["<a:prt:none:1:0:0>".into(), "<a:ht:none:2:0:0>".into()],
            ..TimeGraphConfig::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::DuplicateSpec(1)));
    }

    #[test]
    fn survives_a_switch_from_fcfs_with_queued_work() {
        let mut s = Scheduler::new(Box::new(Fcfs::default()), 2);
        let lo = add(&mut s, vm("lo", 1));
        let mid = add(&mut s, vm("mid", 3));
        let hi = add(&mut s, reserved("hi", 5, 50, 100, Enforcement::Pe));
        assert_eq!(submit(&mut s, 0, lo, 1), d(lo, 1));
        assert_eq!(submit(&mut s, 1, lo, 2), d(lo, 2));
        assert!(submit(&mut s, 2, lo, 3).is_empty());
        assert!(submit(&mut s, 3, mid, 4).is_empty());
        assert!(submit(&mut s, 4, hi, 5).is_empty());
        let mut out = Vec::new();
        s.set_policy(5, PolicyConfig::TimeGraph(prt()).build(), &mut out);
        assert!(out.is_empty());
        assert_eq!(s.policy_name(), "timegraph");
        assert_eq!(fig(&s, hi, "admitted"), Some(1.0));
        assert_eq!(s.next_deadline(), Some(105));
        // PRT: both FCFS groups must finish before the highest priority waiter goes.
        assert!(complete(&mut s, 6, lo, 1, 0).is_empty());
        assert_eq!(complete(&mut s, 7, lo, 2, 1), d(hi, 5));
        assert_eq!(complete(&mut s, 8, hi, 5, 7), d(mid, 4));
        assert_eq!(complete(&mut s, 9, mid, 4, 8), d(lo, 3));
        assert_eq!(fig(&s, hi, "budget_ns"), Some(49.0));
    }
}
