//! `vgpu-cuda-host`: serves guest CUDA drivers (`libcuda.so.1` of `guest-drivers/libcuda`
//! with `VGPU_CUDA_SOCKET` set) on a Unix socket, each connection on its own backend: the PTX
//! executor, or the real driver with `--backend nvcuda`. What a VM's compute context does,
//! without a VM: for tests, and for a GPU host.
//!
//!   vgpu-cuda-host --socket PATH [--backend cpu|nvcuda] [--once] [--request-time S]
//!                  [--memory-budget MIB]   (see --help)
//!
//! `--once` serves one connection and exits. The socket is bound in a private directory (mode
//! 0700), made mode 0600 there and only then moved to its path, so under any umask no other
//! user can reach it, even for a moment; and each connection's peer is checked
//! (`SO_PEERCRED`): only the server's own user and those named with `--allow-uid` are served.
//! Each connection is served by a process of its own (this program again, the connection as its standard
//! input), so a fault that breaks CUDA for a process on the real driver stays with its guest,
//! and ends with a line on standard error: requests, launches, failures, bytes each way. A
//! client may share a memory region for its copies (`compute::shm`), charged to the
//! connection's `--memory-budget`.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use clap::Parser;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use mdev_backend::budget::MemoryBudget;
use mdev_backend::compute::backend::parse_request_time;
use mdev_backend::compute::cpu::DEFAULT_MEMORY_BUDGET_BYTES;
use mdev_backend::compute::ptx::Engine;
use mdev_backend::compute::remote::{Limits, serve};
use mdev_backend::compute::{CpuConfig, one_guest_backend};

/// Connections served at once; more are closed at accept.
const MAX_CONNECTIONS: usize = 16;
/// The internal option a connection's own process is started with (`--serve-stdin N`): serve
/// standard input.
const SERVE_STDIN: &str = "serve-stdin";
/// The socket's mode: its user only (the peer check then refuses any other user who reaches
/// it through a mode changed later).
const SOCKET_MODE: u32 = 0o600;
/// The mode of the private directory the socket is bound in before it is moved to its path.
const BIND_DIR_MODE: u32 = 0o700;
/// Largest `--memory-budget` (MiB): 1 TiB, as `vgpu-server --resource-memory-mb` allows.
const MAX_MEMORY_BUDGET_MIB: u64 = 1 << 20;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "vgpu-cuda-host",
    version,
    about = "Serves guest CUDA drivers on a Unix socket, each connection in a process of its own",
    long_about = "Serves guest CUDA drivers (our libcuda.so.1 with VGPU_CUDA_SOCKET set) on a \
        Unix socket (mode 0600, and only the server's user or those of --allow-uid are \
        served), each connection on its own backend in a process of its own: \
        the PTX executor on the host's CPUs, or NVIDIA's driver with --backend nvcuda. Each \
        connection ends with a line on standard error: requests, launches, failures, bytes \
        each way.",
    after_long_help = "EXAMPLES
  vgpu-cuda-host --socket /run/vgpu-cuda/host.sock
  VGPU_CUDA_SOCKET=/run/vgpu-cuda/host.sock ./vectorAdd

FILES
  The socket given with --socket, mode 0600.

SEE ALSO
vgpu-server(1); docs/CUDA-GUEST.md and docs/PTX.md in the source tree."
)]
struct Cli {
    /// The socket to listen on (it must not exist)
    #[arg(long, value_name = "PATH", required_unless_present = "serve_stdin")]
    socket: Option<PathBuf>,
    /// The backend of every connection
    #[arg(
        long,
        action = clap::ArgAction::Set,
        value_name = "BACKEND",
        default_value = "cpu",
        value_parser = PossibleValuesParser::new(["cpu", "nvcuda"]).map(|b| b == "nvcuda"),
    )]
    backend: bool,
    /// Serve one connection, then exit
    #[arg(long)]
    once: bool,
    /// Also serve connections of this user id (repeatable; the server's own user is always
    /// served, any other is refused)
    #[arg(long = "allow-uid", value_name = "UID")]
    allow_uid: Vec<u32>,
    /// Longest one request of a connection may run, in seconds (at most 3600): past it its
    /// kernel stops with CUDA_ERROR_LAUNCH_TIMEOUT (the PTX executor's watchdog; default 1.5)
    #[arg(
        long,
        value_name = "SECONDS",
        default_value = "1.5",
        value_parser = parse_request_time
    )]
    request_time: std::time::Duration,
    /// What runs each connection's kernels on the PTX executor: compiled native code (the
    /// interpreter still runs what the compiler refuses), or the interpreter alone (the
    /// reference)
    #[arg(
        long,
        value_name = "ENGINE",
        default_value = "compiled",
        value_parser = PossibleValuesParser::new(["compiled", "interpreter"])
            .try_map(|e| e.parse::<Engine>()),
    )]
    ptx_engine: Engine,
    /// Log level on standard error (RUST_LOG refines it): warn names a connection's first
    /// failures, info also the kernels the compiler leaves to the interpreter and why
    #[arg(
        long,
        value_name = "LEVEL",
        default_value = "warn",
        value_parser = vgpu_cli::log_level(),
        ignore_case = true,
    )]
    log_level: log::LevelFilter,
    /// Host memory each connection may make the server hold, in MiB: device memory, modules
    /// and the contexts' tables (past it, CUDA_ERROR_OUT_OF_MEMORY)
    #[arg(
        long,
        value_name = "MIB",
        default_value_t = DEFAULT_MEMORY_BUDGET_BYTES >> 20,
        value_parser = clap::value_parser!(u64).range(1..=MAX_MEMORY_BUDGET_MIB),
    )]
    memory_budget: u64,
    /// Internal: serve connection N on standard input (how each connection's process starts)
    #[arg(
        long = SERVE_STDIN,
        value_name = "N",
        hide = true,
        conflicts_with_all = ["socket", "once", "allow_uid"]
    )]
    serve_stdin: Option<usize>,
}

/// Serves the connection on standard input (a Unix stream socket) to its end, then reports.
fn serve_stdin(n: usize, nvcuda: bool, config: CpuConfig) -> ! {
    let fd = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .unwrap_or_else(|e| fail(&format!("connection {n}: {e}")));
    let mut stream = UnixStream::from(fd);
    // A region the guest shares for its copies is charged with its device memory.
    let limits = Limits::new(&config.budget);
    let mut be = one_guest_backend(nvcuda, config).unwrap_or_else(|e| fail(&e.to_string()));
    let (stats, result) = serve(&mut stream, be.as_mut(), &limits);
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

/// Listens on `socket` (which must not exist) with mode [`SOCKET_MODE`] from the moment it
/// exists: bound in a private directory beside it, made [`SOCKET_MODE`] there, then renamed to
/// its path without replacing anything. A socket bound at its path takes the umask's mode until
/// a chmod (under umask 000, user nobody connected in between).
fn listen(socket: &Path) -> Result<UnixListener, String> {
    let shown = socket.display();
    let name = socket
        .file_name()
        .ok_or_else(|| format!("{shown}: not a file name"))?;
    let parent = match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut hidden = std::ffi::OsString::from(".");
    hidden.push(name);
    hidden.push(format!(".{}", std::process::id()));
    let private = parent.join(hidden);
    std::fs::DirBuilder::new()
        .mode(BIND_DIR_MODE)
        .create(&private)
        .map_err(|e| format!("{}: {e}", private.display()))?;
    let bound = private.join("socket");
    let listener = UnixListener::bind(&bound)
        .and_then(|l| {
            std::fs::set_permissions(&bound, std::fs::Permissions::from_mode(SOCKET_MODE))?;
            rustix::fs::renameat_with(
                rustix::fs::CWD,
                &bound,
                rustix::fs::CWD,
                socket,
                rustix::fs::RenameFlags::NOREPLACE,
            )?;
            Ok(l)
        })
        .map_err(|e| format!("{shown}: {e}"));
    // Empty once the socket moved; on a failure it goes with its bound socket.
    let _ = std::fs::remove_file(&bound);
    if let Err(e) = std::fs::remove_dir(&private) {
        eprintln!("vgpu-cuda-host: {}: {e}", private.display());
    }
    listener
}

/// The user id of the process that connected `stream` (`SO_PEERCRED`).
fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    Ok(rustix::net::sockopt::socket_peercred(stream)?.uid.as_raw())
}

fn main() {
    let cli: Cli = vgpu_cli::parse();
    mdev_backend::logger(cli.log_level).init();
    let nvcuda = cli.backend;
    if let Some(n) = cli.serve_stdin {
        serve_stdin(n, nvcuda, connection_config(&cli));
    }
    // clap requires --socket without --serve-stdin.
    let Some(socket) = cli.socket else {
        fail("--socket is required")
    };
    let listener = listen(&socket).unwrap_or_else(|e| fail(&e));
    let mut allowed = cli.allow_uid;
    allowed.push(rustix::process::getuid().as_raw());
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
        match peer_uid(&stream) {
            Ok(uid) if allowed.contains(&uid) => {}
            Ok(uid) => {
                eprintln!("vgpu-cuda-host: connection {n} refused: user {uid} is not allowed");
                continue;
            }
            Err(e) => {
                eprintln!("vgpu-cuda-host: connection {n} refused: its peer's user: {e}");
                continue;
            }
        }
        if live.load(Ordering::Acquire) >= MAX_CONNECTIONS {
            eprintln!("vgpu-cuda-host: connection {n} refused: {MAX_CONNECTIONS} are served");
            continue;
        }
        // Each connection in a process of its own: a fault on the real driver breaks CUDA for
        // its whole process, and a guest's memory and kernels die with its connection.
        let child = Command::new(&me)
            .args(["--backend", backend])
            .arg(format!("--request-time={}", cli.request_time.as_secs_f64()))
            .arg(format!("--memory-budget={}", cli.memory_budget))
            .arg(format!("--ptx-engine={}", engine_name(cli.ptx_engine)))
            .arg(format!("--log-level={}", cli.log_level))
            .arg(format!("--{SERVE_STDIN}"))
            .arg(n.to_string())
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
        if cli.once {
            let _ = waiter.join();
            let _ = std::fs::remove_file(&socket);
            return;
        }
    }
}

/// `--ptx-engine`'s name of `engine`, as a connection's process is given it.
fn engine_name(engine: Engine) -> &'static str {
    match engine {
        Engine::Interpreter => "interpreter",
        Engine::Compiled => "compiled",
    }
}

/// The backend configuration of each connection: its budget, request time and engine.
fn connection_config(cli: &Cli) -> CpuConfig {
    let budget = cli.memory_budget << 20;
    CpuConfig {
        budget: MemoryBudget::new(budget),
        memory_per_context: budget,
        engine: cli.ptx_engine,
        ..CpuConfig::default()
    }
    .with_request_time(cli.request_time)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;
    use mdev_backend::compute::backend::DEFAULT_REQUEST_TIME;

    fn parse(line: &[&str]) -> Result<Cli, ErrorKind> {
        vgpu_cli::check::arguments(line).map_err(|e| e.kind())
    }

    #[test]
    fn keeps_the_command_line_conventions() {
        vgpu_cli::check::conventions::<Cli>(env!("CARGO_PKG_VERSION")).unwrap();
        vgpu_cli::check::operator_man_page::<Cli>().unwrap();
    }

    #[test]
    fn the_command_line_is_checked() {
        let cli = parse(&["--socket", "/s", "--once"]).unwrap();
        assert_eq!(cli.socket, Some(PathBuf::from("/s")));
        assert_eq!(cli.request_time, DEFAULT_REQUEST_TIME);
        assert_eq!(cli.memory_budget << 20, DEFAULT_MEMORY_BUDGET_BYTES);
        assert_eq!(connection_config(&cli).engine, Engine::Compiled);
        let long = parse(&[
            "--socket=/s",
            "--request-time=120",
            "--memory-budget",
            "4096",
            "--ptx-engine=interpreter",
        ])
        .unwrap();
        let config = connection_config(&long);
        assert_eq!(config.engine, Engine::Interpreter);
        // A connection's process gets the engine by the name it was given.
        for engine in [Engine::Interpreter, Engine::Compiled] {
            assert_eq!(engine_name(engine).parse::<Engine>(), Ok(engine));
        }
        assert_eq!(config.request_time, std::time::Duration::from_secs(120));
        assert_eq!(config.budget.limit(), 4 << 30);
        for bad in [
            ["--request-time", "0"],
            ["--request-time", "3601"],
            ["--memory-budget", "0"],
            ["--memory-budget", "1048577"],
        ] {
            assert_eq!(
                parse(&["--socket", "/s", bad[0], bad[1]]).unwrap_err(),
                ErrorKind::ValueValidation,
                "{bad:?}"
            );
        }
        assert!(cli.once && !cli.backend && cli.serve_stdin.is_none());
        assert!(cli.allow_uid.is_empty());
        let cli = parse(&["--socket", "/s", "--allow-uid", "7", "--allow-uid=8"]).unwrap();
        assert_eq!(cli.allow_uid, [7, 8]);
        assert!(parse(&["--socket=/s", "--backend=nvcuda"]).unwrap().backend);
        // How each connection's process is started (see main).
        let cli = parse(&["--backend", "cpu", "--serve-stdin", "7"]).unwrap();
        assert_eq!(cli.serve_stdin, Some(7));
        assert_eq!(parse(&[]).unwrap_err(), ErrorKind::MissingRequiredArgument);
        assert_eq!(
            parse(&["--socket", "/s", "--backend", "gpu"]).unwrap_err(),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            parse(&["--socket", "/s", "--ptx-engine", "jit"]).unwrap_err(),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            parse(&["--socket", "/s", "--serve-stdin", "1"]).unwrap_err(),
            ErrorKind::ArgumentConflict
        );
        assert_eq!(
            parse(&["--serve-stdin", "x"]).unwrap_err(),
            ErrorKind::ValueValidation
        );
        assert_eq!(
            parse(&["--socket", "/s", "/t"]).unwrap_err(),
            ErrorKind::UnknownArgument
        );
    }
}
