//! mdev-backend: executes vGPU work on the physical GPU and reports its completion fences
//! (hops 7 and 8 of the data path, see docs/ARCHITECTURE.md).
//!
//! The device drives a [`GpuBackend`]; [`virgl`] (virglrenderer on the host's EGL) is the first
//! implementation. [`compute`] executes CUDA work: a PTX executor on the CPU and the NVIDIA
//! driver behind one trait.

pub mod backend;
pub mod budget;
pub mod compute;
pub mod virgl;

/// The code generator's crates, logged at warn at most by [`logger`]: at info Cranelift
/// writes each compiled function's whole IR, thousands of lines a kernel, formatted on the
/// compiling thread, so a guest's modules could fill the host's log.
const COMPILER_LOG_MODULES: [&str; 4] = [
    "cranelift_codegen",
    "cranelift_frontend",
    "cranelift_jit",
    "cranelift_module",
];

/// The logger of a process that runs guests' work (vgpu-server, vgpu-cuda-host): `level`,
/// the code generator's crates at warn at most, then `RUST_LOG` (which can still name them),
/// microsecond timestamps.
pub fn logger(level: log::LevelFilter) -> env_logger::Builder {
    let mut b = env_logger::Builder::new();
    b.filter_level(level);
    for m in COMPILER_LOG_MODULES {
        b.filter_module(m, level.min(log::LevelFilter::Warn));
    }
    b.parse_default_env().format_timestamp_micros();
    b
}

pub use backend::{BackendError, BackendResult, GpuBackend};

#[cfg(test)]
mod tests {
    use log::{Level, Log, Metadata};

    fn enabled(logger: &env_logger::Logger, target: &str, level: Level) -> bool {
        logger.enabled(&Metadata::builder().target(target).level(level).build())
    }

    #[test]
    fn the_logger_keeps_the_code_generator_at_warn() {
        if std::env::var_os("RUST_LOG").is_some() {
            eprintln!("skipped: RUST_LOG is set and would name the filters");
            return;
        }
        let logger = super::logger(log::LevelFilter::Debug).build();
        assert!(enabled(&logger, "mdev_backend::compute", Level::Debug));
        assert!(!enabled(&logger, "cranelift_jit::backend", Level::Info));
        assert!(enabled(&logger, "cranelift_jit::backend", Level::Warn));
        let quiet = super::logger(log::LevelFilter::Error).build();
        assert!(!enabled(&quiet, "cranelift_codegen", Level::Warn));
    }
}
