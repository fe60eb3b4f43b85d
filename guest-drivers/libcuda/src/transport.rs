//! How requests reach the host. [`SocketTransport`]: a Unix socket to `vgpu-cuda-host` (the
//! same host code a VM's compute context uses), for running the library on the host without a
//! VM: tests, and a GPU host; bulk copies go through a memory region shared with the host
//! ([`shm`]) where the host takes it. In a guest, [`crate::drm::DrmTransport`]: the vGPU's virtio-gpu
//! device through the kernel's DRM driver.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use mdev_backend::compute::backend::{ContextId, StreamId};
use mdev_backend::compute::remote::RemoteError;
use mdev_backend::compute::shm;
use mdev_backend::compute::wire::{Reply, Request, WireError};
use thiserror::Error;

/// Environment variable naming the host socket.
pub const SOCKET_ENV: &str = "VGPU_CUDA_SOCKET";

/// The transport `cuInit` uses: the socket named by [`SOCKET_ENV`] when it is set, else the
/// vGPU's virtio-gpu render node.
pub fn connect() -> Result<Box<dyn Transport>, String> {
    match std::env::var(SOCKET_ENV) {
        Ok(path) => match SocketTransport::connect(&path) {
            Ok(t) => Ok(Box::new(t)),
            Err(e) => Err(format!("{SOCKET_ENV}={path}: {e}")),
        },
        Err(_) => crate::drm::DrmTransport::open()
            .map(|t| Box::new(t) as Box<dyn Transport>)
            .map_err(|e: TransportError| e.to_string()),
    }
}
/// Longest wait for one reply: a kernel may run this long on the host before the driver
/// reports the connection lost (the host's own launch budget ends runaway kernels sooner).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Error)]
pub enum TransportError {
    #[error("host connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad reply: {0}")]
    Wire(#[from] WireError),
    #[error("no virtio-gpu render node {path}: {source}")]
    NoDevice {
        path: String,
        source: std::io::Error,
    },
    #[error("the virtio-gpu device lacks {0}")]
    Missing(&'static str),
    #[error("{ioctl} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    Ioctl { ioctl: &'static str, errno: i32 },
    #[error("virtio-gpu compute: {0}")]
    Device(String),
    #[error("request of {len} bytes past the largest buffer, {max} bytes")]
    RequestTooLarge { len: usize, max: usize },
    #[error("reply of {len} bytes past the buffer's capacity of {capacity} bytes")]
    ReplyPastCapacity { len: u64, capacity: usize },
    #[error("no reply within {0:?}")]
    Timeout(Duration),
}

impl From<RemoteError> for TransportError {
    fn from(e: RemoteError) -> Self {
        match e {
            RemoteError::Io(e) => TransportError::Io(e),
            RemoteError::Wire(e) => TransportError::Wire(e),
            RemoteError::Shared(why) => TransportError::Device(why.into()),
        }
    }
}

/// A request–reply channel to the host.
pub trait Transport: Send {
    fn call(&mut self, req: &Request) -> Result<Reply, TransportError>;

    /// The region shared with the host for bulk copies, where this transport has one.
    fn shared(&mut self) -> Option<Shared<'_>> {
        None
    }

    /// The channel for page-locked allocations shared with the host, where this transport
    /// has one.
    fn pinned(&mut self) -> Option<Pinned<'_>> {
        None
    }
}

/// Page-locked allocations a [`SocketTransport`] shares with the host ([`shm`]): each a memory
/// file both map, so a copy whose host side lies in one moves between it and device memory
/// on the host, with no copy here and no bytes in the message.
#[derive(Debug)]
pub struct Pinned<'a> {
    stream: &'a mut UnixStream,
}

impl Pinned<'_> {
    /// A page-locked allocation of `bytes`, or the host's refusal (an error reply).
    pub fn alloc(self, bytes: u64) -> Result<Result<shm::PinnedMemory, Reply>, TransportError> {
        Ok(shm::PinnedMemory::create(self.stream, bytes)?)
    }

    /// A page-locked allocation of `bytes` at `start`, its memory file mapped there by
    /// `place`, or the host's refusal.
    pub fn alloc_at(
        self,
        start: u64,
        bytes: u64,
        place: impl FnOnce(std::os::fd::BorrowedFd<'_>) -> std::io::Result<()>,
    ) -> Result<Result<shm::PinnedMemory, Reply>, TransportError> {
        Ok(shm::PinnedMemory::create_at(
            self.stream,
            start,
            bytes,
            place,
        )?)
    }

    /// Gives `memory` back to the host: its answer.
    pub fn free(self, memory: shm::PinnedMemory) -> Result<Reply, TransportError> {
        Ok(memory.free(self.stream)?)
    }

    /// Copies `len` bytes at `offset` of `memory` to device address `addr` (`to_device`) or
    /// from it: the host's answer (`Done` or the copy's error), after which the host no
    /// longer touches the range.
    #[allow(clippy::too_many_arguments)]
    pub fn copy(
        self,
        memory: &shm::PinnedMemory,
        ctx: ContextId,
        stream: StreamId,
        to_device: bool,
        addr: u64,
        offset: u64,
        len: u64,
    ) -> Result<Reply, TransportError> {
        Ok(memory.copy(self.stream, ctx, stream, to_device, addr, offset, len)?)
    }
}

/// Bulk copies through the memory region a [`SocketTransport`] shares with the host
/// ([`shm`]): the bytes move through the region, the socket carries their descriptions.
#[derive(Debug)]
pub struct Shared<'a> {
    stream: &'a mut UnixStream,
    client: &'a shm::Client,
}

impl Shared<'_> {
    /// Host to device; the host's answer (`Done` or the copy's error).
    pub fn htod(
        self,
        ctx: ContextId,
        dst: u64,
        src: &[u8],
        stream: StreamId,
    ) -> Result<Reply, TransportError> {
        Ok(self.client.htod(self.stream, ctx, dst, src, stream)?)
    }

    /// Device to host; the host's answer (`Done` or the copy's error).
    pub fn dtoh(
        self,
        ctx: ContextId,
        dst: &mut [u8],
        src: u64,
        stream: StreamId,
    ) -> Result<Reply, TransportError> {
        Ok(self.client.dtoh(self.stream, ctx, src, dst, stream)?)
    }
}

/// A Unix socket to `vgpu-cuda-host`, with a region shared with it for bulk copies where the
/// host takes one.
#[derive(Debug)]
pub struct SocketTransport {
    stream: UnixStream,
    shared: Option<shm::Client>,
    /// The host speaks the shared-memory protocol (it took or refused the region): page-locked
    /// allocations are shared with it.
    pins: bool,
}

impl SocketTransport {
    /// Connects to `path` and offers the host a shared region. A host without shared memory
    /// (an older one) answers an error and closes the connection: it is connected to again,
    /// and served over the socket alone.
    pub fn connect(path: &str) -> Result<Self, TransportError> {
        let t = Self::over_shared(UnixStream::connect(path)?)?;
        match t.offer {
            Offer::Unknown => Self::over(UnixStream::connect(path)?),
            Offer::Taken | Offer::Refused => Ok(t.transport),
        }
    }

    /// Over a connected stream (one end of a socket pair, in benchmarks and tests), the
    /// socket alone.
    pub fn over(stream: UnixStream) -> Result<Self, TransportError> {
        stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
        Ok(SocketTransport {
            stream,
            shared: None,
            pins: false,
        })
    }

    /// Over a connected stream, offering the host a shared region: what it answered. Where
    /// it did not know the offer the stream is closed.
    pub fn over_shared(stream: UnixStream) -> Result<Offered, TransportError> {
        let mut transport = Self::over(stream)?;
        let offer = match shm::Client::offer(&mut transport.stream)? {
            shm::Offer::Taken(client) => {
                transport.shared = Some(client);
                transport.pins = true;
                Offer::Taken
            }
            shm::Offer::Refused(_) => {
                transport.pins = true;
                Offer::Refused
            }
            shm::Offer::Unknown => Offer::Unknown,
        };
        Ok(Offered { transport, offer })
    }

    /// Whether bulk copies go through a shared region.
    pub fn is_shared(&self) -> bool {
        self.shared.is_some()
    }
}

/// A transport and what became of its offer of a shared region.
#[derive(Debug)]
pub struct Offered {
    pub transport: SocketTransport,
    pub offer: Offer,
}

/// What the host answered to the offer of a shared region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// Bulk copies go through it.
    Taken,
    /// Refused (its limit, its budget): the connection goes on over the socket.
    Refused,
    /// Unknown to the host, which closed the connection.
    Unknown,
}

impl Transport for SocketTransport {
    fn call(&mut self, req: &Request) -> Result<Reply, TransportError> {
        self.stream.write_all(&req.encode())?;
        Ok(Reply::read_from(&mut self.stream)??)
    }

    fn shared(&mut self) -> Option<Shared<'_>> {
        Some(Shared {
            client: self.shared.as_ref()?,
            stream: &mut self.stream,
        })
    }

    fn pinned(&mut self) -> Option<Pinned<'_>> {
        self.pins.then_some(Pinned {
            stream: &mut self.stream,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Driver;
    use mdev_backend::budget::MemoryBudget;
    use mdev_backend::compute::remote::{Limits, serve};
    use mdev_backend::compute::{ComputeError, CpuBackend, CpuConfig};
    use std::sync::Arc;

    /// Serves `stream` on a CPU backend charged to `budget`.
    fn host(mut stream: UnixStream, budget: Arc<MemoryBudget>) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let config = CpuConfig {
                budget,
                ..CpuConfig::default()
            };
            let limits = Limits::new(&config.budget);
            let mut be = CpuBackend::new(config);
            serve(&mut stream, &mut be, &limits).1.unwrap();
        })
    }

    /// Copies `n` patterned bytes to the device and back through `d`, in one copy each way.
    fn round_trip(d: &mut Driver<SocketTransport>, n: usize) {
        let ctx = d.context_create().unwrap();
        let buf = d.mem_alloc(ctx, n as u64).unwrap();
        let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8 ^ (i >> 16) as u8).collect();
        d.copy_htod(ctx, buf, &data, 0).unwrap();
        let mut back = vec![0u8; n];
        d.copy_dtoh(ctx, &mut back, buf, 0).unwrap();
        assert!(back == data, "{n} bytes came back intact");
        // Past the allocation: the host's error is the copy's.
        assert!(d.copy_htod(ctx, buf + 1, &data, 0).is_err());
        assert!(d.copy_dtoh(ctx, &mut back, buf + 1, 0).is_err());
        d.mem_free(ctx, buf).unwrap();
    }

    #[test]
    fn copies_go_through_the_region_the_host_takes() {
        let (a, b) = UnixStream::pair().unwrap();
        let served = host(b, MemoryBudget::new(1 << 30));
        let offered = SocketTransport::over_shared(a).unwrap();
        assert_eq!(offered.offer, Offer::Taken);
        assert!(offered.transport.is_shared());
        let mut d = Driver::new(offered.transport).unwrap();
        // Small copies still go in messages, large ones through the region's ring.
        for n in [4096, 3 * shm::CLIENT_REGION_BYTES + 777] {
            round_trip(&mut d, n);
        }
        drop(d);
        served.join().unwrap();
    }

    #[test]
    fn a_host_that_refuses_the_region_is_used_over_the_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let budget = MemoryBudget::new(1 << 30);
        let served = host(b, Arc::clone(&budget));
        // All but a byte too few for the region and the host's buffer are taken.
        let room = (shm::CLIENT_REGION_BYTES + shm::BOUNCE_BYTES) as u64 - 1;
        let taken = budget.charge(budget.limit() - room).unwrap();
        let offered = SocketTransport::over_shared(a).unwrap();
        drop(taken);
        assert_eq!(offered.offer, Offer::Refused);
        assert!(!offered.transport.is_shared());
        let mut d = Driver::new(offered.transport).unwrap();
        round_trip(&mut d, 1 << 20);
        drop(d);
        served.join().unwrap();
    }

    #[test]
    fn an_older_host_is_connected_to_again_over_the_socket() {
        let dir = std::env::temp_dir().join(format!("vgpu-libcuda-older-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("host.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let older = std::thread::spawn(move || {
            // The first connection as a host without shared memory answers an unknown
            // opcode: an error, then the connection ends.
            let (mut first, _) = listener.accept().unwrap();
            let mut header = [0u8; 4];
            std::io::Read::read_exact(&mut first, &mut header).unwrap();
            let mut body = vec![0; mdev_backend::compute::wire::body_len(header).unwrap()];
            std::io::Read::read_exact(&mut first, &mut body).unwrap();
            let e = Request::decode(&body).unwrap_err();
            let reply = Reply::error(&ComputeError::InvalidValue(e.to_string()));
            first.write_all(&reply.encode()).unwrap();
            drop(first);
            let (second, _) = listener.accept().unwrap();
            host(second, MemoryBudget::new(1 << 30)).join().unwrap();
        });
        let t = SocketTransport::connect(path.to_str().unwrap()).unwrap();
        assert!(!t.is_shared());
        let mut d = Driver::new(t).unwrap();
        round_trip(&mut d, 4 << 20);
        drop(d);
        older.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A driver over a socket pair to a CPU backend charged to `budget`, sharing memory with
    /// it; the served connection's thread.
    fn shared_driver(
        budget: &Arc<MemoryBudget>,
    ) -> (Driver<SocketTransport>, std::thread::JoinHandle<()>) {
        let (a, b) = UnixStream::pair().unwrap();
        let served = host(b, Arc::clone(budget));
        let offered = SocketTransport::over_shared(a).unwrap();
        assert_eq!(offered.offer, Offer::Taken);
        (Driver::new(offered.transport).unwrap(), served)
    }

    #[test]
    fn pinned_memory_is_charged_until_freed_or_the_connection_ends() {
        let budget = MemoryBudget::new(1 << 30);
        let (mut d, served) = shared_driver(&budget);
        let ctx = d.context_create().unwrap();
        let idle = budget.used();
        for _ in 0..2 {
            let p = d.pinned_alloc(ctx, 100_003, 0).unwrap().expect("shared");
            assert!(budget.used() >= idle + 100_003, "charged");
            assert!(matches!(
                d.pointer_info(p + 100_002),
                Some(crate::driver::PointerInfo::Host { device: None, .. })
            ));
            d.host_memory_remove(p, false).unwrap();
            assert!(d.pinned_free(p).unwrap());
            assert!(!d.pinned_free(p).unwrap(), "freed once");
            assert_eq!(budget.used(), idle, "the charge is given back");
        }
        // Held at the end: given back with the connection, its contexts destroyed.
        d.pinned_alloc(ctx, 1 << 20, 0).unwrap().expect("shared");
        drop(d);
        served.join().unwrap();
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn pinned_memory_past_the_budget_is_out_of_memory() {
        let budget = MemoryBudget::new(256 << 20);
        let (mut d, served) = shared_driver(&budget);
        let ctx = d.context_create().unwrap();
        assert_eq!(
            d.pinned_alloc(ctx, 256 << 20, 0),
            Err(crate::status::CUDA_ERROR_OUT_OF_MEMORY)
        );
        assert_eq!(
            d.pinned_alloc(ctx, shm::MAX_PINNED_BYTES + 1, 0),
            Err(crate::status::CUDA_ERROR_OUT_OF_MEMORY)
        );
        // The connection goes on.
        assert!(d.pinned_alloc(ctx, 1 << 20, 0).unwrap().is_some());
        drop(d);
        served.join().unwrap();
    }

    #[test]
    fn without_shared_memory_there_is_no_pinned_allocation_to_share() {
        let (a, b) = UnixStream::pair().unwrap();
        let served = host(b, MemoryBudget::new(1 << 30));
        let mut d = Driver::new(SocketTransport::over(a).unwrap()).unwrap();
        let ctx = d.context_create().unwrap();
        assert_eq!(d.pinned_alloc(ctx, 4096, 0), Ok(None));
        drop(d);
        served.join().unwrap();
    }
}
