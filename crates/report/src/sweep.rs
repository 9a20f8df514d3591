//! Owns reading a sweep directory: results.jsonl and each trial's run directory.
//! Keeps: read as leniently as a run's metrics; a bad record is a warning.
use serde::Deserialize;
use std::path::Path;

use crate::series::{Point, RunSeries};
use crate::{jsonl, Error};

/// One line of results.jsonl; every field optional so that older and newer sweeps read.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TrialRecord {
    pub trial: Option<String>,
    pub index: Option<u64>,
    #[serde(default)]
    pub params: serde_json::Map<String, serde_json::Value>,
    pub status: Option<String>,
    pub told_by: Option<String>,
    pub exit_code: Option<i64>,
    pub final_eval_loss: Option<f64>,
    pub best_eval_loss: Option<f64>,
    pub final_loss: Option<f64>,
    pub tokens_per_s: Option<f64>,
    pub final_micro_batch_size: Option<u64>,
    pub ooms: Option<u64>,
    pub duration_s: Option<f64>,
    pub run_dir: Option<String>,
    pub message: Option<String>,
    /// The sweep's metric, by its field's name (sweeps since 2026-11-29 write it).
    pub metric: Option<String>,
}

/// The metric a sweep ranks by when its records name none (older sweeps' default).
pub const DEFAULT_METRIC: &str = "best_eval_loss";

/// A trial and the eval losses its run directory recorded.
#[derive(Debug, Clone)]
pub struct Trial {
    pub name: String,
    pub record: TrialRecord,
    pub eval_loss: Vec<Point>,
}

impl Trial {
    pub fn is_ok(&self) -> bool {
        self.record.status.as_deref() == Some("ok")
    }

    /// `ok`, `infeasible (planner)`, `failed (exit 1)`, ...
    pub fn status(&self) -> String {
        let r = &self.record;
        let status = r.status.as_deref().unwrap_or("unknown");
        match (status, &r.told_by, r.exit_code) {
            ("infeasible", Some(by), _) => format!("infeasible ({by})"),
            ("failed", _, Some(code)) => format!("failed (exit {code})"),
            _ => status.to_string(),
        }
    }

    /// `model.n_embd=64 optim.lr=0.001`
    pub fn params(&self) -> String {
        let value = |v: &serde_json::Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
        self.record
            .params
            .iter()
            .map(|(k, v)| format!("{k}={}", value(v)))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The trial's value of the sweep's `metric` (a results.jsonl field's name): its record's,
    /// else, for the eval losses, its run's.
    pub fn value(&self, metric: &str) -> Option<f64> {
        let r = &self.record;
        match metric {
            "final_eval_loss" => r.final_eval_loss.or_else(|| self.eval_loss.last().map(|p| p.1)),
            "final_loss" => r.final_loss,
            "tokens_per_s" => r.tokens_per_s,
            _ => self.best_eval_loss(),
        }
    }

    /// The trial's best eval loss: its record's, else its run's.
    pub fn best_eval_loss(&self) -> Option<f64> {
        self.record
            .best_eval_loss
            .or_else(|| self.eval_loss.iter().map(|p| p.1).reduce(f64::min))
    }
}

#[derive(Debug, Clone, Default)]
pub struct Sweep {
    pub trials: Vec<Trial>,
    /// Index into `trials` of the completed trial with the best value of `metric`.
    pub best: Option<usize>,
    /// What the sweep ranked its trials by (its records' `metric`; `best_eval_loss` for
    /// sweeps that wrote none).
    pub metric: String,
    pub warnings: Vec<String>,
}

impl Sweep {
    pub fn read(dir: &Path) -> Result<Sweep, Error> {
        let mut records = Vec::new();
        let mut warnings = jsonl::read::<TrialRecord>(&dir.join("results.jsonl"), |r| records.push(r))?;
        let mut trials = Vec::with_capacity(records.len());
        for (i, record) in records.into_iter().enumerate() {
            let name = record
                .trial
                .clone()
                .or_else(|| record.index.map(|n| format!("{n:03}")))
                .unwrap_or_else(|| format!("#{}", i + 1));
            let mut eval_loss = Vec::new();
            if let Some(run) = record.run_dir.as_deref() {
                let metrics = dir.join(run).join("metrics.jsonl");
                if metrics.is_file() {
                    let series = RunSeries::read(&metrics)?;
                    warnings.extend(series.warnings);
                    eval_loss = series.eval_loss;
                } else if record.status.as_deref() == Some("ok") {
                    warnings.push(format!(
                        "{}: missing; trial {name} is listed without its eval losses",
                        metrics.display()
                    ));
                }
            }
            trials.push(Trial {
                name,
                record,
                eval_loss,
            });
        }
        let metric = trials
            .iter()
            .rev()
            .find_map(|t| t.record.metric.clone())
            .unwrap_or_else(|| DEFAULT_METRIC.into());
        let mut sweep = Sweep {
            trials,
            best: None,
            metric,
            warnings,
        };
        sweep.best = sweep.ranked().first().copied().filter(|&i| sweep.score(i).is_some());
        Ok(sweep)
    }

    /// A completed trial's value of the metric, larger the worse (tokens/s negated).
    fn score(&self, i: usize) -> Option<f64> {
        let t = &self.trials[i];
        let v = t.value(&self.metric).filter(|v| v.is_finite() && t.is_ok())?;
        Some(if self.metric == "tokens_per_s" { -v } else { v })
    }

    /// `12 trials: 9 ok, 2 infeasible, 1 failed`
    pub fn counts(&self) -> String {
        let mut counts: Vec<(String, usize)> = Vec::new();
        for t in &self.trials {
            let s = t.record.status.clone().unwrap_or_else(|| "unknown".into());
            match counts.iter_mut().find(|(k, _)| *k == s) {
                Some((_, n)) => *n += 1,
                None => counts.push((s, 1)),
            }
        }
        let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
        format!("{} trials: {}", self.trials.len(), parts.join(", "))
    }

    /// Trials best first: completed ones by the sweep's metric, then the rest in file order.
    pub fn ranked(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.trials.len()).collect();
        order.sort_by(|&a, &b| match (self.score(a), self.score(b)) {
            (Some(x), Some(y)) => x.total_cmp(&y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => a.cmp(&b),
        });
        order
    }

    /// The table's header and rows, best first, each with its trial's index (text, picture
    /// and HTML share them).
    /// The loss column is the sweep's metric where that is a loss.
    pub fn table(&self) -> (Vec<&'static str>, Vec<(usize, Vec<String>)>) {
        let (loss_header, loss_metric) = match self.metric.as_str() {
            "final_eval_loss" => ("final eval loss", "final_eval_loss"),
            "final_loss" => ("final loss", "final_loss"),
            _ => ("best eval loss", DEFAULT_METRIC),
        };
        let header = vec![
            "",
            "trial",
            "status",
            loss_header,
            "tokens/s",
            "final micro-batch",
            "OOMs",
            "duration",
            "params",
        ];
        let f = |v: Option<f64>, d: usize| v.map_or("-".into(), |v| format!("{v:.d$}"));
        let rows = self
            .ranked()
            .into_iter()
            .map(|i| {
                let (t, r) = (&self.trials[i], &self.trials[i].record);
                let row = vec![
                    if self.best == Some(i) {
                        "best".into()
                    } else {
                        String::new()
                    },
                    t.name.clone(),
                    t.status(),
                    f(t.value(loss_metric), 4),
                    f(r.tokens_per_s, 0),
                    r.final_micro_batch_size.map_or("-".into(), |v| v.to_string()),
                    r.ooms.map_or("-".into(), |v| v.to_string()),
                    r.duration_s.map_or("-".into(), |v| format!("{v:.1} s")),
                    t.params(),
                ];
                (i, row)
            })
            .collect();
        (header, rows)
    }

    /// The table as aligned text, for stdout.
    pub fn text_table(&self) -> String {
        let (header, rows) = self.table();
        let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
        for (_, row) in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |cells: Vec<&str>| {
            let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
            padded.join("  ").trim_end().to_string() + "\n"
        };
        let mut out = line(header.clone());
        for (_, row) in &rows {
            out += &line(row.iter().map(String::as_str).collect());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_is_by_the_metric_the_sweep_ranked_by() {
        let dir = tempfile::tempdir().unwrap();
        let lines = [
            r#"{"trial":"000-a","status":"ok","best_eval_loss":1.0,"final_eval_loss":3.0,"final_loss":2.5,"tokens_per_s":900,"metric":"final_eval_loss"}"#,
            r#"{"trial":"001-b","status":"ok","best_eval_loss":2.0,"final_eval_loss":2.0,"final_loss":2.9,"tokens_per_s":800,"metric":"final_eval_loss"}"#,
            r#"{"trial":"002-c","status":"failed","best_eval_loss":0.1,"final_eval_loss":0.1,"metric":"final_eval_loss"}"#,
        ];
        let read = |metric: &str| {
            let text = lines
                .join("\n")
                .replace("\"metric\":\"final_eval_loss\"", &format!("\"metric\":\"{metric}\""));
            std::fs::write(dir.path().join("results.jsonl"), text).unwrap();
            Sweep::read(dir.path()).unwrap()
        };
        let s = read("final_eval_loss");
        assert_eq!((s.best, s.ranked()), (Some(1), vec![1, 0, 2]));
        let (header, rows) = s.table();
        assert_eq!((header[3], rows[0].1[3].as_str()), ("final eval loss", "2.0000"));
        let by = |metric: &str| read(metric).best;
        assert_eq!(by("final_loss"), Some(0));
        assert_eq!(by("tokens_per_s"), Some(0), "tokens/s: the most");
        assert_eq!(by("best_eval_loss"), Some(0));
    }

    #[test]
    fn the_best_is_the_lowest_completed_trial_and_statuses_say_who_decided() {
        let dir = tempfile::tempdir().unwrap();
        let lines = [
            r#"{"trial":"000-a","status":"ok","best_eval_loss":2.0,"params":{"optim.lr":0.001}}"#,
            r#"{"trial":"001-b","status":"infeasible","told_by":"planner","best_eval_loss":null}"#,
            r#"{"trial":"002-c","status":"timeout","best_eval_loss":0.5}"#,
            r#"{"trial":"003-d","status":"ok","best_eval_loss":1.5,"params":{"model.n_embd":64,"data.source":"text"}}"#,
            r#"{"trial":"004-e","status":"failed","exit_code":1}"#,
            r#"{"trial":"005-f","status":"#,
        ];
        std::fs::write(dir.path().join("results.jsonl"), lines.join("\n")).unwrap();
        let s = Sweep::read(dir.path()).unwrap();
        assert_eq!(s.trials.len(), 5);
        assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
        assert_eq!(s.best, Some(3), "a timeout's loss is not a result");
        assert_eq!(s.trials[1].status(), "infeasible (planner)");
        assert_eq!(s.trials[4].status(), "failed (exit 1)");
        assert_eq!(s.trials[3].params(), "data.source=text model.n_embd=64");
        assert_eq!(s.counts(), "5 trials: 2 ok, 1 infeasible, 1 timeout, 1 failed");
        assert_eq!(s.ranked(), [3, 0, 1, 2, 4]);
        assert_eq!(s.metric, "best_eval_loss", "a sweep whose records name no metric");
        let text = s.text_table();
        assert!(text.lines().nth(1).unwrap().starts_with("best  003-d"), "{text}");
        assert!(
            text.lines()
                .nth(3)
                .unwrap()
                .starts_with("      001-b  infeasible (planner)"),
            "{text}"
        );
    }
}
