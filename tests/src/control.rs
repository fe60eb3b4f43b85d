//! The host end of the host-guest control channel (wire format:
//! `vgpu_guest_drivers::control`; guest end: `vgpu-agent`). A guest booted with
//! [`crate::guest::GuestConfig::control`] has a virtio-serial port whose QEMU chardev is a
//! Unix socket in the run's directory; [`ControlChannel`] connects to it, waits for the agent
//! (`HELLO`), starts jobs, stops them and collects their summary lines and exit codes.
//!
//! Every wait has a deadline; a guest that reports something unexpected or malformed is
//! recorded, never trusted to be well-behaved.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use vgpu_guest_drivers::control::{ControlError, GuestMsg, HostMsg, JobId, LineReader};

/// How often `PING` is repeated while the agent has not answered (a line the guest sends
/// while QEMU's chardev has no client is lost).
const PING_EVERY: Duration = Duration::from_secs(2);
/// Most malformed lines kept for the error report.
const MAX_BAD_LINES: usize = 16;
/// Most summary lines kept per job (a workload prints one; the rest is a guest misbehaving).
const MAX_SUMMARIES: usize = 64;

/// Why the channel failed.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("control socket {path}: {source}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("writing to the control channel: {0}")]
    Write(#[source] std::io::Error),
    #[error("the control channel closed (QEMU exited?) while waiting for {0}")]
    Closed(String),
    #[error("no answer within {timeout:?} while waiting for {what}")]
    Timeout { what: String, timeout: Duration },
    #[error("job {id}: the agent refused: {text}")]
    Refused { id: String, text: String },
    #[error("bad job name: {0}")]
    BadId(#[from] ControlError),
}

/// What a job reported.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobReport {
    pub started: bool,
    /// Its `SUMMARY` lines, in order (at most [`MAX_SUMMARIES`]).
    pub summaries: Vec<String>,
    /// Its exit code once it ended.
    pub exit: Option<i32>,
    /// A refusal or failure the agent reported for it.
    pub error: Option<String>,
}

/// A connected control channel.
pub struct ControlChannel {
    stream: UnixStream,
    rx: Receiver<Result<GuestMsg, ControlError>>,
    closed: bool,
    hello: Option<u32>,
    bye: bool,
    jobs: BTreeMap<JobId, JobReport>,
    /// Lines the guest sent that were not messages, and errors not tied to a job.
    pub bad_lines: Vec<String>,
}

impl std::fmt::Debug for ControlChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlChannel")
            .field("hello", &self.hello)
            .field("jobs", &self.jobs)
            .field("bad_lines", &self.bad_lines)
            .finish_non_exhaustive()
    }
}

impl ControlChannel {
    /// Connects to QEMU's chardev socket at `path`, retrying until `timeout` (QEMU creates
    /// it early in its start-up).
    pub fn connect(path: &Path, timeout: Duration) -> Result<ControlChannel, ChannelError> {
        let until = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= until => {
                    return Err(ChannelError::Connect {
                        path: path.display().to_string(),
                        source: e,
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        Self::over(stream).map_err(|e| ChannelError::Connect {
            path: path.display().to_string(),
            source: e,
        })
    }

    /// A channel over a connected `stream` (the agent's `--socket` end, in tests).
    pub fn over(stream: UnixStream) -> std::io::Result<ControlChannel> {
        let mut reader = stream.try_clone()?;
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("vgpu-control".into())
            .spawn(move || {
                let mut lines = LineReader::default();
                let mut buf = [0u8; 4096];
                loop {
                    let n = match reader.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    for line in lines.push(&buf[..n]) {
                        if tx.send(line.and_then(|l| GuestMsg::parse(&l))).is_err() {
                            return;
                        }
                    }
                }
            })?;
        Ok(ControlChannel {
            stream,
            rx,
            closed: false,
            hello: None,
            bye: false,
            jobs: BTreeMap::new(),
            bad_lines: Vec::new(),
        })
    }

    fn send(&mut self, msg: &HostMsg) -> Result<(), ChannelError> {
        self.stream
            .write_all(&msg.encode())
            .map_err(ChannelError::Write)
    }

    /// Takes one message, waiting until `until` at most; false when none came.
    fn pump(&mut self, until: Instant) -> bool {
        if self.closed {
            return false;
        }
        let wait = until.saturating_duration_since(Instant::now());
        let msg = match self.rx.recv_timeout(wait) {
            Ok(msg) => msg,
            Err(RecvTimeoutError::Timeout) => return false,
            Err(RecvTimeoutError::Disconnected) => {
                self.closed = true;
                return false;
            }
        };
        match msg {
            Ok(GuestMsg::Hello { version }) => self.hello = Some(version),
            Ok(GuestMsg::Started { id }) => self.jobs.entry(id).or_default().started = true,
            Ok(GuestMsg::Summary { id, text }) => {
                let job = self.jobs.entry(id).or_default();
                if job.summaries.len() < MAX_SUMMARIES {
                    job.summaries.push(text);
                }
            }
            Ok(GuestMsg::Exited { id, code }) => self.jobs.entry(id).or_default().exit = Some(code),
            Ok(GuestMsg::Error { id: Some(id), text }) => {
                self.jobs.entry(id).or_default().error = Some(text);
            }
            Ok(GuestMsg::Error { id: None, text }) => self.note_bad(format!("agent: {text}")),
            Ok(GuestMsg::Bye) => self.bye = true,
            Err(e) => self.note_bad(e.to_string()),
        }
        true
    }

    fn note_bad(&mut self, text: String) {
        if self.bad_lines.len() < MAX_BAD_LINES {
            self.bad_lines.push(text);
        }
    }

    /// Waits until `done` holds of the channel, or `timeout`.
    fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(&Self) -> bool,
    ) -> Result<(), ChannelError> {
        let until = Instant::now() + timeout;
        while !done(self) {
            if !self.pump(until) {
                if self.closed {
                    return Err(ChannelError::Closed(what.to_owned()));
                }
                if Instant::now() >= until {
                    return Err(ChannelError::Timeout {
                        what: what.to_owned(),
                        timeout,
                    });
                }
            }
        }
        Ok(())
    }

    /// Waits for the agent (the guest booted and started it), asking every few seconds;
    /// returns its protocol version.
    pub fn hello(&mut self, timeout: Duration) -> Result<u32, ChannelError> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(version) = self.hello {
                return Ok(version);
            }
            self.send(&HostMsg::Ping)?;
            let left = until.saturating_duration_since(Instant::now());
            match self.wait_for("the agent's HELLO", left.min(PING_EVERY), |c| {
                c.hello.is_some()
            }) {
                Ok(()) => {}
                Err(ChannelError::Timeout { .. }) if Instant::now() < until => {}
                Err(ChannelError::Timeout { .. }) => {
                    return Err(ChannelError::Timeout {
                        what: "the agent's HELLO".into(),
                        timeout,
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Starts `script` as job `id` and waits until the agent says it runs.
    pub fn start(&mut self, id: &str, script: &str, timeout: Duration) -> Result<(), ChannelError> {
        let id = JobId::new(id)?;
        self.jobs.insert(id.clone(), JobReport::default());
        self.send(&HostMsg::Start {
            id: id.clone(),
            script: script.as_bytes().to_vec(),
        })?;
        let what = format!("job {id} to start");
        self.wait_for(&what, timeout, |c| {
            c.jobs
                .get(&id)
                .is_some_and(|j| j.started || j.error.is_some())
        })?;
        match &self.jobs[&id].error {
            Some(text) if !self.jobs[&id].started => Err(ChannelError::Refused {
                id: id.to_string(),
                text: text.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Asks job `id` to stop (its stdin closes; the agent signals it if it lingers).
    pub fn stop(&mut self, id: &str) -> Result<(), ChannelError> {
        let id = JobId::new(id)?;
        self.send(&HostMsg::Stop { id })
    }

    /// Waits for job `id` to end; returns what it reported.
    pub fn wait_exit(&mut self, id: &str, timeout: Duration) -> Result<JobReport, ChannelError> {
        let id = JobId::new(id)?;
        let what = format!("job {id} to end");
        self.wait_for(&what, timeout, |c| {
            c.jobs.get(&id).is_some_and(|j| j.exit.is_some())
        })?;
        Ok(self.jobs[&id].clone())
    }

    /// What job `id` reported so far (taking every message already received).
    pub fn report(&mut self, id: &str) -> Option<JobReport> {
        while self.pump(Instant::now()) {}
        let id = JobId::new(id).ok()?;
        self.jobs.get(&id).cloned()
    }

    /// Stops every job and ends the agent (the guest then powers off).
    pub fn quit(&mut self, timeout: Duration) -> Result<(), ChannelError> {
        self.send(&HostMsg::Quit)?;
        self.wait_for("the agent's BYE", timeout, |c| c.bye)
    }
}
