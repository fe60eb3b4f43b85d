//! The occupancy model: how many blocks of a kernel fit on one multiprocessor of a compute
//! capability at once, as NVIDIA's occupancy calculator computes it. The guest library answers
//! the occupancy queries (`cuOccupancy*`) with it, and a cooperative launch's grid is bounded by
//! it on both sides ([`co_resident_blocks`]): what a program reads from
//! `cuOccupancyMaxActiveBlocksPerMultiprocessor` times the multiprocessor count is exactly what
//! a cooperative launch may have.

use super::backend::FunctionAttributes;

/// A multiprocessor's resources, as the occupancy calculator models them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmLimits {
    pub max_threads: u32,
    pub max_blocks: u32,
    pub registers: u32,
    /// Registers are allocated to a warp in units of this many.
    pub register_unit: u32,
    /// The register file is split evenly between this many warp schedulers.
    pub sub_partitions: u32,
    pub max_registers_per_thread: u32,
    pub shared_bytes: u32,
    /// Most shared memory one block may have (after opting in).
    pub shared_per_block_optin: u32,
    /// Shared memory is allocated to a block in units of this many bytes.
    pub shared_unit: u32,
    /// Shared memory the system reserves per block.
    pub shared_reserved_per_block: u32,
}

/// The multiprocessor limits of compute capability `cc` (NVIDIA's occupancy calculator and
/// programming guide): Turing (7.5) is the GPU the CPU executor presents; Volta, Ampere, Ada
/// and Hopper are what the NVIDIA backend may pass through. Others are not known.
pub fn sm_limits(cc: (u32, u32)) -> Option<SmLimits> {
    // (max threads, max blocks, shared per SM, opt-in shared per block, allocation unit,
    // reserved per block), all in bytes where memory.
    let (max_threads, max_blocks, shared_bytes, optin, shared_unit, reserved) = match cc {
        (7, 0) => (2048, 32, 96 << 10, 96 << 10, 256, 0),
        (7, 5) => (1024, 16, 64 << 10, 64 << 10, 256, 0),
        (8, 0) => (2048, 32, 164 << 10, 163 << 10, 128, 1 << 10),
        (8, 6) => (1536, 16, 100 << 10, 99 << 10, 128, 1 << 10),
        (8, 9) => (1536, 24, 100 << 10, 99 << 10, 128, 1 << 10),
        (9, 0) => (2048, 32, 228 << 10, 227 << 10, 128, 1 << 10),
        _ => return None,
    };
    Some(SmLimits {
        max_threads,
        max_blocks,
        registers: 65536,
        register_unit: 256,
        sub_partitions: 4,
        max_registers_per_thread: 255,
        shared_bytes,
        shared_per_block_optin: optin,
        shared_unit,
        shared_reserved_per_block: reserved,
    })
}

/// Blocks of `block_size` threads, each with `dynamic_shared` bytes besides the function's
/// static shared memory, that fit on one multiprocessor at once: the least of the limits on
/// warps, blocks, registers (allocated per warp, in units, within each sub-partition) and
/// shared memory (allocated per block, in units). 0 when one block cannot run at all.
pub fn active_blocks(
    sm: &SmLimits,
    f: &FunctionAttributes,
    block_size: u32,
    dynamic_shared: u32,
) -> u32 {
    const WARP: u32 = 32;
    if block_size == 0 || block_size > f.max_threads_per_block.min(sm.max_threads) {
        return 0;
    }
    let warps = block_size.div_ceil(WARP);
    let by_warps = (sm.max_threads / WARP) / warps;
    let by_registers = if f.num_regs == 0 {
        u32::MAX
    } else if f.num_regs > sm.max_registers_per_thread {
        0
    } else {
        let per_warp = (f.num_regs * WARP).next_multiple_of(sm.register_unit);
        let warps_per_partition = (sm.registers / sm.sub_partitions) / per_warp;
        (warps_per_partition * sm.sub_partitions) / warps
    };
    let shared = u64::from(f.shared_size_bytes)
        + u64::from(dynamic_shared)
        + u64::from(sm.shared_reserved_per_block);
    let by_shared = if shared > u64::from(sm.shared_per_block_optin) {
        0
    } else if shared == 0 {
        u32::MAX
    } else {
        let per_block = shared.next_multiple_of(u64::from(sm.shared_unit));
        (u64::from(sm.shared_bytes) / per_block) as u32
    };
    by_warps.min(sm.max_blocks).min(by_registers).min(by_shared)
}

/// Blocks of a launch that can all be resident at once on `multiprocessors` multiprocessors:
/// what a cooperative launch's grid may have at most (`CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`
/// past it).
pub fn co_resident_blocks(
    sm: &SmLimits,
    f: &FunctionAttributes,
    block_size: u32,
    dynamic_shared: u32,
    multiprocessors: u32,
) -> u64 {
    u64::from(active_blocks(sm, f, block_size, dynamic_shared)) * u64::from(multiprocessors)
}
