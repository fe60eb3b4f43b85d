//! The metrics listener for a central Prometheus (`vgpu-schedd --metrics-listen ADDR:PORT`):
//! `GET /metrics` and `GET /healthz` only, each with `Authorization: Bearer TOKEN`, over TLS
//! (rustls, ring provider) when a certificate and key are given.
//!
//! The loopback listener of [`crate::http`] serves the dashboard and takes changes; it trusts
//! the host's users and guards against web pages (the `Host` check). This one faces the
//! network: nothing on it changes the scheduler, and every request needs the token of
//! [`MetricsListenConfig::token_file`], a file only the daemon's user may read (the daemon
//! refuses to start otherwise), compared in constant time. Plain HTTP is refused on an address
//! that is not loopback unless [`MetricsListenConfig::insecure`] says so: the token would
//! cross the network in the clear.
//!
//! It is served by the daemon's one event loop ([`crate::server`]) like the other clients,
//! never blocking: sockets are non-blocking, requests are parsed by [`http::receive`] within
//! its head and body limits, at most [`MAX_SCRAPERS`] connections are open (a new one past
//! that closes the oldest that has not been answered), new connections past
//! [`MAX_CONNECTS_PER_SECOND`] are closed unread (each TLS handshake costs the loop a
//! signature), and each connection has [`SCRAPE_HEAD_TIMEOUT`] to send its request and
//! [`SCRAPE_TIMEOUT`] in all.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use event_manager::EventSet;
use log::debug;
use rustls::ServerConnection;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use thiserror::Error;

use crate::http::{self, HttpError, HttpRequest, Received, Route};
use crate::server::{Flushed, read_client, write_some};

/// Most connections open at once: a Prometheus server or two, with room for a probe.
pub const MAX_SCRAPERS: usize = 8;
/// Most new connections served per second; the rest are closed unread. Each TLS handshake
/// costs the event loop a signature (tens of µs to a millisecond): this bounds what a flood
/// of handshakes takes from the VMs' scheduling to a few percent.
pub const MAX_CONNECTS_PER_SECOND: u32 = 16;
/// How long a connection may take for the TLS handshake and its request: a scraper across a
/// network sends them at once, in a few round trips.
pub const SCRAPE_HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection lasts in all, the answer read included (Prometheus' default scrape
/// timeout is 10 s).
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(15);
/// Largest token file: a token is a line of a few dozen characters.
pub const MAX_TOKEN_FILE_BYTES: u64 = 4096;
/// Shortest token accepted: 16 characters of a random hex or base64 string are 64 bits or
/// more, beyond guessing over a network.
pub const MIN_TOKEN_CHARS: usize = 16;
/// Largest certificate chain or key file.
pub const MAX_PEM_FILE_BYTES: u64 = 1024 * 1024;
/// Most TLS reads per wake-up of one connection (a request is one or two records).
const MAX_TLS_READS_PER_WAKE: usize = 16;
/// Who must not have access to a secret file, and the mode that fixes it.
#[derive(Debug, Clone, Copy)]
struct Secrecy {
    /// Mode bits it must not have.
    forbidden: u32,
    /// Who those bits let in.
    who: &'static str,
    /// The `chmod` that fixes it.
    fix: &'static str,
}

/// The token file: no access for group or others.
const TOKEN_SECRECY: Secrecy = Secrecy {
    forbidden: 0o077,
    who: "group or others",
    fix: "600",
};
/// The key file: no access for others (a group such as Debian's `ssl-cert` may read it).
const KEY_SECRECY: Secrecy = Secrecy {
    forbidden: 0o007,
    who: "others",
    fix: "600 (or 640 with the group)",
};

/// The listener's options (`--metrics-listen`, `--metrics-token-file`, `--metrics-tls-cert`,
/// `--metrics-tls-key`, `--metrics-insecure`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsListenConfig {
    /// Where it listens; port 0 picks a free one.
    pub addr: SocketAddr,
    /// The file holding the bearer token: one line, mode 0600 or narrower.
    pub token_file: PathBuf,
    /// The certificate chain and private key (PEM) of TLS, if any.
    pub tls: Option<TlsFiles>,
    /// Serve plain HTTP on an address that is not loopback.
    pub insecure: bool,
}

/// The PEM files of the listener's TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, the listener's own first.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Why the listener cannot start.
#[derive(Debug, Error)]
pub enum ListenError {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A file others than the daemon's user (and, for the key, its group) could read.
    #[error(
        "{}: mode {mode:04o} lets {who} read or change it: chmod {fix} it",
        path.display()
    )]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its mode bits.
        mode: u32,
        /// Who may use it and should not.
        who: &'static str,
        /// The mode to give it.
        fix: &'static str,
    },
    /// A file whose contents are refused.
    #[error("{}: {why}", path.display())]
    Refused {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// rustls refused the certificate and key.
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    /// Plain HTTP on an address that is not loopback, without `--metrics-insecure`.
    #[error(
        "{0} is not a loopback address: give --metrics-tls-cert and --metrics-tls-key, or \
         --metrics-insecure to send the token and the metrics in the clear"
    )]
    Plain(SocketAddr),
    /// The listener could not be set up.
    #[error("metrics listener {addr}: {source}")]
    Bind {
        /// Its address.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
}

/// Reads a regular file of at most `max` bytes; a secret one must be kept as `secrecy` says.
fn read_file(path: &Path, max: u64, secrecy: Option<Secrecy>) -> Result<Vec<u8>, ListenError> {
    let fail = |source| ListenError::Read {
        path: path.to_owned(),
        source,
    };
    let refused = |why: String| ListenError::Refused {
        path: path.to_owned(),
        why,
    };
    let file = File::open(path).map_err(fail)?;
    // The mode of the file opened, not of a path that may change in between.
    let meta = file.metadata().map_err(fail)?;
    if !meta.is_file() {
        return Err(refused("not a regular file".to_owned()));
    }
    let mode = meta.mode() & 0o7777;
    if let Some(s) = secrecy.filter(|s| mode & s.forbidden != 0) {
        return Err(ListenError::Exposed {
            path: path.to_owned(),
            mode,
            who: s.who,
            fix: s.fix,
        });
    }
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(fail)?;
    if bytes.len() as u64 > max {
        return Err(refused(format!("larger than {max} bytes")));
    }
    Ok(bytes)
}

/// The token of a token file's contents: one line of at least [`MIN_TOKEN_CHARS`] visible
/// ASCII characters (what an `Authorization` header can carry), surrounding whitespace
/// dropped.
pub fn parse_token(text: &[u8]) -> Result<String, String> {
    let token = std::str::from_utf8(text)
        .map_err(|_| "the token is not ASCII".to_owned())?
        .trim();
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the token must be one word of visible ASCII characters".to_owned());
    }
    if token.len() < MIN_TOKEN_CHARS {
        return Err(format!(
            "the token has {} characters, fewer than {MIN_TOKEN_CHARS} (make one with \
             `openssl rand -hex 32`)",
            token.len()
        ));
    }
    Ok(token.to_owned())
}

/// The route of `req` on the listener with `token`: it must carry
/// `Authorization: Bearer TOKEN` (checked first, in constant time, so that a client without it
/// learns nothing of the routes), then ask for `GET /metrics` or `GET /healthz`.
pub fn authorize(token: &str, req: &HttpRequest) -> Result<Route, HttpError> {
    let given = req
        .authorization
        .as_deref()
        .and_then(|a| a.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, credentials)| credentials.trim())
        .unwrap_or_default();
    if !http::same_secret(given.as_bytes(), token.as_bytes()) {
        return Err(HttpError::Unauthorized);
    }
    match Route::of(&req.method, &req.path)? {
        route @ (Route::Metrics | Route::Health) => Ok(route),
        _ => Err(HttpError::NotFound),
    }
}

/// The TLS configuration of a certificate chain and key (PEM files).
fn tls_config(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, ListenError> {
    let refused = |path: &Path, why: String| ListenError::Refused {
        path: path.to_owned(),
        why,
    };
    let cert_pem = read_file(&files.cert, MAX_PEM_FILE_BYTES, None)?;
    let certs = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| refused(&files.cert, format!("PEM: {e}")))?;
    if certs.is_empty() {
        return Err(refused(&files.cert, "no CERTIFICATE in it".to_owned()));
    }
    let key_pem = read_file(&files.key, MAX_PEM_FILE_BYTES, Some(KEY_SECRECY))?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| refused(&files.key, format!("PEM private key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    Ok(Arc::new(config))
}

/// The bound listener, its token and its TLS configuration.
#[derive(Debug)]
pub struct MetricsListener {
    listener: TcpListener,
    token: String,
    tls: Option<Arc<rustls::ServerConfig>>,
    /// New connections of the current second.
    connects: ConnectWindow,
}

/// New connections per second, for [`MAX_CONNECTS_PER_SECOND`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ConnectWindow {
    /// When the current second started.
    start: Instant,
    /// Connections admitted in it.
    admitted: u32,
}

impl ConnectWindow {
    /// Whether a connection at `now` is admitted (and counts it); a second starts at the
    /// first connection a second or more after the last one started.
    fn admit(&mut self, now: Instant) -> bool {
        if now.saturating_duration_since(self.start) >= Duration::from_secs(1) {
            *self = ConnectWindow {
                start: now,
                admitted: 0,
            };
        }
        if self.admitted >= MAX_CONNECTS_PER_SECOND {
            return false;
        }
        self.admitted = self.admitted.saturating_add(1);
        true
    }
}

impl MetricsListener {
    /// Reads the token (and the certificate and key), checks the address may serve plain
    /// HTTP when there is no TLS, and binds the listener (non-blocking).
    pub fn bind(config: &MetricsListenConfig) -> Result<MetricsListener, ListenError> {
        let token_text = read_file(
            &config.token_file,
            MAX_TOKEN_FILE_BYTES,
            Some(TOKEN_SECRECY),
        )?;
        let token = parse_token(&token_text).map_err(|why| ListenError::Refused {
            path: config.token_file.clone(),
            why,
        })?;
        let tls = config.tls.as_ref().map(tls_config).transpose()?;
        if tls.is_none() && !config.insecure && !config.addr.ip().is_loopback() {
            return Err(ListenError::Plain(config.addr));
        }
        let bind_err = |source| ListenError::Bind {
            addr: config.addr,
            source,
        };
        let listener = TcpListener::bind(config.addr).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        Ok(MetricsListener {
            listener,
            token,
            tls,
            connects: ConnectWindow {
                start: Instant::now(),
                admitted: 0,
            },
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Whether it serves TLS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The next connection, if one waits.
    pub fn accept(&mut self) -> io::Result<Accepted> {
        let stream = match self.listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Accepted::None),
            Err(e) => return Err(e),
        };
        let now = Instant::now();
        if !self.connects.admit(now) {
            return Ok(Accepted::Dropped);
        }
        stream.set_nonblocking(true)?;
        let tls = match &self.tls {
            Some(config) => Some(Box::new(
                ServerConnection::new(Arc::clone(config)).map_err(io::Error::other)?,
            )),
            None => None,
        };
        Ok(Accepted::New(Scraper {
            stream,
            tls,
            head: Vec::new(),
            out: Vec::new(),
            answered: false,
            close_sent: false,
            interest: EventSet::IN,
            since: now,
        }))
    }

    /// The route of a whole request ([`authorize`]).
    pub fn authorize(&self, req: &HttpRequest) -> Result<Route, HttpError> {
        authorize(&self.token, req)
    }
}

impl AsRawFd for MetricsListener {
    fn as_raw_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }
}

/// What [`MetricsListener::accept`] found.
#[derive(Debug)]
pub enum Accepted {
    /// No connection waits.
    None,
    /// One past [`MAX_CONNECTS_PER_SECOND`]: closed unread.
    Dropped,
    /// A new connection to serve.
    New(Scraper),
}

/// What a scraper's connection holds after a read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A whole request, to be answered ([`Scraper::answer`]).
    Request(HttpRequest),
    /// A request refused as it stands; its answer is [`HttpError::answer`].
    Refused(HttpError),
    /// Nothing to answer yet.
    Pending,
    /// The connection ended or broke: close it.
    Closed,
}

/// One connection of the metrics listener: its TLS state, the request so far, the answer not
/// yet sent.
#[derive(Debug)]
pub struct Scraper {
    stream: TcpStream,
    /// Its TLS state (boxed: a kilobyte and more, where the loop's other clients are small).
    tls: Option<Box<ServerConnection>>,
    /// The request as received so far ([`http::receive`]).
    head: Vec<u8>,
    /// Answer bytes not yet handed to TLS or the socket.
    out: Vec<u8>,
    /// The answer is queued: nothing more is read, and the connection closes once it is sent.
    answered: bool,
    /// TLS's close_notify is queued.
    close_sent: bool,
    /// What the loop watches it for.
    interest: EventSet,
    since: Instant,
}

impl Scraper {
    /// Reads what arrived (TLS records decrypted) and parses the request.
    pub fn receive(&mut self) -> Step {
        if self.answered {
            return Step::Pending;
        }
        let mut state = Received::Incomplete;
        let head = &mut self.head;
        let mut feed = |bytes: &[u8]| {
            if state == Received::Incomplete {
                state = http::receive(head, bytes);
            }
        };
        let ended = match &mut self.tls {
            None => read_client(&mut self.stream, &mut feed),
            Some(tls) => read_tls(tls, &mut self.stream, &mut feed),
        };
        match (state, ended) {
            (Received::Complete(req), _) => Step::Request(req),
            (Received::Refused(e), _) => Step::Refused(e),
            (Received::Incomplete, Ok(false)) => Step::Pending,
            (Received::Incomplete, Ok(true) | Err(_)) => Step::Closed,
        }
    }

    /// Queues the whole answer; the connection closes once it is sent.
    pub fn answer(&mut self, bytes: Vec<u8>) {
        self.out = bytes;
        self.answered = true;
    }

    /// Writes what the socket takes; says whether to close the connection or watch it for
    /// other events.
    pub(crate) fn flush(&mut self) -> Flushed {
        let result = match &mut self.tls {
            None => write_some(&mut self.stream, &mut self.out),
            Some(tls) => write_tls(
                tls,
                &mut self.stream,
                &mut self.out,
                self.answered,
                &mut self.close_sent,
            ),
        };
        let unsent = !self.out.is_empty() || self.tls.as_ref().is_some_and(|t| t.wants_write());
        if result.is_err() || (self.answered && !unsent) {
            return Flushed::Close;
        }
        let mut want = EventSet::empty();
        if !self.answered {
            want |= EventSet::IN;
        }
        if unsent {
            want |= EventSet::OUT;
        }
        if want == self.interest {
            return Flushed::Keep;
        }
        self.interest = want;
        Flushed::Watch(self.stream.as_raw_fd(), want)
    }

    /// Whether it has had its time: [`SCRAPE_HEAD_TIMEOUT`] to send its request,
    /// [`SCRAPE_TIMEOUT`] in all.
    pub fn expired(&self) -> bool {
        let age = self.since.elapsed();
        age > SCRAPE_TIMEOUT || (!self.answered && age > SCRAPE_HEAD_TIMEOUT)
    }

    /// Whether its answer is queued.
    pub fn answered(&self) -> bool {
        self.answered
    }

    /// When it connected.
    pub fn since(&self) -> Instant {
        self.since
    }
}

impl AsRawFd for Scraper {
    fn as_raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
}

/// Reads TLS records (at most [`MAX_TLS_READS_PER_WAKE`]), processes them and hands the
/// plaintext to `feed`; `Ok(true)` at end of stream. A TLS error is logged at debug level
/// and ends the connection (its alert is sent if the socket takes it).
fn read_tls(
    tls: &mut ServerConnection,
    stream: &mut TcpStream,
    feed: &mut dyn FnMut(&[u8]),
) -> io::Result<bool> {
    let mut buf = [0u8; 4096];
    for _ in 0..MAX_TLS_READS_PER_WAKE {
        match tls.read_tls(stream) {
            Ok(0) => return Ok(true),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        if let Err(e) = tls.process_new_packets() {
            debug!("metrics listener: TLS: {e}");
            let _ = tls.write_tls(stream);
            return Err(io::Error::other(e));
        }
        loop {
            match tls.reader().read(&mut buf) {
                Ok(0) => return Ok(true),
                Ok(n) => feed(buf.get(..n).unwrap_or_default()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(false)
}

/// Hands `out` to TLS as its buffer takes it and writes the records the socket takes; once
/// the whole answer is handed over (`answered` and `out` empty), queues close_notify.
fn write_tls(
    tls: &mut ServerConnection,
    stream: &mut TcpStream,
    out: &mut Vec<u8>,
    answered: bool,
    close_sent: &mut bool,
) -> io::Result<()> {
    loop {
        if !out.is_empty() {
            let n = tls.writer().write(out)?;
            out.drain(..n.min(out.len()));
        }
        if answered && out.is_empty() && !*close_sent {
            tls.send_close_notify();
            *close_sent = true;
        }
        if !tls.wants_write() {
            return Ok(());
        }
        match tls.write_tls(stream) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: &str, path: &str, authorization: Option<&str>) -> HttpRequest {
        HttpRequest {
            method: method.into(),
            path: path.into(),
            host: None,
            token: None,
            authorization: authorization.map(Into::into),
            content_type: None,
            body: Vec::new(),
        }
    }

    #[test]
    fn only_the_bearer_token_opens_metrics_and_health() {
        let token = "0123456789abcdef";
        let ok = "Bearer 0123456789abcdef";
        assert_eq!(
            authorize(token, &request("GET", "/metrics", Some(ok))),
            Ok(Route::Metrics)
        );
        assert_eq!(
            authorize(
                token,
                &request("GET", "/healthz", Some(" bEaReR  0123456789abcdef "))
            ),
            Ok(Route::Health)
        );
        for bad in [
            None,
            Some(""),
            Some("Bearer"),
            Some("Bearer "),
            Some("Bearer 0123456789abcdeF"),
            Some("Bearer 0123456789abcde"),
            Some("Bearer 0123456789abcdef0"),
            Some("Basic 0123456789abcdef"),
            Some("0123456789abcdef"),
            Some("Bearer\t0123456789abcdef"),
        ] {
            for path in ["/metrics", "/healthz", "/", "/nope"] {
                assert_eq!(
                    authorize(token, &request("GET", path, bad)),
                    Err(HttpError::Unauthorized),
                    "{bad:?} {path}"
                );
            }
        }
        for (method, path, e) in [
            ("GET", "/", HttpError::NotFound),
            ("GET", "/api/state", HttpError::NotFound),
            ("GET", "/events", HttpError::NotFound),
            ("POST", "/api/policy", HttpError::NotFound),
            ("GET", "/nope", HttpError::NotFound),
            ("POST", "/metrics", HttpError::MethodNotAllowed),
        ] {
            assert_eq!(authorize(token, &request(method, path, Some(ok))), Err(e));
        }
        let answer = String::from_utf8(HttpError::Unauthorized.answer()).unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 401 Unauthorized\r\n"),
            "{answer}"
        );
        assert!(answer.contains("\r\nWWW-Authenticate: Bearer realm=\"vgpu-schedd\"\r\n"));
    }

    #[test]
    fn token_files_hold_one_long_visible_word() {
        assert_eq!(
            parse_token(b"  0123456789abcdef0123\n").as_deref(),
            Ok("0123456789abcdef0123")
        );
        assert!(parse_token(b"0123456789abcde\n").is_err());
        assert!(parse_token(b"0123456789 abcdef0123").is_err());
        assert!(parse_token(b"0123456789abcdef\n0123").is_err());
        assert!(parse_token("0123456789abcdéf".as_bytes()).is_err());
        assert!(parse_token(b"0123456789abcdef\xff").is_err());
        assert!(parse_token(b"").is_err());
    }

    #[test]
    fn new_connections_are_counted_per_second() {
        let t0 = Instant::now();
        let mut w = ConnectWindow {
            start: t0,
            admitted: 0,
        };
        for _ in 0..MAX_CONNECTS_PER_SECOND {
            assert!(w.admit(t0 + Duration::from_millis(500)));
        }
        assert!(!w.admit(t0 + Duration::from_millis(999)));
        // A second after the window started, a new one starts at that connection.
        let t1 = t0 + Duration::from_secs(1);
        assert!(w.admit(t1));
        assert_eq!(
            w,
            ConnectWindow {
                start: t1,
                admitted: 1
            }
        );
        // A clock that goes back does not reopen the window.
        assert!(w.admit(t0));
        assert_eq!(w.admitted, 2);
    }
}
