//! The scheduler daemon client (`--scheduler SOCKET --vm-name NAME`): every GPU-executing
//! command group asks `vgpu-schedd` before it runs.
//!
//! Two halves. [`SchedLink`] is the socket (SOCK_SEQPACKET, `vgpu_schedd::proto` messages),
//! owned by the worker thread, whose epoll watches it. [`Scheduling`] is the device's side of
//! the protocol, pure and kept under the device lock: it decides whether a group may run now
//! ([`Scheduling::gate`]), tracks the load groups the daemon's engine runs and the frames
//! waiting for their present, and queues the messages to send ([`Scheduling::due_outbox`]).
//! Reports of groups run under a lease (`Dispatched`, and `Completed` while nothing waits on
//! it) are held back while the worker is busy, up to [`MAX_REPORT_DELAY_NS`] or
//! [`MAX_HELD_REPORTS`], and go together when the worker idles: a device streaming groups back
//! to back wakes the daemon once per batch instead of twice per group. Anything the daemon
//! must answer or act on goes at once and takes the held reports with it, in order.
//!
//! Fail closed: a device started with `--scheduler` that the daemon has not admitted (not
//! connected yet, the daemon gone, or it refused or dropped us) dispatches its GPU groups
//! only under a conservative budget, [`FallbackShare`] of the GPU: one group at a time, a
//! group may start while the budget is positive, its measured GPU time is charged when it
//! completes (a debt carries over), and the budget grows by its share every
//! [`FALLBACK_PERIOD_NS`] up to one period's worth. Scheduling is a promise to the other VMs:
//! a guest cannot escape the scheduler by being slow enough to be dropped. Once the daemon's
//! `Welcome` admits the device again, groups ask it as before. Load groups (the simulated
//! engine, no GPU) run on the device's local engine meanwhile, and frames are not paced.
//! Without `--scheduler` every group runs at once. Daemon messages are untrusted: a grant or
//! completion for a group the device did not ask about, or a present nobody waits for, is
//! logged and ignored.

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use log::{debug, error, info, warn};
use vgpu_schedd::proto::{self, Exec, Msg, PROTOCOL_VERSION, ProtoError, RefuseCode, VmName};
use vgpu_schedd::seqpacket::{SeqError, SeqStream};
use vgpu_scheduler::{CostSignature, GroupId, GroupKind, Time};

use crate::gpu::load::{LoadCommand, LoadToken, MAX_PENDING_GROUPS};
use crate::metrics::{DeviceMetrics, add, inc};
use crate::virtio_pci::MAX_QUEUE_SIZE;

/// Load groups one device keeps at the daemon at most: the per-device bound both sides agree
/// on ([`proto::MAX_GROUPS_PER_DEVICE`]) less room for the groups the device executes itself
/// (at most one per control-queue chain). The device refuses a load submit past it
/// (ERR_OUT_OF_MEMORY to the guest), so the daemon never has to refuse the device.
pub const MAX_REMOTE_LOAD_GROUPS: usize = proto::MAX_GROUPS_PER_DEVICE - MAX_QUEUE_SIZE as usize;

/// Most daemon messages handled per wake-up of the worker: the socket is level-triggered, so
/// the rest wait for the next round and a flooding daemon cannot starve the guest's queues.
pub const MAX_MESSAGES_PER_WAKE: usize = 256;
/// Most messages the device queues for the daemon between two flushes. Each guest request
/// adds a bounded number (a load submit at most [`crate::gpu::load::MAX_COMMANDS`]) and the
/// worker flushes after every round, so a larger count means a bug: the link is dropped.
pub const MAX_OUTBOX: usize = 2 * MAX_PENDING_GROUPS;
/// Most frames waiting for their present at once; past it a frame is not announced (its
/// submit completes without waiting for a present).
pub const MAX_PENDING_FRAMES: usize = 1024;
/// Longest a leased group's report waits to go with others while the worker stays busy. The
/// daemon then learns of leased work at most this late: far inside its `DISPATCH_GRACE_NS`
/// (250 ms) and group timeout (2 s), and half of fair queuing's default idle grace (500 µs),
/// so a streaming VM does not look idle to it for longer than it really was.
pub const MAX_REPORT_DELAY_NS: Time = 250_000;
/// Most reports held back at once: past it they go at once (a batch the daemon reads in one
/// wake-up, well under its per-wake limit).
pub const MAX_HELD_REPORTS: usize = 32;
/// Receive buffer: one byte over the largest valid message, so that a longer one is detected.
const RECV_BYTES: usize = proto::MAX_MESSAGE_BYTES + 1;
/// The fallback budget's period: every period adds the device's share of it to the budget,
/// which holds at most one period's worth. Short against a guest's frame (16.7 ms at 60 Hz)
/// so that a held group waits about as long as the share implies, not a long burst; long
/// against a wake-up of the worker, which its timer costs each period a group waits.
pub const FALLBACK_PERIOD_NS: Time = 20_000_000;
/// The share of the GPU a device dispatches under while it is not admitted, unless
/// `--fallback-share` says otherwise: an equal split among four vGPUs. The protocol does not
/// tell a device how many vGPUs the daemon serves (`Welcome` carries none, and a field added
/// to it would make older devices refuse the message), so the device cannot compute the
/// split itself; four is the split of a small host's usual load, and an operator who runs
/// more VMs per GPU passes the equal split of theirs.
pub const DEFAULT_FALLBACK_PERCENT: u8 = 25;

/// Errors of the daemon link.
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    /// Connecting failed.
    #[error("connecting to the scheduler daemon at {path}: {source}")]
    Connect {
        /// The daemon's socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: SeqError,
    },
    /// Sending or receiving failed.
    #[error("scheduler daemon link: {0}")]
    Io(#[source] SeqError),
    /// The daemon closed the connection.
    #[error("the scheduler daemon closed the connection")]
    Closed,
    /// The daemon refused a message.
    #[error("the scheduler daemon refused us ({code:?}): {detail}")]
    Refused {
        /// Its code.
        code: RefuseCode,
        /// Its explanation.
        detail: String,
    },
    /// The device queued more than [`MAX_OUTBOX`] messages.
    #[error("more than {MAX_OUTBOX} messages queued for the scheduler daemon")]
    Backlog,
    /// Not connected.
    #[error("not connected to the scheduler daemon")]
    NotConnected,
    /// A fallback share outside 1 to 100 percent.
    #[error("a fallback share of {0}% is not 1 to 100")]
    BadShare(u64),
}

/// The share of the GPU, in percent (1 to 100), a scheduled device dispatches under while
/// the daemon has not admitted it (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FallbackShare(u8);

impl FallbackShare {
    /// `percent` of the GPU; [`SchedError::BadShare`] outside 1 to 100.
    pub fn new(percent: u64) -> Result<FallbackShare, SchedError> {
        match u8::try_from(percent) {
            Ok(p @ 1..=100) => Ok(FallbackShare(p)),
            _ => Err(SchedError::BadShare(percent)),
        }
    }

    /// The share in percent.
    pub fn percent(self) -> u8 {
        self.0
    }

    /// GPU time one [`FALLBACK_PERIOD_NS`] adds to the budget.
    fn per_period_ns(self) -> i64 {
        // At most 20 ms: fits an i64 with room to spare.
        (FALLBACK_PERIOD_NS * u64::from(self.0) / 100) as i64
    }
}

impl Default for FallbackShare {
    fn default() -> FallbackShare {
        FallbackShare(DEFAULT_FALLBACK_PERCENT)
    }
}

/// Where the daemon listens and who we are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedConfig {
    /// The daemon's socket.
    pub socket: PathBuf,
    /// This VM's name (sent in `Hello`).
    pub vm_name: VmName,
    /// The share of the GPU the device dispatches under while not admitted.
    pub fallback: FallbackShare,
}

/// The connection to the daemon (worker thread).
#[derive(Debug)]
pub struct SchedLink {
    config: SchedConfig,
    stream: Option<SeqStream>,
    buf: Vec<u8>,
}

impl SchedLink {
    /// A link that is not connected yet.
    pub fn new(config: SchedConfig) -> SchedLink {
        SchedLink {
            config,
            stream: None,
            buf: vec![0; RECV_BYTES],
        }
    }

    /// The daemon's socket path.
    pub fn path(&self) -> &std::path::Path {
        &self.config.socket
    }

    /// The share the device dispatches under while not admitted.
    pub fn fallback(&self) -> FallbackShare {
        self.config.fallback
    }

    /// Connects and sends `Hello` with our pid and QEMU's (`qemu_pid`, 0 when unknown). With
    /// `qemu_conn`, QEMU's vfio-user connection, the Hello carries it as proof of the pid: the
    /// daemon uses a QEMU pid only when the descriptor's peer has it.
    pub fn connect(
        &mut self,
        qemu_pid: u32,
        qemu_conn: Option<BorrowedFd<'_>>,
    ) -> Result<(), SchedError> {
        self.stream = None;
        let connect_error = |source| SchedError::Connect {
            path: self.config.socket.clone(),
            source,
        };
        let stream = SeqStream::connect(&self.config.socket).map_err(connect_error)?;
        stream.set_nonblocking(true).map_err(connect_error)?;
        let hello = Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: self.config.vm_name.clone(),
            device_pid: std::process::id().clamp(1, proto::MAX_PID),
            qemu_pid: qemu_pid.min(proto::MAX_PID),
        };
        match qemu_conn {
            Some(fd) => {
                let mut packet = Vec::with_capacity(64);
                proto::encode(&hello, &mut packet);
                stream.send_with_fd(&packet, fd).map_err(SchedError::Io)?;
            }
            None => send_on(&stream, &hello)?,
        }
        self.stream = Some(stream);
        Ok(())
    }

    /// The socket to watch, while connected.
    pub fn fd(&self) -> Option<RawFd> {
        self.stream.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Sends one message.
    pub fn send(&self, msg: &Msg) -> Result<(), SchedError> {
        let stream = self.stream.as_ref().ok_or(SchedError::NotConnected)?;
        send_on(stream, msg)
    }

    /// Receives one message: `None` when nothing is waiting. A packet that does not decode,
    /// or one meant for the daemon, is logged and skipped; end of stream is
    /// [`SchedError::Closed`] and a `Refused` is [`SchedError::Refused`].
    pub fn recv(&mut self) -> Result<Option<Msg>, SchedError> {
        let stream = self.stream.as_ref().ok_or(SchedError::NotConnected)?;
        loop {
            let n = match stream.recv(&mut self.buf) {
                Ok(None) => return Ok(None),
                Ok(Some(0)) => return Err(SchedError::Closed),
                Ok(Some(n)) => n,
                Err(SeqError::Truncated(n)) => {
                    warn!("scheduler daemon sent a {n}-byte packet; ignored");
                    continue;
                }
                Err(e) => return Err(SchedError::Io(e)),
            };
            match decode_from_daemon(self.buf.get(..n).unwrap_or_default()) {
                Ok(Msg::Refused { code, detail }) => {
                    return Err(SchedError::Refused {
                        code,
                        detail: detail.as_str().to_string(),
                    });
                }
                Ok(msg) => return Ok(Some(msg)),
                Err(e) => warn!("scheduler daemon sent a bad message ({e}); ignored"),
            }
        }
    }

    /// Says `Bye` (best effort) and closes the connection.
    pub fn close(&mut self) {
        if let Some(stream) = self.stream.take() {
            let _ = send_on(&stream, &Msg::Bye);
        }
    }

    /// Drops the connection without a word (it failed).
    pub fn drop_connection(&mut self) {
        self.stream = None;
    }
}

fn send_on(stream: &SeqStream, msg: &Msg) -> Result<(), SchedError> {
    let mut packet = Vec::with_capacity(64);
    proto::encode(msg, &mut packet);
    stream.send(&packet).map_err(SchedError::Io)
}

/// Decodes a packet from the daemon; messages for the other direction are refused.
fn decode_from_daemon(packet: &[u8]) -> Result<Msg, ProtoError> {
    let msg = proto::decode(packet)?;
    if !msg.kind().to_device() {
        return Err(ProtoError::WrongDirection(msg.kind()));
    }
    Ok(msg)
}

/// What [`Scheduling::gate`] says about a device-executed group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Run it now; `Some` with the group id the daemon knows it by (its completion is
    /// reported with [`Scheduling::completed`]).
    Run(Option<GroupId>),
    /// Hold it (and everything behind it on its queue) until the daemon lets it go.
    Hold,
}

/// A lease: dispatch without asking until it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lease {
    /// GPU time left; `None` when unbounded.
    budget_ns: Option<u64>,
    /// When it ends; `None` when it does not.
    until: Option<Time>,
}

/// A device-executed group dispatched and not reported complete yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Running {
    /// When it was dispatched.
    start: Time,
    /// The daemon session it was dispatched in (a group started under the fallback budget
    /// carries the session of the connection that was lost).
    session: u64,
}

/// Most device-executed groups dispatched and not complete at once: the daemon drops a device
/// with more groups in flight than [`proto::MAX_GROUPS_PER_DEVICE`] (`QueueFull`), so a
/// device never needs more, and past it the next group waits for one to complete.
const MAX_RUNNING: usize = proto::MAX_GROUPS_PER_DEVICE;

/// The conservative budget of a device started with `--scheduler` while the daemon has not
/// admitted it (see the module documentation).
#[derive(Debug)]
struct Fallback {
    share: FallbackShare,
    metrics: Arc<DeviceMetrics>,
    /// GPU time the device may still start groups with, ns; negative while a group's charge
    /// is paid off.
    budget_ns: i64,
    /// When the budget last grew: whole periods after it entered fallback.
    replenished: Time,
    /// When the device last entered fallback; `None` while admitted.
    since: Option<Time>,
    /// Entering fallback was logged (once until the daemon admits the device again).
    warned: bool,
}

impl Fallback {
    /// Not admitted from `now` (a no-op while already in fallback): a full budget.
    fn enter(&mut self, now: Time) {
        if self.since.is_some() {
            return;
        }
        self.since = Some(now);
        self.budget_ns = self.share.per_period_ns();
        self.replenished = now;
        self.metrics.sched_fallback.store(1, Ordering::Relaxed);
    }

    /// The daemon lost, refused or dropped the device (`why`): logged once until admitted.
    fn fell_back(&mut self, now: Time, why: &SchedError) {
        self.enter(now);
        if self.warned {
            debug!("{why}");
            return;
        }
        self.warned = true;
        inc(&self.metrics.sched_fallback_entered);
        let share = self.share.percent();
        let what = "until the daemon admits the device again (reconnecting)";
        match why {
            SchedError::Refused { .. } => {
                error!("{why}; dispatching under the fallback budget ({share}% of the GPU) {what}")
            }
            _ => warn!("{why}; dispatching under the fallback budget ({share}% of the GPU) {what}"),
        }
    }

    /// Admitted (`admitted`: by the daemon's `Welcome`; else the client went away) at `now`.
    fn leave(&mut self, now: Time, admitted: bool) {
        let Some(since) = self.since.take() else {
            return;
        };
        let spent = now.saturating_sub(since);
        add(&self.metrics.sched_fallback_ns, spent);
        self.metrics.sched_fallback.store(0, Ordering::Relaxed);
        if admitted && self.warned {
            info!(
                "the scheduler daemon admitted the device again after {} ms under the fallback budget",
                spent / 1_000_000
            );
        }
        self.warned = false;
    }

    /// Adds the share of every whole period since the last growth, up to one period's worth.
    fn replenish(&mut self, now: Time) {
        let periods = now.saturating_sub(self.replenished) / FALLBACK_PERIOD_NS;
        if periods == 0 {
            return;
        }
        self.replenished = self
            .replenished
            .saturating_add(periods.saturating_mul(FALLBACK_PERIOD_NS));
        let grown = i64::try_from(periods)
            .unwrap_or(i64::MAX)
            .saturating_mul(self.share.per_period_ns());
        self.budget_ns = self
            .budget_ns
            .saturating_add(grown)
            .min(self.share.per_period_ns());
    }

    /// When the budget is positive again (as of the last [`Fallback::replenish`]).
    fn positive_at(&self) -> Time {
        if self.budget_ns > 0 {
            return self.replenished;
        }
        // Periods until the debt is paid and some budget is left; the share per period is
        // at least 200 µs (1% of 20 ms).
        let per = self.share.per_period_ns().unsigned_abs();
        let periods = (self.budget_ns.unsigned_abs() / per).saturating_add(1);
        self.replenished
            .saturating_add(periods.saturating_mul(FALLBACK_PERIOD_NS))
    }

    /// A group ran `ns` of GPU time while not admitted.
    fn charge(&mut self, ns: u64) {
        self.budget_ns = self
            .budget_ns
            .saturating_sub(i64::try_from(ns).unwrap_or(i64::MAX));
        add(&self.metrics.sched_fallback_gpu_ns, ns);
    }

    /// GPU time from `start` to `finish` that fell within this fallback.
    fn charge_span(&mut self, start: Time, finish: Time) {
        let from = self.since.map_or(start, |since| start.max(since));
        self.charge(finish.saturating_sub(from));
    }
}

/// A load group the daemon's engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RemoteGroup {
    token: LoadToken,
    ctx: u32,
    cost_ns: u64,
}

/// The device's side of the daemon protocol (under the device lock). Times are
/// `CLOCK_MONOTONIC` ns.
#[derive(Debug, Default)]
pub struct Scheduling {
    connected: bool,
    /// The daemon's `Welcome` came on the current connection.
    admitted: bool,
    /// With `--scheduler`: the budget groups dispatch under while not admitted.
    fallback: Option<Fallback>,
    /// Device-executed groups dispatched and not reported complete.
    running: BTreeMap<GroupId, Running>,
    /// How many of them the current connection's daemon does not know of (dispatched under
    /// the fallback budget or in an earlier session).
    unknown_running: usize,
    /// The group at the front of the control queue is held by the device itself (the
    /// fallback budget, or groups the daemon does not know of still running), not by the
    /// daemon: [`Scheduling::retry_at`] says when to gate it again.
    holding: bool,
    /// Connections so far: a completion of a group from an earlier one is not reported.
    session: u64,
    suspended: bool,
    lease: Option<Lease>,
    next_group: u64,
    /// The held group asked for this grant.
    asked: Option<GroupId>,
    /// The held group's grant arrived.
    granted: Option<GroupId>,
    /// Load groups on the daemon's engine.
    remote: BTreeMap<GroupId, RemoteGroup>,
    /// Per load submit: its remote groups and frames not yet done.
    waiting: BTreeMap<LoadToken, usize>,
    /// Frames announced, oldest first, waiting for their `Present`.
    frames: VecDeque<LoadToken>,
    /// The last frame found [`MAX_PENDING_FRAMES`] waiting (warned once until one goes).
    frames_full: bool,
    /// Presents received: (when, submit), waiting for their time.
    presents: Vec<(Time, LoadToken)>,
    outbox: Vec<Msg>,
    /// The outbox holds a message the daemon must see now.
    urgent: bool,
    /// When the oldest report held back was queued.
    held_since: Option<Time>,
    /// The VM's memory budget as last noted: (used, limit) bytes.
    memory: (u64, u64),
}

/// What a daemon message changed, for the worker.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Handled {
    /// The held group may go on (grant, resume, lease): process the control queue.
    pub resume_queue: bool,
    /// Load submits whose groups and frames are all done.
    pub done: Vec<LoadToken>,
    /// A present was scheduled: re-arm the timer.
    pub timer: bool,
}

impl Scheduling {
    /// The device runs with `--scheduler` (sharing `metrics`): until the daemon's `Welcome`
    /// admits it, from `now`, its groups dispatch under `share` of the GPU.
    pub fn configure(&mut self, share: FallbackShare, metrics: Arc<DeviceMetrics>, now: Time) {
        let mut fallback = Fallback {
            share,
            metrics,
            budget_ns: 0,
            replenished: now,
            since: None,
            warned: false,
        };
        fallback.enter(now);
        self.fallback = Some(fallback);
    }

    /// Whether a daemon connection is up (groups ask the daemon).
    pub fn connected(&self) -> bool {
        self.connected
    }

    /// Whether the daemon admitted the device on the current connection.
    pub fn admitted(&self) -> bool {
        self.admitted
    }

    /// Whether GPU groups go through [`Scheduling::gate`]: while connected, or at all times
    /// with `--scheduler` (under the fallback budget while not admitted).
    pub fn gating(&self) -> bool {
        self.connected || self.fallback.is_some()
    }

    /// The link came up (`Hello` sent): groups ask the daemon from now on; the device is
    /// admitted when its `Welcome` comes.
    pub fn connect(&mut self) {
        self.connected = true;
        self.admitted = false;
        self.session = self.session.wrapping_add(1);
        self.unknown_running = self.running.len();
        self.suspended = false;
        self.lease = None;
        // Each session's daemon hears the VM's memory once at least.
        let (used, limit) = self.memory;
        self.send(Msg::Memory { used, limit });
    }

    /// The VM's memory budget stands at `used` of `limit` bytes at `now`: a held report for the
    /// daemon when the figures changed. At most one is queued: a newer figure replaces one
    /// not sent yet, so a guest allocating in a loop costs the daemon one message per flush.
    pub fn note_memory(&mut self, used: u64, limit: u64, now: Time) {
        let used = used.min(limit);
        if self.memory == (used, limit) {
            return;
        }
        self.memory = (used, limit);
        if !self.connected {
            return;
        }
        let msg = Msg::Memory { used, limit };
        match self
            .outbox
            .iter_mut()
            .find(|m| matches!(m, Msg::Memory { .. }))
        {
            Some(queued) => *queued = msg,
            None => self.hold_report(msg, now),
        }
    }

    /// The current session, to tag groups with for [`Scheduling::completed`].
    pub fn session(&self) -> u64 {
        self.session
    }

    fn new_group(&mut self) -> GroupId {
        let g = GroupId(self.next_group);
        self.next_group = self.next_group.wrapping_add(1);
        g
    }

    fn lease_valid(&mut self, now: Time) -> bool {
        let valid = self
            .lease
            .is_some_and(|l| l.budget_ns != Some(0) && l.until.is_none_or(|u| now < u));
        if !valid {
            self.lease = None;
        }
        valid
    }

    /// Whether groups still running keep the next one from starting: under the fallback
    /// budget any group (one at a time); while connected one the daemon does not know of
    /// (started under the fallback budget, or in an earlier connection); always past
    /// [`MAX_RUNNING`].
    fn waits_for_running(&self) -> bool {
        self.running.len() >= MAX_RUNNING
            || match self.connected {
                true => self.unknown_running > 0,
                false => !self.running.is_empty(),
            }
    }

    /// Holds the front group for a reason of the device's own (see [`Scheduling::retry_at`]).
    fn hold_here(&mut self) -> Gate {
        if !self.holding
            && !self.connected
            && let Some(f) = &self.fallback
        {
            inc(&f.metrics.sched_fallback_delayed);
        }
        self.holding = true;
        Gate::Hold
    }

    /// A group dispatched at `now`, to be reported with [`Scheduling::completed`].
    fn run(&mut self, group: GroupId, now: Time) -> Gate {
        self.holding = false;
        self.running.insert(
            group,
            Running {
                start: now,
                session: self.session,
            },
        );
        Gate::Run(Some(group))
    }

    /// Whether the device-executed group at the front of the control queue may run now.
    /// Asks the daemon (`Submit`) the first time it is held, reports `Dispatched` under a
    /// lease. Not admitted, with `--scheduler`, a group runs while the fallback budget is
    /// positive and no other group runs; without `--scheduler` everything runs.
    pub fn gate(
        &mut self,
        context: u32,
        kind: GroupKind,
        signature: CostSignature,
        now: Time,
    ) -> Gate {
        if let Some(g) = self.granted.take() {
            return self.run(g, now);
        }
        if !self.connected {
            let wait = self.waits_for_running();
            let Some(f) = &mut self.fallback else {
                return Gate::Run(None);
            };
            f.replenish(now);
            if f.budget_ns <= 0 || wait {
                return self.hold_here();
            }
            inc(&f.metrics.sched_fallback_groups);
            let group = self.new_group();
            return self.run(group, now);
        }
        if self.asked.is_some() || self.suspended {
            self.holding = false;
            return Gate::Hold;
        }
        if self.waits_for_running() {
            return self.hold_here();
        }
        self.holding = false;
        let group = self.new_group();
        if self.lease_valid(now) {
            self.hold_report(
                Msg::Dispatched {
                    group,
                    context,
                    kind,
                    signature,
                },
                now,
            );
            return self.run(group, now);
        }
        self.send(Msg::Submit {
            group,
            context,
            kind,
            signature,
            cost_ns: 0,
            exec: Exec::Device,
        });
        self.asked = Some(group);
        Gate::Hold
    }

    /// Whether a group waits at the daemon for its grant, or its grant came and it has not
    /// run yet (the next [`Scheduling::gate`] runs it, whatever it is gated for).
    pub fn asking(&self) -> bool {
        self.asked.is_some() || self.granted.is_some()
    }

    /// The held group will not run after all (the work it was for ended first): the group
    /// asked or granted for it is cancelled at the daemon, which frees what it reserved.
    pub fn withdraw_held(&mut self) {
        self.holding = false;
        let held = self.take_held();
        if self.connected {
            for group in held {
                self.send(Msg::Cancel { group });
            }
        }
    }

    /// Forgets the held group's ask and grant; returns the group ids the daemon holds for it.
    fn take_held(&mut self) -> Vec<GroupId> {
        self.asked
            .take()
            .into_iter()
            .chain(self.granted.take())
            .collect()
    }

    /// When the group the device holds itself may be gated again: `None` when no group is
    /// held so, or when it waits for a running group to complete (the completion is the
    /// time to look again).
    pub fn retry_at(&mut self, now: Time) -> Option<Time> {
        if !self.holding || self.waits_for_running() {
            return None;
        }
        match (&mut self.fallback, self.connected) {
            (Some(f), false) => {
                f.replenish(now);
                Some(f.positive_at().max(now))
            }
            _ => Some(now),
        }
    }

    /// Whether the group the device holds itself may be gated again at `now`: true once per
    /// hold (the caller processes the control queue, whose gate holds it again if it must),
    /// so a queue that cannot be processed (a device needing reset) is not kicked in a loop.
    pub fn release_due(&mut self, now: Time) -> bool {
        let due = self.retry_at(now).is_some_and(|at| at <= now);
        if due {
            self.holding = false;
        }
        due
    }

    /// A device-executed group of session `session` ran on the GPU from `start` to `finish`.
    /// Not admitted, what it ran in fallback is charged to the fallback budget.
    pub fn completed(&mut self, group: GroupId, session: u64, start: Time, finish: Time) {
        let finish = finish.max(start);
        let ran = self.running.remove(&group);
        if ran.is_some_and(|r| r.session != self.session) {
            self.unknown_running = self.unknown_running.saturating_sub(1);
        }
        if !self.connected {
            if let (Some(_), Some(f)) = (ran, &mut self.fallback) {
                f.charge_span(start, finish);
            }
            return;
        }
        if session != self.session {
            return;
        }
        if let Some(Lease {
            budget_ns: Some(b), ..
        }) = &mut self.lease
        {
            *b = b.saturating_sub(finish - start);
        }
        let msg = Msg::Completed {
            group,
            start,
            finish,
        };
        // Streaming under a lease, nobody waits on this completion; a group held for its
        // grant may (the GPU the daemon hands out next is this one's).
        if self.lease.is_some() && self.asked.is_none() && !self.suspended {
            self.hold_report(msg, finish);
        } else {
            self.send(msg);
        }
    }

    /// Queues a message the daemon must see now.
    fn send(&mut self, msg: Msg) {
        self.outbox.push(msg);
        self.urgent = true;
    }

    /// Queues a leased group's report, which may wait for others (see [`Self::due_outbox`]).
    fn hold_report(&mut self, msg: Msg, now: Time) {
        self.outbox.push(msg);
        self.held_since.get_or_insert(now);
    }

    /// Sends a load submit's groups (`Submit{Simulated}`) and frames (`Frame`) to the daemon.
    /// `Ok(false)` when not connected (the caller runs them locally).
    pub fn submit_load(
        &mut self,
        token: LoadToken,
        context: u32,
        commands: &[LoadCommand],
    ) -> Result<bool, crate::gpu::load::LoadError> {
        if !self.connected {
            return Ok(false);
        }
        let groups = commands.iter().filter(|c| c.cost_ns().is_some()).count();
        if self.remote.len().saturating_add(groups) > MAX_REMOTE_LOAD_GROUPS {
            return Err(crate::gpu::load::LoadError::DaemonBound);
        }
        let mut count = 0usize;
        for command in commands {
            match command.cost_ns() {
                Some(cost_ns) => {
                    let group = self.new_group();
                    let us = u32::try_from(cost_ns / 1000).unwrap_or(u32::MAX);
                    let mut methods = [(crate::gpu::load::OP_OCCUPY, us)];
                    self.send(Msg::Submit {
                        group,
                        context,
                        kind: GroupKind::Load,
                        signature: CostSignature::from_methods(&mut methods),
                        cost_ns,
                        exec: Exec::Simulated,
                    });
                    self.remote.insert(
                        group,
                        RemoteGroup {
                            token,
                            ctx: context,
                            cost_ns,
                        },
                    );
                    count += 1;
                }
                None => {
                    if self.announce_frame(token) {
                        count += 1;
                    }
                }
            }
        }
        if count > 0 {
            let left = self.waiting.entry(token).or_insert(0);
            *left = left.saturating_add(count);
        }
        Ok(true)
    }

    /// Sends `Frame` and queues `token` for its present; false (nothing sent) past
    /// [`MAX_PENDING_FRAMES`].
    fn announce_frame(&mut self, token: LoadToken) -> bool {
        if self.frames.len() >= MAX_PENDING_FRAMES {
            if !self.frames_full {
                warn!("{MAX_PENDING_FRAMES} frames wait for presents; frames not paced");
            }
            self.frames_full = true;
            return false;
        }
        self.frames_full = false;
        self.send(Msg::Frame);
        self.frames.push_back(token);
        true
    }

    /// A presented frame of the guest's display (a RESOURCE_FLUSH that reached a scanout):
    /// sends `Frame`, and `token` is reported done once the daemon's `Present` for it is due.
    /// False when nothing was sent (not connected, or [`MAX_PENDING_FRAMES`] already wait):
    /// the caller completes the flush at once.
    pub fn present_frame(&mut self, token: LoadToken) -> bool {
        if !self.connected || !self.announce_frame(token) {
            return false;
        }
        let left = self.waiting.entry(token).or_insert(0);
        *left = left.saturating_add(1);
        true
    }

    /// One item of `token` is done; true when it was the last.
    fn item_done(&mut self, token: LoadToken) -> bool {
        match self.waiting.get_mut(&token) {
            Some(left) if *left > 1 => {
                *left -= 1;
                false
            }
            Some(_) => {
                self.waiting.remove(&token);
                true
            }
            None => false,
        }
    }

    /// Handles one message from the daemon at `now`.
    pub fn handle(&mut self, msg: Msg, now: Time) -> Handled {
        let mut out = Handled::default();
        match msg {
            Msg::Welcome { version, vgpu } => {
                info!(
                    "scheduler daemon: welcome (protocol {version}, vGPU {})",
                    vgpu.0
                );
                self.admitted = true;
                if let Some(f) = &mut self.fallback {
                    f.leave(now, true);
                }
            }
            Msg::Grant { group } if self.asked == Some(group) => {
                self.asked = None;
                self.granted = Some(group);
                out.resume_queue = true;
            }
            Msg::Grant { group }
                if self.granted == Some(group) || self.remote.contains_key(&group) =>
            {
                warn!("scheduler daemon granted group {} twice", group.0);
            }
            Msg::Grant { group } => {
                // A grant crossing a reset or cancel: the group is gone here, so the
                // daemon must free the GPU it reserved for it.
                warn!(
                    "scheduler daemon granted unknown group {}: cancelled",
                    group.0
                );
                self.send(Msg::Cancel { group });
            }
            Msg::Done { group, .. } => match self.remote.remove(&group) {
                Some(r) => {
                    if self.item_done(r.token) {
                        out.done.push(r.token);
                    }
                }
                None => warn!("scheduler daemon finished unknown group {}", group.0),
            },
            Msg::Lease { budget_ns, until } => {
                self.lease = Some(Lease {
                    budget_ns: (budget_ns != 0).then_some(budget_ns),
                    until: (until != 0).then_some(until),
                });
                out.resume_queue = true;
            }
            // The daemon is about to hand the GPU to someone else once it knows what ran
            // under the lease: held reports go now.
            Msg::Revoke => {
                self.lease = None;
                self.urgent = true;
            }
            Msg::Suspend => {
                self.suspended = true;
                self.urgent = true;
            }
            Msg::Resume => {
                self.suspended = false;
                out.resume_queue = true;
            }
            Msg::Present { at } => match self.frames.pop_front() {
                Some(token) => {
                    self.presents.push((at, token));
                    out.timer = true;
                    out.done = self.presents_due(now);
                }
                None => warn!("scheduler daemon sent a present with no frame waiting"),
            },
            other => warn!("unexpected {} from the scheduler daemon", other.kind()),
        }
        out
    }

    /// The presents due by `now`: returns the load submits this completes.
    pub fn presents_due(&mut self, now: Time) -> Vec<LoadToken> {
        let mut due = Vec::new();
        self.presents.retain(|&(at, token)| {
            if at <= now {
                due.push(token);
                false
            } else {
                true
            }
        });
        due.into_iter().filter(|&t| self.item_done(t)).collect()
    }

    /// When the next present is due.
    pub fn next_present(&self) -> Option<Time> {
        self.presents.iter().map(|&(at, _)| at).min()
    }

    /// The daemon is gone, or it refused or dropped the device (`why`, at `now`): with
    /// `--scheduler` the device dispatches under the fallback budget (logged once until
    /// admitted again). The held group goes through the gate again, presents are released,
    /// and the remote load groups come back as `(token, ctx, cost_ns)` for the local engine;
    /// also returns the submits that nothing else waits for any more.
    pub fn disconnect(
        &mut self,
        now: Time,
        why: &SchedError,
    ) -> (Vec<(LoadToken, u32, u64)>, Vec<LoadToken>) {
        match &mut self.fallback {
            Some(f) => f.fell_back(now, why),
            None => debug!("{why}"),
        }
        // A group held for the daemon goes through the gate again (the worker processes the
        // control queue); one the fallback budget holds stays held (a reconnect that failed).
        if self.connected {
            self.holding = false;
        }
        self.connected = false;
        self.admitted = false;
        self.suspended = false;
        self.lease = None;
        self.asked = None;
        self.granted = None;
        // Nobody to send them to: whatever was queued is dropped.
        let _ = self.take_outbox();
        self.frames.clear();
        self.presents.clear();
        let back: Vec<_> = std::mem::take(&mut self.remote)
            .into_values()
            .map(|r| (r.token, r.ctx, r.cost_ns))
            .collect();
        // Submits with groups coming back complete on the local engine; the others (only
        // frames were left) complete now.
        let released = std::mem::take(&mut self.waiting)
            .into_keys()
            .filter(|t| !back.iter().any(|&(b, _, _)| b == *t))
            .collect();
        (back, released)
    }

    /// Forgets every group and frame (device reset at `now`); the connection stays, and
    /// every group the daemon holds for this device (asked, granted or on its engine) is
    /// cancelled there so its queue slot and GPU time are given back. Groups still running
    /// are forgotten too; not admitted, what they ran so far is charged to the fallback budget.
    pub fn reset(&mut self, now: Time) {
        let running = std::mem::take(&mut self.running);
        self.unknown_running = 0;
        if let (false, Some(f)) = (self.connected, &mut self.fallback) {
            for r in running.values() {
                f.charge_span(r.start, now);
            }
        }
        self.holding = false;
        let mut at_daemon = self.take_held();
        at_daemon.extend(self.remote.keys().copied());
        if self.connected {
            for group in at_daemon {
                self.send(Msg::Cancel { group });
            }
        }
        self.remote.clear();
        self.waiting.clear();
        self.frames.clear();
        self.presents.clear();
    }

    /// The client is going away (at `now`): like [`Scheduling::reset`], and the time spent
    /// under the fallback budget so far is counted.
    pub fn withdraw(&mut self, now: Time) {
        self.reset(now);
        if let Some(f) = &mut self.fallback {
            f.leave(now, false);
        }
    }

    /// Every message queued, oldest first (held reports too); [`SchedError::Backlog`] past
    /// [`MAX_OUTBOX`].
    pub fn take_outbox(&mut self) -> Result<Vec<Msg>, SchedError> {
        self.urgent = false;
        self.held_since = None;
        let out = std::mem::take(&mut self.outbox);
        if out.len() > MAX_OUTBOX {
            return Err(SchedError::Backlog);
        }
        Ok(out)
    }

    /// The messages to send at `now`: the whole outbox when something in it is urgent, when
    /// [`MAX_HELD_REPORTS`] reports are held or the oldest has waited [`MAX_REPORT_DELAY_NS`];
    /// else nothing (the worker sends held reports anyway before it blocks).
    pub fn due_outbox(&mut self, now: Time) -> Result<Vec<Msg>, SchedError> {
        let due = self
            .held_since
            .is_none_or(|t| now >= t.saturating_add(MAX_REPORT_DELAY_NS));
        if self.urgent || self.outbox.len() >= MAX_HELD_REPORTS || due {
            return self.take_outbox();
        }
        Ok(Vec::new())
    }

    /// Whether messages are queued (held reports, between two flushes).
    pub fn holds_reports(&self) -> bool {
        !self.outbox.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::load::LoadRunner;
    use vgpu_schedd::proto::Detail;
    use vgpu_schedd::seqpacket::SeqListener;

    const SIG: CostSignature = CostSignature(1);

    fn connected() -> Scheduling {
        let mut s = Scheduling::default();
        connect(&mut s);
        s
    }

    /// Connects `s`; its first message, the VM's memory, is taken from the outbox.
    fn connect(s: &mut Scheduling) {
        s.connect();
        let out = s.take_outbox().unwrap();
        assert!(matches!(out[..], [Msg::Memory { .. }]), "{out:?}");
    }

    #[test]
    fn the_vms_memory_is_reported_once_per_session_and_then_when_it_changes() {
        let mut s = Scheduling::default();
        s.note_memory(10, 100, 0);
        s.connect();
        assert_eq!(
            s.take_outbox().unwrap(),
            [Msg::Memory {
                used: 10,
                limit: 100
            }]
        );
        s.note_memory(10, 100, MS);
        assert!(s.take_outbox().unwrap().is_empty(), "unchanged: not sent");
        // Changes pile into one held report, the latest figures.
        for used in [20, 30, 40] {
            s.note_memory(used, 100, MS);
        }
        assert!(s.due_outbox(MS).unwrap().is_empty(), "held a while");
        assert_eq!(
            s.due_outbox(MS + MAX_REPORT_DELAY_NS).unwrap(),
            [Msg::Memory {
                used: 40,
                limit: 100
            }]
        );
        // Away, nothing is queued; the next session hears the latest.
        s.disconnect(2 * MS, &SchedError::Closed);
        s.note_memory(50, 100, 3 * MS);
        assert!(s.take_outbox().unwrap().is_empty());
        s.connect();
        assert_eq!(
            s.take_outbox().unwrap(),
            [Msg::Memory {
                used: 50,
                limit: 100
            }]
        );
    }

    /// A device started with `--scheduler` (the default share) at time 0, and its counters.
    fn scheduled() -> (Scheduling, Arc<DeviceMetrics>) {
        let metrics = Arc::new(DeviceMetrics::default());
        let mut s = Scheduling::default();
        s.configure(FallbackShare::default(), metrics.clone(), 0);
        (s, metrics)
    }

    /// The fallback budget's share of one period, ns.
    const SHARE_NS: Time = FALLBACK_PERIOD_NS * DEFAULT_FALLBACK_PERCENT as Time / 100;
    const MS: Time = 1_000_000;

    fn welcome() -> Msg {
        Msg::Welcome {
            version: PROTOCOL_VERSION,
            vgpu: vgpu_scheduler::VgpuId(0),
        }
    }

    fn refused(code: RefuseCode) -> SchedError {
        SchedError::Refused {
            code,
            detail: "x".into(),
        }
    }

    fn run(s: &mut Scheduling, now: Time) -> GroupId {
        match s.gate(1, GroupKind::Compute, SIG, now) {
            Gate::Run(Some(g)) => g,
            other => panic!("expected a group to run at {now}, got {other:?}"),
        }
    }

    fn counter(m: &DeviceMetrics, name: &str) -> u64 {
        m.snapshot()
            .into_iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)
            .unwrap()
    }

    #[test]
    fn not_admitted_a_scheduled_device_dispatches_under_the_fallback_budget() {
        let (mut s, m) = scheduled();
        assert_eq!(counter(&m, "sched_fallback"), 1, "not admitted yet");
        // One group at a time, reported complete with its GPU time; nothing goes to a daemon.
        let g1 = run(&mut s, 0);
        assert_eq!(
            s.gate(1, GroupKind::Render, SIG, MS),
            Gate::Hold,
            "one at a time"
        );
        assert_eq!(
            s.retry_at(MS),
            None,
            "the running group's completion says when"
        );
        assert_eq!(s.gate(1, GroupKind::Render, SIG, MS), Gate::Hold);
        s.completed(g1, s.session(), 0, SHARE_NS - MS);
        assert_eq!(s.retry_at(SHARE_NS), Some(SHARE_NS), "budget left: at once");
        assert!(s.release_due(SHARE_NS));
        assert!(!s.release_due(SHARE_NS), "once per hold");
        // The budget is still positive: the next group runs and overdraws it.
        let g2 = run(&mut s, SHARE_NS);
        s.completed(g2, s.session(), SHARE_NS, SHARE_NS + 10 * MS);
        let now = SHARE_NS + 10 * MS;
        assert_eq!(
            s.gate(1, GroupKind::Render, SIG, now),
            Gate::Hold,
            "overdrawn"
        );
        // Owed 9 ms: paid by two periods' shares (5 ms each), the budget is positive at 40 ms.
        assert_eq!(s.retry_at(now), Some(2 * FALLBACK_PERIOD_NS));
        let almost = 2 * FALLBACK_PERIOD_NS - 1;
        assert_eq!(s.gate(1, GroupKind::Render, SIG, almost), Gate::Hold);
        run(&mut s, 2 * FALLBACK_PERIOD_NS);
        assert!(s.take_outbox().unwrap().is_empty(), "no daemon to tell");
        assert_eq!(counter(&m, "sched_fallback_groups"), 3);
        assert_eq!(
            counter(&m, "sched_fallback_delayed"),
            2,
            "once per held group"
        );
        assert_eq!(counter(&m, "sched_fallback_gpu_ns"), SHARE_NS + 9 * MS);
        assert_eq!(
            counter(&m, "sched_fallback_entered"),
            0,
            "not an event: not connected yet"
        );
    }

    #[test]
    fn the_fallback_budget_holds_one_period_at_most() {
        let (mut s, _) = scheduled();
        // Idle for a long while: no credit piles up.
        let late = 1_000 * FALLBACK_PERIOD_NS;
        let g = run(&mut s, late);
        s.completed(g, s.session(), late, late + SHARE_NS);
        assert_eq!(
            s.gate(1, GroupKind::Render, SIG, late + SHARE_NS),
            Gate::Hold
        );
        assert_eq!(
            s.retry_at(late + SHARE_NS),
            Some(late + FALLBACK_PERIOD_NS),
            "one period's share repays it"
        );
        // A wild completion time saturates instead of wrapping.
        let g = run(&mut s, late + FALLBACK_PERIOD_NS);
        s.completed(g, s.session(), 0, Time::MAX);
        assert_eq!(s.gate(1, GroupKind::Render, SIG, Time::MAX - 1), Gate::Hold);
        assert!(s.retry_at(Time::MAX - 1).is_some());
    }

    #[test]
    fn a_device_the_daemon_drops_for_a_timeout_falls_back_instead_of_running_unscheduled() {
        let (mut s, m) = scheduled();
        connect(&mut s);
        s.handle(welcome(), 0);
        assert!(s.admitted());
        assert_eq!(counter(&m, "sched_fallback"), 0);
        // A slow group, granted, outlives the daemon's group timeout: the daemon drops us.
        assert_eq!(s.gate(1, GroupKind::Compute, SIG, 0), Gate::Hold);
        let Some(Msg::Submit { group: slow, .. }) = s.take_outbox().unwrap().pop() else {
            panic!("asked")
        };
        s.handle(Msg::Grant { group: slow }, 0);
        assert_eq!(run(&mut s, 0), slow);
        let dropped = 2_000 * MS;
        s.disconnect(dropped, &refused(RefuseCode::Timeout));
        assert!(!s.admitted());
        assert_eq!(counter(&m, "sched_fallback"), 1);
        assert_eq!(counter(&m, "sched_fallback_entered"), 1);
        // Not unscheduled: nothing runs beside the slow group...
        assert_eq!(s.gate(1, GroupKind::Compute, SIG, dropped), Gate::Hold);
        assert_eq!(s.retry_at(dropped), None);
        // ...and the 3 s it ran after the drop are charged to the fallback budget.
        let finish = 5_000 * MS;
        s.completed(slow, 1, 0, finish);
        assert_eq!(counter(&m, "sched_fallback_gpu_ns"), 3_000 * MS);
        assert_eq!(s.gate(1, GroupKind::Compute, SIG, finish), Gate::Hold);
        // 3 s owed at 5 ms per 20 ms: 12 s of waiting.
        let owed = 3_000 * MS - SHARE_NS;
        let periods = owed / SHARE_NS + 1;
        let at = dropped + periods * FALLBACK_PERIOD_NS;
        assert_eq!(s.retry_at(finish), Some(at));
        // A reconnect that fails while the group waits is not a new event, and the group
        // stays held for its time.
        s.disconnect(finish, &SchedError::Closed);
        assert_eq!(counter(&m, "sched_fallback_entered"), 1);
        assert_eq!(s.retry_at(finish), Some(at));
        assert_eq!(s.gate(1, GroupKind::Compute, SIG, at - 1), Gate::Hold);
        run(&mut s, at);
    }

    #[test]
    fn admitted_again_the_device_asks_the_daemon_once_its_fallback_group_is_done() {
        let (mut s, m) = scheduled();
        connect(&mut s);
        s.handle(welcome(), 0);
        s.disconnect(MS, &SchedError::Closed);
        let fallback_group = run(&mut s, MS);
        // The daemon is back while a group the daemon never heard of runs: the next group
        // waits for it, then asks.
        connect(&mut s);
        assert_eq!(s.gate(1, GroupKind::Render, SIG, 2 * MS), Gate::Hold);
        assert!(s.take_outbox().unwrap().is_empty(), "not asked yet");
        assert_eq!(s.retry_at(2 * MS), None);
        s.completed(fallback_group, s.session() - 1, MS, 3 * MS);
        assert!(
            s.take_outbox().unwrap().is_empty(),
            "not reported: the daemon never knew it"
        );
        assert_eq!(s.retry_at(3 * MS), Some(3 * MS));
        assert_eq!(s.gate(1, GroupKind::Render, SIG, 3 * MS), Gate::Hold);
        assert!(matches!(
            s.take_outbox().unwrap()[..],
            [Msg::Submit {
                exec: Exec::Device,
                ..
            }]
        ));
        assert_eq!(s.retry_at(3 * MS), None, "held by the daemon now");
        assert_eq!(
            counter(&m, "sched_fallback"),
            1,
            "connected, not admitted yet"
        );
        s.handle(welcome(), 10 * MS);
        assert_eq!(counter(&m, "sched_fallback"), 0);
        assert_eq!(counter(&m, "sched_fallback_ns"), 9 * MS);
        // Refused by name: fallback again (never unscheduled), and once more admitted.
        s.disconnect(11 * MS, &refused(RefuseCode::Forbidden));
        assert_eq!(counter(&m, "sched_fallback"), 1);
        assert_eq!(counter(&m, "sched_fallback_entered"), 2);
        assert!(matches!(
            s.gate(1, GroupKind::Render, SIG, 11 * MS),
            Gate::Run(Some(_))
        ));
    }

    #[test]
    fn a_reset_under_the_fallback_budget_charges_what_ran_and_forgets_it() {
        let (mut s, m) = scheduled();
        let g = run(&mut s, 0);
        s.reset(2 * MS);
        assert_eq!(counter(&m, "sched_fallback_gpu_ns"), 2 * MS);
        // The group the reset forgot does not hold the next one, budget permitting.
        assert_eq!(run(&mut s, 2 * MS).0, g.0 + 1);
        s.withdraw(4 * MS);
        assert_eq!(counter(&m, "sched_fallback"), 0, "the client went away");
        assert_eq!(counter(&m, "sched_fallback_ns"), 4 * MS);
        assert_eq!(counter(&m, "sched_fallback_gpu_ns"), 4 * MS);
    }

    #[test]
    fn unconnected_everything_runs_and_nothing_is_sent() {
        let mut s = Scheduling::default();
        assert_eq!(s.gate(1, GroupKind::Render, SIG, 0), Gate::Run(None));
        let token = LoadRunner::default().token();
        assert_eq!(
            s.submit_load(token, 1, &[LoadCommand::Occupy { us: 1 }]),
            Ok(false)
        );
        assert!(s.take_outbox().unwrap().is_empty());
    }

    #[test]
    fn a_group_waits_for_its_own_grant() {
        let mut s = connected();
        assert_eq!(s.gate(3, GroupKind::Render, SIG, 0), Gate::Hold);
        let out = s.take_outbox().unwrap();
        let [Msg::Submit { group, exec, .. }] = out.as_slice() else {
            panic!("{out:?}")
        };
        assert_eq!(*exec, Exec::Device);
        assert_eq!(
            s.gate(3, GroupKind::Render, SIG, 0),
            Gate::Hold,
            "asked once"
        );
        assert!(s.take_outbox().unwrap().is_empty());
        let wrong = Msg::Grant {
            group: GroupId(group.0 + 1),
        };
        assert!(
            !s.handle(wrong.clone(), 0).resume_queue,
            "unknown grant ignored"
        );
        let Msg::Grant { group: late } = wrong else {
            unreachable!()
        };
        assert_eq!(
            s.take_outbox().unwrap(),
            [Msg::Cancel { group: late }],
            "an unknown grant is given back"
        );
        assert_eq!(s.gate(3, GroupKind::Render, SIG, 0), Gate::Hold);
        assert!(s.handle(Msg::Grant { group: *group }, 0).resume_queue);
        assert_eq!(
            s.gate(3, GroupKind::Render, SIG, 0),
            Gate::Run(Some(*group))
        );
        s.completed(*group, s.session(), 10, 5);
        assert_eq!(
            s.take_outbox().unwrap(),
            [Msg::Completed {
                group: *group,
                start: 10,
                finish: 10
            }],
            "finish never before start"
        );
        s.completed(*group, s.session() + 1, 1, 2);
        assert!(
            s.take_outbox().unwrap().is_empty(),
            "other session: not reported"
        );
    }

    #[test]
    fn leases_suspend_and_resume() {
        let mut s = connected();
        s.handle(
            Msg::Lease {
                budget_ns: 100,
                until: 1_000,
            },
            0,
        );
        let Gate::Run(Some(g)) = s.gate(1, GroupKind::Transfer, SIG, 10) else {
            panic!("leased groups run")
        };
        assert!(matches!(
            s.take_outbox().unwrap()[..],
            [Msg::Dispatched { .. }]
        ));
        s.completed(g, s.session(), 0, 100);
        s.take_outbox().unwrap();
        assert_eq!(
            s.gate(1, GroupKind::Render, SIG, 20),
            Gate::Hold,
            "budget used"
        );
        let mut s = connected();
        s.handle(
            Msg::Lease {
                budget_ns: 0,
                until: 1_000,
            },
            0,
        );
        assert_eq!(
            s.gate(1, GroupKind::Render, SIG, 1_000),
            Gate::Hold,
            "expired"
        );
        let mut s = connected();
        s.handle(Msg::Suspend, 0);
        assert_eq!(s.gate(1, GroupKind::Render, SIG, 0), Gate::Hold);
        assert!(
            s.take_outbox().unwrap().is_empty(),
            "suspended: not even asked"
        );
        assert!(s.handle(Msg::Resume, 0).resume_queue);
        assert_eq!(s.gate(1, GroupKind::Render, SIG, 0), Gate::Hold);
        assert_eq!(s.take_outbox().unwrap().len(), 1);
    }

    #[test]
    fn leased_reports_are_held_until_due_and_anything_urgent_takes_them_along() {
        let unbounded = Msg::Lease {
            budget_ns: 0,
            until: 0,
        };
        let mut s = connected();
        s.handle(unbounded.clone(), 0);
        let Gate::Run(Some(g1)) = s.gate(1, GroupKind::Render, SIG, 10) else {
            panic!("leased groups run")
        };
        s.completed(g1, s.session(), 10, 20);
        // Held: nothing to send yet (the worker sends them when it idles).
        assert!(s.due_outbox(30).unwrap().is_empty());
        assert!(s.holds_reports());
        let sent = s.due_outbox(10 + MAX_REPORT_DELAY_NS).unwrap();
        assert!(matches!(
            sent[..],
            [Msg::Dispatched { group, .. }, Msg::Completed { group: done, .. }]
                if group == g1 && done == g1
        ));
        assert!(!s.holds_reports());
        // A batch that reaches the limit goes at once.
        for i in 0..MAX_HELD_REPORTS / 2 {
            let now = 100 + i as Time;
            let Gate::Run(Some(g)) = s.gate(1, GroupKind::Render, SIG, now) else {
                panic!("leased groups run")
            };
            s.completed(g, s.session(), now, now);
        }
        assert_eq!(s.due_outbox(200).unwrap().len(), MAX_HELD_REPORTS);
        // A revoke sends what was held at once, and the next group asks.
        let Gate::Run(Some(g2)) = s.gate(1, GroupKind::Render, SIG, 300) else {
            panic!("leased groups run")
        };
        s.handle(Msg::Revoke, 310);
        assert!(matches!(
            s.due_outbox(310).unwrap()[..],
            [Msg::Dispatched { .. }]
        ));
        // Completed while a group waits for its grant: the daemon needs it now.
        assert_eq!(s.gate(1, GroupKind::Render, SIG, 320), Gate::Hold);
        s.handle(unbounded, 330);
        s.completed(g2, s.session(), 300, 340);
        assert!(matches!(
            s.due_outbox(340).unwrap()[..],
            [Msg::Submit { .. }, Msg::Completed { group, .. }] if group == g2
        ));
        // Without a lease nothing is held.
        let mut s = connected();
        assert_eq!(s.gate(1, GroupKind::Render, SIG, 0), Gate::Hold);
        assert_eq!(s.due_outbox(0).unwrap().len(), 1);
    }

    #[test]
    fn load_submits_complete_on_done_and_present() {
        let mut runner = LoadRunner::default();
        let mut s = connected();
        let t = runner.token();
        let cmds = [
            LoadCommand::Occupy { us: 5 },
            LoadCommand::EndFrame,
            LoadCommand::Occupy { us: 7 },
        ];
        assert_eq!(s.submit_load(t, 2, &cmds), Ok(true));
        let out = s.take_outbox().unwrap();
        let groups: Vec<GroupId> = out
            .iter()
            .filter_map(|m| match m {
                Msg::Submit {
                    group,
                    cost_ns,
                    exec: Exec::Simulated,
                    kind: GroupKind::Load,
                    ..
                } => Some((*group, *cost_ns)),
                _ => None,
            })
            .map(|(g, c)| {
                assert!(c == 5_000 || c == 7_000);
                g
            })
            .collect();
        assert_eq!(groups.len(), 2);
        assert!(out.contains(&Msg::Frame));
        let done = |g| Msg::Done {
            group: g,
            start: 0,
            finish: 0,
        };
        assert!(s.handle(done(groups[0]), 0).done.is_empty());
        assert!(
            s.handle(done(groups[0]), 0).done.is_empty(),
            "twice: unknown"
        );
        assert!(s.handle(done(groups[1]), 0).done.is_empty(), "frame left");
        let h = s.handle(Msg::Present { at: 100 }, 50);
        assert!(h.timer && h.done.is_empty());
        assert_eq!(s.next_present(), Some(100));
        assert!(s.presents_due(99).is_empty());
        assert_eq!(s.presents_due(100), [t]);
        assert!(
            s.handle(Msg::Present { at: 0 }, 0).done.is_empty(),
            "no frame waits"
        );
    }

    #[test]
    fn flushed_frames_wait_for_their_present_within_the_bound() {
        let mut runner = LoadRunner::default();
        let mut s = Scheduling::default();
        assert!(!s.present_frame(runner.token()), "unconnected: at once");
        connect(&mut s);
        let first = runner.token();
        assert!(s.present_frame(first));
        assert_eq!(s.take_outbox().unwrap(), [Msg::Frame]);
        let h = s.handle(Msg::Present { at: 10 }, 5);
        assert!(h.timer && h.done.is_empty(), "not due yet");
        assert_eq!(s.presents_due(10), [first]);
        for _ in 0..MAX_PENDING_FRAMES {
            assert!(s.present_frame(runner.token()));
        }
        assert_eq!(s.take_outbox().unwrap().len(), MAX_PENDING_FRAMES);
        let over = runner.token();
        assert!(!s.present_frame(over), "past the bound: at once");
        assert!(s.take_outbox().unwrap().is_empty(), "and not announced");
        let h = s.handle(Msg::Present { at: 0 }, 0);
        assert_eq!(h.done.len(), 1, "the oldest frame goes");
        assert!(s.present_frame(over), "room again");
        let (back, released) = s.disconnect(0, &SchedError::Closed);
        assert!(back.is_empty());
        assert_eq!(
            released.len(),
            MAX_PENDING_FRAMES,
            "the daemon left: all released"
        );
    }

    #[test]
    fn disconnect_gives_back_what_waited() {
        let mut runner = LoadRunner::default();
        let (mut s, _) = scheduled();
        connect(&mut s);
        let (a, b) = (runner.token(), runner.token());
        s.submit_load(a, 1, &[LoadCommand::Occupy { us: 3 }])
            .unwrap();
        s.submit_load(b, 1, &[LoadCommand::EndFrame]).unwrap();
        assert_eq!(s.gate(1, GroupKind::Render, SIG, 0), Gate::Hold);
        let (back, released) = s.disconnect(0, &SchedError::Closed);
        assert_eq!(back, [(a, 1, 3_000)]);
        assert_eq!(released, [b]);
        assert!(!s.connected());
        // The held group goes under the fallback budget, not unscheduled.
        assert!(matches!(
            s.gate(1, GroupKind::Render, SIG, 0),
            Gate::Run(Some(_))
        ));
        assert!(s.take_outbox().unwrap().is_empty());
        // Without --scheduler nothing is gated.
        let mut s = connected();
        s.disconnect(0, &SchedError::Closed);
        assert_eq!(s.gate(1, GroupKind::Render, SIG, 0), Gate::Run(None));
    }

    #[test]
    fn reset_cancels_every_group_at_the_daemon() {
        let mut runner = LoadRunner::default();
        let mut s = connected();
        let a = runner.token();
        s.submit_load(a, 1, &[LoadCommand::Occupy { us: 3 }])
            .unwrap();
        assert_eq!(s.gate(1, GroupKind::Render, SIG, 0), Gate::Hold);
        let mut at_daemon: Vec<GroupId> = s
            .take_outbox()
            .unwrap()
            .into_iter()
            .filter_map(|m| match m {
                Msg::Submit { group, .. } => Some(group),
                _ => None,
            })
            .collect();
        assert_eq!(at_daemon.len(), 2, "one load group and the held group");
        s.reset(0);
        let mut cancelled: Vec<GroupId> = s
            .take_outbox()
            .unwrap()
            .into_iter()
            .map(|m| match m {
                Msg::Cancel { group } => group,
                other => panic!("only cancels after a reset: {other:?}"),
            })
            .collect();
        at_daemon.sort();
        cancelled.sort();
        assert_eq!(cancelled, at_daemon);
        let late = s.handle(
            Msg::Grant {
                group: at_daemon[0],
            },
            0,
        );
        assert!(!late.resume_queue);
        assert_eq!(
            s.take_outbox().unwrap(),
            [Msg::Cancel {
                group: at_daemon[0]
            }],
            "a grant crossing the reset is given back"
        );
        s.reset(0);
        assert!(
            s.take_outbox().unwrap().is_empty(),
            "nothing left to cancel"
        );
    }

    #[test]
    fn daemon_side_messages_and_bounds() {
        let mut s = connected();
        for m in [
            Msg::Frame,
            Msg::Bye,
            Msg::Refused {
                code: RefuseCode::Internal,
                detail: Detail::lossy("x"),
            },
        ] {
            assert_eq!(s.handle(m, 0), Handled::default());
        }
        let mut runner = LoadRunner::default();
        let full = vec![LoadCommand::Occupy { us: 1 }; 64];
        for _ in 0..MAX_REMOTE_LOAD_GROUPS / 64 {
            s.submit_load(runner.token(), 1, &full).unwrap();
        }
        assert_eq!(
            s.submit_load(runner.token(), 1, &full[..1]),
            Err(crate::gpu::load::LoadError::DaemonBound)
        );
        let at_daemon = s
            .take_outbox()
            .unwrap()
            .iter()
            .filter(|m| matches!(m, Msg::Submit { .. }))
            .count();
        assert!(at_daemon <= proto::MAX_GROUPS_PER_DEVICE - usize::from(MAX_QUEUE_SIZE));
        assert!(s.take_outbox().is_ok());
        assert!(matches!(
            decode_from_daemon(&{
                let mut p = Vec::new();
                proto::encode(&Msg::Frame, &mut p);
                p
            }),
            Err(ProtoError::WrongDirection(_))
        ));
    }

    #[test]
    fn link_hello_garbage_refusal_and_close() {
        let dir = std::env::temp_dir().join(format!("vgpu-sched-link-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.sock");
        let mut link = SchedLink::new(SchedConfig {
            socket: path.clone(),
            vm_name: VmName::new("vm").unwrap(),
            fallback: FallbackShare::default(),
        });
        assert!(matches!(
            link.connect(5, None),
            Err(SchedError::Connect { .. })
        ));
        assert!(matches!(
            link.send(&Msg::Frame),
            Err(SchedError::NotConnected)
        ));
        let listener = SeqListener::bind(&path).unwrap();
        link.connect(5, None).unwrap();
        let (peer, _) = listener.accept().unwrap().unwrap();
        peer.set_nonblocking(false).unwrap();
        let mut buf = vec![0; RECV_BYTES];
        let n = peer.recv(&mut buf).unwrap().unwrap();
        assert!(matches!(
            proto::decode(&buf[..n]),
            Ok(Msg::Hello { qemu_pid: 5, .. })
        ));
        assert!(link.recv().unwrap().is_none(), "nothing yet");
        let mut p = Vec::new();
        proto::encode(&Msg::Grant { group: GroupId(4) }, &mut p);
        peer.send(b"garbage").unwrap();
        peer.send(&vec![0; RECV_BYTES + 10]).unwrap();
        peer.send(&p).unwrap();
        assert_eq!(link.recv().unwrap(), Some(Msg::Grant { group: GroupId(4) }));
        let mut r = Vec::new();
        proto::encode(
            &Msg::Refused {
                code: RefuseCode::NameInUse,
                detail: Detail::lossy("taken"),
            },
            &mut r,
        );
        peer.send(&r).unwrap();
        assert!(matches!(link.recv(), Err(SchedError::Refused { .. })));
        link.close();
        let n = peer.recv(&mut buf).unwrap().unwrap();
        assert_eq!(proto::decode(&buf[..n]), Ok(Msg::Bye));
        assert_eq!(peer.recv(&mut buf).unwrap(), Some(0), "closed");
        link.connect(0, None).unwrap();
        let (peer, _) = listener.accept().unwrap().unwrap();
        drop(peer);
        // Closed with our Hello unread: a reset or end of stream, the daemon is gone either way.
        assert!(matches!(
            link.recv(),
            Err(SchedError::Closed | SchedError::Io(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
