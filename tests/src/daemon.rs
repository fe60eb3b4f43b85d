//! A real `vgpu-schedd` for multi-guest tests: started from the workspace's target directory
//! on a socket in a temporary directory, driven with `vgpuctl --json`, killed by pid and
//! restarted on the same socket, its stderr printed when a test fails while it runs; and the
//! [`GuestConfig`] of a real guest whose device process it schedules.

use std::fs::File;
use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;
use thiserror::Error;

use crate::TempDir;
use crate::guest::{self, GuestConfig, GuestImage};

/// Longest wait for the daemon's control socket to accept connections after a start.
pub const START_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a `vgpuctl` call may take before the test calls the daemon stuck.
pub const CTL_TIMEOUT: Duration = Duration::from_secs(10);
/// Interval between two checks while waiting.
const POLL: Duration = Duration::from_millis(10);

/// Errors of the daemon fixture.
#[derive(Debug, Error)]
pub enum DaemonError {
    /// A system call on the fixture's files or children failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A workspace binary is missing and could not be built.
    #[error("{0} not found and `cargo build` did not produce it")]
    Missing(String),
    /// The daemon exited or did not listen in time.
    #[error("vgpu-schedd did not start ({why}); its stderr:\n{log}")]
    Start {
        /// Why the start is considered failed.
        why: String,
        /// The daemon's stderr.
        log: String,
    },
    /// `vgpuctl` failed or printed something that is not JSON.
    #[error("vgpuctl {args:?}: {why}")]
    Ctl {
        /// Its arguments.
        args: Vec<String>,
        /// What went wrong (exit status and stderr, or the parse error).
        why: String,
    },
}

type Result<T> = std::result::Result<T, DaemonError>;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonError {
    let what = what.into();
    move |source| DaemonError::Io { what, source }
}

/// The workspace binary `name` (`vgpu-server`, `vgpu-schedd`, `vgpuctl`, `vgpu-cuda-host`,
/// `libcuda.so`), fresh: the first call in a process runs `cargo build --locked -p vgpu-schedd
/// -p vgpu-server -p mdev-backend --bins` and `-p vgpu-libcuda --lib` with the running test
/// executable's profile into its target directory (a second or so when nothing changed), so
/// a test never runs a binary older than the library code it was built with, as it would after
/// `cargo test -p vgpu-tests` alone. Outside cargo (no `CARGO` in the environment) the binaries
/// beside the executable are taken as they are.
pub fn workspace_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().map_err(io("locating the test executable"))?;
    // target/<profile>/deps/<test>-HASH or target/<profile>/<bin>
    let profile_dir = exe
        .ancestors()
        .skip(1)
        .take(2)
        .find(|d| d.file_name().is_some_and(|n| n != "deps"))
        .ok_or_else(|| DaemonError::Missing(name.to_string()))?;
    static BUILT: OnceLock<bool> = OnceLock::new();
    let built = *BUILT.get_or_init(|| build_binaries(profile_dir));
    let path = profile_dir.join(name);
    if path.is_file() && (built || std::env::var_os("CARGO").is_none()) {
        Ok(path)
    } else {
        Err(DaemonError::Missing(name.to_string()))
    }
}

/// Builds the workspace's binaries into `profile_dir` (`<target>/<profile>`); false when cargo
/// failed. Without `CARGO` (a test executable started by hand) nothing is built.
fn build_binaries(profile_dir: &Path) -> bool {
    let Some(cargo) = std::env::var_os("CARGO") else {
        return false;
    };
    let (Some(target), Some(profile)) = (
        profile_dir.parent(),
        profile_dir.file_name().and_then(|p| p.to_str()),
    ) else {
        return false;
    };
    let profile = if profile == "debug" { "dev" } else { profile };
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let build = |what: &[&str]| {
        Command::new(&cargo)
            .args(["build", "--locked", "--quiet", "--profile", profile])
            .args(what)
            .env("CARGO_TARGET_DIR", target)
            .current_dir(&workspace)
            .status()
            .is_ok_and(|s| s.success())
    };
    build(&[
        "-p",
        "vgpu-schedd",
        "-p",
        "vgpu-server",
        "-p",
        "mdev-backend",
        "-p",
        "vgpu-sim",
        "--bins",
    ]) && build(&["-p", "vgpu-libcuda", "--lib", "--bins"])
}

/// A running `vgpu-schedd`: killed (SIGKILL, by pid) and reaped on drop, its stderr printed
/// if the test is panicking.
#[derive(Debug)]
pub struct Schedd {
    child: Option<Child>,
    dir: TempDir,
    policy: Option<PathBuf>,
    log_level: &'static str,
    args: Vec<String>,
    starts: u32,
}

impl Schedd {
    /// Starts the daemon with the policy in the TOML file `policy` (the daemon's default,
    /// `none`, without one) on fresh sockets, with its simulated engine.
    pub fn start(policy: Option<&str>) -> Result<Schedd> {
        Schedd::start_logging(policy, "debug")
    }

    /// [`Schedd::start`] with the daemon's `--log-level` (benchmarks: `warn`, so logging does
    /// not weigh on what they measure).
    pub fn start_logging(policy: Option<&str>, log_level: &'static str) -> Result<Schedd> {
        Schedd::start_with(policy, log_level, &[])
    }

    /// [`Schedd::start_logging`] with further daemon arguments (e.g. `--cpu-writeback`), kept
    /// for restarts.
    pub fn start_with(
        policy: Option<&str>,
        log_level: &'static str,
        args: &[&str],
    ) -> Result<Schedd> {
        let dir = TempDir::new("vgpu-schedd").map_err(io("creating temp dir"))?;
        let policy = match policy {
            Some(text) => Some(write_file(dir.path(), "policy.toml", text)?),
            None => None,
        };
        let mut daemon = Schedd {
            child: None,
            dir,
            policy,
            log_level,
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            starts: 0,
        };
        daemon.spawn()?;
        Ok(daemon)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("schedd-{}.log", self.starts))
    }

    fn spawn(&mut self) -> Result<()> {
        self.starts = self.starts.saturating_add(1);
        let log = File::create(self.log_path()).map_err(io("creating daemon log"))?;
        let mut command = Command::new(workspace_binary("vgpu-schedd")?);
        command
            .arg("--socket")
            .arg(self.socket())
            .arg("--control")
            .arg(self.control())
            .args(["--log-level", self.log_level]);
        if let Some(policy) = &self.policy {
            command.arg("--policy").arg(policy);
        }
        command.args(&self.args);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        log::info!("starting {command:?}");
        self.child = Some(command.spawn().map_err(io("starting vgpu-schedd"))?);
        let start = Instant::now();
        while UnixStream::connect(self.control()).is_err() {
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            let why = match exited {
                Some(status) => format!("it exited ({status})"),
                None if start.elapsed() > START_TIMEOUT => {
                    format!("no control socket after {START_TIMEOUT:?}")
                }
                None => {
                    std::thread::sleep(POLL);
                    continue;
                }
            };
            self.kill();
            return Err(DaemonError::Start {
                why,
                log: self.log(),
            });
        }
        Ok(())
    }

    /// The socket device processes connect to (`vgpu-server --scheduler`).
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("sched.sock")
    }

    /// The control socket (`vgpuctl --control`).
    pub fn control(&self) -> PathBuf {
        self.dir.path().join("control.sock")
    }

    /// The running daemon's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The current daemon's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Kills the daemon with SIGKILL (sockets stay behind, as after a crash) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the daemon with SIGTERM (its clean shutdown) and waits up to `timeout` for it to
    /// exit; SIGKILLs it if it does not. Returns whether it exited successfully in time.
    pub fn terminate(&mut self, timeout: Duration) -> Result<bool> {
        let Some(mut child) = self.child.take() else {
            return Ok(false);
        };
        let pid = child.id();
        if let Err(e) = vgpu_schedd::seqpacket::terminate(pid) {
            log::warn!("SIGTERM to vgpu-schedd (pid {pid}): {e}");
        }
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().map_err(io("waiting for vgpu-schedd"))? {
                return Ok(status.success());
            }
            if start.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(false);
            }
            std::thread::sleep(POLL);
        }
    }

    /// SIGKILLs the daemon and starts a new one on the same sockets and policy file.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.spawn()
    }

    /// Writes `text` into the daemon's directory as `name` and returns its path (for
    /// `vgpuctl set-policy`).
    pub fn write(&self, name: &str, text: &str) -> Result<PathBuf> {
        write_file(self.dir.path(), name, text)
    }

    /// Runs `vgpuctl --control SOCK --json ARGS` and parses its output; a non-zero exit is an
    /// error carrying its stderr.
    pub fn ctl(&self, args: &[&str]) -> Result<Value> {
        let out = self.run_vgpuctl(args, true)?;
        serde_json::from_slice(&out).map_err(|e| ctl_error(args, e.to_string()))
    }

    /// Runs `vgpuctl --control SOCK ARGS` (its human-readable output), prints the command and
    /// its output straight to stderr, past the test harness's capture, so that the transcript
    /// always shows, and returns the output; a non-zero exit is an error carrying its stderr.
    pub fn transcript(&self, args: &[&str]) -> Result<String> {
        let out = self.run_vgpuctl(args, false)?;
        let text = String::from_utf8_lossy(&out).into_owned();
        let _ = writeln!(std::io::stderr(), "$ vgpuctl {}\n{text}", args.join(" "));
        Ok(text)
    }

    /// Runs `vgpuctl` on the control socket (with `--json` if `json`) and returns its stdout;
    /// kills it after [`CTL_TIMEOUT`].
    fn run_vgpuctl(&self, args: &[&str], json: bool) -> Result<Vec<u8>> {
        let mut command = Command::new(workspace_binary("vgpuctl")?);
        command.arg("--control").arg(self.control());
        if json {
            command.arg("--json");
        }
        let mut child = command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io("starting vgpuctl"))?;
        let start = Instant::now();
        while child
            .try_wait()
            .map_err(io("waiting for vgpuctl"))?
            .is_none()
        {
            if start.elapsed() > CTL_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                return Err(ctl_error(args, format!("no answer in {CTL_TIMEOUT:?}")));
            }
            std::thread::sleep(POLL);
        }
        let out = child
            .wait_with_output()
            .map_err(io("reading vgpuctl output"))?;
        if !out.status.success() {
            return Err(ctl_error(
                args,
                format!(
                    "{}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        Ok(out.stdout)
    }

    /// A real guest booting `image` to run `job` as VM `vm` of this daemon: its `vgpu-server`
    /// connects to [`Schedd::socket`] under that name, and QEMU runs in a CPU cgroup of its own
    /// ([`guest::test_cgroup`]) where this process may create one, so that the daemon samples
    /// the VM's vCPUs alone. The time limit is [`GuestConfig::new`]'s unless set.
    pub fn guest_config(
        &self,
        image: &GuestImage,
        vm: &str,
        job: impl Into<String>,
    ) -> GuestConfig {
        let mut config = GuestConfig::new(image.clone(), job);
        config.server_args = vec![
            "--scheduler".into(),
            self.socket().display().to_string(),
            "--vm-name".into(),
            vm.into(),
        ];
        config.cgroup = guest::test_cgroup(vm);
        config
    }

    /// [`Schedd::guest_config`] for a guest served by the control channel's agent
    /// ([`GuestConfig::agent`]): the host starts its workloads through
    /// [`RunningGuest::control`](crate::guest::RunningGuest::control).
    pub fn agent_config(&self, image: &GuestImage, vm: &str) -> GuestConfig {
        self.guest_config(image, vm, String::new()).agent()
    }

    /// The entry of VM `name` in `vgpuctl --json list` (`Value::Null` if absent).
    pub fn vm_info(&self, name: &str) -> Result<Value> {
        Ok(find_vm(&self.ctl(&["list"])?, name))
    }

    /// The entry of VM `name` in `vgpuctl --json show` (`Value::Null` if absent).
    pub fn vm_stats(&self, name: &str) -> Result<Value> {
        Ok(find_vm(&self.ctl(&["show"])?, name))
    }
}

impl Drop for Schedd {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("---- vgpu-schedd stderr ----\n{}", self.log());
        }
    }
}

fn ctl_error(args: &[&str], why: String) -> DaemonError {
    DaemonError::Ctl {
        args: args.iter().map(|s| (*s).to_string()).collect(),
        why,
    }
}

/// The entry of VM `name` in a `vgpuctl --json list` or `show` answer (`Value::Null` if absent).
pub fn find_vm(answer: &Value, name: &str) -> Value {
    answer["vms"]
        .as_array()
        .and_then(|vms| vms.iter().find(|v| v["name"] == name))
        .cloned()
        .unwrap_or(Value::Null)
}

fn write_file(dir: &Path, name: &str, text: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, text).map_err(io(format!("writing {}", path.display())))?;
    Ok(path)
}
