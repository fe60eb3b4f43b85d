//! The 3D half of the virtio-gpu device (hop 5 for GPU-executing commands): virgl contexts,
//! 3D resources and command streams, executed by virglrenderer on the worker thread.
//!
//! The device keeps its own table of what the guest created, so that every id is checked
//! before virglrenderer sees it (virglrenderer 0.10 silently replaces duplicate ids and
//! poisons a context on any error) and so that a guest reset can destroy everything. A reset
//! happens on the message-loop thread, which must never call virglrenderer: it only marks the
//! objects, and the worker destroys them ([`ThreeD::reap`]) before it runs anything else.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use log::debug;
use mdev_backend::budget::{Charge, MemoryBudget, OverBudget};
use mdev_backend::virgl::{
    self as virgl, BackingMemory, CAPSET_VIRGL, CAPSET_VIRGL2, TARGET_BUFFER, TARGET_TEXTURE_3D,
};
use mdev_backend::{BackendError, GpuBackend};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use super::compute::{self, COMPUTE_CAPSET_SIZE, COMPUTE_CAPSET_VERSION, VGPU_COMPUTE_CAPSET_ID};
use super::device::MAX_RESOURCE_EDGE;
use super::load::{self, LOAD_CAPSET_SIZE, LOAD_CAPSET_VERSION, VGPU_LOAD_CAPSET_ID};
use super::protocol::{
    CtxCreate, MAX_BACKING_ENTRIES, MemEntry, ResourceCreate3d, Response, Transfer3d, ty,
};
use crate::ratelimit::guest_fault;

/// Capsets offered, in GET_CAPSET_INFO index order (VIRGL, VIRGL2, then the private load and
/// compute capsets, which the device serves itself).
pub const CAPSETS: [u32; 4] = [
    CAPSET_VIRGL,
    CAPSET_VIRGL2,
    VGPU_LOAD_CAPSET_ID,
    VGPU_COMPUTE_CAPSET_ID,
];
/// Most 3D contexts per guest. Mesa opens one per GL context; a desktop session uses a few
/// dozen at most.
pub const MAX_CONTEXTS: usize = 256;
/// Most 3D resources per guest (textures, buffers, render targets of every GL context).
pub const MAX_RESOURCES_3D: usize = 65536;
/// Largest depth of a 3D texture and array size of an array texture (GL_MAX_3D_TEXTURE_SIZE
/// and GL_MAX_ARRAY_TEXTURE_LAYERS of common GPUs and llvmpipe are 2048).
pub const MAX_TEXTURE_LAYERS: u32 = 2048;
/// Highest mipmap level: a full chain of a [`MAX_RESOURCE_EDGE`] texture has levels 0..=14.
pub const MAX_MIP_LEVEL: u32 = 14;
/// Most samples per pixel of a multisampled resource (GL_MAX_SAMPLES is 8 or 16 on common GPUs
/// and llvmpipe).
pub const MAX_SAMPLES: u32 = 16;
/// Bytes per pixel charged for a format not in [`bytes_per_pixel`]'s table: the widest pixel
/// of any virgl format (R64G64B64A64, 32 bytes); compressed formats take less.
const WIDEST_PIXEL: u64 = 32;
/// VIRGL_FORMAT_R8_UNORM (virgl_hw.h): one byte per pixel, the format of Mesa's buffers.
const FORMAT_R8_UNORM: u32 = 64;

/// Errors of 3D execution; each maps to a VIRTIO_GPU_RESP_ERR_* code.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ThreeDError {
    /// GET_CAPSET_INFO for an index past the offered capsets.
    #[error("no capset at index {0}")]
    CapsetIndex(u32),
    /// A context id that is 0 or already in use.
    #[error("context id {0} is 0 or taken")]
    ContextIdTaken(u32),
    /// A context id the guest never created.
    #[error("unknown context {0}")]
    UnknownContext(u32),
    /// CONTEXT_INIT names a capset that is not offered.
    #[error("context init capset {0} is not offered")]
    ContextCapset(u32),
    /// GET_CAPSET of the load capset with a version it does not have.
    #[error("load capset version {0} is not offered")]
    CapsetVersion(u32),
    /// Too many contexts or resources.
    #[error("limit of {0} reached")]
    Limit(&'static str),
    /// A resource id that is 0 or already in use.
    #[error("resource id {0} is 0 or taken")]
    ResourceIdTaken(u32),
    /// A 3D resource id the guest never created.
    #[error("unknown 3D resource {0}")]
    UnknownResource(u32),
    /// A transfer box outside level 0 of the resource.
    #[error("transfer box {x},{y} {w}x{h} outside the {width}x{height} resource")]
    BoxOutside {
        /// Box origin.
        x: u32,
        /// Box origin.
        y: u32,
        /// Box width.
        w: u32,
        /// Box height.
        h: u32,
        /// Resource width.
        width: u32,
        /// Resource height.
        height: u32,
    },
    /// A backing entry outside guest memory, or across two memory regions.
    #[error("backing entry {addr:#x}+{len:#x} is not inside one guest memory region")]
    BadEntry {
        /// Entry address.
        addr: u64,
        /// Entry length.
        len: u32,
    },
    /// Strides whose products with the box overflow virglrenderer's 32-bit size checks.
    #[error("transfer strides {stride}/{layer_stride} too large for a {h}-row, {d}-layer box")]
    StridesTooLarge {
        /// Row stride.
        stride: u32,
        /// Layer stride.
        layer_stride: u32,
        /// Box height.
        h: u32,
        /// Box depth.
        d: u32,
    },
    /// A 3D resource whose size or layout is outside the named limits.
    #[error(
        "3D resource {width}x{height}x{depth}, {array_size} layers, levels 0..={last_level}, \
         {samples} samples is outside the limits"
    )]
    BadSize {
        /// Width.
        width: u32,
        /// Height.
        height: u32,
        /// Depth.
        depth: u32,
        /// Array size.
        array_size: u32,
        /// Last mipmap level.
        last_level: u32,
        /// Samples.
        samples: u32,
    },
    /// The resource or backing would take the VM past its host-memory budget.
    #[error("3D: {0}")]
    OutOfMemory(#[from] OverBudget),
    /// virglrenderer refused the call.
    #[error("renderer: {0}")]
    Renderer(String),
}

impl From<BackendError> for ThreeDError {
    fn from(e: BackendError) -> Self {
        ThreeDError::Renderer(e.to_string())
    }
}

impl ThreeDError {
    /// The response code the guest gets.
    pub fn response_code(&self) -> u32 {
        match self {
            ThreeDError::ContextIdTaken(_) | ThreeDError::UnknownContext(_) => {
                ty::ERR_INVALID_CONTEXT_ID
            }
            ThreeDError::ResourceIdTaken(_) | ThreeDError::UnknownResource(_) => {
                ty::ERR_INVALID_RESOURCE_ID
            }
            ThreeDError::BoxOutside { .. }
            | ThreeDError::StridesTooLarge { .. }
            | ThreeDError::CapsetIndex(_)
            | ThreeDError::ContextCapset(_)
            | ThreeDError::CapsetVersion(_)
            | ThreeDError::BadEntry { .. }
            | ThreeDError::BadSize { .. } => ty::ERR_INVALID_PARAMETER,
            ThreeDError::Limit(_) | ThreeDError::OutOfMemory(_) => ty::ERR_OUT_OF_MEMORY,
            ThreeDError::Renderer(_) => ty::ERR_UNSPEC,
        }
    }
}

/// Backing memory of a 3D resource: iovecs into guest RAM plus the guest-memory snapshot they
/// point into.
struct GuestBacking {
    /// Keeps every mapping the iovecs point into alive, even after a DMA_UNMAP.
    _mem: Arc<GuestMemoryMmap>,
    iovecs: Vec<libc::iovec>,
    /// What the iovecs are charged to the VM's budget, given back when the renderer drops
    /// the backing (detach, unref, reset).
    _charge: Charge,
}

// SAFETY: each iovec was taken from a region of `_mem` and lies inside that one region
// (checked in `GuestBacking::new`). The regions are mmaps owned through the `Arc`, which this
// value holds, so they stay mapped and never move for as long as it lives. Rust code accesses
// guest memory only through vm-memory's volatile accessors, never through references.
unsafe impl BackingMemory for GuestBacking {
    fn iovecs(&self) -> &[libc::iovec] {
        &self.iovecs
    }
}

/// Host bytes one backing entry of a 3D resource costs: its iovec.
const IOVEC_BYTES: u64 = std::mem::size_of::<libc::iovec>() as u64;

impl GuestBacking {
    /// The iovecs of `entries`, each inside one region of `mem`; `charge` pays for them.
    fn new(
        mem: Arc<GuestMemoryMmap>,
        entries: &[MemEntry],
        charge: Charge,
    ) -> Result<GuestBacking, ThreeDError> {
        let mut iovecs = Vec::with_capacity(entries.len().min(MAX_BACKING_ENTRIES as usize));
        for e in entries {
            let bad = || ThreeDError::BadEntry {
                addr: e.addr,
                len: e.length,
            };
            let region = mem.find_region(GuestAddress(e.addr)).ok_or_else(bad)?;
            let start = region.start_addr().0;
            let end = e.addr.checked_add(u64::from(e.length)).ok_or_else(bad)?;
            if end > start + region.len() {
                return Err(bad());
            }
            let host = mem
                .get_host_address(GuestAddress(e.addr))
                .map_err(|_| bad())?;
            iovecs.push(libc::iovec {
                iov_base: host.cast(),
                iov_len: e.length as usize,
            });
        }
        Ok(GuestBacking {
            _mem: mem,
            iovecs,
            _charge: charge,
        })
    }
}

/// What 3D execution needs for one command: the backend and the guest memory snapshot backing
/// entries are resolved against.
#[derive(Debug, Clone, Copy)]
pub struct Renderer<'a> {
    /// The 3D backend, on the thread that owns it.
    pub virgl: &'a dyn GpuBackend,
    /// The guest memory of this command.
    pub mem: &'a Arc<GuestMemoryMmap>,
}

/// Size of a 3D resource, for scanout checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size3d {
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
    /// virgl format (the same numbers as virtio_gpu_formats for the scanout formats).
    pub format: u32,
}

/// Bytes per pixel of virgl format `format`, or an upper bound ([`WIDEST_PIXEL`]) for formats
/// not in this table of the common ones.
fn bytes_per_pixel(format: u32) -> u64 {
    match format {
        FORMAT_R8_UNORM => 1,
        virgl::FORMAT_B8G8R8A8_UNORM
        | virgl::FORMAT_B8G8R8X8_UNORM
        | virgl::FORMAT_R8G8B8A8_UNORM => 4,
        f if super::protocol::PixelFormat::from_wire(f).is_some() => 4,
        _ => WIDEST_PIXEL,
    }
}

/// The host bytes a 3D resource may take: every mipmap level of every layer and sample, at its
/// format's bytes per pixel (an upper bound for unknown formats); a buffer is `width` bytes.
/// Sizes outside the named limits are refused; the arithmetic is checked throughout.
pub fn resource_bytes(args: &virgl::ResourceCreate3d) -> Result<u64, ThreeDError> {
    let bad = || ThreeDError::BadSize {
        width: args.width,
        height: args.height,
        depth: args.depth,
        array_size: args.array_size,
        last_level: args.last_level,
        samples: args.nr_samples,
    };
    // Mesa sends 1 for unused dimensions; 0 is charged as 1.
    let (height, depth, layers) = (
        args.height.max(1),
        args.depth.max(1),
        args.array_size.max(1),
    );
    let samples = args.nr_samples.max(1);
    if args.target == TARGET_BUFFER {
        if height != 1 || depth != 1 || layers != 1 || args.last_level != 0 || samples != 1 {
            return Err(bad());
        }
        return Ok(u64::from(args.width.max(1)));
    }
    let edge = 1..=MAX_RESOURCE_EDGE;
    if !edge.contains(&args.width)
        || !edge.contains(&height)
        || depth > MAX_TEXTURE_LAYERS
        || layers > MAX_TEXTURE_LAYERS
        || args.last_level > MAX_MIP_LEVEL
        || samples > MAX_SAMPLES
    {
        return Err(bad());
    }
    let per_texel = bytes_per_pixel(args.format)
        .checked_mul(u64::from(layers))
        .and_then(|b| b.checked_mul(u64::from(samples)))
        .ok_or_else(bad)?;
    let mut total = 0u64;
    for level in 0..=args.last_level {
        let shrink = |n: u32| u64::from((n >> level).max(1));
        let level_depth = if args.target == TARGET_TEXTURE_3D {
            shrink(depth)
        } else {
            u64::from(depth)
        };
        total = shrink(args.width)
            .checked_mul(shrink(height))
            .and_then(|t| t.checked_mul(level_depth))
            .and_then(|t| t.checked_mul(per_texel))
            .and_then(|t| t.checked_add(total))
            .ok_or_else(bad)?;
    }
    Ok(total)
}

/// The 3D objects of one guest.
#[derive(Debug, Default)]
pub struct ThreeD {
    /// virgl contexts.
    contexts: BTreeSet<u32>,
    /// Load- and compute-capset contexts (the device's own; virglrenderer never sees them),
    /// with their capset.
    private_contexts: BTreeMap<u32, u32>,
    /// 3D resources, with what each is charged to the VM's budget ([`resource_bytes`]).
    resources: BTreeMap<u32, (Size3d, Charge)>,
    /// Left behind by a reset, destroyed by the worker in [`ThreeD::reap`].
    doomed_contexts: Vec<u32>,
    doomed_resources: Vec<u32>,
}

impl ThreeD {
    /// The size of 3D resource `id`, if it exists.
    pub fn resource(&self, id: u32) -> Option<Size3d> {
        self.resources.get(&id).map(|(size, _)| *size)
    }

    /// Whether `ctx` is a load-capset context.
    pub fn is_load_context(&self, ctx: u32) -> bool {
        self.private_contexts.get(&ctx) == Some(&VGPU_LOAD_CAPSET_ID)
    }

    /// Whether `ctx` is a compute-capset context.
    pub fn is_compute_context(&self, ctx: u32) -> bool {
        self.private_contexts.get(&ctx) == Some(&VGPU_COMPUTE_CAPSET_ID)
    }

    /// Guest reset: everything goes, on the worker's next [`ThreeD::reap`].
    pub fn reset(&mut self) {
        self.private_contexts.clear();
        self.doomed_contexts
            .extend(std::mem::take(&mut self.contexts));
        self.doomed_resources
            .extend(std::mem::take(&mut self.resources).into_keys());
    }

    /// Destroys what a reset left behind (worker thread only).
    pub fn reap(&mut self, virgl: &dyn GpuBackend) {
        for ctx in self.doomed_contexts.drain(..) {
            virgl.context_destroy(ctx);
        }
        for res in self.doomed_resources.drain(..) {
            if let Err(e) = virgl.resource_unref(res) {
                debug!("3D resource {res} at reset: {e}");
            }
        }
    }

    /// GET_CAPSET_INFO.
    pub fn capset_info(&self, index: u32, r: Renderer<'_>) -> Result<Response, ThreeDError> {
        let id = *CAPSETS
            .get(index as usize)
            .ok_or(ThreeDError::CapsetIndex(index))?;
        let private = match id {
            VGPU_LOAD_CAPSET_ID => Some((LOAD_CAPSET_VERSION, LOAD_CAPSET_SIZE)),
            VGPU_COMPUTE_CAPSET_ID => Some((COMPUTE_CAPSET_VERSION, COMPUTE_CAPSET_SIZE)),
            _ => None,
        };
        if let Some((capset_max_version, capset_max_size)) = private {
            return Ok(Response::OkCapsetInfo {
                capset_id: id,
                capset_max_version,
                capset_max_size,
            });
        }
        let info = r.virgl.capset_info(id)?;
        Ok(Response::OkCapsetInfo {
            capset_id: id,
            capset_max_version: info.max_version,
            capset_max_size: info.max_size,
        })
    }

    /// GET_CAPSET.
    pub fn capset(&self, id: u32, version: u32, r: Renderer<'_>) -> Result<Response, ThreeDError> {
        if !CAPSETS.contains(&id) {
            return Err(ThreeDError::ContextCapset(id));
        }
        if id == VGPU_LOAD_CAPSET_ID {
            if version > LOAD_CAPSET_VERSION {
                return Err(ThreeDError::CapsetVersion(version));
            }
            return Ok(Response::OkCapset(load::capset_blob()));
        }
        if id == VGPU_COMPUTE_CAPSET_ID {
            if version > COMPUTE_CAPSET_VERSION {
                return Err(ThreeDError::CapsetVersion(version));
            }
            return Ok(Response::OkCapset(compute::capset_blob()));
        }
        Ok(Response::OkCapset(r.virgl.capset(id, version)?))
    }

    /// CTX_CREATE. context_init capset 20 makes a load context, 21 a compute context, kept
    /// here; 0 (no
    /// CONTEXT_INIT), 1 (VIRGL) and 2 (VIRGL2) make a virgl context. virglrenderer's
    /// `virgl_renderer_context_create` makes the same vrend context that
    /// `..._create_with_flags` makes for capsets 1 and 2, so the plain call serves all three.
    pub fn ctx_create(&mut self, c: &CtxCreate, r: Renderer<'_>) -> Result<Response, ThreeDError> {
        if c.ctx_id == 0
            || self.contexts.contains(&c.ctx_id)
            || self.private_contexts.contains_key(&c.ctx_id)
        {
            return Err(ThreeDError::ContextIdTaken(c.ctx_id));
        }
        let capset = c.capset_id();
        if capset != 0 && !CAPSETS.contains(&capset) {
            return Err(ThreeDError::ContextCapset(capset));
        }
        if self
            .contexts
            .len()
            .saturating_add(self.private_contexts.len())
            >= MAX_CONTEXTS
        {
            return Err(ThreeDError::Limit("3D contexts"));
        }
        let name = String::from_utf8_lossy(&c.debug_name);
        if capset == VGPU_LOAD_CAPSET_ID || capset == VGPU_COMPUTE_CAPSET_ID {
            self.private_contexts.insert(c.ctx_id, capset);
            debug!("capset {capset} context {} ({name}) created", c.ctx_id);
            return Ok(Response::OkNoData);
        }
        r.virgl.context_create(c.ctx_id, &name)?;
        self.contexts.insert(c.ctx_id);
        debug!("3D context {} ({name}) created", c.ctx_id);
        Ok(Response::OkNoData)
    }

    /// CTX_DESTROY.
    pub fn ctx_destroy(&mut self, ctx: u32, r: Renderer<'_>) -> Result<Response, ThreeDError> {
        if self.private_contexts.remove(&ctx).is_some() {
            // Its groups or requests already queued still run; their fences complete as usual.
            return Ok(Response::OkNoData);
        }
        if !self.contexts.remove(&ctx) {
            return Err(ThreeDError::UnknownContext(ctx));
        }
        r.virgl.context_destroy(ctx);
        Ok(Response::OkNoData)
    }

    fn context(&self, ctx: u32) -> Result<(), ThreeDError> {
        if self.contexts.contains(&ctx) {
            Ok(())
        } else {
            Err(ThreeDError::UnknownContext(ctx))
        }
    }

    /// CTX_ATTACH_RESOURCE / CTX_DETACH_RESOURCE.
    pub fn ctx_resource(
        &mut self,
        ctx: u32,
        res: u32,
        attach: bool,
        r: Renderer<'_>,
    ) -> Result<Response, ThreeDError> {
        if self.private_contexts.contains_key(&ctx) {
            // Linux attaches every buffer of a DRM file to its context; a load or compute
            // context keeps nothing (a compute submit names its blob itself).
            return Ok(Response::OkNoData);
        }
        self.context(ctx)?;
        if attach {
            r.virgl.ctx_attach_resource(ctx, res)?;
        } else {
            r.virgl.ctx_detach_resource(ctx, res)?;
        }
        Ok(Response::OkNoData)
    }

    /// RESOURCE_CREATE_3D; `taken` says whether a 2D resource already uses the id. The
    /// resource is charged [`resource_bytes`] to `budget`, the VM's; nothing reaches the
    /// renderer unless they fit.
    pub fn resource_create(
        &mut self,
        c: &ResourceCreate3d,
        taken: bool,
        budget: &Arc<MemoryBudget>,
        r: Renderer<'_>,
    ) -> Result<(), ThreeDError> {
        let id = c.resource_id;
        if id == 0 || taken || self.resources.contains_key(&id) {
            return Err(ThreeDError::ResourceIdTaken(id));
        }
        if self.resources.len() >= MAX_RESOURCES_3D {
            return Err(ThreeDError::Limit("3D resources"));
        }
        let bytes = resource_bytes(&c.args)?;
        let charge = budget.charge(bytes)?;
        r.virgl.resource_create(id, &c.args)?;
        let size = Size3d {
            width: c.args.width,
            height: c.args.height,
            format: c.args.format,
        };
        self.resources.insert(id, (size, charge));
        debug!(
            "3D resource {id}: {}x{} format {}, {bytes} bytes charged",
            c.args.width, c.args.height, c.args.format
        );
        Ok(())
    }

    /// RESOURCE_UNREF of a 3D resource.
    pub fn resource_unref(&mut self, id: u32, r: Renderer<'_>) -> Result<Response, ThreeDError> {
        self.resources.remove(&id);
        r.virgl.resource_unref(id)?;
        Ok(Response::OkNoData)
    }

    /// RESOURCE_ATTACH_BACKING of a 3D resource: its iovecs are charged to `budget`, the
    /// VM's, before they are made.
    pub fn attach_backing(
        &mut self,
        id: u32,
        entries: &[MemEntry],
        budget: &Arc<MemoryBudget>,
        r: Renderer<'_>,
    ) -> Result<Response, ThreeDError> {
        // At most MAX_BACKING_ENTRIES entries (the decoder's bound): no overflow.
        let charge = budget.charge(entries.len() as u64 * IOVEC_BYTES)?;
        let backing = GuestBacking::new(r.mem.clone(), entries, charge)?;
        r.virgl.attach_backing(id, Box::new(backing))?;
        Ok(Response::OkNoData)
    }

    /// RESOURCE_DETACH_BACKING of a 3D resource.
    pub fn detach_backing(&mut self, id: u32, r: Renderer<'_>) -> Result<Response, ThreeDError> {
        drop(r.virgl.detach_backing(id)?);
        Ok(Response::OkNoData)
    }

    /// TRANSFER_TO_HOST_3D (`to_host`) or TRANSFER_FROM_HOST_3D through the attached backing.
    pub fn transfer(
        &mut self,
        t: &Transfer3d,
        to_host: bool,
        r: Renderer<'_>,
    ) -> Result<Response, ThreeDError> {
        if t.ctx_id != 0 {
            self.context(t.ctx_id)?;
        }
        let size = self
            .resource(t.resource_id)
            .ok_or(ThreeDError::UnknownResource(t.resource_id))?;
        // Level 0 must hold the box (virglrenderer checks in 32-bit arithmetic and poisons the
        // context on failure); deeper levels are smaller and left to virglrenderer.
        let fits = |o: u32, l: u32, limit: u32| o.checked_add(l).is_some_and(|e| e <= limit);
        let b = t.transfer.region;
        // virglrenderer 0.10 sizes transfers in 32-bit arithmetic: products that would wrap
        // could pass its bounds check, so they are refused here.
        let fits_u32 = |a: u32, b: u32| u64::from(a) * u64::from(b) <= u64::from(u32::MAX);
        let (stride, layer_stride) = (t.transfer.stride, t.transfer.layer_stride);
        if !(fits_u32(stride, b.h) && fits_u32(layer_stride, b.d)) {
            return Err(ThreeDError::StridesTooLarge {
                stride,
                layer_stride,
                h: b.h,
                d: b.d,
            });
        }
        if t.transfer.level == 0 && !(fits(b.x, b.w, size.width) && fits(b.y, b.h, size.height)) {
            return Err(ThreeDError::BoxOutside {
                x: b.x,
                y: b.y,
                w: b.w,
                h: b.h,
                width: size.width,
                height: size.height,
            });
        }
        if to_host {
            r.virgl
                .transfer_write(t.resource_id, t.ctx_id, &t.transfer)?;
        } else {
            r.virgl
                .transfer_read(t.resource_id, t.ctx_id, &t.transfer)?;
        }
        Ok(Response::OkNoData)
    }

    /// SUBMIT_3D.
    pub fn submit(
        &mut self,
        ctx: u32,
        commands: &mut [u32],
        r: Renderer<'_>,
    ) -> Result<Response, ThreeDError> {
        self.context(ctx)?;
        if let Err(e) = r.virgl.submit(ctx, commands) {
            guest_fault!(
                "3D context {ctx}: command stream refused ({e}); the context stays in error"
            );
            return Err(e.into());
        }
        Ok(Response::OkNoData)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes() {
        assert_eq!(
            ThreeDError::UnknownContext(3).response_code(),
            ty::ERR_INVALID_CONTEXT_ID
        );
        assert_eq!(
            ThreeDError::CapsetIndex(2).response_code(),
            ty::ERR_INVALID_PARAMETER
        );
        assert_eq!(
            ThreeDError::Limit("x").response_code(),
            ty::ERR_OUT_OF_MEMORY
        );
    }

    #[test]
    fn backing_entries_must_lie_in_one_region() {
        let mem = Arc::new(
            GuestMemoryMmap::from_ranges(&[
                (GuestAddress(0), 0x10000),
                (GuestAddress(0x10000), 0x10000),
            ])
            .unwrap(),
        );
        let budget = MemoryBudget::new(1 << 20);
        let ok = GuestBacking::new(
            mem.clone(),
            &[MemEntry {
                addr: 0x1000,
                length: 0x2000,
            }],
            Charge::empty(&budget),
        )
        .unwrap();
        assert_eq!(ok.iovecs().len(), 1);
        assert_eq!(ok.iovecs()[0].iov_len, 0x2000);
        for (addr, length) in [(0xf000, 0x2000), (0x30000, 16), (u64::MAX - 4, 16)] {
            assert!(matches!(
                GuestBacking::new(
                    mem.clone(),
                    &[MemEntry { addr, length }],
                    Charge::empty(&budget)
                ),
                Err(ThreeDError::BadEntry { .. })
            ));
        }
    }

    #[test]
    fn reset_dooms_everything_for_the_worker() {
        let mut t = ThreeD::default();
        let budget = MemoryBudget::new(1 << 20);
        t.contexts.insert(1);
        let size = Size3d {
            width: 1,
            height: 1,
            format: 1,
        };
        t.resources.insert(5, (size, budget.charge(4).unwrap()));
        t.reset();
        assert!(t.resource(5).is_none());
        assert_eq!(budget.used(), 0, "its charge goes with it");
        assert_eq!((t.doomed_contexts.len(), t.doomed_resources.len()), (1, 1));
    }
}
