//! Helpers shared by the crate's unit tests: drive a [`Scheduler`] one event at a time and
//! return the decisions it made.

use crate::core::Scheduler;
use crate::model::{CommandGroup, Decision, Event, GroupId, GroupKind, Time, VgpuId};

/// The decision of an unbounded lease for `v` (no budget, no end).
pub(crate) fn lease(v: VgpuId) -> Decision {
    Decision::Lease {
        vgpu: v,
        budget: None,
        until: None,
    }
}

/// The decision that sends group `id` of `v` to the GPU (`leased`: under `v`'s lease).
pub(crate) fn dispatch(v: VgpuId, id: u64, leased: bool) -> Decision {
    Decision::Dispatch {
        vgpu: v,
        group: GroupId(id),
        leased,
    }
}

/// Handles `ev` at `now` (it must be accepted); returns the decisions.
pub(crate) fn event(s: &mut Scheduler, now: Time, ev: Event) -> Vec<Decision> {
    let mut out = Vec::new();
    s.handle(now, ev, &mut out).unwrap();
    out
}

/// Submits load group `id` of `v` (signature 1) at `now`.
pub(crate) fn submit(s: &mut Scheduler, now: Time, v: VgpuId, id: u64) -> Vec<Decision> {
    let g = CommandGroup::new(id, v, GroupKind::Load, 1);
    event(s, now, Event::Submitted(g))
}

/// Completes group `id` of `v`: it ran from `start` to `now`.
pub(crate) fn complete(
    s: &mut Scheduler,
    now: Time,
    v: VgpuId,
    id: u64,
    start: Time,
) -> Vec<Decision> {
    let ev = Event::Completed {
        vgpu: v,
        group: GroupId(id),
        start,
        finish: now,
    };
    event(s, now, ev)
}
