//! qtest tests of the 3D commands through virglrenderer on the host (llvmpipe): capsets,
//! contexts, a texture written from guest memory and read back, a fenced command stream, and
//! the error code of each bad 3D command. virglrenderer may be initialised once per process,
//! so everything runs against one server in one test.

use std::time::Duration;

use vgpu_guest_drivers::virtio_gpu::{
    self, CTRL_HDR_SIZE, Capset, CapsetInfo, ResourceCreate3d, Transfer3d,
};
use vgpu_tests::server::{TestServer, VgpuGuest};
use vgpu_tests::skip_without_qemu;

/// VIRGL_FORMAT_B8G8R8A8_UNORM, PIPE_TEXTURE_2D, bind render target | sampler view.
const BGRA: u32 = 1;
const BIND: u32 = 0x2 | 0x8;
const RESP_OK_NODATA: u32 = 0x1100;
const ERR_INVALID_CONTEXT_ID: u32 = 0x1204;
const ERR_INVALID_PARAMETER: u32 = 0x1205;
const ERR_INVALID_RESOURCE_ID: u32 = 0x1203;
const ERR_OUT_OF_MEMORY: u32 = 0x1201;

fn response_type(guest: &mut VgpuGuest, request: &[u8]) -> u32 {
    guest.control_header(request).ctrl_type
}

#[test]
fn virgl_contexts_textures_fences_and_errors() {
    if skip_without_qemu() {
        return;
    }
    let server = TestServer::start_3d();
    let mut guest = VgpuGuest::start(&server);
    let Some(features) = guest.virgl_features() else {
        return;
    };
    let qt = guest.vm.qtest();
    assert_eq!(
        guest
            .dev
            .read_device_config_u32(qt, virtio_gpu::CONFIG_NUM_CAPSETS)
            .unwrap(),
        4,
        "VIRGL, VIRGL2, the load and the compute capsets"
    );
    // Bring the device up again with VIRGL negotiated, as a 3D guest driver would.
    guest.bring_up_with(features);

    // Capsets 1 (VIRGL) and 2 (VIRGL2) pass through from virglrenderer.
    let info = CapsetInfo::parse(&guest.control(&virtio_gpu::get_capset_info(0), 40)).unwrap();
    assert_eq!(
        (
            info.capset_id,
            info.capset_max_version,
            info.capset_max_size
        ),
        (1, 1, 308)
    );
    let info2 = CapsetInfo::parse(&guest.control(&virtio_gpu::get_capset_info(1), 40)).unwrap();
    assert_eq!(info2.capset_id, 2);
    let caps = Capset::parse(&guest.control(
        &virtio_gpu::get_capset(2, 0),
        CTRL_HDR_SIZE as u32 + info2.capset_max_size,
    ))
    .unwrap();
    assert_eq!(caps.data.len(), info2.capset_max_size as usize);
    assert!(caps.data.iter().any(|&b| b != 0));

    // A context, a 64x64 texture backed by guest RAM, written to the host and read back.
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::ctx_create(1, 0, b"qtest")),
        RESP_OK_NODATA
    );
    let tex = ResourceCreate3d::texture_2d(10, BGRA, BIND, 64, 64);
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::resource_create_3d(&tex)),
        RESP_OK_NODATA
    );
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::ctx_attach_resource(1, 10)),
        RESP_OK_NODATA
    );
    let len = 64 * 64 * 4;
    let backing = guest.ram.alloc(len, 4096).unwrap();
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    guest.vm.qtest().memwrite(backing, &pattern).unwrap();
    let attach = virtio_gpu::resource_attach_backing(10, &[(backing, len as u32)]);
    assert_eq!(response_type(&mut guest, &attach), RESP_OK_NODATA);
    let whole = Transfer3d::whole_2d(10, 64, 64, 4);
    let upload = virtio_gpu::with_fence(virtio_gpu::transfer_to_host_3d(1, &whole), 1);
    assert_eq!(response_type(&mut guest, &upload), RESP_OK_NODATA);
    guest.vm.qtest().memset(backing, len as usize, 0).unwrap();
    let download = virtio_gpu::with_fence(virtio_gpu::transfer_from_host_3d(1, &whole), 2);
    let reply = guest.control_header(&download);
    assert_eq!(
        (reply.ctrl_type, reply.fence_id),
        (RESP_OK_NODATA, 2),
        "fence echoed"
    );
    let back = guest.vm.qtest().memread(backing, len as usize).unwrap();
    assert_eq!(
        back, pattern,
        "the texture round-trips through virglrenderer"
    );

    // A fenced command stream (one NOP) completes once its fence has signalled.
    let submit = virtio_gpu::with_fence(virtio_gpu::submit_3d(1, &[0]), 3);
    assert_eq!(response_type(&mut guest, &submit), RESP_OK_NODATA);

    // Bad 3D commands get their error codes; the device stays live.
    let bad: Vec<(Vec<u8>, u32, &str)> = vec![
        (
            virtio_gpu::get_capset_info(4),
            ERR_INVALID_PARAMETER,
            "capset index 4",
        ),
        (
            virtio_gpu::get_capset(7, 0),
            ERR_INVALID_PARAMETER,
            "capset 7",
        ),
        (
            virtio_gpu::ctx_create(1, 0, b"again"),
            ERR_INVALID_CONTEXT_ID,
            "context 1 again",
        ),
        (
            virtio_gpu::ctx_create(0, 0, b"zero"),
            ERR_INVALID_CONTEXT_ID,
            "context 0",
        ),
        (
            virtio_gpu::ctx_create(2, 9, b"venus"),
            ERR_INVALID_PARAMETER,
            "capset 9 context",
        ),
        (
            virtio_gpu::submit_3d(5, &[0]),
            ERR_INVALID_CONTEXT_ID,
            "submit to unknown context",
        ),
        (
            virtio_gpu::resource_create_3d(&tex),
            ERR_INVALID_RESOURCE_ID,
            "resource 10 again",
        ),
        (
            virtio_gpu::resource_attach_backing(10, &[(backing, 16)]),
            virtio_gpu::RESP_ERR_UNSPEC,
            "second backing",
        ),
        (
            // 16384 x 16384 x 4 bytes x 2048 layers: 2 TiB, past the 1 GiB default budget.
            virtio_gpu::resource_create_3d(&ResourceCreate3d {
                array_size: 2048,
                ..ResourceCreate3d::texture_2d(12, BGRA, BIND, 16384, 16384)
            }),
            ERR_OUT_OF_MEMORY,
            "2 TiB texture array",
        ),
        (
            virtio_gpu::resource_create_3d(&ResourceCreate3d::texture_2d(
                12, BGRA, BIND, 16385, 16,
            )),
            ERR_INVALID_PARAMETER,
            "texture wider than 16384",
        ),
    ];
    for (request, code, what) in bad {
        assert_eq!(response_type(&mut guest, &request), code, "{what}");
    }
    let outside = guest.vm.ram_bytes() + 0x10_0000;
    let tex2 = ResourceCreate3d::texture_2d(11, BGRA, BIND, 16, 16);
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::resource_create_3d(&tex2)),
        RESP_OK_NODATA
    );
    let attach_outside = virtio_gpu::resource_attach_backing(11, &[(outside, 1024)]);
    assert_eq!(
        response_type(&mut guest, &attach_outside),
        ERR_INVALID_PARAMETER
    );
    // Transfers naming an unknown resource or a box outside it are refused before
    // virglrenderer sees them (which would poison the context).
    let unknown = Transfer3d {
        resource_id: 99,
        ..whole
    };
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::transfer_to_host_3d(1, &unknown)),
        ERR_INVALID_RESOURCE_ID
    );
    let outside_box = Transfer3d {
        bbox: virtio_gpu::Box3d {
            x: 32,
            y: 0,
            z: 0,
            w: 64,
            h: 64,
            d: 1,
        },
        ..whole
    };
    assert_eq!(
        response_type(
            &mut guest,
            &virtio_gpu::transfer_to_host_3d(1, &outside_box)
        ),
        ERR_INVALID_PARAMETER
    );
    let huge_stride = Transfer3d {
        stride: 0x8000_0000,
        ..whole
    };
    assert_eq!(
        response_type(
            &mut guest,
            &virtio_gpu::transfer_to_host_3d(1, &huge_stride)
        ),
        ERR_INVALID_PARAMETER,
        "stride x height past 32 bits"
    );
    // Context 1 was not poisoned: it still transfers.
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::transfer_from_host_3d(1, &whole)),
        RESP_OK_NODATA
    );
    // A destroyed context takes no more work.
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::ctx_destroy(1)),
        RESP_OK_NODATA
    );
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::submit_3d(1, &[0])),
        ERR_INVALID_CONTEXT_ID,
        "submit after destroy"
    );
    // The neighbour survived all of it: resource 10 still reads back.
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::ctx_create(3, 0, b"after")),
        RESP_OK_NODATA
    );
    assert_eq!(
        response_type(&mut guest, &virtio_gpu::ctx_attach_resource(3, 10)),
        RESP_OK_NODATA
    );
    let again = virtio_gpu::transfer_from_host_3d(3, &whole);
    assert_eq!(response_type(&mut guest, &again), RESP_OK_NODATA);
    assert_eq!(
        guest.vm.qtest().memread(backing, len as usize).unwrap(),
        pattern
    );
    assert_eq!(server.counter("transport_faults"), 0);
    drop(guest);
    server.wait(Duration::from_secs(10)).unwrap();
}
