//! `vgpu-server --socket PATH [--display WxH] [--dump-dir DIR] [--log-level LEVEL]
//! [--exit-on-disconnect] [--scheduler SOCKET --vm-name NAME] [--resource-memory-mb N]
//! [--run-as UID:GID] [--no-sandbox] [--busy-poll-us N]`

use std::path::PathBuf;
use std::process::ExitCode;

use mdev_backend::virgl;
use vgpu_schedd::busy_poll;
use vgpu_schedd::proto::VmName;
use vgpu_server::gpu::DisplayConfig;
use vgpu_server::gpu::compute::ComputeKind;
use vgpu_server::gpu::device::{DEFAULT_RESOURCE_MEMORY_MB, MAX_RESOURCE_MEMORY_MB};
use vgpu_server::gpu::dump::DumpConfig;
use vgpu_server::sandbox::{self, SandboxConfig};
use vgpu_server::sched_client::SchedConfig;
use vgpu_server::{ServerConfig, VgpuServer};

const USAGE: &str = "usage: vgpu-server --socket PATH [--display WIDTHxHEIGHT] [--dump-dir DIR] [--renderer virgl|none] [--virgl-library NAME] [--log-level error|warn|info|debug|trace] [--exit-on-disconnect] [--scheduler SOCKET --vm-name NAME] [--resource-memory-mb N] [--compute cpu|nvcuda] [--run-as UID:GID] [--no-sandbox] [--busy-poll-us N]

Serves one virtio-gpu PCI function over vfio-user on PATH. With the virgl renderer (default;
libvirglrenderer.so.1, host EGL) guests get OpenGL through virgl; without it, 2D only. With
--dump-dir, what the guest
shows is written to DIR/scanout0.png (after a flush at most once a second, on SIGUSR1, and
when the client disconnects). With --scheduler, GPU work waits for the vgpu-schedd daemon at
SOCKET (as VM NAME); while it is unreachable the VM runs unscheduled. The guest's 2D and 3D
resources may take N MiB of host memory (default 1024); past it creates fail with
ERR_OUT_OF_MEMORY. Guest CUDA (the compute capset 21, with virgl) runs on the PTX executor on
the host's CPUs, or with --compute nvcuda on NVIDIA's driver (needs --no-sandbox: the driver's
system calls are not in the filter). Start QEMU with
  -object memory-backend-memfd,id=mem,size=1G,share=on -machine q35,memory-backend=mem
  -device '{\"driver\":\"vfio-user-pci\",\"socket\":{\"path\":\"PATH\",\"type\":\"unix\"}}'
Once started (socket bound, renderer ready) the process closes inherited descriptors, sets
no_new_privs, drops to --run-as UID:GID when run as root, and installs a seccomp filter that
kills it on any syscall outside its measured list (--no-sandbox: no filter, for debugging).
--busy-poll-us is the longest the relay and the worker spin for their next event before they
sleep (default 200, 0: never): a doorbell or grant that follows soon after the last is caught
without a scheduler wake-up. The window adapts to the guest: an idle device does not spin.";

struct Args {
    config: ServerConfig,
    log_level: String,
    sandbox: SandboxConfig,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut socket = None;
    let mut display = DisplayConfig::default();
    let mut log_level = "info".to_string();
    let mut max_connections = None;
    let mut dump = None;
    let mut renderer = Some(virgl::DEFAULT_LIBRARY.to_string());
    let mut scheduler = None;
    let mut vm_name = None;
    let mut resource_memory_mb = DEFAULT_RESOURCE_MEMORY_MB;
    let mut compute = ComputeKind::Cpu;
    let mut busy_poll = busy_poll::DEFAULT_MAX;
    let mut sandbox = SandboxConfig {
        filter: true,
        run_as: None,
    };
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--socket" => socket = Some(PathBuf::from(value("--socket")?)),
            "--display" => {
                display = value("--display")?
                    .parse()
                    .map_err(|e| format!("--display: {e}"))?
            }
            "--log-level" => log_level = value("--log-level")?,
            "--dump-dir" => dump = Some(DumpConfig::new(value("--dump-dir")?)),
            "--exit-on-disconnect" => max_connections = Some(1),
            "--renderer" => match value("--renderer")?.as_str() {
                "virgl" => renderer = Some(virgl::DEFAULT_LIBRARY.to_string()),
                "none" => renderer = None,
                other => return Err(format!("--renderer: {other:?} is not virgl or none")),
            },
            "--scheduler" => scheduler = Some(PathBuf::from(value("--scheduler")?)),
            "--compute" => {
                compute = match value("--compute")?.as_str() {
                    "cpu" => ComputeKind::Cpu,
                    "nvcuda" => ComputeKind::NvCuda,
                    other => return Err(format!("--compute: {other:?} is not cpu or nvcuda")),
                }
            }
            "--vm-name" => {
                let name = value("--vm-name")?;
                vm_name = Some(VmName::new(&name).map_err(|e| format!("--vm-name: {e}"))?);
            }
            "--resource-memory-mb" => {
                resource_memory_mb = value("--resource-memory-mb")?
                    .parse()
                    .ok()
                    .filter(|mb| (1..=MAX_RESOURCE_MEMORY_MB).contains(mb))
                    .ok_or(format!(
                        "--resource-memory-mb: a number of MiB in 1..={MAX_RESOURCE_MEMORY_MB}"
                    ))?
            }
            "--virgl-library" => renderer = Some(value("--virgl-library")?),
            "--run-as" => {
                sandbox.run_as = Some(
                    value("--run-as")?
                        .parse()
                        .map_err(|e: sandbox::SandboxError| e.to_string())?,
                )
            }
            "--no-sandbox" => sandbox.filter = false,
            "--busy-poll-us" => busy_poll = busy_poll::parse_us(&value("--busy-poll-us")?)?,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if log_level.parse::<log::LevelFilter>().is_err() {
        return Err(format!("--log-level: unknown level {log_level:?}"));
    }
    let socket = socket.ok_or("--socket is required")?;
    let scheduler = match (scheduler, vm_name) {
        (Some(socket), Some(vm_name)) => Some(SchedConfig { socket, vm_name }),
        (None, None) => None,
        _ => return Err("--scheduler and --vm-name go together".to_string()),
    };
    Ok(Args {
        config: ServerConfig {
            socket,
            display,
            max_connections,
            dump,
            renderer,
            scheduler,
            // At most MAX_RESOURCE_MEMORY_MB (2^20) MiB: 2^40 bytes.
            resource_memory: resource_memory_mb << 20,
            compute,
            busy_poll,
        },
        log_level,
        sandbox,
    })
}

/// Creates the dump directory if needed and makes SIGUSR1 request a dump (the signal handler
/// writes a byte to the dump request socket).
fn dump_on_sigusr1(dump: DumpConfig) -> std::io::Result<DumpConfig> {
    std::fs::create_dir_all(&dump.dir)?;
    let (dump, wake) = dump.with_requests()?;
    signal_hook::low_level::pipe::register(signal_hook::consts::SIGUSR1, wake)?;
    Ok(dump)
}

fn main() -> ExitCode {
    // First, before anything here opens a descriptor: none of another VM's may stay open.
    let closed = sandbox::close_inherited_fds();
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("vgpu-server: {msg}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    env_logger::Builder::new()
        .parse_filters(&args.log_level)
        .parse_default_env()
        .format_timestamp_micros()
        .init();
    let fds_closed = match closed {
        Ok(n) => n,
        Err(e) => {
            log::error!("closing inherited descriptors: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut config = args.config;
    if let Some(dump) = config.dump.take() {
        match dump_on_sigusr1(dump) {
            Ok(dump) => config.dump = Some(dump),
            Err(e) => {
                log::error!("setting up SIGUSR1 for --dump-dir: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let server = match VgpuServer::bind(config) {
        Ok(server) => server,
        Err(e) => {
            log::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    match sandbox::enter(args.sandbox) {
        Ok(state) => sandbox::log_state(state, fds_closed),
        Err(e) => {
            log::error!("entering the sandbox: {e}");
            return ExitCode::FAILURE;
        }
    }
    match server.serve() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            ExitCode::FAILURE
        }
    }
}
