//! Virtio 1.x driver for the modern PCI transport, with split virtqueues.
//!
//! Interrupts are observed the way libqos does under qtest: each MSI-X vector's message address
//! points at a "mailbox" dword in guest RAM, so when the device signals the vector, QEMU's MSI
//! write lands in RAM and can be polled with qtest reads.
//!
//! Besides the high-level path ([`VirtioPciDevice::negotiate`], [`VirtioPciDevice::setup_queue`],
//! [`VirtioPciDevice::request`], [`VirtioPciDevice::wait_used`]) the driver exposes raw access
//! (descriptors, avail/used rings, common configuration fields) for tests that feed a device
//! malformed input.
//!
//! The high-level path always notifies and never writes `used_event`, so it does not implement
//! `VIRTIO_RING_F_EVENT_IDX` interrupt suppression; tests negotiating that feature must manage
//! `used_event` through the raw ring addresses.

use std::collections::HashMap;
use std::thread;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FEATURES_OK,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};

use crate::guest_ram::{GuestRam, GuestRamError};
use crate::pci::{
    Bars, CAP_ID_VENDOR, COMMAND_BUS_MASTER, COMMAND_IO_SPACE, COMMAND_MEMORY_SPACE, MsiMessage,
    MsixCapability, PciAllocator, PciDevice, PciError,
};
use crate::qtest::{Qtest, QtestError};

/// PCI vendor ID of virtio devices.
pub const VIRTIO_PCI_VENDOR_ID: u16 = 0x1af4;
/// Modern virtio PCI device IDs are this plus the virtio device ID (16 = GPU gives 0x1050).
pub const VIRTIO_PCI_MODERN_DEVICE_ID_BASE: u16 = 0x1040;

/// Vendor capability type: common configuration.
pub const CAP_COMMON_CFG: u8 = 1;
/// Vendor capability type: notifications.
pub const CAP_NOTIFY_CFG: u8 = 2;
/// Vendor capability type: ISR status.
pub const CAP_ISR_CFG: u8 = 3;
/// Vendor capability type: device-specific configuration.
pub const CAP_DEVICE_CFG: u8 = 4;
/// Vendor capability type: PCI configuration access window.
pub const CAP_PCI_CFG: u8 = 5;

/// "No MSI-X vector" value of `config_msix_vector` / `queue_msix_vector`.
pub const MSI_NO_VECTOR: u16 = 0xffff;
/// MSI data value of vector `n` is `MSI_DATA_BASE | n`.
pub const MSI_DATA_BASE: u32 = 0x5647_0000;

/// Size of the per-queue area holding the buffers of [`VirtioPciDevice::request`].
pub const QUEUE_BUFFER_AREA: u64 = 256 * 1024;

/// How long [`VirtioPciDevice::reset`] waits for the device status to read back 0.
const RESET_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between two polls of guest memory.
const POLL_INTERVAL: Duration = Duration::from_micros(200);
/// Alignment of each buffer in a queue's buffer area.
const BUFFER_ALIGN: u64 = 16;

/// Offsets of the common configuration structure (`struct virtio_pci_common_cfg`).
pub mod common_cfg {
    /// `device_feature_select` (le32).
    pub const DEVICE_FEATURE_SELECT: u16 = 0x00;
    /// `device_feature` (le32, read-only).
    pub const DEVICE_FEATURE: u16 = 0x04;
    /// `driver_feature_select` (le32).
    pub const DRIVER_FEATURE_SELECT: u16 = 0x08;
    /// `driver_feature` (le32).
    pub const DRIVER_FEATURE: u16 = 0x0c;
    /// `config_msix_vector` (le16).
    pub const CONFIG_MSIX_VECTOR: u16 = 0x10;
    /// `num_queues` (le16, read-only).
    pub const NUM_QUEUES: u16 = 0x12;
    /// `device_status` (u8).
    pub const DEVICE_STATUS: u16 = 0x14;
    /// `config_generation` (u8, read-only).
    pub const CONFIG_GENERATION: u16 = 0x15;
    /// `queue_select` (le16).
    pub const QUEUE_SELECT: u16 = 0x16;
    /// `queue_size` (le16).
    pub const QUEUE_SIZE: u16 = 0x18;
    /// `queue_msix_vector` (le16).
    pub const QUEUE_MSIX_VECTOR: u16 = 0x1a;
    /// `queue_enable` (le16).
    pub const QUEUE_ENABLE: u16 = 0x1c;
    /// `queue_notify_off` (le16, read-only).
    pub const QUEUE_NOTIFY_OFF: u16 = 0x1e;
    /// `queue_desc` (le64, accessed as two le32 halves).
    pub const QUEUE_DESC: u16 = 0x20;
    /// `queue_driver` (le64, accessed as two le32 halves).
    pub const QUEUE_DRIVER: u16 = 0x28;
    /// `queue_device` (le64, accessed as two le32 halves).
    pub const QUEUE_DEVICE: u16 = 0x30;
}

/// Errors of the virtio PCI driver.
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    /// A qtest command failed.
    #[error(transparent)]
    Qtest(#[from] QtestError),
    /// A PCI-level operation failed.
    #[error(transparent)]
    Pci(#[from] PciError),
    /// Guest RAM ran out.
    #[error(transparent)]
    GuestRam(#[from] GuestRamError),
    /// A required vendor capability is missing.
    #[error("device has no virtio capability of cfg_type {0}")]
    MissingCapability(u8),
    /// Device status did not read back 0 after a reset.
    #[error("device status still {0:#x} after reset")]
    ResetTimeout(u8),
    /// The device cleared FEATURES_OK: it does not accept the driver's features.
    #[error("device rejected features {0:#x} (FEATURES_OK did not stick)")]
    FeaturesRejected(u64),
    /// The queue index is at or beyond `num_queues`, or the device reports size 0 for it.
    #[error("queue {0} is not available")]
    NoSuchQueue(u16),
    /// The queue size requested is 0, not a power of two, or above the device's maximum.
    #[error("queue {index}: size {size} invalid (device maximum {max})")]
    BadQueueSize {
        /// Queue index.
        index: u16,
        /// Requested size.
        size: u16,
        /// Device maximum.
        max: u16,
    },
    /// The queue has not been set up with [`VirtioPciDevice::setup_queue`].
    #[error("queue {0} is not set up")]
    QueueNotSetUp(u16),
    /// The device did not accept an MSI-X vector (read back `MSI_NO_VECTOR`).
    #[error("device refused MSI-X vector {vector:#x} for {target}")]
    VectorRejected {
        /// "config" or "queue N".
        target: String,
        /// The vector written.
        vector: u16,
    },
    /// MSI-X was used before [`VirtioPciDevice::enable_msix`] or beyond the enabled vectors.
    #[error("MSI-X vector {0} is not enabled")]
    VectorNotEnabled(u16),
    /// The device has no MSI-X capability.
    #[error("device has no MSI-X capability")]
    NoMsix,
    /// A raw access names a descriptor beyond the queue's table.
    #[error("queue {queue}: descriptor {index} beyond its {size} entries")]
    DescriptorOutOfRange {
        /// Queue index.
        queue: u16,
        /// Descriptor index.
        index: u16,
        /// Queue size.
        size: u16,
    },
    /// A request has no buffers at all.
    #[error("request without buffers")]
    EmptyRequest,
    /// Not enough free descriptors for the request.
    #[error("queue {queue}: {needed} descriptors needed, {free} free")]
    OutOfDescriptors {
        /// Queue index.
        queue: u16,
        /// Descriptors needed.
        needed: usize,
        /// Descriptors free.
        free: usize,
    },
    /// Not enough room in the queue's buffer area for the request.
    #[error("queue {queue}: no room for {size} bytes of request buffers")]
    OutOfBufferSpace {
        /// Queue index.
        queue: u16,
        /// Bytes needed.
        size: u64,
    },
    /// No used element appeared in time.
    #[error("queue {queue}: no used buffer within {timeout:?}")]
    UsedTimeout {
        /// Queue index.
        queue: u16,
        /// How long was waited.
        timeout: Duration,
    },
    /// The device returned a different head than the request waited for.
    #[error("queue {queue}: used ring returned id {got}, expected {expected}")]
    UnexpectedUsedId {
        /// Queue index.
        queue: u16,
        /// Head of the request.
        expected: u16,
        /// Id in the used element.
        got: u32,
    },
    /// The MSI-X mailbox of a vector did not receive the message in time.
    #[error("no MSI-X message on vector {vector} within {timeout:?}")]
    MsixTimeout {
        /// The vector.
        vector: u16,
        /// How long was waited.
        timeout: Duration,
    },
    /// An access beyond the device-specific configuration structure.
    #[error("device config access at {offset:#x} (+{width}) beyond its {length:#x} bytes")]
    DeviceConfigRange {
        /// Offset of the access.
        offset: u32,
        /// Width of the access.
        width: u32,
        /// Length of the structure.
        length: u32,
    },
    /// A PCI configuration access capability access with a width other than 1, 2 or 4.
    #[error("PCI cfg capability access width {0} (must be 1, 2 or 4)")]
    BadAccessWidth(u8),
}

/// Result type of this module.
pub type Result<T> = std::result::Result<T, VirtioError>;

/// One virtio vendor capability (`struct virtio_pci_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioCap {
    /// Offset of the capability in configuration space.
    pub cap_offset: u8,
    /// `cap_len`.
    pub cap_len: u8,
    /// `cfg_type` (`CAP_*`).
    pub cfg_type: u8,
    /// BAR index the structure lives in.
    pub bar: u8,
    /// `id` (distinguishes multiple shared-memory regions).
    pub id: u8,
    /// Offset of the structure in the BAR.
    pub offset: u32,
    /// Length of the structure.
    pub length: u32,
}

/// A structure mapped in a BAR: guest-physical address and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Guest-physical address.
    pub address: u64,
    /// Length in bytes.
    pub length: u32,
}

/// A split virtqueue descriptor (`struct virtq_desc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Descriptor {
    /// Buffer guest-physical address.
    pub addr: u64,
    /// Buffer length.
    pub len: u32,
    /// `VRING_DESC_F_*` flags.
    pub flags: u16,
    /// Next descriptor when `flags` has `VRING_DESC_F_NEXT`.
    pub next: u16,
}

impl Descriptor {
    /// Size of a descriptor in the table.
    pub const SIZE: u64 = 16;

    /// Its 16 bytes as they lie in a descriptor table (e.g. for an indirect table a test
    /// writes into guest memory itself).
    pub fn to_bytes(self) -> [u8; 16] {
        let mut bytes = [0; 16];
        bytes[0..8].copy_from_slice(&self.addr.to_le_bytes());
        bytes[8..12].copy_from_slice(&self.len.to_le_bytes());
        bytes[12..14].copy_from_slice(&self.flags.to_le_bytes());
        bytes[14..16].copy_from_slice(&self.next.to_le_bytes());
        bytes
    }
}

/// A used ring element (`struct virtq_used_elem`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsedElem {
    /// Head descriptor index of the chain.
    pub id: u32,
    /// Bytes the device wrote into the chain's device-writable buffers.
    pub len: u32,
}

/// A used element taken from the used ring by [`VirtioPciDevice::wait_used`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The used element.
    pub used: UsedElem,
    /// The device-writable buffers (full requested lengths) when the id is the head of a chain
    /// made by [`VirtioPciDevice::request`]; `None` for any other id (raw chains, bogus ids).
    pub writable: Option<Vec<Vec<u8>>>,
}

/// A request made by [`VirtioPciDevice::request`] that the device has not returned yet.
#[derive(Debug)]
struct InFlight {
    descriptors: Vec<u16>,
    writable: Vec<(u64, u32)>,
    area_offset: u64,
}

/// First-fit allocator over a queue's buffer area.
#[derive(Debug)]
struct BufferArea {
    base: u64,
    size: u64,
    /// Allocated `(offset, length)` ranges, sorted by offset.
    used: Vec<(u64, u64)>,
}

impl BufferArea {
    fn alloc(&mut self, size: u64) -> Option<u64> {
        let size = size.max(1).next_multiple_of(BUFFER_ALIGN);
        let mut start = 0;
        let mut slot = self.used.len();
        for (i, &(offset, length)) in self.used.iter().enumerate() {
            if offset - start >= size {
                slot = i;
                break;
            }
            start = offset + length;
        }
        if slot == self.used.len() && self.size - start < size {
            return None;
        }
        self.used.insert(slot, (start, size));
        Some(start)
    }

    fn free(&mut self, offset: u64) {
        self.used.retain(|&(start, _)| start != offset);
    }
}

/// Driver-side state of one split virtqueue.
#[derive(Debug)]
pub struct Virtqueue {
    index: u16,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    notify_address: u64,
    msix_vector: u16,
    avail_idx: u16,
    last_used_idx: u16,
    free: Vec<u16>,
    in_flight: HashMap<u16, InFlight>,
    area: BufferArea,
}

impl Virtqueue {
    /// Queue index.
    pub fn index(&self) -> u16 {
        self.index
    }

    /// Number of descriptors.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Guest-physical address of the descriptor table.
    pub fn desc_address(&self) -> u64 {
        self.desc
    }

    /// Guest-physical address of the avail ring (`flags`, `idx`, `ring[]`, `used_event`).
    pub fn avail_address(&self) -> u64 {
        self.avail
    }

    /// Guest-physical address of the used ring (`flags`, `idx`, `ring[]`, `avail_event`).
    pub fn used_address(&self) -> u64 {
        self.used
    }

    /// Address written to notify this queue.
    pub fn notify_address(&self) -> u64 {
        self.notify_address
    }

    /// MSI-X vector of the queue (`MSI_NO_VECTOR` for none).
    pub fn msix_vector(&self) -> u16 {
        self.msix_vector
    }

    /// The driver's avail index: the value `avail.idx` was last set to.
    pub fn avail_idx(&self) -> u16 {
        self.avail_idx
    }

    /// The used index up to which the driver has consumed used elements.
    pub fn last_used_idx(&self) -> u16 {
        self.last_used_idx
    }

    fn slot(&self, idx: u16) -> u64 {
        u64::from(idx % self.size)
    }
}

/// A virtio device behind the modern PCI transport.
#[derive(Debug)]
pub struct VirtioPciDevice {
    pci: PciDevice,
    bars: Bars,
    caps: Vec<VirtioCap>,
    common: Region,
    notify: Region,
    notify_off_multiplier: u32,
    isr: Region,
    device_cfg: Option<Region>,
    pci_cfg_cap: Option<u8>,
    msix: Option<MsixCapability>,
    mailboxes: Vec<u64>,
    queues: HashMap<u16, Virtqueue>,
}

impl VirtioPciDevice {
    /// Assigns the function's BARs from `alloc`, enables memory and I/O decoding and bus
    /// mastering, and locates the virtio structures through the vendor capabilities (the first
    /// capability of each type wins, as the spec asks drivers to do).
    pub fn probe(qt: &mut Qtest, pci: PciDevice, alloc: &mut PciAllocator) -> Result<Self> {
        let bars = pci.assign_bars(qt, alloc)?;
        pci.enable(
            qt,
            COMMAND_MEMORY_SPACE | COMMAND_IO_SPACE | COMMAND_BUS_MASTER,
        )?;
        let mut caps = Vec::new();
        for cap in pci.capabilities(qt)? {
            if cap.id != CAP_ID_VENDOR {
                continue;
            }
            let o = cap.offset;
            let head = pci.read_config_u32(qt, o)?;
            let ids = pci.read_config_u32(qt, o + 4)?;
            caps.push(VirtioCap {
                cap_offset: o,
                cap_len: (head >> 16) as u8,
                cfg_type: (head >> 24) as u8,
                bar: ids as u8,
                id: (ids >> 8) as u8,
                offset: pci.read_config_u32(qt, o + 8)?,
                length: pci.read_config_u32(qt, o + 12)?,
            });
        }
        log::debug!("{}: virtio capabilities {caps:x?}", pci.address());
        let first = |cfg_type| {
            caps.iter()
                .find(|c| c.cfg_type == cfg_type && bars.get(c.bar).is_some())
        };
        let cap_of = |cfg_type| first(cfg_type).ok_or(VirtioError::MissingCapability(cfg_type));
        let region = |cap: &VirtioCap| -> Result<Region> {
            Ok(Region {
                address: bars.address(cap.bar)? + u64::from(cap.offset),
                length: cap.length,
            })
        };
        let notify_cap = cap_of(CAP_NOTIFY_CFG)?;
        let common = region(cap_of(CAP_COMMON_CFG)?)?;
        let notify = region(notify_cap)?;
        let isr = region(cap_of(CAP_ISR_CFG)?)?;
        let device_cfg = first(CAP_DEVICE_CFG).map(region).transpose()?;
        let notify_off_multiplier = pci.read_config_u32(qt, notify_cap.cap_offset + 16)?;
        let pci_cfg_cap = caps
            .iter()
            .find(|c| c.cfg_type == CAP_PCI_CFG)
            .map(|c| c.cap_offset);
        let msix = pci.msix_capability(qt)?;
        Ok(Self {
            pci,
            bars,
            caps,
            common,
            notify,
            notify_off_multiplier,
            isr,
            device_cfg,
            pci_cfg_cap,
            msix,
            mailboxes: Vec::new(),
            queues: HashMap::new(),
        })
    }

    /// The underlying PCI function.
    pub fn pci(&self) -> PciDevice {
        self.pci
    }

    /// The function's BARs as assigned by [`Self::probe`].
    pub fn bars(&self) -> &Bars {
        &self.bars
    }

    /// All virtio vendor capabilities, in list order.
    pub fn capabilities(&self) -> &[VirtioCap] {
        &self.caps
    }

    /// The common configuration structure.
    pub fn common_cfg(&self) -> Region {
        self.common
    }

    /// The notification structure.
    pub fn notify_cfg(&self) -> Region {
        self.notify
    }

    /// `notify_off_multiplier` of the notification capability.
    pub fn notify_off_multiplier(&self) -> u32 {
        self.notify_off_multiplier
    }

    /// The ISR status structure.
    pub fn isr_cfg(&self) -> Region {
        self.isr
    }

    /// The device-specific configuration structure, if the device has one.
    pub fn device_cfg(&self) -> Option<Region> {
        self.device_cfg
    }

    /// The MSI-X capability, if the function has one.
    pub fn msix(&self) -> Option<&MsixCapability> {
        self.msix.as_ref()
    }

    /// Reads a byte of the common configuration structure.
    pub fn read_common_u8(&self, qt: &mut Qtest, offset: u16) -> Result<u8> {
        Ok(qt.readb(self.common.address + u64::from(offset))?)
    }

    /// Reads a 16-bit field of the common configuration structure.
    pub fn read_common_u16(&self, qt: &mut Qtest, offset: u16) -> Result<u16> {
        Ok(qt.readw(self.common.address + u64::from(offset))?)
    }

    /// Reads a 32-bit field of the common configuration structure.
    pub fn read_common_u32(&self, qt: &mut Qtest, offset: u16) -> Result<u32> {
        Ok(qt.readl(self.common.address + u64::from(offset))?)
    }

    /// Writes a byte of the common configuration structure.
    pub fn write_common_u8(&self, qt: &mut Qtest, offset: u16, value: u8) -> Result<()> {
        Ok(qt.writeb(self.common.address + u64::from(offset), value)?)
    }

    /// Writes a 16-bit field of the common configuration structure.
    pub fn write_common_u16(&self, qt: &mut Qtest, offset: u16, value: u16) -> Result<()> {
        Ok(qt.writew(self.common.address + u64::from(offset), value)?)
    }

    /// Writes a 32-bit field of the common configuration structure.
    pub fn write_common_u32(&self, qt: &mut Qtest, offset: u16, value: u32) -> Result<()> {
        Ok(qt.writel(self.common.address + u64::from(offset), value)?)
    }

    /// Writes a 64-bit field (`queue_desc`, ...) as low then high 32-bit half.
    pub fn write_common_u64(&self, qt: &mut Qtest, offset: u16, value: u64) -> Result<()> {
        self.write_common_u32(qt, offset, value as u32)?;
        self.write_common_u32(qt, offset + 4, (value >> 32) as u32)
    }

    /// Device status byte.
    pub fn status(&self, qt: &mut Qtest) -> Result<u8> {
        self.read_common_u8(qt, common_cfg::DEVICE_STATUS)
    }

    /// Writes the device status byte as is.
    pub fn set_status(&self, qt: &mut Qtest, status: u8) -> Result<()> {
        self.write_common_u8(qt, common_cfg::DEVICE_STATUS, status)
    }

    /// Sets `bits` in the device status, keeping the bits already set.
    pub fn add_status(&self, qt: &mut Qtest, bits: u8) -> Result<()> {
        let status = self.status(qt)?;
        self.set_status(qt, status | bits)
    }

    /// Resets the device (writes status 0 and waits until it reads 0) and forgets all queues.
    pub fn reset(&mut self, qt: &mut Qtest) -> Result<()> {
        self.set_status(qt, 0)?;
        self.queues.clear();
        let deadline = Instant::now() + RESET_TIMEOUT;
        loop {
            let status = self.status(qt)?;
            if status == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(VirtioError::ResetTimeout(status));
            }
            thread::sleep(POLL_INTERVAL);
        }
    }

    /// The 64 device feature bits.
    pub fn device_features(&self, qt: &mut Qtest) -> Result<u64> {
        self.read_feature_pair(
            qt,
            common_cfg::DEVICE_FEATURE_SELECT,
            common_cfg::DEVICE_FEATURE,
        )
    }

    /// The 64 driver feature bits as the device reports them back.
    pub fn driver_features(&self, qt: &mut Qtest) -> Result<u64> {
        self.read_feature_pair(
            qt,
            common_cfg::DRIVER_FEATURE_SELECT,
            common_cfg::DRIVER_FEATURE,
        )
    }

    fn read_feature_pair(&self, qt: &mut Qtest, select: u16, window: u16) -> Result<u64> {
        self.write_common_u32(qt, select, 0)?;
        let low = self.read_common_u32(qt, window)?;
        self.write_common_u32(qt, select, 1)?;
        let high = self.read_common_u32(qt, window)?;
        Ok(u64::from(high) << 32 | u64::from(low))
    }

    /// Writes the 64 driver feature bits, without any status change.
    pub fn write_driver_features(&self, qt: &mut Qtest, features: u64) -> Result<()> {
        for (select, half) in [(0, features as u32), (1, (features >> 32) as u32)] {
            self.write_common_u32(qt, common_cfg::DRIVER_FEATURE_SELECT, select)?;
            self.write_common_u32(qt, common_cfg::DRIVER_FEATURE, half)?;
        }
        Ok(())
    }

    /// Resets the device and negotiates features: ACKNOWLEDGE, DRIVER, accept the offered
    /// subset of `wanted`, FEATURES_OK, and check that FEATURES_OK stuck. Returns the accepted
    /// features. The device is left ready for queue setup; finish with [`Self::driver_ok`].
    pub fn negotiate(&mut self, qt: &mut Qtest, wanted: u64) -> Result<u64> {
        self.reset(qt)?;
        self.add_status(qt, VIRTIO_CONFIG_S_ACKNOWLEDGE as u8)?;
        self.add_status(qt, VIRTIO_CONFIG_S_DRIVER as u8)?;
        let accepted = self.device_features(qt)? & wanted;
        self.write_driver_features(qt, accepted)?;
        self.add_status(qt, VIRTIO_CONFIG_S_FEATURES_OK as u8)?;
        if self.status(qt)? & VIRTIO_CONFIG_S_FEATURES_OK as u8 == 0 {
            return Err(VirtioError::FeaturesRejected(accepted));
        }
        log::debug!("{}: negotiated features {accepted:#x}", self.pci.address());
        Ok(accepted)
    }

    /// Sets DRIVER_OK.
    pub fn driver_ok(&self, qt: &mut Qtest) -> Result<()> {
        self.add_status(qt, VIRTIO_CONFIG_S_DRIVER_OK as u8)
    }

    /// `num_queues`.
    pub fn num_queues(&self, qt: &mut Qtest) -> Result<u16> {
        self.read_common_u16(qt, common_cfg::NUM_QUEUES)
    }

    /// `config_generation`.
    pub fn config_generation(&self, qt: &mut Qtest) -> Result<u8> {
        self.read_common_u8(qt, common_cfg::CONFIG_GENERATION)
    }

    /// Reads the ISR status byte (reading clears it).
    pub fn read_isr(&self, qt: &mut Qtest) -> Result<u8> {
        Ok(qt.readb(self.isr.address)?)
    }

    fn device_cfg_address(&self, offset: u32, width: u32) -> Result<u64> {
        let region = self
            .device_cfg
            .ok_or(VirtioError::MissingCapability(CAP_DEVICE_CFG))?;
        if offset
            .checked_add(width)
            .is_none_or(|end| end > region.length)
        {
            return Err(VirtioError::DeviceConfigRange {
                offset,
                width,
                length: region.length,
            });
        }
        Ok(region.address + u64::from(offset))
    }

    /// Reads a byte of the device-specific configuration.
    pub fn read_device_config_u8(&self, qt: &mut Qtest, offset: u32) -> Result<u8> {
        Ok(qt.readb(self.device_cfg_address(offset, 1)?)?)
    }

    /// Reads a 16-bit field of the device-specific configuration.
    pub fn read_device_config_u16(&self, qt: &mut Qtest, offset: u32) -> Result<u16> {
        Ok(qt.readw(self.device_cfg_address(offset, 2)?)?)
    }

    /// Reads a 32-bit field of the device-specific configuration.
    pub fn read_device_config_u32(&self, qt: &mut Qtest, offset: u32) -> Result<u32> {
        Ok(qt.readl(self.device_cfg_address(offset, 4)?)?)
    }

    /// Writes a 32-bit field of the device-specific configuration.
    pub fn write_device_config_u32(&self, qt: &mut Qtest, offset: u32, value: u32) -> Result<()> {
        Ok(qt.writel(self.device_cfg_address(offset, 4)?, value)?)
    }

    /// Points the PCI configuration access capability (`cfg_type` 5) at `bar` + `offset` with
    /// `width` (1, 2 or 4) and returns the configuration-space offset of its data window.
    fn pci_cfg_window(&self, qt: &mut Qtest, bar: u8, offset: u32, width: u8) -> Result<u8> {
        if !matches!(width, 1 | 2 | 4) {
            return Err(VirtioError::BadAccessWidth(width));
        }
        let cap = self
            .pci_cfg_cap
            .ok_or(VirtioError::MissingCapability(CAP_PCI_CFG))?;
        self.pci.write_config_u8(qt, cap + 4, bar)?;
        self.pci.write_config_u32(qt, cap + 8, offset)?;
        self.pci.write_config_u32(qt, cap + 12, u32::from(width))?;
        Ok(cap + 16)
    }

    /// Reads `width` (1, 2 or 4) bytes at `bar` + `offset` through the PCI configuration access
    /// capability instead of the BAR mapping.
    pub fn pci_cfg_read(&self, qt: &mut Qtest, bar: u8, offset: u32, width: u8) -> Result<u32> {
        let data = self.pci_cfg_window(qt, bar, offset, width)?;
        Ok(match width {
            1 => u32::from(self.pci.read_config_u8(qt, data)?),
            2 => u32::from(self.pci.read_config_u16(qt, data)?),
            _ => self.pci.read_config_u32(qt, data)?,
        })
    }

    /// Writes `width` (1, 2 or 4) bytes at `bar` + `offset` through the PCI configuration
    /// access capability.
    pub fn pci_cfg_write(
        &self,
        qt: &mut Qtest,
        bar: u8,
        offset: u32,
        width: u8,
        value: u32,
    ) -> Result<()> {
        let data = self.pci_cfg_window(qt, bar, offset, width)?;
        match width {
            1 => self.pci.write_config_u8(qt, data, value as u8)?,
            2 => self.pci.write_config_u16(qt, data, value as u16)?,
            _ => self.pci.write_config_u32(qt, data, value)?,
        }
        Ok(())
    }

    /// Enables MSI-X with `vectors` vectors. Vector `n` gets a mailbox dword in guest RAM as its
    /// message address and [`MSI_DATA_BASE`]` | n` as its data.
    pub fn enable_msix(&mut self, qt: &mut Qtest, ram: &mut GuestRam, vectors: u16) -> Result<()> {
        let msix = self.msix.ok_or(VirtioError::NoMsix)?;
        let base = ram.alloc(4 * u64::from(vectors), 4)?;
        qt.memset(base, 4 * usize::from(vectors), 0)?;
        self.mailboxes = (0..u64::from(vectors)).map(|n| base + 4 * n).collect();
        let messages: Vec<_> = (0..vectors)
            .map(|vector| MsiMessage {
                address: self.mailboxes[usize::from(vector)],
                data: msi_data(vector),
            })
            .collect();
        self.pci.enable_msix(qt, &msix, &self.bars, &messages)?;
        Ok(())
    }

    /// Guest-physical address of a vector's mailbox.
    pub fn mailbox_address(&self, vector: u16) -> Result<u64> {
        self.mailboxes
            .get(usize::from(vector))
            .copied()
            .ok_or(VirtioError::VectorNotEnabled(vector))
    }

    /// Zeroes a vector's mailbox, so a later message can be told apart from an earlier one.
    pub fn clear_mailbox(&self, qt: &mut Qtest, vector: u16) -> Result<()> {
        Ok(qt.writel(self.mailbox_address(vector)?, 0)?)
    }

    /// Whether the vector's message has landed in its mailbox since it was last cleared.
    pub fn mailbox_signalled(&self, qt: &mut Qtest, vector: u16) -> Result<bool> {
        Ok(qt.readl(self.mailbox_address(vector)?)? == msi_data(vector))
    }

    /// Polls a vector's mailbox until its message lands, then clears it (consuming the
    /// interrupt).
    pub fn wait_msix(&self, qt: &mut Qtest, vector: u16, timeout: Duration) -> Result<()> {
        poll(timeout, || {
            Ok(self.mailbox_signalled(qt, vector)?.then_some(()))
        })?
        .ok_or(VirtioError::MsixTimeout { vector, timeout })?;
        self.clear_mailbox(qt, vector)
    }

    /// Masks or unmasks one MSI-X vector.
    pub fn set_msix_vector_masked(&self, qt: &mut Qtest, vector: u16, masked: bool) -> Result<()> {
        let msix = self.msix.ok_or(VirtioError::NoMsix)?;
        Ok(self
            .pci
            .set_msix_vector_masked(qt, &msix, &self.bars, vector, masked)?)
    }

    /// Whether a vector's pending bit is set.
    pub fn msix_pending(&self, qt: &mut Qtest, vector: u16) -> Result<bool> {
        let msix = self.msix.ok_or(VirtioError::NoMsix)?;
        Ok(self.pci.msix_pending(qt, &msix, &self.bars, vector)?)
    }

    /// Sets `config_msix_vector` (`None` for no vector) and checks that the device took it.
    pub fn set_config_vector(&self, qt: &mut Qtest, vector: Option<u16>) -> Result<()> {
        self.write_vector(qt, common_cfg::CONFIG_MSIX_VECTOR, vector, "config")
    }

    fn write_vector(
        &self,
        qt: &mut Qtest,
        field: u16,
        vector: Option<u16>,
        target: &str,
    ) -> Result<()> {
        let vector = vector.unwrap_or(MSI_NO_VECTOR);
        self.write_common_u16(qt, field, vector)?;
        if self.read_common_u16(qt, field)? != vector {
            return Err(VirtioError::VectorRejected {
                target: target.to_owned(),
                vector,
            });
        }
        Ok(())
    }

    /// Sets up split virtqueue `index` with `size` descriptors: allocates and zeroes the
    /// descriptor table, avail and used rings and a [`QUEUE_BUFFER_AREA`] buffer area in guest
    /// RAM, programs size, addresses and MSI-X vector (`None` for none), and enables the queue.
    pub fn setup_queue(
        &mut self,
        qt: &mut Qtest,
        ram: &mut GuestRam,
        index: u16,
        size: u16,
        msix_vector: Option<u16>,
    ) -> Result<&Virtqueue> {
        if index >= self.num_queues(qt)? {
            return Err(VirtioError::NoSuchQueue(index));
        }
        self.write_common_u16(qt, common_cfg::QUEUE_SELECT, index)?;
        let max = self.read_common_u16(qt, common_cfg::QUEUE_SIZE)?;
        if max == 0 {
            return Err(VirtioError::NoSuchQueue(index));
        }
        if !size.is_power_of_two() || size > max {
            return Err(VirtioError::BadQueueSize { index, size, max });
        }
        let n = u64::from(size);
        let desc_len = Descriptor::SIZE * n;
        let avail_len = 6 + 2 * n;
        let used_len = 6 + 8 * n;
        let desc = ram.alloc(desc_len, 16)?;
        let avail = ram.alloc(avail_len, 2)?;
        let used = ram.alloc(used_len, 4)?;
        for (addr, len) in [(desc, desc_len), (avail, avail_len), (used, used_len)] {
            qt.memset(addr, len as usize, 0)?;
        }
        let area = ram.alloc(QUEUE_BUFFER_AREA, 4096)?;

        self.write_common_u16(qt, common_cfg::QUEUE_SIZE, size)?;
        self.write_common_u64(qt, common_cfg::QUEUE_DESC, desc)?;
        self.write_common_u64(qt, common_cfg::QUEUE_DRIVER, avail)?;
        self.write_common_u64(qt, common_cfg::QUEUE_DEVICE, used)?;
        self.write_vector(
            qt,
            common_cfg::QUEUE_MSIX_VECTOR,
            msix_vector,
            &format!("queue {index}"),
        )?;
        let notify_off = self.read_common_u16(qt, common_cfg::QUEUE_NOTIFY_OFF)?;
        self.write_common_u16(qt, common_cfg::QUEUE_ENABLE, 1)?;

        let notify_address =
            self.notify.address + u64::from(notify_off) * u64::from(self.notify_off_multiplier);
        log::debug!(
            "{}: queue {index} size {size} desc {desc:#x} avail {avail:#x} used {used:#x} \
             notify {notify_address:#x} vector {:?}",
            self.pci.address(),
            msix_vector,
        );
        let queue = Virtqueue {
            index,
            size,
            desc,
            avail,
            used,
            notify_address,
            msix_vector: msix_vector.unwrap_or(MSI_NO_VECTOR),
            avail_idx: 0,
            last_used_idx: 0,
            free: (0..size).rev().collect(),
            in_flight: HashMap::new(),
            area: BufferArea {
                base: area,
                size: QUEUE_BUFFER_AREA,
                used: Vec::new(),
            },
        };
        Ok(self.queues.entry(index).insert_entry(queue).into_mut())
    }

    /// The driver state of a queue set up with [`Self::setup_queue`].
    pub fn queue(&self, index: u16) -> Result<&Virtqueue> {
        self.queues
            .get(&index)
            .ok_or(VirtioError::QueueNotSetUp(index))
    }

    fn queue_mut(&mut self, index: u16) -> Result<&mut Virtqueue> {
        self.queues
            .get_mut(&index)
            .ok_or(VirtioError::QueueNotSetUp(index))
    }

    /// Notifies the device of new buffers in a queue (writes the queue index, 16 bit, to the
    /// queue's notification address).
    pub fn notify(&self, qt: &mut Qtest, queue: u16) -> Result<()> {
        let address = self.queue(queue)?.notify_address;
        Ok(qt.writew(address, queue)?)
    }

    /// Builds a descriptor chain of device-readable buffers holding `out`, followed by
    /// zeroed device-writable buffers of `in_lens` bytes, publishes it in the avail ring and
    /// notifies the device. Returns the head descriptor index, which the device returns as the
    /// used element's id.
    pub fn request(
        &mut self,
        qt: &mut Qtest,
        queue: u16,
        out: &[&[u8]],
        in_lens: &[u32],
    ) -> Result<u16> {
        let vq = self.queue_mut(queue)?;
        let count = out.len() + in_lens.len();
        if count == 0 {
            return Err(VirtioError::EmptyRequest);
        }
        if count > vq.free.len() {
            return Err(VirtioError::OutOfDescriptors {
                queue,
                needed: count,
                free: vq.free.len(),
            });
        }
        let lengths: Vec<u64> = out
            .iter()
            .map(|b| b.len() as u64)
            .chain(in_lens.iter().map(|&l| u64::from(l)))
            .collect();
        let total: u64 = lengths
            .iter()
            .map(|l| l.next_multiple_of(BUFFER_ALIGN))
            .sum();
        let area_offset = vq
            .area
            .alloc(total)
            .ok_or(VirtioError::OutOfBufferSpace { queue, size: total })?;
        let descriptors: Vec<u16> = (0..count).map_while(|_| vq.free.pop()).collect();

        let mut addr = vq.area.base + area_offset;
        let mut writable = Vec::new();
        for (i, (&desc, &len)) in descriptors.iter().zip(&lengths).enumerate() {
            let mut flags = 0;
            if let Some(data) = out.get(i) {
                qt.memwrite(addr, data)?;
            } else {
                qt.memset(addr, len as usize, 0)?;
                flags |= VRING_DESC_F_WRITE as u16;
                writable.push((addr, len as u32));
            }
            let next = descriptors.get(i + 1).copied();
            if next.is_some() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let descriptor = Descriptor {
                addr,
                len: len as u32,
                flags,
                next: next.unwrap_or(0),
            };
            qt.memwrite(
                vq.desc + Descriptor::SIZE * u64::from(desc),
                &descriptor.to_bytes(),
            )?;
            addr += len.next_multiple_of(BUFFER_ALIGN);
        }
        let head = descriptors[0];
        vq.in_flight.insert(
            head,
            InFlight {
                descriptors,
                writable,
                area_offset,
            },
        );
        self.publish_avail(qt, queue, head)?;
        self.notify(qt, queue)?;
        Ok(head)
    }

    /// Waits up to `timeout` for the next used element of a queue and consumes it. If its id is
    /// the head of a [`Self::request`] chain, the chain's device-writable buffers are read back
    /// and its descriptors and buffer space are freed.
    pub fn wait_used(
        &mut self,
        qt: &mut Qtest,
        queue: u16,
        timeout: Duration,
    ) -> Result<Completion> {
        let used = poll(timeout, || self.pop_used(qt, queue))?
            .ok_or(VirtioError::UsedTimeout { queue, timeout })?;
        let vq = self.queue_mut(queue)?;
        let Some(chain) = u16::try_from(used.id)
            .ok()
            .and_then(|id| vq.in_flight.remove(&id))
        else {
            return Ok(Completion {
                used,
                writable: None,
            });
        };
        vq.free.extend(chain.descriptors.iter().rev());
        vq.area.free(chain.area_offset);
        let writable = chain
            .writable
            .iter()
            .map(|&(addr, len)| qt.memread(addr, len as usize))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Completion {
            used,
            writable: Some(writable),
        })
    }

    /// [`Self::request`] followed by [`Self::wait_used`], checking that the device returned
    /// this request's chain.
    pub fn transact(
        &mut self,
        qt: &mut Qtest,
        queue: u16,
        out: &[&[u8]],
        in_lens: &[u32],
        timeout: Duration,
    ) -> Result<Completion> {
        let head = self.request(qt, queue, out, in_lens)?;
        let completion = self.wait_used(qt, queue, timeout)?;
        if completion.used.id != u32::from(head) {
            return Err(VirtioError::UnexpectedUsedId {
                queue,
                expected: head,
                got: completion.used.id,
            });
        }
        Ok(completion)
    }

    /// Raw: writes descriptor `index` (below the queue size) of a queue's descriptor table,
    /// whatever it holds; the contents are not checked.
    pub fn write_descriptor(
        &self,
        qt: &mut Qtest,
        queue: u16,
        index: u16,
        descriptor: &Descriptor,
    ) -> Result<()> {
        let vq = self.queue(queue)?;
        if index >= vq.size {
            return Err(VirtioError::DescriptorOutOfRange {
                queue,
                index,
                size: vq.size,
            });
        }
        let addr = vq.desc + Descriptor::SIZE * u64::from(index);
        Ok(qt.memwrite(addr, &descriptor.to_bytes())?)
    }

    /// Raw: writes `buffers` (address, length, device-writable) as one chain into the highest
    /// descriptor slots, which [`Self::request`] hands out last, linked in order. Does not
    /// publish it. Returns the head index.
    pub fn write_raw_chain(
        &self,
        qt: &mut Qtest,
        queue: u16,
        buffers: &[(u64, u32, bool)],
    ) -> Result<u16> {
        let size = self.queue(queue)?.size;
        if buffers.is_empty() {
            return Err(VirtioError::EmptyRequest);
        }
        let count = u16::try_from(buffers.len()).ok().filter(|&n| n <= size);
        let count = count.ok_or(VirtioError::OutOfDescriptors {
            queue,
            needed: buffers.len(),
            free: usize::from(size),
        })?;
        let head = size - 1;
        for (i, &(addr, len, writable)) in (0..count).zip(buffers) {
            let index = head - i;
            let last = i + 1 == count;
            let mut flags = if writable {
                VRING_DESC_F_WRITE as u16
            } else {
                0
            };
            if !last {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let next = if last { 0 } else { index - 1 };
            self.write_descriptor(
                qt,
                queue,
                index,
                &Descriptor {
                    addr,
                    len,
                    flags,
                    next,
                },
            )?;
        }
        Ok(head)
    }

    /// Raw: puts `head` (any value) in the next avail ring slot and increments `avail.idx`.
    /// Does not notify.
    pub fn publish_avail(&mut self, qt: &mut Qtest, queue: u16, head: u16) -> Result<()> {
        let vq = self.queue_mut(queue)?;
        let slot = vq.avail + 4 + 2 * vq.slot(vq.avail_idx);
        qt.writew(slot, head)?;
        let idx = vq.avail_idx.wrapping_add(1);
        self.write_avail_idx(qt, queue, idx)
    }

    /// Raw: sets `avail.idx` (the driver's copy follows), e.g. to jump ahead of the ring.
    pub fn write_avail_idx(&mut self, qt: &mut Qtest, queue: u16, idx: u16) -> Result<()> {
        let vq = self.queue_mut(queue)?;
        qt.writew(vq.avail + 2, idx)?;
        vq.avail_idx = idx;
        Ok(())
    }

    /// Raw: reads `used.idx`.
    pub fn read_used_idx(&self, qt: &mut Qtest, queue: u16) -> Result<u16> {
        Ok(qt.readw(self.queue(queue)?.used + 2)?)
    }

    /// Raw: reads used ring slot `slot % size` without consuming anything.
    pub fn read_used_elem(&self, qt: &mut Qtest, queue: u16, slot: u16) -> Result<UsedElem> {
        let vq = self.queue(queue)?;
        let bytes = qt.memread(vq.used + 4 + 8 * vq.slot(slot), 8)?;
        let word =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        Ok(UsedElem {
            id: word(0),
            len: word(4),
        })
    }

    /// Raw: consumes the next used element if the device has published one, without any
    /// bookkeeping of [`Self::request`] chains.
    pub fn pop_used(&mut self, qt: &mut Qtest, queue: u16) -> Result<Option<UsedElem>> {
        let last = self.queue(queue)?.last_used_idx;
        if self.read_used_idx(qt, queue)? == last {
            return Ok(None);
        }
        let elem = self.read_used_elem(qt, queue, last)?;
        self.queue_mut(queue)?.last_used_idx = last.wrapping_add(1);
        Ok(Some(elem))
    }
}

/// MSI data value used for `vector`.
pub fn msi_data(vector: u16) -> u32 {
    MSI_DATA_BASE | u32::from(vector)
}

/// Calls `check` until it returns `Some` or `timeout` passes (checking at least once).
fn poll<T>(timeout: Duration, mut check: impl FnMut() -> Result<Option<T>>) -> Result<Option<T>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check()? {
            return Ok(Some(value));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        thread::sleep(POLL_INTERVAL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_area_first_fit() {
        let mut area = BufferArea {
            base: 0,
            size: 64,
            used: Vec::new(),
        };
        assert_eq!(area.alloc(10), Some(0));
        assert_eq!(area.alloc(16), Some(16));
        assert_eq!(area.alloc(32), Some(32));
        assert_eq!(area.alloc(1), None);
        area.free(16);
        assert_eq!(area.alloc(20), None);
        assert_eq!(area.alloc(16), Some(16));
        area.free(0);
        area.free(32);
        assert_eq!(area.alloc(32), Some(32));
    }

    #[test]
    fn descriptor_layout() {
        let d = Descriptor {
            addr: 0x1122_3344_5566_7788,
            len: 0x99aa_bbcc,
            flags: 0xddee,
            next: 0x0102,
        };
        assert_eq!(
            d.to_bytes(),
            [
                0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0xcc, 0xbb, 0xaa, 0x99, 0xee, 0xdd,
                0x02, 0x01
            ]
        );
    }
}
