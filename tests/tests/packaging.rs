//! The deployment files under `packaging/` (docs/DEPLOY.md), checked with the tools that
//! consume them:
//!
//! - `packaging/install.sh` into a temporary destdir with the workspace's binaries: the whole
//!   tree (binaries, completions and man pages each binary generates, units with the
//!   prefix's paths, the /etc/vgpu skeleton, the libvirt recipe, the monitoring kit), a
//!   manifest listing exactly that tree, a second run changing nothing, another prefix
//!   rewriting the units, an operator's edit kept, and `--uninstall` leaving nothing else
//!   behind;
//! - the installed units with `systemd-analyze verify --root=` on that tree (any message
//!   fails), every flag of their command lines against the binary's `--help`, and
//!   `systemd-analyze security` exposure no higher than docs/DEPLOY.md states;
//! - the units' `SystemCallFilter=` against what the daemon and a device process really call
//!   (`strace -f` through start-up, a scheduled virgl 3D session from a qtest guest, a
//!   control request and shutdown), and the device unit's `ProcSubset=pid` and
//!   `ProtectProc=invisible` against the `/proc` files it opens;
//! - the libvirt domain with `virt-xml-validate` (and a broken copy refused), its device
//!   argument against the unit's socket, the example definition as the daemon reads it;
//! - `packaging/guest-deb.sh`: the guest package (`vgpu-guest-cuda`) built from the workspace's
//!   `libcuda.so` and `vgpu-smi-guest`: its files, modes and owner, its `Depends` against the glibc
//!   floor `objdump -T` measures of the unpacked files, and the unpacked tool run.
//!
//! The tools come from Debian packages that qemu-scripts/test.sh installs; a missing one fails
//! the test, naming its package.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use vgpu_guest_drivers::virtio_gpu::{self, ResourceCreate3d, Transfer3d};
use vgpu_schedd::definitions::Definition;
use vgpu_tests::TempDir;
use vgpu_tests::daemon::workspace_binary;
use vgpu_tests::guest::ServerProcess;
use vgpu_tests::server::VgpuGuest;
use vgpu_tests::skip_without_qemu;

/// The binaries the install script installs (its `BINARIES`).
const BINARIES: &[&str] = &[
    "vgpu-server",
    "vgpu-schedd",
    "vgpuctl",
    "vgpu-smi",
    "vgpu-sim",
    "vgpu-cuda-host",
];
/// The units, as files in packaging/systemd and as installed.
const DAEMON_UNIT: &str = "vgpu-schedd.service";
const SERVER_UNIT: &str = "vgpu-server@.service";
/// The template's instance the checks use (a VM name).
const INSTANCE: &str = "vm1";
/// The exposure `systemd-analyze security` gives each unit (docs/DEPLOY.md): a change that
/// weakens a unit fails here until the document says why.
const MAX_DAEMON_EXPOSURE: f64 = 2.8;
const MAX_SERVER_EXPOSURE: f64 = 0.7;
/// Longest wait for a process of the system call test to start or stop.
const TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(50);
/// VIRGL_FORMAT_B8G8R8A8_UNORM, PIPE_TEXTURE_2D, bind render target | sampler view.
const BGRA: u32 = 1;
const BIND: u32 = 0x2 | 0x8;
const RESP_OK_NODATA: u32 = 0x1100;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn packaging(rel: &str) -> PathBuf {
    workspace().join("packaging").join(rel)
}

/// The path of tool `name`, or a failure naming the Debian package that has it.
fn tool(name: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .unwrap_or_else(|| {
            panic!("{name} not found: install Debian package {package} (qemu-scripts/test.sh does)")
        })
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The directory holding the workspace's binaries, all of them fresh (built by
/// `workspace_binary`, `vgpu-sim` by the workspace build that qemu-scripts/test.sh runs first).
fn bin_dir() -> PathBuf {
    let server = workspace_binary("vgpu-server").expect("vgpu-server binary");
    let dir = server.parent().expect("binary directory").to_path_buf();
    for b in BINARIES {
        assert!(
            dir.join(b).is_file(),
            "{} missing: cargo build --workspace --bins first",
            dir.join(b).display()
        );
    }
    dir
}

/// Runs packaging/install.sh with `args`, asserting it succeeds; returns what it printed.
fn install(args: &[&str]) -> String {
    let output = Command::new(packaging("install.sh"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running install.sh");
    let out = text(&output);
    assert!(
        output.status.success(),
        "install.sh {args:?} failed:\n{out}"
    );
    out
}

fn install_into(destdir: &Path, bins: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "--destdir".to_string(),
        destdir.display().to_string(),
        format!("--bin-dir={}", bins.display()),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    install(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Every path under `root`, relative, directories included.
fn tree(root: &Path) -> BTreeSet<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<PathBuf>) {
        for entry in fs::read_dir(dir).expect("read_dir") {
            let path = entry.expect("entry").path();
            out.insert(path.strip_prefix(root).expect("under root").to_path_buf());
            if path.symlink_metadata().expect("metadata").is_dir() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, root, &mut out);
    out
}

/// The install manifest under `destdir` for `prefix`: kind and path of each line (paths
/// relative, as in [`tree`]).
fn manifest(destdir: &Path, prefix: &str) -> Vec<(String, PathBuf)> {
    let path = destdir.join(format!("{}/share/vgpu/install-manifest", &prefix[1..]));
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            assert_eq!(fields.len(), 3, "manifest line {line:?}");
            let rel = fields[2].strip_prefix('/').expect("absolute path");
            (fields[0].to_string(), PathBuf::from(rel))
        })
        .collect()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The unit's logical lines (continuations joined) of `key=`, values only.
fn unit_values(unit: &str, key: &str) -> Vec<String> {
    let joined = unit.replace("\\\n", " ");
    joined
        .lines()
        .filter_map(|l| l.trim().strip_prefix(key)?.strip_prefix('='))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}

/// The command paths of a unit's `Exec*=` lines (without systemd's `+-@!:` prefixes).
fn exec_commands(unit: &str) -> Vec<String> {
    [
        "ExecStartPre",
        "ExecStart",
        "ExecStartPost",
        "ExecStop",
        "ExecReload",
    ]
    .iter()
    .flat_map(|key| unit_values(unit, key))
    .filter_map(|v| {
        let first = v.split_whitespace().next()?;
        Some(
            first
                .trim_start_matches(['+', '-', '@', '!', ':'])
                .to_string(),
        )
    })
    .collect()
}

#[test]
fn install_tree_is_complete_idempotent_and_uninstalls_to_nothing() {
    let bins = bin_dir();
    let dest = TempDir::new("vgpu-install").expect("temp dir");
    let d = dest.path();
    // Paths the units could not carry as they are are refused before anything is done.
    for prefix in ["usr/local", "/opt/a b", "/opt/a#b"] {
        let refused = Command::new(packaging("install.sh"))
            .arg("--destdir")
            .arg(d)
            .arg(format!("--prefix={prefix}"))
            .output()
            .expect("install.sh");
        assert_eq!(refused.status.code(), Some(2), "--prefix {prefix:?}");
    }
    assert!(tree(d).is_empty());
    install_into(d, &bins, &[]);

    for b in BINARIES {
        let installed = d.join("usr/local/bin").join(b);
        let meta = installed.metadata().expect("installed binary");
        assert_eq!(meta.permissions().mode() & 0o777, 0o755, "{b}");
        let version = Command::new(&installed)
            .arg("--version")
            .output()
            .expect("--version");
        assert!(
            version.status.success() && String::from_utf8_lossy(&version.stdout).starts_with(b),
            "{b} --version: {}",
            text(&version)
        );
        let bash = read(
            &d.join("usr/local/share/bash-completion/completions")
                .join(b),
        );
        assert!(
            bash.contains("complete") && bash.contains(b),
            "{b} bash:\n{bash}"
        );
        let zsh = read(&d.join(format!("usr/local/share/zsh/site-functions/_{b}")));
        assert!(zsh.starts_with(&format!("#compdef {b}")), "{b} zsh:\n{zsh}");
        let fish = read(&d.join(format!(
            "usr/local/share/fish/vendor_completions.d/{b}.fish"
        )));
        assert!(
            fish.contains(&format!("complete -c {b}")),
            "{b} fish:\n{fish}"
        );
        let man = read(&d.join(format!("usr/local/share/man/man1/{b}.1")));
        assert!(man.contains(&format!(".TH {b} 1")), "{b} man page:\n{man}");
        assert!(man.contains(".SH EXAMPLES"), "{b} man page:\n{man}");
    }
    // Every page a page names is there: vgpuctl's lists one per subcommand.
    let man1 = d.join("usr/local/share/man/man1");
    for sub in ["set", "define", "types", "show"] {
        let page = read(&man1.join(format!("vgpuctl-{sub}.1")));
        assert!(page.contains(&format!(".TH vgpuctl-{sub} 1")), "{page}");
    }
    for unit in [DAEMON_UNIT, SERVER_UNIT] {
        let installed = read(&d.join("usr/local/lib/systemd/system").join(unit));
        assert_eq!(installed, read(&packaging(&format!("systemd/{unit}"))));
    }
    for file in [
        "etc/vgpu/schedd.env",
        "etc/vgpu/server/vm.env.example",
        "etc/vgpu/examples/vm1.json",
        "usr/local/share/vgpu/libvirt/vgpu-domain.xml",
        "usr/local/share/vgpu/libvirt/qemu-hook",
    ] {
        assert!(d.join(file).is_file(), "{file} not installed");
    }
    // The monitoring kit, as it is in packaging/monitoring (checked by the daemon's
    // tests/monitoring.rs).
    for file in [
        "vgpu-dashboard.json",
        "vgpu-alerts.yml",
        "vgpu-alerts.test.yml",
    ] {
        let installed = d.join("usr/local/share/vgpu/monitoring").join(file);
        assert_eq!(
            read(&installed),
            read(&packaging(&format!("monitoring/{file}"))),
            "{file}"
        );
    }
    assert!(d.join("etc/vgpu/vgpus").is_dir());

    // The manifest lists exactly the tree (the manifest itself aside).
    let installed = tree(d);
    let listed: BTreeSet<PathBuf> = manifest(d, "/usr/local")
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let manifest_path = PathBuf::from("usr/local/share/vgpu/install-manifest");
    let unlisted: Vec<_> = installed
        .iter()
        .filter(|p| !listed.contains(*p) && **p != manifest_path)
        .collect();
    assert!(
        unlisted.is_empty(),
        "installed but not in the manifest: {unlisted:?}"
    );
    let missing: Vec<_> = listed.difference(&installed).collect();
    assert!(
        missing.is_empty(),
        "in the manifest but not installed: {missing:?}"
    );

    // Idempotent: a second run leaves the same tree and manifest.
    let before = manifest(d, "/usr/local");
    install_into(d, &bins, &[]);
    assert_eq!(tree(d), installed);
    assert_eq!(manifest(d, "/usr/local"), before);

    install_into(d, &bins, &["--uninstall"]);
    let left = tree(d);
    assert!(left.is_empty(), "left after --uninstall: {left:?}");

    // Another prefix: the units run its binaries and read its configuration; an operator's
    // edit of a configuration file survives a reinstall and the uninstall.
    let other = TempDir::new("vgpu-install-opt").expect("temp dir");
    let o = other.path();
    let opt = ["--prefix", "/opt/vgpu", "--sysconfdir", "/etc/opt"];
    install_into(o, &bins, &opt);
    let unit = read(&o.join("opt/vgpu/lib/systemd/system").join(DAEMON_UNIT));
    let exec = &unit_values(&unit, "ExecStart")[0];
    assert!(exec.starts_with("/opt/vgpu/bin/vgpu-schedd "), "{exec}");
    assert!(unit.contains("EnvironmentFile=-/etc/opt/vgpu/schedd.env"));
    let settings: Vec<&str> = unit.lines().filter(|l| !l.starts_with('#')).collect();
    assert!(
        settings
            .iter()
            .all(|l| !l.contains("/usr/local/") && !l.contains("/etc/vgpu")),
        "paths of the default prefix left:\n{unit}"
    );
    let env = o.join("etc/opt/vgpu/schedd.env");
    let edited = format!("{}VGPU_SCHEDD_ARGS=--cpu-writeback\n", read(&env));
    fs::write(&env, &edited).expect("editing schedd.env");
    let out = install_into(o, &bins, &opt);
    assert!(out.contains("kept /etc/opt/vgpu/schedd.env"), "{out}");
    assert_eq!(read(&env), edited);
    install_into(o, &bins, &["--prefix=/opt/vgpu", "--uninstall"]);
    let left: Vec<_> = tree(o).into_iter().collect();
    assert_eq!(
        left,
        ["etc", "etc/opt", "etc/opt/vgpu", "etc/opt/vgpu/schedd.env"].map(PathBuf::from),
        "only the edited file (and its directories) stays"
    );
}

/// A root for `systemd-analyze --root=`: the install tree plus, copied from this host, the
/// system's own units (sysinit.target and the rest the units' dependencies resolve to) and
/// the helper commands the units run besides ours.
fn verify_root(bins: &Path) -> TempDir {
    let root = TempDir::new("vgpu-units-root").expect("temp dir");
    let r = root.path();
    install_into(r, bins, &[]);
    let system = Path::new("/usr/lib/systemd/system");
    fs::create_dir_all(r.join("usr/lib/systemd")).expect("mkdir");
    let copied = Command::new("cp")
        .arg("-a")
        .arg(system)
        .arg(r.join("usr/lib/systemd/"))
        .status()
        .expect("cp");
    assert!(copied.success(), "copying {}", system.display());
    for unit in [DAEMON_UNIT, SERVER_UNIT] {
        let text = read(&r.join("usr/local/lib/systemd/system").join(unit));
        for command in exec_commands(&text) {
            if command.starts_with("/usr/local/") {
                continue;
            }
            let target = r.join(&command[1..]);
            fs::create_dir_all(target.parent().expect("parent")).expect("mkdir");
            fs::copy(&command, &target).unwrap_or_else(|e| panic!("{command}: {e}"));
        }
    }
    root
}

/// The overall exposure `systemd-analyze security` gives `unit` in `root`.
fn exposure(analyze: &Path, root: &Path, unit: &str) -> f64 {
    let output = Command::new(analyze)
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(format!("--root={}", root.display()))
        .arg(unit)
        .output()
        .expect("systemd-analyze security");
    let out = text(&output);
    let line = out
        .lines()
        .find(|l| l.contains("Overall exposure level for"))
        .unwrap_or_else(|| panic!("no overall exposure for {unit}:\n{out}"));
    let figure = line
        .rsplit(':')
        .next()
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("exposure line {line:?}"));
    eprintln!("{line}");
    figure
}

#[test]
fn units_pass_systemd_analyze_verify_and_security() {
    let analyze = tool("systemd-analyze", "systemd");
    tool("man", "man-db");
    let bins = bin_dir();
    let root = verify_root(&bins);
    let r = root.path();
    let instance = format!("vgpu-server@{INSTANCE}.service");
    // Documentation=man: pages are looked up with man(1): the installed ones.
    let output = Command::new(&analyze)
        .args(["verify", "--no-pager"])
        .arg(format!("--root={}", r.display()))
        .args([DAEMON_UNIT, instance.as_str()])
        .env("MANPATH", r.join("usr/local/share/man"))
        .output()
        .expect("systemd-analyze verify");
    let out = text(&output);
    assert!(
        output.status.success() && out.trim().is_empty(),
        "systemd-analyze verify ({}):\n{out}",
        output.status
    );

    // Every option on the units' command lines is one the binary accepts.
    for unit in [DAEMON_UNIT, SERVER_UNIT] {
        let text = read(&r.join("usr/local/lib/systemd/system").join(unit));
        let exec = unit_values(&text, "ExecStart");
        assert_eq!(exec.len(), 1, "{unit}: one ExecStart");
        let mut words = exec[0].split_whitespace();
        let binary = words.next().expect("a command");
        let help = Command::new(r.join(&binary[1..]))
            .arg("--help")
            .output()
            .expect("--help");
        let help = String::from_utf8_lossy(&help.stdout).into_owned();
        for flag in words.filter(|w| w.starts_with("--")) {
            assert!(
                help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
                "{unit}: {binary} does not document {flag}:\n{help}"
            );
        }
    }

    let daemon = exposure(&analyze, r, DAEMON_UNIT);
    let server = exposure(&analyze, r, &instance);
    assert!(
        daemon <= MAX_DAEMON_EXPOSURE,
        "{DAEMON_UNIT}: exposure {daemon} > {MAX_DAEMON_EXPOSURE}"
    );
    assert!(
        server <= MAX_SERVER_EXPOSURE,
        "{instance}: exposure {server} > {MAX_SERVER_EXPOSURE}"
    );
}

/// Expands systemd's system call filter entries (names and `@groups`) to system call names.
struct SyscallSets {
    analyze: PathBuf,
    groups: HashMap<String, BTreeSet<String>>,
}

impl SyscallSets {
    fn expand(&mut self, entry: &str) -> BTreeSet<String> {
        if !entry.starts_with('@') {
            return BTreeSet::from([entry.to_string()]);
        }
        if let Some(set) = self.groups.get(entry) {
            return set.clone();
        }
        let output = Command::new(&self.analyze)
            .args(["syscall-filter", "--no-pager", entry])
            .output()
            .expect("systemd-analyze syscall-filter");
        assert!(output.status.success(), "{entry}: {}", text(&output));
        let listing = String::from_utf8_lossy(&output.stdout).into_owned();
        let mut set = BTreeSet::new();
        // The first line names the group; then a comment and one member per line.
        for member in listing.lines().skip(1).map(str::trim) {
            if member.is_empty() || member.starts_with('#') {
                continue;
            }
            set.extend(self.expand(member));
        }
        assert!(!set.is_empty(), "{entry}: empty expansion:\n{listing}");
        self.groups.insert(entry.to_string(), set.clone());
        set
    }

    /// What a unit's `SystemCallFilter=` lines allow: the allow-list minus every `~` list.
    fn allowed(&mut self, unit: &str) -> BTreeSet<String> {
        let mut allow = BTreeSet::new();
        let mut deny = BTreeSet::new();
        for value in unit_values(unit, "SystemCallFilter") {
            let (target, list) = match value.strip_prefix('~') {
                Some(list) => (&mut deny, list.to_string()),
                None => (&mut allow, value),
            };
            for entry in list.split_whitespace() {
                target.extend(self.expand(entry));
            }
        }
        assert!(!allow.is_empty(), "no allow-list in the unit");
        allow.difference(&deny).cloned().collect()
    }
}

/// A process run under `strace -f`: the tracer's child, and its own pid for signals (strace
/// blocks fatal signals while it traces a command). Both are killed by pid on drop if still
/// running.
struct Traced {
    strace: Child,
    pid: i32,
    trace: PathBuf,
}

impl Traced {
    fn start(program: &Path, args: &[&str], trace: PathBuf, log: &Path) -> Traced {
        let log = fs::File::create(log).expect("log file");
        let mut strace = Command::new(tool("strace", "strace"))
            .args(["-f", "-qq", "-s", "256", "-o"])
            .arg(&trace)
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting strace");
        let children = format!("/proc/{0}/task/{0}/children", strace.id());
        let deadline = Instant::now() + TIMEOUT;
        let pid = loop {
            let found = fs::read_to_string(&children)
                .ok()
                .and_then(|t| t.split_whitespace().next()?.parse().ok());
            if let Some(pid) = found {
                break pid;
            }
            if Instant::now() > deadline || strace.try_wait().ok().flatten().is_some() {
                let _ = strace.kill();
                let _ = strace.wait();
                panic!("{} did not start under strace", program.display());
            }
            std::thread::sleep(POLL);
        };
        Traced { strace, pid, trace }
    }

    /// Sends SIGTERM and waits (bounded) for the tracer to finish.
    fn stop(&mut self) {
        // SAFETY: kill(2) takes no pointers; the pid is our tracer's child, not reaped by
        // the tracer until it has exited.
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        self.wait();
    }

    fn wait(&mut self) {
        let deadline = Instant::now() + TIMEOUT;
        while self.strace.try_wait().expect("strace status").is_none() {
            assert!(Instant::now() < deadline, "traced process did not exit");
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        if self.strace.try_wait().ok().flatten().is_none() {
            // SAFETY: kill(2) takes no pointers; the pid is the traced child, still there
            // while its tracer runs.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
            let _ = self.strace.kill();
            let _ = self.strace.wait();
        }
    }
}

/// What a `strace -f` trace shows: the system call names, the `/proc` paths opened and the
/// pids (threads included) that made them.
struct TraceSummary {
    calls: BTreeSet<String>,
    proc_paths: Vec<String>,
    pids: BTreeSet<String>,
}

fn summarize(trace: &Path) -> TraceSummary {
    let text = read(trace);
    let mut summary = TraceSummary {
        calls: BTreeSet::new(),
        proc_paths: Vec::new(),
        pids: BTreeSet::new(),
    };
    for line in text.lines() {
        let Some((pid, rest)) = line.split_once(' ') else {
            continue;
        };
        let rest = rest.trim_start();
        assert!(
            !rest.starts_with("+++ killed"),
            "traced process killed: {line}"
        );
        summary.pids.insert(pid.to_string());
        let call = rest.strip_prefix("<... ").unwrap_or(rest);
        let name: String = call
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() || !call[name.len()..].starts_with(['(', ' ']) {
            continue;
        }
        if let Some(path) = call
            .split_once("\"/proc/")
            .and_then(|(_, p)| p.split('"').next())
        {
            summary.proc_paths.push(format!("/proc/{path}"));
        }
        summary.calls.insert(name);
    }
    assert!(!summary.calls.is_empty(), "empty trace {}", trace.display());
    summary
}

/// A scheduled virgl session from a qtest guest: a context, a texture written from guest
/// memory and read back, fenced.
fn virgl_session(socket: &Path) {
    let mut guest = VgpuGuest::attach(socket, true);
    let Some(features) = guest.virgl_features() else {
        return;
    };
    guest.bring_up_with(features);
    let ok = |guest: &mut VgpuGuest, request: &[u8]| {
        assert_eq!(guest.control_header(request).ctrl_type, RESP_OK_NODATA);
    };
    ok(&mut guest, &virtio_gpu::ctx_create(1, 0, b"packaging"));
    let tex = ResourceCreate3d::texture_2d(10, BGRA, BIND, 64, 64);
    ok(&mut guest, &virtio_gpu::resource_create_3d(&tex));
    ok(&mut guest, &virtio_gpu::ctx_attach_resource(1, 10));
    let len = 64 * 64 * 4;
    let backing = guest.ram.alloc(len, 4096).expect("guest memory");
    ok(
        &mut guest,
        &virtio_gpu::resource_attach_backing(10, &[(backing, len as u32)]),
    );
    let whole = Transfer3d::whole_2d(10, 64, 64, 4);
    let upload = virtio_gpu::with_fence(virtio_gpu::transfer_to_host_3d(1, &whole), 1);
    ok(&mut guest, &upload);
    let download = virtio_gpu::with_fence(virtio_gpu::transfer_from_host_3d(1, &whole), 2);
    ok(&mut guest, &download);
}

#[test]
fn unit_system_call_filters_cover_what_the_daemon_and_a_device_call() {
    if skip_without_qemu() {
        return;
    }
    let mut sets = SyscallSets {
        analyze: tool("systemd-analyze", "systemd"),
        groups: HashMap::new(),
    };
    let dir = TempDir::new("vgpu-syscalls").expect("temp dir");
    let d = dir.path();
    let sched = d.join("sched.sock");
    let control = d.join("control.sock");
    let schedd = workspace_binary("vgpu-schedd").expect("vgpu-schedd");
    let args = [
        "--socket",
        sched.to_str().expect("utf-8"),
        "--control",
        control.to_str().expect("utf-8"),
        "--log-level",
        "info",
    ];
    let mut daemon = Traced::start(
        &schedd,
        &args,
        d.join("schedd.trace"),
        &d.join("schedd.log"),
    );
    let deadline = Instant::now() + TIMEOUT;
    while !(sched.exists() && control.exists()) {
        assert!(Instant::now() < deadline, "{}", read(&d.join("schedd.log")));
        std::thread::sleep(POLL);
    }

    // The device process as the unit starts it: scheduled, under its name, sandboxed.
    let wrapper = d.join("strace-server");
    fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec {} -f -qq -s 256 -o {} \"$@\"\n",
            tool("strace", "strace").display(),
            d.join("server.trace").display()
        ),
    )
    .expect("wrapper");
    fs::set_permissions(&wrapper, fs::Permissions::from_mode(0o755)).expect("chmod");
    let server_bin = workspace_binary("vgpu-server").expect("vgpu-server");
    let server_args = [
        "--scheduler".to_string(),
        sched.display().to_string(),
        "--vm-name".to_string(),
        INSTANCE.to_string(),
    ];
    let mut server = ServerProcess::start_via(Some(&wrapper), &server_bin, true, &server_args, &[])
        .expect("vgpu-server starts under strace");
    virgl_session(server.socket());
    // The guest has gone: the device process exits (--exit-on-disconnect) and so its tracer.
    assert!(
        server.wait_exit(TIMEOUT).expect("server status").is_some(),
        "the device process did not exit:\n{}",
        server.log()
    );
    let ctl = Command::new(workspace_binary("vgpuctl").expect("vgpuctl"))
        .arg("--control")
        .arg(&control)
        .arg("list")
        .output()
        .expect("vgpuctl");
    assert!(ctl.status.success(), "vgpuctl list: {}", text(&ctl));
    daemon.stop();

    let TraceSummary {
        calls: server_calls,
        proc_paths,
        pids: server_pids,
    } = summarize(&d.join("server.trace"));
    let TraceSummary {
        calls: daemon_calls,
        proc_paths: daemon_proc_paths,
        ..
    } = summarize(&daemon.trace);
    assert!(
        server.log().contains("sandbox: seccomp filter installed"),
        "{}",
        server.log()
    );

    let server_unit = read(&packaging(&format!("systemd/{SERVER_UNIT}")));
    let allowed = sets.allowed(&server_unit);
    let outside: Vec<_> = server_calls.difference(&allowed).collect();
    assert!(
        outside.is_empty(),
        "{SERVER_UNIT}'s SystemCallFilter refuses what the device process calls: {outside:?}"
    );
    // The daemon's children (vgpuctl create, definitions) run under the daemon's filter.
    let daemon_unit = read(&packaging(&format!("systemd/{DAEMON_UNIT}")));
    let allowed = sets.allowed(&daemon_unit);
    let outside: Vec<_> = daemon_calls
        .union(&server_calls)
        .filter(|c| !allowed.contains(*c))
        .collect();
    assert!(
        outside.is_empty(),
        "{DAEMON_UNIT}'s SystemCallFilter refuses what the daemon or its device processes call: {outside:?}"
    );

    // ProcSubset=pid (both units): only process directories; ProtectProc=invisible (the
    // device): only the process's own.
    assert!(server_unit.contains("ProcSubset=pid") && daemon_unit.contains("ProcSubset=pid"));
    assert!(server_unit.contains("ProtectProc=invisible"));
    let first = |p: &str| {
        p["/proc/".len()..]
            .split('/')
            .next()
            .unwrap_or_default()
            .to_string()
    };
    let process_dir = |p: &str| {
        let f = first(p);
        f == "self"
            || f == "thread-self"
            || (!f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()))
    };
    let hidden: Vec<_> = proc_paths
        .iter()
        .chain(&daemon_proc_paths)
        .filter(|p| !process_dir(p))
        .collect();
    assert!(
        hidden.is_empty(),
        "/proc files ProcSubset=pid hides: {hidden:?}"
    );
    let foreign: Vec<_> = proc_paths
        .iter()
        .filter(|p| {
            !(matches!(first(p).as_str(), "self" | "thread-self")
                || server_pids.contains(&first(p)))
        })
        .collect();
    assert!(
        foreign.is_empty(),
        "the device process opens other processes' /proc entries (ProtectProc=invisible): {foreign:?}"
    );
    eprintln!(
        "device process: {} distinct system calls, daemon: {}; /proc paths opened: device {:?}, daemon {:?}",
        server_calls.len(),
        daemon_calls.len(),
        proc_paths.iter().collect::<BTreeSet<_>>(),
        daemon_proc_paths.iter().collect::<BTreeSet<_>>()
    );
}

#[test]
fn the_libvirt_domain_validates_and_matches_the_unit() {
    let validate = tool("virt-xml-validate", "libvirt-clients");
    tool("xmllint", "libxml2-utils");
    let xml_path = packaging("libvirt/vgpu-domain.xml");
    let output = Command::new(&validate)
        .arg(&xml_path)
        .arg("domain")
        .output()
        .expect("virt-xml-validate");
    assert!(
        output.status.success(),
        "virt-xml-validate:\n{}",
        text(&output)
    );

    // The validator refuses a broken domain (it is not passing everything).
    let xml = read(&xml_path);
    let dir = TempDir::new("vgpu-libvirt").expect("temp dir");
    let broken = dir.path().join("broken.xml");
    fs::write(
        &broken,
        xml.replace("<access mode='shared'/>", "<access mode='everyone'/>"),
    )
    .expect("write");
    let output = Command::new(&validate)
        .arg(&broken)
        .arg("domain")
        .output()
        .expect("virt-xml-validate");
    assert!(!output.status.success(), "a broken domain validated");

    // The device argument is QEMU's JSON form of vfio-user-pci on the socket that
    // vgpu-server@vm1 listens on, and guest RAM is a shared memfd.
    let arg = xml
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("<qemu:arg value='")?
                .strip_suffix("'/>")
        })
        .find(|v| v.starts_with('{'))
        .expect("a -device JSON argument");
    let device: serde_json::Value = serde_json::from_str(arg).expect("JSON device");
    assert_eq!(device["driver"], "vfio-user-pci");
    assert_eq!(device["socket"]["type"], "unix");
    let unit = read(&packaging(&format!("systemd/{SERVER_UNIT}")));
    let exec = &unit_values(&unit, "ExecStart")[0];
    let socket = exec
        .split_whitespace()
        .skip_while(|w| *w != "--socket")
        .nth(1)
        .expect("--socket in ExecStart")
        .replace("%t", "/run")
        .replace("%i", INSTANCE);
    assert_eq!(device["socket"]["path"], socket.as_str());
    assert!(xml.contains("<source type='memfd'/>") && xml.contains("machine='q35'"));

    // The example definition is one the daemon and vgpuctl take.
    let example = read(&packaging("config/vm1.json"));
    let definition: Definition = serde_json::from_str(&example).expect("example definition");
    definition.check().expect("example definition checks");
    let values: BTreeMap<String, serde_json::Value> =
        serde_json::from_str(&example).expect("JSON object");
    assert_eq!(values["auto"], false, "the example must not start at boot");
}

/// Runs the libvirt hook as libvirt would, with a `systemctl` on `PATH` that records its
/// arguments; returns whether it succeeded and what `systemctl` was asked.
fn run_hook(dir: &Path, args: &[&str], domain_xml: &str) -> (bool, String) {
    let calls = dir.join("systemctl.calls");
    let _ = fs::remove_file(&calls);
    let fake = dir.join("systemctl");
    fs::write(
        &fake,
        format!("#!/bin/sh\necho \"$@\" >> {}\n", calls.display()),
    )
    .expect("fake systemctl");
    fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new(packaging("libvirt/qemu-hook"))
        .args(args)
        .env("PATH", path)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-hook");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(domain_xml.as_bytes())
            .expect("domain XML to the hook");
    }
    let ok = child.wait().expect("hook status").success();
    (ok, fs::read_to_string(&calls).unwrap_or_default())
}

#[test]
fn the_libvirt_hook_starts_the_device_unit_of_our_domains_only() {
    let dir = TempDir::new("vgpu-hook").expect("temp dir");
    let ours = read(&packaging("libvirt/vgpu-domain.xml"));
    let other = "<domain type='kvm'><name>plain</name></domain>";
    assert_eq!(
        run_hook(dir.path(), &["vm1", "prepare", "begin", "-"], &ours),
        (true, "start vgpu-server@vm1.service\n".to_string())
    );
    // Other domains, other moments of a domain's life: nothing to do.
    assert_eq!(
        run_hook(dir.path(), &["plain", "prepare", "begin", "-"], other),
        (true, String::new())
    );
    for (op, sub) in [("start", "begin"), ("release", "end"), ("stopped", "end")] {
        assert_eq!(
            run_hook(dir.path(), &["vm1", op, sub, "-"], &ours),
            (true, String::new()),
            "{op} {sub}"
        );
    }
    // A name that is not a plain unit instance refuses the domain's start.
    for name in ["../x", "a b", ".hidden", ""] {
        assert_eq!(
            run_hook(dir.path(), &[name, "prepare", "begin", "-"], &ours),
            (false, String::new()),
            "{name:?}"
        );
    }
}

/// glibc of Debian 13 (trixie), the guest the package is for: its floor may not be above it.
const TRIXIE_GLIBC: (u32, u32) = (2, 41);

/// The highest `GLIBC_x.y` symbol version `file` references (`objdump -T`).
fn glibc_floor(objdump: &Path, file: &Path) -> (u32, u32) {
    let out = Command::new(objdump)
        .arg("-T")
        .arg(file)
        .output()
        .expect("objdump");
    assert!(out.status.success(), "objdump -T {}", file.display());
    String::from_utf8_lossy(&out.stdout)
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let (major, minor) = v.split_once('.')?;
            Some((major.parse().ok()?, minor.split('.').next()?.parse().ok()?))
        })
        .max()
        .unwrap_or_else(|| panic!("no GLIBC versions in {}", file.display()))
}

#[test]
fn the_guest_package_holds_the_library_and_vgpu_smi_and_depends_on_their_glibc_floor() {
    let (dpkg_deb, dpkg) = (tool("dpkg-deb", "dpkg"), tool("dpkg", "dpkg"));
    let objdump = tool("objdump", "binutils");
    let lib = workspace_binary("libcuda.so").expect("libcuda.so of guest-drivers/libcuda");
    let bins = lib.parent().expect("binary directory");
    let dir = TempDir::new("guest-deb").expect("temp dir");
    let output = Command::new(packaging("guest-deb.sh"))
        .arg(format!("--bin-dir={}", bins.display()))
        .arg("--out")
        .arg(dir.path())
        .stdin(Stdio::null())
        .output()
        .expect("running guest-deb.sh");
    let said = text(&output);
    assert!(output.status.success(), "guest-deb.sh failed:\n{said}");
    let version = env!("CARGO_PKG_VERSION");
    let deb = dir
        .path()
        .join(format!("vgpu-guest-cuda_{version}_amd64.deb"));
    assert_eq!(said.lines().next(), Some(deb.to_str().unwrap()), "{said}");

    let contents = text(
        &Command::new(&dpkg_deb)
            .arg("-c")
            .arg(&deb)
            .output()
            .unwrap(),
    );
    let entries: BTreeMap<String, String> = contents
        .lines()
        .map(|l| {
            let path = l.split_whitespace().skip(5).collect::<Vec<_>>().join(" ");
            (path, l.split_whitespace().next().unwrap_or("").to_string())
        })
        .collect();
    for (path, mode) in [
        ("./usr/lib/x86_64-linux-gnu/libcuda.so.1", "-rw-r--r--"),
        (
            "./usr/lib/x86_64-linux-gnu/libcuda.so -> libcuda.so.1",
            "lrwxrwxrwx",
        ),
        ("./usr/bin/vgpu-smi", "-rwxr-xr-x"),
        ("./usr/share/doc/vgpu-guest-cuda/copyright", "-rw-r--r--"),
    ] {
        assert_eq!(
            entries.get(path).map(String::as_str),
            Some(mode),
            "{path} in\n{contents}"
        );
    }
    assert!(
        contents.lines().all(|l| l.contains(" root/root ")),
        "owned by root:\n{contents}"
    );

    // Unpacked as dpkg installs it: the floor it depends on is what its files need.
    let root = dir.path().join("root");
    let unpacked = Command::new(&dpkg).arg("-x").arg(&deb).arg(&root).output();
    assert!(unpacked.unwrap().status.success());
    let library = root.join("usr/lib/x86_64-linux-gnu/libcuda.so.1");
    let smi = root.join("usr/bin/vgpu-smi");
    let floor = glibc_floor(&objdump, &library).max(glibc_floor(&objdump, &smi));
    assert!(floor <= TRIXIE_GLIBC, "glibc {floor:?} is past trixie's");
    let field = |name: &str| {
        let out = Command::new(&dpkg_deb)
            .args(["-f"])
            .arg(&deb)
            .arg(name)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(field("Package"), "vgpu-guest-cuda");
    assert_eq!(field("Version"), version);
    assert_eq!(field("Architecture"), "amd64");
    assert_eq!(
        field("Depends"),
        format!("libc6 (>= {}.{})", floor.0, floor.1)
    );
    assert!(said.contains(&format!("glibc floor: {}.{}", floor.0, floor.1)));
    let info = text(
        &Command::new(&dpkg_deb)
            .arg("-I")
            .arg(&deb)
            .output()
            .unwrap(),
    );
    for member in ["control", "md5sums", "triggers"] {
        assert!(info.contains(&format!(" {member} ")), "{member} in\n{info}");
    }
    let soname = text(
        &Command::new(&objdump)
            .arg("-p")
            .arg(&library)
            .output()
            .unwrap(),
    );
    assert!(
        soname
            .lines()
            .any(|l| l.split_whitespace().eq(["SONAME", "libcuda.so.1"])),
        "{soname}"
    );
    assert!(read(&root.join("usr/share/doc/vgpu-guest-cuda/copyright")).contains("Apache-2.0"));

    // The unpacked tool runs: its help, and with no device (no vGPU here, a socket that is
    // not there) it says so and exits 1.
    let help = Command::new(&smi).arg("--help").output().unwrap();
    assert!(help.status.success() && text(&help).contains("Usage: vgpu-smi"));
    let none = Command::new(&smi)
        .env("VGPU_CUDA_SOCKET", dir.path().join("absent.sock"))
        .output()
        .unwrap();
    assert_eq!(none.status.code(), Some(1), "{}", text(&none));
    assert!(text(&none).contains("no device"));
}
