//! What a run reports, and the bounded-memory statistics behind it.

use serde::Serialize;

use crate::model::Nanos;

/// Sub-buckets per power of two in a [`Histogram`]: 2^7 gives quantiles within 1%.
const SUB_BITS: u32 = 7;
/// Values below this are their own bucket.
const LINEAR: u64 = 1 << SUB_BITS;
/// Buckets of a [`Histogram`]: the linear range plus one group per power of two above it.
const BUCKETS: usize = ((64 - SUB_BITS as usize) + 1) << SUB_BITS;

/// A log-linear histogram of nanosecond values: constant memory however many samples, and
/// quantiles within 1%.
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

impl Histogram {
    pub(crate) fn new() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
        }
    }

    fn bucket(v: u64) -> usize {
        if v < LINEAR {
            return v as usize;
        }
        let exp = 63 - v.leading_zeros();
        let shift = exp - SUB_BITS;
        let sub = (v >> shift) - LINEAR;
        (((shift + 1) as usize) << SUB_BITS) + sub as usize
    }

    /// The middle of a bucket's value range.
    fn value(b: usize) -> u64 {
        if (b as u64) < LINEAR {
            return b as u64;
        }
        let group = (b >> SUB_BITS) as u32;
        let shift = group - 1;
        let sub = (b as u64) & (LINEAR - 1);
        let low = (LINEAR + sub) << shift;
        low.saturating_add((1u64 << shift) / 2)
    }

    pub(crate) fn record(&mut self, v: Nanos) {
        if let Some(c) = self.counts.get_mut(Self::bucket(v)) {
            *c = c.saturating_add(1);
            self.total = self.total.saturating_add(1);
        }
    }

    pub(crate) fn count(&self) -> u64 {
        self.total
    }

    /// The `q` quantile (0..=1), or 0 without samples.
    pub(crate) fn quantile(&self, q: f64) -> Nanos {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (b, &c) in self.counts.iter().enumerate() {
            seen = seen.saturating_add(c);
            if seen >= rank {
                return Self::value(b);
            }
        }
        0
    }
}

/// One VM's results in one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VmReport {
    /// The VM's name.
    pub name: String,
    /// The workload kind.
    pub workload: &'static str,
    /// GPU time its completed groups used.
    pub gpu_time_ns: Nanos,
    /// Its part of all GPU busy time (0-1).
    pub gpu_share: f64,
    /// Its GPU time over the run's duration (0-1).
    pub gpu_util: f64,
    /// Groups completed.
    pub groups: u64,
    /// Median group latency, submission to finish.
    pub latency_p50_us: f64,
    /// 99th percentile group latency.
    pub latency_p99_us: f64,
    /// Frames presented.
    pub frames: u64,
    /// Frames per second over the run.
    pub fps: f64,
    /// Median frame time (present to present).
    pub frame_time_p50_ms: f64,
    /// 99th percentile frame time.
    pub frame_time_p99_ms: f64,
    /// Median frame latency (frame start to its present finishing).
    pub frame_latency_p50_ms: f64,
    /// Frames whose frame time exceeded the bound, percent.
    pub frames_over_bound_pct: f64,
    /// The frame-time bound used, if any.
    pub frame_bound_ms: Option<f64>,
    /// Work done per second: frames for a game, groups otherwise.
    pub work_per_sec: f64,
    /// CPU time its vCPUs used.
    pub cpu_time_ns: Nanos,
    /// Work it could not issue because too much was outstanding (periodic submissions
    /// skipped).
    pub skipped: u64,
    /// The policy's figures for this vGPU at the end of the run.
    pub figures: Vec<(String, f64)>,
}

/// A per-VM time series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VmSeries {
    /// The VM's name.
    pub name: String,
    /// Frames per second in each interval.
    pub fps: Vec<f64>,
    /// GPU time in each interval over the interval (0-1), by completion time.
    pub gpu_share: Vec<f64>,
}

/// Time series of a run, for plots.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Series {
    /// Interval length.
    pub interval_ms: f64,
    /// End of each interval since the run started.
    pub t_ms: Vec<f64>,
    /// One series per VM, in the order of [`RunReport::vms`].
    pub vms: Vec<VmSeries>,
}

/// How many decisions of each kind the scheduler returned.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DecisionCounts {
    /// Dispatches (granted and leased).
    pub dispatch: u64,
    /// Dispatches under a lease.
    pub leased: u64,
    /// Leases granted.
    pub lease: u64,
    /// Leases revoked.
    pub revoke: u64,
    /// Suspensions.
    pub suspend: u64,
    /// Resumptions.
    pub resume: u64,
    /// Presents released.
    pub present: u64,
    /// CPU weight suggestions.
    pub cpu_weight: u64,
}

/// The results of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    /// The run's label.
    pub label: String,
    /// The policy's name.
    pub policy: &'static str,
    /// Simulated duration.
    pub duration_ms: u64,
    /// GPU busy time over the duration, percent.
    pub gpu_busy_pct: f64,
    /// Times the engine switched to another (vGPU, context).
    pub context_switches: u64,
    /// Events the scheduler handled.
    pub sched_events: u64,
    /// Decisions it returned, all kinds.
    pub decisions: u64,
    /// Decisions by kind.
    pub decision_counts: DecisionCounts,
    /// Per-VM results.
    pub vms: Vec<VmReport>,
    /// Time series.
    pub series: Series,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_one_percent() {
        let mut h = Histogram::new();
        for v in 1..=10_000u64 {
            h.record(v * 1_000);
        }
        assert_eq!(h.count(), 10_000);
        let p50 = h.quantile(0.5) as f64;
        let p99 = h.quantile(0.99) as f64;
        assert!((p50 / 5_000_000.0 - 1.0).abs() < 0.01, "{p50}");
        assert!((p99 / 9_900_000.0 - 1.0).abs() < 0.01, "{p99}");
        assert_eq!(Histogram::new().quantile(0.5), 0);
        let mut h = Histogram::new();
        h.record(u64::MAX);
        h.record(3);
        assert_eq!(h.quantile(0.0), 3);
        assert!(h.quantile(1.0) > u64::MAX / 2);
    }
}
