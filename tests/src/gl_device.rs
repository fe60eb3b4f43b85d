//! The GL devices the side-by-side comparisons boot the same guest on: ours and the virgl
//! devices a QEMU user would pick instead, each given the same single display mode.

use std::path::Path;

use crate::guest::{
    GuestConfig, GuestGpu, gl_render_node, prefix_exec, qemu_gl_support, vhost_user_gpu_binary,
};

/// The one mode every device offers (the guest image's EDID, [`EDID`]).
pub const MODE: (u32, u32) = (1024, 768);
/// The EDID firmware file in the guest image (qemu-scripts/build-guest-image.sh).
pub const EDID: &str = "edid/vgpu-1024x768.bin";

/// A guest GL device (the command-line names are [`GlDevice::name`]'s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum GlDevice {
    /// Our `vgpu-server` over vfio-user on the host's virglrenderer and Mesa.
    Vgpu,
    /// The same server run with `qemu-scripts/prefix-exec`, so it loads the QEMU prefix's
    /// virglrenderer and Mesa, the stack QEMU's devices use: the device path is then the only
    /// difference.
    VgpuPrefix,
    /// QEMU's `virtio-gpu-gl-pci`, virgl in QEMU's process, on `egl-headless`.
    QemuVirtioGpuGl,
    /// QEMU's `vhost-user-gpu-pci` with the prefix's `vhost-user-gpu --virgl` backend.
    VhostUserGpu,
}

impl GlDevice {
    /// Every device, ours first.
    pub const ALL: [GlDevice; 4] = [
        GlDevice::Vgpu,
        GlDevice::VgpuPrefix,
        GlDevice::QemuVirtioGpuGl,
        GlDevice::VhostUserGpu,
    ];

    pub fn name(self) -> &'static str {
        match self {
            GlDevice::Vgpu => "vgpu",
            GlDevice::VgpuPrefix => "vgpu-prefix",
            GlDevice::QemuVirtioGpuGl => "qemu-virtio-gpu-gl",
            GlDevice::VhostUserGpu => "vhost-user-gpu",
        }
    }

    /// The host stack it renders with.
    pub fn stack(self) -> &'static str {
        match self {
            GlDevice::Vgpu => "host virglrenderer + Mesa",
            _ => "QEMU prefix virglrenderer + Mesa",
        }
    }

    /// Whether this host can run it at all (vhost-user-gpu needs the prefix's backend).
    pub fn available(self) -> Result<(), String> {
        match self {
            GlDevice::VhostUserGpu if vhost_user_gpu_binary().is_none() => {
                Err("no vhost-user-gpu in the QEMU prefix (run qemu-scripts/setup-qemu.sh)".into())
            }
            _ => Ok(()),
        }
    }

    /// Whether the device can present: without a DRM render node vhost-user-gpu's virgl
    /// cannot start and the guest renders with its own llvmpipe.
    pub fn presents(self) -> bool {
        self != GlDevice::VhostUserGpu || gl_render_node().starts_with("/dev/dri")
    }

    /// Sets `config` up for this device: the GPU, [`MODE`] and the EDID on the kernel command
    /// line; `server` is our `vgpu-server` binary (ours only).
    pub fn configure(
        self,
        config: &mut GuestConfig,
        server: Result<&Path, &str>,
    ) -> Result<(), String> {
        config.extra_cmdline = format!("drm.edid_firmware={EDID}");
        match self {
            GlDevice::Vgpu | GlDevice::VgpuPrefix => {
                config.gpu = GuestGpu::Vgpu;
                config.server_bin = Some(server.map_err(str::to_owned)?.to_path_buf());
                config.server_args = vec!["--display".into(), format!("{}x{}", MODE.0, MODE.1)];
                if self == GlDevice::VgpuPrefix {
                    config.server_launcher = Some(prefix_exec());
                }
            }
            GlDevice::QemuVirtioGpuGl | GlDevice::VhostUserGpu => {
                qemu_gl_support()
                    .map_err(|why| format!("QEMU has no egl-headless display: {why}"))?;
                if self == GlDevice::VhostUserGpu {
                    config.gpu = GuestGpu::VhostUserGpu;
                } else {
                    config.gpu = GuestGpu::QemuVirtioGpuGl;
                    // The display info's mode, like ours (the EDID decides the modes).
                    for (prop, v) in [("xres", MODE.0), ("yres", MODE.1)] {
                        config.extra_qemu_args.push("-global".into());
                        config
                            .extra_qemu_args
                            .push(format!("virtio-gpu-gl-device.{prop}={v}"));
                    }
                }
            }
        }
        Ok(())
    }
}
