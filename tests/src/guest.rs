//! Boots the Debian test guest (`qemu-scripts/build-guest-image.sh`) under QEMU with a chosen
//! GPU, runs one job in it and collects the result from the serial console.
//!
//! The guest's init (`qemu-scripts/guest/vgpu-init`) takes the job from the kernel command line
//! (`vgpu.run=<base64>`) or, when that would pass the 2047-byte limit, from fw_cfg
//! (`opt/vgpu/run`), prints `VGPU-INIT`, `VGPU-BEGIN`, the job's output and `VGPU-EXIT <code>`
//! on the serial console, and powers off. [`RunningGuest`] owns every process it starts (the
//! `vgpu-server` for [`GuestGpu::Vgpu`] and QEMU): they are killed by their handles and reaped
//! whenever it is dropped, and their logs are printed if that happens during a panic.

use std::fmt;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use vgpu_schedd::cgroup::{CgroupError, CgroupFs};

use crate::control::ControlChannel;
use crate::temp_dir::TempDir;
use crate::vm::CgroupGuard;
use crate::{qemu_path, skip_without_qemu};

/// Environment variable naming the guest image directory (default
/// `${VGPU_CACHE:-$HOME/.cache/vgpu}/guest`).
pub const GUEST_DIR_ENV: &str = "VGPU_GUEST_DIR";
/// Environment variable turning a missing guest image from a skip into a failure (set by
/// `qemu-scripts/test.sh` once it has built the image).
pub const REQUIRE_GUEST_ENV: &str = "VGPU_REQUIRE_GUEST";
/// Environment variable naming the `vgpu-server` binary to start.
pub const SERVER_BIN_ENV: &str = "VGPU_SERVER_BIN";
/// Environment variable forcing the accelerator: `kvm`, `tcg` or `auto` (the default).
pub const ACCEL_ENV: &str = "VGPU_ACCEL";
/// Environment variable naming the host DRM render node QEMU's virgl device renders on
/// (default: the first `/dev/dri/renderD*`, else `/dev/null`, which makes Mesa fall back to
/// llvmpipe).
pub const GL_RENDER_NODE_ENV: &str = "VGPU_GL_RENDER_NODE";
/// Path of the init inside the image.
pub const GUEST_INIT: &str = "/usr/local/sbin/vgpu-init";
/// The guest kernel's command line limit (x86, `COMMAND_LINE_SIZE` minus the terminator).
pub const KERNEL_CMDLINE_MAX: usize = 2047;
/// fw_cfg file the init reads a job from.
pub const FW_CFG_JOB: &str = "opt/vgpu/run";

/// The job of a guest served by the control channel's agent (in the image since
/// build-guest-image.sh installs it).
pub const AGENT_JOB: &str = "exec vgpu-agent";
/// Longest wait for QEMU to create the control channel's socket.
const CONTROL_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How often files and processes are polled while waiting.
const POLL: Duration = Duration::from_millis(20);
/// Longest wait for a started `vgpu-server` to create its socket.
const SERVER_START_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of the serial log shown in error messages.
const SERIAL_TAIL_LINES: usize = 60;
/// The fixed part of the guest's kernel command line.
/// `fsck.mode=skip`: the root is read-only and never dirty; checking it costs seconds under TCG.
const BASE_CMDLINE: &str =
    "console=ttyS0 root=/dev/vda ro rootfstype=ext4 fsck.mode=skip panic=1 quiet mitigations=off";

/// Errors of the guest launcher.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// The guest image is not (completely) built.
    #[error(
        "no guest image in {dir}: {why}. Build it with qemu-scripts/build-guest-image.sh (or set {GUEST_DIR_ENV})"
    )]
    ImageMissing {
        /// The directory looked at.
        dir: PathBuf,
        /// What is missing.
        why: String,
    },
    /// No `vgpu-server` binary was found.
    #[error(
        "no vgpu-server binary ({looked}); build it with `cargo build -p vgpu-server` or set {SERVER_BIN_ENV}"
    )]
    ServerMissing {
        /// Why it is missing.
        looked: String,
    },
    /// The `vhost-user-gpu` backend (or the preload it needs here) is missing.
    #[error("cannot start vhost-user-gpu: {0}")]
    BackendMissing(String),
    /// A file or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A path cannot be passed in a QEMU option (QEMU splits options at commas).
    #[error("path {0} contains a comma, which QEMU options cannot carry")]
    CommaInPath(PathBuf),
    /// `vgpu-server` exited or did not create its socket in time.
    #[error("vgpu-server did not start: {why}; its log:\n{log}")]
    ServerStart {
        /// What happened.
        why: String,
        /// Its stderr.
        log: String,
    },
    /// The guest did not finish within the wall-clock limit (QEMU was killed).
    #[error("the guest did not finish within {limit:?}\n{logs}")]
    Timeout {
        /// The limit.
        limit: Duration,
        /// Serial, QEMU and server logs.
        logs: String,
    },
    /// A bad value for the accelerator override.
    #[error("{ACCEL_ENV}={0:?}: expected kvm, tcg or auto")]
    BadAccel(String),
    /// QEMU's cgroup ([`GuestConfig::cgroup`]) could not be created or joined.
    #[error("QEMU's cgroup: {0}")]
    Cgroup(#[from] CgroupError),
    /// The guest exited before its serial console printed the awaited line
    /// ([`RunningGuest::launch_until`]).
    #[error("the guest exited before it printed a line starting with {marker:?}")]
    EndedEarly {
        /// The awaited line's start.
        marker: String,
    },
    /// The control channel's socket could not be connected.
    #[error("the control channel: {0}")]
    Control(String),
    /// The caller's stop flag ([`GuestConfig::stop`]) was raised; QEMU was killed.
    #[error("stopped before the guest finished\n{logs}")]
    Stopped {
        /// Serial, QEMU and server logs.
        logs: String,
    },
}

/// Result type of the launcher.
pub type Result<T> = std::result::Result<T, GuestError>;

fn io_context(context: impl Into<String>) -> impl FnOnce(io::Error) -> GuestError {
    let context = context.into();
    move |source| GuestError::Io { context, source }
}

/// The files `build-guest-image.sh` produces.
#[derive(Debug, Clone)]
pub struct GuestImage {
    /// The image directory.
    pub dir: PathBuf,
    /// The kernel.
    pub kernel: PathBuf,
    /// Its initramfs.
    pub initrd: PathBuf,
    /// The ext4 root file system.
    pub rootfs: PathBuf,
}

impl GuestImage {
    /// The default image directory: `$VGPU_GUEST_DIR`, else `${VGPU_CACHE:-$HOME/.cache/vgpu}/guest`.
    pub fn default_dir() -> PathBuf {
        cache_path(GUEST_DIR_ENV, "guest")
    }

    /// The image in the default directory.
    pub fn locate() -> Result<Self> {
        Self::at(&Self::default_dir())
    }

    /// The image in `dir`, if the build there completed.
    pub fn at(dir: &Path) -> Result<Self> {
        let image = Self {
            dir: dir.to_owned(),
            kernel: dir.join("vmlinuz"),
            initrd: dir.join("initrd.img"),
            rootfs: dir.join("rootfs.ext4"),
        };
        let stamp = dir.join(".vgpu-guest-complete");
        for path in [&stamp, &image.kernel, &image.initrd, &image.rootfs] {
            if !path.is_file() {
                return Err(GuestError::ImageMissing {
                    dir: dir.to_owned(),
                    why: format!("{} does not exist", path.display()),
                });
            }
        }
        Ok(image)
    }

    /// One line describing the image (its build summary).
    pub fn summary(&self) -> String {
        std::fs::read_to_string(self.dir.join(".vgpu-guest-complete"))
            .ok()
            .and_then(|s| s.lines().nth(2).map(str::to_owned))
            .unwrap_or_default()
    }
}

/// The image, or `None` (after printing why) when it is missing and the calling test should
/// return early. Panics instead when `VGPU_REQUIRE_GUEST` is set. Checks QEMU too.
pub fn skip_without_guest() -> Option<GuestImage> {
    if skip_without_qemu() {
        return None;
    }
    match GuestImage::locate() {
        Ok(image) => Some(image),
        Err(e) if std::env::var_os(REQUIRE_GUEST_ENV).is_some() => panic!("{e}"),
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

/// The accelerator a guest runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualization through /dev/kvm.
    Kvm,
    /// QEMU's binary translation, multi-threaded.
    Tcg,
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

impl Accel {
    /// The accelerator to use here and why: `VGPU_ACCEL` if set, else KVM when /dev/kvm is usable
    /// and not kvm_pvm (nested PVM realizes VMs, but real guest kernels hang in it), else TCG.
    pub fn detect() -> Result<(Accel, String)> {
        match std::env::var(ACCEL_ENV).as_deref() {
            Ok("kvm") => return Ok((Accel::Kvm, format!("forced by {ACCEL_ENV}"))),
            Ok("tcg") => return Ok((Accel::Tcg, format!("forced by {ACCEL_ENV}"))),
            Ok("auto") | Ok("") | Err(std::env::VarError::NotPresent) => {}
            Ok(other) => return Err(GuestError::BadAccel(other.to_owned())),
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(GuestError::BadAccel(v.to_string_lossy().into_owned()));
            }
        }
        Ok(Self::detect_from(
            Path::new("/dev/kvm"),
            Path::new("/sys/module/kvm_pvm"),
        ))
    }

    fn detect_from(kvm: &Path, pvm_module: &Path) -> (Accel, String) {
        if let Err(e) = File::options().read(true).write(true).open(kvm) {
            return (Accel::Tcg, format!("{} not usable: {e}", kvm.display()));
        }
        if pvm_module.exists() {
            return (
                Accel::Tcg,
                format!("{} is kvm_pvm, whose guests hang", kvm.display()),
            );
        }
        (Accel::Kvm, format!("{} usable", kvm.display()))
    }

    fn qemu_args(self) -> [&'static str; 6] {
        match self {
            Accel::Kvm => ["-accel", "kvm", "-cpu", "host", "-smp", "2"],
            Accel::Tcg => [
                "-accel",
                "tcg,thread=multi,tb-size=512",
                "-cpu",
                "max",
                "-smp",
                "2",
            ],
        }
    }
}

/// The GPU the guest gets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum GuestGpu {
    /// Our `vgpu-server`, started for this boot with `--exit-on-disconnect`.
    #[default]
    Vgpu,
    /// A vfio-user server already listening on this socket; the launcher neither starts nor
    /// stops it.
    VfioUser(PathBuf),
    /// QEMU's own `virtio-gpu-pci` (the reference device).
    QemuVirtioGpu,
    /// QEMU's own `virtio-gpu-gl-pci`: virgl in QEMU's process, on an `egl-headless` display
    /// over [`gl_render_node`] (the 3D reference device; [`qemu_gl_support`] tells whether
    /// this QEMU can start it).
    QemuVirtioGpuGl,
    /// QEMU's `vhost-user-gpu-pci` with the prefix's `vhost-user-gpu --virgl` backend process
    /// (virgl in that process, run with [`prefix_exec`]), on an `egl-headless` display over
    /// [`gl_render_node`] like [`GuestGpu::QemuVirtioGpuGl`] ([`vhost_user_gpu_binary`] tells
    /// whether the prefix has it). Its virglrenderer needs a render node (GBM): on a host
    /// without one it cannot initialise virgl and the guest renders with its own llvmpipe.
    VhostUserGpu,
    /// No GPU.
    None,
}

/// How the job reaches the guest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum JobTransport {
    /// The kernel command line if it fits, else fw_cfg.
    #[default]
    Auto,
    /// Always the kernel command line (`vgpu.run=<base64>`).
    Cmdline,
    /// Always fw_cfg (`opt/vgpu/run`).
    FwCfg,
}

/// What to boot.
#[derive(Debug, Clone)]
pub struct GuestConfig {
    /// The guest image.
    pub image: GuestImage,
    /// The GPU.
    pub gpu: GuestGpu,
    /// The job: a shell script run by bash as root in a writable directory.
    pub job: String,
    /// How the job is passed.
    pub transport: JobTransport,
    /// Wall-clock limit from QEMU's start to its exit.
    pub timeout: Duration,
    /// The accelerator; `None` detects it ([`Accel::detect`]).
    pub accel: Option<Accel>,
    /// Guest RAM in MiB (a shared memfd).
    pub ram_mib: u64,
    /// Let a guest reboot restart the machine (by default QEMU exits instead).
    pub allow_reboot: bool,
    /// The `vgpu-server` binary for [`GuestGpu::Vgpu`]; `None` finds it ([`server_binary`]).
    pub server_bin: Option<PathBuf>,
    /// Further `vgpu-server` arguments (e.g. `--display 1280x800`).
    pub server_args: Vec<String>,
    /// Runs `vgpu-server` as `LAUNCHER SERVER ARGS..` (e.g. [`prefix_exec`], to put it on the
    /// QEMU prefix's virglrenderer and Mesa); `None` runs it directly.
    pub server_launcher: Option<PathBuf>,
    /// Appended to the kernel command line.
    pub extra_cmdline: String,
    /// Further QEMU arguments, appended last.
    pub extra_qemu_args: Vec<String>,
    /// Puts QEMU into a new CPU cgroup of this name (under the cpu controller's root, v1 or
    /// v2: [`vgpu_schedd::cgroup::CgroupFs::create_vm_cgroup`]) while it runs, so that `vgpu-schedd` samples and
    /// weights the VM alone; the cgroup is removed when QEMU has exited. `None`: QEMU stays in
    /// the launcher's cgroup.
    pub cgroup: Option<String>,
    /// Raised from elsewhere (e.g. a signal handler) to end the run early: the waits kill QEMU
    /// and return [`GuestError::Stopped`], and dropping the guest stops the server and
    /// removes the cgroup. `None`: only the guest or the time limit ends it.
    pub stop: Option<Arc<AtomicBool>>,
    /// Adds the host-guest control channel: a virtio-serial port named
    /// [`vgpu_guest_drivers::control::PORT_NAME`] on a chardev socket in the run's directory,
    /// connected at launch ([`RunningGuest::control`]). The job should then be
    /// [`AGENT_JOB`] ([`GuestConfig::agent`] sets both).
    pub control: bool,
}

impl GuestConfig {
    /// Boots `image` with our vGPU to run `job`, with a 5-minute limit.
    pub fn new(image: GuestImage, job: impl Into<String>) -> Self {
        Self {
            image,
            gpu: GuestGpu::Vgpu,
            job: job.into(),
            transport: JobTransport::Auto,
            timeout: Duration::from_secs(300),
            accel: None,
            ram_mib: 1024,
            allow_reboot: false,
            server_bin: None,
            server_args: Vec::new(),
            server_launcher: None,
            extra_cmdline: String::new(),
            extra_qemu_args: Vec::new(),
            cgroup: None,
            stop: None,
            control: false,
        }
    }

    /// Makes the guest's job the control channel's agent, with the channel added: the host
    /// starts, stops and hears back from workloads through [`RunningGuest::control`].
    pub fn agent(mut self) -> Self {
        self.job = AGENT_JOB.to_owned();
        self.control = true;
        self
    }

    /// Sets the GPU.
    pub fn gpu(mut self, gpu: GuestGpu) -> Self {
        self.gpu = gpu;
        self
    }

    /// Sets the wall-clock limit.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// Standard base64 (RFC 4648, padded).
pub fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The `vgpu-server` binary: `$VGPU_SERVER_BIN`, else the workspace's, freshly built with the
/// running executable's profile ([`crate::daemon::workspace_binary`]).
pub fn server_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(SERVER_BIN_ENV) {
        return Ok(path.into());
    }
    crate::daemon::workspace_binary("vgpu-server").map_err(|e| GuestError::ServerMissing {
        looked: e.to_string(),
    })
}

/// The QEMU prefix `setup-qemu.sh` installs: `$VGPU_QEMU_PREFIX`, else `qemu` in the cache
/// (`$VGPU_CACHE`, else `~/.cache/vgpu`), the wrappers' rule.
pub fn qemu_prefix() -> PathBuf {
    cache_path("VGPU_QEMU_PREFIX", "qemu")
}

/// What the setup scripts put in the cache: the path in `$override_env` if set, else `name` in
/// `$VGPU_CACHE`, else in `~/.cache/vgpu` (their rule).
pub fn cache_path(override_env: &str, name: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(override_env) {
        return path.into();
    }
    let cache = std::env::var_os("VGPU_CACHE").map_or_else(
        || {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/".into());
            Path::new(&home).join(".cache/vgpu")
        },
        PathBuf::from,
    );
    cache.join(name)
}

/// `qemu-scripts/prefix-exec`: runs a program on the QEMU prefix's loader, libraries and Mesa.
pub fn prefix_exec() -> PathBuf {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../qemu-scripts/prefix-exec").into()
}

/// The prefix's `vhost-user-gpu` (from Debian's qemu-system-gui), if installed.
pub fn vhost_user_gpu_binary() -> Option<PathBuf> {
    Some(qemu_prefix().join("usr/lib/qemu/vhost-user-gpu")).filter(|p| p.is_file())
}

/// Longest wait for a started `vhost-user-gpu` to create its socket.
const BACKEND_START_TIMEOUT: Duration = Duration::from_secs(10);

/// A `vhost-user-gpu` backend serving one QEMU on a socket in the guest's directory; killed on
/// drop.
#[derive(Debug)]
struct VhostUserBackend {
    child: ChildGuard,
    socket: PathBuf,
    log_path: PathBuf,
}

impl VhostUserBackend {
    fn start(dir: &Path) -> Result<Self> {
        let binary = vhost_user_gpu_binary().ok_or_else(|| {
            GuestError::BackendMissing(format!(
                "no vhost-user-gpu in {} (run qemu-scripts/setup-qemu.sh)",
                qemu_prefix().display()
            ))
        })?;
        let socket = dir.join("vhost-user-gpu.sock");
        let log_path = dir.join("vhost-user-gpu.log");
        let log = File::create(&log_path).map_err(io_context("creating vhost-user-gpu log"))?;
        let stderr = log
            .try_clone()
            .map_err(io_context("creating vhost-user-gpu log"))?;
        let mut command = Command::new(prefix_exec());
        command.arg(&binary).arg("--virgl");
        let node = gl_render_node();
        if node.starts_with("/dev/dri") {
            command.arg("--render-node").arg(node);
        }
        let child = command
            .arg("--socket-path")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .spawn()
            .map_err(io_context("starting vhost-user-gpu"))?;
        let mut backend = Self {
            child: ChildGuard {
                name: "vhost-user-gpu",
                child,
            },
            socket,
            log_path,
        };
        let deadline = Instant::now() + BACKEND_START_TIMEOUT;
        while !backend.socket.exists() {
            if let Some(status) = backend
                .child
                .child
                .try_wait()
                .map_err(io_context("vhost-user-gpu"))?
            {
                return Err(GuestError::ServerStart {
                    why: format!("vhost-user-gpu exited ({status})"),
                    log: read_lossy(&backend.log_path),
                });
            }
            if Instant::now() >= deadline {
                let _ = backend.child.kill();
                return Err(GuestError::ServerStart {
                    why: format!("vhost-user-gpu made no socket in {BACKEND_START_TIMEOUT:?}"),
                    log: read_lossy(&backend.log_path),
                });
            }
            thread::sleep(POLL);
        }
        Ok(backend)
    }
}

/// The host render node for QEMU's virgl device: `$VGPU_GL_RENDER_NODE`, else the first
/// `/dev/dri/renderD*`, else `/dev/null` (no DRM render node: Mesa's GBM falls back to
/// software rendering, llvmpipe).
pub fn gl_render_node() -> PathBuf {
    if let Some(node) = std::env::var_os(GL_RENDER_NODE_ENV) {
        return node.into();
    }
    let mut nodes: Vec<PathBuf> = std::fs::read_dir("/dev/dri")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("renderD"))
        })
        .collect();
    nodes.sort();
    nodes
        .into_iter()
        .next()
        .unwrap_or_else(|| PathBuf::from("/dev/null"))
}

fn egl_headless_display(render_node: &Path) -> Result<String> {
    Ok(format!(
        "egl-headless,rendernode={}",
        no_comma(render_node)?.display()
    ))
}

/// Longest wait for the [`qemu_gl_support`] probe.
const GL_PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether this QEMU can start `virtio-gpu-gl-pci` on an `egl-headless` display over
/// [`gl_render_node`]: `Ok(description)` or `Err(why not, with QEMU's output)`. It starts QEMU
/// stopped (`-S`), which initialises the display's EGL and realizes the device, and quits
/// through the monitor (about 0.3 s). Checked once per process.
///
/// The display needs QEMU's EGL stack to be complete and consistent: a prefix with Mesa's
/// `libgbm1` but without `libegl1`/`libegl-mesa0` of the same Mesa loads the host's libEGL
/// and crashes (SIGSEGV), and GBM finds its `dri_gbm.so` backend only through
/// `GBM_BACKENDS_PATH` when the prefix is not installed at `/usr`.
pub fn qemu_gl_support() -> std::result::Result<&'static str, &'static str> {
    static CHECK: std::sync::OnceLock<std::result::Result<String, String>> =
        std::sync::OnceLock::new();
    CHECK
        .get_or_init(probe_qemu_gl)
        .as_ref()
        .map(String::as_str)
        .map_err(String::as_str)
}

fn probe_qemu_gl() -> std::result::Result<String, String> {
    let node = gl_render_node();
    let display = egl_headless_display(&node).map_err(|e| e.to_string())?;
    let dir = TempDir::new("vgpu-gl-probe").map_err(|e| format!("temp dir: {e}"))?;
    let log_path = dir.path().join("qemu.log");
    let log = File::create(&log_path).map_err(|e| format!("QEMU log: {e}"))?;
    let stderr = log.try_clone().map_err(|e| format!("QEMU log: {e}"))?;
    let mut command = Command::new(qemu_path());
    command
        .args(["-machine", "q35", "-accel", "tcg", "-nodefaults", "-S"])
        .args(["-serial", "none", "-monitor", "stdio", "-display"])
        .arg(&display)
        .args(["-device", "virtio-gpu-gl-pci"])
        .stdin(Stdio::piped())
        .stdout(log)
        .stderr(stderr);
    let child = command
        .spawn()
        .map_err(|e| format!("starting {}: {e}", qemu_path().display()))?;
    let mut qemu = ChildGuard {
        name: "QEMU (GL probe)",
        child,
    };
    if let Some(mut stdin) = qemu.child.stdin.take() {
        // QEMU reads the monitor only once it is up; an early exit makes this fail harmlessly.
        let _ = stdin.write_all(b"quit\n");
    }
    let deadline = Instant::now() + GL_PROBE_TIMEOUT;
    let status = loop {
        match qemu.child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = qemu.kill();
                return Err(format!(
                    "QEMU with virtio-gpu-gl-pci and -display {display} did not quit within {GL_PROBE_TIMEOUT:?}:\n{}",
                    read_lossy(&log_path)
                ));
            }
            Ok(None) => thread::sleep(POLL),
            Err(e) => return Err(format!("waiting for QEMU: {e}")),
        }
    };
    if status.success() {
        Ok(format!("virtio-gpu-gl-pci with -display {display}"))
    } else {
        Err(format!(
            "QEMU cannot start virtio-gpu-gl-pci with -display {display} ({status}):\n{}",
            read_lossy(&log_path).trim_end()
        ))
    }
}

/// A child process killed (SIGKILL, by its handle) and reaped when dropped.
#[derive(Debug)]
struct ChildGuard {
    name: &'static str,
    child: Child,
}

impl ChildGuard {
    fn kill(&mut self) -> io::Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        self.child.kill()?;
        self.child.wait()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Err(e) = self.kill() {
            log::warn!("cannot kill {} (pid {}): {e}", self.name, self.child.id());
        }
    }
}

fn read_lossy(path: &Path) -> String {
    match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => format!("<cannot read {}: {e}>", path.display()),
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn no_comma(path: &Path) -> Result<&Path> {
    if path.to_string_lossy().contains(',') {
        Err(GuestError::CommaInPath(path.to_owned()))
    } else {
        Ok(path)
    }
}

/// A `vgpu-server` process serving a socket in its own temporary directory; killed and reaped
/// on drop.
#[derive(Debug)]
pub struct ServerProcess {
    child: ChildGuard,
    socket: PathBuf,
    log_path: PathBuf,
    _dir: TempDir,
}

impl ServerProcess {
    /// Starts `binary --socket <dir>/vgpu.sock --log-level info [--exit-on-disconnect] args..`
    /// and waits for its socket.
    pub fn start(binary: &Path, exit_on_disconnect: bool, args: &[String]) -> Result<Self> {
        Self::start_env(binary, exit_on_disconnect, args, &[])
    }

    /// [`ServerProcess::start`] with `env` added to its environment.
    pub fn start_env(
        binary: &Path,
        exit_on_disconnect: bool,
        args: &[String],
        env: &[(&str, &str)],
    ) -> Result<Self> {
        Self::start_via(None, binary, exit_on_disconnect, args, env)
    }

    /// [`ServerProcess::start_env`] run as `launcher binary ...` when `launcher` is given.
    pub fn start_via(
        launcher: Option<&Path>,
        binary: &Path,
        exit_on_disconnect: bool,
        args: &[String],
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let dir = TempDir::new("vgpu-guest-server").map_err(io_context("creating temp dir"))?;
        let socket = dir.path().join("vgpu.sock");
        let log_path = dir.path().join("server.log");
        let log = File::create(&log_path).map_err(io_context("creating server log"))?;
        let mut command = match launcher {
            Some(launcher) => {
                let mut c = Command::new(launcher);
                c.arg(binary);
                c
            }
            None => Command::new(binary),
        };
        command
            .arg("--socket")
            .arg(&socket)
            .args(["--log-level", "info"]);
        if exit_on_disconnect {
            command.arg("--exit-on-disconnect");
        }
        command
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        log::info!("starting {command:?}");
        let child = command
            .spawn()
            .map_err(io_context(format!("starting {}", binary.display())))?;
        let mut server = Self {
            child: ChildGuard {
                name: "vgpu-server",
                child,
            },
            socket,
            log_path,
            _dir: dir,
        };
        let deadline = Instant::now() + SERVER_START_TIMEOUT;
        while !server.socket.exists() {
            if let Some(status) = server.try_wait()? {
                return Err(GuestError::ServerStart {
                    why: format!("it exited ({status})"),
                    log: server.log(),
                });
            }
            if Instant::now() >= deadline {
                let _ = server.child.kill();
                return Err(GuestError::ServerStart {
                    why: format!("no socket after {SERVER_START_TIMEOUT:?}"),
                    log: server.log(),
                });
            }
            thread::sleep(POLL);
        }
        Ok(server)
    }

    /// The socket it listens on.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Its process ID.
    pub fn pid(&self) -> u32 {
        self.child.child.id()
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        read_lossy(&self.log_path)
    }

    /// Asserts that the server is still running a moment after `event` (a grace period for a
    /// crash to show), printing its log otherwise.
    pub fn assert_survived(&mut self, event: &str) {
        thread::sleep(Duration::from_millis(500));
        assert!(
            self.try_wait().expect("server state").is_none(),
            "the server exited after {event}:\n{}",
            self.log()
        );
    }

    /// Its exit status if it has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        self.child
            .child
            .try_wait()
            .map_err(io_context("waiting for vgpu-server"))
    }

    /// Waits up to `timeout` for it to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            thread::sleep(POLL);
        }
    }

    /// Waits up to `timeout` for a log line containing `needle`.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.log().contains(needle) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(POLL);
        }
    }

    /// Kills it (SIGKILL) unless it has exited, and reaps it.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        self.child.kill().map_err(io_context("killing vgpu-server"))
    }
}

/// Reads a growing file line by line.
#[derive(Debug)]
struct LineFollower {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl LineFollower {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            partial: Vec::new(),
        }
    }

    /// Complete lines appended since the last call (without `\r`/`\n`).
    fn poll(&mut self) -> io::Result<Vec<String>> {
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        file.seek(SeekFrom::Start(self.offset))?;
        let mut new = Vec::new();
        file.read_to_end(&mut new)?;
        self.offset += new.len() as u64;
        self.partial.extend_from_slice(&new);
        let mut lines = Vec::new();
        while let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            let text = String::from_utf8_lossy(&line);
            lines.push(text.trim_end_matches(['\r', '\n']).to_owned());
        }
        Ok(lines)
    }
}

/// What a finished boot produced.
#[derive(Debug, Clone)]
pub struct GuestRun {
    /// The job's exit code (`None` if the guest never printed `VGPU-EXIT`).
    pub exit_code: Option<i32>,
    /// The job's output: the lines between the last `VGPU-BEGIN` and its `VGPU-EXIT`.
    pub output: String,
    /// Everything the guest printed on its serial console.
    pub serial: String,
    /// The accelerator used and why.
    pub accel: Accel,
    /// Why that accelerator.
    pub accel_reason: String,
    /// Host time from QEMU's start to the first `VGPU-INIT` line.
    pub boot_to_init: Option<Duration>,
    /// Guest uptime when its init started, as it reported.
    pub guest_uptime_at_init: Option<f64>,
    /// Host time from QEMU's start to its exit.
    pub wall: Duration,
    /// QEMU's exit status.
    pub qemu_status: ExitStatus,
    /// QEMU's stdout and stderr.
    pub qemu_log: String,
    /// The log of the server the launcher started, if any.
    pub server_log: Option<String>,
}

impl GuestRun {
    /// One line for reports: accelerator, times, exit code.
    pub fn timing(&self) -> String {
        let init = self
            .boot_to_init
            .map_or("never".into(), |d| format!("{:.1} s", d.as_secs_f64()));
        let uptime = self
            .guest_uptime_at_init
            .map_or(String::new(), |u| format!(" (guest uptime {u:.1} s)"));
        format!(
            "accel {} ({}), boot to init {init}{uptime}, total {:.1} s, job exit {}",
            self.accel,
            self.accel_reason,
            self.wall.as_secs_f64(),
            self.exit_code.map_or("none".to_owned(), |c| c.to_string())
        )
    }

    /// The serial, QEMU and server logs, for failure messages.
    pub fn logs(&self) -> String {
        let mut s = format!(
            "---- serial (last {SERIAL_TAIL_LINES} lines) ----\n{}\n---- QEMU ({}) ----\n{}",
            tail(&self.serial, SERIAL_TAIL_LINES),
            self.qemu_status,
            self.qemu_log
        );
        if let Some(log) = &self.server_log {
            s.push_str(&format!("\n---- vgpu-server ----\n{log}"));
        }
        s
    }
}

/// A booting guest. Dropping it kills QEMU and the server it started (printing their logs if
/// the thread is panicking) and removes its temporary directory.
#[derive(Debug)]
pub struct RunningGuest {
    // Field order is drop order: QEMU first, then its cgroup, the server, the directory.
    qemu: ChildGuard,
    cgroup: CgroupGuard,
    server: Option<ServerProcess>,
    backend: Option<VhostUserBackend>,
    accel: Accel,
    accel_reason: String,
    timeout: Duration,
    stop: Option<Arc<AtomicBool>>,
    started: Instant,
    serial: LineFollower,
    serial_lines: Vec<String>,
    boot_to_init: Option<Duration>,
    qemu_log_path: PathBuf,
    control: Option<ControlChannel>,
    dir: TempDir,
}

impl RunningGuest {
    /// Starts the server (for [`GuestGpu::Vgpu`]) and QEMU.
    pub fn launch(config: &GuestConfig) -> Result<Self> {
        let (accel, accel_reason) = match config.accel {
            Some(accel) => (accel, "chosen by the caller".to_owned()),
            None => Accel::detect()?,
        };
        let dir = TempDir::new("vgpu-guest").map_err(io_context("creating temp dir"))?;
        let serial_path = dir.path().join("serial.log");
        let qemu_log_path = dir.path().join("qemu.log");
        let image = &config.image;

        let server = match &config.gpu {
            GuestGpu::Vgpu => {
                let binary = match &config.server_bin {
                    Some(path) => path.clone(),
                    None => server_binary()?,
                };
                Some(ServerProcess::start_via(
                    config.server_launcher.as_deref(),
                    &binary,
                    true,
                    &config.server_args,
                    &[],
                )?)
            }
            _ => None,
        };
        let backend = match &config.gpu {
            GuestGpu::VhostUserGpu => Some(VhostUserBackend::start(dir.path())?),
            _ => None,
        };

        let mut cmdline = format!("{BASE_CMDLINE} init={GUEST_INIT}");
        if !config.extra_cmdline.is_empty() {
            cmdline.push(' ');
            cmdline.push_str(&config.extra_cmdline);
        }
        let encoded = format!(" vgpu.run={}", base64(config.job.as_bytes()));
        let fits = cmdline.len() + encoded.len() <= KERNEL_CMDLINE_MAX;
        let use_fw_cfg = match config.transport {
            JobTransport::Auto => !fits,
            JobTransport::Cmdline => false,
            JobTransport::FwCfg => true,
        };
        let mut command = Command::new(qemu_path());
        if use_fw_cfg {
            let job_path = dir.path().join("job.sh");
            std::fs::write(&job_path, &config.job).map_err(io_context("writing job.sh"))?;
            command.arg("-fw_cfg").arg(format!(
                "name={FW_CFG_JOB},file={}",
                no_comma(&job_path)?.display()
            ));
        } else {
            cmdline.push_str(&encoded);
        }

        command
            .args(["-machine", "q35,memory-backend=mem", "-object"])
            .arg(format!(
                "memory-backend-memfd,id=mem,size={}M,share=on",
                config.ram_mib
            ))
            .args(accel.qemu_args())
            .arg("-kernel")
            .arg(&image.kernel)
            .arg("-initrd")
            .arg(&image.initrd)
            .arg("-append")
            .arg(&cmdline)
            .arg("-drive")
            .arg(format!(
                "file={},format=raw,if=virtio,readonly=on",
                no_comma(&image.rootfs)?.display()
            ))
            .arg("-serial")
            .arg(format!("file:{}", no_comma(&serial_path)?.display()))
            .args(["-nodefaults", "-monitor", "none"]);
        if !config.allow_reboot {
            command.arg("-no-reboot");
        }
        match &config.gpu {
            GuestGpu::Vgpu => {
                let socket = server.as_ref().map(ServerProcess::socket);
                command
                    .arg("-device")
                    .arg(crate::vfio_user_pci_device(socket.unwrap_or(Path::new(""))));
            }
            GuestGpu::VfioUser(socket) => {
                command
                    .arg("-device")
                    .arg(crate::vfio_user_pci_device(socket));
            }
            GuestGpu::QemuVirtioGpu => {
                command.args(["-device", "virtio-gpu-pci"]);
            }
            GuestGpu::QemuVirtioGpuGl => {
                command
                    .args(["-device", "virtio-gpu-gl-pci", "-display"])
                    .arg(egl_headless_display(&gl_render_node())?);
            }
            GuestGpu::VhostUserGpu => {
                let socket = backend
                    .as_ref()
                    .map_or(Path::new(""), |b| b.socket.as_path());
                command
                    .arg("-chardev")
                    .arg(format!(
                        "socket,id=vgpu,path={}",
                        no_comma(socket)?.display()
                    ))
                    .args(["-device", "vhost-user-gpu-pci,chardev=vgpu", "-display"])
                    .arg(egl_headless_display(&gl_render_node())?);
            }
            GuestGpu::None => {}
        }
        if !matches!(
            config.gpu,
            GuestGpu::QemuVirtioGpuGl | GuestGpu::VhostUserGpu
        ) {
            command.args(["-display", "none"]);
        }
        let control_path = dir.path().join("control.sock");
        if config.control {
            command
                .args(["-device", "virtio-serial-pci,id=vgpuser", "-chardev"])
                .arg(format!(
                    "socket,id=vgpuctl,path={},server=on,wait=off",
                    no_comma(&control_path)?.display()
                ))
                .arg("-device")
                .arg(format!(
                    "virtserialport,bus=vgpuser.0,chardev=vgpuctl,name={}",
                    vgpu_guest_drivers::control::PORT_NAME
                ));
        }
        let log = File::create(&qemu_log_path).map_err(io_context("creating QEMU log"))?;
        let stderr = log.try_clone().map_err(io_context("creating QEMU log"))?;
        command
            .args(&config.extra_qemu_args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr);
        log::info!("launching {command:?}");
        let started = Instant::now();
        let child = command
            .spawn()
            .map_err(io_context(format!("starting {}", qemu_path().display())))?;
        let qemu = ChildGuard {
            name: "QEMU",
            child,
        };
        let cgroup = match &config.cgroup {
            // QEMU is killed (its guard dropped) if this fails.
            Some(name) => CgroupGuard::join(name, qemu.child.id())?,
            None => CgroupGuard::none(),
        };
        // Connected at once: a line the guest sends while no client is connected is lost.
        let control = if config.control {
            Some(
                ControlChannel::connect(&control_path, CONTROL_CONNECT_TIMEOUT)
                    .map_err(|e| GuestError::Control(e.to_string()))?,
            )
        } else {
            None
        };
        Ok(Self {
            qemu,
            cgroup,
            server,
            backend,
            accel,
            accel_reason,
            timeout: config.timeout,
            stop: config.stop.clone(),
            started,
            serial: LineFollower::new(serial_path),
            serial_lines: Vec::new(),
            boot_to_init: None,
            qemu_log_path,
            control,
            dir,
        })
    }

    /// Boots `config` and waits for the guest to finish.
    pub fn run(config: &GuestConfig) -> Result<GuestRun> {
        Self::launch(config)?.wait(|_| {})
    }

    /// The accelerator in use.
    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// The control channel ([`GuestConfig::control`]).
    pub fn control(&mut self) -> Option<&mut ControlChannel> {
        self.control.as_mut()
    }

    /// The processes that run this guest: QEMU and the device process the launcher started.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = vec![self.qemu_pid()];
        pids.extend(self.server().map(ServerProcess::pid));
        pids
    }

    /// The server the launcher started, if any.
    pub fn server(&self) -> Option<&ServerProcess> {
        self.server.as_ref()
    }

    /// How the server this launcher started ended, if it has (`None` while it runs, or when
    /// the launcher started none).
    pub fn server_exited(&mut self) -> Result<Option<ExitStatus>> {
        match &mut self.server {
            Some(server) => server.try_wait(),
            None => Ok(None),
        }
    }

    /// QEMU's process ID.
    pub fn qemu_pid(&self) -> u32 {
        self.qemu.child.id()
    }

    /// The directory of QEMU's own cgroup ([`GuestConfig::cgroup`]), if it has one.
    pub fn cgroup_path(&self) -> Option<PathBuf> {
        self.cgroup.path()
    }

    /// The guest's temporary directory (serial and QEMU logs, job file).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Time since QEMU started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Reads new serial lines, records when init started, and hands each line to `on_line`.
    fn pump(&mut self, on_line: &mut impl FnMut(&str)) -> Result<()> {
        let lines = self
            .serial
            .poll()
            .map_err(io_context("reading the serial log"))?;
        for line in lines {
            if self.boot_to_init.is_none() && line.starts_with("VGPU-INIT") {
                self.boot_to_init = Some(self.started.elapsed());
            }
            on_line(&line);
            self.serial_lines.push(line);
        }
        Ok(())
    }

    /// Starts a guest ([`RunningGuest::launch`]) and waits until its serial console prints a
    /// line starting with `marker` (typically the job's first output), so that what the caller
    /// measures next happens while the job runs.
    pub fn launch_until(config: &GuestConfig, marker: &str) -> Result<Self> {
        let mut guest = Self::launch(config)?;
        if guest.wait_for_serial(|l| l.starts_with(marker), |_| {})? {
            Ok(guest)
        } else {
            Err(GuestError::EndedEarly {
                marker: marker.to_owned(),
            })
        }
    }

    /// Waits (within the wall-clock limit) until `predicate` holds for a serial line, passing
    /// every line to `on_line` meanwhile. Returns `false` if QEMU exited first.
    pub fn wait_for_serial(
        &mut self,
        predicate: impl Fn(&str) -> bool,
        mut on_line: impl FnMut(&str),
    ) -> Result<bool> {
        let mut seen = self.serial_lines.len();
        loop {
            self.pump(&mut on_line)?;
            if self.serial_lines[seen..].iter().any(|l| predicate(l)) {
                return Ok(true);
            }
            seen = self.serial_lines.len();
            if self.qemu_exited()?.is_some() {
                return Ok(false);
            }
            self.check_deadline()?;
            thread::sleep(POLL);
        }
    }

    fn qemu_exited(&mut self) -> Result<Option<ExitStatus>> {
        self.qemu
            .child
            .try_wait()
            .map_err(io_context("waiting for QEMU"))
    }

    /// Whether QEMU has exited (without waiting), and the serial output so far if it has.
    pub fn exited(&mut self) -> Result<Option<String>> {
        if self.qemu_exited()?.is_none() {
            return Ok(None);
        }
        self.pump(&mut |_| {})?;
        Ok(Some(self.serial_lines.join("\n")))
    }

    /// Ends the run with an error once the time limit has passed or the stop flag is raised.
    fn check_deadline(&mut self) -> Result<()> {
        let stopped = self
            .stop
            .as_ref()
            .is_some_and(|s| s.load(Ordering::Relaxed));
        if !stopped && self.started.elapsed() < self.timeout {
            return Ok(());
        }
        // The logs are only complete once QEMU is gone.
        let status = self.kill()?;
        self.pump(&mut |_| {})?;
        let logs = self.snapshot(status).logs();
        Err(if stopped {
            GuestError::Stopped { logs }
        } else {
            GuestError::Timeout {
                limit: self.timeout,
                logs,
            }
        })
    }

    /// Kills QEMU (SIGKILL, unless it has exited) and reaps it; the server stays.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        self.qemu.kill().map_err(io_context("killing QEMU"))
    }

    /// Waits for QEMU to exit (the guest powers off after its job), passing every serial line
    /// to `on_line`, then waits briefly for a server started with `--exit-on-disconnect`.
    pub fn wait(self, on_line: impl FnMut(&str)) -> Result<GuestRun> {
        self.wait_until(on_line, None)
    }

    /// Ends the boot within `grace`: waits that long for QEMU to exit by itself (a guest told
    /// to power off, or one whose QEMU already went), then kills it; returns what the boot
    /// produced (a killed QEMU's status says so).
    pub fn end(self, grace: Duration) -> Result<GuestRun> {
        self.wait_until(|_| {}, Some(Instant::now() + grace))
    }

    /// [`RunningGuest::wait`], killing QEMU at `kill_at` if it is still running then.
    fn wait_until(
        mut self,
        mut on_line: impl FnMut(&str),
        kill_at: Option<Instant>,
    ) -> Result<GuestRun> {
        let status = loop {
            self.pump(&mut on_line)?;
            if let Some(status) = self.qemu_exited()? {
                break status;
            }
            if kill_at.is_some_and(|t| Instant::now() >= t) {
                break self.kill()?;
            }
            self.check_deadline()?;
            thread::sleep(POLL);
        };
        self.pump(&mut on_line)?;
        if let Some(server) = &mut self.server {
            if server.wait_exit(Duration::from_secs(5))?.is_none() {
                log::warn!("vgpu-server did not exit after QEMU; killing it");
                server.kill()?;
            }
        }
        Ok(self.snapshot(status))
    }

    fn snapshot(&self, qemu_status: ExitStatus) -> GuestRun {
        let serial = self.serial_lines.join("\n");
        let (exit_code, output) = parse_job(&self.serial_lines);
        let guest_uptime_at_init = self
            .serial_lines
            .iter()
            .find_map(|l| l.strip_prefix("VGPU-INIT uptime="))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|u| u.parse().ok());
        GuestRun {
            exit_code,
            output,
            serial,
            accel: self.accel,
            accel_reason: self.accel_reason.clone(),
            boot_to_init: self.boot_to_init,
            guest_uptime_at_init,
            wall: self.started.elapsed(),
            qemu_status,
            qemu_log: read_lossy(&self.qemu_log_path),
            server_log: self
                .server
                .as_ref()
                .map(ServerProcess::log)
                .or_else(|| self.backend.as_ref().map(|b| read_lossy(&b.log_path))),
        }
    }
}

impl Drop for RunningGuest {
    fn drop(&mut self) {
        if let Err(e) = self.qemu.kill() {
            log::warn!("cannot kill QEMU: {e}");
        }
        if let Some(server) = &mut self.server {
            if let Err(e) = server.kill() {
                log::warn!("{e}");
            }
        }
        if thread::panicking() {
            let _ = self.pump(&mut |_| {});
            eprintln!(
                "---- guest serial ----\n{}\n---- QEMU output ----\n{}",
                tail(&self.serial_lines.join("\n"), SERIAL_TAIL_LINES),
                read_lossy(&self.qemu_log_path)
            );
            if let Some(server) = &self.server {
                eprintln!("---- vgpu-server log ----\n{}", server.log());
            }
        }
    }
}

/// The exit code and output of the last `VGPU-BEGIN` .. `VGPU-EXIT <code>` block.
fn parse_job(lines: &[String]) -> (Option<i32>, String) {
    let Some(begin) = lines.iter().rposition(|l| l.starts_with("VGPU-BEGIN")) else {
        return (None, String::new());
    };
    let mut output = Vec::new();
    for line in &lines[begin + 1..] {
        if let Some(code) = line.strip_prefix("VGPU-EXIT ") {
            return (code.trim().parse().ok(), output.join("\n"));
        }
        output.push(line.as_str());
    }
    (None, output.join("\n"))
}

/// A name for a CPU cgroup of the test VM `vm` ([`GuestConfig::cgroup`]):
/// `vgpu-test-<vm>-<pid>`, unique per test process, when this process may create cgroups
/// under the cpu controller's root (probed by creating and removing `vgpu-test-probe-<pid>`);
/// `None` otherwise (not root, no writable cpu controller), and the VM then stays in the
/// test's cgroup.
pub fn test_cgroup(vm: &str) -> Option<String> {
    let pid = std::process::id();
    let probe = format!("vgpu-test-probe-{pid}");
    match CgroupFs::default()
        .create_vm_cgroup("", &probe)
        .and_then(|cgroup| cgroup.remove())
    {
        Ok(()) => Some(format!("vgpu-test-{vm}-{pid}")),
        Err(e) => {
            log::info!("no cgroup for {vm}: this process may not create one ({e})");
            None
        }
    }
}

/// One guest boot at a time in a test process: boots are CPU-bound and each uses two vCPUs.
static BOOT_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the process's boot lock (poisoning by a failed test is ignored).
pub fn boot_lock() -> std::sync::MutexGuard<'static, ()> {
    BOOT_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Prints `[tag] test: what` to the real stderr, past the test harness's capture, so that
/// timings and results always show.
pub fn report(tag: &str, test: &str, what: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "[{tag}] {test}: {what}");
}

/// The value after `key` on the first line of a job's output that starts with it.
pub fn output_value<'a>(output: &'a str, key: &str) -> Option<&'a str> {
    output
        .lines()
        .find_map(|l| l.trim_start().strip_prefix(key))
        .map(str::trim)
}

/// [`output_value`] parsed as a number.
pub fn output_number<T: std::str::FromStr>(output: &str, key: &str) -> Option<T> {
    output_value(output, key).and_then(|v| v.parse().ok())
}

/// The shared object a program of this machine resolves `name` to (libgomp and its plugin).
pub fn host_library(name: &str) -> PathBuf {
    let out = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .expect("ldconfig -p");
    let listing = String::from_utf8_lossy(&out.stdout);
    let path = listing
        .lines()
        .filter(|l| l.trim_start().starts_with(&format!("{name} ")) && l.contains("x86-64"))
        .find_map(|l| l.split("=> ").nth(1))
        .unwrap_or_else(|| {
            panic!("{name} not found by ldconfig (Debian's libgomp1, libgomp-plugin-nvptx1)")
        });
    std::fs::canonicalize(path.trim()).expect("library path")
}

/// An ext4 image in `dir` holding `files` (name in the image, source; a `libcuda.so.1` among
/// them is stripped), for a guest to mount from a second virtio disk: how tests hand the
/// current build of a library or program to the guest (fw_cfg's sysfs files read at about
/// 70 KiB/s under TCG).
pub fn data_disk(dir: &Path, files: &[(&str, PathBuf)]) -> PathBuf {
    let root = dir.join("root");
    std::fs::create_dir_all(&root).expect("disk root");
    let mut bytes = 0;
    for (name, src) in files {
        let dst = root.join(name);
        std::fs::copy(src, &dst).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
        bytes += std::fs::metadata(&dst).expect("copied").len();
    }
    // Debug builds carry their symbols; the guest needs none of them.
    let lib = root.join("libcuda.so.1");
    let stripped = std::process::Command::new("strip")
        .arg(&lib)
        .status()
        .is_ok_and(|s| s.success());
    assert!(stripped, "strip {}", lib.display());
    let image = dir.join("cuda.ext4");
    let mib = (bytes >> 20) * 2 + 16;
    let status = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&root)
        .arg(&image)
        .arg(format!("{mib}M"))
        .stdout(Stdio::null())
        .status()
        .expect("mkfs.ext4 (e2fsprogs)");
    assert!(status.success(), "mkfs.ext4 -d {}", root.display());
    image
}

/// Where [`cuda_payload`]'s disk is mounted in the guest.
pub const CUDA_DIR: &str = "/tmp/work/cuda";

/// The environment line a job on [`cuda_payload`]'s disk needs once it is mounted (a later
/// job in the same guest, through the control channel, starts with it).
pub fn cuda_env() -> String {
    format!("export LD_LIBRARY_PATH={CUDA_DIR} OMP_TARGET_OFFLOAD=MANDATORY\n")
}

/// What a guest needs to run CUDA clients on the vGPU, on a disk made in `dir`: our
/// `libcuda.so.1` (`lib`), this host's libgomp and its nvptx plugin (what the corpus's GCC
/// OpenMP programs were linked with) and the files `programs` of the CUDA corpus in `corpus`.
/// Returns the QEMU arguments that attach the disk and the job prologue that mounts it at
/// [`CUDA_DIR`] and points the loader there (with `OMP_TARGET_OFFLOAD=MANDATORY`: a failed
/// offload is an error, not a silent fall-back to the guest's CPU).
pub fn cuda_payload(
    dir: &Path,
    lib: &Path,
    corpus: &Path,
    programs: &[&str],
) -> (Vec<String>, String) {
    let mut files = vec![
        ("libcuda.so.1", lib.to_path_buf()),
        ("libgomp.so.1", host_library("libgomp.so.1")),
        (
            "libgomp-plugin-nvptx.so.1",
            host_library("libgomp-plugin-nvptx.so.1"),
        ),
    ];
    files.extend(programs.iter().map(|p| (*p, corpus.join(p))));
    let disk = data_disk(dir, &files);
    let (qemu, mount) = second_disk(&disk, CUDA_DIR);
    (qemu, mount + &cuda_env())
}

/// The QEMU arguments that attach the ext4 image `disk` read-only as the guest's second virtio
/// disk (`/dev/vdb`, after the root disk), and the job line that mounts it at `dir` (the job
/// exits 1 if it cannot).
pub fn second_disk(disk: &Path, dir: &str) -> (Vec<String>, String) {
    let qemu = vec![
        "-drive".to_owned(),
        format!("file={},format=raw,if=virtio,readonly=on", disk.display()),
    ];
    (qemu, mount_second_disk(dir))
}

/// The job line that mounts [`second_disk`]'s disk at `dir` (the job exits 1 if it cannot).
pub fn mount_second_disk(dir: &str) -> String {
    format!("mkdir -p {dir} && mount -o ro /dev/vdb {dir} || exit 1\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), expected);
        }
        assert_eq!(base64(&[0xfb, 0xff]), "+/8=");
    }

    #[test]
    fn job_block_is_parsed_from_the_last_begin() {
        let lines: Vec<String> = [
            "noise",
            "VGPU-BEGIN source=cmdline",
            "first boot",
            "VGPU-INIT uptime=1.0",
            "VGPU-BEGIN source=cmdline",
            "a",
            "b",
            "VGPU-EXIT 3",
            "[  1.0] reboot: Power down",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(parse_job(&lines), (Some(3), "a\nb".to_owned()));
        assert_eq!(parse_job(&lines[..7]), (None, "a\nb".to_owned()));
        assert_eq!(parse_job(&lines[..1]), (None, String::new()));
    }

    #[test]
    fn accel_falls_back_to_tcg() {
        let dir = TempDir::new("vgpu-accel-test").unwrap();
        let missing = dir.path().join("kvm");
        assert_eq!(Accel::detect_from(&missing, &missing).0, Accel::Tcg);
        let kvm = dir.path().join("fake-kvm");
        std::fs::write(&kvm, b"").unwrap();
        let pvm = dir.path().join("kvm_pvm");
        assert_eq!(Accel::detect_from(&kvm, &pvm).0, Accel::Kvm);
        std::fs::create_dir(&pvm).unwrap();
        let (accel, why) = Accel::detect_from(&kvm, &pvm);
        assert_eq!(accel, Accel::Tcg);
        assert!(why.contains("kvm_pvm"), "{why}");
    }
}
