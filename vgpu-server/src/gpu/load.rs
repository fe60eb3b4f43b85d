//! The private load capset (capset 20): a guest context that asks the device to occupy the
//! GPU for given times instead of drawing, so that scheduling policies can be exercised with
//! exact, known costs.
//!
//! A SUBMIT_3D on a load context carries 16-byte little-endian commands
//! `{op u32, flags u32, arg u64}`: [`OP_OCCUPY`] (arg = µs, `1..=MAX_OCCUPY_US`) is one command
//! group, [`OP_END_FRAME`] (arg = 0) a frame boundary. Decoding is pure ([`decode_submit`]);
//! anything malformed refuses the whole submit before any of it runs.
//!
//! Without a scheduler daemon, the groups run on a [`LoadRunner`]: the simulator's
//! non-preemptive engine, with time as an input; the worker drives it with a timer.

use std::collections::BTreeMap;

use vgpu_scheduler::sim::engine::{Engine, Job};
use vgpu_scheduler::{GroupId, Time, VgpuId};

use super::protocol::ty;

/// The load capset's id (`VGPU_LOAD_CAPSET_ID`), outside the range of the standard ones.
pub const VGPU_LOAD_CAPSET_ID: u32 = 20;
/// The load capset's only version.
pub const LOAD_CAPSET_VERSION: u32 = 1;
/// Size of the capset blob: `{version, max_commands, max_occupy_us, reserved}`, u32 each.
pub const LOAD_CAPSET_SIZE: u32 = 16;
/// Size of one load command.
pub const COMMAND_SIZE: usize = 16;
/// Most commands in one submit: bounds the groups one request creates (the guest learns it
/// from the capset).
pub const MAX_COMMANDS: usize = 64;
/// Longest OCCUPY in µs (one second): one group must not hold the GPU unboundedly.
pub const MAX_OCCUPY_US: u64 = 1_000_000;
/// Most load groups waiting for or running on the local engine at once. Unfenced submits
/// are not bounded by the queues, so this bounds the engine's memory and the backlog a guest
/// can queue (at most an hour of GPU time at [`MAX_OCCUPY_US`] each).
pub const MAX_PENDING_GROUPS: usize = 4096;
/// Op: occupy the GPU for `arg` µs.
pub const OP_OCCUPY: u32 = 1;
/// Op: end of a frame (`arg` = 0).
pub const OP_END_FRAME: u32 = 2;

/// One decoded load command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadCommand {
    /// Occupy the GPU for this many µs (a command group).
    Occupy {
        /// Duration in µs, `1..=MAX_OCCUPY_US`.
        us: u64,
    },
    /// A frame boundary.
    EndFrame,
}

impl LoadCommand {
    /// The GPU time an OCCUPY asks for, in ns (`None` for a frame boundary).
    pub fn cost_ns(&self) -> Option<u64> {
        match *self {
            LoadCommand::Occupy { us } => Some(us.saturating_mul(1000)),
            LoadCommand::EndFrame => None,
        }
    }
}

/// Errors of load submits.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LoadError {
    /// The stream is not a whole number of commands.
    #[error("load submit of {0} bytes is not a multiple of {COMMAND_SIZE}")]
    Size(usize),
    /// More than [`MAX_COMMANDS`] commands.
    #[error("load submit of {0} commands (at most {MAX_COMMANDS})")]
    TooMany(usize),
    /// An unknown op.
    #[error("load command {index}: unknown op {op}")]
    Op {
        /// Command index in the submit.
        index: usize,
        /// The op.
        op: u32,
    },
    /// Flags other than 0.
    #[error("load command {index}: flags {flags:#x} must be 0")]
    Flags {
        /// Command index in the submit.
        index: usize,
        /// The flags.
        flags: u32,
    },
    /// An argument out of range for its op.
    #[error("load command {index}: argument {arg} out of range")]
    Arg {
        /// Command index in the submit.
        index: usize,
        /// The argument.
        arg: u64,
    },
    /// The local engine already holds [`MAX_PENDING_GROUPS`].
    #[error("more than {MAX_PENDING_GROUPS} load groups pending")]
    Full,
    /// The scheduler daemon already holds as many of this device's load groups as the
    /// per-device bound leaves for them (`sched_client::MAX_REMOTE_LOAD_GROUPS`).
    #[error("the scheduler daemon holds this device's share of load groups")]
    DaemonBound,
}

impl LoadError {
    /// The virtio-gpu response code for this error.
    pub fn response_code(&self) -> u32 {
        match self {
            LoadError::Full | LoadError::DaemonBound => ty::ERR_OUT_OF_MEMORY,
            LoadError::Size(_)
            | LoadError::TooMany(_)
            | LoadError::Op { .. }
            | LoadError::Flags { .. }
            | LoadError::Arg { .. } => ty::ERR_INVALID_PARAMETER,
        }
    }
}

/// The capset blob GET_CAPSET returns: version, max commands, max occupy µs, reserved.
pub fn capset_blob() -> Vec<u8> {
    [
        LOAD_CAPSET_VERSION,
        MAX_COMMANDS as u32,
        MAX_OCCUPY_US as u32,
        0,
    ]
    .iter()
    .flat_map(|v| v.to_le_bytes())
    .collect()
}

/// Decodes a load submit from its command stream (little-endian dwords, as SUBMIT_3D decoding
/// hands it over). Pure; every command is checked before any is returned.
pub fn decode_submit(dwords: &[u32]) -> Result<Vec<LoadCommand>, LoadError> {
    const DWORDS: usize = COMMAND_SIZE / 4;
    if dwords.len() % DWORDS != 0 {
        return Err(LoadError::Size(dwords.len().saturating_mul(4)));
    }
    let count = dwords.len() / DWORDS;
    if count > MAX_COMMANDS {
        return Err(LoadError::TooMany(count));
    }
    dwords
        .chunks_exact(DWORDS)
        .enumerate()
        .map(|(index, c)| {
            let (op, flags) = (c[0], c[1]);
            let arg = u64::from(c[2]) | u64::from(c[3]) << 32;
            if flags != 0 {
                return Err(LoadError::Flags { index, flags });
            }
            match op {
                OP_OCCUPY if (1..=MAX_OCCUPY_US).contains(&arg) => {
                    Ok(LoadCommand::Occupy { us: arg })
                }
                OP_END_FRAME if arg == 0 => Ok(LoadCommand::EndFrame),
                OP_OCCUPY | OP_END_FRAME => Err(LoadError::Arg { index, arg }),
                op => Err(LoadError::Op { index, op }),
            }
        })
        .collect()
}

/// A submit's groups on the local engine, released as a whole when its last group finishes;
/// under a scheduler daemon also what a load submit or a flush waits for there (its groups'
/// `Done`s and its frames' `Present`s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct LoadToken(u64);

/// The local simulated engine of a device without a scheduler daemon: load groups run one at
/// a time in submission order, each for its cost. Time is an input (ns on the caller's
/// monotonic clock).
#[derive(Debug)]
pub struct LoadRunner {
    engine: Engine,
    /// Finish time of the running group.
    deadline: Option<Time>,
    /// Pending group -> the submit it belongs to.
    groups: BTreeMap<u64, LoadToken>,
    /// Submit -> its groups not yet finished.
    remaining: BTreeMap<LoadToken, usize>,
    next_group: u64,
    next_token: u64,
}

impl Default for LoadRunner {
    fn default() -> Self {
        LoadRunner {
            engine: Engine::new(0),
            deadline: None,
            groups: BTreeMap::new(),
            remaining: BTreeMap::new(),
            next_group: 0,
            next_token: 0,
        }
    }
}

impl LoadRunner {
    /// Queues the OCCUPY groups of a decoded submit on context `ctx` at `now`; returns the
    /// token [`LoadRunner::advance`] reports when they have all finished, or `None` when the
    /// submit has no group (it is complete at once).
    pub fn submit(
        &mut self,
        ctx: u32,
        commands: &[LoadCommand],
        now: Time,
    ) -> Result<Option<LoadToken>, LoadError> {
        let costs: Vec<u64> = commands.iter().filter_map(|c| c.cost_ns()).collect();
        if costs.is_empty() {
            return Ok(None);
        }
        let token = self.token();
        self.run(token, ctx, &costs, now)?;
        Ok(Some(token))
    }

    /// A new submit token (for groups that may run elsewhere, such as on a scheduler
    /// daemon's engine, and come back here with [`LoadRunner::run`]).
    pub fn token(&mut self) -> LoadToken {
        let token = LoadToken(self.next_token);
        self.next_token = self.next_token.wrapping_add(1);
        token
    }

    /// Queues groups of `costs` ns for submit `token` (added to the ones it has here);
    /// [`LoadRunner::advance`] reports it once all of them have finished.
    pub fn run(
        &mut self,
        token: LoadToken,
        ctx: u32,
        costs: &[u64],
        now: Time,
    ) -> Result<(), LoadError> {
        if costs.is_empty() {
            return Ok(());
        }
        if self.groups.len().saturating_add(costs.len()) > MAX_PENDING_GROUPS {
            return Err(LoadError::Full);
        }
        let left = self.remaining.entry(token).or_insert(0);
        *left = left.saturating_add(costs.len());
        for &cost in costs {
            let group = self.next_group;
            self.next_group = self.next_group.wrapping_add(1);
            self.groups.insert(group, token);
            self.engine.push(Job {
                owner: 0,
                vgpu: VgpuId(0),
                group: GroupId(group),
                context: ctx,
                cost,
                submitted: now,
            });
        }
        if self.deadline.is_none() {
            self.deadline = self.engine.kick(now);
        }
        Ok(())
    }

    /// Finishes every group due by `now` (the next one starts when the previous finished) and
    /// returns the submits that completed, in order.
    pub fn advance(&mut self, now: Time) -> Vec<LoadToken> {
        let mut done = Vec::new();
        while let Some(finish) = self.deadline.filter(|&d| d <= now) {
            if let Some((job, _, _)) = self.engine.finish()
                && let Some(token) = self.groups.remove(&job.group.0)
                && let Some(left) = self.remaining.get_mut(&token)
            {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    self.remaining.remove(&token);
                    done.push(token);
                }
            }
            self.deadline = self.engine.kick(finish);
        }
        done
    }

    /// When the running group finishes, if one runs.
    pub fn deadline(&self) -> Option<Time> {
        self.deadline
    }

    /// Forgets every group (device reset).
    pub fn reset(&mut self) {
        *self = LoadRunner::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(op: u32, flags: u32, arg: u64) -> [u32; 4] {
        [op, flags, arg as u32, (arg >> 32) as u32]
    }

    fn stream(cmds: &[[u32; 4]]) -> Vec<u32> {
        cmds.iter().flatten().copied().collect()
    }

    #[test]
    fn capset_blob_layout() {
        let b = capset_blob();
        assert_eq!(b.len(), LOAD_CAPSET_SIZE as usize);
        assert_eq!(&b[..4], &1u32.to_le_bytes());
        assert_eq!(&b[4..8], &64u32.to_le_bytes());
        assert_eq!(&b[8..12], &1_000_000u32.to_le_bytes());
        assert_eq!(&b[12..], &[0; 4]);
    }

    #[test]
    fn decodes_occupy_and_end_frame() {
        let s = stream(&[cmd(1, 0, 2000), cmd(2, 0, 0), cmd(1, 0, MAX_OCCUPY_US)]);
        assert_eq!(
            decode_submit(&s),
            Ok(vec![
                LoadCommand::Occupy { us: 2000 },
                LoadCommand::EndFrame,
                LoadCommand::Occupy { us: MAX_OCCUPY_US }
            ])
        );
        assert_eq!(decode_submit(&[]), Ok(vec![]));
        let max = stream(&vec![cmd(1, 0, 1); MAX_COMMANDS]);
        assert_eq!(decode_submit(&max).map(|v| v.len()), Ok(MAX_COMMANDS));
    }

    #[test]
    fn refuses_every_malformed_command() {
        let cases: [(Vec<u32>, LoadError); 8] = [
            (vec![1, 0, 5], LoadError::Size(12)),
            (vec![1, 0, 5, 0, 1], LoadError::Size(20)),
            (
                stream(&vec![cmd(1, 0, 1); MAX_COMMANDS + 1]),
                LoadError::TooMany(65),
            ),
            (stream(&[cmd(3, 0, 1)]), LoadError::Op { index: 0, op: 3 }),
            (
                stream(&[cmd(1, 0, 1), cmd(0, 0, 0)]),
                LoadError::Op { index: 1, op: 0 },
            ),
            (
                stream(&[cmd(1, 1, 1)]),
                LoadError::Flags { index: 0, flags: 1 },
            ),
            (stream(&[cmd(1, 0, 0)]), LoadError::Arg { index: 0, arg: 0 }),
            (
                stream(&[cmd(1, 0, MAX_OCCUPY_US + 1)]),
                LoadError::Arg {
                    index: 0,
                    arg: MAX_OCCUPY_US + 1,
                },
            ),
        ];
        for (s, e) in cases {
            assert_eq!(decode_submit(&s), Err(e));
        }
        assert_eq!(
            decode_submit(&stream(&[cmd(2, 0, 1)])),
            Err(LoadError::Arg { index: 0, arg: 1 })
        );
        assert_eq!(
            decode_submit(&stream(&[cmd(1, 0, 1 << 40)])),
            Err(LoadError::Arg {
                index: 0,
                arg: 1 << 40
            })
        );
        assert_eq!(
            LoadError::Size(4).response_code(),
            ty::ERR_INVALID_PARAMETER
        );
        assert_eq!(LoadError::Full.response_code(), ty::ERR_OUT_OF_MEMORY);
    }

    #[test]
    fn groups_run_one_at_a_time_and_submits_complete_whole() {
        let mut r = LoadRunner::default();
        let occ = |us| LoadCommand::Occupy { us };
        let a = r
            .submit(1, &[occ(2000), LoadCommand::EndFrame, occ(1000)], 100)
            .unwrap()
            .unwrap();
        let b = r.submit(2, &[occ(500)], 200).unwrap().unwrap();
        assert_eq!(r.submit(1, &[LoadCommand::EndFrame], 200), Ok(None));
        assert_eq!(r.deadline(), Some(2_000_100));
        assert!(r.advance(2_000_099).is_empty());
        assert!(r.advance(2_000_100).is_empty(), "one group of a left");
        assert_eq!(r.deadline(), Some(3_000_100));
        // A late wake-up finishes everything due, chaining from each finish.
        assert_eq!(r.advance(10_000_000), vec![a, b]);
        assert_eq!(r.deadline(), None);
        let c = r.submit(1, &[occ(1)], 20_000_000).unwrap().unwrap();
        assert_eq!(
            r.deadline(),
            Some(20_001_000),
            "an idle engine starts at once"
        );
        r.reset();
        assert_eq!(r.deadline(), None);
        assert!(r.advance(u64::MAX).is_empty());
        assert_ne!(Some(c), None);
    }

    #[test]
    fn pending_groups_are_bounded() {
        let mut r = LoadRunner::default();
        let full = vec![LoadCommand::Occupy { us: 1 }; MAX_COMMANDS];
        for _ in 0..MAX_PENDING_GROUPS / MAX_COMMANDS {
            r.submit(1, &full, 0).unwrap();
        }
        assert_eq!(
            r.submit(1, &[LoadCommand::Occupy { us: 1 }], 0),
            Err(LoadError::Full)
        );
        assert_eq!(r.advance(u64::MAX).len(), MAX_PENDING_GROUPS / MAX_COMMANDS);
        assert!(r.submit(1, &full, 0).unwrap().is_some());
    }
}
