//! The device's queue walking over guest memory the fuzzer writes: descriptor tables, available
//! rings (indices, heads out of range, loops, indirect and chained descriptors of any length
//! and address) and the requests they point at, on the control and the cursor queue, with any
//! feature set the device offers. Nothing may panic; one kick completes at most a ring's worth of
//! requests (the guest cannot add entries while the device walks the ring).
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::os::unix::fs::FileExt;
use vgpu_fuzz::{GuestDevice, Input, QUEUE_SIZE, ring_addrs};
use vgpu_server::metrics::get;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mut dev = GuestDevice::new();
    let features = input.u64() & dev.device.gpu().features();
    dev.driver_ok(features);
    while !input.is_empty() {
        let op = input.u8();
        match op % 4 {
            0 | 1 => {
                // Guest RAM writes: a ring, a descriptor table or a request.
                let addr = u64::from(input.u16());
                dev.write_ram(addr, input.chunk());
            }
            2 => {
                // The guest publishes `n` more available entries on queue `q`.
                let q = u16::from(op >> 7);
                let (_, avail, _) = ring_addrs(q);
                let mut idx = [0u8; 2];
                dev.ram
                    .read_exact_at(&mut idx, avail + 2)
                    .expect("reading avail idx");
                let next = u16::from_le_bytes(idx).wrapping_add(u16::from(input.u8() % 4));
                dev.write_ram(avail + 2, &next.to_le_bytes());
            }
            _ => {
                let q = u16::from(op >> 7);
                let completed = |dev: &GuestDevice| {
                    get(&dev.metrics.ctrl_requests) + get(&dev.metrics.cursor_requests)
                };
                let before = completed(&dev);
                let _ = dev.device.process_queue(q, None);
                let added = completed(&dev) - before;
                assert!(
                    added <= u64::from(QUEUE_SIZE),
                    "one kick completed {added} requests on a ring of {QUEUE_SIZE}"
                );
            }
        }
    }
});
