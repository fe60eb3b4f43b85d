//! `vgpu-load`: the guest's GPU load generator. It runs inside the Debian test guest (installed as
//! `/usr/local/bin/vgpu-load` by `qemu-scripts/build-guest-image.sh`, statically linked) and
//! drives the vgpu device's private load capset (capset 20) through the stock `virtio_gpu`
//! kernel driver's DRM ioctls: each OCCUPY is one command group of a chosen cost, each
//! END_FRAME a frame whose fence is released at the paced present. It measures every group's
//! latency from submit to fence and prints JSON lines or a text summary. See `--help`.

mod args;
mod run;
mod stats;
mod wire;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use args::Config;
use run::LoadContext;

/// Raised when the workload is to end early (`--until-stopped`: stdin reached its end).
static STOPPED: AtomicBool = AtomicBool::new(false);

/// Exit code for usage and device errors.
const EXIT_ERROR: u8 = 2;

fn main() -> ExitCode {
    // Usage errors exit with 2 (EXIT_ERROR), as clap does.
    let config: Config = vgpu_cli::parse();
    if config.until_stopped {
        // Stdin's end is the stop: everything read before it is ignored.
        std::thread::spawn(|| {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            STOPPED.store(true, Ordering::Relaxed);
        });
    }
    let result = LoadContext::open(&config.device).and_then(|ctx| {
        let limits = ctx.limits();
        let until = if config.until_stopped {
            "until stopped (stdin's end)".to_owned()
        } else {
            format!("for {} s", config.duration.as_secs())
        };
        eprintln!(
            "vgpu-load: {} {until} on {} (load capset: {} commands per submit, occupy up to {} us)",
            config.mode.name(),
            config.device.display(),
            limits.max_commands,
            limits.max_occupy_us,
        );
        run::run(&ctx, &config, std::io::stdout().lock(), &STOPPED)
    });
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vgpu-load: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}
