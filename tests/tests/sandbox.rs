//! The `vgpu-server` process sandbox seen from outside (docs/SECURITY.md, "Device process
//! sandbox"): its credentials, no_new_privs and seccomp state in `/proc/PID/status`, the
//! descriptors it keeps, and the `--run-as`/`--no-sandbox` options. The SIGSYS kill itself is
//! in `multi_guest` (`a_forbidden_syscall_kills_only_that_device_process`).

use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

use vgpu_tests::daemon::Schedd;
use vgpu_tests::guest::{ServerProcess, server_binary};
use vgpu_tests::server::VgpuGuest;
use vgpu_tests::skip_without_qemu;

/// Longest wait for the server's start-up log line or its exit.
const TIMEOUT: Duration = Duration::from_secs(10);
/// An unprivileged user and group that exist on every system (nobody/nogroup).
const NOBODY: u32 = 65534;
/// The start-up log line of the sandbox.
const SANDBOX_LINE: &str = "sandbox: seccomp filter";

/// Starts the server with `args`, waiting until it has entered its sandbox.
fn start(args: &[&str]) -> ServerProcess {
    let binary = server_binary().expect("vgpu-server binary");
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let server = ServerProcess::start(&binary, true, &args).expect("vgpu-server starts");
    assert!(
        server.wait_for_log(SANDBOX_LINE, TIMEOUT),
        "no sandbox line:\n{}",
        server.log()
    );
    server
}

/// The value of `field` in `/proc/PID/status`, whitespace-separated.
fn status(pid: u32, field: &str) -> Vec<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in\n{text}"));
    line.split_whitespace().map(str::to_string).collect()
}

/// Kills a device process the daemon created if the test fails before `destroy` (the daemon
/// itself is killed without stopping its children).
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(pid) = libc::pid_t::try_from(self.0)
            && std::thread::panicking()
        {
            // SAFETY: kill(2) takes no pointers; the pid is the daemon's child, not yet
            // reaped while the daemon lives (it is dropped after this guard).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn the_default_is_a_filter_and_no_new_privs() {
    let mut server = start(&[]);
    let pid = server.pid();
    assert_eq!(status(pid, "NoNewPrivs"), ["1"]);
    // 2: SECCOMP_MODE_FILTER, on every thread (the worker's included).
    assert_eq!(status(pid, "Seccomp"), ["2"]);
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks") {
        let tid = task.expect("task").file_name();
        let text = std::fs::read_to_string(format!("/proc/{pid}/task/{}/status", tid.display()))
            .expect("task status");
        assert!(text.contains("\nSeccomp:\t2\n"), "thread {tid:?}:\n{text}");
    }
    assert!(server.log().contains("seccomp filter installed"));
    server.kill().expect("killed");
}

#[test]
fn no_sandbox_installs_no_filter_and_warns() {
    let mut server = start(&["--no-sandbox"]);
    assert_eq!(status(server.pid(), "Seccomp"), ["0"]);
    assert_eq!(status(server.pid(), "NoNewPrivs"), ["1"]);
    assert!(server.log().contains("WARN"), "{}", server.log());
    assert!(server.log().contains("seccomp filter off"));
    server.kill().expect("killed");
}

#[test]
fn inherited_descriptors_are_closed() {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors; no O_CLOEXEC, so children inherit them.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: pipe(2) just returned these two descriptors, owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let ours = std::fs::read_link(format!("/proc/self/fd/{}", fds[1])).expect("pipe link");
    let mut server = start(&[]);
    let pid = server.pid();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fds") {
        let link = std::fs::read_link(fd.expect("fd").path()).unwrap_or_default();
        assert_ne!(link, ours, "the server kept the inherited pipe");
    }
    let log = server.log();
    let line = log
        .lines()
        .find(|l| l.contains(SANDBOX_LINE))
        .expect("sandbox line");
    let closed: usize = line
        .split(", ")
        .find_map(|part| part.strip_suffix(" inherited fds closed"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count of closed fds:\n{line}"));
    assert!(closed >= 2, "{closed} closed:\n{line}");
    server.kill().expect("killed");
    drop((read, write));
}

#[test]
fn run_as_root_or_junk_is_refused() {
    let binary = server_binary().expect("vgpu-server binary");
    for bad in ["0:0", "1000", "x:y"] {
        let out = std::process::Command::new(&binary)
            .args(["--socket", "/nonexistent/vgpu.sock", "--run-as", bad])
            .output()
            .expect("runs");
        assert_eq!(out.status.code(), Some(2), "--run-as {bad}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--run-as"));
    }
}

#[test]
fn run_as_drops_root_for_good_and_keeps_serving() {
    if !is_root() {
        eprintln!("SKIPPED: dropping to another user needs root");
        return;
    }
    if skip_without_qemu() {
        return;
    }
    let id = NOBODY.to_string();
    let mut server = start(&["--run-as", &format!("{NOBODY}:{NOBODY}")]);
    let pid = server.pid();
    // Real, effective, saved and file-system ids: none is left at 0 to return to.
    assert_eq!(status(pid, "Uid"), [id.as_str(); 4]);
    assert_eq!(status(pid, "Gid"), [id.as_str(); 4]);
    assert!(status(pid, "Groups").is_empty());
    assert!(server.log().contains(&format!("uid {NOBODY} gid {NOBODY}")));
    // The socket was bound before the drop: a guest still gets a working device.
    let mut guest = VgpuGuest::attach(server.socket(), true);
    guest.bring_up();
    let info = guest.display_info(None);
    assert!(info.pmodes[0].enabled != 0, "{info:?}");
    drop(guest);
    let exit = server.wait_exit(TIMEOUT).expect("server state");
    assert!(
        exit.is_some_and(|s| s.success()),
        "{exit:?} after its client:\n{}",
        server.log()
    );
}

#[test]
fn run_as_another_user_without_root_is_an_error() {
    if is_root() {
        eprintln!("SKIPPED: needs a user other than root");
        return;
    }
    let binary = server_binary().expect("vgpu-server binary");
    let dir = vgpu_tests::TempDir::new("vgpu-sandbox").expect("temp dir");
    let out = std::process::Command::new(&binary)
        .arg("--socket")
        .arg(dir.path().join("vgpu.sock"))
        .args(["--renderer", "none", "--run-as", "65534:65534"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs root"));
}

/// A device process the daemon creates with `--device-uid-base`/`--device-gid` runs as its
/// own user, serves its guest and still reaches the daemon (QEMU's connection found among its
/// own descriptors, Hello accepted).
#[test]
fn created_device_runs_as_its_own_user_and_reaches_the_daemon() {
    use std::os::unix::fs::PermissionsExt;

    if !is_root() {
        eprintln!("SKIPPED: running device processes as other users needs root");
        return;
    }
    if skip_without_qemu() {
        return;
    }
    let daemon = Schedd::start_with(
        None,
        "debug",
        &["--device-uid-base", "70000", "--device-gid", "70100"],
    )
    .expect("daemon");
    // The device user must be able to reach the daemon's socket by its path.
    let sched_dir = daemon.socket().parent().expect("socket dir").to_owned();
    std::fs::set_permissions(&sched_dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    let dir = vgpu_tests::TempDir::new("vgpu-sandbox").expect("temp dir");
    let socket = dir.path().join("vm1.sock");
    let child = daemon
        .ctl(&["create", "vm1", "--socket", socket.to_str().unwrap()])
        .expect("create");
    let pid = u32::try_from(child["pid"].as_u64().expect("pid")).unwrap();
    let _reaper = KillOnDrop(pid);
    // Its socket is there before it enters the sandbox.
    let start = std::time::Instant::now();
    while status(pid, "Seccomp") != ["2"] {
        assert!(start.elapsed() < TIMEOUT, "no sandbox:\n{}", daemon.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(status(pid, "Uid"), ["70000"; 4]);
    assert_eq!(status(pid, "Gid"), ["70100"; 4]);
    let mut guest = VgpuGuest::attach(&socket, true);
    guest.bring_up();
    let start = std::time::Instant::now();
    while daemon.vm_info("vm1").unwrap()["connected"] != true {
        assert!(
            start.elapsed() < TIMEOUT,
            "vm1 never connected to the daemon:\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(guest);
    daemon.ctl(&["destroy", "vm1"]).expect("destroy");
}

/// A SIGUSR1 dump request (signal delivery, the signal-hook pipe, the worker reading it) is
/// inside the filter.
#[test]
fn a_dump_request_survives_the_filter() {
    let dir = vgpu_tests::TempDir::new("vgpu-sandbox").expect("temp dir");
    let dump = dir.path().join("dump");
    let mut server = start(&["--dump-dir", dump.to_str().unwrap()]);
    let pid = libc::pid_t::try_from(server.pid()).unwrap();
    for _ in 0..3 {
        // SAFETY: kill(2) takes no pointers; `pid` is our live child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGUSR1) }, 0);
    }
    server.assert_survived("SIGUSR1");
    server.kill().expect("killed");
}
