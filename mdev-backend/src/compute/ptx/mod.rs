//! The PTX executor: runs kernels of a PTX module on the host's CPUs.
//!
//! [`Module::parse`] decodes the text once (every name resolved, anything unsupported refused
//! with its line); [`launch`] runs one grid. Blocks are spread over host threads; within a
//! block, warps of 32 lanes execute in lock step with per-lane program counters (see
//! `docs/PTX.md` for the model and what is refused). Every global access goes through
//! [`GlobalMemory`](crate::compute::GlobalMemory), so a kernel can only touch its context's
//! allocations.

mod exec;
mod ir;
#[cfg(feature = "jit")]
mod jit;
mod lex;
mod parse;
mod printf;
pub mod texture;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::backend::Interrupt;
use super::memory::DeviceHeap;
use super::{ComputeError, ComputeResult};
use crate::budget::{Charge, MemoryBudget};

pub use exec::CHECK_EVERY;
pub(crate) use parse::Stop;

/// Largest PTX text accepted (bytes): nvcc's PTX for a large program is a few MiB.
pub const MAX_PTX_BYTES: usize = 64 << 20;
/// PTX images linked into one module (GCC's OpenMP offloading links about 25).
pub const MAX_LINKED_IMAGES: usize = 256;
/// Instructions in one module, bounding decode memory.
pub const MAX_INSTRUCTIONS_PER_MODULE: usize = 4 << 20;
/// Registers of one thread over all functions of a module (one value of 8 bytes each per lane
/// of a running warp).
pub const MAX_REGISTERS_PER_THREAD: usize = 64 * 1024;
/// Largest module variable: bounds what a module load allocates.
pub const MAX_VARIABLE_BYTES: u64 = 256 << 20;
/// Static plus dynamic shared memory of one block: the opt-in maximum of Hopper (227 KiB).
pub const MAX_SHARED_BYTES: u32 = 227 * 1024;
/// Local memory of one thread (the hardware allows 512 KiB; 64 KiB keeps a 1024-thread block
/// at 64 MiB of host memory).
pub const MAX_LOCAL_BYTES_PER_THREAD: u32 = 64 * 1024;
/// Kernel parameter buffer (CUDA 12.1+ allows 32764 bytes).
pub const MAX_PARAM_BYTES: u32 = 32_764;
/// `.param` variables of device functions and call sites, per thread.
pub const MAX_FPARAM_BYTES: u32 = 64 * 1024;
/// Nesting of device-function calls (the executor refuses recursion at load).
pub const MAX_CALL_DEPTH: usize = 64;
/// Output of `printf` per launch, as the device's 1 MiB printf FIFO; the rest is dropped.
pub const MAX_PRINTF_BYTES: usize = 1 << 20;
/// Threads in one block.
pub const MAX_THREADS_PER_BLOCK: u32 = 1024;
/// Blocks of one cooperative launch: they all run at once, each on a host thread of its own
/// (a block waiting at a grid barrier must not hold up the one it waits for), so this bounds
/// the host threads a launch starts, as the executor's bound on a launch's threads (also 1024)
/// does for other launches.
pub const MAX_COOPERATIVE_BLOCKS: u64 = 1024;
/// Bytes of a cooperative launch's grid workspace (`{ u32 size; u32 barrier; }`, what CUDA's
/// cooperative groups read through `%envreg1`/`%envreg2`).
pub const GRID_WORKSPACE_BYTES: u64 = 8;

/// A module `.global` or `.const` variable's state space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VarSpace {
    Global,
    Const,
}

/// A module-scope variable the backend allocates and initialises in device memory at load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalVar {
    pub name: String,
    pub space: VarSpace,
    pub size: u64,
    pub align: u32,
    /// Initial bytes, `size` long (zeros where the PTX has no initialiser).
    pub init: Vec<u8>,
    /// (offset in `init`, index in [`Module::globals`]): where the loader writes the device
    /// address of another variable (`generic(var)` initialisers), as 8 bytes.
    pub relocs: Vec<(u32, u32)>,
}

/// One kernel parameter's place in the parameter buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamInfo {
    pub offset: u32,
    pub size: u32,
    pub align: u32,
}

/// What a launch needs to know of a kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelInfo {
    pub name: String,
    pub params: Vec<ParamInfo>,
    pub param_bytes: u32,
    pub static_shared_bytes: u32,
    pub local_bytes: u32,
}

/// A parsed, validated PTX module.
#[derive(Debug)]
pub struct Module {
    parsed: parse::Parsed,
    kernels: Vec<(KernelInfo, u32)>,
    /// Its kernels' compiled code, made on their first compiled launch.
    #[cfg(feature = "jit")]
    jit: jit::Cache,
    /// Whether its code relies on warps running in lock step: GCC's uniform-SIMT code
    /// (OpenMP offloading, the `__nvptx_uni` masks) has every lane load a shared word, one
    /// lane's atomic decide, and every lane compare its own loaded value, so it runs on the
    /// interpreter, whose lanes see one value per load.
    #[cfg(feature = "jit")]
    lockstep: bool,
}

impl Module {
    /// Parses PTX text. Refuses (`InvalidPtx`, with the line) what the executor cannot run.
    /// Uncharged: for tools and tests; a guest's module goes through [`Module::load`].
    pub fn parse(text: &str) -> ComputeResult<Module> {
        Module::link(&[text])
    }

    /// [`Module::load`] uncharged and never cancelled: for tools and tests.
    pub fn link(images: &[&str]) -> ComputeResult<Module> {
        let never = AtomicBool::new(false);
        Module::load(images, &MemoryBudget::new(u64::MAX), &never).map(|(m, _)| m)
    }

    /// Parses PTX images and links them into one module (what `cuLinkAddData` for each and
    /// `cuLinkComplete` do): `.extern` functions and variables resolve to another image's
    /// `.visible` or `.weak` definitions; names without linkage stay their image's own.
    ///
    /// Every host byte the parse holds is charged to `budget` before it is made (past it, an
    /// `OutOfMemory` error); the returned charge is what the module keeps, to hold as long as
    /// the module. The parse costs time linear in the text and stops within a few thousand
    /// tokens once `cancel` is set.
    pub fn load(
        images: &[&str],
        budget: &Arc<MemoryBudget>,
        cancel: &AtomicBool,
    ) -> ComputeResult<(Module, Charge)> {
        if images.is_empty() || images.len() > MAX_LINKED_IMAGES {
            return Err(ComputeError::InvalidPtx(format!(
                "{} images to link (1 to {MAX_LINKED_IMAGES})",
                images.len()
            )));
        }
        let bytes: usize = images.iter().map(|t| t.len()).sum();
        if bytes > MAX_PTX_BYTES {
            return Err(ComputeError::InvalidPtx(format!(
                "{bytes} bytes of PTX, more than {MAX_PTX_BYTES}"
            )));
        }
        let meter = parse::Meter::new(budget, cancel);
        let (parsed, charge) = parse::parse(images, meter).map_err(|f| match f {
            parse::Failure::Invalid(image, line, msg) => {
                ComputeError::InvalidPtx(if images.len() == 1 {
                    format!("line {line}: {msg}")
                } else {
                    format!("image {image}, line {line}: {msg}")
                })
            }
            parse::Failure::Stopped(stop) => stop.error(),
        })?;
        let mut kernels = Vec::new();
        for (i, f) in parsed.funcs.iter().enumerate() {
            if !f.entry || f.start == f.end {
                continue;
            }
            let (params, bytes) = parsed
                .kernel_params
                .get(&(i as u32))
                .cloned()
                .unwrap_or_default();
            kernels.push((
                KernelInfo {
                    name: f.name.clone(),
                    params: params
                        .into_iter()
                        .map(|(offset, size, align)| ParamInfo {
                            offset,
                            size,
                            align,
                        })
                        .collect(),
                    param_bytes: bytes,
                    static_shared_bytes: parsed.shared_bytes,
                    local_bytes: parsed.local_bytes,
                },
                i as u32,
            ));
        }
        Ok((
            Module {
                parsed,
                kernels,
                #[cfg(feature = "jit")]
                jit: jit::Cache::default(),
                #[cfg(feature = "jit")]
                lockstep: images.iter().any(|t| t.contains("__nvptx_uni")),
            },
            charge,
        ))
    }

    /// The names of the module's kernels (`.entry`).
    pub fn kernels(&self) -> impl Iterator<Item = &str> {
        self.kernels.iter().map(|(k, _)| k.name.as_str())
    }

    /// A kernel's parameter layout and memory needs.
    pub fn kernel(&self, name: &str) -> Option<&KernelInfo> {
        self.kernels
            .iter()
            .find(|(k, _)| k.name == name)
            .map(|(k, _)| k)
    }

    /// Module-scope `.global` and `.const` variables.
    pub fn globals(&self) -> &[GlobalVar] {
        &self.parsed.globals
    }

    /// Whether the module calls the device heap's `malloc`/`free`.
    pub fn uses_heap(&self) -> bool {
        self.parsed.code.iter().any(|i| {
            matches!(
                i.op,
                ir::Op::Call {
                    callee: ir::Callee::Malloc | ir::Callee::Free,
                    ..
                }
            )
        })
    }

    fn function_of(&self, name: &str) -> Option<u32> {
        self.kernels
            .iter()
            .find(|(k, _)| k.name == name)
            .map(|(_, f)| *f)
    }
}

/// How a launch runs its kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    /// The warp-level interpreter (`exec`): the reference.
    Interpreter,
    /// Native code compiled from the module (`jit`), with the interpreter as the fallback
    /// for a kernel the compiler refuses.
    #[default]
    Compiled,
}

impl std::str::FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "interpreter" => Ok(Engine::Interpreter),
            "compiled" => Ok(Engine::Compiled),
            _ => Err(format!("{s}: the engines are interpreter and compiled")),
        }
    }
}

/// Runs `kernel` of `module` over the launch's grid with the launch's engine.
pub fn launch(
    module: &Module,
    kernel: &str,
    l: &Launch<'_>,
    memory: &dyn super::GlobalMemory,
) -> ComputeResult<LaunchStats> {
    #[cfg(feature = "jit")]
    if l.engine == Engine::Compiled
        && let Some(result) = jit::launch(module, kernel, l, memory)
    {
        return result;
    }
    exec::launch(module, kernel, l, memory)
}

/// One grid launch.
#[derive(Debug, Clone)]
pub struct Launch<'a> {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dynamic_shared_bytes: u32,
    /// The packed parameter buffer, `param_bytes` long.
    pub params: &'a [u8],
    /// Device address of each module variable, in [`Module::globals`] order.
    pub symbols: &'a [u64],
    /// The context's device heap for `malloc`/`free` (`malloc` returns NULL without one).
    pub heap: Option<&'a DeviceHeap>,
    /// Cost units (warp-instructions, and what a `printf` or a block's setup costs in them)
    /// the whole launch may spend; past it the launch fails with `LaunchTimeout`.
    pub instruction_budget: u64,
    /// Host threads the blocks are spread over (at least 1).
    pub threads: usize,
    /// Checked every [`CHECK_EVERY`] cost units: stops the launch when its request is
    /// cancelled or past its deadline. `None`: bounded by the budget alone (tools, tests).
    pub interrupt: Option<&'a Interrupt>,
    /// Where the host memory of the blocks running at once (registers, local, shared and
    /// `.param` memory) is charged for the launch's duration.
    pub budget: &'a Arc<MemoryBudget>,
    /// The engine that runs the kernel.
    pub engine: Engine,
    /// A cooperative launch's grid workspace (`cuLaunchCooperativeKernel`): the device address
    /// of [`GRID_WORKSPACE_BYTES`] the caller zeroed, which `%envreg1` (high word) and
    /// `%envreg2` (low word) give the kernel. Every block of a cooperative launch runs at once,
    /// each on a host thread of its own (at most [`MAX_COOPERATIVE_BLOCKS`], past which the
    /// launch is refused with `CooperativeLaunchTooLarge`), so blocks may wait for each other.
    /// `None`: blocks run as host threads take them, and every `%envreg` reads 0.
    pub cooperative: Option<u64>,
}

impl Launch<'_> {
    /// `%envreg<n>`, the driver's environment registers: `%envreg1` and `%envreg2` hold the
    /// high and low words of a cooperative launch's grid workspace (where CUDA's cooperative
    /// groups find the grid barrier; a null address is what `grid_group::is_valid` reports for
    /// a launch that is not cooperative); the others read 0.
    pub(crate) fn envreg(&self, n: u8) -> u64 {
        match (n, self.cooperative) {
            (1, Some(address)) => address >> 32,
            (2, Some(address)) => address & 0xffff_ffff,
            _ => 0,
        }
    }
}

/// What a launch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaunchStats {
    /// Cost units spent: warp-instructions and their equivalents (see
    /// [`Launch::instruction_budget`]).
    pub warp_instructions: u64,
    pub blocks: u64,
    /// Host threads the blocks ran on.
    pub threads: usize,
    /// Host bytes one block held while it ran (charged per thread for the launch).
    pub block_bytes: u64,
    /// `printf` output, in block order, at most [`MAX_PRINTF_BYTES`].
    pub output: String,
    /// Whether compiled code ran the kernel (else the interpreter did).
    pub compiled: bool,
    /// Times the launch looked whether it may go on (its stop flag, its request's interrupt
    /// and deadline, its budget): each reads the clock, so they are spaced by work done.
    pub checks: u64,
}

#[cfg(test)]
mod differential;
#[cfg(test)]
mod tests;
