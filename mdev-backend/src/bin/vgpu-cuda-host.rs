//! `vgpu-cuda-host`: serves guest CUDA drivers (`libcuda.so.1` of `guest-drivers/libcuda`
//! with `VGPU_CUDA_SOCKET` set) on a Unix socket, each connection on its own backend: the PTX
//! executor, or the real driver with `--backend nvcuda`. What a VM's compute context does,
//! without a VM: for tests, and for a GPU host.
//!
//!   vgpu-cuda-host --socket PATH [--backend cpu|nvcuda] [--once]
//!
//! `--once` serves one connection and exits. The socket is created mode 0600. Each connection
//! ends with a line on standard error: requests, launches, failures, bytes each way.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use mdev_backend::compute::remote::serve;
use mdev_backend::compute::{ComputeBackend, CpuBackend, CpuConfig, NvCuda};

/// Connections served at once; more are closed at accept.
const MAX_CONNECTIONS: usize = 16;

fn usage() -> ! {
    eprintln!("usage: vgpu-cuda-host --socket PATH [--backend cpu|nvcuda] [--once]");
    std::process::exit(2)
}

fn main() {
    let mut socket = None;
    let mut nvcuda = false;
    let mut once = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--socket" => socket = Some(args.next().unwrap_or_else(|| usage())),
            "--backend" => match args.next().as_deref() {
                Some("cpu") => nvcuda = false,
                Some("nvcuda") => nvcuda = true,
                _ => usage(),
            },
            "--once" => once = true,
            _ => usage(),
        }
    }
    let socket = socket.unwrap_or_else(|| usage());
    let listener = UnixListener::bind(&socket).unwrap_or_else(|e| {
        eprintln!("vgpu-cuda-host: {socket}: {e}");
        std::process::exit(1)
    });
    if let Err(e) = std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600)) {
        eprintln!("vgpu-cuda-host: {socket}: {e}");
        std::process::exit(1);
    }
    let live = Arc::new(AtomicUsize::new(0));
    for (n, conn) in listener.incoming().enumerate() {
        let mut stream = match conn {
            Ok(s) => s,
            Err(e) => {
                eprintln!("vgpu-cuda-host: accept: {e}");
                continue;
            }
        };
        if live.load(Ordering::Acquire) >= MAX_CONNECTIONS {
            eprintln!("vgpu-cuda-host: connection {n} refused: {MAX_CONNECTIONS} are served");
            continue;
        }
        let mut be: Box<dyn ComputeBackend> = if nvcuda {
            match NvCuda::new(0) {
                Ok(b) => Box::new(b),
                Err(e) => {
                    eprintln!("vgpu-cuda-host: {e}");
                    std::process::exit(1);
                }
            }
        } else {
            Box::new(CpuBackend::new(CpuConfig::default()))
        };
        live.fetch_add(1, Ordering::AcqRel);
        let live2 = Arc::clone(&live);
        let worker = std::thread::spawn(move || {
            let (stats, result) = serve(&mut stream, be.as_mut());
            live2.fetch_sub(1, Ordering::AcqRel);
            let end = match result {
                Ok(()) => "closed".to_string(),
                Err(e) => e.to_string(),
            };
            eprintln!(
                "vgpu-cuda-host: connection {n} {end}: {} requests, {} launches, {} failed, \
                 {} bytes to device, {} from device",
                stats.requests,
                stats.launches,
                stats.failed,
                stats.bytes_to_device,
                stats.bytes_from_device
            );
        });
        if once {
            let _ = worker.join();
            let _ = std::fs::remove_file(&socket);
            return;
        }
    }
}
