//! What the benchmarks and experiments of the workspace share to report their results.
//!
//! - [`plot`]: SVG figures written next to a benchmark's JSON (grouped bars or lines over
//!   categories, one or more panels), with plotters' SVG backend: no fonts or image libraries.
//! - [`figure`]: each benchmark's figure drawn from the JSON it wrote (also what `vgpu-replot`
//!   does with recorded results).
//! - [`criterion`]: the estimates of criterion benchmarks collected into one JSON and figure.
//! - [`CargoBench`]: the `--bench` flag cargo passes to `harness = false` benchmarks, for
//!   their clap definitions to flatten.
//! - [`machine`]: the CPUs a figure was measured on, for titles and JSON.
//! - [`stats`]: percentiles and medians, one definition for every benchmark.
//!
//! It is its own crate because benchmarks of several crates use it (`vgpu-tests`,
//! `vgpu-schedd`, `vgpu-scheduler`, `mdev-backend`) and none of them is below all the others
//! without carrying plotters into the production binaries. (Progress bars come from
//! `vgpu_cli::progress`, shared with the long-running tools.)

#![forbid(unsafe_code)]

pub mod criterion;
pub mod figure;
pub mod plot;
pub mod stats;

pub use figure::{FigureError, out_path, write_for, write_results};
pub use plot::{Kind, Panel, PlotError, Series, write_svg};

/// The flag `cargo bench` passes to a `harness = false` benchmark: accepted and ignored.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct CargoBench {
    /// Passed by `cargo bench`; ignored.
    #[arg(long = "bench", hide = true)]
    pub bench: bool,
}

/// The machine in a figure's title: `N CPUs (model)`, the model from `/proc/cpuinfo`.
pub fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| cpu_model(&s).map(str::to_owned))
        .unwrap_or_else(|| "unknown CPU".to_owned());
    format!("{cpus} CPUs ({model})")
}

/// The first `model name` of a `/proc/cpuinfo` text.
fn cpu_model(cpuinfo: &str) -> Option<&str> {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim())
        .filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Args {
        #[command(flatten)]
        _cargo: CargoBench,
        #[arg(long)]
        quick: bool,
    }

    #[test]
    fn cargo_bench_flag_is_accepted() {
        let a = Args::try_parse_from(["b", "--bench", "--quick"]).unwrap();
        assert!(a.quick);
        assert!(Args::try_parse_from(["b", "--bogus"]).is_err());
    }

    #[test]
    fn the_cpu_model_is_the_first_model_name() {
        let text =
            "processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nprocessor\t: 1\nmodel name\t: other\n";
        assert_eq!(cpu_model(text), Some("Intel(R) Xeon(R)"));
        assert_eq!(cpu_model("processor : 0\n"), None);
        assert_eq!(cpu_model("model name :  \n"), None);
        assert!(machine().contains("CPUs ("));
    }
}
