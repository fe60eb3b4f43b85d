//! The daemon's control requests: a byte stream split into lines by the control socket's line
//! buffer, each line parsed, and the requests that touch only the daemon core carried out on
//! a daemon with a few devices connected. Nothing may panic; a line is never over the limit.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use vgpu_fuzz::Input;
use vgpu_schedd::control::{self, LineBuffer, MAX_REQUEST_BYTES, Request};
use vgpu_schedd::daemon::{Daemon, DaemonConfig, Peer};
use vgpu_schedd::proto::{self, Msg, PROTOCOL_VERSION, VmName};

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mut daemon = Daemon::new(0, DaemonConfig::default()).expect("default config");
    for (i, name) in ["vm0", "vm1"].iter().enumerate() {
        let conn = daemon.connect(0, Peer { pid: 0, uid: 0 });
        let hello = Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new(name).expect("valid name"),
            device_pid: 100 + i as u32,
            qemu_pid: 0,
        };
        let mut packet = Vec::new();
        proto::encode(&hello, &mut packet);
        daemon.receive(0, conn, &packet);
    }
    let mut lines = LineBuffer::default();
    let mut now = 0u64;
    while !input.is_empty() {
        now = now.saturating_add(u64::from(input.u16()) * 1000);
        lines.push(input.chunk());
        while let Ok(Some(line)) = lines.next_line() {
            assert!(line.len() <= MAX_REQUEST_BYTES);
            if let Ok(text) = std::str::from_utf8(&line) {
                let _ = control::parse_assignment(text);
            }
            let Ok(req) = Request::parse(&line) else {
                continue;
            };
            match req {
                Request::List {} => drop(daemon.list()),
                Request::Stats {} => drop(daemon.stats(now)),
                Request::SetPolicy { policy } => drop(daemon.set_policy(now, policy)),
                // The server refuses a VM it does not know unless the request adds it.
                Request::SetParams { vm, params, add } => {
                    if add || daemon.knows(&vm) {
                        drop(daemon.set_params(now, &vm, &params));
                    }
                }
                Request::Forget { vm } => drop(daemon.forget(&vm)),
                Request::Focus { vm } => drop(daemon.focus(now, &vm)),
                Request::Create { options, .. } => {
                    drop(options.to_args(Some(Path::new("state/vm"))));
                }
                Request::Destroy { .. } | Request::Dashboard {} => {}
            }
            daemon.timer(now);
            drop(daemon.drain());
        }
    }
});
