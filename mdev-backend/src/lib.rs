//! mdev-backend: executes vGPU work on the physical GPU and reports its completion fences
//! (hops 7 and 8 of the data path, see docs/ARCHITECTURE.md).
//!
//! The device drives a [`GpuBackend`]; [`virgl`] (virglrenderer on the host's EGL) is the first
//! implementation. [`compute`] executes CUDA work: a PTX executor on the CPU and the NVIDIA
//! driver behind one trait.

pub mod backend;
pub mod budget;
pub mod compute;
pub mod virgl;

pub use backend::{BackendError, BackendResult, GpuBackend};
