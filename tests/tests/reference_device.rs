//! Validates the guest drivers against QEMU's own `virtio-gpu-pci` (the same 1af4:1050 function
//! our vfio-user server presents), so that failures against the server can be blamed on the
//! server rather than on the drivers.

use std::time::Duration;

use vgpu_guest_drivers::guest_ram::GuestRam;
use vgpu_guest_drivers::pci::{self, CAP_ID_MSIX, CAP_ID_VENDOR, PciAllocator};
use vgpu_guest_drivers::virtio_gpu::{
    self, CONFIG_NUM_SCANOUTS, CONTROL_QUEUE, CTRL_HDR_SIZE, CURSOR_QUEUE, CtrlHeader,
    DISPLAY_INFO_SIZE, DisplayInfo, RESP_ERR_UNSPEC,
};
use vgpu_guest_drivers::virtio_pci::{
    CAP_COMMON_CFG, CAP_DEVICE_CFG, CAP_ISR_CFG, CAP_NOTIFY_CFG, CAP_PCI_CFG, VIRTIO_PCI_VENDOR_ID,
    VirtioPciDevice, common_cfg,
};
use vgpu_tests::{QtestVm, VmConfig, skip_without_qemu};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;

const VIRTIO_GPU_DEVICE_ID: u16 = 0x1050;
/// Longest wait for a request's completion, on a host whose cores are all busy with other
/// work too (`qemu-scripts/test.sh --loaded`).
const TIMEOUT: Duration = Duration::from_secs(20);
/// MSI-X vectors: configuration changes, control queue, cursor queue.
const CONFIG_VECTOR: u16 = 0;
const CONTROL_VECTOR: u16 = 1;
const CURSOR_VECTOR: u16 = 2;
/// Size of `struct virtio_gpu_update_cursor`.
const UPDATE_CURSOR_SIZE: usize = 56;

/// QEMU with a reference virtio-gpu, initialised up to DRIVER_OK.
struct ReferenceGpu {
    vm: QtestVm,
    dev: VirtioPciDevice,
    ram: GuestRam,
}

fn launch() -> QtestVm {
    QtestVm::launch(&VmConfig::default().device("virtio-gpu-pci")).expect("QEMU starts")
}

impl ReferenceGpu {
    fn start() -> Self {
        let mut vm = launch();
        let mut ram = vm.guest_ram();
        let qt = vm.qtest();
        let pci = pci::find_device(qt, VIRTIO_PCI_VENDOR_ID, VIRTIO_GPU_DEVICE_ID).unwrap();
        let mut dev = VirtioPciDevice::probe(qt, pci, &mut PciAllocator::new()).unwrap();
        let features = dev.negotiate(qt, 1 << VIRTIO_F_VERSION_1).unwrap();
        assert_eq!(features, 1 << VIRTIO_F_VERSION_1);
        dev.enable_msix(qt, &mut ram, 3).unwrap();
        dev.set_config_vector(qt, Some(CONFIG_VECTOR)).unwrap();
        dev.setup_queue(qt, &mut ram, CONTROL_QUEUE, 64, Some(CONTROL_VECTOR))
            .unwrap();
        dev.setup_queue(qt, &mut ram, CURSOR_QUEUE, 16, Some(CURSOR_VECTOR))
            .unwrap();
        dev.driver_ok(qt).unwrap();
        Self { vm, dev, ram }
    }
}

#[test]
fn enumerates_like_firmware() {
    if skip_without_qemu() {
        return;
    }
    let mut vm = launch();
    let qt = vm.qtest();

    let functions = pci::scan_bus0(qt).unwrap();
    let gpu = functions
        .iter()
        .find(|f| f.vendor_id == VIRTIO_PCI_VENDOR_ID && f.device_id == VIRTIO_GPU_DEVICE_ID)
        .unwrap_or_else(|| panic!("no virtio-gpu among {functions:x?}"));
    // q35's host bridge and ICH9 functions are always there as well.
    assert!(functions.len() > 1, "{functions:x?}");
    let pci = pci::PciDevice::new(gpu.address);
    assert_eq!(pci.class_code(qt).unwrap().0, 0x03, "display controller");

    let caps = pci.capabilities(qt).unwrap();
    assert!(caps.iter().any(|c| c.id == CAP_ID_MSIX), "{caps:x?}");
    assert!(caps.iter().filter(|c| c.id == CAP_ID_VENDOR).count() >= 5);
    let msix = pci.msix_capability(qt).unwrap().expect("MSI-X");
    assert!(msix.table_size >= 3, "{msix:?}");

    let dev = VirtioPciDevice::probe(qt, pci, &mut PciAllocator::new()).unwrap();
    for cfg_type in [
        CAP_COMMON_CFG,
        CAP_NOTIFY_CFG,
        CAP_ISR_CFG,
        CAP_DEVICE_CFG,
        CAP_PCI_CFG,
    ] {
        assert!(
            dev.capabilities().iter().any(|c| c.cfg_type == cfg_type),
            "cfg_type {cfg_type} missing from {:x?}",
            dev.capabilities()
        );
    }
    for bar in dev.bars().iter() {
        assert!(
            bar.size.is_power_of_two() && bar.address % bar.size == 0,
            "{bar:x?}"
        );
        assert!(bar.address >= pci::MMIO_WINDOW_START, "{bar:x?}");
    }

    // The BAR mapping and the PCI configuration access window see the same registers.
    let num_queues = dev.num_queues(qt).unwrap();
    assert_eq!(num_queues, 2, "controlq and cursorq");
    let common = dev
        .capabilities()
        .iter()
        .find(|c| c.cfg_type == CAP_COMMON_CFG)
        .unwrap();
    let via_window = dev
        .pci_cfg_read(
            qt,
            common.bar,
            common.offset + u32::from(common_cfg::NUM_QUEUES),
            2,
        )
        .unwrap();
    assert_eq!(via_window, u32::from(num_queues));
}

#[test]
fn display_info_over_controlq_raises_msix() {
    if skip_without_qemu() {
        return;
    }
    let ReferenceGpu {
        mut vm, mut dev, ..
    } = ReferenceGpu::start();
    let qt = vm.qtest();
    assert!(dev.read_device_config_u32(qt, CONFIG_NUM_SCANOUTS).unwrap() >= 1);

    dev.clear_mailbox(qt, CONTROL_VECTOR).unwrap();
    let request = virtio_gpu::get_display_info();
    let done = dev
        .transact(
            qt,
            CONTROL_QUEUE,
            &[&request],
            &[DISPLAY_INFO_SIZE as u32],
            TIMEOUT,
        )
        .unwrap();
    assert_eq!(done.used.len, DISPLAY_INFO_SIZE as u32);
    let response = &done.writable.expect("our chain")[0];
    let info = DisplayInfo::parse(response).unwrap();
    let scanout = info.pmodes[0];
    assert_ne!(scanout.enabled, 0, "{info:?}");
    assert!(
        scanout.rect.width > 0 && scanout.rect.height > 0,
        "{info:?}"
    );
    dev.wait_msix(qt, CONTROL_VECTOR, TIMEOUT).unwrap();

    // Each queue signals its own vector.
    dev.clear_mailbox(qt, CURSOR_VECTOR).unwrap();
    let mut cursor = CtrlHeader::new(virtio_gpu::CMD_MOVE_CURSOR)
        .to_bytes()
        .to_vec();
    cursor.resize(UPDATE_CURSOR_SIZE, 0);
    let done = dev
        .transact(qt, CURSOR_QUEUE, &[&cursor], &[], TIMEOUT)
        .unwrap();
    assert_eq!(done.used.len, 0);
    dev.wait_msix(qt, CURSOR_VECTOR, TIMEOUT).unwrap();
    assert!(!dev.mailbox_signalled(qt, CONTROL_VECTOR).unwrap());
}

#[test]
fn unknown_command_gets_err_unspec() {
    if skip_without_qemu() {
        return;
    }
    let ReferenceGpu {
        mut vm, mut dev, ..
    } = ReferenceGpu::start();
    let qt = vm.qtest();
    let request = CtrlHeader::fenced(0x0fff, 7).to_bytes();
    let done = dev
        .transact(
            qt,
            CONTROL_QUEUE,
            &[&request],
            &[CTRL_HDR_SIZE as u32],
            TIMEOUT,
        )
        .unwrap();
    let header = CtrlHeader::parse(&done.writable.unwrap()[0]).unwrap();
    assert_eq!(header.ctrl_type, RESP_ERR_UNSPEC);
    // A fenced request is answered with the fence echoed.
    assert!(header.is_fenced(), "{header:?}");
    assert_eq!(header.fence_id, 7);
}

#[test]
fn masked_vector_sets_pending_bit_until_unmasked() {
    if skip_without_qemu() {
        return;
    }
    let ReferenceGpu {
        mut vm, mut dev, ..
    } = ReferenceGpu::start();
    let qt = vm.qtest();
    dev.set_msix_vector_masked(qt, CONTROL_VECTOR, true)
        .unwrap();
    dev.clear_mailbox(qt, CONTROL_VECTOR).unwrap();
    let request = virtio_gpu::get_display_info();
    dev.transact(
        qt,
        CONTROL_QUEUE,
        &[&request],
        &[DISPLAY_INFO_SIZE as u32],
        TIMEOUT,
    )
    .unwrap();
    assert!(dev.msix_pending(qt, CONTROL_VECTOR).unwrap());
    assert!(!dev.mailbox_signalled(qt, CONTROL_VECTOR).unwrap());

    dev.set_msix_vector_masked(qt, CONTROL_VECTOR, false)
        .unwrap();
    dev.wait_msix(qt, CONTROL_VECTOR, TIMEOUT).unwrap();
    assert!(!dev.msix_pending(qt, CONTROL_VECTOR).unwrap());
}

#[test]
fn raw_descriptor_chain() {
    if skip_without_qemu() {
        return;
    }
    let ReferenceGpu {
        mut vm,
        mut dev,
        mut ram,
    } = ReferenceGpu::start();
    let qt = vm.qtest();
    let request = ram.alloc(CTRL_HDR_SIZE as u64, 8).unwrap();
    let response = ram.alloc(DISPLAY_INFO_SIZE as u64, 8).unwrap();
    qt.memwrite(request, &virtio_gpu::get_display_info())
        .unwrap();
    let buffers = [
        (request, CTRL_HDR_SIZE as u32, false),
        (response, DISPLAY_INFO_SIZE as u32, true),
    ];
    let head = dev.write_raw_chain(qt, CONTROL_QUEUE, &buffers).unwrap();
    dev.publish_avail(qt, CONTROL_QUEUE, head).unwrap();
    dev.notify(qt, CONTROL_QUEUE).unwrap();

    let done = dev.wait_used(qt, CONTROL_QUEUE, TIMEOUT).unwrap();
    assert_eq!(u32::from(head), done.used.id);
    assert_eq!(done.used.len, DISPLAY_INFO_SIZE as u32);
    assert_eq!(done.writable, None, "not a high-level chain");
    assert_eq!(dev.read_used_idx(qt, CONTROL_QUEUE).unwrap(), 1);
    assert_eq!(dev.read_used_elem(qt, CONTROL_QUEUE, 0).unwrap(), done.used);
    let bytes = qt.memread(response, DISPLAY_INFO_SIZE).unwrap();
    DisplayInfo::parse(&bytes).unwrap();
}
