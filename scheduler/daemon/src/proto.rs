//! The wire protocol between a device process (`vgpu-server`, one per VM) and the scheduler
//! daemon (DESIGN §2).
//!
//! The transport is a Unix `SOCK_SEQPACKET` socket carrying one message per packet, so message
//! boundaries are preserved and this module works on byte slices only: [`encode`] appends one
//! message to a buffer, [`decode`] parses one received packet. It does no I/O.
//!
//! Every message is a 12-byte little-endian header followed by its payload:
//!
//! | offset | size | field                                   |
//! |--------|------|-----------------------------------------|
//! | 0      | 4    | magic, [`MAGIC`] (`"VGS1"`)             |
//! | 4      | 2    | kind, a [`Kind`]                        |
//! | 6      | 2    | flags, must be 0                        |
//! | 8      | 4    | payload length in bytes                 |
//!
//! A packet is at most [`MAX_MESSAGE_BYTES`] long. Payload fields follow in the order the
//! [`Msg`] variants list them, without padding; integers are little-endian, enums one byte (or
//! four for [`RefuseCode`]), text a `u16` byte count and that many UTF-8 bytes.
//!
//! The peer is untrusted (a device process serves an untrusted guest): [`decode`] checks the
//! header first, then the payload (exact length, no trailing bytes, enum values in range, text
//! valid and bounded) and returns an error instead of a message for anything else. A receiver
//! should read into a buffer of at least `MAX_MESSAGE_BYTES + 1` bytes (or use `MSG_TRUNC`) so an
//! oversized packet is seen as such rather than silently truncated.
//!
//! [`Session`] holds the daemon side's connection-level rule: `Hello` first and once, `Bye`
//! last. Which groups a device has in flight is tracked by the daemon core, not here.

use std::fmt;

use thiserror::Error;
use vgpu_scheduler::{CostSignature, Decision, GroupId, GroupKind, Nanos, Time, VgpuId};

/// The header's magic number: `"VGS1"` in little-endian byte order.
pub const MAGIC: u32 = 0x3153_4756;

/// The protocol version a device announces in `Hello` and the daemon confirms in `Welcome`.
pub const PROTOCOL_VERSION: u32 = 3;

/// The size of the message header in bytes.
pub const HEADER_BYTES: usize = 12;

/// The largest packet, header included. The largest valid message is far smaller; the bound
/// lets a receiver use one fixed buffer and reject anything bigger before looking at it.
pub const MAX_MESSAGE_BYTES: usize = 4096;

/// The longest VM name in bytes: enough for any libvirt-style domain name, short enough that
/// names stay readable in logs and the control CLI's tables.
pub const MAX_NAME_BYTES: usize = 64;

/// The longest `Refused` detail in bytes: one log line's worth of explanation.
pub const MAX_DETAIL_BYTES: usize = 200;

/// The largest process id accepted: ids are handed to `libc` as `pid_t` (an `i32`), where a
/// negative value would name a process group instead of a process.
pub const MAX_PID: u32 = i32::MAX as u32;

/// The most groups one device may have queued or in flight at the daemon (submitted or
/// dispatched and not yet completed, done or cancelled). Both sides use it: a device refuses
/// guest work beyond it (the guest sees an error response, the VM stays scheduled), so the daemon,
/// which refuses a device that goes past it, never has to. A device's queues hold far fewer
/// groups than this in normal operation (one control queue of 256 descriptors, load submits of at
/// most a few hundred groups); the daemon's own per-vGPU limit is above it.
pub const MAX_GROUPS_PER_DEVICE: usize = 1024;

/// Bit set in the kind of every message sent by the daemon to a device.
const TO_DEVICE: u16 = 0x8000;

/// Everything that can be wrong with a message, or with where it arrived in a session.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtoError {
    /// The packet is longer than [`MAX_MESSAGE_BYTES`].
    #[error("message of {0} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")]
    TooLong(usize),
    /// The packet is shorter than the header.
    #[error("message of {0} bytes is shorter than the {HEADER_BYTES}-byte header")]
    ShortHeader(usize),
    /// The magic number is wrong.
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// Reserved flags are set.
    #[error("reserved flags {0:#06x} set")]
    BadFlags(u16),
    /// The kind names no message.
    #[error("unknown message kind {0:#06x}")]
    UnknownKind(u16),
    /// The header's payload length disagrees with the packet's.
    #[error("header declares a {declared}-byte payload, packet carries {actual}")]
    LengthMismatch {
        /// The length in the header.
        declared: u32,
        /// The payload bytes actually present.
        actual: usize,
    },
    /// The payload ended before the message did.
    #[error("{0} payload is truncated")]
    Truncated(Kind),
    /// The payload continues after the message ended.
    #[error("{kind} payload has {count} trailing bytes")]
    TrailingBytes {
        /// The message.
        kind: Kind,
        /// How many bytes were left over.
        count: usize,
    },
    /// A field holds a value outside its range (an enum value, a process id).
    #[error("field {field} has invalid value {value}")]
    BadValue {
        /// The field.
        field: &'static str,
        /// The value received.
        value: u64,
    },
    /// A text field is empty where it may not be, too long, not UTF-8 or has forbidden
    /// characters.
    #[error("field {field} is not valid text: {reason}")]
    BadText {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A group finished before it started.
    #[error("finish {finish} precedes start {start}")]
    BadTimes {
        /// The start time.
        start: Time,
        /// The finish time.
        finish: Time,
    },
    /// A daemon-to-device message arrived at the daemon.
    #[error("{0} is not a message a device may send")]
    WrongDirection(Kind),
    /// The first message of a session is not `Hello`.
    #[error("{0} before Hello")]
    HelloRequired(Kind),
    /// A second `Hello` arrived.
    #[error("second Hello in one session")]
    DuplicateHello,
    /// A message arrived after `Bye`.
    #[error("{0} after Bye")]
    Closed(Kind),
    /// The device speaks another protocol version.
    #[error("protocol version {0} is not {PROTOCOL_VERSION}")]
    VersionMismatch(u32),
}

impl ProtoError {
    /// The code the daemon answers this error with in a `Refused` message.
    pub fn refuse_code(&self) -> RefuseCode {
        match self {
            ProtoError::HelloRequired(_) | ProtoError::DuplicateHello | ProtoError::Closed(_) => {
                RefuseCode::OutOfOrder
            }
            ProtoError::VersionMismatch(_) => RefuseCode::VersionMismatch,
            _ => RefuseCode::BadMessage,
        }
    }
}

/// The message kinds, as the header's kind field numbers them. Kinds sent by the daemon have
/// the high bit set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Kind {
    /// [`Msg::Hello`].
    Hello = 0x0001,
    /// [`Msg::Submit`].
    Submit = 0x0002,
    /// [`Msg::Dispatched`].
    Dispatched = 0x0003,
    /// [`Msg::Completed`].
    Completed = 0x0004,
    /// [`Msg::Frame`].
    Frame = 0x0005,
    /// [`Msg::Bye`].
    Bye = 0x0006,
    /// [`Msg::Cancel`].
    Cancel = 0x0007,
    /// [`Msg::Memory`].
    Memory = 0x0008,
    /// [`Msg::Welcome`].
    Welcome = TO_DEVICE | 0x0001,
    /// [`Msg::Grant`].
    Grant = TO_DEVICE | 0x0002,
    /// [`Msg::Done`].
    Done = TO_DEVICE | 0x0003,
    /// [`Msg::Lease`].
    Lease = TO_DEVICE | 0x0004,
    /// [`Msg::Revoke`].
    Revoke = TO_DEVICE | 0x0005,
    /// [`Msg::Suspend`].
    Suspend = TO_DEVICE | 0x0006,
    /// [`Msg::Resume`].
    Resume = TO_DEVICE | 0x0007,
    /// [`Msg::Present`].
    Present = TO_DEVICE | 0x0008,
    /// [`Msg::Refused`].
    Refused = TO_DEVICE | 0x0009,
}

impl Kind {
    /// Every kind, for lookups and tests.
    const ALL: [Kind; 17] = [
        Kind::Hello,
        Kind::Submit,
        Kind::Dispatched,
        Kind::Completed,
        Kind::Frame,
        Kind::Bye,
        Kind::Cancel,
        Kind::Memory,
        Kind::Welcome,
        Kind::Grant,
        Kind::Done,
        Kind::Lease,
        Kind::Revoke,
        Kind::Suspend,
        Kind::Resume,
        Kind::Present,
        Kind::Refused,
    ];

    /// The kind numbered `raw`, if any.
    pub fn from_u16(raw: u16) -> Option<Kind> {
        Kind::ALL.into_iter().find(|&k| k as u16 == raw)
    }

    /// True for messages the daemon sends to a device, false for those a device sends.
    pub fn to_device(self) -> bool {
        self as u16 & TO_DEVICE != 0
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Where a command group runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Exec {
    /// The device runs it on its GPU and reports `Completed`.
    Device = 0,
    /// The daemon's simulated engine runs it for its `cost_ns` and reports `Done`.
    Simulated = 1,
}

impl Exec {
    fn from_u8(raw: u8) -> Option<Exec> {
        match raw {
            0 => Some(Exec::Device),
            1 => Some(Exec::Simulated),
            _ => None,
        }
    }
}

/// Why the daemon refused a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum RefuseCode {
    /// The message did not decode.
    BadMessage = 1,
    /// The device speaks another protocol version.
    VersionMismatch = 2,
    /// The message names a group the device has not in flight.
    UnknownGroup = 3,
    /// The message reuses the id of a group the device has in flight.
    DuplicateGroup = 4,
    /// The device has as many groups in flight as it may.
    QueueFull = 5,
    /// The daemon serves as many vGPUs as it may.
    TooManyVgpus = 6,
    /// Another connected device uses this VM name.
    NameInUse = 7,
    /// The message is not allowed at this point of the session.
    OutOfOrder = 8,
    /// The daemon failed to carry out a valid request.
    Internal = 9,
    /// A group granted or dispatched by the device did not complete within the daemon's group
    /// timeout: the device is dropped and its groups written off.
    Timeout = 10,
    /// `Dispatched` while the device holds no lease (nor is within the grace after a Revoke).
    NotLeased = 11,
    /// The device may not use what it asked for: a VM name bound to another user or reserved
    /// for another process, or a QEMU pid it cannot prove.
    Forbidden = 12,
}

impl RefuseCode {
    fn from_u32(raw: u32) -> Option<RefuseCode> {
        Some(match raw {
            1 => RefuseCode::BadMessage,
            2 => RefuseCode::VersionMismatch,
            3 => RefuseCode::UnknownGroup,
            4 => RefuseCode::DuplicateGroup,
            5 => RefuseCode::QueueFull,
            6 => RefuseCode::TooManyVgpus,
            7 => RefuseCode::NameInUse,
            8 => RefuseCode::OutOfOrder,
            9 => RefuseCode::Internal,
            10 => RefuseCode::Timeout,
            11 => RefuseCode::NotLeased,
            12 => RefuseCode::Forbidden,
            _ => return None,
        })
    }
}

/// The wire value of a group kind.
pub fn group_kind_to_u8(kind: GroupKind) -> u8 {
    match kind {
        GroupKind::Render => 0,
        GroupKind::Transfer => 1,
        GroupKind::Compute => 2,
        GroupKind::Load => 3,
        GroupKind::Present => 4,
    }
}

/// The group kind a wire value stands for, if any.
pub fn group_kind_from_u8(raw: u8) -> Option<GroupKind> {
    Some(match raw {
        0 => GroupKind::Render,
        1 => GroupKind::Transfer,
        2 => GroupKind::Compute,
        3 => GroupKind::Load,
        4 => GroupKind::Present,
        _ => return None,
    })
}

/// Checks a text field: at most `max` bytes, at least one if `!empty_ok`, no control
/// characters.
fn check_text(field: &'static str, s: &str, max: usize, empty_ok: bool) -> Result<(), ProtoError> {
    let bad = |reason| Err(ProtoError::BadText { field, reason });
    if s.is_empty() && !empty_ok {
        return bad("empty");
    }
    if s.len() > max {
        return bad("too long");
    }
    if s.chars().any(char::is_control) {
        return bad("control character");
    }
    Ok(())
}

/// A VM name as the protocol carries it: 1 to [`MAX_NAME_BYTES`] bytes of UTF-8 without control
/// characters. It must also be usable in a TimeGraph spec line `<name:...>`, so it may not
/// contain `:`, `<` or `>` nor start or end with whitespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VmName(String);

/// Whether `name` can be one plain directory entry the daemon makes from it (a cgroup, a
/// definition file): 1 to `max_len` bytes of ASCII letters, digits, `_`, `-` and `.`, not
/// starting with `.` (so neither `.`, `..` nor hidden).
pub fn is_plain_name(name: &str, max_len: usize) -> bool {
    !name.is_empty()
        && name.len() <= max_len
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

impl VmName {
    /// The name `name`, if valid.
    pub fn new(name: &str) -> Result<VmName, ProtoError> {
        check_text("vm_name", name, MAX_NAME_BYTES, false)?;
        if name.contains([':', '<', '>']) {
            return Err(ProtoError::BadText {
                field: "vm_name",
                reason: "':', '<' or '>'",
            });
        }
        if name.trim() != name {
            return Err(ProtoError::BadText {
                field: "vm_name",
                reason: "leading or trailing whitespace",
            });
        }
        Ok(VmName(name.to_owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for VmName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The explanation in a `Refused` message: at most [`MAX_DETAIL_BYTES`] bytes of UTF-8 without
/// control characters, possibly empty.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Detail(String);

impl Detail {
    /// The detail `text`, if valid.
    pub fn new(text: &str) -> Result<Detail, ProtoError> {
        check_text("detail", text, MAX_DETAIL_BYTES, true)?;
        Ok(Detail(text.to_owned()))
    }

    /// A detail made from any text (an error's message): control characters become spaces and
    /// the text is cut at a character boundary to fit [`MAX_DETAIL_BYTES`].
    pub fn lossy(text: &str) -> Detail {
        let mut out = String::new();
        for ch in text.chars() {
            let ch = if ch.is_control() { ' ' } else { ch };
            if out.len().saturating_add(ch.len_utf8()) > MAX_DETAIL_BYTES {
                break;
            }
            out.push(ch);
        }
        Detail(out)
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One protocol message. Times are `CLOCK_MONOTONIC` nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Device to daemon, first in every session: who is connecting.
    Hello {
        /// The device's protocol version, [`PROTOCOL_VERSION`].
        version: u32,
        /// The VM's name.
        vm_name: VmName,
        /// The device process's pid, 1 to [`MAX_PID`].
        device_pid: u32,
        /// The QEMU process's pid, up to [`MAX_PID`]; 0 when unknown.
        qemu_pid: u32,
    },
    /// Device to daemon: a group asks to be dispatched.
    Submit {
        /// The group, unique among the device's groups in flight.
        group: GroupId,
        /// The guest context it runs in.
        context: u32,
        /// What it does.
        kind: GroupKind,
        /// Its cost signature.
        signature: CostSignature,
        /// Its expected GPU time; 0 when unknown.
        cost_ns: Nanos,
        /// Where it runs.
        exec: Exec,
    },
    /// Device to daemon: a group was dispatched under a lease, without asking.
    Dispatched {
        /// The group.
        group: GroupId,
        /// The guest context it runs in.
        context: u32,
        /// What it does.
        kind: GroupKind,
        /// Its cost signature.
        signature: CostSignature,
    },
    /// Device to daemon: a device-executed group ran on the GPU from `start` to `finish`.
    Completed {
        /// The group.
        group: GroupId,
        /// When the GPU started it.
        start: Time,
        /// When its fence signalled; not before `start`.
        finish: Time,
    },
    /// Device to daemon: the guest reached a frame boundary and wants to present.
    Frame,
    /// Device to daemon, last in a session: the device disconnects.
    Bye,
    /// Device to daemon: a submitted, granted or leased group will not complete (the guest
    /// reset the device or went away before it ran or while it ran). The daemon forgets it: a
    /// queued group leaves its queue, a group on the GPU leaves the GPU-online list at once.
    Cancel {
        /// The group.
        group: GroupId,
    },
    /// Device to daemon: the VM's memory budget (`--resource-memory-mb`: its GPU memory on the
    /// compute path, its GL resources, what its requests hold) stands at `used` of `limit`
    /// bytes. Sent when the figures change (the latest only), and once per session.
    Memory {
        /// Bytes in use; at most `limit`.
        used: u64,
        /// The budget.
        limit: u64,
    },
    /// Daemon to device: the answer to `Hello`.
    Welcome {
        /// The daemon's protocol version.
        version: u32,
        /// The vGPU the daemon gave the device.
        vgpu: VgpuId,
    },
    /// Daemon to device: dispatch this submitted group now.
    Grant {
        /// The group.
        group: GroupId,
    },
    /// Daemon to device: a `Simulated` group finished on the daemon's engine.
    Done {
        /// The group.
        group: GroupId,
        /// When the engine started it.
        start: Time,
        /// When it finished; not before `start`.
        finish: Time,
    },
    /// Daemon to device: dispatch without asking until revoked, until `until` or until
    /// `budget_ns` of GPU time is used.
    Lease {
        /// GPU time the device may use; 0 when unbounded.
        budget_ns: Nanos,
        /// When the lease ends; 0 when it does not.
        until: Time,
    },
    /// Daemon to device: the lease is withdrawn; ask again for every group.
    Revoke,
    /// Daemon to device: dispatch nothing until resumed.
    Suspend,
    /// Daemon to device: dispatch again.
    Resume,
    /// Daemon to device: release the pending present at `at`.
    Present {
        /// When to present.
        at: Time,
    },
    /// Daemon to device: the last message was refused.
    Refused {
        /// Why.
        code: RefuseCode,
        /// A human-readable explanation.
        detail: Detail,
    },
}

impl Msg {
    /// The message's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Msg::Hello { .. } => Kind::Hello,
            Msg::Submit { .. } => Kind::Submit,
            Msg::Dispatched { .. } => Kind::Dispatched,
            Msg::Completed { .. } => Kind::Completed,
            Msg::Frame => Kind::Frame,
            Msg::Bye => Kind::Bye,
            Msg::Cancel { .. } => Kind::Cancel,
            Msg::Memory { .. } => Kind::Memory,
            Msg::Welcome { .. } => Kind::Welcome,
            Msg::Grant { .. } => Kind::Grant,
            Msg::Done { .. } => Kind::Done,
            Msg::Lease { .. } => Kind::Lease,
            Msg::Revoke => Kind::Revoke,
            Msg::Suspend => Kind::Suspend,
            Msg::Resume => Kind::Resume,
            Msg::Present { .. } => Kind::Present,
            Msg::Refused { .. } => Kind::Refused,
        }
    }

    /// The message that carries out `decision` at its vGPU's device, with that vGPU, or `None`
    /// for decisions that are not sent to devices (`CpuWeight`).
    ///
    /// Every `Dispatch` becomes a `Grant`, leased or not: a leased dispatch may answer a
    /// `Submit` sent while the lease was on its way. (A device's own `Dispatched` gets no
    /// decision back from the scheduler core.) A lease with a budget of 0 or an end at time 0
    /// allows nothing and becomes `Revoke` (0 means "unbounded" on the wire).
    pub fn from_decision(decision: &Decision) -> Option<(VgpuId, Msg)> {
        Some(match *decision {
            Decision::Dispatch { vgpu, group, .. } => (vgpu, Msg::Grant { group }),
            Decision::Lease {
                vgpu,
                budget: Some(0),
                ..
            }
            | Decision::Lease {
                vgpu,
                until: Some(0),
                ..
            } => (vgpu, Msg::Revoke),
            Decision::Lease {
                vgpu,
                budget,
                until,
            } => (
                vgpu,
                Msg::Lease {
                    budget_ns: budget.unwrap_or(0),
                    until: until.unwrap_or(0),
                },
            ),
            Decision::Revoke { vgpu } => (vgpu, Msg::Revoke),
            Decision::Suspend { vgpu } => (vgpu, Msg::Suspend),
            Decision::Resume { vgpu } => (vgpu, Msg::Resume),
            Decision::Present { vgpu, at } => (vgpu, Msg::Present { at }),
            Decision::CpuWeight { .. } => return None,
        })
    }
}

/// Appends `text` with its `u16` byte count. Valid text is far below `u16::MAX` bytes.
fn put_text(out: &mut Vec<u8>, text: &str) {
    let len = u16::try_from(text.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

/// Appends `msg`, header and payload, to `out`.
///
/// Every [`Msg`] is valid by construction, so encoding cannot fail; the result is at most
/// [`MAX_MESSAGE_BYTES`] long.
pub fn encode(msg: &Msg, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&(msg.kind() as u16).to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    match msg {
        Msg::Hello {
            version,
            vm_name,
            device_pid,
            qemu_pid,
        } => {
            out.extend_from_slice(&version.to_le_bytes());
            put_text(out, vm_name.as_str());
            out.extend_from_slice(&device_pid.to_le_bytes());
            out.extend_from_slice(&qemu_pid.to_le_bytes());
        }
        Msg::Submit {
            group,
            context,
            kind,
            signature,
            cost_ns,
            exec,
        } => {
            out.extend_from_slice(&group.0.to_le_bytes());
            out.extend_from_slice(&context.to_le_bytes());
            out.push(group_kind_to_u8(*kind));
            out.extend_from_slice(&signature.0.to_le_bytes());
            out.extend_from_slice(&cost_ns.to_le_bytes());
            out.push(*exec as u8);
        }
        Msg::Dispatched {
            group,
            context,
            kind,
            signature,
        } => {
            out.extend_from_slice(&group.0.to_le_bytes());
            out.extend_from_slice(&context.to_le_bytes());
            out.push(group_kind_to_u8(*kind));
            out.extend_from_slice(&signature.0.to_le_bytes());
        }
        Msg::Completed {
            group,
            start,
            finish,
        }
        | Msg::Done {
            group,
            start,
            finish,
        } => {
            out.extend_from_slice(&group.0.to_le_bytes());
            out.extend_from_slice(&start.to_le_bytes());
            out.extend_from_slice(&finish.to_le_bytes());
        }
        Msg::Frame | Msg::Bye | Msg::Revoke | Msg::Suspend | Msg::Resume => {}
        Msg::Welcome { version, vgpu } => {
            out.extend_from_slice(&version.to_le_bytes());
            out.extend_from_slice(&vgpu.0.to_le_bytes());
        }
        Msg::Grant { group } | Msg::Cancel { group } => {
            out.extend_from_slice(&group.0.to_le_bytes())
        }
        Msg::Lease { budget_ns, until } => {
            out.extend_from_slice(&budget_ns.to_le_bytes());
            out.extend_from_slice(&until.to_le_bytes());
        }
        Msg::Memory { used, limit } => {
            out.extend_from_slice(&used.to_le_bytes());
            out.extend_from_slice(&limit.to_le_bytes());
        }
        Msg::Present { at } => out.extend_from_slice(&at.to_le_bytes()),
        Msg::Refused { code, detail } => {
            out.extend_from_slice(&(*code as u32).to_le_bytes());
            put_text(out, detail.as_str());
        }
    }
    // The largest payload (Refused) is 206 bytes: the length always fits.
    let payload = out.len().saturating_sub(start).saturating_sub(HEADER_BYTES);
    let len = u32::try_from(payload).unwrap_or(u32::MAX);
    if let Some(field) = out
        .get_mut(start..)
        .and_then(|header| header.get_mut(8..HEADER_BYTES))
    {
        field.copy_from_slice(&len.to_le_bytes());
    }
}

/// Reads a payload front to back; every read fails with `Truncated` past the end.
struct Reader<'a> {
    kind: Kind,
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if self.rest.len() < n {
            return Err(ProtoError::Truncated(self.kind));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ProtoError> {
        let mut a = [0; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, ProtoError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A `u16`-counted UTF-8 string of at most `max` bytes.
    fn text(&mut self, field: &'static str, max: usize) -> Result<&'a str, ProtoError> {
        let len = usize::from(self.u16()?);
        if len > max {
            return Err(ProtoError::BadText {
                field,
                reason: "too long",
            });
        }
        std::str::from_utf8(self.bytes(len)?).map_err(|_| ProtoError::BadText {
            field,
            reason: "not UTF-8",
        })
    }

    fn group_kind(&mut self) -> Result<GroupKind, ProtoError> {
        let raw = self.u8()?;
        group_kind_from_u8(raw).ok_or(ProtoError::BadValue {
            field: "kind",
            value: raw.into(),
        })
    }

    fn pid(&mut self, field: &'static str, min: u32) -> Result<u32, ProtoError> {
        let pid = self.u32()?;
        if !(min..=MAX_PID).contains(&pid) {
            return Err(ProtoError::BadValue {
                field,
                value: pid.into(),
            });
        }
        Ok(pid)
    }

    /// A group id and its start and finish times, `finish >= start`.
    fn times(&mut self) -> Result<(GroupId, Time, Time), ProtoError> {
        let group = GroupId(self.u64()?);
        let start = self.u64()?;
        let finish = self.u64()?;
        if finish < start {
            return Err(ProtoError::BadTimes { start, finish });
        }
        Ok((group, start, finish))
    }

    fn finish(self) -> Result<(), ProtoError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::TrailingBytes {
                kind: self.kind,
                count: self.rest.len(),
            })
        }
    }
}

/// Checks the header of `packet` and returns the message kind and the payload.
fn decode_header(packet: &[u8]) -> Result<(Kind, &[u8]), ProtoError> {
    if packet.len() > MAX_MESSAGE_BYTES {
        return Err(ProtoError::TooLong(packet.len()));
    }
    let (header, payload) = packet
        .split_first_chunk::<HEADER_BYTES>()
        .ok_or(ProtoError::ShortHeader(packet.len()))?;
    let [m0, m1, m2, m3, k0, k1, f0, f1, l0, l1, l2, l3] = *header;
    let magic = u32::from_le_bytes([m0, m1, m2, m3]);
    if magic != MAGIC {
        return Err(ProtoError::BadMagic(magic));
    }
    let flags = u16::from_le_bytes([f0, f1]);
    if flags != 0 {
        return Err(ProtoError::BadFlags(flags));
    }
    let raw_kind = u16::from_le_bytes([k0, k1]);
    let kind = Kind::from_u16(raw_kind).ok_or(ProtoError::UnknownKind(raw_kind))?;
    let declared = u32::from_le_bytes([l0, l1, l2, l3]);
    if usize::try_from(declared).ok() != Some(payload.len()) {
        return Err(ProtoError::LengthMismatch {
            declared,
            actual: payload.len(),
        });
    }
    Ok((kind, payload))
}

/// Parses one packet into a message, validating the header first and then the whole payload.
pub fn decode(packet: &[u8]) -> Result<Msg, ProtoError> {
    let (kind, payload) = decode_header(packet)?;
    let mut r = Reader {
        kind,
        rest: payload,
    };
    let msg = match kind {
        Kind::Hello => {
            let version = r.u32()?;
            let vm_name = VmName::new(r.text("vm_name", MAX_NAME_BYTES)?)?;
            let device_pid = r.pid("device_pid", 1)?;
            let qemu_pid = r.pid("qemu_pid", 0)?;
            Msg::Hello {
                version,
                vm_name,
                device_pid,
                qemu_pid,
            }
        }
        Kind::Submit => {
            let group = GroupId(r.u64()?);
            let context = r.u32()?;
            let kind = r.group_kind()?;
            let signature = CostSignature(r.u64()?);
            let cost_ns = r.u64()?;
            let raw = r.u8()?;
            let exec = Exec::from_u8(raw).ok_or(ProtoError::BadValue {
                field: "exec",
                value: raw.into(),
            })?;
            Msg::Submit {
                group,
                context,
                kind,
                signature,
                cost_ns,
                exec,
            }
        }
        Kind::Dispatched => Msg::Dispatched {
            group: GroupId(r.u64()?),
            context: r.u32()?,
            kind: r.group_kind()?,
            signature: CostSignature(r.u64()?),
        },
        Kind::Completed => {
            let (group, start, finish) = r.times()?;
            Msg::Completed {
                group,
                start,
                finish,
            }
        }
        Kind::Frame => Msg::Frame,
        Kind::Bye => Msg::Bye,
        Kind::Cancel => Msg::Cancel {
            group: GroupId(r.u64()?),
        },
        Kind::Memory => {
            let (used, limit) = (r.u64()?, r.u64()?);
            if used > limit {
                return Err(ProtoError::BadValue {
                    field: "used",
                    value: used,
                });
            }
            Msg::Memory { used, limit }
        }
        Kind::Welcome => Msg::Welcome {
            version: r.u32()?,
            vgpu: VgpuId(r.u32()?),
        },
        Kind::Grant => Msg::Grant {
            group: GroupId(r.u64()?),
        },
        Kind::Done => {
            let (group, start, finish) = r.times()?;
            Msg::Done {
                group,
                start,
                finish,
            }
        }
        Kind::Lease => Msg::Lease {
            budget_ns: r.u64()?,
            until: r.u64()?,
        },
        Kind::Revoke => Msg::Revoke,
        Kind::Suspend => Msg::Suspend,
        Kind::Resume => Msg::Resume,
        Kind::Present => Msg::Present { at: r.u64()? },
        Kind::Refused => {
            let raw = r.u32()?;
            let code = RefuseCode::from_u32(raw).ok_or(ProtoError::BadValue {
                field: "code",
                value: raw.into(),
            })?;
            let detail = Detail::new(r.text("detail", MAX_DETAIL_BYTES)?)?;
            Msg::Refused { code, detail }
        }
    };
    r.finish()?;
    Ok(msg)
}

/// Where a daemon-side session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SessionState {
    /// Connected; waiting for `Hello`.
    #[default]
    AwaitingHello,
    /// `Hello` accepted; any device message but `Hello` may follow.
    Open,
    /// `Bye` received; nothing more may follow.
    Closed,
}

/// The daemon side's connection-level rules: a device sends `Hello` first and only once, only
/// device-to-daemon messages, and nothing after `Bye`.
///
/// A rejected message leaves the state unchanged; whether to refuse and go on or to close the
/// connection is the caller's choice.
#[derive(Debug, Clone, Default)]
pub struct Session {
    state: SessionState,
}

impl Session {
    /// A session that waits for `Hello`.
    pub fn new() -> Session {
        Session::default()
    }

    /// Where the session stands.
    pub fn state(&self) -> SessionState {
        self.state
    }

    /// Checks that `msg` may arrive now and advances the session: `Hello` opens it (if its
    /// version is [`PROTOCOL_VERSION`]), `Bye` closes it.
    pub fn receive(&mut self, msg: &Msg) -> Result<(), ProtoError> {
        let kind = msg.kind();
        if kind.to_device() {
            return Err(ProtoError::WrongDirection(kind));
        }
        match (self.state, msg) {
            (SessionState::Closed, _) => Err(ProtoError::Closed(kind)),
            (SessionState::AwaitingHello, Msg::Hello { version, .. }) => {
                if *version != PROTOCOL_VERSION {
                    return Err(ProtoError::VersionMismatch(*version));
                }
                self.state = SessionState::Open;
                Ok(())
            }
            (SessionState::AwaitingHello, _) => Err(ProtoError::HelloRequired(kind)),
            (SessionState::Open, Msg::Hello { .. }) => Err(ProtoError::DuplicateHello),
            (SessionState::Open, Msg::Bye) => {
                self.state = SessionState::Closed;
                Ok(())
            }
            (SessionState::Open, _) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn name(s: &str) -> VmName {
        VmName::new(s).unwrap()
    }

    fn hello() -> Msg {
        Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: name("vm-1"),
            device_pid: 4242,
            qemu_pid: 0,
        }
    }

    /// One message of every kind, with non-trivial field values.
    fn samples() -> Vec<Msg> {
        vec![
            hello(),
            Msg::Hello {
                version: 7,
                vm_name: name(&"é".repeat(MAX_NAME_BYTES / 2)),
                device_pid: MAX_PID,
                qemu_pid: MAX_PID,
            },
            Msg::Submit {
                group: GroupId(u64::MAX),
                context: 3,
                kind: GroupKind::Present,
                signature: CostSignature(0x0123_4567_89ab_cdef),
                cost_ns: 5_000,
                exec: Exec::Simulated,
            },
            Msg::Dispatched {
                group: GroupId(1),
                context: u32::MAX,
                kind: GroupKind::Transfer,
                signature: CostSignature(9),
            },
            Msg::Completed {
                group: GroupId(2),
                start: 10,
                finish: 10,
            },
            Msg::Frame,
            Msg::Bye,
            Msg::Cancel {
                group: GroupId(u64::MAX - 1),
            },
            Msg::Memory {
                used: 3 << 20,
                limit: u64::MAX,
            },
            Msg::Welcome {
                version: PROTOCOL_VERSION,
                vgpu: VgpuId(5),
            },
            Msg::Grant { group: GroupId(8) },
            Msg::Done {
                group: GroupId(3),
                start: 1,
                finish: u64::MAX,
            },
            Msg::Lease {
                budget_ns: 0,
                until: 77,
            },
            Msg::Revoke,
            Msg::Suspend,
            Msg::Resume,
            Msg::Present { at: 123_456 },
            Msg::Refused {
                code: RefuseCode::Internal,
                detail: Detail::new(&"x".repeat(MAX_DETAIL_BYTES)).unwrap(),
            },
            Msg::Refused {
                code: RefuseCode::BadMessage,
                detail: Detail::default(),
            },
        ]
    }

    fn bytes(msg: &Msg) -> Vec<u8> {
        let mut out = Vec::new();
        encode(msg, &mut out);
        out
    }

    /// A packet with the given header fields around `payload`.
    fn packet(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut out = MAGIC.to_le_bytes().to_vec();
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_le_bytes());
        out.extend_from_slice(payload);
        out
    }

    fn hello_payload(name: &[u8], device_pid: u32, qemu_pid: u32) -> Vec<u8> {
        let mut p = PROTOCOL_VERSION.to_le_bytes().to_vec();
        p.extend_from_slice(&u16::try_from(name.len()).unwrap().to_le_bytes());
        p.extend_from_slice(name);
        p.extend_from_slice(&device_pid.to_le_bytes());
        p.extend_from_slice(&qemu_pid.to_le_bytes());
        p
    }

    #[test]
    fn every_message_round_trips() {
        let all = samples();
        let kinds: Vec<Kind> = all.iter().map(Msg::kind).collect();
        for k in Kind::ALL {
            assert!(kinds.contains(&k), "{k} has no sample");
        }
        for msg in all {
            let b = bytes(&msg);
            assert!(b.len() <= MAX_MESSAGE_BYTES);
            assert_eq!(decode(&b), Ok(msg));
        }
    }

    #[test]
    fn encode_appends_and_header_is_little_endian() {
        let mut out = vec![0xee];
        encode(&Msg::Grant { group: GroupId(1) }, &mut out);
        assert_eq!(
            out,
            [
                0xee, b'V', b'G', b'S', b'1', 0x02, 0x80, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0
            ]
        );
        assert_eq!(decode(&out[1..]), Ok(Msg::Grant { group: GroupId(1) }));
    }

    #[test]
    fn kinds_and_enums_map_both_ways() {
        for k in Kind::ALL {
            assert_eq!(Kind::from_u16(k as u16), Some(k));
        }
        for raw in 0..=u8::MAX {
            if let Some(k) = group_kind_from_u8(raw) {
                assert_eq!(group_kind_to_u8(k), raw);
            }
            if let Some(e) = Exec::from_u8(raw) {
                assert_eq!(e as u8, raw);
            }
        }
        for raw in 0..=20 {
            if let Some(c) = RefuseCode::from_u32(raw) {
                assert_eq!(c as u32, raw);
            }
        }
        assert_eq!(RefuseCode::from_u32(0), None);
        assert_eq!(RefuseCode::from_u32(13), None);
        for code in [
            RefuseCode::Timeout,
            RefuseCode::NotLeased,
            RefuseCode::Forbidden,
        ] {
            let msg = Msg::Refused {
                code,
                detail: Detail::lossy("x"),
            };
            let mut b = Vec::new();
            encode(&msg, &mut b);
            assert_eq!(decode(&b), Ok(msg));
        }
    }

    #[test]
    fn bad_magic_is_rejected() {
        let mut b = bytes(&Msg::Frame);
        b[3] = b'2';
        assert_eq!(decode(&b), Err(ProtoError::BadMagic(0x3253_4756)));
    }

    #[test]
    fn unknown_kinds_are_rejected() {
        for raw in [0u16, 9, 0x8000, 0x800a, 0x0101, u16::MAX] {
            assert_eq!(decode(&packet(raw, &[])), Err(ProtoError::UnknownKind(raw)));
        }
    }

    #[test]
    fn flags_must_be_zero() {
        for bit in 0..16 {
            let mut b = bytes(&Msg::Bye);
            b[6..8].copy_from_slice(&(1u16 << bit).to_le_bytes());
            assert_eq!(decode(&b), Err(ProtoError::BadFlags(1 << bit)));
        }
    }

    #[test]
    fn declared_length_must_match_the_packet() {
        let b = bytes(&Msg::Present { at: 1 });
        for declared in [0u32, 7, 9, 4096, u32::MAX] {
            let mut c = b.clone();
            c[8..12].copy_from_slice(&declared.to_le_bytes());
            assert_eq!(
                decode(&c),
                Err(ProtoError::LengthMismatch {
                    declared,
                    actual: 8
                })
            );
        }
        // A packet cut short disagrees with its header.
        assert_eq!(
            decode(&b[..b.len() - 1]),
            Err(ProtoError::LengthMismatch {
                declared: 8,
                actual: 7
            })
        );
    }

    #[test]
    fn packets_shorter_than_the_header_are_rejected() {
        let b = bytes(&Msg::Bye);
        for len in 0..HEADER_BYTES {
            assert_eq!(decode(&b[..len]), Err(ProtoError::ShortHeader(len)));
        }
    }

    #[test]
    fn packets_over_the_limit_are_rejected_before_anything_else() {
        let big = vec![0u8; MAX_MESSAGE_BYTES + 1];
        assert_eq!(
            decode(&big),
            Err(ProtoError::TooLong(MAX_MESSAGE_BYTES + 1))
        );
        let b = packet(Kind::Frame as u16, &vec![0; MAX_MESSAGE_BYTES]);
        assert_eq!(decode(&b), Err(ProtoError::TooLong(b.len())));
        // At the limit, the header is fine and the payload is what is wrong.
        let b = packet(
            Kind::Frame as u16,
            &vec![0; MAX_MESSAGE_BYTES - HEADER_BYTES],
        );
        assert_eq!(
            decode(&b),
            Err(ProtoError::TrailingBytes {
                kind: Kind::Frame,
                count: MAX_MESSAGE_BYTES - HEADER_BYTES
            })
        );
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        for msg in samples() {
            let b = bytes(&msg);
            let mut payload = b[HEADER_BYTES..].to_vec();
            payload.push(0);
            assert_eq!(
                decode(&packet(msg.kind() as u16, &payload)),
                Err(ProtoError::TrailingBytes {
                    kind: msg.kind(),
                    count: 1
                }),
                "{msg:?}"
            );
        }
    }

    #[test]
    fn truncated_payloads_are_rejected_at_every_length() {
        for msg in samples() {
            let b = bytes(&msg);
            let payload = &b[HEADER_BYTES..];
            for len in 0..payload.len() {
                let got = decode(&packet(msg.kind() as u16, &payload[..len]));
                assert_eq!(
                    got,
                    Err(ProtoError::Truncated(msg.kind())),
                    "{msg:?} at {len}"
                );
            }
        }
    }

    #[test]
    fn bad_enum_values_are_rejected() {
        let submit = bytes(&samples()[2]);
        // Submit: group 8, context 4, kind at 12, signature 8, cost 8, exec at 29.
        let mut b = submit.clone();
        b[HEADER_BYTES + 12] = 5;
        assert_eq!(
            decode(&b),
            Err(ProtoError::BadValue {
                field: "kind",
                value: 5
            })
        );
        let mut b = submit;
        b[HEADER_BYTES + 29] = 2;
        assert_eq!(
            decode(&b),
            Err(ProtoError::BadValue {
                field: "exec",
                value: 2
            })
        );
        let mut b = bytes(&samples()[3]);
        b[HEADER_BYTES + 12] = 0xff;
        assert_eq!(
            decode(&b),
            Err(ProtoError::BadValue {
                field: "kind",
                value: 0xff
            })
        );
        // Memory: more in use than the budget is a lie.
        let mut p = 5u64.to_le_bytes().to_vec();
        p.extend_from_slice(&4u64.to_le_bytes());
        assert_eq!(
            decode(&packet(Kind::Memory as u16, &p)),
            Err(ProtoError::BadValue {
                field: "used",
                value: 5
            })
        );
        for code in [0u32, 13, u32::MAX] {
            let mut p = code.to_le_bytes().to_vec();
            p.extend_from_slice(&0u16.to_le_bytes());
            assert_eq!(
                decode(&packet(Kind::Refused as u16, &p)),
                Err(ProtoError::BadValue {
                    field: "code",
                    value: code.into()
                })
            );
        }
    }

    #[test]
    fn pids_out_of_range_are_rejected() {
        let bad = |field, value: u32| {
            Err(ProtoError::BadValue {
                field,
                value: value.into(),
            })
        };
        let p = hello_payload(b"vm", 0, 1);
        assert_eq!(decode(&packet(1, &p)), bad("device_pid", 0));
        let p = hello_payload(b"vm", MAX_PID + 1, 1);
        assert_eq!(decode(&packet(1, &p)), bad("device_pid", MAX_PID + 1));
        let p = hello_payload(b"vm", 1, u32::MAX);
        assert_eq!(decode(&packet(1, &p)), bad("qemu_pid", u32::MAX));
    }

    #[test]
    fn finish_before_start_is_rejected() {
        for kind in [Kind::Completed, Kind::Done] {
            let mut p = 1u64.to_le_bytes().to_vec();
            p.extend_from_slice(&10u64.to_le_bytes());
            p.extend_from_slice(&9u64.to_le_bytes());
            assert_eq!(
                decode(&packet(kind as u16, &p)),
                Err(ProtoError::BadTimes {
                    start: 10,
                    finish: 9
                })
            );
        }
    }

    #[test]
    fn bad_names_are_rejected_on_the_wire_and_in_constructors() {
        let long = "n".repeat(MAX_NAME_BYTES + 1);
        let cases: [(&[u8], &str); 9] = [
            (b"", "empty"),
            (long.as_bytes(), "too long"),
            (b"vm\xff", "not UTF-8"),
            (b"\xc3", "not UTF-8"),
            (b"vm\n1", "control character"),
            (b"vm\x7f", "control character"),
            (b"vm\xc2\x85", "control character"),
            (b"a:b", "':', '<' or '>'"),
            (b" vm", "leading or trailing whitespace"),
        ];
        for (raw, reason) in cases {
            let want = Err(ProtoError::BadText {
                field: "vm_name",
                reason,
            });
            assert_eq!(
                decode(&packet(1, &hello_payload(raw, 1, 0))),
                want,
                "{raw:?}"
            );
            if let Ok(s) = std::str::from_utf8(raw) {
                assert_eq!(VmName::new(s), want.map(|_: Msg| name("x")));
            }
        }
        let max = "n".repeat(MAX_NAME_BYTES);
        assert!(decode(&packet(1, &hello_payload(max.as_bytes(), 1, 0))).is_ok());
    }

    #[test]
    fn bad_details_are_rejected_and_lossy_details_fit() {
        let refused = |detail: &[u8]| {
            let mut p = 1u32.to_le_bytes().to_vec();
            p.extend_from_slice(&u16::try_from(detail.len()).unwrap().to_le_bytes());
            p.extend_from_slice(detail);
            decode(&packet(Kind::Refused as u16, &p))
        };
        let long = "d".repeat(MAX_DETAIL_BYTES + 1);
        for (raw, reason) in [
            (long.as_bytes(), "too long"),
            (&b"\xff"[..], "not UTF-8"),
            (&b"a\tb"[..], "control character"),
        ] {
            let want = Err(ProtoError::BadText {
                field: "detail",
                reason,
            });
            assert_eq!(refused(raw), want);
        }
        assert!(Detail::new(&long).is_err());
        let lossy = Detail::lossy(&format!("bad\nthing {}", "é".repeat(MAX_DETAIL_BYTES)));
        assert!(lossy.as_str().starts_with("bad thing é"));
        assert_eq!(lossy.as_str().len(), MAX_DETAIL_BYTES);
        assert!(Detail::new(lossy.as_str()).is_ok());
    }

    #[test]
    fn decisions_map_to_device_messages() {
        let v = VgpuId(2);
        let cases = [
            (
                Decision::Dispatch {
                    vgpu: v,
                    group: GroupId(4),
                    leased: true,
                },
                Some(Msg::Grant { group: GroupId(4) }),
            ),
            (
                Decision::Lease {
                    vgpu: v,
                    budget: None,
                    until: Some(9),
                },
                Some(Msg::Lease {
                    budget_ns: 0,
                    until: 9,
                }),
            ),
            (
                Decision::Lease {
                    vgpu: v,
                    budget: Some(5),
                    until: None,
                },
                Some(Msg::Lease {
                    budget_ns: 5,
                    until: 0,
                }),
            ),
            (
                Decision::Lease {
                    vgpu: v,
                    budget: Some(0),
                    until: None,
                },
                Some(Msg::Revoke),
            ),
            (
                Decision::Lease {
                    vgpu: v,
                    budget: None,
                    until: Some(0),
                },
                Some(Msg::Revoke),
            ),
            (Decision::Revoke { vgpu: v }, Some(Msg::Revoke)),
            (Decision::Suspend { vgpu: v }, Some(Msg::Suspend)),
            (Decision::Resume { vgpu: v }, Some(Msg::Resume)),
            (
                Decision::Present { vgpu: v, at: 11 },
                Some(Msg::Present { at: 11 }),
            ),
            (Decision::CpuWeight { vgpu: v, weight: 3 }, None),
        ];
        for (decision, want) in cases {
            assert_eq!(
                Msg::from_decision(&decision),
                want.map(|m| (v, m)),
                "{decision:?}"
            );
        }
    }

    #[test]
    fn session_requires_hello_first_and_once() {
        let mut s = Session::new();
        assert_eq!(
            s.receive(&Msg::Frame),
            Err(ProtoError::HelloRequired(Kind::Frame))
        );
        assert_eq!(
            s.receive(&Msg::Bye),
            Err(ProtoError::HelloRequired(Kind::Bye))
        );
        assert_eq!(s.state(), SessionState::AwaitingHello);
        assert_eq!(s.receive(&hello()), Ok(()));
        assert_eq!(s.state(), SessionState::Open);
        assert_eq!(s.receive(&hello()), Err(ProtoError::DuplicateHello));
        assert_eq!(s.receive(&samples()[2]), Ok(()));
        assert_eq!(s.receive(&Msg::Frame), Ok(()));
        assert_eq!(s.receive(&Msg::Bye), Ok(()));
        assert_eq!(s.state(), SessionState::Closed);
        assert_eq!(s.receive(&Msg::Frame), Err(ProtoError::Closed(Kind::Frame)));
        assert_eq!(s.receive(&hello()), Err(ProtoError::Closed(Kind::Hello)));
    }

    #[test]
    fn session_rejects_other_versions_and_daemon_messages() {
        let mut s = Session::new();
        let old = Msg::Hello {
            version: 0,
            vm_name: name("a"),
            device_pid: 1,
            qemu_pid: 0,
        };
        assert_eq!(s.receive(&old), Err(ProtoError::VersionMismatch(0)));
        assert_eq!(s.state(), SessionState::AwaitingHello);
        for msg in samples().iter().filter(|m| m.kind().to_device()) {
            assert_eq!(s.receive(msg), Err(ProtoError::WrongDirection(msg.kind())));
        }
        assert_eq!(s.receive(&hello()), Ok(()));
    }

    #[test]
    fn errors_map_to_refuse_codes() {
        assert_eq!(
            ProtoError::HelloRequired(Kind::Frame).refuse_code(),
            RefuseCode::OutOfOrder
        );
        assert_eq!(
            ProtoError::DuplicateHello.refuse_code(),
            RefuseCode::OutOfOrder
        );
        assert_eq!(
            ProtoError::Closed(Kind::Bye).refuse_code(),
            RefuseCode::OutOfOrder
        );
        assert_eq!(
            ProtoError::VersionMismatch(2).refuse_code(),
            RefuseCode::VersionMismatch
        );
        assert_eq!(
            ProtoError::BadMagic(0).refuse_code(),
            RefuseCode::BadMessage
        );
        assert_eq!(
            ProtoError::WrongDirection(Kind::Grant).refuse_code(),
            RefuseCode::BadMessage
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics_on_arbitrary_bytes(
            b in proptest::collection::vec(any::<u8>(), 0..=MAX_MESSAGE_BYTES + 8),
        ) {
            let _ = decode(&b);
        }

        #[test]
        fn decoded_packets_encode_back_to_the_same_bytes(
            kind in prop::sample::select(Kind::ALL.to_vec()),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            // Valid headers let random payloads reach the payload checks; whatever decodes
            // encodes back to the same packet: the format is canonical.
            let p = packet(kind as u16, &payload);
            if let Ok(msg) = decode(&p) {
                prop_assert_eq!(bytes(&msg), p);
            }
        }
    }
}
