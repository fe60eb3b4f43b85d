//! The host CPU model: `cpus` cores shared by the VMs' vCPUs in proportion to their CPU
//! weights, CFS-like. Every quantum the runnable VMs with the least weighted CPU time
//! (virtual runtime) get the cores, up to their vCPU count each; a VM that becomes runnable
//! between quanta takes a core that is idle. A VM is runnable while its workload is in a CPU
//! phase or spins waiting for the GPU; a phase progresses only while the VM holds cores.

use crate::model::{CpuHint, Nanos, Time};

/// Lowest and highest CPU weight (cgroup v2 `cpu.weight`).
pub(crate) const WEIGHT_RANGE: (u32, u32) = (1, 10_000);
/// The weight whose virtual runtime advances at the speed of real time.
const NICE0_WEIGHT: u128 = 100;

#[derive(Debug, Clone)]
struct CpuVm {
    weight: u32,
    vcpus: u32,
    runnable: bool,
    cores: u32,
    since: Time,
    remaining: Nanos,
    vruntime: u128,
    usage: Nanos,
    epoch: u64,
    hinted: Option<(bool, bool, u32)>,
}

/// The CPU model's state.
#[derive(Debug, Clone)]
pub(crate) struct Cpu {
    cores: u32,
    free: u32,
    vms: Vec<CpuVm>,
    order: Vec<usize>,
}

impl Cpu {
    /// A host with `cores` cores and one entry per VM: (vcpus, weight).
    pub(crate) fn new(cores: u32, vms: &[(u32, u32)]) -> Self {
        let cores = cores.max(1);
        Cpu {
            cores,
            free: cores,
            vms: vms
                .iter()
                .map(|&(vcpus, weight)| CpuVm {
                    weight: weight.clamp(WEIGHT_RANGE.0, WEIGHT_RANGE.1),
                    vcpus: vcpus.max(1),
                    runnable: false,
                    cores: 0,
                    since: 0,
                    remaining: 0,
                    vruntime: 0,
                    usage: 0,
                    epoch: 0,
                    hinted: None,
                })
                .collect(),
            order: (0..vms.len()).collect(),
        }
    }

    /// Whether any VM is runnable (the quantum tick is needed).
    pub(crate) fn busy(&self) -> bool {
        self.vms.iter().any(|v| v.runnable)
    }

    /// The VM's cumulative CPU time up to `now`.
    pub(crate) fn usage(&self, vm: usize, now: Time) -> Nanos {
        self.vms.get(vm).map_or(0, |v| {
            let ran = now
                .saturating_sub(v.since)
                .saturating_mul(u64::from(v.cores));
            v.usage.saturating_add(ran)
        })
    }

    /// The hint for the VM at `now`.
    pub(crate) fn hint(&self, vm: usize, now: Time) -> CpuHint {
        let v = self.vms.get(vm);
        CpuHint {
            weight: v.map_or(0, |v| v.weight),
            running: v.is_some_and(|v| v.cores > 0),
            runnable: v.is_some_and(|v| v.runnable),
            usage: self.usage(vm, now),
        }
    }

    /// Whether the VM's hint differs from the last one sent; records it as sent.
    pub(crate) fn take_changed(&mut self, vm: usize) -> bool {
        let Some(v) = self.vms.get_mut(vm) else {
            return false;
        };
        let now = (v.cores > 0, v.runnable, v.weight);
        let changed = v.hinted != Some(now);
        v.hinted = Some(now);
        changed
    }

    /// Sets a VM's weight (clamped to the cgroup range).
    pub(crate) fn set_weight(&mut self, vm: usize, weight: u32, now: Time) {
        self.settle(vm, now);
        if let Some(v) = self.vms.get_mut(vm) {
            v.weight = weight.clamp(WEIGHT_RANGE.0, WEIGHT_RANGE.1);
        }
    }

    /// Credits the CPU time the VM used since it last was settled.
    fn settle(&mut self, vm: usize, now: Time) {
        let Some(v) = self.vms.get_mut(vm) else {
            return;
        };
        let used = now
            .saturating_sub(v.since)
            .saturating_mul(u64::from(v.cores));
        v.since = now;
        v.usage = v.usage.saturating_add(used);
        v.remaining = v.remaining.saturating_sub(used);
        v.vruntime = v
            .vruntime
            .saturating_add(u128::from(used) * NICE0_WEIGHT / u128::from(v.weight));
    }

    /// The VM starts a CPU phase of `work`; it takes idle cores at once. A VM that is still
    /// runnable (it spun while it waited) keeps its cores and its virtual runtime.
    pub(crate) fn start_phase(&mut self, vm: usize, work: Nanos, now: Time) {
        let floor = self.min_vruntime(vm);
        let Some(runnable) = self.vms.get(vm).map(|v| v.runnable) else {
            return;
        };
        if runnable {
            self.settle(vm, now);
        }
        let Some(v) = self.vms.get_mut(vm) else {
            return;
        };
        v.remaining = work;
        if runnable {
            // The old phase's completion event is stale now.
            v.epoch = v.epoch.wrapping_add(1);
        } else {
            v.runnable = true;
            // A VM that slept does not bank CPU time (CFS places wakers at the minimum).
            v.vruntime = v.vruntime.max(floor);
        }
        self.fill(now);
    }

    /// The VM spins until [`Cpu::stop`] or the next [`Cpu::start_phase`]: runnable, using
    /// the cores it gets, with no end of its own.
    pub(crate) fn spin(&mut self, vm: usize, now: Time) {
        self.start_phase(vm, Nanos::MAX, now);
    }

    /// The VM stops being runnable: it releases its cores and idle cores go to waiting VMs.
    pub(crate) fn stop(&mut self, vm: usize, now: Time) {
        if self.vms.get(vm).is_none_or(|v| !v.runnable) {
            return;
        }
        self.settle(vm, now);
        let Some(v) = self.vms.get_mut(vm) else {
            return;
        };
        v.runnable = false;
        self.free = self.free.saturating_add(v.cores).min(self.cores);
        v.cores = 0;
        v.epoch = v.epoch.wrapping_add(1);
        self.fill(now);
    }

    fn min_vruntime(&self, except: usize) -> u128 {
        let others = self
            .vms
            .iter()
            .enumerate()
            .filter(|&(i, v)| i != except && v.runnable);
        others.map(|(_, v)| v.vruntime).min().unwrap_or(0)
    }

    /// Whether the VM's CPU phase has ended (its completion event fired and is not stale).
    /// The VM stays runnable and keeps its cores: the caller stops it or starts its next
    /// phase (a spinning wait).
    pub(crate) fn phase_ended(&mut self, vm: usize, epoch: u64, now: Time) -> bool {
        if self
            .vms
            .get(vm)
            .is_none_or(|v| v.epoch != epoch || !v.runnable)
        {
            return false;
        }
        self.settle(vm, now);
        self.vms.get(vm).is_some_and(|v| v.remaining == 0)
    }

    /// A quantum boundary: all cores are handed out afresh by virtual runtime.
    pub(crate) fn tick(&mut self, now: Time) {
        for vm in 0..self.vms.len() {
            self.settle(vm, now);
        }
        for v in &mut self.vms {
            if v.cores > 0 {
                v.cores = 0;
                v.epoch = v.epoch.wrapping_add(1);
            }
        }
        self.free = self.cores;
        self.fill(now);
    }

    /// Gives idle cores to runnable VMs, least virtual runtime first: one core each to those
    /// without one, then more up to their vCPU counts.
    fn fill(&mut self, now: Time) {
        if self.free == 0 {
            return;
        }
        let vms = &self.vms;
        self.order
            .sort_unstable_by_key(|&i| (vms.get(i).map_or(0, |v| v.vruntime), i));
        for first_pass in [true, false] {
            for k in 0..self.order.len() {
                let i = self.order[k];
                let Some(v) = self.vms.get(i) else { continue };
                let want = if first_pass {
                    u32::from(v.cores == 0)
                } else {
                    v.vcpus.saturating_sub(v.cores)
                };
                let give = want.min(self.free);
                if !v.runnable || give == 0 {
                    continue;
                }
                self.settle(i, now);
                if let Some(v) = self.vms.get_mut(i) {
                    v.cores += give;
                    v.epoch = v.epoch.wrapping_add(1);
                    self.free -= give;
                }
            }
        }
    }

    /// When each running VM's phase ends at its current cores, with the epoch to check it
    /// against; only those ending by `before`.
    pub(crate) fn endings(&self, now: Time, before: Time, out: &mut Vec<(usize, u64, Time)>) {
        out.clear();
        for (i, v) in self.vms.iter().enumerate() {
            if v.cores == 0 || !v.runnable {
                continue;
            }
            let done = v.since.max(now).saturating_add(
                v.remaining
                    .saturating_sub(
                        now.saturating_sub(v.since)
                            .saturating_mul(u64::from(v.cores)),
                    )
                    .div_ceil(u64::from(v.cores)),
            );
            if done <= before {
                out.push((i, v.epoch, done));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs every VM permanently runnable for `ticks` quanta of `q`.
    fn contend(cpu: &mut Cpu, n: usize, ticks: u64, q: u64) {
        for vm in 0..n {
            cpu.start_phase(vm, u64::MAX, 0);
        }
        for t in 1..=ticks {
            cpu.tick(t * q);
        }
    }

    #[test]
    fn cpu_time_is_shared_in_proportion_to_weight() {
        let mut cpu = Cpu::new(1, &[(1, 100), (1, 300)]);
        contend(&mut cpu, 2, 1000, 1_000_000);
        let (a, b) = (cpu.usage(0, 1_000_000_000), cpu.usage(1, 1_000_000_000));
        assert_eq!(a + b, 1_000_000_000);
        let ratio = b as f64 / a as f64;
        assert!((ratio - 3.0).abs() < 0.05, "ratio {ratio}");
    }

    #[test]
    fn vcpus_bound_what_a_vm_gets_and_cores_are_not_left_idle() {
        // 4 cores, a 1-vCPU VM with a huge weight and a 4-vCPU VM: the first cannot use more
        // than one core, the second gets the other three.
        let mut cpu = Cpu::new(4, &[(1, 10_000), (4, 1)]);
        contend(&mut cpu, 2, 100, 1_000_000);
        assert_eq!(cpu.usage(0, 100_000_000), 100_000_000);
        assert_eq!(cpu.usage(1, 100_000_000), 300_000_000);
    }

    #[test]
    fn a_phase_ends_after_its_work_and_frees_the_core() {
        let mut cpu = Cpu::new(1, &[(1, 100), (1, 100)]);
        cpu.start_phase(0, 300_000, 0);
        cpu.start_phase(1, 300_000, 0);
        assert!(cpu.hint(0, 0).running && !cpu.hint(1, 0).running);
        assert!(cpu.hint(1, 0).runnable);
        let mut ends = Vec::new();
        cpu.endings(0, 1_000_000, &mut ends);
        assert_eq!(ends, vec![(0, ends[0].1, 300_000)]);
        assert!(!cpu.phase_ended(0, ends[0].1.wrapping_add(1), 300_000));
        assert!(cpu.phase_ended(0, ends[0].1, 300_000));
        cpu.stop(0, 300_000);
        assert!(cpu.hint(1, 300_000).running);
        cpu.endings(300_000, 1_000_000, &mut ends);
        assert_eq!(ends[0].2, 600_000);
        assert_eq!(cpu.usage(0, 900_000), 300_000);
    }

    #[test]
    fn a_spinning_vm_keeps_its_core_and_stays_runnable_until_stopped() {
        let mut cpu = Cpu::new(1, &[(1, 100), (1, 100)]);
        cpu.start_phase(0, 300_000, 0);
        let mut ends = Vec::new();
        cpu.endings(0, 1_000_000, &mut ends);
        assert!(cpu.phase_ended(0, ends[0].1, 300_000));
        // It spins: the other VM, waking now, finds no idle core.
        cpu.spin(0, 300_000);
        cpu.start_phase(1, 300_000, 400_000);
        let h = cpu.hint(0, 400_000);
        assert!(h.running && h.runnable && h.usage == 400_000);
        assert!(!cpu.hint(1, 400_000).running && cpu.hint(1, 400_000).runnable);
        // A spin never ends by itself.
        cpu.endings(400_000, 1_000_000_000_000, &mut ends);
        assert!(ends.is_empty());
        // Its next phase starts on the core it holds.
        cpu.start_phase(0, 100_000, 500_000);
        cpu.endings(500_000, 1_000_000, &mut ends);
        assert_eq!(
            ends.iter().map(|e| (e.0, e.2)).collect::<Vec<_>>(),
            [(0, 600_000)]
        );
        // Stopped, it frees the core for the waiting VM.
        cpu.stop(0, 550_000);
        assert!(!cpu.hint(0, 550_000).runnable);
        assert!(cpu.hint(1, 550_000).running);
        assert_eq!(cpu.usage(0, 900_000), 550_000);
    }
}
