//! A hostile device process for the malicious-guest suite: connects to a scheduler daemon's
//! device socket, says `Hello` under a VM name of its choosing (its own pid, QEMU unknown)
//! and then, with `--submit N`, keeps `N` device-executed groups asking for a grant and never
//! completes one. With `--reconnect` it comes back each time the daemon drops it.
//!
//! Usage: `vgpu-fake-device --socket PATH --name NAME [--submit N] [--reconnect]`
//!
//! It prints one line per event on stdout (`welcome`, `refused`, `grant`, `closed`), so a test
//! can see what the daemon did to it, and runs until it is killed (or, without `--reconnect`,
//! until the daemon closes its connection).

use std::path::PathBuf;
use std::time::Duration;

use vgpu_schedd::proto::{self, Exec, Msg, PROTOCOL_VERSION, VmName};
use vgpu_schedd::seqpacket::SeqStream;
use vgpu_scheduler::{CostSignature, GroupId, GroupKind};

/// How long one wait for the daemon's messages lasts before the loop looks again.
const POLL: Duration = Duration::from_millis(100);
/// Pause before a reconnect, so a daemon that drops it at once is not hammered.
const RECONNECT_PAUSE: Duration = Duration::from_millis(50);
/// The cost each group announces: 1 ms.
const COST_NS: u64 = 1_000_000;

struct Args {
    socket: PathBuf,
    name: VmName,
    submit: u64,
    reconnect: bool,
}

fn parse() -> Result<Args, String> {
    let mut socket = None;
    let mut name = None;
    let mut submit = 0;
    let mut reconnect = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--socket" => socket = Some(PathBuf::from(value()?)),
            "--name" => {
                let v = value()?;
                name = Some(VmName::new(&v).map_err(|e| format!("--name {v}: {e}"))?);
            }
            "--submit" => {
                let v = value()?;
                submit = v.parse().map_err(|e| format!("--submit {v}: {e}"))?;
            }
            "--reconnect" => reconnect = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(Args {
        socket: socket.ok_or("--socket is required")?,
        name: name.ok_or("--name is required")?,
        submit,
        reconnect,
    })
}

fn send(stream: &SeqStream, msg: &Msg) -> bool {
    let mut packet = Vec::new();
    proto::encode(msg, &mut packet);
    stream.send(&packet).is_ok()
}

fn submit(stream: &SeqStream, group: u64) -> bool {
    send(
        stream,
        &Msg::Submit {
            group: GroupId(group),
            context: 1,
            kind: GroupKind::Render,
            signature: CostSignature(0),
            cost_ns: COST_NS,
            exec: Exec::Device,
        },
    )
}

/// One session: Hello, then groups that never complete, until the daemon closes it.
fn session(args: &Args, next_group: &mut u64) {
    let Ok(stream) = SeqStream::connect(&args.socket) else {
        println!("closed");
        return;
    };
    let _ = stream.set_read_timeout(Some(POLL));
    let hello = Msg::Hello {
        version: PROTOCOL_VERSION,
        vm_name: args.name.clone(),
        device_pid: std::process::id(),
        qemu_pid: 0,
    };
    if !send(&stream, &hello) {
        println!("closed");
        return;
    }
    let mut buf = vec![0; proto::MAX_MESSAGE_BYTES + 1];
    let mut asked = 0;
    loop {
        while asked < args.submit {
            if !submit(&stream, *next_group) {
                println!("closed");
                return;
            }
            *next_group = next_group.wrapping_add(1);
            asked += 1;
        }
        let n = match stream.recv(&mut buf) {
            Ok(None) => continue,
            Ok(Some(0)) | Err(_) => {
                println!("closed");
                return;
            }
            Ok(Some(n)) => n,
        };
        match proto::decode(&buf[..n]) {
            Ok(Msg::Welcome { .. }) => println!("welcome"),
            Ok(Msg::Refused { .. }) => println!("refused"),
            // A granted group stays on the GPU for ever, as far as this device says; the next
            // one asks in its place.
            Ok(Msg::Grant { .. }) => {
                println!("grant");
                asked = asked.saturating_sub(1);
            }
            _ => {}
        }
    }
}

fn main() {
    let args = match parse() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("vgpu-fake-device: {e}");
            std::process::exit(2);
        }
    };
    let mut next_group = 1;
    loop {
        session(&args, &mut next_group);
        if !args.reconnect {
            return;
        }
        std::thread::sleep(RECONNECT_PAUSE);
    }
}
