//! `vgpu-run-vm`: boots the Debian test guest with a GPU, runs one job in it and exits with the
//! job's exit code (see `vgpu_tests::guest`; `qemu-scripts/run-vm.sh` builds and runs this).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use mdev_backend::compute::corpus::corpus_dir;
use vgpu_tests::TempDir;
use vgpu_tests::guest::{
    Accel, GuestConfig, GuestError, GuestGpu, GuestImage, JobTransport, RunningGuest, cuda_payload,
};

const USAGE: &str = "usage: vgpu-run-vm [options] (--job 'SHELL COMMANDS' | --job-file FILE)

Boots the guest built by qemu-scripts/build-guest-image.sh, runs the job (a bash script, as root,
in a writable directory) and powers off. Prints the job's output; exits with the job's exit code
(124: time limit, 125: the launcher failed, 126: the guest printed no exit code, 143: stopped
by SIGTERM, SIGINT or SIGHUP; QEMU and vgpu-server are stopped and the cgroup removed first).

options:
  --gpu vgpu|virtio-gpu|virtio-gpu-gl|vhost-user-gpu|none
                               the GPU: our vgpu-server (default; started with
                               --exit-on-disconnect), QEMU's virtio-gpu-pci, QEMU's
                               virtio-gpu-gl-pci (virgl in QEMU, on an egl-headless display),
                               QEMU's vhost-user-gpu-pci with the prefix's vhost-user-gpu
                               backend, or none
  --socket PATH                use a vfio-user server already listening on PATH instead
  --server PATH                the vgpu-server binary (default: beside this program)
  --server-arg ARG             pass ARG to vgpu-server (repeatable)
  --scheduler SOCKET           vgpu-server asks the vgpu-schedd daemon listening on SOCKET
                               before it runs GPU work (needs --vm-name)
  --vm-name NAME               the VM's name for the daemon (vgpuctl addresses it by NAME)
  --cgroup NAME                run QEMU in a new CPU cgroup NAME (cgroup v2 where the root
                               delegates cpu, else the v1 cpu hierarchy), removed at exit
  --image DIR                  the guest image directory (default: $VGPU_GUEST_DIR or
                               ${VGPU_CACHE:-$HOME/.cache/vgpu}/guest)
  --timeout SECONDS            wall-clock limit (default 300)
  --accel auto|tcg|kvm         accelerator (default auto: KVM unless /dev/kvm is unusable or
                               kvm_pvm)
  --fw-cfg | --cmdline         pass the job through fw_cfg or the kernel command line
                               (default: the command line when it fits)
  --ram MIB                    guest RAM (default 1024)
  --append ARGS                more kernel command line (e.g. vgpu.loglevel=7)
  --allow-reboot               let a guest reboot restart the machine
  --serial                     print every serial line, not only the job's output
  --qemu-arg ARG               pass ARG to QEMU (repeatable)
  --cuda                       give the guest CUDA: a second disk with our libcuda.so.1 (from
                               beside this program), this host's libgomp and its nvptx plugin
                               and the CUDA corpus (qemu-scripts/cuda-corpus.sh), mounted at
                               /tmp/work/cuda with LD_LIBRARY_PATH set before the job runs";

struct Args {
    config: GuestConfig,
    print_serial: bool,
    cuda: bool,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut image_dir = None;
    let mut job = None;
    let mut gpu = GuestGpu::Vgpu;
    let mut server_bin = None;
    let mut server_args = Vec::new();
    let mut timeout = Duration::from_secs(300);
    let mut accel = None;
    let mut transport = JobTransport::Auto;
    let mut ram_mib = 1024;
    let mut extra_cmdline = String::new();
    let mut allow_reboot = false;
    let mut print_serial = false;
    let mut qemu_args = Vec::new();
    let mut cuda = false;
    let mut scheduler = None;
    let mut vm_name = None;
    let mut cgroup = None;
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--job" => job = Some(value("--job")?),
            "--job-file" => {
                let path = value("--job-file")?;
                job = Some(std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?);
            }
            "--gpu" => {
                gpu = match value("--gpu")?.as_str() {
                    "vgpu" => GuestGpu::Vgpu,
                    "virtio-gpu" => GuestGpu::QemuVirtioGpu,
                    "virtio-gpu-gl" => GuestGpu::QemuVirtioGpuGl,
                    "vhost-user-gpu" => GuestGpu::VhostUserGpu,
                    "none" => GuestGpu::None,
                    other => return Err(format!("--gpu: unknown GPU {other:?}")),
                }
            }
            "--socket" => gpu = GuestGpu::VfioUser(PathBuf::from(value("--socket")?)),
            "--server" => server_bin = Some(PathBuf::from(value("--server")?)),
            "--server-arg" => server_args.push(value("--server-arg")?),
            "--scheduler" => scheduler = Some(value("--scheduler")?),
            "--vm-name" => vm_name = Some(value("--vm-name")?),
            "--cgroup" => cgroup = Some(value("--cgroup")?),
            "--image" => image_dir = Some(PathBuf::from(value("--image")?)),
            "--timeout" => {
                let secs: f64 = value("--timeout")?
                    .parse()
                    .map_err(|e| format!("--timeout: {e}"))?;
                timeout =
                    Duration::try_from_secs_f64(secs).map_err(|e| format!("--timeout: {e}"))?;
            }
            "--accel" => {
                accel = match value("--accel")?.as_str() {
                    "auto" => None,
                    "tcg" => Some(Accel::Tcg),
                    "kvm" => Some(Accel::Kvm),
                    other => return Err(format!("--accel: unknown accelerator {other:?}")),
                }
            }
            "--fw-cfg" => transport = JobTransport::FwCfg,
            "--cmdline" => transport = JobTransport::Cmdline,
            "--ram" => ram_mib = value("--ram")?.parse().map_err(|e| format!("--ram: {e}"))?,
            "--append" => extra_cmdline = value("--append")?,
            "--allow-reboot" => allow_reboot = true,
            "--serial" => print_serial = true,
            "--qemu-arg" => qemu_args.push(value("--qemu-arg")?),
            "--cuda" => cuda = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let job = job.ok_or("--job or --job-file is required")?;
    match (scheduler, vm_name) {
        (Some(socket), Some(name)) => {
            if gpu != GuestGpu::Vgpu {
                return Err("--scheduler needs --gpu vgpu".into());
            }
            server_args.extend(["--scheduler".into(), socket, "--vm-name".into(), name]);
        }
        (None, None) => {}
        _ => return Err("--scheduler and --vm-name go together".into()),
    }
    let image = match image_dir {
        Some(dir) => GuestImage::at(&dir),
        None => GuestImage::locate(),
    }
    .map_err(|e| e.to_string())?;
    let mut config = GuestConfig::new(image, job).gpu(gpu).timeout(timeout);
    config.server_bin = server_bin;
    config.server_args = server_args;
    config.accel = accel;
    config.transport = transport;
    config.ram_mib = ram_mib;
    config.extra_cmdline = extra_cmdline;
    config.allow_reboot = allow_reboot;
    config.extra_qemu_args = qemu_args;
    config.cgroup = cgroup;
    Ok(Args {
        config,
        print_serial,
        cuda,
    })
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

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("vgpu-run-vm: {msg}");
            }
            eprintln!("{USAGE}");
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
    let guest = match RunningGuest::launch(&config) {
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
    // Print the job's output as it arrives (or every line with --serial).
    let mut in_job = false;
    let result = guest.wait(|line| {
        if line.starts_with("VGPU-BEGIN") {
            in_job = true;
        } else if line.starts_with("VGPU-EXIT") {
            in_job = false;
        } else if in_job && !args.print_serial {
            println!("{line}");
        }
        if args.print_serial {
            println!("{line}");
        }
    });
    match result {
        Ok(run) => {
            eprintln!("vgpu-run-vm: {}", run.timing());
            match run.exit_code {
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
