//! The HTTP side of the daemon's loopback listener, as pure functions the event loop
//! ([`crate::server`]) calls: request parsing (the head with `httparse`, the body by its
//! `Content-Length`), routing, the access rules and the answers, Server-Sent Events framing
//! included.
//!
//! Every client is untrusted. A request is refused before anything is carried out when its
//! head or body is over its limit ([`MAX_HTTP_HEAD_BYTES`], [`MAX_HTTP_BODY_BYTES`]), when it
//! repeats a header the daemon reads, sends a body any other way than with `Content-Length`,
//! names another host than the listener ([`Access::check`]: the guard against DNS rebinding,
//! where a web page of another site reaches a loopback port under its own name), or, for a
//! request that changes the scheduler, lacks the listener's token (`X-Vgpu-Token`) or a JSON
//! content type.
//!
//! | route | answer |
//! |---|---|
//! | `GET /` | the dashboard page |
//! | `GET /dashboard.js`, `GET /dashboard.css` | its script and style |
//! | `GET /metrics` | Prometheus text |
//! | `GET /healthz` | `{"status": "ok", "vms_connected": N}` while the loop serves (no token) |
//! | `GET /api/state` | the dashboard snapshot (JSON) |
//! | `GET /api/policies` | the policies the page offers (JSON) |
//! | `GET /events` | Server-Sent Events: the history, then a snapshot about every second |
//! | `POST /api/policy` | installs a policy (token) |
//! | `POST /api/params` | changes a VM's parameters (token) |
//! | `POST /api/focus` | focuses a VM (token) |

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};

use thiserror::Error;

/// Largest request head: a browser's GET with its usual headers is 1-2 KiB.
pub const MAX_HTTP_HEAD_BYTES: usize = 8 * 1024;
/// Largest request body: the largest one the dashboard sends, a policy configuration, is a
/// few hundred bytes; a TimeGraph configuration with many spec lines still fits.
pub const MAX_HTTP_BODY_BYTES: usize = 16 * 1024;
/// Most header lines in a request head (a browser sends about 15).
pub const MAX_HTTP_HEADERS: usize = 48;
/// Length of the listener's token in random bytes (hex-encoded: twice as many characters).
pub const TOKEN_BYTES: usize = 16;
/// The header that carries the token.
pub const TOKEN_HEADER: &str = "X-Vgpu-Token";

/// Headers every answer carries: nothing is cached (answers are live), no type is sniffed,
/// no referrer leaves the page, the page is never framed, and the page may load nothing but
/// its own script, style and event stream.
const COMMON_HEADERS: &str = "Cache-Control: no-store\r\n\
     X-Content-Type-Options: nosniff\r\n\
     Referrer-Policy: no-referrer\r\n\
     X-Frame-Options: DENY\r\n\
     Content-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'\r\n";

/// Why a request is refused; each maps to its status code ([`HttpError::status`]).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HttpError {
    /// Not a well-formed HTTP/1.x request, or a body that is not the JSON expected.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The head is over [`MAX_HTTP_HEAD_BYTES`] or has more than [`MAX_HTTP_HEADERS`] lines.
    #[error("request head larger than {MAX_HTTP_HEAD_BYTES} bytes or {MAX_HTTP_HEADERS} lines")]
    HeadTooLarge,
    /// The body is over [`MAX_HTTP_BODY_BYTES`].
    #[error("request body larger than {MAX_HTTP_BODY_BYTES} bytes")]
    BodyTooLarge,
    /// The `Host` header is missing or names another host or port than the listener.
    #[error("the Host header must name this listener ({0})")]
    BadHost(SocketAddr),
    /// A request that changes the scheduler without the listener's token.
    #[error("missing or wrong {TOKEN_HEADER} (get the dashboard URL with `vgpuctl dashboard`)")]
    BadToken,
    /// A request to the metrics listener ([`crate::metrics_listener`]) without its bearer
    /// token.
    #[error("missing or wrong Authorization: Bearer token")]
    Unauthorized,
    /// No such route.
    #[error("not found")]
    NotFound,
    /// The route exists with another method.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// A body that is not declared `application/json`.
    #[error("the body must be application/json")]
    UnsupportedType,
    /// The named VM is not known to the daemon.
    #[error("no VM {0:?}")]
    UnknownVm(String),
    /// The daemon refused the change.
    #[error("{0}")]
    Refused(String),
}

impl HttpError {
    /// The status line's code and reason.
    pub fn status(&self) -> &'static str {
        match self {
            HttpError::BadRequest(_) | HttpError::Refused(_) => "400 Bad Request",
            HttpError::HeadTooLarge => "431 Request Header Fields Too Large",
            HttpError::BodyTooLarge => "413 Content Too Large",
            HttpError::BadHost(_) | HttpError::BadToken => "403 Forbidden",
            HttpError::Unauthorized => "401 Unauthorized",
            HttpError::NotFound | HttpError::UnknownVm(_) => "404 Not Found",
            HttpError::MethodNotAllowed => "405 Method Not Allowed",
            HttpError::UnsupportedType => "415 Unsupported Media Type",
        }
    }

    /// The whole answer: the status and `{"error": "why"}` (a 401 names the scheme it wants).
    pub fn answer(&self) -> Vec<u8> {
        let body = serde_json::json!({ "error": self.to_string() }).to_string();
        let extra = match self {
            HttpError::Unauthorized => "WWW-Authenticate: Bearer realm=\"vgpu-schedd\"\r\n",
            _ => "",
        };
        response_with(self.status(), "application/json", extra, body.as_bytes())
    }
}

/// A whole request: the head fields the daemon reads and the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpRequest {
    /// The method, as sent.
    pub method: String,
    /// The target's path, without its query.
    pub path: String,
    /// The `Host` header.
    pub host: Option<String>,
    /// The [`TOKEN_HEADER`] header.
    pub token: Option<String>,
    /// The `Authorization` header (the metrics listener's bearer token).
    pub authorization: Option<String>,
    /// The `Content-Type` header.
    pub content_type: Option<String>,
    /// The body (`Content-Length` bytes).
    pub body: Vec<u8>,
}

/// What a connection's received bytes hold so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// Not a whole request yet, and room for more.
    Incomplete,
    /// A whole request.
    Complete(HttpRequest),
    /// A request that is refused as it stands.
    Refused(HttpError),
}

/// Appends `received` to a connection's buffer `buf` (keeping at most the head and body
/// limits; the rest is dropped) and says what it holds now. Pure, so that it can be fuzzed on
/// its own (fuzz target `http_head`). Bytes after the body (a pipelined request) are ignored:
/// every answer closes the connection.
pub fn receive(buf: &mut Vec<u8>, received: &[u8]) -> Received {
    let room = (MAX_HTTP_HEAD_BYTES + MAX_HTTP_BODY_BYTES).saturating_sub(buf.len());
    buf.extend_from_slice(received.get(..room).unwrap_or(received));
    let mut headers = [httparse::EMPTY_HEADER; MAX_HTTP_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n <= MAX_HTTP_HEAD_BYTES => n,
        Ok(httparse::Status::Complete(_)) | Err(httparse::Error::TooManyHeaders) => {
            return Received::Refused(HttpError::HeadTooLarge);
        }
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HTTP_HEAD_BYTES => {
            return Received::Refused(HttpError::HeadTooLarge);
        }
        Ok(httparse::Status::Partial) => return Received::Incomplete,
        Err(e) => return Received::Refused(HttpError::BadRequest(e.to_string())),
    };
    match head_fields(&req) {
        Ok((mut request, length)) => {
            let Some(body) = head_len
                .checked_add(length)
                .and_then(|end| buf.get(head_len..end))
            else {
                return Received::Incomplete;
            };
            request.body = body.to_vec();
            Received::Complete(request)
        }
        Err(e) => Received::Refused(e),
    }
}

/// The fields of a parsed head and its body's length.
fn head_fields(req: &httparse::Request<'_, '_>) -> Result<(HttpRequest, usize), HttpError> {
    let bad = |why: &str| HttpError::BadRequest(why.to_owned());
    let (Some(method), Some(target)) = (req.method, req.path) else {
        return Err(bad("incomplete request line"));
    };
    let mut request = HttpRequest {
        method: method.to_owned(),
        path: target
            .split(['?', '#'])
            .next()
            .unwrap_or_default()
            .to_owned(),
        host: None,
        token: None,
        authorization: None,
        content_type: None,
        body: Vec::new(),
    };
    let mut length: Option<usize> = None;
    for h in req.headers.iter() {
        let value = std::str::from_utf8(h.value)
            .map_err(|_| bad("header value is not UTF-8"))?
            .trim();
        let slot = if h.name.eq_ignore_ascii_case("host") {
            &mut request.host
        } else if h.name.eq_ignore_ascii_case(TOKEN_HEADER) {
            &mut request.token
        } else if h.name.eq_ignore_ascii_case("authorization") {
            &mut request.authorization
        } else if h.name.eq_ignore_ascii_case("content-type") {
            &mut request.content_type
        } else if h.name.eq_ignore_ascii_case("content-length") {
            // Digits only: `parse` would take a sign, and two readings of one length are how
            // requests are smuggled.
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad("Content-Length is not a number"));
            }
            let n = value
                .parse::<usize>()
                .map_err(|_| HttpError::BodyTooLarge)?;
            if length.replace(n).is_some() {
                return Err(bad("Content-Length given twice"));
            }
            if n > MAX_HTTP_BODY_BYTES {
                return Err(HttpError::BodyTooLarge);
            }
            continue;
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(bad(
                "Transfer-Encoding is not accepted; send Content-Length",
            ));
        } else {
            continue;
        };
        if slot.replace(value.to_owned()).is_some() {
            return Err(HttpError::BadRequest(format!("{} given twice", h.name)));
        }
    }
    Ok((request, length.unwrap_or(0)))
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `GET /`: the page.
    Page,
    /// `GET /dashboard.js`.
    Script,
    /// `GET /dashboard.css`.
    Style,
    /// `GET /metrics`: Prometheus text.
    Metrics,
    /// `GET /healthz`: the daemon serves ([`health_body`]).
    Health,
    /// `GET /api/state`: the snapshot.
    State,
    /// `GET /api/policies`: the policies the page offers.
    Policies,
    /// `GET /events`: the event stream.
    Events,
    /// `POST /api/policy`.
    SetPolicy,
    /// `POST /api/params`.
    SetParams,
    /// `POST /api/focus`.
    Focus,
}

/// Every route: path, method, where it goes.
const ROUTES: [(&str, &str, Route); 11] = [
    ("/", "GET", Route::Page),
    ("/dashboard.js", "GET", Route::Script),
    ("/dashboard.css", "GET", Route::Style),
    ("/metrics", "GET", Route::Metrics),
    ("/healthz", "GET", Route::Health),
    ("/api/state", "GET", Route::State),
    ("/api/policies", "GET", Route::Policies),
    ("/events", "GET", Route::Events),
    ("/api/policy", "POST", Route::SetPolicy),
    ("/api/params", "POST", Route::SetParams),
    ("/api/focus", "POST", Route::Focus),
];

impl Route {
    /// The route of `method` and `path`: 404 for an unknown path, 405 for another method.
    pub fn of(method: &str, path: &str) -> Result<Route, HttpError> {
        let mut found = false;
        for (p, m, route) in ROUTES {
            if p == path {
                if m == method {
                    return Ok(route);
                }
                found = true;
            }
        }
        Err(if found {
            HttpError::MethodNotAllowed
        } else {
            HttpError::NotFound
        })
    }

    /// Whether it changes the scheduler (and needs the token).
    pub fn changes_state(self) -> bool {
        matches!(self, Route::SetPolicy | Route::SetParams | Route::Focus)
    }
}

/// The listener's access rules: its address (for the `Host` check) and its token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    /// The listener's address.
    pub addr: SocketAddr,
    /// The token of requests that change the scheduler.
    pub token: String,
}

impl Access {
    /// A new token from the kernel's random source.
    pub fn new(addr: SocketAddr) -> std::io::Result<Access> {
        use std::io::Read;
        let mut bytes = [0u8; TOKEN_BYTES];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
        let token = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(Access { addr, token })
    }

    /// The dashboard's address with the token in the fragment (never sent by a browser).
    pub fn url(&self) -> String {
        format!("http://{}/#token={}", self.addr, self.token)
    }

    /// Routes `req` and checks it may go there: its `Host` names the listener, and a request
    /// that changes the scheduler carries the token and a JSON body.
    pub fn check(&self, req: &HttpRequest) -> Result<Route, HttpError> {
        if !req.host.as_deref().is_some_and(|h| names(h, self.addr)) {
            return Err(HttpError::BadHost(self.addr));
        }
        let route = Route::of(&req.method, &req.path)?;
        if route.changes_state() {
            let given = req.token.as_deref().unwrap_or_default();
            if !same_secret(given.as_bytes(), self.token.as_bytes()) {
                return Err(HttpError::BadToken);
            }
            let media = req.content_type.as_deref().unwrap_or_default();
            let media = media.split(';').next().unwrap_or_default().trim();
            if !media.eq_ignore_ascii_case("application/json") {
                return Err(HttpError::UnsupportedType);
            }
        }
        Ok(route)
    }
}

/// Whether `host` (a `Host` header: name, optional port) names the listener at `addr`: a
/// loopback address or `localhost`, with the listener's port (80 when none is given). A name
/// under any other domain is refused, so a page that rebinds its own name to 127.0.0.1 cannot
/// use the listener. SSH port forwarding works when the local port is the same.
pub fn names(host: &str, addr: SocketAddr) -> bool {
    let (name, port) = match host.rsplit_once(':') {
        // `[::1]:80` and `name:80`, but not a bare IPv6 address's last group.
        Some((name, port)) if !name.contains(':') || name.ends_with(']') => (name, Some(port)),
        _ => (host, None),
    };
    let port_ok = match port {
        Some(p) => {
            !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && p.parse() == Ok(addr.port())
        }
        None => addr.port() == 80,
    };
    let bare = name
        .strip_prefix('[')
        .and_then(|n| n.strip_suffix(']'))
        .unwrap_or(name);
    let name_ok = bare.eq_ignore_ascii_case("localhost")
        || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    port_ok && name_ok
}

/// Compares two secrets in time that does not depend on where they differ.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A whole answer that closes the connection.
pub fn response(status: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    response_with(status, content_type, "", body)
}

/// A whole answer with `extra` header lines (each ending in CRLF).
fn response_with(status: &str, content_type: &str, extra: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         {COMMON_HEADERS}{extra}Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// The body of `GET /healthz`: the event loop answered, and how many VMs have a device
/// connected. A probe needs no more: a daemon that does not serve does not answer at all.
pub fn health_body(vms_connected: usize) -> String {
    serde_json::json!({ "status": "ok", "vms_connected": vms_connected }).to_string()
}

/// A TCP socket of this host as `/proc/net/tcp` and `/proc/net/tcp6` list it: what the
/// listener can learn of a loopback client, which TCP gives no `SO_PEERCRED` for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSocket {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// Bytes sent and not yet acknowledged by the other end (`tx_queue`).
    pub unacked: u64,
    /// Bytes received and not yet read by the socket's owner (`rx_queue`).
    pub unread: u64,
    /// The user who opened it.
    pub uid: u32,
}

/// What the sockets' table says of the client at the other end of a connection of ours on
/// this host: its user, and the bytes we sent that it has not read (in our send queue and its
/// receive queue).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpPeer {
    pub uid: u32,
    pub unread: u64,
}

/// The TCP sockets of this network namespace; a table that cannot be read adds none.
pub fn tcp_sockets() -> Vec<TcpSocket> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .flat_map(|table| parse_tcp_table(&table))
        .collect()
}

/// The sockets of one table's text (the heading and lines it cannot read are skipped).
pub fn parse_tcp_table(text: &str) -> Vec<TcpSocket> {
    text.lines().skip(1).filter_map(parse_tcp_line).collect()
}

/// One line: `sl local rem st tx_queue:rx_queue tr:when retrnsmt uid ...`.
fn parse_tcp_line(line: &str) -> Option<TcpSocket> {
    let fields: Vec<&str> = line.split_whitespace().take(8).collect();
    let (tx, rx) = fields.get(4)?.split_once(':')?;
    Some(TcpSocket {
        local: parse_tcp_address(fields.get(1)?)?,
        remote: parse_tcp_address(fields.get(2)?)?,
        unacked: u64::from_str_radix(tx, 16).ok()?,
        unread: u64::from_str_radix(rx, 16).ok()?,
        uid: fields.get(7)?.parse().ok()?,
    })
}

/// `ADDR:PORT` in hex: the address as 32-bit words of network-order bytes printed as the
/// host's integers (one word for IPv4, four for IPv6), the port as a number.
fn parse_tcp_address(text: &str) -> Option<SocketAddr> {
    let (addr, port) = text.split_once(':')?;
    let word = |i: usize| {
        let hex = addr.get(i * 8..i * 8 + 8)?;
        u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes)
    };
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, u16::from_str_radix(port, 16).ok()?))
}

/// The client at the other end of `stream`, when it is a socket of this host in `table`.
pub fn tcp_peer(table: &[TcpSocket], stream: &TcpStream) -> Option<TcpPeer> {
    let (ours, theirs) = (stream.local_addr().ok()?, stream.peer_addr().ok()?);
    let peer = table
        .iter()
        .find(|s| s.local == theirs && s.remote == ours)?;
    let unacked = table
        .iter()
        .find(|s| s.local == ours && s.remote == theirs)
        .map_or(0, |s| s.unacked);
    Some(TcpPeer {
        uid: peer.uid,
        unread: peer.unread.saturating_add(unacked),
    })
}

/// The head of an event stream (no length: it lasts until either side closes), with the
/// reconnection delay the browser uses when the stream breaks.
pub fn event_stream_head() -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{COMMON_HEADERS}\
         Connection: keep-alive\r\n\r\nretry: 2000\n\n"
    )
    .into_bytes()
}

/// One Server-Sent Event `name` carrying `data`, appended to `out`; every line of `data`
/// becomes a `data:` line, so no data can end the event early or start another.
pub fn push_event(out: &mut Vec<u8>, name: &str, data: &str) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.push(b'\n');
    for line in data.split(['\n', '\r']) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
    }
    out.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr() -> SocketAddr {
        "127.0.0.1:9100".parse().unwrap()
    }

    fn access() -> Access {
        Access {
            addr: addr(),
            token: "t0k".into(),
        }
    }

    fn complete(bytes: &[u8]) -> HttpRequest {
        match receive(&mut Vec::new(), bytes) {
            Received::Complete(r) => r,
            other => panic!("{other:?}"),
        }
    }

    fn refused(bytes: &[u8]) -> HttpError {
        match receive(&mut Vec::new(), bytes) {
            Received::Refused(e) => e,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn heads_and_bodies_arrive_in_pieces() {
        let whole = b"POST /api/focus?x=1 HTTP/1.1\r\nHost: 127.0.0.1:9100\r\n\
            x-vgpu-token: t0k\r\nContent-Type: application/json; charset=utf-8\r\n\
            Content-Length: 10\r\n\r\n{\"vm\":\"a\"}trailing";
        let mut buf = Vec::new();
        let mut result = Received::Incomplete;
        for (i, byte) in whole.iter().enumerate() {
            result = receive(&mut buf, std::slice::from_ref(byte));
            if let Received::Complete(_) = result {
                assert_eq!(i, whole.len() - "trailing".len() - 1);
                break;
            }
            assert_eq!(result, Received::Incomplete, "at byte {i}");
        }
        let Received::Complete(req) = result else {
            panic!("{result:?}")
        };
        assert_eq!(
            (req.method.as_str(), req.path.as_str()),
            ("POST", "/api/focus")
        );
        assert_eq!(req.host.as_deref(), Some("127.0.0.1:9100"));
        assert_eq!(req.token.as_deref(), Some("t0k"));
        assert_eq!(req.body, b"{\"vm\":\"a\"}");
        assert_eq!(access().check(&req), Ok(Route::Focus));
        // A GET without a body, bare newlines accepted.
        let req = complete(b"GET /metrics HTTP/1.0\nHost: localhost:9100\n\n");
        assert!(req.body.is_empty() && req.token.is_none());
        assert_eq!(access().check(&req), Ok(Route::Metrics));
    }

    #[test]
    fn malformed_and_oversized_requests_are_refused() {
        for bad in [
            &b"hello\r\n\r\n"[..],
            b"GET /\n\n",
            b"GET / HTTP/2.0\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            b"GET / HTTP/1.1\r\nContent-Length: +4\r\n\r\n",
            b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
            b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"GET / HTTP/1.1\r\nX-Vgpu-Token: \xff\r\n\r\n",
            b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
        ] {
            let e = refused(bad);
            assert!(e.status().starts_with("400"), "{bad:?}: {e:?}");
        }
        let big = format!(
            "POST /api/policy HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_HTTP_BODY_BYTES + 1
        );
        assert_eq!(refused(big.as_bytes()), HttpError::BodyTooLarge);
        let huge = b"GET / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n";
        assert_eq!(refused(huge), HttpError::BodyTooLarge);
        // A head that never ends, and one with too many lines.
        let mut buf = vec![b'G'; MAX_HTTP_HEAD_BYTES - 1];
        assert_eq!(
            receive(&mut buf, b"ET"),
            Received::Refused(HttpError::HeadTooLarge)
        );
        let mut long = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HTTP_HEADERS {
            long.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
        }
        long.extend_from_slice(b"\r\n");
        assert_eq!(refused(&long), HttpError::HeadTooLarge);
        // The buffer never grows past the limits, whatever arrives.
        let mut buf = Vec::new();
        let flood = vec![b'a'; 4 * (MAX_HTTP_HEAD_BYTES + MAX_HTTP_BODY_BYTES)];
        let _ = receive(&mut buf, &flood);
        assert_eq!(buf.len(), MAX_HTTP_HEAD_BYTES + MAX_HTTP_BODY_BYTES);
    }

    #[test]
    fn routes_methods_and_status_codes() {
        assert_eq!(Route::of("GET", "/"), Ok(Route::Page));
        assert_eq!(Route::of("GET", "/events"), Ok(Route::Events));
        assert_eq!(Route::of("GET", "/healthz"), Ok(Route::Health));
        assert!(!Route::Health.changes_state());
        assert_eq!(health_body(2), "{\"status\":\"ok\",\"vms_connected\":2}");
        assert_eq!(Route::of("POST", "/api/params"), Ok(Route::SetParams));
        assert_eq!(
            Route::of("POST", "/metrics"),
            Err(HttpError::MethodNotAllowed)
        );
        assert_eq!(
            Route::of("GET", "/api/focus"),
            Err(HttpError::MethodNotAllowed)
        );
        assert_eq!(Route::of("DELETE", "/"), Err(HttpError::MethodNotAllowed));
        assert_eq!(Route::of("GET", "/nope"), Err(HttpError::NotFound));
        assert_eq!(Route::of("GET", "/metrics/"), Err(HttpError::NotFound));
        assert!(
            ROUTES
                .iter()
                .filter(|r| r.2.changes_state())
                .all(|r| r.1 == "POST")
        );
        let answer = String::from_utf8(HttpError::BodyTooLarge.answer()).unwrap();
        assert!(answer.starts_with("HTTP/1.1 413 "), "{answer}");
        assert!(answer.ends_with("{\"error\":\"request body larger than 16384 bytes\"}"));
        assert!(answer.contains("Connection: close\r\n"));
        assert!(answer.contains("Content-Security-Policy: default-src 'none';"));
        let r = String::from_utf8(response("200 OK", "text/plain", b"x\n")).unwrap();
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n") && r.contains("Content-Length: 2\r\n"));
        assert!(r.ends_with("\r\n\r\nx\n"));
    }

    #[test]
    fn host_header_must_name_the_listener() {
        let a = addr();
        for ok in [
            "127.0.0.1:9100",
            "localhost:9100",
            "LocalHost:9100",
            "127.1.2.3:9100",
            "[::1]:9100",
        ] {
            assert!(names(ok, a), "{ok}");
        }
        for bad in [
            "127.0.0.1",
            "127.0.0.1:9101",
            "127.0.0.1:",
            "127.0.0.1:+9100",
            "evil.example:9100",
            "localhost.evil.example:9100",
            "10.0.0.1:9100",
            "[::1]",
            "::1",
            "",
        ] {
            assert!(!names(bad, a), "{bad}");
        }
        assert!(names("localhost", "127.0.0.1:80".parse().unwrap()));
        assert!(names("[::1]:80", "[::1]:80".parse().unwrap()));
        let get = |host: Option<&str>| HttpRequest {
            method: "GET".into(),
            path: "/api/state".into(),
            host: host.map(Into::into),
            token: None,
            authorization: None,
            content_type: None,
            body: Vec::new(),
        };
        assert_eq!(access().check(&get(None)), Err(HttpError::BadHost(a)));
        assert_eq!(access().check(&get(Some("x"))), Err(HttpError::BadHost(a)));
        assert_eq!(
            access().check(&get(Some("127.0.0.1:9100"))),
            Ok(Route::State)
        );
    }

    #[test]
    fn changes_need_the_token_and_json() {
        let post = |token: Option<&str>, ty: Option<&str>| HttpRequest {
            method: "POST".into(),
            path: "/api/policy".into(),
            host: Some("127.0.0.1:9100".into()),
            token: token.map(Into::into),
            authorization: None,
            content_type: ty.map(Into::into),
            body: b"{}".to_vec(),
        };
        let json = Some("application/json");
        assert_eq!(access().check(&post(None, json)), Err(HttpError::BadToken));
        assert_eq!(
            access().check(&post(Some("t0"), json)),
            Err(HttpError::BadToken)
        );
        assert_eq!(
            access().check(&post(Some("t0k0"), json)),
            Err(HttpError::BadToken)
        );
        assert_eq!(
            access().check(&post(Some("T0K"), json)),
            Err(HttpError::BadToken)
        );
        assert_eq!(
            access().check(&post(Some("t0k"), Some("text/plain"))),
            Err(HttpError::UnsupportedType)
        );
        assert_eq!(
            access().check(&post(Some("t0k"), None)),
            Err(HttpError::UnsupportedType)
        );
        assert_eq!(
            access().check(&post(Some("t0k"), json)),
            Ok(Route::SetPolicy)
        );
        assert_eq!(HttpError::BadToken.status(), "403 Forbidden");
    }

    #[test]
    fn tokens_are_random_hex_and_only_in_the_fragment() {
        let a = Access::new(addr()).unwrap();
        let b = Access::new(addr()).unwrap();
        assert_eq!(a.token.len(), 2 * TOKEN_BYTES);
        assert!(a.token.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a.token, b.token);
        assert_eq!(a.url(), format!("http://127.0.0.1:9100/#token={}", a.token));
        let v6 = Access::new("[::1]:8000".parse().unwrap()).unwrap();
        assert!(v6.url().starts_with("http://[::1]:8000/#token="));
        assert!(same_secret(b"abc", b"abc") && !same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"", b"a"));
    }

    #[test]
    fn tcp_tables_are_parsed() {
        let heading =
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n";
        let v4 = format!(
            "{heading}   0: 0100007F:1F90 0100007F:D431 01 00000010:0000A000 00:00000000 \
             00000000  65534        0 1234 1 0 20 4 30 10 -1\n   1: garbage\n"
        );
        assert_eq!(
            parse_tcp_table(&v4),
            [TcpSocket {
                local: "127.0.0.1:8080".parse().unwrap(),
                remote: "127.0.0.1:54321".parse().unwrap(),
                unacked: 0x10,
                unread: 0xa000,
                uid: 65534,
            }]
        );
        let v6 = format!(
            "{heading}   0: 00000000000000000000000001000000:1F90 \
             0000000000000000FFFF00000100007F:D431 01 00000000:00000002 00:00000000 00000000 \
             0        0 1 1 0 20 4 30 10 -1\n"
        );
        let parsed = parse_tcp_table(&v6);
        assert_eq!(parsed[0].local, "[::1]:8080".parse().unwrap());
        assert_eq!(
            parsed[0].remote,
            "[::ffff:127.0.0.1]:54321".parse().unwrap()
        );
        assert_eq!((parsed[0].unread, parsed[0].uid), (2, 0));
    }

    #[test]
    fn a_loopback_peer_is_found_with_its_user_and_what_it_left_unread() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut ours, _) = listener.accept().unwrap();
        let sent = vec![b'x'; 100_000];
        std::io::Write::write_all(&mut ours, &sent).unwrap();
        // Loopback delivers at once; the bound only guards against a stuck test.
        let start = std::time::Instant::now();
        let peer = loop {
            let peer = tcp_peer(&tcp_sockets(), &ours).expect("the client's socket is listed");
            if peer.unread == sent.len() as u64 || start.elapsed().as_secs() > 10 {
                break peer;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert_eq!(peer.unread, sent.len() as u64);
        let me = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m));
        assert_eq!(Ok(peer.uid), me.map_err(|e| e.to_string()));
        drop(client);
    }

    #[test]
    fn events_are_framed_line_by_line() {
        let mut out = Vec::new();
        push_event(&mut out, "snapshot", "{\"a\":1}");
        push_event(&mut out, "x", "one\ntwo\r\n\nevent: forged");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "event: snapshot\ndata: {\"a\":1}\n\n\
             event: x\ndata: one\ndata: two\ndata: \ndata: \ndata: event: forged\n\n"
        );
        let head = String::from_utf8(event_stream_head()).unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"));
        assert!(!head.contains("Content-Length") && head.ends_with("\r\n\r\nretry: 2000\n\n"));
    }
}
