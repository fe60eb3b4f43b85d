//! Fair queuing / LoGA experiments: `loga.toml` (accounting overhead and accounting quality,
//! LoGA §5.3–§5.4) and `fair.toml` (GPU shares under fair queuing, LoGA §5.5).

mod common;

use vgpu_scheduler::sim::{RunReport, VmReport};

/// The instance-count sets of `loga.toml`: the app with 10 light (9.9 %) or heavy (90.9 %)
/// Throttles, then with 1, 5 and 20 light ones.
const SETS: [&str; 5] = ["l10", "h10", "l1", "l5", "l20"];

/// A VM's policy figure `name` (the fair policy reports `charged_ms`).
fn figure(vm: &VmReport, name: &str) -> f64 {
    vm.figures
        .iter()
        .find(|(n, _)| n == name)
        .map(|&(_, v)| v)
        .unwrap_or_else(|| panic!("no figure {name} for {}", vm.name))
}

/// The application's turnaround per iteration in run `label`, normalised to the same set of
/// Throttles without accounting (`<set>-none`): above 1 means slower.
fn turnaround(reports: &[RunReport], set: &str, policy: &str) -> f64 {
    let none = common::vm(reports, &format!("{set}-none"), "app").work_per_sec;
    let run = common::vm(reports, &format!("{set}-{policy}"), "app").work_per_sec;
    none / run
}

/// The load the fair policy measured (charged GPU time over the duration) for all VMs of a run.
fn measured_load(run: &RunReport) -> f64 {
    let charged: f64 = run.vms.iter().map(|v| figure(v, "charged_ms")).sum();
    charged / run.duration_ms as f64
}

#[test]
fn exact_accounting_adds_no_overhead() {
    let reports = common::run_scenario("loga");
    for set in SETS {
        let t = turnaround(&reports, set, "exact");
        assert!((t - 1.0).abs() < 0.005, "{set}: turnaround x{t}");
        let none = common::run(&reports, &format!("{set}-none"));
        let exact = common::run(&reports, &format!("{set}-exact"));
        assert!(
            (none.gpu_busy_pct - exact.gpu_busy_pct).abs() < 0.5,
            "{set}: busy {} vs {}",
            none.gpu_busy_pct,
            exact.gpu_busy_pct
        );
        // Exact accounting charges each VM exactly the GPU time it used.
        for vm in &exact.vms {
            let used = vm.gpu_time_ns as f64 / 1e6;
            assert!(
                (figure(vm, "charged_ms") - used).abs() < 1e-3,
                "{set}/{}",
                vm.name
            );
        }
    }
}

#[test]
fn sampling_accounting_slows_the_application_and_idles_the_gpu() {
    let reports = common::run_scenario("loga");
    // LoGA measured +11.4 % at 9.9 % Throttle load and +7.6 % at 90.9 %: clearly above zero,
    // well below doubling.
    for set in SETS {
        let t = turnaround(&reports, set, "sampling");
        assert!((1.05..1.30).contains(&t), "{set}: turnaround x{t}");
        let none = common::run(&reports, &format!("{set}-none"));
        let sampling = common::run(&reports, &format!("{set}-sampling"));
        assert!(
            sampling.gpu_busy_pct < none.gpu_busy_pct - 5.0,
            "{set}: busy {} vs {}",
            sampling.gpu_busy_pct,
            none.gpu_busy_pct
        );
    }
    // The overhead grows with the number of Throttle instances (longer sampling phases).
    let one = turnaround(&reports, "l1", "sampling");
    for set in ["l5", "l10", "l20"] {
        let more = turnaround(&reports, set, "sampling");
        assert!(more > one + 0.03, "{set}: x{more} vs 1 instance x{one}");
    }
}

#[test]
fn exact_accounting_measures_throttle_load_within_2_5_percent() {
    let reports = common::run_scenario("loga");
    for (label, intended) in [
        ("q-l10", 10.0 * 10.0 / 1010.0),
        ("q-h10", 10.0 * 100.0 / 1100.0),
        ("q-100", 0.1),
        ("q-500", 0.5),
        ("q-900", 0.9),
    ] {
        let measured = measured_load(common::run(&reports, label));
        assert!(
            (measured - intended).abs() / intended < 0.025,
            "{label}: measured {measured} vs intended {intended}"
        );
    }
}

/// GPU shares of the VMs named in `targets` in run `label`, checked against the targets.
fn assert_shares(reports: &[RunReport], label: &str, targets: &[(&str, f64)], tolerance: f64) {
    for &(vm, target) in targets {
        let share = common::vm(reports, label, vm).gpu_share;
        assert!(
            (share - target).abs() < tolerance,
            "{label}/{vm}: share {share} vs {target}"
        );
    }
}

#[test]
fn fair_queuing_holds_backlogged_shares_within_2_percent() {
    let reports = common::run_scenario("fair");
    let equal = [
        ("q250", 0.25),
        ("q500", 0.25),
        ("q1000", 0.25),
        ("q4000", 0.25),
    ];
    assert_shares(&reports, "equal-exact", &equal, 0.02);
    assert_shares(&reports, "equal-sampling", &equal, 0.02);
    let weighted = [
        ("q250", 0.125),
        ("q500", 0.25),
        ("q1000", 0.5),
        ("q4000", 0.125),
    ];
    assert_shares(&reports, "weighted-exact", &weighted, 0.02);
    // Exact accounting keeps the GPU busy; sampling's drains and exclusive windows do not.
    assert!(common::run(&reports, "equal-exact").gpu_busy_pct > 99.0);
    assert!(common::run(&reports, "equal-sampling").gpu_busy_pct < 97.0);
}

#[test]
fn without_scheduling_the_longest_groups_take_the_gpu() {
    let reports = common::run_scenario("fair");
    for label in ["equal-none", "weighted-none"] {
        // Groups run in turn, so shares follow group cost: 4 ms of 5.75 ms is about 70 %.
        let long = common::vm(&reports, label, "q4000").gpu_share;
        assert!((0.6..0.8).contains(&long), "{label}: {long}");
        let short = common::vm(&reports, label, "q250").gpu_share;
        assert!(short < 0.1, "{label}: {short}");
    }
}

#[test]
fn fair_queuing_brings_the_application_and_throttles_to_equal_shares() {
    let reports = common::run_scenario("fair");
    let throttles = ["throttle-1", "throttle-2", "throttle-3", "throttle-4"];
    // No scheduling: the GPU-bound application takes more than half of the GPU.
    assert!(common::vm(&reports, "mix-none", "app").gpu_share > 0.5);
    for t in throttles {
        assert!(common::vm(&reports, "mix-none", t).gpu_share < 0.15, "{t}");
    }
    // Fair queuing slows the application towards its fair fifth.
    assert!(common::vm(&reports, "mix-exact", "app").gpu_share < 0.3);
    // With an idle grace covering Throttle's sleep every VM holds about a fifth.
    let fifth: Vec<(&str, f64)> = std::iter::once("app")
        .chain(throttles)
        .map(|vm| (vm, 0.2))
        .collect();
    assert_shares(&reports, "mix-exact-grace", &fifth, 0.02);
    assert_shares(&reports, "mix-sampling-grace", &fifth, 0.02);
}
