//! Cancelled groups under every policy: a group its device withdraws leaves the queue or the
//! GPU-online list, no policy keeps anything for it, and the other vGPUs keep being dispatched.

use vgpu_scheduler::model::{GroupId, NS_PER_MS, NS_PER_US};
use vgpu_scheduler::{
    CommandGroup, Decision, Event, GroupKind, PolicyConfig, SchedError, Scheduler, Time, VgpuId,
    VgpuParams,
};

fn handle(s: &mut Scheduler, now: Time, ev: Event) {
    let mut out: Vec<Decision> = Vec::new();
    s.handle(now, ev, &mut out).unwrap();
}

fn submit(s: &mut Scheduler, now: Time, v: VgpuId, id: u64) {
    handle(
        s,
        now,
        Event::Submitted(CommandGroup::new(id, v, GroupKind::Load, 1)),
    );
}

/// Delivers the timers due by `now`.
fn timers(s: &mut Scheduler, now: Time) {
    for _ in 0..1000 {
        match s.next_deadline() {
            Some(t) if t <= now => handle(s, t.max(s.now()), Event::Timer),
            _ => return,
        }
    }
}

#[test]
fn a_cancelled_group_frees_the_gpu_under_every_policy() {
    for config in PolicyConfig::every_mode() {
        let name = format!("{config:?}");
        let mut s = Scheduler::new(config.build(), 1);
        let mut out = Vec::new();
        let ids: Vec<VgpuId> = ["a", "b", "c"]
            .iter()
            .map(|n| s.add_vgpu(0, VgpuParams::named(n), &mut out).unwrap())
            .collect();
        let (a, b, c) = (ids[0], ids[1], ids[2]);
        // a's first group goes onto the GPU, its second waits or goes through a lease; b and c
        // queue behind it.
        submit(&mut s, NS_PER_US, a, 1);
        submit(&mut s, 2 * NS_PER_US, a, 2);
        submit(&mut s, 3 * NS_PER_US, b, 100);
        submit(&mut s, 4 * NS_PER_US, c, 200);
        assert!(
            s.online().iter().any(|o| o.group.vgpu == a),
            "{name}: a is on the GPU"
        );
        // a's device is reset: it cancels both groups and never completes anything.
        for id in [1, 2] {
            handle(
                &mut s,
                5 * NS_PER_US,
                Event::Cancelled {
                    vgpu: a,
                    group: GroupId(id),
                },
            );
        }
        let st = s.vgpu(a).unwrap();
        assert_eq!(st.queued(), 0, "{name}");
        assert_eq!(st.in_flight(), 0, "{name}");
        assert_eq!(st.account().cancelled, 2, "{name}");
        assert_eq!(st.account().completed, 0, "{name}");
        assert!(!s.online().iter().any(|o| o.group.vgpu == a), "{name}");
        // A second cancel of the same group, and one of a group never submitted, are refused
        // without effect.
        let mut out = Vec::new();
        for id in [1, 7] {
            let ev = Event::Cancelled {
                vgpu: a,
                group: GroupId(id),
            };
            assert_eq!(
                s.handle(6 * NS_PER_US, ev, &mut out),
                Err(SchedError::UnknownGroup(GroupId(id))),
                "{name}"
            );
        }
        // The GPU serves b and c: it completes whatever is online first, each completion of
        // b or c submits its next group (a closed loop).
        let mut now = 10 * NS_PER_US;
        let mut next_id = 1000;
        for _ in 0..400 {
            now += 100 * NS_PER_US;
            timers(&mut s, now);
            let Some(o) = s.online().first().cloned() else {
                continue;
            };
            assert_ne!(o.group.vgpu, a, "{name}: a was dispatched after its cancel");
            let start = o.dispatched.max(now - 100 * NS_PER_US);
            handle(
                &mut s,
                now,
                Event::Completed {
                    vgpu: o.group.vgpu,
                    group: o.group.id,
                    start,
                    finish: now,
                },
            );
            next_id += 1;
            submit(&mut s, now, o.group.vgpu, next_id);
        }
        assert!(now > 20 * NS_PER_MS);
        for v in [b, c] {
            let done = s.vgpu(v).unwrap().account().completed;
            assert!(done >= 50, "{name}: {v:?} completed only {done} groups");
        }
    }
}

#[test]
fn a_group_cancelled_in_flight_is_charged_from_its_dispatch() {
    let mut s = Scheduler::new(PolicyConfig::None.build(), 1);
    let mut out = Vec::new();
    let a = s.add_vgpu(0, VgpuParams::named("a"), &mut out).unwrap();
    submit(&mut s, 10, a, 1);
    let ev = Event::Cancelled {
        vgpu: a,
        group: GroupId(1),
    };
    handle(&mut s, 50, ev);
    let acct = s.vgpu(a).unwrap().account().clone();
    assert_eq!((acct.cancelled, acct.completed, acct.gpu_time), (1, 0, 40));
}
