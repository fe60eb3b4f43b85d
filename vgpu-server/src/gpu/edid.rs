//! The EDID the device answers GET_EDID with: an EDID 1.4 base block whose preferred (and only)
//! mode is the configured scanout mode, so that a stock guest picks exactly that mode.
//!
//! Pure: a mode in, 128 bytes out. The block lists no established or standard timings and no
//! range limits, and does not claim continuous frequency, so Linux adds no inferred modes.

use log::debug;

/// Size of an EDID base block.
pub const EDID_BLOCK_SIZE: usize = 128;
/// Largest active width or height a detailed timing descriptor can carry (12-bit fields).
pub const MAX_DTD_EDGE: u32 = 4095;
/// Refresh rate the mode is described with, when the pixel clock allows it.
pub const REFRESH_HZ: u32 = 60;
/// Largest pixel clock a detailed timing descriptor can carry, in 10 kHz units (16 bits).
const MAX_PIXEL_CLOCK_10KHZ: u64 = 0xffff;
/// Horizontal blanking in the style of CVT reduced blanking: front porch, sync, back porch.
const H_FRONT: u32 = 48;
const H_SYNC: u32 = 32;
const H_BACK: u32 = 80;
/// Vertical blanking: front porch, sync, back porch (lines).
const V_FRONT: u32 = 3;
const V_SYNC: u32 = 5;
const V_BACK: u32 = 15;
/// Pixel density the physical size is derived from (a 96 dpi desktop monitor), as
/// tenths of a millimetre per pixel: 254 / 96 = 0.2646 mm.
const MM_TIMES_960_PER_PIXEL: u32 = 254;
/// Manufacturer id "VGP" (three 5-bit letters, 'A' = 1).
const MANUFACTURER: u16 = (22 << 10) | (7 << 5) | 16;
/// Product code: the virtio-gpu PCI device id.
const PRODUCT: u16 = 0x1050;
/// Year of manufacture, as years after 1990 (2026).
const YEAR_SINCE_1990: u8 = 36;
/// Name in the monitor name descriptor.
const MONITOR_NAME: &[u8] = b"vgpu";

/// Why no EDID can describe a mode.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EdidError {
    /// An edge is zero or beyond what a detailed timing descriptor can carry.
    #[error("mode {0}x{1} cannot be described by an EDID detailed timing (1..={MAX_DTD_EDGE})")]
    ModeTooLarge(u32, u32),
}

/// The timing the EDID describes for a mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Active width.
    pub width: u32,
    /// Active height.
    pub height: u32,
    /// Pixel clock in 10 kHz units.
    pub clock_10khz: u16,
    /// Horizontal total (active + blanking).
    pub htotal: u32,
    /// Vertical total (active + blanking).
    pub vtotal: u32,
}

impl Timing {
    /// The timing of a `width` x `height` mode at [`REFRESH_HZ`], or at the highest whole
    /// refresh rate the descriptor's pixel clock field allows for very large modes.
    pub fn for_mode(width: u32, height: u32) -> Result<Timing, EdidError> {
        let edge = 1..=MAX_DTD_EDGE;
        if !edge.contains(&width) || !edge.contains(&height) {
            return Err(EdidError::ModeTooLarge(width, height));
        }
        let htotal = width + H_FRONT + H_SYNC + H_BACK;
        let vtotal = height + V_FRONT + V_SYNC + V_BACK;
        let pixels_per_frame = u64::from(htotal) * u64::from(vtotal);
        let max_refresh = MAX_PIXEL_CLOCK_10KHZ * 10_000 / pixels_per_frame;
        let refresh = u64::from(REFRESH_HZ).min(max_refresh).max(1);
        // Nearest 10 kHz, within the 16-bit field (max_refresh keeps it there).
        let clock = ((pixels_per_frame * refresh + 5_000) / 10_000).clamp(1, MAX_PIXEL_CLOCK_10KHZ);
        Ok(Timing {
            width,
            height,
            clock_10khz: u16::try_from(clock).unwrap_or(u16::MAX),
            htotal,
            vtotal,
        })
    }

    /// Refresh rate in Hz, rounded to the nearest integer (as Linux computes it).
    pub fn refresh_hz(&self) -> u64 {
        let per_frame = u64::from(self.htotal) * u64::from(self.vtotal);
        (u64::from(self.clock_10khz) * 10_000 + per_frame / 2) / per_frame
    }
}

/// The EDID base block for a `width` x `height` scanout.
pub fn edid_for_mode(width: u32, height: u32) -> Result<[u8; EDID_BLOCK_SIZE], EdidError> {
    let t = Timing::for_mode(width, height)?;
    let mut e = [0u8; EDID_BLOCK_SIZE];
    e[0..8].copy_from_slice(&[0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00]);
    e[8..10].copy_from_slice(&MANUFACTURER.to_be_bytes());
    e[10..12].copy_from_slice(&PRODUCT.to_le_bytes());
    // Serial number 0, week of manufacture unknown.
    e[17] = YEAR_SINCE_1990;
    e[18] = 1; // version 1
    e[19] = 4; // revision 4
    e[20] = 0x80 | (0b010 << 4); // digital input, 8 bits per colour, interface undefined
    let (w_mm, h_mm) = (physical_mm(width), physical_mm(height));
    e[21] = u8::try_from(w_mm.div_ceil(10)).unwrap_or(u8::MAX);
    e[22] = u8::try_from(h_mm.div_ceil(10)).unwrap_or(u8::MAX);
    e[23] = 120; // gamma 2.2
    // RGB 4:4:4, sRGB default colour space, preferred timing is the native mode.
    e[24] = 0x04 | 0x02;
    chromaticity(&mut e[25..35]);
    // No established timings (35..38); no standard timings (38..54: 0x01 0x01 = unused).
    e[38..54].fill(0x01);
    detailed_timing(&mut e[54..72], &t, w_mm, h_mm);
    monitor_name(&mut e[72..90]);
    dummy_descriptor(&mut e[90..108]);
    dummy_descriptor(&mut e[108..126]);
    e[126] = 0; // no extension blocks
    e[127] = checksum_byte(&e[..127]);
    debug!(
        "EDID for {width}x{height}@{}: clock {} kHz",
        t.refresh_hz(),
        u32::from(t.clock_10khz) * 10
    );
    Ok(e)
}

/// The byte that makes the sum of `bytes` and itself 0 modulo 256.
pub fn checksum_byte(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |sum, &b| sum.wrapping_add(b))
        .wrapping_neg()
}

/// Physical size of `pixels` at 96 dpi, in millimetres (at most 4095 * 254 / 960 = 1083).
fn physical_mm(pixels: u32) -> u32 {
    (pixels * MM_TIMES_960_PER_PIXEL).div_ceil(960)
}

/// sRGB primaries and D65 white point as 10-bit binary fractions (bytes 25..35).
fn chromaticity(out: &mut [u8]) {
    // Red x/y, green x/y, blue x/y, white x/y: round(v * 1024).
    let c: [u16; 8] = [655, 338, 307, 614, 154, 61, 320, 337];
    let lo = |v: u16| (v & 0x3) as u8;
    out[0] = lo(c[0]) << 6 | lo(c[1]) << 4 | lo(c[2]) << 2 | lo(c[3]);
    out[1] = lo(c[4]) << 6 | lo(c[5]) << 4 | lo(c[6]) << 2 | lo(c[7]);
    for (o, v) in out[2..10].iter_mut().zip(c) {
        *o = (v >> 2) as u8;
    }
}

/// An 18-byte detailed timing descriptor. All fields were bounded by [`Timing::for_mode`]:
/// active edges at most 12 bits, blanking and porches fixed and small.
fn detailed_timing(d: &mut [u8], t: &Timing, w_mm: u32, h_mm: u32) {
    let hblank = H_FRONT + H_SYNC + H_BACK;
    let vblank = V_FRONT + V_SYNC + V_BACK;
    let lo8 = |v: u32| (v & 0xff) as u8;
    let hi4 = |v: u32| ((v >> 8) & 0xf) as u8;
    d[0..2].copy_from_slice(&t.clock_10khz.to_le_bytes());
    d[2] = lo8(t.width);
    d[3] = lo8(hblank);
    d[4] = hi4(t.width) << 4 | hi4(hblank);
    d[5] = lo8(t.height);
    d[6] = lo8(vblank);
    d[7] = hi4(t.height) << 4 | hi4(vblank);
    d[8] = lo8(H_FRONT);
    d[9] = lo8(H_SYNC);
    d[10] = ((V_FRONT & 0xf) << 4 | (V_SYNC & 0xf)) as u8;
    d[11] = (((H_FRONT >> 8) & 0x3) << 6
        | ((H_SYNC >> 8) & 0x3) << 4
        | ((V_FRONT >> 4) & 0x3) << 2
        | ((V_SYNC >> 4) & 0x3)) as u8;
    d[12] = lo8(w_mm);
    d[13] = lo8(h_mm);
    d[14] = hi4(w_mm) << 4 | hi4(h_mm);
    // No borders; non-interlaced, digital separate sync, hsync +, vsync - (as CVT-RB).
    d[17] = 0x18 | 0x02;
}

/// Display product name descriptor (tag 0xfc): up to 13 bytes, ended by 0x0a, padded with
/// spaces.
fn monitor_name(d: &mut [u8]) {
    d[3] = 0xfc;
    let text = &mut d[5..18];
    text.fill(b' ');
    text[..MONITOR_NAME.len()].copy_from_slice(MONITOR_NAME);
    text[MONITOR_NAME.len()] = 0x0a;
}

/// Dummy descriptor (tag 0x10).
fn dummy_descriptor(d: &mut [u8]) {
    d.fill(0);
    d[3] = 0x10;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes the first detailed timing descriptor: (width, height, clock 10 kHz, htotal,
    /// vtotal).
    fn dtd(e: &[u8; EDID_BLOCK_SIZE]) -> (u32, u32, u32, u32, u32) {
        let d = &e[54..72];
        let w = u32::from(d[2]) | u32::from(d[4] >> 4) << 8;
        let hb = u32::from(d[3]) | u32::from(d[4] & 0xf) << 8;
        let h = u32::from(d[5]) | u32::from(d[7] >> 4) << 8;
        let vb = u32::from(d[6]) | u32::from(d[7] & 0xf) << 8;
        let clock = u32::from(u16::from_le_bytes([d[0], d[1]]));
        (w, h, clock, w + hb, h + vb)
    }

    #[test]
    fn block_is_valid_edid_1_4_with_the_mode() {
        for (w, h) in [(1024, 768), (1280, 800), (640, 480), (1920, 1080), (16, 16)] {
            let e = edid_for_mode(w, h).unwrap();
            assert_eq!(&e[..8], &[0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0]);
            assert_eq!(e.iter().fold(0u8, |s, &b| s.wrapping_add(b)), 0, "checksum");
            assert_eq!((e[18], e[19]), (1, 4), "EDID 1.4");
            assert_eq!(e[126], 0, "no extensions");
            assert_eq!(&e[35..38], &[0, 0, 0], "no established timings");
            assert!(e[38..54].iter().all(|&b| b == 1), "no standard timings");
            assert_eq!(
                e[24] & 0x01,
                0,
                "no continuous frequency: no inferred modes"
            );
            assert_ne!(u16::from_le_bytes([e[54], e[55]]), 0, "first is a timing");
            let (dw, dh, clock, htotal, vtotal) = dtd(&e);
            assert_eq!((dw, dh), (w, h));
            let refresh = (u64::from(clock) * 10_000 + u64::from(htotal * vtotal) / 2)
                / u64::from(htotal * vtotal);
            assert_eq!(refresh, 60, "{w}x{h}");
            // The other descriptors are not timings.
            for at in [72, 90, 108] {
                assert_eq!(&e[at..at + 3], &[0, 0, 0]);
            }
            assert_eq!(e[75], 0xfc);
            assert_eq!(&e[77..82], b"vgpu\n");
            assert!(e[21] > 0 && e[22] > 0, "physical size");
        }
    }

    #[test]
    fn large_modes_lower_the_refresh_and_huge_ones_are_refused() {
        let t = Timing::for_mode(4095, 4095).unwrap();
        assert!(t.refresh_hz() >= 30 && t.refresh_hz() < 60, "{t:?}");
        let e = edid_for_mode(3840, 2160).unwrap();
        let (w, h, ..) = dtd(&e);
        assert_eq!((w, h), (3840, 2160));
        assert_eq!(
            edid_for_mode(4096, 768),
            Err(EdidError::ModeTooLarge(4096, 768))
        );
        assert!(edid_for_mode(0, 768).is_err());
    }

    #[test]
    fn checksum_byte_completes_the_sum() {
        assert_eq!(checksum_byte(&[]), 0);
        assert_eq!(checksum_byte(&[1]), 0xff);
        assert_eq!(checksum_byte(&[0x80, 0x80]), 0);
    }
}
