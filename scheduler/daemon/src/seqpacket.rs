//! Unix `SOCK_SEQPACKET` sockets (one message per packet, boundaries kept, connection
//! oriented) for the daemon and the device processes' client, and the two system calls their
//! users need beside them: the `CLOCK_MONOTONIC` time the protocol carries and `SIGTERM` to a
//! child. This is the crate's only module with `unsafe` code; every block says why it is sound.
//!
//! Sockets are created close-on-exec. A listener and the streams it accepts are non-blocking;
//! a stream from [`SeqStream::connect`] blocks until [`SeqStream::set_nonblocking`] says
//! otherwise. Sends never raise `SIGPIPE` (`MSG_NOSIGNAL`): a closed peer is an error.

use std::ffi::OsStr;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

/// Connections a listener's backlog holds before `accept`: more than the devices of one host
/// start at once.
pub const LISTEN_BACKLOG: i32 = 128;

/// Errors of the socket layer.
#[derive(Debug, Error)]
pub enum SeqError {
    /// A system call failed.
    #[error("{call}: {source}")]
    Sys {
        /// The call.
        call: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The path does not fit a `sockaddr_un` (or contains a NUL byte).
    #[error("socket path {0:?} is empty, too long or contains a NUL byte")]
    BadPath(PathBuf),
    /// A live listener serves the path already.
    #[error("socket path {0:?} is in use by a live listener")]
    InUse(PathBuf),
    /// Something that is not a socket is at the path; it is left alone.
    #[error("{0:?} exists and is not a socket")]
    NotASocket(PathBuf),
    /// A received packet was longer than the buffer; its real length.
    #[error("packet of {0} bytes is longer than the receive buffer")]
    Truncated(usize),
    /// A send took only part of the packet.
    #[error("sent {sent} of {len} bytes")]
    ShortSend {
        /// Bytes sent.
        sent: usize,
        /// Bytes of the packet.
        len: usize,
    },
    /// A send or receive found no room or no data on a non-blocking socket (or timed out).
    #[error("operation would block")]
    WouldBlock,
}

impl SeqError {
    fn last(call: &'static str) -> SeqError {
        let source = io::Error::last_os_error();
        if source.kind() == io::ErrorKind::WouldBlock {
            SeqError::WouldBlock
        } else {
            SeqError::Sys { call, source }
        }
    }

    /// Whether the peer closed its end (EPIPE, ECONNRESET): a disconnect, not a misbehaving
    /// peer.
    pub fn peer_gone(&self) -> bool {
        matches!(self, SeqError::Sys { source, .. } if matches!(
            source.kind(),
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
        ))
    }
}

/// Result of the socket layer.
pub type Result<T> = std::result::Result<T, SeqError>;

/// The credentials of a socket's peer (`SO_PEERCRED`): those of the process that connected
/// or listened, taken at that time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id; 0 when the kernel reports none.
    pub pid: u32,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

/// The credentials of the peer of socket `fd`.
fn peer_cred_of(fd: RawFd) -> Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and `len` is `cred`'s size; on a descriptor
    // that is not a socket (or no longer open) the call fails without touching memory.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(SeqError::last("getsockopt(SO_PEERCRED)"));
    }
    Ok(PeerCred {
        pid: u32::try_from(cred.pid).unwrap_or(0),
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Most descriptors [`accepted_peer`] looks at: far above what a device process holds, and it
/// bounds the scan.
pub const MAX_SCANNED_FDS: usize = 4096;

/// True if `fd` is a connected (not listening) Unix socket whose local address is `path`: a
/// connection accepted on the listener bound there.
fn accepted_on(fd: RawFd, path: &Path) -> bool {
    let mut listening: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `listening` and `len` are valid for writes and `len` is its size; a descriptor
    // that is not a socket makes the call fail without touching memory.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&raw mut listening).cast(),
            &mut len,
        )
    };
    if rc != 0 || listening != 0 {
        return false;
    }
    let mut addr = libc::sockaddr_un {
        sun_family: 0,
        sun_path: [0; 108],
    };
    let mut len = size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: `addr` is a writable sockaddr_un and `len` its size; the kernel writes at most
    // `len` bytes and reports the address's real length back in `len`.
    let rc = unsafe { libc::getsockname(fd, (&raw mut addr).cast(), &mut len) };
    if rc != 0 || addr.sun_family != libc::AF_UNIX as libc::sa_family_t {
        return false;
    }
    let name: Vec<u8> = addr
        .sun_path
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    name == path.as_os_str().as_bytes()
}

/// The credentials of the process connected to this process through the Unix socket it
/// listens on at `path`, found among its own descriptors (`/proc/self/fd`).
///
/// The vfio-user crate accepts QEMU's connection inside its own loop and does not hand the
/// stream out; an accepted socket keeps the listener's address, so this finds it without
/// forking the crate, and SO_PEERCRED then gives QEMU's pid (DESIGN §5). Returns a duplicate of
/// the connection (the crate's own descriptor may be closed by its thread at any time; the
/// duplicate, checked again, is ours) with its peer's credentials, so that it can be handed to
/// the daemon as proof of the pid; `None` if no such connection is open.
pub fn accepted_peer(path: &Path) -> Option<(OwnedFd, PeerCred)> {
    let entries = std::fs::read_dir("/proc/self/fd").ok()?;
    entries
        .take(MAX_SCANNED_FDS)
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<RawFd>().ok())
        .filter(|&fd| fd > 2 && accepted_on(fd, path))
        .find_map(|fd| {
            // SAFETY: F_DUPFD_CLOEXEC takes no pointers; on success the new descriptor is ours.
            let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
            if dup < 0 {
                return None;
            }
            // SAFETY: `dup` was just created and nothing else owns it.
            let dup = unsafe { OwnedFd::from_raw_fd(dup) };
            let cred = peer_cred_of(dup.as_raw_fd()).ok().filter(|c| c.pid != 0)?;
            accepted_on(dup.as_raw_fd(), path).then_some((dup, cred))
        })
}

/// Bytes of one descriptor in `SCM_RIGHTS` data.
const FD_BYTES: u32 = size_of::<RawFd>() as u32;
/// Descriptors the receive buffer has room for: more than the one accepted, so that a peer
/// sending a few extra has them received and closed rather than silently truncated.
const MAX_RECEIVED_FDS: u32 = 4;

/// 64-bit words of the control buffer: room for [`MAX_RECEIVED_FDS`] descriptors' header and
/// data (checked at compile time).
const FD_CONTROL_WORDS: usize = 8;

/// A control-message buffer for `SCM_RIGHTS`, aligned for `cmsghdr`.
struct FdControl {
    buf: [u64; FD_CONTROL_WORDS],
}

impl FdControl {
    fn new() -> Self {
        const _: () = assert!(
            // SAFETY: CMSG_SPACE only computes a size.
            unsafe { libc::CMSG_SPACE(FD_BYTES * MAX_RECEIVED_FDS) } as usize
                <= size_of::<[u64; FD_CONTROL_WORDS]>()
        );
        FdControl {
            buf: [0; FD_CONTROL_WORDS],
        }
    }

    /// The control length for `n` descriptors.
    fn len_for(&self, n: u32) -> usize {
        // SAFETY: CMSG_SPACE only computes a size.
        unsafe { libc::CMSG_SPACE(FD_BYTES * n) as usize }
    }

    /// A `msghdr` with one data buffer and this control buffer, with room for
    /// [`MAX_RECEIVED_FDS`] descriptors.
    fn msghdr(&mut self, iov: &mut libc::iovec) -> libc::msghdr {
        let len = self.len_for(MAX_RECEIVED_FDS);
        // SAFETY: msghdr is plain data, valid all zero.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov;
        msg.msg_iovlen = 1;
        msg.msg_control = self.buf.as_mut_ptr().cast();
        msg.msg_controllen = len as _;
        msg
    }
}

/// `sockaddr_un` for `path` and its length.
fn sockaddr(path: &Path) -> Result<(libc::sockaddr_un, libc::socklen_t)> {
    let bytes = path.as_os_str().as_bytes();
    let mut addr = libc::sockaddr_un {
        sun_family: libc::AF_UNIX as libc::sa_family_t,
        sun_path: [0; 108],
    };
    // Room for the terminating NUL.
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(SeqError::BadPath(path.to_path_buf()));
    }
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + bytes.len() + 1;
    let len = libc::socklen_t::try_from(len).map_err(|_| SeqError::BadPath(path.to_path_buf()))?;
    Ok((addr, len))
}

/// A new `SOCK_SEQPACKET` socket with `flags` (`SOCK_CLOEXEC`, `SOCK_NONBLOCK`).
fn new_socket(flags: libc::c_int) -> Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | flags, 0) };
    if fd < 0 {
        return Err(SeqError::last("socket"));
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A listening `SOCK_SEQPACKET` socket bound to a path.
#[derive(Debug)]
pub struct SeqListener {
    fd: OwnedFd,
    path: PathBuf,
}

impl SeqListener {
    /// Listens at `path`. A socket file left by a listener that is gone (nothing accepts on
    /// it) is removed first; a live listener ([`SeqError::InUse`]) or a file that is not a
    /// socket ([`SeqError::NotASocket`]) is left alone and refused.
    pub fn bind(path: &Path) -> Result<SeqListener> {
        let (addr, len) = sockaddr(path)?;
        remove_stale(path, |p| match SeqStream::connect(p) {
            Ok(_) => Ok(true),
            Err(SeqError::Sys { source, .. })
                if source.raw_os_error() == Some(libc::ECONNREFUSED) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        })?;
        let fd = new_socket(libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK)?;
        // SAFETY: `addr` is a valid sockaddr_un and `len` does not exceed its size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast::<libc::sockaddr>(),
                len,
            )
        };
        if rc != 0 {
            return Err(SeqError::last("bind"));
        }
        // SAFETY: listen(2) takes no pointers.
        if unsafe { libc::listen(fd.as_raw_fd(), LISTEN_BACKLOG) } != 0 {
            return Err(SeqError::last("listen"));
        }
        Ok(SeqListener {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The path it listens at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts one pending connection (non-blocking, close-on-exec) with its peer's
    /// credentials; `None` when none is pending.
    pub fn accept(&self) -> Result<Option<(SeqStream, PeerCred)>> {
        // SAFETY: null address pointers are allowed (the peer address is not wanted).
        let fd = unsafe {
            libc::accept4(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            )
        };
        if fd < 0 {
            return match SeqError::last("accept4") {
                SeqError::WouldBlock => Ok(None),
                e => Err(e),
            };
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let stream = SeqStream { fd };
        let cred = stream.peer_cred()?;
        Ok(Some((stream, cred)))
    }
}

impl AsRawFd for SeqListener {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for SeqListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Before binding `path`: Ok when nothing is there or a stale socket file was removed.
/// `live` says whether a listener answers at the path.
pub fn remove_stale(path: &Path, live: impl FnOnce(&Path) -> Result<bool>) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(SeqError::Sys {
                call: "stat",
                source,
            });
        }
    };
    if !meta.file_type().is_socket() {
        return Err(SeqError::NotASocket(path.to_path_buf()));
    }
    if live(path)? {
        return Err(SeqError::InUse(path.to_path_buf()));
    }
    log::info!("removing stale socket {}", path.display());
    std::fs::remove_file(path).map_err(|source| SeqError::Sys {
        call: "unlink",
        source,
    })
}

/// A connected `SOCK_SEQPACKET` socket.
#[derive(Debug)]
pub struct SeqStream {
    fd: OwnedFd,
}

impl SeqStream {
    /// Connects to the listener at `path` (blocking, close-on-exec).
    pub fn connect(path: &Path) -> Result<SeqStream> {
        let (addr, len) = sockaddr(path)?;
        let fd = new_socket(libc::SOCK_CLOEXEC)?;
        // SAFETY: `addr` is a valid sockaddr_un and `len` does not exceed its size.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&raw const addr).cast::<libc::sockaddr>(),
                len,
            )
        };
        if rc != 0 {
            return Err(SeqError::last("connect"));
        }
        Ok(SeqStream { fd })
    }

    /// Sends `packet` as one message. [`SeqError::WouldBlock`] when the peer's queue is full
    /// on a non-blocking socket.
    pub fn send(&self, packet: &[u8]) -> Result<()> {
        // SAFETY: the pointer and length describe `packet`, which outlives the call.
        let n = unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        let sent = usize::try_from(n).map_err(|_| SeqError::last("send"))?;
        if sent != packet.len() {
            return Err(SeqError::ShortSend {
                sent,
                len: packet.len(),
            });
        }
        Ok(())
    }

    /// Receives one message into `buf`: `Some(n)` with its length, `Some(0)` at end of stream
    /// (the peer closed; an empty packet reads the same and is taken as closing), `None` when
    /// nothing is there on a non-blocking socket or a read timeout passed.
    /// [`SeqError::Truncated`] when the packet was longer than `buf` (its tail is lost): use a
    /// buffer one byte longer than the largest valid message.
    pub fn recv(&self, buf: &mut [u8]) -> Result<Option<usize>> {
        // SAFETY: the pointer and length describe `buf`, which outlives the call; with
        // MSG_TRUNC the kernel still writes at most `buf.len()` bytes.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_TRUNC,
            )
        };
        let Ok(n) = usize::try_from(n) else {
            return match SeqError::last("recv") {
                SeqError::WouldBlock => Ok(None),
                e => Err(e),
            };
        };
        if n > buf.len() {
            return Err(SeqError::Truncated(n));
        }
        Ok(Some(n))
    }

    /// Sends `packet` as one message carrying one descriptor, `fd`, as `SCM_RIGHTS` ancillary
    /// data: the receiver gets its own copy of the descriptor with the packet.
    pub fn send_with_fd(&self, packet: &[u8], fd: BorrowedFd<'_>) -> Result<()> {
        self.send_fds(packet, &[fd])
    }

    /// Sends `packet` with `fds` (at most [`MAX_RECEIVED_FDS`]; the rest are not sent) in one
    /// `SCM_RIGHTS` header.
    fn send_fds(&self, packet: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        let fds = fds.get(..MAX_RECEIVED_FDS as usize).unwrap_or(fds);
        let count = u32::try_from(fds.len()).unwrap_or(MAX_RECEIVED_FDS);
        let mut control = FdControl::new();
        let mut iov = libc::iovec {
            iov_base: packet.as_ptr().cast_mut().cast(),
            iov_len: packet.len(),
        };
        let mut msg = control.msghdr(&mut iov);
        // SAFETY: `msg` points at `control`, whose buffer has room for the header and data of
        // MAX_RECEIVED_FDS descriptors (CMSG_SPACE), so CMSG_FIRSTHDR is non-null and the
        // `count` descriptors after CMSG_DATA are in the buffer; written unaligned, as they may be.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(FD_BYTES * count) as _;
            let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(data.add(i), fd.as_raw_fd());
            }
        }
        msg.msg_controllen = control.len_for(count);
        // SAFETY: `msg` describes `packet` (read only by the kernel) and `control`, both of
        // which outlive the call.
        let n = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        let sent = usize::try_from(n).map_err(|_| SeqError::last("sendmsg"))?;
        if sent != packet.len() {
            return Err(SeqError::ShortSend {
                sent,
                len: packet.len(),
            });
        }
        Ok(())
    }

    /// Receives one message into `buf` like [`SeqStream::recv`], with the descriptor it
    /// carries, if exactly one came with it. Descriptors beyond the first, and all of them when
    /// the kernel had to drop some (`MSG_CTRUNC`) or they came in more than one header, are
    /// closed and none is returned: a peer gets one descriptor through, or none.
    pub fn recv_with_fd(&self, buf: &mut [u8]) -> Result<Option<(usize, Option<OwnedFd>)>> {
        let mut control = FdControl::new();
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut msg = control.msghdr(&mut iov);
        // SAFETY: `msg` describes `buf` and `control`, both of which outlive the call; the
        // kernel writes at most their lengths.
        let n = unsafe {
            libc::recvmsg(
                self.fd.as_raw_fd(),
                &mut msg,
                libc::MSG_TRUNC | libc::MSG_CMSG_CLOEXEC,
            )
        };
        let Ok(n) = usize::try_from(n) else {
            return match SeqError::last("recvmsg") {
                SeqError::WouldBlock => Ok(None),
                e => Err(e),
            };
        };
        let mut fds = Vec::new();
        // SAFETY: the kernel filled `control` up to `msg.msg_controllen`; CMSG_FIRSTHDR and
        // CMSG_NXTHDR stay within it, and each SCM_RIGHTS header's data holds
        // (cmsg_len - CMSG_LEN(0)) / 4 descriptors that are now ours, read unaligned.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let bytes =
                        ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                    let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                    for i in 0..bytes / size_of::<RawFd>() {
                        let raw = std::ptr::read_unaligned(data.add(i));
                        fds.push(OwnedFd::from_raw_fd(raw));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        if n > buf.len() {
            return Err(SeqError::Truncated(n));
        }
        let whole = msg.msg_flags & libc::MSG_CTRUNC == 0;
        // Every descriptor but a single one is closed here, as `fds` drops.
        let fd = if whole && fds.len() == 1 {
            fds.pop()
        } else {
            None
        };
        Ok(Some((n, fd)))
    }

    /// The credentials of the peer.
    pub fn peer_cred(&self) -> Result<PeerCred> {
        peer_cred_of(self.fd.as_raw_fd())
    }

    /// Makes the socket non-blocking (or blocking again).
    pub fn set_nonblocking(&self, on: bool) -> Result<()> {
        // SAFETY: fcntl(F_GETFL) takes no pointers.
        let flags = unsafe { libc::fcntl(self.fd.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 {
            return Err(SeqError::last("fcntl(F_GETFL)"));
        }
        let flags = if on {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        // SAFETY: fcntl(F_SETFL) takes an int argument, no pointers.
        if unsafe { libc::fcntl(self.fd.as_raw_fd(), libc::F_SETFL, flags) } != 0 {
            return Err(SeqError::last("fcntl(F_SETFL)"));
        }
        Ok(())
    }

    /// Bounds how long a blocking [`SeqStream::recv`] waits (`None`: forever); after it,
    /// `recv` returns `None`.
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> Result<()> {
        let t = timeout.unwrap_or(Duration::ZERO);
        let tv = libc::timeval {
            tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
            // Below 1_000_000: fits every suseconds_t.
            tv_usec: t.subsec_micros() as libc::suseconds_t,
        };
        // A zero timeval means "no timeout" to the kernel; a tiny request must still time out.
        let tv = if timeout.is_some() && tv.tv_sec == 0 && tv.tv_usec == 0 {
            libc::timeval {
                tv_sec: 0,
                tv_usec: 1,
            }
        } else {
            tv
        };
        // SAFETY: `tv` is a valid timeval and the length is its size.
        let rc = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(SeqError::last("setsockopt(SO_RCVTIMEO)"));
        }
        Ok(())
    }
}

impl AsRawFd for SeqStream {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for SeqStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: the time base of the wire protocol.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is valid for writes; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

/// Sends `SIGTERM` to process `pid` (a child the caller spawned and has not reaped, so the
/// pid cannot have been reused). Pids outside 1..=i32::MAX are refused.
pub fn terminate(pid: u32) -> Result<()> {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return Err(SeqError::Sys {
            call: "kill",
            source: io::Error::from_raw_os_error(libc::ESRCH),
        });
    };
    if pid <= 0 {
        return Err(SeqError::Sys {
            call: "kill",
            source: io::Error::from_raw_os_error(libc::ESRCH),
        });
    }
    // SAFETY: kill(2) takes no pointers; `pid` is positive, so it names one process.
    if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
        return Err(SeqError::last("kill"));
    }
    Ok(())
}

/// Whether `path` is usable as a socket path (fits a `sockaddr_un`).
pub fn valid_path(path: &OsStr) -> bool {
    sockaddr(Path::new(path)).is_ok()
}

/// The credentials of the peer of any connected Unix socket (a control client's stream, say).
pub fn peer_cred(socket: BorrowedFd<'_>) -> Result<PeerCred> {
    peer_cred_of(socket.as_raw_fd())
}

/// Most supplementary groups [`peer_groups`] takes: the kernel's `NGROUPS_MAX`.
pub const MAX_PEER_GROUPS: usize = 65536;

/// The supplementary groups of the peer of a connected Unix socket (`SO_PEERGROUPS`), as the
/// kernel recorded them when the peer connected. Unlike `/proc/PID/status` they cannot belong
/// to another process that reused the peer's pid since.
pub fn peer_groups(socket: BorrowedFd<'_>) -> Result<Vec<u32>> {
    let gid_size = size_of::<libc::gid_t>();
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let bytes = groups.len().saturating_mul(gid_size);
        let mut len = libc::socklen_t::try_from(bytes).unwrap_or(libc::socklen_t::MAX);
        // SAFETY: `groups` is valid for writes of `len` bytes (its length times the size of
        // a gid_t); the kernel writes at most `len` bytes and stores the length it needs or
        // wrote in `len`.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let needed = usize::try_from(len).unwrap_or(usize::MAX) / gid_size;
        if rc == 0 {
            groups.truncate(needed);
            return Ok(groups);
        }
        let source = io::Error::last_os_error();
        // Too small a buffer: the kernel said how many there are; grow once and ask again.
        if source.raw_os_error() == Some(libc::ERANGE)
            && needed > groups.len()
            && needed <= MAX_PEER_GROUPS
        {
            groups.resize(needed, 0);
            continue;
        }
        return Err(SeqError::Sys {
            call: "getsockopt(SO_PEERGROUPS)",
            source,
        });
    }
}

/// The process's effective user id.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid(2) takes no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

/// Runs `f` with the process's file mode creation mask set to `mask`, then puts the previous
/// mask back: a socket `f` binds is created with `0o777 & !mask` from the start, with no
/// window in which it is wider. The mask is process-wide: call this while no other thread
/// creates files (the daemon binds its sockets before it starts any thread).
pub fn with_umask<T>(mask: u32, f: impl FnOnce() -> T) -> T {
    // SAFETY: umask(2) takes no pointers and cannot fail.
    let old = unsafe { libc::umask(mask) };
    let result = f();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    result
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    fn pair() -> (SeqStream, SeqStream) {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors socketpair writes.
        let rc = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0);
        let own = |fd| SeqStream {
            // SAFETY: both descriptors were just created and are owned by nothing else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        };
        (own(fds[0]), own(fds[1]))
    }

    /// True while `fd` is an open descriptor of this process.
    fn open(fd: RawFd) -> bool {
        // SAFETY: F_GETFD takes no pointers.
        unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
    }

    #[test]
    fn a_closed_peer_is_told_from_a_full_queue() {
        let (a, b) = pair();
        a.set_nonblocking(true).unwrap();
        // Nobody reads b: the queue fills and a send would block, which is not a closed peer.
        let full = (0..100_000)
            .map(|_| a.send(&[0u8; 1024]))
            .find_map(Result::err)
            .expect("the queue fills");
        assert!(
            matches!(full, SeqError::WouldBlock) && !full.peer_gone(),
            "{full}"
        );
        drop(b);
        let gone = a.send(b"bye").unwrap_err();
        assert!(gone.peer_gone(), "{gone}");
    }

    #[test]
    fn one_descriptor_goes_through_with_its_packet_and_extra_ones_are_closed() {
        let (a, b) = pair();
        let (x, _y) = UnixStream::pair().unwrap();
        let mut buf = [0u8; 16];
        // One descriptor: received, and it is the same socket (its peer is this process).
        a.send_with_fd(b"hello", x.as_fd()).unwrap();
        let (n, fd) = b.recv_with_fd(&mut buf).unwrap().unwrap();
        assert_eq!(&buf[..n], b"hello");
        let fd = fd.expect("one descriptor");
        assert_eq!(peer_cred(fd.as_fd()).unwrap().pid, std::process::id());
        // None: a plain packet.
        a.send(b"plain").unwrap();
        let (n, fd) = b.recv_with_fd(&mut buf).unwrap().unwrap();
        assert_eq!((&buf[..n], fd.is_none()), (&b"plain"[..], true));
        // Two: neither is returned, and both received copies are closed.
        let before: Vec<RawFd> = (3..256).filter(|&fd| open(fd)).collect();
        a.send_fds(b"two", &[x.as_fd(), x.as_fd()]).unwrap();
        let (n, fd) = b.recv_with_fd(&mut buf).unwrap().unwrap();
        assert_eq!((&buf[..n], fd.is_none()), (&b"two"[..], true));
        let after: Vec<RawFd> = (3..256).filter(|&fd| open(fd)).collect();
        assert_eq!(before, after, "no descriptor leaked");
    }

    use super::*;

    #[test]
    fn the_peer_of_an_accepted_stream_is_found_by_the_listeners_address() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vfio.sock");
        let other = dir.path().join("other.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let _unrelated = std::os::unix::net::UnixListener::bind(&other).unwrap();
        assert!(
            accepted_peer(&path).is_none(),
            "a listener alone is no connection"
        );
        let _client = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let (_accepted, _) = listener.accept().unwrap();
        let (dup, peer) = accepted_peer(&path).expect("the accepted connection is found");
        assert_eq!(peer.pid, std::process::id());
        assert_eq!(peer_cred(dup.as_fd()).unwrap().pid, std::process::id());
        assert!(accepted_peer(&other).is_none());
    }

    #[test]
    fn packets_keep_boundaries_and_truncation_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let l = SeqListener::bind(&path).unwrap();
        assert!(l.accept().unwrap().is_none());
        let c = SeqStream::connect(&path).unwrap();
        let (s, cred) = l.accept().unwrap().unwrap();
        assert_eq!(cred.pid, std::process::id());
        c.send(b"one").unwrap();
        c.send(b"two!").unwrap();
        c.send(&[7; 10]).unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(s.recv(&mut buf).unwrap(), Some(3));
        assert_eq!(s.recv(&mut buf).unwrap(), Some(4));
        assert_eq!(&buf[..4], b"two!");
        assert!(matches!(s.recv(&mut buf), Err(SeqError::Truncated(10))));
        assert_eq!(s.recv(&mut buf).unwrap(), None);
        drop(c);
        assert_eq!(s.recv(&mut buf).unwrap(), Some(0));
        assert!(s.send(b"x").is_err());
    }

    #[test]
    fn read_timeout_returns_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let l = SeqListener::bind(&path).unwrap();
        let c = SeqStream::connect(&path).unwrap();
        c.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
        assert_eq!(c.recv(&mut [0; 4]).unwrap(), None);
        c.set_nonblocking(true).unwrap();
        assert_eq!(c.recv(&mut [0; 4]).unwrap(), None);
        drop(l);
    }

    #[test]
    fn live_listener_refused_stale_socket_replaced_other_files_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let l = SeqListener::bind(&path).unwrap();
        assert!(matches!(SeqListener::bind(&path), Err(SeqError::InUse(_))));
        drop(l);
        // The file stays; nobody listens.
        assert!(path.exists());
        let l = SeqListener::bind(&path).unwrap();
        assert_eq!(l.path(), path);
        let file = dir.path().join("f");
        std::fs::write(&file, b"keep").unwrap();
        assert!(matches!(
            SeqListener::bind(&file),
            Err(SeqError::NotASocket(_))
        ));
        assert_eq!(std::fs::read(&file).unwrap(), b"keep");
    }

    #[test]
    fn bad_paths_refused() {
        let long = PathBuf::from("/".repeat(200));
        assert!(matches!(
            SeqListener::bind(&long),
            Err(SeqError::BadPath(_))
        ));
        assert!(matches!(
            SeqStream::connect(Path::new("")),
            Err(SeqError::BadPath(_))
        ));
        assert!(!valid_path(OsStr::new("a\0b")));
        assert!(SeqStream::connect(Path::new("/nonexistent/x")).is_err());
    }

    #[test]
    fn clock_moves_and_terminate_checks_pid() {
        let a = monotonic_ns();
        let b = monotonic_ns();
        assert!(a > 0 && b >= a);
        assert!(terminate(0).is_err());
        assert!(terminate(u32::MAX).is_err());
    }
}
