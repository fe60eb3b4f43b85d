//! A guest without QEMU: a raw vfio-user client with a RAM file DMA-mapped as guest memory. It
//! programs the vGPU with the register writes QEMU forwards for a guest driver (posted, as QEMU
//! sends MMIO writes) and keeps one GET_DISPLAY_INFO chain ready in the control queue, so a
//! test or benchmark can submit it and watch the used ring and the interrupt eventfds directly.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::Ordering;

use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_PCI_BAR4_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_INTX_IRQ_INDEX,
};
use vgpu_guest_drivers::virtio_gpu::{CTRL_HDR_SIZE, DISPLAY_INFO_SIZE, get_display_info};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::TempDir;
use crate::vfio_user_raw::{RawClient, Result};

const CONFIG_REGION: u32 = VFIO_PCI_CONFIG_REGION_INDEX;
const BAR4: u32 = VFIO_PCI_BAR4_REGION_INDEX;
const TRIGGER_EVENTFD: u32 = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
const UNMASK_EVENTFD: u32 = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_UNMASK;

/// Guest memory size.
pub const RAM: u64 = 16 << 20;
/// Control queue size.
pub const QUEUE_SIZE: u16 = 64;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x2000;
const USED: u64 = 0x3000;
const REQUEST: u64 = 0x10000;
const RESPONSE: u64 = 0x11000;
/// Offset of the ISR byte in BAR 4.
pub const ISR: u64 = 0x1000;
const NOTIFY: u64 = 0x3000;
const STATUS: u64 = 0x14;

/// A connected raw guest with the vGPU at DRIVER_OK (control queue only).
#[derive(Debug)]
pub struct RawGuest {
    /// The vfio-user connection.
    pub client: RawClient,
    mem: GuestMemoryMmap,
    ram: std::fs::File,
    vector: u16,
    /// Device feature bits 0-31 the driver accepts (bits 32+ are VERSION_1 only).
    features_low: u32,
    submitted: u16,
    _dir: TempDir,
}

/// VIRTIO_GPU_F_VIRGL and VIRTIO_GPU_F_CONTEXT_INIT: 3D contexts and capset-typed contexts
/// (the load capset).
pub const FEATURES_3D: u32 = 1 | 1 << 4;

impl RawGuest {
    /// Connects to `socket`, maps guest RAM, enables memory and bus mastering, and brings the
    /// device up with VERSION_1 and a control queue whose control-queue vector is `vector`
    /// (0xffff for none).
    pub fn connect(socket: &Path, vector: u16) -> Result<RawGuest> {
        Self::connect_with(socket, vector, 0)
    }

    /// [`RawGuest::connect`] accepting also the device features `features_low` (bits 0-31,
    /// e.g. [`FEATURES_3D`]), which the device must offer.
    pub fn connect_with(socket: &Path, vector: u16, features_low: u32) -> Result<RawGuest> {
        let dir = TempDir::new("vgpu-raw-guest")?;
        let ram = dir.file("ram", RAM)?;
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(0),
            RAM as usize,
            Some(FileOffset::new(ram.try_clone()?, 0)),
        )])
        .map_err(std::io::Error::other)?;
        let mut client = RawClient::connect(socket)?;
        client.dma_map(&ram, 0, 0, RAM)?;
        let mut guest = RawGuest {
            client,
            mem,
            ram,
            vector,
            features_low,
            submitted: 0,
            _dir: dir,
        };
        guest.bring_up()?;
        Ok(guest)
    }

    /// Resets the device and brings it up again: VERSION_1, the control queue (vector as at
    /// [`RawGuest::connect`]), DRIVER_OK, and the GET_DISPLAY_INFO chain written afresh.
    pub fn bring_up(&mut self) -> Result<()> {
        self.client
            .region_write(CONFIG_REGION, 4, &0x6u16.to_le_bytes())?;
        self.submitted = 0;
        let zero = [0u8; 6 + 8 * QUEUE_SIZE as usize];
        for ring in [AVAIL, USED] {
            self.mem
                .write_slice(&zero, GuestAddress(ring))
                .map_err(std::io::Error::other)?;
        }
        let vector = self.vector;
        let writes: &[(u64, &[u8])] = &[
            (STATUS, &[0]),
            (STATUS, &[1]),
            (STATUS, &[3]),
            (0x08, &0u32.to_le_bytes()),
            (0x0c, &self.features_low.to_le_bytes()),
            (0x08, &1u32.to_le_bytes()),
            (0x0c, &1u32.to_le_bytes()), // VIRTIO_F_VERSION_1 (bit 32)
            (STATUS, &[0xb]),
            (0x16, &0u16.to_le_bytes()),
            (0x18, &QUEUE_SIZE.to_le_bytes()),
            (0x20, &DESC.to_le_bytes()),
            (0x28, &AVAIL.to_le_bytes()),
            (0x30, &USED.to_le_bytes()),
            (0x1a, &vector.to_le_bytes()),
            (0x1c, &1u16.to_le_bytes()),
            (STATUS, &[0xf]),
        ];
        for (offset, data) in writes {
            self.client.region_write_posted(BAR4, *offset, data)?;
        }
        let chain = [
            descriptor(REQUEST, CTRL_HDR_SIZE as u32, VRING_DESC_F_NEXT, 1),
            descriptor(RESPONSE, DISPLAY_INFO_SIZE as u32, VRING_DESC_F_WRITE, 0),
        ]
        .concat();
        self.mem
            .write_slice(&chain, GuestAddress(DESC))
            .map_err(std::io::Error::other)?;
        self.mem
            .write_slice(&get_display_info(), GuestAddress(REQUEST))
            .map_err(std::io::Error::other)?;
        Ok(())
    }

    /// The device status register.
    pub fn status(&mut self) -> Result<u8> {
        Ok(self.client.region_read(BAR4, STATUS, 1)?[0])
    }

    /// Hands `fd` to the device as the trigger eventfd of vector `start` of interrupt `index`.
    pub fn set_trigger(&mut self, index: u32, start: u32, fd: &EventFd) -> Result<()> {
        self.client
            .set_irqs(index, TRIGGER_EVENTFD, start, 1, &[fd.as_raw_fd()])
    }

    /// Hands `fd` to the device as the INTx resample (unmask) eventfd, as QEMU does under KVM.
    pub fn set_intx_resample(&mut self, fd: &EventFd) -> Result<()> {
        self.client.set_irqs(
            VFIO_PCI_INTX_IRQ_INDEX,
            UNMASK_EVENTFD,
            0,
            1,
            &[fd.as_raw_fd()],
        )
    }

    /// Publishes the GET_DISPLAY_INFO chain once more (without notifying).
    pub fn publish(&mut self) -> Result<()> {
        let slot = u64::from(self.submitted % QUEUE_SIZE);
        self.submitted = self.submitted.wrapping_add(1);
        self.mem
            .write_obj(0u16, GuestAddress(AVAIL + 4 + 2 * slot))
            .map_err(std::io::Error::other)?;
        self.mem
            .store(self.submitted, GuestAddress(AVAIL + 2), Ordering::Release)
            .map_err(std::io::Error::other)?;
        Ok(())
    }

    /// Truncates the RAM file the device mapped to `len` bytes, as a hostile QEMU could. The
    /// guest's own view of memory past `len` faults too: publish first.
    pub fn truncate_ram(&self, len: u64) -> Result<()> {
        Ok(self.ram.set_len(len)?)
    }

    /// Writes the control queue's notify register (a posted write).
    pub fn notify(&mut self) -> Result<()> {
        self.client.region_write_posted(BAR4, NOTIFY, &[0, 0])
    }

    /// Takes all of guest RAM, rings included, away from the device (DMA_UNMAP), as a hostile
    /// VMM may while chains wait.
    pub fn unmap_ram(&mut self) -> Result<()> {
        self.client.dma_unmap(0, RAM)
    }

    /// Hands guest RAM back to the device (DMA_MAP of the same file at the same address).
    pub fn map_ram(&mut self) -> Result<()> {
        self.client.dma_map(&self.ram, 0, 0, RAM)
    }

    /// Chains published so far.
    pub fn submitted(&self) -> u16 {
        self.submitted
    }

    /// Sends `request` (at most 4 KiB) with a response buffer of a control header, waits for
    /// its completion (`irq`, the control queue's vector's eventfd, up to `timeout`), and
    /// returns the response's type. The next [`RawGuest::publish`] needs a
    /// [`RawGuest::bring_up`] first (this rewrites the chain).
    pub fn call(
        &mut self,
        request: &[u8],
        irq: &EventFd,
        timeout: std::time::Duration,
    ) -> Result<u32> {
        let too_long = || std::io::Error::other("request longer than its buffer");
        if request.len() as u64 > RESPONSE - REQUEST {
            return Err(too_long().into());
        }
        let chain = [
            descriptor(REQUEST, request.len() as u32, VRING_DESC_F_NEXT, 1),
            descriptor(RESPONSE, CTRL_HDR_SIZE as u32, VRING_DESC_F_WRITE, 0),
        ]
        .concat();
        self.mem
            .write_slice(&chain, GuestAddress(DESC))
            .map_err(std::io::Error::other)?;
        self.mem
            .write_slice(request, GuestAddress(REQUEST))
            .map_err(std::io::Error::other)?;
        self.publish()?;
        self.notify()?;
        let deadline = std::time::Instant::now() + timeout;
        while self.used_idx() != self.submitted {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || wait_interrupt(irq, left)? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into());
            }
        }
        let ctrl_type: u32 = self
            .mem
            .read_obj(GuestAddress(RESPONSE))
            .map_err(std::io::Error::other)?;
        Ok(ctrl_type)
    }

    /// The used ring's index.
    pub fn used_idx(&self) -> u16 {
        self.mem
            .load(GuestAddress(USED + 2), Ordering::Acquire)
            .unwrap_or(0)
    }
}

/// A split-ring descriptor.
fn descriptor(addr: u64, len: u32, flags: u32, next: u16) -> [u8; 16] {
    let mut d = [0u8; 16];
    d[0..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&len.to_le_bytes());
    d[12..14].copy_from_slice(&(flags as u16).to_le_bytes());
    d[14..16].copy_from_slice(&next.to_le_bytes());
    d
}

/// Waits (blocking in `epoll_wait`, as QEMU's main loop waits for an irqfd) until `irq` is
/// signalled or `timeout` passes, and reads it; `Ok(0)` on a time-out. The server makes the
/// interrupt eventfds it is given non-blocking, which the client's copy shares.
pub fn wait_interrupt(irq: &EventFd, timeout: std::time::Duration) -> std::io::Result<u64> {
    use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
    let epoll = Epoll::new()?;
    epoll.ctl(
        ControlOperation::Add,
        irq.as_raw_fd(),
        EpollEvent::new(EventSet::IN, 0),
    )?;
    let mut events = [EpollEvent::default()];
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    loop {
        match epoll.wait(ms, &mut events) {
            Ok(0) => return Ok(0),
            Ok(_) => match irq.read() {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            },
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}
