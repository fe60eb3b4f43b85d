//! Guest OpenGL end-to-end tests: the stock Mesa of the Debian trixie guest
//! (`qemu-scripts/build-guest-image.sh`) must render through virgl on the device under test.
//!
//! Every check runs against two devices:
//! - our `vgpu-server` ([`GuestGpu::Vgpu`]), once it offers VIRTIO_GPU_F_VIRGL. Until then these
//!   tests skip unless `VGPU_GUEST_GL=1` is set; with it they must pass.
//! - QEMU's own `virtio-gpu-gl-pci` on an `egl-headless` display ([`GuestGpu::QemuVirtioGpuGl`]),
//!   the reference that shows the jobs and their checks are right. It skips unless
//!   `VGPU_GUEST_GL_REFERENCE=1` is set: five TCG boots take about two minutes here, and the
//!   QEMU prefix must carry a complete EGL stack ([`qemu_gl_support`] says what is missing).
//!
//! The checks: GL_RENDERER names virgl (`eglinfo -B -p gbm`), kmscube renders a fixed number
//! of frames and exits 0, glmark2-es2-drm's `build` scene completes with a score, and GL works
//! again after a guest reboot. Boots run one at a time; timings go to stderr.

use std::time::Duration;

use vgpu_tests::TempDir;
use vgpu_tests::guest::{
    self, GuestConfig, GuestGpu, GuestImage, GuestRun, JobTransport, RunningGuest, ServerProcess,
    boot_lock, qemu_gl_support, server_binary, skip_without_guest,
};

/// Set to 1 to run the tests against our device (qemu-scripts/test.sh does).
const GUEST_GL_ENV: &str = "VGPU_GUEST_GL";
/// Set to 1 to run the tests against QEMU's virtio-gpu-gl-pci.
const GUEST_GL_REFERENCE_ENV: &str = "VGPU_GUEST_GL_REFERENCE";

/// Wall-clock limit of one boot (15-25 s to init here, plus the GL job).
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// Frames kmscube renders (it ignores the first in its report).
const KMSCUBE_FRAMES: u32 = 200;
/// Frames kmscube renders in each boot of the reboot test.
const KMSCUBE_REBOOT_FRAMES: u32 = 60;
/// Seconds glmark2 spends in its `build` scene (its default is 10).
const GLMARK2_SECONDS: u32 = 3;

/// Bash functions shared by the jobs. Each prints `KEY value` lines for the parsers below.
/// kmscube stops at its first frame when stdin is readable (it takes that as a key press) and
/// the init gives jobs /dev/null: it gets a pipe that nothing writes to instead.
const JOB_LIB: &str = r#"
ms() { echo $(( $(date +%s%N) / 1000000 )); }
gl_renderer() {
    local t=$(ms)
    ls /dev/dri | tr '\n' ' ' | sed 's/^/DRI-NODES /'; echo
    eglinfo -B -p gbm 2>&1
    echo "EGLINFO-EXIT $?"
    echo "EGLINFO-MS $(( $(ms) - t ))"
}
kmscube_run() {
    local t=$(ms)
    timeout 120 kmscube -c "$1" < <(sleep 600) 2>&1 | grep -v extensions:
    echo "KMSCUBE-EXIT ${PIPESTATUS[0]}"
    echo "KMSCUBE-MS $(( $(ms) - t ))"
}
"#;

/// Prints past the test harness's capture, so that timings and results always show.
fn report(test: &str, what: &str) {
    guest::report("guest_gl", test, what);
}

/// The device under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dut {
    /// QEMU's virtio-gpu-gl-pci (the reference).
    QemuVirgl,
    /// Our vgpu-server.
    Vgpu,
}

impl Dut {
    fn gpu(self) -> GuestGpu {
        match self {
            Dut::QemuVirgl => GuestGpu::QemuVirtioGpuGl,
            Dut::Vgpu => GuestGpu::Vgpu,
        }
    }

    /// The guest image, or `None` (after saying why) when this device's tests are switched off
    /// or cannot run here.
    fn image(self, test: &str) -> Option<GuestImage> {
        let (env, why) = match self {
            Dut::Vgpu => (
                GUEST_GL_ENV,
                "guest GL boots take about two minutes under TCG",
            ),
            Dut::QemuVirgl => (
                GUEST_GL_REFERENCE_ENV,
                "the reference boots take about two minutes under TCG",
            ),
        };
        if std::env::var(env).as_deref() != Ok("1") {
            eprintln!("SKIPPED: {test}: {why}; set {env}=1 to run it");
            return None;
        }
        let image = skip_without_guest()?;
        if self == Dut::QemuVirgl {
            // Asked for explicitly: a QEMU that cannot do GL is a failure, not a skip.
            match qemu_gl_support() {
                Ok(how) => report(test, &format!("reference: {how}")),
                Err(why) => panic!("{test}: {why}"),
            }
        }
        Some(image)
    }
}

fn config(image: GuestImage, dut: Dut, job: &str) -> GuestConfig {
    config_with(image, dut.gpu(), job)
}

fn config_with(image: GuestImage, gpu: GuestGpu, job: &str) -> GuestConfig {
    vgpu_tests::server::init_logging();
    let mut config = GuestConfig::new(image, job).gpu(gpu).timeout(BOOT_TIMEOUT);
    // The jobs are longer than the kernel command line takes once base64-encoded.
    config.transport = JobTransport::FwCfg;
    config
}

fn boot(test: &str, config: &GuestConfig) -> GuestRun {
    let run = RunningGuest::run(config).unwrap_or_else(|e| panic!("{test}: {e}"));
    report(test, &run.timing());
    assert!(
        run.qemu_status.success(),
        "QEMU failed ({})\n{}",
        run.qemu_status,
        run.logs()
    );
    assert_eq!(run.exit_code, Some(0), "the job failed\n{}", run.logs());
    run
}

/// What `gl_renderer` printed.
#[derive(Debug, PartialEq)]
struct RendererReport {
    /// Every "<profile> profile renderer: X" line of eglinfo: (profile, X).
    renderers: Vec<(String, String)>,
    exit: Option<i32>,
    millis: Option<u64>,
}

impl RendererReport {
    fn parse(output: &str) -> Self {
        let renderers = output
            .lines()
            .filter_map(|l| l.split_once(" profile renderer: "))
            .map(|(profile, r)| (profile.trim().to_owned(), r.trim().to_owned()))
            .collect();
        Self {
            renderers,
            exit: guest::output_number(output, "EGLINFO-EXIT"),
            millis: guest::output_number(output, "EGLINFO-MS"),
        }
    }

    /// The GL ES renderer string (what GL_RENDERER returns to an ES context), else any.
    fn gles(&self) -> Option<&str> {
        self.renderers
            .iter()
            .find(|(p, _)| p.contains("ES"))
            .or(self.renderers.first())
            .map(|(_, r)| r.as_str())
    }

    fn check(&self, run: &GuestRun) {
        assert_eq!(self.exit, Some(0), "eglinfo failed\n{}", run.logs());
        assert!(
            !self.renderers.is_empty(),
            "eglinfo printed no renderer\n{}",
            run.logs()
        );
        for (profile, renderer) in &self.renderers {
            assert!(
                renderer.contains("virgl"),
                "{profile} renderer is {renderer:?}, not virgl\n{}",
                run.logs()
            );
        }
    }
}

/// What `kmscube_run` printed.
#[derive(Debug, PartialEq)]
struct KmscubeReport {
    /// The last "Rendered N frames in S sec (F fps)": (N, S, F).
    rendered: Option<(u32, f64, f64)>,
    interrupted: bool,
    exit: Option<i32>,
    millis: Option<u64>,
}

impl KmscubeReport {
    fn parse(output: &str) -> Self {
        let rendered = output
            .lines()
            .filter_map(|l| {
                let rest = l.trim().strip_prefix("Rendered ")?;
                let (frames, rest) = rest.split_once(" frames in ")?;
                let (secs, rest) = rest.split_once(" sec (")?;
                let fps = rest.strip_suffix(" fps)")?;
                Some((frames.parse().ok()?, secs.parse().ok()?, fps.parse().ok()?))
            })
            .next_back();
        Self {
            rendered,
            interrupted: output.contains("user interrupted"),
            exit: guest::output_number(output, "KMSCUBE-EXIT"),
            millis: guest::output_number(output, "KMSCUBE-MS"),
        }
    }

    /// Asserts that all `frames` were rendered (kmscube reports one fewer) and it exited 0.
    fn check(&self, frames: u32, run: &GuestRun) {
        assert!(!self.interrupted, "kmscube stopped early\n{}", run.logs());
        assert_eq!(self.exit, Some(0), "kmscube failed\n{}", run.logs());
        let Some((rendered, _, fps)) = self.rendered else {
            panic!("kmscube reported no frames\n{}", run.logs());
        };
        assert_eq!(rendered, frames - 1, "kmscube frames\n{}", run.logs());
        assert!(fps > 0.0, "kmscube fps {fps}");
    }

    fn summary(&self) -> String {
        match self.rendered {
            Some((n, s, fps)) => format!(
                "kmscube rendered {n} frames in {s:.2} s ({fps:.1} fps); job step {} ms",
                self.millis.unwrap_or_default()
            ),
            None => "kmscube rendered nothing".to_owned(),
        }
    }
}

/// What the glmark2 job printed.
#[derive(Debug, PartialEq)]
struct Glmark2Report {
    renderer: Option<String>,
    surface: Option<String>,
    /// The `[build]` line's FPS and frame time in ms.
    build: Option<(u32, f64)>,
    score: Option<u32>,
    exit: Option<i32>,
    millis: Option<u64>,
}

impl Glmark2Report {
    fn parse(output: &str) -> Self {
        let build = output
            .lines()
            .filter(|l| l.trim_start().starts_with("[build]"))
            .find_map(|l| {
                let (_, rest) = l.split_once("FPS: ")?;
                let (fps, rest) = rest.split_once(" FrameTime: ")?;
                let ms = rest.trim().strip_suffix("ms")?.trim();
                Some((fps.trim().parse().ok()?, ms.parse().ok()?))
            });
        Self {
            renderer: guest::output_value(output, "GL_RENDERER:").map(str::to_owned),
            surface: guest::output_value(output, "Surface Size:").map(str::to_owned),
            build,
            score: guest::output_number(output, "glmark2 Score:"),
            exit: guest::output_number(output, "GLMARK2-EXIT"),
            millis: guest::output_number(output, "GLMARK2-MS"),
        }
    }

    fn check(&self, run: &GuestRun) {
        assert_eq!(self.exit, Some(0), "glmark2 failed\n{}", run.logs());
        let renderer = self.renderer.as_deref().unwrap_or_default();
        assert!(
            renderer.contains("virgl"),
            "glmark2 GL_RENDERER {renderer:?}, not virgl\n{}",
            run.logs()
        );
        assert!(
            self.build.is_some_and(|(_, ms)| ms > 0.0),
            "glmark2 ran no build frames\n{}",
            run.logs()
        );
        // The score is the mean FPS rounded down: under TCG at the largest EDID mode it can be
        // small, so only its presence is required.
        assert!(
            self.score.is_some(),
            "glmark2 printed no score\n{}",
            run.logs()
        );
    }
}

fn gl_renderer_is_virgl(dut: Dut, test: &str) {
    let Some(image) = dut.image(test) else {
        return;
    };
    let _lock = boot_lock();
    let job = format!("{JOB_LIB}\ngl_renderer\n");
    let run = boot(test, &config(image, dut, &job));
    let renderer = RendererReport::parse(&run.output);
    report(
        test,
        &format!(
            "GL_RENDERER {:?} ({} profiles; eglinfo {} ms); {}",
            renderer.gles().unwrap_or_default(),
            renderer.renderers.len(),
            renderer.millis.unwrap_or_default(),
            guest::output_value(&run.output, "DRI-NODES").unwrap_or_default()
        ),
    );
    renderer.check(&run);
}

fn kmscube_renders_frames(dut: Dut, test: &str) {
    let Some(image) = dut.image(test) else {
        return;
    };
    let _lock = boot_lock();
    let job = format!("{JOB_LIB}\nkmscube_run {KMSCUBE_FRAMES}\n");
    let run = boot(test, &config(image, dut, &job));
    let kmscube = KmscubeReport::parse(&run.output);
    report(test, &kmscube.summary());
    kmscube.check(KMSCUBE_FRAMES, &run);
}

fn glmark2_build_scores(dut: Dut, test: &str) {
    let Some(image) = dut.image(test) else {
        return;
    };
    let _lock = boot_lock();
    let job = format!(
        r#"{JOB_LIB}
t=$(ms)
glmark2-es2-drm -s 640x480 --visual-config alpha=0 -b build:duration={GLMARK2_SECONDS}
echo "GLMARK2-EXIT $?"
echo "GLMARK2-MS $(( $(ms) - t ))"
"#
    );
    let run = boot(test, &config(image, dut, &job));
    let glmark2 = Glmark2Report::parse(&run.output);
    report(
        test,
        &format!(
            "glmark2 score {} (build {:?} fps/ms) on {:?}, surface {:?}; job step {} ms",
            glmark2.score.map_or("none".into(), |s| s.to_string()),
            glmark2.build,
            glmark2.renderer.as_deref().unwrap_or_default(),
            glmark2.surface.as_deref().unwrap_or_default(),
            glmark2.millis.unwrap_or_default()
        ),
    );
    glmark2.check(&run);
}

/// GL in a first boot, a guest reboot (the device is reset), GL again. The first boot's lines
/// carry a `BOOT1 ` prefix; a scratch disk tells the second boot from the first.
fn gl_works_after_reboot(dut: Dut, test: &str) {
    let Some(image) = dut.image(test) else {
        return;
    };
    let _lock = boot_lock();
    let dir = TempDir::new("vgpu-guest-gl-reboot").expect("temp dir");
    let scratch = dir.path().join("scratch.img");
    std::fs::File::create(&scratch)
        .and_then(|f| f.set_len(1 << 20))
        .expect("scratch disk");
    let job = format!(
        r#"{JOB_LIB}
gl_checks() {{ gl_renderer; kmscube_run {KMSCUBE_REBOOT_FRAMES}; }}
if [ "$(head -c 5 /dev/vdb)" = again ]; then
    echo SECOND-BOOT
    gl_checks
else
    gl_checks | sed 's/^/BOOT1 /'
    printf again | dd of=/dev/vdb conv=notrunc,fsync status=none
    echo REBOOTING
    echo b > /proc/sysrq-trigger
    sleep 30
fi
"#
    );
    let mut config = config(image, dut, &job);
    config.allow_reboot = true;
    config.extra_qemu_args = vec![
        "-drive".into(),
        format!("file={},format=raw,if=virtio", scratch.display()),
    ];
    let run = boot(test, &config);
    assert!(
        matches!(
            (run.serial.find("REBOOTING"), run.serial.find("SECOND-BOOT")),
            (Some(a), Some(b)) if a < b
        ),
        "no reboot seen\n{}",
        run.logs()
    );
    let first: String = run
        .serial
        .lines()
        .filter_map(|l| l.strip_prefix("BOOT1 "))
        .map(|l| format!("{l}\n"))
        .collect();
    for (boot, output) in [("first boot", first.as_str()), ("second boot", &run.output)] {
        let renderer = RendererReport::parse(output);
        let kmscube = KmscubeReport::parse(output);
        report(
            test,
            &format!(
                "{boot}: GL_RENDERER {:?}; {}",
                renderer.gles().unwrap_or_default(),
                kmscube.summary()
            ),
        );
        renderer.check(&run);
        kmscube.check(KMSCUBE_REBOOT_FRAMES, &run);
    }
    if dut == Dut::Vgpu {
        let server_log = run.server_log.as_deref().unwrap_or_default();
        assert!(
            server_log.matches("driver ready").count() >= 2,
            "the driver did not come up twice:\n{server_log}"
        );
    }
}

/// GL_RENDERER on our device names virgl. Needs `VGPU_GUEST_GL=1`.
#[test]
fn vgpu_gl_renderer_is_virgl() {
    gl_renderer_is_virgl(Dut::Vgpu, "vgpu_gl_renderer_is_virgl");
}

/// GL_RENDERER on QEMU's virtio-gpu-gl-pci names virgl. Needs `VGPU_GUEST_GL_REFERENCE=1`.
#[test]
fn reference_gl_renderer_is_virgl() {
    gl_renderer_is_virgl(Dut::QemuVirgl, "reference_gl_renderer_is_virgl");
}

/// kmscube renders its frames on our device and exits 0. Needs `VGPU_GUEST_GL=1`.
#[test]
fn vgpu_kmscube_renders_frames() {
    kmscube_renders_frames(Dut::Vgpu, "vgpu_kmscube_renders_frames");
}

/// kmscube on QEMU's virtio-gpu-gl-pci. Needs `VGPU_GUEST_GL_REFERENCE=1`.
#[test]
fn reference_kmscube_renders_frames() {
    kmscube_renders_frames(Dut::QemuVirgl, "reference_kmscube_renders_frames");
}

/// glmark2-es2-drm's build scene scores on our device. Needs `VGPU_GUEST_GL=1`.
#[test]
fn vgpu_glmark2_build_scores() {
    glmark2_build_scores(Dut::Vgpu, "vgpu_glmark2_build_scores");
}

/// glmark2-es2-drm's build scene on QEMU's virtio-gpu-gl-pci. Needs
/// `VGPU_GUEST_GL_REFERENCE=1`.
#[test]
fn reference_glmark2_build_scores() {
    glmark2_build_scores(Dut::QemuVirgl, "reference_glmark2_build_scores");
}

/// GL on our device works again after a guest reboot. Needs `VGPU_GUEST_GL=1`.
#[test]
fn vgpu_gl_works_after_reboot() {
    gl_works_after_reboot(Dut::Vgpu, "vgpu_gl_works_after_reboot");
}

/// GL on QEMU's virtio-gpu-gl-pci after a guest reboot. Needs `VGPU_GUEST_GL_REFERENCE=1`.
#[test]
fn reference_gl_works_after_reboot() {
    gl_works_after_reboot(Dut::QemuVirgl, "reference_gl_works_after_reboot");
}

/// Pixel statistics of a dumped scanout: (distinct colours, share of pixels unlike the
/// top-left one).
fn png_stats(path: &std::path::Path) -> (usize, f64) {
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(path).expect("scanout PNG"),
    ));
    let mut reader = decoder.read_info().expect("PNG header");
    let mut buf = vec![0; reader.output_buffer_size().expect("PNG size")];
    let info = reader.next_frame(&mut buf).expect("PNG frame");
    let channels = info.color_type.samples();
    let pixels: Vec<&[u8]> = buf[..info.buffer_size()].chunks(channels).collect();
    let colours: std::collections::HashSet<&[u8]> = pixels.iter().copied().collect();
    let background = pixels[0];
    let different = pixels.iter().filter(|p| **p != background).count();
    (colours.len(), different as f64 / pixels.len() as f64)
}

/// kmscube on our device shows up in the dumped scanout (pixel statistics, not a hash); QEMU
/// killed mid-render leaves the server able to serve the next VM's GL. Needs
/// `VGPU_GUEST_GL=1`.
#[test]
fn vgpu_scanout_shows_kmscube_and_server_survives_qemu_killed_mid_render() {
    let test = "vgpu_scanout_shows_kmscube_and_server_survives_qemu_killed_mid_render";
    let Some(image) = Dut::Vgpu.image(test) else {
        return;
    };
    let _lock = boot_lock();
    let dumps = TempDir::new("vgpu-gl-dump").expect("dump directory");
    let dump_arg = dumps.path().to_string_lossy().into_owned();
    let binary = server_binary().unwrap_or_else(|e| panic!("{e}"));
    let mut server = ServerProcess::start(&binary, false, &["--dump-dir".into(), dump_arg])
        .unwrap_or_else(|e| panic!("{e}"));
    let socket = server.socket().to_owned();
    let job = "(kmscube < <(sleep 600) > /dev/null 2>&1 &)
echo KMSCUBE-STARTED
sleep 600
";
    let config = config_with(image.clone(), GuestGpu::VfioUser(socket.clone()), job);
    let mut victim = RunningGuest::launch(&config).unwrap_or_else(|e| panic!("{test}: {e}"));
    let started = victim
        .wait_for_serial(|l| l.contains("KMSCUBE-STARTED"), |_| {})
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    assert!(
        started,
        "the job never started:
{}",
        server.log()
    );
    // The dump is rewritten at most once a second while kmscube flushes frames; give the
    // emulated guest time to render, then look at what the scanout shows.
    let png = dumps.path().join("scanout0.png");
    // Twice an idle host's minute: a TCG guest renders far slower when the host's cores are
    // busy with other work too.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let (colours, share) = loop {
        std::thread::sleep(Duration::from_secs(2));
        let stats = png.exists().then(|| png_stats(&png));
        match stats {
            Some((colours, share)) if colours > 1000 && share > 0.05 => break (colours, share),
            _ if std::time::Instant::now() > deadline => {
                panic!(
                    "no rendered frame in the dump ({stats:?})
{}",
                    server.log()
                )
            }
            _ => {}
        }
    };
    report(
        test,
        &format!(
            "scanout0.png: {colours} colours, {:.1}% of pixels unlike the background",
            share * 100.0
        ),
    );
    assert!(share < 0.95, "the cube does not fill the screen: {share}");
    let status = victim.kill().expect("kill QEMU");
    report(test, &format!("killed QEMU mid-render ({status})"));
    drop(victim);
    server.assert_survived("QEMU was killed");
    let next = config_with(
        image,
        GuestGpu::VfioUser(socket),
        &format!("{JOB_LIB}\ngl_renderer\n"),
    );
    let run = boot(test, &next);
    RendererReport::parse(&run.output).check(&run);
    server.kill().expect("kill server");
}

/// The parsers against output captured from the guest on QEMU's virtio-gpu-gl-pci.
#[test]
fn parsers_read_guest_output() {
    let eglinfo = "DRI-NODES card0 renderD128\nGBM platform:\nEGL API version: 1.5\n\
        OpenGL core profile renderer: virgl (LLVMPIPE (LLVM 19.1.7, 256 bits))\n\
        OpenGL ES profile vendor: Mesa\n\
        OpenGL ES profile renderer: virgl (LLVMPIPE (LLVM 19.1.7, 256 bits))\n\
        EGLINFO-EXIT 0\nEGLINFO-MS 2300\n";
    let r = RendererReport::parse(eglinfo);
    assert_eq!(r.renderers.len(), 2);
    assert_eq!(r.gles(), Some("virgl (LLVMPIPE (LLVM 19.1.7, 256 bits))"));
    assert_eq!((r.exit, r.millis), (Some(0), Some(2300)));
    assert_eq!(
        guest::output_value(eglinfo, "DRI-NODES"),
        Some("card0 renderD128")
    );

    let kmscube = "  renderer: \"virgl (LLVMPIPE)\"\n\
        Rendered 236 frames in 2.007059 sec (117.584999 fps)\n\
        Rendered 299 frames in 2.543441 sec (117.557263 fps)\nKMSCUBE-EXIT 0\nKMSCUBE-MS 6198\n";
    let k = KmscubeReport::parse(kmscube);
    assert_eq!(k.rendered, Some((299, 2.543441, 117.557263)));
    assert_eq!(
        (k.exit, k.millis, k.interrupted),
        (Some(0), Some(6198), false)
    );
    assert!(KmscubeReport::parse("user interrupted!\nKMSCUBE-EXIT 0").interrupted);

    let glmark2 = "    GL_RENDERER:    virgl (LLVMPIPE (LLVM 19.1.7, 256 bits))\n\
        \x20   Surface Size:   5120x2160 fullscreen\n\
        [build] <default>: FPS: 8 FrameTime: 136.764 ms\n\
        \x20                                 glmark2 Score: 7 \n\
        GLMARK2-EXIT 0\nGLMARK2-MS 14134\n";
    let g = Glmark2Report::parse(glmark2);
    assert_eq!(
        g,
        Glmark2Report {
            renderer: Some("virgl (LLVMPIPE (LLVM 19.1.7, 256 bits))".into()),
            surface: Some("5120x2160 fullscreen".into()),
            build: Some((8, 136.764)),
            score: Some(7),
            exit: Some(0),
            millis: Some(14134),
        }
    );
}
