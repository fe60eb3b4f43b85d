//! qtest tests of vgpu's private load capset (capset 20) through the real vfio-user path:
//! the capset listed with its blob, load contexts next to virgl contexts created with
//! CONTEXT_INIT, OCCUPY groups timed by the device's local engine (no scheduler daemon), fence
//! order across load and other requests, and every malformed load submit refused whole.
//! virglrenderer may be initialised once per process, so everything runs in one test.

use std::time::{Duration, Instant};

use vgpu_guest_drivers::virtio_gpu::{
    self, CAPSET_LOAD, CONTROL_QUEUE, CTRL_HDR_SIZE, Capset, CapsetInfo, CtrlHeader,
    LOAD_OP_END_FRAME, LOAD_OP_OCCUPY,
};
use vgpu_tests::server::{TestServer, VgpuGuest};
use vgpu_tests::skip_without_qemu;

const TIMEOUT: Duration = Duration::from_secs(10);
const RESP_OK_NODATA: u32 = 0x1100;
const ERR_INVALID_CONTEXT_ID: u32 = 0x1204;
const ERR_INVALID_PARAMETER: u32 = 0x1205;
/// The load context of these tests.
const LOAD_CTX: u32 = 7;

fn response(guest: &mut VgpuGuest, request: &[u8]) -> CtrlHeader {
    guest.control_header(request)
}

fn response_type(guest: &mut VgpuGuest, request: &[u8]) -> u32 {
    response(guest, request).ctrl_type
}

fn occupy(us: u64) -> (u32, u32, u64) {
    (LOAD_OP_OCCUPY, 0, us)
}

#[test]
fn load_capset_contexts_occupy_and_errors() {
    if skip_without_qemu() {
        return;
    }
    let server = TestServer::start_3d();
    let mut guest = VgpuGuest::start(&server);
    let Some(features) = guest.virgl_features() else {
        return;
    };
    assert_ne!(
        features & 1 << virtio_gpu::F_CONTEXT_INIT,
        0,
        "CONTEXT_INIT offered with 3D"
    );
    let qt = guest.vm.qtest();
    assert_eq!(
        guest
            .dev
            .read_device_config_u32(qt, virtio_gpu::CONFIG_NUM_CAPSETS)
            .unwrap(),
        4,
        "VIRGL, VIRGL2, load, compute"
    );
    guest.bring_up_with(features);

    // The capset: index 2, id 20, version 1, a 16-byte blob.
    let info = CapsetInfo::parse(&guest.control(&virtio_gpu::get_capset_info(2), 40)).unwrap();
    assert_eq!(
        (
            info.capset_id,
            info.capset_max_version,
            info.capset_max_size
        ),
        (CAPSET_LOAD, 1, 16)
    );
    let caps = Capset::parse(&guest.control(
        &virtio_gpu::get_capset(CAPSET_LOAD, 1),
        CTRL_HDR_SIZE as u32 + 16,
    ))
    .unwrap();
    let words: Vec<u32> = caps
        .data
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
        .collect();
    assert_eq!(words, [1, 64, 1_000_000, 0]);
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::get_capset(CAPSET_LOAD, 2)),
        ERR_INVALID_PARAMETER,
        "no version 2"
    );

    // virgl contexts created with CONTEXT_INIT (as Mesa does once it is offered) still run
    // command streams; a load context sits next to them.
    for (ctx, init) in [(1, 1), (2, 2)] {
        assert_eq!(
            response_type(&mut guest, &virtio_gpu::ctx_create(ctx, init, b"gl")),
            RESP_OK_NODATA
        );
        let submit = virtio_gpu::with_fence(virtio_gpu::submit_3d(ctx, &[0]), u64::from(ctx));
        assert_eq!(response_type(&mut guest, &submit), RESP_OK_NODATA);
    }
    let create = virtio_gpu::ctx_create(LOAD_CTX, CAPSET_LOAD, b"load");
    assert_eq!(response_type(&mut guest, &create), RESP_OK_NODATA);
    assert_eq!(
        response_type(&mut guest, &create),
        ERR_INVALID_CONTEXT_ID,
        "the id is taken"
    );
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::ctx_create(1, CAPSET_LOAD, b"x")),
        ERR_INVALID_CONTEXT_ID,
        "a virgl context's id is taken too"
    );
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::ctx_attach_resource(LOAD_CTX, 99)),
        RESP_OK_NODATA,
        "attaching a buffer to a load context is a no-op, as Linux does it for every buffer"
    );

    // OCCUPY 2000 µs: its fence completes no earlier than 2 ms after the submit.
    let submit = virtio_gpu::with_fence(
        virtio_gpu::load_submit(LOAD_CTX, &[occupy(2000), (LOAD_OP_END_FRAME, 0, 0)]),
        10,
    );
    let start = Instant::now();
    let reply = response(&mut guest, &submit);
    let took = start.elapsed();
    assert_eq!((reply.ctrl_type, reply.fence_id), (RESP_OK_NODATA, 10));
    assert!(
        took >= Duration::from_micros(2000),
        "completed after {took:?}"
    );

    // Two groups in one submit run one after the other: 2 x 3 ms.
    let submit = virtio_gpu::with_fence(
        virtio_gpu::load_submit(LOAD_CTX, &[occupy(3000), occupy(3000)]),
        11,
    );
    let start = Instant::now();
    assert_eq!(response_type(&mut guest, &submit), RESP_OK_NODATA);
    assert!(start.elapsed() >= Duration::from_millis(6));

    // Fence order: a fenced request after a 30 ms OCCUPY completes after it, not before.
    let long = virtio_gpu::with_fence(virtio_gpu::load_submit(LOAD_CTX, &[occupy(30_000)]), 12);
    let after = virtio_gpu::with_fence(virtio_gpu::get_display_info().to_vec(), 13);
    let qt = guest.vm.qtest();
    let start = Instant::now();
    let first = guest
        .dev
        .request(qt, CONTROL_QUEUE, &[&long], &[CTRL_HDR_SIZE as u32])
        .unwrap();
    let second = guest
        .dev
        .request(
            qt,
            CONTROL_QUEUE,
            &[&after],
            &[virtio_gpu::DISPLAY_INFO_SIZE as u32],
        )
        .unwrap();
    let a = guest.dev.wait_used(qt, CONTROL_QUEUE, TIMEOUT).unwrap();
    let b = guest.dev.wait_used(qt, CONTROL_QUEUE, TIMEOUT).unwrap();
    assert_eq!(
        (a.used.id, b.used.id),
        (u32::from(first), u32::from(second))
    );
    assert!(start.elapsed() >= Duration::from_millis(30));

    // An unfenced submit answers at once, its group still runs.
    assert_eq!(
        response_type(
            &mut guest,
            &virtio_gpu::load_submit(LOAD_CTX, &[occupy(500)])
        ),
        RESP_OK_NODATA
    );

    // Malformed submits are refused whole with INVALID_PARAMETER (fenced, so their fences
    // complete too), and the context still works.
    let too_many = vec![occupy(1); 65];
    let bad: Vec<(Vec<u8>, &str)> = vec![
        (
            virtio_gpu::load_submit(LOAD_CTX, &[(3, 0, 1)]),
            "unknown op",
        ),
        (
            virtio_gpu::load_submit(LOAD_CTX, &[occupy(1), (0, 0, 0)]),
            "op 0 after a good one",
        ),
        (
            virtio_gpu::load_submit(LOAD_CTX, &[(LOAD_OP_OCCUPY, 1, 100)]),
            "flags",
        ),
        (virtio_gpu::load_submit(LOAD_CTX, &[occupy(0)]), "0 µs"),
        (
            virtio_gpu::load_submit(LOAD_CTX, &[occupy(1_000_001)]),
            "too long",
        ),
        (
            virtio_gpu::load_submit(LOAD_CTX, &[(LOAD_OP_END_FRAME, 0, 5)]),
            "END_FRAME argument",
        ),
        (virtio_gpu::load_submit(LOAD_CTX, &too_many), "65 commands"),
        (
            virtio_gpu::submit_3d(LOAD_CTX, &[LOAD_OP_OCCUPY, 0, 100]),
            "12 bytes",
        ),
        (
            virtio_gpu::submit_3d(LOAD_CTX, &[LOAD_OP_OCCUPY, 0, 100, 0, 0]),
            "20 bytes",
        ),
    ];
    for (i, (request, what)) in bad.into_iter().enumerate() {
        let fence = 100 + i as u64;
        let reply = response(&mut guest, &virtio_gpu::with_fence(request, fence));
        assert_eq!(
            (reply.ctrl_type, reply.fence_id),
            (ERR_INVALID_PARAMETER, fence),
            "{what}"
        );
    }
    let ok = virtio_gpu::with_fence(virtio_gpu::load_submit(LOAD_CTX, &[occupy(100)]), 200);
    assert_eq!(response_type(&mut guest, &ok), RESP_OK_NODATA);
    let max = vec![occupy(1); 64];
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::load_submit(LOAD_CTX, &max)),
        RESP_OK_NODATA,
        "64 commands are allowed"
    );

    // Destroyed, the load context is unknown; the virgl ones were not disturbed.
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::ctx_destroy(LOAD_CTX)),
        RESP_OK_NODATA
    );
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::load_submit(LOAD_CTX, &[occupy(1)])),
        ERR_INVALID_CONTEXT_ID
    );
    let submit = virtio_gpu::with_fence(virtio_gpu::submit_3d(2, &[0]), 300);
    assert_eq!(response_type(&mut guest, &submit), RESP_OK_NODATA);
}
