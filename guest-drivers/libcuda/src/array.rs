//! CUDA arrays, 2D/3D copies and texture/surface object descriptors: pure logic (the C
//! structures' bytes decoded and checked, layouts, copy plans). An array is device memory of
//! its context laid out privately here (rows of `width × texel` bytes, no padding, slices
//! and layers one after another); a texture or surface object is an
//! [`mdev_backend::compute::ptx::texture::Descriptor`] written into device memory, its
//! handle the descriptor's device address, which the executor reads and validates on every
//! fetch. See `docs/CUDA-GUEST.md`.

use mdev_backend::compute::ptx::texture::{
    AddressMode, Descriptor, FLAG_CUBEMAP, FLAG_LAYERED, FLAG_LINEAR, FLAG_NORMALIZED,
    FLAG_READ_NORMALIZED, FLAG_SRGB, Format, MAX_LEVELS, Mip,
};

use crate::driver::CuResult;
use crate::status::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED};

/// `CUDA_ARRAY3D_LAYERED`.
pub const ARRAY_LAYERED: u32 = 1;
/// `CUDA_ARRAY3D_SURFACE_LDST`.
pub const ARRAY_SURFACE_LDST: u32 = 2;
/// `CUDA_ARRAY3D_CUBEMAP`.
pub const ARRAY_CUBEMAP: u32 = 4;
/// `CUDA_ARRAY3D_TEXTURE_GATHER` (accepted: `tld4` gathers from any array).
pub const ARRAY_TEXTURE_GATHER: u32 = 8;
/// Array flags this library implements.
const ARRAY_FLAGS: u32 = ARRAY_LAYERED | ARRAY_SURFACE_LDST | ARRAY_CUBEMAP | ARRAY_TEXTURE_GATHER;

// Limits of a Turing GPU, the same `attributes.rs` reports (the attribute numbers).
/// Width of a 1D array (21).
pub const MAX_1D: u64 = 131_072;
/// Width and height of a 2D array (22, 23).
pub const MAX_2D: [u64; 2] = [131_072, 65_536];
/// Each extent of a 3D array (24 to 26).
pub const MAX_3D: u64 = 16_384;
/// Width (and height) of a layered 1D or 2D array (42; 27, 28).
pub const MAX_LAYERED: u64 = 32_768;
/// Layers of a layered array (43, 29).
pub const MAX_LAYERS: u64 = 2_048;
/// Face width of a cubemap (67; 52 layered).
pub const MAX_CUBEMAP: u64 = 32_768;
/// Layers (of 6 faces) of a layered cubemap (68).
pub const MAX_CUBEMAP_LAYERS: u64 = 2_046;
/// Texels of a 1D texture over linear memory (69).
pub const MAX_LINEAR: u64 = 1 << 27;
/// Width, height and pitch in bytes of a 2D texture over pitched memory (70 to 72).
pub const MAX_PITCH2D: [u64; 3] = [131_072, 65_000, 2_097_120];
/// Alignment of a pitched texture's pitch (51), and of `cuMemAllocPitch`'s.
pub const PITCH_ALIGN: u64 = 32;

/// Bytes of `CUDA_ARRAY_DESCRIPTOR`.
pub const ARRAY_DESCRIPTOR_BYTES: usize = 24;
/// Bytes of `CUDA_ARRAY3D_DESCRIPTOR`.
pub const ARRAY3D_DESCRIPTOR_BYTES: usize = 40;
/// Bytes of `CUDA_MEMCPY2D`.
pub const MEMCPY2D_BYTES: usize = 128;
/// Bytes of `CUDA_MEMCPY3D`.
pub const MEMCPY3D_BYTES: usize = 200;
/// Bytes of `CUDA_RESOURCE_DESC`.
pub const RESOURCE_DESC_BYTES: usize = 144;
/// Bytes of `CUDA_TEXTURE_DESC`.
pub const TEXTURE_DESC_BYTES: usize = 104;

/// `CU_TRSF_READ_AS_INTEGER`.
const TRSF_READ_AS_INTEGER: u32 = 1;
/// `CU_TRSF_NORMALIZED_COORDINATES`.
const TRSF_NORMALIZED_COORDINATES: u32 = 2;
/// `CU_TRSF_SRGB`.
const TRSF_SRGB: u32 = 0x10;
/// `CU_TRSF_DISABLE_TRILINEAR_OPTIMIZATION` and `CU_TRSF_SEAMLESS_CUBEMAP`: accepted (no
/// mipmaps to optimise; cubemap faces are sampled clamped at their edges).
const TRSF_IGNORED: u32 = 0x20 | 0x40;

fn word(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn long(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// An array's shape as created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayDesc {
    pub width: u64,
    /// 0 for a 1D array.
    pub height: u64,
    /// 0 for a 1D or 2D array; layers of a layered one, faces of a cubemap.
    pub depth: u64,
    pub format: Format,
    pub channels: u32,
    pub flags: u32,
}

/// `CUDA_ARRAY_DESCRIPTOR`'s channel format and count, checked.
fn format_of(format: u32, channels: u32) -> CuResult<Format> {
    let f = Format::from_cuda(format).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if !matches!(channels, 1 | 2 | 4) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(f)
}

impl ArrayDesc {
    /// A `CUDA_ARRAY_DESCRIPTOR` (2D or 1D).
    pub fn from_2d(b: &[u8]) -> CuResult<ArrayDesc> {
        let (format, channels) = (word(b, 16), word(b, 20));
        ArrayDesc {
            width: long(b, 0),
            height: long(b, 8),
            depth: 0,
            format: format_of(format, channels)?,
            channels,
            flags: 0,
        }
        .checked()
    }

    /// A `CUDA_ARRAY3D_DESCRIPTOR`.
    pub fn from_3d(b: &[u8]) -> CuResult<ArrayDesc> {
        let (format, channels) = (word(b, 24), word(b, 28));
        ArrayDesc {
            width: long(b, 0),
            height: long(b, 8),
            depth: long(b, 16),
            format: format_of(format, channels)?,
            channels,
            flags: word(b, 32),
        }
        .checked()
    }

    /// `CUDA_ARRAY_DESCRIPTOR`'s bytes.
    pub fn to_2d(&self) -> [u8; ARRAY_DESCRIPTOR_BYTES] {
        let mut b = [0u8; ARRAY_DESCRIPTOR_BYTES];
        b[0..8].copy_from_slice(&self.width.to_le_bytes());
        b[8..16].copy_from_slice(&self.height.to_le_bytes());
        b[16..20].copy_from_slice(&(self.format as u32).to_le_bytes());
        b[20..24].copy_from_slice(&self.channels.to_le_bytes());
        b
    }

    /// `CUDA_ARRAY3D_DESCRIPTOR`'s bytes.
    pub fn to_3d(&self) -> [u8; ARRAY3D_DESCRIPTOR_BYTES] {
        let mut b = [0u8; ARRAY3D_DESCRIPTOR_BYTES];
        b[0..8].copy_from_slice(&self.width.to_le_bytes());
        b[8..16].copy_from_slice(&self.height.to_le_bytes());
        b[16..24].copy_from_slice(&self.depth.to_le_bytes());
        b[24..28].copy_from_slice(&(self.format as u32).to_le_bytes());
        b[28..32].copy_from_slice(&self.channels.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b
    }

    /// What the driver checks at creation: known flags, extents within the limits of their
    /// kind (see [`MAX_1D`] and the others), a cubemap's square faces, 6 per layer.
    fn checked(self) -> CuResult<ArrayDesc> {
        if self.flags & !ARRAY_FLAGS != 0 {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let layered = self.flags & ARRAY_LAYERED != 0;
        let cube = self.flags & ARRAY_CUBEMAP != 0;
        let (w, h, d) = (self.width, self.height, self.depth);
        // (width, height, depth) limits of the kind; 0 where the extent must be 0.
        let max = match (layered, cube, h, d) {
            (false, false, 0, 0) => [MAX_1D, 0, 0],
            (false, false, _, 0) => [MAX_2D[0], MAX_2D[1], 0],
            (false, false, _, _) => [MAX_3D; 3],
            (true, false, 0, _) => [MAX_LAYERED, 0, MAX_LAYERS],
            (true, false, _, _) => [MAX_LAYERED, MAX_LAYERED, MAX_LAYERS],
            (false, true, _, _) => [MAX_CUBEMAP, MAX_CUBEMAP, 6],
            (true, true, _, _) => [MAX_CUBEMAP, MAX_CUBEMAP, MAX_CUBEMAP_LAYERS * 6],
        };
        let ok = (1..=max[0]).contains(&w)
            && h <= max[1]
            && d <= max[2]
            && (!layered || d > 0)
            && (layered || d == 0 || h > 0)
            && (!cube || (w == h && d > 0 && d % 6 == 0));
        if !ok {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(self)
    }

    /// Mipmap levels an array of this shape may have: down to one texel along its largest
    /// dimension (layers and faces are not halved), at most [`MAX_LEVELS`].
    pub fn max_levels(&self) -> u32 {
        let layered = self.flags & (ARRAY_LAYERED | ARRAY_CUBEMAP) != 0;
        let largest = self
            .width
            .max(self.height)
            .max(if layered { 0 } else { self.depth });
        (largest.ilog2() + 1).min(MAX_LEVELS as u32)
    }

    /// The shape of mipmap level `l`: each extent halved `l` times (at least 1; absent ones
    /// stay 0; layers and faces kept).
    pub fn level(&self, l: u32) -> ArrayDesc {
        let half = |e: u64| if e == 0 { 0 } else { (e >> l).max(1) };
        let layered = self.flags & (ARRAY_LAYERED | ARRAY_CUBEMAP) != 0;
        ArrayDesc {
            width: half(self.width),
            height: half(self.height),
            depth: if layered {
                self.depth
            } else {
                half(self.depth)
            },
            ..*self
        }
    }

    /// Bytes of one element.
    pub fn texel_bytes(&self) -> u64 {
        u64::from(self.format.bytes() * self.channels)
    }

    /// Bytes of one row.
    pub fn pitch(&self) -> u64 {
        self.width * self.texel_bytes()
    }

    /// Rows (1 for a 1D array).
    pub fn rows(&self) -> u64 {
        self.height.max(1)
    }

    /// Slices, layers or faces (1 for a 1D or 2D array).
    pub fn slices(&self) -> u64 {
        self.depth.max(1)
    }

    /// Bytes of one slice.
    pub fn slice(&self) -> u64 {
        self.pitch() * self.rows()
    }

    /// Bytes of the whole array (no overflow: the extents are bounded).
    pub fn bytes(&self) -> u64 {
        self.slice() * self.slices()
    }

    /// The executor's descriptor of this array at `base`, sampled as `sampling` says.
    pub fn resource(&self, base: u64) -> Descriptor {
        let mut flags = 0;
        if self.flags & ARRAY_LAYERED != 0 {
            flags |= FLAG_LAYERED;
        }
        if self.flags & ARRAY_CUBEMAP != 0 {
            flags |= FLAG_CUBEMAP;
        }
        Descriptor {
            surface: false,
            format: self.format,
            channels: self.channels,
            flags,
            address: [AddressMode::Clamp; 3],
            extent: [self.width as u32, self.rows() as u32, self.slices() as u32],
            base,
            pitch: self.pitch(),
            slice: self.slice(),
            border: [0.0; 4],
            mip: Mip::NONE,
        }
    }
}

/// `CUmemorytype` of a copy's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// A host address.
    Host(u64),
    /// A device address.
    Device(u64),
    /// An array handle.
    Array(u64),
    /// An address either side may hold (`CU_MEMORYTYPE_UNIFIED`).
    Unified(u64),
}

/// One side of a 2D/3D copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Side {
    pub memory: Memory,
    pub x: u64,
    pub y: u64,
    pub z: u64,
    /// Bytes per row (linear memory; an array's own for arrays).
    pub pitch: u64,
    /// Rows per slice (linear memory).
    pub height: u64,
}

/// A `CUDA_MEMCPY2D` or `CUDA_MEMCPY3D`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy3D {
    pub src: Side,
    pub dst: Side,
    pub width: u64,
    pub height: u64,
    pub depth: u64,
}

fn memory(kind: u32, host: u64, device: u64, array: u64) -> CuResult<Memory> {
    Ok(match kind {
        1 => Memory::Host(host),
        2 => Memory::Device(device),
        3 => Memory::Array(array),
        4 => Memory::Unified(device),
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

impl Copy3D {
    /// A `CUDA_MEMCPY2D`'s bytes.
    pub fn from_2d(b: &[u8]) -> CuResult<Copy3D> {
        let side = |o: usize| -> CuResult<Side> {
            Ok(Side {
                memory: memory(
                    word(b, o + 16),
                    long(b, o + 24),
                    long(b, o + 32),
                    long(b, o + 40),
                )?,
                x: long(b, o),
                y: long(b, o + 8),
                z: 0,
                pitch: long(b, o + 48),
                height: 0,
            })
        };
        Ok(Copy3D {
            src: side(0)?,
            dst: side(56)?,
            width: long(b, 112),
            height: long(b, 120),
            depth: 1,
        })
    }

    /// A `CUDA_MEMCPY3D`'s bytes: levels of detail other than 0 are refused (no mipmapped
    /// arrays).
    pub fn from_3d(b: &[u8]) -> CuResult<Copy3D> {
        let side = |o: usize| -> CuResult<Side> {
            if long(b, o + 24) != 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            Ok(Side {
                memory: memory(
                    word(b, o + 32),
                    long(b, o + 40),
                    long(b, o + 48),
                    long(b, o + 56),
                )?,
                x: long(b, o),
                y: long(b, o + 8),
                z: long(b, o + 16),
                pitch: long(b, o + 72),
                height: long(b, o + 80),
            })
        };
        Ok(Copy3D {
            src: side(0)?,
            dst: side(88)?,
            width: long(b, 176),
            height: long(b, 184),
            depth: long(b, 192),
        })
    }
}

/// Linear memory a side of a copy reaches: `start` of its first row, and from there row `r`
/// of slice `s` at `s * slice + r * pitch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Linear {
    pub start: u64,
    pub pitch: u64,
    pub slice: u64,
}

impl Linear {
    /// Where a side's rows are: its linear memory's layout (`pitch` and rows per slice given
    /// for arrays by their layout) from `base`, checked for `width × height × depth` bytes:
    /// the offset of the last byte must not overflow, and a pitch must hold a row. Returns the
    /// layout and the span from the first row's start to the last row's end.
    pub fn of(
        base: u64,
        side: &Side,
        pitch: u64,
        rows: u64,
        width: u64,
        height: u64,
        depth: u64,
    ) -> CuResult<(Linear, u64)> {
        let bad = CUDA_ERROR_INVALID_VALUE;
        if width == 0 || height == 0 || depth == 0 {
            return Err(bad);
        }
        if (height > 1 || depth > 1) && pitch < side.x.checked_add(width).ok_or(bad)? {
            return Err(bad);
        }
        if depth > 1 && rows < side.y.checked_add(height).ok_or(bad)? {
            return Err(bad);
        }
        let slice = pitch.checked_mul(rows).ok_or(bad)?;
        let first = side
            .z
            .checked_mul(slice)
            .and_then(|o| o.checked_add(side.y.checked_mul(pitch)?))
            .and_then(|o| o.checked_add(side.x))
            .ok_or(bad)?;
        let span = (depth - 1)
            .checked_mul(slice)
            .and_then(|o| o.checked_add((height - 1).checked_mul(pitch)?))
            .and_then(|o| o.checked_add(width))
            .ok_or(bad)?;
        let start = base.checked_add(first).ok_or(bad)?;
        start.checked_add(span).ok_or(bad)?;
        Ok((
            Linear {
                start,
                pitch,
                slice,
            },
            span,
        ))
    }

    /// The address of row `r` of slice `s` (within the checked span: no overflow).
    pub fn row(&self, s: u64, r: u64) -> u64 {
        self.start + s * self.slice + r * self.pitch
    }
}

/// Checks an array side's window against the array: `x + width` bytes within a row, rows and
/// slices within the array's.
pub fn check_in_array(
    a: &ArrayDesc,
    side: &Side,
    width: u64,
    height: u64,
    depth: u64,
) -> CuResult<()> {
    let bad = CUDA_ERROR_INVALID_VALUE;
    let fits = |at: u64, n: u64, limit: u64| at.checked_add(n).is_some_and(|e| e <= limit);
    if side.x % a.texel_bytes() != 0
        || !fits(side.x, width, a.pitch())
        || !fits(side.y, height, a.rows())
        || !fits(side.z, depth, a.slices())
    {
        return Err(bad);
    }
    Ok(())
}

/// Rows of a copy merged where both sides are contiguous: (source offset, destination
/// offset, bytes) relative to each side's start, in order.
pub fn runs(
    src: &Linear,
    dst: &Linear,
    width: u64,
    height: u64,
    depth: u64,
) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for s in 0..depth {
        for r in 0..height {
            let (so, d) = (src.row(s, r) - src.start, dst.row(s, r) - dst.start);
            match out.last_mut() {
                Some((ps, pd, n)) if *ps + *n == so && *pd + *n == d => *n += width,
                _ => out.push((so, d, width)),
            }
        }
    }
    out
}

/// What a texture object's resource is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    Array(u64),
    Mipmapped(u64),
    Linear {
        addr: u64,
        format: Format,
        channels: u32,
        bytes: u64,
    },
    Pitch2D {
        addr: u64,
        format: Format,
        channels: u32,
        width: u64,
        height: u64,
        pitch: u64,
    },
}

impl Resource {
    /// A `CUDA_RESOURCE_DESC`'s bytes (its flags must be 0).
    pub fn decode(b: &[u8]) -> CuResult<Resource> {
        if word(b, 136) != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(match word(b, 0) {
            0 => Resource::Array(long(b, 8)),
            1 => Resource::Mipmapped(long(b, 8)),
            2 => Resource::Linear {
                addr: long(b, 8),
                format: format_of(word(b, 16), word(b, 20))?,
                channels: word(b, 20),
                bytes: long(b, 24),
            },
            3 => Resource::Pitch2D {
                addr: long(b, 8),
                format: format_of(word(b, 16), word(b, 20))?,
                channels: word(b, 20),
                width: long(b, 24),
                height: long(b, 32),
                pitch: long(b, 40),
            },
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        })
    }

    /// Its `CUDA_RESOURCE_DESC` bytes.
    pub fn encode(&self) -> [u8; RESOURCE_DESC_BYTES] {
        let mut b = [0u8; RESOURCE_DESC_BYTES];
        let mut put = |at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        match *self {
            Resource::Array(h) => {
                put(0, &0u32.to_le_bytes());
                put(8, &h.to_le_bytes());
            }
            Resource::Mipmapped(h) => {
                put(0, &1u32.to_le_bytes());
                put(8, &h.to_le_bytes());
            }
            Resource::Linear {
                addr,
                format,
                channels,
                bytes,
            } => {
                put(0, &2u32.to_le_bytes());
                put(8, &addr.to_le_bytes());
                put(16, &(format as u32).to_le_bytes());
                put(20, &channels.to_le_bytes());
                put(24, &bytes.to_le_bytes());
            }
            Resource::Pitch2D {
                addr,
                format,
                channels,
                width,
                height,
                pitch,
            } => {
                put(0, &3u32.to_le_bytes());
                put(8, &addr.to_le_bytes());
                put(16, &(format as u32).to_le_bytes());
                put(20, &channels.to_le_bytes());
                put(24, &width.to_le_bytes());
                put(32, &height.to_le_bytes());
                put(40, &pitch.to_le_bytes());
            }
        }
        b
    }

    /// The executor's descriptor of a linear or pitched resource (an array's comes from its
    /// [`ArrayDesc::resource`]); `None` for arrays.
    pub fn linear(&self) -> CuResult<Option<Descriptor>> {
        let bad = CUDA_ERROR_INVALID_VALUE;
        let (addr, format, channels, w, h, pitch) = match *self {
            Resource::Array(_) | Resource::Mipmapped(_) => return Ok(None),
            Resource::Linear {
                addr,
                format,
                channels,
                bytes,
            } => {
                let texel = u64::from(format.bytes() * channels);
                let w = bytes / texel;
                (addr, format, channels, w, 1, w * texel)
            }
            Resource::Pitch2D {
                addr,
                format,
                channels,
                width,
                height,
                pitch,
            } => (addr, format, channels, width, height, pitch),
        };
        let linear = matches!(self, Resource::Linear { .. });
        let [mw, mh, mp] = if linear {
            [MAX_LINEAR, 1, u64::MAX]
        } else {
            MAX_PITCH2D
        };
        let aligned = linear || pitch % PITCH_ALIGN == 0;
        if !(1..=mw).contains(&w) || !(1..=mh).contains(&h) || pitch > mp || !aligned {
            return Err(bad);
        }
        let rows = pitch.checked_mul(h).ok_or(bad)?;
        Ok(Some(Descriptor {
            surface: false,
            format,
            channels,
            flags: 0,
            address: [AddressMode::Clamp; 3],
            extent: [w as u32, h as u32, 1],
            base: addr,
            pitch,
            slice: rows,
            border: [0.0; 4],
            mip: Mip::NONE,
        }))
    }
}

/// A `CUDA_TEXTURE_DESC` applied to a resource's descriptor: address modes, filter, read
/// mode, coordinates, sRGB, border colour, mipmap filter, level bias and clamp (which do
/// nothing without mipmap levels). Anisotropy is accepted and does nothing: the executor
/// has no derivatives to be anisotropic along.
pub fn apply_texture_desc(b: &[u8], d: &mut Descriptor) -> CuResult<()> {
    let bad = CUDA_ERROR_INVALID_VALUE;
    for i in 0..3 {
        d.address[i] = AddressMode::from_cuda(word(b, 4 * i)).ok_or(bad)?;
    }
    match word(b, 12) {
        0 => {}
        1 => d.flags |= FLAG_LINEAR,
        _ => return Err(bad),
    }
    let flags = word(b, 16);
    if flags & !(TRSF_READ_AS_INTEGER | TRSF_NORMALIZED_COORDINATES | TRSF_SRGB | TRSF_IGNORED) != 0
    {
        return Err(bad);
    }
    if flags & TRSF_NORMALIZED_COORDINATES != 0 {
        d.flags |= FLAG_NORMALIZED;
    }
    // Without READ_AS_INTEGER, 8- and 16-bit integer texels read as normalised floats.
    if flags & TRSF_READ_AS_INTEGER == 0
        && matches!(
            d.format,
            Format::U8 | Format::U16 | Format::S8 | Format::S16
        )
    {
        d.flags |= FLAG_READ_NORMALIZED;
    }
    if flags & TRSF_SRGB != 0 {
        d.flags |= FLAG_SRGB;
    }
    for i in 0..4 {
        d.border[i] = f32::from_bits(word(b, 40 + 4 * i));
    }
    d.mip.linear = match word(b, 24) {
        0 => false,
        1 => true,
        _ => return Err(bad),
    };
    d.mip.bias = f32::from_bits(word(b, 28));
    d.mip.min = f32::from_bits(word(b, 32));
    d.mip.max = f32::from_bits(word(b, 36));
    d.validate().map_err(|_| bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc3d(
        w: u64,
        h: u64,
        d: u64,
        format: u32,
        ch: u32,
        flags: u32,
    ) -> [u8; ARRAY3D_DESCRIPTOR_BYTES] {
        let a = ArrayDesc {
            width: w,
            height: h,
            depth: d,
            format: Format::F32,
            channels: 1,
            flags,
        };
        let mut b = a.to_3d();
        b[24..28].copy_from_slice(&format.to_le_bytes());
        b[28..32].copy_from_slice(&ch.to_le_bytes());
        b
    }

    #[test]
    fn array_descriptors_round_trip_and_bad_ones_are_refused() {
        let a = ArrayDesc::from_3d(&desc3d(64, 32, 4, 0x01, 4, ARRAY_SURFACE_LDST)).unwrap();
        assert_eq!(
            (a.pitch(), a.slice(), a.bytes()),
            (256, 256 * 32, 256 * 32 * 4)
        );
        assert_eq!(ArrayDesc::from_3d(&a.to_3d()), Ok(a));
        let two = ArrayDesc::from_2d(&a.to_2d()).unwrap();
        assert_eq!((two.width, two.height, two.depth), (64, 32, 0));
        for (b, why) in [
            (desc3d(0, 1, 0, 0x20, 1, 0), "zero width"),
            (desc3d(1 << 40, 1, 0, 0x20, 1, 0), "width past the limit"),
            (
                desc3d(u64::MAX, u64::MAX, u64::MAX, 0x20, 1, 0),
                "overflowing extents",
            ),
            (desc3d(4, 4, 0, 0x07, 1, 0), "unknown format"),
            (desc3d(4, 4, 0, 0x20, 3, 0), "three channels"),
            (desc3d(4, 0, 4, 0x20, 1, 0), "depth without height"),
            (desc3d(MAX_1D + 1, 0, 0, 0x20, 1, 0), "1D past its limit"),
            (
                desc3d(64, MAX_2D[1] + 1, 0, 0x20, 1, 0),
                "2D past its limit",
            ),
            (desc3d(MAX_3D + 1, 2, 2, 0x20, 1, 0), "3D past its limit"),
            (
                desc3d(4, 4, MAX_LAYERS + 1, 0x20, 1, ARRAY_LAYERED),
                "too many layers",
            ),
            (
                desc3d(4, 8, 6, 0x20, 1, ARRAY_CUBEMAP),
                "non-square cubemap",
            ),
            (
                desc3d(4, 4, 5, 0x20, 1, ARRAY_CUBEMAP),
                "cubemap without 6 faces",
            ),
            (
                desc3d(4, 4, 0, 0x20, 1, ARRAY_LAYERED),
                "layered without layers",
            ),
        ] {
            assert_eq!(
                ArrayDesc::from_3d(&b),
                Err(CUDA_ERROR_INVALID_VALUE),
                "{why}"
            );
        }
        assert_eq!(
            ArrayDesc::from_3d(&desc3d(4, 4, 0, 0x20, 1, 0x100)),
            Err(CUDA_ERROR_NOT_SUPPORTED)
        );
    }

    #[test]
    fn mipmap_levels_halve_every_extent_but_layers() {
        let d = ArrayDesc::from_3d(&desc3d(100, 30, 0, 0x20, 1, 0)).unwrap();
        assert_eq!(d.max_levels(), 7);
        let l6 = d.level(6);
        assert_eq!((l6.width, l6.height, l6.depth), (1, 1, 0));
        assert_eq!(d.level(2).width, 25);
        let layered = ArrayDesc::from_3d(&desc3d(16, 16, 5, 0x20, 1, ARRAY_LAYERED)).unwrap();
        assert_eq!(layered.max_levels(), 5);
        assert_eq!(layered.level(3).depth, 5, "layers are not halved");
        let volume = ArrayDesc::from_3d(&desc3d(4, 4, 64, 0x20, 1, 0)).unwrap();
        assert_eq!(volume.max_levels(), 7);
        assert_eq!((volume.level(4).width, volume.level(4).depth), (1, 4));
    }

    #[test]
    fn copy_layouts_are_checked_and_rows_merge_where_contiguous() {
        let side = Side {
            memory: Memory::Device(0),
            x: 4,
            y: 1,
            z: 0,
            pitch: 64,
            height: 0,
        };
        let (l, span) = Linear::of(0x1000, &side, 64, 8, 16, 3, 1).unwrap();
        assert_eq!((l.start, span), (0x1000 + 64 + 4, 2 * 64 + 16));
        // A pitch narrower than x + width, a wrapping base: refused.
        assert!(Linear::of(0x1000, &side, 16, 8, 16, 3, 1).is_err());
        assert!(Linear::of(u64::MAX - 8, &side, 64, 8, 16, 3, 1).is_err());
        assert!(Linear::of(0, &side, u64::MAX, 8, 16, 3, 2).is_err());
        let packed = Linear {
            start: 0,
            pitch: 16,
            slice: 48,
        };
        assert_eq!(runs(&packed, &packed, 16, 3, 2), vec![(0, 0, 96)]);
        assert_eq!(
            runs(&l, &packed, 16, 3, 1),
            vec![(0, 0, 16), (64, 16, 16), (128, 32, 16)]
        );
        let a = ArrayDesc {
            width: 8,
            height: 4,
            depth: 0,
            format: Format::U16,
            channels: 2,
            flags: 0,
        };
        let at = |x| Side { x, y: 3, ..side };
        assert!(check_in_array(&a, &at(0), 32, 1, 1).is_ok());
        assert!(check_in_array(&a, &at(4), 32, 1, 1).is_err());
        assert!(check_in_array(&a, &at(2), 4, 1, 1).is_err());
        assert!(check_in_array(&a, &at(0), 4, 2, 1).is_err());
        assert!(check_in_array(&a, &at(u64::MAX), 4, 1, 1).is_err());
    }

    #[test]
    fn resource_and_texture_descriptors_decode_and_validate() {
        let r = Resource::Pitch2D {
            addr: 0x10000,
            format: Format::U8,
            channels: 1,
            width: 100,
            height: 10,
            pitch: 128,
        };
        assert_eq!(Resource::decode(&r.encode()), Ok(r));
        let mut d = r.linear().unwrap().unwrap();
        let mut t = [0u8; TEXTURE_DESC_BYTES];
        t[0..4].copy_from_slice(&2u32.to_le_bytes());
        t[12..16].copy_from_slice(&1u32.to_le_bytes());
        t[16..20].copy_from_slice(&TRSF_NORMALIZED_COORDINATES.to_le_bytes());
        apply_texture_desc(&t, &mut d).unwrap();
        assert_eq!(
            d.flags,
            FLAG_LINEAR | FLAG_NORMALIZED | FLAG_READ_NORMALIZED
        );
        assert_eq!(d.address[0], AddressMode::Mirror);
        // Linear filtering of integer reads, an unknown mode, a pitch under a row: refused.
        let mut d2 = r.linear().unwrap().unwrap();
        t[16..20].copy_from_slice(&TRSF_READ_AS_INTEGER.to_le_bytes());
        assert_eq!(
            apply_texture_desc(&t, &mut d2),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        t[0..4].copy_from_slice(&9u32.to_le_bytes());
        assert_eq!(
            apply_texture_desc(&t, &mut d2),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        let narrow = Resource::Pitch2D {
            addr: 0x10000,
            format: Format::U8,
            channels: 1,
            width: 100,
            height: 10,
            pitch: 64,
        };
        let mut d3 = narrow.linear().unwrap().unwrap();
        assert_eq!(
            apply_texture_desc(&[0u8; TEXTURE_DESC_BYTES], &mut d3),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        let mut bad = r.encode();
        bad[0] = 7;
        assert_eq!(Resource::decode(&bad), Err(CUDA_ERROR_INVALID_VALUE));
    }
}
