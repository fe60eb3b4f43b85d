//! The daemon core driven by fake devices that exchange encoded packets with it, over
//! simulated time.

mod common;

use vgpu_schedd::daemon::{
    ConnId, DEFAULT_GROUP_TIMEOUT_NS, DISPATCH_GRACE_NS, Daemon, DaemonConfig, MAX_CONNECTIONS,
    MAX_SIMULATED_COST_NS, Outbox, Peer, SUBMIT_RECENT_NS, Stats,
};
use vgpu_schedd::metrics::{
    Context, LATENCY_BOUNDS_NS, ProcessStats, VmPlace, family_names, figure_is_known,
    render_metrics,
};
use vgpu_schedd::proto::{
    self, Exec, HEADER_BYTES, MAX_GROUPS_PER_DEVICE, MAX_MESSAGE_BYTES, Msg, PROTOCOL_VERSION,
    RefuseCode, VmName,
};
use vgpu_scheduler::model::{Enforcement, NS_PER_MS, NS_PER_SEC, PrioPolicy, Reserve};
use vgpu_scheduler::policy::fair::FairConfig;
use vgpu_scheduler::policy::pegasus::PegasusConfig;
use vgpu_scheduler::policy::timegraph::TimeGraphConfig;
use vgpu_scheduler::policy::vgris::VgrisConfig;
use vgpu_scheduler::sim::ParamsOverride;
use vgpu_scheduler::{CostSignature, GroupId, GroupKind, PolicyConfig, Time, VgpuId};

const PID: u32 = 1000;

fn daemon(policy: PolicyConfig) -> Daemon {
    let config = DaemonConfig {
        policy,
        ..DaemonConfig::default()
    };
    Daemon::new(0, config).unwrap()
}

fn bytes(msg: &Msg) -> Vec<u8> {
    let mut b = Vec::new();
    proto::encode(msg, &mut b);
    b
}

fn send(d: &mut Daemon, now: Time, conn: ConnId, msg: &Msg) -> Outbox {
    d.receive(now, conn, &bytes(msg));
    d.drain()
}

fn hello(name: &str, pid: u32) -> Msg {
    Msg::Hello {
        version: PROTOCOL_VERSION,
        vm_name: VmName::new(name).unwrap(),
        device_pid: pid,
        qemu_pid: pid + 1,
    }
}

/// Connects a device for `name` and returns its connection and vGPU.
fn attach(d: &mut Daemon, now: Time, name: &str, pid: u32) -> (ConnId, VgpuId) {
    let c = d.connect(now, Peer { pid, uid: 0 });
    // The device proves QEMU's pid with QEMU's connection, whose peer it is.
    d.receive_proven(now, c, &bytes(&hello(name, pid)), Some(pid + 1));
    let out = d.drain();
    match out.messages.first() {
        Some((to, Msg::Welcome { version, vgpu })) if *to == c => {
            assert_eq!(*version, PROTOCOL_VERSION);
            (c, *vgpu)
        }
        other => panic!("no Welcome: {other:?}"),
    }
}

fn submit(id: u64, exec: Exec, cost_ns: u64) -> Msg {
    Msg::Submit {
        group: GroupId(id),
        context: 0,
        kind: GroupKind::Load,
        signature: CostSignature(id % 4),
        cost_ns,
        exec,
    }
}

fn device(id: u64) -> Msg {
    submit(id, Exec::Device, 0)
}

fn completed(id: u64, start: Time, finish: Time) -> Msg {
    Msg::Completed {
        group: GroupId(id),
        start,
        finish,
    }
}

fn grants(out: &Outbox, conn: ConnId) -> Vec<u64> {
    let it = out.messages.iter().filter(|(c, _)| *c == conn);
    it.filter_map(|(_, m)| match m {
        Msg::Grant { group } => Some(group.0),
        _ => None,
    })
    .collect()
}

fn refused(out: &Outbox, conn: ConnId) -> Option<RefuseCode> {
    out.messages.iter().find_map(|(c, m)| match m {
        Msg::Refused { code, .. } if *c == conn => Some(*code),
        _ => None,
    })
}

/// Runs the daemon's timers up to `end`, answering `Done`s with `respond`.
fn run_until(
    d: &mut Daemon,
    end: Time,
    mut respond: impl FnMut(&mut Daemon, Time, ConnId, &Msg),
) -> Vec<(Time, ConnId, Msg)> {
    let mut seen = Vec::new();
    while let Some(t) = d.next_deadline().filter(|&t| t <= end) {
        d.timer(t);
        let out = d.drain();
        for (c, m) in out.messages {
            respond(d, t, c, &m);
            seen.push((t, c, m));
        }
    }
    seen
}

#[test]
fn timegraph_prt_grants_by_priority() {
    let tg = TimeGraphConfig {
        sched: PrioPolicy::Prt,
        ..TimeGraphConfig::default()
    };
    let mut d = daemon(PolicyConfig::TimeGraph(tg));
    for (name, priority) in [("lo", 1), ("hi", 10)] {
        let change = ParamsOverride {
            priority: Some(priority),
            ..ParamsOverride::default()
        };
        d.set_params(0, name, &change).unwrap();
    }
    let (lo, _) = attach(&mut d, 0, "lo", PID);
    let (hi, _) = attach(&mut d, 0, "hi", PID + 10);
    // lo's first group finds the GPU idle.
    assert_eq!(grants(&send(&mut d, 10, lo, &device(1)), lo), [1]);
    // While it runs, lo and then hi queue more.
    assert!(send(&mut d, 20, lo, &device(2)).messages.is_empty());
    assert!(send(&mut d, 30, hi, &device(7)).messages.is_empty());
    // PRT: on completion the highest priority waiter goes next, then lo.
    let out = send(&mut d, 100, lo, &completed(1, 10, 100));
    assert_eq!((grants(&out, hi), grants(&out, lo)), (vec![7], vec![]));
    let out = send(&mut d, 200, hi, &completed(7, 100, 200));
    assert_eq!(grants(&out, lo), [2]);
    let stats = d.stats(300);
    let hi_stats = stats.vms.iter().find(|v| v.name == "hi").unwrap();
    assert_eq!((hi_stats.completed, hi_stats.submitted), (1, 1));
    assert_eq!(stats.policy, "timegraph");
}

/// Two devices keep `depth` simulated groups of `cost` each outstanding for `secs` seconds;
/// returns their GPU shares.
fn simulated_shares(mut d: Daemon, depth: u64, cost: u64, secs: u64) -> (f64, f64) {
    let (a, _) = attach(&mut d, 0, "a", PID);
    let (b, _) = attach(&mut d, 0, "b", PID + 10);
    let mut next = [0u64; 2];
    for (i, c) in [a, b].into_iter().enumerate() {
        for _ in 0..depth {
            next[i] += 1;
            let out = send(&mut d, 0, c, &submit(next[i], Exec::Simulated, cost));
            assert_eq!(refused(&out, c), None);
        }
    }
    let end = secs * NS_PER_SEC;
    let mut done = [0u64; 2];
    run_until(&mut d, end, |d, t, c, m| {
        if let Msg::Done { .. } = m {
            let i = usize::from(c != a);
            done[i] += 1;
            next[i] += 1;
            let out = send(d, t, c, &submit(next[i], Exec::Simulated, cost));
            assert_eq!(refused(&out, c), None, "{out:?}");
        }
    });
    let total = (done[0] + done[1]) as f64;
    assert!(total * cost as f64 > 0.95 * end as f64, "GPU kept busy");
    let s = d.stats(end);
    assert!(s.engine_busy > 0.95);
    let share = |n: &str| s.vms.iter().find(|v| v.name == n).unwrap().gpu_share;
    (share("a"), share("b"))
}

#[test]
fn pegasus_shares_the_simulated_engine_equally() {
    let d = daemon(PolicyConfig::Pegasus(PegasusConfig::default()));
    let (a, b) = simulated_shares(d, 4, NS_PER_MS, 3);
    assert!((a - 0.5).abs() < 0.05 && (b - 0.5).abs() < 0.05, "{a} {b}");
}

#[test]
fn fair_queuing_shares_follow_weights_and_runs_under_leases() {
    let mut d = daemon(PolicyConfig::Fair(FairConfig::default()));
    let heavy = ParamsOverride {
        weight: Some(512),
        ..ParamsOverride::default()
    };
    d.set_params(0, "a", &heavy).unwrap();
    let (a, b) = simulated_shares(d, 4, NS_PER_MS, 3);
    assert!(
        (a - 2.0 / 3.0).abs() < 0.05 && (b - 1.0 / 3.0).abs() < 0.05,
        "{a} {b}"
    );
}

#[test]
fn fair_leases_let_devices_dispatch_without_asking() {
    let mut d = daemon(PolicyConfig::Fair(FairConfig::default()));
    let c = d.connect(0, Peer { pid: PID, uid: 0 });
    let out = send(&mut d, 0, c, &hello("vm", PID));
    assert!(matches!(out.messages[0].1, Msg::Welcome { .. }));
    assert_eq!(
        out.messages[1..],
        [(
            c,
            Msg::Lease {
                budget_ns: 0,
                until: 0
            }
        )]
    );
    // Under the lease the device dispatches itself and reports it; no grant comes back.
    let dispatched = Msg::Dispatched {
        group: GroupId(1),
        context: 0,
        kind: GroupKind::Render,
        signature: CostSignature(1),
    };
    assert_eq!(send(&mut d, 10, c, &dispatched), Outbox::default());
    let out = send(&mut d, 50, c, &completed(1, 10, 50));
    assert_eq!(refused(&out, c), None);
    // A Submit under a lease is granted at once.
    assert_eq!(grants(&send(&mut d, 60, c, &device(2)), c), [2]);
    let s = d.stats(100);
    assert_eq!(
        (s.vms[0].completed, s.vms[0].dispatched, s.vms[0].in_flight),
        (1, 2, 1)
    );
}

#[test]
fn a_lone_ht_vm_streams_under_a_lease_and_the_daemon_stops_hurrying() {
    let mut d = daemon(PolicyConfig::TimeGraph(TimeGraphConfig::default()));
    let (a, _) = attach(&mut d, 0, "a", PID);
    // A vGPU that asks for its grants: the loop spins for its packets.
    assert!(d.answers_awaited(0));
    let out = send(&mut d, 10, a, &device(1));
    assert_eq!(grants(&out, a), [1]);
    assert!(out.messages.contains(&(
        a,
        Msg::Lease {
            budget_ns: 0,
            until: 0
        }
    )));
    // It just asked: it may ask again soon.
    assert!(d.answers_awaited(10 + SUBMIT_RECENT_NS - 1));
    // Under the lease it dispatches itself; once nobody asked for a while, nothing needs a
    // prompt answer.
    assert_eq!(
        refused(&send(&mut d, 20, a, &completed(1, 10, 20)), a),
        None
    );
    let later = 10 + SUBMIT_RECENT_NS;
    assert_eq!(
        send(&mut d, later, a, &dispatched_msg(2)),
        Outbox::default()
    );
    assert!(!d.answers_awaited(later));
    // A second VM at the same priority asks: the lease ends and the loop hurries again.
    let (b, _) = attach(&mut d, later, "b", PID + 10);
    assert!(d.answers_awaited(later));
    let out = send(&mut d, later + 1, b, &device(1));
    assert_eq!(out.messages, [(a, Msg::Revoke)]);
    let out = send(&mut d, later + 2, a, &completed(2, later, later + 2));
    assert_eq!(grants(&out, b), [1]);
    // Simulated groups keep the loop hurrying while the engine runs them.
    let mut f = daemon(PolicyConfig::Fair(FairConfig::default()));
    let (c, _) = attach(&mut f, 0, "c", PID + 20);
    assert!(!f.answers_awaited(SUBMIT_RECENT_NS));
    send(
        &mut f,
        SUBMIT_RECENT_NS,
        c,
        &submit(1, Exec::Simulated, 50 * NS_PER_MS),
    );
    assert!(f.answers_awaited(3 * SUBMIT_RECENT_NS));
    run_until(&mut f, 100 * NS_PER_MS, |_, _, _, _| {});
    assert!(!f.answers_awaited(100 * NS_PER_MS));
}

#[test]
fn vgris_paces_presents_to_the_target_frame_rate() {
    let mut d = daemon(PolicyConfig::Vgris(VgrisConfig::default()));
    let fps = ParamsOverride {
        target_fps: Some(50.0),
        ..ParamsOverride::default()
    };
    d.set_params(0, "game", &fps).unwrap();
    let (c, _) = attach(&mut d, 0, "game", PID);
    let t0 = NS_PER_MS;
    assert_eq!(
        send(&mut d, t0, c, &Msg::Frame).messages,
        [(c, Msg::Present { at: t0 })]
    );
    // The next frame is ready after 5 ms of work: its present waits for the 20 ms period.
    let out = send(&mut d, t0 + 5 * NS_PER_MS, c, &Msg::Frame);
    assert_eq!(
        out.messages,
        [(
            c,
            Msg::Present {
                at: t0 + 20 * NS_PER_MS
            }
        )]
    );
}

#[test]
fn a_device_dying_mid_flight_leaves_the_others_running() {
    let mut d = daemon(PolicyConfig::None);
    let (a, _) = attach(&mut d, 0, "a", PID);
    let (b, _) = attach(&mut d, 0, "b", PID + 10);
    // a's group runs on the engine; b's waits in its queue; a has more queued behind.
    for (c, id) in [(a, 1), (b, 2), (a, 3)] {
        let out = send(&mut d, 0, c, &submit(id, Exec::Simulated, 10 * NS_PER_MS));
        assert_eq!(refused(&out, c), None);
    }
    assert_eq!(d.next_deadline(), Some(10 * NS_PER_MS));
    d.disconnect(NS_PER_MS, a);
    let out = d.drain();
    assert_eq!(out.drops, [a]);
    // a's running job finishes at 10 ms and is dropped; b's runs next and finishes at 20 ms.
    let seen = run_until(&mut d, 30 * NS_PER_MS, |_, _, _, _| {});
    assert!(seen.iter().all(|(_, c, _)| *c == b), "{seen:?}");
    let done: Vec<_> = seen
        .iter()
        .filter_map(|(_, _, m)| match m {
            Msg::Done {
                group,
                start,
                finish,
            } => Some((group.0, *start, *finish)),
            _ => None,
        })
        .collect();
    assert_eq!(done, [(2, 10 * NS_PER_MS, 20 * NS_PER_MS)]);
    // Packets from the dead connection are ignored; b goes on.
    d.receive(31 * NS_PER_MS, a, &bytes(&device(9)));
    assert_eq!(d.drain(), Outbox::default());
    assert_eq!(grants(&send(&mut d, 32 * NS_PER_MS, b, &device(4)), b), [4]);
    assert_eq!(d.list().len(), 1);
}

#[test]
fn a_device_dying_with_a_granted_group_frees_the_gpu() {
    let mut d = daemon(PolicyConfig::None);
    let (a, _) = attach(&mut d, 0, "a", PID);
    let (b, _) = attach(&mut d, 0, "b", PID + 10);
    assert_eq!(grants(&send(&mut d, 1, a, &device(1)), a), [1]);
    assert!(grants(&send(&mut d, 2, b, &device(1)), b).is_empty());
    d.disconnect(3, a);
    assert_eq!(grants(&d.drain(), b), [1]);
}

#[test]
fn reconnecting_with_the_same_name_keeps_parameters() {
    let mut d = daemon(PolicyConfig::None);
    let w = |weight| ParamsOverride {
        weight: Some(weight),
        ..ParamsOverride::default()
    };
    d.set_params(0, "vm", &w(77)).unwrap();
    let (c, v) = attach(&mut d, 0, "vm", PID);
    assert_eq!(d.list()[0].params.weight, 77);
    assert_eq!(d.list()[0].qemu_pid, Some(PID + 1));
    // Changed while connected: applies now and is stored.
    d.set_params(1, "vm", &w(99)).unwrap();
    assert_eq!(d.list()[0].params.weight, 99);
    let out = send(&mut d, 2, c, &Msg::Bye);
    assert_eq!(out.drops, [c]);
    assert_eq!(refused(&out, c), None);
    assert!(!d.list()[0].connected);
    let (c2, v2) = attach(&mut d, 3, "vm", PID + 5);
    assert_ne!(c, c2, "connection ids are not reused");
    assert_eq!(v, v2, "the freed vGPU slot is reused");
    let info = &d.list()[0];
    assert_eq!((info.params.weight, info.params.name.as_str()), (99, "vm"));
    // Invalid parameters and names are refused and change nothing.
    assert!(d.set_params(4, "vm", &w(0)).is_err());
    assert!(d.set_params(4, "a:b", &w(1)).is_err());
    assert_eq!(d.list()[0].params.weight, 99);
    assert!(d.focus(5, "ghost").is_err());
    assert!(d.focus(5, "vm").is_ok());
}

#[test]
fn list_shows_the_parameters_the_policy_applies_next_to_the_operators() {
    let mut d = daemon(PolicyConfig::None);
    let own = ParamsOverride {
        priority: Some(2),
        weight: Some(300),
        ..ParamsOverride::default()
    };
    d.set_params(0, "game", &own).unwrap();
    d.set_params(0, "away", &own).unwrap();
    attach(&mut d, 0, "game", PID);
    attach(&mut d, 0, "other", PID + 10);
    let find = |d: &Daemon, name: &str| d.list().into_iter().find(|v| v.name == name).unwrap();
    // No scheduling: what was set is what applies; a VM away has nothing in force.
    let game = find(&d, "game");
    assert_eq!(game.effective.as_ref(), Some(&game.params));
    assert_eq!(find(&d, "away").effective, None);
    let tg = TimeGraphConfig {
        wildcard_priority: 1,
        specs: vec![
            "<game:ht:none:10:1:1>".into(),
            "<other:prt:pe:*:100:1000>".into(),
        ],
        ..TimeGraphConfig::default()
    };
    d.set_policy(1, PolicyConfig::TimeGraph(tg)).unwrap();
    let game = find(&d, "game");
    assert_eq!((game.params.priority, game.params.sched), (2, None));
    let eff = game.effective.unwrap();
    assert_eq!((eff.priority, eff.sched), (10, Some(PrioPolicy::Ht)));
    assert_eq!((eff.weight, eff.reserve), (300, None));
    let other = find(&d, "other").effective.unwrap();
    let reserve = Reserve {
        c: 100_000,
        t: 1_000_000,
        enforcement: Enforcement::Pe,
        shared: None,
    };
    assert_eq!((other.priority, other.reserve), (1, Some(reserve)));
    d.focus(2, "other").unwrap();
    assert_eq!(find(&d, "other").effective.unwrap().priority, u32::MAX);
    // Both go out on the control interface.
    let json = serde_json::to_value(d.list()).unwrap();
    assert_eq!(json[1]["params"]["priority"], 2);
    assert_eq!(json[1]["effective"]["priority"], 10);
    assert_eq!(json[0]["effective"], serde_json::Value::Null);
    d.set_policy(3, PolicyConfig::None).unwrap();
    let game = find(&d, "game");
    assert_eq!(game.effective.as_ref(), Some(&game.params));
}

#[test]
fn set_policy_swaps_live_and_keeps_queues() {
    let mut d = daemon(PolicyConfig::None);
    let (a, _) = attach(&mut d, 0, "a", PID);
    let (b, _) = attach(&mut d, 0, "b", PID + 10);
    assert_eq!(grants(&send(&mut d, 1, a, &device(1)), a), [1]);
    assert!(send(&mut d, 2, b, &device(2)).messages.is_empty());
    let tg = TimeGraphConfig {
        sched: PrioPolicy::Prt,
        ..TimeGraphConfig::default()
    };
    d.set_policy(3, PolicyConfig::TimeGraph(tg)).unwrap();
    assert_eq!(
        d.policy(),
        &PolicyConfig::TimeGraph(TimeGraphConfig {
            sched: PrioPolicy::Prt,
            ..TimeGraphConfig::default()
        })
    );
    assert_eq!(grants(&send(&mut d, 4, a, &completed(1, 1, 4)), b), [2]);
    let bad = TimeGraphConfig {
        admission_limit: f64::NAN,
        ..TimeGraphConfig::default()
    };
    assert!(d.set_policy(5, PolicyConfig::TimeGraph(bad)).is_err());
    assert_eq!(d.stats(5).policy, "timegraph");
}

#[test]
fn cpu_hints_reach_the_scheduler_and_weights_are_written_back_when_enabled() {
    let config = DaemonConfig {
        policy: PolicyConfig::Pegasus(PegasusConfig::default()),
        cpu_writeback: true,
        ..DaemonConfig::default()
    };
    let mut d = Daemon::new(0, config).unwrap();
    attach(&mut d, 0, "vm", PID);
    let hint = vgpu_scheduler::CpuHint {
        weight: 100,
        running: true,
        runnable: true,
        usage: 5,
    };
    assert!(d.cpu_hint(1, "vm", hint).is_ok());
    assert!(d.cpu_hint(1, "ghost", hint).is_err());
    // Whatever weights the policy suggests name the VM and its QEMU pid.
    run_until(&mut d, NS_PER_SEC, |_, _, _, _| {});
    for w in d.drain().weights {
        assert_eq!((w.vm.as_str(), w.qemu_pid), ("vm", PID + 1));
    }
}

/// A packet `f` makes from a valid one.
fn mangled(msg: &Msg, f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut b = bytes(msg);
    f(&mut b);
    b
}

/// Greets the victim device of the bad-input cases.
fn greet(d: &mut Daemon, c: ConnId) {
    let out = send(d, 1, c, &hello("victim", PID + 100));
    assert!(matches!(out.messages[0].1, Msg::Welcome { .. }));
}

/// Each bad input refuses and drops only its sender; the bystander keeps working.
#[test]
fn bad_input_refuses_and_drops_only_its_connection() {
    type Setup = fn(&mut Daemon, ConnId) -> Vec<u8>;
    let cases: Vec<(&str, RefuseCode, Setup)> = vec![
        ("truncated", RefuseCode::BadMessage, |_, _| {
            mangled(&hello("victim", PID + 100), |b| {
                b.truncate(b.len() - 1);
            })
        }),
        ("oversized", RefuseCode::BadMessage, |_, _| {
            vec![0; MAX_MESSAGE_BYTES + 1]
        }),
        ("unknown kind", RefuseCode::BadMessage, |_, _| {
            mangled(&Msg::Bye, |b| {
                b[4..6].copy_from_slice(&0x77u16.to_le_bytes())
            })
        }),
        ("bad flags", RefuseCode::BadMessage, |_, _| {
            mangled(&Msg::Bye, |b| b[6] = 1)
        }),
        ("short header", RefuseCode::BadMessage, |_, _| {
            bytes(&Msg::Bye)[..HEADER_BYTES - 1].to_vec()
        }),
        ("daemon message", RefuseCode::BadMessage, |_, _| {
            bytes(&Msg::Grant { group: GroupId(1) })
        }),
        ("before Hello", RefuseCode::OutOfOrder, |_, _| {
            bytes(&device(1))
        }),
        ("second Hello", RefuseCode::OutOfOrder, |d, c| {
            greet(d, c);
            bytes(&hello("victim", PID + 100))
        }),
        ("name in use", RefuseCode::NameInUse, |_, _| {
            bytes(&hello("bystander", PID + 100))
        }),
        ("pid mismatch", RefuseCode::BadMessage, |_, _| {
            bytes(&hello("victim", PID + 101))
        }),
        ("version", RefuseCode::VersionMismatch, |_, _| {
            let mut h = hello("victim", PID + 100);
            if let Msg::Hello { version, .. } = &mut h {
                *version = PROTOCOL_VERSION + 1;
            }
            bytes(&h)
        }),
        ("completed before grant", RefuseCode::OutOfOrder, |d, c| {
            greet(d, c);
            // With the bystander's group, this device's first fills the GPU; the second waits.
            assert_eq!(grants(&send(d, 2, c, &device(5)), c), [5]);
            assert!(send(d, 2, c, &device(6)).messages.is_empty());
            bytes(&completed(6, 2, 3))
        }),
        ("unknown group", RefuseCode::UnknownGroup, |d, c| {
            greet(d, c);
            bytes(&completed(42, 2, 3))
        }),
        ("duplicate group", RefuseCode::DuplicateGroup, |d, c| {
            greet(d, c);
            assert_eq!(grants(&send(d, 2, c, &device(5)), c), [5]);
            bytes(&device(5))
        }),
        ("queue full", RefuseCode::QueueFull, |d, c| {
            greet(d, c);
            for id in 0..MAX_GROUPS_PER_DEVICE as u64 {
                let out = send(d, 2, c, &device(id));
                assert_eq!(refused(&out, c), None);
            }
            bytes(&device(u64::MAX))
        }),
        ("simulated cost 0", RefuseCode::BadMessage, |d, c| {
            greet(d, c);
            bytes(&submit(1, Exec::Simulated, 0))
        }),
        ("simulated cost too big", RefuseCode::BadMessage, |d, c| {
            greet(d, c);
            bytes(&submit(1, Exec::Simulated, MAX_SIMULATED_COST_NS + 1))
        }),
        (
            "completed for a simulated group",
            RefuseCode::BadMessage,
            |d, c| {
                greet(d, c);
                let out = send(d, 2, c, &submit(1, Exec::Simulated, NS_PER_MS));
                assert_eq!(refused(&out, c), None);
                bytes(&completed(1, 2, 3))
            },
        ),
        ("finish in the future", RefuseCode::BadMessage, |d, c| {
            greet(d, c);
            assert_eq!(grants(&send(d, 3, c, &device(5)), c), [5]);
            bytes(&completed(5, 3, 1_000))
        }),
    ];
    for (what, code, setup) in cases {
        // Room for one group of each device on the GPU.
        let config = DaemonConfig {
            capacity: 2,
            ..DaemonConfig::default()
        };
        let mut d = Daemon::new(0, config).unwrap();
        let (by, _) = attach(&mut d, 0, "bystander", PID);
        assert_eq!(grants(&send(&mut d, 0, by, &device(1)), by), [1], "{what}");
        let c = d.connect(
            1,
            Peer {
                pid: PID + 100,
                uid: 0,
            },
        );
        let packet = setup(&mut d, c);
        d.drain();
        d.receive(10, c, &packet);
        let out = d.drain();
        assert_eq!(refused(&out, c), Some(code), "{what}: {out:?}");
        assert!(out.drops.contains(&c), "{what}");
        assert!(!out.drops.contains(&by), "{what}");
        assert!(out.messages.iter().all(|(to, _)| *to == c || *to == by));
        // The refused device's state is gone and the bystander goes on.
        assert!(
            d.list().iter().all(|v| v.name != "victim" || !v.connected),
            "{what}"
        );
        let out = send(&mut d, 20, by, &completed(1, 0, 20));
        assert_eq!(refused(&out, by), None, "{what}: {out:?}");
        assert_eq!(grants(&send(&mut d, 21, by, &device(2)), by), [2], "{what}");
        // The victim's name is free again (a device refused after its Hello waits one group
        // timeout first).
        let t = 10 + DEFAULT_GROUP_TIMEOUT_NS;
        let again = d.connect(t, Peer { pid: 7, uid: 0 });
        let out = send(&mut d, t, again, &hello("victim", 7));
        assert!(matches!(out.messages[0].1, Msg::Welcome { .. }), "{what}");
    }
}

#[test]
fn connections_beyond_the_limit_are_refused() {
    let mut d = daemon(PolicyConfig::None);
    for _ in 0..MAX_CONNECTIONS {
        d.connect(0, Peer { pid: 0, uid: 0 });
    }
    let extra = d.connect(0, Peer { pid: 0, uid: 0 });
    let out = d.drain();
    assert_eq!(refused(&out, extra), Some(RefuseCode::TooManyVgpus));
    assert_eq!(out.drops, [extra]);
    // A peer pid of 0 (unknown) is not checked against Hello's.
    d.disconnect(1, ConnId(0));
    d.drain();
    let c = d.connect(2, Peer { pid: 0, uid: 0 });
    let out = send(&mut d, 2, c, &hello("vm", 4242));
    assert!(matches!(out.messages[0].1, Msg::Welcome { .. }));
}

#[test]
fn stats_rates_and_prometheus_rendering() {
    let mut d = daemon(PolicyConfig::None);
    d.set_params(0, "away", &ParamsOverride::default()).unwrap();
    let (c, _) = attach(&mut d, 0, "vm", PID);
    // One 100 ms group and one frame per 200 ms for 5 s.
    let mut t = 0;
    for id in 0..25 {
        assert_eq!(grants(&send(&mut d, t, c, &device(id)), c), [id]);
        let out = send(
            &mut d,
            t + 100 * NS_PER_MS,
            c,
            &completed(id, t, t + 100 * NS_PER_MS),
        );
        assert_eq!(refused(&out, c), None);
        send(&mut d, t + 100 * NS_PER_MS, c, &Msg::Frame);
        t += 200 * NS_PER_MS;
        run_until(&mut d, t, |_, _, _, _| {});
    }
    let s = d.stats(t);
    let vm = s.vms.iter().find(|v| v.name == "vm").unwrap();
    assert!((vm.gpu_share - 0.5).abs() < 0.05, "{vm:?}");
    assert!((vm.groups_per_sec - 5.0).abs() < 0.5, "{vm:?}");
    assert!((vm.fps - 5.0).abs() < 0.5, "{vm:?}");
    // 100 ms = 100_000 µs, within the histogram's 12.5 % bucket width.
    assert!((87_500..=100_000).contains(&vm.latency_p50_us), "{vm:?}");
    assert_eq!(vm.latency_p50_us, vm.latency_p99_us);
    let away = s.vms.iter().find(|v| v.name == "away").unwrap();
    assert!(!away.connected);
    let json = serde_json::to_string(&s).unwrap();
    assert!(json.contains("\"gpu_share\""));
    serde_json::to_string(&d.list()).unwrap();

    let place = VmPlace {
        cgroup: Some("/sys/fs/cgroup/machine.slice/vm".into()),
        socket: Some("/run/vgpu/vm.sock".into()),
        vgpu_type: Some("quarter".into()),
    };
    let ctx = Context {
        places: [("vm".to_owned(), place)].into(),
        ..context()
    };
    let text = render_metrics(&s, &ctx);
    assert!(text.contains("# TYPE vgpu_groups_completed_total counter\n"));
    assert_eq!(
        sample(&text, "vgpu_groups_completed_total", "vm=\"vm\""),
        Some(25.0)
    );
    assert_eq!(sample(&text, "vgpu_frames_total", "vm=\"vm\""), Some(25.0));
    // 25 groups of 100 ms, in seconds.
    assert_eq!(
        sample(&text, "vgpu_gpu_seconds_total", "vm=\"vm\""),
        Some(2.5)
    );
    assert_eq!(sample(&text, "vgpu_connected", "vm=\"away\""), Some(0.0));
    assert_eq!(sample(&text, "vgpu_connected", "vm=\"vm\""), Some(1.0));
    assert_eq!(
        sample(&text, "vgpu_gpu_share_ratio", "vm=\"vm\""),
        Some(vm.gpu_share)
    );
    assert_eq!(
        sample(&text, "vgpu_frames_per_second", "vm=\"vm\""),
        Some(vm.fps)
    );
    // The latency quantiles in seconds: 87.5 to 100 ms.
    let p50 = sample(&text, "vgpu_group_latency_p50_seconds", "vm=\"vm\"").unwrap();
    assert!((0.0875..=0.1).contains(&p50), "{p50}");
    assert_eq!(
        sample(&text, "vgpu_group_latency_p99_seconds", "vm=\"vm\""),
        Some(p50)
    );
    // The groups of the last 5 to 10 s: all of them here, so the same 87.5 to 100 ms.
    let recent = sample(&text, "vgpu_group_recent_latency_p50_seconds", "vm=\"vm\"");
    assert_eq!(recent, Some(vm.recent_latency_p50_us as f64 / 1e6));
    assert!(
        recent.is_some_and(|r| (0.0875..=0.1).contains(&r)),
        "{recent:?}"
    );
    assert!(text.contains("# TYPE vgpu_queue_depth gauge\n"));
    assert_eq!(sample(&text, "vgpu_queue_depth", "vm=\"vm\""), Some(0.0));
    // Info gauges: the build, the policy, the connected VM's vGPU (none for the VM away).
    let version = env!("CARGO_PKG_VERSION");
    let build = format!("version=\"{version}\"");
    assert_eq!(sample(&text, "vgpu_build_info", &build), Some(1.0));
    assert_eq!(
        sample(&text, "vgpu_policy_info", "policy=\"none\""),
        Some(1.0)
    );
    // The latency histogram: 25 groups of exactly 100 ms, so all in the 0.1 s bucket.
    assert!(text.contains("# TYPE vgpu_group_latency_seconds histogram\n"));
    let bucket = |le: &str| {
        let labels = format!("vm=\"vm\",le=\"{le}\"");
        sample(&text, "vgpu_group_latency_seconds_bucket", &labels)
    };
    assert_eq!(
        (bucket("0.05"), bucket("0.1"), bucket("10"), bucket("+Inf")),
        (Some(0.0), Some(25.0), Some(25.0), Some(25.0)),
        "{text}"
    );
    let count = sample(&text, "vgpu_group_latency_seconds_count", "vm=\"vm\"");
    let sum = sample(&text, "vgpu_group_latency_seconds_sum", "vm=\"vm\"");
    assert_eq!((count, sum), (Some(25.0), Some(2.5)));
    let buckets = text
        .lines()
        .filter(|l| l.starts_with("vgpu_group_latency_seconds_bucket{vm=\"vm\""))
        .count();
    assert_eq!(buckets, LATENCY_BOUNDS_NS.len() + 1);
    assert_eq!(
        sample(&text, "vgpu_group_latency_seconds_count", "vm=\"away\""),
        Some(0.0)
    );
    // vm_info names where the VM runs: QEMU's pid (the Hello's, proven), cgroup, socket, type.
    let vgpu = vm.vgpu.unwrap().0;
    let labels = format!(
        "vm=\"vm\",vgpu=\"{vgpu}\",qemu_pid=\"{}\",\
         cgroup=\"/sys/fs/cgroup/machine.slice/vm\",socket=\"/run/vgpu/vm.sock\",type=\"quarter\"",
        PID + 1
    );
    assert_eq!(sample(&text, "vgpu_vm_info", &labels), Some(1.0), "{text}");
    // Unknown places are empty labels.
    let bare = render_metrics(&s, &Context::default());
    let labels = format!(
        "vm=\"vm\",vgpu=\"{vgpu}\",qemu_pid=\"{}\",cgroup=\"\",socket=\"\",type=\"\"",
        PID + 1
    );
    assert_eq!(sample(&bare, "vgpu_vm_info", &labels), Some(1.0), "{bare}");
    assert!(!bare.contains("process_"), "{bare}");
    // The daemon process's own figures.
    assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"));
    let cpu = sample(&text, "process_cpu_seconds_total", "");
    assert!(cpu.is_some_and(|v| v >= 0.0), "{cpu:?}");
    for family in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(
            sample(&text, family, "").is_some_and(|v| v > 0.0),
            "{family}"
        );
    }
    assert!(!text.contains("vgpu_vm_info{vm=\"away\""), "{text}");
    assert!(text.contains("# TYPE vgpu_engine_context_switches_total counter\n"));
    let busy = sample(&text, "vgpu_engine_busy_ratio", "").unwrap();
    assert!((0.0..=1.0).contains(&busy), "{busy}");
    // The old names that broke Prometheus' rules are gone (docs/METRICS.md lists them).
    for old in [
        "vgpu_latency_p50_microseconds",
        "vgpu_vgpu_id",
        "vgpu_policy_figure",
        "vgpu_gpu_share{",
    ] {
        assert!(!text.contains(old), "{old}");
    }
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (_, value) = line.rsplit_once(' ').unwrap();
        assert!(value.parse::<f64>().is_ok(), "{line}");
    }
    common::assert_promtool_clean(&text);
    // Label values are escaped.
    let mut odd = s.clone();
    odd.vms[0].name = "a\"b\\c\nd".into();
    assert!(render_metrics(&odd, &ctx).contains("vm=\"a\\\"b\\\\c\\nd\""));
}

/// What the I/O layer adds to a scrape: this process's figures, no places.
fn context() -> Context {
    Context {
        process: Some(ProcessStats::read().unwrap()),
        ..Context::default()
    }
}

/// The value of the sample of family `name` with `labels` (`vm="a"`; empty for none) in a
/// Prometheus text exposition.
fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    let series = if labels.is_empty() {
        format!("{name} ")
    } else {
        format!("{name}{{{labels}}} ")
    };
    let line = text.lines().find(|l| l.starts_with(&series))?;
    line[series.len()..].parse().ok()
}

/// The family a sample line of an exposition belongs to: its name up to the labels, without
/// the `_bucket`, `_sum` or `_count` of a histogram's samples (no other family ends so).
fn family_of(line: &str) -> &str {
    let end = line.find(['{', ' ']).unwrap_or(line.len());
    let name = &line[..end];
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}

#[test]
fn every_policy_family_renders_metrics_that_promtool_accepts() {
    let reserve = ParamsOverride {
        reserve: Some(Reserve {
            c: 5 * NS_PER_MS,
            t: 25 * NS_PER_MS,
            enforcement: Enforcement::Pe,
            shared: None,
        }),
        ..ParamsOverride::default()
    };
    let mut seen = std::collections::BTreeSet::new();
    for policy in PolicyConfig::every_mode() {
        let name = format!("{policy:?}");
        let mut d = daemon(policy);
        d.set_params(0, "a", &reserve).unwrap();
        let (a, _) = attach(&mut d, 0, "a", PID);
        let (b, _) = attach(&mut d, 0, "b", PID + 10);
        let memory = Msg::Memory {
            used: 3 << 20,
            limit: 1 << 30,
        };
        d.receive(0, a, &bytes(&memory));
        // 100 ms: past fair sampling's first 50 ms period, so its estimates exist.
        serve_closed_loop(&mut d, 0, &[a, b], 1000);
        let stats: Stats = d.stats(100 * NS_PER_MS);
        for vm in &stats.vms {
            for key in vm.figures.keys() {
                assert!(
                    figure_is_known(stats.policy, key),
                    "{name}: figure {key} has no metric"
                );
            }
        }
        let text = render_metrics(&stats, &context());
        common::assert_promtool_clean(&text);
        let policy = format!("policy=\"{}\"", stats.policy);
        assert_eq!(
            sample(&text, "vgpu_policy_info", &policy),
            Some(1.0),
            "{name}"
        );
        for vm in ["a", "b"] {
            let labels = format!("vm=\"{vm}\"");
            assert_eq!(
                sample(&text, "vgpu_connected", &labels),
                Some(1.0),
                "{name}"
            );
            // Only the VM whose device reported its memory has memory samples.
            let used = sample(&text, "vgpu_memory_used_bytes", &labels);
            let limit = sample(&text, "vgpu_memory_limit_bytes", &labels);
            let reported = (Some(3_145_728.0), Some(1_073_741_824.0));
            assert_eq!(
                (used, limit),
                if vm == "a" { reported } else { (None, None) },
                "{name}"
            );
            let done = sample(&text, "vgpu_groups_completed_total", &labels);
            assert!(
                done.is_some_and(|n| n > 0.0),
                "{name}: {vm} completed nothing"
            );
        }
        seen.extend(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| family_of(l).to_owned()),
        );
    }
    let families = family_names();
    let missing: Vec<&String> = families.iter().filter(|f| !seen.contains(*f)).collect();
    assert!(
        missing.is_empty(),
        "families no policy exposed: {missing:?}"
    );
    let unknown: Vec<&String> = seen.iter().filter(|f| !families.contains(f)).collect();
    assert!(
        unknown.is_empty(),
        "families family_names() misses: {unknown:?}"
    );
}

#[test]
fn metrics_doc_lists_every_family() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/METRICS.md");
    let doc = std::fs::read_to_string(path).unwrap();
    for family in family_names() {
        assert!(
            doc.contains(&format!("`{family}`")),
            "docs/METRICS.md: {family}"
        );
    }
}

#[test]
fn promtool_reports_expositions_that_break_the_naming_rules() {
    // A counter without `_total`, an abbreviated unit and a unit that is not a base unit (the
    // old `vgpu_latency_p50_microseconds`).
    let bad = "# HELP vgpu_groups Groups.\n# TYPE vgpu_groups counter\nvgpu_groups{vm=\"a\"} 1\n\
               # HELP vgpu_latency_ms Latency.\n# TYPE vgpu_latency_ms gauge\nvgpu_latency_ms 3\n\
               # HELP vgpu_latency_p50_microseconds Latency.\n\
               # TYPE vgpu_latency_p50_microseconds gauge\nvgpu_latency_p50_microseconds 3\n";
    let (ok, report) = common::promtool_check(bad);
    assert!(!ok, "{report}");
    for problem in [
        "vgpu_groups counter metrics should have \"_total\" suffix",
        "vgpu_latency_ms metric names should not contain abbreviated units",
        "vgpu_latency_p50_microseconds use base unit \"seconds\" instead of \"microseconds\"",
    ] {
        assert!(report.contains(problem), "{problem}: {report}");
    }
    // And text that does not parse is an error too.
    let (ok, report) = common::promtool_check("vgpu_groups{vm=\"a\" 1\n");
    assert!(!ok, "{report}");
}

#[test]
fn stats_and_metrics_carry_the_budget_of_vms_that_have_one() {
    let mut d = daemon(PolicyConfig::TimeGraph(TimeGraphConfig::default()));
    let reserve = ParamsOverride {
        reserve: Some(Reserve {
            c: 5 * NS_PER_MS,
            t: 25 * NS_PER_MS,
            enforcement: Enforcement::Pe,
            shared: None,
        }),
        ..ParamsOverride::default()
    };
    d.set_params(0, "rt", &reserve).unwrap();
    d.set_params(0, "away", &reserve).unwrap();
    let (rt, _) = attach(&mut d, 0, "rt", PID);
    attach(&mut d, 0, "bg", PID + 10);
    let budget = |d: &Daemon, now: Time| {
        let s = d.stats(now);
        let get = |name: &str| s.vms.iter().find(|v| v.name == name).unwrap().budget;
        assert_eq!((get("bg"), get("away")), (None, None));
        get("rt").map(|b| (b.remaining_ns, b.capacity_ns, b.period_ns))
    };
    let full = Some((5_000_000, 5 * NS_PER_MS, Some(25 * NS_PER_MS)));
    assert_eq!(budget(&d, 0), full);
    assert_eq!(grants(&send(&mut d, 0, rt, &device(1)), rt), [1]);
    let out = send(&mut d, 2 * NS_PER_MS, rt, &completed(1, 0, 2 * NS_PER_MS));
    assert_eq!(refused(&out, rt), None);
    let left = Some((3_000_000, 5 * NS_PER_MS, Some(25 * NS_PER_MS)));
    assert_eq!(budget(&d, 2 * NS_PER_MS), left);

    let s = d.stats(2 * NS_PER_MS);
    let json: serde_json::Value = serde_json::to_value(&s).unwrap();
    let vms = json["vms"].as_array().unwrap();
    let field = |name: &str| &vms.iter().find(|v| v["name"] == name).unwrap()["budget"];
    assert_eq!(field("rt")["remaining_ns"], 3_000_000);
    assert_eq!(field("rt")["period_ns"], 25 * NS_PER_MS);
    assert!(field("bg").is_null());
    let text = render_metrics(&s, &context());
    assert!(text.contains("# TYPE vgpu_budget_remaining_seconds gauge\n"));
    let samples: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("vgpu_budget_remaining_seconds"))
        .collect();
    assert_eq!(samples, ["vgpu_budget_remaining_seconds{vm=\"rt\"} 0.003"]);
    let rt = "vm=\"rt\"";
    assert_eq!(
        sample(&text, "vgpu_budget_capacity_seconds", rt),
        Some(0.005)
    );
    assert_eq!(sample(&text, "vgpu_budget_period_seconds", rt), Some(0.025));
    // TimeGraph's own figures of the reserve, in seconds.
    let figures = [
        ("vgpu_timegraph_reserve_budget_seconds", 0.003),
        ("vgpu_timegraph_reserve_capacity_seconds", 0.005),
        ("vgpu_timegraph_reserve_period_seconds", 0.025),
        ("vgpu_timegraph_reserve_admitted", 1.0),
        ("vgpu_timegraph_background", 0.0),
    ];
    for (family, value) in figures {
        assert_eq!(sample(&text, family, rt), Some(value), "{family}");
    }
    assert_eq!(
        sample(&text, "vgpu_timegraph_background", "vm=\"bg\""),
        Some(1.0)
    );

    // The period's replenishment refills it.
    run_until(&mut d, 25 * NS_PER_MS, |_, _, _, _| {});
    assert_eq!(budget(&d, 25 * NS_PER_MS), full);
}

/// Devices `conns` keep one device group each outstanding: the GPU runs the granted groups in
/// the order they were granted, completing one every 100 µs, and each completion is followed by
/// that device's next submit. Returns the grants each received, from `now` for `steps` steps.
fn serve_closed_loop(d: &mut Daemon, mut now: Time, conns: &[ConnId], steps: u64) -> Vec<u64> {
    let mut running: std::collections::VecDeque<(usize, u64)> = Default::default();
    let mut next = 10_000u64;
    let mut counts = vec![0u64; conns.len()];
    let mut take = |out: &Outbox, running: &mut std::collections::VecDeque<(usize, u64)>| {
        for (i, &c) in conns.iter().enumerate() {
            assert_eq!(refused(out, c), None, "{out:?}");
            let g = grants(out, c);
            counts[i] += g.len() as u64;
            running.extend(g.into_iter().map(|id| (i, id)));
        }
    };
    for &c in conns {
        next += 1;
        let out = send(d, now, c, &device(next));
        take(&out, &mut running);
    }
    for _ in 0..steps {
        now += 100_000;
        d.timer(now);
        let out = d.drain();
        take(&out, &mut running);
        let Some((i, id)) = running.pop_front() else {
            continue;
        };
        let out = send(d, now, conns[i], &completed(id, now - 50_000, now));
        take(&out, &mut running);
        next += 1;
        let out = send(d, now, conns[i], &device(next));
        take(&out, &mut running);
    }
    counts
}

#[test]
fn a_cancelled_grant_frees_the_gpu_under_every_policy() {
    for policy in PolicyConfig::every_mode() {
        let name = format!("{policy:?}");
        let mut d = daemon(policy);
        let (a, _) = attach(&mut d, 0, "a", PID);
        let (b, _) = attach(&mut d, 0, "b", PID + 10);
        let (c, _) = attach(&mut d, 0, "c", PID + 20);
        assert_eq!(grants(&send(&mut d, 10, a, &device(1)), a), [1], "{name}");
        // a queues a second group (or gets it through a lease), then its guest resets the
        // device: both are cancelled and a never completes anything.
        send(&mut d, 20, a, &device(2));
        for id in [1, 2] {
            let out = send(&mut d, 30, a, &Msg::Cancel { group: GroupId(id) });
            assert_eq!(refused(&out, a), None, "{name}");
        }
        // A cancel that crossed its grant's completion names a group no longer tracked: ignored.
        let out = send(&mut d, 40, a, &Msg::Cancel { group: GroupId(9) });
        assert!(out.messages.is_empty() && out.drops.is_empty(), "{name}");
        let counts = serve_closed_loop(&mut d, 50, &[b, c], 400);
        assert!(counts.iter().all(|&n| n >= 50), "{name}: grants {counts:?}");
        let stats = d.stats(50 * NS_PER_MS);
        let vm = |n: &str| stats.vms.iter().find(|v| v.name == n).unwrap().clone();
        assert_eq!((vm("a").cancelled, vm("a").completed), (2, 0), "{name}");
        assert!(vm("a").connected, "{name}");
        assert!(
            render_metrics(&stats, &context()).contains("vgpu_groups_cancelled_total{vm=\"a\"} 2")
        );
    }
}

#[test]
fn a_device_that_never_completes_is_dropped_and_the_others_get_grants() {
    let mut d = daemon(PolicyConfig::None);
    let (a, _) = attach(&mut d, 0, "a", PID);
    let (b, _) = attach(&mut d, 0, "b", PID + 10);
    assert_eq!(grants(&send(&mut d, 10, a, &device(1)), a), [1]);
    assert!(grants(&send(&mut d, 20, b, &device(5)), b).is_empty());
    // Nothing happens before the timeout (2 s after the grant).
    d.timer(10 + DEFAULT_GROUP_TIMEOUT_NS - 1);
    let out = d.drain();
    assert!(
        out.drops.is_empty() && grants(&out, b).is_empty(),
        "{out:?}"
    );
    d.timer(10 + DEFAULT_GROUP_TIMEOUT_NS);
    let out = d.drain();
    assert_eq!(refused(&out, a), Some(RefuseCode::Timeout));
    assert_eq!(out.drops, [a]);
    assert_eq!(grants(&out, b), [5]);
    let a_info = d.list().into_iter().find(|v| v.name == "a");
    assert!(a_info.is_none_or(|v| !v.connected));
    // b keeps getting grants.
    let t = 10 + DEFAULT_GROUP_TIMEOUT_NS + 100;
    assert_eq!(
        refused(&send(&mut d, t, b, &completed(5, t - 50, t)), b),
        None
    );
    let counts = serve_closed_loop(&mut d, 3 * NS_PER_SEC, &[b], 50);
    assert!(counts[0] >= 40, "{counts:?}");
}

#[test]
fn a_name_that_timed_out_waits_longer_each_time_before_it_connects_again() {
    let mut d = daemon(PolicyConfig::None);
    let mut now = 0;
    for strike in 0..3u32 {
        let (a, _) = attach(&mut d, now, "a", PID);
        assert_eq!(grants(&send(&mut d, now, a, &device(1)), a), [1]);
        now += DEFAULT_GROUP_TIMEOUT_NS;
        d.timer(now);
        let out = d.drain();
        assert_eq!(out.drops, [a]);
        // Refused with Timeout until the back-off (the timeout, doubled per strike) is over.
        let wait = DEFAULT_GROUP_TIMEOUT_NS << strike;
        let c = d.connect(now + wait - 1, Peer { pid: PID, uid: 0 });
        let out = send(&mut d, now + wait - 1, c, &hello("a", PID));
        assert_eq!(
            refused(&out, c),
            Some(RefuseCode::Timeout),
            "strike {strike}"
        );
        assert_eq!(out.drops, [c]);
        now += wait;
    }
    // Another name is never held back.
    attach(&mut d, now, "b", PID + 10);
}

#[test]
fn the_oldest_group_in_flight_cannot_be_kept_alive_by_newer_ones() {
    let config = DaemonConfig {
        capacity: 2,
        group_timeout_ns: 500 * NS_PER_MS,
        ..DaemonConfig::default()
    };
    let mut d = Daemon::new(0, config).unwrap();
    let (a, _) = attach(&mut d, 0, "a", PID);
    assert_eq!(grants(&send(&mut d, 0, a, &device(1)), a), [1]);
    assert_eq!(grants(&send(&mut d, 0, a, &device(2)), a), [2]);
    // a completes every newer group within 10 ms and submits the next, but never group 1.
    let mut newest = 2;
    let mut now = 0;
    let mut dropped_at = None;
    while now < NS_PER_SEC {
        now += 10 * NS_PER_MS;
        d.timer(now);
        let out = d.drain();
        if out.drops.contains(&a) {
            assert_eq!(refused(&out, a), Some(RefuseCode::Timeout));
            dropped_at = Some(now);
            break;
        }
        let out = send(&mut d, now, a, &completed(newest, now - NS_PER_MS, now));
        assert_eq!(refused(&out, a), None);
        newest += 1;
        let out = send(&mut d, now, a, &device(newest));
        assert_eq!(grants(&out, a), [newest]);
    }
    assert_eq!(dropped_at, Some(500 * NS_PER_MS));
}

fn dispatched_msg(id: u64) -> Msg {
    Msg::Dispatched {
        group: GroupId(id),
        context: 0,
        kind: GroupKind::Render,
        signature: CostSignature(1),
    }
}

#[test]
fn dispatched_without_a_lease_is_refused() {
    let mut d = daemon(PolicyConfig::None);
    let (a, _) = attach(&mut d, 0, "a", PID);
    let out = send(&mut d, 10, a, &dispatched_msg(1));
    assert_eq!(refused(&out, a), Some(RefuseCode::NotLeased));
    assert_eq!(out.drops, [a]);
    assert!(d.stats(20).vms.iter().all(|v| !v.connected));
}

#[test]
fn dispatched_is_accepted_within_the_grace_after_a_revoke_only() {
    let mut d = daemon(PolicyConfig::Fair(FairConfig::default()));
    let (a, _) = attach(&mut d, 0, "a", PID);
    assert_eq!(send(&mut d, 10, a, &dispatched_msg(1)), Outbox::default());
    // The operator swaps the policy: the lease is revoked.
    d.set_policy(100, PolicyConfig::None).unwrap();
    let out = d.drain();
    assert!(out.messages.contains(&(a, Msg::Revoke)), "{out:?}");
    // A Dispatched that crossed the Revoke is accepted within the grace.
    let t = 100 + DISPATCH_GRACE_NS;
    let out = send(&mut d, t, a, &dispatched_msg(2));
    assert_eq!((refused(&out, a), out.drops.len()), (None, 0));
    // Past it, it is a protocol violation.
    let out = send(&mut d, t + 1, a, &dispatched_msg(3));
    assert_eq!(refused(&out, a), Some(RefuseCode::NotLeased));
    assert_eq!(out.drops, [a]);
}

#[test]
fn a_device_past_its_group_bound_is_refused_and_the_others_are_not() {
    let mut d = daemon(PolicyConfig::None);
    let (a, _) = attach(&mut d, 0, "a", PID);
    let (b, _) = attach(&mut d, 0, "b", PID + 10);
    // One group granted, the rest queued: together they count.
    for id in 0..MAX_GROUPS_PER_DEVICE as u64 {
        assert_eq!(refused(&send(&mut d, 1, a, &device(id)), a), None);
    }
    let out = send(&mut d, 2, b, &device(1));
    assert_eq!(refused(&out, b), None);
    let out = send(&mut d, 3, a, &device(u64::MAX));
    assert_eq!(refused(&out, a), Some(RefuseCode::QueueFull));
    assert_eq!(out.drops, [a]);
    // b, queued behind a's grant, is granted once a is gone.
    assert_eq!(grants(&out, b), [1]);
}

/// Connects as `peer` and sends Hello for `name`; returns the connection and the outbox.
fn hello_as(d: &mut Daemon, now: Time, name: &str, peer: Peer) -> (ConnId, Outbox) {
    let c = d.connect(now, peer);
    let out = send(d, now, c, &hello(name, peer.pid));
    (c, out)
}

#[test]
fn a_vm_name_is_bound_to_the_user_that_first_used_it() {
    let mut d = daemon(PolicyConfig::None);
    let (c, out) = hello_as(
        &mut d,
        0,
        "vm",
        Peer {
            pid: PID,
            uid: 1000,
        },
    );
    assert!(matches!(out.messages[0].1, Msg::Welcome { .. }));
    d.disconnect(1, c);
    d.drain();
    // Another user cannot take the name, even while its owner is away.
    let (s, out) = hello_as(
        &mut d,
        2,
        "vm",
        Peer {
            pid: 2000,
            uid: 1001,
        },
    );
    assert_eq!(refused(&out, s), Some(RefuseCode::Forbidden));
    assert_eq!(out.drops, [s]);
    // Its owner can, and so can anyone with a name of their own.
    let (c, out) = hello_as(
        &mut d,
        3,
        "vm",
        Peer {
            pid: PID,
            uid: 1000,
        },
    );
    assert_eq!(refused(&out, c), None);
    let (o, out) = hello_as(
        &mut d,
        4,
        "other",
        Peer {
            pid: 2000,
            uid: 1001,
        },
    );
    assert_eq!(refused(&out, o), None);
}

#[test]
fn a_created_vms_name_is_reserved_for_the_process_the_daemon_spawned() {
    let mut d = daemon(PolicyConfig::None);
    d.reserve_name("vm", 4242);
    // A squatter of the same user is refused.
    let (s, out) = hello_as(&mut d, 0, "vm", Peer { pid: PID, uid: 0 });
    assert_eq!(refused(&out, s), Some(RefuseCode::Forbidden));
    // The created process is welcome.
    let (c, out) = hello_as(&mut d, 1, "vm", Peer { pid: 4242, uid: 0 });
    assert!(matches!(out.messages[0].1, Msg::Welcome { .. }), "{out:?}");
    d.disconnect(2, c);
    // Released when it exits (a stale release for another pid changes nothing first).
    d.release_name("vm", 1);
    let (s, out) = hello_as(&mut d, 3, "vm", Peer { pid: PID, uid: 0 });
    assert_eq!(refused(&out, s), Some(RefuseCode::Forbidden));
    d.release_name("vm", 4242);
    let (c, out) = hello_as(
        &mut d,
        4,
        "vm",
        Peer {
            pid: PID + 1,
            uid: 0,
        },
    );
    assert_eq!(refused(&out, c), None, "{out:?}");
}

#[test]
fn an_unproven_qemu_pid_is_not_used() {
    let mut d = daemon(PolicyConfig::None);
    for (name, proof) in [("lie", Some(PID + 7)), ("bare", None)] {
        let c = d.connect(0, Peer { pid: PID, uid: 0 });
        d.receive_proven(0, c, &bytes(&hello(name, PID)), proof);
        let out = d.drain();
        assert!(matches!(out.messages[0].1, Msg::Welcome { .. }));
        let vm = d.list().into_iter().find(|v| v.name == name).unwrap();
        assert_eq!(vm.qemu_pid, Some(0), "{name}");
    }
}
