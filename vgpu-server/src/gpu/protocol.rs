//! virtio-gpu wire format: decoding of guest requests and encoding of device responses.
//!
//! Pure functions over byte slices (no I/O, no guest memory): the queue layer hands in the
//! device-readable bytes of a descriptor chain, and gets back the bytes to write into its
//! device-writable part. Every decode failure maps to a `VIRTIO_GPU_RESP_ERR_*` code, so a
//! malformed request still completes with an error response.
//!
//! The 3D commands (contexts, 3D resources and transfers, SUBMIT_3D command streams, capsets)
//! are decoded here too; what a command stream says is the renderer's business, not this
//! module's.

use std::fmt;

use mdev_backend::virgl;
use virtio_bindings::virtio_gpu as vg;

use crate::queue::MAX_REQUEST_BYTES;

/// Size of struct virtio_gpu_ctrl_hdr.
pub const CTRL_HDR_SIZE: usize = 24;
/// Number of scanout slots in a display-info response (VIRTIO_GPU_MAX_SCANOUTS).
pub const MAX_SCANOUTS: usize = vg::VIRTIO_GPU_MAX_SCANOUTS as usize;
/// Size of struct virtio_gpu_resp_display_info.
pub const DISPLAY_INFO_SIZE: usize = CTRL_HDR_SIZE + MAX_SCANOUTS * 24;
/// Size of struct virtio_gpu_update_cursor (used by both cursor commands).
pub const CURSOR_CMD_SIZE: usize = CTRL_HDR_SIZE + 16 + 16;
/// Size of struct virtio_gpu_rect.
pub const RECT_SIZE: usize = 16;
/// Size of struct virtio_gpu_resource_create_2d.
pub const RESOURCE_CREATE_2D_SIZE: usize = CTRL_HDR_SIZE + 16;
/// Size of struct virtio_gpu_resource_unref, _detach_backing, virtio_gpu_get_edid,
/// virtio_gpu_get_capset_info, virtio_gpu_get_capset and virtio_gpu_ctx_resource (a header and
/// two 32-bit fields).
pub const HDR_PLUS_8_SIZE: usize = CTRL_HDR_SIZE + 8;
/// Size of struct virtio_gpu_set_scanout.
pub const SET_SCANOUT_SIZE: usize = CTRL_HDR_SIZE + RECT_SIZE + 8;
/// Size of struct virtio_gpu_resource_flush.
pub const RESOURCE_FLUSH_SIZE: usize = CTRL_HDR_SIZE + RECT_SIZE + 8;
/// Size of struct virtio_gpu_transfer_to_host_2d.
pub const TRANSFER_TO_HOST_2D_SIZE: usize = CTRL_HDR_SIZE + RECT_SIZE + 16;
/// Size of struct virtio_gpu_resource_attach_backing, without its entries.
pub const ATTACH_BACKING_SIZE: usize = CTRL_HDR_SIZE + 8;
/// Size of struct virtio_gpu_resource_create_blob (its memory entries follow it).
pub const RESOURCE_CREATE_BLOB_SIZE: usize = CTRL_HDR_SIZE + 32;
/// Size of struct virtio_gpu_mem_entry.
pub const MEM_ENTRY_SIZE: usize = 16;
/// Size of the EDID blob in struct virtio_gpu_resp_edid.
pub const EDID_BLOB_SIZE: usize = 1024;
/// Size of struct virtio_gpu_resp_edid.
pub const RESP_EDID_SIZE: usize = CTRL_HDR_SIZE + 8 + EDID_BLOB_SIZE;
/// Size of the debug_name array of struct virtio_gpu_ctx_create.
pub const CTX_DEBUG_NAME_SIZE: usize = 64;
/// Size of struct virtio_gpu_ctx_create.
pub const CTX_CREATE_SIZE: usize = CTRL_HDR_SIZE + 8 + CTX_DEBUG_NAME_SIZE;
/// Size of struct virtio_gpu_box.
pub const BOX_SIZE: usize = 24;
/// Size of struct virtio_gpu_resource_create_3d.
pub const RESOURCE_CREATE_3D_SIZE: usize = CTRL_HDR_SIZE + 48;
/// Size of struct virtio_gpu_transfer_host_3d (both 3D transfer directions).
pub const TRANSFER_HOST_3D_SIZE: usize = CTRL_HDR_SIZE + BOX_SIZE + 8 + 16;
/// Size of struct virtio_gpu_cmd_submit, without the command stream that follows it.
pub const SUBMIT_3D_SIZE: usize = CTRL_HDR_SIZE + 8;
/// Size of struct virtio_gpu_resp_capset_info.
pub const RESP_CAPSET_INFO_SIZE: usize = CTRL_HDR_SIZE + 16;
/// The bits of CTX_CREATE's context_init that name the context's capset (with
/// VIRTIO_GPU_F_CONTEXT_INIT); the other bits are reserved.
pub const CONTEXT_INIT_CAPSET_ID_MASK: u32 = vg::VIRTIO_GPU_CONTEXT_INIT_CAPSET_ID_MASK;
/// Command streams are made of 32-bit words.
const DWORD: usize = 4;
/// Largest SUBMIT_3D command stream. The stream travels in the same request as its
/// struct virtio_gpu_cmd_submit, and the queue layer never copies more than
/// [`MAX_REQUEST_BYTES`] of a request, so a larger size can never be satisfied; refusing it up
/// front says so instead of reporting a short request. (Mesa's virgl winsys flushes at 256 KiB.)
pub const MAX_SUBMIT_BYTES: usize = MAX_REQUEST_BYTES - SUBMIT_3D_SIZE;
/// Most backing entries one RESOURCE_ATTACH_BACKING may carry. Linux sends one entry per
/// scatter-gather segment, at worst one per 4 KiB page: 16384 entries back a 64 MiB resource
/// (a 4K scanout of 32 MiB needs 8100) even when no two pages are contiguous. The bound keeps a
/// guest from making the device copy and keep large entry lists (QEMU uses the same bound).
pub const MAX_BACKING_ENTRIES: u32 = 16384;

/// The largest fixed-size control command (CTX_CREATE with its debug name); every other
/// command but SUBMIT_3D and RESOURCE_ATTACH_BACKING fits in it.
const LARGEST_FIXED_COMMAND: usize = {
    let sizes = [
        HDR_PLUS_8_SIZE,
        RESOURCE_CREATE_2D_SIZE,
        SET_SCANOUT_SIZE,
        RESOURCE_FLUSH_SIZE,
        TRANSFER_TO_HOST_2D_SIZE,
        CTX_CREATE_SIZE,
        RESOURCE_CREATE_3D_SIZE,
        TRANSFER_HOST_3D_SIZE,
    ];
    let mut largest = 0;
    let mut i = 0;
    while i < sizes.len() {
        if sizes[i] > largest {
            largest = sizes[i];
        }
        i += 1;
    }
    largest
};

/// The most bytes of a control request of type `ty` that decoding can use: what the queue
/// layer copies out of guest memory at most (the rest of a longer request is never read).
/// SUBMIT_3D: its struct and [`MAX_SUBMIT_BYTES`] of stream; ATTACH_BACKING: its struct and
/// [`MAX_BACKING_ENTRIES`] entries; any other command: [`LARGEST_FIXED_COMMAND`] bytes.
pub fn control_copy_bound(ty: u32) -> usize {
    match ty {
        ty::SUBMIT_3D => SUBMIT_3D_SIZE + MAX_SUBMIT_BYTES,
        ty::RESOURCE_ATTACH_BACKING => {
            ATTACH_BACKING_SIZE + MAX_BACKING_ENTRIES as usize * MEM_ENTRY_SIZE
        }
        ty::RESOURCE_CREATE_BLOB => {
            RESOURCE_CREATE_BLOB_SIZE + MAX_BACKING_ENTRIES as usize * MEM_ENTRY_SIZE
        }
        _ => LARGEST_FIXED_COMMAND,
    }
}

/// The most bytes of a cursor request that decoding can use (all are one fixed size).
pub fn cursor_copy_bound(_ty: u32) -> usize {
    CURSOR_CMD_SIZE
}

/// The request asks for a fence: the response is returned once the work it covers is done.
pub const FLAG_FENCE: u32 = vg::VIRTIO_GPU_FLAG_FENCE;
/// The request's ring_idx field is valid (context-init rings).
pub const FLAG_INFO_RING_IDX: u32 = vg::VIRTIO_GPU_FLAG_INFO_RING_IDX;

/// Command and response type codes (struct virtio_gpu_ctrl_hdr.type).
pub mod ty {
    use virtio_bindings::virtio_gpu as vg;
    /// Query the scanouts.
    pub const GET_DISPLAY_INFO: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_GET_DISPLAY_INFO;
    /// Create a host-side 2D resource.
    pub const RESOURCE_CREATE_2D: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_CREATE_2D;
    /// Destroy a resource.
    pub const RESOURCE_UNREF: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_UNREF;
    /// Show a resource (or nothing) on a scanout.
    pub const SET_SCANOUT: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_SET_SCANOUT;
    /// A rectangle of a resource is ready to be shown.
    pub const RESOURCE_FLUSH: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_FLUSH;
    /// Copy from guest backing into a 2D resource.
    pub const TRANSFER_TO_HOST_2D: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_TRANSFER_TO_HOST_2D;
    /// Give a resource guest pages as backing.
    pub const RESOURCE_ATTACH_BACKING: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_ATTACH_BACKING;
    /// Take a resource's guest backing away.
    pub const RESOURCE_DETACH_BACKING: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_DETACH_BACKING;
    /// Query a scanout's EDID.
    pub const GET_EDID: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_GET_EDID;
    /// VIRTIO_GPU_CMD_RESOURCE_CREATE_BLOB.
    pub const RESOURCE_CREATE_BLOB: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_CREATE_BLOB;
    /// Query the id and sizes of the capset at an index.
    pub const GET_CAPSET_INFO: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_GET_CAPSET_INFO;
    /// Fetch a capset.
    pub const GET_CAPSET: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_GET_CAPSET;
    /// Create a 3D context.
    pub const CTX_CREATE: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_CTX_CREATE;
    /// Destroy a 3D context.
    pub const CTX_DESTROY: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_CTX_DESTROY;
    /// Let a 3D context use a resource.
    pub const CTX_ATTACH_RESOURCE: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_CTX_ATTACH_RESOURCE;
    /// Take a resource away from a 3D context.
    pub const CTX_DETACH_RESOURCE: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_CTX_DETACH_RESOURCE;
    /// Create a host-side 3D resource.
    pub const RESOURCE_CREATE_3D: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_CREATE_3D;
    /// Copy from guest backing into a 3D resource.
    pub const TRANSFER_TO_HOST_3D: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_TRANSFER_TO_HOST_3D;
    /// Copy from a 3D resource into its guest backing.
    pub const TRANSFER_FROM_HOST_3D: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_TRANSFER_FROM_HOST_3D;
    /// Run a command stream in a 3D context.
    pub const SUBMIT_3D: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_SUBMIT_3D;
    /// First 2D command code.
    pub const FIRST_2D: u32 = GET_DISPLAY_INFO;
    /// Last 2D command code defined by the specification.
    pub const LAST_2D: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_SET_SCANOUT_BLOB;
    /// First 3D command code.
    pub const FIRST_3D: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_CTX_CREATE;
    /// Last 3D command code defined by the specification.
    pub const LAST_3D: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_RESOURCE_UNMAP_BLOB;
    /// Set the cursor image and position.
    pub const UPDATE_CURSOR: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_UPDATE_CURSOR;
    /// Move the cursor.
    pub const MOVE_CURSOR: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_MOVE_CURSOR;
    /// Success without payload.
    pub const OK_NODATA: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_OK_NODATA;
    /// Success with struct virtio_gpu_resp_display_info.
    pub const OK_DISPLAY_INFO: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_OK_DISPLAY_INFO;
    /// Success with struct virtio_gpu_resp_edid.
    pub const OK_EDID: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_OK_EDID;
    /// Success with struct virtio_gpu_resp_capset_info.
    pub const OK_CAPSET_INFO: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_OK_CAPSET_INFO;
    /// Success with struct virtio_gpu_resp_capset (header and capset bytes).
    pub const OK_CAPSET: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_OK_CAPSET;
    /// Unspecified error.
    pub const ERR_UNSPEC: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_UNSPEC;
    /// The host is out of memory (or past a named limit) for the request.
    pub const ERR_OUT_OF_MEMORY: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_OUT_OF_MEMORY;
    /// No such 3D context.
    pub const ERR_INVALID_CONTEXT_ID: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_INVALID_CONTEXT_ID;
    /// No such scanout.
    pub const ERR_INVALID_SCANOUT_ID: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_INVALID_SCANOUT_ID;
    /// No such resource (or the id is taken, for a create).
    pub const ERR_INVALID_RESOURCE_ID: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_INVALID_RESOURCE_ID;
    /// Invalid parameter.
    pub const ERR_INVALID_PARAMETER: u32 =
        vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_INVALID_PARAMETER;
}

/// Why a request could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    /// The request is shorter than a control header.
    #[error("request of {0} bytes is shorter than the {CTRL_HDR_SIZE}-byte header")]
    ShortHeader(usize),
    /// The command code is not one the specification defines for this queue.
    #[error("unknown command type {0:#x}")]
    UnknownCommand(u32),
    /// The request is shorter than its command's structure.
    #[error("command {ty:#x}: {len} bytes, needs {need}")]
    ShortCommand {
        /// Command code.
        ty: u32,
        /// Bytes received.
        len: usize,
        /// Bytes the command structure needs.
        need: usize,
    },
    /// RESOURCE_CREATE_2D with a pixel format this device does not support.
    #[error("unsupported pixel format {0}")]
    UnsupportedFormat(u32),
    /// RESOURCE_ATTACH_BACKING with more entries than [`MAX_BACKING_ENTRIES`].
    #[error("{0} backing entries, at most {MAX_BACKING_ENTRIES}")]
    TooManyEntries(u32),
    /// CTX_CREATE whose nlen is longer than its debug_name array.
    #[error("context debug name of {0} bytes, at most {CTX_DEBUG_NAME_SIZE}")]
    DebugNameTooLong(u32),
    /// SUBMIT_3D announcing more than [`MAX_SUBMIT_BYTES`].
    #[error("command stream of {0} bytes, at most {MAX_SUBMIT_BYTES}")]
    SubmitTooLarge(u32),
    /// SUBMIT_3D whose size is not a whole number of 32-bit words.
    #[error("command stream of {0} bytes is not a multiple of {DWORD}")]
    SubmitUnaligned(u32),
}

impl ProtocolError {
    /// The response code a guest gets for this failure.
    pub fn response_code(&self) -> u32 {
        match self {
            ProtocolError::ShortHeader(_) | ProtocolError::UnknownCommand(_) => ty::ERR_UNSPEC,
            ProtocolError::ShortCommand { .. }
            | ProtocolError::UnsupportedFormat(_)
            | ProtocolError::TooManyEntries(_)
            | ProtocolError::DebugNameTooLong(_)
            | ProtocolError::SubmitTooLarge(_)
            | ProtocolError::SubmitUnaligned(_) => ty::ERR_INVALID_PARAMETER,
        }
    }
}

/// struct virtio_gpu_ctrl_hdr.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CtrlHeader {
    /// Command or response type.
    pub ty: u32,
    /// VIRTIO_GPU_FLAG_* bits.
    pub flags: u32,
    /// Fence id, valid with [`FLAG_FENCE`].
    pub fence_id: u64,
    /// 3D context id.
    pub ctx_id: u32,
    /// Context ring, valid with [`FLAG_INFO_RING_IDX`].
    pub ring_idx: u8,
}

impl CtrlHeader {
    /// Decodes the header at the start of `buf`.
    pub fn decode(buf: &[u8]) -> Result<CtrlHeader, ProtocolError> {
        let mut r = Fields::new(buf, CTRL_HDR_SIZE).ok_or(ProtocolError::ShortHeader(buf.len()))?;
        Ok(CtrlHeader {
            ty: r.u32(),
            flags: r.u32(),
            fence_id: r.u64(),
            ctx_id: r.u32(),
            ring_idx: r.u8(),
        })
    }

    /// Whether the request carries a fence.
    pub fn fenced(&self) -> bool {
        self.flags & FLAG_FENCE != 0
    }

    /// The header of a response of type `ty` to this request: fence and ring are echoed.
    pub fn response(&self, ty: u32) -> CtrlHeader {
        CtrlHeader {
            ty,
            flags: self.flags & (FLAG_FENCE | FLAG_INFO_RING_IDX),
            fence_id: if self.fenced() { self.fence_id } else { 0 },
            ctx_id: self.ctx_id,
            ring_idx: if self.flags & FLAG_INFO_RING_IDX != 0 {
                self.ring_idx
            } else {
                0
            },
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.ty.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.fence_id.to_le_bytes());
        out.extend_from_slice(&self.ctx_id.to_le_bytes());
        out.extend_from_slice(&[self.ring_idx, 0, 0, 0]);
    }
}

/// struct virtio_gpu_rect.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
    /// Whether the rectangle is non-empty and lies inside a `width` x `height` image
    /// (checked arithmetic: an edge past 2^32 is outside).
    pub fn is_inside(&self, width: u32, height: u32) -> bool {
        let fits = |start: u32, len: u32, limit: u32| {
            len != 0 && start.checked_add(len).is_some_and(|end| end <= limit)
        };
        fits(self.x, self.width, width) && fits(self.y, self.height, height)
    }

    /// The overlap of two rectangles, `None` when they do not overlap.
    pub fn intersect(&self, other: &Rect) -> Option<Rect> {
        let end = |start: u32, len: u32| u64::from(start) + u64::from(len);
        let x0 = self.x.max(other.x);
        let y0 = self.y.max(other.y);
        let x1 = end(self.x, self.width).min(end(other.x, other.width));
        let y1 = end(self.y, self.height).min(end(other.y, other.height));
        let width = u32::try_from(x1.checked_sub(u64::from(x0))?).ok()?;
        let height = u32::try_from(y1.checked_sub(u64::from(y0))?).ok()?;
        (width != 0 && height != 0).then_some(Rect {
            x: x0,
            y: y0,
            width,
            height,
        })
    }
}

/// The 32-bit pixel formats of virtio_gpu_formats that Linux uses for 2D resources. Each name
/// lists the components in memory byte order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PixelFormat {
    /// VIRTIO_GPU_FORMAT_B8G8R8A8_UNORM.
    B8G8R8A8,
    /// VIRTIO_GPU_FORMAT_B8G8R8X8_UNORM (DRM XRGB8888 on little-endian).
    B8G8R8X8,
    /// VIRTIO_GPU_FORMAT_A8R8G8B8_UNORM.
    A8R8G8B8,
    /// VIRTIO_GPU_FORMAT_X8R8G8B8_UNORM.
    X8R8G8B8,
    /// VIRTIO_GPU_FORMAT_R8G8B8A8_UNORM.
    R8G8B8A8,
    /// VIRTIO_GPU_FORMAT_X8B8G8R8_UNORM.
    X8B8G8R8,
    /// VIRTIO_GPU_FORMAT_A8B8G8R8_UNORM.
    A8B8G8R8,
    /// VIRTIO_GPU_FORMAT_R8G8B8X8_UNORM.
    R8G8B8X8,
}

impl PixelFormat {
    /// Bytes per pixel of every supported format.
    pub const BYTES_PER_PIXEL: u32 = 4;

    /// The format of a virtio_gpu_formats value, if supported.
    pub fn from_wire(v: u32) -> Option<PixelFormat> {
        Some(match v {
            vg::virtio_gpu_formats_VIRTIO_GPU_FORMAT_B8G8R8A8_UNORM => PixelFormat::B8G8R8A8,
            vg::virtio_gpu_formats_VIRTIO_GPU_FORMAT_B8G8R8X8_UNORM => PixelFormat::B8G8R8X8,
            vg::virtio_gpu_formats_VIRTIO_GPU_FORMAT_A8R8G8B8_UNORM => PixelFormat::A8R8G8B8,
            vg::virtio_gpu_formats_VIRTIO_GPU_FORMAT_X8R8G8B8_UNORM => PixelFormat::X8R8G8B8,
            vg::virtio_gpu_formats_VIRTIO_GPU_FORMAT_R8G8B8A8_UNORM => PixelFormat::R8G8B8A8,
            vg::virtio_gpu_formats_VIRTIO_GPU_FORMAT_X8B8G8R8_UNORM => PixelFormat::X8B8G8R8,
            vg::virtio_gpu_formats_VIRTIO_GPU_FORMAT_A8B8G8R8_UNORM => PixelFormat::A8B8G8R8,
            vg::virtio_gpu_formats_VIRTIO_GPU_FORMAT_R8G8B8X8_UNORM => PixelFormat::R8G8B8X8,
            _ => return None,
        })
    }

    /// Byte offsets of red, green and blue within one pixel.
    pub fn rgb_offsets(self) -> [usize; 3] {
        match self {
            PixelFormat::B8G8R8A8 | PixelFormat::B8G8R8X8 => [2, 1, 0],
            PixelFormat::A8R8G8B8 | PixelFormat::X8R8G8B8 => [1, 2, 3],
            PixelFormat::R8G8B8A8 | PixelFormat::R8G8B8X8 => [0, 1, 2],
            PixelFormat::X8B8G8R8 | PixelFormat::A8B8G8R8 => [3, 2, 1],
        }
    }
}

/// struct virtio_gpu_mem_entry: one guest-physical range of a resource's backing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemEntry {
    /// Guest-physical address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
}

/// CTX_CREATE (struct virtio_gpu_ctx_create).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CtxCreate {
    /// The new context's id (from the header).
    pub ctx_id: u32,
    /// The raw context_init field; see [`CtxCreate::capset_id`].
    pub context_init: u32,
    /// The first nlen bytes of debug_name (at most [`CTX_DEBUG_NAME_SIZE`]); not necessarily
    /// UTF-8, not NUL-terminated.
    pub debug_name: Vec<u8>,
}

impl CtxCreate {
    /// The capset (context type) the driver asks for with VIRTIO_GPU_F_CONTEXT_INIT; 0 when it
    /// leaves the choice to the device (every driver without that feature).
    pub fn capset_id(&self) -> u32 {
        self.context_init & CONTEXT_INIT_CAPSET_ID_MASK
    }
}

/// RESOURCE_CREATE_3D (struct virtio_gpu_resource_create_3d). The parameters are Gallium's
/// (pipe_texture_target, virgl formats, PIPE_BIND_* bits), decoded into the backend's own
/// parameter type and not checked here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceCreate3d {
    /// Guest-chosen id (0 is invalid).
    pub resource_id: u32,
    /// Target, format, bind, size, levels, samples, flags.
    pub args: virgl::ResourceCreate3d,
}

/// TRANSFER_TO_HOST_3D and TRANSFER_FROM_HOST_3D (struct virtio_gpu_transfer_host_3d).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transfer3d {
    /// Context the transfer is ordered in (from the header).
    pub ctx_id: u32,
    /// Resource.
    pub resource_id: u32,
    /// Box, offset, level and strides, in the backend's own transfer type.
    pub transfer: virgl::Transfer,
}

/// The command stream of a SUBMIT_3D, as 32-bit words (little-endian on the wire).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct CommandStream(Vec<u32>);

impl CommandStream {
    /// The words.
    pub fn dwords(&self) -> &[u32] {
        &self.0
    }

    /// The words, for a renderer API that takes them mutably.
    pub fn dwords_mut(&mut self) -> &mut [u32] {
        &mut self.0
    }

    /// The words, owned.
    pub fn into_dwords(self) -> Vec<u32> {
        self.0
    }

    /// Length in bytes (the request's size field).
    pub fn len_bytes(&self) -> usize {
        self.0.len() * DWORD
    }

    /// Decodes little-endian words; trailing bytes short of a word are not part of the stream.
    fn from_le_bytes(bytes: &[u8]) -> CommandStream {
        CommandStream(
            bytes
                .chunks_exact(DWORD)
                .map(|c| {
                    let mut w = [0; DWORD];
                    w.copy_from_slice(c);
                    u32::from_le_bytes(w)
                })
                .collect(),
        )
    }
}

impl From<Vec<u32>> for CommandStream {
    fn from(dwords: Vec<u32>) -> CommandStream {
        CommandStream(dwords)
    }
}

/// Streams can be 1 MiB: debug output shows their length only.
impl fmt::Debug for CommandStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CommandStream({} dwords)", self.0.len())
    }
}

/// A decoded control-queue command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlCommand {
    /// VIRTIO_GPU_CMD_GET_DISPLAY_INFO.
    GetDisplayInfo,
    /// VIRTIO_GPU_CMD_GET_EDID.
    GetEdid {
        /// Scanout whose EDID is asked for.
        scanout_id: u32,
    },
    /// VIRTIO_GPU_CMD_RESOURCE_CREATE_2D.
    ResourceCreate2d {
        /// Guest-chosen id (0 is invalid).
        resource_id: u32,
        /// Pixel format.
        format: PixelFormat,
        /// Width in pixels.
        width: u32,
        /// Height in pixels.
        height: u32,
    },
    /// VIRTIO_GPU_CMD_RESOURCE_UNREF.
    ResourceUnref {
        /// Resource to destroy.
        resource_id: u32,
    },
    /// VIRTIO_GPU_CMD_SET_SCANOUT.
    SetScanout {
        /// Scanout.
        scanout_id: u32,
        /// Resource to show; 0 disables the scanout.
        resource_id: u32,
        /// Part of the resource shown.
        rect: Rect,
    },
    /// VIRTIO_GPU_CMD_RESOURCE_FLUSH.
    ResourceFlush {
        /// Resource.
        resource_id: u32,
        /// Part of the resource that changed.
        rect: Rect,
    },
    /// VIRTIO_GPU_CMD_TRANSFER_TO_HOST_2D.
    TransferToHost2d {
        /// Resource.
        resource_id: u32,
        /// Destination rectangle in the resource.
        rect: Rect,
        /// Byte offset of the rectangle's first pixel in the backing; row `i` starts
        /// `i` strides (resource width times 4 bytes) after it.
        offset: u64,
    },
    /// VIRTIO_GPU_CMD_RESOURCE_ATTACH_BACKING with its entries.
    AttachBacking {
        /// Resource.
        resource_id: u32,
        /// The guest-physical ranges, in order.
        entries: Vec<MemEntry>,
    },
    /// VIRTIO_GPU_CMD_RESOURCE_DETACH_BACKING.
    DetachBacking {
        /// Resource.
        resource_id: u32,
    },
    /// VIRTIO_GPU_CMD_GET_CAPSET_INFO.
    GetCapsetInfo {
        /// Index of the capset, below the configuration's num_capsets.
        capset_index: u32,
    },
    /// VIRTIO_GPU_CMD_GET_CAPSET.
    GetCapset {
        /// Capset id (VIRTIO_GPU_CAPSET_*).
        capset_id: u32,
        /// Version asked for, at most the capset's max version.
        capset_version: u32,
    },
    /// VIRTIO_GPU_CMD_CTX_CREATE.
    CtxCreate(CtxCreate),
    /// VIRTIO_GPU_CMD_CTX_DESTROY.
    CtxDestroy {
        /// Context (from the header).
        ctx_id: u32,
    },
    /// VIRTIO_GPU_CMD_CTX_ATTACH_RESOURCE.
    CtxAttachResource {
        /// Context (from the header).
        ctx_id: u32,
        /// Resource.
        resource_id: u32,
    },
    /// VIRTIO_GPU_CMD_CTX_DETACH_RESOURCE.
    CtxDetachResource {
        /// Context (from the header).
        ctx_id: u32,
        /// Resource.
        resource_id: u32,
    },
    /// VIRTIO_GPU_CMD_RESOURCE_CREATE_3D.
    ResourceCreate3d(ResourceCreate3d),
    /// VIRTIO_GPU_CMD_TRANSFER_TO_HOST_3D.
    TransferToHost3d(Transfer3d),
    /// VIRTIO_GPU_CMD_TRANSFER_FROM_HOST_3D.
    TransferFromHost3d(Transfer3d),
    /// VIRTIO_GPU_CMD_SUBMIT_3D with its command stream.
    Submit3d {
        /// Context (from the header).
        ctx_id: u32,
        /// The commands.
        commands: CommandStream,
    },
    /// VIRTIO_GPU_CMD_RESOURCE_CREATE_BLOB with its memory entries.
    ResourceCreateBlob(ResourceCreateBlob),
    /// A command the specification defines that this device does not implement yet.
    Unimplemented(u32),
}

/// RESOURCE_CREATE_BLOB's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceCreateBlob {
    /// Guest-chosen id (0 is invalid).
    pub resource_id: u32,
    /// VIRTIO_GPU_BLOB_MEM_*: where the blob's memory lives.
    pub blob_mem: u32,
    /// VIRTIO_GPU_BLOB_FLAG_*.
    pub blob_flags: u32,
    /// The host object a host blob is made from (0 for guest blobs).
    pub blob_id: u64,
    /// Size in bytes.
    pub size: u64,
    /// The guest-physical ranges of a guest blob, in order.
    pub entries: Vec<MemEntry>,
}

/// A decoded control-queue request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlRequest {
    /// Its header (for the fence and the response).
    pub hdr: CtrlHeader,
    /// The command.
    pub cmd: ControlCommand,
}

/// Decodes a control-queue request from the device-readable bytes of a chain.
pub fn decode_control(buf: &[u8]) -> Result<ControlRequest, (Option<CtrlHeader>, ProtocolError)> {
    let hdr = CtrlHeader::decode(buf).map_err(|e| (None, e))?;
    let cmd = decode_command(&hdr, buf).map_err(|e| (Some(hdr), e))?;
    Ok(ControlRequest { hdr, cmd })
}

/// Reads the fixed part of command `hdr.ty`, `need` bytes, past its header. Bytes after the
/// structure are ignored, as the specification's fixed-size commands allow.
fn body<'a>(hdr: &CtrlHeader, buf: &'a [u8], need: usize) -> Result<Fields<'a>, ProtocolError> {
    let mut r = Fields::new(buf, need).ok_or(ProtocolError::ShortCommand {
        ty: hdr.ty,
        len: buf.len(),
        need,
    })?;
    r.skip(CTRL_HDR_SIZE);
    Ok(r)
}

fn decode_command(hdr: &CtrlHeader, buf: &[u8]) -> Result<ControlCommand, ProtocolError> {
    Ok(match hdr.ty {
        ty::GET_DISPLAY_INFO => ControlCommand::GetDisplayInfo,
        ty::GET_EDID => ControlCommand::GetEdid {
            scanout_id: body(hdr, buf, HDR_PLUS_8_SIZE)?.u32(),
        },
        ty::RESOURCE_CREATE_2D => {
            let mut r = body(hdr, buf, RESOURCE_CREATE_2D_SIZE)?;
            let (resource_id, format) = (r.u32(), r.u32());
            ControlCommand::ResourceCreate2d {
                resource_id,
                format: PixelFormat::from_wire(format)
                    .ok_or(ProtocolError::UnsupportedFormat(format))?,
                width: r.u32(),
                height: r.u32(),
            }
        }
        ty::RESOURCE_UNREF => ControlCommand::ResourceUnref {
            resource_id: body(hdr, buf, HDR_PLUS_8_SIZE)?.u32(),
        },
        ty::RESOURCE_DETACH_BACKING => ControlCommand::DetachBacking {
            resource_id: body(hdr, buf, HDR_PLUS_8_SIZE)?.u32(),
        },
        ty::SET_SCANOUT => {
            let mut r = body(hdr, buf, SET_SCANOUT_SIZE)?;
            let rect = r.rect();
            ControlCommand::SetScanout {
                rect,
                scanout_id: r.u32(),
                resource_id: r.u32(),
            }
        }
        ty::RESOURCE_FLUSH => {
            let mut r = body(hdr, buf, RESOURCE_FLUSH_SIZE)?;
            let rect = r.rect();
            ControlCommand::ResourceFlush {
                rect,
                resource_id: r.u32(),
            }
        }
        ty::TRANSFER_TO_HOST_2D => {
            let mut r = body(hdr, buf, TRANSFER_TO_HOST_2D_SIZE)?;
            let rect = r.rect();
            let offset = r.u64();
            ControlCommand::TransferToHost2d {
                rect,
                offset,
                resource_id: r.u32(),
            }
        }
        ty::RESOURCE_ATTACH_BACKING => decode_attach_backing(hdr, buf)?,
        ty::RESOURCE_CREATE_BLOB => decode_create_blob(hdr, buf)?,
        ty::GET_CAPSET_INFO => ControlCommand::GetCapsetInfo {
            capset_index: body(hdr, buf, HDR_PLUS_8_SIZE)?.u32(),
        },
        ty::GET_CAPSET => {
            let mut r = body(hdr, buf, HDR_PLUS_8_SIZE)?;
            ControlCommand::GetCapset {
                capset_id: r.u32(),
                capset_version: r.u32(),
            }
        }
        ty::CTX_CREATE => decode_ctx_create(hdr, buf)?,
        ty::CTX_DESTROY => ControlCommand::CtxDestroy { ctx_id: hdr.ctx_id },
        ty::CTX_ATTACH_RESOURCE => ControlCommand::CtxAttachResource {
            ctx_id: hdr.ctx_id,
            resource_id: body(hdr, buf, HDR_PLUS_8_SIZE)?.u32(),
        },
        ty::CTX_DETACH_RESOURCE => ControlCommand::CtxDetachResource {
            ctx_id: hdr.ctx_id,
            resource_id: body(hdr, buf, HDR_PLUS_8_SIZE)?.u32(),
        },
        ty::RESOURCE_CREATE_3D => {
            let mut r = body(hdr, buf, RESOURCE_CREATE_3D_SIZE)?;
            ControlCommand::ResourceCreate3d(ResourceCreate3d {
                resource_id: r.u32(),
                args: virgl::ResourceCreate3d {
                    target: r.u32(),
                    format: r.u32(),
                    bind: r.u32(),
                    width: r.u32(),
                    height: r.u32(),
                    depth: r.u32(),
                    array_size: r.u32(),
                    last_level: r.u32(),
                    nr_samples: r.u32(),
                    flags: r.u32(),
                },
            })
        }
        ty::TRANSFER_TO_HOST_3D => ControlCommand::TransferToHost3d(decode_transfer_3d(hdr, buf)?),
        ty::TRANSFER_FROM_HOST_3D => {
            ControlCommand::TransferFromHost3d(decode_transfer_3d(hdr, buf)?)
        }
        ty::SUBMIT_3D => decode_submit_3d(hdr, buf)?,
        t if (ty::FIRST_2D..=ty::LAST_2D).contains(&t)
            || (ty::FIRST_3D..=ty::LAST_3D).contains(&t) =>
        {
            ControlCommand::Unimplemented(t)
        }
        t => return Err(ProtocolError::UnknownCommand(t)),
    })
}

/// RESOURCE_ATTACH_BACKING: the entry count is bounded before the entries are read, and the
/// request must hold all of them.
fn decode_attach_backing(hdr: &CtrlHeader, buf: &[u8]) -> Result<ControlCommand, ProtocolError> {
    let mut r = body(hdr, buf, ATTACH_BACKING_SIZE)?;
    let (resource_id, nr_entries) = (r.u32(), r.u32());
    Ok(ControlCommand::AttachBacking {
        resource_id,
        entries: decode_entries(hdr, buf, ATTACH_BACKING_SIZE, nr_entries)?,
    })
}

/// The `nr_entries` memory entries that follow a command's fixed part of `fixed` bytes.
fn decode_entries(
    hdr: &CtrlHeader,
    buf: &[u8],
    fixed: usize,
    nr_entries: u32,
) -> Result<Vec<MemEntry>, ProtocolError> {
    if nr_entries > MAX_BACKING_ENTRIES {
        return Err(ProtocolError::TooManyEntries(nr_entries));
    }
    // nr_entries <= MAX_BACKING_ENTRIES, so this cannot overflow.
    let need = fixed + nr_entries as usize * MEM_ENTRY_SIZE;
    let mut r = body(hdr, buf, need)?;
    r.skip(fixed - CTRL_HDR_SIZE);
    Ok((0..nr_entries)
        .map(|_| {
            let addr = r.u64();
            let length = r.u32();
            r.skip(4);
            MemEntry { addr, length }
        })
        .collect())
}

fn decode_create_blob(hdr: &CtrlHeader, buf: &[u8]) -> Result<ControlCommand, ProtocolError> {
    let mut r = body(hdr, buf, RESOURCE_CREATE_BLOB_SIZE)?;
    let (resource_id, blob_mem, blob_flags, nr_entries) = (r.u32(), r.u32(), r.u32(), r.u32());
    let (blob_id, size) = (r.u64(), r.u64());
    Ok(ControlCommand::ResourceCreateBlob(ResourceCreateBlob {
        resource_id,
        blob_mem,
        blob_flags,
        blob_id,
        size,
        entries: decode_entries(hdr, buf, RESOURCE_CREATE_BLOB_SIZE, nr_entries)?,
    }))
}

/// CTX_CREATE: nlen may not exceed the debug_name array it describes.
fn decode_ctx_create(hdr: &CtrlHeader, buf: &[u8]) -> Result<ControlCommand, ProtocolError> {
    let mut r = body(hdr, buf, CTX_CREATE_SIZE)?;
    let (nlen, context_init) = (r.u32(), r.u32());
    let name = r.take::<CTX_DEBUG_NAME_SIZE>();
    let debug_name = usize::try_from(nlen)
        .ok()
        .and_then(|n| name.get(..n))
        .ok_or(ProtocolError::DebugNameTooLong(nlen))?
        .to_vec();
    Ok(ControlCommand::CtxCreate(CtxCreate {
        ctx_id: hdr.ctx_id,
        context_init,
        debug_name,
    }))
}

/// TRANSFER_TO_HOST_3D and TRANSFER_FROM_HOST_3D share struct virtio_gpu_transfer_host_3d.
fn decode_transfer_3d(hdr: &CtrlHeader, buf: &[u8]) -> Result<Transfer3d, ProtocolError> {
    let mut r = body(hdr, buf, TRANSFER_HOST_3D_SIZE)?;
    let region = virgl::TransferBox {
        x: r.u32(),
        y: r.u32(),
        z: r.u32(),
        w: r.u32(),
        h: r.u32(),
        d: r.u32(),
    };
    let offset = r.u64();
    let resource_id = r.u32();
    Ok(Transfer3d {
        ctx_id: hdr.ctx_id,
        resource_id,
        transfer: virgl::Transfer {
            region,
            offset,
            level: r.u32(),
            stride: r.u32(),
            layer_stride: r.u32(),
        },
    })
}

/// SUBMIT_3D: the size is bounded and whole words before the stream is looked for, and the
/// request must hold all of it. Bytes after the stream are ignored, as after any structure.
fn decode_submit_3d(hdr: &CtrlHeader, buf: &[u8]) -> Result<ControlCommand, ProtocolError> {
    let size = body(hdr, buf, SUBMIT_3D_SIZE)?.u32();
    let len = usize::try_from(size)
        .ok()
        .filter(|&n| n <= MAX_SUBMIT_BYTES)
        .ok_or(ProtocolError::SubmitTooLarge(size))?;
    if len % DWORD != 0 {
        return Err(ProtocolError::SubmitUnaligned(size));
    }
    let need = SUBMIT_3D_SIZE
        .checked_add(len)
        .ok_or(ProtocolError::SubmitTooLarge(size))?;
    let stream = buf
        .get(SUBMIT_3D_SIZE..need)
        .ok_or(ProtocolError::ShortCommand {
            ty: hdr.ty,
            len: buf.len(),
            need,
        })?;
    Ok(ControlCommand::Submit3d {
        ctx_id: hdr.ctx_id,
        commands: CommandStream::from_le_bytes(stream),
    })
}

/// A decoded cursor-queue command (struct virtio_gpu_update_cursor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CursorCommand {
    /// true for UPDATE_CURSOR (new image), false for MOVE_CURSOR.
    pub update: bool,
    /// Scanout the cursor is on.
    pub scanout_id: u32,
    /// Position.
    pub x: u32,
    /// Position.
    pub y: u32,
    /// Cursor image resource (0 hides the cursor).
    pub resource_id: u32,
    /// Hot spot.
    pub hot_x: u32,
    /// Hot spot.
    pub hot_y: u32,
}

/// Decodes a cursor-queue request.
pub fn decode_cursor(buf: &[u8]) -> Result<CursorCommand, ProtocolError> {
    let hdr = CtrlHeader::decode(buf)?;
    let update = match hdr.ty {
        ty::UPDATE_CURSOR => true,
        ty::MOVE_CURSOR => false,
        t => return Err(ProtocolError::UnknownCommand(t)),
    };
    let mut r = Fields::new(buf, CURSOR_CMD_SIZE).ok_or(ProtocolError::ShortCommand {
        ty: hdr.ty,
        len: buf.len(),
        need: CURSOR_CMD_SIZE,
    })?;
    r.skip(CTRL_HDR_SIZE);
    let (scanout_id, x, y) = (r.u32(), r.u32(), r.u32());
    r.skip(4);
    Ok(CursorCommand {
        update,
        scanout_id,
        x,
        y,
        resource_id: r.u32(),
        hot_x: r.u32(),
        hot_y: r.u32(),
    })
}

/// One scanout of a display-info response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DisplayOne {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Whether the scanout is connected.
    pub enabled: bool,
}

/// A device response to a control-queue request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// VIRTIO_GPU_RESP_OK_NODATA.
    OkNoData,
    /// VIRTIO_GPU_RESP_OK_DISPLAY_INFO with up to [`MAX_SCANOUTS`] scanouts.
    OkDisplayInfo(Vec<DisplayOne>),
    /// VIRTIO_GPU_RESP_OK_EDID with an EDID of at most [`EDID_BLOB_SIZE`] bytes.
    OkEdid(Vec<u8>),
    /// VIRTIO_GPU_RESP_OK_CAPSET_INFO.
    OkCapsetInfo {
        /// Capset id (VIRTIO_GPU_CAPSET_*).
        capset_id: u32,
        /// Newest version of the capset the device has.
        capset_max_version: u32,
        /// Largest size in bytes of any of its versions.
        capset_max_size: u32,
    },
    /// VIRTIO_GPU_RESP_OK_CAPSET: the capset's bytes follow the header.
    OkCapset(Vec<u8>),
    /// A VIRTIO_GPU_RESP_ERR_* code.
    Err(u32),
}

impl Response {
    /// Encodes the response to the request whose header is `req` (fence fields are echoed).
    pub fn encode(&self, req: &CtrlHeader) -> Vec<u8> {
        let capacity = match self {
            Response::OkCapset(data) => CTRL_HDR_SIZE.saturating_add(data.len()),
            _ => RESP_EDID_SIZE,
        };
        let mut out = Vec::with_capacity(capacity);
        match self {
            Response::OkNoData => req.response(ty::OK_NODATA).encode(&mut out),
            Response::Err(code) => req.response(*code).encode(&mut out),
            Response::OkDisplayInfo(scanouts) => {
                req.response(ty::OK_DISPLAY_INFO).encode(&mut out);
                for i in 0..MAX_SCANOUTS {
                    let one = scanouts.get(i).copied().unwrap_or_default();
                    for v in [0, 0, one.width, one.height, u32::from(one.enabled), 0] {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                }
            }
            Response::OkEdid(edid) => {
                req.response(ty::OK_EDID).encode(&mut out);
                let edid = &edid[..edid.len().min(EDID_BLOB_SIZE)];
                // At most EDID_BLOB_SIZE, a u32.
                out.extend_from_slice(&(edid.len() as u32).to_le_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(edid);
                out.resize(RESP_EDID_SIZE, 0);
            }
            Response::OkCapsetInfo {
                capset_id,
                capset_max_version,
                capset_max_size,
            } => {
                req.response(ty::OK_CAPSET_INFO).encode(&mut out);
                for v in [*capset_id, *capset_max_version, *capset_max_size, 0] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Response::OkCapset(data) => {
                req.response(ty::OK_CAPSET).encode(&mut out);
                out.extend_from_slice(data);
            }
        }
        out
    }
}

/// Little-endian field reader over a buffer already checked to hold `need` bytes.
struct Fields<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    fn new(buf: &'a [u8], need: usize) -> Option<Self> {
        buf.get(..need).map(|buf| Fields { buf, at: 0 })
    }

    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        if let Some(src) = self.buf.get(self.at..self.at + N) {
            out.copy_from_slice(src);
        }
        self.at += N;
        out
    }

    fn skip(&mut self, n: usize) {
        self.at += n;
    }

    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }

    fn rect(&mut self) -> Rect {
        Rect {
            x: self.u32(),
            y: self.u32(),
            width: self.u32(),
            height: self.u32(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr_bytes(ty: u32, flags: u32, fence: u64) -> Vec<u8> {
        let mut v = Vec::new();
        CtrlHeader {
            ty,
            flags,
            fence_id: fence,
            ctx_id: 7,
            ring_idx: 3,
        }
        .encode(&mut v);
        v
    }

    #[test]
    fn header_round_trip() {
        let b = hdr_bytes(ty::GET_DISPLAY_INFO, FLAG_FENCE, 42);
        assert_eq!(b.len(), CTRL_HDR_SIZE);
        let h = CtrlHeader::decode(&b).unwrap();
        assert_eq!(
            (h.ty, h.flags, h.fence_id, h.ctx_id, h.ring_idx),
            (0x100, 1, 42, 7, 3)
        );
    }

    #[test]
    fn short_and_unknown_requests_map_to_error_codes() {
        let e = decode_control(&[0u8; 23]).unwrap_err();
        assert_eq!(e, (None, ProtocolError::ShortHeader(23)));
        assert_eq!(e.1.response_code(), ty::ERR_UNSPEC);
        let (hdr, e) = decode_control(&hdr_bytes(0x1234, 0, 0)).unwrap_err();
        assert_eq!(hdr.map(|h| h.ty), Some(0x1234));
        assert_eq!(e, ProtocolError::UnknownCommand(0x1234));
        // Response codes are not commands.
        assert!(decode_control(&hdr_bytes(ty::OK_NODATA, 0, 0)).is_err());
    }

    #[test]
    fn known_but_unimplemented_commands_decode() {
        let req = decode_control(&hdr_bytes(ty::LAST_3D, 0, 0)).unwrap();
        assert_eq!(req.cmd, ControlCommand::Unimplemented(ty::LAST_3D));
    }

    #[test]
    fn display_info_response_layout_and_fence_echo() {
        let req = CtrlHeader::decode(&hdr_bytes(ty::GET_DISPLAY_INFO, FLAG_FENCE, 9)).unwrap();
        let out = Response::OkDisplayInfo(vec![DisplayOne {
            width: 1024,
            height: 768,
            enabled: true,
        }])
        .encode(&req);
        assert_eq!(out.len(), DISPLAY_INFO_SIZE);
        let h = CtrlHeader::decode(&out).unwrap();
        assert_eq!(
            (h.ty, h.flags, h.fence_id),
            (ty::OK_DISPLAY_INFO, FLAG_FENCE, 9)
        );
        let word = |i: usize| u32::from_le_bytes(out[i..i + 4].try_into().unwrap());
        assert_eq!((word(32), word(36), word(40)), (1024, 768, 1));
        assert_eq!(word(24 + 24 + 16), 0, "scanout 1 disabled");
    }

    #[test]
    fn unfenced_response_has_no_fence() {
        let req = CtrlHeader::decode(&hdr_bytes(ty::GET_DISPLAY_INFO, 0, 77)).unwrap();
        let h = CtrlHeader::decode(&Response::Err(ty::ERR_UNSPEC).encode(&req)).unwrap();
        assert_eq!((h.ty, h.flags, h.fence_id), (ty::ERR_UNSPEC, 0, 0));
    }

    #[test]
    fn cursor_commands() {
        let mut b = hdr_bytes(ty::MOVE_CURSOR, 0, 0);
        for v in [0u32, 10, 20, 0, 5, 1, 2, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let c = decode_cursor(&b).unwrap();
        assert_eq!(
            (c.update, c.x, c.y, c.resource_id, c.hot_x, c.hot_y),
            (false, 10, 20, 5, 1, 2)
        );
        assert!(matches!(
            decode_cursor(&b[..40]),
            Err(ProtocolError::ShortCommand { need: 56, .. })
        ));
        assert_eq!(
            decode_cursor(&hdr_bytes(ty::GET_DISPLAY_INFO, 0, 0)),
            Err(ProtocolError::UnknownCommand(0x100))
        );
    }

    /// A request of type `ty` with 32-bit body words `words`.
    fn request(ty: u32, words: &[u32]) -> Vec<u8> {
        let mut b = hdr_bytes(ty, 0, 0);
        for w in words {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b
    }

    fn cmd(buf: &[u8]) -> ControlCommand {
        decode_control(buf).unwrap().cmd
    }

    fn refusal(buf: &[u8]) -> (ProtocolError, u32) {
        let (hdr, e) = decode_control(buf).unwrap_err();
        assert!(hdr.is_some(), "the header is echoed");
        let code = e.response_code();
        (e, code)
    }

    #[test]
    fn decodes_the_2d_commands() {
        assert_eq!(
            cmd(&request(ty::RESOURCE_CREATE_2D, &[5, 2, 64, 32])),
            ControlCommand::ResourceCreate2d {
                resource_id: 5,
                format: PixelFormat::B8G8R8X8,
                width: 64,
                height: 32
            }
        );
        assert_eq!(
            cmd(&request(ty::RESOURCE_UNREF, &[5, 0])),
            ControlCommand::ResourceUnref { resource_id: 5 }
        );
        let r = Rect {
            x: 1,
            y: 2,
            width: 3,
            height: 4,
        };
        assert_eq!(
            cmd(&request(ty::SET_SCANOUT, &[1, 2, 3, 4, 0, 5])),
            ControlCommand::SetScanout {
                scanout_id: 0,
                resource_id: 5,
                rect: r
            }
        );
        assert_eq!(
            cmd(&request(ty::RESOURCE_FLUSH, &[1, 2, 3, 4, 5, 0])),
            ControlCommand::ResourceFlush {
                resource_id: 5,
                rect: r
            }
        );
        assert_eq!(
            cmd(&request(
                ty::TRANSFER_TO_HOST_2D,
                &[1, 2, 3, 4, 0x10, 0x1, 5, 0]
            )),
            ControlCommand::TransferToHost2d {
                resource_id: 5,
                rect: r,
                offset: 0x1_0000_0010
            }
        );
        assert_eq!(
            cmd(&request(ty::RESOURCE_DETACH_BACKING, &[5, 0])),
            ControlCommand::DetachBacking { resource_id: 5 }
        );
        assert_eq!(
            cmd(&request(ty::GET_EDID, &[0, 0])),
            ControlCommand::GetEdid { scanout_id: 0 }
        );
        assert_eq!(
            cmd(&request(
                ty::RESOURCE_ATTACH_BACKING,
                &[5, 2, 0x1000, 0, 4096, 0, 0x3000, 0x1, 100, 0]
            )),
            ControlCommand::AttachBacking {
                resource_id: 5,
                entries: vec![
                    MemEntry {
                        addr: 0x1000,
                        length: 4096
                    },
                    MemEntry {
                        addr: 0x1_0000_3000,
                        length: 100
                    }
                ]
            }
        );
    }

    #[test]
    fn all_linux_formats_and_nothing_else() {
        for (wire, rgb) in [
            (1, [2, 1, 0]),
            (2, [2, 1, 0]),
            (3, [1, 2, 3]),
            (4, [1, 2, 3]),
            (67, [0, 1, 2]),
            (68, [3, 2, 1]),
            (121, [3, 2, 1]),
            (134, [0, 1, 2]),
        ] {
            let f = PixelFormat::from_wire(wire).unwrap();
            assert_eq!(f.rgb_offsets(), rgb, "{f:?}");
        }
        for wire in [0, 5, 66, 100, 0xffff_ffff] {
            assert_eq!(PixelFormat::from_wire(wire), None);
            assert_eq!(
                refusal(&request(ty::RESOURCE_CREATE_2D, &[1, wire, 8, 8])),
                (
                    ProtocolError::UnsupportedFormat(wire),
                    ty::ERR_INVALID_PARAMETER
                )
            );
        }
    }

    #[test]
    fn short_requests_are_invalid_parameters() {
        for (t, full) in [
            (ty::RESOURCE_CREATE_2D, RESOURCE_CREATE_2D_SIZE),
            (ty::RESOURCE_UNREF, HDR_PLUS_8_SIZE),
            (ty::SET_SCANOUT, SET_SCANOUT_SIZE),
            (ty::RESOURCE_FLUSH, RESOURCE_FLUSH_SIZE),
            (ty::TRANSFER_TO_HOST_2D, TRANSFER_TO_HOST_2D_SIZE),
            (ty::RESOURCE_ATTACH_BACKING, ATTACH_BACKING_SIZE),
            (ty::RESOURCE_DETACH_BACKING, HDR_PLUS_8_SIZE),
            (ty::GET_EDID, HDR_PLUS_8_SIZE),
        ] {
            let mut b = request(t, &[1, 2, 0, 0, 1, 1, 0, 0]);
            b.resize(full, 0);
            // Format 2 and one entry where they matter; one byte less is refused.
            if t == ty::RESOURCE_ATTACH_BACKING {
                b[28..32].copy_from_slice(&0u32.to_le_bytes());
            }
            assert!(decode_control(&b).is_ok(), "{t:#x} at full size");
            let (e, code) = refusal(&b[..full - 1]);
            assert_eq!(
                e,
                ProtocolError::ShortCommand {
                    ty: t,
                    len: full - 1,
                    need: full
                }
            );
            assert_eq!(code, ty::ERR_INVALID_PARAMETER);
            // Bytes past the structure are ignored, as for any fixed-size command.
            b.extend_from_slice(&[0xee; 40]);
            assert!(decode_control(&b).is_ok(), "{t:#x} with trailing bytes");
        }
    }

    #[test]
    fn attach_backing_entry_counts() {
        // Two entries announced, one present.
        let b = request(ty::RESOURCE_ATTACH_BACKING, &[1, 2, 0x1000, 0, 16, 0]);
        assert_eq!(
            refusal(&b),
            (
                ProtocolError::ShortCommand {
                    ty: ty::RESOURCE_ATTACH_BACKING,
                    len: 48,
                    need: 64
                },
                ty::ERR_INVALID_PARAMETER
            )
        );
        // Above the limit: refused before the entries are looked at.
        for n in [MAX_BACKING_ENTRIES + 1, u32::MAX] {
            assert_eq!(
                refusal(&request(ty::RESOURCE_ATTACH_BACKING, &[1, n])),
                (ProtocolError::TooManyEntries(n), ty::ERR_INVALID_PARAMETER)
            );
        }
        // At the limit it decodes (the request is just under 256 KiB).
        let mut b = request(ty::RESOURCE_ATTACH_BACKING, &[1, MAX_BACKING_ENTRIES]);
        b.resize(
            ATTACH_BACKING_SIZE + MAX_BACKING_ENTRIES as usize * MEM_ENTRY_SIZE,
            0,
        );
        let ControlCommand::AttachBacking { entries, .. } = cmd(&b) else {
            panic!("not an attach");
        };
        assert_eq!(entries.len(), MAX_BACKING_ENTRIES as usize);
        // Zero entries decode; the device model refuses them.
        assert!(decode_control(&request(ty::RESOURCE_ATTACH_BACKING, &[1, 0])).is_ok());
    }

    #[test]
    fn garbage_never_panics() {
        // A cheap deterministic generator: every command type, every length up to 160.
        let mut x = 0x1234_5678u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        for t in (ty::FIRST_2D..=ty::LAST_2D + 2).chain(ty::FIRST_3D..=ty::LAST_3D + 2) {
            for len in 0..160 {
                let mut b: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                if len >= 4 {
                    b[..4].copy_from_slice(&t.to_le_bytes());
                }
                let _ = decode_control(&b);
                let _ = decode_cursor(&b);
            }
        }
    }

    #[test]
    fn rect_math() {
        let r = |x, y, width, height| Rect {
            x,
            y,
            width,
            height,
        };
        assert!(r(0, 0, 64, 64).is_inside(64, 64));
        assert!(r(63, 63, 1, 1).is_inside(64, 64));
        assert!(!r(63, 63, 2, 1).is_inside(64, 64));
        assert!(!r(0, 0, 0, 1).is_inside(64, 64));
        assert!(!r(u32::MAX, 0, 1, 1).is_inside(u32::MAX, 1));
        assert!(!r(1, 0, u32::MAX, 1).is_inside(u32::MAX, 1));
        assert_eq!(
            r(0, 0, 10, 10).intersect(&r(5, 5, 10, 10)),
            Some(r(5, 5, 5, 5))
        );
        assert_eq!(r(0, 0, 5, 5).intersect(&r(5, 0, 5, 5)), None, "touching");
        assert_eq!(
            r(u32::MAX, u32::MAX, u32::MAX, u32::MAX).intersect(&r(0, 0, u32::MAX, u32::MAX)),
            None
        );
    }

    #[test]
    fn edid_response_layout() {
        let req = CtrlHeader::decode(&hdr_bytes(ty::GET_EDID, FLAG_FENCE, 3)).unwrap();
        let out = Response::OkEdid(vec![0xab; 128]).encode(&req);
        assert_eq!(out.len(), RESP_EDID_SIZE);
        let h = CtrlHeader::decode(&out).unwrap();
        assert_eq!((h.ty, h.fence_id), (ty::OK_EDID, 3));
        assert_eq!(&out[24..28], &128u32.to_le_bytes());
        assert_eq!(&out[32..160], &[0xab; 128][..]);
        assert!(out[160..].iter().all(|&b| b == 0));
    }

    /// A request of type `ty` with 32-bit body words `words` and then `tail`, as the Linux
    /// driver lays it out (context 7 in the header).
    fn request_with(ty: u32, words: &[u32], tail: &[u8]) -> Vec<u8> {
        let mut b = request(ty, words);
        b.extend_from_slice(tail);
        b
    }

    /// CTX_CREATE as Linux sends it: nlen is strlen of the task name, strscpy'd into
    /// debug_name.
    fn ctx_create_bytes(nlen: u32, context_init: u32, name: &[u8]) -> Vec<u8> {
        let mut debug_name = [0u8; CTX_DEBUG_NAME_SIZE];
        debug_name[..name.len()].copy_from_slice(name);
        request_with(ty::CTX_CREATE, &[nlen, context_init], &debug_name)
    }

    /// SUBMIT_3D as Linux sends it: the struct, then the stream in the next descriptor.
    fn submit_bytes(size: u32, stream: &[u32]) -> Vec<u8> {
        let mut b = request(ty::SUBMIT_3D, &[size, 0]);
        for w in stream {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// One well-formed request of every 3D command, with what it decodes to.
    fn three_d_samples() -> Vec<(Vec<u8>, ControlCommand)> {
        let transfer = Transfer3d {
            ctx_id: 7,
            resource_id: 9,
            transfer: virgl::Transfer {
                region: virgl::TransferBox {
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
            },
        };
        let transfer_words = [1, 2, 3, 4, 5, 6, 0x40, 2, 9, 1, 256, 4096];
        vec![
            (
                request(ty::GET_CAPSET_INFO, &[1, 0]),
                ControlCommand::GetCapsetInfo { capset_index: 1 },
            ),
            (
                request(ty::GET_CAPSET, &[2, 1]),
                ControlCommand::GetCapset {
                    capset_id: 2,
                    capset_version: 1,
                },
            ),
            (
                ctx_create_bytes(7, 2, b"kmscube"),
                ControlCommand::CtxCreate(CtxCreate {
                    ctx_id: 7,
                    context_init: 2,
                    debug_name: b"kmscube".to_vec(),
                }),
            ),
            (
                request(ty::CTX_DESTROY, &[]),
                ControlCommand::CtxDestroy { ctx_id: 7 },
            ),
            (
                request(ty::CTX_ATTACH_RESOURCE, &[9, 0]),
                ControlCommand::CtxAttachResource {
                    ctx_id: 7,
                    resource_id: 9,
                },
            ),
            (
                request(ty::CTX_DETACH_RESOURCE, &[9, 0]),
                ControlCommand::CtxDetachResource {
                    ctx_id: 7,
                    resource_id: 9,
                },
            ),
            (
                request(
                    ty::RESOURCE_CREATE_3D,
                    &[9, 2, 67, 0x2, 640, 480, 1, 1, 0, 0, 0x1, 0],
                ),
                ControlCommand::ResourceCreate3d(ResourceCreate3d {
                    resource_id: 9,
                    args: virgl::ResourceCreate3d {
                        target: 2,
                        format: 67,
                        bind: 0x2,
                        width: 640,
                        height: 480,
                        depth: 1,
                        array_size: 1,
                        last_level: 0,
                        nr_samples: 0,
                        flags: 0x1,
                    },
                }),
            ),
            (
                request(ty::TRANSFER_TO_HOST_3D, &transfer_words),
                ControlCommand::TransferToHost3d(transfer),
            ),
            (
                request(ty::TRANSFER_FROM_HOST_3D, &transfer_words),
                ControlCommand::TransferFromHost3d(transfer),
            ),
            (
                submit_bytes(12, &[0x0001_0203, 0xdead_beef, 0]),
                ControlCommand::Submit3d {
                    ctx_id: 7,
                    commands: vec![0x0001_0203, 0xdead_beef, 0].into(),
                },
            ),
        ]
    }

    #[test]
    fn decodes_the_3d_commands() {
        let sizes = [
            HDR_PLUS_8_SIZE,
            HDR_PLUS_8_SIZE,
            CTX_CREATE_SIZE,
            CTRL_HDR_SIZE,
            HDR_PLUS_8_SIZE,
            HDR_PLUS_8_SIZE,
            RESOURCE_CREATE_3D_SIZE,
            TRANSFER_HOST_3D_SIZE,
            TRANSFER_HOST_3D_SIZE,
            SUBMIT_3D_SIZE + 12,
        ];
        // The sizes of the Linux uapi structures.
        assert_eq!(
            (
                CTX_CREATE_SIZE,
                RESOURCE_CREATE_3D_SIZE,
                TRANSFER_HOST_3D_SIZE
            ),
            (96, 72, 72)
        );
        for ((bytes, want), size) in three_d_samples().into_iter().zip(sizes) {
            assert_eq!(bytes.len(), size, "{want:?}");
            let req = decode_control(&bytes).unwrap();
            assert_eq!(req.cmd, want);
            assert_eq!(req.hdr.ctx_id, 7);
            // Bytes past the structure (or past the stream) are ignored.
            let mut longer = bytes.clone();
            longer.extend_from_slice(&[0xee; 13]);
            assert_eq!(cmd(&longer), want, "with trailing bytes");
        }
    }

    #[test]
    fn every_truncation_of_a_3d_command_is_refused() {
        for (bytes, want) in three_d_samples() {
            let t = u32::from_le_bytes(bytes[..4].try_into().unwrap());
            for len in 0..bytes.len() {
                let (hdr, e) = decode_control(&bytes[..len]).unwrap_err();
                if len < CTRL_HDR_SIZE {
                    assert_eq!((hdr, e), (None, ProtocolError::ShortHeader(len)));
                    continue;
                }
                // The fixed part first, then (for SUBMIT_3D) the stream it announces.
                let need = if t == ty::SUBMIT_3D && len < SUBMIT_3D_SIZE {
                    SUBMIT_3D_SIZE
                } else {
                    bytes.len()
                };
                assert_eq!(hdr.map(|h| h.ty), Some(t));
                assert_eq!(
                    e,
                    ProtocolError::ShortCommand { ty: t, len, need },
                    "{want:?}"
                );
                assert_eq!(e.response_code(), ty::ERR_INVALID_PARAMETER);
            }
        }
    }

    #[test]
    fn ctx_create_name_and_capset() {
        let name = [b'n'; CTX_DEBUG_NAME_SIZE];
        // A name filling the whole array, without a NUL, is whole.
        let ControlCommand::CtxCreate(c) = cmd(&ctx_create_bytes(64, 0, &name)) else {
            panic!("not a ctx_create");
        };
        assert_eq!(c.debug_name, name.to_vec());
        assert_eq!(c.capset_id(), 0, "no CONTEXT_INIT: the device chooses");
        // nlen 0, and the capset id is the low 8 bits of context_init.
        let ControlCommand::CtxCreate(c) = cmd(&ctx_create_bytes(0, 0x0000_0104, b"x")) else {
            panic!("not a ctx_create");
        };
        assert_eq!((c.debug_name.len(), c.capset_id()), (0, 4));
        for nlen in [65, 0x100, u32::MAX] {
            assert_eq!(
                refusal(&ctx_create_bytes(nlen, 0, b"x")),
                (
                    ProtocolError::DebugNameTooLong(nlen),
                    ty::ERR_INVALID_PARAMETER
                )
            );
        }
    }

    #[test]
    fn submit_3d_sizes() {
        // Not whole words.
        for size in [1, 2, 3, 6, 4097] {
            assert_eq!(
                refusal(&submit_bytes(size, &[0; 1100])),
                (
                    ProtocolError::SubmitUnaligned(size),
                    ty::ERR_INVALID_PARAMETER
                )
            );
        }
        // More than the request carries.
        assert_eq!(
            refusal(&submit_bytes(16, &[1, 2])),
            (
                ProtocolError::ShortCommand {
                    ty: ty::SUBMIT_3D,
                    len: 40,
                    need: 48
                },
                ty::ERR_INVALID_PARAMETER
            )
        );
        // More than any request can carry: refused before the stream is looked for.
        for size in [MAX_SUBMIT_BYTES as u32 + 4, u32::MAX - 3, u32::MAX] {
            assert_eq!(
                refusal(&submit_bytes(size, &[])),
                (
                    ProtocolError::SubmitTooLarge(size),
                    ty::ERR_INVALID_PARAMETER
                )
            );
        }
        // An empty stream decodes; the renderer decides what it means.
        assert_eq!(
            cmd(&submit_bytes(0, &[])),
            ControlCommand::Submit3d {
                ctx_id: 7,
                commands: CommandStream::default()
            }
        );
        // At the limit, the request is exactly MAX_REQUEST_BYTES.
        let words = MAX_SUBMIT_BYTES / DWORD;
        let stream: Vec<u32> = (0..words as u32).collect();
        let b = submit_bytes(MAX_SUBMIT_BYTES as u32, &stream);
        assert_eq!(b.len(), MAX_REQUEST_BYTES);
        let ControlCommand::Submit3d { mut commands, .. } = cmd(&b) else {
            panic!("not a submit");
        };
        assert_eq!(commands.len_bytes(), MAX_SUBMIT_BYTES);
        assert_eq!(commands.dwords(), &stream[..]);
        commands.dwords_mut()[0] = 5;
        assert_eq!(
            format!("{commands:?}"),
            format!("CommandStream({words} dwords)")
        );
        assert_eq!(commands.into_dwords()[..2], [5, 1]);
    }

    #[test]
    fn capset_responses_layout() {
        let req = CtrlHeader::decode(&hdr_bytes(ty::GET_CAPSET_INFO, FLAG_FENCE, 5)).unwrap();
        let out = Response::OkCapsetInfo {
            capset_id: 2,
            capset_max_version: 2,
            capset_max_size: 0x1234,
        }
        .encode(&req);
        assert_eq!(out.len(), RESP_CAPSET_INFO_SIZE);
        let h = CtrlHeader::decode(&out).unwrap();
        assert_eq!((h.ty, h.fence_id), (ty::OK_CAPSET_INFO, 5));
        assert_eq!(&out[24..32], &[2, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(&out[32..40], &[0x34, 0x12, 0, 0, 0, 0, 0, 0]);

        let req = CtrlHeader::decode(&hdr_bytes(ty::GET_CAPSET, 0, 0)).unwrap();
        let caps: Vec<u8> = (0..=255).collect();
        let out = Response::OkCapset(caps.clone()).encode(&req);
        assert_eq!(out.len(), CTRL_HDR_SIZE + caps.len());
        assert_eq!(CtrlHeader::decode(&out).unwrap().ty, ty::OK_CAPSET);
        assert_eq!(&out[CTRL_HDR_SIZE..], &caps[..]);
        let empty = Response::OkCapset(Vec::new()).encode(&req);
        assert_eq!(empty.len(), CTRL_HDR_SIZE);
    }
}
