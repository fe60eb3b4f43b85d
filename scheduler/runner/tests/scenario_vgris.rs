//! VGRIS (Yu et al., HPDC 2013): the qualitative outcomes of §2 and §4 in `vgris.toml`.

mod common;

use vgpu_scheduler::sim::RunReport;

/// A policy figure of VM `vm` at the end of run `label`.
fn figure(reports: &[RunReport], label: &str, vm: &str, name: &str) -> f64 {
    let figures = &common::vm(reports, label, vm).figures;
    let found = figures.iter().find(|(n, _)| n == name);
    found.map(|(_, x)| *x).expect("figure exists")
}

/// Mean FPS of `vm` in run `label` over the series points in `[from_ms, to_ms)`.
fn fps_between(reports: &[RunReport], label: &str, vm: &str, from_ms: f64, to_ms: f64) -> f64 {
    let run = common::run(reports, label);
    let i = run.vms.iter().position(|v| v.name == vm).expect("vm");
    let series = &run.series;
    let points: Vec<f64> = series
        .t_ms
        .iter()
        .zip(&series.vms[i].fps)
        .filter(|(t, _)| **t > from_ms && **t <= to_ms)
        .map(|(_, f)| *f)
        .collect();
    assert!(!points.is_empty(), "no samples in {from_ms}..{to_ms}");
    points.iter().sum::<f64>() / points.len() as f64
}

#[test]
fn vgris_reproduces_the_papers_outcomes() {
    let r = common::run_scenario("vgris");
    let games = ["light", "medium", "heavy"];

    // Standalone: the light game runs far above the SLA, the heavy one just above it.
    assert!(common::vm(&r, "light-alone", "light").fps > 150.0);
    let heavy_alone = common::vm(&r, "heavy-alone", "heavy").fps;
    assert!((31.0..40.0).contains(&heavy_alone), "{heavy_alone}");

    // Figure 2: without scheduling the heavy game drops below 30 FPS while the light one
    // runs far above it, and most heavy frames miss the bound.
    let none_heavy = common::vm(&r, "none", "heavy");
    let none_light = common::vm(&r, "none", "light");
    assert!(none_heavy.fps < 29.5, "{}", none_heavy.fps);
    assert!(none_light.fps > 2.0 * 30.0, "{}", none_light.fps);
    assert!(none_heavy.frames_over_bound_pct > 20.0);

    // Figure 7 (acceptance): SLA-aware holds 30 FPS for all three with <= 1% of frames over
    // 1000/30 ms + 2 ms, and the heavy game gains.
    for g in games {
        let v = common::vm(&r, "sla", g);
        assert!((29.5..30.5).contains(&v.fps), "{g}: {}", v.fps);
        assert!(
            v.frames_over_bound_pct <= 1.0,
            "{g}: {}",
            v.frames_over_bound_pct
        );
        let bound = v.frame_bound_ms.expect("bound");
        assert!((bound - (1000.0 / 30.0 + 2.0)).abs() < 0.01, "{bound}");
    }
    let gain = common::vm(&r, "sla", "heavy").fps / none_heavy.fps;
    assert!(gain > 1.03, "{gain}");
    // SLA-aware gives away the light game's excess: far less GPU busy time than none.
    assert!(common::run(&r, "sla").gpu_busy_pct < common::run(&r, "none").gpu_busy_pct - 15.0);

    // Figure 10: proportional share follows the shares, equal and 2:1:1.
    for g in games {
        let s = common::vm(&r, "share", g).gpu_share;
        assert!((s - 1.0 / 3.0).abs() < 0.05, "{g}: {s}");
    }
    for (g, want) in [("light", 0.5), ("medium", 0.25), ("heavy", 0.25)] {
        let s = common::vm(&r, "share-2-1-1", g).gpu_share;
        assert!((s - want).abs() < 0.05, "{g}: {s}");
    }
    // Shares are not SLAs: with a third of the GPU the heavy game misses 30 FPS.
    assert!(common::vm(&r, "share", "heavy").fps < 25.0);

    // Figure 11: the GPU-bound game joins at 3 s and starves under equal shares; after 5 s
    // hybrid switches to SLA-aware (everyone paced to 30 FPS), and after 5 s of low GPU usage
    // back to proportional share with s_i = u_i + (1 - sum u)/n, which then meets the SLA.
    let late = ["light", "medium", "gt3-late"];
    assert!(fps_between(&r, "hybrid", "gt3-late", 4000.0, 7000.0) < 29.0);
    // Before it started the late game was idle, not starving: no switch before 3 + 5 s.
    assert!(fps_between(&r, "hybrid", "light", 6000.0, 7900.0) > 45.0);
    for g in late {
        let paced = fps_between(&r, "hybrid", g, 9000.0, 12000.0);
        assert!((29.0..31.5).contains(&paced), "{g}: {paced}");
        let end = fps_between(&r, "hybrid", g, 15000.0, 20000.0);
        assert!(end >= 30.0, "{g}: {end}");
    }
    assert!(fps_between(&r, "hybrid", "light", 15000.0, 20000.0) > 45.0);
    assert_eq!(figure(&r, "hybrid", "light", "sla_aware"), 0.0);
    let share = figure(&r, "hybrid", "gt3-late", "share");
    assert!((0.4..0.6).contains(&share), "{share}");

    // The CPU-heavy game cannot use its Equation (2) share in bursts: hybrid switches back and
    // forth, as in the rest of Figure 11.
    assert!(fps_between(&r, "hybrid-bursty", "heavy-late", 14000.0, 17000.0) < 28.0);
    assert!(fps_between(&r, "hybrid-bursty", "light", 14000.0, 17000.0) > 45.0);
    let paced = fps_between(&r, "hybrid-bursty", "light", 19000.0, 20000.0);
    assert!((29.0..31.5).contains(&paced), "{paced}");
}
