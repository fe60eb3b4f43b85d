//! The `vgpu-server` process sandbox seen from outside (docs/SECURITY.md, "Device process
//! sandbox"): its credentials, no_new_privs and seccomp state in `/proc/PID/status`, the
//! descriptors it keeps, and the `--run-as`/`--no-sandbox` options. The SIGSYS kill itself is
//! in `multi_guest` (`a_forbidden_syscall_kills_only_that_device_process`).

use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

use vgpu_tests::daemon::Schedd;
use vgpu_tests::guest::{ServerProcess, server_binary};
use vgpu_tests::server::VgpuGuest;
use vgpu_tests::skip_without_qemu;

/// Longest wait for the server's start-up log line or its exit.
const TIMEOUT: Duration = Duration::from_secs(10);
/// An unprivileged user and group that exist on every system (nobody/nogroup).
const NOBODY: u32 = 65534;
/// The start-up log line of the sandbox.
const SANDBOX_LINE: &str = "sandbox: seccomp filter";

/// Starts the server with `args`, waiting until it has entered its sandbox.
fn start(args: &[&str]) -> ServerProcess {
    let binary = server_binary().expect("vgpu-server binary");
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let server = ServerProcess::start(&binary, true, &args).expect("vgpu-server starts");
    assert!(
        server.wait_for_log(SANDBOX_LINE, TIMEOUT),
        "no sandbox line:\n{}",
        server.log()
    );
    server
}

/// The value of `field` in `/proc/PID/status`, whitespace-separated.
fn status(pid: u32, field: &str) -> Vec<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in\n{text}"));
    line.split_whitespace().map(str::to_string).collect()
}

/// Kills a device process the daemon created if the test fails before `destroy` (the daemon
/// itself is killed without stopping its children).
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(pid) = libc::pid_t::try_from(self.0)
            && std::thread::panicking()
        {
            // SAFETY: kill(2) takes no pointers; the pid is the daemon's child, not yet
            // reaped while the daemon lives (it is dropped after this guard).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn the_default_is_a_filter_and_no_new_privs() {
    let mut server = start(&[]);
    let pid = server.pid();
    assert_eq!(status(pid, "NoNewPrivs"), ["1"]);
    // 2: SECCOMP_MODE_FILTER, on every thread (the worker's included).
    assert_eq!(status(pid, "Seccomp"), ["2"]);
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks") {
        let tid = task.expect("task").file_name();
        let text = std::fs::read_to_string(format!("/proc/{pid}/task/{}/status", tid.display()))
            .expect("task status");
        assert!(text.contains("\nSeccomp:\t2\n"), "thread {tid:?}:\n{text}");
    }
    assert!(server.log().contains("seccomp filter installed"));
    server.kill().expect("killed");
}

#[test]
fn no_sandbox_installs_no_filter_and_warns() {
    let mut server = start(&["--no-sandbox"]);
    assert_eq!(status(server.pid(), "Seccomp"), ["0"]);
    assert_eq!(status(server.pid(), "NoNewPrivs"), ["1"]);
    assert!(server.log().contains("WARN"), "{}", server.log());
    assert!(server.log().contains("seccomp filter off"));
    server.kill().expect("killed");
}

#[test]
fn inherited_descriptors_are_closed() {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors; no O_CLOEXEC, so children inherit them.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: pipe(2) just returned these two descriptors, owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let ours = std::fs::read_link(format!("/proc/self/fd/{}", fds[1])).expect("pipe link");
    let mut server = start(&[]);
    let pid = server.pid();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fds") {
        let link = std::fs::read_link(fd.expect("fd").path()).unwrap_or_default();
        assert_ne!(link, ours, "the server kept the inherited pipe");
    }
    let log = server.log();
    let line = log
        .lines()
        .find(|l| l.contains(SANDBOX_LINE))
        .expect("sandbox line");
    let closed: usize = line
        .split(", ")
        .find_map(|part| part.strip_suffix(" inherited fds closed"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count of closed fds:\n{line}"));
    assert!(closed >= 2, "{closed} closed:\n{line}");
    server.kill().expect("killed");
    drop((read, write));
}

#[test]
fn run_as_root_or_junk_is_refused() {
    let binary = server_binary().expect("vgpu-server binary");
    for bad in ["0:0", "1000", "x:y"] {
        let out = std::process::Command::new(&binary)
            .args(["--socket", "/nonexistent/vgpu.sock", "--run-as", bad])
            .output()
            .expect("runs");
        assert_eq!(out.status.code(), Some(2), "--run-as {bad}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--run-as"));
    }
}

#[test]
fn run_as_drops_root_for_good_and_keeps_serving() {
    if !is_root() {
        eprintln!("SKIPPED: dropping to another user needs root");
        return;
    }
    if skip_without_qemu() {
        return;
    }
    let id = NOBODY.to_string();
    let mut server = start(&["--run-as", &format!("{NOBODY}:{NOBODY}")]);
    let pid = server.pid();
    // Real, effective, saved and file-system ids: none is left at 0 to return to.
    assert_eq!(status(pid, "Uid"), [id.as_str(); 4]);
    assert_eq!(status(pid, "Gid"), [id.as_str(); 4]);
    assert!(status(pid, "Groups").is_empty());
    assert!(server.log().contains(&format!("uid {NOBODY} gid {NOBODY}")));
    // The socket was bound before the drop: a guest still gets a working device.
    let mut guest = VgpuGuest::attach(server.socket(), true);
    guest.bring_up();
    let info = guest.display_info(None);
    assert!(info.pmodes[0].enabled != 0, "{info:?}");
    drop(guest);
    let exit = server.wait_exit(TIMEOUT).expect("server state");
    assert!(
        exit.is_some_and(|s| s.success()),
        "{exit:?} after its client:\n{}",
        server.log()
    );
}

#[test]
fn run_as_another_user_without_root_is_an_error() {
    if is_root() {
        eprintln!("SKIPPED: needs a user other than root");
        return;
    }
    let binary = server_binary().expect("vgpu-server binary");
    let dir = vgpu_tests::TempDir::new("vgpu-sandbox").expect("temp dir");
    let out = std::process::Command::new(&binary)
        .arg("--socket")
        .arg(dir.path().join("vgpu.sock"))
        .args(["--renderer", "none", "--run-as", "65534:65534"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs root"));
}

/// A device process the daemon creates with `--device-uid-base`/`--device-gid` runs as its
/// own user, serves its guest and still reaches the daemon (QEMU's connection found among its
/// own descriptors, Hello accepted).
#[test]
fn created_device_runs_as_its_own_user_and_reaches_the_daemon() {
    use std::os::unix::fs::PermissionsExt;

    if !is_root() {
        eprintln!("SKIPPED: running device processes as other users needs root");
        return;
    }
    if skip_without_qemu() {
        return;
    }
    let daemon = Schedd::start_with(
        None,
        "debug",
        &["--device-uid-base", "70000", "--device-gid", "70100"],
    )
    .expect("daemon");
    // The device user must be able to reach the daemon's socket by its path.
    let sched_dir = daemon.socket().parent().expect("socket dir").to_owned();
    std::fs::set_permissions(&sched_dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    let dir = vgpu_tests::TempDir::new("vgpu-sandbox").expect("temp dir");
    let socket = dir.path().join("vm1.sock");
    let child = daemon
        .ctl(&["create", "vm1", "--socket", socket.to_str().unwrap()])
        .expect("create");
    let pid = u32::try_from(child["pid"].as_u64().expect("pid")).unwrap();
    let _reaper = KillOnDrop(pid);
    // Its socket is there before it enters the sandbox.
    let start = std::time::Instant::now();
    while status(pid, "Seccomp") != ["2"] {
        assert!(start.elapsed() < TIMEOUT, "no sandbox:\n{}", daemon.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(status(pid, "Uid"), ["70000"; 4]);
    assert_eq!(status(pid, "Gid"), ["70100"; 4]);
    let mut guest = VgpuGuest::attach(&socket, true);
    guest.bring_up();
    let start = std::time::Instant::now();
    while daemon.vm_info("vm1").unwrap()["connected"] != true {
        assert!(
            start.elapsed() < TIMEOUT,
            "vm1 never connected to the daemon:\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(guest);
    daemon.ctl(&["destroy", "vm1"]).expect("destroy");
}

/// A SIGUSR1 dump request (signal delivery, the signal-hook pipe, the worker reading it) is
/// inside the filter.
#[test]
fn a_dump_request_survives_the_filter() {
    let dir = vgpu_tests::TempDir::new("vgpu-sandbox").expect("temp dir");
    let dump = dir.path().join("dump");
    let mut server = start(&["--dump-dir", dump.to_str().unwrap()]);
    let pid = libc::pid_t::try_from(server.pid()).unwrap();
    for _ in 0..3 {
        // SAFETY: kill(2) takes no pointers; `pid` is our live child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGUSR1) }, 0);
    }
    server.assert_survived("SIGUSR1");
    server.kill().expect("killed");
}

/// A kernel the sandbox test runs: `out[i] = in[i] * 3 + i` for `i < n`, looping over a grid
/// stride so that each thread runs a branch back.
const TRIPLE: &str = r#".version 7.0
.target sm_75
.address_size 64
.visible .entry triple(.param .u64 src, .param .u64 dst, .param .u32 n)
{
.reg .pred %p<2>;
.reg .b32 %r<8>;
.reg .b64 %rd<6>;
ld.param.u64 %rd1, [src];
ld.param.u64 %rd2, [dst];
ld.param.u32 %r1, [n];
mov.u32 %r2, %ctaid.x;
mov.u32 %r3, %ntid.x;
mov.u32 %r4, %tid.x;
mad.lo.s32 %r5, %r2, %r3, %r4;
mov.u32 %r6, %nctaid.x;
mul.lo.s32 %r6, %r6, %r3;
LOOP:
setp.ge.u32 %p1, %r5, %r1;
@%p1 bra DONE;
mul.wide.u32 %rd3, %r5, 4;
add.s64 %rd4, %rd1, %rd3;
ld.global.u32 %r7, [%rd4];
mad.lo.s32 %r7, %r7, 3, %r5;
add.s64 %rd5, %rd2, %rd3;
st.global.u32 [%rd5], %r7;
add.s32 %r5, %r5, %r6;
bra LOOP;
DONE:
ret;
}
"#;

/// The compute context, its blob and the blob's size (one piece of guest RAM).
const CUDA_CTX: u32 = 5;
const CUDA_BLOB: u32 = 40;
const CUDA_BLOB_BYTES: u32 = 64 << 10;
/// `VIRTIO_GPU_RESP_OK_NODATA`.
const RESP_OK_NODATA: u32 = 0x1100;
/// The compiled engine's log line for a launch it runs (at debug level).
const COMPILED_LINE: &str = "compiled launch of";

/// Runs [`TRIPLE`] over `n` words through the compute capset of a qtest guest of `server`;
/// the words it wrote, or `None` when the server found no virglrenderer (no compute capset).
fn run_triple(server: &ServerProcess, input: &[u32]) -> Option<Vec<u32>> {
    use mdev_backend::compute::backend::{ContextId, DEFAULT_STREAM, ModuleId};
    use mdev_backend::compute::wire::{Reply, Request};
    use vgpu_guest_drivers::virtio_gpu::{self, CAPSET_COMPUTE};
    use vgpu_tests::compute::ComputeBlob;

    let mut guest = VgpuGuest::attach(server.socket(), true);
    let features = guest.virgl_features()?;
    guest.bring_up_with(features);
    let create = virtio_gpu::ctx_create(CUDA_CTX, CAPSET_COMPUTE, b"cuda");
    assert_eq!(guest.control_header(&create).ctrl_type, RESP_OK_NODATA);
    let blob = ComputeBlob::create(&mut guest, CUDA_BLOB, 1, CUDA_BLOB_BYTES);
    let attach = virtio_gpu::ctx_attach_resource(CUDA_CTX, CUDA_BLOB);
    assert_eq!(guest.control_header(&attach).ctrl_type, RESP_OK_NODATA);
    let mut ask = |req: &Request| blob.exchange(&mut guest, CUDA_CTX, req);
    let id = |r: Reply| match r {
        Reply::Id(id) => id,
        other => panic!("expected an id, got {other:?}"),
    };
    let ctx = ContextId(id(ask(&Request::ContextCreate)));
    let module = ModuleId(id(ask(&Request::ModuleLoad {
        ctx,
        image: TRIPLE.as_bytes().to_vec(),
    })));
    let function = match ask(&Request::Function {
        ctx,
        module,
        name: "triple".into(),
    }) {
        Reply::Function { id, .. } => id,
        other => panic!("{other:?}"),
    };
    let bytes = u64::try_from(input.len() * 4).unwrap();
    let mut alloc = || match ask(&Request::MemAlloc { ctx, bytes }) {
        Reply::Address(a) => a,
        other => panic!("{other:?}"),
    };
    let (src, dst) = (alloc(), alloc());
    let data = input.iter().flat_map(|w| w.to_le_bytes()).collect();
    let copied = ask(&Request::CopyHtoD {
        ctx,
        dst: src,
        data,
        stream: DEFAULT_STREAM,
    });
    assert_eq!(copied, Reply::Done);
    let n = u32::try_from(input.len()).unwrap();
    let params = [&src.to_le_bytes()[..], &dst.to_le_bytes(), &n.to_le_bytes()].concat();
    let batch = Request::Batch(vec![
        Request::Launch {
            ctx,
            function,
            grid: [2, 1, 1],
            block: [64, 1, 1],
            shared_bytes: 0,
            stream: DEFAULT_STREAM,
            params,
            cooperative: false,
        },
        Request::ContextSynchronize { ctx },
    ]);
    let ran = ask(&batch);
    assert!(
        matches!(
            ran,
            Reply::Batch {
                completed: 2,
                error: None,
                ..
            }
        ),
        "{ran:?}"
    );
    let back = ask(&Request::CopyDtoH {
        ctx,
        src: dst,
        bytes,
        stream: DEFAULT_STREAM,
    });
    let Reply::Data(out) = back else {
        panic!("{back:?}")
    };
    Some(
        out.chunks(4)
            .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
            .collect(),
    )
}

/// Compiled kernels run inside the filter: the PTX compiler's code memory (anonymous
/// mappings made executable with `mprotect`, docs/SECURITY.md) is allowed, so a sandboxed
/// device process runs a guest kernel as native code and answers its result; with
/// `--ptx-engine interpreter` the interpreter runs it.
#[test]
fn a_sandboxed_device_runs_kernels_compiled() {
    if skip_without_qemu() {
        return;
    }
    let input: Vec<u32> = (0..1000).map(|i| i * 7 + 1).collect();
    let want: Vec<u32> = input.iter().zip(0..).map(|(&v, i)| v * 3 + i).collect();
    for (engine, compiled) in [("compiled", true), ("interpreter", false)] {
        let mut server = start(&["--log-level", "debug", "--ptx-engine", engine]);
        assert_eq!(status(server.pid(), "Seccomp"), ["2"]);
        let Some(got) = run_triple(&server, &input) else {
            server.kill().expect("killed");
            return;
        };
        assert_eq!(got, want, "--ptx-engine {engine}");
        // It serves one connection: the guest gone, it exits by itself, not killed by the
        // filter.
        let exit = server.wait_exit(TIMEOUT).expect("server state");
        let log = server.log();
        assert!(exit.is_some_and(|s| s.success()), "{exit:?}:\n{log}");
        assert_eq!(
            log.contains(COMPILED_LINE),
            compiled,
            "--ptx-engine {engine}:\n{log}"
        );
        let named = if compiled { "Compiled" } else { "Interpreter" };
        assert!(log.contains(&format!("PTX engine {named}")), "{log}");
    }
}
