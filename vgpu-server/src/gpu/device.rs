//! The virtio-gpu device model: executes decoded commands and owns the device-specific
//! configuration (struct virtio_gpu_config).
//!
//! Control commands that need no GPU run here at once. (GPU-executing commands become command
//! groups handed to the scheduler and the backend; see docs/ARCHITECTURE.md.)
//!
//! The 2D model: a resource is a host-side image (width x height pixels of 4 bytes) plus an
//! optional list of guest-physical backing ranges. TRANSFER_TO_HOST_2D copies from the backing
//! into the image; a scanout shows a rectangle of one resource, and RESOURCE_FLUSH marks it as a
//! new frame. Every command is validated whole before it changes anything, and a failure only
//! ever concerns the resource or scanout it names.

use std::collections::BTreeMap;
use std::sync::Arc;

use log::{debug, trace};
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

use mdev_backend::GpuBackend;
use mdev_backend::budget::{Charge, MemoryBudget, OverBudget};
use mdev_backend::virgl::{Transfer, TransferBox};

use super::compute::{Blobs, ComputeSubmitError};
use super::dump::Frame;
use super::edid::{self, EdidError};
use super::protocol::{
    ControlCommand, ControlRequest, CursorCommand, DisplayOne, MemEntry, PixelFormat, Rect,
    Response, ty,
};
use super::three_d::{CAPSETS, Renderer, ThreeD, ThreeDError};

/// Smallest scanout edge accepted by `--display`.
pub const MIN_SCANOUT_EDGE: u32 = 16;
/// Largest scanout edge accepted by `--display` (the 16K limit of common GPUs and of the EDID
/// detailed timing descriptor's 12-bit fields is 4095; 16384 leaves room for tiled modes).
pub const MAX_SCANOUT_EDGE: u32 = 16384;

/// Size of the single scanout the device reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DisplayConfig {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

impl Default for DisplayConfig {
    fn default() -> Self {
        DisplayConfig {
            width: 1024,
            height: 768,
        }
    }
}

/// Number of scanouts the device reports (virtio_gpu_config.num_scanouts).
pub const NUM_SCANOUTS: u32 = 1;
/// Most resources one device holds at once. Linux creates one per dumb buffer or GEM object; a
/// desktop session uses tens to hundreds. The bound keeps the resource table and its per-entry
/// bookkeeping small whatever ids a guest invents.
pub const MAX_RESOURCES: usize = 16384;
/// Default host-memory budget of one guest (`--resource-memory-mb`), in MiB: the 2D images and
/// backing entry lists the device holds, what 3D resources are charged
/// ([`super::three_d::resource_bytes`]: every level, layer and sample), guest blobs' entry
/// lists, queued compute requests, and the compute backend's device memory and modules (one
/// [`MemoryBudget`] for all of them). QEMU's virtio-gpu
/// holds 256 MiB of 2D images (`max_hostmem`); a GL desktop adds its textures and render
/// targets (a 4K compositor's buffers alone are over 100 MiB, and unknown formats are charged
/// at the widest pixel), so 1 GiB keeps real sessions clear of the limit while a guest can
/// make its device process hold no more than that. Past it creates fail with
/// ERR_OUT_OF_MEMORY.
pub const DEFAULT_RESOURCE_MEMORY_MB: u64 = 1024;
/// Largest `--resource-memory-mb`: 1 TiB, far above any host; keeps the byte count in range.
pub const MAX_RESOURCE_MEMORY_MB: u64 = 1 << 20;
/// Largest resource width or height (the 16K texture limit of common GPUs; Linux's virtio-gpu
/// mode_config max is 8192). Larger edges are an invalid parameter, not an allocation attempt.
pub const MAX_RESOURCE_EDGE: u32 = 16384;
/// Largest scanout image read back from a 3D resource: a [`MAX_RESOURCE_EDGE`] square of
/// 4-byte pixels. A 3D buffer resource can be wider than any image; reading one back as a
/// scanout is refused rather than sized by the guest.
const MAX_READBACK_BYTES: u64 =
    MAX_RESOURCE_EDGE as u64 * MAX_RESOURCE_EDGE as u64 * PixelFormat::BYTES_PER_PIXEL as u64;
/// Host bytes a backing entry costs (the entry and its prefix offset).
const BACKING_ENTRY_COST: u64 =
    (std::mem::size_of::<MemEntry>() + std::mem::size_of::<u64>()) as u64;

/// Errors of the device model: bad `--display` values, and refused commands (each maps to the
/// VIRTIO_GPU_RESP_ERR_* code the guest gets).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    /// A 3D command failed.
    #[error(transparent)]
    ThreeD(#[from] ThreeDError),
    /// A blob command failed.
    #[error(transparent)]
    Blob(#[from] ComputeSubmitError),
    /// A display mode outside the supported range.
    #[error("display mode {0}x{1} outside {MIN_SCANOUT_EDGE}..={MAX_SCANOUT_EDGE} per edge")]
    BadMode(u32, u32),
    /// A display mode string that is not WIDTHxHEIGHT.
    #[error("display mode {0:?} is not WIDTHxHEIGHT")]
    BadModeSyntax(String),
    /// The command names a resource that does not exist (or resource id 0).
    #[error("no resource {0}")]
    UnknownResource(u32),
    /// RESOURCE_CREATE_2D with an id already in use, or 0.
    #[error("resource id {0} is 0 or already in use")]
    ResourceIdTaken(u32),
    /// The command names a scanout that does not exist.
    #[error("no scanout {0}")]
    UnknownScanout(u32),
    /// GET_EDID for a scanout that does not exist.
    #[error("GET_EDID for scanout {0}, which does not exist")]
    EdidScanout(u32),
    /// The scanout mode has no EDID.
    #[error(transparent)]
    Edid(#[from] EdidError),
    /// A resource size that is zero or larger than [`MAX_RESOURCE_EDGE`].
    #[error("resource size {0}x{1} outside 1..={MAX_RESOURCE_EDGE} per edge")]
    BadSize(u32, u32),
    /// A rectangle that is empty or not inside its resource.
    #[error("rectangle {rect:?} is empty or outside the {width}x{height} resource")]
    RectOutside {
        /// The rectangle.
        rect: Rect,
        /// Resource width.
        width: u32,
        /// Resource height.
        height: u32,
    },
    /// [`MAX_RESOURCES`] resources exist already.
    #[error("{MAX_RESOURCES} resources exist already")]
    TooManyResources,
    /// The request would take host memory past the VM's budget.
    #[error(transparent)]
    OutOfMemory(#[from] OverBudget),
    /// The host could not allocate an image the budget allowed.
    #[error("allocating {0} bytes failed")]
    Allocation(u64),
    /// A scanout read-back of a rectangle larger than [`MAX_READBACK_BYTES`].
    #[error("read-back of {width}x{height} pixels is larger than any scanout image")]
    ReadBackTooLarge {
        /// Width.
        width: u32,
        /// Height.
        height: u32,
    },
    /// The renderer failed.
    #[error("renderer: {0}")]
    Renderer(String),
    /// The resource has no backing (TRANSFER, DETACH).
    #[error("resource {0} has no backing")]
    NoBacking(u32),
    /// ATTACH_BACKING for a resource that has backing already.
    #[error("resource {0} has backing already")]
    BackingAttached(u32),
    /// ATTACH_BACKING with no entries, a zero-length entry or one that wraps past 2^64.
    #[error("backing entry {addr:#x}+{length:#x} is empty or wraps (or no entries)")]
    BadEntry {
        /// Guest address.
        addr: u64,
        /// Length.
        length: u32,
    },
    /// A transfer that reads past the end of the backing.
    #[error("transfer needs backing bytes up to {end:#x}, the backing has {len:#x}")]
    PastBacking {
        /// First backing byte not needed.
        end: u64,
        /// Backing length.
        len: u64,
    },
    /// A backing entry is not in guest memory: at ATTACH_BACKING, or (after a DMA_UNMAP) at a
    /// transfer that needs it.
    #[error("backing entry {addr:#x}+{length:#x} is not in guest memory")]
    BackingNotInMemory {
        /// Guest address.
        addr: u64,
        /// Length.
        length: u32,
    },
    /// Reading guest memory failed after validation (a concurrent unmap).
    #[error("reading backing: {0}")]
    Memory(String),
}

impl DeviceError {
    /// The VIRTIO_GPU_RESP_ERR_* code a command refused with this error gets.
    pub fn response_code(&self) -> u32 {
        match self {
            DeviceError::UnknownResource(_) | DeviceError::ResourceIdTaken(_) => {
                ty::ERR_INVALID_RESOURCE_ID
            }
            DeviceError::UnknownScanout(_) => ty::ERR_INVALID_SCANOUT_ID,
            DeviceError::BadSize(..)
            | DeviceError::RectOutside { .. }
            | DeviceError::BadEntry { .. }
            | DeviceError::PastBacking { .. }
            | DeviceError::EdidScanout(_) => ty::ERR_INVALID_PARAMETER,
            DeviceError::TooManyResources
            | DeviceError::OutOfMemory(_)
            | DeviceError::Allocation(_) => ty::ERR_OUT_OF_MEMORY,
            DeviceError::BadMode(..)
            | DeviceError::BadModeSyntax(_)
            | DeviceError::Edid(_)
            | DeviceError::NoBacking(_)
            | DeviceError::BackingAttached(_)
            | DeviceError::BackingNotInMemory { .. }
            | DeviceError::ReadBackTooLarge { .. }
            | DeviceError::Renderer(_)
            | DeviceError::Memory(_) => ty::ERR_UNSPEC,
            DeviceError::ThreeD(e) => e.response_code(),
            DeviceError::Blob(e) => e.response_code(),
        }
    }
}

impl std::str::FromStr for DisplayConfig {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || DeviceError::BadModeSyntax(s.to_string());
        let (w, h) = s.split_once('x').ok_or_else(bad)?;
        let (width, height) = (w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?);
        let edge = MIN_SCANOUT_EDGE..=MAX_SCANOUT_EDGE;
        if !edge.contains(&width) || !edge.contains(&height) {
            return Err(DeviceError::BadMode(width, height));
        }
        Ok(DisplayConfig { width, height })
    }
}

/// struct virtio_gpu_config: events_read, events_clear, num_scanouts, num_capsets.
const CONFIG_SIZE: usize = 16;
const CONFIG_EVENTS_READ: usize = 0;
const CONFIG_EVENTS_CLEAR: u64 = 4;
const CONFIG_NUM_SCANOUTS: usize = 8;
const CONFIG_NUM_CAPSETS: usize = 12;

/// Cursor state of the (single) scanout.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CursorState {
    /// Position.
    pub x: u32,
    /// Position.
    pub y: u32,
    /// Image resource, 0 when hidden.
    pub resource_id: u32,
}

/// The first of `entries` that is not wholly guest memory `mem` grants `access` to. `mem` is
/// the guest memory of this moment: an entry checked when it was made can be unmapped later
/// (DMA_UNMAP), so whoever uses entries checks them again against the memory of the use.
pub fn entry_outside<'a, M: GuestMemory>(
    entries: &'a [MemEntry],
    mem: &M,
    access: Permissions,
) -> Option<&'a MemEntry> {
    entries
        .iter()
        .find(|e| !mem.check_range(GuestAddress(e.addr), e.length as usize, access))
}

/// A resource's guest backing: the entries and where each starts in the backing's bytes.
#[derive(Debug)]
struct Backing {
    entries: Vec<MemEntry>,
    /// `starts[i]` is the backing offset of `entries[i]`; strictly increasing (no empty entry).
    starts: Vec<u64>,
    len: u64,
    /// What the two lists are charged to the VM's budget.
    _charge: Charge,
}

impl Backing {
    /// ATTACH_BACKING's entries, checked whole (none empty or wrapping, every one in guest
    /// memory `mem` now, as QEMU's device checks at attach) and charged to `budget` before
    /// the device copies them.
    fn new<M: GuestMemory>(
        resource_id: u32,
        entries: &[MemEntry],
        mem: &M,
        budget: &Arc<MemoryBudget>,
    ) -> Result<Backing, DeviceError> {
        if entries.is_empty() {
            debug!("resource {resource_id}: ATTACH_BACKING without entries");
            return Err(DeviceError::BadEntry { addr: 0, length: 0 });
        }
        if let Some(e) = entries
            .iter()
            .find(|e| e.length == 0 || e.addr.checked_add(u64::from(e.length)).is_none())
        {
            return Err(DeviceError::BadEntry {
                addr: e.addr,
                length: e.length,
            });
        }
        // Reserved before the entries are walked, so that a guest past its budget is refused
        // at once (dropped again if an entry is refused). At most MAX_BACKING_ENTRIES
        // entries: far from overflowing.
        let charge = budget.charge(entries.len() as u64 * BACKING_ENTRY_COST)?;
        if let Some(e) = entry_outside(entries, mem, Permissions::Read) {
            debug!("resource {resource_id}: backing entry outside guest RAM");
            return Err(DeviceError::BackingNotInMemory {
                addr: e.addr,
                length: e.length,
            });
        }
        let mut starts = Vec::with_capacity(entries.len());
        let mut len = 0u64;
        for e in entries {
            starts.push(len);
            // At most MAX_BACKING_ENTRIES entries of u32 lengths: far from overflowing.
            len = len
                .checked_add(u64::from(e.length))
                .ok_or(DeviceError::BadEntry {
                    addr: e.addr,
                    length: e.length,
                })?;
        }
        Ok(Backing {
            entries: entries.to_vec(),
            starts,
            len,
            _charge: charge,
        })
    }

    /// Index of the entry holding backing byte `offset` (< `self.len`).
    fn entry_at(&self, offset: u64) -> usize {
        // starts[0] == 0 <= offset, so the partition point is at least 1.
        self.starts
            .partition_point(|&s| s <= offset)
            .saturating_sub(1)
    }

    /// Checks that every entry overlapping backing bytes `start..end` is in guest memory.
    fn check_in_memory<M: GuestMemory>(
        &self,
        mem: &M,
        start: u64,
        end: u64,
    ) -> Result<(), DeviceError> {
        let (first, last) = (self.entry_at(start), self.entry_at(end.saturating_sub(1)));
        let needed = self.entries.get(first..=last).unwrap_or_default();
        match entry_outside(needed, mem, Permissions::Read) {
            Some(e) => Err(DeviceError::BackingNotInMemory {
                addr: e.addr,
                length: e.length,
            }),
            None => Ok(()),
        }
    }

    /// Copies backing bytes `offset..offset + out.len()` (inside the backing) into `out`.
    fn read<M: GuestMemory>(
        &self,
        mem: &M,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        let mut offset = offset;
        let mut out = out;
        while !out.is_empty() {
            let i = self.entry_at(offset);
            let (Some(e), Some(&start)) = (self.entries.get(i), self.starts.get(i)) else {
                return Err(DeviceError::Memory(format!(
                    "offset {offset:#x} past the backing"
                )));
            };
            let within = offset - start;
            let avail = u64::from(e.length).saturating_sub(within);
            if avail == 0 {
                return Err(DeviceError::Memory(format!(
                    "offset {offset:#x} past the backing"
                )));
            }
            let n = usize::try_from(avail).unwrap_or(usize::MAX).min(out.len());
            let (chunk, rest) = out.split_at_mut(n);
            // e.addr + e.length does not wrap (checked at attach) and within < e.length.
            mem.read_slice(chunk, GuestAddress(e.addr + within))
                .map_err(|err| DeviceError::Memory(err.to_string()))?;
            out = rest;
            offset += n as u64;
        }
        Ok(())
    }
}

/// A 2D resource: its host-side image and its guest backing.
#[derive(Debug)]
struct Resource {
    format: PixelFormat,
    width: u32,
    height: u32,
    /// `width * height * 4` bytes, rows of `width * 4` bytes.
    image: Vec<u8>,
    /// What the image is charged to the VM's budget.
    _charge: Charge,
    backing: Option<Backing>,
}

impl Resource {
    fn stride(&self) -> u64 {
        u64::from(self.width) * u64::from(PixelFormat::BYTES_PER_PIXEL)
    }

    fn check_rect(&self, rect: &Rect) -> Result<(), DeviceError> {
        if rect.is_inside(self.width, self.height) {
            Ok(())
        } else {
            Err(DeviceError::RectOutside {
                rect: *rect,
                width: self.width,
                height: self.height,
            })
        }
    }

    /// A copy of the image bytes of `rect` (inside the resource), rows of `rect.width` pixels.
    fn copy_rect(&self, rect: &Rect) -> Vec<u8> {
        let bpp = PixelFormat::BYTES_PER_PIXEL as usize;
        let (x, row_len) = (rect.x as usize, rect.width as usize * bpp);
        let mut out = Vec::with_capacity(row_len * rect.height as usize);
        for row in rect.y..rect.y + rect.height {
            let start = (row as usize * self.width as usize + x) * bpp;
            if let Some(line) = self.image.get(start..start + row_len) {
                out.extend_from_slice(line);
            }
        }
        out
    }
}

/// Reads `rect` of 3D resource `id` back from the renderer (4 bytes per pixel, rows packed).
/// The size is computed with checked arithmetic and bounded by [`MAX_READBACK_BYTES`] before
/// anything is allocated.
fn read_back(virgl: &dyn GpuBackend, id: u32, rect: &Rect) -> Result<Vec<u8>, DeviceError> {
    let too_large = || DeviceError::ReadBackTooLarge {
        width: rect.width,
        height: rect.height,
    };
    let stride = rect
        .width
        .checked_mul(PixelFormat::BYTES_PER_PIXEL)
        .ok_or_else(too_large)?;
    let len = u64::from(stride)
        .checked_mul(u64::from(rect.height))
        .filter(|&n| n <= MAX_READBACK_BYTES)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(too_large)?;
    let mut pixels = Vec::new();
    pixels.try_reserve_exact(len).map_err(|_| too_large())?;
    pixels.resize(len, 0);
    let transfer = Transfer {
        level: 0,
        stride,
        layer_stride: 0,
        region: TransferBox {
            x: rect.x,
            y: rect.y,
            z: 0,
            w: rect.width,
            h: rect.height,
            d: 1,
        },
        offset: 0,
    };
    virgl
        .transfer_read_into(id, 0, &transfer, &mut pixels)
        .map_err(|e| DeviceError::Renderer(e.to_string()))?;
    Ok(pixels)
}

/// What one scanout shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScanoutState {
    /// Resource shown, 0 when disabled.
    pub resource_id: u32,
    /// Part of the resource shown.
    pub rect: Rect,
    /// RESOURCE_FLUSHes that reached this scanout (cumulative over resets).
    pub frames: u64,
    /// The part of the last flush that fell on this scanout (resource coordinates).
    pub last_flush: Option<Rect>,
    /// Flushed since its image was last taken for a dump.
    pub undumped: bool,
}

/// The virtio-gpu device state of one vGPU.
#[derive(Debug)]
pub struct GpuDevice {
    display: DisplayConfig,
    /// Whether 3D (virgl) is offered: a renderer is available.
    virgl: bool,
    three_d: ThreeD,
    events_read: u32,
    cursor: CursorState,
    resources: BTreeMap<u32, Resource>,
    /// The VM's host-memory budget (`--resource-memory-mb`): 2D images and entry lists, 3D
    /// resources and backings, blobs' entry lists here; queued compute requests and the
    /// compute backend's memory share it.
    budget: Arc<MemoryBudget>,
    scanouts: [ScanoutState; NUM_SCANOUTS as usize],
    /// Guest-memory blobs (offered with 3D, for the compute capset).
    blobs: Blobs,
}

impl GpuDevice {
    /// Creates the device with one scanout of the given size; `virgl` offers 3D (the caller
    /// has a renderer for [`GpuDevice::execute`]).
    pub fn new(display: DisplayConfig, virgl: bool) -> Self {
        GpuDevice {
            display,
            virgl,
            three_d: ThreeD::default(),
            events_read: 0,
            cursor: CursorState::default(),
            resources: BTreeMap::new(),
            budget: MemoryBudget::new(DEFAULT_RESOURCE_MEMORY_MB << 20),
            scanouts: [ScanoutState::default(); NUM_SCANOUTS as usize],
            blobs: Blobs::default(),
        }
    }

    /// The guest blobs (compute submits read and write them).
    pub fn blobs(&self) -> &Blobs {
        &self.blobs
    }

    /// Whether `ctx` is a compute-capset context (its submits go to the compute backend).
    pub fn is_compute_context(&self, ctx: u32) -> bool {
        self.virgl && self.three_d.is_compute_context(ctx)
    }

    /// Gives the VM a host-memory budget of `bytes` (default [`DEFAULT_RESOURCE_MEMORY_MB`]
    /// MiB), kept across resets. Made before the guest runs: what is already charged stays
    /// charged to the budget it was charged to.
    pub fn set_resource_budget(&mut self, bytes: u64) {
        self.budget = MemoryBudget::new(bytes);
    }

    /// The VM's host-memory budget, for everything else the guest makes the device process
    /// hold (the compute backend's).
    pub fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
    }

    /// Whether resource `id` is a 3D (virgl) resource.
    pub fn is_3d_resource(&self, id: u32) -> bool {
        self.three_d.resource(id).is_some()
    }

    /// Whether `ctx` is a load-capset context (its submits are the device's own work).
    pub fn is_load_context(&self, ctx: u32) -> bool {
        self.virgl && self.three_d.is_load_context(ctx)
    }

    /// Returns to the power-on state: every resource is freed and every scanout disabled (the
    /// display configuration and the frame counters are kept).
    pub fn reset(&mut self) {
        let frames = self.scanouts.map(|s| s.frames);
        let mut three_d = std::mem::take(&mut self.three_d);
        three_d.reset();
        let budget = Arc::clone(&self.budget);
        *self = GpuDevice::new(self.display, self.virgl);
        self.three_d = three_d;
        self.budget = budget;
        for (s, frames) in self.scanouts.iter_mut().zip(frames) {
            s.frames = frames;
        }
    }

    /// Device-specific feature bits offered: VIRTIO_GPU_F_EDID when the mode has an EDID,
    /// VIRTIO_GPU_F_VIRGL, VIRTIO_GPU_F_CONTEXT_INIT (for the load and compute capsets) and
    /// VIRTIO_GPU_F_RESOURCE_BLOB (guest blobs, for the compute capset) with a renderer. Blobs
    /// only with 3D: Linux makes its dumb buffers blobs when a device has blobs and no 3D.
    pub fn features(&self) -> u64 {
        let virgl = if self.virgl {
            1 << virtio_bindings::virtio_gpu::VIRTIO_GPU_F_VIRGL
                | 1 << virtio_bindings::virtio_gpu::VIRTIO_GPU_F_CONTEXT_INIT
                | 1 << virtio_bindings::virtio_gpu::VIRTIO_GPU_F_RESOURCE_BLOB
        } else {
            0
        };
        match edid::edid_for_mode(self.display.width, self.display.height) {
            Ok(_) => virgl | 1 << virtio_bindings::virtio_gpu::VIRTIO_GPU_F_EDID,
            Err(e) => {
                debug!("VIRTIO_GPU_F_EDID not offered: {e}");
                virgl
            }
        }
    }

    /// Destroys the 3D objects a reset left behind (worker thread, before anything else).
    pub fn reap_3d(&mut self, virgl: &dyn GpuBackend) {
        self.three_d.reap(virgl);
    }

    /// Destroys every 3D object of this guest (the client went away).
    pub fn release_3d(&mut self, virgl: &dyn GpuBackend) {
        self.three_d.reset();
        self.three_d.reap(virgl);
    }

    /// Current cursor state.
    pub fn cursor(&self) -> CursorState {
        self.cursor
    }

    /// State of scanout `id`.
    pub fn scanout(&self, id: u32) -> Option<ScanoutState> {
        self.scanouts.get(id as usize).copied()
    }

    /// Flushes that reached any scanout, in all.
    pub fn frames_flushed(&self) -> u64 {
        self.scanouts.iter().map(|s| s.frames).sum()
    }

    /// Number of resources.
    pub fn resource_count(&self) -> usize {
        self.resources.len()
    }

    /// Host bytes charged to the VM's budget (resources, blobs, and what compute holds).
    pub fn host_bytes(&self) -> u64 {
        self.budget.used()
    }

    /// Whether a scanout was flushed since its image was last taken.
    pub fn frames_undumped(&self) -> bool {
        self.scanouts
            .iter()
            .any(|s| s.undumped && s.resource_id != 0)
    }

    /// Copies of the images of the enabled scanouts that were flushed since they were last
    /// taken (all enabled scanouts with `all`); marks them taken. A scanout showing a 3D
    /// resource is read back through `virgl` (worker thread; without it, it is skipped).
    pub fn take_frames(&mut self, all: bool, virgl: Option<&dyn GpuBackend>) -> Vec<Frame> {
        let mut frames = Vec::new();
        for (id, s) in (0u32..).zip(self.scanouts.iter_mut()) {
            if !(all || s.undumped) {
                continue;
            }
            s.undumped = false;
            if let Some(res) = self.resources.get(&s.resource_id) {
                frames.push(Frame {
                    scanout: id,
                    width: s.rect.width,
                    height: s.rect.height,
                    format: res.format,
                    pixels: res.copy_rect(&s.rect),
                });
            } else if let (Some(res), Some(virgl)) = (self.three_d.resource(s.resource_id), virgl)
                && let Some(format) = PixelFormat::from_wire(res.format)
            {
                match read_back(virgl, s.resource_id, &s.rect) {
                    Ok(pixels) => frames.push(Frame {
                        scanout: id,
                        width: s.rect.width,
                        height: s.rect.height,
                        format,
                        pixels,
                    }),
                    Err(e) => debug!("scanout {id}: reading back resource {}: {e}", s.resource_id),
                }
            }
        }
        frames
    }

    /// Executes a control-queue request; `mem` is the guest memory backing ranges refer to,
    /// `renderer` runs the 3D commands (without one they get ERR_UNSPEC).
    pub fn execute<M: GuestMemory>(
        &mut self,
        req: &mut ControlRequest,
        mem: &M,
        renderer: Option<Renderer<'_>>,
    ) -> Response {
        trace!("control {:?}", req.cmd);
        let result = match renderer {
            Some(r) if self.virgl => match self.try_execute_3d(req, r) {
                Some(result) => result,
                None => self.try_execute(&req.cmd, mem),
            },
            _ => self.try_execute(&req.cmd, mem),
        };
        match result {
            Ok(response) => response,
            Err(e) => {
                debug!("control command {:#x} refused: {e}", req.hdr.ty);
                Response::Err(e.response_code())
            }
        }
    }

    /// The 3D commands, and the shared ones when they name a 3D resource; `None` for the rest.
    fn try_execute_3d(
        &mut self,
        req: &mut ControlRequest,
        r: Renderer<'_>,
    ) -> Option<Result<Response, DeviceError>> {
        let t = &mut self.three_d;
        let is_3d = |id: u32| t.resource(id).is_some();
        let result = match &mut req.cmd {
            ControlCommand::GetCapsetInfo { capset_index } => t.capset_info(*capset_index, r),
            ControlCommand::GetCapset {
                capset_id,
                capset_version,
            } => t.capset(*capset_id, *capset_version, r),
            ControlCommand::CtxCreate(c) => t.ctx_create(c, r),
            ControlCommand::CtxDestroy { ctx_id } => t.ctx_destroy(*ctx_id, r),
            // Linux attaches every buffer of a DRM file to its context, 2D dumb buffers too;
            // those live here, not in virglrenderer, and need nothing (QEMU ignores them too).
            ControlCommand::CtxAttachResource { resource_id, .. }
            | ControlCommand::CtxDetachResource { resource_id, .. }
                if !is_3d(*resource_id) =>
            {
                Ok(Response::OkNoData)
            }
            ControlCommand::CtxAttachResource {
                ctx_id,
                resource_id,
            } => t.ctx_resource(*ctx_id, *resource_id, true, r),
            ControlCommand::CtxDetachResource {
                ctx_id,
                resource_id,
            } => t.ctx_resource(*ctx_id, *resource_id, false, r),
            ControlCommand::ResourceCreate3d(c) => {
                let taken = self.resources.contains_key(&c.resource_id)
                    || self.blobs.contains(c.resource_id);
                self.three_d
                    .resource_create(c, taken, &self.budget, r)
                    .map(|()| Response::OkNoData)
            }
            ControlCommand::TransferToHost3d(x) => t.transfer(x, true, r),
            ControlCommand::TransferFromHost3d(x) => t.transfer(x, false, r),
            ControlCommand::Submit3d { ctx_id, commands } => {
                t.submit(*ctx_id, commands.dwords_mut(), r)
            }
            ControlCommand::ResourceUnref { resource_id } if is_3d(*resource_id) => {
                let id = *resource_id;
                self.disable_scanouts_of(id);
                self.three_d.resource_unref(id, r)
            }
            ControlCommand::AttachBacking {
                resource_id,
                entries,
            } if is_3d(*resource_id) => t.attach_backing(*resource_id, entries, &self.budget, r),
            ControlCommand::DetachBacking { resource_id } if is_3d(*resource_id) => {
                t.detach_backing(*resource_id, r)
            }
            _ => return None,
        };
        Some(result.map_err(DeviceError::ThreeD))
    }

    fn try_execute<M: GuestMemory>(
        &mut self,
        cmd: &ControlCommand,
        mem: &M,
    ) -> Result<Response, DeviceError> {
        match *cmd {
            ControlCommand::GetDisplayInfo => Ok(Response::OkDisplayInfo(vec![DisplayOne {
                width: self.display.width,
                height: self.display.height,
                enabled: true,
            }])),
            ControlCommand::GetEdid { scanout_id } => {
                if scanout_id >= NUM_SCANOUTS {
                    return Err(DeviceError::EdidScanout(scanout_id));
                }
                let block = edid::edid_for_mode(self.display.width, self.display.height)?;
                Ok(Response::OkEdid(block.to_vec()))
            }
            ControlCommand::ResourceCreate2d {
                resource_id,
                format,
                width,
                height,
            } => self.create_2d(resource_id, format, width, height),
            ControlCommand::ResourceUnref { resource_id } if self.blobs.remove(resource_id) => {
                Ok(Response::OkNoData)
            }
            ControlCommand::ResourceUnref { resource_id } => self.unref(resource_id),
            ControlCommand::SetScanout {
                scanout_id,
                resource_id,
                rect,
            } => self.set_scanout(scanout_id, resource_id, rect),
            ControlCommand::ResourceFlush { resource_id, rect } => self.flush(resource_id, rect),
            ControlCommand::TransferToHost2d {
                resource_id,
                rect,
                offset,
            } => self.transfer_to_host_2d(resource_id, rect, offset, mem),
            ControlCommand::AttachBacking {
                resource_id,
                ref entries,
            } => self.attach_backing(resource_id, entries, mem),
            ControlCommand::DetachBacking { resource_id } if self.blobs.detach(resource_id) => {
                Ok(Response::OkNoData)
            }
            ControlCommand::DetachBacking { resource_id } => self.detach_backing(resource_id),
            ControlCommand::ResourceCreateBlob(ref c) if self.virgl => {
                let taken = self.resources.contains_key(&c.resource_id)
                    || self.is_3d_resource(c.resource_id);
                self.blobs.create(c, taken, mem, &self.budget)?;
                Ok(Response::OkNoData)
            }
            ControlCommand::GetCapsetInfo { .. }
            | ControlCommand::GetCapset { .. }
            | ControlCommand::CtxCreate(_)
            | ControlCommand::CtxDestroy { .. }
            | ControlCommand::CtxAttachResource { .. }
            | ControlCommand::CtxDetachResource { .. }
            | ControlCommand::ResourceCreate3d(_)
            | ControlCommand::TransferToHost3d(_)
            | ControlCommand::TransferFromHost3d(_)
            | ControlCommand::Submit3d { .. }
            | ControlCommand::ResourceCreateBlob(_)
            | ControlCommand::Unimplemented(_) => {
                debug!("control command not implemented, ERR_UNSPEC: {cmd:?}");
                Ok(Response::Err(ty::ERR_UNSPEC))
            }
        }
    }

    fn resource(&self, id: u32) -> Result<&Resource, DeviceError> {
        self.resources
            .get(&id)
            .ok_or(DeviceError::UnknownResource(id))
    }

    fn resource_mut(&mut self, id: u32) -> Result<&mut Resource, DeviceError> {
        self.resources
            .get_mut(&id)
            .ok_or(DeviceError::UnknownResource(id))
    }

    fn create_2d(
        &mut self,
        id: u32,
        format: PixelFormat,
        width: u32,
        height: u32,
    ) -> Result<Response, DeviceError> {
        if id == 0
            || self.resources.contains_key(&id)
            || self.three_d.resource(id).is_some()
            || self.blobs.contains(id)
        {
            return Err(DeviceError::ResourceIdTaken(id));
        }
        let edge = 1..=MAX_RESOURCE_EDGE;
        if !edge.contains(&width) || !edge.contains(&height) {
            return Err(DeviceError::BadSize(width, height));
        }
        if self.resources.len() >= MAX_RESOURCES {
            return Err(DeviceError::TooManyResources);
        }
        // Both edges <= 2^14: at most 2^30 bytes, no overflow in u64.
        let bytes = u64::from(width) * u64::from(height) * u64::from(PixelFormat::BYTES_PER_PIXEL);
        let charge = self.budget.charge(bytes)?;
        let len = usize::try_from(bytes).map_err(|_| DeviceError::Allocation(bytes))?;
        let mut image = Vec::new();
        image
            .try_reserve_exact(len)
            .map_err(|_| DeviceError::Allocation(bytes))?;
        image.resize(len, 0);
        self.resources.insert(
            id,
            Resource {
                format,
                width,
                height,
                image,
                _charge: charge,
                backing: None,
            },
        );
        debug!("resource {id}: {width}x{height} {format:?} created");
        Ok(Response::OkNoData)
    }

    fn unref(&mut self, id: u32) -> Result<Response, DeviceError> {
        // Its charges go back to the budget with it.
        self.resources
            .remove(&id)
            .ok_or(DeviceError::UnknownResource(id))?;
        self.disable_scanouts_of(id);
        debug!("resource {id} unreferenced");
        Ok(Response::OkNoData)
    }

    fn disable_scanouts_of(&mut self, id: u32) {
        for s in &mut self.scanouts {
            if s.resource_id == id {
                debug!("resource {id} unreferenced while shown; scanout disabled");
                s.resource_id = 0;
                s.rect = Rect::default();
            }
        }
    }

    /// Checks `rect` against resource `id`, 2D or 3D.
    fn check_rect_of(&self, id: u32, rect: &Rect) -> Result<(), DeviceError> {
        match self.three_d.resource(id) {
            Some(size) if rect.is_inside(size.width, size.height) => Ok(()),
            Some(size) => Err(DeviceError::RectOutside {
                rect: *rect,
                width: size.width,
                height: size.height,
            }),
            None => self.resource(id)?.check_rect(rect),
        }
    }

    fn set_scanout(
        &mut self,
        scanout_id: u32,
        resource_id: u32,
        rect: Rect,
    ) -> Result<Response, DeviceError> {
        if scanout_id >= NUM_SCANOUTS {
            return Err(DeviceError::UnknownScanout(scanout_id));
        }
        if resource_id != 0 {
            self.check_rect_of(resource_id, &rect)?;
        }
        let s = &mut self.scanouts[scanout_id as usize];
        s.resource_id = resource_id;
        s.rect = if resource_id == 0 {
            Rect::default()
        } else {
            rect
        };
        s.last_flush = None;
        debug!("scanout {scanout_id} shows resource {resource_id} {rect:?}");
        Ok(Response::OkNoData)
    }

    fn flush(&mut self, id: u32, rect: Rect) -> Result<Response, DeviceError> {
        self.check_rect_of(id, &rect)?;
        for (n, s) in self.scanouts.iter_mut().enumerate() {
            if s.resource_id != id {
                continue;
            }
            if let Some(hit) = rect.intersect(&s.rect) {
                s.frames = s.frames.saturating_add(1);
                s.last_flush = Some(hit);
                s.undumped = true;
                trace!("scanout {n}: frame {} ({hit:?})", s.frames);
            }
        }
        Ok(Response::OkNoData)
    }

    fn transfer_to_host_2d<M: GuestMemory>(
        &mut self,
        id: u32,
        rect: Rect,
        offset: u64,
        mem: &M,
    ) -> Result<Response, DeviceError> {
        let res = self.resource_mut(id)?;
        res.check_rect(&rect)?;
        let stride = res.stride();
        let bpp = u64::from(PixelFormat::BYTES_PER_PIXEL);
        let backing = res.backing.as_ref().ok_or(DeviceError::NoBacking(id))?;
        // Row i of the rectangle comes from backing bytes offset + i * stride, width * 4 long.
        // The rectangle is inside the resource, so rows, widths and strides are at most 2^14
        // pixels; only the guest's offset can overflow.
        let row_bytes = u64::from(rect.width) * bpp;
        let span = u64::from(rect.height - 1) * stride + row_bytes;
        let end = offset.checked_add(span).ok_or(DeviceError::PastBacking {
            end: u64::MAX,
            len: backing.len,
        })?;
        if end > backing.len {
            return Err(DeviceError::PastBacking {
                end,
                len: backing.len,
            });
        }
        backing.check_in_memory(mem, offset, end)?;
        let row_len = row_bytes as usize;
        for row in 0..u64::from(rect.height) {
            let dst = ((u64::from(rect.y) + row) * stride + u64::from(rect.x) * bpp) as usize;
            let Some(line) = res.image.get_mut(dst..dst + row_len) else {
                return Err(DeviceError::Memory(format!("row {row} outside the image")));
            };
            backing.read(mem, offset + row * stride, line)?;
        }
        trace!("resource {id}: {rect:?} transferred from backing offset {offset:#x}");
        Ok(Response::OkNoData)
    }

    fn attach_backing<M: GuestMemory>(
        &mut self,
        id: u32,
        entries: &[MemEntry],
        mem: &M,
    ) -> Result<Response, DeviceError> {
        let res = self.resource(id)?;
        if res.backing.is_some() {
            return Err(DeviceError::BackingAttached(id));
        }
        let backing = Backing::new(id, entries, mem, &self.budget)?;
        debug!(
            "resource {id}: {} backing entries, {:#x} bytes",
            backing.entries.len(),
            backing.len
        );
        self.resource_mut(id)?.backing = Some(backing);
        Ok(Response::OkNoData)
    }

    fn detach_backing(&mut self, id: u32) -> Result<Response, DeviceError> {
        // Its charge goes back to the budget with it.
        self.resource_mut(id)?
            .backing
            .take()
            .ok_or(DeviceError::NoBacking(id))?;
        debug!("resource {id}: backing detached");
        Ok(Response::OkNoData)
    }

    /// Executes a cursor-queue command (cursor commands have no response).
    pub fn execute_cursor(&mut self, cmd: &CursorCommand) {
        trace!("cursor {cmd:?}");
        if cmd.scanout_id >= NUM_SCANOUTS {
            debug!(
                "cursor command for scanout {} ignored; {NUM_SCANOUTS} scanout(s)",
                cmd.scanout_id
            );
            return;
        }
        self.cursor.x = cmd.x;
        self.cursor.y = cmd.y;
        if cmd.update {
            self.cursor.resource_id = cmd.resource_id;
        }
    }

    /// Reads the device configuration; `offset`/`data` were validated against its 16 bytes
    /// as whole, naturally aligned 32-bit fields or parts of them.
    pub fn config_read(&self, offset: u64, data: &mut [u8]) {
        let mut bytes = [0u8; CONFIG_SIZE];
        for (at, v) in [
            (CONFIG_EVENTS_READ, self.events_read),
            (CONFIG_NUM_SCANOUTS, NUM_SCANOUTS),
            (
                CONFIG_NUM_CAPSETS,
                if self.virgl { CAPSETS.len() as u32 } else { 0 },
            ),
        ] {
            bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        data.fill(0);
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        if let Some(src) = bytes.get(start..) {
            let n = src.len().min(data.len());
            data[..n].copy_from_slice(&src[..n]);
        }
    }

    /// Writes the device configuration: only events_clear is writable (write-1-to-clear).
    pub fn config_write(&mut self, offset: u64, data: &[u8]) {
        if offset == CONFIG_EVENTS_CLEAR && data.len() == 4 {
            let mut raw = [0u8; 4];
            raw.copy_from_slice(data);
            self.events_read &= !u32::from_le_bytes(raw);
        } else {
            debug!("write to read-only device config at {offset:#x} ignored");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::protocol::CtrlHeader;
    use vm_memory::GuestMemoryMmap;

    fn req(cmd: ControlCommand) -> ControlRequest {
        ControlRequest {
            hdr: CtrlHeader::default(),
            cmd,
        }
    }

    /// 1 MiB of guest memory at 0.
    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn run(dev: &mut GpuDevice, mem: &GuestMemoryMmap, cmd: ControlCommand) -> Response {
        dev.execute(&mut req(cmd), mem, None)
    }

    fn ok(dev: &mut GpuDevice, mem: &GuestMemoryMmap, cmd: ControlCommand) {
        let r = run(dev, mem, cmd.clone());
        assert_eq!(r, Response::OkNoData, "{cmd:?}");
    }

    fn err(dev: &mut GpuDevice, mem: &GuestMemoryMmap, cmd: ControlCommand) -> u32 {
        match run(dev, mem, cmd.clone()) {
            Response::Err(code) => code,
            r => panic!("{cmd:?} answered {r:?}"),
        }
    }

    fn create(id: u32, width: u32, height: u32) -> ControlCommand {
        ControlCommand::ResourceCreate2d {
            resource_id: id,
            format: PixelFormat::B8G8R8X8,
            width,
            height,
        }
    }

    fn rect(x: u32, y: u32, width: u32, height: u32) -> Rect {
        Rect {
            x,
            y,
            width,
            height,
        }
    }

    fn attach(id: u32, entries: &[(u64, u32)]) -> ControlCommand {
        ControlCommand::AttachBacking {
            resource_id: id,
            entries: entries
                .iter()
                .map(|&(addr, length)| MemEntry { addr, length })
                .collect(),
        }
    }

    fn transfer(id: u32, r: Rect, offset: u64) -> ControlCommand {
        ControlCommand::TransferToHost2d {
            resource_id: id,
            rect: r,
            offset,
        }
    }

    /// A device with resource `id` of `w`x`h` backed by guest memory at `addr`, where pixel
    /// (x, y) holds bytes [x, y, id, 0xff] (B, G, R, X).
    fn backed(dev: &mut GpuDevice, m: &GuestMemoryMmap, id: u32, w: u32, h: u32, addr: u64) {
        ok(dev, m, create(id, w, h));
        let mut bytes = Vec::new();
        for y in 0..h {
            for x in 0..w {
                bytes.extend_from_slice(&[x as u8, y as u8, id as u8, 0xff]);
            }
        }
        m.write_slice(&bytes, GuestAddress(addr)).unwrap();
        ok(dev, m, attach(id, &[(addr, bytes.len() as u32)]));
    }

    fn pixel(dev: &GpuDevice, id: u32, x: u32, y: u32) -> [u8; 4] {
        let res = &dev.resources[&id];
        let at = ((y * res.width + x) * 4) as usize;
        res.image[at..at + 4].try_into().unwrap()
    }

    #[test]
    fn transfer_set_scanout_flush_and_frames() {
        let m = mem();
        let mut dev = GpuDevice::new(DisplayConfig::default(), false);
        backed(&mut dev, &m, 1, 64, 64, 0x1_0000);
        ok(&mut dev, &m, transfer(1, rect(0, 0, 64, 64), 0));
        assert_eq!(pixel(&dev, 1, 5, 9), [5, 9, 1, 0xff]);
        ok(
            &mut dev,
            &m,
            ControlCommand::SetScanout {
                scanout_id: 0,
                resource_id: 1,
                rect: rect(0, 0, 64, 64),
            },
        );
        assert!(!dev.frames_undumped(), "nothing flushed yet");
        ok(
            &mut dev,
            &m,
            ControlCommand::ResourceFlush {
                resource_id: 1,
                rect: rect(8, 8, 100, 100).intersect(&rect(0, 0, 64, 64)).unwrap(),
            },
        );
        let s = dev.scanout(0).unwrap();
        assert_eq!((s.frames, s.last_flush), (1, Some(rect(8, 8, 56, 56))));
        assert_eq!(dev.frames_flushed(), 1);
        assert!(dev.frames_undumped());
        let frames = dev.take_frames(false, None);
        assert_eq!(frames.len(), 1);
        let f = &frames[0];
        let rgb = f.rgb();
        assert_eq!((f.width, f.height, rgb.len()), (64, 64, 64 * 64 * 3));
        // Pixel (5, 9) as RGB: R = id, G = y, B = x.
        let at = (9 * 64 + 5) * 3;
        assert_eq!(&rgb[at..at + 3], &[1, 9, 5]);
        assert!(!dev.frames_undumped());
        assert!(dev.take_frames(false, None).is_empty());
        assert_eq!(
            dev.take_frames(true, None).len(),
            1,
            "all: even when not flushed"
        );
        // A reset frees everything but keeps the frame count.
        dev.reset();
        assert_eq!((dev.resource_count(), dev.host_bytes()), (0, 0));
        assert_eq!(dev.scanout(0).unwrap().frames, 1);
        assert_eq!(dev.scanout(0).unwrap().resource_id, 0);
    }

    #[test]
    fn partial_transfers_use_offset_and_stride() {
        let m = mem();
        let mut dev = GpuDevice::new(DisplayConfig::default(), false);
        backed(&mut dev, &m, 1, 16, 8, 0x1_0000);
        // The Linux driver's offset for a rect at (3, 2): y * stride + x * 4.
        let r = rect(3, 2, 4, 5);
        ok(&mut dev, &m, transfer(1, r, 2 * 64 + 3 * 4));
        assert_eq!(pixel(&dev, 1, 3, 2), [3, 2, 1, 0xff]);
        assert_eq!(pixel(&dev, 1, 6, 6), [6, 6, 1, 0xff]);
        assert_eq!(pixel(&dev, 1, 7, 6), [0; 4], "right of the rect");
        assert_eq!(pixel(&dev, 1, 3, 7), [0; 4], "below the rect");
        assert_eq!(pixel(&dev, 1, 2, 2), [0; 4], "left of the rect");
        // The last pixel of the resource, with the exact backing end.
        ok(&mut dev, &m, transfer(1, rect(15, 7, 1, 1), 16 * 8 * 4 - 4));
        assert_eq!(pixel(&dev, 1, 15, 7), [15, 7, 1, 0xff]);
    }

    #[test]
    fn transfers_gather_from_scattered_backing() {
        let m = mem();
        let mut dev = GpuDevice::new(DisplayConfig::default(), false);
        ok(&mut dev, &m, create(2, 4, 2));
        // 32 bytes of image in three pieces, out of order in guest memory.
        let bytes: Vec<u8> = (0..32).collect();
        m.write_slice(&bytes[..10], GuestAddress(0x9000)).unwrap();
        m.write_slice(&bytes[10..11], GuestAddress(0x2000)).unwrap();
        m.write_slice(&bytes[11..], GuestAddress(0x5003)).unwrap();
        ok(
            &mut dev,
            &m,
            attach(2, &[(0x9000, 10), (0x2000, 1), (0x5003, 21)]),
        );
        ok(&mut dev, &m, transfer(2, rect(0, 0, 4, 2), 0));
        assert_eq!(dev.resources[&2].image, bytes);
    }

    #[test]
    fn transfer_bounds_and_overflow() {
        let m = mem();
        let mut dev = GpuDevice::new(DisplayConfig::default(), false);
        backed(&mut dev, &m, 1, 16, 16, 0x1_0000);
        let before = dev.resources[&1].image.clone();
        let p = ty::ERR_INVALID_PARAMETER;
        for (r, offset) in [
            (rect(0, 0, 17, 1), 0),                 // wider than the resource
            (rect(0, 16, 1, 1), 0),                 // below it
            (rect(15, 0, 2, 1), 0),                 // straddles the right edge
            (rect(u32::MAX, 0, 2, 1), 0),           // x + width wraps
            (rect(0, u32::MAX, 1, 2), 0),           // y + height wraps
            (rect(0, 0, 0, 1), 0),                  // empty
            (rect(0, 0, 1, 0), 0),                  // empty
            (rect(0, 0, 16, 16), 4),                // one pixel past the backing
            (rect(0, 0, 1, 1), 16 * 16 * 4),        // starts at the backing end
            (rect(0, 0, 1, 1), u64::MAX - 1),       // offset + span wraps
            (rect(0, 15, 16, 1), u64::MAX - 0x100), // same, on a later row
        ] {
            assert_eq!(
                err(&mut dev, &m, transfer(1, r, offset)),
                p,
                "{r:?} at {offset}"
            );
        }
        assert_eq!(dev.resources[&1].image, before, "nothing copied");
        assert_eq!(
            err(&mut dev, &m, transfer(9, rect(0, 0, 1, 1), 0)),
            ty::ERR_INVALID_RESOURCE_ID
        );
        ok(&mut dev, &m, create(3, 4, 4));
        assert_eq!(
            err(&mut dev, &m, transfer(3, rect(0, 0, 1, 1), 0)),
            ty::ERR_UNSPEC,
            "no backing"
        );
    }

    #[test]
    fn backing_unmapped_after_attach_fails_at_transfer_time() {
        let m = mem();
        let mut dev = GpuDevice::new(DisplayConfig::default(), false);
        backed(&mut dev, &m, 1, 8, 8, 0x1_0000);
        ok(&mut dev, &m, create(2, 8, 8));
        // In guest RAM when attached; a DMA_UNMAP of the top half of RAM takes the second
        // half of the backing away, and a transfer of it fails then.
        ok(
            &mut dev,
            &m,
            attach(2, &[(0x7_ff80, 0x80), (0x8_0000, 0x80)]),
        );
        let unmapped = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x8_0000)]).unwrap();
        assert_eq!(
            err(&mut dev, &unmapped, transfer(2, rect(0, 0, 8, 8), 0)),
            ty::ERR_UNSPEC
        );
        // The part of the backing still in memory still works.
        ok(&mut dev, &unmapped, transfer(2, rect(0, 0, 8, 4), 0));
        // The neighbour is untouched and still works.
        ok(&mut dev, &m, transfer(1, rect(0, 0, 8, 8), 0));
        assert_eq!(pixel(&dev, 1, 7, 7), [7, 7, 1, 0xff]);
    }

    #[test]
    fn resource_lifecycle_errors() {
        let m = mem();
        let mut dev = GpuDevice::new(DisplayConfig::default(), false);
        let rid = ty::ERR_INVALID_RESOURCE_ID;
        ok(&mut dev, &m, create(1, 8, 8));
        assert_eq!(err(&mut dev, &m, create(1, 8, 8)), rid, "double create");
        assert_eq!(err(&mut dev, &m, create(0, 8, 8)), rid, "id 0");
        for (w, h) in [(0, 8), (8, 0), (MAX_RESOURCE_EDGE + 1, 1)] {
            assert_eq!(
                err(&mut dev, &m, create(5, w, h)),
                ty::ERR_INVALID_PARAMETER
            );
        }
        assert_eq!(
            err(
                &mut dev,
                &m,
                ControlCommand::ResourceUnref { resource_id: 7 }
            ),
            rid
        );
        assert_eq!(
            err(
                &mut dev,
                &m,
                ControlCommand::DetachBacking { resource_id: 1 }
            ),
            ty::ERR_UNSPEC,
            "no backing to detach"
        );
        assert_eq!(err(&mut dev, &m, attach(7, &[(0, 4)])), rid);
        assert_eq!(err(&mut dev, &m, attach(1, &[])), ty::ERR_INVALID_PARAMETER);
        assert_eq!(
            err(&mut dev, &m, attach(1, &[(0x1000, 0)])),
            ty::ERR_INVALID_PARAMETER
        );
        assert_eq!(
            err(&mut dev, &m, attach(1, &[(u64::MAX - 2, 4)])),
            ty::ERR_INVALID_PARAMETER
        );
        ok(&mut dev, &m, attach(1, &[(0x1000, 256)]));
        assert_eq!(
            err(&mut dev, &m, attach(1, &[(0x1000, 256)])),
            ty::ERR_UNSPEC,
            "already backed"
        );
        ok(
            &mut dev,
            &m,
            ControlCommand::DetachBacking { resource_id: 1 },
        );
        ok(&mut dev, &m, attach(1, &[(0x1000, 256)]));
        ok(
            &mut dev,
            &m,
            ControlCommand::ResourceUnref { resource_id: 1 },
        );
        assert_eq!((dev.resource_count(), dev.host_bytes()), (0, 0));
        ok(&mut dev, &m, create(1, 8, 8));
    }

    #[test]
    fn scanout_and_flush_errors() {
        let m = mem();
        let mut dev = GpuDevice::new(DisplayConfig::default(), false);
        ok(&mut dev, &m, create(1, 32, 32));
        let set = |scanout_id, resource_id, r| ControlCommand::SetScanout {
            scanout_id,
            resource_id,
            rect: r,
        };
        assert_eq!(
            err(&mut dev, &m, set(1, 1, rect(0, 0, 32, 32))),
            ty::ERR_INVALID_SCANOUT_ID
        );
        assert_eq!(
            err(&mut dev, &m, set(u32::MAX, 0, rect(0, 0, 0, 0))),
            ty::ERR_INVALID_SCANOUT_ID
        );
        assert_eq!(
            err(&mut dev, &m, set(0, 2, rect(0, 0, 32, 32))),
            ty::ERR_INVALID_RESOURCE_ID
        );
        assert_eq!(
            err(&mut dev, &m, set(0, 1, rect(1, 0, 32, 32))),
            ty::ERR_INVALID_PARAMETER
        );
        ok(&mut dev, &m, set(0, 1, rect(8, 8, 16, 16)));
        let flush = |resource_id, r| ControlCommand::ResourceFlush {
            resource_id,
            rect: r,
        };
        assert_eq!(
            err(&mut dev, &m, flush(2, rect(0, 0, 1, 1))),
            ty::ERR_INVALID_RESOURCE_ID
        );
        assert_eq!(
            err(&mut dev, &m, flush(1, rect(0, 0, 33, 1))),
            ty::ERR_INVALID_PARAMETER
        );
        // A flush outside the shown part is no frame.
        ok(&mut dev, &m, flush(1, rect(0, 0, 8, 8)));
        assert_eq!(dev.frames_flushed(), 0);
        ok(&mut dev, &m, flush(1, rect(0, 0, 9, 9)));
        assert_eq!(dev.scanout(0).unwrap().last_flush, Some(rect(8, 8, 1, 1)));
        // Unref of the shown resource disables the scanout; resource 0 disables it too.
        ok(
            &mut dev,
            &m,
            ControlCommand::ResourceUnref { resource_id: 1 },
        );
        assert_eq!(dev.scanout(0).unwrap().resource_id, 0);
        assert!(dev.take_frames(true, None).is_empty());
        ok(&mut dev, &m, set(0, 0, rect(1, 2, 3, 4)));
        assert_eq!(dev.scanout(0).unwrap().rect, Rect::default());
    }

    #[test]
    fn limits_on_resources_and_host_bytes() {
        let m = mem();
        let mut dev = GpuDevice::new(DisplayConfig::default(), false);
        dev.set_resource_budget(256 << 20);
        // 8192 x 8192 x 4 = 256 MiB: exactly the budget, so one more byte fails.
        ok(&mut dev, &m, create(1, 8192, 8192));
        assert_eq!(dev.host_bytes(), 256 << 20);
        assert_eq!(err(&mut dev, &m, create(2, 1, 1)), ty::ERR_OUT_OF_MEMORY);
        assert_eq!(
            err(&mut dev, &m, attach(1, &[(0x1000, 4)])),
            ty::ERR_OUT_OF_MEMORY,
            "backing entries count too"
        );
        ok(
            &mut dev,
            &m,
            ControlCommand::ResourceUnref { resource_id: 1 },
        );
        assert_eq!(
            err(
                &mut dev,
                &m,
                create(2, MAX_RESOURCE_EDGE, MAX_RESOURCE_EDGE)
            ),
            ty::ERR_OUT_OF_MEMORY
        );
        for id in 1..=MAX_RESOURCES as u32 {
            ok(&mut dev, &m, create(id, 1, 1));
        }
        assert_eq!(
            err(&mut dev, &m, create(MAX_RESOURCES as u32 + 1, 1, 1)),
            ty::ERR_OUT_OF_MEMORY
        );
        ok(
            &mut dev,
            &m,
            ControlCommand::ResourceUnref { resource_id: 5 },
        );
        ok(&mut dev, &m, create(MAX_RESOURCES as u32 + 1, 1, 1));
    }

    use crate::gpu::compute::BLOB_MEM_GUEST;
    use crate::gpu::fake_backend::FakeBackend;
    use crate::gpu::protocol::{ResourceCreate3d, ResourceCreateBlob};
    use mdev_backend::virgl::{self as virgl, TARGET_BUFFER, TARGET_TEXTURE_2D};
    use std::sync::Arc;

    /// RESOURCE_CREATE_3D of a `width`x`height` B8G8R8A8 2D texture with `layers` layers.
    fn create_3d(id: u32, width: u32, height: u32, layers: u32) -> ControlCommand {
        ControlCommand::ResourceCreate3d(ResourceCreate3d {
            resource_id: id,
            args: virgl::ResourceCreate3d {
                target: TARGET_TEXTURE_2D,
                format: virgl::FORMAT_B8G8R8A8_UNORM,
                width,
                height,
                depth: 1,
                array_size: layers,
                ..Default::default()
            },
        })
    }

    /// Runs `cmd` with `fake` as the renderer.
    fn run_3d(
        dev: &mut GpuDevice,
        m: &Arc<GuestMemoryMmap>,
        fake: &FakeBackend,
        cmd: ControlCommand,
    ) -> Response {
        let renderer = Renderer {
            virgl: fake,
            mem: m,
        };
        dev.execute(&mut req(cmd), &**m, Some(renderer))
    }

    #[test]
    fn oversized_3d_resources_are_refused_before_the_renderer() {
        let m = Arc::new(mem());
        let fake = FakeBackend::default();
        let mut dev = GpuDevice::new(DisplayConfig::default(), true);
        // 16384 x 16384 x 4 bytes x 2048 layers: 2 TiB.
        let huge = create_3d(1, MAX_RESOURCE_EDGE, MAX_RESOURCE_EDGE, 2048);
        assert_eq!(
            run_3d(&mut dev, &m, &fake, huge),
            Response::Err(ty::ERR_OUT_OF_MEMORY)
        );
        for bad in [
            create_3d(1, MAX_RESOURCE_EDGE + 1, 1, 1),
            create_3d(1, 1, u32::MAX, 1),
            create_3d(1, 1, 1, 2049),
        ] {
            assert_eq!(
                run_3d(&mut dev, &m, &fake, bad),
                Response::Err(ty::ERR_INVALID_PARAMETER)
            );
        }
        assert_eq!(fake.created.get(), 0, "the renderer allocated nothing");
        assert_eq!(dev.host_bytes(), 0);
        // A full mip chain is charged: 64x64 + 32x32 + ... + 1x1 texels of 4 bytes.
        let mut mipmapped = create_3d(2, 64, 64, 1);
        if let ControlCommand::ResourceCreate3d(c) = &mut mipmapped {
            c.args.last_level = 6;
        }
        assert_eq!(run_3d(&mut dev, &m, &fake, mipmapped), Response::OkNoData);
        let texels: u64 = (0..=6).map(|l| (64u64 >> l) * (64 >> l)).sum();
        assert_eq!(dev.host_bytes(), texels * 4);
    }

    #[test]
    fn resource_creates_stop_at_the_budget_and_unref_returns_it() {
        let m = Arc::new(mem());
        let fake = FakeBackend::default();
        let mut dev = GpuDevice::new(DisplayConfig::default(), true);
        dev.set_resource_budget(16 << 20);
        // 65536 creates of 256 KiB textures: 64 fit in 16 MiB.
        let mut created = 0;
        for id in 1..=65536 {
            match run_3d(&mut dev, &m, &fake, create_3d(id, 256, 256, 1)) {
                Response::OkNoData => created += 1,
                r => assert_eq!(r, Response::Err(ty::ERR_OUT_OF_MEMORY), "create {id}"),
            }
        }
        assert_eq!((created, fake.created.get()), (64, 64));
        assert_eq!(dev.host_bytes(), 16 << 20);
        // 2D resources share the budget.
        assert_eq!(
            run_3d(&mut dev, &m, &fake, create(70_000, 1, 1)),
            Response::Err(ty::ERR_OUT_OF_MEMORY)
        );
        let unref = ControlCommand::ResourceUnref { resource_id: 3 };
        assert_eq!(run_3d(&mut dev, &m, &fake, unref), Response::OkNoData);
        assert_eq!(dev.host_bytes(), 15 << 20 | 3 << 18);
        assert_eq!(
            run_3d(&mut dev, &m, &fake, create(70_000, 256, 256)),
            Response::OkNoData,
            "the unreferenced texture's bytes serve a 2D resource"
        );
        dev.reset();
        assert_eq!(dev.host_bytes(), 0, "a reset returns everything");
        assert_eq!(
            run_3d(&mut dev, &m, &fake, create_3d(1, 2048, 2048, 1)),
            Response::OkNoData,
            "16 MiB again after the reset, the budget kept"
        );
        assert_eq!(
            run_3d(&mut dev, &m, &fake, create_3d(2, 1, 1, 1)),
            Response::Err(ty::ERR_OUT_OF_MEMORY)
        );
    }

    #[test]
    fn read_back_with_overflowing_dimensions_is_refused() {
        let m = Arc::new(mem());
        let fake = FakeBackend::default();
        for (width, height) in [(0x4000_0000, 1), (MAX_RESOURCE_EDGE, MAX_RESOURCE_EDGE + 1)] {
            assert_eq!(
                read_back(&fake, 1, &rect(0, 0, width, height)),
                Err(DeviceError::ReadBackTooLarge { width, height })
            );
        }
        assert_eq!(fake.read_backs.get(), 0);
        // A scanout of a 3D buffer wider than any image: the dump's read-back is refused.
        let mut dev = GpuDevice::new(DisplayConfig::default(), true);
        dev.set_resource_budget(4 << 30);
        let width = 0x4000_0001;
        let buffer = ControlCommand::ResourceCreate3d(ResourceCreate3d {
            resource_id: 9,
            args: virgl::ResourceCreate3d {
                target: TARGET_BUFFER,
                format: virgl::FORMAT_B8G8R8A8_UNORM,
                width,
                height: 1,
                depth: 1,
                array_size: 1,
                ..Default::default()
            },
        });
        assert_eq!(run_3d(&mut dev, &m, &fake, buffer), Response::OkNoData);
        let show = ControlCommand::SetScanout {
            scanout_id: 0,
            resource_id: 9,
            rect: rect(0, 0, width, 1),
        };
        assert_eq!(run_3d(&mut dev, &m, &fake, show), Response::OkNoData);
        assert!(dev.take_frames(true, Some(&fake)).is_empty());
        assert_eq!(fake.read_backs.get(), 0);
        // An ordinary scanout is still read back.
        assert_eq!(
            run_3d(&mut dev, &m, &fake, create_3d(10, 64, 32, 1)),
            Response::OkNoData
        );
        let show = ControlCommand::SetScanout {
            scanout_id: 0,
            resource_id: 10,
            rect: rect(0, 0, 64, 32),
        };
        assert_eq!(run_3d(&mut dev, &m, &fake, show), Response::OkNoData);
        let frames = dev.take_frames(true, Some(&fake));
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].pixels.len(), 64 * 32 * 4);
    }

    /// This process's resident set in KiB, for the figures a test prints (never asserted: the
    /// tests of this binary run side by side).
    fn rss_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    /// RESOURCE_CREATE_BLOB of a 4 KiB guest blob with `entries`.
    fn create_blob(id: u32, entries: &[MemEntry]) -> ControlCommand {
        ControlCommand::ResourceCreateBlob(ResourceCreateBlob {
            resource_id: id,
            blob_mem: BLOB_MEM_GUEST,
            blob_flags: 1,
            blob_id: 0,
            size: 4096,
            entries: entries.to_vec(),
        })
    }

    /// `n` entries of 16 bytes each in guest RAM.
    fn entries(n: usize) -> Vec<MemEntry> {
        vec![
            MemEntry {
                addr: 0x1000,
                length: 16
            };
            n
        ]
    }

    #[test]
    fn blob_entry_lists_are_charged_and_stop_at_the_budget() {
        // Issue 24, finding 6: 4,095 blobs of 10,000 entries each against 256 MiB.
        const BLOBS: u32 = 4095;
        const ENTRIES: usize = 10_000;
        const BUDGET: u64 = 256 << 20;
        let m = mem();
        let mut dev = GpuDevice::new(DisplayConfig::default(), true);
        dev.set_resource_budget(BUDGET);
        let list = entries(ENTRIES);
        let before = rss_kib();
        let mut created = 0u64;
        for id in 1..=BLOBS {
            match run(&mut dev, &m, create_blob(id, &list)) {
                Response::OkNoData => created += 1,
                r => assert_eq!(r, Response::Err(ty::ERR_OUT_OF_MEMORY), "blob {id}"),
            }
        }
        eprintln!(
            "{created} of {BLOBS} blobs of {ENTRIES} entries created: {} bytes charged, \
             RSS {before} -> {} KiB",
            dev.host_bytes(),
            rss_kib()
        );
        let per_blob = (ENTRIES * std::mem::size_of::<MemEntry>()) as u64;
        assert_eq!(created, BUDGET / per_blob, "the budget stops them");
        assert!(dev.host_bytes() <= BUDGET);
        // An unref gives its list back, and another blob fits.
        ok(
            &mut dev,
            &m,
            ControlCommand::ResourceUnref { resource_id: 1 },
        );
        ok(&mut dev, &m, create_blob(1, &list));
        assert_eq!(
            err(&mut dev, &m, create_blob(BLOBS + 1, &list)),
            ty::ERR_OUT_OF_MEMORY
        );
        // A detach gives it back too.
        ok(
            &mut dev,
            &m,
            ControlCommand::DetachBacking { resource_id: 1 },
        );
        ok(&mut dev, &m, create_blob(BLOBS + 1, &list));
        dev.reset();
        assert_eq!(dev.host_bytes(), 0, "a reset returns every list");
    }

    #[test]
    fn gl_resources_and_blobs_share_one_budget() {
        let m = Arc::new(mem());
        let fake = FakeBackend::default();
        let mut dev = GpuDevice::new(DisplayConfig::default(), true);
        dev.set_resource_budget(16 << 20);
        // 60 textures of 256 KiB: 15 MiB of the 16.
        for id in 1..=60 {
            let r = run_3d(&mut dev, &m, &fake, create_3d(id, 256, 256, 1));
            assert_eq!(r, Response::OkNoData);
        }
        // The last MiB holds four blobs of 16,384 entries (256 KiB of entries each).
        let list = entries(16384);
        let mut blobs = 0;
        for id in 100..110 {
            match run_3d(&mut dev, &m, &fake, create_blob(id, &list)) {
                Response::OkNoData => blobs += 1,
                r => assert_eq!(r, Response::Err(ty::ERR_OUT_OF_MEMORY), "blob {id}"),
            }
        }
        assert_eq!(blobs, 4);
        assert_eq!(dev.host_bytes(), 16 << 20);
        // Neither a 2D image, a 2D or 3D backing nor another texture fits now.
        assert_eq!(
            run_3d(&mut dev, &m, &fake, create(200, 1, 1)),
            Response::Err(ty::ERR_OUT_OF_MEMORY)
        );
        assert_eq!(
            run_3d(&mut dev, &m, &fake, attach(1, &[(0x1000, 4096)])),
            Response::Err(ty::ERR_OUT_OF_MEMORY)
        );
        assert_eq!(
            run_3d(&mut dev, &m, &fake, create_3d(201, 1, 1, 1)),
            Response::Err(ty::ERR_OUT_OF_MEMORY)
        );
        // A blob's unref makes room for a texture, a texture's for a blob.
        let unref = |id| ControlCommand::ResourceUnref { resource_id: id };
        assert_eq!(run_3d(&mut dev, &m, &fake, unref(100)), Response::OkNoData);
        assert_eq!(
            run_3d(&mut dev, &m, &fake, create_3d(201, 256, 256, 1)),
            Response::OkNoData
        );
        assert_eq!(run_3d(&mut dev, &m, &fake, unref(1)), Response::OkNoData);
        assert_eq!(
            run_3d(&mut dev, &m, &fake, create_blob(100, &list)),
            Response::OkNoData
        );
        dev.reset();
        assert_eq!(dev.host_bytes(), 0, "a reset returns the whole budget");
        assert_eq!(
            run_3d(&mut dev, &m, &fake, create_3d(1, 2048, 2048, 1)),
            Response::OkNoData,
            "all 16 MiB again after the reset"
        );
    }

    #[test]
    fn entries_outside_guest_ram_are_refused_when_they_are_made() {
        // Issue 24, finding 8: an entry outside guest RAM answers ERR_UNSPEC at once, as
        // QEMU's virtio_gpu_create_mapping_iov does, not OK and an error at transfer.
        let m = mem();
        let mut dev = GpuDevice::new(DisplayConfig::default(), true);
        ok(&mut dev, &m, create(1, 8, 8));
        let outside = 0x7fff_0000_0000;
        for entries in [
            vec![(outside, 4096)],
            vec![(0x1000, 2048), (outside, 2048)],
            vec![(0xf_f800, 4096)],
        ] {
            assert_eq!(err(&mut dev, &m, attach(1, &entries)), ty::ERR_UNSPEC);
            let list: Vec<MemEntry> = entries
                .iter()
                .map(|&(addr, length)| MemEntry { addr, length })
                .collect();
            assert_eq!(err(&mut dev, &m, create_blob(2, &list)), ty::ERR_UNSPEC);
        }
        assert_eq!(dev.host_bytes(), 8 * 8 * 4, "nothing charged for them");
        ok(&mut dev, &m, attach(1, &[(0x1000, 256)]));
        ok(&mut dev, &m, create_blob(2, &entries(256)));
    }

    #[test]
    fn edid_for_scanout_0_only() {
        let m = mem();
        let mut dev = GpuDevice::new("1280x800".parse().unwrap(), false);
        assert_eq!(dev.features(), 1 << 1, "VIRTIO_GPU_F_EDID");
        let Response::OkEdid(e) = run(&mut dev, &m, ControlCommand::GetEdid { scanout_id: 0 })
        else {
            panic!("no EDID");
        };
        assert_eq!(e.len(), 128);
        assert_eq!(e.iter().fold(0u8, |s, &b| s.wrapping_add(b)), 0);
        assert_eq!(
            err(&mut dev, &m, ControlCommand::GetEdid { scanout_id: 1 }),
            ty::ERR_INVALID_PARAMETER
        );
        let mut big = GpuDevice::new("8192x4096".parse().unwrap(), false);
        assert_eq!(
            big.features(),
            0,
            "no EDID feature for a mode an EDID cannot carry"
        );
        assert_eq!(
            err(&mut big, &m, ControlCommand::GetEdid { scanout_id: 0 }),
            ty::ERR_UNSPEC
        );
    }

    #[test]
    fn display_info_reports_the_configured_mode() {
        let mut dev = GpuDevice::new("1280x720".parse().unwrap(), false);
        let m = mem();
        let Response::OkDisplayInfo(s) =
            dev.execute(&mut req(ControlCommand::GetDisplayInfo), &m, None)
        else {
            panic!("wrong response");
        };
        assert_eq!(
            s,
            vec![DisplayOne {
                width: 1280,
                height: 720,
                enabled: true
            }]
        );
        assert_eq!(
            dev.execute(&mut req(ControlCommand::Unimplemented(0x20b)), &m, None),
            Response::Err(ty::ERR_UNSPEC)
        );
    }

    #[test]
    fn mode_parsing_bounds() {
        assert_eq!(
            "1024x768".parse::<DisplayConfig>(),
            Ok(DisplayConfig::default())
        );
        assert!(matches!(
            "0x768".parse::<DisplayConfig>(),
            Err(DeviceError::BadMode(0, 768))
        ));
        assert!("99999x1".parse::<DisplayConfig>().is_err());
        assert!("1024*768".parse::<DisplayConfig>().is_err());
        assert!("x".parse::<DisplayConfig>().is_err());
    }

    #[test]
    fn config_space_reports_one_scanout() {
        let dev = GpuDevice::new(DisplayConfig::default(), false);
        let mut b = [0u8; 4];
        dev.config_read(8, &mut b);
        assert_eq!(u32::from_le_bytes(b), 1);
        dev.config_read(12, &mut b);
        assert_eq!(u32::from_le_bytes(b), 0);
        dev.config_read(u64::MAX, &mut b);
        assert_eq!(b, [0; 4]);
    }

    #[test]
    fn cursor_updates_position_and_image() {
        let mut dev = GpuDevice::new(DisplayConfig::default(), false);
        let cmd = CursorCommand {
            update: true,
            scanout_id: 0,
            x: 3,
            y: 4,
            resource_id: 9,
            hot_x: 0,
            hot_y: 0,
        };
        dev.execute_cursor(&cmd);
        dev.execute_cursor(&CursorCommand {
            update: false,
            x: 5,
            resource_id: 0,
            ..cmd
        });
        assert_eq!(
            dev.cursor(),
            CursorState {
                x: 5,
                y: 4,
                resource_id: 9
            }
        );
        dev.execute_cursor(&CursorCommand {
            scanout_id: 3,
            x: 100,
            ..cmd
        });
        assert_eq!(dev.cursor().x, 5);
    }
}
