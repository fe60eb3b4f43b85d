//! Rate-limited logging of guest faults.
//!
//! A guest decides how often it breaks the protocol: a reset storm or a loop of bad commands
//! would otherwise write a log line each, as fast as the guest can make them. [`RateLimit`]
//! (pure; the clock is an argument) lets the first [`FAULT_BURST`] lines of each
//! [`FAULT_INTERVAL`] through and counts the rest; the first line of the next interval is
//! preceded by one summary line with that count, as the kernel's `printk_ratelimit` does
//! ("N callbacks suppressed"). [`guest_fault!`] logs through the process's limiter: one
//! device process serves one VM, so the budget is per VM.

use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Guest-fault lines logged per [`FAULT_INTERVAL`] before the rest are only counted: enough to
/// see what a misbehaving driver does (its first faults are the telling ones), few enough that
/// a hostile one cannot fill the host's disk.
pub const FAULT_BURST: u32 = 10;
/// Length of one rate-limit interval (the kernel's default `printk_ratelimit` interval).
pub const FAULT_INTERVAL: Duration = Duration::from_secs(5);

/// Faults suppressed in an interval that ended, reported before the next logged line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suppressed {
    /// Lines not logged.
    pub count: u64,
    /// From the start of their interval to the line that reports them.
    pub over: Duration,
}

/// What to do with one fault line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admit {
    /// Log the line.
    pub log: bool,
    /// Log this summary first.
    pub summary: Option<Suppressed>,
}

/// First `burst` lines per `interval`, then a count.
#[derive(Debug, Clone)]
pub struct RateLimit {
    burst: u32,
    interval: Duration,
    /// Start of the current interval; `None` before the first line.
    start: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

impl RateLimit {
    /// A limiter letting `burst` lines through per `interval`.
    pub const fn new(burst: u32, interval: Duration) -> Self {
        RateLimit {
            burst,
            interval,
            start: None,
            logged: 0,
            suppressed: 0,
        }
    }

    /// Decides about one line at time `now`. An interval starts with the first line after
    /// the previous one ended.
    pub fn admit(&mut self, now: Instant) -> Admit {
        let mut summary = None;
        let current = self
            .start
            .filter(|&start| now.saturating_duration_since(start) < self.interval);
        if current.is_none() {
            if let Some(start) = self.start
                && self.suppressed > 0
            {
                summary = Some(Suppressed {
                    count: self.suppressed,
                    over: now.saturating_duration_since(start),
                });
            }
            self.start = Some(now);
            self.logged = 0;
            self.suppressed = 0;
        }
        if self.logged < self.burst {
            self.logged += 1;
            Admit { log: true, summary }
        } else {
            self.suppressed = self.suppressed.saturating_add(1);
            Admit {
                log: false,
                summary,
            }
        }
    }
}

/// The process's guest-fault limiter.
static GUEST_FAULTS: Mutex<RateLimit> = Mutex::new(RateLimit::new(FAULT_BURST, FAULT_INTERVAL));
/// Guest-fault lines suppressed since the process started.
static SUPPRESSED: AtomicU64 = AtomicU64::new(0);

/// Logs a guest fault at warn, through the process's limiter (use [`guest_fault!`]).
pub fn log_guest_fault(line: fmt::Arguments<'_>) {
    let admit = GUEST_FAULTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .admit(Instant::now());
    if let Some(s) = admit.summary {
        log::warn!(
            "suppressed {} guest faults in the last {} s",
            s.count,
            s.over.as_secs()
        );
    }
    if admit.log {
        log::warn!("{line}");
    } else {
        SUPPRESSED.fetch_add(1, Ordering::Relaxed);
    }
}

/// Guest-fault lines suppressed since the process started.
pub fn suppressed_guest_faults() -> u64 {
    SUPPRESSED.load(Ordering::Relaxed)
}

/// `warn!` for a fault a guest can repeat at will: rate-limited per process (per VM) by
/// [`log_guest_fault`].
macro_rules! guest_fault {
    ($($arg:tt)*) => {
        $crate::ratelimit::log_guest_fault(format_args!($($arg)*))
    };
}
pub(crate) use guest_fault;

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn first_burst_then_counted_then_one_summary() {
        let mut limit = RateLimit::new(3, 5 * SECOND);
        let t0 = Instant::now();
        let logged: Vec<bool> = (0..10).map(|_| limit.admit(t0).log).collect();
        assert_eq!(
            logged,
            [
                true, true, true, false, false, false, false, false, false, false
            ]
        );
        // Still the same interval just before its end.
        assert_eq!(
            limit.admit(t0 + 5 * SECOND - Duration::from_nanos(1)),
            Admit {
                log: false,
                summary: None
            }
        );
        // The next interval's first line carries the count of the last one.
        assert_eq!(
            limit.admit(t0 + 7 * SECOND),
            Admit {
                log: true,
                summary: Some(Suppressed {
                    count: 8,
                    over: 7 * SECOND
                })
            }
        );
        assert_eq!(
            limit.admit(t0 + 7 * SECOND).summary,
            None,
            "one summary per interval"
        );
    }

    #[test]
    fn quiet_intervals_have_no_summary() {
        let mut limit = RateLimit::new(2, SECOND);
        let t0 = Instant::now();
        for i in 0..5u32 {
            let admit = limit.admit(t0 + i * 2 * SECOND);
            assert_eq!(
                admit,
                Admit {
                    log: true,
                    summary: None
                }
            );
        }
    }

    #[test]
    fn a_clock_going_backwards_stays_in_the_interval() {
        let mut limit = RateLimit::new(1, SECOND);
        let t0 = Instant::now() + 10 * SECOND;
        assert!(limit.admit(t0).log);
        assert!(!limit.admit(t0 - SECOND).log);
    }

    #[test]
    fn a_storm_of_guest_faults_is_mostly_counted() {
        let before = suppressed_guest_faults();
        for i in 0..1000 {
            guest_fault!("test fault {i}");
        }
        // The loop takes far less than an interval, so it spans at most two of them (other
        // tests' faults only take more of the burst).
        let suppressed = suppressed_guest_faults() - before;
        assert!(
            suppressed >= 1000 - 2 * u64::from(FAULT_BURST),
            "{suppressed} suppressed"
        );
    }
}
