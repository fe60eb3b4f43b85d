//! Persistent vGPU definitions end to end, with the real binaries: `vgpuctl define` two vGPUs
//! (one `--auto`), `start`/`stop`/`list --defined`, a daemon restart (SIGTERM by pid, then a
//! fresh `vgpu-schedd` on the same config dir) after which the auto one runs again, the other
//! does not, a broken definition file is skipped and every definition is still there. The
//! device processes are the workspace's `vgpu-server` (`--server-bin`). The transcript of the
//! human-readable commands goes to stderr (`cargo test -- --nocapture` shows it).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tempfile::TempDir;

const SCHEDD: &str = env!("CARGO_BIN_EXE_vgpu-schedd");
const VGPUCTL: &str = env!("CARGO_BIN_EXE_vgpuctl");
/// How long the daemon, a device process or an exit may take.
const WAIT: Duration = Duration::from_secs(20);
const POLL: Duration = Duration::from_millis(20);

/// The workspace's `vgpu-server`, beside this package's binaries: built first (once per test
/// process) with the same profile when cargo runs the test (it belongs to another package, so
/// cargo does not build it for this one's tests); taken as it is otherwise.
fn server_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(build_server).clone()
}

fn build_server() -> PathBuf {
    let profile_dir = Path::new(SCHEDD).parent().expect("binary directory");
    if let Some(cargo) = std::env::var_os("CARGO") {
        let profile = match profile_dir.file_name().and_then(|p| p.to_str()) {
            Some("debug") | None => "dev".to_owned(),
            Some(p) => p.to_owned(),
        };
        let target = profile_dir.parent().expect("target directory");
        let status = Command::new(cargo)
            .args(["build", "--quiet", "--profile", &profile])
            .args(["-p", "vgpu-server", "--bin", "vgpu-server"])
            .env("CARGO_TARGET_DIR", target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("running cargo");
        assert!(status.success(), "building vgpu-server: {status}");
    }
    let bin = profile_dir.join("vgpu-server");
    assert!(bin.is_file(), "no {}", bin.display());
    bin
}

/// A running `vgpu-schedd` on fixed paths under `dir` (so a restart serves the same sockets),
/// killed by pid on drop.
struct Schedd {
    dir: PathBuf,
    child: Option<Child>,
    starts: u32,
}

impl Schedd {
    fn start(dir: &Path) -> Schedd {
        let mut d = Schedd {
            dir: dir.to_owned(),
            child: None,
            starts: 0,
        };
        d.spawn();
        d
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join(format!("schedd-{}.log", self.starts))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let log = std::fs::File::create(self.log_path()).unwrap();
        let child = Command::new(SCHEDD)
            .arg(format!(
                "--socket={}",
                self.dir.join("sched.sock").display()
            ))
            .arg("--control")
            .arg(self.dir.join("control.sock"))
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .arg("--config-dir")
            .arg(self.dir.join("etc"))
            .arg("--server-bin")
            .arg(server_bin())
            .args(["--log-level", "debug"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let start = Instant::now();
        while UnixStream::connect(self.dir.join("control.sock")).is_err() {
            let exited = self.child.as_mut().and_then(|c| c.try_wait().unwrap());
            assert!(
                exited.is_none(),
                "the daemon exited: {exited:?}\n{}",
                self.log()
            );
            assert!(start.elapsed() < WAIT, "no control socket:\n{}", self.log());
            std::thread::sleep(POLL);
        }
    }

    /// SIGTERM by pid and the exit, as `systemctl restart` would; then a fresh daemon.
    fn restart(&mut self) {
        let mut child = self.child.take().expect("running");
        let pid = child.id().to_string();
        let o = Command::new("kill").args(["-TERM", &pid]).output().unwrap();
        assert!(o.status.success(), "{o:?}");
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(start.elapsed() < WAIT, "the daemon did not stop");
            std::thread::sleep(POLL);
        };
        assert!(status.success(), "{status}\n{}", self.log());
        self.spawn();
    }

    /// A crash under systemd: the daemon and then its device processes (the unit's cgroup) are
    /// killed with SIGKILL, so nobody removes the device sockets; then a fresh daemon.
    fn crash(&mut self) {
        let pids: Vec<String> = self.json(&["list"])["children"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["pid"].to_string())
            .collect();
        let mut child = self.child.take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
        for pid in &pids {
            let o = Command::new("kill").args(["-KILL", pid]).output().unwrap();
            assert!(o.status.success(), "{o:?}");
        }
        // The killed device processes are reparented and reaped by whoever adopts them; once
        // every thread of one is gone or a zombie it has closed its sockets. The leader alone
        // is not enough: it turns zombie while its other threads are still exiting with the
        // descriptor table (CI saw the restarted daemon find the socket still served).
        let running = |stat: &Path| {
            std::fs::read_to_string(stat).is_ok_and(|s| {
                !matches!(
                    s.rsplit_once(") ")
                        .and_then(|(_, rest)| rest.chars().next()),
                    Some('Z' | 'X')
                )
            })
        };
        let exiting = |pid: &String| {
            std::fs::read_dir(Path::new("/proc").join(pid).join("task")).is_ok_and(|tasks| {
                tasks
                    .filter_map(Result::ok)
                    .any(|t| running(&t.path().join("stat")))
            })
        };
        let start = Instant::now();
        while pids.iter().any(exiting) {
            assert!(
                start.elapsed() < WAIT,
                "device processes {pids:?} still run"
            );
            std::thread::sleep(POLL);
        }
        self.spawn();
    }

    /// `vgpuctl --control SOCK --config-dir DIR ARGS`.
    fn ctl(&self, args: &[&str]) -> Output {
        Command::new(VGPUCTL)
            .arg("--control")
            .arg(self.dir.join("control.sock"))
            .arg(format!("--config-dir={}", self.dir.join("etc").display()))
            .args(args)
            .output()
            .unwrap()
    }

    /// `ctl ARGS`, which must succeed, printed as a transcript line; its stdout.
    fn say(&self, args: &[&str]) -> String {
        let o = self.ctl(args);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let shown: Vec<String> = args
            .iter()
            .map(|a| a.replace(&self.dir.display().to_string(), "$T"))
            .collect();
        let _ = write!(
            std::io::stderr(),
            "$ vgpuctl {}\n{}",
            shown.join(" "),
            out.replace(&self.dir.display().to_string(), "$T")
        );
        assert!(
            o.status.success(),
            "vgpuctl {args:?}: {o:?}\n{}",
            self.log()
        );
        out
    }

    /// `ctl --json ARGS`, which must succeed, parsed.
    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let o = self.ctl(&all);
        assert!(o.status.success(), "vgpuctl {all:?}: {o:?}\n{}", self.log());
        serde_json::from_slice(&o.stdout).unwrap()
    }

    /// The names of the device processes the daemon runs.
    fn children(&self) -> Vec<String> {
        let list = self.json(&["list"]);
        let children = list["children"].as_array().unwrap();
        children
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_owned())
            .collect()
    }

    /// VM `name`'s own parameters in `list`.
    fn params(&self, name: &str) -> Value {
        let list = self.json(&["list"]);
        let vms = list["vms"].as_array().unwrap();
        let vm = vms.iter().find(|v| v["name"] == name);
        vm.map(|v| v["params"].clone()).unwrap_or(Value::Null)
    }

    fn wait_children(&self, want: &[&str]) {
        let start = Instant::now();
        while self.children() != want {
            assert!(
                start.elapsed() < WAIT,
                "device processes {:?}, want {want:?}\n{}",
                self.children(),
                self.log()
            );
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for Schedd {
    fn drop(&mut self) {
        // SIGTERM first so that the daemon stops its device processes.
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let start = Instant::now();
            while c.try_wait().ok().flatten().is_none() && start.elapsed() < WAIT {
                std::thread::sleep(POLL);
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- vgpu-schedd stderr ---\n{}", self.log());
        }
    }
}

/// `list --defined --json` as name → (state, pid).
fn defined(d: &Schedd) -> Vec<(String, bool, Option<u64>)> {
    let v = d.json(&["list", "--defined"]);
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_owned(),
                e.get("error").is_none(),
                e["pid"].as_u64(),
            )
        })
        .collect()
}

#[test]
fn definitions_survive_a_daemon_restart_and_auto_ones_start_again() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let mut d = Schedd::start(dir);
    let sock = |n: &str| dir.join(format!("{n}.sock")).display().to_string();
    let (s1, s2) = (sock("vm1"), sock("vm2"));
    d.say(&[
        "define",
        "vm1",
        "--socket",
        &s1,
        "--auto",
        "priority=3",
        "weight=512",
        "--",
        "--renderer",
        "none",
    ]);
    d.say(&[
        "define",
        "vm2",
        &format!("--socket={s2}"),
        "reserve=2000/10000/pe",
        "--",
        "--renderer",
        "none",
    ]);
    // Refused (exit 1): a second definition of a name, a bad name, a bad parameter, a bad
    // option, an unknown definition or device process.
    for bad in [
        vec!["define", "vm1", "--socket", &s2],
        vec!["define", "../x", "--socket", &s2],
        vec!["define", "vm3", "--socket", &s2, "colour=red"],
        vec!["define", "vm3", "--socket", &s2, "--", "--dump-dir", "/etc"],
        vec!["start", "nosuch"],
        vec!["stop", "nosuch"],
    ] {
        assert_eq!(d.ctl(&bad).status.code(), Some(1), "{bad:?}");
    }
    let file = dir.join("etc/vgpus/vm1.json");
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let uuid = saved["uuid"].as_str().expect("a UUID").to_owned();
    assert_eq!(
        saved,
        json!({"socket": s1, "server_args": ["--renderer", "none"],
               "params": {"priority": 3, "weight": 512}, "auto": true, "uuid": uuid})
    );
    // A broken file, even marked auto, is listed as broken and never fatal.
    std::fs::write(
        dir.join("etc/vgpus/broken.json"),
        br#"{"socket": "relative.sock", "auto": true}"#,
    )
    .unwrap();
    d.say(&["list", "--defined"]);
    assert_eq!(
        defined(&d),
        [
            ("broken".to_owned(), false, None),
            ("vm1".to_owned(), true, None),
            ("vm2".to_owned(), true, None)
        ]
    );
    let broken = d.ctl(&["start", "broken"]);
    assert_eq!(broken.status.code(), Some(1), "{broken:?}");

    d.say(&["start", "vm1"]);
    d.say(&["start", "vm2"]);
    // Started twice: the daemon refuses (exit 1).
    assert_eq!(d.ctl(&["start", "vm1"]).status.code(), Some(1));
    d.say(&["list", "--defined"]);
    assert_eq!(d.children(), ["vm1", "vm2"]);
    // The parameters are in force for the VMs before their devices connect.
    assert_eq!(d.params("vm1")["priority"], 3);
    assert_eq!(d.params("vm1")["weight"], 512);
    assert_eq!(d.params("vm2")["reserve"]["c"], 2_000_000);
    d.say(&["list"]);
    d.say(&["stop", "vm2"]);
    d.say(&["list", "--defined"]);
    assert_eq!(d.children(), ["vm1"]);

    let _ = writeln!(std::io::stderr(), "--- vgpu-schedd restarts ---");
    d.restart();
    // vm1 (auto) runs again, vm2 does not; the definitions are all there.
    d.wait_children(&["vm1"]);
    d.say(&["list", "--defined"]);
    assert_eq!(
        defined(&d)
            .into_iter()
            .map(|(n, ok, pid)| (n, ok, pid.is_some()))
            .collect::<Vec<_>>(),
        [
            ("broken".to_owned(), false, false),
            ("vm1".to_owned(), true, true),
            ("vm2".to_owned(), true, false)
        ]
    );
    assert_eq!(d.params("vm1")["priority"], 3, "applied at boot");
    assert!(
        d.log().contains("broken") && d.log().contains("skipped"),
        "{}",
        d.log()
    );
    d.say(&["start", "vm2"]);
    assert_eq!(d.children(), ["vm1", "vm2"]);
    d.say(&["stop", "vm2"]);
    d.say(&["undefine", "vm2"]);
    d.say(&["list", "--defined"]);
    assert!(!dir.join("etc/vgpus/vm2.json").exists());
    assert_eq!(d.ctl(&["undefine", "vm2"]).status.code(), Some(1));

    let _ = writeln!(std::io::stderr(), "--- vgpu-schedd crashes ---");
    d.crash();
    // vm1's socket was left behind by its killed device process: the new daemon removes it
    // (nobody serves it) and starts vm1 again.
    d.wait_children(&["vm1"]);
    assert!(d.log().contains("nobody serves it"), "{}", d.log());
}

/// `ctl ARGS`, which must be refused (exit 1) with a message holding every one of `says`;
/// printed as a transcript line.
fn refused(d: &Schedd, args: &[&str], says: &[&str]) {
    let o = d.ctl(args);
    let err = String::from_utf8_lossy(&o.stderr);
    let _ = write!(std::io::stderr(), "$ vgpuctl {}\n{err}", args.join(" "));
    assert_eq!(o.status.code(), Some(1), "vgpuctl {args:?}: {o:?}");
    for s in says {
        assert!(
            err.contains(s),
            "vgpuctl {args:?} does not say {s:?}: {err}"
        );
    }
}

/// The VM names `list` shows.
fn listed(d: &Schedd) -> Vec<String> {
    let list = d.json(&["list"]);
    let stats = d.json(&["show"]);
    let names = |v: &Value| -> Vec<String> {
        v["vms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|vm| vm["name"].as_str().unwrap().to_owned())
            .collect()
    };
    // The statistics (what /metrics and the dashboard show) list the same VMs.
    assert_eq!(names(&list), names(&stats));
    names(&list)
}

#[test]
fn every_value_is_checked_once_and_live_changes_survive_a_restart() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    // The config dir exists, as the package makes it: the daemon keeps its live state there.
    std::fs::create_dir(dir.join("etc")).unwrap();
    let mut d = Schedd::start(dir);
    let sock = dir.join("vm1.sock").display().to_string();
    d.say(&[
        "define",
        "vm1",
        "--socket",
        &sock,
        "priority=2",
        "--",
        "--renderer",
        "none",
    ]);

    // An unknown VM is refused, named, with the known ones; nothing is added.
    refused(
        &d,
        &["set", "nosuchvm", "priority=3"],
        &["\"nosuchvm\"", "known: vm1"],
    );
    refused(
        &d,
        &["set", "--live", "nosuchvm", "priority=3"],
        &["nosuchvm"],
    );
    refused(
        &d,
        &["set", "--config", "nosuchvm", "priority=3"],
        &["nosuchvm is not defined"],
    );
    refused(&d, &["forget", "nosuchvm"], &["nosuchvm", "known: vm1"]);
    assert!(listed(&d).is_empty());

    // Unknown keys are refused with the valid ones, and nothing changes.
    refused(
        &d,
        &["set", "vm1", "bogus_key=42"],
        &["bogus_key", "priority, weight"],
    );
    let policy = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let fair_bogus = policy("fb.toml", "policy = \"fair\"\nbogus_key = 42\n");
    refused(
        &d,
        &["set-policy", &fair_bogus],
        &["bogus_key", "accounting"],
    );
    let none_bogus = policy("nb.toml", "policy = \"none\"\nbogus_key = 42\n");
    refused(&d, &["set-policy", &none_bogus], &["bogus_key"]);
    assert_eq!(d.json(&["list"])["policy"]["policy"], "none");

    // define refuses what start would, naming the value and the range; no file is written.
    let missing = dir.join("missing/vm2.sock").display().to_string();
    for (args, says) in [
        (vec!["reserve=2000/1000/pe"], "0 < C <= T"),
        (vec!["weight=0"], "weight must be at least 1"),
        (vec!["target_fps=5000"], "target_fps must be in (0, 1000]"),
        (
            vec!["--", "--display", "99999x1"],
            "--display 99999x1: each edge must be in 16..=16384",
        ),
    ] {
        let mut all = vec!["define", "vm2", "--socket", &sock];
        all.extend(args);
        refused(&d, &all, &[says]);
        let mut modify = vec!["modify", "vm1"];
        modify.extend(all.iter().skip(4));
        refused(&d, &modify, &[says]);
    }
    refused(
        &d,
        &["define", "vm2", "--socket", &missing],
        &["does not exist"],
    );
    refused(
        &d,
        &["modify", "vm1", "--socket", &missing],
        &["does not exist"],
    );
    assert!(!dir.join("etc/vgpus/vm2.json").exists());
    assert!(listed(&d).is_empty());

    // A VM that has not connected yet is added only when asked; forget drops it.
    d.say(&["set", "--add", "later", "weight=7"]);
    assert_eq!(listed(&d), ["later"]);
    d.say(&["forget", "later"]);
    assert!(listed(&d).is_empty());

    // Not running: set changes the definition (virsh's --current); --live the daemon's.
    d.say(&["set", "vm1", "weight=300"]);
    let def = |d: &Schedd| d.json(&["list", "--defined"])[0]["definition"]["params"].clone();
    assert_eq!(def(&d), json!({"priority": 2, "weight": 300}));
    assert!(listed(&d).is_empty(), "the daemon was not asked");
    // With no daemon to ask, nothing runs: a defined VM's definition is changed, and an
    // unknown VM is a connection error (exit 2).
    let offline = |args: &[&str]| {
        Command::new(VGPUCTL)
            .arg("--control")
            .arg(dir.join("nobody.sock"))
            .arg(format!("--config-dir={}", dir.join("etc").display()))
            .args(args)
            .output()
            .unwrap()
    };
    let o = offline(&["set", "vm1", "weight=300"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(
        offline(&["set", "nosuchvm", "weight=3"]).status.code(),
        Some(2)
    );
    d.say(&[
        "modify",
        "vm1",
        "--auto",
        "sched=prt",
        "--",
        "--renderer",
        "none",
    ]);
    assert_eq!(
        def(&d),
        json!({"priority": 2, "weight": 300, "sched": "prt"})
    );

    d.say(&["start", "vm1"]);
    d.wait_children(&["vm1"]);
    refused(&d, &["forget", "vm1"], &["running"]);
    // Running: set changes the live parameters only; --both both; --config the definition.
    d.say(&["set", "vm1", "priority=5"]);
    assert_eq!(d.params("vm1")["priority"], 5);
    assert_eq!(def(&d)["priority"], 2);
    d.say(&["set", "--both", "vm1", "target_fps=30"]);
    assert_eq!(d.params("vm1")["target_fps"], 30.0);
    assert_eq!(def(&d)["target_fps"], 30.0);
    d.say(&["set", "--config", "vm1", "priority=4"]);
    assert_eq!(
        (
            d.params("vm1")["priority"].clone(),
            def(&d)["priority"].clone()
        ),
        (json!(5), json!(4))
    );
    // --both is checked whole before anything changes.
    refused(
        &d,
        &["set", "--both", "vm1", "weight=0"],
        &["weight must be at least 1"],
    );
    assert_eq!(
        (d.params("vm1")["weight"].clone(), def(&d)["weight"].clone()),
        (json!(300), json!(300))
    );
    let fair = policy("fair.toml", "policy = \"fair\"\n");
    d.say(&["set-policy", &fair]);
    let live = dir.join("etc/live.json");
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&live).unwrap()).unwrap();
    assert_eq!(saved["policy"]["policy"], "fair");
    assert_eq!(saved["params"]["vm1"]["priority"], 5);

    let _ = writeln!(std::io::stderr(), "--- vgpu-schedd restarts ---");
    d.restart();
    d.wait_children(&["vm1"]);
    // The live policy and parameters are back, not the definition's.
    assert_eq!(d.json(&["list"])["policy"]["policy"], "fair");
    assert_eq!(d.params("vm1")["priority"], 5);
    assert_eq!(d.params("vm1")["target_fps"], 30.0);
    d.say(&["list"]);

    // stop after undefine stops the device process.
    d.say(&["undefine", "vm1"]);
    d.say(&["stop", "vm1"]);
    d.wait_children(&[]);
    // Never connected and no longer defined: forget removes it for good, across a restart.
    d.say(&["forget", "vm1"]);
    assert!(listed(&d).is_empty());
    d.restart();
    assert!(listed(&d).is_empty());
    refused(&d, &["set", "vm1", "priority=1"], &["known: none"]);
}

/// `vgpuctl types` lists the types of the config dir with their free instances; `define
/// --type` copies a type into a definition (its memory reaching the device process as
/// vgpu-server's budget), gives it a UUID, and is refused once every instance is defined.
#[test]
fn a_type_defines_vgpus_up_to_its_capacity() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let types = dir.join("etc/types");
    std::fs::create_dir_all(&types).unwrap();
    let small = json!({
        "description": "half the GPU, 512 MiB",
        "params": {"weight": 512, "priority": 4},
        "server_args": ["--memory-mb", "512", "--renderer", "none"],
        "max_instances": 1
    });
    std::fs::write(types.join("small.json"), small.to_string()).unwrap();
    std::fs::write(types.join("broken.json"), b"{\"max_instances\": 0}").unwrap();
    let d = Schedd::start(dir);
    let table = d.say(&["types"]);
    assert!(
        table.contains("small") && table.contains("512 MiB") && table.contains("broken"),
        "{table}"
    );
    let free = |d: &Schedd| {
        let v = d.json(&["types"]);
        let small = v.as_array().unwrap().iter().find(|t| t["name"] == "small");
        small.unwrap()["free"].as_u64().unwrap()
    };
    assert_eq!(free(&d), 1);
    let sock = |n: &str| dir.join(format!("{n}.sock")).display().to_string();
    let (s1, s2) = (sock("vm1"), sock("vm2"));
    let out = d.say(&["define", "vm1", "--type", "small", "--socket", &s1]);
    assert!(
        out.contains("type: small") && out.contains("uuid: "),
        "{out}"
    );
    assert_eq!(free(&d), 0);
    refused(
        &d,
        &["define", "vm2", "--type", "small", "--socket", &s2],
        &["small", "no free instance"],
    );
    refused(
        &d,
        &["define", "vm2", "--type", "large", "--socket", &s2],
        &["no vGPU type large"],
    );
    let listed = d.json(&["list", "--defined"]);
    let vm1 = &listed.as_array().unwrap()[0]["definition"];
    assert_eq!(vm1["type"], "small");
    assert_eq!(vm1["params"]["weight"], 512);
    let uuid = vm1["uuid"].as_str().unwrap().to_owned();
    // The identity stays through a change.
    d.say(&["modify", "vm1", "priority=6"]);
    let listed = d.json(&["list", "--defined"]);
    assert_eq!(listed[0]["definition"]["uuid"], uuid.as_str());
    // Started, the device process gets the type's memory as its budget.
    d.say(&["start", "vm1"]);
    d.wait_children(&["vm1"]);
    let pid = d.json(&["list"])["children"][0]["pid"].as_u64().unwrap();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    assert!(
        args.windows(2)
            .any(|w| w == [&b"--resource-memory-mb"[..], &b"512"[..]]),
        "{:?}",
        String::from_utf8_lossy(&cmdline)
    );
    assert_eq!(d.params("vm1")["weight"], 512);
    d.say(&["stop", "vm1"]);
    d.wait_children(&[]);
    // Undefined, its instance is free again.
    d.say(&["undefine", "vm1"]);
    assert_eq!(free(&d), 1);
}
