//! Piglit, the OpenGL conformance suite, in a guest: the disk `qemu-scripts/build-piglit-disk.sh`
//! builds (Debian's piglit and the selection of `tests/piglit/selection.txt`), mounted read-only
//! in a guest that runs each test as one job of the control channel, the way piglit's own runner
//! runs it (one process, `-auto`, `-fbo` where it may run concurrently, the gbm platform), and
//! classifies its result the way piglit does. The host drives the list: every test is bounded in
//! the guest (`timeout`) and on the host (the job's wait), and a guest that goes away is booted
//! again (at most [`MAX_RELAUNCHES`] times) to go on with the next test.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::control::{ChannelError, ControlChannel, JobReport};
use crate::guest::{
    GuestConfig, GuestImage, RunningGuest, cache_path, mount_second_disk, second_disk,
    skip_without_guest,
};

/// Where the disk is mounted in the guest.
pub const MOUNT: &str = "/tmp/work/piglit";
/// A test's limit in the guest: piglit's tests take about a second each under TCG, the first
/// one of a boot about ten (Mesa's shader cache is cold).
pub const TEST_LIMIT: Duration = Duration::from_secs(120);
/// How much longer than [`TEST_LIMIT`] the host waits for a test's job to end: `timeout`'s
/// 5-s kill delay, the agent's report, a slow guest.
const JOB_SLACK: Duration = Duration::from_secs(30);
/// How long the host waits for a job it stopped: the agent's SIGTERM grace (15 s) and SIGKILL
/// delay (5 s), and a slow guest.
const STOP_WAIT: Duration = Duration::from_secs(40);
/// Boots of the guest after the first, when one went away in the middle of the list (its
/// QEMU or its device process ended: a boot under TCG costs about 20 s).
pub const MAX_RELAUNCHES: usize = 20;
/// How often the host looks at the device process while a test runs: a device that died
/// leaves the guest's GL programs waiting for ever, so its end is a lost test at once.
const LIVENESS_POLL: Duration = Duration::from_secs(1);
/// Bytes of a test's output kept for the report (its last ones).
const DETAIL_BYTES: usize = 1024;
/// Most tests a list may hold (the selection has about a thousand).
const MAX_TESTS: usize = 20_000;
/// Longest wait for the agent's first answer after a boot.
const BOOT_WAIT: Duration = Duration::from_secs(600);

/// What can go wrong before or between tests (a test's own failure is a [`TestResult`]).
#[derive(Debug, thiserror::Error)]
pub enum PiglitError {
    #[error("no piglit disk in {dir} ({why}); run qemu-scripts/build-piglit-disk.sh")]
    NoDisk { dir: PathBuf, why: String },
    #[error("{path}: line {line}: {why}")]
    BadList {
        path: PathBuf,
        line: usize,
        why: String,
    },
    #[error("booting the guest: {0}")]
    Boot(String),
    #[error("the guest's control channel: {0}")]
    Channel(#[from] ChannelError),
    #[error("mounting the piglit disk in the guest failed: {0}")]
    Mount(String),
}

/// One test of the list.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, Serialize)]
pub struct PiglitTest {
    /// Piglit's name (`spec@arb_sync@repeat-wait`).
    pub name: String,
    /// The selection's group (`tests/piglit/selection.txt`).
    pub group: String,
    /// The program in piglit's `bin/` and its arguments.
    pub argv: Vec<String>,
}

/// The piglit disk and its test list.
#[derive(Debug, Clone)]
pub struct PiglitDisk {
    pub image: PathBuf,
    pub tests: Vec<PiglitTest>,
}

impl PiglitDisk {
    /// `$VGPU_PIGLIT_DISK`, or `piglit` in `${VGPU_CACHE:-$HOME/.cache/vgpu}`.
    pub fn default_dir() -> PathBuf {
        cache_path("VGPU_PIGLIT_DISK", "piglit")
    }

    /// The disk in `dir` (`piglit.ext4`, `tests.json`).
    pub fn at(dir: &Path) -> Result<Self, PiglitError> {
        let no_disk = |why: String| PiglitError::NoDisk {
            dir: dir.to_path_buf(),
            why,
        };
        let image = dir.join("piglit.ext4");
        if !image.is_file() {
            return Err(no_disk("piglit.ext4 is missing".into()));
        }
        let path = dir.join("tests.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| no_disk(format!("tests.json: {e}")))?;
        let tests = parse_list(&path, &text)?;
        Ok(Self { image, tests })
    }
}

/// Environment variable turning a missing piglit disk from a skip into a failure (test.sh).
pub const REQUIRE_PIGLIT_ENV: &str = "VGPU_REQUIRE_PIGLIT";

/// The guest image and the piglit disk, or `None` after saying why a test is skipped (a panic
/// instead when [`REQUIRE_PIGLIT_ENV`] is set and the disk is missing).
pub fn skip_without_piglit() -> Option<(GuestImage, PiglitDisk)> {
    let image = skip_without_guest()?;
    match PiglitDisk::at(&PiglitDisk::default_dir()) {
        Ok(disk) => Some((image, disk)),
        Err(e) if std::env::var_os(REQUIRE_PIGLIT_ENV).is_some() => panic!("{e}"),
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

/// Parses the disk's `tests.json` (one test per line).
fn parse_list(path: &Path, text: &str) -> Result<Vec<PiglitTest>, PiglitError> {
    let mut tests = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |why: String| PiglitError::BadList {
            path: path.to_path_buf(),
            line: i + 1,
            why,
        };
        if tests.len() == MAX_TESTS {
            return Err(bad(format!("more than {MAX_TESTS} tests")));
        }
        let test: PiglitTest = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let program = test.argv.first().ok_or_else(|| bad("no program".into()))?;
        if program.contains('/') || program.starts_with('.') || program.is_empty() {
            return Err(bad(format!("program {program:?} is not a name in bin/")));
        }
        if test
            .argv
            .iter()
            .any(|a| a.contains('\0') || a.contains('\n'))
        {
            return Err(bad("an argument holds a NUL or a newline".into()));
        }
        tests.push(test);
    }
    Ok(tests)
}

/// A test's result, as piglit's runner names them, and `lost` for a test whose guest went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Pass,
    Warn,
    Fail,
    Skip,
    Crash,
    Timeout,
    Lost,
}

impl Outcome {
    pub const ALL: [Outcome; 7] = [
        Outcome::Pass,
        Outcome::Warn,
        Outcome::Fail,
        Outcome::Skip,
        Outcome::Crash,
        Outcome::Timeout,
        Outcome::Lost,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Warn => "warn",
            Outcome::Fail => "fail",
            Outcome::Skip => "skip",
            Outcome::Crash => "crash",
            Outcome::Timeout => "timeout",
            Outcome::Lost => "lost",
        }
    }
}

/// One test's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TestResult {
    pub name: String,
    pub group: String,
    pub outcome: Outcome,
    /// The program's exit status as the guest's shell gives it (128 + N: signal N).
    pub rc: Option<i32>,
    /// Its run time in the guest.
    pub ms: Option<u64>,
    /// The last [`DETAIL_BYTES`] bytes of its output, or why there is no result.
    pub detail: String,
}

/// Quotes `s` for bash (single quotes).
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The job that mounts the disk and checks that piglit's programs load (ends 0 when they do).
pub fn mount_script() -> String {
    let mount = mount_second_disk(MOUNT);
    format!("{mount}test -x {MOUNT}/bin/shader_runner || exit 2\n")
}

/// The job that runs `test` with `limit`, as piglit's runner would, and reports one `SUMMARY`
/// line of JSON: the `PIGLIT:` result line's result (empty when there is none), the exit
/// status, the run time and the output's last bytes (hex).
pub fn test_script(test: &PiglitTest, limit: Duration) -> String {
    let argv: Vec<String> = test.argv.iter().map(|a| quote(a)).collect();
    format!(
        r#"cd {MOUNT} || exit 90
export LD_LIBRARY_PATH={MOUNT}/lib:{MOUNT}/deps PIGLIT_PLATFORM=gbm PIGLIT_SOURCE_DIR={MOUNT}
s=$(date +%s%N)
out=$(timeout -k 5 {secs} ./bin/{argv} 2>&1 </dev/null); rc=$?
e=$(date +%s%N)
r=$(printf '%s\n' "$out" | sed -n 's/^PIGLIT: {{"result": "\([a-z]*\)".*/\1/p' | tail -n 1)
t=$(printf '%s\n' "$out" | tail -c {DETAIL_BYTES} | od -An -v -tx1 | tr -d ' \n')
echo "SUMMARY {{\"result\":\"$r\",\"rc\":$rc,\"ms\":$(( (e - s) / 1000000 )),\"tail\":\"$t\"}}"
"#,
        secs = limit.as_secs(),
        argv = argv.join(" "),
    )
}

/// Bytes from their hex digits (`od -tx1`), `None` if `hex` is not that.
fn from_hex(hex: &str) -> Option<Vec<u8>> {
    let digits = hex.as_bytes();
    if digits.len() % 2 != 0 {
        return None;
    }
    digits
        .chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

/// Classifies a test's job report the way piglit's runner does: the program's own result line,
/// made `warn` when a passing program exits non-zero; `crash` when it died of a signal or gave no
/// result; `timeout` when `timeout` ended it.
pub fn interpret(test: &PiglitTest, report: &JobReport) -> TestResult {
    let mut result = unreported(test, Outcome::Crash, String::new());
    let Some(summary) = report
        .summaries
        .iter()
        .find_map(|s| serde_json::from_str::<serde_json::Value>(s).ok())
    else {
        result.detail = match (&report.error, report.exit) {
            (Some(e), _) => format!("the agent: {e}"),
            (None, Some(code)) => format!("the job ended {code} without a summary"),
            (None, None) => "no summary".into(),
        };
        return result;
    };
    let rc = summary["rc"].as_i64().and_then(|r| i32::try_from(r).ok());
    result.rc = rc;
    result.ms = summary["ms"].as_u64();
    result.detail = summary["tail"]
        .as_str()
        .and_then(from_hex)
        .map(|b| String::from_utf8_lossy(&b).trim_end().to_owned())
        .unwrap_or_default();
    let own = match summary["result"].as_str().unwrap_or("") {
        "pass" => Some(Outcome::Pass),
        "warn" => Some(Outcome::Warn),
        "fail" => Some(Outcome::Fail),
        "skip" => Some(Outcome::Skip),
        "crash" => Some(Outcome::Crash),
        _ => None,
    };
    result.outcome = match (rc, own) {
        // timeout(1): 124 when it sent SIGTERM, 137 when SIGKILL followed.
        (Some(124 | 137), _) => Outcome::Timeout,
        (Some(rc), _) if rc > 128 => Outcome::Crash,
        (Some(rc), Some(Outcome::Pass)) if rc != 0 => Outcome::Warn,
        (_, Some(own)) => own,
        (_, None) => Outcome::Crash,
    };
    result
}

/// `test`'s result when the program reported none: `outcome` and why.
fn unreported(test: &PiglitTest, outcome: Outcome, why: String) -> TestResult {
    TestResult {
        name: test.name.clone(),
        group: test.group.clone(),
        outcome,
        rc: None,
        ms: None,
        detail: why,
    }
}

/// A booted guest with the disk mounted.
struct Booted {
    guest: RunningGuest,
}

impl Booted {
    fn boot(config: &GuestConfig) -> Result<Self, PiglitError> {
        let mut guest =
            RunningGuest::launch(config).map_err(|e| PiglitError::Boot(e.to_string()))?;
        let ch = channel(&mut guest)?;
        ch.hello(BOOT_WAIT)?;
        ch.start("mount", &mount_script(), BOOT_WAIT)?;
        let report = ch.wait_exit("mount", BOOT_WAIT)?;
        if report.exit != Some(0) {
            return Err(PiglitError::Mount(format!(
                "exit {:?} {}",
                report.exit,
                report.error.unwrap_or_default()
            )));
        }
        Ok(Self { guest })
    }

    /// Runs one test as job `id`; `Err` when the guest no longer answers.
    fn run(&mut self, id: &str, test: &PiglitTest) -> Result<TestResult, String> {
        let ch = channel(&mut self.guest).map_err(|e| e.to_string())?;
        ch.start(id, &test_script(test, TEST_LIMIT), JOB_SLACK)
            .map_err(|e| format!("starting the test: {e}"))?;
        let deadline = Instant::now() + TEST_LIMIT + JOB_SLACK;
        let outcome = loop {
            let ch = channel(&mut self.guest).map_err(|e| e.to_string())?;
            match ch.wait_exit(id, LIVENESS_POLL) {
                Err(ChannelError::Timeout { .. }) if Instant::now() < deadline => {}
                other => break other,
            }
            if let Some(status) = self.guest.server_exited().map_err(|e| e.to_string())? {
                return Err(format!("the device process ended ({status})"));
            }
        };
        let ch = channel(&mut self.guest).map_err(|e| e.to_string())?;
        match outcome {
            Ok(report) => Ok(interpret(test, &report)),
            Err(ChannelError::Timeout { .. }) => {
                // Past the guest's own limit: the guest is stuck or too slow; stop the job and
                // go on if the agent still answers.
                ch.stop(id).map_err(|e| e.to_string())?;
                ch.wait_exit(id, STOP_WAIT)
                    .map_err(|e| format!("the stopped test did not end: {e}"))?;
                Ok(unreported(
                    test,
                    Outcome::Timeout,
                    "the job outlived its limit; stopped".into(),
                ))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// Ends the guest: the agent quits and the guest powers off (killed if it does not).
    fn finish(mut self) {
        if let Ok(ch) = channel(&mut self.guest) {
            let _ = ch.quit(STOP_WAIT);
        }
        if let Err(e) = self.guest.end(STOP_WAIT) {
            log::warn!("the piglit guest did not end cleanly: {e}");
        }
    }

    /// Ends a guest that stopped answering; says how QEMU and the server ended and what they
    /// printed last.
    fn post_mortem(self) -> String {
        match self.guest.end(Duration::from_secs(10)) {
            Err(e) => format!("(ending the guest: {e})"),
            Ok(run) => {
                let last = |log: &str| {
                    let lines: Vec<&str> = log.lines().rev().take(3).collect();
                    lines.into_iter().rev().collect::<Vec<_>>().join(" / ")
                };
                let mut why = format!("QEMU {}", run.qemu_status);
                if !run.qemu_log.trim().is_empty() {
                    why += &format!(": {}", last(&run.qemu_log));
                }
                if let Some(log) = run.server_log.filter(|l| !l.trim().is_empty()) {
                    why += &format!("; server: {}", last(&log));
                }
                why
            }
        }
    }
}

fn channel(guest: &mut RunningGuest) -> Result<&mut ControlChannel, PiglitError> {
    guest
        .control()
        .ok_or_else(|| PiglitError::Boot("a guest without its control channel".into()))
}

/// Runs `tests` in guests booted from `config` (made an agent guest with the disk attached),
/// reporting each result to `on_result` as it comes. A guest that stops answering costs the
/// test it was running (`lost`) and is booted again, at most [`MAX_RELAUNCHES`] times; past
/// that the remaining tests are `lost` too. `Err` only when the first boot fails.
pub fn run(
    config: &GuestConfig,
    disk: &PiglitDisk,
    tests: &[PiglitTest],
    mut on_result: impl FnMut(&TestResult),
) -> Result<Vec<TestResult>, PiglitError> {
    let mut config = config.clone().agent();
    // Every test is bounded on its own; the boot's limit only has to outlast them all.
    let per_test = TEST_LIMIT + JOB_SLACK + STOP_WAIT;
    config.timeout = BOOT_WAIT * 2 + per_test * u32::try_from(tests.len()).unwrap_or(u32::MAX);
    let (qemu, _) = second_disk(&disk.image, MOUNT);
    config.extra_qemu_args.extend(qemu);
    let mut booted = Some(Booted::boot(&config)?);
    let mut relaunches = 0;
    let mut results = Vec::with_capacity(tests.len());
    let mut reboot = |booted: &mut Option<Booted>| {
        if relaunches < MAX_RELAUNCHES {
            relaunches += 1;
            let started = Instant::now();
            match Booted::boot(&config) {
                Ok(b) => *booted = Some(b),
                Err(e) => log::warn!(
                    "piglit: booting again failed after {:?}: {e}",
                    started.elapsed()
                ),
            }
        }
    };
    for (i, test) in tests.iter().enumerate() {
        let result = match booted.as_mut() {
            None => unreported(test, Outcome::Lost, "the guest went away too often".into()),
            Some(b) => match b.run(&format!("t{i}"), test) {
                Ok(r) => r,
                Err(why) => {
                    let ended = booted.take().map(Booted::post_mortem).unwrap_or_default();
                    let why = format!("{why}; {ended}");
                    log::warn!("piglit: the guest went away during {}: {why}", test.name);
                    reboot(&mut booted);
                    unreported(test, Outcome::Lost, format!("the guest went away: {why}"))
                }
            },
        };
        // A test that outlived even timeout's SIGKILL is stuck in the guest's kernel (its GPU
        // no longer answers): the next tests get a new boot.
        if result.outcome == Outcome::Timeout && result.rc.is_none() {
            if let Some(b) = booted.take() {
                log::warn!("piglit: {} is stuck; booting again", test.name);
                b.finish();
            }
            reboot(&mut booted);
        }
        on_result(&result);
        results.push(result);
    }
    if let Some(b) = booted {
        b.finish();
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test(argv: &[&str]) -> PiglitTest {
        PiglitTest {
            name: "spec@x@y".into(),
            group: "g".into(),
            argv: argv.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn report(summary: &str, exit: i32) -> JobReport {
        JobReport {
            started: true,
            summaries: vec![summary.to_owned()],
            exit: Some(exit),
            error: None,
        }
    }

    fn outcome(result: &str, rc: i32) -> Outcome {
        let s = format!(r#"{{"result":"{result}","rc":{rc},"ms":5,"tail":"6f6b0a"}}"#);
        interpret(&test(&["p"]), &report(&s, 0)).outcome
    }

    #[test]
    fn results_are_classified_as_piglit_does() {
        assert_eq!(outcome("pass", 0), Outcome::Pass);
        assert_eq!(outcome("fail", 1), Outcome::Fail);
        assert_eq!(outcome("skip", 0), Outcome::Skip);
        assert_eq!(outcome("pass", 1), Outcome::Warn);
        assert_eq!(outcome("", 1), Outcome::Crash);
        assert_eq!(outcome("", 139), Outcome::Crash);
        assert_eq!(outcome("pass", 134), Outcome::Crash);
        assert_eq!(outcome("", 124), Outcome::Timeout);
        assert_eq!(outcome("fail", 137), Outcome::Timeout);
        let s = r#"{"result":"fail","rc":1,"ms":7,"tail":"6f6b0a"}"#;
        let r = interpret(&test(&["p"]), &report(s, 0));
        assert_eq!((r.rc, r.ms, r.detail.as_str()), (Some(1), Some(7), "ok"));
    }

    #[test]
    fn a_job_without_a_summary_is_a_crash_that_says_why() {
        let mut r = report("not json", 90);
        let got = interpret(&test(&["p"]), &r);
        assert_eq!(got.outcome, Outcome::Crash);
        assert!(got.detail.contains("ended 90"), "{}", got.detail);
        r.error = Some("refused".into());
        assert!(interpret(&test(&["p"]), &r).detail.contains("refused"));
    }

    #[test]
    fn arguments_are_quoted_for_the_shell() {
        let script = test_script(&test(&["prog", "it's", "a b", "$(x)"]), TEST_LIMIT);
        assert!(
            script.contains(r"./bin/'prog' 'it'\''s' 'a b' '$(x)' 2>&1"),
            "{script}"
        );
        assert!(script.contains("timeout -k 5 120 "));
        assert_eq!(from_hex("6f6b0a").as_deref(), Some(&b"ok\n"[..]));
        assert_eq!(from_hex("6f6"), None);
        assert_eq!(from_hex("zz"), None);
    }

    #[test]
    fn the_list_is_validated() {
        let p = Path::new("tests.json");
        let ok =
            r#"{"name":"a","group":"g","argv":["shader_runner","tests/x.shader_test","-auto"]}"#;
        assert_eq!(parse_list(p, &format!("{ok}\n\n{ok}\n")).unwrap().len(), 2);
        for bad in [
            r#"{"name":"a","group":"g","argv":[]}"#,
            r#"{"name":"a","group":"g","argv":["../../bin/sh"]}"#,
            r#"{"name":"a","group":"g","argv":["/bin/sh"]}"#,
            r#"{"name":"a","group":"g","argv":["p","x\ny"]}"#,
            r#"{"name":"a","group":"g"}"#,
            "[",
        ] {
            let e = parse_list(p, &format!("{ok}\n{bad}\n")).unwrap_err();
            assert!(e.to_string().contains("line 2"), "{bad}: {e}");
        }
    }
}
