//! Texture and surface objects as the executor sees them: the descriptor a guest's driver
//! writes into device memory (the object's handle is the descriptor's device address, so a
//! kernel's handle is read and validated on every fetch: a bad handle is a fault of that
//! context, never a host access), texel addressing and filtering as the CUDA Programming
//! Guide's "Texture Fetching" appendix defines them, and the surface load/store formats.
//! Pure logic: memory is reached through [`Objects`] only, whose accesses are checked: the
//! interpreter reads every descriptor and texel through [`GlobalMemory`], compiled code
//! through a view that keeps the descriptors it decoded and returns the same bytes and faults.
//!
//! Formulas (N texels along a dimension, x the fetch coordinate):
//! - normalised coordinates: `x * N` (unnormalised are used as given);
//! - nearest-point: texel `floor(x)`;
//! - linear: `xB = x - 0.5`, `i = floor(xB)`, `α = frac(xB)` held in 9-bit fixed point with 8
//!   fractional bits (rounded to the nearest 1/256), `(1-α)·T[i] + α·T[i+1]` (bilinear and
//!   trilinear the products of the per-dimension weights), each term in `f32`;
//! - address modes per texel index: clamp to `[0, N-1]`; border gives the border colour;
//!   wrap `i mod N`; mirror reflects every N; wrap and mirror need normalised coordinates and
//!   are clamp otherwise, as on the hardware;
//! - normalised-float reads: unsigned `v / (2^n - 1)`, signed `max(v / (2^(n-1) - 1), -1)`;
//!   sRGB the standard curve on red, green and blue; `f16` widened exactly.

use thiserror::Error;

use crate::compute::memory::{Fault, GlobalMemory};

/// Where a lane's texture and surface instructions find descriptors and texels. The
/// provided methods are the reference (every descriptor read and validated anew, every
/// texel read through the context's checked memory: the interpreter); a view that keeps
/// what it decoded or reads faster (compiled code) must give the same descriptors, the same
/// bytes and the same faults.
pub(crate) trait Objects {
    /// The context's memory.
    fn memory(&self) -> &dyn GlobalMemory;

    /// The validated descriptor of the object at `handle`: [`Descriptor::load`].
    fn descriptor(&mut self, handle: u64, surface: bool) -> Result<Descriptor, TextureError> {
        Descriptor::load(self.memory(), handle, surface)
    }

    /// `buf.len()` bytes at `addr`: [`GlobalMemory::read`].
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), Fault> {
        self.memory().read(addr, buf)
    }
}

/// Bytes of a descriptor in device memory.
pub const DESCRIPTOR_BYTES: usize = 80;
/// The first word of a texture object's descriptor ("VTEX").
pub const TEXTURE_MAGIC: u32 = 0x5845_5456;
/// The first word of a surface object's descriptor ("VSRF").
pub const SURFACE_MAGIC: u32 = 0x4652_5356;
/// Largest extent of any dimension (layers and faces included) the executor accepts in a
/// descriptor: a Turing's largest texture limit (1D linear textures, 2^27 texels). Each kind
/// of resource has its own, smaller limits, which the driver checks when it creates one.
pub const MAX_EXTENT: u32 = 1 << 27;

/// Most mipmap levels of a texture: a Turing's 32768-texel cubemap faces have 16.
pub const MAX_LEVELS: usize = 16;
/// Bytes of each level record after the descriptor of a mipmapped texture (levels 1 and up).
pub const LEVEL_BYTES: usize = 40;

/// Why a fetch or a descriptor is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TextureError {
    #[error("texture/surface handle {0:#x}: no descriptor there")]
    Unreadable(u64),
    #[error("handle {0:#x} is not a {1} object")]
    NotAnObject(u64, &'static str),
    #[error("descriptor at {0:#x}: {1}")]
    Invalid(u64, String),
    #[error("texel at {0:#x} outside the resource's memory")]
    Texel(u64),
    #[error("surface access out of range: x {x} bytes, y {y}, z {z}")]
    OutOfRange { x: i64, y: i64, z: i64 },
    #[error("{0} on this resource")]
    Geometry(&'static str),
}

/// Element formats (CUarray_format's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    U8 = 0x01,
    U16 = 0x02,
    U32 = 0x03,
    S8 = 0x08,
    S16 = 0x09,
    S32 = 0x0a,
    F16 = 0x10,
    F32 = 0x20,
}

impl Format {
    /// The format of a `CUarray_format` value.
    pub fn from_cuda(v: u32) -> Option<Format> {
        Some(match v {
            0x01 => Format::U8,
            0x02 => Format::U16,
            0x03 => Format::U32,
            0x08 => Format::S8,
            0x09 => Format::S16,
            0x0a => Format::S32,
            0x10 => Format::F16,
            0x20 => Format::F32,
            _ => return None,
        })
    }

    /// Bytes of one channel.
    pub fn bytes(self) -> u32 {
        match self {
            Format::U8 | Format::S8 => 1,
            Format::U16 | Format::S16 | Format::F16 => 2,
            Format::U32 | Format::S32 | Format::F32 => 4,
        }
    }

    fn float(self) -> bool {
        matches!(self, Format::F16 | Format::F32)
    }
}

/// Address modes (CUaddress_mode's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressMode {
    Wrap = 0,
    Clamp = 1,
    Mirror = 2,
    Border = 3,
}

impl AddressMode {
    pub fn from_cuda(v: u32) -> Option<AddressMode> {
        Some(match v {
            0 => AddressMode::Wrap,
            1 => AddressMode::Clamp,
            2 => AddressMode::Mirror,
            3 => AddressMode::Border,
            _ => return None,
        })
    }
}

/// Descriptor flag: coordinates are normalised to [0, 1).
pub const FLAG_NORMALIZED: u8 = 1;
/// Descriptor flag: 8/16-bit integer texels read as normalised floats.
pub const FLAG_READ_NORMALIZED: u8 = 2;
/// Descriptor flag: linear filtering (else nearest-point).
pub const FLAG_LINEAR: u8 = 4;
/// Descriptor flag: sRGB to linear conversion of red, green and blue.
pub const FLAG_SRGB: u8 = 8;
/// Descriptor flag: the resource is layered (its depth counts layers).
pub const FLAG_LAYERED: u8 = 16;
/// Descriptor flag: the resource is a cubemap (6 faces per layer).
pub const FLAG_CUBEMAP: u8 = 32;
const FLAGS_KNOWN: u8 = 63;

/// A texture or surface object: its resource (memory laid out as `base + z * slice + y *
/// pitch + x * texel bytes`) and how it is sampled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Descriptor {
    pub surface: bool,
    pub format: Format,
    /// 1, 2 or 4.
    pub channels: u32,
    pub flags: u8,
    pub address: [AddressMode; 3],
    /// Texels along x, y and z (y and z 1 where absent; z counts layers or faces).
    pub extent: [u32; 3],
    pub base: u64,
    pub pitch: u64,
    pub slice: u64,
    pub border: [f32; 4],
    pub mip: Mip,
}

/// The mipmap levels of a texture and how a fetch picks them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mip {
    /// Levels (1 for a texture without mipmaps); level 0 is the descriptor's own resource,
    /// the others follow it as [`LEVEL_BYTES`] records.
    pub levels: u8,
    /// Level of detail added to every fetch's.
    pub bias: f32,
    /// The range a fetch's level of detail is clamped to.
    pub min: f32,
    pub max: f32,
    /// Linear filtering between the two nearest levels (else the nearest level).
    pub linear: bool,
}

impl Mip {
    /// No mipmaps.
    pub const NONE: Mip = Mip {
        levels: 1,
        bias: 0.0,
        min: 0.0,
        max: 0.0,
        linear: false,
    };
}

/// What `txq` and `suq` ask of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Query {
    Width,
    Height,
    Depth,
    ArraySize,
    NumMipmapLevels,
    NumSamples,
    NormalizedCoords,
    FilterMode,
    AddrMode(u8),
}

impl Query {
    /// The query a `txq`/`suq` modifier names; `None` for the ones not answered here
    /// (`channel_data_type`, `channel_order`, `memory_layout`, per-level forms).
    pub fn parse(s: &str) -> Option<Query> {
        Some(match s {
            "width" => Query::Width,
            "height" => Query::Height,
            "depth" => Query::Depth,
            "array_size" => Query::ArraySize,
            "num_mipmap_levels" => Query::NumMipmapLevels,
            "num_samples" => Query::NumSamples,
            "normalized_coords" => Query::NormalizedCoords,
            "filter_mode" => Query::FilterMode,
            "addr_mode_0" => Query::AddrMode(0),
            "addr_mode_1" => Query::AddrMode(1),
            "addr_mode_2" => Query::AddrMode(2),
            _ => return None,
        })
    }

    /// Whether `suq` may ask it (surfaces have no sampler or levels).
    pub fn of_surfaces(self) -> bool {
        matches!(
            self,
            Query::Width | Query::Height | Query::Depth | Query::ArraySize
        )
    }
}

/// `txq` (`surface` false) and `suq`: the answer to `q` about the object at `handle`.
/// Extents are the resource's (depth 1 but for a 3D one; a layered one's layers, a cubemap
/// array's cubemaps, are its array size), the filter mode 0 for nearest and 1 for linear,
/// address modes CUDA's numbers.
pub(crate) fn query(
    o: &mut impl Objects,
    handle: u64,
    surface: bool,
    q: Query,
) -> Result<u32, TextureError> {
    let d = o.descriptor(handle, surface)?;
    let layered = d.flags & FLAG_LAYERED != 0;
    let cube = d.flags & FLAG_CUBEMAP != 0;
    Ok(match q {
        Query::Width => d.extent[0],
        Query::Height => d.extent[1],
        Query::Depth if layered || cube => 1,
        Query::Depth => d.extent[2],
        Query::ArraySize if cube && layered => d.extent[2] / 6,
        Query::ArraySize if layered => d.extent[2],
        Query::ArraySize => 0,
        Query::NumMipmapLevels => u32::from(d.mip.levels),
        Query::NumSamples => 0,
        Query::NormalizedCoords => u32::from(d.flags & FLAG_NORMALIZED != 0),
        Query::FilterMode => u32::from(d.flags & FLAG_LINEAR != 0),
        Query::AddrMode(k) => d.address[usize::from(k)] as u32,
    })
}

/// A fetch's level of detail, as its instruction gives it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Lod {
    /// `tex`: 0 (a kernel has no derivatives to compute one from).
    Implicit,
    /// `tex.level`.
    Level(f32),
    /// `tex.grad`: the coordinates' gradients along x and y.
    Grad([f32; 3], [f32; 3]),
}

/// Fetch geometry of a `tex`/`suld`/`sust` instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Geom {
    D1,
    D2,
    D3,
    A1,
    A2,
    Cube,
    ACube,
}

impl Geom {
    pub fn parse(s: &str) -> Option<Geom> {
        Some(match s {
            "1d" => Geom::D1,
            "2d" => Geom::D2,
            "3d" => Geom::D3,
            "a1d" => Geom::A1,
            "a2d" => Geom::A2,
            "cube" => Geom::Cube,
            "acube" => Geom::ACube,
            _ => return None,
        })
    }

    /// Coordinate operands the instruction takes (its vector is padded to 1, 2 or 4).
    pub fn operands(self) -> usize {
        match self {
            Geom::D1 => 1,
            Geom::D2 | Geom::A1 => 2,
            Geom::D3 | Geom::A2 | Geom::Cube | Geom::ACube => 4,
        }
    }
}

/// What a surface access out of range does (`.trap`, `.clamp`, `.zero`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Oob {
    Trap,
    Clamp,
    Zero,
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Descriptor {
    /// Checks what a driver creating the object checks: extents within the limits, a layout
    /// whose rows and slices hold their texels, a filter the format allows.
    pub fn validate(&self) -> Result<(), String> {
        if !matches!(self.channels, 1 | 2 | 4) {
            return Err(format!("{} channels", self.channels));
        }
        if self.flags & !FLAGS_KNOWN != 0 {
            return Err(format!("flags {:#x}", self.flags));
        }
        let [w, h, d] = self.extent;
        if [w, h, d].iter().any(|e| !(1..=MAX_EXTENT).contains(e)) {
            return Err(format!("extent {w}x{h}x{d}"));
        }
        let row = u64::from(w) * u64::from(self.texel_bytes());
        let rows = u64::from(h - 1)
            .checked_mul(self.pitch)
            .and_then(|r| r.checked_add(row));
        if self.pitch < row || rows.is_none_or(|r| self.slice < r && d > 1) {
            return Err(format!(
                "pitch {} / slice {} for {w}x{h}",
                self.pitch, self.slice
            ));
        }
        let end = u64::from(d - 1)
            .checked_mul(self.slice)
            .zip(rows)
            .and_then(|(s, r)| s.checked_add(r))
            .and_then(|n| self.base.checked_add(n));
        if end.is_none() {
            return Err("resource wraps the address space".into());
        }
        if self.flags & FLAG_LINEAR != 0 && !self.reads_float() {
            return Err("linear filtering of texels read as integers".into());
        }
        if self.flags & FLAG_READ_NORMALIZED != 0 && self.format.bytes() == 4 {
            return Err("normalised-float reads of 32-bit texels".into());
        }
        if self.flags & FLAG_CUBEMAP != 0 && (w != h || d % 6 != 0) {
            return Err("a cubemap needs square faces, 6 per layer".into());
        }
        let m = &self.mip;
        if !(1..=MAX_LEVELS).contains(&usize::from(m.levels))
            || ![m.bias, m.min, m.max].iter().all(|v| v.is_finite())
            || (m.linear && m.levels > 1 && !self.reads_float())
        {
            return Err(format!("mipmap levels {} {:?}", m.levels, m));
        }
        Ok(())
    }

    /// Bytes of one texel.
    pub fn texel_bytes(&self) -> u32 {
        self.format.bytes() * self.channels
    }

    fn reads_float(&self) -> bool {
        self.format.float() || self.flags & FLAG_READ_NORMALIZED != 0
    }

    /// The descriptor's bytes, as a driver writes them into device memory.
    pub fn encode(&self) -> [u8; DESCRIPTOR_BYTES] {
        let mut b = [0u8; DESCRIPTOR_BYTES];
        let magic = if self.surface {
            SURFACE_MAGIC
        } else {
            TEXTURE_MAGIC
        };
        b[0..4].copy_from_slice(&magic.to_le_bytes());
        b[4] = self.format as u8;
        b[5] = self.channels as u8;
        b[6] = self.flags;
        for (i, m) in self.address.iter().enumerate() {
            b[8 + i] = *m as u8;
        }
        for (i, e) in self.extent.iter().enumerate() {
            b[12 + 4 * i..16 + 4 * i].copy_from_slice(&e.to_le_bytes());
        }
        b[24..32].copy_from_slice(&self.base.to_le_bytes());
        b[32..40].copy_from_slice(&self.pitch.to_le_bytes());
        b[40..48].copy_from_slice(&self.slice.to_le_bytes());
        for (i, c) in self.border.iter().enumerate() {
            b[48 + 4 * i..52 + 4 * i].copy_from_slice(&c.to_bits().to_le_bytes());
        }
        let m = &self.mip;
        b[7] = m.levels;
        for (i, v) in [m.bias, m.min, m.max].iter().enumerate() {
            b[64 + 4 * i..68 + 4 * i].copy_from_slice(&v.to_bits().to_le_bytes());
        }
        b[76] = u8::from(m.linear);
        b
    }

    /// The record of a mipmap level (1 and up) that follows a mipmapped texture's descriptor:
    /// `level`'s resource (base, pitch, slice, extent).
    pub fn encode_level(level: &Descriptor) -> [u8; LEVEL_BYTES] {
        let mut b = [0u8; LEVEL_BYTES];
        b[0..8].copy_from_slice(&level.base.to_le_bytes());
        b[8..16].copy_from_slice(&level.pitch.to_le_bytes());
        b[16..24].copy_from_slice(&level.slice.to_le_bytes());
        for (i, e) in level.extent.iter().enumerate() {
            b[24 + 4 * i..28 + 4 * i].copy_from_slice(&e.to_le_bytes());
        }
        b
    }

    /// Level `l` (1 and up) of the mipmapped texture at `handle`: its resource in place of
    /// level 0's, validated as a descriptor is.
    fn level(&self, o: &mut impl Objects, handle: u64, l: u8) -> Result<Descriptor, TextureError> {
        let at = (u64::from(l) - 1) * LEVEL_BYTES as u64 + DESCRIPTOR_BYTES as u64;
        let addr = handle
            .checked_add(at)
            .ok_or(TextureError::Unreadable(handle))?;
        let mut b = [0u8; LEVEL_BYTES];
        o.read(addr, &mut b)
            .map_err(|_| TextureError::Unreadable(addr))?;
        let d = Descriptor {
            base: le64(&b, 0),
            pitch: le64(&b, 8),
            slice: le64(&b, 16),
            extent: [le32(&b, 24), le32(&b, 28), le32(&b, 32)],
            ..*self
        };
        d.validate()
            .map_err(|e| TextureError::Invalid(handle, format!("level {l}: {e}")))?;
        Ok(d)
    }

    /// Reads and validates the descriptor a handle names.
    pub fn load(
        memory: &dyn GlobalMemory,
        handle: u64,
        surface: bool,
    ) -> Result<Descriptor, TextureError> {
        let mut b = [0u8; DESCRIPTOR_BYTES];
        memory
            .read(handle, &mut b)
            .map_err(|_| TextureError::Unreadable(handle))?;
        Self::decode(handle, surface, &b)
    }

    /// The descriptor of bytes `b` read at `handle`, validated.
    pub(crate) fn decode(
        handle: u64,
        surface: bool,
        b: &[u8; DESCRIPTOR_BYTES],
    ) -> Result<Descriptor, TextureError> {
        let want = if surface {
            (SURFACE_MAGIC, "surface")
        } else {
            (TEXTURE_MAGIC, "texture")
        };
        if le32(b, 0) != want.0 {
            return Err(TextureError::NotAnObject(handle, want.1));
        }
        let bad = |what: &str| TextureError::Invalid(handle, what.to_string());
        let format = Format::from_cuda(u32::from(b[4])).ok_or_else(|| bad("format"))?;
        let mut address = [AddressMode::Clamp; 3];
        for (i, m) in address.iter_mut().enumerate() {
            *m = AddressMode::from_cuda(u32::from(b[8 + i])).ok_or_else(|| bad("address mode"))?;
        }
        let mut border = [0f32; 4];
        for (i, c) in border.iter_mut().enumerate() {
            *c = f32::from_bits(le32(b, 48 + 4 * i));
        }
        let d = Descriptor {
            surface,
            format,
            channels: u32::from(b[5]),
            flags: b[6],
            address,
            extent: [le32(b, 12), le32(b, 16), le32(b, 20)],
            base: le64(b, 24),
            pitch: le64(b, 32),
            slice: le64(b, 40),
            border,
            mip: Mip {
                levels: b[7],
                bias: f32::from_bits(le32(b, 64)),
                min: f32::from_bits(le32(b, 68)),
                max: f32::from_bits(le32(b, 72)),
                linear: b[76] != 0,
            },
        };
        if surface && d.mip.levels != 1 {
            return Err(bad("a surface of mipmap levels"));
        }
        d.validate().map_err(|e| bad(&e))?;
        Ok(d)
    }

    /// The address of texel (x, y, z), all in range.
    #[inline]
    fn texel_addr(&self, x: u32, y: u32, z: u32) -> u64 {
        // In range and validated: no overflow (see `validate`).
        self.base
            + u64::from(z) * self.slice
            + u64::from(y) * self.pitch
            + u64::from(x) * u64::from(self.texel_bytes())
    }
}

/// One texel's channels as read: floats (as their bits), or integers (sign-extended), as the
/// descriptor reads them.
type Texel = [u32; 4];

/// IEEE binary16 bits to `f32` (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: m * 2^-24, exact in f32.
            let v = m as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// The sRGB curve's inverse (sRGB-encoded to linear).
pub fn srgb_to_linear(c: f32) -> f32 {
    if c <= 0.040_45 {
        c / 12.92
    } else {
        ((c + 0.055) / 1.055).powf(2.4)
    }
}

/// A texel's bytes as the descriptor reads them.
#[inline(always)]
fn decode_texel(d: &Descriptor, raw: &[u8]) -> Texel {
    let chan = |c: usize| -> u32 {
        match d.format.bytes() {
            1 => u32::from(raw[c]),
            2 => u32::from(u16::from_le_bytes([raw[2 * c], raw[2 * c + 1]])),
            _ => le32(raw, 4 * c),
        }
    };
    let channels = d.channels as usize;
    if d.reads_float() {
        let mut v = [0f32; 4];
        for (c, o) in v.iter_mut().enumerate().take(channels) {
            let r = chan(c);
            *o = match d.format {
                Format::F32 => f32::from_bits(r),
                Format::F16 => f16_to_f32(r as u16),
                Format::U8 => r as f32 / 255.0,
                Format::U16 => r as f32 / 65_535.0,
                Format::S8 => (f32::from(r as u8 as i8) / 127.0).max(-1.0),
                Format::S16 => (f32::from(r as u16 as i16) / 32_767.0).max(-1.0),
                Format::U32 | Format::S32 => unreachable!("validated: no normalised 32-bit reads"),
            };
            if d.flags & FLAG_SRGB != 0 && c < 3 {
                *o = srgb_to_linear(*o);
            }
        }
        if channels < 4 {
            v[3] = 1.0;
        }
        v.map(f32::to_bits)
    } else {
        let mut v = [0u32; 4];
        for (c, o) in v.iter_mut().enumerate().take(channels) {
            let r = chan(c);
            *o = match d.format {
                Format::S8 => r as u8 as i8 as i32 as u32,
                Format::S16 => r as u16 as i16 as i32 as u32,
                _ => r,
            };
        }
        if channels < 4 {
            v[3] = 1;
        }
        v
    }
}

/// A texel index after the address mode: `None` for border.
#[inline]
pub fn address(i: i64, n: u32, mode: AddressMode, normalized: bool) -> Option<u32> {
    let n = i64::from(n);
    if (0..n).contains(&i) {
        // Every mode keeps an index in range.
        return Some(i as u32);
    }
    let mode = match mode {
        AddressMode::Wrap | AddressMode::Mirror if !normalized => AddressMode::Clamp,
        m => m,
    };
    let i = match mode {
        AddressMode::Clamp => i.clamp(0, n - 1),
        AddressMode::Border => {
            if !(0..n).contains(&i) {
                return None;
            }
            i
        }
        AddressMode::Wrap => i.rem_euclid(n),
        AddressMode::Mirror => {
            let m = i.rem_euclid(2 * n);
            if m >= n { 2 * n - 1 - m } else { m }
        }
    };
    Some(i as u32)
}

/// From 2^23 up every finite f32 is an integer.
const F32_INTEGRAL: f32 = 8_388_608.0;

/// `x.floor()`, bit for bit (signed zeros, NaNs as they are), without the library call the
/// baseline x86-64 instruction set needs for it: fetches round every coordinate.
#[inline(always)]
fn floor(x: f32) -> f32 {
    // Infinities, NaNs and every f32 from 2^23 up are their own floor.
    if x.is_nan() || x.abs() >= F32_INTEGRAL {
        return x;
    }
    // Toward zero, exactly (|x| < 2^23), then down for negative fractions; a zero result
    // keeps x's sign (floor(-0.0) is -0.0, and x in (-1, 0) gives -1).
    let t = x as i32 as f32;
    let f = if t > x { t - 1.0 } else { t };
    if f == 0.0 { 0f32.copysign(x) } else { f }
}

/// `x.round()` (halves away from zero), bit for bit, as [`floor`] is `x.floor()`.
#[inline(always)]
fn round(x: f32) -> f32 {
    if x.is_nan() {
        // Quietened, as the library's `roundf` does (its `floorf` does not).
        return x + x;
    }
    if x.abs() >= F32_INTEGRAL {
        return x;
    }
    // `x - t` is exact for |x| < 2^23; every result has x's sign (-0.3 rounds to -0.0).
    let t = x as i32 as f32;
    let r = if (x - t).abs() >= 0.5 {
        t + 1f32.copysign(x)
    } else {
        t
    };
    r.copysign(x)
}

/// The 9-bit fixed-point weight of a fraction in [0, 1): 8 fractional bits, to nearest.
#[inline]
pub fn weight(frac: f32) -> f32 {
    round(frac * 256.0) / 256.0
}

/// Texel index ranges of `x` (unnormalised) for one dimension: (first index, weight of the
/// second), the second index the first plus one. Nearest-point has weight 0.
#[inline]
fn taps(x: f32, linear: bool) -> (i64, f32) {
    // `as` saturates (NaN to 0): any coordinate gives an index the address mode bounds.
    if linear {
        let xb = x - 0.5;
        let i = floor(xb);
        (i as i64, weight(xb - i))
    } else {
        (floor(x) as i64, 0.0)
    }
}

/// A fetch's coordinates, decoded from an instruction's operands.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Coords {
    xyz: [f32; 3],
    /// Dimensions sampled (1, 2 or 3).
    dims: usize,
    layer: u32,
}

/// The cubemap face and its 2D coordinates (in [0, 1]) of direction (x, y, z), by the Guide's
/// cubemap-fetch table.
pub fn cube_face(x: f32, y: f32, z: f32) -> (u32, f32, f32) {
    let (ax, ay, az) = (x.abs(), y.abs(), z.abs());
    let (face, m, s, t) = if ax >= ay && ax >= az {
        if x >= 0.0 {
            (0, ax, -z, -y)
        } else {
            (1, ax, z, -y)
        }
    } else if ay >= az {
        if y >= 0.0 {
            (2, ay, x, z)
        } else {
            (3, ay, x, -z)
        }
    } else if z >= 0.0 {
        (4, az, x, -y)
    } else {
        (5, az, -x, -y)
    };
    (face, (s / m + 1.0) * 0.5, (t / m + 1.0) * 0.5)
}

/// Decodes the raw 32-bit coordinate operands of a fetch of `geom`.
#[inline(always)]
fn coords(d: &Descriptor, geom: Geom, int: bool, raw: [u32; 4]) -> Result<Coords, TextureError> {
    let layered = d.flags & FLAG_LAYERED != 0;
    let cube = d.flags & FLAG_CUBEMAP != 0;
    let want = match geom {
        Geom::D1 | Geom::D2 | Geom::D3 => !layered && !cube,
        Geom::A1 | Geom::A2 => layered && !cube,
        Geom::Cube => cube && !layered,
        Geom::ACube => cube && layered,
    };
    if !want {
        return Err(TextureError::Geometry("a fetch of another geometry"));
    }
    let f = |v: u32| {
        if int {
            v as i32 as f32
        } else {
            f32::from_bits(v)
        }
    };
    // A layer index is clamped to the layers there are.
    let layer = |v: u32, per: u32| {
        let layers = d.extent[2] / per;
        (v as i32).clamp(0, layers as i32 - 1) as u32
    };
    Ok(match geom {
        Geom::D1 => Coords {
            xyz: [f(raw[0]), 0.0, 0.0],
            dims: 1,
            layer: 0,
        },
        Geom::D2 => Coords {
            xyz: [f(raw[0]), f(raw[1]), 0.0],
            dims: 2,
            layer: 0,
        },
        Geom::D3 => Coords {
            xyz: [f(raw[0]), f(raw[1]), f(raw[2])],
            dims: 3,
            layer: 0,
        },
        Geom::A1 => Coords {
            xyz: [f(raw[1]), 0.0, 0.0],
            dims: 1,
            layer: layer(raw[0], 1),
        },
        Geom::A2 => Coords {
            xyz: [f(raw[1]), f(raw[2]), 0.0],
            dims: 2,
            layer: layer(raw[0], 1),
        },
        Geom::Cube | Geom::ACube => {
            let (base, v) = if geom == Geom::ACube {
                (layer(raw[0], 6) * 6, [raw[1], raw[2], raw[3]])
            } else {
                (0, [raw[0], raw[1], raw[2]])
            };
            let (face, s, t) = cube_face(f(v[0]), f(v[1]), f(v[2]));
            Coords {
                xyz: [s, t, 0.0],
                dims: 2,
                layer: base + face,
            }
        }
    })
}

/// `tex.geom.v4.dtype.ctype`: the four 32-bit results of a fetch through texture `handle`
/// (floats as their bits), `raw` the coordinate operands' low 32 bits; `int` for `.s32`
/// coordinates (texel indices, nearest-point). With `gather` (`tld4.{r,g,b,a}`, 2D), that
/// channel of the four texels linear filtering would weigh, in the ISA's order: (i, j+1),
/// (i+1, j+1), (i+1, j), (i, j).
///
/// A mipmapped texture is sampled at the level of detail `lod` (`tex.level`'s; from
/// `tex.grad`'s gradients `log2(max(|dx|, |dy|))`, their lengths in texels of level 0; 0
/// for `tex`) plus the descriptor's bias, clamped to its range and to the levels there are: at the
/// nearest level, or (linear mipmap filtering of float reads) between the two nearest,
/// `(1-f)·L[l] + f·L[l+1]` with `f` the fraction of the level of detail.
pub(crate) fn sample(
    o: &mut impl Objects,
    handle: u64,
    geom: Geom,
    int: bool,
    gather: Option<usize>,
    lod: Lod,
    raw: [u32; 4],
) -> Result<[u32; 4], TextureError> {
    let d = o.descriptor(handle, false)?;
    let c = coords(&d, geom, int, raw)?;
    let m = d.mip;
    if m.levels == 1 {
        return sample_level(o, &d, &c, int, gather);
    }
    let top = f32::from(m.levels - 1);
    let lod = match lod {
        Lod::Implicit => 0.0,
        Lod::Level(l) => l,
        Lod::Grad(dx, dy) => {
            let normalized = d.flags & (FLAG_NORMALIZED | FLAG_CUBEMAP) != 0;
            let texels = |g: [f32; 3]| -> f32 {
                (0..c.dims)
                    .map(|k| {
                        let scale = if normalized { d.extent[k] as f32 } else { 1.0 };
                        (g[k] * scale) * (g[k] * scale)
                    })
                    .sum::<f32>()
                    .sqrt()
            };
            texels(dx).max(texels(dy)).log2()
        }
    };
    // `max`/`min`, not `clamp`: a NaN level of detail becomes the range's low end.
    let lod = (lod + m.bias).max(m.min).min(m.max).max(0.0).min(top);
    let at = |o: &mut _, l: f32| {
        // In [0, top]: a level that exists.
        let l = l as u8;
        if l == 0 { Ok(d) } else { d.level(o, handle, l) }
    };
    if !m.linear || gather.is_some() || int {
        let level = at(o, (lod + 0.5).floor())?;
        return sample_level(o, &level, &c, int, gather);
    }
    let low = lod.floor();
    let f = lod - low;
    let level = at(o, low)?;
    let a = sample_level(o, &level, &c, int, None)?;
    if f == 0.0 {
        return Ok(a);
    }
    let level = at(o, low + 1.0)?;
    let b = sample_level(o, &level, &c, int, None)?;
    Ok(std::array::from_fn(|i| {
        ((1.0 - f) * f32::from_bits(a[i]) + f * f32::from_bits(b[i])).to_bits()
    }))
}

/// One level's fetch (see [`sample`]).
fn sample_level(
    o: &mut impl Objects,
    d: &Descriptor,
    c: &Coords,
    int: bool,
    gather: Option<usize>,
) -> Result<[u32; 4], TextureError> {
    let cube = d.flags & FLAG_CUBEMAP != 0;
    let normalized = cube || (d.flags & FLAG_NORMALIZED != 0 && !int);
    let linear = gather.is_some() || (d.flags & FLAG_LINEAR != 0 && !int);
    // Each dimension's texel index and the next one (linear filtering's second), after the
    // address mode (`None`: outside, the border); a 2D fetch's z is its layer.
    let mut index = [[Some(0u32); 2], [Some(0); 2], [Some(c.layer); 2]];
    let mut alpha = [0f32; 3];
    for k in 0..c.dims {
        let x = if normalized {
            c.xyz[k] * d.extent[k] as f32
        } else {
            c.xyz[k]
        };
        let (first, a) = taps(x, linear);
        alpha[k] = a;
        // Cubemap faces are sampled clamped at their edges; integer coordinates
        // (`tex1Dfetch`) have no address modes: out of range they read 0.
        let mode = if cube {
            AddressMode::Clamp
        } else if int {
            AddressMode::Border
        } else {
            d.address[k]
        };
        index[k][0] = address(first, d.extent[k], mode, normalized);
        if linear {
            index[k][1] = address(first.saturating_add(1), d.extent[k], mode, normalized);
        }
    }
    // The address of the texel at offsets (0 or 1 along each dimension) from the first.
    let at = |x: usize, y: usize, z: usize| -> Option<u64> {
        Some(d.texel_addr(index[0][x]?, index[1][y]?, index[2][z]?))
    };
    let mut t = [[0u32; 4]; 8];
    if let Some(ch) = gather {
        let addrs = [at(0, 1, 0), at(1, 1, 0), at(1, 0, 0), at(0, 0, 0)];
        texels(o, d, int, &addrs, &mut t)?;
        return Ok([t[0][ch], t[1][ch], t[2][ch], t[3][ch]]);
    }
    if !linear {
        texels(o, d, int, &[at(0, 0, 0)], &mut t)?;
        return Ok(t[0]);
    }
    // (1-α)·T[i] + α·T[i+1] per dimension, the weights multiplied across dimensions, summed
    // in the order of the corners (x the fastest); the texels are floats (validated: linear
    // filtering reads floats).
    let corners = 1usize << c.dims;
    let mut addrs = [None; 8];
    for (corner, a) in addrs.iter_mut().enumerate().take(corners) {
        *a = at(corner & 1, corner >> 1 & 1, corner >> 2 & 1);
    }
    texels(o, d, int, &addrs[..corners], &mut t)?;
    let mut acc = [0f32; 4];
    for (corner, texel) in t.iter().enumerate().take(corners) {
        let mut w = 1f32;
        for (k, a) in alpha.iter().enumerate().take(c.dims) {
            let hi = corner >> k & 1 == 1;
            w *= if hi { *a } else { 1.0 - *a };
        }
        for (a, t) in acc.iter_mut().zip(texel) {
            *a += w * f32::from_bits(*t);
        }
    }
    Ok([
        acc[0].to_bits(),
        acc[1].to_bits(),
        acc[2].to_bits(),
        acc[3].to_bits(),
    ])
}

/// Bytes of the largest texel (4 channels of 4 bytes).
const MAX_TEXEL_BYTES: usize = 16;

/// The texels at `addrs` into `out` (an address `None`: outside, the border colour, or 0 for
/// integer coordinates), as reading them one at a time in order reads them, the first
/// unreadable one the error; two in a row that are neighbours in memory (or the same texel)
/// take one read. Inlined: its texels stay in registers (written piecewise into memory and
/// read back whole, they stalled the load).
#[inline(always)]
fn texels(
    o: &mut impl Objects,
    d: &Descriptor,
    int: bool,
    addrs: &[Option<u64>],
    out: &mut [Texel],
) -> Result<(), TextureError> {
    let n = d.texel_bytes() as usize;
    let mut j = 0;
    while j < addrs.len() {
        let Some(a) = addrs[j] else {
            out[j] = if int { [0; 4] } else { border(d) };
            j += 1;
            continue;
        };
        match addrs.get(j + 1).copied().flatten() {
            Some(b) if b == a => {
                out[j] = texel(o, d, a)?;
                out[j + 1] = out[j];
            }
            Some(b) if a.abs_diff(b) == n as u64 => {
                let mut raw = [0u8; 2 * MAX_TEXEL_BYTES];
                if o.read(a.min(b), &mut raw[..2 * n]).is_ok() {
                    let (lo, hi) = (decode_texel(d, &raw[..n]), decode_texel(d, &raw[n..2 * n]));
                    (out[j], out[j + 1]) = if a < b { (lo, hi) } else { (hi, lo) };
                } else {
                    // One of them is unreadable: which one, as the reads one by one find it.
                    out[j] = texel(o, d, a)?;
                    out[j + 1] = texel(o, d, b)?;
                }
            }
            _ => {
                out[j] = texel(o, d, a)?;
                j += 1;
                continue;
            }
        }
        j += 2;
    }
    Ok(())
}

/// The texel at `a`.
#[inline(always)]
fn texel(o: &mut impl Objects, d: &Descriptor, a: u64) -> Result<Texel, TextureError> {
    let n = d.texel_bytes() as usize;
    let mut raw = [0u8; MAX_TEXEL_BYTES];
    match o.read(a, &mut raw[..n]) {
        Ok(()) => Ok(decode_texel(d, &raw[..n])),
        Err(_) => Err(TextureError::Texel(a)),
    }
}

/// What a border texel reads as: the border colour (floats), or its values as integers.
#[inline]
fn border(d: &Descriptor) -> Texel {
    if d.reads_float() {
        d.border.map(f32::to_bits)
    } else {
        d.border.map(|c| c as i32 as u32)
    }
}

/// The address of a surface access of `bytes` bytes at byte column `x`, row `y`, slice or
/// layer `z`; `None` where `.zero` makes an out-of-range access read 0 or store nothing.
fn surface_addr(
    d: &Descriptor,
    geom: Geom,
    raw: [u32; 4],
    bytes: u32,
    oob: Oob,
) -> Result<Option<u64>, TextureError> {
    // The geometry must be the resource's; the coordinates are s32 (x in bytes), a layer
    // index first for layered ones, and out of range as the access says (not clamped).
    coords(d, geom, true, raw)?;
    let r = raw.map(|v| i64::from(v as i32));
    let (x, y, z) = match geom {
        Geom::D1 => (r[0], 0, 0),
        Geom::D2 => (r[0], r[1], 0),
        Geom::D3 => (r[0], r[1], r[2]),
        Geom::A1 => (r[1], 0, r[0]),
        Geom::A2 => (r[1], r[2], r[0]),
        Geom::Cube | Geom::ACube => return Err(TextureError::Geometry("a cubemap surface")),
    };
    let row = i64::from(d.extent[0]) * i64::from(d.texel_bytes());
    let ok = (0..=row - i64::from(bytes)).contains(&x)
        && (0..i64::from(d.extent[1])).contains(&y)
        && (0..i64::from(d.extent[2])).contains(&z);
    let (x, y, z) = match (ok, oob) {
        (true, _) => (x, y, z),
        (false, Oob::Zero) => return Ok(None),
        (false, Oob::Trap) => return Err(TextureError::OutOfRange { x, y, z }),
        (false, Oob::Clamp) => (
            x.clamp(0, row - i64::from(bytes)),
            y.clamp(0, i64::from(d.extent[1]) - 1),
            z.clamp(0, i64::from(d.extent[2]) - 1),
        ),
    };
    if x % i64::from(bytes.min(d.texel_bytes())) != 0 {
        return Err(TextureError::OutOfRange { x, y, z });
    }
    // In range: no overflow (see `Descriptor::validate`).
    Ok(Some(
        d.base + z as u64 * d.slice + y as u64 * d.pitch + x as u64,
    ))
}

/// `suld.b`: `out.len()` bytes of surface `handle` at the coordinates `raw` (x in bytes).
pub(crate) fn surface_load(
    o: &mut impl Objects,
    handle: u64,
    geom: Geom,
    raw: [u32; 4],
    oob: Oob,
    out: &mut [u8],
) -> Result<(), TextureError> {
    let d = o.descriptor(handle, true)?;
    match surface_addr(&d, geom, raw, out.len() as u32, oob)? {
        Some(a) => o.read(a, out).map_err(|_| TextureError::Texel(a)),
        None => {
            out.fill(0);
            Ok(())
        }
    }
}

/// `sust.b`: stores `data` into surface `handle` at the coordinates `raw` (x in bytes).
pub(crate) fn surface_store(
    o: &mut impl Objects,
    handle: u64,
    geom: Geom,
    raw: [u32; 4],
    oob: Oob,
    data: &[u8],
) -> Result<(), TextureError> {
    let d = o.descriptor(handle, true)?;
    match surface_addr(&d, geom, raw, data.len() as u32, oob)? {
        Some(a) => o
            .memory()
            .write(a, data)
            .map_err(|_| TextureError::Texel(a)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    //! Fetches through the backend trait (a kernel's `tex`/`suld`/`sust` on the CPU executor)
    //! against a host reference written from the Programming Guide's formulas.
    use super::*;
    use crate::compute::backend::{ComputeBackend, ContextId, DEFAULT_STREAM, KernelLaunch};
    use crate::compute::{CpuBackend, CpuConfig};

    /// A kernel: thread i reads four 32-bit coordinate words at `c + 16 i`, runs `op` on them
    /// with handle `t`, and stores four words at `o + 16 i`.
    fn kernel(op: &str) -> String {
        format!(
            ".version 8.5\n.target sm_75\n.address_size 64\n\
             .visible .entry k(.param .u64 t, .param .u64 c, .param .u64 o)\n{{\n\
             .reg .b32 %r<12>;\n.reg .b64 %rd<8>;\n\
             ld.param.u64 %rd1, [t];\nld.param.u64 %rd2, [c];\nld.param.u64 %rd3, [o];\n\
             mov.u32 %r1, %tid.x;\nmul.wide.u32 %rd4, %r1, 16;\n\
             add.s64 %rd5, %rd2, %rd4;\nadd.s64 %rd6, %rd3, %rd4;\n\
             ld.global.v4.b32 {{%r2, %r3, %r4, %r5}}, [%rd5];\n\
             mov.b32 %r6, 0;\nmov.b32 %r7, 0;\nmov.b32 %r8, 0;\nmov.b32 %r9, 0;\n\
             {op}\n\
             st.global.v4.b32 [%rd6], {{%r6, %r7, %r8, %r9}};\nret;\n}}\n"
        )
    }

    struct Rig {
        be: CpuBackend,
        ctx: ContextId,
    }

    impl Rig {
        fn new() -> Rig {
            let mut be = CpuBackend::new(CpuConfig {
                memory_per_context: 8 << 20,
                ..CpuConfig::default()
            });
            let ctx = be.context_create().unwrap();
            Rig { be, ctx }
        }

        fn put(&mut self, data: &[u8]) -> u64 {
            let a = self.be.mem_alloc(self.ctx, data.len() as u64).unwrap();
            self.be
                .copy_htod(self.ctx, a, data, DEFAULT_STREAM)
                .unwrap();
            a
        }

        /// The descriptor `d` over `texels` in device memory: its handle.
        fn object(&mut self, mut d: Descriptor, texels: &[u8]) -> u64 {
            d.base = self.put(texels);
            self.put(&d.encode())
        }

        /// Runs `op` for each coordinate quadruple: the four result words of each.
        fn run(
            &mut self,
            op: &str,
            handle: u64,
            coords: &[[u32; 4]],
        ) -> ComputeResult<Vec<[u32; 4]>> {
            let m = self.be.module_load(self.ctx, kernel(op).as_bytes())?;
            let (f, _) = self.be.function(self.ctx, m, "k")?;
            let c: Vec<u8> = coords
                .iter()
                .flatten()
                .flat_map(|w| w.to_le_bytes())
                .collect();
            let c = self.put(&c);
            let o = self.put(&vec![0u8; coords.len() * 16]);
            let params = [handle, c, o].map(u64::to_le_bytes).concat();
            self.be.launch(
                self.ctx,
                &KernelLaunch {
                    function: f,
                    grid: [1, 1, 1],
                    block: [coords.len() as u32, 1, 1],
                    shared_bytes: 0,
                    stream: DEFAULT_STREAM,
                    params: &params,
                    cooperative: false,
                },
            )?;
            let mut out = vec![0u8; coords.len() * 16];
            self.be.copy_dtoh(self.ctx, &mut out, o, DEFAULT_STREAM)?;
            Ok(out
                .chunks(16)
                .map(|q| std::array::from_fn(|i| le32(q, 4 * i)))
                .collect())
        }
    }

    use crate::compute::ComputeResult;

    fn f32_desc(w: u32, h: u32, flags: u8, mode: AddressMode) -> Descriptor {
        Descriptor {
            surface: false,
            format: Format::F32,
            channels: 1,
            flags,
            address: [mode; 3],
            extent: [w, h, 1],
            base: 0,
            pitch: u64::from(w) * 4,
            slice: u64::from(w * h) * 4,
            border: [7.5, 0.0, 0.0, 1.0],
            mip: Mip::NONE,
        }
    }

    /// The Guide's addressing of texel index `i` of `n` (None: the border colour), with
    /// wrap and mirror defined on normalised coordinates only.
    fn reference_index(i: i64, n: i64, mode: AddressMode, normalized: bool) -> Option<i64> {
        match mode {
            AddressMode::Border if !(0..n).contains(&i) => None,
            AddressMode::Wrap if normalized => Some(((i % n) + n) % n),
            AddressMode::Mirror if normalized => {
                // Texels repeat as T[0..n], then T[n-1..=0], and so on.
                let period = ((i % (2 * n)) + 2 * n) % (2 * n);
                Some(if period < n {
                    period
                } else {
                    2 * n - 1 - period
                })
            }
            _ => Some(i.max(0).min(n - 1)),
        }
    }

    /// The Guide's tex2D of a one-channel float texture `t` (w × h).
    fn reference_2d(t: &[f32], w: u32, d: &Descriptor, x: f32, y: f32) -> f32 {
        let h = t.len() as u32 / w;
        let norm = d.flags & FLAG_NORMALIZED != 0;
        let (x, y) = if norm {
            (x * w as f32, y * h as f32)
        } else {
            (x, y)
        };
        let texel = |i: i64, j: i64| -> f32 {
            let mode = d.address[0];
            match (
                reference_index(i, i64::from(w), mode, norm),
                reference_index(j, i64::from(h), d.address[1], norm),
            ) {
                (Some(i), Some(j)) => t[(j * i64::from(w) + i) as usize],
                _ => d.border[0],
            }
        };
        if d.flags & FLAG_LINEAR == 0 {
            return texel(x.floor() as i64, y.floor() as i64);
        }
        let (xb, yb) = (x - 0.5, y - 0.5);
        let (i, j) = (xb.floor(), yb.floor());
        // α and β in 9-bit fixed point, 8 fractional bits.
        let a = ((xb - i) * 256.0).round() / 256.0;
        let b = ((yb - j) * 256.0).round() / 256.0;
        let (i, j) = (i as i64, j as i64);
        (1.0 - a) * (1.0 - b) * texel(i, j)
            + a * (1.0 - b) * texel(i + 1, j)
            + (1.0 - a) * b * texel(i, j + 1)
            + a * b * texel(i + 1, j + 1)
    }

    const TEX2D: &str = "tex.2d.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3}];";

    #[test]
    fn tex_2d_matches_the_guides_formulas_in_every_mode() {
        let mut rig = Rig::new();
        let (w, h) = (5u32, 3u32);
        let t: Vec<f32> = (0..w * h)
            .map(|i| (i * i % 11) as f32 * 1.25 - 3.0)
            .collect();
        let texels: Vec<u8> = t.iter().flat_map(|v| v.to_le_bytes()).collect();
        // Points inside, on texel edges, outside on every side; fractions not on 1/256.
        let mut points = Vec::new();
        for x in [
            -1.3f32, -0.2, 0.0, 0.3, 0.5, 1.7, 2.49, 4.99, 5.0, 6.6, 11.1,
        ] {
            for y in [-0.7f32, 0.1, 1.5, 2.9, 3.2] {
                points.push((x, y));
            }
        }
        for mode in [
            AddressMode::Wrap,
            AddressMode::Clamp,
            AddressMode::Mirror,
            AddressMode::Border,
        ] {
            for flags in [
                0,
                FLAG_LINEAR,
                FLAG_NORMALIZED,
                FLAG_NORMALIZED | FLAG_LINEAR,
            ] {
                let d = f32_desc(w, h, flags, mode);
                let handle = rig.object(d, &texels);
                let scale = if flags & FLAG_NORMALIZED != 0 {
                    (1.0 / w as f32, 1.0 / h as f32)
                } else {
                    (1.0, 1.0)
                };
                let coords: Vec<(f32, f32)> = points
                    .iter()
                    .map(|&(x, y)| (x * scale.0, y * scale.1))
                    .collect();
                let raw: Vec<[u32; 4]> = coords
                    .iter()
                    .map(|&(x, y)| [x.to_bits(), y.to_bits(), 0, 0])
                    .collect();
                let got = rig.run(TEX2D, handle, &raw).unwrap();
                for (&(x, y), g) in coords.iter().zip(&got) {
                    let want = reference_2d(&t, w, &d, x, y);
                    assert_eq!(
                        f32::from_bits(g[0]).to_bits(),
                        want.to_bits(),
                        "{mode:?} flags {flags} at ({x}, {y}): {} vs {want}",
                        f32::from_bits(g[0])
                    );
                    // A one-channel texture reads (v, 0, 0, 1).
                    assert_eq!([g[1], g[2], g[3]], [0, 0, 1f32.to_bits()]);
                }
            }
        }
    }

    #[test]
    fn linear_weights_are_9_bit_fixed_point() {
        let mut rig = Rig::new();
        let d = f32_desc(2, 1, FLAG_LINEAR, AddressMode::Clamp);
        let handle = rig.object(d, &[0f32, 1.0].map(f32::to_le_bytes).concat());
        // x = 0.5 + 0.3: α = 0.3 would be exact-ish in f32; the hardware's is 77/256.
        let got = rig
            .run(TEX2D, handle, &[[0.8f32.to_bits(), 0.5f32.to_bits(), 0, 0]])
            .unwrap();
        assert_eq!(f32::from_bits(got[0][0]), 77.0 / 256.0);
    }

    #[test]
    fn tld4_gathers_one_channel_of_the_bilinear_footprint_in_the_isas_order() {
        let mut rig = Rig::new();
        // 3 x 2 texels of two channels: (10 i + j, -(10 i + j)) at column i, row j.
        let mut texels = Vec::new();
        for j in 0..2 {
            for i in 0..3 {
                let v = (10 * i + j) as f32;
                texels.extend(v.to_le_bytes());
                texels.extend((-v).to_le_bytes());
            }
        }
        let d = Descriptor {
            channels: 2,
            pitch: 24,
            slice: 48,
            ..f32_desc(3, 2, 0, AddressMode::Clamp)
        };
        let handle = rig.object(d, &texels);
        let at = [1.7f32.to_bits(), 1.2f32.to_bits(), 0, 0];
        // Footprint i = 1, j = 0: (1, 1), (2, 1), (2, 0), (1, 0).
        let r = "tld4.r.2d.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3}];";
        let got = rig.run(r, handle, &[at]).unwrap()[0].map(f32::from_bits);
        assert_eq!(got, [11.0, 21.0, 20.0, 10.0]);
        let g = "tld4.g.2d.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3}];";
        let got = rig.run(g, handle, &[at]).unwrap()[0].map(f32::from_bits);
        assert_eq!(got, [-11.0, -21.0, -20.0, -10.0]);
        // Missing channels read as 0 (blue) and 1 (alpha).
        let a = "tld4.a.2d.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3}];";
        let got = rig.run(a, handle, &[at]).unwrap()[0].map(f32::from_bits);
        assert_eq!(got, [1.0; 4]);
        let bad = "tld4.r.3d.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3, %r4, %r5}];";
        assert!(rig.run(bad, handle, &[at]).is_err(), "tld4 is 2D only");
    }

    #[test]
    fn integer_coordinates_fetch_texels_and_read_zero_out_of_range() {
        let mut rig = Rig::new();
        let d = Descriptor {
            format: Format::S32,
            extent: [5, 1, 1],
            pitch: 20,
            slice: 20,
            // Address modes do not apply to integer coordinates (`tex1Dfetch`).
            ..f32_desc(5, 1, 0, AddressMode::Wrap)
        };
        let handle = rig.object(d, &[-3i32, 1, 2, 3, 4].map(i32::to_le_bytes).concat());
        let op = "tex.1d.v4.s32.s32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2}];";
        let got = rig
            .run(
                op,
                handle,
                &[[0; 4], [4, 0, 0, 0], [5, 0, 0, 0], [u32::MAX, 0, 0, 0]],
            )
            .unwrap();
        assert_eq!(got[0], [(-3i32) as u32, 0, 0, 1]);
        assert_eq!(got[1], [4, 0, 0, 1]);
        assert_eq!(got[2], [0; 4], "past the end");
        assert_eq!(got[3], [0; 4], "before the start");
    }

    #[test]
    fn layered_surfaces_take_the_layer_first_and_do_not_clamp_it() {
        let mut rig = Rig::new();
        let d = Descriptor {
            surface: true,
            format: Format::U32,
            flags: FLAG_LAYERED,
            extent: [2, 2, 3],
            pitch: 8,
            slice: 16,
            ..f32_desc(2, 2, 0, AddressMode::Clamp)
        };
        let handle = rig.object(
            d,
            &(0u32..12).flat_map(u32::to_le_bytes).collect::<Vec<_>>(),
        );
        let load =
            |oob: &str| format!("suld.b.a2d.b32.{oob} {{%r6}}, [%rd1, {{%r2, %r3, %r4, %r4}}];");
        // Layer 2, x 4 bytes, row 1: element 11; layer 3 is past the layers.
        let at = [[2, 4, 1, 0], [3, 4, 1, 0]];
        let got = rig.run(&load("zero"), handle, &at).unwrap();
        assert_eq!([got[0][0], got[1][0]], [11, 0]);
        let got = rig.run(&load("clamp"), handle, &at).unwrap();
        assert_eq!([got[0][0], got[1][0]], [11, 11]);
        let err = rig.run(&load("trap"), handle, &at[1..]).unwrap_err();
        assert_eq!(err.cuda_status(), 700, "{err}");
    }

    #[test]
    fn mipmapped_textures_pick_and_blend_levels_by_level_of_detail() {
        let mut rig = Rig::new();
        // Levels 4x4, 2x2, 1x1: texel i of level l holds 100 l + i.
        let level = |l: u32| -> Vec<u8> {
            let n = 4 >> l;
            (0..n * n)
                .flat_map(|i| ((100 * l + i) as f32).to_le_bytes())
                .collect()
        };
        let mut levels = Vec::new();
        for l in 0..3u32 {
            let n = 4 >> l;
            let d = Descriptor {
                base: rig.put(&level(l)),
                extent: [n, n, 1],
                pitch: u64::from(n) * 4,
                slice: u64::from(n * n) * 4,
                ..f32_desc(4, 4, FLAG_NORMALIZED, AddressMode::Clamp)
            };
            levels.push(d);
        }
        let object = |rig: &mut Rig, mip: Mip| -> u64 {
            let mut b = Descriptor { mip, ..levels[0] }.encode().to_vec();
            for l in &levels[1..] {
                b.extend(Descriptor::encode_level(l));
            }
            rig.put(&b)
        };
        let nearest = Mip {
            levels: 3,
            max: 8.0,
            ..Mip::NONE
        };
        let handle = object(&mut rig, nearest);
        // (0.6, 0.8): texel (2, 3) of level 0 = 14, (1, 1) of level 1 = 103, level 2's = 200.
        let at = |lod: f32| [0.6f32.to_bits(), 0.8f32.to_bits(), lod.to_bits(), 0];
        let op = "tex.level.2d.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3}], %r4;";
        let lods = [0.0f32, 0.49, 0.5, 1.4, 1.6, 9.0, -3.0, f32::NAN];
        let got = rig.run(op, handle, &lods.map(at)).unwrap();
        let red: Vec<f32> = got.iter().map(|g| f32::from_bits(g[0])).collect();
        assert_eq!(red, [14.0, 14.0, 103.0, 103.0, 200.0, 200.0, 14.0, 14.0]);
        // Without .level: the bias alone, clamped to the descriptor's range.
        let biased = object(
            &mut rig,
            Mip {
                bias: 1.0,
                ..nearest
            },
        );
        let got = rig.run(TEX2D, biased, &[at(0.0)]).unwrap();
        assert_eq!(f32::from_bits(got[0][0]), 103.0);
        let capped = object(
            &mut rig,
            Mip {
                bias: 2.0,
                max: 0.4,
                ..nearest
            },
        );
        let got = rig.run(TEX2D, capped, &[at(0.0)]).unwrap();
        assert_eq!(f32::from_bits(got[0][0]), 14.0);
        // Linear between levels: (1 - f) L[l] + f L[l + 1].
        let linear = object(
            &mut rig,
            Mip {
                linear: true,
                ..nearest
            },
        );
        let got = rig.run(op, linear, &[at(0.25), at(1.5), at(2.0)]).unwrap();
        let red: Vec<f32> = got.iter().map(|g| f32::from_bits(g[0])).collect();
        assert_eq!(
            red,
            [0.75 * 14.0 + 0.25 * 103.0, 0.5 * 103.0 + 0.5 * 200.0, 200.0]
        );
        // Gradients: the longer of dx and dy in level-0 texels, log2 of it.
        let grad = "tex.grad.2d.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3}], \
                    {%r4, 0f00000000}, {0f00000000, %r5};";
        let g = |dx: f32, dy: f32| {
            [
                0.6f32.to_bits(),
                0.8f32.to_bits(),
                dx.to_bits(),
                dy.to_bits(),
            ]
        };
        let got = rig
            .run(
                grad,
                handle,
                &[g(0.5, 0.0), g(0.25, 1.0), g(0.0, 0.0), g(0.1, 0.2)],
            )
            .unwrap();
        let red: Vec<f32> = got.iter().map(|g| f32::from_bits(g[0])).collect();
        // 2 texels: level 1; 4: level 2; none: level 0; 0.8 texels: lod -0.32, level 0.
        assert_eq!(red, [103.0, 200.0, 14.0, 14.0]);
        // A level record that lies: a fault of the context.
        let mut b = Descriptor {
            mip: nearest,
            ..levels[0]
        }
        .encode()
        .to_vec();
        b.extend(Descriptor::encode_level(&Descriptor {
            pitch: 1,
            ..levels[1]
        }));
        b.extend(Descriptor::encode_level(&levels[2]));
        let bad = rig.put(&b);
        assert_eq!(rig.run(op, bad, &[at(1.0)]).unwrap_err().cuda_status(), 700);
    }

    #[test]
    fn txq_and_suq_answer_from_the_descriptor() {
        let mut rig = Rig::new();
        let d = Descriptor {
            flags: FLAG_LAYERED | FLAG_LINEAR | FLAG_NORMALIZED,
            extent: [4, 2, 3],
            slice: 32,
            address: [AddressMode::Wrap, AddressMode::Mirror, AddressMode::Border],
            ..f32_desc(4, 2, 0, AddressMode::Clamp)
        };
        let tex = rig.object(d, &[0; 96]);
        let queries = [
            ("width", 4),
            ("height", 2),
            ("depth", 1),
            ("array_size", 3),
            ("num_mipmap_levels", 1),
            ("normalized_coords", 1),
            ("filter_mode", 1),
            ("addr_mode_0", 0),
            ("addr_mode_1", 2),
            ("addr_mode_2", 3),
        ];
        for (q, want) in queries {
            let op = format!("txq.{q}.b32 %r6, [%rd1];");
            assert_eq!(rig.run(&op, tex, &[[0; 4]]).unwrap()[0][0], want, "{q}");
        }
        let surf = rig.object(
            Descriptor {
                surface: true,
                flags: 0,
                ..d
            },
            &[0; 96],
        );
        let got = rig
            .run("suq.depth.b32 %r6, [%rd1];", surf, &[[0; 4]])
            .unwrap();
        assert_eq!(got[0][0], 3, "a 3D surface's depth");
        for refused in [
            "suq.filter_mode.b32",
            "txq.channel_order.b32",
            "txq.width.b64",
        ] {
            let op = format!("{refused} %r6, [%rd1];");
            assert!(rig.run(&op, tex, &[[0; 4]]).is_err(), "{refused}");
        }
        // A surface is no texture.
        let err = rig
            .run("txq.width.b32 %r6, [%rd1];", surf, &[[0; 4]])
            .unwrap_err();
        assert_eq!(err.cuda_status(), 700);
    }

    #[test]
    fn integer_texels_read_as_elements_or_normalised_floats_and_srgb() {
        let mut rig = Rig::new();
        let texels = [0u8, 64, 128, 255, 200, 100, 50, 25];
        let mut d = Descriptor {
            format: Format::U8,
            channels: 4,
            pitch: 8,
            slice: 8,
            extent: [2, 1, 1],
            ..f32_desc(2, 1, 0, AddressMode::Clamp)
        };
        let at = |x: f32| [x.to_bits(), 0.5f32.to_bits(), 0, 0];
        let int = rig.object(d, &texels);
        let op = "tex.2d.v4.u32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3}];";
        assert_eq!(rig.run(op, int, &[at(1.5)]).unwrap()[0], [200, 100, 50, 25]);
        d.flags = FLAG_READ_NORMALIZED;
        let norm = rig.object(d, &texels);
        let got = rig.run(TEX2D, norm, &[at(0.5)]).unwrap()[0].map(f32::from_bits);
        assert_eq!(got, [0.0, 64.0 / 255.0, 128.0 / 255.0, 1.0]);
        d.flags = FLAG_READ_NORMALIZED | FLAG_SRGB;
        let srgb = rig.object(d, &texels);
        let got = rig.run(TEX2D, srgb, &[at(0.5)]).unwrap()[0].map(f32::from_bits);
        assert_eq!(got[1], srgb_to_linear(64.0 / 255.0));
        assert_eq!(got[3], 1.0, "alpha is not sRGB-encoded");
        // Signed 16-bit: -32768 reads as -1, not below.
        d.format = Format::S16;
        d.channels = 2;
        d.flags = FLAG_READ_NORMALIZED;
        let s16 = rig.object(d, &[0x00, 0x80, 0xff, 0x7f, 0, 0, 0, 0]);
        let got = rig.run(TEX2D, s16, &[at(0.5)]).unwrap()[0].map(f32::from_bits);
        assert_eq!(got, [-1.0, 1.0, 0.0, 1.0]);
        // Half floats widen exactly.
        d.format = Format::F16;
        d.flags = 0;
        let h = rig.object(d, &[0x00, 0x3c, 0x01, 0x00, 0, 0xfc, 0, 0]);
        let got = rig.run(TEX2D, h, &[at(0.5)]).unwrap()[0].map(f32::from_bits);
        assert_eq!(got[..2], [1.0, 2f32.powi(-24)]);
    }

    #[test]
    fn layered_3d_and_cubemap_fetches_pick_their_texels() {
        let mut rig = Rig::new();
        let n = 4u32;
        let t: Vec<f32> = (0..n * n * 6).map(|i| i as f32).collect();
        let texels: Vec<u8> = t.iter().flat_map(|v| v.to_le_bytes()).collect();
        let base = Descriptor {
            extent: [n, n, 6],
            pitch: u64::from(n) * 4,
            slice: u64::from(n * n) * 4,
            ..f32_desc(n, n, 0, AddressMode::Clamp)
        };
        let f = |v: f32| v.to_bits();
        // 3D: texel (1, 2, 3).
        let vol = rig.object(base, &texels);
        let op = "tex.3d.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3, %r4, %r5}];";
        let got = rig.run(op, vol, &[[f(1.5), f(2.5), f(3.5), 0]]).unwrap();
        assert_eq!(f32::from_bits(got[0][0]), t[(3 * 16 + 2 * 4 + 1) as usize]);
        // Layered 2D: layer 5 (and 9 clamps to 5), texel (3, 0).
        let layered = rig.object(
            Descriptor {
                flags: FLAG_LAYERED,
                ..base
            },
            &texels,
        );
        let op = "tex.a2d.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3, %r4, %r4}];";
        let got = rig
            .run(
                op,
                layered,
                &[[5, f(3.5), f(0.5), 0], [9, f(3.5), f(0.5), 0]],
            )
            .unwrap();
        assert_eq!(f32::from_bits(got[0][0]), t[5 * 16 + 3]);
        assert_eq!(got[0], got[1]);
        // Cubemap: +x face (0) centre row; -z face (5).
        let cube = rig.object(
            Descriptor {
                flags: FLAG_CUBEMAP,
                ..base
            },
            &texels,
        );
        let op = "tex.cube.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3, %r4, %r5}];";
        let got = rig
            .run(
                op,
                cube,
                &[[f(1.0), f(0.1), f(0.6), 0], [f(0.3), f(-0.2), f(-1.0), 0]],
            )
            .unwrap();
        for (g, (x, y, z)) in got
            .iter()
            .zip([(1.0f32, 0.1f32, 0.6f32), (0.3, -0.2, -1.0)])
        {
            let (face, s, tt) = cube_face(x, y, z);
            let (i, j) = ((s * 4.0).floor() as u32, (tt * 4.0).floor() as u32);
            assert_eq!(
                f32::from_bits(g[0]),
                t[(face * 16 + j.min(3) * 4 + i.min(3)) as usize]
            );
        }
        assert_eq!(cube_face(1.0, 0.1, 0.6).0, 0);
        assert_eq!(cube_face(0.3, -0.2, -1.0).0, 5);
        // A 2D fetch of a cubemap is refused, as a fault of the context.
        let err = rig.run(TEX2D, cube, &[[0; 4]]).unwrap_err();
        assert_eq!(err.cuda_status(), 700, "{err}");
    }

    #[test]
    fn surfaces_load_and_store_bytes_with_each_out_of_range_mode() {
        let mut rig = Rig::new();
        let d = Descriptor {
            surface: true,
            format: Format::U32,
            ..f32_desc(4, 2, 0, AddressMode::Clamp)
        };
        let handle = rig.object(d, &(0u32..8).flat_map(u32::to_le_bytes).collect::<Vec<_>>());
        let store = "add.u32 %r10, %r4, 100;\nsust.b.2d.b32.trap [%rd1, {%r2, %r3}], {%r10};\n\
                     suld.b.2d.b32.trap {%r6}, [%rd1, {%r2, %r3}];";
        let got = rig.run(store, handle, &[[12, 1, 5, 0]]).unwrap();
        assert_eq!(got[0][0], 105);
        let load = |oob: &str| format!("suld.b.2d.b32.{oob} {{%r6}}, [%rd1, {{%r2, %r3}}];");
        // (x 16 bytes, row 0) is past the row: zero reads 0, clamp the row's last element.
        let past = [[16, 0, 0, 0], [0u32.wrapping_sub(4), 1, 0, 0]];
        assert_eq!(rig.run(&load("zero"), handle, &past).unwrap()[0][0], 0);
        let got = rig.run(&load("clamp"), handle, &past).unwrap();
        assert_eq!([got[0][0], got[1][0]], [3, 4]);
        // A texture handle is not a surface.
        let tex = rig.object(
            Descriptor {
                surface: false,
                ..d
            },
            &[0; 32],
        );
        assert_eq!(
            rig.run(&load("trap"), tex, &[[0; 4]])
                .unwrap_err()
                .cuda_status(),
            700
        );
        let mut rig = Rig::new();
        let handle = rig.object(d, &[0; 32]);
        let err = rig.run(&load("trap"), handle, &past).unwrap_err();
        assert_eq!(err.cuda_status(), 700, "{err}");
    }

    #[test]
    fn bad_handles_and_descriptors_are_faults_of_the_context_never_host_accesses() {
        for (name, mangle) in [
            ("nowhere", None),
            ("zero extent", Some((12usize, 0u8))),
            ("unknown format", Some((4, 0x33))),
            ("three channels", Some((5, 3))),
            ("unknown address mode", Some((8, 9))),
        ] {
            let mut rig = Rig::new();
            let d = f32_desc(2, 2, 0, AddressMode::Clamp);
            let mut handle = rig.object(d, &[0; 16]);
            match mangle {
                None => handle = 0xdead_0000,
                Some((at, v)) => {
                    let mut b = Descriptor { base: d.base, ..d }.encode();
                    let mut real = [0u8; DESCRIPTOR_BYTES];
                    rig.be
                        .copy_dtoh(rig.ctx, &mut real, handle, DEFAULT_STREAM)
                        .unwrap();
                    b.copy_from_slice(&real);
                    b[at] = v;
                    if at == 12 {
                        b[13..16].fill(0);
                    }
                    rig.be
                        .copy_htod(rig.ctx, handle, &b, DEFAULT_STREAM)
                        .unwrap();
                }
            }
            let err = rig.run(TEX2D, handle, &[[0; 4]]).unwrap_err();
            assert_eq!(err.cuda_status(), 700, "{name}: {err}");
        }
        // A descriptor whose texels lie past its memory: the texel read faults.
        let mut rig = Rig::new();
        let mut d = f32_desc(64, 64, 0, AddressMode::Clamp);
        d.base = rig.put(&[0; 16]);
        let handle = rig.put(&d.encode());
        let far = [63.5f32.to_bits(), 63.5f32.to_bits(), 0, 0];
        assert_eq!(
            rig.run(TEX2D, handle, &[far]).unwrap_err().cuda_status(),
            700
        );
    }

    #[test]
    fn descriptors_that_overflow_or_mix_filters_are_invalid() {
        let d = f32_desc(4, 4, 0, AddressMode::Clamp);
        assert!(d.validate().is_ok());
        for bad in [
            Descriptor {
                extent: [MAX_EXTENT + 1, 1, 1],
                ..d
            },
            Descriptor { pitch: 8, ..d },
            Descriptor {
                base: u64::MAX - 8,
                ..d
            },
            Descriptor {
                extent: [4, 4, 2],
                slice: 8,
                ..d
            },
            Descriptor {
                format: Format::U32,
                flags: FLAG_LINEAR,
                ..d
            },
            Descriptor {
                format: Format::S32,
                flags: FLAG_READ_NORMALIZED,
                ..d
            },
            Descriptor {
                flags: FLAG_CUBEMAP,
                ..d
            },
            Descriptor { flags: 0x80, ..d },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_descriptor_rewritten_at_the_same_handle_is_read_anew() {
        let mut rig = Rig::new();
        let texels = [1f32, 2.0, 3.0, 4.0].map(f32::to_le_bytes).concat();
        let d = f32_desc(2, 2, 0, AddressMode::Clamp);
        let handle = rig.object(d, &texels);
        let at = [[1.5f32.to_bits(), 0.5f32.to_bits(), 0, 0]];
        let first = rig.run(TEX2D, handle, &at).unwrap()[0][0];
        assert_eq!(f32::from_bits(first), 2.0);
        let mut real = [0u8; DESCRIPTOR_BYTES];
        rig.be
            .copy_dtoh(rig.ctx, &mut real, handle, DEFAULT_STREAM)
            .unwrap();
        // The same handle now describes the texture as one row of 4: (1.5, 0.5) is texel 1
        // still, (3.5, 0.5) texel 3, which the 2 x 2 texture clamped to texel 1.
        let base = le64(&real, 24);
        let row = Descriptor {
            base,
            ..f32_desc(4, 1, 0, AddressMode::Clamp)
        };
        rig.be
            .copy_htod(rig.ctx, handle, &row.encode(), DEFAULT_STREAM)
            .unwrap();
        let far = [[3.5f32.to_bits(), 0.5f32.to_bits(), 0, 0]];
        assert_eq!(
            f32::from_bits(rig.run(TEX2D, handle, &far).unwrap()[0][0]),
            4.0
        );
        rig.be
            .copy_htod(rig.ctx, handle, &real, DEFAULT_STREAM)
            .unwrap();
        assert_eq!(rig.run(TEX2D, handle, &at).unwrap()[0][0], first);
        // And a corrupt descriptor over one fetched before is refused, not remembered.
        let mut bad = real;
        bad[5] = 3;
        rig.be
            .copy_htod(rig.ctx, handle, &bad, DEFAULT_STREAM)
            .unwrap();
        assert_eq!(rig.run(TEX2D, handle, &at).unwrap_err().cuda_status(), 700);
    }

    #[test]
    fn floor_and_round_give_the_librarys_bits() {
        let special = [
            0.0f32,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            -2.5,
            0.499_999_97,
            -0.499_999_97,
            0.3,
            -0.3,
            1.0,
            -1.0,
            8_388_607.5,
            -8_388_607.5,
            8_388_608.0,
            -8_388_609.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7fa0_0001),
            f32::from_bits(0xffc0_1234),
        ];
        // And a sweep of bit patterns (xorshift), every exponent among them.
        let mut x = 0x2545_f491u32;
        let sweep = (0..200_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f32::from_bits(x)
        });
        for v in special.into_iter().chain(sweep) {
            assert_eq!(
                floor(v).to_bits(),
                v.floor().to_bits(),
                "floor {v:e} ({:#x})",
                v.to_bits()
            );
            assert_eq!(
                round(v).to_bits(),
                v.round().to_bits(),
                "round {v:e} ({:#x})",
                v.to_bits()
            );
        }
    }

    #[test]
    fn neighbouring_texels_fault_as_read_one_by_one() {
        // Two texels of a row, the second past its memory: linear filtering and a gather
        // fault at the second texel's address, as reading them one at a time does.
        let between = [[1.0f32.to_bits(), 0.5f32.to_bits(), 0, 0]];
        let r = "tld4.r.2d.v4.f32.f32 {%r6, %r7, %r8, %r9}, [%rd1, {%r2, %r3}];";
        for op in [TEX2D, r] {
            // A fault breaks the context: a fresh one for each.
            let mut rig = Rig::new();
            let mut d = f32_desc(2, 1, FLAG_LINEAR, AddressMode::Clamp);
            d.base = rig.put(&1f32.to_le_bytes());
            let handle = rig.put(&d.encode());
            let err = rig.run(op, handle, &between).unwrap_err();
            let second = format!("texel at {:#x} ", d.base + 4);
            assert!(err.to_string().contains(&second), "{op}: {err}");
        }
        // With one texel both corners clamp to it: it alone is read.
        let mut rig = Rig::new();
        let mut d = f32_desc(1, 1, FLAG_LINEAR, AddressMode::Clamp);
        d.base = rig.put(&1f32.to_le_bytes());
        let handle = rig.put(&d.encode());
        let got = rig.run(r, handle, &between).unwrap()[0];
        assert_eq!(got, [1f32.to_bits(); 4]);
    }
}
