//! virglrenderer through the binding on this host (llvmpipe via surfaceless EGL): capsets,
//! a context, a command stream and a fence signalled through the poll fd. One test, because
//! virglrenderer may be initialised once per process.

use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use mdev_backend::virgl::{CAPSET_VIRGL, CAPSET_VIRGL2, DEFAULT_LIBRARY, Virgl, VirglError};

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
    let virgl = match Virgl::new(DEFAULT_LIBRARY) {
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
        Virgl::new(DEFAULT_LIBRARY),
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
    virgl.context_destroy(1);
}
