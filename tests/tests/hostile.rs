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
//! The CUDA section (issue 24; both VMs also hold a compute context, capset 21, and talk
//! `mdev_backend::compute::wire` through guest blobs; the neighbour's GL requests are paced
//! below its fair share and its CUDA rate, paced short launches, is measured beside its GL
//! rate; the hostile device's peak RSS and CPU time are recorded):
//!
//! | case | the hostile side (finding) |
//! |------|------------------|
//! | `cuda_fatbin_bomb` | ModuleLoads of a fat binary of 12 Zstandard entries of 2 KiB, each expanding to 64 MiB (1) |
//! | `cuda_memory` | 4 contexts x a 256 MiB MemAlloc with a 256 MiB budget, destroyed and made again (2) |
//! | `cuda_spin_kernel` | a kernel that never ends, in a new context each time (3) |
//! | `cuda_launch_batch` | a Batch of 1023 launches of a short loop (3) |
//! | `cuda_printf` | a kernel whose threads print 64 `%s` of 4 KiB each (3) |
//! | `cuda_reset_spin` | a spin kernel, then a device reset; the device's CPU time after the reset (3) |
//! | `cuda_nested_batch` | a Batch nested 20,000 deep (4) |
//! | `cuda_deep_ptx` | a module of 200,000 nested scopes around 20,000 instructions (5) |
//! | `cuda_blob_entries` | RESOURCE_CREATE_BLOBs of 16384 entries each, held, with a 64 MiB budget (6) |
//! | `cuda_wraparound` | MemsetD32 and CopyDtoD whose ranges wrap around 2^64; the allocation must keep its bytes (7) |
//! | `cuda_bad_entries` | a blob and a 2D backing naming memory outside guest RAM, and a compute submit on the blob (8) |
//! | `cuda_killed_mid_kernel` | CTX_DESTROY of a compute context while its spin kernel runs, then the next program's first launch (11) |
//! | `cuda_group_timeout` | spin kernels under a daemon whose group timeout (300 ms) they outlive on purpose (3, deliverable 3) |
//!
//! A CUDA case also fails when the device accepts what the boundary must refuse (the case
//! names it), or does not answer a compute request within [`CUDA_ANSWER_WAIT`].
//!
//! A case passes when the daemon and both device processes are alive afterwards (a fake peer
//! may be dropped), the daemon's RSS grew by at most [`DAEMON_RSS_GROWTH_MAX_KIB`] and the
//! hostile device process's by at most its `--resource-memory-mb` plus [`HOSTILE_RSS_SLACK_MB`]
//! (in the CUDA cases its peak, sampled every [`RSS_SAMPLE_PERIOD`]), the name checks of the
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

use mdev_backend::compute::backend::{ContextId, DEFAULT_STREAM, FunctionId, ModuleId};
use mdev_backend::compute::wire::{Reply, Request};
use serde_json::{Value, json};
use vgpu_guest_drivers::guest_ram::GuestRam;
use vgpu_guest_drivers::virtio_gpu::{
    self, CAPSET_LOAD, CONTROL_QUEUE, CTRL_HDR_SIZE, CtrlHeader, LOAD_OP_END_FRAME, LOAD_OP_OCCUPY,
    RESP_OK_NODATA, ResourceCreate3d,
};
use vgpu_guest_drivers::virtio_pci::Descriptor;
use vgpu_tests::compute::ComputeBlob;
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
/// How far beyond its resource budget the hostile device process's RSS may grow: queue
/// copies, virglrenderer's own state and the allocator's slack.
const HOSTILE_RSS_SLACK_MB: u64 = 128;
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
/// Longest wait for the hostile side to pause before a window alone: past the longest a
/// hostile request may take to be answered (a device that has not answered by then is
/// judged hung anyway).
const PARK_WAIT: Duration = Duration::from_secs(12);
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

/// Creates the load and the GL context; with `blobs`, also the compute context and the
/// blobs (their guest memory allocated before), attached to it.
fn contexts(guest: &mut VgpuGuest, timeout: Duration, blobs: &[ComputeBlob]) -> Result<(), String> {
    let compute = (CUDA_CTX, virtio_gpu::CAPSET_COMPUTE, &b"cuda"[..]);
    let all = [
        (LOAD_CTX, CAPSET_LOAD, &b"load"[..]),
        (GL_CTX, 1, &b"gl"[..]),
        compute,
    ];
    let wanted = if blobs.is_empty() { 2 } else { 3 };
    for &(ctx, capset, name) in &all[..wanted] {
        let answer = call(guest, &virtio_gpu::ctx_create(ctx, capset, name), timeout)?;
        if answer != RESP_OK_NODATA {
            return Err(format!("CTX_CREATE {ctx}: {answer:#x}"));
        }
    }
    for blob in blobs {
        for request in [
            blob.create_request(),
            virtio_gpu::ctx_attach_resource(CUDA_CTX, blob.id),
        ] {
            let answer = call(guest, &request, timeout)?;
            if answer != RESP_OK_NODATA {
                return Err(format!("compute blob {}: {answer:#x}", blob.id));
            }
        }
    }
    Ok(())
}

/// Allocates the guest memory of compute blobs `ids` (created by [`contexts`]).
fn allocate_blobs(guest: &mut VgpuGuest, ids: &[u32]) -> Vec<ComputeBlob> {
    ids.iter()
        .map(|&id| ComputeBlob::allocate(guest, id, CUDA_BLOB_PIECES, CUDA_BLOB_PIECE))
        .collect()
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
    /// The shortest time between two of its GL requests (the CUDA cases pace it; `None`:
    /// as fast as the engine allows).
    pace: Option<Duration>,
    /// Its CUDA workload (the CUDA cases).
    cuda: Option<CudaNeighbour>,
}

impl GoodVm {
    /// Starts it; `cuda` adds the paced CUDA workload and paces its GL requests.
    fn start(daemon: &Schedd, cuda: bool) -> Option<GoodVm> {
        let server = scheduled_server(daemon, GOOD, &[]);
        let (mut guest, _) = attach_virgl(&server, CONTROL_QUEUE_SIZE)?;
        let blobs = if cuda {
            allocate_blobs(&mut guest, &CUDA_BLOBS[..1])
        } else {
            Vec::new()
        };
        contexts(&mut guest, TIMEOUT, &blobs).expect("the well-behaved VM's contexts");
        let cuda = blobs.into_iter().next().map(|blob| {
            CudaNeighbour::start(&mut guest, blob).expect("the well-behaved VM's CUDA program")
        });
        Some(GoodVm {
            guest,
            server,
            pending: VecDeque::new(),
            next_fence: 1,
            refused: 0,
            stalled: false,
            pace: cuda.as_ref().map(|_| GOOD_GL_PACE),
            cuda,
        })
    }

    /// Launches per second of its CUDA workload over `window`, one each [`GOOD_CUDA_PACE`]
    /// (catching up after a slow one); `None` without one.
    fn measure_cuda(&mut self, window: Duration) -> Option<f64> {
        let cuda = self.cuda.as_ref()?;
        if self.stalled {
            return Some(0.0);
        }
        let start = Instant::now();
        let mut done = 0u32;
        while let Some(left) = window.checked_sub(start.elapsed()) {
            if let Some(early) = (GOOD_CUDA_PACE * done).checked_sub(start.elapsed()) {
                std::thread::sleep(early.min(left));
                continue;
            }
            match exchange(
                &mut self.guest,
                &cuda.blob,
                CUDA_CTX,
                &cuda.run,
                DRAIN_TIMEOUT,
            ) {
                Ok(reply) => {
                    self.refused += u64::from(status_of(&reply) != 0);
                    done += 1;
                }
                Err(_) => {
                    self.stalled = true;
                    break;
                }
            }
        }
        Some(f64::from(done) / start.elapsed().as_secs_f64())
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
        let (mut groups, mut frames, mut sent) = (0u32, 0u32, 0u32);
        // When the next request is due: at once, or `sent` paces after the start.
        let pace = self.pace;
        let due = move |sent: u32| pace.map_or(Duration::ZERO, |p| p * sent);
        while let Some(left) = window.checked_sub(start.elapsed()) {
            while self.pending.len() < DEPTH && due(sent) <= start.elapsed() {
                self.submit();
                sent += 1;
            }
            let until_due = due(sent).saturating_sub(start.elapsed()).min(left);
            if self.pending.is_empty() {
                std::thread::sleep(until_due);
                continue;
            }
            let wait = if self.pending.len() < DEPTH && self.pace.is_some() {
                until_due
            } else {
                left
            };
            if let Some(frame) = self.wait_one(wait) {
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
    /// Its compute blobs ([`CUDA_BLOBS`]) in the CUDA cases, created again at each reset.
    blobs: Vec<ComputeBlob>,
}

impl HostileVm {
    /// Starts it with a budget of `resource_mb`; `cuda` adds the compute context and blobs.
    fn start(daemon: &Schedd, resource_mb: u64, cuda: bool) -> Option<HostileVm> {
        let extra = ["--resource-memory-mb".to_string(), resource_mb.to_string()];
        let server = scheduled_server(daemon, HOSTILE, &extra);
        renice(server.pid());
        let (mut guest, features) = attach_virgl(&server, HOSTILE_QUEUE_SIZE)?;
        renice(guest.vm.pid());
        guest
            .vm
            .qtest()
            .set_timeout(HOSTILE_QTEST_TIMEOUT)
            .expect("the hostile VM's qtest timeout");
        let blobs = if cuda {
            allocate_blobs(&mut guest, &CUDA_BLOBS)
        } else {
            Vec::new()
        };
        contexts(&mut guest, TIMEOUT, &blobs).expect("the hostile VM's contexts");
        renice_tasks(server.pid());
        let ram = guest.ram.clone();
        Some(HostileVm {
            guest,
            server,
            features,
            ram,
            next_fence: 1,
            blobs,
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
        contexts(&mut self.guest, TIMEOUT, &self.blobs)
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
/// The hostile side says when it has paused (or given up), so that a window alone never
/// measures the tail of an attack still running (a compute request lasts up to seconds).
struct Gate {
    state: AtomicU8,
    /// Whether the hostile side is waiting in a pause or has returned.
    parked: std::sync::atomic::AtomicBool,
}

impl Gate {
    const ATTACK: u8 = 0;
    const PAUSE: u8 = 1;
    const STOP: u8 = 2;

    fn new(state: u8) -> Gate {
        Gate {
            state: AtomicU8::new(state),
            parked: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn set(&self, state: u8) {
        if state == Gate::ATTACK {
            self.parked.store(false, Ordering::SeqCst);
        }
        self.state.store(state, Ordering::SeqCst);
    }

    fn state(&self) -> u8 {
        self.state.load(Ordering::SeqCst)
    }

    /// The hostile side is idle: paused, or returned.
    fn park(&self) {
        self.parked.store(true, Ordering::SeqCst);
    }

    /// Waits up to [`PARK_WAIT`] until the hostile side is idle.
    fn wait_parked(&self) {
        let start = Instant::now();
        while !self.parked.load(Ordering::SeqCst) && start.elapsed() < PARK_WAIT {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn attacking(&self) -> bool {
        self.state() == Gate::ATTACK
    }

    /// Waits while paused; true to attack, false once stopped.
    fn go(&self) -> bool {
        loop {
            match self.state() {
                Gate::ATTACK => {
                    self.parked.store(false, Ordering::SeqCst);
                    return true;
                }
                Gate::STOP => return false,
                _ => {
                    self.park();
                    std::thread::sleep(Duration::from_millis(5));
                }
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

/// How often the hostile device process's RSS is sampled for its peak.
const RSS_SAMPLE_PERIOD: Duration = Duration::from_millis(20);

/// The nice value of everything the hostile side runs on the CPU.
const HOSTILE_NICE: i32 = 19;

/// How long the hostile side waits for each qtest reply of its QEMU. Its QEMU and device run
/// at [`HOSTILE_NICE`], so beside other work at nice 0 (`test.sh --loaded`: `stress-ng --cpu
/// 2` on 2 cores) they get a few percent of a CPU and one command took longer than the usual
/// 10 s; a device that stops serving is still caught, a minute later.
const HOSTILE_QTEST_TIMEOUT: Duration = Duration::from_secs(60);

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
    CudaFatbinBomb,
    CudaMemory,
    CudaSpinKernel,
    CudaLaunchBatch,
    CudaPrintf,
    CudaResetSpin,
    CudaNestedBatch,
    CudaDeepPtx,
    CudaBlobEntries,
    CudaWraparound,
    CudaBadEntries,
    CudaKilledMidKernel,
    CudaGroupTimeout,
}

impl Kind {
    /// Whether it is a case of the CUDA section: both VMs get a compute context, the
    /// neighbour's demand is paced and its CUDA rate measured too, and the hostile device's
    /// peak RSS is judged.
    fn cuda(self) -> bool {
        matches!(
            self,
            Kind::CudaFatbinBomb
                | Kind::CudaMemory
                | Kind::CudaSpinKernel
                | Kind::CudaLaunchBatch
                | Kind::CudaPrintf
                | Kind::CudaResetSpin
                | Kind::CudaNestedBatch
                | Kind::CudaDeepPtx
                | Kind::CudaBlobEntries
                | Kind::CudaWraparound
                | Kind::CudaBadEntries
                | Kind::CudaKilledMidKernel
                | Kind::CudaGroupTimeout
        )
    }

    /// The daemon's group timeout for the case.
    fn group_timeout_ms(self) -> Option<u64> {
        match self {
            Kind::CudaGroupTimeout => Some(SHORT_GROUP_TIMEOUT_MS),
            k if k.cuda() => Some(CUDA_GROUP_TIMEOUT_MS),
            _ => None,
        }
    }

    /// The hostile device's `--resource-memory-mb`.
    fn resource_mb(self) -> u64 {
        match self {
            Kind::CudaBlobEntries => BLOB_ENTRIES_RESOURCE_MB,
            _ => HOSTILE_RESOURCE_MB,
        }
    }

    /// How far the hostile device process's RSS may grow during the case.
    fn rss_growth_max_kib(self) -> u64 {
        (self.resource_mb() + HOSTILE_RSS_SLACK_MB) << 10
    }

    /// How long each window of the neighbour's GL rate lasts.
    fn window(self) -> Duration {
        if self.cuda() { CUDA_WINDOW } else { WINDOW }
    }

    /// Attacked windows (each between two windows alone).
    fn rounds(self) -> usize {
        if self.cuda() { CUDA_ROUNDS } else { ROUNDS }
    }
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
    ("cuda_fatbin_bomb", Kind::CudaFatbinBomb),
    ("cuda_memory", Kind::CudaMemory),
    ("cuda_spin_kernel", Kind::CudaSpinKernel),
    ("cuda_launch_batch", Kind::CudaLaunchBatch),
    ("cuda_printf", Kind::CudaPrintf),
    ("cuda_reset_spin", Kind::CudaResetSpin),
    ("cuda_nested_batch", Kind::CudaNestedBatch),
    ("cuda_deep_ptx", Kind::CudaDeepPtx),
    ("cuda_blob_entries", Kind::CudaBlobEntries),
    ("cuda_wraparound", Kind::CudaWraparound),
    ("cuda_bad_entries", Kind::CudaBadEntries),
    ("cuda_killed_mid_kernel", Kind::CudaKilledMidKernel),
    ("cuda_group_timeout", Kind::CudaGroupTimeout),
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
        _ => Hostile::Vm(Box::new(HostileVm::start(
            daemon,
            kind.resource_mb(),
            kind.cuda(),
        )?)),
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
) -> Result<Outcome, String> {
    match hostile {
        Hostile::Vm(vm) => match kind {
            Kind::ResetDuringSubmit => attack::reset_during_submit(vm, gate).map(Outcome::from),
            Kind::ResetAfterGrant => {
                attack::reset_after_grant(vm, metrics, gate).map(Outcome::from)
            }
            Kind::ResetDuringFence => attack::reset_during_fence(vm, gate).map(Outcome::from),
            Kind::ResetStorm => attack::reset_storm(vm, gate).map(Outcome::from),
            Kind::LoadFlood => attack::load_flood(vm, gate).map(Outcome::from),
            Kind::IndirectChains => attack::indirect_chains(vm, gate).map(Outcome::from),
            Kind::RingAmplification => attack::ring_amplification(vm, gate).map(Outcome::from),
            Kind::Oversized3d => attack::oversized_3d(vm, gate).map(Outcome::from),
            Kind::CudaFatbinBomb => cuda::fatbin_bomb(vm, gate),
            Kind::CudaMemory => cuda::memory(vm, gate),
            Kind::CudaSpinKernel | Kind::CudaGroupTimeout => cuda::spin_kernel(vm, gate),
            Kind::CudaLaunchBatch => cuda::launch_batch(vm, gate),
            Kind::CudaPrintf => cuda::printf(vm, gate),
            Kind::CudaResetSpin => cuda::reset_spin(vm, gate),
            Kind::CudaNestedBatch => cuda::nested_batch(vm, gate),
            Kind::CudaDeepPtx => cuda::deep_ptx(vm, gate),
            Kind::CudaBlobEntries => cuda::blob_entries(vm, gate),
            Kind::CudaWraparound => cuda::wraparound(vm, gate),
            Kind::CudaBadEntries => cuda::bad_entries(vm, gate),
            Kind::CudaKilledMidKernel => cuda::killed_mid_kernel(vm, gate),
            other => Err(format!("{other:?} is not a VM attack")),
        },
        Hostile::Raw { guest, .. } => attack::dma_unmap(guest, gate).map(Outcome::from),
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
                    _ => {
                        peers.kill();
                        gate.park();
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(Outcome::default())
        }
    }
}

/// One row of the table.
struct Row {
    case: &'static str,
    standalone: Rate,
    neighbour: Rate,
    /// The neighbour's CUDA launches per second alone and beside the hostile VM (CUDA cases).
    cuda: Option<(f64, f64)>,
    hostile_rss: (Option<u64>, Option<u64>),
    /// The hostile device process's highest RSS seen during the case, in KiB.
    hostile_peak: Option<u64>,
    /// The hostile device process's CPU time from the first attacked window to the end.
    hostile_cpu_s: Option<f64>,
    daemon_rss: (Option<u64>, Option<u64>),
    what: String,
    failures: Vec<String>,
}

impl Row {
    /// The lowest of the neighbour's ratios: groups, frames and (CUDA cases) launches.
    fn ratio(&self) -> f64 {
        let cuda = self.cuda.map_or(f64::INFINITY, |(alone, beside)| {
            if alone > 0.0 { beside / alone } else { 0.0 }
        });
        self.neighbour.ratio(self.standalone).min(cuda)
    }

    fn json(&self) -> Value {
        json!({
            "case": self.case,
            "standalone_groups_per_s": self.standalone.groups,
            "standalone_frames_per_s": self.standalone.frames,
            "with_hostile_groups_per_s": self.neighbour.groups,
            "with_hostile_frames_per_s": self.neighbour.frames,
            "standalone_cuda_launches_per_s": self.cuda.map(|c| c.0),
            "with_hostile_cuda_launches_per_s": self.cuda.map(|c| c.1),
            "ratio": self.ratio(),
            "hostile_rss_kib": [self.hostile_rss.0, self.hostile_rss.1],
            "hostile_peak_rss_kib": self.hostile_peak,
            "hostile_cpu_s": self.hostile_cpu_s,
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
    let metrics_arg = metrics.to_string();
    let timeout_arg = kind.group_timeout_ms().map(|ms| ms.to_string());
    let mut args = vec!["--metrics", &metrics_arg];
    if let Some(ms) = &timeout_arg {
        args.extend(["--group-timeout-ms", ms]);
    }
    let daemon = Schedd::start_with(Some(&policy), "info", &args).expect("daemon");
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
    let mut good = GoodVm::start(&daemon, kind.cuda())?;
    good.measure(WARM_UP);
    good.measure_cuda(CUDA_WINDOW);
    if before_good {
        check_name(&daemon, &good, &mut failures);
    }
    let daemon_before = rss_kib(daemon_pid);
    let watched = std::sync::atomic::AtomicU32::new(hostile.pid());
    let peak = std::sync::atomic::AtomicU64::new(0);
    let sampling = std::sync::atomic::AtomicBool::new(true);
    let (rounds, window) = (kind.rounds(), kind.window());
    let (alone, attacked, cuda_rates, hostile_rss, hostile_cpu_s, attack) =
        std::thread::scope(|s| {
            let attacker = s.spawn(|| {
                renice(thread_id());
                let result = run_attack(&mut hostile, kind, &daemon, metrics, &gate, &watched);
                gate.park();
                (result, hostile)
            });
            s.spawn(|| {
                renice(thread_id());
                while sampling.load(Ordering::SeqCst) {
                    if let Some(kib) = rss_kib(watched.load(Ordering::SeqCst)) {
                        peak.fetch_max(kib, Ordering::SeqCst);
                    }
                    std::thread::sleep(RSS_SAMPLE_PERIOD);
                }
            });
            let (mut alone, mut attacked) = (Vec::new(), Vec::new());
            let (mut cuda_alone, mut cuda_attacked) = (Vec::new(), Vec::new());
            let (mut rss_before, mut rss_after, mut cpu_before) = (None, None, None);
            for round in 0..rounds {
                alone.push(good.measure(window));
                cuda_alone.extend(good.measure_cuda(CUDA_WINDOW));
                gate.set(Gate::ATTACK);
                if round == 0 {
                    // A peer is started for the window: measure it once it runs.
                    let start = Instant::now();
                    while watched.load(Ordering::SeqCst) == 0 && start.elapsed() < NAME_WAIT {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    rss_before = rss_kib(watched.load(Ordering::SeqCst));
                    cpu_before = cpu_seconds(watched.load(Ordering::SeqCst));
                }
                attacked.push(good.measure(window));
                cuda_attacked.extend(good.measure_cuda(CUDA_WINDOW));
                if round + 1 == rounds {
                    rss_after = rss_kib(watched.load(Ordering::SeqCst));
                    if kind == Kind::SquatterAfter {
                        check_name(&daemon, &good, &mut failures);
                    }
                }
                gate.set(Gate::PAUSE);
                gate.wait_parked();
            }
            alone.push(good.measure(window));
            cuda_alone.extend(good.measure_cuda(CUDA_WINDOW));
            gate.set(Gate::STOP);
            let attack = attacker.join().map_or_else(
                |_| (Err("the hostile driver panicked".to_string()), None),
                |(result, hostile)| (result, Some(hostile)),
            );
            let cpu_after = cpu_seconds(watched.load(Ordering::SeqCst));
            sampling.store(false, Ordering::SeqCst);
            let cuda_rates = (!cuda_alone.is_empty()).then(|| {
                let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
                // Windows alone after a stall measure nothing, as for the GL rate.
                let ran: Vec<f64> = cuda_alone.iter().copied().filter(|&r| r > 0.0).collect();
                (mean(&ran), mean(&cuda_attacked))
            });
            let cpu = cpu_before.zip(cpu_after).map(|(b, a)| a - b);
            (
                alone,
                attacked,
                cuda_rates,
                (rss_before, rss_after),
                cpu,
                attack,
            )
        });
    let hostile_peak = Some(peak.load(Ordering::SeqCst)).filter(|&k| k > 0);
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
        (Ok(outcome), _) => {
            failures.extend(outcome.violations);
            outcome.what
        }
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
    let rss_max = kind.rss_growth_max_kib();
    if growth(hostile_rss) > rss_max {
        failures.push(format!(
            "the hostile device's RSS grew by {} KiB (at most {rss_max})",
            growth(hostile_rss)
        ));
    }
    // A CUDA attack's memory may come and go within a request: its peak is judged.
    let peak_growth = growth((hostile_rss.0, hostile_peak));
    if kind.cuda() && peak_growth > rss_max {
        failures.push(format!(
            "the hostile device's RSS peaked {peak_growth} KiB above its start (at most {rss_max})"
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
    let mut row = Row {
        case,
        standalone,
        neighbour,
        cuda: cuda_rates,
        hostile_rss,
        hostile_peak,
        hostile_cpu_s,
        daemon_rss,
        what,
        failures,
    };
    let ratio = row.ratio();
    if ratio < MIN_RATIO {
        row.failures.push(format!(
            "the neighbour kept {ratio:.2} of its standalone rate (at least {MIN_RATIO})"
        ));
    }
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
        "| case | standalone groups/s (frames/s) | with hostile groups/s (frames/s) \
         | CUDA launches/s alone → beside | ratio | hostile RSS MiB before → after (peak) \
         | hostile CPU-s | daemon RSS MiB before → after | hostile side did |\n\
         |------|---:|---:|---:|---:|---|---:|---|---|\n",
    );
    for r in &rows {
        let cuda = r
            .cuda
            .map_or_else(|| "-".into(), |(a, b)| format!("{a:.1} → {b:.1}"));
        let cpu = r
            .hostile_cpu_s
            .map_or_else(|| "-".into(), |c| format!("{c:.1}"));
        table.push_str(&format!(
            "| {} | {:.1} ({:.1}) | {:.1} ({:.1}) | {} | {:.2} | {} → {} ({}) | {} | {} → {} | {} |\n",
            r.case,
            r.standalone.groups,
            r.standalone.frames,
            r.neighbour.groups,
            r.neighbour.frames,
            cuda,
            r.ratio(),
            kib(r.hostile_rss.0),
            kib(r.hostile_rss.1),
            kib(r.hostile_peak),
            cpu,
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

// ---- The CUDA section: a guest's CUDA driver (capset 21) as a hostile guest would drive it ----

/// The compute context (capset 21) of either VM.
const CUDA_CTX: u32 = 5;
/// The second compute context of `cuda_killed_mid_kernel`: the program that gets killed.
const KILLED_CTX: u32 = 6;
/// The compute blobs' resource ids: the hostile VM's first is its main channel, the second
/// the killed program's.
const CUDA_BLOBS: [u32; 2] = [50, 51];
/// Pieces of each compute blob.
const CUDA_BLOB_PIECES: usize = 4;
/// Bytes of each piece: a 2 MiB blob holds the largest request of the section (the deep PTX
/// module, about 1.3 MB) and the printf kernel's output.
const CUDA_BLOB_PIECE: u32 = 512 << 10;
/// Rounds of the CUDA cases (each an attacked window between two windows alone): two keep
/// the section short, since every window is measured twice (GL, then CUDA).
const CUDA_ROUNDS: usize = 2;
/// How long each window of the well-behaved VM lasts in the CUDA cases, for its GL and for
/// its CUDA rate each: 24 requests of either at their paces, an even number so that every
/// GL window holds as many frames as virgl submits (they alternate).
const CUDA_WINDOW: Duration = Duration::from_millis(480);
/// The well-behaved VM's paced GL demand in the CUDA cases, one request each this often (50
/// groups/s: 25 frames of 10 ms, a quarter of the engine): below its fair share of the
/// engine, so that keeping [`MIN_RATIO`] of its rate is what a working scheduler guarantees
/// even while the hostile VM uses its whole share.
const GOOD_GL_PACE: Duration = Duration::from_millis(20);
/// The well-behaved VM's paced CUDA demand: one small launch (a Batch of a launch and a
/// context synchronise) this often.
const GOOD_CUDA_PACE: Duration = Duration::from_millis(20);
/// Longest wait for the hostile device's answer to one compute request: far past any
/// request's deadline, so a device silent for this long counts as hung.
const CUDA_ANSWER_WAIT: Duration = TIMEOUT;
/// The daemon's group timeout (`--group-timeout-ms`) in the CUDA cases, named so that
/// `cuda_group_timeout` can time its groups out on purpose; the default of the daemon.
const CUDA_GROUP_TIMEOUT_MS: u64 = 2000;
/// The daemon's group timeout in `cuda_group_timeout`: short, so that every spin group of the
/// hostile VM outlives it several times within one attacked window.
const SHORT_GROUP_TIMEOUT_MS: u64 = 300;
/// Zstandard entries of the fat-binary bomb (finding 1), each a frame of about 2 KiB that
/// expands to [`BOMB_ENTRY_BYTES`]: 12 of them ask for 768 MiB, three times the hostile
/// VM's budget, while the request is about 26 KB.
const BOMB_ENTRIES: usize = 12;
/// What each bomb entry expands to: the fat-binary parser's per-entry limit.
const BOMB_ENTRY_BYTES: usize = mdev_backend::compute::fatbin::MAX_DECOMPRESSED_BYTES;
/// Compute contexts of `cuda_memory` (finding 2), each asking for [`MEMORY_ALLOC_BYTES`]:
/// 1 GiB in all, four times the hostile VM's `--resource-memory-mb`.
const MEMORY_CONTEXTS: usize = 4;
/// One allocation of `cuda_memory`.
const MEMORY_ALLOC_BYTES: u64 = 256 << 20;
/// Launches in one Batch of `cuda_launch_batch` (finding 3): the wire's most, less the
/// synchronise that ends it.
const BATCH_LAUNCHES: usize = mdev_backend::compute::wire::MAX_BATCH - 1;
/// Loop iterations of each `busy` launch of `cuda_launch_batch`: a short kernel (well under
/// the per-launch budget) that a Batch of [`BATCH_LAUNCHES`] multiplies.
const BUSY_ITERATIONS: u32 = 20_000;
/// Threads of the printf kernel (finding 3), each printing 64 `%s` of 4 KiB: 1 MiB of output,
/// half the wire's text limit.
const PRINTF_THREADS: u32 = 4;
/// How long `cuda_reset_spin` lets its spin kernel run before it resets the device.
const SPIN_BEFORE_RESET: Duration = Duration::from_millis(200);
/// How long `cuda_reset_spin` then watches the hostile device process's CPU time.
const AFTER_RESET_WINDOW: Duration = Duration::from_secs(1);
/// CPU time the hostile device may burn in [`AFTER_RESET_WINDOW`] after a reset: a reset
/// cancels its kernels (within 10 ms by the issue's bound; this leaves room for the
/// re-initialisation and a busy machine).
const AFTER_RESET_CPU_MAX_S: f64 = 0.25;
/// Nesting of the Batch of `cuda_nested_batch` (finding 4): a 200 KB request.
const NESTED_BATCH_DEPTH: usize = 20_000;
/// Nested scopes of the PTX of `cuda_deep_ptx` (finding 5: the issue's 200k).
const DEEP_SCOPES: usize = 200_000;
/// Instructions inside the innermost scope of `cuda_deep_ptx` (the issue's 20k).
const DEEP_INSTRUCTIONS: usize = 20_000;
/// Blobs `cuda_blob_entries` creates before it resets the device and starts again (finding
/// 6), across attacked windows: 2000 blobs of [`BLOB_ENTRIES`] name 500 MiB of entry lists.
const ENTRY_BLOBS: u32 = 2000;
/// The hostile device's budget in `cuda_blob_entries`: small, so that the entry lists a
/// debug build's device takes in within the case's attacked windows (a few hundred blobs)
/// are well past it.
const BLOB_ENTRIES_RESOURCE_MB: u64 = 64;
/// Memory entries of each of those blobs (all naming one page): the device's most
/// (`MAX_BACKING_ENTRIES`), 256 KiB of entry list each.
const BLOB_ENTRIES: usize = 16384;
/// RESOURCE_CREATE_BLOBs of `cuda_blob_entries` published at once, three descriptors each
/// (its own header, the entry list all share, its response): what the hostile VM's ring
/// holds.
const ENTRY_CHAINS: u16 = HOSTILE_QUEUE_SIZE / 3;
/// Bytes of a RESOURCE_CREATE_BLOB before its entries.
const CREATE_BLOB_HEADER: usize = CTRL_HDR_SIZE + 32;
/// The first resource id of `cuda_blob_entries`' blobs.
const ENTRY_BLOB_ID: u32 = 1000;
/// A guest-physical address far outside the qtest VM's RAM (finding 8).
const OUTSIDE_RAM: u64 = 0x7fff_0000_0000;
/// Resource ids of `cuda_bad_entries`' blob and 2D resource.
const BAD_BLOB_ID: u32 = 60;
const BAD_2D_ID: u32 = 61;
/// How long the killed program's kernel runs before its context is destroyed.
const KILL_AFTER: Duration = Duration::from_millis(200);
/// How much of a refusal's message the table quotes.
const ERROR_TEXT_CHARS: usize = 60;
/// `VIRTQ_DESC_F_WRITE`.
const DESC_F_WRITE: u16 = 2;
/// The byte `cuda_wraparound` fills its allocation with, to see whether a refused copy or
/// memset changed it.
const WRAP_PATTERN: u8 = 0x5a;

/// The hostile VM's module: a kernel that does nothing, one that spins for ever, one that
/// loops `n` times, and one whose threads print 64 strings of 4 KiB each.
fn hostile_ptx() -> String {
    let mut big = String::new();
    for _ in 0..4096 {
        big.push_str("65, ");
    }
    big.push('0');
    let format: String = "%s".repeat(64);
    let format_bytes: Vec<String> = format
        .bytes()
        .chain(std::iter::once(0))
        .map(|b| b.to_string())
        .collect();
    let mut stores = String::new();
    for i in 0..64 {
        stores.push_str(&format!("st.local.u64 [%rd2+{}], %rd4;\n", 8 * i));
    }
    format!(
        r#".version 7.0
.target sm_70
.address_size 64
.extern .func (.param .b32 func_retval0) vprintf (.param .b64 vprintf_param_0, .param .b64 vprintf_param_1);
.global .align 1 .b8 $fmt[{flen}] = {{{fbytes}}};
.global .align 1 .b8 $big[4097] = {{{big}}};
.visible .entry tiny()
{{
ret;
}}
.visible .entry spin()
{{
.reg .b32 %r<2>;
mov.u32 %r1, 0;
SPIN:
add.u32 %r1, %r1, 1;
bra.uni SPIN;
}}
.visible .entry busy(.param .u32 n)
{{
.reg .pred %p<2>;
.reg .b32 %r<3>;
ld.param.u32 %r1, [n];
mov.u32 %r2, 0;
BUSY:
add.u32 %r2, %r2, 1;
setp.lt.u32 %p1, %r2, %r1;
@%p1 bra.uni BUSY;
ret;
}}
.visible .entry shout()
{{
.local .align 8 .b8 __local_depot0[512];
.reg .b64 %SP;
.reg .b64 %SPL;
.reg .b32 %r<2>;
.reg .b64 %rd<6>;
mov.u64 %SPL, __local_depot0;
cvta.local.u64 %SP, %SPL;
add.u64 %rd1, %SP, 0;
add.u64 %rd2, %SPL, 0;
mov.u64 %rd3, $big;
cvta.global.u64 %rd4, %rd3;
{stores}mov.u64 %rd5, $fmt;
cvta.global.u64 %rd5, %rd5;
{{
.param .b64 param0;
st.param.b64 [param0], %rd5;
.param .b64 param1;
st.param.b64 [param1], %rd1;
.param .b32 retval0;
call.uni (retval0), vprintf, (param0, param1);
ld.param.b32 %r1, [retval0];
}}
ret;
}}
"#,
        flen = format_bytes.len(),
        fbytes = format_bytes.join(", "),
    )
}

/// A fat binary of `entries` Zstandard PTX entries, each a frame of RLE blocks expanding to
/// [`BOMB_ENTRY_BYTES`] of newlines (what finding 1 sent).
fn bomb_image(entries: usize) -> Vec<u8> {
    /// Zstandard's largest block.
    const BLOCK: usize = 128 << 10;
    let mut frame = Vec::new();
    frame.extend_from_slice(&0xFD2F_B528u32.to_le_bytes());
    // Frame header: no content size, no checksum, a window descriptor of 128 KiB.
    frame.extend_from_slice(&[0x00, 7 << 3]);
    let blocks = BOMB_ENTRY_BYTES / BLOCK;
    for i in 0..blocks {
        let last = u32::from(i + 1 == blocks);
        // Block header: last flag, type 1 (RLE), the regenerated size; then the byte.
        let header = (BLOCK as u32) << 3 | 1 << 1 | last;
        frame.extend_from_slice(&header.to_le_bytes()[..3]);
        frame.push(b'\n');
    }
    let padded = frame.len().next_multiple_of(8);
    let mut body = Vec::new();
    for i in 0..entries {
        let mut e = vec![0u8; 64];
        e[0..2].copy_from_slice(&1u16.to_le_bytes()); // PTX
        e[2..4].copy_from_slice(&0x101u16.to_le_bytes());
        e[4..8].copy_from_slice(&64u32.to_le_bytes());
        e[8..16].copy_from_slice(&(padded as u64).to_le_bytes());
        e[16..20].copy_from_slice(&(frame.len() as u32).to_le_bytes());
        e[28..32].copy_from_slice(&(70 + i as u32).to_le_bytes());
        e[40..48].copy_from_slice(&(0x8000u64 | 0x11).to_le_bytes()); // Zstandard
        e[56..64].copy_from_slice(&(BOMB_ENTRY_BYTES as u64).to_le_bytes());
        e.extend_from_slice(&frame);
        e.resize(64 + padded, 0);
        body.extend_from_slice(&e);
    }
    let mut f = Vec::new();
    f.extend_from_slice(&0xBA55_ED50u32.to_le_bytes());
    f.extend_from_slice(&1u16.to_le_bytes());
    f.extend_from_slice(&16u16.to_le_bytes());
    f.extend_from_slice(&(body.len() as u64).to_le_bytes());
    f.extend_from_slice(&body);
    f
}

/// A framed Batch message nested `depth` deep around an empty Batch, written the way a
/// hostile guest library would (each level: opcode 29, count 1, the inner body's length).
fn nested_batch_message(depth: usize) -> Vec<u8> {
    const OPCODE_BATCH: u16 = 29;
    const EMPTY: usize = 6;
    const LEVEL: usize = 10;
    let total = EMPTY + depth * LEVEL;
    let mut m = Vec::with_capacity(total + 4);
    m.extend_from_slice(&(total as u32).to_le_bytes());
    for level in (1..=depth).rev() {
        let inner = EMPTY + (level - 1) * LEVEL;
        m.extend_from_slice(&OPCODE_BATCH.to_le_bytes());
        m.extend_from_slice(&1u32.to_le_bytes());
        m.extend_from_slice(&(inner as u32).to_le_bytes());
    }
    m.extend_from_slice(&OPCODE_BATCH.to_le_bytes());
    m.extend_from_slice(&0u32.to_le_bytes());
    m
}

/// A PTX module whose kernel nests [`DEEP_SCOPES`] scopes around [`DEEP_INSTRUCTIONS`]
/// instructions naming a register of the outermost scope (finding 5).
fn deep_ptx_text() -> String {
    let mut t = String::from(
        ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry deep()\n{\n.reg .b32 %r<2>;\n",
    );
    t.push_str(&"{\n".repeat(DEEP_SCOPES));
    t.push_str(&"add.u32 %r1, %r1, 1;\n".repeat(DEEP_INSTRUCTIONS));
    t.push_str(&"}\n".repeat(DEEP_SCOPES));
    t.push_str("ret;\n}\n");
    t
}

/// A launch of `function` on one block of `threads` threads.
fn launch(ctx: ContextId, function: FunctionId, threads: u32, params: Vec<u8>) -> Request {
    Request::Launch {
        ctx,
        function,
        grid: [1, 1, 1],
        block: [threads, 1, 1],
        shared_bytes: 0,
        stream: DEFAULT_STREAM,
        params,
        cooperative: false,
    }
}

/// `launches` followed by a synchronise of their context, as one Batch.
fn run_batch(ctx: ContextId, mut launches: Vec<Request>) -> Request {
    launches.push(Request::ContextSynchronize { ctx });
    Request::Batch(launches)
}

/// One compute exchange through `blob` on compute context `vctx`: the framed `message` in,
/// a fenced SUBMIT_3D answered OK, the reply out; an error when the submit is refused, not
/// answered within `timeout`, or no reply is written.
fn exchange(
    guest: &mut VgpuGuest,
    blob: &ComputeBlob,
    vctx: u32,
    message: &[u8],
    timeout: Duration,
) -> Result<Reply, String> {
    let submit = blob.put_message(guest, vctx, message, 1);
    let answer = call(guest, &submit, timeout)?;
    if answer != RESP_OK_NODATA {
        return Err(format!("compute submit answered {answer:#x}"));
    }
    blob.try_reply(guest)
}

/// The handle a reply carries, or what came instead.
fn handle(reply: Reply) -> Result<u32, String> {
    match reply {
        Reply::Id(id) => Ok(id),
        other => Err(format!("expected a handle, got {other:?}")),
    }
}

/// The CUresult of a failed reply (0 when it succeeded).
fn status_of(reply: &Reply) -> u32 {
    match reply {
        Reply::Error { status, .. } => *status,
        Reply::Batch {
            error: Some((status, _)),
            ..
        } => *status,
        _ => 0,
    }
}

/// A CUDA context with the hostile (or the neighbour's) module loaded.
struct Program {
    ctx: ContextId,
    module: ModuleId,
}

impl Program {
    /// Creates a CUDA context on compute context `vctx` through `blob` and loads `ptx`.
    fn open(
        guest: &mut VgpuGuest,
        blob: &ComputeBlob,
        vctx: u32,
        ptx: &str,
    ) -> Result<Program, String> {
        let ask = |guest: &mut VgpuGuest, r: &Request| {
            exchange(guest, blob, vctx, &r.encode(), CUDA_ANSWER_WAIT)
        };
        let ctx = ContextId(handle(ask(guest, &Request::ContextCreate)?)?);
        let load = Request::ModuleLoad {
            ctx,
            image: ptx.as_bytes().to_vec(),
        };
        let module = ModuleId(handle(ask(guest, &load)?)?);
        Ok(Program { ctx, module })
    }

    /// The kernel `name` of its module.
    fn function(
        &self,
        guest: &mut VgpuGuest,
        blob: &ComputeBlob,
        vctx: u32,
        name: &str,
    ) -> Result<FunctionId, String> {
        let r = Request::Function {
            ctx: self.ctx,
            module: self.module,
            name: name.into(),
        };
        match exchange(guest, blob, vctx, &r.encode(), CUDA_ANSWER_WAIT)? {
            Reply::Function { id, .. } => Ok(id),
            other => Err(format!("function {name}: {other:?}")),
        }
    }
}

/// The well-behaved VM's CUDA workload: paced short launches of a kernel that does nothing,
/// each a Batch of the launch and a synchronise, through its own blob.
struct CudaNeighbour {
    blob: ComputeBlob,
    /// The encoded Batch each exchange sends.
    run: Vec<u8>,
}

impl CudaNeighbour {
    fn start(guest: &mut VgpuGuest, blob: ComputeBlob) -> Result<CudaNeighbour, String> {
        let ptx = hostile_ptx();
        let program = Program::open(guest, &blob, CUDA_CTX, &ptx)?;
        let tiny = program.function(guest, &blob, CUDA_CTX, "tiny")?;
        let run = run_batch(program.ctx, vec![launch(program.ctx, tiny, 32, vec![])]).encode();
        Ok(CudaNeighbour { blob, run })
    }
}

/// `utime + stime` of `pid` in seconds; `None` once it is gone.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces) start at state (field 3).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf takes no pointers.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 / hz as f64)
}

/// Lowers every thread of `pid` to [`HOSTILE_NICE`]: the device's compute threads are started
/// by threads that existed before the process was reniced (see [`renice`]).
fn renice_tasks(pid: u32) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    for task in tasks.flatten() {
        if let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) {
            renice(tid);
        }
    }
}

/// What a case's attack did, and what it saw that the boundary should have refused.
#[derive(Default)]
struct Outcome {
    what: String,
    violations: Vec<String>,
}

impl From<String> for Outcome {
    fn from(what: String) -> Outcome {
        Outcome {
            what,
            violations: Vec::new(),
        }
    }
}

/// The CUDA attacks (the issue's findings as a guest would exercise them). Each attacks while
/// `gate` says so, waits while it pauses, returns once it stops.
mod cuda {
    use super::*;

    impl HostileVm {
        /// The compute blob the attacks talk through.
        fn blob(&self) -> ComputeBlob {
            self.blobs[0].clone()
        }

        /// One exchange on the hostile VM's compute context.
        fn ask(&mut self, request: &Request) -> Result<Reply, String> {
            self.ask_raw(&request.encode())
        }

        fn ask_raw(&mut self, message: &[u8]) -> Result<Reply, String> {
            renice_tasks(self.server.pid());
            let blob = self.blob();
            exchange(&mut self.guest, &blob, CUDA_CTX, message, CUDA_ANSWER_WAIT)
        }

        /// A new CUDA context with the hostile module and the kernel `name`.
        fn program(&mut self, name: &str) -> Result<(Program, FunctionId), String> {
            let blob = self.blob();
            let program = Program::open(&mut self.guest, &blob, CUDA_CTX, &hostile_ptx())?;
            let f = program.function(&mut self.guest, &blob, CUDA_CTX, name)?;
            Ok((program, f))
        }

        /// Destroys CUDA context `ctx` (its answer does not matter).
        fn drop_context(&mut self, ctx: ContextId) -> Result<(), String> {
            self.ask(&Request::ContextDestroy { ctx }).map(|_| ())
        }

        /// Waits for the used ring to return every chain of `heads`, at most `timeout`.
        fn wait_heads(&mut self, heads: &[u16], timeout: Duration) -> Result<(), String> {
            let deadline = Instant::now() + timeout;
            let mut left: Vec<u16> = heads.to_vec();
            while !left.is_empty() {
                let wait = deadline.saturating_duration_since(Instant::now());
                let qt = self.guest.vm.qtest();
                let done = self
                    .guest
                    .dev
                    .wait_used(qt, CONTROL_QUEUE, wait)
                    .map_err(|e| e.to_string())?;
                left.retain(|&h| u32::from(h) != done.used.id);
            }
            Ok(())
        }
    }

    /// An error as the attacks report it.
    fn text(e: impl std::fmt::Display) -> String {
        e.to_string()
    }

    /// The first words of a failed reply's message (empty for a success).
    fn error_text(reply: &Reply) -> String {
        let message = match reply {
            Reply::Error { message, .. } => message.as_str(),
            Reply::Batch {
                error: Some((_, message)),
                ..
            } => message.as_str(),
            _ => "",
        };
        message.chars().take(ERROR_TEXT_CHARS).collect()
    }

    /// A reply that should have been a refusal, as a violation.
    fn accepted(what: &str, reply: &Reply) -> String {
        format!("{what} was accepted: {reply:?}")
    }

    /// ModuleLoads of a fat binary of Zstandard bombs (finding 1).
    pub fn fatbin_bomb(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        let (program, _) = vm.program("tiny")?;
        let image = bomb_image(BOMB_ENTRIES);
        let request = Request::ModuleLoad {
            ctx: program.ctx,
            image,
        };
        let mut out = Outcome::default();
        let (mut loads, mut slowest) = (0, Duration::ZERO);
        while gate.go() {
            let start = Instant::now();
            let reply = vm.ask(&request)?;
            slowest = slowest.max(start.elapsed());
            loads += 1;
            if status_of(&reply) == 0 {
                out.violations
                    .push(accepted("a fat binary of bombs", &reply));
            }
        }
        out.what = format!(
            "{loads} ModuleLoads of {BOMB_ENTRIES} Zstandard entries x {} MiB, slowest answer {:.2} s",
            BOMB_ENTRY_BYTES >> 20,
            slowest.as_secs_f64()
        );
        Ok(out)
    }

    /// Contexts that each allocate a large buffer (finding 2), destroyed and made again.
    pub fn memory(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        let budget = HOSTILE_RESOURCE_MB << 20;
        let mut out = Outcome::default();
        let (mut rounds, mut most) = (0, 0u64);
        while gate.go() {
            let mut contexts = Vec::new();
            let mut granted = 0u64;
            for _ in 0..MEMORY_CONTEXTS {
                let ctx = ContextId(handle(vm.ask(&Request::ContextCreate)?)?);
                contexts.push(ctx);
                let alloc = Request::MemAlloc {
                    ctx,
                    bytes: MEMORY_ALLOC_BYTES,
                };
                if let Reply::Address(_) = vm.ask(&alloc)? {
                    granted += MEMORY_ALLOC_BYTES;
                }
            }
            most = most.max(granted);
            for ctx in contexts {
                vm.drop_context(ctx)?;
            }
            rounds += 1;
        }
        if most > budget {
            out.violations.push(format!(
                "{} MiB of device memory granted with a budget of {HOSTILE_RESOURCE_MB} MiB",
                most >> 20
            ));
        }
        out.what = format!(
            "{rounds} rounds of {MEMORY_CONTEXTS} contexts x {} MiB, at most {} MiB granted",
            MEMORY_ALLOC_BYTES >> 20,
            most >> 20
        );
        Ok(out)
    }

    /// Launches of `name` with `threads` threads and `params`, `count` per Batch, each in a new
    /// context (a launch that runs out of time breaks its context); the answers' statuses,
    /// their slowest time and the most CPU time one cost.
    fn launches(
        vm: &mut HostileVm,
        gate: &Gate,
        name: &str,
        threads: u32,
        params: &[u8],
        count: usize,
    ) -> Result<Outcome, String> {
        let pid = vm.server.pid();
        let (mut runs, mut slowest, mut most_cpu) = (0, Duration::ZERO, 0f64);
        let mut statuses = std::collections::BTreeMap::new();
        while gate.go() {
            let (program, f) = vm.program(name)?;
            let batch = run_batch(
                program.ctx,
                vec![launch(program.ctx, f, threads, params.to_vec()); count],
            );
            let cpu = cpu_seconds(pid).unwrap_or(0.0);
            let start = Instant::now();
            let reply = vm.ask(&batch)?;
            slowest = slowest.max(start.elapsed());
            most_cpu = most_cpu.max(cpu_seconds(pid).unwrap_or(0.0) - cpu);
            statuses
                .entry(status_of(&reply))
                .or_insert_with(|| error_text(&reply));
            vm.drop_context(program.ctx)?;
            runs += 1;
        }
        Ok(Outcome::from(format!(
            "{runs} Batches of {count} `{name}` launches x {threads} threads answered with \
             CUresult {statuses:?}, slowest {:.2} s, at most {most_cpu:.2} CPU-s each",
            slowest.as_secs_f64()
        )))
    }

    /// A kernel that never ends (finding 3; also `cuda_group_timeout`, under a daemon whose
    /// group timeout it outlives on purpose).
    pub fn spin_kernel(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        launches(vm, gate, "spin", 1, &[], 1)
    }

    /// A Batch of the most launches of a short kernel (finding 3).
    pub fn launch_batch(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        launches(
            vm,
            gate,
            "busy",
            1,
            &BUSY_ITERATIONS.to_le_bytes(),
            BATCH_LAUNCHES,
        )
    }

    /// A kernel whose every thread prints 64 strings of 4 KiB (finding 3).
    pub fn printf(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        launches(vm, gate, "shout", PRINTF_THREADS, &[], 1)
    }

    /// A spin kernel queued, then a device reset; the device's CPU time after the reset
    /// (finding 3: a reset never cancelled).
    pub fn reset_spin(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        let pid = vm.server.pid();
        let mut out = Outcome::default();
        let (mut resets, mut most) = (0, 0f64);
        while gate.go() {
            let (program, f) = vm.program("spin")?;
            let batch = run_batch(program.ctx, vec![launch(program.ctx, f, 1, vec![])]);
            let blob = vm.blob();
            let submit = blob.put(&mut vm.guest, CUDA_CTX, &batch, 1);
            vm.queue(&submit)?;
            std::thread::sleep(SPIN_BEFORE_RESET);
            vm.reset()?;
            renice_tasks(pid);
            let cpu = cpu_seconds(pid).unwrap_or(0.0);
            std::thread::sleep(AFTER_RESET_WINDOW);
            let burned = cpu_seconds(pid).unwrap_or(0.0) - cpu;
            most = most.max(burned);
            resets += 1;
        }
        if most > AFTER_RESET_CPU_MAX_S {
            out.violations.push(format!(
                "{most:.2} CPU-s burned in the {:.1} s after a reset (at most {AFTER_RESET_CPU_MAX_S})",
                AFTER_RESET_WINDOW.as_secs_f64()
            ));
        }
        out.what = format!(
            "{resets} resets {} ms into a spin kernel, at most {most:.2} CPU-s in the {:.1} s after",
            SPIN_BEFORE_RESET.as_millis(),
            AFTER_RESET_WINDOW.as_secs_f64()
        );
        Ok(out)
    }

    /// A Batch nested [`NESTED_BATCH_DEPTH`] deep (finding 4).
    pub fn nested_batch(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        let message = nested_batch_message(NESTED_BATCH_DEPTH);
        let mut out = Outcome::default();
        let mut sent = 0;
        while gate.go() {
            let reply = vm.ask_raw(&message)?;
            if status_of(&reply) == 0 {
                out.violations.push(accepted("a nested Batch", &reply));
            }
            sent += 1;
        }
        out.what = format!(
            "{sent} Batches nested {NESTED_BATCH_DEPTH} deep ({} KB each)",
            message.len() / 1000
        );
        Ok(out)
    }

    /// A module of deeply nested scopes (finding 5).
    pub fn deep_ptx(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        let pid = vm.server.pid();
        let ctx = ContextId(handle(vm.ask(&Request::ContextCreate)?)?);
        let text = deep_ptx_text();
        let request = Request::ModuleLoad {
            ctx,
            image: text.clone().into_bytes(),
        };
        let (mut loads, mut slowest, mut most_cpu) = (0, Duration::ZERO, 0f64);
        let mut statuses = std::collections::BTreeMap::new();
        while gate.go() {
            let cpu = cpu_seconds(pid).unwrap_or(0.0);
            let start = Instant::now();
            let reply = vm.ask(&request)?;
            slowest = slowest.max(start.elapsed());
            most_cpu = most_cpu.max(cpu_seconds(pid).unwrap_or(0.0) - cpu);
            statuses
                .entry(status_of(&reply))
                .or_insert_with(|| error_text(&reply));
            if let Reply::Id(m) = reply {
                vm.ask(&Request::ModuleUnload {
                    ctx,
                    module: ModuleId(m),
                })?;
            }
            loads += 1;
        }
        Ok(Outcome::from(format!(
            "{loads} ModuleLoads of {DEEP_SCOPES} scopes x {DEEP_INSTRUCTIONS} instructions \
             ({} KB) answered with CUresult {statuses:?}, slowest {:.2} s, at most {most_cpu:.2} CPU-s each",
            text.len() / 1000,
            slowest.as_secs_f64()
        )))
    }

    /// RESOURCE_CREATE_BLOBs with the longest entry lists, [`ENTRY_CHAINS`] per kick and
    /// held across attacked windows, until [`ENTRY_BLOBS`]; then a reset frees them and it
    /// starts again (finding 6). The requests are written to guest memory once; each kick
    /// writes the descriptor table and the avail ring in one piece, as a fast guest driver
    /// would.
    pub fn blob_entries(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        let page = vm.ram.alloc(4096, 4096).map_err(text)?;
        let template = virtio_gpu::resource_create_blob(
            0,
            virtio_gpu::BLOB_MEM_GUEST,
            virtio_gpu::BLOB_FLAG_USE_MAPPABLE,
            4096 * BLOB_ENTRIES as u64,
            &vec![(page, 4096u32); BLOB_ENTRIES],
        );
        let (header, list) = template.split_at(CREATE_BLOB_HEADER);
        let list_len = u32::try_from(list.len()).map_err(|e| e.to_string())?;
        let list_at = vm.ram.alloc(u64::from(list_len), 4096).map_err(text)?;
        let header_stride = CREATE_BLOB_HEADER.next_multiple_of(16) as u64;
        let headers_at = vm
            .ram
            .alloc(header_stride * u64::from(ENTRY_BLOBS), 4096)
            .map_err(text)?;
        let response_stride = CTRL_HDR_SIZE as u64;
        let responses_at = vm
            .ram
            .alloc(response_stride * u64::from(ENTRY_CHAINS), 4096)
            .map_err(text)?;
        let mut headers = Vec::new();
        for id in ENTRY_BLOB_ID..ENTRY_BLOB_ID + ENTRY_BLOBS {
            let mut h = header.to_vec();
            h[CTRL_HDR_SIZE..CTRL_HDR_SIZE + 4].copy_from_slice(&id.to_le_bytes());
            h.resize(header_stride as usize, 0);
            headers.extend_from_slice(&h);
        }
        let qt = vm.guest.vm.qtest();
        qt.memwrite(list_at, list).map_err(text)?;
        qt.memwrite(headers_at, &headers).map_err(text)?;
        let mut out = Outcome::default();
        let (mut rounds, mut created, mut most) = (0, 0u32, 0u32);
        let mut next = ENTRY_BLOBS;
        while gate.go() {
            if next == ENTRY_BLOBS {
                vm.reset()?;
                renice_tasks(vm.server.pid());
                most = most.max(created);
                (created, next) = (0, 0);
                rounds += 1;
            }
            let n = ENTRY_CHAINS.min(u16::try_from(ENTRY_BLOBS - next).unwrap_or(0));
            let qt = vm.guest.vm.qtest();
            let queue = vm
                .guest
                .dev
                .queue(CONTROL_QUEUE)
                .map_err(|e| e.to_string())?;
            let (size, avail) = (queue.size(), queue.avail_idx());
            let (table, ring) = (queue.desc_address(), queue.avail_address());
            let used = vm
                .guest
                .dev
                .read_used_idx(qt, CONTROL_QUEUE)
                .map_err(|e| e.to_string())?;
            let mut descriptors = Vec::new();
            let mut slots = vec![0u8; 2 * usize::from(size)];
            for j in 0..n {
                let head = 3 * j;
                let blob = u64::from(next) + u64::from(j);
                for d in [
                    Descriptor {
                        addr: headers_at + blob * header_stride,
                        len: CREATE_BLOB_HEADER as u32,
                        flags: DESC_F_NEXT,
                        next: head + 1,
                    },
                    Descriptor {
                        addr: list_at,
                        len: list_len,
                        flags: DESC_F_NEXT,
                        next: head + 2,
                    },
                    Descriptor {
                        addr: responses_at + u64::from(j) * response_stride,
                        len: CTRL_HDR_SIZE as u32,
                        flags: DESC_F_WRITE,
                        next: 0,
                    },
                ] {
                    descriptors.extend_from_slice(&d.to_bytes());
                }
                let slot = 2 * usize::from(avail.wrapping_add(j) % size);
                slots[slot..slot + 2].copy_from_slice(&head.to_le_bytes());
            }
            qt.memwrite(table, &descriptors).map_err(text)?;
            qt.memwrite(ring + 4, &slots).map_err(text)?;
            vm.guest
                .dev
                .write_avail_idx(qt, CONTROL_QUEUE, avail.wrapping_add(n))
                .map_err(|e| e.to_string())?;
            vm.guest
                .dev
                .notify(qt, CONTROL_QUEUE)
                .map_err(|e| e.to_string())?;
            vm.wait_used_or_broken(used.wrapping_add(n), CUDA_ANSWER_WAIT);
            if vm.status() & NEEDS_RESET != 0 {
                return Err("the device needs a reset after RESOURCE_CREATE_BLOBs".into());
            }
            let qt = vm.guest.vm.qtest();
            let answers = qt
                .memread(responses_at, usize::from(n) * CTRL_HDR_SIZE)
                .map_err(text)?;
            created += answers
                .chunks(CTRL_HDR_SIZE)
                .filter(|h| CtrlHeader::parse(h).is_ok_and(|h| h.ctrl_type == RESP_OK_NODATA))
                .count() as u32;
            next += u32::from(n);
        }
        most = most.max(created);
        vm.reset()?;
        let held = u64::from(most) * list.len() as u64;
        if held > BLOB_ENTRIES_RESOURCE_MB << 20 {
            out.violations.push(format!(
                "{most} blobs of {BLOB_ENTRIES} entries ({} MiB of entry lists) accepted with a \
                 budget of {BLOB_ENTRIES_RESOURCE_MB} MiB",
                held >> 20
            ));
        }
        out.what = format!(
            "{rounds} rounds of up to {ENTRY_BLOBS} blobs of {BLOB_ENTRIES} entries, at most {most} accepted"
        );
        Ok(out)
    }

    /// CopyDtoD and MemsetD32 whose ranges wrap around 2^64 (finding 7); the allocation must
    /// keep its bytes.
    pub fn wraparound(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        const BYTES: u64 = 4096;
        let ctx = ContextId(handle(vm.ask(&Request::ContextCreate)?)?);
        let Reply::Address(a) = vm.ask(&Request::MemAlloc { ctx, bytes: BYTES })? else {
            return Err("MemAlloc refused".into());
        };
        let pattern = vec![WRAP_PATTERN; BYTES as usize];
        let mut out = Outcome::default();
        let (mut tries, mut refused) = (0, 0);
        while gate.go() {
            vm.ask(&Request::CopyHtoD {
                ctx,
                dst: a,
                data: pattern.clone(),
                stream: DEFAULT_STREAM,
            })?;
            let attacks = [
                Request::MemsetD32 {
                    ctx,
                    addr: a + 4,
                    value: 0,
                    count: (u64::MAX - 3) / 4,
                    stream: DEFAULT_STREAM,
                },
                Request::CopyDtoD {
                    ctx,
                    dst: a + 8,
                    src: a + 8,
                    bytes: u64::MAX - 7,
                    stream: DEFAULT_STREAM,
                },
                Request::CopyDtoD {
                    ctx,
                    dst: a + 8,
                    src: a,
                    bytes: u64::MAX - 7,
                    stream: DEFAULT_STREAM,
                },
            ];
            for attack in &attacks {
                let reply = vm.ask(attack)?;
                if status_of(&reply) == 0 {
                    out.violations.push(accepted("a wrapping range", &reply));
                } else {
                    refused += 1;
                }
                let back = vm.ask(&Request::CopyDtoH {
                    ctx,
                    src: a,
                    bytes: BYTES,
                    stream: DEFAULT_STREAM,
                })?;
                if back != Reply::Data(pattern.clone()) {
                    out.violations
                        .push(format!("the allocation changed under a refused {attack:?}"));
                }
                tries += 1;
            }
        }
        out.violations.dedup();
        out.what = format!("{tries} wrapping MemsetD32/CopyDtoD, {refused} refused");
        Ok(out)
    }

    /// A blob and a 2D backing naming memory outside guest RAM, and a compute submit on
    /// that blob (finding 8).
    pub fn bad_entries(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        let outside = [(OUTSIDE_RAM, 4096u32)];
        let mut out = Outcome::default();
        let mut tries = 0;
        while gate.go() {
            let create = virtio_gpu::resource_create_blob(
                BAD_BLOB_ID,
                virtio_gpu::BLOB_MEM_GUEST,
                virtio_gpu::BLOB_FLAG_USE_MAPPABLE,
                4096,
                &outside,
            );
            if call(&mut vm.guest, &create, TIMEOUT)? == RESP_OK_NODATA {
                out.violations
                    .push("RESOURCE_CREATE_BLOB of an entry outside guest RAM answered OK".into());
                call(
                    &mut vm.guest,
                    &virtio_gpu::ctx_attach_resource(CUDA_CTX, BAD_BLOB_ID),
                    TIMEOUT,
                )?;
                let submit = virtio_gpu::compute_submit(CUDA_CTX, BAD_BLOB_ID, 8, 4096);
                if call(&mut vm.guest, &submit, TIMEOUT)? == RESP_OK_NODATA {
                    out.violations.push(
                        "a compute submit on that blob answered OK (no reply can be written)"
                            .into(),
                    );
                }
                call(
                    &mut vm.guest,
                    &virtio_gpu::resource_unref(BAD_BLOB_ID),
                    TIMEOUT,
                )?;
            }
            let create_2d =
                virtio_gpu::resource_create_2d(BAD_2D_ID, virtio_gpu::FORMAT_B8G8R8X8, 32, 32);
            call(&mut vm.guest, &create_2d, TIMEOUT)?;
            let attach = virtio_gpu::resource_attach_backing(BAD_2D_ID, &outside);
            if call(&mut vm.guest, &attach, TIMEOUT)? == RESP_OK_NODATA {
                out.violations
                    .push("ATTACH_BACKING of an entry outside guest RAM answered OK".into());
            }
            call(
                &mut vm.guest,
                &virtio_gpu::resource_unref(BAD_2D_ID),
                TIMEOUT,
            )?;
            tries += 1;
        }
        out.violations.sort();
        out.violations.dedup();
        out.what = format!("{tries} rounds of a blob, a 2D backing and a submit outside guest RAM");
        Ok(out)
    }

    /// A program killed mid-kernel: its compute context destroyed while its spin kernel
    /// runs; then the next program's first launch (finding 11).
    pub fn killed_mid_kernel(vm: &mut HostileVm, gate: &Gate) -> Result<Outcome, String> {
        let killed_blob = vm.blobs[1].clone();
        let mut out = Outcome::default();
        let (mut kills, mut slowest_next) = (0, Duration::ZERO);
        while gate.go() {
            let create = virtio_gpu::ctx_create(KILLED_CTX, virtio_gpu::CAPSET_COMPUTE, b"killed");
            call(&mut vm.guest, &create, TIMEOUT)?;
            call(
                &mut vm.guest,
                &virtio_gpu::ctx_attach_resource(KILLED_CTX, killed_blob.id),
                TIMEOUT,
            )?;
            let program = Program::open(&mut vm.guest, &killed_blob, KILLED_CTX, &hostile_ptx())?;
            let spin = program.function(&mut vm.guest, &killed_blob, KILLED_CTX, "spin")?;
            renice_tasks(vm.server.pid());
            let batch = run_batch(program.ctx, vec![launch(program.ctx, spin, 1, vec![])]);
            let submit = killed_blob.put(&mut vm.guest, KILLED_CTX, &batch, 1);
            let running = vm.queue(&submit)?;
            std::thread::sleep(KILL_AFTER);
            let destroy = vm.queue(&virtio_gpu::ctx_destroy(KILLED_CTX))?;
            if let Err(e) = vm.wait_heads(&[running, destroy], CUDA_ANSWER_WAIT) {
                out.violations.push(format!(
                    "the killed program's kernel was not cancelled ({e})"
                ));
                // The device still holds the chains: start over as the guest's driver would.
                vm.reset()?;
            }
            let start = Instant::now();
            let (next, tiny) = vm.program("tiny")?;
            vm.ask(&run_batch(
                next.ctx,
                vec![launch(next.ctx, tiny, 1, vec![])],
            ))?;
            slowest_next = slowest_next.max(start.elapsed());
            vm.drop_context(next.ctx)?;
            kills += 1;
        }
        out.violations.dedup();
        out.what = format!(
            "{kills} programs killed {} ms into a spin kernel; the next program's first launch took at most {:.2} s",
            KILL_AFTER.as_millis(),
            slowest_next.as_secs_f64()
        );
        Ok(out)
    }
}
