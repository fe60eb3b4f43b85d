//! Bump allocator for guest RAM used by the drivers (virtqueues, buffers, MSI-X mailboxes).
//!
//! Guest-physical addresses handed out are in the q35 machine's low RAM, starting at 1 MiB
//! (above the legacy VGA hole and BIOS area) so that everything is addressable with 32 bits.
//! Memory is never freed; each test VM starts with a fresh allocator.

/// First address handed out.
pub const GUEST_RAM_START: u64 = 0x10_0000;

/// RAM at or above this size makes q35 put only 2 GiB below 4 GiB (the rest goes above 4 GiB).
const Q35_SPLIT_THRESHOLD: u64 = 0xb000_0000;
/// Low RAM size of q35 when RAM is split around the PCI hole.
const Q35_LOW_RAM_WHEN_SPLIT: u64 = 0x8000_0000;

/// Errors of the guest RAM allocator.
#[derive(Debug, thiserror::Error)]
pub enum GuestRamError {
    /// The allocation does not fit in the remaining low RAM.
    #[error("out of guest RAM: {size:#x} bytes (align {align:#x}) requested, {left:#x} left")]
    Exhausted {
        /// Requested size.
        size: u64,
        /// Requested alignment.
        align: u64,
        /// Bytes left before alignment.
        left: u64,
    },
    /// The alignment is not a power of two.
    #[error("alignment {0:#x} is not a power of two")]
    BadAlignment(u64),
}

/// Hands out never-reused, aligned ranges of guest low RAM.
#[derive(Debug, Clone)]
pub struct GuestRam {
    next: u64,
    end: u64,
}

impl GuestRam {
    /// Creates an allocator for a q35 guest with `ram_bytes` of RAM.
    pub fn new(ram_bytes: u64) -> Self {
        let low_ram = if ram_bytes >= Q35_SPLIT_THRESHOLD {
            Q35_LOW_RAM_WHEN_SPLIT
        } else {
            ram_bytes
        };
        Self {
            next: GUEST_RAM_START,
            end: low_ram.max(GUEST_RAM_START),
        }
    }

    /// Allocates `size` bytes aligned to `align` (a power of two) and returns the address.
    pub fn alloc(&mut self, size: u64, align: u64) -> Result<u64, GuestRamError> {
        if !align.is_power_of_two() {
            return Err(GuestRamError::BadAlignment(align));
        }
        let exhausted = || GuestRamError::Exhausted {
            size,
            align,
            left: self.end - self.next,
        };
        let start = self
            .next
            .checked_next_multiple_of(align)
            .ok_or_else(exhausted)?;
        let end = start
            .checked_add(size)
            .filter(|&end| end <= self.end)
            .ok_or_else(exhausted)?;
        self.next = end;
        log::debug!("guest RAM: {size:#x} bytes at {start:#x}");
        Ok(start)
    }

    /// Bytes still available (ignoring alignment padding).
    pub fn remaining(&self) -> u64 {
        self.end - self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligns_and_bounds() {
        let mut ram = GuestRam::new(GUEST_RAM_START + 0x3000);
        assert_eq!(ram.alloc(3, 1).unwrap(), GUEST_RAM_START);
        assert_eq!(ram.alloc(0x10, 0x1000).unwrap(), GUEST_RAM_START + 0x1000);
        assert!(matches!(
            ram.alloc(0x2000, 8),
            Err(GuestRamError::Exhausted { .. })
        ));
        assert!(matches!(
            ram.alloc(8, 3),
            Err(GuestRamError::BadAlignment(3))
        ));
        assert_eq!(ram.remaining(), 0x1ff0);
    }

    #[test]
    fn big_q35_guests_only_use_low_ram() {
        assert_eq!(
            GuestRam::new(4 << 30).remaining(),
            0x8000_0000 - GUEST_RAM_START
        );
        assert_eq!(
            GuestRam::new(256 << 20).remaining(),
            (256 << 20) - GUEST_RAM_START
        );
    }
}
