//! Pegasus (Gupta et al., USENIX ATC 2011) experiments: GPU time in proportion to the domains'
//! credits (`pegasus.toml`) and BlackScholes-like coupled loops (`pegasus-coupled.toml`).

mod common;

use vgpu_scheduler::sim::RunReport;

/// The domains, in the order of their credits 256/512/1024/256.
const DOMS: [&str; 4] = ["dom1", "dom2", "dom3", "dom4"];

/// Each domain's GPU share under the credits 256/512/1024/256 (1:2:4:1).
const CREDIT_SHARES: [f64; 4] = [0.125, 0.25, 0.5, 0.125];

fn shares(reports: &[RunReport], label: &str) -> Vec<f64> {
    DOMS.iter()
        .map(|d| common::vm(reports, label, d).gpu_share)
        .collect()
}

fn work(reports: &[RunReport], label: &str) -> Vec<f64> {
    DOMS.iter()
        .map(|d| common::vm(reports, label, d).work_per_sec)
        .collect()
}

fn total_work(reports: &[RunReport], label: &str) -> f64 {
    work(reports, label).iter().sum()
}

/// Asserts every share is within `rel` (relative) of the expected one.
fn assert_shares(reports: &[RunReport], label: &str, want: &[f64], rel: f64) {
    let got = shares(reports, label);
    for ((d, g), w) in DOMS.iter().zip(&got).zip(want) {
        assert!(
            (g - w).abs() <= rel * w,
            "{label}: {d} GPU share {g:.4}, want {w:.4} ± {:.0}%",
            rel * 100.0
        );
    }
}

/// Asserts the largest and smallest value are within `rel` of each other.
fn assert_even(label: &str, what: &str, xs: &[f64], rel: f64) {
    let max = xs.iter().copied().fold(f64::MIN, f64::max);
    let min = xs.iter().copied().fold(f64::MAX, f64::min);
    assert!(
        max - min <= rel * max,
        "{label}: {what} not even within {:.0}%: {xs:?}",
        rel * 100.0
    );
}

#[test]
fn gpu_bound_domains_get_gpu_time_in_proportion_to_their_credits() {
    let r = common::run_scenario("pegasus");
    for run in &r {
        assert!(run.gpu_busy_pct > 99.0, "{}: GPU idle", run.label);
    }
    // Acceptance: within 2% of 1:2:4:1 under AccC and XC (CPU weights = GPU credits). AugC
    // and CoSched have no vCPU on a CPU to favour here, so they keep the credit proportion.
    for label in ["accc", "xc", "augc", "cosched"] {
        assert_shares(&r, label, &CREDIT_SHARES, 0.02);
    }
    // XC follows the CPU credits: equal CPU weights give equal GPU shares.
    assert_shares(&r, "xc-equal-cpu", &[0.25; 4], 0.02);
    // RR: one tick each, equal shares (a 4 ms kernel overruns the 10 ms tick by up to 2 ms).
    assert_shares(&r, "rr", &[0.25; 4], 0.12);
    // None: each domain gets one kernel in turn, so the shares follow the kernel sizes
    // 4:2:1:2 ms and the domain with the most credits gets the least.
    let kernels = [4.0, 2.0, 1.0, 2.0];
    let sum: f64 = kernels.iter().sum();
    let by_kernel: Vec<f64> = kernels.iter().map(|k| k / sum).collect();
    assert_shares(&r, "none", &by_kernel, 0.03);
    // SLAF keeps the credit order and meets every SLO (GPU time per second).
    let slaf = shares(&r, "slaf");
    assert!(
        slaf[2] > slaf[1] && slaf[1] > slaf[0] && slaf[1] > slaf[3],
        "{slaf:?}"
    );
    for (d, slo) in DOMS.iter().zip([0.1, 0.2, 0.4, 0.1]) {
        let util = common::vm(&r, "slaf", d).gpu_util;
        assert!(
            util >= slo,
            "slaf: {d} GPU utilisation {util:.3} below SLO {slo}"
        );
    }
}

#[test]
fn coupled_loops_credits_favour_dom3_without_changing_total_work() {
    let r = common::run_scenario("pegasus-coupled");
    for set in ["eqcpu", "propcpu"] {
        let l = |p: &str| format!("{p}-{set}");
        let none = work(&r, &l("none"));
        // Credit-based policies give Dom3 (1024 credits) clearly more work than None does,
        // and more than any other domain; Dom3's median GPU-call latency drops.
        let credit_runs: &[&str] = if set == "eqcpu" {
            &["accc", "slaf", "augc", "cosched"]
        } else {
            &["accc", "xc", "slaf", "augc", "cosched"]
        };
        for p in credit_runs {
            let w = work(&r, &l(p));
            assert!(
                w[2] >= 1.2 * none[2],
                "{}: dom3 {w:?} vs none {none:?}",
                l(p)
            );
            assert!(
                w.iter().all(|&x| x <= w[2]),
                "{}: dom3 not first {w:?}",
                l(p)
            );
            let lat = common::vm(&r, &l(p), "dom3").latency_p50_us;
            let lat_none = common::vm(&r, &l("none"), "dom3").latency_p50_us;
            assert!(
                lat <= 0.75 * lat_none,
                "{}: dom3 p50 {lat} vs none {lat_none}",
                l(p)
            );
        }
        // The GPU stays busy whatever the policy, so total work is the same within 2%: the
        // policies move work between domains. AugC and CoSched do as well as XC.
        let base = total_work(&r, &l("none"));
        for p in ["rr", "accc", "xc", "slaf", "augc", "cosched"] {
            let t = total_work(&r, &l(p));
            assert!(
                (t - base).abs() <= 0.02 * base,
                "{}: total {t} vs {base}",
                l(p)
            );
        }
        let xc = total_work(&r, &l("xc"));
        for p in ["augc", "cosched"] {
            let t = total_work(&r, &l(p));
            assert!(t >= 0.98 * xc, "{}: total {t} below xc {xc}", l(p));
        }
        // RR ignores credits: even work.
        assert_even(&l("rr"), "work", &work(&r, &l("rr")), 0.1);
    }
    // Equal CPU weights: None and XC (which reads the CPU weights) are even.
    assert_even("none-eqcpu", "work", &work(&r, "none-eqcpu"), 0.1);
    assert_even("xc-eqcpu", "work", &work(&r, "xc-eqcpu"), 0.05);
    // Proportional CPU weights: the CPU scheduler alone already favours Dom3 under None.
    let none_prop = work(&r, "none-propcpu");
    assert!(none_prop[2] > 1.1 * none_prop[0], "{none_prop:?}");
}

fn p50s(reports: &[RunReport], label: &str) -> Vec<f64> {
    DOMS.iter()
        .map(|d| common::vm(reports, label, d).latency_p50_us)
        .collect()
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

#[test]
fn spinning_guests_let_cosched_shorten_calls_but_add_no_work() {
    let r = common::run_scenario("pegasus-coupled");
    let policies = ["none", "xc", "accc", "augc", "cosched"];
    // One core: the polling guests keep it saturated (a quarter each), so the CPU, not the
    // GPU, limits the loops: less total work than with sleeping guests and the same under
    // every policy, since a call rarely waits for another on the GPU.
    let block = total_work(&r, "none-eqcpu");
    let spin = total_work(&r, "none-spin");
    assert!(spin < 0.85 * block, "spin {spin} vs block {block}");
    for p in policies {
        let label = format!("{p}-spin");
        for d in DOMS {
            let cpu_ms = common::vm(&r, &label, d).cpu_time_ns as f64 / 1e6;
            assert!(
                (cpu_ms - 1500.0).abs() <= 15.0,
                "{label}: {d} CPU {cpu_ms} ms"
            );
        }
        let t = total_work(&r, &label);
        assert!(
            (t - spin).abs() <= 0.01 * spin,
            "{label}: total {t} vs {spin}"
        );
    }
    // Two cores (two domains each): the GPU is the bottleneck again and the total is the
    // same under every policy. CoSched serves the calls of domains whose vCPUs are on a
    // core first: every domain's median call latency is below XC's and None's, at the
    // price of a longer tail.
    let xc = total_work(&r, "xc-spin2");
    for p in policies {
        let label = format!("{p}-spin2");
        assert!(
            common::run(&r, &label).gpu_busy_pct > 99.0,
            "{label}: GPU idle"
        );
        let t = total_work(&r, &label);
        assert!((t - xc).abs() <= 0.01 * xc, "{label}: total {t} vs xc {xc}");
    }
    let cosched = p50s(&r, "cosched-spin2");
    for base in ["xc-spin2", "none-spin2"] {
        let other = p50s(&r, base);
        assert!(
            cosched.iter().zip(&other).all(|(c, o)| c < o),
            "cosched p50 {cosched:?} vs {base} {other:?}"
        );
        assert!(
            mean(&cosched) <= 0.97 * mean(&other),
            "cosched p50 {cosched:?} vs {base} {other:?}"
        );
    }
    let p99 = |label: &str| {
        DOMS.iter()
            .map(|d| common::vm(&r, label, d).latency_p99_us)
            .fold(f64::MIN, f64::max)
    };
    assert!(p99("cosched-spin2") > p99("none-spin2"));
}
