//! vgpu-server: a vfio-user server presenting a virtio-gpu PCI function to a QEMU guest
//! (`-device vfio-user-pci`). One process serves one vGPU.
//!
//! Data path (see docs/ARCHITECTURE.md): [`transport`] validates every vfio-user message and
//! turns doorbell writes into worker kicks; [`device`] holds the function state; [`worker`]
//! walks the virtqueues ([`queue`]) over guest memory ([`memory`]); [`gpu`] decodes and executes
//! virtio-gpu commands; [`irq`] delivers MSI-X or INTx interrupts.

pub mod device;
pub mod fds;
pub mod gpu;
pub mod irq;
pub mod memory;
pub mod metrics;
pub mod pci;
pub mod queue;
pub mod ratelimit;
pub mod sandbox;
pub mod sched_client;
pub mod transport;
pub mod virtio_pci;
pub mod worker;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use log::{error, info, warn};
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_INFO_AUTOMASKED, VFIO_IRQ_INFO_EVENTFD, VFIO_IRQ_INFO_MASKABLE,
    VFIO_IRQ_INFO_NORESIZE, VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_NUM_IRQS,
    VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE, vfio_region_info,
};
use vfio_user::{IrqInfo, Server, ServerRegion};

use crate::device::Device;
use crate::gpu::DisplayConfig;
use crate::gpu::dump::DumpConfig;
use crate::metrics::{DeviceMetrics, inc};
use crate::transport::{NUM_REGIONS, Region, Transport};
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
    /// The scheduler daemon to ask before GPU work runs (`--scheduler`, `--vm-name`); `None`
    /// runs everything at once.
    pub scheduler: Option<crate::sched_client::SchedConfig>,
    /// Host-memory budget of the guest's 2D and 3D resources, in bytes
    /// (`--resource-memory-mb`; [`gpu::device::DEFAULT_RESOURCE_MEMORY_MB`] MiB by default).
    pub resource_memory: u64,
}

/// Errors that stop the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket could not be created.
    #[error("listening on {path}: {source}")]
    Listen {
        /// Socket path.
        path: PathBuf,
        /// The crate's error.
        #[source]
        source: vfio_user::Error,
    },
    /// The device worker could not start.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// Accepting a connection failed.
    #[error("accepting a client: {0}")]
    Accept(#[source] vfio_user::Error),
    /// The dump directory is not a directory.
    #[error("dump directory {0} is not a directory")]
    DumpDir(PathBuf),
}

/// A listening vGPU server.
pub struct VgpuServer {
    server: Server,
    config: ServerConfig,
    metrics: Arc<DeviceMetrics>,
    /// One worker for the life of the server, serving each connection's device in turn.
    worker: WorkerHandle,
}

impl std::fmt::Debug for VgpuServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VgpuServer")
            .field("config", &self.config)
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
        let server = Server::new(&config.socket, true, irqs(), regions()).map_err(|source| {
            ServerError::Listen {
                path: config.socket.clone(),
                source,
            }
        })?;
        info!(
            "listening on {} ({}x{} scanout)",
            config.socket.display(),
            config.display.width,
            config.display.height
        );
        let metrics = Arc::new(DeviceMetrics::default());
        let worker = WorkerHandle::spawn(
            config.dump.clone(),
            metrics.clone(),
            config.renderer.clone(),
            config.scheduler.clone(),
            config.socket.clone(),
        )?;
        Ok(VgpuServer {
            server,
            config,
            metrics,
            worker,
        })
    }

    /// The device's counters.
    pub fn metrics(&self) -> Arc<DeviceMetrics> {
        self.metrics.clone()
    }

    /// Serves clients one after another: each connection gets a fresh device; when it ends
    /// (QEMU quit or was killed) all guest mappings are dropped. Returns after
    /// `max_connections` connections, if set.
    pub fn serve(self) -> Result<(), ServerError> {
        let mut served = 0u32;
        while self.config.max_connections.is_none_or(|max| served < max) {
            self.serve_one()?;
            served = served.saturating_add(1);
        }
        Ok(())
    }

    fn serve_one(&self) -> Result<(), ServerError> {
        let mut device = Device::new(
            self.config.display,
            self.metrics.clone(),
            self.worker.has_renderer(),
        );
        device.set_resource_budget(self.config.resource_memory);
        let device = Arc::new(Mutex::new(device));
        self.worker.attach(device.clone());
        let mut transport = Transport::new(device, &self.worker, self.metrics.clone());
        inc(&self.metrics.connections);
        // The crate's message loop can panic on a malformed VERSION message (it unwraps the
        // client's capability string). Contain it to this connection: the device is dropped
        // with the connection either way, and the next client gets a fresh one.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.server.run(&mut transport)
        }));
        // The worker writes the final dump and lets go; the device and its guest mappings go
        // with the last reference, the transport's.
        self.worker.detach();
        drop(transport);
        let counters: Vec<String> = self
            .metrics
            .snapshot()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        match result {
            Err(_) => error!(
                "client connection dropped after a panic in the vfio-user message loop; {}",
                counters.join(" ")
            ),
            Ok(Ok(())) => info!("client disconnected; {}", counters.join(" ")),
            Ok(Err(vfio_user::Error::SocketAccept(e))) => {
                return Err(ServerError::Accept(vfio_user::Error::SocketAccept(e)));
            }
            Ok(Err(e)) => warn!("client connection lost: {e}; {}", counters.join(" ")),
        }
        Ok(())
    }
}
