//! The host-guest control channel's wire format: how the host starts, stops and hears back
//! from workloads in a guest it booted, over a virtio-serial port named [`PORT_NAME`] (a QEMU
//! chardev socket on the host side, `/dev/vportNpM` in the guest; the stock kernel's
//! `virtio_console` driver). The guest end is `vgpu-agent` (src/bin/vgpu-agent.rs); the host
//! end is the test harness (`vgpu_tests::control`). Pure decoding and encoding, no I/O.
//!
//! Every message is one line of ASCII text ending in `\n`, except a `START`'s script, which
//! follows its line as exactly the number of bytes the line announces.
//!
//! Host to guest ([`HostMsg`]):
//!
//! | line | meaning |
//! |---|---|
//! | `PING` | the agent answers `HELLO` (the host's way to learn the agent is up) |
//! | `START <id> <length>` + script | runs the script with bash as a job named `id` |
//! | `STOP <id>` | closes the job's stdin; its processes get SIGTERM, later SIGKILL, if it lingers |
//! | `QUIT` | stops every job, answers `BYE` and exits (the guest then powers off) |
//!
//! Guest to host ([`GuestMsg`]):
//!
//! | line | meaning |
//! |---|---|
//! | `HELLO <version>` | the agent is up (unasked at its start, and after each `PING`) |
//! | `STARTED <id>` | the job runs |
//! | `SUMMARY <id> <text>` | a line the job printed as `SUMMARY <text>` (its figures) |
//! | `EXITED <id> <code>` | the job ended: its exit code, or 128 + the signal that ended it |
//! | `ERROR <id or -> <text>` | a request was refused, or a job could not be run |
//! | `BYE` | the agent stopped every job and exits |
//!
//! Job names are 1 to [`MAX_ID_LEN`] characters of `[A-Za-z0-9._-]`; a line is at most
//! [`MAX_LINE`] bytes and a script at most [`MAX_SCRIPT`] bytes.

use thiserror::Error;

/// The virtio-serial port's name (QEMU's `virtserialport,name=`; the guest reads it from
/// `/sys/class/virtio-ports/*/name`).
pub const PORT_NAME: &str = "org.vgpu.control";
/// The protocol's version, sent in `HELLO`.
pub const VERSION: u32 = 1;
/// Longest line, newline included: a workload's summary (one JSON object of a few hundred
/// bytes) with room to spare; longer lines are refused, not buffered.
pub const MAX_LINE: usize = 4096;
/// Largest script of a `START`: the harness's jobs are a few lines; a long one fits too.
pub const MAX_SCRIPT: usize = 64 * 1024;
/// Longest job name.
pub const MAX_ID_LEN: usize = 32;
/// The prefix a job prints before a line the agent forwards to the host as `SUMMARY`.
pub const SUMMARY_PREFIX: &str = "SUMMARY ";

/// Why bytes are not a message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ControlError {
    #[error("line longer than {MAX_LINE} bytes")]
    LineTooLong,
    #[error("line is not printable ASCII")]
    NotAscii,
    #[error("unknown message {0:?}")]
    Unknown(String),
    #[error("malformed {0}")]
    Malformed(&'static str),
    #[error("job name must be 1-{MAX_ID_LEN} characters of [A-Za-z0-9._-]")]
    BadId,
    #[error("script of {0} bytes; at most {MAX_SCRIPT}")]
    ScriptTooLarge(usize),
}

/// A job's name, checked.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(String);

impl JobId {
    /// Checks `text` as a job name.
    pub fn new(text: &str) -> Result<JobId, ControlError> {
        let ok = (1..=MAX_ID_LEN).contains(&text.len())
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if ok {
            Ok(JobId(text.to_owned()))
        } else {
            Err(ControlError::BadId)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A request of the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMsg {
    Ping,
    Start { id: JobId, script: Vec<u8> },
    Stop { id: JobId },
    Quit,
}

impl HostMsg {
    /// The message's bytes on the wire.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            HostMsg::Ping => b"PING\n".to_vec(),
            HostMsg::Start { id, script } => {
                let mut out = format!("START {id} {}\n", script.len()).into_bytes();
                out.extend_from_slice(script);
                out
            }
            HostMsg::Stop { id } => format!("STOP {id}\n").into_bytes(),
            HostMsg::Quit => b"QUIT\n".to_vec(),
        }
    }
}

/// A report of the guest's agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestMsg {
    Hello { version: u32 },
    Started { id: JobId },
    Summary { id: JobId, text: String },
    Exited { id: JobId, code: i32 },
    Error { id: Option<JobId>, text: String },
    Bye,
}

impl GuestMsg {
    /// The message's line, newline included. Text that would break the line (a newline, a
    /// control character, more than [`MAX_LINE`] bytes in all) is cut at that point.
    pub fn encode(&self) -> Vec<u8> {
        let line = match self {
            GuestMsg::Hello { version } => format!("HELLO {version}"),
            GuestMsg::Started { id } => format!("STARTED {id}"),
            GuestMsg::Summary { id, text } => format!("SUMMARY {id} {text}"),
            GuestMsg::Exited { id, code } => format!("EXITED {id} {code}"),
            GuestMsg::Error { id, text } => match id {
                Some(id) => format!("ERROR {id} {text}"),
                None => format!("ERROR - {text}"),
            },
            GuestMsg::Bye => "BYE".to_owned(),
        };
        let mut out: Vec<u8> = line
            .bytes()
            .take_while(|&b| is_text(b))
            .take(MAX_LINE - 1)
            .collect();
        out.push(b'\n');
        out
    }

    /// Decodes one line (without its newline).
    pub fn parse(line: &[u8]) -> Result<GuestMsg, ControlError> {
        let line = text(line)?;
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        let id_and = |what: &'static str| -> Result<(JobId, &str), ControlError> {
            let (id, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            if id.is_empty() {
                return Err(ControlError::Malformed(what));
            }
            Ok((JobId::new(id)?, tail))
        };
        Ok(match word {
            "HELLO" => GuestMsg::Hello {
                version: rest.parse().map_err(|_| ControlError::Malformed("HELLO"))?,
            },
            "STARTED" => GuestMsg::Started {
                id: JobId::new(rest)?,
            },
            "SUMMARY" => {
                let (id, text) = id_and("SUMMARY")?;
                GuestMsg::Summary {
                    id,
                    text: text.to_owned(),
                }
            }
            "EXITED" => {
                let (id, code) = id_and("EXITED")?;
                GuestMsg::Exited {
                    id,
                    code: code
                        .parse()
                        .map_err(|_| ControlError::Malformed("EXITED"))?,
                }
            }
            "ERROR" => {
                let (id, text) = rest.split_once(' ').unwrap_or((rest, ""));
                GuestMsg::Error {
                    id: if id == "-" {
                        None
                    } else {
                        Some(JobId::new(id)?)
                    },
                    text: text.to_owned(),
                }
            }
            "BYE" if rest.is_empty() => GuestMsg::Bye,
            _ => return Err(ControlError::Unknown(word.chars().take(16).collect())),
        })
    }
}

/// Printable ASCII or a tab: what a line may hold.
fn is_text(b: u8) -> bool {
    b == b'\t' || (b' '..=b'~').contains(&b)
}

fn text(line: &[u8]) -> Result<&str, ControlError> {
    if line.len() >= MAX_LINE {
        return Err(ControlError::LineTooLong);
    }
    if !line.iter().all(|&b| is_text(b)) {
        return Err(ControlError::NotAscii);
    }
    // Printable ASCII is UTF-8.
    std::str::from_utf8(line).map_err(|_| ControlError::NotAscii)
}

/// Splits a byte stream into lines of at most [`MAX_LINE`] bytes. A longer line is reported
/// once as [`ControlError::LineTooLong`] and skipped up to its newline, so one bad line costs
/// nothing but itself.
#[derive(Debug, Default)]
pub struct LineReader {
    buf: Vec<u8>,
    /// Inside a line that was too long: bytes are dropped until its newline.
    skipping: bool,
}

impl LineReader {
    /// Takes `bytes` and returns the complete lines (without newlines) and errors they held.
    pub fn push(&mut self, mut bytes: &[u8]) -> Vec<Result<Vec<u8>, ControlError>> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let newline = bytes.iter().position(|&b| b == b'\n');
            let (chunk, rest) = match newline {
                Some(i) => (&bytes[..i], &bytes[i + 1..]),
                None => (bytes, &[][..]),
            };
            bytes = rest;
            if !self.skipping {
                if self.buf.len() + chunk.len() < MAX_LINE {
                    self.buf.extend_from_slice(chunk);
                } else {
                    self.buf.clear();
                    self.skipping = true;
                    out.push(Err(ControlError::LineTooLong));
                }
            }
            if newline.is_some() {
                if !self.skipping {
                    out.push(Ok(std::mem::take(&mut self.buf)));
                }
                self.skipping = false;
            }
        }
        out
    }
}

/// Decodes the host's byte stream into requests: lines, and each `START`'s script bytes.
#[derive(Debug, Default)]
pub struct HostDecoder {
    lines: LineReader,
    /// A `START` whose script is still arriving: its job and the bytes still to come.
    script: Option<(JobId, usize, Vec<u8>)>,
}

impl HostDecoder {
    /// Takes `bytes` and returns the requests they completed, with the errors of lines that
    /// were not requests.
    pub fn push(&mut self, mut bytes: &[u8]) -> Vec<Result<HostMsg, ControlError>> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            if let Some((_, left, script)) = &mut self.script {
                let n = (*left).min(bytes.len());
                script.extend_from_slice(&bytes[..n]);
                *left -= n;
                bytes = &bytes[n..];
                if *left == 0
                    && let Some((id, _, script)) = self.script.take()
                {
                    out.push(Ok(HostMsg::Start { id, script }));
                }
                continue;
            }
            // Lines up to the first START's header are decoded; its script is taken raw.
            let end = bytes
                .iter()
                .position(|&b| b == b'\n')
                .map_or(bytes.len(), |i| i + 1);
            let (head, rest) = bytes.split_at(end);
            bytes = rest;
            for line in self.lines.push(head) {
                match line.and_then(|l| parse_host_line(&l)) {
                    Ok(Request::Done(msg)) => out.push(Ok(msg)),
                    Ok(Request::Script(id, 0)) => out.push(Ok(HostMsg::Start {
                        id,
                        script: Vec::new(),
                    })),
                    Ok(Request::Script(id, len)) => {
                        self.script = Some((id, len, Vec::with_capacity(len)));
                    }
                    Err(e) => out.push(Err(e)),
                }
            }
        }
        out
    }
}

/// A decoded host line: a whole request, or a `START` whose script follows.
enum Request {
    Done(HostMsg),
    Script(JobId, usize),
}

/// The host's requests by name.
const REQUESTS: [&str; 4] = ["PING", "START", "STOP", "QUIT"];

fn parse_host_line(line: &[u8]) -> Result<Request, ControlError> {
    let line = text(line)?;
    let words: Vec<&str> = line.split(' ').collect();
    Ok(match words.as_slice() {
        ["PING"] => Request::Done(HostMsg::Ping),
        ["QUIT"] => Request::Done(HostMsg::Quit),
        ["STOP", id] => Request::Done(HostMsg::Stop {
            id: JobId::new(id)?,
        }),
        ["START", id, len] => {
            let id = JobId::new(id)?;
            let len: usize = len.parse().map_err(|_| ControlError::Malformed("START"))?;
            if len > MAX_SCRIPT {
                return Err(ControlError::ScriptTooLarge(len));
            }
            Request::Script(id, len)
        }
        [word, ..] => {
            return Err(match REQUESTS.iter().find(|r| *r == word) {
                Some(request) => ControlError::Malformed(request),
                None => ControlError::Unknown(word.chars().take(16).collect()),
            });
        }
        [] => return Err(ControlError::Unknown(String::new())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> JobId {
        JobId::new(s).unwrap()
    }

    fn decode_all(bytes: &[u8]) -> Vec<Result<HostMsg, ControlError>> {
        HostDecoder::default().push(bytes)
    }

    #[test]
    fn host_requests_round_trip_in_any_pieces() {
        let msgs = vec![
            HostMsg::Ping,
            HostMsg::Start {
                id: id("load-1"),
                script: b"echo hi\nvgpu-load bomb --cost-us 5\n".to_vec(),
            },
            HostMsg::Start {
                id: id("empty"),
                script: Vec::new(),
            },
            HostMsg::Stop { id: id("load-1") },
            HostMsg::Quit,
        ];
        let wire: Vec<u8> = msgs.iter().flat_map(HostMsg::encode).collect();
        for step in [1, 2, 3, 7, wire.len()] {
            let mut d = HostDecoder::default();
            let got: Vec<HostMsg> = wire
                .chunks(step)
                .flat_map(|c| d.push(c))
                .map(Result::unwrap)
                .collect();
            assert_eq!(got, msgs, "pieces of {step} bytes");
        }
    }

    #[test]
    fn a_script_may_hold_anything_even_request_lines() {
        let script = b"QUIT\nSTOP x\n\x00\xff".to_vec();
        let msg = HostMsg::Start {
            id: id("j"),
            script: script.clone(),
        };
        let mut wire = msg.encode();
        wire.extend_from_slice(b"PING\n");
        assert_eq!(
            decode_all(&wire),
            vec![Ok(msg), Ok(HostMsg::Ping)],
            "the script's bytes are taken by count, not parsed"
        );
    }

    #[test]
    fn bad_host_lines_are_refused_one_by_one() {
        let cases: &[(&[u8], ControlError)] = &[
            (b"REBOOT\n", ControlError::Unknown("REBOOT".into())),
            (b"PING now\n", ControlError::Malformed("PING")),
            (b"STOP\n", ControlError::Malformed("STOP")),
            (b"STOP a b\n", ControlError::Malformed("STOP")),
            (b"STOP ../x\n", ControlError::BadId),
            (b"STOP \n", ControlError::BadId),
            (b"START j\n", ControlError::Malformed("START")),
            (b"START j -1\n", ControlError::Malformed("START")),
            (b"START j 65537\n", ControlError::ScriptTooLarge(65537)),
            (
                b"START j 99999999999999999999999\n",
                ControlError::Malformed("START"),
            ),
            (
                b"START aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa 1\n",
                ControlError::BadId,
            ),
            (b"PI\x01NG\n", ControlError::NotAscii),
            (b"STOP \xc3\xa9\n", ControlError::NotAscii),
        ];
        for (bytes, error) in cases {
            let mut wire = bytes.to_vec();
            wire.extend_from_slice(b"PING\n");
            assert_eq!(
                decode_all(&wire),
                vec![Err(error.clone()), Ok(HostMsg::Ping)],
                "{:?}: refused, and the next request still decodes",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn an_overlong_line_is_refused_once_and_skipped() {
        let mut wire = vec![b'P'; MAX_LINE * 3];
        wire.extend_from_slice(b"\nPING\n");
        for step in [1, 100, wire.len()] {
            let mut d = HostDecoder::default();
            let got: Vec<_> = wire.chunks(step).flat_map(|c| d.push(c)).collect();
            assert_eq!(
                got,
                vec![Err(ControlError::LineTooLong), Ok(HostMsg::Ping)],
                "{step}"
            );
        }
        // The longest line that fits.
        let mut r = LineReader::default();
        let line = vec![b'x'; MAX_LINE - 1];
        let mut wire = line.clone();
        wire.push(b'\n');
        assert_eq!(r.push(&wire), vec![Ok(line)]);
    }

    #[test]
    fn guest_reports_round_trip() {
        let msgs = [
            GuestMsg::Hello { version: VERSION },
            GuestMsg::Started { id: id("a") },
            GuestMsg::Summary {
                id: id("a"),
                text: r#"{"summary":true,"fps":59.8}"#.into(),
            },
            GuestMsg::Summary {
                id: id("a"),
                text: String::new(),
            },
            GuestMsg::Exited {
                id: id("a"),
                code: 143,
            },
            GuestMsg::Exited {
                id: id("a"),
                code: -1,
            },
            GuestMsg::Error {
                id: Some(id("a")),
                text: "no such job".into(),
            },
            GuestMsg::Error {
                id: None,
                text: "unknown message \"X\"".into(),
            },
            GuestMsg::Bye,
        ];
        for msg in msgs {
            let wire = msg.encode();
            assert_eq!(wire.last(), Some(&b'\n'));
            assert_eq!(GuestMsg::parse(&wire[..wire.len() - 1]), Ok(msg));
        }
    }

    #[test]
    fn guest_text_that_would_break_the_line_is_cut() {
        let msg = GuestMsg::Summary {
            id: id("a"),
            text: format!("one\ntwo{}", "x".repeat(MAX_LINE)),
        };
        assert_eq!(msg.encode(), b"SUMMARY a one\n");
        let long = GuestMsg::Error {
            id: None,
            text: "y".repeat(2 * MAX_LINE),
        };
        let wire = long.encode();
        assert_eq!(wire.len(), MAX_LINE);
        assert!(GuestMsg::parse(&wire[..wire.len() - 1]).is_ok());
    }

    #[test]
    fn bad_guest_lines_are_refused() {
        for line in [
            &b"HELLO"[..],
            b"HELLO x",
            b"STARTED",
            b"STARTED a b",
            b"SUMMARY",
            b"EXITED a",
            b"EXITED a 1.5",
            b"ERROR ../ x",
            b"BYE now",
            b"WHAT",
            b"SUMMARY a \x07",
        ] {
            assert!(
                GuestMsg::parse(line).is_err(),
                "{:?}",
                String::from_utf8_lossy(line)
            );
        }
        assert_eq!(
            GuestMsg::parse(&vec![b'a'; MAX_LINE]),
            Err(ControlError::LineTooLong)
        );
    }
}
