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
        let blob = ComputeBlob::allocate(guest, id, pieces, piece);
        assert_eq!(
            guest.control_header(&blob.create_request()).ctrl_type,
            RESP_OK_NODATA
        );
        blob
    }

    /// Allocates the pieces in guest RAM without creating the blob (see
    /// [`ComputeBlob::create_request`]).
    pub fn allocate(guest: &mut VgpuGuest, id: u32, pieces: usize, piece: u32) -> ComputeBlob {
        let mut entries: Vec<(u64, u32)> = (0..pieces)
            .map(|_| {
                (
                    guest.ram.alloc(u64::from(piece), PAGE).expect("guest RAM"),
                    piece,
                )
            })
            .collect();
        entries.reverse();
        ComputeBlob { id, entries }
    }

    /// The RESOURCE_CREATE_BLOB that creates it (again, after a device reset).
    pub fn create_request(&self) -> Vec<u8> {
        virtio_gpu::resource_create_blob(
            self.id,
            BLOB_MEM_GUEST,
            BLOB_FLAG_USE_MAPPABLE,
            u64::from(self.capacity()),
            &self.entries,
        )
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
        self.put_message(guest, ctx, &req.encode(), fence)
    }

    /// [`ComputeBlob::put`] of a framed message given as bytes (which a guest may craft by
    /// hand, e.g. nestings `Request::encode` would need deep recursion for).
    pub fn put_message(
        &self,
        guest: &mut VgpuGuest,
        ctx: u32,
        message: &[u8],
        fence: u64,
    ) -> Vec<u8> {
        self.write(guest, &[0xff; 4]);
        self.write(guest, message);
        virtio_gpu::with_fence(
            virtio_gpu::compute_submit(ctx, self.id, message.len() as u32, self.capacity()),
            fence,
        )
    }

    /// The reply the device wrote at the start.
    pub fn reply(&self, guest: &mut VgpuGuest) -> Reply {
        self.try_reply(guest).expect("a reply")
    }

    /// The reply the device wrote at the start, or why there is none (the stale length
    /// [`ComputeBlob::put`] left, or bytes that do not decode).
    pub fn try_reply(&self, guest: &mut VgpuGuest) -> Result<Reply, String> {
        let head: [u8; 4] = self
            .read(guest, 4)
            .try_into()
            .map_err(|_| "a blob of under 4 bytes")?;
        let len = u32::from_le_bytes(head) as usize;
        if len
            .checked_add(4)
            .is_none_or(|n| n > self.capacity() as usize)
        {
            return Err(format!("no reply written (length word {len:#x})"));
        }
        let framed = self.read(guest, 4 + len);
        Reply::decode(&framed[4..]).map_err(|e| format!("reply does not decode: {e}"))
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
