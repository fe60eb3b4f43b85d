//! Test harness for the vgpu project: runs QEMU under qtest and drives it with the guest-side
//! drivers of `vgpu-guest-drivers` (re-exported as [`drivers`]).
//!
//! QEMU is the wrapper `qemu-scripts/qemu-system-x86_64` of this repository unless the
//! environment variable `VGPU_QEMU` names another binary. Tests call [`skip_without_qemu`]
//! first: without a working QEMU they are skipped with an explanation, or fail when
//! `VGPU_REQUIRE_QEMU` is set (for CI).

pub mod browser;
pub mod compute;
pub mod control;
pub mod daemon;
pub mod experiment;
pub mod gl_device;
pub mod guest;
pub mod live_switch;
pub mod load_vm;
pub mod piglit;
pub mod raw_guest;
pub mod server;
pub mod temp_dir;
pub mod vfio_user_raw;
pub mod vm;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

pub use temp_dir::TempDir;
pub use vgpu_guest_drivers as drivers;
pub use vm::{HarnessError, QtestVm, VmConfig, vfio_user_pci_device};

/// Environment variable overriding the QEMU binary.
pub const QEMU_ENV: &str = "VGPU_QEMU";
/// Environment variable turning a missing QEMU from a skip into a failure.
pub const REQUIRE_QEMU_ENV: &str = "VGPU_REQUIRE_QEMU";

/// The QEMU binary tests run.
pub fn qemu_path() -> PathBuf {
    std::env::var_os(QEMU_ENV).map_or_else(
        || {
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../qemu-scripts/qemu-system-x86_64"
            )
            .into()
        },
        PathBuf::from,
    )
}

/// QEMU's version line, or why QEMU cannot run here. Checked once per process.
pub fn qemu_version() -> Result<&'static str, &'static str> {
    static CHECK: OnceLock<Result<String, String>> = OnceLock::new();
    CHECK
        .get_or_init(|| {
            let path = qemu_path();
            let why = match Command::new(&path).arg("--version").output() {
                Ok(out) if out.status.success() => {
                    let stdout = String::from_utf8_lossy(&out.stdout);
                    return Ok(stdout.lines().next().unwrap_or_default().to_owned());
                }
                Ok(out) => format!(
                    "{} ({})",
                    String::from_utf8_lossy(&out.stderr).trim(),
                    out.status
                ),
                Err(e) => e.to_string(),
            };
            Err(format!(
                "QEMU at {} does not run: {why}. Run qemu-scripts/setup-qemu.sh (or set {QEMU_ENV})",
                path.display()
            ))
        })
        .as_deref()
        .map_err(String::as_str)
}

/// Returns `true` (after printing why) when QEMU is unavailable and the calling test should
/// return early; panics instead when `VGPU_REQUIRE_QEMU` is set.
pub fn skip_without_qemu() -> bool {
    match qemu_version() {
        Ok(_) => false,
        Err(why) if std::env::var_os(REQUIRE_QEMU_ENV).is_some() => panic!("{why}"),
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            true
        }
    }
}

/// The host CPU model (for benchmark reports).
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}
