//! PCI function of the vGPU: the layout of its BARs and its type-0 configuration space.
//!
//! The function is a virtio 1.x modern device (virtio-gpu, 1af4:1050, class display) with:
//! - BAR 2: 32-bit memory, the MSI-X table and PBA (QEMU emulates the table itself; accesses that
//!   reach us are answered with zeros and ignored),
//! - BAR 4/5: 64-bit prefetchable memory holding the virtio structures (common, ISR, device and
//!   notify configuration), each announced by a vendor capability.
//!
//! Writes go through a per-byte write mask, so only the bits a PCI function really implements
//! (command register, BAR address bits, interrupt line, MSI-X enable/mask) ever change.

/// Virtio's PCI vendor id.
pub const VENDOR_ID: u16 = 0x1af4;
/// Modern virtio device ids are 0x1040 + the virtio device id (16 for GPU).
pub const DEVICE_ID: u16 = 0x1040 + virtio_bindings::virtio_ids::VIRTIO_ID_GPU as u16;
/// Subsystem id used by modern virtio PCI devices.
pub const SUBSYSTEM_ID: u16 = 0x1100;
/// Class code: display controller (0x03), "other" subclass (0x80), as QEMU's virtio-gpu-pci.
pub const CLASS_DISPLAY: u8 = 0x03;
/// Subclass "other display controller".
pub const SUBCLASS_OTHER: u8 = 0x80;
/// Revision id: 1 for modern-only virtio devices.
pub const REVISION: u8 = 1;

/// Size of the configuration space region (conventional PCI).
pub const CONFIG_SPACE_SIZE: u64 = 256;

/// BAR holding the MSI-X table and PBA.
pub const MSIX_BAR: u32 = 2;
/// Size of [`MSIX_BAR`]: room for 128 table entries and the PBA; a page, the smallest BAR QEMU
/// maps without sub-page handling.
pub const MSIX_BAR_SIZE: u64 = 0x1000;
/// Offset of the MSI-X table in [`MSIX_BAR`].
pub const MSIX_TABLE_OFFSET: u32 = 0;
/// Offset of the MSI-X pending bit array in [`MSIX_BAR`].
pub const MSIX_PBA_OFFSET: u32 = 0x800;
/// MSI-X vectors: one for configuration changes and one per virtqueue.
pub const MSIX_VECTORS: u16 = 1 + crate::virtio_pci::NUM_QUEUES;

/// BAR holding the virtio structures (64-bit, so it also uses BAR 5).
pub const VIRTIO_BAR: u32 = 4;
/// Size of [`VIRTIO_BAR`]: four 4 KiB pages, one per virtio structure.
pub const VIRTIO_BAR_SIZE: u64 = 0x4000;
/// Offset of the common configuration structure in [`VIRTIO_BAR`].
pub const COMMON_CFG_OFFSET: u64 = 0x0000;
/// Length of the common configuration structure (virtio 1.1 layout, up to `queue_device`).
pub const COMMON_CFG_LEN: u64 = 0x38;
/// Offset of the ISR status byte in [`VIRTIO_BAR`].
pub const ISR_OFFSET: u64 = 0x1000;
/// Length announced for the ISR structure.
pub const ISR_LEN: u64 = 4;
/// Offset of the device-specific configuration (struct virtio_gpu_config) in [`VIRTIO_BAR`].
pub const DEVICE_CFG_OFFSET: u64 = 0x2000;
/// Length of struct virtio_gpu_config.
pub const DEVICE_CFG_LEN: u64 = 16;
/// Offset of the notification area in [`VIRTIO_BAR`].
pub const NOTIFY_OFFSET: u64 = 0x3000;
/// Distance between two queues' notify addresses.
pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;
/// Length of the notification area.
pub const NOTIFY_LEN: u64 = crate::virtio_pci::NUM_QUEUES as u64 * NOTIFY_OFF_MULTIPLIER as u64;

const REG_VENDOR: usize = 0x00;
const REG_DEVICE: usize = 0x02;
const REG_COMMAND: usize = 0x04;
const REG_STATUS: usize = 0x06;
const REG_REVISION: usize = 0x08;
const REG_CLASS: usize = 0x09;
const REG_HEADER_TYPE: usize = 0x0e;
const REG_BAR0: usize = 0x10;
const REG_SUBSYSTEM_VENDOR: usize = 0x2c;
const REG_SUBSYSTEM: usize = 0x2e;
const REG_CAP_PTR: usize = 0x34;
const REG_INTERRUPT_LINE: usize = 0x3c;
const REG_INTERRUPT_PIN: usize = 0x3d;

/// Command register bits a function may implement: I/O, memory, bus master, parity, SERR#,
/// INTx disable.
const COMMAND_WRITABLE: u16 = 0x0001 | 0x0002 | 0x0004 | 0x0040 | 0x0100 | 0x0400;
/// Status register: capability list present.
const STATUS_CAP_LIST: u16 = 1 << 4;
/// Status register: INTx asserted.
const STATUS_INTERRUPT: u16 = 1 << 3;
/// BAR type bits: 64-bit memory, prefetchable.
const BAR_MEM64_PREFETCH: u32 = 0x4 | 0x8;

const CAP_ID_MSIX: u8 = 0x11;
const CAP_ID_VENDOR: u8 = 0x09;
/// MSI-X message control: enable and function mask, the only writable bits.
const MSIX_CONTROL_WRITABLE: u16 = (1 << 15) | (1 << 14);

const CAP_MSIX: usize = 0x40;
const CAP_COMMON: usize = 0x4c;
const CAP_ISR: usize = CAP_COMMON + VIRTIO_CAP_LEN;
const CAP_DEVICE: usize = CAP_ISR + VIRTIO_CAP_LEN;
const CAP_NOTIFY: usize = CAP_DEVICE + VIRTIO_CAP_LEN;
const CAP_PCI_CFG: usize = CAP_NOTIFY + VIRTIO_NOTIFY_CAP_LEN;
/// struct virtio_pci_cfg_cap: the capability plus the 4-byte pci_cfg_data window.
const VIRTIO_PCI_CFG_CAP_LEN: usize = VIRTIO_CAP_LEN + 4;
/// Offset of pci_cfg_data in configuration space.
const PCI_CFG_DATA: usize = CAP_PCI_CFG + VIRTIO_CAP_LEN;
/// struct virtio_pci_cap is 16 bytes; the notify capability adds a 32-bit multiplier.
const VIRTIO_CAP_LEN: usize = 16;
const VIRTIO_NOTIFY_CAP_LEN: usize = VIRTIO_CAP_LEN + 4;

/// virtio_pci_cap cfg_type values.
const VIRTIO_PCI_CAP_COMMON_CFG: u8 = 1;
const VIRTIO_PCI_CAP_NOTIFY_CFG: u8 = 2;
const VIRTIO_PCI_CAP_ISR_CFG: u8 = 3;
const VIRTIO_PCI_CAP_DEVICE_CFG: u8 = 4;
const VIRTIO_PCI_CAP_PCI_CFG: u8 = 5;

/// An access through the configuration window that does not name a virtio register.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "pci_cfg_data access of {access} bytes with window bar {bar} offset {offset:#x} length {length}"
)]
pub struct WindowError {
    /// The BAR programmed.
    pub bar: u8,
    /// The offset programmed.
    pub offset: u64,
    /// The length programmed.
    pub length: usize,
    /// Bytes of the config access.
    pub access: usize,
}

/// The configuration space of the function with its write mask.
#[derive(Debug, Clone)]
pub struct ConfigSpace {
    bytes: [u8; CONFIG_SPACE_SIZE as usize],
    wmask: [u8; CONFIG_SPACE_SIZE as usize],
}

impl Default for ConfigSpace {
    fn default() -> Self {
        Self::new()
    }
}

impl ConfigSpace {
    /// Builds the power-on configuration space.
    pub fn new() -> Self {
        let mut cs = ConfigSpace {
            bytes: [0; CONFIG_SPACE_SIZE as usize],
            wmask: [0; CONFIG_SPACE_SIZE as usize],
        };
        cs.put16(REG_VENDOR, VENDOR_ID);
        cs.put16(REG_DEVICE, DEVICE_ID);
        cs.put16(REG_STATUS, STATUS_CAP_LIST);
        cs.bytes[REG_REVISION] = REVISION;
        cs.bytes[REG_CLASS..REG_CLASS + 3].copy_from_slice(&[0, SUBCLASS_OTHER, CLASS_DISPLAY]);
        cs.bytes[REG_HEADER_TYPE] = 0;
        cs.put16(REG_SUBSYSTEM_VENDOR, VENDOR_ID);
        cs.put16(REG_SUBSYSTEM, SUBSYSTEM_ID);
        cs.bytes[REG_CAP_PTR] = CAP_MSIX as u8;
        cs.bytes[REG_INTERRUPT_PIN] = 1; // INTA#
        cs.wmask[REG_INTERRUPT_LINE] = 0xff;
        cs.mask16(REG_COMMAND, COMMAND_WRITABLE);

        // BAR 2: 32-bit non-prefetchable memory.
        let msix_bar = REG_BAR0 + 4 * MSIX_BAR as usize;
        cs.mask32(msix_bar, !(MSIX_BAR_SIZE as u32 - 1));
        // BAR 4/5: 64-bit prefetchable memory.
        let virtio_bar = REG_BAR0 + 4 * VIRTIO_BAR as usize;
        cs.put32(virtio_bar, BAR_MEM64_PREFETCH);
        cs.mask32(virtio_bar, !(VIRTIO_BAR_SIZE as u32 - 1));
        cs.mask32(virtio_bar + 4, u32::MAX);

        // MSI-X capability.
        cs.bytes[CAP_MSIX] = CAP_ID_MSIX;
        cs.bytes[CAP_MSIX + 1] = CAP_COMMON as u8;
        cs.put16(CAP_MSIX + 2, MSIX_VECTORS - 1);
        cs.mask16(CAP_MSIX + 2, MSIX_CONTROL_WRITABLE);
        cs.put32(CAP_MSIX + 4, MSIX_TABLE_OFFSET | MSIX_BAR);
        cs.put32(CAP_MSIX + 8, MSIX_PBA_OFFSET | MSIX_BAR);

        // Virtio vendor capabilities.
        let caps = [
            (
                CAP_COMMON,
                VIRTIO_PCI_CAP_COMMON_CFG,
                COMMON_CFG_OFFSET,
                COMMON_CFG_LEN,
                CAP_ISR,
            ),
            (
                CAP_ISR,
                VIRTIO_PCI_CAP_ISR_CFG,
                ISR_OFFSET,
                ISR_LEN,
                CAP_DEVICE,
            ),
            (
                CAP_DEVICE,
                VIRTIO_PCI_CAP_DEVICE_CFG,
                DEVICE_CFG_OFFSET,
                DEVICE_CFG_LEN,
                CAP_NOTIFY,
            ),
            (
                CAP_NOTIFY,
                VIRTIO_PCI_CAP_NOTIFY_CFG,
                NOTIFY_OFFSET,
                NOTIFY_LEN,
                CAP_PCI_CFG,
            ),
        ];
        for (at, cfg_type, offset, len, next) in caps {
            let cap_len = if cfg_type == VIRTIO_PCI_CAP_NOTIFY_CFG {
                VIRTIO_NOTIFY_CAP_LEN
            } else {
                VIRTIO_CAP_LEN
            };
            cs.bytes[at] = CAP_ID_VENDOR;
            cs.bytes[at + 1] = next as u8;
            cs.bytes[at + 2] = cap_len as u8;
            cs.bytes[at + 3] = cfg_type;
            cs.bytes[at + 4] = VIRTIO_BAR as u8;
            cs.put32(at + 8, offset as u32);
            cs.put32(at + 12, len as u32);
        }
        cs.put32(CAP_NOTIFY + VIRTIO_CAP_LEN, NOTIFY_OFF_MULTIPLIER);

        // The configuration access window: the driver programs bar, offset and length, then
        // reads or writes pci_cfg_data (handled by the device, not stored here).
        cs.bytes[CAP_PCI_CFG] = CAP_ID_VENDOR;
        cs.bytes[CAP_PCI_CFG + 1] = 0;
        cs.bytes[CAP_PCI_CFG + 2] = VIRTIO_PCI_CFG_CAP_LEN as u8;
        cs.bytes[CAP_PCI_CFG + 3] = VIRTIO_PCI_CAP_PCI_CFG;
        cs.wmask[CAP_PCI_CFG + 4] = 0xff;
        cs.mask32(CAP_PCI_CFG + 8, u32::MAX);
        cs.mask32(CAP_PCI_CFG + 12, u32::MAX);
        cs
    }

    /// If an access of `len` bytes at `offset` is one to pci_cfg_data (it starts there and is at
    /// most 4 bytes), the BAR access it stands for: (bar, offset in the BAR, length) as the
    /// driver programmed the window; the access must cover the programmed length. Other
    /// accesses, such as QEMU reading the whole space, see the data bytes as plain zeros.
    pub fn pci_cfg_window(
        &self,
        offset: u64,
        len: usize,
    ) -> Option<Result<(u8, u64, usize), WindowError>> {
        let data = PCI_CFG_DATA as u64;
        if offset != data || len > 4 {
            return None;
        }
        let bar = self.bytes[CAP_PCI_CFG + 4];
        let word = |at: usize| {
            u32::from_le_bytes([
                self.bytes[at],
                self.bytes[at + 1],
                self.bytes[at + 2],
                self.bytes[at + 3],
            ])
        };
        let (bar_offset, length) = (
            u64::from(word(CAP_PCI_CFG + 8)),
            word(CAP_PCI_CFG + 12) as usize,
        );
        if !matches!(length, 1 | 2 | 4) || len < length || u32::from(bar) != VIRTIO_BAR {
            return Some(Err(WindowError {
                bar,
                offset: bar_offset,
                length,
                access: len,
            }));
        }
        Some(Ok((bar, bar_offset, length)))
    }

    fn put16(&mut self, at: usize, v: u16) {
        self.bytes[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn put32(&mut self, at: usize, v: u32) {
        self.bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn mask16(&mut self, at: usize, m: u16) {
        self.wmask[at..at + 2].copy_from_slice(&m.to_le_bytes());
    }

    fn mask32(&mut self, at: usize, m: u32) {
        self.wmask[at..at + 4].copy_from_slice(&m.to_le_bytes());
    }

    /// Reads `data.len()` bytes at `offset`. The caller has validated the range
    /// (see [`crate::transport`]); an out-of-range read yields zeros for the missing bytes.
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let Ok(start) = usize::try_from(offset) else {
            return;
        };
        if let Some(src) = self.bytes.get(start..) {
            let n = src.len().min(data.len());
            data[..n].copy_from_slice(&src[..n]);
        }
    }

    /// Writes `data` at `offset` through the write mask; bytes outside the space are dropped.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let Ok(start) = usize::try_from(offset) else {
            return;
        };
        for (i, v) in data.iter().enumerate() {
            let Some(at) = start.checked_add(i).filter(|&a| a < self.bytes.len()) else {
                return;
            };
            let m = self.wmask[at];
            self.bytes[at] = (self.bytes[at] & !m) | (v & m);
        }
    }

    /// Reflects the INTx line in the status register (bit 3), as a real function does.
    pub fn set_interrupt_status(&mut self, asserted: bool) {
        let mut status = u16::from_le_bytes([self.bytes[REG_STATUS], self.bytes[REG_STATUS + 1]]);
        if asserted {
            status |= STATUS_INTERRUPT;
        } else {
            status &= !STATUS_INTERRUPT;
        }
        self.put16(REG_STATUS, status);
    }

    /// Whether the guest has disabled INTx in the command register.
    pub fn intx_disabled(&self) -> bool {
        self.bytes[REG_COMMAND + 1] & 0x04 != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read32(cs: &ConfigSpace, off: u64) -> u32 {
        let mut b = [0u8; 4];
        cs.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    #[test]
    fn identity_and_class() {
        let cs = ConfigSpace::new();
        assert_eq!(read32(&cs, 0), 0x1050_1af4);
        assert_eq!(read32(&cs, 8) >> 8, 0x03_80_00);
        assert_eq!(read32(&cs, 0x2c), 0x1100_1af4);
    }

    #[test]
    fn capability_chain_ends_and_names_all_virtio_structures() {
        let cs = ConfigSpace::new();
        let mut ptr = cs.bytes[REG_CAP_PTR] as usize;
        let mut seen = Vec::new();
        while ptr != 0 {
            assert!(seen.len() < 48, "capability loop");
            seen.push((cs.bytes[ptr], cs.bytes[ptr + 3]));
            ptr = cs.bytes[ptr + 1] as usize;
        }
        assert_eq!(
            seen,
            vec![(0x11, 0), (9, 1), (9, 3), (9, 4), (9, 2), (9, 5)],
            "MSI-X then common, ISR, device, notify, config window"
        );
        assert_eq!(read32(&cs, CAP_NOTIFY as u64 + 16), NOTIFY_OFF_MULTIPLIER);
    }

    #[test]
    fn bar_sizing_reports_sizes_and_type_bits() {
        let mut cs = ConfigSpace::new();
        for bar in 0..6u64 {
            cs.write(0x10 + 4 * bar, &u32::MAX.to_le_bytes());
        }
        assert_eq!(read32(&cs, 0x10), 0, "BAR 0 unimplemented");
        assert_eq!(read32(&cs, 0x18), !(MSIX_BAR_SIZE as u32 - 1));
        assert_eq!(read32(&cs, 0x20), !(VIRTIO_BAR_SIZE as u32 - 1) | 0xc);
        assert_eq!(read32(&cs, 0x24), u32::MAX);
    }

    #[test]
    fn read_only_fields_ignore_writes() {
        let mut cs = ConfigSpace::new();
        cs.write(0, &[0xff; 64]);
        assert_eq!(read32(&cs, 0), 0x1050_1af4);
        assert_eq!(cs.bytes[REG_CAP_PTR], CAP_MSIX as u8);
        // Command register keeps only implemented bits.
        cs.write(4, &0xffffu16.to_le_bytes());
        assert_eq!(read32(&cs, 4) & 0xffff, COMMAND_WRITABLE as u32);
    }

    #[test]
    fn config_window_decodes_the_programmed_access() {
        let mut cs = ConfigSpace::new();
        let data = PCI_CFG_DATA as u64;
        assert_eq!(cs.pci_cfg_window(0, 4), None);
        assert_eq!(cs.pci_cfg_window(data + 4, 4), None);
        cs.write(CAP_PCI_CFG as u64 + 4, &[4]);
        cs.write(CAP_PCI_CFG as u64 + 8, &0x12u32.to_le_bytes());
        cs.write(CAP_PCI_CFG as u64 + 12, &2u32.to_le_bytes());
        assert_eq!(cs.pci_cfg_window(data, 2), Some(Ok((4, 0x12, 2))));
        assert_eq!(
            cs.pci_cfg_window(data, 4),
            Some(Ok((4, 0x12, 2))),
            "wider access, programmed length"
        );
        assert!(
            matches!(cs.pci_cfg_window(data, 1), Some(Err(_))),
            "narrower than the length"
        );
        assert_eq!(cs.pci_cfg_window(data + 2, 2), None, "plain bytes");
        assert_eq!(cs.pci_cfg_window(0, 256), None, "a whole-space read");
        cs.write(CAP_PCI_CFG as u64 + 4, &[2]);
        assert!(
            matches!(cs.pci_cfg_window(data, 2), Some(Err(_))),
            "not the virtio BAR"
        );
        // The data bytes themselves are never stored.
        cs.write(data, &[0xff; 4]);
        let mut b = [0u8; 4];
        cs.read(data, &mut b);
        assert_eq!(b, [0; 4]);
    }

    #[test]
    fn accesses_past_the_end_are_clipped() {
        let mut cs = ConfigSpace::new();
        let mut b = [0xaau8; 8];
        cs.read(252, &mut b);
        assert_eq!(&b[4..], &[0, 0, 0, 0]);
        cs.write(u64::MAX, &[1, 2, 3]);
        cs.write(255, &[1, 2, 3]);
    }
}
