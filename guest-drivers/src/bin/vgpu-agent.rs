//! `vgpu-agent`: the guest end of the host-guest control channel
//! (`vgpu_guest_drivers::control` has the wire format). Installed in the Debian test guest as
//! `/usr/local/bin/vgpu-agent` (statically linked, by `qemu-scripts/build-guest-image.sh`);
//! the host boots the guest with a virtio-serial port named `org.vgpu.control` and the job
//! `vgpu-agent`, then starts workloads, stops them and hears their summaries through it.
//!
//! Each job is a bash script run in a process group of its own, stdin a pipe the agent holds,
//! stdout read by the agent: every line goes to the agent's own stdout (the guest's console),
//! and lines starting with `SUMMARY ` also to the host. A `STOP` closes the job's stdin (a
//! workload such as `vgpu-load --until-stopped` ends there and prints its summary); a job
//! still running [`STOP_GRACE`] later gets SIGTERM, and SIGKILL [`KILL_GRACE`] after that.
//! When a job's script has exited, what it left running in its group gets SIGTERM.
//! `QUIT` stops every job the same way, answers `BYE` and exits 0 (the guest's init then powers
//! the machine off). Every request is answered or refused with `ERROR`.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, ExitCode, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use rustix::process::{Pid, Signal, kill_process_group};
use vgpu_guest_drivers::control::{
    ControlError, GuestMsg, HostDecoder, HostMsg, JobId, MAX_LINE, PORT_NAME, SUMMARY_PREFIX,
    VERSION,
};

/// Longest wait for the control port to appear (the `virtio_console` driver probes it early in
/// boot; the agent may start before udev-less devtmpfs shows the node).
const PORT_WAIT: Duration = Duration::from_secs(30);
/// From a STOP (stdin closed) to SIGTERM, by default: a workload drains its work in flight
/// (each group is at most 1 s, and a starved VM's may queue behind others') and prints its
/// summary.
const STOP_GRACE_MS: u64 = 15_000;
/// Longest stop grace the command line takes (10 minutes).
const MAX_STOP_GRACE_MS: u64 = 600_000;
/// From SIGTERM to SIGKILL.
const KILL_GRACE: Duration = Duration::from_secs(5);
/// How long a job's exit waits for the rest of its output (a process it left behind may
/// hold the pipe open).
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);
/// Most jobs at once (each is a bash and its workload in a small guest).
const MAX_JOBS: usize = 16;
/// How often the agent looks at its stop deadlines, and retries reading a port whose host
/// end is not connected.
const TICK: Duration = Duration::from_millis(100);
/// Where the jobs' scripts are written.
const JOB_DIR: &str = "/run/vgpu-agent";
/// Exit code for a port that cannot be found or opened.
const EXIT_NO_PORT: u8 = 2;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "vgpu-agent",
    version,
    about = "The guest end of the vgpu host-guest control channel: runs, stops and reports \
             the host's jobs"
)]
struct Cli {
    /// Talk over this Unix socket (connecting to it) instead of the virtio-serial port named
    /// org.vgpu.control: for tests and development on a host
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Milliseconds from a STOP (the job's stdin closed) to SIGTERM; SIGKILL follows 5 s later
    #[arg(long, value_name = "MS", default_value_t = STOP_GRACE_MS,
          value_parser = clap::value_parser!(u64).range(0..=MAX_STOP_GRACE_MS))]
    stop_grace_ms: u64,
}

/// What the agent's loop reacts to.
enum Event {
    Host(Result<HostMsg, ControlError>),
    Summary(JobId, String),
    Exited(JobId, i32),
}

/// A running job.
struct Job {
    group: Pid,
    /// Dropped (closed) by STOP.
    stdin: Option<ChildStdin>,
    /// When STOP came.
    stopping: Option<Instant>,
    /// The strongest signal sent since: 0 none, 1 SIGTERM, 2 SIGKILL.
    signalled: u8,
}

/// Finds the device node of the virtio-serial port named `name`.
fn find_port(name: &str) -> Option<PathBuf> {
    let ports = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for port in ports.flatten() {
        let named = std::fs::read_to_string(port.path().join("name")).unwrap_or_default();
        if named.trim_end() == name {
            return Some(Path::new("/dev").join(port.file_name()));
        }
    }
    None
}

/// The port, once it has appeared (bounded by [`PORT_WAIT`]).
fn open_port() -> Result<File, String> {
    let until = Instant::now() + PORT_WAIT;
    loop {
        if let Some(path) = find_port(PORT_NAME) {
            return OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| format!("opening {}: {e}", path.display()));
        }
        if Instant::now() >= until {
            return Err(format!(
                "no virtio-serial port named {PORT_NAME} within {} s (is virtio_console loaded, \
                 and did the host add the port?)",
                PORT_WAIT.as_secs()
            ));
        }
        std::thread::sleep(TICK);
    }
}

/// Sends reports to the host: one write per line, from any thread.
#[derive(Clone)]
struct Reporter(Arc<Mutex<Box<dyn Write + Send>>>);

impl Reporter {
    fn send(&self, msg: &GuestMsg) {
        let line = msg.encode();
        let mut port = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // A host that is not connected loses the line (QEMU drops it): it asks again (PING).
        if let Err(e) = port.write_all(&line) {
            eprintln!("vgpu-agent: writing to the control port: {e}");
        }
    }
}

/// Reads the host's requests into `events`. A read of nothing means the host end is not
/// connected (yet, or any more): it is retried.
fn read_host(mut port: impl Read, events: Sender<Event>) {
    let mut decoder = HostDecoder::default();
    let mut buf = [0u8; 4096];
    loop {
        match port.read(&mut buf) {
            Ok(0) => std::thread::sleep(TICK),
            Ok(n) => {
                for msg in decoder.push(&buf[..n]) {
                    if events.send(Event::Host(msg)).is_err() {
                        return;
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("vgpu-agent: reading the control port: {e}");
                std::thread::sleep(TICK);
            }
        }
    }
}

/// Copies a job's stdout to the console line by line and sends its summary lines; returns at
/// the pipe's end.
fn read_output(id: &JobId, stdout: impl Read, events: &Sender<Event>) {
    let mut reader = BufReader::new(stdout);
    let mut line = Vec::new();
    loop {
        line.clear();
        // At most MAX_LINE bytes at a time: a longer line arrives in pieces.
        match reader
            .by_ref()
            .take(MAX_LINE as u64)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end_matches(['\n', '\r']);
        println!("{text}");
        if let Some(summary) = text.strip_prefix(SUMMARY_PREFIX) {
            let _ = events.send(Event::Summary(id.clone(), summary.to_owned()));
        }
    }
}

/// Starts `script` as job `id`: its own process group, a thread for its output and one that
/// waits for its exit.
fn start(id: &JobId, script: &[u8], events: &Sender<Event>) -> Result<Job, String> {
    std::fs::create_dir_all(JOB_DIR).map_err(|e| format!("{JOB_DIR}: {e}"))?;
    let path = Path::new(JOB_DIR).join(format!("{id}.sh"));
    std::fs::write(&path, script).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut child = Command::new("bash")
        .arg(&path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("starting bash: {e}"))?;
    let group = i32::try_from(child.id())
        .ok()
        .and_then(Pid::from_raw)
        .ok_or("a job without a pid")?;
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().ok_or("a job without stdout")?;
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (out_id, out_events) = (id.clone(), events.clone());
    std::thread::spawn(move || {
        read_output(&out_id, stdout, &out_events);
        let _ = done_tx.send(());
    });
    let (wait_id, wait_events) = (id.clone(), events.clone());
    std::thread::spawn(move || {
        let code = match child.wait() {
            Ok(status) => status
                .code()
                .or_else(|| status.signal().map(|s| 128 + s))
                .unwrap_or(-1),
            Err(_) => -1,
        };
        // What the script left behind ends with it (it may hold the output pipe).
        let _ = done_rx.recv_timeout(OUTPUT_DRAIN);
        let _ = kill_process_group(group, Signal::TERM);
        let _ = wait_events.send(Event::Exited(wait_id, code));
    });
    Ok(Job {
        group,
        stdin,
        stopping: None,
        signalled: 0,
    })
}

/// Asks `job` to stop: its stdin closes now; the signals follow from [`escalate`].
fn stop(job: &mut Job, now: Instant) {
    job.stdin = None;
    job.stopping.get_or_insert(now);
}

/// Signals the jobs whose stop grace is over.
fn escalate(jobs: &mut BTreeMap<JobId, Job>, grace: Duration, now: Instant) {
    for (id, job) in jobs.iter_mut() {
        let Some(since) = job.stopping else { continue };
        let waited = now.saturating_duration_since(since);
        let (level, signal, name) = if waited >= grace + KILL_GRACE {
            (2, Signal::KILL, "SIGKILL")
        } else if waited >= grace {
            (1, Signal::TERM, "SIGTERM")
        } else {
            continue;
        };
        if job.signalled < level {
            eprintln!(
                "vgpu-agent: job {id} still runs {} ms after STOP: {name}",
                waited.as_millis()
            );
            let _ = kill_process_group(job.group, signal);
            job.signalled = level;
        }
    }
}

/// Serves the host until `QUIT`.
fn serve(report: &Reporter, events: &Sender<Event>, rx: &Receiver<Event>, grace: Duration) {
    let mut jobs: BTreeMap<JobId, Job> = BTreeMap::new();
    let mut quitting = false;
    report.send(&GuestMsg::Hello { version: VERSION });
    loop {
        let event = match rx.recv_timeout(TICK) {
            Ok(event) => Some(event),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let now = Instant::now();
        match event {
            None => {}
            Some(Event::Host(Err(e))) => report.send(&GuestMsg::Error {
                id: None,
                text: e.to_string(),
            }),
            Some(Event::Host(Ok(msg))) => match msg {
                HostMsg::Ping => report.send(&GuestMsg::Hello { version: VERSION }),
                HostMsg::Start { id, script } => {
                    let refused = if quitting {
                        Some("the agent is quitting".to_owned())
                    } else if jobs.contains_key(&id) {
                        Some("a job of that name runs".to_owned())
                    } else if jobs.len() >= MAX_JOBS {
                        Some(format!("{MAX_JOBS} jobs run already"))
                    } else {
                        match start(&id, &script, events) {
                            Ok(job) => {
                                jobs.insert(id.clone(), job);
                                report.send(&GuestMsg::Started { id: id.clone() });
                                None
                            }
                            Err(e) => Some(e),
                        }
                    };
                    if let Some(text) = refused {
                        report.send(&GuestMsg::Error { id: Some(id), text });
                    }
                }
                HostMsg::Stop { id } => match jobs.get_mut(&id) {
                    Some(job) => stop(job, now),
                    None => report.send(&GuestMsg::Error {
                        id: Some(id),
                        text: "no such job".to_owned(),
                    }),
                },
                HostMsg::Quit => {
                    quitting = true;
                    for job in jobs.values_mut() {
                        stop(job, now);
                    }
                }
            },
            Some(Event::Summary(id, text)) => report.send(&GuestMsg::Summary { id, text }),
            Some(Event::Exited(id, code)) => {
                jobs.remove(&id);
                report.send(&GuestMsg::Exited { id, code });
            }
        }
        escalate(&mut jobs, grace, now);
        if quitting && jobs.is_empty() {
            report.send(&GuestMsg::Bye);
            return;
        }
    }
}

/// The channel's reading and writing ends.
type Ends = (Box<dyn Read + Send>, Box<dyn Write + Send>);

/// The channel's two ends: the virtio-serial port, or a Unix socket (`--socket`).
fn channel(cli: &Cli) -> Result<Ends, String> {
    match &cli.socket {
        Some(path) => {
            let stream = UnixStream::connect(path)
                .map_err(|e| format!("connecting to {}: {e}", path.display()))?;
            let writer = stream.try_clone().map_err(|e| e.to_string())?;
            Ok((Box::new(stream), Box::new(writer)))
        }
        None => {
            let port = open_port()?;
            let writer = port.try_clone().map_err(|e| e.to_string())?;
            Ok((Box::new(port), Box::new(writer)))
        }
    }
}

fn main() -> ExitCode {
    let cli: Cli = vgpu_cli::parse();
    let (reader, writer) = match channel(&cli) {
        Ok(ends) => ends,
        Err(e) => {
            eprintln!("vgpu-agent: {e}");
            return ExitCode::from(EXIT_NO_PORT);
        }
    };
    eprintln!("vgpu-agent: serving the host");
    let report = Reporter(Arc::new(Mutex::new(writer)));
    let (events, rx) = mpsc::channel();
    let host_events = events.clone();
    std::thread::spawn(move || read_host(reader, host_events));
    serve(
        &report,
        &events,
        &rx,
        Duration::from_millis(cli.stop_grace_ms),
    );
    eprintln!("vgpu-agent: done");
    ExitCode::SUCCESS
}
