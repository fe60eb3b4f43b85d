//! One guest driver's connection served by a compute backend: requests ([`wire`]) read from a
//! byte stream, executed on the backend, answered in order. The stream is a Unix socket on the
//! host (the guest library's socket transport, for tests without a VM and for a GPU host);
//! [`dispatch`] is what any transport calls per request.
//!
//! A connection owns the contexts it creates: it can name no other connection's, and they are
//! all destroyed when it ends, however it ends.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use log::{debug, warn};
use thiserror::Error;

use super::backend::{ComputeBackend, ContextId, Interrupt, KernelLaunch};
use super::wire::{self, Reply, Request, WireError};
use super::{ComputeError, ComputeResult};

/// How long the rest of a message may take once its header has arrived: a peer that stalls
/// mid-message is dropped. Between messages a client may idle as long as it likes.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a connection ended other than by the peer closing it.
#[derive(Debug, Error)]
pub enum RemoteError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad message: {0}")]
    Wire(#[from] WireError),
}

/// What one connection did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stats {
    pub requests: u64,
    pub launches: u64,
    pub failed: u64,
    pub bytes_to_device: u64,
    pub bytes_from_device: u64,
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
    execute(be, owned, stats, req).unwrap_or_else(|e| {
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

/// The next message's header; `None` when the peer closed the connection between messages.
/// A peer may idle between messages (timeouts with nothing read are waited out), but once a
/// message has begun the read timeout applies.
fn read_header(stream: &mut UnixStream) -> std::io::Result<Option<[u8; 4]>> {
    use std::io::ErrorKind::*;
    let mut h = [0u8; 4];
    let mut got = 0;
    while got < h.len() {
        match stream.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), WouldBlock | TimedOut) && got == 0 => {}
            Err(e) if e.kind() == Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(h))
}

/// A context's pending printf output, cut to what a reply carries.
fn output(be: &mut dyn ComputeBackend, ctx: ContextId) -> ComputeResult<Reply> {
    let mut out = be.take_output(ctx)?;
    wire::truncate(&mut out, wire::MAX_TEXT_BYTES);
    Ok(Reply::Output(out))
}

/// Serves one connection until the peer closes it (`Ok`) or breaks the protocol; the
/// connection's contexts are destroyed either way.
///
/// Each request is bounded in time by the backend's [`Interrupt`] (its deadline and
/// instruction budget; a `Batch` is one request). While the connection is served, a watcher
/// thread polls the peer for a hang-up: a guest killed in the middle of a kernel stops that
/// kernel within [`HANGUP_POLL`] (where the backend can stop kernels), instead of the kernel
/// running on to its deadline.
pub fn serve(
    stream: &mut UnixStream,
    be: &mut dyn ComputeBackend,
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
    let result = serve_requests(stream, be, interrupt.as_deref(), &mut owned, &mut stats);
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
    owned: &mut Owned,
    stats: &mut Stats,
) -> Result<(), RemoteError> {
    stream.set_read_timeout(Some(MESSAGE_TIMEOUT))?;
    loop {
        let Some(header) = read_header(stream)? else {
            return Ok(());
        };
        let len = wire::body_len(header)?;
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body)?;
        let reply = match Request::decode(&body) {
            Ok(req) => match interrupt {
                Some(i) => i.request(|| dispatch(be, owned, stats, req)),
                None => dispatch(be, owned, stats, req),
            },
            Err(e) => {
                // Answer, then drop the peer: it does not speak the protocol.
                let reply = Reply::error(&ComputeError::InvalidValue(e.to_string()));
                stream.write_all(&reply.encode())?;
                return Err(e.into());
            }
        };
        reply.write_to(stream)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::{CpuBackend, CpuConfig};

    /// Sends requests over a socket pair to a served backend; returns the replies.
    fn exchange(requests: &[Vec<u8>]) -> (Vec<Reply>, Stats, Result<(), RemoteError>) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            let mut be = CpuBackend::new(CpuConfig::default());
            serve(&mut b, &mut be)
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
            let _ = tx.send(serve(&mut b, &mut be));
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
}
