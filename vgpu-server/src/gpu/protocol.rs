//! virtio-gpu wire format: decoding of guest requests and encoding of device responses.
//!
//! Pure functions over byte slices (no I/O, no guest memory): the queue layer hands in the
//! device-readable bytes of a descriptor chain, and gets back the bytes to write into its
//! device-writable part. Every decode failure maps to a `VIRTIO_GPU_RESP_ERR_*` code, so a
//! malformed request still completes with an error response.

use virtio_bindings::virtio_gpu as vg;

/// Size of struct virtio_gpu_ctrl_hdr.
pub const CTRL_HDR_SIZE: usize = 24;
/// Number of scanout slots in a display-info response (VIRTIO_GPU_MAX_SCANOUTS).
pub const MAX_SCANOUTS: usize = vg::VIRTIO_GPU_MAX_SCANOUTS as usize;
/// Size of struct virtio_gpu_resp_display_info.
pub const DISPLAY_INFO_SIZE: usize = CTRL_HDR_SIZE + MAX_SCANOUTS * 24;
/// Size of struct virtio_gpu_update_cursor (used by both cursor commands).
pub const CURSOR_CMD_SIZE: usize = CTRL_HDR_SIZE + 16 + 16;

/// The request asks for a fence: the response is returned once the work it covers is done.
pub const FLAG_FENCE: u32 = vg::VIRTIO_GPU_FLAG_FENCE;
/// The request's ring_idx field is valid (context-init rings).
pub const FLAG_INFO_RING_IDX: u32 = vg::VIRTIO_GPU_FLAG_INFO_RING_IDX;

/// Command and response type codes (struct virtio_gpu_ctrl_hdr.type).
pub mod ty {
    use virtio_bindings::virtio_gpu as vg;
    /// Query the scanouts.
    pub const GET_DISPLAY_INFO: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_CMD_GET_DISPLAY_INFO;
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
    /// Unspecified error.
    pub const ERR_UNSPEC: u32 = vg::virtio_gpu_ctrl_type_VIRTIO_GPU_RESP_ERR_UNSPEC;
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
}

impl ProtocolError {
    /// The response code a guest gets for this failure.
    pub fn response_code(&self) -> u32 {
        match self {
            ProtocolError::ShortHeader(_) | ProtocolError::UnknownCommand(_) => ty::ERR_UNSPEC,
            ProtocolError::ShortCommand { .. } => ty::ERR_INVALID_PARAMETER,
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

/// A decoded control-queue command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlCommand {
    /// VIRTIO_GPU_CMD_GET_DISPLAY_INFO.
    GetDisplayInfo,
    /// A command the specification defines that this device does not implement yet.
    Unimplemented(u32),
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
    let cmd = match hdr.ty {
        ty::GET_DISPLAY_INFO => ControlCommand::GetDisplayInfo,
        t if (ty::FIRST_2D..=ty::LAST_2D).contains(&t)
            || (ty::FIRST_3D..=ty::LAST_3D).contains(&t) =>
        {
            ControlCommand::Unimplemented(t)
        }
        t => return Err((Some(hdr), ProtocolError::UnknownCommand(t))),
    };
    Ok(ControlRequest { hdr, cmd })
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
    /// A VIRTIO_GPU_RESP_ERR_* code.
    Err(u32),
}

impl Response {
    /// Encodes the response to the request whose header is `req` (fence fields are echoed).
    pub fn encode(&self, req: &CtrlHeader) -> Vec<u8> {
        let mut out = Vec::with_capacity(DISPLAY_INFO_SIZE);
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
}
