//! The cgroup module against this machine's real cgroup v1 cpu hierarchy: create a VM cgroup,
//! write its weight, move spawned children into it, read their CPU hint, and clean up.
//!
//! Where the v1 cpu hierarchy is missing or not writable the test says why and passes, unless
//! `VGPU_REQUIRE_CGROUP=1` asks for it to fail instead.

use std::path::Path;
use std::process::{Child, Command};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use vgpu_schedd::cgroup::{
    CgroupFs, CpuProbe, Hierarchy, VmCgroup, shares_to_weight, weight_to_shares,
};

/// Kills the children this test spawned (by their pid) and removes the cgroup, also when an
/// assertion fails half way.
struct Cleanup {
    children: Vec<Child>,
    cgroup: Option<VmCgroup>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for child in &mut self.children {
            // Kill only our own children; an already reaped one just errors.
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(cgroup) = self.cgroup.take() {
            // A killed child leaves the cgroup once reaped; give the kernel a moment.
            for _ in 0..50 {
                if cgroup.pids().map(|p| p.is_empty()).unwrap_or(true) {
                    break;
                }
                thread::sleep(Duration::from_millis(20));
            }
            if let Err(err) = cgroup.remove() {
                eprintln!("cgroup_v1: could not remove the test cgroup: {err}");
            }
        }
    }
}

/// Says why the real hierarchy cannot be used; fails when `VGPU_REQUIRE_CGROUP=1`.
fn unavailable(why: &str) {
    let required = std::env::var("VGPU_REQUIRE_CGROUP").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "VGPU_REQUIRE_CGROUP=1 but the cgroup v1 cpu hierarchy is unusable: {why}"
    );
    eprintln!("cgroup_v1: skipped: {why}");
}

/// The host's mounts, but with cgroup v2 pointed at nothing so the v1 path is the one tested.
fn v1_only() -> CgroupFs {
    CgroupFs {
        v2_root: Path::new("/nonexistent/vgpu-cgroup-v2").to_path_buf(),
        ..CgroupFs::default()
    }
}

fn spawn(script: &str) -> Child {
    Command::new("sh")
        .args(["-c", script])
        .spawn()
        .expect("spawn sh")
}

#[test]
fn real_v1_cpu_hierarchy() {
    let fs = v1_only();
    if !fs.v1_cpu_root.join("cpu.shares").is_file() {
        unavailable(&format!(
            "{} is not a cgroup v1 cpu hierarchy",
            fs.v1_cpu_root.display()
        ));
        return;
    }
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let name = format!("vgpu-test-{}-{stamp}", std::process::id());
    let cgroup = match fs.create_vm_cgroup("", &name) {
        Ok(cgroup) => cgroup,
        Err(err) => {
            unavailable(&format!("cannot create a cgroup: {err}"));
            return;
        }
    };
    assert_eq!(cgroup.hierarchy(), Hierarchy::V1);
    assert_eq!(cgroup.path(), fs.v1_cpu_root.join(&name));
    let mut guard = Cleanup {
        children: Vec::new(),
        cgroup: Some(cgroup.clone()),
    };

    // The weight goes out as shares and comes back through systemd's conversion.
    cgroup.set_weight(300).unwrap();
    let shares = std::fs::read_to_string(cgroup.path().join("cpu.shares")).unwrap();
    assert_eq!(shares.trim(), weight_to_shares(300).to_string());
    assert_eq!(
        cgroup.weight().unwrap(),
        shares_to_weight(weight_to_shares(300))
    );
    assert_eq!(cgroup.weight().unwrap(), 300);

    // A sleeping child: found in its cgroup, not runnable.
    guard.children.push(spawn("exec sleep 30"));
    let sleeper = guard.children[0].id();
    cgroup.add_pid(sleeper).unwrap();
    assert_eq!(cgroup.pids().unwrap(), vec![sleeper]);
    let clock = Instant::now();
    let now = || u64::try_from(clock.elapsed().as_nanos()).unwrap();
    let mut probe = CpuProbe::new(fs.clone(), sleeper).unwrap();
    assert_eq!(probe.cgroup().path(), cgroup.path());
    thread::sleep(Duration::from_millis(50));
    let before = probe.sample(now()).unwrap();
    assert_eq!(before.weight, 300);
    assert!(!before.runnable, "sleep(1) is asleep: {before:?}");

    // A busy child in the same cgroup: runnable while it spins, and the usage grows.
    guard.children.push(spawn("while :; do :; done"));
    let busy = guard.children[1].id();
    cgroup.add_pid(busy).unwrap();
    let mut busy_probe = CpuProbe::new(fs.clone(), busy).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut seen_runnable = false;
    while Instant::now() < deadline && !seen_runnable {
        seen_runnable = busy_probe.sample(now()).unwrap().runnable;
        thread::sleep(Duration::from_millis(10));
    }
    assert!(seen_runnable, "the busy loop was never seen runnable");
    thread::sleep(Duration::from_millis(300));
    // It was busy all that time (on a CPU or waiting for one): running, not only runnable.
    let spinning = busy_probe.sample(now()).unwrap();
    assert!(
        spinning.running || !spinning.runnable,
        "a spinning loop is not running: {spinning:?}"
    );
    let mut busy_child = guard.children.remove(1);
    busy_child.kill().unwrap();
    busy_child.wait().unwrap();
    let after = probe.sample(now()).unwrap();
    assert!(
        after.usage >= before.usage.saturating_add(100_000_000),
        "usage grew by only {} ns",
        after.usage.saturating_sub(before.usage)
    );

    // Move the sleeper out, kill it, remove the now empty cgroup.
    cgroup.move_out(sleeper).unwrap();
    assert!(cgroup.pids().unwrap().is_empty());
    assert!(
        std::fs::read_to_string(fs.v1_cpu_root.join("cgroup.procs"))
            .unwrap()
            .lines()
            .any(|l| l.trim() == sleeper.to_string()),
        "the sleeper is back in the root cgroup"
    );
    let mut sleeper_child = guard.children.remove(0);
    sleeper_child.kill().unwrap();
    sleeper_child.wait().unwrap();
    guard.cgroup = None;
    cgroup.remove().unwrap();
    assert!(!fs.v1_cpu_root.join(&name).exists());
    assert!(!fs.v1_cpuacct_root.join(&name).exists());
}
