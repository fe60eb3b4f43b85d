//! Arrays, pitched memory, 2D/3D copies, 2D memsets and texture and surface objects through
//! the C entry points, as a C program calls them (the structures declared here as `cuda.h`
//! declares them), against a served CPU backend; results checked against host computations,
//! and what a buggy program passes refused (bad formats and handles, overflowing extents,
//! copies past either side's end). One test: the driver is process-global.

use std::ffi::{CStr, c_uint, c_void};
use std::ptr::{null, null_mut};

extern crate cuda;

mod support;

type Handle = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Array3DDesc {
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    flags: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ArrayDesc {
    width: usize,
    height: usize,
    format: c_uint,
    channels: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Memcpy2D {
    src_x: usize,
    src_y: usize,
    src_type: c_uint,
    src_host: *const c_void,
    src_device: u64,
    src_array: u64,
    src_pitch: usize,
    dst_x: usize,
    dst_y: usize,
    dst_type: c_uint,
    dst_host: *mut c_void,
    dst_device: u64,
    dst_array: u64,
    dst_pitch: usize,
    width: usize,
    height: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Memcpy3D {
    src_x: usize,
    src_y: usize,
    src_z: usize,
    src_lod: usize,
    src_type: c_uint,
    src_host: *const c_void,
    src_device: u64,
    src_array: u64,
    reserved0: *mut c_void,
    src_pitch: usize,
    src_height: usize,
    dst_x: usize,
    dst_y: usize,
    dst_z: usize,
    dst_lod: usize,
    dst_type: c_uint,
    dst_host: *mut c_void,
    dst_device: u64,
    dst_array: u64,
    reserved1: *mut c_void,
    dst_pitch: usize,
    dst_height: usize,
    width: usize,
    height: usize,
    depth: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct ResourceDesc {
    kind: c_uint,
    /// The union: `hArray` first, or `devPtr, format, numChannels, width, height, pitch`.
    res: [u64; 16],
    flags: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TextureDesc {
    address: [c_uint; 3],
    filter: c_uint,
    flags: c_uint,
    max_anisotropy: c_uint,
    mipmap_filter: c_uint,
    mipmap_bias: f32,
    min_lod: f32,
    max_lod: f32,
    border: [f32; 4],
    reserved: [i32; 12],
}

unsafe extern "C" {
    fn cuInit(flags: c_uint) -> c_uint;
    fn cuCtxCreate_v2(ctx: *mut Handle, flags: c_uint, dev: i32) -> c_uint;
    fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> c_uint;
    fn cuModuleGetFunction(f: *mut Handle, module: Handle, name: *const i8) -> c_uint;
    fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> c_uint;
    fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> c_uint;
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> c_uint;
    fn cuCtxSynchronize() -> c_uint;
    #[allow(clippy::too_many_arguments)]
    fn cuLaunchKernel(
        f: Handle,
        gx: c_uint,
        gy: c_uint,
        gz: c_uint,
        bx: c_uint,
        by: c_uint,
        bz: c_uint,
        shared: c_uint,
        stream: Handle,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> c_uint;
    fn cuArray3DCreate_v2(h: *mut u64, d: *const Array3DDesc) -> c_uint;
    fn cuArrayCreate_v2(h: *mut u64, d: *const ArrayDesc) -> c_uint;
    fn cuArray3DGetDescriptor_v2(d: *mut Array3DDesc, h: u64) -> c_uint;
    fn cuArrayGetDescriptor_v2(d: *mut ArrayDesc, h: u64) -> c_uint;
    fn cuArrayDestroy(h: u64) -> c_uint;
    fn cuMipmappedArrayCreate(h: *mut u64, d: *const Array3DDesc, levels: c_uint) -> c_uint;
    fn cuMipmappedArrayGetLevel(level: *mut u64, h: u64, l: c_uint) -> c_uint;
    fn cuMipmappedArrayDestroy(h: u64) -> c_uint;
    fn cuMemAllocPitch_v2(
        dptr: *mut u64,
        pitch: *mut usize,
        w: usize,
        h: usize,
        elem: c_uint,
    ) -> c_uint;
    fn cuMemcpy2D_v2(p: *const Memcpy2D) -> c_uint;
    fn cuMemcpy2DAsync_v2(p: *const Memcpy2D, stream: Handle) -> c_uint;
    fn cuMemcpy3D_v2(p: *const Memcpy3D) -> c_uint;
    fn cuMemcpyHtoA_v2(dst: u64, off: usize, src: *const c_void, n: usize) -> c_uint;
    fn cuMemcpyAtoH_v2(dst: *mut c_void, src: u64, off: usize, n: usize) -> c_uint;
    fn cuMemcpyAtoA_v2(dst: u64, doff: usize, src: u64, soff: usize, n: usize) -> c_uint;
    fn cuMemcpyAtoD_v2(dst: u64, src: u64, off: usize, n: usize) -> c_uint;
    fn cuMemcpyDtoA_v2(dst: u64, off: usize, src: u64, n: usize) -> c_uint;
    fn cuMemsetD16_v2(dst: u64, v: u16, n: usize) -> c_uint;
    fn cuMemsetD2D8_v2(dst: u64, pitch: usize, v: u8, w: usize, h: usize) -> c_uint;
    fn cuMemsetD2D16_v2(dst: u64, pitch: usize, v: u16, w: usize, h: usize) -> c_uint;
    fn cuMemsetD2D32_v2(dst: u64, pitch: usize, v: u32, w: usize, h: usize) -> c_uint;
    fn cuTexObjectCreate(
        t: *mut u64,
        r: *const ResourceDesc,
        d: *const TextureDesc,
        v: *const c_void,
    ) -> c_uint;
    fn cuTexObjectDestroy(t: u64) -> c_uint;
    fn cuTexObjectGetResourceDesc(r: *mut ResourceDesc, t: u64) -> c_uint;
    fn cuTexObjectGetTextureDesc(d: *mut TextureDesc, t: u64) -> c_uint;
    fn cuSurfObjectCreate(s: *mut u64, r: *const ResourceDesc) -> c_uint;
    fn cuSurfObjectDestroy(s: u64) -> c_uint;
}

const FLOAT: c_uint = 0x20;
const U8: c_uint = 0x01;
const HOST: c_uint = 1;
const DEVICE: c_uint = 2;
const ARRAY: c_uint = 3;
const SURFACE_LDST: c_uint = 2;

/// Thread i fetches texture `t` at (c[2i], c[2i+1]) and stores the red channel at `o[i]`;
/// `s` gets surface stores of `i * 10` at byte column `4 i`, row 1.
const KERNELS: &CStr = c".version 8.5\n.target sm_75\n.address_size 64\n\
    .visible .entry fetch(.param .u64 t, .param .u64 c, .param .u64 o)\n{\n\
    .reg .b32 %r<3>;\n.reg .f32 %f<8>;\n.reg .b64 %rd<8>;\n\
    ld.param.u64 %rd1, [t];\nld.param.u64 %rd2, [c];\nld.param.u64 %rd3, [o];\n\
    mov.u32 %r1, %tid.x;\nmul.wide.u32 %rd4, %r1, 8;\nadd.s64 %rd5, %rd2, %rd4;\n\
    ld.global.v2.f32 {%f1, %f2}, [%rd5];\n\
    tex.2d.v4.f32.f32 {%f3, %f4, %f5, %f6}, [%rd1, {%f1, %f2}];\n\
    mul.wide.u32 %rd6, %r1, 4;\nadd.s64 %rd7, %rd3, %rd6;\nst.global.f32 [%rd7], %f3;\nret;\n}\n\
    .visible .entry paint(.param .u64 s)\n{\n.reg .b32 %r<5>;\n.reg .b64 %rd<2>;\n\
    ld.param.u64 %rd1, [s];\nmov.u32 %r1, %tid.x;\nshl.b32 %r2, %r1, 2;\nmul.lo.u32 %r3, %r1, 10;\n\
    mov.u32 %r4, 1;\nsust.b.2d.b32.trap [%rd1, {%r2, %r4}], {%r3};\nret;\n}\n";

fn copy2d() -> Memcpy2D {
    Memcpy2D {
        src_x: 0,
        src_y: 0,
        src_type: 0,
        src_host: null(),
        src_device: 0,
        src_array: 0,
        src_pitch: 0,
        dst_x: 0,
        dst_y: 0,
        dst_type: 0,
        dst_host: null_mut(),
        dst_device: 0,
        dst_array: 0,
        dst_pitch: 0,
        width: 0,
        height: 0,
    }
}

/// The Programming Guide's bilinear fetch of a one-channel float image (unnormalised
/// coordinates, clamp), its weights in 9-bit fixed point.
fn bilinear(img: &[f32], w: usize, h: usize, x: f32, y: f32) -> f32 {
    let at = |i: i64, j: i64| {
        img[j.clamp(0, h as i64 - 1) as usize * w + i.clamp(0, w as i64 - 1) as usize]
    };
    let (xb, yb) = (x - 0.5, y - 0.5);
    let (i, j) = (xb.floor(), yb.floor());
    let a = ((xb - i) * 256.0).round() / 256.0;
    let b = ((yb - j) * 256.0).round() / 256.0;
    let (i, j) = (i as i64, j as i64);
    (1.0 - a) * (1.0 - b) * at(i, j)
        + a * (1.0 - b) * at(i + 1, j)
        + (1.0 - a) * b * at(i, j + 1)
        + a * b * at(i + 1, j + 1)
}

#[test]
fn arrays_copies_and_texture_objects_work_and_refuse_bad_arguments() {
    let host = support::serve_cpu_backend("arrays");
    // SAFETY: every call passes arguments as the driver API documents them (out-pointers
    // and structures of the declared types, buffers of the stated sizes), or bad handles,
    // extents and formats where the test checks that they are refused.
    unsafe {
        assert_eq!(cuInit(0), 0);
        let mut ctx: Handle = null_mut();
        assert_eq!(cuCtxCreate_v2(&mut ctx, 0, 0), 0);

        // Arrays: created, described, refused.
        let (w, h) = (16usize, 8usize);
        let desc = Array3DDesc {
            width: w,
            height: h,
            depth: 0,
            format: FLOAT,
            channels: 1,
            flags: SURFACE_LDST,
        };
        let mut arr = 0u64;
        assert_eq!(cuArray3DCreate_v2(&mut arr, &desc), 0);
        let mut back = Array3DDesc::default();
        assert_eq!(cuArray3DGetDescriptor_v2(&mut back, arr), 0);
        assert_eq!(
            (back.width, back.height, back.depth, back.flags),
            (w, h, 0, SURFACE_LDST)
        );
        let mut two = ArrayDesc::default();
        assert_eq!(cuArrayGetDescriptor_v2(&mut two, arr), 0);
        assert_eq!(
            (two.width, two.height, two.format, two.channels),
            (w, h, FLOAT, 1)
        );
        let mut bad = 0u64;
        for (d, why) in [
            (
                Array3DDesc {
                    channels: 3,
                    ..desc
                },
                "three channels",
            ),
            (
                Array3DDesc {
                    format: 0x77,
                    ..desc
                },
                "unknown format",
            ),
            (
                Array3DDesc {
                    width: usize::MAX,
                    ..desc
                },
                "overflowing width",
            ),
            (
                Array3DDesc {
                    width: 1 << 20,
                    height: 1 << 20,
                    ..desc
                },
                "past the limits",
            ),
            (
                Array3DDesc {
                    depth: 3,
                    flags: 4,
                    ..desc
                },
                "a cubemap of 3 faces",
            ),
        ] {
            assert_eq!(cuArray3DCreate_v2(&mut bad, &d), 1, "{why}");
        }
        assert_eq!(cuArray3DCreate_v2(&mut bad, null()), 1, "NULL descriptor");
        assert_eq!(
            cuArray3DGetDescriptor_v2(&mut back, 12345),
            400,
            "not an array"
        );
        let small = ArrayDesc {
            width: 4,
            height: 0,
            format: U8,
            channels: 4,
        };
        let mut arr1d = 0u64;
        assert_eq!(cuArrayCreate_v2(&mut arr1d, &small), 0);

        // Host rows (pitch 80 bytes) into the array, and back out through a 3D copy.
        let img: Vec<f32> = (0..w * h).map(|i| ((i * 7) % 23) as f32 * 0.5).collect();
        let src_pitch = 80;
        let mut host_rows = vec![0u8; src_pitch * h];
        for (r, row) in img.chunks(w).enumerate() {
            let bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
            host_rows[r * src_pitch..r * src_pitch + w * 4].copy_from_slice(&bytes);
        }
        let to_array = Memcpy2D {
            src_type: HOST,
            src_host: host_rows.as_ptr().cast(),
            src_pitch,
            dst_type: ARRAY,
            dst_array: arr,
            width: w * 4,
            height: h,
            ..copy2d()
        };
        assert_eq!(cuMemcpy2D_v2(&to_array), 0);
        let mut out = vec![0f32; w * h];
        let from_array = Memcpy3D {
            src_x: 0,
            src_y: 0,
            src_z: 0,
            src_lod: 0,
            src_type: ARRAY,
            src_host: null(),
            src_device: 0,
            src_array: arr,
            reserved0: null_mut(),
            src_pitch: 0,
            src_height: 0,
            dst_x: 0,
            dst_y: 0,
            dst_z: 0,
            dst_lod: 0,
            dst_type: HOST,
            dst_host: out.as_mut_ptr().cast(),
            dst_device: 0,
            dst_array: 0,
            reserved1: null_mut(),
            dst_pitch: w * 4,
            dst_height: h,
            width: w * 4,
            height: h,
            depth: 1,
        };
        assert_eq!(cuMemcpy3D_v2(&from_array), 0);
        assert_eq!(out, img);
        assert_eq!(
            cuMemcpy2D_v2(&Memcpy2D {
                height: 0,
                ..to_array
            }),
            0,
            "empty"
        );
        // Past the array's row, rows, or with a pitch under the row: refused.
        for (c, why) in [
            (
                Memcpy2D {
                    dst_x: 4,
                    ..to_array
                },
                "past the row",
            ),
            (
                Memcpy2D {
                    dst_y: 1,
                    ..to_array
                },
                "past the rows",
            ),
            (
                Memcpy2D {
                    dst_x: 2,
                    width: 4,
                    ..to_array
                },
                "inside a texel",
            ),
            (
                Memcpy2D {
                    src_pitch: 8,
                    ..to_array
                },
                "pitch under the row",
            ),
            (
                Memcpy2D {
                    dst_y: usize::MAX,
                    ..to_array
                },
                "overflowing row",
            ),
            (
                Memcpy2D {
                    dst_array: 99,
                    ..to_array
                },
                "not an array",
            ),
        ] {
            let want = if why == "not an array" { 400 } else { 1 };
            assert_eq!(cuMemcpy2D_v2(&c), want, "{why}");
        }

        // Pitched device memory: a 2D copy into the middle, a 2D memset, then read back.
        let (mut dp, mut pitch) = (0u64, 0usize);
        assert_eq!(cuMemAllocPitch_v2(&mut dp, &mut pitch, 20, 6, 4), 0);
        assert_eq!(pitch % 32, 0);
        assert!(pitch >= 20);
        assert_eq!(
            cuMemAllocPitch_v2(&mut dp, &mut pitch, 20, 6, 3),
            1,
            "element size 3"
        );
        assert_eq!(cuMemsetD2D8_v2(dp, pitch, 0xaa, 20, 6), 0);
        assert_eq!(cuMemsetD2D32_v2(dp, pitch, 0x0102_0304, 2, 1), 0);
        assert_eq!(
            cuMemsetD2D16_v2(dp + 2 * pitch as u64 + 2, pitch, 0xbeef, 3, 2),
            0
        );
        assert_eq!(
            cuMemsetD2D8_v2(dp, pitch, 0, pitch + 1, 6),
            1,
            "row past the pitch"
        );
        assert_eq!(
            cuMemsetD2D8_v2(dp, pitch, 0, 20, 7),
            1,
            "rows past the allocation"
        );
        assert_eq!(cuMemsetD16_v2(dp + 1, 1, 2), 1, "unaligned 16-bit memset");
        let block: Vec<u8> = (0..12u8).collect();
        let into = Memcpy2D {
            src_type: HOST,
            src_host: block.as_ptr().cast(),
            src_pitch: 4,
            dst_type: DEVICE,
            dst_device: dp,
            dst_x: 8,
            dst_y: 3,
            dst_pitch: pitch,
            width: 4,
            height: 3,
            ..copy2d()
        };
        assert_eq!(cuMemcpy2DAsync_v2(&into, null_mut()), 0);
        assert_eq!(
            cuMemcpy2D_v2(&Memcpy2D { dst_y: 4, ..into }),
            1,
            "rows past the allocation"
        );
        let mut whole = vec![0u8; pitch * 6];
        assert_eq!(
            cuMemcpyDtoH_v2(whole.as_mut_ptr().cast(), dp, whole.len()),
            0
        );
        let mut want = vec![0u8; pitch * 6];
        for r in 0..6 {
            want[r * pitch..r * pitch + 20].fill(0xaa);
        }
        want[..8].copy_from_slice(&[4, 3, 2, 1, 4, 3, 2, 1]);
        for r in 2..4 {
            for e in 0..3 {
                want[r * pitch + 2 + 2 * e..r * pitch + 4 + 2 * e]
                    .copy_from_slice(&0xbeefu16.to_le_bytes());
            }
        }
        for r in 0..3 {
            want[(3 + r) * pitch + 8..(3 + r) * pitch + 12]
                .copy_from_slice(&block[r * 4..r * 4 + 4]);
        }
        assert_eq!(whole, want);

        // 1D copies at byte offsets of arrays.
        assert_eq!(
            cuMemcpyHtoA_v2(arr1d, 4, [9u8, 8, 7, 6].as_ptr().cast(), 4),
            0
        );
        assert_eq!(
            cuMemcpyHtoA_v2(arr1d, 14, [0u8; 4].as_ptr().cast(), 4),
            1,
            "past the end"
        );
        assert_eq!(cuMemcpyAtoA_v2(arr1d, 8, arr1d, 4, 4), 0);
        assert_eq!(cuMemcpyAtoD_v2(dp, arr1d, 8, 4), 0);
        assert_eq!(cuMemcpyDtoA_v2(arr1d, 0, dp, 4), 0);
        let mut four = [0u8; 16];
        assert_eq!(cuMemcpyAtoH_v2(four.as_mut_ptr().cast(), arr1d, 0, 16), 0);
        assert_eq!(four[..12], [9, 8, 7, 6, 9, 8, 7, 6, 9, 8, 7, 6]);

        // A texture object over the array: bilinear fetches against the host's formula.
        let mut module: Handle = null_mut();
        assert_eq!(cuModuleLoadData(&mut module, KERNELS.as_ptr().cast()), 0);
        let (mut fetch, mut paint): (Handle, Handle) = (null_mut(), null_mut());
        assert_eq!(
            cuModuleGetFunction(&mut fetch, module, c"fetch".as_ptr()),
            0
        );
        assert_eq!(
            cuModuleGetFunction(&mut paint, module, c"paint".as_ptr()),
            0
        );
        let mut res = ResourceDesc {
            kind: 0,
            res: [0; 16],
            flags: 0,
        };
        res.res[0] = arr;
        let tdesc = TextureDesc {
            address: [1; 3],
            filter: 1,
            ..Default::default()
        };
        let mut tex = 0u64;
        assert_eq!(cuTexObjectCreate(&mut tex, &res, &tdesc, null()), 0);
        let points: Vec<[f32; 2]> = vec![
            [0.0, 0.0],
            [3.3, 2.7],
            [15.9, 7.9],
            [8.25, 4.5],
            [-2.0, 9.0],
        ];
        let coords: Vec<u8> = points
            .iter()
            .flatten()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let (mut dc, mut dout) = (0u64, 0u64);
        assert_eq!(cuMemAlloc_v2(&mut dc, coords.len()), 0);
        assert_eq!(cuMemAlloc_v2(&mut dout, points.len() * 4), 0);
        assert_eq!(cuMemcpyHtoD_v2(dc, coords.as_ptr().cast(), coords.len()), 0);
        let mut args = [tex, dc, dout];
        let mut params: Vec<*mut c_void> =
            args.iter_mut().map(|a| (a as *mut u64).cast()).collect();
        let n = points.len() as c_uint;
        assert_eq!(
            cuLaunchKernel(
                fetch,
                1,
                1,
                1,
                n,
                1,
                1,
                0,
                null_mut(),
                params.as_mut_ptr(),
                null_mut()
            ),
            0
        );
        let mut got = vec![0f32; points.len()];
        assert_eq!(
            cuMemcpyDtoH_v2(got.as_mut_ptr().cast(), dout, got.len() * 4),
            0
        );
        for (p, g) in points.iter().zip(&got) {
            assert_eq!(
                g.to_bits(),
                bilinear(&img, w, h, p[0], p[1]).to_bits(),
                "at {p:?}"
            );
        }
        let mut res_back = ResourceDesc {
            kind: 9,
            res: [0; 16],
            flags: 0,
        };
        assert_eq!(cuTexObjectGetResourceDesc(&mut res_back, tex), 0);
        assert_eq!((res_back.kind, res_back.res[0]), (0, arr));
        let mut t_back = TextureDesc::default();
        assert_eq!(cuTexObjectGetTextureDesc(&mut t_back, tex), 0);
        assert_eq!((t_back.filter, t_back.address), (1, [1; 3]));
        // Refused: linear filtering of integers read as such, an unknown address mode, a
        // pitched resource past its allocation, a bad array, a handle never created.
        let mut bad_tex = 0u64;
        let int_desc = ArrayDesc {
            width: 4,
            height: 4,
            format: 0x03,
            channels: 1,
        };
        let mut int_arr = 0u64;
        assert_eq!(cuArrayCreate_v2(&mut int_arr, &int_desc), 0);
        let mut int_res = res;
        int_res.res[0] = int_arr;
        assert_eq!(cuTexObjectCreate(&mut bad_tex, &int_res, &tdesc, null()), 1);
        let odd = TextureDesc {
            address: [7, 1, 1],
            ..tdesc
        };
        assert_eq!(cuTexObjectCreate(&mut bad_tex, &res, &odd, null()), 1);
        let mut pitched = ResourceDesc {
            kind: 3,
            res: [0; 16],
            flags: 0,
        };
        pitched.res[0] = dp;
        pitched.res[1] = u64::from(FLOAT) | 1 << 32;
        pitched.res[2] = 8;
        pitched.res[3] = 7;
        pitched.res[4] = pitch as u64;
        assert_eq!(
            cuTexObjectCreate(&mut bad_tex, &pitched, &tdesc, null()),
            1,
            "7 rows of 6"
        );
        pitched.res[3] = 6;
        assert_eq!(cuTexObjectCreate(&mut bad_tex, &pitched, &tdesc, null()), 0);
        assert_eq!(cuTexObjectDestroy(bad_tex), 0);
        let mut nowhere = res;
        nowhere.res[0] = 4242;
        assert_eq!(
            cuTexObjectCreate(&mut bad_tex, &nowhere, &tdesc, null()),
            400
        );
        assert_eq!(
            cuTexObjectDestroy(dc),
            1,
            "device memory is no texture object"
        );
        assert_eq!(cuTexObjectDestroy(bad_tex), 1, "destroyed twice");

        // A surface object: only over an array made for surface loads and stores.
        let mut surf = 0u64;
        res.res[0] = arr1d;
        assert_eq!(
            cuSurfObjectCreate(&mut surf, &res),
            1,
            "array without SURFACE_LDST"
        );
        res.res[0] = arr;
        assert_eq!(cuSurfObjectCreate(&mut surf, &res), 0);
        assert_eq!(cuSurfObjectDestroy(tex), 1, "a texture is no surface");
        let mut sargs = [surf];
        let mut sparams: Vec<*mut c_void> =
            sargs.iter_mut().map(|a| (a as *mut u64).cast()).collect();
        assert_eq!(
            cuLaunchKernel(
                paint,
                1,
                1,
                1,
                16,
                1,
                1,
                0,
                null_mut(),
                sparams.as_mut_ptr(),
                null_mut()
            ),
            0
        );
        assert_eq!(cuCtxSynchronize(), 0);
        let mut row = [0u32; 16];
        assert_eq!(
            cuMemcpyAtoH_v2(row.as_mut_ptr().cast(), arr, w * 4, w * 4),
            0
        );
        assert_eq!(row, std::array::from_fn(|i| i as u32 * 10));
        assert_eq!(cuSurfObjectDestroy(surf), 0);
        assert_eq!(cuTexObjectDestroy(tex), 0);

        // A mipmapped array of 8 x 8 floats: 4 levels (8, 4, 2, 1), level l all 10 l + 1.
        let mip_desc = Array3DDesc {
            width: 8,
            height: 8,
            flags: 0,
            ..desc
        };
        let mut mip = 0u64;
        assert_eq!(
            cuMipmappedArrayCreate(&mut mip, &mip_desc, 5),
            1,
            "past 1 x 1"
        );
        assert_eq!(
            cuMipmappedArrayCreate(&mut mip, &mip_desc, 0),
            1,
            "no levels"
        );
        assert_eq!(cuMipmappedArrayCreate(&mut mip, &mip_desc, 4), 0);
        let mut levels = [0u64; 4];
        for (l, h) in levels.iter_mut().enumerate() {
            assert_eq!(cuMipmappedArrayGetLevel(h, mip, l as c_uint), 0);
            let mut shape = Array3DDesc::default();
            assert_eq!(cuArray3DGetDescriptor_v2(&mut shape, *h), 0);
            let n = 8 >> l;
            assert_eq!((shape.width, shape.height), (n, n));
            let fill: Vec<u8> = (0..n * n)
                .flat_map(|_| ((10 * l + 1) as f32).to_le_bytes())
                .collect();
            assert_eq!(cuMemcpyHtoA_v2(*h, 0, fill.as_ptr().cast(), fill.len()), 0);
        }
        let mut none = 0u64;
        assert_eq!(cuMipmappedArrayGetLevel(&mut none, mip, 4), 1, "no level 4");
        assert_eq!(cuArrayDestroy(levels[1]), 1, "a level goes with its array");
        let mut mres = ResourceDesc {
            kind: 1,
            res: [0; 16],
            flags: 0,
        };
        mres.res[0] = mip;
        // Point mipmap filtering with a bias of 2: level 2; linear with 1.5: between 1 and 2.
        let fetched = |mipmap_filter: c_uint, bias: f32| -> f32 {
            let td = TextureDesc {
                address: [1; 3],
                filter: 0,
                flags: 2,
                mipmap_filter,
                mipmap_bias: bias,
                max_lod: 3.0,
                ..Default::default()
            };
            let mut t = 0u64;
            assert_eq!(cuTexObjectCreate(&mut t, &mres, &td, null()), 0);
            let mut targs = [t, dc, dout];
            let mut tp: Vec<*mut c_void> =
                targs.iter_mut().map(|a| (a as *mut u64).cast()).collect();
            assert_eq!(
                cuLaunchKernel(
                    fetch,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    null_mut(),
                    tp.as_mut_ptr(),
                    null_mut()
                ),
                0
            );
            let mut v = 0f32;
            assert_eq!(cuMemcpyDtoH_v2((&mut v as *mut f32).cast(), dout, 4), 0);
            assert_eq!(cuTexObjectDestroy(t), 0);
            v
        };
        assert_eq!(fetched(0, 2.0), 21.0);
        assert_eq!(fetched(0, 9.0), 31.0, "clamped to the last level");
        assert_eq!(fetched(1, 1.5), 0.5 * 11.0 + 0.5 * 21.0);
        assert_eq!(cuMipmappedArrayDestroy(mip), 0);
        assert_eq!(cuMipmappedArrayDestroy(mip), 400, "destroyed twice");
        assert_eq!(
            cuMemcpyHtoA_v2(levels[0], 0, [0u8; 4].as_ptr().cast(), 4),
            400,
            "its levels went with it"
        );

        assert_eq!(cuArrayDestroy(arr), 0);
        assert_eq!(cuArrayDestroy(arr), 400, "destroyed twice");
        assert_eq!(
            cuMemcpyHtoA_v2(arr, 0, [0u8; 4].as_ptr().cast(), 4),
            400,
            "a destroyed array"
        );
    }
    host.close();
}
