//! `vgpu-run-vm`: boots the Debian test guest with a GPU, runs one job in it and exits with the
//! job's exit code (see `vgpu_tests::guest`; `qemu-scripts/run-vm.sh` builds and runs this).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{ArgGroup, Parser};
use mdev_backend::compute::corpus::corpus_dir;
use vgpu_tests::TempDir;
use vgpu_tests::drivers::control::SUMMARY_PREFIX;
use vgpu_tests::guest::{
    AGENT_JOB, GuestConfig, GuestError, GuestGpu, GuestImage, JobTransport, RunningGuest,
    cuda_payload,
};

const ABOUT: &str = "Boots the Debian test guest with a GPU, runs one job in it and exits with \
the job's exit code";

const LONG_ABOUT: &str =
    "Boots the guest built by qemu-scripts/build-guest-image.sh, runs the job \
(a bash script, as root, in a writable directory) and powers off. Prints the job's output; exits \
with the job's exit code (124: time limit, 125: the launcher failed, 126: the guest printed no \
exit code, 143: stopped by SIGTERM, SIGINT or SIGHUP; QEMU and vgpu-server are stopped and the \
cgroup removed first).

Options whose values are themselves options take them in either form: \
--server-arg=--display --server-arg=800x600, or --server-arg --dump-dir --server-arg DIR.";

/// The command line.
#[derive(Debug, Parser)]
// A repeated option takes its last value, as before clap.
#[command(
    name = "vgpu-run-vm",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    args_override_self = true,
    // One job or the other; that one is given is checked after parsing, where --completions
    // and --man need none.
    group(ArgGroup::new("job_source").args(["job", "job_file"])),
)]
struct Cli {
    /// The job: shell commands
    #[arg(long, value_name = "SHELL COMMANDS", allow_hyphen_values = true)]
    job: Option<String>,
    /// The job: a file of shell commands
    #[arg(long, value_name = "FILE")]
    job_file: Option<PathBuf>,
    /// The GPU: our vgpu-server (started with --exit-on-disconnect), QEMU's virtio-gpu-pci,
    /// QEMU's virtio-gpu-gl-pci (virgl in QEMU, on an egl-headless display), QEMU's
    /// vhost-user-gpu-pci with the prefix's vhost-user-gpu backend, or none
    #[arg(
        long,
        value_name = "GPU",
        default_value = "vgpu",
        value_parser = PossibleValuesParser::new(
            ["vgpu", "virtio-gpu", "virtio-gpu-gl", "vhost-user-gpu", "none"]
        ).try_map(gpu),
    )]
    gpu: GuestGpu,
    /// Use a vfio-user server already listening on PATH instead of starting one
    #[arg(long, value_name = "PATH", conflicts_with = "gpu")]
    socket: Option<PathBuf>,
    /// The vgpu-server binary (default: beside this program)
    #[arg(long, value_name = "PATH")]
    server: Option<PathBuf>,
    /// Pass ARG to vgpu-server (repeatable)
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    server_arg: Vec<String>,
    /// vgpu-server asks the vgpu-schedd daemon listening on SOCKET before it runs GPU work
    #[arg(long, value_name = "SOCKET", requires = "vm_name")]
    scheduler: Option<String>,
    /// The VM's name for the daemon (vgpuctl addresses it by NAME)
    #[arg(
        long,
        value_name = "NAME",
        requires = "scheduler",
        allow_hyphen_values = true
    )]
    vm_name: Option<String>,
    /// Run QEMU in a new CPU cgroup NAME (cgroup v2 where the root delegates cpu, else the v1
    /// cpu hierarchy), removed at exit
    #[arg(long, value_name = "NAME")]
    cgroup: Option<String>,
    /// The guest image directory (default: $VGPU_GUEST_DIR or ${VGPU_CACHE:-$HOME/.cache/vgpu}/guest)
    #[arg(long, value_name = "DIR")]
    image: Option<PathBuf>,
    /// Wall-clock limit, seconds
    #[arg(long, value_name = "SECONDS", default_value = "300", value_parser = seconds)]
    timeout: Duration,
    /// Accelerator (auto: KVM unless /dev/kvm is unusable or kvm_pvm)
    #[arg(
        long,
        value_name = "ACCEL",
        default_value = "auto",
        value_parser = PossibleValuesParser::new(["auto", "tcg", "kvm"]).try_map(accel),
    )]
    accel: Accel,
    /// Pass the job through fw_cfg (default: the kernel command line when it fits)
    #[arg(long, conflicts_with = "cmdline")]
    fw_cfg: bool,
    /// Pass the job on the kernel command line
    #[arg(long)]
    cmdline: bool,
    /// Guest RAM, MiB
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    ram: u64,
    /// More kernel command line (e.g. vgpu.loglevel=7)
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    append: Option<String>,
    /// Let a guest reboot restart the machine
    #[arg(long)]
    allow_reboot: bool,
    /// Print every serial line, not only the job's output
    #[arg(long)]
    serial: bool,
    /// Pass ARG to QEMU (repeatable)
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    qemu_arg: Vec<String>,
    /// Give the guest CUDA: a second disk with our libcuda.so.1 (from beside this program),
    /// this host's libgomp and its nvptx plugin and the CUDA corpus (qemu-scripts/cuda-corpus.sh),
    /// mounted at /tmp/work/cuda with LD_LIBRARY_PATH set before the job runs
    #[arg(long)]
    cuda: bool,
    /// Run the job through the host-guest control channel (vgpu-agent on a virtio-serial
    /// port) once the guest has booted, and stop it after SECONDS (its stdin closes; SIGTERM
    /// 15 s later) unless it ended before; its SUMMARY lines are printed as it sends them back.
    /// A signal stops the job the same way before the guest goes
    #[arg(long, value_name = "SECONDS", value_parser = seconds, conflicts_with_all = ["fw_cfg", "cmdline"])]
    stop_after: Option<Duration>,
}

/// `--accel`: `None` is auto.
type Accel = Option<vgpu_tests::guest::Accel>;

fn gpu(name: String) -> Result<GuestGpu, String> {
    Ok(match name.as_str() {
        "vgpu" => GuestGpu::Vgpu,
        "virtio-gpu" => GuestGpu::QemuVirtioGpu,
        "virtio-gpu-gl" => GuestGpu::QemuVirtioGpuGl,
        "vhost-user-gpu" => GuestGpu::VhostUserGpu,
        "none" => GuestGpu::None,
        other => return Err(format!("unknown GPU {other:?}")),
    })
}

fn accel(name: String) -> Result<Accel, String> {
    Ok(match name.as_str() {
        "auto" => None,
        "tcg" => Some(vgpu_tests::guest::Accel::Tcg),
        "kvm" => Some(vgpu_tests::guest::Accel::Kvm),
        other => return Err(format!("unknown accelerator {other:?}")),
    })
}

fn seconds(text: &str) -> Result<Duration, String> {
    let secs: f64 = text.parse().map_err(|e| format!("{e}"))?;
    Duration::try_from_secs_f64(secs).map_err(|e| e.to_string())
}

struct Args {
    config: GuestConfig,
    print_serial: bool,
    cuda: bool,
    stop_after: Option<Duration>,
}

impl Cli {
    /// The GPU and vgpu-server's arguments (with the scheduler's, which need our server).
    fn gpu_and_server_args(&self) -> Result<(GuestGpu, Vec<String>), String> {
        let gpu = match &self.socket {
            Some(path) => GuestGpu::VfioUser(path.clone()),
            None => self.gpu.clone(),
        };
        let mut server_args = self.server_arg.clone();
        // clap's `requires` makes them come together.
        if let (Some(socket), Some(name)) = (&self.scheduler, &self.vm_name) {
            if gpu != GuestGpu::Vgpu {
                return Err("--scheduler needs --gpu vgpu".into());
            }
            server_args.extend([
                "--scheduler".into(),
                socket.clone(),
                "--vm-name".into(),
                name.clone(),
            ]);
        }
        Ok((gpu, server_args))
    }

    /// Reads the job and locates the image.
    fn args(self) -> Result<Args, String> {
        let (gpu, server_args) = self.gpu_and_server_args()?;
        let job = match (self.job, &self.job_file) {
            (Some(job), _) => job,
            (None, Some(path)) => {
                std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?
            }
            (None, None) => return Err("--job or --job-file is required".into()),
        };
        let image = match &self.image {
            Some(dir) => GuestImage::at(dir),
            None => GuestImage::locate(),
        }
        .map_err(|e| e.to_string())?;
        let mut config = GuestConfig::new(image, job).gpu(gpu).timeout(self.timeout);
        config.server_bin = self.server;
        config.server_args = server_args;
        config.accel = self.accel;
        config.transport = if self.fw_cfg {
            JobTransport::FwCfg
        } else if self.cmdline {
            JobTransport::Cmdline
        } else {
            JobTransport::Auto
        };
        config.ram_mib = self.ram;
        config.extra_cmdline = self.append.unwrap_or_default();
        config.allow_reboot = self.allow_reboot;
        config.extra_qemu_args = self.qemu_arg;
        config.cgroup = self.cgroup;
        Ok(Args {
            config,
            print_serial: self.serial,
            cuda: self.cuda,
            stop_after: self.stop_after,
        })
    }
}

/// `--cuda`: attaches the CUDA disk and prefixes the job with its mount.
fn with_cuda(config: &mut GuestConfig) -> Result<TempDir, String> {
    let lib = std::env::current_exe()
        .map_err(|e| e.to_string())?
        .with_file_name("libcuda.so");
    if !lib.is_file() {
        return Err(format!(
            "{} is missing (cargo build -p vgpu-libcuda)",
            lib.display()
        ));
    }
    let corpus = corpus_dir()
        .filter(|d| d.is_dir())
        .ok_or("no CUDA corpus (qemu-scripts/cuda-corpus.sh)")?;
    let mut programs: Vec<String> = std::fs::read_dir(&corpus)
        .map_err(|e| format!("{}: {e}", corpus.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    programs.sort();
    let names: Vec<&str> = programs.iter().map(String::as_str).collect();
    let dir = TempDir::new("vgpu-run-vm-cuda").map_err(|e| e.to_string())?;
    let (qemu, prologue) = cuda_payload(dir.path(), &lib, &corpus, &names);
    config.extra_qemu_args.extend(qemu);
    config.job = prologue + &config.job;
    Ok(dir)
}

/// Longest wait for the agent to start the job, and for a stopped job to end (the agent's
/// 15 s grace before SIGTERM, 5 s before SIGKILL, a slow guest's reply).
const JOB_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a controlled job's state and the stop flag are looked at.
const JOB_POLL: Duration = Duration::from_millis(100);

/// `--stop-after`: waits for the agent, runs `job` through the channel until it ends, `after`
/// has passed or the stop flag is raised (then stops it), prints its SUMMARY lines, ends the
/// agent; returns the job's exit code.
fn controlled(
    guest: &mut RunningGuest,
    job: &str,
    after: Duration,
    config: &GuestConfig,
) -> Result<i32, String> {
    let stop = config.stop.clone().unwrap_or_default();
    let ch = guest.control().ok_or("no control channel")?;
    ch.hello(config.timeout)
        .map_err(|e| format!("the guest's agent: {e}"))?;
    ch.start("job", job, JOB_TIMEOUT)
        .map_err(|e| e.to_string())?;
    eprintln!(
        "vgpu-run-vm: the job runs; stopping it in {} s",
        after.as_secs_f64()
    );
    let until = Instant::now() + after;
    let mut printed = 0;
    let report = loop {
        let report = ch.report("job").unwrap_or_default();
        for line in report.summaries.iter().skip(printed) {
            println!("SUMMARY {line}");
        }
        printed = report.summaries.len();
        if report.exit.is_some() {
            break report;
        }
        if Instant::now() >= until || stop.load(std::sync::atomic::Ordering::Relaxed) {
            ch.stop("job").map_err(|e| e.to_string())?;
            break ch
                .wait_exit("job", JOB_TIMEOUT)
                .map_err(|e| e.to_string())?;
        }
        std::thread::sleep(JOB_POLL);
    };
    for line in report.summaries.iter().skip(printed) {
        println!("SUMMARY {line}");
    }
    let _ = ch.quit(Duration::from_secs(10));
    report
        .exit
        .ok_or_else(|| "the job reported no exit code".to_owned())
}

fn main() -> ExitCode {
    let args = match vgpu_cli::parse::<Cli>().args() {
        Ok(args) => args,
        Err(msg) => {
            eprintln!("vgpu-run-vm: {msg}");
            return ExitCode::from(2);
        }
    };
    env_logger::Builder::new()
        .filter_level(log::LevelFilter::Warn)
        .parse_default_env()
        .init();
    // A signal ends the run through the guest's waits, so that QEMU, the server and the
    // cgroup are cleaned up as at a normal exit.
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
    ] {
        if let Err(e) = signal_hook::flag::register(signal, Arc::clone(&stop)) {
            eprintln!("vgpu-run-vm: installing the handler of signal {signal}: {e}");
            return ExitCode::from(125);
        }
    }
    let mut config = args.config;
    config.stop = Some(stop);
    // Held until the guest is gone: it holds the CUDA disk.
    let _cuda_disk = match args.cuda.then(|| with_cuda(&mut config)).transpose() {
        Ok(dir) => dir,
        Err(e) => {
            eprintln!("vgpu-run-vm: --cuda: {e}");
            return ExitCode::from(125);
        }
    };
    // With --stop-after the guest's init runs the agent, and the job goes over the channel.
    let job = if args.stop_after.is_some() {
        config.control = true;
        Some(std::mem::replace(&mut config.job, AGENT_JOB.to_owned()))
    } else {
        None
    };
    let mut guest = match RunningGuest::launch(&config) {
        Ok(guest) => guest,
        Err(e) => {
            eprintln!("vgpu-run-vm: {e}");
            return ExitCode::from(125);
        }
    };
    eprintln!(
        "vgpu-run-vm: booting {} with {:?} under {}",
        config.image.dir.display(),
        config.gpu,
        guest.accel()
    );
    if let Some(path) = guest.cgroup_path() {
        eprintln!("vgpu-run-vm: QEMU runs in cgroup {}", path.display());
    }
    let mut job_exit = None;
    if let (Some(job), Some(after)) = (job, args.stop_after) {
        match controlled(&mut guest, &job, after, &config) {
            Ok(code) => job_exit = Some(code),
            Err(e) => {
                eprintln!("vgpu-run-vm: {e}");
                let _ = guest.kill();
                return ExitCode::from(125);
            }
        }
    }
    // Print the job's output as it arrives (or every line with --serial). A job run through
    // the channel has had its SUMMARY lines printed already; the agent's echo of them on the
    // console is not printed again.
    let via_channel = args.stop_after.is_some();
    let mut in_job = false;
    let result = guest.wait(|line| {
        if line.starts_with("VGPU-BEGIN") {
            in_job = true;
        } else if line.starts_with("VGPU-EXIT") {
            in_job = false;
        } else if in_job && !args.print_serial && !(via_channel && line.starts_with(SUMMARY_PREFIX))
        {
            println!("{line}");
        }
        if args.print_serial {
            println!("{line}");
        }
    });
    match result {
        Ok(run) => {
            eprintln!("vgpu-run-vm: {}", run.timing());
            match job_exit.or(run.exit_code) {
                Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(255)),
                None => {
                    eprintln!(
                        "vgpu-run-vm: the guest printed no VGPU-EXIT line\n{}",
                        run.logs()
                    );
                    ExitCode::from(126)
                }
            }
        }
        Err(e @ GuestError::Timeout { .. }) => {
            eprintln!("vgpu-run-vm: {e}");
            ExitCode::from(124)
        }
        Err(GuestError::Stopped { .. }) => {
            eprintln!("vgpu-run-vm: stopped by a signal; QEMU and its GPU server are gone");
            ExitCode::from(143)
        }
        Err(e) => {
            eprintln!("vgpu-run-vm: {e}");
            ExitCode::from(125)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    fn parse(line: &[&str]) -> Result<Cli, ErrorKind> {
        vgpu_cli::check::arguments(line).map_err(|e| e.kind())
    }

    #[test]
    fn keeps_the_command_line_conventions() {
        vgpu_cli::check::conventions::<Cli>(env!("CARGO_PKG_VERSION")).unwrap();
    }

    #[test]
    fn server_and_qemu_arguments_may_be_options() {
        // The example, and demo.sh's form.
        let cli = parse(&[
            "--server-arg=--display",
            "--server-arg=800x600",
            "--server-arg",
            "--dump-dir",
            "--server-arg",
            "/tmp/out",
            "--qemu-arg",
            "-smp",
            "--qemu-arg=2",
            "--append",
            "-- quiet",
            "--job",
            "-x",
        ])
        .unwrap();
        assert_eq!(
            cli.server_arg,
            ["--display", "800x600", "--dump-dir", "/tmp/out"]
        );
        assert_eq!(cli.qemu_arg, ["-smp", "2"]);
        assert_eq!(cli.append.as_deref(), Some("-- quiet"));
        assert_eq!(cli.job.as_deref(), Some("-x"));
        let (gpu, server) = cli.gpu_and_server_args().unwrap();
        assert_eq!(gpu, GuestGpu::Vgpu);
        assert_eq!(server, ["--display", "800x600", "--dump-dir", "/tmp/out"]);
    }

    #[test]
    fn options_and_defaults() {
        let cli = parse(&["--job", "true"]).unwrap();
        assert_eq!(cli.timeout, Duration::from_secs(300));
        assert_eq!((cli.ram, cli.accel), (1024, None));
        assert!(!cli.fw_cfg && !cli.cmdline && !cli.cuda && !cli.serial);
        let cli = parse(&[
            "--job-file=/j",
            "--gpu=virtio-gpu-gl",
            "--timeout=2.5",
            "--accel",
            "tcg",
            "--fw-cfg",
            "--ram=2048",
            "--cgroup=g",
            "--image",
            "/img",
            "--server=/bin/s",
            "--allow-reboot",
            "--serial",
            "--cuda",
        ])
        .unwrap();
        assert_eq!(cli.gpu, GuestGpu::QemuVirtioGpuGl);
        assert_eq!(cli.timeout, Duration::from_millis(2500));
        assert_eq!(cli.accel, Some(vgpu_tests::guest::Accel::Tcg));
        assert!(cli.fw_cfg && cli.allow_reboot && cli.serial && cli.cuda);
        assert_eq!(cli.stop_after, None);
        assert_eq!((cli.ram, cli.cgroup.as_deref()), (2048, Some("g")));
        let cli = parse(&[
            "--job",
            "vgpu-load bomb --cost-us 9 --until-stopped",
            "--stop-after",
            "30",
        ])
        .unwrap();
        assert_eq!(cli.stop_after, Some(Duration::from_secs(30)));
        assert!(
            parse(&["--job", "x", "--stop-after", "30", "--fw-cfg"]).is_err(),
            "the job goes over the channel, not fw_cfg"
        );
        let cli = parse(&["--job", "x", "--socket", "/s"]).unwrap();
        assert_eq!(
            cli.gpu_and_server_args().unwrap().0,
            GuestGpu::VfioUser("/s".into())
        );
        let cli = parse(&["--job", "x", "--scheduler", "/d", "--vm-name", "a"]).unwrap();
        assert_eq!(
            cli.gpu_and_server_args().unwrap().1,
            ["--scheduler", "/d", "--vm-name", "a"]
        );
        // The last of a repeated option counts.
        assert_eq!(
            parse(&["--job", "a", "--job", "b"]).unwrap().job.as_deref(),
            Some("b")
        );
    }

    #[test]
    fn bad_command_lines_are_refused() {
        assert!(
            parse(&[])
                .unwrap()
                .args()
                .is_err_and(|e| e.contains("--job"))
        );
        assert_eq!(
            parse(&["--job", "x", "--job-file", "f"]).unwrap_err(),
            ErrorKind::ArgumentConflict
        );
        assert_eq!(
            parse(&["--job", "x", "--gpu", "rtx"]).unwrap_err(),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            parse(&["--job", "x", "--accel", "hvf"]).unwrap_err(),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            parse(&["--job", "x", "--timeout=-1"]).unwrap_err(),
            ErrorKind::ValueValidation
        );
        assert_eq!(
            parse(&["--job", "x", "--timeout", "soon"]).unwrap_err(),
            ErrorKind::ValueValidation
        );
        assert_eq!(
            parse(&["--job", "x", "--ram", "lots"]).unwrap_err(),
            ErrorKind::ValueValidation
        );
        assert_eq!(
            parse(&["--job", "x", "--fw-cfg", "--cmdline"]).unwrap_err(),
            ErrorKind::ArgumentConflict
        );
        assert_eq!(
            parse(&["--job", "x", "--gpu", "none", "--socket", "/s"]).unwrap_err(),
            ErrorKind::ArgumentConflict
        );
        assert_eq!(
            parse(&["--job", "x", "--scheduler", "/d"]).unwrap_err(),
            ErrorKind::MissingRequiredArgument
        );
        assert_eq!(
            parse(&["--job", "x", "--frob"]).unwrap_err(),
            ErrorKind::UnknownArgument
        );
        let cli = parse(&["--job", "x", "--gpu=none", "--scheduler=/d", "--vm-name=a"]).unwrap();
        assert!(cli.gpu_and_server_args().is_err());
    }
}
