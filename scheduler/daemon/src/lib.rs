//! vgpu-schedd: the host-wide scheduler daemon that device processes ask before they dispatch
//! a command group (DESIGN §2), the wire protocol between them, and the host CPU coordination
//! through cgroups.

pub mod cgroup;
pub mod daemon;
pub mod proto;
