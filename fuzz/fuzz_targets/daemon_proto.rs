//! The daemon's device protocol with several connections at once: fuzzed raw packets and
//! well-formed messages with fuzzed fields (names and pids that collide, groups that are never
//! completed, completions of groups never granted), connections opening and closing, time
//! passing. Invariants: nothing panics; once every fuzzed connection is closed (by the fuzzer
//! or by the daemon), the GPU-online list has drained: a new well-behaved device is welcomed
//! and its first group is granted at once, whatever the others left behind.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_fuzz::Input;
use vgpu_schedd::daemon::{ConnId, Daemon, DaemonConfig, Peer};
use vgpu_schedd::proto::{self, Exec, Msg, PROTOCOL_VERSION, VmName};
use vgpu_scheduler::model::{CostSignature, GroupId, GroupKind, Time};

/// Connections the fuzzer holds open at once.
const MAX_CONNS: usize = 4;

fn send(daemon: &mut Daemon, now: Time, conn: ConnId, msg: &Msg) {
    let mut packet = Vec::new();
    proto::encode(msg, &mut packet);
    daemon.receive(now, conn, &packet);
}

/// Carries out the outbox as the I/O layer does: dropped connections are disconnected.
fn settle(daemon: &mut Daemon, now: Time, conns: &mut Vec<ConnId>) -> Vec<(ConnId, Msg)> {
    let mut sent = Vec::new();
    loop {
        let out = daemon.drain();
        sent.extend(out.messages);
        if out.drops.is_empty() {
            return sent;
        }
        for conn in out.drops {
            conns.retain(|&c| c != conn);
            daemon.disconnect(now, conn);
        }
    }
}

fn kind(raw: u8) -> GroupKind {
    match raw % 5 {
        0 => GroupKind::Render,
        1 => GroupKind::Transfer,
        2 => GroupKind::Compute,
        3 => GroupKind::Load,
        _ => GroupKind::Present,
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let config = DaemonConfig {
        capacity: 1 + usize::from(input.u8() % 2),
        ..DaemonConfig::default()
    };
    let mut now: Time = 1;
    let mut daemon = Daemon::new(now, config).expect("valid config");
    let mut conns: Vec<ConnId> = Vec::new();
    while !input.is_empty() {
        let op = input.u8();
        let pick = usize::from(input.u8());
        let target = (!conns.is_empty()).then(|| conns[pick % conns.len()]);
        match (op % 9, target) {
            (0, _) if conns.len() < MAX_CONNS => {
                let peer = Peer {
                    pid: u32::from(input.u8() % 4),
                    uid: 0,
                };
                conns.push(daemon.connect(now, peer));
            }
            (1, Some(conn)) => {
                conns.retain(|&c| c != conn);
                daemon.disconnect(now, conn);
            }
            (2, Some(conn)) => daemon.receive(now, conn, input.chunk()),
            (3, Some(conn)) => {
                let hello = Msg::Hello {
                    version: PROTOCOL_VERSION,
                    vm_name: VmName::new(&format!("vm{}", input.u8() % 4)).expect("valid"),
                    device_pid: 1 + u32::from(input.u8() % 4),
                    qemu_pid: u32::from(input.u8() % 4),
                };
                send(&mut daemon, now, conn, &hello);
            }
            (4, Some(conn)) => {
                let submit = Msg::Submit {
                    group: GroupId(u64::from(input.u8())),
                    context: u32::from(input.u8() % 4),
                    kind: kind(input.u8()),
                    signature: CostSignature(u64::from(input.u8())),
                    cost_ns: u64::from(input.u16()) * 1000,
                    exec: if input.u8() & 1 == 0 {
                        Exec::Device
                    } else {
                        Exec::Simulated
                    },
                };
                send(&mut daemon, now, conn, &submit);
            }
            (5, Some(conn)) => {
                let start = now.saturating_sub(u64::from(input.u16()) * 1000);
                let finish = start.saturating_add(u64::from(input.u16()) * 1000);
                let completed = Msg::Completed {
                    group: GroupId(u64::from(input.u8())),
                    start,
                    finish,
                };
                send(&mut daemon, now, conn, &completed);
            }
            (6, Some(conn)) => {
                let group = GroupId(u64::from(input.u8()));
                let msg = match input.u8() % 5 {
                    0 => Msg::Cancel { group },
                    1 => Msg::Frame,
                    2 => Msg::Bye,
                    3 => {
                        let limit = u64::from(input.u16()) << 20;
                        Msg::Memory {
                            used: limit.saturating_sub(u64::from(input.u16())),
                            limit,
                        }
                    }
                    _ => Msg::Dispatched {
                        group,
                        context: 0,
                        kind: kind(input.u8()),
                        signature: CostSignature(0),
                    },
                };
                send(&mut daemon, now, conn, &msg);
            }
            _ => {
                now = now.saturating_add(u64::from(input.u32()));
                daemon.timer(now);
            }
        }
        settle(&mut daemon, now, &mut conns);
    }
    for conn in std::mem::take(&mut conns) {
        daemon.disconnect(now, conn);
    }
    settle(&mut daemon, now, &mut conns);

    // A new device after everyone left: welcomed, and its group granted at once.
    let fresh = daemon.connect(now, Peer { pid: 0, uid: 0 });
    let hello = Msg::Hello {
        version: PROTOCOL_VERSION,
        vm_name: VmName::new("fresh").expect("valid"),
        device_pid: 77,
        qemu_pid: 0,
    };
    send(&mut daemon, now, fresh, &hello);
    let submit = Msg::Submit {
        group: GroupId(1),
        context: 0,
        kind: GroupKind::Render,
        signature: CostSignature(1),
        cost_ns: 1000,
        exec: Exec::Device,
    };
    send(&mut daemon, now, fresh, &submit);
    let sent = settle(&mut daemon, now, &mut conns);
    assert!(
        sent.iter()
            .any(|(c, m)| *c == fresh && *m == Msg::Grant { group: GroupId(1) }),
        "a new device is not granted after every other connection closed: {sent:?}"
    );
});
