//! The cuda-samples runner (`qemu-scripts/cuda-samples.sh`) checked without NVIDIA's
//! checkout: its `--self-check` builds a made-up samples tree (our tests/cuda/vector_add.cu
//! and small programs the script writes: one that waives, one that prints a failure, one that
//! prints a CUDA error name, one that crashes, one that outlives its timeout, one that does not
//! compile, and three that the selection rules must exclude), runs it through our libcuda.so.1
//! against a vgpu-cuda-host the script starts, and checks every classification and reason.

use std::path::Path;
use std::process::Command;

use mdev_backend::compute::corpus::corpus_for_tests;
use vgpu_tests::daemon::workspace_binary;

#[test]
fn the_samples_runner_classifies_a_made_up_tree() {
    // The corpus's toolchain (nvcc and the header-only wheels) builds the made-up samples.
    if corpus_for_tests("vector_add").is_none() {
        return;
    }
    let lib = workspace_binary("libcuda.so").expect("libcuda.so of guest-drivers/libcuda");
    let host = workspace_binary("vgpu-cuda-host").expect("vgpu-cuda-host");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../qemu-scripts/cuda-samples.sh");
    let out = Command::new(script)
        .arg("--self-check")
        .arg("--lib")
        .arg(lib)
        .arg("--host")
        .arg(host)
        .env_remove("VGPU_CUDA_TRACE")
        .output()
        .expect("run cuda-samples.sh --self-check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && stdout
                .lines()
                .last()
                .is_some_and(|l| l.starts_with("self-check: PASS")),
        "cuda-samples.sh --self-check failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
