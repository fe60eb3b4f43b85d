//! Helpers shared by the fuzz targets in `fuzz_targets/` (see docs/FUZZING.md): a reader that
//! turns the fuzzer's bytes into operations, and a device brought up the way a guest driver
//! does it, over guest memory the target can write.

pub mod compute;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use vgpu_server::device::{Device, VirtioRegion};
use vgpu_server::gpu::DisplayConfig;
use vgpu_server::metrics::DeviceMetrics;

/// Reads operations out of the fuzzer's input; past its end every read yields zeros, so a
/// short input is still a whole (if dull) sequence.
#[derive(Debug)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// Reads `data` from its start.
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    /// Whether everything was read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The next `n` bytes, or what is left when fewer remain.
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        head
    }

    /// A length-prefixed slice: one byte of length (0 to 255), then that many bytes.
    pub fn chunk(&mut self) -> &'a [u8] {
        let n = usize::from(self.u8());
        self.bytes(n)
    }

    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.data.len())
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let got = self.bytes(N);
        out[..got.len()].copy_from_slice(got);
        out
    }

    /// One byte.
    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    /// A little-endian u64.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// Size of the guest RAM the device targets map: room for both rings and a few buffers.
pub const GUEST_RAM_BYTES: u64 = 64 * 1024;

/// Where the rings of queue `q` live in guest RAM (descriptor table, available ring, used ring),
/// as a driver would place them: one page per structure, queue after queue.
pub fn ring_addrs(q: u16) -> (u64, u64, u64) {
    let base = u64::from(q) * 0x3000;
    (base, base + 0x1000, base + 0x2000)
}

/// Ring size both queues are set up with.
pub const QUEUE_SIZE: u16 = 16;

/// A device and the memory file backing its guest RAM at guest address 0.
#[derive(Debug)]
pub struct GuestDevice {
    /// The device under test.
    pub device: Device,
    /// Its counters.
    pub metrics: Arc<DeviceMetrics>,
    /// The file mapped as guest RAM; writes to it are what the guest writes.
    pub ram: File,
}

impl GuestDevice {
    /// A fresh device with [`GUEST_RAM_BYTES`] of guest RAM DMA-mapped at 0, not yet set up.
    pub fn new() -> GuestDevice {
        let metrics = Arc::new(DeviceMetrics::default());
        let mut device = Device::new(DisplayConfig::default(), metrics.clone(), false);
        let ram = memfd();
        ram.set_len(GUEST_RAM_BYTES).expect("sizing guest RAM");
        device
            .dma_map(
                0,
                GUEST_RAM_BYTES,
                Some(ram.try_clone().expect("dup")),
                0,
                true,
            )
            .expect("mapping guest RAM");
        GuestDevice {
            device,
            metrics,
            ram,
        }
    }

    /// Writes `value` (1, 2, 4 or 8 bytes) to the common configuration at `offset`.
    pub fn common(&mut self, offset: u64, value: &[u8]) {
        self.device
            .virtio_write(VirtioRegion::Common(offset), value);
    }

    /// Brings the device to DRIVER_OK as a virtio 1.x driver does, with both queues of
    /// [`QUEUE_SIZE`] at [`ring_addrs`] and the features in `features` accepted (VERSION_1 is
    /// always added).
    pub fn driver_ok(&mut self, features: u64) {
        const ACK_DRIVER: u8 = 1 | 2;
        const FEATURES_OK: u8 = 8;
        const DRIVER_OK: u8 = 4;
        let features = features | (1 << 32);
        self.common(0x14, &[0]);
        self.common(0x14, &[ACK_DRIVER]);
        for (select, word) in [(0u32, features as u32), (1, (features >> 32) as u32)] {
            self.common(0x08, &select.to_le_bytes());
            self.common(0x0c, &word.to_le_bytes());
        }
        self.common(0x14, &[ACK_DRIVER | FEATURES_OK]);
        for q in 0..2u16 {
            let (desc, avail, used) = ring_addrs(q);
            self.common(0x16, &q.to_le_bytes());
            self.common(0x18, &QUEUE_SIZE.to_le_bytes());
            self.common(0x20, &desc.to_le_bytes());
            self.common(0x28, &avail.to_le_bytes());
            self.common(0x30, &used.to_le_bytes());
            self.common(0x1c, &1u16.to_le_bytes());
        }
        self.common(0x14, &[ACK_DRIVER | FEATURES_OK | DRIVER_OK]);
    }

    /// Writes `bytes` to guest RAM at `addr` (cut at the end of RAM).
    pub fn write_ram(&self, addr: u64, bytes: &[u8]) {
        let room = usize::try_from(GUEST_RAM_BYTES.saturating_sub(addr)).unwrap_or(0);
        let bytes = &bytes[..bytes.len().min(room)];
        self.ram
            .write_all_at(bytes, addr)
            .expect("writing guest RAM");
    }
}

impl Default for GuestDevice {
    fn default() -> Self {
        GuestDevice::new()
    }
}

/// An anonymous memory file, as QEMU hands guest RAM over.
pub fn memfd() -> File {
    use std::os::fd::FromRawFd;
    // SAFETY: the name is a NUL-terminated literal; the call has no other inputs.
    let fd = unsafe { libc::memfd_create(c"vgpu-fuzz".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and is owned by nobody else.
    unsafe { File::from_raw_fd(fd) }
}

/// An eventfd as a `File`, as QEMU hands interrupt fds over.
pub fn eventfd() -> File {
    use std::os::fd::FromRawFd;
    // SAFETY: plain system call without pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and is owned by nobody else.
    unsafe { File::from_raw_fd(fd) }
}
