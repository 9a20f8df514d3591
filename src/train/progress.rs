//! Owns a run's clock: elapsed time, the ETA and, for rank 0 on a terminal, the live bar.
//! Keeps: only the lead rank shows a bar.
use std::time::Instant;

use oomguard_console::progress::{self, Bar, Eta, Schedule};

/// indicatif's template for a training run (`{clock}`: elapsed<ETA).
const TEMPLATE: &str = "{pos}/{len} [{bar:20}] {clock} {msg}";

pub(super) struct Progress {
    start: Instant,
    /// The end of the last step, evaluation or checkpoint measured: each is timed from the
    /// one before, so the time between them (logging, metrics) is counted too.
    mark: Instant,
    eta: Eta,
    pub schedule: Schedule,
    bar: Option<Bar>,
}

/// What was measured, besides steps.
#[derive(Debug, Clone, Copy)]
pub(super) enum Other {
    Eval,
    Checkpoint,
}

impl Progress {
    /// `next_step`: where the run starts; `lead`: rank 0 (or a single process) draws the bar.
    pub fn new(schedule: Schedule, next_step: u64, lead: bool) -> Progress {
        let start = Instant::now();
        let bar = lead
            .then(|| Bar::start(TEMPLATE, schedule.max_steps, next_step, start))
            .flatten();
        Progress {
            start,
            mark: start,
            eta: Eta::default(),
            schedule,
            bar,
        }
    }

    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn lap(&mut self) -> f64 {
        let now = Instant::now();
        let secs = now.duration_since(self.mark).as_secs_f64();
        self.mark = now;
        secs
    }

    /// Step `step` trained: its time goes into the pace; returns the ETA (seconds).
    pub fn step_done(&mut self, step: u64) -> Option<f64> {
        let secs = self.lap();
        self.eta.steps.add(secs);
        self.eta.remaining(self.schedule.left_at(step))
    }

    pub fn other_done(&mut self, what: Other) {
        let secs = self.lap();
        match what {
            Other::Eval => self.eta.evals.add(secs),
            Other::Checkpoint => self.eta.checkpoints.add(secs),
        }
    }

    /// The step's figures on the bar, if there is one.
    pub fn show(&self, step: u64, eta: Option<f64>, loss: f64, micro_batch: usize, accum: usize) {
        if let Some(bar) = &self.bar {
            let rate = progress::rate(self.eta.steps.mean().unwrap_or(0.0));
            bar.update(
                step + 1,
                eta,
                format!("{rate} | loss {loss:.4} | mb {micro_batch}x{accum}"),
            );
        }
    }

    /// The run is done: the bar stays on screen, the summary prints below it.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish();
        }
    }
}
