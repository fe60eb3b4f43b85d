//! A qtest load guest: a `vgpu-server` connected to a `vgpu-schedd` under a VM name, and a
//! qtest QEMU whose harness driver creates a load context (capset 20) and submits fenced
//! OCCUPY and END_FRAME requests through the real vfio-user path, as `vgpu-load` does in a
//! real guest. Used by the multi-guest tests and by `vgpu-bench --on qtest`. Failures panic
//! with the device's log, as the rest of the harness does.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use vgpu_guest_drivers::virtio_gpu::{
    self, CAPSET_LOAD, CONTROL_QUEUE, CTRL_HDR_SIZE, CtrlHeader, LOAD_OP_END_FRAME, LOAD_OP_OCCUPY,
};

use crate::daemon::Schedd;
use crate::guest::{ServerProcess, server_binary};
use crate::server::VgpuGuest;

/// Longest wait for one request (context creation, a fence) of a qtest load guest.
pub const TIMEOUT: Duration = Duration::from_secs(10);
const RESP_OK_NODATA: u32 = 0x1100;
const LOAD_CTX: u32 = 3;

/// One guest: its device process (connected to the daemon) and its qtest QEMU.
pub struct LoadVm {
    pub name: String,
    /// Dropped first: QEMU goes before its device process.
    pub guest: VgpuGuest,
    pub server: ServerProcess,
    next_fence: u64,
    pending: VecDeque<u16>,
}

impl std::fmt::Debug for LoadVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadVm")
            .field("name", &self.name)
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl LoadVm {
    /// Starts a device process for `name` on the daemon's socket and a guest that creates a
    /// load context. `None` when virglrenderer (hence CONTEXT_INIT) is missing and not required.
    pub fn start(daemon: &Schedd, name: &str) -> Option<LoadVm> {
        Self::start_env(daemon, name, &[])
    }

    /// [`LoadVm::start`] with `env` added to the device process's environment.
    pub fn start_env(daemon: &Schedd, name: &str, env: &[(&str, &str)]) -> Option<LoadVm> {
        let socket = daemon.socket();
        let args = [
            "--scheduler".to_string(),
            socket.display().to_string(),
            "--vm-name".to_string(),
            name.to_string(),
        ];
        let binary = server_binary().expect("vgpu-server binary");
        let server =
            ServerProcess::start_env(&binary, true, &args, env).expect("vgpu-server starts");
        let mut guest = VgpuGuest::attach(server.socket(), true);
        let qt = guest.vm.qtest();
        let features = guest.dev.device_features(qt).unwrap();
        if features & 1 << virtio_gpu::F_CONTEXT_INIT == 0 {
            assert!(
                std::env::var_os("VGPU_REQUIRE_VIRGL").is_none(),
                "CONTEXT_INIT not offered: the server found no virglrenderer:\n{}",
                server.log()
            );
            eprintln!("SKIPPED: no virglrenderer on this host");
            return None;
        }
        guest.bring_up_with(features);
        let mut vm = LoadVm {
            name: name.to_owned(),
            guest,
            server,
            next_fence: 1,
            pending: VecDeque::new(),
        };
        vm.submit_raw(&virtio_gpu::ctx_create(LOAD_CTX, CAPSET_LOAD, b"load"));
        vm.wait_one(TIMEOUT).expect("CTX_CREATE completes");
        Some(vm)
    }

    fn submit_raw(&mut self, request: &[u8]) {
        let qt = self.guest.vm.qtest();
        let head = self
            .guest
            .dev
            .request(qt, CONTROL_QUEUE, &[request], &[CTRL_HDR_SIZE as u32])
            .expect("request queued");
        self.pending.push_back(head);
    }

    /// Queues one fenced load submit of `commands`.
    pub fn submit(&mut self, commands: &[(u32, u32, u64)]) {
        let fence = self.next_fence;
        self.next_fence += 1;
        let request = virtio_gpu::with_fence(virtio_gpu::load_submit(LOAD_CTX, commands), fence);
        self.submit_raw(&request);
    }

    /// Queues one fenced END_FRAME: its fence is the frame's present, released when the
    /// scheduler paces it.
    pub fn end_frame(&mut self) {
        self.submit(&[(LOAD_OP_END_FRAME, 0, 0)]);
    }

    /// Requests queued and not yet completed.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Queues one fenced OCCUPY of `us` µs.
    pub fn occupy(&mut self, us: u64) {
        self.submit(&[(LOAD_OP_OCCUPY, 0, us)]);
    }

    /// Waits up to `timeout` for the oldest pending request; `None` if it is not done.
    pub fn wait_one(&mut self, timeout: Duration) -> Option<Instant> {
        let qt = self.guest.vm.qtest();
        let done = self.guest.dev.wait_used(qt, CONTROL_QUEUE, timeout).ok()?;
        let at = Instant::now();
        let head = self.pending.pop_front().expect("a pending request");
        assert_eq!(done.used.id, u32::from(head), "{}: in order", self.name);
        let reply = done.writable.expect("our chain").remove(0);
        let hdr = CtrlHeader::parse(&reply).unwrap();
        assert_eq!(
            hdr.ctrl_type, RESP_OK_NODATA,
            "{}: request refused",
            self.name
        );
        Some(at)
    }

    /// Waits for every pending request.
    pub fn drain(&mut self) -> Vec<Instant> {
        let mut times = Vec::new();
        while !self.pending.is_empty() {
            let at = self.wait_one(TIMEOUT);
            times.push(at.unwrap_or_else(|| {
                panic!("{}: fence not completed:\n{}", self.name, self.server.log())
            }));
        }
        times
    }

    /// How many pending requests have completed by now (without waiting).
    pub fn count_done(&mut self) -> usize {
        let mut n = 0;
        while !self.pending.is_empty() && self.wait_one(Duration::ZERO).is_some() {
            n += 1;
        }
        n
    }
}
