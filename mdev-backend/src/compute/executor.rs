//! One executor thread per VM: it owns the VM's [`ComputeBackend`] (created on the thread, so
//! a driver backend makes every driver call from it) and runs requests sent over a bounded
//! channel, one at a time, in order.
//!
//! Every wait is bounded: a request not answered within [`ExecutorConfig::timeout`] returns
//! [`ComputeError::LaunchTimeout`] to its caller and marks its context broken here (later calls
//! for it answer [`ComputeError::ContextBroken`] without reaching the backend, until it is
//! destroyed). A request still queued behind such a call when its own time runs out is not
//! run at all and answers [`ComputeError::Busy`], leaving its context intact.
//!
//! [`Executor::group`] runs a work group (a launch, a copy, or a batch) between two events on
//! its stream and reports a [`GroupDone`] with the group's `start` and `finish` to the
//! completion callback, which the device forwards to the scheduler as `Completed`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::backend::{ComputeBackend, ContextId, StreamId};
use super::{ComputeError, ComputeResult};

/// Requests queued to one executor thread at most.
pub const QUEUE_DEPTH: usize = 64;

/// Settings of an executor thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutorConfig {
    /// Longest wait for one request's answer (and for the backend's creation).
    pub timeout: Duration,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig {
            timeout: Duration::from_secs(10),
        }
    }
}

/// A finished work group: when it ran on the device and how it ended.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupDone {
    /// The caller's tag of the group (its scheduler group id).
    pub tag: u64,
    pub start: Instant,
    pub finish: Instant,
    pub result: ComputeResult<()>,
}

/// Where finished groups are reported, on the executor thread.
pub type CompletionSink = Box<dyn FnMut(GroupDone) + Send>;

type Job = Box<dyn FnOnce(&mut dyn ComputeBackend, &mut CompletionSink) + Send>;

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const CANCELLED: u8 = 2;

/// The executor thread of one VM and the sending side of its queue.
pub struct Executor {
    tx: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
    config: ExecutorConfig,
    /// Contexts whose calls did not finish in time, with why.
    broken: Arc<Mutex<HashMap<ContextId, String>>>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Executor {
    /// Starts the thread, creates the backend on it with `make`, and returns once it exists
    /// (or with `make`'s error).
    pub fn spawn(
        name: &str,
        config: ExecutorConfig,
        make: impl FnOnce() -> ComputeResult<Box<dyn ComputeBackend>> + Send + 'static,
        mut sink: CompletionSink,
    ) -> ComputeResult<Executor> {
        let (tx, rx) = sync_channel::<Job>(QUEUE_DEPTH);
        let (ready_tx, ready_rx) = sync_channel(1);
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let mut backend = match make() {
                    Ok(b) => {
                        let _ = ready_tx.send(Ok(()));
                        b
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                serve(&rx, backend.as_mut(), &mut sink);
            })
            .map_err(|e| ComputeError::NoDevice(format!("executor thread: {e}")))?;
        match ready_rx.recv_timeout(config.timeout) {
            Ok(Ok(())) => Ok(Executor {
                tx: Some(tx),
                thread: Some(thread),
                config,
                broken: Arc::default(),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(ComputeError::NoDevice(format!(
                "backend not ready within {:?}",
                config.timeout
            ))),
        }
    }

    fn broken(&self) -> std::sync::MutexGuard<'_, HashMap<ContextId, String>> {
        self.broken.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the executor thread and waits (bounded) for its answer. `ctx` is the
    /// context the call is for (`None`: none, e.g. creating one).
    pub fn call<R: Send + 'static>(
        &self,
        ctx: Option<ContextId>,
        f: impl FnOnce(&mut dyn ComputeBackend) -> ComputeResult<R> + Send + 'static,
    ) -> ComputeResult<R> {
        self.submit(ctx, move |b, _| f(b))
    }

    /// Runs a work group on `stream` of `ctx`: `ops` between two events, then waits for the
    /// second. The group's [`GroupDone`] goes to the completion callback (also when it fails,
    /// so a scheduler never waits for it); its result is also returned to the caller.
    pub fn group<R: Send + 'static>(
        &self,
        ctx: ContextId,
        stream: StreamId,
        tag: u64,
        ops: impl FnOnce(&mut dyn ComputeBackend) -> ComputeResult<R> + Send + 'static,
    ) -> ComputeResult<R> {
        self.submit(Some(ctx), move |b, sink| {
            let began = Instant::now();
            let (r, elapsed) = timed(b, ctx, stream, ops);
            let finish = Instant::now();
            // Device time from the events; host time where the events could not be used.
            let start = elapsed
                .and_then(|d| finish.checked_sub(d))
                .map_or(began, |s| s.max(began));
            sink(GroupDone {
                tag,
                start,
                finish,
                result: r.as_ref().map(|_| ()).map_err(Clone::clone),
            });
            r
        })
    }

    /// Destroys a context on the backend and forgets that it was broken here.
    pub fn context_destroy(&self, ctx: ContextId) -> ComputeResult<()> {
        let r = self.submit(None, move |b, _| b.context_destroy(ctx));
        if r.is_ok() {
            self.broken().remove(&ctx);
        }
        r
    }

    /// Queues `f` to run on the executor thread and returns at once; `f` reports its own
    /// result (a device posts a guest's request and learns of its end from `f`). `Busy` when
    /// [`QUEUE_DEPTH`] jobs wait: the caller never blocks on the executor.
    pub fn post(
        &self,
        f: impl FnOnce(&mut dyn ComputeBackend) + Send + 'static,
    ) -> ComputeResult<()> {
        self.enqueue(Box::new(move |b, _| f(b)))
    }

    fn enqueue(&self, job: Job) -> ComputeResult<()> {
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| ComputeError::NoDevice("executor stopped".into()))?;
        match tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                Err(ComputeError::Busy(format!("{QUEUE_DEPTH} requests queued")))
            }
            Err(TrySendError::Disconnected(_)) => {
                Err(ComputeError::NoDevice("executor thread gone".into()))
            }
        }
    }

    fn submit<R: Send + 'static>(
        &self,
        ctx: Option<ContextId>,
        f: impl FnOnce(&mut dyn ComputeBackend, &mut CompletionSink) -> ComputeResult<R>
        + Send
        + 'static,
    ) -> ComputeResult<R> {
        if let Some(why) = ctx.and_then(|c| self.broken().get(&c).cloned()) {
            return Err(ComputeError::ContextBroken(why));
        }
        let state = Arc::new(AtomicU8::new(QUEUED));
        let (reply_tx, reply_rx) = sync_channel(1);
        let job_state = Arc::clone(&state);
        let job: Job = Box::new(move |b, sink| {
            if job_state
                .compare_exchange(QUEUED, RUNNING, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                let _ = reply_tx.send(f(b, sink));
            }
        });
        self.enqueue(job)?;
        match reply_rx.recv_timeout(self.config.timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Disconnected) => {
                Err(ComputeError::NoDevice("executor thread gone".into()))
            }
            Err(RecvTimeoutError::Timeout) => {
                if state
                    .compare_exchange(QUEUED, CANCELLED, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return Err(ComputeError::Busy(format!(
                        "not started within {:?}",
                        self.config.timeout
                    )));
                }
                let why = format!("call not finished within {:?}", self.config.timeout);
                if let Some(c) = ctx {
                    log::warn!("compute context {}: {why}; the context is broken", c.0);
                    self.broken().insert(c, why.clone());
                }
                Err(ComputeError::LaunchTimeout(why))
            }
        }
    }
}

/// Runs `ops` between two events on `stream`; returns its result and the events' elapsed
/// time when they could be recorded.
fn timed<R>(
    b: &mut dyn ComputeBackend,
    ctx: ContextId,
    stream: StreamId,
    ops: impl FnOnce(&mut dyn ComputeBackend) -> ComputeResult<R>,
) -> (ComputeResult<R>, Option<Duration>) {
    let events = b.event_create(ctx).and_then(|s| match b.event_create(ctx) {
        Ok(e) => Ok((s, e)),
        Err(err) => {
            let _ = b.event_destroy(ctx, s);
            Err(err)
        }
    });
    let (s, e) = match events {
        Ok(pair) => pair,
        Err(err) => return (Err(err), None),
    };
    let r = b
        .event_record(ctx, s, stream)
        .and_then(|()| ops(&mut *b))
        .and_then(|v| {
            b.event_record(ctx, e, stream)?;
            b.event_synchronize(ctx, e)?;
            Ok(v)
        });
    let elapsed = r
        .as_ref()
        .ok()
        .and_then(|_| b.event_elapsed_ms(ctx, s, e).ok())
        .map(|ms| Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3));
    // A broken context answers these with ContextBroken; its events go with it.
    let _ = b.event_destroy(ctx, s);
    let _ = b.event_destroy(ctx, e);
    (r, elapsed)
}

fn serve(rx: &Receiver<Job>, backend: &mut dyn ComputeBackend, sink: &mut CompletionSink) {
    while let Ok(job) = rx.recv() {
        job(backend, sink);
    }
    log::debug!("compute executor thread ends");
}

impl Drop for Executor {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            // The thread ends once its current call returns; a call stuck in a driver is left
            // to the process exit rather than blocking the caller here.
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::backend::DEFAULT_STREAM;
    use crate::compute::cpu::{CpuBackend, CpuConfig};
    use std::sync::mpsc::channel;

    fn cpu(timeout_ms: u64, budget: u64) -> (Executor, Receiver<GroupDone>) {
        let (tx, rx) = channel();
        let ex = Executor::spawn(
            "compute-test",
            ExecutorConfig {
                timeout: Duration::from_millis(timeout_ms),
            },
            move || {
                Ok(Box::new(CpuBackend::new(CpuConfig {
                    memory_per_context: 1 << 20,
                    instruction_budget: budget,
                    threads: 1,
                    ..CpuConfig::default()
                })) as Box<dyn ComputeBackend>)
            },
            Box::new(move |d| {
                let _ = tx.send(d);
            }),
        )
        .unwrap();
        (ex, rx)
    }

    #[test]
    fn groups_report_their_time_and_result() {
        let (ex, done) = cpu(5000, 1 << 20);
        let c = ex.call(None, |b| b.context_create()).unwrap();
        let a = ex.call(Some(c), move |b| b.mem_alloc(c, 4096)).unwrap();
        let before = Instant::now();
        let out = ex
            .group(c, DEFAULT_STREAM, 7, move |b| {
                b.copy_htod(c, a, &[5; 4096], DEFAULT_STREAM)?;
                let mut v = vec![0; 4096];
                b.copy_dtoh(c, &mut v, a, DEFAULT_STREAM)?;
                Ok(v)
            })
            .unwrap();
        assert_eq!(out, vec![5; 4096]);
        let d = done.recv().unwrap();
        assert_eq!(d.tag, 7);
        assert!(before <= d.start && d.start <= d.finish && d.finish <= Instant::now());
        assert_eq!(d.result, Ok(()));
        // A failing group is reported too, with its error.
        let r = ex.group(c, DEFAULT_STREAM, 8, move |b| {
            b.copy_htod(c, a, &[0; 4097], DEFAULT_STREAM)
        });
        assert!(matches!(r, Err(ComputeError::InvalidValue(_))));
        let d = done.recv().unwrap();
        assert_eq!((d.tag, d.result), (8, r));
        // Bad ids through the thread are errors, not a dead thread.
        let r = ex.group(ContextId(999), DEFAULT_STREAM, 9, |_| Ok(()));
        assert!(matches!(r, Err(ComputeError::InvalidHandle(_))));
        assert_eq!(done.recv().unwrap().tag, 9);
        ex.context_destroy(c).unwrap();
    }

    #[test]
    fn a_call_past_the_timeout_breaks_its_context_only() {
        let (ex, _done) = cpu(100, 1 << 20);
        let c = ex.call(None, |b| b.context_create()).unwrap();
        let other = ex.call(None, |b| b.context_create()).unwrap();
        // A call that holds the thread for 400 ms, as a kernel stuck in a driver would.
        let r = ex.call(Some(c), move |b| {
            std::thread::sleep(Duration::from_millis(400));
            b.context_synchronize(c)
        });
        assert!(matches!(r, Err(ComputeError::LaunchTimeout(_))), "{r:?}");
        let r = ex.call(Some(c), move |b| b.mem_alloc(c, 16));
        assert!(matches!(r, Err(ComputeError::ContextBroken(_))), "{r:?}");
        // The thread is still held: a call for another context is not run, nor broken.
        let r = ex.call(Some(other), move |b| b.mem_alloc(other, 16));
        assert!(matches!(r, Err(ComputeError::Busy(_))), "{r:?}");
        std::thread::sleep(Duration::from_millis(300));
        ex.call(Some(other), move |b| b.mem_alloc(other, 16))
            .unwrap();
        // The broken context can still be destroyed, and is then unknown.
        ex.context_destroy(c).unwrap();
        let r = ex.call(Some(c), move |b| b.mem_alloc(c, 16));
        assert!(matches!(r, Err(ComputeError::InvalidHandle(_))), "{r:?}");
    }

    /// Group timing from CUDA events on the real driver, when it loads (skipped with the reason
    /// otherwise): a 64 MiB memset's `GroupDone` spans its device time.
    #[test]
    fn groups_on_the_real_driver_are_timed_by_events() {
        let (tx, done) = channel();
        let ex = Executor::spawn(
            "compute-test-nvcuda",
            ExecutorConfig::default(),
            || Ok(Box::new(crate::compute::NvCuda::new(0)?) as Box<dyn ComputeBackend>),
            Box::new(move |d| {
                let _ = tx.send(d);
            }),
        );
        let ex = match ex {
            Ok(ex) => ex,
            Err(e) => {
                println!("skipped: NvCuda unavailable: {e}");
                return;
            }
        };
        let c = ex.call(None, |b| b.context_create()).unwrap();
        let bytes = 64u64 << 20;
        let a = ex.call(Some(c), move |b| b.mem_alloc(c, bytes)).unwrap();
        let before = Instant::now();
        for tag in 0..3 {
            ex.group(c, DEFAULT_STREAM, tag, move |b| {
                b.memset_d8(c, a, tag as u8, bytes, DEFAULT_STREAM)
            })
            .unwrap();
        }
        let after = Instant::now();
        let mut last = before;
        for tag in 0..3 {
            let d = done.recv().unwrap();
            assert_eq!((d.tag, d.result), (tag, Ok(())));
            assert!(last <= d.start && d.start <= d.finish && d.finish <= after);
            println!("group {tag}: {:?} on the device", d.finish - d.start);
            last = d.finish;
        }
        ex.context_destroy(c).unwrap();
    }

    #[test]
    fn a_backend_that_cannot_start_is_an_error() {
        let r = Executor::spawn(
            "compute-test",
            ExecutorConfig::default(),
            || Err(ComputeError::NoDevice("none here".into())),
            Box::new(|_| {}),
        );
        assert!(matches!(r, Err(ComputeError::NoDevice(_))), "{r:?}");
    }
}
