//! Bulk copies of the host transport through shared memory: the guest library's socket to
//! `vgpu-cuda-host` carries only small messages naming ranges of a region both sides map,
//! and a copy's bytes move through that region, never through the socket.
//!
//! At connect the client creates a memfd (sealed against shrinking and growing), maps it and
//! offers it with a [`HELLO`] message whose file descriptor travels with it (`SCM_RIGHTS`).
//! The host checks it (a sealed memory file of the announced size, at most
//! [`MAX_REGION_BYTES`], charged to the connection's memory budget), maps it and answers
//! `Done`; where it refuses one it answers why (an `Output` reply), and the client carries on
//! over the socket alone. A host without this protocol answers an error and closes the
//! connection (an unknown opcode): the client then connects again and speaks the socket
//! protocol alone.
//!
//! A copy is cut into chunks of at most [`MAX_CHUNK_BYTES`], each one message naming a
//! device address and a range of the region; the client keeps several in flight, each in its
//! own slot of the region (a ring), so its copies into the region overlap with the host's
//! copies out of it. The host answers each chunk in order (`Done` or the copy's error).
//!
//! The region is memory the client writes while the host reads it: the host validates every
//! range against the region before touching it, and only copies out of and into it
//! ([`vm_memory`]'s volatile slices; no reference into the region is ever held), into or from
//! a small buffer of its own. A chunk flagged [`MORE`] says another of the same copy follows:
//! the host waits for it no longer than for the rest of a message (a client that stalls
//! mid-copy is dropped), where between copies it may idle.
//!
//! Page-locked host memory the client allocates (`cuMemAllocHost`, `cuMemHostAlloc`) is a
//! memory file of its own, offered with a [`PIN`] message (its descriptor attached), checked
//! as the ring is, charged to the budget and bounded by [`MAX_PINNED_BYTES`] and
//! [`MAX_PINNED_REGIONS`]; the host answers its id. A copy whose host side lies in one is a
//! single message naming the region, offset, length, device address and stream: the host
//! copies between the region and device memory with no copy in the client and no bytes in the
//! message, and forgets the region at [`UNPIN`] or when the connection ends.

use std::collections::HashMap;
use std::fs::File;
use std::io::{IoSlice, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use log::warn;
use rustix::fs::SealFlags;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use vm_memory::{FileOffset, MmapRegion, VolatileMemory, VolatileSlice};

use super::backend::{ContextId, StreamId};
use super::remote::RemoteError;
use super::wire::{self, Reply, WireError};
use super::{ComputeError, ComputeResult};
use crate::budget::{Charge, MemoryBudget};

/// Opcode of the message offering the region (its descriptor attached), outside the opcodes
/// of [`wire`]: an older host refuses it as unknown.
const HELLO: u16 = 0x7301;
/// Opcode of a host-to-device chunk.
const HTOD: u16 = 0x7302;
/// Opcode of a device-to-host chunk.
const DTOH: u16 = 0x7303;
/// Opcode of the message offering a page-locked allocation's memory file (its descriptor
/// attached).
const PIN: u16 = 0x7304;
/// Opcode of the message giving a page-locked allocation back.
const UNPIN: u16 = 0x7305;
/// Opcodes of copies between a page-locked allocation and device memory.
const PINNED_HTOD: u16 = 0x7306;
const PINNED_DTOH: u16 = 0x7307;
/// A chunk's flag: another chunk of the same copy follows.
pub const MORE: u8 = 1;
/// Body of a [`HELLO`]: opcode, region bytes.
const HELLO_BODY: usize = 2 + 8;
/// Body of a chunk: opcode, context, stream, device address, region offset, length, flags.
const CHUNK_BODY: usize = 2 + 4 + 4 + 8 + 8 + 8 + 1;
/// Body of an [`UNPIN`]: opcode, region id.
const UNPIN_BODY: usize = 2 + 4;
/// Body of a pinned copy: opcode, context, stream, region id, device address, offset, length.
const PINNED_BODY: usize = 2 + 4 + 4 + 4 + 8 + 8 + 8;

/// Bytes of page-locked allocations one connection may share: the host keeps each mapped
/// until it is freed and charges it to the connection's budget; past it an allocation fails
/// with `CUDA_ERROR_OUT_OF_MEMORY`, as pinning past a host's locked-memory limit does.
pub const MAX_PINNED_BYTES: u64 = 4 << 30;
/// Page-locked allocations one connection may share: each holds a mapping (and the client's
/// descriptor travels once) for its life.
pub const MAX_PINNED_REGIONS: usize = 4096;

/// Largest region a client may share: the host keeps it mapped for the connection's life and
/// charges it to the connection's memory budget.
pub const MAX_REGION_BYTES: u64 = 64 << 20;
/// Largest chunk one message moves, as a socket message's copy
/// ([`wire::MAX_COPY_BYTES`]): one request's worth of device work.
pub const MAX_CHUNK_BYTES: u64 = wire::MAX_COPY_BYTES;
/// The host's buffer between the region and device memory: copies go through it a piece at
/// a time, small enough to stay in the host thread's cache.
pub const BOUNCE_BYTES: usize = 256 << 10;
/// The client's region: [`CLIENT_SLOTS`] chunks of [`CLIENT_CHUNK_BYTES`].
pub const CLIENT_REGION_BYTES: usize = CLIENT_SLOTS * CLIENT_CHUNK_BYTES;
/// Chunks the client keeps in flight.
pub const CLIENT_SLOTS: usize = 8;
/// The client's chunk, one host piece ([`BOUNCE_BYTES`]): large enough that a message's
/// cost is small beside its copy (about a tenth), small enough that the ring (2 MiB) stays
/// in the cache between the client's copy into it and the host's out of it, and that the
/// two sides' copies overlap on a copy of a MiB.
pub const CLIENT_CHUNK_BYTES: usize = 256 << 10;
/// Smallest copy the client sends through the region: smaller ones go in messages, batched
/// with other deferred work, where they cost less than a round trip of their own.
pub const MIN_SHARED_COPY_BYTES: usize = 64 << 10;

/// A host-to-device or device-to-host chunk: `len` bytes at `offset` in the region, to or from
/// device address `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub ctx: ContextId,
    pub stream: StreamId,
    pub addr: u64,
    pub offset: u64,
    pub len: u64,
    pub flags: u8,
}

impl Chunk {
    /// Whether another chunk of the same copy follows.
    pub fn more(&self) -> bool {
        self.flags & MORE != 0
    }
}

/// A copy between a page-locked allocation (`region`, as the host numbered it) and device
/// memory: `len` bytes at `offset` in the region, to or from device address `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedCopy {
    pub ctx: ContextId,
    pub stream: StreamId,
    pub region: u32,
    pub addr: u64,
    pub offset: u64,
    pub len: u64,
}

/// A message of this protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// The region of `bytes` bytes, its descriptor attached.
    Hello {
        bytes: u64,
    },
    HtoD(Chunk),
    DtoH(Chunk),
    /// A page-locked allocation of `bytes` bytes, its descriptor attached.
    Pin {
        bytes: u64,
    },
    /// The page-locked allocation the host numbered `region` is freed.
    Unpin {
        region: u32,
    },
    PinnedHtoD(PinnedCopy),
    PinnedDtoH(PinnedCopy),
}

impl Message {
    /// The whole message: length, opcode, fields.
    pub fn encode(&self) -> Vec<u8> {
        let (op, body) = match self {
            Message::Hello { .. } => (HELLO, HELLO_BODY),
            Message::HtoD(_) => (HTOD, CHUNK_BODY),
            Message::DtoH(_) => (DTOH, CHUNK_BODY),
            Message::Pin { .. } => (PIN, HELLO_BODY),
            Message::Unpin { .. } => (UNPIN, UNPIN_BODY),
            Message::PinnedHtoD(_) => (PINNED_HTOD, PINNED_BODY),
            Message::PinnedDtoH(_) => (PINNED_DTOH, PINNED_BODY),
        };
        let mut o = Vec::with_capacity(4 + body);
        o.extend_from_slice(&(body as u32).to_le_bytes());
        o.extend_from_slice(&op.to_le_bytes());
        match self {
            Message::Hello { bytes } | Message::Pin { bytes } => {
                o.extend_from_slice(&bytes.to_le_bytes());
            }
            Message::HtoD(c) | Message::DtoH(c) => {
                o.extend_from_slice(&c.ctx.0.to_le_bytes());
                o.extend_from_slice(&c.stream.0.to_le_bytes());
                for v in [c.addr, c.offset, c.len] {
                    o.extend_from_slice(&v.to_le_bytes());
                }
                o.push(c.flags);
            }
            Message::Unpin { region } => o.extend_from_slice(&region.to_le_bytes()),
            Message::PinnedHtoD(c) | Message::PinnedDtoH(c) => {
                for v in [c.ctx.0, c.stream.0, c.region] {
                    o.extend_from_slice(&v.to_le_bytes());
                }
                for v in [c.addr, c.offset, c.len] {
                    o.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        o
    }

    /// Decodes a message body (what follows the length): `None` when its opcode is not this
    /// protocol's (a [`wire`] request).
    pub fn decode(body: &[u8]) -> Option<Result<Message, WireError>> {
        let op = u16::from_le_bytes(body.get(..2)?.try_into().ok()?);
        let want = match op {
            HELLO | PIN => HELLO_BODY,
            HTOD | DTOH => CHUNK_BODY,
            UNPIN => UNPIN_BODY,
            PINNED_HTOD | PINNED_DTOH => PINNED_BODY,
            _ => return None,
        };
        Some(match body.len() {
            n if n < want => Err(WireError::Truncated),
            n if n > want => Err(WireError::Trailing(n - want)),
            _ => Ok(Self::fields(op, &body[2..])),
        })
    }

    /// The fields of a body of the right length for `op`.
    fn fields(op: u16, f: &[u8]) -> Message {
        let u32_at = |i: usize| u32::from_le_bytes([f[i], f[i + 1], f[i + 2], f[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | u64::from(u32_at(i + 4)) << 32;
        match op {
            HELLO => return Message::Hello { bytes: u64_at(0) },
            PIN => return Message::Pin { bytes: u64_at(0) },
            UNPIN => return Message::Unpin { region: u32_at(0) },
            PINNED_HTOD | PINNED_DTOH => {
                let c = PinnedCopy {
                    ctx: ContextId(u32_at(0)),
                    stream: StreamId(u32_at(4)),
                    region: u32_at(8),
                    addr: u64_at(12),
                    offset: u64_at(20),
                    len: u64_at(28),
                };
                return if op == PINNED_HTOD {
                    Message::PinnedHtoD(c)
                } else {
                    Message::PinnedDtoH(c)
                };
            }
            _ => {}
        }
        let c = Chunk {
            ctx: ContextId(u32_at(0)),
            stream: StreamId(u32_at(4)),
            addr: u64_at(8),
            offset: u64_at(16),
            len: u64_at(24),
            flags: f[32],
        };
        if op == HTOD {
            Message::HtoD(c)
        } else {
            Message::DtoH(c)
        }
    }
}

/// Maps `len` bytes of the memory file `fd` shared (the same pages in both processes).
fn map(fd: OwnedFd, len: usize) -> std::io::Result<MmapRegion> {
    MmapRegion::from_file(FileOffset::new(File::from(fd), 0), len)
        .map_err(|e| std::io::Error::other(format!("mapping the shared region: {e}")))
}

/// The slice `[offset, offset + len)` of `region`, checked against it.
fn slice(region: &MmapRegion, offset: u64, len: u64) -> Option<VolatileSlice<'_>> {
    let offset = usize::try_from(offset).ok()?;
    let len = usize::try_from(len).ok()?;
    region.get_slice(offset, len).ok()
}

/// The host's side of a connection's region.
#[derive(Debug)]
pub struct Shared {
    region: MmapRegion,
    /// Between the region and device memory, [`BOUNCE_BYTES`].
    bounce: Vec<u8>,
    /// The region and the buffer, charged to the connection's budget.
    _charge: Charge,
}

impl Shared {
    /// Accepts the region the client offered: a memory file sealed against shrinking (the
    /// client can never take pages from under the host's mapping) of exactly `bytes` bytes, at
    /// most [`MAX_REGION_BYTES`], charged with the host's buffer to `budget`.
    pub fn accept(fd: OwnedFd, bytes: u64, budget: &Arc<MemoryBudget>) -> ComputeResult<Shared> {
        if bytes == 0 || bytes > MAX_REGION_BYTES {
            return Err(ComputeError::InvalidValue(format!(
                "a shared region of {bytes} bytes (1 to {MAX_REGION_BYTES})"
            )));
        }
        let refused = |why: String| ComputeError::InvalidValue(format!("shared region: {why}"));
        check_file(&fd, bytes).map_err(refused)?;
        // Bounded above by MAX_REGION_BYTES.
        let len = bytes as usize;
        let charge = budget
            .charge(bytes + BOUNCE_BYTES as u64)
            .map_err(|e| ComputeError::OutOfMemory(format!("shared region: {e}")))?;
        let region = map(fd, len).map_err(|e| refused(e.to_string()))?;
        Ok(Shared {
            region,
            bounce: vec![0; BOUNCE_BYTES],
            _charge: charge,
        })
    }

    /// Checks a chunk's range against the region and the chunk limit: `Err` when the client
    /// broke the protocol.
    pub fn check(&self, c: &Chunk) -> Result<(), WireError> {
        if c.len > MAX_CHUNK_BYTES {
            return Err(WireError::TooLong {
                what: "shared-memory chunk",
                len: usize::try_from(c.len).unwrap_or(usize::MAX),
                max: MAX_CHUNK_BYTES as usize,
            });
        }
        match slice(&self.region, c.offset, c.len) {
            Some(_) => Ok(()),
            None => Err(WireError::TooLong {
                what: "shared-memory range end",
                len: usize::try_from(c.offset.saturating_add(c.len)).unwrap_or(usize::MAX),
                max: self.region.len(),
            }),
        }
    }

    /// Copies a checked chunk's range out of the region, a piece at a time, handing each
    /// piece and its device address to `to_device`.
    pub fn read(
        &mut self,
        c: &Chunk,
        to_device: impl FnMut(u64, &[u8]) -> ComputeResult<()>,
    ) -> ComputeResult<()> {
        let range = (c.offset, c.len, c.addr);
        copy_out(&self.region, &mut self.bounce, range, to_device)
    }

    /// Copies device memory into a checked chunk's range of the region, a piece at a time,
    /// `from_device` filling each piece from its device address.
    pub fn write(
        &mut self,
        c: &Chunk,
        from_device: impl FnMut(u64, &mut [u8]) -> ComputeResult<()>,
    ) -> ComputeResult<()> {
        let range = (c.offset, c.len, c.addr);
        copy_in(&self.region, &mut self.bounce, range, from_device)
    }
}

/// A range of a region and the device address it is copied to or from: (offset, length,
/// device address).
type Range = (u64, u64, u64);

/// Copies `range` out of `region` through `bounce`, handing each piece and its device
/// address to `to_device`.
fn copy_out(
    region: &MmapRegion,
    bounce: &mut [u8],
    range: Range,
    mut to_device: impl FnMut(u64, &[u8]) -> ComputeResult<()>,
) -> ComputeResult<()> {
    pieces(region, bounce, range, |piece, region, addr| {
        region.copy_to(&mut *piece);
        to_device(addr, piece)
    })
}

/// Copies device memory into `range` of `region` through `bounce`, `from_device` filling
/// each piece from its device address.
fn copy_in(
    region: &MmapRegion,
    bounce: &mut [u8],
    range: Range,
    mut from_device: impl FnMut(u64, &mut [u8]) -> ComputeResult<()>,
) -> ComputeResult<()> {
    pieces(region, bounce, range, |piece, region, addr| {
        from_device(addr, &mut *piece)?;
        region.copy_from(piece);
        Ok(())
    })
}

/// Walks `[offset, offset + len)` of `region` in pieces of at most `bounce.len()`: the buffer
/// cut to the piece, the piece's slice of the region, its device address (from `addr`).
fn pieces(
    region: &MmapRegion,
    bounce: &mut [u8],
    (offset, len, addr): Range,
    mut each: impl FnMut(&mut [u8], VolatileSlice<'_>, u64) -> ComputeResult<()>,
) -> ComputeResult<()> {
    let bad = || ComputeError::InvalidValue("shared-memory range".into());
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(bounce.len() as u64);
        let at = offset.checked_add(done).ok_or_else(bad)?;
        let piece = slice(region, at, n).ok_or_else(bad)?;
        let to = addr.checked_add(done).ok_or_else(bad)?;
        // n <= bounce.len().
        each(&mut bounce[..n as usize], piece, to)?;
        done += n;
    }
    Ok(())
}

/// Checks that `fd` is a memory file sealed against shrinking (the client can never take
/// pages from under the host's mapping) of exactly `bytes` bytes: why not, where it is not.
fn check_file(fd: &OwnedFd, bytes: u64) -> Result<(), String> {
    let seals =
        rustix::fs::fcntl_get_seals(fd).map_err(|e| format!("not a sealable memory file ({e})"))?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err("not sealed against shrinking".into());
    }
    let size = rustix::fs::fstat(fd).map_err(|e| e.to_string())?.st_size;
    if u64::try_from(size) != Ok(bytes) {
        return Err(format!("{size} bytes, {bytes} announced"));
    }
    Ok(())
}

/// One page-locked allocation the host maps.
#[derive(Debug)]
struct PinnedRegion {
    region: MmapRegion,
    _charge: Charge,
}

/// The host's side of a connection's page-locked allocations: regions by id, the bytes they
/// hold, and the buffer copies go through (allocated, and charged, with the first region).
#[derive(Debug, Default)]
pub struct Pinned {
    regions: HashMap<u32, PinnedRegion>,
    bytes: u64,
    last_id: u32,
    bounce: Option<(Vec<u8>, Charge)>,
}

impl Pinned {
    /// Takes a page-locked allocation the client offered: its id, or why it is refused
    /// (`Ok(Err(..))`: past [`MAX_PINNED_BYTES`], [`MAX_PINNED_REGIONS`] or the budget, and
    /// the connection goes on); `Err` where the file breaks the protocol (not a memory file
    /// sealed against shrinking of the announced size).
    pub fn pin(
        &mut self,
        fd: OwnedFd,
        bytes: u64,
        budget: &Arc<MemoryBudget>,
    ) -> Result<ComputeResult<u32>, RemoteError> {
        if bytes == 0 {
            return Err(RemoteError::Shared("an empty page-locked region"));
        }
        check_file(&fd, bytes).map_err(|why| {
            warn!("compute peer's page-locked region: {why}");
            RemoteError::Shared("a page-locked region not sealed as announced")
        })?;
        let oom = |why: String| Ok(Err(ComputeError::OutOfMemory(why)));
        let total = self
            .bytes
            .checked_add(bytes)
            .filter(|&t| t <= MAX_PINNED_BYTES);
        let Some(total) = total else {
            return oom(format!(
                "page-locked memory: {bytes} bytes past the limit of {MAX_PINNED_BYTES}"
            ));
        };
        if self.regions.len() >= MAX_PINNED_REGIONS {
            return oom(format!(
                "page-locked memory: more than {MAX_PINNED_REGIONS} allocations"
            ));
        }
        if self.bounce.is_none() {
            match budget.charge(BOUNCE_BYTES as u64) {
                Ok(c) => self.bounce = Some((vec![0; BOUNCE_BYTES], c)),
                Err(e) => return oom(format!("page-locked memory: {e}")),
            }
        }
        let charge = match budget.charge(bytes) {
            Ok(c) => c,
            Err(e) => return oom(format!("page-locked memory: {e}")),
        };
        // Bounded above by MAX_PINNED_BYTES.
        let region = match map(fd, bytes as usize) {
            Ok(r) => r,
            Err(e) => return oom(format!("page-locked memory: {e}")),
        };
        // Ids are not reused while the connection lives: a stale one names nothing.
        let Some(id) = self.last_id.checked_add(1) else {
            return oom("page-locked memory: ids exhausted".into());
        };
        self.last_id = id;
        self.bytes = total;
        self.regions.insert(
            id,
            PinnedRegion {
                region,
                _charge: charge,
            },
        );
        Ok(Ok(id))
    }

    /// Forgets region `id` (its mapping and charge go); `Err` for an id not held.
    pub fn unpin(&mut self, id: u32) -> Result<(), RemoteError> {
        let r = self
            .regions
            .remove(&id)
            .ok_or(RemoteError::Shared("an unknown page-locked region"))?;
        self.bytes -= r.region.len() as u64;
        if self.regions.is_empty() {
            // The buffer goes with the last region, its charge too.
            self.bounce = None;
        }
        Ok(())
    }

    /// Checks a copy's region and range: `Err` when the client broke the protocol.
    pub fn check(&self, c: &PinnedCopy) -> Result<(), RemoteError> {
        let r = self
            .regions
            .get(&c.region)
            .ok_or(RemoteError::Shared("an unknown page-locked region"))?;
        match slice(&r.region, c.offset, c.len) {
            Some(_) => Ok(()),
            None => Err(WireError::TooLong {
                what: "page-locked range end",
                len: usize::try_from(c.offset.saturating_add(c.len)).unwrap_or(usize::MAX),
                max: r.region.len(),
            }
            .into()),
        }
    }

    /// Copies a checked copy's range out of its region, a piece at a time through the host's
    /// buffer, handing each piece and its device address to `to_device`.
    pub fn read(
        &mut self,
        c: &PinnedCopy,
        to_device: impl FnMut(u64, &[u8]) -> ComputeResult<()>,
    ) -> ComputeResult<()> {
        let (region, bounce) = self.parts(c)?;
        copy_out(region, bounce, (c.offset, c.len, c.addr), to_device)
    }

    /// Copies device memory into a checked copy's range of its region, a piece at a time,
    /// `from_device` filling each piece from its device address.
    pub fn write(
        &mut self,
        c: &PinnedCopy,
        from_device: impl FnMut(u64, &mut [u8]) -> ComputeResult<()>,
    ) -> ComputeResult<()> {
        let (region, bounce) = self.parts(c)?;
        copy_in(region, bounce, (c.offset, c.len, c.addr), from_device)
    }

    /// A copy's region and the host's buffer.
    fn parts(&mut self, c: &PinnedCopy) -> ComputeResult<(&MmapRegion, &mut [u8])> {
        let bad = || ComputeError::InvalidValue("page-locked region".into());
        let r = self.regions.get(&c.region).ok_or_else(bad)?;
        let (bounce, _) = self.bounce.as_mut().ok_or_else(bad)?;
        Ok((&r.region, bounce.as_mut_slice()))
    }

    /// Bytes of the regions held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Room for the one descriptor a message may carry.
const FD_SPACE: usize = rustix::cmsg_space!(ScmRights(1));

/// Reads into `buf` from `stream` like `read`, also taking a descriptor sent with those bytes
/// (`SCM_RIGHTS`; any more are closed by the kernel). The stream's read timeout applies.
pub fn recv_with_fd(
    stream: &UnixStream,
    buf: &mut [u8],
) -> std::io::Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); FD_SPACE];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        stream,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fd = None;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = msg {
            for f in fds {
                // A second descriptor is dropped (closed) here.
                fd.get_or_insert(f);
            }
        }
    }
    Ok((got.bytes, fd))
}

/// What a host answered to the offer of a region.
#[derive(Debug)]
pub enum Offer {
    /// Taken (`Done`): copies go through it.
    Taken(Client),
    /// Refused, and why (an `Output` reply): the connection goes on over the socket alone.
    Refused(String),
    /// Not understood (an error reply: an older host, which closes the connection).
    Unknown,
}

/// A memory file of `bytes` bytes sealed against shrinking, growing and further seals: what a
/// client shares.
pub fn region_file(bytes: u64) -> std::io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(
        "vgpu-cuda-shared",
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )?;
    rustix::fs::ftruncate(&fd, bytes)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(fd)
}

/// Writes `message` to `stream` with `fd` attached to its first bytes (`SCM_RIGHTS`).
pub fn send_with_fd(
    stream: &mut UnixStream,
    message: &[u8],
    fd: BorrowedFd<'_>,
) -> std::io::Result<()> {
    let mut space = [MaybeUninit::uninit(); FD_SPACE];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    control.push(SendAncillaryMessage::ScmRights(&fds));
    let sent = rustix::net::sendmsg(
        &*stream,
        &[IoSlice::new(message)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    stream.write_all(&message[sent..])
}

/// The client's side: its region, cut into [`CLIENT_SLOTS`] slots of [`CLIENT_CHUNK_BYTES`].
#[derive(Debug)]
pub struct Client {
    region: MmapRegion,
}

impl Client {
    /// Creates the region (a sealed memory file) and offers it on `stream`.
    pub fn offer(stream: &mut UnixStream) -> Result<Offer, RemoteError> {
        let fd = region_file(CLIENT_REGION_BYTES as u64)?;
        let region = map(fd.try_clone()?, CLIENT_REGION_BYTES)?;
        let hello = Message::Hello {
            bytes: CLIENT_REGION_BYTES as u64,
        }
        .encode();
        send_with_fd(stream, &hello, fd.as_fd())?;
        Ok(match Reply::read_from(stream)?? {
            Reply::Done => Offer::Taken(Client { region }),
            Reply::Output(why) => Offer::Refused(why),
            _ => Offer::Unknown,
        })
    }

    /// The region's slot `i` (of [`CLIENT_SLOTS`]) cut to `len` bytes, and its offset.
    fn slot(&self, i: usize, len: usize) -> Result<(u64, VolatileSlice<'_>), RemoteError> {
        let offset = (i % CLIENT_SLOTS) * CLIENT_CHUNK_BYTES;
        let s = self
            .region
            .get_slice(offset, len)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok((offset as u64, s))
    }

    /// Host to device: `src` to `dst`, through the region. The host's answer: `Done`, or the
    /// first chunk's error (the copy stops there).
    pub fn htod(
        &self,
        stream: &mut UnixStream,
        ctx: ContextId,
        dst: u64,
        src: &[u8],
        stream_id: StreamId,
    ) -> Result<Reply, RemoteError> {
        let mut pipe = Pipe::new(src.len());
        for (i, piece) in src.chunks(CLIENT_CHUNK_BYTES).enumerate() {
            if pipe.in_flight() == CLIENT_SLOTS {
                pipe.answer(stream)?;
            }
            if pipe.failed() {
                break;
            }
            let (offset, slot) = self.slot(i, piece.len())?;
            slot.copy_from(piece);
            pipe.send(
                stream,
                Message::HtoD,
                ctx,
                stream_id,
                dst,
                offset,
                piece.len(),
            )?;
        }
        pipe.finish(stream, ctx, stream_id)
    }

    /// Device to host: `dst` from `src`, through the region. The host's answer: `Done`, or the
    /// first chunk's error (the copy stops there; `dst` holds what came before it).
    pub fn dtoh(
        &self,
        stream: &mut UnixStream,
        ctx: ContextId,
        src: u64,
        dst: &mut [u8],
        stream_id: StreamId,
    ) -> Result<Reply, RemoteError> {
        let mut pipe = Pipe::new(dst.len());
        let mut pieces = dst.chunks_mut(CLIENT_CHUNK_BYTES);
        loop {
            while pipe.sent < pipe.chunks && pipe.in_flight() < CLIENT_SLOTS && !pipe.failed() {
                let len = (pipe.bytes - pipe.sent * CLIENT_CHUNK_BYTES).min(CLIENT_CHUNK_BYTES);
                let (offset, _) = self.slot(pipe.sent, len)?;
                pipe.send(stream, Message::DtoH, ctx, stream_id, src, offset, len)?;
            }
            if pipe.in_flight() == 0 {
                break;
            }
            // Answers come in order: this one is for the next piece.
            let i = pipe.answered;
            pipe.answer(stream)?;
            if let Some(piece) = pieces.next()
                && !pipe.failed()
            {
                // Out of the slot before the next request reuses it.
                self.slot(i, piece.len())?.1.copy_to(piece);
            }
        }
        pipe.finish(stream, ctx, stream_id)
    }
}

/// A page-locked allocation of the client: a memory file it maps and shares with the host,
/// which numbered it `id`. Unmapped when dropped where this mapped it (`create`); where the
/// caller mapped it at its own place (`create_at`), the caller unmaps it.
#[derive(Debug)]
pub struct PinnedMemory {
    id: u32,
    start: u64,
    len: u64,
    region: Option<MmapRegion>,
}

impl PinnedMemory {
    /// Creates a sealed memory file of `bytes` bytes, maps it and offers it on `stream`: the
    /// allocation, or the host's refusal (an error reply: its limit, its budget).
    pub fn create(stream: &mut UnixStream, bytes: u64) -> Result<Result<Self, Reply>, RemoteError> {
        let len = usize::try_from(bytes).map_err(|_| std::io::Error::other("too large"))?;
        let fd = region_file(bytes)?;
        let region = map(fd.try_clone()?, len)?;
        let start = region.as_ptr() as u64;
        Ok(Self::offer(stream, bytes, &fd)?.map(|id| PinnedMemory {
            id,
            start,
            len: bytes,
            region: Some(region),
        }))
    }

    /// As [`PinnedMemory::create`], the memory file mapped by `place` (shared, all `bytes`
    /// of it, at `start`): where the memory must lie at an address of the caller's.
    pub fn create_at(
        stream: &mut UnixStream,
        start: u64,
        bytes: u64,
        place: impl FnOnce(BorrowedFd<'_>) -> std::io::Result<()>,
    ) -> Result<Result<Self, Reply>, RemoteError> {
        let fd = region_file(bytes)?;
        place(fd.as_fd())?;
        Ok(Self::offer(stream, bytes, &fd)?.map(|id| PinnedMemory {
            id,
            start,
            len: bytes,
            region: None,
        }))
    }

    /// Offers memory file `fd` of `bytes` on `stream`: the host's id for it, or its refusal.
    fn offer(
        stream: &mut UnixStream,
        bytes: u64,
        fd: &OwnedFd,
    ) -> Result<Result<u32, Reply>, RemoteError> {
        send_with_fd(stream, &Message::Pin { bytes }.encode(), fd.as_fd())?;
        Ok(match Reply::read_from(stream)?? {
            Reply::Id(id) => Ok(id),
            e @ Reply::Error { .. } => Err(e),
            _ => return Err(WireError::Opcode(0).into()),
        })
    }

    /// Where the allocation lies in this process.
    pub fn start(&self) -> u64 {
        self.start
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation's bytes, which the host may read or write while a copy is in flight,
    /// where this mapped it.
    pub fn slice(&self) -> Option<VolatileSlice<'_>> {
        self.region.as_ref().map(|r| r.as_volatile_slice())
    }

    /// The offset of `[addr, addr + bytes)` in the allocation, where it lies wholly in it.
    pub fn offset_of(&self, addr: u64, bytes: u64) -> Option<u64> {
        let offset = addr.checked_sub(self.start())?;
        (offset.checked_add(bytes)? <= self.len()).then_some(offset)
    }

    /// Gives the allocation back to the host (then unmaps it here): the host's answer.
    pub fn free(self, stream: &mut UnixStream) -> Result<Reply, RemoteError> {
        stream.write_all(&Message::Unpin { region: self.id }.encode())?;
        Ok(Reply::read_from(stream)??)
    }

    /// Copies `len` bytes at `offset` of the allocation to device address `addr`
    /// (`to_device`), or from it, on `stream_id`: the host's answer (`Done` or the copy's
    /// error). Once it has answered, the host no longer reads or writes the range.
    #[allow(clippy::too_many_arguments)]
    pub fn copy(
        &self,
        stream: &mut UnixStream,
        ctx: ContextId,
        stream_id: StreamId,
        to_device: bool,
        addr: u64,
        offset: u64,
        len: u64,
    ) -> Result<Reply, RemoteError> {
        let c = PinnedCopy {
            ctx,
            stream: stream_id,
            region: self.id,
            addr,
            offset,
            len,
        };
        let m = if to_device {
            Message::PinnedHtoD(c)
        } else {
            Message::PinnedDtoH(c)
        };
        stream.write_all(&m.encode())?;
        Ok(Reply::read_from(stream)??)
    }
}

/// The chunks of one copy in flight: sent, answered, the first error.
struct Pipe {
    /// The copy's bytes and chunks.
    bytes: usize,
    chunks: usize,
    sent: usize,
    answered: usize,
    /// Whether the last chunk sent said another follows.
    open: bool,
    error: Option<Reply>,
}

impl Pipe {
    fn new(bytes: usize) -> Pipe {
        Pipe {
            bytes,
            chunks: bytes.div_ceil(CLIENT_CHUNK_BYTES),
            sent: 0,
            answered: 0,
            open: false,
            error: None,
        }
    }

    fn in_flight(&self) -> usize {
        self.sent - self.answered
    }

    fn failed(&self) -> bool {
        self.error.is_some()
    }

    /// Sends the next chunk: `len` bytes at `offset` of the region, for the copy's device
    /// range starting at `base`.
    #[allow(clippy::too_many_arguments)]
    fn send(
        &mut self,
        stream: &mut UnixStream,
        kind: fn(Chunk) -> Message,
        ctx: ContextId,
        stream_id: StreamId,
        base: u64,
        offset: u64,
        len: usize,
    ) -> Result<(), RemoteError> {
        let addr = (self.sent * CLIENT_CHUNK_BYTES) as u64;
        self.sent += 1;
        self.open = self.sent < self.chunks;
        let c = Chunk {
            ctx,
            stream: stream_id,
            // Past the address space is no context's memory: the host refuses it.
            addr: base.wrapping_add(addr),
            offset,
            len: len as u64,
            flags: if self.open { MORE } else { 0 },
        };
        stream.write_all(&kind(c).encode())?;
        Ok(())
    }

    /// Reads the answer to the oldest chunk in flight.
    fn answer(&mut self, stream: &mut UnixStream) -> Result<(), RemoteError> {
        let reply = Reply::read_from(stream)??;
        self.answered += 1;
        match reply {
            Reply::Done => {}
            Reply::Error { .. } => {
                self.error.get_or_insert(reply);
            }
            _ => return Err(WireError::Opcode(0).into()),
        }
        Ok(())
    }

    /// Waits for the chunks in flight; a copy stopped by an error before its last chunk is
    /// closed with an empty chunk, so the host does not wait for the rest.
    fn finish(
        mut self,
        stream: &mut UnixStream,
        ctx: ContextId,
        stream_id: StreamId,
    ) -> Result<Reply, RemoteError> {
        while self.in_flight() > 0 {
            self.answer(stream)?;
        }
        if self.open {
            self.chunks = self.sent + 1;
            self.send(stream, Message::HtoD, ctx, stream_id, 0, 0, 0)?;
            self.answer(stream)?;
        }
        Ok(self.error.unwrap_or(Reply::Done))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_decode_as_they_were_encoded_and_nothing_else() {
        let c = Chunk {
            ctx: ContextId(3),
            stream: StreamId(4),
            addr: 0x1234_5678_9abc,
            offset: 1 << 20,
            len: 4096,
            flags: MORE,
        };
        let p = PinnedCopy {
            ctx: ContextId(3),
            stream: StreamId(4),
            region: 5,
            addr: 0x1234_5678_9abc,
            offset: 12_345,
            len: 1 << 33,
        };
        for m in [
            Message::Hello { bytes: 1 << 21 },
            Message::HtoD(c),
            Message::DtoH(c),
            Message::Pin { bytes: 3 << 30 },
            Message::Unpin { region: 7 },
            Message::PinnedHtoD(p),
            Message::PinnedDtoH(p),
        ] {
            let bytes = m.encode();
            let len = wire::body_len(bytes[..4].try_into().unwrap()).unwrap();
            assert_eq!(len, bytes.len() - 4);
            assert_eq!(Message::decode(&bytes[4..]), Some(Ok(m)));
            let short = &bytes[4..bytes.len() - 1];
            assert_eq!(Message::decode(short), Some(Err(WireError::Truncated)));
            let long = [&bytes[4..], &[0]].concat();
            assert_eq!(Message::decode(&long), Some(Err(WireError::Trailing(1))));
        }
        // The socket protocol's requests are not this protocol's.
        let create = wire::Request::ContextCreate.encode();
        assert_eq!(Message::decode(&create[4..]), None);
        assert_eq!(Message::decode(&[]), None);
    }
}
