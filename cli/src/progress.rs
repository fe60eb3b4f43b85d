//! Progress of a long job made of steps (scenario files, experiment runs) on standard error:
//! an `indicatif` bar when standard error is a terminal, otherwise plain lines, one when a
//! step starts and one every [`LINE_PERIOD`] while it runs, so that CI logs show where a
//! long run is without a bar's control sequences.

use std::io::{IsTerminal, Write};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How often a plain-line report repeats while a step runs: often enough that a log shows the
/// job is alive, rarely enough that a run of an hour prints a page, not a book.
pub const LINE_PERIOD: Duration = Duration::from_secs(30);
/// The bar: what, how long so far, how far, how long still, the current step.
const BAR_TEMPLATE: &str =
    "{prefix} {spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} (eta {eta}) {msg}";
/// How often the bar redraws by itself (its spinner and elapsed time) between steps.
const BAR_TICK: Duration = Duration::from_millis(250);

/// A job's progress: `total` steps, each started with [`Progress::step`] and ended with
/// [`Progress::advance`].
#[derive(Debug)]
pub struct Progress {
    out: Output,
}

#[derive(Debug)]
enum Output {
    Bar(ProgressBar),
    Lines {
        shared: Arc<Lines>,
        stop: Option<mpsc::Sender<()>>,
        ticker: Option<JoinHandle<()>>,
    },
}

/// The plain-line reporter's state, shared with its periodic thread.
struct Lines {
    prefix: String,
    total: u64,
    started: Instant,
    state: Mutex<LineState>,
}

struct LineState {
    done: u64,
    step: String,
    out: Box<dyn Write + Send>,
}

impl std::fmt::Debug for Lines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lines")
            .field("prefix", &self.prefix)
            .field("total", &self.total)
            .finish_non_exhaustive()
    }
}

impl Progress {
    /// A bar if standard error is a terminal, plain lines on standard error otherwise;
    /// `prefix` starts every line (the program's name).
    pub fn new(prefix: &str, total: u64) -> Progress {
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total);
            // The template is a constant: a mistake in it is a bug found by the unit test.
            let style = ProgressStyle::with_template(BAR_TEMPLATE)
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_prefix(prefix.to_owned());
            bar.enable_steady_tick(BAR_TICK);
            Progress {
                out: Output::Bar(bar),
            }
        } else {
            Progress::lines(prefix, total, Box::new(std::io::stderr()), LINE_PERIOD)
        }
    }

    /// Plain lines to `out`, repeated every `period` while a step runs.
    fn lines(prefix: &str, total: u64, out: Box<dyn Write + Send>, period: Duration) -> Progress {
        let shared = Arc::new(Lines {
            prefix: prefix.to_owned(),
            total,
            started: Instant::now(),
            state: Mutex::new(LineState {
                done: 0,
                step: String::new(),
                out,
            }),
        });
        let (stop, stopped) = mpsc::channel::<()>();
        let periodic = Arc::clone(&shared);
        // Without the thread the job still runs; only the repeated lines are missing.
        let ticker = std::thread::Builder::new()
            .name("progress".into())
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(period) {
                    periodic.report("running");
                }
            })
            .ok();
        Progress {
            out: Output::Lines {
                shared,
                stop: Some(stop),
                ticker,
            },
        }
    }

    /// Starts the next step, described by `what`.
    pub fn step(&self, what: &str) {
        match &self.out {
            Output::Bar(bar) => bar.set_message(what.to_owned()),
            Output::Lines { shared, .. } => {
                shared.lock().step = what.to_owned();
                shared.report("starting");
            }
        }
    }

    /// Ends the current step.
    pub fn advance(&self) {
        match &self.out {
            Output::Bar(bar) => bar.inc(1),
            Output::Lines { shared, .. } => {
                let mut state = shared.lock();
                state.done = state.done.saturating_add(1);
            }
        }
    }

    /// Prints a line of the job's own (an event, a result, an error) without breaking the bar.
    pub fn note(&self, line: &str) {
        match &self.out {
            Output::Bar(bar) => bar.suspend(|| eprintln!("{line}")),
            Output::Lines { shared, .. } => shared.write(line),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        match &mut self.out {
            Output::Bar(bar) => bar.finish_and_clear(),
            Output::Lines {
                shared,
                stop,
                ticker,
            } => {
                // Dropping the sender ends the periodic thread's wait at once.
                drop(stop.take());
                // The thread only writes lines: a panic there has printed its message.
                if let Some(t) = ticker.take() {
                    let _ = t.join();
                }
                let done = shared.lock().done;
                shared.write(&format!(
                    "{} [{done}/{}] finished in {}",
                    shared.prefix,
                    shared.total,
                    minutes(shared.started.elapsed())
                ));
            }
        }
    }
}

impl Lines {
    fn lock(&self) -> std::sync::MutexGuard<'_, LineState> {
        // A panic while holding the lock leaves only a progress line half written.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self, line: &str) {
        let mut state = self.lock();
        // Progress is best effort: a closed standard error must not stop the job.
        let _ = writeln!(state.out, "{line}");
    }

    /// `PREFIX [done/total] STEP: EVENT (elapsed 1m05s, about 3m20s left)`.
    fn report(&self, event: &str) {
        let mut state = self.lock();
        let elapsed = self.started.elapsed();
        let left = match remaining(elapsed, state.done, self.total) {
            Some(left) => format!(", about {} left", minutes(left)),
            None => String::new(),
        };
        let line = format!(
            "{} [{}/{}] {}: {event} (elapsed {}{left})",
            self.prefix,
            state.done,
            self.total,
            state.step,
            minutes(elapsed)
        );
        let _ = writeln!(state.out, "{line}");
    }
}

/// The time the steps not yet done should take at the pace of those done; `None` before the
/// first step ends.
pub fn remaining(elapsed: Duration, done: u64, total: u64) -> Option<Duration> {
    let per_step = elapsed.checked_div(u32::try_from(done).ok().filter(|&d| d > 0)?)?;
    let left = u32::try_from(total.saturating_sub(done)).unwrap_or(u32::MAX);
    per_step.checked_mul(left)
}

/// `12m05s`.
pub fn minutes(d: Duration) -> String {
    let s = d.as_secs();
    format!("{}m{:02}s", s / 60, s % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Shared {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    #[test]
    fn plain_lines_name_the_step_and_repeat_while_it_runs() {
        let out = Shared::default();
        let p = Progress::lines("job", 3, Box::new(out.clone()), Duration::from_millis(20));
        p.step("first");
        p.note("an event");
        let deadline = Instant::now() + Duration::from_secs(10);
        while out.text().matches("running").count() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        p.advance();
        p.step("second");
        drop(p);
        let text = out.text();
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("job [0/3] first: starting (elapsed 0m0"),
            "{text}"
        );
        assert_eq!(lines[1], "an event");
        assert!(
            lines
                .iter()
                .filter(|l| l.contains("first: running"))
                .count()
                >= 2,
            "{text}"
        );
        assert!(
            text.contains("job [1/3] second: starting") && text.contains("left)"),
            "{text}"
        );
        assert!(
            lines
                .last()
                .unwrap()
                .starts_with("job [1/3] finished in 0m0"),
            "{text}"
        );
        // No control sequences in a log.
        assert!(!text.contains('\x1b') && !text.contains('\r'), "{text}");
    }

    #[test]
    fn the_bar_template_is_valid() {
        assert!(ProgressStyle::with_template(BAR_TEMPLATE).is_ok());
        // The bar of a test run (stderr is not a terminal under the harness, or is) works.
        let p = Progress::new("job", 2);
        p.step("one");
        p.advance();
    }

    #[test]
    fn remaining_time_follows_the_pace_so_far() {
        assert_eq!(remaining(Duration::from_secs(60), 0, 4), None);
        assert_eq!(
            remaining(Duration::from_secs(60), 2, 5),
            Some(Duration::from_secs(90))
        );
        assert_eq!(
            remaining(Duration::from_secs(60), 5, 5),
            Some(Duration::ZERO)
        );
        assert_eq!(minutes(Duration::from_secs(3725)), "62m05s");
    }
}
