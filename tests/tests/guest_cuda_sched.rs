//! A CUDA guest and a GPU bomb share the vGPU under the `vgpu-schedd` daemon: "bomb" keeps a
//! GPU command bomb in flight (`vgpu-load`, the load capset on the daemon's simulated engine);
//! "cuda" runs the corpus's `driver_bench` (plain C on our `libcuda.so.1`: every launch and
//! its synchronisation is one compute-capset submit, a `Compute` group that asks the daemon)
//! twice. The daemon starts with policy none; between the two runs `vgpuctl set-policy`
//! installs TimeGraph with the CUDA VM prioritised (HT, priority 10) and the bomb capped by a
//! PE reserve, and the second run's launch latency must drop. Both guests are driven through
//! the host-guest control channel: the bomb runs until the host stops it, and each benchmark
//! run starts when the host says (the second only once TimeGraph is in force).
//!
//! Skipped with a message when the guest image or the CUDA corpus is missing, unless
//! `VGPU_REQUIRE_GUEST` / `VGPU_REQUIRE_CUDA_CORPUS` is set (test.sh).

use std::time::{Duration, Instant};

use mdev_backend::compute::corpus::corpus_for_tests;
use vgpu_tests::TempDir;
use vgpu_tests::daemon::{Schedd, workspace_binary};
use vgpu_tests::guest::{self, RunningGuest, boot_lock, skip_without_guest};

/// Wall-clock limit of each guest: two TCG guests boot side by side, then run their loads.
const GUEST_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest wait for both guests to boot and start their agents.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest wait for a job to start, for a benchmark run to end (200 launches, each behind
/// the bomb's queued groups under policy none), and for the stopped bomb to report.
const JOB_TIMEOUT: Duration = Duration::from_secs(180);
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

    // Both guests boot with the control channel's agent; the host starts each workload.
    let config = schedd.agent_config(&image, "bomb").timeout(GUEST_TIMEOUT);
    let mut bomb = RunningGuest::launch(&config).unwrap();
    let lib = workspace_binary("libcuda.so").expect("libcuda.so of guest-drivers/libcuda");
    let dir = TempDir::new("guest-cuda-sched").expect("temp dir");
    let (qemu, prologue) = guest::cuda_payload(dir.path(), &lib, &corpus, &["driver_bench"]);
    let mut config = schedd.agent_config(&image, "cuda").timeout(GUEST_TIMEOUT);
    config.extra_qemu_args.extend(qemu);
    let mut cuda = RunningGuest::launch(&config).unwrap();
    for g in [&mut bomb, &mut cuda] {
        g.control()
            .unwrap()
            .hello(BOOT_TIMEOUT)
            .expect("the guest boots");
    }
    report(&format!("both guests up after {:?}", started.elapsed()));
    let bomb_ch = bomb.control().unwrap();
    bomb_ch
        .start(
            "bomb",
            "vgpu-load bomb --cost-us 4000 --depth 8 --until-stopped --json \
             | grep '\"summary\"' | sed 's/^/SUMMARY /'",
            JOB_TIMEOUT,
        )
        .unwrap();
    let bench = format!(
        "{}/driver_bench {LAUNCHES} 1 | sed 's/^/SUMMARY /'",
        guest::CUDA_DIR
    );
    // One benchmark run: the bomb must be running when it starts and when it ends.
    let mut run = |name: &str, script: String, bomb: &mut RunningGuest| -> String {
        let ch = cuda.control().unwrap();
        ch.start(name, &script, JOB_TIMEOUT).unwrap();
        let r = ch.wait_exit(name, JOB_TIMEOUT).unwrap();
        assert_eq!(r.exit, Some(0), "{name}: {r:?}");
        let still = bomb.control().unwrap().report("bomb").unwrap();
        assert_eq!(
            still.exit, None,
            "the bomb ran through {name} (the comparison's precondition)"
        );
        r.summaries.join("\n")
    };
    let run1 = run("run1", format!("{prologue}{bench}\n"), &mut bomb);
    report(&format!("first run done after {:?}", started.elapsed()));
    schedd.transcript(&["show"]).unwrap();
    let answer = schedd
        .transcript(&["set-policy", policy.to_str().unwrap()])
        .unwrap();
    assert!(answer.contains("timegraph"), "{answer}");
    // The second run starts only now: TimeGraph is in force for all of it.
    let run2 = run("run2", format!("{}{bench}\n", guest::cuda_env()), &mut bomb);
    schedd.transcript(&["show"]).unwrap();
    let bomb_ch = bomb.control().unwrap();
    bomb_ch.stop("bomb").unwrap();
    let bomb_report = bomb_ch.wait_exit("bomb", JOB_TIMEOUT).unwrap();
    assert!(
        !bomb_report.summaries.is_empty(),
        "the bomb reports its summary when stopped: {bomb_report:?}"
    );
    for g in [&mut bomb, &mut cuda] {
        let _ = g.control().unwrap().quit(Duration::from_secs(10));
    }
    let output = format!(
        "{}\n{}\n",
        run1.lines()
            .map(|l| format!("RUN1 {l}"))
            .collect::<Vec<_>>()
            .join("\n"),
        run2.lines()
            .map(|l| format!("RUN2 {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        output.contains("RUN1 PASS") && output.contains("RUN2 PASS"),
        "{output}"
    );
    let (none, tg) = (
        result(&output, "RUN1", "launch_p50_us"),
        result(&output, "RUN2", "launch_p50_us"),
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
