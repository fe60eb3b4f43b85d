//! What the device checks about file descriptors it is handed or makes: QEMU's interrupt
//! eventfds and DMA files are untrusted (a pipe instead of an eventfd would block a write under
//! the device lock; a file that shrinks under a mapping raises SIGBUS), and the worker's own
//! timers must never block it.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};

use rustix::fs::{OFlags, SealFlags};

/// Puts `fd`'s open file description into non-blocking mode (O_NONBLOCK). For a descriptor
/// QEMU handed over this changes QEMU's side too; QEMU's own event loop already reads its
/// eventfds without blocking.
pub fn set_nonblocking(fd: impl AsFd) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(&fd)?;
    rustix::fs::fcntl_setfl(&fd, flags | OFlags::NONBLOCK)?;
    Ok(())
}

/// Whether `file` is an eventfd. The kernel names anonymous inodes by their kind in the
/// descriptor's `/proc/self/fd` link, the one check that tells an eventfd from a pipe, a
/// socket or another anonymous inode (their `fstat` looks alike).
pub fn is_eventfd(file: &File) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .is_ok_and(|target| target.as_os_str() == "anon_inode:[eventfd]")
}

/// Whether `file` is a regular file (QEMU's memfd, shared-memory and file-backed RAM all are;
/// a device node or a socket is not memory the device may map).
pub fn is_regular_file(file: &File) -> io::Result<bool> {
    Ok(file.metadata()?.file_type().is_file())
}

/// Whether `file` can never shrink: a memfd with `F_SEAL_SHRINK` (QEMU's
/// `memory-backend-memfd` seals its files by default). Files that cannot carry seals are not.
pub fn cannot_shrink(file: &File) -> bool {
    rustix::fs::fcntl_get_seals(file).is_ok_and(|seals| seals.contains(SealFlags::SHRINK))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    fn eventfd() -> File {
        File::from(rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap())
    }

    #[test]
    fn eventfds_are_told_from_other_descriptors() {
        assert!(is_eventfd(&eventfd()));
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(!is_eventfd(&File::from(std::os::fd::OwnedFd::from(a))));
        let (r, _w) = std::io::pipe().unwrap();
        assert!(!is_eventfd(&File::from(std::os::fd::OwnedFd::from(r))));
        let f = vmm_sys_util::tempfile::TempFile::new().unwrap().into_file();
        assert!(!is_eventfd(&f));
        assert!(is_regular_file(&f).unwrap());
        assert!(!is_regular_file(&eventfd()).unwrap());
    }

    #[test]
    fn a_non_blocking_full_eventfd_refuses_instead_of_blocking() {
        let mut e = eventfd();
        set_nonblocking(&e).unwrap();
        // The counter's maximum is 2^64 - 2: one more write would block.
        e.write_all(&(u64::MAX - 1).to_ne_bytes()).unwrap();
        let err = e.write_all(&1u64.to_ne_bytes()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
    }

    #[test]
    fn seals_are_read() {
        let plain = vmm_sys_util::tempfile::TempFile::new().unwrap().into_file();
        assert!(!cannot_shrink(&plain));
        let memfd = rustix::fs::memfd_create(
            "seal-test",
            rustix::fs::MemfdFlags::ALLOW_SEALING | rustix::fs::MemfdFlags::CLOEXEC,
        )
        .unwrap();
        let memfd = File::from(memfd);
        assert!(!cannot_shrink(&memfd));
        rustix::fs::fcntl_add_seals(&memfd, SealFlags::SHRINK).unwrap();
        assert!(cannot_shrink(&memfd));
    }
}
