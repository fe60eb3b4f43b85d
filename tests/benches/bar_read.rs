//! BAR read round trip: how long one REGION_READ of the device status takes from a raw
//! vfio-user client (no QEMU) to its reply, through the server's relay and message loop. The
//! relay's added cost is this figure against the same loop run on a build without it
//! (`docs/PERFORMANCE.md`).
//!
//! `cargo bench -p vgpu-tests --bench bar_read [-- --quick]`

use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::VFIO_PCI_BAR4_REGION_INDEX;
use vgpu_tests::server::TestServer;
use vgpu_tests::vfio_user_raw::RawClient;

/// device_status in the virtio common configuration.
const STATUS: u64 = 0x14;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let reads: u32 = if quick { 5_000 } else { 50_000 };
    let server = TestServer::start(1);
    let mut client = RawClient::connect(server.socket()).expect("client connects");
    let read = |client: &mut RawClient| {
        client
            .region_read(VFIO_PCI_BAR4_REGION_INDEX, STATUS, 1)
            .expect("status read")
    };
    for _ in 0..1_000 {
        read(&mut client);
    }
    let mut samples = Vec::with_capacity(reads as usize);
    let start = Instant::now();
    for _ in 0..reads {
        let t0 = Instant::now();
        read(&mut client);
        samples.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    let total = start.elapsed();
    drop(client);
    server.wait(Duration::from_secs(10)).expect("server exits");
    samples.sort_by(f64::total_cmp);
    let mean = total.as_secs_f64() * 1e6 / f64::from(reads);
    println!(
        "BAR read round trip ({reads} reads, {} CPUs, {}): p50 {:.1} µs, p99 {:.1} µs, mean {mean:.1} µs",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        vgpu_tests::cpu_model(),
        percentile(&samples, 50.0),
        percentile(&samples, 99.0),
    );
}
