//! vgpu-scheduler: the host-wide GPU scheduling policies (TimeGraph, Pegasus, VGRIS,
//! NEON/LoGA fair queuing) that decide when each vGPU's command groups reach the GPU (hop 6 of
//! the data path), and a deterministic GPU simulator to test and compare them.
//!
//! The library does no I/O, has no unsafe code and never reads a clock: time is an input. The
//! daemon and the simulator feed [`Event`]s with their own clock into a [`Scheduler`] and carry
//! out the [`Decision`]s it returns.

#![forbid(unsafe_code)]

pub mod core;
pub mod model;
pub mod policy;
pub mod sim;
#[cfg(test)]
mod testkit;

pub use crate::core::{Account, Cx, Online, SchedError, Scheduler, VgpuState};
pub use crate::model::{
    Budget, CommandGroup, ConfigChange, CostSignature, CpuHint, Decision, Event, GroupId,
    GroupKind, Nanos, Time, VgpuId, VgpuParams,
};
pub use crate::policy::{Policy, PolicyConfig};
