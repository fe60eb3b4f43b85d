//! The standard DRM virtgpu ioctls (Linux `include/uapi/drm/virtgpu_drm.h`) on a render node, and
//! poll() on sync_file fences: what the guest tools (`vgpu-load`) and the guest CUDA driver
//! (`guest-drivers/libcuda`) call. This crate's only unsafe code besides the qtest drivers'.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thiserror::Error;

/// `VIRTGPU_PARAM_RESOURCE_BLOB`: 1 when the device offers VIRTIO_GPU_F_RESOURCE_BLOB.
pub const PARAM_RESOURCE_BLOB: u64 = 3;
/// `VIRTGPU_PARAM_CONTEXT_INIT`: 1 when the device offers VIRTIO_GPU_F_CONTEXT_INIT.
pub const PARAM_CONTEXT_INIT: u64 = 6;
/// `VIRTGPU_PARAM_SUPPORTED_CAPSET_IDs`: a bit mask of the capset ids the device lists.
pub const PARAM_SUPPORTED_CAPSET_IDS: u64 = 7;
/// `VIRTGPU_CONTEXT_PARAM_CAPSET_ID`.
pub const CONTEXT_PARAM_CAPSET_ID: u64 = 1;
/// `VIRTGPU_CONTEXT_PARAM_NUM_RINGS`.
pub const CONTEXT_PARAM_NUM_RINGS: u64 = 2;
/// Most context parameters we pass in one CONTEXT_INIT (the kernel accepts a handful).
const MAX_CONTEXT_PARAMS: usize = 4;
/// Most fences polled at once: poll() takes them as one array.
pub const MAX_POLL_FDS: usize = 256;

const VIRTGPU_EXECBUF_FENCE_FD_OUT: u32 = 0x02;
/// Attempts at an ioctl the kernel keeps interrupting before it is an error.
const MAX_RETRIES: usize = 1000;

/// `struct drm_virtgpu_execbuffer` (with the sync-object fields of Linux 6.5+; the DRM core
/// zero-extends or truncates to the kernel's own size, so it works on older kernels too).
#[repr(C)]
#[derive(Debug, Default)]
struct Execbuffer {
    flags: u32,
    size: u32,
    command: u64,
    bo_handles: u64,
    num_bo_handles: u32,
    fence_fd: i32,
    ring_idx: u32,
    syncobj_stride: u32,
    num_in_syncobjs: u32,
    num_out_syncobjs: u32,
    in_syncobjs: u64,
    out_syncobjs: u64,
}

/// `struct drm_virtgpu_getparam`: `value` points at an int the kernel writes.
#[repr(C)]
#[derive(Debug, Default)]
struct GetParam {
    param: u64,
    value: u64,
}

/// `struct drm_virtgpu_get_caps`.
#[repr(C)]
#[derive(Debug, Default)]
struct GetCaps {
    cap_set_id: u32,
    cap_set_ver: u32,
    addr: u64,
    size: u32,
    pad: u32,
}

/// `struct drm_virtgpu_context_set_param`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct ContextSetParam {
    param: u64,
    value: u64,
}

/// `struct drm_virtgpu_context_init`.
#[repr(C)]
#[derive(Debug, Default)]
struct ContextInit {
    num_params: u32,
    pad: u32,
    ctx_set_params: u64,
}

const _: () = assert!(size_of::<Execbuffer>() == 64);
const _: () = assert!(size_of::<GetParam>() == 16);
const _: () = assert!(size_of::<GetCaps>() == 24);
const _: () = assert!(size_of::<ContextSetParam>() == 16);
const _: () = assert!(size_of::<ContextInit>() == 16);
const _: () = assert!(size_of::<ResourceCreateBlob>() == 48);
const _: () = assert!(size_of::<Map>() == 16);
const _: () = assert!(size_of::<Wait>() == 8);
const _: () = assert!(size_of::<GemClose>() == 8);

/// `struct drm_virtgpu_resource_create_blob`.
#[repr(C)]
#[derive(Debug, Default)]
struct ResourceCreateBlob {
    blob_mem: u32,
    blob_flags: u32,
    bo_handle: u32,
    res_handle: u32,
    size: u64,
    pad: u32,
    cmd_size: u32,
    cmd: u64,
    blob_id: u64,
}

/// `struct drm_virtgpu_map`.
#[repr(C)]
#[derive(Debug, Default)]
struct Map {
    offset: u64,
    handle: u32,
    pad: u32,
}

/// `struct drm_virtgpu_3d_wait`.
#[repr(C)]
#[derive(Debug, Default)]
struct Wait {
    handle: u32,
    flags: u32,
}

/// `struct drm_gem_close` (drm.h).
#[repr(C)]
#[derive(Debug, Default)]
struct GemClose {
    handle: u32,
    pad: u32,
}

/// A blob the kernel created: its GEM handle (for this file) and its resource id (for the
/// device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blob {
    pub bo: u32,
    pub res: u32,
}

/// `DRM_IOWR(DRM_COMMAND_BASE + nr, T)`: direction read|write, type 'd', the argument's size.
const fn drm_iowr(nr: u64, size: usize) -> u64 {
    const DRM_COMMAND_BASE: u64 = 0x40;
    const IOC_READ_WRITE: u64 = 3;
    assert!(size < (1 << 14), "ioctl argument too large for _IOC");
    (IOC_READ_WRITE << 30) | ((size as u64) << 16) | ((b'd' as u64) << 8) | (DRM_COMMAND_BASE + nr)
}

const IOCTL_EXECBUFFER: u64 = drm_iowr(0x02, size_of::<Execbuffer>());
const IOCTL_GETPARAM: u64 = drm_iowr(0x03, size_of::<GetParam>());
const IOCTL_GET_CAPS: u64 = drm_iowr(0x09, size_of::<GetCaps>());
const IOCTL_CONTEXT_INIT: u64 = drm_iowr(0x0b, size_of::<ContextInit>());
const IOCTL_MAP: u64 = drm_iowr(0x01, size_of::<Map>());
const IOCTL_WAIT: u64 = drm_iowr(0x08, size_of::<Wait>());
const IOCTL_RESOURCE_CREATE_BLOB: u64 = drm_iowr(0x0a, size_of::<ResourceCreateBlob>());
/// DRM_IOCTL_GEM_CLOSE: `_IOW('d', 0x09, struct drm_gem_close)` of the DRM core.
const IOCTL_GEM_CLOSE: u64 =
    (1 << 30) | ((size_of::<GemClose>() as u64) << 16) | (0x64 << 8) | 0x09;

/// Render-node errors.
#[derive(Debug, Error)]
pub enum DrmError {
    /// The render node could not be opened.
    #[error("cannot open render node {path}: {source} (is the virtio_gpu driver bound?)")]
    Open {
        /// The node.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// An ioctl failed.
    #[error("{name} failed: {source}")]
    Ioctl {
        /// The ioctl.
        name: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
    /// A buffer or parameter list larger than the ioctl can describe.
    #[error("{0}: argument too large")]
    TooLarge(&'static str),
    /// EXECBUFFER succeeded without returning an out-fence.
    #[error("DRM_IOCTL_VIRTGPU_EXECBUFFER returned no fence fd ({0})")]
    NoFence(i32),
    /// poll() failed or reported a bad descriptor.
    #[error("poll on fences failed: {0}")]
    Poll(io::Error),
}

/// An open virtgpu render node.
#[derive(Debug)]
pub struct RenderNode {
    file: File,
}

/// Runs one ioctl, retrying on EINTR/EAGAIN like libdrm's drmIoctl.
///
/// # Safety
/// `request` must be a virtgpu ioctl whose argument type is `T`, and every user pointer inside
/// `arg` must point at memory valid for the access the kernel makes for the whole call.
unsafe fn ioctl<T>(
    fd: BorrowedFd<'_>,
    name: &'static str,
    request: u64,
    arg: &mut T,
) -> Result<(), DrmError> {
    let request = libc::Ioctl::try_from(request).map_err(|_| DrmError::TooLarge(name))?;
    for _ in 0..MAX_RETRIES {
        // SAFETY: `fd` is open for the duration of the borrow, `arg` is a live exclusive `T`
        // that `request` describes, and the caller vouches for the pointers inside it.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request, std::ptr::from_mut(arg)) };
        if rc != -1 {
            return Ok(());
        }
        let source = io::Error::last_os_error();
        if !matches!(source.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) {
            return Err(DrmError::Ioctl { name, source });
        }
    }
    Err(DrmError::Ioctl {
        name,
        source: io::Error::from_raw_os_error(libc::EINTR),
    })
}

impl RenderNode {
    /// Opens the render node read-write (close-on-exec, as std always does).
    pub fn open(path: &Path) -> Result<Self, DrmError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| DrmError::Open {
                path: path.to_owned(),
                source,
            })?;
        Ok(Self { file })
    }

    /// DRM_IOCTL_VIRTGPU_GETPARAM.
    pub fn get_param(&self, param: u64) -> Result<u32, DrmError> {
        let mut value: u32 = 0;
        let mut arg = GetParam {
            param,
            value: std::ptr::from_mut(&mut value) as u64,
        };
        // SAFETY: GETPARAM takes a GetParam; `value` points at a live u32, the int it writes.
        unsafe {
            ioctl(
                self.file.as_fd(),
                "DRM_IOCTL_VIRTGPU_GETPARAM",
                IOCTL_GETPARAM,
                &mut arg,
            )
        }?;
        Ok(value)
    }

    /// DRM_IOCTL_VIRTGPU_GET_CAPS: fills `buf` with (at most its length of) the capset.
    pub fn get_caps(&self, id: u32, version: u32, buf: &mut [u8]) -> Result<(), DrmError> {
        const NAME: &str = "DRM_IOCTL_VIRTGPU_GET_CAPS";
        let mut arg = GetCaps {
            cap_set_id: id,
            cap_set_ver: version,
            addr: buf.as_mut_ptr() as u64,
            size: u32::try_from(buf.len()).map_err(|_| DrmError::TooLarge(NAME))?,
            pad: 0,
        };
        // SAFETY: GET_CAPS takes a GetCaps; `addr` points at `buf`, writable for `size` bytes,
        // and the kernel copies at most `size` bytes.
        unsafe { ioctl(self.file.as_fd(), NAME, IOCTL_GET_CAPS, &mut arg) }
    }

    /// DRM_IOCTL_VIRTGPU_CONTEXT_INIT with (param, value) pairs.
    pub fn context_init(&self, params: &[(u64, u64)]) -> Result<(), DrmError> {
        const NAME: &str = "DRM_IOCTL_VIRTGPU_CONTEXT_INIT";
        if params.len() > MAX_CONTEXT_PARAMS {
            return Err(DrmError::TooLarge(NAME));
        }
        let list: Vec<ContextSetParam> = params
            .iter()
            .map(|&(param, value)| ContextSetParam { param, value })
            .collect();
        let mut arg = ContextInit {
            num_params: u32::try_from(list.len()).map_err(|_| DrmError::TooLarge(NAME))?,
            pad: 0,
            ctx_set_params: list.as_ptr() as u64,
        };
        // SAFETY: CONTEXT_INIT takes a ContextInit; `ctx_set_params` points at `list`, which
        // holds `num_params` initialised entries and outlives the call; the kernel only reads it.
        unsafe { ioctl(self.file.as_fd(), NAME, IOCTL_CONTEXT_INIT, &mut arg) }
    }

    /// DRM_IOCTL_VIRTGPU_EXECBUFFER of `commands` on ring 0, no buffer objects, asking for an
    /// out-fence; returns the sync_file that signals when the submit's fence does.
    pub fn execbuffer(&self, commands: &[u8]) -> Result<OwnedFd, DrmError> {
        const NAME: &str = "DRM_IOCTL_VIRTGPU_EXECBUFFER";
        let mut arg = Execbuffer {
            flags: VIRTGPU_EXECBUF_FENCE_FD_OUT,
            size: u32::try_from(commands.len()).map_err(|_| DrmError::TooLarge(NAME))?,
            command: commands.as_ptr() as u64,
            fence_fd: -1,
            ..Execbuffer::default()
        };
        // SAFETY: EXECBUFFER takes an Execbuffer; `command` points at `commands`, readable for
        // `size` bytes for the call; no buffer-object or sync-object arrays are passed.
        unsafe { ioctl(self.file.as_fd(), NAME, IOCTL_EXECBUFFER, &mut arg) }?;
        if arg.fence_fd < 0 {
            return Err(DrmError::NoFence(arg.fence_fd));
        }
        // SAFETY: with FENCE_FD_OUT a successful EXECBUFFER installs a new sync_file descriptor
        // in `fence_fd` that nothing else owns; we take sole ownership of it here.
        Ok(unsafe { OwnedFd::from_raw_fd(arg.fence_fd) })
    }

    /// DRM_IOCTL_VIRTGPU_EXECBUFFER of `commands` naming buffer objects `bo_handles`, without
    /// an out-fence: the kernel fences the buffers, which [`RenderNode::wait`] waits on.
    pub fn execbuffer_on(&self, commands: &[u8], bo_handles: &[u32]) -> Result<(), DrmError> {
        const NAME: &str = "DRM_IOCTL_VIRTGPU_EXECBUFFER";
        let mut arg = Execbuffer {
            size: u32::try_from(commands.len()).map_err(|_| DrmError::TooLarge(NAME))?,
            command: commands.as_ptr() as u64,
            bo_handles: bo_handles.as_ptr() as u64,
            num_bo_handles: u32::try_from(bo_handles.len())
                .map_err(|_| DrmError::TooLarge(NAME))?,
            fence_fd: -1,
            ..Execbuffer::default()
        };
        // SAFETY: EXECBUFFER takes an Execbuffer; `command` and `bo_handles` point at the
        // borrowed slices, readable for the sizes given, for the call.
        unsafe { ioctl(self.file.as_fd(), NAME, IOCTL_EXECBUFFER, &mut arg) }
    }

    /// DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB of `size` bytes.
    pub fn create_blob(&self, blob_mem: u32, flags: u32, size: u64) -> Result<Blob, DrmError> {
        let mut arg = ResourceCreateBlob {
            blob_mem,
            blob_flags: flags,
            size,
            ..ResourceCreateBlob::default()
        };
        // SAFETY: RESOURCE_CREATE_BLOB takes a ResourceCreateBlob; no command buffer is passed
        // (`cmd` 0, `cmd_size` 0).
        unsafe {
            ioctl(
                self.file.as_fd(),
                "DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB",
                IOCTL_RESOURCE_CREATE_BLOB,
                &mut arg,
            )
        }?;
        Ok(Blob {
            bo: arg.bo_handle,
            res: arg.res_handle,
        })
    }

    /// DRM_IOCTL_VIRTGPU_MAP: the offset to `mmap` buffer object `bo` at on this node.
    pub fn map_offset(&self, bo: u32) -> Result<u64, DrmError> {
        let mut arg = Map {
            handle: bo,
            ..Map::default()
        };
        // SAFETY: MAP takes a Map and holds no pointers.
        unsafe {
            ioctl(
                self.file.as_fd(),
                "DRM_IOCTL_VIRTGPU_MAP",
                IOCTL_MAP,
                &mut arg,
            )
        }?;
        Ok(arg.offset)
    }

    /// DRM_IOCTL_VIRTGPU_WAIT on buffer object `bo`: true once its fences signalled, false
    /// when the kernel gave up for now (EBUSY after its own timeout) and it should be asked
    /// again.
    pub fn wait(&self, bo: u32) -> Result<bool, DrmError> {
        let mut arg = Wait {
            handle: bo,
            flags: 0,
        };
        // SAFETY: WAIT takes a Wait and holds no pointers.
        match unsafe {
            ioctl(
                self.file.as_fd(),
                "DRM_IOCTL_VIRTGPU_WAIT",
                IOCTL_WAIT,
                &mut arg,
            )
        } {
            Ok(()) => Ok(true),
            Err(DrmError::Ioctl { source, .. }) if source.raw_os_error() == Some(libc::EBUSY) => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// DRM_IOCTL_GEM_CLOSE of buffer object `bo`.
    pub fn gem_close(&self, bo: u32) -> Result<(), DrmError> {
        let mut arg = GemClose { handle: bo, pad: 0 };
        // SAFETY: GEM_CLOSE takes a GemClose and holds no pointers.
        unsafe {
            ioctl(
                self.file.as_fd(),
                "DRM_IOCTL_GEM_CLOSE",
                IOCTL_GEM_CLOSE,
                &mut arg,
            )
        }
    }

    /// The node's descriptor (for `mmap` of a mapped buffer object).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// Waits until at least one of `fences` has signalled or `timeout` passes; returns which have.
/// Signalled sync_files poll readable (POLLIN).
pub fn poll_fences(fences: &[BorrowedFd<'_>], timeout: Duration) -> Result<Vec<bool>, DrmError> {
    if fences.len() > MAX_POLL_FDS {
        return Err(DrmError::TooLarge("poll"));
    }
    let mut fds: Vec<libc::pollfd> = fences
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let count = libc::nfds_t::try_from(fds.len()).map_err(|_| DrmError::TooLarge("poll"))?;
    let deadline = Instant::now().checked_add(timeout);
    loop {
        let left = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
        // Round up so a sub-millisecond remainder still waits instead of spinning.
        let ms = left.as_micros().div_ceil(1000);
        let ms = libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX);
        // SAFETY: `fds` is a live array of `count` pollfd entries for the call; the descriptors
        // are borrowed open fds.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), count, ms) };
        if rc >= 0 {
            break;
        }
        let error = io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EINTR) {
            return Err(DrmError::Poll(error));
        }
    }
    fds.iter()
        .map(|p| {
            if p.revents & (libc::POLLERR | libc::POLLNVAL) != 0 {
                Err(DrmError::Poll(io::Error::other(format!(
                    "fence fd {} reported revents {:#x}",
                    p.fd, p.revents
                ))))
            } else {
                Ok(p.revents & libc::POLLIN != 0)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_uapi_header() {
        assert_eq!(IOCTL_EXECBUFFER, 0xc040_6442);
        assert_eq!(IOCTL_GETPARAM, 0xc010_6443);
        assert_eq!(IOCTL_GET_CAPS, 0xc018_6449);
        assert_eq!(IOCTL_CONTEXT_INIT, 0xc010_644b);
        assert_eq!(IOCTL_MAP, 0xc010_6441);
        assert_eq!(IOCTL_WAIT, 0xc008_6448);
        assert_eq!(IOCTL_RESOURCE_CREATE_BLOB, 0xc030_644a);
        assert_eq!(IOCTL_GEM_CLOSE, 0x4008_6409);
    }

    #[test]
    fn missing_node_is_an_open_error() {
        let err = RenderNode::open(Path::new("/nonexistent/renderD128")).unwrap_err();
        assert!(matches!(err, DrmError::Open { .. }), "{err}");
    }

    #[test]
    fn ioctls_on_a_non_drm_file_fail_cleanly() {
        let node = RenderNode::open(Path::new("/dev/null")).unwrap();
        assert!(matches!(
            node.get_param(PARAM_SUPPORTED_CAPSET_IDS),
            Err(DrmError::Ioctl { .. })
        ));
        assert!(node.get_caps(20, 1, &mut [0; 16]).is_err());
        assert!(node.context_init(&[(CONTEXT_PARAM_CAPSET_ID, 20)]).is_err());
        assert!(node.execbuffer(&[0; 16]).is_err());
        assert!(node.execbuffer_on(&[0; 16], &[1]).is_err());
        assert!(node.create_blob(1, 1, 4096).is_err());
        assert!(node.map_offset(1).is_err());
        assert!(node.wait(1).is_err());
        assert!(node.gem_close(1).is_err());
        assert!(matches!(
            node.context_init(&[(0, 0); MAX_CONTEXT_PARAMS + 1]),
            Err(DrmError::TooLarge(_))
        ));
    }

    #[test]
    fn poll_reports_readiness_and_times_out() {
        use std::io::Write as _;
        let (reader, mut writer) = std::os::unix::net::UnixStream::pair().unwrap();
        let got = poll_fences(&[reader.as_fd()], Duration::from_millis(1)).unwrap();
        assert_eq!(got, vec![false]);
        writer.write_all(b"x").unwrap();
        let got = poll_fences(&[reader.as_fd(), writer.as_fd()], Duration::from_secs(5)).unwrap();
        assert_eq!(got, vec![true, false]);
        assert_eq!(
            poll_fences(&[], Duration::ZERO).unwrap(),
            Vec::<bool>::new()
        );
    }
}
