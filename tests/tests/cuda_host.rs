//! Stock CUDA clients on the guest library, without a VM: `libcuda.so.1` of
//! `guest-drivers/libcuda` talks over a Unix socket to `vgpu-cuda-host` (the host side a VM's
//! compute context uses, on the PTX executor). The programs of the CUDA corpus run unmodified
//! and check their own results: the GCC OpenMP-offloading ones (Debian's libgomp nvptx plugin
//! dlopens our `libcuda.so.1`, links the program's PTX, allocates, copies and launches through
//! it) and the nvcc-built ones (their static cudart resolves the driver through
//! `cuGetProcAddress` and the export tables). `OMP_TARGET_OFFLOAD=MANDATORY` makes a failed offload an error instead of a silent
//! fall-back to the host, and the host reports the launches it ran.

use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use mdev_backend::compute::wire::Request;

use mdev_backend::compute::corpus::{NVCC_PROGRAMS, NVCC_REFUSED, corpus_for_tests};
use vgpu_tests::daemon::workspace_binary;
use vgpu_tests::temp_dir::TempDir;

/// Longest a program or the host may take (a cold TCG-free run takes about a second).
const DEADLINE: Duration = Duration::from_secs(120);
/// The user the other-user client runs as.
const NOBODY: u32 = 65534;
/// Set for the test binary started as [`NOBODY`]: the socket [`client_of_another_user`]
/// connects to.
const CLIENT_SOCKET: &str = "VGPU_TEST_CUDA_HOST_CLIENT_SOCKET";

fn corpus() -> Option<PathBuf> {
    corpus_for_tests("omp_saxpy")
}

/// Waits for a child until the deadline; kills it past that. Its output either way.
fn finish(mut child: Child, what: &str) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "{what} ran past {DEADLINE:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// A served socket and a directory holding our `libcuda.so.1`. A host still running when
/// this is dropped (a failed assertion before [`Host::report`]) is killed and reaped.
struct Host {
    dir: TempDir,
    child: Option<Child>,
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Host {
    fn start() -> Host {
        Host::start_under_umask("022")
    }

    /// Starts the host with `umask` (octal) and checks its socket's mode when it appears.
    fn start_under_umask(umask: &str) -> Host {
        let dir = TempDir::new("cuda-host").expect("temp dir");
        let lib = workspace_binary("libcuda.so").expect("libcuda.so of guest-drivers/libcuda");
        std::os::unix::fs::symlink(lib, dir.path().join("libcuda.so.1")).expect("symlink");
        let socket = dir.path().join("host.sock");
        let child = Command::new("sh")
            .arg("-c")
            .arg("umask \"$0\" && exec \"$@\"")
            .arg(umask)
            .arg(workspace_binary("vgpu-cuda-host").expect("vgpu-cuda-host"))
            .arg("--socket")
            .arg(&socket)
            .arg("--once")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start vgpu-cuda-host");
        // Owned by the `Host` at once, so a failure from here on still kills it.
        let host = Host {
            dir,
            child: Some(child),
        };
        let start = Instant::now();
        let meta = loop {
            if let Ok(meta) = std::fs::symlink_metadata(&socket) {
                break meta;
            }
            assert!(start.elapsed() < DEADLINE, "no socket from vgpu-cuda-host");
            std::thread::sleep(Duration::from_millis(1));
        };
        // Its mode from the moment it exists, whatever the umask.
        assert!(meta.file_type().is_socket());
        assert_eq!(
            meta.permissions().mode() & 0o777,
            0o600,
            "under umask {umask}"
        );
        host
    }

    /// Runs a program against the host with our library.
    fn run(&self, program: &PathBuf) -> Output {
        let child = Command::new(program)
            .env("LD_LIBRARY_PATH", self.dir.path())
            .env("VGPU_CUDA_SOCKET", self.dir.path().join("host.sock"))
            .env("OMP_TARGET_OFFLOAD", "MANDATORY")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the program");
        finish(child, &program.display().to_string())
    }

    /// The host's report once the connection has ended.
    fn report(mut self) -> String {
        let child = self.child.take().expect("a host not yet reported");
        let out = finish(child, "vgpu-cuda-host");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

/// Runs `program` of the corpus against a fresh host: it must exit 0 with a last line starting
/// `PASS`, and the host must report `launches` launches. Its stdout and the host's report.
fn passes(dir: &Path, program: &str, launches: u64) -> (String, String) {
    let host = Host::start();
    let out = host.run(&dir.join(program));
    let report = host.report();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.lines().last().is_some_and(|l| l.starts_with("PASS")),
        "{program}: {:?}\nstdout:\n{stdout}\nstderr:\n{}\nhost:\n{report}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        report.contains(&format!(" {launches} launches, ")),
        "{program}: {report}"
    );
    (stdout, report)
}

#[test]
fn gcc_offload_programs_run_unmodified_through_the_guest_library() {
    let Some(dir) = corpus() else { return };
    // (program, target regions launched, bytes the host saw go to the device or None).
    for (program, launches, bytes_to_device) in [
        ("omp_saxpy", 1, Some(32768 + 16)),
        ("omp_reduction", 1, Some(8 + 8)),
        // A double reduction over teams, threads and SIMD lanes, device printf, atomics and a
        // target data region with two kernels: five regions.
        ("omp_features", 5, None),
    ] {
        if !dir.join(program).exists() {
            panic!("{program} missing from the corpus in {}", dir.display());
        }
        let (stdout, report) = passes(&dir, program, launches);
        if let Some(b) = bytes_to_device {
            assert!(
                report.contains(&format!(" {b} bytes to device")),
                "{program}: {report}"
            );
        }
        if program == "omp_features" {
            assert!(stdout.contains("hello from the device, team 0"), "{stdout}");
        }
    }
}

#[test]
fn without_a_reachable_host_there_is_no_device_and_openmp_runs_on_the_cpu() {
    let Some(dir) = corpus() else { return };
    let host = Host::start();
    let lib_dir = host.dir.path().to_path_buf();
    // The host serves its socket, but the program is pointed elsewhere: cuInit answers
    // CUDA_ERROR_NO_DEVICE, libgomp sees no device and (as GCC 12 does even with MANDATORY
    // when there is none) runs the region on the host.
    let child = Command::new(dir.join("omp_saxpy"))
        .env("LD_LIBRARY_PATH", &lib_dir)
        .env("VGPU_CUDA_SOCKET", lib_dir.join("nothing-here.sock"))
        .env("OMP_TARGET_OFFLOAD", "MANDATORY")
        .env("VGPU_CUDA_TRACE", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the program");
    let out = finish(child, "omp_saxpy");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("PASS"));
    assert!(
        stderr.contains("vgpu libcuda: cuInit"),
        "our library was loaded: {stderr}"
    );
    assert!(!stderr.contains("cuLaunchKernel"), "{stderr}");
    // Release the waiting host with a connection that says nothing.
    drop(std::os::unix::net::UnixStream::connect(lib_dir.join("host.sock")).expect("connect"));
    assert!(host.report().contains("0 requests"));
}

#[test]
fn nvcc_programs_run_unmodified_through_the_guest_library() {
    let Some(dir) = corpus_for_tests(NVCC_PROGRAMS[0].0) else {
        return;
    };
    // Their static cudart 13 goes through the export tables (the integrity check included),
    // loads its fat binary as a library (cuLibraryLoadData) and launches CUkernel handles.
    for (program, launches) in NVCC_PROGRAMS {
        let (stdout, _) = passes(&dir, program, launches);
        if program == "hello" {
            assert!(stdout.contains("block 1 thread 1 value 1.50"), "{stdout}");
        }
    }
    // A kernel polling mapped memory for the host's write runs into its deadline: a CUDA error
    // the program reports, no hang.
    let (program, line) = NVCC_REFUSED;
    let host = Host::start();
    let out = host.run(&dir.join(program));
    let report = host.report();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{report}");
    assert!(stdout.starts_with(line), "{stdout}");
    assert!(report.contains(" 1 launches"), "{report}");
}

/// Another user who reaches the socket (its directory and mode opened, as a mistaken mode or
/// a umask of 000 would) is refused at accept, from the connection's credentials: it gets no
/// answer, and the host, still waiting, serves its own user next. Before the check, user
/// nobody was served.
#[test]
fn another_user_is_refused_whatever_the_socket_mode() {
    // Only root may start a process as another user.
    if vgpu_schedd::seqpacket::effective_uid() != 0 {
        eprintln!("skipped: not root");
        return;
    }
    let host = Host::start_under_umask("000");
    let socket = host.dir.path().join("host.sock");
    std::fs::set_permissions(host.dir.path(), std::fs::Permissions::from_mode(0o711))
        .expect("chmod the directory");
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666))
        .expect("chmod the socket");
    let client = Command::new(std::env::current_exe().expect("this test binary"))
        .args(["--exact", "client_of_another_user", "--nocapture"])
        .env(CLIENT_SOCKET, &socket)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the client as nobody");
    let out = finish(client, "the client as nobody");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("client: no answer"), "{stdout}");
    // The host still waits for its one connection: its own user's.
    let mut own = UnixStream::connect(&socket).expect("connect as the host's user");
    assert!(answer(&mut own).is_some(), "the host's own user is served");
    drop(own);
    let report = host.report();
    assert!(
        report.contains(&format!("refused: user {NOBODY} is not allowed")),
        "{report}"
    );
    assert!(report.contains(" 1 requests"), "{report}");
}

/// Sends one `Attributes` request; its answer's length, or `None` when the host closed the
/// connection without one.
fn answer(stream: &mut UnixStream) -> Option<usize> {
    stream.set_read_timeout(Some(DEADLINE)).expect("timeout");
    stream.write_all(&Request::Attributes.encode()).ok()?;
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).ok()?;
    Some(u32::from_le_bytes(header) as usize)
}

/// Not a test of its own: the client [`another_user_is_refused_whatever_the_socket_mode`]
/// starts as another user (without [`CLIENT_SOCKET`] set it does nothing).
#[test]
fn client_of_another_user() {
    let Some(socket) = std::env::var_os(CLIENT_SOCKET) else {
        return;
    };
    match UnixStream::connect(&socket) {
        Ok(mut s) => match answer(&mut s) {
            Some(len) => println!("client: served, an answer of {len} bytes"),
            None => println!("client: no answer"),
        },
        Err(e) => println!("client: connect: {e}"),
    }
}
