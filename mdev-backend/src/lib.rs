//! mdev-backend: executes vGPU work on the physical GPU and reports its completion fences
//! (hops 7 and 8 of the data path, see docs/ARCHITECTURE.md).
//!
//! Today: the virglrenderer binding ([`virgl`]) that the virtio-gpu 3D commands will drive.
//! Next: its wiring into the device worker, then CUDA remoting and the simulated engine.

pub mod virgl;
