//! One executor thread per VM: the VM's compute backend lives on it and every call runs there,
//! in the order sent (the real driver's contexts are bound to threads; the CPU backend keeps a
//! VM's kernels off the device's worker). Callers wait a bounded time: a call the thread does
//! not answer in time is a `LaunchTimeout` for the caller, and a full queue refuses at once.
//! A work group (launches and copies ending in a synchronisation) reports when it started and
//! finished on the executor, the `Completed{start, finish}` the scheduler accounts.

use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::warn;

use super::{ComputeBackend, ComputeError, ComputeResult};

/// Calls queued on one executor before new ones are refused.
pub const MAX_QUEUED_CALLS: usize = 256;

type Job = Box<dyn FnOnce(&mut dyn ComputeBackend) + Send>;

/// When a work group ran on the executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupTiming {
    pub start: Instant,
    pub finish: Instant,
}

/// The executor thread of one VM.
#[derive(Debug)]
pub struct Executor {
    jobs: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Executor {
    /// Starts the thread `name` owning `backend`.
    pub fn spawn(name: &str, mut backend: Box<dyn ComputeBackend>) -> ComputeResult<Executor> {
        let (tx, rx) = mpsc::sync_channel::<Job>(MAX_QUEUED_CALLS);
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    job(backend.as_mut());
                }
            })
            .map_err(|e| ComputeError::OutOfMemory(format!("executor thread: {e}")))?;
        Ok(Executor {
            jobs: Some(tx),
            thread: Some(thread),
        })
    }

    /// Runs `call` on the executor and waits at most `timeout` for its answer.
    pub fn call<T: Send + 'static>(
        &self,
        timeout: Duration,
        call: impl FnOnce(&mut dyn ComputeBackend) -> ComputeResult<T> + Send + 'static,
    ) -> ComputeResult<T> {
        let (reply, answer) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |be| {
            // The caller may have given up waiting; then the answer is dropped.
            let _ = reply.send(call(be));
        });
        let jobs = self.jobs.as_ref().expect("jobs until drop");
        match jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return Err(ComputeError::OutOfMemory(format!(
                    "{MAX_QUEUED_CALLS} calls queued"
                )));
            }
            Err(TrySendError::Disconnected(_)) => {
                return Err(ComputeError::NoDevice("the executor thread is gone".into()));
            }
        }
        match answer.recv_timeout(timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => {
                warn!("compute call unanswered after {timeout:?}");
                Err(ComputeError::LaunchTimeout(format!(
                    "no answer within {timeout:?}"
                )))
            }
            Err(RecvTimeoutError::Disconnected) => Err(ComputeError::NoDevice(
                "the executor thread ended during the call".into(),
            )),
        }
    }

    /// Runs a work group (`group` should end by synchronising what it queued) and reports when
    /// it started and finished on the executor.
    pub fn group<T: Send + 'static>(
        &self,
        timeout: Duration,
        group: impl FnOnce(&mut dyn ComputeBackend) -> ComputeResult<T> + Send + 'static,
    ) -> ComputeResult<(T, GroupTiming)> {
        self.call(timeout, move |be| {
            let start = Instant::now();
            let value = group(be)?;
            Ok((
                value,
                GroupTiming {
                    start,
                    finish: Instant::now(),
                },
            ))
        })
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the calls already queued.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::backend::DEFAULT_STREAM;
    use crate::compute::{CpuBackend, CpuConfig};

    const SPIN: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
        .visible .entry spin() { $L: bra $L; }\n";

    #[test]
    fn calls_run_in_order_on_the_thread_and_groups_are_timed() {
        let ex = Executor::spawn(
            "vgpu-compute-test",
            Box::new(CpuBackend::new(CpuConfig::default())),
        )
        .unwrap();
        let t = Duration::from_secs(10);
        let ctx = ex.call(t, |be| be.context_create()).unwrap();
        let addr = ex.call(t, move |be| be.mem_alloc(ctx, 64)).unwrap();
        let ((), timing) = ex
            .group(t, move |be| {
                be.copy_htod(ctx, addr, &[9; 64], DEFAULT_STREAM)?;
                be.context_synchronize(ctx)
            })
            .unwrap();
        assert!(timing.finish >= timing.start);
        let back = ex
            .call(t, move |be| {
                let mut v = vec![0; 64];
                be.copy_dtoh(ctx, &mut v, addr, DEFAULT_STREAM)?;
                Ok(v)
            })
            .unwrap();
        assert_eq!(back, vec![9; 64]);
        assert!(ex.call(t, move |be| be.mem_free(ctx, addr + 1)).is_err());
    }

    #[test]
    fn a_call_that_does_not_answer_in_time_is_a_timeout_for_the_caller() {
        let config = CpuConfig {
            instruction_budget: 40_000_000,
            threads: 1,
            ..CpuConfig::default()
        };
        let ex = Executor::spawn("vgpu-compute-test", Box::new(CpuBackend::new(config))).unwrap();
        let t = Duration::from_secs(10);
        let ctx = ex.call(t, |be| be.context_create()).unwrap();
        let module = ex
            .call(t, move |be| be.module_load(ctx, SPIN.as_bytes()))
            .unwrap();
        let (f, _) = ex
            .call(t, move |be| be.function(ctx, module, "spin"))
            .unwrap();
        let start = Instant::now();
        let err = ex
            .call(Duration::from_millis(20), move |be| {
                let l = crate::compute::backend::KernelLaunch {
                    function: f,
                    grid: [64, 1, 1],
                    block: [32, 1, 1],
                    shared_bytes: 0,
                    stream: DEFAULT_STREAM,
                    params: &[],
                };
                be.launch(ctx, &l)
            })
            .unwrap_err();
        assert!(matches!(err, ComputeError::LaunchTimeout(_)), "{err:?}");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the caller did not wait for the kernel"
        );
        // The kernel ends at its instruction budget; the executor then answers again, and the
        // context is broken by the timeout.
        let again = ex
            .call(Duration::from_secs(60), move |be| {
                be.context_synchronize(ctx)
            })
            .unwrap_err();
        assert!(matches!(again, ComputeError::ContextBroken(_)), "{again:?}");
    }
}
