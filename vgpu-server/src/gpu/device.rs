//! The virtio-gpu device model: executes decoded commands and owns the device-specific
//! configuration (struct virtio_gpu_config).
//!
//! Control commands that need no GPU run here at once. (GPU-executing commands become command
//! groups handed to the scheduler and the backend; see docs/ARCHITECTURE.md.)

use log::{debug, trace};

use super::protocol::{ControlCommand, ControlRequest, CursorCommand, DisplayOne, Response, ty};

/// Smallest scanout edge accepted by `--display`.
pub const MIN_SCANOUT_EDGE: u32 = 16;
/// Largest scanout edge accepted by `--display` (the 16K limit of common GPUs and of the EDID
/// detailed timing descriptor's 12-bit fields is 4095; 16384 leaves room for tiled modes).
pub const MAX_SCANOUT_EDGE: u32 = 16384;

/// Size of the single scanout the device reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DisplayConfig {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

impl Default for DisplayConfig {
    fn default() -> Self {
        DisplayConfig {
            width: 1024,
            height: 768,
        }
    }
}

/// Errors of the device model.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    /// A display mode outside the supported range.
    #[error("display mode {0}x{1} outside {MIN_SCANOUT_EDGE}..={MAX_SCANOUT_EDGE} per edge")]
    BadMode(u32, u32),
    /// A display mode string that is not WIDTHxHEIGHT.
    #[error("display mode {0:?} is not WIDTHxHEIGHT")]
    BadModeSyntax(String),
}

impl std::str::FromStr for DisplayConfig {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || DeviceError::BadModeSyntax(s.to_string());
        let (w, h) = s.split_once('x').ok_or_else(bad)?;
        let (width, height) = (w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?);
        let edge = MIN_SCANOUT_EDGE..=MAX_SCANOUT_EDGE;
        if !edge.contains(&width) || !edge.contains(&height) {
            return Err(DeviceError::BadMode(width, height));
        }
        Ok(DisplayConfig { width, height })
    }
}

/// struct virtio_gpu_config: events_read, events_clear, num_scanouts, num_capsets.
const CONFIG_SIZE: usize = 16;
const CONFIG_EVENTS_READ: usize = 0;
const CONFIG_EVENTS_CLEAR: u64 = 4;
const CONFIG_NUM_SCANOUTS: usize = 8;
const CONFIG_NUM_CAPSETS: usize = 12;

/// Cursor state of the (single) scanout.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CursorState {
    /// Position.
    pub x: u32,
    /// Position.
    pub y: u32,
    /// Image resource, 0 when hidden.
    pub resource_id: u32,
}

/// The virtio-gpu device state of one vGPU.
#[derive(Debug)]
pub struct GpuDevice {
    display: DisplayConfig,
    events_read: u32,
    cursor: CursorState,
}

impl GpuDevice {
    /// Creates the device with one scanout of the given size.
    pub fn new(display: DisplayConfig) -> Self {
        GpuDevice {
            display,
            events_read: 0,
            cursor: CursorState::default(),
        }
    }

    /// Returns to the power-on state (the display configuration is kept).
    pub fn reset(&mut self) {
        *self = GpuDevice::new(self.display);
    }

    /// Current cursor state.
    pub fn cursor(&self) -> CursorState {
        self.cursor
    }

    /// Executes a control-queue request.
    pub fn execute(&mut self, req: &ControlRequest) -> Response {
        match req.cmd {
            ControlCommand::GetDisplayInfo => Response::OkDisplayInfo(vec![DisplayOne {
                width: self.display.width,
                height: self.display.height,
                enabled: true,
            }]),
            ControlCommand::Unimplemented(t) => {
                debug!("control command {t:#x} not implemented; ERR_UNSPEC");
                Response::Err(ty::ERR_UNSPEC)
            }
        }
    }

    /// Executes a cursor-queue command (cursor commands have no response).
    pub fn execute_cursor(&mut self, cmd: &CursorCommand) {
        trace!("cursor {cmd:?}");
        if cmd.scanout_id != 0 {
            debug!(
                "cursor command for scanout {} ignored; one scanout",
                cmd.scanout_id
            );
            return;
        }
        self.cursor.x = cmd.x;
        self.cursor.y = cmd.y;
        if cmd.update {
            self.cursor.resource_id = cmd.resource_id;
        }
    }

    /// Reads the device configuration; `offset`/`data` were validated against its 16 bytes
    /// as whole, naturally aligned 32-bit fields or parts of them.
    pub fn config_read(&self, offset: u64, data: &mut [u8]) {
        let mut bytes = [0u8; CONFIG_SIZE];
        for (at, v) in [
            (CONFIG_EVENTS_READ, self.events_read),
            (CONFIG_NUM_SCANOUTS, 1),
            (CONFIG_NUM_CAPSETS, 0),
        ] {
            bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        data.fill(0);
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        if let Some(src) = bytes.get(start..) {
            let n = src.len().min(data.len());
            data[..n].copy_from_slice(&src[..n]);
        }
    }

    /// Writes the device configuration: only events_clear is writable (write-1-to-clear).
    pub fn config_write(&mut self, offset: u64, data: &[u8]) {
        if offset == CONFIG_EVENTS_CLEAR && data.len() == 4 {
            let mut raw = [0u8; 4];
            raw.copy_from_slice(data);
            self.events_read &= !u32::from_le_bytes(raw);
        } else {
            debug!("write to read-only device config at {offset:#x} ignored");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::protocol::CtrlHeader;

    fn req(cmd: ControlCommand) -> ControlRequest {
        ControlRequest {
            hdr: CtrlHeader::default(),
            cmd,
        }
    }

    #[test]
    fn display_info_reports_the_configured_mode() {
        let mut dev = GpuDevice::new("1280x720".parse().unwrap());
        let Response::OkDisplayInfo(s) = dev.execute(&req(ControlCommand::GetDisplayInfo)) else {
            panic!("wrong response");
        };
        assert_eq!(
            s,
            vec![DisplayOne {
                width: 1280,
                height: 720,
                enabled: true
            }]
        );
        assert_eq!(
            dev.execute(&req(ControlCommand::Unimplemented(0x101))),
            Response::Err(ty::ERR_UNSPEC)
        );
    }

    #[test]
    fn mode_parsing_bounds() {
        assert_eq!(
            "1024x768".parse::<DisplayConfig>(),
            Ok(DisplayConfig::default())
        );
        assert!(matches!(
            "0x768".parse::<DisplayConfig>(),
            Err(DeviceError::BadMode(0, 768))
        ));
        assert!("99999x1".parse::<DisplayConfig>().is_err());
        assert!("1024*768".parse::<DisplayConfig>().is_err());
        assert!("x".parse::<DisplayConfig>().is_err());
    }

    #[test]
    fn config_space_reports_one_scanout() {
        let dev = GpuDevice::new(DisplayConfig::default());
        let mut b = [0u8; 4];
        dev.config_read(8, &mut b);
        assert_eq!(u32::from_le_bytes(b), 1);
        dev.config_read(12, &mut b);
        assert_eq!(u32::from_le_bytes(b), 0);
        dev.config_read(u64::MAX, &mut b);
        assert_eq!(b, [0; 4]);
    }

    #[test]
    fn cursor_updates_position_and_image() {
        let mut dev = GpuDevice::new(DisplayConfig::default());
        let cmd = CursorCommand {
            update: true,
            scanout_id: 0,
            x: 3,
            y: 4,
            resource_id: 9,
            hot_x: 0,
            hot_y: 0,
        };
        dev.execute_cursor(&cmd);
        dev.execute_cursor(&CursorCommand {
            update: false,
            x: 5,
            resource_id: 0,
            ..cmd
        });
        assert_eq!(
            dev.cursor(),
            CursorState {
                x: 5,
                y: 4,
                resource_id: 9
            }
        );
        dev.execute_cursor(&CursorCommand {
            scanout_id: 3,
            x: 100,
            ..cmd
        });
        assert_eq!(dev.cursor().x, 5);
    }
}
