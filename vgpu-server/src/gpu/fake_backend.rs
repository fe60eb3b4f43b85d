//! A renderer that renders nothing, for unit tests of the 3D paths: every call succeeds and
//! the calls that allocate or copy are counted.

use std::cell::Cell;
use std::os::fd::RawFd;

use mdev_backend::virgl::{BackingMemory, CapsetInfo, ResourceCreate3d, Transfer};
use mdev_backend::{BackendResult, GpuBackend};

/// Counts of the calls a test checks.
#[derive(Debug, Default)]
pub struct FakeBackend {
    /// Resources created.
    pub created: Cell<u32>,
    /// Resources destroyed.
    pub destroyed: Cell<u32>,
    /// Read-backs into host buffers.
    pub read_backs: Cell<u32>,
}

impl GpuBackend for FakeBackend {
    fn capset_info(&self, id: u32) -> BackendResult<CapsetInfo> {
        Ok(CapsetInfo {
            id,
            max_version: 1,
            max_size: 4,
        })
    }
    fn capset(&self, _id: u32, _version: u32) -> BackendResult<Vec<u8>> {
        Ok(vec![0; 4])
    }
    fn context_create(&self, _ctx_id: u32, _name: &str) -> BackendResult<()> {
        Ok(())
    }
    fn context_destroy(&self, _ctx_id: u32) {}
    fn resource_create(&self, _id: u32, _args: &ResourceCreate3d) -> BackendResult<()> {
        self.created.set(self.created.get() + 1);
        Ok(())
    }
    fn resource_unref(&self, _id: u32) -> BackendResult<()> {
        self.destroyed.set(self.destroyed.get() + 1);
        Ok(())
    }
    fn ctx_attach_resource(&self, _ctx_id: u32, _id: u32) -> BackendResult<()> {
        Ok(())
    }
    fn ctx_detach_resource(&self, _ctx_id: u32, _id: u32) -> BackendResult<()> {
        Ok(())
    }
    fn attach_backing(&self, _id: u32, _backing: Box<dyn BackingMemory>) -> BackendResult<()> {
        Ok(())
    }
    fn detach_backing(&self, _id: u32) -> BackendResult<Box<dyn BackingMemory>> {
        Ok(Box::new(mdev_backend::virgl::HostBacking::new(vec![
            vec![0u8; 1].into(),
        ])))
    }
    fn transfer_write(&self, _id: u32, _ctx_id: u32, _t: &Transfer) -> BackendResult<()> {
        Ok(())
    }
    fn transfer_read(&self, _id: u32, _ctx_id: u32, _t: &Transfer) -> BackendResult<()> {
        Ok(())
    }
    fn transfer_read_into(
        &self,
        _id: u32,
        _ctx_id: u32,
        _t: &Transfer,
        _out: &mut [u8],
    ) -> BackendResult<()> {
        self.read_backs.set(self.read_backs.get() + 1);
        Ok(())
    }
    fn submit(&self, _ctx_id: u32, _commands: &mut [u32]) -> BackendResult<()> {
        Ok(())
    }
    fn create_fence(&self, _fence: u32, _ctx_id: u32) -> BackendResult<()> {
        Ok(())
    }
    fn poll_fd(&self) -> Option<RawFd> {
        None
    }
    fn poll(&self) -> Option<u32> {
        None
    }
}
