//! Piglit in a guest on our device (`vgpu_tests::piglit`, the disk of
//! `qemu-scripts/build-piglit-disk.sh`): a handful of the selection's tests, one per group and
//! both GLES versions, pass through our device on the host's virglrenderer, each as one
//! control-channel job; a program that is not there is a crash and a shader script that is not
//! there a failure, each with the output that says so; a test that takes its guest down is lost,
//! and the next one runs in a new boot. The whole selection on both devices is
//! `cargo bench -p vgpu-tests --bench piglit_side_by_side` (docs/PERFORMANCE.md).
//!
//! Skipped with a message when the guest image or the piglit disk is missing, unless
//! `VGPU_REQUIRE_GUEST` / `VGPU_REQUIRE_PIGLIT` is set (test.sh).

use std::time::Instant;

use vgpu_tests::gl_device::GlDevice;
use vgpu_tests::guest::{self, GuestConfig, boot_lock, server_binary};
use vgpu_tests::piglit::{self, Outcome, PiglitTest, skip_without_piglit};

/// Tests that pass on our device on the host's stack (virglrenderer 0.10, Mesa 22.3), one or
/// more per group of the selection.
const PASSING: [&str; 7] = [
    "spec@!opengl 1.5@gl-1.5-get-array-attribs",
    "spec@!opengl es 2.0@draw_buffers_gles2",
    "spec@!opengl es 3.0@ext_texture_array-compressed_gles3 texsubimage",
    "spec@glsl-1.40@uniform_buffer@vs-floats",
    "spec@arb_texture_rg@fbo-blending-formats-float",
    "spec@ext_framebuffer_blit@fbo-sys-blit",
    "spec@arb_sync@repeat-wait",
];

fn synthetic(name: &str, argv: &[&str]) -> PiglitTest {
    PiglitTest {
        name: name.into(),
        group: "negative".into(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
    }
}

#[test]
fn piglit_tests_pass_on_our_device_and_broken_ones_are_reported() {
    let Some((image, disk)) = skip_without_piglit() else {
        return;
    };
    let _lock = boot_lock();
    let mut tests: Vec<PiglitTest> = PASSING
        .iter()
        .map(|name| {
            disk.tests
                .iter()
                .find(|t| t.name == *name)
                .unwrap_or_else(|| panic!("{name} is not in the piglit disk's selection"))
                .clone()
        })
        .collect();
    tests.push(synthetic(
        "negative@no-program",
        &["no-such-piglit-test", "-auto"],
    ));
    tests.push(synthetic(
        "negative@no-script",
        &[
            "shader_runner",
            "tests/no-such.shader_test",
            "-auto",
            "-fbo",
        ],
    ));
    // A test that takes its guest down (powers it off at once): the test is lost, the guest is
    // booted again and the list goes on.
    tests.push(synthetic(
        "negative@guest-goes-away",
        &[
            "../../../../bin/sh",
            "-c",
            "echo o > /proc/sysrq-trigger; sleep 60",
        ],
    ));
    tests.push(tests[0].clone());
    let mut config = GuestConfig::new(image, "");
    let server = server_binary().map_err(|e| e.to_string());
    GlDevice::Vgpu
        .configure(&mut config, server.as_deref().map_err(String::as_str))
        .expect("our device");
    let started = Instant::now();
    let results = piglit::run(&config, &disk, &tests, |r| {
        guest::report(
            "piglit",
            "guest_piglit",
            &format!("{} {} ({:?} ms)", r.outcome.name(), r.name, r.ms),
        )
    })
    .expect("the guest boots and mounts the piglit disk");
    guest::report(
        "piglit",
        "guest_piglit",
        &format!("{} tests in {:.0?}", results.len(), started.elapsed()),
    );
    assert_eq!(results.len(), tests.len());
    for r in &results[..PASSING.len()] {
        assert_eq!(r.outcome, Outcome::Pass, "{}: {}", r.name, r.detail);
        assert_eq!(r.rc, Some(0), "{}", r.name);
    }
    let missing = &results[PASSING.len()];
    assert_eq!(missing.outcome, Outcome::Crash, "{missing:?}");
    assert_eq!(missing.rc, Some(127), "{missing:?}");
    assert!(missing.detail.contains("No such file"), "{missing:?}");
    let script = &results[PASSING.len() + 1];
    assert_eq!(script.outcome, Outcome::Fail, "{script:?}");
    assert!(script.detail.contains("no-such.shader_test"), "{script:?}");
    let gone = &results[PASSING.len() + 2];
    assert_eq!(gone.outcome, Outcome::Lost, "{gone:?}");
    assert!(gone.detail.contains("QEMU exit"), "{gone:?}");
    let again = &results[PASSING.len() + 3];
    assert_eq!(again.outcome, Outcome::Pass, "after a new boot: {again:?}");
}
