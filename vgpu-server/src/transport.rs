//! The vfio-user side of the device (hops 1 and 2): every message the relay
//! ([`crate::relay`]) passes to the `vfio-user` crate's message loop lands in [`Transport`],
//! which checks each access again before the device sees it: region index, offset + count
//! within the region, access width and alignment.
//!
//! Region writes never return an error to the crate: MMIO writes may be posted (No_reply), and
//! the device, not the transport, owns the answer to a bad one. A refused write is counted,
//! logged and puts the device into DEVICE_NEEDS_RESET instead.

use std::fs::File;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use log::{debug, warn};
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_NUM_REGIONS,
};
use vfio_user::{DmaMapFlags, DmaUnmapFlags, ServerBackend};

use crate::device::{Device, VirtioRegion, decode_virtio_bar};
use crate::frame;
use crate::irq::IrqChange;
use crate::metrics::{DeviceMetrics, inc};
use crate::pci;
use crate::worker::WorkerHandle;

/// The regions of the function that hold registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    /// PCI configuration space.
    Config,
    /// BAR 2: MSI-X table and PBA.
    Msix,
    /// BAR 4: the virtio structures.
    Virtio,
}

impl Region {
    /// The region with vfio index `index`, if it holds registers.
    pub fn from_index(index: u32) -> Option<Region> {
        match index {
            VFIO_PCI_CONFIG_REGION_INDEX => Some(Region::Config),
            i if i == VFIO_PCI_BAR0_REGION_INDEX + pci::MSIX_BAR => Some(Region::Msix),
            i if i == VFIO_PCI_BAR0_REGION_INDEX + pci::VIRTIO_BAR => Some(Region::Virtio),
            _ => None,
        }
    }

    /// Size in bytes.
    pub fn size(self) -> u64 {
        match self {
            Region::Config => pci::CONFIG_SPACE_SIZE,
            Region::Msix => pci::MSIX_BAR_SIZE,
            Region::Virtio => pci::VIRTIO_BAR_SIZE,
        }
    }

    /// The vfio region index.
    pub fn index(self) -> u32 {
        match self {
            Region::Config => VFIO_PCI_CONFIG_REGION_INDEX,
            Region::Msix => VFIO_PCI_BAR0_REGION_INDEX + pci::MSIX_BAR,
            Region::Virtio => VFIO_PCI_BAR0_REGION_INDEX + pci::VIRTIO_BAR,
        }
    }
}

/// Number of vfio regions a PCI function reports (BARs 0-5, ROM, config, VGA).
pub const NUM_REGIONS: u32 = VFIO_PCI_NUM_REGIONS;

/// Why a region access was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AccessError {
    /// The region index names no region with registers.
    #[error("region {0} has no registers")]
    UnknownRegion(u32),
    /// offset + count is outside the region.
    #[error("{region:?} access of {len} bytes at {offset:#x} outside its {size:#x} bytes")]
    OutOfRange {
        /// The region.
        region: Region,
        /// Offset.
        offset: u64,
        /// Bytes.
        len: usize,
        /// Region size.
        size: u64,
    },
    /// A BAR access that is not 1, 2, 4 or 8 bytes, naturally aligned.
    #[error(
        "{region:?} access of {len} bytes at {offset:#x}: not a naturally aligned 1/2/4/8-byte access"
    )]
    BadWidth {
        /// The region.
        region: Region,
        /// Offset.
        offset: u64,
        /// Bytes.
        len: usize,
    },
}

/// Validates a region access before any handler runs (libvfio-user's
/// `is_valid_region_access`).
pub fn check_access(index: u32, offset: u64, len: usize) -> Result<Region, AccessError> {
    let region = Region::from_index(index).ok_or(AccessError::UnknownRegion(index))?;
    let size = region.size();
    if !frame::access_within(size, offset, len as u64) {
        return Err(AccessError::OutOfRange {
            region,
            offset,
            len,
            size,
        });
    }
    if region != Region::Config && (!matches!(len, 1 | 2 | 4 | 8) || offset % len as u64 != 0) {
        return Err(AccessError::BadWidth {
            region,
            offset,
            len,
        });
    }
    Ok(region)
}

/// Logs a refused DMA or IRQ message and makes the error the crate answers it with (EINVAL).
fn refusal<E>(message: &'static str) -> impl FnOnce(E) -> io::Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    move |e| {
        warn!("{message} refused: {e}");
        io::Error::new(io::ErrorKind::InvalidInput, e)
    }
}

/// The device of the connection being served. The server's thread puts each connection's
/// device in before the relay passes on its first message and takes it out after the last
/// one was handled; the message loop's thread reads it for every message.
#[derive(Debug, Default)]
pub struct DeviceSlot(Mutex<Option<Arc<Mutex<Device>>>>);

impl DeviceSlot {
    /// Puts `device` in (`None`: between connections).
    pub fn set(&self, device: Option<Arc<Mutex<Device>>>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = device;
    }

    fn get(&self) -> Option<Arc<Mutex<Device>>> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The `vfio-user` server backend: one for the process, serving the device in its
/// [`DeviceSlot`].
#[derive(Debug)]
pub struct Transport<'a> {
    slot: Arc<DeviceSlot>,
    worker: &'a WorkerHandle,
    metrics: Arc<DeviceMetrics>,
}

impl<'a> Transport<'a> {
    /// Serves the device in `slot`; `worker` processes its queues (the caller attaches and
    /// detaches each device).
    pub fn new(
        slot: Arc<DeviceSlot>,
        worker: &'a WorkerHandle,
        metrics: Arc<DeviceMetrics>,
    ) -> Self {
        Transport {
            slot,
            worker,
            metrics,
        }
    }

    /// The slot's device, for the message being handled (held no longer, so that it goes
    /// with its connection).
    fn current(&self) -> io::Result<Arc<Mutex<Device>>> {
        self.slot.get().ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotConnected, "no device between connections")
        })
    }

    /// After a reset the device has queued a Cancel for every group it had at the daemon: a
    /// control-queue kick wakes the worker, which sends them at once (the queue itself is not
    /// live, so the kick runs nothing else).
    fn cancels_go_out(&self) {
        self.worker.kick(crate::virtio_pci::CONTROL_QUEUE);
    }

    fn refuse(&self, device: &Mutex<Device>, e: impl std::fmt::Display) {
        inc(&self.metrics.invalid_accesses);
        lock(device).fault(e);
    }
}

/// The queue a REGION_WRITE payload (checked by [`frame::check_payload`]) notifies, if it is a
/// doorbell: a 2- or 4-byte write to a queue's notify address in the virtio BAR. Such a write
/// needs no device state, so the relay may turn a posted one into a worker kick itself when
/// nothing is in flight before it (the doorbell fast path, [`crate::relay::Relay::serve`]).
pub fn posted_notify(payload: &[u8]) -> Option<u16> {
    let access = frame::region_access(payload)?;
    let len = access.data.len();
    if u64::from(access.count) != len as u64 {
        return None;
    }
    match check_access(access.region, access.offset, len) {
        Ok(Region::Virtio) => match decode_virtio_bar(access.offset, len)? {
            VirtioRegion::Notify(q) => Some(q),
            _ => None,
        },
        _ => None,
    }
}

fn lock(device: &Mutex<Device>) -> MutexGuard<'_, Device> {
    device.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ServerBackend for Transport<'_> {
    fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        let device = self.current()?;
        inc(&self.metrics.region_reads);
        let region = match check_access(index, offset, data.len()) {
            Ok(region) => region,
            Err(e) => {
                self.refuse(&device, &e);
                return Err(io::Error::new(io::ErrorKind::InvalidInput, e));
            }
        };
        match region {
            Region::Config => lock(&device).config_read(offset, data),
            // QEMU emulates the MSI-X table and PBA; nothing is pending on our side.
            Region::Msix => data.fill(0),
            Region::Virtio => match decode_virtio_bar(offset, data.len()) {
                Some(r) => lock(&device).virtio_read(r, data),
                None => {
                    data.fill(0);
                    self.refuse(
                        &device,
                        format_args!(
                            "read of {} bytes at virtio BAR offset {offset:#x}",
                            data.len()
                        ),
                    );
                }
            },
        }
        Ok(())
    }

    fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        let device = self.current()?;
        inc(&self.metrics.region_writes);
        match check_access(index, offset, data.len()) {
            Err(e) => self.refuse(&device, e),
            Ok(Region::Config) => {
                let kick = lock(&device).config_write(offset, data);
                if let Some(q) = kick {
                    inc(&self.metrics.notifies);
                    self.worker.kick(q);
                }
            }
            Ok(Region::Msix) => {
                debug!("write to MSI-X BAR at {offset:#x} ignored (QEMU emulates the table)")
            }
            Ok(Region::Virtio) => match decode_virtio_bar(offset, data.len()) {
                Some(VirtioRegion::Notify(q)) => {
                    inc(&self.metrics.notifies);
                    self.worker.kick(q);
                }
                Some(r) => {
                    let reset = {
                        let mut d = lock(&device);
                        d.virtio_write(r, data);
                        matches!(r, VirtioRegion::Common(_)) && d.status() == 0
                    };
                    if reset {
                        self.cancels_go_out();
                    }
                }
                None => self.refuse(
                    &device,
                    format_args!(
                        "write of {} bytes at virtio BAR offset {offset:#x}",
                        data.len()
                    ),
                ),
            },
        }
        Ok(())
    }

    fn dma_map(
        &mut self,
        flags: DmaMapFlags,
        offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> io::Result<()> {
        let device = self.current()?;
        let writable = flags.contains(DmaMapFlags::READ_WRITE);
        lock(&device)
            .dma_map(address, size, fd, offset, writable)
            .map_err(refusal("DMA_MAP"))
    }

    fn dma_unmap(&mut self, flags: DmaUnmapFlags, address: u64, size: u64) -> io::Result<()> {
        let device = self.current()?;
        let all = flags.contains(DmaUnmapFlags::UNMAP_ALL);
        lock(&device)
            .dma_unmap(address, size, all)
            .map_err(refusal("DMA_UNMAP"))
    }

    fn reset(&mut self) -> io::Result<()> {
        let device = self.current()?;
        lock(&device).function_reset();
        self.cancels_go_out();
        Ok(())
    }

    fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> io::Result<()> {
        let device = self.current()?;
        let change = lock(&device)
            .set_irqs(index, flags, start, count, fds)
            .map_err(refusal("SET_IRQS"))?;
        if change == IrqChange::ResampleChanged {
            self.worker.resample_changed();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_doorbell_writes_take_the_fast_path() {
        let write = |region: u32, offset: u64, count: u32, data: &[u8]| {
            let mut p = offset.to_le_bytes().to_vec();
            p.extend_from_slice(&region.to_le_bytes());
            p.extend_from_slice(&count.to_le_bytes());
            p.extend_from_slice(data);
            p
        };
        let bar = VFIO_PCI_BAR0_REGION_INDEX + pci::VIRTIO_BAR;
        let notify = pci::NOTIFY_OFFSET;
        let q1 = notify + u64::from(pci::NOTIFY_OFF_MULTIPLIER);
        assert_eq!(posted_notify(&write(bar, notify, 2, &[0, 0])), Some(0));
        assert_eq!(posted_notify(&write(bar, q1, 4, &[1, 0, 0, 0])), Some(1));
        // Not doorbells: another register, another region, a bad width or alignment, a count
        // that disagrees with the data, a truncated access header, past the BAR's end.
        assert_eq!(posted_notify(&write(bar, 0x14, 1, &[0])), None);
        assert_eq!(
            posted_notify(&write(VFIO_PCI_CONFIG_REGION_INDEX, 4, 2, &[0, 0])),
            None
        );
        assert_eq!(posted_notify(&write(bar, notify, 1, &[0])), None);
        assert_eq!(posted_notify(&write(bar, notify + 1, 2, &[0, 0])), None);
        assert_eq!(posted_notify(&write(bar, notify, 4, &[0, 0])), None);
        assert_eq!(posted_notify(&write(bar, notify, 2, &[0, 0])[..10]), None);
        assert_eq!(posted_notify(&write(bar, u64::MAX - 1, 2, &[0, 0])), None);
    }

    #[test]
    fn access_validation() {
        assert_eq!(check_access(7, 0, 256), Ok(Region::Config));
        assert_eq!(check_access(7, 255, 1), Ok(Region::Config));
        assert!(matches!(
            check_access(7, 255, 2),
            Err(AccessError::OutOfRange { .. })
        ));
        assert!(matches!(
            check_access(7, 0, 0),
            Err(AccessError::OutOfRange { .. })
        ));
        assert_eq!(check_access(0, 0, 4), Err(AccessError::UnknownRegion(0)));
        assert_eq!(check_access(99, 0, 4), Err(AccessError::UnknownRegion(99)));
        assert_eq!(check_access(4, 0x3ffc, 4), Ok(Region::Virtio));
        assert!(matches!(
            check_access(4, 0x3ffc, 8),
            Err(AccessError::OutOfRange { .. })
        ));
        assert!(matches!(
            check_access(4, u64::MAX, 2),
            Err(AccessError::OutOfRange { .. })
        ));
        assert!(matches!(
            check_access(4, 2, 4),
            Err(AccessError::BadWidth { .. })
        ));
        assert!(matches!(
            check_access(2, 0, 3),
            Err(AccessError::BadWidth { .. })
        ));
        assert_eq!(check_access(2, 0x808, 8), Ok(Region::Msix));
    }
}
