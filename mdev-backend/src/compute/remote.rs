//! One guest driver's connection served by a compute backend: requests ([`wire`]) read from a
//! byte stream, executed on the backend, answered in order. The stream is a Unix socket on the
//! host (the guest library's socket transport, for tests without a VM and for a GPU host);
//! [`dispatch`] is what any transport calls per request. A client may share a region of
//! memory at connect ([`shm`]): its bulk copies then move through the region, the socket
//! carrying only the chunks' descriptions.
//!
//! A connection owns the contexts it creates: it can name no other connection's, and they are
//! all destroyed when it ends, however it ends.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use log::{debug, warn};
use thiserror::Error;

use super::backend::{ComputeBackend, ContextId, Interrupt, KernelLaunch};
use super::shm::{self, Chunk, Message, Pinned, PinnedCopy, Shared};
use super::wire::{self, Reply, Request, WireError};
use super::{ComputeError, ComputeResult};
use crate::budget::MemoryBudget;

/// How long the rest of a message may take once its header has arrived, and the next chunk
/// of a copy through shared memory once one has said another follows: a peer that stalls
/// mid-message or mid-copy is dropped. Between messages a client may idle as long as it
/// likes.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// What bounds a served connection besides its backend.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The connection's memory budget (the backend's own, normally): a shared region is
    /// charged to it.
    pub budget: Arc<MemoryBudget>,
    /// [`MESSAGE_TIMEOUT`], or shorter in tests.
    pub message_timeout: Duration,
}

impl Limits {
    /// A connection charged to `budget`, waiting [`MESSAGE_TIMEOUT`] mid-message.
    pub fn new(budget: &Arc<MemoryBudget>) -> Limits {
        Limits {
            budget: Arc::clone(budget),
            message_timeout: MESSAGE_TIMEOUT,
        }
    }
}

/// Why a connection ended other than by the peer closing it.
#[derive(Debug, Error)]
pub enum RemoteError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad message: {0}")]
    Wire(#[from] WireError),
    #[error("shared memory: {0}")]
    Shared(&'static str),
}

/// What one connection did.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub requests: u64,
    pub launches: u64,
    pub failed: u64,
    pub bytes_to_device: u64,
    pub bytes_from_device: u64,
    /// The VM's device time, which its device work is added to ([`Request::Usage`]): the
    /// connection's own on the host path, one shared by the VM's sessions on the device.
    pub device_time: DeviceTime,
}

/// The time a VM's device work has run since an origin: what [`Request::Usage`] answers. A
/// clone is the same meter (every session of a VM adds to one).
#[derive(Debug, Clone)]
pub struct DeviceTime(Arc<Meter>);

#[derive(Debug)]
struct Meter {
    origin: Instant,
    /// Running time of device work, paused time included.
    busy_ns: AtomicU64,
    /// Of that, the time requests waited paused at the end of a slice (the device lent to
    /// another VM).
    paused_ns: AtomicU64,
}

impl Default for DeviceTime {
    fn default() -> DeviceTime {
        DeviceTime(Arc::new(Meter {
            origin: Instant::now(),
            busy_ns: AtomicU64::new(0),
            paused_ns: AtomicU64::new(0),
        }))
    }
}

/// Nanoseconds of `d`, saturating.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Adds `n` to `counter`, saturating: a meter never wraps back to 0.
fn add_saturating(counter: &AtomicU64, n: u64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_add(n))
    });
}

impl DeviceTime {
    /// Device work ran for `d` (its pauses included: see [`DeviceTime::paused`]).
    pub fn add(&self, d: Duration) {
        add_saturating(&self.0.busy_ns, nanos(d));
    }

    /// A time-sliced request added with [`DeviceTime::add`] waited `ns` for its next slice:
    /// not its VM's device time.
    pub fn paused(&self, ns: u64) {
        add_saturating(&self.0.paused_ns, ns);
    }

    /// `(busy, elapsed)`: nanoseconds of device work, and nanoseconds since the origin.
    pub fn sample(&self) -> (u64, u64) {
        let m = &self.0;
        let busy = m
            .busy_ns
            .load(Ordering::Relaxed)
            .saturating_sub(m.paused_ns.load(Ordering::Relaxed));
        (busy, nanos(m.origin.elapsed()))
    }
}

/// The contexts a connection created.
#[derive(Debug, Default)]
pub struct Owned(HashSet<u32>);

impl Owned {
    fn check(&self, ctx: ContextId) -> ComputeResult<ContextId> {
        if self.0.contains(&ctx.0) {
            Ok(ctx)
        } else {
            Err(ComputeError::InvalidHandle(format!("context {}", ctx.0)))
        }
    }

    /// Destroys every context still alive.
    pub fn release(&mut self, be: &mut dyn ComputeBackend) {
        for ctx in self.0.drain() {
            if let Err(e) = be.context_destroy(ContextId(ctx)) {
                warn!("context {ctx}: destroy at disconnect: {e}");
            }
        }
    }
}

/// Executes one request for the connection that owns `owned`.
pub fn dispatch(
    be: &mut dyn ComputeBackend,
    owned: &mut Owned,
    stats: &mut Stats,
    req: Request,
) -> Reply {
    stats.requests += 1;
    let start = req.occupies_device().then(Instant::now);
    let r = execute(be, owned, stats, req);
    if let Some(start) = start {
        stats.device_time.add(start.elapsed());
    }
    answer(stats, r)
}

/// The reply to a request that ended with `r`; a failure is counted and logged.
fn answer(stats: &mut Stats, r: ComputeResult<Reply>) -> Reply {
    r.unwrap_or_else(|e| {
        stats.failed += 1;
        // The operator sees why a guest's work was refused (the PTX construct and its line, the
        // limit hit); a guest failing on purpose gets its first few said, not a flood.
        if stats.failed <= MAX_FAILURES_WARNED {
            warn!("compute request failed ({}): {e}", e.cuda_status());
        } else {
            debug!("compute request failed ({}): {e}", e.cuda_status());
        }
        Reply::error(&e)
    })
}

/// Failed requests of one connection logged at warn level; later ones at debug.
const MAX_FAILURES_WARNED: u64 = 16;

fn execute(
    be: &mut dyn ComputeBackend,
    owned: &mut Owned,
    stats: &mut Stats,
    req: Request,
) -> ComputeResult<Reply> {
    use Request::*;
    let done = |r: ComputeResult<()>| r.map(|()| Reply::Done);
    Ok(match req {
        Attributes => Reply::Attributes(be.attributes()),
        ContextCreate => {
            let ctx = be.context_create()?;
            owned.0.insert(ctx.0);
            Reply::Id(ctx.0)
        }
        ContextCreateAt { base, size } => {
            let ctx = be.context_create_at(base, size)?;
            owned.0.insert(ctx.0);
            Reply::Id(ctx.0)
        }
        ContextDestroy { ctx } => {
            let ctx = owned.check(ctx)?;
            owned.0.remove(&ctx.0);
            done(be.context_destroy(ctx))?
        }
        ContextSynchronize { ctx } => done(be.context_synchronize(owned.check(ctx)?))?,
        SetHeapSize { ctx, bytes } => done(be.set_heap_size(owned.check(ctx)?, bytes))?,
        ModuleLoad { ctx, image } => Reply::Id(be.module_load(owned.check(ctx)?, &image)?.0),
        ModuleLink { ctx, images } => {
            let images: Vec<&[u8]> = images.iter().map(Vec::as_slice).collect();
            Reply::Id(be.module_link(owned.check(ctx)?, &images)?.0)
        }
        ModuleUnload { ctx, module } => done(be.module_unload(owned.check(ctx)?, module))?,
        Function { ctx, module, name } => {
            let (id, params) = be.function(owned.check(ctx)?, module, &name)?;
            Reply::Function { id, params }
        }
        FunctionAttributes { ctx, function } => {
            Reply::FunctionAttributes(be.function_attributes(owned.check(ctx)?, function)?)
        }
        Global { ctx, module, name } => {
            let (addr, size) = be.module_global(owned.check(ctx)?, module, &name)?;
            Reply::Global { addr, size }
        }
        MemAlloc { ctx, bytes } => Reply::Address(be.mem_alloc(owned.check(ctx)?, bytes)?),
        MemFree { ctx, addr } => done(be.mem_free(owned.check(ctx)?, addr))?,
        MemInfo { ctx } => {
            let (free, total) = be.mem_info(owned.check(ctx)?)?;
            Reply::MemInfo { free, total }
        }
        Usage => {
            let (busy_ns, elapsed_ns) = stats.device_time.sample();
            Reply::Usage {
                busy_ns,
                elapsed_ns,
            }
        }
        MemsetD8 {
            ctx,
            addr,
            value,
            count,
            stream,
        } => done(be.memset_d8(owned.check(ctx)?, addr, value, count, stream))?,
        MemsetD32 {
            ctx,
            addr,
            value,
            count,
            stream,
        } => done(be.memset_d32(owned.check(ctx)?, addr, value, count, stream))?,
        CopyHtoD {
            ctx,
            dst,
            data,
            stream,
        } => {
            be.copy_htod(owned.check(ctx)?, dst, &data, stream)?;
            stats.bytes_to_device += data.len() as u64;
            Reply::Done
        }
        CopyDtoH {
            ctx,
            src,
            bytes,
            stream,
        } => {
            let ctx = owned.check(ctx)?;
            // Bounded by the decoder (wire::MAX_COPY_BYTES).
            let mut data = vec![0; bytes as usize];
            be.copy_dtoh(ctx, &mut data, src, stream)?;
            stats.bytes_from_device += bytes;
            Reply::Data(data)
        }
        CopyDtoD {
            ctx,
            dst,
            src,
            bytes,
            stream,
        } => done(be.copy_dtod(owned.check(ctx)?, dst, src, bytes, stream))?,
        StreamCreate { ctx } => Reply::Id(be.stream_create(owned.check(ctx)?)?.0),
        StreamDestroy { ctx, stream } => done(be.stream_destroy(owned.check(ctx)?, stream))?,
        StreamSynchronize { ctx, stream } => {
            done(be.stream_synchronize(owned.check(ctx)?, stream))?
        }
        StreamQuery { ctx, stream } => done(be.stream_query(owned.check(ctx)?, stream))?,
        EventCreate { ctx } => Reply::Id(be.event_create(owned.check(ctx)?)?.0),
        EventDestroy { ctx, event } => done(be.event_destroy(owned.check(ctx)?, event))?,
        EventRecord { ctx, event, stream } => {
            done(be.event_record(owned.check(ctx)?, event, stream))?
        }
        EventSynchronize { ctx, event } => done(be.event_synchronize(owned.check(ctx)?, event))?,
        EventQuery { ctx, event } => done(be.event_query(owned.check(ctx)?, event))?,
        EventElapsed { ctx, start, end } => {
            Reply::Elapsed(be.event_elapsed_ms(owned.check(ctx)?, start, end)?)
        }
        Launch {
            ctx,
            function,
            grid,
            block,
            shared_bytes,
            stream,
            params,
            cooperative,
        } => {
            let l = KernelLaunch {
                function,
                grid,
                block,
                shared_bytes,
                stream,
                params: &params,
                cooperative,
            };
            stats.launches += 1;
            let ctx = owned.check(ctx)?;
            be.launch(ctx, &l)?;
            // The launch's device printf output comes back with it: one round trip.
            output(be, ctx)?
        }
        TakeOutput { ctx } => output(be, owned.check(ctx)?)?,
        Batch(requests) => {
            let mut out = String::new();
            let mut completed = 0u32;
            let mut error = None;
            for r in requests {
                match execute(be, owned, stats, r) {
                    Ok(Reply::Output(text)) => {
                        if out.len() + text.len() <= wire::MAX_TEXT_BYTES {
                            out.push_str(&text);
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        stats.failed += 1;
                        // A failed device assert prints its line to the program's output.
                        if let ComputeError::Assert(text) = &e
                            && out.len() + text.len() <= wire::MAX_TEXT_BYTES
                        {
                            out.push_str(text);
                        }
                        let mut message = e.to_string();
                        wire::truncate(&mut message, wire::MAX_TEXT_BYTES);
                        error = Some((e.cuda_status(), message));
                        break;
                    }
                }
                completed += 1;
            }
            Reply::Batch {
                completed,
                output: out,
                error,
            }
        }
    })
}

/// The next message's header, with the descriptor sent with it if any; `None` when the peer
/// closed the connection between messages. Where the peer may `idle` between messages,
/// timeouts with nothing read are waited out; once a message has begun, or where it may not
/// idle (mid-copy), the read timeout applies.
fn read_header(
    stream: &UnixStream,
    idle: bool,
) -> std::io::Result<Option<([u8; 4], Option<OwnedFd>)>> {
    use std::io::ErrorKind::*;
    let mut h = [0u8; 4];
    let mut got = 0;
    let mut fd = None;
    while got < h.len() {
        match shm::recv_with_fd(stream, &mut h[got..]) {
            Ok((0, _)) if got == 0 => return Ok(None),
            Ok((0, _)) => return Err(UnexpectedEof.into()),
            Ok((n, f)) => {
                got += n;
                fd = fd.or(f);
            }
            Err(e) if matches!(e.kind(), WouldBlock | TimedOut) && got == 0 && idle => {}
            Err(e) if e.kind() == Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some((h, fd)))
}

/// A context's pending printf output, cut to what a reply carries.
fn output(be: &mut dyn ComputeBackend, ctx: ContextId) -> ComputeResult<Reply> {
    let mut out = be.take_output(ctx)?;
    wire::truncate(&mut out, wire::MAX_TEXT_BYTES);
    Ok(Reply::Output(out))
}

/// Serves one connection until the peer closes it (`Ok`) or breaks the protocol; the
/// connection's contexts are destroyed either way (and its shared region unmapped, its
/// charge to `limits.budget` given back).
///
/// Each request is bounded in time by the backend's [`Interrupt`] (its deadline and
/// instruction budget; a `Batch` is one request). While the connection is served, a watcher
/// thread polls the peer for a hang-up: a guest killed in the middle of a kernel stops that
/// kernel within [`HANGUP_POLL`] (where the backend can stop kernels), instead of the kernel
/// running on to its deadline.
pub fn serve(
    stream: &mut UnixStream,
    be: &mut dyn ComputeBackend,
    limits: &Limits,
) -> (Stats, Result<(), RemoteError>) {
    let mut owned = Owned::default();
    let mut stats = Stats::default();
    let done = Arc::new(AtomicBool::new(false));
    let interrupt = be.interrupt();
    let watcher = interrupt
        .clone()
        .and_then(|interrupt| Some((interrupt, stream.try_clone().ok()?)))
        .map(|(interrupt, peer)| {
            let done = Arc::clone(&done);
            std::thread::spawn(move || watch_hangup(&peer, &interrupt, &done))
        });
    let result = serve_requests(
        stream,
        be,
        interrupt.as_deref(),
        limits,
        &mut owned,
        &mut stats,
    );
    done.store(true, Ordering::Release);
    if let Some(w) = watcher {
        let _ = w.join();
    }
    owned.release(be);
    (stats, result)
}

/// How often the watcher looks for the peer's hang-up.
pub const HANGUP_POLL: Duration = Duration::from_millis(100);

/// Closes `interrupt` when the peer hangs up, until `done`.
fn watch_hangup(peer: &UnixStream, interrupt: &Interrupt, done: &AtomicBool) {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: HANGUP_POLL.as_nanos() as _,
    };
    while !done.load(Ordering::Acquire) {
        let mut fds = [PollFd::new(peer, PollFlags::RDHUP)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) => {}
            Ok(_) => {
                let gone = PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR;
                if fds[0].revents().intersects(gone) {
                    debug!("compute peer hung up; stopping its kernels");
                    interrupt.close();
                    return;
                }
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                warn!("watching the compute peer: {e}");
                return;
            }
        }
    }
}

fn serve_requests(
    stream: &mut UnixStream,
    be: &mut dyn ComputeBackend,
    interrupt: Option<&Interrupt>,
    limits: &Limits,
    owned: &mut Owned,
    stats: &mut Stats,
) -> Result<(), RemoteError> {
    stream.set_read_timeout(Some(limits.message_timeout))?;
    let mut shared: Option<Shared> = None;
    // Page-locked allocations: unmapped, their charges given back, when the connection ends.
    let mut pinned = Pinned::default();
    // A chunk said another of its copy follows: the peer may not idle.
    let mut mid_copy = false;
    loop {
        let Some((header, fd)) = read_header(stream, !mid_copy)? else {
            return Ok(());
        };
        let len = wire::body_len(header)?;
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body)?;
        let reply = match (Message::decode(&body), fd) {
            (None, None) => match Request::decode(&body) {
                Ok(req) => {
                    // A copy left unfinished is the client's loss: the host waits for nothing.
                    mid_copy = false;
                    within(interrupt, || dispatch(be, owned, stats, req))
                }
                Err(e) => return refuse(stream, e.into()),
            },
            (Some(Ok(Message::Hello { bytes })), Some(fd)) if shared.is_none() => {
                match Shared::accept(fd, bytes, &limits.budget) {
                    Ok(s) => {
                        debug!("compute peer shares {bytes} bytes");
                        shared = Some(s);
                        Reply::Done
                    }
                    // Refused, not a broken protocol: the peer goes on over the socket.
                    Err(e) => {
                        warn!("compute peer's shared region refused: {e}");
                        let mut why = e.to_string();
                        wire::truncate(&mut why, wire::MAX_TEXT_BYTES);
                        Reply::Output(why)
                    }
                }
            }
            (Some(Ok(m @ (Message::HtoD(c) | Message::DtoH(c)))), None) => {
                let to_device = matches!(m, Message::HtoD(_));
                let Some(sh) = shared.as_mut() else {
                    return refuse(stream, RemoteError::Shared("a chunk before a region"));
                };
                if let Err(e) = sh.check(&c) {
                    return refuse(stream, e.into());
                }
                mid_copy = c.more();
                stats.requests += 1;
                let r = within(interrupt, || {
                    copy_shared(be, owned, stats, Through::Ring(sh, &c), to_device)
                });
                answer(stats, r)
            }
            (Some(Ok(Message::Pin { bytes })), Some(fd)) => {
                mid_copy = false;
                stats.requests += 1;
                let r = match pinned.pin(fd, bytes, &limits.budget) {
                    Ok(r) => r.map(Reply::Id),
                    Err(e) => return refuse(stream, e),
                };
                debug!(
                    "compute peer pins {bytes} bytes ({} in all)",
                    pinned.bytes()
                );
                answer(stats, r)
            }
            (Some(Ok(Message::Unpin { region })), None) => {
                mid_copy = false;
                stats.requests += 1;
                if let Err(e) = pinned.unpin(region) {
                    return refuse(stream, e);
                }
                Reply::Done
            }
            (Some(Ok(m @ (Message::PinnedHtoD(c) | Message::PinnedDtoH(c)))), None) => {
                mid_copy = false;
                if let Err(e) = pinned.check(&c) {
                    return refuse(stream, e);
                }
                stats.requests += 1;
                let to_device = matches!(m, Message::PinnedHtoD(_));
                let r = within(interrupt, || {
                    copy_shared(
                        be,
                        owned,
                        stats,
                        Through::Pinned(&mut pinned, &c),
                        to_device,
                    )
                });
                answer(stats, r)
            }
            (Some(Err(e)), _) => return refuse(stream, e.into()),
            (Some(Ok(Message::Pin { .. })), None) => {
                return refuse(stream, RemoteError::Shared("a page-locked region not sent"));
            }
            (Some(Ok(Message::Hello { .. })), _) => {
                return refuse(stream, RemoteError::Shared("a second region, or none sent"));
            }
            (_, Some(_)) => {
                return refuse(stream, RemoteError::Shared("a descriptor out of place"));
            }
        };
        reply.write_to(stream)?;
    }
}

/// Runs `f` as one request of `interrupt`, where the backend has one.
fn within<R>(interrupt: Option<&Interrupt>, f: impl FnOnce() -> R) -> R {
    match interrupt {
        Some(i) => i.request(f),
        None => f(),
    }
}

/// Answers a peer that broke the protocol, then ends its connection with `why`.
fn refuse(stream: &mut UnixStream, why: RemoteError) -> Result<(), RemoteError> {
    let reply = Reply::error(&ComputeError::InvalidValue(why.to_string()));
    stream.write_all(&reply.encode())?;
    Err(why)
}

/// Shared memory a checked copy moves through: a chunk of the ring, or a range of a
/// page-locked allocation.
enum Through<'a> {
    Ring(&'a mut Shared, &'a Chunk),
    Pinned(&'a mut Pinned, &'a PinnedCopy),
}

/// One checked copy through shared memory, to or from device memory.
fn copy_shared(
    be: &mut dyn ComputeBackend,
    owned: &Owned,
    stats: &mut Stats,
    through: Through<'_>,
    to_device: bool,
) -> ComputeResult<Reply> {
    let (ctx, stream, len) = match &through {
        Through::Ring(_, c) => (c.ctx, c.stream, c.len),
        Through::Pinned(_, c) => (c.ctx, c.stream, c.len),
    };
    let ctx = owned.check(ctx)?;
    let start = Instant::now();
    let htod = |addr, bytes: &[u8]| be.copy_htod(ctx, addr, bytes, stream);
    match (through, to_device) {
        (Through::Ring(sh, c), true) => sh.read(c, htod)?,
        (Through::Pinned(p, c), true) => p.read(c, htod)?,
        (through, false) => {
            let dtoh = |addr, bytes: &mut [u8]| be.copy_dtoh(ctx, bytes, addr, stream);
            match through {
                Through::Ring(sh, c) => sh.write(c, dtoh)?,
                Through::Pinned(p, c) => p.write(c, dtoh)?,
            }
        }
    }
    stats.device_time.add(start.elapsed());
    if to_device {
        stats.bytes_to_device += len;
    } else {
        stats.bytes_from_device += len;
    }
    Ok(Reply::Done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::{CpuBackend, CpuConfig};

    /// Sends requests over a socket pair to a served backend; returns the replies.
    fn exchange(requests: &[Vec<u8>]) -> (Vec<Reply>, Stats, Result<(), RemoteError>) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            let config = CpuConfig::default();
            let limits = Limits::new(&config.budget);
            let mut be = CpuBackend::new(config);
            serve(&mut b, &mut be, &limits)
        });
        let mut replies = Vec::new();
        for r in requests {
            // A server that ended the connection makes the write or the read fail.
            let mut h = [0u8; 4];
            if a.write_all(r).is_err() || a.read_exact(&mut h).is_err() {
                break;
            }
            let mut body = vec![0; wire::body_len(h).unwrap()];
            a.read_exact(&mut body).unwrap();
            replies.push(Reply::decode(&body).unwrap());
        }
        drop(a);
        let (stats, result) = server.join().unwrap();
        (replies, stats, result)
    }

    #[test]
    fn a_connection_runs_a_kernel_and_names_only_its_own_contexts() {
        const PTX: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
            .visible .entry put(.param .u64 p, .param .u32 v)\n{\n.reg .b32 %r<2>;\n\
            .reg .b64 %rd<2>;\nld.param.u64 %rd1, [p];\nld.param.u32 %r1, [v];\n\
            st.global.u32 [%rd1], %r1;\nret;\n}\n";
        use Request::*;
        let ctx = ContextId(1);
        let stream = super::super::backend::DEFAULT_STREAM;
        let module = super::super::backend::ModuleId(1);
        let reqs = [
            ContextCreate,
            ModuleLoad {
                ctx,
                image: PTX.as_bytes().to_vec(),
            },
            MemAlloc { ctx, bytes: 4 },
        ];
        let mut msgs: Vec<Vec<u8>> = reqs.iter().map(Request::encode).collect();
        let (replies, ..) = exchange(&msgs);
        assert_eq!(replies[0], Reply::Id(1));
        let Reply::Address(addr) = replies[2] else {
            panic!("{replies:?}")
        };
        let more = [
            Function {
                ctx,
                module,
                name: "put".into(),
            },
            Launch {
                ctx,
                function: super::super::backend::FunctionId(2),
                grid: [1, 1, 1],
                block: [1, 1, 1],
                shared_bytes: 0,
                stream,
                params: [addr.to_le_bytes().as_slice(), &77u32.to_le_bytes()].concat(),
                cooperative: false,
            },
            CopyDtoH {
                ctx,
                src: addr,
                bytes: 4,
                stream,
            },
            // Someone else's context (the backend's next id) is not this connection's.
            MemAlloc {
                ctx: ContextId(2),
                bytes: 4,
            },
        ];
        msgs.extend(more.iter().map(Request::encode));
        let (replies, stats, result) = exchange(&msgs);
        result.unwrap();
        assert!(matches!(replies[3], Reply::Function { .. }), "{replies:?}");
        assert_eq!(replies[4], Reply::Output(String::new()), "{replies:?}");
        assert_eq!(replies[5], Reply::Data(77u32.to_le_bytes().to_vec()));
        assert!(matches!(replies[6], Reply::Error { status: 400, .. }));
        assert_eq!((stats.requests, stats.launches, stats.failed), (7, 1, 1));
    }

    #[test]
    fn usage_counts_device_work_not_control_requests() {
        const PTX: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
            .visible .entry put(.param .u64 p)\n{\n.reg .b32 %r<2>;\n.reg .b64 %rd<2>;\n\
            ld.param.u64 %rd1, [p];\nmov.u32 %r1, 5;\nst.global.u32 [%rd1], %r1;\nret;\n}\n";
        use Request::*;
        let ctx = ContextId(1);
        let stream = super::super::backend::DEFAULT_STREAM;
        let setup = [
            Usage,
            ContextCreate,
            ModuleLoad {
                ctx,
                image: PTX.as_bytes().to_vec(),
            },
            MemAlloc { ctx, bytes: 4 },
        ];
        let (replies, ..) = exchange(&setup.iter().map(Request::encode).collect::<Vec<_>>());
        let Reply::Address(addr) = replies[3] else {
            panic!("{replies:?}")
        };
        let work = [
            Usage,
            Function {
                ctx,
                module: super::super::backend::ModuleId(1),
                name: "put".into(),
            },
            Launch {
                ctx,
                function: super::super::backend::FunctionId(2),
                grid: [64, 1, 1],
                block: [32, 1, 1],
                shared_bytes: 0,
                stream,
                params: addr.to_le_bytes().to_vec(),
                cooperative: false,
            },
            ContextSynchronize { ctx },
            Usage,
        ];
        let msgs: Vec<Vec<u8>> = setup.iter().chain(&work).map(Request::encode).collect();
        let (replies, stats, result) = exchange(&msgs);
        result.unwrap();
        let usage = |i: usize| match replies[i] {
            Reply::Usage {
                busy_ns,
                elapsed_ns,
            } => (busy_ns, elapsed_ns),
            ref r => panic!("{i}: {r:?}"),
        };
        let (first, before, after) = (usage(0), usage(4), usage(8));
        assert_eq!(first.0, 0, "nothing ran");
        assert_eq!(
            before.0, 0,
            "a module load and an allocation are not device time"
        );
        assert!(
            after.0 > 0,
            "the launch and the synchronisation are: {after:?}"
        );
        assert!(first.1 <= before.1 && before.1 <= after.1 && after.0 <= after.1);
        assert_eq!(stats.device_time.sample().0, after.0);
    }

    /// The result of a served connection, once it ends.
    type Served = std::sync::mpsc::Receiver<(Stats, Result<(), RemoteError>)>;

    /// Sends `r` and reads its reply.
    fn roundtrip(a: &mut UnixStream, r: &Request) -> Reply {
        a.write_all(&r.encode()).unwrap();
        let mut h = [0u8; 4];
        a.read_exact(&mut h).unwrap();
        let mut body = vec![0; wire::body_len(h).unwrap()];
        a.read_exact(&mut body).unwrap();
        Reply::decode(&body).unwrap()
    }

    /// A connection to a backend without an instruction budget whose requests may each run
    /// `request_time`, with a never-ending kernel loaded; returns the client's end, the
    /// connection's result and the request launching the kernel.
    fn spin_connection(request_time: Duration) -> (UnixStream, Served, Request) {
        const SPIN: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
            .visible .entry spin()\n{\n$L:\nbra $L;\n}\n";
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut be = CpuBackend::new(CpuConfig {
                instruction_budget: u64::MAX,
                threads: 1,
                request_time,
                ..CpuConfig::default()
            });
            let limits = Limits::new(&crate::budget::MemoryBudget::new(u64::MAX));
            let _ = tx.send(serve(&mut b, &mut be, &limits));
        });
        use Request::*;
        let ctx = ContextId(1);
        for r in [
            ContextCreate,
            ModuleLoad {
                ctx,
                image: SPIN.as_bytes().to_vec(),
            },
            Function {
                ctx,
                module: super::super::backend::ModuleId(1),
                name: "spin".into(),
            },
        ] {
            roundtrip(&mut a, &r);
        }
        let launch = Launch {
            ctx,
            function: super::super::backend::FunctionId(2),
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_bytes: 0,
            stream: super::super::backend::DEFAULT_STREAM,
            params: vec![],
            cooperative: false,
        };
        (a, rx, launch)
    }

    #[test]
    fn a_peer_that_hangs_up_mid_kernel_stops_the_kernel() {
        // No budget and no deadline to speak of: only the hang-up can stop this kernel.
        let (mut a, served, launch) = spin_connection(Duration::from_secs(3600));
        a.write_all(&launch.encode()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        drop(a);
        let (stats, _) = served
            .recv_timeout(Duration::from_secs(60))
            .expect("the served connection ends once its peer is gone");
        assert_eq!((stats.launches, stats.failed), (1, 1));
    }

    #[test]
    fn each_request_ends_at_its_deadline_and_the_connection_goes_on() {
        let (mut a, served, launch) = spin_connection(Duration::from_millis(200));
        let start = std::time::Instant::now();
        let reply = roundtrip(&mut a, &launch);
        println!(
            "spin kernel over the socket answered after {:?}",
            start.elapsed()
        );
        assert!(
            matches!(&reply, Reply::Error { status: 702, message } if message.contains("time limit")),
            "{reply:?}"
        );
        assert!(matches!(
            roundtrip(&mut a, &Request::ContextCreate),
            Reply::Id(_)
        ));
        drop(a);
        let (stats, result) = served.recv_timeout(Duration::from_secs(60)).unwrap();
        result.unwrap();
        assert_eq!((stats.launches, stats.failed), (1, 1));
    }

    #[test]
    fn a_malformed_message_is_answered_and_ends_the_connection() {
        let mut bad = Request::ContextCreate.encode();
        bad[4] = 0xee;
        let (replies, stats, result) = exchange(&[bad, Request::ContextCreate.encode()]);
        assert!(
            matches!(replies[..], [Reply::Error { status: 1, .. }]),
            "{replies:?}"
        );
        assert!(matches!(
            result,
            Err(RemoteError::Wire(WireError::Opcode(_)))
        ));
        assert_eq!(stats.requests, 0);
    }
    /// A served connection whose memory budget the test can watch, waiting `timeout`
    /// mid-message: the client's end, the budget and the connection's result once it ends.
    fn budgeted(budget_bytes: u64, timeout: Duration) -> (UnixStream, Arc<MemoryBudget>, Served) {
        let (a, mut b) = UnixStream::pair().unwrap();
        let budget = MemoryBudget::new(budget_bytes);
        let limits = Limits {
            budget: Arc::clone(&budget),
            message_timeout: timeout,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let config = CpuConfig {
            budget: Arc::clone(&budget),
            ..CpuConfig::default()
        };
        std::thread::spawn(move || {
            let mut be = CpuBackend::new(config);
            let _ = tx.send(serve(&mut b, &mut be, &limits));
        });
        (a, budget, rx)
    }

    /// A context with `bytes` of device memory on connection `a`: the memory's address.
    fn context_with(a: &mut UnixStream, bytes: u64) -> u64 {
        assert_eq!(roundtrip(a, &Request::ContextCreate), Reply::Id(1));
        let alloc = Request::MemAlloc {
            ctx: ContextId(1),
            bytes,
        };
        match roundtrip(a, &alloc) {
            Reply::Address(addr) => addr,
            r => panic!("{r:?}"),
        }
    }

    /// A chunk of context 1 on the default stream.
    fn chunk(addr: u64, offset: u64, len: u64, flags: u8) -> Chunk {
        Chunk {
            ctx: ContextId(1),
            stream: super::super::backend::DEFAULT_STREAM,
            addr,
            offset,
            len,
            flags,
        }
    }

    /// Waits for a served connection's end, then checks that everything it held is given back.
    fn ended(served: &Served, budget: &MemoryBudget) -> Result<(), RemoteError> {
        let (_, result) = served
            .recv_timeout(Duration::from_secs(60))
            .expect("the connection ends");
        assert_eq!(budget.used(), 0, "contexts and region given back");
        result
    }

    #[test]
    fn large_copies_go_through_the_shared_region_intact() {
        let (mut a, budget, served) = budgeted(1 << 30, MESSAGE_TIMEOUT);
        let client = match shm::Client::offer(&mut a).unwrap() {
            shm::Offer::Taken(c) => c,
            o => panic!("{o:?}"),
        };
        // Past the region (more chunks than slots) and not a whole number of chunks.
        let n = 3 * shm::CLIENT_REGION_BYTES + 12_345;
        let addr = context_with(&mut a, n as u64);
        let data: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4099) as u8).collect();
        let (ctx, stream) = (ContextId(1), super::super::backend::DEFAULT_STREAM);
        assert_eq!(
            client.htod(&mut a, ctx, addr, &data, stream).unwrap(),
            Reply::Done
        );
        // What went down through the region is what comes back through the socket...
        let tail = Request::CopyDtoH {
            ctx,
            src: addr + n as u64 - 4096,
            bytes: 4096,
            stream,
        };
        assert_eq!(
            roundtrip(&mut a, &tail),
            Reply::Data(data[n - 4096..].to_vec())
        );
        // ... and through the region, at an offset.
        let mut back = vec![0u8; n - 1000];
        assert_eq!(
            client
                .dtoh(&mut a, ctx, addr + 1000, &mut back, stream)
                .unwrap(),
            Reply::Done
        );
        assert!(back == data[1000..], "the copy came back intact");
        // A copy past the allocation fails as a copy, and the connection goes on.
        let reply = client
            .htod(&mut a, ctx, addr + 4096, &data, stream)
            .unwrap();
        assert!(matches!(reply, Reply::Error { .. }), "{reply:?}");
        let reply = client.dtoh(&mut a, ctx, addr + 4096, &mut back, stream);
        assert!(matches!(reply, Ok(Reply::Error { .. })), "{reply:?}");
        assert!(matches!(
            roundtrip(&mut a, &Request::ContextCreate),
            Reply::Id(_)
        ));
        drop(a);
        let (stats, result) = served.recv_timeout(Duration::from_secs(60)).unwrap();
        result.unwrap();
        // The failed copy's whole chunks before the one past the end went down.
        let whole = (n - 4096) / shm::CLIENT_CHUNK_BYTES * shm::CLIENT_CHUNK_BYTES;
        assert_eq!(stats.bytes_to_device, (n + whole) as u64);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_chunk_outside_the_region_ends_the_connection() {
        let region = shm::CLIENT_REGION_BYTES as u64;
        for (offset, len) in [
            (region - 8, 16),
            (region, 1),
            (u64::MAX - 2, 8),
            (0, shm::MAX_CHUNK_BYTES + 1),
        ] {
            let (mut a, budget, served) = budgeted(1 << 30, MESSAGE_TIMEOUT);
            assert!(matches!(
                shm::Client::offer(&mut a).unwrap(),
                shm::Offer::Taken(_)
            ));
            let addr = context_with(&mut a, 4096);
            let m = Message::HtoD(chunk(addr, offset, len, 0));
            a.write_all(&m.encode()).unwrap();
            let reply = Reply::read_from(&mut a).unwrap().unwrap();
            assert!(matches!(reply, Reply::Error { .. }), "{reply:?}");
            let result = ended(&served, &budget);
            assert!(
                matches!(result, Err(RemoteError::Wire(WireError::TooLong { .. }))),
                "{offset} {len}: {result:?}"
            );
        }
    }

    #[test]
    fn a_client_that_dies_or_stalls_mid_copy_is_let_go() {
        for dies in [true, false] {
            let (mut a, budget, served) = budgeted(1 << 30, Duration::from_millis(200));
            assert!(matches!(
                shm::Client::offer(&mut a).unwrap(),
                shm::Offer::Taken(_)
            ));
            let addr = context_with(&mut a, 1 << 20);
            let first = Message::HtoD(chunk(addr, 0, 4096, shm::MORE));
            a.write_all(&first.encode()).unwrap();
            assert_eq!(Reply::read_from(&mut a).unwrap().unwrap(), Reply::Done);
            if dies {
                drop(a);
                ended(&served, &budget).unwrap();
            } else {
                // The next chunk never comes: the host does not wait for it past the bound.
                let result = ended(&served, &budget);
                assert!(matches!(result, Err(RemoteError::Io(_))), "{result:?}");
            }
        }
    }

    #[test]
    fn an_idle_client_between_copies_is_kept() {
        let (mut a, budget, served) = budgeted(1 << 30, Duration::from_millis(100));
        assert!(matches!(
            shm::Client::offer(&mut a).unwrap(),
            shm::Offer::Taken(_)
        ));
        let addr = context_with(&mut a, 1 << 20);
        let last = Message::HtoD(chunk(addr, 0, 4096, 0));
        a.write_all(&last.encode()).unwrap();
        assert_eq!(Reply::read_from(&mut a).unwrap().unwrap(), Reply::Done);
        std::thread::sleep(Duration::from_millis(300));
        assert!(matches!(
            roundtrip(&mut a, &Request::ContextCreate),
            Reply::Id(_)
        ));
        // A copy abandoned for other requests is not waited for either.
        let abandoned = Message::HtoD(chunk(addr, 0, 4096, shm::MORE));
        a.write_all(&abandoned.encode()).unwrap();
        assert_eq!(Reply::read_from(&mut a).unwrap().unwrap(), Reply::Done);
        assert!(matches!(
            roundtrip(&mut a, &Request::ContextCreate),
            Reply::Id(_)
        ));
        std::thread::sleep(Duration::from_millis(300));
        assert!(matches!(
            roundtrip(&mut a, &Request::ContextCreate),
            Reply::Id(_)
        ));
        drop(a);
        ended(&served, &budget).unwrap();
    }

    #[test]
    fn regions_the_host_cannot_trust_or_afford_are_refused() {
        let budget = MemoryBudget::new(1 << 30);
        let too_big = shm::MAX_REGION_BYTES + 4096;
        let unsealed = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::empty()).unwrap();
        rustix::fs::ftruncate(&unsealed, 4096).unwrap();
        let pipe = rustix::pipe::pipe().unwrap().0;
        for (fd, bytes) in [
            (shm::region_file(too_big).unwrap(), too_big),
            (shm::region_file(4096).unwrap(), 8192),
            (unsealed, 4096),
            (pipe, 4096),
            (shm::region_file(4096).unwrap(), 0),
        ] {
            let e = Shared::accept(fd, bytes, &budget).unwrap_err();
            assert!(matches!(e, ComputeError::InvalidValue(_)), "{e}");
        }
        let small = MemoryBudget::new(shm::MAX_REGION_BYTES);
        let e = Shared::accept(
            shm::region_file(shm::MAX_REGION_BYTES).unwrap(),
            shm::MAX_REGION_BYTES,
            &small,
        )
        .unwrap_err();
        assert!(matches!(e, ComputeError::OutOfMemory(_)), "{e}");
        assert_eq!(budget.used() + small.used(), 0);

        // Refused by a served connection: it goes on over the socket.
        let (mut a, budget, served) = budgeted(1 << 30, MESSAGE_TIMEOUT);
        // All but a byte too few for the region and the host's buffer are taken.
        let room = (shm::CLIENT_REGION_BYTES + shm::BOUNCE_BYTES) as u64 - 1;
        let taken = budget.charge(budget.limit() - room).unwrap();
        let offer = shm::Client::offer(&mut a).unwrap();
        drop(taken);
        assert!(
            matches!(&offer, shm::Offer::Refused(why) if why.contains("refused")),
            "{offer:?}"
        );
        assert!(matches!(
            roundtrip(&mut a, &Request::ContextCreate),
            Reply::Id(_)
        ));
        drop(a);
        ended(&served, &budget).unwrap();
    }

    #[test]
    fn misplaced_shared_memory_messages_end_the_connection() {
        let fd = || shm::region_file(4096).unwrap();
        let hello = Message::Hello { bytes: 4096 }.encode();
        let create = Request::ContextCreate.encode();
        let htod = Message::HtoD(chunk(0, 0, 8, 0)).encode();
        type Send = fn(&mut UnixStream, &[u8], &[u8], &OwnedFd);
        let cases: [(&str, Send); 4] = [
            ("a chunk before a region", |a, _, htod, _| {
                a.write_all(htod).unwrap()
            }),
            ("a hello without its region", |a, hello, _, _| {
                a.write_all(hello).unwrap()
            }),
            ("a descriptor with a request", |a, _, _, fd| {
                let create = Request::ContextCreate.encode();
                shm::send_with_fd(a, &create, std::os::fd::AsFd::as_fd(fd)).unwrap()
            }),
            ("a second region", |a, hello, _, fd| {
                shm::send_with_fd(a, hello, std::os::fd::AsFd::as_fd(fd)).unwrap();
                assert_eq!(Reply::read_from(a).unwrap().unwrap(), Reply::Done);
                shm::send_with_fd(a, hello, std::os::fd::AsFd::as_fd(fd)).unwrap()
            }),
        ];
        for (what, send) in cases {
            let (mut a, budget, served) = budgeted(1 << 30, MESSAGE_TIMEOUT);
            a.write_all(&create).unwrap();
            assert_eq!(Reply::read_from(&mut a).unwrap().unwrap(), Reply::Id(1));
            send(&mut a, &hello, &htod, &fd());
            let reply = Reply::read_from(&mut a).unwrap().unwrap();
            assert!(matches!(reply, Reply::Error { .. }), "{what}: {reply:?}");
            let result = ended(&served, &budget);
            assert!(
                matches!(result, Err(RemoteError::Shared(_))),
                "{what}: {result:?}"
            );
        }
    }

    /// Pins `bytes` on connection `a`: the client's allocation, or the host's refusal.
    fn pin(a: &mut UnixStream, bytes: u64) -> Result<shm::PinnedMemory, Reply> {
        shm::PinnedMemory::create(a, bytes).unwrap()
    }

    #[test]
    fn pinned_copies_move_between_the_allocation_and_device_memory_on_the_host() {
        let (mut a, budget, served) = budgeted(1 << 30, MESSAGE_TIMEOUT);
        let (ctx, stream) = (ContextId(1), super::super::backend::DEFAULT_STREAM);
        let addr = context_with(&mut a, 3 << 20);
        let before = budget.used();
        // Not a whole number of pages, nor of the host's buffer.
        let n = 2 * shm::BOUNCE_BYTES as u64 + 4099;
        let p = pin(&mut a, n).unwrap();
        assert_eq!(p.len(), n);
        assert!(budget.used() >= before + n, "the allocation is charged");
        let mem: Vec<u8> = (0..n as usize).map(|i| (i * 13 + i / 4096) as u8).collect();
        p.slice().unwrap().copy_from(&mem);
        let copy = |a: &mut UnixStream, to_device, addr, offset, len| {
            p.copy(a, ctx, stream, to_device, addr, offset, len)
                .unwrap()
        };
        assert_eq!(copy(&mut a, true, addr + 8, 0, n), Reply::Done);
        let back = Request::CopyDtoH {
            ctx,
            src: addr + 8,
            bytes: n,
            stream,
        };
        let Reply::Data(d) = roundtrip(&mut a, &back) else {
            panic!()
        };
        assert!(d == mem[..], "what went down is the allocation's contents");
        // Back into another part of the allocation, at an offset, a size off the pages.
        assert_eq!(
            copy(&mut a, false, addr + 8 + 100, 5000, 70_001),
            Reply::Done
        );
        let want: Vec<u8> = d[100..100 + 70_001].to_vec();
        let mut now = vec![0u8; n as usize];
        p.slice().unwrap().copy_to(&mut now[..]);
        assert!(now[5000..5000 + 70_001] == want[..], "and came back");
        assert!(now[..5000] == mem[..5000] && now[75_001..] == mem[75_001..]);
        // A copy past the device allocation fails as a copy; the connection goes on.
        let r = copy(&mut a, true, addr + (3 << 20) - 16, 0, 4096);
        assert!(matches!(r, Reply::Error { .. }), "{r:?}");
        p.free(&mut a).unwrap();
        assert_eq!(
            budget.used(),
            before,
            "the allocation's charge is given back"
        );
        // Allocations held at the end go with the connection.
        let _held = pin(&mut a, 1 << 20).unwrap();
        drop(a);
        ended(&served, &budget).unwrap();
    }

    #[test]
    fn pinned_memory_past_its_limit_or_the_budget_is_refused_and_the_connection_goes_on() {
        let (mut a, budget, served) = budgeted(64 << 20, MESSAGE_TIMEOUT);
        context_with(&mut a, 4096);
        for bytes in [shm::MAX_PINNED_BYTES + 1, 64 << 20] {
            let r = pin(&mut a, bytes).unwrap_err();
            assert!(
                matches!(&r, Reply::Error { status: 2, .. }),
                "{bytes}: {r:?}"
            );
        }
        let p = pin(&mut a, 1 << 20).unwrap();
        p.free(&mut a).unwrap();
        drop(a);
        ended(&served, &budget).unwrap();
    }

    #[test]
    fn pinned_messages_that_break_the_protocol_end_the_connection() {
        /// A copy of `len` bytes at `offset` of region `region` to device address `addr`.
        fn raw(a: &mut UnixStream, region: u32, addr: u64, offset: u64, len: u64) {
            let c = PinnedCopy {
                ctx: ContextId(1),
                stream: super::super::backend::DEFAULT_STREAM,
                region,
                addr,
                offset,
                len,
            };
            a.write_all(&Message::PinnedHtoD(c).encode()).unwrap();
        }
        type Case = fn(&mut UnixStream, u64, shm::PinnedMemory);
        // The allocation of each case is region 1, of 4096 bytes.
        let cases: [(&str, Case); 7] = [
            ("a range past the region", |a, addr, _| {
                raw(a, 1, addr, 4000, 200)
            }),
            ("a range wrapping around", |a, addr, _| {
                raw(a, 1, addr, u64::MAX - 8, 16)
            }),
            ("a length past the region", |a, addr, _| {
                raw(a, 1, addr, 0, 4097)
            }),
            ("an unknown region", |a, addr, _| raw(a, 99, addr, 0, 8)),
            ("a region freed", |a, addr, p| {
                assert_eq!(p.free(a).unwrap(), Reply::Done);
                raw(a, 1, addr, 0, 8)
            }),
            ("an unknown region given back", |a, _, _| {
                a.write_all(&Message::Unpin { region: 2 }.encode()).unwrap()
            }),
            ("a region not sealed", |a, _, _| {
                let unsealed =
                    rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::empty()).unwrap();
                rustix::fs::ftruncate(&unsealed, 4096).unwrap();
                let pin = Message::Pin { bytes: 4096 }.encode();
                shm::send_with_fd(a, &pin, std::os::fd::AsFd::as_fd(&unsealed)).unwrap();
            }),
        ];
        for (what, send) in cases {
            let (mut a, budget, served) = budgeted(1 << 30, MESSAGE_TIMEOUT);
            let addr = context_with(&mut a, 1 << 20);
            let p = pin(&mut a, 4096).unwrap();
            send(&mut a, addr, p);
            let reply = Reply::read_from(&mut a).unwrap().unwrap();
            assert!(matches!(reply, Reply::Error { .. }), "{what}: {reply:?}");
            // Its contexts destroyed, its allocations unmapped: the budget is whole again.
            let result = ended(&served, &budget);
            assert!(result.is_err(), "{what}: {result:?}");
        }
    }
}
