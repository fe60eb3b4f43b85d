//! The host-guest control channel (guest-drivers/src/control.rs), both directions, the bytes
//! arriving in pieces: what a guest's agent sends the host (lines split by `LineReader`, each
//! decoded by `GuestMsg::parse`: untrusted, the guest may be hostile) and what the host sends
//! the agent (`HostDecoder`, a `START`'s script taken by count). Invariants: nothing panics;
//! every line is shorter than `MAX_LINE` and every script at most `MAX_SCRIPT`; a decoded
//! message encodes to bytes that decode to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_fuzz::Input;
use vgpu_guest_drivers::control::{
    GuestMsg, HostDecoder, HostMsg, LineReader, MAX_LINE, MAX_SCRIPT,
};

fn host_round_trip(msg: &HostMsg) {
    let again = HostDecoder::default().push(&msg.encode());
    assert_eq!(again.len(), 1, "{msg:?}");
    assert_eq!(again[0].as_ref(), Ok(msg));
}

fn guest_round_trip(msg: &GuestMsg) {
    let wire = msg.encode();
    assert!(wire.len() <= MAX_LINE);
    assert_eq!(GuestMsg::parse(&wire[..wire.len() - 1]).as_ref(), Ok(msg));
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mut lines = LineReader::default();
    let mut host = HostDecoder::default();
    while !input.is_empty() {
        let to_host = input.u8() & 1 == 0;
        let piece = input.chunk();
        if to_host {
            for line in lines.push(piece) {
                let Ok(line) = line else { continue };
                assert!(line.len() < MAX_LINE);
                if let Ok(msg) = GuestMsg::parse(&line) {
                    guest_round_trip(&msg);
                }
            }
        } else {
            for msg in host.push(piece).into_iter().flatten() {
                if let HostMsg::Start { script, .. } = &msg {
                    assert!(script.len() <= MAX_SCRIPT);
                }
                host_round_trip(&msg);
            }
        }
    }
});
