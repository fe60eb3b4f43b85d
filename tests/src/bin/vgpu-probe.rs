//! `vgpu-probe --socket PATH`: what a guest sees of a running `vgpu-server`. Starts QEMU under
//! qtest against the server, enumerates PCI bus 0, brings the vGPU up with the qtest
//! virtio-pci driver, issues GET_DISPLAY_INFO through the control queue and reports the
//! scanouts and the MSI-X interrupt. Exits non-zero if any step fails.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use vgpu_guest_drivers::pci;
use vgpu_tests::server::{CONTROL_VECTOR, VIRTIO_GPU_DEVICE_ID, VgpuGuest};

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "vgpu-probe",
    version,
    about = "Shows what a guest sees of a running vgpu-server: PCI bus 0, the negotiated \
        features, GET_DISPLAY_INFO's scanouts and the MSI-X interrupt (QEMU under qtest)"
)]
struct Cli {
    /// The server's vfio-user socket
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
}

fn main() -> ExitCode {
    let Cli { socket } = vgpu_cli::parse();
    if let Err(why) = vgpu_tests::qemu_version() {
        eprintln!("vgpu-probe: {why}");
        return ExitCode::FAILURE;
    }
    let mut guest = VgpuGuest::attach(&socket, true);
    let qt = guest.vm.qtest();
    println!("PCI bus 0 as the guest sees it:");
    for f in pci::scan_bus0(qt).expect("bus scan") {
        let class = pci::PciDevice::new(f.address)
            .class_code(qt)
            .expect("class");
        let ours = if f.device_id == VIRTIO_GPU_DEVICE_ID {
            "  <- vgpu (virtio-gpu over vfio-user)"
        } else {
            ""
        };
        println!(
            "  {} vendor {:#06x} device {:#06x} class {:02x}{:02x}{ours}",
            f.address, f.vendor_id, f.device_id, class.0, class.1
        );
    }
    let features = guest.dev.driver_features(qt).expect("features");
    let status = guest.dev.status(qt).expect("status");
    println!("negotiated features {features:#x}, device status {status:#x}");
    guest
        .dev
        .clear_mailbox(qt, CONTROL_VECTOR)
        .expect("mailbox");
    let info = guest.display_info(None);
    let qt = guest.vm.qtest();
    let msix = guest
        .dev
        .wait_msix(qt, CONTROL_VECTOR, Duration::from_secs(5))
        .is_ok();
    println!(
        "GET_DISPLAY_INFO -> response type {:#x}",
        info.header.ctrl_type
    );
    let mut enabled = 0;
    for (i, p) in info
        .pmodes
        .iter()
        .enumerate()
        .filter(|(_, p)| p.enabled != 0)
    {
        println!("  scanout {i}: {}x{} enabled", p.rect.width, p.rect.height);
        enabled += 1;
    }
    println!(
        "MSI-X interrupt on the control queue vector: {}",
        if msix { "received" } else { "MISSING" }
    );
    if enabled == 0 || !msix {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_cli::check;

    #[test]
    fn keeps_the_command_line_conventions() {
        check::conventions::<Cli>(env!("CARGO_PKG_VERSION")).unwrap();
        for line in [&["--socket", "/s"][..], &["--socket=/s"]] {
            let cli: Cli = check::arguments(line).unwrap();
            assert_eq!(cli.socket, PathBuf::from("/s"));
        }
        assert!(check::arguments::<Cli, _, _>([""; 0]).is_err());
        assert!(check::arguments::<Cli, _, _>(["/s"]).is_err());
    }
}
