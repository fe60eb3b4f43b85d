//! CUDA in a real guest: the Debian trixie image boots (TCG here) with our vGPU, and stock CUDA
//! clients run on our `libcuda.so.1` (guest-drivers/libcuda) through the virtio-gpu DRM
//! transport: render node, compute capset 21, a guest blob, SUBMIT_3D; the device runs their
//! work on the PTX executor. The GCC OpenMP-offloading programs of the CUDA corpus, linked
//! against Debian's libgomp and its nvptx plugin (from the machine that built them), must print
//! their own PASS; `OMP_TARGET_OFFLOAD=MANDATORY` makes a failed offload an error instead of a
//! silent fall-back to the host. The image's own copies must pass too under Debian trixie's
//! libgomp and nvptx plugin (GCC 14). The nvcc-built programs (static cudart 13) must print
//! their PASS too, and the one needing mapped pinned host memory (`spin`) must end with its own
//! CUDA error, never hang (docs/CUDA-GUEST.md).
//!
//! The library, the programs and libgomp reach the guest on a second, read-only virtio disk
//! (an ext4 image made here with `mkfs.ext4 -d`), so the test always runs the current build
//! (fw_cfg's sysfs files read at about 70 KiB/s under TCG). Skipped with a message when the image or the corpus is missing,
//! unless `VGPU_REQUIRE_GUEST` / `VGPU_REQUIRE_CUDA_CORPUS` is set (test.sh).

use std::time::Duration;

use mdev_backend::compute::corpus::{NVCC_PROGRAMS, NVCC_REFUSED, SHARED_CUDART, corpus_for_tests};
use vgpu_tests::TempDir;
use vgpu_tests::daemon::workspace_binary;
use vgpu_tests::guest::{self, GuestConfig, RunningGuest, boot_lock, skip_without_guest};

/// Wall-clock limit of the boot and the programs (about a minute here under TCG).
const TIMEOUT: Duration = Duration::from_secs(300);
/// The OpenMP programs that must pass.
const OMP_PROGRAMS: [&str; 3] = ["omp_saxpy", "omp_reduction", "omp_features"];
/// The nvcc-built program also run from the image's own corpus with the image's library.
const IMAGE_NVCC_PROGRAM: &str = "vector_add";

/// The VM's GPU memory (vgpu-server --resource-memory-mb), which the guest's vgpu-smi shows.
const GUEST_MEMORY_MB: u64 = 512;
/// Where the guest image installs our library (its package) and the corpus
/// (build-guest-image.sh).
/// (ldconfig names it under /lib or /usr/lib: trixie's /lib is /usr/lib.)
const IMAGE_LIB: &str = "/lib/x86_64-linux-gnu/libcuda.so.1";
const IMAGE_CORPUS: &str = "/usr/local/share/vgpu-cuda";

fn job(programs: &[&str]) -> String {
    let mut job = format!(
        "set -u\nls /dev/dri | sed 's/^/DRI /'\n\
         ldconfig -p | grep -q '{IMAGE_LIB}$' && echo IMAGE-LIB ok\n\
         dpkg-query -W -f='IMAGE-PKG ${{Package}} ${{Status}}\\n' vgpu-guest-cuda\n\
         echo \"SMI $(vgpu-smi --json --interval 50 | tr -d '\\n')\"\n\
         ls {IMAGE_CORPUS} | sed 's/^/IMAGE-CORPUS /'\n"
    );
    let mut run = |name: &str, path: String| {
        job.push_str(&format!(
            "echo CUDA-BEGIN {name}\ntimeout 120 {path}\necho CUDA-END {name} rc=$?\n"
        ))
    };
    for p in programs {
        run(p, format!("{}/{p}", guest::CUDA_DIR));
    }
    // The image's own copies, with nothing handed in: the image's library under Debian
    // trixie's own libgomp and nvptx plugin (GCC 14, which requires unified addressing).
    for p in OMP_PROGRAMS.into_iter().chain([IMAGE_NVCC_PROGRAM]) {
        run(
            &format!("debian-{p}"),
            format!("env -u LD_LIBRARY_PATH {IMAGE_CORPUS}/{p}"),
        );
    }
    job
}

/// (exit code, output) of each program, from the job's output.
fn results(output: &str) -> Vec<(String, i32, String)> {
    let mut out = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in output.lines() {
        if let Some(name) = line.strip_prefix("CUDA-BEGIN ") {
            current = Some((name.to_owned(), String::new()));
        } else if let Some(rest) = line.strip_prefix("CUDA-END ") {
            let rc = rest
                .rsplit("rc=")
                .next()
                .and_then(|r| r.parse().ok())
                .unwrap_or(-1);
            if let Some((name, text)) = current.take() {
                out.push((name, rc, text));
            }
        } else if let Some((_, text)) = &mut current {
            text.push_str(line);
            text.push('\n');
        }
    }
    out
}

#[test]
fn stock_cuda_clients_run_through_the_vgpu_in_a_tcg_guest() {
    let Some(image) = skip_without_guest() else {
        return;
    };
    let Some(corpus) = corpus_for_tests("omp_saxpy") else {
        return;
    };
    let _lock = boot_lock();
    let lib = workspace_binary("libcuda.so").expect("libcuda.so of guest-drivers/libcuda");
    let mut programs: Vec<&str> = OMP_PROGRAMS.to_vec();
    programs.extend(NVCC_PROGRAMS.iter().map(|(p, _)| *p));
    programs.push(NVCC_REFUSED.0);
    let dir = TempDir::new("guest-cuda").expect("temp dir");
    let files: Vec<&str> = programs.iter().copied().chain([SHARED_CUDART]).collect();
    let (qemu, prologue) = guest::cuda_payload(dir.path(), &lib, &corpus, &files);
    let mut config = GuestConfig::new(image, prologue + &job(&programs)).timeout(TIMEOUT);
    config.extra_qemu_args = qemu;
    config.server_args = vec![
        "--log-level".into(),
        "info".into(),
        "--resource-memory-mb".into(),
        GUEST_MEMORY_MB.to_string(),
    ];
    let run = RunningGuest::run(&config).expect("guest run");
    guest::report("guest_cuda", "stock_cuda_clients", &run.timing());
    let logs = run.logs();
    assert_eq!(run.exit_code, Some(0), "{logs}");
    assert!(
        run.output.contains("DRI renderD128"),
        "no render node: does the server offer 3D?\n{logs}"
    );
    assert!(
        run.output.contains("IMAGE-LIB ok")
            && OMP_PROGRAMS
                .iter()
                .all(|p| run.output.contains(&format!("IMAGE-CORPUS {p}\n"))),
        "the image holds our libcuda.so.1 and the corpus\n{}",
        run.output
    );
    assert!(
        run.output
            .contains("IMAGE-PKG vgpu-guest-cuda install ok installed"),
        "the image installed the guest package with dpkg\n{}",
        run.output
    );
    // The guest's vgpu-smi sees the VM's GPU memory: the device's budget.
    let smi: serde_json::Value = run
        .output
        .lines()
        .find_map(|l| l.strip_prefix("SMI "))
        .and_then(|j| serde_json::from_str(j).ok())
        .unwrap_or_else(|| panic!("no vgpu-smi --json output\n{logs}"));
    guest::report("guest_cuda", "vgpu-smi", &smi.to_string());
    assert_eq!(
        smi["gpus"][0]["memory"]["total_bytes"].as_u64(),
        Some(GUEST_MEMORY_MB << 20),
        "{smi}"
    );
    let results = results(&run.output);
    let debian: Vec<String> = OMP_PROGRAMS
        .into_iter()
        .chain([IMAGE_NVCC_PROGRAM])
        .map(|p| format!("debian-{p}"))
        .collect();
    let result = |p: &str| {
        let (_, rc, text) = results
            .iter()
            .find(|(n, ..)| n == p)
            .unwrap_or_else(|| panic!("{p} did not run\n{logs}"));
        guest::report("guest_cuda", p, &format!("rc={rc}: {}", text.trim()));
        (*rc, text.clone())
    };
    for p in OMP_PROGRAMS
        .into_iter()
        .chain(NVCC_PROGRAMS.iter().map(|(p, _)| *p))
        .chain(debian.iter().map(String::as_str))
    {
        let (rc, text) = result(p);
        assert!(
            rc == 0 && text.lines().last().is_some_and(|l| l.starts_with("PASS")),
            "{p}: rc={rc}\n{text}\n{logs}"
        );
    }
    let (program, line) = NVCC_REFUSED;
    let (rc, text) = result(program);
    assert!(
        rc == 1 && text.lines().any(|l| l.starts_with(line)),
        "{program} ends with its own CUDA error, never a hang or a crash: rc={rc}\n{text}"
    );
    let server = run.server_log.clone().unwrap_or_default();
    assert!(
        server.contains("compute backend Cpu ready"),
        "the device ran the requests on its executor\n{server}"
    );
}
