//! BAR read round trip: how long one REGION_READ of the device status takes from a raw
//! vfio-user client (no QEMU) to its reply, through the server's relay and message loop. The
//! relay's added cost is this figure against the same loop run on a build without it
//! (`docs/PERFORMANCE.md`).
//!
//! Writes JSON (default `target/vgpu-bench/bar_read.json`, or `$VGPU_BENCH_OUT`) and its figure
//! beside it.
//!
//! `cargo bench -p vgpu-tests --bench bar_read [-- --quick]`

use std::path::Path;
use std::time::{Duration, Instant};
use vgpu_bench_report::stats::percentile;

use vfio_bindings::bindings::vfio::VFIO_PCI_BAR4_REGION_INDEX;
use vgpu_tests::server::TestServer;
use vgpu_tests::vfio_user_raw::RawClient;

/// device_status in the virtio common configuration.
const STATUS: u64 = 0x14;

/// BAR read round trip from a raw vfio-user client.
#[derive(Debug, clap::Parser)]
struct Cli {
    /// A tenth of the reads.
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    _cargo: vgpu_bench_report::CargoBench,
}

fn main() {
    let cli: Cli = clap::Parser::parse();
    let reads: u32 = if cli.quick { 5_000 } else { 50_000 };
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
    let (p50, p99) = (percentile(&samples, 50.0), percentile(&samples, 99.0));
    let machine = vgpu_bench_report::machine();
    println!(
        "BAR read round trip ({reads} reads, {machine}): p50 {p50:.1} µs, p99 {p99:.1} µs, mean {mean:.1} µs"
    );
    let doc = serde_json::json!({
        "bench": "bar_read",
        "reads": reads,
        "machine": machine,
        "p50_us": p50,
        "p99_us": p99,
        "mean_us": mean,
    });
    let out = vgpu_bench_report::out_path(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/vgpu-bench/bar_read.json"
    )));
    vgpu_bench_report::write_results(&out, &doc).expect("writing the results");
}
