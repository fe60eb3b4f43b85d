//! Two real guests share the vGPU under the `vgpu-schedd` daemon, as the demo shows them
//! (`vgpu-bench live-switch`, tests/src/live_switch.rs): "bomb" keeps a GPU command bomb in
//! flight and "game" renders frames with the guest tool `vgpu-load` (the load capset, run on
//! the daemon's simulated engine). The daemon starts with policy none; after the game's first
//! phase `vgpuctl set-policy` installs TimeGraph with the game prioritised (HT, priority 10) and
//! the bomb capped by a PE reserve, and the game's second phase must render faster with lower
//! group latency. Both guests are driven through the host-guest control channel: the workloads
//! start once both guests booted and stop when the host says, and each phase's preconditions
//! (both VMs busy all through its window, the policy in force) are asserted before its figures
//! are compared. The vgpuctl transcript is printed to stderr.
//!
//! Skipped with a message when the guest image is missing, unless `VGPU_REQUIRE_GUEST` is set
//! (test.sh). Each QEMU runs in its own CPU cgroup where this process may create one.

use std::time::{Duration, Instant};

use vgpu_tests::daemon::Schedd;
use vgpu_tests::guest::{self, boot_lock, skip_without_guest};
use vgpu_tests::live_switch::{self, LiveSwitch};

/// Longest wait for both TCG guests to boot side by side.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// The measured window of each game phase (policy none, then TimeGraph).
const PHASE: Duration = Duration::from_secs(15);
/// The policy installed half-way.
const TIMEGRAPH: &str = "policy = \"timegraph\"\nsched = \"ht\"\n\
    specs = [\"<game:ht:none:10:1:1>\", \"<bomb:prt:pe:0:5000:25000>\"]\n";
/// The frame rate TimeGraph must at least multiply the game's by (about 2.8x here).
const MIN_FPS_GAIN: f64 = 1.3;

fn report(test: &str, what: &str) {
    guest::report("guest_sched", test, what);
}

#[test]
fn live_timegraph_prioritises_the_game_over_a_bomb() {
    const TEST: &str = "live_timegraph_prioritises_the_game_over_a_bomb";
    let Some(image) = skip_without_guest() else {
        return;
    };
    let _lock = boot_lock();
    let started = Instant::now();
    let schedd = Schedd::start_logging(None, "info").unwrap();
    let cfg = LiveSwitch {
        phase: PHASE,
        gl: false,
        policy_file: schedd.write("timegraph.toml", TIMEGRAPH).unwrap(),
        policy_name: "timegraph".into(),
        boot_timeout: BOOT_TIMEOUT,
    };
    let r = live_switch::run(&schedd, &image, &cfg, |what| report(TEST, what))
        .unwrap_or_else(|e| panic!("{e}\ndaemon log:\n{}", schedd.log()));
    let verdict = live_switch::verdict(&r);
    report(
        TEST,
        &format!("{} (total {:?})", verdict.trim_end(), started.elapsed()),
    );
    // The comparison's preconditions: both VMs busy through both windows, each policy in force.
    for (phase, p) in [("none", &r.before), ("timegraph", &r.after)] {
        assert_eq!(p.policy, phase);
        assert!(
            p.failures.is_empty(),
            "phase {phase}: {:?}\n{verdict}",
            p.failures
        );
    }
    assert!(
        r.bomb_summary.is_some(),
        "the bomb reports its own summary when stopped"
    );
    let fps = |p: &live_switch::Phase| p.guest_fps().expect("the game's fps");
    let p50 = |p: &live_switch::Phase| p.guest_p50_us().expect("the game's p50");
    let (fps_none, fps_tg) = (fps(&r.before), fps(&r.after));
    // The guest's own count and the daemon's agree (both count the same frames; the guest's
    // run is a little longer than the window).
    for p in [&r.before, &r.after] {
        assert!(
            (fps(p) - p.daemon_fps).abs() <= 0.25 * p.daemon_fps.max(1.0),
            "the game's own frame rate {} and the daemon's {} disagree\n{verdict}",
            fps(p),
            p.daemon_fps
        );
    }
    assert!(
        fps_tg >= fps_none * MIN_FPS_GAIN,
        "TimeGraph should raise the game's frame rate: {fps_none} -> {fps_tg} fps\n{verdict}"
    );
    assert!(
        p50(&r.after) < p50(&r.before),
        "TimeGraph should cut the game's group latency\n{verdict}"
    );
}
