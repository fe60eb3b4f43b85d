//! The vfio-user message stream as a client sends it: the fuzzer's bytes are written into a
//! connection to a vGPU server serving on a background thread, which serves it with a fresh
//! device through the real path (the relay's frame checks, the vfio-user crate's message loop,
//! the transport, DMA and interrupt messages without fds, the worker processing the kicked
//! queues). Nothing may panic; every connection ends (the server closes it once the client's
//! bytes are consumed or refused).
#![no_main]

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use libfuzzer_sys::fuzz_target;
use vgpu_server::gpu::DisplayConfig;
use vgpu_server::{ServerConfig, VgpuServer};

struct Listening {
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
    let socket = std::env::temp_dir().join(format!("vgpu-fuzz-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let config = ServerConfig {
        socket: socket.clone(),
        display: DisplayConfig::default(),
        max_connections: None,
        dump: None,
        renderer: None,
        host_gl: Default::default(),
        scheduler: None,
        resource_memory: 64 << 20,
        compute: vgpu_server::gpu::compute::ComputeKind::Cpu,
        compute_request_time: mdev_backend::compute::backend::DEFAULT_REQUEST_TIME,
        ptx_engine: mdev_backend::compute::ptx::Engine::default(),
        // The fuzzer drives one stream at a time: spinning would only burn its CPU.
        busy_poll: std::time::Duration::ZERO,
    };
    let server = VgpuServer::bind(config).expect("binding the server");
    std::thread::spawn(move || server.serve().expect("serving"));
    Listening { socket }
}

thread_local! {
    static SERVER: Listening = listen();
}

fuzz_target!(|data: &[u8]| {
    SERVER.with(|l| {
        let mut client = UnixStream::connect(&l.socket).expect("connecting");
        // The server may stop reading early (a fatal message); the rest is not sent.
        let _ = client.write_all(data);
        let _ = client.shutdown(Shutdown::Write);
        // Ends when the server closes the connection.
        let mut sink = Vec::new();
        let _ = client.read_to_end(&mut sink);
    });
});
