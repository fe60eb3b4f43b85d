//! The device worker thread: owns queue processing, waiting with `event-manager` (epoll) on the
//! per-queue kick eventfds the message loop writes, the INTx resample eventfd and a control
//! eventfd. The message loop never waits for queue work, so config space, BAR reads and DMA
//! maps are answered promptly whatever the guest queues.

use std::fs::File;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use log::{debug, error, warn};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::device::Device;
use crate::virtio_pci::NUM_QUEUES;

/// Event data of the control eventfd (queue kicks use the queue index).
const CONTROL_TOKEN: u32 = 0x100;
/// Event data of the INTx resample eventfd.
const RESAMPLE_TOKEN: u32 = 0x101;

/// Errors starting the worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// eventfd or epoll creation failed.
    #[error("creating worker events: {0}")]
    Setup(#[source] std::io::Error),
    /// The thread could not be spawned.
    #[error("spawning the worker thread: {0}")]
    Spawn(#[source] std::io::Error),
}

/// The message loop's side of the worker: kicks and control.
#[derive(Debug)]
pub struct WorkerHandle {
    kicks: Vec<EventFd>,
    control: EventFd,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    /// Starts the worker thread for `device`.
    pub fn spawn(device: Arc<Mutex<Device>>) -> Result<WorkerHandle, WorkerError> {
        let new_efd = || EventFd::new(libc::EFD_NONBLOCK).map_err(WorkerError::Setup);
        let kicks = (0..NUM_QUEUES)
            .map(|_| new_efd())
            .collect::<Result<Vec<_>, _>>()?;
        let control = new_efd()?;
        let stop = Arc::new(AtomicBool::new(false));
        let clone = |e: &EventFd| e.try_clone().map_err(WorkerError::Setup);
        let worker = Worker {
            device,
            kicks: kicks.iter().map(clone).collect::<Result<_, _>>()?,
            control: clone(&control)?,
            resample: None,
            stop: stop.clone(),
        };
        let mut manager: EventManager<Worker> =
            EventManager::new().map_err(|e| WorkerError::Setup(std::io::Error::other(e)))?;
        manager.add_subscriber(worker);
        let stop_loop = stop.clone();
        let thread = std::thread::Builder::new()
            .name("vgpu-worker".into())
            .spawn(move || {
                while !stop_loop.load(Ordering::Acquire) {
                    if let Err(e) = manager.run() {
                        error!("worker event loop: {e}");
                        break;
                    }
                }
                debug!("worker stopped");
            })
            .map_err(WorkerError::Spawn)?;
        Ok(WorkerHandle {
            kicks,
            control,
            stop,
            thread: Some(thread),
        })
    }

    /// Kicks queue `q` (a doorbell write). Unknown queues are the caller's to filter.
    pub fn kick(&self, q: u16) {
        if let Some(kick) = self.kicks.get(usize::from(q))
            && let Err(e) = kick.write(1)
        {
            warn!("kicking queue {q}: {e}");
        }
    }

    /// Tells the worker to re-read the INTx resample eventfd from the device.
    pub fn resample_changed(&self) {
        if let Err(e) = self.control.write(1) {
            warn!("waking the worker: {e}");
        }
    }

    /// Stops the worker and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.control.write(1);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            error!("worker thread panicked");
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Worker {
    device: Arc<Mutex<Device>>,
    kicks: Vec<EventFd>,
    control: EventFd,
    resample: Option<File>,
    stop: Arc<AtomicBool>,
}

impl Worker {
    fn device(&self) -> std::sync::MutexGuard<'_, Device> {
        self.device.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn swap_resample(&mut self, ops: &mut EventOps) {
        if let Some(old) = self.resample.take() {
            let _ = ops.remove(Events::with_data(&old, RESAMPLE_TOKEN, EventSet::IN));
        }
        let fd = self.device().resample_fd();
        self.resample = fd;
        if let Some(fd) = &self.resample
            && let Err(e) = ops.add(Events::with_data(fd, RESAMPLE_TOKEN, EventSet::IN))
        {
            error!("watching the INTx resample eventfd: {e}");
        }
    }
}

impl MutEventSubscriber for Worker {
    fn init(&mut self, ops: &mut EventOps) {
        for (q, kick) in self.kicks.iter().enumerate() {
            if let Err(e) = ops.add(Events::with_data(kick, q as u32, EventSet::IN)) {
                error!("watching queue {q} kicks: {e}");
            }
        }
        if let Err(e) = ops.add(Events::with_data(
            &self.control,
            CONTROL_TOKEN,
            EventSet::IN,
        )) {
            error!("watching the control eventfd: {e}");
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            CONTROL_TOKEN => {
                let _ = self.control.read();
                if !self.stop.load(Ordering::Acquire) {
                    self.swap_resample(ops);
                }
            }
            RESAMPLE_TOKEN => {
                if let Some(mut fd) = self.resample.as_ref() {
                    let mut buf = [0u8; 8];
                    let _ = fd.read(&mut buf);
                }
                self.device().intx_unmasked();
            }
            q => {
                let Ok(q) = u16::try_from(q) else { return };
                let Some(kick) = self.kicks.get(usize::from(q)) else {
                    return;
                };
                let _ = kick.read();
                // Fairness: one queue's worth of chains per round; re-kick if more remain.
                if self.device().process_queue(q) {
                    let _ = self.kicks[usize::from(q)].write(1);
                }
            }
        }
    }
}
