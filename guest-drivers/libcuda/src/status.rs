//! `CUresult` values (the CUDA driver API's `cuda.h`) and their names.

use std::ffi::CStr;

pub const CUDA_SUCCESS: u32 = 0;
pub const CUDA_ERROR_INVALID_VALUE: u32 = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: u32 = 3;
pub const CUDA_ERROR_DEINITIALIZED: u32 = 4;
pub const CUDA_ERROR_NO_DEVICE: u32 = 100;
pub const CUDA_ERROR_INVALID_DEVICE: u32 = 101;
pub const CUDA_ERROR_INVALID_IMAGE: u32 = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: u32 = 201;
pub const CUDA_ERROR_FILE_NOT_FOUND: u32 = 301;
pub const CUDA_ERROR_INVALID_HANDLE: u32 = 400;
pub const CUDA_ERROR_ILLEGAL_STATE: u32 = 401;
pub const CUDA_ERROR_NOT_FOUND: u32 = 500;
pub const CUDA_ERROR_NOT_READY: u32 = 600;
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: u32 = 712;
pub const CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: u32 = 713;
pub const CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: u32 = 720;
pub const CUDA_ERROR_NOT_SUPPORTED: u32 = 801;
pub const CUDA_ERROR_UNKNOWN: u32 = 999;

/// (value, name, description) of the statuses this driver returns or forwards.
const NAMES: &[(u32, &CStr, &CStr)] = &[
    (0, c"CUDA_SUCCESS", c"no error"),
    (1, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (
        4,
        c"CUDA_ERROR_DEINITIALIZED",
        c"driver shutting down (the host connection is gone)",
    ),
    (
        46,
        c"CUDA_ERROR_DEVICE_NOT_AVAILABLE",
        c"CUDA-capable device is busy or unavailable",
    ),
    (
        100,
        c"CUDA_ERROR_NO_DEVICE",
        c"no CUDA-capable device is detected",
    ),
    (101, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (
        200,
        c"CUDA_ERROR_INVALID_IMAGE",
        c"device kernel image is invalid",
    ),
    (
        201,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        209,
        c"CUDA_ERROR_NO_BINARY_FOR_GPU",
        c"no kernel image is available for execution on the device",
    ),
    (
        218,
        c"CUDA_ERROR_INVALID_PTX",
        c"a PTX JIT compilation failed",
    ),
    (301, c"CUDA_ERROR_FILE_NOT_FOUND", c"file not found"),
    (
        400,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (
        401,
        c"CUDA_ERROR_ILLEGAL_STATE",
        c"the operation cannot be performed in the present state",
    ),
    (500, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (600, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (
        700,
        c"CUDA_ERROR_ILLEGAL_ADDRESS",
        c"an illegal memory access was encountered",
    ),
    (
        701,
        c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        c"too many resources requested for launch",
    ),
    (
        702,
        c"CUDA_ERROR_LAUNCH_TIMEOUT",
        c"the launch timed out and was terminated",
    ),
    (
        712,
        c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        c"part or all of the requested memory range is already mapped",
    ),
    (
        713,
        c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        c"pointer does not correspond to a registered memory region",
    ),
    (
        715,
        c"CUDA_ERROR_ILLEGAL_INSTRUCTION",
        c"an illegal instruction was encountered",
    ),
    (716, c"CUDA_ERROR_MISALIGNED_ADDRESS", c"misaligned address"),
    (
        719,
        c"CUDA_ERROR_LAUNCH_FAILED",
        c"unspecified launch failure",
    ),
    (
        720,
        c"CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        c"too many blocks in cooperative launch",
    ),
    (801, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (
        900,
        c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        c"operation not permitted when stream is capturing",
    ),
    (
        901,
        c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        c"operation failed due to a previous error during capture",
    ),
    (
        902,
        c"CUDA_ERROR_STREAM_CAPTURE_MERGE",
        c"operation would result in a merge of separate capture sequences",
    ),
    (
        903,
        c"CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        c"capture was not ended in the same stream as it began",
    ),
    (
        904,
        c"CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        c"capturing stream has unjoined work",
    ),
    (
        905,
        c"CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        c"dependency created on uncaptured work in another stream",
    ),
    (
        906,
        c"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        c"operation would make the legacy stream depend on a capturing blocking stream",
    ),
    (
        908,
        c"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        c"attempt to terminate a thread-local capture sequence from another thread",
    ),
    (
        910,
        c"CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
        c"the graph update was not performed because it included changes which violated constraints specific to instantiated graph update",
    ),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// The name and description of a status, as NUL-terminated strings for C.
pub fn describe(status: u32) -> Option<(&'static CStr, &'static CStr)> {
    NAMES
        .iter()
        .find(|(v, ..)| *v == status)
        .map(|&(_, n, d)| (n, d))
}
