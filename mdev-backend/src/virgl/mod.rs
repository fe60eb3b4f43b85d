//! virglrenderer as a backend: the host renders guest OpenGL command streams with its own GL
//! (llvmpipe through surfaceless EGL when the host has no GPU).
//!
//! The library is loaded at run time (`libloading`), so the build needs no -dev package and a
//! newer virglrenderer can be chosen by name. virglrenderer keeps process-global state: it may
//! be initialised once per process, and every call must come from the thread that initialised
//! it. [`Virgl`] enforces both: it is neither `Send` nor `Sync`, and a second instance in the
//! same process is refused.

mod ffi;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use log::{debug, info};

pub use ffi::{BackingMemory, HostBacking, IntoAny, LoadError};

/// The library virglrenderer is loaded from by default (Debian's libvirglrenderer1).
pub const DEFAULT_LIBRARY: &str = "libvirglrenderer.so.1";
/// Capset id of VIRGL (version 1).
pub const CAPSET_VIRGL: u32 = 1;
/// Capset id of VIRGL2 (version 2).
pub const CAPSET_VIRGL2: u32 = 2;
/// Largest capset accepted from the library: virgl's capsets are a few hundred bytes to a few
/// KiB; anything larger means a broken library.
pub const MAX_CAPSET_SIZE: u32 = 64 * 1024;

/// Gallium target PIPE_BUFFER (p_defines.h).
pub const TARGET_BUFFER: u32 = 0;
/// Gallium target PIPE_TEXTURE_1D.
pub const TARGET_TEXTURE_1D: u32 = 1;
/// Gallium target PIPE_TEXTURE_2D.
pub const TARGET_TEXTURE_2D: u32 = 2;
/// Gallium target PIPE_TEXTURE_3D.
pub const TARGET_TEXTURE_3D: u32 = 3;
/// VIRGL_FORMAT_B8G8R8A8_UNORM (virgl_hw.h).
pub const FORMAT_B8G8R8A8_UNORM: u32 = 1;
/// VIRGL_FORMAT_B8G8R8X8_UNORM.
pub const FORMAT_B8G8R8X8_UNORM: u32 = 2;
/// VIRGL_FORMAT_R8G8B8A8_UNORM.
pub const FORMAT_R8G8B8A8_UNORM: u32 = 67;
/// VIRGL_BIND_DEPTH_STENCIL (virgl_hw.h, same bits as PIPE_BIND_*).
pub const BIND_DEPTH_STENCIL: u32 = 1 << 0;
/// VIRGL_BIND_RENDER_TARGET.
pub const BIND_RENDER_TARGET: u32 = 1 << 1;
/// VIRGL_BIND_SAMPLER_VIEW.
pub const BIND_SAMPLER_VIEW: u32 = 1 << 3;
/// VIRGL_BIND_VERTEX_BUFFER.
pub const BIND_VERTEX_BUFFER: u32 = 1 << 4;
/// VIRGL_BIND_DISPLAY_TARGET.
pub const BIND_DISPLAY_TARGET: u32 = 1 << 7;
/// VIRGL_BIND_SCANOUT.
pub const BIND_SCANOUT: u32 = 1 << 18;

static INITIALISED: AtomicBool = AtomicBool::new(false);

/// Errors of the virgl backend.
#[derive(Debug, thiserror::Error)]
pub enum VirglError {
    /// The library could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Another `Virgl` was created in this process.
    #[error("virglrenderer is already initialised in this process")]
    AlreadyInitialised,
    /// virgl_renderer_init failed.
    #[error("virgl_renderer_init failed ({0})")]
    Init(i32),
    /// A capset id the library does not know, or an absurd size.
    #[error("capset {id}: version {version}, size {size}")]
    BadCapset {
        /// Capset id.
        id: u32,
        /// Version reported.
        version: u32,
        /// Size reported.
        size: u32,
    },
    /// A renderer call failed with an errno-style code. virglrenderer 0.10 mostly returns
    /// positive errno values (EINVAL = 22), a few negative ones; refusals of the binding
    /// itself are negative (-EBUSY, -EINVAL).
    #[error("{call} failed ({code})")]
    Call {
        /// The call.
        call: &'static str,
        /// Its return value.
        code: i32,
    },
    /// Resource id 0 is reserved.
    #[error("resource id 0 is invalid")]
    InvalidResourceId,
    /// Context id 0 is reserved.
    #[error("context id 0 is invalid")]
    InvalidContextId,
    /// The resource id is in use.
    #[error("resource {0} already exists")]
    ResourceExists(u32),
    /// No resource with this id was created through this renderer.
    #[error("unknown resource {0}")]
    UnknownResource(u32),
    /// No context with this id was created through this renderer.
    #[error("unknown context {0}")]
    UnknownContext(u32),
    /// The resource is not attached to the context.
    #[error("resource {res} is not attached to context {ctx}")]
    NotAttached {
        /// Context id.
        ctx: u32,
        /// Resource id.
        res: u32,
    },
    /// The resource already has backing memory.
    #[error("resource {0} already has backing memory")]
    BackingAttached(u32),
    /// The resource has no backing memory.
    #[error("resource {0} has no backing memory")]
    NoBacking(u32),
    /// Backing memory that cannot be handed to virglrenderer.
    #[error("invalid backing: {0}")]
    InvalidBacking(&'static str),
    /// A transfer that cannot be handed to virglrenderer.
    #[error("invalid transfer: {0}")]
    InvalidTransfer(&'static str),
}

/// Fences signalled by virglrenderer, written by the callback during [`Virgl::poll`]. Fences
/// are mergeable: the newest signalled fence completes every earlier one.
#[derive(Debug, Default)]
pub(crate) struct FenceLog {
    last: Cell<Option<u32>>,
}

impl FenceLog {
    fn signal(&self, fence: u32) {
        self.last.set(Some(fence));
    }
}

/// Capset description as virtio-gpu's GET_CAPSET_INFO reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapsetInfo {
    /// Capset id.
    pub id: u32,
    /// Highest version.
    pub max_version: u32,
    /// Size in bytes.
    pub max_size: u32,
}

/// The parameters of a 3D resource (virtio_gpu_resource_create_3d without the id).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceCreate3d {
    /// Gallium target ([`TARGET_TEXTURE_2D`], ...).
    pub target: u32,
    /// VIRGL_FORMAT_* ([`FORMAT_B8G8R8A8_UNORM`], ...).
    pub format: u32,
    /// VIRGL_BIND_* flags ([`BIND_RENDER_TARGET`], ...).
    pub bind: u32,
    /// Width in pixels (bytes for buffers).
    pub width: u32,
    /// Height.
    pub height: u32,
    /// Depth.
    pub depth: u32,
    /// Array size.
    pub array_size: u32,
    /// Last mipmap level.
    pub last_level: u32,
    /// Samples.
    pub nr_samples: u32,
    /// Flags (bit 0: Y_0_TOP).
    pub flags: u32,
}

/// A region of a resource (virtio_gpu_box / virgl_box).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferBox {
    /// Origin.
    pub x: u32,
    /// Origin.
    pub y: u32,
    /// Origin (layer or slice).
    pub z: u32,
    /// Width.
    pub w: u32,
    /// Height.
    pub h: u32,
    /// Depth (layers or slices); 1 for 2D.
    pub d: u32,
}

/// A transfer between a resource and its backing (or a host buffer), as in
/// virtio_gpu_transfer_host_3d.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transfer {
    /// Mipmap level.
    pub level: u32,
    /// Row stride in the backing; 0 for the level's natural stride.
    pub stride: u32,
    /// Layer stride in the backing; 0 for the natural one.
    pub layer_stride: u32,
    /// The region of the resource.
    pub region: TransferBox,
    /// Byte offset into the backing.
    pub offset: u64,
}

impl Transfer {
    /// The whole of a `width` x `height` level 0 of a 2D resource, natural strides, offset 0.
    pub fn whole_2d(width: u32, height: u32) -> Transfer {
        Transfer {
            region: TransferBox {
                w: width,
                h: height,
                d: 1,
                ..TransferBox::default()
            },
            ..Transfer::default()
        }
    }

    fn to_ffi(self) -> ffi::TransferArgs {
        let r = self.region;
        ffi::TransferArgs {
            level: self.level,
            stride: self.stride,
            layer_stride: self.layer_stride,
            region: ffi::VirglBox {
                x: r.x,
                y: r.y,
                z: r.z,
                w: r.w,
                h: r.h,
                d: r.d,
            },
            offset: self.offset,
        }
    }
}

/// Ids 0 are reserved for resources.
fn check_resource_id(res_id: u32) -> Result<(), VirglError> {
    if res_id == 0 {
        return Err(VirglError::InvalidResourceId);
    }
    Ok(())
}

/// Whether `v` fits C's int.
fn fits_c_int(v: u32) -> bool {
    c_int::try_from(v).is_ok()
}

/// Checks what virglrenderer reads as ints: level and box, including `origin + extent` (which
/// it adds in int). Bounds against the resource are virglrenderer's job (it knows the
/// resource and checks them).
pub(crate) fn check_transfer(t: &ffi::TransferArgs) -> Result<(), VirglError> {
    let b = &t.region;
    if !fits_c_int(t.level) {
        return Err(VirglError::InvalidTransfer("level does not fit an int"));
    }
    for (origin, extent) in [(b.x, b.w), (b.y, b.h), (b.z, b.d)] {
        let end = origin.saturating_add(extent);
        if !fits_c_int(origin) || !fits_c_int(extent) || !fits_c_int(end) {
            return Err(VirglError::InvalidTransfer("box does not fit an int"));
        }
    }
    Ok(())
}

/// Checks iovecs before they are handed to virglrenderer: at least one, a count that fits
/// C's int, no null base with a length, and a total that fits u64. Returns the total size.
fn check_iovecs(iovecs: &[libc::iovec]) -> Result<u64, VirglError> {
    if iovecs.is_empty() {
        return Err(VirglError::InvalidBacking("no memory"));
    }
    if c_int::try_from(iovecs.len()).is_err() {
        return Err(VirglError::InvalidBacking("more iovecs than an int counts"));
    }
    let mut total = 0u64;
    for iov in iovecs {
        if iov.iov_base.is_null() && iov.iov_len != 0 {
            return Err(VirglError::InvalidBacking("null iovec base"));
        }
        total = total
            .checked_add(iov.iov_len as u64)
            .ok_or(VirglError::InvalidBacking("total size overflows"))?;
    }
    Ok(total)
}

/// Maps a virglrenderer return value to a result.
fn call_result(call: &'static str, code: c_int) -> Result<(), VirglError> {
    match code {
        0 => Ok(()),
        code => Err(VirglError::Call { call, code }),
    }
}

/// An initialised virglrenderer, bound to the thread that created it.
///
/// It keeps track of the contexts and resources created through it (with the contexts each
/// resource is attached to) and owns the backing memory attached to resources until
/// virglrenderer has let go of it; dropping it unreferences every resource and destroys every
/// context before `virgl_renderer_cleanup`.
#[derive(Debug)]
pub struct Virgl {
    api: ffi::Api,
    contexts: RefCell<BTreeSet<u32>>,
    /// Resource id -> contexts it is attached to.
    resources: RefCell<BTreeMap<u32, BTreeSet<u32>>>,
    fences: Box<FenceLog>,
    /// virglrenderer keeps a pointer to the callback table until cleanup.
    _callbacks: Box<ffi::Callbacks>,
    _single_thread: PhantomData<*const ()>,
}

/// The host API virglrenderer renders with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HostGl {
    /// Desktop OpenGL (a core profile), as QEMU's virtio-gpu-gl renders: guests' desktop-GL
    /// features (edge flags, logic ops, double vertex attributes, 1D textures with borders)
    /// run natively: 43 of the 44 piglit tests that failed through our device on GLES and
    /// passed on QEMU's pass on it (docs/PERFORMANCE.md).
    #[default]
    Gl,
    /// OpenGL ES: for hosts whose driver offers only GLES. virglrenderer emulates or lacks
    /// the desktop-only features there (piglit: 935 of the 1078 pass).
    Gles,
}

impl std::str::FromStr for HostGl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "gl" => Ok(HostGl::Gl),
            "gles" => Ok(HostGl::Gles),
            other => Err(format!("{other:?} is not gl or gles")),
        }
    }
}

impl std::fmt::Display for HostGl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HostGl::Gl => "desktop GL",
            HostGl::Gles => "GLES",
        })
    }
}

impl Virgl {
    /// Loads `library` and initialises it for surfaceless EGL with `api`, fences signalled
    /// through a poll fd (no polling loop).
    pub fn new(library: &str, api_kind: HostGl) -> Result<Virgl, VirglError> {
        let api = ffi::Api::load(library)?;
        if INITIALISED.swap(true, Ordering::SeqCst) {
            return Err(VirglError::AlreadyInitialised);
        }
        let fences = Box::new(FenceLog::default());
        let mut callbacks = Box::new(ffi::Callbacks {
            version: 1,
            write_fence: Some(ffi::write_fence),
            create_gl_context: None,
            destroy_gl_context: None,
            make_current: None,
        });
        let mut flags = ffi::USE_EGL | ffi::USE_SURFACELESS | ffi::THREAD_SYNC;
        if api_kind == HostGl::Gles {
            flags |= ffi::USE_GLES;
        }
        let cookie = &*fences as *const FenceLog as *mut c_void;
        let rc = api.init(cookie, flags, &mut callbacks);
        if rc != 0 {
            return Err(VirglError::Init(rc));
        }
        info!("virglrenderer initialised from {library} (surfaceless EGL, {api_kind})");
        Ok(Virgl {
            api,
            contexts: RefCell::default(),
            resources: RefCell::default(),
            fences,
            _callbacks: callbacks,
            _single_thread: PhantomData,
        })
    }

    /// The fd that becomes readable when fences may have signalled (for epoll).
    pub fn poll_fd(&self) -> Option<RawFd> {
        let fd = self.api.poll_fd();
        (fd >= 0).then_some(fd)
    }

    /// Runs the fence callbacks and returns the newest fence signalled since the last call.
    pub fn poll(&self) -> Option<u32> {
        self.api.poll();
        self.fences.last.take()
    }

    /// Version and size of capset `id`.
    pub fn capset_info(&self, id: u32) -> Result<CapsetInfo, VirglError> {
        let (max_version, max_size) = self.api.cap_set(id);
        if max_version == 0 || max_size == 0 || max_size > MAX_CAPSET_SIZE {
            return Err(VirglError::BadCapset {
                id,
                version: max_version,
                size: max_size,
            });
        }
        Ok(CapsetInfo {
            id,
            max_version,
            max_size,
        })
    }

    /// The capset `id` at `version`.
    pub fn capset(&self, id: u32, version: u32) -> Result<Vec<u8>, VirglError> {
        let info = self.capset_info(id)?;
        // Version 0 is what Mesa asks for (virglrenderer fills the newest); above the maximum
        // is refused.
        if version > info.max_version {
            return Err(VirglError::BadCapset {
                id,
                version,
                size: info.max_size,
            });
        }
        let mut out = vec![0u8; info.max_size as usize];
        self.api.fill_caps(id, version, &mut out, info.max_size);
        Ok(out)
    }

    /// Creates 3D context `ctx_id` (ids are chosen by the guest; 0 is invalid).
    pub fn context_create(&self, ctx_id: u32, name: &str) -> Result<(), VirglError> {
        call_result(
            "virgl_renderer_context_create",
            self.api.context_create(ctx_id, name.as_bytes()),
        )?;
        self.contexts.borrow_mut().insert(ctx_id);
        Ok(())
    }

    /// Destroys 3D context `ctx_id` (which detaches its resources).
    pub fn context_destroy(&self, ctx_id: u32) {
        self.api.context_destroy(ctx_id);
        self.contexts.borrow_mut().remove(&ctx_id);
        for attached in self.resources.borrow_mut().values_mut() {
            attached.remove(&ctx_id);
        }
    }

    /// Creates 3D resource `res_id` without backing memory.
    pub fn resource_create(&self, res_id: u32, args: &ResourceCreate3d) -> Result<(), VirglError> {
        check_resource_id(res_id)?;
        if self.resources.borrow().contains_key(&res_id) {
            // virglrenderer would replace the resource in its table while we hold its backing.
            return Err(VirglError::ResourceExists(res_id));
        }
        let raw = ffi::ResourceCreateArgs {
            handle: res_id,
            target: args.target,
            format: args.format,
            bind: args.bind,
            width: args.width,
            height: args.height,
            depth: args.depth,
            array_size: args.array_size,
            last_level: args.last_level,
            nr_samples: args.nr_samples,
            flags: args.flags,
        };
        call_result(
            "virgl_renderer_resource_create",
            self.api.resource_create(&raw),
        )?;
        self.resources.borrow_mut().insert(res_id, BTreeSet::new());
        debug!("virgl resource {res_id} created: {args:?}");
        Ok(())
    }

    /// Unreferences resource `res_id`: detaches its backing (dropped afterwards), detaches it
    /// from every context and destroys it.
    pub fn resource_unref(&self, res_id: u32) -> Result<(), VirglError> {
        check_resource_id(res_id)?;
        if self.resources.borrow_mut().remove(&res_id).is_none() {
            return Err(VirglError::UnknownResource(res_id));
        }
        drop(self.api.resource_unref(res_id));
        Ok(())
    }

    /// Whether resource `res_id` exists (was created through this renderer, not unref'd).
    pub fn has_resource(&self, res_id: u32) -> bool {
        self.resources.borrow().contains_key(&res_id)
    }

    /// Makes resource `res_id` visible to context `ctx_id`'s command streams and transfers.
    pub fn ctx_attach_resource(&self, ctx_id: u32, res_id: u32) -> Result<(), VirglError> {
        self.check_ctx_and_resource(ctx_id, res_id)?;
        self.api.ctx_attach_resource(ctx_id, res_id);
        if let Some(attached) = self.resources.borrow_mut().get_mut(&res_id) {
            attached.insert(ctx_id);
        }
        Ok(())
    }

    /// Undoes [`Virgl::ctx_attach_resource`].
    pub fn ctx_detach_resource(&self, ctx_id: u32, res_id: u32) -> Result<(), VirglError> {
        self.check_ctx_and_resource(ctx_id, res_id)?;
        let was_attached = self
            .resources
            .borrow_mut()
            .get_mut(&res_id)
            .is_some_and(|attached| attached.remove(&ctx_id));
        if !was_attached {
            return Err(VirglError::NotAttached {
                ctx: ctx_id,
                res: res_id,
            });
        }
        self.api.ctx_detach_resource(ctx_id, res_id);
        Ok(())
    }

    fn check_ctx_and_resource(&self, ctx_id: u32, res_id: u32) -> Result<(), VirglError> {
        if ctx_id == 0 {
            return Err(VirglError::InvalidContextId);
        }
        check_resource_id(res_id)?;
        if !self.contexts.borrow().contains(&ctx_id) {
            return Err(VirglError::UnknownContext(ctx_id));
        }
        if !self.resources.borrow().contains_key(&res_id) {
            return Err(VirglError::UnknownResource(res_id));
        }
        Ok(())
    }

    /// Attaches `backing` as the memory of resource `res_id`. The renderer owns it until
    /// [`Virgl::detach_backing`] gives it back, or drops it after unref or cleanup:
    /// virglrenderer reads and writes it through raw pointers in between.
    ///
    /// The resource id is not checked here but by virglrenderer (an unknown id fails with its
    /// EINVAL); on failure the backing is dropped.
    pub fn attach_backing(
        &self,
        res_id: u32,
        backing: Box<dyn BackingMemory>,
    ) -> Result<(), VirglError> {
        check_resource_id(res_id)?;
        if self.api.has_backing(res_id) {
            return Err(VirglError::BackingAttached(res_id));
        }
        let size = check_iovecs(backing.iovecs())?;
        call_result(
            "virgl_renderer_resource_attach_iov",
            self.api.resource_attach_iov(res_id, backing),
        )?;
        debug!("virgl resource {res_id}: {size} bytes of backing attached");
        Ok(())
    }

    /// Detaches the backing of resource `res_id` and gives it back (downcast it with
    /// [`IntoAny::into_any`]).
    pub fn detach_backing(&self, res_id: u32) -> Result<Box<dyn BackingMemory>, VirglError> {
        check_resource_id(res_id)?;
        self.api
            .resource_detach_iov(res_id)
            .ok_or(VirglError::NoBacking(res_id))
    }

    /// Whether resource `res_id` has backing memory attached.
    pub fn has_backing(&self, res_id: u32) -> bool {
        self.api.has_backing(res_id)
    }

    /// Copies `t` from the attached backing into resource `res_id`
    /// (virgl_renderer_transfer_write_iov with no iovecs). `ctx_id` 0 uses virglrenderer's
    /// own context; any other context must have the resource attached.
    pub fn transfer_write(&self, res_id: u32, ctx_id: u32, t: &Transfer) -> Result<(), VirglError> {
        self.transfer(ffi::Direction::ToHost, res_id, ctx_id, t, None)
    }

    /// Copies `t` from resource `res_id` into the attached backing
    /// (virgl_renderer_transfer_read_iov with no iovecs).
    pub fn transfer_read(&self, res_id: u32, ctx_id: u32, t: &Transfer) -> Result<(), VirglError> {
        self.transfer(ffi::Direction::FromHost, res_id, ctx_id, t, None)
    }

    /// Copies `t` from `src` (as if it were the backing) into resource `res_id`. `src` is
    /// mutable because virglrenderer 0.10 may modify it: on GLES hosts that emulate BGRA it
    /// swizzles single-iovec uploads in place (not observed with Mesa 22.3 llvmpipe).
    pub fn transfer_write_from(
        &self,
        res_id: u32,
        ctx_id: u32,
        t: &Transfer,
        src: &mut [u8],
    ) -> Result<(), VirglError> {
        self.transfer(ffi::Direction::ToHost, res_id, ctx_id, t, Some(src))
    }

    /// Copies `t` from resource `res_id` into `dst` (as if it were the backing), e.g. a
    /// scanout read back into a dump frame.
    pub fn transfer_read_into(
        &self,
        res_id: u32,
        ctx_id: u32,
        t: &Transfer,
        dst: &mut [u8],
    ) -> Result<(), VirglError> {
        self.transfer(ffi::Direction::FromHost, res_id, ctx_id, t, Some(dst))
    }

    fn transfer(
        &self,
        dir: ffi::Direction,
        res_id: u32,
        ctx_id: u32,
        t: &Transfer,
        buffer: Option<&mut [u8]>,
    ) -> Result<(), VirglError> {
        let args = t.to_ffi();
        check_transfer(&args)?;
        let call = match dir {
            ffi::Direction::ToHost => "virgl_renderer_transfer_write_iov",
            ffi::Direction::FromHost => "virgl_renderer_transfer_read_iov",
        };
        call_result(call, self.api.transfer(dir, res_id, ctx_id, &args, buffer))
    }

    /// Decodes and executes a virgl command stream in context `ctx_id`.
    pub fn submit(&self, ctx_id: u32, commands: &mut [u32]) -> Result<(), VirglError> {
        match self.api.submit_cmd(commands, ctx_id) {
            0 => Ok(()),
            code => Err(VirglError::Call {
                call: "virgl_renderer_submit_cmd",
                code,
            }),
        }
    }

    /// Queues fence `fence` after the work submitted so far in context `ctx_id`.
    pub fn create_fence(&self, fence: u32, ctx_id: u32) -> Result<(), VirglError> {
        match self.api.create_fence(fence, ctx_id) {
            0 => Ok(()),
            code => Err(VirglError::Call {
                call: "virgl_renderer_create_fence",
                code,
            }),
        }
    }
}

impl Drop for Virgl {
    fn drop(&mut self) {
        // Unref (which detaches backings first) every resource, including any the api holds a
        // backing for without our knowing it, then destroy the contexts; the backings are
        // dropped as each unref returns, once virglrenderer has let go of them.
        let mut ids: BTreeSet<u32> = self.resources.take().into_keys().collect();
        ids.extend(self.api.backed_resources());
        for res_id in ids {
            drop(self.api.resource_unref(res_id));
        }
        for ctx_id in self.contexts.take() {
            self.api.context_destroy(ctx_id);
        }
        let cookie = &*self.fences as *const FenceLog as *mut c_void;
        // The boxed callbacks and fence log are freed after this, once virglrenderer has let
        // go of them.
        self.api.cleanup(cookie);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transfer(region: TransferBox) -> ffi::TransferArgs {
        Transfer {
            region,
            ..Transfer::default()
        }
        .to_ffi()
    }

    #[test]
    fn resource_id_zero_is_invalid() {
        assert!(matches!(
            check_resource_id(0),
            Err(VirglError::InvalidResourceId)
        ));
        assert!(check_resource_id(1).is_ok());
        assert!(check_resource_id(u32::MAX).is_ok());
    }

    #[test]
    fn boxes_must_fit_c_int() {
        let ok = TransferBox {
            x: 1,
            y: 2,
            z: 0,
            w: 63,
            h: 62,
            d: 1,
        };
        assert!(check_transfer(&transfer(ok)).is_ok());
        let max = i32::MAX as u32;
        assert!(check_transfer(&transfer(TransferBox { x: max, w: 0, ..ok })).is_ok());
        for bad in [
            TransferBox { x: max + 1, ..ok },
            TransferBox { w: u32::MAX, ..ok },
            TransferBox { y: max, h: 1, ..ok },
            TransferBox { z: 1, d: max, ..ok },
            TransferBox {
                x: u32::MAX,
                w: u32::MAX,
                ..ok
            },
        ] {
            assert!(
                matches!(
                    check_transfer(&transfer(bad)),
                    Err(VirglError::InvalidTransfer(_))
                ),
                "{bad:?}"
            );
        }
        let mut level = transfer(ok);
        level.level = max + 1;
        assert!(check_transfer(&level).is_err());
        assert_eq!(
            Transfer::whole_2d(64, 32).region,
            TransferBox {
                x: 0,
                y: 0,
                z: 0,
                w: 64,
                h: 32,
                d: 1
            }
        );
    }

    #[test]
    fn iovecs_are_checked() {
        assert!(matches!(
            check_iovecs(&[]),
            Err(VirglError::InvalidBacking(_))
        ));
        let host = HostBacking::zeroed(&[16, 0, 4]);
        assert_eq!(check_iovecs(host.iovecs()).unwrap(), 20);
        let null = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 8,
        };
        assert!(check_iovecs(&[null]).is_err());
        let empty_null = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        assert_eq!(check_iovecs(&[empty_null]).unwrap(), 0);
    }

    #[test]
    fn host_backing_iovecs_point_into_its_buffers() {
        let host = HostBacking::new(vec![vec![1u8, 2, 3].into(), vec![4u8; 5].into()]);
        let iovs = host.iovecs();
        assert_eq!(iovs.len(), 2);
        for (iov, buf) in iovs.iter().zip(host.buffers()) {
            assert_eq!(iov.iov_base.cast_const().cast::<u8>(), buf.as_ptr());
            assert_eq!(iov.iov_len, buf.len());
        }
        assert_eq!(host.to_vec(), [1, 2, 3, 4, 4, 4, 4, 4]);
        // Moving the backing (as into a Box) keeps the addresses.
        let before = iovs[1].iov_base;
        let boxed: Box<dyn BackingMemory> = Box::new(host);
        assert_eq!(boxed.iovecs()[1].iov_base, before);
        let back = boxed.into_any().downcast::<HostBacking>().unwrap();
        assert_eq!(back.into_buffers().len(), 2);
    }

    #[test]
    fn call_results_map_codes() {
        assert!(call_result("x", 0).is_ok());
        assert!(matches!(
            call_result("x", libc::EINVAL),
            Err(VirglError::Call {
                call: "x",
                code: 22
            })
        ));
    }
}
