//! Per-device counters, shared between the message loop, the worker and whoever watches
//! (logs at disconnect, tests, later the scheduler daemon's statistics).

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! metrics {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Counters of one vGPU device process, cumulative over connections.
        #[derive(Debug, Default)]
        pub struct DeviceMetrics {
            $($(#[$doc])* pub $name: AtomicU64,)*
        }

        impl DeviceMetrics {
            /// All counters as (name, value) pairs, for logs and reports.
            pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name.load(Ordering::Relaxed)),)*]
            }
        }
    };
}

metrics! {
    /// vfio-user client connections accepted.
    connections,
    /// REGION_READ messages handled.
    region_reads,
    /// REGION_WRITE messages handled.
    region_writes,
    /// Queue notifications (doorbell writes) received.
    notifies,
    /// Notifications for a queue that was not enabled or a device that was not live.
    notifies_ignored,
    /// Region accesses refused by validation (bad region, range or width).
    invalid_accesses,
    /// vfio-user messages the relay refused before the message loop saw them (bad header,
    /// size, region range, interrupt range or descriptors; see `relay.rs`).
    refused_messages,
    /// Protocol violations that put the device into DEVICE_NEEDS_RESET.
    transport_faults,
    /// Control-queue requests completed.
    ctrl_requests,
    /// Control-queue requests answered with an error response.
    ctrl_errors,
    /// Cursor-queue requests completed.
    cursor_requests,
    /// Queue turns that spent their chain or byte budget with chains left (the worker kicked
    /// the queue again).
    kicks_deferred,
    /// Interrupts delivered (MSI-X or INTx).
    interrupts,
    /// DMA_MAP messages accepted.
    dma_maps,
    /// DMA_UNMAP messages accepted.
    dma_unmaps,
    /// Device resets (DEVICE_RESET messages and driver status resets).
    resets,
    /// RESOURCE_FLUSHes that reached a scanout (frames shown), all scanouts together.
    frames_flushed,
    /// Scanout images written to the dump directory.
    scanout_dumps,
    /// Scanout images that could not be written.
    dump_errors,
    /// 1 while a device started with `--scheduler` is not admitted by the daemon (not
    /// connected yet, the daemon gone, or it refused or dropped the device) and dispatches
    /// under the fallback budget; else 0 (a gauge).
    sched_fallback,
    /// Times the device fell back after the daemon lost, refused or dropped it, or was not
    /// there at the first try (each logged once).
    sched_fallback_entered,
    /// GPU groups the fallback budget held back (each counted once however long it waited).
    sched_fallback_delayed,
    /// GPU groups dispatched under the fallback budget.
    sched_fallback_groups,
    /// GPU time, ns, of groups run under the fallback budget (what the budget was charged).
    sched_fallback_gpu_ns,
    /// Time, ns, spent under the fallback budget, added when the daemon admits the device or
    /// the client goes away.
    sched_fallback_ns,
    /// Host bytes charged to the VM's memory budget (`--resource-memory-mb`): resources,
    /// blobs and entry lists, queued compute requests, compute memory and modules (a gauge,
    /// as of the last request the device handled).
    memory_used_bytes,
    /// The VM's memory budget, in bytes (a gauge).
    memory_limit_bytes,
}

/// Adds one to a counter.
pub fn inc(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Adds `n` to a counter.
pub fn add(counter: &AtomicU64, n: u64) {
    if n != 0 {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Sets a gauge.
pub fn set(gauge: &AtomicU64, value: u64) {
    gauge.store(value, Ordering::Relaxed);
}

/// Reads a counter.
pub fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}
