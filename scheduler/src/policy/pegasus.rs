//! Pegasus (Gupta et al., USENIX ATC 2011, §3–§5, Algorithms 1–2): coordinated, credit-based
//! accelerator scheduling.
//!
//! Every vGPU is a Pegasus domain with credits `X`. The policy keeps a run queue of the vGPUs
//! with queued work (Pegasus's `RQ_A`) and hands the GPU to its head for a time slice of
//! `Tc` ticks: one tick while the domain has no context established on the GPU, and
//! `Tm = X / Xmin` ticks once it has (Algorithm 1). When the slice ends (or the domain runs out of
//! work) the domain goes back into the queue one round later and the next head takes over.
//!
//! Ticks alone drift from the intended proportion because command groups are not preemptive: a
//! group dispatched just before a slice ends overruns it. So, as in the Xen credit scheduler the
//! paper builds on, every vGPU also holds a GPU-time credit balance: each completed group is
//! debited from its owner, and at every credit period the GPU time debited in that period is
//! handed back out in proportion to `X` among the vGPUs that were active. vGPUs with a positive
//! balance (UNDER) go before those without (OVER); within a class the queue is round robin, a
//! round in order of decreasing `X` (the paper's credit-sorted queue). The balances stay bounded,
//! so over a long run each backlogged vGPU gets GPU time in proportion to its credits.
//!
//! AugC puts vGPUs holding an unspent boost ahead of UNDER (Algorithm 2 picks the highest
//! `AugCredit + X`; the boost is bounded and expires each period, so no one is denied its turn).
//! CoSched picks the on-CPU vGPU with the highest credit balance (Algorithm 2's "highest X";
//! the balance carries `X` through the refills) and holds the GPU one tick at a time.
//!
//! Pegasus's hypervisor saw the exact vCPU schedule; we see the vCPUs only through sampled CPU
//! hints. A VM whose vCPUs halt while they wait on GPU fences runs only briefly after each
//! fence, which a sampler misses, and gets no fences while it gets no GPU: strict
//! co-scheduling would starve it for as long as an on-CPU VM has work. So CoSched and AugC (whose
//! boost class an on-CPU VM can hold for a whole period, every period) bound the wait: a vGPU
//! whose oldest queued group has waited [`PegasusConfig::max_wait`] goes next, oldest first
//! (CoSched also ends the holder's tick for it; AugC lets the slice run out).
//!
//! Modes ([`PegasusMode`]): `rr` (plain round robin, one tick each), `accc` (credits from
//! [`crate::model::VgpuParams::weight`]), `xc` (credits are the VM's CPU weight from its
//! [`crate::model::CpuHint`]), `slaf` (AccC plus compensation for SLO violations), `augc` (AccC
//! plus a temporary boost of the remaining CPU credit for vGPUs whose vCPUs run now) and
//! `cosched` (only vGPUs whose vCPUs are on a CPU, else the highest credit). FCFS ("None" in the
//! paper) is the `none` policy. [`select_accelerator`] is the paper's accelerator selection for
//! placing a new vGPU when several GPUs exist.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::core::{Cx, VgpuState};
use crate::model::{Budget, DEFAULT_WEIGHT, NS_PER_MS, NS_PER_SEC, NS_PER_US, Nanos, Time, VgpuId};
use crate::policy::ready::ReadySet;
use crate::policy::{Completion, Policy};

/// Shortest tick accepted: below this the slice bookkeeping would run once per group or more
/// often, and completions (which drive the decisions) cannot be timed that finely anyway.
pub const MIN_TICK: Nanos = 100 * NS_PER_US;
/// Longest tick accepted: one second already makes the GPU unresponsive to other VMs.
pub const MAX_TICK: Nanos = NS_PER_SEC;
/// Shortest credit period accepted: the period work is proportional to the vGPUs touched in
/// the period, so it must not run per group.
pub const MIN_PERIOD: Nanos = NS_PER_MS;
/// Longest credit period accepted: credits must be refilled often enough to track demand.
pub const MAX_PERIOD: Nanos = 10 * NS_PER_SEC;
/// Most ticks one slice may last (`Tm` is capped here): bounds how long the others wait when
/// credits differ by orders of magnitude. Credits keep the long-run proportion regardless.
pub const MAX_SLICE_TICKS: u32 = 256;
/// Most compensation ticks SLAF may add to one slice: bounds the delay it imposes on others.
pub const MAX_COMPENSATION_TICKS: u32 = 16;
/// A credit balance stays within this many credit periods of GPU time either way, so one huge
/// group (or a long idle spell) cannot lock a vGPU out or give it a burst for ever.
pub const MAX_CREDIT_PERIODS: i64 = 64;
/// Shortest bounded wait accepted ([`PegasusConfig::max_wait`]): below a millisecond nearly
/// every group would be overdue and CoSched and AugC would degenerate to first come, first served.
pub const MIN_MAX_WAIT: Nanos = NS_PER_MS;
/// Longest bounded wait accepted: a guest whose GPU work waits longer shows a frozen display,
/// and its driver's fence timeouts fire (the Linux DRM scheduler's default is 10 s).
pub const MAX_MAX_WAIT: Nanos = 10 * NS_PER_SEC;
/// The default bounded wait: five default credit periods (150 ms). It is longer than the
/// daemon's 100 ms CPU sample interval, so the co-scheduling order, which changes only with a
/// sample, still decides most dispatches, and short enough that a halted VM's GPU work still
/// completes several times a second next to a VM that is always on a CPU.
pub const DEFAULT_MAX_WAIT: Nanos = 150 * NS_PER_MS;
/// Fractional bits of the global refill accumulator (credit per unit of `X`): a refill of `r` ns
/// among vGPUs whose credits sum to `Xa` advances it by `r · 2^32 / Xa`, so each vGPU's share
/// `X · ΔG / 2^32` is exact to within 1 ns while `r · 2^32` (at most 2^96) fits in a u128.
const CREDIT_SHIFT: u32 = 32;

/// The host CPU weight (cgroup v2 `cpu.weight` scale) hinted for a vGPU holding the default
/// credits [`DEFAULT_WEIGHT`]: cgroup v2's default, so a VM with default credits keeps the
/// CPU share it would have without the hint.
pub const CPU_WEIGHT_DEFAULT: u32 = 100;
/// Smallest host CPU weight hinted (cgroup v2's `cpu.weight` minimum).
pub const CPU_WEIGHT_MIN: u32 = 1;
/// Largest host CPU weight hinted (cgroup v2's `cpu.weight` maximum).
pub const CPU_WEIGHT_MAX: u32 = 10_000;

/// The host CPU weight the credit modes (all but `rr` and `xc`) hint for a vGPU with credits
/// `x`: proportional to `x`, with [`DEFAULT_WEIGHT`] credits mapped to [`CPU_WEIGHT_DEFAULT`]
/// (`x * 100 / 256`, truncated), clamped to [`CPU_WEIGHT_MIN`]..=[`CPU_WEIGHT_MAX`]. The VM
/// whose GPU work gets the larger share so also gets the CPU time to feed it (DESIGN §5).
pub fn cpu_weight_for(x: u32) -> u32 {
    let w = u64::from(x).saturating_mul(u64::from(CPU_WEIGHT_DEFAULT)) / u64::from(DEFAULT_WEIGHT);
    let clamped = w.clamp(u64::from(CPU_WEIGHT_MIN), u64::from(CPU_WEIGHT_MAX));
    u32::try_from(clamped).unwrap_or(CPU_WEIGHT_MAX)
}

/// The Pegasus scheduling method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PegasusMode {
    /// Round robin among vGPUs with queued work, one tick each (fair share).
    Rr,
    /// AccCredit: slices of `X / Xmin` ticks with `X` = the vGPU's weight (proportional share).
    #[default]
    Accc,
    /// XenoCredit: AccC with `X` = the VM's CPU weight from its CPU hint (the weight until the
    /// first hint arrives).
    Xc,
    /// SLA feedback: AccC plus compensation ticks and credit for vGPUs whose SLO (GPU time per
    /// second) was violated in the last period.
    Slaf,
    /// Augmented credits: AccC plus, for vGPUs whose vCPUs run at a period boundary, their
    /// remaining CPU credit as a temporary GPU credit for the next period.
    Augc,
    /// Strict co-scheduling: only vGPUs whose vCPUs are on a CPU; when none of the ready ones is,
    /// the ready vGPU with the highest credit, to keep the GPU busy.
    Cosched,
}

impl PegasusMode {
    fn name(self) -> &'static str {
        match self {
            PegasusMode::Rr => "pegasus-rr",
            PegasusMode::Accc => "pegasus-accc",
            PegasusMode::Xc => "pegasus-xc",
            PegasusMode::Slaf => "pegasus-slaf",
            PegasusMode::Augc => "pegasus-augc",
            PegasusMode::Cosched => "pegasus-cosched",
        }
    }
}

/// Global parameters of the Pegasus family (`policy = "pegasus"`). Every field has a default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PegasusConfig {
    /// The scheduling method (`rr`, `accc`, `xc`, `slaf`, `augc`, `cosched`; default `accc`).
    pub mode: PegasusMode,
    /// Credit period in nanoseconds (default 30 ms, the paper's typical scheduling period):
    /// credits are refilled, SLOs checked and AugC boosts computed once per period. Clamped to
    /// [`MIN_PERIOD`]..=[`MAX_PERIOD`].
    pub period: Nanos,
    /// One scheduling tick in nanoseconds (default 10 ms, Xen's scheduler tick, which Pegasus
    /// uses as its timer interval). Clamped to [`MIN_TICK`]..=[`MAX_TICK`].
    pub tick: Nanos,
    /// Most ticks in one slice (`Tm` is capped here; default 16, at most [`MAX_SLICE_TICKS`]).
    pub max_slice_ticks: u32,
    /// SLAF: extra ticks per slice for a vGPU whose SLO was violated in the last period, and the
    /// most compensation credit it gets per period in ticks' worth of GPU time (default 1, at
    /// most [`MAX_COMPENSATION_TICKS`]).
    pub slaf_compensation: u32,
    /// CoSched and AugC: the longest a vGPU's oldest queued group waits before the vGPU goes
    /// next as if co-scheduled (oldest first), in nanoseconds (default [`DEFAULT_MAX_WAIT`]).
    /// Bounds the starvation of a VM whose vCPUs the CPU samples miss. Clamped to
    /// [`MIN_MAX_WAIT`]..=[`MAX_MAX_WAIT`].
    pub max_wait: Nanos,
}

impl Default for PegasusConfig {
    fn default() -> Self {
        PegasusConfig {
            mode: PegasusMode::Accc,
            period: 30 * NS_PER_MS,
            tick: 10 * NS_PER_MS,
            max_slice_ticks: 16,
            slaf_compensation: 1,
            max_wait: DEFAULT_MAX_WAIT,
        }
    }
}

impl PegasusConfig {
    /// The configuration with every field inside its accepted range.
    fn sanitized(&self) -> PegasusConfig {
        PegasusConfig {
            mode: self.mode,
            period: self.period.clamp(MIN_PERIOD, MAX_PERIOD),
            tick: self.tick.clamp(MIN_TICK, MAX_TICK),
            max_slice_ticks: self.max_slice_ticks.clamp(1, MAX_SLICE_TICKS),
            slaf_compensation: self.slaf_compensation.min(MAX_COMPENSATION_TICKS),
            max_wait: self.max_wait.clamp(MIN_MAX_WAIT, MAX_MAX_WAIT),
        }
    }
}

/// One accelerator as the placement sees it: its profile and its current load (§3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AcceleratorLoad {
    /// Static capability from the accelerator's profile (relative throughput, e.g. cores ×
    /// clock); 0 marks an accelerator that must not be used.
    pub capability: u64,
    /// The sum of the credits (weights) of the vGPUs already placed on it.
    pub credits: u64,
    /// How many vGPUs are placed on it.
    pub domains: u32,
    /// Most vGPUs it accepts (Pegasus restricts the domains per accelerator); `None`: no limit.
    pub max_domains: Option<u32>,
}

/// Pegasus's accelerator selection: the index of the accelerator a new vGPU with credits
/// `weight` goes to, or `None` when none can take it.
///
/// Each accelerator's weight is its capability divided by the credits it would carry with the
/// newcomer (`capability / (credits + weight)`): the more it is used, the lower its weight, so it
/// is not oversubscribed, and the most capable one is considered first. The highest weight wins;
/// ties go to the accelerator with fewer vGPUs, then to the lower index.
pub fn select_accelerator(loads: &[AcceleratorLoad], weight: u32) -> Option<usize> {
    let weight = u128::from(weight.max(1));
    let usable = loads
        .iter()
        .enumerate()
        .filter(|(_, a)| a.capability > 0 && a.max_domains.is_none_or(|max| a.domains < max));
    // Compare capability_a / load_a with capability_b / load_b by cross-multiplying in u128
    // (u64 × (u64 + u32) fits).
    usable
        .max_by(|(i, a), (j, b)| {
            let load_a = u128::from(a.credits) + weight;
            let load_b = u128::from(b.credits) + weight;
            let lhs = u128::from(a.capability) * load_b;
            let rhs = u128::from(b.capability) * load_a;
            lhs.cmp(&rhs).then(b.domains.cmp(&a.domains)).then(j.cmp(i))
        })
        .map(|(i, _)| i)
}

/// The run-queue key: (class, round, rank); smaller goes first, ties to the lower id.
///
/// Credit modes: class 0 = AugC boost, 1 = UNDER (positive credit), 2 = OVER; rank = −X.
/// RR: class 0, rank 0. CoSched: class 0 = vCPUs on a CPU, 1 = not; round 0, rank 0 (the
/// order within a class is kept in [`CoGroups`]).
type Key = (u8, u64, i64);

/// A CoSched group: the waiting vGPUs of one class that share a refill rule (accruing with the
/// same `X`, or not accruing: `X` = 0).
type CoGroup = (u8, u32);

/// CoSched's order within a class: per group, the vGPUs by decreasing normalised balance
/// `credit · 2^CREDIT_SHIFT − X · G_seen` (ties to the lower id). A refill through `G` adds
/// `X · ΔG` to every member of a group alike, so it never reorders a group; the head of the
/// class is the best of the group heads.
type CoGroups = BTreeMap<CoGroup, BTreeSet<(Reverse<i128>, VgpuId)>>;

/// SLAF: a group of queued OVER vGPUs that accrue the same refill and compensation per period
/// (`X`, want), each with its normalised balance `credit · 2^CREDIT_SHIFT − X · G_seen −
/// want · F_seen`. Refills through `G` and `F` never reorder a group, so the members turn
/// positive in order of decreasing normalised balance.
type OverGroups = BTreeMap<(u32, Nanos), BTreeSet<(Reverse<i128>, VgpuId)>>;

/// The Pegasus state of one vGPU (domain).
#[derive(Debug, Clone, Default)]
struct Domain {
    /// Its credits `X` (weight or CPU weight), at least 1.
    x: u32,
    /// GPU-time credit balance in ns, within ±[`MAX_CREDIT_PERIODS`] periods.
    credit: i64,
    /// AugC: temporary credit for this period, spent before `credit`.
    aug: Nanos,
    /// SLAF: its SLO was violated in the last period; its slices get compensation ticks.
    violated: bool,
    /// ContextEstablished: it ran on the GPU and has not been idle for a whole period since.
    established: bool,
    /// The run-queue round it is in.
    round: u64,
    /// GPU time of its groups completed in this period.
    used: Nanos,
    /// CPU usage at the last period boundary (from its CPU hints), once a hint arrived.
    cpu_mark: Option<Nanos>,
    /// It was backlogged at the last boundary it was processed at, so it takes its share of
    /// every refill until touched: `credit` lags by
    /// `(X · (G − g_seen) + want · (F − f_seen)) / 2^CREDIT_SHIFT`, where want is its SLAF
    /// compensation per period (see [`Pegasus::want`]).
    accruing: bool,
    /// The global accumulator `G` when `credit` was last brought up to date.
    g_seen: u128,
    /// The global compensation accumulator `F` when `credit` was last brought up to date.
    f_seen: u128,
    /// SLAF: the GPU time its SLO asks for in one regular period, as of the last boundary it
    /// was processed at (the SLO only changes with a touch); 0 in the other modes.
    slo_expected: Nanos,
    /// The number of the last boundary it was processed at: an accruing vGPU not processed at
    /// later ones had no GPU time in them, so under SLAF its SLO counts as violated there.
    epoch: u64,
    /// SLAF: its group and normalised balance while it waits OVER with compensation to accrue.
    over_key: Option<((u32, Nanos), i128)>,
    /// The `G` at which its (non-positive) balance turns positive, while it waits in the run
    /// queue in a mode whose class depends on the balance.
    positive_at: Option<u128>,
    /// It is in the list of vGPUs the next period boundary processes.
    dirty: bool,
    /// CoSched: its group and normalised balance while it waits.
    co_key: Option<(CoGroup, i128)>,
    /// CPU time used since the last boundary per its latest hint (its part of `cpu_total`).
    cpu_delta: Nanos,
    /// The CPU weight of its latest hint (its part of `cpu_weights`).
    cpu_weight: u32,
}

/// Where a queued OVER vGPU waits for its balance to turn positive.
#[derive(Debug, Clone, Copy)]
enum TurnsPositive {
    /// At this value of `G` (it accrues no compensation).
    AtG(u128),
    /// In this SLAF group, with this normalised balance (see [`OverGroups`]).
    Over((u32, Nanos), i128),
}

/// The slice the GPU is given to.
#[derive(Debug, Clone, Copy)]
struct Slice {
    vgpu: VgpuId,
    end: Time,
    /// Given under CoSched because the holder was overdue ([`PegasusConfig::max_wait`]): it
    /// lasts one tick and is not cut short, so that a GPU on which everyone is overdue changes
    /// holder once per tick, not after every group.
    overdue: bool,
}

/// The Pegasus policy in one of its modes.
#[derive(Debug)]
pub struct Pegasus {
    cfg: PegasusConfig,
    domains: Vec<Option<Domain>>,
    /// Multiset of the attached vGPUs' `X`, for `Xmin` in O(log n).
    xs: BTreeMap<u32, usize>,
    /// The sum of the attached vGPUs' `X`.
    x_sum: u64,
    /// vGPUs with queued work, except the one holding the slice.
    ready: ReadySet<Key>,
    current: Option<Slice>,
    /// The latest round a slice was given in.
    round: u64,
    /// The start of the current credit period and the next boundary (set once a vGPU exists).
    period_start: Time,
    next_period: Option<Time>,
    /// GPU time debited from credit balances in this period: the next refill hands it out.
    debited: Nanos,
    /// Global refill accumulator: credit per unit of `X` handed to every backlogged vGPU so
    /// far, with [`CREDIT_SHIFT`] fractional bits (saturating; it would take some 2^32 periods
    /// of 2^64 ns refills to get there).
    g: u128,
    /// The sum of `X` over the accruing vGPUs.
    x_accruing: u64,
    /// SLAF's global compensation accumulator: the compensation per unit of want handed to
    /// every accruing vGPU so far (2^CREDIT_SHIFT per period while the pool covers all wants;
    /// saturating like `G`).
    f: u128,
    /// The sum of want over the accruing vGPUs.
    want_accruing: u64,
    /// The number of period boundaries processed so far.
    epoch: u64,
    /// SLAF: queued accruing OVER vGPUs with compensation to accrue (the others with a
    /// non-positive balance are in `positive_at`).
    over: OverGroups,
    /// vGPUs touched in this period (each once): only they need per-vGPU work at the boundary.
    dirty: Vec<VgpuId>,
    /// Queued accruing vGPUs with a non-positive balance, by the `G` at which it turns positive.
    positive_at: BTreeSet<(u128, VgpuId)>,
    /// `X` was added since the last boundary: idle vGPUs' caps may have shrunk, so the next
    /// boundary processes every vGPU.
    caps_stale: bool,
    /// CPU time all attached vGPUs used since the last boundary, per their hints.
    cpu_total: u64,
    /// The sum of the attached vGPUs' CPU weights, per their hints.
    cpu_weights: u64,
    /// vGPUs whose hint says their vCPUs run (with a CPU weight): AugC boosts only them.
    on_cpu: BTreeSet<VgpuId>,
    /// vGPUs given an AugC boost at the last boundary: the next one takes it back.
    boosted: Vec<VgpuId>,
    /// CoSched: the waiting vGPUs in order of balance, per class.
    co: CoGroups,
    /// CoSched and AugC: the vGPUs in `ready` by the arrival order of their oldest queued group
    /// (its `head_seq`), for the bounded wait. A waiting vGPU's head only changes when it is
    /// dispatched, and it leaves `ready` for that.
    waiting: ReadySet<u64>,
}

/// Counts a GPU time as credit, saturating.
fn as_credit(ns: Nanos) -> i64 {
    i64::try_from(ns).unwrap_or(i64::MAX)
}

/// `a * b / c` without overflow (0 when `c` is 0), saturated to u64.
fn mul_div(a: u64, b: u64, c: u64) -> u64 {
    if c == 0 {
        return 0;
    }
    let q = u128::from(a) * u128::from(b) / u128::from(c);
    u64::try_from(q).unwrap_or(u64::MAX)
}

impl Pegasus {
    /// A Pegasus policy; out-of-range parameters are clamped to their limits.
    pub fn new(cfg: &PegasusConfig) -> Self {
        Pegasus {
            cfg: cfg.sanitized(),
            domains: Vec::new(),
            xs: BTreeMap::new(),
            x_sum: 0,
            ready: ReadySet::default(),
            current: None,
            round: 0,
            period_start: 0,
            next_period: None,
            debited: 0,
            g: 0,
            x_accruing: 0,
            f: 0,
            want_accruing: 0,
            epoch: 0,
            over: BTreeMap::new(),
            dirty: Vec::new(),
            positive_at: BTreeSet::new(),
            caps_stale: false,
            cpu_total: 0,
            cpu_weights: 0,
            on_cpu: BTreeSet::new(),
            boosted: Vec::new(),
            co: BTreeMap::new(),
            waiting: ReadySet::default(),
        }
    }

    fn domain(&self, v: VgpuId) -> Option<&Domain> {
        self.domains.get(v.index()).and_then(Option::as_ref)
    }

    fn domain_mut(&mut self, v: VgpuId) -> Option<&mut Domain> {
        self.domains.get_mut(v.index()).and_then(Option::as_mut)
    }

    fn credit_limit(&self) -> i64 {
        as_credit(self.cfg.period).saturating_mul(MAX_CREDIT_PERIODS)
    }

    /// The credits `X` the mode gives the vGPU now.
    fn credits_of(&self, cx: &Cx<'_>, v: VgpuId) -> u32 {
        let Some(s) = cx.vgpu(v) else { return 1 };
        let hint = s.cpu().weight;
        let x = match self.cfg.mode {
            PegasusMode::Xc if hint > 0 => hint,
            _ => s.params().weight,
        };
        x.max(1)
    }

    /// Hints the host CPU weight for `v`'s credits `x` ([`cpu_weight_for`]) in the modes whose
    /// credits are GPU credits: not `rr` (no credits) nor `xc` (its credits are the CPU weight).
    fn hint_cpu_weight(&self, cx: &mut Cx<'_>, v: VgpuId, x: u32) {
        if !matches!(self.cfg.mode, PegasusMode::Rr | PegasusMode::Xc) {
            cx.cpu_weight(v, cpu_weight_for(x));
        }
    }

    fn add_x(&mut self, x: u32) {
        self.caps_stale = true;
        *self.xs.entry(x).or_insert(0) += 1;
        self.x_sum = self.x_sum.saturating_add(u64::from(x));
    }

    fn remove_x(&mut self, x: u32) {
        if let Some(n) = self.xs.get_mut(&x) {
            *n -= 1;
            if *n == 0 {
                self.xs.remove(&x);
            }
            self.x_sum = self.x_sum.saturating_sub(u64::from(x));
        }
    }

    /// Re-reads the vGPU's `X` (its weight, or its CPU weight under XC).
    fn refresh_x(&mut self, cx: &Cx<'_>, v: VgpuId) {
        let x = self.credits_of(cx, v);
        let Some((old, accruing)) = self.domain(v).map(|d| (d.x, d.accruing)) else {
            return;
        };
        if old != x {
            // The refills so far were earned with the old X.
            self.settle(v);
            self.remove_x(old);
            self.add_x(x);
            if accruing {
                self.x_accruing = self
                    .x_accruing
                    .saturating_sub(u64::from(old))
                    .saturating_add(u64::from(x));
            }
            if let Some(d) = self.domain_mut(v) {
                d.x = x;
            }
        }
    }

    /// The SLAF compensation per period an untouched accruing `d` takes: its SLO's shortfall
    /// with no GPU time at all, at most the compensation ticks (0 when it does not accrue).
    fn want(&self, d: &Domain) -> Nanos {
        if !d.accruing {
            return 0;
        }
        let comp = self
            .cfg
            .tick
            .saturating_mul(u64::from(self.cfg.slaf_compensation));
        d.slo_expected.min(comp)
    }

    /// Whether the SLO of `d` was violated in the last period: as processed at its last
    /// boundary, or, if it was accruing and not processed at later ones, whether it has an SLO
    /// to miss (it had no GPU time in the last period).
    fn violated_now(&self, d: &Domain) -> bool {
        if self.cfg.mode == PegasusMode::Slaf && d.accruing && d.epoch < self.epoch {
            d.slo_expected > 0
        } else {
            d.violated
        }
    }

    /// The refills and compensation `d` has earned since its balance was last brought up to
    /// date, in ns.
    fn pending(&self, d: &Domain) -> i64 {
        if !d.accruing {
            return 0;
        }
        let refill = u128::from(d.x).checked_mul(self.g.saturating_sub(d.g_seen));
        let comp = u128::from(self.want(d)).checked_mul(self.f.saturating_sub(d.f_seen));
        let grant = refill
            .zip(comp)
            .and_then(|(a, b)| a.checked_add(b))
            .map_or(u128::MAX, |p| p >> CREDIT_SHIFT);
        i64::try_from(grant).unwrap_or(i64::MAX)
    }

    /// The credit balance of `d` now, refills included. Refills are never negative, so
    /// clamping once equals clamping after each of them.
    fn credit_now(&self, d: &Domain) -> i64 {
        d.credit
            .saturating_add(self.pending(d))
            .min(self.credit_limit())
    }

    /// Brings the vGPU's stored balance up to date with the refills so far.
    fn settle(&mut self, v: VgpuId) {
        let (g, f) = (self.g, self.f);
        let Some(credit) = self.domain(v).map(|d| self.credit_now(d)) else {
            return;
        };
        if let Some(d) = self.domain_mut(v) {
            d.credit = credit;
            d.g_seen = g;
            d.f_seen = f;
        }
    }

    /// Adds the vGPU to the list the next period boundary processes.
    fn touch(&mut self, v: VgpuId) {
        if let Some(d) = self.domain_mut(v)
            && !d.dirty
        {
            d.dirty = true;
            self.dirty.push(v);
        }
    }

    /// Takes the vGPU's CPU hint into the CPU sums and the on-CPU set (`attached`: false when
    /// it leaves them).
    fn note_hint(&mut self, cx: &Cx<'_>, v: VgpuId, attached: bool) {
        let hint = cx.vgpu(v).map(|s| *s.cpu()).unwrap_or_default();
        let Some(d) = self.domain_mut(v) else { return };
        let (old_delta, old_weight) = (d.cpu_delta, d.cpu_weight);
        if attached {
            d.cpu_delta = match d.cpu_mark {
                Some(mark) if hint.weight > 0 => hint.usage.saturating_sub(mark),
                _ => 0,
            };
            d.cpu_weight = hint.weight;
        } else {
            d.cpu_delta = 0;
            d.cpu_weight = 0;
        }
        let (delta, weight) = (d.cpu_delta, d.cpu_weight);
        self.cpu_total = self
            .cpu_total
            .saturating_sub(old_delta)
            .saturating_add(delta);
        self.cpu_weights = self
            .cpu_weights
            .saturating_sub(u64::from(old_weight))
            .saturating_add(u64::from(weight));
        if attached && hint.running && weight > 0 {
            self.on_cpu.insert(v);
        } else {
            self.on_cpu.remove(&v);
        }
    }

    /// Stops the vGPU accruing refills (its balance must be settled).
    fn stop_accruing(&mut self, v: VgpuId) {
        let Some(want) = self.domain(v).map(|d| self.want(d)) else {
            return;
        };
        let Some(d) = self.domain_mut(v) else { return };
        let x = d.x;
        if std::mem::take(&mut d.accruing) {
            self.x_accruing = self.x_accruing.saturating_sub(u64::from(x));
            self.want_accruing = self.want_accruing.saturating_sub(want);
        }
    }

    /// Where the settled balance of queued `d` is watched until it turns positive, if the
    /// run-queue class depends on it and it is not positive yet.
    fn turns_positive(&self, d: &Domain) -> Option<TurnsPositive> {
        let classes = matches!(
            self.cfg.mode,
            PegasusMode::Accc | PegasusMode::Xc | PegasusMode::Slaf | PegasusMode::Augc
        );
        if !classes || !d.accruing || d.credit > 0 {
            return None;
        }
        let want = self.want(d);
        if want > 0 {
            let scaled = i128::from(d.credit).saturating_mul(1 << CREDIT_SHIFT);
            let g_seen = i128::try_from(d.g_seen).unwrap_or(i128::MAX);
            let f_seen = i128::try_from(d.f_seen).unwrap_or(i128::MAX);
            let b = scaled
                .saturating_sub(i128::from(d.x).saturating_mul(g_seen))
                .saturating_sub(i128::from(want).saturating_mul(f_seen));
            return Some(TurnsPositive::Over((d.x, want), b));
        }
        // The least D with floor(X · D / 2^S) >= 1 - credit.
        let missing = u128::try_from(1i128.saturating_sub(i128::from(d.credit))).ok()?;
        let steps = (missing << CREDIT_SHIFT).div_ceil(u128::from(d.x.max(1)));
        Some(TurnsPositive::AtG(d.g_seen.saturating_add(steps)))
    }

    /// Takes the vGPU out of the run queue (and of the turn-positive indexes).
    fn unready(&mut self, v: VgpuId) {
        self.ready.remove(v);
        self.waiting.remove(v);
        if let Some(t) = self.domain_mut(v).and_then(|d| d.positive_at.take()) {
            self.positive_at.remove(&(t, v));
        }
        if let Some((group, b)) = self.domain_mut(v).and_then(|d| d.over_key.take())
            && let Some(set) = self.over.get_mut(&group)
        {
            set.remove(&(Reverse(b), v));
            if set.is_empty() {
                self.over.remove(&group);
            }
        }
        if let Some((group, b)) = self.domain_mut(v).and_then(|d| d.co_key.take())
            && let Some(set) = self.co.get_mut(&group)
        {
            set.remove(&(Reverse(b), v));
            if set.is_empty() {
                self.co.remove(&group);
            }
        }
    }

    /// CoSched: the group and normalised balance of settled `d` waiting in `class`.
    fn co_key(d: &Domain, class: u8) -> (CoGroup, i128) {
        let x = if d.accruing { d.x } else { 0 };
        let scaled = i128::from(d.credit).saturating_mul(1 << CREDIT_SHIFT);
        let seen = i128::try_from(d.g_seen).unwrap_or(i128::MAX);
        let b = scaled.saturating_sub(i128::from(x).saturating_mul(seen));
        ((class, x), b)
    }

    /// CoSched: the waiting vGPU of `class` with the highest balance now (ties to the lower
    /// id): the best of the group heads, O(groups · log n).
    fn co_first(&self, class: u8) -> Option<VgpuId> {
        self.co
            .range((class, 0)..=(class, u32::MAX))
            .filter_map(|(_, set)| set.first().map(|&(_, v)| v))
            .filter_map(|v| self.domain(v).map(|d| (self.credit_now(d), v)))
            .max_by(|(ca, va), (cb, vb)| ca.cmp(cb).then(vb.cmp(va)))
            .map(|(_, v)| v)
    }

    /// Whether the mode bounds the wait ([`PegasusConfig::max_wait`]): the modes that order
    /// by the sampled vCPU state.
    fn bounds_wait(&self) -> bool {
        matches!(self.cfg.mode, PegasusMode::Cosched | PegasusMode::Augc)
    }

    /// The waiting vGPU whose oldest queued group arrived first, if that group has waited
    /// [`PegasusConfig::max_wait`] or longer: O(log n).
    fn overdue(&self, cx: &Cx<'_>) -> Option<VgpuId> {
        let (_, v) = self.waiting.first()?;
        let since = cx.vgpu(v)?.head_submitted()?;
        (cx.now().saturating_sub(since) >= self.cfg.max_wait).then_some(v)
    }

    fn xmin(&self) -> u32 {
        self.xs.keys().next().copied().unwrap_or(1)
    }

    /// The length of the next slice of `d` in ns: `Tc` ticks (Algorithm 1) plus SLAF's
    /// compensation ticks.
    fn slice_len(&self, d: &Domain) -> Nanos {
        let tick = self.cfg.tick;
        let base = match self.cfg.mode {
            PegasusMode::Rr | PegasusMode::Cosched => tick,
            _ if !d.established => tick,
            _ => {
                // Tm = X / Xmin ticks, kept fractional so uneven credits stay proportional.
                let tm = mul_div(tick, u64::from(d.x), u64::from(self.xmin()));
                let cap = tick.saturating_mul(u64::from(self.cfg.max_slice_ticks));
                tm.clamp(tick, cap)
            }
        };
        let comp = if self.cfg.mode == PegasusMode::Slaf && self.violated_now(d) {
            tick.saturating_mul(u64::from(self.cfg.slaf_compensation))
        } else {
            0
        };
        base.saturating_add(comp)
    }

    fn key(&self, cx: &Cx<'_>, v: VgpuId, d: &Domain) -> Key {
        match self.cfg.mode {
            PegasusMode::Rr => (0, d.round, 0),
            PegasusMode::Cosched => {
                let on_cpu = cx.vgpu(v).is_some_and(|s| s.cpu().running);
                (u8::from(!on_cpu), 0, 0)
            }
            mode => {
                let class = if mode == PegasusMode::Augc && d.aug > 0 {
                    0
                } else if d.credit > 0 {
                    1
                } else {
                    2
                };
                (class, d.round, -i64::from(d.x))
            }
        }
    }

    /// Puts the vGPU in the run queue under its current key if it has queued work and does not
    /// hold the slice; takes it out otherwise.
    fn index(&mut self, cx: &Cx<'_>, v: VgpuId) {
        self.settle(v);
        self.unready(v);
        let holds = self.current.is_some_and(|c| c.vgpu == v);
        let queued = cx.vgpu(v).is_some_and(|s| s.queued() > 0);
        let Some(d) = self.domain(v) else { return };
        if queued && !holds {
            let key = self.key(cx, v, d);
            let turn = self.turns_positive(d);
            let co = (self.cfg.mode == PegasusMode::Cosched).then(|| Self::co_key(d, key.0));
            self.ready.insert(v, key);
            if self.bounds_wait()
                && let Some(seq) = cx.vgpu(v).and_then(VgpuState::head_seq)
            {
                self.waiting.insert(v, seq);
            }
            if let Some((group, b)) = co {
                self.co.entry(group).or_default().insert((Reverse(b), v));
                if let Some(d) = self.domain_mut(v) {
                    d.co_key = Some((group, b));
                }
            }
            match turn {
                Some(TurnsPositive::AtG(t)) => {
                    self.positive_at.insert((t, v));
                    if let Some(d) = self.domain_mut(v) {
                        d.positive_at = Some(t);
                    }
                }
                Some(TurnsPositive::Over(group, b)) => {
                    self.over.entry(group).or_default().insert((Reverse(b), v));
                    if let Some(d) = self.domain_mut(v) {
                        d.over_key = Some((group, b));
                    }
                }
                None => {}
            }
        }
    }

    /// Whether the slice holder goes on: its slice has time left, it has queued work and (under
    /// CoSched) no waiting vGPU is overdue and its vCPUs are on a CPU or no waiting vGPU's are.
    fn keeps_slice(&self, cx: &Cx<'_>, cur: Slice) -> bool {
        let Some(s) = cx.vgpu(cur.vgpu) else {
            return false;
        };
        if cx.now() >= cur.end || s.queued() == 0 {
            return false;
        }
        if self.cfg.mode != PegasusMode::Cosched {
            return true;
        }
        // An overdue holder's tick is not cut short, by overdue or on-CPU vGPUs alike.
        if cur.overdue {
            return true;
        }
        if self.overdue(cx).is_some() {
            return false;
        }
        let on_cpu_waiting = self
            .ready
            .first()
            .is_some_and(|((class, _, _), _)| class == 0);
        s.cpu().running || !on_cpu_waiting
    }

    /// Ends the current slice: the holder goes back into the queue one round later.
    fn end_slice(&mut self, cx: &Cx<'_>) {
        let Some(cur) = self.current.take() else {
            return;
        };
        let round = self.round;
        if let Some(d) = self.domain_mut(cur.vgpu) {
            d.round = d.round.max(round).saturating_add(1);
        }
        self.touch(cur.vgpu);
        self.index(cx, cur.vgpu);
    }

    /// The credit-period work for the period that ended `elapsed` ns after it began: AugC
    /// boosts, SLAF violations and compensation, the refill, ContextEstablished expiry.
    ///
    /// Only the vGPUs touched in the period are processed one by one (under AugC also those
    /// on a CPU or boosted; every vGPU after `X` grew, and under SLAF when boundaries were
    /// skipped, as the SLOs then ask for more than one period's worth). An untouched vGPU is in
    /// the same state as at the last boundary: if it was backlogged it had no GPU time, so under
    /// SLAF it misses its SLO (if any) and wants the same compensation as in every such period;
    /// it takes that through the accumulator `F` and its share of the refill through `G`. If it
    /// was idle the boundary changes nothing for it.
    fn end_period(&mut self, cx: &Cx<'_>, elapsed: Nanos) {
        struct Row {
            v: VgpuId,
            x: u32,
            active: bool,
            backlogged: bool,
            cpu_delta: Nanos,
            cpu_weight: u32,
            running: bool,
            want: Nanos,
        }
        let mode = self.cfg.mode;
        let comp = self
            .cfg
            .tick
            .saturating_mul(u64::from(self.cfg.slaf_compensation));
        let holder = self.current.map(|c| c.vgpu);
        self.epoch = self.epoch.saturating_add(1);
        let epoch = self.epoch;
        if mode == PegasusMode::Augc {
            // Only vGPUs running now get a boost, and only those boosted lose one.
            let running: Vec<VgpuId> = self.on_cpu.iter().copied().collect();
            for v in running.into_iter().chain(std::mem::take(&mut self.boosted)) {
                self.touch(v);
            }
        }
        // AugC: the remaining CPU credit of a VM is its CPU-weight share of the CPU time all
        // VMs used in the period, less what it used itself (what Xen's credit scheduler would
        // still owe it). Only hints change the sums, and hinted vGPUs are processed below.
        let cpu_total = std::mem::take(&mut self.cpu_total);
        let cpu_weights = self.cpu_weights;
        let period = self.cfg.period;
        let skipped = mode == PegasusMode::Slaf && elapsed != period;
        let full = std::mem::take(&mut self.caps_stale) || skipped;
        let touched = std::mem::take(&mut self.dirty);
        let eager = if full { cx.vgpu_ids() } else { touched };
        let mut rows = Vec::new();
        for v in eager {
            let Some(s) = cx.vgpu(v) else { continue };
            if !self.domain(v).is_some_and(|d| d.dirty || full) {
                // Listed twice (detached and attached again): already processed.
                continue;
            }
            self.settle(v);
            self.stop_accruing(v);
            let Some(d) = self.domain_mut(v) else {
                continue;
            };
            d.dirty = false;
            let hint = *s.cpu();
            let backlogged = s.queued() > 0 || s.in_flight() > 0 || holder == Some(v);
            let active = backlogged || d.used > 0;
            // CPU time used since the last boundary; a counter that went back (a restarted VM)
            // starts a new baseline.
            let mut cpu_delta = 0;
            if hint.weight > 0 {
                let mark = d.cpu_mark.unwrap_or(hint.usage);
                cpu_delta = hint.usage.saturating_sub(mark);
                d.cpu_mark = Some(hint.usage);
            }
            d.cpu_delta = 0;
            // SLAF: the SLO is GPU time per second; a vGPU that wanted the GPU and got less
            // than its SLO for this period is violated.
            let expected = s
                .params()
                .slo
                .map_or(0, |slo| mul_div(slo, elapsed, NS_PER_SEC));
            d.violated = mode == PegasusMode::Slaf && active && d.used < expected;
            let want = if d.violated {
                (expected - d.used).min(comp)
            } else {
                0
            };
            d.slo_expected = match s.params().slo {
                Some(slo) if mode == PegasusMode::Slaf => mul_div(slo, period, NS_PER_SEC),
                _ => 0,
            };
            rows.push(Row {
                v,
                x: d.x,
                active,
                backlogged,
                cpu_delta,
                cpu_weight: hint.weight,
                running: hint.running,
                want,
            });
        }

        // The refill: SLAF compensation first (scaled down if it exceeds what there is), the
        // rest in proportion to X among the active vGPUs: the untouched accruing ones and the
        // active processed ones. The untouched ones take their compensation through F (the
        // compensation per unit of want) and their share through G (the credit per unit of X).
        let pool = std::mem::take(&mut self.debited);
        let want_lazy = self.want_accruing;
        let want_total: u64 = rows.iter().fold(want_lazy, |a, r| a.saturating_add(r.want));
        let df = if want_total <= pool {
            1 << CREDIT_SHIFT
        } else {
            (u128::from(pool) << CREDIT_SHIFT) / u128::from(want_total)
        };
        let bonus_lazy = u128::from(want_lazy).checked_mul(df).map_or(u64::MAX, |p| {
            u64::try_from(p >> CREDIT_SHIFT).unwrap_or(u64::MAX)
        });
        let x_active = rows
            .iter()
            .filter(|r| r.active)
            .fold(self.x_accruing, |a, r| a.saturating_add(u64::from(r.x)));
        let bonus_of = |want: Nanos| {
            if want_total <= pool {
                want
            } else {
                mul_div(want, pool, want_total)
            }
        };
        let bonus_total: u64 = rows
            .iter()
            .fold(bonus_lazy, |a, r| a.saturating_add(bonus_of(r.want)));
        let rest = pool.saturating_sub(bonus_total);
        let dg = if x_active == 0 {
            0
        } else {
            (u128::from(rest) << CREDIT_SHIFT) / u128::from(x_active)
        };
        self.g = self.g.saturating_add(dg);
        self.f = self.f.saturating_add(df);
        let limit = self.credit_limit();
        let (x_sum, g, f) = (self.x_sum, self.g, self.f);
        let mut carried = Vec::new();
        for r in &rows {
            let Some(d) = self.domain_mut(r.v) else {
                continue;
            };
            let share = if r.active {
                let grant = u128::from(d.x)
                    .checked_mul(dg)
                    .map_or(u128::MAX, |p| p >> CREDIT_SHIFT);
                u64::try_from(grant).unwrap_or(u64::MAX)
            } else {
                0
            };
            let grant = bonus_of(r.want).saturating_add(share);
            d.credit = d.credit.saturating_add(as_credit(grant));
            if !r.backlogged {
                // No saving up: an idle vGPU keeps at most its share of one period.
                let cap = as_credit(mul_div(period, u64::from(d.x), x_sum));
                d.credit = d.credit.min(cap);
            }
            d.credit = d.credit.clamp(-limit, limit);
            d.aug = if mode == PegasusMode::Augc && r.running && r.cpu_weight > 0 {
                let share = mul_div(cpu_total, u64::from(r.cpu_weight), cpu_weights);
                share.saturating_sub(r.cpu_delta).min(elapsed)
            } else {
                0
            };
            d.established &= r.active;
            d.used = 0;
            d.g_seen = g;
            d.f_seen = f;
            d.epoch = epoch;
            d.accruing = r.backlogged;
            if d.aug > 0 {
                self.boosted.push(r.v);
            }
            if r.backlogged {
                let want = self.domain(r.v).map_or(0, |d| self.want(d));
                self.x_accruing = self.x_accruing.saturating_add(u64::from(r.x));
                self.want_accruing = self.want_accruing.saturating_add(want);
            } else if r.active {
                // It goes inactive at the next boundary (its context expires there).
                carried.push(r.v);
            }
        }
        for r in &rows {
            self.index(cx, r.v);
        }
        for v in carried {
            self.touch(v);
        }
        // Queued vGPUs whose balance the refill made positive move from OVER to UNDER: those
        // without compensation by the G at which they turn positive, the others group by group
        // from the head (the highest normalised balance).
        let mut due: Vec<VgpuId> = self
            .positive_at
            .iter()
            .take_while(|&&(t, _)| t <= g)
            .map(|&(_, v)| v)
            .collect();
        for set in self.over.values() {
            due.extend(
                set.iter()
                    .map(|&(_, v)| v)
                    .take_while(|&v| self.domain(v).is_some_and(|d| self.credit_now(d) > 0)),
            );
        }
        for v in due {
            self.index(cx, v);
        }
    }
}

impl Policy for Pegasus {
    fn name(&self) -> &'static str {
        self.cfg.mode.name()
    }

    fn attach(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        let i = v.index();
        if self.domains.len() <= i {
            self.domains.resize(i + 1, None);
        }
        if self.domains[i].is_some() {
            self.unready(v);
            self.stop_accruing(v);
            self.note_hint(cx, v, false);
        }
        if let Some(old) = self.domains[i].take() {
            self.remove_x(old.x);
        }
        let x = self.credits_of(cx, v);
        self.add_x(x);
        let hint = cx.vgpu(v).map(|s| *s.cpu()).unwrap_or_default();
        self.domains[i] = Some(Domain {
            x,
            round: self.round,
            cpu_mark: (hint.weight > 0).then_some(hint.usage),
            g_seen: self.g,
            f_seen: self.f,
            epoch: self.epoch,
            ..Domain::default()
        });
        self.touch(v);
        self.note_hint(cx, v, true);
        self.hint_cpu_weight(cx, v, x);
        if self.next_period.is_none() {
            self.period_start = cx.now();
            self.next_period = Some(cx.now().saturating_add(self.cfg.period));
        }
        self.index(cx, v);
    }

    fn detach(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.unready(v);
        self.stop_accruing(v);
        self.note_hint(cx, v, false);
        if self.current.is_some_and(|c| c.vgpu == v) {
            self.current = None;
        }
        if let Some(old) = self.domains.get_mut(v.index()).and_then(Option::take) {
            self.remove_x(old.x);
        }
        if self.xs.is_empty() {
            self.next_period = None;
        }
    }

    fn params_changed(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        // Keep the balance and the context state; only X (and the SLO, read each period) change.
        let old = self.domain(v).map(|d| d.x);
        self.refresh_x(cx, v);
        if let Some(x) = self.domain(v).map(|d| d.x)
            && old != Some(x)
        {
            self.hint_cpu_weight(cx, v, x);
        }
        self.touch(v);
        self.index(cx, v);
    }

    fn submitted(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.touch(v);
        if self.ready.contains(v) || self.current.is_some_and(|c| c.vgpu == v) {
            return;
        }
        // A vGPU that was idle joins the current round.
        let round = self.round;
        if let Some(d) = self.domain_mut(v) {
            d.round = d.round.max(round);
        }
        self.index(cx, v);
    }

    fn withdrawn(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.touch(v);
        self.index(cx, v);
    }

    fn completed(&mut self, cx: &mut Cx<'_>, done: &Completion) {
        let v = done.vgpu;
        let cost = done.cost();
        let credits = self.cfg.mode != PegasusMode::Rr;
        let limit = self.credit_limit();
        self.touch(v);
        self.settle(v);
        let Some(d) = self.domain_mut(v) else { return };
        d.used = d.used.saturating_add(cost);
        d.established = true;
        if credits {
            // The temporary AugC credit is spent first; the rest is debited from the balance
            // and handed out again at the next refill.
            let from_aug = d.aug.min(cost);
            d.aug -= from_aug;
            let rest = cost - from_aug;
            d.credit = d
                .credit
                .saturating_sub(as_credit(rest))
                .clamp(-limit, limit);
            self.debited = self.debited.saturating_add(rest);
        }
        if self.ready.contains(v) {
            self.index(cx, v);
        }
    }

    fn timer(&mut self, cx: &mut Cx<'_>) {
        let now = cx.now();
        let Some(next) = self.next_period else { return };
        if now < next {
            return;
        }
        // One pass covers every boundary up to now: the latest boundary <= now ends it.
        let period = self.cfg.period;
        let boundary = next.saturating_add((now - next) / period * period);
        let elapsed = boundary.saturating_sub(self.period_start).max(1);
        self.period_start = boundary;
        self.next_period = Some(boundary.saturating_add(period));
        self.end_period(cx, elapsed);
    }

    fn cpu_hint(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        let hint = cx.vgpu(v).map(|s| *s.cpu()).unwrap_or_default();
        if let Some(d) = self.domain_mut(v)
            && d.cpu_mark.is_none()
            && hint.weight > 0
        {
            d.cpu_mark = Some(hint.usage);
        }
        // Its CPU mark moves at the next boundary.
        self.touch(v);
        self.note_hint(cx, v, true);
        self.refresh_x(cx, v);
        self.index(cx, v);
    }

    fn pick(&mut self, cx: &mut Cx<'_>) -> Option<VgpuId> {
        if let Some(cur) = self.current {
            if self.keeps_slice(cx, cur) {
                return Some(cur.vgpu);
            }
            self.end_slice(cx);
        }
        let ((class, _, _), first) = self.ready.first()?;
        // The bounded wait: an overdue vGPU goes first under CoSched, and ahead of AugC's boost
        // class (without boosts AugC is AccC, whose credits let no one starve).
        let overdue = match self.cfg.mode {
            PegasusMode::Cosched => self.overdue(cx),
            PegasusMode::Augc if class == 0 => self.overdue(cx),
            _ => None,
        };
        let v = match self.cfg.mode {
            PegasusMode::Cosched => overdue.or_else(|| self.co_first(class)).unwrap_or(first),
            PegasusMode::Augc => overdue.unwrap_or(first),
            _ => first,
        };
        let overdue = self.cfg.mode == PegasusMode::Cosched && overdue.is_some();
        let round = self.ready.key(v).map_or(self.round, |(_, round, _)| round);
        self.unready(v);
        self.touch(v);
        self.round = self.round.max(round);
        let len = match self.domain(v) {
            Some(d) if !overdue => self.slice_len(d),
            _ => self.cfg.tick,
        };
        self.current = Some(Slice {
            vgpu: v,
            end: cx.now().saturating_add(len),
            overdue,
        });
        Some(v)
    }

    fn next_deadline(&self) -> Option<Time> {
        // Slices and the bounded wait need no timer: they only matter when the core asks for a
        // pick, and it does so at every completion and submission. `pick` always picks when a
        // vGPU has queued work, so while a group waits one is on the GPU, and its completion
        // asks for the next pick.
        self.next_period
    }

    /// The credit balance in GPU ns (the refills handed out so far included) plus an unspent
    /// AugC boost, and the vGPU's part `X / ΣX` of one credit period. The balance is not a cap:
    /// a vGPU without credit still runs when no one with credit waits. Round robin ignores
    /// credits, so then there is none.
    fn budget(&self, v: VgpuId, _state: &VgpuState, _now: Time) -> Option<Budget> {
        if self.cfg.mode == PegasusMode::Rr {
            return None;
        }
        let d = self.domain(v)?;
        Some(Budget {
            remaining_ns: self.credit_now(d).saturating_add(as_credit(d.aug)),
            capacity_ns: mul_div(self.cfg.period, u64::from(d.x), self.x_sum),
            period_ns: Some(self.cfg.period),
        })
    }

    fn figures(&self, v: VgpuId) -> Vec<(&'static str, f64)> {
        let Some(d) = self.domain(v) else {
            return Vec::new();
        };
        let ticks = self.slice_len(d) as f64 / self.cfg.tick as f64;
        vec![
            ("credits_x", f64::from(d.x)),
            ("credit_ns", self.credit_now(d) as f64),
            ("aug_credit_ns", d.aug as f64),
            ("slice_ticks", ticks),
            ("context_established", f64::from(u8::from(d.established))),
            ("slo_violated", f64::from(u8::from(self.violated_now(d)))),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::Scheduler;
    use crate::model::{
        CommandGroup, ConfigChange, CpuHint, Decision, Event, GroupId, GroupKind, VgpuParams,
    };
    use crate::policy::PolicyConfig;
    use crate::testkit::{complete, dispatch, submit};

    const MS: Nanos = NS_PER_MS;

    fn config(mode: PegasusMode) -> PegasusConfig {
        PegasusConfig {
            mode,
            ..PegasusConfig::default()
        }
    }

    fn weighted(weight: u32) -> VgpuParams {
        VgpuParams {
            weight,
            ..VgpuParams::default()
        }
    }

    /// A scheduler running Pegasus with one vGPU per parameter set.
    fn sched(
        cfg: PegasusConfig,
        capacity: usize,
        params: &[VgpuParams],
    ) -> (Scheduler, Vec<VgpuId>) {
        let mut s = Scheduler::new(PolicyConfig::Pegasus(cfg).build(), capacity);
        let mut out = Vec::new();
        let ids = params
            .iter()
            .map(|p| s.add_vgpu(0, p.clone(), &mut out).unwrap())
            .collect();
        (s, ids)
    }

    fn figure(s: &Scheduler, v: VgpuId, name: &str) -> f64 {
        s.figures(v)
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, x)| x)
            .unwrap()
    }

    fn hint(s: &mut Scheduler, now: Time, v: VgpuId, weight: u32, running: bool, usage: Nanos) {
        let h = CpuHint {
            weight,
            running,
            runnable: running,
            usage,
        };
        s.handle(now, Event::CpuHint(v, h), &mut Vec::new())
            .unwrap();
    }

    /// A tiny GPU: runs every dispatched group for `cost` from its dispatch, keeps each vGPU
    /// `backlog` groups deep, delivers completions and timers in time order.
    struct Gpu {
        s: Scheduler,
        cost: Nanos,
        backlog: usize,
        running: Vec<(Time, VgpuId, GroupId, Time)>,
        next_id: u64,
        dispatched: Vec<VgpuId>,
        /// When each of `dispatched` was dispatched.
        at: Vec<Time>,
    }

    impl Gpu {
        fn new(s: Scheduler, cost: Nanos, backlog: usize) -> Self {
            Gpu {
                s,
                cost,
                backlog,
                running: Vec::new(),
                next_id: 0,
                dispatched: Vec::new(),
                at: Vec::new(),
            }
        }

        fn submit(&mut self, now: Time, v: VgpuId) {
            let g = CommandGroup::new(self.next_id, v, GroupKind::Load, 1);
            self.next_id += 1;
            let mut out = Vec::new();
            self.s.handle(now, Event::Submitted(g), &mut out).unwrap();
            self.apply(now, out);
        }

        fn apply(&mut self, now: Time, out: Vec<Decision>) {
            for d in out {
                if let Decision::Dispatch { vgpu, group, .. } = d {
                    self.running.push((now + self.cost, vgpu, group, now));
                    self.dispatched.push(vgpu);
                    self.at.push(now);
                    if self.backlog > 0 {
                        self.submit(now, vgpu);
                    }
                }
            }
        }

        fn start(&mut self, ids: &[VgpuId]) {
            for _ in 0..self.backlog {
                for &v in ids {
                    self.submit(0, v);
                }
            }
        }

        fn run_until(&mut self, end: Time) {
            loop {
                let first = (0..self.running.len()).min_by_key(|&i| self.running[i].0);
                let finish = first.map(|i| self.running[i].0);
                let deadline = self.s.next_deadline();
                let now = match (finish, deadline) {
                    (Some(f), Some(d)) => f.min(d),
                    (f, d) => f.or(d).unwrap(),
                };
                if now > end {
                    return;
                }
                let mut out = Vec::new();
                match first {
                    Some(i) if finish == Some(now) => {
                        let (_, vgpu, group, start) = self.running.swap_remove(i);
                        let ev = Event::Completed {
                            vgpu,
                            group,
                            start,
                            finish: now,
                        };
                        self.s.handle(now, ev, &mut out).unwrap();
                    }
                    _ => self.s.handle(now, Event::Timer, &mut out).unwrap(),
                }
                self.apply(now, out);
            }
        }

        fn gpu_time(&self, v: VgpuId) -> Nanos {
            self.s.vgpu(v).unwrap().account().gpu_time
        }

        /// Lengths of the runs of consecutive dispatches to the same vGPU.
        fn runs(&self) -> Vec<(VgpuId, usize)> {
            let mut runs: Vec<(VgpuId, usize)> = Vec::new();
            for &v in &self.dispatched {
                match runs.last_mut() {
                    Some((w, n)) if *w == v => *n += 1,
                    _ => runs.push((v, 1)),
                }
            }
            runs
        }
    }

    #[test]
    fn slices_are_one_tick_without_context_then_x_over_xmin() {
        let params = [weighted(1024), weighted(512), weighted(256)];
        let (s, v) = sched(config(PegasusMode::Accc), 1, &params);
        let mut gpu = Gpu::new(s, MS, 2);
        gpu.start(&v);
        gpu.run_until(130 * MS);
        // 1 ms groups, 10 ms ticks: first one tick each (NoContextEstablished), then 4, 2, 1.
        let runs: Vec<_> = gpu.runs().into_iter().take(6).collect();
        let expect = [
            (v[0], 10),
            (v[1], 10),
            (v[2], 10),
            (v[0], 40),
            (v[1], 20),
            (v[2], 10),
        ];
        assert_eq!(runs, expect);
        assert_eq!(figure(&gpu.s, v[0], "slice_ticks"), 4.0);
        assert_eq!(figure(&gpu.s, v[1], "slice_ticks"), 2.0);
        assert_eq!(figure(&gpu.s, v[2], "slice_ticks"), 1.0);
    }

    /// The vGPUs' GPU time as shares of their total.
    fn shares(gpu: &Gpu, v: &[VgpuId]) -> Vec<f64> {
        let times: Vec<f64> = v.iter().map(|&v| gpu.gpu_time(v) as f64).collect();
        let total: f64 = times.iter().sum();
        times.iter().map(|t| t / total).collect()
    }

    fn assert_proportional(shares: &[f64], weights: &[f64], tolerance: f64) {
        let total: f64 = weights.iter().sum();
        for (share, w) in shares.iter().zip(weights) {
            let want = w / total;
            assert!(
                (share - want).abs() <= tolerance * want,
                "shares {shares:?} not within {tolerance} of {weights:?}"
            );
        }
    }

    #[test]
    fn backlogged_vgpus_get_gpu_time_in_proportion_to_credits() {
        let weights = [256, 512, 1024, 256];
        let ratio = [1.0, 2.0, 4.0, 1.0];
        // Group costs that do not divide the tick (overruns), and two groups on the GPU at once.
        for (cost, capacity) in [(3 * MS, 1), (7 * MS, 1), (MS, 1), (3 * MS, 2)] {
            // AccC: credits from the weights.
            let params: Vec<_> = weights.iter().map(|&w| weighted(w)).collect();
            let (s, v) = sched(config(PegasusMode::Accc), capacity, &params);
            let mut gpu = Gpu::new(s, cost, 2);
            gpu.start(&v);
            gpu.run_until(60 * NS_PER_SEC);
            assert_proportional(&shares(&gpu, &v), &ratio, 0.02);
            // XC: equal weights, credits from the CPU hints.
            let params = vec![VgpuParams::default(); 4];
            let (mut s, v) = sched(config(PegasusMode::Xc), capacity, &params);
            for (&v, &w) in v.iter().zip(&weights) {
                hint(&mut s, 0, v, w, true, 0);
            }
            let mut gpu = Gpu::new(s, cost, 2);
            gpu.start(&v);
            gpu.run_until(60 * NS_PER_SEC);
            assert_proportional(&shares(&gpu, &v), &ratio, 0.02);
        }
    }

    fn timer(s: &mut Scheduler, now: Time) {
        assert_eq!(s.next_deadline(), Some(now));
        s.handle(now, Event::Timer, &mut Vec::new()).unwrap();
    }

    #[test]
    fn credits_are_debited_by_gpu_time_and_refilled_each_period() {
        let (mut s, v) = sched(
            config(PegasusMode::Accc),
            1,
            &[weighted(256), weighted(768)],
        );
        assert_eq!(submit(&mut s, 0, v[0], 1), vec![dispatch(v[0], 1, false)]);
        assert!(submit(&mut s, 1, v[1], 2).is_empty());
        assert_eq!(
            complete(&mut s, 8 * MS, v[0], 1, 0),
            vec![dispatch(v[1], 2, false)]
        );
        assert_eq!(figure(&s, v[0], "credit_ns"), -8e6);
        complete(&mut s, 20 * MS, v[1], 2, 8 * MS);
        assert_eq!(figure(&s, v[1], "credit_ns"), -12e6);
        // The 20 ms debited in the period go back in proportion 1:3.
        timer(&mut s, 30 * MS);
        assert_eq!(figure(&s, v[0], "credit_ns"), -3e6);
        assert_eq!(figure(&s, v[1], "credit_ns"), 3e6);
        assert_eq!(figure(&s, v[0], "context_established"), 1.0);
        // A quiet period: no refill, and the contexts count as gone.
        timer(&mut s, 60 * MS);
        assert_eq!(figure(&s, v[1], "credit_ns"), 3e6);
        assert_eq!(figure(&s, v[0], "context_established"), 0.0);
        // A group spanning three periods is debited at once; the refill would give v1 three
        // quarters of it, but v1 is idle and keeps only its share of one period (22.5 ms).
        assert_eq!(
            submit(&mut s, 61 * MS, v[0], 3),
            vec![dispatch(v[0], 3, false)]
        );
        timer(&mut s, 90 * MS);
        timer(&mut s, 120 * MS);
        assert!(submit(&mut s, 125 * MS, v[1], 4).is_empty());
        timer(&mut s, 150 * MS);
        complete(&mut s, 151 * MS, v[0], 3, 61 * MS);
        complete(&mut s, 152 * MS, v[1], 4, 151 * MS);
        timer(&mut s, 180 * MS);
        assert_eq!(figure(&s, v[0], "credit_ns"), (-3.0 - 90.0 + 22.75) * 1e6);
        assert_eq!(figure(&s, v[1], "credit_ns"), 22.5e6);
    }

    #[test]
    fn the_budget_query_is_the_credit_balance_against_a_share_of_the_period() {
        let (mut s, v) = sched(
            config(PegasusMode::Accc),
            1,
            &[weighted(256), weighted(768)],
        );
        let budget = |s: &Scheduler, vg: VgpuId, left: i64| {
            let capacity_ns = if vg == v[0] { 7_500_000 } else { 22_500_000 };
            let want = Budget {
                remaining_ns: left,
                capacity_ns,
                period_ns: Some(30 * MS),
            };
            assert_eq!(s.budget(vg, s.now()), Some(want));
        };
        budget(&s, v[0], 0);
        submit(&mut s, 0, v[0], 1);
        submit(&mut s, 1, v[1], 2);
        complete(&mut s, 8 * MS, v[0], 1, 0);
        budget(&s, v[0], -8_000_000);
        complete(&mut s, 20 * MS, v[1], 2, 8 * MS);
        budget(&s, v[1], -12_000_000);
        // The period's refill hands the 20 ms back 1:3.
        timer(&mut s, 30 * MS);
        budget(&s, v[0], -3_000_000);
        budget(&s, v[1], 3_000_000);
        // Round robin has no credits to show.
        let (rr, w) = sched(config(PegasusMode::Rr), 1, &[weighted(256)]);
        assert_eq!(rr.budget(w[0], 0), None);
    }

    #[test]
    fn untouched_waiting_vgpus_take_their_refill_lazily() {
        // One long tick: v2 holds the GPU across boundaries while v0 waits untouched.
        let cfg = PegasusConfig {
            tick: 100 * MS,
            ..config(PegasusMode::Accc)
        };
        let (mut s, v) = sched(cfg, 1, &[weighted(256), weighted(768)]);
        let (v0, v2) = (v[0], v[1]);
        assert_eq!(submit(&mut s, 0, v0, 1), vec![dispatch(v0, 1, false)]);
        assert!(complete(&mut s, 10 * MS, v0, 1, 0).is_empty());
        assert_eq!(submit(&mut s, 10 * MS, v2, 2), vec![dispatch(v2, 2, false)]);
        assert!(submit(&mut s, 11 * MS, v0, 3).is_empty());
        submit(&mut s, 11 * MS, v2, 4);
        assert_eq!(
            complete(&mut s, 20 * MS, v2, 2, 10 * MS),
            vec![dispatch(v2, 4, false)]
        );
        submit(&mut s, 20 * MS, v2, 5);
        // 20 ms debited, handed back 1:3.
        timer(&mut s, 30 * MS);
        assert_eq!(figure(&s, v0, "credit_ns"), -5e6);
        assert_eq!(figure(&s, v2, "credit_ns"), 5e6);
        assert_eq!(
            complete(&mut s, 40 * MS, v2, 4, 20 * MS),
            vec![dispatch(v2, 5, false)]
        );
        submit(&mut s, 40 * MS, v2, 6);
        assert_eq!(
            complete(&mut s, 55 * MS, v2, 5, 40 * MS),
            vec![dispatch(v2, 6, false)]
        );
        // v0 saw no event in this period, yet takes a quarter of the 35 ms and turns UNDER.
        timer(&mut s, 60 * MS);
        assert_eq!(figure(&s, v0, "credit_ns"), 3.75e6);
        assert_eq!(figure(&s, v2, "credit_ns"), -3.75e6);
        timer(&mut s, 90 * MS);
        assert_eq!(figure(&s, v0, "credit_ns"), 3.75e6);
        // The slice ends: the UNDER v0 goes before the OVER holder.
        submit(&mut s, 100 * MS, v2, 7);
        assert_eq!(
            complete(&mut s, 110 * MS, v2, 6, 55 * MS),
            vec![dispatch(v0, 3, false)]
        );
        assert_eq!(figure(&s, v2, "credit_ns"), -58.75e6);
    }

    #[test]
    fn rr_takes_turns_one_tick_each_regardless_of_weight() {
        let params = [weighted(1024), weighted(256), weighted(256)];
        let (s, v) = sched(config(PegasusMode::Rr), 1, &params);
        let mut gpu = Gpu::new(s, 10 * MS, 0);
        for (n, &v) in [3, 2, 1].iter().zip(&v) {
            for _ in 0..*n {
                gpu.submit(0, v);
            }
        }
        gpu.run_until(NS_PER_SEC);
        assert_eq!(gpu.dispatched, vec![v[0], v[1], v[2], v[0], v[1], v[0]]);
    }

    #[test]
    fn xc_takes_credits_from_the_cpu_hint_and_falls_back_to_the_weight() {
        let (mut s, v) = sched(config(PegasusMode::Xc), 1, &[weighted(512), weighted(256)]);
        assert_eq!(figure(&s, v[0], "credits_x"), 512.0);
        hint(&mut s, 0, v[0], 100, false, 0);
        hint(&mut s, 0, v[1], 400, false, 0);
        assert_eq!(figure(&s, v[0], "credits_x"), 100.0);
        assert_eq!(figure(&s, v[1], "credits_x"), 400.0);
        let mut gpu = Gpu::new(s, MS, 2);
        gpu.start(&v);
        gpu.run_until(200 * MS);
        // One tick each without a context, then Tm = 400 / 100 = 4 ticks for v1 against one
        // for v0. v1 heads the next round (the queue is sorted by X within a round), so its
        // first long slice follows its first short one at once.
        let runs: Vec<_> = gpu.runs().into_iter().take(6).collect();
        let expect = [
            (v[0], 10),
            (v[1], 10 + 40),
            (v[0], 10),
            (v[1], 40),
            (v[0], 10),
            (v[1], 40),
        ];
        assert_eq!(runs, expect);
        // AccC ignores the hint.
        let (mut s, v) = sched(config(PegasusMode::Accc), 1, &[weighted(512)]);
        hint(&mut s, 0, v[0], 100, false, 0);
        assert_eq!(figure(&s, v[0], "credits_x"), 512.0);
    }

    /// GPU time of a vGPU with an SLO of 0.8 s/s against an equal one without, over 3 s.
    fn slo_share(mode: PegasusMode) -> (f64, Gpu, Vec<VgpuId>) {
        let slo = VgpuParams {
            slo: Some(800 * MS),
            ..VgpuParams::default()
        };
        let (s, v) = sched(config(mode), 1, &[slo, VgpuParams::default()]);
        let mut gpu = Gpu::new(s, MS, 2);
        gpu.start(&v);
        gpu.run_until(3 * NS_PER_SEC);
        (shares(&gpu, &v)[0], gpu, v)
    }

    #[test]
    fn slaf_compensates_slo_violations_with_ticks_and_credit() {
        let (fair, gpu, v) = slo_share(PegasusMode::Accc);
        assert!((fair - 0.5).abs() < 0.01, "{fair}");
        assert_eq!(figure(&gpu.s, v[0], "slo_violated"), 0.0);
        let (share, gpu, v) = slo_share(PegasusMode::Slaf);
        // Each period it gets its shortfall (at most one tick) as compensation credit first and
        // half the rest. At a share s the shortfall is 0.8 - s, so s = (0.8 - s) + (0.2 + s) / 2:
        // s = 0.6, against 0.5 without SLAF.
        assert!((share - 0.6).abs() < 0.01, "{share}");
        assert_eq!(figure(&gpu.s, v[0], "slo_violated"), 1.0);
        assert_eq!(figure(&gpu.s, v[0], "slice_ticks"), 2.0);
        assert_eq!(figure(&gpu.s, v[1], "slice_ticks"), 1.0);
    }

    #[test]
    fn slaf_compensates_untouched_waiting_vgpus_lazily() {
        // v0 (SLO 500 ms/s: 15 ms a period) waits untouched while v1 holds a long slice.
        let cfg = PegasusConfig {
            tick: 100 * MS,
            ..config(PegasusMode::Slaf)
        };
        let slo = VgpuParams {
            slo: Some(500 * MS),
            ..weighted(256)
        };
        let (mut s, v) = sched(cfg, 1, &[slo, weighted(768)]);
        let (v0, v1) = (v[0], v[1]);
        assert_eq!(submit(&mut s, 0, v0, 1), vec![dispatch(v0, 1, false)]);
        assert!(complete(&mut s, 10 * MS, v0, 1, 0).is_empty());
        assert_eq!(submit(&mut s, 10 * MS, v1, 2), vec![dispatch(v1, 2, false)]);
        assert!(submit(&mut s, 11 * MS, v0, 3).is_empty());
        submit(&mut s, 11 * MS, v1, 4);
        assert_eq!(
            complete(&mut s, 20 * MS, v1, 2, 10 * MS),
            vec![dispatch(v1, 4, false)]
        );
        submit(&mut s, 20 * MS, v1, 5);
        // 20 ms debited: v0 missed its SLO by 5 ms and gets them first, the rest goes 1:3.
        timer(&mut s, 30 * MS);
        assert_eq!(figure(&s, v0, "credit_ns"), -1.25e6);
        assert_eq!(figure(&s, v1, "credit_ns"), 1.25e6);
        assert_eq!(
            complete(&mut s, 40 * MS, v1, 4, 20 * MS),
            vec![dispatch(v1, 5, false)]
        );
        submit(&mut s, 40 * MS, v1, 6);
        assert_eq!(
            complete(&mut s, 55 * MS, v1, 5, 40 * MS),
            vec![dispatch(v1, 6, false)]
        );
        // v0 saw no event and had no GPU time: it misses its whole 15 ms, takes them out of the
        // 35 ms and a quarter of the other 20 ms, and turns UNDER with a compensation tick.
        timer(&mut s, 60 * MS);
        assert_eq!(figure(&s, v0, "credit_ns"), 18.75e6);
        assert_eq!(figure(&s, v0, "slo_violated"), 1.0);
        assert_eq!(figure(&s, v0, "slice_ticks"), 2.0);
        assert_eq!(figure(&s, v1, "credit_ns"), -18.75e6);
        // Nothing was debited: no compensation to hand out.
        timer(&mut s, 90 * MS);
        assert_eq!(figure(&s, v0, "credit_ns"), 18.75e6);
        // The slice ends: the UNDER v0 goes before the OVER holder.
        submit(&mut s, 100 * MS, v1, 7);
        assert_eq!(
            complete(&mut s, 110 * MS, v1, 6, 55 * MS),
            vec![dispatch(v0, 3, false)]
        );
        assert_eq!(figure(&s, v1, "credit_ns"), -73.75e6);
    }

    #[test]
    fn augc_boosts_running_vgpus_by_their_remaining_cpu_credit() {
        let run = |mode| {
            let (mut s, v) = sched(config(mode), 1, &vec![VgpuParams::default(); 3]);
            // v2 holds the GPU across the period boundary; v0 and v1 wait.
            assert_eq!(submit(&mut s, 0, v[2], 1), vec![dispatch(v[2], 1, false)]);
            submit(&mut s, 1, v[0], 2);
            submit(&mut s, 1, v[1], 3);
            hint(&mut s, 1, v[0], 100, false, 0);
            hint(&mut s, 1, v[1], 100, true, 0);
            // v0 used 20 ms of CPU, v1 1 ms: each was owed 10.5 ms, v1 has 9.5 ms left and
            // its vCPUs run at the boundary.
            hint(&mut s, 25 * MS, v[0], 100, false, 20 * MS);
            hint(&mut s, 25 * MS, v[1], 100, true, MS);
            timer(&mut s, 30 * MS);
            let first = complete(&mut s, 40 * MS, v[2], 1, 0);
            (s, v, first)
        };
        let (_, v, first) = run(PegasusMode::Accc);
        assert_eq!(first, vec![dispatch(v[0], 2, false)]);
        let (mut s, v, first) = run(PegasusMode::Augc);
        assert_eq!(first, vec![dispatch(v[1], 3, false)]);
        assert_eq!(figure(&s, v[0], "aug_credit_ns"), 0.0);
        // The boost is spent before the balance and lasts one period.
        complete(&mut s, 45 * MS, v[1], 3, 40 * MS);
        assert_eq!(figure(&s, v[1], "aug_credit_ns"), 4.5e6);
        assert_eq!(figure(&s, v[1], "credit_ns"), 0.0);
        hint(&mut s, 50 * MS, v[1], 100, false, MS);
        timer(&mut s, 60 * MS);
        assert_eq!(figure(&s, v[1], "aug_credit_ns"), 0.0);
    }

    #[test]
    fn cosched_runs_only_vgpus_on_a_cpu_and_falls_back_to_the_highest_credit() {
        let (mut s, v) = sched(
            config(PegasusMode::Cosched),
            1,
            &vec![VgpuParams::default(); 3],
        );
        assert_eq!(submit(&mut s, 0, v[2], 1), vec![dispatch(v[2], 1, false)]);
        submit(&mut s, 1, v[0], 2);
        submit(&mut s, 1, v[1], 3);
        hint(&mut s, 1, v[0], 100, false, 0);
        hint(&mut s, 1, v[1], 100, true, 0);
        // v0 is first by id and arrival, but only v1's vCPUs are on a CPU.
        assert_eq!(
            complete(&mut s, 5 * MS, v[2], 1, 0),
            vec![dispatch(v[1], 3, false)]
        );
        // None of the ready vGPUs is on a CPU: the GPU stays busy with the highest credit.
        hint(&mut s, 6 * MS, v[1], 100, false, 0);
        submit(&mut s, 6 * MS, v[2], 4);
        assert_eq!(figure(&s, v[2], "credit_ns"), -5e6);
        assert_eq!(
            complete(&mut s, 7 * MS, v[1], 3, 5 * MS),
            vec![dispatch(v[0], 2, false)]
        );
        // A vGPU holding the slice off-CPU yields as soon as a waiting one gets on a CPU.
        submit(&mut s, 8 * MS, v[0], 5);
        hint(&mut s, 8 * MS, v[2], 100, true, 0);
        assert_eq!(
            complete(&mut s, 9 * MS, v[0], 2, 7 * MS),
            vec![dispatch(v[2], 4, false)]
        );
    }

    #[test]
    fn cosched_orders_untouched_waiting_vgpus_by_their_refilled_balance() {
        // One long tick: v2 holds the GPU while v0 and v1 wait untouched; v1's larger X makes
        // its balance overtake v0's through the refills alone.
        let cfg = PegasusConfig {
            tick: 100 * MS,
            ..config(PegasusMode::Cosched)
        };
        let params = [weighted(256), weighted(768), weighted(256)];
        let (mut s, v) = sched(cfg, 1, &params);
        assert_eq!(submit(&mut s, 0, v[0], 1), vec![dispatch(v[0], 1, false)]);
        assert!(complete(&mut s, 2 * MS, v[0], 1, 0).is_empty());
        assert_eq!(
            submit(&mut s, 2 * MS, v[1], 2),
            vec![dispatch(v[1], 2, false)]
        );
        assert!(complete(&mut s, 16 * MS, v[1], 2, 2 * MS).is_empty());
        assert_eq!(
            submit(&mut s, 16 * MS, v[2], 3),
            vec![dispatch(v[2], 3, false)]
        );
        for (w, id) in [(v[0], 4), (v[1], 5), (v[2], 6)] {
            assert!(submit(&mut s, 17 * MS, w, id).is_empty());
        }
        assert_eq!(
            complete(&mut s, 28 * MS, v[2], 3, 16 * MS),
            vec![dispatch(v[2], 6, false)]
        );
        submit(&mut s, 28 * MS, v[2], 7);
        // 28 ms handed back 1:3:1: v0 is ahead of v1.
        timer(&mut s, 30 * MS);
        assert_eq!(figure(&s, v[0], "credit_ns"), 3.6e6);
        assert_eq!(figure(&s, v[1], "credit_ns"), 2.8e6);
        assert_eq!(
            complete(&mut s, 48 * MS, v[2], 6, 28 * MS),
            vec![dispatch(v[2], 7, false)]
        );
        // 20 ms handed back 1:3:1: v1 overtakes v0 without an event of its own.
        timer(&mut s, 60 * MS);
        assert_eq!(figure(&s, v[0], "credit_ns"), 7.6e6);
        assert_eq!(figure(&s, v[1], "credit_ns"), 14.8e6);
        let left = s.budget(v[1], 60 * MS).map(|b| b.remaining_ns);
        assert_eq!(left, Some(14_800_000));
        assert_eq!(
            complete(&mut s, 70 * MS, v[2], 7, 48 * MS),
            vec![dispatch(v[1], 5, false)]
        );
    }

    /// When `v` was dispatched, in order.
    fn dispatch_times(gpu: &Gpu, v: VgpuId) -> Vec<Time> {
        gpu.dispatched
            .iter()
            .zip(&gpu.at)
            .filter(|&(&w, _)| w == v)
            .map(|(_, &t)| t)
            .collect()
    }

    #[test]
    fn cosched_bounds_the_wait_of_a_vgpu_whose_vcpus_halt() {
        assert_eq!(PegasusConfig::default().max_wait, DEFAULT_MAX_WAIT);
        let parsed: PegasusConfig = toml::from_str("max_wait = 50_000_000").unwrap();
        assert_eq!(parsed.max_wait, 50 * MS);
        for limit in [DEFAULT_MAX_WAIT, 50 * MS] {
            let cfg = PegasusConfig {
                max_wait: limit,
                ..config(PegasusMode::Cosched)
            };
            let (mut s, v) = sched(cfg, 1, &vec![VgpuParams::default(); 2]);
            let (busy, halted) = (v[0], v[1]);
            hint(&mut s, 0, halted, 100, false, 0);
            // An idle GPU with only a waiter whose vCPUs halt still runs its work.
            assert_eq!(
                submit(&mut s, 0, halted, 1_000),
                vec![dispatch(halted, 1_000, false)]
            );
            assert!(complete(&mut s, MS, halted, 1_000, 0).is_empty());
            hint(&mut s, MS, busy, 100, true, 0);
            // 2 ms groups, one queued behind each dispatch: the busy VM always has work, and
            // each of the halted VM's groups is submitted when the one before is dispatched.
            let mut gpu = Gpu::new(s, 2 * MS, 1);
            gpu.submit(MS, busy);
            gpu.submit(MS, halted);
            gpu.run_until(NS_PER_SEC + MS);
            let times = dispatch_times(&gpu, halted);
            let waits: Vec<Nanos> = std::iter::once(MS)
                .chain(times.iter().copied())
                .zip(&times)
                .map(|(submitted, &dispatched)| dispatched - submitted)
                .collect();
            // The first group waits out the limit and goes at the next completion; the VM
            // then holds the GPU for one tick (its groups submitted meanwhile wait one group),
            // and its next group waits out the limit again.
            assert!(
                waits.iter().all(|&w| w <= limit + 2 * MS),
                "limit {limit}: waits {waits:?}"
            );
            assert!(waits[0] >= limit, "limit {limit}: waits {waits:?}");
            let per_tick = (PegasusConfig::default().tick / (2 * MS)) as usize;
            for burst in waits.split(|&w| w >= limit).skip(1) {
                assert!(burst.len() < per_tick, "limit {limit}: waits {waits:?}");
            }
            let windows = NS_PER_SEC / (limit + 2 * MS);
            assert!(
                times.len() as u64 >= windows,
                "limit {limit}: {} groups",
                times.len()
            );
            // The halted VM gets at most about a tick per limit: the busy VM keeps the rest.
            let (b, h) = (gpu.gpu_time(busy), gpu.gpu_time(halted));
            let tick = PegasusConfig::default().tick;
            assert!(
                u128::from(h) * u128::from(limit) <= u128::from(tick + 2 * MS) * u128::from(b + h),
                "limit {limit}: busy {b} ns, halted {h} ns"
            );
        }
    }

    #[test]
    fn augc_bounds_the_wait_behind_a_vgpu_boosted_every_period() {
        // v0's vCPUs are on a CPU at every boundary and use no CPU time while v2 uses three
        // cores: v0's remaining CPU credit covers every whole period, so its boost outlasts the
        // GPU time it can use, and v1 (halted, equal credits) never got a turn without the
        // bounded wait.
        let cfg = PegasusConfig {
            max_wait: 100 * MS,
            ..config(PegasusMode::Augc)
        };
        let (mut s, v) = sched(cfg.clone(), 1, &vec![VgpuParams::default(); 3]);
        hint(&mut s, 0, v[0], 100, true, 0);
        hint(&mut s, 0, v[1], 100, false, 0);
        hint(&mut s, 0, v[2], 100, false, 0);
        // 7 ms groups: the boost never runs out at a boundary.
        let cost = 7 * MS;
        let mut gpu = Gpu::new(s, cost, 1);
        gpu.submit(0, v[0]);
        gpu.submit(0, v[1]);
        let period = cfg.period;
        let mut end = 0;
        for n in 1..=20 {
            end = n * period;
            gpu.run_until(end - 1);
            hint(&mut gpu.s, end - 1, v[2], 100, false, 3 * end);
        }
        gpu.run_until(end);
        assert!(figure(&gpu.s, v[0], "aug_credit_ns") > 0.0);
        let times = dispatch_times(&gpu, v[1]);
        // Later groups wait out the limit, plus the rest of a boosted slice (equal credits: one
        // tick) and the group on the GPU at most; without the bound v1 went once in 7 periods,
        // when five completions fell into one period and used up the boost.
        let slice = cfg.tick;
        for pair in times.windows(2) {
            let wait = pair[1] - pair[0];
            assert!(
                wait <= cfg.max_wait + slice + cost,
                "waited {wait} ns: {times:?}"
            );
        }
        assert!(times.len() >= 4, "{times:?}");
    }

    #[test]
    fn accelerator_selection_prefers_capability_per_credit() {
        let acc = |capability, credits, domains| AcceleratorLoad {
            capability,
            credits,
            domains,
            max_domains: None,
        };
        assert_eq!(select_accelerator(&[], 256), None);
        // Equal GPUs: the less loaded one.
        assert_eq!(
            select_accelerator(&[acc(100, 512, 2), acc(100, 256, 1)], 256),
            Some(1)
        );
        // Twice the capability outweighs twice the load: 200 / 768 > 100 / 512.
        assert_eq!(
            select_accelerator(&[acc(100, 256, 1), acc(200, 512, 2)], 256),
            Some(1)
        );
        // Equal weight: fewer domains, then the lower index.
        assert_eq!(
            select_accelerator(&[acc(100, 256, 2), acc(100, 256, 1)], 256),
            Some(1)
        );
        assert_eq!(
            select_accelerator(&[acc(100, 256, 1), acc(100, 256, 1)], 256),
            Some(0)
        );
        // Full or unusable accelerators are skipped.
        let full = AcceleratorLoad {
            max_domains: Some(1),
            ..acc(1000, 0, 1)
        };
        assert_eq!(
            select_accelerator(&[full, acc(0, 0, 0), acc(1, 1 << 40, 9)], 0),
            Some(2)
        );
        assert_eq!(select_accelerator(&[full, acc(0, 0, 0)], 256), None);
        // Extreme values neither overflow nor panic.
        let big = acc(u64::MAX, u64::MAX, u32::MAX);
        assert_eq!(select_accelerator(&[big, acc(1, 0, 0)], u32::MAX), Some(0));
    }

    #[test]
    fn extreme_parameters_are_clamped_and_do_not_panic() {
        let cfg = PegasusConfig {
            mode: PegasusMode::Slaf,
            period: 0,
            tick: u64::MAX,
            max_slice_ticks: u32::MAX,
            slaf_compensation: u32::MAX,
            max_wait: 0,
        };
        assert_eq!(Pegasus::new(&cfg).cfg.max_wait, MIN_MAX_WAIT);
        let long = PegasusConfig {
            max_wait: u64::MAX,
            ..cfg.clone()
        };
        assert_eq!(Pegasus::new(&long).cfg.max_wait, MAX_MAX_WAIT);
        let p = VgpuParams {
            weight: u32::MAX,
            slo: Some(u64::MAX),
            ..VgpuParams::default()
        };
        let (mut s, v) = sched(cfg, 1, &[p, weighted(1)]);
        assert_eq!(s.next_deadline(), Some(MIN_PERIOD));
        assert_eq!(submit(&mut s, 0, v[0], 1), vec![dispatch(v[0], 1, false)]);
        complete(&mut s, u64::MAX / 2, v[0], 1, 0);
        s.handle(u64::MAX / 2, Event::Timer, &mut Vec::new())
            .unwrap();
        assert!(figure(&s, v[0], "credit_ns") >= -(MAX_CREDIT_PERIODS as f64) * 1e6);
        assert!(
            figure(&s, v[0], "slice_ticks") <= f64::from(MAX_SLICE_TICKS + MAX_COMPENSATION_TICKS)
        );
    }

    #[test]
    fn credit_modes_hint_a_cpu_weight_proportional_to_credits() {
        assert_eq!(cpu_weight_for(DEFAULT_WEIGHT), CPU_WEIGHT_DEFAULT);
        assert_eq!(cpu_weight_for(512), 200);
        assert_eq!(cpu_weight_for(300), 117, "300 * 100 / 256 truncated");
        assert_eq!(cpu_weight_for(1), CPU_WEIGHT_MIN);
        assert_eq!(cpu_weight_for(u32::MAX), CPU_WEIGHT_MAX);
        let hints = |out: &[Decision]| -> Vec<(VgpuId, u32)> {
            out.iter()
                .filter_map(|d| match *d {
                    Decision::CpuWeight { vgpu, weight } => Some((vgpu, weight)),
                    _ => None,
                })
                .collect()
        };
        for mode in [
            PegasusMode::Rr,
            PegasusMode::Accc,
            PegasusMode::Xc,
            PegasusMode::Slaf,
            PegasusMode::Augc,
            PegasusMode::Cosched,
        ] {
            let mut s = Scheduler::new(PolicyConfig::Pegasus(config(mode)).build(), 1);
            let mut out = Vec::new();
            let a = s.add_vgpu(0, weighted(512), &mut out).unwrap();
            let silent = matches!(mode, PegasusMode::Rr | PegasusMode::Xc);
            let want = if silent { vec![] } else { vec![(a, 200)] };
            assert_eq!(hints(&out), want, "{mode:?}: on attach");
            // A new weight is hinted again; an unchanged one is not.
            for (weight, want) in [(1024, vec![(a, 400)]), (1024, vec![])] {
                let mut out = Vec::new();
                let ev = Event::Config(ConfigChange::Params(a, weighted(weight)));
                s.handle(1, ev, &mut out).unwrap();
                let want = if silent { vec![] } else { want };
                assert_eq!(hints(&out), want, "{mode:?}: weight {weight}");
            }
        }
    }
}
