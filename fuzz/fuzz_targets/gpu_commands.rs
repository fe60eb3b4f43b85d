//! virtio-gpu command decoding and execution without a renderer: control-queue requests
//! (2D resources, backing over guest memory, scanouts, flushes, capsets, 3D commands refused),
//! cursor-queue commands and the private load capset's command streams, in any order on one
//! device. Nothing may panic; every response encodes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_fuzz::Input;
use vgpu_server::gpu::DisplayConfig;
use vgpu_server::gpu::device::GpuDevice;
use vgpu_server::gpu::load::decode_submit;
use vgpu_server::gpu::protocol::{decode_control, decode_cursor};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest memory the backing entries may name.
const RAM_BYTES: usize = 64 * 1024;

/// Largest request the target builds: room for a backing list of a few dozen entries.
const MAX_REQUEST: usize = 2048;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mem =
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), RAM_BYTES)]).expect("guest memory");
    let mut gpu = GpuDevice::new(DisplayConfig::default(), input.u8() & 1 == 1);
    while !input.is_empty() {
        let op = input.u8();
        let len = usize::from(input.u16()) % MAX_REQUEST;
        let buf = input.bytes(len);
        match op % 4 {
            0 => match decode_control(buf) {
                Ok(mut req) => {
                    let response = gpu.execute(&mut req, &mem, None);
                    let _ = response.encode(&req.hdr);
                }
                Err((hdr, e)) => {
                    let _ = (hdr, e.response_code());
                }
            },
            1 => {
                if let Ok(cmd) = decode_cursor(buf) {
                    gpu.execute_cursor(&cmd);
                }
            }
            2 => {
                let dwords: Vec<u32> = buf
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let _ = decode_submit(&dwords);
            }
            _ => {
                let addr = u64::from(input.u16());
                let _ = mem.write_slice(buf, GuestAddress(addr));
            }
        }
    }
    gpu.reset();
    assert_eq!(gpu.resource_count(), 0, "reset leaves no resources");
});
