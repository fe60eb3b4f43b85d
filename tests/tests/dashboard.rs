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
//! A second test needs no QEMU: two fake devices (threads of the test speaking the daemon's
//! device protocol) keep the daemon busy while the page, in a 1280x800 window, edits a VM's
//! reserve and another's SLO (accepted, and refused with the daemon's words), shows changes
//! made with `vgpuctl` under "Last change", fits the window's width, and is saved as a
//! screenshot (`$CARGO_TARGET_TMPDIR/dashboard-1280.png`, its path printed).
//!
//! Chromium is required: without it the tests fail, naming the Debian package.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vgpu_guest_drivers::virtio_gpu::{LOAD_OP_END_FRAME, LOAD_OP_OCCUPY};
use vgpu_schedd::proto::{self, Exec, MAX_MESSAGE_BYTES, Msg, PROTOCOL_VERSION, VmName};
use vgpu_schedd::seqpacket::{SeqStream, monotonic_ns};
use vgpu_scheduler::{CostSignature, GroupId, GroupKind};
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

/// Waits until `page` is live and shows a row for each of [`VMS`].
fn wait_live_with_both_vms(page: &Page<'_>) {
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
}

/// Runs `action` (JavaScript that makes the page POST, in a block of its own) after clearing
/// `#last-result`, and
/// waits for the page to show the POST's outcome (`ok` or `refused: why`); returns it.
fn post_through_page(page: &Page<'_>, action: &str) -> String {
    page.evaluate(&format!(
        "document.getElementById('last-result').replaceChildren(); {{ {action}; }} true"
    ))
    .expect("action runs");
    page.wait_for(
        "(o => o && o.textContent.trim())(document.querySelector('#last-result .outcome'))",
        PAGE_TIMEOUT,
    )
    .expect("the page shows the outcome")
    .as_str()
    .unwrap_or_default()
    .to_owned()
}

/// Sets the inputs `fields` (`[(param, value)]`) of VM `vm`'s row as a user types them and
/// applies them through the page; returns the outcome it shows.
fn set_through_page(page: &Page<'_>, vm: &str, fields: &[(&str, &str)]) -> String {
    let fields = Value::from(
        fields
            .iter()
            .map(|(k, v)| json!([k, v]))
            .collect::<Vec<_>>(),
    );
    post_through_page(
        page,
        &format!(
            "const r = {}; \
             for (const [k, v] of {fields}) {{ \
               const i = r.querySelector('[data-param=' + k + ']'); \
               i.value = v; i.dispatchEvent(new Event('input')); }} \
             r.querySelector('[data-action=apply]').click()",
            row(vm)
        ),
    )
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
    wait_live_with_both_vms(&page);
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
    let answer = set_through_page(
        &page,
        "a",
        &[
            ("priority", &PRIORITY_A.to_string()),
            ("weight", &WEIGHT_A.to_string()),
        ],
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

/// The window of the second test: a common laptop screen.
const WINDOW: (u32, u32) = (1280, 800);
/// GPU time of one group of each fake VM, ms: different, so that their lines differ.
const FAKE_GROUP_MS: [u64; 2] = [3, 1];
/// How long a fake device waits for the daemon's message before it looks at its stop flag.
const FAKE_POLL: Duration = Duration::from_millis(100);
/// How long the devices run before the screenshot, so that the charts have lines (a third
/// of the young daemon's one-minute time axis).
const CHART_BEFORE_SCREENSHOT: Duration = Duration::from_secs(20);

/// A fake device of VM `name` on the daemon's device socket, on a thread: it submits a
/// present group, and when granted "runs" it for `group` (a sleep), completes it and presents
/// a frame, until dropped.
struct FakeDevice {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeDevice {
    fn start(daemon: &Schedd, name: &str, group: Duration) -> FakeDevice {
        let s = SeqStream::connect(&daemon.socket()).expect("the device socket");
        s.set_read_timeout(Some(FAKE_POLL)).unwrap();
        let hello = Msg::Hello {
            version: PROTOCOL_VERSION,
            vm_name: VmName::new(name).unwrap(),
            device_pid: std::process::id(),
            qemu_pid: 0,
        };
        fake_send(&s, &hello);
        assert!(
            matches!(fake_recv(&s), Some(Msg::Welcome { .. })),
            "{name} is not welcomed"
        );
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut id = 0u64;
            let mut waiting = false;
            while !flag.load(Ordering::Relaxed) {
                if !waiting {
                    id += 1;
                    let submit = Msg::Submit {
                        group: GroupId(id),
                        context: 0,
                        kind: GroupKind::Present,
                        signature: CostSignature(1),
                        cost_ns: 0,
                        exec: Exec::Device,
                    };
                    fake_send(&s, &submit);
                    waiting = true;
                }
                if let Some(Msg::Grant { group: granted }) = fake_recv(&s) {
                    let start = monotonic_ns();
                    std::thread::sleep(group);
                    let finish = monotonic_ns();
                    let done = Msg::Completed {
                        group: granted,
                        start,
                        finish,
                    };
                    fake_send(&s, &done);
                    fake_send(&s, &Msg::Frame);
                    waiting = false;
                }
            }
        });
        FakeDevice {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for FakeDevice {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn fake_send(s: &SeqStream, m: &Msg) {
    let mut b = Vec::new();
    proto::encode(m, &mut b);
    // A daemon that went away ends the test elsewhere.
    let _ = s.send(&b);
}

/// The daemon's next message, `None` after [`FAKE_POLL`].
fn fake_recv(s: &SeqStream) -> Option<Msg> {
    let mut buf = vec![0u8; MAX_MESSAGE_BYTES + 1];
    let n = s.recv(&mut buf).ok()??;
    proto::decode(buf.get(..n)?).ok()
}

/// The text of `selector` inside `#last-result`, as a JavaScript expression.
fn last(selector: &str) -> String {
    format!(
        "(e => e ? e.textContent.trim() : '')(document.querySelector('#last-result {selector}'))"
    )
}

#[test]
fn dashboard_edits_reserve_and_slo_and_shows_cli_changes_at_1280() {
    let started = Instant::now();
    let browser = Browser::launch().unwrap_or_else(|e| panic!("{e}"));
    let daemon = Schedd::start_with(None, "info", &["--http", "127.0.0.1:0"]).expect("daemon");
    let _devices: Vec<FakeDevice> = VMS
        .iter()
        .zip(FAKE_GROUP_MS)
        .map(|(vm, ms)| FakeDevice::start(&daemon, vm, Duration::from_millis(ms)))
        .collect();
    let load_started = Instant::now();
    let url = control(&daemon, &json!({"cmd": "dashboard"}))["url"]
        .as_str()
        .expect("a url")
        .to_owned();

    let page = browser.new_page().expect("new page");
    page.call(
        "Emulation.setDeviceMetricsOverride",
        json!({"width": WINDOW.0, "height": WINDOW.1, "deviceScaleFactor": 1, "mobile": false}),
    )
    .expect("the window's size");
    page.navigate(&url).expect("the dashboard loads");
    wait_live_with_both_vms(&page);

    // A policy installed with vgpuctl shows as the last change, with who made it.
    let file = daemon
        .write("timegraph.toml", "policy = \"timegraph\"\n")
        .expect("policy file");
    daemon
        .ctl(&["set-policy", file.to_str().unwrap()])
        .expect("vgpuctl set-policy");
    let what = page
        .wait_for(
            &format!("(w => w.startsWith('set-policy') && w)({})", last(".what")),
            PAGE_TIMEOUT,
        )
        .expect("the CLI's policy change shows");
    assert_eq!(what, "set-policy timegraph (ht)");
    let by = page.evaluate(&last(".by")).unwrap();
    assert!(
        by.as_str()
            .is_some_and(|b| b.starts_with("by control socket, uid ")),
        "{by}"
    );
    assert_eq!(page.evaluate(&last(".outcome")).unwrap(), "ok");
    // The policy panel is a table with units.
    page.wait_for(
        "[...document.querySelectorAll('#policy-params tbody tr')].some(r => \
         r.cells[0].textContent === 'ht_lease' && r.cells[1].textContent === 'on')",
        PAGE_TIMEOUT,
    )
    .expect("the policy table shows TimeGraph's parameters");

    // A reserve through the page, in vgpuctl set's words.
    assert_eq!(
        set_through_page(&page, "a", &[("reserve", "2000/10000/pe")]),
        "ok"
    );
    let a = find_vm(&control(&daemon, &json!({"cmd": "list"})), "a");
    assert_eq!(
        a["params"]["reserve"],
        json!({"c": 2_000_000, "t": 10_000_000, "enforcement": "pe", "shared": null}),
        "{a}"
    );
    page.wait_for(
        &format!(
            "{}.querySelector('td.effective').textContent.includes('reserve 2.0/10.0 ms pe')",
            row("a")
        ),
        PAGE_TIMEOUT,
    )
    .expect("a's row shows the reserve in force");
    assert_eq!(
        page.evaluate(&last(".what")).unwrap(),
        "set a reserve=2000/10000/pe"
    );
    // An SLO.
    assert_eq!(set_through_page(&page, "b", &[("slo", "3000")]), "ok");
    let b = find_vm(&control(&daemon, &json!({"cmd": "list"})), "b");
    assert_eq!(b["params"]["slo"], 3_000_000, "{b}");

    // Refused: a budget longer than its period (the daemon's check), and a malformed SLO
    // (vgpuctl's parser): the page shows the same words as vgpuctl, and nothing changes.
    for (vm, key, value) in [("a", "reserve", "20000/10000/pe"), ("b", "slo", "fast")] {
        let shown = set_through_page(&page, vm, &[(key, value)]);
        let assignment = format!("{key}={value}");
        let cli = daemon
            .ctl(&["set", vm, &assignment])
            .expect_err("vgpuctl refuses it too")
            .to_string();
        let why = shown
            .strip_prefix("refused: ")
            .unwrap_or_else(|| panic!("{assignment} through the page: {shown}"));
        assert!(
            !why.is_empty() && cli.contains(why),
            "the page says {why:?}, vgpuctl {cli:?}"
        );
        // The field stays as typed, marked edited, for the user to correct.
        let kept = page
            .evaluate(&format!(
                "(i => i.classList.contains('dirty') && i.value)({}.querySelector('[data-param={key}]'))",
                row(vm)
            ))
            .unwrap();
        assert_eq!(kept, json!(value));
    }
    let list = control(&daemon, &json!({"cmd": "list"}));
    assert_eq!(find_vm(&list, "a")["params"]["reserve"]["c"], 2_000_000);
    assert_eq!(find_vm(&list, "b")["params"]["slo"], 3_000_000);
    // Put the refused fields back as the daemon has them.
    page.evaluate(
        "for (const i of document.querySelectorAll('#vms .dirty')) i.classList.remove('dirty'); true",
    )
    .unwrap();

    // A parameter set with vgpuctl shows as the last change, and in b's row.
    daemon
        .ctl(&["set", "b", "weight=512"])
        .expect("vgpuctl set");
    page.wait_for(
        &format!("{} === 'set b weight=512'", last(".what")),
        PAGE_TIMEOUT,
    )
    .expect("the CLI's parameter change shows");
    assert!(
        page.evaluate(&last(".by"))
            .unwrap()
            .as_str()
            .is_some_and(|b| b.starts_with("by control socket")),
    );
    page.wait_for(
        &format!(
            "{}.querySelector('[data-param=weight]').value === '512'",
            row("b")
        ),
        PAGE_TIMEOUT,
    )
    .expect("b's row shows the weight set with vgpuctl");

    // The screenshot of the window, once the charts have some seconds of lines (taken before
    // the layout's checks, so that a failure can be looked at).
    std::thread::sleep(CHART_BEFORE_SCREENSHOT.saturating_sub(load_started.elapsed()));
    page.wait_for(
        &format!(
            "parseFloat({}.querySelector('td.share').textContent) > 0",
            row("a")
        ),
        PAGE_TIMEOUT,
    )
    .expect("a's share shows");
    let png = page.screenshot().expect("screenshot");
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard-1280.png");
    std::fs::write(&path, &png).expect("screenshot written");
    eprintln!("dashboard screenshot (1280x800): {}", path.display());
    // And the whole page (the charts below the window: budget, policy), for a look.
    let whole = page.screenshot_full_page().expect("full-page screenshot");
    let whole_path = path.with_file_name("dashboard-1280-full.png");
    std::fs::write(&whole_path, &whole).expect("screenshot written");
    eprintln!(
        "dashboard screenshot (whole page): {}",
        whole_path.display()
    );
    let image = Image::decode(&png).expect("the screenshot decodes");
    assert_eq!((image.width, image.height), WINDOW);
    assert!(image.distinct_colours() > MIN_COLOURS);
    // 1280 px wide: nothing scrolls sideways, the VM table included.
    let widths = page
        .evaluate(
            "[document.documentElement.scrollWidth, \
              document.querySelector('.table-card').scrollWidth, \
              document.querySelector('.table-card').clientWidth]",
        )
        .unwrap();
    let widths: Vec<u64> = widths
        .as_array()
        .and_then(|w| w.iter().map(Value::as_u64).collect())
        .unwrap_or_else(|| panic!("widths: {widths}"));
    assert!(
        widths[0] <= u64::from(WINDOW.0) && widths[1] <= widths[2],
        "page {} px, VM table {} px in {} px",
        widths[0],
        widths[1],
        widths[2]
    );

    eprintln!("dashboard test at 1280 px took {:?}", started.elapsed());
}
