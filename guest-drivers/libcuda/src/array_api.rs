//! The C entry points of arrays, pitched memory, 2D/3D copies, 2D memsets and texture and
//! surface objects (see [`crate::array`] for the layouts and checks). Host sides of copies
//! are read and written here; device sides go to the host as the driver's ordinary copy and
//! memset requests, which it batches; arrays are device memory of their context.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::sync::Mutex;

use mdev_backend::compute::ptx::texture::Descriptor;

use crate::api::{
    CUresult, Handle, bytes, bytes_mut, current, entry, finish, owner, put, trace, unsupported,
    with,
};
use crate::array::*;
use crate::driver::CuResult;
use crate::status::*;

/// Arrays a process may hold (each an entry of this library's table).
const MAX_ARRAYS: usize = 65_536;
/// Texture and surface objects a process may hold (each a descriptor in device memory).
const MAX_OBJECTS: usize = 65_536;
/// Where array handles start (any non-NULL value would do; these never look like a host or
/// device address).
const ARRAY_HANDLE_BASE: u64 = 0x00a7_0000_0000_0000;

/// An array: its context, device memory and shape.
#[derive(Debug, Clone, Copy)]
struct Array {
    ctx: u64,
    addr: u64,
    desc: ArrayDesc,
    /// A level of a mipmapped array, destroyed with it only.
    level: bool,
}

/// A mipmapped array: its context and its levels' arrays, level 0 first.
#[derive(Debug, Clone)]
struct Mipmapped {
    ctx: u64,
    levels: Vec<u64>,
}

/// A texture or surface object: its context and what it was created from.
#[derive(Debug, Clone, Copy)]
struct Object {
    ctx: u64,
    surface: bool,
    resource: [u8; RESOURCE_DESC_BYTES],
    texture: [u8; TEXTURE_DESC_BYTES],
}

#[derive(Default)]
struct State {
    arrays: HashMap<u64, Array>,
    objects: HashMap<u64, Object>,
    mipmapped: HashMap<u64, Mipmapped>,
    next: u64,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state<R>(f: impl FnOnce(&mut State) -> CuResult<R>) -> CuResult<R> {
    let mut g = STATE.lock().unwrap_or_else(|p| p.into_inner());
    f(g.get_or_insert_with(State::default))
}

/// The array `h` of context `ctx`.
fn array(ctx: u64, h: u64) -> CuResult<Array> {
    state(|s| match s.arrays.get(&h) {
        Some(a) if a.ctx == ctx => Ok(*a),
        Some(_) => Err(CUDA_ERROR_INVALID_CONTEXT),
        None => Err(CUDA_ERROR_INVALID_HANDLE),
    })
}

/// A caller's structure of `n` bytes.
fn structure<'a>(p: *const c_void, n: usize) -> CuResult<&'a [u8]> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    bytes(p, n)
}

// Arrays.

/// A new array of `ctx` (a level of a mipmapped array with `level`): its handle.
fn new_array(ctx: u64, desc: ArrayDesc, level: bool) -> CuResult<u64> {
    state(|s| {
        if s.arrays.len() >= MAX_ARRAYS {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(())
    })?;
    let addr = with(|d| d.mem_alloc(ctx, desc.bytes()))?;
    state(|s| {
        let h = next_handle(s);
        let a = Array {
            ctx,
            addr,
            desc,
            level,
        };
        s.arrays.insert(h, a);
        Ok(h)
    })
}

/// A handle no array or mipmapped array has.
fn next_handle(s: &mut State) -> u64 {
    s.next += 1;
    ARRAY_HANDLE_BASE + s.next
}

fn array_create(out: *mut u64, desc: CuResult<ArrayDesc>) -> CuResult<()> {
    let desc = desc?;
    let ctx = current()?;
    put(out, new_array(ctx, desc, false)?)
}

/// Frees arrays taken out of the table; the first failure is the result.
fn free_arrays(arrays: &[Array]) -> CuResult<()> {
    let mut r = Ok(());
    for a in arrays {
        let freed = with(|d| d.mem_free(a.ctx, a.addr));
        r = r.and(freed);
    }
    r
}

entry!(cuArrayCreate_v2 | cuArrayCreate(out: *mut u64, desc: *const c_void) {
    array_create(out, structure(desc, ARRAY_DESCRIPTOR_BYTES).and_then(ArrayDesc::from_2d))
});

entry!(cuArray3DCreate_v2 | cuArray3DCreate(out: *mut u64, desc: *const c_void) {
    array_create(out, structure(desc, ARRAY3D_DESCRIPTOR_BYTES).and_then(ArrayDesc::from_3d))
});

entry!(cuArrayDestroy(h: u64) {
    let a = state(|s| match s.arrays.get(&h) {
        Some(a) if a.level => Err(CUDA_ERROR_INVALID_VALUE),
        Some(_) => Ok(s.arrays.remove(&h).expect("present")),
        None => Err(CUDA_ERROR_INVALID_HANDLE),
    })?;
    free_arrays(&[a])
});

fn any_array(h: u64) -> CuResult<ArrayDesc> {
    state(|s| {
        s.arrays
            .get(&h)
            .map(|a| a.desc)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

entry!(cuArrayGetDescriptor_v2 | cuArrayGetDescriptor(out: *mut [u8; ARRAY_DESCRIPTOR_BYTES], h: u64) {
    let a = any_array(h)?;
    if a.depth != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    put(out, a.to_2d())
});

entry!(cuArray3DGetDescriptor_v2 | cuArray3DGetDescriptor(out: *mut [u8; ARRAY3D_DESCRIPTOR_BYTES], h: u64) {
    put(out, any_array(h)?.to_3d())
});

entry!(cuMipmappedArrayCreate(out: *mut u64, desc: *const c_void, levels: c_uint) {
    let desc = ArrayDesc::from_3d(structure(desc, ARRAY3D_DESCRIPTOR_BYTES)?)?;
    if levels == 0 || levels > desc.max_levels() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = current()?;
    let mut made = Vec::new();
    for l in 0..levels {
        match new_array(ctx, desc.level(l), true) {
            Ok(h) => made.push(h),
            Err(e) => {
                let taken = state(|s| Ok(made.iter().filter_map(|h| s.arrays.remove(h)).collect::<Vec<_>>()))?;
                let _ = free_arrays(&taken);
                return Err(e);
            }
        }
    }
    let h = state(|s| {
        let h = next_handle(s);
        s.mipmapped.insert(h, Mipmapped { ctx, levels: made });
        Ok(h)
    })?;
    put(out, h)
});

entry!(cuMipmappedArrayGetLevel(out: *mut u64, h: u64, level: c_uint) {
    let m = state(|s| s.mipmapped.get(&h).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE))?;
    let l = m.levels.get(level as usize).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    put(out, *l)
});

entry!(cuMipmappedArrayDestroy(h: u64) {
    let taken = state(|s| {
        let m = s.mipmapped.remove(&h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        Ok(m.levels.iter().filter_map(|l| s.arrays.remove(l)).collect::<Vec<_>>())
    })?;
    free_arrays(&taken)
});

// Pitched memory.

entry!(cuMemAllocPitch_v2 | cuMemAllocPitch(
    dptr: *mut u64,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: c_uint,
) {
    if !matches!(elem, 4 | 8 | 16) || width == 0 || height == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bad = CUDA_ERROR_INVALID_VALUE;
    let p = (width as u64).checked_next_multiple_of(PITCH_ALIGN).ok_or(bad)?;
    let total = p.checked_mul(height as u64).ok_or(bad)?;
    let ctx = current()?;
    let a = with(|d| d.mem_alloc(ctx, total))?;
    put(pitch, p as usize)?;
    put(dptr, a)
});

// Copies.

/// One resolved side of a copy.
#[derive(Debug, Clone, Copy)]
enum Where {
    Host(Linear),
    Device(Linear),
}

/// Where a side's rows are, checked against its array or device allocation.
fn resolve(ctx: u64, side: &Side, c: &Copy3D) -> CuResult<Where> {
    let (w, h, dep) = (c.width, c.height, c.depth);
    let linear = |base| Linear::of(base, side, side.pitch, side.height, w, h, dep);
    let device = |base: u64| -> CuResult<Where> {
        let (l, span) = linear(base)?;
        if !with(|d| Ok(d.is_device(ctx, l.start, span)))? {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(Where::Device(l))
    };
    match side.memory {
        Memory::Host(p) => Ok(Where::Host(linear(p)?.0)),
        Memory::Device(p) => device(p),
        Memory::Unified(p) => {
            let (l, span) = linear(p)?;
            if with(|d| Ok(d.is_device(ctx, l.start, span)))? {
                Ok(Where::Device(l))
            } else {
                Ok(Where::Host(l))
            }
        }
        Memory::Array(handle) => {
            let a = array(ctx, handle)?;
            check_in_array(&a.desc, side, w, h, dep)?;
            let (l, _) = Linear::of(a.addr, side, a.desc.pitch(), a.desc.rows(), w, h, dep)?;
            Ok(Where::Device(l))
        }
    }
}

/// Checks both sides of a copy as [`copy`] does before it moves anything (a graph's copy
/// node, when it is made).
pub(crate) fn check_copy(ctx: u64, c: &Copy3D) -> CuResult<()> {
    if c.width == 0 || c.height == 0 || c.depth == 0 {
        return Ok(());
    }
    resolve(ctx, &c.src, c)?;
    resolve(ctx, &c.dst, c).map(drop)
}

/// A 2D/3D copy on `stream` (the NULL stream for the synchronous calls); a node of the
/// stream's capture while it captures.
pub(crate) fn copy(c: Copy3D, stream: Handle) -> CuResult<()> {
    if crate::api::record_in_capture(stream, || crate::graph::Op::Copy { copy: c })? {
        return Ok(());
    }
    let ctx = owner(stream)?;
    // An empty copy moves nothing, as the driver's.
    if c.width == 0 || c.height == 0 || c.depth == 0 {
        return Ok(());
    }
    let (src, dst) = (resolve(ctx, &c.src, &c)?, resolve(ctx, &c.dst, &c)?);
    let (s, d) = match (src, dst) {
        (Where::Host(s) | Where::Device(s), Where::Host(d) | Where::Device(d)) => (s, d),
    };
    let runs = runs(&s, &d, c.width, c.height, c.depth);
    let st = stream as u64;
    match (src, dst) {
        (Where::Host(s), Where::Device(d)) => {
            for (so, doff, n) in runs {
                let data = bytes((s.start + so) as *const c_void, n as usize)?;
                with(|dr| dr.copy_htod(ctx, d.start + doff, data, st))?;
            }
            Ok(())
        }
        (Where::Device(s), Where::Host(d)) => {
            // One read of the span the rows lie in (checked inside one allocation).
            let last = runs.last().map_or(0, |&(so, _, n)| so + n);
            let mut buf = vec![0u8; usize::try_from(last).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?];
            with(|dr| dr.copy_dtoh(ctx, &mut buf, s.start, st))?;
            for (so, doff, n) in runs {
                bytes_mut((d.start + doff) as *mut c_void, n as usize)?
                    .copy_from_slice(&buf[so as usize..(so + n) as usize]);
            }
            Ok(())
        }
        (Where::Device(s), Where::Device(d)) => {
            for (so, doff, n) in runs {
                with(|dr| dr.copy_dtod(ctx, d.start + doff, s.start + so, n, st))?;
            }
            Ok(())
        }
        (Where::Host(s), Where::Host(d)) => {
            for (so, doff, n) in runs {
                let row = bytes((s.start + so) as *const c_void, n as usize)?.to_vec();
                bytes_mut((d.start + doff) as *mut c_void, n as usize)?.copy_from_slice(&row);
            }
            Ok(())
        }
    }
}

fn copy_2d(p: *const c_void, stream: Handle) -> CuResult<()> {
    copy(Copy3D::from_2d(structure(p, MEMCPY2D_BYTES)?)?, stream)
}

fn copy_3d(p: *const c_void, stream: Handle) -> CuResult<()> {
    copy(Copy3D::from_3d(structure(p, MEMCPY3D_BYTES)?)?, stream)
}

entry!(cuMemcpy2D_v2 | cuMemcpy2D(p: *const c_void) { copy_2d(p, std::ptr::null_mut()) });
entry!(cuMemcpy2DUnaligned_v2 | cuMemcpy2DUnaligned(p: *const c_void) { copy_2d(p, std::ptr::null_mut()) });
entry!(cuMemcpy2DAsync_v2 | cuMemcpy2DAsync(p: *const c_void, stream: Handle) { copy_2d(p, stream) });
entry!(cuMemcpy3D_v2 | cuMemcpy3D(p: *const c_void) { copy_3d(p, std::ptr::null_mut()) });
entry!(cuMemcpy3DAsync_v2 | cuMemcpy3DAsync(p: *const c_void, stream: Handle) { copy_3d(p, stream) });

/// A 1D copy of `n` bytes at byte offsets of arrays (whose bytes are their rows, in order)
/// or of host or device memory.
fn copy_bytes(
    dst: Memory,
    dst_off: usize,
    src: Memory,
    src_off: usize,
    n: usize,
    stream: Handle,
) -> CuResult<()> {
    let ctx = owner(stream)?;
    let side = |m: Memory, off: usize| -> CuResult<Side> {
        let off = off as u64;
        let memory = match m {
            Memory::Array(h) => {
                let a = array(ctx, h)?;
                let end = off.checked_add(n as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
                if end > a.desc.bytes() {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                Memory::Device(a.addr + off)
            }
            Memory::Host(p) => Memory::Host(p.checked_add(off).ok_or(CUDA_ERROR_INVALID_VALUE)?),
            Memory::Device(p) | Memory::Unified(p) => {
                Memory::Device(p.checked_add(off).ok_or(CUDA_ERROR_INVALID_VALUE)?)
            }
        };
        Ok(Side {
            memory,
            x: 0,
            y: 0,
            z: 0,
            pitch: 0,
            height: 0,
        })
    };
    let c = Copy3D {
        src: side(src, src_off)?,
        dst: side(dst, dst_off)?,
        width: n as u64,
        height: 1,
        depth: 1,
    };
    copy(c, stream)
}

entry!(cuMemcpyHtoA_v2 | cuMemcpyHtoA(dst: u64, off: usize, src: *const c_void, n: usize) {
    copy_bytes(Memory::Array(dst), off, Memory::Host(src as u64), 0, n, std::ptr::null_mut())
});
entry!(cuMemcpyHtoAAsync_v2 | cuMemcpyHtoAAsync(dst: u64, off: usize, src: *const c_void, n: usize, stream: Handle) {
    copy_bytes(Memory::Array(dst), off, Memory::Host(src as u64), 0, n, stream)
});
entry!(cuMemcpyAtoH_v2 | cuMemcpyAtoH(dst: *mut c_void, src: u64, off: usize, n: usize) {
    copy_bytes(Memory::Host(dst as u64), 0, Memory::Array(src), off, n, std::ptr::null_mut())
});
entry!(cuMemcpyAtoHAsync_v2 | cuMemcpyAtoHAsync(dst: *mut c_void, src: u64, off: usize, n: usize, stream: Handle) {
    copy_bytes(Memory::Host(dst as u64), 0, Memory::Array(src), off, n, stream)
});
entry!(cuMemcpyAtoD_v2 | cuMemcpyAtoD(dst: u64, src: u64, off: usize, n: usize) {
    copy_bytes(Memory::Device(dst), 0, Memory::Array(src), off, n, std::ptr::null_mut())
});
entry!(cuMemcpyDtoA_v2 | cuMemcpyDtoA(dst: u64, off: usize, src: u64, n: usize) {
    copy_bytes(Memory::Array(dst), off, Memory::Device(src), 0, n, std::ptr::null_mut())
});
entry!(cuMemcpyAtoA_v2 | cuMemcpyAtoA(dst: u64, dst_off: usize, src: u64, src_off: usize, n: usize) {
    copy_bytes(Memory::Array(dst), dst_off, Memory::Array(src), src_off, n, std::ptr::null_mut())
});

// Memsets of 16-bit values and of 2D ranges.

/// `count` 16-bit `value`s at `addr` (2-byte aligned): 32-bit fills for the aligned pairs,
/// 2-byte copies for an unaligned head or an odd tail.
fn memset16(ctx: u64, addr: u64, value: u16, count: u64, stream: u64) -> CuResult<()> {
    let bad = CUDA_ERROR_INVALID_VALUE;
    if addr % 2 != 0 {
        return Err(bad);
    }
    let bytes = count.checked_mul(2).ok_or(bad)?;
    if !with(|d| Ok(d.is_device(ctx, addr, bytes)))? {
        return Err(bad);
    }
    let (mut at, mut left) = (addr, count);
    let one = value.to_le_bytes();
    if left > 0 && at % 4 == 2 {
        with(|d| d.copy_htod(ctx, at, &one, stream))?;
        at += 2;
        left -= 1;
    }
    if left >= 2 {
        let pair = u32::from(value) | u32::from(value) << 16;
        with(|d| d.memset_d32(ctx, at, pair, left / 2, stream))?;
        at += left / 2 * 4;
    }
    if left % 2 == 1 {
        with(|d| d.copy_htod(ctx, at, &one, stream))?;
    }
    Ok(())
}

/// A 2D memset of `width` elements of `elem` bytes in each of `height` rows `pitch` apart.
pub(crate) fn memset_2d(
    dst: u64,
    pitch: usize,
    value: u32,
    elem: u64,
    width: usize,
    height: usize,
    stream: Handle,
) -> CuResult<()> {
    let node = || crate::graph::Op::Memset {
        dst,
        pitch,
        value,
        element_size: elem,
        width,
        height,
    };
    if crate::api::record_in_capture(stream, node)? {
        return Ok(());
    }
    let bad = CUDA_ERROR_INVALID_VALUE;
    let ctx = owner(stream)?;
    let (pitch, width, height) = (pitch as u64, width as u64, height as u64);
    let row = width.checked_mul(elem).ok_or(bad)?;
    if height > 1 && pitch < row {
        return Err(bad);
    }
    let span = height
        .checked_sub(1)
        .map_or(Some(0), |h| h.checked_mul(pitch))
        .and_then(|o| o.checked_add(row))
        .ok_or(bad)?;
    if width == 0 || height == 0 {
        return Ok(());
    }
    if !with(|d| Ok(d.is_device(ctx, dst, span)))? {
        return Err(bad);
    }
    // Contiguous rows are one fill.
    let (rows, count) = if pitch == row {
        (1, width * height)
    } else {
        (height, width)
    };
    let st = stream as u64;
    for r in 0..rows {
        let at = dst + r * pitch;
        match elem {
            1 => with(|d| d.memset_d8(ctx, at, value as u8, count, st))?,
            2 => memset16(ctx, at, value as u16, count, st)?,
            _ => with(|d| d.memset_d32(ctx, at, value, count, st))?,
        }
    }
    Ok(())
}

entry!(cuMemsetD16_v2 | cuMemsetD16(dst: u64, value: u16, n: usize) {
    let ctx = current()?;
    memset16(ctx, dst, value, n as u64, 0)
});
entry!(cuMemsetD16Async(dst: u64, value: u16, n: usize, stream: Handle) {
    memset_2d(dst, 0, u32::from(value), 2, n, 1, stream)
});
entry!(cuMemsetD2D8_v2 | cuMemsetD2D8(dst: u64, pitch: usize, value: u8, w: usize, h: usize) {
    memset_2d(dst, pitch, u32::from(value), 1, w, h, std::ptr::null_mut())
});
entry!(cuMemsetD2D16_v2 | cuMemsetD2D16(dst: u64, pitch: usize, value: u16, w: usize, h: usize) {
    memset_2d(dst, pitch, u32::from(value), 2, w, h, std::ptr::null_mut())
});
entry!(cuMemsetD2D32_v2 | cuMemsetD2D32(dst: u64, pitch: usize, value: u32, w: usize, h: usize) {
    memset_2d(dst, pitch, value, 4, w, h, std::ptr::null_mut())
});
entry!(cuMemsetD2D8Async(dst: u64, pitch: usize, value: u8, w: usize, h: usize, stream: Handle) {
    memset_2d(dst, pitch, u32::from(value), 1, w, h, stream)
});
entry!(cuMemsetD2D16Async(dst: u64, pitch: usize, value: u16, w: usize, h: usize, stream: Handle) {
    memset_2d(dst, pitch, u32::from(value), 2, w, h, stream)
});
entry!(cuMemsetD2D32Async(dst: u64, pitch: usize, value: u32, w: usize, h: usize, stream: Handle) {
    memset_2d(dst, pitch, value, 4, w, h, stream)
});

// Texture and surface objects.

/// The executor's descriptor of a resource of `ctx`, checked inside its memory, with the
/// level records of a mipmapped array's levels after the first.
fn resource(ctx: u64, r: &Resource) -> CuResult<(Descriptor, ArrayDesc, Vec<u8>)> {
    match *r {
        Resource::Array(h) => {
            let a = array(ctx, h)?;
            Ok((a.desc.resource(a.addr), a.desc, Vec::new()))
        }
        Resource::Mipmapped(h) => {
            let m = state(|s| match s.mipmapped.get(&h) {
                Some(m) if m.ctx == ctx => Ok(m.clone()),
                Some(_) => Err(CUDA_ERROR_INVALID_CONTEXT),
                None => Err(CUDA_ERROR_INVALID_HANDLE),
            })?;
            let levels = m
                .levels
                .iter()
                .map(|&l| array(ctx, l))
                .collect::<CuResult<Vec<Array>>>()?;
            let mut d = levels[0].desc.resource(levels[0].addr);
            d.mip.levels = u8::try_from(levels.len()).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
            let records = levels[1..]
                .iter()
                .flat_map(|a| Descriptor::encode_level(&a.desc.resource(a.addr)))
                .collect();
            Ok((d, levels[0].desc, records))
        }
        _ => {
            let d = r.linear()?.ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let row = u64::from(d.extent[0]) * u64::from(d.texel_bytes());
            let span = u64::from(d.extent[1] - 1) * d.pitch + row;
            if d.pitch < row || !with(|dr| Ok(dr.is_device(ctx, d.base, span)))? {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // Linear memory has no array flags.
            let none = ArrayDesc {
                width: 1,
                height: 0,
                depth: 0,
                format: d.format,
                channels: d.channels,
                flags: 0,
            };
            Ok((d, none, Vec::new()))
        }
    }
}

/// Writes a descriptor (and its level records) into new device memory of `ctx`: the
/// object's handle.
fn create_object(ctx: u64, d: &Descriptor, levels: &[u8], obj: Object) -> CuResult<u64> {
    state(|s| {
        if s.objects.len() >= MAX_OBJECTS {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(())
    })?;
    let bytes = [&d.encode()[..], levels].concat();
    let h = with(|dr| {
        let h = dr.mem_alloc(ctx, bytes.len() as u64)?;
        match dr.copy_htod(ctx, h, &bytes, 0) {
            Ok(()) => Ok(h),
            Err(e) => {
                let _ = dr.mem_free(ctx, h);
                Err(e)
            }
        }
    })?;
    state(|s| {
        s.objects.insert(h, obj);
        Ok(h)
    })
}

fn destroy_object(h: u64, surface: bool) -> CuResult<()> {
    let o = state(|s| match s.objects.get(&h) {
        Some(o) if o.surface == surface => Ok(s.objects.remove(&h).expect("present")),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    })?;
    with(|d| d.mem_free(o.ctx, h))
}

fn object(h: u64, surface: bool) -> CuResult<Object> {
    state(|s| match s.objects.get(&h) {
        Some(o) if o.surface == surface => Ok(*o),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    })
}

entry!(cuTexObjectCreate(out: *mut u64, res: *const c_void, tex: *const c_void, view: *const c_void) {
    if !view.is_null() {
        return unsupported("cuTexObjectCreate with a resource view");
    }
    let ctx = current()?;
    let rb: [u8; RESOURCE_DESC_BYTES] = structure(res, RESOURCE_DESC_BYTES)?.try_into().expect("size");
    let tb: [u8; TEXTURE_DESC_BYTES] = structure(tex, TEXTURE_DESC_BYTES)?.try_into().expect("size");
    let (mut d, _, levels) = resource(ctx, &Resource::decode(&rb)?)?;
    apply_texture_desc(&tb, &mut d)?;
    let obj = Object { ctx, surface: false, resource: rb, texture: tb };
    let h = create_object(ctx, &d, &levels, obj)?;
    put(out, h)
});

entry!(cuTexObjectDestroy(h: u64) { destroy_object(h, false) });

entry!(cuTexObjectGetResourceDesc(out: *mut [u8; RESOURCE_DESC_BYTES], h: u64) {
    put(out, object(h, false)?.resource)
});

entry!(cuTexObjectGetTextureDesc(out: *mut [u8; TEXTURE_DESC_BYTES], h: u64) {
    put(out, object(h, false)?.texture)
});

entry!(cuTexObjectGetResourceViewDesc(_out: *mut c_void, _h: u64) {
    unsupported("cuTexObjectGetResourceViewDesc (resource views)")
});

entry!(cuSurfObjectCreate(out: *mut u64, res: *const c_void) {
    let ctx = current()?;
    let rb: [u8; RESOURCE_DESC_BYTES] = structure(res, RESOURCE_DESC_BYTES)?.try_into().expect("size");
    let r = Resource::decode(&rb)?;
    // Surfaces are arrays made for surface loads and stores.
    if !matches!(r, Resource::Array(_)) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (mut d, a, _) = resource(ctx, &r)?;
    if a.flags & ARRAY_SURFACE_LDST == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    d.surface = true;
    let obj = Object { ctx, surface: true, resource: rb, texture: [0; TEXTURE_DESC_BYTES] };
    put(out, create_object(ctx, &d, &[], obj)?)
});

entry!(cuSurfObjectDestroy(h: u64) { destroy_object(h, true) });

entry!(cuSurfObjectGetResourceDesc(out: *mut [u8; RESOURCE_DESC_BYTES], h: u64) {
    put(out, object(h, true)?.resource)
});
