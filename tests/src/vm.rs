//! A QEMU process under qtest control.

use std::fs::File;
use std::io;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use vgpu_guest_drivers::guest_ram::GuestRam;
use vgpu_guest_drivers::qtest::{Qtest, QtestError};
use vgpu_schedd::cgroup::{CgroupError, CgroupFs, VmCgroup};

use crate::qemu_path;
use crate::temp_dir::TempDir;

/// How often process state and the listener are polled while waiting.
const WAIT_POLL: Duration = Duration::from_millis(10);
/// How long QEMU may take to exit after hanging up on qtest.
const EXIT_AFTER_HANGUP: Duration = Duration::from_secs(5);
/// Lines of the qtest traffic log shown when a test fails.
const QTEST_LOG_TAIL_LINES: usize = 40;

/// Errors of the VM harness.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A file, socket or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A qtest command failed.
    #[error(transparent)]
    Qtest(#[from] QtestError),
    /// QEMU exited before it was ready (e.g. a device failed to initialise).
    #[error("QEMU exited ({status}) while starting; its output:\n{log}")]
    QemuExited {
        /// Its exit status.
        status: ExitStatus,
        /// Its stdout and stderr.
        log: String,
    },
    /// QEMU did not connect to the qtest socket and finish initialisation in time.
    #[error("QEMU was not ready within {timeout:?}; its output:\n{log}")]
    StartTimeout {
        /// How long was waited.
        timeout: Duration,
        /// Its stdout and stderr.
        log: String,
    },
    /// QEMU did not exit in time.
    #[error("QEMU did not exit within {0:?}")]
    ExitTimeout(Duration),
    /// QEMU's cgroup ([`VmConfig::cgroup`]) could not be created or joined.
    #[error("QEMU's cgroup: {0}")]
    Cgroup(#[from] CgroupError),
}

/// Result type of the harness.
pub type Result<T> = std::result::Result<T, HarnessError>;

fn io_context(context: impl Into<String>) -> impl FnOnce(io::Error) -> HarnessError {
    let context = context.into();
    move |source| HarnessError::Io { context, source }
}

/// What to start QEMU with.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Guest RAM in MiB (a shared memfd backend, so vfio-user servers can map it).
    pub ram_mib: u64,
    /// Values of `-device` arguments, e.g. `virtio-gpu-pci` or the JSON from
    /// [`vfio_user_pci_device`].
    pub devices: Vec<String>,
    /// Further arguments, appended last.
    pub extra_args: Vec<String>,
    /// Longest wait for any single qtest reply.
    pub qtest_timeout: Duration,
    /// Longest wait for QEMU to start and connect to the qtest socket.
    pub start_timeout: Duration,
    /// Record the qtest traffic (`-qtest-log`) in the VM's directory; its tail is printed when
    /// a test fails.
    pub qtest_log: bool,
    /// Puts QEMU into a new CPU cgroup of this name (under the cpu controller's root, v1 or
    /// v2: [`CgroupFs::create_vm_cgroup`]) right after it starts, before it connects to any
    /// vfio-user server, so that `vgpu-schedd` samples and weights the VM alone; the cgroup is
    /// removed when QEMU has exited. `None`: QEMU stays in the launcher's cgroup.
    pub cgroup: Option<String>,
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            ram_mib: 256,
            devices: Vec::new(),
            extra_args: Vec::new(),
            qtest_timeout: Duration::from_secs(10),
            start_timeout: Duration::from_secs(30),
            qtest_log: false,
            cgroup: None,
        }
    }
}

impl VmConfig {
    /// Adds a `-device` argument.
    pub fn device(mut self, device: impl Into<String>) -> Self {
        self.devices.push(device.into());
        self
    }

    /// Runs QEMU in a new CPU cgroup `name` ([`VmConfig::cgroup`]).
    pub fn cgroup(mut self, name: impl Into<String>) -> Self {
        self.cgroup = Some(name.into());
        self
    }

    /// Sets the guest RAM size.
    pub fn ram_mib(mut self, ram_mib: u64) -> Self {
        self.ram_mib = ram_mib;
        self
    }
}

/// How long QEMU's vfio-user client waits for each reply of the device (`x-msg-timeout`).
/// QEMU's own 5 s is shorter than the stalls of a loaded 2-core host running two TCG guests
/// beside `stress-ng` (`test.sh --loaded`), where a device attach once timed out; a late
/// reply is not what these tests look for, a missing one still ends the VM.
pub const MSG_TIMEOUT_MS: u32 = 30_000;

/// The `-device` value (JSON form) of a `vfio-user-pci` device connecting to `socket`.
pub fn vfio_user_pci_device(socket: &Path) -> String {
    let mut path = String::new();
    for c in socket.to_string_lossy().chars() {
        match c {
            '"' | '\\' => {
                path.push('\\');
                path.push(c);
            }
            c if c.is_control() => path.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => path.push(c),
        }
    }
    format!(
        r#"{{"driver":"vfio-user-pci","socket":{{"path":"{path}","type":"unix"}},"x-msg-timeout":{MSG_TIMEOUT_MS}}}"#
    )
}

/// Kills (SIGKILL) and reaps a child unless it has exited already.
fn kill_and_reap(child: &mut Child) -> io::Result<ExitStatus> {
    if let Some(status) = child.try_wait()? {
        return Ok(status);
    }
    child.kill()?;
    child.wait()
}

/// Owns the QEMU child process: it is killed and reaped whenever this is dropped.
#[derive(Debug)]
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Err(e) = kill_and_reap(&mut self.0) {
            log::warn!("cannot kill QEMU (pid {}): {e}", self.0.id());
        }
    }
}

/// QEMU's own cgroup: created for it and removed once it has exited (the guard drops after the
/// QEMU guard, which reaps it).
#[derive(Debug)]
pub(crate) struct CgroupGuard(Option<VmCgroup>);

impl CgroupGuard {
    /// Creates the cgroup `name` under the cpu controller's root and moves `pid` into it; the
    /// cgroup is removed again if the move fails.
    pub(crate) fn join(name: &str, pid: u32) -> std::result::Result<Self, CgroupError> {
        let cgroup = CgroupFs::default().create_vm_cgroup("", name)?;
        if let Err(e) = cgroup.add_pid(pid) {
            if let Err(undo) = cgroup.remove() {
                log::warn!("cannot remove the cgroup {name}: {undo}");
            }
            return Err(e);
        }
        log::info!(
            "QEMU (pid {pid}) runs in cgroup {}",
            cgroup.path().display()
        );
        Ok(Self(Some(cgroup)))
    }

    /// No cgroup of its own: QEMU stays where it was started.
    pub(crate) fn none() -> Self {
        Self(None)
    }

    /// The cgroup's directory, if QEMU has one.
    pub(crate) fn path(&self) -> Option<PathBuf> {
        self.0.as_ref().map(VmCgroup::path)
    }
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        if let Some(cgroup) = self.0.take() {
            let path = cgroup.path();
            if let Err(e) = cgroup.remove() {
                log::warn!("cannot remove cgroup {}: {e}", path.display());
            }
        }
    }
}

/// Polls until the child exits or `timeout` passes.
fn wait_timeout(child: &mut Child, timeout: Duration) -> io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        thread::sleep(WAIT_POLL);
    }
}

/// How QEMU's start ended.
enum Startup {
    Ready(Qtest),
    Exited(ExitStatus),
    TimedOut,
}

/// Waits for QEMU to connect to the qtest socket and finish initialisation.
fn start(listener: &UnixListener, child: &mut Child, config: &VmConfig) -> Result<Startup> {
    let deadline = Instant::now() + config.start_timeout;
    let stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(io_context("accepting QEMU's qtest connection")(e)),
        }
        if let Some(status) = child.try_wait().map_err(io_context("waiting for QEMU"))? {
            return Ok(Startup::Exited(status));
        }
        if Instant::now() >= deadline {
            return Ok(Startup::TimedOut);
        }
        thread::sleep(WAIT_POLL);
    };
    stream
        .set_nonblocking(false)
        .map_err(io_context("configuring qtest socket"))?;
    let left = deadline.saturating_duration_since(Instant::now());
    let mut qtest = Qtest::new(stream, left.max(WAIT_POLL))?;
    // QEMU connects to qtest before it creates the devices: the first reply comes once
    // initialisation is over, and QEMU hangs up instead if a device fails to initialise.
    match qtest.command("endianness") {
        Ok(_) => {
            qtest.set_timeout(config.qtest_timeout)?;
            Ok(Startup::Ready(qtest))
        }
        Err(QtestError::Timeout { .. }) => Ok(Startup::TimedOut),
        Err(e @ QtestError::Closed { .. }) => {
            match wait_timeout(child, EXIT_AFTER_HANGUP).map_err(io_context("waiting for QEMU"))? {
                Some(status) => Ok(Startup::Exited(status)),
                None => Err(e.into()),
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// A QEMU (q35, `-accel qtest`, no default devices) driven through its qtest socket. Dropping
/// it kills QEMU, prints QEMU's output if the thread is panicking (a failing test), and removes
/// its temporary directory.
#[derive(Debug)]
pub struct QtestVm {
    // Field order is drop order: close the socket, kill QEMU, remove its cgroup, then its
    // directory.
    qtest: Qtest,
    child: ChildGuard,
    cgroup: CgroupGuard,
    ram_bytes: u64,
    log_path: PathBuf,
    qtest_log_path: Option<PathBuf>,
    dir: TempDir,
}

impl QtestVm {
    /// Starts QEMU with `config`, waits for it to connect to a fresh qtest socket and to finish
    /// initialisation (devices realized, vfio-user servers connected). A QEMU that exits or
    /// hangs meanwhile is reported with its output.
    pub fn launch(config: &VmConfig) -> Result<Self> {
        let dir = TempDir::new("vgpu-qtest").map_err(io_context("creating temp dir"))?;
        let socket = dir.path().join("qtest.sock");
        let listener = UnixListener::bind(&socket)
            .map_err(io_context(format!("binding {}", socket.display())))?;
        listener
            .set_nonblocking(true)
            .map_err(io_context("configuring qtest listener"))?;
        let log_path = dir.path().join("qemu.log");
        let log = File::create(&log_path).map_err(io_context("creating QEMU log"))?;
        let stderr = log.try_clone().map_err(io_context("creating QEMU log"))?;
        let qtest_log_path = config.qtest_log.then(|| dir.path().join("qtest.log"));
        let qtest_log_arg = qtest_log_path.as_deref().unwrap_or(Path::new("/dev/null"));
        let ram_bytes = config.ram_mib << 20;

        let mut command = Command::new(qemu_path());
        command
            .args(["-machine", "q35,memory-backend=mem", "-object"])
            .arg(format!(
                "memory-backend-memfd,id=mem,size={}M,share=on",
                config.ram_mib
            ))
            .args(["-accel", "qtest", "-qtest"])
            .arg(format!("unix:{}", socket.display()))
            .arg("-qtest-log")
            .arg(qtest_log_arg)
            .args([
                "-display",
                "none",
                "-nodefaults",
                "-serial",
                "none",
                "-monitor",
                "none",
            ]);
        for device in &config.devices {
            command.arg("-device").arg(device);
        }
        command
            .args(&config.extra_args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr);
        log::info!("launching {command:?}");
        let mut child = ChildGuard(
            command
                .spawn()
                .map_err(io_context(format!("starting {}", qemu_path().display())))?,
        );
        // QEMU connects to vfio-user servers only after it has connected to qtest, which waits
        // for our accept below: it is in its cgroup before any device learns its pid.
        let cgroup = match &config.cgroup {
            Some(name) => CgroupGuard::join(name, child.0.id())?,
            None => CgroupGuard::none(),
        };

        match start(&listener, &mut child.0, config)? {
            Startup::Ready(qtest) => {
                log::info!("QEMU pid {} ready on {}", child.0.id(), socket.display());
                Ok(Self {
                    qtest,
                    child,
                    cgroup,
                    ram_bytes,
                    log_path,
                    qtest_log_path,
                    dir,
                })
            }
            Startup::Exited(status) => Err(HarnessError::QemuExited {
                status,
                log: read_lossy(&log_path),
            }),
            Startup::TimedOut => {
                // The log is only complete once QEMU is gone.
                let _ = kill_and_reap(&mut child.0);
                Err(HarnessError::StartTimeout {
                    timeout: config.start_timeout,
                    log: read_lossy(&log_path),
                })
            }
        }
    }

    /// The qtest connection.
    pub fn qtest(&mut self) -> &mut Qtest {
        &mut self.qtest
    }

    /// Guest RAM size in bytes.
    pub fn ram_bytes(&self) -> u64 {
        self.ram_bytes
    }

    /// A fresh allocator over this VM's guest RAM.
    pub fn guest_ram(&self) -> GuestRam {
        GuestRam::new(self.ram_bytes)
    }

    /// The VM's temporary directory (holds the qtest socket and logs; removed on drop).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The directory of QEMU's own cgroup ([`VmConfig::cgroup`]), if it has one.
    pub fn cgroup_path(&self) -> Option<PathBuf> {
        self.cgroup.path()
    }

    /// QEMU's process ID.
    pub fn pid(&self) -> u32 {
        self.child.0.id()
    }

    /// What QEMU has written to stdout and stderr so far.
    pub fn log(&self) -> String {
        read_lossy(&self.log_path)
    }

    /// Kills QEMU with SIGKILL (unless it has exited already) and returns its exit status.
    /// The qtest connection fails from then on.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        kill_and_reap(&mut self.child.0).map_err(io_context("killing QEMU"))
    }

    /// Waits up to `timeout` for QEMU to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        wait_timeout(&mut self.child.0, timeout)
            .map_err(io_context("waiting for QEMU"))?
            .ok_or(HarnessError::ExitTimeout(timeout))
    }
}

impl Drop for QtestVm {
    fn drop(&mut self) {
        if let Err(e) = self.kill() {
            log::warn!("{e}");
        }
        if thread::panicking() {
            eprintln!(
                "---- QEMU output ({}) ----\n{}---- end of QEMU output ----",
                self.log_path.display(),
                self.log()
            );
            if let Some(path) = &self.qtest_log_path {
                let traffic = read_lossy(path);
                let lines: Vec<_> = traffic.lines().collect();
                let tail = &lines[lines.len().saturating_sub(QTEST_LOG_TAIL_LINES)..];
                eprintln!("---- last qtest traffic ----\n{}", tail.join("\n"));
            }
        }
    }
}

fn read_lossy(path: &Path) -> String {
    match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => format!("<cannot read {}: {e}>", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vfio_user_device_json() {
        assert_eq!(
            vfio_user_pci_device(Path::new("/tmp/a\"b.sock")),
            r#"{"driver":"vfio-user-pci","socket":{"path":"/tmp/a\"b.sock","type":"unix"},"x-msg-timeout":30000}"#
        );
    }
}
