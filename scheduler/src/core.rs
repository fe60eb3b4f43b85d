//! The scheduler core: the vGPU table, per-vGPU queues, the GPU-online list, accounting and
//! leases. It turns events into policy callbacks and carries out the policy's choices.

use std::collections::{BTreeSet, VecDeque};

use serde::Serialize;

use crate::model::{
    Budget, CommandGroup, ConfigChange, CpuHint, Decision, Event, GroupId, Nanos, Time, VgpuId,
    VgpuParams,
};
use crate::policy::{Completion, Policy};

/// Most vGPUs one scheduler serves: far above one host's VMs, and it bounds the vGPU table.
pub const MAX_VGPUS: usize = 4096;
/// Most groups one vGPU may have queued or in flight. A guest that submits faster than its
/// share is refused beyond this instead of growing the daemon's memory without bound.
pub const MAX_GROUPS_PER_VGPU: usize = 4096;
/// Most groups the GPU may have in flight at once (the GPU-online list's capacity bound).
pub const MAX_CAPACITY: usize = 64;
/// Highest VGRIS frame-rate target accepted: above any display and keeps 1/fps meaningful.
pub const MAX_TARGET_FPS: f64 = 1000.0;

/// Errors of the scheduler core. Each means the caller sent something inconsistent; the
/// scheduler's state is unchanged by the event that caused it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    /// No vGPU has this id.
    #[error("unknown vGPU {0:?}")]
    UnknownVgpu(VgpuId),
    /// The group id is already queued or in flight for this vGPU.
    #[error("group {0:?} is already queued or in flight")]
    DuplicateGroup(GroupId),
    /// No group with this id is in flight for this vGPU.
    #[error("group {0:?} is not in flight")]
    UnknownGroup(GroupId),
    /// The vGPU has [`MAX_GROUPS_PER_VGPU`] groups queued or in flight.
    #[error("vGPU {0:?} has too many groups queued or in flight")]
    QueueFull(VgpuId),
    /// [`MAX_VGPUS`] vGPUs exist.
    #[error("too many vGPUs")]
    TooManyVgpus,
    /// The event's time is earlier than an event already handled.
    #[error("time went backwards: {now} after {last}")]
    TimeWentBackwards {
        /// The time given.
        now: Time,
        /// The latest time seen.
        last: Time,
    },
    /// A completion that finished before it started.
    #[error("group {0:?} finished before it started")]
    BadTimes(GroupId),
    /// Parameters that no policy can use.
    #[error("invalid parameters: {0}")]
    BadParams(&'static str),
}

/// A queued group.
#[derive(Debug, Clone)]
struct Queued {
    group: CommandGroup,
    seq: u64,
    submitted: Time,
}

/// A group on the GPU-online list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Online {
    /// The group.
    pub group: CommandGroup,
    /// When it was submitted.
    pub submitted: Time,
    /// When it was dispatched.
    pub dispatched: Time,
    /// Dispatched under a lease.
    pub leased: bool,
}

/// What the core has counted for one vGPU since it was added.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Account {
    /// Groups submitted for a grant.
    pub submitted: u64,
    /// Groups dispatched (granted or leased).
    pub dispatched: u64,
    /// Groups completed.
    pub completed: u64,
    /// Groups cancelled by their submitter, queued or in flight (see [`Event::Cancelled`]).
    pub cancelled: u64,
    /// GPU time used by completed groups, and charged to groups cancelled in flight.
    pub gpu_time: Nanos,
    /// Time completed groups spent waiting between submission and dispatch.
    pub wait_time: Nanos,
    /// Frame boundaries seen.
    pub frames: u64,
    /// When the last group finished.
    pub last_finish: Option<Time>,
}

/// A lease as the core tracks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// GPU time left, if bounded.
    pub budget: Option<Nanos>,
    /// The GPU time it was granted with, if bounded: `budget` counts down from it.
    pub granted: Option<Nanos>,
    /// When it ends, if bounded.
    pub until: Option<Time>,
}

/// One vGPU's state in the core.
#[derive(Debug, Clone)]
pub struct VgpuState {
    params: VgpuParams,
    queue: VecDeque<Queued>,
    live: BTreeSet<GroupId>,
    in_flight: usize,
    account: Account,
    cpu: CpuHint,
    suspended: bool,
    lease: Option<Lease>,
}

impl VgpuState {
    /// Its parameters.
    pub fn params(&self) -> &VgpuParams {
        &self.params
    }
    /// How many groups wait in its queue.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }
    /// The oldest queued group.
    pub fn head(&self) -> Option<&CommandGroup> {
        self.queue.front().map(|q| &q.group)
    }
    /// The arrival order of the oldest queued group: smaller is older, across all vGPUs.
    pub fn head_seq(&self) -> Option<u64> {
        self.queue.front().map(|q| q.seq)
    }
    /// When the oldest queued group was submitted.
    pub fn head_submitted(&self) -> Option<Time> {
        self.queue.front().map(|q| q.submitted)
    }
    /// How many of its groups are on the GPU-online list.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }
    /// Its accounting.
    pub fn account(&self) -> &Account {
        &self.account
    }
    /// The latest CPU hint.
    pub fn cpu(&self) -> &CpuHint {
        &self.cpu
    }
    /// True while suspended.
    pub fn suspended(&self) -> bool {
        self.suspended
    }
    /// Its lease, if it holds one.
    pub fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref()
    }
}

/// The state the core keeps; policies read it through [`Cx`].
#[derive(Debug)]
struct CoreState {
    now: Time,
    capacity: usize,
    vgpus: Vec<Option<VgpuState>>,
    count: usize,
    online: Vec<Online>,
    next_seq: u64,
    lease_ends: BTreeSet<(Time, VgpuId)>,
    last_on_gpu: Option<(VgpuId, u32)>,
    /// vGPUs holding a lease, and vGPUs suspended (never both at once): counted where they
    /// change, so that [`Scheduler::may_ask`], asked on every round of the daemon's loop, is
    /// O(1) instead of a walk over the table.
    leased: usize,
    suspended: usize,
}

impl CoreState {
    fn get(&self, v: VgpuId) -> Option<&VgpuState> {
        self.vgpus.get(v.index()).and_then(Option::as_ref)
    }
    fn get_mut(&mut self, v: VgpuId) -> Option<&mut VgpuState> {
        self.vgpus.get_mut(v.index()).and_then(Option::as_mut)
    }
}

/// What a policy sees and may do during a callback.
#[derive(Debug)]
pub struct Cx<'a> {
    st: &'a mut CoreState,
    out: &'a mut Vec<Decision>,
}

impl Cx<'_> {
    /// The current time.
    pub fn now(&self) -> Time {
        self.st.now
    }
    /// How many groups the GPU-online list may hold (1 = exclusive).
    pub fn capacity(&self) -> usize {
        self.st.capacity
    }
    /// The groups in flight, oldest dispatch first.
    pub fn online(&self) -> &[Online] {
        &self.st.online
    }
    /// One vGPU's state. Ids given to a callback always exist.
    pub fn vgpu(&self, v: VgpuId) -> Option<&VgpuState> {
        self.st.get(v)
    }
    /// The parameters of a vGPU (defaults for an unknown id).
    pub fn params(&self, v: VgpuId) -> VgpuParams {
        self.vgpu(v).map(|s| s.params.clone()).unwrap_or_default()
    }
    /// The number of vGPUs.
    pub fn vgpu_count(&self) -> usize {
        self.st.count
    }
    /// All vGPU ids, lowest first. Linear in the table size: for periodic work, not per group.
    pub fn vgpu_ids(&self) -> Vec<VgpuId> {
        let ids = self.st.vgpus.iter().enumerate();
        ids.filter(|(_, s)| s.is_some())
            .map(|(i, _)| VgpuId(i as u32))
            .collect()
    }
    /// Stop the vGPU from dispatching; also withdraws its lease.
    pub fn suspend(&mut self, v: VgpuId) {
        self.revoke(v);
        if let Some(s) = self.st.get_mut(v)
            && !s.suspended
        {
            s.suspended = true;
            self.st.suspended += 1;
            self.out.push(Decision::Suspend { vgpu: v });
        }
    }
    /// Let a suspended vGPU dispatch again.
    pub fn resume(&mut self, v: VgpuId) {
        if let Some(s) = self.st.get_mut(v)
            && s.suspended
        {
            s.suspended = false;
            self.st.suspended -= 1;
            self.out.push(Decision::Resume { vgpu: v });
        }
    }
    /// Let the vGPU dispatch without asking until revoked, until `until` or until it used
    /// `budget`. Replaces a lease it holds. Ignored while the vGPU is suspended.
    pub fn lease(&mut self, v: VgpuId, budget: Option<Nanos>, until: Option<Time>) {
        let Some(s) = self.st.get_mut(v) else { return };
        if s.suspended {
            return;
        }
        let new = Lease {
            budget,
            granted: budget,
            until,
        };
        if s.lease == Some(new) {
            return;
        }
        match s.lease.replace(new) {
            Some(Lease { until: Some(t), .. }) => {
                self.st.lease_ends.remove(&(t, v));
            }
            Some(_) => {}
            None => self.st.leased += 1,
        }
        if let Some(t) = until {
            self.st.lease_ends.insert((t, v));
        }
        self.out.push(Decision::Lease {
            vgpu: v,
            budget,
            until,
        });
    }
    /// Withdraw the vGPU's lease, if it holds one.
    pub fn revoke(&mut self, v: VgpuId) {
        let Some(s) = self.st.get_mut(v) else { return };
        if let Some(old) = s.lease.take() {
            self.st.leased -= 1;
            if let Some(t) = old.until {
                self.st.lease_ends.remove(&(t, v));
            }
            self.out.push(Decision::Revoke { vgpu: v });
        }
    }
    /// Suggest a CPU weight for the VM's cgroup.
    pub fn cpu_weight(&mut self, v: VgpuId, weight: u32) {
        self.out.push(Decision::CpuWeight { vgpu: v, weight });
    }
}

/// The scheduler: the core plus the installed policy.
#[derive(Debug)]
pub struct Scheduler {
    st: CoreState,
    policy: Box<dyn Policy>,
}

/// Checks parameters the way [`Scheduler::add_vgpu`] and a parameter change do, so a control
/// interface can refuse them before anything changes.
pub fn check_params(p: &VgpuParams) -> Result<(), SchedError> {
    if p.weight == 0 {
        return Err(SchedError::BadParams("weight must be at least 1"));
    }
    if let Some(r) = &p.reserve
        && (r.t == 0 || r.c == 0 || r.c > r.t)
    {
        return Err(SchedError::BadParams("a reserve needs 0 < C <= T"));
    }
    if let Some(fps) = p.target_fps
        && !(fps > 0.0 && fps <= MAX_TARGET_FPS)
    {
        return Err(SchedError::BadParams("target_fps must be in (0, 1000]"));
    }
    Ok(())
}

impl Scheduler {
    /// A scheduler running `policy` on a GPU that holds `capacity` groups in flight (clamped to
    /// 1..=[`MAX_CAPACITY`]).
    pub fn new(policy: Box<dyn Policy>, capacity: usize) -> Self {
        Scheduler {
            st: CoreState {
                now: 0,
                capacity: capacity.clamp(1, MAX_CAPACITY),
                vgpus: Vec::new(),
                count: 0,
                online: Vec::new(),
                next_seq: 0,
                lease_ends: BTreeSet::new(),
                last_on_gpu: None,
                leased: 0,
                suspended: 0,
            },
            policy,
        }
    }

    /// The installed policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// A vGPU's state.
    pub fn vgpu(&self, v: VgpuId) -> Option<&VgpuState> {
        self.st.get(v)
    }

    /// The groups in flight.
    pub fn online(&self) -> &[Online] {
        &self.st.online
    }

    /// True while some vGPU may ask for a grant: one that holds no lease and is not
    /// suspended. An event loop need not hurry for devices that dispatch on their own.
    pub fn may_ask(&self) -> bool {
        self.st.count > self.st.leased + self.st.suspended
    }

    /// The latest time handled.
    pub fn now(&self) -> Time {
        self.st.now
    }

    /// Policy-specific figures for a vGPU.
    pub fn figures(&self, v: VgpuId) -> Vec<(&'static str, f64)> {
        self.policy.figures(v)
    }

    /// What vGPU `v` may still use of the GPU at `now` (a time before the latest event handled
    /// counts as that event's): the policy's budget for it, else what is left of a bounded
    /// lease it holds. `None` for an unknown vGPU and one that nothing budgets. Changes nothing
    /// and allocates nothing; O(log n) at most in every policy.
    pub fn budget(&self, v: VgpuId, now: Time) -> Option<Budget> {
        let s = self.st.get(v)?;
        let now = now.max(self.st.now);
        self.policy.budget(v, s, now).or_else(|| {
            let lease = s.lease?;
            Some(Budget {
                remaining_ns: i64::try_from(lease.budget?).unwrap_or(i64::MAX),
                capacity_ns: lease.granted?,
                period_ns: None,
            })
        })
    }

    /// The parameters the policy applies to vGPU `v` now: its own, except where the policy
    /// overrides them (TimeGraph's spec lines and focus). `None` for an unknown vGPU.
    pub fn effective_params(&self, v: VgpuId) -> Option<VgpuParams> {
        let s = self.st.get(v)?;
        Some(self.policy.effective_params(v, s))
    }

    /// When the caller must deliver [`Event::Timer`] next.
    pub fn next_deadline(&self) -> Option<Time> {
        let lease = self.st.lease_ends.first().map(|&(t, _)| t);
        crate::policy::earliest([lease, self.policy.next_deadline()])
    }

    fn advance(&mut self, now: Time) -> Result<(), SchedError> {
        if now < self.st.now {
            return Err(SchedError::TimeWentBackwards {
                now,
                last: self.st.now,
            });
        }
        self.st.now = now;
        Ok(())
    }

    fn cx<'a>(st: &'a mut CoreState, out: &'a mut Vec<Decision>) -> Cx<'a> {
        Cx { st, out }
    }

    /// Adds a vGPU; returns its id.
    pub fn add_vgpu(
        &mut self,
        now: Time,
        params: VgpuParams,
        out: &mut Vec<Decision>,
    ) -> Result<VgpuId, SchedError> {
        check_params(&params)?;
        if self.st.count >= MAX_VGPUS {
            return Err(SchedError::TooManyVgpus);
        }
        self.advance(now)?;
        let slot = match self.st.vgpus.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.st.vgpus.push(None);
                self.st.vgpus.len() - 1
            }
        };
        self.st.vgpus[slot] = Some(VgpuState {
            params,
            queue: VecDeque::new(),
            live: BTreeSet::new(),
            in_flight: 0,
            account: Account::default(),
            cpu: CpuHint::default(),
            suspended: false,
            lease: None,
        });
        self.st.count += 1;
        let v = VgpuId(slot as u32);
        self.policy.attach(&mut Self::cx(&mut self.st, out), v);
        self.dispatch_round(out);
        Ok(v)
    }

    /// Removes a vGPU (its VM went away): its queued groups are dropped and its groups in
    /// flight are forgotten. Returns the accounting it had.
    pub fn remove_vgpu(
        &mut self,
        now: Time,
        v: VgpuId,
        out: &mut Vec<Decision>,
    ) -> Result<Account, SchedError> {
        if self.st.get(v).is_none() {
            return Err(SchedError::UnknownVgpu(v));
        }
        self.advance(now)?;
        if let Some(s) = self.st.get_mut(v) {
            s.queue.clear();
        }
        self.st.online.retain(|o| o.group.vgpu != v);
        let mut cx = Self::cx(&mut self.st, out);
        cx.revoke(v);
        self.policy.detach(&mut cx, v);
        let state = self.st.vgpus[v.index()].take();
        self.st.count -= 1;
        if state.as_ref().is_some_and(|s| s.suspended) {
            self.st.suspended -= 1;
        }
        if self.st.last_on_gpu.is_some_and(|(owner, _)| owner == v) {
            self.st.last_on_gpu = None;
        }
        self.dispatch_round(out);
        Ok(state.map(|s| s.account).unwrap_or_default())
    }

    /// Installs another policy. Queued groups, groups in flight and accounting are kept;
    /// leases and suspensions of the old policy are withdrawn.
    pub fn set_policy(&mut self, now: Time, policy: Box<dyn Policy>, out: &mut Vec<Decision>) {
        self.st.now = self.st.now.max(now);
        let ids = Self::cx(&mut self.st, out).vgpu_ids();
        let mut cx = Self::cx(&mut self.st, out);
        for &v in &ids {
            cx.revoke(v);
            cx.resume(v);
        }
        self.policy = policy;
        for &v in &ids {
            self.policy.attach(&mut Self::cx(&mut self.st, out), v);
        }
        self.dispatch_round(out);
    }

    /// Handles one event at time `now`; decisions are appended to `out`.
    pub fn handle(
        &mut self,
        now: Time,
        event: Event,
        out: &mut Vec<Decision>,
    ) -> Result<(), SchedError> {
        match &event {
            Event::Submitted(g) | Event::Dispatched(g) => self.check_new_group(g)?,
            Event::Completed { vgpu, group, .. } => {
                if self.st.get(*vgpu).is_none() {
                    return Err(SchedError::UnknownVgpu(*vgpu));
                }
                if !self.st.online.iter().any(|o| o.group.id == *group) {
                    return Err(SchedError::UnknownGroup(*group));
                }
            }
            Event::Cancelled { vgpu, group } => {
                let s = self.st.get(*vgpu).ok_or(SchedError::UnknownVgpu(*vgpu))?;
                if !s.live.contains(group) {
                    return Err(SchedError::UnknownGroup(*group));
                }
            }
            Event::CpuHint(v, _) | Event::Frame(v) => self.check_vgpu(*v)?,
            Event::Config(ConfigChange::Params(v, p)) => {
                self.check_vgpu(*v)?;
                check_params(p)?;
            }
            Event::Config(ConfigChange::Focus(v)) => self.check_vgpu(*v)?,
            Event::Timer => {}
        }
        if let Event::Completed {
            group,
            start,
            finish,
            ..
        } = &event
            && finish < start
        {
            return Err(SchedError::BadTimes(*group));
        }
        self.advance(now)?;
        match event {
            Event::Submitted(g) => self.submitted(g, out),
            Event::Dispatched(g) => {
                // The device already dispatched it: accounted, but no decision to send back.
                let v = g.vgpu;
                self.put_online(g, now, true);
                self.policy
                    .dispatched(&mut Self::cx(&mut self.st, out), v, true);
            }
            Event::Completed {
                vgpu,
                group,
                start,
                finish,
            } => self.completed(vgpu, group, start, finish, false, out),
            Event::Cancelled { vgpu, group } => self.cancelled(vgpu, group, out),
            Event::Timer => {
                while let Some(&(t, v)) = self.st.lease_ends.first() {
                    if t > now {
                        break;
                    }
                    Self::cx(&mut self.st, out).revoke(v);
                }
                self.policy.timer(&mut Self::cx(&mut self.st, out));
            }
            Event::CpuHint(v, hint) => {
                if let Some(s) = self.st.get_mut(v) {
                    s.cpu = hint;
                }
                self.policy.cpu_hint(&mut Self::cx(&mut self.st, out), v);
            }
            Event::Frame(v) => {
                if let Some(s) = self.st.get_mut(v) {
                    s.account.frames += 1;
                }
                let at = self.policy.frame(&mut Self::cx(&mut self.st, out), v);
                out.push(Decision::Present {
                    vgpu: v,
                    at: at.max(now),
                });
            }
            Event::Config(ConfigChange::Params(v, p)) => {
                if let Some(s) = self.st.get_mut(v) {
                    s.params = p;
                }
                self.policy
                    .params_changed(&mut Self::cx(&mut self.st, out), v);
            }
            Event::Config(ConfigChange::Focus(v)) => {
                self.policy.focus(&mut Self::cx(&mut self.st, out), v);
            }
        }
        self.dispatch_round(out);
        Ok(())
    }

    fn check_vgpu(&self, v: VgpuId) -> Result<(), SchedError> {
        match self.st.get(v) {
            Some(_) => Ok(()),
            None => Err(SchedError::UnknownVgpu(v)),
        }
    }

    fn check_new_group(&self, g: &CommandGroup) -> Result<(), SchedError> {
        let s = self.st.get(g.vgpu).ok_or(SchedError::UnknownVgpu(g.vgpu))?;
        if s.live.contains(&g.id) {
            return Err(SchedError::DuplicateGroup(g.id));
        }
        if s.live.len() >= MAX_GROUPS_PER_VGPU {
            return Err(SchedError::QueueFull(g.vgpu));
        }
        Ok(())
    }

    fn submitted(&mut self, g: CommandGroup, out: &mut Vec<Decision>) {
        let now = self.st.now;
        let v = g.vgpu;
        let seq = self.st.next_seq;
        self.st.next_seq += 1;
        let Some(s) = self.st.get_mut(v) else { return };
        s.account.submitted += 1;
        let leased = s.lease.is_some() && !s.suspended && s.queue.is_empty();
        if leased {
            out.push(Decision::Dispatch {
                vgpu: v,
                group: g.id,
                leased: true,
            });
            self.put_online(g, now, true);
            self.policy
                .dispatched(&mut Self::cx(&mut self.st, out), v, true);
            return;
        }
        let Some(s) = self.st.get_mut(v) else { return };
        s.live.insert(g.id);
        s.queue.push_back(Queued {
            group: g,
            seq,
            submitted: now,
        });
        self.policy.submitted(&mut Self::cx(&mut self.st, out), v);
    }

    /// Puts a group on the GPU-online list.
    fn put_online(&mut self, g: CommandGroup, submitted: Time, leased: bool) {
        let now = self.st.now;
        if let Some(s) = self.st.get_mut(g.vgpu) {
            s.live.insert(g.id);
            s.in_flight += 1;
            s.account.dispatched += 1;
        }
        self.st.online.push(Online {
            group: g,
            submitted,
            dispatched: now,
            leased,
        });
    }

    /// A group leaves: from its queue, or from the GPU-online list as a completion that ran
    /// from its dispatch until now.
    fn cancelled(&mut self, v: VgpuId, id: GroupId, out: &mut Vec<Decision>) {
        let now = self.st.now;
        let Some(s) = self.st.get_mut(v) else { return };
        if let Some(pos) = s.queue.iter().position(|q| q.group.id == id) {
            s.queue.remove(pos);
            s.live.remove(&id);
            s.account.cancelled += 1;
            self.policy.withdrawn(&mut Self::cx(&mut self.st, out), v);
            return;
        }
        let dispatched = self
            .st
            .online
            .iter()
            .find(|o| o.group.id == id && o.group.vgpu == v)
            .map(|o| o.dispatched);
        if let Some(start) = dispatched {
            self.completed(v, id, start, now, true, out);
        }
    }

    fn completed(
        &mut self,
        v: VgpuId,
        id: GroupId,
        start: Time,
        finish: Time,
        cancelled: bool,
        out: &mut Vec<Decision>,
    ) {
        let Some(pos) = self
            .st
            .online
            .iter()
            .position(|o| o.group.id == id && o.group.vgpu == v)
        else {
            return;
        };
        let o = self.st.online.remove(pos);
        let here = (v, o.group.context);
        let context_switch = self.st.last_on_gpu.is_some_and(|prev| prev != here);
        self.st.last_on_gpu = Some(here);
        let done = Completion {
            vgpu: v,
            kind: o.group.kind,
            signature: o.group.signature,
            context: o.group.context,
            submitted: o.submitted,
            dispatched: o.dispatched,
            start,
            finish,
            context_switch,
        };
        let mut spent = false;
        if let Some(s) = self.st.get_mut(v) {
            s.live.remove(&id);
            s.in_flight = s.in_flight.saturating_sub(1);
            let a = &mut s.account;
            if cancelled {
                a.cancelled += 1;
            } else {
                a.completed += 1;
            }
            a.gpu_time = a.gpu_time.saturating_add(done.cost());
            a.wait_time = a
                .wait_time
                .saturating_add(o.dispatched.saturating_sub(o.submitted));
            a.last_finish = Some(finish);
            if let Some(lease) = &mut s.lease
                && let Some(b) = &mut lease.budget
            {
                *b = b.saturating_sub(done.cost());
                spent = *b == 0;
            }
        }
        let mut cx = Self::cx(&mut self.st, out);
        if spent {
            cx.revoke(v);
        }
        self.policy.completed(&mut cx, &done);
    }

    /// Dispatches queued groups while the GPU-online list has room and the policy picks.
    fn dispatch_round(&mut self, out: &mut Vec<Decision>) {
        while self.st.online.len() < self.st.capacity {
            let Some(v) = self.policy.pick(&mut Self::cx(&mut self.st, out)) else {
                break;
            };
            let Some(s) = self.st.get_mut(v) else { break };
            if s.suspended {
                break;
            }
            let Some(q) = s.queue.pop_front() else { break };
            out.push(Decision::Dispatch {
                vgpu: v,
                group: q.group.id,
                leased: false,
            });
            self.put_online(q.group, q.submitted, false);
            self.policy
                .dispatched(&mut Self::cx(&mut self.st, out), v, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CostSignature, Enforcement, GroupKind, Reserve};
    use crate::policy::fcfs::Fcfs;
    use crate::testkit::{complete, dispatch, submit};

    fn sched(capacity: usize, n: usize) -> (Scheduler, Vec<VgpuId>) {
        let mut s = Scheduler::new(Box::new(Fcfs::default()), capacity);
        let mut out = Vec::new();
        let ids = (0..n)
            .map(|i| {
                s.add_vgpu(0, VgpuParams::named(&format!("vm{i}")), &mut out)
                    .unwrap()
            })
            .collect();
        assert!(out.is_empty());
        (s, ids)
    }

    #[test]
    fn fcfs_dispatches_in_arrival_order_within_capacity() {
        let (mut s, v) = sched(1, 2);
        assert_eq!(submit(&mut s, 1, v[1], 10), vec![dispatch(v[1], 10, false)]);
        assert!(submit(&mut s, 2, v[0], 20).is_empty());
        assert!(submit(&mut s, 3, v[1], 11).is_empty());
        assert_eq!(
            complete(&mut s, 5, v[1], 10, 1),
            vec![dispatch(v[0], 20, false)]
        );
        assert_eq!(
            complete(&mut s, 9, v[0], 20, 5),
            vec![dispatch(v[1], 11, false)]
        );
        let a = s.vgpu(v[1]).unwrap().account().clone();
        assert_eq!(
            (a.submitted, a.dispatched, a.completed, a.gpu_time),
            (2, 2, 1, 4)
        );
        assert_eq!(s.vgpu(v[0]).unwrap().account().wait_time, 3);
        // No scheduling, no budget; no vGPU, no budget.
        assert_eq!(s.budget(v[0], 9), None);
        assert_eq!(s.budget(VgpuId(7), 9), None);
        // A policy that only reads parameters applies the vGPU's own.
        assert_eq!(s.effective_params(v[1]), Some(VgpuParams::named("vm1")));
        assert_eq!(s.effective_params(VgpuId(7)), None);
    }

    #[test]
    fn capacity_bounds_the_online_list() {
        let (mut s, v) = sched(2, 1);
        for id in 0..4 {
            submit(&mut s, id, v[0], id);
        }
        assert_eq!(s.online().len(), 2);
        assert_eq!(s.vgpu(v[0]).unwrap().queued(), 2);
        assert_eq!(s.vgpu(v[0]).unwrap().in_flight(), 2);
    }

    #[test]
    fn inconsistent_events_are_refused_without_effect() {
        let (mut s, v) = sched(1, 1);
        let mut out = Vec::new();
        submit(&mut s, 10, v[0], 1);
        let g = CommandGroup::new(1, v[0], GroupKind::Load, 1);
        assert_eq!(
            s.handle(11, Event::Submitted(g), &mut out),
            Err(SchedError::DuplicateGroup(GroupId(1)))
        );
        let g = CommandGroup::new(2, VgpuId(9), GroupKind::Load, 1);
        assert_eq!(
            s.handle(11, Event::Submitted(g), &mut out),
            Err(SchedError::UnknownVgpu(VgpuId(9)))
        );
        let ev = Event::Completed {
            vgpu: v[0],
            group: GroupId(7),
            start: 0,
            finish: 1,
        };
        assert_eq!(
            s.handle(11, ev, &mut out),
            Err(SchedError::UnknownGroup(GroupId(7)))
        );
        let ev = Event::Completed {
            vgpu: v[0],
            group: GroupId(1),
            start: 5,
            finish: 4,
        };
        assert_eq!(
            s.handle(11, ev, &mut out),
            Err(SchedError::BadTimes(GroupId(1)))
        );
        assert!(matches!(
            s.handle(3, Event::Timer, &mut out),
            Err(SchedError::TimeWentBackwards { .. })
        ));
        let bad = VgpuParams {
            weight: 0,
            ..VgpuParams::default()
        };
        assert!(s.add_vgpu(12, bad, &mut out).is_err());
        let bad = VgpuParams {
            reserve: Some(Reserve {
                c: 5,
                t: 4,
                enforcement: Enforcement::Pe,
                shared: None,
            }),
            ..VgpuParams::default()
        };
        let ev = Event::Config(ConfigChange::Params(v[0], bad));
        assert!(s.handle(12, ev, &mut out).is_err());
        assert!(out.is_empty());
        assert_eq!(s.online().len(), 1);
        assert_eq!(s.now(), 10);
    }

    #[test]
    fn a_vgpu_cannot_queue_without_bound() {
        let (mut s, v) = sched(1, 1);
        let mut out = Vec::new();
        for id in 0..MAX_GROUPS_PER_VGPU as u64 {
            let g = CommandGroup::new(id, v[0], GroupKind::Load, 1);
            s.handle(0, Event::Submitted(g), &mut out).unwrap();
        }
        let g = CommandGroup::new(u64::MAX, v[0], GroupKind::Load, 1);
        assert_eq!(
            s.handle(0, Event::Submitted(g), &mut out),
            Err(SchedError::QueueFull(v[0]))
        );
    }

    #[test]
    fn removing_a_vgpu_frees_its_slot_and_lets_others_run() {
        let (mut s, v) = sched(1, 2);
        submit(&mut s, 1, v[0], 1);
        submit(&mut s, 2, v[0], 2);
        submit(&mut s, 3, v[1], 3);
        let mut out = Vec::new();
        let acct = s.remove_vgpu(4, v[0], &mut out).unwrap();
        assert_eq!(acct.submitted, 2);
        assert_eq!(out, vec![dispatch(v[1], 3, false)]);
        let again = s.add_vgpu(5, VgpuParams::named("new"), &mut out).unwrap();
        assert_eq!(again, v[0]);
        assert_eq!(s.vgpu(again).unwrap().account().submitted, 0);
    }

    #[test]
    fn swapping_the_policy_keeps_queues_and_accounting() {
        let (mut s, v) = sched(1, 2);
        submit(&mut s, 1, v[0], 1);
        submit(&mut s, 2, v[1], 2);
        let mut out = Vec::new();
        s.set_policy(3, Box::new(Fcfs::default()), &mut out);
        assert!(out.is_empty());
        assert_eq!(
            complete(&mut s, 4, v[0], 1, 1),
            vec![dispatch(v[1], 2, false)]
        );
        assert_eq!(s.vgpu(v[0]).unwrap().account().completed, 1);
    }

    /// A test policy that leases and suspends on request, to drive the core's mechanics.
    #[derive(Debug, Default)]
    struct Manual {
        inner: Fcfs,
    }
    impl Policy for Manual {
        fn name(&self) -> &'static str {
            "manual"
        }
        fn attach(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
            self.inner.attach(cx, v)
        }
        fn detach(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
            self.inner.detach(cx, v)
        }
        fn submitted(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
            self.inner.submitted(cx, v)
        }
        fn dispatched(&mut self, cx: &mut Cx<'_>, v: VgpuId, l: bool) {
            self.inner.dispatched(cx, v, l)
        }
        fn withdrawn(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
            self.inner.withdrawn(cx, v)
        }
        fn focus(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
            // Focus toggles: lease with a budget of 10 and an end at 100, or suspend.
            if cx.vgpu(v).unwrap().lease().is_some() {
                cx.suspend(v);
            } else if cx.vgpu(v).unwrap().suspended() {
                cx.resume(v);
            } else {
                cx.lease(v, Some(10), Some(100));
            }
        }
        fn pick(&mut self, cx: &mut Cx<'_>) -> Option<VgpuId> {
            self.inner.pick(cx)
        }
    }

    #[test]
    fn leases_bypass_the_queue_until_spent_or_expired() {
        let mut s = Scheduler::new(Box::new(Manual::default()), 1);
        let mut out = Vec::new();
        let a = s.add_vgpu(0, VgpuParams::named("a"), &mut out).unwrap();
        s.handle(0, Event::Config(ConfigChange::Focus(a)), &mut out)
            .unwrap();
        assert_eq!(
            out,
            vec![Decision::Lease {
                vgpu: a,
                budget: Some(10),
                until: Some(100)
            }]
        );
        assert_eq!(s.next_deadline(), Some(100));
        // Leased groups go straight online, beyond the capacity.
        let leased = |id| Decision::Dispatch {
            vgpu: a,
            group: GroupId(id),
            leased: true,
        };
        // The lease's budget is the vGPU's budget: the policy has none of its own.
        let budget = |left| Budget {
            remaining_ns: left,
            capacity_ns: 10,
            period_ns: None,
        };
        assert_eq!(s.budget(a, 0), Some(budget(10)));
        assert_eq!(submit(&mut s, 1, a, 1), vec![leased(1)]);
        assert_eq!(submit(&mut s, 2, a, 2), vec![leased(2)]);
        assert_eq!(s.online().len(), 2);
        // 6 + 4 ns of GPU time spend the budget of 10: the lease is revoked.
        assert!(complete(&mut s, 7, a, 1, 1).is_empty());
        assert_eq!(s.budget(a, 7), Some(budget(4)));
        assert_eq!(
            complete(&mut s, 11, a, 2, 7),
            vec![Decision::Revoke { vgpu: a }]
        );
        assert_eq!(s.budget(a, 11), None);
        assert_eq!(submit(&mut s, 12, a, 3), vec![dispatch(a, 3, false)]);
        // A lease that expires by time.
        out.clear();
        s.handle(13, Event::Config(ConfigChange::Focus(a)), &mut out)
            .unwrap();
        s.handle(100, Event::Timer, &mut out).unwrap();
        assert_eq!(out.last(), Some(&Decision::Revoke { vgpu: a }));
        assert_eq!(s.next_deadline(), None);
    }

    #[test]
    fn device_reported_dispatches_are_accounted_without_a_decision() {
        let (mut s, v) = sched(1, 1);
        let mut out = Vec::new();
        let g = CommandGroup::new(1, v[0], GroupKind::Load, 1);
        s.handle(5, Event::Dispatched(g), &mut out).unwrap();
        assert!(out.is_empty());
        assert_eq!(s.online().len(), 1);
        assert!(s.online()[0].leased);
        assert_eq!(s.vgpu(v[0]).unwrap().account().dispatched, 1);
        assert!(complete(&mut s, 9, v[0], 1, 5).is_empty());
        assert_eq!(s.vgpu(v[0]).unwrap().account().gpu_time, 4);
    }

    #[test]
    fn suspended_vgpus_do_not_dispatch_and_suspension_revokes() {
        let mut s = Scheduler::new(Box::new(Manual::default()), 1);
        let mut out = Vec::new();
        let a = s.add_vgpu(0, VgpuParams::named("a"), &mut out).unwrap();
        let focus = |s: &mut Scheduler, out: &mut Vec<Decision>| {
            s.handle(1, Event::Config(ConfigChange::Focus(a)), out)
                .unwrap()
        };
        focus(&mut s, &mut out);
        out.clear();
        focus(&mut s, &mut out);
        assert_eq!(
            out,
            vec![Decision::Revoke { vgpu: a }, Decision::Suspend { vgpu: a }]
        );
        assert!(submit(&mut s, 1, a, 1).is_empty());
        out.clear();
        focus(&mut s, &mut out);
        assert_eq!(
            out,
            vec![Decision::Resume { vgpu: a }, dispatch(a, 1, false)]
        );
    }

    #[test]
    fn frames_are_presented_at_once_without_pacing() {
        let (mut s, v) = sched(1, 1);
        let mut out = Vec::new();
        s.handle(42, Event::Frame(v[0]), &mut out).unwrap();
        assert_eq!(out, vec![Decision::Present { vgpu: v[0], at: 42 }]);
        assert_eq!(s.vgpu(v[0]).unwrap().account().frames, 1);
    }

    #[test]
    fn cost_signatures_ignore_order_but_not_multiplicity() {
        let a = CostSignature::from_methods(&mut [(1, 64), (2, 128)]);
        let b = CostSignature::from_methods(&mut [(2, 128), (1, 64)]);
        let c = CostSignature::from_methods(&mut [(2, 128), (1, 64), (1, 64)]);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }
}
