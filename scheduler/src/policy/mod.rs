//! The policy trait and the policy families, one module each.
//!
//! A policy holds only its decision state (budgets, credits, virtual times, predictors). The
//! scheduler core owns the vGPU table, the per-vGPU queues, the GPU-online list and the
//! accounting, so a policy can be replaced at run time without losing queued work or history.

pub mod fair;
pub mod fcfs;
pub mod pegasus;
pub mod ready;
pub mod timegraph;
pub mod vgris;

use serde::{Deserialize, Serialize};

use crate::core::{Cx, VgpuState};
use crate::model::{Budget, GroupKind, Nanos, Time, VgpuId, VgpuParams};

/// A completed group as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The owner.
    pub vgpu: VgpuId,
    /// What the group did.
    pub kind: GroupKind,
    /// Its cost signature.
    pub signature: crate::model::CostSignature,
    /// Its context.
    pub context: u32,
    /// When it was submitted (equal to `dispatched` for leased groups).
    pub submitted: Time,
    /// When the scheduler dispatched it.
    pub dispatched: Time,
    /// When the GPU started it.
    pub start: Time,
    /// When it finished.
    pub finish: Time,
    /// True when the GPU switched contexts to run it (the previous group on the GPU belonged to
    /// another vGPU or context).
    pub context_switch: bool,
}

impl Completion {
    /// The GPU time the group used.
    pub fn cost(&self) -> Nanos {
        self.finish.saturating_sub(self.start)
    }
}

/// A scheduling policy. Every callback gets a [`Cx`]: the read-only view of the core's state
/// plus the actions a policy may take (suspend, resume, lease, revoke, CPU weight hints).
///
/// Call order for one group: `submitted` (engaged only), `dispatched`, `completed`. After every
/// event the core calls `pick` while the GPU-online list has room; a policy that returns a vGPU
/// whose queue is empty or that is suspended ends that round.
pub trait Policy: std::fmt::Debug + Send {
    /// The policy's name as the control interface shows it.
    fn name(&self) -> &'static str;
    /// A vGPU joins, or the policy was just installed and the vGPU already existed (then its
    /// queue may be non-empty and its accounting is the core's history).
    fn attach(&mut self, cx: &mut Cx<'_>, vgpu: VgpuId);
    /// A vGPU leaves. Its queue is already empty, nothing of it is online and its lease is
    /// revoked.
    fn detach(&mut self, cx: &mut Cx<'_>, vgpu: VgpuId);
    /// The vGPU's parameters changed (they are already in the core).
    fn params_changed(&mut self, cx: &mut Cx<'_>, vgpu: VgpuId) {
        self.detach(cx, vgpu);
        self.attach(cx, vgpu);
    }
    /// A group was appended to the vGPU's queue.
    fn submitted(&mut self, _cx: &mut Cx<'_>, _vgpu: VgpuId) {}
    /// A group of the vGPU went onto the GPU-online list, from its queue or under a lease.
    fn dispatched(&mut self, _cx: &mut Cx<'_>, _vgpu: VgpuId, _leased: bool) {}
    /// A group finished. The core's accounting already includes it. A group cancelled while
    /// on the GPU-online list arrives here too, as a completion that ran from its dispatch until
    /// its cancellation (see [`crate::model::Event::Cancelled`]).
    fn completed(&mut self, _cx: &mut Cx<'_>, _done: &Completion) {}
    /// A queued group of the vGPU left its queue without being dispatched (its submitter
    /// cancelled it): the queue's head changed or the queue is empty. The policy must file the
    /// vGPU again so that it keeps nothing for the group (a vGPU with an empty queue must not
    /// be picked). No default: every policy says how it re-files a vGPU.
    fn withdrawn(&mut self, cx: &mut Cx<'_>, vgpu: VgpuId);
    /// The deadline the policy asked for was reached.
    fn timer(&mut self, _cx: &mut Cx<'_>) {}
    /// The vGPU's CPU hint changed (it is already in the core).
    fn cpu_hint(&mut self, _cx: &mut Cx<'_>, _vgpu: VgpuId) {}
    /// The vGPU reached a frame boundary: return when its present may go (default: now).
    fn frame(&mut self, cx: &mut Cx<'_>, _vgpu: VgpuId) -> Time {
        cx.now()
    }
    /// The user focused this vGPU.
    fn focus(&mut self, _cx: &mut Cx<'_>, _vgpu: VgpuId) {}
    /// Choose the vGPU whose oldest queued group goes next, or `None` to leave the slot idle.
    fn pick(&mut self, cx: &mut Cx<'_>) -> Option<VgpuId>;
    /// The earliest time the policy needs a [`crate::model::Event::Timer`].
    fn next_deadline(&self) -> Option<Time> {
        None
    }
    /// Policy-specific live figures for one vGPU (budget left, credits, virtual time ...), for
    /// the control interface and the simulator's reports.
    fn figures(&self, _vgpu: VgpuId) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
    /// What `vgpu` may still use of the GPU at `now` (not before the latest event handled),
    /// `None` where the policy budgets nothing for it. `state` is the vGPU's state in the core.
    /// Must not change anything and should cost O(log n) at most: the control interface asks
    /// for every vGPU at every statistics request.
    fn budget(&self, _vgpu: VgpuId, _state: &VgpuState, _now: Time) -> Option<Budget> {
        None
    }
    /// The parameters the policy applies to `vgpu` now, for the control interface: by default
    /// the vGPU's own (`state.params()`), which is right for policies that only read them. A
    /// policy that overrides some from its own configuration (TimeGraph's spec lines) reports
    /// what is in force instead. Must not change anything.
    fn effective_params(&self, _vgpu: VgpuId, state: &VgpuState) -> VgpuParams {
        state.params().clone()
    }
}

/// Which policy to run, with its family's global parameters. Per-vGPU parameters live in
/// [`crate::model::VgpuParams`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
pub enum PolicyConfig {
    /// First come, first served: no scheduling.
    None,
    /// Disengaged fair queuing (NEON / LoGA).
    Fair(fair::FairConfig),
    /// TimeGraph: PRT/HT priorities, PE/AE/Shared reserves, history-based prediction.
    #[serde(rename = "timegraph")]
    TimeGraph(timegraph::TimeGraphConfig),
    /// Pegasus: accelerator credits, CPU-coordinated credits and co-scheduling.
    Pegasus(pegasus::PegasusConfig),
    /// VGRIS: SLA-aware pacing, proportional share and the hybrid controller.
    Vgris(vgris::VgrisConfig),
}

impl PolicyConfig {
    /// Every policy family, in each of its modes that schedules differently: what tests and
    /// benchmarks run "under every policy".
    pub fn every_mode() -> Vec<PolicyConfig> {
        use self::fair::{Accounting, FairConfig};
        use self::pegasus::{PegasusConfig, PegasusMode};
        use self::timegraph::TimeGraphConfig;
        use self::vgris::{VgrisConfig, VgrisMode};
        let mut all = vec![
            PolicyConfig::None,
            PolicyConfig::Fair(FairConfig::default()),
            PolicyConfig::Fair(FairConfig {
                accounting: Accounting::Sampling,
                ..FairConfig::default()
            }),
            PolicyConfig::TimeGraph(TimeGraphConfig::default()),
        ];
        for mode in [
            PegasusMode::Rr,
            PegasusMode::Accc,
            PegasusMode::Xc,
            PegasusMode::Slaf,
            PegasusMode::Augc,
            PegasusMode::Cosched,
        ] {
            all.push(PolicyConfig::Pegasus(PegasusConfig {
                mode,
                ..PegasusConfig::default()
            }));
        }
        for mode in [VgrisMode::Sla, VgrisMode::Share, VgrisMode::Hybrid] {
            all.push(PolicyConfig::Vgris(VgrisConfig {
                mode,
                ..VgrisConfig::default()
            }));
        }
        all
    }

    /// A fresh policy for this configuration.
    pub fn build(&self) -> Box<dyn Policy> {
        match self {
            PolicyConfig::None => Box::new(fcfs::Fcfs::default()),
            PolicyConfig::Fair(c) => Box::new(fair::Fair::new(c.clone())),
            PolicyConfig::TimeGraph(c) => Box::new(timegraph::TimeGraph::new(c)),
            PolicyConfig::Pegasus(c) => Box::new(pegasus::Pegasus::new(c)),
            PolicyConfig::Vgris(c) => Box::new(vgris::Vgris::new(c)),
        }
    }
}

/// The minimum over a few deadlines.
pub fn earliest(deadlines: impl IntoIterator<Item = Option<Time>>) -> Option<Time> {
    deadlines.into_iter().flatten().min()
}
