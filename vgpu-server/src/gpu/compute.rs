//! The private compute capset (capset 21, hop 5 for CUDA work): a guest's CUDA driver
//! (`guest-drivers/libcuda`) reaches the VM's compute backend through SUBMIT_3D on a context
//! created with this capset, exchanging `mdev_backend::compute::wire` messages through a
//! guest-memory blob (`docs/CUDA-GUEST.md`, "The virtio-gpu transport").
//!
//! Decoding is pure: [`decode_header`] checks the 20-byte submit header, [`Blobs`] the guest
//! blobs it names, [`decode_request`] the request read from one. [`ComputeRuntime`] executes:
//! requests run on the VM's compute executor thread (`compute::Executor`), never on the device
//! worker; each finished request comes back as a [`Done`] the device turns into the reply in
//! the guest's blob, the submit's fence and the scheduler's `Completed`.

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};

use log::{debug, info, warn};
use mdev_backend::compute::remote::{Owned, Stats, dispatch};
use mdev_backend::compute::wire::{self, Reply, Request};
use mdev_backend::compute::{
    ComputeBackend, ComputeError, CpuBackend, CpuConfig, Executor, ExecutorConfig, NvCuda,
};
use vgpu_schedd::seqpacket::monotonic_ns;
use vgpu_scheduler::{CostSignature, GroupId};
use vm_memory::{Bytes, GuestAddress, GuestMemory};
use vmm_sys_util::eventfd::EventFd;

use super::load::LoadToken;
use super::protocol::{MemEntry, ResourceCreateBlob, ty};

/// The compute capset's id (`VGPU_COMPUTE_CAPSET_ID`), next to the load capset 20.
pub const VGPU_COMPUTE_CAPSET_ID: u32 = 21;
/// The compute capset's only version.
pub const COMPUTE_CAPSET_VERSION: u32 = 1;
/// Size of the capset blob: `{version, max_message_bytes, max_buffer_bytes, reserved}`.
pub const COMPUTE_CAPSET_SIZE: u32 = 16;
/// First word of a compute submit ("VGCU").
pub const SUBMIT_MAGIC: u32 = 0x5543_4756;
/// A compute submit is exactly its header: `{magic, resource_id, request_bytes,
/// reply_capacity, reserved}`.
pub const SUBMIT_HEADER_BYTES: usize = 20;
/// VIRTIO_GPU_BLOB_MEM_GUEST: the only blob memory offered.
pub const BLOB_MEM_GUEST: u32 = 1;
/// Largest blob: bounds what one request makes the device copy out of guest memory (a
/// module of `ptx::MAX_PTX_BYTES` with its framing fits).
pub const MAX_BLOB_BYTES: u64 = 128 << 20;
/// Most blobs a guest holds at once (each costs the device its entry list only).
pub const MAX_BLOBS: usize = 4096;
/// Most compute requests of one VM queued or running on its executor: a guest that does not
/// wait for its replies gets errors past this, never an unbounded queue.
pub const MAX_IN_FLIGHT: usize = 32;
/// Smallest reply capacity a submit may give: an error reply always fits.
pub const MIN_REPLY_CAPACITY: u32 = 64;

/// Errors of compute submits and guest blobs; each maps to a VIRTIO_GPU_RESP_ERR_* code.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ComputeSubmitError {
    /// The submit is not a header of [`SUBMIT_HEADER_BYTES`].
    #[error("compute submit of {0} bytes (a header is {SUBMIT_HEADER_BYTES})")]
    HeaderSize(usize),
    /// The header's magic is wrong.
    #[error("compute submit magic {0:#x}")]
    Magic(u32),
    /// The header names a resource that is not a guest blob with memory.
    #[error("resource {0} is not a guest blob with memory")]
    NotABlob(u32),
    /// The request or reply does not fit the blob, or the reply capacity is too small.
    #[error("request of {request} bytes / reply capacity {reply} for a blob of {size}")]
    Bounds {
        /// Request bytes.
        request: u32,
        /// Reply capacity.
        reply: u32,
        /// Blob size.
        size: u64,
    },
    /// A blob that is not guest memory, too large, or whose entries do not cover it.
    #[error("blob {id}: {why}")]
    BadBlob {
        /// The resource id.
        id: u32,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The resource id is 0 or taken.
    #[error("resource id {0} is 0 or in use")]
    IdTaken(u32),
    /// [`MAX_BLOBS`] blobs exist.
    #[error("{MAX_BLOBS} blobs exist")]
    TooMany,
    /// Guest memory named by a blob's entries could not be read or written.
    #[error("blob {0}: guest memory outside RAM")]
    Memory(u32),
}

impl ComputeSubmitError {
    /// The virtio-gpu response code.
    pub fn response_code(&self) -> u32 {
        match self {
            ComputeSubmitError::NotABlob(_) => ty::ERR_INVALID_RESOURCE_ID,
            ComputeSubmitError::IdTaken(_) => ty::ERR_INVALID_RESOURCE_ID,
            ComputeSubmitError::TooMany => ty::ERR_OUT_OF_MEMORY,
            _ => ty::ERR_INVALID_PARAMETER,
        }
    }
}

/// The capset blob: `{version, max_message_bytes, max_buffer_bytes, reserved}`.
pub fn capset_blob() -> Vec<u8> {
    [
        COMPUTE_CAPSET_VERSION,
        wire::MAX_MESSAGE_BYTES as u32,
        MAX_BLOB_BYTES as u32,
        0,
    ]
    .iter()
    .flat_map(|w| w.to_le_bytes())
    .collect()
}

/// A compute submit's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubmitHeader {
    /// The blob holding the request, where the reply goes.
    pub resource_id: u32,
    /// Bytes of the request at offset 0 (its framing included).
    pub request_bytes: u32,
    /// Bytes the reply may take at offset 0.
    pub reply_capacity: u32,
}

/// Decodes a compute submit's command stream (its header; nothing else may follow).
pub fn decode_header(dwords: &[u32]) -> Result<SubmitHeader, ComputeSubmitError> {
    let [magic, resource_id, request_bytes, reply_capacity, _reserved] = *dwords else {
        return Err(ComputeSubmitError::HeaderSize(
            dwords.len().saturating_mul(4),
        ));
    };
    if magic != SUBMIT_MAGIC {
        return Err(ComputeSubmitError::Magic(magic));
    }
    Ok(SubmitHeader {
        resource_id,
        request_bytes,
        reply_capacity,
    })
}

/// Decodes the request read from a blob: one framed `wire` message, nothing after it.
pub fn decode_request(bytes: &[u8]) -> Result<Request, wire::WireError> {
    let header: [u8; 4] = bytes
        .get(..4)
        .and_then(|h| h.try_into().ok())
        .ok_or(wire::WireError::Truncated)?;
    let len = wire::body_len(header)?;
    let body = &bytes[4..];
    if body.len() != len {
        return Err(if body.len() < len {
            wire::WireError::Truncated
        } else {
            wire::WireError::Trailing(body.len() - len)
        });
    }
    Request::decode(body)
}

/// The cost signature of a request's device work, for the scheduler's history: launches,
/// and threads and bytes by power of two (requests of the same shape predict each other).
pub fn signature(work: &wire::Work) -> CostSignature {
    let log2 = |n: u64| 64 - n.leading_zeros();
    CostSignature::from_methods(&mut [
        (1, u32::try_from(work.launches).unwrap_or(u32::MAX)),
        (2, log2(work.threads)),
        (3, log2(work.bytes)),
    ])
}

/// A guest blob: guest pages the device reads and writes in place.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Blob {
    size: u64,
    /// `None` once its backing was detached.
    entries: Option<Vec<MemEntry>>,
}

/// The guest blobs of one VM.
#[derive(Debug, Default)]
pub struct Blobs(BTreeMap<u32, Blob>);

impl Blobs {
    /// RESOURCE_CREATE_BLOB; `taken`: the id names another resource.
    pub fn create(
        &mut self,
        c: &ResourceCreateBlob,
        taken: bool,
    ) -> Result<(), ComputeSubmitError> {
        let id = c.resource_id;
        if id == 0 || taken || self.0.contains_key(&id) {
            return Err(ComputeSubmitError::IdTaken(id));
        }
        let bad = |why| Err(ComputeSubmitError::BadBlob { id, why });
        if c.blob_mem != BLOB_MEM_GUEST {
            return bad("only guest-memory blobs are offered");
        }
        if c.size == 0 || c.size > MAX_BLOB_BYTES {
            return bad("size is 0 or past the largest blob");
        }
        let covered = c
            .entries
            .iter()
            .try_fold(0u64, |sum, e| sum.checked_add(u64::from(e.length)));
        if covered.is_none_or(|n| n < c.size) {
            return bad("its memory entries do not cover its size");
        }
        if self.0.len() >= MAX_BLOBS {
            return Err(ComputeSubmitError::TooMany);
        }
        self.0.insert(
            id,
            Blob {
                size: c.size,
                entries: Some(c.entries.clone()),
            },
        );
        Ok(())
    }

    /// Whether `id` is a blob.
    pub fn contains(&self, id: u32) -> bool {
        self.0.contains_key(&id)
    }

    /// RESOURCE_UNREF of a blob; false if `id` is not one.
    pub fn remove(&mut self, id: u32) -> bool {
        self.0.remove(&id).is_some()
    }

    /// RESOURCE_DETACH_BACKING of a blob; false if `id` is not one.
    pub fn detach(&mut self, id: u32) -> bool {
        self.0.get_mut(&id).map(|b| b.entries = None).is_some()
    }

    /// Every blob goes (a reset).
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Checks a submit's header against its blob.
    pub fn check(&self, h: &SubmitHeader) -> Result<(), ComputeSubmitError> {
        let blob = self
            .0
            .get(&h.resource_id)
            .filter(|b| b.entries.is_some())
            .ok_or(ComputeSubmitError::NotABlob(h.resource_id))?;
        let fits = |n: u32| u64::from(n) <= blob.size;
        if !fits(h.request_bytes)
            || !fits(h.reply_capacity)
            || h.reply_capacity < MIN_REPLY_CAPACITY
            || h.request_bytes as usize > wire::MAX_MESSAGE_BYTES + 4
        {
            return Err(ComputeSubmitError::Bounds {
                request: h.request_bytes,
                reply: h.reply_capacity,
                size: blob.size,
            });
        }
        Ok(())
    }

    /// The guest ranges of `len` bytes from the start of blob `id`.
    fn ranges(&self, id: u32, len: usize) -> Result<Vec<(u64, usize)>, ComputeSubmitError> {
        let entries = self
            .0
            .get(&id)
            .filter(|b| len as u64 <= b.size)
            .and_then(|b| b.entries.as_ref())
            .ok_or(ComputeSubmitError::NotABlob(id))?;
        let mut out = Vec::new();
        let mut left = len;
        for e in entries {
            if left == 0 {
                break;
            }
            let n = left.min(e.length as usize);
            out.push((e.addr, n));
            left -= n;
        }
        Ok(out)
    }

    /// Reads `len` bytes from the start of blob `id` out of guest memory.
    pub fn read<M: GuestMemory>(
        &self,
        mem: &M,
        id: u32,
        len: usize,
    ) -> Result<Vec<u8>, ComputeSubmitError> {
        let mut out = vec![0u8; len];
        let mut at = 0;
        for (addr, n) in self.ranges(id, len)? {
            mem.read_slice(&mut out[at..at + n], GuestAddress(addr))
                .map_err(|_| ComputeSubmitError::Memory(id))?;
            at += n;
        }
        Ok(out)
    }

    /// Writes `bytes` at the start of blob `id` into guest memory.
    pub fn write<M: GuestMemory>(
        &self,
        mem: &M,
        id: u32,
        bytes: &[u8],
    ) -> Result<(), ComputeSubmitError> {
        let mut at = 0;
        for (addr, n) in self.ranges(id, bytes.len())? {
            mem.write_slice(&bytes[at..at + n], GuestAddress(addr))
                .map_err(|_| ComputeSubmitError::Memory(id))?;
            at += n;
        }
        Ok(())
    }
}

/// Which backend a VM's compute requests run on (`vgpu-server --compute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeKind {
    /// The PTX executor on the host's CPUs.
    Cpu,
    /// NVIDIA's driver (`libcuda.so.1`); absent, every request answers NoDevice.
    NvCuda,
}

/// A request that finished on the executor, for the device to complete.
#[derive(Debug)]
pub struct Done {
    /// The token its fenced submit waits on.
    pub token: LoadToken,
    /// The blob its reply goes to, and the room there.
    pub resource_id: u32,
    pub reply_capacity: u32,
    /// The encoded reply.
    pub reply: Vec<u8>,
    /// Its scheduler group and session, when it was one.
    pub group: Option<(GroupId, u64)>,
    /// When it began and ended running (monotonic ns).
    pub start: u64,
    pub finish: u64,
    generation: u64,
}

/// What one guest compute context owns on the backend.
#[derive(Debug, Default)]
struct Session {
    owned: Owned,
    stats: Stats,
}

/// A VM's compute execution: its executor thread (made at the first request), the sessions
/// of its guest compute contexts, and the requests in flight.
pub struct ComputeRuntime {
    kind: ComputeKind,
    executor: Option<Result<Executor, ComputeError>>,
    sessions: HashMap<u32, Arc<Mutex<Session>>>,
    done_tx: Sender<Done>,
    done_rx: Receiver<Done>,
    /// Written once per finished request: wakes the device's worker.
    notify: Option<Arc<EventFd>>,
    in_flight: usize,
    /// Bumped at every reset: what finishes from before is dropped.
    generation: u64,
}

impl std::fmt::Debug for ComputeRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputeRuntime")
            .field("kind", &self.kind)
            .field("sessions", &self.sessions.len())
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl ComputeRuntime {
    pub fn new(kind: ComputeKind) -> ComputeRuntime {
        let (done_tx, done_rx) = channel();
        ComputeRuntime {
            kind,
            executor: None,
            sessions: HashMap::new(),
            done_tx,
            done_rx,
            notify: None,
            in_flight: 0,
            generation: 0,
        }
    }

    /// The eventfd written when a request finishes (the worker's control-queue kick).
    pub fn set_notify(&mut self, notify: Arc<EventFd>) {
        self.notify = Some(notify);
    }

    fn executor(&mut self) -> Result<&Executor, ComputeError> {
        let kind = self.kind;
        self.executor
            .get_or_insert_with(|| {
                let make = move || -> Result<Box<dyn ComputeBackend>, ComputeError> {
                    Ok(match kind {
                        ComputeKind::Cpu => Box::new(CpuBackend::new(CpuConfig::default())),
                        ComputeKind::NvCuda => {
                            let mut b = NvCuda::new(0)?;
                            // This process serves one VM: the driver's printf output is its.
                            b.capture_printf()?;
                            Box::new(b)
                        }
                    })
                };
                let e = Executor::spawn(
                    "vgpu-compute",
                    ExecutorConfig::default(),
                    make,
                    Box::new(|_| {}),
                );
                match &e {
                    Ok(_) => info!("compute backend {kind:?} ready"),
                    Err(err) => warn!("compute backend {kind:?} unavailable: {err}"),
                }
                e
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Runs `req` of guest compute context `ctx` on the executor. When it finishes, a [`Done`]
    /// carrying its reply (at most `reply_capacity` bytes encoded, else an error reply) comes
    /// out of [`ComputeRuntime::take_done`]. An error here (executor unavailable or full) is
    /// the request's reply, to be written at once.
    pub fn post(
        &mut self,
        ctx: u32,
        req: Request,
        token: LoadToken,
        target: (u32, u32),
        group: Option<(GroupId, u64)>,
    ) -> Result<(), Reply> {
        if self.in_flight >= MAX_IN_FLIGHT {
            return Err(Reply::error(&ComputeError::Busy(format!(
                "{MAX_IN_FLIGHT} compute requests in flight"
            ))));
        }
        let session = Arc::clone(self.sessions.entry(ctx).or_default());
        let (tx, notify, generation) = (self.done_tx.clone(), self.notify.clone(), self.generation);
        let (resource_id, reply_capacity) = target;
        let executor = self.executor().map_err(|e| Reply::error(&e))?;
        executor
            .post(move |be| {
                let start = monotonic_ns();
                let reply = {
                    let mut s = session.lock().unwrap_or_else(PoisonError::into_inner);
                    let Session { owned, stats } = &mut *s;
                    dispatch(be, owned, stats, req)
                };
                let finish = monotonic_ns();
                let _ = tx.send(Done {
                    token,
                    resource_id,
                    reply_capacity,
                    reply: fitted(&reply, reply_capacity),
                    group,
                    start,
                    finish,
                    generation,
                });
                if let Some(n) = notify
                    && let Err(e) = n.write(1)
                {
                    warn!("waking the device worker: {e}");
                }
            })
            .map_err(|e| Reply::error(&e))?;
        self.in_flight += 1;
        Ok(())
    }

    /// The requests that finished since the last call (those from before a reset dropped).
    pub fn take_done(&mut self) -> Vec<Done> {
        let mut out = Vec::new();
        while let Ok(d) = self.done_rx.try_recv() {
            if d.generation == self.generation {
                self.in_flight = self.in_flight.saturating_sub(1);
                out.push(d);
            }
        }
        out
    }

    /// Guest compute context `ctx` is destroyed: the backend contexts it made go too.
    pub fn destroy(&mut self, ctx: u32) {
        if let Some(session) = self.sessions.remove(&ctx) {
            self.release(session);
        }
    }

    /// A device reset or QEMU's disconnect: every session's backend contexts are destroyed
    /// and what is in flight is forgotten.
    pub fn reset(&mut self) {
        self.generation = self.generation.wrapping_add(1);
        self.in_flight = 0;
        for (_, session) in std::mem::take(&mut self.sessions) {
            self.release(session);
        }
    }

    fn release(&mut self, session: Arc<Mutex<Session>>) {
        let Some(Ok(executor)) = &self.executor else {
            return;
        };
        let r = executor.post(move |be| {
            let mut s = session.lock().unwrap_or_else(PoisonError::into_inner);
            debug!(
                "compute session ends: {} requests, {} launches, {} failed",
                s.stats.requests, s.stats.launches, s.stats.failed
            );
            s.owned.release(be);
        });
        if let Err(e) = r {
            warn!("releasing a compute session's contexts: {e}");
        }
    }
}

/// The encoded reply if it fits `capacity`, else a short error reply
/// (CUDA_ERROR_INVALID_VALUE), which always fits [`MIN_REPLY_CAPACITY`].
pub fn fitted(reply: &Reply, capacity: u32) -> Vec<u8> {
    let bytes = reply.encode();
    if bytes.len() <= capacity as usize {
        return bytes;
    }
    Reply::Error {
        status: ComputeError::InvalidValue(String::new()).cuda_status(),
        message: "reply too large".into(),
    }
    .encode()
}
