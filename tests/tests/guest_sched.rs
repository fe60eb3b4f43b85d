//! Two real guests share the vGPU under the `vgpu-schedd` daemon: "bomb" keeps a GPU command
//! bomb in flight and "game" renders frames with the guest tool `vgpu-load` (the load capset,
//! run on the daemon's simulated engine). The daemon starts with policy none; after the game's
//! first phase `vgpuctl set-policy` installs TimeGraph with the game prioritised (HT, priority
//! 10) and the bomb capped by a PE reserve, and the game's second phase must render faster with
//! lower group latency. The vgpuctl transcript is printed to stderr.
//!
//! Skipped with a message when the guest image is missing, unless `VGPU_REQUIRE_GUEST` is set
//! (test.sh). Each QEMU runs in its own CPU cgroup where this process may create one.

use std::time::{Duration, Instant};

use vgpu_tests::daemon::Schedd;
use vgpu_tests::guest::{self, RunningGuest, boot_lock, skip_without_guest};

/// Wall-clock limit of each guest: two TCG guests boot side by side, then run their loads.
const GUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// Seconds of each game phase (policy none, then TimeGraph).
const PHASE_S: u32 = 15;
/// The bomb's run: the game's boot under TCG (up to a minute beside the bomb, two with the
/// host's cores busy with other work too), both phases and the pause between them fit in it
/// with room to spare; the bomb is killed once the game is done, and the test fails if it ended
/// before the second phase did.
const BOMB_S: u32 = 240;
/// The game's pause between its phases, in which the host sees the first phase's end and
/// installs TimeGraph (three `vgpuctl` calls, well under a second on an idle host; 2 s was
/// tight with the host's cores busy). The guests have no way yet to be told when to start.
const PAUSE_S: u32 = 10;
/// The policy installed half-way.
const TIMEGRAPH: &str = "policy = \"timegraph\"\nsched = \"ht\"\n\
    specs = [\"<game:ht:none:10:1:1>\", \"<bomb:prt:pe:0:5000:25000>\"]\n";
/// The frame rate TimeGraph must at least multiply the game's by (about 2.5x here).
const MIN_FPS_GAIN: f64 = 1.3;

fn report(test: &str, what: &str) {
    guest::report("guest_sched", test, what);
}

/// A number field of a vgpu-load JSON summary line.
fn field(summary: &str, key: &str) -> f64 {
    let pattern = format!("\"{key}\":");
    let rest = &summary[summary.find(&pattern).expect(key) + pattern.len()..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end]
        .parse()
        .unwrap_or_else(|_| panic!("{key} in {summary}"))
}

/// The vgpu-load summary line the game's job printed after `tag`.
fn summary<'a>(output: &'a str, tag: &str) -> &'a str {
    output
        .lines()
        .find_map(|l| l.strip_prefix(tag))
        .unwrap_or_else(|| panic!("no {tag} line in the game's output:\n{output}"))
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
    let policy = schedd.write("timegraph.toml", TIMEGRAPH).unwrap();

    let bomb_job = format!(
        "echo BOMB-RUNNING\nvgpu-load bomb --cost-us 4000 --depth 8 --duration-s {BOMB_S} --json | grep '\"summary\"'"
    );
    let config = schedd.guest_config(&image, "bomb", bomb_job);
    let mut bomb =
        RunningGuest::launch_until(&config.timeout(GUEST_TIMEOUT), "BOMB-RUNNING").unwrap();
    report(TEST, &format!("bomb running after {:?}", started.elapsed()));
    let game_job = format!(
        "for phase in 1 2; do
    echo PHASE$phase-START
    vgpu-load frames --groups 4 --cost-us 2000 --cpu-us 1000 --duration-s {PHASE_S} --json \
        | grep '\"summary\"' | sed \"s/^/PHASE$phase /\"
    [ $phase = 1 ] && echo PHASE1-DONE && sleep {PAUSE_S}
done
true"
    );
    let mut game = RunningGuest::launch(
        &schedd
            .guest_config(&image, "game", game_job)
            .timeout(GUEST_TIMEOUT),
    )
    .unwrap();
    if let Some(path) = game.cgroup_path() {
        report(TEST, &format!("game's QEMU in {}", path.display()));
    }
    assert!(
        game.wait_for_serial(|l| l.starts_with("PHASE1-DONE"), |_| {})
            .unwrap(),
        "the game's guest exited in its first phase"
    );
    report(
        TEST,
        &format!("game phase 1 done after {:?}", started.elapsed()),
    );
    schedd.transcript(&["list"]).unwrap();
    schedd.transcript(&["show"]).unwrap();
    let answer = schedd
        .transcript(&["set-policy", policy.to_str().unwrap()])
        .unwrap();
    assert!(answer.contains("timegraph"), "{answer}");
    // The precondition of the comparison: TimeGraph was in force for the whole second phase.
    let game_serial = std::fs::read_to_string(game.dir().join("serial.log")).unwrap();
    assert!(
        !game_serial.contains("PHASE2-START"),
        "TimeGraph was installed after the game's second phase began (the host took more than \
         the {PAUSE_S} s pause); the phases cannot be compared"
    );
    let run = game.wait(|_| {}).unwrap();
    assert_eq!(run.exit_code, Some(0), "{}", run.logs());
    schedd.transcript(&["show"]).unwrap();
    // The bomb has served its purpose if its load is still running now, after both phases.
    let bomb_serial = std::fs::read_to_string(bomb.dir().join("serial.log")).unwrap();
    assert!(
        !bomb_serial.contains("\"summary\"") && !bomb_serial.contains("VGPU-EXIT"),
        "the bomb finished before the game's second phase:\n{bomb_serial}"
    );
    bomb.kill().unwrap();
    drop(bomb);

    let (none, timegraph) = (
        summary(&run.output, "PHASE1 "),
        summary(&run.output, "PHASE2 "),
    );
    let (fps_none, fps_tg) = (field(none, "fps"), field(timegraph, "fps"));
    let (p50_none, p50_tg) = (
        field(none, "latency_p50_us"),
        field(timegraph, "latency_p50_us"),
    );
    report(
        TEST,
        &format!(
            "game with policy none: {fps_none} fps, group latency p50 {p50_none} us; \
             with TimeGraph: {fps_tg} fps, p50 {p50_tg} us; total {:?}",
            started.elapsed()
        ),
    );
    assert!(
        fps_tg >= fps_none * MIN_FPS_GAIN,
        "TimeGraph should raise the game's frame rate: {fps_none} -> {fps_tg} fps"
    );
    assert!(
        p50_tg < p50_none,
        "TimeGraph should cut the game's group latency: {p50_none} -> {p50_tg} us"
    );
}
