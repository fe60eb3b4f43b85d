//! qtest integration tests of the 2D virtio-gpu commands: resources in guest RAM, transfers,
//! scanout, flush, the headless PNG dump and GET_EDID, plus the error codes of bad commands.
//! The same command sequences run against QEMU's own virtio-gpu-pci first, so that the request
//! builders (and the error codes we mirror) are checked against the reference device.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use vgpu_guest_drivers::pci::{self, PciAllocator};
use vgpu_guest_drivers::qtest::Qtest;
use vgpu_guest_drivers::virtio_gpu::{
    self as gpu, CONTROL_QUEUE, CTRL_HDR_SIZE, CURSOR_QUEUE, CtrlHeader, EdidResponse, F_EDID,
    FORMAT_B8G8R8X8, RESP_EDID_SIZE, RESP_ERR_INVALID_PARAMETER, RESP_ERR_INVALID_RESOURCE_ID,
    RESP_ERR_INVALID_SCANOUT_ID, RESP_ERR_OUT_OF_MEMORY, RESP_ERR_UNSPEC, RESP_OK_NODATA, Rect,
};
use vgpu_guest_drivers::virtio_pci::{VIRTIO_PCI_VENDOR_ID, VirtioPciDevice};
use vgpu_server::gpu::DisplayConfig;
use vgpu_server::gpu::dump::DumpConfig;
use vgpu_tests::server::{TestServer, VIRTIO_GPU_DEVICE_ID, VgpuGuest};
use vgpu_tests::{QtestVm, TempDir, VmConfig, skip_without_qemu};
use virtio_bindings::virtio_config::{VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1};

/// Longest wait for what the device does after a request, on a host whose cores are all
/// busy with other work too (`qemu-scripts/test.sh --loaded`).
const TIMEOUT: Duration = Duration::from_secs(20);
const SERVER_EXIT: Duration = Duration::from_secs(10);
const NEEDS_RESET: u8 = VIRTIO_CONFIG_S_NEEDS_RESET as u8;
/// Edge of the test resources.
const EDGE: u32 = 64;
/// Bytes of one EDGE x EDGE resource.
const RES_BYTES: usize = (EDGE * EDGE * 4) as usize;
const PAGE: u64 = 4096;

/// Sends one control request and returns the device-writable bytes (`resp_len` of them).
fn ctrl(qt: &mut Qtest, dev: &mut VirtioPciDevice, req: &[u8], resp_len: usize) -> Vec<u8> {
    let done = dev
        .transact(qt, CONTROL_QUEUE, &[req], &[resp_len as u32], TIMEOUT)
        .expect("control request completes");
    done.writable.expect("our chain").remove(0)
}

/// Sends one control request and returns the response type.
fn code(qt: &mut Qtest, dev: &mut VirtioPciDevice, req: &[u8]) -> u32 {
    let resp = ctrl(qt, dev, req, CTRL_HDR_SIZE);
    CtrlHeader::parse(&resp).unwrap().ctrl_type
}

/// BGRX bytes of the test picture: quadrants red (top left), green (top right), blue (bottom
/// left), white (bottom right), with `black` pixels at the top-left corner (a square of that
/// edge).
fn picture(black: u32) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(RES_BYTES);
    for y in 0..EDGE {
        for x in 0..EDGE {
            let (r, g, b) = match (x < EDGE / 2, y < EDGE / 2) {
                _ if x < black && y < black => (0, 0, 0),
                (true, true) => (255, 0, 0),
                (false, true) => (0, 255, 0),
                (true, false) => (0, 0, 255),
                (false, false) => (255, 255, 255),
            };
            bytes.extend_from_slice(&[b, g, r, 0xff]);
        }
    }
    bytes
}

/// Writes `bytes` into guest RAM as four page-aligned pieces allocated in reverse order, so the
/// backing is scattered; returns the entries in backing order.
fn scattered_backing(
    qt: &mut Qtest,
    ram: &mut vgpu_guest_drivers::guest_ram::GuestRam,
    bytes: &[u8],
) -> Vec<(u64, u32)> {
    let piece = bytes.len().div_ceil(4);
    let mut addrs: Vec<u64> = (0..4)
        .map(|_| ram.alloc(piece as u64, PAGE).unwrap())
        .collect();
    addrs.reverse();
    bytes
        .chunks(piece)
        .zip(addrs)
        .map(|(chunk, addr)| {
            qt.memwrite(addr, chunk).unwrap();
            (addr, chunk.len() as u32)
        })
        .collect()
}

/// Creates resource `id` (EDGE x EDGE, B8G8R8X8) backed by `picture(black)` and transfers it.
fn backed_resource(
    qt: &mut Qtest,
    dev: &mut VirtioPciDevice,
    ram: &mut vgpu_guest_drivers::guest_ram::GuestRam,
    id: u32,
    black: u32,
) -> Vec<(u64, u32)> {
    let full = Rect::new(0, 0, EDGE, EDGE);
    let entries = scattered_backing(qt, ram, &picture(black));
    for req in [
        gpu::resource_create_2d(id, FORMAT_B8G8R8X8, EDGE, EDGE),
        gpu::resource_attach_backing(id, &entries),
        gpu::transfer_to_host_2d(id, full, 0),
    ] {
        assert_eq!(code(qt, dev, &req), RESP_OK_NODATA, "{:#x?}", &req[..4]);
    }
    entries
}

/// Pixel statistics of a decoded RGB image.
#[derive(Debug, PartialEq, Eq)]
struct Stats {
    width: u32,
    height: u32,
    red: usize,
    green: usize,
    blue: usize,
    white: usize,
    black: usize,
    other: usize,
    /// Mean of all channels of all pixels.
    mean: u64,
}

fn png_stats(path: &Path) -> Option<Stats> {
    let file = std::fs::File::open(path).ok()?;
    let mut reader = png::Decoder::new(std::io::BufReader::new(file))
        .read_info()
        .ok()?;
    let mut buf = vec![0; reader.output_buffer_size()?];
    let info = reader.next_frame(&mut buf).ok()?;
    assert_eq!(info.color_type, png::ColorType::Rgb);
    let pixels = &buf[..info.buffer_size()];
    let mut s = Stats {
        width: info.width,
        height: info.height,
        red: 0,
        green: 0,
        blue: 0,
        white: 0,
        black: 0,
        other: 0,
        mean: pixels.iter().map(|&b| u64::from(b)).sum::<u64>() / pixels.len().max(1) as u64,
    };
    for px in pixels.chunks_exact(3) {
        match px {
            [255, 0, 0] => s.red += 1,
            [0, 255, 0] => s.green += 1,
            [0, 0, 255] => s.blue += 1,
            [255, 255, 255] => s.white += 1,
            [0, 0, 0] => s.black += 1,
            _ => s.other += 1,
        }
    }
    Some(s)
}

/// Expected statistics of `picture(black)` for black < EDGE / 2.
fn expected(black: u32) -> Stats {
    let q = (EDGE * EDGE / 4) as usize;
    let k = (black * black) as usize;
    // Red and black share the first quadrant; white counts three channels.
    let sum = 255 * ((q - k) as u64 + 5 * q as u64);
    Stats {
        width: EDGE,
        height: EDGE,
        red: q - k,
        green: q,
        blue: q,
        white: q,
        black: k,
        other: 0,
        mean: sum / (u64::from(EDGE * EDGE) * 3),
    }
}

/// Waits until the PNG at `path` decodes to `want`.
fn wait_png(path: &Path, want: &Stats) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let got = png_stats(path);
        if got.as_ref() == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} shows {got:?}, expected {want:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A server that dumps into a fresh directory, with the request socket (SIGUSR1's stand-in).
fn dumping_server(display: DisplayConfig) -> (TestServer, TempDir, UnixStream) {
    let dir = TempDir::new("vgpu-dump").unwrap();
    let (config, requests) = DumpConfig::new(dir.path()).with_requests().unwrap();
    let server = TestServer::start_dumping(display, 1, Some(config));
    (server, dir, requests)
}

fn assert_live(guest: &mut VgpuGuest, server: &TestServer) {
    let qt = guest.vm.qtest();
    assert_eq!(
        guest.dev.status(qt).unwrap() & NEEDS_RESET,
        0,
        "no NEEDS_RESET"
    );
    assert_eq!(server.counter("transport_faults"), 0);
    assert_eq!(guest.display_info(None).pmodes[0].enabled, 1);
}

#[test]
fn scanout_png_shows_the_transferred_picture() {
    if skip_without_qemu() {
        return;
    }
    let (server, dir, mut requests) = dumping_server(DisplayConfig::default());
    let png_path = dir.path().join("scanout0.png");
    let mut guest = VgpuGuest::start(&server);
    let (qt, dev, ram) = (guest.vm.qtest(), &mut guest.dev, &mut guest.ram);
    let full = Rect::new(0, 0, EDGE, EDGE);
    let entries = backed_resource(qt, dev, ram, 1, 0);
    assert_eq!(code(qt, dev, &gpu::set_scanout(0, 1, full)), RESP_OK_NODATA);
    assert!(!png_path.exists(), "nothing flushed yet");
    assert_eq!(code(qt, dev, &gpu::resource_flush(1, full)), RESP_OK_NODATA);
    // The first flush is written at once.
    wait_png(&png_path, &expected(0));
    assert_eq!(server.counter("frames_flushed"), 1);

    // Paint a 16x16 black corner in guest RAM, transfer just that rectangle and flush it.
    let corner = Rect::new(0, 0, 16, 16);
    let black = picture(16);
    let (addr, _) = entries[0];
    qt.memwrite(addr, &black[..entries[0].1 as usize]).unwrap();
    for req in [
        gpu::transfer_to_host_2d(1, corner, 0),
        gpu::resource_flush(1, corner),
    ] {
        assert_eq!(code(qt, dev, &req), RESP_OK_NODATA);
    }
    assert_eq!(server.counter("frames_flushed"), 2);
    // Within a second of the first dump: the request socket (SIGUSR1) writes it now, or the
    // rate limiter's timer writes it a second after the first.
    requests.write_all(&[1]).unwrap();
    wait_png(&png_path, &expected(16));
    // Counted once its file is written, which the wait above may see first.
    server.wait_counter("scanout_dumps", |dumps| dumps >= 2);

    // Disconnect writes the last image once more.
    drop(guest);
    server.wait(SERVER_EXIT).unwrap();
    assert_eq!(png_stats(&png_path), Some(expected(16)));
    assert!(!dir.path().join(".scanout0.png.tmp").exists());
}

#[test]
fn get_edid_describes_the_configured_mode() {
    if skip_without_qemu() {
        return;
    }
    let server = TestServer::start_with("1280x800".parse().unwrap(), 1);
    let mut guest = VgpuGuest::start(&server);
    let qt = guest.vm.qtest();
    let offered = guest.dev.device_features(qt).unwrap();
    assert_ne!(
        offered & 1 << F_EDID,
        0,
        "VIRTIO_GPU_F_EDID offered: {offered:#x}"
    );
    let resp = ctrl(qt, &mut guest.dev, &gpu::get_edid(0), RESP_EDID_SIZE);
    let edid = EdidResponse::parse(&resp).unwrap().edid;
    assert_eq!(edid.len(), 128);
    assert_eq!(&edid[..8], &[0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0]);
    assert_eq!(
        edid.iter().fold(0u8, |s, &b| s.wrapping_add(b)),
        0,
        "checksum"
    );
    assert_eq!((edid[18], edid[19]), (1, 4), "EDID 1.4");
    let d = &edid[54..72];
    let width = u32::from(d[2]) | u32::from(d[4] >> 4) << 8;
    let height = u32::from(d[5]) | u32::from(d[7] >> 4) << 8;
    assert_eq!((width, height), (1280, 800), "preferred detailed timing");
    assert_eq!(&edid[35..38], &[0, 0, 0], "no established timings");
    assert!(edid[38..54].iter().all(|&b| b == 1), "no standard timings");
    assert_eq!(
        code(qt, &mut guest.dev, &gpu::get_edid(1)),
        RESP_ERR_INVALID_PARAMETER
    );
    // Negotiating the feature works like any other.
    guest.dev.reset(qt).unwrap();
    let features = guest
        .dev
        .negotiate(qt, 1 << VIRTIO_F_VERSION_1 | 1 << F_EDID)
        .unwrap();
    assert_eq!(features, 1 << VIRTIO_F_VERSION_1 | 1 << F_EDID);
}

/// The bad commands and the codes our device answers them with; `outside` is a guest-physical
/// address outside guest RAM. Resource 1 is the neighbour, already set up, and is never named.
fn bad_commands(outside: u64) -> Vec<(&'static str, Vec<u8>, u32)> {
    let full = Rect::new(0, 0, EDGE, EDGE);
    let mut short_create = gpu::resource_create_2d(9, FORMAT_B8G8R8X8, 8, 8);
    short_create.truncate(CTRL_HDR_SIZE + 8);
    vec![
        (
            "unref unknown",
            gpu::resource_unref(99),
            RESP_ERR_INVALID_RESOURCE_ID,
        ),
        (
            "flush unknown",
            gpu::resource_flush(99, full),
            RESP_ERR_INVALID_RESOURCE_ID,
        ),
        (
            "transfer unknown",
            gpu::transfer_to_host_2d(99, full, 0),
            RESP_ERR_INVALID_RESOURCE_ID,
        ),
        (
            "attach unknown",
            gpu::resource_attach_backing(99, &[(0x10_0000, 4096)]),
            RESP_ERR_INVALID_RESOURCE_ID,
        ),
        (
            "detach unknown",
            gpu::resource_detach_backing(99),
            RESP_ERR_INVALID_RESOURCE_ID,
        ),
        (
            "scanout unknown",
            gpu::set_scanout(0, 99, full),
            RESP_ERR_INVALID_RESOURCE_ID,
        ),
        (
            "create id 0",
            gpu::resource_create_2d(0, FORMAT_B8G8R8X8, 8, 8),
            RESP_ERR_INVALID_RESOURCE_ID,
        ),
        (
            "bad scanout",
            gpu::set_scanout(1, 2, full),
            RESP_ERR_INVALID_SCANOUT_ID,
        ),
        (
            "huge scanout id",
            gpu::set_scanout(u32::MAX, 0, full),
            RESP_ERR_INVALID_SCANOUT_ID,
        ),
        (
            "scanout rect outside",
            gpu::set_scanout(0, 2, Rect::new(1, 0, EDGE, EDGE)),
            RESP_ERR_INVALID_PARAMETER,
        ),
        (
            "transfer outside the resource",
            gpu::transfer_to_host_2d(2, Rect::new(EDGE - 1, 0, 2, 1), 0),
            RESP_ERR_INVALID_PARAMETER,
        ),
        (
            "transfer rect wraps",
            gpu::transfer_to_host_2d(2, Rect::new(u32::MAX, 0, 2, 1), 0),
            RESP_ERR_INVALID_PARAMETER,
        ),
        (
            "transfer past the backing",
            gpu::transfer_to_host_2d(2, full, 4),
            RESP_ERR_INVALID_PARAMETER,
        ),
        (
            "transfer offset wraps",
            gpu::transfer_to_host_2d(2, full, u64::MAX - 8),
            RESP_ERR_INVALID_PARAMETER,
        ),
        (
            "flush outside",
            gpu::resource_flush(2, Rect::new(0, EDGE, 1, 1)),
            RESP_ERR_INVALID_PARAMETER,
        ),
        (
            "oversized entry count",
            gpu::resource_attach_backing_claiming(3, 16385, &[(0x10_0000, 4096)]),
            RESP_ERR_INVALID_PARAMETER,
        ),
        (
            "entries missing",
            gpu::resource_attach_backing_claiming(3, 3, &[(0x10_0000, 4096)]),
            RESP_ERR_INVALID_PARAMETER,
        ),
        (
            "unsupported format",
            gpu::resource_create_2d(9, 0x1234, 8, 8),
            RESP_ERR_INVALID_PARAMETER,
        ),
        (
            "zero width",
            gpu::resource_create_2d(9, FORMAT_B8G8R8X8, 0, 8),
            RESP_ERR_INVALID_PARAMETER,
        ),
        (
            "host memory",
            gpu::resource_create_2d(9, FORMAT_B8G8R8X8, 16384, 16384),
            RESP_ERR_OUT_OF_MEMORY,
        ),
        ("short create", short_create, RESP_ERR_INVALID_PARAMETER),
        (
            "transfer without backing",
            gpu::transfer_to_host_2d(3, Rect::new(0, 0, 8, 8), 0),
            RESP_ERR_UNSPEC,
        ),
        (
            "attach outside guest RAM",
            gpu::resource_attach_backing(3, &[(outside, 4096)]),
            RESP_ERR_UNSPEC,
        ),
        (
            "attach partly outside guest RAM",
            gpu::resource_attach_backing(3, &[(0x10_0000, 4096), (outside, 4096)]),
            RESP_ERR_UNSPEC,
        ),
        (
            "attach twice",
            gpu::resource_attach_backing(2, &[(0x10_0000, 4096)]),
            RESP_ERR_UNSPEC,
        ),
        (
            "double create",
            gpu::resource_create_2d(2, FORMAT_B8G8R8X8, 8, 8),
            RESP_ERR_INVALID_RESOURCE_ID,
        ),
    ]
}

#[test]
fn bad_commands_get_error_codes_and_spare_the_neighbour() {
    if skip_without_qemu() {
        return;
    }
    let (server, dir, mut requests) = dumping_server(DisplayConfig::default());
    let png_path = dir.path().join("scanout0.png");
    let mut guest = VgpuGuest::start(&server);
    let outside = guest.vm.ram_bytes() + 0x100_0000;
    let (qt, dev, ram) = (guest.vm.qtest(), &mut guest.dev, &mut guest.ram);
    let full = Rect::new(0, 0, EDGE, EDGE);
    // The neighbour: resource 1 on the scanout.
    backed_resource(qt, dev, ram, 1, 4);
    for req in [gpu::set_scanout(0, 1, full), gpu::resource_flush(1, full)] {
        assert_eq!(code(qt, dev, &req), RESP_OK_NODATA);
    }
    wait_png(&png_path, &expected(4));
    // Resource 2: a valid target for range errors; resource 3: refused backing outside guest
    // RAM when it is attached (issue 24, finding 8: as QEMU's device, not at transfer).
    backed_resource(qt, dev, ram, 2, 0);
    let create = gpu::resource_create_2d(3, FORMAT_B8G8R8X8, 8, 8);
    assert_eq!(code(qt, dev, &create), RESP_OK_NODATA);
    let errors_before = server.counter("ctrl_errors");
    let bad = bad_commands(outside);
    for (what, req, want) in &bad {
        let resp = ctrl(qt, dev, req, CTRL_HDR_SIZE);
        let got = CtrlHeader::parse(&resp).unwrap().ctrl_type;
        assert_eq!(got, *want, "{what}: {got:#x}, expected {want:#x}");
    }
    assert_eq!(
        server.counter("ctrl_errors") - errors_before,
        bad.len() as u64
    );
    // A fenced bad command still echoes its fence.
    let mut fenced = gpu::resource_unref(99);
    fenced[..CTRL_HDR_SIZE]
        .copy_from_slice(&CtrlHeader::fenced(gpu::CMD_RESOURCE_UNREF, 77).to_bytes());
    let h = CtrlHeader::parse(&ctrl(qt, dev, &fenced, CTRL_HDR_SIZE)).unwrap();
    assert_eq!(
        (h.ctrl_type, h.is_fenced(), h.fence_id),
        (RESP_ERR_INVALID_RESOURCE_ID, true, 77)
    );
    // Resource 3 takes a backing in guest RAM and then works.
    let good = ram.alloc(8 * 8 * 4, PAGE).unwrap();
    for req in [
        gpu::resource_attach_backing(3, &[(good, 8 * 8 * 4)]),
        gpu::transfer_to_host_2d(3, Rect::new(0, 0, 8, 8), 0),
        gpu::resource_unref(3),
        gpu::resource_unref(2),
    ] {
        assert_eq!(code(qt, dev, &req), RESP_OK_NODATA);
    }
    assert_live(&mut guest, &server);
    // The neighbour is intact: a dump now still shows its picture.
    let frames = server.counter("frames_flushed");
    let _ = std::fs::remove_file(&png_path);
    requests.write_all(&[1]).unwrap();
    wait_png(&png_path, &expected(4));
    let qt = guest.vm.qtest();
    assert_eq!(
        code(qt, &mut guest.dev, &gpu::resource_flush(1, full)),
        RESP_OK_NODATA
    );
    assert_eq!(server.counter("frames_flushed"), frames + 1);
    drop(guest);
    server.wait(SERVER_EXIT).unwrap();
}

#[test]
fn reset_frees_resources_and_keeps_serving() {
    if skip_without_qemu() {
        return;
    }
    let server = TestServer::start(1);
    let mut guest = VgpuGuest::start(&server);
    let (qt, dev, ram) = (guest.vm.qtest(), &mut guest.dev, &mut guest.ram);
    backed_resource(qt, dev, ram, 1, 0);
    dev.reset(qt).unwrap();
    guest.bring_up();
    let (qt, dev) = (guest.vm.qtest(), &mut guest.dev);
    assert_eq!(
        code(qt, dev, &gpu::resource_unref(1)),
        RESP_ERR_INVALID_RESOURCE_ID,
        "gone with the reset"
    );
    assert_eq!(
        code(
            qt,
            dev,
            &gpu::resource_create_2d(1, FORMAT_B8G8R8X8, EDGE, EDGE)
        ),
        RESP_OK_NODATA,
        "the id is free again"
    );
    assert_live(&mut guest, &server);
}

/// QEMU's own virtio-gpu-pci at DRIVER_OK (EDID negotiated).
fn reference_gpu() -> (
    QtestVm,
    VirtioPciDevice,
    vgpu_guest_drivers::guest_ram::GuestRam,
) {
    let mut vm = QtestVm::launch(&VmConfig::default().device("virtio-gpu-pci")).unwrap();
    let mut ram = vm.guest_ram();
    let qt = vm.qtest();
    let pci = pci::find_device(qt, VIRTIO_PCI_VENDOR_ID, VIRTIO_GPU_DEVICE_ID).unwrap();
    let mut dev = VirtioPciDevice::probe(qt, pci, &mut PciAllocator::new()).unwrap();
    let wanted = 1 << VIRTIO_F_VERSION_1 | 1 << F_EDID;
    assert_eq!(dev.negotiate(qt, wanted).unwrap(), wanted);
    dev.setup_queue(qt, &mut ram, CONTROL_QUEUE, 64, None)
        .unwrap();
    dev.setup_queue(qt, &mut ram, CURSOR_QUEUE, 16, None)
        .unwrap();
    dev.driver_ok(qt).unwrap();
    (vm, dev, ram)
}

#[test]
fn builders_and_codes_match_qemus_virtio_gpu() {
    if skip_without_qemu() {
        return;
    }
    let (mut vm, mut dev, mut ram) = reference_gpu();
    let qt = vm.qtest();
    let full = Rect::new(0, 0, EDGE, EDGE);
    backed_resource(qt, &mut dev, &mut ram, 1, 0);
    for req in [gpu::set_scanout(0, 1, full), gpu::resource_flush(1, full)] {
        assert_eq!(code(qt, &mut dev, &req), RESP_OK_NODATA);
    }
    let edid = EdidResponse::parse(&ctrl(qt, &mut dev, &gpu::get_edid(0), RESP_EDID_SIZE))
        .unwrap()
        .edid;
    assert!(edid.len() >= 128);
    // The error codes QEMU gives for the bad commands whose meaning is unambiguous; ours
    // (checked above) are the same.
    backed_resource(qt, &mut dev, &mut ram, 2, 0);
    for (what, req, want) in bad_commands(0) {
        let same_in_qemu = matches!(
            what,
            "unref unknown"
                | "flush unknown"
                | "transfer unknown"
                | "attach unknown"
                | "scanout unknown"
                | "bad scanout"
                | "huge scanout id"
                | "scanout rect outside"
                | "transfer outside the resource"
                | "flush outside"
                | "unsupported format"
                | "create id 0"
                | "double create"
        );
        if same_in_qemu {
            assert_eq!(code(qt, &mut dev, &req), want, "QEMU, {what}");
        }
    }
}
