//! The device worker thread: owns queue processing, waiting with `event-manager` (epoll) on the
//! per-queue kick eventfds the message loop writes, the INTx resample eventfd and a control
//! eventfd. The message loop never waits for queue work, so config space, BAR reads and DMA
//! maps are answered promptly whatever the guest queues.
//!
//! There is one worker for the life of the process, serving the device of each client
//! connection in turn (attached when the connection starts, detached when it ends). GPU
//! backends such as virglrenderer may be initialised once per process and only used from the
//! thread that initialised them; this thread is where they will live.
//!
//! With a dump directory, the worker also writes the scanout images (PNG encoding runs here,
//! outside the device lock): after a RESOURCE_FLUSH at most every `min_interval` (a timer
//! catches the last flush of a burst), on a byte from the request socket (SIGUSR1), and once
//! more when it stops at disconnect.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use log::{debug, error, info, warn};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use mdev_backend::GpuBackend;
use mdev_backend::virgl::{HostGl, Virgl};
use vgpu_schedd::busy_poll::{self, BusyPoll};
use vgpu_schedd::proto::{Msg, RefuseCode};

use crate::device::Device;
use crate::gpu::dump::{self, DumpConfig};
use crate::metrics::{DeviceMetrics, inc};
use crate::sched_client::{MAX_MESSAGES_PER_WAKE, SchedConfig, SchedError, SchedLink};
use crate::virtio_pci::{CONTROL_QUEUE, NUM_QUEUES};

/// Event data of the control eventfd (queue kicks use the queue index).
const CONTROL_TOKEN: u32 = 0x100;
/// Event data of the INTx resample eventfd.
const RESAMPLE_TOKEN: u32 = 0x101;
/// Event data of virglrenderer's fence poll fd.
const VIRGL_TOKEN: u32 = 0x104;
/// Event data of the dump timer.
const DUMP_TIMER_TOKEN: u32 = 0x102;
/// Event data of the dump request socket.
const DUMP_REQUEST_TOKEN: u32 = 0x103;
/// Event data of the load engine's timer.
const LOAD_TIMER_TOKEN: u32 = 0x105;
/// Shortest load timer: a zero interval would disarm a timerfd instead of firing it.
const MIN_LOAD_TIMER: Duration = Duration::from_micros(1);
/// Event data of the scheduler daemon socket.
const SCHED_TOKEN: u32 = 0x106;
/// Event data of the scheduler daemon reconnect timer.
const SCHED_RETRY_TOKEN: u32 = 0x107;
/// Event data of the eventfd the worker signals itself with, before it blocks, to send held
/// scheduler reports.
const SCHED_REPORT_TOKEN: u32 = 0x108;
/// How soon a device reconnects to a scheduler daemon it lost after being admitted, and the
/// first wait of the backoff while the daemon stays unreachable or refuses it.
pub const SCHED_RETRY: Duration = Duration::from_secs(1);
/// The longest wait between two reconnects: the backoff doubles from [`SCHED_RETRY`] up to
/// it, and a device refused its name (`Forbidden`, `NameInUse`) waits this long at once. A
/// device that is not admitted dispatches under the fallback budget, so a slow retry costs
/// its guest speed, not its neighbours; at most this long after the daemon is back and
/// willing, the device is admitted again. Within the daemon's longest rejoin hold-back
/// after a group timeout (60 s), so a dropped device is not the one that waits longest.
pub const MAX_SCHED_RETRY: Duration = Duration::from_secs(8);
/// How often the worker looks for QEMU's connection before it says `Hello` to the daemon.
const QEMU_POLL: Duration = Duration::from_millis(20);

/// Errors starting the worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// eventfd or epoll creation failed.
    #[error("creating worker events: {0}")]
    Setup(#[source] std::io::Error),
    /// The thread could not be spawned.
    #[error("spawning the worker thread: {0}")]
    Spawn(#[source] std::io::Error),
}

/// What the message loop asks of the worker besides kicks.
#[derive(Debug)]
enum Command {
    /// Serve this connection's device.
    Attach(Arc<Mutex<Device>>),
    /// The connection ended: write the final dump, let go of the device, then acknowledge.
    Detach(SyncSender<()>),
}

/// The message loop's side of the worker: kicks and control.
#[derive(Debug)]
pub struct WorkerHandle {
    kicks: Vec<EventFd>,
    control: EventFd,
    commands: Sender<Command>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    has_renderer: bool,
}

impl WorkerHandle {
    /// Starts the worker thread; with `dump`, it also writes the scanout images.
    ///
    /// With `renderer` (a virglrenderer library name and its host API), the worker initialises virglrenderer
    /// on its own thread; if that fails the device serves 2D only (see
    /// [`WorkerHandle::has_renderer`]). With `scheduler`, each attached device connects to
    /// that scheduler daemon (see [`crate::sched_client`]).
    pub fn spawn(
        dump: Option<DumpConfig>,
        metrics: Arc<DeviceMetrics>,
        renderer: Option<(String, HostGl)>,
        scheduler: Option<SchedConfig>,
        vfio_socket: PathBuf,
        busy_poll: Duration,
    ) -> Result<WorkerHandle, WorkerError> {
        let new_efd = || EventFd::new(libc::EFD_NONBLOCK).map_err(WorkerError::Setup);
        let kicks = (0..NUM_QUEUES)
            .map(|_| new_efd())
            .collect::<Result<Vec<_>, _>>()?;
        let control = new_efd()?;
        let stop = Arc::new(AtomicBool::new(false));
        let clone = |e: &EventFd| e.try_clone().map_err(WorkerError::Setup);
        let dumper = match dump {
            Some(config) => Some(Dumper::new(config, metrics)?),
            None => None,
        };
        let (commands, received) = std::sync::mpsc::channel();
        let worker_kicks = kicks.iter().map(clone).collect::<Result<Vec<_>, _>>()?;
        let worker_control = clone(&control)?;
        let worker_stop = stop.clone();
        let stop_loop = stop.clone();
        let (ready, started) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("vgpu-worker".into())
            .spawn(move || {
                // virglrenderer is bound to the thread that initialises it: this one.
                let virgl = renderer.and_then(|(library, api)| match Virgl::new(&library, api) {
                    Ok(v) => Some(Box::new(v) as Box<dyn GpuBackend>),
                    Err(e) => {
                        warn!("no 3D: {e}; the device offers 2D only");
                        None
                    }
                });
                let has_renderer = virgl.is_some();
                let report_kick = EventFd::new(libc::EFD_NONBLOCK);
                let (load_timer, retry_timer, report_kick) =
                    match (new_timer(), new_timer(), report_kick) {
                        (Ok(a), Ok(b), Ok(c)) => (a, b, c),
                        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                            let _ = ready.send(Err(WorkerError::Setup(e)));
                            return;
                        }
                    };
                let worker = Worker {
                    load_timer,
                    sched: scheduler.map(|config| Sched {
                        link: SchedLink::new(config),
                        vfio_socket,
                        retry_timer,
                        report_kick,
                        watched: None,
                        retry: SCHED_RETRY,
                    }),
                    virgl,
                    device: None,
                    kicks: worker_kicks,
                    control: worker_control,
                    commands: received,
                    resample: None,
                    stop: worker_stop,
                    dumper,
                };
                let mut manager: EventManager<Worker> = match EventManager::new() {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = ready.send(Err(WorkerError::Setup(std::io::Error::other(e))));
                        return;
                    }
                };
                let id = manager.add_subscriber(worker);
                let _ = ready.send(Ok(has_renderer));
                // A kick, fence or grant that follows soon after the last is caught without a
                // wake-up (see vgpu_schedd::busy_poll).
                let mut busy = BusyPoll::new(busy_poll);
                let idle = |m: &mut EventManager<Worker>| {
                    if let Ok(w) = m.subscriber_mut(id) {
                        w.before_block();
                    }
                };
                while !stop_loop.load(Ordering::Acquire) {
                    if let Err(e) = busy_poll::run_round(&mut busy, &mut manager, true, idle) {
                        error!("worker event loop: {e}");
                        break;
                    }
                }
                debug!("worker stopped");
            })
            .map_err(WorkerError::Spawn)?;
        let has_renderer = match started.recv() {
            Ok(result) => result?,
            Err(_) => return Err(WorkerError::Spawn(std::io::Error::other("worker died"))),
        };
        Ok(WorkerHandle {
            kicks,
            control,
            commands,
            stop,
            thread: Some(thread),
            has_renderer,
        })
    }

    /// Whether the worker has a 3D renderer (the device may offer VIRTIO_GPU_F_VIRGL).
    pub fn has_renderer(&self) -> bool {
        self.has_renderer
    }

    fn send(&self, command: Command) {
        if self.commands.send(command).is_err() {
            error!("the worker thread is gone");
            return;
        }
        if let Err(e) = self.control.write(1) {
            warn!("waking the worker: {e}");
        }
    }

    /// Hands the device of a new connection to the worker.
    pub fn attach(&self, device: Arc<Mutex<Device>>) {
        self.send(Command::Attach(device));
    }

    /// Takes the device back at the end of a connection; returns once the worker has written
    /// the final scanout dump and dropped its reference.
    pub fn detach(&self) {
        let (ack, done) = std::sync::mpsc::sync_channel(1);
        self.send(Command::Detach(ack));
        if done.recv().is_err() {
            error!("the worker thread is gone");
        }
    }

    /// Kicks queue `q` (a doorbell write). Unknown queues are the caller's to filter.
    pub fn kick(&self, q: u16) {
        if let Some(kick) = self.kicks.get(usize::from(q))
            && let Err(e) = kick.write(1)
        {
            warn!("kicking queue {q}: {e}");
        }
    }

    /// Tells the worker to re-read the INTx resample eventfd from the device.
    pub fn resample_changed(&self) {
        if let Err(e) = self.control.write(1) {
            warn!("waking the worker: {e}");
        }
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.control.write(1);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            error!("worker thread panicked");
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn device_lock(device: &Mutex<Device>) -> MutexGuard<'_, Device> {
    device.lock().unwrap_or_else(|p| p.into_inner())
}

/// Takes the scanout images (all enabled ones, or those flushed since the last take) under
/// the device lock, then encodes and writes them without it.
fn write_frames(
    device: &Mutex<Device>,
    config: &DumpConfig,
    metrics: &DeviceMetrics,
    all: bool,
    virgl: Option<&dyn GpuBackend>,
) {
    let frames = device_lock(device).take_frames(all, virgl);
    if frames.is_empty() && all {
        debug!("no scanout shows anything; nothing to dump");
    }
    for frame in frames {
        match dump::write_frame(&config.dir, &frame) {
            Ok(path) => {
                inc(&metrics.scanout_dumps);
                if all {
                    info!("scanout {} written to {}", frame.scanout, path.display());
                }
            }
            Err(e) => {
                inc(&metrics.dump_errors);
                warn!("scanout dump: {e}");
            }
        }
    }
}

/// A timerfd the worker can read whenever epoll reported it: non-blocking, so a timer that
/// was disarmed or re-armed after its expiry was reported (a client detaching in the same
/// epoll batch) reads as nothing due instead of blocking the worker for good.
fn new_timer() -> std::io::Result<TimerFd> {
    let timer = TimerFd::new().map_err(std::io::Error::from)?;
    // SAFETY: the descriptor belongs to `timer`, which outlives this borrow.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(timer.as_raw_fd()) };
    crate::fds::set_nonblocking(fd)?;
    Ok(timer)
}

/// The worker's side of scanout dumps: rate limit, trailing-edge timer, request socket.
struct Dumper {
    config: DumpConfig,
    metrics: Arc<DeviceMetrics>,
    timer: TimerFd,
    timer_armed: bool,
    last: Option<Instant>,
    requests: Option<UnixStream>,
}

impl Dumper {
    fn new(config: DumpConfig, metrics: Arc<DeviceMetrics>) -> Result<Dumper, WorkerError> {
        let requests = match &config.requests {
            Some(r) => Some(r.try_clone().map_err(WorkerError::Setup)?),
            None => None,
        };
        Ok(Dumper {
            timer: new_timer().map_err(WorkerError::Setup)?,
            timer_armed: false,
            last: None,
            requests,
            config,
            metrics,
        })
    }

    /// After control commands ran: dump flushed scanouts if the interval allows, else arm
    /// the timer for when it does.
    fn flushed(&mut self, device: &Mutex<Device>, virgl: Option<&dyn GpuBackend>) {
        if !device_lock(device).frames_undumped() {
            return;
        }
        let since = self.last.map(|t| t.elapsed());
        match since {
            Some(since) if since < self.config.min_interval => {
                if !self.timer_armed {
                    let wait = (self.config.min_interval - since).max(Duration::from_millis(1));
                    match self.timer.reset(wait, None) {
                        Ok(()) => self.timer_armed = true,
                        Err(e) => warn!("arming the dump timer: {e}"),
                    }
                }
            }
            _ => self.write(device, false, virgl),
        }
    }

    fn write(&mut self, device: &Mutex<Device>, all: bool, virgl: Option<&dyn GpuBackend>) {
        self.last = Some(Instant::now());
        write_frames(device, &self.config, &self.metrics, all, virgl);
    }

    /// The timer expired (it is read even with no client attached, so it stops firing).
    fn timer_fired(&mut self, device: Option<&Mutex<Device>>, virgl: Option<&dyn GpuBackend>) {
        let _ = self.timer.wait();
        self.timer_armed = false;
        if let Some(device) = device {
            self.flushed(device, virgl);
        }
    }

    /// Bytes on the request socket: one dump of every enabled scanout, however many arrived
    /// (they are drained even with no client attached, so they stop firing).
    fn requested(&mut self, device: Option<&Mutex<Device>>, virgl: Option<&dyn GpuBackend>) {
        let mut buf = [0u8; 64];
        if let Some(mut r) = self.requests.as_ref() {
            while matches!(r.read(&mut buf), Ok(n) if n > 0) {}
        }
        match device {
            Some(device) => {
                debug!("scanout dump requested");
                self.write(device, true, virgl);
            }
            None => debug!("scanout dump requested with no client attached"),
        }
    }
}

struct Worker {
    /// The 3D backend (virglrenderer), created on this thread and used only here.
    virgl: Option<Box<dyn GpuBackend>>,
    /// The device of the current connection, if any.
    device: Option<Arc<Mutex<Device>>>,
    kicks: Vec<EventFd>,
    control: EventFd,
    commands: Receiver<Command>,
    resample: Option<File>,
    stop: Arc<AtomicBool>,
    dumper: Option<Dumper>,
    /// Fires when the load engine's running group finishes (or a present is due).
    load_timer: TimerFd,
    /// The scheduler daemon link, with `--scheduler`.
    sched: Option<Sched>,
}

/// The worker's side of the scheduler daemon link.
struct Sched {
    link: SchedLink,
    /// The vfio-user socket QEMU connects to: its accepted connection gives QEMU's pid.
    vfio_socket: PathBuf,
    /// Fires when the device reconnects while the daemon is unreachable or refused it.
    retry_timer: TimerFd,
    /// Signalled by the worker itself before it blocks while reports are held
    /// (`Scheduling::due_outbox`): an idle worker sends them.
    report_kick: EventFd,
    /// The socket fd in the poll set.
    watched: Option<std::os::fd::RawFd>,
    /// The wait before the next reconnect: doubles from [`SCHED_RETRY`] up to
    /// [`MAX_SCHED_RETRY`] while the daemon does not admit the device.
    retry: Duration,
}

impl Sched {
    /// Arms the reconnect after the link failed with `why`; `admitted`: the daemon had
    /// admitted the device on the link that failed (reconnect soon, the backoff restarts).
    fn retry_later(&mut self, why: &SchedError, admitted: bool) {
        let refused_name = matches!(
            why,
            SchedError::Refused {
                code: RefuseCode::Forbidden | RefuseCode::NameInUse,
                ..
            }
        );
        let wait = match (admitted, refused_name) {
            (_, true) => MAX_SCHED_RETRY,
            (true, false) => SCHED_RETRY,
            (false, false) => self.retry,
        };
        self.retry = wait.saturating_mul(2).min(MAX_SCHED_RETRY);
        if let Err(e) = self.retry_timer.reset(wait, None) {
            error!("arming the scheduler reconnect timer: {e}");
        }
    }
}

impl Worker {
    /// Connects to the scheduler daemon for the attached device; on failure, retries every
    /// [`SCHED_RETRY`].
    fn sched_connect(&mut self, ops: &mut EventOps) {
        let (Some(s), Some(device)) = (&mut self.sched, &self.device) else {
            return;
        };
        // The vfio-user crate accepts QEMU's connection internally: find it among our own
        // descriptors by the listener's address. The worker attaches before that accept, so
        // until QEMU is there, look again shortly: the daemon learns of the VM when it exists.
        let Some((qemu_fd, qemu)) = vgpu_schedd::seqpacket::accepted_peer(&s.vfio_socket) else {
            if let Err(e) = s.retry_timer.reset(QEMU_POLL, None) {
                error!("arming the scheduler reconnect timer: {e}");
            }
            return;
        };
        // The Hello carries (a duplicate of) QEMU's connection as proof of its pid.
        match s
            .link
            .connect(qemu.pid, Some(std::os::fd::AsFd::as_fd(&qemu_fd)))
        {
            Ok(()) => {
                if let Some(fd) = s.link.fd() {
                    match ops.add(Events::with_data_raw(fd, SCHED_TOKEN, EventSet::IN)) {
                        Ok(()) => s.watched = Some(fd),
                        Err(e) => error!("watching the scheduler daemon socket: {e}"),
                    }
                }
                // Admission (the daemon's Welcome) is logged, with the time spent under the
                // fallback budget when there was one to speak of.
                debug!(
                    "connected to the scheduler daemon at {}",
                    s.link.path().display()
                );
                let _ = s.retry_timer.reset(Duration::ZERO, None);
                device_lock(device).sched_connected();
                // A group the fallback budget held may ask the daemon now.
                self.run_load();
            }
            Err(e) => {
                // Logged once until admitted (the device stays under the fallback budget).
                device_lock(device).sched_gone(&e);
                s.retry_later(&e, false);
            }
        }
    }

    /// Stops watching the daemon socket and closes it (`bye`: say goodbye first).
    fn sched_close(s: &mut Sched, ops: &mut EventOps, bye: bool) {
        if let Some(fd) = s.watched.take() {
            let _ = ops.remove(Events::with_data_raw(fd, SCHED_TOKEN, EventSet::IN));
        }
        if bye {
            s.link.close();
        } else {
            s.link.drop_connection();
        }
    }

    /// The daemon link failed, or the daemon refused or dropped the device: the attached
    /// device dispatches under the fallback budget (it says so, once) until a reconnect,
    /// after a bounded backoff, is admitted again.
    fn sched_gone(&mut self, why: &SchedError, ops: &mut EventOps) {
        let Some(s) = &mut self.sched else { return };
        Self::sched_close(s, ops, false);
        let admitted = match &self.device {
            Some(device) => {
                let mut locked = device_lock(device);
                let admitted = locked.sched_admitted();
                locked.sched_gone(why);
                admitted
            }
            None => false,
        };
        s.retry_later(why, admitted);
        self.kick_control();
        self.run_load();
    }

    /// Sends what the device queued for the daemon and is due (`all`: everything, held
    /// reports too).
    fn sched_flush(&mut self, ops: &mut EventOps, all: bool) {
        let (Some(s), Some(device)) = (&self.sched, &self.device) else {
            return;
        };
        let result = device_lock(device)
            .sched_outbox(all)
            .and_then(|msgs| msgs.iter().try_for_each(|m| s.link.send(m)));
        if let Err(e) = result {
            self.sched_gone(&e, ops);
        }
    }

    /// The worker is about to block: held reports go first (through its own eventfd, so that
    /// a send that fails is handled in the event loop).
    fn before_block(&self) {
        if let (Some(s), Some(device)) = (&self.sched, &self.device)
            && device_lock(device).sched_holds_reports()
            && let Err(e) = s.report_kick.write(1)
        {
            warn!("signalling held scheduler reports: {e}");
        }
    }

    /// The daemon socket is readable: handle what arrived (a bounded number per round).
    fn sched_readable(&mut self, ops: &mut EventOps) {
        let mut resume = false;
        for _ in 0..MAX_MESSAGES_PER_WAKE {
            let Some(s) = &mut self.sched else { return };
            match s.link.recv() {
                Ok(Some(msg)) => {
                    if matches!(msg, Msg::Grant { .. } | Msg::Done { .. }) {
                        crate::sandbox::selftest_point();
                    }
                    if let Some(device) = &self.device {
                        resume |= device_lock(device).sched_message(msg);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    self.sched_gone(&e, ops);
                    return;
                }
            }
        }
        if resume {
            self.kick_control();
        }
        self.run_load();
        // A revoke or suspend sends the held reports now; a stray grant queued a cancel.
        self.sched_flush(ops, false);
    }

    /// Has the control queue processed again (a held group may go on).
    fn kick_control(&self) {
        if let Some(kick) = self.kicks.get(usize::from(CONTROL_QUEUE))
            && let Err(e) = kick.write(1)
        {
            warn!("kicking the control queue: {e}");
        }
    }

    /// Runs the device's load engine up to now and arms the timer for its next finish (or
    /// for when a group the fallback budget holds may go); the control queue is processed
    /// again when such a group may go now.
    fn run_load(&mut self) {
        let Some(device) = &self.device else {
            return;
        };
        let mut locked = device_lock(device);
        locked.load_tick();
        let release = locked.sched_release_due();
        let next = locked.load_deadline();
        drop(locked);
        if release {
            self.kick_control();
        }
        if let Some(wait) = next
            && let Err(e) = self.load_timer.reset(wait.max(MIN_LOAD_TIMER), None)
        {
            error!("arming the load timer: {e}");
        }
    }

    fn device(&self) -> Option<MutexGuard<'_, Device>> {
        self.device.as_deref().map(device_lock)
    }

    fn run_commands(&mut self, ops: &mut EventOps) {
        loop {
            match self.commands.try_recv() {
                Ok(Command::Attach(device)) => {
                    if self.dumper.is_some() {
                        device_lock(&device).retain_frames_on_reset();
                    }
                    // A finished compute request kicks the control queue, whose handler
                    // completes it.
                    match self.kicks[usize::from(CONTROL_QUEUE)].try_clone() {
                        Ok(kick) => device_lock(&device).set_compute_notify(Arc::new(kick)),
                        Err(e) => error!("compute completion eventfd: {e}"),
                    }
                    if let Some(s) = &mut self.sched {
                        device_lock(&device).sched_configure(s.link.fallback());
                        s.retry = SCHED_RETRY;
                    }
                    self.device = Some(device);
                    self.sched_connect(ops);
                }
                Ok(Command::Detach(ack)) => {
                    if let (Some(device), Some(d)) = (&self.device, &mut self.dumper) {
                        // The client is gone: write what its scanouts showed last.
                        d.write(device, true, self.virgl.as_deref());
                    }
                    // Cancels first, so the daemon never waits on a group of a client that left.
                    if let Some(device) = &self.device {
                        device_lock(device).withdraw_from_scheduler();
                    }
                    self.sched_flush(ops, true);
                    if let Some(s) = &mut self.sched {
                        Self::sched_close(s, ops, true);
                        let _ = s.retry_timer.reset(Duration::ZERO, None);
                    }
                    let device = self.device.take();
                    if let (Some(device), Some(v)) = (&device, self.virgl.as_deref()) {
                        device_lock(device).release_3d(v);
                    }
                    self.swap_resample(ops);
                    let _ = ack.send(());
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return,
            }
        }
    }

    fn swap_resample(&mut self, ops: &mut EventOps) {
        if let Some(old) = self.resample.take() {
            let _ = ops.remove(Events::with_data(&old, RESAMPLE_TOKEN, EventSet::IN));
        }
        let fd = self.device().and_then(|d| d.resample_fd());
        self.resample = fd;
        if let Some(fd) = &self.resample
            && let Err(e) = ops.add(Events::with_data(fd, RESAMPLE_TOKEN, EventSet::IN))
        {
            error!("watching the INTx resample eventfd: {e}");
        }
    }
}

impl MutEventSubscriber for Worker {
    fn init(&mut self, ops: &mut EventOps) {
        for (q, kick) in self.kicks.iter().enumerate() {
            if let Err(e) = ops.add(Events::with_data(kick, q as u32, EventSet::IN)) {
                error!("watching queue {q} kicks: {e}");
            }
        }
        if let Err(e) = ops.add(Events::with_data(
            &self.control,
            CONTROL_TOKEN,
            EventSet::IN,
        )) {
            error!("watching the control eventfd: {e}");
        }
        if let Err(e) = ops.add(Events::with_data(
            &self.load_timer,
            LOAD_TIMER_TOKEN,
            EventSet::IN,
        )) {
            error!("watching the load timer: {e}");
        }
        if let Some(s) = &self.sched {
            let fds = [
                (
                    s.retry_timer.as_raw_fd(),
                    SCHED_RETRY_TOKEN,
                    "reconnect timer",
                ),
                (
                    s.report_kick.as_raw_fd(),
                    SCHED_REPORT_TOKEN,
                    "report eventfd",
                ),
            ];
            for (fd, token, what) in fds {
                if let Err(e) = ops.add(Events::with_data_raw(fd, token, EventSet::IN)) {
                    error!("watching the scheduler {what}: {e}");
                }
            }
        }
        if let Some(fd) = self.virgl.as_deref().and_then(GpuBackend::poll_fd)
            && let Err(e) = ops.add(Events::with_data_raw(fd, VIRGL_TOKEN, EventSet::IN))
        {
            error!("watching virglrenderer's fence fd: {e}");
        }
        if let Some(d) = &self.dumper {
            if let Err(e) = ops.add(Events::with_data(&d.timer, DUMP_TIMER_TOKEN, EventSet::IN)) {
                error!("watching the dump timer: {e}");
            }
            if let Some(r) = &d.requests
                && let Err(e) = ops.add(Events::with_data(r, DUMP_REQUEST_TOKEN, EventSet::IN))
            {
                error!("watching the dump request socket: {e}");
            }
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            CONTROL_TOKEN => {
                let _ = self.control.read();
                self.run_commands(ops);
                if !self.stop.load(Ordering::Acquire) {
                    self.swap_resample(ops);
                }
            }
            RESAMPLE_TOKEN => {
                if let Some(mut fd) = self.resample.as_ref() {
                    let mut buf = [0u8; 8];
                    let _ = fd.read(&mut buf);
                }
                if let Some(mut device) = self.device() {
                    device.intx_unmasked();
                }
            }
            VIRGL_TOKEN => {
                // Always poll: it runs the fence callbacks and clears the poll fd.
                let newest = self.virgl.as_deref().and_then(GpuBackend::poll);
                if let (Some(n), Some(device)) = (newest, &self.device) {
                    device_lock(device).fences_signalled(n);
                }
                self.sched_flush(ops, false);
                // A completed group may let one the device held go.
                self.run_load();
            }
            SCHED_TOKEN => self.sched_readable(ops),
            SCHED_REPORT_TOKEN => {
                if let Some(s) = &self.sched {
                    let _ = s.report_kick.read();
                }
                self.sched_flush(ops, true);
            }
            SCHED_RETRY_TOKEN => {
                // Non-blocking: a timer disarmed since it fired reads as nothing due.
                if let Some(s) = &mut self.sched {
                    let _ = s.retry_timer.wait();
                }
                if self.sched.as_ref().is_some_and(|s| s.watched.is_none()) {
                    self.sched_connect(ops);
                }
            }
            DUMP_TIMER_TOKEN => {
                if let Some(d) = &mut self.dumper {
                    d.timer_fired(self.device.as_deref(), self.virgl.as_deref());
                }
            }
            LOAD_TIMER_TOKEN => {
                // Read even with no client attached, so that it stops firing; a timer re-armed
                // or disarmed since it fired reads as nothing due (it is non-blocking).
                let _ = self.load_timer.wait();
                self.run_load();
            }
            DUMP_REQUEST_TOKEN => {
                if let Some(d) = &mut self.dumper {
                    d.requested(self.device.as_deref(), self.virgl.as_deref());
                }
            }
            q => {
                let Ok(q) = u16::try_from(q) else { return };
                let Some(kick) = self.kicks.get(usize::from(q)) else {
                    return;
                };
                let _ = kick.read();
                let Some(device) = &self.device else {
                    debug!("kick for queue {q} with no client attached");
                    return;
                };
                let mut locked = device_lock(device);
                if let Some(v) = self.virgl.as_deref() {
                    locked.reap_3d(v);
                }
                if q == CONTROL_QUEUE {
                    locked.compute_done();
                }
                // Fairness: at most MAX_CHAINS_PER_KICK chains and MAX_BYTES_PER_KICK bytes per
                // round; re-kick if more remain, so the other events are served in between.
                let more = locked.process_queue(q, self.virgl.as_deref());
                drop(locked);
                if more {
                    let _ = self.kicks[usize::from(q)].write(1);
                }
                if q == CONTROL_QUEUE {
                    if let Some(d) = &mut self.dumper {
                        d.flushed(device, self.virgl.as_deref());
                    }
                    self.sched_flush(ops, false);
                    self.run_load();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnects_back_off_up_to_the_bound_and_refused_names_wait_longest() {
        let config = SchedConfig {
            socket: "/nonexistent".into(),
            vm_name: vgpu_schedd::proto::VmName::new("vm").unwrap(),
            fallback: Default::default(),
        };
        let mut s = Sched {
            link: SchedLink::new(config),
            vfio_socket: "/nonexistent".into(),
            retry_timer: new_timer().unwrap(),
            report_kick: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            watched: None,
            retry: SCHED_RETRY,
        };
        let refused = |code| SchedError::Refused {
            code,
            detail: String::new(),
        };
        // Not admitted: 1 s, 2 s, 4 s, 8 s, 8 s...
        let mut waits = Vec::new();
        for _ in 0..5 {
            waits.push(s.retry);
            s.retry_later(&SchedError::Closed, false);
            assert!(s.retry_timer.is_armed().unwrap());
        }
        let secs = |n| Duration::from_secs(n);
        assert_eq!(waits, [secs(1), secs(2), secs(4), secs(8), secs(8)]);
        // Lost after an admission: soon again, and the backoff starts over.
        s.retry_later(&refused(RefuseCode::Timeout), true);
        assert_eq!(s.retry, secs(2));
        // A name refused: the longest wait at once, admitted before or not.
        for code in [RefuseCode::Forbidden, RefuseCode::NameInUse] {
            s.retry = SCHED_RETRY;
            s.retry_later(&refused(code), true);
            assert_eq!(s.retry, MAX_SCHED_RETRY);
        }
    }

    #[test]
    fn a_timer_disarmed_after_expiry_reads_as_nothing_due() {
        let mut timer = new_timer().unwrap();
        timer.reset(Duration::from_millis(1), None).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        // Expired (epoll would report it), then disarmed before the worker got to it: the
        // kernel drops the pending expiry, so a blocking read would never return.
        timer.clear().unwrap();
        let (done, waited) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(timer.wait().map_err(|e| e.errno()));
        });
        let result = waited
            .recv_timeout(Duration::from_secs(10))
            .expect("reading a disarmed timer blocked");
        assert_eq!(result, Err(libc::EAGAIN));
    }
}
