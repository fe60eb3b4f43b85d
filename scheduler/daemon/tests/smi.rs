//! `vgpu-smi` end to end with the real `vgpu-schedd`: a fake device (this process, over
//! SOCK_SEQPACKET) greets the daemon and reports its memory budget's use; `vgpu-smi` shows its
//! row (pid, uptime, memory used/limit), its `-q` block, its JSON; an unknown VM exits 1 and a
//! daemon that is not there 2. The transcript goes to stderr (`-- --nocapture` shows it).

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;
use vgpu_schedd::proto::{self, MAX_MESSAGE_BYTES, Msg, PROTOCOL_VERSION, VmName};
use vgpu_schedd::seqpacket::SeqStream;

const SCHEDD: &str = env!("CARGO_BIN_EXE_vgpu-schedd");
const SMI: &str = env!("CARGO_BIN_EXE_vgpu-smi");
/// How long the daemon may take to start or to take a message in.
const WAIT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(20);
/// What the fake device reports: 256 MiB of its 1 GiB budget in use.
const USED: u64 = 256 << 20;
const LIMIT: u64 = 1 << 30;

/// The daemon, killed by pid and reaped on drop.
struct Schedd(Child);

impl Drop for Schedd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn send(s: &SeqStream, m: &Msg) {
    let mut b = Vec::new();
    proto::encode(m, &mut b);
    s.send(&b).unwrap();
}

fn smi(control: &Path, args: &[&str]) -> Output {
    let out = Command::new(SMI)
        .arg("--control")
        .arg(control)
        .args(args)
        .output()
        .unwrap();
    eprintln!(
        "$ vgpu-smi {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn vgpu_smi_shows_a_connected_vm_with_its_memory() {
    let dir = TempDir::new().unwrap();
    let control = dir.path().join("control.sock");
    let _daemon = Schedd(
        Command::new(SCHEDD)
            .arg("--socket")
            .arg(dir.path().join("sched.sock"))
            .arg("--control")
            .arg(&control)
            .arg("--config-dir")
            .arg(dir.path().join("etc"))
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = Instant::now();
    while UnixStream::connect(&control).is_err() {
        assert!(start.elapsed() < WAIT, "the daemon did not start");
        std::thread::sleep(POLL);
    }

    let device = SeqStream::connect(&dir.path().join("sched.sock")).unwrap();
    device.set_read_timeout(Some(WAIT)).unwrap();
    send(
        &device,
        &Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new("vm1").unwrap(),
            device_pid: std::process::id(),
            qemu_pid: 0,
        },
    );
    let mut buf = vec![0u8; MAX_MESSAGE_BYTES + 1];
    let n = device.recv(&mut buf).unwrap().expect("an answer");
    assert!(matches!(proto::decode(&buf[..n]), Ok(Msg::Welcome { .. })));
    send(
        &device,
        &Msg::Memory {
            used: USED,
            limit: LIMIT,
        },
    );

    // The report is taken in: the JSON carries it, with the pids and the uptime.
    let start = Instant::now();
    let vm = loop {
        let out = smi(&control, &["--json", "vm1"]);
        assert_eq!(out.status.code(), Some(0));
        let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
        let vm = answer["vms"][0].clone();
        if vm["memory_used_bytes"] == USED {
            break vm;
        }
        assert!(start.elapsed() < WAIT, "no memory report in {answer}");
        std::thread::sleep(POLL);
    };
    assert_eq!(vm["name"], "vm1");
    assert_eq!(vm["state"], "connected");
    assert_eq!(vm["memory_limit_bytes"], LIMIT);
    assert_eq!(vm["device_pid"], std::process::id());
    assert!(vm["uptime_ns"].as_u64().is_some(), "{vm}");

    let out = smi(&control, &[]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    let row = text
        .lines()
        .find(|l| l.starts_with("vm1 "))
        .unwrap_or_else(|| panic!("no row for vm1 in\n{text}"));
    assert!(row.contains("connected"), "{row}");
    assert!(row.contains(&std::process::id().to_string()), "{row}");
    assert!(row.contains("256/1024 MiB"), "{row}");

    let out = smi(&control, &["-q"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    for line in ["Used", "Limit", "Free"] {
        assert!(
            text.lines().any(|l| l.trim_start().starts_with(line)),
            "{text}"
        );
    }
    assert!(text.contains(": 768 MiB"), "{text}");

    // An unknown VM is refused (1); no daemon at the socket is 2, as vgpuctl's.
    let out = smi(&control, &["nosuchvm"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nosuchvm"));
    let out = smi(&dir.path().join("none.sock"), &[]);
    assert_eq!(out.status.code(), Some(2));
    drop(device);
}
