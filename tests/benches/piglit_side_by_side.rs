//! GL conformance side by side: piglit's selection (`tests/piglit/selection.txt`, built onto a
//! disk by `qemu-scripts/build-piglit-disk.sh`) run in the same guest image on our device and on
//! QEMU's virtio-gpu-gl, by default with the same host renderer (our server on the QEMU
//! prefix's virglrenderer and Mesa, `vgpu-prefix`), so that a difference is the device path's.
//!
//! Each test runs as piglit's runner runs it (one process, `-auto`, `-fbo` where concurrent,
//! PIGLIT_PLATFORM=gbm), one control-channel job per test, bounded in the guest and on the
//! host (`vgpu_tests::piglit`). Prints the pass/fail/skip/crash/timeout table per group and
//! device, then every test whose result differs between the devices with each device's output
//! tail; writes `piglit_side_by_side.json` (every result) and its figure to
//! `target/vgpu-bench/` (or `$VGPU_BENCH_OUT`). Progress goes to stderr.
//!
//! `cargo bench -p vgpu-tests --bench piglit_side_by_side [-- --devices a,b] [--group G]...
//! [--filter TEXT] [--every N]` (`--every N`: every Nth test of the selection, a quick sample).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use serde_json::{Value, json};
use vgpu_cli::progress::Progress;
use vgpu_tests::gl_device::GlDevice;
use vgpu_tests::guest::{Accel, GuestConfig, GuestImage, server_binary};
use vgpu_tests::piglit::{self, Outcome, PiglitDisk, PiglitTest, TestResult};
use vgpu_tests::{qemu_version, skip_without_qemu};

/// GL conformance side by side: piglit on our device and on QEMU's virtio-gpu-gl.
#[derive(Debug, clap::Parser)]
struct Cli {
    /// Devices to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_values = ["vgpu-prefix", "qemu-virtio-gpu-gl"])]
    devices: Vec<GlDevice>,
    /// Only the selection's groups named (repeatable).
    #[arg(long = "group")]
    groups: Vec<String>,
    /// Only tests whose name contains TEXT.
    #[arg(long, value_name = "TEXT")]
    filter: Option<String>,
    /// Every Nth test only (a quick sample of every group).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1000))]
    every: u16,
    /// Pass ARG to our vgpu-server (repeatable; e.g. --no-sandbox or --log-level debug to see
    /// why a device process ended).
    #[arg(long = "server-arg", value_name = "ARG", allow_hyphen_values = true)]
    server_args: Vec<String>,
    #[command(flatten)]
    _cargo: vgpu_bench_report::CargoBench,
}

/// One device's run.
struct DeviceRun {
    device: GlDevice,
    wall_s: f64,
    results: Vec<TestResult>,
    failure: Option<String>,
}

impl DeviceRun {
    fn count(&self, group: Option<&str>, outcome: Outcome) -> usize {
        self.results
            .iter()
            .filter(|r| group.is_none_or(|g| r.group == g) && r.outcome == outcome)
            .count()
    }

    fn counts(&self, group: Option<&str>) -> Value {
        Outcome::ALL
            .iter()
            .map(|&o| (o.name().to_owned(), json!(self.count(group, o))))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

fn run_device(
    device: GlDevice,
    image: &GuestImage,
    accel: Accel,
    disk: &PiglitDisk,
    tests: &[PiglitTest],
    server_args: &[String],
) -> DeviceRun {
    let started = Instant::now();
    let mut run = DeviceRun {
        device,
        wall_s: 0.0,
        results: Vec::new(),
        failure: None,
    };
    let mut config = GuestConfig::new(image.clone(), "");
    config.accel = Some(accel);
    let server = server_binary().map_err(|e| e.to_string());
    if let Err(why) = device.configure(&mut config, server.as_deref().map_err(String::as_str)) {
        run.failure = Some(why);
        return run;
    }
    if config.server_bin.is_some() {
        config.server_args.extend(server_args.iter().cloned());
    }
    let progress = Progress::new(device.name(), tests.len() as u64);
    let mut tally: BTreeMap<Outcome, usize> = BTreeMap::new();
    let outcome = piglit::run(&config, disk, tests, |r| {
        *tally.entry(r.outcome).or_default() += 1;
        progress.step(&r.name);
        progress.advance();
        if !matches!(r.outcome, Outcome::Pass | Outcome::Skip) {
            let first = r.detail.lines().rev().find(|l| !l.trim().is_empty());
            progress.note(&format!(
                "{}: {} {}",
                r.outcome.name(),
                r.name,
                first.unwrap_or("")
            ));
        }
    });
    match outcome {
        Ok(results) => run.results = results,
        Err(e) => run.failure = Some(e.to_string()),
    }
    run.wall_s = started.elapsed().as_secs_f64();
    eprintln!(
        "{}: {} in {:.0} s",
        device.name(),
        tally
            .iter()
            .map(|(o, n)| format!("{n} {}", o.name()))
            .collect::<Vec<_>>()
            .join(", "),
        run.wall_s
    );
    run
}

/// The table: per group, each device's pass/fail/skip/crash/timeout(+lost).
fn table(groups: &[String], runs: &[DeviceRun]) -> String {
    let cell = |r: &DeviceRun, g: Option<&str>| {
        let n = |o| r.count(g, o);
        format!(
            "{}/{}/{}/{}/{}",
            n(Outcome::Pass) + n(Outcome::Warn),
            n(Outcome::Fail),
            n(Outcome::Skip),
            n(Outcome::Crash),
            n(Outcome::Timeout) + n(Outcome::Lost)
        )
    };
    let mut out = format!(
        "| group | tests | {} |\n|---|---:|{}\n",
        runs.iter()
            .map(|r| r.device.name())
            .collect::<Vec<_>>()
            .join(" | "),
        "---:|".repeat(runs.len())
    );
    let total = |g: Option<&str>| {
        runs.first().map_or(0, |r| {
            r.results
                .iter()
                .filter(|t| g.is_none_or(|g| t.group == g))
                .count()
        })
    };
    for g in groups {
        let cells: Vec<String> = runs.iter().map(|r| cell(r, Some(g))).collect();
        out += &format!("| {g} | {} | {} |\n", total(Some(g)), cells.join(" | "));
    }
    let cells: Vec<String> = runs.iter().map(|r| cell(r, None)).collect();
    out += &format!("| **all** | {} | {} |\n", total(None), cells.join(" | "));
    out
}

/// Tests whose outcome differs between the devices (`warn` counts as `pass`).
fn differences(runs: &[DeviceRun]) -> Vec<(&str, Vec<&TestResult>)> {
    let Some(first) = runs.first() else {
        return Vec::new();
    };
    let norm = |o: Outcome| if o == Outcome::Warn { Outcome::Pass } else { o };
    (0..first.results.len())
        .filter_map(|i| {
            let row: Vec<&TestResult> = runs.iter().filter_map(|r| r.results.get(i)).collect();
            let differs = row.len() == runs.len()
                && row.iter().any(|r| norm(r.outcome) != norm(row[0].outcome));
            differs.then(|| (first.results[i].name.as_str(), row))
        })
        .collect()
}

fn main() {
    let o: Cli = clap::Parser::parse();
    if skip_without_qemu() {
        return;
    }
    let image = match GuestImage::locate() {
        Ok(image) => image,
        Err(e) => {
            eprintln!("SKIPPED: piglit_side_by_side: {e}");
            return;
        }
    };
    let disk = match PiglitDisk::at(&PiglitDisk::default_dir()) {
        Ok(disk) => disk,
        Err(e) => {
            eprintln!("piglit_side_by_side: {e}");
            std::process::exit(2);
        }
    };
    let tests: Vec<PiglitTest> = disk
        .tests
        .iter()
        .filter(|t| o.groups.is_empty() || o.groups.contains(&t.group))
        .filter(|t| {
            o.filter
                .as_ref()
                .is_none_or(|f| t.name.contains(f.as_str()))
        })
        .step_by(usize::from(o.every))
        .cloned()
        .collect();
    if tests.is_empty() {
        eprintln!("piglit_side_by_side: no test of the selection matches");
        std::process::exit(2);
    }
    let mut groups: Vec<String> = tests.iter().map(|t| t.group.clone()).collect();
    groups.sort();
    groups.dedup();
    let (accel, accel_reason) = Accel::detect().expect("accelerator");
    let qemu = qemu_version().unwrap_or("unknown");
    println!(
        "piglit_side_by_side: {} tests ({}) on {}; accel {accel} ({accel_reason}); QEMU {qemu}; {}",
        tests.len(),
        groups.join(", "),
        o.devices
            .iter()
            .map(|d| d.name())
            .collect::<Vec<_>>()
            .join(", "),
        vgpu_bench_report::machine()
    );
    let mut runs = Vec::new();
    for &device in &o.devices {
        if let Err(why) = device.available() {
            eprintln!("piglit_side_by_side: {}: {why}", device.name());
            continue;
        }
        runs.push(run_device(
            device,
            &image,
            accel,
            &disk,
            &tests,
            &o.server_args,
        ));
    }
    for r in runs.iter().filter(|r| r.failure.is_some()) {
        println!(
            "{}: no result: {}",
            r.device.name(),
            r.failure.as_deref().unwrap_or("")
        );
    }
    let runs: Vec<DeviceRun> = runs.into_iter().filter(|r| r.failure.is_none()).collect();
    println!("\npass/fail/skip/crash/timeout per group (warn counted as pass, lost as timeout):\n");
    print!("{}", table(&groups, &runs));
    let diffs = differences(&runs);
    println!("\n{} tests differ between the devices:", diffs.len());
    for (name, row) in &diffs {
        let outcomes: Vec<String> = runs
            .iter()
            .zip(row)
            .map(|(r, t)| format!("{} {}", r.device.name(), t.outcome.name()))
            .collect();
        println!("- {name}: {}", outcomes.join(", "));
        for (r, t) in runs.iter().zip(row) {
            if t.outcome != Outcome::Pass {
                let tail: Vec<&str> = t.detail.lines().rev().take(3).collect();
                for line in tail.iter().rev() {
                    println!("    {}: {line}", r.device.name());
                }
            }
        }
    }

    let out = vgpu_bench_report::out_path(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/vgpu-bench/piglit_side_by_side.json"
    )));
    let doc = json!({
        "bench": "piglit",
        "machine": vgpu_bench_report::machine(),
        "accel": accel.to_string(),
        "qemu": qemu,
        "selection": "tests/piglit/selection.txt",
        "tests": tests.len(),
        "test_limit_s": piglit::TEST_LIMIT.as_secs(),
        "groups": groups,
        "devices": runs.iter().map(|r| json!({
            "device": r.device.name(),
            "host_stack": r.device.stack(),
            "wall_s": r.wall_s,
            "counts": r.counts(None),
            "groups": groups.iter().map(|g| (g.clone(), r.counts(Some(g)))).collect::<serde_json::Map<_, _>>(),
        })).collect::<Vec<_>>(),
        "differences": diffs.iter().map(|(name, row)| json!({
            "name": name,
            "results": runs.iter().zip(row).map(|(r, t)| (r.device.name().to_owned(), json!(t))).collect::<serde_json::Map<_, _>>(),
        })).collect::<Vec<_>>(),
        "results": runs.iter().map(|r| (r.device.name().to_owned(), json!(r.results.iter().map(|t| json!({
            "name": t.name, "outcome": t.outcome, "rc": t.rc, "ms": t.ms,
        })).collect::<Vec<_>>()))).collect::<serde_json::Map<_, _>>(),
    });
    vgpu_bench_report::write_results(&out, &doc).expect("writing the results");
}
