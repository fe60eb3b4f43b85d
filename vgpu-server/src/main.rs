//! `vgpu-server`: serves one virtio-gpu PCI function over vfio-user (see `--help`). Its
//! arguments come from an operator, a test, or the scheduler daemon (`vgpu-schedd`'s
//! `ServerOptions`, which passes only allowed options): every value is checked here before the
//! device starts.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use mdev_backend::compute::backend::parse_request_time;
use mdev_backend::compute::ptx::Engine;
use mdev_backend::virgl;
use vgpu_schedd::busy_poll;
use vgpu_schedd::proto::VmName;
use vgpu_server::gpu::DisplayConfig;
use vgpu_server::gpu::compute::ComputeKind;
use vgpu_server::gpu::device::{DEFAULT_RESOURCE_MEMORY_MB, MAX_RESOURCE_MEMORY_MB};
use vgpu_server::gpu::dump::DumpConfig;
use vgpu_server::sandbox::{self, RunAs, SandboxConfig};
use vgpu_server::sched_client::{FallbackShare, SchedConfig};
use vgpu_server::{ServerConfig, VgpuServer};

const ABOUT: &str = "Serves one virtio-gpu PCI function over vfio-user on a Unix socket";

const LONG_ABOUT: &str = "Serves one virtio-gpu PCI function over vfio-user on PATH. With the \
virgl renderer (default; libvirglrenderer.so.1, host EGL) guests get OpenGL through virgl; \
without it, 2D only. Guest CUDA (the compute capset 21, with virgl) runs on the PTX executor on \
the host's CPUs, or with --compute nvcuda on NVIDIA's driver.

Start QEMU with
  -object memory-backend-memfd,id=mem,size=1G,share=on -machine q35,memory-backend=mem
  -device '{\"driver\":\"vfio-user-pci\",\"socket\":{\"path\":\"PATH\",\"type\":\"unix\"}}'

Once started (socket bound, renderer ready) the process closes inherited descriptors, sets \
no_new_privs, drops to --run-as UID:GID when run as root, and installs a seccomp filter that \
kills it on any syscall outside its measured list (--no-sandbox: no filter, for debugging).";

/// The command line. Options with free-form values (paths, the VM name) take the next argument
/// whatever it starts with, as the daemon passes them: a VM may be named `-x`.
#[derive(Debug, Parser)]
// A repeated option takes its last value, as before clap: test harnesses add their own
// `--log-level` after a default one.
#[command(
    name = "vgpu-server",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    args_override_self = true,
    after_long_help = "EXAMPLES
  vgpu-server --socket /run/vgpu/vm1/vgpu.sock --scheduler /run/vgpu-schedd/schedd.sock --vm-name vm1
  qemu-system-x86_64 ... -device '{\"driver\":\"vfio-user-pci\",\"socket\":{\"path\":\"/run/vgpu/vm1/vgpu.sock\",\"type\":\"unix\"}}'
  systemctl start vgpu-server@vm1

FILES
  /run/vgpu/NAME/vgpu.sock
  /etc/vgpu/server/NAME.env

The socket QEMU connects to (--socket), and the options of the vgpu-server@NAME unit.

SEE ALSO
vgpu-schedd(1), vgpuctl(1), qemu-system-x86_64(1); docs/DEPLOY.md and docs/SECURITY.md in the
source tree."
)]
struct Cli {
    /// The Unix socket QEMU connects to (it must not exist; removed at exit)
    #[arg(long, value_name = "PATH", allow_hyphen_values = true)]
    socket: PathBuf,
    /// The scanout mode reported to the guest
    #[arg(long, value_name = "WIDTHxHEIGHT")]
    display: Option<DisplayConfig>,
    /// Write what the guest shows to DIR/scanout0.png (after a flush at most once a second, on
    /// SIGUSR1, and when the client disconnects)
    #[arg(long, value_name = "DIR", allow_hyphen_values = true)]
    dump_dir: Option<PathBuf>,
    /// With virgl (3D) or without (2D only)
    #[arg(
        long,
        action = clap::ArgAction::Set,
        value_name = "RENDERER",
        default_value = "virgl",
        value_parser = PossibleValuesParser::new(["virgl", "none"]).map(|r| r == "virgl"),
    )]
    renderer: bool,
    /// The virglrenderer library to load instead of libvirglrenderer.so.1
    #[arg(long, value_name = "NAME")]
    virgl_library: Option<String>,
    /// The host API virglrenderer renders with: desktop OpenGL (as QEMU's virtio-gpu-gl; the
    /// guest's desktop-GL features run natively) or OpenGL ES (hosts whose driver has only GLES)
    #[arg(long, value_name = "API", default_value = "gl", value_parser = PossibleValuesParser::new(["gl", "gles"]).try_map(|s| s.parse::<mdev_backend::virgl::HostGl>()))]
    host_gl: mdev_backend::virgl::HostGl,
    /// Log level (RUST_LOG refines it)
    #[arg(
        long,
        value_name = "LEVEL",
        default_value = "info",
        value_parser = vgpu_cli::log_level(),
        ignore_case = true,
    )]
    log_level: log::LevelFilter,
    /// Serve one QEMU connection, then exit
    #[arg(long)]
    exit_on_disconnect: bool,
    /// GPU work waits for the vgpu-schedd daemon at SOCKET (as --vm-name); until it admits
    /// the device (unreachable, or it refused or dropped the device) GPU work runs under
    /// --fallback-share of the GPU
    #[arg(
        long,
        value_name = "SOCKET",
        requires = "vm_name",
        allow_hyphen_values = true
    )]
    scheduler: Option<PathBuf>,
    /// The VM's name for the scheduler daemon
    #[arg(
        long,
        value_name = "NAME",
        requires = "scheduler",
        value_parser = vm_name,
        allow_hyphen_values = true
    )]
    vm_name: Option<VmName>,
    /// The share of the GPU, in percent, GPU work runs under while the scheduler daemon has
    /// not admitted the device (default: an equal split among four VMs)
    #[arg(
        long,
        value_name = "PERCENT",
        requires = "scheduler",
        value_parser = fallback_share,
    )]
    fallback_share: Option<FallbackShare>,
    /// Host memory the guest may make the device hold, in MiB: 2D and 3D resources, blobs and
    /// their entry lists, queued CUDA requests, CUDA device memory and modules (past it,
    /// creates fail with ERR_OUT_OF_MEMORY, CUDA requests with CUDA_ERROR_OUT_OF_MEMORY)
    #[arg(
        long,
        value_name = "N",
        default_value_t = DEFAULT_RESOURCE_MEMORY_MB,
        value_parser = clap::value_parser!(u64).range(1..=MAX_RESOURCE_MEMORY_MB),
    )]
    resource_memory_mb: u64,
    /// The backend of guest CUDA: the PTX executor, or NVIDIA's driver (needs --no-sandbox:
    /// the driver's system calls are not in the filter)
    #[arg(
        long,
        value_name = "BACKEND",
        default_value = "cpu",
        value_parser = PossibleValuesParser::new(["cpu", "nvcuda"]).try_map(compute),
    )]
    compute: ComputeKind,
    /// Longest one CUDA request may run on the PTX executor, in seconds (at most 3600): past
    /// it its kernel stops with CUDA_ERROR_LAUNCH_TIMEOUT. A scheduled device's long requests
    /// run in time slices, so neighbours do not wait for them
    #[arg(
        long,
        value_name = "SECONDS",
        default_value = "1.5",
        value_parser = parse_request_time
    )]
    compute_request_time: Duration,
    /// What runs guest kernels on the PTX executor: compiled native code (the interpreter
    /// still runs what the compiler refuses), or the interpreter alone (the reference)
    #[arg(
        long,
        value_name = "ENGINE",
        default_value = "compiled",
        value_parser = PossibleValuesParser::new(["compiled", "interpreter"])
            .try_map(|e| e.parse::<Engine>()),
    )]
    ptx_engine: Engine,
    /// When run as root, drop to this user and group once started (not root)
    #[arg(long, value_name = "UID:GID")]
    run_as: Option<RunAs>,
    /// No seccomp filter (debugging)
    #[arg(long)]
    no_sandbox: bool,
    /// The longest the relay and the worker spin for their next event before they sleep (0:
    /// never): a doorbell or grant that follows soon after the last is caught without a
    /// scheduler wake-up. The window adapts to the guest: an idle device does not spin
    #[arg(
        long,
        value_name = "US",
        default_value = "200",
        value_parser = busy_poll::parse_us,
    )]
    busy_poll_us: Duration,
}

fn compute(name: String) -> Result<ComputeKind, String> {
    match name.as_str() {
        "cpu" => Ok(ComputeKind::Cpu),
        "nvcuda" => Ok(ComputeKind::NvCuda),
        other => Err(format!("{other:?} is not cpu or nvcuda")),
    }
}

fn fallback_share(text: &str) -> Result<FallbackShare, String> {
    let percent: u64 = text.parse().map_err(|e| format!("{text:?}: {e}"))?;
    FallbackShare::new(percent).map_err(|e| e.to_string())
}

fn vm_name(name: &str) -> Result<VmName, String> {
    VmName::new(name).map_err(|e| e.to_string())
}

/// What the device process runs with.
#[derive(Debug)]
struct Args {
    config: ServerConfig,
    log_level: log::LevelFilter,
    sandbox: SandboxConfig,
}

/// Checks what clap cannot see alone and builds the server's configuration.
fn args(cli: Cli) -> Result<Args, clap::Error> {
    let renderer = match (cli.renderer, cli.virgl_library) {
        (true, library) => Some(library.unwrap_or_else(|| virgl::DEFAULT_LIBRARY.to_owned())),
        (false, None) => None,
        (false, Some(_)) => {
            return Err(clap::Error::raw(
                clap::error::ErrorKind::ArgumentConflict,
                "--virgl-library needs the virgl renderer, not --renderer none",
            ));
        }
    };
    let scheduler = match (cli.scheduler, cli.vm_name) {
        (Some(socket), Some(vm_name)) => Some(SchedConfig {
            socket,
            vm_name,
            fallback: cli.fallback_share.unwrap_or_default(),
        }),
        // clap's `requires` refuses one without the other.
        _ => None,
    };
    Ok(Args {
        config: ServerConfig {
            socket: cli.socket,
            display: cli.display.unwrap_or_default(),
            max_connections: cli.exit_on_disconnect.then_some(1),
            dump: cli.dump_dir.map(DumpConfig::new),
            renderer,
            host_gl: cli.host_gl,
            scheduler,
            // At most MAX_RESOURCE_MEMORY_MB (2^20) MiB: 2^40 bytes.
            resource_memory: cli.resource_memory_mb << 20,
            compute: cli.compute,
            compute_request_time: cli.compute_request_time,
            ptx_engine: cli.ptx_engine,
            busy_poll: cli.busy_poll_us,
        },
        log_level: cli.log_level,
        sandbox: SandboxConfig {
            filter: !cli.no_sandbox,
            run_as: cli.run_as,
        },
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
    let args = match args(vgpu_cli::parse::<Cli>()) {
        Ok(args) => args,
        Err(e) => e.format(&mut vgpu_cli::command::<Cli>()).exit(),
    };
    mdev_backend::logger(args.log_level).init();
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

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::path::Path;

    use log::LevelFilter;
    use mdev_backend::compute::backend::DEFAULT_REQUEST_TIME;
    use vgpu_schedd::control::{Renderer, ServerOptions};

    use super::*;

    fn parse<I, T>(line: I) -> Result<Args, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        args(vgpu_cli::check::arguments(line)?)
    }

    fn refused(line: &[&str]) -> clap::Error {
        match parse(line) {
            Err(e) => e,
            Ok(a) => panic!("{line:?} accepted: {a:?}"),
        }
    }

    #[test]
    fn keeps_the_command_line_conventions() {
        vgpu_cli::check::conventions::<Cli>(env!("CARGO_PKG_VERSION")).unwrap();
        vgpu_cli::check::operator_man_page::<Cli>().unwrap();
    }

    #[test]
    fn defaults() {
        let a = parse(["--socket", "/run/a.sock"]).unwrap();
        let c = &a.config;
        assert_eq!(c.socket, PathBuf::from("/run/a.sock"));
        assert_eq!(c.display, DisplayConfig::default());
        assert_eq!(c.max_connections, None);
        assert!(c.dump.is_none() && c.scheduler.is_none());
        assert_eq!(c.renderer.as_deref(), Some(virgl::DEFAULT_LIBRARY));
        assert_eq!(c.host_gl, virgl::HostGl::Gl);
        let gles = parse(["--socket", "/s", "--host-gl", "gles"]).unwrap();
        assert_eq!(gles.config.host_gl, virgl::HostGl::Gles);
        assert_eq!(c.resource_memory, DEFAULT_RESOURCE_MEMORY_MB << 20);
        assert_eq!(c.compute, ComputeKind::Cpu);
        assert_eq!(c.compute_request_time, DEFAULT_REQUEST_TIME);
        assert_eq!(c.ptx_engine, Engine::Compiled);
        assert_eq!(c.busy_poll, busy_poll::DEFAULT_MAX);
        assert_eq!(a.log_level, LevelFilter::Info);
        assert!(a.sandbox.filter && a.sandbox.run_as.is_none());
    }

    #[test]
    fn every_option_with_a_space_or_an_equals_sign() {
        for eq in [false, true] {
            let opts = [
                ("--socket", "/s"),
                ("--display", "800x600"),
                ("--dump-dir", "/d"),
                ("--renderer", "virgl"),
                ("--virgl-library", "libother.so"),
                ("--log-level", "TRACE"),
                ("--scheduler", "/sched"),
                ("--vm-name", "vm-1"),
                ("--fallback-share", "50"),
                ("--resource-memory-mb", "1048576"),
                ("--compute", "nvcuda"),
                ("--compute-request-time", "120"),
                ("--ptx-engine", "interpreter"),
                ("--run-as", "1000:1000"),
                ("--busy-poll-us", "0"),
            ];
            let mut line: Vec<String> = Vec::new();
            for (k, v) in opts {
                if eq {
                    line.push(format!("{k}={v}"));
                } else {
                    line.extend([k.to_owned(), v.to_owned()]);
                }
            }
            line.extend(["--exit-on-disconnect".into(), "--no-sandbox".into()]);
            let a = parse(&line).unwrap();
            let c = &a.config;
            assert_eq!((c.display.width, c.display.height), (800, 600));
            assert_eq!(c.dump.as_ref().unwrap().dir, PathBuf::from("/d"));
            assert_eq!(c.renderer.as_deref(), Some("libother.so"));
            assert_eq!(a.log_level, LevelFilter::Trace);
            let sched = c.scheduler.as_ref().unwrap();
            assert_eq!(sched.socket, PathBuf::from("/sched"));
            assert_eq!(sched.vm_name.as_str(), "vm-1");
            assert_eq!(sched.fallback.percent(), 50);
            assert_eq!(c.resource_memory, MAX_RESOURCE_MEMORY_MB << 20);
            assert_eq!(c.compute, ComputeKind::NvCuda);
            assert_eq!(c.compute_request_time, Duration::from_secs(120));
            assert_eq!(c.ptx_engine, Engine::Interpreter);
            assert_eq!(c.busy_poll, Duration::ZERO);
            assert_eq!(c.max_connections, Some(1));
            assert!(!a.sandbox.filter);
            assert_eq!(
                a.sandbox.run_as,
                Some(RunAs {
                    uid: 1000,
                    gid: 1000
                })
            );
        }
        let a = parse(["--socket", "/s", "--renderer", "none"]).unwrap();
        assert_eq!(a.config.renderer, None);
        // The last of a repeated option counts (test harnesses add their own --log-level).
        let a = parse(["--socket=/s", "--log-level", "info", "--log-level", "warn"]).unwrap();
        assert_eq!(a.log_level, LevelFilter::Warn);
    }

    /// The command line `vgpu-schedd` builds for `create` (scheduler/daemon/src/server.rs:
    /// its own options, then `ServerOptions::to_args`, then `--run-as`) must parse with every
    /// allowed option set, so that renaming a flag here or there fails this test.
    #[test]
    fn what_the_daemon_passes_is_accepted() {
        for (renderer, level, memory_mb) in [
            (Renderer::Virgl, LevelFilter::Off, 1),
            (Renderer::None, LevelFilter::Debug, MAX_RESOURCE_MEMORY_MB),
        ] {
            let options = ServerOptions {
                display: Some((1280, 800)),
                renderer: Some(renderer),
                log_level: Some(level),
                memory_mb: Some(memory_mb),
                dump: true,
                exit_on_disconnect: true,
            };
            let mut line: Vec<OsString> = [
                "--socket",
                "/run/vgpu/a.sock",
                "--scheduler",
                "/run/vgpu/sched.sock",
                "--vm-name",
                "a",
            ]
            .map(OsString::from)
            .into();
            line.extend(options.to_args(Some(Path::new("/var/lib/vgpu/dump/a"))));
            line.extend(["--run-as", "70000:70100"].map(OsString::from));
            let a = parse(&line).unwrap();
            let c = &a.config;
            assert_eq!((c.display.width, c.display.height), (1280, 800));
            assert_eq!(c.renderer.is_some(), renderer == Renderer::Virgl);
            assert_eq!(a.log_level, level);
            assert_eq!(c.resource_memory, memory_mb << 20);
            assert_eq!(
                c.dump.as_ref().unwrap().dir,
                PathBuf::from("/var/lib/vgpu/dump/a")
            );
            assert_eq!(c.max_connections, Some(1));
            assert_eq!(c.scheduler.as_ref().unwrap().vm_name.as_str(), "a");
            assert_eq!(
                a.sandbox.run_as,
                Some(RunAs {
                    uid: 70000,
                    gid: 70100
                })
            );
        }
        // A VM name that looks like an option is the name, nothing more.
        for name in ["--no-sandbox", "-x"] {
            let a = parse(["--socket", "/s", "--scheduler", "/d", "--vm-name", name]).unwrap();
            assert_eq!(a.config.scheduler.unwrap().vm_name.as_str(), name);
            assert!(a.sandbox.filter);
        }
        // With no options the daemon's own part alone.
        let line = ServerOptions::default().to_args(None);
        assert!(line.is_empty());
    }

    /// The daemon checks `--display` and `--memory-mb` at `define` against its own copies of
    /// this process's limits (it cannot depend on this crate): they must be the same.
    #[test]
    fn the_daemon_checks_the_same_limits() {
        use vgpu_schedd::control::{MAX_DISPLAY_EDGE, MAX_MEMORY_MB, MIN_DISPLAY_EDGE};
        use vgpu_server::gpu::device::{MAX_SCANOUT_EDGE, MIN_SCANOUT_EDGE};
        assert_eq!(
            (MIN_DISPLAY_EDGE, MAX_DISPLAY_EDGE),
            (MIN_SCANOUT_EDGE, MAX_SCANOUT_EDGE)
        );
        assert_eq!(MAX_MEMORY_MB, MAX_RESOURCE_MEMORY_MB);
    }

    #[test]
    fn bad_values_are_refused() {
        use clap::error::ErrorKind::*;
        let s = ["--socket", "/s"];
        let with = |more: &[&'static str]| -> Vec<&'static str> { [&s[..], more].concat() };
        assert_eq!(refused(&[]).kind(), MissingRequiredArgument);
        assert_eq!(refused(&["--socket"]).kind(), InvalidValue);
        assert_eq!(refused(&with(&["--bogus"])).kind(), UnknownArgument);
        assert_eq!(refused(&with(&["extra"])).kind(), UnknownArgument);
        for bad in [
            &["--display", "big"][..],
            &["--display", "0x600"],
            &["--renderer", "vulkan"],
            &["--host-gl", "vulkan"],
            &["--compute", "gpu"],
            &["--ptx-engine", "jit"],
            &["--ptx-engine", ""],
            &["--log-level", "loud"],
            &["--resource-memory-mb", "0"],
            &["--resource-memory-mb", "1048577"],
            &["--resource-memory-mb", "lots"],
            &["--run-as", "0:0"],
            &["--run-as", "1000"],
            &["--run-as", "x:y"],
            &["--busy-poll-us", "1001"],
            &["--busy-poll-us", "-1"],
            &["--scheduler", "/x", "--vm-name", "a:b"],
            &["--fallback-share", "0"],
            &["--fallback-share", "101"],
            &["--fallback-share", "half"],
        ] {
            let e = refused(&with(bad));
            assert!(
                matches!(e.kind(), ValueValidation | InvalidValue | UnknownArgument),
                "{bad:?}: {e}"
            );
            // A value clap read and refused names its option (tests and operators look for it).
            assert!(
                e.kind() != ValueValidation || e.to_string().contains(bad[bad.len() - 2]),
                "{bad:?}: {e}"
            );
        }
        assert_eq!(
            refused(&with(&["--scheduler", "/x"])).kind(),
            MissingRequiredArgument
        );
        assert_eq!(
            refused(&with(&["--vm-name", "a"])).kind(),
            MissingRequiredArgument
        );
        let e = refused(&with(&["--renderer", "none", "--virgl-library", "x"]));
        assert_eq!(e.kind(), ArgumentConflict);
    }
}
