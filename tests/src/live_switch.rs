//! The live policy switch on real guests, as the demo shows it and `guest_sched` checks it:
//! under one `vgpu-schedd`, a "bomb" guest keeps a GPU command bomb in flight while a "game"
//! guest renders frames in two phases, the first under the daemon's policy as it is, the
//! second after a new policy (TimeGraph) was installed live. Both guests are served by the
//! control channel: the workloads start once both guests booted, each phase is measured over
//! a window in which both VMs must be busy all through ([`watch_window`]) and the expected
//! policy in force at both ends, and the game's own summary is collected at each phase's end.
//! [`verdict`] compares the phases only when every precondition held, and says which failed
//! otherwise.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::control::ControlChannel;
use crate::daemon::{Schedd, find_vm};
use crate::experiment::{CpuTimes, Watched, Window, cpu_waits, watch_window};
use crate::guest::{GuestImage, RunningGuest};

/// The guests' names.
pub const BOMB: &str = "bomb";
pub const GAME: &str = "game";
/// The bomb's workload: 8 groups of 4 ms in flight until stopped.
const BOMB_JOB: &str = "vgpu-load bomb --cost-us 4000 --depth 8 --until-stopped --json \
    | grep '\"summary\"' | sed 's/^/SUMMARY /'";
/// The game's workload: 1 ms of CPU then 4 groups of 2 ms per frame, until stopped.
const GAME_JOB: &str = "vgpu-load frames --groups 4 --cost-us 2000 --cpu-us 1000 \
    --fps-target 60 --until-stopped --json | grep '\"summary\"' | sed 's/^/SUMMARY /'";
/// Work each VM must have completed in a phase before its window opens (its workload runs).
const WARM_GROUPS: u64 = 8;
/// Longest wait for a phase's workloads to warm up: a glmark2 set-up under TCG takes seconds.
const WARM_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest wait for the agent to start a job, and for a stopped job to end and report (the
/// agent's 15 s grace before SIGTERM, 5 s before SIGKILL, a slow guest's reply).
const JOB_TIMEOUT: Duration = Duration::from_secs(60);
/// How much longer glmark2 runs than the window it is measured in (its start-up lag).
const GL_EXTRA_S: u64 = 20;
/// Poll interval while a phase warms up.
const POLL: Duration = Duration::from_millis(250);

/// What to run.
#[derive(Debug, Clone)]
pub struct LiveSwitch {
    /// The measured window of each phase.
    pub phase: Duration,
    /// The game is glmark2 on virgl instead of vgpu-load's frame workload.
    pub gl: bool,
    /// The policy installed between the phases (a `vgpuctl set-policy` file).
    pub policy_file: std::path::PathBuf,
    /// The policy's name as `vgpuctl show` reports it.
    pub policy_name: String,
    /// Longest wait for both guests to boot and start their agents.
    pub boot_timeout: Duration,
}

/// One phase of the game.
#[derive(Debug, Clone)]
pub struct Phase {
    /// The policy meant to be in force.
    pub policy: String,
    pub window: Window,
    /// The game's frame rate over the window, from the daemon's counters.
    pub daemon_fps: f64,
    /// The game's own summary line (vgpu-load's JSON, or glmark2's `[build]` line).
    pub guest_summary: Option<String>,
    /// The bomb's and the game's CPU wait shares in the window ([`cpu_waits`]).
    pub cpu_waits: Vec<f64>,
    /// Every precondition that failed: the window's ([`Window::failures`]), a VM starved of
    /// CPU, a policy not in force at its start or end, a summary missing.
    pub failures: Vec<String>,
}

impl Phase {
    /// The game's own frame rate: vgpu-load's `fps`, or glmark2's `FPS:`.
    pub fn guest_fps(&self) -> Option<f64> {
        let s = self.guest_summary.as_deref()?;
        if let Ok(v) = serde_json::from_str::<Value>(s) {
            return v["fps"].as_f64();
        }
        let rest = &s[s.find("FPS:")? + 4..];
        rest.split_whitespace().next()?.parse().ok()
    }

    /// The game's own median group latency (vgpu-load only).
    pub fn guest_p50_us(&self) -> Option<f64> {
        let v: Value = serde_json::from_str(self.guest_summary.as_deref()?).ok()?;
        v["latency_p50_us"].as_f64()
    }
}

/// Both phases and the bomb's own summary.
#[derive(Debug, Clone)]
pub struct LiveSwitchResult {
    pub before: Phase,
    pub after: Phase,
    pub bomb_summary: Option<String>,
}

fn channel(guest: &mut RunningGuest) -> Result<&mut ControlChannel, String> {
    guest
        .control()
        .ok_or_else(|| "a guest without its control channel".to_owned())
}

/// Waits until every VM of `vms` has completed [`WARM_GROUPS`] more than in `since`.
fn warm(schedd: &Schedd, vms: &[&str], since: &Value) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let show = schedd.ctl(&["show"]).map_err(|e| e.to_string())?;
        let done = |vm: &str| {
            let c = |v: &Value| find_vm(v, vm)["completed"].as_u64().unwrap_or(0);
            c(&show).saturating_sub(c(since)) >= WARM_GROUPS
        };
        if vms.iter().all(|vm| done(vm)) {
            return Ok(());
        }
        if started.elapsed() > WARM_TIMEOUT {
            return Err(format!(
                "the workloads did not run within {WARM_TIMEOUT:?}: {}",
                show["vms"]
            ));
        }
        std::thread::sleep(POLL);
    }
}

/// One phase: starts the game's workload, measures the window, ends the workload.
fn phase(
    schedd: &Schedd,
    pids: &[Watched<'_>],
    game: &mut RunningGuest,
    cfg: &LiveSwitch,
    policy: &str,
    job: &str,
    progress: &mut impl FnMut(&str),
) -> Result<Phase, String> {
    let before = schedd.ctl(&["show"]).map_err(|e| e.to_string())?;
    let script = if cfg.gl {
        format!(
            "glmark2-es2-drm -s 640x480 --visual-config alpha=0 -b build:duration={} 2>&1 \
             | grep -E '^ *\\[build\\]' | sed 's/^/SUMMARY /'",
            cfg.phase.as_secs() + GL_EXTRA_S
        )
    } else {
        GAME_JOB.to_owned()
    };
    channel(game)?
        .start(job, &script, JOB_TIMEOUT)
        .map_err(|e| format!("{GAME}: {e}"))?;
    warm(schedd, &[BOMB, GAME], &before)?;
    progress(&format!(
        "measuring the game under policy {policy} for {} s",
        cfg.phase.as_secs()
    ));
    let cpu_start: Vec<CpuTimes> = pids.iter().map(|(_, p, _)| CpuTimes::of(p)).collect();
    let window = watch_window(schedd, &[BOMB, GAME], cfg.phase)?;
    let mut failures = window.failures.clone();
    let cpu_waits = cpu_waits(pids, &cpu_start, &mut failures);
    // The daemon's view at the window's end, for the transcript.
    let _ = schedd.transcript(&["show"]);
    let ch = channel(game)?;
    if !cfg.gl {
        ch.stop(job).map_err(|e| e.to_string())?;
    }
    let wait = if cfg.gl {
        JOB_TIMEOUT + Duration::from_secs(GL_EXTRA_S)
    } else {
        JOB_TIMEOUT
    };
    let report = ch
        .wait_exit(job, wait)
        .map_err(|e| format!("{GAME}: {e}"))?;
    let frames = |v: &Value| find_vm(v, GAME)["frames"].as_f64().unwrap_or(0.0);
    for (when, show) in [("start", &window.first), ("end", &window.last)] {
        let now = show["policy"].as_str().unwrap_or("?");
        if now != policy {
            failures.push(format!(
                "policy {now} instead of {policy} at the window's {when}"
            ));
        }
    }
    let guest_summary = report.summaries.last().cloned();
    if guest_summary.is_none() {
        failures.push(format!(
            "the game printed no summary (exit {:?})",
            report.exit
        ));
    }
    Ok(Phase {
        policy: policy.to_owned(),
        daemon_fps: (frames(&window.last) - frames(&window.first)).max(0.0)
            / window.seconds.max(f64::EPSILON),
        window,
        guest_summary,
        cpu_waits,
        failures,
    })
}

/// Boots both guests under `schedd` (its policy as it is: the first phase's), runs both
/// phases with `cfg.policy_file` installed between them, and stops everything.
pub fn run(
    schedd: &Schedd,
    image: &GuestImage,
    cfg: &LiveSwitch,
    mut progress: impl FnMut(&str),
) -> Result<LiveSwitchResult, String> {
    let started = Instant::now();
    let first_policy = schedd.ctl(&["show"]).map_err(|e| e.to_string())?["policy"]
        .as_str()
        .unwrap_or("?")
        .to_owned();
    let limit = cfg.boot_timeout + 2 * cfg.phase + Duration::from_secs(600);
    let mut guests = Vec::new();
    for name in [BOMB, GAME] {
        let config = schedd.agent_config(image, name).timeout(limit);
        progress(&format!("booting {name}"));
        guests.push(RunningGuest::launch(&config).map_err(|e| format!("{name}: {e}"))?);
    }
    let [mut bomb, mut game]: [RunningGuest; 2] =
        guests.try_into().map_err(|_| "two guests".to_owned())?;
    for (name, guest) in [(BOMB, &mut bomb), (GAME, &mut game)] {
        let left = cfg.boot_timeout.saturating_sub(started.elapsed());
        channel(guest)?
            .hello(left)
            .map_err(|e| format!("{name} did not boot: {e}"))?;
    }
    progress(&format!(
        "both guests up after {:.0} s; the bomb starts",
        started.elapsed().as_secs_f64()
    ));
    channel(&mut bomb)?
        .start("bomb", BOMB_JOB, JOB_TIMEOUT)
        .map_err(|e| format!("{BOMB}: {e}"))?;
    // The game's frame rate is paced by its CPU phase; the bomb sleeps on its fences.
    let pids: [Watched<'_>; 2] = [(BOMB, bomb.pids(), false), (GAME, game.pids(), true)];
    let before = phase(
        schedd,
        &pids,
        &mut game,
        cfg,
        &first_policy,
        "phase1",
        &mut progress,
    )?;
    progress(&format!(
        "switching the policy live: vgpuctl set-policy {}",
        cfg.policy_file.display()
    ));
    let file = cfg.policy_file.to_string_lossy().into_owned();
    schedd
        .transcript(&["set-policy", &file])
        .map_err(|e| format!("set-policy: {e}"))?;
    let after = phase(
        schedd,
        &pids,
        &mut game,
        cfg,
        &cfg.policy_name,
        "phase2",
        &mut progress,
    )?;
    let ch = channel(&mut bomb)?;
    ch.stop("bomb").map_err(|e| e.to_string())?;
    let bomb_summary = ch
        .wait_exit("bomb", JOB_TIMEOUT)
        .map_err(|e| format!("{BOMB}: {e}"))?
        .summaries
        .last()
        .cloned();
    for guest in [&mut bomb, &mut game] {
        let _ = channel(guest)?.quit(Duration::from_secs(10));
        let _ = guest.kill();
    }
    Ok(LiveSwitchResult {
        before,
        after,
        bomb_summary,
    })
}

/// What the run shows, in words: both phases' figures and the gain, or, when a
/// precondition failed, which one and that no comparison is made.
pub fn verdict(r: &LiveSwitchResult) -> String {
    let mut out = String::new();
    let fmt = |v: Option<f64>| v.map_or("?".to_owned(), |v| format!("{v:.1}"));
    for (n, p) in [(1, &r.before), (2, &r.after)] {
        out.push_str(&format!(
            "phase {n}, policy {}: the game {} fps by its own count, {:.1} fps by the daemon's \
             ({:.0} s window, bomb running; CPU wait bomb/game {})",
            p.policy,
            fmt(p.guest_fps()),
            p.daemon_fps,
            p.window.seconds,
            p.cpu_waits
                .iter()
                .map(|w| format!("{:.0}%", w * 100.0))
                .collect::<Vec<_>>()
                .join("/")
        ));
        if let Some(p50) = p.guest_p50_us() {
            out.push_str(&format!(", group latency p50 {p50:.0} us"));
        }
        out.push('\n');
    }
    let failures: Vec<String> = [(1, &r.before), (2, &r.after)]
        .iter()
        .flat_map(|(n, p)| p.failures.iter().map(move |f| format!("phase {n}: {f}")))
        .collect();
    if !failures.is_empty() {
        out.push_str(&format!(
            "NO VERDICT: the phases cannot be compared because a precondition failed:\n  {}\n",
            failures.join("\n  ")
        ));
        return out;
    }
    match (r.before.guest_fps(), r.after.guest_fps()) {
        (Some(a), Some(b)) if a > 0.0 => out.push_str(&format!(
            "{} gives the game {:.1}x the frame rate it had under {} (both VMs busy in both \
             windows)\n",
            r.after.policy,
            b / a,
            r.before.policy
        )),
        _ => out.push_str("NO VERDICT: the game reported no frame rate\n"),
    }
    out
}
