//! The guest's `vgpu-smi` (`src/bin/vgpu-smi-guest.rs`): what the library's device tells a
//! program about itself, with no host access: the device (name, UUID, compute capability,
//! multiprocessors), the driver version the library reports, the memory `cuMemGetInfo`
//! answers (the VM's budget as the total, what the VM can still allocate as free) and the
//! VM's utilisation of the device between two [`Usage`] samples. Rendered as a table, as
//! `-q` blocks and as JSON.

use std::time::Duration;

use mdev_backend::compute::backend::DeviceAttributes;
use serde_json::json;

use crate::attributes::{DEVICE_UUID, DRIVER_VERSION};
use crate::driver::{CuResult, Driver};
use crate::transport::Transport;

/// One sample of the VM's device time ([`Driver::usage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Nanoseconds the VM's device work has run.
    pub busy_ns: u64,
    /// Nanoseconds since the same origin.
    pub elapsed_ns: u64,
}

impl Usage {
    /// The VM's device time now.
    pub fn take<T: Transport>(d: &mut Driver<T>) -> CuResult<Usage> {
        let (busy_ns, elapsed_ns) = d.usage()?;
        Ok(Usage {
            busy_ns,
            elapsed_ns,
        })
    }

    /// The share of the time since `earlier` the device worked for the VM, 0 to 1; `None`
    /// when no time passed between them or the samples are not of one origin (the later one
    /// is behind).
    pub fn utilisation_since(&self, earlier: &Usage) -> Option<f64> {
        let elapsed = self.elapsed_ns.checked_sub(earlier.elapsed_ns)?;
        let busy = self.busy_ns.checked_sub(earlier.busy_ns)?;
        if elapsed == 0 {
            return None;
        }
        // A request's time is counted when it ends: one that began before `earlier` may
        // add more than the interval.
        Some((busy as f64 / elapsed as f64).min(1.0))
    }
}

/// What `vgpu-smi` shows.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub name: String,
    pub uuid: [u8; 16],
    pub compute_capability: (u32, u32),
    pub multiprocessors: u32,
    /// `cuDriverGetVersion`'s answer (1000 × major + 10 × minor).
    pub driver_version: i32,
    /// `cuMemGetInfo`: bytes the VM may still allocate, and its total.
    pub free: u64,
    pub total: u64,
    /// The VM's utilisation over [`Report::interval`], 0 to 1.
    pub utilisation: Option<f64>,
    pub interval: Duration,
}

/// Longest sampling interval `vgpu-smi` takes: it waits that long before it answers.
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);

impl Report {
    /// Asks the device through `d`: its attributes, memory in a context of the tool's own
    /// (which holds a context's small reserve of the budget while it lives), and two usage
    /// samples `interval` apart.
    pub fn take<T: Transport>(d: &mut Driver<T>, interval: Duration) -> CuResult<Report> {
        let ctx = d.context_create()?;
        let memory = d.mem_info(ctx);
        let destroyed = d.context_destroy(ctx);
        let (free, total) = memory?;
        destroyed?;
        let before = Usage::take(d)?;
        std::thread::sleep(interval.min(MAX_INTERVAL));
        let after = Usage::take(d)?;
        Ok(Report::new(
            d.attributes(),
            (free, total),
            after.utilisation_since(&before),
            interval,
        ))
    }

    /// The report of a device of attributes `a`, `memory` `(free, total)` and `utilisation`
    /// over `interval`.
    pub fn new(
        a: &DeviceAttributes,
        memory: (u64, u64),
        utilisation: Option<f64>,
        interval: Duration,
    ) -> Report {
        Report {
            name: a.name.clone(),
            uuid: DEVICE_UUID,
            compute_capability: a.compute_capability,
            multiprocessors: a.multiprocessors,
            driver_version: DRIVER_VERSION,
            free: memory.0,
            total: memory.1,
            utilisation,
            interval,
        }
    }

    /// Bytes the VM holds: the total less what is free.
    pub fn used(&self) -> u64 {
        self.total.saturating_sub(self.free)
    }

    /// The CUDA version the driver supports, as nvidia-smi writes it: `13.5`.
    pub fn driver_version_text(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            self.driver_version % 1000 / 10
        )
    }

    /// The UUID as nvidia-smi writes one: `GPU-` and 8-4-4-4-12 hexadecimal digits.
    pub fn uuid_text(&self) -> String {
        let hex: String = self.uuid.iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "GPU-{}-{}-{}-{}-{}",
            &hex[..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..]
        )
    }

    fn capability_text(&self) -> String {
        format!(
            "{}.{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }

    /// The utilisation in whole percent, or `N/A`.
    fn utilisation_text(&self) -> String {
        self.utilisation
            .map_or_else(|| "N/A".into(), |u| format!("{:.0}%", u * 100.0))
    }

    /// The table `vgpu-smi` prints by default, as nvidia-smi's.
    pub fn table(&self) -> String {
        const WIDTH: usize = 77;
        let rule = |c: char| format!("+{}+\n", c.to_string().repeat(WIDTH));
        let line = |s: String| format!("| {s:<w$} |\n", w = WIDTH - 2);
        let mut name = self.name.clone();
        cut(&mut name, 27);
        let memory = format!("{}MiB / {}MiB", mib(self.used()), mib(self.total));
        let mut out = rule('-');
        out += &line(format!(
            "VGPU-SMI (guest)        Driver Version: {:<12} CUDA Version: {}",
            env!("CARGO_PKG_VERSION"),
            self.driver_version_text()
        ));
        out += &rule('-');
        out += &line(format!(
            "{:<3} {:<27} {:>21} {:>8} {:>12}",
            "GPU", "Name", "Memory-Usage", "GPU-Util", "Compute Cap"
        ));
        out += &rule('=');
        out += &line(format!(
            "{:<3} {:<27} {:>21} {:>8} {:>12}",
            0,
            name,
            memory,
            self.utilisation_text(),
            self.capability_text()
        ));
        out += &rule('-');
        out
    }

    /// The `-q` blocks: every figure, one per line.
    pub fn query(&self) -> String {
        let field = |indent: usize, k: &str, v: String| {
            format!("{:indent$}{k:<w$}: {v}\n", "", w = 38 - indent)
        };
        let mut out = String::from("\n==============VGPU-SMI LOG==============\n\n");
        out += &field(0, "Driver Version", env!("CARGO_PKG_VERSION").into());
        out += &field(0, "CUDA Version", self.driver_version_text());
        out += &field(0, "CUDA Driver API", self.driver_version.to_string());
        out += &field(0, "Attached GPUs", "1".into());
        out += "GPU 0\n";
        out += &field(4, "Product Name", self.name.clone());
        out += &field(4, "GPU UUID", self.uuid_text());
        out += &field(4, "Compute Capability", self.capability_text());
        out += &field(4, "Multiprocessors", self.multiprocessors.to_string());
        out += "    Memory Usage\n";
        out += &field(8, "Total", format!("{} MiB", mib(self.total)));
        out += &field(8, "Used", format!("{} MiB", mib(self.used())));
        out += &field(8, "Free", format!("{} MiB", mib(self.free)));
        out += "    Utilization\n";
        out += &field(8, "Gpu", self.utilisation_text().replace('%', " %"));
        out += &field(
            8,
            "Sampling Interval",
            format!("{} ms", self.interval.as_millis()),
        );
        out
    }

    /// The JSON `vgpu-smi --json` prints: memory in bytes, utilisation as a fraction.
    pub fn json(&self) -> serde_json::Value {
        json!({
            "driver_version": env!("CARGO_PKG_VERSION"),
            "cuda_version": self.driver_version_text(),
            "cuda_driver_api": self.driver_version,
            "gpus": [{
                "index": 0,
                "name": self.name,
                "uuid": self.uuid_text(),
                "compute_capability": self.capability_text(),
                "multiprocessors": self.multiprocessors,
                "memory": {
                    "total_bytes": self.total,
                    "used_bytes": self.used(),
                    "free_bytes": self.free,
                },
                "utilization": {
                    "gpu": self.utilisation,
                    "interval_ms": u64::try_from(self.interval.as_millis()).unwrap_or(u64::MAX),
                },
            }],
        })
    }
}

/// Whole MiB of `bytes`, rounded down.
fn mib(bytes: u64) -> u64 {
    bytes >> 20
}

/// Cuts `s` to at most `max` characters.
fn cut(s: &mut String, max: usize) {
    if let Some((at, _)) = s.char_indices().nth(max) {
        s.truncate(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        let a = DeviceAttributes {
            name: "vGPU compute (PTX executor on a CPU with a long name)".into(),
            placement: true,
            total_memory: 96 << 20,
            compute_capability: (8, 9),
            multiprocessors: 4,
            max_threads_per_block: 1024,
            max_block: [1024, 1024, 64],
            max_grid: [u32::MAX, 65535, 65535],
            shared_memory_per_block: 48 << 10,
            warp_size: 32,
            clock_khz: 1_000_000,
        };
        Report::new(
            &a,
            (90 << 20, 96 << 20),
            Some(0.25),
            Duration::from_millis(500),
        )
    }

    #[test]
    fn utilisation_is_the_busy_share_of_the_time_between_two_samples() {
        let at = |busy_ns, elapsed_ns| Usage {
            busy_ns,
            elapsed_ns,
        };
        assert_eq!(at(150, 1000).utilisation_since(&at(100, 800)), Some(0.25));
        assert_eq!(at(100, 800).utilisation_since(&at(100, 800)), None);
        assert_eq!(at(100, 700).utilisation_since(&at(100, 800)), None);
        assert_eq!(at(5000, 1000).utilisation_since(&at(0, 800)), Some(1.0));
    }

    #[test]
    fn the_table_query_and_json_carry_every_figure() {
        let r = report();
        assert_eq!(r.driver_version_text(), "13.5");
        assert_eq!(r.uuid_text(), "GPU-76677075-2d63-6f6d-7075-74652d303030");
        let table = r.table();
        assert!(table.lines().all(|l| l.chars().count() == 79), "{table}");
        for want in ["6MiB / 96MiB", "25%", "8.9", "CUDA Version: 13.5"] {
            assert!(table.contains(want), "{want} in\n{table}");
        }
        let q = r.query();
        for want in [
            "Multiprocessors                   : 4",
            "Total                         : 96 MiB",
            "Gpu                           : 25 %",
            "Sampling Interval             : 500 ms",
        ] {
            assert!(q.contains(want), "{want} in\n{q}");
        }
        let j = r.json();
        assert_eq!(j["gpus"][0]["memory"]["total_bytes"], 96u64 << 20);
        assert_eq!(j["gpus"][0]["memory"]["used_bytes"], 6u64 << 20);
        assert_eq!(j["gpus"][0]["utilization"]["gpu"], 0.25);
        assert_eq!(j["cuda_driver_api"], 13050);
        let none = Report {
            utilisation: None,
            ..r
        };
        assert!(none.table().contains("N/A"));
        assert!(none.json()["gpus"][0]["utilization"]["gpu"].is_null());
    }
}
