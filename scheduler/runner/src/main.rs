//! `vgpu-sim`: runs scheduler simulator scenarios (TOML) and writes their results.
//!
//! ```text
//! vgpu-sim scheduler/scenarios/<name>.toml [--out DIR]   # one scenario
//! vgpu-sim --all scheduler/scenarios [--out DIR]         # every *.toml in a directory
//! ```
//!
//! For each scenario it prints a markdown table and writes `<name>.json` (all run reports),
//! `<name>.csv` (the table) and `<name>.svg` (per-VM GPU share, and FPS where a VM renders
//! frames, over time, one row of plots per run) to DIR (default `target/sim`). Errors name
//! the file and the field and exit with status 2.

#![forbid(unsafe_code)]

mod plot;
mod table;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use vgpu_scheduler::sim::{self, RunReport, Scenario};

/// Largest scenario file read: scenarios are a few kilobytes; this bounds a mistaken path.
const MAX_SCENARIO_BYTES: u64 = 1 << 20;

const USAGE: &str = "usage: vgpu-sim SCENARIO.toml [--out DIR] | vgpu-sim --all DIR [--out DIR]";

/// What the command line asks for.
#[derive(Debug)]
struct Args {
    files: Vec<PathBuf>,
    out: PathBuf,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut out = PathBuf::from("target/sim");
    let mut all = None;
    let mut file = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = args.next().ok_or("--out needs a directory")?.into(),
            "--all" => all = Some(PathBuf::from(args.next().ok_or("--all needs a directory")?)),
            "-h" | "--help" => return Err(USAGE.into()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}\n{USAGE}")),
            s if file.is_none() => file = Some(PathBuf::from(s)),
            s => return Err(format!("unexpected argument {s}\n{USAGE}")),
        }
    }
    let files = match (all, file) {
        (Some(dir), None) => scenario_files(&dir)?,
        (None, Some(f)) => vec![f],
        _ => return Err(USAGE.into()),
    };
    Ok(Args { files, out })
}

/// The `*.toml` files of a directory, sorted by name.
fn scenario_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut files = Vec::new();
    for e in entries {
        let path = e.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        if path.extension().is_some_and(|x| x == "toml") {
            files.push(path);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(format!("{}: no *.toml scenario files", dir.display()));
    }
    Ok(files)
}

/// Reads and parses one scenario file.
fn load(path: &Path) -> Result<Scenario, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if meta.len() > MAX_SCENARIO_BYTES {
        return Err(format!("{}: larger than 1 MiB", path.display()));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Runs one scenario file and writes its outputs.
fn run_file(path: &Path, out: &Path) -> Result<(), String> {
    let sc = load(path)?;
    if sc.name.is_empty()
        || !sc
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(format!(
            "{}: name: use letters, digits, '-' and '_' (it names the output files)",
            path.display()
        ));
    }
    let reports = sim::run(&sc).map_err(|e| format!("{}: {e}", path.display()))?;
    let md = table::markdown(&sc, &reports);
    println!("{md}");
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let write = |ext: &str, data: &str| {
        let p = out.join(format!("{}.{ext}", sc.name));
        std::fs::write(&p, data).map_err(|e| format!("{}: {e}", p.display()))
    };
    write("json", &json(&sc, &reports)?)?;
    write("csv", &table::csv(&reports))?;
    write("md", &md)?;
    let svg = out.join(format!("{}.svg", sc.name));
    plot::svg(&svg, &sc, &reports).map_err(|e| format!("{}: {e}", svg.display()))?;
    Ok(())
}

fn json(sc: &Scenario, reports: &[RunReport]) -> Result<String, String> {
    #[derive(serde::Serialize)]
    struct Doc<'a> {
        scenario: &'a str,
        description: &'a str,
        duration_ms: u64,
        seed: u64,
        runs: &'a [RunReport],
    }
    let doc = Doc {
        scenario: &sc.name,
        description: &sc.description,
        duration_ms: sc.duration_ms,
        seed: sc.seed,
        runs: reports,
    };
    serde_json::to_string_pretty(&doc).map_err(|e| format!("{}: {e}", sc.name))
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vgpu-sim: {e}");
            return ExitCode::from(2);
        }
    };
    let mut failed = false;
    for f in &args.files {
        if let Err(e) = run_file(f, &args.out) {
            eprintln!("vgpu-sim: {e}");
            failed = true;
        }
    }
    if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}
