//! Checks of the QEMU harness itself.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::Duration;

use vgpu_tests::{HarnessError, QtestVm, VmConfig, skip_without_qemu, vfio_user_pci_device};

#[test]
fn failed_device_realize_is_reported_with_qemu_output() {
    if skip_without_qemu() {
        return;
    }
    let device = vfio_user_pci_device(Path::new("/nonexistent/vgpu.sock"));
    match QtestVm::launch(&VmConfig::default().device(device)) {
        Err(HarnessError::QemuExited { status, log }) => {
            assert!(!status.success());
            assert!(log.contains("/nonexistent/vgpu.sock"), "{log}");
        }
        other => panic!("expected QemuExited, got {other:?}"),
    }
}

#[test]
fn kill_stops_qemu_and_drop_cleans_up() {
    if skip_without_qemu() {
        return;
    }
    let mut vm = QtestVm::launch(&VmConfig::default()).unwrap();
    let dir = vm.dir().to_owned();
    assert_eq!(vm.qtest().readl(0x10_0000).unwrap(), 0);
    assert!(matches!(
        vm.wait_exit(Duration::from_millis(50)),
        Err(HarnessError::ExitTimeout(_))
    ));
    let status = vm.kill().unwrap();
    assert_eq!(status.signal(), Some(9));
    assert!(vm.qtest().readl(0x10_0000).is_err());
    assert_eq!(vm.wait_exit(Duration::ZERO).unwrap(), status);
    drop(vm);
    assert!(!dir.exists());
}
