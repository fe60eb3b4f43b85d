//! A CUDA guest and a GPU bomb share the vGPU under the `vgpu-schedd` daemon: "bomb" keeps a
//! GPU command bomb in flight (`vgpu-load`, the load capset on the daemon's simulated engine);
//! "cuda" runs the corpus's `driver_bench` (plain C on our `libcuda.so.1`: every launch and
//! its synchronisation is one compute-capset submit, a `Compute` group that asks the daemon)
//! twice. The daemon starts with policy none; between the two runs `vgpuctl set-policy`
//! installs TimeGraph with the CUDA VM prioritised (HT, priority 10) and the bomb capped by a
//! PE reserve, and the second run's launch latency must drop.
//!
//! Skipped with a message when the guest image or the CUDA corpus is missing, unless
//! `VGPU_REQUIRE_GUEST` / `VGPU_REQUIRE_CUDA_CORPUS` is set (test.sh).

use std::time::{Duration, Instant};

use mdev_backend::compute::corpus::corpus_for_tests;
use vgpu_tests::TempDir;
use vgpu_tests::daemon::{Schedd, workspace_binary};
use vgpu_tests::guest::{self, RunningGuest, boot_lock, skip_without_guest};

/// Wall-clock limit of each guest: two TCG guests boot side by side, then run their loads.
const GUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// The bomb's run: the CUDA guest's boot beside it (two minutes with the host's cores busy
/// with other work too) and both benchmark runs fit in it; the test fails if it ended before
/// the second run did.
const BOMB_S: u32 = 240;
/// The CUDA guest's pause between its runs, in which the host sees the first run's end and
/// installs TimeGraph (two `vgpuctl` calls, well under a second on an idle host). The guests
/// have no way yet to be told when to start.
const PAUSE_S: u32 = 10;
/// Launches per benchmark run (each waits behind the bomb's groups under policy none).
const LAUNCHES: u32 = 200;
/// The policy installed half-way.
const TIMEGRAPH: &str = "policy = \"timegraph\"\nsched = \"ht\"\n\
    specs = [\"<cuda:ht:none:10:1:1>\", \"<bomb:prt:pe:0:5000:25000>\"]\n";

fn report(what: &str) {
    guest::report("guest_cuda_sched", "timegraph_prioritises_cuda", what);
}

/// A `RESULT key value` of the run tagged `tag`.
fn result(output: &str, tag: &str, key: &str) -> f64 {
    let prefix = format!("{tag} RESULT {key} ");
    output
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} line:\n{output}"))
}

#[test]
fn live_timegraph_prioritises_a_cuda_guest_over_a_bomb() {
    let Some(image) = skip_without_guest() else {
        return;
    };
    let Some(corpus) = corpus_for_tests("driver_bench") else {
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
    report(&format!("bomb running after {:?}", started.elapsed()));

    let lib = workspace_binary("libcuda.so").expect("libcuda.so of guest-drivers/libcuda");
    let dir = TempDir::new("guest-cuda-sched").expect("temp dir");
    let (qemu, prologue) = guest::cuda_payload(dir.path(), &lib, &corpus, &["driver_bench"]);
    let bench = format!("{}/driver_bench {LAUNCHES} 1", guest::CUDA_DIR);
    let cuda_job = format!(
        "{prologue}{bench} | sed 's/^/RUN1 /'\necho RUN1-DONE\nsleep {PAUSE_S}\necho RUN2-START\n{bench} | sed 's/^/RUN2 /'\n"
    );
    let mut config = schedd
        .guest_config(&image, "cuda", cuda_job)
        .timeout(GUEST_TIMEOUT);
    config.extra_qemu_args.extend(qemu);
    let mut cuda = RunningGuest::launch(&config).unwrap();
    assert!(
        cuda.wait_for_serial(|l| l.starts_with("RUN1-DONE"), |_| {})
            .unwrap(),
        "the CUDA guest exited in its first run"
    );
    report(&format!("first run done after {:?}", started.elapsed()));
    schedd.transcript(&["show"]).unwrap();
    let answer = schedd
        .transcript(&["set-policy", policy.to_str().unwrap()])
        .unwrap();
    assert!(answer.contains("timegraph"), "{answer}");
    // The precondition of the comparison: TimeGraph was in force for the whole second run.
    let cuda_serial = std::fs::read_to_string(cuda.dir().join("serial.log")).unwrap();
    assert!(
        !cuda_serial.contains("RUN2-START"),
        "TimeGraph was installed after the second run began (the host took more than the \
         {PAUSE_S} s pause); the runs cannot be compared"
    );
    let run = cuda.wait(|_| {}).unwrap();
    assert_eq!(run.exit_code, Some(0), "{}", run.logs());
    schedd.transcript(&["show"]).unwrap();
    let bomb_serial = std::fs::read_to_string(bomb.dir().join("serial.log")).unwrap();
    assert!(
        !bomb_serial.contains("\"summary\"") && !bomb_serial.contains("VGPU-EXIT"),
        "the bomb finished before the second run:\n{bomb_serial}"
    );
    bomb.kill().unwrap();
    drop(bomb);

    assert!(
        run.output.contains("RUN1 PASS") && run.output.contains("RUN2 PASS"),
        "{}",
        run.output
    );
    let (none, tg) = (
        result(&run.output, "RUN1", "launch_p50_us"),
        result(&run.output, "RUN2", "launch_p50_us"),
    );
    report(&format!(
        "CUDA launch to completion p50: policy none {none} us, TimeGraph {tg} us; total {:?}",
        started.elapsed()
    ));
    assert!(
        tg < none,
        "TimeGraph should cut the CUDA guest's launch latency: {none} -> {tg} us"
    );
}
