//! The vfio-user message stream as a client sends it: the fuzzer's bytes are written into a
//! connection to a listening vGPU server, which serves it with a fresh device through the real
//! transport (vfio-user framing, region accesses, DMA and interrupt messages without fds, the
//! worker processing the kicked queues). Nothing may panic outside the vfio-user crate's
//! message loop (whose panics `serve_one` contains to the connection); every connection ends.
#![no_main]

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use libfuzzer_sys::fuzz_target;
use vgpu_server::gpu::DisplayConfig;
use vgpu_server::{ServerConfig, VgpuServer};

/// Whether a panic inside the vfio-user crate was seen (and reported) yet.
static CONTAINED: AtomicBool = AtomicBool::new(false);

struct Listening {
    server: VgpuServer,
    socket: PathBuf,
}

impl Drop for Listening {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
    }
}

fn listen() -> Listening {
    // libFuzzer's `main` runs instead of Rust's, which would have ignored SIGPIPE as the
    // server binary does: a client gone before the last reply must be an EPIPE, not a death.
    // SAFETY: installs the "ignore" disposition; no handler code runs.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    // Panics in the vfio-user crate's message loop are caught by `serve_one` (the product
    // contains them to the connection); every other panic is a finding and aborts as usual.
    let fuzzer_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let in_crate = info
            .location()
            .is_some_and(|l| l.file().contains("vfio_user"));
        if !in_crate {
            fuzzer_hook(info);
        } else if !CONTAINED.swap(true, Ordering::Relaxed) {
            eprintln!("contained panic in the vfio-user crate (reported once): {info}");
        }
    }));
    let socket = std::env::temp_dir().join(format!("vgpu-fuzz-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let config = ServerConfig {
        socket: socket.clone(),
        display: DisplayConfig::default(),
        max_connections: None,
        dump: None,
        renderer: None,
        scheduler: None,
    };
    let server = VgpuServer::bind(config).expect("binding the server");
    Listening { server, socket }
}

thread_local! {
    static SERVER: Listening = listen();
}

fuzz_target!(|data: &[u8]| {
    SERVER.with(|l| {
        let mut client = UnixStream::connect(&l.socket).expect("connecting");
        let bytes = data.to_vec();
        let peer = std::thread::spawn(move || {
            // The server may stop reading early (a fatal message); the rest is not sent.
            let _ = client.write_all(&bytes);
            let _ = client.shutdown(Shutdown::Write);
            let mut sink = Vec::new();
            let _ = client.read_to_end(&mut sink);
        });
        l.server.serve_one().expect("serving a connection");
        peer.join().expect("client thread");
    });
});
