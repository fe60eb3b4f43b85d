//! Adaptive busy polling before an event loop blocks, after KVM's halt polling.
//!
//! A thread that blocks in `poll`/`epoll_wait` and is woken by the next message pays a
//! scheduler wake-up (16-26 µs on the project's 2-vCPU VM, docs/PERFORMANCE.md) on every hop.
//! On a path of several hops (QEMU -> relay -> worker -> MSI-X, device -> daemon -> device)
//! those wake-ups are most of the latency. A short spin that checks for work without blocking
//! catches a message that follows soon after the previous one, and costs nothing when the
//! thread is idle, because the spin window adapts to how long the thread actually waits:
//!
//! - the window starts at zero: an idle thread never spins;
//! - after a blocking wait that ended within [`BusyPoll::max`] of the spin's start, a longer
//!   window would have caught the event: the window grows (from [`GROW_START`], doubling, up to
//!   the maximum);
//! - after a blocking wait that took longer, spinning was wasted: the window halves, and drops
//!   to zero below [`GROW_START`];
//! - an event caught while spinning keeps the window.
//!
//! So the CPU spent spinning is bounded by the maximum per wake-up, and by about twice the
//! maximum in total over a run of idle waits. The spin yields the CPU between checks, so a
//! runnable thread on the same CPU (a vCPU of an oversubscribed host) is not kept waiting by
//! it. [`BusyPoll`] is pure logic (the caller supplies
//! the check and does the blocking); [`run_round`] applies it to an `event-manager` loop.

use std::time::{Duration, Instant};

use event_manager::{EventManager, MutEventSubscriber};

/// First non-zero window (KVM's `halt_poll_ns_grow_start` is 10 µs too).
pub const GROW_START: Duration = Duration::from_micros(10);
/// Default maximum window, KVM's `halt_poll_ns` default. It must cover the peer's whole turn
/// around *without* polling (about 70-90 µs for a doorbell on the project's machine: three
/// wake-ups), or a request/response pattern never gets the window started.
pub const DEFAULT_MAX: Duration = Duration::from_micros(200);
/// Largest maximum accepted from a command line: longer spins only burn a CPU.
pub const LIMIT_MAX: Duration = Duration::from_millis(1);

/// One round of an `event-manager` loop: rounds that do not block (`epoll_wait` with a zero
/// timeout) while `busy`'s window lasts, then one that blocks until an event if none came.
/// With `awaited` false (no peer waits for this thread's answer) it blocks at once and the
/// window is left as it is. `before_block` runs just before the loop would block (work to do
/// when idle: it may make an event ready, and then the loop does not block). Returns how many
/// events were handled.
pub fn run_round<S: MutEventSubscriber>(
    busy: &mut BusyPoll,
    manager: &mut EventManager<S>,
    awaited: bool,
    before_block: impl FnOnce(&mut EventManager<S>),
) -> event_manager::Result<usize> {
    let mut outcome = Ok(0);
    let caught = awaited
        && busy.spin(|| match manager.run_with_timeout(0) {
            Ok(0) => false,
            other => {
                outcome = other;
                true
            }
        });
    if caught {
        return outcome;
    }
    before_block(manager);
    let outcome = manager.run();
    busy.woken();
    outcome
}

/// Parses a command line's maximum in microseconds (`--busy-poll-us`).
pub fn parse_us(text: &str) -> Result<Duration, String> {
    let us: u64 = text
        .parse()
        .map_err(|_| format!("--busy-poll-us: {text:?} is not a number of microseconds"))?;
    let max = Duration::from_micros(us);
    if max > LIMIT_MAX {
        return Err(format!(
            "--busy-poll-us: {us} is above {} µs",
            LIMIT_MAX.as_micros()
        ));
    }
    Ok(max)
}

/// The adaptive spin window of one thread.
#[derive(Debug, Clone)]
pub struct BusyPoll {
    window: Duration,
    max: Duration,
    /// When the current spin began (set by [`BusyPoll::spin`] when it gave up).
    spun_from: Option<Instant>,
}

impl BusyPoll {
    /// A window that grows up to `max` (clamped to [`LIMIT_MAX`]); zero disables spinning.
    pub fn new(max: Duration) -> BusyPoll {
        BusyPoll {
            window: Duration::ZERO,
            max: max.min(LIMIT_MAX),
            spun_from: None,
        }
    }

    /// The current window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The maximum window.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// Calls `ready` (a non-blocking check for work that also handles what it finds) until it
    /// returns true or the window has passed. Returns true when work was found: the caller
    /// goes on without blocking. When it returns false the caller blocks and then reports the
    /// wait with [`BusyPoll::woken`].
    pub fn spin(&mut self, mut ready: impl FnMut() -> bool) -> bool {
        let start = Instant::now();
        self.spun_from = Some(start);
        if self.window.is_zero() {
            return false;
        }
        loop {
            if ready() {
                self.spun_from = None;
                return true;
            }
            if start.elapsed() >= self.window {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// The blocking wait that followed an unsuccessful [`BusyPoll::spin`] has ended (the
    /// caller was woken by an event or a timeout): adapts the window to how long the event
    /// took from the spin's start.
    pub fn woken(&mut self) {
        let Some(from) = self.spun_from.take() else {
            return;
        };
        self.adapt(from.elapsed());
    }

    /// Adapts the window to an event that came `after` the spin began.
    fn adapt(&mut self, after: Duration) {
        if self.max.is_zero() {
            self.window = Duration::ZERO;
        } else if after <= self.max {
            let grown = if self.window < GROW_START {
                GROW_START
            } else {
                self.window.saturating_mul(2)
            };
            self.window = grown.min(self.max);
        } else {
            let halved = self.window / 2;
            self.window = if halved < GROW_START {
                Duration::ZERO
            } else {
                halved
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn an_idle_thread_never_spins() {
        let mut p = BusyPoll::new(DEFAULT_MAX);
        for _ in 0..10 {
            let mut checks = 0;
            assert!(!p.spin(|| {
                checks += 1;
                false
            }));
            assert_eq!(checks, 0, "a zero window checks nothing");
            p.adapt(Duration::from_millis(5));
            assert_eq!(p.window(), Duration::ZERO);
        }
    }

    #[test]
    fn quick_events_grow_the_window_to_the_maximum_and_slow_ones_shrink_it_to_zero() {
        let mut p = BusyPoll::new(50 * US);
        let mut windows = Vec::new();
        for _ in 0..5 {
            p.adapt(20 * US);
            windows.push(p.window());
        }
        assert_eq!(windows, [10 * US, 20 * US, 40 * US, 50 * US, 50 * US]);
        windows.clear();
        for _ in 0..4 {
            p.adapt(Duration::from_millis(2));
            windows.push(p.window());
        }
        assert_eq!(
            windows,
            [
                25 * US,
                12500 * Duration::from_nanos(1),
                Duration::ZERO,
                Duration::ZERO
            ]
        );
    }

    #[test]
    fn a_zero_maximum_disables_and_the_maximum_is_clamped() {
        let mut p = BusyPoll::new(Duration::ZERO);
        p.adapt(US);
        assert_eq!(p.window(), Duration::ZERO);
        assert_eq!(BusyPoll::new(Duration::from_secs(1)).max(), LIMIT_MAX);
    }

    #[test]
    fn spinning_stops_at_work_or_at_the_window() {
        let mut p = BusyPoll::new(Duration::from_millis(1));
        p.adapt(US);
        // Work at the first check is found whatever the clock does (a loaded machine may take
        // longer than the window between two later checks).
        let mut n = 0;
        assert!(p.spin(|| {
            n += 1;
            true
        }));
        assert_eq!(n, 1);
        // Work caught while spinning: nothing to adapt, the window stays.
        p.woken();
        assert_eq!(p.window(), GROW_START);
        let start = Instant::now();
        assert!(!p.spin(|| false));
        assert!(start.elapsed() >= GROW_START);
        // The blocking wait that followed took longer than the maximum (1 ms): the window
        // halves, to zero below GROW_START. (Growth is `adapt`'s, tested above without a clock.)
        std::thread::sleep(Duration::from_millis(5));
        p.woken();
        assert_eq!(p.window(), Duration::ZERO);
    }
}
