//! Doorbell benchmark: how fast the vGPU takes doorbell (queue notify) writes from QEMU, and how
//! long a request takes from the notify write to its used-ring entry.
//!
//! QEMU 11.1 runs under qtest against the server (in-process, the same library code as the
//! `vgpu-server` binary); the guest side is the qtest virtio-pci driver, so every guest access
//! is a qtest round trip. Prints a table and writes JSON (default
//! `target/vgpu-bench/doorbell.json`, or `$VGPU_BENCH_OUT`).
//!
//! `cargo bench -p vgpu-tests --bench doorbell [-- --quick]`

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use vgpu_guest_drivers::virtio_gpu::{
    CONTROL_QUEUE, CTRL_HDR_SIZE, DISPLAY_INFO_SIZE, get_display_info,
};
use vgpu_guest_drivers::virtio_pci::Descriptor;
use vgpu_tests::server::{TestServer, VgpuGuest};
use vgpu_tests::{qemu_version, skip_without_qemu};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};

const POLL_TIMEOUT: Duration = Duration::from_secs(5);

struct Sizes {
    notifies: u32,
    round_trips: u32,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
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
    let size = guest.dev.queue(CONTROL_QUEUE).unwrap().size();
    let (head, tail) = (size - 1, size - 2);
    let chain = [
        (
            head,
            Descriptor {
                addr: request,
                len: CTRL_HDR_SIZE as u32,
                flags: VRING_DESC_F_NEXT as u16,
                next: tail,
            },
        ),
        (
            tail,
            Descriptor {
                addr: response,
                len: DISPLAY_INFO_SIZE as u32,
                flags: VRING_DESC_F_WRITE as u16,
                next: 0,
            },
        ),
    ];
    for (index, desc) in &chain {
        guest
            .dev
            .write_descriptor(qt, CONTROL_QUEUE, *index, desc)
            .unwrap();
    }
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

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn main() {
    if skip_without_qemu() {
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes = if quick {
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
    let server = TestServer::start(1);
    let mut guest = VgpuGuest::start(&server);

    // Warm up both paths once.
    notify_rate(&mut guest, 500);
    round_trips(&mut guest, 50);

    let floor = qtest_round_trip_us(&mut guest, 2_000);
    let rate = notify_rate(&mut guest, sizes.notifies);
    let mut lat = round_trips(&mut guest, sizes.round_trips);
    lat.sort_by(f64::total_cmp);
    let (p50, p99) = (percentile(&lat, 50.0), percentile(&lat, 99.0));
    let mean = lat.iter().sum::<f64>() / lat.len() as f64;
    let max = lat.last().copied().unwrap_or_default();
    let faults = server.counter("transport_faults");
    assert_eq!(faults, 0, "the benchmark must not trip the device");

    let machine = format!(
        "{} CPUs ({}), accelerator qtest",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model()
    );
    let qemu = qemu_version().unwrap_or("unknown");
    println!("doorbell benchmark: {qemu}; {machine}");
    println!("| metric | value |");
    println!("|---|---|");
    println!(
        "| notify writes/s ({} posted writes) | {rate:.0} |",
        sizes.notifies
    );
    println!(
        "| write-to-used p50 (µs, {} requests) | {p50:.1} |",
        sizes.round_trips
    );
    println!("| write-to-used p99 (µs) | {p99:.1} |");
    println!("| write-to-used mean / max (µs) | {mean:.1} / {max:.1} |");
    println!("| qtest round trip (µs, floor of the above) | {floor:.1} |");

    let mut json = String::new();
    let _ = write!(
        json,
        "{{\"benchmark\":\"doorbell\",\"qemu\":{qemu:?},\"machine\":{machine:?},\"accelerator\":\"qtest\",\
         \"notifies\":{},\"notify_writes_per_s\":{rate:.0},\"round_trips\":{},\"write_to_used_us\":\
         {{\"p50\":{p50:.2},\"p99\":{p99:.2},\"mean\":{mean:.2},\"max\":{max:.2}}},\"qtest_round_trip_us\":{floor:.2}}}\n",
        sizes.notifies, sizes.round_trips
    );
    let out = std::env::var_os("VGPU_BENCH_OUT").map_or_else(
        || {
            std::path::PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../target/vgpu-bench/doorbell.json"
            ))
        },
        std::path::PathBuf::from,
    );
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).expect("output directory");
    }
    std::fs::write(&out, json).expect("writing the JSON result");
    println!("JSON: {}", out.display());
    drop(guest);
    server.wait(Duration::from_secs(10)).expect("server exits");
}
