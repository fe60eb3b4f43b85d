//! Guest-side drivers that run against a QEMU started with `-accel qtest`: there is no guest
//! OS, every port and memory access is a qtest command. Enough of a PCI, virtio-pci and
//! virtio-gpu driver to enumerate, configure and exercise a virtio-gpu function. Also the
//! wire format of the host-guest control channel ([`control`]) that `vgpu-agent` speaks in a
//! real guest.

pub mod control;
pub mod guest_ram;
pub mod pci;
pub mod qtest;
pub mod virtgpu;
pub mod virtio_gpu;
pub mod virtio_pci;
