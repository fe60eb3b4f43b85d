//! Guest OpenGL side by side: the same Debian guest image and the same stock GL workloads on
//! our device and on QEMU's own virgl devices.
//!
//! Devices:
//! - **vgpu**: our `vgpu-server` over vfio-user ([`GuestGpu::Vgpu`]). The server binary is
//!   `$VGPU_SERVER_BIN`, else the workspace's, built fresh with this benchmark's (release)
//!   profile ([`server_binary`]).
//! - **qemu-virtio-gpu-gl**: QEMU's `virtio-gpu-gl-pci` with virgl in QEMU's process, on an
//!   `egl-headless` display ([`GuestGpu::QemuVirtioGpuGl`]), its preferred mode set to
//!   1024x768 like ours.
//! - **vhost-user-gpu**: only when the QEMU prefix ships the `vhost-user-gpu` binary; otherwise
//!   it is reported as not available.
//!
//! Every run is one boot that runs `glmark2-es2-drm` on a small fixed scene set and then
//! `kmscube`. Runs alternate between the devices (default 3 each, `-- --runs N`). The table
//! gives the median per device and the ratio ours/theirs; a run that fails (QEMU killed by a
//! signal, a job error, a time-out) is counted as failed and the benchmark goes on. The guest
//! CPU is emulated (TCG here) and the host renders with whatever GL the host stack gives
//! (llvmpipe without a GPU): the renderer strings, accelerator and surface sizes are recorded
//! with the results. Writes JSON to `target/vgpu-bench/gl_side_by_side.json` (or
//! `$VGPU_BENCH_OUT`).
//!
//! `cargo bench -p vgpu-tests --bench gl_side_by_side [-- --runs N]`

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use vgpu_tests::guest::{
    Accel, GuestConfig, GuestError, GuestGpu, GuestImage, JobTransport, RunningGuest,
    gl_render_node, qemu_gl_support, server_binary,
};
use vgpu_tests::{qemu_version, skip_without_qemu};

/// glmark2 scenes, each run for [`SCENE_SECONDS`].
const SCENES: [&str; 3] = ["build", "shading", "texture"];
const SCENE_SECONDS: u32 = 3;
/// Frames kmscube renders (it reports one fewer).
const KMSCUBE_FRAMES: u32 = 200;
/// Wall-clock limit of one boot.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// The scanout mode: our device's only mode, and the preferred mode given to QEMU's device.
const MODE: (u32, u32) = (1024, 768);
const DEFAULT_RUNS: usize = 3;

/// The devices compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Device {
    Vgpu,
    QemuVirtioGpuGl,
    VhostUserGpu,
}

impl Device {
    fn name(self) -> &'static str {
        match self {
            Device::Vgpu => "vgpu",
            Device::QemuVirtioGpuGl => "qemu-virtio-gpu-gl",
            Device::VhostUserGpu => "vhost-user-gpu",
        }
    }
}

/// The job: the DRM modes the guest sees, glmark2, kmscube. Every step prints `KEY value`
/// lines for [`RunResult::parse`]. kmscube takes readable stdin as a key press: it gets a pipe
/// that nothing writes to.
fn job() -> String {
    let benches: String = SCENES
        .iter()
        .map(|s| format!(" -b {s}:duration={SCENE_SECONDS}"))
        .collect();
    format!(
        r#"ms() {{ echo $(( $(date +%s%N) / 1000000 )); }}
for c in /sys/class/drm/card*-*; do
    [ -f "$c/modes" ] && echo "DRM-MODES $(basename "$c") $(tr '\n' ' ' < "$c/modes")"
done
t=$(ms)
timeout 120 glmark2-es2-drm --visual-config alpha=0{benches} 2>&1
echo "GLMARK2-EXIT $?"
echo "GLMARK2-MS $(( $(ms) - t ))"
t=$(ms)
timeout 120 kmscube -c {KMSCUBE_FRAMES} < <(sleep 600) 2>&1 | grep -v extensions:
echo "KMSCUBE-EXIT ${{PIPESTATUS[0]}}"
echo "KMSCUBE-MS $(( $(ms) - t ))"
"#
    )
}

/// One boot's results.
#[derive(Debug, Default)]
struct RunResult {
    device: &'static str,
    index: usize,
    /// Why the run failed, if it did.
    failure: Option<String>,
    score: Option<u32>,
    /// (scene, fps, frame time ms) per glmark2 scene line.
    scenes: Vec<(String, u32, f64)>,
    surface: Option<String>,
    renderer: Option<String>,
    /// The guest connector's first (preferred) and largest mode.
    preferred_mode: Option<String>,
    largest_mode: Option<String>,
    kmscube_fps: Option<f64>,
    boot_to_init_s: Option<f64>,
    wall_s: f64,
    qemu_status: String,
}

impl RunResult {
    fn parse(&mut self, output: &str) {
        self.scenes = output
            .lines()
            .filter_map(|l| {
                let l = l.trim_start().strip_prefix('[')?;
                let (scene, rest) = l.split_once(']')?;
                let (_, rest) = rest.split_once("FPS: ")?;
                let (fps, rest) = rest.split_once(" FrameTime: ")?;
                let ms = rest.trim().strip_suffix("ms")?.trim();
                Some((scene.to_owned(), fps.trim().parse().ok()?, ms.parse().ok()?))
            })
            .collect();
        self.score = vgpu_tests::guest::output_number(output, "glmark2 Score:");
        self.surface = vgpu_tests::guest::output_value(output, "Surface Size:").map(str::to_owned);
        self.renderer = vgpu_tests::guest::output_value(output, "GL_RENDERER:").map(str::to_owned);
        if let Some(modes) = vgpu_tests::guest::output_value(output, "DRM-MODES") {
            let modes: Vec<&str> = modes.split_whitespace().skip(1).collect();
            self.preferred_mode = modes.first().map(|m| (*m).to_owned());
            self.largest_mode = modes
                .iter()
                .filter_map(|m| {
                    let (w, h) = m.split_once('x')?;
                    Some((w.parse::<u64>().ok()? * h.parse::<u64>().ok()?, *m))
                })
                .max_by_key(|(area, _)| *area)
                .map(|(_, m)| m.to_owned());
        }
        self.kmscube_fps = output
            .lines()
            .filter_map(|l| {
                let rest = l.trim().strip_prefix("Rendered ")?;
                let (_, rest) = rest.split_once(" sec (")?;
                rest.strip_suffix(" fps)")?.parse().ok()
            })
            .next_back();
        let mut problems = Vec::new();
        match vgpu_tests::guest::output_number::<i32>(output, "GLMARK2-EXIT") {
            Some(0) if self.score.is_some() => {}
            Some(0) => problems.push("glmark2 printed no score".to_owned()),
            code => problems.push(format!("glmark2 exit {code:?}")),
        }
        match vgpu_tests::guest::output_number::<i32>(output, "KMSCUBE-EXIT") {
            Some(0) if self.kmscube_fps.is_some() => {}
            Some(0) => problems.push("kmscube printed no fps".to_owned()),
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

    fn scene_fps(&self, scene: &str) -> Option<f64> {
        self.scenes
            .iter()
            .find(|(s, _, _)| s == scene)
            .map(|(_, fps, _)| f64::from(*fps))
    }
}

fn describe_status(status: &ExitStatus) -> String {
    match status.signal() {
        Some(sig) => {
            let name = match sig {
                libc::SIGBUS => "SIGBUS",
                libc::SIGSEGV => "SIGSEGV",
                libc::SIGABRT => "SIGABRT",
                libc::SIGKILL => "SIGKILL",
                _ => "signal",
            };
            format!("killed by {name} ({sig})")
        }
        None => status.to_string(),
    }
}

/// The QEMU prefix `setup-qemu.sh` installs (the wrapper's rule).
fn qemu_prefix() -> PathBuf {
    if let Some(p) = std::env::var_os("VGPU_QEMU_PREFIX") {
        return p.into();
    }
    let cache = std::env::var_os("VGPU_CACHE").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/vgpu"),
        PathBuf::from,
    );
    cache.join("qemu")
}

fn vhost_user_gpu_binary() -> Option<PathBuf> {
    let prefix = qemu_prefix();
    ["usr/lib/qemu/vhost-user-gpu", "usr/libexec/vhost-user-gpu"]
        .iter()
        .map(|p| prefix.join(p))
        .find(|p| p.is_file())
}

fn run_once(
    device: Device,
    index: usize,
    image: &GuestImage,
    accel: Accel,
    server: &Result<PathBuf, String>,
) -> RunResult {
    let mut result = RunResult {
        device: device.name(),
        index,
        ..RunResult::default()
    };
    let mut config = GuestConfig::new(image.clone(), job()).timeout(BOOT_TIMEOUT);
    config.transport = JobTransport::FwCfg;
    config.accel = Some(accel);
    match device {
        Device::Vgpu => match server {
            Ok(path) => {
                config.gpu = GuestGpu::Vgpu;
                config.server_bin = Some(path.clone());
                config.server_args = vec!["--display".into(), format!("{}x{}", MODE.0, MODE.1)];
            }
            Err(why) => {
                result.fail(why.clone());
                return result;
            }
        },
        Device::QemuVirtioGpuGl => {
            if let Err(why) = qemu_gl_support() {
                result.fail(format!("QEMU cannot start virtio-gpu-gl-pci: {why}"));
                return result;
            }
            config.gpu = GuestGpu::QemuVirtioGpuGl;
            // The preferred mode; QEMU's EDID still lists larger ones (see the docs).
            for (prop, v) in [("xres", MODE.0), ("yres", MODE.1)] {
                config.extra_qemu_args.push("-global".into());
                config
                    .extra_qemu_args
                    .push(format!("virtio-gpu-gl-device.{prop}={v}"));
            }
        }
        Device::VhostUserGpu => unreachable!("vhost-user-gpu is never booted without its binary"),
    }
    match RunningGuest::run(&config) {
        Ok(run) => {
            result.wall_s = run.wall.as_secs_f64();
            result.boot_to_init_s = run.boot_to_init.map(|d| d.as_secs_f64());
            result.qemu_status = describe_status(&run.qemu_status);
            result.parse(&run.output);
            if !run.qemu_status.success() {
                result.fail(format!("QEMU {}", result.qemu_status));
            }
            if run.exit_code != Some(0) {
                result.fail(format!("job exit {:?}", run.exit_code));
            }
            if result.failure.is_some() {
                let qemu_log = run.qemu_log.trim();
                let tail: String = qemu_log
                    .lines()
                    .rev()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join(" | ");
                if !tail.is_empty() {
                    result.fail(format!("QEMU log: {tail}"));
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

fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    })
}

/// Per-device medians over the successful runs.
#[derive(Debug, Default)]
struct Summary {
    ok: usize,
    total: usize,
    score: Option<f64>,
    scenes: Vec<Option<f64>>,
    kmscube: Option<f64>,
    surfaces: Vec<String>,
    renderers: Vec<String>,
    modes: Vec<String>,
    failures: Vec<String>,
}

fn summarize(runs: &[&RunResult]) -> Summary {
    let ok: Vec<&&RunResult> = runs.iter().filter(|r| r.failure.is_none()).collect();
    let collect = |f: &dyn Fn(&RunResult) -> Option<f64>| -> Option<f64> {
        median(ok.iter().filter_map(|r| f(r)).collect())
    };
    let distinct = |f: &dyn Fn(&RunResult) -> Option<String>| -> Vec<String> {
        let mut v: Vec<String> = runs.iter().filter_map(|r| f(r)).collect();
        v.sort();
        v.dedup();
        v
    };
    Summary {
        ok: ok.len(),
        total: runs.len(),
        score: collect(&|r| r.score.map(f64::from)),
        scenes: SCENES
            .iter()
            .map(|s| collect(&|r| r.scene_fps(s)))
            .collect(),
        kmscube: collect(&|r| r.kmscube_fps),
        surfaces: distinct(&|r| r.surface.clone()),
        renderers: distinct(&|r| r.renderer.clone()),
        modes: distinct(&|r| {
            Some(format!(
                "preferred {} / largest {}",
                r.preferred_mode.as_deref()?,
                r.largest_mode.as_deref()?
            ))
        }),
        failures: runs
            .iter()
            .filter_map(|r| Some(format!("run {}: {}", r.index, r.failure.as_deref()?)))
            .collect(),
    }
}

fn fmt_opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or("–".to_owned(), |v| format!("{v:.decimals$}"))
}

fn ratio(ours: Option<f64>, theirs: Option<f64>) -> Option<f64> {
    match (ours, theirs) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_num(v: Option<f64>) -> String {
    v.map_or("null".to_owned(), |v| format!("{v:.3}"))
}

fn json_list(items: &[String]) -> String {
    format!(
        "[{}]",
        items
            .iter()
            .map(|s| json_str(s))
            .collect::<Vec<_>>()
            .join(",")
    )
}

fn run_json(r: &RunResult) -> String {
    let scenes: Vec<String> = r
        .scenes
        .iter()
        .map(|(s, fps, ms)| {
            format!(
                "{{\"scene\":{},\"fps\":{fps},\"frame_time_ms\":{ms:.3}}}",
                json_str(s)
            )
        })
        .collect();
    let opt_str = |s: &Option<String>| s.as_deref().map_or("null".to_owned(), json_str);
    format!(
        "{{\"device\":{},\"run\":{},\"ok\":{},\"failure\":{},\"glmark2_score\":{},\"scenes\":[{}],\
         \"surface\":{},\"renderer\":{},\"preferred_mode\":{},\"largest_mode\":{},\
         \"kmscube_fps\":{},\"boot_to_init_s\":{},\"wall_s\":{:.3},\"qemu_status\":{}}}",
        json_str(r.device),
        r.index,
        r.failure.is_none(),
        opt_str(&r.failure),
        r.score.map_or("null".to_owned(), |s| s.to_string()),
        scenes.join(","),
        opt_str(&r.surface),
        opt_str(&r.renderer),
        opt_str(&r.preferred_mode),
        opt_str(&r.largest_mode),
        json_num(r.kmscube_fps),
        json_num(r.boot_to_init_s),
        r.wall_s,
        json_str(&r.qemu_status),
    )
}

fn parse_runs() -> Result<usize, String> {
    let mut runs = DEFAULT_RUNS;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--runs" => {
                runs = args
                    .next()
                    .ok_or("--runs needs a value")?
                    .parse()
                    .map_err(|e| format!("--runs: {e}"))?;
                if runs == 0 {
                    return Err("--runs must be at least 1".into());
                }
            }
            // cargo bench passes --bench to harness = false benchmarks.
            "--bench" => {}
            other => return Err(format!("unknown argument {other:?} (expected --runs N)")),
        }
    }
    Ok(runs)
}

fn main() {
    let runs = match parse_runs() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("gl_side_by_side: {e}");
            std::process::exit(2);
        }
    };
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
    let vhost = vhost_user_gpu_binary();
    let qemu = qemu_version().unwrap_or("unknown");
    let machine = format!(
        "{} CPUs ({})",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        vgpu_tests::cpu_model()
    );
    let booted = [Device::Vgpu, Device::QemuVirtioGpuGl];
    eprintln!(
        "gl_side_by_side: {runs} runs per device, alternating; accel {accel} ({accel_reason}); {qemu}; server {}",
        server
            .as_ref()
            .map_or_else(|e| e.clone(), |p| p.display().to_string())
    );

    let mut results = Vec::new();
    for index in 1..=runs {
        for device in booted {
            eprintln!("run {index}/{runs}: {} ...", device.name());
            let r = run_once(device, index, &image, accel, &server);
            eprintln!(
                "run {index}/{runs}: {}: score {} scenes {:?} kmscube {} fps, surface {}, {:.1} s{}",
                device.name(),
                r.score.map_or("–".into(), |s| s.to_string()),
                r.scenes
                    .iter()
                    .map(|(s, fps, _)| format!("{s} {fps}"))
                    .collect::<Vec<_>>(),
                fmt_opt(r.kmscube_fps, 1),
                r.surface.as_deref().unwrap_or("?"),
                r.wall_s,
                r.failure
                    .as_deref()
                    .map_or(String::new(), |f| format!("; FAILED: {f}"))
            );
            results.push(r);
        }
    }

    let summaries: Vec<(Device, Summary)> = booted
        .iter()
        .map(|&d| {
            let runs: Vec<&RunResult> = results.iter().filter(|r| r.device == d.name()).collect();
            (d, summarize(&runs))
        })
        .collect();
    let ours = &summaries[0].1;
    let theirs = &summaries[1].1;

    let scene_cols: String = SCENES.iter().map(|s| format!(" {s} fps |")).collect();
    let scene_rule: String = SCENES.iter().map(|_| "---|").collect();
    println!(
        "gl_side_by_side: {qemu}; {machine}; accelerator {accel}; medians of {runs} alternating runs"
    );
    println!(
        "| device | runs ok | glmark2 score |{scene_cols} kmscube fps | glmark2 surface | guest modes | GL_RENDERER |"
    );
    println!("|---|---|---|{scene_rule}---|---|---|---|");
    for (device, s) in &summaries {
        let scenes: String = s
            .scenes
            .iter()
            .map(|v| format!(" {} |", fmt_opt(*v, 1)))
            .collect();
        println!(
            "| {} | {}/{} | {} |{scenes} {} | {} | {} | {} |",
            device.name(),
            s.ok,
            s.total,
            fmt_opt(s.score, 1),
            fmt_opt(s.kmscube, 1),
            s.surfaces.join(", "),
            s.modes.join(", "),
            s.renderers.join(", ")
        );
    }
    let vhost_note = match &vhost {
        Some(path) => format!(
            "binary at {} (not benchmarked: it exports scanouts as dmabufs, which this host cannot import)",
            path.display()
        ),
        None => "not available (the QEMU prefix ships no vhost-user-gpu binary)".to_owned(),
    };
    let dashes: String = SCENES.iter().map(|_| " – |").collect();
    println!("| vhost-user-gpu | – | – |{dashes} – | {vhost_note} | – | – |");
    let scene_ratios: Vec<Option<f64>> = ours
        .scenes
        .iter()
        .zip(&theirs.scenes)
        .map(|(a, b)| ratio(*a, *b))
        .collect();
    let score_ratio = ratio(ours.score, theirs.score);
    let kmscube_ratio = ratio(ours.kmscube, theirs.kmscube);
    let ratio_scenes: String = scene_ratios
        .iter()
        .map(|v| format!(" {} |", fmt_opt(*v, 2)))
        .collect();
    println!(
        "| **ratio vgpu / qemu-virtio-gpu-gl** | | {} |{ratio_scenes} {} | | | |",
        fmt_opt(score_ratio, 2),
        fmt_opt(kmscube_ratio, 2)
    );
    for (device, s) in &summaries {
        for f in &s.failures {
            println!("failed: {} {f}", device.name());
        }
    }

    let device_json = |device: Device, s: &Summary| {
        let scenes: Vec<String> = SCENES
            .iter()
            .zip(&s.scenes)
            .map(|(name, v)| format!("{}:{}", json_str(name), json_num(*v)))
            .collect();
        format!(
            "{{\"device\":{},\"runs_ok\":{},\"runs\":{},\"median_glmark2_score\":{},\
             \"median_scene_fps\":{{{}}},\"median_kmscube_fps\":{},\"surfaces\":{},\
             \"guest_modes\":{},\"renderers\":{},\"failures\":{}}}",
            json_str(device.name()),
            s.ok,
            s.total,
            json_num(s.score),
            scenes.join(","),
            json_num(s.kmscube),
            json_list(&s.surfaces),
            json_list(&s.modes),
            json_list(&s.renderers),
            json_list(&s.failures),
        )
    };
    let mut devices: Vec<String> = summaries.iter().map(|(d, s)| device_json(*d, s)).collect();
    devices.push(format!(
        "{{\"device\":{},\"available\":{},\"note\":{}}}",
        json_str(Device::VhostUserGpu.name()),
        vhost.is_some(),
        json_str(&vhost_note)
    ));
    let scene_ratio_json: Vec<String> = SCENES
        .iter()
        .zip(&scene_ratios)
        .map(|(name, v)| format!("{}:{}", json_str(name), json_num(*v)))
        .collect();
    let glmark2_cmd = format!(
        "glmark2-es2-drm --visual-config alpha=0{}",
        SCENES
            .iter()
            .map(|s| format!(" -b {s}:duration={SCENE_SECONDS}"))
            .collect::<String>()
    );
    let json = format!(
        "{{\"benchmark\":\"gl_side_by_side\",\"qemu\":{},\"machine\":{},\"accelerator\":{},\
         \"accelerator_reason\":{},\"runs_per_device\":{runs},\"glmark2\":{},\
         \"kmscube\":{},\"mode\":\"{}x{}\",\"qemu_gl_display\":{},\"server\":{},\
         \"devices\":[{}],\"ratio_vgpu_over_qemu_virtio_gpu_gl\":{{\"glmark2_score\":{},\
         \"scene_fps\":{{{}}},\"kmscube_fps\":{}}},\"runs\":[{}]}}\n",
        json_str(qemu),
        json_str(&machine),
        json_str(&accel.to_string()),
        json_str(&accel_reason),
        json_str(&glmark2_cmd),
        json_str(&format!("kmscube -c {KMSCUBE_FRAMES}")),
        MODE.0,
        MODE.1,
        json_str(&format!(
            "virtio-gpu-gl-pci (xres={},yres={}), -display egl-headless,rendernode={}",
            MODE.0,
            MODE.1,
            gl_render_node().display()
        )),
        json_str(
            &server
                .as_ref()
                .map_or_else(|e| e.clone(), |p| p.display().to_string())
        ),
        devices.join(","),
        json_num(score_ratio),
        scene_ratio_json.join(","),
        json_num(kmscube_ratio),
        results.iter().map(run_json).collect::<Vec<_>>().join(","),
    );
    let out = std::env::var_os("VGPU_BENCH_OUT").map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../target/vgpu-bench/gl_side_by_side.json"
            ))
        },
        PathBuf::from,
    );
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).expect("output directory");
    }
    std::fs::write(&out, json).expect("writing the JSON result");
    println!("JSON: {}", out.display());
}
