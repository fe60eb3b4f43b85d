//! [`DrmTransport`]: requests to the vGPU through the guest kernel's virtio-gpu DRM driver, the
//! transport of a real guest (`docs/CUDA-GUEST.md`, "The virtio-gpu transport").
//!
//! The render node (`$VGPU_CUDA_DRM`, else `/dev/dri/renderD128`) must offer guest-memory
//! blobs and context initialisation; the context is created for capset 21 (the vGPU's compute
//! capset). One mappable guest blob carries every exchange: the request is written at its
//! offset 0, framed exactly as on the socket (`u32` length, then the body), an EXECBUFFER
//! submits a 20-byte header naming the blob, WAIT on the blob returns once the device has
//! answered, and the reply is read back at offset 0 with the same framing. The blob starts at
//! [`MIN_BUFFER_BYTES`] and is replaced by a bigger one when a request, or the reply it may
//! bring (a device-to-host copy), would not fit; never past the device's `max_buffer_bytes`.
//!
//! The exchange logic ([`Exchange`]) calls the kernel through the small [`Kernel`] trait, so
//! the tests play the device in-process; [`Drm`] is the real one, on the render-node calls of
//! `vgpu_guest_drivers::virtgpu` (this module's unsafe code is the blob's `mmap`).

use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::time::Instant;

use mdev_backend::compute::wire::{self, MAX_TEXT_BYTES, Reply, Request};

use crate::transport::{REPLY_TIMEOUT, Transport, TransportError};

/// Environment variable naming the render node, instead of [`DEFAULT_NODE`].
pub const DRM_ENV: &str = "VGPU_CUDA_DRM";
/// The render node of the first DRM device.
pub const DEFAULT_NODE: &str = "/dev/dri/renderD128";

/// The vGPU's compute capset, and the version this library speaks.
pub const CAPSET_ID: u32 = 21;
pub const CAPSET_VERSION: u32 = 1;
/// Bytes of the capset GET_CAPS answers: version, max_message_bytes, max_buffer_bytes,
/// reserved.
const CAPSET_BYTES: usize = 16;
/// The SUBMIT header's magic, "VGCU" little-endian.
pub const SUBMIT_MAGIC: u32 = 0x5543_4756;
/// Bytes of the SUBMIT header: magic, resource_id, request_bytes, reply_capacity, reserved.
pub const SUBMIT_HEADER_BYTES: usize = 20;
/// The first buffer, and the least any buffer holds (about 4 MiB): the largest reply of any
/// request but a device-to-host copy, a batch's with printf output and an error message of
/// [`MAX_TEXT_BYTES`] each.
pub const MIN_BUFFER_BYTES: usize = 2 * MAX_TEXT_BYTES + REPLY_SLACK;
/// Room for a reply's framing and fixed fields next to the data it carries.
const REPLY_SLACK: usize = 4096;
/// Blob sizes are multiples of this (and of the guest's page size).
const BLOB_ALIGN: usize = 4096;

use vgpu_guest_drivers::virtgpu::{Blob, CONTEXT_PARAM_CAPSET_ID, DrmError, RenderNode};
/// GETPARAM numbers and blob kinds of the uAPI this transport uses.
pub use vgpu_guest_drivers::virtgpu::{PARAM_CONTEXT_INIT, PARAM_RESOURCE_BLOB};
const VIRTGPU_BLOB_MEM_GUEST: u32 = 1;
const VIRTGPU_BLOB_FLAG_USE_MAPPABLE: u32 = 1;

/// The kernel calls the exchange makes; [`Drm`] makes them on a render node.
pub(crate) trait Kernel: Send {
    /// GETPARAM: the value of `param`.
    fn getparam(&mut self, param: u64) -> Result<u64, TransportError>;
    /// GET_CAPS: fills `out` with (a prefix of) capset `id` at `version`.
    fn get_caps(&mut self, id: u32, version: u32, out: &mut [u8]) -> Result<(), TransportError>;
    /// CONTEXT_INIT with the given (param, value) pairs.
    fn context_init(&mut self, params: &[(u64, u64)]) -> Result<(), TransportError>;
    /// RESOURCE_CREATE_BLOB of `size` bytes.
    fn create_blob(&mut self, blob_mem: u32, flags: u32, size: u64)
    -> Result<Blob, TransportError>;
    /// MAP, then `mmap` of the blob's `len` bytes, shared, readable and writable.
    fn map(&mut self, bo: u32, len: usize) -> Result<(), TransportError>;
    /// The mapped bytes of `bo`.
    fn mem(&mut self, bo: u32) -> Option<&mut [u8]>;
    /// `munmap` of `bo`'s mapping, if any.
    fn unmap(&mut self, bo: u32);
    /// EXECBUFFER of `command` naming `bo_handles`.
    fn execbuffer(&mut self, command: &[u8], bo_handles: &[u32]) -> Result<(), TransportError>;
    /// WAIT on `bo`: true once its fences signalled, false when the kernel gave up waiting
    /// for now (interrupted, or its own timeout) and the wait should be repeated.
    fn wait(&mut self, bo: u32) -> Result<bool, TransportError>;
    /// GEM_CLOSE of `bo`.
    fn close(&mut self, bo: u32) -> Result<(), TransportError>;
}

/// What capset 21 says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    pub version: u32,
    pub max_message_bytes: u32,
    pub max_buffer_bytes: u32,
}

/// The buffer in use.
#[derive(Debug, Clone, Copy)]
struct Buffer {
    blob: Blob,
    size: usize,
}

/// The request–reply exchange over a [`Kernel`].
#[derive(Debug)]
pub(crate) struct Exchange<K: Kernel> {
    k: K,
    caps: Caps,
    /// Blob sizes are multiples of it.
    align: usize,
    /// The largest buffer: max_buffer_bytes, down to `align`, at most `u32::MAX`.
    limit: usize,
    buf: Option<Buffer>,
    /// A submit whose completion was not seen (its wait failed or timed out).
    stuck: bool,
}

fn round_up(n: usize, align: usize) -> Option<usize> {
    n.checked_add(align - 1).map(|n| n / align * align)
}

/// The reply a request may bring, in bytes with its framing.
fn expected_reply(req: &Request) -> usize {
    match req {
        Request::CopyDtoH { bytes, .. } => usize::try_from(*bytes)
            .ok()
            .and_then(|b| b.checked_add(REPLY_SLACK))
            .unwrap_or(usize::MAX),
        // Printf output and an error message (a batch has both): the least buffer holds it.
        _ => MIN_BUFFER_BYTES,
    }
}

/// The 20 bytes EXECBUFFER submits.
fn submit_header(res: u32, request_bytes: u32, reply_capacity: u32) -> [u8; SUBMIT_HEADER_BYTES] {
    let mut h = [0u8; SUBMIT_HEADER_BYTES];
    for (i, v) in [SUBMIT_MAGIC, res, request_bytes, reply_capacity, 0]
        .into_iter()
        .enumerate()
    {
        h[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
    }
    h
}

impl<K: Kernel> Exchange<K> {
    /// Checks the features, reads the capset, creates the context and the first buffer.
    /// `page` is the guest's page size: blob sizes are multiples of it and of 4096.
    pub(crate) fn new(mut k: K, page: usize) -> Result<Self, TransportError> {
        for (param, name) in [
            (
                PARAM_RESOURCE_BLOB,
                "blob resources (VIRTGPU_PARAM_RESOURCE_BLOB)",
            ),
            (
                PARAM_CONTEXT_INIT,
                "context initialisation (VIRTGPU_PARAM_CONTEXT_INIT)",
            ),
        ] {
            if k.getparam(param)? != 1 {
                return Err(TransportError::Missing(name));
            }
        }
        let mut raw = [0u8; CAPSET_BYTES];
        k.get_caps(CAPSET_ID, CAPSET_VERSION, &mut raw)?;
        let word = |i: usize| u32::from_le_bytes([raw[i], raw[i + 1], raw[i + 2], raw[i + 3]]);
        let caps = Caps {
            version: word(0),
            max_message_bytes: word(4),
            max_buffer_bytes: word(8),
        };
        if caps.version != CAPSET_VERSION {
            return Err(TransportError::Device(format!(
                "capset {CAPSET_ID} is version {}, this library speaks {CAPSET_VERSION}",
                caps.version
            )));
        }
        let align = page.max(BLOB_ALIGN);
        if !align.is_power_of_two() {
            return Err(TransportError::Device(format!("page size {page}")));
        }
        let limit = usize::try_from(caps.max_buffer_bytes).unwrap_or(usize::MAX) / align * align;
        if limit == 0 {
            return Err(TransportError::Device(format!(
                "max_buffer_bytes {} is less than a page",
                caps.max_buffer_bytes
            )));
        }
        k.context_init(&[(CONTEXT_PARAM_CAPSET_ID, u64::from(CAPSET_ID))])?;
        let mut x = Exchange {
            k,
            caps,
            align,
            limit,
            buf: None,
            stuck: false,
        };
        x.reserve(0, MIN_BUFFER_BYTES)?;
        Ok(x)
    }

    pub(crate) fn caps(&self) -> Caps {
        self.caps
    }

    /// Makes the buffer hold a request of `request` bytes and, as far as the device allows, a
    /// reply of `reply` bytes; returns it.
    fn reserve(&mut self, request: usize, reply: usize) -> Result<Buffer, TransportError> {
        let want = request.max(reply).max(MIN_BUFFER_BYTES);
        let size = round_up(want, self.align)
            .unwrap_or(usize::MAX)
            .min(self.limit);
        if request > size {
            return Err(TransportError::RequestTooLarge {
                len: request,
                max: self.limit,
            });
        }
        if let Some(b) = self.buf.filter(|b| b.size >= size) {
            return Ok(b);
        }
        let blob = self.k.create_blob(
            VIRTGPU_BLOB_MEM_GUEST,
            VIRTGPU_BLOB_FLAG_USE_MAPPABLE,
            size as u64,
        )?;
        if let Err(e) = self.k.map(blob.bo, size) {
            let _ = self.k.close(blob.bo);
            return Err(e);
        }
        self.release();
        let b = Buffer { blob, size };
        self.buf = Some(b);
        Ok(b)
    }

    /// Unmaps and closes the buffer.
    fn release(&mut self) {
        if let Some(b) = self.buf.take() {
            self.k.unmap(b.blob.bo);
            let _ = self.k.close(b.blob.bo);
        }
    }

    fn mem(&mut self, bo: u32) -> Result<&mut [u8], TransportError> {
        self.k
            .mem(bo)
            .ok_or_else(|| TransportError::Device("the buffer is not mapped".into()))
    }
}

impl<K: Kernel> Drop for Exchange<K> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<K: Kernel> Transport for Exchange<K> {
    fn call(&mut self, req: &Request) -> Result<Reply, TransportError> {
        if self.stuck {
            return Err(TransportError::Device(
                "an earlier request was never answered".into(),
            ));
        }
        let bytes = req.encode();
        let b = self.reserve(bytes.len(), expected_reply(req))?;
        let request_bytes =
            u32::try_from(bytes.len()).map_err(|_| TransportError::RequestTooLarge {
                len: bytes.len(),
                max: self.limit,
            })?;
        // `limit` keeps every size within u32.
        let capacity = u32::try_from(b.size)
            .map_err(|_| TransportError::Device(format!("buffer of {} bytes past u32", b.size)))?;
        let mem = self.mem(b.blob.bo)?;
        mem.get_mut(..bytes.len())
            .ok_or_else(|| TransportError::Device("mapping shorter than the buffer".into()))?
            .copy_from_slice(&bytes);
        let header = submit_header(b.blob.res, request_bytes, capacity);
        self.k.execbuffer(&header, &[b.blob.bo])?;
        // Until the wait succeeds the device may still write the buffer: a later request
        // must not share it.
        self.stuck = true;
        let deadline = Instant::now() + REPLY_TIMEOUT;
        while !self.k.wait(b.blob.bo)? {
            if Instant::now() >= deadline {
                return Err(TransportError::Timeout(REPLY_TIMEOUT));
            }
        }
        self.stuck = false;
        let mem = self.mem(b.blob.bo)?;
        let head: [u8; 4] = mem
            .get(..4)
            .and_then(|h| h.try_into().ok())
            .ok_or_else(|| TransportError::Device("mapping shorter than the buffer".into()))?;
        let len = u32::from_le_bytes(head);
        let end = usize::try_from(len).ok().and_then(|l| l.checked_add(4));
        let body = match end {
            Some(end) if end <= b.size => mem
                .get(4..end)
                .ok_or_else(|| TransportError::Device("mapping shorter than the buffer".into()))?,
            _ => {
                return Err(TransportError::ReplyPastCapacity {
                    len: u64::from(len),
                    capacity: b.size,
                });
            }
        };
        wire::body_len(head)?;
        Ok(Reply::decode(body)?)
    }
}

/// Requests over the guest's virtio-gpu render node.
#[derive(Debug)]
pub struct DrmTransport(Exchange<Drm>);

impl DrmTransport {
    /// Opens `$VGPU_CUDA_DRM`, else [`DEFAULT_NODE`].
    pub fn open() -> Result<Self, TransportError> {
        let path = std::env::var(DRM_ENV).unwrap_or_else(|_| DEFAULT_NODE.to_owned());
        Self::open_path(&path)
    }

    /// Opens the render node at `path`: checks its features and capset, creates the compute
    /// context and the first buffer.
    pub fn open_path(path: &str) -> Result<Self, TransportError> {
        let k = Drm::open(path)?;
        Ok(DrmTransport(Exchange::new(k, page_size())?))
    }

    /// What the device's capset says.
    pub fn caps(&self) -> Caps {
        self.0.caps()
    }
}

impl Transport for DrmTransport {
    fn call(&mut self, req: &Request) -> Result<Reply, TransportError> {
        self.0.call(req)
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system; it has no memory effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).unwrap_or(BLOB_ALIGN)
}

/// A shared mapping of one blob.
#[derive(Debug)]
struct Mapping {
    bo: u32,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is memory this process owns through `Mapping` alone (nothing else holds
// its address); moving it to another thread moves that ownership.
unsafe impl Send for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` are exactly what mmap returned and was given; no slice of the
        // mapping outlives `self` (they borrow it).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The virtio-gpu render node and this process's mappings of its blobs.
#[derive(Debug)]
pub(crate) struct Drm {
    node: RenderNode,
    maps: Vec<Mapping>,
}

/// The transport's error for a render-node call that failed.
fn kernel(e: DrmError) -> TransportError {
    match e {
        DrmError::Ioctl { name, source } => TransportError::Ioctl {
            ioctl: name,
            errno: source.raw_os_error().unwrap_or(0),
        },
        other => TransportError::Device(other.to_string()),
    }
}

impl Drm {
    fn open(path: &str) -> Result<Self, TransportError> {
        let node = RenderNode::open(std::path::Path::new(path)).map_err(|e| match e {
            DrmError::Open { path, source } => TransportError::NoDevice {
                path: path.display().to_string(),
                source,
            },
            other => kernel(other),
        })?;
        Ok(Drm {
            node,
            maps: Vec::new(),
        })
    }
}

impl Kernel for Drm {
    fn getparam(&mut self, param: u64) -> Result<u64, TransportError> {
        self.node.get_param(param).map(u64::from).map_err(kernel)
    }

    fn get_caps(&mut self, id: u32, version: u32, out: &mut [u8]) -> Result<(), TransportError> {
        self.node.get_caps(id, version, out).map_err(kernel)
    }

    fn context_init(&mut self, params: &[(u64, u64)]) -> Result<(), TransportError> {
        self.node.context_init(params).map_err(kernel)
    }

    fn create_blob(
        &mut self,
        blob_mem: u32,
        flags: u32,
        size: u64,
    ) -> Result<Blob, TransportError> {
        self.node.create_blob(blob_mem, flags, size).map_err(kernel)
    }

    fn map(&mut self, bo: u32, len: usize) -> Result<(), TransportError> {
        let offset = self.node.map_offset(bo).map_err(kernel)?;
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| TransportError::Device(format!("map offset {offset:#x} past off_t")))?;
        // SAFETY: a new shared mapping chosen by the kernel (no address hint), of the blob at
        // the fake offset MAP returned; it overlaps nothing of this process.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.node.fd().as_raw_fd(),
                offset,
            )
        };
        if p == libc::MAP_FAILED {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            return Err(TransportError::Ioctl {
                ioctl: "mmap",
                errno,
            });
        }
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| TransportError::Device("mmap returned NULL".into()))?;
        self.maps.push(Mapping { bo, ptr, len });
        Ok(())
    }

    fn mem(&mut self, bo: u32) -> Option<&mut [u8]> {
        let m = self.maps.iter_mut().find(|m| m.bo == bo)?;
        // SAFETY: the mapping is `len` readable and writable bytes, alive while `m` is (the
        // slice borrows `self` mutably, so it cannot be unmapped meanwhile). The device writes
        // to it only between an EXECBUFFER and the end of the WAIT on its fence, never while
        // the exchange holds this slice.
        Some(unsafe { std::slice::from_raw_parts_mut(m.ptr.as_ptr(), m.len) })
    }

    fn unmap(&mut self, bo: u32) {
        self.maps.retain(|m| m.bo != bo);
    }

    fn execbuffer(&mut self, command: &[u8], bo_handles: &[u32]) -> Result<(), TransportError> {
        self.node.execbuffer_on(command, bo_handles).map_err(kernel)
    }

    fn wait(&mut self, bo: u32) -> Result<bool, TransportError> {
        // The kernel waits 15 s at most per call, then answers EBUSY (`Ok(false)`).
        self.node.wait(bo).map_err(kernel)
    }

    fn close(&mut self, bo: u32) -> Result<(), TransportError> {
        self.node.gem_close(bo).map_err(kernel)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use mdev_backend::compute::remote::{Owned, Stats, dispatch};
    use mdev_backend::compute::{CpuBackend, CpuConfig};

    use super::*;
    use crate::driver::{Driver, LaunchParams};

    /// How the fake device misbehaves.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Fault {
        None,
        /// Writes this reply length instead of the reply's.
        ReplyLength(u32),
    }

    /// The guest kernel and the vGPU in-process: blobs are plain memory, EXECBUFFER checks the
    /// header as the device does, reads the request from the blob, runs it on a CPU backend
    /// with the dispatch of a host connection and writes the reply framed at offset 0.
    struct Fake {
        params: HashMap<u64, u64>,
        caps: [u32; 4],
        context: Option<Vec<(u64, u64)>>,
        /// bo handle → (resource id, memory, mapped).
        blobs: HashMap<u32, (u32, Vec<u8>, bool)>,
        next: u32,
        created: Vec<u64>,
        closed: Vec<u32>,
        headers: Vec<[u8; SUBMIT_HEADER_BYTES]>,
        /// A submitted fence not yet waited for.
        pending: Option<u32>,
        /// Waits answered "not yet" before the one that completes.
        busy_waits: usize,
        /// WAIT fails (after the busy answers).
        fail_wait: bool,
        fault: Fault,
        be: CpuBackend,
        owned: Owned,
        stats: Stats,
    }

    impl Fake {
        fn new() -> Self {
            Fake {
                params: HashMap::from([(PARAM_RESOURCE_BLOB, 1), (PARAM_CONTEXT_INIT, 1)]),
                caps: [1, wire::MAX_MESSAGE_BYTES as u32, 64 << 20, 0],
                context: None,
                blobs: HashMap::new(),
                next: 1,
                created: Vec::new(),
                closed: Vec::new(),
                headers: Vec::new(),
                pending: None,
                busy_waits: 0,
                fail_wait: false,
                fault: Fault::None,
                be: CpuBackend::new(CpuConfig::default()),
                owned: Owned::default(),
                stats: Stats::default(),
            }
        }

        /// What the device does with one SUBMIT; `Err` fails the submit and writes nothing.
        fn submit(&mut self, h: &[u8], bos: &[u32]) -> Result<(), &'static str> {
            let word = |i: usize| u32::from_le_bytes(h[i * 4..i * 4 + 4].try_into().unwrap());
            if h.len() != SUBMIT_HEADER_BYTES || word(0) != SUBMIT_MAGIC || word(4) != 0 {
                return Err("not a header");
            }
            let (res, request_bytes, capacity) = (word(1), word(2) as usize, word(3) as usize);
            let (&bo, _) = self
                .blobs
                .iter()
                .find(|(_, b)| b.0 == res)
                .ok_or("unknown resource")?;
            if !bos.contains(&bo) {
                return Err("buffer not named");
            }
            let mem = &mut self.blobs.get_mut(&bo).unwrap().1;
            if request_bytes > mem.len() || capacity > mem.len() || request_bytes < 4 {
                return Err("sizes past the buffer");
            }
            let len = wire::body_len(mem[..4].try_into().unwrap()).map_err(|_| "length")?;
            let reply = match mem.get(4..4 + len).map(Request::decode) {
                Some(Ok(req)) if 4 + len == request_bytes => {
                    dispatch(&mut self.be, &mut self.owned, &mut self.stats, req)
                }
                _ => bad("unreadable request"),
            };
            let mut out = reply.encode();
            if out.len() > capacity {
                out = bad("reply past capacity").encode();
            }
            if let Fault::ReplyLength(len) = self.fault {
                out[..4].copy_from_slice(&len.to_le_bytes());
            }
            mem[..out.len()].copy_from_slice(&out);
            Ok(())
        }
    }

    fn bad(why: &str) -> Reply {
        Reply::Error {
            status: 1,
            message: why.into(),
        }
    }

    fn einval(ioctl: &'static str) -> TransportError {
        TransportError::Ioctl {
            ioctl,
            errno: libc::EINVAL,
        }
    }

    impl Kernel for Fake {
        fn getparam(&mut self, param: u64) -> Result<u64, TransportError> {
            Ok(self.params.get(&param).copied().unwrap_or(0))
        }

        fn get_caps(&mut self, id: u32, ver: u32, out: &mut [u8]) -> Result<(), TransportError> {
            if (id, ver) != (CAPSET_ID, CAPSET_VERSION) {
                return Err(einval("get_caps"));
            }
            let raw: Vec<u8> = self.caps.iter().flat_map(|w| w.to_le_bytes()).collect();
            let n = out.len().min(raw.len());
            out[..n].copy_from_slice(&raw[..n]);
            Ok(())
        }

        fn context_init(&mut self, params: &[(u64, u64)]) -> Result<(), TransportError> {
            if self.context.is_some() {
                return Err(einval("context_init"));
            }
            self.context = Some(params.to_vec());
            Ok(())
        }

        fn create_blob(&mut self, mem: u32, flags: u32, size: u64) -> Result<Blob, TransportError> {
            let ok = self.context.is_some()
                && (mem, flags) == (VIRTGPU_BLOB_MEM_GUEST, VIRTGPU_BLOB_FLAG_USE_MAPPABLE)
                && size > 0
                && size % BLOB_ALIGN as u64 == 0
                && size <= u64::from(self.caps[2]);
            if !ok {
                return Err(einval("create_blob"));
            }
            let blob = Blob {
                bo: self.next,
                res: self.next + 100,
            };
            self.next += 1;
            self.created.push(size);
            self.blobs
                .insert(blob.bo, (blob.res, vec![0; size as usize], false));
            Ok(blob)
        }

        fn map(&mut self, bo: u32, len: usize) -> Result<(), TransportError> {
            match self.blobs.get_mut(&bo) {
                Some(b) if b.1.len() == len => {
                    b.2 = true;
                    Ok(())
                }
                _ => Err(einval("map")),
            }
        }

        fn mem(&mut self, bo: u32) -> Option<&mut [u8]> {
            self.blobs
                .get_mut(&bo)
                .filter(|b| b.2)
                .map(|b| b.1.as_mut_slice())
        }

        fn unmap(&mut self, bo: u32) {
            if let Some(b) = self.blobs.get_mut(&bo) {
                b.2 = false;
            }
        }

        fn execbuffer(&mut self, command: &[u8], bos: &[u32]) -> Result<(), TransportError> {
            let header: [u8; SUBMIT_HEADER_BYTES] =
                command.try_into().map_err(|_| einval("execbuffer"))?;
            self.headers.push(header);
            // The kernel accepts any command; a bad header fails on the device, which writes
            // nothing, and the fence still signals.
            let _ = self.submit(command, bos);
            self.pending = bos.first().copied();
            Ok(())
        }

        fn wait(&mut self, bo: u32) -> Result<bool, TransportError> {
            if !self.blobs.contains_key(&bo) {
                return Err(einval("wait"));
            }
            if self.pending == Some(bo) && self.busy_waits > 0 {
                self.busy_waits -= 1;
                return Ok(false);
            }
            if self.fail_wait {
                return Err(einval("wait"));
            }
            self.pending = None;
            Ok(true)
        }

        fn close(&mut self, bo: u32) -> Result<(), TransportError> {
            let b = self.blobs.remove(&bo).ok_or_else(|| einval("close"))?;
            assert!(!b.2, "closed while mapped");
            self.closed.push(bo);
            Ok(())
        }
    }

    fn exchange() -> Exchange<Fake> {
        Exchange::new(Fake::new(), 4096).unwrap()
    }

    const PTX: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
        .visible .entry put(.param .u64 p, .param .u32 v)\n{\n.reg .b32 %r<2>;\n\
        .reg .b64 %rd<2>;\nld.param.u64 %rd1, [p];\nld.param.u32 %r1, [v];\n\
        st.global.u32 [%rd1], %r1;\nret;\n}\n";

    /// Every header submitted is one: the magic, the buffer's resource, sizes within it.
    fn assert_headers(f: &Fake, size: usize) {
        assert!(!f.headers.is_empty());
        for h in &f.headers {
            let word = |i: usize| u32::from_le_bytes(h[i * 4..i * 4 + 4].try_into().unwrap());
            assert_eq!(&h[..4], b"VGCU");
            assert_eq!(word(0), SUBMIT_MAGIC);
            assert!(word(1) > 100, "a resource id");
            assert!(word(2) as usize >= 6 && word(2) <= word(3));
            assert!(word(3) as usize <= size);
            assert_eq!(word(4), 0);
        }
    }

    #[test]
    fn a_kernel_runs_through_the_driver_over_the_drm_transport() {
        let mut d = Driver::new(exchange()).unwrap();
        let ctx = d.context_create().unwrap();
        let m = d
            .module_load(ctx, crate::driver::Image::Single(PTX.as_bytes().to_vec()))
            .unwrap();
        let f = d.function(m, "put").unwrap();
        let a = d.mem_alloc(ctx, 8).unwrap();
        let packed = [a.to_le_bytes().as_slice(), &0x5eedu32.to_le_bytes()].concat();
        d.launch(
            ctx,
            f,
            [1, 1, 1],
            [1, 1, 1],
            0,
            0,
            LaunchParams::Packed(packed),
            false,
        )
        .unwrap();
        let mut out = [0u8; 4];
        d.copy_dtoh(ctx, &mut out, a, 0).unwrap();
        assert_eq!(u32::from_le_bytes(out), 0x5eed);
        // A host error comes back as the call's status.
        assert_eq!(d.function(m, "nope"), Err(500));
        let x = &d_transport(&d);
        assert_eq!(
            x.created,
            [MIN_BUFFER_BYTES as u64],
            "one buffer did it all"
        );
        assert_eq!(
            x.context.as_deref(),
            Some([(CONTEXT_PARAM_CAPSET_ID, 21)].as_slice())
        );
        assert_headers(x, MIN_BUFFER_BYTES);
        assert!(x.stats.launches == 1 && x.stats.failed == 1);
    }

    fn d_transport(d: &Driver<Exchange<Fake>>) -> &Fake {
        &d.transport().k
    }

    #[test]
    fn the_buffer_grows_for_big_copies_and_the_old_one_is_closed() {
        let mut d = Driver::new(exchange()).unwrap();
        let ctx = d.context_create().unwrap();
        let n = 6 << 20;
        let a = d.mem_alloc(ctx, n as u64).unwrap();
        let data: Vec<u8> = (0..n).map(|i| (i * 13 % 251) as u8).collect();
        d.copy_htod(ctx, a, &data, 0).unwrap();
        d.flush().unwrap();
        let grown = d_transport(&d).created.clone();
        assert_eq!(grown.len(), 2, "grown for the request");
        assert!(grown[1] as usize >= n && grown[1] % 4096 == 0);
        let mut back = vec![0u8; n];
        d.copy_dtoh(ctx, &mut back, a, 0).unwrap();
        assert!(back == data);
        let x = d_transport(&d);
        assert!(x.created.len() <= 3);
        assert!(*x.created.last().unwrap() as usize >= n + REPLY_SLACK);
        assert_eq!(x.closed.len(), x.created.len() - 1, "old buffers closed");
        assert_eq!(x.blobs.len(), 1);
        assert_headers(x, *x.created.last().unwrap() as usize);
        // Dropping the transport unmaps and closes the last one.
        drop(d);
    }

    #[test]
    fn a_device_to_host_copy_grows_the_buffer_for_its_reply() {
        let mut x = exchange();
        let ctx = match x.call(&Request::ContextCreate).unwrap() {
            Reply::Id(c) => mdev_backend::compute::backend::ContextId(c),
            r => panic!("{r:?}"),
        };
        let n = 6u64 << 20;
        let Reply::Address(src) = x.call(&Request::MemAlloc { ctx, bytes: n }).unwrap() else {
            panic!()
        };
        let req = Request::CopyDtoH {
            ctx,
            src,
            bytes: n,
            stream: mdev_backend::compute::backend::DEFAULT_STREAM,
        };
        assert_eq!(x.k.created.len(), 1);
        match x.call(&req).unwrap() {
            Reply::Data(d) => assert_eq!(d.len() as u64, n),
            r => panic!("{r:?}"),
        }
        assert_eq!(x.k.created.len(), 2);
        assert!(x.k.created[1] >= n + REPLY_SLACK as u64);
        assert_eq!(x.k.closed, [1]);
    }

    #[test]
    fn growth_stops_at_the_device_limit() {
        let mut f = Fake::new();
        f.caps[2] = (5 << 20) + 123;
        const { assert!(MIN_BUFFER_BYTES < 5 << 20) };
        let mut x = Exchange::new(f, 4096).unwrap();
        assert_eq!(x.limit, 5 << 20);
        let ctx = match x.call(&Request::ContextCreate).unwrap() {
            Reply::Id(c) => mdev_backend::compute::backend::ContextId(c),
            r => panic!("{r:?}"),
        };
        let big = Request::CopyHtoD {
            ctx,
            dst: 0,
            data: vec![0; 6 << 20],
            stream: mdev_backend::compute::backend::DEFAULT_STREAM,
        };
        assert!(matches!(
            x.call(&big),
            Err(TransportError::RequestTooLarge { .. })
        ));
        // A reply expected past the limit: the buffer is the largest, the device answers
        // within it.
        let req = Request::CopyDtoH {
            ctx,
            src: 0,
            bytes: 6 << 20,
            stream: mdev_backend::compute::backend::DEFAULT_STREAM,
        };
        assert!(matches!(x.call(&req), Ok(Reply::Error { .. })));
        assert_eq!(x.k.created, [MIN_BUFFER_BYTES as u64, 5 << 20]);
    }

    #[test]
    fn a_reply_length_past_the_capacity_is_an_error_not_a_panic() {
        for len in [MIN_BUFFER_BYTES as u32 - 3, u32::MAX - 2, u32::MAX] {
            let mut x = exchange();
            x.k.fault = Fault::ReplyLength(len);
            match x.call(&Request::Attributes) {
                Err(TransportError::ReplyPastCapacity {
                    len: l,
                    capacity: MIN_BUFFER_BYTES,
                }) => assert_eq!(l, u64::from(len)),
                r => panic!("{len}: {r:?}"),
            }
        }
        // Through the driver: a failed call, not a panic.
        let mut f = Fake::new();
        f.fault = Fault::ReplyLength(MIN_BUFFER_BYTES as u32);
        let x = Exchange::new(f, 4096).unwrap();
        assert_eq!(
            Driver::new(x).err(),
            Some(crate::status::CUDA_ERROR_NO_DEVICE)
        );
    }

    #[test]
    fn waits_the_kernel_gives_up_on_are_repeated() {
        let mut x = exchange();
        x.k.busy_waits = 3;
        assert!(matches!(
            x.call(&Request::Attributes),
            Ok(Reply::Attributes(_))
        ));
        assert_eq!(x.k.busy_waits, 0);
    }

    #[test]
    fn after_a_failed_wait_the_buffer_is_not_reused() {
        let mut x = exchange();
        x.k.busy_waits = 1;
        x.k.fail_wait = true;
        assert!(matches!(
            x.call(&Request::Attributes),
            Err(TransportError::Ioctl { .. })
        ));
        let submits = x.k.headers.len();
        assert!(matches!(
            x.call(&Request::Attributes),
            Err(TransportError::Device(_))
        ));
        assert_eq!(x.k.headers.len(), submits, "nothing submitted");
    }

    #[test]
    fn a_node_that_is_not_virtio_gpu_fails_its_first_ioctl() {
        match DrmTransport::open_path("/dev/null") {
            Err(TransportError::Ioctl { ioctl, errno }) => {
                assert_eq!(ioctl, "DRM_IOCTL_VIRTGPU_GETPARAM");
                assert_eq!(errno, libc::ENOTTY);
            }
            r => panic!("{:?}", r.err()),
        }
    }

    #[test]
    fn missing_features_and_a_wrong_capset_are_errors() {
        for param in [PARAM_RESOURCE_BLOB, PARAM_CONTEXT_INIT] {
            let mut f = Fake::new();
            f.params.insert(param, 0);
            match Exchange::new(f, 4096) {
                Err(e @ TransportError::Missing(_)) => {
                    assert!(e.to_string().contains("VIRTGPU_PARAM_"), "{e}")
                }
                r => panic!("{:?}", r.err()),
            }
        }
        let mut f = Fake::new();
        f.caps[0] = 2;
        assert!(matches!(
            Exchange::new(f, 4096),
            Err(TransportError::Device(_))
        ));
        let mut f = Fake::new();
        f.caps[2] = 100;
        assert!(matches!(
            Exchange::new(f, 4096),
            Err(TransportError::Device(_))
        ));
    }

    #[test]
    fn a_missing_node_is_a_clear_error() {
        let e = DrmTransport::open_path("/nonexistent/renderD128").unwrap_err();
        assert!(matches!(e, TransportError::NoDevice { .. }));
        assert!(e.to_string().contains("/nonexistent/renderD128"), "{e}");
        let e = TransportError::Ioctl {
            ioctl: "DRM_IOCTL_VIRTGPU_EXECBUFFER",
            errno: libc::ENOSYS,
        };
        assert!(
            e.to_string()
                .starts_with("DRM_IOCTL_VIRTGPU_EXECBUFFER failed: ")
        );
    }

    #[test]
    fn the_submit_header_is_five_little_endian_words() {
        let h = submit_header(7, 40, 4096);
        assert_eq!(
            h,
            [
                0x56, 0x47, 0x43, 0x55, 7, 0, 0, 0, 40, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0
            ]
        );
    }
}
