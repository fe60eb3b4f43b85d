//! vfio-user frames from the client, checked before the `vfio-user` crate's message loop sees
//! them (hop 2; libvfio-user's `is_valid_header` and `is_valid_region_access`).
//!
//! The crate trusts what the client says: it allocates a REGION_READ or REGION_WRITE's `count`
//! before any handler runs, subtracts from a VERSION's `message_size` unchecked and unwraps its
//! capability string, and reads each command's fixed part whatever `message_size` claims. The
//! relay ([`crate::relay`]) therefore frames every message itself and asks this module, in two
//! steps, whether to pass it on:
//!
//! 1. [`check_header`], before any payload is read: flags, a known and supported command,
//!    `message_size` between the command's fixed part and its named maximum, posting allowed,
//!    and how many file descriptors came with it. Nothing bigger than that maximum is read.
//! 2. [`check_payload`], on the bounded payload: region accesses within the region table,
//!    SET_IRQS within the interrupt table, the VERSION capability string terminated once.
//!
//! [`FrameError::unframeable`] tells which refusals leave the stream out of step (the relay
//! then closes the connection); the others get an error reply ([`error_reply`]) when the
//! message expects one. Pure: no I/O, no unsafe.

/// Size of the header every vfio-user message starts with: message id (u16), command (u16),
/// message size (u32), flags (u32), error (u32), little-endian.
pub const HEADER_SIZE: usize = 16;

/// The largest data transfer a client may send in one message: the `max_data_xfer_size` the
/// crate's VERSION reply advertises (the protocol's default, 1 MiB). QEMU splits larger
/// accesses to honour it.
pub const MAX_DATA_XFER_BYTES: u32 = 1 << 20;

/// The largest frame whose payload the relay reads to stay in step with the stream (and then
/// discards when the message is refused): a region access header and [`MAX_DATA_XFER_BYTES`]
/// of data, the biggest message a client that honours the negotiation can send. A
/// `message_size` beyond it is not skipped through: the connection is closed.
pub const MAX_FRAME_BYTES: u32 = REGION_ACCESS_SIZE + MAX_DATA_XFER_BYTES;

/// The largest VERSION capability string (JSON, with its terminating NUL). QEMU's is about
/// 200 bytes; 4 KiB leaves room for capabilities added later and still bounds the crate's
/// parse.
pub const MAX_VERSION_BYTES: u32 = 4096;

/// File descriptors a client may attach to one message: the `max_msg_fds` the crate's VERSION
/// reply advertises (its default, 1). QEMU sends SET_IRQS eventfds in messages of at most this
/// many; DMA_MAP carries one file.
pub const MAX_MSG_FDS: usize = 1;

/// Fixed part of VERSION: header, major (u16), minor (u16).
const VERSION_FIXED: u32 = 20;
/// DMA_MAP: header, argsz, flags, offset, address, size.
const DMA_MAP_SIZE: u32 = 48;
/// DMA_UNMAP: header, argsz, flags, address, size (no dirty bitmap: not supported).
const DMA_UNMAP_SIZE: u32 = 40;
/// DEVICE_GET_INFO: header, argsz, flags, num_regions, num_irqs.
const DEVICE_GET_INFO_SIZE: u32 = 32;
/// DEVICE_GET_REGION_INFO: header and a `vfio_region_info`.
const GET_REGION_INFO_SIZE: u32 = 48;
/// DEVICE_GET_IRQ_INFO: header, argsz, flags, index, count.
const GET_IRQ_INFO_SIZE: u32 = 32;
/// DEVICE_SET_IRQS: header, argsz, flags, index, start, count (eventfds travel as SCM_RIGHTS,
/// boolean data is not supported).
const SET_IRQS_SIZE: u32 = 36;
/// REGION_READ/REGION_WRITE: header, offset (u64), region (u32), count (u32); a write's data
/// follows.
const REGION_ACCESS_SIZE: u32 = 32;

/// Type bits of the header flags.
const FLAG_TYPE_MASK: u32 = 0xf;
/// Type of a reply.
const FLAG_REPLY: u32 = 1;
/// The sender expects no reply (a posted write).
const FLAG_NO_REPLY: u32 = 1 << 4;
/// The reply reports an error.
const FLAG_ERROR: u32 = 1 << 5;

/// `VFIO_IRQ_SET_DATA_EVENTFD`: SET_IRQS carries eventfds.
const IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;

/// `EINVAL`, the error an invalid request is answered with.
pub const EINVAL: u32 = 22;

/// A vfio-user message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Message id, echoed by the reply.
    pub id: u16,
    /// Command code.
    pub command: u16,
    /// Size of the whole message, header included.
    pub size: u32,
    /// Type, no-reply and error flags.
    pub flags: u32,
    /// errno of an error reply.
    pub error: u32,
}

impl Header {
    /// Decodes a header.
    pub fn parse(bytes: &[u8; HEADER_SIZE]) -> Header {
        let u16_at = |i: usize| u16::from_le_bytes([bytes[i], bytes[i + 1]]);
        let u32_at =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        Header {
            id: u16_at(0),
            command: u16_at(2),
            size: u32_at(4),
            flags: u32_at(8),
            error: u32_at(12),
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut out = [0u8; HEADER_SIZE];
        out[0..2].copy_from_slice(&self.id.to_le_bytes());
        out[2..4].copy_from_slice(&self.command.to_le_bytes());
        out[4..8].copy_from_slice(&self.size.to_le_bytes());
        out[8..12].copy_from_slice(&self.flags.to_le_bytes());
        out[12..16].copy_from_slice(&self.error.to_le_bytes());
        out
    }

    /// The sender expects no reply.
    pub fn posted(&self) -> bool {
        self.flags & FLAG_NO_REPLY != 0
    }

    /// The same message as a request that expects a reply (the no-reply flag cleared).
    pub fn as_request(&self) -> Header {
        Header {
            flags: self.flags & !FLAG_NO_REPLY,
            ..*self
        }
    }

    /// Bytes after the header, or `None` when `size` is below the header's own.
    pub fn payload_len(&self) -> Option<usize> {
        usize::try_from(self.size).ok()?.checked_sub(HEADER_SIZE)
    }
}

/// The error reply to `request`: same id and command, reply and error flags, `errno`.
pub fn error_reply(request: &Header, errno: u32) -> [u8; HEADER_SIZE] {
    Header {
        id: request.id,
        command: request.command,
        size: HEADER_SIZE as u32,
        flags: FLAG_REPLY | FLAG_ERROR,
        error: errno,
    }
    .encode()
}

/// vfio-user commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// VFIO_USER_VERSION.
    Version,
    /// VFIO_USER_DMA_MAP.
    DmaMap,
    /// VFIO_USER_DMA_UNMAP.
    DmaUnmap,
    /// VFIO_USER_DEVICE_GET_INFO.
    DeviceGetInfo,
    /// VFIO_USER_DEVICE_GET_REGION_INFO.
    GetRegionInfo,
    /// VFIO_USER_DEVICE_GET_REGION_IO_FDS (not supported).
    GetRegionIoFds,
    /// VFIO_USER_DEVICE_GET_IRQ_INFO.
    GetIrqInfo,
    /// VFIO_USER_DEVICE_SET_IRQS.
    SetIrqs,
    /// VFIO_USER_REGION_READ.
    RegionRead,
    /// VFIO_USER_REGION_WRITE.
    RegionWrite,
    /// VFIO_USER_DMA_READ (server to client only).
    DmaRead,
    /// VFIO_USER_DMA_WRITE (server to client only).
    DmaWrite,
    /// VFIO_USER_DEVICE_RESET.
    DeviceReset,
    /// VFIO_USER_DIRTY_PAGES (migration, not supported).
    DirtyPages,
}

impl Command {
    /// The command with code `code`.
    pub fn from_code(code: u16) -> Option<Command> {
        Some(match code {
            1 => Command::Version,
            2 => Command::DmaMap,
            3 => Command::DmaUnmap,
            4 => Command::DeviceGetInfo,
            5 => Command::GetRegionInfo,
            6 => Command::GetRegionIoFds,
            7 => Command::GetIrqInfo,
            8 => Command::SetIrqs,
            9 => Command::RegionRead,
            10 => Command::RegionWrite,
            11 => Command::DmaRead,
            12 => Command::DmaWrite,
            13 => Command::DeviceReset,
            14 => Command::DirtyPages,
            _ => return None,
        })
    }
}

/// What a command may look like on the wire.
struct Rule {
    /// Smallest `message_size`.
    min: u32,
    /// Largest `message_size`.
    max: u32,
    /// May be sent with no-reply (the crate answers the others' no-reply with an error).
    may_post: bool,
    /// File descriptors it may carry.
    fds: usize,
}

impl Rule {
    const fn fixed(size: u32, may_post: bool, fds: usize) -> Rule {
        Rule {
            min: size,
            max: size,
            may_post,
            fds,
        }
    }
}

/// The device's region and interrupt tables, as reported to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    region_sizes: Vec<u64>,
    irq_counts: Vec<u32>,
}

impl Limits {
    /// Limits of a device with these region sizes and interrupt counts, by index.
    pub fn new(region_sizes: Vec<u64>, irq_counts: Vec<u32>) -> Limits {
        Limits {
            region_sizes,
            irq_counts,
        }
    }

    /// The largest data one region access may carry.
    fn max_access(&self) -> u32 {
        let largest = self.region_sizes.iter().copied().max().unwrap_or(0);
        u32::try_from(largest).map_or(MAX_DATA_XFER_BYTES, |l| l.min(MAX_DATA_XFER_BYTES))
    }

    fn rule(&self, command: Command) -> Option<Rule> {
        Some(match command {
            Command::Version => Rule {
                min: VERSION_FIXED + 1,
                max: VERSION_FIXED + MAX_VERSION_BYTES,
                may_post: false,
                fds: 0,
            },
            Command::DmaMap => Rule::fixed(DMA_MAP_SIZE, true, 1),
            Command::DmaUnmap => Rule::fixed(DMA_UNMAP_SIZE, true, 0),
            Command::DeviceGetInfo => Rule::fixed(DEVICE_GET_INFO_SIZE, false, 0),
            Command::GetRegionInfo => Rule::fixed(GET_REGION_INFO_SIZE, false, 0),
            Command::GetIrqInfo => Rule::fixed(GET_IRQ_INFO_SIZE, false, 0),
            Command::SetIrqs => Rule::fixed(SET_IRQS_SIZE, true, MAX_MSG_FDS),
            Command::RegionRead => Rule::fixed(REGION_ACCESS_SIZE, false, 0),
            Command::RegionWrite => Rule {
                min: REGION_ACCESS_SIZE,
                max: REGION_ACCESS_SIZE + self.max_access(),
                may_post: true,
                fds: 0,
            },
            Command::DeviceReset => Rule::fixed(HEADER_SIZE as u32, true, 0),
            Command::GetRegionIoFds
            | Command::DmaRead
            | Command::DmaWrite
            | Command::DirtyPages => return None,
        })
    }
}

/// Whether an access of `count` bytes at `offset` lies inside a region of `size` bytes (and
/// is not empty). Shared with the backend's own check ([`crate::transport::check_access`]).
pub fn access_within(size: u64, offset: u64, count: u64) -> bool {
    count != 0 && offset.checked_add(count).is_some_and(|end| end <= size)
}

/// Why a client message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// `message_size` is smaller than the header.
    #[error("message size {0} is below the {HEADER_SIZE}-byte header")]
    TooShort(u32),
    /// `message_size` is beyond [`MAX_FRAME_BYTES`].
    #[error("message size {0} is beyond the {MAX_FRAME_BYTES}-byte frame limit")]
    TooLarge(u32),
    /// The flags are not those of a command (a reply, an error, unknown bits).
    #[error("flags {0:#x} are not those of a command")]
    NotACommand(u32),
    /// No such command.
    #[error("unknown command {0}")]
    Unknown(u16),
    /// A command the server does not implement.
    #[error("{0:?} is not supported")]
    Unsupported(Command),
    /// `message_size` outside the command's bounds.
    #[error("{command:?} of {size} bytes, expected {min}..={max}")]
    Size {
        /// The command.
        command: Command,
        /// Its `message_size`.
        size: u32,
        /// Smallest allowed.
        min: u32,
        /// Largest allowed.
        max: u32,
    },
    /// No-reply set on a command that must be answered.
    #[error("{0:?} cannot be posted")]
    Posted(Command),
    /// More file descriptors than the command carries.
    #[error("{command:?} with {fds} file descriptors, at most {max}")]
    Fds {
        /// The command.
        command: Command,
        /// Descriptors received.
        fds: usize,
        /// Descriptors allowed.
        max: usize,
    },
    /// A region access outside the region table.
    #[error("access of {count} bytes at {offset:#x} of region {region} ({size:#x} bytes)")]
    Region {
        /// Region index.
        region: u32,
        /// Offset.
        offset: u64,
        /// Bytes.
        count: u32,
        /// The region's size (0 for no such region).
        size: u64,
    },
    /// A REGION_WRITE whose data is not `count` bytes.
    #[error("write of {count} bytes carries {data} bytes of data")]
    WriteData {
        /// The count it claims.
        count: u32,
        /// The data it has.
        data: usize,
    },
    /// A GET_IRQ_INFO or SET_IRQS outside the interrupt table.
    #[error("interrupts {start}+{count} of index {index} ({available} available)")]
    Irqs {
        /// Interrupt index.
        index: u32,
        /// First vector.
        start: u32,
        /// Vectors.
        count: u32,
        /// Vectors the index has (0 for no such index).
        available: u32,
    },
    /// SET_IRQS with more eventfds than vectors, or with descriptors but not eventfd data.
    #[error("SET_IRQS of {count} vectors (flags {flags:#x}) with {fds} file descriptors")]
    IrqFds {
        /// Vectors.
        count: u32,
        /// SET_IRQS flags.
        flags: u32,
        /// Descriptors received.
        fds: usize,
    },
    /// The VERSION capability string is not one NUL-terminated string.
    #[error("VERSION capabilities are not a NUL-terminated string")]
    Capabilities,
}

impl FrameError {
    /// The stream cannot be followed past this message: the relay closes the connection
    /// instead of answering. (A posted message is never answered either.)
    pub fn unframeable(&self) -> bool {
        matches!(
            self,
            FrameError::TooShort(_) | FrameError::TooLarge(_) | FrameError::NotACommand(_)
        )
    }
}

/// Checks a header, with `fds` descriptors received alongside it, before its payload is read.
/// On success the payload is at most the command's maximum and may be read.
pub fn check_header(header: &Header, fds: usize, limits: &Limits) -> Result<(), FrameError> {
    if (header.size as usize) < HEADER_SIZE {
        return Err(FrameError::TooShort(header.size));
    }
    if header.size > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(header.size));
    }
    if header.flags & !FLAG_NO_REPLY != 0 || header.flags & FLAG_TYPE_MASK != 0 {
        return Err(FrameError::NotACommand(header.flags));
    }
    let command = Command::from_code(header.command).ok_or(FrameError::Unknown(header.command))?;
    let rule = limits
        .rule(command)
        .ok_or(FrameError::Unsupported(command))?;
    if header.size < rule.min || header.size > rule.max {
        return Err(FrameError::Size {
            command,
            size: header.size,
            min: rule.min,
            max: rule.max,
        });
    }
    if header.posted() && !rule.may_post {
        return Err(FrameError::Posted(command));
    }
    if fds > rule.fds {
        return Err(FrameError::Fds {
            command,
            fds,
            max: rule.fds,
        });
    }
    Ok(())
}

/// Reads the little-endian u32 at `at` of `payload`.
fn u32_at(payload: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&payload[at..at + 4]);
    u32::from_le_bytes(word)
}

/// The fields of a REGION_READ or REGION_WRITE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionAccess<'a> {
    /// The region index.
    pub region: u32,
    /// The offset in the region.
    pub offset: u64,
    /// Bytes to access.
    pub count: u32,
    /// A write's data (whatever follows the fixed part).
    pub data: &'a [u8],
}

/// Decodes the payload of a REGION_READ/REGION_WRITE; `None` if it is shorter than the fixed
/// part (never after [`check_header`]).
pub fn region_access(payload: &[u8]) -> Option<RegionAccess<'_>> {
    let data = payload.get((REGION_ACCESS_SIZE as usize - HEADER_SIZE)..)?;
    let mut offset = [0u8; 8];
    offset.copy_from_slice(&payload[0..8]);
    Some(RegionAccess {
        region: u32_at(payload, 8),
        offset: u64::from_le_bytes(offset),
        count: u32_at(payload, 12),
        data,
    })
}

/// Checks the payload (everything after the header) of a message whose header passed
/// [`check_header`].
pub fn check_payload(
    header: &Header,
    payload: &[u8],
    fds: usize,
    limits: &Limits,
) -> Result<(), FrameError> {
    // check_header bounded the size by the command's fixed part, so the fields below exist.
    match Command::from_code(header.command) {
        Some(Command::Version) => {
            let caps = &payload[(VERSION_FIXED as usize - HEADER_SIZE)..];
            match caps.iter().position(|&b| b == 0) {
                Some(nul) if nul + 1 == caps.len() => Ok(()),
                _ => Err(FrameError::Capabilities),
            }
        }
        Some(Command::GetRegionInfo) => {
            // vfio_region_info: argsz, flags, index, ...
            let index = u32_at(payload, 8);
            match limits.region_sizes.get(index as usize) {
                Some(_) => Ok(()),
                None => Err(FrameError::Region {
                    region: index,
                    offset: 0,
                    count: 0,
                    size: 0,
                }),
            }
        }
        Some(Command::GetIrqInfo) => {
            // argsz, flags, index, count
            let index = u32_at(payload, 8);
            match limits.irq_counts.get(index as usize) {
                Some(_) => Ok(()),
                None => Err(FrameError::Irqs {
                    index,
                    start: 0,
                    count: 0,
                    available: 0,
                }),
            }
        }
        Some(Command::SetIrqs) => {
            // argsz, flags, index, start, count
            let (flags, index) = (u32_at(payload, 4), u32_at(payload, 8));
            let (start, count) = (u32_at(payload, 12), u32_at(payload, 16));
            let available = limits.irq_counts.get(index as usize).copied();
            if start
                .checked_add(count)
                .is_none_or(|end| available.is_none_or(|a| end > a))
            {
                return Err(FrameError::Irqs {
                    index,
                    start,
                    count,
                    available: available.unwrap_or(0),
                });
            }
            if fds > count as usize || (fds > 0 && flags & IRQ_SET_DATA_EVENTFD == 0) {
                return Err(FrameError::IrqFds { count, flags, fds });
            }
            Ok(())
        }
        Some(command @ (Command::RegionRead | Command::RegionWrite)) => {
            let Some(RegionAccess {
                region,
                offset,
                count,
                data,
            }) = region_access(payload)
            else {
                return Err(FrameError::WriteData {
                    count: 0,
                    data: payload.len(),
                });
            };
            let size = limits
                .region_sizes
                .get(region as usize)
                .copied()
                .unwrap_or(0);
            if !access_within(size, offset, u64::from(count)) {
                return Err(FrameError::Region {
                    region,
                    offset,
                    count,
                    size,
                });
            }
            let expected = if command == Command::RegionWrite {
                count as usize
            } else {
                0
            };
            if data.len() != expected {
                return Err(FrameError::WriteData {
                    count,
                    data: data.len(),
                });
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Config space 256 bytes (index 7 of 9), BAR 4 16 KiB; INTx 1, MSI-X 3 of 5 indices.
    fn limits() -> Limits {
        let mut regions = vec![0u64; 9];
        regions[4] = 0x4000;
        regions[7] = 256;
        Limits::new(regions, vec![1, 0, 3, 0, 0])
    }

    fn header(command: u16, size: u32, flags: u32) -> Header {
        Header {
            id: 7,
            command,
            size,
            flags,
            error: 0,
        }
    }

    fn access(region: u32, offset: u64, count: u32) -> Vec<u8> {
        let mut p = offset.to_le_bytes().to_vec();
        p.extend_from_slice(&region.to_le_bytes());
        p.extend_from_slice(&count.to_le_bytes());
        p
    }

    /// Runs both checks on a whole message.
    fn check(command: u16, flags: u32, payload: &[u8], fds: usize) -> Result<(), FrameError> {
        let h = header(command, (HEADER_SIZE + payload.len()) as u32, flags);
        check_header(&h, fds, &limits())?;
        check_payload(&h, payload, fds, &limits())
    }

    fn write(region: u32, offset: u64, data: &[u8]) -> Result<(), FrameError> {
        let mut p = access(region, offset, data.len() as u32);
        p.extend_from_slice(data);
        check(10, FLAG_NO_REPLY, &p, 0)
    }

    #[test]
    fn header_round_trips() {
        let h = header(9, 32, FLAG_NO_REPLY);
        assert_eq!(Header::parse(&h.encode()), h);
        let reply = Header::parse(&error_reply(&h, EINVAL));
        assert_eq!(
            (reply.id, reply.command, reply.size, reply.error),
            (7, 9, 16, EINVAL)
        );
        assert_eq!(reply.flags, FLAG_REPLY | FLAG_ERROR);
        assert_eq!(header(1, 15, 0).payload_len(), None);
        assert!(!h.as_request().posted());
        assert_eq!(h.as_request().encode()[8..12], [0; 4]);
        assert_eq!(header(1, 20, 0).payload_len(), Some(4));
    }

    #[test]
    fn sizes_outside_the_frame_limits_close_the_stream() {
        for size in [0, 15] {
            let e = check_header(&header(13, size, 0), 0, &limits()).unwrap_err();
            assert_eq!(e, FrameError::TooShort(size));
            assert!(e.unframeable());
        }
        for size in [MAX_FRAME_BYTES + 1, 0xffff_ff20, u32::MAX] {
            let e = check_header(&header(10, size, 0), 0, &limits()).unwrap_err();
            assert_eq!(e, FrameError::TooLarge(size));
            assert!(e.unframeable());
        }
        // A reply, an error or unknown flag bits from the client.
        for flags in [FLAG_REPLY, FLAG_ERROR, 1 << 8, FLAG_REPLY | FLAG_NO_REPLY] {
            let e = check_header(&header(13, 16, flags), 0, &limits()).unwrap_err();
            assert_eq!(e, FrameError::NotACommand(flags));
            assert!(e.unframeable());
        }
    }

    #[test]
    fn unknown_and_unsupported_commands_are_answered() {
        for code in [0, 15, 0xffff] {
            let e = check_header(&header(code, 16, 0), 0, &limits()).unwrap_err();
            assert_eq!(e, FrameError::Unknown(code));
            assert!(!e.unframeable());
        }
        for (code, command) in [
            (6, Command::GetRegionIoFds),
            (11, Command::DmaRead),
            (12, Command::DmaWrite),
            (14, Command::DirtyPages),
        ] {
            assert_eq!(
                check_header(&header(code, 64, 0), 0, &limits()),
                Err(FrameError::Unsupported(command))
            );
        }
    }

    #[test]
    fn fixed_size_commands_have_exactly_their_size() {
        for (code, size) in [
            (2, 48),
            (3, 40),
            (4, 32),
            (5, 48),
            (7, 32),
            (8, 36),
            (9, 32),
            (13, 16),
        ] {
            let command = Command::from_code(code).unwrap();
            assert_eq!(check_header(&header(code, size, 0), 0, &limits()), Ok(()));
            for wrong in [size - 1, size + 1].into_iter().filter(|&w| w >= 16) {
                assert!(
                    matches!(
                        check_header(&header(code, wrong, 0), 0, &limits()),
                        Err(FrameError::Size { command: c, size: s, .. }) if c == command && s == wrong
                    ),
                    "{command:?} of {wrong} bytes"
                );
            }
        }
    }

    #[test]
    fn only_commands_without_a_reply_payload_may_be_posted() {
        for code in [2, 3, 8, 13] {
            let size = match code {
                2 => 48,
                3 => 40,
                8 => 36,
                _ => 16,
            };
            assert_eq!(
                check_header(&header(code, size, FLAG_NO_REPLY), 0, &limits()),
                Ok(())
            );
        }
        for (code, size) in [(1, 64), (4, 32), (5, 48), (7, 32), (9, 32)] {
            assert_eq!(
                check_header(&header(code, size, FLAG_NO_REPLY), 0, &limits()),
                Err(FrameError::Posted(Command::from_code(code).unwrap()))
            );
        }
    }

    #[test]
    fn descriptors_only_where_the_command_carries_them() {
        assert_eq!(check_header(&header(2, 48, 0), 1, &limits()), Ok(()));
        assert_eq!(
            check_header(&header(2, 48, 0), 2, &limits()),
            Err(FrameError::Fds {
                command: Command::DmaMap,
                fds: 2,
                max: 1
            })
        );
        assert_eq!(
            check_header(&header(8, 36, 0), MAX_MSG_FDS + 1, &limits()),
            Err(FrameError::Fds {
                command: Command::SetIrqs,
                fds: MAX_MSG_FDS + 1,
                max: MAX_MSG_FDS
            })
        );
        for (code, size) in [(3, 40), (9, 32), (13, 16), (4, 32)] {
            assert!(matches!(
                check_header(&header(code, size, 0), 1, &limits()),
                Err(FrameError::Fds { fds: 1, max: 0, .. })
            ));
        }
        assert!(matches!(
            check_header(&header(10, 36, FLAG_NO_REPLY), 3, &limits()),
            Err(FrameError::Fds { fds: 3, .. })
        ));
    }

    #[test]
    fn version_capabilities_are_one_terminated_string() {
        let version = |caps: &[u8]| {
            let mut p = vec![0, 0, 1, 0];
            p.extend_from_slice(caps);
            check(1, 0, &p, 0)
        };
        assert_eq!(version(b"{\"capabilities\":{}}\0"), Ok(()));
        assert_eq!(
            version(b"\0"),
            Ok(()),
            "empty JSON is the crate's to refuse"
        );
        assert_eq!(version(b"{}"), Err(FrameError::Capabilities), "no NUL");
        assert_eq!(version(b"{}\0{}\0"), Err(FrameError::Capabilities));
        assert_eq!(version(b"{\0}\0"), Err(FrameError::Capabilities));
        // Short: no capabilities at all, or not even major and minor.
        for size in [16, 18, 20] {
            assert!(matches!(
                check_header(&header(1, size, 0), 0, &limits()),
                Err(FrameError::Size {
                    command: Command::Version,
                    ..
                })
            ));
        }
        let largest = VERSION_FIXED + MAX_VERSION_BYTES;
        assert_eq!(check_header(&header(1, largest, 0), 0, &limits()), Ok(()));
        assert!(matches!(
            check_header(&header(1, largest + 1, 0), 0, &limits()),
            Err(FrameError::Size { .. })
        ));
    }

    #[test]
    fn region_accesses_stay_inside_the_region_table() {
        let read =
            |region: u32, offset: u64, count: u32| check(9, 0, &access(region, offset, count), 0);
        assert_eq!(read(7, 0, 256), Ok(()));
        assert_eq!(read(4, 0x3ffc, 4), Ok(()));
        assert_eq!(read(4, 0, 3), Ok(()), "widths are the backend's to check");
        let out = |region, offset, count, size| {
            Err(FrameError::Region {
                region,
                offset,
                count,
                size,
            })
        };
        assert_eq!(read(7, 255, 2), out(7, 255, 2, 256), "past the end");
        assert_eq!(
            read(7, 0, 257),
            out(7, 0, 257, 256),
            "bigger than the region"
        );
        assert_eq!(read(4, 0x4000, 4), out(4, 0x4000, 4, 0x4000));
        assert_eq!(read(4, u64::MAX - 1, 4), out(4, u64::MAX - 1, 4, 0x4000));
        assert_eq!(read(0, 0, 4), out(0, 0, 4, 0), "a region without registers");
        assert_eq!(read(42, 0, 4), out(42, 0, 4, 0), "no such region");
        assert_eq!(read(4, 0, 0), out(4, 0, 0, 0x4000), "no bytes");
        assert_eq!(
            read(4, 0, 0xffff_ff00),
            out(4, 0, 0xffff_ff00, 0x4000),
            "a huge count is refused before anything is allocated"
        );

        assert_eq!(write(4, 0x14, &[1]), Ok(()));
        assert_eq!(write(7, 0, &[0; 256]), Ok(()));
        assert_eq!(write(4, 0x3ffe, &[0; 4]), out(4, 0x3ffe, 4, 0x4000));
        assert_eq!(write(2, 0, &[0; 4]), out(2, 0, 4, 0));
        // The data must be exactly `count` bytes.
        let mut p = access(4, 0x14, 4);
        p.extend_from_slice(&[0; 2]);
        assert_eq!(
            check(10, 0, &p, 0),
            Err(FrameError::WriteData { count: 4, data: 2 })
        );
        let mut p = access(4, 0x14, 1);
        p.extend_from_slice(&[0; 2]);
        assert_eq!(
            check(10, 0, &p, 0),
            Err(FrameError::WriteData { count: 1, data: 2 })
        );
        // A write claiming 0xffff_ff00 bytes with a short message: refused on the region, and
        // a message that size does not frame.
        assert!(matches!(
            check(10, 0, &access(4, 0, 0xffff_ff00), 0),
            Err(FrameError::Region { .. })
        ));
        let max = REGION_ACCESS_SIZE + 0x4000;
        assert_eq!(check_header(&header(10, max, 0), 0, &limits()), Ok(()));
        assert!(matches!(
            check_header(&header(10, max + 1, 0), 0, &limits()),
            Err(FrameError::Size { .. })
        ));
    }

    #[test]
    fn interrupts_stay_inside_the_interrupt_table() {
        let set = |flags: u32, index: u32, start: u32, count: u32, fds: usize| {
            let mut p = Vec::new();
            for v in [20, flags, index, start, count] {
                p.extend_from_slice(&u32::to_le_bytes(v));
            }
            check(8, 0, &p, fds)
        };
        let eventfd = IRQ_SET_DATA_EVENTFD | 0x20; // ACTION_TRIGGER
        assert_eq!(set(eventfd, 2, 0, 1, 1), Ok(()));
        assert_eq!(set(eventfd, 2, 2, 1, 1), Ok(()), "the last MSI-X vector");
        assert_eq!(set(eventfd, 2, 0, 3, 0), Ok(()), "all vectors, no fds");
        assert_eq!(set(0x21, 2, 0, 0, 0), Ok(()), "disable all");
        let irqs = |index, start, count, available| {
            Err(FrameError::Irqs {
                index,
                start,
                count,
                available,
            })
        };
        assert_eq!(set(eventfd, 2, 3, 1, 1), irqs(2, 3, 1, 3));
        assert_eq!(set(eventfd, 2, 0, 4, 0), irqs(2, 0, 4, 3));
        assert_eq!(set(eventfd, 2, u32::MAX, 2, 0), irqs(2, u32::MAX, 2, 3));
        assert_eq!(set(eventfd, 9, 0, 1, 1), irqs(9, 0, 1, 0));
        assert_eq!(
            set(eventfd, 1, 0, 1, 0),
            irqs(1, 0, 1, 0),
            "MSI, not offered"
        );
        assert_eq!(
            set(eventfd, 0, 0, 0, 1),
            Err(FrameError::IrqFds {
                count: 0,
                flags: eventfd,
                fds: 1
            })
        );
        assert_eq!(
            set(0x21, 2, 0, 1, 1),
            Err(FrameError::IrqFds {
                count: 1,
                flags: 0x21,
                fds: 1
            }),
            "descriptors without eventfd data"
        );

        let info = |index: u32| {
            let mut p = Vec::new();
            for v in [16, 0, index, 0] {
                p.extend_from_slice(&u32::to_le_bytes(v));
            }
            check(7, 0, &p, 0)
        };
        assert_eq!(info(4), Ok(()));
        assert_eq!(info(5), irqs(5, 0, 0, 0));
        let region_info = |index: u32| {
            let mut p = Vec::new();
            for v in [32u32, 0, index, 0, 0, 0, 0, 0] {
                p.extend_from_slice(&v.to_le_bytes());
            }
            check(5, 0, &p, 0)
        };
        assert_eq!(region_info(8), Ok(()));
        assert!(matches!(
            region_info(9),
            Err(FrameError::Region { region: 9, .. })
        ));
    }

    #[test]
    fn access_within_is_checked_arithmetic() {
        assert!(access_within(16, 0, 16));
        assert!(access_within(16, 15, 1));
        assert!(!access_within(16, 16, 1));
        assert!(!access_within(16, 0, 0));
        assert!(!access_within(16, u64::MAX, 2));
        assert!(!access_within(0, 0, 1));
    }
}
