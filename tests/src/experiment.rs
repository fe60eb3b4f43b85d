//! The papers' experiments on real guests: a simulator scenario (`scheduler/scenarios/*.toml`)
//! run with a real `vgpu-schedd`, one `vgpu-server` and one QEMU per VM: a TCG guest in a CPU
//! cgroup of its own with the scenario's CPU weight, its workload run by `vgpu-load`
//! ([`Guests::Vms`]), or a qtest guest whose load requests a host thread issues through the
//! harness's virtio-gpu driver ([`Guests::Qtest`], for many VMs). The groups run on the
//! daemon's simulated engine, as in the demo. `vgpu-bench` is the command; this module maps a
//! scenario onto guests ([`guest_command`]), runs it ([`run_on_vms`]) and compares the result
//! with the simulator's ([`side_by_side`], [`svg`]).
//!
//! Per run: the daemon starts with the run's policy, every VM's parameters are set with
//! `vgpuctl set` before it boots, the guests boot side by side; once every VM has completed
//! work the daemon's counters are read, again after the measuring window, and the guests and
//! the daemon are stopped. GPU shares, frame and group rates come from the counters' growth
//! over the window; latencies are the daemon's (submit to finish, since the VM connected).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;
use vgpu_scheduler::model::{Enforcement, PrioPolicy, VgpuParams};
use vgpu_scheduler::sim::{RunReport, RunSpec, RunVm, Scenario, Shape, Workload};

use vgpu_schedd::cgroup::parse_schedstat;

use crate::daemon::{Schedd, find_vm};
use crate::guest::{GuestImage, RunningGuest};
use crate::load_vm::{self, LoadVm};

/// Why a scenario cannot run on guests, or a run failed.
#[derive(Debug, thiserror::Error)]
pub enum ExperimentError {
    /// A workload with no guest program.
    #[error("VM {vm}: {why}")]
    Unmapped { vm: String, why: String },
    /// A run's VMs did not all start their workloads in time.
    #[error("run {run}: {why}")]
    Boot { run: String, why: String },
    /// The daemon or a guest failed.
    #[error("run {run}: {why}")]
    Harness { run: String, why: String },
    /// No run matches the selection.
    #[error("no run of {scenario} is selected ({why})")]
    NoRuns { scenario: String, why: String },
}

/// Seconds added to a guest workload's longest run beyond the window (a scenario's own
/// `guest` command takes it as `{duration_s}`): the warm-up; the host stops every workload
/// once the window is over.
const WORKLOAD_SLACK_S: u64 = 300;
/// Work every VM must have completed before the window opens (its workload is running).
const WARM_GROUPS: u64 = 4;
/// The name of a guest's workload on its control channel.
const WORKLOAD_JOB: &str = "workload";
/// Longest wait for the agent to start a workload.
const WORKLOAD_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a stopped workload to end and report: the agent's 15 s grace before
/// SIGTERM, 5 s more before SIGKILL, and a slow TCG guest's reply.
const WORKLOAD_STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for the agent's BYE (the guest is killed anyway after it).
const AGENT_QUIT_TIMEOUT: Duration = Duration::from_secs(10);
/// Poll interval of the daemon's counters through a measuring window (each poll is a
/// `vgpuctl show`: a process on the host the VMs share): four looks per [`ACTIVE_SLICE`].
const WINDOW_POLL: Duration = Duration::from_millis(500);
/// Poll interval of the daemon's counters while the VMs boot.
const POLL: Duration = Duration::from_millis(250);
/// Most VMs of one run on guests: TCG guests on a small host (the scenario's `instances` can
/// ask for more; `--on qtest` is the way to scale).
pub const MAX_GUESTS: usize = 8;

/// The guest's shell command for a VM, started through the control channel once every VM of
/// the run has booted: its `guest` command when the scenario names one (with `{duration_s}`
/// filled in: the longest it may run; the host stops it earlier), else `vgpu-load` in the
/// mode of its workload's shape, until the host stops it (for the workload's own span when it
/// has a `stop_ms`), printing its JSON summary line prefixed with `SUMMARY ` (the agent
/// forwards it to the host). Cost jitter is not reproduced (vgpu-load's costs are exact);
/// `start_ms` becomes a sleep before it.
pub fn guest_command(vm: &RunVm, duration_s: u64) -> Result<String, ExperimentError> {
    let unmapped = |why: &str| ExperimentError::Unmapped {
        vm: vm.name.clone(),
        why: why.to_owned(),
    };
    if let Some(command) = &vm.spec.guest {
        return Ok(command.replace("{duration_s}", &duration_s.to_string()));
    }
    let w = &vm.spec.workload;
    let mode = match &w.shape {
        Shape::Bomb { cost_us, depth } => format!("bomb --cost-us {cost_us} --depth {depth}"),
        Shape::Periodic { cost_us, period_us } => {
            format!("periodic --cost-us {cost_us} --period-us {period_us}")
        }
        Shape::Frames {
            cpu_us,
            groups,
            cost_us,
            ..
        } => {
            let mut m = format!("frames --groups {groups} --cost-us {cost_us} --cpu-us {cpu_us}");
            if let Some(fps) = vm.params.target_fps {
                m.push_str(&format!(" --fps-target {}", fps.round().max(1.0)));
            }
            m
        }
        Shape::Throttle {
            kernel_us,
            sleep_us,
        } => format!("throttle --kernel-us {kernel_us} --sleep-us {sleep_us}"),
        Shape::Coupled { .. } => {
            return Err(unmapped(
                "coupled (CPU then blocking GPU call) workloads have no guest program yet",
            ));
        }
    };
    let until = match w.stop_ms {
        Some(stop) => format!(
            "--duration-s {}",
            duration_s.min(stop.saturating_sub(w.start_ms).div_ceil(1000).max(1))
        ),
        None => "--until-stopped".to_owned(),
    };
    let start = if w.start_ms > 0 {
        format!("sleep {}.{:03}\n", w.start_ms / 1000, w.start_ms % 1000)
    } else {
        String::new()
    };
    Ok(format!(
        "{start}vgpu-load {mode} {until} --json | grep '\"summary\"' | sed 's/^/SUMMARY /'"
    ))
}

/// `vgpuctl set` arguments for the parameters a VM has beyond the defaults. A Shared reserve
/// comes from the policy's spec lines instead (`set` has no key for it).
pub fn set_arguments(p: &VgpuParams) -> Vec<String> {
    let d = VgpuParams::named(&p.name);
    let mut kv = Vec::new();
    if p.priority != d.priority {
        kv.push(format!("priority={}", p.priority));
    }
    if p.weight != d.weight {
        kv.push(format!("weight={}", p.weight));
    }
    if let Some(s) = p.sched {
        kv.push(format!(
            "sched={}",
            if s == PrioPolicy::Ht { "ht" } else { "prt" }
        ));
    }
    if let Some(fps) = p.target_fps {
        kv.push(format!("target_fps={fps}"));
    }
    if let Some(slo) = p.slo {
        kv.push(format!("slo={}", slo / 1000));
    }
    if let Some(r) = p.reserve.as_ref().filter(|r| r.shared.is_none()) {
        let e = if r.enforcement == Enforcement::Ae {
            "ae"
        } else {
            "pe"
        };
        kv.push(format!("reserve={}/{}/{e}", r.c / 1000, r.t / 1000));
    }
    kv
}

/// One VM's result on guests.
#[derive(Debug, Clone, Serialize)]
pub struct VmResult {
    pub name: String,
    /// Of all the run's VMs' GPU time in the window.
    pub gpu_share: f64,
    /// Of the window.
    pub gpu_util: f64,
    /// Groups completed per second in the window.
    pub groups_per_sec: f64,
    /// Frames per second in the window.
    pub fps: f64,
    /// Frames per second for frame workloads, groups per second otherwise (the simulator's
    /// `work_per_sec`).
    pub work_per_sec: f64,
    /// The daemon's submit-to-finish latency since the VM connected.
    pub latency_p50_us: u64,
    pub latency_p99_us: u64,
    /// The policy's figures for the VM at the window's end.
    pub figures: Value,
    /// What the guest's workload measured itself (its summary, through the control channel;
    /// `None` for qtest guests and workloads that print none).
    pub guest: Option<Value>,
    /// The share of the CPU time the VM's processes wanted in the window that they spent
    /// waiting for a CPU (`None` for qtest guests).
    pub cpu_wait: Option<f64>,
}

/// One run's result on guests.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub label: String,
    pub policy: String,
    /// Measured window, seconds.
    pub window_s: f64,
    /// Seconds from the daemon's start to the window's opening (the VMs' boots).
    pub boot_s: f64,
    pub vms: Vec<VmResult>,
    /// Why the run's figures cannot be compared with another run's ([`Window::failures`]:
    /// a VM absent or idle in the window); empty when every precondition held.
    pub precondition_failures: Vec<String>,
}

/// Which guests a run boots.
#[derive(Debug, Clone)]
pub enum Guests {
    /// Real guests booting this image under TCG (or KVM), running `vgpu-load`.
    Vms(GuestImage),
    /// qtest guests (no guest OS) whose load requests the harness's virtio-gpu driver issues
    /// from a host thread per VM: for many VMs (LoGA's 20 tenants), and for the `coupled`
    /// workload that has no guest program. No CPU weights (no vCPU runs guest code).
    Qtest,
}

/// How a run is to be measured.
#[derive(Debug, Clone)]
pub struct VmRunConfig {
    pub guests: Guests,
    pub window: Duration,
    pub boot_timeout: Duration,
}

/// Most qtest guests of one run (each is a QEMU and a device process).
pub const MAX_QTEST_GUESTS: usize = 64;

/// What runs the VMs of a run: booted guests, or qtest guests with their driver threads.
enum Running {
    Vms(Vec<RunningGuest>),
    Qtest {
        stop: Arc<AtomicBool>,
        threads: Vec<(String, JoinHandle<()>)>,
    },
}

impl Running {
    /// `Err` with what happened when a VM's workload ended before the window closed.
    fn check(&mut self) -> Result<(), String> {
        match self {
            Running::Vms(guests) => {
                for g in guests {
                    if let Some(serial) = g.exited().map_err(|e| e.to_string())? {
                        return Err(format!("a guest ended early:\n{serial}"));
                    }
                    let report = g.control().and_then(|ch| ch.report(WORKLOAD_JOB));
                    if let Some(code) = report.and_then(|r| r.exit) {
                        return Err(format!("a guest's workload ended early (exit {code})"));
                    }
                }
            }
            Running::Qtest { threads, .. } => {
                if let Some((name, _)) = threads.iter().find(|(_, t)| t.is_finished()) {
                    return Err(format!("{name}'s load driver ended early"));
                }
            }
        }
        Ok(())
    }

    /// Each booted guest's processes: its QEMU and its device process (none for qtest guests,
    /// whose QEMU runs no guest code).
    fn pids(&self) -> Vec<Vec<u32>> {
        match self {
            Running::Vms(guests) => guests.iter().map(RunningGuest::pids).collect(),
            Running::Qtest { .. } => Vec::new(),
        }
    }

    /// Stops everything: stops the guests' workloads (collecting each one's summary, in
    /// the VMs' order) and kills the guests, or ends the drivers (their requests drain) and
    /// reports one that failed.
    fn stop(self) -> Result<Vec<Option<Value>>, String> {
        match self {
            Running::Vms(mut guests) => {
                for g in &mut guests {
                    if let Some(ch) = g.control() {
                        let _ = ch.stop(WORKLOAD_JOB);
                    }
                }
                let mut summaries = Vec::new();
                let mut failed = None;
                for g in &mut guests {
                    let report = g
                        .control()
                        .ok_or_else(|| "no control channel".to_owned())
                        .and_then(|ch| {
                            ch.wait_exit(WORKLOAD_JOB, WORKLOAD_STOP_TIMEOUT)
                                .map_err(|e| e.to_string())
                        });
                    let summary = report.as_ref().ok().and_then(|r| {
                        r.summaries
                            .last()
                            .and_then(|text| serde_json::from_str::<Value>(text).ok())
                    });
                    if let Err(e) = report {
                        failed.get_or_insert(format!("stopping a workload: {e}"));
                    }
                    summaries.push(summary);
                    if let Some(ch) = g.control() {
                        let _ = ch.quit(AGENT_QUIT_TIMEOUT);
                    }
                    let _ = g.kill();
                }
                failed.map_or(Ok(summaries), Err)
            }
            Running::Qtest { stop, threads } => {
                stop.store(true, Ordering::Relaxed);
                let mut failed = None;
                for (name, t) in threads {
                    if let Err(panic) = t.join() {
                        let why = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                            .unwrap_or_default();
                        failed.get_or_insert(format!("{name}'s load driver failed: {why}"));
                    }
                }
                failed.map_or(Ok(Vec::new()), Err)
            }
        }
    }
}

/// Runs one run of `sc` on guests and measures it.
pub fn run_on_vms(
    sc: &Scenario,
    run: &RunSpec,
    policy_toml: &str,
    config: &VmRunConfig,
    mut progress: impl FnMut(&str),
) -> Result<RunResult, ExperimentError> {
    let harness = |why: String| ExperimentError::Harness {
        run: run.label.clone(),
        why,
    };
    let vms = sc.run_vms(run);
    let most = match config.guests {
        Guests::Vms(_) => MAX_GUESTS,
        Guests::Qtest => MAX_QTEST_GUESTS,
    };
    if vms.len() > most {
        return Err(harness(format!(
            "{} VMs; at most {most} per run on these guests (TCG guests: --on qtest to scale)",
            vms.len()
        )));
    }
    let duration_s = config.window.as_secs() + WORKLOAD_SLACK_S;
    let jobs = match config.guests {
        Guests::Vms(_) => vms
            .iter()
            .map(|vm| guest_command(vm, duration_s))
            .collect::<Result<Vec<_>, _>>()?,
        Guests::Qtest => Vec::new(),
    };
    let writeback = run.cpu_writeback.unwrap_or(sc.cpu_writeback);
    let args: &[&str] = if writeback { &["--cpu-writeback"] } else { &[] };
    let started = Instant::now();
    let schedd = Schedd::start_with(Some(policy_toml), "warn", args)
        .map_err(|e| harness(format!("vgpu-schedd: {e}")))?;
    for vm in &vms {
        let kv = set_arguments(&vm.params);
        if kv.is_empty() {
            continue;
        }
        // Before its VM connects: `--add` keeps the parameters for it.
        let mut a = vec!["set", "--add", vm.name.as_str()];
        a.extend(kv.iter().map(String::as_str));
        schedd
            .ctl(&a)
            .map_err(|e| harness(format!("vgpuctl set {}: {e}", vm.name)))?;
    }
    progress(&format!("starting {} VMs", vms.len()));
    let mut running = match &config.guests {
        Guests::Vms(image) => {
            let mut guests = Vec::new();
            for vm in &vms {
                let guest_config = schedd
                    .agent_config(image, &vm.name)
                    .timeout(config.boot_timeout + config.window + Duration::from_secs(180));
                let guest = RunningGuest::launch(&guest_config)
                    .map_err(|e| harness(format!("booting {}: {e}", vm.name)))?;
                if vm.cpu_weight != vgpu_scheduler::sim::CpuSpec::default().weight {
                    set_cpu_weight(&guest, vm.cpu_weight)
                        .map_err(|e| harness(format!("{}: {e}", vm.name)))?;
                }
                guests.push(guest);
            }
            // The workloads start together, once every guest has booted.
            for (vm, guest) in vms.iter().zip(&mut guests) {
                let left = config.boot_timeout.saturating_sub(started.elapsed());
                let Some(ch) = guest.control() else {
                    return Err(harness(format!("{}: no control channel", vm.name)));
                };
                let agent = ch.hello(left).map_err(|e| ExperimentError::Boot {
                    run: run.label.clone(),
                    why: format!("{}: {e}", vm.name),
                })?;
                log::debug!("{}: agent version {agent}", vm.name);
            }
            progress("starting the workloads");
            for ((vm, job), guest) in vms.iter().zip(&jobs).zip(&mut guests) {
                if let Some(ch) = guest.control() {
                    ch.start(WORKLOAD_JOB, job, WORKLOAD_START_TIMEOUT)
                        .map_err(|e| harness(format!("{}: {e}", vm.name)))?;
                }
            }
            Running::Vms(guests)
        }
        Guests::Qtest => {
            let stop = Arc::new(AtomicBool::new(false));
            let mut threads = Vec::new();
            for vm in &vms {
                let mut load = std::panic::catch_unwind(|| LoadVm::start(&schedd, &vm.name))
                    .ok()
                    .flatten()
                    .ok_or_else(|| harness(format!("{}: no qtest load guest", vm.name)))?;
                let (w, stop) = (vm.spec.workload.clone(), stop.clone());
                let t = std::thread::Builder::new()
                    .name(vm.name.clone())
                    .spawn(move || drive(&mut load, &w, &stop))
                    .map_err(|e| harness(format!("{}: {e}", vm.name)))?;
                threads.push((vm.name.clone(), t));
            }
            Running::Qtest { stop, threads }
        }
    };
    // The window opens once every VM has completed some work.
    let ready = |show: &Value| {
        vms.iter()
            .all(|vm| find_vm(show, &vm.name)["completed"].as_u64() >= Some(WARM_GROUPS))
    };
    loop {
        let show = schedd
            .ctl(&["show"])
            .map_err(|e| harness(format!("vgpuctl show: {e}")))?;
        if ready(&show) {
            break;
        }
        if let Err(why) = running.check() {
            let _ = running.stop();
            return Err(ExperimentError::Boot {
                run: run.label.clone(),
                why,
            });
        }
        if started.elapsed() > config.boot_timeout {
            let _ = running.stop();
            return Err(ExperimentError::Boot {
                run: run.label.clone(),
                why: format!(
                    "not every VM ran its workload within {:?}: {}",
                    config.boot_timeout, show["vms"]
                ),
            });
        }
        std::thread::sleep(POLL);
    }
    let boot_s = started.elapsed().as_secs_f64();
    progress(&format!("measuring {} s", config.window.as_secs()));
    // Only VMs whose workload spans the whole window must be busy all through it.
    let whole: Vec<&str> = vms
        .iter()
        .filter(|vm| vm.spec.workload.start_ms == 0 && vm.spec.workload.stop_ms.is_none())
        .map(|vm| vm.name.as_str())
        .collect();
    let watched: Vec<Watched<'_>> = vms
        .iter()
        .zip(running.pids())
        .map(|(vm, pids)| {
            let paced = matches!(vm.spec.workload.shape, Shape::Frames { cpu_us, .. } if cpu_us > 0)
                && vm.spec.guest.is_none();
            (vm.name.as_str(), pids, paced)
        })
        .collect();
    let cpu_start: Vec<CpuTimes> = watched.iter().map(|(_, p, _)| CpuTimes::of(p)).collect();
    let window = watch_window(&schedd, &whole, config.window);
    let mut failures = Vec::new();
    let waits = cpu_waits(&watched, &cpu_start, &mut failures);
    let summaries = running.stop().map_err(harness)?;
    let mut window = window.map_err(harness)?;
    window.failures.extend(failures);
    for failure in &window.failures {
        progress(&format!("precondition failed: {failure}"));
    }
    let mut vm_results = results(&vms, &window.first, &window.last, window.seconds);
    for (r, summary) in vm_results.iter_mut().zip(summaries) {
        r.guest = summary;
    }
    for (r, wait) in vm_results.iter_mut().zip(waits) {
        r.cpu_wait = Some(wait);
    }
    Ok(RunResult {
        label: run.label.clone(),
        policy: window.last["policy"].as_str().unwrap_or("?").to_owned(),
        window_s: window.seconds,
        boot_s,
        vms: vm_results,
        precondition_failures: window.failures,
    })
}

/// Each VM's figures from the daemon's counters at the window's opening and close.
fn results(vms: &[RunVm], first: &Value, last: &Value, window_s: f64) -> Vec<VmResult> {
    let delta = |name: &str, key: &str| {
        let a = find_vm(first, name)[key].as_f64().unwrap_or(0.0);
        let b = find_vm(last, name)[key].as_f64().unwrap_or(0.0);
        (b - a).max(0.0)
    };
    let total_gpu: f64 = vms.iter().map(|vm| delta(&vm.name, "gpu_time_ns")).sum();
    vms.iter()
        .map(|vm| {
            let gpu = delta(&vm.name, "gpu_time_ns");
            let groups = delta(&vm.name, "completed") / window_s;
            let fps = delta(&vm.name, "frames") / window_s;
            let entry = find_vm(last, &vm.name);
            VmResult {
                name: vm.name.clone(),
                gpu_share: if total_gpu > 0.0 {
                    gpu / total_gpu
                } else {
                    0.0
                },
                gpu_util: gpu / (window_s * 1e9),
                groups_per_sec: groups,
                fps,
                work_per_sec: if matches!(vm.spec.workload.shape, Shape::Frames { .. }) {
                    fps
                } else {
                    groups
                },
                latency_p50_us: entry["latency_p50_us"].as_u64().unwrap_or(0),
                latency_p99_us: entry["latency_p99_us"].as_u64().unwrap_or(0),
                figures: entry["figures"].clone(),
                guest: None,
                cpu_wait: None,
            }
        })
        .collect()
}

/// Busy for `us` microseconds of wall time (a workload's CPU phase).
fn spin(us: u64) {
    let until = Instant::now() + Duration::from_micros(us);
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// A qtest VM's workload, as `vgpu-load` runs it in a guest (plus `coupled`: a CPU phase,
/// then one GPU call waited for; the harness thread polls for its fence whether the guest
/// would block or spin), until `stop` is raised or the workload's `stop_ms`; then its
/// requests drain. Panics (with the device's log) when a request fails or stalls.
fn drive(vm: &mut LoadVm, w: &Workload, stop: &AtomicBool) {
    let start = Instant::now();
    let stop_at = w.stop_ms.map(|ms| start + Duration::from_millis(ms));
    let begin = start + Duration::from_millis(w.start_ms);
    while Instant::now() < begin && !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let running = || !stop.load(Ordering::Relaxed) && stop_at.is_none_or(|t| Instant::now() < t);
    let stalled = |vm: &LoadVm| -> ! { panic!("{} stalled:\n{}", vm.name, vm.server.log()) };
    match w.shape {
        Shape::Bomb { cost_us, depth } => {
            while running() {
                while vm.pending() < depth as usize {
                    vm.occupy(cost_us);
                }
                if vm.wait_one(load_vm::TIMEOUT).is_none() {
                    stalled(vm);
                }
            }
        }
        Shape::Periodic { cost_us, period_us } => {
            let period = Duration::from_micros(period_us.max(1));
            let mut next = Instant::now();
            while running() {
                vm.count_done();
                let now = Instant::now();
                if now >= next {
                    if vm.pending() < MAX_PERIODIC_OUTSTANDING {
                        vm.occupy(cost_us);
                    }
                    while next <= now {
                        next += period;
                    }
                }
                std::thread::sleep(next.saturating_duration_since(Instant::now()).min(POLL));
            }
        }
        Shape::Frames {
            cpu_us,
            groups,
            cost_us,
            ..
        } => {
            while running() {
                spin(cpu_us);
                for _ in 0..groups {
                    vm.occupy(cost_us);
                }
                vm.end_frame();
                vm.drain();
            }
        }
        Shape::Throttle {
            kernel_us,
            sleep_us,
        } => {
            while running() {
                vm.occupy(kernel_us);
                vm.drain();
                std::thread::sleep(Duration::from_micros(sleep_us));
            }
        }
        Shape::Coupled {
            cpu_us, cost_us, ..
        } => {
            while running() {
                spin(cpu_us);
                vm.occupy(cost_us);
                vm.drain();
            }
        }
    }
    vm.drain();
}

/// Longest time a VM may complete no work inside a measuring window and still count as
/// present: every workload the scenarios give a guest completes a group at least every few
/// hundred milliseconds, even a bomb held to a PE reserve (its budget returns every period).
pub const ACTIVE_SLICE: Duration = Duration::from_secs(2);

/// A measuring window seen through the daemon's counters.
#[derive(Debug, Clone)]
pub struct Window {
    /// `vgpuctl show` when the window opened and when it closed.
    pub first: Value,
    pub last: Value,
    pub seconds: f64,
    /// The precondition failures: a VM that was absent, or completed nothing for longer than
    /// [`ACTIVE_SLICE`], in the window. Empty when every VM was present and busy throughout.
    pub failures: Vec<String>,
}

/// Watches the daemon's counters for `window`: each VM of `vms` must be connected and
/// complete work in every [`ACTIVE_SLICE`] of it (the precondition of comparing its figures
/// with another window's).
pub fn watch_window(schedd: &Schedd, vms: &[&str], window: Duration) -> Result<Window, String> {
    let show = || {
        schedd
            .ctl(&["show"])
            .map_err(|e| format!("vgpuctl show: {e}"))
    };
    let completed = |show: &Value, vm: &str| find_vm(show, vm)["completed"].as_u64();
    let first = show()?;
    let opened = Instant::now();
    // When each VM last completed work, and its count then.
    let mut seen: Vec<(Instant, Option<u64>)> = vms
        .iter()
        .map(|vm| (opened, completed(&first, vm)))
        .collect();
    let mut failures = Vec::new();
    let mut last = first.clone();
    loop {
        let left = window.saturating_sub(opened.elapsed());
        if left.is_zero() {
            break;
        }
        std::thread::sleep(left.min(WINDOW_POLL));
        last = show()?;
        let now = Instant::now();
        for (vm, (at, count)) in vms.iter().zip(seen.iter_mut()) {
            let c = completed(&last, vm);
            if c > *count {
                *at = now;
                *count = c;
            } else if now.duration_since(*at) > ACTIVE_SLICE {
                failures.push(format!(
                    "{vm} {} from {:.1} s to {:.1} s of the window",
                    if c.is_none() {
                        "was not connected"
                    } else {
                        "completed no work"
                    },
                    (*at - opened).as_secs_f64(),
                    (now - opened).as_secs_f64()
                ));
                // Reported once per gap.
                *at = now;
            }
        }
    }
    Ok(Window {
        first,
        last,
        seconds: opened.elapsed().as_secs_f64(),
        failures,
    })
}

/// Largest share of the CPU time a frame-paced VM's processes (its QEMU and its device
/// process) wanted in a window that they may have spent runnable but waiting for a CPU, and
/// its figures still count: past it they waited more than five times as long as they ran, and
/// the host, not the policy, set the VM's pace (a TCG guest's vCPU starved by other work).
/// The share is a coarse signal (a VM that blocks on fences or a paced present also waits at
/// every wake-up), so the bound is loose. Measured on this 2-core host: with builds beside
/// (load 2.5-6.5) the games waited 20-76% and most runs still showed the paper's direction
/// (TimeGraph quick: 20% alone, 43% beside the bomb, 28% with TimeGraph); with stress-ng on
/// both cores as well, 70-86%, and TimeGraph seemed to slow the game (28.9 against 36.9 fps).
pub const CPU_WAIT_MAX: f64 = 0.85;

/// What processes' threads did with the CPU so far: ran, or waited runnable for one
/// (`/proc/PID/task/*/schedstat`, nanoseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuTimes {
    pub run_ns: u64,
    pub wait_ns: u64,
}

impl CpuTimes {
    /// The times of every thread of `pids` (a process gone or unreadable counts nothing).
    pub fn of(pids: &[u32]) -> CpuTimes {
        let mut total = CpuTimes::default();
        for pid in pids {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
                continue;
            };
            for task in tasks.flatten() {
                let text =
                    std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
                if let Ok(t) = parse_schedstat(&text) {
                    total.run_ns = total.run_ns.saturating_add(t.run_ns);
                    total.wait_ns = total.wait_ns.saturating_add(t.wait_ns);
                }
            }
        }
        total
    }

    /// The share of the CPU time wanted since `before` that was spent waiting for a CPU.
    pub fn wait_share_since(&self, before: &CpuTimes) -> f64 {
        let run = self.run_ns.saturating_sub(before.run_ns) as f64;
        let wait = self.wait_ns.saturating_sub(before.wait_ns) as f64;
        if run + wait > 0.0 {
            wait / (run + wait)
        } else {
            0.0
        }
    }
}

/// A VM whose processes are watched over a window: its name, its QEMU and device process,
/// and whether its figures are paced by its own CPU work (a frame loop's CPU phase), so that a
/// starved CPU invalidates them. A VM that mostly sleeps on its fences (a bomb, a throttled
/// or periodic load) waits for a CPU at every wake-up: its share is reported, not checked.
pub type Watched<'a> = (&'a str, Vec<u32>, bool);

/// Each VM's CPU wait share over a window, from its processes' times at its start; a checked
/// VM past [`CPU_WAIT_MAX`] is a precondition failure (in `failures`).
pub fn cpu_waits(
    vms: &[Watched<'_>],
    at_start: &[CpuTimes],
    failures: &mut Vec<String>,
) -> Vec<f64> {
    vms.iter()
        .zip(at_start)
        .map(|((vm, pids, checked), before)| {
            let share = CpuTimes::of(pids).wait_share_since(before);
            if *checked && share > CPU_WAIT_MAX {
                failures.push(format!(
                    "{vm}'s processes waited for a CPU {:.0}% of the time they wanted one \
                     (at most {:.0}%): the host, not the policy, set its pace",
                    share * 100.0,
                    CPU_WAIT_MAX * 100.0
                ));
            }
            share
        })
        .collect()
}

/// Most periodic groups outstanding, as the simulator's `periodic` workload allows.
const MAX_PERIODIC_OUTSTANDING: usize = 64;

/// Writes a guest's QEMU cgroup CPU weight (cgroup v2 scale).
fn set_cpu_weight(guest: &RunningGuest, weight: u32) -> Result<(), String> {
    let fs = vgpu_schedd::cgroup::CgroupFs::default();
    let cg = fs
        .locate(guest.qemu_pid())
        .map_err(|e| format!("its QEMU's cgroup: {e}"))?;
    cg.set_weight(weight)
        .map_err(|e| format!("CPU weight {weight}: {e}"))
}

/// The side-by-side table of a scenario: per run and VM, what the paper reports (the run's
/// `paper` note), the simulator's and the guests' GPU share, work rate and latency (the
/// daemon's, over the window), and what the guest measured itself (its workload's summary).
/// A run whose preconditions failed is one row saying why, without figures.
pub fn side_by_side(sc: &Scenario, sim: &[RunReport], vms: &[RunResult], guests: &str) -> String {
    let mut md = format!(
        "### {}: paper / simulator / VMs ({guests})\n\n{}\n\n\
         | run | paper | VM | share sim | share VMs | work/s sim | work/s VMs | p50 sim (us) | p50 VMs (us) | guest's own |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
        sc.name, sc.description
    );
    let papers: BTreeMap<&str, &str> = sc
        .run
        .iter()
        .map(|r| (r.label.as_str(), r.paper.as_deref().unwrap_or("")))
        .collect();
    for r in vms {
        if !r.precondition_failures.is_empty() {
            md.push_str(&format!(
                "| {} | {} | excluded: precondition failed ({}) | | | | | | | |\n",
                r.label,
                papers.get(r.label.as_str()).copied().unwrap_or(""),
                r.precondition_failures.join("; ")
            ));
            continue;
        }
        let s = sim.iter().find(|s| s.label == r.label);
        for (i, vm) in r.vms.iter().enumerate() {
            let svm = s.and_then(|s| s.vms.iter().find(|v| v.name == vm.name));
            let (label, paper) = if i == 0 {
                (
                    r.label.as_str(),
                    papers.get(r.label.as_str()).copied().unwrap_or(""),
                )
            } else {
                ("", "")
            };
            md.push_str(&format!(
                "| {label} | {paper} | {} | {} | {:.1}% | {} | {:.1} | {} | {} | {} |\n",
                vm.name,
                svm.map_or("-".into(), |v| format!("{:.1}%", v.gpu_share * 100.0)),
                vm.gpu_share * 100.0,
                svm.map_or("-".into(), |v| format!("{:.1}", v.work_per_sec)),
                vm.work_per_sec,
                svm.map_or("-".into(), |v| format!("{:.0}", v.latency_p50_us)),
                vm.latency_p50_us,
                vm.guest.as_ref().map_or("-".into(), guest_figures),
            ));
        }
    }
    md
}

/// A guest's own summary (vgpu-load's) as "work/s, p50": frames per second for a frame
/// workload, groups per second otherwise, over the workload's whole run.
fn guest_figures(summary: &Value) -> String {
    let f = |key: &str| summary[key].as_f64();
    let rate = match (
        summary["mode"].as_str(),
        f("fps"),
        f("groups"),
        f("elapsed_s"),
    ) {
        (Some("frames"), Some(fps), _, _) => format!("{fps:.1} fps"),
        (_, _, Some(groups), Some(s)) if s > 0.0 => format!("{:.1}/s", groups / s),
        _ => "?".into(),
    };
    match f("latency_p50_us") {
        Some(p50) => format!("{rate}, p50 {p50:.0} us"),
        None => rate,
    }
}

/// The side-by-side figure: one panel per run whose preconditions held, per VM its GPU share
/// in the simulator beside the one measured on guests.
pub fn svg(path: &Path, sim: &[RunReport], vms: &[RunResult]) -> Result<(), String> {
    use vgpu_bench_report::{Kind, Panel, Series, write_svg};
    let panels: Vec<Panel> = vms
        .iter()
        .filter(|r| r.precondition_failures.is_empty())
        .map(|r| {
            let s = sim.iter().find(|s| s.label == r.label);
            let simulated = r
                .vms
                .iter()
                .map(|v| {
                    s.and_then(|s| s.vms.iter().find(|x| x.name == v.name))
                        .map(|x| x.gpu_share * 100.0)
                })
                .collect();
            Panel::new(
                Kind::Bars,
                format!("{} ({})", r.label, r.policy),
                "VM",
                "GPU share (% of GPU time)",
                r.vms.iter().map(|v| v.name.clone()).collect(),
            )
            .with(Series::new("simulator", simulated))
            .with(Series::new(
                "guests",
                r.vms.iter().map(|v| Some(v.gpu_share * 100.0)).collect(),
            ))
        })
        .collect();
    // The scenario's name starts the file's (NAME.KIND.compare.svg).
    let scenario = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.split('.').next())
        .unwrap_or("experiment");
    let title = format!(
        "{scenario}: GPU share per VM, simulator beside the guests — {}",
        vgpu_bench_report::machine()
    );
    write_svg(path, &title, &panels, 2).map_err(|e| e.to_string())
}

/// The guests' results as CSV, one line per run and VM; the last column says whether the
/// run's preconditions held (`ok`) or not (`failed`: not to be compared).
pub fn csv(results: &[RunResult]) -> String {
    let mut out = String::from(
        "run,policy,vm,gpu_share_pct,gpu_util_pct,groups_per_s,fps,work_per_s,lat_p50_us,lat_p99_us,window_s,precondition\n",
    );
    for r in results {
        for v in &r.vms {
            out.push_str(&format!(
                "{},{},{},{:.2},{:.2},{:.1},{:.2},{:.2},{},{},{:.2},{}\n",
                r.label,
                r.policy,
                v.name,
                v.gpu_share * 100.0,
                v.gpu_util * 100.0,
                v.groups_per_sec,
                v.fps,
                v.work_per_sec,
                v.latency_p50_us,
                v.latency_p99_us,
                r.window_s,
                if r.precondition_failures.is_empty() {
                    "ok"
                } else {
                    "failed"
                }
            ));
        }
    }
    out
}

/// Writes `text` to `dir/name`.
pub fn write(dir: &Path, name: &str, text: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(text: &str) -> Scenario {
        toml::from_str(text).expect("scenario")
    }

    const TWO_VMS: &str = r#"
name = "t"
duration_ms = 1000
[[vm]]
name = "game"
params = { priority = 10, sched = "ht", target_fps = 30.0 }
workload = { kind = "frames", cpu_us = 3000, groups = 8, cost_us = 1200, present_us = 300 }
[[vm]]
name = "bomb"
workload = { kind = "bomb", cost_us = 500, depth = 8, start_ms = 1500, stop_ms = 4000 }
cpu = { weight = 200 }
[[run]]
label = "pe"
policy = { policy = "timegraph" }
instances = { bomb = 3 }
params = { bomb = { reserve = { c = 2500000, t = 25000000, enforcement = "pe" } } }
[[run]]
label = "alone"
policy = { policy = "none" }
vms = ["game"]
"#;

    #[test]
    fn runs_expand_instances_and_apply_overrides_as_the_simulator_does() {
        let sc = scenario(TWO_VMS);
        let vms = sc.run_vms(&sc.run[0]);
        let names: Vec<&str> = vms.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, ["game", "bomb-1", "bomb-2", "bomb-3"]);
        assert_eq!(vms[1].params.name, "bomb-1");
        assert!(vms[1].params.reserve.is_some());
        assert_eq!(vms[1].cpu_weight, 200);
        assert_eq!(sc.run_vms(&sc.run[1]).len(), 1);
    }

    #[test]
    fn workloads_become_vgpu_load_commands_and_parameters_vgpuctl_keys() {
        let sc = scenario(TWO_VMS);
        let vms = sc.run_vms(&sc.run[0]);
        let game = guest_command(&vms[0], 30).unwrap();
        assert!(
            game.starts_with(
                "vgpu-load frames --groups 8 --cost-us 1200 --cpu-us 3000 --fps-target 30 \
                 --until-stopped --json"
            ),
            "{game}: it runs until the host stops it"
        );
        // start_ms sleeps first; stop_ms shortens the run to stop - start.
        let bomb = guest_command(&vms[1], 30).unwrap();
        assert!(
            bomb.starts_with("sleep 1.500\nvgpu-load bomb --cost-us 500 --depth 8 --duration-s 3 "),
            "{bomb}"
        );
        assert_eq!(
            set_arguments(&vms[0].params),
            ["priority=10", "sched=ht", "target_fps=30"]
        );
        assert_eq!(set_arguments(&vms[1].params), ["reserve=2500/25000/pe"]);
        let defaults = VgpuParams::named("x");
        assert!(set_arguments(&defaults).is_empty());
    }

    #[test]
    fn a_guest_command_replaces_the_workload_on_guests() {
        let text = TWO_VMS.replace(
            "[[vm]]\nname = \"bomb\"",
            "[[vm]]\nname = \"bomb\"\nguest = \"glmark2-es2-drm -b build:duration={duration_s}\"",
        );
        let sc = scenario(&text);
        let vms = sc.run_vms(&sc.run[0]);
        assert_eq!(
            guest_command(&vms[1], 42).unwrap(),
            "glmark2-es2-drm -b build:duration=42"
        );
        assert!(
            guest_command(&vms[0], 42)
                .unwrap()
                .starts_with("vgpu-load frames")
        );
    }

    #[test]
    fn a_coupled_workload_has_no_guest_program() {
        let sc = scenario(
            r#"
name = "c"
duration_ms = 1000
[[vm]]
name = "app"
workload = { kind = "coupled", cpu_us = 200, cost_us = 800 }
[[run]]
label = "none"
policy = { policy = "none" }
"#,
        );
        let vms = sc.run_vms(&sc.run[0]);
        let e = guest_command(&vms[0], 10).unwrap_err();
        assert!(e.to_string().contains("app: coupled"), "{e}");
    }

    #[test]
    fn cpu_wait_shares_come_from_schedstat() {
        let before = CpuTimes {
            run_ns: 1000,
            wait_ns: 500,
        };
        let after = CpuTimes {
            run_ns: 1600,
            wait_ns: 900,
        };
        assert!((after.wait_share_since(&before) - 0.4).abs() < 1e-9);
        assert_eq!(before.wait_share_since(&before), 0.0, "no CPU wanted");
        // This process's own threads are readable and move.
        let me = std::process::id();
        let start = CpuTimes::of(&[me]);
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        assert!(CpuTimes::of(&[me]).run_ns > start.run_ns);
        // A starved VM is a precondition failure; a gone process counts nothing.
        let mut failures = Vec::new();
        let shares = cpu_waits(
            &[("gone", vec![u32::MAX], true)],
            &[CpuTimes::default()],
            &mut failures,
        );
        assert_eq!((shares, failures.len()), (vec![0.0], 0));
    }

    #[test]
    fn the_comparison_names_each_run_once_and_marks_missing_simulator_figures() {
        let sc = scenario(TWO_VMS);
        let vm = |name: &str, share: f64| VmResult {
            name: name.into(),
            gpu_share: share,
            gpu_util: share,
            groups_per_sec: 10.0,
            fps: 0.0,
            work_per_sec: 10.0,
            latency_p50_us: 100,
            latency_p99_us: 200,
            figures: Value::Null,
            guest: None,
            cpu_wait: None,
        };
        let mut game = vm("game", 0.75);
        game.guest = Some(serde_json::json!({
            "kind": "summary", "mode": "frames", "elapsed_s": 20.0, "groups": 4000,
            "frames": 1000, "fps": 50.0, "latency_p50_us": 4608, "latency_p99_us": 9000
        }));
        let mut bomb = vm("bomb-1", 0.25);
        bomb.guest = Some(serde_json::json!({
            "kind": "summary", "mode": "bomb", "elapsed_s": 20.0, "groups": 3000,
            "frames": 0, "fps": 0.0, "latency_p50_us": 30720, "latency_p99_us": 40000
        }));
        let result = RunResult {
            label: "pe".into(),
            policy: "timegraph".into(),
            window_s: 8.0,
            boot_s: 10.0,
            vms: vec![game, bomb],
            precondition_failures: Vec::new(),
        };
        let idle = RunResult {
            label: "alone".into(),
            vms: vec![vm("game", 1.0)],
            precondition_failures: vec!["game completed no work from 1.0 s to 3.5 s".into()],
            ..result.clone()
        };
        let md = side_by_side(&sc, &[], &[result.clone(), idle.clone()], "vms");
        assert!(
            md.contains("| pe |  | game | - | 75.0% |") && md.contains("| 50.0 fps, p50 4608 us |"),
            "{md}"
        );
        assert!(
            md.contains("|  |  | bomb-1 | - | 25.0% |") && md.contains("| 150.0/s, p50 30720 us |"),
            "{md}"
        );
        assert!(md.contains("VMs (vms)"), "{md}");
        assert!(
            md.contains(
                "| alone |  | excluded: precondition failed (game completed no work from 1.0 s \
                 to 3.5 s) |"
            ) && !md.contains("| alone |  | game |"),
            "a run whose precondition failed shows no figures: {md}"
        );
        let dir = crate::TempDir::new("experiment-svg").unwrap();
        let figure = dir.path().join("t.vms.compare.svg");
        svg(&figure, &[], std::slice::from_ref(&result)).unwrap();
        let drawn = std::fs::read_to_string(&figure).unwrap();
        for text in [
            "t: GPU share per VM",
            "pe (timegraph)",
            "bomb-1",
            "guests",
            "GPU share (% of GPU time)",
            "75.0",
        ] {
            assert!(drawn.contains(text), "{text} missing in the figure");
        }
        let csv = csv(&[result, idle]);
        assert_eq!(csv.lines().count(), 4);
        assert!(
            csv.contains("\npe,timegraph,game,75.00,75.00,10.0,0.00,10.00,100,200,8.00,ok\n")
                && csv.contains(
                    "\nalone,timegraph,game,100.00,100.00,10.0,0.00,10.00,100,200,8.00,failed\n"
                ),
            "{csv}"
        );
    }
}
