//! The entities the scheduler reasons about: vGPUs, their command groups and parameters, and the
//! events and decisions that cross the scheduler's boundary (DESIGN §5).
//!
//! Time is always an input. [`Time`] is a point on the caller's monotonic clock and [`Nanos`] a
//! duration, both in nanoseconds.

use serde::{Deserialize, Serialize};

/// A point in time on the caller's monotonic clock, in nanoseconds.
pub type Time = u64;
/// A duration in nanoseconds.
pub type Nanos = u64;

/// Nanoseconds per microsecond.
pub const NS_PER_US: Nanos = 1_000;
/// Nanoseconds per millisecond.
pub const NS_PER_MS: Nanos = 1_000_000;
/// Nanoseconds per second.
pub const NS_PER_SEC: Nanos = 1_000_000_000;

/// One vGPU (one VM): TimeGraph's task, Pegasus's domain, VGRIS's VM agent, NEON's tenant.
///
/// Ids are dense slot numbers handed out by [`crate::Scheduler::add_vgpu`]; a freed slot is
/// reused by the next vGPU, lowest first, so policies may index plain vectors with them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct VgpuId(pub u32);

impl VgpuId {
    /// The id as a vector index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A command group id, chosen by the submitter and unique among the groups it has in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GroupId(pub u64);

/// What a command group does on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// A rendering command stream (virgl SUBMIT_3D).
    Render,
    /// A transfer between guest memory and a host resource.
    Transfer,
    /// A compute kernel launch.
    Compute,
    /// A synthetic load group from the private load capset.
    Load,
    /// The last group of a frame: the present (VGRIS measures its cost separately).
    Present,
}

/// The cost signature of a command group: TimeGraph's "command group matrix", the multiset of
/// methods and data sizes it contains, reduced to a key for history-based prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CostSignature(pub u64);

impl CostSignature {
    /// The signature of a multiset of `(method, size)` pairs. The order of the pairs does not
    /// matter, their multiplicity does.
    pub fn from_methods(methods: &mut [(u32, u32)]) -> Self {
        methods.sort_unstable();
        // FNV-1a over the sorted pairs: stable across runs and platforms.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for &(method, size) in methods.iter() {
            for byte in method.to_le_bytes().into_iter().chain(size.to_le_bytes()) {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        CostSignature(hash)
    }
}

/// One unit of non-preemptive GPU work: what TimeGraph schedules at its boundaries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandGroup {
    /// Unique among the submitter's groups in flight.
    pub id: GroupId,
    /// The vGPU that submitted it.
    pub vgpu: VgpuId,
    /// The guest context it runs in (a context switch on the GPU costs time).
    pub context: u32,
    /// What it does.
    pub kind: GroupKind,
    /// Its cost signature for prediction.
    pub signature: CostSignature,
}

impl CommandGroup {
    /// A group in context 0 whose signature is `signature`.
    pub fn new(id: u64, vgpu: VgpuId, kind: GroupKind, signature: u64) -> Self {
        CommandGroup {
            id: GroupId(id),
            vgpu,
            context: 0,
            kind,
            signature: CostSignature(signature),
        }
    }
}

/// TimeGraph's priority scheduling policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrioPolicy {
    /// Predictable-Response-Time: every group waits until the GPU is idle; the highest
    /// priority waiter goes next.
    Prt,
    /// High-Throughput: the task on the GPU may submit back to back while no higher priority
    /// task waits.
    Ht,
}

/// TimeGraph's reservation enforcement policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Enforcement {
    /// Posterior Enforcement: submit while the budget is positive; overruns are charged after.
    Pe,
    /// Apriori Enforcement: submit only if the predicted cost fits the budget.
    Ae,
}

/// A GPU reservation: budget `c` every period `t`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reserve {
    /// Budget per period (TimeGraph's C).
    pub c: Nanos,
    /// Replenishment period (TimeGraph's T).
    pub t: Nanos,
    /// How the budget is enforced.
    pub enforcement: Enforcement,
    /// The name of a Shared reserve this vGPU draws from with others, if any.
    #[serde(default)]
    pub shared: Option<String>,
}

/// What a vGPU may still use of the GPU under the running policy: TimeGraph's reserve budget,
/// Pegasus's credit balance, VGRIS's proportional-share budget, fair queuing's lead over the
/// system virtual time, or a bounded lease. For the control interface; no decision reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    /// GPU time the vGPU may still use before the policy holds it back (or, for Pegasus, before
    /// it falls behind the vGPUs with credit left). Negative after an overrun: posterior
    /// enforcement charges a group's whole cost when it completes.
    pub remaining_ns: i64,
    /// The full budget: what a refill brings it up to (a reserve's C, a share's `t * s`, the
    /// vGPU's part of a Pegasus period, the fair-queuing threshold, a lease's grant).
    pub capacity_ns: Nanos,
    /// How often it is refilled; `None` when it refills continuously (fair queuing, as the others
    /// catch up) or never (a lease).
    pub period_ns: Option<Nanos>,
}

/// Per-vGPU parameters. One struct serves every policy so that parameters survive a policy
/// change; each policy reads the fields it understands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VgpuParams {
    /// The VM's name (spec lines and the control CLI address vGPUs by it).
    pub name: String,
    /// GPU priority, higher is more urgent (TimeGraph).
    pub priority: u32,
    /// TimeGraph priority policy for this vGPU; `None` uses the policy's default.
    pub sched: Option<PrioPolicy>,
    /// TimeGraph reservation; `None` puts the vGPU in the Background reserve.
    pub reserve: Option<Reserve>,
    /// The weight of this vGPU: Pegasus GPU credits, VGRIS share, fair-queuing weight.
    pub weight: u32,
    /// Pegasus SLAF service level: the GPU time per second the VM expects.
    pub slo: Option<Nanos>,
    /// VGRIS service level: the frame rate the VM must hold.
    pub target_fps: Option<f64>,
}

/// The weight a vGPU gets when none is given (the Xen credit scheduler's default).
pub const DEFAULT_WEIGHT: u32 = 256;

impl Default for VgpuParams {
    fn default() -> Self {
        VgpuParams {
            name: String::new(),
            priority: 0,
            sched: None,
            reserve: None,
            weight: DEFAULT_WEIGHT,
            slo: None,
            target_fps: None,
        }
    }
}

impl VgpuParams {
    /// Parameters with only a name set.
    pub fn named(name: &str) -> Self {
        VgpuParams {
            name: name.to_owned(),
            ..VgpuParams::default()
        }
    }
}

/// What the host CPU scheduler says about a VM (DESIGN §5, host CPU coordination).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CpuHint {
    /// The VM's CPU weight (cgroup v2 `cpu.weight` scale, 1–10000): Pegasus's CPU credits.
    pub weight: u32,
    /// At least one of the VM's vCPU threads is scheduled now: the vCPU the host CPU scheduler
    /// runs at this moment. A sampler that cannot see the instant (vgpu-schedd reads
    /// /proc every 100 ms) reports a runnable vCPU that was busy, on a CPU or waiting for one,
    /// for most of the last interval, so that host contention does not hide a busy VM.
    pub running: bool,
    /// At least one of the VM's vCPU threads is runnable (running or waiting for a CPU).
    pub runnable: bool,
    /// The VM's cumulative CPU time.
    pub usage: Nanos,
}

/// A configuration change that arrives as an event.
#[derive(Debug, Clone, PartialEq)]
pub enum ConfigChange {
    /// New parameters for one vGPU.
    Params(VgpuId, VgpuParams),
    /// The user looks at this VM's console: TimeGraph raises its wildcard priority.
    Focus(VgpuId),
}

/// An event into the scheduler.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A group asks to be dispatched.
    Submitted(CommandGroup),
    /// A group was dispatched by its device under a lease, without asking.
    Dispatched(CommandGroup),
    /// A dispatched group finished: it ran on the GPU from `start` to `finish`.
    Completed {
        /// The vGPU that owns the group.
        vgpu: VgpuId,
        /// The group.
        group: GroupId,
        /// When the GPU started it.
        start: Time,
        /// When its fence signalled.
        finish: Time,
    },
    /// The submitter withdrew a group it had submitted or dispatched (its device was reset or
    /// its VM rebooted before the group finished). A queued group leaves its queue; a group on
    /// the GPU-online list leaves it and is charged the time it held its place there, from its
    /// dispatch until now: an upper bound of the GPU time it may have used, so that cancelling
    /// is never cheaper than completing.
    Cancelled {
        /// The vGPU that owns the group.
        vgpu: VgpuId,
        /// The group.
        group: GroupId,
    },
    /// A deadline returned by [`crate::Scheduler::next_deadline`] was reached.
    Timer,
    /// News from the host CPU scheduler about a VM.
    CpuHint(VgpuId, CpuHint),
    /// The VM reached a frame boundary and wants to present.
    Frame(VgpuId),
    /// A parameter change.
    Config(ConfigChange),
}

/// A decision out of the scheduler, for the caller to carry out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "decision")]
pub enum Decision {
    /// Dispatch this group now. `leased` is true when the group went straight through under
    /// the vGPU's lease instead of waiting in its queue.
    Dispatch {
        /// The owner.
        vgpu: VgpuId,
        /// The group.
        group: GroupId,
        /// Dispatched under a lease.
        leased: bool,
    },
    /// The vGPU may dispatch without asking until revoked, until `until`, or until it has
    /// used `budget` of GPU time.
    Lease {
        /// The holder.
        vgpu: VgpuId,
        /// GPU time it may use, if bounded.
        budget: Option<Nanos>,
        /// Time at which the lease ends, if bounded.
        until: Option<Time>,
    },
    /// The vGPU's lease is withdrawn: it must ask again for every group.
    Revoke {
        /// The former holder.
        vgpu: VgpuId,
    },
    /// The vGPU may not dispatch anything until resumed.
    Suspend {
        /// The vGPU.
        vgpu: VgpuId,
    },
    /// The vGPU may dispatch again.
    Resume {
        /// The vGPU.
        vgpu: VgpuId,
    },
    /// Release the vGPU's pending present at `at` (VGRIS pacing; `at` is now when unpaced).
    Present {
        /// The vGPU.
        vgpu: VgpuId,
        /// When to present.
        at: Time,
    },
    /// Suggest this CPU weight for the VM's cgroup.
    CpuWeight {
        /// The vGPU.
        vgpu: VgpuId,
        /// The weight, cgroup v2 scale.
        weight: u32,
    },
}
