//! Descriptor chains: a chain popped from a virtqueue is validated as a whole before the device
//! acts on it (hop 3 of the data path).
//!
//! A [`CheckedChain`] has every descriptor inside guest memory, device-readable descriptors
//! before device-writable ones, a bounded request size, no INDIRECT descriptor, and no loop (the
//! walk stops after as many descriptors as the queue has; a chain still pointing onwards then
//! is refused). Only then is the request copied out, into a buffer of the size just validated.
//!
//! The descriptor table is walked here rather than through virtio-queue's `DescriptorChain`
//! iterator, because that iterator follows VIRTQ_DESC_F_INDIRECT transparently (up to a
//! 65535-entry table per descriptor) and this device never offers VIRTIO_F_INDIRECT_DESC: a
//! driver that sets the flag anyway breaks the specification (virtio 1.2, 2.7.5.3.1), and the
//! walk refuses it before reading the table it names.

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

/// Largest device-readable part of one request. The largest virtio-gpu requests are SUBMIT_3D
/// command streams (Mesa's virgl winsys flushes its command buffer at 256 KiB) and
/// ATTACH_BACKING entry lists (16 bytes per page); 1 MiB covers both with room to spare and
/// bounds the copy a guest can make us do per chain.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// Size of one split-ring descriptor in the descriptor table.
const DESCRIPTOR_SIZE: u64 = std::mem::size_of::<Descriptor>() as u64;

/// Why a chain is refused: each is a driver bug or an attack, and resets the device.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    /// The head index names no descriptor, or a descriptor could not be read.
    #[error("chain at head {0} has no readable descriptor")]
    Empty(u16),
    /// The chain loops or points past the table (the TTL ran out).
    #[error("chain at head {0} loops or is longer than the queue")]
    Truncated(u16),
    /// A descriptor's buffer is not inside guest memory.
    #[error("descriptor buffer {addr:#x}+{len:#x} is outside guest memory")]
    OutsideMemory {
        /// Buffer address.
        addr: u64,
        /// Buffer length.
        len: u32,
    },
    /// A device-readable descriptor follows a device-writable one.
    #[error("chain at head {0} has a readable descriptor after a writable one")]
    ReadableAfterWritable(u16),
    /// A descriptor has VIRTQ_DESC_F_INDIRECT, which the device does not offer.
    #[error("chain at head {0} has an INDIRECT descriptor (VIRTIO_F_INDIRECT_DESC not offered)")]
    Indirect(u16),
    /// The readable part exceeds [`MAX_REQUEST_BYTES`].
    #[error("request of more than {MAX_REQUEST_BYTES} bytes")]
    TooLarge,
    /// Guest memory failed between validation and access (a concurrent unmap).
    #[error("guest memory access failed: {0}")]
    Memory(String),
}

/// Where a queue's descriptor table is: what a chain walk needs besides the head index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescTable {
    /// Guest address of the table.
    pub addr: GuestAddress,
    /// Entries in the table (the queue size).
    pub size: u16,
}

/// Fills `out` from the device-readable descriptors `readable`, in order (they hold at least
/// `out.len()` bytes).
fn gather<M: GuestMemory>(
    mem: &M,
    readable: &[Descriptor],
    out: &mut [u8],
) -> Result<(), ChainError> {
    let mut rest = out;
    for desc in readable {
        if rest.is_empty() {
            break;
        }
        let n = rest.len().min(desc.len() as usize);
        let (chunk, tail) = rest.split_at_mut(n);
        mem.read_slice(chunk, desc.addr())
            .map_err(|e| ChainError::Memory(e.to_string()))?;
        rest = tail;
    }
    Ok(())
}

/// A validated descriptor chain: the request bytes and where the response goes.
#[derive(Debug)]
pub struct CheckedChain {
    head: u16,
    request: Vec<u8>,
    writable: Vec<(GuestAddress, u32)>,
}

impl CheckedChain {
    /// Validates the chain starting at `head` of `table` against `mem` and copies its
    /// device-readable part, at most `bound(ty)` bytes of it, where `ty` is the request's first
    /// 32-bit word (its command type): what the command can use. Reads at most `table.size`
    /// descriptors.
    pub fn new<M: GuestMemory>(
        mem: &M,
        table: DescTable,
        head: u16,
        bound: impl FnOnce(u32) -> usize,
    ) -> Result<CheckedChain, ChainError> {
        let mut readable: Vec<Descriptor> = Vec::new();
        let mut writable = Vec::new();
        let mut request_len = 0usize;
        let mut index = head;
        let mut ended = false;
        for walked in 0..table.size {
            let broken = || {
                if walked == 0 {
                    ChainError::Empty(head)
                } else {
                    ChainError::Truncated(head)
                }
            };
            if index >= table.size {
                return Err(broken());
            }
            let desc: Descriptor = table
                .addr
                .checked_add(u64::from(index) * DESCRIPTOR_SIZE)
                .and_then(|at| mem.read_obj(at).ok())
                .ok_or_else(broken)?;
            if desc.refers_to_indirect_table() {
                return Err(ChainError::Indirect(head));
            }
            let len = desc.len();
            let access = if desc.is_write_only() {
                Permissions::Write
            } else {
                Permissions::Read
            };
            if !mem.check_range(desc.addr(), len as usize, access) {
                return Err(ChainError::OutsideMemory {
                    addr: desc.addr().0,
                    len,
                });
            }
            if desc.is_write_only() {
                writable.push((desc.addr(), len));
            } else {
                if !writable.is_empty() {
                    return Err(ChainError::ReadableAfterWritable(head));
                }
                request_len = request_len
                    .checked_add(len as usize)
                    .filter(|&n| n <= MAX_REQUEST_BYTES)
                    .ok_or(ChainError::TooLarge)?;
                readable.push(desc);
            }
            if !desc.has_next() {
                ended = true;
                break;
            }
            index = desc.next();
        }
        if !ended {
            return Err(if table.size == 0 {
                ChainError::Empty(head)
            } else {
                ChainError::Truncated(head)
            });
        }
        let mut ty = [0u8; 4];
        let ty_len = ty.len().min(request_len);
        gather(mem, &readable, &mut ty[..ty_len])?;
        let copy_len = request_len.min(bound(u32::from_le_bytes(ty)));
        let mut request = vec![0u8; copy_len];
        gather(mem, &readable, &mut request)?;
        #[cfg(test)]
        held::add(request.len());
        Ok(CheckedChain {
            head,
            request,
            writable,
        })
    }

    /// Index of the chain's head descriptor (what the used ring reports).
    pub fn head(&self) -> u16 {
        self.head
    }

    /// The device-readable bytes.
    pub fn request(&self) -> &[u8] {
        &self.request
    }

    /// Total size of the device-writable buffers.
    pub fn response_capacity(&self) -> u64 {
        self.writable.iter().map(|&(_, len)| u64::from(len)).sum()
    }

    /// Writes `response` into the device-writable buffers, as far as they reach; returns the
    /// number of bytes written (the used-ring length).
    pub fn write_response<M: GuestMemory>(
        &self,
        mem: &M,
        response: &[u8],
    ) -> Result<u32, ChainError> {
        let mut rest = response;
        let mut written = 0u32;
        for &(addr, len) in &self.writable {
            if rest.is_empty() {
                break;
            }
            let n = rest.len().min(len as usize);
            mem.write_slice(&rest[..n], addr)
                .map_err(|e| ChainError::Memory(e.to_string()))?;
            rest = &rest[n..];
            // n <= len, a u32.
            written += n as u32;
        }
        Ok(written)
    }
}

#[cfg(test)]
impl Drop for CheckedChain {
    fn drop(&mut self) {
        held::sub(self.request.len());
    }
}

/// Request bytes held in [`CheckedChain`]s on this thread, and their peak: what a test
/// measures to show how many copies the device holds at once.
#[cfg(test)]
pub(crate) mod held {
    use std::cell::Cell;

    thread_local! {
        static NOW: Cell<usize> = const { Cell::new(0) };
        static PEAK: Cell<usize> = const { Cell::new(0) };
    }

    pub(super) fn add(n: usize) {
        let now = NOW.get() + n;
        NOW.set(now);
        PEAK.set(PEAK.get().max(now));
    }

    pub(super) fn sub(n: usize) {
        NOW.set(NOW.get() - n);
    }

    /// The most request bytes held at once on this thread since the last [`reset_peak`].
    pub(crate) fn peak() -> usize {
        PEAK.get()
    }

    /// Starts a new peak measurement from what is held now.
    pub(crate) fn reset_peak() {
        PEAK.set(NOW.get());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{RawDescriptor, split::Descriptor as SplitDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{Queue, QueueOwnedT, QueueT};
    use vm_memory::GuestMemoryMmap;

    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const F_INDIRECT: u16 = 4;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    /// Publishes the chain `descs` (addr, len, flags, next) at head 0 and pops it.
    fn walk(
        m: &GuestMemoryMmap,
        descs: &[(u64, u32, u16, u16)],
    ) -> Result<CheckedChain, ChainError> {
        let vq = MockSplitQueue::new(m, 16);
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            let d = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
            vq.desc_table().store(i as u16, d).unwrap();
        }
        vq.avail().ring().ref_at(0).unwrap().store(0);
        vq.avail().idx().store(1);
        let mut q: Queue = vq.create_queue().unwrap();
        let head = q.iter(m).unwrap().next().unwrap().head_index();
        let table = DescTable {
            addr: GuestAddress(q.desc_table()),
            size: q.size(),
        };
        CheckedChain::new(m, table, head, |_| usize::MAX)
    }

    #[test]
    fn request_and_response_round_trip() {
        let m = mem();
        m.write_slice(&[1, 2, 3, 4], GuestAddress(0x8000)).unwrap();
        m.write_slice(&[5, 6], GuestAddress(0x9000)).unwrap();
        let c = walk(
            &m,
            &[
                (0x8000, 4, F_NEXT, 1),
                (0x9000, 2, F_NEXT, 2),
                (0xa000, 3, F_WRITE | F_NEXT, 3),
                (0xb000, 8, F_WRITE, 0),
            ],
        )
        .unwrap();
        assert_eq!(c.request(), &[1, 2, 3, 4, 5, 6]);
        assert_eq!(c.response_capacity(), 11);
        assert_eq!(c.write_response(&m, &[9; 5]).unwrap(), 5);
        let mut out = [0u8; 3];
        m.read_slice(&mut out, GuestAddress(0xb000)).unwrap();
        assert_eq!(out, [9, 9, 0]);
        assert_eq!(
            c.write_response(&m, &[7; 40]).unwrap(),
            11,
            "clipped to the writable buffers"
        );
    }

    #[test]
    fn refuses_buffers_outside_memory() {
        let m = mem();
        assert_eq!(
            walk(&m, &[(0x20_0000, 24, 0, 0)]).unwrap_err(),
            ChainError::OutsideMemory {
                addr: 0x20_0000,
                len: 24
            }
        );
        assert!(matches!(
            walk(&m, &[(0xf_fff0, 0x20, 0, 0)]),
            Err(ChainError::OutsideMemory { .. })
        ));
        assert!(matches!(
            walk(&m, &[(u64::MAX - 4, 8, 0, 0)]),
            Err(ChainError::OutsideMemory { .. })
        ));
    }

    #[test]
    fn refuses_loops_and_bad_next() {
        let m = mem();
        assert_eq!(
            walk(&m, &[(0x8000, 4, F_NEXT, 1), (0x8000, 4, F_NEXT, 0)]).unwrap_err(),
            ChainError::Truncated(0)
        );
        assert_eq!(
            walk(&m, &[(0x8000, 4, F_NEXT, 0)]).unwrap_err(),
            ChainError::Truncated(0)
        );
        assert_eq!(
            walk(&m, &[(0x8000, 4, F_NEXT, 999)]).unwrap_err(),
            ChainError::Truncated(0)
        );
    }

    #[test]
    fn refuses_readable_after_writable_and_oversized_requests() {
        let m = mem();
        assert_eq!(
            walk(&m, &[(0x8000, 4, F_WRITE | F_NEXT, 1), (0x9000, 4, 0, 0)]).unwrap_err(),
            ChainError::ReadableAfterWritable(0)
        );
        let big = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap();
        assert_eq!(
            walk(
                &big,
                &[(0x1_0000, 0x8_0000, F_NEXT, 1), (0x10_0000, 0x8_0001, 0, 0)]
            )
            .unwrap_err(),
            ChainError::TooLarge
        );
    }

    #[test]
    fn refuses_indirect_descriptors_without_reading_their_table() {
        let m = mem();
        // A 65535-entry indirect table of valid one-descriptor requests: virtio-queue's own
        // iterator would walk into it; the device never offered VIRTIO_F_INDIRECT_DESC.
        for i in 0..4u64 {
            let d = SplitDescriptor::new(0x8000, 4, 0, 0);
            m.write_obj(d, GuestAddress(0x1_0000 + i * 16)).unwrap();
        }
        let table_len = 0xffff * 16;
        assert_eq!(
            walk(&m, &[(0x1_0000, table_len, F_INDIRECT, 0)]).unwrap_err(),
            ChainError::Indirect(0)
        );
        assert_eq!(
            walk(
                &m,
                &[
                    (0x8000, 4, F_NEXT, 1),
                    (0x1_0000, 64, F_INDIRECT | F_NEXT, 2)
                ]
            )
            .unwrap_err(),
            ChainError::Indirect(0),
            "an INDIRECT descriptor after the head"
        );
    }

    #[test]
    fn copies_at_most_the_bound_of_the_command_type() {
        let m = mem();
        let request: Vec<u8> = (0..64u8).collect();
        m.write_slice(&request[..3], GuestAddress(0x8000)).unwrap();
        m.write_slice(&request[3..], GuestAddress(0x9000)).unwrap();
        let table = DescTable {
            addr: GuestAddress(0x1_0000),
            size: 4,
        };
        m.write_obj(SplitDescriptor::new(0x8000, 3, F_NEXT, 1), table.addr)
            .unwrap();
        m.write_obj(
            SplitDescriptor::new(0x9000, 61, 0, 0),
            table.addr.unchecked_add(16),
        )
        .unwrap();
        // The type word spans both descriptors.
        let mut seen = None;
        let c = CheckedChain::new(&m, table, 0, |ty| {
            seen = Some(ty);
            10
        })
        .unwrap();
        assert_eq!(seen, Some(u32::from_le_bytes([0, 1, 2, 3])));
        assert_eq!(c.request(), &request[..10]);
        let c = CheckedChain::new(&m, table, 0, |_| 1000).unwrap();
        assert_eq!(
            c.request(),
            &request[..],
            "a bound past the request copies it whole"
        );
    }

    #[test]
    fn copies_only_after_validation() {
        let m = mem();
        held::reset_peak();
        let before = held::peak();
        // A request whose last descriptor points past the table: refused before any copy.
        assert!(walk(&m, &[(0x8000, 16, F_NEXT, 1), (0x8000, 16, F_NEXT, 999)]).is_err());
        assert_eq!(held::peak(), before, "nothing copied for a refused chain");
        let c = walk(&m, &[(0x8000, 16, 0, 0)]).unwrap();
        assert_eq!(held::peak(), before + 16);
        drop(c);
    }
}
