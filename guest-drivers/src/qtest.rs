//! Client for QEMU's qtest text protocol.
//!
//! QEMU started with `-accel qtest -qtest unix:PATH` connects to `PATH` and then executes one
//! command per line (`outl 0xcf8 0x80000000`, `readq 0x100000`, ...), answering each with a line
//! `OK [value]` (or `FAIL ...`/`ERR ...`). When IRQ interception is on, QEMU also sends
//! asynchronous `IRQ raise N` / `IRQ lower N` lines at any time; they are queued, not treated as
//! replies.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// Longest command text kept in an error message (memory writes can be megabytes of hex).
const COMMAND_SNIPPET_LEN: usize = 80;

/// Errors of the qtest client.
#[derive(Debug, thiserror::Error)]
pub enum QtestError {
    /// Reading from or writing to the qtest socket failed.
    #[error("qtest I/O error during `{command}`: {source}")]
    Io {
        /// The command being executed (shortened).
        command: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// QEMU did not answer within the read timeout.
    #[error("timed out waiting for QEMU's reply to `{command}`")]
    Timeout {
        /// The command being executed (shortened).
        command: String,
    },
    /// QEMU closed the connection (it exited or was killed).
    #[error("QEMU closed the qtest connection during `{command}`")]
    Closed {
        /// The command being executed (shortened).
        command: String,
    },
    /// An earlier failure left the connection out of step with QEMU; it cannot be used again.
    #[error("qtest connection unusable after an earlier I/O error or timeout")]
    Broken,
    /// QEMU answered the command with `FAIL` or `ERR`.
    #[error("QEMU rejected `{command}`: {reply}")]
    Rejected {
        /// The command being executed (shortened).
        command: String,
        /// QEMU's reply line.
        reply: String,
    },
    /// QEMU's reply could not be parsed.
    #[error("unexpected qtest reply to `{command}`: {reply}")]
    BadReply {
        /// The command being executed (shortened).
        command: String,
        /// QEMU's reply line.
        reply: String,
    },
}

/// Result type of this module.
pub type Result<T> = std::result::Result<T, QtestError>;

/// An asynchronous interrupt notification sent by QEMU (only with IRQ interception enabled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IrqEvent {
    /// `IRQ raise N`.
    Raise(u32),
    /// `IRQ lower N`.
    Lower(u32),
}

/// A qtest connection to one QEMU process.
#[derive(Debug)]
pub struct Qtest {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    irq_events: VecDeque<IrqEvent>,
    broken: bool,
}

impl Qtest {
    /// Wraps a connected qtest socket. Every reply must arrive within `timeout`, so a QEMU that
    /// died or hangs produces an error instead of blocking forever.
    pub fn new(stream: UnixStream, timeout: Duration) -> Result<Self> {
        let writer = stream.try_clone().map_err(|source| QtestError::Io {
            command: "<connect>".into(),
            source,
        })?;
        let mut qtest = Self {
            reader: BufReader::new(stream),
            writer,
            irq_events: VecDeque::new(),
            broken: false,
        };
        qtest.set_timeout(timeout)?;
        Ok(qtest)
    }

    /// Changes how long sending a command and receiving its reply may each take.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        let io_err = |source| QtestError::Io {
            command: "<set timeout>".into(),
            source,
        };
        self.writer
            .set_read_timeout(Some(timeout))
            .map_err(io_err)?;
        self.writer.set_write_timeout(Some(timeout)).map_err(io_err)
    }

    /// Sends one raw command line (without the newline) and returns the text after `OK`, if any.
    pub fn command(&mut self, command: &str) -> Result<Option<String>> {
        if self.broken {
            return Err(QtestError::Broken);
        }
        let result = self.exchange(command);
        if matches!(
            result,
            Err(QtestError::Io { .. } | QtestError::Timeout { .. } | QtestError::Closed { .. })
        ) {
            self.broken = true;
        }
        result
    }

    fn exchange(&mut self, command: &str) -> Result<Option<String>> {
        log::trace!("qtest > {}", snippet(command));
        let io_err = |source: io::Error| {
            let command = snippet(command);
            match source.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    QtestError::Timeout { command }
                }
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => {
                    QtestError::Closed { command }
                }
                _ => QtestError::Io { command, source },
            }
        };
        let mut line = String::with_capacity(command.len() + 1);
        line.push_str(command);
        line.push('\n');
        self.writer.write_all(line.as_bytes()).map_err(io_err)?;
        loop {
            line.clear();
            if self.reader.read_line(&mut line).map_err(io_err)? == 0 {
                return Err(QtestError::Closed {
                    command: snippet(command),
                });
            }
            let reply = line.trim_end();
            log::trace!("qtest < {}", snippet(reply));
            if let Some(irq) = reply.strip_prefix("IRQ ") {
                self.queue_irq(irq, command)?;
                continue;
            }
            return match reply.split_once(' ').unwrap_or((reply, "")) {
                ("OK", "") => Ok(None),
                ("OK", value) => Ok(Some(value.to_owned())),
                ("FAIL" | "ERR", _) => Err(QtestError::Rejected {
                    command: snippet(command),
                    reply: reply.to_owned(),
                }),
                _ => Err(bad_reply(command, reply)),
            };
        }
    }

    fn queue_irq(&mut self, irq: &str, command: &str) -> Result<()> {
        let event = match irq.split_once(' ') {
            Some(("raise", n)) => n.parse().ok().map(IrqEvent::Raise),
            Some(("lower", n)) => n.parse().ok().map(IrqEvent::Lower),
            _ => None,
        };
        let event = event.ok_or_else(|| bad_reply(command, irq))?;
        self.irq_events.push_back(event);
        Ok(())
    }

    /// Returns and forgets the asynchronous IRQ notifications received so far.
    pub fn take_irq_events(&mut self) -> Vec<IrqEvent> {
        self.irq_events.drain(..).collect()
    }

    /// Runs a command whose reply is `OK <number>` and parses the number.
    fn query(&mut self, command: &str) -> Result<u64> {
        let value = self.command(command)?;
        value
            .as_deref()
            .and_then(parse_number)
            .ok_or_else(|| bad_reply(command, value.as_deref().unwrap_or("OK")))
    }

    /// Runs a command whose reply is a plain `OK`.
    fn execute(&mut self, command: &str) -> Result<()> {
        self.command(command).map(drop)
    }

    /// Writes a byte to an I/O port.
    pub fn outb(&mut self, port: u16, value: u8) -> Result<()> {
        self.execute(&format!("outb {port:#x} {value:#x}"))
    }

    /// Writes a 16-bit value to an I/O port.
    pub fn outw(&mut self, port: u16, value: u16) -> Result<()> {
        self.execute(&format!("outw {port:#x} {value:#x}"))
    }

    /// Writes a 32-bit value to an I/O port.
    pub fn outl(&mut self, port: u16, value: u32) -> Result<()> {
        self.execute(&format!("outl {port:#x} {value:#x}"))
    }

    /// Reads a byte from an I/O port.
    pub fn inb(&mut self, port: u16) -> Result<u8> {
        self.query(&format!("inb {port:#x}")).map(|v| v as u8)
    }

    /// Reads a 16-bit value from an I/O port.
    pub fn inw(&mut self, port: u16) -> Result<u16> {
        self.query(&format!("inw {port:#x}")).map(|v| v as u16)
    }

    /// Reads a 32-bit value from an I/O port.
    pub fn inl(&mut self, port: u16) -> Result<u32> {
        self.query(&format!("inl {port:#x}")).map(|v| v as u32)
    }

    /// Writes a byte to guest-physical memory (RAM or MMIO).
    pub fn writeb(&mut self, addr: u64, value: u8) -> Result<()> {
        self.execute(&format!("writeb {addr:#x} {value:#x}"))
    }

    /// Writes a little-endian 16-bit value to guest-physical memory (one 2-byte access).
    pub fn writew(&mut self, addr: u64, value: u16) -> Result<()> {
        self.execute(&format!("writew {addr:#x} {value:#x}"))
    }

    /// Writes a little-endian 32-bit value to guest-physical memory (one 4-byte access).
    pub fn writel(&mut self, addr: u64, value: u32) -> Result<()> {
        self.execute(&format!("writel {addr:#x} {value:#x}"))
    }

    /// Writes a little-endian 64-bit value to guest-physical memory (one 8-byte access).
    pub fn writeq(&mut self, addr: u64, value: u64) -> Result<()> {
        self.execute(&format!("writeq {addr:#x} {value:#x}"))
    }

    /// Reads a byte from guest-physical memory.
    pub fn readb(&mut self, addr: u64) -> Result<u8> {
        self.query(&format!("readb {addr:#x}")).map(|v| v as u8)
    }

    /// Reads a little-endian 16-bit value from guest-physical memory (one 2-byte access).
    pub fn readw(&mut self, addr: u64) -> Result<u16> {
        self.query(&format!("readw {addr:#x}")).map(|v| v as u16)
    }

    /// Reads a little-endian 32-bit value from guest-physical memory (one 4-byte access).
    pub fn readl(&mut self, addr: u64) -> Result<u32> {
        self.query(&format!("readl {addr:#x}")).map(|v| v as u32)
    }

    /// Reads a little-endian 64-bit value from guest-physical memory (one 8-byte access).
    pub fn readq(&mut self, addr: u64) -> Result<u64> {
        self.query(&format!("readq {addr:#x}"))
    }

    /// Copies `data` into guest-physical memory at `addr` (qtest `write`).
    pub fn memwrite(&mut self, addr: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            // QEMU rejects a `write` without payload.
            return Ok(());
        }
        let mut command = format!("write {addr:#x} {:#x} 0x", data.len());
        command.reserve(data.len() * 2);
        for byte in data {
            // Writing into a String cannot fail.
            let _ = write!(command, "{byte:02x}");
        }
        self.execute(&command)
    }

    /// Reads `len` bytes of guest-physical memory at `addr` (qtest `read`).
    pub fn memread(&mut self, addr: u64, len: usize) -> Result<Vec<u8>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let command = format!("read {addr:#x} {len:#x}");
        let value = self.command(&command)?;
        let bad = || bad_reply(&command, value.as_deref().unwrap_or("OK"));
        value
            .as_deref()
            .and_then(|v| v.strip_prefix("0x"))
            .and_then(decode_hex)
            .filter(|bytes| bytes.len() == len)
            .ok_or_else(bad)
    }

    /// Fills `len` bytes of guest-physical memory at `addr` with `value` (qtest `memset`).
    pub fn memset(&mut self, addr: u64, len: usize, value: u8) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.execute(&format!("memset {addr:#x} {len:#x} {value:#x}"))
    }

    /// Advances QEMU's virtual clock (frozen under qtest) by `ns` nanoseconds, or to the next
    /// timer deadline when `ns` is `None`. Returns the new virtual time in nanoseconds.
    pub fn clock_step(&mut self, ns: Option<u64>) -> Result<u64> {
        match ns {
            Some(ns) => self.query(&format!("clock_step {ns}")),
            None => self.query("clock_step"),
        }
    }
}

/// Parses `0x...` hexadecimal or decimal numbers as QEMU prints them.
fn parse_number(text: &str) -> Option<u64> {
    match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let digits = hex.as_bytes();
    if digits.len() % 2 != 0 {
        return None;
    }
    digits
        .chunks_exact(2)
        .map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?))
        .collect()
}

fn snippet(text: &str) -> String {
    match text.char_indices().nth(COMMAND_SNIPPET_LEN) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_owned(),
    }
}

fn bad_reply(command: &str, reply: &str) -> QtestError {
    QtestError::BadReply {
        command: snippet(command),
        reply: snippet(reply),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::thread;

    /// Runs `client` against a fake QEMU that answers each received line from `replies`.
    fn with_fake_qemu<T>(
        replies: &'static [&'static str],
        client: impl FnOnce(&mut Qtest) -> T,
    ) -> (T, Vec<String>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let server = thread::spawn(move || {
            let mut reader = BufReader::new(theirs.try_clone().unwrap());
            let mut writer = theirs;
            let mut seen = Vec::new();
            for reply in replies {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap() == 0 {
                    break;
                }
                seen.push(line.trim_end().to_owned());
                writer.write_all(reply.as_bytes()).unwrap();
            }
            // Out of replies: hang up like a dying QEMU, but drain what the client still sends.
            writer.shutdown(std::net::Shutdown::Write).unwrap();
            let _ = reader.read_to_end(&mut Vec::new());
            seen
        });
        let mut qt = Qtest::new(ours, Duration::from_secs(5)).unwrap();
        let result = client(&mut qt);
        drop(qt);
        (result, server.join().unwrap())
    }

    #[test]
    fn parses_replies_and_queues_irqs() {
        let replies = &[
            "OK 0x0086\n",
            "IRQ raise 11\nOK 0x00000000deadbeef\n",
            "OK 0x01ff\n",
            "OK\n",
        ];
        let ((b, q, mem, irqs), sent) = with_fake_qemu(replies, |qt| {
            let b = qt.inb(0xcfc).unwrap();
            let q = qt.readq(0x1000).unwrap();
            let mem = qt.memread(0x2000, 2).unwrap();
            qt.memwrite(0x3000, &[0xab, 0x01]).unwrap();
            (b, q, mem, qt.take_irq_events())
        });
        assert_eq!(b, 0x86);
        assert_eq!(q, 0xdead_beef);
        assert_eq!(mem, [0x01, 0xff]);
        assert_eq!(irqs, [IrqEvent::Raise(11)]);
        assert_eq!(
            sent,
            [
                "inb 0xcfc",
                "readq 0x1000",
                "read 0x2000 0x2",
                "write 0x3000 0x2 0xab01"
            ]
        );
    }

    #[test]
    fn reports_rejection_and_hangup() {
        let ((rejected, closed, after), _) =
            with_fake_qemu(&["FAIL Unknown command 'x'\n"], |qt| {
                let rejected = qt.command("x");
                let closed = qt.readb(0);
                let after = qt.readb(0);
                (rejected, closed, after)
            });
        assert!(matches!(rejected, Err(QtestError::Rejected { .. })));
        assert!(matches!(closed, Err(QtestError::Closed { .. })));
        assert!(matches!(after, Err(QtestError::Broken)));
    }

    #[test]
    fn times_out_instead_of_hanging() {
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let mut qt = Qtest::new(ours, Duration::from_millis(50)).unwrap();
        assert!(matches!(qt.readl(0), Err(QtestError::Timeout { .. })));
    }
}
