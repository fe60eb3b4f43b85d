//! Host CPU coordination through cgroups (DESIGN §5): each VM's QEMU runs in its own cgroup.
//!
//! This module finds a process's CPU cgroup, reads its weight (always on the cgroup v2
//! `cpu.weight` scale, 1–10000, Pegasus's CPU credits), its cumulative CPU usage and the run
//! state of its vCPU threads, and turns them into a [`CpuHint`]. It can write a weight back and
//! create, fill and remove a per-VM cgroup for a launch script.
//!
//! cgroup v2 is used where the cpu controller is enabled for the cgroup; otherwise the cgroup v1
//! cpu hierarchy (`cpu.shares`, 2–262144, converted with systemd's formula), with usage from the
//! cpuacct hierarchy (co-mounted as `cpu,cpuacct` or mounted on its own). All file system roots
//! are injectable ([`CgroupFs`]) so tests can run against a fake tree.
//!
//! Everything read here may be shaped by an untrusted process (its thread names, its number of
//! threads), so every read is bounded and every parse is checked; nothing here panics.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};

use vgpu_scheduler::model::{CpuHint, NS_PER_US, Nanos};

/// Largest file read from cgroupfs or procfs. The files read here (`cpu.weight`, `cpu.stat`,
/// `/proc/PID/cgroup`, a thread's `stat`) are well under 4 KiB; `/proc/PID/cgroup` holds at most
/// one `PATH_MAX` (4 KiB) path per hierarchy, and a VM cgroup's `cgroup.procs` a handful of pids.
/// 64 KiB covers all of them with room to spare and bounds what a hostile tree can make us hold.
pub const MAX_FILE_BYTES: u64 = 64 * 1024;

/// Most threads examined per process. KVM allows up to 4096 vCPUs on x86 and QEMU adds a few
/// dozen I/O and worker threads; a process with more entries than this is refused rather than
/// walked without bound.
pub const MAX_THREADS: usize = 8192;

/// Longest name of a cgroup created by [`CgroupFs::create_vm_cgroup`], in bytes. VM names are
/// short identifiers; the bound keeps paths far below `NAME_MAX` (255).
pub const MAX_NAME_LEN: usize = 64;

/// Most path components in the parent given to [`CgroupFs::create_vm_cgroup`]. Real slice trees
/// are a few levels deep; the bound keeps a configured parent from being arbitrarily long.
pub const MAX_PARENT_DEPTH: usize = 16;

/// Largest valid pid: the kernel's `PID_MAX_LIMIT` on 64-bit (2^22). A pid beyond it cannot
/// exist, so it is refused before it names any file.
pub const MAX_PID: u32 = 4_194_304;

/// A runnable vCPU thread counts as running ([`CpuProbe::sample`]) when it was on a CPU or
/// waiting for one for at least this percentage of the time since the previous sample. A vCPU
/// executing guest code is busy all of that time however contended the host is (contention
/// only turns run time into wait time), while one that halts, e.g. until a GPU fence signals,
/// sleeps most of it. Comparing run time with wait time instead called a spinning vCPU idle as
/// soon as more threads than cores wanted the CPU (measured with TCG guests on two cores).
pub const MIN_BUSY_PERCENT: u64 = 50;

/// Smallest cgroup v2 `cpu.weight` (systemd's `CGROUP_WEIGHT_MIN`).
pub const WEIGHT_MIN: u32 = 1;
/// Default cgroup v2 `cpu.weight` (systemd's `CGROUP_WEIGHT_DEFAULT`).
pub const WEIGHT_DEFAULT: u32 = 100;
/// Largest cgroup v2 `cpu.weight` (systemd's `CGROUP_WEIGHT_MAX`).
pub const WEIGHT_MAX: u32 = 10_000;
/// Smallest cgroup v1 `cpu.shares` (systemd's `CGROUP_CPU_SHARES_MIN`).
pub const SHARES_MIN: u64 = 2;
/// Default cgroup v1 `cpu.shares` (systemd's `CGROUP_CPU_SHARES_DEFAULT`).
pub const SHARES_DEFAULT: u64 = 1024;
/// Largest cgroup v1 `cpu.shares` (systemd's `CGROUP_CPU_SHARES_MAX`).
pub const SHARES_MAX: u64 = 262_144;

/// What went wrong reading or writing cgroups and procfs.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A file or directory operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error from the operating system.
        #[source]
        source: io::Error,
    },
    /// A file was longer than [`MAX_FILE_BYTES`].
    #[error("{path}: longer than {MAX_FILE_BYTES} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// A file's content did not have the expected form.
    #[error("{path}: malformed: {what}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        what: &'static str,
    },
    /// A pid of 0 or above [`MAX_PID`].
    #[error("pid {0} is outside 1..={MAX_PID}")]
    InvalidPid(u32),
    /// A weight outside [`WEIGHT_MIN`]..=[`WEIGHT_MAX`].
    #[error("cpu weight {0} is outside {WEIGHT_MIN}..={WEIGHT_MAX}")]
    InvalidWeight(u32),
    /// A cgroup name or parent path that is not a plain, bounded relative name.
    #[error(
        "invalid cgroup name {0:?}: want 1..={MAX_NAME_LEN} of [A-Za-z0-9_.-], not starting with '.'"
    )]
    InvalidName(String),
    /// The process is in no cgroup with a usable cpu controller.
    #[error("pid {0}: no cgroup v2 with the cpu controller and no cgroup v1 cpu hierarchy")]
    NoCpuController(u32),
    /// Neither hierarchy offers the cpu controller under the parent asked for.
    #[error("no cpu controller under parent {0:?} in cgroup v2 or v1")]
    NoCpuControllerUnder(String),
    /// The cgroup has no source of cumulative CPU usage (v1 without cpuacct).
    #[error("{0}: no cpuacct hierarchy to read CPU usage from")]
    NoUsage(PathBuf),
    /// The operation is not allowed on a hierarchy's root cgroup.
    #[error("{0}: is a hierarchy root")]
    IsRoot(PathBuf),
    /// The cgroup still has processes.
    #[error("{0}: still has processes")]
    NotEmpty(PathBuf),
    /// The pid is not a member of the cgroup.
    #[error("pid {pid} is not in {path}")]
    NotMember {
        /// The pid.
        pid: u32,
        /// The cgroup's directory.
        path: PathBuf,
    },
    /// The process has more than [`MAX_THREADS`] threads.
    #[error("pid {0}: more than {MAX_THREADS} threads")]
    TooManyThreads(u32),
    /// A saved weight of one hierarchy was to be put back into a cgroup of the other.
    #[error("{0}: a saved weight of the other cgroup hierarchy")]
    WrongHierarchy(PathBuf),
}

/// Shorthand for this module's results.
pub type Result<T> = std::result::Result<T, CgroupError>;

/// Converts cgroup v1 `cpu.shares` to the cgroup v2 `cpu.weight` scale exactly as systemd does
/// (`cgroup_cpu_shares_to_weight` in systemd's `src/core/cgroup.c`):
/// `CLAMP(shares * CGROUP_WEIGHT_DEFAULT / CGROUP_CPU_SHARES_DEFAULT, CGROUP_WEIGHT_MIN,
/// CGROUP_WEIGHT_MAX)`, i.e. `shares * 100 / 1024` with truncating integer division, clamped to
/// 1..=10000. The multiplication saturates instead of wrapping.
pub fn shares_to_weight(shares: u64) -> u32 {
    let weight = shares.saturating_mul(u64::from(WEIGHT_DEFAULT)) / SHARES_DEFAULT;
    let clamped = weight.clamp(u64::from(WEIGHT_MIN), u64::from(WEIGHT_MAX));
    u32::try_from(clamped).unwrap_or(WEIGHT_MAX)
}

/// Converts a cgroup v2 `cpu.weight` to cgroup v1 `cpu.shares` exactly as systemd does
/// (`cgroup_cpu_weight_to_shares` in systemd's `src/core/cgroup.c`):
/// `CLAMP(weight * CGROUP_CPU_SHARES_DEFAULT / CGROUP_WEIGHT_DEFAULT, CGROUP_CPU_SHARES_MIN,
/// CGROUP_CPU_SHARES_MAX)`, i.e. `weight * 1024 / 100` truncated, clamped to 2..=262144. systemd
/// maps its idle weight 0 to the minimum shares, which the clamp gives as well.
pub fn weight_to_shares(weight: u32) -> u64 {
    let shares = u64::from(weight).saturating_mul(SHARES_DEFAULT) / u64::from(WEIGHT_DEFAULT);
    shares.clamp(SHARES_MIN, SHARES_MAX)
}

/// Where the cgroup and proc file systems are mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupFs {
    /// Mount point of the cgroup v1 hierarchy with the cpu controller.
    pub v1_cpu_root: PathBuf,
    /// Mount point of the cgroup v1 hierarchy with the cpuacct controller (the same as
    /// `v1_cpu_root` where they are co-mounted).
    pub v1_cpuacct_root: PathBuf,
    /// Mount point of the cgroup v2 (unified) hierarchy.
    pub v2_root: PathBuf,
    /// Mount point of procfs.
    pub proc_root: PathBuf,
}

impl Default for CgroupFs {
    /// The host's usual mounts: `/sys/fs/cgroup/cpu,cpuacct` for both v1 controllers where they
    /// are co-mounted, else `/sys/fs/cgroup/cpu` and `/sys/fs/cgroup/cpuacct`;
    /// `/sys/fs/cgroup/unified` for v2 on a hybrid system, else `/sys/fs/cgroup`; and `/proc`.
    fn default() -> Self {
        let base = Path::new("/sys/fs/cgroup");
        let comounted = base.join("cpu,cpuacct");
        let (v1_cpu_root, v1_cpuacct_root) = if comounted.is_dir() {
            (comounted.clone(), comounted)
        } else {
            (base.join("cpu"), base.join("cpuacct"))
        };
        let unified = base.join("unified");
        let v2_root = if unified.is_dir() {
            unified
        } else {
            base.to_path_buf()
        };
        Self {
            v1_cpu_root,
            v1_cpuacct_root,
            v2_root,
            proc_root: PathBuf::from("/proc"),
        }
    }
}

/// Which hierarchy a [`VmCgroup`] uses for its CPU weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hierarchy {
    /// cgroup v2: `cpu.weight`, usage from `cpu.stat`.
    V2,
    /// cgroup v1: `cpu.shares`, usage from `cpuacct.usage`.
    V1,
}

/// A cgroup's weight file exactly as read (`cpu.weight` on v2, `cpu.shares` on v1), so that it
/// can be put back unchanged: v1 shares do not survive a round trip through the v2 scale (1000
/// shares are weight 97, which is 993 shares).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawWeight {
    /// The hierarchy the value belongs to.
    pub hierarchy: Hierarchy,
    /// `cpu.weight` (v2, 1–10000) or `cpu.shares` (v1, 2–262144).
    pub value: u64,
}

/// A directory inside one hierarchy: its mount point and its path below it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CgDir {
    root: PathBuf,
    rel: PathBuf,
}

impl CgDir {
    fn path(&self) -> PathBuf {
        self.root.join(&self.rel)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.path().join(name)
    }

    /// The parent cgroup's directory; refused for the root.
    fn parent(&self) -> Result<PathBuf> {
        match self.rel.parent() {
            Some(parent) if !self.rel.as_os_str().is_empty() => Ok(self.root.join(parent)),
            _ => Err(CgroupError::IsRoot(self.path())),
        }
    }
}

/// One VM's CPU cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmCgroup {
    hierarchy: Hierarchy,
    cpu: CgDir,
    /// The v1 cpuacct cgroup where that hierarchy is mounted apart from cpu; `None` for v2 and
    /// for a co-mounted `cpu,cpuacct`, where usage is read from `cpu`.
    acct: Option<CgDir>,
    /// v1 only: no cpuacct hierarchy at all, so no usage.
    no_usage: bool,
}

impl VmCgroup {
    /// The hierarchy the weight lives in.
    pub fn hierarchy(&self) -> Hierarchy {
        self.hierarchy
    }

    /// The cgroup's directory in the hierarchy that holds its weight.
    pub fn path(&self) -> PathBuf {
        self.cpu.path()
    }

    /// The CPU weight on the cgroup v2 scale (1–10000); v1 shares are converted with
    /// [`shares_to_weight`].
    pub fn weight(&self) -> Result<u32> {
        let raw = self.raw_weight()?;
        Ok(match raw.hierarchy {
            // In 1..=10000: checked by `raw_weight`.
            Hierarchy::V2 => u32::try_from(raw.value).unwrap_or(WEIGHT_MAX),
            Hierarchy::V1 => shares_to_weight(raw.value),
        })
    }

    /// Writes a CPU weight (cgroup v2 scale): `cpu.weight` on v2, `cpu.shares` converted with
    /// [`weight_to_shares`] on v1. The daemon calls this only when writing weights back is
    /// enabled.
    pub fn set_weight(&self, weight: u32) -> Result<()> {
        if !(WEIGHT_MIN..=WEIGHT_MAX).contains(&weight) {
            return Err(CgroupError::InvalidWeight(weight));
        }
        let value = match self.hierarchy {
            Hierarchy::V2 => u64::from(weight),
            Hierarchy::V1 => weight_to_shares(weight),
        };
        self.set_raw_weight(RawWeight {
            hierarchy: self.hierarchy,
            value,
        })
    }

    /// The weight file's value as it is ([`RawWeight`]), checked against the hierarchy's range.
    pub fn raw_weight(&self) -> Result<RawWeight> {
        let (name, range) = self.raw_file();
        let path = self.cpu.file(name);
        let value: u64 = parse_number(&path, &read_bounded(&path)?)?;
        if !range.contains(&value) {
            return Err(malformed(&path, "weight outside the hierarchy's range"));
        }
        Ok(RawWeight {
            hierarchy: self.hierarchy,
            value,
        })
    }

    /// Puts back a value read with [`VmCgroup::raw_weight`] (from a cgroup of the same
    /// hierarchy), e.g. the weight a VM's launcher set before the daemon wrote its hints.
    pub fn set_raw_weight(&self, raw: RawWeight) -> Result<()> {
        if raw.hierarchy != self.hierarchy {
            return Err(CgroupError::WrongHierarchy(self.path()));
        }
        let (name, range) = self.raw_file();
        if !range.contains(&raw.value) {
            return Err(CgroupError::InvalidWeight(
                u32::try_from(raw.value).unwrap_or(u32::MAX),
            ));
        }
        write_value(&self.cpu.file(name), raw.value)
    }

    /// The hierarchy's weight file and the range of its values.
    fn raw_file(&self) -> (&'static str, std::ops::RangeInclusive<u64>) {
        match self.hierarchy {
            Hierarchy::V2 => ("cpu.weight", u64::from(WEIGHT_MIN)..=u64::from(WEIGHT_MAX)),
            Hierarchy::V1 => ("cpu.shares", SHARES_MIN..=SHARES_MAX),
        }
    }

    /// The cgroup's cumulative CPU time in nanoseconds: v2 `cpu.stat` `usage_usec`, v1
    /// `cpuacct.usage`.
    pub fn usage(&self) -> Result<Nanos> {
        match self.hierarchy {
            Hierarchy::V2 => {
                let path = self.cpu.file("cpu.stat");
                let text = read_bounded(&path)?;
                let usec = stat_value(&path, &text, "usage_usec")?;
                usec.checked_mul(NS_PER_US)
                    .ok_or_else(|| malformed(&path, "usage_usec overflows nanoseconds"))
            }
            Hierarchy::V1 => {
                if self.no_usage {
                    return Err(CgroupError::NoUsage(self.path()));
                }
                let dir = self.acct.as_ref().unwrap_or(&self.cpu);
                let path = dir.file("cpuacct.usage");
                parse_number(&path, &read_bounded(&path)?)
            }
        }
    }

    /// The pids in the cgroup (its `cgroup.procs`).
    pub fn pids(&self) -> Result<Vec<u32>> {
        read_pids(&self.cpu.file("cgroup.procs"))
    }

    /// Moves a process into the cgroup (and into the matching cpuacct cgroup where that
    /// hierarchy is mounted apart).
    pub fn add_pid(&self, pid: u32) -> Result<()> {
        check_pid(pid)?;
        write_value(&self.cpu.file("cgroup.procs"), pid)?;
        if let Some(acct) = &self.acct {
            write_value(&acct.file("cgroup.procs"), pid)?;
        }
        log::debug!("moved pid {pid} into {}", self.path().display());
        Ok(())
    }

    /// Moves a process that is in this cgroup into the parent cgroup(s).
    pub fn move_out(&self, pid: u32) -> Result<()> {
        check_pid(pid)?;
        let parent = self.cpu.parent()?;
        if !self.pids()?.contains(&pid) {
            return Err(CgroupError::NotMember {
                pid,
                path: self.path(),
            });
        }
        write_value(&parent.join("cgroup.procs"), pid)?;
        if let Some(acct) = &self.acct {
            write_value(&acct.parent()?.join("cgroup.procs"), pid)?;
        }
        log::debug!("moved pid {pid} out of {}", self.path().display());
        Ok(())
    }

    /// Removes the cgroup (and its cpuacct twin), refused while it has processes.
    pub fn remove(self) -> Result<()> {
        self.cpu.parent()?;
        let dirs: Vec<&CgDir> = std::iter::once(&self.cpu)
            .chain(self.acct.as_ref())
            .collect();
        for dir in &dirs {
            if !read_pids(&dir.file("cgroup.procs"))?.is_empty() {
                return Err(CgroupError::NotEmpty(dir.path()));
            }
        }
        for dir in dirs {
            let path = dir.path();
            fs::remove_dir(&path).map_err(|source| CgroupError::Io { path, source })?;
        }
        log::info!("removed cgroup {}", self.cpu.path().display());
        Ok(())
    }
}

impl CgroupFs {
    /// Finds the CPU cgroup of a process from `/proc/PID/cgroup`: its v2 cgroup when the cpu
    /// controller is enabled for it, else its v1 cpu cgroup.
    ///
    /// A v2 cgroup has `cpu.weight` exactly when its own `cgroup.controllers` lists `cpu` (that
    /// file mirrors the parent's `cgroup.subtree_control`), so that is what is checked; the v2
    /// root has no `cpu.weight` and is never used.
    pub fn locate(&self, pid: u32) -> Result<VmCgroup> {
        check_pid(pid)?;
        let path = self.proc_root.join(pid.to_string()).join("cgroup");
        let paths = parse_proc_cgroup(&path, &read_bounded(&path)?)?;
        if let Some(rel) = paths.v2.map(vm_level) {
            let dir = CgDir {
                root: self.v2_root.clone(),
                rel,
            };
            if !dir.rel.as_os_str().is_empty()
                && lists_word(&dir.file("cgroup.controllers"), "cpu")?
            {
                return Ok(VmCgroup {
                    hierarchy: Hierarchy::V2,
                    cpu: dir,
                    acct: None,
                    no_usage: false,
                });
            }
        }
        let rel = paths
            .v1_cpu
            .map(vm_level)
            .ok_or(CgroupError::NoCpuController(pid))?;
        let cpu = CgDir {
            root: self.v1_cpu_root.clone(),
            rel,
        };
        if !cpu.path().is_dir() {
            return Err(CgroupError::NoCpuController(pid));
        }
        let (acct, no_usage) = match (self.separate_cpuacct(), paths.v1_cpuacct) {
            (false, Some(_)) => (None, false),
            (true, Some(rel)) => (
                Some(CgDir {
                    root: self.v1_cpuacct_root.clone(),
                    rel: vm_level(rel),
                }),
                false,
            ),
            (_, None) => (None, true),
        };
        Ok(VmCgroup {
            hierarchy: Hierarchy::V1,
            cpu,
            acct,
            no_usage,
        })
    }

    /// Creates the cgroup `name` under `parent` (a path relative to the hierarchy roots, `""`
    /// for the root) for a launch script to move a VM into: in cgroup v2 when `parent`'s
    /// `cgroup.subtree_control` enables `cpu`, else in the v1 cpu hierarchy (and in the v1
    /// cpuacct hierarchy too where it is mounted apart). An existing cgroup is an error.
    pub fn create_vm_cgroup(&self, parent: &str, name: &str) -> Result<VmCgroup> {
        check_name(name)?;
        let parent_rel = check_parent(parent)?;
        let rel = parent_rel.join(name);
        let v2_parent = self.v2_root.join(&parent_rel);
        if lists_word(&v2_parent.join("cgroup.subtree_control"), "cpu")? {
            let cpu = CgDir {
                root: self.v2_root.clone(),
                rel,
            };
            make_dir(&cpu.path())?;
            log::info!("created cgroup v2 {}", cpu.path().display());
            return Ok(VmCgroup {
                hierarchy: Hierarchy::V2,
                cpu,
                acct: None,
                no_usage: false,
            });
        }
        if !self
            .v1_cpu_root
            .join(&parent_rel)
            .join("cgroup.procs")
            .is_file()
        {
            return Err(CgroupError::NoCpuControllerUnder(parent.to_owned()));
        }
        let cpu = CgDir {
            root: self.v1_cpu_root.clone(),
            rel: rel.clone(),
        };
        let acct = self.separate_cpuacct().then(|| CgDir {
            root: self.v1_cpuacct_root.clone(),
            rel,
        });
        let no_usage = !self.separate_cpuacct() && !self.v1_cpuacct_root.is_dir();
        make_dir(&cpu.path())?;
        if let Some(Err(err)) = acct.as_ref().map(|acct| make_dir(&acct.path())) {
            if let Err(undo) = fs::remove_dir(cpu.path()) {
                log::warn!("could not undo {}: {undo}", cpu.path().display());
            }
            return Err(err);
        }
        log::info!("created cgroup v1 {}", cpu.path().display());
        Ok(VmCgroup {
            hierarchy: Hierarchy::V1,
            cpu,
            acct,
            no_usage,
        })
    }

    /// Whether the v1 cpuacct hierarchy exists and is mounted apart from the cpu hierarchy.
    fn separate_cpuacct(&self) -> bool {
        match (
            fs::canonicalize(&self.v1_cpu_root),
            fs::canonicalize(&self.v1_cpuacct_root),
        ) {
            (Ok(cpu), Ok(acct)) => cpu != acct,
            (Err(_), Ok(_)) => true,
            (_, Err(_)) => false,
        }
    }

    /// The threads of a process, read from `/proc/PID/task/TID/{stat,schedstat}`. Threads that
    /// exit while they are read are skipped.
    pub fn threads(&self, pid: u32) -> Result<Vec<ThreadSample>> {
        check_pid(pid)?;
        let task_dir = self.proc_root.join(pid.to_string()).join("task");
        // All tids first, so an oversized process is refused before any thread is read.
        let tids = list_tids(&task_dir, pid, MAX_THREADS)?;
        let mut threads = Vec::with_capacity(tids.len());
        for tid in tids {
            match read_thread(&task_dir.join(tid.to_string()), tid) {
                Ok(thread) => threads.push(thread),
                Err(CgroupError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                    log::debug!("thread {tid} of pid {pid} exited while read");
                }
                Err(err) => return Err(err),
            }
        }
        threads.sort_by_key(|t| t.tid);
        Ok(threads)
    }
}

/// Scheduler statistics of one thread (`/proc/PID/task/TID/schedstat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedStat {
    /// Time spent on a CPU, ns.
    pub run_ns: u64,
    /// Time spent runnable on a run queue, waiting for a CPU, ns.
    pub wait_ns: u64,
    /// Number of time slices run.
    pub timeslices: u64,
}

/// One thread of a process as seen at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadSample {
    /// The thread id.
    pub tid: u32,
    /// The thread's name (`comm`), lossily decoded.
    pub comm: String,
    /// QEMU names its vCPU threads `CPU n/ACCEL`: `CPU n/KVM`, `CPU n/TCG`, `CPU n/DUMMY` (qtest).
    pub vcpu: bool,
    /// The state letter of `stat` is `R`: running or waiting for a CPU.
    pub runnable: bool,
    /// The thread's schedstat, where the kernel provides it.
    pub sched: Option<SchedStat>,
}

/// Samples one VM's [`CpuHint`] again and again, keeping each vCPU thread's previous schedstat
/// to tell a thread on a CPU from one waiting for a CPU.
#[derive(Debug)]
pub struct CpuProbe {
    fs: CgroupFs,
    pid: u32,
    cgroup: VmCgroup,
    last: HashMap<u32, SchedStat>,
    /// When `last` was read (the caller's clock, ns).
    last_at: Option<Nanos>,
    vcpu_threads: usize,
}

impl CpuProbe {
    /// A probe for the process `pid` (the VM's QEMU), its cgroup found with
    /// [`CgroupFs::locate`].
    pub fn new(fs: CgroupFs, pid: u32) -> Result<Self> {
        let cgroup = fs.locate(pid)?;
        Ok(Self {
            fs,
            pid,
            cgroup,
            last: HashMap::new(),
            last_at: None,
            vcpu_threads: 0,
        })
    }

    /// The VM's cgroup.
    pub fn cgroup(&self) -> &VmCgroup {
        &self.cgroup
    }

    /// How many threads named like QEMU's vCPU threads the latest [`CpuProbe::sample`] found
    /// (0 before the first sample, and when it fell back to all threads).
    pub fn vcpu_threads(&self) -> usize {
        self.vcpu_threads
    }

    /// Reads the VM's weight, usage and vCPU run state at `now` (ns on a monotonic clock, the
    /// same for every call).
    ///
    /// The vCPU threads are those QEMU names `CPU n/KVM` or `CPU n/TCG`; when there are none,
    /// all threads count. A thread is runnable when its state is `R`. A runnable thread counts
    /// as running when its schedstat shows it busy (on a CPU or waiting for one) for at least
    /// [`MIN_BUSY_PERCENT`] of the time since the previous sample; without a previous sample,
    /// schedstat or a later `now`, every runnable thread counts as running.
    pub fn sample(&mut self, now: Nanos) -> Result<CpuHint> {
        let weight = self.cgroup.weight()?;
        let usage = self.cgroup.usage()?;
        let threads = self.fs.threads(self.pid)?;
        let vcpus = threads.iter().filter(|t| t.vcpu).count();
        let any_vcpu = vcpus > 0;
        let elapsed = self
            .last_at
            .and_then(|at| now.checked_sub(at))
            .filter(|&dt| dt > 0);
        let mut hint = CpuHint {
            weight,
            running: false,
            runnable: false,
            usage,
        };
        let mut seen = HashMap::new();
        for thread in threads.iter().filter(|t| t.vcpu || !any_vcpu) {
            if thread.runnable {
                hint.runnable = true;
                let on_cpu = match (thread.sched, self.last.get(&thread.tid), elapsed) {
                    (Some(now), Some(before), Some(dt)) => busy_for_long(before, &now, dt),
                    _ => true,
                };
                hint.running |= on_cpu;
            }
            if let Some(sched) = thread.sched {
                seen.insert(thread.tid, sched);
            }
        }
        self.last = seen;
        self.last_at = Some(now);
        self.vcpu_threads = vcpus;
        Ok(hint)
    }
}

/// Whether a thread whose schedstat went from `before` to `now` in `dt` ns was on a CPU or
/// waiting for one for at least [`MIN_BUSY_PERCENT`] of that time.
fn busy_for_long(before: &SchedStat, now: &SchedStat, dt: Nanos) -> bool {
    let busy = now
        .run_ns
        .saturating_sub(before.run_ns)
        .saturating_add(now.wait_ns.saturating_sub(before.wait_ns));
    busy.saturating_mul(100) >= dt.saturating_mul(MIN_BUSY_PERCENT)
}

/// A process's cgroup paths from `/proc/PID/cgroup`, relative to their hierarchy roots.
/// The cgroups `/proc/PID/cgroup` names, relative to their hierarchy's root.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ProcCgroups {
    /// The unified (v2) cgroup.
    pub v2: Option<PathBuf>,
    /// The v1 `cpu` controller's cgroup.
    pub v1_cpu: Option<PathBuf>,
    /// The v1 `cpuacct` controller's cgroup.
    pub v1_cpuacct: Option<PathBuf>,
}

/// Parses `/proc/PID/cgroup`: `0::/path` for v2, `N:ctrl,ctrl:/path` for v1. Public, like the
/// other parsers here, for the fuzz target `cgroup_proc`.
pub fn parse_proc_cgroup(path: &Path, text: &str) -> Result<ProcCgroups> {
    let mut out = ProcCgroups::default();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(cg_path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            return Err(malformed(path, "line without three ':'-separated fields"));
        };
        if id.parse::<u32>().is_err() {
            return Err(malformed(path, "hierarchy id is not a number"));
        }
        let rel = cgroup_rel_path(cg_path).ok_or_else(|| malformed(path, "bad cgroup path"))?;
        if id == "0" && controllers.is_empty() {
            out.v2 = Some(rel);
            continue;
        }
        for controller in controllers.split(',') {
            match controller {
                "cpu" => out.v1_cpu = Some(rel.clone()),
                "cpuacct" => out.v1_cpuacct = Some(rel.clone()),
                _ => {}
            }
        }
    }
    Ok(out)
}

/// The cgroup that stands for the whole VM when QEMU runs in one of libvirt's per-thread
/// groups: libvirt puts a domain in a scope (`machine.slice/machine-qemu\x2d1\x2dvm1.scope`
/// under systemd, `machine/qemu-1-vm1.libvirt-qemu` without it) and moves QEMU's main thread to
/// `libvirt/emulator` below it (`emulator` directly below it in cgroup v1), its vCPU threads to
/// `vcpuN` and its I/O threads to `iothreadN`. A weight written there would only set QEMU's own
/// threads against each other and the usage read there would miss the vCPUs, so the scope is
/// the VM's cgroup. Any other layout is taken as it is.
fn vm_level(rel: PathBuf) -> PathBuf {
    let numbered = |name: &str, prefix: &str| {
        name.strip_prefix(prefix)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let per_thread = |name: &str| {
        matches!(name, "libvirt" | "emulator")
            || numbered(name, "vcpu")
            || numbered(name, "iothread")
    };
    let mut scope = rel.as_path();
    while let Some(name) = scope.file_name().and_then(|n| n.to_str()) {
        if !per_thread(name) {
            break;
        }
        match scope.parent() {
            Some(up) => scope = up,
            None => return rel,
        }
    }
    let is_domain = scope
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(".scope") || n.ends_with(".libvirt-qemu"));
    if scope != rel && is_domain {
        scope.to_path_buf()
    } else {
        rel
    }
}

/// An absolute cgroup path made relative, refused unless it is made of plain components.
fn cgroup_rel_path(cg_path: &str) -> Option<PathBuf> {
    let rest = cg_path.strip_prefix('/')?;
    let rel = PathBuf::from(rest);
    rel.components()
        .all(|c| matches!(c, Component::Normal(_)))
        .then_some(rel)
}

/// The numeric entries of `/proc/PID/task`, refused past `limit` ([`MAX_THREADS`]).
fn list_tids(task_dir: &Path, pid: u32, limit: usize) -> Result<Vec<u32>> {
    let io_err = |source| CgroupError::Io {
        path: task_dir.to_path_buf(),
        source,
    };
    let mut tids = Vec::new();
    for entry in fs::read_dir(task_dir).map_err(io_err)? {
        let name = entry.map_err(io_err)?.file_name();
        match name.to_str().and_then(|s| s.parse::<u32>().ok()) {
            Some(_) if tids.len() >= limit => return Err(CgroupError::TooManyThreads(pid)),
            Some(tid) => tids.push(tid),
            None => log::debug!("{}: skipping {name:?}", task_dir.display()),
        }
    }
    Ok(tids)
}

/// Reads and parses one thread's `stat` and `schedstat`.
fn read_thread(dir: &Path, tid: u32) -> Result<ThreadSample> {
    let stat_path = dir.join("stat");
    let bytes = read_bounded_bytes(&stat_path)?;
    let (comm, state) = parse_stat(&bytes).map_err(|what| malformed(&stat_path, what))?;
    let comm = String::from_utf8_lossy(comm).into_owned();
    let sched_path = dir.join("schedstat");
    let sched = match read_bounded(&sched_path) {
        Ok(text) => Some(parse_schedstat(&text).map_err(|what| malformed(&sched_path, what))?),
        Err(CgroupError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            // No schedstat in this kernel (or the thread just exited): run state only.
            None
        }
        Err(err) => return Err(err),
    };
    Ok(ThreadSample {
        tid,
        vcpu: is_vcpu_comm(&comm),
        comm,
        runnable: state == b'R',
        sched,
    })
}

/// Splits a `stat` line `TID (COMM) S ...` into the command name and the state letter. The name
/// may hold spaces and parentheses, so it ends at the last `)`.
pub fn parse_stat(bytes: &[u8]) -> std::result::Result<(&[u8], u8), &'static str> {
    let open = bytes.iter().position(|&b| b == b'(').ok_or("no '('")?;
    let close = bytes.iter().rposition(|&b| b == b')').ok_or("no ')'")?;
    if close < open {
        return Err("')' before '('");
    }
    let head = std::str::from_utf8(&bytes[..open]).map_err(|_| "tid is not text")?;
    if head.trim_end().parse::<u32>().is_err() {
        return Err("tid is not a number");
    }
    let comm = &bytes[open + 1..close];
    match bytes.get(close + 1..).and_then(|rest| rest.get(..2)) {
        Some(&[b' ', state]) if state.is_ascii_alphabetic() => Ok((comm, state)),
        _ => Err("no state letter after the command name"),
    }
}

/// Parses `schedstat`: run time ns, wait time ns, time slices.
pub fn parse_schedstat(text: &str) -> std::result::Result<SchedStat, &'static str> {
    let mut fields = text.split_ascii_whitespace().map(str::parse::<u64>);
    let mut next = || match fields.next() {
        Some(Ok(v)) => Ok(v),
        _ => Err("want three numbers"),
    };
    let stat = SchedStat {
        run_ns: next()?,
        wait_ns: next()?,
        timeslices: next()?,
    };
    match fields.next() {
        None => Ok(stat),
        Some(_) => Err("more than three fields"),
    }
}

/// QEMU's vCPU thread names: `CPU <n>/KVM`, `CPU <n>/TCG`, `CPU <n>/DUMMY` under qtest (other
/// accelerators use other suffixes after the slash; any non-empty one is accepted).
pub fn is_vcpu_comm(comm: &str) -> bool {
    let Some(rest) = comm.strip_prefix("CPU ") else {
        return false;
    };
    let Some((index, accel)) = rest.split_once('/') else {
        return false;
    };
    !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()) && !accel.is_empty()
}

/// Finds `key value` in a flat-keyed file such as `cpu.stat`.
fn stat_value(path: &Path, text: &str, key: &str) -> Result<u64> {
    for line in text.lines() {
        let mut words = line.split_ascii_whitespace();
        if words.next() == Some(key) {
            return match (words.next().map(str::parse::<u64>), words.next()) {
                (Some(Ok(value)), None) => Ok(value),
                _ => Err(malformed(path, "value is not one unsigned number")),
            };
        }
    }
    Err(malformed(path, "key missing"))
}

/// Whether a space-separated list file (`cgroup.controllers`, `cgroup.subtree_control`) has
/// `word`; a missing file has nothing.
fn lists_word(path: &Path, word: &str) -> Result<bool> {
    match read_bounded(path) {
        Ok(text) => Ok(text.split_ascii_whitespace().any(|w| w == word)),
        Err(CgroupError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            Ok(false)
        }
        Err(err) => Err(err),
    }
}

/// Reads a `cgroup.procs` file.
fn read_pids(path: &Path) -> Result<Vec<u32>> {
    read_bounded(path)?
        .lines()
        .map(|line| {
            line.trim()
                .parse::<u32>()
                .map_err(|_| malformed(path, "a line is not a pid"))
        })
        .collect()
}

fn parse_number<T: std::str::FromStr>(path: &Path, text: &str) -> Result<T> {
    text.trim()
        .parse()
        .map_err(|_| malformed(path, "not one unsigned number"))
}

fn read_bounded_bytes(path: &Path) -> Result<Vec<u8>> {
    let io_err = |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = fs::File::open(path).map_err(io_err)?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io_err)?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_FILE_BYTES {
        return Err(CgroupError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    Ok(bytes)
}

fn read_bounded(path: &Path) -> Result<String> {
    String::from_utf8(read_bounded_bytes(path)?).map_err(|_| malformed(path, "not UTF-8"))
}

/// Writes one value to an existing control file (never creates one).
fn write_value(path: &Path, value: impl std::fmt::Display) -> Result<()> {
    let io_err = |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(io_err)?;
    file.write_all(format!("{value}\n").as_bytes())
        .map_err(io_err)
}

fn make_dir(path: &Path) -> Result<()> {
    fs::create_dir(path).map_err(|source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn malformed(path: &Path, what: &'static str) -> CgroupError {
    CgroupError::Malformed {
        path: path.to_path_buf(),
        what,
    }
}

fn check_pid(pid: u32) -> Result<()> {
    if pid == 0 || pid > MAX_PID {
        return Err(CgroupError::InvalidPid(pid));
    }
    Ok(())
}

/// A cgroup name: 1..=[`MAX_NAME_LEN`] bytes of `[A-Za-z0-9_.-]`, not starting with `.` (which
/// also rules out `.` and `..`).
fn check_name(name: &str) -> Result<()> {
    if crate::proto::is_plain_name(name, MAX_NAME_LEN) {
        Ok(())
    } else {
        Err(CgroupError::InvalidName(name.to_owned()))
    }
}

/// A parent path: `""` or `/` for the root, else up to [`MAX_PARENT_DEPTH`] valid names joined
/// by `/` (a leading `/` is allowed).
fn check_parent(parent: &str) -> Result<PathBuf> {
    let trimmed = parent.strip_prefix('/').unwrap_or(parent);
    if trimmed.is_empty() {
        return Ok(PathBuf::new());
    }
    let parts: Vec<&str> = trimmed.split('/').collect();
    if parts.len() > MAX_PARENT_DEPTH {
        return Err(CgroupError::InvalidName(parent.to_owned()));
    }
    for part in &parts {
        check_name(part).map_err(|_| CgroupError::InvalidName(parent.to_owned()))?;
    }
    Ok(parts.iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tempfile::TempDir;

    /// A fake host: procfs, a v2 tree, and separate v1 cpu and cpuacct trees.
    struct Fake {
        dir: TempDir,
        fs: CgroupFs,
    }

    impl Fake {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let fs = CgroupFs {
                v1_cpu_root: dir.path().join("cpu"),
                v1_cpuacct_root: dir.path().join("cpuacct"),
                v2_root: dir.path().join("unified"),
                proc_root: dir.path().join("proc"),
            };
            for root in [
                &fs.v1_cpu_root,
                &fs.v1_cpuacct_root,
                &fs.v2_root,
                &fs.proc_root,
            ] {
                fs::create_dir_all(root).unwrap();
            }
            Self { dir, fs }
        }

        fn write(&self, rel: &str, content: &str) {
            let path = self.dir.path().join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, content).unwrap();
        }

        fn read(&self, rel: &str) -> String {
            fs::read_to_string(self.dir.path().join(rel)).unwrap()
        }

        fn thread(&self, pid: u32, tid: u32, comm: &str, state: char, sched: Option<&str>) {
            let base = format!("proc/{pid}/task/{tid}");
            self.write(
                &format!("{base}/stat"),
                &format!("{tid} ({comm}) {state} 1 1 0 0 -1 4194560 0 0 0 0\n"),
            );
            if let Some(sched) = sched {
                self.write(&format!("{base}/schedstat"), sched);
            }
        }

        /// pid 100: v2 cgroup /vms/a with the cpu controller.
        fn v2_vm(&self) {
            self.write("proc/100/cgroup", "0::/vms/a\n");
            self.write(
                "unified/vms/a/cgroup.controllers",
                "cpuset cpu io memory pids\n",
            );
            self.write("unified/vms/a/cpu.weight", "250\n");
            self.write(
                "unified/vms/a/cpu.stat",
                "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n",
            );
            self.write("unified/vms/a/cgroup.procs", "100\n");
        }

        /// pid 200: hybrid; v2 cgroup without cpu, v1 cpu and cpuacct cgroups /vm.
        fn v1_vm(&self) {
            self.write(
                "proc/200/cgroup",
                "4:memory:/\n3:cpuacct:/vm\n2:cpu:/vm\n1:name=systemd:/\n0::/vm\n",
            );
            self.write("unified/vm/cgroup.controllers", "memory pids\n");
            self.write("cpu/cgroup.procs", "");
            self.write("cpu/vm/cpu.shares", "2048\n");
            self.write("cpu/vm/cgroup.procs", "200\n");
            self.write("cpuacct/cgroup.procs", "");
            self.write("cpuacct/vm/cpuacct.usage", "123456789\n");
            self.write("cpuacct/vm/cgroup.procs", "200\n");
        }
    }

    fn is_malformed(result: Result<impl std::fmt::Debug>) -> bool {
        matches!(result, Err(CgroupError::Malformed { .. }))
    }

    #[test]
    fn conversions_follow_systemd() {
        assert_eq!(shares_to_weight(1024), 100);
        assert_eq!(shares_to_weight(2048), 200);
        assert_eq!(shares_to_weight(2), 1);
        assert_eq!(shares_to_weight(0), 1);
        assert_eq!(shares_to_weight(1023), 99, "truncating division");
        assert_eq!(
            shares_to_weight(SHARES_MAX),
            WEIGHT_MAX,
            "25600 clamps to 10000"
        );
        assert_eq!(shares_to_weight(u64::MAX), WEIGHT_MAX, "no overflow");
        assert_eq!(weight_to_shares(100), 1024);
        assert_eq!(weight_to_shares(1), 10);
        assert_eq!(weight_to_shares(0), SHARES_MIN, "systemd's idle weight");
        assert_eq!(weight_to_shares(WEIGHT_MAX), 102_400);
        assert_eq!(weight_to_shares(u32::MAX), SHARES_MAX);
    }

    #[test]
    fn conversions_round_trip_within_one_step() {
        for weight in WEIGHT_MIN..=WEIGHT_MAX {
            let back = shares_to_weight(weight_to_shares(weight));
            assert!(weight - back <= 1, "weight {weight} came back as {back}");
        }
        for weight in [1, 50, 100, 200, 400, 1000, 10_000] {
            assert_eq!(shares_to_weight(weight_to_shares(weight)), weight);
        }
        for shares in (1024..=SHARES_MAX).step_by(1024) {
            let back = weight_to_shares(shares_to_weight(shares));
            assert_eq!(back, shares.min(102_400), "shares {shares}");
        }
    }

    #[test]
    fn proc_cgroup_parses_v2_v1_and_hybrid() {
        let p = Path::new("x");
        let v2 = parse_proc_cgroup(p, "0::/user.slice/vm\n").unwrap();
        assert_eq!(v2.v2, Some(PathBuf::from("user.slice/vm")));
        assert_eq!(v2.v1_cpu, None);
        let v1 = parse_proc_cgroup(p, "5:cpu,cpuacct:/machine/vm1\n1:name=systemd:/x\n").unwrap();
        assert_eq!(v1.v1_cpu, Some(PathBuf::from("machine/vm1")));
        assert_eq!(v1.v1_cpuacct, Some(PathBuf::from("machine/vm1")));
        let root = parse_proc_cgroup(p, "0::/\n2:cpu:/\n").unwrap();
        assert_eq!(root.v2, Some(PathBuf::new()));
        assert_eq!(root.v1_cpu, Some(PathBuf::new()));
        // "cpuset" is not "cpu".
        assert_eq!(parse_proc_cgroup(p, "3:cpuset:/a\n").unwrap().v1_cpu, None);
        // A path may itself hold ':'.
        let colon = parse_proc_cgroup(p, "0::/a:b\n").unwrap();
        assert_eq!(colon.v2, Some(PathBuf::from("a:b")));
    }

    #[test]
    fn proc_cgroup_rejects_malformed_lines() {
        let p = Path::new("x");
        for bad in [
            "0:/a\n",
            "garbage\n",
            "x::/a\n",
            "0::relative\n",
            "0::/a/../../etc\n",
            "2:cpu:/./a\n",
            "0::\n",
        ] {
            assert!(is_malformed(parse_proc_cgroup(p, bad)), "{bad:?}");
        }
    }

    #[test]
    fn v2_cgroup_with_cpu_controller_is_preferred() {
        let fake = Fake::new();
        fake.v2_vm();
        let cg = fake.fs.locate(100).unwrap();
        assert_eq!(cg.hierarchy(), Hierarchy::V2);
        assert_eq!(cg.path(), fake.fs.v2_root.join("vms/a"));
        assert_eq!(cg.weight().unwrap(), 250);
        assert_eq!(cg.usage().unwrap(), 1_500_000);
        cg.set_weight(700).unwrap();
        assert_eq!(fake.read("unified/vms/a/cpu.weight"), "700\n");
        assert!(matches!(
            cg.set_weight(0),
            Err(CgroupError::InvalidWeight(0))
        ));
        assert!(matches!(
            cg.set_weight(10_001),
            Err(CgroupError::InvalidWeight(_))
        ));
        assert_eq!(cg.pids().unwrap(), vec![100]);
    }

    #[test]
    fn a_libvirt_domain_is_weighted_at_its_scope() {
        let fake = Fake::new();
        let scope = "machine.slice/machine-qemu\\x2d1\\x2dvm1.scope";
        // cgroup v2: QEMU's main thread in libvirt/emulator, the scope has the cpu controller.
        fake.write(
            "proc/300/cgroup",
            &format!("0::/{scope}/libvirt/emulator\n"),
        );
        for dir in [scope.to_owned(), format!("{scope}/libvirt/emulator")] {
            fake.write(
                &format!("unified/{dir}/cgroup.controllers"),
                "cpu io memory\n",
            );
            fake.write(&format!("unified/{dir}/cpu.weight"), "100\n");
        }
        let cg = fake.fs.locate(300).unwrap();
        assert_eq!(cg.path(), fake.fs.v2_root.join(scope));
        cg.set_weight(400).unwrap();
        assert_eq!(fake.read(&format!("unified/{scope}/cpu.weight")), "400\n");
        assert_eq!(
            fake.read(&format!("unified/{scope}/libvirt/emulator/cpu.weight")),
            "100\n"
        );
        // cgroup v1 without systemd: emulator directly below the domain's group.
        fake.write(
            "proc/301/cgroup",
            "2:cpu,cpuacct:/machine/qemu-2-vm2.libvirt-qemu/emulator\n0::/\n",
        );
        fake.write("cpu/machine/qemu-2-vm2.libvirt-qemu/cpu.shares", "1024\n");
        let cg = fake.fs.locate(301).unwrap();
        assert_eq!(
            cg.path(),
            fake.fs.v1_cpu_root.join("machine/qemu-2-vm2.libvirt-qemu")
        );
    }

    #[test]
    fn only_libvirt_layouts_are_lifted() {
        for (rel, vm) in [
            (
                "machine.slice/machine-qemu.scope/libvirt/emulator",
                "machine.slice/machine-qemu.scope",
            ),
            (
                "machine.slice/m.scope/libvirt/vcpu12",
                "machine.slice/m.scope",
            ),
            ("machine.slice/m.scope/iothread1", "machine.slice/m.scope"),
            ("vms/a", "vms/a"),
            ("vms/emulator", "vms/emulator"),
            ("emulator", "emulator"),
            ("libvirt/emulator", "libvirt/emulator"),
            ("m.scope/vcpu", "m.scope/vcpu"),
            ("m.scope/vcpuX", "m.scope/vcpuX"),
            ("m.scope", "m.scope"),
            ("", ""),
        ] {
            assert_eq!(vm_level(PathBuf::from(rel)), PathBuf::from(vm), "{rel}");
        }
    }

    #[test]
    fn missing_v2_cpu_controller_falls_back_to_v1() {
        let fake = Fake::new();
        fake.v1_vm();
        let cg = fake.fs.locate(200).unwrap();
        assert_eq!(cg.hierarchy(), Hierarchy::V1);
        assert_eq!(cg.path(), fake.fs.v1_cpu_root.join("vm"));
        assert_eq!(cg.weight().unwrap(), 200);
        assert_eq!(cg.usage().unwrap(), 123_456_789);
        cg.set_weight(50).unwrap();
        assert_eq!(fake.read("cpu/vm/cpu.shares"), "512\n");

        // v2 cgroup without cgroup.controllers at all, and a v2 root cgroup with cpu: v1 too.
        fake.write("proc/201/cgroup", "2:cpu:/vm\n3:cpuacct:/vm\n0::/\n");
        fake.write("unified/cgroup.controllers", "cpu memory\n");
        assert_eq!(fake.fs.locate(201).unwrap().hierarchy(), Hierarchy::V1);
        fake.write("proc/202/cgroup", "2:cpu:/vm\n0::/gone\n");
        let cg = fake.fs.locate(202).unwrap();
        assert_eq!(cg.hierarchy(), Hierarchy::V1);
        assert!(matches!(cg.usage(), Err(CgroupError::NoUsage(_))));
    }

    #[test]
    fn comounted_v1_reads_usage_from_the_cpu_directory() {
        let fake = Fake::new();
        let fs = CgroupFs {
            v1_cpuacct_root: fake.fs.v1_cpu_root.clone(),
            ..fake.fs.clone()
        };
        fake.write("proc/300/cgroup", "2:cpu,cpuacct:/vm\n0::/\n");
        fake.write("cpu/vm/cpu.shares", "1024\n");
        fake.write("cpu/vm/cpuacct.usage", "42\n");
        let cg = fs.locate(300).unwrap();
        assert_eq!((cg.weight().unwrap(), cg.usage().unwrap()), (100, 42));
    }

    #[test]
    fn no_cpu_controller_anywhere_is_an_error() {
        let fake = Fake::new();
        fake.write("proc/400/cgroup", "0::/vm\n4:memory:/vm\n");
        assert!(matches!(
            fake.fs.locate(400),
            Err(CgroupError::NoCpuController(400))
        ));
        // Listed in /proc but the v1 directory does not exist.
        fake.write("proc/401/cgroup", "2:cpu:/absent\n");
        assert!(matches!(
            fake.fs.locate(401),
            Err(CgroupError::NoCpuController(401))
        ));
        // No such process.
        assert!(matches!(fake.fs.locate(402), Err(CgroupError::Io { .. })));
    }

    #[test]
    fn invalid_pids_are_refused() {
        let fake = Fake::new();
        for pid in [0, MAX_PID + 1, u32::MAX] {
            assert!(matches!(
                fake.fs.locate(pid),
                Err(CgroupError::InvalidPid(_))
            ));
            assert!(matches!(
                fake.fs.threads(pid),
                Err(CgroupError::InvalidPid(_))
            ));
        }
        fake.v2_vm();
        let cg = fake.fs.locate(100).unwrap();
        assert!(matches!(cg.add_pid(0), Err(CgroupError::InvalidPid(0))));
        assert!(matches!(
            cg.move_out(MAX_PID + 1),
            Err(CgroupError::InvalidPid(_))
        ));
    }

    #[test]
    fn malformed_control_files_are_errors() {
        let fake = Fake::new();
        fake.v2_vm();
        let cg = fake.fs.locate(100).unwrap();
        for bad in ["", "abc\n", "0\n", "10001\n", "-5\n", "1 2\n"] {
            fake.write("unified/vms/a/cpu.weight", bad);
            assert!(is_malformed(cg.weight()), "cpu.weight {bad:?}");
        }
        fake.write(
            "unified/vms/a/cpu.weight",
            &"1".repeat(MAX_FILE_BYTES as usize + 1),
        );
        assert!(matches!(cg.weight(), Err(CgroupError::TooLarge { .. })));
        fake.write("unified/vms/a/cpu.weight", "\u{0}\u{ff}");
        assert!(is_malformed(cg.weight()));
        for bad in [
            "user_usec 5\n",
            "usage_usec\n",
            "usage_usec x\n",
            "usage_usec 1 2\n",
            "usage_usec 18446744073709551615\n",
        ] {
            fake.write("unified/vms/a/cpu.stat", bad);
            assert!(is_malformed(cg.usage()), "cpu.stat {bad:?}");
        }
        fake.write("unified/vms/a/cgroup.procs", "100\nnope\n");
        assert!(is_malformed(cg.pids()));
        fs::remove_file(fake.dir.path().join("unified/vms/a/cpu.weight")).unwrap();
        assert!(matches!(cg.weight(), Err(CgroupError::Io { .. })));
        assert!(
            matches!(cg.set_weight(5), Err(CgroupError::Io { .. })),
            "never creates files"
        );

        fake.v1_vm();
        let cg = fake.fs.locate(200).unwrap();
        fake.write("cpu/vm/cpu.shares", "many\n");
        assert!(is_malformed(cg.weight()));
        fake.write("cpuacct/vm/cpuacct.usage", "-1\n");
        assert!(is_malformed(cg.usage()));
    }

    #[test]
    fn stat_comm_may_hold_spaces_and_parentheses() {
        assert_eq!(
            parse_stat(b"12 (CPU 0/KVM) R 1 2").unwrap(),
            (&b"CPU 0/KVM"[..], b'R')
        );
        assert_eq!(
            parse_stat(b"12 (a) (b c) S 1").unwrap(),
            (&b"a) (b c"[..], b'S')
        );
        assert_eq!(parse_stat(b"12 ()) R 1").unwrap(), (&b")"[..], b'R'));
        assert_eq!(parse_stat(b"12 (x) R").unwrap(), (&b"x"[..], b'R'));
        assert_eq!(
            parse_stat(b"12 (\xff\n) D 1").unwrap(),
            (&b"\xff\n"[..], b'D')
        );
        for bad in [
            &b""[..],
            b"12 x R",
            b"12 (x R 1",
            b"12 )x( R",
            b"ab (x) R",
            b"(x) R",
            b"12 (x)",
            b"12 (x) ",
            b"12 (x)R 1",
            b"12 (x) 5 1",
        ] {
            assert!(
                parse_stat(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn schedstat_and_vcpu_names_parse_strictly() {
        let s = parse_schedstat("100 20 3\n").unwrap();
        assert_eq!((s.run_ns, s.wait_ns, s.timeslices), (100, 20, 3));
        for bad in ["", "1 2", "1 2 x", "1 2 3 4", "-1 2 3"] {
            assert!(parse_schedstat(bad).is_err(), "{bad:?}");
        }
        for good in ["CPU 0/KVM", "CPU 17/TCG", "CPU 3/HVF", "CPU 0/DUMMY"] {
            assert!(is_vcpu_comm(good), "{good}");
        }
        for other in [
            "qemu-system-x86",
            "CPU /KVM",
            "CPU x/KVM",
            "CPU 1/",
            "CPU 1",
            "cpu 1/KVM",
        ] {
            assert!(!is_vcpu_comm(other), "{other}");
        }
    }

    #[test]
    fn hint_counts_only_vcpu_threads_when_present() {
        let fake = Fake::new();
        fake.v2_vm();
        fake.thread(100, 100, "qemu-system-x86", 'R', Some("1 0 1\n"));
        fake.thread(100, 101, "CPU 0/KVM", 'S', Some("1 0 1\n"));
        fake.thread(100, 102, "CPU 1/KVM", 'S', None);
        fake.thread(100, 103, "worker (x) R", 'S', None);
        let mut probe = CpuProbe::new(fake.fs.clone(), 100).unwrap();
        let hint = probe.sample(0).unwrap();
        assert_eq!(
            hint,
            CpuHint {
                weight: 250,
                running: false,
                runnable: false,
                usage: 1_500_000
            },
            "a runnable I/O thread is not a running vCPU"
        );
        fake.thread(100, 102, "CPU 1/KVM", 'R', None);
        let hint = probe.sample(100_000_000).unwrap();
        assert!(hint.running && hint.runnable);
    }

    #[test]
    fn hint_uses_all_threads_without_vcpu_names() {
        let fake = Fake::new();
        fake.v2_vm();
        fake.thread(100, 100, "main", 'S', None);
        fake.thread(100, 104, "busy one", 'R', None);
        // An entry that is not a tid is skipped, and a thread without stat has exited.
        fs::create_dir_all(fake.dir.path().join("proc/100/task/self")).unwrap();
        fs::create_dir_all(fake.dir.path().join("proc/100/task/105")).unwrap();
        let threads = fake.fs.threads(100).unwrap();
        assert_eq!(
            threads.iter().map(|t| t.tid).collect::<Vec<_>>(),
            vec![100, 104]
        );
        assert_eq!(threads[1].comm, "busy one");
        let hint = CpuProbe::new(fake.fs.clone(), 100)
            .unwrap()
            .sample(0)
            .unwrap();
        assert!(hint.running && hint.runnable);
    }

    #[test]
    fn schedstat_history_tells_a_busy_vcpu_from_a_halting_one() {
        const MS: Nanos = 1_000_000;
        let fake = Fake::new();
        fake.v2_vm();
        fake.thread(100, 101, "CPU 0/KVM", 'R', Some("1000 0 1\n"));
        let mut probe = CpuProbe::new(fake.fs.clone(), 100).unwrap();
        assert!(
            probe.sample(100 * MS).unwrap().running,
            "no history: R counts as running"
        );
        // In the next 100 ms it ran 10 ms and waited 30: it mostly slept (a halting vCPU
        // woken by interrupts), so runnable now but not running.
        fake.thread(100, 101, "CPU 0/KVM", 'R', Some("10001000 30000000 2\n"));
        let hint = probe.sample(200 * MS).unwrap();
        assert!(hint.runnable && !hint.running, "{hint:?}");
        // Then it ran 30 ms and waited 70 ms of 100: a spinning vCPU on an oversubscribed
        // host, which waits longer than it runs, is still running.
        fake.thread(100, 101, "CPU 0/KVM", 'R', Some("40001000 100000000 3\n"));
        assert!(probe.sample(300 * MS).unwrap().running);
        // Exactly half of the time busy is enough; a little less is not.
        fake.thread(100, 101, "CPU 0/KVM", 'R', Some("65001000 125000000 4\n"));
        assert!(probe.sample(400 * MS).unwrap().running);
        fake.thread(100, 101, "CPU 0/KVM", 'R', Some("90001000 149999999 5\n"));
        assert!(!probe.sample(500 * MS).unwrap().running);
        // A sleeping thread is never running, however busy it was.
        fake.thread(100, 101, "CPU 0/KVM", 'S', Some("190001000 149999999 6\n"));
        assert!(!probe.sample(600 * MS).unwrap().running);
        // A clock that did not advance (or went back) gives no rate: R counts as running.
        fake.thread(100, 101, "CPU 0/KVM", 'R', Some("190001001 149999999 7\n"));
        assert!(probe.sample(600 * MS).unwrap().running);
        assert!(probe.sample(500 * MS).unwrap().running);
        // Counters that went backwards (a new thread with a reused tid) count as idle time.
        fake.thread(100, 101, "CPU 0/KVM", 'R', Some("5 5 1\n"));
        assert!(!probe.sample(700 * MS).unwrap().running);
    }

    #[test]
    fn malformed_thread_files_are_errors() {
        let fake = Fake::new();
        fake.v2_vm();
        fake.thread(100, 101, "CPU 0/KVM", 'R', Some("1 2\n"));
        assert!(is_malformed(fake.fs.threads(100)));
        fake.write("proc/100/task/101/schedstat", "1 2 3\n");
        fake.write("proc/100/task/101/stat", "101 CPU 0/KVM R\n");
        assert!(is_malformed(fake.fs.threads(100)));
        fake.write(
            "proc/100/task/101/stat",
            &"x".repeat(MAX_FILE_BYTES as usize + 1),
        );
        assert!(matches!(
            fake.fs.threads(100),
            Err(CgroupError::TooLarge { .. })
        ));
        // No task directory: the process is gone.
        fake.write("proc/101/cgroup", "0::/vms/a\n");
        assert!(matches!(fake.fs.threads(101), Err(CgroupError::Io { .. })));
    }

    #[test]
    fn too_many_threads_are_refused() {
        let fake = Fake::new();
        let task = fake.dir.path().join("proc/100/task");
        fs::create_dir_all(&task).unwrap();
        for tid in 1..=4 {
            fs::File::create(task.join(tid.to_string())).unwrap();
        }
        fs::File::create(task.join("not-a-tid")).unwrap();
        assert_eq!(list_tids(&task, 100, 4).unwrap().len(), 4);
        assert!(matches!(
            list_tids(&task, 100, 3),
            Err(CgroupError::TooManyThreads(100))
        ));
        // Files where thread directories should be: an error, not a panic.
        assert!(matches!(fake.fs.threads(100), Err(CgroupError::Io { .. })));
    }

    #[test]
    fn names_and_parents_are_validated() {
        let fake = Fake::new();
        fake.write("unified/cgroup.subtree_control", "cpu\n");
        let long = "a".repeat(MAX_NAME_LEN + 1);
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "a/b",
            "a b",
            "a\nb",
            "é",
            long.as_str(),
        ] {
            assert!(
                matches!(
                    fake.fs.create_vm_cgroup("", bad),
                    Err(CgroupError::InvalidName(_))
                ),
                "{bad:?}"
            );
        }
        let deep = vec!["p"; MAX_PARENT_DEPTH + 1].join("/");
        for bad in ["..", "a/../b", "a//b", "a/", "/..", deep.as_str()] {
            assert!(
                matches!(
                    fake.fs.create_vm_cgroup(bad, "vm"),
                    Err(CgroupError::InvalidName(_))
                ),
                "{bad:?}"
            );
        }
        assert!(
            fake.fs
                .create_vm_cgroup(&"a".repeat(MAX_NAME_LEN), "x")
                .is_err()
        );
        assert!(fake.dir.path().join("unified").read_dir().unwrap().count() == 1);
    }

    #[test]
    fn create_prefers_v2_when_the_parent_enables_cpu() {
        let fake = Fake::new();
        fake.write("unified/machine/cgroup.subtree_control", "memory cpu\n");
        let cg = fake.fs.create_vm_cgroup("/machine", "vm-1").unwrap();
        assert_eq!(cg.hierarchy(), Hierarchy::V2);
        assert_eq!(cg.path(), fake.fs.v2_root.join("machine/vm-1"));
        assert!(cg.path().is_dir());
        // The kernel would create the control files; the fake tree needs them written.
        fake.write("unified/machine/vm-1/cgroup.procs", "");
        cg.add_pid(4321).unwrap();
        assert_eq!(fake.read("unified/machine/vm-1/cgroup.procs"), "4321\n");
        assert!(matches!(cg.clone().remove(), Err(CgroupError::NotEmpty(_))));
        assert!(matches!(
            fake.fs.create_vm_cgroup("machine", "vm-1"),
            Err(CgroupError::Io { .. })
        ));
    }

    #[test]
    fn create_falls_back_to_v1_with_its_cpuacct_twin() {
        let fake = Fake::new();
        fake.write("unified/cgroup.subtree_control", "memory\n");
        fake.write("cpu/cgroup.procs", "7\n");
        fake.write("cpuacct/cgroup.procs", "7\n");
        let cg = fake.fs.create_vm_cgroup("", "vm2").unwrap();
        assert_eq!(cg.hierarchy(), Hierarchy::V1);
        assert!(fake.fs.v1_cpu_root.join("vm2").is_dir());
        assert!(fake.fs.v1_cpuacct_root.join("vm2").is_dir());
        fake.write("cpu/vm2/cgroup.procs", "");
        fake.write("cpuacct/vm2/cgroup.procs", "");
        cg.add_pid(9).unwrap();
        assert_eq!(fake.read("cpuacct/vm2/cgroup.procs"), "9\n");
        assert!(matches!(
            cg.move_out(10),
            Err(CgroupError::NotMember { pid: 10, .. })
        ));
        cg.move_out(9).unwrap();
        assert_eq!(fake.read("cpu/cgroup.procs"), "9\n");
        assert_eq!(fake.read("cpuacct/cgroup.procs"), "9\n");
        // The fake files still list 9 (the kernel would have dropped it).
        assert!(matches!(cg.clone().remove(), Err(CgroupError::NotEmpty(_))));
        fake.write("cpu/vm2/cgroup.procs", "");
        assert!(
            matches!(cg.clone().remove(), Err(CgroupError::NotEmpty(_))),
            "cpuacct twin"
        );
        fake.write("cpuacct/vm2/cgroup.procs", "");
        // Unlike cgroupfs, a fake directory holding files cannot be removed.
        assert!(matches!(cg.remove(), Err(CgroupError::Io { .. })));
    }

    #[test]
    fn create_without_any_cpu_controller_fails() {
        let fake = Fake::new();
        fake.write("unified/cgroup.subtree_control", "memory\n");
        assert!(matches!(
            fake.fs.create_vm_cgroup("", "vm"),
            Err(CgroupError::NoCpuControllerUnder(_))
        ));
        assert!(matches!(
            fake.fs.create_vm_cgroup("missing", "vm"),
            Err(CgroupError::NoCpuControllerUnder(_))
        ));
    }

    #[test]
    fn root_cgroups_cannot_be_left_or_removed() {
        let fake = Fake::new();
        fake.write("proc/500/cgroup", "2:cpu:/\n");
        fake.write("cpu/cgroup.procs", "500\n");
        let cg = fake.fs.locate(500).unwrap();
        assert!(matches!(cg.move_out(500), Err(CgroupError::IsRoot(_))));
        assert!(matches!(cg.remove(), Err(CgroupError::IsRoot(_))));
    }
    #[test]
    fn raw_weights_are_put_back_exactly() {
        let fake = Fake::new();
        fake.v1_vm();
        fake.write("cpu/vm/cpu.shares", "1000\n");
        let v1 = fake.fs.locate(200).unwrap();
        let saved = v1.raw_weight().unwrap();
        assert_eq!(
            saved,
            RawWeight {
                hierarchy: Hierarchy::V1,
                value: 1000
            }
        );
        v1.set_weight(v1.weight().unwrap()).unwrap();
        assert_eq!(
            fake.read("cpu/vm/cpu.shares"),
            "993\n",
            "the lossy round trip"
        );
        v1.set_raw_weight(saved).unwrap();
        assert_eq!(fake.read("cpu/vm/cpu.shares"), "1000\n");

        fake.v2_vm();
        let v2 = fake.fs.locate(100).unwrap();
        assert_eq!(v2.raw_weight().unwrap().value, 250);
        assert!(matches!(
            v2.set_raw_weight(saved),
            Err(CgroupError::WrongHierarchy(_))
        ));
        for value in [0, 10_001] {
            let raw = RawWeight {
                hierarchy: Hierarchy::V2,
                value,
            };
            assert!(matches!(
                v2.set_raw_weight(raw),
                Err(CgroupError::InvalidWeight(_))
            ));
        }
        assert_eq!(fake.read("unified/vms/a/cpu.weight"), "250\n");
        for bad in ["1\n", "262145\n", "x\n"] {
            fake.write("cpu/vm/cpu.shares", bad);
            assert!(is_malformed(v1.raw_weight()), "cpu.shares {bad:?}");
        }
    }

    #[test]
    fn the_probe_counts_vcpu_threads() {
        let fake = Fake::new();
        fake.v2_vm();
        fake.thread(100, 100, "ld-linux-x86-64", 'S', None);
        fake.thread(100, 101, "call_rcu", 'S', None);
        fake.thread(100, 102, "CPU 0/DUMMY", 'S', None);
        let mut probe = CpuProbe::new(fake.fs.clone(), 100).unwrap();
        assert_eq!(probe.vcpu_threads(), 0, "before the first sample");
        probe.sample(0).unwrap();
        assert_eq!(probe.vcpu_threads(), 1);
        fake.thread(100, 103, "CPU 1/DUMMY", 'S', None);
        probe.sample(1).unwrap();
        assert_eq!(probe.vcpu_threads(), 2);
    }
}
