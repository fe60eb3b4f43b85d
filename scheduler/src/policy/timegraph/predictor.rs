//! TimeGraph's history-based GPU cost predictor (§5.3, "Command Profiling").
//!
//! A table keyed by the command group's cost signature (the paper's command group matrix)
//! holds the running average cost of the groups seen with that signature. A miss predicts the
//! worst cost seen so far. The table keeps at most a configured number of records and drops
//! the least recently used one beyond that. A group that ran right after a context switch does
//! not update its record: the difference to the record's average is folded into the average
//! "preemption impact", which is added to predictions for groups that will switch contexts.

use std::collections::BTreeMap;

use crate::model::{CostSignature, Nanos};

/// Most records a history table may be configured to hold: far above the paper's 100 and the
/// distinct signatures of a frame, and it bounds the predictor's memory.
pub const MAX_PREDICTOR_ENTRIES: usize = 65_536;

/// One history record.
#[derive(Debug, Clone, Copy)]
struct Record {
    /// Sum of the costs folded into the average.
    sum: u128,
    /// How many costs were folded in (at least 1).
    count: u64,
    /// The LRU stamp of its last use.
    used: u64,
}

impl Record {
    fn average(&self) -> Nanos {
        let avg = self.sum / u128::from(self.count.max(1));
        Nanos::try_from(avg).unwrap_or(Nanos::MAX)
    }
}

/// The history table with its worst case and preemption impact.
#[derive(Debug, Clone)]
pub struct Predictor {
    capacity: usize,
    records: BTreeMap<CostSignature, Record>,
    /// LRU order: stamp -> signature, oldest first.
    lru: BTreeMap<u64, CostSignature>,
    clock: u64,
    worst: Nanos,
    impact_sum: i128,
    impact_count: u64,
    preemption_cost: Nanos,
}

impl Predictor {
    /// A predictor holding at most `capacity` records (clamped to 1..=[`MAX_PREDICTOR_ENTRIES`]).
    /// `preemption_cost` (ns) is the impact assumed for a context switch until one is measured
    /// (the paper measures a single preemption cost when TimeGraph is loaded).
    pub fn new(capacity: usize, preemption_cost: Nanos) -> Self {
        Predictor {
            capacity: capacity.clamp(1, MAX_PREDICTOR_ENTRIES),
            records: BTreeMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            worst: 0,
            impact_sum: 0,
            impact_count: 0,
            preemption_cost,
        }
    }

    /// The predicted cost of a group with `signature`; `switch` tells whether the GPU will
    /// switch contexts to run it. Counts as a use of the record for LRU.
    pub fn predict(&mut self, signature: CostSignature, switch: bool) -> Nanos {
        let base = self.touch(signature).unwrap_or(self.worst);
        if switch {
            base.saturating_add_signed(self.impact())
        } else {
            base
        }
    }

    /// Folds the actual `cost` of a completed group into the history; `switch` is true when the
    /// GPU switched contexts before it ran.
    pub fn record(&mut self, signature: CostSignature, cost: Nanos, switch: bool) {
        self.worst = self.worst.max(cost);
        match self.touch(signature) {
            Some(avg) if switch => {
                let diff = i128::from(cost) - i128::from(avg);
                self.impact_sum = self.impact_sum.saturating_add(diff);
                self.impact_count = self.impact_count.saturating_add(1);
            }
            Some(_) => {
                if let Some(r) = self.records.get_mut(&signature) {
                    r.sum = r.sum.saturating_add(u128::from(cost));
                    r.count = r.count.saturating_add(1);
                }
            }
            None => {
                if self.records.len() >= self.capacity
                    && let Some((_, oldest)) = self.lru.pop_first()
                {
                    self.records.remove(&oldest);
                }
                let used = self.stamp();
                self.lru.insert(used, signature);
                let sum = u128::from(cost);
                self.records.insert(
                    signature,
                    Record {
                        sum,
                        count: 1,
                        used,
                    },
                );
            }
        }
    }

    /// The average preemption impact in ns (negative when switches made groups faster).
    pub fn impact(&self) -> i64 {
        if self.impact_count == 0 {
            return i64::try_from(self.preemption_cost).unwrap_or(i64::MAX);
        }
        let avg = self.impact_sum / i128::from(self.impact_count);
        i64::try_from(avg).unwrap_or(if avg < 0 { i64::MIN } else { i64::MAX })
    }

    /// The worst cost seen so far (what a miss predicts).
    pub fn worst(&self) -> Nanos {
        self.worst
    }

    /// The number of records held.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True if no record is held.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The average stored for `signature`, without counting as a use.
    pub fn average(&self, signature: CostSignature) -> Option<Nanos> {
        self.records.get(&signature).map(Record::average)
    }

    /// Marks the record for `signature` as used now; returns its average.
    fn touch(&mut self, signature: CostSignature) -> Option<Nanos> {
        let old = self.records.get(&signature)?.used;
        let used = self.stamp();
        self.lru.remove(&old);
        self.lru.insert(used, signature);
        let r = self.records.get_mut(&signature)?;
        r.used = used;
        Some(r.average())
    }

    /// The next LRU stamp. When the clock would overflow, the stamps are renumbered densely in
    /// their current order first.
    fn stamp(&mut self) -> u64 {
        if self.clock == u64::MAX {
            let order: Vec<CostSignature> = std::mem::take(&mut self.lru).into_values().collect();
            self.clock = 0;
            for signature in order {
                if let Some(r) = self.records.get_mut(&signature) {
                    r.used = self.clock;
                    self.lru.insert(self.clock, signature);
                    self.clock += 1;
                }
            }
        }
        let used = self.clock;
        self.clock += 1;
        used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: CostSignature = CostSignature(1);
    const B: CostSignature = CostSignature(2);
    const C: CostSignature = CostSignature(3);

    #[test]
    fn averages_per_signature_and_predicts_the_worst_case_on_a_miss() {
        let mut p = Predictor::new(10, 0);
        assert_eq!(p.predict(A, false), 0);
        p.record(A, 10, false);
        p.record(A, 20, false);
        p.record(B, 50, false);
        assert_eq!(p.predict(A, false), 15);
        assert_eq!(p.predict(B, false), 50);
        assert_eq!(p.predict(C, false), 50);
        assert_eq!(p.worst(), 50);
    }

    #[test]
    fn drops_the_least_recently_used_record() {
        let mut p = Predictor::new(2, 0);
        p.record(A, 10, false);
        p.record(B, 20, false);
        // Using A makes B the least recently used.
        assert_eq!(p.predict(A, false), 10);
        p.record(C, 30, false);
        assert_eq!(p.len(), 2);
        assert_eq!(p.average(A), Some(10));
        assert_eq!(p.average(B), None);
        assert_eq!(p.average(C), Some(30));
    }

    #[test]
    fn context_switches_feed_the_preemption_impact_not_the_average() {
        let mut p = Predictor::new(10, 7);
        p.record(A, 100, false);
        // Before any measurement, the configured preemption cost is the impact.
        assert_eq!(p.predict(A, true), 107);
        p.record(A, 130, true);
        p.record(A, 110, true);
        assert_eq!(p.average(A), Some(100));
        assert_eq!(p.impact(), 20);
        assert_eq!(p.predict(A, true), 120);
        assert_eq!(p.predict(A, false), 100);
        // A faster run after a switch lowers the impact, and predictions never go below 0.
        p.record(A, 0, true);
        p.record(A, 0, true);
        p.record(A, 0, true);
        assert_eq!(p.impact(), -52);
        p.record(B, 10, false);
        assert_eq!(p.predict(B, true), 0);
    }
}
