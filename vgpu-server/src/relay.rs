//! The validating frame relay between QEMU and the `vfio-user` crate's message loop (hop 2).
//!
//! The device accepts QEMU's connections itself. The crate's [`vfio_user::Server`] is built
//! on a private listener ([`loop_link`], made once at start-up, before the sandbox) whose
//! only connection is the relay's, and the crate's `Server::run` serves that one connection
//! on its own thread for the life of the process. For each QEMU connection,
//! [`Relay::serve`] reads every message, header first with its SCM_RIGHTS descriptors, has
//! [`crate::frame`] check the header before reading a byte of payload and the payload before
//! passing it on, and forwards header, payload and descriptors to the message loop. The
//! loop's replies are framed by their headers and passed back whole.
//!
//! Every message goes to the loop as a request (a posted message's no-reply flag is
//! cleared), so each one gets exactly one reply, in order. The relay keeps what to do with
//! each ([`MAX_IN_FLIGHT`] at most): a reply to QEMU's request goes to QEMU, the reply to a
//! posted message is dropped (QEMU expects none, not even an error). When QEMU's connection
//! ends, the relay waits for the replies still owed, so the next connection's device never
//! sees a message of the previous one and QEMU never a reply to another's request.
//!
//! A refused message is counted (`refused_messages`) and logged. A request that expects a
//! reply gets an EINVAL error reply and the connection goes on; a posted message, or one that
//! leaves the stream out of step, closes the connection once the loop has handled everything
//! before it, as a disconnect does.
//!
//! One thread (the server's) relays both directions through `poll`: QEMU's socket is read only
//! while no message waits to go to the loop, and the loop's side is non-blocking, so the relay
//! never sits in a write to the loop while the loop sits in a write of its replies. A QEMU
//! that stops reading, or stops in the middle of a message, stalls only its own connection;
//! its hang-up ends it.

use std::collections::VecDeque;
use std::fs::DirBuilder;
use std::hash::{BuildHasher, RandomState};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use log::warn;
use vgpu_schedd::busy_poll::BusyPoll;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::frame::{self, EINVAL, FrameError, HEADER_SIZE, Header, Limits, MAX_FRAME_BYTES};
use crate::metrics::{DeviceMetrics, inc};
use crate::ratelimit::guest_fault;

/// Descriptors the kernel passes in one SCM_RIGHTS message at most (`SCM_MAX_FD`). Receiving
/// with room for that many means a receive is never truncated: every descriptor QEMU attaches
/// is counted against its command's limit, then closed or passed on.
const SCM_MAX_FD: usize = 253;

/// Bytes taken from the message loop's socket per read. Replies are framed from a buffer, so
/// this only sets the number of reads; it holds a REGION_READ reply of the largest region.
const REPLY_CHUNK: usize = 64 << 10;

/// Bytes of a refused message's payload read per call while skipping it.
const DISCARD_CHUNK: usize = 4096;

/// Tries at a unique name for the private directory of [`loop_link`] before giving up.
const LINK_ATTEMPTS: u32 = 16;

/// Messages passed to the message loop whose replies have not come back yet, at most. The
/// relay stops reading QEMU at this many until replies drain: it bounds the relay's
/// bookkeeping, and is well above what QEMU keeps in flight (it waits for each reply but its
/// batched DMA maps, one per memory region).
pub const MAX_IN_FLIGHT: usize = 1024;

/// Why relaying stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The private link to the message loop could not be made.
    #[error("linking the message loop in {dir}: {source}")]
    Link {
        /// The directory the link's socket was made in.
        dir: PathBuf,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// Reading from the client failed.
    #[error("reading from the client: {0}")]
    ClientRead(#[source] io::Error),
    /// The client hung up in the middle of a message.
    #[error("the client hung up in the middle of a message")]
    ClientTruncated,
    /// The message loop's socket failed.
    #[error("message loop socket: {0}")]
    Loop(#[source] io::Error),
    /// The message loop sent something that is not a reply frame.
    #[error("the message loop sent a reply of {0} bytes")]
    BadReply(u32),
    /// The message loop sent a reply to no message.
    #[error("the message loop sent a reply to no message")]
    UnexpectedReply,
    /// The message loop closed its end (its thread ended).
    #[error("the message loop ended")]
    LoopClosed,
    /// Waiting for either socket failed.
    #[error("poll: {0}")]
    Poll(#[source] io::Error),
}

/// How a relayed connection ended; in every case everything before the end was handled.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// The client hung up (or could no longer be read or written).
    ClientClosed,
    /// The relay closed the connection on a message that could not be answered (posted, or
    /// not framed).
    Refused(FrameError),
}

/// A listener for the crate's `Server` with the relay's connection already queued on it.
///
/// The listener is bound in a new directory of mode 0700 next to the device's own socket
/// (`dir`), connected to, and its name and directory removed at once: from then on nothing
/// can reach it, and during those microseconds only this user could (who can ptrace the
/// process anyway). An abstract-namespace name would need no directory but is listed in
/// `/proc/net/unix` for every local user to see and connect to first; a socketpair cannot
/// be accepted. Made once, before the sandbox: the device process needs neither `bind` nor
/// `mkdir` after start-up.
pub fn loop_link(dir: &Path) -> Result<(UnixListener, UnixStream), RelayError> {
    let link_error = |source| RelayError::Link {
        dir: dir.to_path_buf(),
        source,
    };
    let mut attempt = 0;
    let private = loop {
        // std's RandomState is seeded from the OS; mkdir fails on an existing name, so a
        // name taken by someone else is never used, only retried.
        let salt = RandomState::new().hash_one(attempt);
        let path = dir.join(format!(".vgpu-loop-{}-{salt:016x}", std::process::id()));
        match DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => break path,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < LINK_ATTEMPTS => {
                attempt += 1;
            }
            Err(e) => return Err(link_error(e)),
        }
    };
    let socket = private.join("loop.sock");
    let linked = UnixListener::bind(&socket)
        .and_then(|listener| Ok((UnixStream::connect(&socket)?, listener)));
    let removed = std::fs::remove_file(&socket)
        .or_else(|e| match e.kind() {
            io::ErrorKind::NotFound => Ok(()),
            _ => Err(e),
        })
        .and_then(|()| std::fs::remove_dir(&private));
    let (stream, listener) = linked.map_err(link_error)?;
    removed.map_err(link_error)?;
    Ok((listener, stream))
}

/// One message read from the client.
enum Incoming {
    /// The client hung up between messages.
    Eof,
    /// A valid message, to go to the loop.
    Forward(Outgoing),
    /// Refused; answered with an error reply.
    Answer(FrameError, Header),
    /// Refused; the connection closes.
    Close(FrameError),
}

/// A message on its way to the loop.
struct Outgoing {
    bytes: Vec<u8>,
    sent: usize,
    /// Sent with the first bytes.
    fds: Vec<OwnedFd>,
    /// Who gets the reply.
    owed: Owed,
    /// A posted REGION_WRITE without descriptors: a doorbell candidate.
    posted_write: bool,
}

/// Receives into `buf`, with any descriptors attached.
fn recv_with_fds(stream: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut raw = [-1 as RawFd; SCM_MAX_FD];
    let mut iov = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    loop {
        // SAFETY: the iovec describes `buf`, which is valid for writes of its length and
        // borrowed mutably for the call.
        let received = unsafe { stream.recv_with_fds(&mut iov, &mut raw) };
        match received.map_err(io::Error::from) {
            Ok((n, count)) => {
                let fds = raw[..count]
                    .iter()
                    // SAFETY: the kernel installed these descriptors for this receive; nothing
                    // else owns them.
                    .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
                    .collect();
                return Ok((n, fds));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Reads exactly `buf.len()` bytes of a message from the client.
fn read_rest(client: &UnixStream, buf: &mut [u8]) -> Result<(), RelayError> {
    let mut client = client;
    client.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => RelayError::ClientTruncated,
        _ => RelayError::ClientRead(e),
    })
}

/// Reads and drops `len` bytes of a refused message.
fn discard(client: &UnixStream, mut len: usize) -> Result<(), RelayError> {
    let mut scratch = [0u8; DISCARD_CHUNK];
    while len > 0 {
        let n = len.min(DISCARD_CHUNK);
        read_rest(client, &mut scratch[..n])?;
        len -= n;
    }
    Ok(())
}

/// Reads one message from the client, checking its header before its payload.
fn read_message(client: &UnixStream, limits: &Limits) -> Result<Incoming, RelayError> {
    let mut head = [0u8; HEADER_SIZE];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < HEADER_SIZE {
        let (n, more) = recv_with_fds(client, &mut head[got..]).map_err(RelayError::ClientRead)?;
        fds.extend(more);
        if n == 0 {
            return match got {
                0 => Ok(Incoming::Eof),
                _ => Err(RelayError::ClientTruncated),
            };
        }
        got += n;
    }
    let header = Header::parse(&head);
    let refused = |e: FrameError| {
        if e.unframeable() || header.posted() {
            Incoming::Close(e)
        } else {
            Incoming::Answer(e, header)
        }
    };
    if let Err(e) = frame::check_header(&header, fds.len(), limits) {
        drop(fds);
        let incoming = refused(e);
        if let (Incoming::Answer(..), Some(len)) = (&incoming, header.payload_len()) {
            discard(client, len)?;
        }
        return Ok(incoming);
    }
    // check_header bounded the size by the command's maximum. Descriptors attached to the
    // payload rather than the header are not received: the kernel closes them on a plain read.
    let mut bytes = vec![0u8; header.size as usize];
    // Every message goes to the loop as a request, so that each has exactly one reply.
    bytes[..HEADER_SIZE].copy_from_slice(&header.as_request().encode());
    read_rest(client, &mut bytes[HEADER_SIZE..])?;
    match frame::check_payload(&header, &bytes[HEADER_SIZE..], fds.len(), limits) {
        Ok(()) => Ok(Incoming::Forward(Outgoing {
            posted_write: header.posted()
                && fds.is_empty()
                && frame::Command::from_code(header.command) == Some(frame::Command::RegionWrite),
            bytes,
            sent: 0,
            fds,
            owed: if header.posted() {
                Owed::Posted
            } else {
                Owed::Client
            },
        })),
        Err(e) => Ok(refused(e)),
    }
}

/// Sends as much of `out` to the loop as its socket takes now; true once all of it went.
fn send(loop_end: &UnixStream, out: &mut Outgoing) -> Result<bool, RelayError> {
    while out.sent < out.bytes.len() {
        let rest = &out.bytes[out.sent..];
        let sent = if out.fds.is_empty() {
            let mut loop_end = loop_end;
            loop_end.write(rest)
        } else {
            let raw: Vec<RawFd> = out.fds.iter().map(AsRawFd::as_raw_fd).collect();
            loop_end
                .send_with_fds(&[rest], &raw)
                .map_err(io::Error::from)
        };
        match sent {
            Ok(0) => return Err(RelayError::Loop(io::ErrorKind::WriteZero.into())),
            Ok(n) => {
                // The descriptors went with the first byte; the loop owns copies now.
                out.fds.clear();
                out.sent += n;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(RelayError::Loop(e)),
        }
    }
    Ok(true)
}

/// Waits until one of `fds` is ready, first spinning with `busy`.
fn poll(fds: &mut [libc::pollfd], busy: &mut BusyPoll) -> Result<(), RelayError> {
    let mut failed = None;
    if busy.spin(|| match poll_once(fds, 0) {
        Ok(ready) => ready,
        Err(e) => {
            failed = Some(e);
            true
        }
    }) {
        return failed.map_or(Ok(()), Err);
    }
    poll_once(fds, -1)?;
    busy.woken();
    Ok(())
}

/// One `poll` of `fds` with `timeout_ms` (-1: until one is ready); true if one is.
fn poll_once(fds: &mut [libc::pollfd], timeout_ms: libc::c_int) -> Result<bool, RelayError> {
    loop {
        // SAFETY: `fds` is a valid, exclusively borrowed array of pollfd of the given length.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if rc >= 0 {
            return Ok(rc > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(RelayError::Poll(e));
        }
    }
}

/// What to do with the reply to a message passed to the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owed {
    /// Pass it to the client: it asked.
    Client,
    /// Drop it: the client posted the message.
    Posted,
}

/// The relay: the server's end of the message loop's connection, for the life of the process.
#[derive(Debug)]
pub struct Relay {
    loop_end: UnixStream,
    limits: Limits,
    metrics: Arc<DeviceMetrics>,
    /// Replies owed by the loop, oldest first.
    owed: VecDeque<Owed>,
    /// Bytes read from the loop, not yet a whole reply.
    replies: Vec<u8>,
    chunk: Box<[u8]>,
    busy: BusyPoll,
}

impl Relay {
    /// A relay to the message loop at the other end of `loop_end` (see [`loop_link`]),
    /// checking messages against `limits`, spinning up to `busy_poll` before it blocks.
    pub fn new(
        loop_end: UnixStream,
        limits: Limits,
        metrics: Arc<DeviceMetrics>,
        busy_poll: Duration,
    ) -> Result<Relay, RelayError> {
        loop_end.set_nonblocking(true).map_err(RelayError::Loop)?;
        Ok(Relay {
            loop_end,
            limits,
            metrics,
            owed: VecDeque::new(),
            replies: Vec::new(),
            chunk: vec![0u8; REPLY_CHUNK].into_boxed_slice(),
            busy: BusyPoll::new(busy_poll),
        })
    }

    /// Relays one client connection until it ends and every reply the loop owes for it has
    /// come back. An error means the message loop can no longer be reached.
    ///
    /// The doorbell fast path: a posted REGION_WRITE that arrives while nothing is in flight
    /// to the loop is first offered to `doorbell` (its payload); if that takes it (a notify
    /// write, turned into a worker kick) it goes no further. Nothing before it is unhandled,
    /// so the kick cannot overtake a register write, and a posted write has no reply to owe.
    /// This saves the loop's thread a wake-up on every doorbell (docs/PERFORMANCE.md).
    pub fn serve(
        &mut self,
        client: UnixStream,
        doorbell: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Ended, RelayError> {
        let mut conn = Connection {
            client,
            gone: false,
        };
        let mut pending: Option<Outgoing> = None;
        let mut ended: Option<Ended> = None;
        loop {
            if pending.is_none() && self.owed.is_empty() {
                if let Some(ended) = ended.take() {
                    return Ok(ended);
                }
            }
            let read_client =
                ended.is_none() && pending.is_none() && self.owed.len() < MAX_IN_FLIGHT;
            let mut fds = [
                libc::pollfd {
                    fd: self.loop_end.as_raw_fd(),
                    events: libc::POLLIN | if pending.is_some() { libc::POLLOUT } else { 0 },
                    revents: 0,
                },
                libc::pollfd {
                    fd: if read_client {
                        conn.client.as_raw_fd()
                    } else {
                        -1
                    },
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            poll(&mut fds, &mut self.busy)?;
            if fds[0].revents != 0 {
                self.pump(&mut conn)?;
                if let Some(out) = pending.as_mut()
                    && send(&self.loop_end, out)?
                {
                    pending = None;
                }
            }
            if fds[1].revents != 0 {
                match read_message(&conn.client, &self.limits) {
                    Ok(Incoming::Eof) => ended = Some(Ended::ClientClosed),
                    Ok(Incoming::Forward(out))
                        if out.posted_write
                            && self.owed.is_empty()
                            && doorbell(&out.bytes[HEADER_SIZE..]) => {}
                    Ok(Incoming::Forward(mut out)) => {
                        self.owed.push_back(out.owed);
                        if !send(&self.loop_end, &mut out)? {
                            pending = Some(out);
                        }
                    }
                    Ok(Incoming::Answer(e, header)) => {
                        refuse(&self.metrics, &e, "answered with EINVAL");
                        conn.write(&frame::error_reply(&header, EINVAL));
                    }
                    Ok(Incoming::Close(e)) => {
                        refuse(&self.metrics, &e, "closing the connection");
                        ended = Some(Ended::Refused(e));
                    }
                    Err(e) => {
                        warn!("{e}; closing the connection");
                        ended = Some(Ended::ClientClosed);
                    }
                }
                if conn.gone && ended.is_none() {
                    ended = Some(Ended::ClientClosed);
                }
            }
        }
    }

    /// Reads what the loop has sent and hands every whole reply to its owner.
    fn pump(&mut self, conn: &mut Connection) -> Result<(), RelayError> {
        loop {
            let mut reader = &self.loop_end;
            match reader.read(&mut self.chunk) {
                Ok(0) => return Err(RelayError::LoopClosed),
                Ok(n) => {
                    self.replies.extend_from_slice(&self.chunk[..n]);
                    if n < self.chunk.len() {
                        // A stream read returns all there is: nothing more to read now.
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(RelayError::Loop(e)),
            }
        }
        let mut start = 0;
        while let Some(head) = self.replies.get(start..start + HEADER_SIZE) {
            let head: &[u8; HEADER_SIZE] = head.try_into().expect("header-sized slice");
            let size = Header::parse(head).size;
            if (size as usize) < HEADER_SIZE || size > MAX_FRAME_BYTES {
                return Err(RelayError::BadReply(size));
            }
            let end = start + size as usize;
            let Some(reply) = self.replies.get(start..end) else {
                break;
            };
            match self.owed.pop_front() {
                Some(Owed::Client) => conn.write(reply),
                Some(Owed::Posted) => {}
                None => return Err(RelayError::UnexpectedReply),
            }
            start = end;
        }
        self.replies.drain(..start);
        Ok(())
    }
}

/// One client connection.
struct Connection {
    client: UnixStream,
    /// Writing to it failed: it hung up; what is left for it is dropped.
    gone: bool,
}

impl Connection {
    fn write(&mut self, bytes: &[u8]) {
        if self.gone {
            return;
        }
        let mut client = &self.client;
        if let Err(e) = client.write_all(bytes) {
            log::info!("client gone, dropping its replies: {e}");
            self.gone = true;
        }
    }
}

/// Counts and logs a refused message.
fn refuse(metrics: &DeviceMetrics, e: &FrameError, outcome: &str) {
    inc(&metrics.refused_messages);
    guest_fault!("vfio-user message refused ({e}); {outcome}");
}

#[cfg(test)]
mod tests {
    use std::thread;

    use super::*;
    use vgpu_schedd::busy_poll;

    const REGION_READ: u16 = 9;
    const REGION_WRITE: u16 = 10;
    const DMA_MAP: u16 = 2;
    const NO_REPLY: u32 = 1 << 4;

    /// Config space 256 bytes (index 7 of 9), BAR 4 16 KiB; INTx 1, MSI-X 3.
    fn limits() -> Limits {
        let mut regions = vec![0u64; 9];
        regions[4] = 0x4000;
        regions[7] = 256;
        Limits::new(regions, vec![1, 0, 3, 0, 0])
    }

    fn message(id: u16, command: u16, flags: u32, payload: &[u8]) -> Vec<u8> {
        let header = Header {
            id,
            command,
            size: (HEADER_SIZE + payload.len()) as u32,
            flags,
            error: 0,
        };
        let mut bytes = header.encode().to_vec();
        bytes.extend_from_slice(payload);
        bytes
    }

    fn access(region: u32, offset: u64, count: u32) -> Vec<u8> {
        let mut p = offset.to_le_bytes().to_vec();
        p.extend_from_slice(&region.to_le_bytes());
        p.extend_from_slice(&count.to_le_bytes());
        p
    }

    fn read_header(stream: &UnixStream) -> Option<(Header, Vec<OwnedFd>)> {
        let mut head = [0u8; HEADER_SIZE];
        let (n, fds) = recv_with_fds(stream, &mut head).unwrap();
        if n == 0 {
            return None;
        }
        assert_eq!(n, HEADER_SIZE, "whole headers");
        Some((Header::parse(&head), fds))
    }

    /// A message loop that answers every message with an empty reply (after `delay`) and
    /// reports what it got: (header, descriptors received).
    fn fake_loop(stream: UnixStream, delay: Duration) -> thread::JoinHandle<Vec<(Header, usize)>> {
        thread::spawn(move || {
            let mut seen = Vec::new();
            while let Some((header, fds)) = read_header(&stream) {
                let mut payload = vec![0u8; header.payload_len().unwrap()];
                (&stream).read_exact(&mut payload).unwrap();
                seen.push((header, fds.len()));
                thread::sleep(delay);
                let reply = Header {
                    size: HEADER_SIZE as u32,
                    flags: 1,
                    ..header
                };
                (&stream).write_all(&reply.encode()).unwrap();
            }
            seen
        })
    }

    /// Runs `client` against a relay and a fake loop; returns how the connection ended and
    /// what the loop saw.
    fn run(
        client: impl FnOnce(UnixStream) + Send + 'static,
    ) -> (Ended, Vec<(Header, usize)>, Arc<DeviceMetrics>) {
        run_with(&|_| false, Duration::ZERO, client)
    }

    /// [`run`] with a doorbell and a loop that takes `delay` per reply.
    fn run_with(
        doorbell: &dyn Fn(&[u8]) -> bool,
        delay: Duration,
        client: impl FnOnce(UnixStream) + Send + 'static,
    ) -> (Ended, Vec<(Header, usize)>, Arc<DeviceMetrics>) {
        let (loop_end, loop_peer) = UnixStream::pair().unwrap();
        let (qemu, server_side) = UnixStream::pair().unwrap();
        let metrics = Arc::new(DeviceMetrics::default());
        let mut relay =
            Relay::new(loop_end, limits(), metrics.clone(), busy_poll::DEFAULT_MAX).unwrap();
        let fake = fake_loop(loop_peer, delay);
        let client = thread::spawn(move || client(qemu));
        let ended = relay.serve(server_side, doorbell).unwrap();
        client.join().unwrap();
        drop(relay);
        (ended, fake.join().unwrap(), metrics)
    }

    /// The relay closed the connection (a reset when bytes were left unread).
    fn closed(stream: &UnixStream) -> bool {
        let mut byte = [0u8; 1];
        let mut stream = stream;
        match stream.read(&mut byte) {
            Ok(n) => n == 0,
            Err(e) => e.kind() == io::ErrorKind::ConnectionReset,
        }
    }

    fn reply(stream: &UnixStream) -> Header {
        read_header(stream).expect("a reply").0
    }

    #[test]
    fn posted_messages_go_as_requests_and_their_replies_are_dropped() {
        let (ended, seen, metrics) = run(|qemu| {
            let mut write = access(4, 0x14, 1);
            write.push(0);
            (&qemu)
                .write_all(&message(1, REGION_WRITE, NO_REPLY, &write))
                .unwrap();
            (&qemu)
                .write_all(&message(2, REGION_READ, 0, &access(4, 0x14, 1)))
                .unwrap();
            let r = reply(&qemu);
            assert_eq!((r.id, r.command), (2, REGION_READ), "only the read's reply");
        });
        assert_eq!(ended, Ended::ClientClosed);
        assert_eq!(seen.len(), 2);
        assert!(seen.iter().all(|(h, _)| !h.posted()), "no-reply cleared");
        assert_eq!(get_refused(&metrics), 0);
    }

    #[test]
    fn posted_doorbells_skip_the_loop_unless_something_is_in_flight() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        const DOORBELL: u64 = 0x3000;
        let rung = AtomicUsize::new(0);
        // Takes writes at DOORBELL, as the server's notify decoding does for notify addresses.
        let doorbell = |payload: &[u8]| {
            let taken = frame::region_access(payload).is_some_and(|a| a.offset == DOORBELL);
            if taken {
                rung.fetch_add(1, Ordering::Relaxed);
            }
            taken
        };
        let posted = |offset: u64| {
            let mut write = access(4, offset, 2);
            write.extend_from_slice(&[0, 0]);
            message(9, REGION_WRITE, NO_REPLY, &write)
        };
        // The loop answers slowly: a doorbell sent right behind a request finds it in flight.
        let (ended, seen, _) = run_with(&doorbell, Duration::from_millis(200), move |qemu| {
            // Alone: taken by the doorbell.
            (&qemu).write_all(&posted(DOORBELL)).unwrap();
            // Another posted write: not a doorbell, to the loop.
            (&qemu).write_all(&posted(0x14)).unwrap();
            // A request and a doorbell behind it: the doorbell waits its turn in the loop.
            let mut both = message(2, REGION_READ, 0, &access(4, 0x14, 1));
            both.extend_from_slice(&posted(DOORBELL));
            (&qemu).write_all(&both).unwrap();
            let r = reply(&qemu);
            assert_eq!((r.id, r.command), (2, REGION_READ));
        });
        assert_eq!(ended, Ended::ClientClosed);
        assert_eq!(
            rung.load(Ordering::Relaxed),
            1,
            "one doorbell took the fast path"
        );
        let offsets: Vec<u16> = seen.iter().map(|(h, _)| h.command).collect();
        assert_eq!(
            offsets,
            [REGION_WRITE, REGION_READ, REGION_WRITE],
            "the loop saw the plain write, the read and the doorbell behind it"
        );
    }

    fn get_refused(metrics: &DeviceMetrics) -> u64 {
        crate::metrics::get(&metrics.refused_messages)
    }

    #[test]
    fn refused_requests_are_answered_by_the_relay_alone() {
        let (ended, seen, metrics) = run(|qemu| {
            // A read of 0xffff_ff00 bytes, then a VERSION without its NUL: EINVAL for both,
            // and the stream stays in step for the read after them.
            (&qemu)
                .write_all(&message(1, REGION_READ, 0, &access(4, 0, 0xffff_ff00)))
                .unwrap();
            (&qemu)
                .write_all(&message(2, 1, 0, b"\x00\x00\x01\x00{}"))
                .unwrap();
            (&qemu)
                .write_all(&message(3, REGION_READ, 0, &access(7, 0, 4)))
                .unwrap();
            for id in [1, 2] {
                let r = reply(&qemu);
                assert_eq!((r.id, r.flags, r.error), (id, 1 | 1 << 5, EINVAL));
            }
            assert_eq!(reply(&qemu).id, 3);
        });
        assert_eq!(ended, Ended::ClientClosed);
        assert_eq!(seen.len(), 1, "the loop saw only the valid read");
        assert_eq!(get_refused(&metrics), 2);
    }

    #[test]
    fn descriptors_are_counted_and_passed_on() {
        let (ended, seen, metrics) = run(|qemu| {
            let file = std::fs::File::open("/dev/null").unwrap();
            let fd = file.as_raw_fd();
            let mut map = Vec::new();
            for v in [32u32, 3] {
                map.extend_from_slice(&v.to_le_bytes());
            }
            for v in [0u64, 0x1000, 0x1000] {
                map.extend_from_slice(&v.to_le_bytes());
            }
            let two = message(1, DMA_MAP, 0, &map);
            qemu.send_with_fds(&[&two[..]], &[fd, fd]).unwrap();
            assert_eq!(reply(&qemu).error, EINVAL, "two descriptors");
            let one = message(2, DMA_MAP, 0, &map);
            qemu.send_with_fds(&[&one[..]], &[fd]).unwrap();
            assert_eq!(reply(&qemu).id, 2);
        });
        assert_eq!(ended, Ended::ClientClosed);
        assert_eq!(seen.len(), 1);
        assert_eq!(
            (seen[0].0.id, seen[0].1),
            (2, 1),
            "the descriptor went along"
        );
        assert_eq!(get_refused(&metrics), 1);
    }

    #[test]
    fn a_refused_posted_message_closes_after_what_came_before() {
        let (ended, seen, _) = run(|qemu| {
            (&qemu)
                .write_all(&message(1, REGION_READ, 0, &access(7, 0, 4)))
                .unwrap();
            (&qemu)
                .write_all(&message(2, REGION_WRITE, NO_REPLY, &access(4, 0x3ffe, 4)))
                .unwrap();
            assert_eq!(reply(&qemu).id, 1, "the read before is answered");
            assert!(closed(&qemu), "then the connection closes");
        });
        assert!(matches!(ended, Ended::Refused(FrameError::Region { .. })));
        assert_eq!(seen.len(), 1);
    }

    #[test]
    fn a_huge_message_size_closes_without_reading() {
        let (ended, seen, _) = run(|qemu| {
            let mut m = message(1, REGION_WRITE, 0, &access(4, 0, 0xffff_ff00));
            m[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
            (&qemu).write_all(&m).unwrap();
            assert!(closed(&qemu));
        });
        assert_eq!(ended, Ended::Refused(FrameError::TooLarge(u32::MAX)));
        assert!(seen.is_empty());
    }

    #[test]
    fn a_loop_gone_is_an_error() {
        let (loop_end, loop_peer) = UnixStream::pair().unwrap();
        let (qemu, server_side) = UnixStream::pair().unwrap();
        let mut relay = Relay::new(
            loop_end,
            limits(),
            Arc::new(DeviceMetrics::default()),
            Duration::ZERO,
        )
        .unwrap();
        drop(loop_peer);
        (&qemu)
            .write_all(&message(1, REGION_READ, 0, &access(7, 0, 4)))
            .unwrap();
        assert!(matches!(
            relay.serve(server_side, &|_| false),
            Err(RelayError::LoopClosed | RelayError::Loop(_))
        ));
    }

    #[test]
    fn the_loop_link_leaves_no_name() {
        let dir = std::env::temp_dir().join(format!("vgpu-relay-test-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        let (listener, relay_end) = loop_link(&dir).unwrap();
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        std::fs::remove_dir(&dir).unwrap();
        assert!(left.is_empty(), "nothing left in the directory: {left:?}");
        let (accepted, _) = listener.accept().unwrap();
        (&relay_end).write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        (&accepted).read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        assert!(matches!(
            loop_link(&dir.join("missing")),
            Err(RelayError::Link { .. })
        ));
    }
}
