//! The monitoring kit end to end: the metrics listener for a central Prometheus
//! (`--metrics-listen`) in a daemon server in this process, scraped in plain HTTP and over TLS
//! with a self-signed certificate made here, the bearer token refused and accepted, every other
//! route refused, silent clients that do not hold up a scrape, the token and key files the
//! daemon refuses to start with; and `packaging/monitoring/`: the alert rules through
//! `promtool check rules` and their unit tests through `promtool test rules`, every metric the
//! Grafana dashboard's and the rules' queries name checked against a real scrape of the daemon
//! with two VMs at work.

use std::collections::BTreeSet;
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
use vgpu_schedd::proto::{self, Exec, MAX_MESSAGE_BYTES, Msg, PROTOCOL_VERSION, VmName};
use vgpu_schedd::seqpacket::SeqStream;
use vgpu_schedd::seqpacket::monotonic_ns;
use vgpu_schedd::server::{Server, ServerConfig, ServerError};
use vgpu_scheduler::{CostSignature, GroupId, GroupKind};

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
    /// A daemon with its listener, definitions read from `dir/etc` (none while it does not
    /// exist).
    fn start(dir: &Path, listen: MetricsListenConfig) -> Result<Daemon, ServerError> {
        let mut server = Server::bind(config(dir, listen))?;
        server.use_config_dir(&dir.join("etc"))?;
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
    send(
        &s,
        &Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new(name).unwrap(),
            device_pid: std::process::id(),
            qemu_pid: 0,
        },
    );
    assert!(matches!(recv(&s), Msg::Welcome { .. }));
    s
}

/// The daemon's next message to a device.
fn recv(s: &SeqStream) -> Msg {
    let mut buf = vec![0u8; MAX_MESSAGE_BYTES + 1];
    let n = s.recv(&mut buf).unwrap().expect("a message");
    proto::decode(&buf[..n]).unwrap()
}

fn send(s: &SeqStream, msg: &Msg) {
    let mut b = Vec::new();
    proto::encode(msg, &mut b);
    s.send(&b).unwrap();
}

/// One command group of a device: submitted, granted, completed 1 ms after it started, and
/// a frame presented.
fn run_group(s: &SeqStream, id: u64) {
    send(
        s,
        &Msg::Submit {
            group: GroupId(id),
            context: 0,
            kind: GroupKind::Render,
            signature: CostSignature(1),
            cost_ns: 0,
            exec: Exec::Device,
        },
    );
    assert_eq!(recv(s), Msg::Grant { group: GroupId(id) });
    let finish = monotonic_ns();
    send(
        s,
        &Msg::Completed {
            group: GroupId(id),
            start: finish.saturating_sub(1_000_000),
            finish,
        },
    );
    send(s, &Msg::Frame);
    // The frame's present is released (no policy paces it).
    assert!(matches!(recv(s), Msg::Present { .. }));
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

/// A file of `packaging/monitoring/`.
fn kit(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../packaging/monitoring")
        .join(name)
}

/// Runs promtool with `args` in `packaging/monitoring/`; asserts it succeeds.
fn promtool(args: &[&str]) -> String {
    let o = Command::new("promtool")
        .args(args)
        .current_dir(kit(""))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running promtool ({e}): install Debian's `prometheus` package \
                 (apt-get install --no-install-recommends prometheus)"
            )
        });
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "promtool {args:?}:\n{out}");
    out
}

#[test]
fn the_alert_rules_pass_promtool_and_fire_on_their_unit_tests() {
    let checked = promtool(&["check", "rules", "vgpu-alerts.yml"]);
    assert!(checked.contains("SUCCESS: 5 rules found"), "{checked}");
    promtool(&["test", "rules", "vgpu-alerts.test.yml"]);
    // And the test file can fail: a rule that never fires does not pass it.
    let dir = TempDir::new().unwrap();
    let rules = std::fs::read_to_string(kit("vgpu-alerts.yml")).unwrap();
    let broken = rules.replace("> 0.9", "> 2");
    assert_ne!(broken, rules);
    std::fs::write(dir.path().join("vgpu-alerts.yml"), broken).unwrap();
    std::fs::copy(kit("vgpu-alerts.test.yml"), dir.path().join("t.yml")).unwrap();
    let o = Command::new("promtool")
        .args(["test", "rules", "t.yml"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{out}");
    assert!(out.contains("alertname: VgpuMemoryNearLimit"), "{out}");
}

/// PromQL's functions, aggregations and keywords that can stand where a metric name could.
const PROMQL_WORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
];
/// Keywords followed by a list of label names.
const PROMQL_LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric names a PromQL expression (or a Grafana `label_values(METRIC, LABEL)` query)
/// reads: identifiers that are no function (followed by `(`), keyword or label list, outside
/// label matchers, ranges and strings.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    // Skips from an opening bracket at `i` to after its match.
    let skip = |mut i: usize, open: char, close: char| {
        let mut depth = 0;
        while let Some(&c) = chars.get(i) {
            i += 1;
            if c == open {
                depth += 1;
            } else if c == close {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
        }
        i
    };
    // A `label_values(` call: its second argument is a label.
    let mut label_arg_from: Option<usize> = None;
    while let Some(&c) = chars.get(i) {
        if c == '{' {
            i = skip(i, '{', '}');
        } else if c == '[' {
            i = skip(i, '[', ']');
        } else if c == '"' || c == '\'' || c == '`' {
            i += 1;
            while chars.get(i).is_some_and(|&d| d != c) {
                i += 1;
            }
            i += 1;
        } else if c == ',' && label_arg_from.is_some() {
            // Up to the call's closing parenthesis.
            let start = label_arg_from.take().unwrap_or(i);
            i = skip(start, '(', ')');
        } else if c.is_ascii_digit() || c == '.' {
            while chars
                .get(i)
                .is_some_and(|d| d.is_ascii_alphanumeric() || *d == '.')
            {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' || c == '$' {
            let start = i;
            while chars
                .get(i)
                .is_some_and(|d| d.is_ascii_alphanumeric() || *d == '_' || *d == ':' || *d == '$')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while chars.get(next).is_some_and(|d| d.is_whitespace()) {
                next += 1;
            }
            let call = chars.get(next) == Some(&'(');
            if PROMQL_LABEL_LISTS.contains(&word.as_str()) {
                if call {
                    i = skip(next, '(', ')');
                }
            } else if word == "label_values" && call {
                label_arg_from = Some(next);
                i = next + 1;
            } else if !call && !word.starts_with('$') && !PROMQL_WORDS.contains(&word.as_str()) {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

#[test]
fn promql_metric_names_are_found() {
    let names = |e: &str| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            "histogram_quantile(0.99, sum by (vm, le) \
             (rate(vgpu_group_latency_seconds_bucket{vm=~\"$vm\",le!=\"x y\"}[$__rate_interval])))"
        ),
        ["vgpu_group_latency_seconds_bucket"]
    );
    assert_eq!(
        names("a / (b > 0) > 0.9 and on (instance, vm) c offset 5m unless bool 1e3"),
        ["a", "b", "c"]
    );
    assert_eq!(
        names("label_values(vgpu_connected{job=\"$job\"}, vm)"),
        ["vgpu_connected"]
    );
    assert_eq!(
        names("rate(x[5m]) / scalar(sum without (le) (rate(y[5m])))"),
        ["x", "y"]
    );
}

/// The queries of the Grafana dashboard: every `expr` of its panels' targets (rows' panels
/// included) and the query of every template variable of type `query`.
fn dashboard_queries(dashboard: &serde_json::Value) -> Vec<String> {
    fn panels(list: &serde_json::Value, out: &mut Vec<String>) {
        for p in list.as_array().into_iter().flatten() {
            for t in p["targets"].as_array().into_iter().flatten() {
                out.extend(t["expr"].as_str().map(str::to_owned));
            }
            panels(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    panels(&dashboard["panels"], &mut out);
    let variables = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten();
    for v in variables.filter(|v| v["type"] == "query") {
        let query = v["query"]["query"].as_str().or(v["query"].as_str());
        out.push(query.expect("a query variable's query").to_owned());
    }
    out
}

/// The `expr` values of a rules file: `expr: QUERY` on one line, or `expr: |` and the
/// lines indented deeper.
fn rule_queries(rules: &str) -> Vec<String> {
    let lines: Vec<&str> = rules.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim_start().strip_prefix("expr:") else {
            continue;
        };
        let indent = line.len() - line.trim_start().len();
        if rest.trim() == "|" {
            let body: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .copied()
                .collect();
            out.push(body.join("\n"));
        } else {
            out.push(rest.trim().to_owned());
        }
    }
    out
}

/// The series names a scrape exposes: every family of its `# TYPE` lines, a histogram's as
/// `_bucket`, `_sum` and `_count`.
fn exposed_names(exposition: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').unwrap();
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        } else {
            names.insert(name.to_owned());
        }
    }
    names
}

#[test]
fn the_dashboard_and_the_alerts_ask_only_for_metrics_the_daemon_exposes() {
    let dir = TempDir::new().unwrap();
    // VM a is defined from a type: its socket and type label its vgpu_vm_info.
    std::fs::create_dir_all(dir.path().join("etc/vgpus")).unwrap();
    let definition = r#"{"socket": "/run/vgpu/a.sock", "type": "quarter"}"#;
    std::fs::write(dir.path().join("etc/vgpus/a.json"), definition).unwrap();
    let d = Daemon::start(dir.path(), plain(dir.path())).unwrap();
    let a = device(&d, "a");
    let b = device(&d, "b");
    send(
        &a,
        &Msg::Memory {
            used: 3 << 20,
            limit: 1 << 30,
        },
    );
    for id in 1..=3 {
        run_group(&a, id);
        run_group(&b, id);
    }
    let scrape = |d: &Daemon| {
        let answer = get(d.addr, "/metrics", &bearer(TOKEN));
        answer.split_once("\r\n\r\n").unwrap().1.to_owned()
    };
    // The daemon has seen the memory report and the last group once its stats show them.
    let start = std::time::Instant::now();
    let text = loop {
        let text = scrape(&d);
        let done = "vgpu_group_latency_seconds_count{vm=\"b\"} 3\n";
        if (text.contains(done) && text.contains("vgpu_memory_used_bytes{vm=\"a\"}"))
            || start.elapsed() > WAIT
        {
            break text;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let info = "\nvgpu_vm_info{vm=\"a\",vgpu=\"0\",qemu_pid=\"\",cgroup=\"\",\
                socket=\"/run/vgpu/a.sock\",type=\"quarter\"} 1\n";
    assert!(text.contains(info), "{text}");
    assert!(
        text.contains("socket=\"\",type=\"\"} 1\n"),
        "b is not defined: {text}"
    );
    let mut exposed = exposed_names(&text);
    // The series Prometheus makes of every scrape.
    exposed.insert("up".to_owned());
    for needed in [
        "vgpu_memory_used_bytes",
        "vgpu_group_latency_seconds_bucket",
        "process_cpu_seconds_total",
        "vgpu_vm_info",
    ] {
        assert!(exposed.contains(needed), "{needed} not in:\n{text}");
    }

    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(kit("vgpu-dashboard.json")).unwrap())
            .unwrap();
    let queries = dashboard_queries(&dashboard);
    let panels = dashboard["panels"].as_array().unwrap();
    assert!(panels.len() >= 8, "{} panels", panels.len());
    for p in panels {
        let exprs = p["targets"].as_array().map_or(0, |t| {
            t.iter().filter(|t| t["expr"].as_str().is_some()).count()
        });
        assert!(exprs > 0, "panel {} has no query", p["title"]);
    }
    let rules = std::fs::read_to_string(kit("vgpu-alerts.yml")).unwrap();
    let rule_exprs = rule_queries(&rules);
    assert_eq!(rule_exprs.len(), 5, "{rule_exprs:?}");
    let mut used = BTreeSet::new();
    for q in queries.iter().chain(&rule_exprs) {
        let names = metric_names(q);
        assert!(!names.is_empty(), "no metric in {q:?}");
        for name in names {
            assert!(
                exposed.contains(&name),
                "{q:?} reads {name}, which the daemon does not expose"
            );
            used.insert(name);
        }
    }
    // What the dashboard is for: shares, latency quantiles, memory, frames, the engine, the
    // daemon's being up.
    for wanted in [
        "vgpu_gpu_seconds_total",
        "vgpu_group_latency_seconds_bucket",
        "vgpu_memory_used_bytes",
        "vgpu_memory_limit_bytes",
        "vgpu_frames_total",
        "vgpu_engine_busy_ratio",
        "up",
    ] {
        assert!(used.contains(wanted), "nothing reads {wanted}");
    }
    assert!(
        queries
            .iter()
            .any(|q| q.starts_with("histogram_quantile(0.99,")),
        "{queries:?}"
    );
}
