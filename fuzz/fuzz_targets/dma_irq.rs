//! DMA_MAP / DMA_UNMAP and SET_IRQS as a (possibly hostile) QEMU sends them: overlapping,
//! partial, past-the-file and zero-sized maps, unmaps that cut regions, and interrupt setups of
//! every index, action and data type with too many or too few eventfds, mixed with queue
//! processing over whatever memory is mapped. Nothing may panic; after DMA_UNMAP with the ALL
//! flag no request completes (there is no memory to read one from).
#![no_main]

use libfuzzer_sys::fuzz_target;
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_MASK, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK,
    VFIO_IRQ_SET_DATA_BOOL, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE,
};
use vgpu_fuzz::{GuestDevice, Input, eventfd, memfd};
use vgpu_server::metrics::get;

/// Size of the memory file the maps name.
const FILE_BYTES: u64 = 256 * 1024;

/// The SET_IRQS flags QEMU combines: one data type and one action.
const DATA: [u32; 3] = [
    VFIO_IRQ_SET_DATA_NONE,
    VFIO_IRQ_SET_DATA_BOOL,
    VFIO_IRQ_SET_DATA_EVENTFD,
];
const ACTIONS: [u32; 3] = [
    VFIO_IRQ_SET_ACTION_MASK,
    VFIO_IRQ_SET_ACTION_UNMASK,
    VFIO_IRQ_SET_ACTION_TRIGGER,
];

/// A page-granular value most of the time (so maps meet and overlap), any value otherwise.
fn pages(input: &mut Input<'_>) -> u64 {
    let raw = input.u16();
    if raw & 0x8000 == 0 {
        u64::from(raw & 0x7f) << 12
    } else {
        input.u64()
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mut dev = GuestDevice::new();
    let file = memfd();
    file.set_len(FILE_BYTES).expect("sizing");
    let features = input.u64();
    dev.driver_ok(features);
    while !input.is_empty() {
        let op = input.u8();
        match op % 6 {
            0 => {
                let (addr, size, offset) =
                    (pages(&mut input), pages(&mut input), pages(&mut input));
                let fd = (op & 0x10 == 0).then(|| file.try_clone().expect("dup"));
                let _ = dev.device.dma_map(addr, size, fd, offset, op & 0x20 == 0);
            }
            1 => {
                let (addr, size) = (pages(&mut input), pages(&mut input));
                let _ = dev.device.dma_unmap(addr, size, false);
            }
            2 => {
                let _ = dev.device.dma_unmap(0, 0, true);
                let done = get(&dev.metrics.ctrl_requests);
                let _ = dev.device.process_queue(0, None);
                assert_eq!(
                    get(&dev.metrics.ctrl_requests),
                    done,
                    "a request completed without guest memory"
                );
            }
            3 => {
                let index = u32::from(input.u8() % 6);
                let sel = input.u8();
                let mut flags = DATA[usize::from(sel % 3)] | ACTIONS[usize::from(sel / 3 % 3)];
                if sel & 0x80 != 0 {
                    flags = input.u32();
                }
                let start = u32::from(input.u8() % 4);
                let count = u32::from(input.u8() % 4);
                let fds = (0..input.u8() % 4).map(|_| eventfd()).collect();
                let _ = dev.device.set_irqs(index, flags, start, count, fds);
            }
            4 => dev.device.intx_unmasked(),
            _ => {
                let q = u16::from(input.u8() % 3);
                let addr = u64::from(input.u16());
                dev.write_ram(addr, input.chunk());
                let _ = dev.device.process_queue(q, None);
            }
        }
    }
});
