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
//!
//! A request that is a scheduler group runs time-sliced: every [`SLICE`] of running time it
//! pauses and reports [`Event::Yielded`], the device completes its group there and gates a
//! continuation group, and [`ComputeRuntime::resume`] lets it go on once that is granted. So
//! a guest's long kernels hold the scheduler's GPU a slice at a time, as a GPU's compute
//! preemption time-slices contexts.

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use log::{debug, info, warn};
use mdev_backend::budget::{Charge, MemoryBudget, OverBudget};
use mdev_backend::compute::backend::{DEFAULT_REQUEST_TIME, Slicing};
use mdev_backend::compute::executor::Scope;
use mdev_backend::compute::ptx::Engine;
use mdev_backend::compute::remote::{DeviceTime, Owned, Stats, dispatch};
use mdev_backend::compute::wire::{self, Reply, Request};
use mdev_backend::compute::{
    ComputeBackend, ComputeError, CpuConfig, Executor, ExecutorConfig, one_guest_backend,
};
use vgpu_schedd::seqpacket::monotonic_ns;
use vgpu_scheduler::{CostSignature, GroupId};
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};
use vmm_sys_util::eventfd::EventFd;

use super::device::entry_outside;
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
/// Most blobs a guest holds at once (each costs the device its entry list, charged to the
/// VM's budget).
pub const MAX_BLOBS: usize = 4096;
/// Host bytes one entry of a blob's list costs.
const BLOB_ENTRY_BYTES: u64 = std::mem::size_of::<MemEntry>() as u64;
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
    /// A blob entry is not guest RAM now: at RESOURCE_CREATE_BLOB, or (after a DMA_UNMAP) at
    /// a submit that needs it.
    #[error("blob {id}: entry {addr:#x}+{length:#x} is not in guest RAM")]
    NotInRam {
        /// The resource id.
        id: u32,
        /// The entry's guest address.
        addr: u64,
        /// Its length.
        length: u32,
    },
    /// The blob's entry list would take the VM past its host-memory budget.
    #[error(transparent)]
    OutOfMemory(#[from] OverBudget),
}

impl ComputeSubmitError {
    /// The virtio-gpu response code.
    pub fn response_code(&self) -> u32 {
        match self {
            ComputeSubmitError::NotABlob(_) => ty::ERR_INVALID_RESOURCE_ID,
            ComputeSubmitError::IdTaken(_) => ty::ERR_INVALID_RESOURCE_ID,
            ComputeSubmitError::TooMany | ComputeSubmitError::OutOfMemory(_) => {
                ty::ERR_OUT_OF_MEMORY
            }
            // What QEMU's device answers for an entry it cannot map.
            ComputeSubmitError::NotInRam { .. } | ComputeSubmitError::Memory(_) => ty::ERR_UNSPEC,
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

/// Why a compute submit does not run.
#[derive(Debug, Clone, PartialEq)]
pub enum Refused {
    /// Its header is bad: the SUBMIT_3D fails with this response code and nothing is written.
    Submit(u32),
    /// Its request is: this reply answers it in the blob the header names.
    Request(SubmitHeader, Reply),
}

/// A compute submit's header, the request it carries, and what the request's bytes are
/// charged to the VM's budget until it has run.
pub type Submit = (SubmitHeader, Request, Charge);

/// A guest blob: guest pages the device reads and writes in place.
#[derive(Debug)]
struct Blob {
    size: u64,
    /// Its entries and what the list is charged; `None` once its backing was detached.
    entries: Option<(Vec<MemEntry>, Charge)>,
}

/// The guest blobs of one VM.
#[derive(Debug, Default)]
pub struct Blobs(BTreeMap<u32, Blob>);

impl Blobs {
    /// RESOURCE_CREATE_BLOB; `taken`: the id names another resource. Every entry must be
    /// guest memory `mem` now (as QEMU's device checks when it maps a blob), and the entry
    /// list is charged to `budget`, the VM's, before the device keeps a copy.
    pub fn create<M: GuestMemory>(
        &mut self,
        c: &ResourceCreateBlob,
        taken: bool,
        mem: &M,
        budget: &Arc<MemoryBudget>,
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
        // Reserved before the entries are walked, so that a guest past its budget is refused
        // at once (dropped again if an entry is refused). At most MAX_BACKING_ENTRIES entries
        // (the decoder's bound): no overflow.
        let charge = budget.charge(c.entries.len() as u64 * BLOB_ENTRY_BYTES)?;
        if let Some(e) = entry_outside(&c.entries, mem, Permissions::ReadWrite) {
            return Err(ComputeSubmitError::NotInRam {
                id,
                addr: e.addr,
                length: e.length,
            });
        }
        self.0.insert(
            id,
            Blob {
                size: c.size,
                entries: Some((c.entries.clone(), charge)),
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

    /// A compute submit: its header (`dwords`) checked against its blob, the blob's request
    /// and reply bytes checked to be guest memory `mem` (a DMA_UNMAP may have taken them
    /// since the blob was made: then the submit fails, as nothing can be answered there),
    /// and the request charged to `budget`, read from the blob and decoded.
    pub fn request<M: GuestMemory>(
        &self,
        dwords: &[u32],
        mem: &M,
        budget: &Arc<MemoryBudget>,
    ) -> Result<Submit, Refused> {
        let header = decode_header(dwords)
            .and_then(|h| self.check(&h).map(|()| h))
            .and_then(|h| self.check_in_ram(&h, mem).map(|()| h))
            .map_err(|e| {
                debug!("compute submit refused: {e}");
                Refused::Submit(e.response_code())
            })?;
        let answer = |e: ComputeError| Refused::Request(header, Reply::error(&e));
        let bad = |why: String| answer(ComputeError::InvalidValue(why));
        // The copy and the request decoded from it live until the request has run.
        let charge = budget
            .charge(u64::from(header.request_bytes))
            .map_err(|e| answer(ComputeError::OutOfMemory(format!("compute request: {e}"))))?;
        let bytes = self
            .read(mem, header.resource_id, header.request_bytes as usize)
            .map_err(|e| bad(e.to_string()))?;
        let req = decode_request(&bytes).map_err(|e| bad(format!("compute request: {e}")))?;
        Ok((header, req, charge))
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

    /// Checks that the guest memory a submit's request and reply take of its blob is in
    /// `mem` now.
    fn check_in_ram<M: GuestMemory>(
        &self,
        h: &SubmitHeader,
        mem: &M,
    ) -> Result<(), ComputeSubmitError> {
        let len = h.request_bytes.max(h.reply_capacity) as usize;
        let id = h.resource_id;
        match entry_outside(&self.ranges(id, len)?, mem, Permissions::ReadWrite) {
            Some(e) => Err(ComputeSubmitError::NotInRam {
                id,
                addr: e.addr,
                length: e.length,
            }),
            None => Ok(()),
        }
    }

    /// The guest ranges of `len` bytes from the start of blob `id`.
    fn ranges(&self, id: u32, len: usize) -> Result<Vec<MemEntry>, ComputeSubmitError> {
        let (entries, _) = self
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
            // At most the entry's own u32 length.
            let n = left.min(e.length as usize);
            out.push(MemEntry {
                addr: e.addr,
                length: n as u32,
            });
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
        for e in self.ranges(id, len)? {
            let n = e.length as usize;
            mem.read_slice(&mut out[at..at + n], GuestAddress(e.addr))
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
        for e in self.ranges(id, bytes.len())? {
            let n = e.length as usize;
            mem.write_slice(&bytes[at..at + n], GuestAddress(e.addr))
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

/// How long a scheduled compute request runs before it yields the GPU to the scheduler
/// (compute time-slicing). A neighbour's group waits at most about this long behind a guest's
/// long kernel (plus a check interval of the interpreter, under a millisecond, and the daemon's
/// round trip), far under the daemon's 2 s group timeout and a 60 Hz frame (16.7 ms); each
/// slice costs a `Completed` and a grant (tens of microseconds), about 1% of a slice.
pub const SLICE: Duration = Duration::from_millis(10);

/// What the executor reports about a posted request, in order.
#[derive(Debug)]
pub enum Event {
    /// It finished.
    Done(Done),
    /// Its slice ended at `at` (monotonic ns): it is paused until [`ComputeRuntime::resume`]
    /// (or cancelled by a reset or its context's destroy).
    Yielded {
        /// The token of its submit.
        token: LoadToken,
        at: u64,
    },
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
    /// The reply's bytes, charged to the VM's budget until the reply is written and dropped.
    pub charge: Option<Charge>,
    /// Its scheduler group and session, when it was one.
    pub group: Option<(GroupId, u64)>,
    /// When it began and ended running (monotonic ns).
    pub start: u64,
    pub finish: u64,
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
    /// The VM's host-memory budget: the backend charges device memory and modules to it.
    budget: Arc<MemoryBudget>,
    /// Longest one request may run on the PTX executor.
    request_time: Duration,
    /// What runs kernels on the PTX executor.
    engine: Engine,
    executor: Option<Result<Executor, ComputeError>>,
    sessions: HashMap<u32, Arc<Mutex<Session>>>,
    /// What the executor reports, tagged with the generation it was posted in.
    done_tx: Sender<(u64, Event)>,
    done_rx: Receiver<(u64, Event)>,
    /// The request paused at the end of a slice (its submit's token) and when it paused,
    /// waiting for [`ComputeRuntime::resume`].
    yielded: Option<(LoadToken, u64)>,
    /// The device time of the VM's work, shared by its sessions (`Request::Usage`): the time
    /// its requests waited paused is taken off when they go on or end.
    device_time: DeviceTime,
    /// Written once per finished request: wakes the device's worker.
    notify: Option<Arc<EventFd>>,
    /// Requests posted to the executor and not yet reported back by it, of every generation:
    /// what the executor really holds for this VM (a reset cancels them, and they are
    /// answered within milliseconds, but until then they hold their place).
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
    /// The compute runtime of a VM whose backend is `kind` and whose host-memory budget is
    /// `budget` (the device's: one budget per VM). Its executor starts at the first request.
    pub fn new(kind: ComputeKind, budget: Arc<MemoryBudget>) -> ComputeRuntime {
        let (done_tx, done_rx) = channel();
        ComputeRuntime {
            kind,
            budget,
            request_time: DEFAULT_REQUEST_TIME,
            engine: Engine::default(),
            executor: None,
            sessions: HashMap::new(),
            done_tx,
            done_rx,
            yielded: None,
            device_time: DeviceTime::default(),
            notify: None,
            in_flight: 0,
            generation: 0,
        }
    }

    /// This runtime with its PTX executor's requests bounded by `time` instead of
    /// [`DEFAULT_REQUEST_TIME`] (`vgpu-server --compute-request-time`).
    pub fn with_request_time(mut self, time: Duration) -> ComputeRuntime {
        self.request_time = time;
        self
    }

    /// This runtime with its PTX executor's kernels run by `engine` (`vgpu-server
    /// --ptx-engine`; compiled code by default).
    pub fn with_ptx_engine(mut self, engine: Engine) -> ComputeRuntime {
        self.engine = engine;
        self
    }

    /// The eventfd written when a request finishes (the worker's control-queue kick).
    pub fn set_notify(&mut self, notify: Arc<EventFd>) {
        self.notify = Some(notify);
    }

    /// The backend this runtime runs requests on.
    pub fn kind(&self) -> ComputeKind {
        self.kind
    }

    fn executor(&mut self) -> Result<&Executor, ComputeError> {
        if self.executor.is_none() {
            self.executor = Some(spawn_executor(
                self.kind,
                Arc::clone(&self.budget),
                self.request_time,
                self.engine,
            ));
        }
        match &self.executor {
            Some(Ok(executor)) => Ok(executor),
            Some(Err(e)) => Err(e.clone()),
            None => Err(ComputeError::NoDevice("no executor".into())),
        }
    }

    /// Runs `req` of guest compute context `ctx` on the executor. When it finishes, an
    /// [`Event::Done`] carrying its reply (at most `reply_capacity` bytes encoded, else an
    /// error reply) comes out of [`ComputeRuntime::take_events`]. A request that is a
    /// scheduler group (`group`) runs sliced: every [`SLICE`] it pauses and an
    /// [`Event::Yielded`] comes out. An error here (executor unavailable or full) is the
    /// request's reply, to be written at once. `charge` holds the request's bytes: the job
    /// owns it, so it is given back when the request has run, or when a cancelled job is
    /// answered or dropped, never earlier or later.
    pub fn post(
        &mut self,
        ctx: u32,
        req: Request,
        charge: Charge,
        token: LoadToken,
        target: (u32, u32),
        group: Option<(GroupId, u64)>,
    ) -> Result<(), Reply> {
        if self.in_flight >= MAX_IN_FLIGHT {
            return Err(Reply::error(&ComputeError::Busy(format!(
                "{MAX_IN_FLIGHT} compute requests in flight"
            ))));
        }
        let device_time = &self.device_time;
        let session = Arc::clone(self.sessions.entry(ctx).or_insert_with(|| {
            Arc::new(Mutex::new(Session {
                owned: Owned::default(),
                stats: Stats {
                    device_time: device_time.clone(),
                    ..Stats::default()
                },
            }))
        }));
        let (tx, notify, generation) = (self.done_tx.clone(), self.notify.clone(), self.generation);
        let (resource_id, reply_capacity) = target;
        let budget = Arc::clone(&self.budget);
        let slicing = group.map(|_| {
            let (tx, notify) = (tx.clone(), notify.clone());
            Slicing {
                slice: SLICE,
                on_yield: Arc::new(move || {
                    let at = monotonic_ns();
                    let _ = tx.send((generation, Event::Yielded { token, at }));
                    wake(notify.as_deref());
                }),
            }
        });
        let job = move |be: Result<&mut dyn ComputeBackend, ComputeError>| {
            let start = monotonic_ns();
            let reply = match be {
                Ok(be) => {
                    let mut s = session.lock().unwrap_or_else(PoisonError::into_inner);
                    let Session { owned, stats } = &mut *s;
                    dispatch(be, owned, stats, req)
                }
                // Cancelled before it ran (a reset, its context destroyed).
                Err(e) => Reply::error(&e),
            };
            // The request is consumed: its bytes go back before its reply's are charged.
            drop(charge);
            let finish = monotonic_ns();
            let (reply, charge) = charged_reply(&budget, &reply, reply_capacity);
            let done = Done {
                token,
                resource_id,
                reply_capacity,
                reply,
                charge,
                group,
                start,
                finish,
            };
            let _ = tx.send((generation, Event::Done(done)));
            wake(notify.as_deref());
        };
        let executor = self.executor().map_err(|e| Reply::error(&e))?;
        let scope = Scope::Client(u64::from(ctx));
        match slicing {
            Some(slicing) => executor.post_sliced(scope, slicing, job),
            None => executor.post(scope, job),
        }
        .map_err(|e| Reply::error(&e))?;
        self.in_flight += 1;
        Ok(())
    }

    /// What the executor reported since the last call, in order (what is from before a reset
    /// dropped, though its requests are counted out of what is in flight).
    pub fn take_events(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        while let Ok((generation, e)) = self.done_rx.try_recv() {
            if let Event::Done(d) = &e {
                self.in_flight = self.in_flight.saturating_sub(1);
                if let Some((token, at)) = self.yielded
                    && token == d.token
                {
                    // It ended paused (cancelled): paused until it ended.
                    self.device_time.paused(d.finish.saturating_sub(at));
                    self.yielded = None;
                }
            }
            if generation != self.generation {
                continue;
            }
            if let Event::Yielded { token, at } = &e {
                self.yielded = Some((*token, *at));
            }
            out.push(e);
        }
        out
    }

    /// Lets the request of submit `token`, paused at the end of a slice, run its next slice;
    /// false when it is not paused (it finished or was cancelled meanwhile).
    pub fn resume(&mut self, token: LoadToken) -> bool {
        let Some((paused, at)) = self.yielded else {
            return false;
        };
        if paused != token {
            return false;
        }
        self.yielded = None;
        self.device_time.paused(monotonic_ns().saturating_sub(at));
        matches!(&self.executor, Some(Ok(executor)) if executor.resume())
    }

    /// Guest compute context `ctx` is destroyed (its program exited or was killed): its
    /// running kernel stops and its queued requests are answered without running, then the
    /// backend contexts it made go, before any other queued work.
    pub fn destroy(&mut self, ctx: u32) {
        if let Some(Ok(executor)) = &self.executor {
            let cancelled = executor.cancel_scope(Scope::Client(u64::from(ctx)));
            debug!("compute context {ctx} destroyed: {cancelled} queued requests cancelled");
        }
        if let Some(session) = self.sessions.remove(&ctx) {
            self.release(session);
        }
    }

    /// A device reset or QEMU's disconnect: everything in flight is cancelled (the running
    /// kernel stops within milliseconds, queued requests are answered without running, and
    /// their replies dropped), then every session's backend contexts are destroyed, before
    /// anything queued later.
    pub fn reset(&mut self) {
        self.generation = self.generation.wrapping_add(1);
        if let Some((_, at)) = self.yielded.take() {
            self.device_time.paused(monotonic_ns().saturating_sub(at));
        }
        self.cancel();
        for (_, session) in std::mem::take(&mut self.sessions) {
            self.release(session);
        }
    }

    /// Stops everything of the VM on the executor: the running kernel at its next check,
    /// the queued requests answered without running. Later requests run. Dropping the
    /// runtime does this and ends the executor.
    pub fn cancel(&mut self) {
        if let Some(Ok(executor)) = &self.executor {
            let cancelled = executor.cancel_all();
            debug!("compute: {cancelled} queued requests cancelled");
        }
    }

    /// Destroys a session's backend contexts on the executor, ahead of queued work and never
    /// cancelled, so a release happens however full the queue is.
    fn release(&mut self, session: Arc<Mutex<Session>>) {
        let Some(Ok(executor)) = &self.executor else {
            return;
        };
        let r = executor.post_urgent(Scope::Device, move |be| {
            let mut s = session.lock().unwrap_or_else(PoisonError::into_inner);
            debug!(
                "compute session ends: {} requests, {} launches, {} failed",
                s.stats.requests, s.stats.launches, s.stats.failed
            );
            match be {
                Ok(be) => s.owned.release(be),
                Err(e) => warn!("a compute session's contexts not released: {e}"),
            }
        });
        if let Err(e) = r {
            warn!("releasing a compute session's contexts: {e}");
        }
    }
}

/// Wakes the device's worker (a request finished or yielded).
fn wake(notify: Option<&EventFd>) {
    if let Some(n) = notify
        && let Err(e) = n.write(1)
    {
        warn!("waking the device worker: {e}");
    }
}

/// Starts a VM's executor thread with its backend, which charges `budget`, the VM's, bounds
/// each request by `request_time` and runs kernels on `engine`.
fn spawn_executor(
    kind: ComputeKind,
    budget: Arc<MemoryBudget>,
    request_time: Duration,
    engine: Engine,
) -> Result<Executor, ComputeError> {
    let make = move || -> Result<Box<dyn ComputeBackend>, ComputeError> {
        // The guest's GPU memory is its VM's whole budget (`--resource-memory-mb`), shared
        // with everything else the device holds for it.
        let config = CpuConfig {
            memory_per_context: budget.limit(),
            budget,
            engine,
            ..CpuConfig::default()
        }
        .with_request_time(request_time);
        one_guest_backend(kind == ComputeKind::NvCuda, config)
    };
    let e = Executor::spawn(
        "vgpu-compute",
        ExecutorConfig::default(),
        make,
        Box::new(|_| {}),
    );
    match &e {
        Ok(_) => info!("compute backend {kind:?} ready (PTX engine {engine:?})"),
        Err(err) => warn!("compute backend {kind:?} unavailable: {err}"),
    }
    e
}

/// The encoded reply fitted to `capacity` ([`fitted`]) and charged to the VM's budget while it
/// waits to be written into the guest's blob (up to [`MAX_IN_FLIGHT`] replies of up to a
/// blob each), or, past the budget, a short `CUDA_ERROR_OUT_OF_MEMORY` reply, which is not
/// charged (it always fits [`MIN_REPLY_CAPACITY`]).
pub fn charged_reply(
    budget: &Arc<MemoryBudget>,
    reply: &Reply,
    capacity: u32,
) -> (Vec<u8>, Option<Charge>) {
    let bytes = fitted(reply, capacity);
    match budget.charge(bytes.len() as u64) {
        Ok(charge) => (bytes, Some(charge)),
        Err(e) => {
            let refused = Reply::error(&ComputeError::OutOfMemory(format!("reply: {e}")));
            (fitted(&refused, capacity), None)
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use mdev_backend::compute::backend::ContextId;
    use vm_memory::GuestMemoryMmap;

    /// `bytes` of guest RAM at 0.
    fn ram(bytes: usize) -> GuestMemoryMmap {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), bytes)]).unwrap()
    }

    /// A budget no test here reaches.
    fn budget() -> Arc<MemoryBudget> {
        MemoryBudget::new(1 << 30)
    }

    fn blob(id: u32, size: u64, entries: &[(u64, u32)]) -> ResourceCreateBlob {
        ResourceCreateBlob {
            resource_id: id,
            blob_mem: BLOB_MEM_GUEST,
            blob_flags: 1,
            blob_id: 0,
            size,
            entries: entries
                .iter()
                .map(|&(addr, length)| MemEntry { addr, length })
                .collect(),
        }
    }

    #[test]
    fn headers_are_exactly_five_words_with_the_magic() {
        let good = [SUBMIT_MAGIC, 3, 100, 4096, 0];
        assert_eq!(
            decode_header(&good),
            Ok(SubmitHeader {
                resource_id: 3,
                request_bytes: 100,
                reply_capacity: 4096
            })
        );
        assert_eq!(
            decode_header(&good[..4]),
            Err(ComputeSubmitError::HeaderSize(16))
        );
        assert_eq!(
            decode_header(&[SUBMIT_MAGIC, 3, 100, 4096, 0, 0]),
            Err(ComputeSubmitError::HeaderSize(24))
        );
        assert_eq!(
            decode_header(&[1, 3, 100, 4096, 0]),
            Err(ComputeSubmitError::Magic(1))
        );
    }

    #[test]
    fn blobs_are_guest_memory_covered_by_their_entries_and_bounded() {
        let (mem, budget) = (ram(0x10000), budget());
        let mut b = Blobs::default();
        let mut host = blob(1, 4096, &[(0, 4096)]);
        host.blob_mem = 2;
        assert!(matches!(
            b.create(&host, false, &mem, &budget),
            Err(ComputeSubmitError::BadBlob { .. })
        ));
        for bad in [
            blob(1, 0, &[(0, 4096)]),
            blob(1, 8192, &[(0, 4096)]),
            blob(1, MAX_BLOB_BYTES + 1, &[(0, u32::MAX), (0, u32::MAX)]),
        ] {
            assert!(matches!(
                b.create(&bad, false, &mem, &budget),
                Err(ComputeSubmitError::BadBlob { .. })
            ));
        }
        assert_eq!(
            b.create(&blob(0, 4096, &[(0, 4096)]), false, &mem, &budget),
            Err(ComputeSubmitError::IdTaken(0))
        );
        assert_eq!(
            b.create(&blob(1, 4096, &[(0, 4096)]), true, &mem, &budget),
            Err(ComputeSubmitError::IdTaken(1))
        );
        b.create(
            &blob(1, 8192, &[(0, 4096), (0x4000, 4096)]),
            false,
            &mem,
            &budget,
        )
        .unwrap();
        assert_eq!(
            b.create(&blob(1, 4096, &[(0, 4096)]), false, &mem, &budget),
            Err(ComputeSubmitError::IdTaken(1))
        );
        let h = |request_bytes, reply_capacity| SubmitHeader {
            resource_id: 1,
            request_bytes,
            reply_capacity,
        };
        b.check(&h(8192, 8192)).unwrap();
        for bad in [h(8193, 64), h(8, 8193), h(8, MIN_REPLY_CAPACITY - 1)] {
            assert!(matches!(
                b.check(&bad),
                Err(ComputeSubmitError::Bounds { .. })
            ));
        }
        assert!(b.detach(1));
        assert_eq!(b.check(&h(8, 64)), Err(ComputeSubmitError::NotABlob(1)));
        assert!(b.remove(1) && !b.remove(1) && !b.detach(1));
        for id in 1..=MAX_BLOBS as u32 {
            b.create(&blob(id, 4096, &[(0, 4096)]), false, &mem, &budget)
                .unwrap();
        }
        assert_eq!(
            b.create(&blob(0xffff, 4096, &[(0, 4096)]), false, &mem, &budget),
            Err(ComputeSubmitError::TooMany)
        );
    }

    #[test]
    fn blob_reads_and_writes_follow_the_entries_and_stay_in_guest_memory() {
        let (mem, budget) = (ram(0x10000), budget());
        let mut b = Blobs::default();
        // Two pieces in reverse order of address.
        b.create(
            &blob(1, 8, &[(0x2000, 4), (0x1000, 4)]),
            false,
            &mem,
            &budget,
        )
        .unwrap();
        b.write(&mem, 1, &[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(
            mem.read_obj::<[u8; 4]>(GuestAddress(0x2000)).unwrap(),
            [1, 2, 3, 4]
        );
        assert_eq!(
            mem.read_obj::<[u8; 2]>(GuestAddress(0x1000)).unwrap(),
            [5, 6]
        );
        assert_eq!(b.read(&mem, 1, 6).unwrap(), [1, 2, 3, 4, 5, 6]);
        assert_eq!(b.read(&mem, 1, 9), Err(ComputeSubmitError::NotABlob(1)));
        // Made while RAM went further; read and written after a DMA_UNMAP took its end.
        b.create(&blob(2, 8, &[(0xfffc, 8)]), false, &ram(0x20000), &budget)
            .unwrap();
        assert_eq!(
            b.write(&mem, 2, &[0; 8]),
            Err(ComputeSubmitError::Memory(2))
        );
        assert_eq!(b.read(&mem, 2, 8), Err(ComputeSubmitError::Memory(2)));
    }

    #[test]
    fn a_submit_is_refused_whole_for_a_bad_header_and_answered_for_a_bad_request() {
        let (mem, budget) = (ram(0x10000), budget());
        let mut b = Blobs::default();
        b.create(&blob(1, 4096, &[(0x1000, 4096)]), false, &mem, &budget)
            .unwrap();
        let req = Request::ContextCreate.encode();
        b.write(&mem, 1, &req).unwrap();
        let header = |n: usize| [SUBMIT_MAGIC, 1, n as u32, 4096, 0];
        let (h, got, charge) = b.request(&header(req.len()), &mem, &budget).unwrap();
        assert_eq!((h.resource_id, got), (1, Request::ContextCreate));
        assert_eq!(charge.bytes(), req.len() as u64, "its bytes are charged");
        drop(charge);
        assert_eq!(
            b.request(&[SUBMIT_MAGIC, 2, 8, 4096, 0], &mem, &budget)
                .err(),
            Some(Refused::Submit(ty::ERR_INVALID_RESOURCE_ID))
        );
        assert_eq!(
            b.request(&header(4097), &mem, &budget).err(),
            Some(Refused::Submit(ty::ERR_INVALID_PARAMETER))
        );
        // A request one byte short: answered with an error reply in the blob.
        let Err(Refused::Request(h, Reply::Error { status, .. })) =
            b.request(&header(req.len() - 1), &mem, &budget)
        else {
            panic!("an error reply")
        };
        assert_eq!((h.resource_id, status), (1, 1));
        // A request past the budget: answered CUDA_ERROR_OUT_OF_MEMORY, nothing read.
        let full = MemoryBudget::new(req.len() as u64 - 1);
        let Err(Refused::Request(_, Reply::Error { status, .. })) =
            b.request(&header(req.len()), &mem, &full)
        else {
            panic!("an error reply")
        };
        assert_eq!((status, full.used()), (2, 0));
    }

    #[test]
    fn a_submit_on_a_blob_whose_memory_was_unmapped_fails_whole() {
        // Issue 24, finding 8: a blob made in guest RAM whose second piece a DMA_UNMAP took
        // since. Its reply could not be written: the submit fails, it is not answered OK with
        // nothing written.
        let (before, after, budget) = (ram(0x20000), ram(0x10000), budget());
        let mut b = Blobs::default();
        let pieces = [(0x1000, 4096), (0x10000, 4096)];
        b.create(&blob(1, 8192, &pieces), false, &before, &budget)
            .unwrap();
        let req = Request::ContextCreate.encode();
        b.write(&after, 1, &req).unwrap();
        let submit = |reply: u32| [SUBMIT_MAGIC, 1, req.len() as u32, reply, 0];
        assert_eq!(
            b.request(&submit(8192), &after, &budget).err(),
            Some(Refused::Submit(ty::ERR_UNSPEC))
        );
        assert_eq!(budget.used(), 2 * BLOB_ENTRY_BYTES, "nothing more charged");
        // A submit within the piece still in RAM runs.
        let (_, got, _) = b.request(&submit(4096), &after, &budget).unwrap();
        assert_eq!(got, Request::ContextCreate);
    }

    #[test]
    fn blob_entries_are_checked_against_guest_ram_and_charged() {
        let (mem, budget) = (ram(0x10000), MemoryBudget::new(4 * BLOB_ENTRY_BYTES));
        let mut b = Blobs::default();
        for entries in [
            &[(0x7fff_0000_0000, 4096)][..],
            &[(0x1000, 2048), (0xf800, 4096)],
            &[(u64::MAX - 8, 4096)],
        ] {
            assert!(matches!(
                b.create(&blob(1, 4096, entries), false, &mem, &budget),
                Err(ComputeSubmitError::NotInRam { .. })
            ));
        }
        assert_eq!(budget.used(), 0);
        let four = [(0x1000, 1024); 4];
        b.create(&blob(1, 4096, &four), false, &mem, &budget)
            .unwrap();
        assert_eq!(budget.used(), 4 * BLOB_ENTRY_BYTES);
        assert!(matches!(
            b.create(&blob(2, 1024, &[(0x1000, 1024)]), false, &mem, &budget),
            Err(ComputeSubmitError::OutOfMemory(_))
        ));
        assert!(b.detach(1));
        assert_eq!(budget.used(), 0, "a detach gives the list back");
        b.create(&blob(2, 1024, &[(0x1000, 1024)]), false, &mem, &budget)
            .unwrap();
        b.clear();
        assert_eq!(budget.used(), 0, "so does a reset");
    }

    #[test]
    fn requests_are_one_framed_message_and_replies_fit_or_are_errors() {
        let req = Request::MemAlloc {
            ctx: ContextId(1),
            bytes: 64,
        };
        let bytes = req.encode();
        assert_eq!(decode_request(&bytes), Ok(req));
        assert!(decode_request(&bytes[..bytes.len() - 1]).is_err());
        let mut long = bytes.clone();
        long.push(0);
        assert!(decode_request(&long).is_err());
        assert!(decode_request(&[1, 0]).is_err());
        assert!(decode_request(&[0xff, 0xff, 0xff, 0xff]).is_err());

        let data = Reply::Data(vec![7; 1000]);
        assert_eq!(fitted(&data, 2000), data.encode());
        let cut = fitted(&data, MIN_REPLY_CAPACITY);
        assert!(cut.len() <= MIN_REPLY_CAPACITY as usize);
        let Ok(Reply::Error { status, .. }) = Reply::decode(&cut[4..]) else {
            panic!("an error reply")
        };
        assert_eq!(status, 1);
    }

    #[test]
    fn a_reply_waiting_to_be_written_is_charged_and_past_the_budget_is_out_of_memory() {
        let data = Reply::Data(vec![7; 1000]);
        let b = MemoryBudget::new(2000);
        let (bytes, charge) = charged_reply(&b, &data, 4096);
        assert_eq!(bytes, data.encode());
        assert_eq!(b.used(), bytes.len() as u64, "held while it waits");
        // A second one does not fit beside the first: a short error reply, not charged.
        let (refused, none) = charged_reply(&b, &data, 4096);
        assert!(none.is_none());
        let Ok(Reply::Error { status, .. }) = Reply::decode(&refused[4..]) else {
            panic!("an error reply")
        };
        assert_eq!(status, 2, "CUDA_ERROR_OUT_OF_MEMORY");
        drop(charge);
        assert_eq!(b.used(), 0, "given back once written and dropped");
    }

    #[test]
    fn signatures_group_requests_by_shape() {
        let w = |launches, threads, bytes| wire::Work {
            launches,
            threads,
            bytes,
        };
        assert_eq!(signature(&w(1, 1000, 0)), signature(&w(1, 1023, 0)));
        assert_ne!(signature(&w(1, 1000, 0)), signature(&w(1, 1025, 0)));
        assert_ne!(signature(&w(1, 0, 0)), signature(&w(2, 0, 0)));
        assert_ne!(signature(&w(0, 0, 4096)), signature(&w(0, 0, 1 << 20)));
    }

    fn wait_done(rt: &mut ComputeRuntime, n: usize) -> Vec<Done> {
        let mut done = Vec::new();
        let start = std::time::Instant::now();
        while done.len() < n {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(10),
                "no Done"
            );
            done.extend(rt.take_events().into_iter().filter_map(|e| match e {
                Event::Done(d) => Some(d),
                Event::Yielded { .. } => None,
            }));
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        done
    }

    #[test]
    fn the_backend_charges_device_memory_to_the_vms_budget() {
        const BUDGET: u64 = 64 << 20;
        let budget = MemoryBudget::new(BUDGET);
        let mut rt = ComputeRuntime::new(ComputeKind::Cpu, Arc::clone(&budget));
        let mut runner = super::super::load::LoadRunner::default();
        let Reply::Id(ctx) = ask(&mut rt, &mut runner, 1, Request::ContextCreate) else {
            panic!("a context")
        };
        let ctx = ContextId(ctx);
        let with_context = budget.used();
        assert!(with_context > 0, "the context's reserve is the VM's");
        let alloc = |bytes| Request::MemAlloc { ctx, bytes };
        assert!(matches!(
            ask(&mut rt, &mut runner, 1, alloc(1 << 20)),
            Reply::Address(_)
        ));
        assert!(budget.used() >= with_context + (1 << 20));
        // cuMemGetInfo on the device path: the budget is the total, its room what is free.
        let Reply::MemInfo { free, total } = ask(&mut rt, &mut runner, 1, Request::MemInfo { ctx })
        else {
            panic!("memory info")
        };
        assert_eq!(total, BUDGET);
        assert_eq!(free, BUDGET - budget.used());
        // Past the VM's budget: CUDA_ERROR_OUT_OF_MEMORY.
        let Reply::Error { status, .. } = ask(&mut rt, &mut runner, 1, alloc(BUDGET)) else {
            panic!("past the budget")
        };
        assert_eq!(status, 2);
        // The guest sees the VM's budget as its GPU memory, whatever its size.
        for bytes in [BUDGET, 3 << 30] {
            let mut rt = ComputeRuntime::new(ComputeKind::Cpu, MemoryBudget::new(bytes));
            let Reply::Attributes(a) = ask(&mut rt, &mut runner, 1, Request::Attributes) else {
                panic!("attributes")
            };
            assert_eq!(a.total_memory, bytes);
        }
    }

    #[test]
    fn usage_is_the_vms_device_time_in_every_session_less_the_time_paused_between_slices() {
        /// How long the test holds the kernel paused after its first slice.
        const PAUSE: std::time::Duration = std::time::Duration::from_millis(500);
        let mut rt = ComputeRuntime::new(ComputeKind::Cpu, budget());
        let mut runner = super::super::load::LoadRunner::default();
        let usage = |rt: &mut ComputeRuntime, runner: &mut _, guest| match ask(
            rt,
            runner,
            guest,
            Request::Usage,
        ) {
            Reply::Usage {
                busy_ns,
                elapsed_ns,
            } => (busy_ns, elapsed_ns),
            r => panic!("{r:?}"),
        };
        assert_eq!(usage(&mut rt, &mut runner, 2).0, 0, "nothing ran");
        // Guest context 1's kernel runs sliced: a slice, paused PAUSE, a slice, paused until
        // it is cancelled.
        let (_, launch) = spin_launch(&mut rt, &mut runner, 1);
        let token = runner.token();
        let charge = Charge::empty(&rt.budget);
        rt.post(1, launch, charge, token, (9, 4096), Some((GroupId(1), 1)))
            .unwrap();
        let yielded = |rt: &mut ComputeRuntime| {
            rt.take_events()
                .iter()
                .any(|e| matches!(e, Event::Yielded { .. }))
        };
        wait_until(&mut rt, yielded);
        std::thread::sleep(PAUSE);
        assert!(rt.resume(token));
        wait_until(&mut rt, yielded);
        rt.cancel();
        wait_done(&mut rt, 1);
        // Another program of the VM (guest context 2) sees the kernel's time: the VM's.
        let (busy, elapsed) = usage(&mut rt, &mut runner, 2);
        assert!(busy > 0, "the kernel ran");
        // Its pauses are not: whatever ran besides, busy and paused time fit in the elapsed.
        assert!(
            busy.saturating_add(PAUSE.as_nanos() as u64) <= elapsed,
            "busy {busy} ns of {elapsed} ns"
        );
        assert!(usage(&mut rt, &mut runner, 1).1 >= elapsed, "one origin");
    }

    #[test]
    fn the_runtime_answers_each_request_bounds_what_is_in_flight_and_forgets_across_a_reset() {
        let mut rt = ComputeRuntime::new(ComputeKind::Cpu, budget());
        let mut runner = super::super::load::LoadRunner::default();
        post(&mut rt, &mut runner, 1, Request::ContextCreate).unwrap();
        let done = wait_done(&mut rt, 1);
        assert_eq!((done[0].resource_id, done[0].reply_capacity), (9, 4096));
        assert!(done[0].start <= done[0].finish);
        let Ok(Reply::Id(ctx)) = Reply::decode(&done[0].reply[4..]) else {
            panic!("{:?}", done[0].reply)
        };
        // Context 2 may not name context 1's CUDA context.
        let foreign = Request::MemAlloc {
            ctx: ContextId(ctx),
            bytes: 4,
        };
        post(&mut rt, &mut runner, 2, foreign).unwrap();
        let done = wait_done(&mut rt, 1);
        let Ok(Reply::Error { status, .. }) = Reply::decode(&done[0].reply[4..]) else {
            panic!("an error")
        };
        assert_eq!(status, 400);
        // Unanswered requests past the bound are refused at once.
        for _ in 0..MAX_IN_FLIGHT {
            post(&mut rt, &mut runner, 1, Request::Attributes).unwrap();
        }
        let busy = post(&mut rt, &mut runner, 1, Request::Attributes);
        assert!(matches!(busy, Err(Reply::Error { .. })), "{busy:?}");
        // A reset forgets them: their Done never comes out.
        rt.reset();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(rt.take_events().is_empty());
        post(&mut rt, &mut runner, 1, Request::Attributes).unwrap();
        assert_eq!(wait_done(&mut rt, 1).len(), 1);
    }

    /// Posts `req` of guest context `guest`, unscheduled, its reply to blob 9 (4 KiB).
    fn post(
        rt: &mut ComputeRuntime,
        runner: &mut super::super::load::LoadRunner,
        guest: u32,
        req: Request,
    ) -> Result<(), Reply> {
        let charge = Charge::empty(&rt.budget);
        rt.post(guest, req, charge, runner.token(), (9, 4096), None)
    }

    /// Posts `req` of guest context `guest` and waits for its reply.
    pub(crate) fn ask(
        rt: &mut ComputeRuntime,
        runner: &mut super::super::load::LoadRunner,
        guest: u32,
        req: Request,
    ) -> Reply {
        post(rt, runner, guest, req).unwrap();
        let done = wait_done(rt, 1);
        Reply::decode(&done[0].reply[4..]).unwrap()
    }

    /// A backend context of guest context `guest` holding a kernel that never ends, and the
    /// request launching it.
    pub(crate) fn spin_launch(
        rt: &mut ComputeRuntime,
        runner: &mut super::super::load::LoadRunner,
        guest: u32,
    ) -> (ContextId, Request) {
        const SPIN: &str = ".version 7.0\n.target sm_70\n.address_size 64\n\
            .visible .entry spin()\n{\nLOOP:\nbra LOOP;\n}\n";
        let Reply::Id(ctx) = ask(rt, runner, guest, Request::ContextCreate) else {
            panic!("context")
        };
        let ctx = ContextId(ctx);
        let module = Request::ModuleLoad {
            ctx,
            image: SPIN.as_bytes().to_vec(),
        };
        let Reply::Id(m) = ask(rt, runner, guest, module) else {
            panic!("module")
        };
        let function = Request::Function {
            ctx,
            module: mdev_backend::compute::backend::ModuleId(m),
            name: "spin".into(),
        };
        let Reply::Function { id, .. } = ask(rt, runner, guest, function) else {
            panic!("function")
        };
        let launch = Request::Launch {
            ctx,
            function: id,
            grid: [1; 3],
            block: [32, 1, 1],
            shared_bytes: 0,
            stream: mdev_backend::compute::backend::DEFAULT_STREAM,
            params: vec![],
            cooperative: false,
        };
        (ctx, launch)
    }

    /// Waits (bounded) until `done` holds of the runtime, taking what finishes meanwhile.
    fn wait_until(rt: &mut ComputeRuntime, done: impl Fn(&mut ComputeRuntime) -> bool) {
        let start = std::time::Instant::now();
        while !done(rt) {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(30),
                "{rt:?} never got there"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// A runtime whose guest context 1 runs a kernel that never ends (the executor busy with
    /// it), and that kernel's backend context.
    fn spinning() -> (ComputeRuntime, super::super::load::LoadRunner, ContextId) {
        let mut rt = ComputeRuntime::new(ComputeKind::Cpu, budget());
        let mut runner = super::super::load::LoadRunner::default();
        let (ctx, launch) = spin_launch(&mut rt, &mut runner, 1);
        post(&mut rt, &mut runner, 1, launch).unwrap();
        wait_until(&mut rt, |rt| rt.executor().is_ok_and(Executor::busy));
        (rt, runner, ctx)
    }

    /// Asserts that backend context `ctx` was released (destroyed, not left behind the queue).
    fn assert_released(rt: &ComputeRuntime, ctx: ContextId) {
        let gone = rt
            .executor
            .as_ref()
            .and_then(|e| e.as_ref().ok())
            .expect("an executor")
            .call(None, move |b| b.context_synchronize(ctx));
        assert!(
            matches!(gone, Err(ComputeError::InvalidHandle(_))),
            "{gone:?}"
        );
    }

    #[test]
    fn a_vm_that_goes_away_stops_its_running_kernel() {
        let mut rt = ComputeRuntime::new(ComputeKind::Cpu, budget());
        let mut runner = super::super::load::LoadRunner::default();
        let (_, launch) = spin_launch(&mut rt, &mut runner, 1);
        post(&mut rt, &mut runner, 1, launch).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(rt.take_events().is_empty(), "still spinning");
        let start = std::time::Instant::now();
        rt.cancel();
        let done = wait_done(&mut rt, 1);
        assert!(start.elapsed() < std::time::Duration::from_secs(2));
        assert!(matches!(
            Reply::decode(&done[0].reply[4..]),
            Ok(Reply::Error { .. })
        ));
    }

    #[test]
    fn a_reset_with_a_running_kernel_and_a_full_queue_cancels_all_and_releases_every_context() {
        let (mut rt, mut runner, ctx) = spinning();
        for _ in 1..MAX_IN_FLIGHT {
            post(&mut rt, &mut runner, 1, Request::Attributes).unwrap();
        }
        let busy = post(&mut rt, &mut runner, 2, Request::Attributes);
        assert!(matches!(busy, Err(Reply::Error { .. })), "{busy:?}");
        let start = std::time::Instant::now();
        rt.reset();
        // What was in flight is answered (and dropped) at once, the kernel stopped: what the
        // runtime counts in flight is what the executor holds, down to nothing.
        wait_until(&mut rt, |rt| {
            assert!(rt.take_events().is_empty(), "replies from before the reset");
            rt.in_flight == 0 && rt.executor().is_ok_and(|e| e.held() == 0)
        });
        let took = start.elapsed();
        println!("reset to an idle executor: {took:?}");
        // Cancelled, not ended by its deadline (the only other end of that kernel, a second
        // after it began, hundreds of times what a cancel takes).
        assert!(took < DEFAULT_REQUEST_TIME / 2, "{took:?}");
        // The session's backend context was released, not left behind the queue.
        assert_released(&rt, ctx);
        // The next request is served.
        assert!(matches!(
            ask(&mut rt, &mut runner, 1, Request::ContextCreate),
            Reply::Id(_)
        ));
    }

    #[test]
    fn destroying_a_killed_programs_context_cancels_its_kernel_and_the_next_is_served() {
        let (mut rt, mut runner, ctx) = spinning();
        // The program is killed mid-kernel: its DRM file closes and its context goes.
        rt.destroy(1);
        let start = std::time::Instant::now();
        post(&mut rt, &mut runner, 2, Request::ContextCreate).unwrap();
        let replies: Vec<Reply> = wait_done(&mut rt, 2)
            .iter()
            .map(|d| Reply::decode(&d.reply[4..]).unwrap())
            .collect();
        println!(
            "next program's first request served after {:?}",
            start.elapsed()
        );
        assert!(
            matches!(&replies[..], [Reply::Error { message, .. }, Reply::Id(_)]
                if message.contains("cancelled")),
            "{replies:?}"
        );
        assert_released(&rt, ctx);
    }
}
