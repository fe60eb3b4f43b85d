//! The device process sandbox (docs/SECURITY.md, "Device process sandbox"), entered by
//! `vgpu-server` once start-up is done, in the spirit of crosvm's and Firecracker's jails:
//!
//! 1. [`close_inherited_fds`], first thing in `main`: every descriptor above stderr that the
//!    process inherited (from a daemon that serves other VMs, say) is closed.
//! 2. [`enter`], after the vfio-user socket is bound and the worker has initialised
//!    virglrenderer/EGL: drops to `--run-as UID:GID` when started as root (supplementary groups
//!    cleared, checked that root cannot be regained), sets no_new_privs, then installs a seccomp
//!    filter on every thread of the process (TSYNC) whose default action kills the process.
//!    Threads created later (llvmpipe's rasterisers) inherit it.
//!
//! The allow-list, [`ALLOWED`], was measured with `strace -f` over the qtest suites (2D, virgl
//! 3D on llvmpipe, load groups, scheduler connection, reset, DMA map/unmap) and real guests.
//! It allows what a virglrenderer bug could use anyway inside the process (memory, files it
//! may open) but no process creation, no execve, no ptrace, no new privileges and no sockets
//! other than Unix ones.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use log::{info, warn};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Environment variable that makes the worker issue a forbidden syscall (`ptrace`) when the
/// scheduler daemon first grants it GPU time, once the filter is installed: the process must
/// die of SIGSYS and the daemon must free its vGPU. Used by the tests; documented in
/// docs/SECURITY.md. Ignored without the filter (`--no-sandbox`).
pub const SELFTEST_ENV: &str = "VGPU_SANDBOX_SELFTEST";

/// Set by [`enter`] when the filter is installed and [`SELFTEST_ENV`] is set.
static SELFTEST: AtomicBool = AtomicBool::new(false);

/// Errors entering the sandbox.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// `--run-as` is not `UID:GID`.
    #[error("--run-as {0:?}: expected UID:GID (numbers)")]
    RunAsSyntax(String),
    /// `--run-as` names another user but the process is not root.
    #[error("--run-as {uid}:{gid}: switching user needs root (running as uid {current})")]
    NotRoot {
        /// Requested uid.
        uid: u32,
        /// Requested gid.
        gid: u32,
        /// The process's effective uid.
        current: u32,
    },
    /// `--run-as 0:..` would not drop anything.
    #[error("--run-as: uid 0 and gid 0 are root")]
    RunAsRoot,
    /// A system call of the privilege drop failed.
    #[error("{call}: {source}")]
    Sys {
        /// The call.
        call: &'static str,
        /// Its error.
        #[source]
        source: std::io::Error,
    },
    /// After the drop the process could still become root again.
    #[error("the process regained uid or gid 0 after dropping to {uid}:{gid}")]
    RegainedRoot {
        /// The uid dropped to.
        uid: u32,
        /// The gid dropped to.
        gid: u32,
    },
    /// The filter could not be built (a bug in [`ALLOWED`]).
    #[error("building the seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    /// The filter could not be compiled or installed.
    #[error("installing the seccomp filter: {0}")]
    Install(#[from] seccompiler::Error),
}

/// A user and group to run as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

impl std::str::FromStr for RunAs {
    type Err = SandboxError;

    fn from_str(s: &str) -> Result<RunAs, SandboxError> {
        let syntax = || SandboxError::RunAsSyntax(s.to_string());
        let (uid, gid) = s.split_once(':').ok_or_else(syntax)?;
        let run_as = RunAs {
            uid: uid.parse().map_err(|_| syntax())?,
            gid: gid.parse().map_err(|_| syntax())?,
        };
        if run_as.uid == 0 || run_as.gid == 0 {
            return Err(SandboxError::RunAsRoot);
        }
        Ok(run_as)
    }
}

/// What the sandbox is asked to do.
#[derive(Debug, Clone, Copy)]
pub struct SandboxConfig {
    /// Install the seccomp filter (`false` with `--no-sandbox`, for debugging).
    pub filter: bool,
    /// Drop to this user when started as root (`--run-as`).
    pub run_as: Option<RunAs>,
}

/// Closes every descriptor above stderr, returning how many were open. Call it first in
/// `main`, before anything opens a descriptor of its own.
pub fn close_inherited_fds() -> Result<usize, SandboxError> {
    let sys = |call, source| SandboxError::Sys { call, source };
    // Counted (for the log) before closing; the directory's own descriptor is gone by then.
    let open = std::fs::read_dir("/proc/self/fd")
        .map_err(|e| sys("reading /proc/self/fd", e))?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&fd| fd > libc::STDERR_FILENO)
        .collect::<Vec<_>>();
    // SAFETY: close_range takes no pointers; nothing in this process owns a descriptor above
    // stderr yet (this runs first in main), so no Rust object is left with a closed fd.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if rc != 0 {
        return Err(sys("close_range", std::io::Error::last_os_error()));
    }
    // The read_dir descriptor was among them, already closed when it was dropped.
    Ok(open.len().saturating_sub(1))
}

/// What [`enter`] did, for the start-up log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SandboxState {
    /// The seccomp filter is installed on every thread.
    pub filter: bool,
    /// The real, effective and saved uid now.
    pub uid: u32,
    /// The real, effective and saved gid now.
    pub gid: u32,
}

/// Drops privileges as configured, sets no_new_privs and installs the seccomp filter on every
/// thread. Call once start-up is done (socket bound, renderer initialised).
pub fn enter(config: SandboxConfig) -> Result<SandboxState, SandboxError> {
    if let Some(run_as) = config.run_as {
        drop_user(run_as)?;
    }
    set_no_new_privs()?;
    if config.filter {
        for program in filters()? {
            seccompiler::apply_filter_all_threads(&program)?;
        }
        SELFTEST.store(std::env::var_os(SELFTEST_ENV).is_some(), Ordering::Release);
    } else {
        warn!("--no-sandbox: no seccomp filter; a compromised renderer owns this process's user");
    }
    // SAFETY: getuid/getgid take no arguments and cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    Ok(SandboxState {
        filter: config.filter,
        uid,
        gid,
    })
}

/// With [`SELFTEST_ENV`] set and the filter installed, issues a syscall the filter forbids
/// (`ptrace(PTRACE_TRACEME)`), which kills the process. The worker calls it when the scheduler
/// daemon first grants it GPU time.
pub fn selftest_point() {
    if SELFTEST.load(Ordering::Acquire) {
        warn!("{SELFTEST_ENV}: issuing a forbidden syscall (ptrace); the process must die");
        // SAFETY: PTRACE_TRACEME takes no pointers; the filter kills the process before it runs.
        unsafe { libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) };
    }
}

fn set_no_new_privs() -> Result<(), SandboxError> {
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(SandboxError::Sys {
            call: "prctl(PR_SET_NO_NEW_PRIVS)",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Switches the whole process (glibc applies set*id to every thread) to `run_as`.
fn drop_user(run_as: RunAs) -> Result<(), SandboxError> {
    let RunAs { uid, gid } = run_as;
    let check = |call, rc: libc::c_int| {
        if rc == 0 {
            Ok(())
        } else {
            Err(SandboxError::Sys {
                call,
                source: std::io::Error::last_os_error(),
            })
        }
    };
    // SAFETY: geteuid takes no arguments and cannot fail.
    let current = unsafe { libc::geteuid() };
    if current != 0 {
        // SAFETY: getegid takes no arguments and cannot fail.
        if current == uid && unsafe { libc::getegid() } == gid {
            return Ok(());
        }
        return Err(SandboxError::NotRoot { uid, gid, current });
    }
    // SAFETY: an empty list: the pointer is not read.
    check("setgroups", unsafe { libc::setgroups(0, std::ptr::null()) })?;
    // SAFETY: integer arguments only.
    check("setresgid", unsafe { libc::setresgid(gid, gid, gid) })?;
    // SAFETY: integer arguments only.
    check("setresuid", unsafe { libc::setresuid(uid, uid, uid) })?;
    // SAFETY: integer arguments only; both must fail now.
    let regained = unsafe { libc::setuid(0) == 0 || libc::setgid(0) == 0 };
    // SAFETY: a null list with size 0 only counts the supplementary groups.
    let groups = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    if regained || groups != 0 {
        return Err(SandboxError::RegainedRoot { uid, gid });
    }
    Ok(())
}

/// `ioctl` requests: FIONBIO and FIOCLEX (the standard library's `set_nonblocking` and
/// close-on-exec on Linux) and TCGETS (terminal probing of stderr by loggers).
const IOCTLS: &[u64] = &[libc::FIONBIO, libc::FIOCLEX, libc::TCGETS];

/// `prctl` options: thread names (llvmpipe names its threads, created after the filter) and
/// setting no_new_privs again (seccompiler does before each filter it installs; it can only
/// be set, never cleared).
const PRCTLS: &[u64] = &[libc::PR_SET_NAME as u64, libc::PR_SET_NO_NEW_PRIVS as u64];

/// The syscalls allowed without argument checks, by group, as measured after the filter's
/// place in start-up with `strace -f` (docs/SECURITY.md has the list and the method). The
/// last group holds the few that the tests did not reach but that ordinary code paths of
/// the process make (each with its reason).
pub const ALLOWED: &[(&str, &[libc::c_long])] = &[
    (
        // Guest memory (DMA_MAP of QEMU's memfd), heaps, and llvmpipe's JIT, which maps its
        // code PROT_EXEC: mmap/mprotect cannot be narrowed without breaking Mesa. The PTX
        // compiler's code memory (cranelift-jit) needs nothing more: anonymous read-write
        // mappings (mmap), made read-execute or read-only (mprotect), unmapped (munmap).
        "memory",
        &[
            libc::SYS_mmap,
            libc::SYS_munmap,
            libc::SYS_mprotect,
            libc::SYS_madvise,
            libc::SYS_brk,
        ],
    ),
    (
        // Threads: llvmpipe's rasteriser threads are created at the first GL context, after
        // the filter (clone3; plain clone is checked for CLONE_THREAD below), futexes, and
        // their exit.
        "threads",
        &[
            libc::SYS_clone3,
            libc::SYS_futex,
            libc::SYS_set_robust_list,
            libc::SYS_rseq,
            libc::SYS_sigaltstack,
            libc::SYS_rt_sigprocmask,
            libc::SYS_sched_getaffinity,
            libc::SYS_gettid,
            libc::SYS_getpid,
            libc::SYS_exit,
            libc::SYS_exit_group,
        ],
    ),
    (
        // Sockets and events: vfio-user messages with SCM_RIGHTS (recvmsg, sendto, writev;
        // sendmsg where the relay passes QEMU's descriptors on to the message loop), a later
        // QEMU's connection (accept4), the scheduler daemon's SOCK_SEQPACKET
        // (connect, getsockname/getsockopt for SO_PEERCRED, sendmsg for the Hello that carries
        // QEMU's connection as proof of its pid), eventfd kicks and interrupts,
        // timerfds (load engine, dump and reconnect timers), the worker's epoll.
        "io",
        &[
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_writev,
            libc::SYS_recvmsg,
            libc::SYS_sendmsg,
            libc::SYS_recvfrom,
            libc::SYS_sendto,
            libc::SYS_accept4,
            libc::SYS_connect,
            libc::SYS_getsockname,
            libc::SYS_getsockopt,
            libc::SYS_close,
            libc::SYS_fcntl,
            libc::SYS_eventfd2,
            libc::SYS_timerfd_create,
            libc::SYS_timerfd_settime,
            libc::SYS_timerfd_gettime,
            libc::SYS_epoll_create1,
            libc::SYS_epoll_ctl,
        ],
    ),
    (
        // Files: /proc/self/fd to find QEMU's connection, Mesa's driver configuration and
        // shader cache at a new GL context (new cache entries make their directories: mkdir
        // below), libraries libepoxy loads at the first GL context, the PNG dumps (relative to
        // a directory descriptor: unlink a stale temporary, create, sync, rename), the socket
        // file removed at exit, fstat and seals of DMA files, /proc/self/fd links of
        // interrupt descriptors (readlink).
        "files",
        &[
            libc::SYS_openat,
            libc::SYS_unlinkat,
            libc::SYS_renameat,
            libc::SYS_newfstatat,
            libc::SYS_statx,
            libc::SYS_getdents64,
            libc::SYS_lseek,
            libc::SYS_fdatasync,
            libc::SYS_flock,
        ],
    ),
    (
        // Identity, randomness and memory size queries (Mesa's cache paths, hash seeds,
        // and its total-memory query at a new GL context).
        "queries",
        &[
            libc::SYS_sysinfo,
            libc::SYS_getuid,
            libc::SYS_geteuid,
            libc::SYS_getgid,
            libc::SYS_getegid,
            libc::SYS_getrandom,
        ],
    ),
    #[cfg(target_arch = "x86_64")]
    (
        // The same on x86_64's older entry points, which glibc and Mesa use there (poll: the
        // relay waiting on QEMU and the message loop; fstat: Debian trixie's glibc, which the
        // server runs on with the QEMU prefix's stack, where bookworm's calls newfstatat).
        "x86_64 forms",
        &[
            libc::SYS_poll,
            libc::SYS_epoll_wait,
            libc::SYS_fstat,
            libc::SYS_readlink,
            libc::SYS_rename,
            libc::SYS_unlink,
            libc::SYS_mkdir,
        ],
    ),
    #[cfg(not(target_arch = "x86_64"))]
    (
        // Their generic forms elsewhere.
        "generic forms",
        &[
            libc::SYS_ppoll,
            libc::SYS_epoll_pwait,
            libc::SYS_readlinkat,
            libc::SYS_mkdirat,
        ],
    ),
    (
        // Signal handlers installed at run time: Mesa 26's libgallium imports sigaction (and
        // glibc installs its cancellation handler at a first pthread_cancel); under piglit's
        // GL tests the prefix stack's device process was killed for it mid-run. A process's
        // own handlers grant it nothing (crosvm's GPU device policy allows the call too).
        "signal handlers",
        &[libc::SYS_rt_sigaction],
    ),
    (
        // Not seen under strace, made by ordinary paths: malloc resizing a large block
        // (mremap), signal delivery for SIGUSR1 dump requests (rt_sigreturn,
        // restart_syscall; tests/sandbox.rs sends some), Mesa's spin waits (sched_yield),
        // sleeps, clock reads that miss the vDSO, and Mesa's shader cache growing its files
        // (ftruncate, pwrite64).
        "unmeasured",
        &[
            libc::SYS_mremap,
            libc::SYS_rt_sigreturn,
            libc::SYS_restart_syscall,
            libc::SYS_sched_yield,
            libc::SYS_clock_nanosleep,
            libc::SYS_clock_gettime,
            libc::SYS_ftruncate,
            libc::SYS_pwrite64,
        ],
    ),
];

/// A rule matching when argument `arg` (of `len`) equals one of `values`.
fn arg_in(
    arg: u8,
    len: SeccompCmpArgLen,
    values: &[u64],
) -> Result<Vec<SeccompRule>, SandboxError> {
    values
        .iter()
        .map(|&v| {
            let cond = SeccompCondition::new(arg, len.clone(), SeccompCmpOp::Eq, v)?;
            Ok(SeccompRule::new(vec![cond])?)
        })
        .collect()
}

/// `membarrier` commands (its first argument, an int) that cranelift-jit issues on aarch64
/// once it made new code executable, so that no core runs stale instructions
/// (wasmtime-jit-icache-coherence's `pipeline_flush_mt`): registering for, then issuing, the
/// process's core-serialising barrier (MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_SYNC_CORE,
/// MEMBARRIER_CMD_PRIVATE_EXPEDITED_SYNC_CORE), and the global barrier kernels before 4.16
/// answer instead (MEMBARRIER_CMD_GLOBAL). x86-64 keeps instruction fetch coherent and makes
/// no such call.
#[cfg(target_arch = "aarch64")]
const MEMBARRIERS: &[u64] = &[64, 32, 1];

/// Syscalls answered EPERM instead of run or fatal: Mesa lowers its threads' priority and
/// pins them to CPUs by thread id, which cannot be told apart from another process's id, and
/// it carries on when refused. Allowed, they would let the device renice or pin other
/// processes of its user.
const REFUSED: &[libc::c_long] = &[
    libc::SYS_setpriority,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_setaffinity,
];

/// The process's filters: [`ALLOWED`] plus argument-checked `ioctl`, `prctl`, `socket` (Unix
/// only), `clone` (threads only) and `tgkill` (own process only), anything else killing it;
/// and one that refuses [`REFUSED`] with EPERM.
fn filters() -> Result<[BpfProgram; 2], SandboxError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = ALLOWED
        .iter()
        .flat_map(|(_, calls)| calls.iter().map(|&nr| (nr, Vec::new())))
        .collect();
    rules.insert(libc::SYS_ioctl, arg_in(1, SeccompCmpArgLen::Qword, IOCTLS)?);
    rules.insert(libc::SYS_prctl, arg_in(0, SeccompCmpArgLen::Qword, PRCTLS)?);
    #[cfg(target_arch = "aarch64")]
    rules.insert(
        libc::SYS_membarrier,
        arg_in(0, SeccompCmpArgLen::Dword, MEMBARRIERS)?,
    );
    // Only Unix sockets: the scheduler daemon's; the family is the low 32 bits.
    rules.insert(
        libc::SYS_socket,
        vec![SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            libc::AF_UNIX as u64,
        )?])?],
    );
    // Threads, never processes: CLONE_THREAD must be set.
    let thread = libc::CLONE_THREAD as u64;
    rules.insert(
        libc::SYS_clone,
        vec![SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(thread),
            thread,
        )?])?],
    );
    // Signals to its own threads only (abort, Mesa's thread wake-ups).
    rules.insert(
        libc::SYS_tgkill,
        vec![SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            u64::from(std::process::id()),
        )?])?],
    );
    for &nr in REFUSED {
        rules.insert(nr, Vec::new());
    }
    let arch = TargetArch::try_from(std::env::consts::ARCH)?;
    let allow = SeccompFilter::new(
        rules,
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        arch,
    )?;
    // A second filter answers EPERM to REFUSED; where both match, the kernel takes the
    // stricter action, so everything else is still decided by the first.
    let refuse = SeccompFilter::new(
        REFUSED.iter().map(|&nr| (nr, Vec::new())).collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )?;
    // The refusing one first: once the killing one is in, seccomp(2) itself is fatal.
    Ok([refuse.try_into()?, allow.try_into()?])
}

/// Logs the sandbox's state once it is entered (one line at info).
pub fn log_state(state: SandboxState, fds_closed: usize) {
    info!(
        "sandbox: seccomp filter {}, no_new_privs, uid {} gid {}, {} inherited fds closed",
        if state.filter { "installed" } else { "off" },
        state.uid,
        state.gid,
        fds_closed
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_as_parses_and_refuses_root_and_junk() {
        assert_eq!(
            "1000:100".parse::<RunAs>().unwrap(),
            RunAs {
                uid: 1000,
                gid: 100
            }
        );
        for bad in ["", "1000", "a:b", "1000:", ":100", "-1:5", "1:2:3"] {
            assert!(
                matches!(bad.parse::<RunAs>(), Err(SandboxError::RunAsSyntax(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            "0:100".parse::<RunAs>(),
            Err(SandboxError::RunAsRoot)
        ));
        assert!(matches!(
            "100:0".parse::<RunAs>(),
            Err(SandboxError::RunAsRoot)
        ));
    }

    /// Set in the child process of [`renderer_paths_survive_the_filter`].
    const CHILD_ENV: &str = "VGPU_SANDBOX_TEST_CHILD";

    /// What renderer libraries do at run time, after the filter: install a signal handler
    /// (Mesa 26's libgallium; glibc at a first pthread_cancel). Run in a child process (this
    /// test binary again, this test only), which the filter would kill.
    #[test]
    fn renderer_paths_survive_the_filter() {
        if std::env::var_os(CHILD_ENV).is_some() {
            enter(SandboxConfig {
                filter: true,
                run_as: None,
            })
            .expect("the sandbox");
            let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            signal_hook::flag::register(libc::SIGUSR2, flag).expect("sigaction");
            std::process::exit(0);
        }
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "sandbox::tests::renderer_paths_survive_the_filter",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .output()
            .expect("the child");
        assert!(
            out.status.success(),
            "the filtered child ended {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn the_filters_compile_for_this_architecture() {
        for program in filters().expect("filters build") {
            assert!(!program.is_empty());
        }
    }
}
