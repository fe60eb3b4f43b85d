//! A minimal vfio-user client that speaks the wire format itself, so tests can send what QEMU
//! never would (out-of-range accesses, bad widths, bogus DMA maps) and still read error replies
//! (the `vfio-user` crate's client assumes success and desynchronises on an error reply).
//!
//! Message layout (vfio-user spec): a 16-byte header {msg_id u16, command u16, size u32,
//! flags u32, error u32} followed by the command's payload, little-endian.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// vfio-user command codes.
pub mod cmd {
    /// VFIO_USER_VERSION.
    pub const VERSION: u16 = 1;
    /// VFIO_USER_DMA_MAP.
    pub const DMA_MAP: u16 = 2;
    /// VFIO_USER_DMA_UNMAP.
    pub const DMA_UNMAP: u16 = 3;
    /// VFIO_USER_SET_IRQS.
    pub const SET_IRQS: u16 = 8;
    /// VFIO_USER_REGION_READ.
    pub const REGION_READ: u16 = 9;
    /// VFIO_USER_REGION_WRITE.
    pub const REGION_WRITE: u16 = 10;
    /// VFIO_USER_DEVICE_RESET.
    pub const DEVICE_RESET: u16 = 13;
}

const HEADER_SIZE: usize = 16;
const FLAG_REPLY: u32 = 1;
/// Header flag of a posted message (no reply expected).
pub const FLAG_NO_REPLY: u32 = 1 << 4;
const FLAG_ERROR: u32 = 1 << 5;
/// Largest reply payload accepted (the server's 1 MiB transfer limit plus headers).
const MAX_REPLY: usize = (1 << 20) + 4096;

/// Errors of the raw client.
#[derive(Debug, thiserror::Error)]
pub enum RawError {
    /// Socket I/O failed.
    #[error("vfio-user socket: {0}")]
    Io(#[from] std::io::Error),
    /// The server answered with an error reply.
    #[error("server refused command {command} (errno {errno})")]
    Refused {
        /// The command.
        command: u16,
        /// errno from the reply (0 when the server gave none).
        errno: u32,
    },
    /// The reply did not match the command.
    #[error("bad reply: {0}")]
    BadReply(String),
}

/// Result type of the raw client.
pub type Result<T> = std::result::Result<T, RawError>;

/// A connected raw client.
#[derive(Debug)]
pub struct RawClient {
    stream: UnixStream,
    next_id: u16,
}

impl RawClient {
    /// Connects and negotiates the protocol version.
    pub fn connect(path: &Path) -> Result<RawClient> {
        let mut client = Self::connect_unnegotiated(path)?;
        client.call(cmd::VERSION, &Self::version_payload(), &[])?;
        Ok(client)
    }

    /// The payload of a well-formed VERSION message: 0.1 with QEMU-like capabilities.
    pub fn version_payload() -> Vec<u8> {
        let mut payload = vec![0, 0, 1, 0]; // major 0, minor 1
        payload.extend_from_slice(
            br#"{"capabilities":{"max_msg_fds":16,"max_data_xfer_size":1048576}}"#,
        );
        payload.push(0);
        payload
    }

    /// The connected socket, for tests that stream raw bytes.
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Connects without negotiating, so a test can send its own VERSION message.
    pub fn connect_unnegotiated(path: &Path) -> Result<RawClient> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(RawClient { stream, next_id: 0 })
    }

    fn send(&mut self, command: u16, payload: &[u8], fds: &[RawFd], flags: u32) -> Result<()> {
        let size = (HEADER_SIZE + payload.len()) as u32;
        self.send_frame(command, size, flags, payload, fds)
    }

    /// Sends a message whose header claims `size` bytes, whatever `payload` holds.
    pub fn send_frame(
        &mut self,
        command: u16,
        size: u32,
        flags: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> Result<()> {
        let mut msg = Vec::with_capacity(HEADER_SIZE + payload.len());
        msg.extend_from_slice(&self.next_id.to_le_bytes());
        msg.extend_from_slice(&command.to_le_bytes());
        msg.extend_from_slice(&size.to_le_bytes());
        msg.extend_from_slice(&flags.to_le_bytes());
        msg.extend_from_slice(&0u32.to_le_bytes());
        self.next_id = self.next_id.wrapping_add(1);
        msg.extend_from_slice(payload);
        if fds.is_empty() {
            self.stream.write_all(&msg)?;
        } else {
            let sent = self
                .stream
                .send_with_fds(&[&msg[..]], fds)
                .map_err(std::io::Error::from)?;
            self.stream.write_all(&msg[sent..])?;
        }
        Ok(())
    }

    /// Sends a command and returns the reply's payload, or the server's refusal.
    pub fn call(&mut self, command: u16, payload: &[u8], fds: &[RawFd]) -> Result<Vec<u8>> {
        self.send(command, payload, fds, 0)?;
        self.reply(command)
    }

    /// Reads the reply to `command`: its payload, or the server's refusal.
    pub fn reply(&mut self, command: u16) -> Result<Vec<u8>> {
        let mut header = [0u8; HEADER_SIZE];
        self.stream.read_exact(&mut header)?;
        let word = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().expect("4 bytes"));
        let reply_command = u16::from_le_bytes([header[2], header[3]]);
        let (size, flags, errno) = (word(4) as usize, word(8), word(12));
        if reply_command != command || flags & FLAG_REPLY == 0 {
            return Err(RawError::BadReply(format!(
                "command {reply_command} flags {flags:#x} for {command}"
            )));
        }
        let len = size.checked_sub(HEADER_SIZE).filter(|&n| n <= MAX_REPLY);
        let len = len.ok_or_else(|| RawError::BadReply(format!("reply size {size}")))?;
        let mut payload = vec![0u8; len];
        self.stream.read_exact(&mut payload)?;
        if flags & FLAG_ERROR != 0 {
            return Err(RawError::Refused { command, errno });
        }
        Ok(payload)
    }

    /// The payload of a region access: offset, region, count.
    pub fn access(region: u32, offset: u64, count: u32) -> Vec<u8> {
        let mut p = Vec::with_capacity(16);
        p.extend_from_slice(&offset.to_le_bytes());
        p.extend_from_slice(&region.to_le_bytes());
        p.extend_from_slice(&count.to_le_bytes());
        p
    }

    /// REGION_READ of `len` bytes.
    pub fn region_read(&mut self, region: u32, offset: u64, len: u32) -> Result<Vec<u8>> {
        let reply = self.call(cmd::REGION_READ, &Self::access(region, offset, len), &[])?;
        reply
            .get(16..)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| RawError::BadReply("short read reply".into()))
    }

    /// REGION_WRITE as QEMU sends MMIO writes: posted, no reply.
    pub fn region_write_posted(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()> {
        let mut p = Self::access(region, offset, data.len() as u32);
        p.extend_from_slice(data);
        self.send(cmd::REGION_WRITE, &p, &[], FLAG_NO_REPLY)
    }

    /// REGION_WRITE with a reply, as QEMU sends config space writes.
    pub fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()> {
        let mut p = Self::access(region, offset, data.len() as u32);
        p.extend_from_slice(data);
        self.call(cmd::REGION_WRITE, &p, &[]).map(drop)
    }

    /// DMA_MAP of `size` bytes of `file` (from `offset`) at guest address `address`.
    pub fn dma_map(&mut self, file: &File, offset: u64, address: u64, size: u64) -> Result<()> {
        let mut p = Vec::with_capacity(32);
        p.extend_from_slice(&32u32.to_le_bytes()); // argsz
        p.extend_from_slice(&3u32.to_le_bytes()); // READ | WRITE
        for v in [offset, address, size] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        self.call(cmd::DMA_MAP, &p, &[file.as_raw_fd()]).map(drop)
    }

    /// DMA_UNMAP of a range.
    pub fn dma_unmap(&mut self, address: u64, size: u64) -> Result<()> {
        let mut p = Vec::with_capacity(24);
        p.extend_from_slice(&24u32.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend_from_slice(&address.to_le_bytes());
        p.extend_from_slice(&size.to_le_bytes());
        self.call(cmd::DMA_UNMAP, &p, &[]).map(drop)
    }

    /// SET_IRQS with eventfds (or none).
    pub fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: &[RawFd],
    ) -> Result<()> {
        let mut p = Vec::with_capacity(20);
        for v in [20u32, flags, index, start, count] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        self.call(cmd::SET_IRQS, &p, fds).map(drop)
    }

    /// DEVICE_RESET.
    pub fn reset(&mut self) -> Result<()> {
        self.call(cmd::DEVICE_RESET, &[], &[]).map(drop)
    }
}
