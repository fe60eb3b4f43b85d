//! The virtio-pci modern transport: the common configuration structure, device status and
//! feature negotiation, per-queue configuration and the ISR byte.
//!
//! This module is pure state-machine logic (no I/O, no unsafe): register accesses come in as
//! `(offset, bytes)`, validated against the field layout of the virtio 1.x specification
//! (§4.1.4.3), and the caller learns what to do next from [`Effect`]. Any access that violates the
//! specification returns a [`VirtioPciError`]; the caller turns it into DEVICE_NEEDS_RESET.

use log::{debug, info};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemory};

use crate::ratelimit::guest_fault;

/// Number of virtqueues of virtio-gpu: control and cursor.
pub const NUM_QUEUES: u16 = 2;
/// Index of the control queue.
pub const CONTROL_QUEUE: u16 = 0;
/// Index of the cursor queue.
pub const CURSOR_QUEUE: u16 = 1;
/// Largest queue size offered. Linux allocates what the device offers; 256 entries bound the
/// work of one available-ring walk and a descriptor chain's TTL while leaving the guest enough
/// room for pipelined command submission.
pub const MAX_QUEUE_SIZE: u16 = 256;
/// "No MSI-X vector" value of the msix_vector fields.
pub const NO_VECTOR: u16 = 0xffff;

/// VIRTIO_F_VERSION_1: the only transport feature offered, and required of the driver.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// Device status bits (virtio 1.x §2.1).
pub mod status {
    /// The guest noticed the device.
    pub const ACKNOWLEDGE: u8 = 1;
    /// The guest knows how to drive the device.
    pub const DRIVER: u8 = 2;
    /// The driver is ready.
    pub const DRIVER_OK: u8 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u8 = 8;
    /// The device hit an error it cannot recover from without a reset.
    pub const DEVICE_NEEDS_RESET: u8 = 0x40;
    /// The guest gave up on the device.
    pub const FAILED: u8 = 0x80;
}

/// ISR bit: a virtqueue has new used buffers.
pub const ISR_QUEUE: u8 = 1;
/// ISR bit: the device configuration changed.
pub const ISR_CONFIG: u8 = 2;

/// Errors of the transport state machine: each one is a driver (guest) protocol violation.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VirtioPciError {
    /// The access does not match a field's offset and width.
    #[error("common config access of {len} bytes at {offset:#x} matches no field")]
    BadAccess {
        /// Offset in the common configuration structure.
        offset: u64,
        /// Access width in bytes.
        len: usize,
    },
    /// A queue field was written while queue_select names no queue.
    #[error("queue field written with queue_select {0}, the device has {NUM_QUEUES} queues")]
    NoSuchQueue(u16),
    /// A queue field was written while the queue is enabled.
    #[error("queue {0} reconfigured while enabled")]
    QueueBusy(u16),
    /// The queue size is not a power of two up to [`MAX_QUEUE_SIZE`].
    #[error("queue size {0} is not a power of two up to {MAX_QUEUE_SIZE}")]
    BadQueueSize(u16),
    /// A ring address has the wrong alignment.
    #[error("queue {queue}: misaligned ring address {addr:#x}")]
    BadQueueAddress {
        /// Queue index.
        queue: u16,
        /// The address written.
        addr: u64,
    },
    /// queue_enable was written with something else than 1.
    #[error("queue {queue}: queue_enable written with {value}")]
    BadQueueEnable {
        /// Queue index.
        queue: u16,
        /// The value written.
        value: u16,
    },
    /// The rings of an enabled queue lie outside guest memory.
    #[error("queue {0} enabled with rings outside guest memory")]
    QueueOutsideMemory(u16),
    /// A status write cleared bits without resetting.
    #[error("device status {new:#x} clears bits of {old:#x} without a reset")]
    StatusRegression {
        /// Status before.
        old: u8,
        /// Status written.
        new: u8,
    },
    /// DRIVER_OK was set before feature negotiation completed.
    #[error("DRIVER_OK set without FEATURES_OK")]
    DriverOkWithoutFeatures,
}

/// What the caller must do after a successful register write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Nothing beyond the register update.
    None,
    /// The driver wrote 0 to device_status: reset the whole device.
    Reset,
    /// The driver set DRIVER_OK: the device is live.
    DriverOk,
}

/// One register of the common configuration structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    DeviceFeatureSelect,
    DeviceFeature,
    DriverFeatureSelect,
    DriverFeature,
    ConfigMsixVector,
    NumQueues,
    DeviceStatus,
    ConfigGeneration,
    QueueSelect,
    QueueSize,
    QueueMsixVector,
    QueueEnable,
    QueueNotifyOff,
    /// A ring address: which ring, and whether the access covers the high half only.
    QueueRing(Ring, Half),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ring {
    Desc,
    Driver,
    Device,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    Low,
    High,
    Both,
}

impl Field {
    /// Maps an access to a field, requiring the field's own width (64-bit ring addresses may be
    /// accessed whole or as two 32-bit halves).
    fn decode(offset: u64, len: usize) -> Option<Field> {
        use Field::*;
        let field = match (offset, len) {
            (0x00, 4) => DeviceFeatureSelect,
            (0x04, 4) => DeviceFeature,
            (0x08, 4) => DriverFeatureSelect,
            (0x0c, 4) => DriverFeature,
            (0x10, 2) => ConfigMsixVector,
            (0x12, 2) => NumQueues,
            (0x14, 1) => DeviceStatus,
            (0x15, 1) => ConfigGeneration,
            (0x16, 2) => QueueSelect,
            (0x18, 2) => QueueSize,
            (0x1a, 2) => QueueMsixVector,
            (0x1c, 2) => QueueEnable,
            (0x1e, 2) => QueueNotifyOff,
            (0x20..=0x37, _) => {
                let ring = match (offset - 0x20) / 8 {
                    0 => Ring::Desc,
                    1 => Ring::Driver,
                    _ => Ring::Device,
                };
                let half = match (offset % 8, len) {
                    (0, 4) => Half::Low,
                    (4, 4) => Half::High,
                    (0, 8) => Half::Both,
                    _ => return None,
                };
                QueueRing(ring, half)
            }
            _ => return None,
        };
        Some(field)
    }
}

/// State of the virtio-pci modern transport of one device.
#[derive(Debug)]
pub struct VirtioPciTransport {
    device_features: u64,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    config_msix_vector: u16,
    status: u8,
    config_generation: u8,
    queue_select: u16,
    queues: Vec<Queue>,
    queue_vectors: Vec<u16>,
    isr: u8,
    msix_vectors: u16,
}

impl VirtioPciTransport {
    /// Creates the transport offering `device_features` (VIRTIO_F_VERSION_1 is always added) with
    /// `msix_vectors` MSI-X vectors.
    pub fn new(device_features: u64, msix_vectors: u16) -> Self {
        let queues = (0..NUM_QUEUES)
            .map(|_| Queue::new(MAX_QUEUE_SIZE).expect("MAX_QUEUE_SIZE is a valid queue size"))
            .collect();
        VirtioPciTransport {
            device_features: device_features | VIRTIO_F_VERSION_1,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            config_msix_vector: NO_VECTOR,
            status: 0,
            config_generation: 0,
            queue_select: 0,
            queues,
            queue_vectors: vec![NO_VECTOR; NUM_QUEUES as usize],
            isr: 0,
            msix_vectors,
        }
    }

    /// Returns the transport to its power-on state (features offered are kept).
    pub fn reset(&mut self) {
        *self = VirtioPciTransport::new(self.device_features, self.msix_vectors);
    }

    /// Current device status.
    pub fn status(&self) -> u8 {
        self.status
    }

    /// Whether the driver has set DRIVER_OK and the device has not failed since.
    pub fn is_live(&self) -> bool {
        self.status & status::DRIVER_OK != 0 && self.status & status::DEVICE_NEEDS_RESET == 0
    }

    /// Marks the device as needing a reset; it stops processing queues until the driver resets
    /// it. Returns whether this changed the status (the caller then raises a config interrupt).
    pub fn set_needs_reset(&mut self) -> bool {
        let changed = self.status & status::DEVICE_NEEDS_RESET == 0;
        self.status |= status::DEVICE_NEEDS_RESET;
        if changed {
            self.config_generation = self.config_generation.wrapping_add(1);
        }
        changed
    }

    /// Features both sides agreed on (valid once FEATURES_OK is set).
    pub fn negotiated_features(&self) -> u64 {
        self.driver_features & self.device_features
    }

    /// MSI-X vector of configuration-change interrupts.
    pub fn config_vector(&self) -> u16 {
        self.config_msix_vector
    }

    /// MSI-X vector of queue `q`, or [`NO_VECTOR`].
    pub fn queue_vector(&self, q: u16) -> u16 {
        self.queue_vectors
            .get(usize::from(q))
            .copied()
            .unwrap_or(NO_VECTOR)
    }

    /// The queue with index `q`, if it exists.
    pub fn queue_mut(&mut self, q: u16) -> Option<&mut Queue> {
        self.queues.get_mut(usize::from(q))
    }

    /// Whether queue `q` exists and is enabled.
    pub fn queue_ready(&self, q: u16) -> bool {
        self.queues
            .get(usize::from(q))
            .is_some_and(|queue| queue.ready())
    }

    /// Sets bits in the ISR byte.
    pub fn raise_isr(&mut self, bits: u8) {
        self.isr |= bits;
    }

    /// Whether any ISR bit is pending (the INTx line level).
    pub fn isr_pending(&self) -> bool {
        self.isr != 0
    }

    /// Reads the ISR byte, which clears it (virtio 1.x §4.1.4.5).
    pub fn read_isr(&mut self) -> u8 {
        std::mem::take(&mut self.isr)
    }

    /// Counts a configuration change so the driver re-reads the device configuration.
    pub fn bump_config_generation(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
    }

    /// Reads a common configuration field.
    pub fn read_common(&self, offset: u64, data: &mut [u8]) -> Result<(), VirtioPciError> {
        let len = data.len();
        let field = Field::decode(offset, len).ok_or(VirtioPciError::BadAccess { offset, len })?;
        let queue = self.queues.get(usize::from(self.queue_select));
        let value: u64 = match field {
            Field::DeviceFeatureSelect => self.device_feature_select.into(),
            Field::DeviceFeature => select_half(self.device_features, self.device_feature_select),
            Field::DriverFeatureSelect => self.driver_feature_select.into(),
            Field::DriverFeature => select_half(self.driver_features, self.driver_feature_select),
            Field::ConfigMsixVector => self.config_msix_vector.into(),
            Field::NumQueues => NUM_QUEUES.into(),
            Field::DeviceStatus => self.status.into(),
            Field::ConfigGeneration => self.config_generation.into(),
            Field::QueueSelect => self.queue_select.into(),
            Field::QueueSize => queue.map_or(0, |q| q.size().into()),
            Field::QueueMsixVector => queue
                .map_or(NO_VECTOR, |_| self.queue_vector(self.queue_select))
                .into(),
            Field::QueueEnable => queue.map_or(0, |q| q.ready().into()),
            Field::QueueNotifyOff => self.queue_select.into(),
            Field::QueueRing(ring, half) => {
                let addr = queue.map_or(0, |q| match ring {
                    Ring::Desc => q.desc_table(),
                    Ring::Driver => q.avail_ring(),
                    Ring::Device => q.used_ring(),
                });
                match half {
                    Half::Low => addr & 0xffff_ffff,
                    Half::High => addr >> 32,
                    Half::Both => addr,
                }
            }
        };
        data.copy_from_slice(&value.to_le_bytes()[..len]);
        Ok(())
    }

    /// Writes a common configuration field. `mem` is the guest memory an enabled queue's rings
    /// must lie in.
    pub fn write_common<M: GuestMemory>(
        &mut self,
        offset: u64,
        data: &[u8],
        mem: &M,
    ) -> Result<Effect, VirtioPciError> {
        let len = data.len();
        let field = Field::decode(offset, len).ok_or(VirtioPciError::BadAccess { offset, len })?;
        let mut raw = [0u8; 8];
        raw[..len].copy_from_slice(data);
        let value = u64::from_le_bytes(raw);
        // Every field is at most as wide as the access, so these truncations keep the value.
        let v16 = value as u16;
        let v32 = value as u32;
        match field {
            Field::DeviceFeatureSelect => self.device_feature_select = v32,
            Field::DriverFeatureSelect => self.driver_feature_select = v32,
            Field::DriverFeature => {
                if self.status & status::FEATURES_OK != 0 {
                    guest_fault!("driver features written after FEATURES_OK; ignored");
                } else {
                    match self.driver_feature_select {
                        0 => {
                            self.driver_features =
                                (self.driver_features & !0xffff_ffff) | u64::from(v32)
                        }
                        1 => {
                            self.driver_features =
                                (self.driver_features & 0xffff_ffff) | (u64::from(v32) << 32)
                        }
                        sel => debug!(
                            "driver feature word {sel} written with {v32:#x}; no such features"
                        ),
                    }
                }
            }
            Field::ConfigMsixVector => self.config_msix_vector = self.checked_vector(v16),
            Field::DeviceStatus => return self.write_status(value as u8),
            Field::QueueSelect => self.queue_select = v16,
            Field::QueueMsixVector => {
                let q = self.selected_queue()?;
                self.queue_vectors[usize::from(q)] = self.checked_vector(v16);
            }
            Field::QueueSize => {
                let q = self.idle_queue()?;
                self.queues[usize::from(q)]
                    .try_set_size(v16)
                    .map_err(|_| VirtioPciError::BadQueueSize(v16))?;
            }
            Field::QueueEnable => {
                let q = self.idle_queue()?;
                if v16 != 1 {
                    return Err(VirtioPciError::BadQueueEnable {
                        queue: q,
                        value: v16,
                    });
                }
                let queue = &mut self.queues[usize::from(q)];
                queue.set_ready(true);
                if !queue.is_valid(mem) {
                    queue.set_ready(false);
                    return Err(VirtioPciError::QueueOutsideMemory(q));
                }
                info!(
                    "queue {q} enabled: size {} desc {:#x}",
                    queue.size(),
                    queue.desc_table()
                );
            }
            Field::QueueRing(ring, half) => {
                let q = self.idle_queue()?;
                let queue = &mut self.queues[usize::from(q)];
                let old = match ring {
                    Ring::Desc => queue.desc_table(),
                    Ring::Driver => queue.avail_ring(),
                    Ring::Device => queue.used_ring(),
                };
                let addr = match half {
                    Half::Low => (old & !0xffff_ffff) | u64::from(v32),
                    Half::High => (old & 0xffff_ffff) | (u64::from(v32) << 32),
                    Half::Both => value,
                };
                let result = match ring {
                    Ring::Desc => queue.try_set_desc_table_address(GuestAddress(addr)),
                    Ring::Driver => queue.try_set_avail_ring_address(GuestAddress(addr)),
                    Ring::Device => queue.try_set_used_ring_address(GuestAddress(addr)),
                };
                result.map_err(|_| VirtioPciError::BadQueueAddress { queue: q, addr })?;
            }
            Field::DeviceFeature
            | Field::NumQueues
            | Field::ConfigGeneration
            | Field::QueueNotifyOff => {
                debug!("write to read-only common config field {field:?} ignored");
            }
        }
        Ok(Effect::None)
    }

    fn checked_vector(&self, vector: u16) -> u16 {
        if vector < self.msix_vectors {
            vector
        } else {
            if vector != NO_VECTOR {
                debug!("MSI-X vector {vector} out of range; reporting NO_VECTOR");
            }
            NO_VECTOR
        }
    }

    fn selected_queue(&self) -> Result<u16, VirtioPciError> {
        if self.queue_select < NUM_QUEUES {
            Ok(self.queue_select)
        } else {
            Err(VirtioPciError::NoSuchQueue(self.queue_select))
        }
    }

    fn idle_queue(&self) -> Result<u16, VirtioPciError> {
        let q = self.selected_queue()?;
        if self.queues[usize::from(q)].ready() {
            return Err(VirtioPciError::QueueBusy(q));
        }
        Ok(q)
    }

    fn write_status(&mut self, new: u8) -> Result<Effect, VirtioPciError> {
        if new == 0 {
            return Ok(Effect::Reset);
        }
        let old = self.status;
        let sticky = old & status::DEVICE_NEEDS_RESET;
        let new = new & !status::DEVICE_NEEDS_RESET;
        if new & (old & !status::DEVICE_NEEDS_RESET) != old & !status::DEVICE_NEEDS_RESET {
            return Err(VirtioPciError::StatusRegression { old, new });
        }
        let mut accepted = new;
        let added = new & !old;
        if added & status::FEATURES_OK != 0 {
            let unknown = self.driver_features & !self.device_features;
            if unknown != 0 || self.driver_features & VIRTIO_F_VERSION_1 == 0 {
                guest_fault!(
                    "feature negotiation refused: driver features {:#x} (offered {:#x}; VIRTIO_F_VERSION_1 required)",
                    self.driver_features,
                    self.device_features
                );
                accepted &= !status::FEATURES_OK;
            } else {
                info!("features negotiated: {:#x}", self.driver_features);
            }
        }
        if added & status::DRIVER_OK != 0 && accepted & status::FEATURES_OK == 0 {
            return Err(VirtioPciError::DriverOkWithoutFeatures);
        }
        self.status = accepted | sticky;
        if added & status::DRIVER_OK != 0 {
            info!("driver ready (status {:#x})", self.status);
            return Ok(Effect::DriverOk);
        }
        Ok(Effect::None)
    }
}

fn select_half(features: u64, select: u32) -> u64 {
    match select {
        0 => features & 0xffff_ffff,
        1 => features >> 32,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn w(t: &mut VirtioPciTransport, off: u64, data: &[u8]) -> Result<Effect, VirtioPciError> {
        t.write_common(off, data, &mem())
    }

    fn r(t: &VirtioPciTransport, off: u64, len: usize) -> u64 {
        let mut b = vec![0u8; len];
        t.read_common(off, &mut b).unwrap();
        let mut raw = [0u8; 8];
        raw[..len].copy_from_slice(&b);
        u64::from_le_bytes(raw)
    }

    fn negotiate(t: &mut VirtioPciTransport, features: u64) -> u8 {
        w(t, 0x14, &[status::ACKNOWLEDGE | status::DRIVER]).unwrap();
        w(t, 0x08, &0u32.to_le_bytes()).unwrap();
        w(t, 0x0c, &(features as u32).to_le_bytes()).unwrap();
        w(t, 0x08, &1u32.to_le_bytes()).unwrap();
        w(t, 0x0c, &((features >> 32) as u32).to_le_bytes()).unwrap();
        w(
            t,
            0x14,
            &[status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK],
        )
        .unwrap();
        r(t, 0x14, 1) as u8
    }

    #[test]
    fn offers_version_1_in_the_high_word() {
        let mut t = VirtioPciTransport::new(0, 3);
        assert_eq!(r(&t, 0x04, 4), 0);
        w(&mut t, 0x00, &1u32.to_le_bytes()).unwrap();
        assert_eq!(r(&t, 0x04, 4), 1);
        w(&mut t, 0x00, &7u32.to_le_bytes()).unwrap();
        assert_eq!(r(&t, 0x04, 4), 0);
        assert_eq!(r(&t, 0x12, 2), 2);
    }

    #[test]
    fn features_ok_requires_version_1() {
        let mut t = VirtioPciTransport::new(0, 3);
        assert_eq!(negotiate(&mut t, 0) & status::FEATURES_OK, 0);
        assert_eq!(
            w(
                &mut t,
                0x14,
                &[status::ACKNOWLEDGE | status::DRIVER | status::DRIVER_OK]
            ),
            Err(VirtioPciError::DriverOkWithoutFeatures)
        );
        t.reset();
        assert_ne!(
            negotiate(&mut t, VIRTIO_F_VERSION_1) & status::FEATURES_OK,
            0
        );
    }

    #[test]
    fn unknown_feature_bits_are_refused() {
        let mut t = VirtioPciTransport::new(0, 3);
        assert_eq!(
            negotiate(&mut t, VIRTIO_F_VERSION_1 | 1 << 5) & status::FEATURES_OK,
            0
        );
    }

    #[test]
    fn status_zero_resets_and_clearing_bits_is_a_violation() {
        let mut t = VirtioPciTransport::new(0, 3);
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        assert!(matches!(
            w(&mut t, 0x14, &[status::ACKNOWLEDGE]),
            Err(VirtioPciError::StatusRegression { .. })
        ));
        assert_eq!(w(&mut t, 0x14, &[0]), Ok(Effect::Reset));
    }

    #[test]
    fn queue_setup_and_enable() {
        let mut t = VirtioPciTransport::new(0, 3);
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        assert_eq!(r(&t, 0x18, 2), u64::from(MAX_QUEUE_SIZE));
        w(&mut t, 0x18, &64u16.to_le_bytes()).unwrap();
        w(&mut t, 0x20, &0x1000u32.to_le_bytes()).unwrap();
        w(&mut t, 0x24, &0u32.to_le_bytes()).unwrap();
        w(&mut t, 0x28, &0x2000u64.to_le_bytes()).unwrap();
        w(&mut t, 0x30, &0x3000u32.to_le_bytes()).unwrap();
        w(&mut t, 0x1a, &1u16.to_le_bytes()).unwrap();
        w(&mut t, 0x1c, &1u16.to_le_bytes()).unwrap();
        assert!(t.queue_ready(0));
        assert_eq!(r(&t, 0x28, 8), 0x2000);
        assert_eq!(t.queue_vector(0), 1);
        // Reconfiguring an enabled queue is a violation.
        assert_eq!(
            w(&mut t, 0x18, &32u16.to_le_bytes()),
            Err(VirtioPciError::QueueBusy(0))
        );
        assert_eq!(
            w(
                &mut t,
                0x14,
                &[status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK]
            ),
            Ok(Effect::DriverOk)
        );
        assert!(t.is_live());
    }

    #[test]
    fn bad_queue_parameters_are_violations() {
        let mut t = VirtioPciTransport::new(0, 3);
        assert_eq!(
            w(&mut t, 0x18, &100u16.to_le_bytes()),
            Err(VirtioPciError::BadQueueSize(100))
        );
        assert_eq!(
            w(&mut t, 0x18, &512u16.to_le_bytes()),
            Err(VirtioPciError::BadQueueSize(512))
        );
        assert!(matches!(
            w(&mut t, 0x20, &0x1001u32.to_le_bytes()),
            Err(VirtioPciError::BadQueueAddress {
                queue: 0,
                addr: 0x1001
            })
        ));
        // Rings outside the 1 MiB of guest memory.
        w(&mut t, 0x20, &0x4000_0000u32.to_le_bytes()).unwrap();
        w(&mut t, 0x28, &0x2000u32.to_le_bytes()).unwrap();
        w(&mut t, 0x30, &0x3000u32.to_le_bytes()).unwrap();
        assert_eq!(
            w(&mut t, 0x1c, &1u16.to_le_bytes()),
            Err(VirtioPciError::QueueOutsideMemory(0))
        );
        assert!(!t.queue_ready(0));
        assert_eq!(
            w(&mut t, 0x1c, &0u16.to_le_bytes()),
            Err(VirtioPciError::BadQueueEnable { queue: 0, value: 0 })
        );
        w(&mut t, 0x16, &5u16.to_le_bytes()).unwrap();
        assert_eq!(r(&t, 0x18, 2), 0, "absent queue reads size 0");
        assert_eq!(
            w(&mut t, 0x18, &8u16.to_le_bytes()),
            Err(VirtioPciError::NoSuchQueue(5))
        );
    }

    #[test]
    fn wrong_widths_are_rejected() {
        let mut t = VirtioPciTransport::new(0, 3);
        let mut b = [0u8; 2];
        assert!(t.read_common(0x14, &mut b).is_err());
        assert!(w(&mut t, 0x13, &[1]).is_err());
        assert!(w(&mut t, 0x22, &[0; 4]).is_err());
        assert!(w(&mut t, 0x38, &[0; 2]).is_err());
    }

    #[test]
    fn msix_vectors_out_of_range_read_back_no_vector() {
        let mut t = VirtioPciTransport::new(0, 3);
        w(&mut t, 0x10, &3u16.to_le_bytes()).unwrap();
        assert_eq!(r(&t, 0x10, 2), u64::from(NO_VECTOR));
        w(&mut t, 0x10, &2u16.to_le_bytes()).unwrap();
        assert_eq!(r(&t, 0x10, 2), 2);
    }

    #[test]
    fn isr_reads_clear_and_needs_reset_is_sticky() {
        let mut t = VirtioPciTransport::new(0, 3);
        t.raise_isr(ISR_QUEUE);
        assert!(t.isr_pending());
        assert_eq!(t.read_isr(), ISR_QUEUE);
        assert_eq!(t.read_isr(), 0);
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        let generation = r(&t, 0x15, 1);
        assert!(t.set_needs_reset());
        assert!(!t.set_needs_reset());
        assert_ne!(r(&t, 0x15, 1), generation);
        assert_ne!(r(&t, 0x14, 1) as u8 & status::DEVICE_NEEDS_RESET, 0);
        w(
            &mut t,
            0x14,
            &[status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK],
        )
        .unwrap();
        assert!(!t.is_live(), "NEEDS_RESET survives status writes");
    }
}
