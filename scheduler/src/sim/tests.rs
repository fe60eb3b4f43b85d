//! End-to-end tests of the simulator: workloads' shapes, the CPU coupling, FCFS sharing,
//! determinism and the refusal of bad scenarios.

use std::collections::BTreeMap;

use super::*;
use crate::model::VgpuParams;
use crate::policy::PolicyConfig;

fn vm(name: &str, shape: Shape) -> VmSpec {
    VmSpec {
        name: name.into(),
        params: VgpuParams::default(),
        workload: Workload {
            shape,
            start_ms: 0,
            stop_ms: None,
            jitter: 0.0,
        },
        cpu: CpuSpec::default(),
        context: 0,
        instances: 1,
        guest: None,
    }
}

fn fcfs(label: &str) -> RunSpec {
    RunSpec {
        label: label.into(),
        paper: None,
        policy: PolicyConfig::None,
        vms: None,
        params: BTreeMap::new(),
        cpu_weight: BTreeMap::new(),
        instances: BTreeMap::new(),
        cpu_writeback: None,
        capacity: None,
        context_switch_us: None,
        grant_latency_us: None,
        cpus: None,
        wait: None,
    }
}

fn scenario(duration_ms: u64, vms: Vec<VmSpec>) -> Scenario {
    Scenario {
        name: "test".into(),
        description: String::new(),
        duration_ms,
        seed: 7,
        capacity: 1,
        context_switch_us: 0,
        grant_latency_us: 0,
        cpus: 1,
        cpu_quantum_us: 1_000,
        cpu_writeback: false,
        sample_ms: 100,
        frame_bound_ms: None,
        frame_tolerance_ms: 2.0,
        vms: Default::default(),
        vm: vms,
        run: vec![fcfs("none")],
    }
}

fn one_run(sc: &Scenario) -> RunReport {
    let mut reports = run(sc).unwrap();
    assert_eq!(reports.len(), 1);
    reports.remove(0)
}

fn bomb(cost_us: u64) -> Shape {
    Shape::Bomb { cost_us, depth: 2 }
}

#[test]
fn two_bombs_share_the_gpu_about_evenly_under_fcfs() {
    let mut sc = scenario(1_000, vec![vm("a", bomb(1_000)), vm("b", bomb(3_000))]);
    sc.context_switch_us = 10;
    let r = one_run(&sc);
    assert_eq!(r.policy, "none");
    // FCFS alternates the two bombs' groups: equal group counts, GPU time by cost.
    let (a, b) = (&r.vms[0], &r.vms[1]);
    assert!(
        a.groups.abs_diff(b.groups) <= 2,
        "{} vs {}",
        a.groups,
        b.groups
    );
    assert!((b.gpu_share - 0.75).abs() < 0.02, "{}", b.gpu_share);
    assert!(r.gpu_busy_pct > 99.9);
    // Depth 2 each: the engine switches vGPU every second group.
    assert!(r.context_switches * 2 + 4 >= a.groups + b.groups);
    let (a, b) = (&r.vms[0], &r.vms[1]);
    assert!(
        a.gpu_time_ns > a.groups * 1_000_000,
        "switch cost charged to the group"
    );
    // Same-cost bombs: 50/50.
    let r = one_run(&scenario(
        1_000,
        vec![vm("a", bomb(2_000)), vm("b", bomb(2_000))],
    ));
    assert!((r.vms[0].gpu_share - 0.5).abs() < 0.01);
    assert!(b.latency_p50_us > 3_000.0);
}

#[test]
fn throttle_load_is_kernel_over_period_standalone() {
    for (n, m, load) in [(100, 900, 0.1), (1_000, 100, 0.909), (99, 901, 0.099)] {
        let sc = scenario(
            2_000,
            vec![vm(
                "t",
                Shape::Throttle {
                    kernel_us: n,
                    sleep_us: m,
                },
            )],
        );
        let r = one_run(&sc);
        let util = r.vms[0].gpu_util;
        assert!((util - load).abs() / load < 0.01, "N={n} M={m}: {util}");
        assert!((r.vms[0].latency_p99_us - n as f64).abs() <= n as f64 * 0.01);
    }
}

#[test]
fn periodic_work_follows_its_period() {
    let sc = scenario(
        1_000,
        vec![vm(
            "w",
            Shape::Periodic {
                cost_us: 2_000,
                period_us: 10_000,
            },
        )],
    );
    let r = one_run(&sc);
    // Ticks at 0, 10, ... 990 ms complete; the one at 1000 ms does not by the end.
    assert_eq!(r.vms[0].groups, 100);
    assert!((r.vms[0].gpu_util - 0.2).abs() < 1e-9);
    assert!((r.vms[0].latency_p50_us - 2_000.0).abs() < 20.0);
    // Behind a bomb of 5 ms groups, a periodic group waits for the group in flight.
    let mut sc = sc;
    sc.vm.push(vm(
        "bomb",
        Shape::Bomb {
            cost_us: 5_000,
            depth: 1,
        },
    ));
    let r = one_run(&sc);
    assert!(r.vms[0].latency_p99_us > 5_000.0);
}

#[test]
fn frames_go_through_the_present_round_trip() {
    let shape = Shape::Frames {
        cpu_us: 2_000,
        groups: 4,
        cost_us: 1_500,
        present_us: 1_000,
    };
    let mut game = vm("game", shape);
    game.params.target_fps = Some(100.0);
    let sc = scenario(1_000, vec![game]);
    let r = one_run(&sc);
    let g = &r.vms[0];
    // A frame takes 2 + 4 x 1.5 + 1 = 9 ms: about 111 frames a second.
    assert!(
        (g.frame_time_p50_ms - 9.0).abs() < 0.1,
        "{}",
        g.frame_time_p50_ms
    );
    assert_eq!(g.frames, 111);
    assert_eq!(r.decision_counts.present, 111);
    assert!((g.frame_latency_p50_ms - 9.0).abs() < 0.1);
    assert_eq!(g.frame_bound_ms, Some(12.0));
    assert_eq!(g.frames_over_bound_pct, 0.0);
    assert!(g.cpu_time_ns >= 111 * 2_000_000);
    // The series has one point per 100 ms with about 111 FPS in each.
    assert_eq!(r.series.t_ms.len(), 10);
    assert!(
        r.series.vms[0]
            .fps
            .iter()
            .all(|&f| (100.0..=120.0).contains(&f))
    );
    // Against a bomb under FCFS the game slows down and misses its bound.
    let mut sc = sc;
    sc.vm.push(vm("bomb", bomb(8_000)));
    let r = one_run(&sc);
    assert!(r.vms[0].fps < 60.0, "{}", r.vms[0].fps);
    assert!(r.vms[0].frames_over_bound_pct > 90.0);
}

#[test]
fn cpu_weights_share_the_host_among_coupled_vms() {
    let coupled = Shape::Coupled {
        cpu_us: 20_000,
        cost_us: 10,
        wait: Wait::Block,
    };
    let mut a = vm("a", coupled.clone());
    a.cpu.weight = 100;
    let mut b = vm("b", coupled);
    b.cpu.weight = 300;
    let mut sc = scenario(2_000, vec![a, b]);
    let r = one_run(&sc);
    let ratio = r.vms[1].cpu_time_ns as f64 / r.vms[0].cpu_time_ns as f64;
    assert!((ratio - 3.0).abs() < 0.2, "{ratio}");
    assert!((r.vms[1].work_per_sec / r.vms[0].work_per_sec - 3.0).abs() < 0.3);
    // With two cores both run all the time.
    sc.cpus = 2;
    let r = one_run(&sc);
    assert!((r.vms[0].cpu_time_ns as f64 / r.vms[1].cpu_time_ns as f64 - 1.0).abs() < 0.01);
    // So they do with a run that overrides the core count.
    sc.cpus = 1;
    sc.run[0].cpus = Some(2);
    let r = one_run(&sc);
    assert!((r.vms[0].cpu_time_ns as f64 / r.vms[1].cpu_time_ns as f64 - 1.0).abs() < 0.01);
    // A run may change the weights.
    sc.run[0].cpus = None;
    sc.run[0].cpu_weight.insert("a".into(), 300);
    let r = one_run(&sc);
    let ratio = r.vms[1].cpu_time_ns as f64 / r.vms[0].cpu_time_ns as f64;
    assert!((ratio - 1.0).abs() < 0.05, "{ratio}");
}

fn coupled(cpu_us: u64, cost_us: u64, wait: Wait) -> Shape {
    Shape::Coupled {
        cpu_us,
        cost_us,
        wait,
    }
}

#[test]
fn a_spinning_coupled_loop_uses_the_cpu_while_it_waits_for_the_gpu() {
    // 1 ms of CPU, then a 3 ms GPU call: blocking, the vCPU is busy a quarter of the time;
    // spinning, all the time. The loop runs at the same 250 iterations/s either way.
    let ms = 1_000_000.0;
    for (wait, want_ms) in [(Wait::Block, 250.0), (Wait::Spin, 1_000.0)] {
        let r = one_run(&scenario(1_000, vec![vm("a", coupled(1_000, 3_000, wait))]));
        let cpu_ms = r.vms[0].cpu_time_ns as f64 / ms;
        assert!((cpu_ms - want_ms).abs() <= 5.0, "{wait:?}: {cpu_ms} ms");
        assert!((r.vms[0].work_per_sec - 250.0).abs() <= 1.0, "{wait:?}");
    }
    // A run may switch the wait.
    let mut sc = scenario(1_000, vec![vm("a", coupled(1_000, 3_000, Wait::Block))]);
    sc.run[0].wait = Some(Wait::Spin);
    let cpu_ms = one_run(&sc).vms[0].cpu_time_ns as f64 / ms;
    assert!((cpu_ms - 1_000.0).abs() <= 5.0, "{cpu_ms} ms");
    // It stops polling when the workload stops.
    let mut a = vm("a", coupled(1_000, 3_000, Wait::Spin));
    a.workload.stop_ms = Some(500);
    let r = one_run(&scenario(1_000, vec![a]));
    let cpu_ms = r.vms[0].cpu_time_ns as f64 / ms;
    assert!((cpu_ms - 500.0).abs() <= 5.0, "{cpu_ms} ms");
}

#[test]
fn a_spinning_vm_takes_the_core_from_a_cpu_bound_neighbour() {
    // A CPU-bound loop (20 ms of CPU per 10 µs GPU call) beside a loop that mostly waits
    // for 5 ms GPU calls: a sleeping waiter leaves it most of the core (it loses only the time
    // its short calls queue behind the long ones on the GPU), a spinning one takes half of it
    // (equal CPU weights) and slows it down accordingly.
    let mut got = Vec::new();
    for wait in [Wait::Block, Wait::Spin] {
        let sc = scenario(
            2_000,
            vec![
                vm("cpu", coupled(20_000, 10, Wait::Block)),
                vm("gpu", coupled(100, 5_000, wait)),
            ],
        );
        let r = one_run(&sc);
        let share = r.vms[0].cpu_time_ns as f64 / 2e9;
        got.push((share, r.vms[0].work_per_sec, r.vms[1].work_per_sec));
    }
    let (block, spin) = (got[0], got[1]);
    assert!(block.0 > 0.8, "{block:?}");
    assert!((spin.0 - 0.5).abs() < 0.03, "{spin:?}");
    assert!(spin.1 < 0.6 * block.1, "{block:?} {spin:?}");
    // The waiter's own loop runs at about the same rate either way.
    assert!(spin.2 > 0.8 * block.2, "{block:?} {spin:?}");
}

#[test]
fn the_same_seed_gives_the_same_reports() {
    let mut game = vm(
        "game",
        Shape::Frames {
            cpu_us: 1_000,
            groups: 3,
            cost_us: 2_000,
            present_us: 300,
        },
    );
    game.workload.jitter = 0.3;
    let mut b = vm("bomb", bomb(4_000));
    b.workload.jitter = 0.5;
    let mut sc = scenario(500, vec![game, b]);
    sc.run.push(RunSpec {
        vms: Some(vec!["game".into()]),
        ..fcfs("alone")
    });
    let first = run(&sc).unwrap();
    assert_eq!(first, run(&sc).unwrap());
    assert_eq!(first[1].vms.len(), 1);
    sc.seed = 8;
    assert_ne!(first, run(&sc).unwrap());
}

#[test]
fn workloads_issue_work_only_in_their_window() {
    let mut b = vm("b", bomb(1_000));
    b.workload.start_ms = 200;
    b.workload.stop_ms = Some(700);
    let r = one_run(&scenario(1_000, vec![b]));
    assert!(
        (r.vms[0].gpu_util - 0.5).abs() < 0.01,
        "{}",
        r.vms[0].gpu_util
    );
    let share = &r.series.vms[0].gpu_share;
    assert_eq!(share[0], 0.0);
    assert!(share[3] > 0.99);
    assert_eq!(share[9], 0.0);
}

#[test]
fn instances_multiply_a_vm_and_runs_override_params() {
    let mut t = vm(
        "t",
        Shape::Throttle {
            kernel_us: 100,
            sleep_us: 900,
        },
    );
    t.instances = 3;
    let mut sc = scenario(100, vec![t]);
    sc.run[0].instances.insert("t".into(), 5);
    sc.run[0].params.insert(
        "t".into(),
        ParamsOverride {
            weight: Some(0),
            ..ParamsOverride::default()
        },
    );
    assert!(matches!(run(&sc), Err(SimError::Sched { .. })));
    sc.run[0].params.clear();
    let r = one_run(&sc);
    let names: Vec<_> = r.vms.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["t-1", "t-2", "t-3", "t-4", "t-5"]);
    assert!((r.gpu_busy_pct - 50.0).abs() < 1.0);
}

#[test]
fn bad_scenarios_are_refused_with_the_field() {
    let good = scenario(100, vec![vm("a", bomb(1_000))]);
    let mut sc = good.clone();
    sc.run[0].vms = Some(vec!["nope".into()]);
    assert_eq!(
        run(&sc),
        Err(SimError::UnknownVm {
            run: "none".into(),
            field: "vms",
            name: "nope".into()
        })
    );
    let mut sc = good.clone();
    sc.vm[0].workload.shape = Shape::Bomb {
        cost_us: 0,
        depth: 1,
    };
    let err = run(&sc).unwrap_err().to_string();
    assert_eq!(err, "vm.a.workload.cost_us: must be positive");
    let mut sc = good.clone();
    sc.vm[0].workload.jitter = f64::NAN;
    assert!(run(&sc).is_err());
    let mut sc = good.clone();
    sc.duration_ms = 0;
    assert!(run(&sc).is_err());
    let mut sc = good.clone();
    sc.vm.push(vm("a", bomb(1)));
    assert!(run(&sc).unwrap_err().to_string().contains("duplicate"));
    let mut sc = good;
    sc.vm[0].workload.shape = Shape::Frames {
        cpu_us: 0,
        groups: 0,
        cost_us: 5,
        present_us: 0,
    };
    assert!(run(&sc).is_err());
}

#[test]
fn grant_latency_delays_engaged_dispatches() {
    // Back-to-back 1 ms kernels, one group at a time: each waits for its grant on an idle GPU.
    let shape = Shape::Throttle {
        kernel_us: 1_000,
        sleep_us: 0,
    };
    let mut sc = scenario(1_000, vec![vm("t", shape)]);
    sc.grant_latency_us = 100;
    let mut off = fcfs("off");
    off.grant_latency_us = Some(0);
    sc.run.push(off);
    let reports = run(&sc).unwrap();
    let (with, without) = (&reports[0].vms[0], &reports[1].vms[0]);
    assert!(
        (with.gpu_util - 1.0 / 1.1).abs() < 0.002,
        "{}",
        with.gpu_util
    );
    let p50 = with.latency_p50_us;
    assert!((p50 - 1_100.0).abs() < 1_100.0 * 0.02, "{p50}");
    assert!(
        without.latency_p50_us < 1_050.0,
        "{}",
        without.latency_p50_us
    );
    assert!(without.gpu_util > 0.999, "{}", without.gpu_util);
    // With two groups online the next grant travels while the current group runs.
    let mut sc = scenario(1_000, vec![vm("b", bomb(1_000))]);
    sc.grant_latency_us = 100;
    sc.capacity = 2;
    let r = one_run(&sc);
    assert!(r.gpu_busy_pct > 99.0, "{}", r.gpu_busy_pct);
    // Out-of-range latencies are refused, at the top level and per run.
    sc.grant_latency_us = MAX_STEP_US + 1;
    assert!(matches!(run(&sc), Err(SimError::Invalid { .. })));
    sc.grant_latency_us = 0;
    sc.run[0].grant_latency_us = Some(MAX_STEP_US + 1);
    assert!(matches!(run(&sc), Err(SimError::Invalid { .. })));
}
