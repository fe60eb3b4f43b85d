//! Headless scanout: scanout images written as PNG files a user can look at
//! (`vgpu-server --dump-dir DIR` writes `DIR/scanout0.png`).
//!
//! The device model hands out [`Frame`]s (packed RGB copies taken under the device lock);
//! encoding and writing happen here, on the worker thread, never in the vfio-user message loop.
//! A file is written under a temporary name and renamed, so a reader never sees half a PNG.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use log::debug;
use rustix::fs::{AtFlags, CWD, Mode, OFlags, openat, renameat, unlinkat};
use rustix::io::Errno;

use super::protocol::PixelFormat;

/// Shortest time between two dumps triggered by RESOURCE_FLUSH: a guest flushing at 60 Hz
/// costs one PNG encode per second, and the file is at most this stale.
pub const DUMP_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Where and how often scanout images are written.
#[derive(Debug, Clone)]
pub struct DumpConfig {
    /// Directory the PNG files go to (must exist).
    pub dir: PathBuf,
    /// Shortest time between two flush-triggered dumps.
    pub min_interval: Duration,
    /// Read end of a socket: every byte that arrives asks for a dump now (a SIGUSR1 handler
    /// writes them, see [`DumpConfig::with_requests`]).
    pub requests: Option<Arc<UnixStream>>,
}

impl DumpConfig {
    /// Dumps to `dir` at most every [`DUMP_MIN_INTERVAL`], and at disconnect.
    pub fn new(dir: impl Into<PathBuf>) -> DumpConfig {
        DumpConfig {
            dir: dir.into(),
            min_interval: DUMP_MIN_INTERVAL,
            requests: None,
        }
    }

    /// Adds a request channel; returns the end to write to (one byte, one dump). Hand it to
    /// `signal_hook::low_level::pipe::register` to dump on a signal.
    pub fn with_requests(mut self) -> std::io::Result<(DumpConfig, UnixStream)> {
        let (read, write) = UnixStream::pair()?;
        read.set_nonblocking(true)?;
        write.set_nonblocking(true)?;
        self.requests = Some(Arc::new(read));
        Ok((self, write))
    }
}

/// One scanout's image at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Scanout index.
    pub scanout: u32,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Pixel format of `pixels`.
    pub format: PixelFormat,
    /// `width * height` pixels of 4 bytes, row by row (a plain copy, taken under the device
    /// lock; the conversion happens when encoding).
    pub pixels: Vec<u8>,
}

impl Frame {
    /// The pixels as 8-bit red, green, blue (alpha or padding dropped: a scanout is opaque).
    pub fn rgb(&self) -> Vec<u8> {
        let [r, g, b] = self.format.rgb_offsets();
        let bpp = PixelFormat::BYTES_PER_PIXEL as usize;
        let mut out = Vec::with_capacity(self.pixels.len() / bpp * 3);
        for px in self.pixels.chunks_exact(bpp) {
            out.extend_from_slice(&[px[r], px[g], px[b]]);
        }
        out
    }
}

/// Errors writing a scanout image.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// The file could not be created, written or renamed.
    #[error("writing {path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// PNG encoding failed.
    #[error("encoding {path}: {source}")]
    Encode {
        /// File.
        path: PathBuf,
        /// The encoder's error.
        #[source]
        source: png::EncodingError,
    },
}

/// File name of scanout `n`'s image.
pub fn file_name(scanout: u32) -> String {
    format!("scanout{scanout}.png")
}

/// Encodes `frame` as an 8-bit RGB PNG into `out`.
pub fn encode_png<W: Write>(frame: &Frame, out: W) -> Result<(), png::EncodingError> {
    let mut encoder = png::Encoder::new(out, frame.width, frame.height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Fast);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(&frame.rgb())?;
    writer.finish()
}

/// Writes `frame` to `dir/scanoutN.png` (through a temporary file and a rename); returns the
/// path.
///
/// Everything happens relative to one descriptor of `dir`, and no name in it is followed: a
/// stale temporary (or a link planted at its name) is unlinked, the new one is created with
/// `O_CREAT | O_EXCL | O_NOFOLLOW`, and `renameat` replaces whatever sits at the final name
/// without following it. Whoever can write in `dir` cannot redirect the write elsewhere.
pub fn write_frame(dir: &Path, frame: &Frame) -> Result<PathBuf, DumpError> {
    let name = file_name(frame.scanout);
    let path = dir.join(&name);
    let tmp = format!(".{name}.tmp");
    let io = |source: std::io::Error| DumpError::Io {
        path: path.clone(),
        source,
    };
    let dirfd = openat(
        CWD,
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io(e.into()))?;
    match unlinkat(&dirfd, tmp.as_str(), AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => {}
        Err(e) => return Err(io(e.into())),
    }
    let file = openat(
        &dirfd,
        tmp.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::RUSR | Mode::WUSR,
    )
    .map_err(|e| io(e.into()))?;
    let mut out = BufWriter::new(File::from(file));
    encode_png(frame, &mut out).map_err(|source| DumpError::Encode {
        path: path.clone(),
        source,
    })?;
    out.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_data()
        .map_err(io)?;
    renameat(&dirfd, tmp.as_str(), &dirfd, name.as_str()).map_err(|e| io(e.into()))?;
    debug!(
        "scanout {} ({}x{}) written to {}",
        frame.scanout,
        frame.width,
        frame.height,
        path.display()
    );
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_round_trip() {
        let frame = Frame {
            scanout: 0,
            width: 3,
            height: 2,
            format: PixelFormat::B8G8R8X8,
            pixels: vec![
                0, 0, 255, 0, 0, 255, 0, 0, 255, 0, 0, 0, //
                3, 2, 1, 0, 6, 5, 4, 0, 9, 8, 7, 0,
            ],
        };
        let mut bytes = Vec::new();
        encode_png(&frame, &mut bytes).unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (3, 2));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(
            &buf[..info.buffer_size()],
            &[255, 0, 0, 0, 255, 0, 0, 0, 255, 1, 2, 3, 4, 5, 6, 7, 8, 9][..]
        );
        assert_eq!(frame.rgb().len(), 18);
    }

    #[test]
    fn write_frame_replaces_the_file() {
        let dir = std::env::temp_dir().join(format!("vgpu-dump-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut frame = Frame {
            scanout: 0,
            width: 1,
            height: 1,
            format: PixelFormat::R8G8B8A8,
            pixels: vec![1, 2, 3, 4],
        };
        let path = write_frame(&dir, &frame).unwrap();
        assert_eq!(path.file_name().unwrap(), "scanout0.png");
        frame.pixels = vec![4, 5, 6, 7];
        write_frame(&dir, &frame).unwrap();
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["scanout0.png"], "no temporary file left");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn write_frame_never_follows_links_in_the_directory() {
        let base = vmm_sys_util::tempdir::TempDir::new_with_prefix(
            std::env::temp_dir().join("vgpu-dump-links"),
        )
        .unwrap();
        let dir = base.as_path().join("dump");
        let outside = base.as_path().join("outside");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&outside, b"precious").unwrap();
        // Links planted at the temporary name and at the final name, both pointing outside.
        std::os::unix::fs::symlink(&outside, dir.join(".scanout0.png.tmp")).unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("scanout0.png")).unwrap();
        let frame = Frame {
            scanout: 0,
            width: 1,
            height: 1,
            format: PixelFormat::B8G8R8X8,
            pixels: vec![1, 2, 3, 0],
        };
        let path = write_frame(&dir, &frame).unwrap();
        assert_eq!(std::fs::read(&outside).unwrap(), b"precious");
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(
            meta.file_type().is_file(),
            "the link was replaced by the image"
        );
        assert!(std::fs::read(&path).unwrap().starts_with(b"\x89PNG"));
        assert!(!dir.join(".scanout0.png.tmp").exists());
    }
}
