//! Owns progress a person can read at a glance, for `train` and `sweep`: the estimates, the
//! choice of what stderr shows, and the live bar with log lines printed above it.
//! Keeps: the estimates are pure functions of the times given; log lines print above the bar.
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressState, ProgressStyle};
use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The tracing target of periodic progress lines: while a live bar shows the same figures,
/// stderr leaves them out (the log file keeps every one).
pub const TARGET: &str = "oomguard::progress";

/// Seconds per unit of work (a step, an evaluation, a trial) over the most recent `window`:
/// a mean without the slowest and fastest tenth, so that one OOM retry or warm-up step does
/// not swing it, while a lasting change (a shrink, a grow-back) takes over within a window.
#[derive(Debug, Clone)]
pub struct Pace {
    recent: VecDeque<f64>,
    window: usize,
}

impl Pace {
    pub fn new(window: usize) -> Pace {
        Pace {
            recent: VecDeque::with_capacity(window.min(64)),
            window: window.max(1),
        }
    }

    pub fn add(&mut self, secs: f64) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back(secs);
    }

    /// None before anything was measured.
    pub fn mean(&self) -> Option<f64> {
        let mut v: Vec<f64> = self.recent.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        let trim = v.len() / 10;
        let kept = &v[trim..v.len() - trim];
        (!kept.is_empty()).then(|| kept.iter().sum::<f64>() / kept.len() as f64)
    }
}

/// What a run has left to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Work {
    pub steps: u64,
    pub evals: u64,
    pub checkpoints: u64,
}

/// When a run evaluates and checkpoints (`train.max_steps`, `train.eval_every`,
/// `checkpoint.every_steps`): the loop asks it, and so does the ETA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    pub max_steps: u64,
    pub eval_every: u64,
    pub checkpoint_every: u64,
}

impl Schedule {
    /// Whether step `step` (0-based) is followed by an evaluation: every `eval_every`
    /// steps, and after the last.
    pub fn evaluates(&self, step: u64) -> bool {
        step + 1 == self.max_steps || (self.eval_every > 0 && (step + 1).is_multiple_of(self.eval_every))
    }

    /// Whether step `step` is followed by a periodic checkpoint.
    pub fn checkpoints(&self, step: u64) -> bool {
        self.checkpoint_every > 0 && (step + 1).is_multiple_of(self.checkpoint_every)
    }

    /// What is left once step `step` has trained: the later steps, and the evaluations and
    /// checkpoints from this step's on, the final ones included.
    pub fn left_at(&self, step: u64) -> Work {
        let step = step.min(self.max_steps.saturating_sub(1));
        // Multiples of `every` in step+1..=max_steps.
        let multiples = |every: u64| self.max_steps.checked_div(every).map_or(0, |m| m - step / every);
        // The last step evaluates and checkpoints once more unless a multiple already did (a
        // second checkpoint of the same step is found written and costs nothing).
        let more = |every: u64| (every == 0 || !self.max_steps.is_multiple_of(every)) as u64;
        Work {
            steps: self.max_steps - step - 1,
            evals: multiples(self.eval_every) + more(self.eval_every),
            checkpoints: multiples(self.checkpoint_every) + more(self.checkpoint_every),
        }
    }
}

/// A run's ETA: the recent pace of steps, and evaluations and checkpoints at their measured
/// cost (nothing for a kind not measured yet).
#[derive(Debug, Clone)]
pub struct Eta {
    pub steps: Pace,
    pub evals: Pace,
    pub checkpoints: Pace,
}

impl Default for Eta {
    fn default() -> Eta {
        Eta {
            steps: Pace::new(50),
            evals: Pace::new(8),
            checkpoints: Pace::new(8),
        }
    }
}

impl Eta {
    /// Seconds until `left` is done; None before a step was measured.
    pub fn remaining(&self, left: Work) -> Option<f64> {
        let each = |pace: &Pace, n: u64| n as f64 * pace.mean().unwrap_or(0.0);
        Some(
            left.steps as f64 * self.steps.mean()?
                + each(&self.evals, left.evals)
                + each(&self.checkpoints, left.checkpoints),
        )
    }
}

/// A duration as people read it: `4.7s`, `47s`, `3m05s`, `2h07m`, `3d04h`.
pub fn human_duration(secs: f64) -> String {
    let secs = if secs.is_finite() { secs.max(0.0) } else { 0.0 };
    if secs < 9.95 {
        return format!("{secs:.1}s");
    }
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

/// A pace as tqdm shows it: `4.90 it/s`, or `3.20 s/it` when slower than one a second.
pub fn rate(secs_per_unit: f64) -> String {
    match secs_per_unit {
        s if s > 1.0 => format!("{s:.2} s/it"),
        s if s > 0.0 => format!("{:.2} it/s", 1.0 / s),
        _ => "? it/s".into(),
    }
}

/// `12s, ETA 47s` (`ETA ?` while unknown): the tail of every progress line.
pub fn elapsed_eta(elapsed: f64, eta: Option<f64>) -> String {
    format!(
        "{}, ETA {}",
        human_duration(elapsed),
        eta.map_or("?".into(), human_duration)
    )
}

/// What stderr shows, decided once per process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Console {
    pub colour: bool,
    pub bar: bool,
}

impl Console {
    /// Colour and a live bar on a terminal only; `NO_COLOR` takes the colour away,
    /// `TERM=dumb` both (it cannot move the cursor); JSON logs get neither, and a launched
    /// worker (`RANK` set) no bar: its lines are prefixed and merged with the others'.
    pub fn decide(json: bool, terminal: bool, env: &dyn Fn(&str) -> Option<String>) -> Console {
        let dumb = env("TERM").is_some_and(|t| t == "dumb");
        let no_color = env("NO_COLOR").is_some_and(|v| !v.is_empty());
        let worker = env("RANK").is_some() || env("LOCAL_RANK").is_some();
        Console {
            colour: terminal && !dumb && !no_color && !json,
            bar: terminal && !dumb && !json && !worker,
        }
    }
}

static BARS_ALLOWED: AtomicBool = AtomicBool::new(false);
/// The bar on screen, if any: log lines are written around it.
static LIVE: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Whether `Bar::start` draws (set by `init_tracing` from `Console::bar`).
pub fn allow_bars(allowed: bool) {
    BARS_ALLOWED.store(allowed, Ordering::SeqCst);
}

fn live() -> Option<ProgressBar> {
    LIVE.lock().ok().and_then(|b| b.clone())
}

/// Elapsed time and the ETA as last estimated, counting down between updates.
#[derive(Debug, Clone, Copy)]
struct Clock {
    start: Instant,
    eta: Option<(f64, Instant)>,
}

/// A live progress bar on stderr. Log lines print above it while it lives; dropped
/// unfinished (an error, a signal), it stays on screen as it was.
pub struct Bar {
    bar: ProgressBar,
    clock: Arc<Mutex<Clock>>,
}

impl Bar {
    /// A bar from `pos` to `len` drawn by `template` (indicatif's, plus `{clock}`: `12s<47s`),
    /// its elapsed time counted from `start`; None where the console draws no bar.
    pub fn start(template: &str, len: u64, pos: u64, start: Instant) -> Option<Bar> {
        if !BARS_ALLOWED.load(Ordering::SeqCst) {
            return None;
        }
        let clock = Arc::new(Mutex::new(Clock { start, eta: None }));
        let c = clock.clone();
        let style = ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
        let style = style.with_key("clock", move |_: &ProgressState, w: &mut dyn std::fmt::Write| {
            if let Ok(c) = c.lock() {
                let eta = c.eta.map(|(eta, at)| (eta - at.elapsed().as_secs_f64()).max(0.0));
                let _ = write!(
                    w,
                    "{}<{}",
                    human_duration(c.start.elapsed().as_secs_f64()),
                    eta.map_or("?".into(), human_duration)
                );
            }
        });
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr())
            .with_style(style)
            .with_finish(ProgressFinish::Abandon);
        bar.set_position(pos);
        // Redrawn between updates, so that the clock runs through a long step or evaluation.
        bar.enable_steady_tick(Duration::from_millis(500));
        if let Ok(mut l) = LIVE.lock() {
            *l = Some(bar.clone());
        }
        Some(Bar { bar, clock })
    }

    pub fn update(&self, pos: u64, eta: Option<f64>, message: String) {
        if let Ok(mut c) = self.clock.lock() {
            c.eta = eta.map(|e| (e, Instant::now()));
        }
        self.bar.set_position(pos);
        self.bar.set_message(message);
    }

    /// Leaves the bar on screen as it is; what is logged next prints below it.
    pub fn finish(self) {
        self.bar.finish();
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        if let Ok(mut l) = LIVE.lock() {
            *l = None;
        }
        if !self.bar.is_finished() {
            self.bar.abandon();
        }
    }
}

/// tracing's stderr writer: each log line is printed with the live bar cleared, then the bar
/// is drawn again below it; progress lines are left out while a bar shows the same.
#[derive(Debug, Clone, Copy, Default)]
pub struct StderrWriter {
    skip: bool,
}

impl Write for StderrWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.skip {
            return Ok(buf.len());
        }
        match live() {
            Some(bar) => bar.suspend(|| std::io::stderr().write_all(buf)).map(|_| buf.len()),
            None => std::io::stderr().write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for StderrWriter {
    type Writer = StderrWriter;

    fn make_writer(&'a self) -> StderrWriter {
        StderrWriter { skip: false }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> StderrWriter {
        StderrWriter {
            skip: meta.target() == TARGET && live().is_some(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pace_ignores_one_outlier_and_follows_a_lasting_change() {
        let mut p = Pace::new(20);
        assert_eq!(p.mean(), None);
        for _ in 0..19 {
            p.add(0.1);
        }
        p.add(5.0); // an OOM: the step ran twice and emptied the cache
        assert!((p.mean().unwrap() - 0.1).abs() < 1e-9, "{:?}", p.mean());
        for _ in 0..20 {
            p.add(0.2); // micro-batch halved, accumulation doubled: slower for good
        }
        assert!((p.mean().unwrap() - 0.2).abs() < 1e-9);
        p.add(f64::NAN);
        assert!((p.mean().unwrap() - 0.2).abs() < 1e-9);
        // Few samples: a plain mean.
        let mut q = Pace::new(50);
        q.add(1.0);
        q.add(3.0);
        assert_eq!(q.mean(), Some(2.0));
    }

    #[test]
    fn schedule_counts_what_is_left() {
        let s = Schedule {
            max_steps: 100,
            eval_every: 25,
            checkpoint_every: 40,
        };
        // After step 0 trained: evals after steps 25, 50, 75, 100; checkpoints 40, 80, final.
        assert_eq!(
            s.left_at(0),
            Work {
                steps: 99,
                evals: 4,
                checkpoints: 3
            }
        );
        // Step 24's own evaluation is still to come.
        assert_eq!(
            s.left_at(24),
            Work {
                steps: 75,
                evals: 4,
                checkpoints: 3
            }
        );
        assert_eq!(
            s.left_at(25),
            Work {
                steps: 74,
                evals: 3,
                checkpoints: 3
            }
        );
        assert_eq!(
            s.left_at(99),
            Work {
                steps: 0,
                evals: 1,
                checkpoints: 1
            }
        );
        assert!(s.evaluates(24) && !s.evaluates(25) && s.evaluates(99) && s.checkpoints(39) && !s.checkpoints(40));
        // Only at the end: one evaluation, one checkpoint.
        let end = Schedule {
            max_steps: 30,
            eval_every: 0,
            checkpoint_every: 0,
        };
        assert_eq!(
            end.left_at(3),
            Work {
                steps: 26,
                evals: 1,
                checkpoints: 1
            }
        );
        // The last step not a multiple: it evaluates besides the multiples.
        let odd = Schedule {
            max_steps: 30,
            eval_every: 20,
            checkpoint_every: 0,
        };
        assert_eq!(
            odd.left_at(0),
            Work {
                steps: 29,
                evals: 2,
                checkpoints: 1
            }
        );
        assert!(odd.evaluates(19) && odd.evaluates(29) && !odd.evaluates(28));
        let even = Schedule {
            max_steps: 40,
            eval_every: 0,
            checkpoint_every: 20,
        };
        assert_eq!(
            even.left_at(0),
            Work {
                steps: 39,
                evals: 1,
                checkpoints: 2
            }
        );
        // Resumed past the end: nothing left but the final checkpoint.
        assert_eq!(
            end.left_at(40),
            Work {
                steps: 0,
                evals: 1,
                checkpoints: 1
            }
        );
    }

    #[test]
    fn eta_adds_evaluations_and_checkpoints_at_their_measured_cost() {
        let mut e = Eta::default();
        let left = Work {
            steps: 10,
            evals: 2,
            checkpoints: 3,
        };
        assert_eq!(e.remaining(left), None);
        e.steps.add(0.5);
        assert_eq!(e.remaining(left), Some(5.0)); // evaluations and checkpoints not measured yet
        e.evals.add(2.0);
        e.checkpoints.add(1.0);
        assert_eq!(e.remaining(left), Some(5.0 + 4.0 + 3.0));
    }

    #[test]
    fn durations_read_at_a_glance() {
        let cases = [
            (0.04, "0.0s"),
            (4.74, "4.7s"),
            (9.96, "10s"),
            (47.4, "47s"),
            (185.0, "3m05s"),
            (7620.0, "2h07m"),
            (273600.0, "3d04h"),
            (-1.0, "0.0s"),
            (f64::NAN, "0.0s"),
        ];
        for (secs, text) in cases {
            assert_eq!(human_duration(secs), text, "{secs}");
        }
        assert_eq!(elapsed_eta(12.0, Some(47.0)), "12s, ETA 47s");
        assert_eq!(elapsed_eta(12.0, None), "12s, ETA ?");
        assert_eq!(
            (rate(0.25), rate(3.2), rate(0.0)),
            ("4.00 it/s".into(), "3.20 s/it".into(), "? it/s".into())
        );
    }

    #[test]
    fn the_console_honours_terminals_no_color_dumb_json_and_workers() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(
            Console::decide(false, true, &env(&[("TERM", "xterm")])),
            Console {
                colour: true,
                bar: true
            }
        );
        assert_eq!(
            Console::decide(false, false, &env(&[])),
            Console {
                colour: false,
                bar: false
            }
        );
        assert_eq!(
            Console::decide(true, true, &env(&[])),
            Console {
                colour: false,
                bar: false
            }
        );
        assert_eq!(
            Console::decide(false, true, &env(&[("NO_COLOR", "1")])),
            Console {
                colour: false,
                bar: true
            }
        );
        assert_eq!(
            Console::decide(false, true, &env(&[("NO_COLOR", "")])),
            Console {
                colour: true,
                bar: true
            }
        );
        assert_eq!(
            Console::decide(false, true, &env(&[("TERM", "dumb")])),
            Console {
                colour: false,
                bar: false
            }
        );
        assert_eq!(
            Console::decide(false, true, &env(&[("RANK", "0")])),
            Console {
                colour: true,
                bar: false
            }
        );
    }
}
