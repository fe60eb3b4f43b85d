//! End-to-end tests with a real guest: the Debian trixie image of
//! `qemu-scripts/build-guest-image.sh` boots (TCG here) with our vGPU, and its stock kernel's
//! `virtio_gpu` driver must bind to the device and see a connected 1024x768 display.
//!
//! Each boot takes about 15 s under TCG, so the boots run one at a time (two vCPUs each) and
//! every test prints its timings straight to stderr (visible without `--nocapture`). Skipped
//! with a message when the image is missing, unless `VGPU_REQUIRE_GUEST` is set (test.sh).

use std::path::Path;
use std::time::{Duration, Instant};

use vgpu_schedd::cgroup::CgroupFs;

use vgpu_tests::TempDir;
use vgpu_tests::guest::{
    self, GuestConfig, GuestGpu, GuestImage, GuestRun, JobTransport, RunningGuest, ServerProcess,
    boot_lock, server_binary, skip_without_guest,
};

/// Wall-clock limit of one boot (about 15 s here; CI machines may be slower).
const BOOT_TIMEOUT: Duration = Duration::from_secs(240);

/// Reports what the guest sees of its GPU, one fact per line, for [`GpuReport::parse`].
const GPU_REPORT_JOB: &str = r#"
lspci -nn | sed 's/^/LSPCI /'
for d in /sys/bus/pci/devices/*; do
    drv=none
    [ -e "$d/driver" ] && drv=$(basename "$(readlink "$d/driver")")
    echo "PCI $(basename "$d") $(cat "$d/vendor"):$(cat "$d/device") driver=$drv"
done
for d in /sys/bus/virtio/drivers/virtio_gpu/virtio*; do
    [ -e "$d" ] && echo "VIRTIO-GPU-BOUND $(basename "$d")"
done
for c in /sys/class/drm/card[0-9]*; do
    case $c in *-*) continue ;; esac
    echo "DRM-CARD $(basename "$c")"
done
for c in /sys/class/drm/card*-*; do
    [ -e "$c/status" ] && echo "CONNECTOR $(basename "$c") $(cat "$c/status") modes=$(tr '\n' ' ' <"$c/modes")"
done
dmesg | grep -E 'virtio.gpu|\[drm\]' | sed 's/^/DMESG /'
true
"#;

/// Prints past the test harness's capture, so that timings and results always show.
fn report(test: &str, what: &str) {
    guest::report("guest_e2e", test, what);
}

/// What [`GPU_REPORT_JOB`] printed.
#[derive(Debug, Default)]
struct GpuReport {
    lspci: Vec<String>,
    /// (address, "vendor:device", driver)
    pci: Vec<(String, String, String)>,
    virtio_gpu_bound: Vec<String>,
    cards: Vec<String>,
    /// (name, status, modes)
    connectors: Vec<(String, String, Vec<String>)>,
}

impl GpuReport {
    fn parse(output: &str) -> Self {
        let mut report = GpuReport::default();
        for line in output.lines() {
            let mut words = line.split_whitespace();
            match words.next() {
                Some("LSPCI") => report.lspci.push(line["LSPCI ".len()..].to_owned()),
                Some("PCI") => {
                    let address = words.next().unwrap_or_default().to_owned();
                    let ids = words.next().unwrap_or_default().to_owned();
                    let driver = words
                        .next()
                        .and_then(|w| w.strip_prefix("driver="))
                        .unwrap_or_default()
                        .to_owned();
                    report.pci.push((address, ids, driver));
                }
                Some("VIRTIO-GPU-BOUND") => report
                    .virtio_gpu_bound
                    .push(words.next().unwrap_or_default().to_owned()),
                Some("DRM-CARD") => report
                    .cards
                    .push(words.next().unwrap_or_default().to_owned()),
                Some("CONNECTOR") => {
                    let name = words.next().unwrap_or_default().to_owned();
                    let status = words.next().unwrap_or_default().to_owned();
                    let modes = words
                        .map(|w| w.strip_prefix("modes=").unwrap_or(w).to_owned())
                        .filter(|w| !w.is_empty())
                        .collect();
                    report.connectors.push((name, status, modes));
                }
                _ => {}
            }
        }
        report
    }

    /// Asserts that the stock driver bound a virtio-gpu PCI function (1af4:1050) and that a
    /// connected connector offers `mode`.
    fn assert_virtio_gpu_with_mode(&self, mode: &str, run: &GuestRun) {
        assert!(
            self.lspci.iter().any(|l| l.contains("[1af4:1050]")),
            "lspci -nn shows no 1af4:1050:\n{}",
            run.logs()
        );
        let gpu: Vec<_> = self
            .pci
            .iter()
            .filter(|(_, ids, _)| ids == "0x1af4:0x1050")
            .collect();
        assert_eq!(gpu.len(), 1, "one virtio-gpu function: {:?}", self.pci);
        assert_eq!(
            gpu[0].2,
            "virtio-pci",
            "driver of {}: {:?}\n{}",
            gpu[0].0,
            gpu[0].2,
            run.logs()
        );
        assert!(
            !self.virtio_gpu_bound.is_empty(),
            "virtio_gpu bound to no virtio device\n{}",
            run.logs()
        );
        assert!(!self.cards.is_empty(), "no DRM card\n{}", run.logs());
        let connected: Vec<_> = self
            .connectors
            .iter()
            .filter(|(_, status, _)| status == "connected")
            .collect();
        assert!(
            !connected.is_empty(),
            "no connected connector: {:?}\n{}",
            self.connectors,
            run.logs()
        );
        assert!(
            connected
                .iter()
                .any(|(_, _, modes)| modes.iter().any(|m| m == mode)),
            "no connected connector offers {mode}: {:?}",
            self.connectors
        );
    }
}

fn boot(test: &str, config: &GuestConfig) -> GuestRun {
    let run = RunningGuest::run(config).unwrap_or_else(|e| panic!("{test}: {e}"));
    report(test, &run.timing());
    assert!(
        run.qemu_status.success(),
        "QEMU failed ({})\n{}",
        run.qemu_status,
        run.logs()
    );
    run
}

fn config(image: GuestImage, job: &str) -> GuestConfig {
    vgpu_tests::server::init_logging();
    GuestConfig::new(image, job).timeout(BOOT_TIMEOUT)
}

/// (a) The stock guest kernel's virtio_gpu driver binds to our device and sees the 1024x768
/// scanout that GET_DISPLAY_INFO reports.
#[test]
fn stock_virtio_gpu_driver_binds_to_vgpu() {
    let Some(image) = skip_without_guest() else {
        return;
    };
    let _lock = boot_lock();
    let mut config = config(image, GPU_REPORT_JOB);
    config.transport = JobTransport::Cmdline;
    let run = boot("stock_virtio_gpu_driver_binds_to_vgpu", &config);
    assert_eq!(run.exit_code, Some(0), "{}", run.logs());
    let report = GpuReport::parse(&run.output);
    report.assert_virtio_gpu_with_mode("1024x768", &run);
    let server_log = run.server_log.as_deref().unwrap_or_default();
    assert!(
        server_log.contains("driver ready"),
        "server never saw DRIVER_OK:\n{server_log}"
    );
}

/// The same checks against QEMU's own virtio-gpu-pci: shows that the job and its checks are
/// right when the test above fails.
#[test]
fn reference_virtio_gpu_pci_passes_the_same_checks() {
    let Some(image) = skip_without_guest() else {
        return;
    };
    let _lock = boot_lock();
    let config = config(image, GPU_REPORT_JOB).gpu(GuestGpu::QemuVirtioGpu);
    let run = boot("reference_virtio_gpu_pci_passes_the_same_checks", &config);
    assert_eq!(run.exit_code, Some(0), "{}", run.logs());
    GpuReport::parse(&run.output).assert_virtio_gpu_with_mode("1024x768", &run);
    assert!(run.server_log.is_none());
}

/// (b) A guest reboot resets the device (DEVICE_RESET from QEMU), and the driver binds again
/// on the second boot, against the same server connection. The job comes through fw_cfg; a
/// scratch disk tells the second boot from the first.
#[test]
fn guest_reboot_rebinds_the_driver() {
    let Some(image) = skip_without_guest() else {
        return;
    };
    let _lock = boot_lock();
    let dir = TempDir::new("vgpu-guest-reboot").expect("temp dir");
    let scratch = dir.path().join("scratch.img");
    std::fs::File::create(&scratch)
        .and_then(|f| f.set_len(1 << 20))
        .expect("scratch disk");
    let job = format!(
        r#"
if [ "$(head -c 5 /dev/vdb)" = again ]; then
    echo SECOND-BOOT
    {GPU_REPORT_JOB}
else
    echo FIRST-BOOT
    printf again | dd of=/dev/vdb conv=notrunc,fsync status=none
    echo REBOOTING
    # Let the console drain: sysrq b resets at once and drops what is still queued.
    sleep 1
    echo b > /proc/sysrq-trigger
    sleep 30
fi
"#
    );
    let mut config = config(image, &job);
    config.transport = JobTransport::FwCfg;
    config.allow_reboot = true;
    config.extra_qemu_args = vec![
        "-drive".into(),
        format!("file={},format=raw,if=virtio", scratch.display()),
    ];
    let run = boot("guest_reboot_rebinds_the_driver", &config);
    assert_eq!(run.exit_code, Some(0), "{}", run.logs());
    let first = run.serial.find("REBOOTING");
    let second = run.serial.find("SECOND-BOOT");
    assert!(
        matches!((first, second), (Some(a), Some(b)) if a < b),
        "no reboot seen\n{}",
        run.logs()
    );
    assert_eq!(
        run.serial.matches("VGPU-INIT").count(),
        2,
        "two boots\n{}",
        run.logs()
    );
    GpuReport::parse(&run.output).assert_virtio_gpu_with_mode("1024x768", &run);
    let server_log = run.server_log.as_deref().unwrap_or_default();
    assert!(
        server_log.matches("driver ready").count() >= 2,
        "the driver did not come up twice:\n{server_log}"
    );
}

/// (c) QEMU killed while the guest driver is initialising the device: the server (without
/// --exit-on-disconnect) drops that connection and serves a new VM, whose driver binds.
#[test]
fn server_serves_a_new_vm_after_qemu_is_killed_mid_boot() {
    let Some(image) = skip_without_guest() else {
        return;
    };
    let _lock = boot_lock();
    let test = "server_serves_a_new_vm_after_qemu_is_killed_mid_boot";
    let binary = server_binary().unwrap_or_else(|e| panic!("{e}"));
    let mut server = ServerProcess::start(&binary, false, &[]).unwrap_or_else(|e| panic!("{e}"));
    let socket = server.socket().to_owned();

    let config = config(image, GPU_REPORT_JOB).gpu(GuestGpu::VfioUser(socket));
    let started = Instant::now();
    let mut victim = RunningGuest::launch(&config).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        server.wait_for_log("features negotiated", BOOT_TIMEOUT),
        "the guest driver never negotiated features:\n{}",
        server.log()
    );
    let status = victim.kill().expect("kill QEMU");
    report(
        test,
        &format!(
            "killed QEMU {:.1} s into the boot, while the driver was initialising ({status})",
            started.elapsed().as_secs_f64()
        ),
    );
    drop(victim);
    server.assert_survived("QEMU was killed");

    let run = boot(test, &config);
    assert_eq!(run.exit_code, Some(0), "{}", run.logs());
    GpuReport::parse(&run.output).assert_virtio_gpu_with_mode("1024x768", &run);
    // Both connections ended (the second when its guest powered off), the server still up.
    let ended = |log: &str| {
        log.matches("client disconnected").count() + log.matches("client connection lost").count()
    };
    // The server logs the second end once it has handled QEMU's exit, which takes a while
    // on a host whose cores are busy with other work too.
    let deadline = Instant::now() + Duration::from_secs(30);
    while ended(&server.log()) < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = server.log();
    assert!(
        ended(&log) >= 2,
        "two connections should have ended:\n{log}"
    );
    assert!(
        server.try_wait().expect("server state").is_none(),
        "the server exited:\n{log}"
    );
    server.kill().expect("kill server");
}

/// The pids of `pid`'s children (every thread's `children` list).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// `vgpu-run-vm` stopped with SIGTERM while its guest boots (as the demo's cleanup and an
/// operator's Ctrl-C do) exits with 143 after stopping QEMU and vgpu-server and removing the
/// cgroup it made: nothing of the VM is left behind.
#[test]
fn launcher_stopped_by_sigterm_leaves_nothing_behind() {
    let test = "launcher_stopped_by_sigterm_leaves_nothing_behind";
    let Some(image) = skip_without_guest() else {
        return;
    };
    let _boot = boot_lock();
    let server = server_binary().unwrap_or_else(|e| panic!("{e}"));
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_vgpu-run-vm"));
    command
        .arg("--image")
        .arg(&image.dir)
        .arg("--server")
        .arg(&server)
        .args(["--timeout", "240", "--job", "sleep 600"]);
    // The cgroup part needs a process that may create cgroups (root here and in CI).
    let cgroup_name = guest::test_cgroup("sigterm");
    if let Some(name) = &cgroup_name {
        command.args(["--cgroup", name]);
    }
    let mut launcher = command
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start vgpu-run-vm");
    // Kills the launcher if an assertion fails before it exits.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stderr = launcher.stderr.take().expect("piped stderr");
    let mut launcher = Reap(launcher);
    let pid = launcher.0.id();
    let lines = std::thread::spawn(move || {
        use std::io::BufRead as _;
        std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    // Booting: QEMU and vgpu-server are the launcher's children.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut children = Vec::new();
    while children.len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        children = children_of(pid);
    }
    assert!(children.len() >= 2, "QEMU and vgpu-server: {children:?}");
    // QEMU is the child in the new cgroup.
    let cgroup_dir = children
        .iter()
        .filter_map(|&child| CgroupFs::default().locate(child).ok())
        .map(|c| c.path())
        .find(|dir| cgroup_name.as_ref().is_some_and(|name| dir.ends_with(name)));
    assert_eq!(cgroup_dir.is_some(), cgroup_name.is_some(), "QEMU's cgroup");
    // This process started the launcher: the signal goes to exactly that pid.
    let rc = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(rc.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = launcher.0.try_wait().expect("launcher state") {
            break status;
        }
        assert!(Instant::now() < deadline, "vgpu-run-vm ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = lines.join().expect("stderr reader").join("\n");
    report(test, &format!("vgpu-run-vm exited with {status}"));
    assert_eq!(status.code(), Some(143), "{stderr}");
    assert!(stderr.contains("stopped by a signal"), "{stderr}");
    for child in children {
        assert!(
            !Path::new(&format!("/proc/{child}")).exists(),
            "child {child} of the launcher outlived it"
        );
    }
    if let Some(dir) = cgroup_dir {
        assert!(!dir.exists(), "{} was left behind", dir.display());
    }
}

/// `vgpu-run-vm --stop-after` runs its job through the control channel until the time is up,
/// then closes its stdin: the job's SUMMARY lines reach stdout once each (from the channel; the
/// agent's echo on the console is not printed again), its other output once, and the job's
/// exit code is the launcher's.
#[test]
fn launcher_stop_after_stops_the_job_and_prints_each_summary_once() {
    let test = "launcher_stop_after_stops_the_job_and_prints_each_summary_once";
    let Some(image) = skip_without_guest() else {
        return;
    };
    let _boot = boot_lock();
    let server = server_binary().unwrap_or_else(|e| panic!("{e}"));
    let job =
        "echo SUMMARY first; echo plain line; cat >/dev/null; echo SUMMARY after-stop; exit 3";
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vgpu-run-vm"))
        .arg("--image")
        .arg(&image.dir)
        .arg("--server")
        .arg(&server)
        .args(["--timeout", "240", "--stop-after", "3", "--job", job])
        .output()
        .expect("run vgpu-run-vm");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    report(test, &format!("vgpu-run-vm exited with {}", out.status));
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    let count = |line: &str| stdout.lines().filter(|l| *l == line).count();
    assert_eq!(count("SUMMARY first"), 1, "{stdout}");
    assert_eq!(count("SUMMARY after-stop"), 1, "{stdout}");
    assert_eq!(count("plain line"), 1, "{stdout}");
    assert!(stderr.contains("stopping it in 3 s"), "{stderr}");
}
