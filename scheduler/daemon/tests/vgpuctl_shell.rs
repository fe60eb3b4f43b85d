//! vgpuctl as a shell sees it, with the real binaries: the completion scripts it generates,
//! run by bash, zsh and fish against a real `vgpu-schedd`, offer the VMs the daemon knows, the
//! definitions and the vGPU types where a command takes one, nothing (and no error text) when
//! the daemon is gone, and the static completions everywhere else; the `--names` queries they
//! run print exactly those names. A caller the control socket refuses (EACCES, from vgpuctl
//! run as another user when the test runs as root) is told which socket, that permission was
//! denied and which group gives access, and exits 2 as for a daemon it cannot reach.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

const SCHEDD: &str = env!("CARGO_BIN_EXE_vgpu-schedd");
const VGPUCTL: &str = env!("CARGO_BIN_EXE_vgpuctl");
/// How long the daemon may take to start.
const WAIT: Duration = Duration::from_secs(20);
const POLL: Duration = Duration::from_millis(20);
/// The user and group a root test runs vgpuctl as (Debian's `nobody` and `nogroup`).
const NOBODY: u32 = 65534;

/// A `vgpu-schedd` on paths under a directory, killed by pid and reaped on drop.
struct Schedd {
    dir: PathBuf,
    child: Child,
}

impl Schedd {
    fn start(dir: &Path, control_group: Option<u32>) -> Schedd {
        let mut cmd = Command::new(SCHEDD);
        cmd.arg("--socket")
            .arg(dir.join("sched.sock"))
            .arg("--control")
            .arg(dir.join("control.sock"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--config-dir")
            .arg(dir.join("etc"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(gid) = control_group {
            cmd.arg("--control-group").arg(gid.to_string());
        }
        let mut child = cmd.spawn().unwrap();
        let start = Instant::now();
        while UnixStream::connect(dir.join("control.sock")).is_err() {
            assert!(child.try_wait().unwrap().is_none(), "the daemon exited");
            assert!(start.elapsed() < WAIT, "no control socket");
            std::thread::sleep(POLL);
        }
        Schedd {
            dir: dir.to_owned(),
            child,
        }
    }

    fn control(&self) -> PathBuf {
        self.dir.join("control.sock")
    }

    /// SIGKILL: the control socket stays behind, stale.
    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Schedd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `vgpuctl --control DIR/control.sock --config-dir DIR/etc ARGS`, which must succeed; its
/// stdout.
fn ctl(dir: &Path, args: &[&str]) -> String {
    let o = Command::new(VGPUCTL)
        .arg("--control")
        .arg(dir.join("control.sock"))
        .arg("--config-dir")
        .arg(dir.join("etc"))
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "vgpuctl {args:?}: {o:?}");
    String::from_utf8(o.stdout).unwrap()
}

/// The completion script vgpuctl generates for `shell`, written to `path`.
fn script(shell: &str, path: &Path) {
    let o = Command::new(VGPUCTL)
        .args(["--completions", shell])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    std::fs::write(path, o.stdout).unwrap();
}

/// A shell's run: what it offered, one per line, and its stderr.
#[derive(Debug)]
struct Offered {
    values: Vec<String>,
    stderr: String,
}

fn offered(o: Output) -> Offered {
    assert!(o.status.success(), "{o:?}");
    Offered {
        values: String::from_utf8(o.stdout)
            .unwrap()
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect(),
        stderr: String::from_utf8(o.stderr).unwrap(),
    }
}

/// A shell program, failing with the Debian package that has it when it is missing.
fn shell(program: &str) -> Command {
    let found = Command::new(program)
        .args(["-c", "exit 0"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "no {program}: install Debian's `{program}` package (apt-get install {program})"
    );
    Command::new(program)
}

/// bash completing `words` (the last the word under the cursor) as it does on TAB: the
/// generated script sourced, COMP_WORDS and COMP_CWORD set, the function the script
/// registered for vgpuctl called; in `cwd` (empty, so a fallback to file names adds none).
fn bash(script: &Path, cwd: &Path, words: &[&str]) -> Offered {
    const DRIVER: &str = r#"
source "$1"; shift
spec=$(complete -p vgpuctl)
f=${spec##*-F }; f=${f%% *}
COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1))
COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}
"$f" "${COMP_WORDS[0]}" "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}"
"#;
    offered(
        shell("bash")
            .args(["--norc", "--noprofile", "-c", DRIVER, "bash"])
            .arg(script)
            .arg(VGPUCTL)
            .args(words)
            .current_dir(cwd)
            .output()
            .unwrap(),
    )
}

/// zsh running the generated script's `_vgpuctl` with the completion system's `words`,
/// `CURRENT` and `PREFIX` set, `compadd` recording what it is given (outside an interactive
/// shell there is no completion widget).
fn zsh(script: &Path, words: &[&str]) -> Offered {
    const DRIVER: &str = r#"
compdef() { :; }
compadd() { [[ $1 == -a ]] && print -l -- "${(@P)2}"; }
source "$1"; shift
# The static completions need a completion widget: a stand-in says they were called.
_vgpuctl_static() { print -- static; }
words=("$@"); CURRENT=$#; PREFIX=${words[CURRENT]}
_vgpuctl
"#;
    offered(
        shell("zsh")
            .args(["-f", "-c", DRIVER, "zsh"])
            .arg(script)
            .arg(VGPUCTL)
            .args(words)
            .output()
            .unwrap(),
    )
}

/// fish completing `line` (`complete -C`, what it does on TAB) with the generated script.
fn fish(script: &Path, cwd: &Path, line: &str) -> Offered {
    offered(
        shell("fish")
            .args(["--no-config", "-c"])
            .arg(format!(
                "source {}; complete -C '{VGPUCTL} {line}'",
                script.display()
            ))
            .current_dir(cwd)
            .output()
            .unwrap(),
    )
}

/// Defines vm1 (of type small) and vm2 and lets the daemon keep parameters for guest1; types
/// small, big and a broken one.
fn populate(dir: &Path) {
    let types = dir.join("etc/types");
    std::fs::create_dir_all(&types).unwrap();
    std::fs::write(
        types.join("small.json"),
        r#"{"max_instances": 2, "server_args": ["--memory-mb", "512"]}"#,
    )
    .unwrap();
    std::fs::write(types.join("big.json"), r#"{"max_instances": 1}"#).unwrap();
    std::fs::write(types.join("broken.json"), r#"{"max_instances": 0}"#).unwrap();
    let sock = |n: &str| dir.join(format!("{n}.sock")).display().to_string();
    ctl(
        dir,
        &["define", "vm1", "--type", "small", "--socket", &sock("vm1")],
    );
    ctl(dir, &["define", "vm2", "--socket", &sock("vm2")]);
    ctl(dir, &["set", "--live", "--add", "guest1", "priority=2"]);
}

#[test]
fn completions_offer_the_daemon_s_vms_the_definitions_and_the_types() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let mut daemon = Schedd::start(dir, None);
    populate(dir);

    // The queries the scripts run: exactly the names, sorted, one per line.
    assert_eq!(ctl(dir, &["list", "--names"]), "guest1\n");
    assert_eq!(ctl(dir, &["list", "--defined", "--names"]), "vm1\nvm2\n");
    assert_eq!(ctl(dir, &["types", "--names"]), "big\nsmall\n");
    let json: Value = serde_json::from_str(&ctl(dir, &["--json", "types", "--names"])).unwrap();
    assert_eq!(json, serde_json::json!(["big", "small"]));

    let bash_script = dir.join("vgpuctl.bash");
    script("bash", &bash_script);
    let cwd = dir.join("empty");
    std::fs::create_dir(&cwd).unwrap();
    let control = daemon.control().display().to_string();
    let etc = dir.join("etc").display().to_string();
    let complete = |words: &[&str]| {
        let mut line = vec!["--control", &control, "--config-dir", &etc];
        line.extend(words);
        let o = bash(&bash_script, &cwd, &line);
        assert_eq!(o.stderr, "", "{words:?}");
        o.values
    };
    let (live, defined, both) = (
        vec!["guest1"],
        vec!["vm1", "vm2"],
        vec!["guest1", "vm1", "vm2"],
    );
    for (words, want) in [
        (&["show", ""][..], &live),
        (&["top", ""], &live),
        (&["top", "--count", "2", "g"], &live),
        (&["forget", ""], &live),
        (&["focus", ""], &live),
        (&["stop", ""], &live),
        (&["destroy", ""], &live),
        (&["set", ""], &both),
        (&["set", "--live", ""], &both),
        (&["set", "v"], &defined),
        (&["start", ""], &defined),
        (&["modify", ""], &defined),
        (&["undefine", "v"], &defined),
    ] {
        assert_eq!(complete(words), *want, "{words:?}");
    }
    assert_eq!(complete(&["define", "vm3", "--type", ""]), ["big", "small"]);
    assert_eq!(complete(&["define", "--type", "s"]), ["small"]);
    assert!(complete(&["show", "x"]).is_empty());
    // bash splits `--control=PATH` at `=`: the path still reaches the query.
    let split = bash(
        &bash_script,
        &cwd,
        &["--control", "=", &control, "show", ""],
    );
    assert_eq!(split.values, live);
    assert_eq!(split.stderr, "");

    // Elsewhere the static completions: options, subcommands, no names.
    let names = ["guest1", "vm1", "vm2", "big", "small"];
    let no_names = |words: &[&str]| {
        let got = complete(words);
        assert!(
            !got.iter().any(|v| names.contains(&v.as_str())),
            "{words:?}: {got:?}"
        );
        got
    };
    assert!(no_names(&["show", "-"]).contains(&"--watch".to_owned()));
    assert!(no_names(&["sh"]).contains(&"show".to_owned()));
    assert!(no_names(&["create", ""]).contains(&"--socket".to_owned()));
    no_names(&["define", ""]);
    no_names(&["define", "vm3", ""]);
    no_names(&["define", "vm3", "--socket", ""]);
    no_names(&["show", "guest1", ""]);
    no_names(&["show", "--watch", ""]);
    no_names(&["set", "vm1", ""]);
    no_names(&["define", "vm3", "--", ""]);

    // zsh and fish ask the same way.
    let zsh_script = dir.join("_vgpuctl");
    script("zsh", &zsh_script);
    let zsh_complete = |words: &[&str]| {
        let mut line = vec!["--control", &control, "--config-dir", &etc];
        line.extend(words);
        let o = zsh(&zsh_script, &line);
        assert_eq!(o.stderr, "", "{words:?}");
        o.values
    };
    assert_eq!(zsh_complete(&["set", "v"]), defined);
    assert_eq!(zsh_complete(&["show", ""]), live);
    assert_eq!(
        zsh_complete(&["define", "x", "--type", ""]),
        ["big", "small"]
    );
    assert_eq!(zsh_complete(&["show", "-"]), ["static"]);
    let fish_script = dir.join("vgpuctl.fish");
    script("fish", &fish_script);
    let fish_complete = |line: &str| {
        let o = fish(
            &fish_script,
            &cwd,
            &format!("--control {control} --config-dir {etc} {line}"),
        );
        assert_eq!(o.stderr, "", "{line}");
        o.values
    };
    assert_eq!(fish_complete("set "), both);
    assert_eq!(fish_complete("define x --type "), ["big", "small"]);
    assert!(fish_complete("show --wa")[0].starts_with("--watch"));

    // A daemon gone (its socket stale): nothing for what it knows, silently; the
    // definitions and types are still there.
    daemon.kill();
    assert!(complete(&["show", ""]).is_empty());
    assert!(complete(&["stop", ""]).is_empty());
    assert_eq!(complete(&["set", ""]), defined);
    assert_eq!(complete(&["start", ""]), defined);
    assert_eq!(complete(&["define", "x", "--type", ""]), ["big", "small"]);
    assert!(zsh_complete(&["show", ""]).is_empty());
    assert!(fish_complete("show ").is_empty());
    // No socket at all.
    std::fs::remove_file(daemon.control()).unwrap();
    assert!(complete(&["top", ""]).is_empty());
}

/// The effective uid of this process: the owner of a file it creates.
fn euid(dir: &Path) -> u32 {
    let probe = dir.join("probe");
    std::fs::write(&probe, b"").unwrap();
    std::fs::metadata(&probe).unwrap().uid()
}

/// A group of /etc/group that is neither root's nor `nobody`'s: its name and id.
fn other_group() -> (String, u32) {
    let groups = std::fs::read_to_string("/etc/group").unwrap();
    groups
        .lines()
        .find_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            let gid: u32 = fields.nth(1)?.parse().ok()?;
            (gid != 0 && gid != NOBODY).then(|| (name.to_owned(), gid))
        })
        .expect("a group in /etc/group besides root and nogroup")
}

#[test]
fn a_caller_the_control_socket_refuses_is_told_which_group_gives_access() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let root = euid(dir) == 0;
    let (group, gid) = other_group();
    // As root: the socket is the daemon's with a control group (0660 root:GROUP) and vgpuctl
    // runs as nobody, from a copy any user may run, in a directory any user may enter. As
    // another user (whom the socket's mode binds too): a socket made 0000.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let daemon = Schedd::start(dir, root.then_some(gid));
    let control = daemon.control();
    let vgpuctl = dir.join("vgpuctl");
    std::fs::copy(VGPUCTL, &vgpuctl).unwrap();
    std::fs::set_permissions(&vgpuctl, std::fs::Permissions::from_mode(0o755)).unwrap();
    if !root {
        std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o000)).unwrap();
    }
    let run = |args: &[&str]| {
        let mut cmd = Command::new(&vgpuctl);
        cmd.arg("--control").arg(&control).args(args);
        if root {
            cmd.uid(NOBODY).gid(NOBODY);
        }
        cmd.output().unwrap()
    };
    let o = run(&["list"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let shown = control.display();
    let expected = if root {
        format!(
            "vgpuctl: no vgpu-schedd answers at {shown} (permission denied): only its owner \
             (uid 0) and group {group} may use it (mode 0660): add this user to group {group} \
             (usermod -aG {group} $USER, then log in again) or run as root\n"
        )
    } else {
        format!(
            "vgpuctl: no vgpu-schedd answers at {shown} (permission denied): only its owner \
             (uid {}) may use it (mode 0000): run as that user or as root, or have the daemon \
             share it with a group (vgpu-schedd --control-group vgpu)\n",
            euid(dir)
        )
    };
    assert_eq!(stderr, expected);
    // With --json the same reason on stdout, for scripts.
    let o = run(&["--json", "show"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["exit"], 2);
    assert!(
        v["error"].as_str().unwrap().contains("(permission denied)"),
        "{v}"
    );
    // A completion as that caller offers nothing and says nothing.
    let o = run_complete(&vgpuctl, &control, root);
    assert!(o.status.success(), "{o:?}");
    assert!(o.stdout.is_empty() && o.stderr.is_empty(), "{o:?}");
}

/// `vgpuctl __complete --control CONTROL show ""`, as a completion script asks it (as nobody
/// with `as_nobody`).
fn run_complete(vgpuctl: &Path, control: &Path, as_nobody: bool) -> Output {
    let mut cmd = Command::new(vgpuctl);
    cmd.arg("__complete")
        .arg("--control")
        .arg(control)
        .args(["show", ""]);
    if as_nobody {
        cmd.uid(NOBODY).gid(NOBODY);
    }
    cmd.output().unwrap()
}

#[test]
fn a_hung_daemon_offers_nothing() {
    // A socket nobody accepts on: the query is killed at its bound, nothing is offered.
    let tmp = TempDir::new().unwrap();
    let control = tmp.path().join("control.sock");
    let _listener = UnixListener::bind(&control).unwrap();
    let o = run_complete(Path::new(VGPUCTL), &control, false);
    assert!(o.status.success(), "{o:?}");
    assert!(o.stdout.is_empty() && o.stderr.is_empty(), "{o:?}");
}
