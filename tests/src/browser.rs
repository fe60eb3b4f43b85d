//! A headless Chromium for browser tests (the daemon's web dashboard), driven over the Chrome
//! DevTools Protocol (CDP) with `--remote-debugging-pipe`: the browser reads JSON messages,
//! each terminated by a NUL byte, on its fd 3 and writes its answers and events the same way
//! on its fd 4, so no WebSocket and no port are involved.
//!
//! [`Browser::launch`] starts Debian's `chromium` (or the binary named by `VGPU_CHROMIUM`)
//! with a fresh profile, [`Browser::new_page`] opens a tab attached as a flat session with a
//! fixed viewport, and a [`Page`] navigates, evaluates JavaScript, polls a predicate and takes screenshots. Every
//! wait is bounded by a named timeout. The browser is closed (then killed by pid) and reaped
//! on drop; its stderr and the pages' console messages and exceptions are printed when the
//! test is panicking.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write as _};
use std::os::fd::{AsRawFd, FromRawFd as _, OwnedFd, RawFd};
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use thiserror::Error;

use crate::TempDir;

/// Environment variable naming another Chromium binary.
pub const CHROMIUM_ENV: &str = "VGPU_CHROMIUM";
/// The Debian package that provides `chromium` (named in the error when it is missing).
pub const CHROMIUM_PACKAGE: &str = "chromium";
/// Longest wait for a started browser to answer its first message: Chromium's first start
/// with a fresh profile takes a few seconds, more on a loaded two-core machine.
pub const LAUNCH_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for the answer to one CDP command (a navigation's commit, a screenshot).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a navigated page's load to complete.
pub const LOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for the browser to exit after `Browser.close` before it is killed.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Interval between two evaluations of a [`Page::wait_for`] predicate.
const POLL: Duration = Duration::from_millis(100);
/// Largest message accepted from the browser: a base64 PNG of the whole window is a few MiB;
/// anything beyond this is a broken browser, not something to buffer.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// Console messages and exceptions kept for the failure report (the latest ones).
const MAX_EVENTS_KEPT: usize = 200;
/// The size of a page's viewport, hence of its screenshots, in CSS pixels and pixels (the
/// device scale factor is 1); also the browser window's size.
pub const VIEWPORT: (u32, u32) = (1280, 900);
/// Longest edge of a full-page screenshot, in pixels: Chromium's own limit for one capture.
pub const MAX_SCREENSHOT_EDGE: u32 = 16384;
/// The fds on which Chromium reads and writes CDP with `--remote-debugging-pipe`.
const BROWSER_READS_FD: RawFd = 3;
const BROWSER_WRITES_FD: RawFd = 4;
/// Lowest fd used for the temporary copies made while installing fds 3 and 4 in the child.
const SCRATCH_FD_MIN: RawFd = 10;

/// Errors of the browser driver.
#[derive(Debug, Error)]
pub enum BrowserError {
    /// The Chromium binary does not exist.
    #[error(
        "{path} not found: install Debian's `{CHROMIUM_PACKAGE}` package \
         (apt-get install --no-install-recommends {CHROMIUM_PACKAGE}) or set {CHROMIUM_ENV}"
    )]
    NotInstalled {
        /// The binary looked for.
        path: String,
    },
    /// A system call on the driver's files, pipes or child failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The browser did not answer its first message in time.
    #[error("the browser did not start ({why}); its stderr:\n{log}")]
    Launch {
        /// What went wrong.
        why: String,
        /// The browser's stderr.
        log: String,
    },
    /// The browser closed its end of the pipe (it exited or crashed).
    #[error("the browser went away during {what}; its stderr:\n{log}")]
    Closed {
        /// The command that was waiting.
        what: String,
        /// The browser's stderr.
        log: String,
    },
    /// Something did not happen in time.
    #[error("no {what} within {after:?}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The bound.
        after: Duration,
    },
    /// The browser sent something that is not a CDP message.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The browser answered a command with an error.
    #[error("{method}: {error}")]
    Command {
        /// The CDP method.
        method: String,
        /// The error object, as JSON text.
        error: String,
    },
    /// A navigation failed.
    #[error("navigating to {url}: {why}")]
    Navigation {
        /// Where to.
        url: String,
        /// The browser's error text.
        why: String,
    },
    /// Evaluated JavaScript threw.
    #[error("{expression}: threw {details}")]
    Script {
        /// The expression.
        expression: String,
        /// The exception, as the browser describes it.
        details: String,
    },
    /// A screenshot's data is not base64.
    #[error("screenshot data is not base64")]
    Base64,
    /// A screenshot is not a PNG of the expected kind.
    #[error("screenshot: {0}")]
    Png(String),
}

type Result<T> = std::result::Result<T, BrowserError>;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BrowserError {
    let what = what.into();
    move |source| BrowserError::Io { what, source }
}

/// The Chromium binary tests run: `VGPU_CHROMIUM`, or `chromium` from `PATH`.
pub fn chromium_path() -> PathBuf {
    std::env::var_os(CHROMIUM_ENV).map_or_else(|| CHROMIUM_PACKAGE.into(), PathBuf::from)
}

/// The connection to the browser: what to write to and what the reader thread received.
#[derive(Debug)]
struct Connection {
    to_browser: File,
    from_browser: Receiver<std::result::Result<Value, String>>,
    next_id: u64,
    /// Console messages, exceptions and crashes of the pages, the latest first out.
    events: VecDeque<String>,
}

/// A running headless Chromium. Closed, killed if it does not exit, and reaped on drop.
#[derive(Debug)]
pub struct Browser {
    child: Option<Child>,
    connection: Mutex<Connection>,
    /// The profile (`data/`) and the browser's stderr (`stderr.log`).
    dir: TempDir,
}

impl Browser {
    /// Starts the browser headless with a fresh profile and a window of [`VIEWPORT`] and
    /// waits up to [`LAUNCH_TIMEOUT`] for it to answer.
    pub fn launch() -> Result<Browser> {
        let dir = TempDir::new("vgpu-chromium").map_err(io("creating the browser's profile"))?;
        let stderr = File::create(dir.path().join("stderr.log"))
            .map_err(io("creating the browser's log"))?;
        let (browser_reads, to_browser) = pipe()?;
        let (from_browser, browser_writes) = pipe()?;
        let path = chromium_path();
        let mut command = Command::new(&path);
        command
            .args([
                "--headless=new",
                // The tests run as root, where Chromium's sandbox refuses to start.
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-dev-shm-usage",
                "--remote-debugging-pipe",
                "--hide-scrollbars",
            ])
            .arg(format!("--window-size={},{}", VIEWPORT.0, VIEWPORT.1))
            .arg(format!(
                "--user-data-dir={}",
                dir.path().join("data").display()
            ))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(stderr.try_clone().map_err(io("duplicating the log"))?)
            .stderr(stderr);
        let fds = [
            (browser_reads.as_raw_fd(), BROWSER_READS_FD),
            (browser_writes.as_raw_fd(), BROWSER_WRITES_FD),
        ];
        // SAFETY: the closure runs in the forked child between fork and exec, where only
        // async-signal-safe calls are allowed: `install_fds` calls fcntl and dup2 alone, on
        // fds that stay open in the parent until `spawn` returns, and allocates nothing.
        unsafe {
            command.pre_exec(move || install_fds(&fds));
        }
        // Reading starts before the spawn: if the spawn fails, dropping our write end below
        // ends the thread.
        let from_browser = spawn_reader(File::from(from_browser))?;
        log::info!("starting {command:?}");
        let child = command.spawn().map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => BrowserError::NotInstalled {
                path: path.display().to_string(),
            },
            _ => BrowserError::Io {
                what: format!("starting {}", path.display()),
                source: e,
            },
        })?;
        // The child holds its ends now; without closing ours, its exit would not end the pipe.
        drop((browser_reads, browser_writes));
        let browser = Browser {
            child: Some(child),
            connection: Mutex::new(Connection {
                to_browser: File::from(to_browser),
                from_browser,
                next_id: 1,
                events: VecDeque::new(),
            }),
            dir,
        };
        let version = browser
            .call(None, "Browser.getVersion", json!({}), LAUNCH_TIMEOUT)
            .map_err(|e| match e {
                BrowserError::Timeout { .. } => BrowserError::Launch {
                    why: e.to_string(),
                    log: browser.log(),
                },
                e => e,
            })?;
        log::info!("browser: {}", version["product"]);
        Ok(browser)
    }

    /// Sends the CDP command `method` (to the page session `session`, or to the browser) and
    /// waits up to `timeout` for its result. Events received meanwhile are recorded.
    pub fn call(
        &self,
        session: Option<&str>,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<Value> {
        let mut conn = self
            .connection
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let id = conn.next_id;
        conn.next_id = id.saturating_add(1);
        let mut message = json!({"id": id, "method": method, "params": params});
        if let Some(session) = session {
            message["sessionId"] = session.into();
        }
        let mut bytes = message.to_string().into_bytes();
        bytes.push(0);
        if let Err(e) = conn.to_browser.write_all(&bytes) {
            log::warn!("writing {method} to the browser: {e}");
            return Err(self.closed(method));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let message = match conn.from_browser.recv_timeout(left) {
                Ok(Ok(message)) => message,
                Ok(Err(why)) => return Err(BrowserError::Protocol(why)),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(BrowserError::Timeout {
                        what: format!("answer to {method}"),
                        after: timeout,
                    });
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.closed(method)),
            };
            if message["id"].as_u64() == Some(id) {
                if let Some(error) = message.get("error") {
                    return Err(BrowserError::Command {
                        method: method.to_owned(),
                        error: error.to_string(),
                    });
                }
                return Ok(message["result"].clone());
            }
            if let Some(event) = describe_event(&message) {
                log::debug!("browser: {event}");
                if conn.events.len() == MAX_EVENTS_KEPT {
                    conn.events.pop_front();
                }
                conn.events.push_back(event);
            }
        }
    }

    fn closed(&self, what: &str) -> BrowserError {
        BrowserError::Closed {
            what: what.to_owned(),
            log: self.log(),
        }
    }

    /// Opens a new tab on `about:blank`, attached as a flat session with its runtime's
    /// console and exceptions reported and a viewport of [`VIEWPORT`].
    pub fn new_page(&self) -> Result<Page<'_>> {
        let target = self.call(
            None,
            "Target.createTarget",
            json!({"url": "about:blank"}),
            CALL_TIMEOUT,
        )?;
        let target_id = target["targetId"]
            .as_str()
            .ok_or_else(|| BrowserError::Protocol(format!("createTarget answered {target}")))?;
        let attached = self.call(
            None,
            "Target.attachToTarget",
            json!({"targetId": target_id, "flatten": true}),
            CALL_TIMEOUT,
        )?;
        let session = attached["sessionId"]
            .as_str()
            .ok_or_else(|| BrowserError::Protocol(format!("attachToTarget answered {attached}")))?
            .to_owned();
        let page = Page {
            browser: self,
            session,
        };
        page.call("Page.enable", json!({}))?;
        page.call("Runtime.enable", json!({}))?;
        // The window's size includes room for browser UI a headless tab does not show: fix
        // the viewport itself, so that pages and screenshots have the same size everywhere.
        page.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": VIEWPORT.0, "height": VIEWPORT.1,
                   "deviceScaleFactor": 1, "mobile": false}),
        )?;
        Ok(page)
    }

    /// The browser's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read(self.dir.path().join("stderr.log"))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// The pages' console messages, exceptions and crashes recorded so far (the latest
    /// [`MAX_EVENTS_KEPT`]).
    pub fn events(&self) -> Vec<String> {
        self.connection
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .events
            .iter()
            .cloned()
            .collect()
    }

    /// Asks the browser to close, waits up to [`CLOSE_TIMEOUT`] for it to exit, kills it by
    /// pid if it does not, and reaps it.
    fn shut_down(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Err(e) = self.call(None, "Browser.close", json!({}), CLOSE_TIMEOUT) {
            // The browser may exit before it answers: that is a close, not an error.
            log::debug!("Browser.close: {e}");
        }
        let start = Instant::now();
        while matches!(child.try_wait(), Ok(None)) && start.elapsed() < CLOSE_TIMEOUT {
            std::thread::sleep(POLL);
        }
        if matches!(child.try_wait(), Ok(None)) {
            log::warn!("the browser did not exit in {CLOSE_TIMEOUT:?}: killing it");
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        self.shut_down();
        if std::thread::panicking() {
            eprintln!("---- chromium stderr ----\n{}", self.log());
            eprintln!("---- page console and exceptions ----");
            for event in self.events() {
                eprintln!("{event}");
            }
        }
    }
}

/// A tab of a [`Browser`], attached as a flat CDP session.
#[derive(Debug)]
pub struct Page<'b> {
    browser: &'b Browser,
    session: String,
}

impl Page<'_> {
    /// Sends `method` to this page's session with [`CALL_TIMEOUT`].
    pub fn call(&self, method: &str, params: Value) -> Result<Value> {
        self.browser
            .call(Some(&self.session), method, params, CALL_TIMEOUT)
    }

    /// Loads `url` and waits up to [`LOAD_TIMEOUT`] until the new document has loaded.
    pub fn navigate(&self, url: &str) -> Result<()> {
        // A marker on the old document tells it apart from the new one, whose load is awaited.
        const MARKER: &str = "__vgpuPreviousDocument";
        self.evaluate(&format!("window.{MARKER} = true"))?;
        let answer = self.call("Page.navigate", json!({"url": url}))?;
        if let Some(why) = answer["errorText"].as_str().filter(|t| !t.is_empty()) {
            return Err(BrowserError::Navigation {
                url: url.to_owned(),
                why: why.to_owned(),
            });
        }
        self.wait_for(
            &format!("!window.{MARKER} && document.readyState === 'complete'"),
            LOAD_TIMEOUT,
        )
        .map(drop)
    }

    /// Evaluates the JavaScript `expression` in the page (awaiting it if it is a promise) and
    /// returns its value as JSON (`null` for `undefined`).
    pub fn evaluate(&self, expression: &str) -> Result<Value> {
        let answer = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        )?;
        if let Some(details) = answer.get("exceptionDetails") {
            let text = details["exception"]["description"]
                .as_str()
                .or_else(|| details["text"].as_str())
                .map_or_else(|| details.to_string(), str::to_owned);
            return Err(BrowserError::Script {
                expression: expression.to_owned(),
                details: text,
            });
        }
        Ok(answer["result"]
            .get("value")
            .cloned()
            .unwrap_or(Value::Null))
    }

    /// Evaluates `predicate` every 100 ms until its value is truthy and returns that value;
    /// a predicate that throws is retried. Fails after `timeout` with the last value or
    /// exception.
    pub fn wait_for(&self, predicate: &str, timeout: Duration) -> Result<Value> {
        let start = Instant::now();
        loop {
            let last = match self.evaluate(predicate) {
                Ok(value) if truthy(&value) => return Ok(value),
                Ok(value) => format!("it was {value}"),
                Err(e @ BrowserError::Script { .. }) => e.to_string(),
                Err(e) => return Err(e),
            };
            if start.elapsed() >= timeout {
                return Err(BrowserError::Timeout {
                    what: format!("`{predicate}` (last: {last})"),
                    after: timeout,
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// A PNG screenshot of the page's viewport ([`VIEWPORT`]).
    pub fn screenshot(&self) -> Result<Vec<u8>> {
        self.capture(json!({"format": "png"}))
    }

    /// A PNG screenshot of the whole page: [`VIEWPORT`]'s width (or the page's, if wider) and
    /// the page's height, up to [`MAX_SCREENSHOT_EDGE`] pixels either way.
    pub fn screenshot_full_page(&self) -> Result<Vec<u8>> {
        let metrics = self.call("Page.getLayoutMetrics", json!({}))?;
        let size = &metrics["cssContentSize"];
        let edge = |key: &str| {
            size[key]
                .as_f64()
                .filter(|v| v.is_finite() && *v >= 1.0)
                .map(|v| v.ceil().min(f64::from(MAX_SCREENSHOT_EDGE)))
                .ok_or_else(|| BrowserError::Protocol(format!("layout metrics: {metrics}")))
        };
        let clip = json!({"x": 0, "y": 0, "width": edge("width")?, "height": edge("height")?,
                          "scale": 1});
        self.capture(json!({"format": "png", "captureBeyondViewport": true, "clip": clip}))
    }

    fn capture(&self, params: Value) -> Result<Vec<u8>> {
        let answer = self.call("Page.captureScreenshot", params)?;
        let data = answer["data"].as_str().ok_or_else(|| {
            BrowserError::Protocol("captureScreenshot answered without data".into())
        })?;
        base64_decode(data).ok_or(BrowserError::Base64)
    }
}

/// A decoded 8-bit RGB or RGBA image (a screenshot).
#[derive(Debug)]
pub struct Image {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Samples per pixel (3 or 4).
    channels: usize,
    /// Row-major samples.
    pixels: Vec<u8>,
}

impl Image {
    /// Decodes a PNG as Chromium writes them (8-bit RGB or RGBA).
    pub fn decode(png_bytes: &[u8]) -> Result<Image> {
        let bad = |e: &dyn std::fmt::Display| BrowserError::Png(e.to_string());
        let mut reader = png::Decoder::new(std::io::Cursor::new(png_bytes))
            .read_info()
            .map_err(|e| bad(&e))?;
        let size = reader
            .output_buffer_size()
            .ok_or_else(|| bad(&"image too large"))?;
        let mut pixels = vec![0; size];
        let frame = reader.next_frame(&mut pixels).map_err(|e| bad(&e))?;
        let channels = match (frame.color_type, frame.bit_depth) {
            (png::ColorType::Rgb, png::BitDepth::Eight) => 3,
            (png::ColorType::Rgba, png::BitDepth::Eight) => 4,
            other => return Err(bad(&format_args!("unexpected PNG format {other:?}"))),
        };
        pixels.truncate(frame.buffer_size());
        Ok(Image {
            width: frame.width,
            height: frame.height,
            channels,
            pixels,
        })
    }

    /// The colour at (`x`, `y`), which must be inside the image.
    pub fn rgb(&self, x: u32, y: u32) -> [u8; 3] {
        assert!(
            x < self.width && y < self.height,
            "({x}, {y}) outside the image"
        );
        let i = (y as usize * self.width as usize + x as usize) * self.channels;
        [self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]]
    }

    /// How many distinct colours the image holds.
    pub fn distinct_colours(&self) -> usize {
        let colours: std::collections::HashSet<&[u8]> = self
            .pixels
            .chunks_exact(self.channels)
            .map(|p| &p[..3])
            .collect();
        colours.len()
    }

    /// How many pixels of the rectangle `x, y, width, height` (clipped to the image) are
    /// within `tolerance` of `colour` in each channel.
    pub fn count_near(
        &self,
        [x, y, width, height]: [u32; 4],
        colour: [u8; 3],
        tolerance: u8,
    ) -> usize {
        let x_end = x.saturating_add(width).min(self.width);
        let y_end = y.saturating_add(height).min(self.height);
        (y.min(y_end)..y_end)
            .flat_map(|py| (x.min(x_end)..x_end).map(move |px| (px, py)))
            .filter(|&(px, py)| {
                self.rgb(px, py)
                    .iter()
                    .zip(colour)
                    .all(|(a, b)| a.abs_diff(b) <= tolerance)
            })
            .count()
    }
}

/// JavaScript's truthiness of a JSON value.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0 && !f.is_nan()),
        Value::String(s) => !s.is_empty(),
        Value::Array(_) | Value::Object(_) => true,
    }
}

/// A one-line description of an event worth showing when a test fails (console output,
/// exceptions, crashes, detaches), `None` for the others.
fn describe_event(message: &Value) -> Option<String> {
    let params = &message["params"];
    match message["method"].as_str()? {
        "Runtime.consoleAPICalled" => {
            let args: Vec<String> = params["args"]
                .as_array()
                .map(|args| {
                    args.iter()
                        .map(|a| {
                            a.get("value").map_or_else(
                                || a["description"].as_str().unwrap_or("?").to_owned(),
                                |v| v.as_str().map_or_else(|| v.to_string(), str::to_owned),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            Some(format!(
                "console.{}: {}",
                params["type"].as_str().unwrap_or("?"),
                args.join(" ")
            ))
        }
        "Runtime.exceptionThrown" => {
            let details = &params["exceptionDetails"];
            Some(format!(
                "exception: {} {}",
                details["text"].as_str().unwrap_or_default(),
                details["exception"]["description"]
                    .as_str()
                    .unwrap_or_default()
            ))
        }
        method @ ("Target.targetCrashed"
        | "Inspector.targetCrashed"
        | "Target.detachedFromTarget") => Some(format!("{method} {params}")),
        _ => None,
    }
}

/// A pipe whose both ends close on exec: (read end, write end).
fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    if rc != 0 {
        return Err(io("creating a pipe")(std::io::Error::last_os_error()));
    }
    // SAFETY: pipe2 succeeded, so both fds are open and owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// In the forked child: makes each `(source, target)` fd pair's source available as `target`,
/// inheritable across exec. The sources are first copied to fds of at least
/// [`SCRATCH_FD_MIN`] (closed on exec) so that installing one target cannot overwrite another
/// pair's source. Only fcntl and dup2, which are async-signal-safe.
fn install_fds(pairs: &[(RawFd, RawFd); 2]) -> std::io::Result<()> {
    let mut scratch = [0; 2];
    for (copy, (source, _)) in scratch.iter_mut().zip(pairs) {
        // SAFETY: fcntl with F_DUPFD_CLOEXEC only reads `source`, which is open in the child
        // (inherited from the parent, where the caller keeps it open across the spawn).
        *copy = unsafe { libc::fcntl(*source, libc::F_DUPFD_CLOEXEC, SCRATCH_FD_MIN) };
        if *copy < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    for (copy, (_, target)) in scratch.iter().zip(pairs) {
        // SAFETY: dup2 of an open fd onto a small fixed number; whatever the child had there
        // (an inherited fd it does not use) is closed, and the copy is inheritable.
        if unsafe { libc::dup2(*copy, *target) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Starts the thread that splits what the browser writes into NUL-terminated JSON messages
/// and sends them on the returned channel (an `Err` for a message too long or not JSON, after
/// which it stops). It ends when the browser closes the pipe or the receiver is dropped.
fn spawn_reader(mut pipe: File) -> Result<Receiver<std::result::Result<Value, String>>> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("cdp-reader".into())
        .spawn(move || {
            let mut pending = Vec::new();
            let mut chunk = vec![0; 64 * 1024];
            loop {
                let n = match pipe.read(&mut chunk) {
                    Ok(0) => return,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        log::warn!("reading from the browser: {e}");
                        return;
                    }
                };
                pending.extend_from_slice(&chunk[..n]);
                while let Some(end) = pending.iter().position(|&b| b == 0) {
                    let message = serde_json::from_slice::<Value>(&pending[..end])
                        .map_err(|e| format!("a message that is not JSON: {e}"));
                    pending.drain(..=end);
                    let failed = message.is_err();
                    if tx.send(message).is_err() || failed {
                        return;
                    }
                }
                if pending.len() > MAX_MESSAGE_BYTES {
                    let _ = tx.send(Err(format!(
                        "a message longer than {MAX_MESSAGE_BYTES} bytes"
                    )));
                    return;
                }
            }
        })
        .map_err(io("starting the CDP reader thread"))?;
    Ok(rx)
}

/// Decodes standard padded base64 (RFC 4648, as CDP sends binary data); `None` if `text` is
/// not that.
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        Some(u32::from(v))
    }
    let bytes = text.as_bytes();
    if bytes.len() % 4 != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    let quads = bytes.chunks_exact(4);
    let last = quads.len().checked_sub(1);
    for (i, quad) in quads.enumerate() {
        let padding = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if padding > 2 || (padding > 0 && Some(i) != last) {
            return None;
        }
        let mut word = 0u32;
        for &c in &quad[..4 - padding] {
            word = word << 6 | value(c)?;
        }
        word <<= 6 * padding as u32;
        let decoded = word.to_be_bytes();
        out.extend_from_slice(&decoded[1..4 - padding]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest::base64;

    /// A page that draws a red and a blue square on a canvas and sets a flag later.
    const PAGE: &str = "<!doctype html><body style='margin:0;background:#fff'>\
        <canvas id=c width=200 height=100 style='display:block'></canvas>\
        <div style='height:1400px'></div><script>\
        const g = document.getElementById('c').getContext('2d');\
        g.fillStyle = '#ff0000'; g.fillRect(0, 0, 100, 100);\
        g.fillStyle = '#0000ff'; g.fillRect(100, 0, 100, 100);\
        setTimeout(() => { window.later = 'done'; }, 300);\
        console.log('drawn');\
        </script></body>";

    #[test]
    fn drives_a_data_url_page() {
        let browser = Browser::launch().unwrap_or_else(|e| panic!("{e}"));
        let page = browser.new_page().expect("new page");
        page.navigate(&format!("data:text/html,{}", PAGE.replace('#', "%23")))
            .expect("navigate");
        assert_eq!(page.evaluate("1 + 2").unwrap(), json!(3));
        assert_eq!(
            page.evaluate("Promise.resolve({a: [1, 'x']})").unwrap(),
            json!({"a": [1, "x"]})
        );
        assert_eq!(page.evaluate("undefined").unwrap(), Value::Null);
        let err = page.evaluate("null.x").unwrap_err();
        assert!(matches!(err, BrowserError::Script { .. }), "{err}");
        assert_eq!(
            page.wait_for("window.later", Duration::from_secs(10))
                .unwrap(),
            json!("done")
        );
        let err = page
            .wait_for("window.never", Duration::from_millis(300))
            .unwrap_err();
        assert!(matches!(err, BrowserError::Timeout { .. }), "{err}");
        let err = browser
            .call(None, "No.suchMethod", json!({}), CALL_TIMEOUT)
            .unwrap_err();
        assert!(matches!(err, BrowserError::Command { .. }), "{err}");
        let dpr = page.evaluate("window.devicePixelRatio").unwrap();
        assert_eq!(dpr, json!(1), "device pixel ratio");
        let shot = Image::decode(&page.screenshot().expect("screenshot")).unwrap();
        assert_eq!((shot.width, shot.height), VIEWPORT);
        assert_eq!(shot.rgb(50, 50), [255, 0, 0], "red square");
        assert_eq!(shot.rgb(150, 50), [0, 0, 255], "blue square");
        assert_eq!(shot.rgb(400, 400), [255, 255, 255], "background");
        assert_eq!(shot.distinct_colours(), 3);
        let squares = [0, 0, 200, 100];
        assert_eq!(shot.count_near(squares, [250, 5, 0], 5), 100 * 100);
        assert_eq!(shot.count_near(squares, [250, 5, 0], 4), 0);
        assert_eq!(
            shot.count_near([150, 50, 10_000, 10_000], [0, 0, 255], 0),
            50 * 50
        );
        let full = Image::decode(&page.screenshot_full_page().expect("full page")).unwrap();
        assert_eq!(
            (full.width, full.height),
            (VIEWPORT.0, 1500),
            "canvas and div"
        );
        assert_eq!(full.rgb(50, 50), [255, 0, 0], "from the top");
        assert!(matches!(
            Image::decode(b"not a png"),
            Err(BrowserError::Png(_))
        ));
        assert!(
            browser.events().iter().any(|e| e == "console.log: drawn"),
            "{:?}",
            browser.events()
        );
    }

    #[test]
    fn base64_decodes_what_the_encoder_writes_and_refuses_garbage() {
        for input in [&b""[..], b"f", b"fo", b"foo", b"foob", b"fooba", b"foobar"] {
            assert_eq!(base64_decode(&base64(input)).as_deref(), Some(input));
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(base64_decode(&base64(&all)), Some(all));
        for bad in ["Zg", "Zg=", "Z===", "Zg==Zg==", "Zm9v!A==", "Zm 9"] {
            assert_eq!(base64_decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn truthiness_follows_javascript() {
        for falsy in [json!(null), json!(false), json!(0), json!(0.0), json!("")] {
            assert!(!truthy(&falsy), "{falsy}");
        }
        for yes in [json!(true), json!(1), json!("x"), json!([]), json!({})] {
            assert!(truthy(&yes), "{yes}");
        }
    }

    #[test]
    fn events_worth_reporting_are_described() {
        let console = json!({"method": "Runtime.consoleAPICalled", "params": {
            "type": "log", "args": [{"type": "string", "value": "hello"}, {"type": "number", "value": 2}]}});
        assert_eq!(
            describe_event(&console).as_deref(),
            Some("console.log: hello 2")
        );
        let thrown = json!({"method": "Runtime.exceptionThrown", "params": {"exceptionDetails": {
            "text": "Uncaught", "exception": {"description": "Error: boom"}}}});
        assert_eq!(
            describe_event(&thrown).as_deref(),
            Some("exception: Uncaught Error: boom")
        );
        assert_eq!(
            describe_event(&json!({"method": "Page.frameNavigated"})),
            None
        );
        assert_eq!(describe_event(&json!({"id": 3, "result": {}})), None);
    }
}
