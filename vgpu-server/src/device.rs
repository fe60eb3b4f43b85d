//! One vGPU as the guest sees it: the PCI function (config space, BAR structures), the
//! virtio-pci transport, the virtqueues, the virtio-gpu device model, interrupts and guest
//! memory, behind one lock shared by the message loop and the worker.
//!
//! Register accesses arrive here already validated against the region layout
//! ([`crate::transport`]); this module decodes BAR offsets into virtio structures, processes
//! queues, and turns every protocol violation into DEVICE_NEEDS_RESET.

use std::collections::VecDeque;
use std::fmt::Display;
use std::fs::File;
use std::sync::Arc;
use std::time::Instant;

use log::{debug, error, info, warn};
use mdev_backend::GpuBackend;
use mdev_backend::budget::Charge;
use vgpu_schedd::proto::Msg;
use vgpu_schedd::seqpacket::monotonic_ns;
use vgpu_scheduler::{CostSignature, GroupId, GroupKind};
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryMmap};

use crate::gpu::compute::{self, ComputeKind, ComputeRuntime, Event};
use crate::gpu::dump::Frame;
use crate::gpu::fence::{FenceState, Parked, Wait};
use crate::gpu::load::{self, LoadRunner, LoadToken};
use crate::gpu::protocol::{self, ControlCommand, ControlRequest, CtrlHeader, Response};
use crate::gpu::three_d::Renderer;
use crate::gpu::{DisplayConfig, GpuDevice};
use crate::irq::{Interrupts, IrqChange, IrqError};
use crate::memory::{GuestRam, MemoryError};
use crate::metrics::{DeviceMetrics, add, inc, set};
use crate::pci::{self, ConfigSpace};
use crate::queue::{CheckedChain, DescTable};
use crate::ratelimit::guest_fault;
use crate::sched_client::{FallbackShare, Gate, SchedError, Scheduling};
use crate::virtio_pci::{
    CONTROL_QUEUE, Effect, ISR_CONFIG, ISR_QUEUE, NO_VECTOR, NUM_QUEUES, VirtioPciTransport,
};
use mdev_backend::compute::wire::{Reply, Request};

/// Most chains one queue notification processes before the worker turns to its other work
/// (the other queue, the scheduler daemon's socket, QEMU's messages waiting for the device
/// lock); the rest is processed on the next turn. A Linux guest keeps at most a queue's worth
/// (256) in flight; 64 keeps a turn well under a millisecond for the small commands that make
/// up almost all traffic.
pub const MAX_CHAINS_PER_KICK: u32 = 64;
/// Most request bytes one queue notification copies out of guest memory before the worker
/// turns to its other work: four of the largest requests ([`crate::queue::MAX_REQUEST_BYTES`]),
/// or sixteen of Mesa's 256 KiB command buffers. A chain is always processed whole, so a turn
/// copies less than this plus one request.
pub const MAX_BYTES_PER_KICK: usize = 4 << 20;

/// What one queue notification has used of its [`MAX_CHAINS_PER_KICK`] and
/// [`MAX_BYTES_PER_KICK`].
#[derive(Debug, Default)]
struct KickBudget {
    chains: u32,
    bytes: usize,
}

impl KickBudget {
    fn charge(&mut self, request_bytes: usize) {
        self.chains = self.chains.saturating_add(1);
        self.bytes = self.bytes.saturating_add(request_bytes);
    }

    fn spent(&self) -> bool {
        self.chains >= MAX_CHAINS_PER_KICK || self.bytes >= MAX_BYTES_PER_KICK
    }
}

/// Which structure of the virtio BAR an offset falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VirtioRegion {
    /// Common configuration, offset relative to its start.
    Common(u64),
    /// ISR status.
    Isr,
    /// Device configuration, offset relative to its start.
    Device(u64),
    /// Notification of this queue.
    Notify(u16),
}

/// Decodes an access to the virtio BAR; `None` for holes between the structures and for
/// accesses that straddle a structure's end.
pub fn decode_virtio_bar(offset: u64, len: usize) -> Option<VirtioRegion> {
    let end = offset.checked_add(len as u64)?;
    let within = |start: u64, size: u64| offset >= start && end <= start + size;
    if within(pci::COMMON_CFG_OFFSET, pci::COMMON_CFG_LEN) {
        Some(VirtioRegion::Common(offset - pci::COMMON_CFG_OFFSET))
    } else if offset == pci::ISR_OFFSET && len == 1 {
        Some(VirtioRegion::Isr)
    } else if within(pci::DEVICE_CFG_OFFSET, pci::DEVICE_CFG_LEN)
        && offset % len as u64 == 0
        && len <= 4
    {
        Some(VirtioRegion::Device(offset - pci::DEVICE_CFG_OFFSET))
    } else if within(pci::NOTIFY_OFFSET, pci::NOTIFY_LEN) && (len == 2 || len == 4) {
        let rel = offset - pci::NOTIFY_OFFSET;
        let multiplier = u64::from(pci::NOTIFY_OFF_MULTIPLIER);
        (rel % multiplier == 0).then(|| VirtioRegion::Notify((rel / multiplier) as u16))
    } else {
        None
    }
}

/// The state of one vGPU for one client connection.
#[derive(Debug)]
pub struct Device {
    config: ConfigSpace,
    transport: VirtioPciTransport,
    gpu: GpuDevice,
    irqs: Interrupts,
    ram: GuestRam,
    metrics: Arc<DeviceMetrics>,
    /// Keep the undumped scanout images across a reset, for [`Device::take_frames`].
    retain_frames: bool,
    /// Scanout images taken just before a reset, not yet handed out.
    retained: Vec<Frame>,
    /// Fenced completions waiting for their fence.
    fences: FenceState,
    /// Renderer fences created, in order, with what each one signals.
    issued: VecDeque<(u32, Issued)>,
    /// The last renderer fence id given out.
    last_fence: u32,
    /// The control-queue chain popped but not processed: a group waiting for the scheduler
    /// daemon (nothing more is popped while it waits).
    backlog: Option<CheckedChain>,
    /// The device's side of the scheduler daemon protocol.
    sched: Scheduling,
    /// The local engine running load-capset groups.
    load: LoadRunner,
    /// Origin of the load engine's time (ns since then).
    epoch: Instant,
    /// Compute-capset requests on the VM's compute executor.
    compute: ComputeRuntime,
    /// The compute request `gate` read for the chain with this head, so that the execution
    /// that follows runs what was scheduled without reading the guest's blob again.
    gated_compute: Option<(u16, compute::Submit)>,
    /// The scheduled (time-sliced) compute request on the executor, if any: at most one, as
    /// the executor runs one request at a time (a group dispatched behind a paused one would
    /// hold the daemon's GPU without running).
    sliced: Option<SlicedCompute>,
}

/// A scheduled compute request on the executor: each slice of it is a scheduler group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlicedCompute {
    /// The token of its submit.
    token: LoadToken,
    /// Its guest compute context and cost signature, which its continuation groups carry.
    ctx: u32,
    signature: CostSignature,
    slice: Slice,
}

/// Where a scheduled compute request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slice {
    /// Running a slice, which is this group (`None`: the gate gave it none).
    Running(Option<Ran>),
    /// Paused at the end of a slice, its continuation waiting for the gate; `asked`: the
    /// continuation's group is the one the scheduler holds at the front of the control queue
    /// (asked of the daemon, or granted and not run yet).
    Yielded { asked: bool },
}

/// [`Gate`] with the context of a scheduled group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GateFor {
    Run(Option<(GroupId, u32)>),
    Hold,
}

/// What a renderer fence signals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Issued {
    /// The guest's fence with this id.
    guest: Option<u64>,
    /// A scheduled group finished. A fenced group's completion rides on the guest's fence:
    /// one renderer fence (and one wake-up of the renderer's fence thread) serves both.
    group: Option<Ran>,
}

/// A scheduled group handed to the renderer: of scheduler session `session`, started at
/// `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ran {
    group: GroupId,
    session: u64,
    start: u64,
}

/// Most virgl command headers a cost signature covers: the rest of a long stream adds nothing
/// (the signature is a prediction key; bounding it bounds the work per submit).
const MAX_SIGNATURE_COMMANDS: usize = 1024;

/// The cost signature of a virgl command stream: its commands and their lengths.
fn virgl_signature(dwords: &[u32]) -> CostSignature {
    let mut methods = Vec::new();
    let mut at = 0usize;
    while let Some(&header) = dwords.get(at) {
        if methods.len() >= MAX_SIGNATURE_COMMANDS {
            break;
        }
        let len = header >> 16;
        methods.push((header & 0xff, len));
        at = at.saturating_add(1).saturating_add(len as usize);
    }
    CostSignature::from_methods(&mut methods)
}

/// What a held request's completion waits for, besides the earlier fenced ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FenceWait {
    /// A renderer fence created in this context after the request's work.
    Renderer(u32),
    /// A load submit's groups (`None`: it had none, so only the earlier completions).
    Load(Option<LoadToken>),
    /// The scheduler daemon's `Present` for a frame (a RESOURCE_FLUSH of a 3D resource that
    /// reached a scanout, announced with `Frame`); held whether the request is fenced or not.
    Present(LoadToken),
}

impl Device {
    /// A powered-on device with no guest memory and no interrupts yet; `virgl` offers 3D (the
    /// worker has a renderer).
    pub fn new(display: DisplayConfig, metrics: Arc<DeviceMetrics>, virgl: bool) -> Self {
        let gpu = GpuDevice::new(display, virgl);
        Device {
            config: ConfigSpace::new(),
            transport: VirtioPciTransport::new(gpu.features(), pci::MSIX_VECTORS),
            irqs: Interrupts::new(pci::MSIX_VECTORS),
            ram: GuestRam::new(),
            metrics,
            retain_frames: false,
            retained: Vec::new(),
            fences: FenceState::default(),
            issued: VecDeque::new(),
            last_fence: 0,
            backlog: None,
            sched: Scheduling::default(),
            load: LoadRunner::default(),
            epoch: Instant::now(),
            compute: ComputeRuntime::new(ComputeKind::Cpu, Arc::clone(gpu.budget())),
            gpu,
            gated_compute: None,
            sliced: None,
        }
    }

    /// The backend compute-capset requests run on (`--compute`; the PTX executor by default),
    /// charging the VM's budget, and how long one request may run on the PTX executor
    /// (`--compute-request-time`) and on which engine (`--ptx-engine`).
    pub fn set_compute(
        &mut self,
        kind: ComputeKind,
        request_time: std::time::Duration,
        engine: mdev_backend::compute::ptx::Engine,
    ) {
        self.compute = ComputeRuntime::new(kind, Arc::clone(self.gpu.budget()))
            .with_request_time(request_time)
            .with_ptx_engine(engine);
    }

    /// The eventfd written when a compute request finished: the worker's control-queue kick,
    /// whose handler calls [`Device::compute_done`].
    pub fn set_compute_notify(&mut self, notify: Arc<vmm_sys_util::eventfd::EventFd>) {
        self.compute.set_notify(notify);
    }

    /// Completes the compute requests that finished: each reply goes into its blob, its
    /// scheduler group is reported complete, and its fenced submit is released. A scheduled
    /// request that yielded completes the group of its slice; its continuation is gated when
    /// the control queue is processed next (the worker does so after this).
    pub fn compute_done(&mut self) {
        let events = self.compute.take_events();
        if events.is_empty() {
            return;
        }
        if let Err(e) = self.ram.check_backing() {
            self.fault(e);
            return;
        }
        let mem = self.ram.atomic().memory();
        let mut tokens = Vec::with_capacity(events.len());
        for e in events {
            let d = match e {
                Event::Yielded { token, at } => {
                    self.compute_yielded(token, at);
                    continue;
                }
                Event::Done(d) => d,
            };
            if let Err(e) = self.gpu.blobs().write(&*mem, d.resource_id, &d.reply) {
                guest_fault!("compute reply: {e}");
            }
            match self.sliced.take_if(|s| s.token == d.token) {
                Some(s) => self.sliced_done(s, d.start, d.finish),
                None => {
                    if let Some((group, session)) = d.group {
                        self.sched.completed(group, session, d.start, d.finish);
                    }
                }
            }
            tokens.push(d.token);
        }
        self.note_memory();
        self.loads_done(tokens);
    }

    /// The scheduled compute request of submit `token` yielded at `at`: its slice's group is
    /// complete, and a continuation group is to be gated.
    fn compute_yielded(&mut self, token: LoadToken, at: u64) {
        let Some(s) = self.sliced.as_mut().filter(|s| s.token == token) else {
            debug!("a compute request that is not the scheduled one yielded");
            return;
        };
        let was = std::mem::replace(&mut s.slice, Slice::Yielded { asked: false });
        if let Slice::Running(Some(r)) = was {
            self.sched.completed(r.group, r.session, r.start, at);
        }
    }

    /// The scheduled compute request `s` finished (it ran from `start` to `finish`): the
    /// group of its last slice completes; a continuation still waiting for the gate (the
    /// request was cancelled while paused) is withdrawn from the daemon.
    fn sliced_done(&mut self, s: SlicedCompute, start: u64, finish: u64) {
        match s.slice {
            Slice::Running(Some(r)) => {
                self.sched
                    .completed(r.group, r.session, r.start.max(start), finish);
            }
            Slice::Yielded { asked: true } => self.sched.withdraw_held(),
            Slice::Running(None) | Slice::Yielded { asked: false } => {}
        }
    }

    /// Gates the continuation of the scheduled compute request that yielded, if one waits:
    /// first in the control queue, unless the chain held there already asked for its group
    /// (the grant is that chain's). Resumes the request when its group may run; false when
    /// it is held (nothing behind it goes on).
    fn gate_continuation(&mut self) -> bool {
        let Some(s) = self.sliced else {
            return true;
        };
        let Slice::Yielded { asked } = s.slice else {
            return true;
        };
        if !asked && self.sched.asking() {
            return true;
        }
        let now = monotonic_ns();
        let gate = self.sched.gate(s.ctx, GroupKind::Compute, s.signature, now);
        let slice = match gate {
            Gate::Hold => Slice::Yielded {
                asked: self.sched.asking(),
            },
            Gate::Run(group) => Slice::Running(group.map(|group| Ran {
                group,
                session: self.sched.session(),
                start: now,
            })),
        };
        self.sliced = Some(SlicedCompute { slice, ..s });
        match gate {
            Gate::Hold => false,
            Gate::Run(_) => {
                if !self.compute.resume(s.token) {
                    debug!("a yielded compute request ended before its continuation ran");
                }
                true
            }
        }
    }

    /// Sets the VM's host-memory budget, in bytes (`--resource-memory-mb`): one budget for
    /// its 2D and 3D resources, blobs and entry lists, queued compute requests, and the
    /// compute backend's device memory and modules. Set before the guest runs.
    pub fn set_resource_budget(&mut self, bytes: u64) {
        self.gpu.set_resource_budget(bytes);
        self.compute = ComputeRuntime::new(self.compute.kind(), Arc::clone(self.gpu.budget()));
        self.note_memory();
    }

    /// Puts the VM's budget figures into the metrics and the scheduler daemon's reports.
    fn note_memory(&mut self) {
        let budget = self.gpu.budget();
        let (used, limit) = (budget.used(), budget.limit());
        set(&self.metrics.memory_used_bytes, used);
        set(&self.metrics.memory_limit_bytes, limit);
        self.sched.note_memory(used, limit, monotonic_ns());
    }

    /// Scanout images are being dumped: a reset keeps the images flushed since the last dump
    /// so that they are still written.
    pub fn retain_frames_on_reset(&mut self) {
        self.retain_frames = true;
    }

    /// The GPU device model (for tests and diagnostics).
    pub fn gpu(&self) -> &GpuDevice {
        &self.gpu
    }

    /// Whether scanout images were flushed since they were last taken.
    pub fn frames_undumped(&self) -> bool {
        !self.retained.is_empty() || self.gpu.frames_undumped()
    }

    /// Takes the scanout images flushed since they were last taken (`all`: every enabled
    /// scanout's image), including those kept across a reset. Copies only: encode them
    /// without the device lock.
    ///
    /// `virgl` (worker thread) reads scanouts of 3D resources back.
    pub fn take_frames(&mut self, all: bool, virgl: Option<&dyn GpuBackend>) -> Vec<Frame> {
        let mut frames = std::mem::take(&mut self.retained);
        for frame in self.gpu.take_frames(all, virgl) {
            frames.retain(|f| f.scanout != frame.scanout);
            frames.push(frame);
        }
        frames
    }

    /// The device status register (for tests and diagnostics).
    pub fn status(&self) -> u8 {
        self.transport.status()
    }

    /// Records a protocol violation and puts the device into DEVICE_NEEDS_RESET.
    pub fn fault(&mut self, what: impl Display) {
        inc(&self.metrics.transport_faults);
        guest_fault!("device needs reset: {what}");
        if self.transport.set_needs_reset() {
            self.signal_config_change();
        }
    }

    /// Function-level reset (vfio DEVICE_RESET): config space, transport and device state.
    /// Guest memory and interrupt eventfds belong to QEMU and stay.
    pub fn function_reset(&mut self) {
        self.config = ConfigSpace::new();
        self.virtio_reset();
    }

    fn virtio_reset(&mut self) {
        inc(&self.metrics.resets);
        self.transport.reset();
        if self.retain_frames && self.gpu.frames_undumped() {
            self.retained = self.gpu.take_frames(false, None);
        }
        self.gpu.reset();
        self.fences.reset();
        // Groups already handed to the renderer ran (or are running) on the GPU: report
        // them complete now, so the daemon never waits on a group the reset made us forget.
        let now = monotonic_ns();
        for (_, issued) in self.issued.drain(..) {
            if let Some(r) = issued.group {
                self.sched.completed(r.group, r.session, r.start, now);
            }
        }
        // So is the slice of the scheduled compute request running: the reset cancels it
        // within milliseconds and its reply is dropped, so its group completes now.
        if let Some(SlicedCompute {
            slice: Slice::Running(Some(r)),
            ..
        }) = self.sliced
        {
            self.sched.completed(r.group, r.session, r.start, now);
        }
        self.backlog = None;
        self.sched.reset(now);
        self.load.reset();
        self.compute.reset();
        self.gated_compute = None;
        // Its continuation, if one was asked, was cancelled at the daemon with the others.
        self.sliced = None;
        self.note_memory();
        self.config.set_interrupt_status(false);
        info!("device reset");
    }

    /// The client is going away: every group this device has at the daemon is cancelled
    /// (the cancels wait in the scheduler outbox for the worker's next flush).
    pub fn withdraw_from_scheduler(&mut self) {
        self.sched.withdraw(monotonic_ns());
    }

    /// Reads configuration space.
    ///
    /// A read of the VIRTIO_PCI_CAP_PCI_CFG window reads the virtio register it names.
    pub fn config_read(&mut self, offset: u64, data: &mut [u8]) {
        match self.window_target(offset, data.len()) {
            None => self.config.read(offset, data),
            Some(target) => {
                data.fill(0);
                if let Some((region, length)) = target {
                    self.virtio_read(region, &mut data[..length]);
                }
            }
        }
    }

    /// Writes configuration space. A write to the VIRTIO_PCI_CAP_PCI_CFG window writes the
    /// virtio register it names; for a queue notification the queue to kick is returned.
    pub fn config_write(&mut self, offset: u64, data: &[u8]) -> Option<u16> {
        match self.window_target(offset, data.len()) {
            None => self.config.write(offset, data),
            Some(Some((VirtioRegion::Notify(q), _))) => return Some(q),
            Some(Some((region, length))) => self.virtio_write(region, &data[..length]),
            Some(None) => {}
        }
        None
    }

    /// For a config access to the window: `Some(Some(register, length))`, or `Some(None)` when
    /// the window names no register (a violation, already recorded). `None` for other accesses.
    fn window_target(&mut self, offset: u64, len: usize) -> Option<Option<(VirtioRegion, usize)>> {
        let target = match self.config.pci_cfg_window(offset, len)? {
            Ok((_, bar_offset, length)) => match decode_virtio_bar(bar_offset, length) {
                Some(region) => Some((region, length)),
                None => {
                    self.fault(format_args!(
                        "config window names no register at {bar_offset:#x}+{length}"
                    ));
                    None
                }
            },
            Err(e) => {
                self.fault(e);
                None
            }
        };
        Some(target)
    }

    /// Reads a decoded register of the virtio BAR.
    pub fn virtio_read(&mut self, region: VirtioRegion, data: &mut [u8]) {
        data.fill(0);
        match region {
            VirtioRegion::Common(off) => {
                if let Err(e) = self.transport.read_common(off, data) {
                    self.fault(e);
                }
            }
            VirtioRegion::Isr => {
                data[0] = self.transport.read_isr();
                self.config.set_interrupt_status(false);
            }
            VirtioRegion::Device(off) => self.gpu.config_read(off, data),
            VirtioRegion::Notify(_) => {}
        }
    }

    /// Writes a decoded register of the virtio BAR. Notifications do not come here: the
    /// message loop turns them into worker kicks without taking the device lock.
    pub fn virtio_write(&mut self, region: VirtioRegion, data: &[u8]) {
        match region {
            VirtioRegion::Common(off) => {
                let mem = self.ram.atomic().memory();
                match self.transport.write_common(off, data, &*mem) {
                    Ok(Effect::Reset) => self.virtio_reset(),
                    Ok(Effect::DriverOk | Effect::None) => {}
                    Err(e) => self.fault(e),
                }
            }
            VirtioRegion::Device(off) => self.gpu.config_write(off, data),
            VirtioRegion::Isr => debug!("write to ISR ignored"),
            VirtioRegion::Notify(q) => debug!("notify for queue {q} reached the device lock"),
        }
    }

    /// Handles DMA_MAP.
    pub fn dma_map(
        &mut self,
        addr: u64,
        size: u64,
        file: Option<File>,
        offset: u64,
        writable: bool,
    ) -> Result<(), MemoryError> {
        self.ram.map(addr, size, file, offset, writable)?;
        inc(&self.metrics.dma_maps);
        Ok(())
    }

    /// Handles DMA_UNMAP (`all`: the ALL flag, every mapping).
    pub fn dma_unmap(&mut self, addr: u64, size: u64, all: bool) -> Result<(), MemoryError> {
        if all {
            self.ram.clear();
        } else {
            self.ram.unmap(addr, size)?;
        }
        inc(&self.metrics.dma_unmaps);
        Ok(())
    }

    /// Handles SET_IRQS.
    pub fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> Result<IrqChange, IrqError> {
        let change = self.irqs.set_irqs(index, flags, start, count, fds)?;
        if change == IrqChange::IntxUnmasked {
            self.intx_unmasked();
        }
        Ok(change)
    }

    /// A duplicate of the INTx resample eventfd for the worker's poll set.
    pub fn resample_fd(&self) -> Option<File> {
        self.irqs.resample_fd()
    }

    /// INTx was unmasked (UNMASK action or the guest's EOI): a still-pending ISR fires again.
    pub fn intx_unmasked(&mut self) {
        self.irqs.unmask_intx();
        if self.transport.isr_pending() && !self.irqs.msix_enabled() {
            self.assert_intx();
        }
    }

    fn assert_intx(&mut self) {
        if self.config.intx_disabled() {
            return;
        }
        self.config.set_interrupt_status(true);
        if self.irqs.trigger_intx() {
            inc(&self.metrics.interrupts);
        }
    }

    fn signal(&mut self, vector: u16, isr: u8) {
        if self.irqs.msix_enabled() {
            if vector != NO_VECTOR && self.irqs.trigger_msix(vector) {
                inc(&self.metrics.interrupts);
            }
        } else {
            self.transport.raise_isr(isr);
            self.assert_intx();
        }
    }

    fn signal_config_change(&mut self) {
        self.signal(self.transport.config_vector(), ISR_CONFIG);
    }

    /// Processes the available buffers of queue `q` (the worker calls this on a kick), one
    /// chain at a time: each is popped, validated, copied and executed before the next is
    /// popped. At most [`MAX_CHAINS_PER_KICK`] chains and [`MAX_BYTES_PER_KICK`] request bytes
    /// are handled per call; returns true if more remain (the worker kicks the queue again, so
    /// the other queue, the scheduler socket and QEMU's messages are served in between).
    ///
    /// `virgl` (worker thread only) runs 3D commands and fences: a fenced request's used-ring
    /// entry is parked until [`Device::fences_signalled`] releases it.
    pub fn process_queue(&mut self, q: u16, virgl: Option<&dyn GpuBackend>) -> bool {
        if q >= NUM_QUEUES || !self.transport.is_live() || !self.transport.queue_ready(q) {
            inc(&self.metrics.notifies_ignored);
            debug!("notify for queue {q} ignored: device not live or queue not enabled");
            return false;
        }
        if let Err(e) = self.ram.check_backing() {
            self.fault(e);
            return false;
        }
        let mem: Arc<GuestMemoryMmap> = self.ram.atomic().memory().into_inner();
        let mut completed = 0u32;
        let mut budget = KickBudget::default();
        let mut violation = None;
        let more = loop {
            if budget.spent() {
                let left = self.chains_available(q, &mem);
                if left {
                    inc(&self.metrics.kicks_deferred);
                }
                break left;
            }
            // A scheduled compute request that yielded goes on first, when its turn comes.
            if q == CONTROL_QUEUE && !self.gate_continuation() {
                break false;
            }
            // The control queue goes on where a group waiting for the scheduler stopped it.
            let held = if q == CONTROL_QUEUE {
                self.backlog.take()
            } else {
                None
            };
            let chain = match held.map_or_else(|| self.pop_chain(q, &mem), |c| Ok(Some(c))) {
                Ok(Some(chain)) => chain,
                Ok(None) => break false,
                Err(e) => {
                    violation = Some(e);
                    break false;
                }
            };
            budget.charge(chain.request().len());
            let mut rider = None;
            let (len, fence) = match q {
                CONTROL_QUEUE => {
                    let group = match self.gate(&chain, virgl.is_some()) {
                        GateFor::Hold => {
                            self.backlog = Some(chain);
                            break false;
                        }
                        GateFor::Run(group) => group,
                    };
                    let start = monotonic_ns();
                    // A compute group completes when the executor finished it, not by a fence.
                    let compute = group
                        .filter(|&(_, ctx)| self.gpu.is_compute_context(ctx))
                        .map(|(g, _)| g);
                    let result = self.control_request(&chain, &mem, virgl, compute);
                    if let (None, Some((group, ctx_id))) = (compute, group) {
                        let ran = Ran {
                            group,
                            session: self.sched.session(),
                            start,
                        };
                        rider = Some((ran, ctx_id));
                    }
                    result
                }
                _ => (self.cursor_request(&chain), None),
            };
            // A scheduled group's completion rides on the guest's fence of the same context,
            // or gets a renderer fence of its own.
            let riding = rider
                .filter(|&(_, ctx)| matches!(fence, Some((_, FenceWait::Renderer(c))) if c == ctx))
                .map(|(ran, _)| ran);
            if riding.is_none()
                && let (Some((ran, ctx_id)), Some(v)) = (rider, virgl)
            {
                self.group_fence(v, ran, ctx_id);
            }
            if let Some((fence_id, wait)) = fence {
                let entry = Parked {
                    fence_id,
                    queue: q,
                    head: chain.head(),
                    len,
                    wait: Wait::Renderer,
                };
                let parked = match (wait, virgl) {
                    (FenceWait::Renderer(ctx_id), Some(v)) => self.park(v, entry, ctx_id, riding),
                    // Without a renderer, fenced 2D work is done when it returns.
                    (FenceWait::Renderer(_), None) => false,
                    (FenceWait::Load(token), _) => self.park_load(entry, token),
                    (FenceWait::Present(token), _) => self.park_load(entry, Some(token)),
                };
                if parked {
                    continue;
                }
            }
            let added = self
                .transport
                .queue_mut(q)
                .map(|queue| queue.add_used(&*mem, chain.head(), len));
            if let Some(Err(e)) = added {
                violation = Some(format!("queue {q}: completing head {}: {e}", chain.head()));
                break false;
            }
            completed += 1;
        };
        if let Some(v) = violation {
            self.fault(v);
        }
        if completed > 0 {
            match self
                .transport
                .queue_mut(q)
                .map(|queue| queue.needs_notification(&*mem))
            {
                Some(Ok(true)) => self.signal(self.transport.queue_vector(q), ISR_QUEUE),
                Some(Ok(false)) | None => {}
                Some(Err(e)) => self.fault(format_args!("queue {q}: {e}")),
            }
        }
        more && self.transport.is_live()
    }

    /// Pops and validates the next available chain of queue `q` (`None`: the ring is empty);
    /// the error is the violation that stopped the walk.
    fn pop_chain(&mut self, q: u16, mem: &GuestMemoryMmap) -> Result<Option<CheckedChain>, String> {
        let Some(queue) = self.transport.queue_mut(q) else {
            return Ok(None);
        };
        let table = DescTable {
            addr: GuestAddress(queue.desc_table()),
            size: queue.size(),
        };
        let head = match queue.iter(mem) {
            Ok(mut iter) => iter.next().map(|chain| chain.head_index()),
            Err(e) => return Err(format!("queue {q}: {e}")),
        };
        let bound = match q {
            CONTROL_QUEUE => protocol::control_copy_bound,
            _ => protocol::cursor_copy_bound,
        };
        head.map(|head| CheckedChain::new(mem, table, head, bound))
            .transpose()
            .map_err(|e| format!("queue {q}: {e}"))
    }

    /// Whether queue `q` has chains the device has not popped yet (a read of the available
    /// index; a bad one is found again, and refused, by the next pop).
    fn chains_available(&mut self, q: u16, mem: &GuestMemoryMmap) -> bool {
        if q == CONTROL_QUEUE && self.backlog.is_some() {
            return true;
        }
        self.transport.queue_mut(q).is_some_and(|queue| {
            queue
                .avail_idx(mem, std::sync::atomic::Ordering::Acquire)
                .is_ok_and(|idx| idx.0 != queue.next_avail())
        })
    }

    /// Parks a fenced completion behind a renderer fence, which also reports the scheduled
    /// group `ran` complete; false if it must complete now (its fence already signalled, or
    /// the renderer refused the fence).
    fn park(
        &mut self,
        virgl: &dyn GpuBackend,
        entry: Parked,
        ctx_id: u32,
        ran: Option<Ran>,
    ) -> bool {
        let what = Issued {
            guest: Some(entry.fence_id),
            group: ran,
        };
        if let Err(e) = self.renderer_fence(virgl, ctx_id, what) {
            guest_fault!("fence {}: {e}; completing at once", entry.fence_id);
            return false;
        }
        match self.fences.park(entry) {
            Ok(None) => true,
            Ok(Some(_)) => false,
            Err(e) => {
                guest_fault!("fence {}: {e}; completing at once", entry.fence_id);
                false
            }
        }
    }

    /// Creates the next renderer fence in context `ctx_id`, signalling `what`. The renderer's
    /// fence ids are 32-bit and ours count up, so their order holds within any 2^32 fences in
    /// flight. When the renderer refuses it, nothing will signal it: a scheduled group that
    /// was to ride on it is reported complete now (the caller completes the guest's fence).
    fn renderer_fence(
        &mut self,
        virgl: &dyn GpuBackend,
        ctx_id: u32,
        what: Issued,
    ) -> mdev_backend::BackendResult<()> {
        let id = self.last_fence.wrapping_add(1).max(1);
        if let Err(e) = virgl.create_fence(id, ctx_id) {
            if let Some(r) = what.group {
                self.sched
                    .completed(r.group, r.session, r.start, monotonic_ns());
            }
            return Err(e);
        }
        self.last_fence = id;
        self.issued.push_back((id, what));
        Ok(())
    }

    /// After a scheduled group without a guest fence ran: a renderer fence whose signal
    /// reports its completion.
    fn group_fence(&mut self, virgl: &dyn GpuBackend, ran: Ran, ctx_id: u32) {
        let what = Issued {
            guest: None,
            group: Some(ran),
        };
        if let Err(e) = self.renderer_fence(virgl, ctx_id, what) {
            guest_fault!("group {}: fence: {e}; reported complete now", ran.group.0);
        }
    }

    /// Whether the control request `chain` may run now: GPU-executing commands (SUBMIT_3D on
    /// a virgl context, TRANSFER_*_3D) ask the scheduler daemon while one is connected, and
    /// go under the fallback budget while a daemon given with `--scheduler` has not admitted
    /// the device. `Run(Some((group, ctx)))` for a scheduled group.
    fn gate(&mut self, chain: &CheckedChain, renderer: bool) -> GateFor {
        if !renderer || !self.sched.gating() {
            return GateFor::Run(None);
        }
        let (ctx, kind, signature) = match protocol::decode_control(chain.request()) {
            Ok(ControlRequest {
                cmd: ControlCommand::Submit3d { ctx_id, commands },
                ..
            }) if self.gpu.is_compute_context(ctx_id) => {
                // A chain held for the daemon is gated again when its grant comes: it keeps
                // the request read the first time (the guest may have changed its blob since),
                // so the group the daemon granted is the one that runs and completes.
                let held = self
                    .gated_compute
                    .as_ref()
                    .filter(|(head, _)| *head == chain.head())
                    .map(|(_, (_, req, _))| req.work());
                let work = match held {
                    Some(work) => work,
                    None => {
                        let mem = self.ram.atomic().memory();
                        let budget = self.gpu.budget();
                        match self.gpu.blobs().request(commands.dwords(), &*mem, budget) {
                            Ok(submit) => {
                                let work = submit.1.work();
                                self.gated_compute = Some((chain.head(), submit));
                                work
                            }
                            // A request the submit itself answers with an error.
                            Err(_) => return GateFor::Run(None),
                        }
                    }
                };
                if !work.any() {
                    // Control work runs at once.
                    return GateFor::Run(None);
                }
                if self.sliced.is_some() {
                    // Scheduled compute requests run one at a time, as the executor runs
                    // them: the next one is gated when this one is done (`compute_done`).
                    return GateFor::Hold;
                }
                (ctx_id, GroupKind::Compute, compute::signature(&work))
            }
            Ok(ControlRequest {
                cmd: ControlCommand::Submit3d { ctx_id, commands },
                ..
            }) if !self.gpu.is_load_context(ctx_id) => (
                ctx_id,
                GroupKind::Render,
                virgl_signature(commands.dwords()),
            ),
            Ok(ControlRequest {
                hdr,
                cmd: ControlCommand::TransferToHost3d(t) | ControlCommand::TransferFromHost3d(t),
            }) => {
                let r = &t.transfer.region;
                let size = r.w.saturating_mul(r.h).saturating_mul(r.d);
                (
                    t.ctx_id,
                    GroupKind::Transfer,
                    CostSignature::from_methods(&mut [(hdr.ty, size)]),
                )
            }
            _ => return GateFor::Run(None),
        };
        match self.sched.gate(ctx, kind, signature, monotonic_ns()) {
            Gate::Hold => GateFor::Hold,
            Gate::Run(group) => GateFor::Run(group.map(|g| (g, ctx))),
        }
    }

    /// Parks a fenced load submit behind its groups (`None`: none), or a flush behind its
    /// frame's present, and every earlier completion; false if it must complete now.
    fn park_load(&mut self, entry: Parked, token: Option<LoadToken>) -> bool {
        let wait = token.map_or(Wait::Nothing, Wait::Load);
        match self.fences.park(Parked { wait, ..entry }) {
            Ok(None) => true,
            Ok(Some(_)) => false,
            Err(e) => {
                guest_fault!("fence {}: {e}; completing at once", entry.fence_id);
                false
            }
        }
    }

    /// Nanoseconds on the load engine's clock.
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// When the load engine's running group finishes, as a delay from now (`None`: idle).
    /// Scheduled presents count too, and when a group the fallback budget holds may go.
    pub fn load_deadline(&mut self) -> Option<std::time::Duration> {
        let now = monotonic_ns();
        let engine = self.load.deadline().map(|d| d.saturating_sub(self.now()));
        let sched = [self.sched.next_present(), self.sched.retry_at(now)];
        let waits = sched.into_iter().flatten().map(|at| at.saturating_sub(now));
        let wait = engine.into_iter().chain(waits).min()?;
        Some(std::time::Duration::from_nanos(wait))
    }

    /// Whether the control-queue group the device holds itself (the fallback budget, or a
    /// group the daemon does not know of still running) may be gated again now.
    pub fn sched_release_due(&mut self) -> bool {
        self.sched.release_due(monotonic_ns())
    }

    /// Runs the load engine up to now: the fenced submits whose groups have all finished
    /// complete, in order.
    /// Presents due by now are released too.
    pub fn load_tick(&mut self) {
        let now = self.now();
        let done = self.load.advance(now);
        self.loads_done(done);
        let presented = self.sched.presents_due(monotonic_ns());
        self.loads_done(presented);
    }

    /// Load submits whose work is all done: their completions go out, in order.
    fn loads_done(&mut self, tokens: Vec<LoadToken>) {
        for token in tokens {
            let released = self.fences.load_done(token);
            self.complete_parked(released);
        }
    }

    /// The device runs with `--scheduler`: until the daemon admits it, its GPU groups
    /// dispatch under `share` of the GPU (see [`crate::sched_client`]).
    pub fn sched_configure(&mut self, share: FallbackShare) {
        self.sched
            .configure(share, self.metrics.clone(), monotonic_ns());
    }

    /// The scheduler daemon link came up (`Hello` sent): groups ask it from now on.
    pub fn sched_connected(&mut self) {
        self.sched.connect();
    }

    /// Whether the scheduler daemon admitted the device on the current connection.
    pub fn sched_admitted(&self) -> bool {
        self.sched.admitted()
    }

    /// A message from the scheduler daemon; true when the control queue should be processed
    /// again (a held group may go on).
    pub fn sched_message(&mut self, msg: Msg) -> bool {
        let handled = self.sched.handle(msg, monotonic_ns());
        self.loads_done(handled.done);
        handled.resume_queue
    }

    /// The scheduler daemon is gone, or refused or dropped the device (`why`): the group
    /// waiting for it goes under the fallback budget, load groups it was running run on the
    /// local engine.
    pub fn sched_gone(&mut self, why: &SchedError) {
        let (back, released) = self.sched.disconnect(monotonic_ns(), why);
        let now = self.now();
        let mut lost = Vec::new();
        for (token, ctx, cost) in back {
            if let Err(e) = self.load.run(token, ctx, &[cost], now) {
                warn!("load group back from the scheduler daemon: {e}; completed now");
                lost.push(token);
            }
        }
        self.loads_done(released);
        self.loads_done(lost);
    }

    /// The messages for the scheduler daemon due now, oldest first (`all`: held reports too;
    /// see [`Scheduling::due_outbox`]).
    pub fn sched_outbox(&mut self, all: bool) -> Result<Vec<Msg>, SchedError> {
        if all {
            return self.sched.take_outbox();
        }
        self.sched.due_outbox(monotonic_ns())
    }

    /// Whether reports for the scheduler daemon are held back.
    pub fn sched_holds_reports(&self) -> bool {
        self.sched.holds_reports()
    }

    /// The renderer signalled fence `newest` (and every earlier one): the parked completions
    /// it covers go to their used rings, in order, with an interrupt per queue.
    /// Scheduled groups it covers are reported complete.
    pub fn fences_signalled(&mut self, newest: u32) {
        if !self.issued.iter().any(|&(id, _)| id == newest) {
            debug!("renderer fence {newest} is not one of ours");
            return;
        }
        let now = monotonic_ns();
        let mut guest_id = None;
        while let Some((id, what)) = self.issued.pop_front() {
            if let Some(r) = what.group {
                self.sched.completed(r.group, r.session, r.start, now);
            }
            guest_id = what.guest.or(guest_id);
            if id == newest {
                break;
            }
        }
        if let Some(guest_id) = guest_id {
            let released = self.fences.signal(guest_id);
            self.complete_parked(released);
        }
    }

    /// Puts released completions on their used rings, in order, with an interrupt per queue.
    fn complete_parked(&mut self, released: Vec<Parked>) {
        if released.is_empty() {
            return;
        }
        if let Err(e) = self.ram.check_backing() {
            self.fault(e);
            return;
        }
        let mem = self.ram.atomic().memory();
        let mut touched = [false; NUM_QUEUES as usize];
        for p in released {
            let Some(queue) = self.transport.queue_mut(p.queue).filter(|q| q.ready()) else {
                continue;
            };
            if let Err(e) = queue.add_used(&*mem, p.head, p.len) {
                self.fault(format_args!(
                    "queue {}: completing head {}: {e}",
                    p.queue, p.head
                ));
                return;
            }
            touched[usize::from(p.queue)] = true;
        }
        for q in (0..NUM_QUEUES).filter(|&q| touched[usize::from(q)]) {
            let notify = self
                .transport
                .queue_mut(q)
                .map(|queue| queue.needs_notification(&*mem));
            if let Some(Ok(true)) = notify {
                self.signal(self.transport.queue_vector(q), ISR_QUEUE);
            }
        }
    }

    /// Destroys the 3D objects a reset left behind (worker thread, before any queue work).
    pub fn reap_3d(&mut self, virgl: &dyn GpuBackend) {
        self.gpu.reap_3d(virgl);
    }

    /// Destroys every 3D object of this guest (the client went away).
    pub fn release_3d(&mut self, virgl: &dyn GpuBackend) {
        self.gpu.release_3d(virgl);
    }

    /// Decodes and executes one control request and writes its response; returns the used
    /// length and, for a fenced request or a flush held for its present, its fence id and
    /// what it waits for.
    fn control_request(
        &mut self,
        chain: &CheckedChain,
        mem: &Arc<GuestMemoryMmap>,
        virgl: Option<&dyn GpuBackend>,
        compute_group: Option<GroupId>,
    ) -> (u32, Option<(u64, FenceWait)>) {
        inc(&self.metrics.ctrl_requests);
        let frames_before = self.gpu.frames_flushed();
        let renderer = virgl.map(|virgl| Renderer { virgl, mem });
        let mut wait = None;
        let mut flushed_3d = false;
        let (hdr, response) = match protocol::decode_control(chain.request()) {
            Ok(ControlRequest {
                hdr,
                cmd: ControlCommand::Submit3d { ctx_id, commands },
            }) if self.gpu.is_load_context(ctx_id) => {
                match self.load_submit(&hdr, commands.dwords()) {
                    Ok(token) => {
                        wait = Some(FenceWait::Load(token));
                        (hdr, Response::OkNoData)
                    }
                    Err(e) => {
                        wait = Some(FenceWait::Load(None));
                        (hdr, Response::Err(e.response_code()))
                    }
                }
            }
            Ok(ControlRequest {
                hdr,
                cmd: ControlCommand::Submit3d { ctx_id, commands },
            }) if self.gpu.is_compute_context(ctx_id) => {
                let gated = self
                    .gated_compute
                    .take()
                    .filter(|(head, _)| *head == chain.head())
                    .map(|(_, submit)| submit);
                let (response, token) =
                    self.compute_submit(ctx_id, commands.dwords(), mem, compute_group, gated);
                wait = Some(FenceWait::Load(token));
                (hdr, response)
            }
            Ok(mut req) => {
                if let ControlCommand::ResourceFlush { resource_id, .. } = req.cmd {
                    flushed_3d = self.gpu.is_3d_resource(resource_id);
                }
                if let ControlCommand::CtxDestroy { ctx_id } = req.cmd
                    && self.gpu.is_compute_context(ctx_id)
                {
                    self.compute.destroy(ctx_id);
                }
                let response = self.gpu.execute(&mut req, &**mem, renderer);
                (req.hdr, response)
            }
            Err((hdr, e)) => {
                debug!("control request refused: {e}");
                (hdr.unwrap_or_default(), Response::Err(e.response_code()))
            }
        };
        if matches!(response, Response::Err(_)) {
            inc(&self.metrics.ctrl_errors);
        }
        let presented = self.gpu.frames_flushed().saturating_sub(frames_before);
        add(&self.metrics.frames_flushed, presented);
        if presented > 0
            && flushed_3d
            && let Some(token) = self.present_frame()
        {
            wait = Some(FenceWait::Present(token));
        }
        self.note_memory();
        let bytes = response.encode(&hdr);
        if (bytes.len() as u64) > chain.response_capacity() {
            debug!(
                "response of {} bytes clipped to {} writable",
                bytes.len(),
                chain.response_capacity()
            );
        }
        let len = chain.write_response(&**mem, &bytes).unwrap_or_else(|e| {
            error!("writing response: {e}");
            0
        });
        let held = matches!(wait, Some(FenceWait::Present(_))) || hdr.fenced();
        let wait = wait.unwrap_or(FenceWait::Renderer(hdr.ctx_id));
        (len, held.then_some((hdr.fence_id, wait)))
    }

    /// A flush of a 3D (virgl) resource reached a scanout: with a scheduler daemon connected,
    /// it is one presented frame of the guest's GL output (`Frame`), and its completion waits
    /// for the daemon's `Present` (the token returned). 2D flushes (the console's dumb buffers)
    /// are not frames.
    /// `None`: complete it as usual (unscheduled, or [`crate::sched_client::MAX_PENDING_FRAMES`]
    /// frames already wait).
    fn present_frame(&mut self) -> Option<LoadToken> {
        if !self.sched.connected() {
            return None;
        }
        let token = self.load.token();
        self.sched.present_frame(token).then_some(token)
    }

    /// A SUBMIT_3D on a load context: decoded whole, then its groups queued on the local
    /// engine. Returns the submit's token (`None`: no group to wait for).
    fn load_submit(
        &mut self,
        hdr: &CtrlHeader,
        dwords: &[u32],
    ) -> Result<Option<LoadToken>, load::LoadError> {
        let commands = load::decode_submit(dwords).inspect_err(|e| {
            debug!("load submit on context {} refused: {e}", hdr.ctx_id);
        })?;
        if self.sched.connected() {
            let token = self.load.token();
            self.sched.submit_load(token, hdr.ctx_id, &commands)?;
            return Ok(Some(token));
        }
        let now = self.now();
        self.load.submit(hdr.ctx_id, &commands, now)
    }

    /// A SUBMIT_3D on a compute context: its request (`gated`: as the gate read it) goes to the
    /// executor (its reply comes through [`Device::compute_done`]), or is answered into its
    /// blob at once when it cannot run. Returns the submit's response and the token its fence
    /// waits for.
    fn compute_submit(
        &mut self,
        ctx: u32,
        dwords: &[u32],
        mem: &GuestMemoryMmap,
        group: Option<GroupId>,
        gated: Option<compute::Submit>,
    ) -> (Response, Option<LoadToken>) {
        let session = self.sched.session();
        let now = monotonic_ns();
        // What the gate read for this chain (its header is the same words), else read now.
        let read = match gated {
            Some((header, req, charge)) if compute::decode_header(dwords) == Ok(header) => {
                Ok((header, req, charge))
            }
            _ => self.gpu.blobs().request(dwords, mem, self.gpu.budget()),
        };
        let (header, reply) = match read {
            Ok((header, req, charge)) => {
                let target = (header.resource_id, header.reply_capacity);
                match self.compute_post(ctx, req, charge, target, group) {
                    Ok(token) => return (Response::OkNoData, Some(token)),
                    Err(reply) => (header, reply),
                }
            }
            Err(compute::Refused::Submit(code)) => {
                if let Some(g) = group {
                    self.sched.completed(g, session, now, now);
                }
                return (Response::Err(code), None);
            }
            Err(compute::Refused::Request(header, reply)) => (header, reply),
        };
        if let Some(g) = group {
            self.sched.completed(g, session, now, now);
        }
        let bytes = compute::fitted(&reply, header.reply_capacity);
        if let Err(e) = self.gpu.blobs().write(mem, header.resource_id, &bytes) {
            // Not OK with nothing written: the submit fails (its blob left guest RAM since
            // the gate read it).
            guest_fault!("compute reply: {e}");
            return (Response::Err(e.response_code()), None);
        }
        (Response::OkNoData, None)
    }

    /// Posts compute request `req` of guest context `ctx` (its reply to `target`, a blob and
    /// its room) to the executor; a scheduled one (`group`) runs sliced, each slice a group.
    /// `charge` holds the request's bytes until it has run. Returns the token its completion
    /// comes with, or the reply when it cannot run.
    fn compute_post(
        &mut self,
        ctx: u32,
        req: Request,
        charge: Charge,
        target: (u32, u32),
        group: Option<GroupId>,
    ) -> Result<LoadToken, Reply> {
        let (session, start) = (self.sched.session(), monotonic_ns());
        let token = self.load.token();
        let signature = compute::signature(&req.work());
        self.compute
            .post(ctx, req, charge, token, target, group.map(|g| (g, session)))?;
        if let Some(group) = group {
            let ran = Ran {
                group,
                session,
                start,
            };
            self.sliced = Some(SlicedCompute {
                token,
                ctx,
                signature,
                slice: Slice::Running(Some(ran)),
            });
        }
        Ok(token)
    }

    fn cursor_request(&mut self, chain: &CheckedChain) -> u32 {
        inc(&self.metrics.cursor_requests);
        match protocol::decode_cursor(chain.request()) {
            Ok(cmd) => self.gpu.execute_cursor(&cmd),
            Err(e) => debug!("cursor request refused: {e}"),
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtio_bar_decoding() {
        assert_eq!(decode_virtio_bar(0x14, 1), Some(VirtioRegion::Common(0x14)));
        assert_eq!(
            decode_virtio_bar(0x36, 4),
            None,
            "straddles the end of common cfg"
        );
        assert_eq!(decode_virtio_bar(0x100, 4), None, "hole");
        assert_eq!(decode_virtio_bar(0x1000, 1), Some(VirtioRegion::Isr));
        assert_eq!(decode_virtio_bar(0x1000, 4), None);
        assert_eq!(decode_virtio_bar(0x2008, 4), Some(VirtioRegion::Device(8)));
        assert_eq!(decode_virtio_bar(0x2006, 4), None, "unaligned");
        assert_eq!(decode_virtio_bar(0x3000, 2), Some(VirtioRegion::Notify(0)));
        assert_eq!(decode_virtio_bar(0x3004, 2), Some(VirtioRegion::Notify(1)));
        assert_eq!(decode_virtio_bar(0x3002, 2), None);
        assert_eq!(decode_virtio_bar(0x3008, 2), None, "past the last queue");
        assert_eq!(decode_virtio_bar(u64::MAX, 8), None);
    }

    #[test]
    fn violations_set_needs_reset_and_reset_clears_it() {
        let metrics = Arc::new(DeviceMetrics::default());
        let mut dev = Device::new(DisplayConfig::default(), metrics.clone(), false);
        dev.virtio_write(VirtioRegion::Common(0x14), &[1, 2]);
        assert_ne!(
            dev.status() & crate::virtio_pci::status::DEVICE_NEEDS_RESET,
            0
        );
        assert_eq!(crate::metrics::get(&metrics.transport_faults), 1);
        dev.virtio_write(VirtioRegion::Common(0x14), &[0]);
        assert_eq!(dev.status(), 0);
    }

    use crate::virtio_pci::{VIRTIO_F_VERSION_1, status};
    use virtio_queue::desc::split::Descriptor;
    use vm_memory::Bytes;

    /// Guest-physical layout of [`live_device`]: the control queue's rings, then room for
    /// request and response buffers.
    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const QUEUE_SIZE: u16 = 256;
    const GUEST_BYTES: u64 = 8 << 20;
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const F_INDIRECT: u16 = 4;

    /// A device at DRIVER_OK with 8 MiB of guest RAM from a real file and its control queue
    /// enabled at [`DESC`]/[`AVAIL`]/[`USED`]: the guest driver's side of negotiation.
    fn live_device() -> (Device, Arc<DeviceMetrics>) {
        let metrics = Arc::new(DeviceMetrics::default());
        let mut dev = Device::new(DisplayConfig::default(), metrics.clone(), false);
        let file = vmm_sys_util::tempfile::TempFile::new().unwrap().into_file();
        file.set_len(GUEST_BYTES).unwrap();
        dev.dma_map(0, GUEST_BYTES, Some(file), 0, true).unwrap();
        let mut w = |off: u64, data: &[u8]| dev.virtio_write(VirtioRegion::Common(off), data);
        w(0x14, &[status::ACKNOWLEDGE | status::DRIVER]);
        w(0x08, &1u32.to_le_bytes());
        w(0x0c, &((VIRTIO_F_VERSION_1 >> 32) as u32).to_le_bytes());
        w(
            0x14,
            &[status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK],
        );
        w(0x16, &CONTROL_QUEUE.to_le_bytes());
        w(0x18, &QUEUE_SIZE.to_le_bytes());
        w(0x20, &DESC.to_le_bytes());
        w(0x28, &AVAIL.to_le_bytes());
        w(0x30, &USED.to_le_bytes());
        w(0x1c, &1u16.to_le_bytes());
        w(
            0x14,
            &[status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK],
        );
        assert_eq!(dev.status() & status::DRIVER_OK, status::DRIVER_OK);
        (dev, metrics)
    }

    fn guest(dev: &Device) -> Arc<GuestMemoryMmap> {
        dev.ram.atomic().memory().into_inner()
    }

    /// Stores descriptor `i` of the control queue.
    fn put_desc(mem: &GuestMemoryMmap, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = Descriptor::new(addr, len, flags, next);
        mem.write_obj(d, GuestAddress(DESC + u64::from(i) * 16))
            .unwrap();
    }

    /// Makes `heads` available, in order, after `already` earlier ones.
    fn publish(mem: &GuestMemoryMmap, already: u16, heads: &[u16]) {
        for (n, &head) in heads.iter().enumerate() {
            let slot = (usize::from(already) + n) % usize::from(QUEUE_SIZE);
            mem.write_obj(head, GuestAddress(AVAIL + 4 + 2 * slot as u64))
                .unwrap();
        }
        let idx = already.wrapping_add(heads.len() as u16);
        mem.write_obj(idx, GuestAddress(AVAIL + 2)).unwrap();
    }

    fn used_idx(mem: &GuestMemoryMmap) -> u16 {
        mem.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    /// A GET_DISPLAY_INFO header at `addr`.
    fn display_info_request(mem: &GuestMemoryMmap, addr: u64) {
        let ty = crate::gpu::protocol::ty::GET_DISPLAY_INFO;
        mem.write_slice(&ty.to_le_bytes(), GuestAddress(addr))
            .unwrap();
    }

    /// A SUBMIT_3D whose command stream fills a `len`-byte request at `addr`: a request the
    /// device copies whole.
    fn whole_submit_request(mem: &GuestMemoryMmap, addr: u64, len: u32) {
        let ty = crate::gpu::protocol::ty::SUBMIT_3D;
        mem.write_slice(&ty.to_le_bytes(), GuestAddress(addr))
            .unwrap();
        let stream = len - crate::gpu::protocol::SUBMIT_3D_SIZE as u32;
        mem.write_slice(&stream.to_le_bytes(), GuestAddress(addr + 24))
            .unwrap();
    }

    #[test]
    fn a_kick_processes_a_bounded_budget_one_chain_at_a_time() {
        let (mut dev, metrics) = live_device();
        let mem = guest(&dev);
        // 256 chains, each one device-readable descriptor naming the same 1 MiB request.
        let buf = 0x10_0000;
        whole_submit_request(&mem, buf, crate::queue::MAX_REQUEST_BYTES as u32);
        for i in 0..QUEUE_SIZE {
            put_desc(&mem, i, buf, crate::queue::MAX_REQUEST_BYTES as u32, 0, 0);
        }
        publish(&mem, 0, &(0..QUEUE_SIZE).collect::<Vec<_>>());
        crate::queue::held::reset_peak();
        let per_turn = (MAX_BYTES_PER_KICK / crate::queue::MAX_REQUEST_BYTES) as u16;
        let mut turns = 0;
        let mut done = 0u16;
        loop {
            turns += 1;
            let more = dev.process_queue(CONTROL_QUEUE, None);
            let now = used_idx(&mem);
            assert!(
                now - done <= per_turn,
                "turn {turns}: {} chains",
                now - done
            );
            done = now;
            if !more {
                break;
            }
        }
        assert_eq!(done, QUEUE_SIZE, "every chain completed");
        assert_eq!(turns, usize::from(QUEUE_SIZE / per_turn));
        assert_eq!(
            crate::metrics::get(&metrics.kicks_deferred),
            u64::from(QUEUE_SIZE / per_turn - 1)
        );
        assert_eq!(
            crate::queue::held::peak(),
            crate::queue::MAX_REQUEST_BYTES,
            "one request copy held at a time"
        );
        assert!(dev.transport.is_live());
    }

    #[test]
    fn a_request_is_copied_only_as_far_as_its_command_reaches() {
        let (mut dev, _metrics) = live_device();
        let mem = guest(&dev);
        // GET_DISPLAY_INFO padded to 1 MiB, 256 times: a fixed-size command, so only the
        // largest fixed command's bytes of each are copied.
        let buf = 0x10_0000;
        display_info_request(&mem, buf);
        put_desc(&mem, 0, buf, crate::queue::MAX_REQUEST_BYTES as u32, 0, 0);
        crate::queue::held::reset_peak();
        publish(&mem, 0, &[0]);
        assert!(!dev.process_queue(CONTROL_QUEUE, None));
        assert_eq!(used_idx(&mem), 1);
        assert_eq!(
            crate::queue::held::peak(),
            crate::gpu::protocol::control_copy_bound(crate::gpu::protocol::ty::GET_DISPLAY_INFO)
        );
        assert!(crate::queue::held::peak() < 128);
    }

    #[test]
    fn small_chains_stop_at_the_chain_budget_and_resume() {
        let (mut dev, _metrics) = live_device();
        let mem = guest(&dev);
        for i in 0..QUEUE_SIZE {
            let req = 0x10_0000 + u64::from(i) * 64;
            display_info_request(&mem, req);
            put_desc(&mem, i, req, 24, 0, 0);
        }
        publish(&mem, 0, &(0..QUEUE_SIZE).collect::<Vec<_>>());
        assert!(dev.process_queue(CONTROL_QUEUE, None), "more remain");
        assert_eq!(u32::from(used_idx(&mem)), MAX_CHAINS_PER_KICK);
        while dev.process_queue(CONTROL_QUEUE, None) {}
        assert_eq!(used_idx(&mem), QUEUE_SIZE);
        assert!(!dev.process_queue(CONTROL_QUEUE, None), "nothing left");
    }

    #[test]
    fn an_indirect_chain_needs_reset_and_costs_one_chain() {
        let (mut dev, metrics) = live_device();
        let mem = guest(&dev);
        // A full 65535-entry indirect table of valid requests, named by 256 heads.
        let table = 0x10_0000u64;
        display_info_request(&mem, 0x8000);
        for i in 0..0xffffu64 {
            let d = Descriptor::new(0x8000, 24, 0, 0);
            mem.write_obj(d, GuestAddress(table + i * 16)).unwrap();
        }
        for i in 0..QUEUE_SIZE {
            put_desc(&mem, i, table, 0xffff * 16, F_INDIRECT, 0);
        }
        publish(&mem, 0, &(0..QUEUE_SIZE).collect::<Vec<_>>());
        crate::queue::held::reset_peak();
        assert!(!dev.process_queue(CONTROL_QUEUE, None));
        assert_ne!(dev.status() & status::DEVICE_NEEDS_RESET, 0);
        assert_eq!(crate::metrics::get(&metrics.transport_faults), 1);
        assert_eq!(
            crate::metrics::get(&metrics.ctrl_requests),
            0,
            "nothing executed"
        );
        assert_eq!(used_idx(&mem), 0);
        assert_eq!(crate::queue::held::peak(), 0, "nothing copied");
        assert!(
            !dev.process_queue(CONTROL_QUEUE, None),
            "ignored until reset"
        );
    }

    #[test]
    fn chains_before_a_bad_one_complete() {
        let (mut dev, _metrics) = live_device();
        let mem = guest(&dev);
        display_info_request(&mem, 0x8000);
        put_desc(&mem, 0, 0x8000, 24, F_NEXT, 1);
        put_desc(&mem, 1, 0x9000, 64, F_WRITE, 0);
        put_desc(&mem, 2, 0x8000, 24, F_NEXT, 3);
        put_desc(&mem, 3, 0x9000, 64, F_WRITE | F_INDIRECT, 0);
        publish(&mem, 0, &[0, 2]);
        assert!(!dev.process_queue(CONTROL_QUEUE, None));
        assert_eq!(
            used_idx(&mem),
            1,
            "the good chain completed before the fault"
        );
        let mut ty = [0u8; 4];
        mem.read_slice(&mut ty, GuestAddress(0x9000)).unwrap();
        assert_eq!(
            u32::from_le_bytes(ty),
            crate::gpu::protocol::ty::OK_DISPLAY_INFO
        );
        assert_ne!(dev.status() & status::DEVICE_NEEDS_RESET, 0);
    }

    #[test]
    fn notify_before_driver_ok_is_ignored() {
        let metrics = Arc::new(DeviceMetrics::default());
        let mut dev = Device::new(DisplayConfig::default(), metrics.clone(), false);
        assert!(!dev.process_queue(0, None));
        assert!(!dev.process_queue(7, None));
        assert_eq!(crate::metrics::get(&metrics.notifies_ignored), 2);
    }

    /// Processes what the executor reported until the scheduled compute request is in
    /// `want`'s state (bounded wait).
    fn wait_slice(dev: &mut Device, want: impl Fn(&Slice) -> bool) {
        let start = Instant::now();
        while !dev.sliced.is_some_and(|s| want(&s.slice)) {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(30),
                "never happened"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
            dev.compute_done();
        }
    }

    /// A device admitted by a daemon, running a spin kernel of guest compute context 1 as a
    /// scheduled compute request whose group (returned) the daemon granted.
    fn scheduled_spin() -> (Device, LoadRunner, GroupId) {
        let (mut dev, _) = live_device();
        dev.sched_configure(FallbackShare::default());
        dev.sched_connected();
        dev.sched_message(Msg::Welcome {
            version: vgpu_schedd::proto::PROTOCOL_VERSION,
            vgpu: vgpu_scheduler::VgpuId(0),
        });
        let mut runner = LoadRunner::default();
        let (_, launch) = compute::tests::spin_launch(&mut dev.compute, &mut runner, 1);
        let sig = compute::signature(&launch.work());
        let now = monotonic_ns();
        assert_eq!(dev.sched.gate(1, GroupKind::Compute, sig, now), Gate::Hold);
        let first = asked(&mut dev).expect("the launch asks the daemon");
        dev.sched_message(Msg::Grant { group: first });
        let now = monotonic_ns();
        let Gate::Run(Some(group)) = dev.sched.gate(1, GroupKind::Compute, sig, now) else {
            panic!("granted")
        };
        let charge = Charge::empty(dev.gpu.budget());
        dev.compute_post(1, launch, charge, (9, 4096), Some(group))
            .unwrap();
        (dev, runner, group)
    }

    /// The compute group the device asked the daemon for since the last look.
    fn asked(dev: &mut Device) -> Option<GroupId> {
        let out = dev.sched_outbox(true).unwrap();
        out.iter().find_map(|m| match m {
            Msg::Submit { group, kind, .. } if *kind == GroupKind::Compute => Some(*group),
            _ => None,
        })
    }

    #[test]
    fn a_reset_while_a_slice_runs_completes_its_group() {
        let (mut dev, mut runner, group) = scheduled_spin();
        dev.function_reset();
        let out = dev.sched_outbox(true).unwrap();
        assert!(
            out.iter()
                .any(|m| matches!(m, Msg::Completed { group: g, .. } if *g == group)),
            "{out:?}"
        );
        let Reply::Id(_) =
            compute::tests::ask(&mut dev.compute, &mut runner, 2, Request::ContextCreate)
        else {
            panic!("the next request is served")
        };
    }

    #[test]
    fn a_context_destroyed_while_its_request_is_paused_cancels_the_continuation() {
        let (mut dev, _, _) = scheduled_spin();
        wait_slice(&mut dev, |s| matches!(s, Slice::Yielded { .. }));
        assert!(!dev.gate_continuation());
        let pending = asked(&mut dev).expect("the continuation asks the daemon");
        // The guest's program is killed: its compute context goes (CTX_DESTROY).
        dev.compute.destroy(1);
        let start = Instant::now();
        while dev.sliced.is_some() {
            assert!(start.elapsed() < std::time::Duration::from_secs(30));
            std::thread::sleep(std::time::Duration::from_millis(1));
            dev.compute_done();
        }
        let out = dev.sched_outbox(true).unwrap();
        assert!(out.contains(&Msg::Cancel { group: pending }), "{out:?}");
    }

    #[test]
    fn a_long_compute_request_runs_as_slices_each_granted_and_a_reset_cancels_the_rest() {
        let (mut dev, mut runner, group) = scheduled_spin();
        let mut groups = vec![group];
        let mut spans = Vec::new();
        for _ in 0..3 {
            // Its slice ends: that group completes, a continuation asks the daemon.
            wait_slice(&mut dev, |s| matches!(s, Slice::Yielded { .. }));
            assert!(!dev.gate_continuation(), "held for its grant");
            let out = dev.sched_outbox(true).unwrap();
            let span = out.iter().find_map(|m| match m {
                Msg::Completed {
                    group,
                    start,
                    finish,
                } if Some(group) == groups.last() => Some(finish - start),
                _ => None,
            });
            spans.push(span.expect("the slice's group completed"));
            let next = out.iter().find_map(|m| match m {
                Msg::Submit { group, kind, .. } if *kind == GroupKind::Compute => Some(*group),
                _ => None,
            });
            let next = next.expect("the continuation asks the daemon");
            // Not granted, it stays paused: no further slice ends.
            std::thread::sleep(std::time::Duration::from_millis(50));
            dev.compute_done();
            assert_eq!(
                dev.sliced.map(|s| s.slice),
                Some(Slice::Yielded { asked: true })
            );
            assert!(dev.sched_outbox(true).unwrap().is_empty());
            dev.sched_message(Msg::Grant { group: next });
            assert!(dev.gate_continuation());
            assert!(
                matches!(dev.sliced.map(|s| s.slice), Some(Slice::Running(Some(r))) if r.group == next)
            );
            groups.push(next);
        }
        println!(
            "slices of a spin kernel ({:?} each): {spans:?} ns",
            compute::SLICE
        );
        for span in &spans {
            assert!(*span < 50 * compute::SLICE.as_nanos() as u64, "{spans:?}");
        }
        // Paused with its continuation asked, a reset cancels that group at the daemon and
        // answers the request: the executor serves the next one.
        wait_slice(&mut dev, |s| matches!(s, Slice::Yielded { .. }));
        assert!(!dev.gate_continuation());
        let out = dev.sched_outbox(true).unwrap();
        let pending = out.iter().find_map(|m| match m {
            Msg::Submit { group, .. } => Some(*group),
            _ => None,
        });
        let pending = pending.expect("the continuation asks the daemon");
        dev.function_reset();
        assert!(dev.sliced.is_none());
        let out = dev.sched_outbox(true).unwrap();
        assert!(out.contains(&Msg::Cancel { group: pending }), "{out:?}");
        let Reply::Id(_) =
            compute::tests::ask(&mut dev.compute, &mut runner, 2, Request::ContextCreate)
        else {
            panic!("the next request is served")
        };
    }
}
