//! The host-guest control channel without a guest: the real `vgpu-agent` talks over a Unix
//! socket (`--socket`) to the harness's [`ControlChannel`], running real bash jobs. The guest
//! tests (guest_e2e, experiments_vms) use the same two ends over QEMU's virtio-serial port.

use std::os::unix::net::UnixListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_tests::TempDir;
use vgpu_tests::control::{ChannelError, ControlChannel};
use vgpu_tests::daemon::workspace_binary;

/// Bound of every wait on the agent (it answers in milliseconds on an idle host).
const WAIT: Duration = Duration::from_secs(30);

/// The agent process; killed if a test fails before it exited.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl Agent {
    /// Waits (bounded) for the agent to exit; its exit code.
    fn exit_code(&mut self) -> Option<i32> {
        let until = Instant::now() + WAIT;
        while Instant::now() < until {
            if let Some(status) = self.0.try_wait().expect("waiting for the agent") {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

/// Starts an agent with `stop_grace_ms` connected to a fresh socket, and the host's end.
fn connect(dir: &TempDir, stop_grace_ms: u64) -> (Agent, ControlChannel) {
    let path = dir.path().join("control.sock");
    let listener = UnixListener::bind(&path).expect("binding the control socket");
    let agent = Command::new(workspace_binary("vgpu-agent").expect("the vgpu-agent binary"))
        .arg("--socket")
        .arg(&path)
        .arg("--stop-grace-ms")
        .arg(stop_grace_ms.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("starting vgpu-agent");
    let agent = Agent(agent);
    let (stream, _) = listener.accept().expect("the agent connects");
    let mut channel = ControlChannel::over(stream).expect("the channel");
    assert_eq!(channel.hello(WAIT).expect("HELLO"), 1);
    (agent, channel)
}

#[test]
fn a_job_runs_until_stopped_and_reports_its_summary() {
    let dir = TempDir::new("vgpu-control").unwrap();
    let (mut agent, mut ch) = connect(&dir, 30_000);
    // Like `vgpu-load --until-stopped`: runs until stdin ends, then prints its summary.
    ch.start(
        "load",
        "echo 'SUMMARY {\"phase\":\"running\"}'\necho not a summary\ncat >/dev/null\necho 'SUMMARY {\"phase\":\"stopped\"}'\n",
        WAIT,
    )
    .expect("the job starts");
    // It keeps running: no exit while it waits for its stdin's end.
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until {
        let report = ch.report("load").unwrap();
        assert_eq!(report.exit, None, "the job ran until told to stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    ch.stop("load").unwrap();
    let report = ch.wait_exit("load", WAIT).expect("the job ends");
    assert_eq!(report.exit, Some(0));
    assert_eq!(
        report.summaries,
        [r#"{"phase":"running"}"#, r#"{"phase":"stopped"}"#],
        "only SUMMARY lines, in order, the last printed after the stop"
    );
    ch.quit(WAIT).expect("BYE");
    assert_eq!(agent.exit_code(), Some(0));
    assert!(ch.bad_lines.is_empty(), "{:?}", ch.bad_lines);
}

#[test]
fn a_job_that_ignores_its_stop_is_terminated_and_exit_codes_are_reported() {
    let dir = TempDir::new("vgpu-control").unwrap();
    let (mut agent, mut ch) = connect(&dir, 200);
    ch.start("fails", "exit 3\n", WAIT).unwrap();
    assert_eq!(ch.wait_exit("fails", WAIT).unwrap().exit, Some(3));
    // Ignores its stdin; SIGTERM (after the 200 ms grace) ends it through its trap.
    ch.start(
        "stubborn",
        "trap 'echo SUMMARY terminated; exit 7' TERM\nwhile :; do sleep 0.05; done\n",
        WAIT,
    )
    .unwrap();
    ch.stop("stubborn").unwrap();
    let report = ch.wait_exit("stubborn", WAIT).unwrap();
    assert_eq!(report.exit, Some(7));
    assert_eq!(report.summaries, ["terminated"]);
    // Ignores SIGTERM too: SIGKILL 5 s later (exit code 128 + 9).
    ch.start("deaf", "trap '' TERM\nwhile :; do sleep 0.05; done\n", WAIT)
        .unwrap();
    ch.stop("deaf").unwrap();
    assert_eq!(ch.wait_exit("deaf", WAIT).unwrap().exit, Some(137));
    // QUIT stops what still runs and the agent exits.
    ch.start("left", "cat >/dev/null\n", WAIT).unwrap();
    ch.quit(WAIT).expect("BYE");
    assert_eq!(ch.report("left").unwrap().exit, Some(0));
    assert_eq!(agent.exit_code(), Some(0));
}

#[test]
fn bad_requests_are_refused_and_the_agent_keeps_serving() {
    let dir = TempDir::new("vgpu-control").unwrap();
    let (mut agent, mut ch) = connect(&dir, 200);
    ch.start("a", "cat >/dev/null\n", WAIT).unwrap();
    match ch.start("a", "true\n", WAIT) {
        Err(ChannelError::Refused { id, text }) => {
            assert_eq!(id, "a");
            assert!(text.contains("runs"), "{text}");
        }
        other => panic!("a second job named a: {other:?}"),
    }
    // Refused on the host's side before anything is sent.
    assert!(matches!(
        ch.start("../etc", "true\n", WAIT),
        Err(ChannelError::BadId(_))
    ));
    ch.stop("nosuch").unwrap();
    ch.start("b", "echo SUMMARY b\n", WAIT).unwrap();
    assert_eq!(ch.wait_exit("b", WAIT).unwrap().summaries, ["b"]);
    assert_eq!(
        ch.report("nosuch").and_then(|r| r.error).as_deref(),
        Some("no such job")
    );
    ch.stop("a").unwrap();
    assert_eq!(ch.wait_exit("a", WAIT).unwrap().exit, Some(0));
    ch.quit(WAIT).unwrap();
    assert_eq!(agent.exit_code(), Some(0));
}
