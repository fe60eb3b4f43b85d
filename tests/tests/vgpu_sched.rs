//! qtest tests of the device's scheduler daemon client (`--scheduler`) through the real
//! vfio-user path, against a fake daemon in the test (a SOCK_SEQPACKET listener speaking
//! `vgpu_schedd::proto`): Hello, load groups run by the daemon (Submit/Done), frames paced by
//! Present, scanout flushes as presented frames (Frame, held until Present), virgl groups
//! waiting for Grant and reported with Completed, compute-capset launches likewise (control
//! work not asked for), leases, garbage from
//! the daemon, and the daemon going away (the device falls back to its fallback budget, never
//! unscheduled) and coming back. virglrenderer may be initialised
//! once per process, so everything runs in one test.

use std::path::Path;
use std::time::{Duration, Instant};

use mdev_backend::compute::backend::{ContextId, DEFAULT_STREAM, ModuleId};
use mdev_backend::compute::wire::{Reply, Request};
use vgpu_guest_drivers::virtio_gpu::{
    self, CAPSET_COMPUTE, CAPSET_LOAD, CONTROL_QUEUE, CTRL_HDR_SIZE, LOAD_OP_END_FRAME,
    LOAD_OP_OCCUPY, ResourceCreate3d,
};
use vgpu_schedd::proto::{self, Exec, Msg, PROTOCOL_VERSION, VmName};
use vgpu_schedd::seqpacket::{SeqListener, SeqStream, monotonic_ns};
use vgpu_server::sched_client::{MAX_PENDING_FRAMES, SchedConfig};
use vgpu_tests::compute::ComputeBlob;
use vgpu_tests::server::{TestServer, VgpuGuest};
use vgpu_tests::skip_without_qemu;
use vgpu_tests::temp_dir::TempDir;

const TIMEOUT: Duration = Duration::from_secs(10);
/// How long a held request is watched to make sure it does not complete.
const HELD: Duration = Duration::from_millis(300);
const RESP_OK_NODATA: u32 = 0x1100;
const LOAD_CTX: u32 = 7;
const GL_CTX: u32 = 1;
const VM: &str = "vm-sched-test";
/// The 3D resource the scanout shows, and one it does not.
const SHOWN: u32 = 30;
const HIDDEN: u32 = 31;
/// A 2D resource.
const CONSOLE: u32 = 32;
/// VIRGL_FORMAT_B8G8R8A8_UNORM, bind render target | sampler view.
const BGRA: u32 = 1;
const BIND: u32 = 0x2 | 0x8;
/// Commands in one load submit (the load capset's maximum).
const LOAD_MAX_COMMANDS: usize = vgpu_server::gpu::load::MAX_COMMANDS;

/// Waits for the device to connect.
fn accept(listener: &SeqListener) -> SeqStream {
    let start = Instant::now();
    loop {
        if let Some((stream, _)) = listener.accept().expect("accept") {
            stream.set_nonblocking(false).unwrap();
            stream.set_read_timeout(Some(TIMEOUT)).unwrap();
            return stream;
        }
        assert!(start.elapsed() < TIMEOUT, "the device did not connect");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The VM's memory as the device last reported it (`Memory`, which it sends whenever the
/// figures change: [`recv`] keeps it here rather than in the conversation the tests follow).
static MEMORY: std::sync::Mutex<Option<(u64, u64)>> = std::sync::Mutex::new(None);

/// The next message from the device other than a memory report.
fn recv(stream: &SeqStream) -> Msg {
    let mut buf = vec![0; proto::MAX_MESSAGE_BYTES + 1];
    loop {
        let n = stream
            .recv(&mut buf)
            .expect("recv")
            .expect("a message in time");
        match proto::decode(&buf[..n]).expect("a valid message") {
            Msg::Memory { used, limit } => *MEMORY.lock().unwrap() = Some((used, limit)),
            msg => return msg,
        }
    }
}

fn send(stream: &SeqStream, msg: &Msg) {
    let mut packet = Vec::new();
    proto::encode(msg, &mut packet);
    stream.send(&packet).expect("send");
}

/// Expects `Hello` from the device, naming QEMU's pid `qemu`, and welcomes it.
fn hello(stream: &SeqStream, qemu: u32) {
    match recv(stream) {
        Msg::Hello {
            version,
            vm_name,
            device_pid,
            qemu_pid,
        } => {
            assert_eq!(version, PROTOCOL_VERSION);
            assert_eq!(vm_name.as_str(), VM);
            assert_eq!(device_pid, std::process::id(), "the server runs in-process");
            assert_eq!(
                qemu_pid, qemu,
                "QEMU's pid from the accepted vfio-user connection"
            );
        }
        other => panic!("expected Hello, got {other:?}"),
    }
    send(
        stream,
        &Msg::Welcome {
            version: PROTOCOL_VERSION,
            vgpu: vgpu_scheduler::VgpuId(0),
        },
    );
}

/// Queues one request without waiting; returns its head.
fn start(guest: &mut VgpuGuest, request: &[u8]) -> u16 {
    let qt = guest.vm.qtest();
    guest
        .dev
        .request(qt, CONTROL_QUEUE, &[request], &[CTRL_HDR_SIZE as u32])
        .expect("request queued")
}

/// Waits for the next completion, which must be `head`'s.
fn finished(guest: &mut VgpuGuest, head: u16) {
    let qt = guest.vm.qtest();
    let done = guest
        .dev
        .wait_used(qt, CONTROL_QUEUE, TIMEOUT)
        .expect("request completes");
    assert_eq!(done.used.id, u32::from(head));
    let reply = done.writable.expect("our chain").remove(0);
    let hdr = virtio_gpu::CtrlHeader::parse(&reply).unwrap();
    assert_eq!(hdr.ctrl_type, RESP_OK_NODATA);
}

/// Checks that nothing completes for a while.
fn still_held(guest: &mut VgpuGuest) {
    let qt = guest.vm.qtest();
    assert!(
        guest.dev.wait_used(qt, CONTROL_QUEUE, HELD).is_err(),
        "completed without the daemon's answer"
    );
}

fn call(guest: &mut VgpuGuest, request: &[u8]) {
    let head = start(guest, request);
    finished(guest, head);
}

/// Expects `Submit` with `exec`; returns its group and cost.
fn submitted(stream: &SeqStream, exec: Exec) -> (vgpu_scheduler::GroupId, u64) {
    match recv(stream) {
        Msg::Submit {
            group,
            exec: e,
            cost_ns,
            ..
        } if e == exec => (group, cost_ns),
        other => panic!("expected Submit {exec:?}, got {other:?}"),
    }
}

/// The daemon's engine finished `group` just now.
fn done_now(stream: &SeqStream, group: vgpu_scheduler::GroupId) {
    let now = monotonic_ns();
    send(
        stream,
        &Msg::Done {
            group,
            start: now,
            finish: now,
        },
    );
}

fn occupy(us: u64) -> (u32, u32, u64) {
    (LOAD_OP_OCCUPY, 0, us)
}

fn load(fence: u64, commands: &[(u32, u32, u64)]) -> Vec<u8> {
    virtio_gpu::with_fence(virtio_gpu::load_submit(LOAD_CTX, commands), fence)
}

/// The next message is `Completed` for `group`, with sane times.
fn completed_reported(daemon: &SeqStream, group: vgpu_scheduler::GroupId) {
    match recv(daemon) {
        Msg::Completed {
            group: g,
            start,
            finish,
        } => {
            assert_eq!(g, group);
            assert!(start <= finish);
        }
        other => panic!("expected Completed, got {other:?}"),
    }
}

fn gl_submit(fence: u64) -> Vec<u8> {
    virtio_gpu::with_fence(virtio_gpu::submit_3d(GL_CTX, &[0]), fence)
}

#[test]
fn scheduled_device_asks_the_daemon() {
    if skip_without_qemu() {
        return;
    }
    let dir = TempDir::new("vgpu-sched").expect("temporary directory");
    let path = dir.path().join("schedd.sock");
    let listener = SeqListener::bind(&path).expect("fake daemon listens");
    let server = TestServer::start_3d_scheduled(SchedConfig {
        socket: path.clone(),
        vm_name: VmName::new(VM).unwrap(),
        fallback: Default::default(),
    });
    let mut guest = VgpuGuest::start(&server);
    let daemon = accept(&listener);
    hello(&daemon, guest.vm.pid());

    let Some(features) = guest.virgl_features() else {
        return;
    };
    guest.bring_up_with(features);
    call(
        &mut guest,
        &virtio_gpu::ctx_create(LOAD_CTX, CAPSET_LOAD, b"load"),
    );
    call(&mut guest, &virtio_gpu::ctx_create(GL_CTX, 1, b"gl"));

    // A load OCCUPY runs on the daemon's engine: its fence waits for Done.
    let head = start(&mut guest, &load(1, &[occupy(2000)]));
    let (group, cost) = submitted(&daemon, Exec::Simulated);
    assert_eq!(cost, 2_000_000);
    still_held(&mut guest);
    done_now(&daemon, group);
    finished(&mut guest, head);

    // A Done for a group the device never submitted is ignored.
    send(
        &daemon,
        &Msg::Done {
            group: vgpu_scheduler::GroupId(u64::MAX),
            start: 0,
            finish: 0,
        },
    );

    // END_FRAME: Frame, and the fence completes at the Present time.
    let head = start(&mut guest, &load(2, &[(LOAD_OP_END_FRAME, 0, 0)]));
    assert_eq!(recv(&daemon), Msg::Frame);
    still_held(&mut guest);
    let at = monotonic_ns() + 50_000_000;
    send(&daemon, &Msg::Present { at });
    finished(&mut guest, head);
    assert!(monotonic_ns() >= at, "presented before its time");

    // A virgl SUBMIT_3D waits for its Grant, then Completed reports it: fenced (its
    // completion rides on the guest's renderer fence) and unfenced (a renderer fence of its
    // own).
    for submit in [gl_submit(3), virtio_gpu::submit_3d(GL_CTX, &[0])] {
        let head = start(&mut guest, &submit);
        let (group, _) = submitted(&daemon, Exec::Device);
        still_held(&mut guest);
        send(&daemon, &Msg::Grant { group });
        finished(&mut guest, head);
        completed_reported(&daemon, group);
    }

    // Under a lease the device dispatches at once and says so.
    dispatched_under_a_lease(&mut guest, &daemon, &gl_submit(4));

    // Garbage and a grant for an unknown group: the device keeps serving, and answers the
    // grant with a Cancel so the daemon never waits on it.
    daemon.send(b"not a message").unwrap();
    let unknown = vgpu_scheduler::GroupId(77_777);
    send(&daemon, &Msg::Grant { group: unknown });
    let head = start(&mut guest, &load(5, &[occupy(100)]));
    let mut cancelled = false;
    let group = loop {
        match recv(&daemon) {
            Msg::Cancel { group } if group == unknown => cancelled = true,
            Msg::Submit {
                group,
                exec: Exec::Simulated,
                ..
            } => break group,
            other => panic!("expected Cancel or Submit, got {other:?}"),
        }
    };
    done_now(&daemon, group);
    finished(&mut guest, head);
    if !cancelled {
        assert!(matches!(recv(&daemon), Msg::Cancel { group } if group == unknown));
    }

    presented_frames(&mut guest, &daemon);
    compute_groups(&mut guest, &daemon);

    // The daemon goes away with a load group and a virgl group waiting: both complete (the
    // load group on the local engine, the virgl group under the fallback budget).
    let first = start(&mut guest, &load(6, &[occupy(3000)]));
    submitted(&daemon, Exec::Simulated);
    let second = start(&mut guest, &gl_submit(7));
    submitted(&daemon, Exec::Device);
    drop(daemon);
    drop(listener);
    finished(&mut guest, first);
    finished(&mut guest, second);
    // Under the fallback budget the device keeps serving, one group at a time.
    call(&mut guest, &load(8, &[occupy(1000)]));
    call(&mut guest, &gl_submit(9));
    let fallback = |name: &str| server.counter(name);
    assert_eq!(fallback("sched_fallback"), 1, "not admitted: fallback");
    assert_eq!(fallback("sched_fallback_entered"), 1, "said once");
    assert_eq!(
        fallback("sched_fallback_groups"),
        2,
        "the held virgl group and the next one ran under the fallback budget"
    );

    // The daemon is back: the device says Hello again and asks again.
    let listener = SeqListener::bind(&path).expect("fake daemon listens again");
    let daemon = accept(&listener);
    hello(&daemon, guest.vm.pid());
    let head = start(&mut guest, &gl_submit(10));
    let (group, _) = submitted(&daemon, Exec::Device);
    send(&daemon, &Msg::Grant { group });
    finished(&mut guest, head);
    assert_eq!(
        fallback("sched_fallback"),
        0,
        "admitted again by the Welcome"
    );
    assert_eq!(fallback("sched_fallback_groups"), 2);
    cleanup(guest, server, &path);
}

/// The compute capset: control work (a context, a module) does not ask the daemon; a launch is
/// a `Compute` group that waits for its Grant, runs on the executor and is reported Completed;
/// under a lease it is dispatched at once.
fn compute_groups(guest: &mut VgpuGuest, daemon: &SeqStream) {
    const CTX: u32 = 9;
    const EMPTY: &str = ".version 7.0\n.target sm_70\n.address_size 64\n\
        .visible .entry empty()\n{\nret;\n}\n";
    call(guest, &virtio_gpu::ctx_create(CTX, CAPSET_COMPUTE, b"cuda"));
    let blob = ComputeBlob::create(guest, 60, 2, 64 << 10);
    assert!(reports_until_marked(daemon).is_empty());
    let before = MEMORY
        .lock()
        .unwrap()
        .expect("the device reports its memory")
        .0;
    let Reply::Id(c) = blob.exchange(guest, CTX, &Request::ContextCreate) else {
        panic!("context")
    };
    let ctx = ContextId(c);
    // The context's reserve is the VM's memory, and the daemon hears of it.
    assert!(reports_until_marked(daemon).is_empty());
    let (used, limit) = MEMORY.lock().unwrap().expect("reported");
    assert!(
        used > before && used <= limit,
        "{before} -> {used} of {limit}"
    );
    let module = Request::ModuleLoad {
        ctx,
        image: EMPTY.as_bytes().to_vec(),
    };
    let Reply::Id(m) = blob.exchange(guest, CTX, &module) else {
        panic!("module")
    };
    let function = Request::Function {
        ctx,
        module: ModuleId(m),
        name: "empty".into(),
    };
    let Reply::Function { id, .. } = blob.exchange(guest, CTX, &function) else {
        panic!("function")
    };
    let launch = Request::Batch(vec![
        Request::Launch {
            ctx,
            function: id,
            grid: [4, 1, 1],
            block: [64, 1, 1],
            shared_bytes: 0,
            stream: DEFAULT_STREAM,
            params: vec![],
            cooperative: false,
        },
        Request::ContextSynchronize { ctx },
    ]);
    let submit = blob.put(guest, CTX, &launch, 20);
    let head = start(guest, &submit);
    // The first message since the control work: nothing was asked for it.
    let (group, _) = submitted(daemon, Exec::Device);
    still_held(guest);
    // What was scheduled runs, whatever the guest writes into its blob meanwhile.
    blob.write(guest, &[0xff; 64]);
    granted_to_the_end(guest, daemon, group, head);
    assert!(
        matches!(
            blob.reply(guest),
            Reply::Batch {
                completed: 2,
                error: None,
                ..
            }
        ),
        "the launch ran once granted"
    );
    // Under a lease a launch-heavy app pays no grant round trip: dispatched at once.
    let submit = blob.put(guest, CTX, &launch, 21);
    dispatched_under_a_lease(guest, daemon, &submit);
}

/// Grants `group`, held for the compute request `head`, and every continuation the device
/// asks for until the request completes: a request runs a slice
/// ([`vgpu_server::gpu::compute::SLICE`]) at a time, and its first
/// launch (the kernel's compilation included) can outlast a slice on a busy host. Each
/// continuation is asked for only after the slice before it was reported complete, and the
/// request completes with its last slice reported.
fn granted_to_the_end(
    guest: &mut VgpuGuest,
    daemon: &SeqStream,
    group: vgpu_scheduler::GroupId,
    head: u16,
) {
    /// How long each side is watched before the other is looked at.
    const POLL: Duration = Duration::from_millis(20);
    send(daemon, &Msg::Grant { group });
    let mut running = group;
    let mut reported = false;
    let deadline = Instant::now() + TIMEOUT;
    daemon.set_read_timeout(Some(POLL)).unwrap();
    let mut buf = vec![0; proto::MAX_MESSAGE_BYTES + 1];
    loop {
        assert!(
            Instant::now() < deadline,
            "the compute request did not complete"
        );
        if let Ok(done) = guest.dev.wait_used(guest.vm.qtest(), CONTROL_QUEUE, POLL) {
            assert_eq!(done.used.id, u32::from(head));
            let reply = done.writable.expect("our chain").remove(0);
            let hdr = virtio_gpu::CtrlHeader::parse(&reply).unwrap();
            assert_eq!(hdr.ctrl_type, RESP_OK_NODATA);
            break;
        }
        let Some(n) = daemon.recv(&mut buf).expect("recv") else {
            continue;
        };
        match proto::decode(&buf[..n]).expect("a valid message") {
            Msg::Memory { used, limit } => *MEMORY.lock().unwrap() = Some((used, limit)),
            Msg::Completed {
                group: g,
                start,
                finish,
            } if g == running && !reported => {
                assert!(start <= finish);
                reported = true;
            }
            Msg::Submit {
                group: g,
                exec: Exec::Device,
                ..
            } if reported => {
                running = g;
                reported = false;
                send(daemon, &Msg::Grant { group: g });
            }
            other => panic!("expected Completed of {running:?} or a continuation, got {other:?}"),
        }
    }
    daemon.set_read_timeout(Some(TIMEOUT)).unwrap();
    if !reported {
        completed_reported(daemon, running);
    }
}

/// Under a lease `request` runs at once: the device reports `Dispatched`, then `Completed`;
/// the lease is revoked after.
fn dispatched_under_a_lease(guest: &mut VgpuGuest, daemon: &SeqStream, request: &[u8]) {
    send(
        daemon,
        &Msg::Lease {
            budget_ns: 0,
            until: 0,
        },
    );
    assert_eq!(reports_until_marked(daemon), [], "nothing ran meanwhile");
    call(guest, request);
    send(daemon, &Msg::Revoke);
    // One slice, or several when the request outlasted a slice on a busy host: each
    // `Dispatched`, then `Completed`.
    let reports = reports_until_marked(daemon);
    assert!(!reports.is_empty() && reports.len() % 2 == 0, "{reports:?}");
    for pair in reports.chunks(2) {
        match pair {
            [
                Msg::Dispatched { group, .. },
                Msg::Completed {
                    group: done,
                    start,
                    finish,
                },
            ] if group == done && start <= finish => {}
            other => panic!("expected Dispatched, then its Completed; got {other:?}"),
        }
    }
}

/// A group no device asked for. The device answers a grant for it with `Cancel`, after it has
/// acted on every message sent before the grant and sent what it held to report.
const MARKER: vgpu_scheduler::GroupId = vgpu_scheduler::GroupId(77_000);

/// Sends a grant for [`MARKER`]; returns what the device sent before it answered that grant.
fn reports_until_marked(daemon: &SeqStream) -> Vec<Msg> {
    /// More reports than any one step of these tests makes.
    const MAX_REPORTS: usize = 1000;
    send(daemon, &Msg::Grant { group: MARKER });
    let mut before = Vec::new();
    while before.len() < MAX_REPORTS {
        match recv(daemon) {
            Msg::Cancel { group } if group == MARKER => return before,
            report => before.push(report),
        }
    }
    panic!("no answer to the marker's grant after {MAX_REPORTS} reports")
}

/// A flush of the 3D resource a scanout shows is one presented frame: `Frame`, and its
/// completion (fenced or not) waits for the `Present`. A flush of a resource no scanout shows,
/// or of a 2D one, sends nothing; past `MAX_PENDING_FRAMES` frames waiting, a flush completes
/// at once.
fn presented_frames(guest: &mut VgpuGuest, daemon: &SeqStream) {
    let edge = 64;
    let whole = virtio_gpu::Rect::new(0, 0, edge, edge);
    for id in [SHOWN, HIDDEN] {
        let tex = ResourceCreate3d::texture_2d(id, BGRA, BIND, edge, edge);
        call(guest, &virtio_gpu::resource_create_3d(&tex));
    }
    call(guest, &virtio_gpu::set_scanout(0, SHOWN, whole));

    // Fenced: held until the Present's time.
    let head = start(guest, &virtio_gpu::with_fence(flush(SHOWN), 20));
    assert_eq!(recv(daemon), Msg::Frame);
    still_held(guest);
    let at = monotonic_ns() + 50_000_000;
    send(daemon, &Msg::Present { at });
    finished(guest, head);
    assert!(monotonic_ns() >= at, "presented before its time");
    // Unfenced: held all the same.
    let head = start(guest, &flush(SHOWN));
    assert_eq!(recv(daemon), Msg::Frame);
    still_held(guest);
    send(daemon, &Msg::Present { at: 0 });
    finished(guest, head);

    // A resource no scanout shows, and a 2D resource (a console's dumb buffer) that one does:
    // not frames. They complete at once, and the next message is the Submit of the group
    // after them, not a Frame.
    call(guest, &flush(HIDDEN));
    call(
        guest,
        &virtio_gpu::resource_create_2d(CONSOLE, virtio_gpu::FORMAT_B8G8R8X8, edge, edge),
    );
    call(guest, &virtio_gpu::set_scanout(0, CONSOLE, whole));
    call(guest, &flush(CONSOLE));
    call(guest, &virtio_gpu::set_scanout(0, SHOWN, whole));
    let head = start(guest, &gl_submit(21));
    let (group, _) = submitted(daemon, Exec::Device);
    send(daemon, &Msg::Grant { group });
    finished(guest, head);
    assert!(matches!(recv(daemon), Msg::Completed { .. }));

    // Fill the frames waiting for a present with unfenced END_FRAME submits (these complete
    // at once); then a flush is neither announced nor held.
    let frames = [(LOAD_OP_END_FRAME, 0, 0); LOAD_MAX_COMMANDS];
    for _ in 0..MAX_PENDING_FRAMES / LOAD_MAX_COMMANDS {
        call(guest, &virtio_gpu::load_submit(LOAD_CTX, &frames));
        for _ in 0..LOAD_MAX_COMMANDS {
            assert_eq!(recv(daemon), Msg::Frame);
        }
    }
    call(guest, &virtio_gpu::with_fence(flush(SHOWN), 22));
    let head = start(guest, &gl_submit(23));
    let (group, _) = submitted(daemon, Exec::Device);
    send(daemon, &Msg::Grant { group });
    finished(guest, head);
    assert!(matches!(recv(daemon), Msg::Completed { .. }));
    // Presents for the waiting frames release them; flushes are held again after.
    for _ in 0..MAX_PENDING_FRAMES {
        send(daemon, &Msg::Present { at: 0 });
    }
    let head = start(guest, &flush(SHOWN));
    assert_eq!(recv(daemon), Msg::Frame);
    send(daemon, &Msg::Present { at: 0 });
    finished(guest, head);
}

fn flush(resource: u32) -> Vec<u8> {
    virtio_gpu::resource_flush(resource, virtio_gpu::Rect::new(0, 0, 64, 64))
}

fn cleanup(guest: VgpuGuest, server: TestServer, path: &Path) {
    drop(guest);
    server.wait(TIMEOUT).expect("server exits");
    let _ = std::fs::remove_file(path);
}
