//! Entry points a real `libcuda.so.1` still exports that this device answers with
//! `CUDA_ERROR_NOT_SUPPORTED` (801), saying so once on standard error, so that programs that
//! resolve the whole driver API up front (NVIDIA's matrixMulDynlinkJIT resolves ~150 names with
//! `dlsym` before it calls one) find every name and fail only if they really call one:
//!
//! - texture and surface references (`cuTexRef*`, `cuSurfRef*`, `cuModuleGetTexRef`,
//!   `cuModuleGetSurfRef`, `cuParamSetTexRef`): removed from cuda.h in CUDA 12 and no longer
//!   emitted by nvcc; the executor has no `.texref` and `.surfref` variables (their PTX is
//!   refused at load), so no module could give one. Texture and surface objects replace them.
//! - graphics interop (`cuGraphics*`, `cuGLCtxCreate`): no graphics API shares resources with
//!   the compute context of a VM (docs/CUDA-GUEST.md).
//! - inter-process memory and event handles (`cuIpc*`): a guest process's device memory lives
//!   in its own context of the VM's device; no handle exported from it can be opened in another
//!   process, as on a GPU without IPC support (the device attribute reports none).
//!
//! Every argument is ignored: nothing is read or written through a pointer.

use super::*;

/// Declares each name as an entry point answering [`unsupported`] with its own name.
macro_rules! refused {
    ($($name:ident),* $(,)?) => {
        $(
            entry!($name() { unsupported(stringify!($name)) });
        )*
    };
}

refused!(
    cuModuleGetTexRef,
    cuModuleGetSurfRef,
    cuParamSetTexRef,
    cuTexRefCreate,
    cuTexRefDestroy,
    cuTexRefGetAddress,
    cuTexRefGetAddress_v2,
    cuTexRefGetAddressMode,
    cuTexRefGetArray,
    cuTexRefGetFilterMode,
    cuTexRefGetFlags,
    cuTexRefGetFormat,
    cuTexRefSetAddress,
    cuTexRefSetAddress_v2,
    cuTexRefSetAddress2D,
    cuTexRefSetAddress2D_v3,
    cuTexRefSetAddressMode,
    cuTexRefSetArray,
    cuTexRefSetFilterMode,
    cuTexRefSetFlags,
    cuTexRefSetFormat,
    cuSurfRefGetArray,
    cuSurfRefSetArray,
    cuGraphicsUnregisterResource,
    cuGraphicsSubResourceGetMappedArray,
    cuGraphicsResourceGetMappedPointer,
    cuGraphicsResourceGetMappedPointer_v2,
    cuGraphicsResourceGetMappedMipmappedArray,
    cuGraphicsResourceSetMapFlags,
    cuGraphicsResourceSetMapFlags_v2,
    cuGraphicsMapResources,
    cuGraphicsUnmapResources,
    cuGraphicsGLRegisterBuffer,
    cuGraphicsGLRegisterImage,
    cuGLCtxCreate,
    cuGLCtxCreate_v2,
    cuGLGetDevices,
    cuGLGetDevices_v2,
    cuIpcGetMemHandle,
    cuIpcOpenMemHandle,
    cuIpcOpenMemHandle_v2,
    cuIpcCloseMemHandle,
    cuIpcGetEventHandle,
    cuIpcOpenEventHandle,
);
