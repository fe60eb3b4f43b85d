//! The backend trait: what the virtio-gpu device asks of a 3D renderer (in the manner of
//! vhost-device-gpu's `renderer.rs`). The device executes 3D commands through it and never
//! names a concrete renderer; [`Virgl`] is the first implementation, CUDA remoting and the
//! simulated engine come later.
//!
//! A backend is used from one thread only (the device worker), so it needs neither `Send` nor
//! `Sync`.

use std::os::fd::RawFd;

use crate::virgl::{BackingMemory, CapsetInfo, ResourceCreate3d, Transfer, Virgl, VirglError};

/// Errors of a backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// virglrenderer refused the call.
    #[error(transparent)]
    Virgl(#[from] VirglError),
}

/// Result type of backend calls.
pub type BackendResult<T> = Result<T, BackendError>;

/// A 3D renderer executing one guest's contexts, resources and command streams, with fences
/// signalled through a pollable fd.
pub trait GpuBackend: std::fmt::Debug {
    /// Version and size of capset `id`.
    fn capset_info(&self, id: u32) -> BackendResult<CapsetInfo>;
    /// Capset `id` at `version` (0: the newest).
    fn capset(&self, id: u32, version: u32) -> BackendResult<Vec<u8>>;
    /// Creates context `ctx_id`.
    fn context_create(&self, ctx_id: u32, name: &str) -> BackendResult<()>;
    /// Destroys context `ctx_id`.
    fn context_destroy(&self, ctx_id: u32);
    /// Creates resource `id`.
    fn resource_create(&self, id: u32, args: &ResourceCreate3d) -> BackendResult<()>;
    /// Destroys resource `id` (its backing is released).
    fn resource_unref(&self, id: u32) -> BackendResult<()>;
    /// Makes resource `id` usable in context `ctx_id`.
    fn ctx_attach_resource(&self, ctx_id: u32, id: u32) -> BackendResult<()>;
    /// Removes resource `id` from context `ctx_id`.
    fn ctx_detach_resource(&self, ctx_id: u32, id: u32) -> BackendResult<()>;
    /// Gives resource `id` its backing memory, owned until detach or unref.
    fn attach_backing(&self, id: u32, backing: Box<dyn BackingMemory>) -> BackendResult<()>;
    /// Takes resource `id`'s backing back.
    fn detach_backing(&self, id: u32) -> BackendResult<Box<dyn BackingMemory>>;
    /// Copies from the backing into the resource.
    fn transfer_write(&self, id: u32, ctx_id: u32, t: &Transfer) -> BackendResult<()>;
    /// Copies from the resource into the backing.
    fn transfer_read(&self, id: u32, ctx_id: u32, t: &Transfer) -> BackendResult<()>;
    /// Copies from the resource into a host buffer (scanout read-back).
    fn transfer_read_into(
        &self,
        id: u32,
        ctx_id: u32,
        t: &Transfer,
        out: &mut [u8],
    ) -> BackendResult<()>;
    /// Executes a command stream in context `ctx_id`.
    fn submit(&self, ctx_id: u32, commands: &mut [u32]) -> BackendResult<()>;
    /// Queues fence `fence` after the work submitted so far.
    fn create_fence(&self, fence: u32, ctx_id: u32) -> BackendResult<()>;
    /// The fd that becomes readable when fences may have signalled.
    fn poll_fd(&self) -> Option<RawFd>;
    /// The newest fence signalled since the last call.
    fn poll(&self) -> Option<u32>;
}

impl GpuBackend for Virgl {
    fn capset_info(&self, id: u32) -> BackendResult<CapsetInfo> {
        Ok(Virgl::capset_info(self, id)?)
    }

    fn capset(&self, id: u32, version: u32) -> BackendResult<Vec<u8>> {
        Ok(Virgl::capset(self, id, version)?)
    }

    fn context_create(&self, ctx_id: u32, name: &str) -> BackendResult<()> {
        Ok(Virgl::context_create(self, ctx_id, name)?)
    }

    fn context_destroy(&self, ctx_id: u32) {
        Virgl::context_destroy(self, ctx_id);
    }

    fn resource_create(&self, id: u32, args: &ResourceCreate3d) -> BackendResult<()> {
        Ok(Virgl::resource_create(self, id, args)?)
    }

    fn resource_unref(&self, id: u32) -> BackendResult<()> {
        Ok(Virgl::resource_unref(self, id)?)
    }

    fn ctx_attach_resource(&self, ctx_id: u32, id: u32) -> BackendResult<()> {
        Ok(Virgl::ctx_attach_resource(self, ctx_id, id)?)
    }

    fn ctx_detach_resource(&self, ctx_id: u32, id: u32) -> BackendResult<()> {
        Ok(Virgl::ctx_detach_resource(self, ctx_id, id)?)
    }

    fn attach_backing(&self, id: u32, backing: Box<dyn BackingMemory>) -> BackendResult<()> {
        Ok(Virgl::attach_backing(self, id, backing)?)
    }

    fn detach_backing(&self, id: u32) -> BackendResult<Box<dyn BackingMemory>> {
        Ok(Virgl::detach_backing(self, id)?)
    }

    fn transfer_write(&self, id: u32, ctx_id: u32, t: &Transfer) -> BackendResult<()> {
        Ok(Virgl::transfer_write(self, id, ctx_id, t)?)
    }

    fn transfer_read(&self, id: u32, ctx_id: u32, t: &Transfer) -> BackendResult<()> {
        Ok(Virgl::transfer_read(self, id, ctx_id, t)?)
    }

    fn transfer_read_into(
        &self,
        id: u32,
        ctx_id: u32,
        t: &Transfer,
        out: &mut [u8],
    ) -> BackendResult<()> {
        Ok(Virgl::transfer_read_into(self, id, ctx_id, t, out)?)
    }

    fn submit(&self, ctx_id: u32, commands: &mut [u32]) -> BackendResult<()> {
        Ok(Virgl::submit(self, ctx_id, commands)?)
    }

    fn create_fence(&self, fence: u32, ctx_id: u32) -> BackendResult<()> {
        Ok(Virgl::create_fence(self, fence, ctx_id)?)
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Virgl::poll_fd(self)
    }

    fn poll(&self) -> Option<u32> {
        Virgl::poll(self)
    }
}
