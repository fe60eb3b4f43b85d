//! The daemon's web dashboard in a real headless Chromium while two VMs run load.
//!
//! Setup: one `vgpu-schedd` (simulated engine, no policy at first) with its loopback HTTP
//! listener (`--http`) on a free port, and two qtest load guests (`LoadVm`: a qtest QEMU without a guest OS whose
//! harness driver submits fenced OCCUPY + END_FRAME groups through the real vfio-user path to
//! a `vgpu-server` that asks the daemon). That is the cheapest setup in which everything the
//! page shows comes from the real path: no guest kernel to boot, yet real device processes,
//! real scheduling and real frames; each guest is driven by a host thread in a bounded loop.
//!
//! The page's address with its token comes from the control socket (`{"cmd":"dashboard"}`).
//! In the browser: the event stream goes `live` and both VMs get a row; the GPU share chart is
//! drawn and changes over time; fair queuing chosen in the policy selector and a VM's weight
//! and priority set through its row's inputs and apply button reach the daemon (checked with
//! the control socket's `list`), and the table then shows that VM's share pulling away from
//! the other's; a VM's focus button is accepted; a POST from the page without the token, or with a wrong one, is
//! refused with 403 and changes nothing. A screenshot is saved to
//! `<target>/vgpu-dashboard/dashboard.png` and inspected: its size, that it is not uniform,
//! and that the GPU share chart's region holds pixels of both VMs' series colours (read from
//! the page's own swatches).
//!
//! Chromium is required: without it the test fails, naming the Debian package.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vgpu_guest_drivers::virtio_gpu::{LOAD_OP_END_FRAME, LOAD_OP_OCCUPY};
use vgpu_tests::browser::{Browser, Image, Page, VIEWPORT};
use vgpu_tests::daemon::{CTL_TIMEOUT, Schedd, find_vm};
use vgpu_tests::load_vm::{self, LoadVm};
use vgpu_tests::skip_without_qemu;

/// The two VMs.
const VMS: [&str; 2] = ["a", "b"];
/// GPU time of one frame's group, µs: two backlogged VMs keep the engine busy.
const FRAME_US: u64 = 4000;
/// Frames each guest keeps queued: 32 ms of engine time, so that a VM's queue does not run
/// dry (and its share drop) while its qtest driver, QEMU and device process wait for a CPU on
/// a host whose cores are busy with other work too; one request each, well within the queue.
const DEPTH: usize = 8;
/// Longest the load runs if the test does not stop it first (it takes about half a minute).
const MAX_LOAD: Duration = Duration::from_secs(180);
/// Longest wait for the page to connect and show both VMs, or for a POST's outcome (or for
/// the shares to move apart after it), with room for a host whose cores are busy.
const PAGE_TIMEOUT: Duration = Duration::from_secs(40);
/// Longest wait for the share chart to change (the daemon publishes about once a second).
const CHART_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the page shows the two VMs' shares apart before the screenshot, so that each
/// series is a line of its own (the time axis spans 5 minutes: 2 px a second).
const SPLIT_BEFORE_SCREENSHOT: Duration = Duration::from_secs(8);
/// VM a's parameters set through the page; b keeps the default weight (256), so under fair
/// queuing a gets about three quarters of the GPU.
const PRIORITY_A: u32 = 7;
const WEIGHT_A: u32 = 768;
/// How many percentage points a's share must exceed b's by on the page (75 against 25
/// expected).
const SHARE_GAP: u32 = 20;
/// How close (per channel) a screenshot pixel must be to a series colour to count as one: the
/// lines are 2 px wide and antialiased, so their middle pixels have the colour itself.
const COLOUR_TOLERANCE: u8 = 10;
/// Pixels of each VM's colour the share chart must hold at least: the seconds before the
/// screenshot draw a 2 px line a few dozen pixels long.
const MIN_SERIES_PIXELS: usize = 20;
/// Distinct colours the screenshot must hold at least: text, charts and controls give
/// hundreds; a blank or error page a handful.
const MIN_COLOURS: usize = 32;

/// Sends one request to the daemon's control socket and returns its `ok` result.
fn control(daemon: &Schedd, request: &Value) -> Value {
    let stream = UnixStream::connect(daemon.control()).expect("control socket");
    stream.set_read_timeout(Some(CTL_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(CTL_TIMEOUT)).unwrap();
    writeln!(&stream, "{request}").expect("control request sent");
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .expect("control answer");
    let answer: Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("{request}: answer {line:?} is not JSON: {e}"));
    match answer.get("ok") {
        Some(result) => result.clone(),
        None => panic!("{request}: {answer}"),
    }
}

/// The guests' load: a host thread per VM keeps it loaded with frames until stopped (or until
/// [`MAX_LOAD`] passes), then drains. Stopped and joined on drop, before the daemon goes.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<LoadVm>>,
}

impl Load {
    fn start(vms: Vec<LoadVm>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = vms
            .into_iter()
            .map(|mut vm| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let start = Instant::now();
                    while !stop.load(Ordering::Relaxed) && start.elapsed() < MAX_LOAD {
                        while vm.pending() < DEPTH {
                            vm.submit(&[(LOAD_OP_OCCUPY, 0, FRAME_US), (LOAD_OP_END_FRAME, 0, 0)]);
                        }
                        if vm.wait_one(load_vm::TIMEOUT).is_none() {
                            panic!("{}: stalled:\n{}", vm.name, vm.server.log());
                        }
                    }
                    vm.drain();
                    vm
                })
            })
            .collect();
        Load { stop, threads }
    }

    /// Stops the load and waits for the guests to drain; panics if a guest stalled.
    fn finish(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let joined = thread.join();
            if !std::thread::panicking() {
                joined.expect("a load thread");
            }
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Where the screenshot goes: `<target>/vgpu-dashboard/dashboard.png`, beside the test
/// executable's `<target>/<profile>/deps/`.
fn screenshot_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let target = exe
        .ancestors()
        .find(|d| d.file_name().is_some_and(|n| n == "deps"))
        .and_then(|deps| deps.parent()?.parent())
        .expect("the test runs from <target>/<profile>/deps");
    target.join("vgpu-dashboard").join("dashboard.png")
}

/// A JavaScript string literal of `text`.
fn js(text: &str) -> String {
    Value::from(text).to_string()
}

/// The row of VM `vm` in the page, as a JavaScript expression.
fn row(vm: &str) -> String {
    format!(
        "document.querySelector('#vms tr[data-vm=' + {} + ']')",
        js(vm)
    )
}

/// Runs `action` (JavaScript that makes the page POST) after marking `#last-result`, and
/// waits for the page to show the POST's outcome; returns it.
fn post_through_page(page: &Page<'_>, action: &str) -> String {
    page.evaluate(&format!(
        "document.getElementById('last-result').textContent = 'pending'; {action}; true"
    ))
    .expect("action runs");
    page.wait_for(
        "(t => t !== 'pending' && t)(document.getElementById('last-result').textContent.trim())",
        PAGE_TIMEOUT,
    )
    .expect("the page shows the outcome")
    .as_str()
    .unwrap_or_default()
    .to_owned()
}

/// `rgb(r, g, b)` (a computed CSS colour) as bytes.
fn parse_rgb(css: &str) -> [u8; 3] {
    let inner = css
        .trim()
        .strip_prefix("rgb(")
        .and_then(|s| s.strip_suffix(')'))
        .unwrap_or_else(|| panic!("not an rgb() colour: {css:?}"));
    let channels: Vec<u8> = inner
        .split(',')
        .map(|c| c.trim().parse().expect("a channel"))
        .collect();
    channels
        .try_into()
        .unwrap_or_else(|_| panic!("not three channels: {css:?}"))
}

#[test]
fn dashboard_in_chromium_while_two_vms_run() {
    if skip_without_qemu() {
        return;
    }
    let started = Instant::now();
    // First, so that a missing Chromium fails before anything else is set up.
    let browser = Browser::launch().unwrap_or_else(|e| panic!("{e}"));
    let daemon = Schedd::start_with(None, "info", &["--http", "127.0.0.1:0"]).expect("daemon");
    let mut vms = Vec::new();
    for name in VMS {
        match LoadVm::start(&daemon, name) {
            Some(vm) => vms.push(vm),
            // LoadVm::start printed why (no virglrenderer), or failed if it is required.
            None => return,
        }
    }
    let mut load = Load::start(vms);

    let dashboard = control(&daemon, &json!({"cmd": "dashboard"}));
    let url = dashboard["url"].as_str().expect("a url").to_owned();
    let (origin, token) = url
        .split_once("/#token=")
        .unwrap_or_else(|| panic!("the url has no token fragment: {url}"));
    assert!(
        origin.starts_with("http://127.0.0.1:") && !token.is_empty(),
        "{url}"
    );

    let page = browser.new_page().expect("new page");
    page.navigate(&url).expect("the dashboard loads");
    let both_rows = VMS
        .iter()
        .map(|vm| format!("!!{}", row(vm)))
        .collect::<Vec<_>>()
        .join(" && ");
    page.wait_for(
        &format!("document.getElementById('status').textContent.trim() === 'live' && {both_rows}"),
        PAGE_TIMEOUT,
    )
    .expect("the page goes live with both VMs");
    // Both VMs' load shows in their rows.
    for vm in VMS {
        page.wait_for(
            &format!(
                "parseFloat({}.querySelector('td.share').textContent) > 5",
                row(vm)
            ),
            PAGE_TIMEOUT,
        )
        .unwrap_or_else(|e| panic!("VM {vm} gets no share in the table: {e}"));
    }

    // The share chart is drawn and moves.
    let chart = "document.getElementById('chart-share')";
    let drawn = page
        .evaluate(&format!(
            "(c => {{ const blank = document.createElement('canvas'); \
             blank.width = c.width; blank.height = c.height; \
             window.__shareBefore = c.toDataURL(); \
             return c.width > 0 && c.height > 0 && window.__shareBefore !== blank.toDataURL(); }})({chart})"
        ))
        .unwrap();
    assert_eq!(drawn, json!(true), "the share chart is blank");
    page.wait_for(
        &format!("{chart}.toDataURL() !== window.__shareBefore"),
        CHART_TIMEOUT,
    )
    .expect("the share chart changes");

    // A policy through the selector: fair queuing, from the policies the page offers.
    let policies = page
        .evaluate("fetch('/api/policies').then(r => r.json())")
        .expect("the policy list");
    let (index, fair) = policies
        .as_array()
        .expect("a list of policies")
        .iter()
        .enumerate()
        .find(|(_, p)| p["config"]["policy"] == "fair")
        .unwrap_or_else(|| panic!("fair queuing is not offered: {policies}"));
    let answer = post_through_page(
        &page,
        &format!(
            "const s = document.getElementById('policy-select'); s.value = {}; \
             s.dispatchEvent(new Event('change')); \
             document.getElementById('policy-apply').click()",
            js(&index.to_string())
        ),
    );
    assert_eq!(answer, "ok", "switching to {fair} through the page");
    let list = control(&daemon, &json!({"cmd": "list"}));
    assert_eq!(list["policy"], fair["config"], "the daemon's policy");

    // A VM's parameters through its row: a gets three times b's (default) weight.
    let answer = post_through_page(
        &page,
        &format!(
            "const r = {}; \
             for (const [k, v] of [['priority', '{PRIORITY_A}'], ['weight', '{WEIGHT_A}']]) {{ \
               const i = r.querySelector('[data-param=' + k + ']'); \
               i.value = v; i.dispatchEvent(new Event('input')); }} \
             r.querySelector('[data-action=apply]').click()",
            row("a")
        ),
    );
    assert_eq!(answer, "ok", "setting a's parameters through the page");
    let a = find_vm(&control(&daemon, &json!({"cmd": "list"})), "a");
    assert_eq!(a["params"]["priority"], PRIORITY_A, "{a}");
    assert_eq!(a["params"]["weight"], WEIGHT_A, "{a}");
    // The page shows its effect: a's share pulls away from b's.
    let share = |vm| {
        format!(
            "parseFloat({}.querySelector('td.share').textContent)",
            row(vm)
        )
    };
    page.wait_for(
        &format!("{} > {} + {SHARE_GAP}", share("a"), share("b")),
        PAGE_TIMEOUT,
    )
    .expect("a's share exceeds b's in the table");
    let split = Instant::now();
    // Focus: the daemon accepts it for a connected VM (what it changes is the policy's
    // business: TimeGraph's wildcard spec lines only).
    let answer = post_through_page(
        &page,
        &format!("{}.querySelector('[data-action=focus]').click()", row("b")),
    );
    assert_eq!(answer, "ok", "focusing b through the page");

    // Without the token, or with a wrong one, a POST from the page is refused.
    for headers in ["{}", "{'X-Vgpu-Token': 'not-the-token'}"] {
        let status = page
            .evaluate(&format!(
                "fetch('/api/params', {{method: 'POST', \
                 headers: Object.assign({{'Content-Type': 'application/json'}}, {headers}), \
                 body: JSON.stringify({{vm: 'a', params: {{priority: 1}}}})}}).then(r => r.status)"
            ))
            .expect("the POST is answered");
        assert_eq!(status, json!(403), "POST with headers {headers}");
    }
    let a = find_vm(&control(&daemon, &json!({"cmd": "list"})), "a");
    assert_eq!(
        a["params"]["priority"], PRIORITY_A,
        "a refused POST changed {a}"
    );

    // The screenshot, once the chart shows the two shares apart for a few seconds.
    std::thread::sleep(SPLIT_BEFORE_SCREENSHOT.saturating_sub(split.elapsed()));
    let png = page.screenshot_full_page().expect("screenshot");
    let path = screenshot_path();
    std::fs::create_dir_all(path.parent().unwrap()).expect("screenshot directory");
    std::fs::write(&path, &png).expect("screenshot written");
    eprintln!("dashboard screenshot: {}", path.display());

    let image = Image::decode(&png).expect("the screenshot decodes");
    let height = page
        .evaluate("document.documentElement.scrollHeight")
        .unwrap();
    assert_eq!(
        (image.width, u64::from(image.height)),
        (VIEWPORT.0, height.as_u64().expect("a height")),
        "the whole page"
    );
    let colours = image.distinct_colours();
    assert!(
        colours > MIN_COLOURS,
        "the screenshot has {colours} colours"
    );
    let rect = page
        .evaluate(&format!(
            "(r => [r.left + scrollX, r.top + scrollY, r.width, r.height].map(Math.round))\
             ({chart}.getBoundingClientRect())"
        ))
        .unwrap();
    let region: Vec<u32> = rect
        .as_array()
        .and_then(|r| r.iter().map(|v| u32::try_from(v.as_i64()?).ok()).collect())
        .unwrap_or_else(|| panic!("the share chart is not on the page: {rect}"));
    let region: [u32; 4] = region.try_into().unwrap();
    let mut series = Vec::new();
    for vm in VMS {
        let css = page
            .evaluate(&format!(
                "getComputedStyle({}.querySelector('td.name i')).backgroundColor",
                row(vm)
            ))
            .unwrap();
        let colour = parse_rgb(css.as_str().expect("a CSS colour"));
        let n = image.count_near(region, colour, COLOUR_TOLERANCE);
        eprintln!("VM {vm}: series colour {colour:?}, {n} pixels in the share chart");
        assert!(
            n >= MIN_SERIES_PIXELS,
            "VM {vm}'s series colour {colour:?} has {n} pixels in the share chart {region:?} \
             of {}",
            path.display()
        );
        series.push(colour);
    }
    assert_ne!(series[0], series[1], "both VMs drawn in one colour");

    load.finish();
    eprintln!("dashboard test took {:?}", started.elapsed());
}
