//! Draws the figure of recorded benchmark results: for each JSON a benchmark wrote (grant,
//! scale, doorbell, bar_read, sched_overhead, cuda-guest, cuda-remote, gl_side_by_side, and the
//! criterion summaries of the decision benches), the SVG next to it, as the benchmark itself
//! does after a run.
//!
//! `vgpu-replot target/vgpu-bench/*.json target/grant-bench.json`

use std::path::PathBuf;
use std::process::ExitCode;

/// Redraws benchmark figures from their JSON.
#[derive(Debug, clap::Parser)]
#[command(version, about)]
struct Cli {
    /// Benchmark JSON files; each gets FILE.svg beside it.
    #[arg(required = true)]
    json: Vec<PathBuf>,
}

fn main() -> ExitCode {
    let cli = vgpu_cli::parse::<Cli>();
    let mut failed = false;
    for json in &cli.json {
        match vgpu_bench_report::write_for(json) {
            Ok(svg) => println!("{}", svg.display()),
            Err(e) => {
                eprintln!("vgpu-replot: {e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
