//! Guest memory as the vfio-user client shares it: DMA_MAP/DMA_UNMAP build a `vm-memory`
//! [`GuestMemoryMmap`] from the file descriptors QEMU passes (the guest's shared memfd RAM).
//!
//! The map is published through [`GuestMemoryAtomic`], so the worker thread walks queues over a
//! consistent snapshot while the message loop remaps. A snapshot keeps its mappings alive until
//! it is dropped, so an unmap never pulls memory out from under a running walk.

use std::fs::File;
use std::sync::Arc;

use log::debug;

use crate::fds;
use vm_memory::mmap::MmapRegion;
use vm_memory::{
    FileOffset, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend,
    GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap,
};

/// Most DMA regions one client may map. QEMU maps one region per guest RAM section (a q35 guest
/// has a handful, plus one per memory DIMM); the bound keeps a hostile client from exhausting
/// the server's mappings and file descriptors.
pub const MAX_DMA_REGIONS: usize = 256;
/// Most bytes of guest memory one client may map in all (1 TiB, above any VM we host).
pub const MAX_MAPPED_BYTES: u64 = 1 << 40;

/// Errors of DMA mapping; each is answered to QEMU with an error reply.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// Zero size or an end address past 2^64.
    #[error("DMA range {addr:#x}+{size:#x} is empty or wraps")]
    BadRange {
        /// Guest address.
        addr: u64,
        /// Size in bytes.
        size: u64,
    },
    /// Too many regions or bytes mapped.
    #[error(
        "DMA map of {size:#x} bytes at {addr:#x} exceeds the limits ({MAX_DMA_REGIONS} regions, {MAX_MAPPED_BYTES:#x} bytes)"
    )]
    TooMuch {
        /// Guest address.
        addr: u64,
        /// Size in bytes.
        size: u64,
    },
    /// The file is smaller than the mapping: touching the tail would raise SIGBUS.
    #[error(
        "DMA map past the end of its file: offset {offset:#x} + size {size:#x} > file size {file_size:#x}"
    )]
    PastEof {
        /// Offset into the file.
        offset: u64,
        /// Size in bytes.
        size: u64,
        /// File size.
        file_size: u64,
    },
    /// fstat or mmap failed.
    #[error("mapping DMA region at {addr:#x}: {source}")]
    Map {
        /// Guest address.
        addr: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The descriptor is not a regular file (QEMU's RAM is a memfd, shared memory or a file).
    #[error("DMA map at {addr:#x}: the descriptor is not a regular file")]
    NotAFile {
        /// Guest address.
        addr: u64,
    },
    /// A file without a shrink seal became shorter than a region mapped from it: touching the
    /// region would raise SIGBUS.
    #[error("the file behind DMA region {addr:#x} shrank to {file_size:#x} bytes, below {end:#x}")]
    Shrunk {
        /// Guest address of the region.
        addr: u64,
        /// The file's size now.
        file_size: u64,
        /// The file offset the region ends at.
        end: u64,
    },
    /// The new region overlaps an existing one.
    #[error("DMA region {addr:#x}+{size:#x} overlaps a mapped region")]
    Overlap {
        /// Guest address.
        addr: u64,
        /// Size in bytes.
        size: u64,
    },
    /// An unmap that cuts through a region.
    #[error("DMA unmap {addr:#x}+{size:#x} splits a mapped region")]
    PartialUnmap {
        /// Guest address.
        addr: u64,
        /// Size in bytes.
        size: u64,
    },
}

/// A mapped region whose file carries no shrink seal, so its size is checked before use.
#[derive(Debug)]
struct Unsealed {
    /// Guest address of the region.
    addr: u64,
    /// The file (the mapping holds its own reference as well).
    file: File,
    /// The file offset the region ends at.
    end: u64,
}

/// Guest memory of one client connection.
#[derive(Debug)]
pub struct GuestRam {
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    /// Ranges mapped without a usable fd (ROM, PAM, read-only): known, but not accessible.
    unbacked: Vec<(u64, u64)>,
    /// Regions from files that could shrink under the mapping.
    unsealed: Vec<Unsealed>,
    mapped_bytes: u64,
}

impl Default for GuestRam {
    fn default() -> Self {
        Self::new()
    }
}

impl GuestRam {
    /// An empty map.
    pub fn new() -> Self {
        GuestRam {
            mem: GuestMemoryAtomic::new(GuestMemoryMmap::new()),
            unbacked: Vec::new(),
            unsealed: Vec::new(),
            mapped_bytes: 0,
        }
    }

    /// Checks that no file behind a mapped region has shrunk below it; called before the
    /// device touches guest memory (a queue walk, a completion), so a client that truncates its
    /// RAM file gets a device needing reset instead of a SIGBUS. Files sealed against
    /// shrinking (QEMU's memfd default) need no check. A truncation between this check and the
    /// access still raises SIGBUS, which ends only this VM's device process.
    pub fn check_backing(&self) -> Result<(), MemoryError> {
        for u in &self.unsealed {
            let file_size = u
                .file
                .metadata()
                .map_err(|source| MemoryError::Map {
                    addr: u.addr,
                    source,
                })?
                .len();
            if file_size < u.end {
                return Err(MemoryError::Shrunk {
                    addr: u.addr,
                    file_size,
                    end: u.end,
                });
            }
        }
        Ok(())
    }

    /// A handle to the published memory, for the worker thread.
    pub fn atomic(&self) -> GuestMemoryAtomic<GuestMemoryMmap> {
        self.mem.clone()
    }

    /// Number of regions mapped (with and without backing).
    pub fn region_count(&self) -> usize {
        self.mem.memory().num_regions() + self.unbacked.len()
    }

    /// Handles DMA_MAP. Only readable and writable ranges with an fd become accessible guest
    /// memory; others are recorded so their unmap is accepted.
    pub fn map(
        &mut self,
        addr: u64,
        size: u64,
        file: Option<File>,
        offset: u64,
        writable: bool,
    ) -> Result<(), MemoryError> {
        let end = addr.checked_add(size).filter(|_| size > 0);
        if end.is_none() {
            return Err(MemoryError::BadRange { addr, size });
        }
        let total = self
            .mapped_bytes
            .checked_add(size)
            .filter(|&t| t <= MAX_MAPPED_BYTES);
        if self.region_count() >= MAX_DMA_REGIONS || total.is_none() {
            return Err(MemoryError::TooMuch { addr, size });
        }
        let overlaps =
            |(a, s): (u64, u64)| addr < a.saturating_add(s) && a < addr.saturating_add(size);
        let guard = self.mem.memory();
        if guard.iter().any(|r| overlaps((r.start_addr().0, r.len())))
            || self.unbacked.iter().any(|&r| overlaps(r))
        {
            return Err(MemoryError::Overlap { addr, size });
        }
        drop(guard);
        let Some(file) = file.filter(|_| writable) else {
            debug!("DMA map {addr:#x}+{size:#x} without writable backing; not accessible");
            self.unbacked.push((addr, size));
            return Ok(());
        };
        let meta = file
            .metadata()
            .map_err(|source| MemoryError::Map { addr, source })?;
        if !meta.file_type().is_file() {
            return Err(MemoryError::NotAFile { addr });
        }
        let file_size = meta.len();
        let Some(end) = offset.checked_add(size).filter(|&e| e <= file_size) else {
            return Err(MemoryError::PastEof {
                offset,
                size,
                file_size,
            });
        };
        let unsealed = if fds::cannot_shrink(&file) {
            None
        } else {
            let file = file
                .try_clone()
                .map_err(|source| MemoryError::Map { addr, source })?;
            Some(Unsealed { addr, file, end })
        };
        let len = usize::try_from(size).map_err(|_| MemoryError::BadRange { addr, size })?;
        let mapping = MmapRegion::from_file(FileOffset::new(file, offset), len).map_err(|e| {
            MemoryError::Map {
                addr,
                source: std::io::Error::other(e),
            }
        })?;
        let region = GuestRegionMmap::new(mapping, GuestAddress(addr))
            .ok_or(MemoryError::BadRange { addr, size })?;
        let guard = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        let next = self
            .mem
            .memory()
            .insert_region(Arc::new(region))
            .map_err(|_| MemoryError::Overlap { addr, size })?;
        guard.replace(next);
        self.mapped_bytes += size;
        self.unsealed.extend(unsealed);
        debug!("DMA map {addr:#x}+{size:#x} (file offset {offset:#x})");
        Ok(())
    }

    /// Handles DMA_UNMAP: removes every region inside `[addr, addr + size)`; a range that cuts a
    /// region is refused.
    pub fn unmap(&mut self, addr: u64, size: u64) -> Result<(), MemoryError> {
        let end = addr
            .checked_add(size)
            .ok_or(MemoryError::BadRange { addr, size })?;
        let inside = |a: u64, s: u64| a >= addr && a.saturating_add(s) <= end;
        let cuts = |a: u64, s: u64| !inside(a, s) && a < end && addr < a.saturating_add(s);
        let snapshot = self.mem.memory();
        let backed: Vec<(u64, u64)> = snapshot
            .iter()
            .map(|r| (r.start_addr().0, r.len()))
            .collect();
        drop(snapshot);
        if backed
            .iter()
            .chain(&self.unbacked)
            .any(|&(a, s)| cuts(a, s))
        {
            return Err(MemoryError::PartialUnmap { addr, size });
        }
        self.unbacked.retain(|&(a, s)| !inside(a, s));
        self.unsealed.retain(|u| !inside(u.addr, 1));
        let mut current: GuestMemoryMmap = (*self.mem.memory()).clone();
        for (a, s) in backed.into_iter().filter(|&(a, s)| inside(a, s)) {
            if let Ok((next, _)) = current.remove_region(GuestAddress(a), s) {
                current = next;
                self.mapped_bytes -= s;
            }
        }
        let guard = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        guard.replace(current);
        debug!("DMA unmap {addr:#x}+{size:#x}");
        Ok(())
    }

    /// Drops every mapping (DMA_UNMAP with the ALL flag, or a disconnect).
    pub fn clear(&mut self) {
        let guard = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        guard.replace(GuestMemoryMmap::new());
        self.unbacked.clear();
        self.unsealed.clear();
        self.mapped_bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    fn file(size: u64) -> File {
        let f = vmm_sys_util::tempfile::TempFile::new().unwrap().into_file();
        f.set_len(size).unwrap();
        f
    }

    #[test]
    fn map_read_write_unmap() {
        let mut ram = GuestRam::new();
        ram.map(0x10_0000, 0x1_0000, Some(file(0x2_0000)), 0x1_0000, true)
            .unwrap();
        let mem = ram.atomic().memory();
        mem.write_obj(0xdead_beefu32, GuestAddress(0x10_0010))
            .unwrap();
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(0x10_0010)).unwrap(),
            0xdead_beef
        );
        assert!(!mem.check_range(GuestAddress(0x10_fff0), 0x20));
        ram.unmap(0x10_0000, 0x1_0000).unwrap();
        assert_eq!(ram.atomic().memory().num_regions(), 0);
        // The old snapshot still works: mappings live as long as a walk holds them.
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(0x10_0010)).unwrap(),
            0xdead_beef
        );
    }

    #[test]
    fn refuses_bad_maps() {
        let mut ram = GuestRam::new();
        assert!(matches!(
            ram.map(0, 0, Some(file(4096)), 0, true),
            Err(MemoryError::BadRange { .. })
        ));
        assert!(matches!(
            ram.map(u64::MAX - 10, 4096, Some(file(4096)), 0, true),
            Err(MemoryError::BadRange { .. })
        ));
        assert!(matches!(
            ram.map(0, 0x2000, Some(file(0x1000)), 0, true),
            Err(MemoryError::PastEof { .. })
        ));
        assert!(matches!(
            ram.map(0, 0x1000, Some(file(0x1000)), u64::MAX, true),
            Err(MemoryError::PastEof { .. })
        ));
        ram.map(0, 0x2000, Some(file(0x2000)), 0, true).unwrap();
        assert!(matches!(
            ram.map(0x1000, 0x2000, Some(file(0x4000)), 0, true),
            Err(MemoryError::Overlap { .. })
        ));
        assert!(matches!(
            ram.unmap(0x1000, 0x1000),
            Err(MemoryError::PartialUnmap { .. })
        ));
        assert!(matches!(
            ram.map(0, 1 << 41, None, 0, true),
            Err(MemoryError::TooMuch { .. })
        ));
    }

    #[test]
    fn unbacked_ranges_are_tracked_but_inaccessible() {
        let mut ram = GuestRam::new();
        ram.map(0xc0000, 0x20000, None, 0, true).unwrap();
        ram.map(0xe0000, 0x20000, Some(file(0x20000)), 0, false)
            .unwrap();
        assert_eq!(ram.region_count(), 2);
        assert!(!ram.atomic().memory().check_range(GuestAddress(0xc0000), 4));
        ram.unmap(0xc0000, 0x40000).unwrap();
        assert_eq!(ram.region_count(), 0);
    }

    #[test]
    fn region_limit() {
        let mut ram = GuestRam::new();
        for i in 0..MAX_DMA_REGIONS as u64 {
            ram.map(i * 0x1000, 0x1000, None, 0, true).unwrap();
        }
        assert!(matches!(
            ram.map(1 << 32, 0x1000, None, 0, true),
            Err(MemoryError::TooMuch { .. })
        ));
        ram.clear();
        assert_eq!(ram.region_count(), 0);
    }

    #[test]
    fn only_regular_files_are_mapped() {
        let mut ram = GuestRam::new();
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let sock = File::from(std::os::fd::OwnedFd::from(a));
        assert!(matches!(
            ram.map(0, 0x1000, Some(sock), 0, true),
            Err(MemoryError::NotAFile { addr: 0 })
        ));
        assert_eq!(ram.region_count(), 0);
    }

    #[test]
    fn a_shrunk_unsealed_file_is_detected() {
        let mut ram = GuestRam::new();
        let f = file(0x4000);
        ram.map(
            0x10_0000,
            0x2000,
            Some(f.try_clone().unwrap()),
            0x2000,
            true,
        )
        .unwrap();
        ram.check_backing().unwrap();
        f.set_len(0x3000).unwrap();
        assert!(matches!(
            ram.check_backing(),
            Err(MemoryError::Shrunk {
                addr: 0x10_0000,
                file_size: 0x3000,
                end: 0x4000
            })
        ));
        // Unmapped, the region no longer matters.
        ram.unmap(0x10_0000, 0x2000).unwrap();
        ram.check_backing().unwrap();
    }

    #[test]
    fn sealed_files_need_no_check() {
        let mut ram = GuestRam::new();
        let memfd = File::from(
            rustix::fs::memfd_create("ram", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap(),
        );
        memfd.set_len(0x2000).unwrap();
        rustix::fs::fcntl_add_seals(&memfd, rustix::fs::SealFlags::SHRINK).unwrap();
        ram.map(0, 0x2000, Some(memfd), 0, true).unwrap();
        assert!(ram.unsealed.is_empty());
    }
}
