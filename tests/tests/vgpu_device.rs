//! qtest integration tests of the vGPU: QEMU 11.1 `vfio-user-pci` against our server, driven by
//! the guest-side virtio-pci driver through qtest (no guest OS).

use std::time::{Duration, Instant};

use vgpu_guest_drivers::pci::{self, BarKind, CAP_ID_MSIX, CAP_ID_VENDOR, PciAllocator};
use vgpu_guest_drivers::qtest::IrqEvent;
use vgpu_guest_drivers::virtio_gpu::{
    self, CONFIG_NUM_CAPSETS, CONFIG_NUM_SCANOUTS, CONTROL_QUEUE, CTRL_HDR_SIZE, CURSOR_QUEUE,
    CtrlHeader, DISPLAY_INFO_SIZE, RESP_ERR_UNSPEC, RESP_OK_DISPLAY_INFO,
};
use vgpu_guest_drivers::virtio_pci::{
    CAP_COMMON_CFG, CAP_DEVICE_CFG, CAP_ISR_CFG, CAP_NOTIFY_CFG, CAP_PCI_CFG, Descriptor,
    MSI_NO_VECTOR, VIRTIO_PCI_VENDOR_ID, VirtioPciDevice, common_cfg,
};
use vgpu_tests::server::{
    CONFIG_VECTOR, CONTROL_QUEUE_SIZE, CONTROL_VECTOR, CURSOR_QUEUE_SIZE, CURSOR_VECTOR,
    TestServer, VIRTIO_GPU_DEVICE_ID, VgpuGuest,
};
use vgpu_tests::{QtestVm, VmConfig, skip_without_qemu};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};

/// Longest wait for what the device does after a request: long enough for a host whose
/// cores are all busy with other work (`qemu-scripts/test.sh --loaded`).
const TIMEOUT: Duration = Duration::from_secs(20);
const NEEDS_RESET: u8 = VIRTIO_CONFIG_S_NEEDS_RESET as u8;
const SERVER_EXIT: Duration = Duration::from_secs(10);

/// A server for one VM and that VM with the vGPU at DRIVER_OK; `None` (test skipped) without
/// QEMU.
fn vgpu_at_driver_ok() -> Option<(TestServer, VgpuGuest)> {
    if skip_without_qemu() {
        return None;
    }
    let server = TestServer::start(1);
    let guest = VgpuGuest::start(&server);
    Some((server, guest))
}

/// Polls the device status until DEVICE_NEEDS_RESET shows (the worker sets it after the kick).
fn wait_needs_reset(guest: &mut VgpuGuest) -> u8 {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let status = guest.dev.status(guest.vm.qtest()).unwrap();
        if status & NEEDS_RESET != 0 {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "device never reported NEEDS_RESET (status {status:#x})"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Publishes a hand-made chain on the control queue (descriptors from the top of the table,
/// which the driver's allocator hands out last) and notifies.
fn submit_raw(guest: &mut VgpuGuest, chain: &[(u16, Descriptor)]) {
    let qt = guest.vm.qtest();
    for (index, desc) in chain {
        guest
            .dev
            .write_descriptor(qt, CONTROL_QUEUE, *index, desc)
            .unwrap();
    }
    guest
        .dev
        .publish_avail(qt, CONTROL_QUEUE, chain[0].0)
        .unwrap();
    guest.dev.notify(qt, CONTROL_QUEUE).unwrap();
}

/// After a violation: NEEDS_RESET is set, the config vector fired, nothing was completed, and a
/// driver reset brings the device back.
fn assert_faulted_then_recovers(guest: &mut VgpuGuest, server: &TestServer) {
    wait_needs_reset(guest);
    let qt = guest.vm.qtest();
    guest
        .dev
        .wait_msix(qt, CONFIG_VECTOR, TIMEOUT)
        .expect("config-change interrupt");
    assert_eq!(
        guest.dev.read_used_idx(qt, CONTROL_QUEUE).unwrap(),
        0,
        "no chain completed"
    );
    assert!(server.counter("transport_faults") >= 1);
    guest.bring_up();
    let info = guest.display_info(None);
    assert_eq!(info.pmodes[0].enabled, 1);
}

fn raw(addr: u64, len: u32, flags: u32, next: u16) -> Descriptor {
    Descriptor {
        addr,
        len,
        flags: flags as u16,
        next,
    }
}

#[test]
fn enumerates_as_virtio_gpu() {
    if skip_without_qemu() {
        return;
    }
    let server = TestServer::start(1);
    let mut vm = QtestVm::launch(&VmConfig::default().device(server.device_arg())).unwrap();
    let qt = vm.qtest();
    let found = pci::scan_bus0(qt).unwrap();
    let gpu = found
        .iter()
        .find(|f| f.vendor_id == VIRTIO_PCI_VENDOR_ID && f.device_id == VIRTIO_GPU_DEVICE_ID)
        .unwrap_or_else(|| panic!("no 1af4:1050 among {found:x?}"));
    assert_eq!(gpu.address.to_string(), "00:01.0", "first -device slot");
    let dev = pci::PciDevice::new(gpu.address);
    assert_eq!(dev.class_code(qt).unwrap(), (0x03, 0x80, 0x00));
    assert_eq!(
        dev.read_config_u16(qt, 0x2c).unwrap(),
        VIRTIO_PCI_VENDOR_ID,
        "subsystem vendor"
    );

    let caps: Vec<u8> = dev.capabilities(qt).unwrap().iter().map(|c| c.id).collect();
    assert_eq!(
        caps,
        [
            CAP_ID_MSIX,
            CAP_ID_VENDOR,
            CAP_ID_VENDOR,
            CAP_ID_VENDOR,
            CAP_ID_VENDOR,
            CAP_ID_VENDOR
        ]
    );
    let msix = dev.msix_capability(qt).unwrap().expect("MSI-X capability");
    assert_eq!(msix.table_size, 3, "config + two queues: {msix:?}");

    let mut alloc = PciAllocator::new();
    let virtio = VirtioPciDevice::probe(qt, dev, &mut alloc).unwrap();
    let bars: Vec<(u8, BarKind, u64)> = virtio
        .bars()
        .iter()
        .map(|b| (b.index, b.kind, b.size))
        .collect();
    assert_eq!(
        bars,
        [
            (
                2,
                BarKind::Memory32 {
                    prefetchable: false
                },
                0x1000
            ),
            (4, BarKind::Memory64 { prefetchable: true }, 0x4000)
        ]
    );
    let cfg_types: Vec<u8> = virtio.capabilities().iter().map(|c| c.cfg_type).collect();
    assert_eq!(
        cfg_types,
        [
            CAP_COMMON_CFG,
            CAP_ISR_CFG,
            CAP_DEVICE_CFG,
            CAP_NOTIFY_CFG,
            CAP_PCI_CFG
        ]
    );
    assert_eq!(virtio.notify_off_multiplier(), 4);
    assert_eq!(virtio.num_queues(qt).unwrap(), 2);
    assert_eq!(
        virtio
            .read_device_config_u32(qt, CONFIG_NUM_SCANOUTS)
            .unwrap(),
        1
    );
    assert_eq!(
        virtio
            .read_device_config_u32(qt, CONFIG_NUM_CAPSETS)
            .unwrap(),
        0
    );
    drop(vm);
    server.wait(SERVER_EXIT).unwrap();
}

#[test]
fn negotiation_requires_version_1() {
    let Some((_server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let qt = guest.vm.qtest();
    let dev = &mut guest.dev;
    assert_eq!(
        dev.device_features(qt).unwrap(),
        1 << VIRTIO_F_VERSION_1 | 1 << virtio_gpu::F_EDID,
        "VERSION_1 and VIRTIO_GPU_F_EDID offered"
    );
    // A legacy-style driver that does not accept VERSION_1 is refused.
    assert!(dev.negotiate(qt, 0).is_err());
    let status = dev.status(qt).unwrap();
    assert_eq!(
        status & VIRTIO_CONFIG_S_FEATURES_OK as u8,
        0,
        "status {status:#x}"
    );
    // Going on to DRIVER_OK anyway is a violation.
    dev.add_status(qt, VIRTIO_CONFIG_S_DRIVER_OK as u8).unwrap();
    assert_ne!(dev.status(qt).unwrap() & NEEDS_RESET, 0);
    // Unknown feature bits are refused as well.
    dev.reset(qt).unwrap();
    dev.add_status(
        qt,
        (VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER) as u8,
    )
    .unwrap();
    dev.write_driver_features(qt, 1 << VIRTIO_F_VERSION_1 | 1 << 3)
        .unwrap();
    dev.add_status(qt, VIRTIO_CONFIG_S_FEATURES_OK as u8)
        .unwrap();
    assert_eq!(
        dev.status(qt).unwrap() & VIRTIO_CONFIG_S_FEATURES_OK as u8,
        0
    );
    guest.bring_up();
    assert_eq!(
        guest.dev.driver_features(guest.vm.qtest()).unwrap(),
        1 << VIRTIO_F_VERSION_1
    );
}

#[test]
fn queue_setup_reads_back() {
    let Some((_server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let qt = guest.vm.qtest();
    let dev = &guest.dev;
    for (q, size, vector) in [
        (CONTROL_QUEUE, CONTROL_QUEUE_SIZE, CONTROL_VECTOR),
        (CURSOR_QUEUE, CURSOR_QUEUE_SIZE, CURSOR_VECTOR),
    ] {
        let vq = dev.queue(q).unwrap();
        dev.write_common_u16(qt, common_cfg::QUEUE_SELECT, q)
            .unwrap();
        assert_eq!(
            dev.read_common_u16(qt, common_cfg::QUEUE_SIZE).unwrap(),
            size
        );
        assert_eq!(
            dev.read_common_u16(qt, common_cfg::QUEUE_ENABLE).unwrap(),
            1
        );
        assert_eq!(
            dev.read_common_u16(qt, common_cfg::QUEUE_MSIX_VECTOR)
                .unwrap(),
            vector
        );
        assert_eq!(
            dev.read_common_u16(qt, common_cfg::QUEUE_NOTIFY_OFF)
                .unwrap(),
            q
        );
        let desc = u64::from(dev.read_common_u32(qt, common_cfg::QUEUE_DESC).unwrap());
        assert_eq!(desc, vq.desc_address());
        let used = u64::from(dev.read_common_u32(qt, common_cfg::QUEUE_DEVICE).unwrap());
        assert_eq!(used, vq.used_address());
    }
    dev.write_common_u16(qt, common_cfg::QUEUE_SELECT, 2)
        .unwrap();
    assert_eq!(
        dev.read_common_u16(qt, common_cfg::QUEUE_SIZE).unwrap(),
        0,
        "no third queue"
    );
    assert_eq!(dev.status(qt).unwrap() & NEEDS_RESET, 0);
}

#[test]
fn config_window_reaches_the_virtio_registers() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let qt = guest.vm.qtest();
    let dev = &guest.dev;
    let num_queues = u32::from(common_cfg::NUM_QUEUES);
    assert_eq!(dev.pci_cfg_read(qt, 4, num_queues, 2).unwrap(), 2);
    assert_eq!(
        dev.pci_cfg_read(qt, 4, u32::from(common_cfg::DEVICE_STATUS), 1)
            .unwrap(),
        0xf
    );
    assert_eq!(
        dev.pci_cfg_read(qt, 4, 0x2000 + CONFIG_NUM_SCANOUTS, 4)
            .unwrap(),
        1
    );
    // A notification through the window kicks the queue like the notify BAR does.
    let request = guest.ram.alloc(CTRL_HDR_SIZE as u64, 8).unwrap();
    let response = guest.ram.alloc(DISPLAY_INFO_SIZE as u64, 8).unwrap();
    qt.memwrite(request, &virtio_gpu::get_display_info())
        .unwrap();
    let buffers = [
        (request, CTRL_HDR_SIZE as u32, false),
        (response, DISPLAY_INFO_SIZE as u32, true),
    ];
    let head = guest
        .dev
        .write_raw_chain(qt, CONTROL_QUEUE, &buffers)
        .unwrap();
    guest.dev.publish_avail(qt, CONTROL_QUEUE, head).unwrap();
    guest
        .dev
        .pci_cfg_write(qt, 4, 0x3000, 2, u32::from(CONTROL_QUEUE))
        .unwrap();
    let done = guest.dev.wait_used(qt, CONTROL_QUEUE, TIMEOUT).unwrap();
    assert_eq!(
        (done.used.id, done.used.len),
        (u32::from(head), DISPLAY_INFO_SIZE as u32)
    );
    // A window naming no register, or another BAR, is a violation.
    assert_eq!(guest.dev.pci_cfg_read(qt, 2, 0, 4).unwrap(), 0);
    wait_needs_reset(&mut guest);
    assert_eq!(server.counter("transport_faults"), 1);
}

#[test]
fn get_display_info_round_trip_with_msix() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let qt = guest.vm.qtest();
    guest.dev.clear_mailbox(qt, CONTROL_VECTOR).unwrap();
    guest.dev.clear_mailbox(qt, CURSOR_VECTOR).unwrap();
    let info = guest.display_info(None);
    assert_eq!(info.header.ctrl_type, RESP_OK_DISPLAY_INFO);
    let one = info.pmodes[0];
    assert_eq!(
        (one.rect.width, one.rect.height, one.enabled),
        (1024, 768, 1),
        "{info:?}"
    );
    assert!(
        info.pmodes[1..]
            .iter()
            .all(|p| p.enabled == 0 && p.rect.width == 0)
    );
    let qt = guest.vm.qtest();
    guest
        .dev
        .wait_msix(qt, CONTROL_VECTOR, TIMEOUT)
        .expect("MSI-X on the control vector");
    assert!(
        !guest.dev.mailbox_signalled(qt, CURSOR_VECTOR).unwrap(),
        "cursor vector stays quiet"
    );

    // A fenced request completes with its fence echoed.
    let fenced = guest.display_info(Some(42));
    assert!(fenced.header.is_fenced());
    assert_eq!(fenced.header.fence_id, 42);
    assert_eq!(server.counter("ctrl_requests"), 2);
    // The second completion's interrupt is sent (and counted) after its used entry, which
    // the fixture polls for.
    server.wait_counter("interrupts", |n| n >= 2);
    drop(guest);
    server.wait(SERVER_EXIT).unwrap();
}

#[test]
fn configured_mode_is_reported() {
    if skip_without_qemu() {
        return;
    }
    let server = TestServer::start_with("1280x800".parse().unwrap(), 1);
    let mut guest = VgpuGuest::start(&server);
    let one = guest.display_info(None).pmodes[0];
    assert_eq!(
        (one.rect.width, one.rect.height, one.enabled),
        (1280, 800, 1)
    );
}

#[test]
fn cursor_queue_completes_without_response() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let qt = guest.vm.qtest();
    let mut cursor = CtrlHeader::new(virtio_gpu::CMD_MOVE_CURSOR)
        .to_bytes()
        .to_vec();
    cursor.resize(56, 0);
    guest.dev.clear_mailbox(qt, CURSOR_VECTOR).unwrap();
    let done = guest
        .dev
        .transact(qt, CURSOR_QUEUE, &[&cursor], &[], TIMEOUT)
        .unwrap();
    assert_eq!(done.used.len, 0);
    guest.dev.wait_msix(qt, CURSOR_VECTOR, TIMEOUT).unwrap();
    assert_eq!(server.counter("cursor_requests"), 1);
}

#[test]
fn device_reset_clears_queues_and_features() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    guest.display_info(None);
    let qt = guest.vm.qtest();
    let dev = &mut guest.dev;
    dev.reset(qt).unwrap();
    assert_eq!(dev.status(qt).unwrap(), 0);
    assert_eq!(dev.driver_features(qt).unwrap(), 0);
    assert_eq!(
        dev.read_common_u16(qt, common_cfg::CONFIG_MSIX_VECTOR)
            .unwrap(),
        MSI_NO_VECTOR
    );
    for q in [CONTROL_QUEUE, CURSOR_QUEUE] {
        dev.write_common_u16(qt, common_cfg::QUEUE_SELECT, q)
            .unwrap();
        assert_eq!(
            dev.read_common_u16(qt, common_cfg::QUEUE_ENABLE).unwrap(),
            0
        );
        assert_eq!(
            dev.read_common_u16(qt, common_cfg::QUEUE_SIZE).unwrap(),
            256,
            "back to the maximum"
        );
        assert_eq!(dev.read_common_u32(qt, common_cfg::QUEUE_DESC).unwrap(), 0);
        assert_eq!(
            dev.read_common_u16(qt, common_cfg::QUEUE_MSIX_VECTOR)
                .unwrap(),
            MSI_NO_VECTOR
        );
    }
    assert!(
        server.counter("resets") >= 2,
        "negotiation reset + this one"
    );
    guest.bring_up();
    guest.display_info(None);
}

#[test]
fn serves_a_new_vm_after_qemu_is_killed() {
    if skip_without_qemu() {
        return;
    }
    let server = TestServer::start(2);
    let mut first = VgpuGuest::start(&server);
    // Leave a request in flight and kill QEMU under it.
    let qt = first.vm.qtest();
    let request = virtio_gpu::get_display_info();
    first
        .dev
        .request(qt, CONTROL_QUEUE, &[&request], &[DISPLAY_INFO_SIZE as u32])
        .unwrap();
    first.vm.kill().unwrap();
    drop(first);

    let mut second = VgpuGuest::start(&server);
    let one = second.display_info(None).pmodes[0];
    assert_eq!((one.rect.width, one.rect.height), (1024, 768));
    drop(second);
    server
        .wait(SERVER_EXIT)
        .expect("server served two VMs and exited");
}

#[test]
fn intx_when_msix_is_off() {
    if skip_without_qemu() {
        return;
    }
    let server = TestServer::start(1);
    let mut guest = VgpuGuest::start_with(&server, false);
    let qt = guest.vm.qtest();
    qt.command("irq_intercept_in ioapic").unwrap();
    let info = guest.display_info(None);
    assert_eq!(info.pmodes[0].enabled, 1);
    let qt = guest.vm.qtest();
    let deadline = Instant::now() + TIMEOUT;
    let mut raised = Vec::new();
    while raised.is_empty() {
        assert!(Instant::now() < deadline, "no INTx raised");
        qt.command("endianness").unwrap(); // a round trip, so pending IRQ lines are read
        raised = qt
            .take_irq_events()
            .into_iter()
            .filter(|e| matches!(e, IrqEvent::Raise(_)))
            .collect();
    }
    assert_eq!(guest.dev.read_isr(qt).unwrap() & 1, 1, "ISR queue bit");
    // Counted once the line was raised, which QEMU may show first.
    server.wait_counter("interrupts", |n| n >= 1);
}

// ---- negative tests: each violation resets only the device, never the server ----

#[test]
fn bar_access_outside_registers_needs_reset() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let qt = guest.vm.qtest();
    let bar4 = guest.dev.bars().address(4).unwrap();
    // A hole between the common config and the ISR page reads as zero and is a violation.
    assert_eq!(qt.readl(bar4 + 0x100).unwrap(), 0);
    assert_faulted_then_recovers(&mut guest, &server);
    assert_eq!(server.counter("invalid_accesses"), 1);

    // A register accessed with the wrong width (16-bit write of the 8-bit device_status).
    let qt = guest.vm.qtest();
    guest
        .dev
        .write_common_u16(qt, common_cfg::DEVICE_STATUS, 0x0f)
        .unwrap();
    wait_needs_reset(&mut guest);
    guest.bring_up();
    guest.display_info(None);
}

#[test]
fn notify_on_disabled_queue_is_ignored() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let qt = guest.vm.qtest();
    // Bring the device up with the control queue only.
    guest.dev.negotiate(qt, 1 << VIRTIO_F_VERSION_1).unwrap();
    guest
        .dev
        .setup_queue(qt, &mut guest.ram, CONTROL_QUEUE, 8, Some(CONTROL_VECTOR))
        .unwrap();
    guest.dev.driver_ok(qt).unwrap();
    let cursor_notify = guest.dev.queue(CONTROL_QUEUE).unwrap().notify_address() + 4;
    let before = server.counter("notifies_ignored");
    qt.writew(cursor_notify, CURSOR_QUEUE).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    while server.counter("notifies_ignored") == before {
        assert!(Instant::now() < deadline, "notify was not seen");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        guest.dev.status(qt).unwrap() & NEEDS_RESET,
        0,
        "not a violation"
    );
    guest.display_info(None);
}

#[test]
fn descriptor_outside_guest_ram_needs_reset() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let outside = guest.vm.ram_bytes() + 0x10_0000;
    let top = CONTROL_QUEUE_SIZE - 1;
    submit_raw(
        &mut guest,
        &[(top, raw(outside, CTRL_HDR_SIZE as u32, 0, 0))],
    );
    assert_faulted_then_recovers(&mut guest, &server);
}

#[test]
fn response_buffer_outside_guest_ram_needs_reset() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let request = guest.ram.alloc(CTRL_HDR_SIZE as u64, 8).unwrap();
    guest
        .vm
        .qtest()
        .memwrite(request, &virtio_gpu::get_display_info())
        .unwrap();
    let top = CONTROL_QUEUE_SIZE - 1;
    let outside = u64::MAX - 0x100;
    submit_raw(
        &mut guest,
        &[
            (
                top,
                raw(request, CTRL_HDR_SIZE as u32, VRING_DESC_F_NEXT, top - 1),
            ),
            (
                top - 1,
                raw(outside, DISPLAY_INFO_SIZE as u32, VRING_DESC_F_WRITE, 0),
            ),
        ],
    );
    assert_faulted_then_recovers(&mut guest, &server);
}

#[test]
fn descriptor_loop_needs_reset() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let buf = guest.ram.alloc(64, 8).unwrap();
    let (a, b) = (CONTROL_QUEUE_SIZE - 1, CONTROL_QUEUE_SIZE - 2);
    submit_raw(
        &mut guest,
        &[
            (a, raw(buf, 8, VRING_DESC_F_NEXT, b)),
            (b, raw(buf, 8, VRING_DESC_F_NEXT, a)),
        ],
    );
    assert_faulted_then_recovers(&mut guest, &server);
}

#[test]
fn oversized_chain_needs_reset() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    // Two 640 KiB readable buffers: 1.25 MiB, above the 1 MiB request limit.
    let len = 640 * 1024;
    let buf = guest.ram.alloc(2 * u64::from(len), 4096).unwrap();
    let (a, b) = (CONTROL_QUEUE_SIZE - 1, CONTROL_QUEUE_SIZE - 2);
    submit_raw(
        &mut guest,
        &[
            (a, raw(buf, len, VRING_DESC_F_NEXT, b)),
            (b, raw(buf + u64::from(len), len, 0, 0)),
        ],
    );
    assert_faulted_then_recovers(&mut guest, &server);
}

#[test]
fn indirect_descriptor_needs_reset() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    // An indirect table holding a valid GET_DISPLAY_INFO chain: followed, it would complete.
    // The device does not offer VIRTIO_F_INDIRECT_DESC, so the flag is a driver error.
    let request = guest.ram.alloc(CTRL_HDR_SIZE as u64, 8).unwrap();
    let response = guest.ram.alloc(DISPLAY_INFO_SIZE as u64, 8).unwrap();
    let table = guest.ram.alloc(32, 16).unwrap();
    let qt = guest.vm.qtest();
    qt.memwrite(
        request,
        &CtrlHeader::new(virtio_gpu::CMD_GET_DISPLAY_INFO).to_bytes(),
    )
    .unwrap();
    let mut entries = Vec::new();
    for (addr, len, flags, next) in [
        (
            request,
            CTRL_HDR_SIZE as u32,
            VRING_DESC_F_NEXT as u16,
            1u16,
        ),
        (
            response,
            DISPLAY_INFO_SIZE as u32,
            VRING_DESC_F_WRITE as u16,
            0,
        ),
    ] {
        entries.extend_from_slice(&addr.to_le_bytes());
        entries.extend_from_slice(&len.to_le_bytes());
        entries.extend_from_slice(&flags.to_le_bytes());
        entries.extend_from_slice(&next.to_le_bytes());
    }
    qt.memwrite(table, &entries).unwrap();
    let top = CONTROL_QUEUE_SIZE - 1;
    let before = server.counter("ctrl_requests");
    submit_raw(
        &mut guest,
        &[(top, raw(table, 32, VRING_DESC_F_INDIRECT, 0))],
    );
    assert_faulted_then_recovers(&mut guest, &server);
    assert_eq!(
        server.counter("ctrl_requests"),
        before + 1,
        "only the recovery's request ran"
    );
}

#[test]
fn a_ring_of_large_requests_is_processed_over_several_turns() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    // Every descriptor of the ring names the same 1 MiB request, a SUBMIT_3D whose stream
    // fills it (copied whole; a 2D device answers ERR_UNSPEC): the device copies one at a
    // time, at most 4 MiB per turn, instead of the whole ring at once.
    let len = 1 << 20;
    let request = guest.ram.alloc(len, 4096).unwrap();
    let qt = guest.vm.qtest();
    let mut submit = CtrlHeader::new(virtio_gpu::CMD_SUBMIT_3D)
        .to_bytes()
        .to_vec();
    submit.extend_from_slice(&(len as u32 - 32).to_le_bytes());
    qt.memwrite(request, &submit).unwrap();
    for index in 0..CONTROL_QUEUE_SIZE {
        guest
            .dev
            .write_descriptor(qt, CONTROL_QUEUE, index, &raw(request, len as u32, 0, 0))
            .unwrap();
    }
    // The counts before anything is published: a kick still pending from the bring-up (the
    // reset's) may have the device look at the ring before the notify below, on a busy host.
    let (used, requests, deferred) = (
        guest.dev.read_used_idx(qt, CONTROL_QUEUE).unwrap(),
        server.counter("ctrl_requests"),
        server.counter("kicks_deferred"),
    );
    // The whole ring in one step (its entries, then one write of avail.idx), so whenever the
    // device looks, it finds none or all of them: the turns are the ring's, not the moment's.
    let vq = guest.dev.queue(CONTROL_QUEUE).unwrap();
    let (ring, first) = (vq.avail_address() + 4, vq.avail_idx());
    let entries: Vec<u8> = (0..CONTROL_QUEUE_SIZE)
        .flat_map(|index| index.to_le_bytes())
        .collect();
    assert_eq!(
        first % CONTROL_QUEUE_SIZE,
        0,
        "the ring starts at its first slot"
    );
    qt.memwrite(ring, &entries).unwrap();
    guest
        .dev
        .write_avail_idx(qt, CONTROL_QUEUE, first.wrapping_add(CONTROL_QUEUE_SIZE))
        .unwrap();
    guest.dev.notify(qt, CONTROL_QUEUE).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let all = used.wrapping_add(CONTROL_QUEUE_SIZE);
    while guest.dev.read_used_idx(qt, CONTROL_QUEUE).unwrap() != all {
        assert!(Instant::now() < deadline, "the ring was not completed");
        std::thread::sleep(Duration::from_millis(2));
    }
    let turns = server.counter("kicks_deferred") - deferred + 1;
    assert_eq!(turns, u64::from(CONTROL_QUEUE_SIZE / 4), "4 MiB per turn");
    assert_eq!(
        server.counter("ctrl_requests") - requests,
        u64::from(CONTROL_QUEUE_SIZE)
    );
    assert_eq!(server.counter("transport_faults"), 0);
}

#[test]
fn head_index_past_the_table_needs_reset() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let qt = guest.vm.qtest();
    guest.dev.publish_avail(qt, CONTROL_QUEUE, 4000).unwrap();
    guest.dev.notify(qt, CONTROL_QUEUE).unwrap();
    assert_faulted_then_recovers(&mut guest, &server);
}

#[test]
fn unknown_and_short_commands_get_error_responses() {
    let Some((server, mut guest)) = vgpu_at_driver_ok() else {
        return;
    };
    let qt = guest.vm.qtest();
    for request in [
        CtrlHeader::fenced(0x0fff, 7).to_bytes().to_vec(),
        vec![0u8; 8],
    ] {
        let done = guest
            .dev
            .transact(
                qt,
                CONTROL_QUEUE,
                &[&request],
                &[CTRL_HDR_SIZE as u32],
                TIMEOUT,
            )
            .unwrap();
        assert_eq!(done.used.len, CTRL_HDR_SIZE as u32);
        let header = CtrlHeader::parse(&done.writable.unwrap()[0]).unwrap();
        assert_eq!(header.ctrl_type, RESP_ERR_UNSPEC, "{header:?}");
        if request.len() == CTRL_HDR_SIZE {
            assert_eq!((header.is_fenced(), header.fence_id), (true, 7));
        }
    }
    // A known command this device does not implement yet.
    let create = virtio_gpu::ctx_create(1, 0, b"vgpu-test");
    let done = guest
        .dev
        .transact(
            qt,
            CONTROL_QUEUE,
            &[&create[..]],
            &[CTRL_HDR_SIZE as u32],
            TIMEOUT,
        )
        .unwrap();
    assert_eq!(
        CtrlHeader::parse(&done.writable.unwrap()[0])
            .unwrap()
            .ctrl_type,
        RESP_ERR_UNSPEC
    );
    assert_eq!(
        guest.dev.status(qt).unwrap() & NEEDS_RESET,
        0,
        "command errors are not violations"
    );
    assert_eq!(server.counter("ctrl_errors"), 3);
    guest.display_info(None);
}
