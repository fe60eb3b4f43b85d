//! mdev-backend: executes granted command groups on the physical GPU (virglrenderer, CUDA) or on
//! the simulated engine, and reports their completion fences (hops 7 and 8 of the data path).
//!
//! Empty until the virtio-gpu 3D issue: the foundation device answers its control commands
//! without GPU work.
