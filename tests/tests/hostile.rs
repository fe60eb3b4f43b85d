//! The malicious-guest suite: a well-behaved VM measures its own rate of completed groups
//! (fenced load OCCUPY groups on the daemon's engine alternating with virgl SUBMIT_3D groups,
//! each of which needs a Grant) first on its own and then next to a hostile VM or peer, case by
//! case, on one real `vgpu-schedd` (fair queuing) with a `vgpu-server` process per VM:
//!
//! | case | the hostile side |
//! |------|------------------|
//! | `reset_during_submit` | queues virgl groups and resets the device before they can be granted |
//! | `reset_after_grant` | resets once the daemon counts its virgl group dispatched |
//! | `reset_during_fence` | resets 0 to 3 ms after queuing a fenced virgl group (between grant and fence) |
//! | `reset_storm` | resets and re-initialisations back to back (hundreds per window) |
//! | `load_flood` | 4096 unfenced load groups, then a fenced virgl group, again and again |
//! | `indirect_chains` | INDIRECT descriptors (never negotiated) naming a 65535-entry table |
//! | `ring_amplification` | 256 chains naming one 1 MiB buffer, kicked again and again |
//! | `oversized_3d` | 16384² textures and many small ones, unreferenced and created again |
//! | `dma_unmap` | a raw vfio-user client unmapping all guest RAM (rings included) while chains wait, re-initialising after NEEDS_RESET |
//! | `never_completes` | a fake device on the daemon's socket that never completes its grants |
//! | `squatter_after` | a fake device of another uid (when run as root) claiming the VM's name while it is connected |
//! | `squatter_before` | the same, after the VM's device used the name once and before it connects again |
//!
//! A case passes when the daemon and both device processes are alive afterwards (a fake peer
//! may be dropped), the daemon's RSS grew by at most [`DAEMON_RSS_GROWTH_MAX_KIB`] and the
//! hostile device process's by at most [`HOSTILE_RSS_GROWTH_MAX_KIB`], the name checks of the
//! squatter cases hold, and the neighbour kept at least [`MIN_RATIO`] of its standalone rate.
//! Every case runs (one test, in sequence, so that the rates are not measured against the
//! suite's other cases) and the table is printed and written to `hostile.json` in cargo's test
//! temporary directory before the verdict. `VGPU_HOSTILE_CASES=a,b` runs only the cases named;
//! `VGPU_HOSTILE_POLICY=none` (or another policy family) replaces the default fair queuing.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vgpu_guest_drivers::guest_ram::GuestRam;
use vgpu_guest_drivers::virtio_gpu::{
    self, CAPSET_LOAD, CONTROL_QUEUE, CTRL_HDR_SIZE, CtrlHeader, LOAD_OP_END_FRAME, LOAD_OP_OCCUPY,
    RESP_OK_NODATA, ResourceCreate3d,
};
use vgpu_guest_drivers::virtio_pci::Descriptor;
use vgpu_tests::daemon::Schedd;
use vgpu_tests::guest::{ServerProcess, server_binary};
use vgpu_tests::raw_guest::RawGuest;
use vgpu_tests::server::{CONTROL_QUEUE_SIZE, VgpuGuest};
use vgpu_tests::{TempDir, skip_without_qemu};

/// The acceptance: the neighbour keeps this fraction of its standalone rate.
const MIN_RATIO: f64 = 0.9;
/// How long each window of the well-behaved VM lasts (about 200 groups).
const WINDOW: Duration = Duration::from_secs(1);
/// Windows under attack per case, each between two windows alone: alone, attacked, alone, ...,
/// alone. Three seconds of each, interleaved so that a drift of the machine's load (other
/// builds on a 2-core machine under TCG) weighs on both figures alike.
const ROUNDS: usize = 3;
/// How far the daemon's RSS may grow during a case: its tables for one misbehaving device
/// are bounded by `MAX_GROUPS_PER_DEVICE` groups of well under a KiB each.
const DAEMON_RSS_GROWTH_MAX_KIB: u64 = 32 << 10;
/// The resource budget the hostile device runs with (`--resource-memory-mb`).
const HOSTILE_RESOURCE_MB: u64 = 256;
/// How far the hostile device process's RSS may grow: its resource budget plus 128 MiB for
/// queue copies, virglrenderer's own state and the allocator's slack.
const HOSTILE_RSS_GROWTH_MAX_KIB: u64 = (HOSTILE_RESOURCE_MB + 128) << 10;
/// How long the well-behaved VM runs before its first window, unmeasured: the first frames
/// pay for virglrenderer's and the daemon's warm-up.
const WARM_UP: Duration = Duration::from_secs(1);
/// Longest wait for one request of the well-behaved VM, or for a request of the hostile one
/// that its device must answer (a device silent for this long counts as hung; the hostile side
/// runs at nice 19 on a loaded machine, so this is far from a request's usual time).
const TIMEOUT: Duration = Duration::from_secs(10);
/// Longest wait for the well-behaved VM's requests still queued after a window; past it the
/// VM is stalled.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Requests the well-behaved VM keeps queued: three frames' worth, so that the engine does not
/// idle while its driver waits for a CPU on a loaded machine.
const DEPTH: usize = 6;
/// The well-behaved VM's load groups: 10 ms of engine time each, which makes its rate bound by
/// the scheduled engine (100 frames/s) rather than by the CPU time its qtest driver needs per
/// request (1 to 2 ms).
const GOOD_OCCUPY_US: u64 = 10_000;
/// Delays of `reset_during_fence` after its submit, in ms: 0 up to this, exclusive; the
/// grant and the fence of an empty virgl group come within a few ms.
const FENCE_DELAY_STEPS: u64 = 4;
/// Load groups per round of `load_flood`.
const FLOOD_GROUPS: usize = 4096;
/// The hostile VM's control queue size: the device's largest, for 256-chain rings.
const HOSTILE_QUEUE_SIZE: u16 = 256;
/// Chains per round of `ring_amplification`.
const AMPLIFY_CHAINS: u16 = 256;
/// The one buffer every chain of `ring_amplification` names.
const AMPLIFY_BYTES: u32 = 1 << 20;
/// Entries of the indirect table of `indirect_chains` (the most a 16-bit `next` can chain).
const INDIRECT_ENTRIES: u32 = 65535;
/// Edge of the oversized textures.
const HUGE_EDGE: u32 = 16384;
/// Oversized textures asked for per round of `oversized_3d`.
const HUGE_PER_ROUND: u32 = 16;
/// Small textures asked for per round of `oversized_3d`.
const SMALL_PER_ROUND: u32 = 64;
/// How long the hostile side waits for the used ring of a ring it abuses before moving on.
const HOSTILE_WAIT: Duration = Duration::from_millis(500);
/// How long a reset case waits for the daemon to count its group dispatched.
const DISPATCH_WAIT: Duration = Duration::from_secs(1);
/// The unprivileged user the squatter runs as.
const NOBODY: u32 = 65534;
/// How long the squatter cases give the real device to hold its name.
const NAME_WAIT: Duration = Duration::from_secs(5);

/// The daemon's policy unless `VGPU_HOSTILE_POLICY` names another: fair queuing, the one
/// meant to isolate VMs from each other (disengaged: every vGPU holds a lease).
const DEFAULT_POLICY: &str = "fair";
const GOOD: &str = "good";
const HOSTILE: &str = "hostile";
const LOAD_CTX: u32 = 3;
const GL_CTX: u32 = 4;
/// VIRGL_FORMAT_B8G8R8A8_UNORM, bind render target | sampler view.
const BGRA: u32 = 1;
const BIND: u32 = 0x2 | 0x8;
/// virtio status bit DEVICE_NEEDS_RESET.
const NEEDS_RESET: u8 = 0x40;
/// `VRING_DESC_F_INDIRECT`.
const DESC_F_INDIRECT: u16 = 4;
/// `VRING_DESC_F_NEXT`.
const DESC_F_NEXT: u16 = 1;

/// Starts a `vgpu-server` process scheduled by `daemon` as `name`.
fn scheduled_server(daemon: &Schedd, name: &str, extra: &[String]) -> ServerProcess {
    let mut args = vec![
        "--scheduler".to_string(),
        daemon.socket().display().to_string(),
        "--vm-name".to_string(),
        name.to_string(),
    ];
    args.extend_from_slice(extra);
    let binary = server_binary().expect("vgpu-server binary");
    ServerProcess::start(&binary, true, &args).expect("vgpu-server starts")
}

/// Attaches a qtest guest to `server` and brings the device up with every feature it offers
/// (virgl and CONTEXT_INIT included) and a control queue of `queue_size`; `None` when the
/// server found no virglrenderer and `VGPU_REQUIRE_VIRGL` is not set.
fn attach_virgl(server: &ServerProcess, queue_size: u16) -> Option<(VgpuGuest, u64)> {
    let mut guest = VgpuGuest::attach(server.socket(), true);
    let features = guest.virgl_features()?;
    guest
        .try_bring_up_with(features, queue_size)
        .expect("bring-up with virgl");
    Some((guest, features))
}

/// Sends one request and waits for its response header's type.
fn call(guest: &mut VgpuGuest, request: &[u8], timeout: Duration) -> Result<u32, String> {
    let qt = guest.vm.qtest();
    let done = guest
        .dev
        .transact(
            qt,
            CONTROL_QUEUE,
            &[request],
            &[CTRL_HDR_SIZE as u32],
            timeout,
        )
        .map_err(|e| e.to_string())?;
    let reply = done.writable.ok_or("not our chain")?.remove(0);
    CtrlHeader::parse(&reply)
        .map(|h| h.ctrl_type)
        .map_err(|e| e.to_string())
}

/// Creates the load and the GL context.
fn contexts(guest: &mut VgpuGuest, timeout: Duration) -> Result<(), String> {
    for (ctx, capset, name) in [
        (LOAD_CTX, CAPSET_LOAD, &b"load"[..]),
        (GL_CTX, 1, &b"gl"[..]),
    ] {
        let answer = call(guest, &virtio_gpu::ctx_create(ctx, capset, name), timeout)?;
        if answer != RESP_OK_NODATA {
            return Err(format!("CTX_CREATE {ctx}: {answer:#x}"));
        }
    }
    Ok(())
}

fn gl_submit(fence: u64) -> Vec<u8> {
    virtio_gpu::with_fence(virtio_gpu::submit_3d(GL_CTX, &[0]), fence)
}

/// The well-behaved VM.
struct GoodVm {
    /// Dropped first: QEMU goes before its device process.
    guest: VgpuGuest,
    server: ServerProcess,
    /// Queued requests: head, and whether it is a frame.
    pending: VecDeque<(u16, bool)>,
    next_fence: u64,
    /// Requests answered with an error (none are expected).
    refused: u64,
    /// Whether its queue did not drain after a window.
    stalled: bool,
}

impl GoodVm {
    fn start(daemon: &Schedd) -> Option<GoodVm> {
        let server = scheduled_server(daemon, GOOD, &[]);
        let (mut guest, _) = attach_virgl(&server, CONTROL_QUEUE_SIZE)?;
        contexts(&mut guest, TIMEOUT).expect("the well-behaved VM's contexts");
        Some(GoodVm {
            guest,
            server,
            pending: VecDeque::new(),
            next_fence: 1,
            refused: 0,
            stalled: false,
        })
    }

    /// Queues the next request, each fenced: in turn a frame (a load OCCUPY ending with
    /// END_FRAME, so that its fence also waits for the daemon's Present) and a virgl
    /// SUBMIT_3D (which waits for a Grant).
    fn submit(&mut self) {
        let fence = self.next_fence;
        self.next_fence += 1;
        let frame = fence % 2 == 1;
        let request = if frame {
            let commands = [
                (LOAD_OP_OCCUPY, 0, GOOD_OCCUPY_US),
                (LOAD_OP_END_FRAME, 0, 0),
            ];
            virtio_gpu::with_fence(virtio_gpu::load_submit(LOAD_CTX, &commands), fence)
        } else {
            gl_submit(fence)
        };
        let qt = self.guest.vm.qtest();
        let head = self
            .guest
            .dev
            .request(qt, CONTROL_QUEUE, &[&request], &[CTRL_HDR_SIZE as u32])
            .expect("request queued");
        self.pending.push_back((head, frame));
    }

    /// Waits up to `timeout` for the oldest pending request: `None` if it is not done, else
    /// whether it was a frame.
    fn wait_one(&mut self, timeout: Duration) -> Option<bool> {
        let qt = self.guest.vm.qtest();
        let done = self.guest.dev.wait_used(qt, CONTROL_QUEUE, timeout).ok()?;
        let (head, frame) = self.pending.pop_front().expect("a pending request");
        assert_eq!(done.used.id, u32::from(head), "completions in order");
        let reply = done.writable.expect("our chain").remove(0);
        if CtrlHeader::parse(&reply).map(|h| h.ctrl_type).ok() != Some(RESP_OK_NODATA) {
            self.refused += 1;
        }
        Some(frame)
    }

    /// Completed groups and frames per second over `window`, keeping [`DEPTH`] requests
    /// queued; then drains.
    fn measure(&mut self, window: Duration) -> Rate {
        if self.stalled {
            return Rate::default();
        }
        let start = Instant::now();
        let (mut groups, mut frames) = (0u32, 0u32);
        while let Some(left) = window.checked_sub(start.elapsed()) {
            while self.pending.len() < DEPTH {
                self.submit();
            }
            if let Some(frame) = self.wait_one(left) {
                groups += 1;
                frames += u32::from(frame);
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let rate = Rate {
            groups: f64::from(groups) / secs,
            frames: f64::from(frames) / secs,
        };
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while !self.pending.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.wait_one(left).is_none() {
                self.stalled = true;
                break;
            }
        }
        rate
    }
}

/// The well-behaved VM's rates.
#[derive(Clone, Copy, Debug, Default)]
struct Rate {
    /// Completed groups (load and virgl) per second.
    groups: f64,
    /// Presented frames per second.
    frames: f64,
}

impl Rate {
    /// The mean of `rates` (zero for none).
    fn mean(rates: &[Rate]) -> Rate {
        let n = rates.len().max(1) as f64;
        Rate {
            groups: rates.iter().map(|r| r.groups).sum::<f64>() / n,
            frames: rates.iter().map(|r| r.frames).sum::<f64>() / n,
        }
    }

    /// The lower of the two ratios of `self` to `base` (0 where `base` has none).
    fn ratio(self, base: Rate) -> f64 {
        let part = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        part(self.groups, base.groups).min(part(self.frames, base.frames))
    }
}

/// A hostile qtest VM with its own scheduled device process.
struct HostileVm {
    guest: VgpuGuest,
    server: ServerProcess,
    features: u64,
    /// The guest RAM allocator as it was after set-up: every re-initialisation starts from it,
    /// so hundreds of resets place the rings at the same addresses instead of running out.
    ram: GuestRam,
    next_fence: u64,
}

impl HostileVm {
    fn start(daemon: &Schedd) -> Option<HostileVm> {
        let extra = [
            "--resource-memory-mb".to_string(),
            HOSTILE_RESOURCE_MB.to_string(),
        ];
        let server = scheduled_server(daemon, HOSTILE, &extra);
        renice(server.pid());
        let (mut guest, features) = attach_virgl(&server, HOSTILE_QUEUE_SIZE)?;
        renice(guest.vm.pid());
        contexts(&mut guest, TIMEOUT).expect("the hostile VM's contexts");
        let ram = guest.ram.clone();
        Some(HostileVm {
            guest,
            server,
            features,
            ram,
            next_fence: 1,
        })
    }

    fn fence(&mut self) -> u64 {
        self.next_fence += 1;
        self.next_fence
    }

    /// Queues `request` without waiting for it.
    fn queue(&mut self, request: &[u8]) -> Result<u16, String> {
        let qt = self.guest.vm.qtest();
        self.guest
            .dev
            .request(qt, CONTROL_QUEUE, &[request], &[CTRL_HDR_SIZE as u32])
            .map_err(|e| e.to_string())
    }

    /// Resets the device (status 0) and brings it up again with its contexts.
    fn reset(&mut self) -> Result<(), String> {
        let qt = self.guest.vm.qtest();
        self.guest.dev.reset(qt).map_err(|e| e.to_string())?;
        self.guest.ram = self.ram.clone();
        self.guest
            .try_bring_up_with(self.features, HOSTILE_QUEUE_SIZE)
            .map_err(|e| e.to_string())?;
        contexts(&mut self.guest, TIMEOUT)
    }

    fn status(&mut self) -> u8 {
        let qt = self.guest.vm.qtest();
        self.guest.dev.status(qt).unwrap_or(0)
    }

    /// Writes `descriptors` into the control queue's table from slot 0 and publishes
    /// `heads`, then notifies.
    fn publish_raw(&mut self, descriptors: &[Descriptor], heads: &[u16]) -> Result<(), String> {
        let qt = self.guest.vm.qtest();
        for (i, d) in (0u16..).zip(descriptors) {
            self.guest
                .dev
                .write_descriptor(qt, CONTROL_QUEUE, i, d)
                .map_err(|e| e.to_string())?;
        }
        for &head in heads {
            self.guest
                .dev
                .publish_avail(qt, CONTROL_QUEUE, head)
                .map_err(|e| e.to_string())?;
        }
        self.guest
            .dev
            .notify(qt, CONTROL_QUEUE)
            .map_err(|e| e.to_string())
    }

    /// Waits until the device used `count` chains since the queue was set up or needs a reset,
    /// at most `timeout`.
    fn wait_used_or_broken(&mut self, count: u16, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let qt = self.guest.vm.qtest();
            let used = self.guest.dev.read_used_idx(qt, CONTROL_QUEUE).unwrap_or(0);
            if used >= count || self.status() & NEEDS_RESET != 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A hostile VM or peer of one case.
enum Hostile {
    Vm(Box<HostileVm>),
    Raw {
        guest: Box<RawGuest>,
        server: ServerProcess,
    },
    Peer(Peers),
}

impl Hostile {
    /// The process whose RSS and life are watched (0 while a peer is not running).
    fn pid(&self) -> u32 {
        match self {
            Hostile::Vm(vm) => vm.server.pid(),
            Hostile::Raw { server, .. } => server.pid(),
            Hostile::Peer(peers) => hostile_pid(peers),
        }
    }

    /// Whether that process must still be running after the case.
    fn must_survive(&self) -> bool {
        !matches!(self, Hostile::Peer(_))
    }

    fn log(&self) -> String {
        match self {
            Hostile::Vm(vm) => vm.server.log(),
            Hostile::Raw { server, .. } => server.log(),
            Hostile::Peer(peers) => peers.events(),
        }
    }
}

/// A fake device started for each attacked window and killed for each pause (a peer that
/// holds a grant harms as long as it is connected, so pausing it means killing it).
struct Peers {
    name: &'static str,
    submit: u32,
    uid: Option<u32>,
    device: Option<FakeDevice>,
    /// The events of the devices killed so far.
    past: String,
}

impl Peers {
    fn new(name: &'static str, submit: u32, uid: Option<u32>) -> Peers {
        Peers {
            name,
            submit,
            uid,
            device: None,
            past: String::new(),
        }
    }

    fn start(&mut self, daemon: &Schedd) {
        if self.device.is_none() {
            self.device = Some(FakeDevice::start(daemon, self.name, self.submit, self.uid));
        }
    }

    fn kill(&mut self) {
        if let Some(device) = self.device.take() {
            self.past.push_str(&device.events());
        }
    }

    fn events(&self) -> String {
        let current = self.device.as_ref().map(FakeDevice::events);
        format!("{}{}", self.past, current.unwrap_or_default())
    }

    fn count(&self, event: &str) -> usize {
        self.events().lines().filter(|l| *l == event).count()
    }
}

/// Whether the hostile side attacks, pauses or stops; the well-behaved VM's windows alone and
/// under attack alternate, so that a drift of the machine's load weighs on both alike.
struct Gate(AtomicU8);

impl Gate {
    const ATTACK: u8 = 0;
    const PAUSE: u8 = 1;
    const STOP: u8 = 2;

    fn new(state: u8) -> Gate {
        Gate(AtomicU8::new(state))
    }

    fn set(&self, state: u8) {
        self.0.store(state, Ordering::SeqCst);
    }

    fn state(&self) -> u8 {
        self.0.load(Ordering::SeqCst)
    }

    fn attacking(&self) -> bool {
        self.state() == Gate::ATTACK
    }

    /// Waits while paused; true to attack, false once stopped.
    fn go(&self) -> bool {
        loop {
            match self.state() {
                Gate::ATTACK => return true,
                Gate::STOP => return false,
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
}

/// The fake device process (`vgpu-fake-device`), killed and reaped on drop.
struct FakeDevice {
    child: Child,
    out: PathBuf,
    _dir: TempDir,
}

impl FakeDevice {
    /// Starts it on the daemon's device socket as `name`, as user `uid` when given, with
    /// `submit` groups kept asking; it reconnects whenever it is dropped.
    fn start(daemon: &Schedd, name: &str, submit: u32, uid: Option<u32>) -> FakeDevice {
        let dir = TempDir::new("vgpu-fake-device").expect("temporary directory");
        let out = dir.path().join("events");
        let stdout = File::create(&out).expect("events file");
        let mut command = Command::new(env!("CARGO_BIN_EXE_vgpu-fake-device"));
        command
            .arg("--socket")
            .arg(daemon.socket())
            .args([
                "--name",
                name,
                "--submit",
                &submit.to_string(),
                "--reconnect",
            ])
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::null());
        // Only root may start a process as another user; otherwise the squatter is another
        // connection of the same user.
        let uid = uid.filter(|_| vgpu_schedd::seqpacket::effective_uid() == 0);
        if let Some(uid) = uid {
            // Another local user who may reach the device socket (device processes of other
            // uids do): the daemon's temporary directory and socket are opened to it.
            let socket = daemon.socket();
            let parent = socket.parent().expect("socket directory");
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o711))
                .expect("chmod the daemon's directory");
            std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666))
                .expect("chmod the device socket");
            command.uid(uid).gid(uid);
        }
        let child = command.spawn().expect("vgpu-fake-device starts");
        renice(child.id());
        let device = FakeDevice {
            child,
            out,
            _dir: dir,
        };
        // Its first answer from the daemon: it is running (and its RSS is its own, not the
        // test's from before the exec).
        let start = Instant::now();
        while device.events().is_empty() && start.elapsed() < NAME_WAIT {
            std::thread::sleep(Duration::from_millis(10));
        }
        device
    }

    fn events(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }
}

impl Drop for FakeDevice {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `VmRSS` of `pid` in KiB; `None` once it is gone.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The nice value of everything the hostile side runs on the CPU.
const HOSTILE_NICE: i32 = 19;

/// Lowers the CPU priority of process or thread `id` to [`HOSTILE_NICE`].
///
/// The hostile VM's QEMU, its device process and the thread driving it run at the lowest
/// priority, as a host's per-VM CPU cgroups would keep them off the neighbour's CPUs: on this
/// small machine they otherwise take CPU time from the neighbour's driver, and the suite
/// would measure CPU contention instead of the harm it looks for, through the shared GPU
/// path (the daemon, the scheduling and the device protocol).
fn renice(id: u32) {
    let who: libc::id_t = id;
    // SAFETY: setpriority takes no pointers; on Linux PRIO_PROCESS with a thread id sets that
    // thread's nice value.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, who, HOSTILE_NICE) };
    if rc != 0 {
        log::warn!("setpriority({id}): {}", std::io::Error::last_os_error());
    }
}

/// The calling thread's id.
fn thread_id() -> u32 {
    // SAFETY: gettid takes no arguments and cannot fail.
    let tid = unsafe { libc::gettid() };
    u32::try_from(tid).unwrap_or(0)
}

/// Whether `pid` is running (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("State:"))
            .is_some_and(|state| !state.trim_start().starts_with(['Z', 'X']))
    })
}

/// The daemon's count of `vm`'s dispatched groups, from its metrics endpoint at `metrics`
/// (an HTTP request costs the machine far less than a `vgpuctl` process, which matters while
/// the neighbour's rate is measured).
fn dispatched(metrics: SocketAddr, vm: &str) -> u64 {
    let Ok(mut stream) = TcpStream::connect(metrics) else {
        return 0;
    };
    let _ = stream.set_read_timeout(Some(TIMEOUT));
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {metrics}\r\n\r\n");
    let _ = stream.write_all(request.as_bytes());
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    let prefix = format!("vgpu_groups_dispatched_total{{vm=\"{vm}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits until the daemon counts more than `before` of `vm`'s groups dispatched.
fn wait_dispatched(metrics: SocketAddr, vm: &str, before: u64) -> bool {
    let start = Instant::now();
    while start.elapsed() < DISPATCH_WAIT {
        if dispatched(metrics, vm) > before {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// Which device process the daemon lists for `vm`.
fn device_pid(daemon: &Schedd, vm: &str) -> Option<u64> {
    daemon
        .vm_info(vm)
        .ok()
        .filter(|v| v["connected"] == true)
        .and_then(|v| v["device_pid"].as_u64())
}

/// The attacks. Each attacks while `gate` says so, waits while it pauses, returns once it
/// stops and says what it did.
mod attack {
    use super::*;

    /// Resets as soon as the virgl groups are queued: before any grant can arrive.
    pub fn reset_during_submit(vm: &mut HostileVm, gate: &Gate) -> Result<String, String> {
        let mut resets = 0;
        while gate.go() {
            for _ in 0..2 {
                let f = vm.fence();
                vm.queue(&gl_submit(f))?;
            }
            vm.reset()?;
            resets += 1;
        }
        Ok(format!("{resets} resets with 2 virgl groups queued"))
    }

    /// Resets once the daemon counts the virgl group dispatched (granted).
    pub fn reset_after_grant(
        vm: &mut HostileVm,
        metrics: SocketAddr,
        gate: &Gate,
    ) -> Result<String, String> {
        let (mut resets, mut granted) = (0, 0);
        while gate.go() {
            let before = dispatched(metrics, HOSTILE);
            let f = vm.fence();
            vm.queue(&gl_submit(f))?;
            granted += u32::from(wait_dispatched(metrics, HOSTILE, before));
            vm.reset()?;
            resets += 1;
        }
        Ok(format!("{resets} resets, {granted} after the grant"))
    }

    /// Resets at a varying delay (0 to [`FENCE_DELAY_STEPS`] − 1 ms, in turn) after queuing
    /// a fenced virgl group, so that over hundreds of resets some land between its grant and
    /// its fence.
    pub fn reset_during_fence(vm: &mut HostileVm, gate: &Gate) -> Result<String, String> {
        let mut resets = 0;
        while gate.go() {
            let f = vm.fence();
            vm.queue(&gl_submit(f))?;
            std::thread::sleep(Duration::from_millis(resets % FENCE_DELAY_STEPS));
            vm.reset()?;
            resets += 1;
        }
        Ok(format!(
            "{resets} resets 0-{} ms after a fenced virgl group",
            FENCE_DELAY_STEPS - 1
        ))
    }

    /// Resets and re-initialises back to back.
    pub fn reset_storm(vm: &mut HostileVm, gate: &Gate) -> Result<String, String> {
        let mut resets = 0;
        while gate.go() {
            if resets % 10 == 0 {
                let f = vm.fence();
                vm.queue(&gl_submit(f))?;
            }
            vm.reset()?;
            resets += 1;
        }
        Ok(format!("{resets} resets"))
    }

    /// 4096 unfenced 1 µs load groups, then a fenced virgl group.
    pub fn load_flood(vm: &mut HostileVm, gate: &Gate) -> Result<String, String> {
        let per_submit = vgpu_server::gpu::load::MAX_COMMANDS;
        let commands = vec![(LOAD_OP_OCCUPY, 0, 1); per_submit];
        let (mut rounds, mut refused) = (0, 0);
        while gate.go() {
            for _ in 0..FLOOD_GROUPS / per_submit {
                let answer = call(
                    &mut vm.guest,
                    &virtio_gpu::load_submit(LOAD_CTX, &commands),
                    TIMEOUT,
                )?;
                refused += u32::from(answer != RESP_OK_NODATA);
                if !gate.attacking() {
                    break;
                }
            }
            let f = vm.fence();
            // The virgl group waits behind the flood; its answer does not matter.
            let _ = call(&mut vm.guest, &gl_submit(f), TIMEOUT);
            if vm.status() & NEEDS_RESET != 0 {
                vm.reset()?;
            }
            rounds += 1;
        }
        Ok(format!(
            "{rounds} rounds of {FLOOD_GROUPS} load groups, {refused} submits refused"
        ))
    }

    /// Chains made of one INDIRECT descriptor naming a table of 65535 chained entries.
    pub fn indirect_chains(vm: &mut HostileVm, gate: &Gate) -> Result<String, String> {
        let table_bytes = u64::from(INDIRECT_ENTRIES) * Descriptor::SIZE;
        let table = vm.ram.alloc(table_bytes, 16).map_err(|e| e.to_string())?;
        let buffer = vm.ram.alloc(4096, 4096).map_err(|e| e.to_string())?;
        let mut bytes = Vec::with_capacity(usize::try_from(table_bytes).unwrap_or(0));
        for i in 0..INDIRECT_ENTRIES {
            let last = i + 1 == INDIRECT_ENTRIES;
            let next = u16::try_from(i + 1).unwrap_or(0);
            bytes.extend_from_slice(
                &Descriptor {
                    addr: buffer,
                    len: 4096,
                    flags: if last { 0 } else { DESC_F_NEXT },
                    next: if last { 0 } else { next },
                }
                .to_bytes(),
            );
        }
        let qt = vm.guest.vm.qtest();
        qt.memwrite(table, &bytes).map_err(|e| e.to_string())?;
        let indirect = Descriptor {
            addr: table,
            len: u32::try_from(table_bytes).unwrap_or(u32::MAX),
            flags: DESC_F_INDIRECT,
            next: 0,
        };
        let descriptors = vec![indirect; usize::from(HOSTILE_QUEUE_SIZE)];
        let heads: Vec<u16> = (0..HOSTILE_QUEUE_SIZE).collect();
        let (mut rounds, mut broken) = (0, 0);
        while gate.go() {
            vm.reset()?;
            vm.publish_raw(&descriptors, &heads)?;
            vm.wait_used_or_broken(HOSTILE_QUEUE_SIZE, HOSTILE_WAIT);
            broken += u32::from(vm.status() & NEEDS_RESET != 0);
            rounds += 1;
        }
        Ok(format!(
            "{rounds} rings of {HOSTILE_QUEUE_SIZE} indirect chains, {broken} refused with NEEDS_RESET"
        ))
    }

    /// 256 chains naming one 1 MiB buffer (a GET_DISPLAY_INFO header, then zeros), kicked
    /// again and again.
    pub fn ring_amplification(vm: &mut HostileVm, gate: &Gate) -> Result<String, String> {
        let buffer = vm
            .ram
            .alloc(u64::from(AMPLIFY_BYTES), 4096)
            .map_err(|e| e.to_string())?;
        let qt = vm.guest.vm.qtest();
        qt.memset(buffer, AMPLIFY_BYTES as usize, 0)
            .map_err(|e| e.to_string())?;
        qt.memwrite(buffer, &virtio_gpu::get_display_info())
            .map_err(|e| e.to_string())?;
        let chain = Descriptor {
            addr: buffer,
            len: AMPLIFY_BYTES,
            flags: 0,
            next: 0,
        };
        let descriptors = vec![chain; usize::from(AMPLIFY_CHAINS)];
        let heads: Vec<u16> = (0..AMPLIFY_CHAINS).collect();
        let mut rounds = 0;
        while gate.go() {
            vm.reset()?;
            vm.publish_raw(&descriptors, &heads)?;
            for _ in 0..16 {
                let qt = vm.guest.vm.qtest();
                vm.guest
                    .dev
                    .notify(qt, CONTROL_QUEUE)
                    .map_err(|e| e.to_string())?;
            }
            vm.wait_used_or_broken(AMPLIFY_CHAINS, HOSTILE_WAIT);
            rounds += 1;
        }
        Ok(format!(
            "{rounds} rings of {AMPLIFY_CHAINS} chains naming one {} MiB buffer, 17 kicks each",
            AMPLIFY_BYTES >> 20
        ))
    }

    /// 16384² textures until refused, then many small ones; all unreferenced; again.
    pub fn oversized_3d(vm: &mut HostileVm, gate: &Gate) -> Result<String, String> {
        let (mut created, mut refused, mut rounds) = (0, 0, 0);
        while gate.go() {
            let mut ids = Vec::new();
            for i in 0..HUGE_PER_ROUND + SMALL_PER_ROUND {
                let edge = if i < HUGE_PER_ROUND { HUGE_EDGE } else { 64 };
                let id = 100 + i;
                let tex = ResourceCreate3d::texture_2d(id, BGRA, BIND, edge, edge);
                let answer = call(
                    &mut vm.guest,
                    &virtio_gpu::resource_create_3d(&tex),
                    TIMEOUT,
                )?;
                if answer == RESP_OK_NODATA {
                    created += 1;
                    ids.push(id);
                } else {
                    refused += 1;
                }
            }
            for id in ids {
                call(&mut vm.guest, &virtio_gpu::resource_unref(id), TIMEOUT)?;
            }
            rounds += 1;
        }
        Ok(format!(
            "{rounds} rounds: {created} textures created, {refused} refused"
        ))
    }

    /// Publishes chains and takes guest RAM (rings included) away while they wait, then
    /// hands it back; reconnects when the device needs a reset.
    pub fn dma_unmap(guest: &mut RawGuest, gate: &Gate) -> Result<String, String> {
        let (mut unmaps, mut resets) = (0, 0);
        while gate.go() {
            for _ in 0..8 {
                guest.publish().map_err(|e| format!("publishing: {e}"))?;
            }
            guest.notify().map_err(|e| format!("notify: {e}"))?;
            guest.unmap_ram().map_err(|e| format!("DMA_UNMAP: {e}"))?;
            std::thread::sleep(Duration::from_millis(2));
            guest.map_ram().map_err(|e| format!("DMA_MAP: {e}"))?;
            unmaps += 1;
            let status = guest.status().map_err(|e| format!("status read: {e}"))?;
            if status & NEEDS_RESET != 0 {
                guest
                    .bring_up()
                    .map_err(|e| format!("re-initialising: {e}"))?;
                resets += 1;
            }
        }
        Ok(format!(
            "{unmaps} unmaps of all guest RAM with 8 chains published, {resets} resets after NEEDS_RESET"
        ))
    }
}

/// What a case is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    ResetDuringSubmit,
    ResetAfterGrant,
    ResetDuringFence,
    ResetStorm,
    LoadFlood,
    IndirectChains,
    RingAmplification,
    Oversized3d,
    DmaUnmap,
    NeverCompletes,
    SquatterAfter,
    SquatterBefore,
}

const CASES: &[(&str, Kind)] = &[
    ("reset_during_submit", Kind::ResetDuringSubmit),
    ("reset_after_grant", Kind::ResetAfterGrant),
    ("reset_during_fence", Kind::ResetDuringFence),
    ("reset_storm", Kind::ResetStorm),
    ("load_flood", Kind::LoadFlood),
    ("indirect_chains", Kind::IndirectChains),
    ("ring_amplification", Kind::RingAmplification),
    ("oversized_3d", Kind::Oversized3d),
    ("dma_unmap", Kind::DmaUnmap),
    ("never_completes", Kind::NeverCompletes),
    ("squatter_after", Kind::SquatterAfter),
    ("squatter_before", Kind::SquatterBefore),
];

/// Starts the hostile side of `kind`; `None` without virglrenderer (not required).
fn start_hostile(daemon: &Schedd, kind: Kind) -> Option<Hostile> {
    Some(match kind {
        Kind::DmaUnmap => {
            let server = scheduled_server(daemon, HOSTILE, &[]);
            renice(server.pid());
            let guest = RawGuest::connect(server.socket(), 0xffff).expect("raw guest");
            Hostile::Raw {
                guest: Box::new(guest),
                server,
            }
        }
        Kind::NeverCompletes => Hostile::Peer(Peers::new("peer", 4, None)),
        Kind::SquatterAfter | Kind::SquatterBefore => {
            Hostile::Peer(Peers::new(GOOD, 0, Some(NOBODY)))
        }
        _ => Hostile::Vm(Box::new(HostileVm::start(daemon)?)),
    })
}

/// Runs the attack of `kind` until `gate` stops it.
fn run_attack(
    hostile: &mut Hostile,
    kind: Kind,
    daemon: &Schedd,
    metrics: SocketAddr,
    gate: &Gate,
    watched: &std::sync::atomic::AtomicU32,
) -> Result<String, String> {
    match hostile {
        Hostile::Vm(vm) => match kind {
            Kind::ResetDuringSubmit => attack::reset_during_submit(vm, gate),
            Kind::ResetAfterGrant => attack::reset_after_grant(vm, metrics, gate),
            Kind::ResetDuringFence => attack::reset_during_fence(vm, gate),
            Kind::ResetStorm => attack::reset_storm(vm, gate),
            Kind::LoadFlood => attack::load_flood(vm, gate),
            Kind::IndirectChains => attack::indirect_chains(vm, gate),
            Kind::RingAmplification => attack::ring_amplification(vm, gate),
            Kind::Oversized3d => attack::oversized_3d(vm, gate),
            other => Err(format!("{other:?} is not a VM attack")),
        },
        Hostile::Raw { guest, .. } => attack::dma_unmap(guest, gate),
        // The peer misbehaves by itself; this side starts it for each attacked window and
        // kills it for each pause.
        Hostile::Peer(peers) => {
            loop {
                match gate.state() {
                    Gate::STOP => break,
                    Gate::ATTACK => {
                        peers.start(daemon);
                        watched.store(hostile_pid(peers), Ordering::SeqCst);
                    }
                    _ => peers.kill(),
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(String::new())
        }
    }
}

/// One row of the table.
struct Row {
    case: &'static str,
    standalone: Rate,
    neighbour: Rate,
    hostile_rss: (Option<u64>, Option<u64>),
    daemon_rss: (Option<u64>, Option<u64>),
    what: String,
    failures: Vec<String>,
}

impl Row {
    fn ratio(&self) -> f64 {
        self.neighbour.ratio(self.standalone)
    }

    fn json(&self) -> Value {
        json!({
            "case": self.case,
            "standalone_groups_per_s": self.standalone.groups,
            "standalone_frames_per_s": self.standalone.frames,
            "with_hostile_groups_per_s": self.neighbour.groups,
            "with_hostile_frames_per_s": self.neighbour.frames,
            "ratio": self.ratio(),
            "hostile_rss_kib": [self.hostile_rss.0, self.hostile_rss.1],
            "daemon_rss_kib": [self.daemon_rss.0, self.daemon_rss.1],
            "hostile_did": self.what,
            "failures": self.failures,
        })
    }
}

fn kib(v: Option<u64>) -> String {
    v.map_or_else(|| "-".into(), |k| format!("{:.1}", k as f64 / 1024.0))
}

/// The daemon's policy: `VGPU_HOSTILE_POLICY`, or [`DEFAULT_POLICY`].
fn policy() -> String {
    std::env::var("VGPU_HOSTILE_POLICY").unwrap_or_else(|_| DEFAULT_POLICY.into())
}

/// Runs one case; `None` when skipped for want of virglrenderer.
fn run_case(case: &'static str, kind: Kind) -> Option<Row> {
    let metrics = free_port();
    let policy = format!("policy = \"{}\"\n", policy());
    let daemon = Schedd::start_with(Some(&policy), "info", &["--metrics", &metrics.to_string()])
        .expect("daemon");
    let daemon_pid = daemon.pid().expect("daemon pid");
    let before_good = kind == Kind::SquatterBefore;
    let mut failures = Vec::new();
    let mut hostile = start_hostile(&daemon, kind)?;
    let gate = Gate::new(Gate::PAUSE);
    if before_good {
        // The name's owner has used it before (its device's uid, root here, is the one the
        // daemon binds the name to) and is away, as while its VM reboots; the squatter says
        // Hello first.
        drop(FakeDevice::start(&daemon, GOOD, 0, None));
        let start = Instant::now();
        while device_pid(&daemon, GOOD).is_some() && start.elapsed() < NAME_WAIT {
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Hostile::Peer(peers) = &mut hostile {
            peers.start(&daemon);
        }
        let start = Instant::now();
        while device_pid(&daemon, GOOD).is_none() && start.elapsed() < NAME_WAIT {
            std::thread::sleep(Duration::from_millis(20));
        }
        gate.set(Gate::ATTACK);
    }
    let mut good = GoodVm::start(&daemon)?;
    good.measure(WARM_UP);
    if before_good {
        check_name(&daemon, &good, &mut failures);
    }
    let daemon_before = rss_kib(daemon_pid);
    let watched = std::sync::atomic::AtomicU32::new(hostile.pid());
    let (alone, attacked, hostile_rss, attack) = std::thread::scope(|s| {
        let attacker = s.spawn(|| {
            renice(thread_id());
            let result = run_attack(&mut hostile, kind, &daemon, metrics, &gate, &watched);
            (result, hostile)
        });
        let (mut alone, mut attacked) = (Vec::new(), Vec::new());
        let (mut rss_before, mut rss_after) = (None, None);
        for round in 0..ROUNDS {
            alone.push(good.measure(WINDOW));
            gate.set(Gate::ATTACK);
            if round == 0 {
                // A peer is started for the window: measure it once it runs.
                let start = Instant::now();
                while watched.load(Ordering::SeqCst) == 0 && start.elapsed() < NAME_WAIT {
                    std::thread::sleep(Duration::from_millis(5));
                }
                rss_before = rss_kib(watched.load(Ordering::SeqCst));
            }
            attacked.push(good.measure(WINDOW));
            if round + 1 == ROUNDS {
                rss_after = rss_kib(watched.load(Ordering::SeqCst));
                if kind == Kind::SquatterAfter {
                    check_name(&daemon, &good, &mut failures);
                }
            }
            gate.set(Gate::PAUSE);
        }
        alone.push(good.measure(WINDOW));
        gate.set(Gate::STOP);
        let attack = attacker.join().map_or_else(
            |_| (Err("the hostile driver panicked".to_string()), None),
            |(result, hostile)| (result, Some(hostile)),
        );
        (alone, attacked, (rss_before, rss_after), attack)
    });
    let daemon_after = rss_kib(daemon_pid);
    let (result, hostile) = attack;
    let Some(hostile) = hostile else {
        panic!("{case}: the hostile driver panicked");
    };
    let what = match (result, &hostile) {
        (_, Hostile::Peer(peers)) => format!(
            "{} welcome, {} refused, {} grants, {} times dropped",
            peers.count("welcome"),
            peers.count("refused"),
            peers.count("grant"),
            peers.count("closed")
        ),
        (Ok(what), _) => what,
        (Err(e), _) => {
            // Its own device stopped answering it (or refused to come back up): a device
            // process that hangs is as dead as one that crashed.
            failures.push(format!(
                "the hostile device stopped serving its guest ({e}):\n{}",
                tail(&hostile.log())
            ));
            format!("gave up: {e}")
        }
    };
    let hostile_pid = watched.load(Ordering::SeqCst);
    if hostile.must_survive() && !alive(hostile_pid) {
        failures.push(format!(
            "the hostile device process died:\n{}",
            tail(&hostile.log())
        ));
    }
    drop(hostile);
    if !alive(good.server.pid()) {
        failures.push(format!(
            "the well-behaved device process died:\n{}",
            tail(&good.server.log())
        ));
    }
    if !alive(daemon_pid) {
        failures.push(format!("the daemon died:\n{}", tail(&daemon.log())));
    }
    if good.stalled {
        failures.push("the well-behaved VM's requests stopped completing".into());
    }
    if good.refused > 0 {
        failures.push(format!(
            "{} of the well-behaved VM's requests were refused",
            good.refused
        ));
    }
    let growth = |(b, a): (Option<u64>, Option<u64>)| match (b, a) {
        (Some(b), Some(a)) => a.saturating_sub(b),
        _ => 0,
    };
    let daemon_rss = (daemon_before, daemon_after);
    if growth(hostile_rss) > HOSTILE_RSS_GROWTH_MAX_KIB {
        failures.push(format!(
            "the hostile device's RSS grew by {} KiB (at most {HOSTILE_RSS_GROWTH_MAX_KIB})",
            growth(hostile_rss)
        ));
    }
    if growth(daemon_rss) > DAEMON_RSS_GROWTH_MAX_KIB {
        failures.push(format!(
            "the daemon's RSS grew by {} KiB (at most {DAEMON_RSS_GROWTH_MAX_KIB})",
            growth(daemon_rss)
        ));
    }
    // Windows alone after a stall measure nothing: the standalone figure is the mean of those
    // that ran.
    let ran: Vec<Rate> = alone.into_iter().filter(|r| r.groups > 0.0).collect();
    let standalone = Rate::mean(&ran);
    let neighbour = Rate::mean(&attacked);
    let ratio = neighbour.ratio(standalone);
    if ratio < MIN_RATIO {
        failures.push(format!(
            "the neighbour kept {ratio:.2} of its standalone rate (at least {MIN_RATIO})"
        ));
    }
    let row = Row {
        case,
        standalone,
        neighbour,
        hostile_rss,
        daemon_rss,
        what,
        failures,
    };
    Some(finish(row, &daemon, &good))
}

/// The pid of the peer's running fake device, 0 while none runs.
fn hostile_pid(peers: &Peers) -> u32 {
    peers.device.as_ref().map_or(0, |d| d.child.id())
}

/// A loopback address with a port free just now, for the daemon's metrics endpoint.
fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
}

/// Checks that the daemon lists the well-behaved VM's own device under its name (waiting up
/// to [`NAME_WAIT`] for its device to come back after a refusal).
fn check_name(daemon: &Schedd, good: &GoodVm, failures: &mut Vec<String>) {
    let real = u64::from(good.server.pid());
    let start = Instant::now();
    while device_pid(daemon, GOOD) != Some(real) && start.elapsed() < NAME_WAIT {
        std::thread::sleep(Duration::from_millis(50));
    }
    let holder = device_pid(daemon, GOOD);
    if holder != Some(real) {
        failures.push(format!(
            "the name {GOOD} is held by pid {holder:?}, not by its device (pid {real})"
        ));
    }
}

/// The last lines of a log.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Prints a failing case's logs, then hands the row back.
fn finish(row: Row, daemon: &Schedd, good: &GoodVm) -> Row {
    if !row.failures.is_empty() {
        eprintln!(
            "---- {}: daemon log tail ----\n{}\n---- well-behaved device log tail ----\n{}",
            row.case,
            tail(&daemon.log()),
            tail(&good.server.log())
        );
    }
    row
}

#[test]
fn a_hostile_neighbour_cannot_starve_a_well_behaved_vm() {
    if skip_without_qemu() {
        return;
    }
    let only = std::env::var("VGPU_HOSTILE_CASES").ok();
    let selected = |name: &str| {
        only.as_deref()
            .is_none_or(|list| list.split(',').any(|n| n.trim() == name))
    };
    let mut rows = Vec::new();
    for &(case, kind) in CASES.iter().filter(|(n, _)| selected(n)) {
        eprintln!("hostile: {case}");
        match run_case(case, kind) {
            Some(row) => rows.push(row),
            None => return,
        }
    }
    let mut table = String::from(
        "| case | standalone groups/s (frames/s) | with hostile groups/s (frames/s) | ratio | hostile RSS MiB before → after \
         | daemon RSS MiB before → after | hostile side did |\n\
         |------|---:|---:|---:|---|---|---|\n",
    );
    for r in &rows {
        table.push_str(&format!(
            "| {} | {:.1} ({:.1}) | {:.1} ({:.1}) | {:.2} | {} → {} | {} → {} | {} |\n",
            r.case,
            r.standalone.groups,
            r.standalone.frames,
            r.neighbour.groups,
            r.neighbour.frames,
            r.ratio(),
            kib(r.hostile_rss.0),
            kib(r.hostile_rss.1),
            kib(r.daemon_rss.0),
            kib(r.daemon_rss.1),
            r.what
        ));
    }
    eprintln!("{table}");
    let report = json!({
        "min_ratio": MIN_RATIO,
        "window_s": WINDOW.as_secs_f64(),
        "rounds": ROUNDS,
        "policy": policy(),
        "cpu": vgpu_tests::cpu_model(),
        "cases": rows.iter().map(Row::json).collect::<Vec<_>>(),
    });
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hostile.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&report).unwrap_or_default(),
    )
    .expect("writing hostile.json");
    eprintln!("written to {}", path.display());
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| !r.failures.is_empty())
        .map(|r| format!("{}: {}", r.case, r.failures.join("; ")))
        .collect();
    assert!(failed.is_empty(), "failed cases:\n{}", failed.join("\n"));
}
