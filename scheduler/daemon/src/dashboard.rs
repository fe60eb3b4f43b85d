//! The live dashboard's data: the snapshot the daemon publishes about once a second (to
//! `GET /api/state` and to every `GET /events` stream), the history of its chart figures sent
//! to a stream when it connects, the policies the page offers, the bodies of its requests and
//! the page itself (embedded in the binary: no build step, nothing fetched from elsewhere).
//!
//! Pure: the event loop ([`crate::server`]) gives it the core's statistics, VM list and policy
//! and sends what it returns. Rates (GPU share, frame rate) are over the interval since the
//! previous publication, from the core's cumulative counters; latency quantiles are over the
//! last 5 to 10 s ([`crate::daemon::VmStats::recent_latency_p50_us`]).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use vgpu_scheduler::PolicyConfig;
use vgpu_scheduler::model::{Nanos, PrioPolicy, VgpuId, VgpuParams};
use vgpu_scheduler::policy::timegraph::TimeGraphConfig;
use vgpu_scheduler::sim::ParamsOverride;

use crate::daemon::{Stats, VmInfo, VmStats};
use crate::http::HttpError;

/// How often the loop publishes a snapshot.
pub const PUBLISH_PERIOD: Duration = Duration::from_secs(1);
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
    /// headroom, lease), ms; `None` where the policy budgets nothing for it.
    pub budget_ms: Option<f64>,
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
    /// How busy the daemon's simulated engine was since the daemon started, %.
    pub engine_busy_pct: f64,
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

/// The publisher's state: the history and the counters of the previous publication.
#[derive(Debug)]
pub struct Dashboard {
    origin: u64,
    history: VecDeque<Point>,
    previous: BTreeMap<String, Counters>,
}

impl Dashboard {
    /// A dashboard whose time axis starts at `origin` (daemon monotonic ns).
    pub fn new(origin: u64) -> Dashboard {
        Dashboard {
            origin,
            history: VecDeque::with_capacity(HISTORY_POINTS),
            previous: BTreeMap::new(),
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
        Snapshot {
            t: self.seconds(stats.now),
            policy: policy.clone(),
            policy_name: stats.policy,
            engine_busy_pct: stats.engine_busy * 100.0,
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
        to_json(&snapshot)
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
            budget_ms: v.budget.map(|b| b.remaining_ns as f64 / NS_PER_MS),
        }
    }
}

/// `x` to three decimals: what a chart can show, and the history stays short.
fn round(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
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
        .map(|config| {
            let v = serde_json::to_value(&config).unwrap_or_default();
            let family = v["policy"].as_str().unwrap_or("?").to_owned();
            let mode = ["mode", "accounting", "sched"]
                .iter()
                .find_map(|k| v[*k].as_str().map(str::to_owned));
            let label = match mode {
                Some(m) => format!("{family} ({m})"),
                None => family,
            };
            PolicyChoice { label, config }
        })
        .collect()
}

/// The body of `POST /api/params`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamsBody {
    /// The VM.
    pub vm: String,
    /// The fields to change, as the control request `set-params` takes them.
    pub params: ParamsOverride,
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
        assert_eq!(a.budget_ms, Some(-0.5));
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
        assert_eq!(json["engine_busy_pct"], 50.0);
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
            br#"{"vm":"a"}"#,
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
