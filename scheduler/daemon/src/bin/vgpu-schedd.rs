//! `vgpu-schedd --socket PATH --control PATH [--control-group NAME|GID] [--state-dir DIR]
//! [--metrics 127.0.0.1:PORT] [--policy FILE.toml] [--capacity N] [--switch-cost-us N]
//! [--cpu-writeback] [--server-bin PATH] [--busy-poll-us N] [--log-level LEVEL]`: the host-wide scheduler daemon.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use vgpu_schedd::busy_poll;
use vgpu_schedd::cgroup::CgroupFs;
use vgpu_schedd::control::lookup_group;
use vgpu_schedd::daemon::{DaemonConfig, MAX_GROUP_TIMEOUT_NS, MAX_SWITCH_COST_NS};
use vgpu_schedd::server::{DeviceIds, Server, ServerConfig};
use vgpu_scheduler::PolicyConfig;
use vgpu_scheduler::core::MAX_VGPUS;

const USAGE: &str = "usage: vgpu-schedd --socket PATH --control PATH [--control-group NAME|GID] [--state-dir DIR] [--metrics 127.0.0.1:PORT] [--policy FILE.toml] [--capacity N] [--switch-cost-us N] [--cpu-writeback] [--group-timeout-ms N] [--server-bin PATH] [--device-uid-base UID --device-gid GID] [--busy-poll-us N] [--log-level error|warn|info|debug|trace]

Schedules the GPU command groups of every vgpu-server that connects to the SOCK_SEQPACKET
socket --socket. --control is the JSON-lines control socket vgpuctl talks to: mode 0600, only
the daemon's user and root may use it; with --control-group (a name from /etc/group or a
number) it is 0660 with that group and the group's members may use it too. --state-dir is the
daemon's own directory (0700; default $XDG_RUNTIME_DIR/vgpu-schedd, else
/run/vgpu-schedd/state): vgpuctl create -- --dump writes a VM's scanouts to DIR/dump/NAME/.
--metrics serves
Prometheus text at http://ADDR/metrics (loopback only). --policy starts with the policy of a TOML
file (policy = \"timegraph\" | \"fair\" | \"pegasus\" | \"vgris\" | \"none\", with its family's
fields; default none). --capacity is how many groups the GPU runs at once (default 1);
--switch-cost-us the simulated engine's context switch cost. --group-timeout-ms is how long a
group granted to a device may stay unfinished before the device is dropped (default 2000: the
Windows TDR delay). --cpu-writeback writes the policy's
CPU weights to the VMs' cgroups. vgpuctl create runs --server-bin (default: vgpu-server next to
this binary); with --device-uid-base and --device-gid (numbers, not 0) the k-th of them runs as
user UID+k and group GID (the daemon must be root), and --socket is 0660 with group GID. --busy-poll-us is the longest the daemon's loop spins for the next device message before it
sleeps (default 200, 0: never; the window adapts, an idle daemon does not spin). SIGTERM or SIGINT stops the daemon, its children and removes its sockets.";

/// Largest `--capacity`: every vGPU running at once.
const MAX_CAPACITY: usize = MAX_VGPUS;
/// Largest policy file read.
const MAX_POLICY_FILE_BYTES: u64 = 1024 * 1024;
/// Where `--control-group NAME` is looked up (groups of other sources need a number).
const GROUP_FILE: &str = "/etc/group";
/// Largest group file read.
const MAX_GROUP_FILE_BYTES: u64 = 16 * 1024 * 1024;

struct Args {
    config: ServerConfig,
    log_level: String,
}

fn number<T: std::str::FromStr>(name: &str, text: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| format!("{name}: {text:?} is not a valid number"))
}

/// Reads a TOML policy file.
fn read_policy(path: &str) -> Result<PolicyConfig, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("--policy {path}: {e}"))?;
    if meta.len() > MAX_POLICY_FILE_BYTES {
        return Err(format!(
            "--policy {path}: larger than {MAX_POLICY_FILE_BYTES} bytes"
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("--policy {path}: {e}"))?;
    toml::from_str(&text).map_err(|e| format!("--policy {path}: {e}"))
}

/// The group id of `--control-group`: a number, or a name in [`GROUP_FILE`].
fn group_id(text: &str) -> Result<u32, String> {
    if let Ok(gid) = text.parse() {
        return Ok(gid);
    }
    let fail = |e: String| format!("--control-group {text}: {e}");
    let meta = std::fs::metadata(GROUP_FILE).map_err(|e| fail(format!("{GROUP_FILE}: {e}")))?;
    if meta.len() > MAX_GROUP_FILE_BYTES {
        return Err(fail(format!("{GROUP_FILE} is too large")));
    }
    let groups =
        std::fs::read_to_string(GROUP_FILE).map_err(|e| fail(format!("{GROUP_FILE}: {e}")))?;
    lookup_group(&groups, text).ok_or_else(|| fail(format!("no such group in {GROUP_FILE}")))
}

/// `$XDG_RUNTIME_DIR/vgpu-schedd` when that is set to an absolute path, else
/// `/run/vgpu-schedd/state`.
fn default_state_dir() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .map(|p| p.join("vgpu-schedd"))
        .unwrap_or_else(|| PathBuf::from("/run/vgpu-schedd/state"))
}

fn default_server_bin() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("vgpu-server")))
        .unwrap_or_else(|| PathBuf::from("vgpu-server"))
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut socket = None;
    let mut control = None;
    let mut control_group = None;
    let mut state_dir = None;
    let mut metrics = None;
    let mut daemon = DaemonConfig::default();
    let mut server_bin = None;
    let mut uid_base = None;
    let mut device_gid = None;
    let mut log_level = "info".to_string();
    let mut busy_poll = busy_poll::DEFAULT_MAX;
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--socket" => socket = Some(PathBuf::from(value("--socket")?)),
            "--control" => control = Some(PathBuf::from(value("--control")?)),
            "--control-group" => control_group = Some(group_id(&value("--control-group")?)?),
            "--state-dir" => {
                let dir = PathBuf::from(value("--state-dir")?);
                if !dir.is_absolute() {
                    return Err(format!("--state-dir: {} is not absolute", dir.display()));
                }
                state_dir = Some(dir);
            }
            "--metrics" => {
                let addr: SocketAddr = value("--metrics")?
                    .parse()
                    .map_err(|e| format!("--metrics: {e}"))?;
                if !addr.ip().is_loopback() {
                    return Err(format!("--metrics: {addr} is not a loopback address"));
                }
                metrics = Some(addr);
            }
            "--policy" => daemon.policy = read_policy(&value("--policy")?)?,
            "--capacity" => {
                let n: usize = number("--capacity", &value("--capacity")?)?;
                if !(1..=MAX_CAPACITY).contains(&n) {
                    return Err(format!("--capacity: {n} is outside 1..={MAX_CAPACITY}"));
                }
                daemon.capacity = n;
            }
            "--switch-cost-us" => {
                let us: u64 = number("--switch-cost-us", &value("--switch-cost-us")?)?;
                let ns = us.checked_mul(1_000).filter(|&ns| ns <= MAX_SWITCH_COST_NS);
                daemon.switch_cost_ns = ns.ok_or(format!(
                    "--switch-cost-us: {us} is above {} µs",
                    MAX_SWITCH_COST_NS / 1_000
                ))?;
            }
            "--group-timeout-ms" => {
                let ms: u64 = number("--group-timeout-ms", &value("--group-timeout-ms")?)?;
                let ns = ms
                    .checked_mul(1_000_000)
                    .filter(|ns| (1..=MAX_GROUP_TIMEOUT_NS).contains(ns));
                daemon.group_timeout_ns = ns.ok_or(format!(
                    "--group-timeout-ms: {ms} is outside 1..={}",
                    MAX_GROUP_TIMEOUT_NS / 1_000_000
                ))?;
            }
            "--cpu-writeback" => daemon.cpu_writeback = true,
            "--server-bin" => server_bin = Some(PathBuf::from(value("--server-bin")?)),
            "--device-uid-base" => {
                uid_base = Some(number("--device-uid-base", &value("--device-uid-base")?)?)
            }
            "--device-gid" => device_gid = Some(number("--device-gid", &value("--device-gid")?)?),
            "--busy-poll-us" => busy_poll = busy_poll::parse_us(&value("--busy-poll-us")?)?,
            "--log-level" => log_level = value("--log-level")?,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if log_level.parse::<log::LevelFilter>().is_err() {
        return Err(format!("--log-level: unknown level {log_level:?}"));
    }
    let device_ids = match (uid_base, device_gid) {
        (None, None) => None,
        (Some(0), _) | (_, Some(0)) => {
            return Err("--device-uid-base and --device-gid must not be 0 (root)".to_string());
        }
        (Some(uid_base), Some(gid)) => Some(DeviceIds { uid_base, gid }),
        _ => return Err("--device-uid-base and --device-gid go together".to_string()),
    };
    Ok(Args {
        config: ServerConfig {
            socket: socket.ok_or("--socket is required")?,
            control: control.ok_or("--control is required")?,
            control_group,
            state_dir: state_dir.unwrap_or_else(default_state_dir),
            metrics,
            daemon,
            server_bin: server_bin.unwrap_or_else(default_server_bin),
            device_ids,
            cgroups: CgroupFs::default(),
            busy_poll,
        },
        log_level,
    })
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("vgpu-schedd: {msg}");
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
    let server = match Server::bind(args.config) {
        Ok(s) => s,
        Err(e) => {
            log::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        let registered = server
            .stop_handle()
            .and_then(|w| signal_hook::low_level::pipe::register(signal, w));
        if let Err(e) = registered {
            log::error!("installing the handler of signal {signal}: {e}");
            return ExitCode::FAILURE;
        }
    }
    match server.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            ExitCode::FAILURE
        }
    }
}
