//! Owns reading a run's metrics.jsonl into the series the report draws.
//! Keeps: reading is lenient (every field optional, unknown fields ignored), so runs written by
//! older and newer versions both read, without linking the trainer.
use serde::Deserialize;
use std::path::Path;

use crate::{jsonl, Error};

/// (step, value)
pub type Point = (u64, f64);

/// What happened at a step, drawn as a vertical marker across every panel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MarkerKind {
    Oom,
    Shrink,
    Grow,
    Resumed,
    Rung,
    Stopped,
    Leak,
    /// An elastic job's world changed (a node lost or joined).
    Membership,
}

impl MarkerKind {
    pub const ALL: [MarkerKind; 8] = [
        MarkerKind::Oom,
        MarkerKind::Shrink,
        MarkerKind::Grow,
        MarkerKind::Resumed,
        MarkerKind::Rung,
        MarkerKind::Stopped,
        MarkerKind::Leak,
        MarkerKind::Membership,
    ];

    fn from_event(event: &str) -> Option<MarkerKind> {
        Some(match event {
            "oom" => MarkerKind::Oom,
            "shrink" => MarkerKind::Shrink,
            "grow" => MarkerKind::Grow,
            "resumed" => MarkerKind::Resumed,
            // A rung climbed, or a sharding rung left when memory allowed: a rung change.
            "rung" | "rung_down" => MarkerKind::Rung,
            "stopped" => MarkerKind::Stopped,
            "leak_warning" => MarkerKind::Leak,
            "membership" => MarkerKind::Membership,
            _ => return None,
        })
    }

    /// The legend's words.
    pub fn label(self) -> &'static str {
        match self {
            MarkerKind::Oom => "OOM, micro-batch halved",
            MarkerKind::Shrink => "shrink, no OOM",
            MarkerKind::Grow => "grow-back",
            MarkerKind::Resumed => "resumed",
            MarkerKind::Rung => "rung",
            MarkerKind::Stopped => "signal stop",
            MarkerKind::Leak => "leak warning",
            MarkerKind::Membership => "world changed (elastic)",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marker {
    pub step: u64,
    pub kind: MarkerKind,
}

/// Every series of one run, in file order.
#[derive(Debug, Default, Clone)]
pub struct RunSeries {
    pub loss: Vec<Point>,
    pub eval_loss: Vec<Point>,
    pub tokens_per_s: Vec<Point>,
    pub live_bytes: Vec<Point>,
    pub peak_bytes: Vec<Point>,
    /// CUDA: held by the caching allocator.
    pub reserved_bytes: Vec<Point>,
    /// The CPU budget, or the device's capacity.
    pub limit_bytes: Vec<Point>,
    pub micro_batch_size: Vec<Point>,
    pub grad_accum_steps: Vec<Point>,
    /// One per event record (an OOM retried twice at one step is two markers).
    pub markers: Vec<Marker>,
    /// Step records read.
    pub steps: usize,
    /// The steps whose loss was not a number (nan or inf: `"loss": null`), the first and
    /// whether the last step's was one (the run diverged and has not come back).
    pub nonfinite: Option<(u64, bool)>,
    /// The largest data-parallel world seen (1: a single process).
    pub world_size: u64,
    /// Lines skipped, naming file and line.
    pub warnings: Vec<String>,
    /// The first and last step of any record read (a step whose loss is not a number, a step
    /// with no loss, an event), so the axes cover every series drawn.
    pub span: Option<(u64, u64)>,
}

#[derive(Deserialize)]
struct Line {
    event: Option<String>,
    step: Option<u64>,
    loss: Option<f64>,
    val_loss: Option<f64>,
    tokens_per_s: Option<f64>,
    micro_batch_size: Option<u64>,
    grad_accum_steps: Option<u64>,
    world_size: Option<u64>,
    memory: Option<Memory>,
}

#[derive(Deserialize)]
struct Memory {
    live_bytes: Option<u64>,
    peak_bytes: Option<u64>,
    reserved_bytes: Option<u64>,
    limit_bytes: Option<u64>,
}

fn push<T: Into<f64>>(series: &mut Vec<Point>, step: u64, value: Option<T>) {
    // NaN is written as null; it and infinities have no place on an axis.
    if let Some(v) = value.map(Into::into).filter(|v: &f64| v.is_finite()) {
        series.push((step, v));
    }
}

fn bytes(v: Option<u64>) -> Option<f64> {
    v.map(|b| b as f64)
}

impl RunSeries {
    /// Reads `metrics.jsonl` (metrics.replaced.jsonl, work a resumed run redid, is not read).
    pub fn read(path: &Path) -> Result<RunSeries, Error> {
        let mut s = RunSeries {
            world_size: 1,
            ..Default::default()
        };
        let warnings = jsonl::read::<Line>(path, |l| s.add(l))?;
        s.warnings = warnings;
        Ok(s)
    }

    fn add(&mut self, l: Line) {
        let (Some(event), Some(step)) = (l.event.as_deref(), l.step) else {
            return;
        };
        if matches!(event, "step" | "eval") || MarkerKind::from_event(event).is_some() {
            self.span = Some(self.span.map_or((step, step), |(a, b)| (a.min(step), b.max(step))));
        }
        match event {
            "step" => {
                self.steps += 1;
                let finite = l.loss.is_some_and(f64::is_finite);
                self.nonfinite = match (self.nonfinite, finite) {
                    (None, true) => None,
                    (None, false) => Some((step, true)),
                    (Some((first, _)), last) => Some((first, !last)),
                };
                push(&mut self.loss, step, l.loss);
                push(&mut self.tokens_per_s, step, l.tokens_per_s);
                push(&mut self.micro_batch_size, step, l.micro_batch_size.map(|v| v as f64));
                push(&mut self.grad_accum_steps, step, l.grad_accum_steps.map(|v| v as f64));
                if let Some(m) = l.memory {
                    push(&mut self.live_bytes, step, bytes(m.live_bytes));
                    push(&mut self.peak_bytes, step, bytes(m.peak_bytes));
                    push(&mut self.reserved_bytes, step, bytes(m.reserved_bytes));
                    push(&mut self.limit_bytes, step, bytes(m.limit_bytes));
                }
                self.world_size = self.world_size.max(l.world_size.unwrap_or(1));
            }
            "eval" => push(&mut self.eval_loss, step, l.val_loss),
            other => {
                if let Some(kind) = MarkerKind::from_event(other) {
                    self.markers.push(Marker { step, kind });
                }
            }
        }
    }

    /// Event records of one kind.
    pub fn count(&self, kind: MarkerKind) -> usize {
        self.markers.iter().filter(|m| m.kind == kind).count()
    }

    /// The steps the run covers, events included.
    pub fn step_range(&self) -> Option<(u64, u64)> {
        self.span
    }

    pub fn summary(&self) -> Summary {
        let evals = self.eval_loss.iter().map(|p| p.1);
        Summary {
            steps: self.steps,
            last_step: self.loss.last().map(|p| p.0),
            final_eval_loss: self.eval_loss.last().map(|p| p.1),
            best_eval_loss: evals.reduce(f64::min),
            final_loss: match self.nonfinite {
                Some((_, true)) => Some(f64::NAN),
                _ => self.loss.last().map(|p| p.1),
            },
            nonfinite_from: self.nonfinite.map(|n| n.0),
            mean_tokens_per_s: mean(self.tokens_per_s.iter().map(|p| p.1)),
            peak_bytes: self.peak_bytes.iter().map(|p| p.1).reduce(f64::max),
            final_micro_batch: self.micro_batch_size.last().map(|p| p.1 as u64),
            ooms: self.count(MarkerKind::Oom),
            shrinks: self.count(MarkerKind::Shrink),
            grows: self.count(MarkerKind::Grow),
            resumes: self.count(MarkerKind::Resumed),
            world_size: self.world_size,
        }
    }
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// The run's figures in one line or one small table.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub steps: usize,
    pub last_step: Option<u64>,
    pub final_eval_loss: Option<f64>,
    pub best_eval_loss: Option<f64>,
    pub final_loss: Option<f64>,
    /// The first step whose loss was not a number.
    pub nonfinite_from: Option<u64>,
    pub mean_tokens_per_s: Option<f64>,
    pub peak_bytes: Option<f64>,
    pub final_micro_batch: Option<u64>,
    pub ooms: usize,
    pub shrinks: usize,
    pub grows: usize,
    pub resumes: usize,
    pub world_size: u64,
}

impl Summary {
    /// (name, value) rows, for the text summary, the picture's header and the HTML table.
    pub fn rows(&self) -> Vec<(&'static str, String)> {
        let f = |v: Option<f64>, d: usize| v.map_or("-".into(), |v| format!("{v:.d$}"));
        let mut rows = vec![
            ("steps", self.steps.to_string()),
            (
                "final loss",
                match self.nonfinite_from {
                    Some(at) => format!("{} (not a number from step {at})", f(self.final_loss, 4)),
                    None => f(self.final_loss, 4),
                },
            ),
            ("final eval loss", f(self.final_eval_loss, 4)),
            ("best eval loss", f(self.best_eval_loss, 4)),
            ("mean tokens/s", f(self.mean_tokens_per_s, 0)),
            (
                "peak memory",
                self.peak_bytes.map_or("-".into(), crate::labels::human_bytes),
            ),
            (
                "final micro-batch",
                self.final_micro_batch.map_or("-".into(), |v| v.to_string()),
            ),
            ("OOMs", self.ooms.to_string()),
            ("shrinks, no OOM", self.shrinks.to_string()),
            ("grow-backs", self.grows.to_string()),
            ("resumes", self.resumes.to_string()),
        ];
        if self.world_size > 1 {
            rows.push(("data-parallel ranks", self.world_size.to_string()));
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_of_every_kind_land_in_their_series_and_unknown_ones_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        let lines = [
            r#"{"event":"oom","step":0,"new_micro_batch_size":8}"#,
            concat!(
                r#"{"event":"step","step":0,"loss":5.5,"tokens_per_s":100.0,"micro_batch_size":8,"grad_accum_steps":4,"#,
                r#""memory":{"live_bytes":10,"peak_bytes":20,"limit_bytes":100}}"#
            ),
            concat!(
                r#"{"event":"step","step":1,"loss":null,"tokens_per_s":300.0,"micro_batch_size":16,"grad_accum_steps":2,"#,
                r#""world_size":2,"comm_s":0.1,"memory":{"live_bytes":11,"peak_bytes":21}}"#
            ),
            r#"{"event":"eval","step":1,"val_loss":4.0}"#,
            r#"{"event":"grow","step":1}"#,
            r#"{"event":"resumed","step":2,"checkpoint":"x"}"#,
            r#"{"event":"membership","step":2,"old_world":3,"new_world":2}"#,
            r#"{"event":"something_new","step":3,"x":1}"#,
        ];
        std::fs::write(&p, lines.join("\n")).unwrap();
        let s = RunSeries::read(&p).unwrap();
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
        assert_eq!(s.steps, 2);
        assert_eq!(s.loss, [(0, 5.5)]);
        assert_eq!(s.micro_batch_size, [(0, 8.0), (1, 16.0)]);
        assert_eq!(s.limit_bytes, [(0, 100.0)]);
        assert_eq!(s.eval_loss, [(1, 4.0)]);
        assert_eq!(
            s.markers.iter().map(|m| (m.step, m.kind)).collect::<Vec<_>>(),
            [
                (0, MarkerKind::Oom),
                (1, MarkerKind::Grow),
                (2, MarkerKind::Resumed),
                (2, MarkerKind::Membership)
            ]
        );
        assert_eq!(s.step_range(), Some((0, 2)));
        let sum = s.summary();
        assert_eq!((sum.ooms, sum.grows, sum.resumes, sum.world_size), (1, 1, 1, 2));
        assert_eq!(sum.mean_tokens_per_s, Some(200.0));
        assert_eq!(sum.best_eval_loss, Some(4.0));
        // The last step's loss was not a number: the run's final loss says so, not step 0's.
        assert_eq!(
            (sum.final_loss.map(f64::is_nan), sum.nonfinite_from),
            (Some(true), Some(1))
        );
        let rows = sum.rows();
        let final_loss = &rows.iter().find(|r| r.0 == "final loss").unwrap().1;
        assert_eq!(final_loss, "NaN (not a number from step 1)");
    }

    /// A run whose loss turned NaN at step 1 and went on to step 9 with no event after: the
    /// axis covers step 9 (the throughput and memory drawn up to it), and a sharding rung
    /// left is a rung change.
    #[test]
    fn the_steps_covered_include_those_with_no_loss() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        let step = |s: u64, loss: &str| format!(r#"{{"event":"step","step":{s},"loss":{loss},"tokens_per_s":100.0}}"#);
        let mut lines: Vec<String> = vec![step(0, "5.0")];
        lines.extend((1..10).map(|s| step(s, "null")));
        lines.push(r#"{"event":"rung_down","step":4,"rung":"zero1","reason":"memory allowed"}"#.into());
        std::fs::write(&p, lines.join("\n")).unwrap();
        let s = RunSeries::read(&p).unwrap();
        assert_eq!(s.step_range(), Some((0, 9)));
        assert_eq!(s.tokens_per_s.len(), 10);
        assert_eq!(s.count(MarkerKind::Rung), 1);
    }
}
