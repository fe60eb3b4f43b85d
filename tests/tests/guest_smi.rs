//! The guest's `vgpu-smi` (`vgpu-smi-guest` of guest-drivers/libcuda) against a real
//! `vgpu-cuda-host`, as a program in a guest reaches the device but over the host path's
//! socket (`VGPU_CUDA_SOCKET`), without a VM: the memory it shows is the budget the host was
//! given, its table, `-q` and `--json` agree, and with no device it says so. The `Usage`
//! request it samples the utilisation with moves on a connection that ran a kernel (each
//! connection of `vgpu-cuda-host` is a VM of its own, with its own budget and device time).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use mdev_backend::compute::backend::{ContextId, DEFAULT_STREAM, FunctionId, ModuleId};
use mdev_backend::compute::wire::{self, Reply, Request};
use vgpu_tests::TempDir;
use vgpu_tests::daemon::workspace_binary;

/// The host's `--memory-budget` (MiB): what the guest sees as its GPU memory.
const BUDGET_MIB: u64 = 96;
/// Longest wait for the host's socket or a tool's run.
const DEADLINE: Duration = Duration::from_secs(60);

/// A `vgpu-cuda-host` serving `dir/host.sock` with [`BUDGET_MIB`]; killed and reaped on drop.
struct Host {
    dir: TempDir,
    child: Child,
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Host {
    fn start() -> Host {
        let dir = TempDir::new("guest-smi").expect("temp dir");
        let child = Command::new(workspace_binary("vgpu-cuda-host").expect("vgpu-cuda-host"))
            .arg("--socket")
            .arg(dir.path().join("host.sock"))
            .arg(format!("--memory-budget={BUDGET_MIB}"))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start vgpu-cuda-host");
        let host = Host { dir, child };
        let start = Instant::now();
        while !host.socket().exists() {
            assert!(start.elapsed() < DEADLINE, "no socket from vgpu-cuda-host");
            std::thread::sleep(Duration::from_millis(5));
        }
        host
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("host.sock")
    }
}

/// Runs the guest's vgpu-smi with `args`, its device the socket `socket`.
fn smi(socket: &Path, args: &[&str]) -> Output {
    Command::new(workspace_binary("vgpu-smi-guest").expect("vgpu-smi-guest"))
        .args(args)
        .env("VGPU_CUDA_SOCKET", socket)
        .stdin(Stdio::null())
        .output()
        .expect("run vgpu-smi-guest")
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_guest_vgpu_smi_shows_its_hosts_budget_as_the_gpu_memory() {
    let host = Host::start();
    let json: serde_json::Value = serde_json::from_str(&stdout(&smi(
        &host.socket(),
        &["--json", "--interval", "50"],
    )))
    .expect("JSON");
    let gpu = &json["gpus"][0];
    let (total, free, used) = (
        gpu["memory"]["total_bytes"].as_u64().unwrap(),
        gpu["memory"]["free_bytes"].as_u64().unwrap(),
        gpu["memory"]["used_bytes"].as_u64().unwrap(),
    );
    assert_eq!(total, BUDGET_MIB << 20, "{json:#}");
    // Its own context's reserve is all its connection holds.
    assert!(
        free < total && used == total - free && used < 8 << 20,
        "{json:#}"
    );
    assert_eq!(json["cuda_version"], "13.5");
    assert_eq!(json["cuda_driver_api"], 13050);
    assert!(gpu["multiprocessors"].as_u64().unwrap() > 0);
    let cc = gpu["compute_capability"].as_str().unwrap();
    assert!(
        cc.split_once('.')
            .is_some_and(|(a, b)| a.parse::<u32>().is_ok() && b.parse::<u32>().is_ok()),
        "{cc}"
    );
    assert!(gpu["uuid"].as_str().unwrap().starts_with("GPU-"));
    // Its connection ran nothing: the device did no work for it.
    assert_eq!(gpu["utilization"]["gpu"], 0.0, "{json:#}");
    assert_eq!(gpu["utilization"]["interval_ms"], 50);

    let table = stdout(&smi(&host.socket(), &["--interval=20"]));
    assert!(table.contains(&format!("/ {BUDGET_MIB}MiB")), "{table}");
    assert!(table.contains("CUDA Version: 13.5"), "{table}");
    let query = stdout(&smi(&host.socket(), &["-q", "--interval", "20"]));
    let total_line = query
        .lines()
        .find(|l| l.trim_start().starts_with("Total"))
        .unwrap_or_else(|| panic!("no Total in\n{query}"));
    assert!(
        total_line.ends_with(&format!(": {BUDGET_MIB} MiB")),
        "{query}"
    );
    assert!(stdout(&smi(&host.socket(), &["--help"])).contains("Usage: vgpu-smi"));

    // No device: exit 1, said; a bad command line: exit 2.
    let none = smi(&host.dir.path().join("absent.sock"), &[]);
    assert_eq!(none.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&none.stderr).contains("no device"));
    let bad = smi(&host.socket(), &["--interval", "0"]);
    assert_eq!(bad.status.code(), Some(2));
}

/// Sends `r` over `s` and reads its reply.
fn ask(s: &mut UnixStream, r: &Request) -> Reply {
    s.write_all(&r.encode()).unwrap();
    let mut h = [0u8; 4];
    s.read_exact(&mut h).unwrap();
    let mut body = vec![0; wire::body_len(h).unwrap()];
    s.read_exact(&mut body).unwrap();
    Reply::decode(&body).unwrap()
}

/// `(busy, elapsed)` of the connection's VM.
fn usage(s: &mut UnixStream) -> (u64, u64) {
    match ask(s, &Request::Usage) {
        Reply::Usage {
            busy_ns,
            elapsed_ns,
        } => (busy_ns, elapsed_ns),
        r => panic!("{r:?}"),
    }
}

#[test]
fn usage_on_a_vgpu_cuda_host_connection_moves_after_a_kernel_runs() {
    const PTX: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
        .visible .entry spin(.param .u32 n)\n{\n.reg .b32 %r<3>;\n.reg .pred %p;\n\
        ld.param.u32 %r1, [n];\nmov.u32 %r2, 0;\nLOOP:\nadd.u32 %r2, %r2, 1;\n\
        setp.lt.u32 %p, %r2, %r1;\n@%p bra LOOP;\nret;\n}\n";
    let host = Host::start();
    let mut s = UnixStream::connect(host.socket()).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let Reply::Id(ctx) = ask(&mut s, &Request::ContextCreate) else {
        panic!("context")
    };
    let ctx = ContextId(ctx);
    let load = Request::ModuleLoad {
        ctx,
        image: PTX.as_bytes().to_vec(),
    };
    let Reply::Id(module) = ask(&mut s, &load) else {
        panic!("module")
    };
    let function = Request::Function {
        ctx,
        module: ModuleId(module),
        name: "spin".into(),
    };
    let Reply::Function { id, .. } = ask(&mut s, &function) else {
        panic!("function")
    };
    let idle = usage(&mut s);
    assert_eq!(idle.0, 0, "set-up is not device time");
    let launch = Request::Launch {
        ctx,
        function: FunctionId(id.0),
        grid: [16, 1, 1],
        block: [64, 1, 1],
        shared_bytes: 0,
        stream: DEFAULT_STREAM,
        params: 10_000u32.to_le_bytes().to_vec(),
        cooperative: false,
    };
    assert!(matches!(ask(&mut s, &launch), Reply::Output(_)));
    assert_eq!(
        ask(&mut s, &Request::ContextSynchronize { ctx }),
        Reply::Done
    );
    let after = usage(&mut s);
    let busy = after.0 - idle.0;
    let elapsed = after.1 - idle.1;
    assert!(
        busy > 0 && busy <= elapsed,
        "{busy} ns busy of {elapsed} ns"
    );
    println!(
        "utilisation over the kernel: {:.0}% ({busy} ns of {elapsed} ns)",
        busy as f64 * 100.0 / elapsed as f64
    );
}
