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

use clap::Parser;
use vgpu_schedd::proto::{self, Exec, Msg, PROTOCOL_VERSION, VmName};
use vgpu_schedd::seqpacket::SeqStream;
use vgpu_scheduler::{CostSignature, GroupId, GroupKind};

/// How long one wait for the daemon's messages lasts before the loop looks again.
const POLL: Duration = Duration::from_millis(100);
/// Pause before a reconnect, so a daemon that drops it at once is not hammered.
const RECONNECT_PAUSE: Duration = Duration::from_millis(50);
/// The cost each group announces: 1 ms.
const COST_NS: u64 = 1_000_000;

/// The command line.
#[derive(Debug, Parser)]
// A repeated option takes its last value, as before clap.
#[command(
    name = "vgpu-fake-device",
    version,
    about = "A hostile device process for the malicious-guest suite: says Hello to a scheduler \
        daemon and keeps groups asking for a grant, never completing one",
    args_override_self = true
)]
struct Args {
    /// The daemon's device socket
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// The VM name to claim
    #[arg(
        long,
        value_name = "NAME",
        value_parser = vm_name,
        allow_hyphen_values = true
    )]
    name: VmName,
    /// Groups kept asking for a grant
    #[arg(long, value_name = "N", default_value_t = 0)]
    submit: u64,
    /// Come back each time the daemon drops the connection
    #[arg(long)]
    reconnect: bool,
}

fn vm_name(name: &str) -> Result<VmName, String> {
    VmName::new(name).map_err(|e| e.to_string())
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
    let args: Args = vgpu_cli::parse();
    let mut next_group = 1;
    loop {
        session(&args, &mut next_group);
        if !args.reconnect {
            return;
        }
        std::thread::sleep(RECONNECT_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &[&str]) -> Result<Args, clap::error::ErrorKind> {
        vgpu_cli::check::arguments(line).map_err(|e| e.kind())
    }

    #[test]
    fn keeps_the_command_line_conventions() {
        vgpu_cli::check::conventions::<Args>(env!("CARGO_PKG_VERSION")).unwrap();
    }

    #[test]
    fn the_command_line_is_checked() {
        // The form the hostile suite uses, and the = form.
        let a = parse(&[
            "--socket",
            "/s",
            "--name",
            "evil",
            "--submit",
            "3",
            "--reconnect",
        ])
        .unwrap();
        assert_eq!(
            (a.socket, a.name.as_str(), a.submit, a.reconnect),
            ("/s".into(), "evil", 3, true)
        );
        let a = parse(&["--socket=/s", "--name=x"]).unwrap();
        assert_eq!((a.submit, a.reconnect), (0, false));
        use clap::error::ErrorKind::*;
        assert_eq!(
            parse(&["--name", "x"]).unwrap_err(),
            MissingRequiredArgument
        );
        assert_eq!(
            parse(&["--socket", "/s"]).unwrap_err(),
            MissingRequiredArgument
        );
        assert_eq!(
            parse(&["--socket=/s", "--name=a:b"]).unwrap_err(),
            ValueValidation
        );
        assert_eq!(
            parse(&["--socket=/s", "--name=x", "--submit=many"]).unwrap_err(),
            ValueValidation
        );
        assert_eq!(
            parse(&["--socket=/s", "--name=x", "--frob"]).unwrap_err(),
            UnknownArgument
        );
    }
}
