//! The metrics listener for a central Prometheus (`--metrics-listen`) end to end: a daemon
//! server in this process, its listener scraped in plain HTTP and over TLS with a self-signed
//! certificate made here, the bearer token refused and accepted, every other route refused,
//! silent clients that do not hold up a scrape, and the token and key files the daemon refuses
//! to start with.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tempfile::TempDir;
use vgpu_schedd::cgroup::CgroupFs;
use vgpu_schedd::daemon::DaemonConfig;
use vgpu_schedd::metrics_listener::{
    ListenError, MAX_CONNECTS_PER_SECOND, MetricsListenConfig, TlsFiles,
};
use vgpu_schedd::proto::{self, MAX_MESSAGE_BYTES, Msg, PROTOCOL_VERSION, VmName};
use vgpu_schedd::seqpacket::SeqStream;
use vgpu_schedd::server::{Server, ServerConfig, ServerError};

const SCHEDD: &str = env!("CARGO_BIN_EXE_vgpu-schedd");
const WAIT: Duration = Duration::from_secs(10);
const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// A daemon server on a thread of this process; stopped and joined on drop.
struct Daemon {
    dir: PathBuf,
    addr: SocketAddr,
    stop: UnixStream,
    thread: Option<JoinHandle<()>>,
}

fn config(dir: &Path, listen: MetricsListenConfig) -> ServerConfig {
    ServerConfig {
        socket: dir.join("sched.sock"),
        control: dir.join("control.sock"),
        control_group: None,
        state_dir: dir.join("state"),
        metrics: None,
        metrics_listen: Some(listen),
        daemon: DaemonConfig::default(),
        server_bin: PathBuf::from("/nonexistent/vgpu-server"),
        device_ids: None,
        cgroups: CgroupFs::default(),
        busy_poll: Duration::ZERO,
    }
}

impl Daemon {
    fn start(dir: &Path, listen: MetricsListenConfig) -> Result<Daemon, ServerError> {
        let mut server = Server::bind(config(dir, listen))?;
        let addr = server.metrics_listen_addr().unwrap();
        let stop = server.stop_handle().unwrap();
        let thread = std::thread::spawn(move || server.run().unwrap());
        Ok(Daemon {
            dir: dir.to_owned(),
            addr,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.stop.write_all(&[1]);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Writes `text` to `dir/name` with mode `mode`.
fn file(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

/// Plain HTTP, loopback, with the token in a private file.
fn plain(dir: &Path) -> MetricsListenConfig {
    MetricsListenConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        token_file: file(dir, "token", &format!("{TOKEN}\n"), 0o600),
        tls: None,
        insecure: false,
    }
}

/// A device connected for VM `name` (kept connected while it lives).
fn device(d: &Daemon, name: &str) -> SeqStream {
    let s = SeqStream::connect(&d.dir.join("sched.sock")).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut b = Vec::new();
    proto::encode(
        &Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new(name).unwrap(),
            device_pid: std::process::id(),
            qemu_pid: 0,
        },
        &mut b,
    );
    s.send(&b).unwrap();
    let mut buf = vec![0u8; MAX_MESSAGE_BYTES + 1];
    let n = s.recv(&mut buf).unwrap().expect("Welcome");
    assert!(matches!(proto::decode(&buf[..n]), Ok(Msg::Welcome { .. })));
    s
}

/// Connects to the listener, at most [`MAX_CONNECTS_PER_SECOND`] times a second (past that
/// the daemon closes new connections unread): every so many connections it waits a second.
fn connect(addr: SocketAddr) -> TcpStream {
    static MADE: AtomicU32 = AtomicU32::new(0);
    if MADE.fetch_add(1, Ordering::Relaxed) % MAX_CONNECTS_PER_SECOND == MAX_CONNECTS_PER_SECOND - 1
    {
        std::thread::sleep(Duration::from_millis(1100));
    }
    TcpStream::connect(addr).unwrap()
}

/// A GET of `path` with these extra header lines, in plain HTTP; the whole answer.
fn get(addr: SocketAddr, path: &str, headers: &str) -> String {
    let mut s = connect(addr);
    s.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: prometheus.example\r\n{headers}\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer
}

fn bearer(token: &str) -> String {
    format!("Authorization: Bearer {token}\r\n")
}

#[test]
fn the_bearer_token_is_required_and_only_metrics_and_health_are_served() {
    let dir = TempDir::new().unwrap();
    let d = Daemon::start(dir.path(), plain(dir.path())).unwrap();
    let _vm = device(&d, "m1");
    let ok = bearer(TOKEN);
    // The token opens /metrics (whatever Host names: this listener faces the network) and
    // /healthz.
    let metrics = get(d.addr, "/metrics", &ok);
    assert!(metrics.starts_with("HTTP/1.1 200 OK\r\n"), "{metrics}");
    assert!(
        metrics.contains("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("\nvgpu_connected{vm=\"m1\"} 1\n"),
        "{metrics}"
    );
    assert!(metrics.contains("\nprocess_open_fds "), "{metrics}");
    let health = get(d.addr, "/healthz", &ok);
    assert!(health.starts_with("HTTP/1.1 200 OK\r\n"), "{health}");
    assert!(health.ends_with("{\"status\":\"ok\",\"vms_connected\":1}"));
    // The scheme is case-insensitive (RFC 9110).
    let lower = format!("authorization: bearer {TOKEN}\r\n");
    assert!(get(d.addr, "/metrics", &lower).starts_with("HTTP/1.1 200 OK\r\n"));
    // Without it, or with another: 401 naming the scheme, on every path (nothing is told
    // about the routes).
    let mut wrong = TOKEN.to_owned();
    wrong.replace_range(31.., "0");
    for headers in [
        String::new(),
        bearer(&wrong),
        bearer(&TOKEN[..31]),
        bearer(&format!("{TOKEN}0")),
        format!("Authorization: Basic {TOKEN}\r\n"),
        format!("Authorization: {TOKEN}\r\n"),
        format!("X-Vgpu-Token: {TOKEN}\r\n"),
    ] {
        for path in ["/metrics", "/healthz", "/", "/api/state"] {
            let answer = get(d.addr, path, &headers);
            assert!(
                answer.starts_with("HTTP/1.1 401 Unauthorized\r\n"),
                "{path} {headers:?}: {answer}"
            );
            assert!(
                answer.contains("\r\nWWW-Authenticate: Bearer realm=\"vgpu-schedd\"\r\n"),
                "{answer}"
            );
            assert!(!answer.contains("vgpu_"), "{answer}");
        }
    }
    // With it, nothing but the two: not the dashboard, its API, its event stream, or a change.
    for path in [
        "/",
        "/dashboard.js",
        "/api/state",
        "/api/policies",
        "/events",
        "/metrics/",
    ] {
        let answer = get(d.addr, path, &ok);
        assert!(answer.starts_with("HTTP/1.1 404 "), "{path}: {answer}");
    }
    let mut s = connect(d.addr);
    s.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        s,
        "POST /api/focus HTTP/1.1\r\n{ok}Content-Type: application/json\r\n\
         Content-Length: 10\r\n\r\n{{\"vm\":\"m1\"}}"
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 404 "), "{answer}");
    // Malformed requests are refused by the same parser as the loopback listener's.
    let mut s = connect(d.addr);
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(&vec![b'G'; 20_000]).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
}

/// A TLS client that trusts `cert` (DER).
fn tls_client(cert: &rustls::pki_types::CertificateDer<'static>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Arc::new(config)
}

/// A GET of `path` over TLS to `localhost` at `addr`; the whole answer.
fn tls_get(
    config: &Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    path: &str,
    headers: &str,
) -> String {
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(Arc::clone(config), name).unwrap();
    let sock = connect(addr);
    sock.set_read_timeout(Some(WAIT)).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, sock);
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\n{headers}\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    // The daemon ends with close_notify: a clean end of stream, not a truncation error.
    tls.read_to_string(&mut answer).unwrap();
    answer
}

#[test]
fn tls_scrapes_with_a_self_signed_certificate_and_silent_clients_hold_up_nothing() {
    let dir = TempDir::new().unwrap();
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let cert = file(dir.path(), "cert.pem", &made.cert.pem(), 0o644);
    let key = file(
        dir.path(),
        "key.pem",
        &made.signing_key.serialize_pem(),
        0o600,
    );
    let listen = MetricsListenConfig {
        tls: Some(TlsFiles { cert, key }),
        ..plain(dir.path())
    };
    let d = Daemon::start(dir.path(), listen).unwrap();
    let _vm = device(&d, "secure");
    let client = tls_client(made.cert.der());
    // Silent clients first: one that never starts its handshake, one that stops in the middle
    // of it, one in plain HTTP.
    let _silent = connect(d.addr);
    let mut half = connect(d.addr);
    half.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .unwrap();
    let mut clear = connect(d.addr);
    clear.set_read_timeout(Some(WAIT)).unwrap();
    // The daemon may close it on the first bytes, which are no TLS record.
    let request = format!("GET /metrics HTTP/1.1\r\n{}\r\n", bearer(TOKEN));
    let _ = clear.write_all(request.as_bytes());

    let metrics = tls_get(&client, d.addr, "/metrics", &bearer(TOKEN));
    assert!(metrics.starts_with("HTTP/1.1 200 OK\r\n"), "{metrics}");
    assert!(
        metrics.contains("\nvgpu_connected{vm=\"secure\"} 1\n"),
        "{metrics}"
    );
    assert!(metrics.contains("\n# TYPE vgpu_group_latency_seconds histogram\n"));
    let health = tls_get(&client, d.addr, "/healthz", &bearer(TOKEN));
    assert!(
        health.ends_with("{\"status\":\"ok\",\"vms_connected\":1}"),
        "{health}"
    );
    let refused = tls_get(&client, d.addr, "/metrics", "");
    assert!(refused.starts_with("HTTP/1.1 401 "), "{refused}");

    // Plain HTTP on the TLS port gets no metrics: the handshake fails and the daemon closes.
    let mut answer = Vec::new();
    let _ = clear.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    assert!(!text.contains("vgpu_"), "{text}");
    // A client that does not trust the certificate does not finish its handshake.
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let untrusting = tls_client(other.cert.der());
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(untrusting, name).unwrap();
    let sock = connect(d.addr);
    sock.set_read_timeout(Some(WAIT)).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, sock);
    let e = write!(tls, "GET /metrics HTTP/1.1\r\n\r\n").unwrap_err();
    assert!(e.to_string().contains("invalid peer certificate"), "{e}");
}

#[test]
fn the_daemon_refuses_token_and_key_files_others_can_read() {
    let dir = TempDir::new().unwrap();
    let p = dir.path();
    let refusal = |listen: MetricsListenConfig| match Daemon::start(p, listen) {
        Err(ServerError::MetricsListen(e)) => e,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("started"),
    };
    for mode in [0o644, 0o640, 0o604, 0o620, 0o602] {
        let listen = MetricsListenConfig {
            token_file: file(p, "open-token", TOKEN, mode),
            ..plain(p)
        };
        let e = refusal(listen);
        assert!(matches!(e, ListenError::Exposed { .. }), "{mode:o}: {e}");
        assert!(e.to_string().contains("chmod 600"), "{e}");
    }
    let short = MetricsListenConfig {
        token_file: file(p, "short", "0123456789abcde\n", 0o600),
        ..plain(p)
    };
    assert!(refusal(short).to_string().contains("fewer than 16"));
    let spaced = MetricsListenConfig {
        token_file: file(p, "spaced", "0123456789 abcdef0123\n", 0o400),
        ..plain(p)
    };
    assert!(refusal(spaced).to_string().contains("one word"));
    let missing = MetricsListenConfig {
        token_file: p.join("nonexistent"),
        ..plain(p)
    };
    assert!(matches!(refusal(missing), ListenError::Read { .. }));
    // Plain HTTP off loopback only when asked for.
    let open = MetricsListenConfig {
        addr: "0.0.0.0:0".parse().unwrap(),
        ..plain(p)
    };
    let e = refusal(open.clone());
    assert!(matches!(e, ListenError::Plain(_)), "{e}");
    assert!(e.to_string().contains("--metrics-insecure"), "{e}");
    let insecure = MetricsListenConfig {
        insecure: true,
        ..open
    };
    drop(Daemon::start(p, insecure).unwrap());
    // A key others can read, and a certificate file that holds none.
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let cert = file(p, "cert.pem", &made.cert.pem(), 0o644);
    let key = file(p, "key.pem", &made.signing_key.serialize_pem(), 0o644);
    let listen = MetricsListenConfig {
        tls: Some(TlsFiles {
            cert: cert.clone(),
            key,
        }),
        ..plain(p)
    };
    assert!(matches!(refusal(listen), ListenError::Exposed { .. }));
    let key = file(p, "key-ok.pem", &made.signing_key.serialize_pem(), 0o640);
    let listen = MetricsListenConfig {
        tls: Some(TlsFiles {
            cert: key.clone(),
            key,
        }),
        ..plain(p)
    };
    assert!(refusal(listen).to_string().contains("no CERTIFICATE"));

    // The binary says why and exits 1.
    let token = file(p, "world", TOKEN, 0o644);
    let o = Command::new(SCHEDD)
        .arg("--socket")
        .arg(p.join("bin-sched.sock"))
        .arg("--control")
        .arg(p.join("bin-control.sock"))
        .arg("--config-dir")
        .arg(p.join("etc"))
        .args(["--metrics-listen", "127.0.0.1:0", "--metrics-token-file"])
        .arg(&token)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("mode 0644 lets group or others read or change it: chmod 600 it"),
        "{stderr}"
    );
    assert!(!p.join("bin-sched.sock").exists(), "sockets left behind");
}
