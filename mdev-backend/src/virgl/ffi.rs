//! The raw virglrenderer ABI (virglrenderer.h, unchanged since 0.8) and its run-time loader.
//! All unsafe code of this crate lives in this file.
//!
//! Backing memory: virglrenderer keeps the iovec array given to
//! `virgl_renderer_resource_attach_iov`, and the memory it describes, until the backing is
//! detached or the resource unreferenced, and reads or writes that memory whenever a transfer
//! or a command stream asks for it. [`Api`] therefore takes ownership of the backing
//! ([`BackingMemory`]) on attach and gives it back (or drops it) only after virglrenderer has
//! let go of it, so that no safe caller can make those pointers dangle.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::ptr;

use libc::iovec;
use libloading::Library;
use log::warn;

/// VIRGL_RENDERER_USE_EGL: virglrenderer makes its own EGL contexts.
pub const USE_EGL: c_int = 1 << 0;
/// VIRGL_RENDERER_THREAD_SYNC: a sync thread signals fences through the poll fd.
pub const THREAD_SYNC: c_int = 1 << 1;
/// VIRGL_RENDERER_USE_SURFACELESS: EGL without a window system.
pub const USE_SURFACELESS: c_int = 1 << 3;
/// VIRGL_RENDERER_USE_GLES: GLES instead of desktop GL on the host.
pub const USE_GLES: c_int = 1 << 4;

/// struct virgl_renderer_callbacks, version 1 (fence callback; GL context callbacks unused
/// with USE_EGL).
#[repr(C)]
#[derive(Debug)]
pub struct Callbacks {
    /// Callbacks version.
    pub version: c_int,
    /// Called from `virgl_renderer_poll` for each signalled fence.
    pub write_fence: Option<unsafe extern "C" fn(cookie: *mut c_void, fence: u32)>,
    /// Unused with USE_EGL.
    pub create_gl_context:
        Option<unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> *mut c_void>,
    /// Unused with USE_EGL.
    pub destroy_gl_context: Option<unsafe extern "C" fn(*mut c_void, *mut c_void)>,
    /// Unused with USE_EGL.
    pub make_current: Option<unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> c_int>,
}

type InitFn = unsafe extern "C" fn(*mut c_void, c_int, *mut Callbacks) -> c_int;
type VoidFn = unsafe extern "C" fn();
type PollFdFn = unsafe extern "C" fn() -> c_int;
type GetCapSetFn = unsafe extern "C" fn(u32, *mut u32, *mut u32);
type FillCapsFn = unsafe extern "C" fn(u32, u32, *mut c_void);
type ContextCreateFn = unsafe extern "C" fn(u32, u32, *const c_char) -> c_int;
type ContextDestroyFn = unsafe extern "C" fn(u32);
type CreateFenceFn = unsafe extern "C" fn(c_int, u32) -> c_int;
type SubmitCmdFn = unsafe extern "C" fn(*mut c_void, c_int, c_int) -> c_int;
type CleanupFn = unsafe extern "C" fn(*mut c_void);
type ResourceCreateFn = unsafe extern "C" fn(*mut ResourceCreateArgs, *mut iovec, u32) -> c_int;
type ResourceUnrefFn = unsafe extern "C" fn(u32);
type CtxResourceFn = unsafe extern "C" fn(c_int, c_int);
type AttachIovFn = unsafe extern "C" fn(c_int, *mut iovec, c_int) -> c_int;
type DetachIovFn = unsafe extern "C" fn(c_int, *mut *mut iovec, *mut c_int);
type TransferWriteFn = unsafe extern "C" fn(
    u32,
    u32,
    c_int,
    u32,
    u32,
    *mut VirglBox,
    u64,
    *mut iovec,
    c_uint,
) -> c_int;
type TransferReadFn =
    unsafe extern "C" fn(u32, u32, u32, u32, u32, *mut VirglBox, u64, *mut iovec, c_int) -> c_int;

/// struct virgl_renderer_resource_create_args.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ResourceCreateArgs {
    /// Resource id (non-zero).
    pub handle: u32,
    /// Gallium texture target (PIPE_BUFFER, PIPE_TEXTURE_2D, ...).
    pub target: u32,
    /// VIRGL_FORMAT_*.
    pub format: u32,
    /// VIRGL_BIND_* flags.
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
    /// VIRGL_RESOURCE_FLAG_*.
    pub flags: u32,
}

/// struct virgl_box (virgl_hw.h); virglrenderer reads it as a gallium `pipe_box` of `int`s.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct VirglBox {
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
    /// Depth (layers or slices).
    pub d: u32,
}

/// The parameters common to `virgl_renderer_transfer_{read,write}_iov`.
#[derive(Debug, Clone, Copy, Default)]
pub struct TransferArgs {
    /// Mipmap level.
    pub level: u32,
    /// Row stride in the backing (0: the level's natural stride).
    pub stride: u32,
    /// Layer stride in the backing (0: natural).
    pub layer_stride: u32,
    /// The region of the resource.
    pub region: VirglBox,
    /// Byte offset into the backing.
    pub offset: u64,
}

/// Which way a transfer copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Backing (or buffer) into the resource: `transfer_write_iov`.
    ToHost,
    /// Resource into the backing (or buffer): `transfer_read_iov`.
    FromHost,
}

/// Conversion of a boxed value into `Box<dyn Any>`, implemented for every `'static` type, so
/// that a backing given back by detach can be downcast to its concrete type.
pub trait IntoAny: Any {
    /// `self` as `Box<dyn Any>`.
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<T: Any> IntoAny for T {
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// Memory that virglrenderer may use as a resource's backing, through raw pointers, for as
/// long as it is attached.
///
/// # Safety
///
/// Implementors guarantee, for as long as the value lives (it is owned by the renderer while
/// attached and dropped or given back only after virglrenderer has let go of it):
/// - every iovec returned by [`BackingMemory::iovecs`] describes memory that is valid for
///   reads and writes of `iov_len` bytes from `iov_base` (a null `iov_base` only with
///   `iov_len` 0);
/// - that memory does not move or get unmapped, also when the value itself is moved;
/// - no Rust reference to that memory is used while the value is attached: virglrenderer
///   writes it behind any reference's back (memory that another party, such as a guest,
///   writes concurrently is fine as long as Rust code only accesses it through raw pointers
///   or volatile accesses).
///
/// The array returned may change between calls; the renderer copies it on attach.
pub unsafe trait BackingMemory: IntoAny {
    /// The memory, as iovecs in the order virglrenderer sees them as one linear backing.
    fn iovecs(&self) -> &[iovec];
}

/// Host memory owned by the backing: one iovec per boxed slice.
pub struct HostBacking {
    buffers: Vec<Box<[u8]>>,
    iovecs: Vec<iovec>,
}

impl std::fmt::Debug for HostBacking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let lens: Vec<usize> = self.buffers.iter().map(|b| b.len()).collect();
        f.debug_struct("HostBacking").field("lens", &lens).finish()
    }
}

impl HostBacking {
    /// A backing made of `buffers`, in order.
    pub fn new(mut buffers: Vec<Box<[u8]>>) -> HostBacking {
        let iovecs = buffers
            .iter_mut()
            .map(|b| iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        HostBacking { buffers, iovecs }
    }

    /// A zero-filled backing of one buffer per entry of `lens`.
    pub fn zeroed(lens: &[usize]) -> HostBacking {
        HostBacking::new(lens.iter().map(|&n| vec![0u8; n].into()).collect())
    }

    /// The buffers (read-only: their addresses were handed out as iovecs).
    pub fn buffers(&self) -> &[Box<[u8]>] {
        &self.buffers
    }

    /// The contents of all buffers, concatenated.
    pub fn to_vec(&self) -> Vec<u8> {
        self.buffers.concat()
    }

    /// The buffers, giving up the backing.
    pub fn into_buffers(self) -> Vec<Box<[u8]>> {
        self.buffers
    }
}

// SAFETY: the iovecs point into the boxed slices this value owns: valid for reads and writes
// of their whole length, not moved when the value (or the Vec holding the boxes, which is never
// grown) moves, and freed only when the value drops. The only access Rust code gets to them is
// through `&self` (`buffers`, `to_vec`), which needs the value back, i.e. detached, or
// `into_buffers`, which consumes it.
unsafe impl BackingMemory for HostBacking {
    fn iovecs(&self) -> &[iovec] {
        &self.iovecs
    }
}

/// A backing held for virglrenderer: the iovec array it was given (its heap buffer does not
/// move while the map rehashes) and the owner of the memory those iovecs describe.
struct Attached {
    iovecs: Vec<iovec>,
    backing: Box<dyn BackingMemory>,
}

/// Errors loading the library.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// dlopen failed.
    #[error("loading {name}: {source}")]
    Open {
        /// Library name.
        name: String,
        /// The loader's error.
        #[source]
        source: libloading::Error,
    },
    /// A symbol is missing.
    #[error("{name} lacks {symbol}: {source}")]
    Symbol {
        /// Library name.
        name: String,
        /// Symbol name.
        symbol: &'static str,
        /// The loader's error.
        #[source]
        source: libloading::Error,
    },
}

/// The entry points of a loaded virglrenderer, valid as long as this value lives.
pub struct Api {
    init: InitFn,
    poll: VoidFn,
    get_poll_fd: PollFdFn,
    get_cap_set: GetCapSetFn,
    fill_caps: FillCapsFn,
    context_create: ContextCreateFn,
    context_destroy: ContextDestroyFn,
    create_fence: CreateFenceFn,
    submit_cmd: SubmitCmdFn,
    cleanup: CleanupFn,
    resource_create: ResourceCreateFn,
    resource_unref: ResourceUnrefFn,
    ctx_attach_resource: CtxResourceFn,
    ctx_detach_resource: CtxResourceFn,
    attach_iov: AttachIovFn,
    detach_iov: DetachIovFn,
    transfer_write: TransferWriteFn,
    transfer_read: TransferReadFn,
    /// Backings virglrenderer holds pointers into, by resource id. Dropped only after detach,
    /// unref or cleanup.
    attached: RefCell<HashMap<u32, Attached>>,
    _lib: Library,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api").finish_non_exhaustive()
    }
}

impl Api {
    /// dlopens `name` (e.g. `libvirglrenderer.so.1`) and resolves the entry points.
    pub fn load(name: &str) -> Result<Api, LoadError> {
        // SAFETY: loading virglrenderer runs its ELF constructors, which only initialise the
        // library's own state; the library is not unloaded while `Api` holds it.
        let lib = unsafe { Library::new(name) }.map_err(|source| LoadError::Open {
            name: name.into(),
            source,
        })?;
        macro_rules! sym {
            ($ty:ty, $symbol:literal) => {{
                // SAFETY: the symbol has the C signature `$ty` in virglrenderer.h; the copied
                // function pointer stays valid because `_lib` is kept alive with it.
                let f = unsafe { lib.get::<$ty>($symbol.as_bytes()) };
                *f.map_err(|source| LoadError::Symbol {
                    name: name.into(),
                    symbol: $symbol,
                    source,
                })?
            }};
        }
        Ok(Api {
            init: sym!(InitFn, "virgl_renderer_init"),
            poll: sym!(VoidFn, "virgl_renderer_poll"),
            get_poll_fd: sym!(PollFdFn, "virgl_renderer_get_poll_fd"),
            get_cap_set: sym!(GetCapSetFn, "virgl_renderer_get_cap_set"),
            fill_caps: sym!(FillCapsFn, "virgl_renderer_fill_caps"),
            context_create: sym!(ContextCreateFn, "virgl_renderer_context_create"),
            context_destroy: sym!(ContextDestroyFn, "virgl_renderer_context_destroy"),
            create_fence: sym!(CreateFenceFn, "virgl_renderer_create_fence"),
            submit_cmd: sym!(SubmitCmdFn, "virgl_renderer_submit_cmd"),
            cleanup: sym!(CleanupFn, "virgl_renderer_cleanup"),
            resource_create: sym!(ResourceCreateFn, "virgl_renderer_resource_create"),
            resource_unref: sym!(ResourceUnrefFn, "virgl_renderer_resource_unref"),
            ctx_attach_resource: sym!(CtxResourceFn, "virgl_renderer_ctx_attach_resource"),
            ctx_detach_resource: sym!(CtxResourceFn, "virgl_renderer_ctx_detach_resource"),
            attach_iov: sym!(AttachIovFn, "virgl_renderer_resource_attach_iov"),
            detach_iov: sym!(DetachIovFn, "virgl_renderer_resource_detach_iov"),
            transfer_write: sym!(TransferWriteFn, "virgl_renderer_transfer_write_iov"),
            transfer_read: sym!(TransferReadFn, "virgl_renderer_transfer_read_iov"),
            attached: RefCell::new(HashMap::new()),
            _lib: lib,
        })
    }

    /// virgl_renderer_init. The caller guarantees `cookie` and `callbacks` outlive the renderer
    /// (until `cleanup`) and that this is the process's only initialisation.
    pub fn init(&self, cookie: *mut c_void, flags: c_int, callbacks: &mut Callbacks) -> c_int {
        // SAFETY: both pointers are valid for the renderer's lifetime (the safe wrapper boxes
        // them and calls `cleanup` before freeing); virglrenderer keeps them, nothing else.
        unsafe { (self.init)(cookie, flags, callbacks) }
    }

    /// virgl_renderer_poll: runs fence callbacks on this thread.
    pub fn poll(&self) {
        // SAFETY: no arguments; only called after a successful init, from the init thread.
        unsafe { (self.poll)() }
    }

    /// virgl_renderer_get_poll_fd (-1 without THREAD_SYNC).
    pub fn poll_fd(&self) -> c_int {
        // SAFETY: no arguments; only called after a successful init.
        unsafe { (self.get_poll_fd)() }
    }

    /// virgl_renderer_get_cap_set: (max version, size in bytes) of capset `id`.
    pub fn cap_set(&self, id: u32) -> (u32, u32) {
        let (mut version, mut size) = (0u32, 0u32);
        // SAFETY: the two out-pointers are valid u32 locals.
        unsafe { (self.get_cap_set)(id, &mut version, &mut size) };
        (version, size)
    }

    /// virgl_renderer_fill_caps into `out`, which must hold the size `cap_set` reported.
    pub fn fill_caps(&self, id: u32, version: u32, out: &mut [u8], reported_size: u32) {
        assert!(
            out.len() >= reported_size as usize,
            "caller sizes the buffer from cap_set"
        );
        // SAFETY: `out` holds at least the capset size virglrenderer reported for `id`, which
        // is all fill_caps writes.
        unsafe { (self.fill_caps)(id, version, out.as_mut_ptr().cast()) }
    }

    /// virgl_renderer_context_create.
    pub fn context_create(&self, ctx_id: u32, name: &[u8]) -> c_int {
        let len = u32::try_from(name.len()).unwrap_or(0);
        // SAFETY: `name` is valid for `len` bytes; virglrenderer copies it.
        unsafe { (self.context_create)(ctx_id, len, name.as_ptr().cast()) }
    }

    /// virgl_renderer_context_destroy.
    pub fn context_destroy(&self, ctx_id: u32) {
        // SAFETY: plain integer argument; unknown ids are ignored by virglrenderer.
        unsafe { (self.context_destroy)(ctx_id) }
    }

    /// virgl_renderer_create_fence.
    pub fn create_fence(&self, fence: u32, ctx_id: u32) -> c_int {
        // SAFETY: plain integer arguments. The fence id is passed through C's int unchanged.
        unsafe { (self.create_fence)(fence as c_int, ctx_id) }
    }

    /// virgl_renderer_submit_cmd over whole dwords of `commands`.
    pub fn submit_cmd(&self, commands: &mut [u32], ctx_id: u32) -> c_int {
        let Ok(ndw) = c_int::try_from(commands.len()) else {
            return -libc::EINVAL;
        };
        // SAFETY: `commands` is valid for `ndw` dwords; virglrenderer only reads it during the
        // call (it decodes in place).
        unsafe { (self.submit_cmd)(commands.as_mut_ptr().cast(), ctx_id as c_int, ndw) }
    }

    /// virgl_renderer_cleanup. Frees the backings still attached, now that virglrenderer no
    /// longer holds them.
    pub fn cleanup(&self, cookie: *mut c_void) {
        // SAFETY: called once, after which the renderer no longer uses the cookie or callbacks.
        unsafe { (self.cleanup)(cookie) };
        self.attached.borrow_mut().clear();
    }

    /// virgl_renderer_resource_create without backing (`args.handle` is the id).
    pub fn resource_create(&self, args: &ResourceCreateArgs) -> c_int {
        let mut args = *args;
        // SAFETY: `args` is a valid local struct virglrenderer only reads during the call; no
        // iovecs are passed (NULL, 0).
        unsafe { (self.resource_create)(&mut args, ptr::null_mut(), 0) }
    }

    /// virgl_renderer_resource_unref, after detaching the resource's backing (so that objects
    /// of contexts still referencing the resource, e.g. queries, lose its iovecs). Returns
    /// the backing, which virglrenderer no longer uses.
    pub fn resource_unref(&self, res_id: u32) -> Option<Box<dyn BackingMemory>> {
        let backing = self.resource_detach_iov(res_id);
        // SAFETY: plain integer argument; unknown ids are ignored by virglrenderer.
        unsafe { (self.resource_unref)(res_id) };
        backing
    }

    /// virgl_renderer_ctx_attach_resource. Ids go through C's int unchanged, as virglrenderer
    /// converts them back to uint32_t for its lookups.
    pub fn ctx_attach_resource(&self, ctx_id: u32, res_id: u32) {
        // SAFETY: plain integer arguments; unknown ids are ignored by virglrenderer.
        unsafe { (self.ctx_attach_resource)(ctx_id as c_int, res_id as c_int) }
    }

    /// virgl_renderer_ctx_detach_resource.
    pub fn ctx_detach_resource(&self, ctx_id: u32, res_id: u32) {
        // SAFETY: plain integer arguments; unknown ids are ignored by virglrenderer.
        unsafe { (self.ctx_detach_resource)(ctx_id as c_int, res_id as c_int) }
    }

    /// virgl_renderer_resource_attach_iov with the iovecs of `backing`, which is kept until
    /// the backing is detached or the resource unreferenced. Refused (-EBUSY) while one is
    /// attached, and (-EINVAL) for more iovecs than a C int counts. On failure the backing is
    /// dropped: virglrenderer has not kept its pointers.
    pub fn resource_attach_iov(&self, res_id: u32, backing: Box<dyn BackingMemory>) -> c_int {
        if self.attached.borrow().contains_key(&res_id) {
            return -libc::EBUSY;
        }
        let mut held = Attached {
            iovecs: backing.iovecs().to_vec(),
            backing,
        };
        let Ok(count) = c_int::try_from(held.iovecs.len()) else {
            return -libc::EINVAL;
        };
        let iov = held.iovecs.as_mut_ptr();
        // SAFETY: `iov` points to `count` iovecs in `held.iovecs`, whose heap buffer stays put
        // when `held` moves into the map below; their memory is valid per `BackingMemory`'s
        // contract. Both are kept in `self.attached` until virglrenderer lets go of them
        // (detach, unref, cleanup). No backing was attached to this resource through us.
        let rc = unsafe { (self.attach_iov)(res_id as c_int, iov, count) };
        if rc == 0 {
            self.attached.borrow_mut().insert(res_id, held);
        }
        rc
    }

    /// virgl_renderer_resource_detach_iov: gives back the backing attached through
    /// [`Api::resource_attach_iov`], if any.
    pub fn resource_detach_iov(&self, res_id: u32) -> Option<Box<dyn BackingMemory>> {
        let mut held = self.attached.borrow_mut().remove(&res_id)?;
        let mut iov: *mut iovec = ptr::null_mut();
        let mut count: c_int = 0;
        // SAFETY: the out-pointers are valid locals; virglrenderer stores into them the array
        // it held and clears its own pointers before returning.
        unsafe { (self.detach_iov)(res_id as c_int, &mut iov, &mut count) };
        if iov != held.iovecs.as_mut_ptr() {
            warn!("virgl resource {res_id}: detach returned another iovec array ({count} entries)");
        }
        Some(held.backing)
    }

    /// Whether a backing is attached to `res_id` through us.
    pub fn has_backing(&self, res_id: u32) -> bool {
        self.attached.borrow().contains_key(&res_id)
    }

    /// Ids of the resources with a backing attached.
    pub fn backed_resources(&self) -> Vec<u32> {
        self.attached.borrow().keys().copied().collect()
    }

    /// virgl_renderer_transfer_{write,read}_iov between resource `res_id` and `buffer`, or the
    /// attached backing when `buffer` is `None`. A region or level that does not fit C's int
    /// is refused (-EINVAL) before the call, as virglrenderer reads them as ints.
    pub fn transfer(
        &self,
        dir: Direction,
        res_id: u32,
        ctx_id: u32,
        args: &TransferArgs,
        buffer: Option<&mut [u8]>,
    ) -> c_int {
        if super::check_transfer(args).is_err() {
            return -libc::EINVAL;
        }
        let mut region = args.region;
        let mut one = buffer.map(|b| iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        });
        let (iov, count) = match one.as_mut() {
            Some(one) => (one as *mut iovec, 1),
            None => (ptr::null_mut(), 0),
        };
        let (level, stride, layer_stride, offset) =
            (args.level, args.stride, args.layer_stride, args.offset);
        match dir {
            Direction::ToHost => {
                // SAFETY: `region` is a valid local; `iov` is NULL (virglrenderer uses the
                // backing it holds, kept alive by `self.attached`) or one iovec describing the
                // exclusively borrowed `buffer`, used only during the call (it may also write
                // it: virglrenderer 0.10 can swizzle BGRA uploads in place on GLES).
                unsafe {
                    (self.transfer_write)(
                        res_id,
                        ctx_id,
                        level as c_int,
                        stride,
                        layer_stride,
                        &mut region,
                        offset,
                        iov,
                        count,
                    )
                }
            }
            Direction::FromHost => {
                // SAFETY: as for the write: `region` is a valid local, `iov` NULL or one iovec
                // for the exclusively borrowed `buffer`, written only during the call.
                unsafe {
                    (self.transfer_read)(
                        res_id,
                        ctx_id,
                        level,
                        stride,
                        layer_stride,
                        &mut region,
                        offset,
                        iov,
                        count as c_int,
                    )
                }
            }
        }
    }
}

/// The fence callback: records the signalled fence in the `FenceLog` the cookie points to.
///
/// # Safety
/// `cookie` is the pointer given to `virgl_renderer_init`, a live `FenceLog`.
pub unsafe extern "C" fn write_fence(cookie: *mut c_void, fence: u32) {
    // SAFETY: per the contract above, `cookie` points to the boxed `FenceLog` owned by the
    // renderer wrapper, alive until cleanup; the callback runs on the thread that called poll.
    let log = unsafe { &*(cookie as *const super::FenceLog) };
    log.signal(fence);
}
