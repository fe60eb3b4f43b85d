//! The scheduler wire protocol: any packet either fails to decode or decodes to a message that
//! encodes back to a packet decoding to the same message, and the session state machine takes
//! any decoded sequence without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_fuzz::Input;
use vgpu_schedd::proto::{self, MAX_MESSAGE_BYTES, Session};

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mut session = Session::new();
    while !input.is_empty() {
        let len = usize::from(input.u16()) % (MAX_MESSAGE_BYTES + 16);
        let packet = input.bytes(len);
        let Ok(msg) = proto::decode(packet) else {
            continue;
        };
        let mut out = Vec::new();
        proto::encode(&msg, &mut out);
        assert!(
            out.len() <= MAX_MESSAGE_BYTES,
            "encoded {} bytes",
            out.len()
        );
        assert_eq!(
            proto::decode(&out).as_ref(),
            Ok(&msg),
            "round trip of {msg:?}"
        );
        let mut again = Vec::new();
        proto::encode(&msg, &mut again);
        assert_eq!(out, again, "encoding is deterministic");
        let _ = session.receive(&msg);
    }
});
