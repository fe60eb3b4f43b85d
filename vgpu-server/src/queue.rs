//! Descriptor chains: a chain popped from a virtqueue is validated as a whole before the device
//! acts on it (hop 3 of the data path).
//!
//! A [`CheckedChain`] has every descriptor inside guest memory, device-readable descriptors
//! before device-writable ones, a bounded request size, and no loop (virtio-queue's TTL stops a
//! walk after as many descriptors as the queue has; a chain still pointing onwards then is
//! refused). Only then is the request copied out.

use virtio_queue::DescriptorChain;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

/// Largest device-readable part of one request. The largest virtio-gpu requests are SUBMIT_3D
/// command streams (Mesa's virgl winsys flushes its command buffer at 256 KiB) and
/// ATTACH_BACKING entry lists (16 bytes per page); 1 MiB covers both with room to spare and
/// bounds the copy a guest can make us do per chain.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

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
    /// The readable part exceeds [`MAX_REQUEST_BYTES`].
    #[error("request of more than {MAX_REQUEST_BYTES} bytes")]
    TooLarge,
    /// Guest memory failed between validation and access (a concurrent unmap).
    #[error("guest memory access failed: {0}")]
    Memory(String),
}

/// A validated descriptor chain: the request bytes and where the response goes.
#[derive(Debug)]
pub struct CheckedChain {
    head: u16,
    request: Vec<u8>,
    writable: Vec<(GuestAddress, u32)>,
}

impl CheckedChain {
    /// Validates `chain` against `mem` and copies its device-readable part.
    pub fn new<M, D>(chain: DescriptorChain<D>, mem: &M) -> Result<CheckedChain, ChainError>
    where
        M: GuestMemory,
        D: std::ops::Deref<Target = M>,
    {
        let head = chain.head_index();
        let mut readable: Vec<Descriptor> = Vec::new();
        let mut writable = Vec::new();
        let mut request_len = 0usize;
        let mut last: Option<Descriptor> = None;
        for desc in chain {
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
            last = Some(desc);
        }
        match last {
            None => return Err(ChainError::Empty(head)),
            Some(d) if d.has_next() => return Err(ChainError::Truncated(head)),
            Some(_) => {}
        }
        let mut request = vec![0u8; request_len];
        let mut at = 0;
        for desc in readable {
            let end = at + desc.len() as usize;
            mem.read_slice(&mut request[at..end], desc.addr())
                .map_err(|e| ChainError::Memory(e.to_string()))?;
            at = end;
        }
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
mod tests {
    use super::*;
    use virtio_queue::desc::{RawDescriptor, split::Descriptor as SplitDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{Queue, QueueOwnedT};
    use vm_memory::GuestMemoryMmap;

    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;

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
        let chain = q.iter(m).unwrap().next().unwrap();
        CheckedChain::new(chain, m)
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
}
