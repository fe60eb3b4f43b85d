//! Unique temporary directories, removed on drop.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Makes directory names unique within this process; the pid makes them unique across processes.
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh directory under [`std::env::temp_dir`], deleted with its contents on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `<tmp>/<prefix>-<pid>-<n>` for the first `n` whose directory does not exist yet.
    pub fn new(prefix: &str) -> io::Result<Self> {
        let pid = std::process::id();
        loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("{prefix}-{pid}-{n}"));
            match std::fs::create_dir(&path) {
                Ok(()) => return Ok(Self { path }),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Creates (or truncates) the read-write file `name` of `size` bytes in the directory, e.g.
    /// a stand-in for guest RAM to DMA-map.
    pub fn file(&self, name: &str, size: u64) -> io::Result<std::fs::File> {
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(self.path.join(name))?;
        file.set_len(size)?;
        Ok(file)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            log::warn!("cannot remove {}: {e}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_and_removed() {
        let a = TempDir::new("vgpu-tempdir-test").unwrap();
        let b = TempDir::new("vgpu-tempdir-test").unwrap();
        assert_ne!(a.path(), b.path());
        std::fs::write(a.path().join("f"), b"x").unwrap();
        let path = a.path().to_owned();
        drop(a);
        assert!(!path.exists());
        assert!(b.path().is_dir());
    }
}
