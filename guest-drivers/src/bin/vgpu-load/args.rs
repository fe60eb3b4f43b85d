//! Command-line parsing (by hand: `MODE --option value ...`), with every value range-checked.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use crate::wire::MAX_OCCUPY_US;

/// The usage text printed by `--help`.
pub const USAGE: &str = "usage: vgpu-load MODE [options] [--duration-s S] [--json] [--device PATH]

Generates GPU load through the vgpu load capset (virtio-gpu capset 20) with the standard DRM
virtgpu ioctls, and measures each command group's latency (submit -> fence signalled).

modes:
  throttle --kernel-us N --sleep-us M
        one N us group, wait for it, sleep M us, repeat
  bomb --cost-us N [--depth D]
        keep D groups of N us in flight (default depth 4, at most 64)
  periodic --cost-us N --period-us P
        release one N us group every P us (a late release skips the missed periods)
  frames --groups G --cost-us N [--cpu-us C] [--fps-target F]
        per frame: C us of CPU work, G groups of N us, END_FRAME; waits for the frame's fences
        (the END_FRAME fence is the paced present); F is only reported

options:
  --duration-s S   run for S seconds, then wait for the work in flight (default 10)
  --json           JSON lines on stdout: one per group {\"t_us\",\"kind\":\"group\",\"latency_us\"},
                   one per frame {\"t_us\",\"kind\":\"frame\",\"frame_ms\"}, then a summary line
  --device PATH    the render node (default /dev/dri/renderD128)
  -h, --help       this text

Group costs are 1..=1000000 us. Exit codes: 0 done, 2 usage or device error.";

/// Longest run (one day): keeps every time computation far from overflow.
pub const MAX_DURATION_S: u64 = 86_400;
/// Most groups kept in flight by `bomb`: each holds a fence and a file descriptor, and the device
/// parks at most a few hundred fenced requests.
pub const MAX_DEPTH: u32 = 64;
/// Most groups per frame (each is its own submit with its own fence fd).
pub const MAX_GROUPS_PER_FRAME: u32 = 63;
/// Longest sleep, period or CPU burst (10 s): longer is a misconfiguration, not a load.
pub const MAX_WAIT_US: u64 = 10_000_000;
/// Highest informational frame-rate target.
pub const MAX_FPS_TARGET: u32 = 1_000;

const DEFAULT_DURATION_S: u64 = 10;
const DEFAULT_DEPTH: u32 = 4;
const DEFAULT_DEVICE: &str = "/dev/dri/renderD128";

/// Argument errors.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ArgError {
    /// No mode given.
    #[error("no mode given (throttle, bomb, periodic or frames)")]
    NoMode,
    /// An unknown mode.
    #[error("unknown mode {0:?}")]
    UnknownMode(String),
    /// An option this mode does not take.
    #[error("unknown option {0:?} for this mode")]
    UnknownOption(String),
    /// An option given twice.
    #[error("{0} given twice")]
    Repeated(&'static str),
    /// An option without its value.
    #[error("{0} needs a value")]
    MissingValue(&'static str),
    /// A required option left out.
    #[error("{0} is required for this mode")]
    Required(&'static str),
    /// A value that is not a decimal integer in range.
    #[error("{name}: {value:?} is not an integer in {min}..={max}")]
    Range {
        /// The option.
        name: &'static str,
        /// What was given.
        value: String,
        /// Smallest accepted value.
        min: u64,
        /// Largest accepted value.
        max: u64,
    },
}

/// The workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One group, wait, sleep, repeat.
    Throttle {
        /// Group cost, µs.
        kernel_us: u64,
        /// Sleep after each group, µs.
        sleep_us: u64,
    },
    /// `depth` groups always in flight.
    Bomb {
        /// Group cost, µs.
        cost_us: u64,
        /// Groups in flight.
        depth: u32,
    },
    /// One group per period.
    Periodic {
        /// Group cost, µs.
        cost_us: u64,
        /// Release period, µs.
        period_us: u64,
    },
    /// A frame loop: CPU work, groups, END_FRAME, wait.
    Frames {
        /// Groups per frame.
        groups: u32,
        /// Group cost, µs.
        cost_us: u64,
        /// CPU busy time per frame, µs.
        cpu_us: u64,
        /// The frame rate the guest hopes for (reported only).
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

/// A validated run configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The workload.
    pub mode: Mode,
    /// How long to issue work.
    pub duration: Duration,
    /// JSON lines instead of a text summary.
    pub json: bool,
    /// The render node.
    pub device: PathBuf,
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// Print the usage and exit 0.
    Help,
    /// Run a workload.
    Run(Config),
}

/// A numeric option: its name, smallest and largest value.
type OptionSpec = (&'static str, u64, u64);

/// Each mode's own numeric options (every mode also takes --duration-s, --json, --device).
const MODE_OPTIONS: [(&str, &[OptionSpec]); 4] = [
    (
        "throttle",
        &[
            ("--kernel-us", 1, MAX_OCCUPY_US),
            ("--sleep-us", 0, MAX_WAIT_US),
        ],
    ),
    (
        "bomb",
        &[
            ("--cost-us", 1, MAX_OCCUPY_US),
            ("--depth", 1, MAX_DEPTH as u64),
        ],
    ),
    (
        "periodic",
        &[
            ("--cost-us", 1, MAX_OCCUPY_US),
            ("--period-us", 1, MAX_WAIT_US),
        ],
    ),
    (
        "frames",
        &[
            ("--groups", 1, MAX_GROUPS_PER_FRAME as u64),
            ("--cost-us", 1, MAX_OCCUPY_US),
            ("--cpu-us", 0, MAX_WAIT_US),
            ("--fps-target", 1, MAX_FPS_TARGET as u64),
        ],
    ),
];

/// The numeric options seen so far, in the order of the mode's table.
struct Values {
    names: &'static [OptionSpec],
    values: Vec<Option<u64>>,
}

impl Values {
    fn get(&self, name: &'static str) -> Option<u64> {
        let i = self.names.iter().position(|(n, ..)| *n == name)?;
        self.values.get(i).copied().flatten()
    }

    fn required(&self, name: &'static str) -> Result<u64, ArgError> {
        self.get(name).ok_or(ArgError::Required(name))
    }
}

fn number(name: &'static str, value: &str, min: u64, max: u64) -> Result<u64, ArgError> {
    let range = || ArgError::Range {
        name,
        value: value.to_owned(),
        min,
        max,
    };
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(range());
    }
    let n: u64 = value.parse().map_err(|_| range())?;
    if (min..=max).contains(&n) {
        Ok(n)
    } else {
        Err(range())
    }
}

fn to_u32(value: u64) -> u32 {
    // Every u32 option's table maximum is a u32; saturate rather than panic regardless.
    u32::try_from(value).unwrap_or(u32::MAX)
}

/// Parses the arguments after the program name.
pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Parsed, ArgError> {
    let mut args = args.into_iter();
    let mode = match args.next() {
        None => return Err(ArgError::NoMode),
        Some(a) if a == "-h" || a == "--help" => return Ok(Parsed::Help),
        Some(a) => a,
    };
    let names = MODE_OPTIONS
        .iter()
        .find(|(m, _)| *m == mode)
        .map(|(_, names)| *names)
        .ok_or_else(|| ArgError::UnknownMode(mode.clone()))?;
    let mut values = Values {
        names,
        values: vec![None; names.len()],
    };
    let mut duration_s = None;
    let mut json = false;
    let mut device = None;
    while let Some(arg) = args.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        if key == "-h" || key == "--help" {
            return Ok(Parsed::Help);
        }
        if key == "--json" {
            if inline.is_some() {
                return Err(ArgError::UnknownOption(arg));
            }
            json = true;
            continue;
        }
        let (name, slot, min, max): (&'static str, Option<usize>, u64, u64) =
            if key == "--duration-s" {
                ("--duration-s", None, 1, MAX_DURATION_S)
            } else if key == "--device" {
                ("--device", None, 0, 0)
            } else {
                let i = names
                    .iter()
                    .position(|(n, ..)| *n == key)
                    .ok_or(ArgError::UnknownOption(arg.clone()))?;
                (names[i].0, Some(i), names[i].1, names[i].2)
            };
        let value = match inline {
            Some(v) => v,
            None => args.next().ok_or(ArgError::MissingValue(name))?,
        };
        match slot {
            Some(i) => {
                let entry = values
                    .values
                    .get_mut(i)
                    .ok_or(ArgError::UnknownOption(arg))?;
                if entry.replace(number(name, &value, min, max)?).is_some() {
                    return Err(ArgError::Repeated(name));
                }
            }
            None if name == "--device" => {
                if value.is_empty() {
                    return Err(ArgError::MissingValue(name));
                }
                if device.replace(PathBuf::from(value)).is_some() {
                    return Err(ArgError::Repeated(name));
                }
            }
            None => {
                if duration_s
                    .replace(number(name, &value, min, max)?)
                    .is_some()
                {
                    return Err(ArgError::Repeated(name));
                }
            }
        }
    }
    let mode = match mode.as_str() {
        "throttle" => Mode::Throttle {
            kernel_us: values.required("--kernel-us")?,
            sleep_us: values.required("--sleep-us")?,
        },
        "bomb" => Mode::Bomb {
            cost_us: values.required("--cost-us")?,
            depth: to_u32(values.get("--depth").unwrap_or(u64::from(DEFAULT_DEPTH))),
        },
        "periodic" => Mode::Periodic {
            cost_us: values.required("--cost-us")?,
            period_us: values.required("--period-us")?,
        },
        _ => Mode::Frames {
            groups: to_u32(values.required("--groups")?),
            cost_us: values.required("--cost-us")?,
            cpu_us: values.get("--cpu-us").unwrap_or(0),
            fps_target: values.get("--fps-target").map(to_u32),
        },
    };
    Ok(Parsed::Run(Config {
        mode,
        duration: Duration::from_secs(duration_s.unwrap_or(DEFAULT_DURATION_S)),
        json,
        device: device.unwrap_or_else(|| PathBuf::from(DEFAULT_DEVICE)),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(line: &str) -> Result<Parsed, ArgError> {
        parse(line.split_whitespace().map(str::to_owned))
    }

    fn config(line: &str) -> Config {
        match parse_str(line) {
            Ok(Parsed::Run(c)) => c,
            other => panic!("{line}: {other:?}"),
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
        assert!(c.json);
        assert_eq!(c.duration, Duration::from_secs(3));
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
    }

    #[test]
    fn help_anywhere() {
        assert_eq!(parse_str("--help"), Ok(Parsed::Help));
        assert_eq!(parse_str("-h"), Ok(Parsed::Help));
        assert_eq!(parse_str("bomb --cost-us 5 --help"), Ok(Parsed::Help));
    }

    #[test]
    fn rejects_bad_modes_and_options() {
        assert_eq!(parse_str(""), Err(ArgError::NoMode));
        assert_eq!(parse_str("spin"), Err(ArgError::UnknownMode("spin".into())));
        assert_eq!(
            parse_str("bomb --cost-us 5 --period-us 5"),
            Err(ArgError::UnknownOption("--period-us".into()))
        );
        assert_eq!(
            parse_str("bomb --cost-us 5 extra"),
            Err(ArgError::UnknownOption("extra".into()))
        );
        assert_eq!(
            parse_str("bomb --cost-us 5 --json=1"),
            Err(ArgError::UnknownOption("--json=1".into()))
        );
        assert_eq!(
            parse_str("bomb --cost-us"),
            Err(ArgError::MissingValue("--cost-us"))
        );
        assert_eq!(
            parse_str("bomb --cost-us 5 --device="),
            Err(ArgError::MissingValue("--device"))
        );
        assert_eq!(
            parse_str("bomb --cost-us 5 --cost-us 6"),
            Err(ArgError::Repeated("--cost-us"))
        );
        assert_eq!(
            parse_str("bomb --cost-us 5 --duration-s 1 --duration-s 2"),
            Err(ArgError::Repeated("--duration-s"))
        );
        assert_eq!(
            parse_str("bomb --cost-us 5 --device a --device b"),
            Err(ArgError::Repeated("--device"))
        );
        assert_eq!(parse_str("bomb"), Err(ArgError::Required("--cost-us")));
        assert_eq!(
            parse_str("throttle --kernel-us 5"),
            Err(ArgError::Required("--sleep-us"))
        );
        assert_eq!(
            parse_str("frames --cost-us 5"),
            Err(ArgError::Required("--groups"))
        );
    }

    #[test]
    fn rejects_values_out_of_range() {
        for line in [
            "bomb --cost-us 0",
            "bomb --cost-us 1000001",
            "bomb --cost-us -5",
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
            assert!(
                matches!(parse_str(line), Err(ArgError::Range { .. })),
                "{line}: {:?}",
                parse_str(line)
            );
        }
    }

    #[test]
    fn mode_names_and_costs() {
        let m = config("throttle --kernel-us 7 --sleep-us 1").mode;
        assert_eq!((m.name(), m.cost_us()), ("throttle", 7));
        let m = config("frames --groups 2 --cost-us 9").mode;
        assert_eq!((m.name(), m.cost_us()), ("frames", 9));
    }
}
