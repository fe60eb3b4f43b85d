//! PCI configuration space and the virtio-pci BAR as QEMU forwards a guest's accesses: sequences
//! of reads and writes of any offset and width (decoded as the transport decodes them), resets
//! and queue kicks in between. Nothing may panic; a device reset to 0 reads status 0.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_fuzz::{GuestDevice, Input};
use vgpu_server::device::{VirtioRegion, decode_virtio_bar};
use vgpu_server::transport::{Region, check_access};

/// Widths a guest access has (QEMU splits anything larger).
const WIDTHS: [usize; 4] = [1, 2, 4, 8];

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mut dev = GuestDevice::new();
    if input.u8() & 1 == 1 {
        let features = input.u64();
        dev.driver_ok(features);
    }
    while !input.is_empty() {
        let op = input.u8();
        let len = WIDTHS[usize::from(op >> 4) % WIDTHS.len()];
        let offset = u64::from(input.u16());
        let value = input.u64().to_le_bytes();
        let mut buf = [0u8; 8];
        match op % 6 {
            0 => {
                if let Ok(Region::Config) = check_access(Region::Config.index(), offset, len)
                    && let Some(q) = dev.device.config_write(offset, &value[..len])
                {
                    let _ = dev.device.process_queue(q, None);
                }
            }
            1 => {
                if let Ok(Region::Config) = check_access(Region::Config.index(), offset, len) {
                    dev.device.config_read(offset, &mut buf[..len]);
                }
            }
            2 => match decode_virtio_bar(offset, len) {
                Some(VirtioRegion::Notify(q)) => drop(dev.device.process_queue(q, None)),
                Some(region) => dev.device.virtio_write(region, &value[..len]),
                None => {}
            },
            3 => {
                if let Some(region) = decode_virtio_bar(offset, len) {
                    dev.device.virtio_read(region, &mut buf[..len]);
                }
            }
            4 => {
                let _ = dev.device.process_queue(offset as u16 % 3, None);
            }
            _ => {
                if offset & 1 == 0 {
                    dev.device.function_reset();
                } else {
                    dev.common(0x14, &[0]);
                }
                assert_eq!(dev.device.status(), 0, "reset leaves status 0");
            }
        }
    }
});
