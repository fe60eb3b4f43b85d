//! The private load capset's wire format (capset 20, version 1): the 16-byte capset blob the
//! device returns for GET_CAPS, and the 16-byte little-endian commands a SUBMIT_3D on a load
//! context carries. Pure code: no I/O.

use thiserror::Error;

/// The load capset's id (`VGPU_LOAD_CAPSET_ID` on the device side).
pub const LOAD_CAPSET_ID: u32 = 20;
/// The only capset version this tool speaks.
pub const LOAD_CAPSET_VERSION: u32 = 1;
/// Length of the capset blob: {version u32, max_commands u32, max_occupy_us u32, reserved u32}.
pub const CAPSET_BLOB_LEN: usize = 16;
/// Length of one command: {op u32, flags u32, arg u64}, little-endian.
pub const COMMAND_LEN: usize = 16;
/// The protocol's ceiling on commands per submit; a device advertising more is clamped to it, so
/// a buggy or hostile blob cannot make us build a submit the protocol forbids.
pub const MAX_COMMANDS: u32 = 64;
/// The protocol's ceiling on one OCCUPY (1 s), for the same reason.
pub const MAX_OCCUPY_US: u64 = 1_000_000;

const OP_OCCUPY: u32 = 1;
const OP_END_FRAME: u32 = 2;

/// Errors of the capset blob and of command encoding.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    /// The blob is not exactly `CAPSET_BLOB_LEN` bytes.
    #[error("load capset blob is {0} bytes, expected {CAPSET_BLOB_LEN}")]
    BlobLength(usize),
    /// The blob's version field is not the one we asked for.
    #[error("load capset version {0}, this tool speaks version {LOAD_CAPSET_VERSION}")]
    Version(u32),
    /// The device allows no command per submit or no occupy time at all.
    #[error("load capset advertises unusable limits (max_commands {0}, max_occupy_us {1})")]
    Limits(u32, u32),
    /// A submit without commands.
    #[error("a submit needs at least one command")]
    Empty,
    /// More commands than the device accepts in one submit.
    #[error("{0} commands in one submit, the device accepts at most {1}")]
    TooManyCommands(usize, u32),
    /// An OCCUPY outside 1..=max_occupy_us.
    #[error("occupy of {0} us is outside 1..={1} us")]
    Occupy(u64, u64),
}

/// What the device's capset blob allows, clamped to the protocol's ceilings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapsetInfo {
    /// Commands per submit.
    pub max_commands: u32,
    /// Longest OCCUPY, µs.
    pub max_occupy_us: u64,
}

impl CapsetInfo {
    /// Parses and checks the blob GET_CAPS returned.
    pub fn parse(blob: &[u8]) -> Result<Self, WireError> {
        let blob: &[u8; CAPSET_BLOB_LEN] = blob
            .try_into()
            .map_err(|_| WireError::BlobLength(blob.len()))?;
        let word = |i: usize| u32::from_le_bytes([blob[i], blob[i + 1], blob[i + 2], blob[i + 3]]);
        let (version, max_commands, max_occupy_us) = (word(0), word(4), word(8));
        if version != LOAD_CAPSET_VERSION {
            return Err(WireError::Version(version));
        }
        if max_commands == 0 || max_occupy_us == 0 {
            return Err(WireError::Limits(max_commands, max_occupy_us));
        }
        Ok(Self {
            max_commands: max_commands.min(MAX_COMMANDS),
            max_occupy_us: u64::from(max_occupy_us).min(MAX_OCCUPY_US),
        })
    }
}

/// One load command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Occupy the GPU for this many µs: one command group.
    Occupy(u64),
    /// A frame boundary: its fence is released at the paced present.
    EndFrame,
}

/// Encodes a submit's command stream after checking it against the device's limits.
pub fn encode(commands: &[Command], limits: &CapsetInfo) -> Result<Vec<u8>, WireError> {
    if commands.is_empty() {
        return Err(WireError::Empty);
    }
    if commands.len() > limits.max_commands as usize {
        return Err(WireError::TooManyCommands(
            commands.len(),
            limits.max_commands,
        ));
    }
    let mut out = Vec::with_capacity(commands.len() * COMMAND_LEN);
    for command in commands {
        let (op, arg) = match *command {
            Command::Occupy(us) if (1..=limits.max_occupy_us).contains(&us) => (OP_OCCUPY, us),
            Command::Occupy(us) => return Err(WireError::Occupy(us, limits.max_occupy_us)),
            Command::EndFrame => (OP_END_FRAME, 0),
        };
        out.extend_from_slice(&op.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&arg.to_le_bytes());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(version: u32, max_commands: u32, max_occupy_us: u32) -> Vec<u8> {
        [version, max_commands, max_occupy_us, 0]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }

    const LIMITS: CapsetInfo = CapsetInfo {
        max_commands: 64,
        max_occupy_us: 1_000_000,
    };

    #[test]
    fn parses_the_documented_blob() {
        assert_eq!(CapsetInfo::parse(&blob(1, 64, 1_000_000)), Ok(LIMITS));
    }

    #[test]
    fn clamps_limits_beyond_the_protocol() {
        let info = CapsetInfo::parse(&blob(1, 4096, u32::MAX)).unwrap();
        assert_eq!(info, LIMITS);
        let info = CapsetInfo::parse(&blob(1, 8, 500)).unwrap();
        assert_eq!((info.max_commands, info.max_occupy_us), (8, 500));
    }

    #[test]
    fn rejects_bad_blobs() {
        assert_eq!(CapsetInfo::parse(&[0; 15]), Err(WireError::BlobLength(15)));
        assert_eq!(CapsetInfo::parse(&[0; 17]), Err(WireError::BlobLength(17)));
        assert_eq!(CapsetInfo::parse(&[]), Err(WireError::BlobLength(0)));
        assert_eq!(
            CapsetInfo::parse(&blob(2, 64, 1_000_000)),
            Err(WireError::Version(2))
        );
        assert_eq!(
            CapsetInfo::parse(&blob(1, 0, 1_000_000)),
            Err(WireError::Limits(0, 1_000_000))
        );
        assert_eq!(
            CapsetInfo::parse(&blob(1, 64, 0)),
            Err(WireError::Limits(64, 0))
        );
    }

    #[test]
    fn encodes_little_endian_commands() {
        let bytes = encode(&[Command::Occupy(0x000E_0304), Command::EndFrame], &LIMITS).unwrap();
        let mut expected = vec![1, 0, 0, 0, 0, 0, 0, 0, 4, 3, 0x0e, 0, 0, 0, 0, 0];
        expected.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn encodes_the_limits_inclusive() {
        let max = vec![Command::Occupy(1_000_000); 64];
        assert_eq!(encode(&max, &LIMITS).unwrap().len(), 64 * COMMAND_LEN);
        assert!(encode(&[Command::Occupy(1)], &LIMITS).is_ok());
    }

    #[test]
    fn rejects_bad_submits() {
        assert_eq!(encode(&[], &LIMITS), Err(WireError::Empty));
        assert_eq!(
            encode(&vec![Command::EndFrame; 65], &LIMITS),
            Err(WireError::TooManyCommands(65, 64))
        );
        assert_eq!(
            encode(&[Command::Occupy(0)], &LIMITS),
            Err(WireError::Occupy(0, 1_000_000))
        );
        assert_eq!(
            encode(&[Command::Occupy(1_000_001)], &LIMITS),
            Err(WireError::Occupy(1_000_001, 1_000_000))
        );
        let small = CapsetInfo {
            max_commands: 1,
            max_occupy_us: 10,
        };
        assert_eq!(
            encode(&[Command::Occupy(11)], &small),
            Err(WireError::Occupy(11, 10))
        );
        assert_eq!(
            encode(&[Command::EndFrame, Command::EndFrame], &small),
            Err(WireError::TooManyCommands(2, 1))
        );
    }
}
