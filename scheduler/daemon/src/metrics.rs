//! The daemon's Prometheus metrics (`GET /metrics`, docs/METRICS.md).
//!
//! Each scrape takes a [`Stats`] snapshot and encodes it with the `prometheus-client` crate: a
//! [`Registry`] holding one [`Collector`] that owns the snapshot, encoded in the Prometheus text
//! format 0.0.4 (the format `promtool check metrics` lints; its content type is
//! [`CONTENT_TYPE`]). Names follow Prometheus' rules: base units (seconds, ratios 0..1),
//! counters ending in `_total` (the encoder appends it), one label set per VM (`vm="NAME"`),
//! `_info` gauges for the build and the running policy.
//!
//! The policy figures (`Scheduler::figures`) come as `name → f64` pairs in the policy's own
//! units (`vtime_ms`, `budget_ns`, ...); [`FIGURES`] gives each of them a family of its own in
//! base units, named after the policy family. A figure the table does not know is left out (and
//! logged at debug level); the tests run every policy family and check that none is.

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

/// The labels of `vgpu_vm_info`: a connected VM and its vGPU id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct VgpuLabels {
    vm: String,
    vgpu: String,
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
/// `vgpu_vm_info{vm,vgpu}`.
const VM_INFO: &str = "vgpu_vm";

/// The families that are not per-VM figures: (name without suffix, type).
const DAEMON_FAMILIES: [(&str, MetricType); 5] = [
    (BUILD_INFO, MetricType::Info),
    (POLICY_INFO, MetricType::Info),
    (ENGINE_BUSY, MetricType::Gauge),
    (ENGINE_SWITCHES, MetricType::Counter),
    (VM_INFO, MetricType::Info),
];

/// A family's name as exposed: a counter's with `_total`, an info's with `_info`.
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
    DAEMON_FAMILIES
        .into_iter()
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

/// A scrape's statistics as a collector.
#[derive(Debug)]
struct Scrape(Stats);

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = &self.0;
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
        let connected: Vec<VgpuLabels> = stats
            .vms
            .iter()
            .filter_map(|s| {
                s.vgpu.map(|v| VgpuLabels {
                    vm: s.name.clone(),
                    vgpu: v.0.to_string(),
                })
            })
            .collect();
        encode_info(
            &mut encoder,
            VM_INFO,
            "A connected VM and the id of its vGPU.",
            &connected,
        )?;
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

/// Renders statistics as the `/metrics` answer: the Prometheus text format 0.0.4 (see the
/// module documentation and docs/METRICS.md for the families).
pub fn render_metrics(stats: &Stats) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape(stats.clone())));
    let mut out = String::new();
    // Writing into a String cannot fail, and every label and help text is well formed.
    if let Err(e) = prometheus_text::encode(&mut out, &registry) {
        log::error!("encoding the metrics: {e}");
    }
    out
}
