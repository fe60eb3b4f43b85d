//! The live dashboard end to end: a daemon server in this process with its HTTP listener, two
//! fake devices at work, an event stream read with a plain TCP socket, the page and its
//! assets, and the requests that change the scheduler, with and without the token, checked
//! through the control socket; every refusal of the listener.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tempfile::TempDir;
use vgpu_schedd::cgroup::CgroupFs;
use vgpu_schedd::daemon::DaemonConfig;
use vgpu_schedd::dashboard::{
    EVENT_STREAM_READ_GRACE, MAX_DASHBOARD_VMS, MAX_EVENT_STREAM_UNREAD_BYTES, MAX_EVENT_STREAMS,
};
use vgpu_schedd::http::MAX_HTTP_BODY_BYTES;
use vgpu_schedd::proto::{self, Exec, MAX_MESSAGE_BYTES, Msg, PROTOCOL_VERSION, VmName};
use vgpu_schedd::seqpacket::{SeqStream, monotonic_ns};
use vgpu_schedd::server::{Server, ServerConfig};
use vgpu_scheduler::{CostSignature, GroupId, GroupKind};

const WAIT: Duration = Duration::from_secs(10);

/// A daemon server on a thread of this process; stopped and joined on drop.
struct Daemon {
    dir: TempDir,
    http: Option<SocketAddr>,
    stop: UnixStream,
    thread: Option<JoinHandle<()>>,
}

impl Daemon {
    fn start(http: bool) -> Daemon {
        let dir = TempDir::new().unwrap();
        let config = ServerConfig {
            socket: dir.path().join("sched.sock"),
            control: dir.path().join("control.sock"),
            control_group: None,
            state_dir: dir.path().join("state"),
            metrics: http.then(|| "127.0.0.1:0".parse().unwrap()),
            metrics_listen: None,
            daemon: DaemonConfig::default(),
            server_bin: PathBuf::from("/nonexistent/vgpu-server"),
            device_ids: None,
            cgroups: CgroupFs::default(),
            busy_poll: Duration::ZERO,
        };
        let mut server = Server::bind(config).unwrap();
        let http = server.metrics_addr();
        let stop = server.stop_handle().unwrap();
        let thread = std::thread::spawn(move || server.run().unwrap());
        Daemon {
            dir,
            http,
            stop,
            thread: Some(thread),
        }
    }

    fn sock(&self) -> PathBuf {
        self.dir.path().join("sched.sock")
    }

    /// One control request's answer.
    fn call(&self, request: Value) -> Value {
        let mut s = UnixStream::connect(self.dir.path().join("control.sock")).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(format!("{request}\n").as_bytes()).unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    }

    fn vm(&self, name: &str) -> Value {
        let list = self.call(json!({"cmd": "list"}));
        let vms = list["ok"]["vms"].as_array().unwrap().clone();
        vms.into_iter()
            .find(|v| v["name"] == name)
            .unwrap_or_default()
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

/// A fake device that submits frames back to back on its own thread until dropped: each
/// group is granted, "runs" 2 ms, is completed and presents a frame.
struct Busy {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Busy {
    fn start(socket: &Path, name: &str) -> Busy {
        let s = hello(socket, name);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut id = 0u64;
            let mut waiting = false;
            while !flag.load(Ordering::Relaxed) {
                if !waiting {
                    id += 1;
                    send(
                        &s,
                        &Msg::Submit {
                            group: GroupId(id),
                            context: 0,
                            kind: GroupKind::Present,
                            signature: CostSignature(1),
                            cost_ns: 0,
                            exec: Exec::Device,
                        },
                    );
                    waiting = true;
                }
                if let Some(Msg::Grant { group }) = recv(&s) {
                    let start = monotonic_ns();
                    std::thread::sleep(Duration::from_millis(2));
                    let finish = monotonic_ns();
                    send(
                        &s,
                        &Msg::Completed {
                            group,
                            start,
                            finish,
                        },
                    );
                    send(&s, &Msg::Frame);
                    waiting = false;
                }
            }
        });
        Busy {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A fake device of VM `name`, welcomed by the daemon (which lists the VM while it stays
/// connected); it reads with a 100 ms timeout.
fn hello(socket: &Path, name: &str) -> SeqStream {
    let s = SeqStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    send(
        &s,
        &Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new(name).unwrap(),
            device_pid: std::process::id(),
            qemu_pid: 0,
        },
    );
    assert!(matches!(recv(&s), Some(Msg::Welcome { .. })));
    s
}

fn send(s: &SeqStream, m: &Msg) {
    let mut b = Vec::new();
    proto::encode(m, &mut b);
    s.send(&b).unwrap();
}

/// The next message, `None` after the read timeout.
fn recv(s: &SeqStream) -> Option<Msg> {
    let mut buf = vec![0u8; MAX_MESSAGE_BYTES + 1];
    let n = s.recv(&mut buf).ok()??;
    proto::decode(buf.get(..n)?).ok()
}

/// Sends `request` and reads the whole answer: status code, head, body.
fn http(addr: SocketAddr, request: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(request).unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).unwrap();
    let answer = String::from_utf8(answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer:?}"));
    (status, head.to_owned(), body.to_owned())
}

fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
    http(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes(),
    )
}

/// A POST with `headers` (each line with its CRLF) and `body`; `(status, JSON answer)`.
fn post_with(addr: SocketAddr, path: &str, headers: &str, body: &str) -> (u16, Value) {
    let request = format!(
        "POST {path} HTTP/1.1\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (status, _, body) = http(addr, request.as_bytes());
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// A POST as the page sends it, with `token`.
fn post(addr: SocketAddr, token: &str, path: &str, body: &str) -> (u16, Value) {
    let headers =
        format!("Host: {addr}\r\nX-Vgpu-Token: {token}\r\nContent-Type: application/json\r\n");
    post_with(addr, path, &headers, body)
}

/// An open event stream read line by line.
struct Stream {
    reader: BufReader<TcpStream>,
}

impl Stream {
    fn open(addr: SocketAddr) -> Stream {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(format!("GET /events HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
            .unwrap();
        let mut reader = BufReader::new(s);
        let mut head = String::new();
        loop {
            let mut line = String::new();
            assert!(
                reader.read_line(&mut line).unwrap() > 0,
                "stream closed: {head}"
            );
            if line == "\r\n" {
                break;
            }
            head.push_str(&line);
        }
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(
            head.contains("Content-Type: text/event-stream\r\n"),
            "{head}"
        );
        Stream { reader }
    }

    /// The next event: its name and data.
    fn next(&mut self) -> (String, String) {
        let (mut name, mut data) = (String::new(), String::new());
        loop {
            let mut line = String::new();
            assert!(
                self.reader.read_line(&mut line).unwrap() > 0,
                "stream closed"
            );
            let line = line.trim_end_matches('\n');
            if line.is_empty() {
                if !name.is_empty() {
                    return (name, data);
                }
            } else if let Some(n) = line.strip_prefix("event: ") {
                name = n.to_owned();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data.push_str(d);
            }
        }
    }

    /// Whether the daemon closes the stream within `wait` (what it sent before is read and
    /// dropped).
    fn closed_within(&mut self, wait: Duration) -> bool {
        let start = Instant::now();
        let mut line = String::new();
        while start.elapsed() < wait {
            line.clear();
            match self.reader.read_line(&mut line) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => return true,
            }
        }
        false
    }

    /// The next snapshot event's JSON.
    fn snapshot(&mut self) -> Value {
        loop {
            let (name, data) = self.next();
            if name == "snapshot" {
                return serde_json::from_str(&data).unwrap();
            }
        }
    }
}

fn vm_of<'a>(snapshot: &'a Value, name: &str) -> &'a Value {
    snapshot["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {snapshot}"))
}

#[test]
fn dashboard_streams_snapshots_and_changes_the_scheduler_with_the_token() {
    let d = Daemon::start(true);
    let addr = d.http.unwrap();
    let _alpha = Busy::start(&d.sock(), "alpha");
    let _beta = Busy::start(&d.sock(), "beta");

    // The URL and its token come from the control socket only.
    let info = d.call(json!({"cmd": "dashboard"}));
    let url = info["ok"]["url"]
        .as_str()
        .unwrap_or_else(|| panic!("{info}"));
    let prefix = format!("http://{addr}/#token=");
    let token = url.strip_prefix(&prefix).unwrap_or_else(|| panic!("{url}"));
    assert_eq!(token.len(), 32);
    assert_eq!(info["ok"]["addr"], addr.to_string());

    // The page and its assets, from the binary.
    let (status, head, page) = get(addr, "/");
    assert_eq!(status, 200, "{head}");
    assert!(
        head.contains("Content-Type: text/html; charset=utf-8"),
        "{head}"
    );
    assert!(page.contains("id=\"chart-latency\"") && !page.contains(token));
    assert_eq!(get(addr, "/dashboard.js").0, 200);
    assert_eq!(get(addr, "/dashboard.css").0, 200);
    let (status, _, policies) = get(addr, "/api/policies");
    assert_eq!(status, 200);
    let policies: Value = serde_json::from_str(&policies).unwrap();
    assert!(policies.as_array().unwrap().len() >= 10, "{policies}");

    // The stream: the history first, then a snapshot now and about every second.
    let mut stream = Stream::open(addr);
    let (name, history) = stream.next();
    assert_eq!(name, "history");
    assert!(serde_json::from_str::<Value>(&history).unwrap().is_array());
    let first = stream.snapshot();
    let start = Instant::now();
    let mut busy = first.clone();
    while vm_of(&busy, "alpha")["share_pct"].as_f64().unwrap_or(0.0) <= 0.0
        || vm_of(&busy, "beta")["fps"].as_f64().unwrap_or(0.0) <= 0.0
    {
        assert!(start.elapsed() < WAIT, "no figures moved: {busy}");
        busy = stream.snapshot();
    }
    assert!(busy["t"].as_f64() > first["t"].as_f64(), "{first} {busy}");
    let alpha = vm_of(&busy, "alpha");
    assert_eq!(alpha["connected"], true);
    assert!(alpha["latency_p99_ms"].as_f64().unwrap() >= 1.0, "{alpha}");
    assert!(alpha["share_pct"].as_f64().unwrap() <= 100.0, "{alpha}");
    assert_eq!(busy["policy"]["policy"], "none");
    // The same snapshot over plain GET.
    let (status, _, state) = get(addr, "/api/state");
    assert_eq!(status, 200);
    let state: Value = serde_json::from_str(&state).unwrap();
    assert_eq!(vm_of(&state, "beta")["params"]["weight"], 256);

    // Parameters: refused without the token, with a wrong one, for another host; then set.
    let body = r#"{"vm":"alpha","params":{"priority":7,"weight":512,"target_fps":30}}"#;
    let json_type = "Content-Type: application/json\r\n";
    let no_token = format!("Host: {addr}\r\n{json_type}");
    assert_eq!(post_with(addr, "/api/params", &no_token, body).0, 403);
    assert_eq!(post(addr, "0123", "/api/params", body).0, 403);
    let wrong_host = format!(
        "Host: attacker.example:{}\r\nX-Vgpu-Token: {token}\r\n{json_type}",
        addr.port()
    );
    assert_eq!(post_with(addr, "/api/params", &wrong_host, body).0, 403);
    assert_eq!(
        d.vm("alpha")["params"]["priority"],
        0,
        "changed without the token"
    );
    let (status, answer) = post(addr, token, "/api/params", body);
    assert_eq!((status, &answer["ok"]), (200, &json!(true)), "{answer}");
    // The answer carries the change as the page's "Last change" shows it.
    let change = &answer["change"];
    assert_eq!(
        change["what"], "set alpha priority=7 weight=512 target_fps=30",
        "{answer}"
    );
    assert!(
        change["by"]
            .as_str()
            .is_some_and(|b| b.starts_with("dashboard, uid ")),
        "{answer}"
    );
    assert!(change["error"].is_null() && change["seq"].as_u64() > Some(0));
    let params = &d.vm("alpha")["params"];
    assert_eq!(
        (
            &params["priority"],
            &params["weight"],
            &params["target_fps"]
        ),
        (&json!(7), &json!(512), &json!(30.0))
    );

    // Focus and policy: the same paths as the control requests.
    assert_eq!(post(addr, token, "/api/focus", r#"{"vm":"beta"}"#).0, 200);
    let prt = r#"{"policy":"timegraph","sched":"prt"}"#;
    assert_eq!(post(addr, token, "/api/policy", prt).0, 200);
    let list = d.call(json!({"cmd": "list"}));
    assert_eq!(list["ok"]["policy"]["policy"], "timegraph");
    assert_eq!(list["ok"]["policy"]["sched"], "prt");
    // The stream shows the change.
    let start = Instant::now();
    loop {
        let s = stream.snapshot();
        if s["policy_name"] == "timegraph" && vm_of(&s, "alpha")["params"]["priority"] == 7 {
            break;
        }
        assert!(start.elapsed() < WAIT, "change not streamed: {s}");
    }

    // Reserve and SLO as `vgpuctl set` takes them (the page's way); refused with its words,
    // or with the daemon's check's.
    let set = r#"{"vm":"alpha","set":["reserve=2000/10000/ae","slo=3000"]}"#;
    assert_eq!(post(addr, token, "/api/params", set).0, 200);
    let params = &d.vm("alpha")["params"];
    assert_eq!(params["reserve"]["c"], 2_000_000, "{params}");
    assert_eq!(params["reserve"]["enforcement"], "ae", "{params}");
    assert_eq!(params["slo"], 3_000_000, "{params}");
    let (status, answer) = post(
        addr,
        token,
        "/api/params",
        r#"{"vm":"alpha","set":["reserve=1/2"]}"#,
    );
    let cli = vgpu_schedd::control::parse_assignment("reserve=1/2").unwrap_err();
    assert_eq!((status, &answer), (400, &json!({"error": cli.to_string()})));
    let longer = r#"{"vm":"alpha","set":["reserve=20000/10000/pe"]}"#;
    let (status, answer) = post(addr, token, "/api/params", longer);
    assert_eq!(status, 400, "{answer}");
    assert_eq!(d.vm("alpha")["params"]["reserve"]["c"], 2_000_000);
    // A refused change is the last change too, with the daemon's reason.
    let (_, _, state) = get(addr, "/api/state");
    let last: Value = serde_json::from_str::<Value>(&state).unwrap()["last_change"].clone();
    assert_eq!(last["what"], "set alpha reserve=20000/10000/pe", "{last}");
    assert_eq!(last["error"], answer["error"], "{last}");

    // A change through the control socket (as vgpuctl makes it) is the last change the
    // stream shows, with who made it.
    let answer = d.call(json!({"cmd": "set-params", "vm": "beta", "params": {"weight": 300}}));
    assert!(answer["ok"].is_object(), "{answer}");
    let start = Instant::now();
    let last = loop {
        let s = stream.snapshot();
        if s["last_change"]["what"] == "set beta weight=300" {
            break s["last_change"].clone();
        }
        assert!(
            start.elapsed() < WAIT,
            "the control's change not streamed: {s}"
        );
    };
    assert!(
        last["by"]
            .as_str()
            .is_some_and(|b| b.starts_with("control socket, uid ")),
        "{last}"
    );
    assert!(last["error"].is_null(), "{last}");

    // Bodies and VMs that are refused, with the status code of each.
    let huge = format!(
        "POST /api/params HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n",
        MAX_HTTP_BODY_BYTES + 1
    );
    assert_eq!(http(addr, huge.as_bytes()).0, 413);
    for (path, body, want) in [
        ("/api/params", "{not json", 400),
        (
            "/api/params",
            r#"{"vm":"alpha","params":{"colour":3}}"#,
            400,
        ),
        (
            "/api/params",
            r#"{"vm":"alpha","params":{"weight":0}}"#,
            400,
        ),
        (
            "/api/params",
            r#"{"vm":"nobody","params":{"priority":1}}"#,
            404,
        ),
        ("/api/focus", r#"{"vm":"nobody"}"#, 404),
        ("/api/policy", r#"{"policy":"nonesuch"}"#, 400),
        ("/api/nothing", "{}", 404),
    ] {
        let (status, answer) = post(addr, token, path, body);
        assert_eq!(status, want, "{path} {body}: {answer}");
        if status != 404 || path != "/api/nothing" {
            assert!(answer["error"].is_string(), "{path} {body}: {answer}");
        }
    }
    let text = format!("Host: {addr}\r\nX-Vgpu-Token: {token}\r\nContent-Type: text/plain\r\n");
    assert_eq!(
        post_with(addr, "/api/focus", &text, r#"{"vm":"beta"}"#).0,
        415
    );
    assert!(d.vm("nobody").is_null(), "an unknown VM was added");
    assert_eq!(d.vm("alpha")["params"]["weight"], 512);
    assert_eq!(d.vm("beta")["params"]["weight"], 300);

    // Methods, heads and hosts that are refused.
    let request = |line: &str| format!("{line}\r\nHost: {addr}\r\n\r\n");
    assert_eq!(http(addr, request("DELETE / HTTP/1.1").as_bytes()).0, 405);
    assert_eq!(
        http(addr, request("GET /api/policy HTTP/1.1").as_bytes()).0,
        405
    );
    assert_eq!(
        http(addr, request("GET /nothing HTTP/1.1").as_bytes()).0,
        404
    );
    assert_eq!(http(addr, b"GET / HTTP/1.1\r\n\r\n").0, 403);
    assert_eq!(
        http(addr, b"GET /metrics HTTP/1.1\r\nHost: evil.example\r\n\r\n").0,
        403
    );
    assert_eq!(http(addr, b"nonsense\r\n\r\n").0, 400);
    assert_eq!(http(addr, &vec![b'G'; 20_000]).0, 431);

    drop(stream);
}

/// A local user who holds every event stream and reads nothing does not lock the operator out:
/// a new client is served at once, and the oldest stream is closed for it (the new one was
/// answered 503 for as long as the others were held, and they were held for ever).
#[test]
fn a_full_house_of_unread_streams_does_not_lock_a_new_client_out() {
    let d = Daemon::start(true);
    let addr = d.http.unwrap();
    let held: Vec<Stream> = (0..MAX_EVENT_STREAMS).map(|_| Stream::open(addr)).collect();
    let start = Instant::now();
    let mut newcomer = Stream::open(addr);
    newcomer.snapshot();
    eprintln!(
        "a new stream's first snapshot with {MAX_EVENT_STREAMS} held: {:?}",
        start.elapsed()
    );
    let mut held = held.into_iter();
    let mut oldest = held.next().unwrap();
    assert!(
        oldest.closed_within(WAIT),
        "the oldest stream was closed for the new one"
    );
    // The others stay.
    let mut next = held.next().unwrap();
    next.snapshot();
}

/// A client that opens a stream and reads nothing is closed once it leaves more than
/// [`MAX_EVENT_STREAM_UNREAD_BYTES`] unread after its grace, while a page that reads stays
/// (before, such a stream stayed until 4 MiB piled up in the daemon's buffer past both
/// sockets' queues: over an hour at 1 KB a second).
#[test]
fn a_stream_that_is_not_read_is_closed_past_its_unread_limit() {
    let d = Daemon::start(true);
    let addr = d.http.unwrap();
    // Many VMs with long names: snapshots of several KiB, so that the limit is passed within
    // seconds.
    let _vms: Vec<SeqStream> = (0..MAX_DASHBOARD_VMS)
        .map(|i| hello(&d.sock(), &format!("{i:0>60}")))
        .collect();
    let mut page = Stream::open(addr);
    let mut silent = Stream::open(addr);
    let opened = Instant::now();
    // What the silent client's buffered reader may have taken off its socket with the head.
    let read_with_the_head = 16 * 1024;
    let past_limit = MAX_EVENT_STREAM_UNREAD_BYTES + read_with_the_head;
    // Every snapshot the page reads was sent to the silent client too: once those sent since
    // it opened pass the limit after its grace, the next publication closes it.
    let mut sent: u64 = 0;
    let mut snapshots = 0u32;
    while sent <= past_limit || opened.elapsed() <= EVENT_STREAM_READ_GRACE {
        let (name, data) = page.next();
        if name == "snapshot" {
            sent = sent.saturating_add(data.len() as u64);
            snapshots += 1;
        }
        assert!(
            opened.elapsed() < EVENT_STREAM_READ_GRACE + 10 * WAIT,
            "{sent} bytes in {snapshots} snapshots"
        );
    }
    page.snapshot();
    eprintln!(
        "{snapshots} snapshots, {sent} bytes unread after {:?}",
        opened.elapsed()
    );
    assert!(
        silent.closed_within(WAIT),
        "the stream left unread is closed"
    );
    // The page that reads stays.
    page.snapshot();
}

#[test]
fn dashboard_request_without_a_listener_says_so() {
    let d = Daemon::start(false);
    let answer = d.call(json!({"cmd": "dashboard"}));
    let error = answer["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{answer}"));
    assert!(error.contains("HTTP listener is off"), "{error}");
}
