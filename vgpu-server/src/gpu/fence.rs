//! Fenced completions (hop 8): a request with the fence flag is answered only when the host
//! work it covers has finished. Its used-ring entry is parked here until the backend signals
//! its fence, then released together with every earlier one.
//!
//! virtio-gpu fences are mergeable and ordered per device: signalling fence N completes every
//! fence up to N. Parked entries are released in the order they were parked, which is the
//! guest's submission order. A completion may also wait for a load submit's groups
//! ([`Wait::Load`]) instead of a renderer fence; it is released in the same order. Pure logic:
//! no I/O, no guest memory.

use std::collections::VecDeque;

use super::load::LoadToken;

/// What a parked completion waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// The renderer fence with the entry's guest fence id.
    Renderer,
    /// Every group of a load submit, or the present of a flushed frame.
    Load(LoadToken),
    /// Nothing of its own (a load submit without groups, or refused): only its turn.
    Nothing,
}

/// Most completions that can wait for fences at once. Every parked entry holds a descriptor
/// chain of one of the device's queues, so the queues' total size bounds it; a larger count
/// means a bug, not a busy guest.
pub const MAX_PARKED: usize = 2 * crate::virtio_pci::MAX_QUEUE_SIZE as usize;

/// A used-ring entry waiting for its fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parked {
    /// The guest's fence id from the request header.
    pub fence_id: u64,
    /// Queue of the chain.
    pub queue: u16,
    /// Head descriptor index of the chain.
    pub head: u16,
    /// Bytes written into the chain's response buffers.
    pub len: u32,
    /// What it waits for.
    pub wait: Wait,
}

/// Errors of the fence table.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FenceError {
    /// More completions parked than the queues can hold.
    #[error("more than {MAX_PARKED} completions waiting for fences")]
    Full,
}

/// Completions waiting for fences (each with whether it is ready), and the newest fence
/// signalled.
#[derive(Debug, Default)]
pub struct FenceState {
    parked: VecDeque<(Parked, bool)>,
    signalled: Option<u64>,
}

impl FenceState {
    /// Parks a completion. One that waits for nothing pending (a renderer fence that has
    /// already signalled, or [`Wait::Nothing`]) is released at once when nothing is parked
    /// before it: the return value then holds it.
    pub fn park(&mut self, entry: Parked) -> Result<Option<Parked>, FenceError> {
        let ready = match entry.wait {
            Wait::Renderer => self.signalled.is_some_and(|s| entry.fence_id <= s),
            Wait::Load(_) => false,
            Wait::Nothing => true,
        };
        if ready && self.parked.is_empty() {
            return Ok(Some(entry));
        }
        if self.parked.len() >= MAX_PARKED {
            return Err(FenceError::Full);
        }
        self.parked.push_back((entry, ready));
        Ok(None)
    }

    /// Records that fence `fence_id` (and so every earlier one) has signalled and returns the
    /// completions it releases, in the order they were parked. Release stops at the first
    /// entry still waiting, so completions never overtake one another.
    pub fn signal(&mut self, fence_id: u64) -> Vec<Parked> {
        let newest = self.signalled.map_or(fence_id, |s| s.max(fence_id));
        self.signalled = Some(newest);
        for (p, ready) in &mut self.parked {
            if p.wait == Wait::Renderer && p.fence_id <= newest {
                *ready = true;
            }
        }
        self.release()
    }

    /// Every group of load submit `token` has finished: returns the completions this
    /// releases, in order (none while an earlier entry still waits).
    pub fn load_done(&mut self, token: LoadToken) -> Vec<Parked> {
        for (p, ready) in &mut self.parked {
            if p.wait == Wait::Load(token) {
                *ready = true;
            }
        }
        self.release()
    }

    fn release(&mut self) -> Vec<Parked> {
        let ready = self.parked.iter().take_while(|(_, r)| *r).count();
        self.parked.drain(..ready).map(|(p, _)| p).collect()
    }

    /// Number of parked completions.
    pub fn pending(&self) -> usize {
        self.parked.len()
    }

    /// Forgets everything (device reset: parked chains are abandoned with their queues).
    pub fn reset(&mut self) {
        *self = FenceState::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(fence_id: u64, head: u16) -> Parked {
        Parked {
            fence_id,
            queue: 0,
            head,
            len: 24,
            wait: Wait::Renderer,
        }
    }

    #[test]
    fn signalling_releases_everything_up_to_the_fence_in_order() {
        let mut f = FenceState::default();
        for (fence, head) in [(1, 10), (2, 11), (3, 12)] {
            assert_eq!(f.park(entry(fence, head)), Ok(None));
        }
        let heads = |v: Vec<Parked>| v.iter().map(|p| p.head).collect::<Vec<_>>();
        assert_eq!(heads(f.signal(2)), [10, 11]);
        assert_eq!(f.pending(), 1);
        assert_eq!(
            heads(f.signal(1)),
            Vec::<u16>::new(),
            "an older signal changes nothing"
        );
        assert_eq!(heads(f.signal(3)), [12]);
    }

    #[test]
    fn completions_never_overtake_a_pending_fence() {
        let mut f = FenceState::default();
        f.park(entry(5, 1)).unwrap();
        // A hostile or confused guest reuses a lower fence id after a higher one.
        f.park(entry(2, 2)).unwrap();
        assert!(
            f.signal(3).is_empty(),
            "entry 1 (fence 5) is still pending and stays first"
        );
        assert_eq!(f.signal(5).len(), 2);
    }

    #[test]
    fn already_signalled_fences_complete_at_once() {
        let mut f = FenceState::default();
        f.signal(7);
        assert_eq!(f.park(entry(6, 3)), Ok(Some(entry(6, 3))));
        assert_eq!(f.park(entry(8, 4)), Ok(None));
        assert_eq!(
            f.park(entry(7, 5)),
            Ok(None),
            "behind a pending entry, it waits its turn"
        );
        assert_eq!(f.signal(8).len(), 2);
    }

    #[test]
    fn load_waits_keep_the_order_with_renderer_fences() {
        let mut runner = crate::gpu::load::LoadRunner::default();
        let occupy = [crate::gpu::load::LoadCommand::Occupy { us: 1 }];
        let a = runner.submit(1, &occupy, 0).unwrap().unwrap();
        let b = runner.submit(1, &occupy, 0).unwrap().unwrap();
        let mut f = FenceState::default();
        let load = |fence_id, head, t| Parked {
            wait: Wait::Load(t),
            ..entry(fence_id, head)
        };
        f.park(load(1, 1, a)).unwrap();
        f.park(entry(2, 2)).unwrap();
        f.park(load(3, 3, b)).unwrap();
        assert!(
            f.signal(2).is_empty(),
            "the load submit before it still runs"
        );
        assert!(f.load_done(b).is_empty(), "b is done but waits its turn");
        let heads: Vec<u16> = f.load_done(a).iter().map(|p| p.head).collect();
        assert_eq!(heads, [1, 2, 3]);
        assert!(f.signal(9).is_empty());
        assert_eq!(
            f.park(load(4, 4, a)),
            Ok(None),
            "a load wait is never ready on park, whatever has signalled"
        );
        let nothing = Parked {
            wait: Wait::Nothing,
            ..entry(5, 5)
        };
        assert_eq!(
            f.park(nothing),
            Ok(None),
            "it waits its turn behind entry 4"
        );
        assert_eq!(f.load_done(a).len(), 2);
        assert_eq!(
            f.park(nothing),
            Ok(Some(nothing)),
            "nothing before it: at once"
        );
    }

    #[test]
    fn the_table_is_bounded_and_reset_empties_it() {
        let mut f = FenceState::default();
        for i in 0..MAX_PARKED {
            f.park(entry(100, i as u16)).unwrap();
        }
        assert_eq!(f.park(entry(100, 0)), Err(FenceError::Full));
        f.reset();
        assert_eq!(f.pending(), 0);
        assert_eq!(
            f.park(entry(1, 0)),
            Ok(None),
            "reset forgets signalled fences too"
        );
    }
}
