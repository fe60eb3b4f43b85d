//! The scenario description: VMs with workloads, and the runs (policy variants) to compare.
//! It deserializes from any serde format; the runner reads TOML (see `scenarios/README.md`).

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::model::{Nanos, PrioPolicy, Reserve, VgpuParams};
use crate::policy::PolicyConfig;

fn one() -> u32 {
    1
}
fn one_usize() -> usize {
    1
}
fn default_quantum_us() -> u64 {
    1_000
}
fn default_sample_ms() -> u64 {
    100
}
fn default_tolerance_ms() -> f64 {
    2.0
}
fn default_cpu_weight() -> u32 {
    100
}

/// One experiment: a set of VMs and the runs that compare policies on them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name, used for output file names.
    pub name: String,
    /// What the experiment shows.
    #[serde(default)]
    pub description: String,
    /// Simulated time of each run, in milliseconds.
    pub duration_ms: u64,
    /// Seed of the cost jitter generators.
    #[serde(default)]
    pub seed: u64,
    /// Capacity of the scheduler's GPU-online list.
    #[serde(default = "one_usize")]
    pub capacity: usize,
    /// GPU time added when the engine switches to another (vGPU, context).
    #[serde(default)]
    pub context_switch_us: u64,
    /// Round trip of an engaged grant: a group the scheduler dispatches from its queue (not
    /// under a lease) reaches the engine this long after the decision. 0 models a device
    /// that does not ask the scheduler at all (scheduling off).
    #[serde(default)]
    pub grant_latency_us: u64,
    /// Host CPU cores shared by the VMs' vCPUs.
    #[serde(default = "one")]
    pub cpus: u32,
    /// The CPU model's scheduling quantum.
    #[serde(default = "default_quantum_us")]
    pub cpu_quantum_us: u64,
    /// Apply the scheduler's CPU weight suggestions to the CPU model.
    #[serde(default)]
    pub cpu_writeback: bool,
    /// Interval of the per-VM time series.
    #[serde(default = "default_sample_ms")]
    pub sample_ms: u64,
    /// Frames slower than this count as over the bound; default `1000 / target_fps +
    /// frame_tolerance_ms` for VMs with a target frame rate.
    #[serde(default)]
    pub frame_bound_ms: Option<f64>,
    /// Slack added to `1000 / target_fps` for the frame bound.
    #[serde(default = "default_tolerance_ms")]
    pub frame_tolerance_ms: f64,
    /// How the scenario runs on real guests (`vgpu-bench --on vms`); the simulator ignores it.
    #[serde(default)]
    pub vms: VmsSpec,
    /// The VMs, shared by all runs.
    pub vm: Vec<VmSpec>,
    /// The runs, one per policy variant.
    pub run: Vec<RunSpec>,
}

fn default_window_s() -> u64 {
    20
}
fn default_quick_window_s() -> u64 {
    8
}
fn default_boot_timeout_s() -> u64 {
    240
}

/// How a scenario runs on real guests: how long each run is measured once every VM's workload
/// is running, and which runs `--quick` keeps.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmsSpec {
    /// Seconds each run is measured for.
    #[serde(default = "default_window_s")]
    pub window_s: u64,
    /// Seconds each run is measured for with `--quick`.
    #[serde(default = "default_quick_window_s")]
    pub quick_window_s: u64,
    /// The runs `--quick` keeps (labels); empty: all.
    #[serde(default)]
    pub quick_runs: Vec<String>,
    /// Longest wait for every VM of a run to boot and start its workload.
    #[serde(default = "default_boot_timeout_s")]
    pub boot_timeout_s: u64,
}

impl Default for VmsSpec {
    fn default() -> Self {
        VmsSpec {
            window_s: default_window_s(),
            quick_window_s: default_quick_window_s(),
            quick_runs: Vec::new(),
            boot_timeout_s: default_boot_timeout_s(),
        }
    }
}

/// One VM (one vGPU) of a scenario.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    /// Its name; with `instances > 1` the instances are named `name-1`, `name-2`, ...
    pub name: String,
    /// Its vGPU parameters (the name is taken from `name`).
    #[serde(default)]
    pub params: VgpuParams,
    /// What it runs.
    pub workload: Workload,
    /// Its vCPUs and CPU weight.
    #[serde(default)]
    pub cpu: CpuSpec,
    /// The GPU context its groups run in.
    #[serde(default)]
    pub context: u32,
    /// How many identical VMs this entry stands for.
    #[serde(default = "one")]
    pub instances: u32,
    /// On real guests (`vgpu-bench --on vms`): a shell command the guest runs instead of the
    /// workload's `vgpu-load` equivalent (glmark2, kmscube, a CUDA corpus program), with
    /// `{duration_s}` replaced by how long it must run; the simulator runs `workload`.
    #[serde(default)]
    pub guest: Option<String>,
}

/// A VM's virtual CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuSpec {
    /// Number of vCPUs (cores it can use at once).
    #[serde(default = "one")]
    pub vcpus: u32,
    /// CPU weight, cgroup v2 scale 1-10000 (Pegasus's CPU credits).
    #[serde(default = "default_cpu_weight")]
    pub weight: u32,
}

impl Default for CpuSpec {
    fn default() -> Self {
        CpuSpec {
            vcpus: 1,
            weight: default_cpu_weight(),
        }
    }
}

/// A workload with its activity window and cost jitter.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Workload {
    /// The workload's shape.
    #[serde(flatten)]
    pub shape: Shape,
    /// When it starts issuing work.
    #[serde(default)]
    pub start_ms: u64,
    /// When it stops issuing new work (work in flight still finishes); default never.
    #[serde(default)]
    pub stop_ms: Option<u64>,
    /// Costs vary uniformly by +- this fraction (0 to 1).
    #[serde(default)]
    pub jitter: f64,
}

/// The shapes of guest workloads (DESIGN §6). Costs are in microseconds.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Shape {
    /// Keeps `depth` groups of `cost_us` outstanding, back to back (TimeGraph's Clearspd).
    Bomb {
        /// GPU cost of each group.
        cost_us: u64,
        /// Groups kept outstanding.
        #[serde(default = "one")]
        depth: u32,
    },
    /// Submits a group of `cost_us` every `period_us` (a widget, a video player).
    Periodic {
        /// GPU cost of each group.
        cost_us: u64,
        /// Period between submissions.
        period_us: u64,
    },
    /// A game: per frame `cpu_us` of CPU, `groups` groups of `cost_us`, a frame boundary, the
    /// present (when the scheduler releases it) and its group of `present_us`.
    Frames {
        /// CPU time per frame.
        #[serde(default)]
        cpu_us: u64,
        /// Rendering groups per frame.
        #[serde(default = "one")]
        groups: u32,
        /// GPU cost of each rendering group.
        cost_us: u64,
        /// GPU cost of the present group.
        #[serde(default)]
        present_us: u64,
    },
    /// LoGA's Throttle: a kernel of `kernel_us`, then sleep `sleep_us`; load N/(N+M).
    Throttle {
        /// GPU cost of the kernel.
        kernel_us: u64,
        /// Sleep after each kernel.
        sleep_us: u64,
    },
    /// CPU/GPU coupled (BlackScholes-like): `cpu_us` of CPU, then a blocking GPU call of
    /// `cost_us`, repeated.
    Coupled {
        /// CPU time per iteration.
        cpu_us: u64,
        /// GPU cost per iteration.
        cost_us: u64,
        /// How the guest waits for its GPU call.
        #[serde(default)]
        wait: Wait,
    },
}

/// How a guest waits for a blocking GPU call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Wait {
    /// It sleeps: its vCPU is not runnable until the call returns.
    #[default]
    Block,
    /// It polls (CUDA's default spin-wait): its vCPU stays runnable, uses CPU time and
    /// competes for the host cores until the call returns.
    Spin,
}

/// One run: the policy and the per-run changes to the scenario's VMs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSpec {
    /// The run's label in tables and plots.
    pub label: String,
    /// What the paper reports for this run (its figure and values), for side-by-side tables.
    #[serde(default)]
    pub paper: Option<String>,
    /// The policy (`policy = "none"` plus the family's fields).
    pub policy: PolicyConfig,
    /// The VMs in this run (names of `[[vm]]` entries); default all.
    #[serde(default)]
    pub vms: Option<Vec<String>>,
    /// Per-VM overrides of vGPU parameters.
    #[serde(default)]
    pub params: BTreeMap<String, ParamsOverride>,
    /// Per-VM overrides of the CPU weight.
    #[serde(default)]
    pub cpu_weight: BTreeMap<String, u32>,
    /// Per-VM overrides of the instance count.
    #[serde(default)]
    pub instances: BTreeMap<String, u32>,
    /// Overrides the scenario's `cpu_writeback`.
    #[serde(default)]
    pub cpu_writeback: Option<bool>,
    /// Overrides the scenario's `capacity`.
    #[serde(default)]
    pub capacity: Option<usize>,
    /// Overrides the scenario's `context_switch_us`.
    #[serde(default)]
    pub context_switch_us: Option<u64>,
    /// Overrides the scenario's `grant_latency_us`.
    #[serde(default)]
    pub grant_latency_us: Option<u64>,
    /// Overrides the scenario's `cpus`.
    #[serde(default)]
    pub cpus: Option<u32>,
    /// Overrides how every `coupled` workload waits for its GPU calls.
    #[serde(default)]
    pub wait: Option<Wait>,
}

/// One VM of a run: an instance of a `[[vm]]` entry with the run's overrides applied.
#[derive(Debug, Clone)]
pub struct RunVm<'a> {
    /// Its name: the entry's, or `name-1` .. `name-N` for several instances.
    pub name: String,
    /// The entry it is an instance of.
    pub spec: &'a VmSpec,
    /// Its vGPU parameters in force (named `name`).
    pub params: VgpuParams,
    /// Its CPU weight in force.
    pub cpu_weight: u32,
}

impl Scenario {
    /// The VMs of `run`: its subset of the scenario's VMs, instances expanded, with the run's
    /// parameter, CPU weight and instance overrides applied (validated by `sim::run`).
    pub fn run_vms<'a>(&'a self, run: &RunSpec) -> Vec<RunVm<'a>> {
        let mut out = Vec::new();
        for spec in &self.vm {
            if run.vms.as_ref().is_some_and(|v| !v.contains(&spec.name)) {
                continue;
            }
            let count = run
                .instances
                .get(&spec.name)
                .copied()
                .unwrap_or(spec.instances);
            let cpu_weight = run
                .cpu_weight
                .get(&spec.name)
                .copied()
                .unwrap_or(spec.cpu.weight);
            let mut params = spec.params.clone();
            if let Some(o) = run.params.get(&spec.name) {
                o.apply(&mut params);
            }
            for k in 1..=count {
                let name = match count {
                    1 => spec.name.clone(),
                    _ => format!("{}-{k}", spec.name),
                };
                out.push(RunVm {
                    params: VgpuParams {
                        name: name.clone(),
                        ..params.clone()
                    },
                    name,
                    spec,
                    cpu_weight,
                });
            }
        }
        out
    }
}

/// The vGPU parameters a run may change; absent fields keep the VM's value.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamsOverride {
    /// GPU priority.
    pub priority: Option<u32>,
    /// TimeGraph priority policy.
    pub sched: Option<PrioPolicy>,
    /// TimeGraph reservation.
    pub reserve: Option<Reserve>,
    /// Weight (credits, share).
    pub weight: Option<u32>,
    /// Pegasus SLO: GPU time per second, ns.
    pub slo: Option<Nanos>,
    /// VGRIS target frame rate.
    pub target_fps: Option<f64>,
}

impl ParamsOverride {
    /// Applies the fields that are set to `p`.
    pub fn apply(&self, p: &mut VgpuParams) {
        if let Some(v) = self.priority {
            p.priority = v;
        }
        if let Some(v) = self.sched {
            p.sched = Some(v);
        }
        if let Some(v) = &self.reserve {
            p.reserve = Some(v.clone());
        }
        if let Some(v) = self.weight {
            p.weight = v;
        }
        if let Some(v) = self.slo {
            p.slo = Some(v);
        }
        if let Some(v) = self.target_fps {
            p.target_fps = Some(v);
        }
    }
}
