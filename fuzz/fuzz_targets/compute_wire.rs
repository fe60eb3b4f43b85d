//! A guest driver's compute connection: the bytes are a stream of length-prefixed messages
//! as `libcuda.so.1` sends them, each decoded by `wire::Request::decode` and executed by
//! `remote::dispatch` on a small CPU backend (kernels get a small instruction budget, the
//! VM's memory budget is [`BUDGET_BYTES`]), the way `vgpu-cuda-host` serves a socket.
//! Nothing may panic, allocate past the limits or loop without bound; a malformed message
//! ends the stream as it ends a connection.
//!
//! The first byte picks the mode: even, the rest is the stream itself; odd, the rest is a
//! stream of set-up messages followed by one `Batch` nested as deep as the input says
//! (`vgpu_fuzz::compute::nested_batches`, read first), which must be refused without
//! recursing (docs/FUZZING.md).
#![no_main]

use libfuzzer_sys::fuzz_target;
use mdev_backend::budget::MemoryBudget;
use mdev_backend::compute::remote::{Owned, Stats, dispatch};
use mdev_backend::compute::wire::{self, Reply, Request};
use mdev_backend::compute::{CpuBackend, CpuConfig};
use vgpu_fuzz::Input;
use vgpu_fuzz::compute::nested_batches;

/// Messages served per input.
const MAX_MESSAGES: usize = 64;
/// The VM's memory budget: small, so that what a stream makes the host hold is refused
/// well before the process's RSS limit (fuzz.sh).
const BUDGET_BYTES: u64 = 64 << 20;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let stream = if input.u8().is_multiple_of(2) {
        input.rest().to_vec()
    } else {
        let nested = nested_batches(&mut input);
        let mut stream = input.rest().to_vec();
        stream.extend_from_slice(&nested);
        stream
    };
    // Served on a thread of its own with std's default stack (2 MiB, smaller than a
    // process's main thread's 8 MiB), so that a recursion that would overflow the stack of
    // whatever decodes a guest's messages overflows here too.
    let served = std::thread::scope(|s| s.spawn(|| serve(&stream)).join());
    if let Err(panic) = served {
        std::panic::resume_unwind(panic);
    }
});

/// Decodes and dispatches the messages of `stream` as a connection is served, until one is
/// malformed or [`MAX_MESSAGES`] were.
fn serve(stream: &[u8]) {
    let config = CpuConfig {
        budget: MemoryBudget::new(BUDGET_BYTES),
        memory_per_context: 1 << 20,
        instruction_budget: 20_000,
        threads: 1,
        ..CpuConfig::default()
    };
    let mut be = CpuBackend::new(config);
    let (mut owned, mut stats) = (Owned::default(), Stats::default());
    let mut rest = stream;
    for _ in 0..MAX_MESSAGES {
        let Some((header, tail)) = rest.split_first_chunk::<4>() else {
            break;
        };
        let Ok(len) = wire::body_len(*header) else {
            break;
        };
        let Some((body, tail)) = tail.split_at_checked(len) else {
            break;
        };
        rest = tail;
        let Ok(req) = Request::decode(body) else {
            break;
        };
        let reply = dispatch(&mut be, &mut owned, &mut stats, req);
        // What goes back to the guest must encode and decode to itself.
        let bytes = reply.encode();
        assert_eq!(Reply::decode(&bytes[4..]).as_ref(), Ok(&reply));
    }
    owned.release(&mut be);
}
