//! `promtool check metrics` (Debian's `prometheus` package), shared by the tests that check
//! the daemon's metrics exposition against Prometheus' own parser and naming lint.

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long promtool may take to check one exposition (a few kB: it takes milliseconds).
const PROMTOOL_TIMEOUT: Duration = Duration::from_secs(30);

/// Kills the promtool child if the check panics before it has been waited for.
struct Promtool(Child);

impl Drop for Promtool {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Reads a child's pipe to the end on a thread (so a full pipe cannot stall the child).
fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<String> {
    let mut pipe = pipe.expect("piped");
    thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    })
}

/// Runs `promtool check metrics` on `exposition` and returns whether it passed and what it
/// reported (stdout and stderr). A missing promtool is a test failure naming the package.
pub fn promtool_check(exposition: &str) -> (bool, String) {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "running promtool ({e}): install Debian's `prometheus` package \
                 (apt-get install --no-install-recommends prometheus)"
            )
        });
    let mut child = Promtool(child);
    let out = drain(child.0.stdout.take());
    let err = drain(child.0.stderr.take());
    let mut stdin = child.0.stdin.take().expect("piped");
    stdin
        .write_all(exposition.as_bytes())
        .expect("writing to promtool");
    drop(stdin);
    let deadline = Instant::now() + PROMTOOL_TIMEOUT;
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("waiting for promtool") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "promtool did not finish in {PROMTOOL_TIMEOUT:?}"
        );
        thread::sleep(Duration::from_millis(10));
    };
    let report = out.join().expect("promtool stdout") + &err.join().expect("promtool stderr");
    (status.success(), report)
}

/// Asserts that promtool accepts `exposition` and reports no problem at all.
pub fn assert_promtool_clean(exposition: &str) {
    let (ok, report) = promtool_check(exposition);
    assert!(
        ok && report.trim().is_empty(),
        "promtool check metrics: {report}\n--- exposition:\n{exposition}"
    );
}
