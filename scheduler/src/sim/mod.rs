//! A deterministic discrete-event simulator that drives the [`crate::Scheduler`]: VMs run
//! workloads (bombs, periodic widgets, games, Throttle, CPU/GPU coupled programs) that submit
//! command groups; the scheduler's decisions are carried out on one simulated non-preemptive
//! GPU engine and a proportional-share host CPU model. The same [`Scenario`] and seed always
//! give the same [`RunReport`]s.
//!
//! Pure like the rest of the crate: no I/O, no clock. The `vgpu-sim` runner reads scenario
//! files and writes the reports.

mod cpu;
pub mod engine;
mod report;
mod scenario;
mod world;

pub use report::{DecisionCounts, RunReport, Series, VmReport, VmSeries};
pub use scenario::{
    CpuSpec, ParamsOverride, RunSpec, RunVm, Scenario, Shape, VmSpec, VmsSpec, Wait, Workload,
};

use crate::core::SchedError;
use crate::model::Time;

/// Longest simulated run: an hour of simulated time is far beyond any experiment and bounds
/// the work one scenario can ask for.
pub const MAX_DURATION_MS: u64 = 3_600_000;
/// Most VMs in one run (after expanding instances).
pub const MAX_VMS: usize = 256;
/// Most instances one `[[vm]]` entry may stand for.
pub const MAX_INSTANCES: u32 = 64;
/// Largest cost, period or CPU time of one workload step: 10 s, so sums cannot overflow.
pub const MAX_STEP_US: u64 = 10_000_000;
/// Most groups a bomb keeps outstanding, or a frame renders: well below the core's
/// per-vGPU queue bound.
pub const MAX_DEPTH: u32 = 1_024;
/// Most host CPU cores, and most vCPUs of one VM.
pub const MAX_CPUS: u32 = 1_024;
/// Shortest CPU quantum: finer quanta only cost simulation time.
pub const MIN_QUANTUM_US: u64 = 10;
/// Most points in a time series; the interval grows for long runs to stay under it.
pub const MAX_SAMPLES: u64 = 2_000;
/// Most events handled at one instant of simulated time. More means some workload or policy
/// makes no progress (a zero-cost loop, a timer that is always due); the run stops with
/// [`SimError::Stalled`] instead of spinning.
pub const MAX_EVENTS_PER_INSTANT: u64 = 1_000_000;

/// Why a scenario cannot be run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// A field has a value the simulator cannot use.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field, as a path (`vm.game.workload.cost_us`).
        field: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A run names a VM that the scenario does not define.
    #[error("run {run:?}: {field}: unknown VM {name:?}")]
    UnknownVm {
        /// The run's label.
        run: String,
        /// The field that names it.
        field: &'static str,
        /// The name.
        name: String,
    },
    /// The scheduler refused a VM's parameters or an event.
    #[error("run {run:?}, VM {vm:?}: {source}")]
    Sched {
        /// The run's label.
        run: String,
        /// The VM.
        vm: String,
        /// The scheduler's error.
        source: SchedError,
    },
    /// Nothing advanced simulated time for [`MAX_EVENTS_PER_INSTANT`] events.
    #[error("run {run:?}: no progress at {at} ns (zero-cost loop or a timer always due)")]
    Stalled {
        /// The run's label.
        run: String,
        /// The simulated time it got stuck at.
        at: Time,
    },
}

fn invalid(field: String, reason: &'static str) -> SimError {
    SimError::Invalid { field, reason }
}

/// Checks the parts of a scenario that do not depend on a run.
fn validate(sc: &Scenario) -> Result<(), SimError> {
    if sc.duration_ms == 0 || sc.duration_ms > MAX_DURATION_MS {
        return Err(invalid("duration_ms".into(), "must be 1..=3600000"));
    }
    if !(1..=MAX_CPUS).contains(&sc.cpus) {
        return Err(invalid("cpus".into(), "must be 1..=1024"));
    }
    if sc.cpu_quantum_us < MIN_QUANTUM_US || sc.cpu_quantum_us > MAX_STEP_US {
        return Err(invalid("cpu_quantum_us".into(), "must be 10..=10000000"));
    }
    if sc.sample_ms == 0 || sc.sample_ms > MAX_DURATION_MS {
        return Err(invalid("sample_ms".into(), "must be 1..=3600000"));
    }
    if sc.context_switch_us > MAX_STEP_US {
        return Err(invalid("context_switch_us".into(), "at most 10 s"));
    }
    if sc.grant_latency_us > MAX_STEP_US {
        return Err(invalid("grant_latency_us".into(), "at most 10 s"));
    }
    if sc
        .frame_bound_ms
        .is_some_and(|b| !(b.is_finite() && b > 0.0))
    {
        return Err(invalid("frame_bound_ms".into(), "must be positive"));
    }
    if !(sc.frame_tolerance_ms.is_finite() && sc.frame_tolerance_ms >= 0.0) {
        return Err(invalid("frame_tolerance_ms".into(), "must be >= 0"));
    }
    if sc.vm.is_empty() {
        return Err(invalid("vm".into(), "at least one [[vm]] is needed"));
    }
    if sc.run.is_empty() {
        return Err(invalid("run".into(), "at least one [[run]] is needed"));
    }
    for (i, vm) in sc.vm.iter().enumerate() {
        if vm.name.is_empty() {
            return Err(invalid(format!("vm[{i}].name"), "must not be empty"));
        }
        if sc.vm[..i].iter().any(|o| o.name == vm.name) {
            return Err(invalid(format!("vm.{}.name", vm.name), "duplicate VM name"));
        }
        validate_vm(vm)?;
    }
    for (i, run) in sc.run.iter().enumerate() {
        if run.label.is_empty() {
            return Err(invalid(format!("run[{i}].label"), "must not be empty"));
        }
        if sc.run[..i].iter().any(|o| o.label == run.label) {
            return Err(invalid(
                format!("run.{}.label", run.label),
                "duplicate label",
            ));
        }
    }
    Ok(())
}

fn validate_vm(vm: &VmSpec) -> Result<(), SimError> {
    let field = |f: &str| format!("vm.{}.{f}", vm.name);
    if !(1..=MAX_INSTANCES).contains(&vm.instances) {
        return Err(invalid(field("instances"), "must be 1..=64"));
    }
    if !(1..=MAX_CPUS).contains(&vm.cpu.vcpus) {
        return Err(invalid(field("cpu.vcpus"), "must be 1..=1024"));
    }
    if !(1..=10_000).contains(&vm.cpu.weight) {
        return Err(invalid(field("cpu.weight"), "must be 1..=10000"));
    }
    let w = &vm.workload;
    if !(w.jitter.is_finite() && (0.0..=1.0).contains(&w.jitter)) {
        return Err(invalid(field("workload.jitter"), "must be in 0..=1"));
    }
    if w.stop_ms.is_some_and(|s| s <= w.start_ms) {
        return Err(invalid(field("workload.stop_ms"), "must be after start_ms"));
    }
    let steps: &[(&str, u64)] = match &w.shape {
        Shape::Bomb { cost_us, depth } => {
            if *cost_us == 0 {
                return Err(invalid(field("workload.cost_us"), "must be positive"));
            }
            if !(1..=MAX_DEPTH).contains(depth) {
                return Err(invalid(field("workload.depth"), "must be 1..=1024"));
            }
            &[("cost_us", *cost_us)]
        }
        Shape::Periodic { cost_us, period_us } => {
            if *period_us == 0 {
                return Err(invalid(field("workload.period_us"), "must be positive"));
            }
            &[("cost_us", *cost_us), ("period_us", *period_us)]
        }
        Shape::Frames {
            cpu_us,
            groups,
            cost_us,
            present_us,
        } => {
            if *groups > MAX_DEPTH {
                return Err(invalid(field("workload.groups"), "at most 1024"));
            }
            if *cpu_us == 0 && (*groups == 0 || *cost_us == 0) && *present_us == 0 {
                return Err(invalid(field("workload"), "a frame must take some time"));
            }
            &[
                ("cpu_us", *cpu_us),
                ("cost_us", *cost_us),
                ("present_us", *present_us),
            ]
        }
        Shape::Throttle {
            kernel_us,
            sleep_us,
        } => {
            if *kernel_us == 0 && *sleep_us == 0 {
                return Err(invalid(
                    field("workload"),
                    "kernel_us + sleep_us must be > 0",
                ));
            }
            &[("kernel_us", *kernel_us), ("sleep_us", *sleep_us)]
        }
        Shape::Coupled {
            cpu_us, cost_us, ..
        } => {
            if *cpu_us == 0 && *cost_us == 0 {
                return Err(invalid(field("workload"), "cpu_us + cost_us must be > 0"));
            }
            &[("cpu_us", *cpu_us), ("cost_us", *cost_us)]
        }
    };
    for &(name, v) in steps {
        if v > MAX_STEP_US {
            return Err(invalid(field(&format!("workload.{name}")), "at most 10 s"));
        }
    }
    Ok(())
}

/// Checks that every VM name a run uses exists.
fn check_run_names(sc: &Scenario, run: &RunSpec) -> Result<(), SimError> {
    let known = |n: &String| sc.vm.iter().any(|v| &v.name == n);
    let unknown = |field, name: &String| SimError::UnknownVm {
        run: run.label.clone(),
        field,
        name: name.clone(),
    };
    for n in run.vms.iter().flatten() {
        if !known(n) {
            return Err(unknown("vms", n));
        }
    }
    for n in run.params.keys() {
        if !known(n) {
            return Err(unknown("params", n));
        }
    }
    for (n, &w) in &run.cpu_weight {
        if !known(n) {
            return Err(unknown("cpu_weight", n));
        }
        if !(1..=10_000).contains(&w) {
            return Err(invalid(
                format!("run.{}.cpu_weight.{n}", run.label),
                "must be 1..=10000",
            ));
        }
    }
    for (n, &k) in &run.instances {
        if !known(n) {
            return Err(unknown("instances", n));
        }
        if !(1..=MAX_INSTANCES).contains(&k) {
            return Err(invalid(
                format!("run.{}.instances.{n}", run.label),
                "must be 1..=64",
            ));
        }
    }
    if run.context_switch_us.is_some_and(|c| c > MAX_STEP_US) {
        return Err(invalid(
            format!("run.{}.context_switch_us", run.label),
            "at most 10 s",
        ));
    }
    if run.grant_latency_us.is_some_and(|g| g > MAX_STEP_US) {
        return Err(invalid(
            format!("run.{}.grant_latency_us", run.label),
            "at most 10 s",
        ));
    }
    if run.cpus.is_some_and(|c| !(1..=MAX_CPUS).contains(&c)) {
        return Err(invalid(
            format!("run.{}.cpus", run.label),
            "must be 1..=1024",
        ));
    }
    Ok(())
}

/// Runs every `[[run]]` of the scenario; one report per run, in order.
pub fn run(sc: &Scenario) -> Result<Vec<RunReport>, SimError> {
    validate(sc)?;
    for r in &sc.run {
        check_run_names(sc, r)?;
    }
    sc.run
        .iter()
        .map(|r| world::World::new(sc, r)?.run())
        .collect()
}

#[cfg(test)]
mod tests;
