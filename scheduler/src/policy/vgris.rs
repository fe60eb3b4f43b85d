//! VGRIS (Yu et al., HPDC 2013, §3 and Algorithm 1): SLA-aware frame pacing, proportional-share
//! GPU reservations, and the hybrid controller that switches between the two.
//!
//! - SLA-aware: the present of every frame is delayed so that the frame takes the VM's target
//!   latency `1 / target_fps`: `sleep = target - (measured compute + predicted present cost)`,
//!   the prediction being the mean of the last [`DEFAULT_HISTORY`] present costs. GPU groups go
//!   first come, first served, except that a released present goes first (the paper's command
//!   flush before the sleep, which keeps the present cost small and predictable).
//! - Proportional share: TimeGraph's Posterior Enforcement with period `t` and budget `s_i * t`,
//!   `e_i = min(t s_i, e_i + t s_i)` every period; a vGPU dispatches only while `e_i > 0` and is
//!   debited by the actual GPU time of its groups. Replenishment is lazy: a vGPU's budget is
//!   brought up to date from the number of period boundaries passed whenever it is touched, and
//!   only a vGPU with queued work and no budget waits for a timer (at the boundary that makes its
//!   budget positive), so no event costs O(n) however many vGPUs share the GPU.
//! - Hybrid: a controller every interval switches to SLA-aware when some VM's FPS stayed below
//!   `fps_thres` for `time`, and back to proportional share with `s_i = u_i + (1 - Σu)/n` when
//!   the total GPU usage stayed below `gpu_thres` for `time`.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::core::{Cx, MAX_TARGET_FPS, VgpuState};
use crate::model::{Budget, GroupKind, NS_PER_MS, NS_PER_SEC, NS_PER_US, Nanos, Time, VgpuId};
use crate::policy::ready::ReadySet;
use crate::policy::{Completion, Policy, earliest};

/// How many past present costs the SLA-aware predictor averages (the paper's "past twenty").
pub const DEFAULT_HISTORY: usize = 20;
/// Largest present-cost history accepted: bounds each vGPU's memory whatever the config says.
pub const MAX_HISTORY: usize = 1024;
/// The proportional-share period the paper uses: 1 ms, short enough to prevent long lags.
pub const DEFAULT_SHARE_PERIOD: Nanos = NS_PER_MS;
/// Shortest share period accepted: below this the per-period replenishment would dominate.
pub const MIN_SHARE_PERIOD: Nanos = 10 * NS_PER_US;
/// Longest share period accepted: keeps `period * share` far inside `i64` budgets.
pub const MAX_SHARE_PERIOD: Nanos = 10 * NS_PER_SEC;
/// The hybrid controller's period in the paper: every second.
pub const DEFAULT_CONTROLLER_INTERVAL: Nanos = NS_PER_SEC;
/// Shortest controller interval accepted: an FPS measured over less is meaningless.
pub const MIN_CONTROLLER_INTERVAL: Nanos = 10 * NS_PER_MS;
/// Longest controller interval accepted (one hour).
pub const MAX_CONTROLLER_INTERVAL: Nanos = 3_600 * NS_PER_SEC;
/// The paper's minimal acceptable frame rate (its SLA is 30 FPS).
pub const DEFAULT_FPS_THRES: f64 = 30.0;
/// Preferred minimal total GPU usage (fraction). The paper gives no number; 0.9 leaves SLA-aware
/// mode only when at least a tenth of the GPU stays idle.
pub const DEFAULT_GPU_THRES: f64 = 0.9;
/// How long a condition must hold before the hybrid controller switches: the paper's 5 s.
pub const DEFAULT_TIME: Nanos = 5 * NS_PER_SEC;
/// Longest `time` accepted (one day): keeps the interval count small.
pub const MAX_TIME: Nanos = 86_400 * NS_PER_SEC;
/// The least share a vGPU gets from the hybrid formula, so that a VM that used no GPU in the
/// last interval is not starved forever once it has work again.
pub const MIN_SHARE: f64 = 0.001;

/// Which VGRIS algorithm runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VgrisMode {
    /// SLA-aware scheduling: pace presents to the target frame latency, FCFS on the GPU.
    #[default]
    Sla,
    /// Proportional-share scheduling: PE reservations with shares from the vGPU weights.
    Share,
    /// Hybrid scheduling: Algorithm 1 switches between the two, starting with fair shares.
    Hybrid,
}

/// VGRIS's global parameters. Per-vGPU inputs are `VgpuParams::target_fps` (SLA-aware) and
/// `VgpuParams::weight` (share `s_i = weight_i / Σ weight`).
///
/// Out-of-range values are clamped to the `MIN_`/`MAX_` constants of this module; a non-finite
/// threshold falls back to its default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VgrisConfig {
    /// The algorithm (`"sla"`, `"share"` or `"hybrid"`). Default `sla`.
    pub mode: VgrisMode,
    /// Proportional-share period `t`, in nanoseconds. Default 1 ms.
    pub share_period: Nanos,
    /// Hybrid controller interval, in nanoseconds. Default 1 s.
    pub controller_interval: Nanos,
    /// Hybrid: minimal acceptable frames per second of a VM with a `target_fps`. Default 30.
    pub fps_thres: f64,
    /// Hybrid: preferred minimal total GPU usage, a fraction in [0, 1]. Default 0.9.
    pub gpu_thres: f64,
    /// Hybrid: how long (nanoseconds) a condition must hold before switching, rounded up to
    /// whole controller intervals. Default 5 s.
    pub time: Nanos,
    /// SLA-aware: how many past present costs the predictor averages. Default 20.
    pub history: usize,
}

impl Default for VgrisConfig {
    fn default() -> Self {
        VgrisConfig {
            mode: VgrisMode::default(),
            share_period: DEFAULT_SHARE_PERIOD,
            controller_interval: DEFAULT_CONTROLLER_INTERVAL,
            fps_thres: DEFAULT_FPS_THRES,
            gpu_thres: DEFAULT_GPU_THRES,
            time: DEFAULT_TIME,
            history: DEFAULT_HISTORY,
        }
    }
}

impl VgrisConfig {
    /// The configuration with every value brought into its accepted range.
    fn sanitized(&self) -> Self {
        let finite_in = |x: f64, lo: f64, hi: f64, default: f64| {
            if x.is_finite() {
                x.clamp(lo, hi)
            } else {
                default
            }
        };
        VgrisConfig {
            mode: self.mode,
            share_period: self.share_period.clamp(MIN_SHARE_PERIOD, MAX_SHARE_PERIOD),
            controller_interval: self
                .controller_interval
                .clamp(MIN_CONTROLLER_INTERVAL, MAX_CONTROLLER_INTERVAL),
            fps_thres: finite_in(self.fps_thres, 0.0, MAX_TARGET_FPS, DEFAULT_FPS_THRES),
            gpu_thres: finite_in(self.gpu_thres, 0.0, 1.0, DEFAULT_GPU_THRES),
            time: self.time.min(MAX_TIME),
            history: self.history.clamp(1, MAX_HISTORY),
        }
    }
}

/// The algorithm in force now (fixed unless the mode is hybrid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Algo {
    SlaAware,
    PropShare,
}

/// The target frame latency of a frame rate, if the vGPU has one.
fn target_latency(fps: Option<f64>) -> Option<Nanos> {
    let fps = fps.filter(|f| f.is_finite() && *f > 0.0)?;
    // A float-to-int cast saturates; `target_fps` is validated to (0, 1000] by the core.
    Some((NS_PER_SEC as f64 / fps) as Nanos)
}

/// One vGPU's VGRIS state.
#[derive(Debug, Clone)]
struct Slot {
    /// Proportional share `s_i`, in (0, 1].
    share: f64,
    /// Budget per period `t * s_i`, at least 1 ns.
    cap: i64,
    /// Budget left `e_i` after the first `applied` period boundaries; negative after an overrun.
    budget: i64,
    /// Share-period boundaries (at `0, t, 2t, ...`) already applied to `budget`.
    applied: u64,
    /// The vGPU had a group on the GPU at its last update: the boundaries since then refill it
    /// without the cap (see [`Vgris::settle`]).
    running: bool,
    /// The last present costs, oldest first.
    costs: VecDeque<Nanos>,
    /// Their sum.
    cost_sum: u128,
    /// When the current frame's computation began: the previous present's return, or its
    /// release while its completion has not been seen.
    frame_start: Option<Time>,
    /// When the last present was released.
    release: Option<Time>,
    /// When the last frame event came.
    last_frame: Option<Time>,
    /// Frame rate from the last two frame events.
    fps: f64,
    /// The sleep given to the last frame.
    delay: Nanos,
    /// Frames since the controller's last look.
    window_frames: u64,
    /// The core's GPU time of this vGPU at the controller's last look.
    gpu_mark: Nanos,
    /// When the vGPU joined this policy.
    joined: Time,
    /// Consecutive controller intervals with a frame rate below the threshold.
    low_fps: u64,
    /// GPU usage fraction `u_i` in the controller's last interval.
    usage: f64,
}

impl Slot {
    fn new(now: Time, gpu_time: Nanos, applied: u64, running: bool) -> Self {
        Slot {
            share: 0.0,
            cap: 1,
            // Cut to the cap by the first rebalance: a newcomer starts with a full budget.
            budget: i64::MAX,
            applied,
            running,
            costs: VecDeque::new(),
            cost_sum: 0,
            frame_start: None,
            release: None,
            last_frame: None,
            fps: 0.0,
            delay: 0,
            window_frames: 0,
            gpu_mark: gpu_time,
            joined: now,
            low_fps: 0,
            usage: 0.0,
        }
    }

    /// The predicted present cost: the mean of the recorded history (0 without history).
    fn predicted_present(&self) -> Nanos {
        let n = self.costs.len() as u128;
        if n == 0 {
            return 0;
        }
        Nanos::try_from(self.cost_sum / n).unwrap_or(Nanos::MAX)
    }

    /// Records one present cost, keeping at most `window` of them.
    fn record_present(&mut self, cost: Nanos, window: usize) {
        while self.costs.len() >= window {
            match self.costs.pop_front() {
                Some(old) => self.cost_sum = self.cost_sum.saturating_sub(u128::from(old)),
                None => break,
            }
        }
        self.costs.push_back(cost);
        self.cost_sum = self.cost_sum.saturating_add(u128::from(cost));
    }
}

/// The VGRIS policy family.
#[derive(Debug)]
pub struct Vgris {
    cfg: VgrisConfig,
    algo: Algo,
    /// Shares come from the weights (until the hybrid formula sets them).
    weighted: bool,
    slots: Vec<Option<Slot>>,
    /// vGPUs with queued work that may dispatch now, keyed by [`Vgris::key`].
    ready: ReadySet<(bool, u64)>,
    /// Proportional share: vGPUs with queued work and no budget, keyed by the period boundary
    /// at which their budget turns positive.
    waiting: ReadySet<Time>,
    /// The latest time seen: budgets are evaluated at it.
    now: Time,
    /// When the hybrid controller last looked (None before the first callback).
    control_at: Option<Time>,
    /// When the hybrid controller looks next.
    next_control: Time,
    /// Consecutive controller intervals with total GPU usage below the threshold.
    low_gpu: u64,
    /// Total GPU usage in the controller's last interval.
    gpu_usage: f64,
}

impl Vgris {
    /// A VGRIS policy with `config` (clamped to the accepted ranges).
    pub fn new(config: &VgrisConfig) -> Self {
        let cfg = config.sanitized();
        let algo = match cfg.mode {
            VgrisMode::Sla => Algo::SlaAware,
            VgrisMode::Share | VgrisMode::Hybrid => Algo::PropShare,
        };
        Vgris {
            cfg,
            algo,
            weighted: true,
            slots: Vec::new(),
            ready: ReadySet::default(),
            waiting: ReadySet::default(),
            now: 0,
            control_at: None,
            next_control: 0,
            low_gpu: 0,
            gpu_usage: 0.0,
        }
    }

    fn slot(&self, v: VgpuId) -> Option<&Slot> {
        self.slots.get(v.index()).and_then(Option::as_ref)
    }

    fn slot_mut(&mut self, v: VgpuId) -> Option<&mut Slot> {
        self.slots.get_mut(v.index()).and_then(Option::as_mut)
    }

    /// Controller intervals a condition must hold: `time` rounded up, at least one.
    fn intervals_needed(&self) -> u64 {
        self.cfg.time.div_ceil(self.cfg.controller_interval).max(1)
    }

    /// The budget per period of a share.
    fn cap_of(&self, share: f64) -> i64 {
        // Both factors are bounded (period <= MAX_SHARE_PERIOD, share <= 1): the cast is exact
        // enough and cannot saturate.
        ((self.cfg.share_period as f64 * share).round() as i64).max(1)
    }

    /// The dispatch order of a vGPU whose oldest queued group is `kind`, arrived as `seq`:
    /// first come, first served, except that under SLA-aware scheduling a released `Present`
    /// goes first. That is the paper's command flush (§3.2): before the sleep the frame's
    /// commands are flushed to the GPU, so that the delayed `Present` costs only itself
    /// (0.48 ms instead of 11.70 ms under heavy contention) and the predictor stays accurate.
    /// Without it a `Present` queues behind other VMs' whole frames and the frame time swings
    /// by that wait. A vGPU has at most one `Present` outstanding, so this cannot starve anyone.
    fn key(&self, kind: GroupKind, seq: u64) -> (bool, u64) {
        let flushed = self.algo == Algo::SlaAware && kind == GroupKind::Present;
        (!flushed, seq)
    }

    /// How many share-period boundaries (at `0, t, 2t, ...`) lie at or before `now`.
    fn boundaries(&self, now: Time) -> u64 {
        (now / self.cfg.share_period).saturating_add(1)
    }

    /// The budget of `s` at `now` and the boundaries it then includes: the replenishments of
    /// the boundaries passed since its last update applied at once, `e = min(ts, e + k ts)`,
    /// the closed form of applying `e = min(ts, e + ts)` `k` times. Budgets are replenished
    /// only under proportional share (the controller settles every budget before it switches).
    ///
    /// A vGPU with a group on the GPU is debited only when the group completes, so its budget
    /// is not capped meanwhile: the cap applies at completion, after the debit ([`Policy::
    /// completed`]). Capping it while running would throw away every refill of a group longer
    /// than a period and hold the vGPU to `s / (1 + s)` of the GPU instead of `s`. Whether it
    /// runs changes only in `dispatched` and `completed`, which update the vGPU first.
    fn settled(&self, s: &Slot, now: Time) -> (i64, u64) {
        let due = self.boundaries(now);
        if due <= s.applied {
            return (s.budget, s.applied);
        }
        if self.algo != Algo::PropShare {
            return (s.budget, due);
        }
        let k = i64::try_from(due - s.applied).unwrap_or(i64::MAX);
        let refilled = s.budget.saturating_add(s.cap.saturating_mul(k));
        let budget = if s.running {
            refilled
        } else {
            s.cap.min(refilled)
        };
        (budget, due)
    }

    /// Brings the budget of `v` up to the latest time seen.
    fn settle(&mut self, v: VgpuId) {
        let now = self.now;
        let Some(s) = self.slot(v) else {
            return;
        };
        let (budget, applied) = self.settled(s, now);
        if let Some(s) = self.slot_mut(v) {
            s.budget = budget;
            s.applied = applied;
        }
    }

    /// Brings every budget up to the latest time seen (O(n): membership changes, controller).
    fn settle_all(&mut self) {
        for i in 0..self.slots.len() {
            self.settle(VgpuId(i as u32));
        }
    }

    /// When the budget of `s` (up to date, not positive) turns positive: at the `k`-th
    /// boundary still to apply, `k = ⌊-e / ts⌋ + 1`, running or not (the cap only bounds the
    /// budget from above).
    fn eligible_at(&self, s: &Slot) -> Time {
        let need = s.budget.unsigned_abs() / s.cap.unsigned_abs().max(1);
        s.applied
            .saturating_add(need)
            .saturating_mul(self.cfg.share_period)
    }

    /// Brings `v` up to date, records whether it has a group on the GPU, and files it: in the
    /// ready set if it has queued work and may dispatch, in the waiting set (keyed by when it
    /// may) if it has queued work and no budget, else in neither.
    fn index(&mut self, cx: &Cx<'_>, v: VgpuId) {
        self.settle(v);
        let running = cx.vgpu(v).is_some_and(|st| st.in_flight() > 0);
        let head = cx
            .vgpu(v)
            .and_then(|s| Some((s.head()?.kind, s.head_seq()?)));
        let Some(s) = self.slot_mut(v) else {
            self.ready.remove(v);
            self.waiting.remove(v);
            return;
        };
        s.running = running;
        let budget = s.budget;
        match head {
            Some((kind, seq)) if self.algo == Algo::SlaAware || budget > 0 => {
                let key = self.key(kind, seq);
                self.ready.insert(v, key);
                self.waiting.remove(v);
            }
            Some(_) => {
                let at = self.slot(v).map_or(Time::MAX, |s| self.eligible_at(s));
                self.ready.remove(v);
                self.waiting.insert(v, at);
            }
            None => {
                self.ready.remove(v);
                self.waiting.remove(v);
            }
        }
    }

    fn index_all(&mut self, cx: &Cx<'_>) {
        for i in 0..self.slots.len() {
            if self.slots[i].is_some() {
                self.index(cx, VgpuId(i as u32));
            }
        }
    }

    /// Recomputes every share after a change of members or weights. Weighted shares are
    /// `w_i / Σw`; shares set by the hybrid formula are renormalised to sum to one, a newcomer
    /// starting at `1/n`. Budgets above a shrunken cap are cut to it.
    /// Every budget is brought up to date first (under the old caps), and every vGPU is filed
    /// again after (the time a waiting vGPU may dispatch depends on its cap).
    fn rebalance(&mut self, cx: &Cx<'_>, newcomer: Option<VgpuId>) {
        let n = self.slots.iter().flatten().count();
        if n == 0 {
            return;
        }
        self.settle_all();
        if self.weighted {
            let weight = |i: usize| {
                cx.vgpu(VgpuId(i as u32))
                    .map_or(1, |s| u64::from(s.params().weight.max(1)))
            };
            let total: u64 = (0..self.slots.len())
                .filter(|&i| self.slots[i].is_some())
                .map(weight)
                .fold(0, u64::saturating_add);
            for i in 0..self.slots.len() {
                let w = weight(i);
                if let Some(s) = &mut self.slots[i] {
                    s.share = w as f64 / total.max(1) as f64;
                }
            }
        } else {
            if let Some(s) = newcomer.and_then(|v| self.slot_mut(v)) {
                s.share = 1.0 / n as f64;
            }
            self.normalize_shares();
        }
        for i in 0..self.slots.len() {
            let Some(share) = self.slots[i].as_ref().map(|s| s.share) else {
                continue;
            };
            let cap = self.cap_of(share);
            if let Some(s) = &mut self.slots[i] {
                s.cap = cap;
                s.budget = s.budget.min(cap);
            }
        }
        self.index_all(cx);
    }

    /// Scales the shares to sum to one (each at least [`MIN_SHARE`] before scaling).
    fn normalize_shares(&mut self) {
        let mut sum = 0.0;
        for s in self.slots.iter_mut().flatten() {
            if !(s.share.is_finite() && s.share >= MIN_SHARE) {
                s.share = MIN_SHARE;
            }
            sum += s.share;
        }
        for s in self.slots.iter_mut().flatten() {
            s.share /= sum;
        }
    }

    /// Work due at or before now: the vGPUs whose budget turned positive are filed again
    /// (each was put in the waiting set by an earlier event, so this is O(log n) amortised),
    /// then the hybrid controller.
    fn tick(&mut self, cx: &Cx<'_>) {
        let now = cx.now().max(self.now);
        self.now = now;
        // Bounded by the set's size: every vGPU leaves it or moves to a key after now.
        for _ in 0..self.waiting.len() {
            match self.waiting.first() {
                Some((at, v)) if at <= now => {
                    self.waiting.remove(v);
                    self.index(cx, v);
                }
                _ => break,
            }
        }
        if self.cfg.mode == VgrisMode::Hybrid {
            self.control(cx);
        }
    }

    /// Algorithm 1, run once per controller interval.
    fn control(&mut self, cx: &Cx<'_>) {
        let now = cx.now();
        let interval = self.cfg.controller_interval;
        let Some(start) = self.control_at else {
            self.control_at = Some(now);
            self.next_control = now.saturating_add(interval);
            return;
        };
        if now < self.next_control {
            return;
        }
        let elapsed_intervals = (now - self.next_control) / interval + 1;
        self.next_control = self
            .next_control
            .saturating_add(elapsed_intervals.saturating_mul(interval));
        self.control_at = Some(now);
        let elapsed = now.saturating_sub(start).max(1) as f64;
        let needed = self.intervals_needed();
        let mut total = 0.0;
        let mut starving = false;
        for i in 0..self.slots.len() {
            let state = cx.vgpu(VgpuId(i as u32));
            let Some(s) = &mut self.slots[i] else {
                continue;
            };
            let gpu_time = state.map_or(s.gpu_mark, |st| st.account().gpu_time);
            s.usage = gpu_time.saturating_sub(s.gpu_mark) as f64 / elapsed;
            s.gpu_mark = gpu_time;
            total += s.usage;
            let frames = s.window_frames;
            let fps = frames as f64 * NS_PER_SEC as f64 / elapsed;
            s.window_frames = 0;
            let has_sla = state.is_some_and(|st| st.params().target_fps.is_some());
            // A VM that rendered nothing, used no GPU and has nothing queued is idle (not yet
            // started, paused), not starved: it does not call for SLA-aware scheduling.
            let active = frames > 0
                || s.usage > 0.0
                || state.is_some_and(|st| st.queued() > 0 || st.in_flight() > 0);
            if has_sla && active && s.joined <= start && fps < self.cfg.fps_thres {
                s.low_fps = s.low_fps.saturating_add(elapsed_intervals);
            } else {
                s.low_fps = 0;
            }
            starving |= s.low_fps >= needed;
        }
        self.gpu_usage = total.min(1.0);
        if self.gpu_usage < self.cfg.gpu_thres {
            self.low_gpu = self.low_gpu.saturating_add(elapsed_intervals);
        } else {
            self.low_gpu = 0;
        }
        match self.algo {
            Algo::PropShare if starving => {
                // The budgets as proportional share left them (shown, kept for no use).
                self.settle_all();
                self.algo = Algo::SlaAware;
                self.reset_counters();
                self.index_all(cx);
            }
            Algo::SlaAware if self.low_gpu >= needed => {
                self.algo = Algo::PropShare;
                self.shares_from_usage();
                self.reset_counters();
                self.index_all(cx);
            }
            _ => {}
        }
    }

    fn reset_counters(&mut self) {
        self.low_gpu = 0;
        for s in self.slots.iter_mut().flatten() {
            s.low_fps = 0;
        }
    }

    /// Equation (2): `s_i = u_i + (1 - Σu) / n`, then full budgets.
    fn shares_from_usage(&mut self) {
        self.weighted = false;
        let n = self.slots.iter().flatten().count().max(1) as f64;
        let used: f64 = self.slots.iter().flatten().map(|s| s.usage).sum();
        let spare = (1.0 - used).max(0.0) / n;
        for s in self.slots.iter_mut().flatten() {
            s.share = s.usage + spare;
        }
        self.normalize_shares();
        for i in 0..self.slots.len() {
            let Some(share) = self.slots[i].as_ref().map(|s| s.share) else {
                continue;
            };
            let cap = self.cap_of(share);
            if let Some(s) = &mut self.slots[i] {
                s.cap = cap;
                s.budget = cap;
            }
        }
        // Full budgets from now on: the boundaries passed give nothing more.
        let applied = self.boundaries(self.now);
        for s in self.slots.iter_mut().flatten() {
            s.applied = applied;
        }
    }
}

impl Policy for Vgris {
    fn name(&self) -> &'static str {
        "vgris"
    }

    fn attach(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.tick(cx);
        let i = v.index();
        if self.slots.len() <= i {
            self.slots.resize(i + 1, None);
        }
        let state = cx.vgpu(v);
        let gpu_time = state.map_or(0, |s| s.account().gpu_time);
        let running = state.is_some_and(|s| s.in_flight() > 0);
        let applied = self.boundaries(self.now);
        self.slots[i] = Some(Slot::new(self.now, gpu_time, applied, running));
        // Files every vGPU, this one included.
        self.rebalance(cx, Some(v));
    }

    fn detach(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.tick(cx);
        if let Some(slot) = self.slots.get_mut(v.index()) {
            *slot = None;
        }
        self.ready.remove(v);
        self.waiting.remove(v);
        self.rebalance(cx, None);
    }

    fn params_changed(&mut self, cx: &mut Cx<'_>, _v: VgpuId) {
        // Keep the predictor and the budget; only the weights may have changed the shares.
        // Files every vGPU, this one included.
        self.tick(cx);
        self.rebalance(cx, None);
    }

    fn submitted(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.tick(cx);
        // A queued vGPU keeps its place: its head and its budget are unchanged.
        if !self.ready.contains(v) && !self.waiting.contains(v) {
            self.index(cx, v);
        }
    }

    fn withdrawn(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.tick(cx);
        self.index(cx, v);
    }

    fn dispatched(&mut self, cx: &mut Cx<'_>, v: VgpuId, _leased: bool) {
        self.tick(cx);
        // Settles the boundaries before the dispatch as not running, the later ones as running
        // (see `settled`).
        self.index(cx, v);
    }

    fn completed(&mut self, cx: &mut Cx<'_>, done: &Completion) {
        self.tick(cx);
        // The boundaries while the group ran refill it uncapped.
        self.settle(done.vgpu);
        let history = self.cfg.history;
        let debit = self.algo == Algo::PropShare;
        let Some(s) = self.slot_mut(done.vgpu) else {
            return;
        };
        if debit {
            let cost = i64::try_from(done.cost()).unwrap_or(i64::MAX);
            s.budget = s.budget.saturating_sub(cost).min(s.cap);
        }
        if done.kind == GroupKind::Present {
            // What the VM waits for: from the present's submission to its fence, queueing under
            // contention included (the paper's Present time rises with contention).
            s.record_present(done.finish.saturating_sub(done.submitted), history);
            if s.release.is_some_and(|r| done.finish >= r) {
                s.frame_start = Some(done.finish);
            }
        }
        self.index(cx, done.vgpu);
    }

    fn timer(&mut self, cx: &mut Cx<'_>) {
        self.tick(cx);
    }

    fn frame(&mut self, cx: &mut Cx<'_>, v: VgpuId) -> Time {
        self.tick(cx);
        let now = cx.now();
        let target = match self.algo {
            Algo::SlaAware => target_latency(cx.vgpu(v).and_then(|s| s.params().target_fps)),
            Algo::PropShare => None,
        };
        let Some(s) = self.slot_mut(v) else {
            return now;
        };
        if let Some(prev) = s.last_frame
            && now > prev
        {
            s.fps = NS_PER_SEC as f64 / (now - prev) as f64;
        }
        s.last_frame = Some(now);
        s.window_frames = s.window_frames.saturating_add(1);
        let at = match (target, s.frame_start) {
            (Some(target), Some(start)) => {
                let compute = now.saturating_sub(start);
                let busy = compute.saturating_add(s.predicted_present());
                now.saturating_add(target.saturating_sub(busy))
            }
            _ => now,
        };
        s.delay = at - now;
        s.release = Some(at);
        s.frame_start = Some(at);
        at
    }

    fn pick(&mut self, cx: &mut Cx<'_>) -> Option<VgpuId> {
        self.tick(cx);
        self.ready.first().map(|(_, v)| v)
    }

    fn next_deadline(&self) -> Option<Time> {
        let refill = self.waiting.first().map(|(at, _)| at);
        let control = (self.cfg.mode == VgrisMode::Hybrid && self.control_at.is_some())
            .then_some(self.next_control);
        earliest([refill, control])
    }

    /// Under proportional share: the budget `e_i` left, with the refills of the period
    /// boundaries up to `now` (they are applied lazily), `t * s_i` and `t`. SLA-aware
    /// scheduling budgets no GPU time (it paces presents), so then there is none.
    fn budget(&self, v: VgpuId, _state: &VgpuState, now: Time) -> Option<Budget> {
        if self.algo != Algo::PropShare {
            return None;
        }
        let s = self.slot(v)?;
        let (remaining_ns, _) = self.settled(s, now.max(self.now));
        Some(Budget {
            remaining_ns,
            capacity_ns: s.cap.unsigned_abs(),
            period_ns: Some(self.cfg.share_period),
        })
    }

    fn figures(&self, v: VgpuId) -> Vec<(&'static str, f64)> {
        let Some(s) = self.slot(v) else {
            return Vec::new();
        };
        let sla = if self.algo == Algo::SlaAware {
            1.0
        } else {
            0.0
        };
        vec![
            ("sla_aware", sla),
            ("share", s.share),
            ("budget_ns", self.settled(s, self.now).0 as f64),
            ("fps", s.fps),
            ("delay_ns", s.delay as f64),
            ("present_ns", s.predicted_present() as f64),
            ("usage", s.usage),
            ("gpu_usage", self.gpu_usage),
        ]
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::Scheduler;
    use crate::model::{CommandGroup, Decision, Event, GroupId, VgpuParams};
    use crate::policy::PolicyConfig;

    const MS: Nanos = NS_PER_MS;
    const US: Nanos = NS_PER_US;
    const SEC: Nanos = NS_PER_SEC;
    /// floor(1 s / 30).
    const T30: Nanos = 33_333_333;

    fn config(mode: VgrisMode) -> VgrisConfig {
        VgrisConfig {
            mode,
            ..VgrisConfig::default()
        }
    }

    fn vm(name: &str, weight: u32, fps: Option<f64>) -> VgpuParams {
        VgpuParams {
            weight,
            target_fps: fps,
            ..VgpuParams::named(name)
        }
    }

    fn figure(s: &Scheduler, v: VgpuId, name: &str) -> f64 {
        let figures = s.figures(v);
        let found = figures.iter().find(|(n, _)| *n == name);
        found.map(|&(_, x)| x).expect("figure exists")
    }

    /// What a simulated VM does.
    #[derive(Debug, Clone, Copy)]
    enum Load {
        /// A game: CPU compute, one render group, wait for it, frame event, present group
        /// released by the scheduler, wait for it, next frame.
        Game {
            compute: Nanos,
            render: Nanos,
            groups: u32,
            present: Nanos,
        },
        /// Keeps two groups of `cost` queued or running at all times.
        Backlog { cost: Nanos },
    }

    #[derive(Debug)]
    enum Ev {
        Submit(VgpuId, GroupKind, Nanos),
        Done(VgpuId, GroupId, Time),
    }

    /// A tiny deterministic GPU: runs the dispatched groups one after another (capacity 1)
    /// and plays each VM's load against the real scheduler.
    struct Sim {
        s: Scheduler,
        now: Time,
        queue: BTreeMap<(Time, u64), Ev>,
        seq: u64,
        groups: BTreeMap<GroupId, (GroupKind, Nanos)>,
        loads: Vec<Load>,
        /// Present return times per VM.
        returns: Vec<Vec<Time>>,
        /// Render groups of the current frame not yet done, per VM.
        pending: Vec<u32>,
    }

    impl Sim {
        fn new(cfg: VgrisConfig, vms: &[(VgpuParams, Load)]) -> (Sim, Vec<VgpuId>) {
            let mut s = Scheduler::new(PolicyConfig::Vgris(cfg).build(), 1);
            let mut out = Vec::new();
            let ids: Vec<_> = vms
                .iter()
                .map(|(p, _)| s.add_vgpu(0, p.clone(), &mut out).unwrap())
                .collect();
            let mut sim = Sim {
                s,
                now: 0,
                queue: BTreeMap::new(),
                seq: 0,
                groups: BTreeMap::new(),
                loads: vms.iter().map(|(_, l)| *l).collect(),
                returns: vec![Vec::new(); vms.len()],
                pending: vec![0; vms.len()],
            };
            for &v in &ids {
                match sim.loads[v.index()] {
                    Load::Game { compute, .. } => sim.start_frame(v, compute),
                    Load::Backlog { cost } => {
                        sim.push(0, Ev::Submit(v, GroupKind::Load, cost));
                        sim.push(0, Ev::Submit(v, GroupKind::Load, cost));
                    }
                }
            }
            (sim, ids)
        }

        /// Submits a game's render groups `after` from now.
        fn start_frame(&mut self, v: VgpuId, after: Nanos) {
            if let Load::Game { render, groups, .. } = self.loads[v.index()] {
                let at = self.now + after;
                for _ in 0..groups {
                    self.push(at, Ev::Submit(v, GroupKind::Render, render));
                }
                self.pending[v.index()] = groups;
            }
        }

        fn push(&mut self, at: Time, ev: Ev) {
            self.seq += 1;
            self.queue.insert((at, self.seq), ev);
        }

        fn handle(&mut self, ev: Event) {
            let mut out = Vec::new();
            self.s.handle(self.now, ev, &mut out).unwrap();
            for d in out {
                match d {
                    Decision::Dispatch { vgpu, group, .. } => {
                        let cost = self.groups[&group].1;
                        self.push(self.now + cost, Ev::Done(vgpu, group, self.now));
                    }
                    Decision::Present { vgpu, at } => {
                        if let Load::Game { present, .. } = self.loads[vgpu.index()] {
                            self.push(at, Ev::Submit(vgpu, GroupKind::Present, present));
                        }
                    }
                    _ => {}
                }
            }
        }

        fn run(&mut self, until: Time) {
            for _ in 0..10_000_000 {
                let next = self.queue.first_key_value().map_or(Time::MAX, |(k, _)| k.0);
                let deadline = self.s.next_deadline().unwrap_or(Time::MAX);
                let t = next.min(deadline);
                if t > until {
                    self.now = until;
                    return;
                }
                self.now = self.now.max(t);
                if deadline <= next {
                    self.handle(Event::Timer);
                    continue;
                }
                let Some((_, ev)) = self.queue.pop_first() else {
                    return;
                };
                match ev {
                    Ev::Submit(v, kind, cost) => {
                        self.seq += 1;
                        let g = CommandGroup::new(self.seq, v, kind, 1);
                        self.groups.insert(g.id, (kind, cost));
                        self.handle(Event::Submitted(g));
                    }
                    Ev::Done(v, g, start) => {
                        let (kind, _) = self.groups[&g];
                        let finish = self.now;
                        self.handle(Event::Completed {
                            vgpu: v,
                            group: g,
                            start,
                            finish,
                        });
                        self.on_done(v, kind);
                    }
                }
            }
            panic!("simulation did not make progress");
        }

        fn on_done(&mut self, v: VgpuId, kind: GroupKind) {
            match (self.loads[v.index()], kind) {
                (Load::Game { .. }, GroupKind::Render) => {
                    let left = &mut self.pending[v.index()];
                    *left = left.saturating_sub(1);
                    if *left == 0 {
                        self.handle(Event::Frame(v));
                    }
                }
                (Load::Game { compute, .. }, _) => {
                    self.returns[v.index()].push(self.now);
                    self.start_frame(v, compute);
                }
                (Load::Backlog { cost }, _) => self.push(self.now, Ev::Submit(v, kind, cost)),
            }
        }

        fn gpu_time(&self, v: VgpuId) -> Nanos {
            self.s.vgpu(v).unwrap().account().gpu_time
        }
    }

    /// Drives one VM's frame by hand: frame event, present released, present group run.
    fn present(s: &mut Scheduler, v: VgpuId, frame_at: Time, id: u64, cost: Nanos) -> Time {
        let mut out = Vec::new();
        s.handle(frame_at, Event::Frame(v), &mut out).unwrap();
        let Some(&Decision::Present { at, .. }) = out.last() else {
            panic!("no present decision: {out:?}");
        };
        let g = CommandGroup::new(id, v, GroupKind::Present, 7);
        s.handle(at, Event::Submitted(g), &mut out).unwrap();
        let done = Event::Completed {
            vgpu: v,
            group: GroupId(id),
            start: at,
            finish: at + cost,
        };
        s.handle(at + cost, done, &mut out).unwrap();
        at
    }

    #[test]
    fn sla_sleep_is_target_minus_compute_and_predicted_present() {
        let mut s = Scheduler::new(PolicyConfig::Vgris(config(VgrisMode::Sla)).build(), 1);
        let mut out = Vec::new();
        let v = s
            .add_vgpu(0, vm("game", 256, Some(30.0)), &mut out)
            .unwrap();
        // The first frame has no measured start: it goes at once.
        assert_eq!(present(&mut s, v, 10 * MS, 1, 2 * MS), 10 * MS);
        // The present returned at 12 ms; 10 ms of compute; predicted present 2 ms.
        let frame = 22 * MS;
        let at = present(&mut s, v, frame, 2, 2 * MS);
        assert_eq!(at, frame + (T30 - 10 * MS - 2 * MS));
        assert_eq!(figure(&s, v, "delay_ns"), (T30 - 12 * MS) as f64);
        // The frame took exactly the target: from one present return to the next.
        assert_eq!((at + 2 * MS) - 12 * MS, T30);
        // A frame whose compute alone exceeds the target is not delayed.
        let late = at + 2 * MS + 40 * MS;
        assert_eq!(present(&mut s, v, late, 3, 2 * MS), late);
    }

    #[test]
    fn present_cost_is_predicted_by_the_mean_of_the_last_twenty() {
        let mut s = Scheduler::new(PolicyConfig::Vgris(config(VgrisMode::Sla)).build(), 1);
        let mut out = Vec::new();
        let v = s
            .add_vgpu(0, vm("game", 256, Some(30.0)), &mut out)
            .unwrap();
        let mut t = 0;
        // 25 presents costing 1..=25 ms: the last twenty are 6..=25 ms, mean 15.5 ms.
        for i in 1..=25u64 {
            let at = present(&mut s, v, t, i, i * MS);
            t = at + i * MS + MS;
        }
        assert_eq!(figure(&s, v, "present_ns"), (15 * MS + 500 * US) as f64);
        let frame = t;
        let at = present(&mut s, v, frame, 100, MS);
        assert_eq!(at, frame + T30 - MS - (15 * MS + 500 * US));
    }

    #[test]
    fn vgpus_without_a_target_are_not_paced() {
        let mut s = Scheduler::new(PolicyConfig::Vgris(config(VgrisMode::Sla)).build(), 1);
        let mut out = Vec::new();
        let v = s.add_vgpu(0, vm("desk", 256, None), &mut out).unwrap();
        let mut t = 0;
        for i in 1..=5 {
            assert_eq!(present(&mut s, v, t, i, MS), t);
            t += 3 * MS;
        }
        assert_eq!(figure(&s, v, "delay_ns"), 0.0);
    }

    #[test]
    fn the_budget_query_shows_the_share_left_with_its_lazy_refills() {
        let mut s = Scheduler::new(PolicyConfig::Vgris(config(VgrisMode::Share)).build(), 1);
        let mut out = Vec::new();
        let a = s.add_vgpu(0, vm("a", 1, None), &mut out).unwrap();
        s.add_vgpu(0, vm("b", 3, None), &mut out).unwrap();
        let budget = |s: &Scheduler, now, left| {
            let want = Budget {
                remaining_ns: left,
                capacity_ns: 250 * US,
                period_ns: Some(MS),
            };
            assert_eq!(s.budget(a, now), Some(want), "at {now}");
        };
        budget(&s, 0, 250_000);
        let g = CommandGroup::new(1, a, GroupKind::Render, 1);
        s.handle(100 * US, Event::Submitted(g), &mut out).unwrap();
        let done = Event::Completed {
            vgpu: a,
            group: GroupId(1),
            start: 100 * US,
            finish: 700 * US,
        };
        s.handle(700 * US, done, &mut out).unwrap();
        budget(&s, 700 * US, -350_000);
        // No event since: the boundaries at 1 and 2 ms refill it all the same.
        budget(&s, MS + 500 * US, -100_000);
        budget(&s, 2 * MS + 500 * US, 150_000);
        budget(&s, 9 * MS, 250_000);
        // SLA-aware scheduling budgets nothing.
        s.set_policy(
            10 * MS,
            PolicyConfig::Vgris(config(VgrisMode::Sla)).build(),
            &mut out,
        );
        assert_eq!(s.budget(a, 10 * MS), None);
    }

    #[test]
    fn share_budget_is_debited_by_cost_and_replenished_each_period() {
        let mut s = Scheduler::new(PolicyConfig::Vgris(config(VgrisMode::Share)).build(), 1);
        let mut out = Vec::new();
        let a = s.add_vgpu(0, vm("a", 1, None), &mut out).unwrap();
        let b = s.add_vgpu(0, vm("b", 3, None), &mut out).unwrap();
        assert_eq!(figure(&s, a, "share"), 0.25);
        assert_eq!(figure(&s, b, "share"), 0.75);
        assert_eq!(figure(&s, a, "budget_ns"), 250_000.0);
        assert_eq!(figure(&s, b, "budget_ns"), 750_000.0);
        assert_eq!(s.next_deadline(), None);
        let submit = |s: &mut Scheduler, now, id| {
            let mut out = Vec::new();
            let g = CommandGroup::new(id, a, GroupKind::Render, 1);
            s.handle(now, Event::Submitted(g), &mut out).unwrap();
            out
        };
        let dispatch = |id| Decision::Dispatch {
            vgpu: a,
            group: GroupId(id),
            leased: false,
        };
        assert_eq!(submit(&mut s, 100 * US, 1), vec![dispatch(1)]);
        assert!(submit(&mut s, 200 * US, 2).is_empty());
        // 600 µs of GPU time: 250 - 600 = -350 µs; group 2 waits.
        let done = Event::Completed {
            vgpu: a,
            group: GroupId(1),
            start: 100 * US,
            finish: 700 * US,
        };
        out.clear();
        s.handle(700 * US, done, &mut out).unwrap();
        assert!(out.is_empty());
        assert_eq!(figure(&s, a, "budget_ns"), -350_000.0);
        // Period boundary at 1 ms: min(250, -350 + 250) = -100 µs, still waiting. Refills are
        // lazy: the only timer asked for is the boundary that makes the budget positive.
        assert_eq!(s.next_deadline(), Some(2 * MS));
        s.handle(MS, Event::Timer, &mut out).unwrap();
        assert!(out.is_empty());
        assert_eq!(figure(&s, a, "budget_ns"), -100_000.0);
        // At 2 ms: min(250, 150) = 150 µs > 0, group 2 goes.
        assert_eq!(s.next_deadline(), Some(2 * MS));
        s.handle(2 * MS, Event::Timer, &mut out).unwrap();
        assert_eq!(out, vec![dispatch(2)]);
        assert_eq!(figure(&s, a, "budget_ns"), 150_000.0);
        // While group 2 runs its refills are not capped (the debit comes at completion): at
        // 3 ms 150 + 250 = 400 µs.
        s.handle(3 * MS, Event::Timer, &mut out).unwrap();
        assert_eq!(figure(&s, a, "budget_ns"), 400_000.0);
        // It ran 2.0-3.2 ms: 400 - 1200 = -800 µs, then capped at t * s only from above.
        let done = Event::Completed {
            vgpu: a,
            group: GroupId(2),
            start: 2 * MS,
            finish: 3 * MS + 200 * US,
        };
        s.handle(3 * MS + 200 * US, done, &mut out).unwrap();
        assert_eq!(figure(&s, a, "budget_ns"), -800_000.0);
        // A late timer replenishes every boundary passed at once, capped at t * s.
        s.handle(9 * MS + 1, Event::Timer, &mut out).unwrap();
        assert_eq!(figure(&s, a, "budget_ns"), 250_000.0);
        assert_eq!(s.next_deadline(), None);
    }

    #[test]
    fn sla_mode_dispatches_a_released_present_first() {
        // Render 1 of `a` runs, render 2 of `a` waits, then `b`'s present arrives: SLA-aware
        // sends the present next (the flush), proportional share keeps arrival order.
        for (mode, first) in [(VgrisMode::Sla, 1), (VgrisMode::Share, 0)] {
            let mut s = Scheduler::new(PolicyConfig::Vgris(config(mode)).build(), 1);
            let mut out = Vec::new();
            let a = s.add_vgpu(0, vm("a", 1, Some(30.0)), &mut out).unwrap();
            let b = s.add_vgpu(0, vm("b", 1, Some(30.0)), &mut out).unwrap();
            let groups = [
                CommandGroup::new(1, a, GroupKind::Render, 1),
                CommandGroup::new(2, a, GroupKind::Render, 1),
                CommandGroup::new(3, b, GroupKind::Present, 1),
            ];
            for (i, g) in groups.into_iter().enumerate() {
                s.handle(i as Time * US, Event::Submitted(g), &mut out)
                    .unwrap();
            }
            out.clear();
            let done = Event::Completed {
                vgpu: a,
                group: GroupId(1),
                start: 0,
                finish: 100 * US,
            };
            s.handle(100 * US, done, &mut out).unwrap();
            let next = [(a, GroupId(2)), (b, GroupId(3))][first];
            let want = Decision::Dispatch {
                vgpu: next.0,
                group: next.1,
                leased: false,
            };
            assert!(out.contains(&want), "{mode:?}: {out:?}");
        }
    }

    #[test]
    fn only_a_vgpu_without_budget_and_with_queued_work_asks_for_a_timer() {
        let mut s = Scheduler::new(PolicyConfig::Vgris(config(VgrisMode::Share)).build(), 1);
        let mut out = Vec::new();
        let a = s.add_vgpu(0, vm("a", 1, None), &mut out).unwrap();
        let b = s.add_vgpu(0, vm("b", 3, None), &mut out).unwrap();
        let run = |s: &mut Scheduler, v, id, from: Time, to: Time| {
            let mut out = Vec::new();
            let done = Event::Completed {
                vgpu: v,
                group: GroupId(id),
                start: from,
                finish: to,
            };
            s.handle(to, done, &mut out).unwrap();
            out
        };
        let submit = |s: &mut Scheduler, v, id, now| {
            let mut out = Vec::new();
            let g = CommandGroup::new(id, v, GroupKind::Render, 1);
            s.handle(now, Event::Submitted(g), &mut out).unwrap();
            out
        };
        let dispatch = |vgpu, id| Decision::Dispatch {
            vgpu,
            group: GroupId(id),
            leased: false,
        };
        assert_eq!(submit(&mut s, a, 1, 0), vec![dispatch(a, 1)]);
        // a overran (250 - 900 = -650 µs) but has nothing queued: no timer.
        assert!(run(&mut s, a, 1, 0, 900 * US).is_empty());
        assert_eq!(figure(&s, a, "budget_ns"), -650_000.0);
        assert_eq!(s.next_deadline(), None);
        // b runs with budget: no timer either.
        assert_eq!(submit(&mut s, b, 2, MS), vec![dispatch(b, 2)]);
        assert_eq!(s.next_deadline(), None);
        // a queues at 1.1 ms with -400 µs: it waits for the boundary that makes it positive,
        // 3 ms (-150 µs at 2 ms, +100 µs at 3 ms), and only that one.
        assert!(submit(&mut s, a, 3, MS + 100 * US).is_empty());
        assert_eq!(figure(&s, a, "budget_ns"), -400_000.0);
        assert_eq!(s.next_deadline(), Some(3 * MS));
        assert!(run(&mut s, b, 2, MS, MS + 500 * US).is_empty());
        out.clear();
        s.handle(2 * MS, Event::Timer, &mut out).unwrap();
        assert!(out.is_empty());
        assert_eq!(figure(&s, a, "budget_ns"), -150_000.0);
        s.handle(3 * MS, Event::Timer, &mut out).unwrap();
        assert_eq!(out, vec![dispatch(a, 3)]);
        assert_eq!(figure(&s, a, "budget_ns"), 100_000.0);
        assert_eq!(s.next_deadline(), None);
    }

    #[test]
    fn share_refills_while_running_are_kept() {
        // A 10 ms group against 1 ms periods and a 25% share: capping the budget while the
        // group runs would lose ten refills and leave the vGPU ~20% of the GPU.
        let load = Load::Backlog { cost: 10 * MS };
        let vms = [(vm("a", 1, None), load), (vm("b", 3, None), load)];
        let (mut sim, v) = Sim::new(config(VgrisMode::Share), &vms);
        sim.run(2 * SEC);
        let (a, b) = (sim.gpu_time(v[0]) as f64, sim.gpu_time(v[1]) as f64);
        let a_part = a / (a + b);
        assert!((a_part - 0.25).abs() < 0.03, "a got {a_part}");
        assert!(a + b >= 0.8 * 2.0 * SEC as f64, "busy {}", a + b);
    }

    #[test]
    fn share_mode_gives_gpu_time_in_proportion_to_weights() {
        let load = Load::Backlog { cost: 100 * US };
        let vms = [(vm("a", 1, None), load), (vm("b", 3, None), load)];
        let (mut sim, v) = Sim::new(config(VgrisMode::Share), &vms);
        sim.run(SEC);
        let (a, b) = (sim.gpu_time(v[0]) as f64, sim.gpu_time(v[1]) as f64);
        // Posterior enforcement overruns by at most one group per period: within 2 points.
        let a_part = a / (a + b);
        assert!((a_part - 0.25).abs() < 0.02, "a got {a_part}");
        // The GPU stays busy: shares sum to one.
        // Posterior enforcement may leave the GPU idle near a period's end: most of it is used.
        assert!(a + b >= 0.9 * SEC as f64, "busy {}", a + b);
    }

    #[test]
    fn sla_mode_holds_three_games_at_target() {
        let game = |render: Nanos| Load::Game {
            compute: 4 * MS,
            render: render / 2,
            groups: 2,
            present: MS,
        };
        let vms = [
            (vm("light", 256, Some(30.0)), game(2 * MS)),
            (vm("mid", 256, Some(30.0)), game(4 * MS)),
            (vm("heavy", 256, Some(30.0)), game(6 * MS)),
        ];
        let (mut sim, v) = Sim::new(config(VgrisMode::Sla), &vms);
        sim.run(20 * SEC);
        for &id in &v {
            let returns = &sim.returns[id.index()];
            // Skip the first second while the predictor warms up.
            let steady: Vec<_> = returns.iter().copied().filter(|&t| t >= SEC).collect();
            let frames = steady.len() as f64;
            let span = (steady[steady.len() - 1] - steady[0]) as f64 / SEC as f64;
            let fps = (frames - 1.0) / span;
            assert!((29.9..30.1).contains(&fps), "{id:?}: {fps} FPS");
            let over = steady.windows(2).filter(|w| w[1] - w[0] > T30 + 1).count();
            assert!(
                over as f64 <= 0.01 * frames,
                "{id:?}: {over} of {frames} over"
            );
        }
    }

    fn hybrid() -> VgrisConfig {
        VgrisConfig {
            mode: VgrisMode::Hybrid,
            time: 2 * SEC,
            ..VgrisConfig::default()
        }
    }

    /// Delivers every timer due up to `to`, then `event` at `to`.
    fn at(s: &mut Scheduler, to: Time, event: Event) -> Vec<Decision> {
        let mut out = Vec::new();
        while let Some(t) = s.next_deadline().filter(|&t| t <= to) {
            s.handle(t, Event::Timer, &mut out).unwrap();
        }
        out.clear();
        s.handle(to, event, &mut out).unwrap();
        out
    }

    /// Runs one group of `v` from `start` for `cost` on an idle GPU.
    fn gpu(s: &mut Scheduler, v: VgpuId, id: u64, start: Time, cost: Nanos) {
        let g = CommandGroup::new(id, v, GroupKind::Render, 1);
        let out = at(s, start, Event::Submitted(g));
        assert!(out.contains(&Decision::Dispatch {
            vgpu: v,
            group: GroupId(id),
            leased: false
        }));
        let done = Event::Completed {
            vgpu: v,
            group: GroupId(id),
            start,
            finish: start + cost,
        };
        at(s, start + cost, done);
    }

    /// Frame events of `v` at `fps` from `from` until before `to`.
    fn frames(s: &mut Scheduler, v: VgpuId, fps: u64, from: Time, to: Time) {
        let mut t = from;
        while t < to {
            at(s, t, Event::Frame(v));
            t += SEC / fps;
        }
    }

    #[test]
    fn hybrid_switches_to_sla_aware_after_time_of_low_fps() {
        let mut s = Scheduler::new(PolicyConfig::Vgris(hybrid()).build(), 1);
        let mut out = Vec::new();
        let a = s
            .add_vgpu(0, vm("game", 256, Some(30.0)), &mut out)
            .unwrap();
        let b = s.add_vgpu(0, vm("batch", 256, None), &mut out).unwrap();
        // It starts in proportional share with fair shares.
        assert_eq!(figure(&s, a, "sla_aware"), 0.0);
        assert_eq!(figure(&s, b, "share"), 0.5);
        // 40 FPS is fine; then 10 FPS for one second is not yet enough.
        frames(&mut s, a, 40, 0, SEC);
        frames(&mut s, a, 10, SEC, 2 * SEC);
        frames(&mut s, a, 40, 2 * SEC, 3 * SEC);
        at(&mut s, 3 * SEC, Event::Timer);
        assert_eq!(figure(&s, a, "sla_aware"), 0.0);
        // Two consecutive seconds below 30 FPS (time = 2 s): SLA-aware from then on.
        frames(&mut s, a, 10, 3 * SEC, 5 * SEC);
        at(&mut s, 5 * SEC - 1, Event::Timer);
        assert_eq!(figure(&s, a, "sla_aware"), 0.0);
        at(&mut s, 5 * SEC, Event::Timer);
        assert_eq!(figure(&s, a, "sla_aware"), 1.0);
        // Now frames of the VM with a target are paced: 10 ms compute after a 1 ms present.
        let released = present(&mut s, a, 5 * SEC + MS, 99, MS);
        let frame = released + MS + 10 * MS;
        let out = at(&mut s, frame, Event::Frame(a));
        let paced = Decision::Present {
            vgpu: a,
            at: frame + T30 - 11 * MS,
        };
        assert_eq!(out, vec![paced]);
    }

    #[test]
    fn hybrid_returns_to_share_with_usage_plus_equal_spare() {
        let mut s = Scheduler::new(PolicyConfig::Vgris(hybrid()).build(), 1);
        let mut out = Vec::new();
        let a = s
            .add_vgpu(0, vm("game", 256, Some(30.0)), &mut out)
            .unwrap();
        let b = s.add_vgpu(0, vm("batch", 256, None), &mut out).unwrap();
        frames(&mut s, a, 10, 0, 2 * SEC);
        at(&mut s, 2 * SEC, Event::Timer);
        assert_eq!(figure(&s, a, "sla_aware"), 1.0);
        // In SLA-aware mode a uses 20% of the GPU and b 10%: total 30% < 90% for 2 s.
        let mut id = 0;
        for second in [2, 3] {
            let t = second * SEC;
            id += 1;
            gpu(&mut s, a, id, t + 100 * MS, 200 * MS);
            id += 1;
            gpu(&mut s, b, id, t + 400 * MS, 100 * MS);
            frames(&mut s, a, 30, t + 600 * MS, t + 900 * MS);
            at(&mut s, t + SEC, Event::Timer);
            assert!((figure(&s, a, "usage") - 0.2).abs() < 1e-9);
            assert!((figure(&s, b, "usage") - 0.1).abs() < 1e-9);
            // Still SLA-aware after the first low second, proportional share after the second.
            let expected = if second == 2 { 1.0 } else { 0.0 };
            assert_eq!(figure(&s, a, "sla_aware"), expected);
        }
        // s_i = u_i + (1 - Σu) / n: 0.2 + 0.35 and 0.1 + 0.35.
        assert!((figure(&s, a, "share") - 0.55).abs() < 1e-9);
        assert!((figure(&s, b, "share") - 0.45).abs() < 1e-9);
        assert_eq!(figure(&s, a, "budget_ns"), 550_000.0);
        assert_eq!(figure(&s, b, "budget_ns"), 450_000.0);
        // Presents are not paced in proportional share.
        let out = at(&mut s, 4 * SEC + MS, Event::Frame(a));
        assert_eq!(
            out,
            vec![Decision::Present {
                vgpu: a,
                at: 4 * SEC + MS
            }]
        );
    }

    #[test]
    fn out_of_range_config_is_clamped_not_trusted() {
        let cfg = VgrisConfig {
            mode: VgrisMode::Share,
            share_period: 0,
            controller_interval: 0,
            fps_thres: f64::NAN,
            gpu_thres: 7.0,
            time: Nanos::MAX,
            history: 0,
        };
        let clean = cfg.sanitized();
        assert_eq!(clean.share_period, MIN_SHARE_PERIOD);
        assert_eq!(clean.controller_interval, MIN_CONTROLLER_INTERVAL);
        assert_eq!(clean.fps_thres, DEFAULT_FPS_THRES);
        assert_eq!(clean.gpu_thres, 1.0);
        assert_eq!(clean.time, MAX_TIME);
        assert_eq!(clean.history, 1);
        // The policy runs with it: a long group overruns, the next waits for replenishment.
        let load = Load::Backlog { cost: 3 * MS };
        let (mut sim, v) = Sim::new(cfg, &[(vm("a", 1, None), load), (vm("b", 1, None), load)]);
        sim.run(SEC);
        let (a, b) = (sim.gpu_time(v[0]), sim.gpu_time(v[1]));
        assert!(a.abs_diff(b) <= 3 * MS, "{a} vs {b}");
    }
}
