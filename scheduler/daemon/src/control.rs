//! The daemon's control protocol (`vgpuctl` and any other local client): JSON lines over a
//! `SOCK_STREAM` Unix socket. Each request is one JSON object on one line, tagged by `cmd`;
//! each answer is one line, `{"ok": RESULT}` or `{"error": "why"}`.
//!
//! | request | result |
//! |---|---|
//! | `{"cmd":"list"}` | `{"policy": PolicyConfig, "vms": [VmInfo], "children": [Child]}` |
//! | `{"cmd":"stats"}` | `Stats` |
//! | `{"cmd":"set-policy","policy":{"policy":"fair",...}}` | `{"policy": name}` |
//! | `{"cmd":"set-params","vm":"a","params":{"priority":3},"add":false}` | the VM's `VgpuParams` |
//! | `{"cmd":"focus","vm":"a"}` | `null` |
//! | `{"cmd":"create","name":"a","socket":"/run/a.sock","args":[...]}` | `Child` |
//! | `{"cmd":"destroy","name":"a"}` | `{"name": "a", "status": "..."}` |
//! | `{"cmd":"dashboard"}` | `{"url": "http://ADDR/#token=T", "addr": "ADDR"}` |
//! | `{"cmd":"forget","vm":"a"}` | `{"name": "a"}` |
//!
//! `set-params` and `forget` name a VM the daemon knows (connected, with stored parameters, with
//! a device process or a definition); any other name is refused with the list of known ones.
//!
//! A line that is not valid JSON, names an unknown command or has unknown fields gets an
//! error answer and the connection stays usable. A line longer than [`MAX_REQUEST_BYTES`]
//! gets an error answer and the connection is closed (there is no telling where the next
//! request starts without reading the rest).
//!
//! Control clients are local users the daemon does not trust beyond what [`ControlAccess`]
//! allows, and whatever they send runs as the daemon's user: a `create` names only the options
//! of [`ServerOptions`] (no library paths, no directories) and a socket path that passes
//! [`check_socket_path`].

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;
use vgpu_scheduler::PolicyConfig;
use vgpu_scheduler::sim::ParamsOverride;

use crate::seqpacket::PeerCred;

/// Largest policy file read (`vgpuctl set-policy`, `vgpu-schedd --policy`): a policy with
/// its spec lines is a few KiB.
pub const MAX_POLICY_FILE_BYTES: u64 = 1024 * 1024;
/// Longest request line: a policy configuration with its spec lines and shared reserves fits
/// many times over; it bounds what one client makes the daemon buffer.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;
/// Most extra arguments of a `create`.
pub const MAX_EXTRA_ARGS: usize = 64;
/// Longest extra argument of a `create`.
pub const MAX_ARG_BYTES: usize = 4096;
/// Where `vgpuctl` looks for the control socket when not told.
pub const DEFAULT_CONTROL_PATH: &str = "/run/vgpu-schedd/control.sock";
/// Smallest `--display` edge: what vgpu-server's `--display` accepts (its `MIN_SCANOUT_EDGE`),
/// checked here too so that `define` refuses a mode the device process would refuse at `start`.
pub const MIN_DISPLAY_EDGE: u32 = 16;
/// Largest `--display` edge: vgpu-server's `MAX_SCANOUT_EDGE` (16384), for the same reason.
pub const MAX_DISPLAY_EDGE: u32 = 16384;
/// Largest `--memory-mb`: vgpu-server's `MAX_RESOURCE_MEMORY_MB` (1 TiB), checked here so that
/// `define` refuses a budget the device process would refuse at `start`.
pub const MAX_MEMORY_MB: u64 = 1 << 20;
/// The keys of a `vgpuctl set` assignment, as error messages list them.
pub const PARAM_KEYS: &str = "priority, weight, sched, target_fps, slo, reserve";

/// Errors of the control protocol.
#[derive(Debug, Error)]
pub enum ControlError {
    /// The line is not a valid request.
    #[error("bad request: {0}")]
    BadRequest(#[from] serde_json::Error),
    /// The line is longer than [`MAX_REQUEST_BYTES`].
    #[error("request longer than {MAX_REQUEST_BYTES} bytes")]
    TooLong,
    /// A `create` with an option outside [`ServerOptions`], too many or too long extra
    /// arguments, or a bad socket path.
    #[error("bad create: {0}")]
    BadCreate(String),
    /// A `vgpuctl set` assignment that does not parse.
    #[error("bad assignment {0:?}: {1}")]
    BadAssignment(String, &'static str),
    /// A policy configuration that is not one: an unknown family, or a key its family does
    /// not take.
    #[error("bad policy: {0}")]
    BadPolicy(String),
    /// A policy file that cannot be read.
    #[error("{}: {why}", path.display())]
    PolicyFile {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// A `vgpuctl set` assignment of a key that is not a parameter.
    #[error("unknown parameter {0:?} (valid: {PARAM_KEYS})")]
    UnknownKey(String),
}

/// One control request.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// The policy, the VMs and the children the daemon spawned.
    List {},
    /// Live statistics.
    Stats {},
    /// Installs another policy.
    SetPolicy {
        /// The policy and its family's parameters.
        #[serde(deserialize_with = "checked_policy")]
        policy: PolicyConfig,
    },
    /// Changes a VM's parameters.
    SetParams {
        /// The VM.
        vm: String,
        /// The fields to change.
        params: ParamsOverride,
        /// Keep the parameters for a VM the daemon does not know yet (it gets them when it
        /// connects); without it such a name is refused.
        #[serde(default)]
        add: bool,
    },
    /// The user looks at this VM's console.
    Focus {
        /// The VM.
        vm: String,
    },
    /// Spawns a device process for a VM.
    Create {
        /// The VM's name.
        name: String,
        /// The vfio-user socket the device serves.
        socket: PathBuf,
        /// Options for the device process, sent as its command-line arguments.
        #[serde(default, rename = "args")]
        options: ServerOptions,
    },
    /// Stops a device process the daemon spawned.
    Destroy {
        /// The VM's name.
        name: String,
    },
    /// The live dashboard's URL, with the token its requests that change the scheduler need
    /// (an error when the daemon serves no HTTP).
    Dashboard {},
    /// Drops the stored parameters of a VM that is neither connected nor has a device process
    /// (a VM gone for good, or a phantom an older daemon made for a mistyped name).
    Forget {
        /// The VM.
        vm: String,
    },
}

impl Request {
    /// Whether the request changes the scheduler or its device processes (logged with the
    /// caller's credentials, an audit trail), rather than only reading.
    pub fn changes(&self) -> bool {
        match self {
            Request::List {} | Request::Stats {} | Request::Dashboard {} => false,
            Request::SetPolicy { .. }
            | Request::SetParams { .. }
            | Request::Focus { .. }
            | Request::Create { .. }
            | Request::Destroy { .. }
            | Request::Forget { .. } => true,
        }
    }

    /// Parses one request line (without its newline) and checks the bounds JSON cannot say.
    pub fn parse(line: &[u8]) -> Result<Request, ControlError> {
        if line.len() > MAX_REQUEST_BYTES {
            return Err(ControlError::TooLong);
        }
        let req: Request = serde_json::from_slice(line)?;
        if let Request::Create { socket, .. } = &req {
            check_socket_path(socket)?;
        }
        Ok(req)
    }
}

/// A policy configuration from its JSON form (a TOML file's too, converted), every key
/// checked: the families' configurations refuse keys they do not take (naming the valid ones);
/// `policy = "none"` has no other keys, which its unit variant does not check, so they are
/// refused here. The control socket, the dashboard, `vgpuctl set-policy` and
/// `vgpu-schedd --policy` all take a policy through it.
pub fn policy_from_value(value: Value) -> Result<PolicyConfig, ControlError> {
    let extra = value
        .as_object()
        .and_then(|m| m.keys().find(|k| *k != "policy").cloned());
    let policy: PolicyConfig =
        serde_json::from_value(value).map_err(|e| ControlError::BadPolicy(e.to_string()))?;
    match (&policy, extra) {
        (PolicyConfig::None, Some(key)) => Err(ControlError::BadPolicy(format!(
            "unknown field `{key}`: policy \"none\" takes no other keys"
        ))),
        _ => Ok(policy),
    }
}

/// A policy configuration from a TOML file of at most [`MAX_POLICY_FILE_BYTES`], checked as
/// [`policy_from_value`] checks it.
pub fn read_policy_file(path: &Path) -> Result<PolicyConfig, ControlError> {
    let fail = |why: String| ControlError::PolicyFile {
        path: path.to_owned(),
        why,
    };
    let meta = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?;
    if meta.len() > MAX_POLICY_FILE_BYTES {
        return Err(fail(format!("larger than {MAX_POLICY_FILE_BYTES} bytes")));
    }
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let value: Value = toml::from_str(&text).map_err(|e| fail(e.to_string()))?;
    policy_from_value(value).map_err(|e| fail(e.to_string()))
}

/// [`policy_from_value`] for a request's `policy` field.
fn checked_policy<'de, D: serde::Deserializer<'de>>(d: D) -> Result<PolicyConfig, D::Error> {
    policy_from_value(Value::deserialize(d)?).map_err(serde::de::Error::custom)
}

/// One answer line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Response {
    /// The request was carried out; its result.
    Ok(Value),
    /// It was not; why.
    Error(String),
}

impl Response {
    /// The answer as one line, newline included.
    pub fn to_line(&self) -> Vec<u8> {
        // Serialising a Value or a String cannot fail; fall back to a fixed error line.
        let mut line = serde_json::to_vec(self)
            .unwrap_or_else(|_| br#"{"error":"unserialisable result"}"#.to_vec());
        line.push(b'\n');
        line
    }
}

/// A device process the daemon spawned, as `list` and `create` report it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildInfo {
    /// The VM's name.
    pub name: String,
    /// Its process id.
    pub pid: u32,
    /// The vfio-user socket it serves.
    pub socket: PathBuf,
    /// Where it writes its scanout dumps (`--dump`), a directory the daemon made for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dump_dir: Option<PathBuf>,
}

/// The renderer of a device process (`--renderer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renderer {
    /// virglrenderer, the library the device process loads by default.
    Virgl,
    /// None: 2D only.
    None,
}

/// The options a control client may give a device process it creates: an allow-list, because
/// the process runs as the daemon's user. Library paths (`--virgl-library`) and directories
/// (`--dump-dir`) are never taken from a client: `--dump` asks for dumps into a directory the
/// daemon makes for the VM under its state directory. The socket, scheduler and VM name are the
/// daemon's to set. Each option may appear once.
///
/// | option | meaning |
/// |---|---|
/// | `--display WxH` | the scanout mode (the device process checks the range) |
/// | `--renderer virgl\|none` | with or without virgl |
/// | `--log-level off\|error\|warn\|info\|debug\|trace` | its log level |
/// | `--memory-mb N` | the VM's memory budget in MiB (1 to [`MAX_MEMORY_MB`]): its GPU memory on the compute path, and its GL resources (vgpu-server's `--resource-memory-mb`) |
/// | `--dump` | scanout PNGs into the VM's dump directory |
/// | `--exit-on-disconnect` | exit when QEMU disconnects |
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(try_from = "Vec<String>")]
pub struct ServerOptions {
    /// `--display WxH`.
    pub display: Option<(u32, u32)>,
    /// `--renderer`.
    pub renderer: Option<Renderer>,
    /// `--log-level`.
    pub log_level: Option<log::LevelFilter>,
    /// `--memory-mb`.
    pub memory_mb: Option<u64>,
    /// `--dump`.
    pub dump: bool,
    /// `--exit-on-disconnect`.
    pub exit_on_disconnect: bool,
}

/// The allowed options, as error messages list them.
const ALLOWED_OPTIONS: &str = "--display WxH, --renderer virgl|none, --log-level LEVEL, \
                               --memory-mb N, --dump, --exit-on-disconnect";

impl TryFrom<Vec<String>> for ServerOptions {
    type Error = ControlError;

    fn try_from(args: Vec<String>) -> Result<ServerOptions, ControlError> {
        let bad = |why: String| Err(ControlError::BadCreate(why));
        if args.len() > MAX_EXTRA_ARGS {
            return bad(format!("more than {MAX_EXTRA_ARGS} arguments"));
        }
        let mut opts = ServerOptions::default();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            if arg.len() > MAX_ARG_BYTES {
                return bad(format!("argument longer than {MAX_ARG_BYTES} bytes"));
            }
            let mut value = || {
                it.next()
                    .map(String::as_str)
                    .ok_or_else(|| ControlError::BadCreate(format!("{arg} needs a value")))
            };
            let seen = match arg.as_str() {
                "--display" => {
                    let v = value()?;
                    let mode = v
                        .split_once('x')
                        .and_then(|(w, h)| Some((w.parse().ok()?, h.parse().ok()?)));
                    let Some(mode) = mode else {
                        return bad(format!("--display {v:?} is not WIDTHxHEIGHT"));
                    };
                    let edge = MIN_DISPLAY_EDGE..=MAX_DISPLAY_EDGE;
                    if !edge.contains(&mode.0) || !edge.contains(&mode.1) {
                        return bad(format!(
                            "--display {v}: each edge must be in \
                             {MIN_DISPLAY_EDGE}..={MAX_DISPLAY_EDGE}"
                        ));
                    }
                    opts.display.replace(mode).is_some()
                }
                "--renderer" => {
                    let r = match value()? {
                        "virgl" => Renderer::Virgl,
                        "none" => Renderer::None,
                        v => return bad(format!("--renderer {v:?} is not virgl or none")),
                    };
                    opts.renderer.replace(r).is_some()
                }
                "--log-level" => {
                    let v = value()?;
                    let Ok(level) = v.parse::<log::LevelFilter>() else {
                        return bad(format!("--log-level {v:?} is not a level"));
                    };
                    opts.log_level.replace(level).is_some()
                }
                "--memory-mb" => {
                    let v = value()?;
                    match v.parse::<u64>() {
                        Ok(mb @ 1..=MAX_MEMORY_MB) => opts.memory_mb.replace(mb).is_some(),
                        _ => {
                            return bad(format!(
                                "--memory-mb {v:?} is not a number of MiB in 1..={MAX_MEMORY_MB}"
                            ));
                        }
                    }
                }
                "--dump" => std::mem::replace(&mut opts.dump, true),
                "--exit-on-disconnect" => std::mem::replace(&mut opts.exit_on_disconnect, true),
                other => {
                    let shown: String = other.chars().take(64).collect();
                    return bad(format!(
                        "option {shown:?} is not allowed (allowed: {ALLOWED_OPTIONS})"
                    ));
                }
            };
            if seen {
                return bad(format!("{arg} given twice"));
            }
        }
        Ok(opts)
    }
}

impl ServerOptions {
    /// The device process's arguments for these options; `dump_dir` is the directory the
    /// daemon made for `--dump`.
    pub fn to_args(&self, dump_dir: Option<&Path>) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        if let Some((w, h)) = self.display {
            args.extend(["--display".into(), format!("{w}x{h}").into()]);
        }
        if let Some(r) = self.renderer {
            let name = match r {
                Renderer::Virgl => "virgl",
                Renderer::None => "none",
            };
            args.extend(["--renderer".into(), name.into()]);
        }
        if let Some(level) = self.log_level {
            let level = level.as_str().to_ascii_lowercase();
            args.extend(["--log-level".into(), level.into()]);
        }
        if let Some(mb) = self.memory_mb {
            args.extend(["--resource-memory-mb".into(), mb.to_string().into()]);
        }
        if let Some(dir) = dump_dir {
            args.extend(["--dump-dir".into(), dir.into()]);
        }
        if self.exit_on_disconnect {
            args.push("--exit-on-disconnect".into());
        }
        args
    }
}

/// The rule for the socket path of a `create`: absolute, without `.` or `..` components (the
/// path says where the socket lands, with no detours), and fitting a Unix socket address. The
/// daemon then also refuses a path where anything exists already (it never replaces or removes
/// a file at a client's word, stale sockets included) and one whose parent is not a directory.
pub fn check_socket_path(path: &Path) -> Result<(), ControlError> {
    let bytes = path.as_os_str().as_bytes();
    if !path.is_absolute() {
        return Err(ControlError::BadCreate(
            "socket must be an absolute path".into(),
        ));
    }
    if bytes.split(|&b| b == b'/').any(|c| c == b"." || c == b"..") {
        return Err(ControlError::BadCreate(
            "socket path may not have . or .. components".into(),
        ));
    }
    if !crate::seqpacket::valid_path(path.as_os_str()) {
        return Err(ControlError::BadCreate(
            "socket path does not fit a Unix socket address".into(),
        ));
    }
    Ok(())
}

/// The rule for where a device's socket is created: its directory exists (the daemon makes no
/// directories at a client's word). `create` checks it when it runs, `define` and `modify` when
/// they write a definition, so that a definition `start` would refuse is refused first.
pub fn check_socket_dir(path: &Path) -> Result<(), ControlError> {
    if path.parent().is_some_and(Path::is_dir) {
        Ok(())
    } else {
        Err(ControlError::BadCreate(format!(
            "the directory of {} does not exist",
            path.display()
        )))
    }
}

/// Who may use the control socket: the daemon's own user, root, and with a control group
/// every process whose group or supplementary groups include it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlAccess {
    /// The daemon's (effective) user id.
    pub uid: u32,
    /// The control group, if any.
    pub group: Option<u32>,
}

impl ControlAccess {
    /// Whether a peer with credentials `peer` may talk to the daemon; `groups` gives its
    /// supplementary groups, asked for only when the answer depends on them.
    pub fn allows(&self, peer: &PeerCred, groups: impl FnOnce() -> Vec<u32>) -> bool {
        if peer.uid == 0 || peer.uid == self.uid {
            return true;
        }
        match self.group {
            Some(g) => peer.gid == g || groups().contains(&g),
            None => false,
        }
    }
}

/// The groups of a group file (`/etc/group`: `name:password:gid:members` lines), name and id;
/// lines that are not one are skipped.
fn group_entries(group_file: &str) -> impl Iterator<Item = (&str, u32)> {
    group_file.lines().filter_map(|line| {
        let mut fields = line.split(':');
        let (name, _password, gid) = (fields.next()?, fields.next()?, fields.next()?);
        Some((name, gid.parse().ok()?))
    })
}

/// The id of group `name` in a group file.
pub fn lookup_group(group_file: &str, name: &str) -> Option<u32> {
    group_entries(group_file).find_map(|(n, gid)| (n == name).then_some(gid))
}

/// The name of group `gid` in a group file.
pub fn group_name(group_file: &str, gid: u32) -> Option<&str> {
    group_entries(group_file).find_map(|(name, g)| (g == gid).then_some(name))
}

/// Splits a byte stream into request lines, never holding more than [`MAX_REQUEST_BYTES`] of
/// an unfinished line. Lines are taken from the front without moving the rest; the space of
/// taken lines is reclaimed on the next push.
#[derive(Debug, Default)]
pub struct LineBuffer {
    buf: Vec<u8>,
    /// Where the lines not taken yet start.
    start: usize,
}

impl LineBuffer {
    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.drain(..self.start.min(self.buf.len()));
        self.start = 0;
        self.buf.extend_from_slice(bytes);
    }

    fn rest(&self) -> &[u8] {
        self.buf.get(self.start..).unwrap_or_default()
    }

    /// Whether a complete line is waiting.
    pub fn has_line(&self) -> bool {
        self.rest().contains(&b'\n')
    }

    /// The next complete line (without `\n`, and without a `\r` before it), `Ok(None)` when
    /// none is complete yet, [`ControlError::TooLong`] when the line is over the limit.
    pub fn next_line(&mut self) -> Result<Option<Vec<u8>>, ControlError> {
        let rest = self.rest();
        match rest.iter().position(|&b| b == b'\n') {
            Some(end) if end > MAX_REQUEST_BYTES => Err(ControlError::TooLong),
            Some(end) => {
                let mut line = rest.get(..end).unwrap_or_default();
                if let Some(l) = line.strip_suffix(b"\r") {
                    line = l;
                }
                let line = line.to_vec();
                self.start = self.start.saturating_add(end).saturating_add(1);
                Ok(Some(line))
            }
            None if rest.len() > MAX_REQUEST_BYTES => Err(ControlError::TooLong),
            None => Ok(None),
        }
    }
}

/// Parses `vgpuctl set` assignments ([`parse_assignment`]) into the fields of one
/// `set-params` request; a later assignment of a key replaces an earlier one.
pub fn parse_assignments(list: &[String]) -> Result<serde_json::Map<String, Value>, ControlError> {
    let mut fields = serde_json::Map::new();
    for a in list {
        let (key, value) = parse_assignment(a)?;
        fields.insert(key.to_owned(), value);
    }
    Ok(fields)
}

/// Parses a `vgpuctl set` assignment `key=value` into the field of a `set-params` request:
/// `priority`, `weight` (integers), `sched` (`prt`/`ht`), `target_fps` (a positive number),
/// `slo` (GPU µs per second), `reserve=C_us/T_us/pe|ae`.
pub fn parse_assignment(text: &str) -> Result<(&'static str, Value), ControlError> {
    let bad = |why| ControlError::BadAssignment(text.to_owned(), why);
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| bad("expected key=value"))?;
    let int = |v: &str| v.parse::<u64>().map_err(|_| bad("expected an integer"));
    let us = |v: &str| {
        int(v)?
            .checked_mul(1_000)
            .ok_or_else(|| bad("microseconds out of range"))
    };
    Ok(match key {
        "priority" | "weight" => {
            let n = u32::try_from(int(value)?).map_err(|_| bad("out of range"))?;
            (
                if key == "priority" {
                    "priority"
                } else {
                    "weight"
                },
                n.into(),
            )
        }
        "sched" => match value {
            "prt" | "ht" => ("sched", value.into()),
            _ => return Err(bad("sched is prt or ht")),
        },
        "target_fps" => {
            let fps: f64 = value.parse().map_err(|_| bad("expected a number"))?;
            if !(fps.is_finite() && fps > 0.0) {
                return Err(bad("target_fps must be positive"));
            }
            ("target_fps", fps.into())
        }
        "slo" => ("slo", us(value)?.into()),
        "reserve" => {
            let mut parts = value.split('/');
            let (Some(c), Some(t), Some(e), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                return Err(bad("reserve is C_us/T_us/pe|ae"));
            };
            if e != "pe" && e != "ae" {
                return Err(bad("enforcement is pe or ae"));
            }
            let reserve = serde_json::json!({"c": us(c)?, "t": us(t)?, "enforcement": e});
            ("reserve", reserve)
        }
        _ => return Err(ControlError::UnknownKey(key.to_owned())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse() {
        assert_eq!(
            Request::parse(br#"{"cmd":"list"}"#).unwrap(),
            Request::List {}
        );
        let r = Request::parse(br#"{"cmd":"set-policy","policy":{"policy":"fair"}}"#).unwrap();
        assert!(matches!(
            r,
            Request::SetPolicy {
                policy: PolicyConfig::Fair(_)
            }
        ));
        let r =
            Request::parse(br#"{"cmd":"set-params","vm":"a","params":{"priority":3}}"#).unwrap();
        let Request::SetParams { vm, params, .. } = r else {
            panic!()
        };
        assert_eq!((vm.as_str(), params.priority), ("a", Some(3)));
        let r = Request::parse(br#"{"cmd":"create","name":"a","socket":"/tmp/a"}"#).unwrap();
        assert!(
            matches!(r, Request::Create { options, .. } if options == ServerOptions::default())
        );
    }

    #[test]
    fn create_takes_only_allowed_options() {
        let parse = |args: &[&str]| {
            let line = serde_json::json!({"cmd":"create","name":"a","socket":"/run/a","args":args});
            Request::parse(line.to_string().as_bytes())
        };
        let r = parse(&[
            "--display",
            "640x480",
            "--renderer",
            "none",
            "--log-level",
            "Debug",
            "--memory-mb",
            "2048",
            "--dump",
            "--exit-on-disconnect",
        ])
        .unwrap();
        let Request::Create { options, .. } = r else {
            panic!()
        };
        let dir = Path::new("/state/dump/a");
        let args: Vec<String> = options
            .to_args(Some(dir))
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "--display",
                "640x480",
                "--renderer",
                "none",
                "--log-level",
                "debug",
                "--resource-memory-mb",
                "2048",
                "--dump-dir",
                "/state/dump/a",
                "--exit-on-disconnect"
            ]
        );
        for bad in [
            &["--virgl-library", "/tmp/evil.so"][..],
            &["--dump-dir", "/etc"],
            &["--socket", "/tmp/b"],
            &["--scheduler", "/tmp/s"],
            &["--vm-name", "b"],
            &["--frobnicate"],
            &["--display"],
            &["--display", "big"],
            &["--display", "99999x1"],
            &["--display", "640x15"],
            &["--display", "16385x600"],
            &["--display", "1x2", "--display", "3x4"],
            &["--renderer", "vulkan"],
            &["--log-level", "loud"],
            &["--dump", "--dump"],
            &["--memory-mb"],
            &["--memory-mb", "0"],
            &["--memory-mb", "1048577"],
            &["--memory-mb", "-1"],
            &["--memory-mb", "2G"],
            &["--memory-mb", "1", "--memory-mb", "2"],
            &["--resource-memory-mb", "64"],
            &["--display=640x480"],
            &["640x480"],
        ] {
            let e = parse(bad).expect_err(&format!("{bad:?}"));
            assert!(e.to_string().contains("bad create"), "{bad:?}: {e}");
        }
        let e = parse(&["--virgl-library", "x"]).unwrap_err().to_string();
        assert!(e.contains("not allowed") && e.contains("--dump"), "{e}");
    }

    #[test]
    fn socket_paths_are_absolute_and_direct() {
        assert!(check_socket_path(Path::new("/run/vgpu/vm1.sock")).is_ok());
        for bad in [
            "vm1.sock",
            "./vm1.sock",
            "/run/../etc/x",
            "/run/vgpu/..",
            "/run/./x",
            "",
        ] {
            assert!(check_socket_path(Path::new(bad)).is_err(), "{bad}");
        }
        assert!(check_socket_path(&PathBuf::from(format!("/{}", "x".repeat(200)))).is_err());
        let tmp = std::env::temp_dir();
        assert!(check_socket_dir(&tmp.join("a.sock")).is_ok());
        let e = check_socket_dir(&tmp.join("no-such-dir-here/a.sock")).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
    }

    #[test]
    fn control_access_by_user_and_group() {
        let peer = |uid, gid| PeerCred { pid: 1, uid, gid };
        let no_groups = || -> Vec<u32> { panic!("groups not needed") };
        let private = ControlAccess {
            uid: 1000,
            group: None,
        };
        assert!(private.allows(&peer(1000, 5), no_groups));
        assert!(private.allows(&peer(0, 5), no_groups));
        assert!(!private.allows(&peer(1001, 5), || vec![5, 1000]));
        let shared = ControlAccess {
            uid: 0,
            group: Some(42),
        };
        assert!(shared.allows(&peer(1001, 42), no_groups));
        assert!(shared.allows(&peer(1001, 5), || vec![7, 42]));
        assert!(!shared.allows(&peer(1001, 5), || vec![7, 43]));
        assert!(!shared.allows(&peer(42, 5), Vec::new));
    }

    #[test]
    fn groups_found_by_name() {
        let file = "root:x:0:\nvgpu:x:977:alice,bob\nbroken\nodd:x:notanumber:\n";
        assert_eq!(lookup_group(file, "vgpu"), Some(977));
        assert_eq!(lookup_group(file, "root"), Some(0));
        assert_eq!(lookup_group(file, "odd"), None);
        assert_eq!(lookup_group(file, "vgp"), None);
        assert_eq!(lookup_group(file, "broken"), None);
        assert_eq!(group_name(file, 977), Some("vgpu"));
        assert_eq!(group_name(file, 0), Some("root"));
        assert_eq!(group_name(file, 978), None);
    }

    #[test]
    fn bad_requests_refused() {
        for bad in [
            &b"not json"[..],
            br#"{"cmd":"reboot"}"#,
            br#"{"cmd":"list","extra":1}"#,
            br#"{"cmd":"set-params","vm":"a","params":{"colour":1}}"#,
            br#"{"cmd":"set-policy","policy":{"policy":"lottery"}}"#,
            br#"{"cmd":"set-policy","policy":{"policy":"fair","bogus_key":42}}"#,
            br#"{"cmd":"set-policy","policy":{"policy":"timegraph","bogus_key":42}}"#,
            br#"{"cmd":"set-policy","policy":{"policy":"none","bogus_key":42}}"#,
            br#"{"cmd":"forget"}"#,
            br#"{"cmd":"focus"}"#,
            br#"[1,2]"#,
            br#"{"cmd":"create","name":"a","socket":"relative"}"#,
            b"\xff\xfe",
        ] {
            assert!(
                Request::parse(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let many: Vec<String> = (0..=MAX_EXTRA_ARGS).map(|i| i.to_string()).collect();
        let line = serde_json::json!({"cmd":"create","name":"a","socket":"/a","args":many});
        assert!(Request::parse(line.to_string().as_bytes()).is_err());
        let long = format!("/{}", "x".repeat(200));
        let line = serde_json::json!({"cmd":"create","name":"a","socket":long});
        assert!(Request::parse(line.to_string().as_bytes()).is_err());
        let huge = vec![b' '; MAX_REQUEST_BYTES + 1];
        assert!(matches!(Request::parse(&huge), Err(ControlError::TooLong)));
    }

    #[test]
    fn lines_split_and_bounded() {
        let mut b = LineBuffer::default();
        b.push(b"{\"a\":1}\r\n{\"b\"");
        assert_eq!(b.next_line().unwrap().unwrap(), b"{\"a\":1}");
        assert_eq!(b.next_line().unwrap(), None);
        assert!(!b.has_line());
        b.push(b":2}\n\n{}\n");
        assert!(b.has_line());
        assert_eq!(b.next_line().unwrap().unwrap(), b"{\"b\":2}");
        assert_eq!(b.next_line().unwrap().unwrap(), b"");
        assert_eq!(b.next_line().unwrap().unwrap(), b"{}");
        assert!(!b.has_line());
        assert_eq!(b.next_line().unwrap(), None);
        b.push(&vec![b'x'; MAX_REQUEST_BYTES + 1]);
        assert!(matches!(b.next_line(), Err(ControlError::TooLong)));
        let mut b = LineBuffer::default();
        let mut long = vec![b'x'; MAX_REQUEST_BYTES + 1];
        long.push(b'\n');
        b.push(&long);
        assert!(matches!(b.next_line(), Err(ControlError::TooLong)));
    }

    #[test]
    fn responses_are_lines() {
        let ok = Response::Ok(serde_json::json!({"x": 1})).to_line();
        assert_eq!(ok, b"{\"ok\":{\"x\":1}}\n");
        let err = Response::Error("no".into()).to_line();
        assert_eq!(err, b"{\"error\":\"no\"}\n");
        let back: Response = serde_json::from_slice(&err).unwrap();
        assert_eq!(back, Response::Error("no".into()));
    }

    #[test]
    fn assignments_parse_and_refuse() {
        assert_eq!(
            parse_assignment("priority=7").unwrap(),
            ("priority", 7.into())
        );
        assert_eq!(
            parse_assignment("weight=512").unwrap(),
            ("weight", 512.into())
        );
        assert_eq!(
            parse_assignment("sched=prt").unwrap(),
            ("sched", "prt".into())
        );
        assert_eq!(parse_assignment("slo=250000").unwrap().1, 250_000_000u64);
        assert_eq!(parse_assignment("target_fps=30").unwrap().1, 30.0);
        let (k, v) = parse_assignment("reserve=2000/10000/ae").unwrap();
        assert_eq!(k, "reserve");
        assert_eq!(
            v,
            serde_json::json!({"c": 2_000_000u64, "t": 10_000_000u64, "enforcement": "ae"})
        );
        for bad in [
            "priority",
            "priority=-1",
            "priority=4294967296",
            "sched=rr",
            "target_fps=0",
            "target_fps=nan",
            "slo=18446744073709551615",
            "reserve=1/2",
            "reserve=1/2/xe",
            "reserve=1/2/pe/4",
            "colour=red",
        ] {
            assert!(parse_assignment(bad).is_err(), "{bad}");
        }
        let e = parse_assignment("colour=red").unwrap_err().to_string();
        assert!(e.contains("colour") && e.contains(PARAM_KEYS), "{e}");
    }
}
