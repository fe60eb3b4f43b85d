//! The daemon's HTTP listener (metrics and dashboard): a request arriving in pieces is parsed
//! (head with httparse, body by its Content-Length), refused or completed, then routed and
//! checked against the listener's access rules. Nothing may panic; the buffer stays within
//! the limits; a complete request's body is within its limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_fuzz::Input;
use vgpu_schedd::http::{self, Access, MAX_HTTP_BODY_BYTES, MAX_HTTP_HEAD_BYTES, Received};

fuzz_target!(|data: &[u8]| {
    let access = Access {
        addr: "127.0.0.1:9100".parse().expect("address"),
        token: "0123456789abcdef".into(),
    };
    let mut input = Input::new(data);
    let mut buf = Vec::new();
    while !input.is_empty() {
        let piece = input.chunk();
        let state = http::receive(&mut buf, piece);
        assert!(buf.len() <= MAX_HTTP_HEAD_BYTES + MAX_HTTP_BODY_BYTES);
        match state {
            Received::Incomplete => {}
            Received::Refused(e) => {
                let _ = e.answer();
                break;
            }
            Received::Complete(req) => {
                assert!(req.body.len() <= MAX_HTTP_BODY_BYTES);
                if let Ok(route) = access.check(&req) {
                    // Only a request with the token may change the scheduler.
                    assert!(!route.changes_state() || req.token.as_deref() == Some(&access.token));
                }
                break;
            }
        }
    }
});
