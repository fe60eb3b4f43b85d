//! Compute (CUDA driver API) execution on the host: the compute twin of what virglrenderer and
//! llvmpipe are for GL.
//!
//! - [`error`]: [`ComputeError`], the one error enum, with the CUDA driver status each variant
//!   is reported to a guest as.
//! - [`memory`]: the device-memory interface a kernel executes against ([`GlobalMemory`]): every
//!   access is checked against the context's allocations, so an out-of-range access is a
//!   [`Fault`] (CUDA_ERROR_ILLEGAL_ADDRESS for that context), never host memory.
//! - [`ptx`]: the PTX parser and warp-level interpreter (CPU executor).
//! - [`fatbin`]: fat-binary unpacking (the PTX of an nvcc or GCC offload image).
//! - [`backend`]: the [`ComputeBackend`] trait; [`cpu`]: [`CpuBackend`] on the PTX executor;
//!   [`nvcuda`]: [`NvCuda`] on the real driver; [`executor`]: a VM's backend on its own thread,
//!   work groups timed by events.
//! - [`occupancy`]: blocks of a kernel resident on a multiprocessor at once (the occupancy
//!   queries' answers, and the bound of a cooperative launch's grid).
//! - [`wire`]: the remoting protocol a guest's `libcuda.so.1` speaks (decoding, no I/O);
//!   [`remote`]: a connection served by a backend.
//!
//! See `docs/COMPUTE.md`.

pub mod backend;
#[cfg(test)]
mod conformance;
pub mod corpus;
pub mod corpus_kernels;
pub mod cpu;
pub mod error;
pub mod executor;
pub mod fatbin;
pub mod memory;
pub mod nvcuda;
pub mod occupancy;
pub mod ptx;
pub mod remote;
pub mod shm;
pub mod wire;

pub use backend::ComputeBackend;
pub use cpu::{CpuBackend, CpuConfig};
pub use error::{ComputeError, ComputeResult};
pub use executor::{Executor, ExecutorConfig, GroupDone};
pub use memory::{DeviceMemory, Fault, FaultKind, GlobalMemory, HostSpan};
pub use nvcuda::NvCuda;

/// The backend a benchmark or a check measures: [`NvCuda`] when `VGPU_COMPUTE=nvcuda` is set
/// and the driver loads (else a note on standard error), otherwise a [`CpuBackend`] with
/// `cpu`. Named by what ran.
pub fn backend_from_env(cpu: CpuConfig) -> (&'static str, Box<dyn ComputeBackend>) {
    if std::env::var("VGPU_COMPUTE").as_deref() == Ok("nvcuda") {
        match NvCuda::new(0) {
            Ok(b) => return ("nvcuda", Box::new(b)),
            Err(e) => eprintln!("NvCuda unavailable ({e}); measuring the CPU backend"),
        }
    }
    ("cpu", Box::new(CpuBackend::new(cpu)))
}

/// The backend of a process that serves one guest (a VM's device process, a
/// `vgpu-cuda-host` connection): the real driver with its printf output captured, which in
/// such a process is that guest's, or the PTX executor configured by `config`. Either charges
/// device memory to `config.budget`, the guest's memory budget.
pub fn one_guest_backend(
    nvcuda: bool,
    config: CpuConfig,
) -> ComputeResult<Box<dyn ComputeBackend>> {
    if nvcuda {
        let mut b = NvCuda::new(0)?.charged_to(&config.budget);
        b.capture_printf()?;
        Ok(Box::new(b))
    } else {
        Ok(Box::new(CpuBackend::new(config)))
    }
}
