//! The `vgpu-schedd` and `vgpuctl` binaries end to end: fake devices over SOCK_SEQPACKET,
//! the control socket, metrics over HTTP, signals, restarts and bad command lines.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tempfile::TempDir;
use vgpu_schedd::proto::{self, Exec, MAX_MESSAGE_BYTES, Msg, PROTOCOL_VERSION, VmName};
use vgpu_schedd::seqpacket::{SeqStream, monotonic_ns, terminate};
use vgpu_scheduler::{CostSignature, GroupId, GroupKind, PolicyConfig};

const SCHEDD: &str = env!("CARGO_BIN_EXE_vgpu-schedd");
const VGPUCTL: &str = env!("CARGO_BIN_EXE_vgpuctl");
const WAIT: Duration = Duration::from_secs(10);

/// A daemon child: killed by pid and reaped on drop; its stderr printed when a test fails.
struct Schedd {
    child: Option<Child>,
    dir: PathBuf,
    log: PathBuf,
}

impl Schedd {
    fn start(dir: &Path, extra: &[&str]) -> Schedd {
        Schedd::start_with_umask(dir, extra, 0o022)
    }

    /// Starts the daemon with file mode creation mask `umask` (through `sh`, which then
    /// becomes the daemon).
    fn start_with_umask(dir: &Path, extra: &[&str], umask: u32) -> Schedd {
        let log = dir.join(format!("schedd-{}.log", monotonic_ns()));
        let child = Command::new("/bin/sh")
            .arg("-c")
            .arg(format!("umask {umask:03o} && exec \"$0\" \"$@\""))
            .arg(SCHEDD)
            .arg("--socket")
            .arg(dir.join("sched.sock"))
            .arg("--control")
            .arg(dir.join("control.sock"))
            // A config dir of its own that does not exist: no definitions, no live state kept
            // (an installed package's /etc/vgpu is not this test's).
            .arg("--config-dir")
            .arg(dir.join("etc"))
            .args(["--log-level", "debug"])
            .args(extra)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let d = Schedd {
            child: Some(child),
            dir: dir.to_path_buf(),
            log,
        };
        d.wait_ready();
        d
    }

    fn wait_ready(&self) {
        let start = Instant::now();
        while UnixStream::connect(self.control()).is_err() {
            assert!(start.elapsed() < WAIT, "daemon did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn sock(&self) -> PathBuf {
        self.dir.join("sched.sock")
    }

    fn control(&self) -> PathBuf {
        self.dir.join("control.sock")
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits for the daemon to exit and returns its status code.
    fn wait_exit(&mut self) -> Option<i32> {
        let mut child = self.child.take().unwrap();
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.code();
            }
            assert!(start.elapsed() < WAIT, "daemon did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends one control request and returns the answer.
    fn call(&self, request: Value) -> Value {
        let mut s = UnixStream::connect(self.control()).unwrap();
        s.write_all(format!("{request}\n").as_bytes()).unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    }

    fn vm_stats(&self, name: &str) -> Value {
        let stats = self.call(json!({"cmd": "stats"}));
        let vms = stats["ok"]["vms"].as_array().unwrap().clone();
        vms.into_iter()
            .find(|v| v["name"] == name)
            .unwrap_or(Value::Null)
    }

    fn ctl(&self, args: &[&str]) -> Output {
        let control = self.control();
        let mut all = vec!["--control", control.to_str().unwrap()];
        all.extend_from_slice(args);
        ctl(&all)
    }
}

impl Drop for Schedd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("--- vgpu-schedd stderr ---\n{log}");
        }
    }
}

fn ctl(args: &[&str]) -> Output {
    Command::new(VGPUCTL).args(args).output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A fake device process.
struct Device {
    s: SeqStream,
}

impl Device {
    fn connect(path: &Path, name: &str) -> Device {
        let s = SeqStream::connect(path).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let d = Device { s };
        d.send(&Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new(name).unwrap(),
            device_pid: std::process::id(),
            qemu_pid: 0,
        });
        match d.recv() {
            Some(Msg::Welcome { .. }) => d,
            other => panic!("no Welcome: {other:?}"),
        }
    }

    fn send(&self, m: &Msg) {
        let mut b = Vec::new();
        proto::encode(m, &mut b);
        self.s.send(&b).unwrap();
    }

    /// The next message; `None` at end of stream.
    fn recv(&self) -> Option<Msg> {
        let mut buf = vec![0u8; MAX_MESSAGE_BYTES + 1];
        let n = self.s.recv(&mut buf).unwrap().expect("timed out");
        (n > 0).then(|| proto::decode(&buf[..n]).unwrap())
    }

    fn submit(&self, id: u64) {
        self.send(&Msg::Submit {
            group: GroupId(id),
            context: 0,
            kind: GroupKind::Render,
            signature: CostSignature(1),
            cost_ns: 0,
            exec: Exec::Device,
        });
    }

    fn complete(&self, id: u64) {
        let finish = monotonic_ns();
        self.send(&Msg::Completed {
            group: GroupId(id),
            start: finish.saturating_sub(1_000),
            finish,
        });
    }

    fn expect_grant(&self, id: u64) {
        match self.recv() {
            Some(Msg::Grant { group }) => assert_eq!(group, GroupId(id)),
            other => panic!("expected Grant {id}, got {other:?}"),
        }
    }

    fn nothing_pending(&self) {
        self.s
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        assert_eq!(self.s.recv(&mut [0; 64]).unwrap(), None);
        self.s.set_read_timeout(Some(WAIT)).unwrap();
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn prt_grants_by_priority_and_vgpuctl_shows_them() {
    let dir = TempDir::new().unwrap();
    let policy = write(
        dir.path(),
        "prt.toml",
        "policy = \"timegraph\"\nsched = \"prt\"\n",
    );
    let d = Schedd::start(dir.path(), &["--policy", policy.to_str().unwrap()]);
    for (vm, prio) in [("lo", "priority=1"), ("hi", "priority=10")] {
        let o = d.ctl(&["set", "--add", vm, prio]);
        assert!(o.status.success(), "{o:?}");
    }
    // A reserve of 1 s every second: hi has a budget to show, lo none.
    let o = d.ctl(&["set", "--add", "hi", "reserve=1000000/1000000/pe"]);
    assert!(o.status.success(), "{o:?}");
    let lo = Device::connect(&d.sock(), "lo");
    let hi = Device::connect(&d.sock(), "hi");
    lo.submit(1);
    lo.expect_grant(1);
    lo.submit(2);
    hi.submit(7);
    wait_until("both queued", || {
        d.vm_stats("lo")["queue_depth"] == 1 && d.vm_stats("hi")["queue_depth"] == 1
    });
    lo.complete(1);
    hi.expect_grant(7);
    lo.nothing_pending();
    hi.complete(7);
    lo.expect_grant(2);

    let o = d.ctl(&["--json", "list"]);
    assert!(o.status.success());
    let list: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(list["policy"]["policy"], "timegraph");
    let vms = list["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 2);
    let hi_info = vms.iter().find(|v| v["name"] == "hi").unwrap();
    assert_eq!(
        (&hi_info["connected"], &hi_info["params"]["priority"]),
        (&json!(true), &json!(10))
    );
    let o = d.ctl(&["--json", "show"]);
    let stats: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let hi_stats = stats["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "hi")
        .unwrap();
    assert_eq!(
        (&hi_stats["completed"], &hi_stats["submitted"]),
        (&json!(1), &json!(1))
    );
    assert_eq!(hi_stats["budget"]["capacity_ns"], json!(1_000_000_000));
    let vms = stats["vms"].as_array().unwrap();
    let lo_stats = vms.iter().find(|v| v["name"] == "lo").unwrap();
    assert!(lo_stats["budget"].is_null(), "{lo_stats}");
    let table = stdout(&d.ctl(&["show"]));
    let row = |vm: &str| {
        let prefix = format!("{vm} ");
        let line = table.lines().find(|l| l.starts_with(&prefix));
        line.unwrap_or_default().to_owned()
    };
    assert!(
        table.lines().nth(1).unwrap().ends_with("  policy"),
        "{table}"
    );
    assert!(row("hi").contains("/1000.0 ms"), "{table}");
    assert!(
        !row("lo").contains("reserve") && !row("lo").is_empty(),
        "{table}"
    );
    let table = stdout(&d.ctl(&["list"]));
    assert!(table.contains("policy: timegraph") && table.lines().any(|l| l.starts_with("hi ")));
    let o = d.ctl(&["show", "--watch", "0.05", "--count", "2"]);
    assert!(o.status.success());
    assert_eq!(stdout(&o).matches("GPU share").count(), 2, "{}", stdout(&o));
    let o = d.ctl(&["--json", "show", "--watch", "0.01", "--count", "3"]);
    assert_eq!(stdout(&o).lines().count(), 3);
}

#[test]
fn live_policy_change_params_and_focus() {
    let dir = TempDir::new().unwrap();
    let d = Schedd::start(dir.path(), &[]);
    let dev = Device::connect(&d.sock(), "vm");
    dev.submit(1);
    dev.expect_grant(1);
    let fair = write(dir.path(), "fair.toml", "policy = \"fair\"\n");
    let o = d.ctl(&["set-policy", fair.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    assert!(stdout(&o).contains("fair"));
    let start = Instant::now();
    loop {
        match dev.recv() {
            Some(Msg::Lease { .. }) => break,
            Some(_) => assert!(start.elapsed() < WAIT),
            None => panic!("daemon closed the device"),
        }
    }
    let o = d.ctl(&["--json", "set", "vm", "weight=512", "priority=3"]);
    assert!(o.status.success(), "{o:?}");
    let params: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        (&params["weight"], &params["priority"]),
        (&json!(512), &json!(3))
    );
    assert!(d.ctl(&["focus", "vm"]).status.success());
    // Refused requests exit 1, whether the daemon or vgpuctl's own check refuses them;
    // command lines that do not parse exit 2.
    assert_eq!(d.ctl(&["focus", "nobody"]).status.code(), Some(1));
    assert_eq!(d.ctl(&["set", "vm", "weight=0"]).status.code(), Some(1));
    assert_eq!(d.ctl(&["set", "vm", "colour=red"]).status.code(), Some(1));
    assert_eq!(d.ctl(&["set", "vm"]).status.code(), Some(2));
    let bad = write(dir.path(), "bad.toml", "policy = \"lottery\"\n");
    assert_eq!(
        d.ctl(&["set-policy", bad.to_str().unwrap()]).status.code(),
        Some(1)
    );
    let tg = write(
        dir.path(),
        "tg.toml",
        "policy = \"timegraph\"\nadmission_limit = 1.0\nspecs = [\"a:b:c\"]\n",
    );
    let o = d.ctl(&["set-policy", tg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
}

#[test]
fn vgpuctl_list_shows_and_marks_what_the_policy_applies() {
    let dir = TempDir::new().unwrap();
    let d = Schedd::start(dir.path(), &[]);
    for (vm, set) in [
        ("game", "priority=0"),
        ("plain", "sched=prt"),
        ("away", "weight=9"),
    ] {
        let o = d.ctl(&["set", "--add", vm, set]);
        assert!(o.status.success(), "{o:?}");
    }
    let _game = Device::connect(&d.sock(), "game");
    let _video = Device::connect(&d.sock(), "video");
    let _plain = Device::connect(&d.sock(), "plain");
    let policy = write(
        dir.path(),
        "tg.toml",
        "policy = \"timegraph\"\nwildcard_priority = 2\nspecs = [\"<game:ht:none:10:1:1>\", \
         \"<video:prt:pe:*:250:1000>\"]\n",
    );
    let o = d.ctl(&["set-policy", policy.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    assert!(d.ctl(&["focus", "video"]).status.success());
    let table = stdout(&d.ctl(&["list"]));
    let row = |vm: &str| -> Vec<String> {
        let prefix = format!("{vm} ");
        let line = table.lines().find(|l| l.starts_with(&prefix));
        let line = line.unwrap_or_else(|| panic!("no {vm} row in {table}"));
        line.split_whitespace().map(str::to_owned).collect()
    };
    // VM vGPU connected pid qemu priority weight sched reserve slo fps.
    assert_eq!(
        row("game")[5..],
        ["10*", "256", "ht*", "-", "-", "-"],
        "{table}"
    );
    // The focused wildcard line's priority is the highest there is.
    assert_eq!(
        row("video")[5..],
        ["max*", "256", "prt*", "250/1000/pe*", "-", "-"],
        "{table}"
    );
    assert_eq!(
        row("plain")[5..],
        ["0", "256", "prt", "-", "-", "-"],
        "{table}"
    );
    assert_eq!(row("away")[5..], ["0", "9", "-", "-", "-", "-"], "{table}");
    assert!(
        table.lines().any(|l| l.starts_with("* set by the policy")),
        "{table}"
    );
    let list: Value = serde_json::from_str(&stdout(&d.ctl(&["--json", "list"]))).unwrap();
    let vm = |name: &str| {
        let vms = list["vms"].as_array().unwrap();
        vms.iter().find(|v| v["name"] == name).unwrap().clone()
    };
    assert_eq!(vm("game")["params"]["priority"], json!(0));
    assert_eq!(vm("game")["effective"]["priority"], json!(10));
    assert_eq!(vm("away")["effective"], Value::Null);
    // Without the spec lines nothing is marked.
    let none = write(dir.path(), "none.toml", "policy = \"none\"\n");
    assert!(
        d.ctl(&["set-policy", none.to_str().unwrap()])
            .status
            .success()
    );
    let table = stdout(&d.ctl(&["list"]));
    assert!(!table.contains('*'), "{table}");
}

#[test]
fn control_survives_garbage_and_bounds_requests() {
    let dir = TempDir::new().unwrap();
    let d = Schedd::start(dir.path(), &[]);
    let s = UnixStream::connect(d.control()).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    for bad in [
        "not json",
        "{\"cmd\":\"reboot\"}",
        "{\"cmd\":\"list\",\"x\":1}",
        "[]",
    ] {
        w.write_all(format!("{bad}\n").as_bytes()).unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert!(v["error"].is_string(), "{bad}: {line}");
    }
    w.write_all(b"{\"cmd\":\"list\"}\n").unwrap();
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(serde_json::from_str::<Value>(&line).unwrap()["ok"].is_object());
    // An endless line: an error, then the connection closes.
    let _ = w.write_all(&vec![b'x'; 200 * 1024]);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.contains("error"), "{line}");
    let mut rest = String::new();
    assert_eq!(r.read_to_string(&mut rest).unwrap_or(0), 0);
    assert!(d.call(json!({"cmd": "stats"}))["ok"].is_object());
    // A client that closes its sending side still gets its answer.
    let mut s = UnixStream::connect(d.control()).unwrap();
    s.write_all(b"{\"cmd\":\"list\"}\n").unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("{\"ok\""), "{answer}");
}

/// Stops (SIGSTOP) or continues (SIGCONT) the daemon; a stop returns once it is stopped.
fn pause(d: &Schedd, stop: bool) {
    let pid = libc::pid_t::try_from(d.pid()).unwrap();
    let signal = if stop { libc::SIGSTOP } else { libc::SIGCONT };
    // SAFETY: kill(2) takes no pointers; the pid is our own child, not reaped.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    if stop {
        wait_until("the daemon to stop", || {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            let state = stat.rsplit_once(')').unwrap().1.split_whitespace().next();
            state == Some("T")
        });
    }
}

#[test]
fn a_batch_of_requests_does_not_hold_up_another_client() {
    const BATCH: usize = 2000;
    let dir = TempDir::new().unwrap();
    let d = Schedd::start(dir.path(), &[]);
    let batch = UnixStream::connect(d.control()).unwrap();
    batch.set_read_timeout(Some(WAIT)).unwrap();
    let mut batch_answers = BufReader::new(batch.try_clone().unwrap());
    let mut batch = batch;
    // Accepted before the daemon is stopped.
    batch.write_all(b"{\"cmd\":\"list\"}\n").unwrap();
    let mut line = String::new();
    batch_answers.read_line(&mut line).unwrap();
    // While it is stopped, the batch and then the other client's request are both waiting.
    pause(&d, true);
    batch
        .write_all("{\"cmd\":\"list\"}\n".repeat(BATCH).as_bytes())
        .unwrap();
    let mut other = UnixStream::connect(d.control()).unwrap();
    other.set_read_timeout(Some(WAIT)).unwrap();
    let set = json!({"cmd": "set-params", "vm": "probe", "params": {"priority": 7}, "add": true});
    other.write_all(format!("{set}\n").as_bytes()).unwrap();
    pause(&d, false);
    let mut answer = String::new();
    BufReader::new(other).read_line(&mut answer).unwrap();
    assert!(answer.starts_with("{\"ok\""), "{answer}");
    // The batch's answers tell when the other request was carried out: the probe VM shows in
    // every list after it.
    let mut first_with_probe = None;
    for i in 0..BATCH {
        line.clear();
        batch_answers.read_line(&mut line).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        let vms = v["ok"]["vms"].as_array().unwrap();
        let probe = vms.iter().any(|vm| vm["name"] == "probe");
        match first_with_probe {
            None if probe => first_with_probe = Some(i),
            Some(_) => assert!(probe, "answer {i}"),
            None => {}
        }
    }
    let first = first_with_probe.expect("the other request waited for the whole batch");
    eprintln!("the other request came after {first} of the batch's {BATCH}");
    assert!(first < BATCH / 2, "{first}");
}

#[test]
fn a_client_that_never_reads_its_answers_is_dropped() {
    let dir = TempDir::new().unwrap();
    let d = Schedd::start(dir.path(), &[]);
    let mut greedy = UnixStream::connect(d.control()).unwrap();
    greedy.set_write_timeout(Some(WAIT)).unwrap();
    let writer = std::thread::spawn(move || {
        let batch = "{\"cmd\":\"stats\"}\n".repeat(1000);
        let start = Instant::now();
        loop {
            if let Err(e) = greedy.write_all(batch.as_bytes()) {
                return (e.kind(), start.elapsed());
            }
        }
    });
    assert!(d.call(json!({"cmd": "list"}))["ok"].is_object());
    let (error, took) = writer.join().unwrap();
    assert!(
        matches!(
            error,
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        ),
        "{error:?} after {took:?}"
    );
    assert!(d.call(json!({"cmd": "list"}))["ok"].is_object());
}

/// The mode bits of a file.
fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn control_socket_is_private_whatever_the_umask() {
    use std::os::unix::fs::MetadataExt;
    let dir = TempDir::new().unwrap();
    let d = Schedd::start_with_umask(dir.path(), &[], 0);
    assert_eq!(mode(&d.control()), 0o600);
    assert!(d.call(json!({"cmd": "list"}))["ok"].is_object());
    drop(d);
    let dir = TempDir::new().unwrap();
    let d = Schedd::start_with_umask(dir.path(), &["--control-group", "4242"], 0);
    assert_eq!(mode(&d.control()), 0o660);
    assert_eq!(std::fs::metadata(d.control()).unwrap().gid(), 4242);
    assert!(d.call(json!({"cmd": "list"}))["ok"].is_object());
}

/// What a control client of another identity got.
#[derive(Debug, PartialEq, Eq)]
enum PeerOutcome {
    /// An answer.
    Answered,
    /// The daemon closed the connection without one.
    Closed,
    /// `connect` failed with this errno.
    NoConnect(i32),
}

/// Sends `list` to the control socket from a forked child running as user `uid`, group `gid`
/// and supplementary `groups` (needs root). The child makes only async-signal-safe system
/// calls on memory prepared before the fork, gives up by itself (receive timeout, alarm) and
/// reports through its exit status: 0 answered, 1 closed, 2 no answer in time, 3 identity
/// not taken, 10 + errno connect failed.
fn list_as(control: &Path, uid: u32, gid: u32, groups: &[u32]) -> PeerOutcome {
    use std::mem::size_of;
    use std::os::unix::ffi::OsStrExt;
    let mut addr = libc::sockaddr_un {
        sun_family: libc::AF_UNIX as libc::sa_family_t,
        sun_path: [0; 108],
    };
    let path = control.as_os_str().as_bytes();
    assert!(path.len() < addr.sun_path.len());
    for (d, &b) in addr.sun_path.iter_mut().zip(path) {
        *d = b as libc::c_char;
    }
    let request = b"{\"cmd\":\"list\"}\n";
    let timeout = libc::timeval {
        tv_sec: 5,
        tv_usec: 0,
    };
    // SAFETY: fork(2) takes no pointers; the child below only makes async-signal-safe calls.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: every pointer passed points to memory prepared before the fork, alive until
        // _exit; all calls are async-signal-safe system calls.
        unsafe {
            libc::alarm(10);
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                libc::_exit(3);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const timeout).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            );
            let len = size_of::<libc::sockaddr_un>() as libc::socklen_t;
            if libc::connect(fd, (&raw const addr).cast(), len) != 0 {
                libc::_exit(10 + (*libc::__errno_location()).min(200));
            }
            libc::send(
                fd,
                request.as_ptr().cast(),
                request.len(),
                libc::MSG_NOSIGNAL,
            );
            let mut answer = [0u8; 64];
            let n = libc::read(fd, answer.as_mut_ptr().cast(), answer.len());
            let errno = *libc::__errno_location();
            libc::_exit(match n {
                1.. => 0,
                0 => 1,
                _ if errno == libc::ECONNRESET => 1,
                _ => 2,
            });
        }
    }
    let start = Instant::now();
    let mut status = 0;
    loop {
        // SAFETY: `status` is valid for writes; `pid` is our own child.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc == pid {
            break;
        }
        if start.elapsed() > WAIT * 2 {
            // SAFETY: kill and waitpid on our own child, not reaped yet.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            panic!("client child did not exit");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(libc::WIFEXITED(status), "client child status {status:#x}");
    match libc::WEXITSTATUS(status) {
        0 => PeerOutcome::Answered,
        1 => PeerOutcome::Closed,
        code @ 10.. => PeerOutcome::NoConnect(code - 10),
        code => panic!("client child exit {code}"),
    }
}

/// True when the tests run as root (and can take other identities).
fn root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").unwrap().uid() == 0
}

#[test]
fn control_peers_of_other_users_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    if !root() {
        eprintln!("skipped: needs root to connect as other users");
        return;
    }
    const NOBODY: u32 = 65534;
    const GROUP: u32 = 4242;
    let dir = TempDir::new().unwrap();
    // The directory must let the other users reach the socket.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let d = Schedd::start(dir.path(), &[]);
    let c = d.control();
    assert_eq!(list_as(&c, 0, 0, &[]), PeerOutcome::Answered);
    // The mode keeps others out...
    assert_eq!(
        list_as(&c, NOBODY, NOBODY, &[]),
        PeerOutcome::NoConnect(libc::EACCES)
    );
    // ...and where it does not (an operator's chmod), the peer check does.
    std::fs::set_permissions(&c, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(list_as(&c, NOBODY, NOBODY, &[]), PeerOutcome::Closed);
    assert_eq!(list_as(&c, NOBODY, GROUP, &[GROUP]), PeerOutcome::Closed);
    assert_eq!(list_as(&c, 0, 0, &[]), PeerOutcome::Answered);
    let log = std::fs::read_to_string(&d.log).unwrap();
    assert!(
        log.contains("control client refused: pid") && log.contains("uid 65534"),
        "{log}"
    );
    drop(d);

    // With a control group, its members get in through their group or a supplementary one.
    let d = Schedd::start(dir.path(), &["--control-group", &GROUP.to_string()]);
    let c = d.control();
    assert_eq!(list_as(&c, NOBODY, GROUP, &[]), PeerOutcome::Answered);
    assert_eq!(
        list_as(&c, NOBODY, NOBODY, &[7, GROUP]),
        PeerOutcome::Answered
    );
    assert_eq!(
        list_as(&c, NOBODY, NOBODY, &[7]),
        PeerOutcome::NoConnect(libc::EACCES)
    );
    std::fs::set_permissions(&c, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(list_as(&c, NOBODY, NOBODY, &[7]), PeerOutcome::Closed);
    assert_eq!(list_as(&c, NOBODY, NOBODY, &[GROUP]), PeerOutcome::Answered);
}

#[test]
fn garbage_device_dropped_while_another_is_served() {
    let dir = TempDir::new().unwrap();
    let d = Schedd::start(dir.path(), &[]);
    let good = Device::connect(&d.sock(), "good");
    for packet in [b"garbage!".to_vec(), vec![0u8; MAX_MESSAGE_BYTES + 100]] {
        let bad = SeqStream::connect(&d.sock()).unwrap();
        bad.set_read_timeout(Some(WAIT)).unwrap();
        bad.send(&packet).unwrap();
        let mut buf = vec![0u8; MAX_MESSAGE_BYTES + 1];
        let n = bad.recv(&mut buf).unwrap().unwrap();
        assert!(matches!(proto::decode(&buf[..n]), Ok(Msg::Refused { .. })));
        assert_eq!(bad.recv(&mut buf).unwrap(), Some(0), "closed after Refused");
    }
    // A second Hello for a live name is refused too.
    let dup = SeqStream::connect(&d.sock()).unwrap();
    let mut b = Vec::new();
    proto::encode(
        &Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new("good").unwrap(),
            device_pid: std::process::id(),
            qemu_pid: 0,
        },
        &mut b,
    );
    dup.send(&b).unwrap();
    dup.set_read_timeout(Some(WAIT)).unwrap();
    let mut buf = vec![0u8; MAX_MESSAGE_BYTES + 1];
    let n = dup.recv(&mut buf).unwrap().unwrap();
    assert!(matches!(proto::decode(&buf[..n]), Ok(Msg::Refused { .. })));
    good.submit(1);
    good.expect_grant(1);
    good.complete(1);
    good.submit(2);
    good.expect_grant(2);
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http(port: u16, request: &[u8]) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(request).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer
}

#[test]
fn metrics_over_http() {
    let dir = TempDir::new().unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let d = Schedd::start(dir.path(), &["--metrics", &addr]);
    let dev = Device::connect(&d.sock(), "m1");
    dev.submit(1);
    dev.expect_grant(1);
    dev.complete(1);
    wait_until("completion", || d.vm_stats("m1")["completed"] == 1);
    let request = |line: &str| format!("{line}\r\nHost: {addr}\r\n\r\n");
    let answer = http(port, request("GET /metrics HTTP/1.1").as_bytes());
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.contains("vm=\"m1\""), "{answer}");
    let answer = |line: &str| http(port, request(line).as_bytes());
    // The health check: no token, the connected VMs counted.
    let health = answer("GET /healthz HTTP/1.1");
    assert!(health.starts_with("HTTP/1.1 200 OK\r\n"), "{health}");
    assert!(
        health.ends_with("\r\n\r\n{\"status\":\"ok\",\"vms_connected\":1}"),
        "{health}"
    );
    let foreign = http(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(foreign.starts_with("HTTP/1.1 403"), "{foreign}");
    assert!(answer("GET /other HTTP/1.0").starts_with("HTTP/1.1 404"));
    assert!(answer("POST /metrics HTTP/1.1").starts_with("HTTP/1.1 405"));
    assert!(http(port, b"hello\r\n\r\n").starts_with("HTTP/1.1 400"));
    assert!(http(port, &vec![b'G'; 20_000]).starts_with("HTTP/1.1 431"));
    // Only with a Host naming the listener (DNS rebinding).
    assert!(http(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.1 403"));
    assert!(http(port, b"GET /metrics HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 403"));
    // A silent client does not block the others.
    let _silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    assert!(answer("GET /metrics HTTP/1.1").contains("vm=\"m1\""));
}

#[test]
fn metrics_pass_promtool_under_every_policy() {
    let dir = TempDir::new().unwrap();
    let port = free_port();
    let d = Schedd::start(dir.path(), &["--metrics", &format!("127.0.0.1:{port}")]);
    let vms = ["m1", "m2"];
    let devices: Vec<Device> = vms.iter().map(|n| Device::connect(&d.sock(), n)).collect();
    for dev in &devices {
        dev.submit(1);
        dev.expect_grant(1);
        dev.complete(1);
    }
    wait_until("completions", || {
        vms.iter().all(|n| d.vm_stats(n)["completed"] == 1)
    });
    let request = format!("GET /metrics HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    for policy in PolicyConfig::every_mode() {
        let answer = d.call(json!({"cmd": "set-policy", "policy": policy}));
        let name = answer["ok"]["policy"].as_str();
        let name = name.unwrap_or_else(|| panic!("{answer}"));
        let answer = http(port, request.as_bytes());
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        let status = head.lines().next().unwrap_or_default();
        assert!(status.contains(" 200 "), "{name}: {head}");
        let content_type = "content-type: text/plain; version=0.0.4; charset=utf-8";
        assert!(
            head.lines().any(|l| l.eq_ignore_ascii_case(content_type)),
            "{name}: {head}"
        );
        common::assert_promtool_clean(body);
        let info = format!("vgpu_policy_info{{policy=\"{name}\"}} 1\n");
        assert!(body.contains(&info), "{name}: {body}");
        for vm in vms {
            let connected = format!("vgpu_connected{{vm=\"{vm}\"}} 1\n");
            assert!(body.contains(&connected), "{name}: {body}");
        }
        // The policy's own families (none has none).
        let family = name.split('-').next().unwrap_or(name);
        let own = format!("\nvgpu_{family}_");
        assert_eq!(body.contains(&own), name != "none", "{name}: {body}");
    }
}

#[test]
fn idle_metrics_connections_never_lock_out_a_scraper() {
    use vgpu_schedd::server::{HTTP_HEAD_TIMEOUT, MAX_HTTP_CLIENTS};
    let dir = TempDir::new().unwrap();
    let port = free_port();
    let d = Schedd::start(dir.path(), &["--metrics", &format!("127.0.0.1:{port}")]);
    let _dev = Device::connect(&d.sock(), "m1");
    // More silent connections than the daemon serves at once, all before the scrape.
    let idle: Vec<TcpStream> = (0..MAX_HTTP_CLIENTS + 4)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let scrape = format!("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    let answer = http(port, scrape.as_bytes());
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer:?}");
    assert!(answer.contains("vm=\"m1\""), "{answer}");
    drop(idle);

    // A client trickling its head is closed once its time to send it is up.
    // Timed from before the connect: the daemon may accept it (and start its clock) before
    // connect returns here.
    let start = Instant::now();
    let mut slow = TcpStream::connect(("127.0.0.1", port)).unwrap();
    slow.write_all(b"GET /metr").unwrap();
    slow.set_read_timeout(Some(HTTP_HEAD_TIMEOUT + Duration::from_secs(2)))
        .unwrap();
    let mut buf = [0u8; 64];
    let read = loop {
        match slow.read(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => break other,
        }
    };
    let closed = match &read {
        Ok(n) => *n == 0,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    };
    assert!(
        closed,
        "still open after {:?}: the read gave {:?} ({:?})",
        start.elapsed(),
        read,
        String::from_utf8_lossy(&buf[..*read.as_ref().unwrap_or(&0)])
    );
    assert!(
        start.elapsed() >= HTTP_HEAD_TIMEOUT,
        "{:?}",
        start.elapsed()
    );
    assert!(http(port, scrape.as_bytes()).starts_with("HTTP/1.1 200"));
}

#[test]
fn restart_after_sigkill_serves_a_reconnecting_device() {
    let dir = TempDir::new().unwrap();
    let mut d = Schedd::start(dir.path(), &[]);
    let dev = Device::connect(&d.sock(), "vm");
    d.child.as_mut().unwrap().kill().unwrap();
    d.wait_exit();
    assert_eq!(dev.recv(), None, "the device sees the daemon go");
    assert!(d.sock().exists(), "SIGKILL leaves the socket file");
    drop(d);
    let d = Schedd::start(dir.path(), &[]);
    let dev = Device::connect(&d.sock(), "vm");
    dev.submit(1);
    dev.expect_grant(1);
}

#[test]
fn sigterm_removes_sockets_and_a_live_daemon_is_not_replaced() {
    let dir = TempDir::new().unwrap();
    let mut d = Schedd::start(dir.path(), &[]);
    // A second daemon on the same paths refuses to start and leaves the first alone.
    let o = Command::new(SCHEDD)
        .arg("--socket")
        .arg(d.sock())
        .arg("--control")
        .arg(d.control())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("in use"));
    let _dev = Device::connect(&d.sock(), "vm");
    terminate(d.pid()).unwrap();
    assert_eq!(d.wait_exit(), Some(0));
    assert!(!d.sock().exists() && !d.control().exists());
}

#[test]
fn bad_command_lines_exit_2() {
    let dir = TempDir::new().unwrap();
    let sock = dir.path().join("s").to_str().unwrap().to_owned();
    let ctl_path = dir.path().join("c").to_str().unwrap().to_owned();
    for args in [
        vec!["--bogus"],
        vec!["--socket", &sock],
        vec!["--control", &ctl_path],
        vec![
            "--socket",
            &sock,
            "--control",
            &ctl_path,
            "--metrics",
            "10.1.2.3:9000",
        ],
        vec![
            "--socket",
            &sock,
            "--control",
            &ctl_path,
            "--metrics",
            "nonsense",
        ],
        vec!["--socket", &sock, "--control", &ctl_path, "--capacity", "0"],
        vec![
            "--socket",
            &sock,
            "--control",
            &ctl_path,
            "--group-timeout-ms",
            "0",
        ],
        vec![
            "--socket",
            &sock,
            "--control",
            &ctl_path,
            "--group-timeout-ms",
            "600001",
        ],
        vec![
            "--socket",
            &sock,
            "--control",
            &ctl_path,
            "--switch-cost-us",
            "x",
        ],
        vec![
            "--socket",
            &sock,
            "--control",
            &ctl_path,
            "--switch-cost-us",
            "99999999",
        ],
        vec![
            "--socket",
            &sock,
            "--control",
            &ctl_path,
            "--policy",
            "/nonexistent.toml",
        ],
        vec![
            "--socket",
            &sock,
            "--control",
            &ctl_path,
            "--log-level",
            "loud",
        ],
        vec![
            "--socket",
            &sock,
            "--control",
            &ctl_path,
            "--control-group",
            "no-such-group-here",
        ],
        vec![
            "--socket",
            &sock,
            "--control",
            &ctl_path,
            "--state-dir",
            "rel",
        ],
        vec!["--socket"],
    ] {
        let o = Command::new(SCHEDD)
            .args(&args)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}");
    }
    for args in [
        vec![],
        vec!["--frobnicate", "list"],
        vec!["list", "extra"],
        vec!["show", "--watch", "-1"],
        vec!["show", "--count", "2"],
        vec!["create", "x"],
        vec!["--control", &ctl_path, "list"],
    ] {
        assert_eq!(ctl(&args).status.code(), Some(2), "{args:?}");
    }
}

/// A stand-in for vgpu-server: records its arguments, creates its socket file, runs until
/// SIGTERM.
const FAKE_SERVER: &str = r#"#!/bin/sh
echo "$@" > "$0.args"
while [ $# -gt 0 ]; do
  case "$1" in --socket) sock="$2"; shift;; esac
  shift
done
case "$sock" in *fail*) echo "boom: cannot start" >&2; exit 3;; esac
# The sleeper must not outlive us: it would hold the test's output pipe open.
sleeper=
trap '[ -n "$sleeper" ] && kill "$sleeper"; rm -f "$sock"; exit 0' TERM
touch "$sock"
sleep 60 >/dev/null 2>&1 </dev/null &
sleeper=$!
wait
"#;

#[test]
fn create_and_destroy_device_processes() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new().unwrap();
    let bin = write(dir.path(), "fake-server", FAKE_SERVER);
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut d = Schedd::start(dir.path(), &["--server-bin", bin.to_str().unwrap()]);
    let s1 = dir.path().join("vm1.sock");
    let o = d.ctl(&[
        "--json",
        "create",
        "vm1",
        "--socket",
        s1.to_str().unwrap(),
        "--",
        "--display",
        "640x480",
    ]);
    assert!(o.status.success(), "{o:?}");
    let child: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let pid = child["pid"].as_u64().unwrap();
    let args = std::fs::read_to_string(dir.path().join("fake-server.args")).unwrap();
    let want = format!(
        "--socket {} --scheduler {} --vm-name vm1 --display 640x480",
        s1.display(),
        d.sock().display()
    );
    assert_eq!(args.trim(), want);
    let list: Value = serde_json::from_str(&stdout(&d.ctl(&["--json", "list"]))).unwrap();
    assert_eq!(list["children"][0]["name"], "vm1");
    // Refused: the same name again, an existing socket path, a bad name, a failing start.
    let s2 = dir.path().join("vm2.sock");
    assert_eq!(
        d.ctl(&["create", "vm1", "--socket", s2.to_str().unwrap()])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(
        d.ctl(&["create", "vm2", "--socket", s1.to_str().unwrap()])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(
        d.ctl(&["create", "a:b", "--socket", s2.to_str().unwrap()])
            .status
            .code(),
        Some(1)
    );
    let bad = dir.path().join("fail.sock");
    let o = d.ctl(&["create", "vm3", "--socket", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("boom"), "{o:?}");
    assert_eq!(d.ctl(&["destroy", "nobody"]).status.code(), Some(1));
    let o = d.ctl(&["destroy", "vm1"]);
    assert!(o.status.success(), "{o:?}");
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "reaped");
    let list: Value = serde_json::from_str(&stdout(&d.ctl(&["--json", "list"]))).unwrap();
    assert_eq!(list["children"], json!([]));
    // Children still running at SIGTERM are stopped and reaped.
    let o = d.ctl(&["--json", "create", "vm2", "--socket", s2.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let pid: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let pid = pid["pid"].as_u64().unwrap();
    terminate(d.pid()).unwrap();
    assert_eq!(d.wait_exit(), Some(0));
    assert!(!Path::new(&format!("/proc/{pid}")).exists());
}

#[test]
fn create_takes_allowed_options_and_plain_socket_paths_only() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = TempDir::new().unwrap();
    let bin = write(dir.path(), "fake-server", FAKE_SERVER);
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let state = dir.path().join("run/state");
    let mut d = Schedd::start(
        dir.path(),
        &[
            "--server-bin",
            bin.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
        ],
    );
    let spawned = dir.path().join("fake-server.args");
    let sock = dir.path().join("vm.sock");
    let create = |name: &str, socket: &Path, args: &[&str]| {
        d.call(json!({"cmd": "create", "name": name, "socket": socket, "args": args}))
    };
    let refused = |answer: Value, why: &str| {
        let e = answer["error"].as_str().unwrap_or_default().to_owned();
        assert!(e.contains(why), "expected {why:?}, got {answer}");
    };
    for args in [
        &["--virgl-library", "/tmp/evil.so"][..],
        &["--dump-dir", "/etc"],
        &["--socket", "/tmp/other.sock"],
        &["--scheduler", "/tmp/s"],
        &["--frobnicate"],
        &["--display", "640x480", "--display", "800x600"],
    ] {
        refused(create("vm", &sock, args), "bad create");
    }
    let file = write(dir.path(), "file", "keep");
    let _live = std::os::unix::net::UnixListener::bind(dir.path().join("live.sock")).unwrap();
    for (socket, why) in [
        (file.clone(), "already exists"),
        (dir.path().join("live.sock"), "already exists"),
        (dir.path().join("nodir/vm.sock"), "does not exist"),
        (dir.path().join("run/../vm.sock"), ". or .."),
        (PathBuf::from("vm.sock"), "absolute"),
    ] {
        refused(create("vm", &socket, &[]), why);
    }
    assert!(!spawned.exists(), "nothing was started");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
    // vgpuctl refuses them before asking, with the daemon's check (exit 1, refused).
    let o = d.ctl(&[
        "create",
        "vm",
        "--socket",
        sock.to_str().unwrap(),
        "--",
        "--virgl-library",
        "x",
    ]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");

    // --dump: a directory the daemon makes for the VM, 0700 and its own.
    let answer = create("vm", &sock, &["--dump", "--log-level", "DEBUG"]);
    let dump = state.join("dump/vm");
    assert_eq!(answer["ok"]["dump_dir"], json!(dump), "{answer}");
    let args = std::fs::read_to_string(&spawned).unwrap();
    let want = format!(
        "--socket {} --scheduler {} --vm-name vm --log-level debug --dump-dir {}",
        sock.display(),
        d.sock().display(),
        dump.display()
    );
    assert_eq!(args.trim(), want);
    let me = std::fs::metadata("/proc/self").unwrap().uid();
    for p in [&state, &state.join("dump"), &dump] {
        assert_eq!(mode(p), 0o700, "{}", p.display());
        assert_eq!(std::fs::metadata(p).unwrap().uid(), me);
    }
    // A name that is no plain file name still gets one directory under dump/.
    let sock2 = dir.path().join("vm2.sock");
    let answer = create("../x/.", &sock2, &["--dump"]);
    assert_eq!(
        answer["ok"]["dump_dir"],
        json!(state.join("dump/%2E.%2Fx%2F.")),
        "{answer}"
    );
    // The children go with the daemon.
    terminate(d.pid()).unwrap();
    assert_eq!(d.wait_exit(), Some(0));
}

/// With `--device-uid-base` and `--device-gid`, every live created device process gets its own
/// user (the lowest free slot), the shared group reaches the device socket (0660), and a VM's
/// dump directory belongs to its current device user.
#[test]
fn created_device_processes_get_their_own_users() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: running device processes as other users needs root");
        return;
    }
    let dir = TempDir::new().unwrap();
    let bin = write(dir.path(), "fake-server", FAKE_SERVER);
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let state = dir.path().join("state");
    let d = Schedd::start(
        dir.path(),
        &[
            "--server-bin",
            bin.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
            "--device-uid-base",
            "70000",
            "--device-gid",
            "70100",
        ],
    );
    let sock = std::fs::symlink_metadata(d.sock()).unwrap();
    assert_eq!(sock.mode() & 0o777, 0o660);
    assert_eq!(sock.gid(), 70100);
    let spawned = dir.path().join("fake-server.args");
    let create = |name: &str, args: &[&str]| {
        let socket = dir.path().join(format!("{name}.sock"));
        let answer = d.call(json!({"cmd": "create", "name": name, "socket": socket, "args": args}));
        assert!(answer["ok"].is_object(), "{answer}");
        let args = std::fs::read_to_string(&spawned).unwrap();
        let (_, run_as) = args.split_once("--run-as ").expect("--run-as passed");
        run_as.trim().to_owned()
    };
    let destroy = |name: &str| {
        let answer = d.call(json!({"cmd": "destroy", "name": name}));
        assert!(answer.get("error").is_none(), "{answer}");
    };
    let owner = |p: &Path| {
        let m = std::fs::symlink_metadata(p).unwrap();
        (m.uid(), m.gid(), m.mode() & 0o777)
    };
    assert_eq!(create("a", &["--dump"]), "70000:70100");
    let dump = state.join("dump/a");
    assert_eq!(owner(&dump), (70000, 70100, 0o700));
    assert_eq!(create("b", &[]), "70001:70100");
    destroy("a");
    destroy("b");
    // The lowest free slot is taken again; "a" comes back as another user and its dump
    // directory is handed over.
    assert_eq!(create("x", &[]), "70000:70100");
    assert_eq!(create("a", &["--dump"]), "70001:70100");
    assert_eq!(owner(&dump), (70001, 70100, 0o700));
}

#[test]
fn device_ids_need_both_flags_and_no_root() {
    for extra in [
        &["--device-uid-base", "70000"][..],
        &["--device-gid", "70000"],
        &["--device-uid-base", "0", "--device-gid", "70000"],
        &["--device-uid-base", "70000", "--device-gid", "0"],
        &["--device-uid-base", "x", "--device-gid", "70000"],
    ] {
        let out = Command::new(SCHEDD)
            .args(["--socket", "/nonexistent/s", "--control", "/nonexistent/c"])
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--device-"));
    }
}

/// Greets as VM `name` announcing QEMU pid `qemu_pid`, with `proof` attached to the Hello.
fn hello_with(sock: &Path, name: &str, qemu_pid: u32, proof: Option<&UnixStream>) -> Device {
    let s = SeqStream::connect(sock).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut b = Vec::new();
    let hello = Msg::Hello {
        version: PROTOCOL_VERSION,
        vm_name: VmName::new(name).unwrap(),
        device_pid: std::process::id(),
        qemu_pid,
    };
    proto::encode(&hello, &mut b);
    match proof {
        Some(fd) => s.send_with_fd(&b, std::os::fd::AsFd::as_fd(fd)).unwrap(),
        None => s.send(&b).unwrap(),
    }
    let d = Device { s };
    match d.recv() {
        Some(Msg::Welcome { .. }) => d,
        other => panic!("no Welcome: {other:?}"),
    }
}

#[test]
fn hello_qemu_pid_is_used_only_when_proven_by_the_qemu_connection() {
    let dir = TempDir::new().unwrap();
    let d = Schedd::start(dir.path(), &[]);
    // The "QEMU connection": a socket pair whose peer is this process.
    let (ours, _theirs) = UnixStream::pair().unwrap();
    let me = std::process::id();
    let _proven = hello_with(&d.sock(), "proven", me, Some(&ours));
    // A lie: the descriptor's peer is not pid 1.
    let _lie = hello_with(&d.sock(), "lie", 1, Some(&ours));
    // No proof at all.
    let _bare = hello_with(&d.sock(), "bare", me, None);
    let list: Value = serde_json::from_str(&stdout(&d.ctl(&["--json", "list"]))).unwrap();
    let qemu = |n: &str| {
        let vms = list["vms"].as_array().unwrap();
        vms.iter().find(|v| v["name"] == n).unwrap()["qemu_pid"].clone()
    };
    assert_eq!(qemu("proven"), json!(me));
    assert_eq!(qemu("lie"), json!(0));
    assert_eq!(qemu("bare"), json!(0));
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `vgpuctl` and `vgpu-smi` against no daemon: what happened and what to do on stderr, exit 2;
/// with `--json` also `{"error": ..., "exit": 2}` on stdout.
#[test]
fn an_unreachable_daemon_is_explained_and_json_errors_are_json() {
    let dir = TempDir::new().unwrap();
    let control = dir.path().join("control.sock");
    let path = control.to_str().unwrap();
    let smi = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_vgpu-smi"))
            .args(["--control", path])
            .args(args)
            .output()
            .unwrap()
    };
    let missing = format!("no vgpu-schedd answers at {path} (No such file or directory): ");
    for (tool, o) in [
        ("vgpuctl", ctl(&["--control", path, "list"])),
        ("vgpu-smi", smi(&[])),
    ] {
        assert_eq!(o.status.code(), Some(2), "{o:?}");
        assert!(
            stderr(&o).starts_with(&format!("{tool}: {missing}is the daemon running?")),
            "{o:?}"
        );
        assert!(o.stdout.is_empty(), "{o:?}");
    }
    drop(std::os::unix::net::UnixListener::bind(&control).unwrap());
    for o in [
        ctl(&["--control", path, "--json", "show"]),
        smi(&["--json"]),
    ] {
        assert_eq!(o.status.code(), Some(2), "{o:?}");
        assert!(
            stderr(&o).contains("(connection refused): the socket is stale"),
            "{o:?}"
        );
        let line: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(line["exit"], 2, "{line}");
        assert!(
            line["error"]
                .as_str()
                .unwrap()
                .contains("connection refused")
        );
    }
}

/// `show VM` and `top VM` show that VM's row only; an unknown one is refused with the VMs
/// known (exit 1, as JSON with `--json`); `set` prints what changed as a line.
#[test]
fn show_and_top_take_a_vm_and_set_says_what_changed() {
    let dir = TempDir::new().unwrap();
    let d = Schedd::start(dir.path(), &[]);
    let _a = Device::connect(&d.sock(), "alpha");
    let _b = Device::connect(&d.sock(), "beta");
    wait_until("both listed", || {
        d.vm_stats("alpha").is_object() && d.vm_stats("beta").is_object()
    });
    let o = d.ctl(&["set", "alpha", "priority=3"]);
    assert!(o.status.success(), "{o:?}");
    assert!(stdout(&o).starts_with("alpha (live): "), "{o:?}");
    assert!(stdout(&o).contains("priority=3"), "{o:?}");
    for args in [vec!["show", "beta"], vec!["top", "beta", "--count", "1"]] {
        let o = d.ctl(&args);
        assert!(o.status.success(), "{o:?}");
        let out = stdout(&o);
        assert!(out.lines().any(|l| l.starts_with("beta ")), "{out}");
        assert!(!out.lines().any(|l| l.starts_with("alpha ")), "{out}");
    }
    let o = d.ctl(&["--json", "show", "alpha"]);
    let stats: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let names: Vec<&Value> = stats["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| &v["name"])
        .collect();
    assert_eq!(names, [&json!("alpha")]);
    let o = d.ctl(&["show", "gamma"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        stderr(&o).contains("unknown VM gamma (known: alpha, beta)"),
        "{o:?}"
    );
    let o = d.ctl(&["--json", "top", "gamma", "--count", "1"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let line: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        line,
        json!({"error": "unknown VM gamma (known: alpha, beta)", "exit": 1})
    );
    let o = d.ctl(&["--json", "focus", "gamma"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let line: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(line["exit"], 1, "{line}");
}

/// Every change request is logged at info with the caller's uid and pid; reading ones are not.
#[test]
fn change_requests_are_logged_with_the_callers_uid_and_pid() {
    let dir = TempDir::new().unwrap();
    let d = Schedd::start(dir.path(), &[]);
    let _dev = Device::connect(&d.sock(), "vm");
    wait_until("vm listed", || d.vm_stats("vm").is_object());
    let fair = write(dir.path(), "fair.toml", "policy = \"fair\"\n");
    let socket = dir.path().join("new.sock");
    let control = d.control();
    let requests: [(&[&str], &str); 6] = [
        (&["set", "vm", "priority=3"], "SetParams"),
        (&["set-policy", fair.to_str().unwrap()], "SetPolicy"),
        (&["focus", "vm"], "Focus"),
        (&["forget", "gone"], "Forget"),
        (
            &["create", "new", "--socket", socket.to_str().unwrap()],
            "Create",
        ),
        (&["destroy", "new"], "Destroy"),
    ];
    let uid = vgpu_schedd::seqpacket::effective_uid();
    for (args, request) in requests {
        let child = Command::new(VGPUCTL)
            .args(["--control", control.to_str().unwrap()])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        child.wait_with_output().unwrap();
        let want = format!("control: change requested by uid {uid} pid {pid}: {request}");
        wait_until(&want, || {
            let log = std::fs::read_to_string(&d.log).unwrap();
            log.lines()
                .any(|l| l.contains(" INFO ") && l.contains(&want))
        });
    }
    assert!(d.ctl(&["list"]).status.success());
    assert!(d.ctl(&["show"]).status.success());
    let log = std::fs::read_to_string(&d.log).unwrap();
    assert_eq!(log.matches("change requested").count(), 6, "{log}");
}

/// A second daemon whose HTTP port is taken fails to start and removes the sockets it bound;
/// the first daemon's, at other paths, stay and it still answers.
#[test]
fn a_failed_start_leaves_no_sockets_behind() {
    let dir = TempDir::new().unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let d = Schedd::start(dir.path(), &["--metrics", &addr]);
    let second = TempDir::new().unwrap();
    let o = Command::new(SCHEDD)
        .arg("--socket")
        .arg(second.path().join("sched.sock"))
        .arg("--control")
        .arg(second.path().join("control.sock"))
        .arg("--config-dir")
        .arg(second.path().join("etc"))
        .args(["--metrics", &addr])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(stderr(&o).contains("HTTP listener"), "{o:?}");
    let left: Vec<_> = std::fs::read_dir(second.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(d.sock().exists() && d.control().exists());
    assert!(d.ctl(&["list"]).status.success());
}
