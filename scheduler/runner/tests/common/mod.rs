//! Shared by the scenario tests: run a scenario file from `scheduler/scenarios/` and look up
//! its reports.

use std::path::PathBuf;

use vgpu_scheduler::sim::{self, RunReport, Scenario, VmReport};

/// Runs `scheduler/scenarios/<name>.toml` and returns one report per run.
pub fn run_scenario(name: &str) -> Vec<RunReport> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../scenarios")
        .join(format!("{name}.toml"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let scenario: Scenario =
        toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    sim::run(&scenario).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The report of the run labelled `label`.
pub fn run<'a>(reports: &'a [RunReport], label: &str) -> &'a RunReport {
    reports
        .iter()
        .find(|r| r.label == label)
        .unwrap_or_else(|| panic!("no run {label}"))
}

/// The report of VM `vm` in the run labelled `label`.
pub fn vm<'a>(reports: &'a [RunReport], label: &str, vm: &str) -> &'a VmReport {
    run(reports, label)
        .vms
        .iter()
        .find(|v| v.name == vm)
        .unwrap_or_else(|| panic!("no VM {vm} in run {label}"))
}
