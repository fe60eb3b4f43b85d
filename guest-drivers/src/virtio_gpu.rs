//! Virtio-gpu control messages: the request header and the display-info response.
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
/// `VIRTIO_GPU_CMD_CTX_CREATE` (3D).
pub const CMD_CTX_CREATE: u32 = bindings::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_CTX_CREATE;
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

/// `VIRTIO_GPU_CMD_RESOURCE_DETACH_BACKING`.
pub fn resource_detach_backing(resource_id: u32) -> Vec<u8> {
    request(CMD_RESOURCE_DETACH_BACKING, &[resource_id, 0])
}

/// `VIRTIO_GPU_CMD_GET_EDID`.
pub fn get_edid(scanout_id: u32) -> Vec<u8> {
    request(CMD_GET_EDID, &[scanout_id, 0])
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
}
