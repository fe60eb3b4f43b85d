//! vgpu-scheduler: the host-wide scheduling policies (TimeGraph, Pegasus, VGRIS, NEON/LoGA) that
//! decide when each vGPU's command groups reach the GPU (hop 6 of the data path).
//!
//! Empty until the scheduler issue: the foundation device dispatches nothing to a GPU.
