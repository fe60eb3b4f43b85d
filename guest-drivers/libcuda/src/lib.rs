//! `libcuda.so.1` for guests of the vGPU: the CUDA driver API that CUDA programs and GCC's
//! nvptx offloading plugin call, implemented in the guest; real work (modules, memory, copies,
//! launches, synchronisation) is forwarded to the host's compute backend with the protocol of
//! `mdev_backend::compute::wire`.
//!
//! - `api`: the C entry points, and `export`: the private tables cudart asks for (with the
//!   ioctls of [`drm`], the library's only unsafe code); `integrity`: the token of cudart's
//!   integrity check, pure logic;
//! - [`driver`]: handle tables and requests, pure logic;
//! - [`transport`]: how requests reach the host (a Unix socket named by `VGPU_CUDA_SOCKET`),
//!   and [`drm`]: the vGPU's virtio-gpu device, a guest's transport otherwise;
//! - [`attributes`], [`status`]: device and function attributes, `CUresult` values;
//! - [`smi`]: what the guest's `vgpu-smi` (`src/bin/vgpu-smi-guest.rs`) shows.
//!
//! See `docs/CUDA-GUEST.md`.

mod api;
pub mod array;
mod array_api;
pub mod attributes;
pub mod driver;
pub mod drm;
mod export;
mod graph;
mod integrity;
pub mod smi;
pub mod status;
mod symbols;
pub mod transport;
pub mod window;
