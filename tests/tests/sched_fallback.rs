//! Fail closed, end to end: a device started with `--scheduler` (the real library code,
//! in-process, so its counters can be read) under a real `vgpu-schedd` process, driven by a
//! qtest guest running CUDA launches on the compute capset. A launch longer than the daemon's
//! group timeout runs as time slices far shorter than it, so the daemon keeps the device. When
//! the daemon is killed, the device dispatches under its fallback budget instead of running
//! unscheduled: one group at a time, groups held back, at most its share of the time; once the
//! daemon is back the device is admitted again and its groups ask the daemon. Everything is
//! measured with the device's own accounting (`DeviceMetrics`), and every wait is for a state,
//! bounded. virglrenderer may be initialised once per process, so everything runs in one test.

use std::time::{Duration, Instant};

use mdev_backend::compute::backend::{ContextId, DEFAULT_STREAM, FunctionId, ModuleId};
use mdev_backend::compute::wire::{Reply, Request};
use vgpu_guest_drivers::virtio_gpu::{self, CAPSET_COMPUTE, CONTROL_QUEUE, CTRL_HDR_SIZE};
use vgpu_schedd::proto::VmName;
use vgpu_server::sched_client::{
    DEFAULT_FALLBACK_PERCENT, FALLBACK_PERIOD_NS, FallbackShare, SchedConfig,
};
use vgpu_tests::compute::ComputeBlob;
use vgpu_tests::daemon::Schedd;
use vgpu_tests::server::{TestServer, VgpuGuest};
use vgpu_tests::skip_without_qemu;

const VM: &str = "vm-fallback";
const CTX: u32 = 9;
/// The daemon's group timeout here: a device with a group longer than this is dropped.
const GROUP_TIMEOUT_MS: u64 = 200;
/// How long the slow launch runs when it has a core to itself: more than twice the group
/// timeout, and a third of the executor's own time limit per request
/// (`DEFAULT_REQUEST_TIME`, 1.5 s of wall time), so that it stays within it when the host's
/// cores are busy with other work too (700 ms ran past the limit there).
const SLOW: Duration = Duration::from_millis(500);
const _: () = assert!(
    3 * SLOW.as_millis() <= mdev_backend::compute::backend::DEFAULT_REQUEST_TIME.as_millis()
        && SLOW.as_millis() > 2 * GROUP_TIMEOUT_MS as u128
);
/// How long one group of the kill case runs: far above a request's round trip through qtest,
/// so that the time between groups is the budget's, not the test's.
const SHORT: Duration = Duration::from_millis(15);
/// Groups run back to back while the daemon is dead.
const GROUPS: u32 = 24;
/// Longest wait for a state (admission, fallback, a completion).
const WAIT: Duration = Duration::from_secs(30);
const RESP_OK_NODATA: u32 = 0x1100;
/// A kernel of one warp that counts to its parameter.
const SPIN: &str = ".version 7.0\n.target sm_70\n.address_size 64\n\
    .visible .entry spin(.param .u32 n)\n{\n.reg .u32 %r<3>;\n.reg .pred %p;\n\
    ld.param.u32 %r1, [n];\nmov.u32 %r2, 0;\nLOOP:\nadd.u32 %r2, %r2, 1;\n\
    setp.lt.u32 %p, %r2, %r1;\n@%p bra LOOP;\nret;\n}\n";

/// The device's counter `name`.
fn counter(server: &TestServer, name: &str) -> u64 {
    server.counter(name)
}

/// Waits until `what` holds, at most [`WAIT`].
fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < WAIT, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The guest's compute context with the spin kernel loaded, and a second blob for a launch
/// queued behind one still in flight (each request is read from its blob).
struct Spin {
    blob: ComputeBlob,
    behind: ComputeBlob,
    ctx: ContextId,
    function: FunctionId,
    fence: u64,
}

impl Spin {
    fn load(guest: &mut VgpuGuest) -> Spin {
        let create = virtio_gpu::ctx_create(CTX, CAPSET_COMPUTE, b"cuda");
        assert_eq!(guest.control_header(&create).ctrl_type, RESP_OK_NODATA);
        let blob = ComputeBlob::create(guest, 60, 2, 64 << 10);
        let behind = ComputeBlob::create(guest, 61, 2, 64 << 10);
        let Reply::Id(c) = blob.exchange(guest, CTX, &Request::ContextCreate) else {
            panic!("context")
        };
        let ctx = ContextId(c);
        let module = Request::ModuleLoad {
            ctx,
            image: SPIN.as_bytes().to_vec(),
        };
        let Reply::Id(m) = blob.exchange(guest, CTX, &module) else {
            panic!("module")
        };
        let function = Request::Function {
            ctx,
            module: ModuleId(m),
            name: "spin".into(),
        };
        let Reply::Function { id, .. } = blob.exchange(guest, CTX, &function) else {
            panic!("function")
        };
        Spin {
            blob,
            behind,
            ctx,
            function: id,
            fence: 100,
        }
    }

    /// Queues one launch counting to `n` (a Compute group) through the first blob, or the
    /// second one (`behind`); returns its head.
    fn start(&mut self, guest: &mut VgpuGuest, n: u32, behind: bool) -> u16 {
        let launch = Request::Batch(vec![
            Request::Launch {
                ctx: self.ctx,
                function: self.function,
                grid: [1, 1, 1],
                block: [32, 1, 1],
                shared_bytes: 0,
                stream: DEFAULT_STREAM,
                params: n.to_le_bytes().to_vec(),
                cooperative: false,
            },
            Request::ContextSynchronize { ctx: self.ctx },
        ]);
        self.fence += 1;
        let blob = if behind { &self.behind } else { &self.blob };
        let submit = blob.put(guest, CTX, &launch, self.fence);
        let qt = guest.vm.qtest();
        guest
            .dev
            .request(qt, CONTROL_QUEUE, &[&submit], &[CTRL_HDR_SIZE as u32])
            .expect("request queued")
    }

    /// Waits for the next completion, which must be `head`'s, a launch through the first blob
    /// or the second one (`behind`) that ran.
    fn finished(&self, guest: &mut VgpuGuest, head: u16, behind: bool) {
        let qt = guest.vm.qtest();
        let done = guest
            .dev
            .wait_used(qt, CONTROL_QUEUE, WAIT)
            .expect("the launch completes");
        assert_eq!(done.used.id, u32::from(head));
        assert!(
            matches!(
                if behind { &self.behind } else { &self.blob }.reply(guest),
                Reply::Batch {
                    completed: 2,
                    error: None,
                    ..
                }
            ),
            "the launch ran"
        );
    }

    /// One launch counting to `n`, waited for; returns how long the guest waited.
    fn call(&mut self, guest: &mut VgpuGuest, n: u32) -> Duration {
        let start = Instant::now();
        let head = self.start(guest, n, false);
        self.finished(guest, head, false);
        start.elapsed()
    }
}

#[test]
fn a_device_the_daemon_drops_or_loses_dispatches_under_its_fallback_budget() {
    if skip_without_qemu() {
        return;
    }
    let timeout = GROUP_TIMEOUT_MS.to_string();
    let mut daemon =
        Schedd::start_with(None, "info", &["--group-timeout-ms", &timeout]).expect("vgpu-schedd");
    let server = TestServer::start_3d_scheduled(SchedConfig {
        socket: daemon.socket(),
        vm_name: VmName::new(VM).unwrap(),
        fallback: FallbackShare::default(),
    });
    let mut guest = VgpuGuest::start(&server);
    let Some(features) = guest.virgl_features() else {
        return;
    };
    guest.bring_up_with(features);
    wait_for("the daemon admits the device", || {
        counter(&server, "sched_fallback") == 0
    });
    let mut spin = Spin::load(&mut guest);

    // Calibrate the kernel on this machine (admitted: the daemon grants each launch): the
    // difference between a short and a long count, so the round trip drops out. The counts
    // take tens of milliseconds (about 17 ns a count compiled), so that the difference is the
    // kernel's and not the noise of a busy host: with 20,000 and 100,000 counts (1.2 and
    // 2.6 ms) a round trip slowed by other work halved the difference, and the slow launch
    // counted to twice its time and past the executor's limit.
    let probe = 500_000;
    let mut best = |n: u32| (0..3).map(|_| spin.call(&mut guest, n)).min().unwrap();
    let (short, long) = (best(probe), best(5 * probe));
    let per_count = long.saturating_sub(short).as_secs_f64() / f64::from(4 * probe);
    let count = |d: Duration| (d.as_secs_f64() / per_count).clamp(1.0, f64::from(u32::MAX)) as u32;
    eprintln!(
        "spin: {probe} counts in {short:?}, {} in {long:?}",
        5 * probe
    );
    assert_eq!(counter(&server, "sched_fallback_groups"), 0, "all asked");

    // 1. A launch running several group timeouts is time-sliced (`gpu::compute::SLICE`):
    // each slice is a group far shorter than the daemon's group timeout, so the daemon never
    // drops the device, and a launch queued behind it waits for it and runs once it is done.
    // (The device's fallback after a drop for a timeout is covered by the unit tests of
    // `sched_client`; a compute group can no longer outlive the timeout.)
    let slow = spin.start(&mut guest, count(SLOW), false);
    let next = spin.start(&mut guest, count(SHORT), true);
    spin.finished(&mut guest, slow, false);
    spin.finished(&mut guest, next, true);
    assert_eq!(
        counter(&server, "sched_fallback_entered"),
        0,
        "the daemon kept the device:\n{}",
        daemon.log()
    );
    assert!(
        !daemon.log().contains("not completed within"),
        "no group outlived the daemon's group timeout:\n{}",
        daemon.log()
    );

    // For comparison (reported, not asserted): the same groups while admitted, the only VM.
    let alone = Instant::now();
    for _ in 0..GROUPS {
        spin.call(&mut guest, count(SHORT));
    }
    eprintln!("admitted, alone: {GROUPS} groups in {:?}", alone.elapsed());

    // 2. The daemon dies: the device falls back at once, and while the guest runs groups back
    // to back it gets at most its share of the time.
    let before = |name| counter(&server, name);
    let (groups0, delayed0, charged0) = (
        before("sched_fallback_groups"),
        before("sched_fallback_delayed"),
        before("sched_fallback_gpu_ns"),
    );
    daemon.kill();
    wait_for("the device notices the daemon is gone", || {
        counter(&server, "sched_fallback") == 1
    });
    // Announced (and counted) just after the fallback state is set.
    assert_eq!(server.wait_counter("sched_fallback_entered", |n| n >= 1), 1);
    let window = Instant::now();
    for _ in 0..GROUPS {
        spin.call(&mut guest, count(SHORT));
    }
    let window = window.elapsed();
    let groups = counter(&server, "sched_fallback_groups") - groups0;
    let delayed = counter(&server, "sched_fallback_delayed") - delayed0;
    let charged = Duration::from_nanos(counter(&server, "sched_fallback_gpu_ns") - charged0);
    let share = charged.as_secs_f64() / window.as_secs_f64();
    eprintln!(
        "daemon dead: {groups} groups, {delayed} delayed, {charged:?} of GPU time in {window:?} \
         ({:.1}% of the time; the share is {DEFAULT_FALLBACK_PERCENT}%)",
        share * 100.0
    );
    // A launch longer than a slice is several groups.
    assert!(
        groups >= u64::from(GROUPS),
        "every launch ran under the fallback budget ({groups} groups)"
    );
    assert!(delayed >= 1, "the budget held groups back");
    // The budget allows its share of the window, one period's worth it held at the start and
    // one group's overdraw; twice the share is far above that, and far below what running
    // unscheduled gives (the groups back to back).
    let period = Duration::from_nanos(FALLBACK_PERIOD_NS);
    let allowed = window.mul_f64(2.0 * f64::from(DEFAULT_FALLBACK_PERCENT) / 100.0) + period;
    assert!(
        charged <= allowed,
        "{charged:?} of GPU time in {window:?}: more than the fallback share allows"
    );

    // 3. The daemon is back: the device is admitted again and asks it for every group.
    daemon.restart().expect("vgpu-schedd restarts");
    wait_for("the device is admitted by the restarted daemon", || {
        counter(&server, "sched_fallback") == 0
    });
    let groups_now = counter(&server, "sched_fallback_groups");
    spin.call(&mut guest, count(SHORT));
    assert_eq!(
        counter(&server, "sched_fallback_groups"),
        groups_now,
        "admitted, the launch asked the daemon"
    );
    wait_for("the restarted daemon has seen the launch", || {
        daemon
            .vm_stats(VM)
            .ok()
            .and_then(|vm| vm["completed"].as_u64())
            .is_some_and(|g| g >= 1)
    });
    eprintln!(
        "fallback time in all: {} ms",
        counter(&server, "sched_fallback_ns") / 1_000_000
    );
    drop(guest);
    server.wait(WAIT).expect("server exits");
}
