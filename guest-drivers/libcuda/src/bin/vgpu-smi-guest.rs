//! `vgpu-smi` in a guest (built as `vgpu-smi-guest`, installed as `/usr/bin/vgpu-smi` by the
//! guest package, `packaging/guest-deb.sh`): the vGPU as the guest's CUDA library sees it,
//! with no host access. The device, the driver and CUDA versions, the VM's GPU memory
//! (`cuMemGetInfo`: its budget and what it can still allocate) and the VM's utilisation of
//! the device over a sampling interval.
//!
//! It links the library's Rust API (the `cuda` rlib), not `libcuda.so.1`: it runs whatever
//! the loader path holds (another vendor's `libcuda.so.1` included) and needs no C shim. It
//! reaches the device as `cuInit` does: the socket named by `VGPU_CUDA_SOCKET` when it is
//! set, else the vGPU's virtio-gpu render node.
//!
//! ```text
//! vgpu-smi [-q | --json] [--interval MS]
//! ```
//! Exit status: 0, 1 when there is no device or it failed to answer, 2 for a usage error.

use std::process::ExitCode;
use std::time::Duration;

use cuda::driver::Driver;
use cuda::smi::{MAX_INTERVAL, Report};

/// The sampling interval without `--interval`.
const DEFAULT_INTERVAL: Duration = Duration::from_millis(500);

const USAGE: &str = "\
Usage: vgpu-smi [-q | --json] [--interval MS]

The vGPU as this guest's CUDA library sees it: device, driver and CUDA versions,
the VM's GPU memory (its budget and what it can still allocate) and the VM's GPU
utilisation over the sampling interval. No host access is needed.

Options:
  -q, --query        every figure, one per line
      --json         the figures as JSON (memory in bytes, utilisation 0 to 1)
      --interval MS  sampling interval for the utilisation (1 to 60000; 500)
  -h, --help         this help
  -V, --version      the version

The device is the vGPU's virtio-gpu render node, or the socket VGPU_CUDA_SOCKET
names. Exit status: 0; 1 no device; 2 usage error.
";

/// How the report is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Table,
    Query,
    Json,
}

/// What the command line asks.
#[derive(Debug, PartialEq, Eq)]
enum Command {
    Report(Format, Duration),
    Help,
    Version,
}

fn parse(args: &[String]) -> Result<Command, String> {
    let mut format = Format::Table;
    let mut interval = DEFAULT_INTERVAL;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let set = |f: Format, current: Format| {
            if current == Format::Table || current == f {
                Ok(f)
            } else {
                Err("-q and --json exclude each other".to_string())
            }
        };
        match a.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "-V" | "--version" => return Ok(Command::Version),
            "-q" | "--query" => format = set(Format::Query, format)?,
            "--json" => format = set(Format::Json, format)?,
            "--interval" => {
                let v = it.next().ok_or("--interval needs a value")?;
                interval = parse_interval(v)?;
            }
            other => match other.strip_prefix("--interval=") {
                Some(v) => interval = parse_interval(v)?,
                None => return Err(format!("unknown argument '{other}'")),
            },
        }
    }
    Ok(Command::Report(format, interval))
}

fn parse_interval(v: &str) -> Result<Duration, String> {
    let max = MAX_INTERVAL.as_millis();
    match v.parse::<u64>() {
        Ok(ms) if (1..=max).contains(&u128::from(ms)) => Ok(Duration::from_millis(ms)),
        _ => Err(format!("--interval {v}: milliseconds from 1 to {max}")),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (format, interval) = match parse(&args) {
        Ok(Command::Report(f, i)) => (f, i),
        Ok(Command::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!("vgpu-smi {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Err(why) => {
            eprintln!("vgpu-smi: {why}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let report = cuda::transport::connect()
        .map_err(|why| format!("no device: {why}"))
        .and_then(|t| Driver::new(t).map_err(|s| format!("no device: CUDA error {s}")))
        .and_then(|mut d| {
            Report::take(&mut d, interval).map_err(|s| format!("the device: CUDA error {s}"))
        });
    let report = match report {
        Ok(r) => r,
        Err(why) => {
            eprintln!("vgpu-smi: {why}");
            return ExitCode::from(1);
        }
    };
    match format {
        Format::Table => print!("{}", report.table()),
        Format::Query => print!("{}", report.query()),
        Format::Json => println!("{:#}", report.json()),
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Command, String> {
        parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn the_command_line_is_checked() {
        assert_eq!(p(&[]), Ok(Command::Report(Format::Table, DEFAULT_INTERVAL)));
        assert_eq!(
            p(&["-q", "--interval", "20"]),
            Ok(Command::Report(Format::Query, Duration::from_millis(20)))
        );
        assert_eq!(
            p(&["--json", "--interval=60000"]),
            Ok(Command::Report(Format::Json, MAX_INTERVAL))
        );
        assert_eq!(p(&["--help", "--bogus"]), Ok(Command::Help));
        for bad in [
            &["-q", "--json"][..],
            &["--interval"],
            &["--interval", "0"],
            &["--interval=60001"],
            &["--interval", "x"],
            &["-i", "0"],
        ] {
            assert!(p(bad).is_err(), "{bad:?}");
        }
    }
}
