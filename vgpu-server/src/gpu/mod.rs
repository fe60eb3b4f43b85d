//! The virtio-gpu device: wire protocol (decoding, hop 4), device model (execution, hop 5; 3D
//! commands in `three_d` through virglrenderer), fenced completions, the EDID it reports and
//! the headless scanout dumps; the private load capset (`load`) and compute capset (`compute`).

pub mod compute;
pub mod device;
pub mod dump;
pub mod edid;
#[cfg(test)]
pub(crate) mod fake_backend;
pub mod fence;
pub mod load;
pub mod protocol;
pub mod three_d;

pub use device::{DisplayConfig, GpuDevice};
