//! The raw virglrenderer ABI (virglrenderer.h, unchanged since 0.8) and its run-time loader.
//! All unsafe code of this crate lives in this file.

use std::ffi::{c_char, c_int, c_void};

use libloading::Library;

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

    /// virgl_renderer_cleanup.
    pub fn cleanup(&self, cookie: *mut c_void) {
        // SAFETY: called once, after which the renderer no longer uses the cookie or callbacks.
        unsafe { (self.cleanup)(cookie) }
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
