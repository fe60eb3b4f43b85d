//! The command line: `MODE [options]`, parsed with clap (through `vgpu_cli`, so `--version`,
//! `--completions SHELL` and `--man` come with it), every value range-checked with the limits
//! below.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use thiserror::Error;

use crate::wire::MAX_OCCUPY_US;

const ABOUT: &str = "Generates GPU load in the guest and measures each command group's latency";

const LONG_ABOUT: &str = "Generates GPU load through the vgpu load capset (virtio-gpu capset \
20) with the standard DRM virtgpu ioctls, and measures each command group's latency (submit -> \
fence signalled).";

const AFTER_HELP: &str = "With --json, stdout gets JSON lines: one per group \
{\"t_us\",\"kind\":\"group\",\"latency_us\"}, one per frame {\"t_us\",\"kind\":\"frame\",\"frame_ms\"}, \
then a summary line. Group costs are 1..=1000000 us. Exit codes: 0 done, 2 usage or device error.";

/// Longest run (one day): keeps every time computation far from overflow.
pub const MAX_DURATION_S: u64 = 86_400;
/// Most groups kept in flight by `bomb`: each holds a fence and a file descriptor, and the device
/// parks at most a few hundred fenced requests.
pub const MAX_DEPTH: u64 = 64;
/// Most groups per frame (each is its own submit with its own fence fd).
pub const MAX_GROUPS_PER_FRAME: u64 = 63;
/// Longest sleep, period or CPU burst (10 s): longer is a misconfiguration, not a load.
pub const MAX_WAIT_US: u64 = 10_000_000;
/// Highest informational frame-rate target.
pub const MAX_FPS_TARGET: u64 = 1_000;

/// A value refused by the command line.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ArgError {
    /// Not a decimal integer in range.
    #[error("{value:?} is not an integer in {min}..={max}")]
    Range {
        /// What was given.
        value: String,
        /// Smallest accepted value.
        min: u64,
        /// Largest accepted value.
        max: u64,
    },
}

/// A validated run configuration: the command line.
#[derive(Debug, Clone, PartialEq, Eq, Parser)]
#[command(
    name = "vgpu-load",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP
)]
pub struct Config {
    /// The workload.
    #[command(subcommand)]
    pub mode: Mode,
    /// Run for S seconds, then wait for the work in flight
    #[arg(
        long = "duration-s",
        value_name = "S",
        global = true,
        default_value = "10",
        value_parser = seconds
    )]
    pub duration: Duration,
    /// Run until stdin reaches its end (the control agent's STOP closes it) instead of for
    /// --duration-s, then wait for the work in flight; at most a day
    #[arg(long, global = true)]
    pub until_stopped: bool,
    /// JSON lines on stdout instead of a text summary
    #[arg(long, global = true)]
    pub json: bool,
    /// The render node
    #[arg(
        long,
        value_name = "PATH",
        global = true,
        default_value = "/dev/dri/renderD128"
    )]
    pub device: PathBuf,
}

/// The workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Subcommand)]
pub enum Mode {
    /// One N us group, wait for it, sleep M us, repeat
    Throttle {
        /// Group cost, µs
        #[arg(long, value_name = "N", value_parser = number::<u64, 1, MAX_OCCUPY_US>)]
        kernel_us: u64,
        /// Sleep after each group, µs
        #[arg(long, value_name = "M", value_parser = number::<u64, 0, MAX_WAIT_US>)]
        sleep_us: u64,
    },
    /// Keep D groups of N us in flight
    Bomb {
        /// Group cost, µs
        #[arg(long, value_name = "N", value_parser = number::<u64, 1, MAX_OCCUPY_US>)]
        cost_us: u64,
        /// Groups in flight
        #[arg(long, value_name = "D", default_value_t = 4, value_parser = number::<u32, 1, MAX_DEPTH>)]
        depth: u32,
    },
    /// Release one N us group every P us (a late release skips the missed periods)
    Periodic {
        /// Group cost, µs
        #[arg(long, value_name = "N", value_parser = number::<u64, 1, MAX_OCCUPY_US>)]
        cost_us: u64,
        /// Release period, µs
        #[arg(long, value_name = "P", value_parser = number::<u64, 1, MAX_WAIT_US>)]
        period_us: u64,
    },
    /// Per frame: C us of CPU work, G groups of N us, END_FRAME; waits for the frame's fences
    /// (the END_FRAME fence is the paced present)
    Frames {
        /// Groups per frame
        #[arg(long, value_name = "G", value_parser = number::<u32, 1, MAX_GROUPS_PER_FRAME>)]
        groups: u32,
        /// Group cost, µs
        #[arg(long, value_name = "N", value_parser = number::<u64, 1, MAX_OCCUPY_US>)]
        cost_us: u64,
        /// CPU busy time per frame, µs
        #[arg(long, value_name = "C", default_value_t = 0, value_parser = number::<u64, 0, MAX_WAIT_US>)]
        cpu_us: u64,
        /// The frame rate the guest hopes for (reported only)
        #[arg(long, value_name = "F", value_parser = number::<u32, 1, MAX_FPS_TARGET>)]
        fps_target: Option<u32>,
    },
}

impl Mode {
    /// The mode's name as typed on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Throttle { .. } => "throttle",
            Mode::Bomb { .. } => "bomb",
            Mode::Periodic { .. } => "periodic",
            Mode::Frames { .. } => "frames",
        }
    }

    /// The largest group cost this workload submits, µs.
    pub fn cost_us(&self) -> u64 {
        match *self {
            Mode::Throttle { kernel_us, .. } => kernel_us,
            Mode::Bomb { cost_us, .. }
            | Mode::Periodic { cost_us, .. }
            | Mode::Frames { cost_us, .. } => cost_us,
        }
    }
}

/// A decimal integer in `MIN..=MAX` (digits only: no sign, no unit, no blank).
fn number<T: TryFrom<u64>, const MIN: u64, const MAX: u64>(value: &str) -> Result<T, ArgError> {
    let range = || ArgError::Range {
        value: value.to_owned(),
        min: MIN,
        max: MAX,
    };
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(range());
    }
    let n: u64 = value.parse().map_err(|_| range())?;
    if !(MIN..=MAX).contains(&n) {
        return Err(range());
    }
    T::try_from(n).map_err(|_| range())
}

/// `--duration-s`: 1..=[`MAX_DURATION_S`] seconds.
fn seconds(value: &str) -> Result<Duration, ArgError> {
    number::<u64, 1, MAX_DURATION_S>(value).map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    fn parse_str(line: &str) -> Result<Config, clap::Error> {
        vgpu_cli::check::arguments(line.split_whitespace())
    }

    fn config(line: &str) -> Config {
        parse_str(line).unwrap_or_else(|e| panic!("{line}: {e}"))
    }

    fn refused(line: &str) -> ErrorKind {
        match parse_str(line) {
            Err(e) => e.kind(),
            other => panic!("{line}: accepted: {other:?}"),
        }
    }

    #[test]
    fn parses_every_mode() {
        let c = config("throttle --kernel-us 500 --sleep-us 0");
        assert_eq!(
            c.mode,
            Mode::Throttle {
                kernel_us: 500,
                sleep_us: 0
            }
        );
        assert_eq!(c.duration, Duration::from_secs(10));
        assert!(!c.json);
        assert_eq!(c.device, PathBuf::from("/dev/dri/renderD128"));
        let c = config("bomb --cost-us 1000 --json --duration-s 3");
        assert_eq!(
            c.mode,
            Mode::Bomb {
                cost_us: 1000,
                depth: 4
            }
        );
        assert!(c.json && !c.until_stopped);
        assert_eq!(c.duration, Duration::from_secs(3));
        assert!(config("--until-stopped frames --groups 2 --cost-us 9").until_stopped);
        assert_eq!(
            config("bomb --depth=64 --cost-us=1000000").mode,
            Mode::Bomb {
                cost_us: 1_000_000,
                depth: 64
            }
        );
        assert_eq!(
            config("periodic --period-us 16666 --cost-us 2000").mode,
            Mode::Periodic {
                cost_us: 2000,
                period_us: 16666
            }
        );
        let c = config("frames --groups 3 --cost-us 2000 --cpu-us 500 --fps-target 60 --device /x");
        assert_eq!(
            c.mode,
            Mode::Frames {
                groups: 3,
                cost_us: 2000,
                cpu_us: 500,
                fps_target: Some(60)
            }
        );
        assert_eq!(c.device, PathBuf::from("/x"));
        assert_eq!(
            config("frames --groups 63 --cost-us 1").mode,
            Mode::Frames {
                groups: 63,
                cost_us: 1,
                cpu_us: 0,
                fps_target: None
            }
        );
        // The common options may also come before the mode.
        let c = config("--json --duration-s=5 bomb --cost-us 9");
        assert!(c.json && c.duration == Duration::from_secs(5));
    }

    #[test]
    fn help_version_completions_and_man() {
        for line in ["--help", "-h", "bomb --cost-us 5 --help"] {
            assert_eq!(refused(line), ErrorKind::DisplayHelp, "{line}");
        }
        vgpu_cli::check::conventions::<Config>(env!("CARGO_PKG_VERSION")).unwrap();
    }

    #[test]
    fn rejects_bad_modes_and_options() {
        assert_eq!(
            refused(""),
            ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
        );
        assert_eq!(refused("spin"), ErrorKind::InvalidSubcommand);
        assert_eq!(
            refused("bomb --cost-us 5 --period-us 5"),
            ErrorKind::UnknownArgument
        );
        assert_eq!(
            refused("bomb --cost-us 5 extra"),
            ErrorKind::UnknownArgument
        );
        assert_eq!(
            refused("bomb --cost-us 5 --json=1"),
            ErrorKind::TooManyValues
        );
        assert_eq!(refused("bomb --cost-us"), ErrorKind::InvalidValue);
        assert_eq!(
            refused("bomb --cost-us 5 --device="),
            ErrorKind::InvalidValue
        );
        for line in [
            "bomb --cost-us 5 --cost-us 6",
            "bomb --cost-us 5 --duration-s 1 --duration-s 2",
            "bomb --cost-us 5 --device a --device b",
        ] {
            assert_eq!(refused(line), ErrorKind::ArgumentConflict, "{line}");
        }
        for line in ["bomb", "throttle --kernel-us 5", "frames --cost-us 5"] {
            assert_eq!(refused(line), ErrorKind::MissingRequiredArgument, "{line}");
        }
    }

    #[test]
    fn rejects_values_out_of_range() {
        for line in [
            "bomb --cost-us 0",
            "bomb --cost-us 1000001",
            "bomb --cost-us +5",
            "bomb --cost-us 5us",
            "bomb --cost-us 99999999999999999999999",
            "bomb --cost-us 5 --depth 0",
            "bomb --cost-us 5 --depth 65",
            "periodic --cost-us 5 --period-us 0",
            "periodic --cost-us 5 --period-us 10000001",
            "throttle --kernel-us 5 --sleep-us 10000001",
            "frames --groups 64 --cost-us 5",
            "frames --groups 0 --cost-us 5",
            "frames --groups 1 --cost-us 5 --fps-target 0",
            "frames --groups 1 --cost-us 5 --cpu-us 10000001",
            "bomb --cost-us 5 --duration-s 0",
            "bomb --cost-us 5 --duration-s 86401",
            "bomb --cost-us=",
        ] {
            assert_eq!(refused(line), ErrorKind::ValueValidation, "{line}");
        }
        // A negative number is not taken for an option, and not accepted either.
        assert_ne!(
            parse_str("bomb --cost-us -5")
                .map(|_| ())
                .map_err(|e| e.kind()),
            Ok(())
        );
        assert_eq!(
            number::<u32, 1, 64>("7"),
            Ok(7),
            "the limits' own parser accepts what is in range"
        );
    }

    #[test]
    fn mode_names_and_costs() {
        let m = config("throttle --kernel-us 7 --sleep-us 1").mode;
        assert_eq!((m.name(), m.cost_us()), ("throttle", 7));
        let m = config("frames --groups 2 --cost-us 9").mode;
        assert_eq!((m.name(), m.cost_us()), ("frames", 9));
    }
}
