//! vgpu-schedd: the host-wide scheduler daemon that device processes ask before they dispatch
//! a command group (DESIGN §2), the wire protocol between them, and the host CPU coordination
//! through cgroups.
//!
//! [`seqpacket`] is the only module with `unsafe` code (socket system calls).

#![deny(unsafe_code)]

pub mod busy_poll;
pub mod cgroup;
pub mod client;
pub mod control;
pub mod daemon;
pub mod dashboard;
pub mod definitions;
pub mod http;
pub mod metrics;
pub mod metrics_listener;
pub mod proto;
#[allow(unsafe_code)]
pub mod seqpacket;
pub mod server;
