//! vgpu-server: a vfio-user server presenting a virtio-gpu PCI function to a QEMU guest
//! (`-device vfio-user-pci`). One process serves one vGPU.
//!
//! Data path (see docs/ARCHITECTURE.md): [`relay`] frames every vfio-user message from QEMU
//! and has [`frame`] check it before the `vfio-user` crate's message loop sees it;
//! [`transport`] validates each access again and turns doorbell writes into worker kicks; [`device`] holds the function state; [`worker`]
//! walks the virtqueues ([`queue`]) over guest memory ([`memory`]); [`gpu`] decodes and executes
//! virtio-gpu commands; [`irq`] delivers MSI-X or INTx interrupts.

pub mod device;
pub mod fds;
pub mod frame;
pub mod gpu;
pub mod irq;
pub mod memory;
pub mod metrics;
pub mod pci;
pub mod queue;
pub mod ratelimit;
pub mod relay;
pub mod sandbox;
pub mod sched_client;
pub mod transport;
pub mod virtio_pci;
pub mod worker;

use std::io;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use log::{error, info, warn};
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_INFO_AUTOMASKED, VFIO_IRQ_INFO_EVENTFD, VFIO_IRQ_INFO_MASKABLE,
    VFIO_IRQ_INFO_NORESIZE, VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_NUM_IRQS,
    VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE, vfio_region_info,
};
use vfio_user::{IrqInfo, Server, ServerRegion};

use crate::device::Device;
use crate::frame::Limits;
use crate::gpu::DisplayConfig;
use crate::gpu::dump::DumpConfig;
use crate::metrics::{DeviceMetrics, inc};
use crate::relay::{Ended, Relay, RelayError};
use crate::transport::{DeviceSlot, NUM_REGIONS, Region, Transport};
use crate::worker::{WorkerError, WorkerHandle};

/// What one server process serves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Unix socket path to listen on (must not exist).
    pub socket: PathBuf,
    /// The scanout mode reported to the guest.
    pub display: DisplayConfig,
    /// Return after serving this many client connections; `None` serves forever.
    pub max_connections: Option<u32>,
    /// Write the scanout images as PNG files (headless display); `None` keeps them in memory.
    pub dump: Option<DumpConfig>,
    /// The virglrenderer library for 3D (VIRTIO_GPU_F_VIRGL); `None`, or a library that does
    /// not load, serves 2D only. virglrenderer can be initialised once per process.
    pub renderer: Option<String>,
    /// The host API the renderer uses (`--host-gl`).
    pub host_gl: mdev_backend::virgl::HostGl,
    /// The scheduler daemon to ask before GPU work runs (`--scheduler`, `--vm-name`); `None`
    /// runs everything at once.
    pub scheduler: Option<crate::sched_client::SchedConfig>,
    /// The VM's host-memory budget, in bytes (`--resource-memory-mb`;
    /// [`gpu::device::DEFAULT_RESOURCE_MEMORY_MB`] MiB by default): one budget for its 2D
    /// and 3D resources, blobs and entry lists, queued compute requests, and the compute
    /// backend's device memory and modules.
    pub resource_memory: u64,
    /// The backend of the compute capset (`--compute cpu|nvcuda`).
    pub compute: gpu::compute::ComputeKind,
    /// Longest one compute request of the PTX executor may run (`--compute-request-time`;
    /// [`mdev_backend::compute::backend::DEFAULT_REQUEST_TIME`] by default).
    pub compute_request_time: std::time::Duration,
    /// What runs guest kernels on the PTX executor (`--ptx-engine`; compiled code by
    /// default, the interpreter for what the compiler refuses).
    pub ptx_engine: mdev_backend::compute::ptx::Engine,
    /// The longest the relay and the worker spin for their next event before they block
    /// (`--busy-poll-us`; [`vgpu_schedd::busy_poll`]; zero: never).
    pub busy_poll: std::time::Duration,
}

/// Errors that stop the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket could not be created (it must not exist).
    #[error("listening on {path}: {source}")]
    Listen {
        /// Socket path.
        path: PathBuf,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// The device worker could not start.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// Accepting a connection failed.
    #[error("accepting a client: {0}")]
    Accept(#[source] io::Error),
    /// The relay failed: the message loop cannot be reached.
    #[error(transparent)]
    Relay(#[from] RelayError),
    /// The message loop's thread could not be started.
    #[error("starting the message loop thread: {0}")]
    Thread(#[source] io::Error),
    /// The dump directory is not a directory.
    #[error("dump directory {0} is not a directory")]
    DumpDir(PathBuf),
}

/// A listening vGPU server.
pub struct VgpuServer {
    /// The `vfio-user` crate's server on the private listener of [`relay::loop_link`], with
    /// the relay's connection queued on it.
    message_loop: Server,
    /// The relay's end of that connection.
    relay: Relay,
    core: Core,
}

/// What serving a connection takes besides the relay and the message loop.
struct Core {
    /// QEMU's socket.
    listening: Listening,
    config: ServerConfig,
    metrics: Arc<DeviceMetrics>,
    /// One worker for the life of the server, serving each connection's device in turn.
    worker: WorkerHandle,
}

/// The socket QEMU connects to, removed with the listener (bind fails on an existing path,
/// so it is ours).
struct Listening {
    listener: UnixListener,
    path: PathBuf,
}

impl Drop for Listening {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            warn!("removing {}: {e}", self.path.display());
        }
    }
}

impl std::fmt::Debug for VgpuServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VgpuServer")
            .field("config", &self.core.config)
            .finish_non_exhaustive()
    }
}

fn regions() -> Vec<ServerRegion> {
    (0..NUM_REGIONS)
        .map(|index| {
            let (size, flags) = match Region::from_index(index) {
                Some(r) => (
                    r.size(),
                    VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE,
                ),
                None => (0, 0),
            };
            let region_info = vfio_region_info {
                argsz: std::mem::size_of::<vfio_region_info>() as u32,
                flags,
                index,
                cap_offset: 0,
                size,
                offset: 0,
            };
            ServerRegion {
                region_info,
                sparse_areas: Vec::new(),
                mmap_fd: None,
            }
        })
        .collect()
}

fn irqs() -> Vec<IrqInfo> {
    (0..VFIO_PCI_NUM_IRQS)
        .map(|index| {
            let (flags, count) = match index {
                VFIO_PCI_INTX_IRQ_INDEX => (
                    VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_MASKABLE | VFIO_IRQ_INFO_AUTOMASKED,
                    1,
                ),
                VFIO_PCI_MSIX_IRQ_INDEX => (
                    VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE,
                    u32::from(pci::MSIX_VECTORS),
                ),
                _ => (0, 0),
            };
            IrqInfo {
                index,
                flags,
                count,
            }
        })
        .collect()
}

impl VgpuServer {
    /// Creates the listening socket. QEMU never retries, so bind before starting it.
    pub fn bind(config: ServerConfig) -> Result<VgpuServer, ServerError> {
        if let Some(dump) = &config.dump
            && !dump.dir.is_dir()
        {
            return Err(ServerError::DumpDir(dump.dir.clone()));
        }
        let listener =
            UnixListener::bind(&config.socket).map_err(|source| ServerError::Listen {
                path: config.socket.clone(),
                source,
            })?;
        let listening = Listening {
            listener,
            path: config.socket.clone(),
        };
        let dir = match config.socket.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        let (loop_listener, loop_end) = relay::loop_link(dir)?;
        let message_loop = Server::from_owned_fd(loop_listener.into(), true, irqs(), regions());
        let limits = Limits::new(
            regions().iter().map(|r| r.region_info.size).collect(),
            irqs().iter().map(|irq| irq.count).collect(),
        );
        info!(
            "listening on {} ({}x{} scanout)",
            config.socket.display(),
            config.display.width,
            config.display.height
        );
        let metrics = Arc::new(DeviceMetrics::default());
        let relay = Relay::new(loop_end, limits, metrics.clone(), config.busy_poll)?;
        let worker = WorkerHandle::spawn(
            config.dump.clone(),
            metrics.clone(),
            config
                .renderer
                .clone()
                .map(|library| (library, config.host_gl)),
            config.scheduler.clone(),
            config.socket.clone(),
            config.busy_poll,
        )?;
        Ok(VgpuServer {
            message_loop,
            relay,
            core: Core {
                listening,
                config,
                metrics,
                worker,
            },
        })
    }

    /// The device's counters.
    pub fn metrics(&self) -> Arc<DeviceMetrics> {
        self.core.metrics.clone()
    }

    /// Serves clients one after another: each connection gets a fresh device; when it ends
    /// (QEMU quit or was killed) all guest mappings are dropped. Returns after
    /// `max_connections` connections, if set, or when the message loop fails.
    pub fn serve(self) -> Result<(), ServerError> {
        let VgpuServer {
            message_loop,
            mut relay,
            core,
        } = self;
        let slot = Arc::new(DeviceSlot::default());
        let mut transport = Transport::new(slot.clone(), &core.worker, core.metrics.clone());
        let transport = &mut transport;
        // The crate's message loop runs on its own thread for the life of the server, fed
        // only by the relay on this one.
        std::thread::scope(|scope| {
            let looping = std::thread::Builder::new()
                .name("vfio-user".into())
                .spawn_scoped(scope, move || message_loop.run(transport))
                .map_err(ServerError::Thread)?;
            let mut served = 0u32;
            let mut result = Ok(());
            while core.config.max_connections.is_none_or(|max| served < max) {
                result = core.serve_one(&mut relay, &slot);
                if result.is_err() {
                    break;
                }
                served = served.saturating_add(1);
            }
            // Closing the relay's end ends the message loop.
            drop(relay);
            match looping.join() {
                Err(_) => error!("the vfio-user message loop panicked"),
                Ok(Err(e)) => error!("the vfio-user message loop failed: {e}"),
                Ok(Ok(())) => {}
            }
            result
        })
    }
}

impl Core {
    /// Serves one QEMU connection with a fresh device in `slot`.
    fn serve_one(&self, relay: &mut Relay, slot: &DeviceSlot) -> Result<(), ServerError> {
        let (client, _) = self
            .listening
            .listener
            .accept()
            .map_err(ServerError::Accept)?;
        let mut device = Device::new(
            self.config.display,
            self.metrics.clone(),
            self.worker.has_renderer(),
        );
        device.set_resource_budget(self.config.resource_memory);
        device.set_compute(
            self.config.compute,
            self.config.compute_request_time,
            self.config.ptx_engine,
        );
        let device = Arc::new(Mutex::new(device));
        self.worker.attach(device.clone());
        slot.set(Some(device));
        inc(&self.metrics.connections);
        let doorbell = |payload: &[u8]| match transport::posted_notify(payload) {
            Some(q) => {
                inc(&self.metrics.region_writes);
                inc(&self.metrics.notifies);
                self.worker.kick(q);
                true
            }
            None => false,
        };
        let relayed = relay.serve(client, &doorbell);
        // Every message of the connection has been handled. The worker writes the final dump
        // and lets go; the device and its guest mappings go with the slot's reference.
        self.worker.detach();
        slot.set(None);
        let counters: Vec<String> = self
            .metrics
            .snapshot()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let counters = counters.join(" ");
        match relayed? {
            Ended::Refused(e) => {
                warn!("client connection closed after a refused message ({e}); {counters}")
            }
            Ended::ClientClosed => info!("client disconnected; {counters}"),
        }
        Ok(())
    }
}
