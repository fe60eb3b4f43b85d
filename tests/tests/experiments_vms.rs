//! The papers' experiments on real guests, quick mode: `vgpu-bench run SCENARIO --on vms
//! --quick` boots the scenario's VMs under a real `vgpu-schedd` per run (LoGA's 11 tenants:
//! `--on qtest`) and must show the paper's direction (not its numbers, which depend on the
//! GPU): docs/EXPERIMENTS.md.
//!
//! Skipped with a message when the guest image is missing, unless `VGPU_REQUIRE_GUEST` is set
//! (test.sh).

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use vgpu_tests::TempDir;
use vgpu_tests::daemon::workspace_binary;
use vgpu_tests::guest::{self, boot_lock, skip_without_guest};
use vgpu_tests::skip_without_qemu;

/// Runs `vgpu-bench run scheduler/scenarios/NAME.toml --on ON --quick` (`vms` or `qtest`):
/// the JSON results and the progress log.
fn quick_on(name: &str, on: &str) -> Option<(Value, String)> {
    if on == "vms" {
        skip_without_guest()?;
    } else if skip_without_qemu() {
        return None;
    }
    let _lock = boot_lock();
    let out = TempDir::new("vgpu-bench").expect("temp dir");
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scheduler/scenarios")
        .join(format!("{name}.toml"));
    let run = Command::new(workspace_binary("vgpu-bench").expect("vgpu-bench"))
        .arg("run")
        .arg(&scenario)
        .args(["--on", on, "--quick", "--out"])
        .arg(out.path())
        .output()
        .expect("vgpu-bench runs");
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    let table = String::from_utf8_lossy(&run.stdout).into_owned();
    if !run.status.success() && std::env::var_os(LOADED_ENV).is_some() && only_excluded(&stderr) {
        // The runs that failed were measured and excluded for a precondition (a VM starved
        // of CPU by the load beside the tests): on a loaded host that is the honest outcome.
        for line in stderr.lines().filter(|l| l.contains("EXCLUDED")) {
            guest::report(
                "experiments_vms",
                name,
                &format!("INCONCLUSIVE ({LOADED_ENV}): {line}"),
            );
        }
        return None;
    }
    assert!(run.status.success(), "{stderr}\n{table}");
    for line in stderr.lines().filter(|l| l.contains(": done")) {
        guest::report("experiments_vms", name, line);
    }
    eprintln!("{table}");
    let json = std::fs::read_to_string(out.path().join(format!("{name}.{on}.json")))
        .expect("the JSON results");
    assert!(out.path().join(format!("{name}.{on}.compare.md")).exists());
    assert!(out.path().join(format!("{name}.{on}.compare.svg")).exists());
    Some((serde_json::from_str(&json).expect("JSON"), stderr))
}

/// Set by `qemu-scripts/test.sh --loaded`: the host's CPUs are kept busy beside the tests.
const LOADED_ENV: &str = "VGPU_TEST_LOADED";

/// Whether every run `vgpu-bench` reports as failed was measured and excluded for a failed
/// precondition (not a harness or boot failure).
fn only_excluded(stderr: &str) -> bool {
    stderr.contains("EXCLUDED, precondition failed") && !stderr.contains(": FAILED: ")
}

/// CPU wait share past which, in the loaded mode, a comparison that fails is not held against
/// the policy: a VM that waited for a CPU more than half the time it wanted one was paced by
/// the load beside the tests (measured: 70-86% under stress-ng, 20-76% with builds beside).
const LOADED_CPU_WAIT: f64 = 0.5;

/// Asserts `ok`, a comparison of the figures of `involved` (run label, VM) in `r`. In the
/// loaded mode, when one of them waited for a CPU past [`LOADED_CPU_WAIT`], a failed
/// comparison is reported INCONCLUSIVE instead (the host's load may have decided it).
fn judge(name: &str, r: &Value, ok: bool, what: &str, involved: &[(&str, &str)]) {
    if ok {
        return;
    }
    let starved: Vec<String> = involved
        .iter()
        .filter_map(|(run, vm)| {
            let wait = figure(r, run, vm, "cpu_wait");
            (wait > LOADED_CPU_WAIT).then(|| format!("{vm} in {run} waited {:.0}%", wait * 100.0))
        })
        .collect();
    if std::env::var_os(LOADED_ENV).is_some() && !starved.is_empty() {
        let line = what.lines().next().unwrap_or_default();
        guest::report(
            "experiments_vms",
            name,
            &format!(
                "INCONCLUSIVE ({LOADED_ENV}): {line}; {}",
                starved.join(", ")
            ),
        );
        return;
    }
    panic!("{what}");
}

/// [`quick_on`] real guests.
fn quick(name: &str) -> Option<(Value, String)> {
    quick_on(name, "vms")
}

/// A VM's `key` in run `label`.
fn figure(results: &Value, label: &str, vm: &str, key: &str) -> f64 {
    results["runs"]
        .as_array()
        .and_then(|runs| runs.iter().find(|r| r["label"] == label))
        .and_then(|r| r["vms"].as_array())
        .and_then(|vms| vms.iter().find(|v| v["name"] == vm))
        .and_then(|v| v[key].as_f64())
        .unwrap_or_else(|| panic!("no {key} of {vm} in run {label}: {results}"))
}

#[test]
fn timegraph_in_vms_a_reserve_protects_the_game_from_a_bomb() {
    let Some((r, log)) = quick("timegraph") else {
        return;
    };
    let fps = |run| figure(&r, run, "game", "fps");
    let (alone, none, pe) = (fps("standalone"), fps("none-1bomb"), fps("pe-1bomb"));
    // The paper (Figure 8): without TimeGraph the game slows several times; with a priority
    // and a PE reserve for the bomb it stays within a few percent of running alone. (One bomb
    // of 8 x 0.5 ms groups costs the game about 15% here, 38% in the simulator: see
    // docs/EXPERIMENTS.md.)
    let games = [
        ("standalone", "game"),
        ("none-1bomb", "game"),
        ("pe-1bomb", "game"),
    ];
    let judge = |ok, what: String| judge("timegraph", &r, ok, &what, &games);
    judge(
        none < 0.92 * alone,
        format!("the bomb slows the game: {alone} -> {none} fps\n{log}"),
    );
    judge(
        pe > 1.08 * none,
        format!("TimeGraph with a reserve: {none} -> {pe} fps\n{log}"),
    );
    judge(
        pe > 0.9 * alone,
        format!("within 10% of alone: {alone} -> {pe} fps\n{log}"),
    );
    let bomb_share = figure(&r, "pe-1bomb", "bomb", "gpu_util");
    assert!(
        bomb_share < 0.2,
        "the bomb's 2.5 ms / 25 ms reserve caps it near 10% of the GPU: {bomb_share}\n{log}"
    );
}

#[test]
fn pegasus_in_vms_credits_order_the_gpu_shares() {
    let Some((r, log)) = quick("pegasus") else {
        return;
    };
    let share = |run, vm| figure(&r, run, vm, "gpu_share");
    // The paper (Figure 5): without scheduling the driver, not the credits, sets the shares
    // (FCFS favours dom1's large kernels); AccC moves GPU time to the domains with credits.
    // With two kernels outstanding a TCG guest cannot keep dom3 backlogged, so the VMs do not
    // reach the simulator's 1:2:4:1 (pegasus-deep below does): the direction must hold.
    let doms: Vec<(&str, &str)> = ["none", "accc"]
        .into_iter()
        .flat_map(|run| ["dom1", "dom2", "dom3", "dom4"].map(|vm| (run, vm)))
        .collect();
    judge(
        "pegasus",
        &r,
        share("none", "dom1") > 1.5 * share("none", "dom3"),
        &format!("FCFS follows kernel size\n{log}"),
        &doms,
    );
    judge(
        "pegasus",
        &r,
        share("accc", "dom3") > 1.5 * share("none", "dom3")
            && share("accc", "dom1") < share("none", "dom1"),
        &format!("AccC moves GPU time towards the credits\n{log}"),
        &doms,
    );
    let Some((deep, log)) = quick("pegasus-deep") else {
        return;
    };
    let share = |vm| figure(&deep, "accc", vm, "gpu_share");
    let (d1, d2, d3, d4) = (share("dom1"), share("dom2"), share("dom3"), share("dom4"));
    let doms = ["dom1", "dom2", "dom3", "dom4"].map(|vm| ("accc", vm));
    for (got, want) in [(d1, 0.125), (d2, 0.25), (d3, 0.5), (d4, 0.125)] {
        judge(
            "pegasus-deep",
            &deep,
            (got - want).abs() < 0.05,
            &format!(
                "AccC with backlogged domains: shares {d1:.3} / {d2:.3} / {d3:.3} / {d4:.3}, \
                 want 1:2:4:1\n{log}"
            ),
            &doms,
        );
    }
}

#[test]
fn vgris_in_vms_sla_aware_pacing_holds_30_fps() {
    let Some((r, log)) = quick("vgris") else {
        return;
    };
    let fps = |run, vm| figure(&r, run, vm, "fps");
    // The paper (Figures 2, 7): unscheduled, the light game runs far above 30 FPS; SLA-aware
    // pacing holds it at its 30 FPS target and hands the time to the others.
    let games: Vec<(&str, &str)> = ["none", "sla"]
        .into_iter()
        .flat_map(|run| ["light", "medium", "heavy"].map(|vm| (run, vm)))
        .collect();
    let judge = |ok, what: String| judge("vgris", &r, ok, &what, &games);
    let light_none = fps("none", "light");
    judge(
        light_none > 40.0,
        format!("unscheduled, the light game runs above 40 fps: {light_none}\n{log}"),
    );
    let light = fps("sla", "light");
    judge(
        (25.0..=33.0).contains(&light),
        format!("SLA-aware: the light game at its target, {light} fps\n{log}"),
    );
    judge(
        fps("sla", "heavy") >= fps("none", "heavy") * 0.95,
        format!("the heavy game keeps at least its unscheduled rate\n{log}"),
    );
}

#[test]
fn loga_on_qtest_guests_exact_accounting_measures_the_load() {
    let Some((r, log)) = quick_on("loga", "qtest") else {
        return;
    };
    // The paper (§5.4, Figure 10): exact accounting measures the load a Throttle generates.
    // On qtest guests the harness's request round trips stretch each 1 ms cycle (about half
    // the intended cycles run), so the load generated is what the guest issued: groups/s x
    // 500 us. The daemon's charged GPU time must match it, and cannot exceed the intended 50%.
    let load = figure(&r, "q-500", "t500", "gpu_util");
    let issued = figure(&r, "q-500", "t500", "groups_per_sec") * 500e-6;
    assert!(
        (load - issued).abs() <= 0.05 * issued && load <= 0.5,
        "measured load {load:.4}, issued {issued:.4} (intended 0.5)\n{log}"
    );
    // §5.3 (exact accounting leaves the application's turnaround as without accounting;
    // NEON's sampling slows it) is a throughput comparison of three sequential 10 s runs of
    // 11 qtest drivers: on a 2-core host the machine's drift outweighs it (repeated runs of
    // one build gave exact/none from 0.84 to 1.18 and sampling/exact from 0.67 to 1.04, the
    // light VMs moving with the app), so it is reported here and in the bench's table
    // (docs/EXPERIMENTS.md), not asserted.
    let app = |run| figure(&r, run, "app", "work_per_sec");
    eprintln!(
        "LoGA §5.3 on qtest guests, application iterations/s: none {:.0}, exact {:.0}, sampling {:.0}",
        app("l10-none"),
        app("l10-exact"),
        app("l10-sampling")
    );
}
