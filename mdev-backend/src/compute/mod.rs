//! Compute (CUDA driver API) execution on the host: the compute twin of what virglrenderer and
//! llvmpipe are for GL.
//!
//! - [`error`]: [`ComputeError`], the one error enum, with the CUDA driver status each variant
//!   is reported to a guest as.
//! - [`memory`]: the device-memory interface a kernel executes against ([`GlobalMemory`]): every
//!   access is checked against the context's allocations, so an out-of-range access is a
//!   [`Fault`] (CUDA_ERROR_ILLEGAL_ADDRESS for that context), never host memory.
//! - [`ptx`]: the PTX parser and warp-level interpreter (CPU executor).
//! - [`backend`]: the [`ComputeBackend`] trait, its ids and limits.
//! - [`cpu`]: [`CpuBackend`], the trait on the PTX executor.
//! - [`nvcuda`]: [`NvCuda`], the trait on the real driver loaded at run time.
//! - [`executor`]: [`Executor`], the one thread per VM that owns its backend and times groups.
//!
//! See `docs/COMPUTE.md`.

pub mod backend;
#[cfg(test)]
mod conformance;
pub mod cpu;
pub mod error;
pub mod executor;
pub mod memory;
pub mod nvcuda;
pub mod ptx;

pub use backend::{
    ComputeBackend, ComputeConfig, ContextId, EventId, FunctionId, ModuleId, StreamId,
};
pub use cpu::CpuBackend;
pub use error::{ComputeError, ComputeResult};
pub use executor::{Executor, ExecutorConfig, GroupDone};
pub use memory::{DeviceMemory, Fault, FaultKind, GlobalMemory};
pub use nvcuda::{NvCuda, NvCudaConfig};
