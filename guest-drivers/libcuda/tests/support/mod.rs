//! A CPU backend served on a Unix socket that the library in this test process connects to
//! (`VGPU_CUDA_SOCKET`): one connection, served on a thread until the process ends.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::thread::JoinHandle;

use mdev_backend::compute::remote::{Limits, serve};
use mdev_backend::compute::{CpuBackend, CpuConfig};

/// The served host: its thread and the socket's directory (removed by [`Host::close`]).
pub struct Host {
    pub thread: JoinHandle<()>,
    dir: PathBuf,
}

/// Serves a CPU backend at a fresh socket named `name` and points the library at it.
pub fn serve_cpu_backend(name: &str) -> Host {
    let dir = std::env::temp_dir().join(format!("vgpu-libcuda-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("host.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let thread = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let config = CpuConfig::default();
        let limits = Limits::new(&config.budget);
        let mut be = CpuBackend::new(config);
        // The connection's end (the process exiting) is all there is to wait for.
        let _ = serve(&mut s, &mut be, &limits);
    });
    // SAFETY: the test's own environment, set before the driver reads it (at cuInit).
    unsafe { std::env::set_var("VGPU_CUDA_SOCKET", &socket) };
    Host { thread, dir }
}

impl Host {
    /// Checks the host still serves (the library keeps its connection for the process's
    /// life) and removes the socket.
    pub fn close(self) {
        assert!(!self.thread.is_finished());
        std::fs::remove_dir_all(&self.dir).ok();
    }
}
