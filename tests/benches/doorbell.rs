//! Doorbell benchmark: how fast the vGPU takes doorbell (queue notify) writes from QEMU, and how
//! long a request takes from the notify write to its used-ring entry.
//!
//! QEMU 11.1 runs under qtest against the server (in-process, the same library code as the
//! `vgpu-server` binary); the guest side is the qtest virtio-pci driver, so every guest access
//! is a qtest round trip. Prints a table and writes JSON (default
//! `target/vgpu-bench/doorbell.json`, or `$VGPU_BENCH_OUT`) and its figure beside it.
//!
//! A second section takes QEMU out: a raw vfio-user client maps a RAM file as guest memory,
//! programs the device the way QEMU forwards a guest's register writes, and times posted
//! notify writes and notify-to-MSI-X latency (the eventfd QEMU would get). That is the
//! server's own cost per doorbell, hops 1 to 8. It runs twice: with the server's busy polling
//! off (`--busy-poll-us 0`: every hop is a scheduler wake-up) and at its default.
//!
//! A third section runs the same gate in a TCG guest (when the guest image is built): the
//! stock kernel driver's DRM ioctls submit a 1 µs group through the control queue and wait for
//! its fence, back to back (`vgpu-load throttle --kernel-us 1 --sleep-us 0`), with the
//! server's busy polling off and at its default. The latency there is the whole guest path:
//! the guest's ioctl, QEMU's MMIO exit and vfio-user message, our device, the fence's MSI-X
//! through QEMU's irqfd back into the emulated CPU.
//!
//! The figure (latency percentiles and notify rates per path) goes next to the JSON (`.svg`);
//! progress to stderr (a bar on a terminal).
//!
//! `cargo bench -p vgpu-tests --bench doorbell [-- [--quick] [--server-only]]`
//! (`--server-only`: the second section alone, no QEMU or guest)

use std::time::{Duration, Instant};
use vgpu_bench_report::stats::percentile;

use vfio_bindings::bindings::vfio::VFIO_PCI_MSIX_IRQ_INDEX;
use vgpu_cli::progress::Progress;
use vgpu_guest_drivers::virtio_gpu::{
    CONTROL_QUEUE, CTRL_HDR_SIZE, DISPLAY_INFO_SIZE, get_display_info,
};
use vgpu_schedd::busy_poll;
use vgpu_tests::guest::{GuestConfig, GuestImage, RunningGuest};
use vgpu_tests::raw_guest::{RawGuest, wait_interrupt};
use vgpu_tests::server::{TestServer, VgpuGuest};
use vgpu_tests::{qemu_version, skip_without_qemu};
use vmm_sys_util::eventfd::EventFd;

const POLL_TIMEOUT: Duration = Duration::from_secs(5);

struct Sizes {
    notifies: u32,
    round_trips: u32,
}

/// Notify writes per second: posted writes with nothing queued, then a BAR read that returns
/// only after the server has consumed every write before it.
fn notify_rate(guest: &mut VgpuGuest, n: u32) -> f64 {
    let qt = guest.vm.qtest();
    let notify = guest.dev.queue(CONTROL_QUEUE).unwrap().notify_address();
    let start = Instant::now();
    for _ in 0..n {
        qt.writew(notify, CONTROL_QUEUE).unwrap();
    }
    guest.dev.status(qt).unwrap();
    f64::from(n) / start.elapsed().as_secs_f64()
}

/// Write-to-used latency in microseconds: the chain (GET_DISPLAY_INFO) is published first; the
/// clock runs from the notify write until the used index is seen to move.
fn round_trips(guest: &mut VgpuGuest, n: u32) -> Vec<f64> {
    let request = guest.ram.alloc(CTRL_HDR_SIZE as u64, 8).unwrap();
    let response = guest.ram.alloc(DISPLAY_INFO_SIZE as u64, 8).unwrap();
    let qt = guest.vm.qtest();
    qt.memwrite(request, &get_display_info()).unwrap();
    let buffers = [
        (request, CTRL_HDR_SIZE as u32, false),
        (response, DISPLAY_INFO_SIZE as u32, true),
    ];
    let head = guest
        .dev
        .write_raw_chain(qt, CONTROL_QUEUE, &buffers)
        .unwrap();
    let mut used = guest.dev.read_used_idx(qt, CONTROL_QUEUE).unwrap();
    let mut samples = Vec::with_capacity(n as usize);
    for _ in 0..n {
        guest.dev.publish_avail(qt, CONTROL_QUEUE, head).unwrap();
        let start = Instant::now();
        guest.dev.notify(qt, CONTROL_QUEUE).unwrap();
        loop {
            let now = guest.dev.read_used_idx(qt, CONTROL_QUEUE).unwrap();
            if now != used {
                used = now;
                break;
            }
            assert!(start.elapsed() < POLL_TIMEOUT, "request never completed");
        }
        samples.push(start.elapsed().as_secs_f64() * 1e6);
    }
    samples
}

/// The cost of one qtest round trip (a guest RAM read), the floor under every figure here.
fn qtest_round_trip_us(guest: &mut VgpuGuest, n: u32) -> f64 {
    let qt = guest.vm.qtest();
    let start = Instant::now();
    for _ in 0..n {
        qt.readw(0x10_0000).unwrap();
    }
    start.elapsed().as_secs_f64() * 1e6 / f64::from(n)
}

struct RawResults {
    rate: f64,
    latencies: Vec<f64>,
}

/// The server alone, spinning up to `busy_poll`: notify writes/s and notify-to-MSI-X latency
/// (µs) from a raw client.
fn server_only(notifies: u32, round_trips: u32, busy_poll: Duration) -> RawResults {
    let server = TestServer::start_polling(1, busy_poll);
    let mut guest = RawGuest::connect(server.socket(), 1).unwrap();
    let irq = EventFd::new(0).unwrap();
    guest.set_trigger(VFIO_PCI_MSIX_IRQ_INDEX, 1, &irq).unwrap();
    assert_eq!(guest.status().unwrap(), 0xf, "device live");

    let start = Instant::now();
    for _ in 0..notifies {
        guest.notify().unwrap();
    }
    guest.status().unwrap();
    let rate = f64::from(notifies) / start.elapsed().as_secs_f64();

    let mut latencies = Vec::with_capacity(round_trips as usize);
    for _ in 0..round_trips {
        guest.publish().unwrap();
        let t0 = Instant::now();
        guest.notify().unwrap();
        assert_ne!(wait_interrupt(&irq, POLL_TIMEOUT).unwrap(), 0, "MSI-X");
        latencies.push(t0.elapsed().as_secs_f64() * 1e6);
        assert_eq!(
            guest.used_idx(),
            guest.submitted(),
            "one completion per request"
        );
    }
    assert_eq!(server.counter("transport_faults"), 0);
    drop(guest);
    server.wait(Duration::from_secs(10)).expect("server exits");
    RawResults { rate, latencies }
}

/// Calibration: one thread wakes another through an eventfd and is woken back (µs per round
/// trip, two wakeups). The server-only path has three wakeups without busy polling (relay,
/// worker, client; the relay kicks the worker itself) and one with it (the client's).
fn wakeup_round_trip_us(n: u32) -> f64 {
    let (ping, pong) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let (ping2, pong2) = (ping.try_clone().unwrap(), pong.try_clone().unwrap());
    let echo = std::thread::spawn(move || {
        for _ in 0..n {
            ping2.read().unwrap();
            pong2.write(1).unwrap();
        }
    });
    let start = Instant::now();
    for _ in 0..n {
        ping.write(1).unwrap();
        pong.read().unwrap();
    }
    let per = start.elapsed().as_secs_f64() * 1e6 / f64::from(n);
    echo.join().unwrap();
    per
}

/// Seconds the guest ping runs.
const GUEST_PING_S: u32 = 5;

/// The guest ping's (p50, p99) in µs with the server spinning up to `busy_poll`, or why not.
fn guest_ping(image: &GuestImage, busy_poll: Duration) -> Result<(f64, f64, f64), String> {
    let job = format!(
        "vgpu-load throttle --kernel-us 1 --sleep-us 0 --duration-s {GUEST_PING_S} --json | grep '\"kind\":\"summary\"'"
    );
    let mut config = GuestConfig::new(image.clone(), job).timeout(Duration::from_secs(240));
    config.server_args = vec!["--busy-poll-us".into(), busy_poll.as_micros().to_string()];
    let run = RunningGuest::run(&config).map_err(|e| e.to_string())?;
    let line = run
        .output
        .lines()
        .find(|l| l.contains("\"summary\""))
        .ok_or_else(|| format!("no summary; exit {:?}: {}", run.exit_code, run.output))?;
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let field = |k: &str| {
        v[k].as_f64()
            .ok_or_else(|| format!("{k} missing in {line}"))
    };
    Ok((
        field("latency_p50_us")?,
        field("latency_p99_us")?,
        field("groups")? / field("elapsed_s")?,
    ))
}

fn stats(samples: &mut [f64]) -> (f64, f64, f64, f64) {
    samples.sort_by(f64::total_cmp);
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    (
        percentile(samples, 50.0),
        percentile(samples, 99.0),
        mean,
        samples.last().copied().unwrap_or_default(),
    )
}

/// Doorbell writes and their latency: QEMU under qtest, the server alone, a TCG guest.
#[derive(Debug, clap::Parser)]
struct Cli {
    /// A tenth of the notifies and round trips.
    #[arg(long)]
    quick: bool,
    /// Only the server-only section (no QEMU, no guest): seconds, not minutes.
    #[arg(long)]
    server_only: bool,
    #[command(flatten)]
    _cargo: vgpu_bench_report::CargoBench,
}

/// The qtest section's figures.
struct Qtest {
    rate: f64,
    floor: f64,
    latency: (f64, f64, f64, f64),
}

/// Notify rate, write-to-used latency and the qtest floor through QEMU under qtest.
fn qtest_section(sizes: &Sizes) -> Qtest {
    let server = TestServer::start(1);
    let mut guest = VgpuGuest::start(&server);
    // Warm up both paths once.
    notify_rate(&mut guest, 500);
    round_trips(&mut guest, 50);
    let floor = qtest_round_trip_us(&mut guest, 2_000);
    let rate = notify_rate(&mut guest, sizes.notifies);
    let latency = stats(&mut round_trips(&mut guest, sizes.round_trips));
    let faults = server.counter("transport_faults");
    assert_eq!(faults, 0, "the benchmark must not trip the device");
    drop(guest);
    server.wait(Duration::from_secs(10)).expect("server exits");
    Qtest {
        rate,
        floor,
        latency,
    }
}

fn latency_json((p50, p99, mean, max): (f64, f64, f64, f64)) -> serde_json::Value {
    serde_json::json!({"p50": p50, "p99": p99, "mean": mean, "max": max})
}

fn main() {
    let cli: Cli = clap::Parser::parse();
    let qemu = if cli.server_only {
        None
    } else if skip_without_qemu() {
        return;
    } else {
        Some(qemu_version().unwrap_or("unknown"))
    };
    let sizes = if cli.quick {
        Sizes {
            notifies: 5_000,
            round_trips: 500,
        }
    } else {
        Sizes {
            notifies: 50_000,
            round_trips: 5_000,
        }
    };
    let polls = [0, busy_poll::DEFAULT_MAX.as_micros() as u64];
    let image = match qemu {
        None => Err("--server-only".to_owned()),
        Some(_) => GuestImage::locate().map_err(|e| e.to_string()),
    };
    let steps = 1 + usize::from(qemu.is_some()) + polls.len() * (1 + usize::from(image.is_ok()));
    let progress = Progress::new("doorbell", steps as u64);
    let qtest = qemu.map(|_| {
        progress.step("QEMU under qtest");
        let q = qtest_section(&sizes);
        progress.advance();
        q
    });
    let runs: Vec<(u64, RawResults)> = polls
        .into_iter()
        .map(|us| {
            progress.step(&format!("server only, busy poll {us} µs"));
            let raw = server_only(sizes.notifies, sizes.round_trips, Duration::from_micros(us));
            progress.advance();
            (us, raw)
        })
        .collect();
    progress.step("eventfd ping-pong calibration");
    let wakeup = wakeup_round_trip_us(sizes.round_trips);
    progress.advance();
    let mut guest_runs = Vec::new();
    if let Ok(image) = &image {
        for us in polls {
            progress.step(&format!("TCG guest, busy poll {us} µs"));
            guest_runs.push((us, guest_ping(image, Duration::from_micros(us))));
            progress.advance();
        }
    }
    drop(progress);

    let accel = if qemu.is_some() { "qtest" } else { "none" };
    let machine = format!("{}, accelerator {accel}", vgpu_bench_report::machine());
    let (n, m) = (sizes.notifies, sizes.round_trips);
    println!(
        "doorbell benchmark: {}; {machine}",
        qemu.unwrap_or("no QEMU")
    );
    println!("| path | metric | value |");
    println!("|---|---|---|");
    let mut doc = serde_json::json!({
        "benchmark": "doorbell",
        "qemu": qemu,
        "machine": machine,
        "notifies": n,
        "round_trips": m,
        "eventfd_ping_pong_us": wakeup,
    });
    if let Some(q) = &qtest {
        let (p50, p99, mean, max) = q.latency;
        println!(
            "| QEMU qtest | notify writes/s ({n} posted writes) | {:.0} |",
            q.rate
        );
        println!(
            "| QEMU qtest | write-to-used p50 / p99 (µs, {m} requests) | {p50:.1} / {p99:.1} |"
        );
        println!("| QEMU qtest | write-to-used mean / max (µs) | {mean:.1} / {max:.1} |");
        println!(
            "| QEMU qtest | qtest round trip (µs, floor of the above) | {:.1} |",
            q.floor
        );
        doc["qtest"] = serde_json::json!({
            "notify_writes_per_s": q.rate.round(),
            "write_to_used_us": latency_json(q.latency),
            "round_trip_us": q.floor,
        });
    }
    let mut server_json = Vec::new();
    for (us, mut raw) in runs {
        let latency = stats(&mut raw.latencies);
        let (r50, r99, rmean, rmax) = latency;
        let path = format!("server only, busy poll {us} µs");
        println!(
            "| {path} | notify writes/s ({n} posted writes) | {:.0} |",
            raw.rate
        );
        println!("| {path} | notify-to-MSI-X p50 / p99 (µs, {m} requests) | {r50:.1} / {r99:.1} |");
        println!("| {path} | notify-to-MSI-X mean / max (µs) | {rmean:.1} / {rmax:.1} |");
        server_json.push(serde_json::json!({
            "busy_poll_us": us,
            "notify_writes_per_s": raw.rate.round(),
            "notify_to_msix_us": latency_json(latency),
        }));
    }
    doc["server_only"] = server_json.into();
    println!("| calibration | eventfd ping-pong between two threads (µs) | {wakeup:.1} |");
    let mut guest_json = Vec::new();
    if let Err(e) = &image {
        println!("| TCG guest | skipped | {e} |");
    }
    for (us, result) in guest_runs {
        let path = format!("TCG guest, busy poll {us} µs");
        match result {
            Ok((p50, p99, rate)) => {
                println!(
                    "| {path} | 1 µs group submit-to-fence p50 / p99 (µs, {GUEST_PING_S} s) | {p50:.0} / {p99:.0} |"
                );
                println!("| {path} | groups/s back to back | {rate:.0} |");
                guest_json.push(serde_json::json!({
                    "busy_poll_us": us, "p50_us": p50, "p99_us": p99, "groups_per_s": rate,
                }));
            }
            Err(e) => println!("| {path} | failed | {e} |"),
        }
    }
    doc["tcg_guest"] = guest_json.into();

    let out = vgpu_bench_report::out_path(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/vgpu-bench/doorbell.json"
    )));
    vgpu_bench_report::write_results(&out, &doc).expect("writing the results");
}
