//! `cuDeviceGetAttribute`, `cuFuncGetAttribute` and the occupancy calculator's answers: from
//! the host's [`DeviceAttributes`] and [`FunctionAttributes`], and the multiprocessor limits of
//! the compute capability the host reports. Attribute numbers from CUDA 13's `cuda.h`.
//!
//! What is advertised is what the executor and the device path implement, as a single GPU of
//! that capability reports it; a feature they lack answers 0 (docs/CUDA-GUEST.md lists them).

use std::ffi::c_int;

use mdev_backend::compute::backend::{DeviceAttributes, FunctionAttributes};
pub use mdev_backend::compute::occupancy::{SmLimits, active_blocks, sm_limits};

use crate::driver::{CuResult, PointerInfo};
use crate::status::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED};

/// The driver API version reported (`cuDriverGetVersion`): CUDA 13.5, so the runtimes of
/// nvcc up to 13.5 accept the driver.
pub const DRIVER_VERSION: c_int = 13050;
/// The device's UUID (`cuDeviceGetUuid`): one device per VM, the same in every VM.
pub const DEVICE_UUID: [u8; 16] = *b"vgpu-compute-000";

/// `CU_DEVICE_ATTRIBUTE_MAX` of CUDA 13: attributes at or past it are not attributes.
const DEVICE_ATTRIBUTE_MAX: c_int = 162;
/// `CU_FUNC_ATTRIBUTE_MAX` of CUDA 13.
const FUNCTION_ATTRIBUTE_MAX: c_int = 18;
/// Shared memory a block may use without opting in (`cuFuncSetAttribute`), on every GPU since
/// Fermi.
pub const DEFAULT_SHARED_PER_BLOCK: u32 = 48 * 1024;
/// `CU_SHAREDMEM_CARVEOUT_DEFAULT`: no preference for a function's L1/shared split.
pub const CARVEOUT_DEFAULT: c_int = -1;

/// The limits of the device `a` describes; a device without known limits cannot answer
/// occupancy or limit questions.
pub fn limits(a: &DeviceAttributes) -> CuResult<SmLimits> {
    sm_limits(a.compute_capability).ok_or(CUDA_ERROR_NOT_SUPPORTED)
}

/// Texture and surface limits of a Turing GPU, by `CUdevice_attribute`.
const TEXTURE_LIMITS: &[(c_int, c_int)] = &[
    (21, 131072),
    (22, 131072),
    (23, 65536),
    (24, 16384),
    (25, 16384),
    (26, 16384),
    (27, 32768),
    (28, 32768),
    (29, 2048),
    (30, 512),
    (42, 32768),
    (43, 2048),
    (45, 32768),
    (46, 32768),
    (47, 8192),
    (48, 8192),
    (49, 32768),
    (51, 32),
    (52, 32768),
    (53, 32768),
    (54, 2046),
    (55, 32768),
    (56, 131072),
    (57, 65536),
    (58, 16384),
    (59, 16384),
    (60, 16384),
    (61, 32768),
    (62, 2048),
    (63, 32768),
    (64, 32768),
    (65, 2048),
    (66, 32768),
    (67, 32768),
    (68, 2046),
    (69, 1 << 27),
    (70, 131072),
    (71, 65000),
    (72, 2097120),
    (73, 32768),
    (74, 32768),
    (77, 32768),
];

pub fn device_attribute(a: &DeviceAttributes, attribute: c_int) -> CuResult<c_int> {
    let v = |x: u32| x.min(c_int::MAX as u32) as c_int;
    let sm = || limits(a);
    if let Some(&(_, limit)) = TEXTURE_LIMITS.iter().find(|(n, _)| *n == attribute) {
        return Ok(limit);
    }
    Ok(match attribute {
        1 => v(a.max_threads_per_block),
        2..=4 => v(a.max_block[(attribute - 2) as usize]),
        5..=7 => v(a.max_grid[(attribute - 5) as usize]),
        8 => v(a.shared_memory_per_block.min(DEFAULT_SHARED_PER_BLOCK)),
        9 => 64 * 1024,
        10 => v(a.warp_size),
        11 => c_int::MAX,
        12 | 82 => v(sm()?.registers),
        13 => v(a.clock_khz),
        14 => 512,
        // Copies overlapping kernels, concurrent kernels, copy engines: a context's work runs
        // in order on the host.
        15 | 31 | 40 => 0,
        16 => v(a.multiprocessors),
        // Kernel timeout, integrated, ECC, compute mode (default), TCC: no.
        17 | 18 | 20 | 32 | 35 => 0,
        39 => v(sm()?.max_threads),
        // Unified addressing, managed memory and mapped host memory: where the host places
        // device memory in windows this library reserves (driver.rs `context_create`), so a
        // host view can live at a device address (api.rs `unified_alloc`).
        19 | 41 | 83 => c_int::from(a.placement),
        75 => v(a.compute_capability.0),
        76 => v(a.compute_capability.1),
        // Stream priorities (kept and reported), L1 caching of globals and locals, compute
        // preemption (the executor pauses a kernel between slices), host registration,
        // texture gather (`tld4`).
        44 | 78 | 79 | 80 | 90 | 99 => 1,
        81 => v(sm()?.shared_bytes.min(a.shared_memory_per_block)),
        97 => v(sm()?.shared_per_block_optin.min(a.shared_memory_per_block)),
        87 => 32,
        106 => v(sm()?.max_blocks),
        111 => v(sm()?.shared_reserved_per_block),
        // Cooperative launch (cuLaunchCooperativeKernel: every block resident at once, the
        // grid workspace cooperative groups synchronise through); not across devices (96).
        95 => 1,
        // Virtual memory management (api/vmm.rs).
        102 => 1,
        // Memory pools and stream-ordered allocation (api/pools.rs); no IPC handle types.
        115 => 1,
        // One memory synchronisation domain before Hopper.
        126 => 1,
        // No NUMA node of its own, none on the host side.
        131 | 134 => -1,
        _ if (1..DEVICE_ATTRIBUTE_MAX).contains(&attribute) => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

/// What a program set on a function (`cuFuncSetAttribute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FunctionSettings {
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`, once set.
    pub max_dynamic_shared: Option<u32>,
    /// `CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`: a percentage or -1.
    pub carveout: c_int,
}

impl Default for FunctionSettings {
    fn default() -> Self {
        FunctionSettings {
            max_dynamic_shared: None,
            carveout: CARVEOUT_DEFAULT,
        }
    }
}

/// Most dynamic shared memory a launch of the function may ask for: what was set, else what
/// the default per-block amount leaves beside its static shared memory.
pub fn max_dynamic_shared(f: &FunctionAttributes, s: &FunctionSettings) -> u32 {
    s.max_dynamic_shared
        .unwrap_or_else(|| DEFAULT_SHARED_PER_BLOCK.saturating_sub(f.shared_size_bytes))
}

/// `cuFuncGetAttribute`'s answer from the function's attributes on the host (`f`), what the
/// program set (`s`) and the device's compute capability (the PTX and binary versions). Cluster
/// attributes answer 0: clusters need compute capability 9.0.
pub fn function_attribute(
    attribute: c_int,
    f: &FunctionAttributes,
    s: &FunctionSettings,
    device: &DeviceAttributes,
) -> CuResult<c_int> {
    let v = |x: u32| x.min(c_int::MAX as u32) as c_int;
    let (major, minor) = device.compute_capability;
    Ok(match attribute {
        0 => v(f.max_threads_per_block),
        1 => v(f.shared_size_bytes),
        2 => v(f.const_size_bytes),
        3 => v(f.local_size_bytes),
        4 => v(f.num_regs),
        5 | 6 => v(major.saturating_mul(10).saturating_add(minor)),
        8 => v(max_dynamic_shared(f, s)),
        9 => s.carveout,
        // Cache-all loads, cluster size required and dimensions, non-portable clusters,
        // cluster scheduling (default), device-side graph updates, shared memory mode
        // (default).
        7 | 10..FUNCTION_ATTRIBUTE_MAX => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

/// `cuFuncSetAttribute`: the dynamic shared memory maximum (up to what opting in allows
/// beside the static amount) and the carveout preference are settable; cluster attributes
/// need compute capability 9.0, the rest are read-only.
pub fn set_function_attribute(
    attribute: c_int,
    value: c_int,
    f: &FunctionAttributes,
    s: &mut FunctionSettings,
    device: &DeviceAttributes,
) -> CuResult<()> {
    let sm = limits(device)?;
    match attribute {
        8 => {
            let room = sm
                .shared_per_block_optin
                .min(device.shared_memory_per_block)
                .saturating_sub(f.shared_size_bytes);
            let value = u32::try_from(value).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
            if value > room {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            s.max_dynamic_shared = Some(value);
        }
        9 if value == CARVEOUT_DEFAULT || (0..=100).contains(&value) => s.carveout = value,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    }
    Ok(())
}

/// The block size (a multiple of the warp size up to `limit`, or the function's maximum when
/// `limit` is 0) that keeps the most threads active on a multiprocessor, with the dynamic
/// shared memory `dynamic_shared` gives for each size; the first (largest) size wins a tie.
/// Returns (the grid size that fills the device at that occupancy, the block size).
pub fn best_block_size(
    sm: &SmLimits,
    multiprocessors: u32,
    f: &FunctionAttributes,
    limit: u32,
    mut dynamic_shared: impl FnMut(u32) -> u32,
) -> (u32, u32) {
    const WARP: u32 = 32;
    let mut top = f.max_threads_per_block.min(sm.max_threads);
    if limit > 0 {
        top = top.min(limit);
    }
    let (mut best_threads, mut best) = (0u32, (0u32, 0u32));
    let mut size = top.next_multiple_of(WARP);
    while size > 0 {
        let b = size.min(top);
        let blocks = active_blocks(sm, f, b, dynamic_shared(b));
        if blocks * b > best_threads {
            best_threads = blocks * b;
            best = (blocks.saturating_mul(multiprocessors), b);
        }
        size -= WARP;
    }
    best
}

/// Most dynamic shared memory each of `blocks` blocks of `block_size` threads may have with all
/// of them on one multiprocessor at once (0 when they cannot be, whatever their memory).
pub fn available_dynamic_shared(
    sm: &SmLimits,
    f: &FunctionAttributes,
    s: &FunctionSettings,
    blocks: u32,
    block_size: u32,
) -> u32 {
    if blocks == 0 || active_blocks(sm, f, block_size, 0) < blocks {
        return 0;
    }
    let per_block = (sm.shared_bytes / blocks) / sm.shared_unit * sm.shared_unit;
    per_block
        .saturating_sub(f.shared_size_bytes)
        .saturating_sub(sm.shared_reserved_per_block)
        .min(max_dynamic_shared(f, s))
}

/// A pointer attribute's value, written at the width its type has in `cuda.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointerValue {
    /// A pointer, `CUdeviceptr`, `size_t` or `unsigned long long`: 8 bytes.
    Word(u64),
    /// `unsigned int` or `int`: 4 bytes.
    Int(u32),
    /// A boolean: 1 byte.
    Bool(bool),
}

/// `CUmemorytype`: host, device.
const MEMORY_TYPE_HOST: u32 = 1;
const MEMORY_TYPE_DEVICE: u32 = 2;
/// `CU_MEMHOSTREGISTER_READ_ONLY`.
const HOST_REGISTER_READ_ONLY: u32 = 0x08;
/// `CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ` and `_READWRITE`.
const ACCESS_READ: u32 = 1;
const ACCESS_READ_WRITE: u32 = 3;

/// `cuPointerGetAttribute`'s answer for `ptr` from what the library knows of it (`info`):
/// device allocations are device memory of their context, managed memory is device memory
/// the host may use too, page-locked host memory is host memory with a device pointer when
/// mapped.
/// With no `info` (not memory of this driver) every attribute is
/// `CUDA_ERROR_INVALID_VALUE`, or its zero when `lenient` (`cuPointerGetAttributes`).
/// P2P tokens need the nv-p2p kernel interface: `CUDA_ERROR_NOT_SUPPORTED`.
pub fn pointer_attribute(
    attribute: c_int,
    ptr: u64,
    info: Option<&PointerInfo>,
    lenient: bool,
) -> CuResult<PointerValue> {
    use PointerValue::{Bool, Int, Word};
    let zero = match attribute {
        1 | 3 | 4 | 7 | 11 | 12 | 14 | 17..=20 => Word(0),
        2 | 9 | 16 | 22 => Int(0),
        6 | 8 | 10 | 13 | 15 | 21 => Bool(false),
        5 => return Err(CUDA_ERROR_NOT_SUPPORTED),
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    let Some(info) = info else {
        return if lenient {
            Ok(zero)
        } else {
            Err(CUDA_ERROR_INVALID_VALUE)
        };
    };
    // Managed memory is device memory with a host pointer; mapped host memory has a device
    // pointer (`offset` from the host one).
    let (ctx, start, size, buffer_id, device, managed, mapped) = match *info {
        PointerInfo::Device {
            ctx,
            start,
            size,
            buffer_id,
            managed,
        } => (ctx, start, size, buffer_id, true, managed, None),
        PointerInfo::Host {
            start,
            memory,
            device,
        } => (
            memory.ctx,
            start,
            memory.size,
            memory.buffer_id,
            false,
            false,
            device,
        ),
    };
    let read_only = matches!(info, PointerInfo::Host { memory, .. }
        if memory.registered && memory.flags & HOST_REGISTER_READ_ONLY != 0);
    Ok(match attribute {
        1 => Word(ctx),
        2 => Int(if device {
            MEMORY_TYPE_DEVICE
        } else {
            MEMORY_TYPE_HOST
        }),
        3 if device => Word(ptr),
        3 if let Some(d) = mapped => Word(d + (ptr - start)),
        4 if !device || managed => Word(ptr),
        // No device pointer for host memory not mapped, no host pointer for device memory.
        3 | 4 => return Err(CUDA_ERROR_INVALID_VALUE),
        8 => Bool(managed),
        7 | 20 => Word(buffer_id),
        9 => Int(0),
        11 | 19 => Word(start),
        12 | 18 => Word(size),
        13 => Bool(true),
        16 => Int(if read_only {
            ACCESS_READ
        } else {
            ACCESS_READ_WRITE
        }),
        // Not in a locality domain.
        22 => Int(u32::MAX),
        // Synchronous memory operations flag, managed, IPC-capable, GPUDirect RDMA, hardware
        // decompression: no; no shareable handle types, no memory pool.
        _ => zero,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turing() -> DeviceAttributes {
        DeviceAttributes {
            name: "test".into(),
            placement: true,
            total_memory: 1 << 30,
            compute_capability: (7, 5),
            multiprocessors: 40,
            max_threads_per_block: 1024,
            max_block: [1024, 1024, 64],
            max_grid: [i32::MAX as u32, 65535, 65535],
            shared_memory_per_block: 227 * 1024,
            warp_size: 32,
            clock_khz: 1_000_000,
        }
    }

    fn function(regs: u32, shared: u32) -> FunctionAttributes {
        FunctionAttributes {
            max_threads_per_block: 1024,
            shared_size_bytes: shared,
            const_size_bytes: 0,
            local_size_bytes: 0,
            num_regs: regs,
        }
    }

    #[test]
    fn turing_limits_and_features_are_what_a_turing_reports() {
        let a = turing();
        let at = |n| device_attribute(&a, n).unwrap();
        assert_eq!(at(8), 48 * 1024, "per block without opting in");
        assert_eq!(
            at(97),
            64 * 1024,
            "opted in: a Turing's, not the executor's"
        );
        assert_eq!(at(81), 64 * 1024);
        assert_eq!(at(39), 1024);
        assert_eq!(at(106), 16);
        // Features this device does not have: concurrent managed access, pageable memory
        // access, host-native atomics, persisting L2, clusters.
        for n in [89, 88, 86, 108, 120] {
            assert_eq!(at(n), 0, "attribute {n}");
        }
        assert_eq!(at(161), 0, "the last of CUDA 13");
        assert_eq!(device_attribute(&a, 162), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(device_attribute(&a, 0), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(device_attribute(&a, -1), Err(CUDA_ERROR_INVALID_VALUE));
        let unknown = DeviceAttributes {
            compute_capability: (6, 1),
            ..turing()
        };
        assert_eq!(device_attribute(&unknown, 10), Ok(32));
        assert_eq!(
            device_attribute(&unknown, 39),
            Err(CUDA_ERROR_NOT_SUPPORTED)
        );
    }

    #[test]
    fn every_function_attribute_of_cuda_13_answers() {
        let (a, f, s) = (turing(), function(32, 1024), FunctionSettings::default());
        for n in 0..FUNCTION_ATTRIBUTE_MAX {
            assert!(function_attribute(n, &f, &s, &a).is_ok(), "attribute {n}");
        }
        assert_eq!(function_attribute(1, &f, &s, &a), Ok(1024));
        assert_eq!(function_attribute(8, &f, &s, &a), Ok(47 * 1024));
        assert_eq!(function_attribute(9, &f, &s, &a), Ok(-1));
        assert_eq!(function_attribute(6, &f, &s, &a), Ok(75));
        assert_eq!(
            function_attribute(FUNCTION_ATTRIBUTE_MAX, &f, &s, &a),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(
            function_attribute(-1, &f, &s, &a),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
    }

    #[test]
    fn dynamic_shared_memory_may_be_raised_to_what_opting_in_allows() {
        let (a, f) = (turing(), function(32, 1024));
        let mut s = FunctionSettings::default();
        assert_eq!(set_function_attribute(8, 63 * 1024, &f, &mut s, &a), Ok(()));
        assert_eq!(function_attribute(8, &f, &s, &a), Ok(63 * 1024));
        assert_eq!(
            set_function_attribute(8, 63 * 1024 + 1, &f, &mut s, &a),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(
            set_function_attribute(8, -1, &f, &mut s, &a),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(set_function_attribute(9, 50, &f, &mut s, &a), Ok(()));
        assert_eq!(
            set_function_attribute(9, 101, &f, &mut s, &a),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        for read_only in [0, 1, 4, 10, 11, 17, 18] {
            assert_eq!(
                set_function_attribute(read_only, 1, &f, &mut s, &a),
                Err(CUDA_ERROR_INVALID_VALUE),
                "attribute {read_only}"
            );
        }
    }

    #[test]
    fn occupancy_follows_the_turing_model() {
        let sm = sm_limits((7, 5)).unwrap();
        // 32 registers: warps limit (1024 threads), and the 16-block limit for small blocks.
        assert_eq!(active_blocks(&sm, &function(32, 0), 256, 0), 4);
        assert_eq!(active_blocks(&sm, &function(32, 0), 32, 0), 16);
        // 64 registers: 2048 per warp, 8 warps per sub-partition, 32 warps: 4 blocks of 256.
        assert_eq!(active_blocks(&sm, &function(64, 0), 256, 0), 4);
        // 128 registers: 4 warps per sub-partition, 16 warps: 2 blocks of 256.
        assert_eq!(active_blocks(&sm, &function(128, 0), 256, 0), 2);
        // 255 registers (8192 per warp): 2 warps per sub-partition, no block of 1024.
        assert_eq!(active_blocks(&sm, &function(255, 0), 1024, 0), 0);
        assert_eq!(active_blocks(&sm, &function(255, 0), 256, 0), 1);
        assert_eq!(active_blocks(&sm, &function(256, 0), 32, 0), 0, "too many");
        // Shared memory: 20 KiB per block, rounded to 256 bytes: 3 fit in 64 KiB.
        assert_eq!(
            active_blocks(&sm, &function(32, 10 * 1024), 64, 10 * 1024),
            3
        );
        assert_eq!(active_blocks(&sm, &function(32, 0), 64, 64 * 1024 + 1), 0);
        assert_eq!(active_blocks(&sm, &function(32, 0), 0, 0), 0);
        assert_eq!(active_blocks(&sm, &function(32, 0), 1025, 0), 0);

        let f = function(32, 0);
        assert_eq!(best_block_size(&sm, 40, &f, 0, |_| 0), (40, 1024));
        // Up to 96: 64 threads (16 blocks, the block limit) beat 96 (10 blocks, 960 threads).
        assert_eq!(best_block_size(&sm, 40, &f, 96, |_| 0), (40 * 16, 64));
        // Shared memory growing with the block: 64 bytes a thread leaves 1 block of 1024
        // (64 KiB) or 2 of 512; the first of equal occupancies wins.
        assert_eq!(best_block_size(&sm, 1, &f, 0, |b| b * 64), (1, 1024));

        let s = FunctionSettings::default();
        assert_eq!(available_dynamic_shared(&sm, &f, &s, 2, 256), 32 * 1024);
        assert_eq!(
            available_dynamic_shared(&sm, &f, &s, 1, 256),
            48 * 1024,
            "capped"
        );
        assert_eq!(available_dynamic_shared(&sm, &f, &s, 5, 256), 0, "4 fit");
        assert_eq!(available_dynamic_shared(&sm, &f, &s, 0, 256), 0);
        assert_eq!(
            available_dynamic_shared(&sm, &function(32, 1000), &s, 3, 64),
            21 * 1024 + 256 - 1000
        );
    }

    #[test]
    fn pointer_attributes_say_what_the_memory_is() {
        use crate::driver::HostMemory;
        let device = PointerInfo::Device {
            ctx: 7,
            start: 0x1000,
            size: 256,
            buffer_id: 3,
            managed: false,
        };
        let host = PointerInfo::Host {
            start: 0x9000,
            memory: HostMemory {
                size: 64,
                flags: HOST_REGISTER_READ_ONLY,
                ctx: 7,
                registered: true,
                buffer_id: 4,
            },
            device: None,
        };
        let at = |a, p, i| pointer_attribute(a, p, Some(i), false);
        assert_eq!(at(2, 0x1010, &device), Ok(PointerValue::Int(2)));
        assert_eq!(at(3, 0x1010, &device), Ok(PointerValue::Word(0x1010)));
        assert_eq!(at(4, 0x1010, &device), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(at(11, 0x1010, &device), Ok(PointerValue::Word(0x1000)));
        assert_eq!(at(12, 0x1010, &device), Ok(PointerValue::Word(256)));
        assert_eq!(at(8, 0x1010, &device), Ok(PointerValue::Bool(false)));
        assert_eq!(at(2, 0x9001, &host), Ok(PointerValue::Int(1)));
        assert_eq!(
            at(3, 0x9001, &host),
            Err(CUDA_ERROR_INVALID_VALUE),
            "not mapped"
        );
        assert_eq!(at(4, 0x9001, &host), Ok(PointerValue::Word(0x9001)));
        assert_eq!(at(16, 0x9001, &host), Ok(PointerValue::Int(1)), "read-only");
        assert_eq!(at(7, 0x9001, &host), Ok(PointerValue::Word(4)));
        assert_eq!(at(5, 0x1010, &device), Err(CUDA_ERROR_NOT_SUPPORTED));
        assert_eq!(at(23, 0x1010, &device), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(at(0, 0x1010, &device), Err(CUDA_ERROR_INVALID_VALUE));
        // Not this driver's memory.
        assert_eq!(
            pointer_attribute(2, 5, None, false),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(
            pointer_attribute(2, 5, None, true),
            Ok(PointerValue::Int(0))
        );
        assert_eq!(
            pointer_attribute(1, 5, None, true),
            Ok(PointerValue::Word(0))
        );
        // Managed: device memory with a host pointer; mapped host memory: a device pointer.
        let managed = PointerInfo::Device {
            ctx: 7,
            start: 0x4000,
            size: 64,
            buffer_id: 5,
            managed: true,
        };
        assert_eq!(at(8, 0x4008, &managed), Ok(PointerValue::Bool(true)));
        assert_eq!(at(4, 0x4008, &managed), Ok(PointerValue::Word(0x4008)));
        assert_eq!(at(2, 0x4008, &managed), Ok(PointerValue::Int(2)));
        let mapped = PointerInfo::Host {
            start: 0x9000,
            memory: HostMemory {
                size: 64,
                flags: 2,
                ctx: 7,
                registered: true,
                buffer_id: 6,
            },
            device: Some(0x7000),
        };
        assert_eq!(at(3, 0x9010, &mapped), Ok(PointerValue::Word(0x7010)));
    }
}
