//! `cuDeviceGetAttribute` and `cuFuncGetAttribute` answers from the host's
//! [`DeviceAttributes`]; attribute numbers from the driver API's `cuda.h`.

use std::ffi::c_int;

use mdev_backend::compute::backend::{DeviceAttributes, FunctionAttributes};

use crate::driver::CuResult;
use crate::status::CUDA_ERROR_INVALID_VALUE;

/// Highest `CUdevice_attribute` answered (others known to cuda.h 12 answer 0: not supported).
const MAX_DEVICE_ATTRIBUTE: c_int = 150;
/// Registers per block and per multiprocessor reported: what every GPU since Kepler has.
const REGISTERS: c_int = 65536;

pub fn device_attribute(a: &DeviceAttributes, attribute: c_int) -> CuResult<c_int> {
    let v = |x: u32| x.min(c_int::MAX as u32) as c_int;
    Ok(match attribute {
        1 => v(a.max_threads_per_block),
        2..=4 => v(a.max_block[(attribute - 2) as usize]),
        5..=7 => v(a.max_grid[(attribute - 5) as usize]),
        8 => v(a.shared_memory_per_block),
        9 => 64 * 1024,
        10 => v(a.warp_size),
        11 => c_int::MAX,
        12 | 82 => REGISTERS,
        13 => v(a.clock_khz),
        14 => 512,
        // GPU overlap, concurrent kernels, can map host memory: no.
        15 | 19 | 31 => 0,
        // Unified addressing: where the host places device memory in windows this library
        // reserves (driver.rs `context_create`).
        41 => c_int::from(a.placement),
        16 => v(a.multiprocessors),
        // Integrated, ECC, TCC, kernel timeout: no; compute mode default (0).
        17 | 18 | 20 | 32 | 35 => 0,
        39 => 2048,
        40 => 1,
        75 => v(a.compute_capability.0),
        76 => v(a.compute_capability.1),
        81 | 97 => v(a.shared_memory_per_block),
        0 | MAX_DEVICE_ATTRIBUTE.. => return Err(CUDA_ERROR_INVALID_VALUE),
        _ => 0,
    })
}

/// `cuFuncGetAttribute`'s answer from the function's attributes on the host (`f`) and the
/// device's compute capability (the PTX and binary versions).
pub fn function_attribute(
    attribute: c_int,
    f: &FunctionAttributes,
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
        7..=10 => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}
