//! One executor thread per VM: it owns the VM's [`ComputeBackend`] (created on the thread, so
//! a driver backend makes every driver call from it) and runs requests from a bounded queue,
//! one at a time, in order.
//!
//! Every wait is bounded: a request not answered within [`ExecutorConfig::timeout`] returns
//! [`ComputeError::LaunchTimeout`] to its caller and marks its context broken here (later calls
//! for it answer [`ComputeError::ContextBroken`] without reaching the backend, until it is
//! destroyed). A request still queued behind such a call when its own time runs out is not
//! run at all and answers [`ComputeError::Busy`], leaving its context intact.
//!
//! Every job runs as one request of the backend's [`Interrupt`] (its deadline and instruction
//! budget), and belongs to a [`Scope`]. [`Executor::cancel_all`] (a device reset, a VM gone)
//! and [`Executor::cancel_scope`] (a destroyed context, a guest context gone) stop the running
//! job of that scope at its kernel's next check and answer its queued jobs at once without
//! running them (`Busy`), freeing their queue slots; work queued afterwards runs. Either may
//! be called from any thread.
//!
//! A job posted with [`Executor::post_sliced`] runs as a time-sliced request (see
//! [`Interrupt::begin_sliced`]): at the end of each slice it pauses and calls its hook, and
//! [`Executor::resume`] lets it go on; a cancel stops it, paused or not.
//!
//! [`Executor::group`] runs a work group (a launch, a copy, or a batch) between two events on
//! its stream and reports a [`GroupDone`] with the group's `start` and `finish` to the
//! completion callback, which the device forwards to the scheduler as `Completed`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{RecvTimeoutError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::backend::{
    ComputeBackend, ContextId, DEFAULT_REQUEST_TIME, Interrupt, Slicing, StreamId,
};
use super::{ComputeError, ComputeResult};

/// Requests queued to one executor thread at most.
pub const QUEUE_DEPTH: usize = 64;
/// Jobs one executor holds at most, queued or cancelled and not yet answered: a cancel frees
/// its jobs' queue slots at once, and this bounds what a thread held by a driver call (which
/// cannot be interrupted) keeps across repeated cancels.
pub const MAX_HELD_JOBS: usize = 2 * QUEUE_DEPTH;
/// Urgent jobs (releases of a guest's contexts, run before queued work) queued at most: one
/// per guest context of a device, whose count is bounded by the device (256), with room.
pub const URGENT_DEPTH: usize = 1024;

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

/// Whose work a job is, for [`Executor::cancel_scope`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// No one's in particular: cancelled by [`Executor::cancel_all`] only.
    Device,
    /// A call for one backend context ([`Executor::call`], [`Executor::group`]).
    Context(ContextId),
    /// A client's work (a guest compute context of a device, whose requests may name several
    /// backend contexts), by the client's own number.
    Client(u64),
}

/// A job: run with the backend, or told why it was not run.
type Job = Box<dyn FnOnce(&mut CompletionSink, ComputeResult<&mut dyn ComputeBackend>) + Send>;

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const CANCELLED: u8 = 2;

/// A queued job: whose it is, how its request is sliced (`None`: not), and what it runs.
struct Entry {
    scope: Scope,
    slicing: Option<Slicing>,
    job: Job,
}

/// The queue between the callers and the executor thread.
#[derive(Default)]
struct State {
    /// Urgent jobs, run before `jobs`.
    urgent: VecDeque<Entry>,
    jobs: VecDeque<Entry>,
    /// Cancelled jobs, answered by the thread before anything runs.
    refused: VecDeque<(Job, ComputeError)>,
    /// The scope of the job running.
    running: Option<Scope>,
    /// No more jobs: the thread answers what is left and ends.
    closed: bool,
}

impl State {
    /// Jobs held, in every state.
    fn held(&self) -> usize {
        self.urgent.len()
            + self.jobs.len()
            + self.refused.len()
            + usize::from(self.running.is_some())
    }
}

struct Queue {
    state: Mutex<State>,
    ready: Condvar,
    /// The backend's interrupt (one of the executor's own where the backend has none).
    interrupt: Arc<Interrupt>,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Cancels the queued jobs `which` selects (they are answered with `why`, not run; urgent
    /// jobs are not cancelled) and stops the running one if `which` selects its scope.
    /// Returns how many queued jobs were cancelled.
    fn cancel(&self, which: impl Fn(Scope) -> bool, why: &str) -> usize {
        let mut st = self.lock();
        let State {
            jobs,
            refused,
            running,
            ..
        } = &mut *st;
        let (refuse, kept): (VecDeque<_>, VecDeque<_>) =
            jobs.drain(..).partition(|e| which(e.scope));
        *jobs = kept;
        let cancelled = refuse.len();
        refused.extend(
            refuse
                .into_iter()
                .map(|e| (e.job, ComputeError::Busy(why.into()))),
        );
        if running.is_some_and(&which) {
            self.interrupt.stop();
        }
        drop(st);
        self.ready.notify_one();
        cancelled
    }
}

/// The executor thread of one VM and the sending side of its queue.
pub struct Executor {
    queue: Arc<Queue>,
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
        let (ready_tx, ready_rx) = sync_channel(1);
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let mut backend = match make() {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let interrupt = backend
                    .interrupt()
                    .unwrap_or_else(|| Interrupt::new(DEFAULT_REQUEST_TIME));
                let queue = Arc::new(Queue {
                    state: Mutex::default(),
                    ready: Condvar::new(),
                    interrupt,
                });
                if ready_tx.send(Ok(Arc::clone(&queue))).is_ok() {
                    serve(&queue, backend.as_mut(), &mut sink);
                }
            })
            .map_err(|e| ComputeError::NoDevice(format!("executor thread: {e}")))?;
        match ready_rx.recv_timeout(config.timeout) {
            Ok(Ok(queue)) => Ok(Executor {
                queue,
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

    /// Stops everything of the VM: the running job at its kernel's next check (within a
    /// millisecond or so on the CPU backend), and every queued job, answered at once with
    /// `Busy` without running (urgent jobs, releases, still run). Work queued afterwards
    /// runs. Returns how many queued jobs were cancelled.
    pub fn cancel_all(&self) -> usize {
        self.queue
            .cancel(|_| true, "cancelled: the device was reset")
    }

    /// Stops the work of `scope` as [`Executor::cancel_all`] does everything's.
    pub fn cancel_scope(&self, scope: Scope) -> usize {
        self.queue
            .cancel(|s| s == scope, "cancelled: its context was destroyed")
    }

    /// Stops the work queued or running for backend context `ctx` ([`Executor::call`]s and
    /// [`Executor::group`]s naming it).
    pub fn cancel_context(&self, ctx: ContextId) -> usize {
        self.cancel_scope(Scope::Context(ctx))
    }

    /// Jobs the executor holds: queued, cancelled and not yet answered, and running.
    pub fn held(&self) -> usize {
        self.queue.lock().held()
    }

    /// Whether a job is running (taken from the queue, not finished).
    pub fn busy(&self) -> bool {
        self.queue.lock().running.is_some()
    }

    /// Runs `f` on the executor thread and waits (bounded) for its answer. `ctx` is the
    /// context the call is for (`None`: none, e.g. creating one).
    pub fn call<R: Send + 'static>(
        &self,
        ctx: Option<ContextId>,
        f: impl FnOnce(&mut dyn ComputeBackend) -> ComputeResult<R> + Send + 'static,
    ) -> ComputeResult<R> {
        self.submit(ctx, move |b, _| f(b?))
    }

    /// Runs a work group on `stream` of `ctx`: `ops` between two events, then waits for the
    /// second. The group's [`GroupDone`] goes to the completion callback (also when it fails
    /// or is cancelled, so a scheduler never waits for it); its result is also returned to the
    /// caller.
    pub fn group<R: Send + 'static>(
        &self,
        ctx: ContextId,
        stream: StreamId,
        tag: u64,
        ops: impl FnOnce(&mut dyn ComputeBackend) -> ComputeResult<R> + Send + 'static,
    ) -> ComputeResult<R> {
        self.submit(Some(ctx), move |b, sink| {
            let began = Instant::now();
            let (r, elapsed) = match b {
                Ok(b) => timed(b, ctx, stream, ops),
                Err(e) => (Err(e), None),
            };
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

    /// Destroys a context on the backend and forgets that it was broken here: its queued and
    /// running work is cancelled first, and the destroy runs before other queued work.
    pub fn context_destroy(&self, ctx: ContextId) -> ComputeResult<()> {
        self.cancel_context(ctx);
        let (reply_tx, reply_rx) = sync_channel(1);
        self.post_urgent(Scope::Device, move |b| {
            let _ = reply_tx.send(b.and_then(|b| b.context_destroy(ctx)));
        })?;
        let r = reply_rx
            .recv_timeout(self.config.timeout)
            .unwrap_or_else(|e| {
                Err(ComputeError::NoDevice(format!(
                    "context destroy not answered: {e}"
                )))
            });
        if r.is_ok() {
            self.broken().remove(&ctx);
        }
        r
    }

    /// Queues `f` to run on the executor thread as work of `scope` and returns at once; `f`
    /// reports its own result (a device posts a guest's request and learns of its end from
    /// `f`), and is given the backend, or why it was not run (cancelled). `Busy` when
    /// [`QUEUE_DEPTH`] jobs wait: the caller never blocks on the executor.
    pub fn post(
        &self,
        scope: Scope,
        f: impl FnOnce(ComputeResult<&mut dyn ComputeBackend>) + Send + 'static,
    ) -> ComputeResult<()> {
        self.enqueue(scope, false, None, Box::new(move |_, b| f(b)))
    }

    /// [`Executor::post`] as a time-sliced request: it yields every `slicing.slice` of
    /// running time, calling `slicing.on_yield`, and waits for [`Executor::resume`] (or a
    /// cancel, which stops it as any other).
    pub fn post_sliced(
        &self,
        scope: Scope,
        slicing: Slicing,
        f: impl FnOnce(ComputeResult<&mut dyn ComputeBackend>) + Send + 'static,
    ) -> ComputeResult<()> {
        self.enqueue(scope, false, Some(slicing), Box::new(move |_, b| f(b)))
    }

    /// Starts the next slice of the request that yielded; false when none is paused.
    pub fn resume(&self) -> bool {
        self.queue.interrupt.resume()
    }

    /// [`Executor::post`] before any queued work (up to [`URGENT_DEPTH`]), and not cancelled
    /// by [`Executor::cancel_all`]: for releasing what a guest held, which a reset must do
    /// whatever is queued.
    pub fn post_urgent(
        &self,
        scope: Scope,
        f: impl FnOnce(ComputeResult<&mut dyn ComputeBackend>) + Send + 'static,
    ) -> ComputeResult<()> {
        self.enqueue(scope, true, None, Box::new(move |_, b| f(b)))
    }

    fn enqueue(
        &self,
        scope: Scope,
        urgent: bool,
        slicing: Option<Slicing>,
        job: Job,
    ) -> ComputeResult<()> {
        if self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
            return Err(ComputeError::NoDevice("executor thread gone".into()));
        }
        let mut st = self.queue.lock();
        if st.closed {
            return Err(ComputeError::NoDevice("executor stopped".into()));
        }
        let queue = if urgent { &st.urgent } else { &st.jobs };
        let depth = if urgent { URGENT_DEPTH } else { QUEUE_DEPTH };
        if queue.len() >= depth || (!urgent && st.held() >= MAX_HELD_JOBS) {
            return Err(ComputeError::Busy(format!("{} requests queued", st.held())));
        }
        let entry = Entry {
            scope,
            slicing,
            job,
        };
        if urgent {
            st.urgent.push_back(entry);
        } else {
            st.jobs.push_back(entry);
        }
        drop(st);
        self.queue.ready.notify_one();
        Ok(())
    }

    fn submit<R: Send + 'static>(
        &self,
        ctx: Option<ContextId>,
        f: impl FnOnce(ComputeResult<&mut dyn ComputeBackend>, &mut CompletionSink) -> ComputeResult<R>
        + Send
        + 'static,
    ) -> ComputeResult<R> {
        if let Some(why) = ctx.and_then(|c| self.broken().get(&c).cloned()) {
            return Err(ComputeError::ContextBroken(why));
        }
        let state = Arc::new(AtomicU8::new(QUEUED));
        let (reply_tx, reply_rx) = sync_channel(1);
        let job_state = Arc::clone(&state);
        let job: Job = Box::new(move |sink, b| {
            if job_state
                .compare_exchange(QUEUED, RUNNING, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                let _ = reply_tx.send(f(b, sink));
            }
        });
        let scope = ctx.map_or(Scope::Device, Scope::Context);
        self.enqueue(scope, false, None, job)?;
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
                    // Where the backend can, its kernel stops instead of running on.
                    self.cancel_context(c);
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

/// What the executor thread does next.
enum Next {
    Run(Job),
    Refuse(Job, ComputeError),
}

/// The executor thread: answers cancelled jobs, runs urgent then queued jobs, each as one
/// request of the interrupt, until the queue is closed and empty.
fn serve(queue: &Queue, backend: &mut dyn ComputeBackend, sink: &mut CompletionSink) {
    loop {
        let next = {
            let mut st = queue.lock();
            loop {
                if let Some((job, why)) = st.refused.pop_front() {
                    break Next::Refuse(job, why);
                }
                if let Some(e) = st.urgent.pop_front().or_else(|| st.jobs.pop_front()) {
                    // Under the lock: a cancel of its scope from now on stops it.
                    st.running = Some(e.scope);
                    match e.slicing {
                        Some(slicing) => queue.interrupt.begin_sliced(slicing),
                        None => queue.interrupt.begin(),
                    }
                    break Next::Run(e.job);
                }
                if st.closed {
                    log::debug!("compute executor thread ends");
                    return;
                }
                st = queue.ready.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
        };
        match next {
            Next::Refuse(job, why) => job(sink, Err(why)),
            Next::Run(job) => {
                job(sink, Ok(&mut *backend));
                queue.interrupt.end();
                queue.lock().running = None;
            }
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // Queued jobs are answered, the running one stops (where the backend can stop it)
        // and nothing later runs.
        self.cancel_all();
        self.queue.interrupt.close();
        self.queue.lock().closed = true;
        self.queue.ready.notify_one();
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
    use crate::compute::backend::{FunctionId, KernelLaunch};
    use crate::compute::cpu::{CpuBackend, CpuConfig};
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::sync::mpsc::{Receiver, channel};

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

    /// An executor whose requests may run `request_time` with no instruction budget to
    /// speak of, and a context holding `kernel` (PTX text) as its function.
    fn unbounded(
        request_time: Duration,
        kernel: &str,
        name: &str,
    ) -> (Executor, ContextId, FunctionId) {
        unbounded_on(request_time, 1, kernel, name)
    }

    /// [`unbounded`] with launches on `threads` host threads.
    fn unbounded_on(
        request_time: Duration,
        threads: usize,
        kernel: &str,
        name: &str,
    ) -> (Executor, ContextId, FunctionId) {
        let ex = Executor::spawn(
            "compute-test",
            ExecutorConfig {
                timeout: Duration::from_secs(60),
            },
            move || {
                Ok(Box::new(CpuBackend::new(CpuConfig {
                    instruction_budget: u64::MAX,
                    threads,
                    request_time,
                    ..CpuConfig::default()
                })) as Box<dyn ComputeBackend>)
            },
            Box::new(|_| {}),
        )
        .unwrap();
        let (c, f) = function(&ex, kernel, name);
        (ex, c, f)
    }

    /// A new context of `ex` with `kernel` loaded, and its function `name`.
    fn function(ex: &Executor, kernel: &str, name: &str) -> (ContextId, FunctionId) {
        let (text, name) = (kernel.to_owned(), name.to_owned());
        ex.call(None, move |b| {
            let c = b.context_create()?;
            let m = b.module_load(c, text.as_bytes())?;
            Ok((c, b.function(c, m, &name)?.0))
        })
        .unwrap()
    }

    const SPIN: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
        .visible .entry spin()\n{\n$L__spin:\nbra $L__spin;\n}\n";

    /// A kernel of `n` iterations of a loop (one thread).
    const LOOP: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
        .visible .entry count(.param .u32 n)\n{\n.reg .pred %p<2>;\n.reg .b32 %r<3>;\n\
        ld.param.u32 %r1, [n];\nmov.u32 %r2, 0;\n$L__loop:\nadd.u32 %r2, %r2, 1;\n\
        setp.lt.u32 %p1, %r2, %r1;\n@%p1 bra $L__loop;\nret;\n}\n";

    fn one_warp(function: FunctionId, params: &[u8]) -> KernelLaunch<'_> {
        KernelLaunch {
            function,
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_bytes: 0,
            stream: DEFAULT_STREAM,
            params,
            cooperative: false,
        }
    }

    /// Posts a spin kernel of `c`; returns a flag set once it runs and where its result comes.
    fn post_spin(
        ex: &Executor,
        scope: Scope,
        c: ContextId,
        f: FunctionId,
    ) -> (Arc<AtomicBool>, Receiver<ComputeResult<()>>) {
        let (started, (tx, rx)) = (Arc::new(AtomicBool::new(false)), channel());
        let running = Arc::clone(&started);
        ex.post(scope, move |b| {
            running.store(true, Ordering::Release);
            let _ = tx.send(b.and_then(|b| b.launch(c, &one_warp(f, &[]))));
        })
        .unwrap();
        (started, rx)
    }

    /// Waits (bounded) until `flag` is set.
    fn wait_for(flag: &AtomicBool) {
        wait_until(|| flag.load(Ordering::Acquire));
    }

    /// Waits (bounded) until `done` holds.
    fn wait_until(done: impl Fn() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(start.elapsed() < Duration::from_secs(30), "never happened");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_batch_of_launches_shares_one_deadline_and_one_budget() {
        // Each launch alone fits the request's time; a hundred of them do not.
        let (ex, c, f) = unbounded(Duration::from_millis(300), LOOP, "count");
        let r = ex.call(Some(c), move |b| {
            let params = 200_000u32.to_le_bytes();
            let mut done = 0;
            for _ in 0..100 {
                if let Err(e) = b.launch(c, &one_warp(f, &params)) {
                    return Ok((done, Some(e)));
                }
                done += 1;
            }
            Ok((done, None))
        });
        let (done, err) = r.unwrap();
        assert!(
            matches!(&err, Some(ComputeError::LaunchTimeout(m)) if m.contains("time limit")),
            "{done} launches, {err:?}"
        );
        assert!(done < 100);
        // The instruction budget is the request's too: 10 launches of 3 loops each fit a
        // budget of 100 units, whichever way a Batch splits it, 40 do not.
        let (budget_ex, _done) = cpu(60_000, 100);
        let (c, f) = function(&budget_ex, LOOP, "count");
        let run = |n: usize| {
            budget_ex.call(Some(c), move |b| {
                let params = 3u32.to_le_bytes();
                (0..n).try_for_each(|_| b.launch(c, &one_warp(f, &params)))
            })
        };
        run(2).unwrap();
        let err = run(40).unwrap_err();
        assert!(matches!(err, ComputeError::LaunchTimeout(_)), "{err:?}");
    }

    #[test]
    fn cancel_all_stops_a_running_kernel_answers_the_queued_and_lets_later_work_run() {
        let (ex, c, f) = unbounded(Duration::from_secs(3600), SPIN, "spin");
        let (started, spin) = post_spin(&ex, Scope::Device, c, f);
        wait_for(&started);
        // The queue fills behind it.
        let (tx, queued) = channel();
        for _ in 0..QUEUE_DEPTH {
            let tx = tx.clone();
            ex.post(Scope::Device, move |b| {
                let _ = tx.send(b.map(drop));
            })
            .unwrap();
        }
        let full = ex.post(Scope::Device, |_| {});
        assert!(matches!(full, Err(ComputeError::Busy(_))), "{full:?}");
        let start = Instant::now();
        assert_eq!(ex.cancel_all(), QUEUE_DEPTH);
        // Their slots are free at once, before the executor answers them.
        let (tx2, later) = channel();
        ex.post(Scope::Device, move |b| {
            let _ = tx2.send(b.map(drop));
        })
        .unwrap();
        let r = spin.recv_timeout(Duration::from_secs(30)).unwrap();
        let stopped = start.elapsed();
        assert!(
            matches!(&r, Err(ComputeError::LaunchTimeout(m)) if m.contains("cancelled")),
            "{r:?}"
        );
        for _ in 0..QUEUE_DEPTH {
            let r = queued.recv_timeout(Duration::from_secs(30)).unwrap();
            assert!(matches!(r, Err(ComputeError::Busy(_))), "{r:?}");
        }
        later
            .recv_timeout(Duration::from_secs(30))
            .unwrap()
            .unwrap();
        println!("spin kernel stopped {stopped:?} after cancel_all");
        // The stopped kernel's context is broken; a new one works.
        let r = ex.call(Some(c), move |b| b.context_synchronize(c));
        assert!(matches!(r, Err(ComputeError::ContextBroken(_))), "{r:?}");
        let (c2, f2) = function(&ex, LOOP, "count");
        ex.call(Some(c2), move |b| {
            b.launch(c2, &one_warp(f2, &5u32.to_le_bytes()))
        })
        .unwrap();
        // Nothing is left held.
        wait_until(|| ex.held() == 0);
    }

    #[test]
    fn cancel_scope_stops_that_scopes_work_only() {
        let (ex, a, f) = unbounded(Duration::from_secs(3600), SPIN, "spin");
        let (b_ctx, g) = function(&ex, LOOP, "count");
        let (started, spin) = post_spin(&ex, Scope::Client(1), a, f);
        wait_for(&started);
        let (tx, queued) = channel();
        for (scope, ctx) in [(Scope::Client(1), a), (Scope::Client(2), b_ctx)] {
            let tx = tx.clone();
            ex.post(scope, move |b| {
                let params = 5u32.to_le_bytes();
                let _ = tx.send((scope, b.and_then(|b| b.launch(ctx, &one_warp(g, &params)))));
            })
            .unwrap();
        }
        assert_eq!(ex.cancel_scope(Scope::Client(1)), 1);
        let r = spin.recv_timeout(Duration::from_secs(30)).unwrap();
        assert!(matches!(r, Err(ComputeError::LaunchTimeout(_))), "{r:?}");
        let mut answers: Vec<_> = (0..2)
            .map(|_| queued.recv_timeout(Duration::from_secs(30)).unwrap())
            .collect();
        answers.sort_by_key(|(s, _)| *s == Scope::Client(2));
        assert!(
            matches!(answers[0], (Scope::Client(1), Err(ComputeError::Busy(_)))),
            "{answers:?}"
        );
        assert!(
            matches!(answers[1], (Scope::Client(2), Ok(()))),
            "{answers:?}"
        );
        // Destroying a context whose kernel runs stops the kernel first.
        let (c, f) = function(&ex, SPIN, "spin");
        let (started, spin) = post_spin(&ex, Scope::Context(c), c, f);
        wait_for(&started);
        ex.context_destroy(c).unwrap();
        let r = spin.recv_timeout(Duration::from_secs(30)).unwrap();
        assert!(matches!(r, Err(ComputeError::LaunchTimeout(_))), "{r:?}");
    }

    #[test]
    fn an_urgent_job_runs_before_a_full_queue_and_is_not_cancelled() {
        let (ex, c, f) = unbounded(Duration::from_secs(3600), SPIN, "spin");
        let (started, spin) = post_spin(&ex, Scope::Device, c, f);
        wait_for(&started);
        let (tx, order) = channel();
        for _ in 0..QUEUE_DEPTH {
            let tx = tx.clone();
            ex.post(Scope::Device, move |b| {
                let _ = tx.send(("queued", b.is_ok()));
            })
            .unwrap();
        }
        assert!(matches!(
            ex.post(Scope::Device, |_| {}),
            Err(ComputeError::Busy(_))
        ));
        // A release is taken however full the queue is, and survives the cancel that answers
        // the queued work without running it.
        ex.post_urgent(Scope::Device, move |b| {
            let _ = tx.send(("urgent", b.and_then(|b| b.context_destroy(c)).is_ok()));
        })
        .unwrap();
        ex.cancel_all();
        let r = spin.recv_timeout(Duration::from_secs(30)).unwrap();
        assert!(matches!(r, Err(ComputeError::LaunchTimeout(_))), "{r:?}");
        let answers: Vec<_> = (0..=QUEUE_DEPTH)
            .map(|_| order.recv_timeout(Duration::from_secs(30)).unwrap())
            .collect();
        assert!(answers.contains(&("urgent", true)), "{answers:?}");
        assert_eq!(answers.iter().filter(|a| a.1).count(), 1, "{answers:?}");
    }

    /// Posts a spin kernel of `c` on `grid` blocks as a request sliced every `slice`; returns
    /// how many times it yielded and where its result comes.
    fn post_sliced_spin(
        ex: &Executor,
        c: ContextId,
        f: FunctionId,
        grid: u32,
        slice: Duration,
    ) -> (Arc<AtomicUsize>, Receiver<ComputeResult<()>>) {
        let (yields, (tx, rx)) = (Arc::new(AtomicUsize::new(0)), channel());
        let counted = Arc::clone(&yields);
        let slicing = Slicing {
            slice,
            on_yield: Arc::new(move || {
                counted.fetch_add(1, Ordering::AcqRel);
            }),
        };
        ex.post_sliced(Scope::Device, slicing, move |b| {
            let launch = KernelLaunch {
                grid: [grid, 1, 1],
                ..one_warp(f, &[])
            };
            let _ = tx.send(b.and_then(|b| b.launch(c, &launch)));
        })
        .unwrap();
        (yields, rx)
    }

    #[test]
    fn a_sliced_kernel_yields_waits_resumes_and_is_cancelled_while_paused() {
        let (ex, c, f) = unbounded(Duration::from_secs(3600), SPIN, "spin");
        let (yields, spin) = post_sliced_spin(&ex, c, f, 1, Duration::from_millis(5));
        wait_until(|| ex.queue.interrupt.paused());
        assert_eq!(yields.load(Ordering::Acquire), 1);
        wait_until(|| ex.queue.interrupt.paused_threads() == 1);
        // Paused, it neither ends nor yields again until it is resumed.
        std::thread::sleep(Duration::from_millis(50));
        assert!(spin.try_recv().is_err());
        assert_eq!(yields.load(Ordering::Acquire), 1);
        assert!(ex.resume());
        wait_until(|| yields.load(Ordering::Acquire) == 2 && ex.queue.interrupt.paused());
        // A cancel stops it where it waits.
        ex.cancel_all();
        let r = spin.recv_timeout(Duration::from_secs(30)).unwrap();
        assert!(
            matches!(&r, Err(ComputeError::LaunchTimeout(m)) if m.contains("cancelled")),
            "{r:?}"
        );
        assert!(!ex.resume(), "nothing is paused any more");
        // The next request is not sliced.
        let (c2, f2) = function(&ex, LOOP, "count");
        ex.call(Some(c2), move |b| {
            b.launch(c2, &one_warp(f2, &5u32.to_le_bytes()))
        })
        .unwrap();
        assert_eq!(yields.load(Ordering::Acquire), 2);
    }

    #[test]
    fn a_sliced_launch_over_two_threads_pauses_both() {
        let (ex, c, f) = unbounded_on(Duration::from_secs(3600), 2, SPIN, "spin");
        let (yields, spin) = post_sliced_spin(&ex, c, f, 8, Duration::from_millis(5));
        wait_until(|| ex.queue.interrupt.paused_threads() == 2);
        assert_eq!(yields.load(Ordering::Acquire), 1, "one hook call per slice");
        assert!(ex.resume());
        wait_until(|| yields.load(Ordering::Acquire) == 2);
        wait_until(|| ex.queue.interrupt.paused_threads() == 2);
        drop(ex);
        let r = spin.recv_timeout(Duration::from_secs(30)).unwrap();
        assert!(
            matches!(&r, Err(ComputeError::LaunchTimeout(m)) if m.contains("cancelled")),
            "{r:?}"
        );
    }

    #[test]
    fn a_sliced_requests_deadline_counts_its_running_time_only() {
        let limit = Duration::from_millis(100);
        let (ex, c, f) = unbounded(limit, SPIN, "spin");
        let (yields, spin) = post_sliced_spin(&ex, c, f, 1, Duration::from_millis(20));
        wait_until(|| ex.queue.interrupt.paused());
        // Paused three times its deadline, it still runs once resumed.
        std::thread::sleep(3 * limit);
        assert!(ex.resume());
        wait_until(|| yields.load(Ordering::Acquire) == 2);
        // Resumed whenever it yields, it ends at its deadline.
        let r = loop {
            if let Ok(r) = spin.try_recv() {
                break r;
            }
            ex.resume();
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(
            matches!(&r, Err(ComputeError::LaunchTimeout(m)) if m.contains("time limit")),
            "{r:?}"
        );
        println!(
            "a 100 ms request of 20 ms slices yielded {} times",
            yields.load(Ordering::Acquire)
        );
    }
}
