//! A qtest guest's side of the compute capset (capset 21): a guest blob of scattered pages and
//! the exchange of one `wire` request through it, as the guest library's DRM transport does
//! (docs/CUDA-GUEST.md, "The virtio-gpu transport").

use mdev_backend::compute::wire::{Reply, Request};
use vgpu_guest_drivers::virtio_gpu::{self, BLOB_FLAG_USE_MAPPABLE, BLOB_MEM_GUEST};

use crate::server::VgpuGuest;

const PAGE: u64 = 4096;
const RESP_OK_NODATA: u32 = 0x1100;

/// A guest blob: `pieces` page-aligned pieces of guest RAM, allocated in reverse order so
/// that the blob is scattered.
#[derive(Debug, Clone)]
pub struct ComputeBlob {
    /// Its resource id.
    pub id: u32,
    /// (guest-physical address, length) in blob order.
    pub entries: Vec<(u64, u32)>,
}

impl ComputeBlob {
    /// Allocates the pieces and creates the blob (RESOURCE_CREATE_BLOB must succeed).
    pub fn create(guest: &mut VgpuGuest, id: u32, pieces: usize, piece: u32) -> ComputeBlob {
        let mut entries: Vec<(u64, u32)> = (0..pieces)
            .map(|_| {
                (
                    guest.ram.alloc(u64::from(piece), PAGE).expect("guest RAM"),
                    piece,
                )
            })
            .collect();
        entries.reverse();
        let blob = ComputeBlob { id, entries };
        let create = virtio_gpu::resource_create_blob(
            id,
            BLOB_MEM_GUEST,
            BLOB_FLAG_USE_MAPPABLE,
            u64::from(blob.capacity()),
            &blob.entries,
        );
        assert_eq!(guest.control_header(&create).ctrl_type, RESP_OK_NODATA);
        blob
    }

    /// Its size, the reply capacity its submits give.
    pub fn capacity(&self) -> u32 {
        self.entries.iter().map(|&(_, n)| n).sum()
    }

    /// Writes `bytes` from its start.
    pub fn write(&self, guest: &mut VgpuGuest, bytes: &[u8]) {
        let qt = guest.vm.qtest();
        let mut at = 0;
        for &(addr, len) in &self.entries {
            if at == bytes.len() {
                return;
            }
            let n = (len as usize).min(bytes.len() - at);
            qt.memwrite(addr, &bytes[at..at + n]).expect("memwrite");
            at += n;
        }
        assert_eq!(at, bytes.len(), "{} bytes do not fit the blob", bytes.len());
    }

    /// Reads `len` bytes from its start.
    pub fn read(&self, guest: &mut VgpuGuest, len: usize) -> Vec<u8> {
        let qt = guest.vm.qtest();
        let mut out = Vec::with_capacity(len);
        for &(addr, piece) in &self.entries {
            if out.len() == len {
                break;
            }
            let n = (piece as usize).min(len - out.len());
            out.extend(qt.memread(addr, n).expect("memread"));
        }
        out
    }

    /// Writes `req` framed at the start (after spoiling the old reply's length, so stale
    /// bytes never pass for a reply); returns the fenced SUBMIT_3D of context `ctx` that sends
    /// it.
    pub fn put(&self, guest: &mut VgpuGuest, ctx: u32, req: &Request, fence: u64) -> Vec<u8> {
        let bytes = req.encode();
        self.write(guest, &[0xff; 4]);
        self.write(guest, &bytes);
        virtio_gpu::with_fence(
            virtio_gpu::compute_submit(ctx, self.id, bytes.len() as u32, self.capacity()),
            fence,
        )
    }

    /// The reply the device wrote at the start.
    pub fn reply(&self, guest: &mut VgpuGuest) -> Reply {
        let len = u32::from_le_bytes(self.read(guest, 4).try_into().expect("4 bytes")) as usize;
        assert!(len + 4 <= self.capacity() as usize, "reply of {len} bytes");
        let framed = self.read(guest, 4 + len);
        Reply::decode(&framed[4..]).expect("a reply")
    }

    /// One exchange of compute context `ctx`: the request in, a fenced submit (its completion
    /// means the reply is in), the reply out.
    pub fn exchange(&self, guest: &mut VgpuGuest, ctx: u32, req: &Request) -> Reply {
        let submit = self.put(guest, ctx, req, 7);
        assert_eq!(
            guest.control_header(&submit).ctrl_type,
            RESP_OK_NODATA,
            "{req:?}"
        );
        self.reply(guest)
    }
}
