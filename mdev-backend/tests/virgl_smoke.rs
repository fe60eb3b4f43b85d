//! virglrenderer through the binding on this host (llvmpipe via surfaceless EGL): capsets,
//! a context, a command stream and a fence signalled through the poll fd, then resources,
//! backing memory and transfers. One test, because virglrenderer may be initialised once per
//! process; each group of checks is a helper function called from it.

use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use mdev_backend::virgl::{
    BIND_RENDER_TARGET, BIND_SAMPLER_VIEW, BackingMemory, CAPSET_VIRGL, CAPSET_VIRGL2,
    DEFAULT_LIBRARY, FORMAT_B8G8R8A8_UNORM, HostBacking, HostGl, ResourceCreate3d,
    TARGET_TEXTURE_2D, Transfer, TransferBox, Virgl, VirglError,
};

/// virglrenderer 0.10's code for invalid input: positive EINVAL.
const EINVAL: i32 = 22;
const W: u32 = 64;
const H: u32 = 64;
const BYTES: usize = (W * H * 4) as usize;

/// Waits for the poll fd to become readable (epoll with a timeout, no sleep loop).
fn wait_readable(fd: i32, timeout: Duration) -> bool {
    let epoll = Epoll::new().unwrap();
    epoll
        .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, 0))
        .unwrap();
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let mut events = [EpollEvent::default()];
    epoll.wait(ms, &mut events).unwrap() > 0
}

#[test]
fn capsets_context_submit_and_fence() {
    let virgl = match Virgl::new(DEFAULT_LIBRARY, HostGl::default()) {
        Ok(v) => v,
        Err(VirglError::Load(e)) if std::env::var_os("VGPU_REQUIRE_VIRGL").is_none() => {
            eprintln!(
                "SKIPPED: {e} (install libvirglrenderer1, or set VGPU_REQUIRE_VIRGL to fail)"
            );
            return;
        }
        Err(e) => panic!("virglrenderer: {e}"),
    };
    assert!(matches!(
        Virgl::new(DEFAULT_LIBRARY, HostGl::default()),
        Err(VirglError::AlreadyInitialised)
    ));

    let v1 = virgl.capset_info(CAPSET_VIRGL).unwrap();
    assert_eq!(
        (v1.max_version, v1.max_size),
        (1, 308),
        "DESIGN: capset 1 is v1, 308 bytes"
    );
    let v2 = virgl.capset_info(CAPSET_VIRGL2).unwrap();
    assert!(v2.max_version >= 2 && v2.max_size > 308, "{v2:?}");
    let caps = virgl.capset(CAPSET_VIRGL2, v2.max_version).unwrap();
    assert_eq!(caps.len(), v2.max_size as usize);
    assert!(caps.iter().any(|&b| b != 0), "capset filled");
    assert!(virgl.capset_info(99).is_err());
    assert!(
        virgl.capset(CAPSET_VIRGL, 2).is_err(),
        "version above the maximum"
    );

    virgl.context_create(1, "smoke").unwrap();
    // VIRGL_CCMD_NOP with no payload: header dword (length 0 << 16 | cmd 0).
    virgl.submit(1, &mut [0u32]).unwrap();
    let fd = virgl.poll_fd().expect("THREAD_SYNC gives a poll fd");
    let start = Instant::now();
    virgl.create_fence(7, 1).unwrap();
    let mut signalled = None;
    while signalled.is_none() && start.elapsed() < Duration::from_secs(5) {
        if wait_readable(fd, Duration::from_secs(5)) {
            signalled = virgl.poll();
        }
    }
    assert_eq!(signalled, Some(7), "fence 7 signalled through the poll fd");
    eprintln!("fence round trip {:?}", start.elapsed());

    resource_round_trip(&virgl);
    context_attachment(&virgl);
    invalid_input(&virgl);
    resource_left_for_drop(&virgl);
    virgl.context_destroy(1);
}

/// A 64x64 BGRA render target / sampler view texture.
fn texture_2d() -> ResourceCreate3d {
    ResourceCreate3d {
        target: TARGET_TEXTURE_2D,
        format: FORMAT_B8G8R8A8_UNORM,
        bind: BIND_RENDER_TARGET | BIND_SAMPLER_VIEW,
        width: W,
        height: H,
        depth: 1,
        array_size: 1,
        ..ResourceCreate3d::default()
    }
}

/// A pattern with distinct B, G, R and A bytes, so a channel swap shows.
fn pattern() -> Vec<u8> {
    (0..BYTES).map(|i| (i * 7 + i / 256 + 3) as u8).collect()
}

/// `bytes` split into host buffers of the given lengths (the last takes the rest).
fn split(bytes: &[u8], lens: &[usize]) -> HostBacking {
    let mut rest = bytes;
    let mut buffers: Vec<Box<[u8]>> = Vec::new();
    for &n in lens {
        let (head, tail) = rest.split_at(n);
        buffers.push(head.into());
        rest = tail;
    }
    buffers.push(rest.into());
    HostBacking::new(buffers)
}

fn take_host(backing: Box<dyn BackingMemory>) -> HostBacking {
    *backing
        .into_any()
        .downcast::<HostBacking>()
        .expect("a HostBacking")
}

/// Create, attach a patterned backing, write it into the texture, read it back (into a host
/// buffer and into a second, zeroed backing), unref.
fn resource_round_trip(virgl: &Virgl) {
    let whole = Transfer::whole_2d(W, H);
    let pattern = pattern();
    virgl.resource_create(10, &texture_2d()).unwrap();
    assert!(virgl.has_resource(10));

    // Three iovecs, not row-aligned: virglrenderer gathers them into a temporary buffer.
    virgl
        .attach_backing(10, Box::new(split(&pattern, &[5000, 3])))
        .unwrap();
    virgl.transfer_write(10, 0, &whole).unwrap();
    let mut out = vec![0u8; BYTES];
    virgl.transfer_read_into(10, 0, &whole, &mut out).unwrap();
    assert!(out == pattern, "pattern round-trips through the texture");
    let first = take_host(virgl.detach_backing(10).unwrap());
    assert_eq!(first.buffers().len(), 3);
    assert!(
        first.to_vec() == pattern,
        "multi-iovec source left as it was"
    );

    // Read back into a zeroed backing, one iovec.
    virgl
        .attach_backing(10, Box::new(HostBacking::zeroed(&[BYTES])))
        .unwrap();
    virgl.transfer_read(10, 0, &whole).unwrap();
    let second = take_host(virgl.detach_backing(10).unwrap());
    assert!(second.to_vec() == pattern, "read into the attached backing");

    // A sub-box with an offset and an explicit stride: rows 8..24, columns 4..20 land at
    // offset 64 of a 16x16 tight buffer.
    let sub = Transfer {
        stride: 16 * 4,
        region: TransferBox {
            x: 4,
            y: 8,
            z: 0,
            w: 16,
            h: 16,
            d: 1,
        },
        offset: 64,
        ..Transfer::default()
    };
    let mut part = vec![0u8; 64 + 16 * 16 * 4];
    virgl.transfer_read_into(10, 0, &sub, &mut part).unwrap();
    for row in 0..16 {
        let src = ((8 + row) * W as usize + 4) * 4;
        let dst = 64 + row * 16 * 4;
        assert_eq!(part[dst..dst + 64], pattern[src..src + 64], "row {row}");
    }

    // One iovec, the whole texture: report whether the source is modified (virglrenderer
    // 0.10 swizzles BGRA uploads in place on GLES when it needs no temporary buffer).
    virgl
        .attach_backing(10, Box::new(HostBacking::new(vec![pattern.clone().into()])))
        .unwrap();
    virgl.transfer_write(10, 0, &whole).unwrap();
    let single = take_host(virgl.detach_backing(10).unwrap()).to_vec();
    let swapped = single
        .chunks(4)
        .zip(pattern.chunks(4))
        .all(|(s, p)| s == [p[2], p[1], p[0], p[3]]);
    eprintln!(
        "single-iovec BGRA upload: source {}",
        if single == pattern {
            "unchanged"
        } else if swapped {
            "swizzled in place to RGBA"
        } else {
            "changed"
        }
    );
    virgl.transfer_read_into(10, 0, &whole, &mut out).unwrap();
    assert!(
        out == pattern,
        "texture holds the pattern after the single-iovec upload"
    );

    virgl.resource_unref(10).unwrap();
    assert!(!virgl.has_resource(10));
    let err = virgl
        .transfer_read_into(10, 0, &whole, &mut out)
        .unwrap_err();
    assert!(
        matches!(err, VirglError::Call { code: EINVAL, .. }),
        "{err}"
    );
}

/// Transfers in a context need the resource attached to it. A failed transfer leaves the
/// context in error for good (virglrenderer 0.10's `in_error` is sticky), so the failures get
/// contexts of their own.
fn context_attachment(virgl: &Virgl) {
    let whole = Transfer::whole_2d(W, H);
    let pattern = pattern();
    let mut out = vec![0u8; BYTES];
    let is_einval =
        |r: Result<(), VirglError>| matches!(r, Err(VirglError::Call { code: EINVAL, .. }));
    virgl.resource_create(20, &texture_2d()).unwrap();
    virgl
        .attach_backing(20, Box::new(split(&pattern, &[BYTES / 2])))
        .unwrap();

    // Not attached to context 2: EINVAL, and context 2 stays in error even once attached.
    virgl.context_create(2, "poisoned").unwrap();
    assert!(is_einval(virgl.transfer_write(20, 2, &whole)));
    virgl.ctx_attach_resource(2, 20).unwrap();
    assert!(
        is_einval(virgl.transfer_write(20, 2, &whole)),
        "DESIGN: a context error is sticky in virglrenderer 0.10"
    );
    virgl.context_destroy(2);
    assert!(matches!(
        virgl.ctx_detach_resource(2, 20),
        Err(VirglError::UnknownContext(2))
    ));

    // Attached to context 1: round trip through the context.
    virgl.ctx_attach_resource(1, 20).unwrap();
    virgl.transfer_write(20, 1, &whole).unwrap();
    virgl.transfer_read_into(20, 1, &whole, &mut out).unwrap();
    assert!(out == pattern, "round trip in context 1");
    virgl.ctx_detach_resource(1, 20).unwrap();
    assert!(matches!(
        virgl.ctx_detach_resource(1, 20),
        Err(VirglError::NotAttached { ctx: 1, res: 20 })
    ));

    // Detach really detaches (checked in a context of its own, which the failure poisons).
    virgl.context_create(3, "detached").unwrap();
    virgl.ctx_attach_resource(3, 20).unwrap();
    virgl.transfer_read_into(20, 3, &whole, &mut out).unwrap();
    virgl.ctx_detach_resource(3, 20).unwrap();
    assert!(is_einval(virgl.transfer_read_into(20, 3, &whole, &mut out)));
    virgl.context_destroy(3);

    // Unref with the backing still attached: the binding detaches and frees it.
    virgl.resource_unref(20).unwrap();
    assert!(!virgl.has_backing(20));
}

/// Unknown ids, boxes outside the resource, too small buffers, double attach.
fn invalid_input(virgl: &Virgl) {
    let whole = Transfer::whole_2d(W, H);
    let mut out = vec![0u8; BYTES];
    let is_einval =
        |r: Result<(), VirglError>| matches!(r, Err(VirglError::Call { code: EINVAL, .. }));

    // Unknown resource: virglrenderer's own EINVAL for the calls that return a code, the
    // binding's errors for the void ones.
    assert!(is_einval(virgl.transfer_write(999, 0, &whole)));
    assert!(is_einval(
        virgl.transfer_read_into(999, 0, &whole, &mut out)
    ));
    assert!(is_einval(
        virgl.attach_backing(999, Box::new(HostBacking::zeroed(&[BYTES])))
    ));
    assert!(!virgl.has_backing(999));
    assert!(matches!(
        virgl.resource_unref(999),
        Err(VirglError::UnknownResource(999))
    ));
    assert!(matches!(
        virgl.detach_backing(999),
        Err(VirglError::NoBacking(999))
    ));
    assert!(matches!(
        virgl.ctx_attach_resource(1, 999),
        Err(VirglError::UnknownResource(999))
    ));

    // Ids and arguments refused before virglrenderer.
    assert!(matches!(
        virgl.resource_create(0, &texture_2d()),
        Err(VirglError::InvalidResourceId)
    ));
    virgl.resource_create(30, &texture_2d()).unwrap();
    assert!(matches!(
        virgl.resource_create(30, &texture_2d()),
        Err(VirglError::ResourceExists(30))
    ));
    assert!(matches!(
        virgl.ctx_attach_resource(99, 30),
        Err(VirglError::UnknownContext(99))
    ));
    assert!(matches!(
        virgl.attach_backing(30, Box::new(HostBacking::new(Vec::new()))),
        Err(VirglError::InvalidBacking(_))
    ));

    // A format virglrenderer does not know.
    let bad_format = ResourceCreate3d {
        format: 100_000,
        ..texture_2d()
    };
    let err = virgl.resource_create(31, &bad_format).unwrap_err();
    eprintln!("unknown format: {err}");
    assert!(matches!(err, VirglError::Call { .. }), "{err}");
    assert!(!virgl.has_resource(31));

    // No backing attached.
    assert!(is_einval(virgl.transfer_write(30, 0, &whole)));
    virgl
        .attach_backing(30, Box::new(HostBacking::zeroed(&[BYTES])))
        .unwrap();
    assert!(matches!(
        virgl.attach_backing(30, Box::new(HostBacking::zeroed(&[BYTES]))),
        Err(VirglError::BackingAttached(30))
    ));

    // Boxes outside the 64x64 level 0, a level that does not exist, offsets past the backing.
    let outside = |f: fn(&mut Transfer)| {
        let mut t = whole;
        f(&mut t);
        t
    };
    for (what, t) in [
        ("x + w > 64", outside(|t| t.region.x = 1)),
        ("h > 64", outside(|t| t.region.h = H + 1)),
        ("y > 64", outside(|t| t.region.y = H + 1)),
        ("d = 2", outside(|t| t.region.d = 2)),
        ("level 1", outside(|t| t.level = 1)),
        ("offset 4", outside(|t| t.offset = 4)),
        ("stride < row", outside(|t| t.stride = W * 4 - 4)),
    ] {
        let r = virgl.transfer_write(30, 0, &t);
        assert!(is_einval(r), "write {what}");
        let r = virgl.transfer_read(30, 0, &t);
        assert!(is_einval(r), "read {what}");
    }
    // Values C would read as negative ints never reach it.
    let negative = outside(|t| t.region.x = u32::MAX);
    assert!(matches!(
        virgl.transfer_write(30, 0, &negative),
        Err(VirglError::InvalidTransfer(_))
    ));
    // A buffer one byte short.
    let mut short = vec![0u8; BYTES - 1];
    assert!(is_einval(
        virgl.transfer_read_into(30, 0, &whole, &mut short)
    ));
    virgl.resource_unref(30).unwrap();
}

/// A resource with backing, attached to context 1, left for `Drop for Virgl` to release.
fn resource_left_for_drop(virgl: &Virgl) {
    virgl.resource_create(40, &texture_2d()).unwrap();
    virgl
        .attach_backing(40, Box::new(HostBacking::zeroed(&[BYTES])))
        .unwrap();
    virgl.ctx_attach_resource(1, 40).unwrap();
    virgl
        .transfer_write(40, 1, &Transfer::whole_2d(W, H))
        .unwrap();
}
