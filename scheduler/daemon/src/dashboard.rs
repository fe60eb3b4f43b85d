//! The live dashboard's data: the snapshot the daemon publishes about once a second (to
//! `GET /api/state` and to every `GET /events` stream), the history of its chart figures sent
//! to a stream when it connects, the policies the page offers, the bodies of its requests and
//! the page itself (embedded in the binary: no build step, nothing fetched from elsewhere).
//!
//! Pure: the event loop ([`crate::server`]) gives it the core's statistics, VM list and policy
//! and sends what it returns. Every figure is current, over a window the page names: rates
//! (GPU share, frame rate) over the interval since the previous publication (1 s), from the
//! core's cumulative counters; the engine's busy fraction over the last
//! [`ENGINE_WINDOW_POINTS`] publications; latency quantiles over the last 5 to 10 s
//! ([`crate::daemon::VmStats::recent_latency_p50_us`]). The last change of the scheduler
//! ([`ChangeRecord`]), from the page or the control socket, goes with every snapshot.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use vgpu_scheduler::PolicyConfig;
use vgpu_scheduler::model::{Nanos, PrioPolicy, VgpuId, VgpuParams};
use vgpu_scheduler::policy::timegraph::TimeGraphConfig;
use vgpu_scheduler::sim::ParamsOverride;

use crate::control::parse_assignments;
use crate::daemon::{Stats, VmInfo, VmStats};
use crate::http::HttpError;

/// How often the loop publishes a snapshot.
pub const PUBLISH_PERIOD: Duration = Duration::from_secs(1);
/// Publications the engine's busy fraction is taken over (5 s at one per [`PUBLISH_PERIOD`]):
/// current, yet not one second's noise.
pub const ENGINE_WINDOW_POINTS: usize = 5;
/// Most characters of a [`ChangeRecord`]'s texts: a change names a policy or a VM and up to
/// six parameters (well under 200 characters); a refused request's text can quote a name or
/// key of any length, and the record goes out with every snapshot.
pub const MAX_CHANGE_TEXT_CHARS: usize = 240;
/// Chart points kept and sent to a new stream: 5 minutes at one per [`PUBLISH_PERIOD`].
pub const HISTORY_POINTS: usize = 300;
/// Most VMs in a snapshot (connected ones first, then by name): what a page can chart and
/// list legibly, and what bounds a snapshot and the history (at most about 170 bytes per VM
/// and point).
pub const MAX_DASHBOARD_VMS: usize = 32;
/// Most event streams at once: each is a browser tab held open. A new one past it closes
/// one of those open ([`stream_to_evict`]): a local user who holds them all cannot lock the
/// operator out (they were refused with 503 while eight were held).
pub const MAX_EVENT_STREAMS: usize = 8;
/// Longest an event stream lasts: then it is closed, and the page's `EventSource` reconnects
/// (after the stream's retry delay) and gets the history again. The span of the history, so
/// a reconnection loses no point of the chart.
pub const MAX_EVENT_STREAM_AGE: Duration = Duration::from_secs(300);
/// How long a new stream's client has to read what the stream starts with (the history, up
/// to 2 MiB) before [`MAX_EVENT_STREAM_UNREAD_BYTES`] applies.
pub const EVENT_STREAM_READ_GRACE: Duration = Duration::from_secs(10);
/// Most bytes an event stream's client may leave unread (in the daemon's buffer and both
/// sockets' queues) once its grace is over: a page that reads holds about nothing for more
/// than a moment, while a client that does not read (about 1 KB a second of snapshots would
/// take an hour to fill [`MAX_EVENT_STREAM_BYTES`] past the sockets' buffers) is closed
/// within a minute.
pub const MAX_EVENT_STREAM_UNREAD_BYTES: u64 = 64 * 1024;
/// Most bytes buffered for an event stream that does not read: the history of
/// [`MAX_DASHBOARD_VMS`] VMs with the longest names fits twice (under 2 MiB); past it the
/// stream is closed.
pub const MAX_EVENT_STREAM_BYTES: usize = 4 * 1024 * 1024;

/// The page, its script and its style.
pub const PAGE: &str = include_str!("../assets/dashboard.html");
/// See [`PAGE`].
pub const SCRIPT: &str = include_str!("../assets/dashboard.js");
/// See [`PAGE`].
pub const STYLE: &str = include_str!("../assets/dashboard.css");

const NS_PER_MS: f64 = 1e6;

/// The chart figures of one VM at one point in time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VmPoint {
    /// The VM's name.
    pub name: String,
    /// Its share of GPU time over the last interval, %.
    pub share_pct: f64,
    /// Frames per second over the last interval.
    pub fps: f64,
    /// Median submit-to-finish latency of its recent groups, ms.
    pub latency_p50_ms: f64,
    /// 99th percentile of the same, ms.
    pub latency_p99_ms: f64,
    /// Groups waiting in its queue.
    pub queue_depth: usize,
    /// What it may still use of the GPU under the policy (reserve, credit, share, fair-queuing
    /// headroom, lease), % of its full budget (negative after an overrun); `None` where the
    /// policy budgets nothing for it.
    pub budget_pct: Option<f64>,
}

/// One chart point: when, and each VM's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// Seconds since the dashboard started.
    pub t: f64,
    /// Per VM.
    pub vms: Vec<VmPoint>,
}

/// A VM's budget in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BudgetMs {
    /// What is left (negative after an overrun).
    pub remaining_ms: f64,
    /// What a refill brings it up to.
    pub capacity_ms: f64,
    /// How often it is refilled, if periodically.
    pub period_ms: Option<f64>,
}

/// One VM as the dashboard shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VmRow {
    /// Its chart figures (`name` included).
    #[serde(flatten)]
    pub point: VmPoint,
    /// Whether a device is connected for it.
    pub connected: bool,
    /// Its vGPU while connected.
    pub vgpu: Option<VgpuId>,
    /// Groups dispatched and not completed.
    pub in_flight: usize,
    /// Its budget in full.
    pub budget: Option<BudgetMs>,
    /// The policy's own figures for its vGPU.
    pub figures: BTreeMap<&'static str, f64>,
    /// Bytes of its memory budget in use, as its device last reported (`None` while away).
    pub memory_used_bytes: Option<u64>,
    /// Its memory budget, as its device reported it.
    pub memory_limit_bytes: Option<u64>,
    /// Its parameters as set.
    pub params: VgpuParams,
    /// The parameters the policy applies, where they differ from `params`' meaning (TimeGraph
    /// spec lines, focus); absent while away.
    pub effective: Option<VgpuParams>,
}

/// What `GET /api/state` answers and each `snapshot` event carries.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snapshot {
    /// Seconds since the dashboard started.
    pub t: f64,
    /// The running policy with its parameters.
    pub policy: PolicyConfig,
    /// The running policy's name.
    pub policy_name: &'static str,
    /// How busy the daemon's simulated engine was over the last `engine_window_s`, %.
    pub engine_busy_pct: f64,
    /// The window of `engine_busy_pct`, s: [`ENGINE_WINDOW_POINTS`] publications (less just
    /// after the start).
    pub engine_window_s: f64,
    /// The running policy's parameters, each with its unit and meaning.
    pub policy_table: Vec<PolicyRow>,
    /// The last change of the scheduler asked for, from the page or the control socket.
    pub last_change: Option<ChangeRecord>,
    /// The VMs (at most [`MAX_DASHBOARD_VMS`]).
    pub vms: Vec<VmRow>,
    /// VMs left out past [`MAX_DASHBOARD_VMS`].
    pub vms_omitted: usize,
}

/// A VM's counters at the previous publication.
#[derive(Debug, Clone, Copy)]
struct Counters {
    vgpu: Option<VgpuId>,
    at: u64,
    gpu_time_ns: Nanos,
    frames: u64,
}

/// A change of the scheduler as the page shows it under "Last change".
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChangeRecord {
    /// Its number: changes since the daemon started, from 1 (the page shows a record once).
    pub seq: u64,
    /// When it was asked for: ms since the Unix epoch.
    pub unix_ms: u64,
    /// Who asked: `dashboard` or `control socket` (`vgpuctl`), with the user (and process).
    pub by: String,
    /// What, as `vgpuctl` says it: `set-policy fair (exact)`, `set a weight=512`, `focus b`,
    /// `forget c`.
    pub what: String,
    /// Why the daemon refused it; `None` when it was carried out.
    pub error: Option<String>,
}

/// The publisher's state: the history, the counters of the previous publication, the engine's
/// recent samples and the last change.
#[derive(Debug)]
pub struct Dashboard {
    origin: u64,
    history: VecDeque<Point>,
    previous: BTreeMap<String, Counters>,
    /// `(when, engine busy ns since the start)` at the last [`ENGINE_WINDOW_POINTS`]
    /// publications, oldest first.
    engine: VecDeque<(u64, Nanos)>,
    last_change: Option<ChangeRecord>,
}

impl Dashboard {
    /// A dashboard of a daemon that started at `origin` (daemon monotonic ns): the time axis
    /// starts there, and so does the engine's busy time.
    pub fn new(origin: u64) -> Dashboard {
        Dashboard {
            origin,
            history: VecDeque::with_capacity(HISTORY_POINTS),
            previous: BTreeMap::new(),
            engine: VecDeque::from([(origin, 0)]),
            last_change: None,
        }
    }

    /// Records a change asked for now by `by` (`error`: why it was refused) and returns the
    /// record; texts are cut at [`MAX_CHANGE_TEXT_CHARS`].
    pub fn record_change(
        &mut self,
        unix_ms: u64,
        by: &str,
        what: &str,
        error: Option<&str>,
    ) -> ChangeRecord {
        let record = ChangeRecord {
            seq: self
                .last_change
                .as_ref()
                .map_or(1, |c| c.seq.saturating_add(1)),
            unix_ms,
            by: cut(by),
            what: cut(what),
            error: error.map(cut),
        };
        self.last_change = Some(record.clone());
        record
    }

    /// The engine's busy fraction (%) over the window from the oldest sample kept to `stats`,
    /// and that window in seconds.
    fn engine_busy(&self, stats: &Stats) -> (f64, f64) {
        match self.engine.front() {
            Some(&(at, busy)) if at < stats.now && busy <= stats.engine_busy_ns => {
                let span = stats.now.saturating_sub(at) as f64;
                let busy = stats.engine_busy_ns.saturating_sub(busy) as f64;
                (round((busy / span * 100.0).min(100.0)), round(span / 1e9))
            }
            _ => (0.0, 0.0),
        }
    }

    /// The snapshot of `stats`, `list` and `policy`, taken from the core at one moment.
    pub fn snapshot(&self, stats: &Stats, list: &[VmInfo], policy: &PolicyConfig) -> Snapshot {
        let info: BTreeMap<&str, &VmInfo> = list.iter().map(|v| (v.name.as_str(), v)).collect();
        let mut shown: Vec<&VmStats> = stats.vms.iter().collect();
        // Connected first, then by name (the core lists them by name).
        shown.sort_by_key(|v| !v.connected);
        let omitted = shown.len().saturating_sub(MAX_DASHBOARD_VMS);
        shown.truncate(MAX_DASHBOARD_VMS);
        let vms = shown
            .into_iter()
            .map(|v| {
                let vm = info.get(v.name.as_str());
                VmRow {
                    point: self.point(stats.now, v),
                    connected: v.connected,
                    vgpu: v.vgpu,
                    in_flight: v.in_flight,
                    budget: v.budget.map(|b| BudgetMs {
                        remaining_ms: b.remaining_ns as f64 / NS_PER_MS,
                        capacity_ms: b.capacity_ns as f64 / NS_PER_MS,
                        period_ms: b.period_ns.map(|p| p as f64 / NS_PER_MS),
                    }),
                    figures: v.figures.clone(),
                    memory_used_bytes: v.memory_used_bytes,
                    memory_limit_bytes: v.memory_limit_bytes,
                    params: vm.map_or_else(|| VgpuParams::named(&v.name), |i| i.params.clone()),
                    effective: vm.and_then(|i| i.effective.clone()),
                }
            })
            .collect();
        let (engine_busy_pct, engine_window_s) = self.engine_busy(stats);
        Snapshot {
            t: self.seconds(stats.now),
            policy: policy.clone(),
            policy_name: stats.policy,
            engine_busy_pct,
            engine_window_s,
            policy_table: policy_table(policy),
            last_change: self.last_change.clone(),
            vms,
            vms_omitted: omitted,
        }
    }

    /// Takes the snapshot, keeps its chart figures in the history (at most
    /// [`HISTORY_POINTS`]) and starts the next interval; returns the snapshot as JSON.
    pub fn publish(&mut self, stats: &Stats, list: &[VmInfo], policy: &PolicyConfig) -> String {
        let snapshot = self.snapshot(stats, list, policy);
        self.previous = stats
            .vms
            .iter()
            .map(|v| {
                let c = Counters {
                    vgpu: v.vgpu,
                    at: stats.now,
                    gpu_time_ns: v.gpu_time_ns,
                    frames: v.frames,
                };
                (v.name.clone(), c)
            })
            .collect();
        let point = Point {
            t: snapshot.t,
            vms: snapshot.vms.iter().map(|v| v.point.clone()).collect(),
        };
        if self.history.len() >= HISTORY_POINTS {
            self.history.pop_front();
        }
        self.history.push_back(point);
        if self.engine.len() >= ENGINE_WINDOW_POINTS {
            self.engine.pop_front();
        }
        self.engine.push_back((stats.now, stats.engine_busy_ns));
        to_json(&snapshot)
    }

    /// The last change recorded.
    pub fn last_change(&self) -> Option<&ChangeRecord> {
        self.last_change.as_ref()
    }

    /// The history as JSON, oldest point first.
    pub fn history_json(&self) -> String {
        to_json(&self.history)
    }

    fn seconds(&self, now: u64) -> f64 {
        now.saturating_sub(self.origin) as f64 / 1e9
    }

    /// `v`'s chart figures at `now`: rates since the previous publication when the same vGPU
    /// was there (its counters only grow while it stays), else the core's windowed rates.
    fn point(&self, now: u64, v: &VmStats) -> VmPoint {
        let since = self.previous.get(&v.name).filter(|c| {
            c.vgpu == v.vgpu && c.at < now && c.gpu_time_ns <= v.gpu_time_ns && c.frames <= v.frames
        });
        let (share, fps) = match since {
            Some(c) if v.connected => {
                let span = now.saturating_sub(c.at) as f64;
                let gpu = v.gpu_time_ns.saturating_sub(c.gpu_time_ns) as f64;
                let frames = v.frames.saturating_sub(c.frames) as f64;
                (gpu / span, frames * 1e9 / span)
            }
            _ => (v.gpu_share, v.fps),
        };
        let ms = |us: u64| us as f64 / 1e3;
        VmPoint {
            name: v.name.clone(),
            share_pct: round(share * 100.0),
            fps: round(fps),
            latency_p50_ms: ms(v.recent_latency_p50_us),
            latency_p99_ms: ms(v.recent_latency_p99_us),
            queue_depth: v.queue_depth,
            budget_pct: v
                .budget
                .filter(|b| b.capacity_ns > 0)
                .map(|b| round(b.remaining_ns as f64 * 100.0 / b.capacity_ns as f64)),
        }
    }
}

/// `x` to three decimals: what a chart can show, and the history stays short.
fn round(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// `text` cut at [`MAX_CHANGE_TEXT_CHARS`] (an ellipsis says so).
fn cut(text: &str) -> String {
    match text.char_indices().nth(MAX_CHANGE_TEXT_CHARS) {
        Some((end, _)) => format!("{}…", text.get(..end).unwrap_or_default()),
        None => text.to_owned(),
    }
}

fn to_json<T: Serialize>(value: &T) -> String {
    // Plain data (no maps with non-string keys): serialising cannot fail; non-finite floats
    // become null.
    serde_json::to_string(value).unwrap_or_else(|_| "null".to_owned())
}

/// A policy the page offers: a label and the configuration `POST /api/policy` sends.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyChoice {
    /// What the selector shows.
    pub label: String,
    /// The configuration with its family's defaults.
    pub config: PolicyConfig,
}

/// Every policy family in each mode that schedules differently, with its default parameters,
/// TimeGraph's PRT default included (the list tests run "under every policy" has HT only).
pub fn policy_choices() -> Vec<PolicyChoice> {
    let mut all = PolicyConfig::every_mode();
    let prt = PolicyConfig::TimeGraph(TimeGraphConfig {
        sched: PrioPolicy::Prt,
        ..TimeGraphConfig::default()
    });
    if let Some(i) = all
        .iter()
        .position(|p| matches!(p, PolicyConfig::TimeGraph(_)))
    {
        all.insert(i, prt);
    }
    all.into_iter()
        .map(|config| PolicyChoice {
            label: policy_label(&config),
            config,
        })
        .collect()
}

/// A policy's family and the mode that makes it schedule differently: `fair (exact)`,
/// `timegraph (ht)`, `none`.
pub fn policy_label(config: &PolicyConfig) -> String {
    let v = serde_json::to_value(config).unwrap_or_default();
    let family = v["policy"].as_str().unwrap_or("?").to_owned();
    let mode = ["mode", "accounting", "sched"]
        .iter()
        .find_map(|k| v[*k].as_str().map(str::to_owned));
    match mode {
        Some(m) => format!("{family} ({m})"),
        None => family,
    }
}

/// How a policy parameter's value reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    /// A word (a mode).
    Word,
    /// Nanoseconds, shown in s, ms or µs.
    Duration,
    /// A count of the named things ("" for a bare number).
    Count(&'static str),
    /// A fraction, shown in %.
    Fraction,
    /// Frames per second.
    Fps,
    /// On or off.
    Flag,
    /// TimeGraph's Shared reserves.
    Shared,
    /// TimeGraph's spec lines.
    Specs,
}

/// Every policy family's parameters (their JSON keys; `mode` serves two families): unit and
/// meaning. A test checks that every key of every policy the page offers is here.
const POLICY_FIELDS: [(&str, Unit, &str); 25] = [
    ("mode", Unit::Word, "the family's scheduling method"),
    (
        "accounting",
        Unit::Word,
        "exact: charged as run; sampling: estimated in sampling phases",
    ),
    (
        "threshold_ns",
        Unit::Duration,
        "how far a VM may run ahead of the others before it waits",
    ),
    (
        "idle_grace_ns",
        Unit::Duration,
        "how long a VM with nothing queued still counts as active",
    ),
    (
        "sampling_period_ns",
        Unit::Duration,
        "free run between sampling phases (sampling only)",
    ),
    (
        "sampling_window_ns",
        Unit::Duration,
        "each VM's time alone per sampling phase (sampling only)",
    ),
    (
        "sched",
        Unit::Word,
        "priority policy of the VMs that name none",
    ),
    (
        "admission_limit",
        Unit::Fraction,
        "most the reserves' C/T may add up to",
    ),
    (
        "predictor_entries",
        Unit::Count("records"),
        "cost history kept for prediction",
    ),
    (
        "preemption_cost",
        Unit::Duration,
        "cost assumed for a context switch until measured",
    ),
    (
        "wildcard_priority",
        Unit::Count(""),
        "priority of * spec lines without focus",
    ),
    (
        "shared",
        Unit::Shared,
        "Shared reserves: name C/T enforcement",
    ),
    ("specs", Unit::Specs, "spec lines name:sched:resv:prio:C:T"),
    (
        "ht_lease",
        Unit::Flag,
        "an HT owner submits without a round trip per group",
    ),
    (
        "period",
        Unit::Duration,
        "credit period: credits refilled, SLOs checked",
    ),
    ("tick", Unit::Duration, "scheduling tick"),
    ("max_slice_ticks", Unit::Count("ticks"), "longest slice"),
    (
        "slaf_compensation",
        Unit::Count("ticks"),
        "SLAF: extra per slice after a missed SLO",
    ),
    (
        "max_wait",
        Unit::Duration,
        "longest a VM's oldest group waits (CoSched, AugC)",
    ),
    ("share_period", Unit::Duration, "proportional-share period"),
    (
        "controller_interval",
        Unit::Duration,
        "hybrid: how often the controller decides",
    ),
    (
        "fps_thres",
        Unit::Fps,
        "hybrid: least acceptable frame rate",
    ),
    (
        "gpu_thres",
        Unit::Fraction,
        "hybrid: preferred least GPU use",
    ),
    (
        "time",
        Unit::Duration,
        "hybrid: how long a condition holds before a switch",
    ),
    (
        "history",
        Unit::Count("presents"),
        "SLA: past presents the predictor averages",
    ),
];

/// One parameter of the running policy as the page's table shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PolicyRow {
    /// Its name (the JSON key without a `_ns` suffix).
    pub name: String,
    /// Its value with its unit: `5 ms`, `90 %`, `16 ticks`, `on`.
    pub value: String,
    /// What it does.
    pub about: &'static str,
}

/// The parameters of `config`, in its order, with units.
pub fn policy_table(config: &PolicyConfig) -> Vec<PolicyRow> {
    let v = serde_json::to_value(config).unwrap_or_default();
    let Some(fields) = v.as_object() else {
        return Vec::new();
    };
    fields
        .iter()
        .filter(|(key, _)| key.as_str() != "policy")
        .map(|(key, value)| {
            let field = POLICY_FIELDS.iter().find(|(k, _, _)| k == key);
            let (unit, about) = field.map_or((None, ""), |(_, u, a)| (Some(*u), *a));
            PolicyRow {
                name: key.strip_suffix("_ns").unwrap_or(key).to_owned(),
                value: unit.map_or_else(|| value.to_string(), |u| value_text(u, value)),
                about,
            }
        })
        .collect()
}

/// `value` read as `unit` (its JSON text when it is not what the unit expects).
fn value_text(unit: Unit, value: &serde_json::Value) -> String {
    let number = value.as_f64();
    let list = |f: &dyn Fn(&serde_json::Value) -> String| match value.as_array() {
        Some(items) if items.is_empty() => "none".to_owned(),
        Some(items) => items.iter().map(f).collect::<Vec<_>>().join("; "),
        None => value.to_string(),
    };
    match (unit, number) {
        (Unit::Duration, Some(ns)) => duration_text(ns),
        (Unit::Count(""), Some(n)) => format!("{n}"),
        (Unit::Count(what), Some(n)) => format!("{n} {what}"),
        (Unit::Fraction, Some(x)) => format!("{} %", round(x * 100.0)),
        (Unit::Fps, Some(x)) => format!("{x} fps"),
        (Unit::Flag, _) => match value.as_bool() {
            Some(true) => "on".to_owned(),
            Some(false) => "off".to_owned(),
            None => value.to_string(),
        },
        (Unit::Shared, _) => list(&|r| {
            let ns = |k: &str| r[k].as_f64().map_or_else(|| "?".to_owned(), duration_text);
            let enforcement = r["enforcement"].as_str().unwrap_or("pe");
            let name = r["name"].as_str().unwrap_or("?");
            format!("{name} {}/{} {enforcement}", ns("c"), ns("t"))
        }),
        (Unit::Specs, _) => list(&|line| {
            line.as_str()
                .map_or_else(|| line.to_string(), str::to_owned)
        }),
        _ => value
            .as_str()
            .map_or_else(|| value.to_string(), str::to_owned),
    }
}

/// Nanoseconds in the largest unit of s, ms and µs they reach: `5 ms`, `500 µs`, `1.5 s`.
fn duration_text(ns: f64) -> String {
    let (scale, unit) = match ns {
        n if n >= 1e9 => (1e9, "s"),
        n if n >= 1e6 => (1e6, "ms"),
        n if n >= 1e3 => (1e3, "µs"),
        _ => (1.0, "ns"),
    };
    format!("{} {unit}", round(ns / scale))
}

/// Nanoseconds as `vgpuctl set` takes them: whole µs (with decimals when not whole).
fn us_text(ns: Nanos) -> String {
    if ns % 1_000 == 0 {
        (ns / 1_000).to_string()
    } else {
        format!("{}", ns as f64 / 1e3)
    }
}

/// A parameter change as `vgpuctl set` says it: `priority=7 reserve=2000/10000/pe`.
pub fn params_text(params: &ParamsOverride) -> String {
    let mut parts = Vec::new();
    if let Some(p) = params.priority {
        parts.push(format!("priority={p}"));
    }
    if let Some(w) = params.weight {
        parts.push(format!("weight={w}"));
    }
    if let Some(s) = params.sched {
        parts.push(format!("sched={}", word(&s)));
    }
    if let Some(fps) = params.target_fps {
        parts.push(format!("target_fps={fps}"));
    }
    if let Some(slo) = params.slo {
        parts.push(format!("slo={}", us_text(slo)));
    }
    if let Some(r) = &params.reserve {
        let shared = r.shared.as_ref().map(|s| format!(" (shared {s})"));
        parts.push(format!(
            "reserve={}/{}/{}{}",
            us_text(r.c),
            us_text(r.t),
            word(&r.enforcement),
            shared.unwrap_or_default()
        ));
    }
    if parts.is_empty() {
        "nothing".to_owned()
    } else {
        parts.join(" ")
    }
}

/// A unit enum's JSON word (`prt`, `pe`).
fn word<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The body of `POST /api/params`: the fields to change as `params` (JSON, as the control
/// request `set-params` takes them) or as `set` (`key=value` assignments, as `vgpuctl set`
/// takes them: the page's way), not both.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamsBody {
    /// The VM.
    pub vm: String,
    /// The fields to change.
    #[serde(default)]
    pub params: ParamsOverride,
    /// The fields to change as assignments.
    #[serde(default)]
    pub set: Vec<String>,
}

impl ParamsBody {
    /// The change asked for; 400 with `vgpuctl set`'s reason for an assignment it refuses.
    pub fn change(&self) -> Result<ParamsOverride, HttpError> {
        if self.set.is_empty() {
            return Ok(self.params.clone());
        }
        if self.params != ParamsOverride::default() {
            return Err(HttpError::BadRequest(
                "give params or set, not both".to_owned(),
            ));
        }
        let fields = parse_assignments(&self.set).map_err(|e| HttpError::Refused(e.to_string()))?;
        serde_json::from_value(fields.into()).map_err(|e| HttpError::Refused(e.to_string()))
    }
}

/// The body of `POST /api/focus`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FocusBody {
    /// The VM.
    pub vm: String,
}

/// A request body as `T`; 400 with serde's reason when it is not.
pub fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, HttpError> {
    serde_json::from_slice(body).map_err(|e| HttpError::BadRequest(e.to_string()))
}

/// An open event stream, as its admission and its limits see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventStream {
    /// The loop's token of its connection.
    pub token: u32,
    /// How long it has been open.
    pub age: Duration,
    /// Its client's user, where the sockets' table names it.
    pub uid: Option<u32>,
    /// Bytes sent to it and not yet read: the daemon's buffer, and both sockets' queues where
    /// the table has them.
    pub unread: u64,
}

/// Why an event stream is closed ([`stream_end`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// It lasted [`MAX_EVENT_STREAM_AGE`].
    Aged,
    /// Its client left this many bytes unread past [`EVENT_STREAM_READ_GRACE`].
    Unread(u64),
}

impl std::fmt::Display for StreamEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamEnd::Aged => write!(f, "open for {MAX_EVENT_STREAM_AGE:?}"),
            StreamEnd::Unread(n) => write!(
                f,
                "{n} bytes unread (at most {MAX_EVENT_STREAM_UNREAD_BYTES} after \
                 {EVENT_STREAM_READ_GRACE:?})"
            ),
        }
    }
}

/// Whether `stream` is to be closed now, and why.
pub fn stream_end(stream: &EventStream) -> Option<StreamEnd> {
    if stream.age >= MAX_EVENT_STREAM_AGE {
        Some(StreamEnd::Aged)
    } else if stream.age >= EVENT_STREAM_READ_GRACE && stream.unread > MAX_EVENT_STREAM_UNREAD_BYTES
    {
        Some(StreamEnd::Unread(stream.unread))
    } else {
        None
    }
}

/// The stream to close so that a new one (of user `newcomer`) is admitted, when
/// [`MAX_EVENT_STREAMS`] are open: the oldest of the user who would hold the most with the
/// new one (clients of no known user count as one user; between users holding as many, the
/// one with the oldest stream). One local user cannot keep another's tab out, and a user who
/// opens more closes its own.
pub fn stream_to_evict(open: &[EventStream], newcomer: Option<u32>) -> Option<u32> {
    if open.len() < MAX_EVENT_STREAMS {
        return None;
    }
    let mut users: BTreeMap<Option<u32>, (usize, &EventStream)> = BTreeMap::new();
    for s in open {
        let entry = users.entry(s.uid).or_insert((0, s));
        entry.0 += 1;
        if s.age > entry.1.age {
            entry.1 = s;
        }
    }
    if let Some(entry) = users.get_mut(&newcomer) {
        entry.0 += 1;
    }
    users
        .values()
        .max_by_key(|(held, oldest)| (*held, oldest.age))
        .map(|(_, oldest)| oldest.token)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(token: u32, age_s: u64, uid: Option<u32>, unread: u64) -> EventStream {
        EventStream {
            token,
            age: Duration::from_secs(age_s),
            uid,
            unread,
        }
    }

    #[test]
    fn streams_end_when_old_or_not_read() {
        let limit = MAX_EVENT_STREAM_UNREAD_BYTES;
        assert_eq!(stream_end(&stream(1, 1, None, 4 << 20)), None, "its grace");
        assert_eq!(stream_end(&stream(1, 60, None, limit)), None);
        assert_eq!(
            stream_end(&stream(1, 60, None, limit + 1)),
            Some(StreamEnd::Unread(limit + 1))
        );
        let age = MAX_EVENT_STREAM_AGE.as_secs();
        assert_eq!(stream_end(&stream(1, age, None, 0)), Some(StreamEnd::Aged));
    }

    #[test]
    fn a_full_house_closes_the_oldest_of_the_user_holding_most() {
        let few: Vec<EventStream> = (0..7).map(|t| stream(t, 100, Some(1), 0)).collect();
        assert_eq!(stream_to_evict(&few, Some(2)), None);
        // One user holds every slot: another user's tab closes that user's oldest.
        let mut all: Vec<EventStream> = (0..8)
            .map(|t| stream(t, u64::from(t), Some(1), 0))
            .collect();
        assert_eq!(stream_to_evict(&all, Some(0)), Some(7));
        assert_eq!(stream_to_evict(&all, Some(1)), Some(7));
        // The operator holds one, the other user seven: the other user opening an eighth
        // closes its own oldest, not the operator's older one.
        all[0] = stream(0, 1000, Some(0), 0);
        assert_eq!(stream_to_evict(&all, Some(1)), Some(7));
        // Four each: the newcomer's user closes its own oldest.
        let half: Vec<EventStream> = (0..8)
            .map(|t| stream(t, u64::from(t), Some(t % 2), 0))
            .collect();
        assert_eq!(stream_to_evict(&half, Some(0)), Some(6));
        assert_eq!(stream_to_evict(&half, Some(1)), Some(7));
        // Unknown users count as one.
        let unknown: Vec<EventStream> = (0..8).map(|t| stream(t, u64::from(t), None, 0)).collect();
        assert_eq!(stream_to_evict(&unknown, Some(5)), Some(7));
    }
    use vgpu_scheduler::model::Budget;

    fn vm(name: &str, connected: bool, gpu_time_ns: u64, frames: u64) -> VmStats {
        VmStats {
            name: name.into(),
            vgpu: connected.then_some(VgpuId(1)),
            connected,
            gpu_share: 0.25,
            groups_per_sec: 0.0,
            fps: 7.0,
            queue_depth: 3,
            in_flight: 1,
            latency_p50_us: 1,
            latency_p99_us: 2,
            recent_latency_p50_us: 1500,
            recent_latency_p99_us: 9000,
            latency: crate::metrics::LatencyHistogram::default(),
            submitted: 0,
            dispatched: 0,
            completed: 0,
            cancelled: 0,
            gpu_time_ns,
            frames,
            budget: connected.then_some(Budget {
                remaining_ns: -500_000,
                capacity_ns: 5_000_000,
                period_ns: Some(10_000_000),
            }),
            figures: BTreeMap::from([("vtime_ms", 1.5)]),
            memory_used_bytes: connected.then_some(3 << 20),
            memory_limit_bytes: connected.then_some(1 << 30),
            device_pid: connected.then_some(1234),
            qemu_pid: connected.then_some(0),
            uptime_ns: connected.then_some(5_000_000_000),
        }
    }

    fn stats(now: u64, vms: Vec<VmStats>) -> Stats {
        Stats {
            now,
            policy: "fair",
            engine_busy: 0.5,
            engine_busy_ns: now / 2,
            engine_switches: 0,
            vms,
        }
    }

    #[test]
    fn rates_are_over_the_interval_since_the_last_publication() {
        let policy = PolicyConfig::None;
        let mut d = Dashboard::new(1_000_000_000);
        let first = stats(
            2_000_000_000,
            vec![vm("a", true, 100, 10), vm("z", false, 0, 0)],
        );
        // No previous publication: the core's windowed figures.
        let s = d.snapshot(&first, &[], &policy);
        assert_eq!(s.t, 1.0);
        assert_eq!((s.vms[0].point.share_pct, s.vms[0].point.fps), (25.0, 7.0));
        d.publish(&first, &[], &policy);
        // 0.5 s later: 250 ms of GPU time and 30 frames more.
        let second = stats(2_500_000_000, vec![vm("a", true, 250_000_100, 40)]);
        let s = d.snapshot(&second, &[], &policy);
        let a = &s.vms[0].point;
        assert!((a.share_pct - 50.0).abs() < 1e-9, "{a:?}");
        assert!((a.fps - 60.0).abs() < 1e-9, "{a:?}");
        assert_eq!((a.latency_p50_ms, a.latency_p99_ms), (1.5, 9.0));
        assert_eq!(a.budget_pct, Some(-10.0));
        assert_eq!(s.vms[0].budget.unwrap().period_ms, Some(10.0));
        assert_eq!(
            (s.vms[0].memory_used_bytes, s.vms[0].memory_limit_bytes),
            (Some(3 << 20), Some(1 << 30))
        );
        // A reconnected VM (counters started over): the core's figures again.
        let third = stats(3_000_000_000, vec![vm("a", true, 5, 1)]);
        d.publish(&second, &[], &policy);
        assert_eq!(
            d.snapshot(&third, &[], &policy).vms[0].point.share_pct,
            25.0
        );
        let json: serde_json::Value =
            serde_json::from_str(&d.publish(&third, &[], &policy)).unwrap();
        assert_eq!(json["policy"]["policy"], "none");
        assert_eq!(json["vms"][0]["name"], "a");
        assert_eq!(json["vms"][0]["share_pct"], 25.0);
        assert_eq!(json["vms"][0]["params"]["name"], "a");
        // Busy half the time since 0, nothing before the start at 1 s: 1.5 s in 2 s.
        assert_eq!(
            (
                json["engine_busy_pct"].as_f64(),
                json["engine_window_s"].as_f64()
            ),
            (Some(75.0), Some(2.0))
        );
    }

    #[test]
    fn engine_busy_is_over_the_last_publications() {
        let policy = PolicyConfig::None;
        let s = |now: u64, busy: u64| Stats {
            engine_busy_ns: busy,
            ..stats(now, Vec::new())
        };
        let second = 1_000_000_000;
        let mut d = Dashboard::new(0);
        // Busy all along for 10 s, then idle: since the start it reads 10 / 20, now 0.
        for i in 0..=10 {
            d.publish(&s(i * second, i * second), &[], &policy);
        }
        for i in 11..=20 {
            d.publish(&s(i * second, 10 * second), &[], &policy);
        }
        let now = d.snapshot(&s(21 * second, 10 * second), &[], &policy);
        assert_eq!((now.engine_busy_pct, now.engine_window_s), (0.0, 5.0));
        // Busy again for the last 2 s of the 5.
        for i in 21..=22 {
            d.publish(&s(i * second, (i - 10) * second), &[], &policy);
        }
        let now = d.snapshot(&s(23 * second, 13 * second), &[], &policy);
        assert_eq!((now.engine_busy_pct, now.engine_window_s), (60.0, 5.0));
        // Just after the start, the window is what there is.
        let fresh = Dashboard::new(0);
        let now = fresh.snapshot(&s(second / 2, second / 4), &[], &policy);
        assert_eq!((now.engine_busy_pct, now.engine_window_s), (50.0, 0.5));
    }

    #[test]
    fn changes_are_recorded_in_order_and_cut() {
        let policy = PolicyConfig::None;
        let mut d = Dashboard::new(0);
        assert_eq!(
            d.snapshot(&stats(1, Vec::new()), &[], &policy).last_change,
            None
        );
        let first = d.record_change(
            5,
            "control socket, uid 1000 pid 7",
            "set a weight=512",
            None,
        );
        assert_eq!(first.seq, 1);
        let long = "x".repeat(10_000);
        let second = d.record_change(6, "dashboard, uid 1000", "set b slo=3000", Some(&long));
        assert_eq!(second.seq, 2);
        let error = second.error.as_deref().unwrap();
        assert_eq!(error.chars().count(), MAX_CHANGE_TEXT_CHARS + 1);
        assert!(error.ends_with('…'));
        let json: serde_json::Value =
            serde_json::from_str(&d.publish(&stats(2, Vec::new()), &[], &policy)).unwrap();
        assert_eq!(json["last_change"]["seq"], 2);
        assert_eq!(json["last_change"]["what"], "set b slo=3000");
        assert_eq!(json["last_change"]["by"], "dashboard, uid 1000");
        assert_eq!(json["last_change"]["unix_ms"], 6);
    }

    #[test]
    fn every_offered_policy_has_a_table_with_units() {
        for choice in policy_choices() {
            let v = serde_json::to_value(&choice.config).unwrap();
            let keys = v
                .as_object()
                .unwrap()
                .keys()
                .filter(|k| *k != "policy")
                .count();
            let table = policy_table(&choice.config);
            assert_eq!(table.len(), keys, "{}", choice.label);
            for row in &table {
                assert!(
                    !row.about.is_empty(),
                    "{}: {row:?} has no meaning",
                    choice.label
                );
                assert!(
                    !row.value.is_empty() && !row.name.ends_with("_ns"),
                    "{row:?}"
                );
            }
        }
        let value = |config: &PolicyConfig, name: &str| {
            policy_table(config)
                .into_iter()
                .find(|r| r.name == name)
                .unwrap_or_else(|| panic!("no {name}"))
                .value
        };
        let fair = parse_body::<PolicyConfig>(br#"{"policy":"fair"}"#).unwrap();
        assert_eq!(value(&fair, "threshold"), "5 ms");
        assert_eq!(value(&fair, "idle_grace"), "500 µs");
        assert_eq!(value(&fair, "accounting"), "exact");
        let tg = parse_body::<PolicyConfig>(
            br#"{"policy":"timegraph","specs":["a:prt:pe:5:2:10"],
                 "shared":[{"name":"s","c":2000000,"t":10000000}]}"#,
        )
        .unwrap();
        assert_eq!(value(&tg, "admission_limit"), "100 %");
        assert_eq!(value(&tg, "ht_lease"), "on");
        assert_eq!(value(&tg, "predictor_entries"), "100 records");
        assert_eq!(value(&tg, "specs"), "a:prt:pe:5:2:10");
        assert_eq!(value(&tg, "shared"), "s 2 ms/10 ms pe");
        let vgris = parse_body::<PolicyConfig>(br#"{"policy":"vgris","mode":"hybrid"}"#).unwrap();
        assert_eq!(value(&vgris, "gpu_thres"), "90 %");
        assert_eq!(value(&vgris, "fps_thres"), "30 fps");
        assert_eq!(value(&vgris, "time"), "5 s");
        assert_eq!(policy_label(&vgris), "vgris (hybrid)");
    }

    #[test]
    fn params_read_as_vgpuctl_set_takes_them() {
        let body: ParamsBody = parse_body(
            br#"{"vm":"a","set":["priority=7","reserve=2000/10000/pe","slo=3000","sched=prt"]}"#,
        )
        .unwrap();
        let change = body.change().unwrap();
        assert_eq!(change.slo, Some(3_000_000));
        assert_eq!(
            change.reserve.as_ref().map(|r| (r.c, r.t)),
            Some((2_000_000, 10_000_000))
        );
        assert_eq!(
            params_text(&change),
            "priority=7 sched=prt slo=3000 reserve=2000/10000/pe"
        );
        // Refused with vgpuctl set's own words.
        for (bad, why) in [
            ("reserve=2000/10000", "reserve is C_us/T_us/pe|ae"),
            ("slo=fast", "expected an integer"),
            ("colour=red", "colour"),
        ] {
            let body = ParamsBody {
                vm: "a".into(),
                params: ParamsOverride::default(),
                set: vec![bad.into()],
            };
            let e = body.change().unwrap_err();
            let expected = crate::control::parse_assignment(bad)
                .unwrap_err()
                .to_string();
            assert_eq!(e, HttpError::Refused(expected), "{bad}");
            assert!(
                e.to_string().contains(why) && e.status().starts_with("400"),
                "{e}"
            );
        }
        let both: ParamsBody =
            parse_body(br#"{"vm":"a","params":{"weight":2},"set":["priority=1"]}"#).unwrap();
        assert!(both.change().is_err());
        assert_eq!(params_text(&ParamsOverride::default()), "nothing");
    }

    #[test]
    fn history_and_snapshots_are_bounded() {
        let policy = PolicyConfig::None;
        let mut d = Dashboard::new(0);
        // The longest names, figures with every digit.
        let many: Vec<VmStats> = (0..MAX_DASHBOARD_VMS + 5)
            .map(|i| {
                let mut v = vm(&format!("{i:0>64}"), i % 2 == 1, 0, 0);
                v.gpu_share = 1.0 / 3.0;
                v.fps = 2.0 / 3.0;
                v.recent_latency_p50_us = u64::MAX;
                v
            })
            .collect();
        for i in 0..HISTORY_POINTS + 10 {
            d.publish(&stats(i as u64 * 1_000_000_000, many.clone()), &[], &policy);
        }
        assert_eq!(d.history.len(), HISTORY_POINTS);
        assert_eq!(d.history.front().unwrap().t, 10.0);
        let s = d.snapshot(&stats(0, many), &[], &policy);
        assert_eq!((s.vms.len(), s.vms_omitted), (MAX_DASHBOARD_VMS, 5));
        // Connected ones first.
        let connected = (MAX_DASHBOARD_VMS + 5) / 2;
        assert!(s.vms.iter().take(connected).all(|v| v.connected));
        assert!(!s.vms[connected].connected);
        let history: serde_json::Value = serde_json::from_str(&d.history_json()).unwrap();
        assert_eq!(history.as_array().unwrap().len(), HISTORY_POINTS);
        assert!(d.history_json().len() < MAX_EVENT_STREAM_BYTES / 2);
    }

    #[test]
    fn choices_cover_every_family_with_distinct_labels() {
        let choices = policy_choices();
        let labels: Vec<&str> = choices.iter().map(|c| c.label.as_str()).collect();
        for want in [
            "none",
            "fair (exact)",
            "fair (sampling)",
            "timegraph (prt)",
            "timegraph (ht)",
        ] {
            assert!(labels.contains(&want), "{labels:?}");
        }
        assert!(labels.contains(&"pegasus (xc)") && labels.contains(&"vgris (hybrid)"));
        let mut unique = labels.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), labels.len());
    }

    #[test]
    fn bodies_are_checked() {
        let p: ParamsBody =
            parse_body(br#"{"vm":"a","params":{"priority":3,"target_fps":30}}"#).unwrap();
        assert_eq!(
            (p.params.priority, p.params.target_fps),
            (Some(3), Some(30.0))
        );
        for bad in [
            &br#"{"vm":"a","params":{"colour":1}}"#[..],
            br#"{"vm":"a","set":"priority=1"}"#,
            br#"{"vm":"a","params":{},"x":1}"#,
            br#"{"vm":"a","params":{"priority":-1}}"#,
            b"not json",
            b"",
        ] {
            let e = parse_body::<ParamsBody>(bad).unwrap_err();
            assert!(e.status().starts_with("400"), "{e:?}");
        }
        assert!(parse_body::<FocusBody>(br#"{"vm":1}"#).is_err());
        assert!(parse_body::<PolicyConfig>(br#"{"policy":"nonesuch"}"#).is_err());
        assert_eq!(
            parse_body::<PolicyConfig>(br#"{"policy":"none"}"#).unwrap(),
            PolicyConfig::None
        );
    }

    #[test]
    fn assets_hold_the_contract_ids() {
        for id in [
            "id=\"policy-select\"",
            "id=\"policy-apply\"",
            "id=\"vms\"",
            "id=\"chart-share\"",
            "id=\"chart-fps\"",
            "id=\"chart-latency\"",
            "id=\"chart-queue\"",
            "id=\"chart-budget\"",
            "id=\"status\"",
            "id=\"last-result\"",
            "src=\"/dashboard.js\"",
            "href=\"/dashboard.css\"",
        ] {
            assert!(PAGE.contains(id), "{id}");
        }
        for needle in [
            "data-param",
            "data-action",
            "X-Vgpu-Token",
            "/events",
            "location.hash",
        ] {
            assert!(SCRIPT.contains(needle), "{needle}");
        }
        // Nothing from elsewhere.
        for text in [PAGE, SCRIPT, STYLE] {
            assert!(!text.contains("http://") && !text.contains("https://"));
        }
    }
}
