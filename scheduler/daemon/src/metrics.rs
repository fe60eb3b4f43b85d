//! The daemon's Prometheus metrics (`GET /metrics`, docs/METRICS.md).
//!
//! Each scrape takes a [`Stats`] snapshot and encodes it with the `prometheus-client` crate: a
//! [`Registry`] holding one [`Collector`] that owns the snapshot, encoded in the Prometheus text
//! format 0.0.4 (the format `promtool check metrics` lints; its content type is
//! [`CONTENT_TYPE`]). Names follow Prometheus' rules: base units (seconds, ratios 0..1),
//! counters ending in `_total` (the encoder appends it), one label set per VM (`vm="NAME"`),
//! `_info` gauges for the build and the running policy.
//!
//! Submit-to-finish latency is a histogram (`vgpu_group_latency_seconds`, fixed buckets
//! [`LATENCY_BOUNDS_NS`], counted by the core in a [`LatencyHistogram`] per VM), so PromQL's
//! `histogram_quantile` works over any range and across VMs. The I/O layer adds what the core
//! does not know ([`Context`]): the daemon process's own figures (the usual `process_*`
//! families, read from `/proc/self` by [`ProcessStats::read`]) and where each VM runs (its
//! QEMU's cgroup, its device's socket, its vGPU type, as `vgpu_vm_info` labels).
//!
//! The policy figures (`Scheduler::figures`) come as `name → f64` pairs in the policy's own
//! units (`vtime_ms`, `budget_ns`, ...); [`FIGURES`] gives each of them a family of its own in
//! base units, named after the policy family. A figure the table does not know is left out (and
//! logged at debug level); the tests run every policy family and check that none is.

use std::collections::BTreeMap;
use std::path::PathBuf;

use log::debug;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, MetricEncoder, NoLabelSet, prometheus_text,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::daemon::{Stats, VmStats};

/// The `Content-Type` of the `/metrics` answer: the Prometheus text format, version 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Nanoseconds per second (dividing by it rounds once, unlike multiplying by 1e-9).
const NS: f64 = 1e9;
/// Microseconds per second.
const US: f64 = 1e6;
/// Milliseconds per second.
const MS: f64 = 1e3;
/// A figure that is already in its family's unit.
const SAME: f64 = 1.0;

/// The (empty) label set of a daemon-wide sample.
const NO_LABELS: [(&str, &str); 0] = [];

/// The labels of a per-VM sample.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct VmLabels {
    vm: String,
}

/// The labels of `vgpu_vm_info`: a connected VM, its vGPU id and where it runs (empty where
/// the daemon does not know).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct VgpuLabels {
    vm: String,
    vgpu: String,
    /// The QEMU pid its device announced and proved.
    qemu_pid: String,
    /// Its QEMU's cgroup directory.
    cgroup: String,
    /// The vfio-user socket its device process serves.
    socket: String,
    /// The vGPU type it was defined from.
    r#type: String,
}

/// Upper bounds of the latency histogram's buckets, ns (`le` in seconds): from 100 µs (a short
/// compute group) to 10 s (five times the default group timeout); the `+Inf` bucket holds the
/// rest. Fixed and the same for every VM and daemon, so buckets add up across them in PromQL.
pub const LATENCY_BOUNDS_NS: [u64; 16] = [
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Latencies as a Prometheus histogram: how many fell in each bucket of
/// [`LATENCY_BOUNDS_NS`] (a latency equal to a bound counts in that bound's bucket) and past
/// the last, how many in all and their sum. Fixed size: a VM's count costs the same however
/// many groups it runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LatencyHistogram {
    /// Latencies per bucket (not cumulative); the last is past every bound (`+Inf`).
    buckets: [u64; LATENCY_BOUNDS_NS.len() + 1],
    count: u64,
    /// Their sum, ns (saturating: 584 years).
    sum_ns: u64,
}

impl LatencyHistogram {
    /// Counts one latency of `ns`.
    pub fn record(&mut self, ns: u64) {
        let i = LATENCY_BOUNDS_NS.partition_point(|&bound| bound < ns);
        if let Some(b) = self.buckets.get_mut(i) {
            *b = b.saturating_add(1);
        }
        self.count = self.count.saturating_add(1);
        self.sum_ns = self.sum_ns.saturating_add(ns);
    }

    /// How many latencies were counted.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The buckets as the encoder takes them: (upper bound in seconds, latencies in the
    /// bucket), the last bound infinite.
    fn buckets(&self) -> Vec<(f64, u64)> {
        LATENCY_BOUNDS_NS
            .iter()
            .map(|&ns| ns as f64 / NS)
            .chain([f64::INFINITY])
            .zip(self.buckets.iter().copied())
            .collect()
    }
}

/// The daemon process's own figures, as `/proc/self` gives them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessStats {
    /// User and system CPU time, seconds.
    pub cpu_seconds: f64,
    /// Resident memory, bytes.
    pub resident_bytes: u64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// When the process started, seconds since the Unix epoch.
    pub start_time_seconds: f64,
}

/// Fields of `/proc/self/stat` after the command name, counted from 0 at the state (field 3
/// of proc(5)).
const STAT_UTIME: usize = 11;
/// `stime` (field 15).
const STAT_STIME: usize = 12;
/// `starttime` (field 22): clock ticks after boot.
const STAT_STARTTIME: usize = 19;
/// `rss` (field 24): pages.
const STAT_RSS: usize = 21;

impl ProcessStats {
    /// The figures from the text of `/proc/self/stat` (`stat`) and of `/proc/stat`
    /// (`system`, for the boot time `btime`), with `open_fds` counted in `/proc/self/fd`, the
    /// kernel's clock ticks per second and its page size. `None` when a field is missing or
    /// not a number. The command name may hold spaces and parentheses: the fields start after
    /// its last `)`.
    pub fn parse(
        stat: &str,
        system: &str,
        open_fds: u64,
        ticks_per_second: u64,
        page_size: u64,
    ) -> Option<ProcessStats> {
        let (_, rest) = stat.rsplit_once(')')?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |i: usize| fields.get(i)?.parse::<u64>().ok();
        let boot: u64 = system
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        if ticks_per_second == 0 {
            return None;
        }
        let ticks = ticks_per_second as f64;
        let cpu = field(STAT_UTIME)?.checked_add(field(STAT_STIME)?)?;
        Some(ProcessStats {
            cpu_seconds: cpu as f64 / ticks,
            resident_bytes: field(STAT_RSS)?.checked_mul(page_size)?,
            open_fds,
            start_time_seconds: boot as f64 + field(STAT_STARTTIME)? as f64 / ticks,
        })
    }

    /// Reads the daemon's own figures ([`ProcessStats::parse`]).
    pub fn read() -> std::io::Result<ProcessStats> {
        let stat = std::fs::read_to_string("/proc/self/stat")?;
        let system = std::fs::read_to_string("/proc/stat")?;
        let open_fds = std::fs::read_dir("/proc/self/fd")?.count() as u64;
        let ticks = rustix::param::clock_ticks_per_second();
        let page = rustix::param::page_size() as u64;
        ProcessStats::parse(&stat, &system, open_fds, ticks, page).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, "unexpected /proc text")
        })
    }
}

/// Where a VM runs, as the daemon's I/O layer knows it: the extra labels of `vgpu_vm_info`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VmPlace {
    /// Its QEMU's cgroup directory (once the daemon probed it).
    pub cgroup: Option<PathBuf>,
    /// The vfio-user socket its device process serves (created by the daemon, or defined).
    pub socket: Option<PathBuf>,
    /// The vGPU type it was defined from.
    pub vgpu_type: Option<String>,
}

/// What a scrape adds to the core's statistics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Context {
    /// The daemon process's figures; `None` leaves the `process_*` families out.
    pub process: Option<ProcessStats>,
    /// Per VM name, where it runs.
    pub places: BTreeMap<String, VmPlace>,
}

/// The labels of `vgpu_build_info`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

/// The labels of `vgpu_policy_info`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PolicyLabels {
    policy: String,
}

/// A sample's value: counts are encoded as integers, the rest as floats.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Value {
    Count(u64),
    Real(f64),
}

impl Value {
    /// Encodes the value as a sample of a family of type `kind` (a counter or a gauge).
    fn encode(self, kind: MetricType, mut e: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        match (kind, self) {
            (MetricType::Counter, Value::Count(v)) => {
                e.encode_counter::<NoLabelSet, _, f64>(&v, None)
            }
            (MetricType::Counter, Value::Real(v)) => {
                e.encode_counter::<NoLabelSet, _, f64>(&v, None)
            }
            (_, Value::Count(v)) => e.encode_gauge(&v),
            (_, Value::Real(v)) => e.encode_gauge(&v),
        }
    }
}

/// `ns` in seconds.
fn seconds(ns: u64) -> Value {
    Value::Real(ns as f64 / NS)
}

/// A family with one sample per VM.
#[derive(Debug)]
struct VmFamily {
    /// Its name; a counter's without the `_total` the encoder appends.
    name: &'static str,
    help: &'static str,
    /// [`MetricType::Counter`] or [`MetricType::Gauge`].
    kind: MetricType,
    /// A VM's sample; `None` where the VM has none.
    value: fn(&VmStats) -> Option<Value>,
}

/// The per-VM families every policy has, in the order they are encoded.
const VM_FAMILIES: &[VmFamily] = &[
    VmFamily {
        name: "vgpu_connected",
        help: "1 while a device process is connected for the VM, 0 while it is away.",
        kind: MetricType::Gauge,
        value: |s| Some(Value::Count(u64::from(s.connected))),
    },
    VmFamily {
        name: "vgpu_groups_submitted",
        help: "Command groups the VM's device submitted for a grant since it connected.",
        kind: MetricType::Counter,
        value: |s| Some(Value::Count(s.submitted)),
    },
    VmFamily {
        name: "vgpu_groups_dispatched",
        help: "Command groups dispatched (granted or leased) since the VM connected.",
        kind: MetricType::Counter,
        value: |s| Some(Value::Count(s.dispatched)),
    },
    VmFamily {
        name: "vgpu_groups_completed",
        help: "Command groups completed since the VM connected.",
        kind: MetricType::Counter,
        value: |s| Some(Value::Count(s.completed)),
    },
    VmFamily {
        name: "vgpu_groups_cancelled",
        help: "Command groups the VM's device cancelled (queued or in flight) since it connected.",
        kind: MetricType::Counter,
        value: |s| Some(Value::Count(s.cancelled)),
    },
    VmFamily {
        name: "vgpu_gpu_seconds",
        help: "GPU time of the VM's completed groups since it connected, in seconds.",
        kind: MetricType::Counter,
        value: |s| Some(seconds(s.gpu_time_ns)),
    },
    VmFamily {
        name: "vgpu_frames",
        help: "Frames the VM presented since it connected.",
        kind: MetricType::Counter,
        value: |s| Some(Value::Count(s.frames)),
    },
    VmFamily {
        name: "vgpu_gpu_share_ratio",
        help: "Fraction of GPU time (0..1) the VM's completed groups used over the daemon's rate window.",
        kind: MetricType::Gauge,
        value: |s| Some(Value::Real(s.gpu_share)),
    },
    VmFamily {
        name: "vgpu_groups_per_second",
        help: "Command groups completed per second over the daemon's rate window.",
        kind: MetricType::Gauge,
        value: |s| Some(Value::Real(s.groups_per_sec)),
    },
    VmFamily {
        name: "vgpu_frames_per_second",
        help: "Frames presented per second over the daemon's rate window.",
        kind: MetricType::Gauge,
        value: |s| Some(Value::Real(s.fps)),
    },
    VmFamily {
        name: "vgpu_queue_depth",
        help: "Command groups waiting in the VM's queue.",
        kind: MetricType::Gauge,
        value: |s| Some(Value::Count(s.queue_depth as u64)),
    },
    VmFamily {
        name: "vgpu_in_flight",
        help: "Command groups dispatched and not completed.",
        kind: MetricType::Gauge,
        value: |s| Some(Value::Count(s.in_flight as u64)),
    },
    VmFamily {
        name: "vgpu_group_latency_p50_seconds",
        help: "Median submit-to-finish latency of the VM's groups since it connected (histogram bucket lower bound), in seconds.",
        kind: MetricType::Gauge,
        value: |s| Some(Value::Real(s.latency_p50_us as f64 / US)),
    },
    VmFamily {
        name: "vgpu_group_latency_p99_seconds",
        help: "99th percentile submit-to-finish latency of the VM's groups since it connected (histogram bucket lower bound), in seconds.",
        kind: MetricType::Gauge,
        value: |s| Some(Value::Real(s.latency_p99_us as f64 / US)),
    },
    VmFamily {
        name: "vgpu_group_recent_latency_p50_seconds",
        help: "Median submit-to-finish latency of the VM's groups completed in the last 5 to 10 s (histogram bucket lower bound; 0 when none completed), in seconds.",
        kind: MetricType::Gauge,
        value: |s| Some(Value::Real(s.recent_latency_p50_us as f64 / US)),
    },
    VmFamily {
        name: "vgpu_group_recent_latency_p99_seconds",
        help: "99th percentile submit-to-finish latency of the VM's groups completed in the last 5 to 10 s (histogram bucket lower bound; 0 when none completed), in seconds.",
        kind: MetricType::Gauge,
        value: |s| Some(Value::Real(s.recent_latency_p99_us as f64 / US)),
    },
    VmFamily {
        name: "vgpu_budget_remaining_seconds",
        help: "GPU time the VM may still use under the policy (negative after an overrun); only for VMs the policy budgets.",
        kind: MetricType::Gauge,
        value: |s| s.budget.map(|b| Value::Real(b.remaining_ns as f64 / NS)),
    },
    VmFamily {
        name: "vgpu_budget_capacity_seconds",
        help: "The VM's full budget under the policy (what a refill brings it up to); only for VMs the policy budgets.",
        kind: MetricType::Gauge,
        value: |s| s.budget.map(|b| seconds(b.capacity_ns)),
    },
    VmFamily {
        name: "vgpu_budget_period_seconds",
        help: "How often the VM's budget is refilled; only for budgets refilled periodically.",
        kind: MetricType::Gauge,
        value: |s| s.budget.and_then(|b| b.period_ns).map(seconds),
    },
    VmFamily {
        name: "vgpu_memory_used_bytes",
        help: "Bytes of the VM's memory budget in use (its GPU memory on the compute path, its GL resources, what its requests hold), as its device last reported; only for connected VMs.",
        kind: MetricType::Gauge,
        value: |s| s.memory_used_bytes.map(Value::Count),
    },
    VmFamily {
        name: "vgpu_memory_limit_bytes",
        help: "The VM's memory budget (vgpuctl --memory-mb), as its device reported it; only for connected VMs.",
        kind: MetricType::Gauge,
        value: |s| s.memory_limit_bytes.map(Value::Count),
    },
];

/// A policy figure (`Scheduler::figures`) as a per-VM family of its own.
#[derive(Debug)]
struct Figure {
    /// The policy family whose figure it is: the policy's name or the part before its `-`
    /// (`pegasus` for `pegasus-xc`).
    policy: &'static str,
    /// The figure's key.
    key: &'static str,
    /// The family's name; a counter's without `_total`.
    name: &'static str,
    help: &'static str,
    /// [`MetricType::Counter`] or [`MetricType::Gauge`].
    kind: MetricType,
    /// What the figure is divided by to get the family's (base) unit: figures per unit.
    per_unit: f64,
}

/// Every policy figure, by policy family, in the order they are encoded.
const FIGURES: &[Figure] = &[
    Figure {
        policy: "fair",
        key: "vtime_ms",
        name: "vgpu_fair_virtual_time_seconds",
        help: "Fair queuing: the VM's virtual time (weighted GPU time charged), in seconds.",
        kind: MetricType::Gauge,
        per_unit: MS,
    },
    Figure {
        policy: "fair",
        key: "lag_ms",
        name: "vgpu_fair_lag_seconds",
        help: "Fair queuing: how far the VM's virtual time is ahead of the system virtual time, in seconds.",
        kind: MetricType::Gauge,
        per_unit: MS,
    },
    Figure {
        policy: "fair",
        key: "charged_ms",
        name: "vgpu_fair_charged_seconds",
        help: "Fair queuing: unweighted GPU time charged to the VM (exact, or estimated when sampling), in seconds.",
        kind: MetricType::Counter,
        per_unit: MS,
    },
    Figure {
        policy: "fair",
        key: "over",
        name: "vgpu_fair_over_threshold",
        help: "Fair queuing: 1 while the VM is more than the threshold ahead and held back.",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "fair",
        key: "estimate_us",
        name: "vgpu_fair_group_cost_estimate_seconds",
        help: "Fair queuing: the sampled estimate of one of the VM's groups' GPU time, in seconds.",
        kind: MetricType::Gauge,
        per_unit: US,
    },
    Figure {
        policy: "pegasus",
        key: "credits_x",
        name: "vgpu_pegasus_credits",
        help: "Pegasus: the VM's credits X (its weight or CPU weight).",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "pegasus",
        key: "credit_ns",
        name: "vgpu_pegasus_credit_balance_seconds",
        help: "Pegasus: the VM's GPU-time credit balance, refills included, in seconds.",
        kind: MetricType::Gauge,
        per_unit: NS,
    },
    Figure {
        policy: "pegasus",
        key: "aug_credit_ns",
        name: "vgpu_pegasus_augmented_credit_seconds",
        help: "Pegasus (AugC): the VM's temporary credit for this period, in seconds.",
        kind: MetricType::Gauge,
        per_unit: NS,
    },
    Figure {
        policy: "pegasus",
        key: "slice_ticks",
        name: "vgpu_pegasus_slice_ticks",
        help: "Pegasus: the length of the VM's next slice in scheduler ticks (compensation ticks included).",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "pegasus",
        key: "context_established",
        name: "vgpu_pegasus_context_established",
        help: "Pegasus: 1 while the VM's context is established (it ran and was not idle for a whole period since).",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "pegasus",
        key: "slo_violated",
        name: "vgpu_pegasus_slo_violated",
        help: "Pegasus (SLAF): 1 while the VM's SLO was violated in the last period.",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "timegraph",
        key: "priority",
        name: "vgpu_timegraph_priority",
        help: "TimeGraph: the VM's effective priority (focus and spec lines applied).",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "timegraph",
        key: "ht",
        name: "vgpu_timegraph_high_throughput",
        help: "TimeGraph: 1 while the VM is scheduled under High-Throughput (else Predictable-Response-Time).",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "timegraph",
        key: "reserved",
        name: "vgpu_timegraph_reserve_requested",
        help: "TimeGraph: 1 when the VM asked for a reserve.",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "timegraph",
        key: "admitted",
        name: "vgpu_timegraph_reserve_admitted",
        help: "TimeGraph: 1 when the VM's reserve was admitted.",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "timegraph",
        key: "background",
        name: "vgpu_timegraph_background",
        help: "TimeGraph: 1 while the VM runs in the background (no admitted reserve).",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "timegraph",
        key: "throttled",
        name: "vgpu_timegraph_throttled",
        help: "TimeGraph: 1 while the VM is out of the wait queue until its reserve is replenished.",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "timegraph",
        key: "budget_ns",
        name: "vgpu_timegraph_reserve_budget_seconds",
        help: "TimeGraph: GPU time left in the VM's reserve this period, in seconds.",
        kind: MetricType::Gauge,
        per_unit: NS,
    },
    Figure {
        policy: "timegraph",
        key: "capacity_ns",
        name: "vgpu_timegraph_reserve_capacity_seconds",
        help: "TimeGraph: the VM's reserve capacity C per period, in seconds.",
        kind: MetricType::Gauge,
        per_unit: NS,
    },
    Figure {
        policy: "timegraph",
        key: "period_ns",
        name: "vgpu_timegraph_reserve_period_seconds",
        help: "TimeGraph: the VM's reserve period T, in seconds.",
        kind: MetricType::Gauge,
        per_unit: NS,
    },
    Figure {
        policy: "vgris",
        key: "sla_aware",
        name: "vgpu_vgris_sla_aware",
        help: "VGRIS: 1 while the SLA-aware algorithm runs (else proportional share).",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "vgris",
        key: "share",
        name: "vgpu_vgris_share_ratio",
        help: "VGRIS: the VM's proportional share of the GPU (0..1).",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "vgris",
        key: "budget_ns",
        name: "vgpu_vgris_budget_seconds",
        help: "VGRIS: GPU time left in the VM's share budget, in seconds.",
        kind: MetricType::Gauge,
        per_unit: NS,
    },
    Figure {
        policy: "vgris",
        key: "fps",
        name: "vgpu_vgris_frames_per_second",
        help: "VGRIS: the VM's frame rate from its last two frame events.",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "vgris",
        key: "delay_ns",
        name: "vgpu_vgris_frame_delay_seconds",
        help: "VGRIS (SLA-aware): the sleep given to the VM's last frame, in seconds.",
        kind: MetricType::Gauge,
        per_unit: NS,
    },
    Figure {
        policy: "vgris",
        key: "present_ns",
        name: "vgpu_vgris_present_cost_seconds",
        help: "VGRIS: the VM's predicted present cost (mean of its history), in seconds.",
        kind: MetricType::Gauge,
        per_unit: NS,
    },
    Figure {
        policy: "vgris",
        key: "usage",
        name: "vgpu_vgris_gpu_usage_ratio",
        help: "VGRIS: the VM's GPU usage (0..1) in the controller's last interval.",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
    Figure {
        policy: "vgris",
        key: "gpu_usage",
        name: "vgpu_vgris_total_gpu_usage_ratio",
        help: "VGRIS: all VMs' GPU usage (0..1) in the controller's last interval (the same for every VM).",
        kind: MetricType::Gauge,
        per_unit: SAME,
    },
];

/// The policy family of a running policy's name: the name up to its first `-`.
fn policy_family(policy: &str) -> &str {
    policy.split_once('-').map_or(policy, |(family, _)| family)
}

/// Whether [`FIGURES`] has a family for figure `key` of `policy` (a running policy's name).
pub fn figure_is_known(policy: &str, key: &str) -> bool {
    let family = policy_family(policy);
    FIGURES.iter().any(|f| f.policy == family && f.key == key)
}

/// `vgpu_build_info{version}`.
const BUILD_INFO: &str = "vgpu_build";
/// `vgpu_policy_info{policy}`.
const POLICY_INFO: &str = "vgpu_policy";
/// `vgpu_engine_busy_ratio`.
const ENGINE_BUSY: &str = "vgpu_engine_busy_ratio";
/// `vgpu_engine_context_switches_total`.
const ENGINE_SWITCHES: &str = "vgpu_engine_context_switches";
/// `vgpu_vm_info{vm,vgpu,qemu_pid,cgroup,socket,type}`.
const VM_INFO: &str = "vgpu_vm";
/// `vgpu_group_latency_seconds` (a histogram).
const LATENCY: &str = "vgpu_group_latency_seconds";

/// The daemon process's families: name (a counter's without `_total`), help, type, value.
type ProcessFamily = (
    &'static str,
    &'static str,
    MetricType,
    fn(&ProcessStats) -> Value,
);

/// The `process_*` families, as every Prometheus client library names them.
const PROCESS_FAMILIES: [ProcessFamily; 4] = [
    (
        "process_cpu_seconds",
        "User and system CPU time the daemon used, in seconds.",
        MetricType::Counter,
        |p| Value::Real(p.cpu_seconds),
    ),
    (
        "process_resident_memory_bytes",
        "The daemon's resident memory, in bytes.",
        MetricType::Gauge,
        |p| Value::Count(p.resident_bytes),
    ),
    (
        "process_open_fds",
        "File descriptors the daemon holds open.",
        MetricType::Gauge,
        |p| Value::Count(p.open_fds),
    ),
    (
        "process_start_time_seconds",
        "When the daemon started, in seconds since the Unix epoch.",
        MetricType::Gauge,
        |p| Value::Real(p.start_time_seconds),
    ),
];

/// The families that are not per-VM figures: (name without suffix, type).
const DAEMON_FAMILIES: [(&str, MetricType); 6] = [
    (BUILD_INFO, MetricType::Info),
    (POLICY_INFO, MetricType::Info),
    (ENGINE_BUSY, MetricType::Gauge),
    (ENGINE_SWITCHES, MetricType::Counter),
    (VM_INFO, MetricType::Info),
    (LATENCY, MetricType::Histogram),
];

/// A family's name as exposed: a counter's with `_total`, an info's with `_info` (a
/// histogram's samples add `_bucket`, `_sum` and `_count` to its name).
fn exposed_name(name: &str, kind: MetricType) -> String {
    match kind {
        MetricType::Counter => format!("{name}_total"),
        MetricType::Info => format!("{name}_info"),
        _ => name.to_owned(),
    }
}

/// The name of every family the daemon can expose, as exposed, whatever the policy (the
/// policy figures' families only appear under their policy family, the budget's only for
/// VMs that have one).
pub fn family_names() -> Vec<String> {
    let vm = VM_FAMILIES.iter().map(|f| (f.name, f.kind));
    let figures = FIGURES.iter().map(|f| (f.name, f.kind));
    let process = PROCESS_FAMILIES.iter().map(|f| (f.0, f.2));
    DAEMON_FAMILIES
        .into_iter()
        .chain(process)
        .chain(vm)
        .chain(figures)
        .map(|(name, kind)| exposed_name(name, kind))
        .collect()
}

/// Encodes one family: its descriptor, then one sample per `(labels, value)`. A family without
/// samples is left out.
fn encode_family<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: &[(L, Value)],
) -> Result<(), std::fmt::Error> {
    if samples.is_empty() {
        return Ok(());
    }
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in samples {
        value.encode(kind, family.encode_family(labels)?)?;
    }
    Ok(())
}

/// Encodes an `_info` family (`name` without `_info`) with one sample per label set.
fn encode_info<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    label_sets: &[L],
) -> Result<(), std::fmt::Error> {
    if label_sets.is_empty() {
        return Ok(());
    }
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Info)?;
    for labels in label_sets {
        family.encode_info(labels)?;
    }
    Ok(())
}

/// One VM's label set.
fn vm_labels(s: &VmStats) -> VmLabels {
    VmLabels { vm: s.name.clone() }
}

/// A label value of what may be unknown: empty when it is.
fn label(value: Option<impl ToString>) -> String {
    value.map(|v| v.to_string()).unwrap_or_default()
}

/// A scrape's statistics and context as a collector.
#[derive(Debug)]
struct Scrape(Stats, Context);

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (stats, context) = (&self.0, &self.1);
        encode_info(
            &mut encoder,
            BUILD_INFO,
            "The daemon's version.",
            &[BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_owned(),
            }],
        )?;
        encode_info(
            &mut encoder,
            POLICY_INFO,
            "The running scheduling policy.",
            &[PolicyLabels {
                policy: stats.policy.to_owned(),
            }],
        )?;
        encode_family(
            &mut encoder,
            ENGINE_BUSY,
            "Fraction of time (0..1) the simulated engine was busy since the daemon started.",
            MetricType::Gauge,
            &[(NO_LABELS, Value::Real(stats.engine_busy))],
        )?;
        encode_family(
            &mut encoder,
            ENGINE_SWITCHES,
            "Context switches of the simulated engine since the daemon started.",
            MetricType::Counter,
            &[(NO_LABELS, Value::Count(stats.engine_switches))],
        )?;
        if let Some(p) = &context.process {
            for (name, help, kind, value) in PROCESS_FAMILIES {
                encode_family(&mut encoder, name, help, kind, &[(NO_LABELS, value(p))])?;
            }
        }
        let connected: Vec<VgpuLabels> = stats
            .vms
            .iter()
            .filter_map(|s| {
                let place = context.places.get(&s.name);
                s.vgpu.map(|v| VgpuLabels {
                    vm: s.name.clone(),
                    vgpu: v.0.to_string(),
                    qemu_pid: label(s.qemu_pid.filter(|&pid| pid != 0)),
                    cgroup: label(place.and_then(|p| p.cgroup.as_ref()).map(|c| c.display())),
                    socket: label(place.and_then(|p| p.socket.as_ref()).map(|s| s.display())),
                    r#type: label(place.and_then(|p| p.vgpu_type.as_ref())),
                })
            })
            .collect();
        encode_info(
            &mut encoder,
            VM_INFO,
            "A connected VM, the id of its vGPU and where it runs (its QEMU's pid and cgroup, \
             its device's socket, its vGPU type; empty where unknown).",
            &connected,
        )?;
        if !stats.vms.is_empty() {
            let mut family = encoder.encode_descriptor(
                LATENCY,
                "Submit-to-finish latency of the VM's command groups since it connected, in seconds.",
                None,
                MetricType::Histogram,
            )?;
            for s in &stats.vms {
                let h = &s.latency;
                family
                    .encode_family(&vm_labels(s))?
                    .encode_histogram::<NoLabelSet>(
                        h.sum_ns as f64 / NS,
                        h.count,
                        &h.buckets(),
                        None,
                    )?;
            }
        }
        for f in VM_FAMILIES {
            let samples: Vec<(VmLabels, Value)> = stats
                .vms
                .iter()
                .filter_map(|s| (f.value)(s).map(|v| (vm_labels(s), v)))
                .collect();
            encode_family(&mut encoder, f.name, f.help, f.kind, &samples)?;
        }
        let family = policy_family(stats.policy);
        for f in FIGURES.iter().filter(|f| f.policy == family) {
            let samples: Vec<(VmLabels, Value)> = stats
                .vms
                .iter()
                .filter_map(|s| {
                    let v = s.figures.get(f.key)?;
                    Some((vm_labels(s), Value::Real(v / f.per_unit)))
                })
                .collect();
            encode_family(&mut encoder, f.name, f.help, f.kind, &samples)?;
        }
        for s in &stats.vms {
            for key in s.figures.keys() {
                if !figure_is_known(stats.policy, key) {
                    debug!("policy {} figure {key} has no metric", stats.policy);
                }
            }
        }
        Ok(())
    }
}

/// Renders statistics and what the I/O layer adds as the `/metrics` answer: the Prometheus
/// text format 0.0.4 (see the module documentation and docs/METRICS.md for the families).
pub fn render_metrics(stats: &Stats, context: &Context) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape(stats.clone(), context.clone())));
    let mut out = String::new();
    // Writing into a String cannot fail, and every label and help text is well formed.
    if let Err(e) = prometheus_text::encode(&mut out, &registry) {
        log::error!("encoding the metrics: {e}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_fall_in_the_bucket_of_the_first_bound_at_or_above_them() {
        let mut h = LatencyHistogram::default();
        for ns in [
            0,
            100_000,
            100_001,
            10_000_000_000,
            10_000_000_001,
            u64::MAX,
        ] {
            h.record(ns);
        }
        let buckets = h.buckets();
        assert_eq!(buckets.len(), LATENCY_BOUNDS_NS.len() + 1);
        assert_eq!(buckets[0], (0.0001, 2), "0 and exactly 100 µs");
        assert_eq!(buckets[1], (0.00025, 1));
        assert_eq!(buckets[15], (10.0, 1));
        assert_eq!(buckets[16], (f64::INFINITY, 2));
        assert_eq!(buckets.iter().map(|b| b.1).sum::<u64>(), h.count());
        assert_eq!(h.count(), 6);
        assert_eq!(h.sum_ns, u64::MAX, "the sum saturates");
        assert!(LATENCY_BOUNDS_NS.windows(2).all(|w| w[0] < w[1]));
    }

    /// `/proc/self/stat` of a process whose name holds spaces and parentheses.
    const STAT: &str = "4242 (vgpu (sch) d) S 1 4242 4242 0 -1 4194560 1500 0 0 0 \
                        250 150 0 0 20 0 3 0 12345 300000000 2048 18446744073709551615 1 1 0 \
                        0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0";
    const SYSTEM: &str = "cpu  1 2 3 4\ncpu0 1 2 3 4\nintr 5\nctxt 6\nbtime 1700000000\n\
                          processes 7\n";

    #[test]
    fn process_figures_are_parsed_from_proc_text() {
        let p = ProcessStats::parse(STAT, SYSTEM, 9, 100, 4096).unwrap();
        assert_eq!(
            p,
            ProcessStats {
                cpu_seconds: 4.0,
                resident_bytes: 2048 * 4096,
                open_fds: 9,
                start_time_seconds: 1_700_000_123.45,
            }
        );
        // What the parser cannot read is refused, not guessed.
        assert_eq!(ProcessStats::parse(STAT, "cpu 1\n", 9, 100, 4096), None);
        assert_eq!(ProcessStats::parse(STAT, SYSTEM, 9, 0, 4096), None);
        assert_eq!(
            ProcessStats::parse("4242 (x) S 1 2", SYSTEM, 9, 100, 4096),
            None
        );
        assert_eq!(ProcessStats::parse("no name", SYSTEM, 9, 100, 4096), None);
        let negative = STAT.replace(" 250 150 ", " -250 150 ");
        assert_eq!(ProcessStats::parse(&negative, SYSTEM, 9, 100, 4096), None);
        let huge = STAT.replace(" 2048 ", " 18446744073709551615 ");
        assert_eq!(ProcessStats::parse(&huge, SYSTEM, 9, 100, 4096), None);
    }

    #[test]
    fn this_process_reads_its_own_figures() {
        let p = ProcessStats::read().unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        // Started before now (a second's slack for the tick rounding), and not in 1970.
        assert!((1e9..now + 1.0).contains(&p.start_time_seconds), "{p:?}");
        assert!(p.resident_bytes > 0 && p.open_fds >= 3, "{p:?}");
        assert!(p.cpu_seconds >= 0.0, "{p:?}");
    }
}
