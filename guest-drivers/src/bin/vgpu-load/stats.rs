//! Latency statistics and the JSON lines the tool prints. Pure code: no I/O.

use std::fmt::Write as _;

/// Latency samples kept for the percentiles (4 MiB of u32): past it a uniform reservoir sample
/// stands in for the whole run, so a day-long bomb of tiny groups cannot exhaust guest memory.
pub const MAX_SAMPLES: usize = 1 << 20;

/// Latency samples (µs) with nearest-rank percentiles.
#[derive(Debug, Clone)]
pub struct Samples {
    kept: Vec<u32>,
    seen: u64,
    rng: u64,
    capacity: usize,
}

impl Default for Samples {
    fn default() -> Self {
        Self::with_capacity(MAX_SAMPLES)
    }
}

impl Samples {
    /// Keeps at most `capacity` samples (at least one).
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            kept: Vec::new(),
            seen: 0,
            rng: 0x9e37_79b9_7f4a_7c15,
            capacity: capacity.max(1),
        }
    }

    /// Records one sample (µs, saturated to u32: 71 minutes).
    pub fn push(&mut self, us: u64) {
        let us = u32::try_from(us).unwrap_or(u32::MAX);
        self.seen = self.seen.saturating_add(1);
        if self.kept.len() < self.capacity {
            self.kept.push(us);
            return;
        }
        // Algorithm R: the n-th sample replaces a random kept one with probability capacity/n.
        let slot = self.next_random() % self.seen;
        if let Some(kept) = usize::try_from(slot)
            .ok()
            .and_then(|i| self.kept.get_mut(i))
        {
            *kept = us;
        }
    }

    /// How many samples were pushed.
    pub fn count(&self) -> u64 {
        self.seen
    }

    /// The nearest-rank percentile (`per_cent` in 1..=100) of the kept samples, µs.
    pub fn percentile(&self, per_cent: u8) -> Option<u64> {
        if self.kept.is_empty() || !(1..=100).contains(&per_cent) {
            return None;
        }
        let mut sorted = self.kept.clone();
        sorted.sort_unstable();
        let n = sorted.len();
        // rank = ceil(p/100 * n), in 1..=n.
        let rank = (u128::from(per_cent) * n as u128).div_ceil(100);
        let index = usize::try_from(rank).map_or(n, |r| r.clamp(1, n)) - 1;
        sorted.get(index).map(|&v| u64::from(v))
    }

    /// splitmix64: a deterministic generator is enough for reservoir sampling.
    fn next_random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// One group's JSON line: `t_us` is when its fence signalled, µs since the run started.
pub fn group_line(t_us: u64, latency_us: u64) -> String {
    format!(r#"{{"t_us":{t_us},"kind":"group","latency_us":{latency_us}}}"#)
}

/// One frame's JSON line: `frame_ms` is the time since the previous frame's present (or since
/// the run started, for the first frame).
pub fn frame_line(t_us: u64, frame_us: u64) -> String {
    format!(
        r#"{{"t_us":{t_us},"kind":"frame","frame_ms":{}}}"#,
        millis(frame_us)
    )
}

/// µs as milliseconds with three decimals, exactly (no float rounding).
fn millis(us: u64) -> String {
    format!("{}.{:03}", us / 1000, us % 1000)
}

/// What a run did, for its last line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The mode's name.
    pub mode: &'static str,
    /// Wall time from the first submit to the last fence, µs.
    pub elapsed_us: u64,
    /// Groups completed.
    pub groups: u64,
    /// Frames presented.
    pub frames: u64,
    /// Median group latency, µs.
    pub p50_us: Option<u64>,
    /// 99th percentile group latency, µs.
    pub p99_us: Option<u64>,
    /// Periodic releases skipped because the previous group was late.
    pub missed_periods: u64,
    /// The informational frame-rate target.
    pub fps_target: Option<u32>,
}

impl Summary {
    /// Frames per second over the run, with two decimals.
    fn fps(&self) -> String {
        if self.elapsed_us == 0 {
            return "0.00".to_owned();
        }
        // centi-fps = frames * 1e8 / elapsed_us, in u128 so no frame count can overflow it.
        let centi = u128::from(self.frames) * 100_000_000 / u128::from(self.elapsed_us);
        format!("{}.{:02}", centi / 100, centi % 100)
    }

    /// The summary as one JSON line.
    pub fn json(&self) -> String {
        let opt = |v: Option<u64>| v.map_or_else(|| "null".to_owned(), |v| v.to_string());
        let mut line = format!(
            r#"{{"kind":"summary","mode":"{}","elapsed_s":{},"groups":{},"frames":{},"fps":{},"latency_p50_us":{},"latency_p99_us":{}"#,
            self.mode,
            millis(self.elapsed_us / 1000),
            self.groups,
            self.frames,
            self.fps(),
            opt(self.p50_us),
            opt(self.p99_us),
        );
        if self.mode == "periodic" {
            let _ = write!(line, r#","missed_periods":{}"#, self.missed_periods);
        }
        if let Some(target) = self.fps_target {
            let _ = write!(line, r#","fps_target":{target}"#);
        }
        line.push('}');
        line
    }

    /// The summary as text for a person.
    pub fn text(&self) -> String {
        let opt = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v} us"));
        let mut text = format!(
            "vgpu-load {}: {} groups, {} frames in {} s ({} fps); group latency p50 {}, p99 {}",
            self.mode,
            self.groups,
            self.frames,
            millis(self.elapsed_us / 1000),
            self.fps(),
            opt(self.p50_us),
            opt(self.p99_us),
        );
        if self.mode == "periodic" {
            let _ = write!(text, "; {} missed periods", self.missed_periods);
        }
        if let Some(target) = self.fps_target {
            let _ = write!(text, "; fps target {target}");
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut s = Samples::default();
        assert_eq!(s.percentile(50), None);
        for v in (1..=100).rev() {
            s.push(v);
        }
        assert_eq!(s.count(), 100);
        assert_eq!(s.percentile(50), Some(50));
        assert_eq!(s.percentile(99), Some(99));
        assert_eq!(s.percentile(100), Some(100));
        assert_eq!(s.percentile(1), Some(1));
        assert_eq!(s.percentile(0), None);
        assert_eq!(s.percentile(101), None);
        let mut one = Samples::default();
        one.push(7);
        assert_eq!((one.percentile(1), one.percentile(99)), (Some(7), Some(7)));
    }

    #[test]
    fn saturates_huge_samples() {
        let mut s = Samples::default();
        s.push(u64::MAX);
        assert_eq!(s.percentile(50), Some(u64::from(u32::MAX)));
    }

    #[test]
    fn reservoir_stays_bounded_and_representative() {
        let mut s = Samples::with_capacity(1000);
        for v in 0..100_000u64 {
            s.push(v % 100);
        }
        assert_eq!(s.count(), 100_000);
        assert_eq!(s.kept.len(), 1000);
        let p50 = s.percentile(50).unwrap();
        assert!((40..=60).contains(&p50), "p50 {p50}");
        let mut z = Samples::with_capacity(0);
        z.push(1);
        z.push(2);
        assert_eq!(z.kept.len(), 1);
    }

    #[test]
    fn json_lines() {
        assert_eq!(
            group_line(1500, 1200),
            r#"{"t_us":1500,"kind":"group","latency_us":1200}"#
        );
        assert_eq!(
            frame_line(16_700, 16_667),
            r#"{"t_us":16700,"kind":"frame","frame_ms":16.667}"#
        );
        assert_eq!(
            frame_line(0, 5),
            r#"{"t_us":0,"kind":"frame","frame_ms":0.005}"#
        );
    }

    #[test]
    fn summary_lines() {
        let mut s = Summary {
            mode: "frames",
            elapsed_us: 2_000_000,
            groups: 360,
            frames: 120,
            p50_us: Some(2100),
            p99_us: Some(4000),
            missed_periods: 0,
            fps_target: Some(60),
        };
        assert_eq!(
            s.json(),
            r#"{"kind":"summary","mode":"frames","elapsed_s":2.000,"groups":360,"frames":120,"fps":60.00,"latency_p50_us":2100,"latency_p99_us":4000,"fps_target":60}"#
        );
        assert!(s.text().contains("120 frames in 2.000 s (60.00 fps)"));
        s.mode = "periodic";
        s.fps_target = None;
        s.frames = 0;
        s.missed_periods = 3;
        s.p50_us = None;
        s.p99_us = None;
        assert_eq!(
            s.json(),
            r#"{"kind":"summary","mode":"periodic","elapsed_s":2.000,"groups":360,"frames":0,"fps":0.00,"latency_p50_us":null,"latency_p99_us":null,"missed_periods":3}"#
        );
        assert!(s.text().ends_with("p99 -; 3 missed periods"));
        s.elapsed_us = 0;
        s.frames = u64::MAX;
        assert!(s.json().contains(r#""fps":0.00"#));
        s.elapsed_us = 1;
        assert!(s.json().contains(r#""fps":"#));
    }
}
