//! virglrenderer as a backend: the host renders guest OpenGL command streams with its own GL
//! (llvmpipe through surfaceless EGL when the host has no GPU).
//!
//! The library is loaded at run time (`libloading`), so the build needs no -dev package and a
//! newer virglrenderer can be chosen by name. virglrenderer keeps process-global state: it may
//! be initialised once per process, and every call must come from the thread that initialised
//! it. [`Virgl`] enforces both: it is neither `Send` nor `Sync`, and a second instance in the
//! same process is refused.

mod ffi;

use std::cell::Cell;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use log::info;

pub use ffi::LoadError;

/// The library virglrenderer is loaded from by default (Debian's libvirglrenderer1).
pub const DEFAULT_LIBRARY: &str = "libvirglrenderer.so.1";
/// Capset id of VIRGL (version 1).
pub const CAPSET_VIRGL: u32 = 1;
/// Capset id of VIRGL2 (version 2).
pub const CAPSET_VIRGL2: u32 = 2;
/// Largest capset accepted from the library: virgl's capsets are a few hundred bytes to a few
/// KiB; anything larger means a broken library.
pub const MAX_CAPSET_SIZE: u32 = 64 * 1024;

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
    /// A renderer call failed with an errno-style code.
    #[error("{call} failed ({code})")]
    Call {
        /// The call.
        call: &'static str,
        /// Its return value.
        code: i32,
    },
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

/// An initialised virglrenderer, bound to the thread that created it.
#[derive(Debug)]
pub struct Virgl {
    api: ffi::Api,
    fences: Box<FenceLog>,
    /// virglrenderer keeps a pointer to the callback table until cleanup.
    _callbacks: Box<ffi::Callbacks>,
    _single_thread: PhantomData<*const ()>,
}

impl Virgl {
    /// Loads `library` and initialises it for surfaceless EGL with GLES, fences signalled
    /// through a poll fd (no polling loop).
    pub fn new(library: &str) -> Result<Virgl, VirglError> {
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
        let flags = ffi::USE_EGL | ffi::USE_SURFACELESS | ffi::USE_GLES | ffi::THREAD_SYNC;
        let cookie = &*fences as *const FenceLog as *mut c_void;
        let rc = api.init(cookie, flags, &mut callbacks);
        if rc != 0 {
            return Err(VirglError::Init(rc));
        }
        info!("virglrenderer initialised from {library} (surfaceless EGL, GLES)");
        Ok(Virgl {
            api,
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
        if version == 0 || version > info.max_version {
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
        match self.api.context_create(ctx_id, name.as_bytes()) {
            0 => Ok(()),
            code => Err(VirglError::Call {
                call: "virgl_renderer_context_create",
                code,
            }),
        }
    }

    /// Destroys 3D context `ctx_id`.
    pub fn context_destroy(&self, ctx_id: u32) {
        self.api.context_destroy(ctx_id);
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
        let cookie = &*self.fences as *const FenceLog as *mut c_void;
        // The boxed callbacks and fence log are freed after this, once virglrenderer has let
        // go of them.
        self.api.cleanup(cookie);
    }
}
