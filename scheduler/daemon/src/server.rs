//! The daemon's I/O layer: one `event-manager` loop on one thread around the pure
//! [`Daemon`] core.
//!
//! It watches the device listener (`SOCK_SEQPACKET`) and every device connection, the control
//! listener (JSON lines, [`crate::control`]) and its clients, an optional loopback-only HTTP
//! listener ([`crate::http`]: Prometheus text at `GET /metrics`, the live dashboard of
//! [`crate::dashboard`] with its JSON snapshot and Server-Sent Events stream, and the
//! dashboard's requests that change the scheduler), an optional metrics listener for a central
//! Prometheus ([`crate::metrics_listener`]: `/metrics` and `/healthz` with a bearer token, TLS),
//! the scheduler timer (a timerfd armed at
//! [`Daemon::next_deadline`] after every event), a periodic tick (every [`TICK`]: cgroup CPU
//! samples of each VM whose QEMU pid is known, children started or stopped by `create` and
//! `destroy`, idle HTTP clients, a dashboard snapshot every
//! [`crate::dashboard::PUBLISH_PERIOD`] to every event stream) and a stop pipe (written by the
//! binary's signal handlers).
//!
//! With CPU weight write-back on, the first write to a VM's cgroup saves the weight file's
//! value (its launcher's setting); it is put back when the VM's device disconnects (or a new
//! QEMU takes the VM's name) and when the daemon stops, unless someone else changed the file
//! since the daemon's latest write. A daemon killed with SIGKILL cannot put it back.
//!
//! Every peer is untrusted: a device that sends what the core refuses is refused and dropped,
//! a device that does not read its messages (its socket queue stays full) is dropped, control
//! and HTTP clients are bounded in number, request size and buffered output, and so are event
//! streams (a stream that does not read is closed, none lasts more than five minutes, and a new
//! one past their number closes the oldest of the user holding the most). The HTTP requests
//! that change the scheduler need the listener's random token, which only the control
//! socket's `dashboard` request gives out, and go through the same code as the control
//! requests.
//!
//! The control socket is created with mode 0600 (0660 and the control group as its group
//! with [`ServerConfig::control_group`]) whatever the umask: the mode is set through the umask
//! around `bind`, so the socket never exists with a wider one. Every control connection is
//! then checked with `SO_PEERCRED` and `SO_PEERGROUPS` ([`ControlAccess`]) and closed at once,
//! with a rate-limited warning, when its peer is neither the daemon's user, nor root, nor in
//! the control group. `create` runs the device process with the allowed [`ServerOptions`]
//! only; its scanout dumps go to a directory the daemon makes for the VM under
//! [`ServerConfig::state_dir`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::{DirBuilder, OpenOptions, Permissions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{
    EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberId, SubscriberOps,
};
use log::{debug, error, info, warn};
use serde_json::json;
use thiserror::Error;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vmm_sys_util::timerfd::TimerFd;

use vgpu_scheduler::model::CpuHint;

use crate::busy_poll::{self, BusyPoll};

use crate::cgroup::{CgroupError, CgroupFs, CpuProbe, Hierarchy, RawWeight, VmCgroup};
use crate::control::{
    ChildInfo, ControlAccess, LineBuffer, Request, Response, ServerOptions, check_socket_dir,
};
use crate::daemon::{ConnId, Daemon, DaemonConfig, DaemonError, Peer};
use crate::dashboard::{
    self, Dashboard, FocusBody, MAX_EVENT_STREAM_BYTES, MAX_EVENT_STREAMS, PUBLISH_PERIOD,
    ParamsBody,
};
use crate::definitions::{Definition, LiveState, Store};
use crate::http::{self, HttpError, HttpRequest, Received, Route};
use crate::metrics::{self, render_metrics};
use crate::metrics_listener::{
    Accepted, ListenError, MAX_SCRAPERS, MetricsListenConfig, MetricsListener, Scraper, Step,
};
use crate::proto::{MAX_MESSAGE_BYTES, VmName};
use crate::seqpacket::{self, SeqError, SeqListener, SeqStream, monotonic_ns};

/// Period of the tick: cgroup sampling, children, client timeouts.
pub const TICK: Duration = Duration::from_millis(100);
/// Most connections accepted per wake-up of one listener, so a flood cannot starve the rest.
pub const MAX_ACCEPTS_PER_WAKE: usize = 64;
/// Most packets read from one device per wake-up (the fd is level-triggered: the rest wakes
/// the loop again after the others had their turn).
pub const MAX_PACKETS_PER_WAKE: usize = 64;
/// Most bytes read from one control or HTTP client per wake-up (an HTTP request is read to
/// its end in one wake-up when it is all there: it is far smaller).
pub const MAX_READ_PER_WAKE: usize = 256 * 1024;
/// Most request lines of one control client handled per turn. A client with more waiting is
/// served again after every other ready source has had its turn (round-robin through a wake-up
/// event), and its socket is not read meanwhile, so a batch of thousands of requests delays
/// another client by at most one turn.
pub const MAX_REQUESTS_PER_WAKE: usize = 16;
/// Most control clients at once; more are closed on accept.
pub const MAX_CONTROL_CLIENTS: usize = 64;
/// Most HTTP clients at once, event streams apart ([`MAX_EVENT_STREAMS`]). A new one past it
/// closes the oldest client still sending its request (else the oldest), so idle connections
/// can never lock a scraper out.
pub const MAX_HTTP_CLIENTS: usize = 16;
/// How long an HTTP client may take to send its request (head and body): a scraper or a
/// browser sends it with the connection, so this only bounds how long a silent or trickling
/// one holds a slot.
pub const HTTP_HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// How long an HTTP client may take to send its request and read the answer (event streams
/// have no end: they are bounded by their buffered output instead).
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
/// Most answer bytes buffered for a client that does not read them; past it the client is
/// closed.
pub const MAX_CLIENT_OUTPUT_BYTES: usize = 16 * 1024 * 1024;
/// Most device processes the daemon spawns.
pub const MAX_CHILDREN: usize = 256;
/// How long `create` waits for the child's socket to appear before it kills the child.
pub const CREATE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `destroy` (and shutdown) waits after `SIGTERM` before `SIGKILL`.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Lines of a child's stderr kept to report a failed start.
pub const STDERR_TAIL_LINES: usize = 20;
/// Umask around the control socket's `bind`: mode 0600.
const CONTROL_UMASK: u32 = 0o177;
/// Umask around the control socket's `bind` with a control group: mode 0660 (the group is
/// set right after; until then it is the daemon's own group, and the peer check still
/// applies).
const CONTROL_GROUP_UMASK: u32 = 0o117;
/// Refused control peers logged per [`REFUSAL_LOG_PERIOD`]; the rest are counted and summed up
/// in one line, so a local user connecting in a loop cannot flood the log.
const MAX_REFUSALS_LOGGED: u32 = 10;
/// See [`MAX_REFUSALS_LOGGED`].
const REFUSAL_LOG_PERIOD: Duration = Duration::from_secs(60);
/// Rounds of outbox handling per event: sending can fail and drop a device, whose teardown
/// fills the outbox again; each round drops at least one device, so this is only a backstop.
const MAX_OUTBOX_ROUNDS: usize = 64;

const DEVICE_LISTENER: u32 = 0;
const CONTROL_LISTENER: u32 = 1;
const METRICS_LISTENER: u32 = 2;
const SCHED_TIMER: u32 = 3;
const TICK_TIMER: u32 = 4;
const STOP_PIPE: u32 = 5;
/// Control clients with requests left over from their turn.
const DEFERRED_WAKE: u32 = 6;
const SCRAPE_LISTENER: u32 = 7;
/// First event token of a connection.
const FIRST_CONN_TOKEN: u32 = 16;

/// Errors that keep the daemon from starting or running.
#[derive(Debug, Error)]
pub enum ServerError {
    /// A device socket operation failed.
    #[error("device socket: {0}")]
    Socket(#[from] SeqError),
    /// Another I/O operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The configuration is refused by the core.
    #[error(transparent)]
    Daemon(#[from] DaemonError),
    /// The HTTP listener's address is not a loopback address.
    #[error("HTTP address {0} is not loopback")]
    MetricsNotLoopback(SocketAddr),
    /// The metrics listener for a central Prometheus cannot start.
    #[error(transparent)]
    MetricsListen(#[from] ListenError),
    /// The event loop failed.
    #[error("event loop: {0}")]
    EventLoop(event_manager::Error),
    /// A persistent definition could not be started.
    #[error("definition {name}: {why}")]
    Definition {
        /// Its name.
        name: String,
        /// Why.
        why: String,
    },
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> ServerError {
    move |source| ServerError::Io { what, source }
}

/// What the daemon serves and how.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The device socket.
    pub socket: PathBuf,
    /// The control socket.
    pub control: PathBuf,
    /// The group whose members may use the control socket besides the daemon's user and root
    /// (the socket is then 0660 with this group, else 0600).
    pub control_group: Option<u32>,
    /// The daemon's own directory (made 0700 when first needed): `dump/VM/` holds the scanout
    /// dumps of the device processes it creates with `--dump`.
    pub state_dir: PathBuf,
    /// The loopback address of the HTTP listener (metrics and dashboard), if any; port 0
    /// picks a free one ([`Server::metrics_addr`]).
    pub metrics: Option<SocketAddr>,
    /// The metrics listener for a central Prometheus, if any.
    pub metrics_listen: Option<MetricsListenConfig>,
    /// The core's configuration.
    pub daemon: DaemonConfig,
    /// The `vgpu-server` binary `create` runs.
    pub server_bin: PathBuf,
    /// The users and group the device processes `create` starts run as; `None`: the
    /// daemon's user.
    pub device_ids: Option<DeviceIds>,
    /// Where the cgroup and proc file systems are.
    pub cgroups: CgroupFs,
    /// The longest the loop spins for the next message before it blocks
    /// ([`crate::busy_poll`]; zero: never).
    pub busy_poll: Duration,
}

/// Who created device processes run as (`--device-uid-base`, `--device-gid`): the k-th live
/// one (k below [`MAX_CHILDREN`], the lowest free) gets its own user `uid_base + k`, so no
/// device process can signal, trace or read another's files; all share group `gid`, the
/// group of the device socket (then 0660), so they can reach the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceIds {
    /// The first device user.
    pub uid_base: u32,
    /// The device processes' group.
    pub gid: u32,
}

impl DeviceIds {
    /// The user of slot `k`, if the range does not overflow.
    fn uid(self, k: usize) -> Option<u32> {
        self.uid_base.checked_add(u32::try_from(k).ok()?)
    }

    /// Whether `uid` is one of the device users.
    fn owns(self, uid: u32) -> bool {
        uid.checked_sub(self.uid_base)
            .is_some_and(|k| usize::try_from(k).is_ok_and(|k| k < MAX_CHILDREN))
    }
}

/// The running daemon: its sockets and event loop.
#[derive(Debug)]
pub struct Server {
    manager: EventManager<Loop>,
    id: SubscriberId,
    stop_writer: UnixStream,
    busy: BusyPoll,
    /// Its sockets, removed when it is dropped (after [`Server::run`], or unused); a guard,
    /// never read.
    _sockets: BoundSockets,
}

impl Server {
    /// Binds every socket (refusing paths a live listener serves, replacing stale socket
    /// files) and sets up the loop. It sets the process's umask around the control socket's
    /// `bind` ([`seqpacket::with_umask`]): call it before starting threads that create files.
    pub fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        if let Some(addr) = config.metrics
            && !addr.ip().is_loopback()
        {
            return Err(ServerError::MetricsNotLoopback(addr));
        }
        let started = monotonic_ns();
        let daemon = Daemon::new(started, config.daemon.clone())?;
        // Before the sockets: a token or key file refused leaves nothing behind.
        let scrape = config
            .metrics_listen
            .as_ref()
            .map(MetricsListener::bind)
            .transpose()?;
        if let Some(l) = &scrape {
            let bound = l.local_addr().map_err(io_err("metrics listener"))?;
            let scheme = if l.tls() { "https" } else { "http" };
            info!("metrics for Prometheus at {scheme}://{bound}/metrics (bearer token)");
        }
        // Binding refuses a path a live daemon serves; what this start binds goes again if a
        // later step fails, as when the server is dropped.
        let mut sockets = BoundSockets::default();
        let devices = SeqListener::bind(&config.socket)?;
        sockets.0.push(config.socket.clone());
        if let Some(ids) = config.device_ids {
            // Bound with the umask's (narrower) mode, then opened to the device group only.
            let open_to_devices = || {
                std::os::unix::fs::lchown(&config.socket, None, Some(ids.gid))?;
                std::fs::set_permissions(&config.socket, Permissions::from_mode(0o660))
            };
            if let Err(source) = open_to_devices() {
                return Err(ServerError::Io {
                    what: "device socket owner",
                    source,
                });
            }
        }
        let control = bind_control(&config.control, config.control_group)?;
        sockets.0.push(config.control.clone());
        let (metrics, http_access) = match config.metrics {
            Some(addr) => {
                let l = TcpListener::bind(addr).map_err(io_err("HTTP listener"))?;
                l.set_nonblocking(true).map_err(io_err("HTTP listener"))?;
                let bound = l.local_addr().map_err(io_err("HTTP listener"))?;
                // The token stays out of the log: `vgpuctl dashboard` gives the whole URL.
                info!("metrics at http://{bound}/metrics, dashboard at http://{bound}/");
                let access = http::Access::new(bound).map_err(io_err("dashboard token"))?;
                (Some(l), Some(access))
            }
            None => (None, None),
        };
        let (stop_reader, stop_writer) = UnixStream::pair().map_err(io_err("stop pipe"))?;
        stop_reader
            .set_nonblocking(true)
            .map_err(io_err("stop pipe"))?;
        let mut tick = TimerFd::new().map_err(|e| ServerError::Io {
            what: "tick timer",
            source: e.into(),
        })?;
        tick.reset(TICK, Some(TICK)).map_err(|e| ServerError::Io {
            what: "tick timer",
            source: e.into(),
        })?;
        let timer = TimerFd::new().map_err(|e| ServerError::Io {
            what: "scheduler timer",
            source: e.into(),
        })?;
        let mut manager = EventManager::new().map_err(ServerError::EventLoop)?;
        let busy = BusyPoll::new(config.busy_poll);
        let state = Loop {
            cpu_writeback: config.daemon.cpu_writeback,
            access: ControlAccess {
                uid: seqpacket::effective_uid(),
                group: config.control_group,
            },
            refusals: LogBudget::default(),
            daemon,
            devices,
            control,
            metrics,
            http_access,
            scrape,
            dashboard: Dashboard::new(started),
            next_publish: Instant::now(),
            timer,
            tick,
            stop: stop_reader,
            wake: EventFd::new(EFD_NONBLOCK).map_err(io_err("wake-up event"))?,
            deferred: BTreeSet::new(),
            stopped: false,
            next_token: FIRST_CONN_TOKEN,
            sources: BTreeMap::new(),
            device_tokens: BTreeMap::new(),
            probes: BTreeMap::new(),
            written: BTreeMap::new(),
            cgroup_failed: BTreeSet::new(),
            children: BTreeMap::new(),
            store: None,
            config,
        };
        let id = manager.add_subscriber(state);
        info!("listening for devices and control requests");
        Ok(Server {
            manager,
            id,
            stop_writer,
            busy,
            _sockets: sockets,
        })
    }

    /// A socket whose writing of one byte stops the loop (give it to
    /// `signal_hook::low_level::pipe::register`).
    pub fn stop_handle(&self) -> io::Result<UnixStream> {
        self.stop_writer.try_clone()
    }

    /// The metrics listener's address (useful with port 0).
    pub fn metrics_addr(&mut self) -> Option<SocketAddr> {
        let state = self.manager.subscriber_mut(self.id).ok()?;
        state.metrics.as_ref()?.local_addr().ok()
    }

    /// The address of the metrics listener for a central Prometheus (useful with port 0).
    pub fn metrics_listen_addr(&mut self) -> Option<SocketAddr> {
        let state = self.manager.subscriber_mut(self.id).ok()?;
        state.scrape.as_ref()?.local_addr().ok()
    }

    /// Takes the definitions of `config_dir` as known VMs, and its live state: the policy and
    /// the VMs' parameters the daemon before this one last had (what `set-policy` and `set`
    /// changed), which it keeps up to date from now on. A live state that does not load or
    /// check is logged and left alone (the next change replaces it).
    pub fn use_config_dir(&mut self, config_dir: &Path) -> Result<(), ServerError> {
        let store = Store::new(config_dir);
        let state = self
            .manager
            .subscriber_mut(self.id)
            .map_err(ServerError::EventLoop)?;
        match store.load_live() {
            Ok(Some(live)) => state.restore_live(live),
            Ok(None) => {}
            Err(e) => error!("live state not restored: {e}"),
        }
        if !config_dir.is_dir() {
            warn!(
                "{}: no such directory; live changes (set-policy, set) are not kept across \
                 restarts",
                config_dir.display()
            );
        }
        state.store = Some(store);
        Ok(())
    }

    /// Starts persistent definition `name` at boot as a control client's `set-params` and
    /// `create` would: its parameters first (kept for the VM until it connects), then its
    /// device process; a failure to start it later is logged. A VM whose live parameters the
    /// daemon restored keeps them: the restart of the daemon is not a new start of the VM.
    pub fn start_defined(&mut self, name: &str, def: &Definition) -> Result<(), ServerError> {
        let fail = |why: String| ServerError::Definition {
            name: name.to_owned(),
            why,
        };
        let (options, params) = def.check().map_err(fail)?;
        remove_stale_socket(&def.socket);
        let state = self
            .manager
            .subscriber_mut(self.id)
            .map_err(ServerError::EventLoop)?;
        if state.daemon.knows(name) {
            info!("{name}: keeps the live parameters it had before the restart");
        } else {
            state
                .daemon
                .set_params(monotonic_ns(), name, &params)
                .map_err(|e| fail(e.to_string()))?;
        }
        state
            .create(None, name, def.socket.clone(), &options)
            .map_err(|r| match r {
                Response::Error(e) => fail(e),
                Response::Ok(v) => fail(v.to_string()),
            })
    }

    /// Runs until stopped, then stops the children it spawned and removes its sockets.
    pub fn run(mut self) -> Result<(), ServerError> {
        let mut awaited = true;
        loop {
            // Work that comes soon after the last is caught without a wake-up (a device's next
            // Submit, the Completed of a short group), while some device waits for answers:
            // devices that all dispatch under leases are not worth a spinning CPU.
            let result = busy_poll::run_round(&mut self.busy, &mut self.manager, awaited, |_| {});
            let state = self
                .manager
                .subscriber_mut(self.id)
                .map_err(ServerError::EventLoop)?;
            awaited = state.daemon.answers_awaited(monotonic_ns());
            if let Err(e) = result {
                error!("event loop: {e}");
                state.shutdown();
                return Err(ServerError::EventLoop(e));
            }
            if state.stopped {
                state.shutdown();
                return Ok(());
            }
        }
    }
}

/// A control or HTTP client: its input, its unsent output.
#[derive(Debug)]
struct Client<S> {
    stream: S,
    lines: LineBuffer,
    /// An HTTP client's request as received so far ([`http::receive`]).
    head: Vec<u8>,
    out: Vec<u8>,
    /// Most bytes `out` may hold; past it the client is closed.
    max_out: usize,
    /// Close once `out` is sent.
    closing: bool,
    /// Its input has ended.
    eof: bool,
    /// What the loop watches it for.
    interest: EventSet,
    since: Instant,
    /// A control client's credentials (`SO_PEERCRED`), logged with each change it requests;
    /// none for HTTP clients.
    peer: Option<seqpacket::PeerCred>,
}

/// What a client needs after a write.
pub(crate) enum Flushed {
    /// To be closed: done, failed, or too much unsent output.
    Close,
    /// Nothing more.
    Keep,
    /// To be watched for other events.
    Watch(RawFd, EventSet),
}

impl<S: Write + AsRawFd> Client<S> {
    fn new(stream: S) -> Self {
        Client {
            stream,
            lines: LineBuffer::default(),
            head: Vec::new(),
            out: Vec::new(),
            max_out: MAX_CLIENT_OUTPUT_BYTES,
            closing: false,
            eof: false,
            interest: EventSet::IN,
            since: Instant::now(),
            peer: None,
        }
    }

    /// Input while it may send requests and none it sent waits unanswered (those wait in
    /// its socket), output while some is unsent.
    fn wanted(&self) -> EventSet {
        let mut set = EventSet::empty();
        if !self.closing && !self.eof && !self.lines.has_line() {
            set |= EventSet::IN;
        }
        if !self.out.is_empty() {
            set |= EventSet::OUT;
        }
        set
    }

    /// Writes what the socket takes of `out`.
    fn flush(&mut self) -> Flushed {
        let result = write_some(&mut self.stream, &mut self.out);
        let done = self.out.is_empty();
        if result.is_err() || (done && self.closing) || self.out.len() > self.max_out {
            return Flushed::Close;
        }
        let want = self.wanted();
        if want == self.interest {
            return Flushed::Keep;
        }
        self.interest = want;
        Flushed::Watch(self.stream.as_raw_fd(), want)
    }
}

#[derive(Debug)]
enum Source {
    Device {
        conn: ConnId,
        stream: SeqStream,
    },
    Control(Client<UnixStream>),
    Http(Client<TcpStream>),
    /// A dashboard's event stream (`GET /events`): no timeout, bounded output.
    Events(Client<TcpStream>),
    /// A client of the metrics listener for a central Prometheus.
    Scraper(Scraper),
}

/// A cgroup probe of one VM's QEMU.
#[derive(Debug)]
struct Probe {
    pid: u32,
    probe: CpuProbe,
    /// Its latest sample.
    last: Option<CpuHint>,
}

/// A cgroup whose weight the daemon wrote: what to put back when its VM goes.
#[derive(Debug)]
struct Written {
    /// The QEMU the weight was written for.
    pid: u32,
    cgroup: VmCgroup,
    /// The weight file before the daemon's first write (the launcher's setting).
    original: RawWeight,
    /// The weight file after the daemon's latest write.
    latest: RawWeight,
}

/// What a child is waiting for.
#[derive(Debug)]
enum Waiting {
    /// Nothing: it runs.
    Running,
    /// Its socket to appear; answer the control client `token`, if any (none for a
    /// definition started at boot).
    Start {
        token: Option<u32>,
        deadline: Instant,
    },
    /// Its exit after SIGTERM; answer `token` if any.
    Stop {
        token: Option<u32>,
        deadline: Instant,
    },
}

#[derive(Debug)]
struct ChildProc {
    child: Child,
    /// Its slot in [`ServerConfig::device_ids`], if it runs as a device user.
    slot: Option<usize>,
    socket: PathBuf,
    dump_dir: Option<PathBuf>,
    tail: Arc<Mutex<VecDeque<String>>>,
    waiting: Waiting,
}

impl ChildProc {
    fn info(&self, name: &str) -> ChildInfo {
        ChildInfo {
            name: name.to_owned(),
            pid: self.child.id(),
            socket: self.socket.clone(),
            dump_dir: self.dump_dir.clone(),
        }
    }

    fn tail(&self) -> String {
        match self.tail.lock() {
            Ok(t) => t.iter().cloned().collect::<Vec<_>>().join("\n"),
            Err(_) => String::new(),
        }
    }
}

/// A log line budget: at most [`MAX_REFUSALS_LOGGED`] lines per [`REFUSAL_LOG_PERIOD`].
#[derive(Debug, Default)]
struct LogBudget {
    /// Start of the current period.
    since: Option<Instant>,
    logged: u32,
    /// Lines not logged in the current period.
    suppressed: u64,
}

impl LogBudget {
    /// Whether to log one more line now; when a period ends with lines suppressed, their
    /// count is logged first.
    fn allow(&mut self, what: &str) -> bool {
        let now = Instant::now();
        if self
            .since
            .is_none_or(|s| now.saturating_duration_since(s) >= REFUSAL_LOG_PERIOD)
        {
            if self.suppressed > 0 {
                warn!(
                    "{} more {what} in the last {REFUSAL_LOG_PERIOD:?}",
                    self.suppressed
                );
            }
            *self = LogBudget {
                since: Some(now),
                logged: 0,
                suppressed: 0,
            };
        }
        if self.logged < MAX_REFUSALS_LOGGED {
            self.logged = self.logged.saturating_add(1);
            true
        } else {
            self.suppressed = self.suppressed.saturating_add(1);
            false
        }
    }
}

/// The event loop's state (the one subscriber).
#[derive(Debug)]
struct Loop {
    config: ServerConfig,
    cpu_writeback: bool,
    /// Who may use the control socket.
    access: ControlAccess,
    /// Warnings about refused control peers.
    refusals: LogBudget,
    daemon: Daemon,
    devices: SeqListener,
    control: UnixListener,
    metrics: Option<TcpListener>,
    /// The HTTP listener's address and token, with the listener.
    http_access: Option<http::Access>,
    /// The metrics listener for a central Prometheus.
    scrape: Option<MetricsListener>,
    /// The dashboard's history and the counters of its last snapshot.
    dashboard: Dashboard,
    /// When the next dashboard snapshot is due.
    next_publish: Instant,
    timer: TimerFd,
    tick: TimerFd,
    stop: UnixStream,
    /// Readable while `deferred` is not empty.
    wake: EventFd,
    /// Control clients with requests left over from their turn.
    deferred: BTreeSet<u32>,
    stopped: bool,
    next_token: u32,
    sources: BTreeMap<u32, Source>,
    device_tokens: BTreeMap<ConnId, u32>,
    probes: BTreeMap<String, Probe>,
    /// Per VM name, the cgroup weight the daemon changed (write-back only).
    written: BTreeMap<String, Written>,
    cgroup_failed: BTreeSet<String>,
    children: BTreeMap<String, ChildProc>,
    /// The config dir's definitions and live state, once [`Server::use_config_dir`] named it.
    store: Option<Store>,
}

impl MutEventSubscriber for Loop {
    fn init(&mut self, ops: &mut EventOps) {
        let fixed: [(&dyn AsRawFd, u32); 6] = [
            (&self.devices, DEVICE_LISTENER),
            (&self.control, CONTROL_LISTENER),
            (&self.timer, SCHED_TIMER),
            (&self.tick, TICK_TIMER),
            (&self.stop, STOP_PIPE),
            (&self.wake, DEFERRED_WAKE),
        ];
        for (fd, token) in fixed {
            if let Err(e) = ops.add(Events::with_data_raw(fd.as_raw_fd(), token, EventSet::IN)) {
                error!("watching source {token}: {e}");
            }
        }
        if let Some(m) = &self.metrics
            && let Err(e) = ops.add(Events::with_data(m, METRICS_LISTENER, EventSet::IN))
        {
            error!("watching the HTTP listener: {e}");
        }
        if let Some(m) = &self.scrape
            && let Err(e) = ops.add(Events::with_data(m, SCRAPE_LISTENER, EventSet::IN))
        {
            error!("watching the metrics listener: {e}");
        }
        self.arm_timer();
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let now = monotonic_ns();
        match events.data() {
            DEVICE_LISTENER => self.accept_devices(now, ops),
            CONTROL_LISTENER => self.accept_control(ops),
            METRICS_LISTENER => self.accept_http(now, ops),
            SCRAPE_LISTENER => self.accept_scrapers(now, ops),
            SCHED_TIMER => {
                self.daemon.timer(now);
                self.carry_out(now, ops);
            }
            TICK_TIMER => {
                let _ = self.tick.wait();
                self.on_tick(now, ops);
            }
            DEFERRED_WAKE => {
                let _ = self.wake.read();
                for token in std::mem::take(&mut self.deferred) {
                    if matches!(self.sources.get(&token), Some(Source::Control(_))) {
                        self.serve_control(now, token, ops);
                    }
                }
            }
            STOP_PIPE => {
                let mut byte = [0u8; 16];
                let _ = self.stop.read(&mut byte);
                info!("stop requested");
                self.stopped = true;
            }
            token => self.serve(now, token, ops),
        }
        self.arm_timer();
    }
}

impl Loop {
    /// Arms the scheduler timer at the core's next deadline (re-arming also clears an expiry
    /// not read yet, so the timer fd is never read).
    fn arm_timer(&mut self) {
        let Some(deadline) = self.daemon.next_deadline() else {
            let _ = self.timer.clear();
            return;
        };
        let wait = deadline.saturating_sub(monotonic_ns()).max(1);
        if let Err(e) = self.timer.reset(Duration::from_nanos(wait), None) {
            error!("arming the scheduler timer: {e}");
        }
    }

    fn token(&mut self) -> u32 {
        loop {
            let t = self.next_token;
            self.next_token = t.checked_add(1).unwrap_or(FIRST_CONN_TOKEN);
            if !self.sources.contains_key(&t) {
                return t;
            }
        }
    }

    fn watch(&mut self, fd: &dyn AsRawFd, source: Source, ops: &mut EventOps) -> Option<u32> {
        let token = self.token();
        match ops.add(Events::with_data_raw(fd.as_raw_fd(), token, EventSet::IN)) {
            Ok(()) => {
                self.sources.insert(token, source);
                Some(token)
            }
            Err(e) => {
                warn!("watching a connection: {e}");
                None
            }
        }
    }

    /// Stops watching `token` and closes it; a device is disconnected from the core.
    fn close(&mut self, now: u64, token: u32, ops: &mut EventOps) {
        let Some(source) = self.sources.remove(&token) else {
            return;
        };
        self.deferred.remove(&token);
        let fd = match &source {
            Source::Device { stream, .. } => stream.as_raw_fd(),
            Source::Control(c) => c.stream.as_raw_fd(),
            Source::Http(c) | Source::Events(c) => c.stream.as_raw_fd(),
            Source::Scraper(s) => s.as_raw_fd(),
        };
        let _ = ops.remove(Events::empty_raw(fd));
        if let Source::Device { conn, .. } = source {
            self.device_tokens.remove(&conn);
            self.daemon.disconnect(now, conn);
            self.restore_gone(&live_qemus(&self.daemon));
        }
    }

    fn accept_devices(&mut self, now: u64, ops: &mut EventOps) {
        for _ in 0..MAX_ACCEPTS_PER_WAKE {
            let (stream, cred) = match self.devices.accept() {
                Ok(Some(s)) => s,
                Ok(None) => break,
                Err(e) => {
                    warn!("accepting a device: {e}");
                    break;
                }
            };
            let peer = Peer {
                pid: cred.pid,
                uid: cred.uid,
            };
            let conn = self.daemon.connect(now, peer);
            let fd = stream.as_raw_fd();
            if let Some(token) = self.watch(&fd, Source::Device { conn, stream }, ops) {
                self.device_tokens.insert(conn, token);
            } else {
                self.daemon.disconnect(now, conn);
            }
            self.carry_out(now, ops);
        }
    }

    fn accept_control(&mut self, ops: &mut EventOps) {
        for _ in 0..MAX_ACCEPTS_PER_WAKE {
            let stream = match self.control.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    warn!("accepting a control client: {e}");
                    break;
                }
            };
            let count = self
                .sources
                .values()
                .filter(|s| matches!(s, Source::Control(_)))
                .count();
            if count >= MAX_CONTROL_CLIENTS {
                warn!("control client refused: {MAX_CONTROL_CLIENTS} connected");
                continue;
            }
            let peer = match seqpacket::peer_cred(stream.as_fd()) {
                Ok(peer) => {
                    let groups = || {
                        seqpacket::peer_groups(stream.as_fd()).unwrap_or_else(|e| {
                            debug!("control client pid {}: {e}", peer.pid);
                            Vec::new()
                        })
                    };
                    if !self.access.allows(&peer, groups) {
                        if self.refusals.allow("control clients refused") {
                            warn!(
                                "control client refused: pid {} uid {} gid {} is not the \
                                 daemon's user, root or in the control group",
                                peer.pid, peer.uid, peer.gid
                            );
                        }
                        continue;
                    }
                    peer
                }
                Err(e) => {
                    warn!("control client refused: no peer credentials: {e}");
                    continue;
                }
            };
            if let Err(e) = stream.set_nonblocking(true) {
                warn!("control client: {e}");
                continue;
            }
            let fd = stream.as_raw_fd();
            let mut client = Client::new(stream);
            client.peer = Some(peer);
            self.watch(&fd, Source::Control(client), ops);
        }
    }

    fn accept_http(&mut self, now: u64, ops: &mut EventOps) {
        for _ in 0..MAX_ACCEPTS_PER_WAKE {
            let Some(listener) = &self.metrics else {
                return;
            };
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    warn!("accepting a metrics client: {e}");
                    break;
                }
            };
            if let Err(e) = stream.set_nonblocking(true) {
                debug!("metrics client refused: {e}");
                continue;
            }
            let count = self
                .sources
                .values()
                .filter(|s| matches!(s, Source::Http(_)))
                .count();
            if count >= MAX_HTTP_CLIENTS
                && let Some(oldest) = self.http_to_evict()
            {
                debug!("metrics client {oldest} closed to admit a new one");
                self.close(now, oldest, ops);
            }
            let fd = stream.as_raw_fd();
            if let Some(token) = self.watch(&fd, Source::Http(Client::new(stream)), ops) {
                // A scraper sends its request with the connection: answer it at once if it is
                // there, so it never waits behind (or is evicted by) a burst of new ones.
                self.serve_http(now, token, ops);
            }
        }
    }

    /// Accepts the metrics listener's connections: past [`MAX_SCRAPERS`] the oldest not yet
    /// answered (else the oldest) is closed for the new one.
    fn accept_scrapers(&mut self, now: u64, ops: &mut EventOps) {
        for _ in 0..MAX_ACCEPTS_PER_WAKE {
            let Some(listener) = &mut self.scrape else {
                return;
            };
            let scraper = match listener.accept() {
                Ok(Accepted::New(s)) => s,
                Ok(Accepted::Dropped) => {
                    debug!("metrics listener: connection closed, too many this second");
                    continue;
                }
                Ok(Accepted::None) => break,
                Err(e) => {
                    warn!("accepting a metrics client: {e}");
                    break;
                }
            };
            let open = self.sources.iter().filter_map(|(&t, s)| match s {
                Source::Scraper(c) => Some((t, c)),
                _ => None,
            });
            if open.clone().count() >= MAX_SCRAPERS {
                let waiting = open.clone().filter(|(_, c)| !c.answered());
                let oldest = waiting
                    .min_by_key(|(_, c)| c.since())
                    .or_else(|| open.min_by_key(|(_, c)| c.since()))
                    .map(|(t, _)| t);
                if let Some(oldest) = oldest {
                    debug!("metrics listener: client {oldest} closed to admit a new one");
                    self.close(now, oldest, ops);
                }
            }
            let fd = scraper.as_raw_fd();
            if let Some(token) = self.watch(&fd, Source::Scraper(scraper), ops) {
                self.serve_scraper(now, token, ops);
            }
        }
    }

    /// Reads a metrics listener client's request and answers it once it is whole.
    fn serve_scraper(&mut self, now: u64, token: u32, ops: &mut EventOps) {
        let Some(Source::Scraper(scraper)) = self.sources.get_mut(&token) else {
            return;
        };
        let req = match scraper.receive() {
            Step::Pending => None,
            Step::Closed => {
                self.close(now, token, ops);
                return;
            }
            Step::Refused(e) => {
                debug!("metrics listener: client {token} refused: {e}");
                scraper.answer(e.answer());
                None
            }
            Step::Request(req) => Some(req),
        };
        if let Some(req) = req {
            let route = match &self.scrape {
                Some(l) => l.authorize(&req),
                None => Err(HttpError::NotFound),
            };
            let answer = match route {
                Ok(Route::Health) => {
                    http::response("200 OK", "application/json", self.health().as_bytes())
                }
                Ok(_) => http::response(
                    "200 OK",
                    metrics::CONTENT_TYPE,
                    self.metrics_text(now).as_bytes(),
                ),
                Err(e) => {
                    debug!("metrics listener: client {token} refused: {e}");
                    e.answer()
                }
            };
            if let Some(Source::Scraper(s)) = self.sources.get_mut(&token) {
                s.answer(answer);
            }
        }
        self.flush(now, token, ops);
    }

    /// The HTTP client to close for a new one: the oldest still sending its request head,
    /// else the oldest.
    fn http_to_evict(&self) -> Option<u32> {
        let http = self.sources.iter().filter_map(|(&t, s)| match s {
            Source::Http(c) => Some((t, c)),
            _ => None,
        });
        let sending = http.clone().filter(|(_, c)| !c.closing);
        sending
            .min_by_key(|(_, c)| c.since)
            .or_else(|| http.min_by_key(|(_, c)| c.since))
            .map(|(t, _)| t)
    }

    /// Sends what the core produced, closes the connections it dropped, writes CPU weights.
    fn carry_out(&mut self, now: u64, ops: &mut EventOps) {
        let mut packet = Vec::with_capacity(MAX_MESSAGE_BYTES);
        for _ in 0..MAX_OUTBOX_ROUNDS {
            let out = self.daemon.drain();
            if out.messages.is_empty() && out.drops.is_empty() && out.weights.is_empty() {
                return;
            }
            let mut failed = Vec::new();
            for (conn, msg) in &out.messages {
                let Some(Source::Device { stream, .. }) = self
                    .device_tokens
                    .get(conn)
                    .and_then(|t| self.sources.get(t))
                else {
                    continue;
                };
                packet.clear();
                crate::proto::encode(msg, &mut packet);
                if let Err(e) = stream.send(&packet) {
                    // A device that said Bye and closed is gone, not misbehaving.
                    if e.peer_gone() {
                        debug!("{conn}: closed its end, dropping it: {e}");
                    } else {
                        warn!("{conn}: send failed, dropping it: {e}");
                    }
                    failed.push(*conn);
                }
            }
            // Weights before drops: a weight for a VM dropped now is put back with the drop.
            for w in &out.weights {
                self.write_weight(&w.vm, w.qemu_pid, w.weight);
            }
            for conn in out.drops.iter().chain(&failed) {
                if let Some(token) = self.device_tokens.get(conn).copied() {
                    self.close(now, token, ops);
                }
            }
        }
        warn!("outbox still full after {MAX_OUTBOX_ROUNDS} rounds");
    }

    /// Writes a weight hint to the cgroup of `vm`'s QEMU, saving the cgroup's own value first.
    fn write_weight(&mut self, vm: &str, qemu_pid: u32, weight: u32) {
        if !self.cpu_writeback || qemu_pid == 0 {
            return;
        }
        let cgroup = match self.config.cgroups.locate(qemu_pid) {
            Ok(cg) => cg,
            Err(e) => {
                warn!("{vm}: writing CPU weight {weight}: {e}");
                return;
            }
        };
        // A new QEMU under the VM's name, or its QEMU moved: the old cgroup gets its value back.
        if self
            .written
            .get(vm)
            .is_some_and(|w| w.pid != qemu_pid || w.cgroup != cgroup)
        {
            self.restore(vm);
        }
        let saved = self.written.get(vm).map(|w| w.original);
        match write_saving(&cgroup, weight, saved) {
            Ok((original, latest)) => {
                debug!(
                    "{vm}: CPU weight {weight} written to {} (was {})",
                    cgroup.path().display(),
                    original.value
                );
                let w = Written {
                    pid: qemu_pid,
                    cgroup,
                    original,
                    latest,
                };
                self.written.insert(vm.to_owned(), w);
            }
            Err(e) => warn!("{vm}: writing CPU weight {weight}: {e}"),
        }
    }

    /// Puts back the weight the daemon changed for `vm`, unless someone else changed it since.
    fn restore(&mut self, vm: &str) {
        let Some(w) = self.written.remove(vm) else {
            return;
        };
        let path = w.cgroup.path();
        match put_back(&w) {
            Ok(None) => info!(
                "{vm}: CPU weight of {} restored to {}",
                path.display(),
                w.original.value
            ),
            Ok(Some(now)) => info!(
                "{vm}: CPU weight of {} is {}, not the {} written: changed by someone else, left",
                path.display(),
                now.value,
                w.latest.value
            ),
            // Typically the cgroup went with its VM.
            Err(e @ CgroupError::Io { .. }) => {
                debug!("{vm}: not restoring the CPU weight: {e}")
            }
            Err(e) => warn!("{vm}: restoring the CPU weight of {}: {e}", path.display()),
        }
    }

    /// Puts back the weights of VMs that no longer run with the QEMU they were written for.
    fn restore_gone(&mut self, live: &BTreeMap<String, u32>) {
        let gone: Vec<String> = self
            .written
            .iter()
            .filter(|(name, w)| live.get(*name) != Some(&w.pid))
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            self.restore(&name);
        }
    }

    /// The core's VM list, each VM with what the daemon knows of its QEMU's cgroup.
    fn vm_list(&self) -> Vec<serde_json::Value> {
        self.daemon
            .list()
            .into_iter()
            .map(|vm| {
                let cgroup = self.cgroup_info(&vm.name);
                let mut v = serde_json::to_value(vm).unwrap_or_default();
                if let Some(obj) = v.as_object_mut() {
                    obj.insert("cgroup".to_owned(), cgroup);
                }
                v
            })
            .collect()
    }

    /// The cgroup probed for `vm`'s QEMU: path, hierarchy, vCPU threads found, latest sample
    /// and the weight saved before a write-back; `null` while there is no probe.
    fn cgroup_info(&self, vm: &str) -> serde_json::Value {
        let Some(p) = self.probes.get(vm) else {
            return serde_json::Value::Null;
        };
        let cgroup = p.probe.cgroup();
        let saved = self
            .written
            .get(vm)
            .filter(|w| w.pid == p.pid)
            .map(|w| w.original.value);
        json!({
            "path": cgroup.path(),
            "hierarchy": match cgroup.hierarchy() {
                Hierarchy::V1 => "v1",
                Hierarchy::V2 => "v2",
            },
            "vcpu_threads": p.probe.vcpu_threads(),
            "sample": p.last,
            "saved_weight": saved,
        })
    }

    fn serve(&mut self, now: u64, token: u32, ops: &mut EventOps) {
        match self.sources.get(&token) {
            Some(Source::Device { .. }) => self.serve_device(token, ops),
            Some(Source::Control(_)) => self.serve_control(now, token, ops),
            Some(Source::Http(_)) => self.serve_http(now, token, ops),
            Some(Source::Events(_)) => self.serve_events(now, token, ops),
            Some(Source::Scraper(_)) => self.serve_scraper(now, token, ops),
            None => debug!("event for closed source {token}"),
        }
    }

    fn serve_device(&mut self, token: u32, ops: &mut EventOps) {
        let mut buf = vec![0u8; MAX_MESSAGE_BYTES + 1];
        for _ in 0..MAX_PACKETS_PER_WAKE {
            let Some(Source::Device { conn, stream }) = self.sources.get(&token) else {
                return;
            };
            let conn = *conn;
            let received = stream.recv_with_fd(&mut buf);
            // Read the clock after the packet: a completion's finish time is never after it.
            let now = monotonic_ns();
            match received {
                Ok(None) => return,
                Ok(Some((0, _))) => {
                    self.close(now, token, ops);
                    self.carry_out(now, ops);
                    return;
                }
                Ok(Some((n, fd))) => {
                    // A descriptor proves the QEMU pid of a Hello: the pid of its peer. It is
                    // closed right after.
                    let proof = fd.and_then(|fd| seqpacket::peer_cred(fd.as_fd()).ok());
                    let packet = buf.get(..n).unwrap_or(&buf);
                    self.daemon
                        .receive_proven(now, conn, packet, proof.map(|c| c.pid));
                }
                // The whole buffer is one byte over the limit: the core refuses it as too long.
                Err(SeqError::Truncated(n)) => {
                    debug!("{conn}: {n}-byte packet");
                    self.daemon.receive(now, conn, &buf);
                }
                Err(e) => {
                    debug!("{conn}: {e}");
                    self.close(now, token, ops);
                }
            }
            self.carry_out(now, ops);
        }
    }

    /// Reads a control client's requests (only when it has none waiting) and answers at most
    /// [`MAX_REQUESTS_PER_WAKE`] of them; one with more waiting is deferred to the next turn.
    fn serve_control(&mut self, now: u64, token: u32, ops: &mut EventOps) {
        let Some(Source::Control(mut client)) = self.sources.remove(&token) else {
            return;
        };
        if !client.closing && !client.eof && !client.lines.has_line() {
            let mut got = Vec::new();
            let r = read_client(&mut client.stream, &mut |b| got.extend_from_slice(b));
            client.lines.push(&got);
            client.eof = r.unwrap_or(true);
        }
        let mut handled = 0usize;
        while !client.closing && handled < MAX_REQUESTS_PER_WAKE {
            match client.lines.next_line() {
                Ok(Some(line)) => {
                    handled = handled.saturating_add(1);
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    if let Some(resp) = self.request(now, token, client.peer, &line, ops) {
                        client.out.extend_from_slice(&resp.to_line());
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    client
                        .out
                        .extend_from_slice(&Response::Error(e.to_string()).to_line());
                    client.closing = true;
                }
            }
        }
        let more = !client.closing && client.lines.has_line();
        // At end of input, answers already due are still sent before the close.
        client.closing |= client.eof && !more;
        self.sources.insert(token, Source::Control(client));
        if more {
            self.deferred.insert(token);
            if let Err(e) = self.wake.write(1) {
                error!("waking the loop for deferred requests: {e}");
            }
        }
        self.flush(now, token, ops);
    }

    fn serve_http(&mut self, now: u64, token: u32, ops: &mut EventOps) {
        let Some(Source::Http(mut client)) = self.sources.remove(&token) else {
            return;
        };
        let mut eof = false;
        let mut stream = false;
        if !client.closing {
            // What does not fit the limits is read (so the close after the refusal is no
            // reset) but not kept.
            let mut state = Received::Incomplete;
            let head = &mut client.head;
            let r = read_client(&mut client.stream, &mut |b| {
                if state == Received::Incomplete {
                    state = http::receive(head, b);
                }
            });
            let answer = match state {
                Received::Complete(req) => Some(self.http_answer(now, &req, &client.stream, ops)),
                Received::Refused(e) => Some(Err(e)),
                Received::Incomplete => {
                    eof = r.unwrap_or(true);
                    None
                }
            };
            client.closing = answer.is_some();
            match answer {
                Some(Ok(HttpAnswer::Whole(out))) => client.out = out,
                Some(Ok(HttpAnswer::Stream(out))) => {
                    client.out = out;
                    client.closing = false;
                    stream = true;
                }
                Some(Err(e)) => {
                    debug!("HTTP client {token} refused: {e}");
                    client.out = e.answer();
                }
                None => {}
            }
        }
        if stream {
            self.admit_stream(now, &client, ops);
            client.max_out = MAX_EVENT_STREAM_BYTES;
            client.head = Vec::new();
            self.sources.insert(token, Source::Events(client));
        } else {
            self.sources.insert(token, Source::Http(client));
        }
        if eof {
            self.close(now, token, ops);
        } else {
            self.flush(now, token, ops);
        }
    }

    /// Makes room for the new event stream of `client` when [`MAX_EVENT_STREAMS`] are open:
    /// closes the one [`dashboard::stream_to_evict`] names.
    fn admit_stream(&mut self, now: u64, client: &Client<TcpStream>, ops: &mut EventOps) {
        let open = self
            .sources
            .values()
            .filter(|s| matches!(s, Source::Events(_)))
            .count();
        // The sockets' table is read only when a stream is to be closed.
        if open < MAX_EVENT_STREAMS {
            return;
        }
        let table = http::tcp_sockets();
        let open = self.event_streams(&table);
        let uid = http::tcp_peer(&table, &client.stream).map(|p| p.uid);
        if let Some(token) = dashboard::stream_to_evict(&open, uid) {
            info!(
                "dashboard: event stream {token} closed to admit a new one \
                 ({MAX_EVENT_STREAMS} were open)"
            );
            self.close(now, token, ops);
        }
    }

    /// The open event streams, their clients' users and unread bytes from `table`.
    fn event_streams(&self, table: &[http::TcpSocket]) -> Vec<dashboard::EventStream> {
        self.sources
            .iter()
            .filter_map(|(&token, s)| match s {
                Source::Events(c) => {
                    let peer = http::tcp_peer(table, &c.stream);
                    Some(dashboard::EventStream {
                        token,
                        age: c.since.elapsed(),
                        uid: peer.map(|p| p.uid),
                        unread: (c.out.len() as u64).saturating_add(peer.map_or(0, |p| p.unread)),
                    })
                }
                _ => None,
            })
            .collect()
    }

    /// An event stream's client: what it sends is read and dropped; its end closes it.
    fn serve_events(&mut self, now: u64, token: u32, ops: &mut EventOps) {
        let Some(Source::Events(client)) = self.sources.get_mut(&token) else {
            return;
        };
        if !client.eof {
            let r = read_client(&mut client.stream, &mut |_| {});
            client.eof = r.unwrap_or(true);
        }
        if client.eof {
            self.close(now, token, ops);
        } else {
            self.flush(now, token, ops);
        }
    }

    /// The dashboard snapshot now, as JSON.
    fn snapshot_json(&self, now: u64) -> String {
        let snapshot = self.dashboard.snapshot(
            &self.daemon.stats(now),
            &self.daemon.list(),
            self.daemon.policy(),
        );
        serde_json::to_string(&snapshot).unwrap_or_else(|_| "null".to_owned())
    }

    /// The `/metrics` answer's body: the core's statistics, the daemon process's figures and
    /// where each VM runs (the cgroup probed for its QEMU, the socket of the device process
    /// the daemon created or of its definition, its definition's vGPU type).
    fn metrics_text(&self, now: u64) -> String {
        let stats = self.daemon.stats(now);
        let process = metrics::ProcessStats::read()
            .inspect_err(|e| debug!("process metrics: {e}"))
            .ok();
        let places = stats
            .vms
            .iter()
            .filter(|vm| vm.connected)
            .map(|vm| {
                let def = self.store.as_ref().and_then(|s| s.read(&vm.name).ok());
                let socket = self.children.get(&vm.name).map(|c| c.socket.clone());
                let place = metrics::VmPlace {
                    cgroup: self.probes.get(&vm.name).map(|p| p.probe.cgroup().path()),
                    socket: socket.or_else(|| def.as_ref().map(|d| d.socket.clone())),
                    vgpu_type: def.and_then(|d| d.vgpu_type),
                };
                (vm.name.clone(), place)
            })
            .collect();
        render_metrics(&stats, &metrics::Context { process, places })
    }

    /// The body of `GET /healthz` ([`http::health_body`]).
    fn health(&self) -> String {
        let connected = self.daemon.list().iter().filter(|v| v.connected).count();
        http::health_body(connected)
    }

    /// The answer to a whole HTTP request from the client `from`, after the listener's
    /// access checks.
    fn http_answer(
        &mut self,
        now: u64,
        req: &HttpRequest,
        from: &TcpStream,
        ops: &mut EventOps,
    ) -> Result<HttpAnswer, HttpError> {
        let Some(access) = &self.http_access else {
            return Err(HttpError::NotFound);
        };
        let route = access.check(req)?;
        let whole = |content_type: &str, body: &[u8]| {
            Ok(HttpAnswer::Whole(http::response(
                "200 OK",
                content_type,
                body,
            )))
        };
        let json = "application/json";
        match route {
            Route::Page => whole("text/html; charset=utf-8", dashboard::PAGE.as_bytes()),
            Route::Script => whole(
                "text/javascript; charset=utf-8",
                dashboard::SCRIPT.as_bytes(),
            ),
            Route::Style => whole("text/css; charset=utf-8", dashboard::STYLE.as_bytes()),
            Route::Metrics => whole(metrics::CONTENT_TYPE, self.metrics_text(now).as_bytes()),
            Route::Health => whole(json, self.health().as_bytes()),
            Route::State => whole(json, self.snapshot_json(now).as_bytes()),
            Route::Policies => {
                let choices = serde_json::to_string(&dashboard::policy_choices())
                    .unwrap_or_else(|_| "[]".to_owned());
                whole(json, choices.as_bytes())
            }
            Route::Events => {
                let mut out = http::event_stream_head();
                http::push_event(&mut out, "history", &self.dashboard.history_json());
                http::push_event(&mut out, "snapshot", &self.snapshot_json(now));
                Ok(HttpAnswer::Stream(out))
            }
            Route::SetPolicy | Route::SetParams | Route::Focus => {
                let change = match route {
                    Route::SetPolicy => Change::Policy(
                        crate::control::policy_from_value(dashboard::parse_body(&req.body)?)
                            .map_err(|e| HttpError::BadRequest(e.to_string()))?,
                    ),
                    Route::SetParams => {
                        let body: ParamsBody = dashboard::parse_body(&req.body)?;
                        let params = body.change()?;
                        // The page changes the VMs it lists; it never adds one.
                        if !self.daemon.list().iter().any(|v| v.name == body.vm) {
                            return Err(HttpError::UnknownVm(body.vm));
                        }
                        Change::Params {
                            vm: body.vm,
                            params,
                            add: false,
                        }
                    }
                    _ => Change::Focus(dashboard::parse_body::<FocusBody>(&req.body)?.vm),
                };
                // The sockets' table is read only for a change, to log who asked for it.
                let who = match http::tcp_peer(&http::tcp_sockets(), from) {
                    Some(p) => format!("uid {}", p.uid),
                    None => "an unknown peer".to_owned(),
                };
                info!("dashboard: change requested by {who}: {change:?}");
                match self.change(now, change, &format!("dashboard, {who}"), ops) {
                    // The record the snapshots carry, so that the page shows the same.
                    Ok(_) => {
                        let record = self.dashboard.last_change();
                        let answer = json!({"ok": true, "change": record});
                        whole(json, answer.to_string().as_bytes())
                    }
                    Err(DaemonError::UnknownVm(vm)) => Err(HttpError::UnknownVm(vm)),
                    Err(e) => Err(HttpError::Refused(e.to_string())),
                }
            }
        }
    }

    /// Every [`PUBLISH_PERIOD`] with an HTTP listener: a dashboard snapshot into the history
    /// and to every event stream (a stream past its output limit is closed); then each stream's
    /// limits ([`dashboard::stream_end`]: its age, the bytes its client left unread).
    fn publish(&mut self, now: u64, ops: &mut EventOps) {
        if self.http_access.is_none() || Instant::now() < self.next_publish {
            return;
        }
        self.next_publish = Instant::now() + PUBLISH_PERIOD;
        let snapshot = self.dashboard.publish(
            &self.daemon.stats(now),
            &self.daemon.list(),
            self.daemon.policy(),
        );
        let mut event = Vec::new();
        http::push_event(&mut event, "snapshot", &snapshot);
        let streams: Vec<u32> = self
            .sources
            .iter()
            .filter(|(_, s)| matches!(s, Source::Events(_)))
            .map(|(&t, _)| t)
            .collect();
        if streams.is_empty() {
            return;
        }
        for token in streams {
            if let Some(Source::Events(c)) = self.sources.get_mut(&token) {
                c.out.extend_from_slice(&event);
            }
            self.flush(now, token, ops);
        }
        for stream in self.event_streams(&http::tcp_sockets()) {
            if let Some(end) = dashboard::stream_end(&stream) {
                info!("dashboard: event stream {} closed: {end}", stream.token);
                self.close(now, stream.token, ops);
            }
        }
    }

    /// A change of the scheduler, from a control request or from the dashboard (`by` says
    /// which and who): one code path for both. Returns the control request's result; the
    /// dashboard records it, refused or not, as the last change.
    fn change(
        &mut self,
        now: u64,
        change: Change,
        by: &str,
        ops: &mut EventOps,
    ) -> Result<serde_json::Value, DaemonError> {
        let kept = !matches!(change, Change::Focus(_));
        let what = change.describe();
        let result = match change {
            Change::Policy(policy) => self
                .daemon
                .set_policy(now, policy)
                .map(|()| json!({"policy": self.daemon.stats(now).policy})),
            Change::Params { vm, params, add } => self
                .check_known(&vm, add)
                .and_then(|()| self.daemon.set_params(now, &vm, &params))
                .map(|p| serde_json::to_value(p).unwrap_or_default()),
            Change::Focus(vm) => self
                .daemon
                .focus(now, &vm)
                .map(|()| serde_json::Value::Null),
            Change::Forget(vm) => self.forget(&vm).map(|()| json!({"name": vm})),
        };
        self.carry_out(now, ops);
        if kept && result.is_ok() {
            self.save_live();
        }
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let error = result.as_ref().err().map(ToString::to_string);
        self.dashboard
            .record_change(unix_ms, by, &what, error.as_deref());
        result
    }

    /// Refuses a change of VM `name` unless the daemon knows it (connected, with stored
    /// parameters or a device process, or defined in the config dir), or `add` asks to keep
    /// parameters for a VM that has not connected yet.
    fn check_known(&self, name: &str, add: bool) -> Result<(), DaemonError> {
        let defined = self.store.as_ref().is_some_and(|s| s.is_defined(name));
        if add || defined || self.daemon.knows(name) || self.children.contains_key(name) {
            return Ok(());
        }
        Err(DaemonError::NotKnown {
            name: name.to_owned(),
            known: self.known_vms(),
        })
    }

    /// Every VM name the daemon knows, in order: listed, with a device process, or defined.
    fn known_vms(&self) -> Vec<String> {
        let mut known: BTreeSet<String> =
            self.daemon.list().into_iter().map(|vm| vm.name).collect();
        known.extend(self.children.keys().cloned());
        if let Some(listed) = self.store.as_ref().and_then(|s| s.list().ok()) {
            known.extend(listed.into_iter().map(|(name, _)| name));
        }
        known.into_iter().collect()
    }

    /// Drops the stored parameters of VM `name`, which has no device process and is not
    /// connected.
    fn forget(&mut self, name: &str) -> Result<(), DaemonError> {
        if self.children.contains_key(name) {
            return Err(DaemonError::Running(name.to_owned()));
        }
        self.daemon.forget(name).map_err(|e| match e {
            DaemonError::NotKnown { name, .. } => DaemonError::NotKnown {
                name,
                known: self.known_vms(),
            },
            e => e,
        })
    }

    /// Puts the stored parameters of a live state the daemon before this one saved back, and
    /// its policy; what does not check is logged and skipped.
    fn restore_live(&mut self, live: LiveState) {
        let now = monotonic_ns();
        match self.daemon.set_policy(now, live.policy) {
            Ok(()) => info!("policy {} restored", self.daemon.stats(now).policy),
            Err(e) => error!("policy not restored: {e}"),
        }
        for (name, params) in live.params {
            match self.daemon.restore_params(&name, params) {
                Ok(()) => info!("{name}: parameters restored"),
                Err(e) => error!("{name}: parameters not restored: {e}"),
            }
        }
    }

    /// Saves the policy and the stored parameters to the config dir's live state (when the
    /// daemon has a config dir that exists); a failure is logged.
    fn save_live(&self) {
        let Some(store) = &self.store else { return };
        let live = LiveState {
            policy: self.daemon.policy().clone(),
            params: self.daemon.stored_params().clone(),
        };
        match store.save_live(&live) {
            Ok(true) => debug!("live state saved to {}", store.live_path().display()),
            Ok(false) => {}
            Err(e) => error!("live state not saved: {e}"),
        }
    }

    /// What the `dashboard` control request answers: the dashboard's URL with the token.
    fn dashboard_info(&self) -> Result<serde_json::Value, String> {
        match &self.http_access {
            Some(a) => Ok(json!({"url": a.url(), "addr": a.addr.to_string()})),
            None => Err("the HTTP listener is off: start vgpu-schedd with --http \
                         127.0.0.1:PORT to serve the dashboard"
                .to_owned()),
        }
    }

    /// Writes what `token` has pending; closes it when done and closing, or when it holds
    /// too much unsent output or the write fails; watches it for what it waits for next.
    fn flush(&mut self, now: u64, token: u32, ops: &mut EventOps) {
        let flushed = match self.sources.get_mut(&token) {
            Some(Source::Control(c)) => c.flush(),
            Some(Source::Http(c)) | Some(Source::Events(c)) => c.flush(),
            Some(Source::Scraper(s)) => s.flush(),
            Some(Source::Device { .. }) | None => return,
        };
        match flushed {
            Flushed::Keep => {}
            Flushed::Close => self.close(now, token, ops),
            Flushed::Watch(fd, set) => {
                if let Err(e) = ops.modify(Events::with_data_raw(fd, token, set)) {
                    warn!("watching client {token}: {e}");
                    self.close(now, token, ops);
                }
            }
        }
    }

    /// Carries out one control request line from the client `peer`; `None` when the answer
    /// comes later. A change is logged at info with who asked for it.
    fn request(
        &mut self,
        now: u64,
        token: u32,
        peer: Option<seqpacket::PeerCred>,
        line: &[u8],
        ops: &mut EventOps,
    ) -> Option<Response> {
        let req = match Request::parse(line) {
            Ok(r) => r,
            Err(e) => return Some(Response::Error(e.to_string())),
        };
        let who = match peer {
            Some(p) if p.pid != 0 => format!("uid {} pid {}", p.uid, p.pid),
            Some(p) => format!("uid {}", p.uid),
            None => "an unknown peer".to_owned(),
        };
        if req.changes() {
            info!("control: change requested by {who}: {req:?}");
        } else {
            debug!("control: {req:?}");
        }
        let by = format!("control socket, {who}");
        let result = match req {
            Request::List {} => Ok(json!({
                "policy": self.daemon.policy(),
                "vms": self.vm_list(),
                "children": self
                    .children
                    .iter()
                    .map(|(n, c)| c.info(n))
                    .collect::<Vec<_>>(),
            })),
            Request::Stats {} => {
                serde_json::to_value(self.daemon.stats(now)).map_err(|e| e.to_string())
            }
            Request::SetPolicy { policy } => self
                .change(now, Change::Policy(policy), &by, ops)
                .map_err(|e| e.to_string()),
            Request::SetParams { vm, params, add } => self
                .change(now, Change::Params { vm, params, add }, &by, ops)
                .map_err(|e| e.to_string()),
            Request::Forget { vm } => self
                .change(now, Change::Forget(vm), &by, ops)
                .map_err(|e| e.to_string()),
            Request::Focus { vm } => self
                .change(now, Change::Focus(vm), &by, ops)
                .map_err(|e| e.to_string()),
            Request::Dashboard {} => self.dashboard_info(),
            Request::Create {
                name,
                socket,
                options,
            } => {
                return self.create(Some(token), &name, socket, &options).err();
            }
            Request::Destroy { name } => return self.destroy(token, &name).err(),
        };
        self.carry_out(now, ops);
        Some(match result {
            Ok(v) => Response::Ok(v),
            Err(e) => Response::Error(e),
        })
    }

    /// Spawns a device process; the answer comes from [`Loop::on_tick`] (`Err` answers now).
    fn create(
        &mut self,
        token: Option<u32>,
        name: &str,
        socket: PathBuf,
        options: &ServerOptions,
    ) -> Result<(), Response> {
        let fail = |why: String| Err(Response::Error(why));
        if let Err(e) = VmName::new(name) {
            return fail(format!("invalid VM name: {e}"));
        }
        if self.children.contains_key(name) {
            return fail(format!("{name} already has a device process"));
        }
        if self.children.len() >= MAX_CHILDREN {
            return fail(format!(
                "too many device processes (at most {MAX_CHILDREN})"
            ));
        }
        match std::fs::symlink_metadata(&socket) {
            Ok(_) => return fail(format!("{} already exists", socket.display())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return fail(format!("{}: {e}", socket.display())),
        }
        if let Err(e) = check_socket_dir(&socket) {
            return fail(e.to_string());
        }
        let run_as = match self.config.device_ids {
            Some(ids) => {
                let slot =
                    (0..MAX_CHILDREN).find(|&k| !self.children.values().any(|c| c.slot == Some(k)));
                match slot.and_then(|k| Some((k, ids.uid(k)?, ids.gid))) {
                    Some(ids) => Some(ids),
                    None => return fail("no device user left in --device-uid-base".into()),
                }
            }
            None => None,
        };
        let dump_dir = if options.dump {
            let dir = self
                .make_dump_dir(name, run_as.map(|(_, uid, gid)| (uid, gid)))
                .map_err(|e| Response::Error(format!("{name}: making its dump directory: {e}")))?;
            Some(dir)
        } else {
            None
        };
        let spawned = Command::new(&self.config.server_bin)
            .arg("--socket")
            .arg(&socket)
            .arg("--scheduler")
            .arg(&self.config.socket)
            .arg("--vm-name")
            .arg(name)
            .args(options.to_args(dump_dir.as_deref()))
            .args(
                run_as
                    .iter()
                    .flat_map(|(_, uid, gid)| ["--run-as".to_string(), format!("{uid}:{gid}")]),
            )
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                return fail(format!(
                    "starting {}: {e}",
                    self.config.server_bin.display()
                ));
            }
        };
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(stderr) = child.stderr.take() {
            let (tail, vm) = (Arc::clone(&tail), name.to_owned());
            let forward = std::thread::Builder::new()
                .name(format!("stderr-{vm}"))
                .spawn(move || forward_stderr(&vm, stderr, &tail));
            if let Err(e) = forward {
                warn!("{}: no stderr forwarding: {e}", name);
            }
        }
        info!("{name}: started device process {}", child.id());
        self.daemon.reserve_name(name, child.id());
        self.children.insert(
            name.to_owned(),
            ChildProc {
                child,
                slot: run_as.map(|(k, _, _)| k),
                socket,
                dump_dir,
                tail,
                waiting: Waiting::Start {
                    token,
                    deadline: Instant::now() + CREATE_TIMEOUT,
                },
            },
        );
        Ok(())
    }

    /// The dump directory of VM `name`, `STATE/dump/NAME` (the name encoded by [`dir_name`]),
    /// made 0700 with its parents when missing. The dumps stay after the VM's device process
    /// is gone.
    /// With `owner` (a device user and group), the VM's directory is handed to it.
    fn make_dump_dir(&self, name: &str, owner: Option<(u32, u32)>) -> io::Result<PathBuf> {
        let state = &self.config.state_dir;
        if let Some(parent) = state.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let dumps = state.join("dump");
        let dir = dumps.join(dir_name(name));
        for d in [state, &dumps] {
            private_dir(d)?;
        }
        // A directory handed to an earlier device process of this VM comes back first (its
        // parent is the daemon's 0700 directory: no one else can have replaced it).
        if let Some(ids) = self.config.device_ids
            && let Ok(meta) = std::fs::symlink_metadata(&dir)
            && meta.is_dir()
            && ids.owns(meta.uid())
        {
            std::os::unix::fs::lchown(&dir, Some(seqpacket::effective_uid()), None)?;
        }
        private_dir(&dir)?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::lchown(&dir, Some(uid), Some(gid))?;
        }
        Ok(dir)
    }

    /// Sends SIGTERM to a device process; the answer comes from [`Loop::on_tick`].
    fn destroy(&mut self, token: u32, name: &str) -> Result<(), Response> {
        let Some(c) = self.children.get_mut(name) else {
            return Err(Response::Error(format!("no device process for {name:?}")));
        };
        if matches!(c.waiting, Waiting::Stop { .. }) {
            return Err(Response::Error(format!("{name} is already stopping")));
        }
        if let Err(e) = seqpacket::terminate(c.child.id()) {
            warn!("{name}: SIGTERM: {e}");
        }
        c.waiting = Waiting::Stop {
            token: Some(token),
            deadline: Instant::now() + STOP_TIMEOUT,
        };
        Ok(())
    }

    /// Queues a late answer for control client `token` (dropped if it has gone).
    /// Without a client (a definition started at boot), an error is logged.
    fn answer(&mut self, now: u64, token: Option<u32>, resp: Response, ops: &mut EventOps) {
        let Some(token) = token else {
            if let Response::Error(e) = resp {
                error!("{e}");
            }
            return;
        };
        if let Some(Source::Control(c)) = self.sources.get_mut(&token) {
            c.out.extend_from_slice(&resp.to_line());
            self.flush(now, token, ops);
        }
    }

    fn on_tick(&mut self, now: u64, ops: &mut EventOps) {
        self.sample_cpu(now);
        self.carry_out(now, ops);
        self.check_children(now, ops);
        self.publish(now, ops);
        let stale: Vec<u32> = self
            .sources
            .iter()
            .filter(|(_, s)| match s {
                Source::Http(c) => http_expired(c),
                Source::Scraper(c) => c.expired(),
                _ => false,
            })
            .map(|(&t, _)| t)
            .collect();
        for token in stale {
            debug!("metrics client {token} timed out");
            self.close(now, token, ops);
        }
    }

    /// Feeds a CPU sample of each connected VM whose QEMU pid is known to the core.
    fn sample_cpu(&mut self, now: u64) {
        let live = live_qemus(&self.daemon);
        self.probes.retain(|name, p| live.get(name) == Some(&p.pid));
        self.cgroup_failed.retain(|name| live.contains_key(name));
        for (name, pid) in live {
            if !self.probes.contains_key(&name) {
                match CpuProbe::new(self.config.cgroups.clone(), pid) {
                    Ok(probe) => {
                        let p = Probe {
                            pid,
                            probe,
                            last: None,
                        };
                        self.probes.insert(name.clone(), p);
                    }
                    Err(e) => {
                        if self.cgroup_failed.insert(name.clone()) {
                            debug!("{name}: no cgroup probe for QEMU pid {pid}: {e}");
                        }
                        continue;
                    }
                }
            }
            let Some(p) = self.probes.get_mut(&name) else {
                continue;
            };
            match p.probe.sample(now) {
                Ok(hint) => {
                    if p.last.is_none() {
                        debug!(
                            "{name}: QEMU pid {pid} in {}, {} vCPU threads",
                            p.probe.cgroup().path().display(),
                            p.probe.vcpu_threads()
                        );
                    }
                    p.last = Some(hint);
                    if let Err(e) = self.daemon.cpu_hint(now, &name, hint) {
                        debug!("{name}: CPU hint: {e}");
                    }
                }
                Err(e) => {
                    if self.cgroup_failed.insert(name.clone()) {
                        debug!("{name}: CPU sample: {e}");
                    }
                }
            }
        }
    }

    fn check_children(&mut self, now: u64, ops: &mut EventOps) {
        let names: Vec<String> = self.children.keys().cloned().collect();
        for name in names {
            let Some(c) = self.children.get_mut(&name) else {
                continue;
            };
            let exited = match c.child.try_wait() {
                Ok(s) => s,
                Err(e) => {
                    warn!("{name}: waiting for the device process: {e}");
                    None
                }
            };
            let late = match c.waiting {
                Waiting::Start { deadline, .. } | Waiting::Stop { deadline, .. } => {
                    Instant::now() > deadline
                }
                Waiting::Running => false,
            };
            let answer = match (&c.waiting, exited) {
                (Waiting::Running, None) => continue,
                (Waiting::Running, Some(status)) => {
                    warn!("{name}: device process exited: {status}");
                    None
                }
                (&Waiting::Start { token, .. }, None) => {
                    if c.socket.exists() {
                        let info = c.info(&name);
                        c.waiting = Waiting::Running;
                        let v = serde_json::to_value(info).unwrap_or_default();
                        self.answer(now, token, Response::Ok(v), ops);
                        continue;
                    }
                    if !late {
                        continue;
                    }
                    let _ = c.child.kill();
                    let _ = c.child.wait();
                    Some((
                        token,
                        Response::Error(format!(
                            "{name}: socket did not appear within {CREATE_TIMEOUT:?}; stderr:\n{}",
                            c.tail()
                        )),
                    ))
                }
                (&Waiting::Start { token, .. }, Some(status)) => Some((
                    token,
                    Response::Error(format!(
                        "{name}: device process exited ({status}); stderr:\n{}",
                        c.tail()
                    )),
                )),
                (&Waiting::Stop { token, .. }, None) => {
                    if !late {
                        continue;
                    }
                    warn!("{name}: still running {STOP_TIMEOUT:?} after SIGTERM; killing it");
                    let _ = c.child.kill();
                    let status = c.child.wait().map(|s| s.to_string()).unwrap_or_default();
                    Some((token, Response::Ok(json!({"name": name, "status": status}))))
                }
                (&Waiting::Stop { token, .. }, Some(status)) => Some((
                    token,
                    Response::Ok(json!({"name": name, "status": status.to_string()})),
                )),
            };
            if let Some(c) = self.children.remove(&name) {
                self.daemon.release_name(&name, c.child.id());
                remove_child_socket(&c.socket);
            }
            if let Some((token, resp)) = answer {
                self.answer(now, token, resp, ops);
            }
        }
    }

    /// At exit: stops the children (SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]) and reaps
    /// them (the sockets go with the [`Server`]).
    fn shutdown(&mut self) {
        let written: Vec<String> = self.written.keys().cloned().collect();
        for name in written {
            self.restore(&name);
        }
        for (name, c) in &mut self.children {
            info!("{name}: stopping device process {}", c.child.id());
            if let Err(e) = seqpacket::terminate(c.child.id()) {
                warn!("{name}: SIGTERM: {e}");
            }
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        while !self.children.is_empty() {
            self.children.retain(|_, c| {
                let running = matches!(c.child.try_wait(), Ok(None));
                if !running {
                    remove_child_socket(&c.socket);
                }
                running
            });
            if Instant::now() > deadline {
                for (name, c) in &mut self.children {
                    warn!("{name}: killing device process {}", c.child.id());
                    let _ = c.child.kill();
                    let _ = c.child.wait();
                    remove_child_socket(&c.socket);
                }
                self.children.clear();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The sockets a daemon has bound: removed when dropped, so that a start that fails after
/// binding some, and a server that stops or is never run, leave nothing behind.
#[derive(Debug, Default)]
struct BoundSockets(Vec<PathBuf>);

impl Drop for BoundSockets {
    fn drop(&mut self) {
        for path in &self.0 {
            remove_socket(path);
        }
    }
}

/// Binds the control socket at `path` with mode 0600, or 0660 and group `group`, through the
/// umask (no window with a wider mode), after removing a stale socket file there.
fn bind_control(path: &Path, group: Option<u32>) -> Result<UnixListener, ServerError> {
    seqpacket::remove_stale(path, |p| match UnixStream::connect(p) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(false),
        Err(source) => Err(SeqError::Sys {
            call: "connect",
            source,
        }),
    })?;
    let mask = match group {
        Some(_) => CONTROL_GROUP_UMASK,
        None => CONTROL_UMASK,
    };
    let listener = seqpacket::with_umask(mask, || UnixListener::bind(path))
        .map_err(io_err("control socket"))?;
    let set_up = || {
        if let Some(gid) = group {
            // lchown: never follows a link someone put in the socket's place.
            std::os::unix::fs::lchown(path, None, Some(gid))?;
        }
        listener.set_nonblocking(true)
    };
    if let Err(source) = set_up() {
        remove_socket(path);
        return Err(ServerError::Io {
            what: "control socket owner",
            source,
        });
    }
    Ok(listener)
}

/// Makes directory `dir` with mode 0700, or checks the one there: a directory (not a link to
/// one) owned by the daemon's user, made 0700 if it was wider.
fn private_dir(dir: &Path) -> io::Result<()> {
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    // Through the opened directory, so the checks and the chmod are about the same inode.
    let d = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)?;
    let meta = d.metadata()?;
    if meta.uid() != seqpacket::effective_uid() {
        return Err(io::Error::other(format!(
            "{} is owned by uid {}, not the daemon's user",
            dir.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o7777 != 0o700 {
        d.set_permissions(Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// A VM name as one directory name: ASCII letters, digits, `_`, `-` and (not first) `.` stay,
/// every other byte becomes `%XX`. Injective (a `%` is encoded too), never `.`, `..` or a
/// path with `/`, and at most 3 bytes per name byte (192 for the longest name).
fn dir_name(vm: &str) -> String {
    let mut out = String::with_capacity(vm.len());
    for (i, b) in vm.bytes().enumerate() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && i > 0) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The QEMU pid of every connected VM that announced one, by VM name.
fn live_qemus(daemon: &Daemon) -> BTreeMap<String, u32> {
    daemon
        .list()
        .into_iter()
        .filter_map(|vm| Some((vm.name, vm.qemu_pid.filter(|&p| p != 0)?)))
        .collect()
}

/// Writes `weight` to `cgroup`; returns the value to put back later (`saved`, else the file's
/// value before the write) and the file's value after it.
fn write_saving(
    cgroup: &VmCgroup,
    weight: u32,
    saved: Option<RawWeight>,
) -> Result<(RawWeight, RawWeight), CgroupError> {
    let original = match saved {
        Some(raw) => raw,
        None => cgroup.raw_weight()?,
    };
    cgroup.set_weight(weight)?;
    Ok((original, cgroup.raw_weight()?))
}

/// Puts `w.original` back unless the file no longer holds the daemon's latest write: `Ok(None)`
/// when put back, `Ok(Some(value))` with the foreign value left in place.
fn put_back(w: &Written) -> Result<Option<RawWeight>, CgroupError> {
    let now = w.cgroup.raw_weight()?;
    if now != w.latest {
        return Ok(Some(now));
    }
    w.cgroup.set_raw_weight(w.original)?;
    Ok(None)
}

fn remove_socket(path: &Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        warn!("removing {}: {e}", path.display());
    }
}

/// Removes the socket a device process the daemon created left behind once it is reaped (a
/// device process killed by a signal does not remove it), so that the VM can be created again
/// on the same path. `create` made sure nothing was there before; only a socket is removed.
fn remove_child_socket(path: &Path) {
    if is_socket(path) {
        remove_socket(path);
    }
}

/// Whether a socket (not a link to one) is at `path`.
fn is_socket(path: &Path) -> bool {
    std::fs::symlink_metadata(path)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
}

/// Removes a definition's socket that nobody serves any more (a connection is refused): what a
/// device process killed with its daemon leaves behind (systemd kills the unit's whole cgroup
/// when the daemon crashes, and nobody removes the sockets), so that the daemon's restart can
/// start the definition again. Only for definitions, which the administrator wrote; a live
/// socket, or anything that is not a socket, is left alone and `create` refuses the path.
fn remove_stale_socket(path: &Path) {
    if !is_socket(path) {
        return;
    }
    match UnixStream::connect(path) {
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            info!("{}: nobody serves it, removing it", path.display());
            remove_socket(path);
        }
        Err(e) => debug!("{}: {e}; left alone", path.display()),
        Ok(_) => debug!("{}: served by a live process; left alone", path.display()),
    }
}

/// Forwards a child's stderr to the log, keeping its last [`STDERR_TAIL_LINES`] lines.
fn forward_stderr(name: &str, stderr: impl Read, tail: &Mutex<VecDeque<String>>) {
    let reader = BufReader::new(stderr);
    for line in reader.split(b'\n') {
        let Ok(line) = line else { return };
        let line = String::from_utf8_lossy(&line).into_owned();
        info!("[{name}] {line}");
        if let Ok(mut t) = tail.lock() {
            t.push_back(line);
            while t.len() > STDERR_TAIL_LINES {
                t.pop_front();
            }
        }
    }
}

/// Reads what a client sent (up to [`MAX_READ_PER_WAKE`]); `Ok(true)` at end of stream.
pub(crate) fn read_client<S: Read>(
    stream: &mut S,
    sink: &mut dyn FnMut(&[u8]),
) -> io::Result<bool> {
    let mut buf = [0u8; 16 * 1024];
    let mut total = 0usize;
    while total < MAX_READ_PER_WAKE {
        match stream.read(&mut buf) {
            Ok(0) => return Ok(true),
            Ok(n) => {
                total = total.saturating_add(n);
                sink(buf.get(..n).unwrap_or(&[]));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// Writes as much of `out` as the socket takes; removes what was written.
pub(crate) fn write_some<S: Write>(stream: &mut S, out: &mut Vec<u8>) -> io::Result<()> {
    let mut written = 0usize;
    let result = loop {
        let Some(rest) = out.get(written..).filter(|r| !r.is_empty()) else {
            break Ok(());
        };
        match stream.write(rest) {
            Ok(0) => break Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => written = written.saturating_add(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    out.drain(..written.min(out.len()));
    result
}

/// Whether an HTTP client has had its time: [`HTTP_HEAD_TIMEOUT`] to send its request head,
/// [`HTTP_TIMEOUT`] in all.
fn http_expired(c: &Client<TcpStream>) -> bool {
    let age = c.since.elapsed();
    age > HTTP_TIMEOUT || (!c.closing && age > HTTP_HEAD_TIMEOUT)
}

/// What an HTTP request gets.
enum HttpAnswer {
    /// A whole answer, then the connection closes.
    Whole(Vec<u8>),
    /// The start of an event stream: the connection stays.
    Stream(Vec<u8>),
}

/// A change of the scheduler ([`Loop::change`]).
#[derive(Debug)]
enum Change {
    /// Install a policy.
    Policy(vgpu_scheduler::PolicyConfig),
    /// Change a VM's parameters.
    Params {
        /// The VM.
        vm: String,
        /// The fields to change.
        params: vgpu_scheduler::sim::ParamsOverride,
        /// Whether a VM the daemon does not know may be added.
        add: bool,
    },
    /// Focus a VM.
    Focus(String),
    /// Forget a VM's stored parameters.
    Forget(String),
}

impl Change {
    /// What it asks for, as `vgpuctl` says it (the dashboard's "Last change").
    fn describe(&self) -> String {
        match self {
            Change::Policy(p) => format!("set-policy {}", dashboard::policy_label(p)),
            Change::Params { vm, params, .. } => {
                format!("set {vm} {}", dashboard::params_text(params))
            }
            Change::Focus(vm) => format!("focus {vm}"),
            Change::Forget(vm) => format!("forget {vm}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake cgroup v2 tree with pid 100 in `vm`, whose `cpu.weight` is `weight`.
    fn fake_v2(weight: &str) -> (tempfile::TempDir, CgroupFs, VmCgroup) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let write = |rel: &str, text: &str| {
            let path = root.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write("proc/100/cgroup", "0::/vm\n");
        write("unified/vm/cgroup.controllers", "cpu\n");
        write("unified/vm/cpu.weight", weight);
        let fs = CgroupFs {
            v1_cpu_root: root.join("cpu"),
            v1_cpuacct_root: root.join("cpuacct"),
            v2_root: root.join("unified"),
            proc_root: root.join("proc"),
        };
        let cgroup = fs.locate(100).unwrap();
        (dir, fs, cgroup)
    }

    #[test]
    fn written_weights_are_put_back_unless_changed_since() {
        let (dir, _fs, cgroup) = fake_v2("77\n");
        let file = dir.path().join("unified/vm/cpu.weight");
        let read = || std::fs::read_to_string(&file).unwrap();
        let (original, latest) = write_saving(&cgroup, 200, None).unwrap();
        assert_eq!((original.value, latest.value), (77, 200));
        // A second write keeps the first saved value.
        let (original, latest) = write_saving(&cgroup, 300, Some(original)).unwrap();
        assert_eq!((original.value, latest.value), (77, 300));
        assert_eq!(read(), "300\n");
        let w = Written {
            pid: 100,
            cgroup: cgroup.clone(),
            original,
            latest,
        };
        assert_eq!(put_back(&w).unwrap(), None);
        assert_eq!(read(), "77\n");

        // The operator changed it after the daemon's write: left alone.
        write_saving(&cgroup, 300, None).unwrap();
        std::fs::write(&file, "500\n").unwrap();
        assert_eq!(put_back(&w).unwrap().map(|r| r.value), Some(500));
        assert_eq!(read(), "500\n");

        // The cgroup went with its VM: an error, nothing created.
        std::fs::remove_file(&file).unwrap();
        assert!(matches!(put_back(&w), Err(CgroupError::Io { .. })));
        assert!(!file.exists());
        // A weight outside the v2 range is refused before anything is written.
        std::fs::write(&file, "77\n").unwrap();
        assert!(write_saving(&cgroup, 0, None).is_err());
        assert_eq!(read(), "77\n");
    }

    #[test]
    fn vm_names_become_one_plain_directory_name() {
        assert_eq!(dir_name("vm1.test_a-b"), "vm1.test_a-b");
        assert_eq!(dir_name(".."), "%2E.");
        assert_eq!(dir_name("a/../b"), "a%2F..%2Fb");
        assert_eq!(dir_name("50% é"), "50%25%20%C3%A9");
        assert_ne!(dir_name("%2E"), dir_name("."));
    }

    #[test]
    fn private_dirs_are_made_0700_and_checked() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("d");
        private_dir(&dir).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&dir), 0o700);
        std::fs::set_permissions(&dir, Permissions::from_mode(0o755)).unwrap();
        private_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        // A link is not followed, a file is not a directory.
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(private_dir(&link).is_err());
        let file = root.path().join("f");
        std::fs::write(&file, "").unwrap();
        assert!(private_dir(&file).is_err());
    }

    #[test]
    fn refusal_warnings_are_bounded_per_period() {
        let mut budget = LogBudget::default();
        let logged = (0..100).filter(|_| budget.allow("refusals")).count();
        assert_eq!(logged, MAX_REFUSALS_LOGGED as usize);
        assert_eq!(budget.suppressed, 90);
        // A new period starts over (its first line also sums up the last one).
        budget.since = Instant::now().checked_sub(REFUSAL_LOG_PERIOD);
        assert!(budget.allow("refusals"));
        assert_eq!((budget.logged, budget.suppressed), (1, 0));
    }

    #[test]
    fn write_some_keeps_the_rest() {
        let mut sink = Vec::new();
        let mut out = b"hello".to_vec();
        write_some(&mut sink, &mut out).unwrap();
        assert!(out.is_empty());
        assert_eq!(sink, b"hello");
    }

    #[test]
    fn a_client_that_does_not_read_is_closed_past_its_output_limit() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut c = Client::new(ours);
        c.max_out = MAX_EVENT_STREAM_BYTES;
        // Within the limit: kept, watched for output, whatever the socket did not take.
        c.out = vec![b'x'; MAX_EVENT_STREAM_BYTES];
        assert!(matches!(c.flush(), Flushed::Watch(_, set) if set.contains(EventSet::OUT)));
        assert!(
            !c.out.is_empty(),
            "the peer reads nothing, the socket filled"
        );
        // Past it (one more snapshot, say): closed.
        let room = MAX_EVENT_STREAM_BYTES - c.out.len();
        c.out.extend(std::iter::repeat_n(b'y', room + 1));
        assert!(matches!(c.flush(), Flushed::Close));
        drop(theirs);
    }
}
