//! Opens a load context on the render node and runs a workload on it: submits, fences, timing and
//! the lines printed for each group and frame.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::args::{Config, MAX_DURATION_S, Mode};
use crate::stats::{Samples, Summary, frame_line, group_line};
use crate::wire::{
    self, CAPSET_BLOB_LEN, CapsetInfo, Command, LOAD_CAPSET_ID, LOAD_CAPSET_VERSION, WireError,
};
use vgpu_guest_drivers::virtgpu::{
    self, CONTEXT_PARAM_CAPSET_ID, CONTEXT_PARAM_NUM_RINGS, DrmError, PARAM_CONTEXT_INIT,
    PARAM_SUPPORTED_CAPSET_IDS, RenderNode,
};

/// Longest wait for any fence in flight to signal. A group is at most 1 s and at most 64 are in
/// flight, but other VMs share the GPU and the scheduler may suspend this one; two minutes
/// without progress means the device or the scheduler is stuck, not busy.
pub const FENCE_TIMEOUT: Duration = Duration::from_secs(120);

/// Errors of a run.
#[derive(Debug, Error)]
pub enum RunError {
    /// A render-node operation failed.
    #[error(transparent)]
    Drm(#[from] DrmError),
    /// The device does not list the load capset.
    #[error(
        "capset {LOAD_CAPSET_ID} not offered by the virtio-gpu device (it offers capsets {0:?})"
    )]
    CapsetMissing(Vec<u32>),
    /// The device lists the capset but does not offer VIRTIO_GPU_F_CONTEXT_INIT.
    #[error("the virtio-gpu device does not offer context init (VIRTIO_GPU_F_CONTEXT_INIT)")]
    NoContextInit,
    /// The capset blob or a submit does not fit the protocol.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// No fence signalled within `FENCE_TIMEOUT`.
    #[error("no fence signalled within {} s ({} in flight)", .0.as_secs(), .1)]
    FenceTimeout(Duration, usize),
    /// A time computation left the clock's range.
    #[error("time out of range")]
    Clock,
    /// Writing the report failed.
    #[error("writing the report: {0}")]
    Output(io::Error),
}

/// A render node with a load context on it.
#[derive(Debug)]
pub struct LoadContext {
    node: RenderNode,
    limits: CapsetInfo,
}

/// The capset ids set in a SUPPORTED_CAPSET_IDs mask.
fn capset_ids(mask: u32) -> Vec<u32> {
    (0..u32::BITS)
        .filter(|bit| mask & (1 << bit) != 0)
        .collect()
}

impl LoadContext {
    /// Checks that the device offers the load capset and context init, reads the capset and
    /// creates the context (capset 20, one ring).
    pub fn open(path: &Path) -> Result<Self, RunError> {
        let node = RenderNode::open(path)?;
        let mask = node.get_param(PARAM_SUPPORTED_CAPSET_IDS)?;
        if mask & (1 << LOAD_CAPSET_ID) == 0 {
            return Err(RunError::CapsetMissing(capset_ids(mask)));
        }
        if node.get_param(PARAM_CONTEXT_INIT)? != 1 {
            return Err(RunError::NoContextInit);
        }
        let mut blob = [0u8; CAPSET_BLOB_LEN];
        node.get_caps(LOAD_CAPSET_ID, LOAD_CAPSET_VERSION, &mut blob)?;
        let limits = CapsetInfo::parse(&blob)?;
        node.context_init(&[
            (CONTEXT_PARAM_CAPSET_ID, u64::from(LOAD_CAPSET_ID)),
            (CONTEXT_PARAM_NUM_RINGS, 1),
        ])?;
        Ok(Self { node, limits })
    }

    /// What the device allows.
    pub fn limits(&self) -> CapsetInfo {
        self.limits
    }
}

/// A submit whose fence has not signalled yet.
#[derive(Debug)]
struct Pending {
    fence: OwnedFd,
    submitted: Instant,
    frame: bool,
}

/// One run's state.
struct Runner<'a, W: Write> {
    ctx: &'a LoadContext,
    out: W,
    json: bool,
    start: Instant,
    pending: VecDeque<Pending>,
    latencies: Samples,
    frames: u64,
    last_frame: Instant,
    missed_periods: u64,
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn later(t: Instant, d: Duration) -> Result<Instant, RunError> {
    t.checked_add(d).ok_or(RunError::Clock)
}

/// Keeps a CPU busy for `d` (a frame's game logic).
fn spin(d: Duration) -> Result<(), RunError> {
    let until = later(Instant::now(), d)?;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
    Ok(())
}

impl<W: Write> Runner<'_, W> {
    fn submit(&mut self, command: Command) -> Result<(), RunError> {
        let bytes = wire::encode(&[command], &self.ctx.limits)?;
        let submitted = Instant::now();
        let fence = self.ctx.node.execbuffer(&bytes)?;
        self.pending.push_back(Pending {
            fence,
            submitted,
            frame: command == Command::EndFrame,
        });
        Ok(())
    }

    /// Waits until at least one fence in flight signals and records every one that has.
    fn reap(&mut self) -> Result<(), RunError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let ready = {
            let fds: Vec<_> = self.pending.iter().map(|p| p.fence.as_fd()).collect();
            virtgpu::poll_fences(&fds, FENCE_TIMEOUT)?
        };
        let at = Instant::now();
        if !ready.contains(&true) {
            return Err(RunError::FenceTimeout(FENCE_TIMEOUT, self.pending.len()));
        }
        let pending = std::mem::take(&mut self.pending);
        for (p, done) in pending.into_iter().zip(ready) {
            if done {
                self.record(&p, at)?;
            } else {
                self.pending.push_back(p);
            }
        }
        Ok(())
    }

    fn drain(&mut self) -> Result<(), RunError> {
        while !self.pending.is_empty() {
            self.reap()?;
        }
        Ok(())
    }

    fn record(&mut self, p: &Pending, at: Instant) -> Result<(), RunError> {
        let t_us = micros(at.saturating_duration_since(self.start));
        let line = if p.frame {
            self.frames = self.frames.saturating_add(1);
            let frame_us = micros(at.saturating_duration_since(self.last_frame));
            self.last_frame = at;
            frame_line(t_us, frame_us)
        } else {
            let latency_us = micros(at.saturating_duration_since(p.submitted));
            self.latencies.push(latency_us);
            group_line(t_us, latency_us)
        };
        if self.json {
            writeln!(self.out, "{line}").map_err(RunError::Output)?;
        }
        Ok(())
    }

    fn workload(&mut self, mode: Mode, until: &Until) -> Result<(), RunError> {
        match mode {
            Mode::Throttle {
                kernel_us,
                sleep_us,
            } => {
                while !until.reached(Instant::now()) {
                    self.submit(Command::Occupy(kernel_us))?;
                    self.drain()?;
                    std::thread::sleep(Duration::from_micros(sleep_us));
                }
            }
            Mode::Bomb { cost_us, depth } => {
                let depth = usize::try_from(depth).unwrap_or(usize::MAX);
                while !until.reached(Instant::now()) {
                    while self.pending.len() < depth {
                        self.submit(Command::Occupy(cost_us))?;
                    }
                    self.reap()?;
                }
            }
            Mode::Periodic { cost_us, period_us } => {
                let period = Duration::from_micros(period_us);
                let mut release = self.start;
                while !until.reached(release) {
                    std::thread::sleep(release.saturating_duration_since(Instant::now()));
                    self.submit(Command::Occupy(cost_us))?;
                    self.drain()?;
                    release = later(release, period)?;
                    // A group that ran past later releases skips them (counted), keeping phase.
                    let behind = Instant::now().saturating_duration_since(release);
                    if !behind.is_zero() {
                        let skipped = behind.as_micros() / u128::from(period_us) + 1;
                        let skipped = u32::try_from(skipped).map_err(|_| RunError::Clock)?;
                        let skip = period.checked_mul(skipped).ok_or(RunError::Clock)?;
                        release = later(release, skip)?;
                        self.missed_periods = self.missed_periods.saturating_add(skipped.into());
                    }
                }
            }
            Mode::Frames {
                groups,
                cost_us,
                cpu_us,
                ..
            } => {
                while !until.reached(Instant::now()) {
                    spin(Duration::from_micros(cpu_us))?;
                    for _ in 0..groups {
                        self.submit(Command::Occupy(cost_us))?;
                    }
                    self.submit(Command::EndFrame)?;
                    self.drain()?;
                }
            }
        }
        self.drain()
    }
}

/// When a workload ends: at a deadline, or earlier once `stopped` is raised.
pub struct Until<'a> {
    pub deadline: Instant,
    pub stopped: &'a AtomicBool,
}

impl Until<'_> {
    /// Whether the workload is over at `t` (a release time, or now).
    fn reached(&self, t: Instant) -> bool {
        t >= self.deadline || self.stopped.load(Ordering::Relaxed)
    }
}

/// Runs the configured workload on `ctx`, printing to `out`, until its duration is over or
/// `stopped` is raised (with `--until-stopped`: only then, or after [`MAX_DURATION_S`]);
/// returns the summary it printed.
pub fn run<W: Write>(
    ctx: &LoadContext,
    config: &Config,
    out: W,
    stopped: &AtomicBool,
) -> Result<Summary, RunError> {
    // Check the cost against the device's limit before any work is issued.
    wire::encode(&[Command::Occupy(config.mode.cost_us())], &ctx.limits)?;
    let start = Instant::now();
    let duration = if config.until_stopped {
        Duration::from_secs(MAX_DURATION_S)
    } else {
        config.duration
    };
    let until = Until {
        deadline: later(start, duration)?,
        stopped,
    };
    let mut runner = Runner {
        ctx,
        out,
        json: config.json,
        start,
        pending: VecDeque::new(),
        latencies: Samples::default(),
        frames: 0,
        last_frame: start,
        missed_periods: 0,
    };
    runner.workload(config.mode, &until)?;
    let summary = Summary {
        mode: config.mode.name(),
        elapsed_us: micros(start.elapsed()),
        groups: runner.latencies.count(),
        frames: runner.frames,
        p50_us: runner.latencies.percentile(50),
        p99_us: runner.latencies.percentile(99),
        missed_periods: runner.missed_periods,
        fps_target: match config.mode {
            Mode::Frames { fps_target, .. } => fps_target,
            _ => None,
        },
    };
    let line = if config.json {
        summary.json()
    } else {
        summary.text()
    };
    writeln!(runner.out, "{line}").map_err(RunError::Output)?;
    runner.out.flush().map_err(RunError::Output)?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workload_ends_at_its_deadline_or_once_stopped() {
        let stopped = AtomicBool::new(false);
        let now = Instant::now();
        let until = Until {
            deadline: now + Duration::from_secs(60),
            stopped: &stopped,
        };
        assert!(!until.reached(now));
        assert!(until.reached(now + Duration::from_secs(60)));
        stopped.store(true, Ordering::Relaxed);
        assert!(until.reached(now), "a stop ends it before its deadline");
    }

    #[test]
    fn capset_ids_from_mask() {
        assert_eq!(capset_ids(0), Vec::<u32>::new());
        assert_eq!(capset_ids(0b110), vec![1, 2]);
        assert_eq!(capset_ids(1 << 20 | 1 << 31), vec![20, 31]);
    }

    #[test]
    fn missing_render_node_is_reported() {
        let err = LoadContext::open(Path::new("/nonexistent/renderD128")).unwrap_err();
        assert!(err.to_string().contains("cannot open render node"), "{err}");
    }

    #[test]
    fn a_non_virtgpu_node_is_an_ioctl_error() {
        let err = LoadContext::open(Path::new("/dev/null")).unwrap_err();
        assert!(
            err.to_string()
                .contains("DRM_IOCTL_VIRTGPU_GETPARAM failed"),
            "{err}"
        );
    }

    #[test]
    fn error_texts() {
        assert_eq!(
            RunError::CapsetMissing(vec![1, 2]).to_string(),
            "capset 20 not offered by the virtio-gpu device (it offers capsets [1, 2])"
        );
        assert_eq!(
            RunError::FenceTimeout(FENCE_TIMEOUT, 3).to_string(),
            "no fence signalled within 120 s (3 in flight)"
        );
    }

    #[test]
    fn spin_waits_at_least_its_time() {
        let t = Instant::now();
        spin(Duration::from_millis(2)).unwrap();
        assert!(t.elapsed() >= Duration::from_millis(2));
        assert!(matches!(
            later(Instant::now(), Duration::MAX),
            Err(RunError::Clock)
        ));
    }
}
