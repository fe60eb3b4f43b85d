//! The compute backend's one error enum. Each variant maps to the CUDA driver API status a
//! guest sees (`CUresult`, values from the driver API's `cuda.h`).

use thiserror::Error;

/// Result of a compute backend call.
pub type ComputeResult<T> = Result<T, ComputeError>;

/// Why a compute call failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ComputeError {
    /// An argument is out of its range (size, count, dimension, flag).
    #[error("invalid value: {0}")]
    InvalidValue(String),
    /// The context's memory budget or an id table is exhausted.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// An id (context, module, function, stream, event, allocation) names nothing of the caller.
    #[error("invalid handle: {0}")]
    InvalidHandle(String),
    /// A module has no function or global of that name.
    #[error("not found: {0}")]
    NotFound(String),
    /// The image is neither PTX nor a fat binary holding PTX the executor can run.
    #[error("invalid image: {0}")]
    InvalidImage(String),
    /// The image is well formed but holds only machine code (cubins), no PTX: nothing this
    /// device can run, as a GPU of another architecture answers for such an image.
    #[error("no kernel image is available for execution on the device: {0}")]
    NoBinaryForGpu(String),
    /// The PTX text does not parse or uses what the executor refuses.
    #[error("invalid PTX: {0}")]
    InvalidPtx(String),
    /// A kernel or copy touched memory outside the context's allocations; the context is
    /// unusable afterwards, as on the real driver.
    #[error("illegal address: {0}")]
    IllegalAddress(String),
    /// A misaligned access by a kernel.
    #[error("misaligned address: {0}")]
    MisalignedAddress(String),
    /// A kernel ran past its instruction budget (or the driver's watchdog).
    #[error("launch timeout: {0}")]
    LaunchTimeout(String),
    /// Grid, block or shared-memory size past the device's limits.
    #[error("launch out of resources: {0}")]
    LaunchOutOfResources(String),
    /// A cooperative launch's grid is larger than the blocks that can run at once (its
    /// blocks wait for each other, so every one must be resident together).
    #[error("cooperative launch too large: {0}")]
    CooperativeLaunchTooLarge(String),
    /// An executed instruction the executor cannot carry out (trap, `brkpt`, unsupported form).
    #[error("illegal instruction: {0}")]
    IllegalInstruction(String),
    /// A device-side `assert` failed; the text is what the driver prints for it.
    #[error("device-side assert triggered: {0}")]
    Assert(String),
    /// An event or stream has work still pending.
    #[error("not ready")]
    NotReady,
    /// The context faulted earlier and must be destroyed.
    #[error("context is broken by an earlier fault: {0}")]
    ContextBroken(String),
    /// The VM's executor thread is still busy with an earlier call that did not finish in
    /// time; this call was not run.
    #[error("executor busy: {0}")]
    Busy(String),
    /// No CUDA driver (`libcuda.so.1`) or no device.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// The real driver returned a status not listed above.
    #[error("driver error {code}: {what}")]
    Driver { code: u32, what: String },
}

impl ComputeError {
    /// The `CUresult` a guest is answered with.
    pub fn cuda_status(&self) -> u32 {
        match self {
            ComputeError::InvalidValue(_) => 1,
            ComputeError::OutOfMemory(_) => 2,
            ComputeError::Busy(_) => 46,
            ComputeError::NoDevice(_) => 100,
            ComputeError::InvalidImage(_) => 200,
            ComputeError::NoBinaryForGpu(_) => 209,
            ComputeError::InvalidPtx(_) => 218,
            ComputeError::InvalidHandle(_) => 400,
            ComputeError::NotFound(_) => 500,
            ComputeError::NotReady => 600,
            ComputeError::IllegalAddress(_) => 700,
            ComputeError::Assert(_) => 710,
            ComputeError::LaunchOutOfResources(_) => 701,
            ComputeError::LaunchTimeout(_) => 702,
            ComputeError::IllegalInstruction(_) => 715,
            ComputeError::MisalignedAddress(_) => 716,
            ComputeError::ContextBroken(_) => 719,
            ComputeError::CooperativeLaunchTooLarge(_) => 720,
            ComputeError::Driver { code, .. } => *code,
        }
    }

    /// Whether the error leaves the context unusable (sticky on the real driver).
    pub fn is_sticky(&self) -> bool {
        matches!(
            self,
            ComputeError::IllegalAddress(_)
                | ComputeError::MisalignedAddress(_)
                | ComputeError::LaunchTimeout(_)
                | ComputeError::IllegalInstruction(_)
                | ComputeError::Assert(_)
                | ComputeError::ContextBroken(_)
        )
    }
}
