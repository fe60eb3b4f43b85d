//! `vgpu-bench`: runs a scheduling experiment (a scenario of `scheduler/scenarios/`) in the
//! simulator or on real guests, and puts the two side by side. See `docs/EXPERIMENTS.md`.

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use vgpu_cli::progress::{Progress, minutes};
use vgpu_scheduler::sim::{self, RunSpec, Scenario};
use vgpu_tests::daemon::{Schedd, workspace_binary};
use vgpu_tests::experiment::{self, Guests, RunResult, VmRunConfig};
use vgpu_tests::guest::GuestImage;
use vgpu_tests::live_switch::{self, LiveSwitch};

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "vgpu-bench",
    version,
    about = "Runs a scheduling experiment in the simulator or on real guests, side by side",
    after_help = "Exit codes: 0 done, 1 a run failed, 2 usage or scenario error. Progress goes \
        to stderr: a bar on a terminal, plain lines otherwise."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Runs a scenario (scheduler/scenarios/NAME.toml)
    Run(Args),
    /// The demo's live policy switch on two real guests: a game beside a GPU bomb under the
    /// daemon's first policy, then under a policy installed live; prints a verdict only when
    /// both VMs were busy through both windows and each policy in force (exit 3 otherwise)
    LiveSwitch(LiveArgs),
}

/// `vgpu-bench live-switch`.
#[derive(Debug, clap::Args)]
#[command(args_override_self = true)]
struct LiveArgs {
    /// The game is glmark2 (its build scene) on virgl instead of vgpu-load's frames
    #[arg(long)]
    gl: bool,
    /// Seconds of each measured phase
    #[arg(long, value_name = "S", default_value_t = 25,
          value_parser = clap::value_parser!(u64).range(5..=3600))]
    phase_s: u64,
    /// The policy installed between the phases (a vgpuctl set-policy file)
    #[arg(
        long,
        value_name = "FILE",
        default_value = "qemu-scripts/demo-timegraph.toml"
    )]
    policy: PathBuf,
    /// The daemon's web dashboard listener (ADDR:PORT; port 0 picks a free one)
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:0")]
    http: String,
    /// Keep the daemon and its dashboard up this many seconds after the verdict
    #[arg(long, value_name = "S", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    linger_s: u64,
    /// Longest wait for both guests to boot
    #[arg(long, value_name = "S", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(10..=3600))]
    boot_timeout_s: u64,
}

/// Exit code of a live switch whose preconditions failed: no verdict.
const EXIT_NO_VERDICT: u8 = 3;

/// Runs the live switch; `Ok(true)` with a verdict, `Ok(false)` without one.
fn live_switch(args: &LiveArgs) -> Result<bool, String> {
    let image = GuestImage::locate().map_err(|e| format!("guest image: {e}"))?;
    let policy_text = std::fs::read_to_string(&args.policy)
        .map_err(|e| format!("{}: {e}", args.policy.display()))?;
    let policy_name = policy_text
        .parse::<toml::Table>()
        .ok()
        .and_then(|t| t.get("policy").and_then(|p| p.as_str().map(str::to_owned)))
        .ok_or_else(|| format!("{}: no policy = \"NAME\" line", args.policy.display()))?;
    let schedd = Schedd::start_with(None, "info", &["--http", &args.http])
        .map_err(|e| format!("vgpu-schedd: {e}"))?;
    eprintln!(
        "vgpu-schedd is up (policy none); its device socket: {}",
        schedd.socket().display()
    );
    schedd
        .transcript(&["dashboard"])
        .map_err(|e| format!("vgpuctl dashboard: {e}"))?;
    let cfg = LiveSwitch {
        phase: Duration::from_secs(args.phase_s),
        gl: args.gl,
        policy_file: args.policy.clone(),
        policy_name,
        boot_timeout: Duration::from_secs(args.boot_timeout_s),
    };
    let result = live_switch::run(&schedd, &image, &cfg, |what| {
        eprintln!("[vgpu-bench] live-switch: {what}")
    })?;
    if let Some(bomb) = &result.bomb_summary {
        eprintln!("[vgpu-bench] live-switch: the bomb's own summary: {bomb}");
    }
    let text = live_switch::verdict(&result);
    print!("{text}");
    if args.linger_s > 0 {
        eprintln!("the dashboard stays up for {} s more", args.linger_s);
        std::thread::sleep(Duration::from_secs(args.linger_s));
    }
    Ok(result.before.failures.is_empty() && result.after.failures.is_empty())
}

/// `vgpu-bench run`.
#[derive(Debug, clap::Args)]
// A repeated option takes its last value, as before clap.
#[command(args_override_self = true)]
struct Args {
    /// The scenario file
    #[arg(value_name = "SCENARIO.toml")]
    scenario: PathBuf,
    /// Where the runs go
    #[arg(long, value_enum, value_name = "WHERE", default_value_t = On::Sim)]
    on: On,
    /// The scenario's [vms] quick_runs with its quick_window_s
    #[arg(long)]
    quick: bool,
    /// Only these runs (labels)
    #[arg(long, value_name = "LABEL,...", value_delimiter = ',')]
    runs: Option<Vec<String>>,
    /// Output directory
    #[arg(long, value_name = "DIR", default_value = "target/bench")]
    out: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum On {
    /// The simulator (vgpu-sim): every run, JSON/CSV/markdown/SVG in DIR
    Sim,
    /// Real guests: per run a vgpu-schedd with the run's policy, one vgpu-server and one TCG
    /// QEMU per VM (each in its own CPU cgroup with the scenario's CPU weight) running the VM's
    /// workload with vgpu-load; then the simulator's figures for the same runs beside the
    /// guests' (DIR/NAME.vms.json, .vms.csv, .vms.compare.md, .svg)
    Vms,
    /// As vms, with qtest guests (no guest OS) whose load requests a host thread per VM issues
    /// through the harness's virtio-gpu driver: up to 64 VMs per run, and the coupled workload
    /// (DIR/NAME.qtest.json, ...)
    Qtest,
}

/// Largest scenario file read.
const MAX_SCENARIO_BYTES: u64 = 1 << 20;

/// The scenario, and each run's policy table as TOML (what the daemon's `--policy` reads).
fn load(path: &PathBuf) -> Result<(Scenario, Vec<String>), String> {
    let at = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let meta = std::fs::metadata(path).map_err(|e| at(&e))?;
    if meta.len() > MAX_SCENARIO_BYTES {
        return Err(at(&"larger than 1 MiB"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| at(&e))?;
    let sc: Scenario = toml::from_str(&text).map_err(|e| at(&e))?;
    let raw: toml::Table = toml::from_str(&text).map_err(|e| at(&e))?;
    let policies = raw
        .get("run")
        .and_then(|r| r.as_array())
        .map(|runs| {
            runs.iter()
                .map(|r| toml::to_string(&r["policy"]).map_err(|e| at(&e)))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?
        .unwrap_or_default();
    Ok((sc, policies))
}

/// The selected runs (with their policy texts).
fn selected<'a>(
    sc: &'a Scenario,
    policies: &'a [String],
    args: &Args,
) -> Result<Vec<(&'a RunSpec, &'a str)>, String> {
    let wanted: Option<Vec<String>> = args.runs.clone().or_else(|| {
        (args.quick && !sc.vms.quick_runs.is_empty()).then(|| sc.vms.quick_runs.clone())
    });
    if let Some(w) = &wanted
        && let Some(unknown) = w.iter().find(|l| !sc.run.iter().any(|r| &r.label == *l))
    {
        return Err(format!("{}: no run labelled {unknown}", sc.name));
    }
    let runs: Vec<_> = sc
        .run
        .iter()
        .zip(policies.iter().map(String::as_str))
        .filter(|(r, _)| wanted.as_ref().is_none_or(|w| w.contains(&r.label)))
        .collect();
    if runs.is_empty() {
        return Err(format!("{}: no runs selected", sc.name));
    }
    Ok(runs)
}

fn on_guests(sc: &Scenario, runs: &[(&RunSpec, &str)], args: &Args) -> Result<bool, String> {
    let (guests, kind) = if args.on == On::Qtest {
        (Guests::Qtest, "qtest")
    } else {
        let image = GuestImage::locate().map_err(|e| format!("guest image: {e}"))?;
        (Guests::Vms(image), "vms")
    };
    let window_s = if args.quick {
        sc.vms.quick_window_s
    } else {
        sc.vms.window_s
    };
    let config = VmRunConfig {
        guests,
        window: Duration::from_secs(window_s),
        boot_timeout: Duration::from_secs(sc.vms.boot_timeout_s),
    };
    let started = Instant::now();
    let mut results: Vec<RunResult> = Vec::new();
    let mut failed = false;
    let total = u64::try_from(runs.len()).unwrap_or(u64::MAX);
    let progress = Progress::new("[vgpu-bench]", total);
    for (i, (run, policy)) in runs.iter().enumerate() {
        let tag = format!(
            "[vgpu-bench] {} run {}/{} {}",
            sc.name,
            i + 1,
            runs.len(),
            run.label
        );
        progress.step(&format!("{} {}", sc.name, run.label));
        let mut outcome = experiment::run_on_vms(sc, run, policy, &config, |what| {
            progress.note(&format!("{tag}: {what}"))
        });
        // A run whose precondition failed (a VM idle or absent in the window) is measured
        // once more; if it fails again it stays out of the table and the command fails.
        if outcome
            .as_ref()
            .is_ok_and(|r| !r.precondition_failures.is_empty())
        {
            progress.note(&format!("{tag}: precondition failed, measuring it again"));
            outcome = experiment::run_on_vms(sc, run, policy, &config, |what| {
                progress.note(&format!("{tag}: {what}"))
            });
        }
        match outcome {
            Ok(r) if !r.precondition_failures.is_empty() => {
                progress.note(&format!(
                    "{tag}: EXCLUDED, precondition failed: {}",
                    r.precondition_failures.join("; ")
                ));
                failed = true;
                results.push(r);
            }
            Ok(r) => {
                let line: Vec<String> = r
                    .vms
                    .iter()
                    .map(|v| {
                        let cpu = v
                            .cpu_wait
                            .map_or(String::new(), |w| format!(", CPU wait {:.0}%", w * 100.0));
                        format!(
                            "{} {:.0}% {:.1}/s p50 {} us{cpu}",
                            v.name,
                            v.gpu_share * 100.0,
                            v.work_per_sec,
                            v.latency_p50_us
                        )
                    })
                    .collect();
                progress.note(&format!(
                    "{tag}: done (boot {:.0} s): {}",
                    r.boot_s,
                    line.join(", ")
                ));
                results.push(r);
            }
            Err(e) => {
                progress.note(&format!("{tag}: FAILED: {e}"));
                failed = true;
            }
        }
        progress.advance();
    }
    drop(progress);
    let sim_reports = sim::run(sc).map_err(|e| format!("{}: simulator: {e}", sc.name))?;
    let compare = experiment::side_by_side(sc, &sim_reports, &results, kind);
    println!("{compare}");
    let json = serde_json::to_string_pretty(&serde_json::json!({
        "scenario": sc.name,
        "description": sc.description,
        "guests": kind,
        "quick": args.quick,
        "window_s": window_s,
        "wall_s": started.elapsed().as_secs_f64(),
        "runs": results,
    }))
    .map_err(|e| e.to_string())?;
    let out = &args.out;
    let w = |name: String, text: &str| {
        experiment::write(out, &name, text).map_err(|e| format!("{}: {e}", out.display()))
    };
    w(format!("{}.{kind}.json", sc.name), &json)?;
    w(format!("{}.{kind}.compare.md", sc.name), &compare)?;
    w(
        format!("{}.{kind}.csv", sc.name),
        &experiment::csv(&results),
    )?;
    let plot = out.join(format!("{}.{kind}.compare.svg", sc.name));
    experiment::svg(&plot, &sim_reports, &results)
        .map_err(|e| format!("{}: {e}", plot.display()))?;
    eprintln!(
        "[vgpu-bench] {}: {} runs in {}; {}/{}.{kind}.json, .csv, .compare.md and .compare.svg",
        sc.name,
        results.len(),
        minutes(started.elapsed()),
        out.display(),
        sc.name
    );
    Ok(!failed)
}

fn main() -> ExitCode {
    let args = match vgpu_cli::parse::<Cli>().cmd {
        Cmd::Run(args) => args,
        Cmd::LiveSwitch(args) => {
            return match live_switch(&args) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(EXIT_NO_VERDICT),
                Err(e) => {
                    eprintln!("vgpu-bench live-switch: {e}");
                    ExitCode::from(1)
                }
            };
        }
    };
    let (sc, policies) = match load(&args.scenario) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("vgpu-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let runs = match selected(&sc, &policies, &args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vgpu-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match args.on {
        On::Sim => {
            let sim = match workspace_binary("vgpu-sim") {
                Ok(b) => b,
                Err(e) => {
                    eprintln!("vgpu-bench: {e}");
                    return ExitCode::from(2);
                }
            };
            Command::new(sim)
                .arg(&args.scenario)
                .arg("--out")
                .arg(&args.out)
                .status()
                .map(|s| s.success())
                .map_err(|e| format!("vgpu-sim: {e}"))
        }
        On::Vms | On::Qtest => on_guests(&sc, &runs, &args),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("vgpu-bench: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Result<Args, clap::Error> {
        match vgpu_cli::check::arguments::<Cli, _, _>(list)?.cmd {
            Cmd::Run(a) => Ok(a),
            Cmd::LiveSwitch(_) => panic!("not a run: {list:?}"),
        }
    }

    #[test]
    fn the_live_switch_command_line_is_checked() {
        let live =
            |list: &[&str]| match vgpu_cli::check::arguments::<Cli, _, _>(list).map(|c| c.cmd) {
                Ok(Cmd::LiveSwitch(a)) => Ok(a),
                Ok(Cmd::Run(_)) => panic!("not a live switch"),
                Err(e) => Err(e),
            };
        let a = live(&["live-switch"]).unwrap();
        assert_eq!((a.gl, a.phase_s, a.linger_s), (false, 25, 0));
        assert_eq!(a.policy, PathBuf::from("qemu-scripts/demo-timegraph.toml"));
        let a = live(&[
            "live-switch",
            "--gl",
            "--phase-s=10",
            "--http",
            "127.0.0.1:8080",
        ])
        .unwrap();
        assert_eq!(
            (a.gl, a.phase_s, a.http.as_str()),
            (true, 10, "127.0.0.1:8080")
        );
        for bad in [
            &["live-switch", "--phase-s", "0"][..],
            &["live-switch", "--phase-s", "4"],
            &["live-switch", "--linger-s", "99999"],
            &["live-switch", "extra"],
        ] {
            assert!(live(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn keeps_the_command_line_conventions() {
        vgpu_cli::check::conventions::<Cli>(env!("CARGO_PKG_VERSION")).unwrap();
    }

    #[test]
    fn the_command_line_is_checked() {
        let a = args(&["run", "x.toml", "--on=qtest", "--quick", "--runs", "a,b"]).unwrap();
        assert_eq!((a.on, a.quick), (On::Qtest, true));
        assert_eq!(a.runs.unwrap(), ["a", "b"]);
        let a = args(&["run", "--out=o", "x.toml", "--runs=c", "--on", "vms"]).unwrap();
        assert_eq!(
            (a.on, a.out, a.runs.unwrap()),
            (On::Vms, "o".into(), vec!["c".to_owned()])
        );
        let a = args(&["run", "x.toml"]).unwrap();
        assert_eq!((a.on, a.out), (On::Sim, "target/bench".into()));
        for bad in [
            &["x.toml"][..],
            &["run"],
            &["run", "x.toml", "--on", "gpu"],
            &["run", "x.toml", "--on"],
            &["run", "x.toml", "--frobnicate"],
            &["run", "x.toml", "y.toml"],
        ] {
            assert!(args(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn runs_are_selected_by_label_or_by_quick() {
        let text = "name = \"s\"\nduration_ms = 10\n[vms]\nquick_runs = [\"b\"]\n\
            [[vm]]\nname = \"v\"\nworkload = { kind = \"bomb\", cost_us = 5 }\n\
            [[run]]\nlabel = \"a\"\npolicy = { policy = \"none\" }\n\
            [[run]]\nlabel = \"b\"\npolicy = { policy = \"none\" }\n";
        let sc: Scenario = toml::from_str(text).unwrap();
        let policies = vec!["policy = \"none\"\n".to_owned(); 2];
        let pick = |list: &[&str]| {
            selected(&sc, &policies, &args(list).unwrap())
                .map(|r| r.iter().map(|(r, _)| r.label.clone()).collect::<Vec<_>>())
        };
        assert_eq!(pick(&["run", "s.toml"]).unwrap(), ["a", "b"]);
        assert_eq!(pick(&["run", "s.toml", "--quick"]).unwrap(), ["b"]);
        assert_eq!(pick(&["run", "s.toml", "--runs", "a"]).unwrap(), ["a"]);
        assert!(pick(&["run", "s.toml", "--runs", "zzz"]).is_err());
    }
}
