//! Our vfio-user server, run in-process for tests and benchmarks, and a fixture that brings a
//! qtest QEMU with the vGPU up to DRIVER_OK.
//!
//! The server runs on its own thread with exactly the library code the `vgpu-server` binary
//! runs ([`VgpuServer::bind`] then [`VgpuServer::serve`]), serving a fixed number of
//! connections so that it exits by itself once its VMs are gone.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vgpu_guest_drivers::guest_ram::GuestRam;
use vgpu_guest_drivers::pci::{self, PciAllocator};
use vgpu_guest_drivers::virtio_gpu::{
    CMD_GET_DISPLAY_INFO, CONTROL_QUEUE, CTRL_HDR_SIZE, CURSOR_QUEUE, CtrlHeader,
    DISPLAY_INFO_SIZE, DisplayInfo,
};
use vgpu_guest_drivers::virtio_pci::{VIRTIO_PCI_VENDOR_ID, VirtioPciDevice};
use vgpu_schedd::busy_poll;
use vgpu_server::gpu::DisplayConfig;
use vgpu_server::gpu::dump::DumpConfig;
use vgpu_server::metrics::DeviceMetrics;
use vgpu_server::sched_client::SchedConfig;
use vgpu_server::{ServerConfig, ServerError, VgpuServer};

use crate::{QtestVm, TempDir, VmConfig, vfio_user_pci_device};

/// Device id of virtio-gpu (0x1040 + 16).
pub const VIRTIO_GPU_DEVICE_ID: u16 = 0x1050;
/// MSI-X vector the fixture assigns to configuration changes.
pub const CONFIG_VECTOR: u16 = 0;
/// MSI-X vector of the control queue.
pub const CONTROL_VECTOR: u16 = 1;
/// MSI-X vector of the cursor queue.
pub const CURSOR_VECTOR: u16 = 2;
/// Longest wait for a request's completion, on a host whose cores are all busy with other
/// work too (`qemu-scripts/test.sh --loaded`).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest wait for a counter to reach what a test asserts ([`TestServer::wait_counter`]).
pub const COUNTER_TIMEOUT: Duration = Duration::from_secs(10);
/// How often [`TestServer::wait_counter`] reads the counter.
const COUNTER_POLL: Duration = Duration::from_millis(2);
/// Control queue size the fixture uses.
pub const CONTROL_QUEUE_SIZE: u16 = 64;
/// Cursor queue size the fixture uses.
pub const CURSOR_QUEUE_SIZE: u16 = 16;

/// Routes the server's `log` output into the test's captured output, once per process
/// (`RUST_LOG` overrides the default `info`), filtered as vgpu-server's own logger filters it
/// (`mdev_backend::logger`: the code generator at warn).
pub fn init_logging() {
    let _ = mdev_backend::logger(log::LevelFilter::Info)
        .is_test(true)
        .try_init();
}

/// A `vgpu-server` listening on a socket in its own temporary directory.
#[derive(Debug)]
pub struct TestServer {
    socket: PathBuf,
    metrics: Arc<DeviceMetrics>,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
    _dir: TempDir,
}

impl TestServer {
    /// Starts a server with the default 1024x768 scanout that serves `connections` clients.
    pub fn start(connections: u32) -> TestServer {
        Self::start_with(DisplayConfig::default(), connections)
    }

    /// Starts a server reporting `display` that serves `connections` clients.
    pub fn start_with(display: DisplayConfig, connections: u32) -> TestServer {
        Self::start_dumping(display, connections, None)
    }

    /// Starts a server with the virgl renderer (3D), serving one client. virglrenderer may be
    /// initialised once per process: one such server per test binary.
    pub fn start_3d() -> TestServer {
        Self::start_full(
            DisplayConfig::default(),
            1,
            None,
            Some(mdev_backend::virgl::DEFAULT_LIBRARY.to_string()),
            None,
            busy_poll::DEFAULT_MAX,
        )
    }

    /// Starts a server with the virgl renderer that asks the scheduler daemon of `scheduler`
    /// before GPU work runs, serving one client (one such server per test binary, as with
    /// [`TestServer::start_3d`]).
    pub fn start_3d_scheduled(scheduler: SchedConfig) -> TestServer {
        Self::start_full(
            DisplayConfig::default(),
            1,
            None,
            Some(mdev_backend::virgl::DEFAULT_LIBRARY.to_string()),
            Some(scheduler),
            busy_poll::DEFAULT_MAX,
        )
    }

    /// Starts a server reporting `display` that serves `connections` clients and, with
    /// `dump`, writes its scanout images there.
    pub fn start_dumping(
        display: DisplayConfig,
        connections: u32,
        dump: Option<DumpConfig>,
    ) -> TestServer {
        Self::start_full(
            display,
            connections,
            dump,
            None,
            None,
            busy_poll::DEFAULT_MAX,
        )
    }

    /// Starts a 2D server serving `connections` clients whose relay and worker spin up to
    /// `busy_poll` before they block (see `vgpu_schedd::busy_poll`).
    pub fn start_polling(connections: u32, busy_poll: Duration) -> TestServer {
        Self::start_full(
            DisplayConfig::default(),
            connections,
            None,
            None,
            None,
            busy_poll,
        )
    }

    fn start_full(
        display: DisplayConfig,
        connections: u32,
        dump: Option<DumpConfig>,
        renderer: Option<String>,
        scheduler: Option<SchedConfig>,
        busy_poll: Duration,
    ) -> TestServer {
        init_logging();
        let dir = TempDir::new("vgpu-server").expect("temporary directory");
        let socket = dir.path().join("vgpu.sock");
        let config = ServerConfig {
            socket: socket.clone(),
            display,
            max_connections: Some(connections),
            dump,
            renderer,
            host_gl: Default::default(),
            scheduler,
            resource_memory: vgpu_server::gpu::device::DEFAULT_RESOURCE_MEMORY_MB << 20,
            compute: vgpu_server::gpu::compute::ComputeKind::Cpu,
            compute_request_time: mdev_backend::compute::backend::DEFAULT_REQUEST_TIME,
            ptx_engine: mdev_backend::compute::ptx::Engine::default(),
            busy_poll,
        };
        let server = VgpuServer::bind(config).expect("server binds its socket");
        let metrics = server.metrics();
        let thread = std::thread::Builder::new()
            .name("vgpu-server".into())
            .spawn(move || server.serve())
            .expect("server thread");
        TestServer {
            socket,
            metrics,
            thread: Some(thread),
            _dir: dir,
        }
    }

    /// The socket QEMU connects to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The device's counters.
    pub fn metrics(&self) -> &DeviceMetrics {
        &self.metrics
    }

    /// One counter by name (see [`DeviceMetrics::snapshot`]).
    pub fn counter(&self, name: &str) -> u64 {
        self.metrics
            .snapshot()
            .into_iter()
            .find(|(k, _)| *k == name)
            .map_or_else(|| panic!("no counter {name}"), |(_, v)| v)
    }

    /// Waits up to [`COUNTER_TIMEOUT`] until counter `name` satisfies `reached` and returns
    /// its value; panics with the last value read if it never does. For a counter the device
    /// updates after the guest can see what it counts (an interrupt after its used entry, a
    /// dump after its file, a fallback's announcement after its state), which a read right
    /// after would find one short on a busy host.
    pub fn wait_counter(&self, name: &str, reached: impl Fn(u64) -> bool) -> u64 {
        let deadline = Instant::now() + COUNTER_TIMEOUT;
        loop {
            let value = self.counter(name);
            if reached(value) {
                return value;
            }
            assert!(
                Instant::now() < deadline,
                "counter {name} still {value} after {COUNTER_TIMEOUT:?}"
            );
            std::thread::sleep(COUNTER_POLL);
        }
    }

    /// The `-device` argument for a VM using this server.
    pub fn device_arg(&self) -> String {
        vfio_user_pci_device(&self.socket)
    }

    /// Waits until the server thread has served all its connections and returned.
    pub fn wait(mut self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let thread = self.thread.take().expect("waited once");
        while !thread.is_finished() {
            if Instant::now() > deadline {
                return Err(format!("server still running after {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        match thread.join() {
            Ok(result) => result.map_err(|e| e.to_string()),
            Err(_) => Err("server thread panicked".into()),
        }
    }
}

/// A qtest VM with the vGPU at DRIVER_OK and both queues enabled; with MSI-X, vector 0 is
/// configuration changes, 1 the control queue and 2 the cursor queue.
#[derive(Debug)]
pub struct VgpuGuest {
    /// The VM (dropped first, so QEMU is gone before the server is waited for).
    pub vm: QtestVm,
    /// The virtio-pci driver of the vGPU.
    pub dev: VirtioPciDevice,
    /// Guest RAM allocator for rings and buffers.
    pub ram: GuestRam,
    msix: bool,
}

impl VgpuGuest {
    /// Starts QEMU against `server` and brings the device up with MSI-X.
    pub fn start(server: &TestServer) -> VgpuGuest {
        Self::start_with(server, true)
    }

    /// Starts QEMU against `server` and brings the device up, with MSI-X or with INTx only
    /// (every vector NO_VECTOR).
    pub fn start_with(server: &TestServer, msix: bool) -> VgpuGuest {
        Self::attach(server.socket(), msix)
    }

    /// Starts QEMU against the vfio-user server listening on `socket` (ours, in-process or
    /// not) and brings the device up.
    pub fn attach(socket: &Path, msix: bool) -> VgpuGuest {
        let config = VmConfig::default().device(vfio_user_pci_device(socket));
        let mut vm = QtestVm::launch(&config).expect("QEMU starts");
        let mut ram = vm.guest_ram();
        let qt = vm.qtest();
        let pci = pci::find_device(qt, VIRTIO_PCI_VENDOR_ID, VIRTIO_GPU_DEVICE_ID)
            .expect("vGPU on bus 0");
        let mut dev =
            VirtioPciDevice::probe(qt, pci, &mut PciAllocator::new()).expect("virtio-pci probe");
        if msix {
            dev.enable_msix(qt, &mut ram, 3).expect("MSI-X");
        }
        let mut guest = VgpuGuest { vm, dev, ram, msix };
        guest.bring_up();
        guest
    }

    /// The device's features when it offers VIRTIO_GPU_F_VIRGL (the server found
    /// virglrenderer); `None` after printing a skip message otherwise, or a panic when
    /// `VGPU_REQUIRE_VIRGL` is set (test.sh).
    pub fn virgl_features(&mut self) -> Option<u64> {
        let qt = self.vm.qtest();
        let features = self.dev.device_features(qt).expect("device features");
        if features & 1 << vgpu_guest_drivers::virtio_gpu::F_VIRGL != 0 {
            return Some(features);
        }
        assert!(
            std::env::var_os("VGPU_REQUIRE_VIRGL").is_none(),
            "VIRTIO_GPU_F_VIRGL not offered: the server found no virglrenderer"
        );
        eprintln!("SKIPPED: no virglrenderer on this host");
        None
    }

    /// (Re)negotiates VERSION_1, sets up both queues and sets DRIVER_OK.
    pub fn bring_up(&mut self) {
        self.bring_up_with(1u64 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1)
    }

    /// (Re)negotiates exactly `features` (which must be offered), sets up both queues and sets
    /// DRIVER_OK.
    pub fn bring_up_with(&mut self, wanted: u64) {
        self.try_bring_up_with(wanted, CONTROL_QUEUE_SIZE)
            .expect("device bring-up");
    }

    /// [`Self::bring_up_with`] with a control queue of `control_size` descriptors, returning
    /// what failed instead of panicking (a hostile guest's driver re-initialises the device
    /// many times and must survive a device that refuses).
    pub fn try_bring_up_with(
        &mut self,
        wanted: u64,
        control_size: u16,
    ) -> Result<(), vgpu_guest_drivers::virtio_pci::VirtioError> {
        let qt = self.vm.qtest();
        let features = self.dev.negotiate(qt, wanted)?;
        if features != wanted {
            return Err(vgpu_guest_drivers::virtio_pci::VirtioError::FeaturesRejected(features));
        }
        let vector = |v| self.msix.then_some(v);
        let (config, control, cursor) = (
            vector(CONFIG_VECTOR),
            vector(CONTROL_VECTOR),
            vector(CURSOR_VECTOR),
        );
        self.dev.set_config_vector(qt, config)?;
        self.dev
            .setup_queue(qt, &mut self.ram, CONTROL_QUEUE, control_size, control)?;
        self.dev
            .setup_queue(qt, &mut self.ram, CURSOR_QUEUE, CURSOR_QUEUE_SIZE, cursor)?;
        self.dev.driver_ok(qt)
    }

    /// Sends one request on the control queue and returns the response bytes (`reply`
    /// bytes writable).
    pub fn control(&mut self, request: &[u8], reply: u32) -> Vec<u8> {
        let qt = self.vm.qtest();
        let done = self
            .dev
            .transact(qt, CONTROL_QUEUE, &[request], &[reply], REQUEST_TIMEOUT)
            .expect("request completes");
        done.writable.expect("our chain").remove(0)
    }

    /// Sends one request on the control queue and returns its response header.
    pub fn control_header(&mut self, request: &[u8]) -> CtrlHeader {
        CtrlHeader::parse(&self.control(request, CTRL_HDR_SIZE as u32)).expect("response header")
    }

    /// Sends GET_DISPLAY_INFO (fenced with `fence`, if given) on the control queue and
    /// returns the parsed response.
    pub fn display_info(&mut self, fence: Option<u64>) -> DisplayInfo {
        let qt = self.vm.qtest();
        let request = match fence {
            Some(id) => CtrlHeader::fenced(CMD_GET_DISPLAY_INFO, id),
            None => CtrlHeader::new(CMD_GET_DISPLAY_INFO),
        }
        .to_bytes();
        let done = self
            .dev
            .transact(
                qt,
                CONTROL_QUEUE,
                &[&request],
                &[DISPLAY_INFO_SIZE as u32],
                REQUEST_TIMEOUT,
            )
            .expect("GET_DISPLAY_INFO completes");
        assert_eq!(done.used.len, DISPLAY_INFO_SIZE as u32);
        DisplayInfo::parse(&done.writable.expect("our chain")[0]).expect("display info")
    }
}
