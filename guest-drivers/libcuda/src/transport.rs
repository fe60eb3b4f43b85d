//! How requests reach the host. [`SocketTransport`]: a Unix socket to `vgpu-cuda-host` (the
//! same host code a VM's compute context uses), for running the library on the host without a
//! VM: tests, and a GPU host. In a guest, [`crate::drm::DrmTransport`]: the vGPU's virtio-gpu
//! device through the kernel's DRM driver.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use mdev_backend::compute::wire::{Reply, Request, WireError};
use thiserror::Error;

/// Environment variable naming the host socket.
pub const SOCKET_ENV: &str = "VGPU_CUDA_SOCKET";
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

/// A request–reply channel to the host.
pub trait Transport: Send {
    fn call(&mut self, req: &Request) -> Result<Reply, TransportError>;
}

#[derive(Debug)]
pub struct SocketTransport(UnixStream);

impl SocketTransport {
    pub fn connect(path: &str) -> Result<Self, TransportError> {
        Self::over(UnixStream::connect(path)?)
    }

    /// Over a connected stream (one end of a socket pair, in benchmarks and tests).
    pub fn over(s: UnixStream) -> Result<Self, TransportError> {
        s.set_read_timeout(Some(REPLY_TIMEOUT))?;
        Ok(SocketTransport(s))
    }
}

impl Transport for SocketTransport {
    fn call(&mut self, req: &Request) -> Result<Reply, TransportError> {
        self.0.write_all(&req.encode())?;
        Ok(Reply::read_from(&mut self.0)??)
    }
}
