//! The virtio-gpu device: wire protocol (decoding, hop 4), device model (execution, hop 5), the
//! EDID it reports and the headless scanout dumps.

pub mod device;
pub mod dump;
pub mod edid;
pub mod protocol;

pub use device::{DisplayConfig, GpuDevice};
