//! The daemon's metrics endpoint: a request head arriving in pieces is found (or refused as
//! too large) and routed. Nothing may panic; a found head is within the limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_fuzz::Input;
use vgpu_schedd::server::{self, HttpHead, MAX_HTTP_REQUEST_BYTES};

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mut buf = Vec::new();
    while !input.is_empty() {
        let piece = input.chunk();
        match server::http_head(&mut buf, piece) {
            HttpHead::Incomplete => assert!(buf.len() < MAX_HTTP_REQUEST_BYTES),
            HttpHead::TooLarge => break,
            HttpHead::Complete(route) => {
                let _ = route;
                break;
            }
        }
    }
});
