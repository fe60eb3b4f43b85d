//! Guest OpenGL side by side, like for like: the same Debian guest image, kernel command line
//! and stock GL workloads on our device and on the two virgl devices a QEMU user would pick
//! instead, every one rendering the same single 1024x768 mode.
//!
//! Devices:
//! - **vgpu**: our `vgpu-server` over vfio-user on the host's virglrenderer and Mesa.
//! - **vgpu-prefix**: the same server run with `qemu-scripts/prefix-exec`, so it loads the
//!   QEMU prefix's virglrenderer and Mesa, the stack QEMU's devices use: with it the device
//!   path is the only difference.
//! - **qemu-virtio-gpu-gl**: QEMU's `virtio-gpu-gl-pci`, virgl in QEMU's process.
//! - **vhost-user-gpu**: QEMU's `vhost-user-gpu-pci` with Debian's `vhost-user-gpu --virgl`
//!   backend process. It needs a DRM render node for virgl: on a host without one the guest
//!   falls back to its own llvmpipe, which the benchmark reports instead of a figure (a run
//!   whose guest does not render through virgl never counts).
//!
//! QEMU's devices display on `egl-headless` over the host render node (none here: llvmpipe).
//! Same surface: every boot gets `drm.edid_firmware=edid/vgpu-1024x768.bin`, the image's
//! single-mode EDID, which the guest kernel takes instead of each device's own (QEMU's lists
//! modes up to 5120x2160, and glmark2-es2-drm and kmscube take the largest mode). The surface
//! glmark2 reports and the connector's modes are recorded per run and checked.
//!
//! Every run is one boot running: glmark2-es2-drm's whole default suite off-screen, then
//! on-screen (page flips to the connector), each scene for [`SCENE_SECONDS`]; `kmscube`; and a
//! paced client, GStreamer's `gltestsrc` rendering 30 fps (live, on surfaceless EGL) read back
//! through `gldownload` into a clock-synchronised sink, whose per-frame render times give the
//! jitter. (GStreamer's GBM window, `glimagesink` on the connector, stalls after a few page
//! flips on QEMU's virtio-gpu-gl here, so the paced client does not present.) Runs alternate between the
//! devices (default 3 each). Tables give medians and the spread (min-max); ratios compare ours
//! with each of QEMU's devices. Writes `gl_side_by_side.json` and its figure `.svg` (whole-run
//! scores and per-scene frame rates, a bar per device) to `target/vgpu-bench/` (or the path of
//! `$VGPU_BENCH_OUT`). Progress goes to stderr (a bar on a terminal).
//!
//! `cargo bench -p vgpu-tests --bench gl_side_by_side [-- --runs N] [--scene-seconds S]
//! [--devices a,b] [--quick]` (`--quick`: 3 scenes, 1 run).

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use clap::builder::TypedValueParser as _;
use serde_json::{Value, json};
use vgpu_cli::progress::Progress;
use vgpu_tests::gl_device::{EDID, GlDevice, MODE};
use vgpu_tests::guest::{
    Accel, GuestConfig, GuestError, GuestImage, JobTransport, RunningGuest, gl_render_node,
    server_binary,
};
use vgpu_tests::{qemu_version, skip_without_qemu};

/// Seconds each glmark2 scene runs by default.
const SCENE_SECONDS: u32 = 2;
/// Scenes of `--quick`.
const QUICK_SCENES: [&str; 3] = ["build", "shading", "texture"];
/// Frames kmscube renders (it reports one fewer).
const KMSCUBE_FRAMES: u32 = 300;
/// Frames of the paced client, at [`PACED_FPS`].
const PACED_FRAMES: u32 = 300;
const PACED_FPS: u32 = 30;
/// Wall-clock limit of one boot.
const BOOT_TIMEOUT: Duration = Duration::from_secs(900);
const DEFAULT_RUNS: usize = 3;
/// Why vhost-user-gpu cannot present on a host without a render node.
const NO_PRESENT_VHOST: &str = "without a DRM render node Debian's vhost-user-gpu cannot \
     initialise virgl (it sets virglrenderer up for GBM only: \"Failed to initialize virgl\"), so \
     the guest gets no 3D and renders with its own llvmpipe; only the off-screen glmark2 run is \
     made, to record that";

/// Guest OpenGL side by side: our device against QEMU's virgl devices, like for like.
#[derive(Debug, clap::Parser)]
struct Cli {
    /// Boots per device, alternating between the devices [default: 3, 1 with --quick].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=100).map(usize::from))]
    runs: Option<usize>,
    /// Seconds each glmark2 scene runs.
    #[arg(long, default_value_t = SCENE_SECONDS, value_parser = clap::value_parser!(u32).range(1..=60))]
    scene_seconds: u32,
    /// Three glmark2 scenes, one run per device unless --runs says otherwise.
    #[arg(long)]
    quick: bool,
    /// Devices to compare, comma-separated [default: all].
    #[arg(long, value_delimiter = ',')]
    devices: Vec<GlDevice>,
    #[command(flatten)]
    _cargo: vgpu_bench_report::CargoBench,
}

/// Options of one invocation.
struct Options {
    runs: usize,
    scene_seconds: u32,
    quick: bool,
    devices: Vec<GlDevice>,
}

impl From<Cli> for Options {
    fn from(cli: Cli) -> Options {
        Options {
            runs: cli.runs.unwrap_or(if cli.quick { 1 } else { DEFAULT_RUNS }),
            scene_seconds: cli.scene_seconds,
            quick: cli.quick,
            devices: if cli.devices.is_empty() {
                GlDevice::ALL.to_vec()
            } else {
                cli.devices
            },
        }
    }
}

/// The glmark2 arguments: the default suite (an option-only `-b` keeps it), each scene
/// `seconds` long, or the quick scenes.
fn glmark2_benches(o: &Options) -> String {
    if o.quick {
        QUICK_SCENES
            .iter()
            .map(|s| format!(" -b {s}:duration={}", o.scene_seconds))
            .collect()
    } else {
        format!(" -b :duration={}", o.scene_seconds)
    }
}

/// The job. Each step is framed by `BEGIN-x`/`END-x` lines and prints `KEY value` lines. The
/// off-screen glmark2 run comes first; without `on_screen` the steps that set a scanout
/// (glmark2 on-screen, kmscube, and the paced client, whose GStreamer GL display opens the DRM
/// device) are left out. kmscube takes readable stdin as a key press: it gets a pipe nothing
/// writes to. The paced client logs every frame its sink renders (GST_DEBUG's elapsed-time
/// stamps).
fn job(o: &Options, on_screen: bool) -> String {
    let benches = glmark2_benches(o);
    let glmark2 = |mode: &str, flag: &str| {
        format!(
            r#"echo BEGIN-{mode}
t=$(ms)
timeout 600 glmark2-es2-drm {flag}--visual-config alpha=0{benches} 2>&1
echo "GLMARK2-EXIT $?"
echo "GLMARK2-MS $(( $(ms) - t ))"
echo END-{mode}
"#
        )
    };
    let mut job = format!(
        r#"ms() {{ echo $(( $(date +%s%N) / 1000000 )); }}
for c in /sys/class/drm/card*-*; do
    [ -f "$c/modes" ] && echo "DRM-MODES $(basename "$c") $(tr '\n' ' ' < "$c/modes")"
done
{off}"#,
        off = glmark2("off", "--off-screen "),
    );
    if !on_screen {
        return job;
    }
    job.push_str(&format!(
        r#"echo BEGIN-paced
GST_GL_WINDOW=surfaceless GST_GL_PLATFORM=egl GST_GL_API=gles2 GST_DEBUG_NO_COLOR=1 \
GST_DEBUG=basesink:5 timeout 60 gst-launch-1.0 -q gltestsrc is-live=true \
    num-buffers={PACED_FRAMES} ! \
    "video/x-raw(memory:GLMemory),width={w},height={h},framerate={PACED_FPS}/1" ! \
    gldownload ! fakesink sync=true 2>&1 | grep -E 'rendering object|ERROR' | sed 's/^/GST /'
echo "PACED-EXIT ${{PIPESTATUS[0]}}"
echo END-paced
"#,
        w = MODE.0,
        h = MODE.1
    ));
    job.push_str(&glmark2("on", ""));
    job.push_str(&format!(
        r#"echo BEGIN-kmscube
timeout 120 kmscube -c {KMSCUBE_FRAMES} < <(sleep 600) 2>&1 | grep -v extensions:
echo "KMSCUBE-EXIT ${{PIPESTATUS[0]}}"
echo END-kmscube
"#
    ));
    job
}

/// The lines of a `BEGIN-x`..`END-x` section.
fn section<'a>(output: &'a str, name: &str) -> &'a str {
    let begin = format!("BEGIN-{name}\n");
    let Some(start) = output.find(&begin).map(|i| i + begin.len()) else {
        return "";
    };
    let end = output[start..]
        .find(&format!("END-{name}"))
        .map_or(output.len(), |i| start + i);
    &output[start..end]
}

/// One glmark2 run's figures.
#[derive(Debug, Default, Clone)]
struct Glmark2 {
    score: Option<f64>,
    /// fps per scene line (`[scene] options`), in order.
    scenes: Vec<(String, f64)>,
    surface: Option<String>,
    renderer: Option<String>,
    failure: Option<String>,
}

impl Glmark2 {
    fn parse(text: &str) -> Glmark2 {
        let scenes = text
            .lines()
            .filter_map(|l| {
                let l = l.trim_start().strip_prefix('[')?;
                let (scene, rest) = l.split_once(']')?;
                let (options, rest) = rest.split_once(": FPS: ")?;
                let (fps, _) = rest.split_once(" FrameTime: ")?;
                Some((format!("[{scene}]{options}"), fps.trim().parse().ok()?))
            })
            .collect();
        let mut g = Glmark2 {
            score: vgpu_tests::guest::output_number(text, "glmark2 Score:"),
            scenes,
            surface: vgpu_tests::guest::output_value(text, "Surface Size:").map(str::to_owned),
            renderer: vgpu_tests::guest::output_value(text, "GL_RENDERER:").map(str::to_owned),
            failure: None,
        };
        match vgpu_tests::guest::output_number::<i32>(text, "GLMARK2-EXIT") {
            Some(0) if g.score.is_some() => {}
            Some(0) => g.failure = Some("glmark2 printed no score".into()),
            code => g.failure = Some(format!("glmark2 exit {code:?}")),
        }
        g
    }
}

/// The paced client's frame intervals from the sink's render log: each log line starts with
/// the time since GStreamer started (`0:00:01.234567890`).
fn paced_intervals(text: &str) -> Vec<f64> {
    let stamps: Vec<f64> = text
        .lines()
        .filter(|l| l.contains("rendering object"))
        .filter_map(|l| {
            let t = l.strip_prefix("GST ")?.split_whitespace().next()?;
            let mut parts = t.split(':');
            let h: f64 = parts.next()?.parse().ok()?;
            let m: f64 = parts.next()?.parse().ok()?;
            let s: f64 = parts.next()?.parse().ok()?;
            Some((h * 3600.0 + m * 60.0 + s) * 1e3)
        })
        .collect();
    stamps.windows(2).map(|w| w[1] - w[0]).collect()
}

/// One boot's results.
#[derive(Debug, Default)]
struct RunResult {
    device: Option<GlDevice>,
    index: usize,
    failure: Option<String>,
    off: Glmark2,
    on: Glmark2,
    kmscube_fps: Option<f64>,
    /// Paced client: frames rendered, interval mean, standard deviation and p99 (ms).
    paced: Option<(usize, f64, f64, f64)>,
    modes: Vec<String>,
    server_rss_kib: Option<u64>,
    wall_s: f64,
    /// Why the presenting steps (glmark2 on-screen, kmscube) did not run, if they did not.
    no_present: Option<&'static str>,
}

impl RunResult {
    fn parse(&mut self, output: &str) {
        self.off = Glmark2::parse(section(output, "off"));
        self.on = Glmark2::parse(section(output, "on"));
        if let Some(modes) = vgpu_tests::guest::output_value(output, "DRM-MODES") {
            self.modes = modes
                .split_whitespace()
                .skip(1)
                .map(str::to_owned)
                .collect();
        }
        let kms = section(output, "kmscube");
        self.kmscube_fps = kms
            .lines()
            .filter_map(|l| {
                let rest = l.trim().strip_prefix("Rendered ")?;
                let (_, rest) = rest.split_once(" sec (")?;
                rest.strip_suffix(" fps)")?.parse().ok()
            })
            .next_back();
        let intervals = paced_intervals(section(output, "paced"));
        if intervals.len() >= 10 {
            let n = intervals.len() as f64;
            let mean = intervals.iter().sum::<f64>() / n;
            let sd = (intervals.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
            let mut sorted = intervals.clone();
            sorted.sort_by(f64::total_cmp);
            let p99 = sorted[((sorted.len() - 1) as f64 * 0.99).round() as usize];
            self.paced = Some((intervals.len() + 1, mean, sd, p99));
        }
        let mut problems = Vec::new();
        let runs: &[(&str, &Glmark2)] = if self.no_present.is_some() {
            &[("off-screen", &self.off)]
        } else {
            &[("off-screen", &self.off), ("on-screen", &self.on)]
        };
        for &(what, g) in runs {
            if let Some(f) = &g.failure {
                problems.push(format!("{what}: {f}"));
            }
            let want = format!("{}x{}", MODE.0, MODE.1);
            if let Some(s) = &g.surface
                && !s.starts_with(&want)
            {
                problems.push(format!("{what} surface {s}, not {want}"));
            }
        }
        if let Some(r) = &self.off.renderer
            && !r.starts_with("virgl")
        {
            problems.push(format!(
                "the guest renders with {r}, not through the device (virgl): no device figure"
            ));
        }
        if self.modes != [format!("{}x{}", MODE.0, MODE.1)] {
            problems.push(format!(
                "connector modes {:?}, not the EDID's one",
                self.modes
            ));
        }
        match vgpu_tests::guest::output_number::<i32>(kms, "KMSCUBE-EXIT") {
            _ if self.no_present.is_some() => {}
            Some(0) if self.kmscube_fps.is_some() => {}
            code => problems.push(format!("kmscube exit {code:?}")),
        }
        if !problems.is_empty() {
            self.fail(problems.join("; "));
        }
    }

    fn fail(&mut self, why: String) {
        self.failure = Some(match self.failure.take() {
            Some(before) => format!("{before}; {why}"),
            None => why,
        });
    }
}

fn describe_status(status: &ExitStatus) -> String {
    match status.signal() {
        Some(sig) => format!("killed by signal {sig}"),
        None => status.to_string(),
    }
}

/// The server's resident set (VmRSS, KiB).
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    vgpu_tests::guest::output_value(&status, "VmRSS:")?
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

fn run_once(
    device: GlDevice,
    index: usize,
    o: &Options,
    image: &GuestImage,
    accel: Accel,
    server: &Result<PathBuf, String>,
) -> RunResult {
    let mut result = RunResult {
        device: Some(device),
        index,
        no_present: (!device.presents()).then_some(NO_PRESENT_VHOST),
        ..RunResult::default()
    };
    let on_screen = result.no_present.is_none();
    let mut config = GuestConfig::new(image.clone(), job(o, on_screen)).timeout(BOOT_TIMEOUT);
    config.transport = JobTransport::FwCfg;
    config.accel = Some(accel);
    if let Err(why) = device.configure(&mut config, server.as_deref().map_err(String::as_str)) {
        result.fail(why);
        return result;
    }
    let mut peak_rss = None::<u64>;
    let outcome = RunningGuest::launch(&config).and_then(|guest| {
        let pid = guest.server().map(|s| s.pid());
        guest.wait(|_| {
            if let Some(rss) = pid.and_then(rss_kib) {
                peak_rss = Some(peak_rss.map_or(rss, |p| p.max(rss)));
            }
        })
    });
    result.server_rss_kib = peak_rss;
    match outcome {
        Ok(run) => {
            result.wall_s = run.wall.as_secs_f64();
            result.parse(&run.output);
            if !run.qemu_status.success() {
                result.fail(format!("QEMU {}", describe_status(&run.qemu_status)));
            }
            if run.exit_code != Some(0) {
                result.fail(format!("job exit {:?}", run.exit_code));
            }
            if result.failure.is_some() {
                let logs = [Some(run.qemu_log.as_str()), run.server_log.as_deref()];
                let tail: Vec<&str> = logs
                    .iter()
                    .flatten()
                    .flat_map(|l| l.trim().lines().rev().take(3))
                    .collect();
                if !tail.is_empty() {
                    result.fail(format!("logs: {}", tail.join(" | ")));
                }
            }
        }
        Err(GuestError::Timeout { limit, .. }) => {
            result.fail(format!("no result within {limit:?}"));
            result.wall_s = limit.as_secs_f64();
        }
        Err(e) => result.fail(e.to_string()),
    }
    result
}

/// Median, minimum and maximum.
fn spread(mut values: Vec<f64>) -> Option<(f64, f64, f64)> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    };
    Some((median, values[0], values[n - 1]))
}

fn fmt_spread(s: Option<(f64, f64, f64)>) -> String {
    match s {
        Some((m, lo, hi)) if (hi - lo).abs() > f64::EPSILON => format!("{m:.1} ({lo:.1}-{hi:.1})"),
        Some((m, _, _)) => format!("{m:.1}"),
        None => "–".to_owned(),
    }
}

fn spread_json(s: Option<(f64, f64, f64)>) -> Value {
    s.map_or(
        Value::Null,
        |(m, lo, hi)| json!({"median": m, "min": lo, "max": hi}),
    )
}

/// A device's medians.
struct Summary {
    device: GlDevice,
    ok: usize,
    total: usize,
    off_score: Option<(f64, f64, f64)>,
    on_score: Option<(f64, f64, f64)>,
    kmscube: Option<(f64, f64, f64)>,
    paced_sd: Option<(f64, f64, f64)>,
    paced_p99: Option<(f64, f64, f64)>,
    paced_mean: Option<(f64, f64, f64)>,
    rss_mib: Option<(f64, f64, f64)>,
    /// Median fps per scene, off- and on-screen.
    off_scenes: BTreeMap<String, f64>,
    on_scenes: BTreeMap<String, f64>,
    surfaces: Vec<String>,
    renderers: Vec<String>,
    failures: Vec<String>,
}

fn summarize(device: GlDevice, runs: &[&RunResult]) -> Summary {
    let ok: Vec<&&RunResult> = runs.iter().filter(|r| r.failure.is_none()).collect();
    let take =
        |f: &dyn Fn(&RunResult) -> Option<f64>| spread(ok.iter().filter_map(|r| f(r)).collect());
    let scenes = |g: &dyn Fn(&RunResult) -> &Glmark2| {
        let mut by: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for r in &ok {
            for (scene, fps) in &g(r).scenes {
                by.entry(scene.clone()).or_default().push(*fps);
            }
        }
        by.into_iter()
            .filter_map(|(k, v)| Some((k, spread(v)?.0)))
            .collect()
    };
    let distinct = |f: &dyn Fn(&RunResult) -> Vec<String>| {
        let mut v: Vec<String> = runs.iter().flat_map(|r| f(r)).collect();
        v.sort();
        v.dedup();
        v
    };
    Summary {
        device,
        ok: ok.len(),
        total: runs.len(),
        off_score: take(&|r| r.off.score),
        on_score: take(&|r| r.on.score),
        kmscube: take(&|r| r.kmscube_fps),
        paced_mean: take(&|r| r.paced.map(|p| p.1)),
        paced_sd: take(&|r| r.paced.map(|p| p.2)),
        paced_p99: take(&|r| r.paced.map(|p| p.3)),
        rss_mib: take(&|r| r.server_rss_kib.map(|k| k as f64 / 1024.0)),
        off_scenes: scenes(&|r| &r.off),
        on_scenes: scenes(&|r| &r.on),
        surfaces: distinct(&|r| r.off.surface.iter().chain(&r.on.surface).cloned().collect()),
        renderers: distinct(&|r| r.off.renderer.iter().cloned().collect()),
        failures: runs
            .iter()
            .filter_map(|r| Some(format!("run {}: {}", r.index, r.failure.as_deref()?)))
            .collect(),
    }
}

fn ratio(ours: Option<(f64, f64, f64)>, theirs: Option<(f64, f64, f64)>) -> Option<f64> {
    match (ours, theirs) {
        (Some((a, _, _)), Some((b, _, _))) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn main() {
    let o = Options::from(<Cli as clap::Parser>::parse());
    if skip_without_qemu() {
        return;
    }
    let image = match GuestImage::locate() {
        Ok(image) => image,
        Err(e) => {
            eprintln!("SKIPPED: gl_side_by_side: {e}");
            return;
        }
    };
    let (accel, accel_reason) = Accel::detect().expect("accelerator");
    let server = server_binary().map_err(|e| e.to_string());
    let devices: Vec<GlDevice> = o
        .devices
        .iter()
        .copied()
        .filter(|&d| {
            let there = d.available();
            if let Err(why) = &there {
                eprintln!("gl_side_by_side: {why}");
            }
            there.is_ok()
        })
        .collect();
    let qemu = qemu_version().unwrap_or("unknown");
    let machine = format!(
        "{} CPUs ({})",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        vgpu_tests::cpu_model()
    );
    eprintln!(
        "gl_side_by_side: {} runs per device, alternating, {} s per scene; accel {accel} ({accel_reason}); {qemu}",
        o.runs, o.scene_seconds
    );
    let mut results = Vec::new();
    let progress = Progress::new("gl_side_by_side", (o.runs * devices.len()) as u64);
    for index in 1..=o.runs {
        for &device in &devices {
            progress.step(&format!("run {index}: {}", device.name()));
            let r = run_once(device, index, &o, &image, accel, &server);
            progress.advance();
            progress.note(&format!(
                "run {index}: {}: off-screen {} on-screen {} kmscube {} paced sd {} ms, {:.0} s{}",
                device.name(),
                fmt_spread(r.off.score.map(|s| (s, s, s))),
                fmt_spread(r.on.score.map(|s| (s, s, s))),
                fmt_spread(r.kmscube_fps.map(|s| (s, s, s))),
                fmt_spread(r.paced.map(|p| (p.2, p.2, p.2))),
                r.wall_s,
                r.failure
                    .as_deref()
                    .map_or(String::new(), |f| format!("; FAILED: {f}"))
            ));
            results.push(r);
        }
    }
    drop(progress);

    let summaries: Vec<Summary> = devices
        .iter()
        .map(|&d| {
            let runs: Vec<&RunResult> = results.iter().filter(|r| r.device == Some(d)).collect();
            summarize(d, &runs)
        })
        .collect();
    let find = |d: GlDevice| summaries.iter().find(|s| s.device == d);

    println!(
        "gl_side_by_side: {qemu}; {machine}; accelerator {accel}; {}x{} on every device; medians (min-max) of {} alternating runs; glmark2 {} s per scene",
        MODE.0, MODE.1, o.runs, o.scene_seconds
    );
    println!(
        "| device | host stack | runs ok | glmark2 off-screen | glmark2 on-screen | kmscube fps | paced 30 fps: frame interval mean / sd / p99 ms | server RSS MiB | surface | GL_RENDERER |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for s in &summaries {
        println!(
            "| {} | {} | {}/{} | {} | {} | {} | {} / {} / {} | {} | {} | {} |",
            s.device.name(),
            s.device.stack(),
            s.ok,
            s.total,
            fmt_spread(s.off_score),
            fmt_spread(s.on_score),
            fmt_spread(s.kmscube),
            fmt_spread(s.paced_mean),
            fmt_spread(s.paced_sd),
            fmt_spread(s.paced_p99),
            fmt_spread(s.rss_mib),
            s.surfaces.join(", "),
            s.renderers.join(", ")
        );
    }
    let mut ratios = Vec::new();
    for (ours, theirs) in [
        (GlDevice::VgpuPrefix, GlDevice::QemuVirtioGpuGl),
        (GlDevice::VgpuPrefix, GlDevice::VhostUserGpu),
        (GlDevice::Vgpu, GlDevice::QemuVirtioGpuGl),
        (GlDevice::Vgpu, GlDevice::VhostUserGpu),
    ] {
        let (Some(a), Some(b)) = (find(ours), find(theirs)) else {
            continue;
        };
        let r = json!({
            "ours": ours.name(),
            "theirs": theirs.name(),
            "glmark2_off_screen": ratio(a.off_score, b.off_score),
            "glmark2_on_screen": ratio(a.on_score, b.on_score),
            "kmscube": ratio(a.kmscube, b.kmscube),
        });
        let f = |k: &str| r[k].as_f64().map_or("–".to_owned(), |v| format!("{v:.2}"));
        println!(
            "| **{} / {}** | | | {} | {} | {} | | | | |",
            ours.name(),
            theirs.name(),
            f("glmark2_off_screen"),
            f("glmark2_on_screen"),
            f("kmscube")
        );
        ratios.push(r);
    }
    for s in &summaries {
        for f in &s.failures {
            println!("failed: {} {f}", s.device.name());
        }
        if let Some(why) = results
            .iter()
            .find(|r| r.device == Some(s.device))
            .and_then(|r| r.no_present)
        {
            println!("not presented: {}: {why}", s.device.name());
        }
    }

    let out = vgpu_bench_report::out_path(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/vgpu-bench/gl_side_by_side.json"
    )));
    let device_json: Vec<Value> = summaries
        .iter()
        .map(|s| {
            json!({
                "device": s.device.name(),
                "host_stack": s.device.stack(),
                "runs_ok": s.ok,
                "runs": s.total,
                "glmark2_off_screen": spread_json(s.off_score),
                "glmark2_on_screen": spread_json(s.on_score),
                "kmscube_fps": spread_json(s.kmscube),
                "paced_interval_mean_ms": spread_json(s.paced_mean),
                "paced_interval_sd_ms": spread_json(s.paced_sd),
                "paced_interval_p99_ms": spread_json(s.paced_p99),
                "server_peak_rss_mib": spread_json(s.rss_mib),
                "off_screen_scene_fps": s.off_scenes,
                "on_screen_scene_fps": s.on_scenes,
                "surfaces": s.surfaces,
                "renderers": s.renderers,
                "failures": s.failures,
            })
        })
        .collect();
    let run_json: Vec<Value> = results
        .iter()
        .map(|r| {
            json!({
                "device": r.device.map(GlDevice::name),
                "run": r.index,
                "failure": r.failure,
                "glmark2_off_screen": r.off.score,
                "glmark2_on_screen": r.on.score,
                "off_screen_scenes": r.off.scenes,
                "on_screen_scenes": r.on.scenes,
                "kmscube_fps": r.kmscube_fps,
                "paced": r.paced.map(|(n, mean, sd, p99)| json!({"frames": n, "mean_ms": mean, "sd_ms": sd, "p99_ms": p99})),
                "connector_modes": r.modes,
                "not_presented": r.no_present,
                "server_peak_rss_kib": r.server_rss_kib,
                "wall_s": r.wall_s,
            })
        })
        .collect();
    let doc = json!({
        "benchmark": "gl_side_by_side",
        "qemu": qemu,
        "machine": machine,
        "accelerator": accel.to_string(),
        "accelerator_reason": accel_reason,
        "mode": format!("{}x{}", MODE.0, MODE.1),
        "kernel_cmdline": format!("drm.edid_firmware={EDID}"),
        "runs_per_device": o.runs,
        "glmark2": format!("glmark2-es2-drm [--off-screen] --visual-config alpha=0{}", glmark2_benches(&o)),
        "kmscube": format!("kmscube -c {KMSCUBE_FRAMES}"),
        "paced": format!("gltestsrc is-live=true {PACED_FRAMES} frames at {PACED_FPS} fps ! gldownload ! fakesink sync=true"),
        "qemu_display": format!("egl-headless,rendernode={}", gl_render_node().display()),
        "devices": device_json,
        "ratios": ratios,
        "runs": run_json,
    });
    vgpu_bench_report::write_results(&out, &doc).expect("writing the results");
}
