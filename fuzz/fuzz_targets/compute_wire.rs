//! A guest driver's compute connection: the bytes are a stream of length-prefixed messages
//! as `libcuda.so.1` sends them, each decoded by `wire::Request::decode` and executed by
//! `remote::dispatch` on a small CPU backend (kernels get a small instruction budget), the way
//! `vgpu-cuda-host` serves a socket. Nothing may panic, allocate past the limits or loop
//! without bound; a malformed message ends the stream as it ends a connection.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mdev_backend::compute::remote::{Owned, Stats, dispatch};
use mdev_backend::compute::wire::{self, Reply, Request};
use mdev_backend::compute::{CpuBackend, CpuConfig};

/// Messages served per input.
const MAX_MESSAGES: usize = 64;

fuzz_target!(|data: &[u8]| {
    let config = CpuConfig {
        memory_per_context: 1 << 20,
        instruction_budget: 20_000,
        threads: 1,
        ..CpuConfig::default()
    };
    let mut be = CpuBackend::new(config);
    let (mut owned, mut stats) = (Owned::default(), Stats::default());
    let mut rest = data;
    for _ in 0..MAX_MESSAGES {
        let Some((header, tail)) = rest.split_first_chunk::<4>() else { break };
        let Ok(len) = wire::body_len(*header) else { break };
        let Some((body, tail)) = tail.split_at_checked(len) else { break };
        rest = tail;
        let Ok(req) = Request::decode(body) else { break };
        let reply = dispatch(&mut be, &mut owned, &mut stats, req);
        // What goes back to the guest must encode and decode to itself.
        let bytes = reply.encode();
        assert_eq!(Reply::decode(&bytes[4..]).as_ref(), Ok(&reply));
    }
    owned.release(&mut be);
});
