//! `vgpu-schedd`: the host-wide scheduler daemon (see `vgpu-schedd --help`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use vgpu_schedd::busy_poll;
use vgpu_schedd::cgroup::CgroupFs;
use vgpu_schedd::control::{lookup_group, read_policy_file};
use vgpu_schedd::daemon::{DaemonConfig, MAX_GROUP_TIMEOUT_NS, MAX_SWITCH_COST_NS};
use vgpu_schedd::definitions::{DEFAULT_CONFIG_DIR, Store};
use vgpu_schedd::metrics_listener::{MetricsListenConfig, TlsFiles};
use vgpu_schedd::server::{DeviceIds, Server, ServerConfig};
use vgpu_scheduler::PolicyConfig;
use vgpu_scheduler::core::MAX_VGPUS;

/// Largest `--capacity`: every vGPU running at once.
const MAX_CAPACITY: usize = MAX_VGPUS;
/// Where `--control-group NAME` is looked up (groups of other sources need a number).
const GROUP_FILE: &str = "/etc/group";
/// Largest group file read.
const MAX_GROUP_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// The host-wide scheduler daemon of vgpu.
///
/// Schedules the GPU command groups of every vgpu-server that connects to the SOCK_SEQPACKET
/// socket --socket. SIGTERM or SIGINT stops the daemon, its children and removes its sockets.
#[derive(Debug, Parser)]
#[command(
    name = "vgpu-schedd",
    version,
    after_long_help = "EXAMPLES
  systemctl start vgpu-schedd
  vgpu-schedd --socket /run/vgpu-schedd/schedd.sock --control /run/vgpu-schedd/control.sock --state-dir /var/lib/vgpu-schedd --config-dir /etc/vgpu

FILES
  /etc/vgpu/schedd.env
  /run/vgpu-schedd/schedd.sock
  /run/vgpu-schedd/control.sock
  /run/vgpu-schedd/vms/
  /etc/vgpu/vgpus/ and /etc/vgpu/types/
  /etc/vgpu/live.json
  /var/lib/vgpu-schedd/

The unit reads its options from schedd.env. Device processes connect to schedd.sock, vgpuctl
to control.sock; created device processes listen under vms/. Definitions, types and the live
policy and parameters are in the config directory; scanout dumps in the state directory.

SEE ALSO
vgpuctl(1), vgpu-smi(1), vgpu-server(1), systemd.exec(5); docs/DEPLOY.md and docs/METRICS.md
in the source tree."
)]
struct Cli {
    /// The SOCK_SEQPACKET socket device processes (vgpu-server --scheduler) connect to.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// The JSON-lines control socket vgpuctl talks to: mode 0600, only the daemon's user and
    /// root may use it (0660 with --control-group).
    #[arg(long, value_name = "PATH")]
    control: PathBuf,
    /// A group (name from /etc/group, or a number) whose members may use the control socket.
    #[arg(long, value_name = "NAME|GID", value_parser = group_id)]
    control_group: Option<u32>,
    /// The daemon's own directory (0700): `vgpuctl create -- --dump` writes a VM's scanouts to
    /// DIR/dump/NAME/ [default: $XDG_RUNTIME_DIR/vgpu-schedd, else /run/vgpu-schedd/state].
    #[arg(long, value_name = "DIR", value_parser = absolute_dir)]
    state_dir: Option<PathBuf>,
    /// Serve the live dashboard at http://ADDR/ and Prometheus metrics at
    /// http://ADDR/metrics (loopback addresses only).
    #[arg(long, visible_alias = "metrics", value_name = "ADDR", value_parser = loopback)]
    http: Option<SocketAddr>,
    /// Serve Prometheus metrics (GET /metrics and GET /healthz only) to a central Prometheus
    /// at ADDR, every request with `Authorization: Bearer TOKEN` (--metrics-token-file); over
    /// TLS with --metrics-tls-cert and --metrics-tls-key, in plain HTTP only on a loopback
    /// address or with --metrics-insecure.
    #[arg(long, value_name = "ADDR", requires = "metrics_token_file")]
    metrics_listen: Option<SocketAddr>,
    /// The metrics listener's bearer token: a file of one line of at least 16 visible
    /// characters, that only the daemon's user may read (mode 0600 or 0400; else the daemon
    /// does not start).
    #[arg(long, value_name = "PATH", requires = "metrics_listen")]
    metrics_token_file: Option<PathBuf>,
    /// The metrics listener's certificate chain (PEM, its own certificate first).
    #[arg(long, value_name = "PEM", requires_all = ["metrics_listen", "metrics_tls_key"])]
    metrics_tls_cert: Option<PathBuf>,
    /// The metrics listener's private key (PEM; not readable by others).
    #[arg(long, value_name = "PEM", requires = "metrics_tls_cert")]
    metrics_tls_key: Option<PathBuf>,
    /// Serve the metrics listener in plain HTTP on an address that is not loopback: the token
    /// and the metrics cross the network in the clear.
    #[arg(long, requires = "metrics_listen", conflicts_with = "metrics_tls_cert")]
    metrics_insecure: bool,
    /// Persistent vGPU definitions (DIR/vgpus/NAME.json): those marked auto are started when
    /// the daemon starts. When DIR exists, the policy and parameters `set-policy` and `set`
    /// change are kept in DIR/live.json and restored at the next start.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_CONFIG_DIR)]
    config_dir: PathBuf,
    /// Start with the policy of a TOML file (policy = "timegraph" | "fair" | "pegasus" |
    /// "vgris" | "none", with its family's fields) [default: none].
    #[arg(long, value_name = "FILE.toml", value_parser = read_policy)]
    policy: Option<PolicyConfig>,
    /// How many groups the GPU runs at once.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = capacity)]
    capacity: usize,
    /// The simulated engine's context switch cost, µs.
    #[arg(long, value_name = "N", value_parser = switch_cost_ns)]
    switch_cost_us: Option<u64>,
    /// How long a group granted to a device may stay unfinished before the device is dropped,
    /// ms [default: 2000, the Windows TDR delay].
    #[arg(long, value_name = "N", value_parser = group_timeout_ns)]
    group_timeout_ms: Option<u64>,
    /// Write the policy's CPU weights to the VMs' cgroups.
    #[arg(long)]
    cpu_writeback: bool,
    /// The vgpu-server binary `vgpuctl create` runs [default: vgpu-server next to this
    /// binary].
    #[arg(long, value_name = "PATH")]
    server_bin: Option<PathBuf>,
    /// With --device-gid: the k-th created device process runs as user UID+k (the daemon must
    /// be root; not 0).
    #[arg(long, value_name = "UID", requires = "device_gid",
          value_parser = clap::value_parser!(u32).range(1..))]
    device_uid_base: Option<u32>,
    /// With --device-uid-base: the device processes' group (name from /etc/group, or a
    /// number), and the group of --socket (then 0660; not 0).
    #[arg(long, value_name = "NAME|GID", requires = "device_uid_base",
          value_parser = device_group)]
    device_gid: Option<u32>,
    /// The longest the daemon's loop spins for the next device message before it sleeps, while
    /// a device may be waiting for its answer (0: never; the window adapts, an idle daemon and
    /// one whose devices all stream under leases do not spin) [default: 200].
    #[arg(long, value_name = "N", value_parser = busy_poll::parse_us)]
    busy_poll_us: Option<Duration>,
    /// error, warn, info, debug or trace (RUST_LOG refines it).
    #[arg(long, value_name = "LEVEL", default_value = "info", value_parser = vgpu_cli::log_level(),
          ignore_case = true)]
    log_level: log::LevelFilter,
}

fn number<T: std::str::FromStr>(text: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not a valid number"))
}

fn capacity(text: &str) -> Result<usize, String> {
    let n: usize = number(text)?;
    if !(1..=MAX_CAPACITY).contains(&n) {
        return Err(format!("{n} is outside 1..={MAX_CAPACITY}"));
    }
    Ok(n)
}

/// `--switch-cost-us` in ns.
fn switch_cost_ns(text: &str) -> Result<u64, String> {
    let us: u64 = number(text)?;
    us.checked_mul(1_000)
        .filter(|&ns| ns <= MAX_SWITCH_COST_NS)
        .ok_or(format!("{us} is above {} µs", MAX_SWITCH_COST_NS / 1_000))
}

/// `--group-timeout-ms` in ns.
fn group_timeout_ns(text: &str) -> Result<u64, String> {
    let ms: u64 = number(text)?;
    ms.checked_mul(1_000_000)
        .filter(|ns| (1..=MAX_GROUP_TIMEOUT_NS).contains(ns))
        .ok_or(format!(
            "{ms} is outside 1..={}",
            MAX_GROUP_TIMEOUT_NS / 1_000_000
        ))
}

fn loopback(text: &str) -> Result<SocketAddr, String> {
    let addr: SocketAddr = text.parse().map_err(|e| format!("{e}"))?;
    if !addr.ip().is_loopback() {
        return Err(format!("{addr} is not a loopback address"));
    }
    Ok(addr)
}

fn absolute_dir(text: &str) -> Result<PathBuf, String> {
    let dir = PathBuf::from(text);
    if !dir.is_absolute() {
        return Err(format!("{} is not absolute", dir.display()));
    }
    Ok(dir)
}

/// Reads a TOML policy file.
fn read_policy(path: &str) -> Result<PolicyConfig, String> {
    read_policy_file(Path::new(path)).map_err(|e| e.to_string())
}

/// The group id of `--control-group`: a number, or a name in [`GROUP_FILE`].
fn group_id(text: &str) -> Result<u32, String> {
    if let Ok(gid) = text.parse() {
        return Ok(gid);
    }
    let fail = |e: String| format!("{text}: {e}");
    let meta = std::fs::metadata(GROUP_FILE).map_err(|e| fail(format!("{GROUP_FILE}: {e}")))?;
    if meta.len() > MAX_GROUP_FILE_BYTES {
        return Err(fail(format!("{GROUP_FILE} is too large")));
    }
    let groups =
        std::fs::read_to_string(GROUP_FILE).map_err(|e| fail(format!("{GROUP_FILE}: {e}")))?;
    lookup_group(&groups, text).ok_or_else(|| fail(format!("no such group in {GROUP_FILE}")))
}

/// The group of `--device-gid`: as [`group_id`], but never root's group.
fn device_group(text: &str) -> Result<u32, String> {
    match group_id(text)? {
        0 => Err(format!("{text}: the device processes never run in group 0")),
        gid => Ok(gid),
    }
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

impl Cli {
    /// The server's configuration and the definitions' directory.
    fn into_config(self) -> (ServerConfig, PathBuf) {
        let mut daemon = DaemonConfig {
            capacity: self.capacity,
            cpu_writeback: self.cpu_writeback,
            ..DaemonConfig::default()
        };
        if let Some(policy) = self.policy {
            daemon.policy = policy;
        }
        if let Some(ns) = self.switch_cost_us {
            daemon.switch_cost_ns = ns;
        }
        if let Some(ns) = self.group_timeout_ms {
            daemon.group_timeout_ns = ns;
        }
        let device_ids = self
            .device_uid_base
            .zip(self.device_gid)
            .map(|(uid_base, gid)| DeviceIds { uid_base, gid });
        let config = ServerConfig {
            socket: self.socket,
            control: self.control,
            control_group: self.control_group,
            state_dir: self.state_dir.unwrap_or_else(default_state_dir),
            metrics: self.http,
            metrics_listen: self.metrics_listen.zip(self.metrics_token_file).map(
                |(addr, token_file)| MetricsListenConfig {
                    addr,
                    token_file,
                    tls: self
                        .metrics_tls_cert
                        .zip(self.metrics_tls_key)
                        .map(|(cert, key)| TlsFiles { cert, key }),
                    insecure: self.metrics_insecure,
                },
            ),
            daemon,
            server_bin: self.server_bin.unwrap_or_else(default_server_bin),
            device_ids,
            cgroups: CgroupFs::default(),
            busy_poll: self.busy_poll_us.unwrap_or(busy_poll::DEFAULT_MAX),
        };
        (config, self.config_dir)
    }
}

/// Starts the device process of every definition marked auto in `config_dir`; a definition
/// that cannot start is logged and skipped.
fn start_defined(server: &mut Server, config_dir: &Path) {
    for (name, def) in Store::new(config_dir).auto_started() {
        match server.start_defined(&name, &def) {
            Ok(()) => log::info!("{name}: starting its definition"),
            Err(e) => log::error!("{name}: its definition did not start: {e}"),
        }
    }
}

fn main() -> ExitCode {
    let cli: Cli = vgpu_cli::parse();
    env_logger::Builder::new()
        .filter_level(cli.log_level)
        .parse_default_env()
        .format_timestamp_micros()
        .init();
    let (config, config_dir) = cli.into_config();
    let mut server = match Server::bind(config) {
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
    if let Err(e) = server.use_config_dir(&config_dir) {
        log::error!("{e}");
        return ExitCode::FAILURE;
    }
    start_defined(&mut server, &config_dir);
    match server.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let all = ["--socket", "/run/s", "--control", "/run/c"];
        vgpu_cli::check::arguments(all.iter().chain(args))
    }

    #[test]
    fn command_line_conventions() {
        vgpu_cli::check::conventions::<Cli>(env!("CARGO_PKG_VERSION")).unwrap();
        vgpu_cli::check::operator_man_page::<Cli>().unwrap();
    }

    #[test]
    fn flags_keep_their_meaning() {
        let (config, dir) = parse(&[]).unwrap().into_config();
        assert_eq!(dir, Path::new(DEFAULT_CONFIG_DIR));
        assert_eq!(config.metrics, None);
        assert_eq!(config.daemon.capacity, 1);
        assert_eq!(config.busy_poll, busy_poll::DEFAULT_MAX);
        assert_eq!(config.device_ids, None);
        assert_eq!(config.metrics_listen, None);
        // --http is the listener's name, --metrics its alias; --opt=value works.
        for flag in ["--http", "--metrics"] {
            let (config, _) = parse(&[&format!("{flag}=127.0.0.1:9470")])
                .unwrap()
                .into_config();
            assert_eq!(config.metrics, Some("127.0.0.1:9470".parse().unwrap()));
        }
        let (config, dir) = parse(&[
            "--config-dir=/tmp/cfg",
            "--capacity",
            "2",
            "--switch-cost-us=30",
            "--group-timeout-ms",
            "500",
            "--busy-poll-us=0",
            "--device-uid-base=70000",
            "--device-gid=70100",
            "--cpu-writeback",
        ])
        .unwrap()
        .into_config();
        assert_eq!(dir, Path::new("/tmp/cfg"));
        assert_eq!(config.daemon.capacity, 2);
        assert_eq!(config.daemon.switch_cost_ns, 30_000);
        assert_eq!(config.daemon.group_timeout_ns, 500_000_000);
        assert!(config.daemon.cpu_writeback);
        assert_eq!(config.busy_poll, Duration::ZERO);
        let listen = |extra: &[&str]| {
            let mut args = vec![
                "--metrics-listen=0.0.0.0:9478",
                "--metrics-token-file=/etc/vgpu/metrics.token",
            ];
            args.extend_from_slice(extra);
            parse(&args)
                .unwrap()
                .into_config()
                .0
                .metrics_listen
                .unwrap()
        };
        let tls = listen(&["--metrics-tls-cert=/c.pem", "--metrics-tls-key=/k.pem"]);
        assert_eq!(
            tls,
            MetricsListenConfig {
                addr: "0.0.0.0:9478".parse().unwrap(),
                token_file: "/etc/vgpu/metrics.token".into(),
                tls: Some(TlsFiles {
                    cert: "/c.pem".into(),
                    key: "/k.pem".into()
                }),
                insecure: false,
            }
        );
        let plain = listen(&["--metrics-insecure"]);
        assert!(plain.insecure && plain.tls.is_none());
        assert_eq!(
            config.device_ids,
            Some(DeviceIds {
                uid_base: 70000,
                gid: 70100
            })
        );
    }

    #[test]
    fn the_device_group_may_be_named() {
        let groups = std::fs::read_to_string(GROUP_FILE).unwrap();
        let daemon = lookup_group(&groups, "daemon").expect("Debian's daemon group");
        let (config, _) = parse(&["--device-uid-base=70000", "--device-gid=daemon"])
            .unwrap()
            .into_config();
        assert_eq!(config.device_ids.map(|d| d.gid), Some(daemon));
    }

    #[test]
    fn bad_flags_are_usage_errors() {
        for bad in [
            &["--http", "0.0.0.0:9470"][..],
            &["--metrics", "192.168.1.1:80"],
            &["--capacity", "0"],
            &["--switch-cost-us", "18446744073709551615"],
            &["--group-timeout-ms", "0"],
            &["--state-dir", "relative"],
            &["--device-uid-base", "70000"],
            &["--device-uid-base", "0", "--device-gid", "5"],
            &["--device-uid-base", "70000", "--device-gid", "0"],
            &["--device-uid-base", "70000", "--device-gid", "root"],
            &[
                "--device-uid-base",
                "70000",
                "--device-gid",
                "no-such-group-here",
            ],
            &["--log-level", "loud"],
            &["--metrics-listen", "0.0.0.0:9478"],
            &["--metrics-token-file", "/t"],
            &["--metrics-listen", "nowhere", "--metrics-token-file", "/t"],
            &[
                "--metrics-listen",
                "0.0.0.0:9478",
                "--metrics-token-file",
                "/t",
                "--metrics-tls-cert",
                "/c.pem",
            ],
            &[
                "--metrics-listen",
                "0.0.0.0:9478",
                "--metrics-token-file",
                "/t",
                "--metrics-tls-key",
                "/k.pem",
            ],
            &[
                "--metrics-listen",
                "0.0.0.0:9478",
                "--metrics-token-file",
                "/t",
                "--metrics-insecure",
                "--metrics-tls-cert",
                "/c.pem",
                "--metrics-tls-key",
                "/k.pem",
            ],
            &["--metrics-insecure"],
            &["--policy", "/nonexistent.toml"],
            &["--frobnicate"],
        ] {
            let e = parse(bad).map(|_| ()).expect_err(&format!("{bad:?}"));
            assert_eq!(e.exit_code(), 2, "{bad:?}");
        }
        let e = vgpu_cli::check::arguments::<Cli, _, _>(["--socket", "/s"]).unwrap_err();
        assert_eq!(e.exit_code(), 2, "--control is required");
    }
}
