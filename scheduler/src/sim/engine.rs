//! The simulated GPU: one non-preemptive engine that runs dispatched groups one at a time in
//! dispatch order, each for its cost, plus a context-switch cost when the next group belongs
//! to another (vGPU, context) than the previous one.
//!
//! Public so that the scheduler daemon runs the synthetic load groups of its devices on the same
//! engine model as the simulator.

use std::collections::VecDeque;

use crate::model::{GroupId, Nanos, Time, VgpuId};

/// A dispatched group waiting for or running on the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Job {
    /// The caller's tag for the job's owner, handed back when it finishes: the simulator uses
    /// the VM's index, the daemon its connection id.
    pub owner: u64,
    /// Its vGPU.
    pub vgpu: VgpuId,
    /// The group.
    pub group: GroupId,
    /// Its GPU context.
    pub context: u32,
    /// Its cost on the engine.
    pub cost: Nanos,
    /// When the workload submitted it.
    pub submitted: Time,
}

/// The engine's state.
#[derive(Debug, Clone)]
pub struct Engine {
    switch_cost: Nanos,
    fifo: VecDeque<Job>,
    running: Option<(Job, Time, Time)>,
    last: Option<(VgpuId, u32)>,
    /// Context switches so far.
    pub switches: u64,
    /// Busy time of finished jobs.
    pub busy: Nanos,
}

impl Engine {
    /// An idle engine that charges `switch_cost` per context switch.
    pub fn new(switch_cost: Nanos) -> Self {
        Engine {
            switch_cost,
            fifo: VecDeque::new(),
            running: None,
            last: None,
            switches: 0,
            busy: 0,
        }
    }

    /// Queues a dispatched group behind those already dispatched.
    pub fn push(&mut self, job: Job) {
        self.fifo.push_back(job);
    }

    /// Starts the next job if the engine is idle; returns when it will finish.
    pub fn kick(&mut self, now: Time) -> Option<Time> {
        if self.running.is_some() {
            return None;
        }
        let job = self.fifo.pop_front()?;
        let here = (job.vgpu, job.context);
        let mut cost = job.cost;
        if self.last.is_some_and(|prev| prev != here) {
            self.switches = self.switches.saturating_add(1);
            cost = cost.saturating_add(self.switch_cost);
        }
        self.last = Some(here);
        let finish = now.saturating_add(cost);
        self.running = Some((job, now, finish));
        Some(finish)
    }

    /// The running job finished: returns it with its start and finish times.
    pub fn finish(&mut self) -> Option<(Job, Time, Time)> {
        let done = self.running.take()?;
        self.busy = self.busy.saturating_add(done.2.saturating_sub(done.1));
        Some(done)
    }

    /// Drops the jobs of `owner` that wait behind the running one (its owner went away); a
    /// running job is left to finish, since the engine is non-preemptive. Returns how many were
    /// dropped.
    pub fn discard_queued(&mut self, owner: u64) -> usize {
        let before = self.fifo.len();
        self.fifo.retain(|j| j.owner != owner);
        before.saturating_sub(self.fifo.len())
    }

    /// Busy time up to `end`, counting the part of a running job before it.
    pub fn busy_until(&self, end: Time) -> Nanos {
        let partial = self
            .running
            .map_or(0, |(_, start, _)| end.saturating_sub(start));
        self.busy.saturating_add(partial)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(vm: u32, id: u64, cost: Nanos) -> Job {
        Job {
            owner: u64::from(vm),
            vgpu: VgpuId(vm),
            group: GroupId(id),
            context: 0,
            cost,
            submitted: 0,
        }
    }

    #[test]
    fn jobs_run_in_dispatch_order_and_switches_cost_time() {
        let mut e = Engine::new(50);
        e.push(job(0, 1, 100));
        e.push(job(0, 2, 100));
        e.push(job(1, 3, 100));
        assert_eq!(e.kick(0), Some(100));
        assert_eq!(e.kick(10), None, "non-preemptive: one job at a time");
        assert_eq!(e.finish().map(|d| d.0.group), Some(GroupId(1)));
        assert_eq!(e.kick(100), Some(200), "same vGPU and context: no switch");
        e.finish();
        assert_eq!(e.kick(200), Some(350), "another vGPU: switch cost added");
        assert_eq!(e.busy_until(300), 300);
        let (j, start, finish) = e.finish().unwrap();
        assert_eq!((j.group, start, finish), (GroupId(3), 200, 350));
        assert_eq!((e.switches, e.busy), (1, 350));
        assert_eq!(e.kick(400), None);
    }

    #[test]
    fn discarding_drops_only_the_owners_waiting_jobs() {
        let mut e = Engine::new(0);
        e.push(job(0, 1, 100));
        e.push(job(0, 2, 100));
        e.push(job(1, 3, 100));
        assert_eq!(e.kick(0), Some(100));
        assert_eq!(e.discard_queued(0), 1, "the running job stays");
        assert_eq!(e.finish().map(|d| d.0.group), Some(GroupId(1)));
        e.kick(100);
        assert_eq!(e.finish().map(|d| d.0.group), Some(GroupId(3)));
        assert_eq!(e.discard_queued(7), 0);
    }
}
