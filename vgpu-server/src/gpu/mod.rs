//! The virtio-gpu device: wire protocol (decoding, hop 4) and device model (execution, hop 5).

pub mod device;
pub mod protocol;

pub use device::{DisplayConfig, GpuDevice};
