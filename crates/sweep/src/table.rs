//! Owns the summary table (end of a sweep, and `--status`).
//! Keeps: a pure rendering of the records.
use std::collections::BTreeMap;

use super::spec::{Metric, Trial};
use crate::record::{Record, Status};

/// A trial's state where it has no record yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Open {
    Pending,
    /// Another process holds its lock.
    Running,
}

/// A record's value of `metric`, if it has one.
pub fn value(r: &Record, metric: Metric) -> Option<f64> {
    match metric {
        Metric::BestEvalLoss => r.summary.best_eval_loss,
        Metric::FinalEvalLoss => r.summary.final_eval_loss,
        Metric::FinalLoss => r.summary.final_loss,
        Metric::TokensPerS => r.summary.tokens_per_s,
    }
}

/// The best completed (`ok`) trial by `metric`, among those that have it; with none, the
/// best value an early-stopping rung asked for. A failed, timed-out or interrupted trial's
/// loss is not a result.
pub fn best<'a>(records: impl IntoIterator<Item = &'a Record>, metric: Metric) -> Option<&'a Record> {
    let records: Vec<&Record> = records.into_iter().collect();
    best_of(records.iter().copied().filter(|r| r.status == Status::Ok), metric)
        .or_else(|| best_of(records.into_iter().filter(|r| r.status.reached_on_schedule()), metric))
}

/// The best of `records` by `metric` (only those that have it), whatever their status.
pub fn best_of<'a>(records: impl IntoIterator<Item = &'a Record>, metric: Metric) -> Option<&'a Record> {
    let mut scored: Vec<(&Record, f64)> = records
        .into_iter()
        .filter_map(|r| value(r, metric).filter(|v| v.is_finite()).map(|v| (r, v)))
        .collect();
    scored.sort_by(|a, b| a.1.total_cmp(&b.1));
    if metric.maximize() {
        scored.last()
    } else {
        scored.first()
    }
    .map(|(r, _)| *r)
}

fn num(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.digits$}"))
}

/// The table of `trials`, their records and open states, and a line naming the best.
/// `total`: the trials in all (a model-based search has proposed only some so far).
pub fn render(
    trials: &[Trial],
    records: &BTreeMap<String, Record>,
    open: &dyn Fn(&Trial) -> Open,
    metric: Metric,
    total: usize,
) -> String {
    let header = [
        "trial",
        "status",
        "best eval",
        "final eval",
        "tok/s",
        "micro-batch",
        "OOMs",
        "time",
        "parameters",
    ];
    let mut rows = vec![header.map(String::from).to_vec()];
    let mut notes = vec![];
    for t in trials {
        let row = match records.get(&t.id) {
            Some(r) => {
                let status = match (&r.told_by, r.rungs.last()) {
                    (Some(by), _) => format!("{} ({by})", r.status.name()),
                    (None, Some(g)) if r.status != crate::record::Status::Ok => {
                        format!("{} (step {})", r.status.name(), g.step)
                    }
                    _ => r.status.name().to_string(),
                };
                if let Some(m) = r
                    .message
                    .as_ref()
                    .filter(|_| r.status.is_final() && r.status != crate::record::Status::Ok)
                {
                    notes.push(format!("  {}: {m}", r.trial));
                }
                vec![
                    r.trial.clone(),
                    status,
                    num(r.summary.best_eval_loss, 4),
                    num(r.summary.final_eval_loss, 4),
                    num(r.summary.tokens_per_s, 0),
                    r.summary.final_micro_batch_size.map_or("-".into(), |m| m.to_string()),
                    r.summary.ooms.to_string(),
                    format!("{:.0}s", r.duration_s),
                    t.describe(),
                ]
            }
            None => {
                let s = match open(t) {
                    Open::Pending => "pending",
                    Open::Running => "running",
                };
                let mut row = vec![t.id.clone(), s.into()];
                row.extend(std::iter::repeat_n("".to_string(), 6));
                row.push(t.describe());
                row
            }
        };
        rows.push(row);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let cells: Vec<String> = r.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    if !notes.is_empty() {
        out.push_str("why:\n");
        out.push_str(&notes.join("\n"));
        out.push('\n');
    }
    let mine = trials.iter().filter_map(|t| records.get(&t.id));
    let finished = trials
        .iter()
        .filter(|t| records.get(&t.id).is_some_and(|r| r.status.is_final()))
        .count();
    out.push_str(&format!("{finished} of {} trials finished", total.max(trials.len())));
    match best(mine, metric) {
        Some(b) => out.push_str(&format!(
            "; best by {}: {} ({}) {}\n",
            metric.name(),
            b.trial,
            num(value(b, metric), 4),
            trials
                .iter()
                .find(|t| t.id == b.trial)
                .map(Trial::describe)
                .unwrap_or_default()
        )),
        None => out.push('\n'),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_skips_trials_without_the_metric() {
        let r = |t: &str, l: Option<f64>, s: Status| Record {
            exit_code: None,
            summary: crate::record::Summary {
                final_eval_loss: l,
                best_eval_loss: l,
                tokens_per_s: l.map(|l| 100.0 / l),
                ..Default::default()
            },
            shard: String::new(),
            ..Record::of(t, 0, s)
        };
        let rs = [
            r("a", Some(2.0), Status::Ok),
            r("b", None, Status::Infeasible),
            r("c", Some(1.5), Status::Ok),
        ];
        assert_eq!(best(&rs, Metric::BestEvalLoss).unwrap().trial, "c");
        assert_eq!(best(&rs, Metric::TokensPerS).unwrap().trial, "c");
        assert!(best(&rs[1..2], Metric::BestEvalLoss).is_none());
        // No trial finished (ASHA stopped at the target): the best rung value, never a
        // failed trial's.
        let rungs = [
            r("d", Some(0.5), Status::Failed),
            r("e", Some(1.8), Status::StoppedEarly),
            r("f", Some(1.2), Status::Promoted),
        ];
        assert_eq!(best(&rungs, Metric::BestEvalLoss).unwrap().trial, "f");
    }
}
