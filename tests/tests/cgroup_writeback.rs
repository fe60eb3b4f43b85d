//! CPU weight write-back end to end: two qtest QEMUs, each in its own CPU cgroup (v1
//! `cpu.shares` here, v2 `cpu.weight` where the cpu controller is enabled), each with its own
//! `vgpu-server` process connected to one real `vgpu-schedd` running Pegasus AccC.
//!
//! With `--cpu-writeback` the daemon writes the policy's weight hints (the VM's GPU credits
//! scaled so the default credits are cgroup v2's default weight) to each QEMU's cgroup, follows a
//! live parameter change, and puts the cgroup's own value back when the VM disconnects and when
//! the daemon stops on SIGTERM. Without the flag the files stay untouched. `vgpuctl list --json`
//! reports the QEMU pid the device found on its vfio-user socket (SO_PEERCRED), the cgroup the
//! daemon located for it and the vCPU threads (`CPU n/DUMMY` under qtest) its probe found.
//!
//! Creating cgroups needs root and a writable cpu controller: without them the test is skipped,
//! or fails when `VGPU_REQUIRE_CGROUP=1` (test.sh).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use vgpu_schedd::cgroup::CgroupFs;
use vgpu_scheduler::model::DEFAULT_WEIGHT;
use vgpu_tests::daemon::Schedd;
use vgpu_tests::guest::{ServerProcess, server_binary};
use vgpu_tests::{QtestVm, VmConfig, skip_without_qemu, vfio_user_pci_device};

/// Longest wait for anything the daemon does on its 100 ms tick.
const TIMEOUT: Duration = Duration::from_secs(10);
/// How long files are watched to make sure the daemon does not write them.
const UNTOUCHED: Duration = Duration::from_millis(600);
const POLICY: &str = "policy = \"pegasus\"\nmode = \"accc\"\n";
/// GPU credits (Pegasus `X`, the VM's `weight` parameter) of the two VMs, and a live change.
const WEIGHT_A: u32 = 512;
const WEIGHT_B: u32 = 128;
const WEIGHT_A_LIVE: u32 = 1024;

/// The CPU weight file of a cgroup directory: which file, and the value written for a hinted
/// cgroup v2 weight.
struct WeightFile {
    path: PathBuf,
    v1: bool,
}

impl WeightFile {
    fn of(cgroup: &Path) -> WeightFile {
        let v1 = cgroup.join("cpu.shares");
        if v1.is_file() {
            WeightFile { path: v1, v1: true }
        } else {
            WeightFile {
                path: cgroup.join("cpu.weight"),
                v1: false,
            }
        }
    }

    fn read(&self) -> u64 {
        let text = std::fs::read_to_string(&self.path).expect("weight file");
        text.trim().parse().expect("a number")
    }

    /// What the file holds once the policy's hint for GPU credits `x` is written: the AccC
    /// rule maps the default credits (256) to cgroup v2's default weight (100), proportionally,
    /// clamped to 1..=10000; v1 takes systemd's conversion, weight * 1024 / 100 (2..=262144).
    fn hinted(&self, x: u32) -> u64 {
        let weight = (u64::from(x) * 100 / u64::from(DEFAULT_WEIGHT)).clamp(1, 10_000);
        if self.v1 {
            (weight * 1024 / 100).clamp(2, 262_144)
        } else {
            weight
        }
    }
}

/// One VM: its device process (connected to the daemon) and its qtest QEMU in its own cgroup.
struct Vm {
    name: &'static str,
    /// Dropped first: QEMU (and its cgroup) go before its device process.
    qemu: QtestVm,
    server: ServerProcess,
    file: WeightFile,
}

impl Vm {
    fn start(daemon: &Schedd, name: &'static str) -> Vm {
        let args = [
            "--scheduler".to_string(),
            daemon.socket().display().to_string(),
            "--vm-name".to_string(),
            name.to_string(),
        ];
        let binary = server_binary().expect("vgpu-server binary");
        let server = ServerProcess::start(&binary, true, &args).expect("vgpu-server starts");
        let config = VmConfig::default()
            .device(vfio_user_pci_device(server.socket()))
            .cgroup(cgroup_name(name));
        let qemu = QtestVm::launch(&config).expect("QEMU starts in its cgroup");
        let file = WeightFile::of(&qemu.cgroup_path().expect("QEMU has its own cgroup"));
        Vm {
            name,
            qemu,
            server,
            file,
        }
    }

    /// Waits until the daemon lists the VM connected, with a cgroup probe that has sampled;
    /// returns its `list` entry.
    fn listed(&self, daemon: &Schedd) -> Value {
        let mut info = Value::Null;
        wait_until(&format!("{} probed", self.name), || {
            info = daemon.vm_info(self.name).expect("vgpuctl list");
            info["connected"] == true && info["cgroup"]["sample"].is_object()
        });
        info
    }

    /// Checks what the daemon found: the QEMU pid, its cgroup, vCPU threads and usage.
    fn check_listed(&self, daemon: &Schedd) -> Value {
        let info = self.listed(daemon);
        assert_eq!(
            info["qemu_pid"].as_u64(),
            Some(u64::from(self.qemu.pid())),
            "{}: the QEMU pid from the device's vfio-user peer: {info}",
            self.name
        );
        let cgroup = &info["cgroup"];
        assert_eq!(
            cgroup["path"].as_str().map(PathBuf::from),
            self.qemu.cgroup_path(),
            "{}: {info}",
            self.name
        );
        let hierarchy = if self.file.v1 { "v1" } else { "v2" };
        assert_eq!(cgroup["hierarchy"], hierarchy, "{}: {info}", self.name);
        assert!(
            cgroup["vcpu_threads"].as_u64() >= Some(1),
            "{}: QEMU's vCPU threads were not found: {info}\n{}",
            self.name,
            thread_names(self.qemu.pid())
        );
        assert!(
            cgroup["sample"]["usage"].as_u64() > Some(0),
            "{}: no CPU usage in its cgroup: {info}",
            self.name
        );
        info
    }

    fn wait_file(&self, want: u64, what: &str) {
        let mut got = 0;
        wait_until(&format!("{}: {what} ({want})", self.name), || {
            got = self.file.read();
            got == want
        });
    }
}

/// A cgroup name unique to this test process and call (the tests run in parallel).
fn cgroup_name(vm: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("vgpu-wb-{}-{n}-{vm}", std::process::id())
}

/// The names of a process's threads, for a failure message.
fn thread_names(pid: u32) -> String {
    let task = PathBuf::from(format!("/proc/{pid}/task"));
    let Ok(entries) = std::fs::read_dir(&task) else {
        return format!("{} is unreadable", task.display());
    };
    let names: Vec<String> = entries
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .collect();
    format!("threads of {pid}: {names:?}")
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < TIMEOUT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether this process may create CPU cgroups (probed by creating and removing one); says why
/// not, and fails instead when `VGPU_REQUIRE_CGROUP=1`.
fn cgroups_usable() -> bool {
    let probe = cgroup_name("probe");
    let why = match CgroupFs::default().create_vm_cgroup("", &probe) {
        Ok(cgroup) => match cgroup.remove() {
            Ok(()) => return true,
            Err(e) => format!("cannot remove the probe cgroup: {e}"),
        },
        Err(e) => format!("cannot create a CPU cgroup: {e}"),
    };
    let required = std::env::var("VGPU_REQUIRE_CGROUP").is_ok_and(|v| v == "1");
    assert!(!required, "VGPU_REQUIRE_CGROUP=1 but {why}");
    eprintln!("SKIPPED: {why}");
    false
}

/// Starts the daemon, stores both VMs' credits, starts both VMs.
fn start(args: &[&str]) -> (Schedd, Vm, Vm) {
    let daemon = Schedd::start_with(Some(POLICY), "debug", args).expect("daemon");
    for (vm, weight) in [("a", WEIGHT_A), ("b", WEIGHT_B)] {
        let weight = format!("weight={weight}");
        daemon
            .ctl(&["set", "--add", vm, &weight])
            .expect("vgpuctl set");
    }
    let a = Vm::start(&daemon, "a");
    let b = Vm::start(&daemon, "b");
    (daemon, a, b)
}

#[test]
fn weights_are_written_back_and_restored() {
    if skip_without_qemu() || !cgroups_usable() {
        return;
    }
    let (mut daemon, mut a, b) = start(&["--cpu-writeback"]);
    // A new cgroup starts at the hierarchy's default: what must come back.
    let original = if a.file.v1 { 1024 } else { 100 };
    for vm in [&a, &b] {
        let info = vm.check_listed(&daemon);
        assert_eq!(
            info["cgroup"]["saved_weight"].as_u64(),
            Some(original),
            "{}: the cgroup's own value, saved before the first write: {info}",
            vm.name
        );
    }
    a.wait_file(a.file.hinted(WEIGHT_A), "hinted weight");
    b.wait_file(b.file.hinted(WEIGHT_B), "hinted weight");
    assert_ne!(
        a.file.hinted(WEIGHT_A),
        original,
        "the hint must be visible"
    );
    assert_ne!(
        b.file.hinted(WEIGHT_B),
        original,
        "the hint must be visible"
    );

    // A live change of the credits is written too.
    let live = format!("weight={WEIGHT_A_LIVE}");
    daemon.ctl(&["set", "a", &live]).expect("vgpuctl set");
    a.wait_file(a.file.hinted(WEIGHT_A_LIVE), "live weight");

    // The VM goes (QEMU killed, its device process exits): its cgroup gets its value back;
    // the other VM keeps its hint.
    a.qemu.kill().expect("kill QEMU");
    let exited = a
        .server
        .wait_exit(TIMEOUT)
        .expect("waiting for vgpu-server");
    assert!(exited.is_some(), "the device process exits with its QEMU");
    wait_until("a disconnected", || {
        daemon.vm_info("a").expect("vgpuctl list")["connected"] == false
    });
    a.wait_file(original, "restored after the disconnect");
    assert_eq!(b.file.read(), b.file.hinted(WEIGHT_B));

    // The daemon stops on SIGTERM: the remaining VM's value comes back too.
    assert!(
        daemon.terminate(TIMEOUT).expect("SIGTERM"),
        "clean exit:\n{}",
        daemon.log()
    );
    assert_eq!(b.file.read(), original, "restored at shutdown");
    let log = daemon.log();
    for vm in ["a", "b"] {
        assert!(
            log.contains(&format!("{vm}: CPU weight of ")) && log.contains("restored to"),
            "no restore logged for {vm}:\n{log}"
        );
    }
}

#[test]
fn without_writeback_the_cgroups_are_left_alone() {
    if skip_without_qemu() || !cgroups_usable() {
        return;
    }
    let (daemon, a, b) = start(&[]);
    let before = [a.file.read(), b.file.read()];
    for vm in [&a, &b] {
        let info = vm.check_listed(&daemon);
        assert!(info["cgroup"]["saved_weight"].is_null(), "{info}");
    }
    // A live change makes the policy hint again; still nothing is written.
    let live = format!("weight={WEIGHT_A_LIVE}");
    daemon.ctl(&["set", "a", &live]).expect("vgpuctl set");
    std::thread::sleep(UNTOUCHED);
    assert_eq!([a.file.read(), b.file.read()], before);
    assert_ne!(before[0], a.file.hinted(WEIGHT_A), "a write would be seen");
}
