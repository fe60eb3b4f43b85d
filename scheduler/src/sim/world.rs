//! One run: the event loop, the VMs' workloads and the carrying out of decisions.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::cpu::Cpu;
use super::engine::{Engine, Job};
use super::report::{DecisionCounts, Histogram, RunReport, Series, VmReport, VmSeries};
use super::scenario::{RunSpec, RunVm, Scenario, Shape, Wait};
use super::{MAX_EVENTS_PER_INSTANT, MAX_SAMPLES, SimError};
use crate::core::Scheduler;
use crate::model::{
    CommandGroup, CostSignature, Decision, Event, GroupId, GroupKind, NS_PER_MS, NS_PER_SEC,
    NS_PER_US, Nanos, Time, VgpuId,
};

/// Most periodic submissions a VM may have outstanding; beyond it a tick is skipped (the
/// widget drops a frame) instead of queueing without bound.
const MAX_PERIODIC_OUTSTANDING: u32 = 64;

/// A simulation event. Ordered only to sit in the heap; (time, sequence) decides the order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// The engine's running job finishes.
    GpuDone,
    /// A workload's own timer: start, periodic tick, end of a sleep.
    Wake(usize),
    /// The scheduler released the VM's present.
    Present(usize),
    /// A VM's CPU phase may have ended (stale unless the epoch matches).
    CpuDone(usize, u64),
    /// A CPU quantum boundary.
    CpuTick,
    /// Tell the scheduler the VM's CPU state.
    Hint(usize),
    /// The oldest grant on its way reaches the engine.
    Granted,
    /// A scheduler deadline.
    Timer,
    /// End of a time-series interval.
    Sample,
}

/// Where a workload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not started yet.
    Idle,
    /// Issuing work by itself (bomb, periodic).
    Running,
    /// In a CPU phase.
    Cpu,
    /// Waiting for its GPU groups.
    Gpu,
    /// Frame boundary reached, waiting for the scheduler's present.
    AwaitPresent,
    /// Present group on its way.
    Presenting,
    /// Sleeping (Throttle).
    Sleep,
}

/// The VM index an engine job's owner tag stands for: the world tags jobs with the index, so the
/// tag always fits (`usize::MAX`, an index no VM has, otherwise).
fn vm_index(owner: u64) -> usize {
    usize::try_from(owner).unwrap_or(usize::MAX)
}

/// A group the workload submitted that is not on the engine yet.
#[derive(Debug, Clone, Copy)]
struct Pending {
    id: u64,
    cost: Nanos,
    submitted: Time,
}

/// One VM during a run.
#[derive(Debug)]
struct Vm {
    name: String,
    vgpu: VgpuId,
    shape: Shape,
    context: u32,
    start: Time,
    stop: Time,
    jitter: f64,
    rng: ChaCha8Rng,
    next_id: u64,
    pending: VecDeque<Pending>,
    outstanding: u32,
    phase: Phase,
    frame_start: Time,
    last_present: Option<Time>,
    frame_bound: Option<Nanos>,
    hint_queued: bool,
    latency: Histogram,
    frame_time: Histogram,
    frame_latency: Histogram,
    frames: u64,
    over_bound: u64,
    skipped: u64,
    interval_frames: u64,
    interval_gpu: Nanos,
    fps: Vec<f64>,
    gpu: Vec<f64>,
}

impl Vm {
    fn active(&self, now: Time) -> bool {
        now >= self.start && now < self.stop
    }

    fn kind_name(&self) -> &'static str {
        match self.shape {
            Shape::Bomb { .. } => "bomb",
            Shape::Periodic { .. } => "periodic",
            Shape::Frames { .. } => "frames",
            Shape::Throttle { .. } => "throttle",
            Shape::Coupled { .. } => "coupled",
        }
    }

    /// Whether the VM polls (stays runnable) while it waits for its GPU call.
    fn spins(&self) -> bool {
        matches!(
            self.shape,
            Shape::Coupled {
                wait: Wait::Spin,
                ..
            }
        )
    }

    /// `us` microseconds varied by the jitter.
    fn cost(&mut self, us: u64) -> Nanos {
        let base = us.saturating_mul(NS_PER_US);
        if self.jitter <= 0.0 || base == 0 {
            return base;
        }
        let f: f64 = self.rng.random_range(-self.jitter..=self.jitter);
        ((base as f64) * (1.0 + f)).round().max(1.0) as Nanos
    }
}

/// The state of one run.
pub(crate) struct World {
    label: String,
    end: Time,
    sched: Scheduler,
    engine: Engine,
    /// Round trip of an engaged grant (see `Scenario::grant_latency_us`).
    grant_latency: Nanos,
    /// Engaged dispatches on their way to the engine, oldest first. All take the same
    /// `grant_latency`, so they arrive in this order.
    granting: VecDeque<Job>,
    cpu: Cpu,
    writeback: bool,
    quantum: Nanos,
    interval: Nanos,
    vms: Vec<Vm>,
    /// VM index by vGPU index.
    vm_of: Vec<usize>,
    queue: BinaryHeap<Reverse<(Time, u64, Ev)>>,
    seq: u64,
    tick_armed: bool,
    timer_armed: Option<Time>,
    cpu_pushed: Vec<Option<u64>>,
    endings: Vec<(usize, u64, Time)>,
    out: Vec<Decision>,
    events: u64,
    counts: DecisionCounts,
    t_ms: Vec<f64>,
}

impl World {
    /// Builds the run: its VMs with their parameters, the scheduler with the run's policy.
    pub(crate) fn new(sc: &Scenario, run: &RunSpec) -> Result<Self, SimError> {
        let capacity = run.capacity.unwrap_or(sc.capacity);
        let switch = run.context_switch_us.unwrap_or(sc.context_switch_us);
        let grant_latency = run
            .grant_latency_us
            .unwrap_or(sc.grant_latency_us)
            .saturating_mul(NS_PER_US);
        let mut sched = Scheduler::new(run.policy.build(), capacity);
        let mut vms = Vec::new();
        let mut cpu_specs = Vec::new();
        let mut vm_of = Vec::new();
        let mut out = Vec::new();
        let run_vms = sc.run_vms(run);
        if run_vms.len() > super::MAX_VMS {
            return Err(SimError::Invalid {
                field: format!("run.{}", run.label),
                reason: "more than 256 VMs",
            });
        }
        for RunVm {
            name,
            spec,
            params: p,
            cpu_weight: weight,
        } in run_vms
        {
            let frame_bound = match (sc.frame_bound_ms, p.target_fps) {
                (Some(b), _) => Some(b),
                (None, Some(fps)) if fps > 0.0 => Some(1000.0 / fps + sc.frame_tolerance_ms),
                _ => None,
            }
            .map(|ms| (ms * NS_PER_MS as f64) as Nanos);
            let vgpu = sched
                .add_vgpu(0, p, &mut out)
                .map_err(|e| SimError::Sched {
                    run: run.label.clone(),
                    vm: name.clone(),
                    source: e,
                })?;
            let index = vms.len();
            if vm_of.len() <= vgpu.index() {
                vm_of.resize(vgpu.index() + 1, usize::MAX);
            }
            vm_of[vgpu.index()] = index;
            let mut rng = ChaCha8Rng::seed_from_u64(sc.seed);
            rng.set_stream(index as u64);
            let w = &spec.workload;
            let mut shape = w.shape.clone();
            if let (Shape::Coupled { wait, .. }, Some(w)) = (&mut shape, run.wait) {
                *wait = w;
            }
            vms.push(Vm {
                name,
                vgpu,
                shape,
                context: spec.context,
                start: w.start_ms.saturating_mul(NS_PER_MS),
                stop: w.stop_ms.map_or(Time::MAX, |s| s.saturating_mul(NS_PER_MS)),
                jitter: w.jitter,
                rng,
                next_id: 0,
                pending: VecDeque::new(),
                outstanding: 0,
                phase: Phase::Idle,
                frame_start: 0,
                last_present: None,
                frame_bound,
                hint_queued: false,
                latency: Histogram::new(),
                frame_time: Histogram::new(),
                frame_latency: Histogram::new(),
                frames: 0,
                over_bound: 0,
                skipped: 0,
                interval_frames: 0,
                interval_gpu: 0,
                fps: Vec::new(),
                gpu: Vec::new(),
            });
            cpu_specs.push((spec.cpu.vcpus, weight));
        }
        let end = sc.duration_ms.saturating_mul(NS_PER_MS);
        let interval = sc
            .sample_ms
            .saturating_mul(NS_PER_MS)
            .max(end.div_ceil(MAX_SAMPLES));
        let n = vms.len();
        let mut world = World {
            label: run.label.clone(),
            end,
            sched,
            engine: Engine::new(switch.saturating_mul(NS_PER_US)),
            grant_latency,
            granting: VecDeque::new(),
            cpu: Cpu::new(run.cpus.unwrap_or(sc.cpus), &cpu_specs),
            writeback: run.cpu_writeback.unwrap_or(sc.cpu_writeback),
            quantum: sc.cpu_quantum_us.saturating_mul(NS_PER_US),
            interval,
            vms,
            vm_of,
            queue: BinaryHeap::new(),
            seq: 0,
            tick_armed: false,
            timer_armed: None,
            cpu_pushed: vec![None; n],
            endings: Vec::new(),
            out,
            events: 0,
            counts: DecisionCounts::default(),
            t_ms: Vec::new(),
        };
        let decisions = std::mem::take(&mut world.out);
        for d in decisions {
            world.apply(0, d);
        }
        for vm in 0..n {
            let start = world.vms[vm].start;
            world.push(start, Ev::Wake(vm));
            world.queue_hint(vm, 0);
        }
        world.push(interval, Ev::Sample);
        Ok(world)
    }

    fn push(&mut self, at: Time, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, ev)));
    }

    /// Runs to the end and reports.
    pub(crate) fn run(mut self) -> Result<RunReport, SimError> {
        let mut last = 0;
        let mut same = 0u64;
        self.arm_timer(0);
        while let Some(Reverse((now, _, ev))) = self.queue.pop() {
            if now > self.end {
                break;
            }
            if now == last {
                same += 1;
                if same > MAX_EVENTS_PER_INSTANT {
                    return Err(SimError::Stalled {
                        run: self.label.clone(),
                        at: now,
                    });
                }
            } else {
                last = now;
                same = 0;
            }
            self.step(now, ev)?;
            self.arm_timer(now);
        }
        Ok(self.report())
    }

    fn step(&mut self, now: Time, ev: Ev) -> Result<(), SimError> {
        match ev {
            Ev::GpuDone => {
                if let Some((job, start, finish)) = self.engine.finish() {
                    let done = Event::Completed {
                        vgpu: job.vgpu,
                        group: job.group,
                        start,
                        finish,
                    };
                    self.feed(now, vm_index(job.owner), done)?;
                    self.completed(now, job, finish.saturating_sub(start))?;
                }
                self.kick(now);
            }
            Ev::Wake(vm) => self.wake(now, vm)?,
            Ev::Granted => {
                if let Some(job) = self.granting.pop_front() {
                    self.engine.push(job);
                    self.kick(now);
                }
            }
            Ev::Present(vm) => {
                let us = match self.vms[vm].shape {
                    Shape::Frames { present_us, .. } => present_us,
                    _ => 0,
                };
                if self.vms[vm].phase == Phase::AwaitPresent {
                    self.vms[vm].phase = Phase::Presenting;
                    self.submit(now, vm, GroupKind::Present, us)?;
                }
            }
            Ev::CpuDone(vm, epoch) => {
                if self.cpu.phase_ended(vm, epoch, now) {
                    self.cpu_phase_over(now, vm)?;
                }
            }
            Ev::CpuTick => {
                self.tick_armed = false;
                self.cpu.tick(now);
                for vm in 0..self.vms.len() {
                    if self.cpu.hint(vm, now).runnable {
                        self.queue_hint(vm, now);
                    }
                }
                self.cpu_changed(now);
            }
            Ev::Hint(vm) => {
                self.vms[vm].hint_queued = false;
                let hint = self.cpu.hint(vm, now);
                let v = self.vms[vm].vgpu;
                self.feed(now, vm, Event::CpuHint(v, hint))?;
            }
            Ev::Timer => {
                if self.timer_armed == Some(now) {
                    self.timer_armed = None;
                }
                if self.sched.next_deadline().is_some_and(|d| d <= now) {
                    self.feed(now, usize::MAX, Event::Timer)?;
                }
            }
            Ev::Sample => {
                self.t_ms.push(now as f64 / NS_PER_MS as f64);
                let secs = self.interval as f64 / NS_PER_SEC as f64;
                for vm in &mut self.vms {
                    vm.fps.push(vm.interval_frames as f64 / secs);
                    vm.gpu.push(vm.interval_gpu as f64 / self.interval as f64);
                    vm.interval_frames = 0;
                    vm.interval_gpu = 0;
                }
                self.push(now.saturating_add(self.interval), Ev::Sample);
            }
        }
        Ok(())
    }

    /// Hands one event to the scheduler and carries out its decisions. `vm` names the VM the
    /// event is about, for error messages.
    fn feed(&mut self, now: Time, vm: usize, ev: Event) -> Result<(), SimError> {
        self.events += 1;
        let mut out = std::mem::take(&mut self.out);
        out.clear();
        if let Err(e) = self.sched.handle(now, ev, &mut out) {
            return Err(SimError::Sched {
                run: self.label.clone(),
                vm: self
                    .vms
                    .get(vm)
                    .map_or_else(String::new, |v| v.name.clone()),
                source: e,
            });
        }
        for d in out.drain(..) {
            self.apply(now, d);
        }
        self.out = out;
        Ok(())
    }

    fn vm_of(&self, v: VgpuId) -> Option<usize> {
        self.vm_of
            .get(v.index())
            .copied()
            .filter(|&i| i < self.vms.len())
    }

    fn apply(&mut self, now: Time, d: Decision) {
        let c = &mut self.counts;
        match d {
            Decision::Dispatch {
                vgpu,
                group,
                leased,
            } => {
                c.dispatch += 1;
                c.leased += u64::from(leased);
                let Some(vm) = self.vm_of(vgpu) else { return };
                let q = &mut self.vms[vm].pending;
                let pos = match q.front() {
                    Some(p) if p.id == group.0 => Some(0),
                    _ => q.iter().position(|p| p.id == group.0),
                };
                if let Some(p) = pos.and_then(|i| q.remove(i)) {
                    let job = Job {
                        owner: vm as u64,
                        vgpu,
                        group,
                        context: self.vms[vm].context,
                        cost: p.cost,
                        submitted: p.submitted,
                    };
                    // A leased group needs no grant: the device runs it at once.
                    if leased || self.grant_latency == 0 {
                        self.engine.push(job);
                        self.kick(now);
                    } else {
                        self.granting.push_back(job);
                        self.push(now.saturating_add(self.grant_latency), Ev::Granted);
                    }
                }
            }
            Decision::Present { vgpu, at } => {
                c.present += 1;
                if let Some(vm) = self.vm_of(vgpu) {
                    self.push(at.max(now), Ev::Present(vm));
                }
            }
            Decision::CpuWeight { vgpu, weight } => {
                c.cpu_weight += 1;
                if self.writeback
                    && let Some(vm) = self.vm_of(vgpu)
                {
                    self.cpu.set_weight(vm, weight, now);
                    self.queue_hint(vm, now);
                }
            }
            Decision::Lease { .. } => c.lease += 1,
            Decision::Revoke { .. } => c.revoke += 1,
            Decision::Suspend { .. } => c.suspend += 1,
            Decision::Resume { .. } => c.resume += 1,
        }
    }

    fn kick(&mut self, now: Time) {
        if let Some(finish) = self.engine.kick(now) {
            self.push(finish, Ev::GpuDone);
        }
    }

    fn queue_hint(&mut self, vm: usize, now: Time) {
        if let Some(v) = self.vms.get_mut(vm)
            && !v.hint_queued
        {
            v.hint_queued = true;
            self.push(now, Ev::Hint(vm));
        }
    }

    fn arm_timer(&mut self, now: Time) {
        if let Some(d) = self.sched.next_deadline() {
            let d = d.max(now);
            if self.timer_armed.is_none_or(|a| d < a) {
                self.timer_armed = Some(d);
                self.push(d, Ev::Timer);
            }
        }
    }

    /// After the CPU model changed: hints for VMs whose state changed, the quantum tick, and
    /// the phase endings that fall before the next tick.
    fn cpu_changed(&mut self, now: Time) {
        for vm in 0..self.vms.len() {
            if self.cpu.take_changed(vm) {
                self.queue_hint(vm, now);
            }
        }
        let next_tick = (now / self.quantum)
            .saturating_add(1)
            .saturating_mul(self.quantum);
        if self.cpu.busy() && !self.tick_armed {
            self.tick_armed = true;
            self.push(next_tick, Ev::CpuTick);
        }
        let mut endings = std::mem::take(&mut self.endings);
        self.cpu.endings(now, next_tick, &mut endings);
        for &(vm, epoch, at) in &endings {
            if self.cpu_pushed[vm] != Some(epoch) {
                self.cpu_pushed[vm] = Some(epoch);
                self.push(at, Ev::CpuDone(vm, epoch));
            }
        }
        self.endings = endings;
    }

    fn submit(&mut self, now: Time, vm: usize, kind: GroupKind, us: u64) -> Result<(), SimError> {
        let v = &mut self.vms[vm];
        let cost = v.cost(us);
        let id = v.next_id;
        v.next_id += 1;
        v.outstanding += 1;
        v.pending.push_back(Pending {
            id,
            cost,
            submitted: now,
        });
        let code = match kind {
            GroupKind::Render => 1,
            GroupKind::Transfer => 2,
            GroupKind::Compute => 3,
            GroupKind::Load => 4,
            GroupKind::Present => 5,
        };
        let group = CommandGroup {
            id: GroupId(id),
            vgpu: v.vgpu,
            context: v.context,
            kind,
            signature: CostSignature::from_methods(&mut [(
                code,
                us.min(u64::from(u32::MAX)) as u32,
            )]),
        };
        self.feed(now, vm, Event::Submitted(group))
    }

    fn cpu_phase(&mut self, now: Time, vm: usize, us: u64) -> Result<(), SimError> {
        let work = self.vms[vm].cost(us);
        self.vms[vm].phase = Phase::Cpu;
        if work == 0 {
            return self.cpu_phase_over(now, vm);
        }
        self.cpu.start_phase(vm, work, now);
        self.cpu_changed(now);
        Ok(())
    }

    fn begin_frame(&mut self, now: Time, vm: usize) -> Result<(), SimError> {
        if let Shape::Frames { cpu_us, .. } = self.vms[vm].shape {
            self.vms[vm].frame_start = now;
            self.cpu_phase(now, vm, cpu_us)?;
        }
        Ok(())
    }

    /// A workload's own timer.
    fn wake(&mut self, now: Time, vm: usize) -> Result<(), SimError> {
        if !self.vms[vm].active(now) {
            return Ok(());
        }
        let first = self.vms[vm].phase == Phase::Idle;
        match self.vms[vm].shape.clone() {
            Shape::Bomb { cost_us, depth } => {
                self.vms[vm].phase = Phase::Running;
                for _ in 0..depth {
                    self.submit(now, vm, GroupKind::Render, cost_us)?;
                }
            }
            Shape::Periodic { cost_us, period_us } => {
                self.vms[vm].phase = Phase::Running;
                if self.vms[vm].outstanding < MAX_PERIODIC_OUTSTANDING {
                    self.submit(now, vm, GroupKind::Render, cost_us)?;
                } else {
                    self.vms[vm].skipped += 1;
                }
                let next = now.saturating_add(period_us.saturating_mul(NS_PER_US));
                self.push(next, Ev::Wake(vm));
            }
            Shape::Frames { .. } if first => self.begin_frame(now, vm)?,
            Shape::Throttle { kernel_us, .. } => {
                self.vms[vm].phase = Phase::Gpu;
                self.submit(now, vm, GroupKind::Compute, kernel_us)?;
            }
            Shape::Coupled { cpu_us, .. } if first => self.cpu_phase(now, vm, cpu_us)?,
            Shape::Frames { .. } | Shape::Coupled { .. } => {}
        }
        Ok(())
    }

    /// The VM's CPU phase is over: it submits its GPU work and sleeps or (a spinning coupled
    /// loop) keeps its vCPU busy polling.
    fn cpu_phase_over(&mut self, now: Time, vm: usize) -> Result<(), SimError> {
        let active = self.vms[vm].active(now);
        if active && self.vms[vm].spins() {
            self.cpu.spin(vm, now);
        } else {
            self.cpu.stop(vm, now);
        }
        self.cpu_changed(now);
        if !active {
            self.vms[vm].phase = Phase::Idle;
            return Ok(());
        }
        self.vms[vm].phase = Phase::Gpu;
        match self.vms[vm].shape {
            Shape::Frames {
                groups, cost_us, ..
            } => {
                if groups == 0 {
                    return self.frame_boundary(now, vm);
                }
                for _ in 0..groups {
                    self.submit(now, vm, GroupKind::Render, cost_us)?;
                }
            }
            Shape::Coupled { cost_us, .. } => {
                self.submit(now, vm, GroupKind::Compute, cost_us)?;
            }
            _ => {}
        }
        Ok(())
    }

    fn frame_boundary(&mut self, now: Time, vm: usize) -> Result<(), SimError> {
        self.vms[vm].phase = Phase::AwaitPresent;
        let v = self.vms[vm].vgpu;
        self.feed(now, vm, Event::Frame(v))
    }

    /// A group of the VM finished on the engine.
    fn completed(&mut self, now: Time, job: Job, cost: Nanos) -> Result<(), SimError> {
        let vm = vm_index(job.owner);
        let active = self.vms[vm].active(now);
        let v = &mut self.vms[vm];
        v.outstanding = v.outstanding.saturating_sub(1);
        v.latency.record(now.saturating_sub(job.submitted));
        v.interval_gpu = v.interval_gpu.saturating_add(cost);
        match v.shape.clone() {
            Shape::Bomb { cost_us, .. } => {
                if active {
                    self.submit(now, vm, GroupKind::Render, cost_us)?;
                }
            }
            Shape::Periodic { .. } => {}
            Shape::Frames { .. } => {
                if v.phase == Phase::Presenting {
                    v.frames += 1;
                    v.interval_frames += 1;
                    if let Some(prev) = v.last_present {
                        let ft = now.saturating_sub(prev);
                        v.frame_time.record(ft);
                        if v.frame_bound.is_some_and(|b| ft > b) {
                            v.over_bound += 1;
                        }
                    }
                    v.last_present = Some(now);
                    v.frame_latency.record(now.saturating_sub(v.frame_start));
                    v.phase = Phase::Idle;
                    if active {
                        self.begin_frame(now, vm)?;
                    }
                } else if v.phase == Phase::Gpu && v.outstanding == 0 {
                    self.frame_boundary(now, vm)?;
                }
            }
            Shape::Throttle {
                kernel_us,
                sleep_us,
            } => {
                if sleep_us == 0 {
                    if active {
                        self.submit(now, vm, GroupKind::Compute, kernel_us)?;
                    }
                } else {
                    v.phase = Phase::Sleep;
                    let at = now.saturating_add(sleep_us.saturating_mul(NS_PER_US));
                    self.push(at, Ev::Wake(vm));
                }
            }
            Shape::Coupled { cpu_us, .. } => {
                if active {
                    self.cpu_phase(now, vm, cpu_us)?;
                } else {
                    v.phase = Phase::Idle;
                    // A spinning loop stops polling.
                    self.cpu.stop(vm, now);
                    self.cpu_changed(now);
                }
            }
        }
        Ok(())
    }

    fn report(&self) -> RunReport {
        let end = self.end;
        let secs = end as f64 / NS_PER_SEC as f64;
        let accounts: Vec<_> = self
            .vms
            .iter()
            .map(|v| {
                self.sched
                    .vgpu(v.vgpu)
                    .map(|s| s.account().clone())
                    .unwrap_or_default()
            })
            .collect();
        let total: Nanos = accounts
            .iter()
            .map(|a| a.gpu_time)
            .fold(0, Nanos::saturating_add);
        let ms = |ns: Nanos| ns as f64 / NS_PER_MS as f64;
        let vms = self
            .vms
            .iter()
            .zip(&accounts)
            .enumerate()
            .map(|(i, (v, a))| {
                let frames_wl = matches!(v.shape, Shape::Frames { .. });
                let timed = v.frame_time.count();
                VmReport {
                    name: v.name.clone(),
                    workload: v.kind_name(),
                    gpu_time_ns: a.gpu_time,
                    gpu_share: if total == 0 {
                        0.0
                    } else {
                        a.gpu_time as f64 / total as f64
                    },
                    gpu_util: a.gpu_time as f64 / end as f64,
                    groups: a.completed,
                    latency_p50_us: v.latency.quantile(0.5) as f64 / NS_PER_US as f64,
                    latency_p99_us: v.latency.quantile(0.99) as f64 / NS_PER_US as f64,
                    frames: v.frames,
                    fps: v.frames as f64 / secs,
                    frame_time_p50_ms: ms(v.frame_time.quantile(0.5)),
                    frame_time_p99_ms: ms(v.frame_time.quantile(0.99)),
                    frame_latency_p50_ms: ms(v.frame_latency.quantile(0.5)),
                    frames_over_bound_pct: if timed == 0 {
                        0.0
                    } else {
                        100.0 * v.over_bound as f64 / timed as f64
                    },
                    frame_bound_ms: v.frame_bound.map(ms),
                    work_per_sec: if frames_wl {
                        v.frames as f64 / secs
                    } else {
                        a.completed as f64 / secs
                    },
                    cpu_time_ns: self.cpu.usage(i, end),
                    skipped: v.skipped,
                    figures: self
                        .sched
                        .figures(v.vgpu)
                        .into_iter()
                        .map(|(k, x)| (k.to_owned(), x))
                        .collect(),
                }
            })
            .collect();
        let c = &self.counts;
        RunReport {
            label: self.label.clone(),
            policy: self.sched.policy_name(),
            duration_ms: end / NS_PER_MS,
            gpu_busy_pct: 100.0 * self.engine.busy_until(end).min(end) as f64 / end as f64,
            context_switches: self.engine.switches,
            sched_events: self.events,
            decisions: c.dispatch
                + c.lease
                + c.revoke
                + c.suspend
                + c.resume
                + c.present
                + c.cpu_weight,
            decision_counts: c.clone(),
            vms,
            series: Series {
                interval_ms: ms(self.interval),
                t_ms: self.t_ms.clone(),
                vms: self
                    .vms
                    .iter()
                    .map(|v| VmSeries {
                        name: v.name.clone(),
                        fps: v.fps.clone(),
                        gpu_share: v.gpu.clone(),
                    })
                    .collect(),
            },
        }
    }
}
