//! A VM's host-memory budget: one counter, shared by everything a guest makes its device
//! process hold (GL resources and entry lists, compute device memory, decompressed and parsed
//! modules, guest blobs and their entry lists, queued requests), so that no path can take more
//! than `--resource-memory-mb` whichever mix of them a guest uses.
//!
//! Bytes are charged before they are produced: [`MemoryBudget::charge`] either reserves them
//! or refuses with [`OverBudget`], and the [`Charge`] it returns gives them back when dropped,
//! so a failed or cancelled request can never leak its share. Pure bookkeeping: no I/O.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use thiserror::Error;

/// A charge that would take the budget past its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("{need} more host bytes refused ({used} of {limit} in use)")]
pub struct OverBudget {
    /// Bytes asked for.
    pub need: u64,
    /// Bytes in use when it was asked.
    pub used: u64,
    /// The budget's limit.
    pub limit: u64,
}

/// One VM's budget: a limit and the bytes charged against it.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: u64,
    used: AtomicU64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget {
            limit,
            used: AtomicU64::new(0),
        })
    }

    /// The limit, in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes charged now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Reserves `bytes`, or refuses when they do not fit. The bytes are given back when the
    /// returned [`Charge`] is dropped.
    pub fn charge(self: &Arc<Self>, bytes: u64) -> Result<Charge, OverBudget> {
        self.reserve(bytes)?;
        Ok(Charge {
            budget: Arc::clone(self),
            bytes,
        })
    }

    fn reserve(&self, bytes: u64) -> Result<(), OverBudget> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= self.limit)
            })
            .map(|_| ())
            .map_err(|used| OverBudget {
                need: bytes,
                used,
                limit: self.limit,
            })
    }

    fn release(&self, bytes: u64) {
        // Never below zero: a Charge gives back only what it reserved.
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(bytes))
            });
    }
}

/// Bytes reserved in a [`MemoryBudget`]; given back when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl Charge {
    /// An empty charge against `budget`, to [`Charge::grow`] as bytes are produced.
    pub fn empty(budget: &Arc<MemoryBudget>) -> Charge {
        Charge {
            budget: Arc::clone(budget),
            bytes: 0,
        }
    }

    /// Bytes this charge holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Reserves `more` bytes into this charge, or refuses (the charge keeps what it had).
    pub fn grow(&mut self, more: u64) -> Result<(), OverBudget> {
        let total = self.bytes.checked_add(more).ok_or(OverBudget {
            need: more,
            used: self.budget.used(),
            limit: self.budget.limit,
        })?;
        self.budget.reserve(more)?;
        self.bytes = total;
        Ok(())
    }

    /// Gives `less` bytes of this charge back (at most what it holds).
    pub fn shrink(&mut self, less: u64) {
        let less = less.min(self.bytes);
        self.budget.release(less);
        self.bytes -= less;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_stop_at_the_limit_and_come_back_when_dropped() {
        let b = MemoryBudget::new(100);
        let a = b.charge(60).unwrap();
        assert_eq!(b.used(), 60);
        let e = b.charge(41).unwrap_err();
        assert_eq!(
            e,
            OverBudget {
                need: 41,
                used: 60,
                limit: 100
            }
        );
        let c = b.charge(40).unwrap();
        assert_eq!(b.used(), 100);
        drop(a);
        assert_eq!(b.used(), 40);
        drop(c);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn a_charge_grows_and_shrinks_within_the_limit() {
        let b = MemoryBudget::new(100);
        let mut c = Charge::empty(&b);
        c.grow(70).unwrap();
        assert!(c.grow(31).is_err());
        assert_eq!(c.bytes(), 70, "a refused grow keeps what it had");
        c.shrink(20);
        assert_eq!(b.used(), 50);
        c.shrink(1000);
        assert_eq!(
            (c.bytes(), b.used()),
            (0, 0),
            "shrinks at most what it holds"
        );
        c.grow(30).unwrap();
        assert_eq!((c.bytes(), b.used()), (30, 30));
        drop(c);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn sizes_near_u64_max_are_refused_without_wrapping() {
        let b = MemoryBudget::new(u64::MAX);
        let _a = b.charge(u64::MAX - 1).unwrap();
        assert!(b.charge(2).is_err());
        let mut c = Charge::empty(&b);
        assert!(c.grow(u64::MAX).is_err());
        assert_eq!(b.used(), u64::MAX - 1);
    }
}
