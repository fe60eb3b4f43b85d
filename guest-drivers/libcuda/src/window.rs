//! Address ranges reserved in the client's process for a context's device memory: with the host
//! placing the context inside one ([`mdev_backend::compute::backend::DeviceAttributes::placement`]),
//! no device address can be a host address of the client too, which is what unified addressing
//! promises (`CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`; GCC 14's libgomp plugin requires it). The
//! reservation is inaccessible (`PROT_NONE`) and takes no memory (`MAP_NORESERVE`). The unsafe
//! code of this module is the `mmap` and `munmap` of that range.

use std::ffi::c_void;

use mdev_backend::compute::backend::{MAX_WINDOW_BYTES, WINDOW_ALIGN};

/// A reserved range, released when dropped.
#[derive(Debug)]
pub struct Window {
    map: *mut c_void,
    map_len: usize,
    base: u64,
    size: u64,
}

// SAFETY: the mapping is only ever unmapped (once, in Drop); nothing reads or writes through
// the pointer, so which thread holds the Window does not matter.
unsafe impl Send for Window {}

impl Window {
    /// Reserves `size` bytes (rounded up to [`WINDOW_ALIGN`], at most [`MAX_WINDOW_BYTES`]) at
    /// an address the kernel picks, aligned to [`WINDOW_ALIGN`].
    pub fn reserve(size: u64) -> std::io::Result<Window> {
        let size = size
            .clamp(WINDOW_ALIGN, MAX_WINDOW_BYTES)
            .next_multiple_of(WINDOW_ALIGN);
        let map_len = usize::try_from(size + WINDOW_ALIGN)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
        // SAFETY: a new anonymous, inaccessible mapping at an address the kernel chooses; no
        // existing mapping is touched and nothing is read or written through it.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = (map as u64).next_multiple_of(WINDOW_ALIGN);
        Ok(Window {
            map,
            map_len,
            base,
            size,
        })
    }

    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `reserve`, unmapped once, here.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_aligned_reserved_and_keeps_the_kernel_from_mapping_there() {
        let w = Window::reserve(3 * WINDOW_ALIGN + 1).unwrap();
        assert_eq!(w.base() % WINDOW_ALIGN, 0);
        assert_eq!(w.size(), 4 * WINDOW_ALIGN);
        // A later anonymous mapping never lands inside it.
        let others: Vec<Window> = (0..16)
            .map(|_| Window::reserve(WINDOW_ALIGN).unwrap())
            .collect();
        for o in &others {
            let (a, b) = (o.base(), o.base() + o.size());
            assert!(b <= w.base() || a >= w.base() + w.size());
        }
    }
}
