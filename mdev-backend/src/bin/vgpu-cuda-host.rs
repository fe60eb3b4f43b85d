//! `vgpu-cuda-host`: serves guest CUDA drivers (`libcuda.so.1` of `guest-drivers/libcuda`
//! with `VGPU_CUDA_SOCKET` set) on a Unix socket, each connection on its own backend: the PTX
//! executor, or the real driver with `--backend nvcuda`. What a VM's compute context does,
//! without a VM: for tests, and for a GPU host.
//!
//!   vgpu-cuda-host --socket PATH [--backend cpu|nvcuda] [--once]
//!
//! `--once` serves one connection and exits. The socket is created mode 0600. Each connection
//! is served by a process of its own (this program again, the connection as its standard
//! input), so a fault that breaks CUDA for a process on the real driver stays with its guest,
//! and ends with a line on standard error: requests, launches, failures, bytes each way.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use mdev_backend::compute::one_guest_backend;
use mdev_backend::compute::remote::serve;

/// Connections served at once; more are closed at accept.
const MAX_CONNECTIONS: usize = 16;
/// The internal flag a connection's own process is started with: serve standard input.
const SERVE_STDIN: &str = "--serve-stdin";

fn usage() -> ! {
    eprintln!("usage: vgpu-cuda-host --socket PATH [--backend cpu|nvcuda] [--once]");
    std::process::exit(2)
}

/// Serves the connection on standard input (a Unix stream socket) to its end, then reports.
fn serve_stdin(n: &str, nvcuda: bool) -> ! {
    let fd = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .unwrap_or_else(|e| fail(&format!("connection {n}: {e}")));
    let mut stream = UnixStream::from(fd);
    let mut be = one_guest_backend(nvcuda).unwrap_or_else(|e| fail(&e.to_string()));
    let (stats, result) = serve(&mut stream, be.as_mut());
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
    std::process::exit(0)
}

fn fail(what: &str) -> ! {
    eprintln!("vgpu-cuda-host: {what}");
    std::process::exit(1)
}

fn main() {
    let mut socket = None;
    let mut nvcuda = false;
    let mut once = false;
    let mut serve_connection = None;
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
            SERVE_STDIN => serve_connection = Some(args.next().unwrap_or_else(|| usage())),
            _ => usage(),
        }
    }
    if let Some(n) = serve_connection {
        serve_stdin(&n, nvcuda);
    }
    let socket = socket.unwrap_or_else(|| usage());
    let listener = UnixListener::bind(&socket).unwrap_or_else(|e| fail(&format!("{socket}: {e}")));
    if let Err(e) = std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600)) {
        fail(&format!("{socket}: {e}"));
    }
    let me = std::env::current_exe().unwrap_or_else(|e| fail(&format!("own executable: {e}")));
    let backend = if nvcuda { "nvcuda" } else { "cpu" };
    let live = Arc::new(AtomicUsize::new(0));
    for (n, conn) in listener.incoming().enumerate() {
        let stream = match conn {
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
        // Each connection in a process of its own: a fault on the real driver breaks CUDA for
        // its whole process, and a guest's memory and kernels die with its connection.
        let child = Command::new(&me)
            .args(["--backend", backend, SERVE_STDIN, &n.to_string()])
            .stdin(Stdio::from(OwnedFd::from(stream)))
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => {
                eprintln!("vgpu-cuda-host: connection {n}: {e}");
                continue;
            }
        };
        live.fetch_add(1, Ordering::AcqRel);
        let live2 = Arc::clone(&live);
        let waiter = std::thread::spawn(move || {
            if let Ok(status) = child.wait()
                && !status.success()
            {
                eprintln!("vgpu-cuda-host: connection {n}: its process ended with {status}");
            }
            live2.fetch_sub(1, Ordering::AcqRel);
        });
        if once {
            let _ = waiter.join();
            let _ = std::fs::remove_file(&socket);
            return;
        }
    }
}
