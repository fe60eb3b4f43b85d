//! Virtio-gpu control messages: request builders (2D, cursor and 3D commands) and parsers of
//! the responses.
//!
//! All structures are little-endian and encoded by hand. Command and response type values are
//! re-exported from `virtio_bindings::virtio_gpu` under short names; the rest of that module's
//! constants can be used directly.

use virtio_bindings::virtio_gpu as bindings;

/// `VIRTIO_GPU_CMD_GET_DISPLAY_INFO`.
pub const CMD_GET_DISPLAY_INFO: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_GET_DISPLAY_INFO;
/// `VIRTIO_GPU_CMD_RESOURCE_CREATE_2D`.
pub const CMD_RESOURCE_CREATE_2D: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_CREATE_2D;
/// `VIRTIO_GPU_CMD_RESOURCE_UNREF`.
pub const CMD_RESOURCE_UNREF: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_UNREF;
/// `VIRTIO_GPU_CMD_SET_SCANOUT`.
pub const CMD_SET_SCANOUT: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_SET_SCANOUT;
/// `VIRTIO_GPU_CMD_RESOURCE_FLUSH`.
pub const CMD_RESOURCE_FLUSH: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_FLUSH;
/// `VIRTIO_GPU_CMD_TRANSFER_TO_HOST_2D`.
pub const CMD_TRANSFER_TO_HOST_2D: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_TRANSFER_TO_HOST_2D;
/// `VIRTIO_GPU_CMD_RESOURCE_ATTACH_BACKING`.
pub const CMD_RESOURCE_ATTACH_BACKING: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_ATTACH_BACKING;
/// `VIRTIO_GPU_CMD_RESOURCE_DETACH_BACKING`.
pub const CMD_RESOURCE_DETACH_BACKING: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_DETACH_BACKING;
/// `VIRTIO_GPU_CMD_GET_EDID`.
pub const CMD_GET_EDID: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_GET_EDID;
/// `VIRTIO_GPU_CMD_GET_CAPSET_INFO`.
pub const CMD_GET_CAPSET_INFO: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_GET_CAPSET_INFO;
/// `VIRTIO_GPU_CMD_GET_CAPSET`.
pub const CMD_GET_CAPSET: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_GET_CAPSET;
/// `VIRTIO_GPU_CMD_CTX_CREATE` (3D).
pub const CMD_CTX_CREATE: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_CTX_CREATE;
/// `VIRTIO_GPU_CMD_CTX_DESTROY` (3D).
pub const CMD_CTX_DESTROY: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_CTX_DESTROY;
/// `VIRTIO_GPU_CMD_CTX_ATTACH_RESOURCE` (3D).
pub const CMD_CTX_ATTACH_RESOURCE: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_CTX_ATTACH_RESOURCE;
/// `VIRTIO_GPU_CMD_CTX_DETACH_RESOURCE` (3D).
pub const CMD_CTX_DETACH_RESOURCE: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_CTX_DETACH_RESOURCE;
/// `VIRTIO_GPU_CMD_RESOURCE_CREATE_3D` (3D).
pub const CMD_RESOURCE_CREATE_3D: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_CREATE_3D;
/// `VIRTIO_GPU_CMD_TRANSFER_TO_HOST_3D` (3D).
pub const CMD_TRANSFER_TO_HOST_3D: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_TRANSFER_TO_HOST_3D;
/// `VIRTIO_GPU_CMD_TRANSFER_FROM_HOST_3D` (3D).
pub const CMD_TRANSFER_FROM_HOST_3D: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_TRANSFER_FROM_HOST_3D;
/// `VIRTIO_GPU_CMD_SUBMIT_3D` (3D).
pub const CMD_SUBMIT_3D: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_SUBMIT_3D;
/// `VIRTIO_GPU_CMD_UPDATE_CURSOR` (cursor queue).
pub const CMD_UPDATE_CURSOR: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_UPDATE_CURSOR;
/// `VIRTIO_GPU_CMD_MOVE_CURSOR` (cursor queue).
pub const CMD_MOVE_CURSOR: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_MOVE_CURSOR;
/// `VIRTIO_GPU_RESP_OK_NODATA`.
pub const RESP_OK_NODATA: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_OK_NODATA;
/// `VIRTIO_GPU_RESP_OK_DISPLAY_INFO`.
pub const RESP_OK_DISPLAY_INFO: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_OK_DISPLAY_INFO;
/// `VIRTIO_GPU_RESP_OK_EDID`.
pub const RESP_OK_EDID: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_OK_EDID;
/// `VIRTIO_GPU_RESP_OK_CAPSET_INFO`.
pub const RESP_OK_CAPSET_INFO: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_OK_CAPSET_INFO;
/// `VIRTIO_GPU_RESP_OK_CAPSET`.
pub const RESP_OK_CAPSET: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_OK_CAPSET;
/// `VIRTIO_GPU_RESP_ERR_INVALID_CONTEXT_ID`.
pub const RESP_ERR_INVALID_CONTEXT_ID: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_INVALID_CONTEXT_ID;
/// `VIRTIO_GPU_RESP_ERR_OUT_OF_MEMORY`.
pub const RESP_ERR_OUT_OF_MEMORY: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_OUT_OF_MEMORY;
/// `VIRTIO_GPU_RESP_ERR_INVALID_SCANOUT_ID`.
pub const RESP_ERR_INVALID_SCANOUT_ID: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_INVALID_SCANOUT_ID;
/// `VIRTIO_GPU_RESP_ERR_UNSPEC`.
pub const RESP_ERR_UNSPEC: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_UNSPEC;
/// `VIRTIO_GPU_RESP_ERR_INVALID_RESOURCE_ID`.
pub const RESP_ERR_INVALID_RESOURCE_ID: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_INVALID_RESOURCE_ID;
/// `VIRTIO_GPU_RESP_ERR_INVALID_PARAMETER`.
pub const RESP_ERR_INVALID_PARAMETER: u32 =
    bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_INVALID_PARAMETER;
/// Header flag: the request carries a fence.
pub const FLAG_FENCE: u32 = bindings::VIRTIO_GPU_FLAG_FENCE;
/// Header flag: `ring_idx` is valid.
pub const FLAG_INFO_RING_IDX: u32 = bindings::VIRTIO_GPU_FLAG_INFO_RING_IDX;
/// Feature bit `VIRTIO_GPU_F_EDID`.
pub const F_EDID: u32 = bindings::VIRTIO_GPU_F_EDID;
/// Feature bit `VIRTIO_GPU_F_VIRGL` (the 3D commands).
pub const F_VIRGL: u32 = bindings::VIRTIO_GPU_F_VIRGL;
/// Feature bit `VIRTIO_GPU_F_CONTEXT_INIT` (`context_init` of CTX_CREATE, fence rings).
pub const F_CONTEXT_INIT: u32 = bindings::VIRTIO_GPU_F_CONTEXT_INIT;
/// Capset `VIRTIO_GPU_CAPSET_VIRGL`.
pub const CAPSET_VIRGL: u32 = bindings::VIRTIO_GPU_CAPSET_VIRGL;
/// Capset `VIRTIO_GPU_CAPSET_VIRGL2`.
pub const CAPSET_VIRGL2: u32 = bindings::VIRTIO_GPU_CAPSET_VIRGL2;
/// vgpu's private load capset (`VGPU_LOAD_CAPSET_ID`): contexts that occupy the GPU for given
/// times.
pub const CAPSET_LOAD: u32 = 20;
/// vgpu's private compute capset (`VGPU_COMPUTE_CAPSET_ID`): contexts whose submits carry a
/// guest CUDA driver's requests (docs/CUDA-GUEST.md).
pub const CAPSET_COMPUTE: u32 = 21;
/// Feature bit `VIRTIO_GPU_F_RESOURCE_BLOB`.
pub const F_RESOURCE_BLOB: u32 = bindings::VIRTIO_GPU_F_RESOURCE_BLOB;
/// `VIRTIO_GPU_BLOB_MEM_GUEST` / `_HOST3D`.
pub const BLOB_MEM_GUEST: u32 = bindings::VIRTIO_GPU_BLOB_MEM_GUEST;
pub const BLOB_MEM_HOST3D: u32 = bindings::VIRTIO_GPU_BLOB_MEM_HOST3D;
/// `VIRTIO_GPU_BLOB_FLAG_USE_MAPPABLE`.
pub const BLOB_FLAG_USE_MAPPABLE: u32 = bindings::VIRTIO_GPU_BLOB_FLAG_USE_MAPPABLE;
/// First word of a compute submit's header ("VGCU").
pub const COMPUTE_MAGIC: u32 = 0x5543_4756;
/// Load command op: occupy the GPU for `arg` µs.
pub const LOAD_OP_OCCUPY: u32 = 1;
/// Load command op: end of a frame (`arg` 0).
pub const LOAD_OP_END_FRAME: u32 = 2;
/// `VIRTIO_GPU_FORMAT_B8G8R8X8_UNORM` (DRM XRGB8888, what Linux's fbdev and KMS use).
pub const FORMAT_B8G8R8X8: u32 = bindings::virtio_gpu_formats_VIRTIO_GPU_FORMAT_B8G8R8X8_UNORM;
/// `VIRTIO_GPU_FORMAT_B8G8R8A8_UNORM`.
pub const FORMAT_B8G8R8A8: u32 = bindings::virtio_gpu_formats_VIRTIO_GPU_FORMAT_B8G8R8A8_UNORM;
/// `VIRTIO_GPU_FORMAT_R8G8B8A8_UNORM`.
pub const FORMAT_R8G8B8A8: u32 = bindings::virtio_gpu_formats_VIRTIO_GPU_FORMAT_R8G8B8A8_UNORM;
/// Number of scanouts in a display-info response.
pub const MAX_SCANOUTS: usize = bindings::VIRTIO_GPU_MAX_SCANOUTS as usize;

/// Device configuration: `events_read` (le32).
pub const CONFIG_EVENTS_READ: u32 = 0;
/// Device configuration: `events_clear` (le32).
pub const CONFIG_EVENTS_CLEAR: u32 = 4;
/// Device configuration: `num_scanouts` (le32).
pub const CONFIG_NUM_SCANOUTS: u32 = 8;
/// Device configuration: `num_capsets` (le32).
pub const CONFIG_NUM_CAPSETS: u32 = 12;

/// Virtqueue index of the control queue.
pub const CONTROL_QUEUE: u16 = 0;
/// Virtqueue index of the cursor queue.
pub const CURSOR_QUEUE: u16 = 1;

/// Size of `struct virtio_gpu_ctrl_hdr`.
pub const CTRL_HDR_SIZE: usize = 24;
/// Size of one `struct virtio_gpu_display_one`.
const DISPLAY_ONE_SIZE: usize = 24;
/// Size of `struct virtio_gpu_resp_display_info`.
pub const DISPLAY_INFO_SIZE: usize = CTRL_HDR_SIZE + MAX_SCANOUTS * DISPLAY_ONE_SIZE;
/// Size of `struct virtio_gpu_resp_edid`.
pub const RESP_EDID_SIZE: usize = CTRL_HDR_SIZE + 8 + 1024;
/// Size of `struct virtio_gpu_mem_entry`.
pub const MEM_ENTRY_SIZE: usize = 16;
/// Size of the `debug_name` array of `struct virtio_gpu_ctx_create`.
pub const CTX_DEBUG_NAME_SIZE: usize = 64;
/// Size of `struct virtio_gpu_cmd_submit` (the command stream follows it).
pub const SUBMIT_3D_SIZE: usize = CTRL_HDR_SIZE + 8;
/// Size of `struct virtio_gpu_resp_capset_info`.
pub const RESP_CAPSET_INFO_SIZE: usize = CTRL_HDR_SIZE + 16;
/// Gallium's `PIPE_TEXTURE_2D`, the `target` of a plain 2D texture.
pub const PIPE_TEXTURE_2D: u32 = 2;

/// Errors parsing virtio-gpu messages.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The message is shorter than its structure.
    #[error("message of {got} bytes, {needed} needed")]
    TooShort {
        /// Bytes the structure needs.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// The response has another type than expected.
    #[error("response type {got:#x}, expected {expected:#x}")]
    UnexpectedType {
        /// Expected type.
        expected: u32,
        /// Type found.
        got: u32,
    },
}

/// Result type of this module.
pub type Result<T> = std::result::Result<T, GpuError>;

/// `struct virtio_gpu_ctrl_hdr`: starts every request and response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CtrlHeader {
    /// Command or response type.
    pub ctrl_type: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Fence ID (meaningful with [`FLAG_FENCE`]).
    pub fence_id: u64,
    /// 3D context ID.
    pub ctx_id: u32,
    /// Fence ring index (meaningful with [`FLAG_INFO_RING_IDX`]).
    pub ring_idx: u8,
}

impl CtrlHeader {
    /// A header of the given type with everything else zero.
    pub fn new(ctrl_type: u32) -> Self {
        Self {
            ctrl_type,
            ..Self::default()
        }
    }

    /// A header of the given type that asks for fence `fence_id`.
    pub fn fenced(ctrl_type: u32, fence_id: u64) -> Self {
        Self {
            ctrl_type,
            flags: FLAG_FENCE,
            fence_id,
            ..Self::default()
        }
    }

    /// Whether [`FLAG_FENCE`] is set.
    pub fn is_fenced(&self) -> bool {
        self.flags & FLAG_FENCE != 0
    }

    /// Encodes the header (24 bytes, padding zero).
    pub fn to_bytes(&self) -> [u8; CTRL_HDR_SIZE] {
        let mut bytes = [0; CTRL_HDR_SIZE];
        bytes[0..4].copy_from_slice(&self.ctrl_type.to_le_bytes());
        bytes[4..8].copy_from_slice(&self.flags.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.fence_id.to_le_bytes());
        bytes[16..20].copy_from_slice(&self.ctx_id.to_le_bytes());
        bytes[20] = self.ring_idx;
        bytes
    }

    /// Decodes the header at the start of `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let r = Reader::new(bytes, CTRL_HDR_SIZE)?;
        Ok(Self {
            ctrl_type: r.u32(0),
            flags: r.u32(4),
            fence_id: r.u64(8),
            ctx_id: r.u32(16),
            ring_idx: bytes[20],
        })
    }

    /// Decodes the header at the start of `bytes` and checks its type.
    pub fn parse_expecting(bytes: &[u8], expected: u32) -> Result<Self> {
        let header = Self::parse(bytes)?;
        if header.ctrl_type != expected {
            return Err(GpuError::UnexpectedType {
                expected,
                got: header.ctrl_type,
            });
        }
        Ok(header)
    }
}

/// The `VIRTIO_GPU_CMD_GET_DISPLAY_INFO` request.
pub fn get_display_info() -> [u8; CTRL_HDR_SIZE] {
    CtrlHeader::new(CMD_GET_DISPLAY_INFO).to_bytes()
}

/// A request: header of type `ctrl_type` followed by little-endian 32-bit words.
fn request(ctrl_type: u32, words: &[u32]) -> Vec<u8> {
    let mut bytes = CtrlHeader::new(ctrl_type).to_bytes().to_vec();
    for w in words {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    bytes
}

/// `VIRTIO_GPU_CMD_RESOURCE_CREATE_2D` (`struct virtio_gpu_resource_create_2d`).
pub fn resource_create_2d(resource_id: u32, format: u32, width: u32, height: u32) -> Vec<u8> {
    request(
        CMD_RESOURCE_CREATE_2D,
        &[resource_id, format, width, height],
    )
}

/// `VIRTIO_GPU_CMD_RESOURCE_UNREF`.
pub fn resource_unref(resource_id: u32) -> Vec<u8> {
    request(CMD_RESOURCE_UNREF, &[resource_id, 0])
}

/// `VIRTIO_GPU_CMD_SET_SCANOUT` (resource 0 disables the scanout).
pub fn set_scanout(scanout_id: u32, resource_id: u32, r: Rect) -> Vec<u8> {
    request(
        CMD_SET_SCANOUT,
        &[r.x, r.y, r.width, r.height, scanout_id, resource_id],
    )
}

/// `VIRTIO_GPU_CMD_RESOURCE_FLUSH`.
pub fn resource_flush(resource_id: u32, r: Rect) -> Vec<u8> {
    request(
        CMD_RESOURCE_FLUSH,
        &[r.x, r.y, r.width, r.height, resource_id, 0],
    )
}

/// `VIRTIO_GPU_CMD_TRANSFER_TO_HOST_2D`: `offset` is the backing offset of the rectangle's
/// first pixel (Linux: `y * stride + x * 4`).
pub fn transfer_to_host_2d(resource_id: u32, r: Rect, offset: u64) -> Vec<u8> {
    request(
        CMD_TRANSFER_TO_HOST_2D,
        &[
            r.x,
            r.y,
            r.width,
            r.height,
            offset as u32,
            (offset >> 32) as u32,
            resource_id,
            0,
        ],
    )
}

/// `VIRTIO_GPU_CMD_RESOURCE_ATTACH_BACKING` with its `struct virtio_gpu_mem_entry` list
/// (guest-physical address, length), in one buffer.
pub fn resource_attach_backing(resource_id: u32, entries: &[(u64, u32)]) -> Vec<u8> {
    let mut bytes = request(
        CMD_RESOURCE_ATTACH_BACKING,
        &[resource_id, entries.len() as u32],
    );
    for &(addr, length) in entries {
        bytes.extend_from_slice(&addr.to_le_bytes());
        bytes.extend_from_slice(&length.to_le_bytes());
        bytes.extend_from_slice(&[0; 4]);
    }
    bytes
}

/// `VIRTIO_GPU_CMD_RESOURCE_ATTACH_BACKING` announcing `nr_entries` entries but carrying
/// only `entries` (for negative tests).
pub fn resource_attach_backing_claiming(
    resource_id: u32,
    nr_entries: u32,
    entries: &[(u64, u32)],
) -> Vec<u8> {
    let mut bytes = resource_attach_backing(resource_id, entries);
    bytes[CTRL_HDR_SIZE + 4..CTRL_HDR_SIZE + 8].copy_from_slice(&nr_entries.to_le_bytes());
    bytes
}

/// `VIRTIO_GPU_CMD_RESOURCE_CREATE_BLOB` (`struct virtio_gpu_resource_create_blob`) with its
/// memory entries (guest-physical address, length).
pub fn resource_create_blob(
    resource_id: u32,
    blob_mem: u32,
    blob_flags: u32,
    size: u64,
    entries: &[(u64, u32)],
) -> Vec<u8> {
    let mut bytes = request(
        bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_CREATE_BLOB,
        &[resource_id, blob_mem, blob_flags, entries.len() as u32],
    );
    bytes.extend_from_slice(&0u64.to_le_bytes());
    bytes.extend_from_slice(&size.to_le_bytes());
    for &(addr, length) in entries {
        bytes.extend_from_slice(&addr.to_le_bytes());
        bytes.extend_from_slice(&length.to_le_bytes());
        bytes.extend_from_slice(&[0; 4]);
    }
    bytes
}

/// `VIRTIO_GPU_CMD_SUBMIT_3D` on a compute-capset context: the 20-byte header naming the blob
/// that holds `request_bytes` of request and takes up to `reply_capacity` of reply.
pub fn compute_submit(
    ctx_id: u32,
    resource_id: u32,
    request_bytes: u32,
    reply_capacity: u32,
) -> Vec<u8> {
    submit_3d(
        ctx_id,
        &[COMPUTE_MAGIC, resource_id, request_bytes, reply_capacity, 0],
    )
}

/// `VIRTIO_GPU_CMD_RESOURCE_DETACH_BACKING`.
pub fn resource_detach_backing(resource_id: u32) -> Vec<u8> {
    request(CMD_RESOURCE_DETACH_BACKING, &[resource_id, 0])
}

/// `VIRTIO_GPU_CMD_GET_EDID`.
pub fn get_edid(scanout_id: u32) -> Vec<u8> {
    request(CMD_GET_EDID, &[scanout_id, 0])
}

/// A request of type `ctrl_type` in 3D context `ctx_id`, followed by little-endian 32-bit
/// words.
fn request_in(ctx_id: u32, ctrl_type: u32, words: &[u32]) -> Vec<u8> {
    let mut bytes = request(ctrl_type, words);
    bytes[16..20].copy_from_slice(&ctx_id.to_le_bytes());
    bytes
}

/// A byte count as the 32-bit field that carries it (saturating: a builder never wraps).
fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// `request` (any request built here) asking for fence `fence_id`: sets `FLAG_FENCE` and the
/// fence id in its header.
pub fn with_fence(mut request: Vec<u8>, fence_id: u64) -> Vec<u8> {
    if let Some(header) = request
        .get(..CTRL_HDR_SIZE)
        .and_then(|h| CtrlHeader::parse(h).ok())
    {
        let fenced = CtrlHeader {
            flags: header.flags | FLAG_FENCE,
            fence_id,
            ..header
        };
        request[..CTRL_HDR_SIZE].copy_from_slice(&fenced.to_bytes());
    }
    request
}

/// `VIRTIO_GPU_CMD_GET_CAPSET_INFO` (`struct virtio_gpu_get_capset_info`).
pub fn get_capset_info(capset_index: u32) -> Vec<u8> {
    request(CMD_GET_CAPSET_INFO, &[capset_index, 0])
}

/// `VIRTIO_GPU_CMD_GET_CAPSET` (`struct virtio_gpu_get_capset`).
pub fn get_capset(capset_id: u32, capset_version: u32) -> Vec<u8> {
    request(CMD_GET_CAPSET, &[capset_id, capset_version])
}

/// `VIRTIO_GPU_CMD_CTX_CREATE` (`struct virtio_gpu_ctx_create`) for context `ctx_id`: `nlen`
/// is the length of `name`, which is cut to [`CTX_DEBUG_NAME_SIZE`] bytes. Linux sends the
/// task name (at most 15 bytes) and, with `F_CONTEXT_INIT`, the capset id in the low 8 bits of
/// `context_init`.
pub fn ctx_create(ctx_id: u32, context_init: u32, name: &[u8]) -> Vec<u8> {
    let name = &name[..name.len().min(CTX_DEBUG_NAME_SIZE)];
    ctx_create_claiming(ctx_id, context_init, len_u32(name.len()), name)
}

/// `VIRTIO_GPU_CMD_CTX_CREATE` with any `nlen` (for negative tests); `name` is cut to
/// [`CTX_DEBUG_NAME_SIZE`] bytes.
pub fn ctx_create_claiming(ctx_id: u32, context_init: u32, nlen: u32, name: &[u8]) -> Vec<u8> {
    let mut bytes = request_in(ctx_id, CMD_CTX_CREATE, &[nlen, context_init]);
    let mut debug_name = [0; CTX_DEBUG_NAME_SIZE];
    let n = name.len().min(CTX_DEBUG_NAME_SIZE);
    debug_name[..n].copy_from_slice(&name[..n]);
    bytes.extend_from_slice(&debug_name);
    bytes
}

/// `VIRTIO_GPU_CMD_CTX_DESTROY` (`struct virtio_gpu_ctx_destroy`, a header only).
pub fn ctx_destroy(ctx_id: u32) -> Vec<u8> {
    request_in(ctx_id, CMD_CTX_DESTROY, &[])
}

/// `VIRTIO_GPU_CMD_CTX_ATTACH_RESOURCE` (`struct virtio_gpu_ctx_resource`).
pub fn ctx_attach_resource(ctx_id: u32, resource_id: u32) -> Vec<u8> {
    request_in(ctx_id, CMD_CTX_ATTACH_RESOURCE, &[resource_id, 0])
}

/// `VIRTIO_GPU_CMD_CTX_DETACH_RESOURCE` (`struct virtio_gpu_ctx_resource`).
pub fn ctx_detach_resource(ctx_id: u32, resource_id: u32) -> Vec<u8> {
    request_in(ctx_id, CMD_CTX_DETACH_RESOURCE, &[resource_id, 0])
}

/// The fields of `struct virtio_gpu_resource_create_3d` (Gallium values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResourceCreate3d {
    /// Resource id (0 is invalid).
    pub resource_id: u32,
    /// `pipe_texture_target`.
    pub target: u32,
    /// virgl format.
    pub format: u32,
    /// `PIPE_BIND_*` bits.
    pub bind: u32,
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
    /// Depth.
    pub depth: u32,
    /// Array layers.
    pub array_size: u32,
    /// Last mipmap level.
    pub last_level: u32,
    /// Samples.
    pub nr_samples: u32,
    /// `VIRGL_RESOURCE_*` flags.
    pub flags: u32,
}

impl ResourceCreate3d {
    /// A single-level, single-sample 2D texture.
    pub fn texture_2d(resource_id: u32, format: u32, bind: u32, width: u32, height: u32) -> Self {
        Self {
            resource_id,
            target: PIPE_TEXTURE_2D,
            format,
            bind,
            width,
            height,
            depth: 1,
            array_size: 1,
            ..Self::default()
        }
    }
}

/// `VIRTIO_GPU_CMD_RESOURCE_CREATE_3D`.
pub fn resource_create_3d(c: &ResourceCreate3d) -> Vec<u8> {
    request(
        CMD_RESOURCE_CREATE_3D,
        &[
            c.resource_id,
            c.target,
            c.format,
            c.bind,
            c.width,
            c.height,
            c.depth,
            c.array_size,
            c.last_level,
            c.nr_samples,
            c.flags,
            0,
        ],
    )
}

/// `struct virtio_gpu_box`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Box3d {
    /// Left edge.
    pub x: u32,
    /// Top edge.
    pub y: u32,
    /// Front edge or first layer.
    pub z: u32,
    /// Width.
    pub w: u32,
    /// Height.
    pub h: u32,
    /// Depth or layer count.
    pub d: u32,
}

/// The fields of `struct virtio_gpu_transfer_host_3d` after the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Transfer3d {
    /// Resource.
    pub resource_id: u32,
    /// Region of the resource.
    pub bbox: Box3d,
    /// Offset in the backing.
    pub offset: u64,
    /// Mipmap level.
    pub level: u32,
    /// Bytes per row in the backing.
    pub stride: u32,
    /// Bytes per layer in the backing.
    pub layer_stride: u32,
}

impl Transfer3d {
    /// All of a `w` x `h` 2D resource, its backing rows `w * bytes_per_pixel` bytes apart.
    pub fn whole_2d(resource_id: u32, w: u32, h: u32, bytes_per_pixel: u32) -> Transfer3d {
        Transfer3d {
            resource_id,
            bbox: Box3d {
                x: 0,
                y: 0,
                z: 0,
                w,
                h,
                d: 1,
            },
            stride: w.saturating_mul(bytes_per_pixel),
            ..Transfer3d::default()
        }
    }
}

fn transfer_3d(ctrl_type: u32, ctx_id: u32, t: &Transfer3d) -> Vec<u8> {
    let b = t.bbox;
    let mut bytes = request_in(ctx_id, ctrl_type, &[b.x, b.y, b.z, b.w, b.h, b.d]);
    bytes.extend_from_slice(&t.offset.to_le_bytes());
    for w in [t.resource_id, t.level, t.stride, t.layer_stride] {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    bytes
}

/// `VIRTIO_GPU_CMD_TRANSFER_TO_HOST_3D` in context `ctx_id`.
pub fn transfer_to_host_3d(ctx_id: u32, t: &Transfer3d) -> Vec<u8> {
    transfer_3d(CMD_TRANSFER_TO_HOST_3D, ctx_id, t)
}

/// `VIRTIO_GPU_CMD_TRANSFER_FROM_HOST_3D` in context `ctx_id`.
pub fn transfer_from_host_3d(ctx_id: u32, t: &Transfer3d) -> Vec<u8> {
    transfer_3d(CMD_TRANSFER_FROM_HOST_3D, ctx_id, t)
}

/// `VIRTIO_GPU_CMD_SUBMIT_3D` in context `ctx_id` with its command stream, in one buffer
/// (Linux puts the stream in a second descriptor; the device reads them as one request).
pub fn submit_3d(ctx_id: u32, commands: &[u32]) -> Vec<u8> {
    submit_3d_claiming(ctx_id, len_u32(commands.len().saturating_mul(4)), commands)
}

/// `VIRTIO_GPU_CMD_SUBMIT_3D` on a load-capset context: each command `(op, flags, arg)` is
/// 16 little-endian bytes `{op u32, flags u32, arg u64}`.
pub fn load_submit(ctx_id: u32, commands: &[(u32, u32, u64)]) -> Vec<u8> {
    let dwords: Vec<u32> = commands
        .iter()
        .flat_map(|&(op, flags, arg)| [op, flags, arg as u32, (arg >> 32) as u32])
        .collect();
    submit_3d(ctx_id, &dwords)
}

/// `VIRTIO_GPU_CMD_SUBMIT_3D` announcing `size` bytes but carrying `commands` (for negative
/// tests).
pub fn submit_3d_claiming(ctx_id: u32, size: u32, commands: &[u32]) -> Vec<u8> {
    let mut bytes = request_in(ctx_id, CMD_SUBMIT_3D, &[size, 0]);
    for w in commands {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    bytes
}

/// `struct virtio_gpu_resp_capset_info` (`VIRTIO_GPU_RESP_OK_CAPSET_INFO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapsetInfo {
    /// Response header.
    pub header: CtrlHeader,
    /// Capset id.
    pub capset_id: u32,
    /// Newest version.
    pub capset_max_version: u32,
    /// Largest size in bytes.
    pub capset_max_size: u32,
}

impl CapsetInfo {
    /// Decodes a capset-info response; fails on another response type.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let header = CtrlHeader::parse_expecting(bytes, RESP_OK_CAPSET_INFO)?;
        let r = Reader::new(bytes, RESP_CAPSET_INFO_SIZE)?;
        Ok(Self {
            header,
            capset_id: r.u32(CTRL_HDR_SIZE),
            capset_max_version: r.u32(CTRL_HDR_SIZE + 4),
            capset_max_size: r.u32(CTRL_HDR_SIZE + 8),
        })
    }
}

/// `struct virtio_gpu_resp_capset` (`VIRTIO_GPU_RESP_OK_CAPSET`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capset {
    /// Response header.
    pub header: CtrlHeader,
    /// Everything after the header (the used length tells how much of it the device wrote).
    pub data: Vec<u8>,
}

impl Capset {
    /// Decodes a capset response; fails on another response type.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let header = CtrlHeader::parse_expecting(bytes, RESP_OK_CAPSET)?;
        Ok(Self {
            header,
            data: bytes[CTRL_HDR_SIZE..].to_vec(),
        })
    }
}

/// `struct virtio_gpu_resp_edid` (`VIRTIO_GPU_RESP_OK_EDID`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdidResponse {
    /// Response header.
    pub header: CtrlHeader,
    /// The EDID bytes (`size` of them).
    pub edid: Vec<u8>,
}

impl EdidResponse {
    /// Decodes an EDID response; fails on another response type.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let header = CtrlHeader::parse_expecting(bytes, RESP_OK_EDID)?;
        let r = Reader::new(bytes, RESP_EDID_SIZE)?;
        let size = (r.u32(CTRL_HDR_SIZE) as usize).min(1024);
        let start = CTRL_HDR_SIZE + 8;
        Ok(Self {
            header,
            edid: bytes[start..start + size].to_vec(),
        })
    }
}

/// `struct virtio_gpu_rect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rect {
    /// Left edge.
    pub x: u32,
    /// Top edge.
    pub y: u32,
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
}

impl Rect {
    /// A rectangle.
    pub fn new(x: u32, y: u32, width: u32, height: u32) -> Self {
        Self {
            x,
            y,
            width,
            height,
        }
    }
}

/// `struct virtio_gpu_display_one`: one scanout of a display-info response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DisplayOne {
    /// Preferred position and size.
    pub rect: Rect,
    /// Non-zero when the scanout is enabled.
    pub enabled: u32,
    /// Flags.
    pub flags: u32,
}

/// `struct virtio_gpu_resp_display_info` (`VIRTIO_GPU_RESP_OK_DISPLAY_INFO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DisplayInfo {
    /// Response header.
    pub header: CtrlHeader,
    /// The scanouts.
    pub pmodes: [DisplayOne; MAX_SCANOUTS],
}

impl DisplayInfo {
    /// Decodes a display-info response; fails on another response type.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let header = CtrlHeader::parse_expecting(bytes, RESP_OK_DISPLAY_INFO)?;
        let r = Reader::new(bytes, DISPLAY_INFO_SIZE)?;
        let pmodes = std::array::from_fn(|i| {
            let base = CTRL_HDR_SIZE + i * DISPLAY_ONE_SIZE;
            DisplayOne {
                rect: Rect {
                    x: r.u32(base),
                    y: r.u32(base + 4),
                    width: r.u32(base + 8),
                    height: r.u32(base + 12),
                },
                enabled: r.u32(base + 16),
                flags: r.u32(base + 20),
            }
        });
        Ok(Self { header, pmodes })
    }
}

/// Little-endian field reader over a slice already checked to be long enough.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], needed: usize) -> Result<Self> {
        if bytes.len() < needed {
            return Err(GpuError::TooShort {
                needed,
                got: bytes.len(),
            });
        }
        Ok(Self { bytes })
    }

    fn u32(&self, at: usize) -> u32 {
        let mut le = [0; 4];
        le.copy_from_slice(&self.bytes[at..at + 4]);
        u32::from_le_bytes(le)
    }

    fn u64(&self, at: usize) -> u64 {
        u64::from(self.u32(at)) | u64::from(self.u32(at + 4)) << 32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let header = CtrlHeader {
            ctx_id: 7,
            ring_idx: 3,
            ..CtrlHeader::fenced(0x1234, 0x0102_0304_0506_0708)
        };
        let bytes = header.to_bytes();
        assert_eq!(&bytes[..8], &[0x34, 0x12, 0, 0, 1, 0, 0, 0]);
        assert_eq!(&bytes[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&bytes[16..24], &[7, 0, 0, 0, 3, 0, 0, 0]);
        assert_eq!(CtrlHeader::parse(&bytes).unwrap(), header);
        assert!(header.is_fenced());
        assert_eq!(&get_display_info()[..4], &[0, 1, 0, 0]);
    }

    #[test]
    fn display_info_parse() {
        let mut bytes = vec![0; DISPLAY_INFO_SIZE];
        bytes[..CTRL_HDR_SIZE].copy_from_slice(&CtrlHeader::new(RESP_OK_DISPLAY_INFO).to_bytes());
        let one = CTRL_HDR_SIZE + DISPLAY_ONE_SIZE;
        for (i, v) in [1u32, 2, 1280, 800, 1, 0].into_iter().enumerate() {
            bytes[one + 4 * i..one + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        let info = DisplayInfo::parse(&bytes).unwrap();
        assert_eq!(info.pmodes[0], DisplayOne::default());
        assert_eq!(
            info.pmodes[1],
            DisplayOne {
                rect: Rect {
                    x: 1,
                    y: 2,
                    width: 1280,
                    height: 800
                },
                enabled: 1,
                flags: 0
            }
        );
        assert!(matches!(
            DisplayInfo::parse(&bytes[..100]),
            Err(GpuError::TooShort {
                needed: 408,
                got: 100
            })
        ));
        bytes[..4].copy_from_slice(&RESP_ERR_UNSPEC.to_le_bytes());
        assert!(matches!(
            DisplayInfo::parse(&bytes),
            Err(GpuError::UnexpectedType { got: 0x1200, .. })
        ));
    }

    #[test]
    fn two_d_request_layouts() {
        let create = resource_create_2d(7, FORMAT_B8G8R8X8, 64, 32);
        assert_eq!(create.len(), 40);
        assert_eq!(
            &create[24..40],
            &[7, 0, 0, 0, 2, 0, 0, 0, 64, 0, 0, 0, 32, 0, 0, 0]
        );
        assert_eq!(resource_unref(7).len(), 32);
        assert_eq!(resource_detach_backing(7).len(), 32);
        assert_eq!(get_edid(0).len(), 32);
        let r = Rect::new(1, 2, 3, 4);
        let scanout = set_scanout(0, 7, r);
        assert_eq!(scanout.len(), 48);
        assert_eq!(&scanout[40..48], &[0, 0, 0, 0, 7, 0, 0, 0]);
        assert_eq!(resource_flush(7, r).len(), 48);
        let t = transfer_to_host_2d(7, r, 0x1_0000_0020);
        assert_eq!(t.len(), 56);
        assert_eq!(&t[40..52], &[0x20, 0, 0, 0, 1, 0, 0, 0, 7, 0, 0, 0]);
        let a = resource_attach_backing(7, &[(0x1000, 4096), (0x3000, 10)]);
        assert_eq!(a.len(), 32 + 2 * MEM_ENTRY_SIZE);
        assert_eq!(&a[28..32], &[2, 0, 0, 0]);
        assert_eq!(&a[48..60], &[0, 0x30, 0, 0, 0, 0, 0, 0, 10, 0, 0, 0]);
        let claim = resource_attach_backing_claiming(7, 9, &[]);
        assert_eq!((claim.len(), &claim[28..32]), (32, &[9, 0, 0, 0][..]));
    }

    #[test]
    fn edid_response_parse() {
        let mut bytes = vec![0; RESP_EDID_SIZE];
        bytes[..CTRL_HDR_SIZE].copy_from_slice(&CtrlHeader::new(RESP_OK_EDID).to_bytes());
        bytes[24..28].copy_from_slice(&128u32.to_le_bytes());
        bytes[32] = 0xaa;
        let e = EdidResponse::parse(&bytes).unwrap();
        assert_eq!(e.edid.len(), 128);
        assert_eq!(e.edid[0], 0xaa);
        assert!(EdidResponse::parse(&bytes[..100]).is_err());
    }

    /// Word `i` (32-bit, little-endian) of `bytes`.
    fn word(bytes: &[u8], i: usize) -> u32 {
        u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap())
    }

    #[test]
    fn three_d_request_layouts() {
        // The header carries the context; GET_CAPSET* are context-less.
        let c = get_capset_info(1);
        assert_eq!((c.len(), word(&c, 0), word(&c, 6)), (32, 0x108, 1));
        let c = get_capset(CAPSET_VIRGL2, 2);
        assert_eq!(
            (c.len(), word(&c, 0), word(&c, 6), word(&c, 7)),
            (32, 0x109, 2, 2)
        );

        let c = ctx_create(3, CAPSET_VIRGL2, b"kmscube");
        assert_eq!(c.len(), 96);
        assert_eq!((word(&c, 0), word(&c, 4)), (CMD_CTX_CREATE, 3));
        assert_eq!((word(&c, 6), word(&c, 7)), (7, 2));
        assert_eq!(&c[32..40], b"kmscube\0");
        assert!(c[40..].iter().all(|&b| b == 0));
        let long = ctx_create(3, 0, &[b'x'; 100]);
        assert_eq!((long.len(), word(&long, 6)), (96, 64));
        let claim = ctx_create_claiming(3, 0, 65, b"x");
        assert_eq!((claim.len(), word(&claim, 6)), (96, 65));

        let d = ctx_destroy(3);
        assert_eq!((d.len(), word(&d, 0), word(&d, 4)), (24, 0x201, 3));
        let a = ctx_attach_resource(3, 9);
        assert_eq!(
            (a.len(), word(&a, 0), word(&a, 4), word(&a, 6)),
            (32, 0x202, 3, 9)
        );
        let a = ctx_detach_resource(3, 9);
        assert_eq!(
            (a.len(), word(&a, 0), word(&a, 4), word(&a, 6)),
            (32, 0x203, 3, 9)
        );

        let r = resource_create_3d(&ResourceCreate3d {
            last_level: 3,
            nr_samples: 4,
            flags: 1,
            ..ResourceCreate3d::texture_2d(9, 67, 0xa, 640, 480)
        });
        assert_eq!((r.len(), word(&r, 0)), (72, 0x204));
        let fields: Vec<u32> = (6..18).map(|i| word(&r, i)).collect();
        assert_eq!(fields, [9, 2, 67, 0xa, 640, 480, 1, 1, 3, 4, 1, 0]);

        let t = Transfer3d {
            resource_id: 9,
            bbox: Box3d {
                x: 1,
                y: 2,
                z: 3,
                w: 4,
                h: 5,
                d: 6,
            },
            offset: 0x2_0000_0040,
            level: 1,
            stride: 256,
            layer_stride: 4096,
        };
        for (bytes, ty) in [
            (transfer_to_host_3d(3, &t), CMD_TRANSFER_TO_HOST_3D),
            (transfer_from_host_3d(3, &t), CMD_TRANSFER_FROM_HOST_3D),
        ] {
            assert_eq!((bytes.len(), word(&bytes, 0), word(&bytes, 4)), (72, ty, 3));
            let fields: Vec<u32> = (6..18).map(|i| word(&bytes, i)).collect();
            assert_eq!(fields, [1, 2, 3, 4, 5, 6, 0x40, 2, 9, 1, 256, 4096]);
        }

        let s = submit_3d(3, &[0xdead_beef, 7]);
        assert_eq!(s.len(), SUBMIT_3D_SIZE + 8);
        assert_eq!((word(&s, 0), word(&s, 4), word(&s, 6)), (0x207, 3, 8));
        assert_eq!((word(&s, 8), word(&s, 9)), (0xdead_beef, 7));
        let claim = submit_3d_claiming(3, 6, &[1]);
        assert_eq!((claim.len(), word(&claim, 6)), (SUBMIT_3D_SIZE + 4, 6));
    }

    #[test]
    fn fences_are_added_to_any_request() {
        let l = load_submit(4, &[(LOAD_OP_OCCUPY, 0, 0x1_0000_0002)]);
        assert_eq!(l.len(), SUBMIT_3D_SIZE + 16);
        assert_eq!(&l[24..28], &16u32.to_le_bytes(), "size");
        assert_eq!(
            &l[32..48],
            &[1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0]
        );
        let s = with_fence(submit_3d(3, &[1]), 0x1_0000_0002);
        let h = CtrlHeader::parse(&s).unwrap();
        assert!(h.is_fenced());
        assert_eq!(
            (h.fence_id, h.ctx_id, h.ctrl_type),
            (0x1_0000_0002, 3, CMD_SUBMIT_3D)
        );
        assert_eq!(word(&s, 8), 1, "the body is untouched");
        assert_eq!(
            with_fence(vec![1, 2, 3], 5),
            vec![1, 2, 3],
            "too short to be fenced"
        );
    }

    #[test]
    fn capset_response_parse() {
        let mut bytes = CtrlHeader::new(RESP_OK_CAPSET_INFO).to_bytes().to_vec();
        for v in [2u32, 2, 0x300, 0] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        let info = CapsetInfo::parse(&bytes).unwrap();
        assert_eq!(
            (
                info.capset_id,
                info.capset_max_version,
                info.capset_max_size
            ),
            (2, 2, 0x300)
        );
        assert!(matches!(
            CapsetInfo::parse(&bytes[..36]),
            Err(GpuError::TooShort {
                needed: 40,
                got: 36
            })
        ));
        assert!(matches!(
            Capset::parse(&bytes),
            Err(GpuError::UnexpectedType { .. })
        ));

        let mut bytes = CtrlHeader::new(RESP_OK_CAPSET).to_bytes().to_vec();
        bytes.extend_from_slice(&[1, 2, 3]);
        assert_eq!(Capset::parse(&bytes).unwrap().data, vec![1, 2, 3]);
        assert!(matches!(
            Capset::parse(&bytes[..10]),
            Err(GpuError::TooShort { .. })
        ));
    }
}
