//! TimeGraph's experiments (Kato et al., USENIX ATC 2011, §6.1 Figures 8 and 9, §6.3 Figure
//! 15) in the simulator: `scenarios/timegraph.toml` and `scenarios/overhead.toml`.

mod common;

use vgpu_scheduler::sim::{RunReport, VmReport};

/// The game's frame rate in run `label`.
fn fps(reports: &[RunReport], label: &str) -> f64 {
    common::vm(reports, label, "game").fps
}

/// The policy's figure `key` for a VM at the end of its run.
fn figure(vm: &VmReport, key: &str) -> Option<f64> {
    vm.figures.iter().find(|(k, _)| k == key).map(|&(_, x)| x)
}

/// The bombs' VMs in run `label`.
fn bombs<'a>(reports: &'a [RunReport], label: &str) -> Vec<&'a VmReport> {
    let bombs: Vec<_> = common::run(reports, label)
        .vms
        .iter()
        .filter(|v| v.name.starts_with("bomb"))
        .collect();
    assert!(!bombs.is_empty(), "{label}: no bombs");
    bombs
}

/// The bombs' GPU time in run `label`, as a fraction of the run's duration.
fn bomb_util(reports: &[RunReport], label: &str) -> f64 {
    bombs(reports, label).iter().map(|v| v.gpu_util).sum()
}

#[test]
fn priorities_and_reserves_isolate_the_game_from_clearspd_bombs() {
    let r = common::run_scenario("timegraph");
    let alone = fps(&r, "standalone");
    assert!(alone > 60.0, "standalone game at {alone} FPS");
    for n in ["1bomb", "5bombs"] {
        let none = fps(&r, &format!("none-{n}"));
        let ht = fps(&r, &format!("ht-{n}"));
        // Without scheduling the bombs take a large part of the GPU from the game.
        assert!(none < 0.7 * alone, "{n}: none {none} vs alone {alone}");
        // Priorities alone: the game waits at most for one bomb group per scheduling point.
        assert!(ht > 0.9 * alone, "{n}: ht {ht} vs alone {alone}");
        assert!(ht > 1.4 * none, "{n}: ht {ht} vs none {none}");
        // PRT for everybody gives the same isolation here (no grant round trip to hide).
        let prt = fps(&r, &format!("prt-{n}"));
        assert!((prt - ht).abs() < 0.02 * ht, "{n}: prt {prt} vs ht {ht}");
    }
    // Five bombs: vanilla is several times worse than TimeGraph with priorities.
    let (none5, ht5) = (fps(&r, "none-5bombs"), fps(&r, "ht-5bombs"));
    assert!(ht5 > 3.0 * none5, "ht {ht5} vs none {none5}");
    // Priority plus reservation keeps the game within 3% of standalone against 5 bombs (and
    // against one).
    for label in [
        "pe-1bomb",
        "ae-1bomb",
        "pe-5bombs",
        "ae-5bombs",
        "shared-5bombs",
    ] {
        let f = fps(&r, label);
        assert!(f >= 0.97 * alone, "{label}: {f} vs standalone {alone}");
        // Reserves help beyond priorities.
        let ht = fps(&r, &format!("ht-{}", label.split_once('-').unwrap().1));
        assert!(f > ht, "{label}: {f} vs {ht}");
    }
    // Reserves cap the bombs' GPU time near the 10% reserved for them in total: PE and Shared
    // overrun by at most about one group per period, AE predicts and does not overrun.
    for label in ["pe-1bomb", "pe-5bombs", "shared-5bombs"] {
        let u = bomb_util(&r, label);
        assert!((0.08..0.115).contains(&u), "{label}: bombs at {u}");
    }
    for label in ["ae-1bomb", "ae-5bombs"] {
        let u = bomb_util(&r, label);
        assert!(u > 0.02 && u <= 0.10, "{label}: bombs at {u}");
    }
    // Unreserved, the bombs take far more: everything the game leaves idle.
    for label in ["ht-1bomb", "ht-5bombs"] {
        let u = bomb_util(&r, label);
        assert!(u > 0.2, "{label}: bombs at {u}");
    }
    // Five private PE reserves of 0.5 ms each: each bomb near its 2% share.
    for b in bombs(&r, "pe-5bombs") {
        assert!(
            (0.015..0.025).contains(&b.gpu_util),
            "{}: {}",
            b.name,
            b.gpu_util
        );
    }
    // The Shared run is configured by spec lines: the bombs joined the reserve of 2.5 ms / 25
    // ms and the game kept its priority without a reserve.
    for b in bombs(&r, "shared-5bombs") {
        let fig = |k: &str| figure(b, k);
        assert_eq!(fig("admitted"), Some(1.0), "{}", b.name);
        assert_eq!(fig("capacity_ns"), Some(2_500_000.0), "{}", b.name);
        assert_eq!(fig("period_ns"), Some(25_000_000.0), "{}", b.name);
    }
    let game = common::vm(&r, "shared-5bombs", "game");
    assert_eq!(figure(game, "priority"), Some(10.0));
    assert_eq!(figure(game, "admitted"), Some(0.0));
}

#[test]
fn ht_costs_little_and_prt_costs_a_grant_per_group() {
    let r = common::run_scenario("overhead");
    // Each run has one VM, the game.
    let fps = |label: &str| common::run(&r, label).vms[0].fps;
    let overhead = |off: &str, on: &str| {
        let (off, on) = (fps(off), fps(on));
        assert!(off > 0.0);
        1.0 - on / off
    };
    for (off, ht, prt, prt_min) in [
        ("off", "ht", "prt", 0.02),
        ("off-fine", "ht-fine", "prt-fine", 0.08),
    ] {
        let ht_cost = overhead(off, ht);
        let prt_cost = overhead(off, prt);
        assert!((0.0..0.02).contains(&ht_cost), "{ht}: {ht_cost}");
        assert!(prt_cost > prt_min, "{prt}: {prt_cost}");
        assert!(
            prt_cost > 3.0 * ht_cost,
            "{prt} {prt_cost} vs {ht} {ht_cost}"
        );
    }
    // More groups per frame cost PRT more grants.
    assert!(overhead("off-fine", "prt-fine") > 2.0 * overhead("off", "prt"));
}
