//! PCI configuration space access, enumeration, BAR programming and MSI-X, done the way
//! firmware would: configuration mechanism #1 through I/O ports 0xcf8/0xcfc.

use std::fmt;

use crate::qtest::{Qtest, QtestError};

/// CONFIG_ADDRESS I/O port.
pub const CONFIG_ADDRESS_PORT: u16 = 0xcf8;
/// CONFIG_DATA I/O port.
pub const CONFIG_DATA_PORT: u16 = 0xcfc;

/// Vendor ID register (16 bit).
pub const REG_VENDOR_ID: u8 = 0x00;
/// Device ID register (16 bit).
pub const REG_DEVICE_ID: u8 = 0x02;
/// Command register (16 bit).
pub const REG_COMMAND: u8 = 0x04;
/// Status register (16 bit).
pub const REG_STATUS: u8 = 0x06;
/// Revision ID register (8 bit).
pub const REG_REVISION_ID: u8 = 0x08;
/// Programming interface byte of the class code.
pub const REG_PROG_IF: u8 = 0x09;
/// Sub-class byte of the class code.
pub const REG_SUBCLASS: u8 = 0x0a;
/// Base class byte of the class code.
pub const REG_CLASS: u8 = 0x0b;
/// Header type register (8 bit; bit 7 = multi-function).
pub const REG_HEADER_TYPE: u8 = 0x0e;
/// First base address register; BAR `n` is at `REG_BAR0 + 4 * n`.
pub const REG_BAR0: u8 = 0x10;
/// Subsystem vendor ID register (16 bit).
pub const REG_SUBSYSTEM_VENDOR_ID: u8 = 0x2c;
/// Subsystem ID register (16 bit).
pub const REG_SUBSYSTEM_ID: u8 = 0x2e;
/// Capabilities pointer register (8 bit).
pub const REG_CAPABILITIES: u8 = 0x34;
/// Interrupt pin register (8 bit).
pub const REG_INTERRUPT_PIN: u8 = 0x3d;

/// Command register: I/O space decoding.
pub const COMMAND_IO_SPACE: u16 = 1 << 0;
/// Command register: memory space decoding.
pub const COMMAND_MEMORY_SPACE: u16 = 1 << 1;
/// Command register: bus mastering (DMA and MSI writes).
pub const COMMAND_BUS_MASTER: u16 = 1 << 2;
/// Command register: INTx disable.
pub const COMMAND_INTX_DISABLE: u16 = 1 << 10;
/// Status register: capabilities list present.
pub const STATUS_CAPABILITIES_LIST: u16 = 1 << 4;

/// Capability ID of MSI.
pub const CAP_ID_MSI: u8 = 0x05;
/// Capability ID of vendor-specific capabilities (used by virtio).
pub const CAP_ID_VENDOR: u8 = 0x09;
/// Capability ID of PCI Express.
pub const CAP_ID_EXP: u8 = 0x10;
/// Capability ID of MSI-X.
pub const CAP_ID_MSIX: u8 = 0x11;

/// MSI-X message control: function mask.
pub const MSIX_CONTROL_MASK_ALL: u16 = 1 << 14;
/// MSI-X message control: MSI-X enable.
pub const MSIX_CONTROL_ENABLE: u16 = 1 << 15;
/// Size of one MSI-X table entry.
pub const MSIX_ENTRY_SIZE: u64 = 16;
/// MSI-X vector control: masked.
pub const MSIX_VECTOR_MASKED: u32 = 1;

/// Start of the MMIO window BARs are placed in.
pub const MMIO_WINDOW_START: u64 = 0xe000_0000;
/// End (exclusive) of the MMIO window: the IOAPIC.
pub const MMIO_WINDOW_END: u64 = 0xfec0_0000;
/// Start of the I/O port window BARs are placed in.
pub const IO_WINDOW_START: u64 = 0xc000;
/// End (exclusive) of the I/O port window.
pub const IO_WINDOW_END: u64 = 0x1_0000;

/// Number of BARs of a type 0 header.
pub const BAR_COUNT: u8 = 6;
/// First byte of configuration space available to capabilities.
const CAPABILITIES_START: u8 = 0x40;
/// Most capabilities walked before the list is declared looping: 256 bytes hold at most 48 of
/// them after the 64-byte header.
const MAX_CAPABILITIES: usize = 48;

/// Errors of the PCI layer.
#[derive(Debug, thiserror::Error)]
pub enum PciError {
    /// A qtest command failed.
    #[error(transparent)]
    Qtest(#[from] QtestError),
    /// No function on bus 0 has the IDs.
    #[error("no PCI function {vendor:04x}:{device:04x} on bus 0")]
    NotFound {
        /// Vendor ID searched for.
        vendor: u16,
        /// Device ID searched for.
        device: u16,
    },
    /// The capability list loops or holds more entries than fit in configuration space.
    #[error("{address}: capability list loops or has more than {MAX_CAPABILITIES} entries")]
    CapabilityLoop {
        /// The function.
        address: PciAddress,
    },
    /// A capability pointer points into the standard header.
    #[error("{address}: capability pointer {pointer:#x} points into the standard header")]
    BadCapabilityPointer {
        /// The function.
        address: PciAddress,
        /// The offending pointer.
        pointer: u8,
    },
    /// A BAR index is out of range or names the upper half of a 64-bit BAR.
    #[error("{address}: BAR {index} does not exist")]
    NoSuchBar {
        /// The function.
        address: PciAddress,
        /// The BAR index.
        index: u8,
    },
    /// A BAR that is needed was not implemented or not assigned.
    #[error("BAR {index} is not assigned")]
    BarNotAssigned {
        /// The BAR index.
        index: u8,
    },
    /// The MMIO or I/O window has no room left for a BAR.
    #[error("no room for a {size:#x}-byte {kind} BAR")]
    WindowExhausted {
        /// "memory" or "I/O".
        kind: &'static str,
        /// The BAR size.
        size: u64,
    },
    /// The function has no MSI-X capability.
    #[error("{address}: no MSI-X capability")]
    NoMsix {
        /// The function.
        address: PciAddress,
    },
    /// An MSI-X vector beyond the table was named.
    #[error("MSI-X vector {vector} out of range (table has {table_size} entries)")]
    MsixVectorOutOfRange {
        /// The vector.
        vector: u16,
        /// Entries in the table.
        table_size: u16,
    },
    /// The MSI-X table or PBA lives in an I/O BAR.
    #[error("MSI-X structure in BAR {index}, which is not a memory BAR")]
    MsixNotInMemoryBar {
        /// The BAR index.
        index: u8,
    },
}

/// Result type of this module.
pub type Result<T> = std::result::Result<T, PciError>;

/// Bus/device/function of a PCI function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    /// Bus number.
    pub bus: u8,
    /// Device number (0..32).
    pub device: u8,
    /// Function number (0..8).
    pub function: u8,
}

impl PciAddress {
    /// Creates an address.
    pub const fn new(bus: u8, device: u8, function: u8) -> Self {
        Self {
            bus,
            device,
            function,
        }
    }

    /// The CONFIG_ADDRESS value selecting dword register `reg & 0xfc` of this function.
    pub fn config_address(self, reg: u8) -> u32 {
        0x8000_0000
            | u32::from(self.bus) << 16
            | u32::from(self.device & 0x1f) << 11
            | u32::from(self.function & 0x7) << 8
            | u32::from(reg & 0xfc)
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02x}:{:02x}.{}", self.bus, self.device, self.function)
    }
}

/// What a BAR decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarKind {
    /// I/O ports.
    Io,
    /// 32-bit memory.
    Memory32 {
        /// Prefetchable bit.
        prefetchable: bool,
    },
    /// 64-bit memory (occupies this BAR and the next).
    Memory64 {
        /// Prefetchable bit.
        prefetchable: bool,
    },
}

impl BarKind {
    /// Whether this is a memory BAR.
    pub fn is_memory(self) -> bool {
        self != BarKind::Io
    }
}

/// A sized (and possibly programmed) BAR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bar {
    /// BAR index (0..6).
    pub index: u8,
    /// What it decodes.
    pub kind: BarKind,
    /// Size in bytes (a power of two).
    pub size: u64,
    /// Base address (port number for I/O BARs); 0 until assigned.
    pub address: u64,
}

/// The BARs of one function after [`PciDevice::assign_bars`].
#[derive(Debug, Clone, Default)]
pub struct Bars {
    bars: [Option<Bar>; BAR_COUNT as usize],
}

impl Bars {
    /// The BAR with this index, if it is implemented.
    pub fn get(&self, index: u8) -> Option<&Bar> {
        self.bars.get(usize::from(index))?.as_ref()
    }

    /// Base address of an implemented BAR.
    pub fn address(&self, index: u8) -> Result<u64> {
        self.get(index)
            .map(|bar| bar.address)
            .ok_or(PciError::BarNotAssigned { index })
    }

    /// Base address of an implemented memory BAR.
    fn memory_address(&self, index: u8) -> Result<u64> {
        match self.get(index) {
            Some(bar) if bar.kind.is_memory() => Ok(bar.address),
            Some(_) => Err(PciError::MsixNotInMemoryBar { index }),
            None => Err(PciError::BarNotAssigned { index }),
        }
    }

    /// The implemented BARs, in index order.
    pub fn iter(&self) -> impl Iterator<Item = &Bar> {
        self.bars.iter().flatten()
    }
}

/// Places BARs in the MMIO window (0xE000_0000..0xFEC0_0000) and I/O window (0xC000..0x10000).
#[derive(Debug, Clone)]
pub struct PciAllocator {
    next_mmio: u64,
    next_io: u64,
}

impl Default for PciAllocator {
    fn default() -> Self {
        Self::new()
    }
}

impl PciAllocator {
    /// Creates an allocator with both windows empty.
    pub fn new() -> Self {
        Self {
            next_mmio: MMIO_WINDOW_START,
            next_io: IO_WINDOW_START,
        }
    }

    /// Reserves a naturally aligned range for a BAR of this kind and size.
    pub fn alloc(&mut self, kind: BarKind, size: u64) -> Result<u64> {
        let (next, end, name) = match kind {
            BarKind::Io => (&mut self.next_io, IO_WINDOW_END, "I/O"),
            _ => (&mut self.next_mmio, MMIO_WINDOW_END, "memory"),
        };
        let start = next
            .checked_next_multiple_of(size)
            .filter(|start| start.checked_add(size).is_some_and(|e| e <= end))
            .ok_or(PciError::WindowExhausted { kind: name, size })?;
        *next = start + size;
        Ok(start)
    }
}

/// A capability found in the capability list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capability {
    /// Capability ID.
    pub id: u8,
    /// Offset of the capability in configuration space.
    pub offset: u8,
}

/// Location and size of a function's MSI-X structures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsixCapability {
    /// Offset of the capability in configuration space.
    pub offset: u8,
    /// Number of table entries.
    pub table_size: u16,
    /// BAR holding the table.
    pub table_bar: u8,
    /// Offset of the table in its BAR.
    pub table_offset: u32,
    /// BAR holding the pending bit array.
    pub pba_bar: u8,
    /// Offset of the pending bit array in its BAR.
    pub pba_offset: u32,
}

/// An MSI message: the write a device performs to signal an interrupt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsiMessage {
    /// Address written.
    pub address: u64,
    /// 32-bit value written.
    pub data: u32,
}

/// A function on bus 0, as found by [`scan_bus0`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciFunctionInfo {
    /// Where it is.
    pub address: PciAddress,
    /// Vendor ID.
    pub vendor_id: u16,
    /// Device ID.
    pub device_id: u16,
}

/// Lists all functions present on bus 0 (multi-function devices included).
pub fn scan_bus0(qt: &mut Qtest) -> Result<Vec<PciFunctionInfo>> {
    let mut found = Vec::new();
    for device in 0..32 {
        for function in 0..8 {
            let dev = PciDevice::new(PciAddress::new(0, device, function));
            let ids = dev.read_config_u32(qt, REG_VENDOR_ID)?;
            let vendor_id = ids as u16;
            if vendor_id == 0xffff {
                if function == 0 {
                    break;
                }
                continue;
            }
            found.push(PciFunctionInfo {
                address: dev.address,
                vendor_id,
                device_id: (ids >> 16) as u16,
            });
            if function == 0 && dev.read_config_u8(qt, REG_HEADER_TYPE)? & 0x80 == 0 {
                break;
            }
        }
    }
    log::debug!("bus 0: {found:x?}");
    Ok(found)
}

/// Finds the first function on bus 0 with these IDs.
pub fn find_device(qt: &mut Qtest, vendor: u16, device: u16) -> Result<PciDevice> {
    scan_bus0(qt)?
        .into_iter()
        .find(|f| f.vendor_id == vendor && f.device_id == device)
        .map(|f| PciDevice::new(f.address))
        .ok_or(PciError::NotFound { vendor, device })
}

/// Handle on one PCI function. Holds no state besides its address; all methods go through the
/// qtest connection passed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciDevice {
    address: PciAddress,
}

impl PciDevice {
    /// A handle for the function at `address` (whether or not it exists).
    pub fn new(address: PciAddress) -> Self {
        Self { address }
    }

    /// The function's address.
    pub fn address(&self) -> PciAddress {
        self.address
    }

    fn select(&self, qt: &mut Qtest, reg: u8) -> Result<u16> {
        qt.outl(CONFIG_ADDRESS_PORT, self.address.config_address(reg))?;
        Ok(CONFIG_DATA_PORT + u16::from(reg & 3))
    }

    /// Reads a configuration byte.
    pub fn read_config_u8(&self, qt: &mut Qtest, reg: u8) -> Result<u8> {
        let port = self.select(qt, reg)?;
        Ok(qt.inb(port)?)
    }

    /// Reads a configuration word (`reg` should be 2-byte aligned).
    pub fn read_config_u16(&self, qt: &mut Qtest, reg: u8) -> Result<u16> {
        let port = self.select(qt, reg)?;
        Ok(qt.inw(port)?)
    }

    /// Reads a configuration dword (`reg` should be 4-byte aligned).
    pub fn read_config_u32(&self, qt: &mut Qtest, reg: u8) -> Result<u32> {
        let port = self.select(qt, reg)?;
        Ok(qt.inl(port)?)
    }

    /// Writes a configuration byte.
    pub fn write_config_u8(&self, qt: &mut Qtest, reg: u8, value: u8) -> Result<()> {
        let port = self.select(qt, reg)?;
        Ok(qt.outb(port, value)?)
    }

    /// Writes a configuration word (`reg` should be 2-byte aligned).
    pub fn write_config_u16(&self, qt: &mut Qtest, reg: u8, value: u16) -> Result<()> {
        let port = self.select(qt, reg)?;
        Ok(qt.outw(port, value)?)
    }

    /// Writes a configuration dword (`reg` should be 4-byte aligned).
    pub fn write_config_u32(&self, qt: &mut Qtest, reg: u8, value: u32) -> Result<()> {
        let port = self.select(qt, reg)?;
        Ok(qt.outl(port, value)?)
    }

    /// Vendor ID.
    pub fn vendor_id(&self, qt: &mut Qtest) -> Result<u16> {
        self.read_config_u16(qt, REG_VENDOR_ID)
    }

    /// Device ID.
    pub fn device_id(&self, qt: &mut Qtest) -> Result<u16> {
        self.read_config_u16(qt, REG_DEVICE_ID)
    }

    /// Class code as `(base class, sub-class, programming interface)`.
    pub fn class_code(&self, qt: &mut Qtest) -> Result<(u8, u8, u8)> {
        let dword = self.read_config_u32(qt, REG_REVISION_ID)?;
        Ok(((dword >> 24) as u8, (dword >> 16) as u8, (dword >> 8) as u8))
    }

    /// Command register.
    pub fn command(&self, qt: &mut Qtest) -> Result<u16> {
        self.read_config_u16(qt, REG_COMMAND)
    }

    /// Writes the command register.
    pub fn set_command(&self, qt: &mut Qtest, command: u16) -> Result<()> {
        self.write_config_u16(qt, REG_COMMAND, command)
    }

    /// Sets `bits` (e.g. [`COMMAND_MEMORY_SPACE`] | [`COMMAND_BUS_MASTER`]) in the command register.
    pub fn enable(&self, qt: &mut Qtest, bits: u16) -> Result<()> {
        let command = self.command(qt)?;
        self.set_command(qt, command | bits)
    }

    /// Walks the capability list (empty when the status register says there is none).
    pub fn capabilities(&self, qt: &mut Qtest) -> Result<Vec<Capability>> {
        let mut caps = Vec::new();
        if self.read_config_u16(qt, REG_STATUS)? & STATUS_CAPABILITIES_LIST == 0 {
            return Ok(caps);
        }
        let mut pointer = self.read_config_u8(qt, REG_CAPABILITIES)? & 0xfc;
        while pointer != 0 {
            if caps.len() == MAX_CAPABILITIES {
                return Err(PciError::CapabilityLoop {
                    address: self.address,
                });
            }
            if pointer < CAPABILITIES_START {
                return Err(PciError::BadCapabilityPointer {
                    address: self.address,
                    pointer,
                });
            }
            let header = self.read_config_u16(qt, pointer)?;
            caps.push(Capability {
                id: header as u8,
                offset: pointer,
            });
            pointer = (header >> 8) as u8 & 0xfc;
        }
        Ok(caps)
    }

    /// Offset of the first capability with this ID.
    pub fn find_capability(&self, qt: &mut Qtest, id: u8) -> Result<Option<u8>> {
        Ok(self
            .capabilities(qt)?
            .into_iter()
            .find(|cap| cap.id == id)
            .map(|cap| cap.offset))
    }

    /// Sizes BAR `index` by writing all-ones and reading back, then restores it. Returns `None`
    /// for an unimplemented BAR. Decoding should be off (as [`Self::assign_bars`] does), lest the
    /// device briefly decode at the all-ones address.
    pub fn size_bar(&self, qt: &mut Qtest, index: u8) -> Result<Option<Bar>> {
        if index >= BAR_COUNT {
            return Err(PciError::NoSuchBar {
                address: self.address,
                index,
            });
        }
        let reg = REG_BAR0 + 4 * index;
        let low = self.probe_bar_dword(qt, reg)?;
        let (kind, mask) = if low.original & 1 == 1 {
            (BarKind::Io, u64::from(low.sized & !0x3))
        } else {
            let prefetchable = low.original & 0x8 != 0;
            let low_mask = u64::from(low.sized & !0xf);
            if low.original & 0x6 == 0x4 {
                if index + 1 >= BAR_COUNT {
                    return Err(PciError::NoSuchBar {
                        address: self.address,
                        index: index + 1,
                    });
                }
                let high = self.probe_bar_dword(qt, reg + 4)?;
                let mask = u64::from(high.sized) << 32 | low_mask;
                (BarKind::Memory64 { prefetchable }, mask)
            } else {
                (BarKind::Memory32 { prefetchable }, low_mask)
            }
        };
        if mask == 0 {
            return Ok(None);
        }
        let address = match kind {
            BarKind::Io => u64::from(low.original & !0x3),
            BarKind::Memory32 { .. } => u64::from(low.original & !0xf),
            BarKind::Memory64 { .. } => {
                u64::from(self.read_config_u32(qt, reg + 4)?) << 32 | u64::from(low.original & !0xf)
            }
        };
        // The size is the lowest writable address bit.
        let size = mask & mask.wrapping_neg();
        Ok(Some(Bar {
            index,
            kind,
            size,
            address,
        }))
    }

    fn probe_bar_dword(&self, qt: &mut Qtest, reg: u8) -> Result<BarProbe> {
        let original = self.read_config_u32(qt, reg)?;
        self.write_config_u32(qt, reg, u32::MAX)?;
        let sized = self.read_config_u32(qt, reg)?;
        self.write_config_u32(qt, reg, original)?;
        Ok(BarProbe { original, sized })
    }

    /// Sizes every BAR and programs each implemented one with an address from `alloc` (64-bit
    /// BARs get an upper dword of 0). Decoding is disabled meanwhile and the command register
    /// restored afterwards, so the caller enables memory/I/O decoding itself.
    pub fn assign_bars(&self, qt: &mut Qtest, alloc: &mut PciAllocator) -> Result<Bars> {
        let command = self.command(qt)?;
        self.set_command(qt, command & !(COMMAND_IO_SPACE | COMMAND_MEMORY_SPACE))?;
        let mut bars = Bars::default();
        let mut index = 0;
        while index < BAR_COUNT {
            let Some(mut bar) = self.size_bar(qt, index)? else {
                index += 1;
                continue;
            };
            bar.address = alloc.alloc(bar.kind, bar.size)?;
            let reg = REG_BAR0 + 4 * index;
            self.write_config_u32(qt, reg, bar.address as u32)?;
            if let BarKind::Memory64 { .. } = bar.kind {
                self.write_config_u32(qt, reg + 4, (bar.address >> 32) as u32)?;
                index += 1;
            }
            log::debug!(
                "{}: BAR{} {:?} size {:#x} at {:#x}",
                self.address,
                bar.index,
                bar.kind,
                bar.size,
                bar.address
            );
            bars.bars[usize::from(bar.index)] = Some(bar);
            index += 1;
        }
        self.set_command(qt, command)?;
        Ok(bars)
    }

    /// Parses the MSI-X capability, if the function has one.
    pub fn msix_capability(&self, qt: &mut Qtest) -> Result<Option<MsixCapability>> {
        let Some(offset) = self.find_capability(qt, CAP_ID_MSIX)? else {
            return Ok(None);
        };
        let control = self.read_config_u16(qt, offset + 2)?;
        let table = self.read_config_u32(qt, offset + 4)?;
        let pba = self.read_config_u32(qt, offset + 8)?;
        Ok(Some(MsixCapability {
            offset,
            table_size: (control & 0x7ff) + 1,
            table_bar: (table & 0x7) as u8,
            table_offset: table & !0x7,
            pba_bar: (pba & 0x7) as u8,
            pba_offset: pba & !0x7,
        }))
    }

    fn msix_entry_address(&self, cap: &MsixCapability, bars: &Bars, vector: u16) -> Result<u64> {
        if vector >= cap.table_size {
            return Err(PciError::MsixVectorOutOfRange {
                vector,
                table_size: cap.table_size,
            });
        }
        let table = bars.memory_address(cap.table_bar)? + u64::from(cap.table_offset);
        Ok(table + MSIX_ENTRY_SIZE * u64::from(vector))
    }

    /// Programs table entries `0..messages.len()` with the messages, unmasked, by MMIO writes
    /// into the table's BAR, then sets MSI-X enable and clears the function mask. Memory
    /// decoding must be on, and bus mastering too for the messages to be delivered.
    pub fn enable_msix(
        &self,
        qt: &mut Qtest,
        cap: &MsixCapability,
        bars: &Bars,
        messages: &[MsiMessage],
    ) -> Result<()> {
        for (vector, message) in (0..).zip(messages) {
            let entry = self.msix_entry_address(cap, bars, vector)?;
            qt.writel(entry, message.address as u32)?;
            qt.writel(entry + 4, (message.address >> 32) as u32)?;
            qt.writel(entry + 8, message.data)?;
            qt.writel(entry + 12, 0)?;
        }
        let control = self.read_config_u16(qt, cap.offset + 2)?;
        let control = (control | MSIX_CONTROL_ENABLE) & !MSIX_CONTROL_MASK_ALL;
        self.write_config_u16(qt, cap.offset + 2, control)
    }

    /// Clears MSI-X enable.
    pub fn disable_msix(&self, qt: &mut Qtest, cap: &MsixCapability) -> Result<()> {
        let control = self.read_config_u16(qt, cap.offset + 2)?;
        self.write_config_u16(qt, cap.offset + 2, control & !MSIX_CONTROL_ENABLE)
    }

    /// Masks or unmasks one vector through its vector control word. Unmasking a vector whose
    /// pending bit is set makes the device send the message.
    pub fn set_msix_vector_masked(
        &self,
        qt: &mut Qtest,
        cap: &MsixCapability,
        bars: &Bars,
        vector: u16,
        masked: bool,
    ) -> Result<()> {
        let entry = self.msix_entry_address(cap, bars, vector)?;
        let control = if masked { MSIX_VECTOR_MASKED } else { 0 };
        Ok(qt.writel(entry + 12, control)?)
    }

    /// Reads a vector's bit in the pending bit array.
    pub fn msix_pending(
        &self,
        qt: &mut Qtest,
        cap: &MsixCapability,
        bars: &Bars,
        vector: u16,
    ) -> Result<bool> {
        // Validates the vector against the table size.
        self.msix_entry_address(cap, bars, vector)?;
        let pba = bars.memory_address(cap.pba_bar)? + u64::from(cap.pba_offset);
        let qword = qt.readq(pba + 8 * u64::from(vector / 64))?;
        Ok(qword >> (vector % 64) & 1 == 1)
    }
}

/// A BAR dword before and after writing all-ones.
struct BarProbe {
    original: u32,
    sized: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_address_layout() {
        let addr = PciAddress::new(1, 2, 3);
        assert_eq!(addr.config_address(0x37), 0x8001_1334);
        assert_eq!(addr.to_string(), "01:02.3");
    }

    #[test]
    fn allocator_aligns_and_bounds() {
        let mut alloc = PciAllocator::new();
        let mem = BarKind::Memory32 {
            prefetchable: false,
        };
        assert_eq!(alloc.alloc(mem, 0x1000).unwrap(), 0xe000_0000);
        assert_eq!(alloc.alloc(mem, 0x4000).unwrap(), 0xe000_4000);
        assert_eq!(alloc.alloc(BarKind::Io, 0x40).unwrap(), 0xc000);
        assert_eq!(alloc.alloc(BarKind::Io, 0x100).unwrap(), 0xc100);
        assert!(matches!(
            alloc.alloc(mem, 0x4000_0000),
            Err(PciError::WindowExhausted { .. })
        ));
    }
}
