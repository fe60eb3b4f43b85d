//! The server against a hostile vfio-user client (a raw client plays a QEMU that sends what QEMU
//! never would). The relay refuses malformed frames before the message loop sees them: an
//! EINVAL reply where the message expects one, the connection closed where it does not; bad
//! register widths inside a region reach the device, which needs a reset. The server then
//! serves the next VM.

use std::os::fd::AsRawFd;
use std::time::Duration;

use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_MASK, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_IRQ_SET_DATA_NONE, VFIO_PCI_BAR2_REGION_INDEX, VFIO_PCI_BAR4_REGION_INDEX,
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
};
use vgpu_tests::TempDir;
use vgpu_tests::guest::{ServerProcess, server_binary};
use vgpu_tests::raw_guest::{ISR, RawGuest, wait_interrupt};
use vgpu_tests::server::{TestServer, VgpuGuest};
use vgpu_tests::skip_without_qemu;
use vgpu_tests::vfio_user_raw::{FLAG_NO_REPLY, RawClient, RawError, cmd};
use vmm_sys_util::eventfd::EventFd;

const BAR4: u32 = VFIO_PCI_BAR4_REGION_INDEX;
const STATUS: u64 = 0x14;
const NEEDS_RESET: u8 = 0x40;
/// Longest wait for what the device does after a message, on a host whose cores are all
/// busy with other work too (`qemu-scripts/test.sh --loaded`).
const TIMEOUT: Duration = Duration::from_secs(20);
const EINVAL: u32 = libc::EINVAL as u32;

fn status(client: &mut RawClient) -> u8 {
    client.region_read(BAR4, STATUS, 1).unwrap()[0]
}

fn refused(r: Result<impl std::fmt::Debug, RawError>) -> bool {
    matches!(r, Err(RawError::Refused { .. }))
}

#[test]
fn malformed_messages_are_refused() {
    let server = TestServer::start(1);
    let mut client = RawClient::connect(server.socket()).expect("client connects");

    let id = client
        .region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, 4)
        .unwrap();
    assert_eq!(id, 0x1050_1af4u32.to_le_bytes());
    assert_eq!(status(&mut client), 0);

    // Reads outside a region, of regions without registers, or of bad widths are refused.
    assert!(refused(client.region_read(
        VFIO_PCI_CONFIG_REGION_INDEX,
        254,
        4
    )));
    assert!(refused(client.region_read(BAR4, 0x4000, 4)));
    assert!(refused(client.region_read(BAR4, u64::MAX - 1, 4)));
    assert!(
        refused(client.region_read(0, 0, 4)),
        "BAR 0 is not implemented"
    );
    assert!(refused(client.region_read(BAR4, 0, 3)), "3-byte access");
    assert!(refused(client.region_read(BAR4, 2, 4)), "unaligned access");
    assert!(refused(client.region_read(
        VFIO_PCI_BAR2_REGION_INDEX,
        0x1000,
        8
    )));
    assert!(refused(client.region_read(42, 0, 4)), "no such region");
    assert_eq!(
        server.counter("refused_messages"),
        6,
        "accesses outside the region table stop at the relay"
    );
    assert_eq!(
        server.counter("invalid_accesses"),
        2,
        "bad widths inside a region reach the device"
    );
    assert_ne!(
        status(&mut client) & NEEDS_RESET,
        0,
        "violations put the device into NEEDS_RESET"
    );

    // Posted writes are never answered; a bad width inside the region keeps the connection.
    client.region_write_posted(BAR4, 0x2001, &[0; 2]).unwrap();
    assert_eq!(status(&mut client) & NEEDS_RESET, NEEDS_RESET);
    assert_eq!(server.counter("invalid_accesses"), 3);
    client.reset().unwrap();
    assert_eq!(status(&mut client), 0, "DEVICE_RESET clears NEEDS_RESET");
}

/// The errno of a refusal, or a panic naming what came back instead.
fn errno(r: Result<impl std::fmt::Debug, RawError>) -> u32 {
    match r {
        Err(RawError::Refused { errno, .. }) => errno,
        other => panic!("expected an error reply, got {other:?}"),
    }
}

#[test]
fn malformed_version_messages_are_answered() {
    let server = TestServer::start(2);
    let mut client = RawClient::connect_unnegotiated(server.socket()).unwrap();
    // Version 0.1 with a capability string lacking its terminating NUL, with two NULs, none
    // at all, and a header alone (the crate would read the next message as its version).
    for caps in [&b"{}"[..], b"{}\0{}\0", b""] {
        let mut payload = vec![0, 0, 1, 0];
        payload.extend_from_slice(caps);
        assert_eq!(errno(client.call(cmd::VERSION, &payload, &[])), EINVAL);
    }
    assert_eq!(errno(client.call(cmd::VERSION, &[], &[])), EINVAL);
    // Bigger than MAX_VERSION_BYTES: skipped unread, answered, still in step.
    let mut huge = vec![0, 0, 1, 0];
    huge.extend(std::iter::repeat_n(b' ', 8192));
    huge.push(0);
    assert_eq!(errno(client.call(cmd::VERSION, &huge, &[])), EINVAL);
    assert_eq!(server.counter("refused_messages"), 5);

    // The same connection negotiates and is served: nothing panicked, nothing was dropped.
    client
        .call(cmd::VERSION, &RawClient::version_payload(), &[])
        .expect("a well-formed VERSION after the bad ones");
    assert_eq!(status(&mut client), 0);
    drop(client);
    let mut next = RawClient::connect(server.socket()).expect("the server still serves");
    assert_eq!(status(&mut next), 0);
    drop(next);
    server.wait(Duration::from_secs(10)).unwrap();
}

/// Found by the `vfio_user_stream` fuzz target (docs/FUZZING.md): a VERSION message whose
/// header declares fewer bytes than the VERSION struct makes the `vfio-user` crate subtract with
/// overflow (`message_size - size_of::<Version>()`; in a build without overflow checks a
/// capacity overflow instead). `serve_one` must contain it to that connection.
#[test]
fn version_message_shorter_than_its_header_costs_only_its_connection() {
    use std::io::{Read, Write};
    let server = TestServer::start(2);
    let mut stream = std::os::unix::net::UnixStream::connect(server.socket()).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut message = Vec::new();
    message.extend_from_slice(&0u16.to_le_bytes()); // message id
    message.extend_from_slice(&cmd::VERSION.to_le_bytes());
    message.extend_from_slice(&16u32.to_le_bytes()); // the header alone, no version fields
    message.extend_from_slice(&[0; 8]); // flags, error
    message.extend_from_slice(&[0, 0, 1, 0]); // major 0, minor 1, read as the struct's tail
    stream.write_all(&message).unwrap();
    let mut rest = Vec::new();
    let closed = stream.read_to_end(&mut rest);
    assert!(
        matches!(closed, Ok(0)) || closed.is_err(),
        "connection dropped: {closed:?} {rest:?}"
    );
    drop(stream);
    let mut next = RawClient::connect(server.socket()).expect("the server still serves");
    assert_eq!(status(&mut next), 0);
    drop(next);
    server.wait(Duration::from_secs(10)).unwrap();
}

#[test]
fn posted_write_outside_a_region_closes_the_connection() {
    let server = TestServer::start(2);
    let mut client = RawClient::connect(server.socket()).unwrap();
    // QEMU bounds MMIO writes by the BAR size it was given: only a broken or hostile QEMU
    // sends this, and a posted message cannot be answered.
    client.region_write_posted(BAR4, 0x3ffe, &[0; 4]).unwrap();
    assert!(
        matches!(client.region_read(BAR4, STATUS, 1), Err(RawError::Io(_))),
        "connection closed"
    );
    assert_eq!(server.counter("refused_messages"), 1);
    assert_eq!(server.counter("invalid_accesses"), 0);
    drop(client);
    let mut next = RawClient::connect(server.socket()).expect("the server still serves");
    assert_eq!(status(&mut next), 0, "a fresh device");
    drop(next);
    server.wait(Duration::from_secs(10)).unwrap();
}

#[test]
fn unframeable_messages_close_the_connection() {
    // A header shorter than itself, a message past the frame limit, a reply from the client.
    for (size, flags) in [(8, 0), (u32::MAX, 0), (16, 1)] {
        let server = TestServer::start(1);
        let mut client = RawClient::connect(server.socket()).unwrap();
        client
            .send_frame(cmd::DEVICE_RESET, size, flags, &[], &[])
            .unwrap();
        assert!(
            matches!(client.reply(cmd::DEVICE_RESET), Err(RawError::Io(_))),
            "size {size} flags {flags}: connection closed"
        );
        assert_eq!(server.counter("refused_messages"), 1);
        drop(client);
        server.wait(Duration::from_secs(10)).unwrap();
    }
}

#[test]
fn bad_dma_maps_and_irqs_are_refused() {
    let server = TestServer::start(1);
    let mut client = RawClient::connect(server.socket()).unwrap();
    let dir = TempDir::new("vgpu-dma").unwrap();
    let ram = dir.file("ram", 0x10000).unwrap();

    assert!(
        refused(client.dma_map(&ram, 0, 0x1000_0000, 0x20000)),
        "past the end of the file"
    );
    assert!(
        refused(client.dma_map(&ram, 0x8000, 0x1000_0000, 0x10000)),
        "offset + size past the end"
    );
    assert!(
        refused(client.dma_map(&ram, 0, u64::MAX - 0xfff, 0x2000)),
        "wrapping range"
    );
    assert!(
        refused(client.dma_map(&ram, 0, 0x1000_0000, 0)),
        "empty range"
    );
    client.dma_map(&ram, 0, 0x1000_0000, 0x10000).unwrap();
    assert!(
        refused(client.dma_map(&ram, 0, 0x1000_8000, 0x10000)),
        "overlap"
    );
    assert!(
        refused(client.dma_unmap(0x1000_0000, 0x8000)),
        "unmap splitting a region"
    );
    client.dma_unmap(0x1000_0000, 0x10000).unwrap();
    let (sock, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let sock = std::fs::File::from(std::os::fd::OwnedFd::from(sock));
    assert!(
        refused(client.dma_map(&sock, 0, 0x2000_0000, 0x1000)),
        "not a regular file"
    );
    assert_eq!(server.counter("dma_maps"), 1);

    let efd = EventFd::new(0).unwrap();
    let trigger = VFIO_IRQ_SET_ACTION_TRIGGER | VFIO_IRQ_SET_DATA_EVENTFD;
    let fd = efd.as_raw_fd();
    assert!(
        refused(client.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, trigger, 3, 1, &[fd])),
        "vector 3 of 3"
    );
    assert!(
        refused(client.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, trigger, u32::MAX, 2, &[])),
        "wrapping range"
    );
    assert!(
        refused(client.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, trigger, 0, 2, &[fd])),
        "fd count"
    );
    let mask = VFIO_IRQ_SET_ACTION_MASK | VFIO_IRQ_SET_DATA_NONE;
    assert!(
        refused(client.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, mask, 0, 1, &[])),
        "MSI-X masking is QEMU's"
    );
    assert!(
        refused(client.set_irqs(9, trigger, 0, 1, &[fd])),
        "no such index"
    );
    let (pipe, _writer) = std::io::pipe().unwrap();
    assert!(
        refused(client.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, trigger, 0, 1, &[pipe.as_raw_fd()])),
        "a pipe is not an eventfd: a write to a full one would block the device"
    );
    client
        .set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, trigger, 0, 1, &[fd])
        .unwrap();

    // More descriptors than the command carries: refused, every one closed, still in step.
    let mut map = Vec::new();
    for v in [32u32, 3] {
        map.extend_from_slice(&v.to_le_bytes());
    }
    for v in [0u64, 0x2000_0000, 0x10000] {
        map.extend_from_slice(&v.to_le_bytes());
    }
    let two = [ram.as_raw_fd(), ram.as_raw_fd()];
    assert_eq!(errno(client.call(cmd::DMA_MAP, &map, &two)), EINVAL);
    assert_eq!(
        errno(client.call(cmd::REGION_READ, &RawClient::access(BAR4, 0, 4), &[fd])),
        EINVAL,
        "a descriptor on a region read"
    );
    assert_eq!(server.counter("dma_maps"), 1);
    assert_eq!(
        status(&mut client),
        0,
        "refused requests are not device faults"
    );
}

#[test]
fn a_ram_file_truncated_after_dma_map_faults_the_device() {
    let server = TestServer::start(1);
    let mut guest = RawGuest::connect(server.socket(), 0xffff).unwrap();
    guest.publish().unwrap();
    // The RAM file is not sealed: shrink it below the rings and the request.
    guest.truncate_ram(0x2000).unwrap();
    guest.notify().unwrap();
    // The worker walks the queue after the kick; the message loop answers meanwhile.
    let deadline = std::time::Instant::now() + TIMEOUT;
    while guest.status().unwrap() & NEEDS_RESET == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no DEVICE_NEEDS_RESET after the RAM file shrank"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(server.counter("transport_faults") >= 1);
}

#[test]
fn next_vm_is_served_after_a_hostile_client() {
    if skip_without_qemu() {
        return;
    }
    let server = TestServer::start(2);
    let mut client = RawClient::connect(server.socket()).unwrap();
    let dir = TempDir::new("vgpu-dma").unwrap();
    client
        .dma_map(&dir.file("ram", 0x10000).unwrap(), 0, 0, 0x10000)
        .unwrap();
    client.region_write_posted(BAR4, 0x2001, &[0; 2]).unwrap();
    assert_ne!(status(&mut client) & NEEDS_RESET, 0);
    drop(client);

    let mut guest = VgpuGuest::start(&server);
    let qt = guest.vm.qtest();
    assert_eq!(
        guest.dev.status(qt).unwrap() & NEEDS_RESET,
        0,
        "a fresh device per connection"
    );
    assert_eq!(guest.display_info(None).pmodes[0].enabled, 1);
    drop(guest);
    server.wait(Duration::from_secs(10)).unwrap();
}

#[test]
fn intx_stays_masked_until_the_resample_eventfd() {
    let server = TestServer::start(1);
    let mut guest = RawGuest::connect(server.socket(), 0xffff).unwrap();
    let trigger = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let resample = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    guest
        .set_trigger(VFIO_PCI_INTX_IRQ_INDEX, 0, &trigger)
        .unwrap();
    guest.set_intx_resample(&resample).unwrap();

    guest.publish().unwrap();
    guest.notify().unwrap();
    assert_eq!(
        wait_interrupt(&trigger, TIMEOUT).unwrap(),
        1,
        "INTx asserted"
    );

    // A second completion while the line is masked (no EOI yet) does not fire again.
    guest.publish().unwrap();
    guest.notify().unwrap();
    let deadline = std::time::Instant::now() + TIMEOUT;
    while guest.used_idx() != 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "second request never completed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(trigger.read().is_err(), "masked until the guest's EOI");

    // The EOI (KVM signals the resample eventfd): the ISR is still pending, so INTx fires again.
    resample.write(1).unwrap();
    assert_eq!(
        wait_interrupt(&trigger, TIMEOUT).unwrap(),
        1,
        "re-asserted after the EOI"
    );
    // Reading the ISR deasserts the line; after the next EOI nothing is pending.
    let isr = guest
        .client
        .region_read(VFIO_PCI_BAR4_REGION_INDEX, ISR, 1)
        .unwrap();
    assert_eq!(isr, [1], "queue interrupt");
    resample.write(1).unwrap();
    assert_eq!(
        wait_interrupt(&trigger, Duration::from_millis(200)).unwrap(),
        0,
        "nothing pending"
    );
    assert_eq!(guest.status().unwrap(), 0xf);
}

/// Resident memory of process `pid` in KiB (`VmRSS` of /proc/PID/status).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("process status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line")
}

/// Data streamed behind the huge REGION_WRITE below: what a server that believed its count
/// would take into memory.
const STREAMED: usize = 128 << 20;
/// RSS growth that counts as "none": connection threads and buffers, far below `STREAMED`.
const RSS_SLACK_KIB: u64 = 32 << 10;

#[test]
fn hostile_frames_cost_the_server_process_nothing() {
    let binary = server_binary().expect("vgpu-server binary");
    let args = ["--renderer".to_string(), "none".to_string()];
    let server = ServerProcess::start(&binary, false, &args).expect("server starts");

    // A malformed VERSION gets an error reply; the connection goes on to negotiate.
    let mut client = RawClient::connect_unnegotiated(server.socket()).unwrap();
    assert_eq!(
        errno(client.call(cmd::VERSION, b"\x00\x00\x01\x00{}", &[])),
        EINVAL
    );
    assert_eq!(errno(client.call(cmd::VERSION, &[], &[])), EINVAL);
    client
        .call(cmd::VERSION, &RawClient::version_payload(), &[])
        .unwrap();
    // Descriptors pass through the relay to the message loop (sendmsg, inside the sandbox).
    let efd = EventFd::new(0).unwrap();
    let trigger = VFIO_IRQ_SET_ACTION_TRIGGER | VFIO_IRQ_SET_DATA_EVENTFD;
    client
        .set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, trigger, 0, 1, &[efd.as_raw_fd()])
        .expect("an eventfd through the relay");
    // A REGION_WRITE claiming 0xffff_ff00 bytes, expecting a reply: refused, still in step.
    let huge = RawClient::access(BAR4, 0, 0xffff_ff00);
    assert_eq!(errno(client.call(cmd::REGION_WRITE, &huge, &[])), EINVAL);
    assert_eq!(status(&mut client), 0);

    // The same write posted (as QEMU posts MMIO writes; its message size wraps to 32), with
    // 128 MiB of "data" behind it: the connection closes before any of it is read.
    let before = rss_kib(server.pid());
    let mut writer = client.stream().try_clone().unwrap();
    client
        .send_frame(cmd::REGION_WRITE, 32, FLAG_NO_REPLY, &huge, &[])
        .unwrap();
    let streamer = std::thread::spawn(move || {
        let chunk = vec![0x5au8; 1 << 20];
        (0..STREAMED / chunk.len()).try_for_each(|_| std::io::Write::write_all(&mut writer, &chunk))
    });
    let streamed = streamer.join().unwrap();
    let after = rss_kib(server.pid());
    println!("server RSS {before} KiB before the write, {after} KiB after");
    assert!(
        after < before + RSS_SLACK_KIB,
        "server RSS grew from {before} KiB to {after} KiB"
    );
    assert!(streamed.is_err(), "the server stopped reading");
    drop(client);

    // The next client is served by a fresh device.
    let mut next = RawClient::connect(server.socket()).expect("the server still serves");
    assert_eq!(status(&mut next), 0);
    drop(next);
    let log = server.log();
    assert!(!log.contains("panic"), "no panic:\n{log}");
    assert!(log.contains("refused"), "refusals logged:\n{log}");
}
