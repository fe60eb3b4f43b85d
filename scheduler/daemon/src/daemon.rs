//! The daemon core: the state machine between device connections, the [`Scheduler`], the
//! simulated GPU engine and the control interface (DESIGN §2, issue 5).
//!
//! Pure like the scheduler library: no I/O, no clock, no unsafe. The I/O layer accepts
//! connections and calls [`Daemon::connect`], hands every received packet to
//! [`Daemon::receive`], calls [`Daemon::timer`] at [`Daemon::next_deadline`], and after each
//! call drains the [`Outbox`]: messages to send, connections to close (after sending their
//! `Refused`) and CPU weight hints to write to cgroups.
//!
//! Every device is untrusted: anything it sends that does not decode, breaks the session rules
//! or that the scheduler refuses gets a `Refused` and closes that connection only; its vGPU is
//! removed and the other VMs go on.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use log::{debug, info, warn};
use serde::Serialize;
use thiserror::Error;
use vgpu_scheduler::core::{MAX_GROUPS_PER_VGPU, MAX_VGPUS};
use vgpu_scheduler::policy::timegraph::ConfigError;
use vgpu_scheduler::sim::ParamsOverride;
use vgpu_scheduler::sim::engine::{Engine, Job};
use vgpu_scheduler::{
    Budget, CommandGroup, CostSignature, CpuHint, Decision, Event, GroupId, GroupKind, Nanos,
    PolicyConfig, SchedError, Scheduler, Time, VgpuId, VgpuParams,
};

use crate::metrics::LatencyHistogram;
use crate::proto::{
    self, Detail, Exec, MAX_GROUPS_PER_DEVICE, Msg, PROTOCOL_VERSION, ProtoError, RefuseCode,
    Session, VmName,
};

// The per-device bound the device and the daemon agree on is what the daemon enforces; the
// scheduler core's per-vGPU bound stays above it, so the core never refuses a device the daemon
// accepted, and the core's total (every vGPU at its bound) stays finite.
const _: () = assert!(MAX_GROUPS_PER_DEVICE <= MAX_GROUPS_PER_VGPU);
const _: () = assert!(MAX_CONNECTIONS <= MAX_VGPUS);

/// Most device connections at once, greeted or not: far above one host's VMs, and it bounds
/// the connection table against a local process that opens sockets in a loop.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most VM names whose parameters the daemon stores (set by the control interface, kept while
/// the VM is away): bounds the table a control client can grow.
pub const MAX_STORED_VMS: usize = 4096;
/// Most VM names bound to the user of the device that first used them: the same bound as the
/// stored parameters. When full, a binding of a name with no live device is dropped for a new
/// one, so the table cannot lock out new names.
pub const MAX_BOUND_NAMES: usize = MAX_STORED_VMS;
/// Largest cost of one `Simulated` group: the load capset's largest OCCUPY (1 s), so one group
/// cannot hold the shared engine for longer.
pub const MAX_SIMULATED_COST_NS: Nanos = 1_000_000_000;
/// Interval between two statistics snapshots.
pub const STATS_INTERVAL_NS: Nanos = 1_000_000_000;
/// Snapshots kept per VM: rates are taken over the last this-many intervals (a 5 s window).
pub const STATS_WINDOW_SNAPSHOTS: usize = 5;
/// A device that asked this recently is likely to ask again soon (a device-executed group
/// held for its grant, or the load groups that are submitted even under a lease): 1 ms, a
/// few group round trips on the project's machine (docs/PERFORMANCE.md).
pub const SUBMIT_RECENT_NS: Time = 1_000_000;
/// Most timer steps (engine completions, scheduler timers, snapshots) one [`Daemon::timer`]
/// call handles. A call that is late by a lot stops here and leaves the rest to the next call
/// (its deadline is then already due) instead of running without bound.
pub const MAX_TIMER_STEPS: usize = 1 << 20;
/// Largest GPU context switch cost of the simulated engine: 10 ms, far above any real GPU's.
pub const MAX_SWITCH_COST_NS: Nanos = 10_000_000;
/// How long a group granted to a device (or dispatched by it under a lease) may stay
/// unfinished before the daemon stops trusting the device: 2 s. The longest legitimate group is
/// bounded by what a guest's own display stack tolerates: Windows WDDM's Timeout Detection and
/// Recovery treats a GPU job that runs longer than its default `TdrDelay` of 2 seconds as a
/// hung GPU and resets it ("Timeout Detection and Recovery (TDR)", Windows driver
/// documentation), and Linux DRM drivers use timeouts of the same order. A device whose group
/// is not done by then is broken, hung or hostile: it is dropped (its connection closed, its
/// groups written off, its place on the GPU-online list freed) so that the other VMs keep
/// getting grants.
pub const DEFAULT_GROUP_TIMEOUT_NS: Nanos = 2 * vgpu_scheduler::model::NS_PER_SEC;
/// How long after a Revoke the daemon still accepts `Dispatched` from the device: 250 ms. A
/// device that dispatched under its lease sends `Dispatched` at once, but the Revoke and that
/// message may cross in the sockets, and the device's worker may be busy in a long submit when the
/// Revoke arrives; 250 ms covers both with room on a loaded host (scheduling latency of tens of
/// ms), while keeping what a device may still put on the GPU after a Revoke small. A
/// `Dispatched` outside a lease and this grace is a protocol violation.
pub const DISPATCH_GRACE_NS: Nanos = 250 * vgpu_scheduler::model::NS_PER_MS;
/// Longest group timeout accepted: 10 minutes, for debugging a device under a debugger; beyond
/// it a hung device would stall every VM for longer than any operator waits.
pub const MAX_GROUP_TIMEOUT_NS: Nanos = 600 * vgpu_scheduler::model::NS_PER_SEC;
/// Longest time a VM name waits before it may connect again after its device was dropped for
/// a group timeout. The wait is the group timeout, doubled for each further timeout of the
/// name, up to this: a device that keeps taking a grant and never finishing it holds the GPU
/// for one timeout and then stays away for ever longer, instead of one timeout in every two.
/// A minute bounds what one real GPU hang costs a VM that recovers.
pub const MAX_REJOIN_BACKOFF_NS: Nanos = 60 * vgpu_scheduler::model::NS_PER_SEC;

/// Latency values below this many µs have a histogram bucket each.
const HIST_LINEAR: u64 = 16;
/// Sub-buckets per power of two above [`HIST_LINEAR`] (3 bits: at most 12.5 % error).
const HIST_SUB_BITS: u32 = 3;
/// Buckets of the latency histogram: the linear ones, then 8 per power of two from 2^4 to 2^63.
const HIST_BUCKETS: usize = 16 + (64 - 4) * 8;

/// Errors of the daemon core: a device's message that is refused, or a control request that
/// cannot be carried out.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum DaemonError {
    /// The packet did not decode or broke the session rules.
    #[error(transparent)]
    Proto(#[from] ProtoError),
    /// The scheduler refused the event.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// Another live connection uses this VM name.
    #[error("VM name {0:?} is in use by another connection")]
    NameInUse(String),
    /// `Hello` names another process than the peer's credentials.
    #[error("Hello says device pid {said}, the socket's peer is pid {peer}")]
    PidMismatch {
        /// The pid in `Hello`.
        said: u32,
        /// The pid from the socket's credentials.
        peer: u32,
    },
    /// The VM name is bound to another user, or reserved for a device process the daemon
    /// created.
    #[error("VM name {0:?} belongs to another user or process")]
    NameForbidden(String),
    /// [`MAX_CONNECTIONS`] connections are open.
    #[error("too many connections (at most {MAX_CONNECTIONS})")]
    TooManyConnections,
    /// The group id is already queued or in flight for this device.
    #[error("group {0:?} is already queued or in flight")]
    DuplicateGroup(GroupId),
    /// The device has [`MAX_GROUPS_PER_DEVICE`] groups queued or in flight.
    #[error("too many groups queued or in flight (at most {MAX_GROUPS_PER_DEVICE})")]
    QueueFull,
    /// No group with this id is queued or in flight for this device.
    #[error("group {0:?} is not queued or in flight")]
    UnknownGroup(GroupId),
    /// `Completed` for a group that was submitted but not granted yet.
    #[error("group {0:?} completed before it was granted")]
    NotGranted(GroupId),
    /// `Completed` for a group the daemon's engine runs.
    #[error("group {0:?} is simulated: the daemon completes it")]
    NotDeviceGroup(GroupId),
    /// A completion that finished after the daemon received it.
    #[error("group {group:?} finished at {finish}, in the future of {now}")]
    FinishInFuture {
        /// The group.
        group: GroupId,
        /// Its claimed finish.
        finish: Time,
        /// The daemon's time.
        now: Time,
    },
    /// A `Simulated` group's cost is 0 or above [`MAX_SIMULATED_COST_NS`].
    #[error("simulated cost {0} ns is outside 1..={MAX_SIMULATED_COST_NS}")]
    BadCost(Nanos),
    /// A control request names a VM that is not connected.
    #[error("no VM {0:?} is connected")]
    UnknownVm(String),
    /// A control request names a VM by an invalid name.
    #[error("invalid VM name: {0}")]
    BadName(ProtoError),
    /// A device of this VM name timed out recently and must wait before it connects again.
    #[error("VM {name:?} timed out a group; it may connect again in {left_ms} ms")]
    Backoff {
        /// The VM name.
        name: String,
        /// Milliseconds left.
        left_ms: u64,
    },
    /// A group granted to the device, or dispatched by it, did not complete in time.
    #[error("group {group:?} not completed within {timeout_ms} ms of its dispatch")]
    GroupTimeout {
        /// The oldest group in flight.
        group: GroupId,
        /// The group timeout.
        timeout_ms: u64,
    },
    /// `Dispatched` while the device holds no lease and its last one ended more than
    /// [`DISPATCH_GRACE_NS`] ago.
    #[error("group {0:?} dispatched without a lease")]
    NotLeased(GroupId),
    /// [`MAX_STORED_VMS`] VMs have stored parameters.
    #[error("too many VMs with stored parameters (at most {MAX_STORED_VMS})")]
    TooManyVms,
    /// A TimeGraph configuration that does not validate.
    #[error("invalid TimeGraph configuration: {0}")]
    BadPolicy(ConfigError),
    /// A control request names a VM the daemon does not know: not connected, without stored
    /// parameters, device process or definition.
    #[error("no VM {name:?}: it is not connected, created or defined (known: {})", known_list(.known))]
    NotKnown {
        /// The name as given.
        name: String,
        /// The VMs the daemon knows, by name.
        known: Vec<String>,
    },
    /// `forget` of a VM that is connected or has a device process.
    #[error("VM {0:?} is running: stop it (or its QEMU) first, then forget it")]
    Running(String),
}

/// The known VMs of a [`DaemonError::NotKnown`], as its message lists them.
fn known_list(known: &[String]) -> String {
    if known.is_empty() {
        "none".to_owned()
    } else {
        known.join(", ")
    }
}

impl DaemonError {
    /// The code a device is refused with for this error.
    pub fn refuse_code(&self) -> RefuseCode {
        match self {
            DaemonError::Proto(e) => e.refuse_code(),
            DaemonError::Sched(e) => match e {
                SchedError::DuplicateGroup(_) => RefuseCode::DuplicateGroup,
                SchedError::UnknownGroup(_) => RefuseCode::UnknownGroup,
                SchedError::QueueFull(_) => RefuseCode::QueueFull,
                SchedError::TooManyVgpus => RefuseCode::TooManyVgpus,
                SchedError::BadTimes(_) => RefuseCode::BadMessage,
                SchedError::UnknownVgpu(_)
                | SchedError::TimeWentBackwards { .. }
                | SchedError::BadParams(_) => RefuseCode::Internal,
            },
            DaemonError::NameInUse(_) => RefuseCode::NameInUse,
            DaemonError::NameForbidden(_) => RefuseCode::Forbidden,
            DaemonError::TooManyConnections => RefuseCode::TooManyVgpus,
            DaemonError::DuplicateGroup(_) => RefuseCode::DuplicateGroup,
            DaemonError::QueueFull => RefuseCode::QueueFull,
            DaemonError::UnknownGroup(_) => RefuseCode::UnknownGroup,
            DaemonError::NotGranted(_) => RefuseCode::OutOfOrder,
            DaemonError::GroupTimeout { .. } | DaemonError::Backoff { .. } => RefuseCode::Timeout,
            DaemonError::NotLeased(_) => RefuseCode::NotLeased,
            DaemonError::PidMismatch { .. }
            | DaemonError::NotDeviceGroup(_)
            | DaemonError::FinishInFuture { .. }
            | DaemonError::BadCost(_)
            | DaemonError::BadName(_) => RefuseCode::BadMessage,
            DaemonError::UnknownVm(_)
            | DaemonError::TooManyVms
            | DaemonError::BadPolicy(_)
            | DaemonError::NotKnown { .. }
            | DaemonError::Running(_) => RefuseCode::Internal,
        }
    }
}

/// A device connection, numbered by the daemon; never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ConnId(pub u64);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conn{}", self.0)
    }
}

/// The credentials of a connection's peer (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Peer {
    /// The peer's process id; 0 when unknown (then `Hello`'s pid is not checked against it).
    pub pid: u32,
    /// The peer's user id.
    pub uid: u32,
}

/// The daemon's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonConfig {
    /// The policy to start with.
    pub policy: PolicyConfig,
    /// Groups the GPU-online list holds (1 = exclusive).
    pub capacity: usize,
    /// The simulated engine's context switch cost (clamped to [`MAX_SWITCH_COST_NS`]).
    pub switch_cost_ns: Nanos,
    /// Whether the scheduler's CPU weight hints go to the outbox (to be written to cgroups).
    pub cpu_writeback: bool,
    /// How long a device group may stay granted (or dispatched under a lease) without
    /// completing before its device is dropped; [`DEFAULT_GROUP_TIMEOUT_NS`] by default,
    /// clamped to 1 ns..=[`MAX_GROUP_TIMEOUT_NS`].
    pub group_timeout_ns: Nanos,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            policy: PolicyConfig::None,
            capacity: 1,
            switch_cost_ns: 0,
            cpu_writeback: false,
            group_timeout_ns: DEFAULT_GROUP_TIMEOUT_NS,
        }
    }
}

/// A CPU weight to write to a VM's cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WeightHint {
    /// The VM.
    pub vm: String,
    /// Its QEMU process (0 when its device did not say).
    pub qemu_pid: u32,
    /// The weight, cgroup v2 scale.
    pub weight: u32,
}

/// What the I/O layer must carry out after a call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outbox {
    /// Messages to send, in order.
    pub messages: Vec<(ConnId, Msg)>,
    /// Connections to close once their messages above are sent.
    pub drops: Vec<ConnId>,
    /// CPU weights to write (only with write-back enabled).
    pub weights: Vec<WeightHint>,
}

/// Where a device's group stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Submitted, waiting for a dispatch.
    Queued,
    /// Dispatched: on the device's GPU or on the daemon's engine.
    InFlight,
}

/// A group the daemon tracks for its device.
#[derive(Debug, Clone, Copy)]
struct Group {
    exec: Exec,
    stage: Stage,
    context: u32,
    cost: Nanos,
    submitted: Time,
    /// While granted to its device (or dispatched by it): when it times out.
    deadline: Option<Time>,
}

/// Counters at one statistics snapshot.
#[derive(Debug, Clone, Copy, Default)]
struct Snapshot {
    at: Time,
    completed: u64,
    gpu_time: Nanos,
    frames: u64,
}

/// A fixed-size log-linear histogram of latencies in µs.
#[derive(Debug, Clone)]
struct Histogram {
    buckets: Box<[u64; HIST_BUCKETS]>,
    count: u64,
}

impl Histogram {
    fn new() -> Self {
        Histogram {
            buckets: Box::new([0; HIST_BUCKETS]),
            count: 0,
        }
    }

    fn index(us: u64) -> usize {
        if us < HIST_LINEAR {
            return usize::try_from(us).unwrap_or(0);
        }
        let exp = 63 - us.leading_zeros();
        let sub = (us >> (exp - HIST_SUB_BITS)) & ((1 << HIST_SUB_BITS) - 1);
        let i = HIST_LINEAR + u64::from(exp - 4) * (1 << HIST_SUB_BITS) + sub;
        usize::try_from(i).map_or(HIST_BUCKETS - 1, |i| i.min(HIST_BUCKETS - 1))
    }

    /// The smallest value that falls in bucket `i`.
    fn lower(i: usize) -> u64 {
        let i = i as u64;
        if i < HIST_LINEAR {
            return i;
        }
        let k = i - HIST_LINEAR;
        let exp = k / (1 << HIST_SUB_BITS) + 4;
        let sub = k % (1 << HIST_SUB_BITS);
        (1u64 << exp) | (sub << (exp - u64::from(HIST_SUB_BITS)))
    }

    fn record(&mut self, us: u64) {
        if let Some(b) = self.buckets.get_mut(Self::index(us)) {
            *b = b.saturating_add(1);
        }
        self.count = self.count.saturating_add(1);
    }

    /// The `q` quantile (0..=1), as its bucket's lower bound; 0 when empty.
    fn quantile(&self, q: f64) -> u64 {
        Self::quantile_of(&[self], q)
    }

    /// The `q` quantile of the latencies of all `parts` together.
    fn quantile_of(parts: &[&Histogram], q: f64) -> u64 {
        let count = parts.iter().fold(0u64, |n, h| n.saturating_add(h.count));
        if count == 0 {
            return 0;
        }
        let rank = ((count as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0u64;
        for i in 0..HIST_BUCKETS {
            for h in parts {
                seen = seen.saturating_add(h.buckets.get(i).copied().unwrap_or(0));
            }
            if seen >= rank {
                return Self::lower(i);
            }
        }
        Self::lower(HIST_BUCKETS - 1)
    }
}

/// Latencies of the recent past: the window being filled and the one before it, each
/// [`STATS_WINDOW_SNAPSHOTS`] snapshots long, so quantiles cover the last 5 to 10 s.
#[derive(Debug, Clone)]
struct RecentLatency {
    current: Histogram,
    previous: Histogram,
    /// Snapshots since `current` started.
    age: usize,
}

impl RecentLatency {
    fn new() -> Self {
        RecentLatency {
            current: Histogram::new(),
            previous: Histogram::new(),
            age: 0,
        }
    }

    fn record(&mut self, us: u64) {
        self.current.record(us);
    }

    /// One statistics snapshot went by; a full window becomes the previous one.
    fn tick(&mut self) {
        self.age = self.age.saturating_add(1);
        if self.age >= STATS_WINDOW_SNAPSHOTS {
            self.previous = std::mem::replace(&mut self.current, Histogram::new());
            self.age = 0;
        }
    }

    fn quantile(&self, q: f64) -> u64 {
        Histogram::quantile_of(&[&self.current, &self.previous], q)
    }
}

/// A greeted device: its VM and vGPU.
#[derive(Debug, Clone)]
struct Attached {
    name: String,
    vgpu: VgpuId,
    device_pid: u32,
    qemu_pid: u32,
    /// When its last lease was revoked, for [`DISPATCH_GRACE_NS`].
    revoked_at: Option<Time>,
    groups: BTreeMap<GroupId, Group>,
    snapshots: VecDeque<Snapshot>,
    latency: Histogram,
    recent: RecentLatency,
    /// The same latencies in the exposition's buckets, with their sum.
    histogram: LatencyHistogram,
    /// Its memory budget as its device last reported it: (used, limit) bytes.
    memory: Option<(u64, u64)>,
    /// When its device connected (greeted).
    connected_at: Time,
}

impl Attached {
    /// A group's submit-to-finish latency, in ns.
    fn record_latency(&mut self, ns: Nanos) {
        let us = ns / vgpu_scheduler::model::NS_PER_US;
        self.latency.record(us);
        self.recent.record(us);
        self.histogram.record(ns);
    }
}

/// One device connection.
#[derive(Debug, Clone)]
struct Conn {
    peer: Peer,
    session: Session,
    vm: Option<Attached>,
}

/// A VM as the control interface lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VmInfo {
    /// Its name.
    pub name: String,
    /// Whether a device is connected for it.
    pub connected: bool,
    /// Its vGPU while connected.
    pub vgpu: Option<VgpuId>,
    /// Its connection while connected.
    pub conn: Option<ConnId>,
    /// The device process's pid while connected.
    pub device_pid: Option<u32>,
    /// The QEMU pid its device announced (0 = unknown) while connected.
    pub qemu_pid: Option<u32>,
    /// The device process's user id while connected.
    pub uid: Option<u32>,
    /// Its parameters as the operator set them (stored ones while away).
    pub params: VgpuParams,
    /// The parameters the policy applies to it, which differ from `params` where the policy
    /// overrides them (TimeGraph's spec lines and focus); absent while away.
    pub effective: Option<VgpuParams>,
}

/// Live statistics of one VM.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VmStats {
    /// Its name.
    pub name: String,
    /// Its vGPU while connected.
    pub vgpu: Option<VgpuId>,
    /// Whether a device is connected for it.
    pub connected: bool,
    /// Fraction of GPU time its completed groups used over the window.
    pub gpu_share: f64,
    /// Groups completed per second over the window.
    pub groups_per_sec: f64,
    /// Frames per second over the window.
    pub fps: f64,
    /// Groups waiting in its queue.
    pub queue_depth: usize,
    /// Groups dispatched and not completed.
    pub in_flight: usize,
    /// Median submit-to-finish latency since it connected, µs (bucket lower bound).
    pub latency_p50_us: u64,
    /// 99th percentile submit-to-finish latency since it connected, µs (bucket lower bound).
    pub latency_p99_us: u64,
    /// Median submit-to-finish latency of the groups completed in the last 5 to 10 s, µs
    /// (bucket lower bound; 0 when none completed).
    pub recent_latency_p50_us: u64,
    /// 99th percentile of the same, µs.
    pub recent_latency_p99_us: u64,
    /// Submit-to-finish latencies since it connected, as the metrics' histogram (not in the
    /// JSON statistics: the quantiles above are).
    #[serde(skip)]
    pub latency: LatencyHistogram,
    /// Groups submitted since it connected (asked for a grant).
    pub submitted: u64,
    /// Groups dispatched since it connected (granted or leased).
    pub dispatched: u64,
    /// Groups completed since it connected.
    pub completed: u64,
    /// Groups its device cancelled since it connected (queued or in flight).
    pub cancelled: u64,
    /// GPU time of its completed groups since it connected, ns.
    pub gpu_time_ns: Nanos,
    /// Frames since it connected.
    pub frames: u64,
    /// What it may still use of the GPU under the policy (see [`Budget`]); `None` while away
    /// and where the policy budgets nothing for it.
    pub budget: Option<Budget>,
    /// The policy's figures for its vGPU.
    pub figures: BTreeMap<&'static str, f64>,
    /// Bytes of its memory budget in use (its GPU memory on the compute path, GL resources),
    /// as its device last reported; `None` while away or before the first report.
    pub memory_used_bytes: Option<u64>,
    /// Its memory budget (`--memory-mb`), as its device reported it.
    pub memory_limit_bytes: Option<u64>,
    /// The device process's pid while connected.
    pub device_pid: Option<u32>,
    /// The QEMU pid its device announced (0 = unknown) while connected.
    pub qemu_pid: Option<u32>,
    /// How long its device has been connected, ns; `None` while away.
    pub uptime_ns: Option<Nanos>,
}

/// Live statistics of the daemon.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    /// When they were taken.
    pub now: Time,
    /// The running policy's name.
    pub policy: &'static str,
    /// Fraction of time the simulated engine was busy, since the daemon started.
    pub engine_busy: f64,
    /// Time the simulated engine was busy since the daemon started, ns (two samples give the
    /// busy fraction of the time between them).
    pub engine_busy_ns: Nanos,
    /// Context switches of the simulated engine.
    pub engine_switches: u64,
    /// Per VM, by name.
    pub vms: Vec<VmStats>,
}

/// The daemon core. See the module documentation.
#[derive(Debug)]
pub struct Daemon {
    config: DaemonConfig,
    sched: Scheduler,
    policy: PolicyConfig,
    started: Time,
    now: Time,
    next_conn: u64,
    conns: BTreeMap<ConnId, Conn>,
    by_vgpu: BTreeMap<VgpuId, ConnId>,
    stored: BTreeMap<String, VgpuParams>,
    /// VM name → the uid of the first device connection that used it.
    owners: BTreeMap<String, u32>,
    /// VM name → the pid of the device process the daemon created for it.
    reserved: BTreeMap<String, u32>,
    /// VM name → (time it may connect again, group timeouts so far), see
    /// [`MAX_REJOIN_BACKOFF_NS`]; at most [`MAX_BOUND_NAMES`] entries.
    backoff: BTreeMap<String, (Time, u32)>,
    engine: Engine,
    engine_due: Option<Time>,
    /// When the last `Submit` arrived (see [`Daemon::answers_awaited`]).
    last_submit: Option<Time>,
    next_snapshot: Time,
    /// Device groups in flight by deadline: the first one is the oldest group in flight of any
    /// device, so a device that completes newer groups does not keep an old one alive.
    expiry: BTreeSet<(Time, ConnId, GroupId)>,
    out: Outbox,
}

fn check_policy(policy: &PolicyConfig) -> Result<(), DaemonError> {
    if let PolicyConfig::TimeGraph(c) = policy {
        c.validate().map_err(DaemonError::BadPolicy)?;
    }
    Ok(())
}

impl Daemon {
    /// A daemon started at `now` with no devices.
    pub fn new(now: Time, config: DaemonConfig) -> Result<Daemon, DaemonError> {
        check_policy(&config.policy)?;
        let sched = Scheduler::new(config.policy.build(), config.capacity);
        Ok(Daemon {
            engine: Engine::new(config.switch_cost_ns.min(MAX_SWITCH_COST_NS)),
            policy: config.policy.clone(),
            config,
            sched,
            started: now,
            now,
            next_conn: 0,
            conns: BTreeMap::new(),
            by_vgpu: BTreeMap::new(),
            stored: BTreeMap::new(),
            owners: BTreeMap::new(),
            reserved: BTreeMap::new(),
            backoff: BTreeMap::new(),
            engine_due: None,
            last_submit: None,
            next_snapshot: now.saturating_add(STATS_INTERVAL_NS),
            expiry: BTreeSet::new(),
            out: Outbox::default(),
        })
    }

    /// Takes what the I/O layer must carry out.
    pub fn drain(&mut self) -> Outbox {
        std::mem::take(&mut self.out)
    }

    /// The daemon's time: `now`, but never before a time already handled.
    fn clock(&mut self, now: Time) -> Time {
        self.now = self.now.max(now).max(self.sched.now());
        self.now
    }

    /// Moves to `now`, first handling what fell due before it (engine completions, timers), so
    /// an input is never handled before something that happened earlier.
    fn advance(&mut self, now: Time) -> Time {
        self.timer(now);
        self.now
    }

    /// A device connected. Returns its id; beyond [`MAX_CONNECTIONS`] it is refused at once
    /// (the outbox says so).
    pub fn connect(&mut self, now: Time, peer: Peer) -> ConnId {
        self.advance(now);
        let id = ConnId(self.next_conn);
        self.next_conn = self.next_conn.saturating_add(1);
        if self.conns.len() >= MAX_CONNECTIONS {
            warn!(
                "{id} from pid {}: {}",
                peer.pid,
                DaemonError::TooManyConnections
            );
            self.refuse(id, &DaemonError::TooManyConnections);
            self.out.drops.push(id);
            return id;
        }
        debug!("{id} from pid {} uid {}", peer.pid, peer.uid);
        self.conns.insert(
            id,
            Conn {
                peer,
                session: Session::new(),
                vm: None,
            },
        );
        id
    }

    /// A device's connection closed (or its process died): its vGPU is removed, its queued
    /// work dropped; its groups on the engine are discarded. Unknown ids are ignored.
    pub fn disconnect(&mut self, now: Time, conn: ConnId) {
        let now = self.advance(now);
        if self.conns.contains_key(&conn) {
            info!("{conn} disconnected");
            self.teardown(now, conn);
        }
    }

    /// One packet from a device, without a descriptor.
    pub fn receive(&mut self, now: Time, conn: ConnId, packet: &[u8]) {
        self.receive_proven(now, conn, packet, None);
    }

    /// One packet from a device; `qemu_peer` is the pid of the peer of the descriptor that came
    /// with it, if any. A `Hello`'s QEMU pid is used (cgroup probing and weight write-back)
    /// only when its device proves it this way, by handing over QEMU's vfio-user connection;
    /// an unproven one is replaced by 0 (unknown) and the VM still runs, scheduled but without
    /// CPU coordination.
    pub fn receive_proven(
        &mut self,
        now: Time,
        conn: ConnId,
        packet: &[u8],
        qemu_peer: Option<u32>,
    ) {
        let now = self.advance(now);
        if !self.conns.contains_key(&conn) {
            debug!("{conn}: packet after close ignored");
            return;
        }
        let result = proto::decode(packet)
            .map_err(DaemonError::from)
            .and_then(|msg| self.message(now, conn, msg, qemu_peer));
        if let Err(e) = result {
            warn!("{conn}: refused: {e}");
            if let Some(name) = self.attached(conn).map(|vm| vm.name.clone()) {
                self.hold_back(now, &name);
            }
            self.refuse(conn, &e);
            self.teardown(now, conn);
        }
    }

    fn refuse(&mut self, conn: ConnId, e: &DaemonError) {
        let msg = Msg::Refused {
            code: e.refuse_code(),
            detail: Detail::lossy(&e.to_string()),
        };
        self.out.messages.push((conn, msg));
    }

    /// Removes a connection and its vGPU and closes it.
    fn teardown(&mut self, now: Time, conn: ConnId) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        self.out.drops.push(conn);
        let Some(vm) = c.vm else { return };
        for (&id, g) in &vm.groups {
            if let Some(t) = g.deadline {
                self.expiry.remove(&(t, conn, id));
            }
        }
        self.by_vgpu.remove(&vm.vgpu);
        let dropped = self.engine.discard_queued(conn.0);
        let mut out = Vec::new();
        match self.sched.remove_vgpu(now, vm.vgpu, &mut out) {
            Ok(_) => info!(
                "VM {} ({conn}) removed from {:?}; {dropped} engine jobs dropped",
                vm.name, vm.vgpu
            ),
            Err(e) => warn!("VM {} ({conn}): removing {:?}: {e}", vm.name, vm.vgpu),
        }
        self.carry_out(now, out);
    }

    fn attached(&mut self, conn: ConnId) -> Option<&mut Attached> {
        self.conns.get_mut(&conn).and_then(|c| c.vm.as_mut())
    }

    fn message(
        &mut self,
        now: Time,
        conn: ConnId,
        msg: Msg,
        qemu_peer: Option<u32>,
    ) -> Result<(), DaemonError> {
        let Some(c) = self.conns.get_mut(&conn) else {
            return Ok(());
        };
        c.session.receive(&msg)?;
        let peer = c.peer;
        match msg {
            Msg::Hello {
                vm_name,
                device_pid,
                qemu_pid,
                ..
            } => {
                let proven = if qemu_pid != 0 && qemu_peer != Some(qemu_pid) {
                    warn!(
                        "{conn}: Hello's QEMU pid {qemu_pid} is not proven (descriptor peer \
                         {qemu_peer:?}): not used"
                    );
                    0
                } else {
                    qemu_pid
                };
                self.hello(now, conn, peer, vm_name, device_pid, proven)
            }
            Msg::Submit {
                group,
                context,
                kind,
                signature,
                cost_ns,
                exec,
            } => self.submit(now, conn, group, context, kind, signature, cost_ns, exec),
            Msg::Dispatched {
                group,
                context,
                kind,
                signature,
            } => self.dispatched(now, conn, group, context, kind, signature),
            Msg::Completed {
                group,
                start,
                finish,
            } => self.completed(now, conn, group, start, finish),
            Msg::Cancel { group } => self.cancel(now, conn, group),
            Msg::Memory { used, limit } => {
                let vm = self
                    .attached(conn)
                    .ok_or(ProtoError::HelloRequired(proto::Kind::Memory))?;
                vm.memory = Some((used, limit));
                Ok(())
            }
            Msg::Frame => {
                let v = self.vgpu_of(conn)?;
                self.feed(now, Event::Frame(v))
            }
            Msg::Bye => {
                info!("{conn} said Bye");
                self.teardown(now, conn);
                Ok(())
            }
            // The session refuses daemon-to-device messages before this point.
            other => Err(ProtoError::WrongDirection(other.kind()).into()),
        }
    }

    fn vgpu_of(&self, conn: ConnId) -> Result<VgpuId, DaemonError> {
        self.conns
            .get(&conn)
            .and_then(|c| c.vm.as_ref())
            .map(|vm| vm.vgpu)
            .ok_or(ProtoError::HelloRequired(proto::Kind::Frame).into())
    }

    fn hello(
        &mut self,
        now: Time,
        conn: ConnId,
        peer: Peer,
        name: VmName,
        device_pid: u32,
        qemu_pid: u32,
    ) -> Result<(), DaemonError> {
        if peer.pid != 0 && peer.pid != device_pid {
            return Err(DaemonError::PidMismatch {
                said: device_pid,
                peer: peer.pid,
            });
        }
        let name = name.as_str().to_owned();
        if self
            .reserved
            .get(&name)
            .is_some_and(|&pid| pid != peer.pid || peer.pid == 0)
            || self.owners.get(&name).is_some_and(|&uid| uid != peer.uid)
        {
            return Err(DaemonError::NameForbidden(name));
        }
        if self.live_conn(&name).is_some() {
            return Err(DaemonError::NameInUse(name));
        }
        if let Some(&(until, _)) = self.backoff.get(&name)
            && until > now
        {
            let left_ms = (until - now) / vgpu_scheduler::model::NS_PER_MS;
            return Err(DaemonError::Backoff { name, left_ms });
        }
        self.bind_name(&name, peer.uid);
        let mut params = self
            .stored
            .get(&name)
            .cloned()
            .unwrap_or_else(|| VgpuParams::named(&name));
        params.name.clone_from(&name);
        let mut out = Vec::new();
        let vgpu = self.sched.add_vgpu(now, params, &mut out)?;
        info!("VM {name} ({conn}, pid {device_pid}, qemu {qemu_pid}) is {vgpu:?}");
        let start = Snapshot {
            at: now,
            ..Snapshot::default()
        };
        if let Some(c) = self.conns.get_mut(&conn) {
            c.vm = Some(Attached {
                name,
                vgpu,
                device_pid,
                qemu_pid,
                revoked_at: None,
                groups: BTreeMap::new(),
                snapshots: VecDeque::from([start]),
                latency: Histogram::new(),
                histogram: LatencyHistogram::default(),
                recent: RecentLatency::new(),
                memory: None,
                connected_at: now,
            });
        }
        self.by_vgpu.insert(vgpu, conn);
        self.out.messages.push((
            conn,
            Msg::Welcome {
                version: PROTOCOL_VERSION,
                vgpu,
            },
        ));
        self.carry_out(now, out);
        Ok(())
    }

    /// Binds `name` to `uid` if it is not bound yet (see [`MAX_BOUND_NAMES`]).
    fn bind_name(&mut self, name: &str, uid: u32) {
        if self.owners.contains_key(name) {
            return;
        }
        if self.owners.len() >= MAX_BOUND_NAMES {
            let idle = self
                .owners
                .keys()
                .find(|n| self.live_conn(n).is_none())
                .cloned();
            match idle {
                Some(n) => {
                    self.owners.remove(&n);
                }
                None => return,
            }
        }
        self.owners.insert(name.to_owned(), uid);
    }

    /// Reserves VM `name` for the device process `pid` the daemon created: until
    /// [`Daemon::release_name`], a `Hello` for it from another process is refused.
    pub fn reserve_name(&mut self, name: &str, pid: u32) {
        self.reserved.insert(name.to_owned(), pid);
    }

    /// Ends the reservation of `name` for `pid` (its process exited); another reservation of
    /// the name is kept.
    pub fn release_name(&mut self, name: &str, pid: u32) {
        if self.reserved.get(name) == Some(&pid) {
            self.reserved.remove(name);
        }
    }

    /// Checks that a new group may be tracked for the device and returns its vGPU.
    fn new_group(&mut self, conn: ConnId, group: GroupId) -> Result<VgpuId, DaemonError> {
        let vm = self
            .attached(conn)
            .ok_or(ProtoError::HelloRequired(proto::Kind::Submit))?;
        if vm.groups.contains_key(&group) {
            return Err(DaemonError::DuplicateGroup(group));
        }
        if vm.groups.len() >= MAX_GROUPS_PER_DEVICE {
            return Err(DaemonError::QueueFull);
        }
        Ok(vm.vgpu)
    }

    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        now: Time,
        conn: ConnId,
        group: GroupId,
        context: u32,
        kind: GroupKind,
        signature: CostSignature,
        cost: Nanos,
        exec: Exec,
    ) -> Result<(), DaemonError> {
        let vgpu = self.new_group(conn, group)?;
        if exec == Exec::Simulated && !(1..=MAX_SIMULATED_COST_NS).contains(&cost) {
            return Err(DaemonError::BadCost(cost));
        }
        self.last_submit = Some(now);
        if let Some(vm) = self.attached(conn) {
            vm.groups.insert(
                group,
                Group {
                    exec,
                    stage: Stage::Queued,
                    context,
                    cost,
                    submitted: now,
                    deadline: None,
                },
            );
        }
        let g = CommandGroup {
            id: group,
            vgpu,
            context,
            kind,
            signature,
        };
        self.feed(now, Event::Submitted(g))
    }

    fn dispatched(
        &mut self,
        now: Time,
        conn: ConnId,
        group: GroupId,
        context: u32,
        kind: GroupKind,
        signature: CostSignature,
    ) -> Result<(), DaemonError> {
        let vgpu = self.new_group(conn, group)?;
        let leased = self.sched.vgpu(vgpu).is_some_and(|s| s.lease().is_some());
        let revoked_at = self.attached(conn).and_then(|vm| vm.revoked_at);
        let in_grace = revoked_at.is_some_and(|t| now <= t.saturating_add(DISPATCH_GRACE_NS));
        if !leased && !in_grace {
            return Err(DaemonError::NotLeased(group));
        }
        let deadline = now.saturating_add(self.group_timeout());
        if let Some(vm) = self.attached(conn) {
            vm.groups.insert(
                group,
                Group {
                    exec: Exec::Device,
                    stage: Stage::InFlight,
                    context,
                    cost: 0,
                    submitted: now,
                    deadline: Some(deadline),
                },
            );
        }
        self.expiry.insert((deadline, conn, group));
        let g = CommandGroup {
            id: group,
            vgpu,
            context,
            kind,
            signature,
        };
        self.feed(now, Event::Dispatched(g))
    }

    fn completed(
        &mut self,
        now: Time,
        conn: ConnId,
        group: GroupId,
        start: Time,
        finish: Time,
    ) -> Result<(), DaemonError> {
        let vm = self
            .attached(conn)
            .ok_or(ProtoError::HelloRequired(proto::Kind::Completed))?;
        let g = *vm
            .groups
            .get(&group)
            .ok_or(DaemonError::UnknownGroup(group))?;
        if g.exec != Exec::Device {
            return Err(DaemonError::NotDeviceGroup(group));
        }
        if g.stage != Stage::InFlight {
            return Err(DaemonError::NotGranted(group));
        }
        if finish > now {
            return Err(DaemonError::FinishInFuture { group, finish, now });
        }
        let vgpu = vm.vgpu;
        vm.groups.remove(&group);
        if let Some(t) = g.deadline {
            self.expiry.remove(&(t, conn, group));
        }
        let Some(vm) = self.attached(conn) else {
            return Ok(());
        };
        vm.record_latency(finish.saturating_sub(g.submitted));
        self.feed(
            now,
            Event::Completed {
                vgpu,
                group,
                start,
                finish,
            },
        )
    }

    /// The device withdrew a group (its guest reset the device): it leaves the queue or the
    /// GPU-online list. A cancel of a group the daemon no longer tracks crossed its `Done` or
    /// the device's own `Completed` on the way and is ignored.
    fn cancel(&mut self, now: Time, conn: ConnId, group: GroupId) -> Result<(), DaemonError> {
        let vm = self
            .attached(conn)
            .ok_or(ProtoError::HelloRequired(proto::Kind::Cancel))?;
        let vgpu = vm.vgpu;
        let Some(g) = vm.groups.remove(&group) else {
            debug!("{conn}: cancel of {group:?}, which is no longer tracked, ignored");
            return Ok(());
        };
        if let Some(t) = g.deadline {
            self.expiry.remove(&(t, conn, group));
        }
        debug!("{conn}: {group:?} cancelled");
        self.feed(now, Event::Cancelled { vgpu, group })
    }

    /// Feeds one event to the scheduler and carries out its decisions.
    fn feed(&mut self, now: Time, event: Event) -> Result<(), DaemonError> {
        let mut out = Vec::new();
        self.sched.handle(now, event, &mut out)?;
        self.carry_out(now, out);
        Ok(())
    }

    /// Carries out the scheduler's decisions: messages to devices, engine jobs, weight hints.
    fn carry_out(&mut self, now: Time, decisions: Vec<Decision>) {
        for d in decisions {
            let vgpu = match d {
                Decision::Dispatch { vgpu, .. }
                | Decision::Lease { vgpu, .. }
                | Decision::Revoke { vgpu }
                | Decision::Suspend { vgpu }
                | Decision::Resume { vgpu }
                | Decision::Present { vgpu, .. }
                | Decision::CpuWeight { vgpu, .. } => vgpu,
            };
            let Some(&conn) = self.by_vgpu.get(&vgpu) else {
                debug!("{d:?} for a vGPU without a connection dropped");
                continue;
            };
            match d {
                Decision::Dispatch { group, .. } => self.dispatch(now, conn, vgpu, group),
                Decision::CpuWeight { weight, .. } => {
                    if self.config.cpu_writeback
                        && let Some(vm) = self.attached(conn)
                    {
                        let hint = WeightHint {
                            vm: vm.name.clone(),
                            qemu_pid: vm.qemu_pid,
                            weight,
                        };
                        self.out.weights.push(hint);
                    }
                }
                _ => {
                    if let Decision::Revoke { .. } = d
                        && let Some(vm) = self.attached(conn)
                    {
                        vm.revoked_at = Some(now);
                    }
                    if let Some((_, msg)) = Msg::from_decision(&d) {
                        self.out.messages.push((conn, msg));
                    }
                }
            }
        }
    }

    /// A dispatch: a device group is granted, a simulated one goes onto the engine.
    fn dispatch(&mut self, now: Time, conn: ConnId, vgpu: VgpuId, group: GroupId) {
        let deadline = now.saturating_add(self.group_timeout());
        let Some(vm) = self.attached(conn) else {
            return;
        };
        let Some(g) = vm.groups.get_mut(&group) else {
            warn!("{conn}: dispatch of untracked {group:?}");
            return;
        };
        g.stage = Stage::InFlight;
        if g.exec == Exec::Device {
            g.deadline = Some(deadline);
        }
        let g = *g;
        match g.exec {
            Exec::Device => {
                if let Some(t) = g.deadline {
                    self.expiry.insert((t, conn, group));
                }
                self.out.messages.push((conn, Msg::Grant { group }));
            }
            Exec::Simulated => {
                self.engine.push(Job {
                    owner: conn.0,
                    vgpu,
                    group,
                    context: g.context,
                    cost: g.cost,
                    submitted: g.submitted,
                });
                self.kick(now);
            }
        }
    }

    fn kick(&mut self, now: Time) {
        if let Some(finish) = self.engine.kick(now) {
            self.engine_due = Some(finish);
        }
    }

    /// True while a device may be waiting for an answer soon at `now`: some vGPU asks for its
    /// grants, the engine runs a group whose `Done` a device waits for, or a `Submit` came
    /// within [`SUBMIT_RECENT_NS`] (load groups are submitted even under a lease). When every
    /// device dispatches under a lease (or is suspended), the engine is idle and nobody asked
    /// lately, the event loop need not spin for the next packet.
    pub fn answers_awaited(&self, now: Time) -> bool {
        self.sched.may_ask()
            || self.engine_due.is_some()
            || self
                .last_submit
                .is_some_and(|t| now.saturating_sub(t) < SUBMIT_RECENT_NS)
    }

    /// When [`Daemon::timer`] must be called next.
    pub fn next_deadline(&self) -> Option<Time> {
        [
            self.engine_due,
            self.sched.next_deadline(),
            Some(self.next_snapshot),
            self.expiry.first().map(|&(t, _, _)| t),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Time passed: engine jobs finish, scheduler timers fire, statistics are snapshotted, in
    /// time order, up to `now`.
    pub fn timer(&mut self, now: Time) {
        let now = self.clock(now);
        for _ in 0..MAX_TIMER_STEPS {
            let Some(due) = self.next_deadline().filter(|&t| t <= now) else {
                return;
            };
            let at = due.max(self.sched.now());
            if self.engine_due == Some(due) {
                self.engine_done(at);
            } else if self.next_snapshot == due {
                self.snapshot(at);
            } else if let Some(&(t, conn, group)) = self.expiry.first()
                && t == due
            {
                self.time_out(at, (t, conn, group));
            } else if let Err(e) = self.feed(at, Event::Timer) {
                warn!("scheduler timer at {at}: {e}");
                return;
            }
        }
        warn!("timer: {MAX_TIMER_STEPS} steps at {now}; the rest is left to the next call");
    }

    /// The device's oldest group in flight timed out at `at`: the device is dropped.
    fn time_out(&mut self, at: Time, entry: (Time, ConnId, GroupId)) {
        let (_, conn, group) = entry;
        let e = DaemonError::GroupTimeout {
            group,
            timeout_ms: self.group_timeout() / vgpu_scheduler::model::NS_PER_MS,
        };
        let name = self
            .attached(conn)
            .map_or_else(String::new, |vm| vm.name.clone());
        let wait = self.hold_back(at, &name);
        warn!(
            "VM {name} ({conn}): {e}: device dropped, its groups written off; it may connect again in {} ms",
            wait / vgpu_scheduler::model::NS_PER_MS
        );
        self.refuse(conn, &e);
        // Teardown removes every expiry entry of the connection, this one included.
        self.teardown(at, conn);
        self.expiry.remove(&entry);
    }

    /// Keeps `name` from connecting again for a while after its device was dropped for a
    /// group timeout or a protocol violation (see [`MAX_REJOIN_BACKOFF_NS`]); returns the wait.
    fn hold_back(&mut self, at: Time, name: &str) -> Nanos {
        let strikes = self.backoff.get(name).map_or(0, |&(_, n)| n);
        let wait = self
            .group_timeout()
            .saturating_mul(1 << strikes.min(16))
            .min(MAX_REJOIN_BACKOFF_NS);
        if self.backoff.len() >= MAX_BOUND_NAMES && !self.backoff.contains_key(name) {
            // Full: forget the entry that expires first.
            let first = self.backoff.iter().min_by_key(|(_, until)| until.0);
            if let Some(old) = first.map(|(n, _)| n.clone()) {
                self.backoff.remove(&old);
            }
        }
        self.backoff.insert(
            name.to_owned(),
            (at.saturating_add(wait), strikes.saturating_add(1)),
        );
        wait
    }

    /// The group timeout in force.
    fn group_timeout(&self) -> Nanos {
        self.config.group_timeout_ns.clamp(1, MAX_GROUP_TIMEOUT_NS)
    }

    /// The engine's running job finished at `at`.
    fn engine_done(&mut self, at: Time) {
        self.engine_due = None;
        if let Some((job, start, finish)) = self.engine.finish() {
            let conn = ConnId(job.owner);
            let live = self
                .attached(conn)
                .and_then(|vm| vm.groups.remove(&job.group).map(|g| (vm, g)));
            match live {
                Some((vm, g)) => {
                    vm.record_latency(finish.saturating_sub(g.submitted));
                    let group = job.group;
                    self.out.messages.push((
                        conn,
                        Msg::Done {
                            group,
                            start,
                            finish,
                        },
                    ));
                    let done = Event::Completed {
                        vgpu: job.vgpu,
                        group,
                        start,
                        finish,
                    };
                    if let Err(e) = self.feed(at, done) {
                        warn!("{conn}: engine completion of {group:?}: {e}");
                    }
                }
                None => debug!(
                    "{conn}: engine job {:?} of a closed device dropped",
                    job.group
                ),
            }
        }
        self.kick(at);
    }

    fn snapshot(&mut self, at: Time) {
        self.next_snapshot = at.saturating_add(STATS_INTERVAL_NS);
        for c in self.conns.values_mut() {
            let Some(vm) = c.vm.as_mut() else { continue };
            let Some(a) = self.sched.vgpu(vm.vgpu).map(|s| s.account()) else {
                continue;
            };
            vm.snapshots.push_back(Snapshot {
                at,
                completed: a.completed,
                gpu_time: a.gpu_time,
                frames: a.frames,
            });
            while vm.snapshots.len() > STATS_WINDOW_SNAPSHOTS {
                vm.snapshots.pop_front();
            }
            vm.recent.tick();
        }
    }

    /// The live connection of VM `name`, if any.
    fn live_conn(&self, name: &str) -> Option<ConnId> {
        self.conns
            .iter()
            .find(|(_, c)| c.vm.as_ref().is_some_and(|vm| vm.name == name))
            .map(|(&id, _)| id)
    }

    fn live_vgpu(&self, name: &str) -> Result<VgpuId, DaemonError> {
        self.live_conn(name)
            .and_then(|id| self.conns.get(&id))
            .and_then(|c| c.vm.as_ref())
            .map(|vm| vm.vgpu)
            .ok_or_else(|| DaemonError::UnknownVm(name.to_owned()))
    }

    /// A CPU sample for VM `name` from the I/O layer's cgroup probe.
    pub fn cpu_hint(&mut self, now: Time, name: &str, hint: CpuHint) -> Result<(), DaemonError> {
        let now = self.advance(now);
        let v = self.live_vgpu(name)?;
        self.feed(now, Event::CpuHint(v, hint))
    }

    /// Every VM that is connected or has stored parameters, by name.
    pub fn list(&self) -> Vec<VmInfo> {
        let mut vms: BTreeMap<String, VmInfo> = self
            .stored
            .iter()
            .map(|(name, p)| {
                let info = VmInfo {
                    name: name.clone(),
                    connected: false,
                    vgpu: None,
                    conn: None,
                    device_pid: None,
                    qemu_pid: None,
                    uid: None,
                    params: p.clone(),
                    effective: None,
                };
                (name.clone(), info)
            })
            .collect();
        for (&id, c) in &self.conns {
            let Some(vm) = &c.vm else { continue };
            let params = self
                .sched
                .vgpu(vm.vgpu)
                .map(|s| s.params().clone())
                .unwrap_or_else(|| VgpuParams::named(&vm.name));
            let info = VmInfo {
                name: vm.name.clone(),
                connected: true,
                vgpu: Some(vm.vgpu),
                conn: Some(id),
                device_pid: Some(vm.device_pid),
                qemu_pid: Some(vm.qemu_pid),
                uid: Some(c.peer.uid),
                params,
                effective: self.sched.effective_params(vm.vgpu),
            };
            vms.insert(vm.name.clone(), info);
        }
        vms.into_values().collect()
    }

    /// Live statistics at `now` (rates over the last [`STATS_WINDOW_SNAPSHOTS`] intervals).
    pub fn stats(&self, now: Time) -> Stats {
        let now = now.max(self.now);
        let mut vms: BTreeMap<String, VmStats> = self
            .stored
            .keys()
            .map(|name| (name.clone(), idle_stats(name)))
            .collect();
        for c in self.conns.values() {
            let Some(vm) = &c.vm else { continue };
            let Some(s) = self.sched.vgpu(vm.vgpu) else {
                continue;
            };
            let a = s.account();
            let base = vm.snapshots.front().copied().unwrap_or_default();
            let span = now.saturating_sub(base.at) as f64 / 1e9;
            let rate = |d: f64| if span > 0.0 { d / span } else { 0.0 };
            let stats = VmStats {
                name: vm.name.clone(),
                vgpu: Some(vm.vgpu),
                connected: true,
                gpu_share: rate(a.gpu_time.saturating_sub(base.gpu_time) as f64 / 1e9),
                groups_per_sec: rate(a.completed.saturating_sub(base.completed) as f64),
                fps: rate(a.frames.saturating_sub(base.frames) as f64),
                queue_depth: s.queued(),
                in_flight: s.in_flight(),
                latency_p50_us: vm.latency.quantile(0.5),
                latency_p99_us: vm.latency.quantile(0.99),
                recent_latency_p50_us: vm.recent.quantile(0.5),
                recent_latency_p99_us: vm.recent.quantile(0.99),
                latency: vm.histogram.clone(),
                submitted: a.submitted,
                dispatched: a.dispatched,
                completed: a.completed,
                cancelled: a.cancelled,
                gpu_time_ns: a.gpu_time,
                frames: a.frames,
                budget: self.sched.budget(vm.vgpu, now),
                figures: self.sched.figures(vm.vgpu).into_iter().collect(),
                memory_used_bytes: vm.memory.map(|m| m.0),
                memory_limit_bytes: vm.memory.map(|m| m.1),
                device_pid: Some(vm.device_pid),
                qemu_pid: Some(vm.qemu_pid),
                uptime_ns: Some(now.saturating_sub(vm.connected_at)),
            };
            vms.insert(vm.name.clone(), stats);
        }
        let elapsed = now.saturating_sub(self.started);
        let busy = self.engine.busy_until(now).min(elapsed);
        Stats {
            now,
            policy: self.sched.policy_name(),
            engine_busy: if elapsed == 0 {
                0.0
            } else {
                busy as f64 / elapsed as f64
            },
            engine_busy_ns: busy,
            engine_switches: self.engine.switches,
            vms: vms.into_values().collect(),
        }
    }

    /// The running policy's configuration.
    pub fn policy(&self) -> &PolicyConfig {
        &self.policy
    }

    /// Installs another policy; queued groups, groups in flight and accounting are kept.
    pub fn set_policy(&mut self, now: Time, policy: PolicyConfig) -> Result<(), DaemonError> {
        check_policy(&policy)?;
        let now = self.advance(now);
        let mut out = Vec::new();
        self.sched.set_policy(now, policy.build(), &mut out);
        info!("policy is now {}", self.sched.policy_name());
        self.policy = policy;
        self.carry_out(now, out);
        Ok(())
    }

    /// Changes VM `name`'s parameters (the fields `change` sets); they are stored for the name
    /// and apply at once when it is connected, or when it connects. Returns the new parameters.
    pub fn set_params(
        &mut self,
        now: Time,
        name: &str,
        change: &ParamsOverride,
    ) -> Result<VgpuParams, DaemonError> {
        let name = VmName::new(name).map_err(DaemonError::BadName)?;
        let name = name.as_str();
        let now = self.advance(now);
        let live = self.live_vgpu(name).ok();
        let mut params = match live.and_then(|v| self.sched.vgpu(v)) {
            Some(s) => s.params().clone(),
            None => self
                .stored
                .get(name)
                .cloned()
                .unwrap_or_else(|| VgpuParams::named(name)),
        };
        change.apply(&mut params);
        vgpu_scheduler::core::check_params(&params)?;
        if !self.stored.contains_key(name) && self.stored.len() >= MAX_STORED_VMS {
            return Err(DaemonError::TooManyVms);
        }
        if let Some(v) = live {
            let event = Event::Config(vgpu_scheduler::ConfigChange::Params(v, params.clone()));
            self.feed(now, event)?;
        }
        self.stored.insert(name.to_owned(), params.clone());
        Ok(params)
    }

    /// Whether VM `name` is connected, has stored parameters or a device process the daemon
    /// created: a name the control interface may set parameters of without a definition.
    pub fn knows(&self, name: &str) -> bool {
        self.live_conn(name).is_some()
            || self.stored.contains_key(name)
            || self.reserved.contains_key(name)
    }

    /// The stored parameters of every VM that has them, by name (what the server keeps across
    /// a restart of the daemon).
    pub fn stored_params(&self) -> &BTreeMap<String, VgpuParams> {
        &self.stored
    }

    /// Stores `params` for VM `name` as a `set-params` before the restart of the daemon left
    /// them; checked as `set-params` checks them. They apply when the VM connects.
    pub fn restore_params(&mut self, name: &str, params: VgpuParams) -> Result<(), DaemonError> {
        VmName::new(name).map_err(DaemonError::BadName)?;
        vgpu_scheduler::core::check_params(&params)?;
        if !self.stored.contains_key(name) && self.stored.len() >= MAX_STORED_VMS {
            return Err(DaemonError::TooManyVms);
        }
        let mut params = params;
        params.name = name.to_owned();
        self.stored.insert(name.to_owned(), params);
        Ok(())
    }

    /// Drops the stored parameters of VM `name`, which must not be connected or have a device
    /// process; afterwards the daemon does not know it (unless it is defined).
    pub fn forget(&mut self, name: &str) -> Result<(), DaemonError> {
        if self.live_conn(name).is_some() || self.reserved.contains_key(name) {
            return Err(DaemonError::Running(name.to_owned()));
        }
        if self.stored.remove(name).is_none() {
            return Err(DaemonError::NotKnown {
                name: name.to_owned(),
                known: self.list().into_iter().map(|vm| vm.name).collect(),
            });
        }
        info!("VM {name}: stored parameters forgotten");
        Ok(())
    }

    /// The user looks at VM `name`'s console.
    pub fn focus(&mut self, now: Time, name: &str) -> Result<(), DaemonError> {
        let now = self.advance(now);
        let v = self.live_vgpu(name)?;
        self.feed(now, Event::Config(vgpu_scheduler::ConfigChange::Focus(v)))
    }
}

fn idle_stats(name: &str) -> VmStats {
    VmStats {
        name: name.to_owned(),
        vgpu: None,
        connected: false,
        gpu_share: 0.0,
        groups_per_sec: 0.0,
        fps: 0.0,
        queue_depth: 0,
        in_flight: 0,
        latency_p50_us: 0,
        latency_p99_us: 0,
        recent_latency_p50_us: 0,
        recent_latency_p99_us: 0,
        latency: LatencyHistogram::default(),
        submitted: 0,
        dispatched: 0,
        completed: 0,
        cancelled: 0,
        gpu_time_ns: 0,
        frames: 0,
        budget: None,
        figures: BTreeMap::new(),
        memory_used_bytes: None,
        memory_limit_bytes: None,
        device_pid: None,
        qemu_pid: None,
        uptime_ns: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_ordered_and_quantiles_bounded() {
        let mut prev = 0;
        for i in 1..HIST_BUCKETS {
            let lo = Histogram::lower(i);
            assert!(lo > prev, "bucket {i}");
            assert_eq!(Histogram::index(lo), i);
            assert_eq!(Histogram::index(lo - 1), i - 1);
            prev = lo;
        }
        assert_eq!(Histogram::index(u64::MAX), HIST_BUCKETS - 1);
        let mut h = Histogram::new();
        assert_eq!(h.quantile(0.5), 0);
        for us in 1..=1000 {
            h.record(us);
        }
        h.record(u64::MAX);
        let p50 = h.quantile(0.5);
        assert!((440..=500).contains(&p50), "{p50}");
        assert!(h.quantile(1.0) >= 1 << 63);
    }

    #[test]
    fn recent_latency_forgets_windows_older_than_two() {
        let mut r = RecentLatency::new();
        assert_eq!(r.quantile(0.5), 0);
        for _ in 0..100 {
            r.record(5000);
        }
        // Still counted while its window is the current or the previous one.
        for _ in 0..STATS_WINDOW_SNAPSHOTS {
            r.tick();
        }
        r.record(10);
        assert!(r.quantile(0.5) >= 4096, "{}", r.quantile(0.5));
        assert_eq!(r.quantile(0.001), 10);
        // Two windows later only the recent group is left.
        for _ in 0..STATS_WINDOW_SNAPSHOTS {
            r.tick();
        }
        assert_eq!((r.quantile(0.5), r.quantile(0.99)), (10, 10));
        for _ in 0..STATS_WINDOW_SNAPSHOTS {
            r.tick();
        }
        assert_eq!(r.quantile(0.99), 0);
    }

    #[test]
    fn refuse_codes_follow_the_error() {
        let g = GroupId(1);
        assert_eq!(
            DaemonError::from(SchedError::QueueFull(VgpuId(0))).refuse_code(),
            RefuseCode::QueueFull
        );
        assert_eq!(
            DaemonError::NotGranted(g).refuse_code(),
            RefuseCode::OutOfOrder
        );
        assert_eq!(
            DaemonError::NameInUse("a".into()).refuse_code(),
            RefuseCode::NameInUse
        );
        assert_eq!(
            DaemonError::BadCost(0).refuse_code(),
            RefuseCode::BadMessage
        );
    }
}
