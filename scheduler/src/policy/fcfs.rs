//! No scheduling: groups go to the GPU in the order they were submitted (passthrough).

use crate::core::Cx;
use crate::model::VgpuId;
use crate::policy::Policy;
use crate::policy::ready::ReadySet;

/// First come, first served across all vGPUs.
#[derive(Debug, Default)]
pub struct Fcfs {
    /// vGPUs with queued work, keyed by the arrival order of their oldest group.
    ready: ReadySet<u64>,
}

impl Fcfs {
    fn index(&mut self, cx: &Cx<'_>, v: VgpuId) {
        match cx.vgpu(v).and_then(|s| s.head_seq()) {
            Some(seq) => self.ready.insert(v, seq),
            None => {
                self.ready.remove(v);
            }
        }
    }
}

impl Policy for Fcfs {
    fn name(&self) -> &'static str {
        "none"
    }
    fn attach(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.index(cx, v);
    }
    fn detach(&mut self, _cx: &mut Cx<'_>, v: VgpuId) {
        self.ready.remove(v);
    }
    fn submitted(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        if !self.ready.contains(v) {
            self.index(cx, v);
        }
    }
    fn dispatched(&mut self, cx: &mut Cx<'_>, v: VgpuId, _leased: bool) {
        self.index(cx, v);
    }
    fn withdrawn(&mut self, cx: &mut Cx<'_>, v: VgpuId) {
        self.index(cx, v);
    }
    fn pick(&mut self, _cx: &mut Cx<'_>) -> Option<VgpuId> {
        self.ready.first().map(|(_, v)| v)
    }
}
