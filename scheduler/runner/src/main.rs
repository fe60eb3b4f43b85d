//! `vgpu-sim`: runs scheduler simulator scenarios (TOML) and writes their results.
//!
//! ```text
//! vgpu-sim scheduler/scenarios/<name>.toml [--out DIR]   # one scenario
//! vgpu-sim --all scheduler/scenarios [--out=DIR]         # every *.toml in a directory
//! ```
//!
//! Progress on stderr: a bar per scenario file on a terminal, plain lines otherwise.
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

use clap::Parser;
use vgpu_cli::progress::Progress;
use vgpu_scheduler::sim::{self, RunReport, Scenario};

/// Largest scenario file read: scenarios are a few kilobytes; this bounds a mistaken path.
const MAX_SCENARIO_BYTES: u64 = 1 << 20;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "vgpu-sim",
    version,
    about = "Runs scheduler simulator scenarios (TOML) and writes their results",
    long_about = "Runs scheduler simulator scenarios (TOML) and writes their results: for each \
        scenario a markdown table on stdout, and NAME.json (all run reports), NAME.csv, NAME.md \
        and NAME.svg (per-VM GPU share, and FPS where a VM renders frames, over time) in the \
        output directory. Errors name the file and the field and exit with status 2. Progress \
        goes to stderr: a bar on a terminal, plain lines otherwise.",
    after_long_help = "EXAMPLES
  vgpu-sim scheduler/scenarios/timegraph.toml
  vgpu-sim --all scheduler/scenarios --out target/sim

FILES
  NAME.json, NAME.csv, NAME.md, NAME.svg

Written into the output directory for each scenario NAME.

SEE ALSO
vgpu-schedd(1); docs/SCHEDULING.md and docs/EXPERIMENTS.md in the source tree."
)]
struct Cli {
    /// The scenario file to run
    #[arg(
        value_name = "SCENARIO.toml",
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    scenario: Option<PathBuf>,
    /// Run every *.toml scenario file in DIR, in name order
    #[arg(long, value_name = "DIR")]
    all: Option<PathBuf>,
    /// Where the output files go
    #[arg(long, value_name = "DIR", default_value = "target/sim")]
    out: PathBuf,
}

/// What the command line asks for.
#[derive(Debug)]
struct Args {
    files: Vec<PathBuf>,
    out: PathBuf,
}

impl Cli {
    fn args(self) -> Result<Args, String> {
        let files = match (self.all, self.scenario) {
            (Some(dir), _) => scenario_files(&dir)?,
            (None, Some(file)) => vec![file],
            // clap requires one or the other.
            (None, None) => Vec::new(),
        };
        Ok(Args {
            files,
            out: self.out,
        })
    }
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
    let args = match vgpu_cli::parse::<Cli>().args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vgpu-sim: {e}");
            return ExitCode::from(2);
        }
    };
    let total = u64::try_from(args.files.len()).unwrap_or(u64::MAX);
    let progress = Progress::new("vgpu-sim", total);
    let mut failed = false;
    for f in &args.files {
        progress.step(&f.display().to_string());
        if let Err(e) = run_file(f, &args.out) {
            progress.note(&format!("vgpu-sim: {e}"));
            failed = true;
        }
        progress.advance();
    }
    drop(progress);
    if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        vgpu_cli::check::arguments(args)
    }

    fn cli(args: &[&str]) -> Cli {
        parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    #[test]
    fn a_file_or_a_directory_and_an_output_directory() {
        let c = cli(&["x.toml"]);
        assert_eq!(c.scenario, Some(PathBuf::from("x.toml")));
        assert_eq!(c.out, PathBuf::from("target/sim"));
        let c = cli(&["--all=dir", "--out=o"]);
        assert_eq!((c.all, c.out), (Some("dir".into()), "o".into()));
        let c = cli(&["--out", "o", "x.toml"]);
        assert_eq!((c.scenario, c.out), (Some("x.toml".into()), "o".into()));
        let dir = tempfile::tempdir().unwrap();
        for name in ["b.toml", "a.toml", "notes.txt"] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        let files = cli(&["--all", dir.path().to_str().unwrap()])
            .args()
            .unwrap()
            .files;
        assert_eq!(
            files,
            [dir.path().join("a.toml"), dir.path().join("b.toml")]
        );
        std::fs::remove_file(dir.path().join("a.toml")).unwrap();
        std::fs::remove_file(dir.path().join("b.toml")).unwrap();
        assert!(
            cli(&["--all", dir.path().to_str().unwrap()])
                .args()
                .is_err()
        );
    }

    #[test]
    fn usage_errors_are_refused() {
        let kind = |args: &[&str]| parse(args).map(|_| ()).map_err(|e| e.kind());
        assert_eq!(kind(&[]), Err(ErrorKind::MissingRequiredArgument));
        assert_eq!(
            kind(&["a.toml", "--all", "d"]),
            Err(ErrorKind::ArgumentConflict)
        );
        assert_eq!(kind(&["a.toml", "b.toml"]), Err(ErrorKind::UnknownArgument));
        assert_eq!(kind(&["--bogus"]), Err(ErrorKind::UnknownArgument));
        assert_eq!(kind(&["a.toml", "--out"]), Err(ErrorKind::InvalidValue));
    }

    #[test]
    fn keeps_the_command_line_conventions() {
        vgpu_cli::check::conventions::<Cli>(env!("CARGO_PKG_VERSION")).unwrap();
        vgpu_cli::check::operator_man_page::<Cli>().unwrap();
    }
}
