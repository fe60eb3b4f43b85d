//! What the control CLIs (`vgpuctl`, `vgpu-smi`) share: the connection to the daemon's
//! control socket, their failures and exit codes, and the cells and tables they print.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::{Map, Value};

/// How long an answer may take: `create` waits up to 10 s for the device's socket.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// Where group names are: a refusal names the control socket's group.
const GROUP_FILE: &str = "/etc/group";
/// The most of [`GROUP_FILE`] read to name a group (local files are kilobytes); a group not
/// found in it is shown by its id.
const MAX_GROUP_FILE_BYTES: u64 = 16 << 20;

/// Why a control CLI failed.
#[derive(Debug)]
pub enum Failure {
    /// The daemon cannot be reached or answers what is not an answer: exit 2, as a command
    /// line that does not parse.
    Connection(String),
    /// The request was refused, by the daemon or by the checks made before asking it: exit 1.
    Refused(String),
}

impl From<crate::definitions::DefinitionError> for Failure {
    fn from(e: crate::definitions::DefinitionError) -> Failure {
        Failure::Refused(e.to_string())
    }
}

/// A connection to the daemon's control socket.
#[derive(Debug)]
pub struct Conn {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Conn {
    /// Connects to the control socket at `path`; answers wait at most [`ANSWER_TIMEOUT`].
    pub fn open(path: &Path) -> Result<Conn, Failure> {
        let fail = |e: std::io::Error| Failure::Connection(format!("{}: {e}", path.display()));
        let writer = UnixStream::connect(path).map_err(|e| unreachable(path, &e))?;
        writer
            .set_read_timeout(Some(ANSWER_TIMEOUT))
            .map_err(fail)?;
        let reader = BufReader::new(writer.try_clone().map_err(fail)?);
        Ok(Conn { writer, reader })
    }

    /// Sends one request and reads its answer: the `ok` value, or the daemon's refusal.
    pub fn call(&mut self, request: &Value) -> Result<Value, Failure> {
        let lost = |e: std::io::Error| Failure::Connection(format!("control connection: {e}"));
        let mut line = request.to_string();
        line.push('\n');
        self.writer.write_all(line.as_bytes()).map_err(lost)?;
        let mut answer = String::new();
        if self.reader.read_line(&mut answer).map_err(lost)? == 0 {
            return Err(Failure::Connection(
                "the daemon closed the connection".into(),
            ));
        }
        let answer: Value = serde_json::from_str(&answer)
            .map_err(|e| Failure::Connection(format!("bad answer from the daemon: {e}")))?;
        match answer {
            Value::Object(mut m) => {
                if let Some(e) = m.remove("error") {
                    return Err(Failure::Refused(e.as_str().unwrap_or("error").to_owned()));
                }
                m.remove("ok")
                    .ok_or(Failure::Connection("answer without ok or error".into()))
            }
            _ => Err(Failure::Connection("answer is not an object".into())),
        }
    }
}

/// Why no daemon answers at the control socket `path`, and what to do: a missing socket
/// (the daemon is not running), a refused connection (a socket left by a daemon that died)
/// and a socket the caller may not use are told apart.
fn unreachable(path: &Path, e: &std::io::Error) -> Failure {
    use std::io::ErrorKind;
    let shown = path.display();
    let (why, hint) = match e.kind() {
        ErrorKind::NotFound => (
            "No such file or directory",
            "is the daemon running? (systemctl status vgpu-schedd)",
        ),
        ErrorKind::ConnectionRefused => (
            "connection refused",
            "the socket is stale, left by a daemon that is gone: \
             start it again (systemctl restart vgpu-schedd)",
        ),
        ErrorKind::PermissionDenied => {
            return Failure::Connection(format!(
                "no vgpu-schedd answers at {shown} (permission denied): {}",
                permission_hint(path)
            ));
        }
        _ => return Failure::Connection(format!("no vgpu-schedd answers at {shown}: {e}")),
    };
    Failure::Connection(format!("no vgpu-schedd answers at {shown} ({why}): {hint}"))
}

/// Who may use the socket at `path` that refused the caller (EACCES), and how to get access:
/// its owner, mode and group (named from [`GROUP_FILE`]); or, where the socket cannot even be
/// looked at, that a directory on its path is closed to the caller.
fn permission_hint(path: &Path) -> String {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(_) => {
            let dir = path.parent().unwrap_or(path).display();
            return format!(
                "a directory on its path is closed to this user (see `ls -ld` of {dir} and \
                 the directories above it); run as root or as a user they admit"
            );
        }
    };
    let (uid, gid, mode) = (meta.uid(), meta.gid(), meta.mode() & 0o7777);
    if mode & 0o060 != 0o060 {
        return format!(
            "only its owner (uid {uid}) may use it (mode {mode:04o}): run as that user or as \
             root, or have the daemon share it with a group (vgpu-schedd --control-group vgpu)"
        );
    }
    let mut groups = String::new();
    let named = std::fs::File::open(GROUP_FILE)
        .and_then(|f| f.take(MAX_GROUP_FILE_BYTES).read_to_string(&mut groups))
        .ok()
        .and_then(|_| crate::control::group_name(&groups, gid));
    let group = named.map_or_else(|| gid.to_string(), str::to_owned);
    format!(
        "only its owner (uid {uid}) and group {group} may use it (mode {mode:04o}): add this \
         user to group {group} (usermod -aG {group} $USER, then log in again) or run as root"
    )
}

/// Only the VM named `only` of `vms` (`stats` or `list` entries), or all without a name;
/// refused, with the names known, when no entry has it.
pub fn only_vm(vms: &[Value], only: Option<&str>) -> Result<Vec<Value>, Failure> {
    let name_of = |vm: &Value| {
        vm.get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let Some(only) = only else {
        return Ok(vms.to_vec());
    };
    let found: Vec<Value> = vms
        .iter()
        .filter(|vm| name_of(vm) == only)
        .cloned()
        .collect();
    if found.is_empty() {
        let known: Vec<String> = vms.iter().map(name_of).collect();
        let known = if known.is_empty() {
            "none".to_owned()
        } else {
            known.join(", ")
        };
        return Err(Failure::Refused(format!(
            "unknown VM {only} (known: {known})"
        )));
    }
    Ok(found)
}

/// A JSON value as a table cell: `-` for none, numbers with one decimal.
pub fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".into(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(f) if n.is_f64() => format!("{f:.1}"),
            _ => n.to_string(),
        },
        Some(other) => other.to_string(),
    }
}

/// How a column's cells line up.
#[derive(Debug, Clone, Copy)]
pub enum Align {
    /// Text.
    Left,
    /// Figures.
    Right,
}

/// Rows as aligned lines under a header.
pub fn table(header: &[(&str, Align)], rows: &[Vec<String>]) -> Vec<String> {
    let mut widths: Vec<usize> = header.iter().map(|(h, _)| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let parts: Vec<String> = cells
            .iter()
            .zip(header.iter().zip(&widths))
            .map(|(c, ((_, align), w))| match align {
                Align::Left => format!("{c:<w$}"),
                Align::Right => format!("{c:>w$}"),
            })
            .collect();
        parts.join("  ").trim_end().to_owned()
    };
    let names: Vec<String> = header.iter().map(|(h, _)| (*h).to_owned()).collect();
    std::iter::once(line(&names))
        .chain(rows.iter().map(|r| line(r)))
        .collect()
}

/// Nanoseconds as milliseconds with one decimal.
pub fn ms(ns: f64) -> String {
    format!("{:.1}", ns / 1e6)
}

/// Nanoseconds as signed milliseconds with one decimal (`+0.0` for what rounds to zero).
pub fn signed_ms(ns: f64) -> String {
    let v = ns / 1e6;
    let v = if v.abs() < 0.05 { 0.0 } else { v };
    format!("{v:+.1}")
}

/// A policy figure of a VM's statistics.
pub fn figure(figures: &Map<String, Value>, key: &str) -> Option<f64> {
    figures.get(key).and_then(Value::as_f64)
}

/// A VM's standing under the policy family `policy`, in a few words: TimeGraph's reserve
/// budget (`reserve 3.0/5.0 ms`) or priority (`prio 3 ht`), fair queuing's lead over the
/// system virtual time (`vt +0.4 ms`), Pegasus's credit (`credits +1.2 ms`), VGRIS's share and
/// budget (`share 25 % +1.0 ms`) or SLA delay (`delay 2.1 ms`); `-` where the policy reports
/// nothing (policy none, a VM away).
pub fn policy_cell(policy: &str, figures: &Map<String, Value>) -> String {
    let f = |k| figure(figures, k);
    let flag = |k| f(k).is_some_and(|x| x != 0.0);
    let text = match policy {
        "timegraph" => f("priority").map(|prio| {
            let mut text = match (f("budget_ns"), f("capacity_ns")) {
                (Some(b), Some(c)) if flag("admitted") => format!("reserve {}/{} ms", ms(b), ms(c)),
                _ if flag("reserved") => format!("reserve refused, prio {prio:.0}"),
                _ if flag("ht") => format!("prio {prio:.0} ht"),
                _ => format!("prio {prio:.0} prt"),
            };
            if flag("throttled") {
                text.push_str(", throttled");
            }
            text
        }),
        "fair" => f("lag_ms").map(|lag| {
            let mut text = format!("vt {} ms", signed_ms(lag * 1e6));
            if flag("over") {
                text.push_str(", over");
            }
            text
        }),
        p if p.starts_with("pegasus") => f("credit_ns").map(|credit| {
            let mut text = format!("credits {} ms", signed_ms(credit));
            if flag("slo_violated") {
                text.push_str(", SLO missed");
            }
            text
        }),
        "vgris" if flag("sla_aware") => f("delay_ns").map(|d| format!("delay {} ms", ms(d))),
        "vgris" => f("share").map(|share| {
            let budget = f("budget_ns").unwrap_or(0.0);
            format!("share {:.0} % {} ms", share * 100.0, signed_ms(budget))
        }),
        _ => None,
    };
    text.unwrap_or_else(|| "-".into())
}

/// Latency percentiles in µs as `p50/p99` in ms, or in µs where both are below 1 ms.
pub fn latency_cell(p50_us: f64, p99_us: f64) -> String {
    if p99_us < 1_000.0 {
        format!("{p50_us:.0}/{p99_us:.0} µs")
    } else {
        format!("{:.1}/{:.1} ms", p50_us / 1e3, p99_us / 1e3)
    }
}

/// Memory in use of a budget, both in bytes, in MiB (`-` before the device reported it).
pub fn memory_cell(used: Option<u64>, limit: Option<u64>) -> String {
    match (used, limit) {
        (Some(u), Some(l)) => {
            const MIB: f64 = (1u64 << 20) as f64;
            format!("{:.0}/{:.0} MiB", u as f64 / MIB, l as f64 / MIB)
        }
        _ => "-".into(),
    }
}

/// A parameter's value as `vgpuctl set` and `define` take it (`-` for none): a reserve as
/// `C_us/T_us/pe|ae` (with `@name` for a Shared reserve), `slo` in µs of GPU time per second,
/// a priority of `max` for the highest (a focused wildcard spec line's).
pub fn param_text(key: &str, v: Option<&Value>) -> String {
    let us = |ns: &Value| ns.as_u64().map(|ns| ns / 1_000);
    let text = v.filter(|v| !v.is_null()).and_then(|v| match key {
        "reserve" => {
            let mut text = format!(
                "{}/{}/{}",
                us(v.get("c")?)?,
                us(v.get("t")?)?,
                v.get("enforcement")?.as_str()?
            );
            if let Some(name) = v.get("shared").and_then(Value::as_str) {
                text.push('@');
                text.push_str(name);
            }
            Some(text)
        }
        "slo" => us(v).map(|us| us.to_string()),
        "priority" if v.as_u64() == Some(u64::from(u32::MAX)) => Some("max".into()),
        _ => Some(cell(Some(v))),
    });
    text.unwrap_or_else(|| "-".into())
}

/// The exit of a control CLI named `tool` that ended with `result`: 0 ok; 1 refused; 2 the
/// daemon cannot be reached (as a command line that does not parse). The reason is on
/// stderr; with `json` also on stdout as one line `{"error": REASON, "exit": CODE}`, so that a
/// script reads answers and failures from one stream.
pub fn exit(tool: &str, json: bool, result: Result<(), Failure>) -> ExitCode {
    let (why, code) = match result {
        Ok(()) => return ExitCode::SUCCESS,
        Err(Failure::Refused(e)) => (e, 1u8),
        Err(Failure::Connection(e)) => (e, 2u8),
    };
    eprintln!("{tool}: {why}");
    if json {
        println!("{}", serde_json::json!({"error": why, "exit": code}));
    }
    ExitCode::from(code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn connection_failure(path: &Path) -> String {
        match Conn::open(path) {
            Err(Failure::Connection(e)) => e,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_unreachable_daemon_is_explained() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        let missing = connection_failure(&path);
        assert!(
            missing.starts_with(&format!("no vgpu-schedd answers at {}", path.display())),
            "{missing}"
        );
        assert!(missing.contains("(No such file or directory): is the daemon running?"));
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let stale = connection_failure(&path);
        assert!(
            stale.contains("(connection refused): the socket is stale"),
            "{stale}"
        );
    }

    /// The name `getent` (NSS, as `ls -l` does) gives group `gid`.
    fn getent_group(gid: u32) -> String {
        let out = std::process::Command::new("getent")
            .args(["group", &gid.to_string()])
            .output()
            .unwrap();
        let line = String::from_utf8(out.stdout).unwrap();
        line.split(':').next().unwrap().to_owned()
    }

    #[test]
    fn a_refused_caller_is_told_who_may_use_the_socket() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        // The errno a connect to a socket the caller may not write returns (EACCES); tests
        // that run as root cannot get it from this process (root passes every mode), the
        // integration test gets it from vgpuctl run as another user.
        let denied = || std::io::Error::from_raw_os_error(libc::EACCES);
        let message = |path: &Path| match unreachable(path, &denied()) {
            Failure::Connection(e) => e,
            other => panic!("{other:?}"),
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        let (uid, group) = (meta.uid(), getent_group(meta.gid()));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o660)).unwrap();
        let shared = message(&path);
        assert_eq!(
            shared,
            format!(
                "no vgpu-schedd answers at {} (permission denied): only its owner (uid {uid}) \
                 and group {group} may use it (mode 0660): add this user to group {group} \
                 (usermod -aG {group} $USER, then log in again) or run as root",
                path.display()
            )
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let private = message(&path);
        assert!(
            private.contains("(permission denied): only its owner")
                && private.contains("(mode 0600): run as that user or as root")
                && private.contains("--control-group"),
            "{private}"
        );
        let hidden = message(&dir.path().join("closed").join("control.sock"));
        assert!(
            hidden.contains("(permission denied): a directory on its path is closed"),
            "{hidden}"
        );
    }

    #[test]
    fn only_vm_keeps_the_named_vm_or_refuses_with_the_known_ones() {
        let vms = [json!({"name": "a"}), json!({"name": "b"})];
        assert_eq!(only_vm(&vms, None).unwrap().len(), 2);
        assert_eq!(
            only_vm(&vms, Some("b")).unwrap(),
            vec![json!({"name": "b"})]
        );
        assert!(matches!(
            only_vm(&vms, Some("c")),
            Err(Failure::Refused(e)) if e == "unknown VM c (known: a, b)"
        ));
        assert!(matches!(
            only_vm(&[], Some("c")),
            Err(Failure::Refused(e)) if e == "unknown VM c (known: none)"
        ));
    }
}
