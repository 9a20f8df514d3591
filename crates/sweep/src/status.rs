//! Owns how far along a sweep is: trials done, running and left, the best so far, an ETA, and
//! whether W&B's `metric.target` was reached.
//! Keeps: once the target is reached, nothing new starts (an interrupted trial resumes).
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::spec::{Metric, Trial};
use super::table;
use crate::record::{Record, Status};
use oomguard_console::progress::{self, Bar, Pace};

/// A status line at least this often (besides one after each trial).
const EVERY: Duration = Duration::from_secs(60);
/// indicatif's template for the live line (`{clock}`: elapsed<ETA).
const TEMPLATE: &str = "sweep {pos}/{len} [{bar:20}] {clock} | {msg}";

/// The shard's trials as their records and the running ones show them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub total: usize,
    pub done: usize,
    pub running: usize,
    pub ok: usize,
    pub infeasible: usize,
    pub failed: usize,
    pub timeout: usize,
    pub stopped_early: usize,
    /// The best finished trial by the sweep's metric: its id and value.
    pub best: Option<(String, f64)>,
    /// Seconds until the last trial ends; None before one finished.
    pub eta_s: Option<f64>,
}

impl Snapshot {
    /// `trials`: the shard's known so far, of `total`; `running`: seconds each running trial
    /// has run (over every start); `slots`: --parallel.
    pub fn new(
        trials: &[&Trial],
        total: usize,
        records: &BTreeMap<String, Record>,
        running: &[f64],
        slots: usize,
        metric: Metric,
    ) -> Snapshot {
        let finished: Vec<&Record> = trials
            .iter()
            .filter_map(|t| records.get(&t.id))
            .filter(|r| r.status.is_final())
            .collect();
        let count = |s: Status| finished.iter().filter(|r| r.status == s).count();
        let mut pace = Pace::new(finished.len());
        finished.iter().for_each(|r| pace.add(r.duration_s));
        let left = total.saturating_sub(finished.len() + running.len());
        Snapshot {
            total,
            done: finished.len(),
            running: running.len(),
            ok: count(Status::Ok),
            infeasible: count(Status::Infeasible),
            failed: count(Status::Failed),
            timeout: count(Status::Timeout),
            stopped_early: count(Status::StoppedEarly),
            best: table::best(finished.iter().copied(), metric)
                .and_then(|b| Some((b.trial.clone(), table::value(b, metric)?))),
            eta_s: eta(&pace, running, left, slots),
        }
    }

    pub fn left(&self) -> usize {
        self.total.saturating_sub(self.done + self.running)
    }

    /// `1 running, 1 left | ok 1, infeasible 1, failed 0 | best 000-0511874d 2.1234`
    fn details(&self) -> String {
        let mut timeout = if self.timeout > 0 {
            format!(", timeout {}", self.timeout)
        } else {
            String::new()
        };
        if self.stopped_early > 0 {
            timeout.push_str(&format!(", stopped early {}", self.stopped_early));
        }
        let best = self.best.as_ref().map_or("-".into(), |(id, v)| format!("{id} {v:.4}"));
        format!(
            "{} running, {} left | ok {}, infeasible {}, failed {}{timeout} | best {best}",
            self.running,
            self.left(),
            self.ok,
            self.infeasible,
            self.failed
        )
    }

    /// The log line: `sweep: 2/4 done, 1 running, 1 left | ok 1, ... | best ... | 35s, ETA 40s`.
    pub fn line(&self, elapsed: f64) -> String {
        format!(
            "sweep: {}/{} done, {} | {}",
            self.done,
            self.total,
            self.details(),
            progress::elapsed_eta(elapsed, self.eta_s)
        )
    }
}

/// Seconds until the sweep is done: each trial left takes the finished trials' pace, each
/// running one what it has not run of it yet, spread over the slots.
pub fn eta(pace: &Pace, running: &[f64], left: usize, slots: usize) -> Option<f64> {
    let each = pace.mean()?;
    let work = left as f64 * each + running.iter().map(|ran| (each - ran).max(0.0)).sum::<f64>();
    Some(work / slots.min(left + running.len()).max(1) as f64)
}

/// W&B's `metric.target`: whether a trial's metric (a finished trial's, or one evaluated at
/// a rung; not a failed, timed-out or interrupted one's) reached it (<= when minimized, >= when maximized), as the sentence the log and
/// `--status` print; None when none did or there is no target.
pub fn target_reached(records: &BTreeMap<String, Record>, metric: Metric, target: Option<f64>) -> Option<String> {
    let target = target?;
    let best = table::best_of(records.values().filter(|r| r.status.reached_on_schedule()), metric)?;
    let v = table::value(best, metric)?;
    let (reached, cmp) = if metric.maximize() {
        (v >= target, ">=")
    } else {
        (v <= target, "<=")
    };
    reached.then(|| {
        format!(
            "metric.target reached: trial {} has {} {v:.4} {cmp} {target}: no new trial starts; running and interrupted trials finish",
            best.trial,
            metric.name()
        )
    })
}

/// Reports a sweep's progress as it goes.
pub struct Reporter {
    total: usize,
    slots: usize,
    metric: Metric,
    start: Instant,
    last_line: Instant,
    bar: Option<Bar>,
}

impl Reporter {
    /// `total`: the shard's trials.
    pub fn new(total: usize, slots: usize, metric: Metric) -> Reporter {
        let start = Instant::now();
        let bar = Bar::start(TEMPLATE, total as u64, 0, start);
        Reporter {
            total,
            slots,
            metric,
            start,
            last_line: start,
            bar,
        }
    }

    /// Whether a line is due though nothing finished.
    pub fn due(&self) -> bool {
        self.last_line.elapsed() >= EVERY
    }

    /// Updates the live line; logs a status line when `finished` (a trial got its record) or due.
    pub fn report(&mut self, trials: &[Trial], records: &BTreeMap<String, Record>, running: &[f64], finished: bool) {
        let trials: Vec<&Trial> = trials.iter().collect();
        let s = Snapshot::new(&trials, self.total, records, running, self.slots, self.metric);
        if let Some(bar) = &self.bar {
            bar.update(s.done as u64, s.eta_s, s.details());
        }
        if finished || self.due() {
            tracing::info!(target: progress::TARGET, "{}", s.line(self.start.elapsed().as_secs_f64()));
            self.last_line = Instant::now();
        }
    }

    /// The sweep is over: the live line stays, the table prints below it.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Summary;

    fn trial(i: usize) -> Trial {
        Trial {
            id: format!("{i:03}-x"),
            index: i,
            params: BTreeMap::new(),
        }
    }

    fn record(t: &Trial, status: Status, loss: Option<f64>, secs: f64) -> Record {
        Record {
            exit_code: None,
            summary: Summary {
                best_eval_loss: loss,
                ..Default::default()
            },
            duration_s: secs,
            ..Record::of(&t.id, t.index, status)
        }
    }

    #[test]
    fn counts_outcomes_best_and_eta() {
        let ts: Vec<Trial> = (0..6).map(trial).collect();
        let mine: Vec<&Trial> = ts.iter().collect();
        let mut records = BTreeMap::new();
        let s = Snapshot::new(&mine, 6, &records, &[3.0], 2, Metric::BestEvalLoss);
        assert_eq!(
            (s.done, s.running, s.left(), s.eta_s, s.best.clone()),
            (0, 1, 5, None, None)
        );
        assert!(
            s.line(3.0).starts_with(
                "sweep: 0/6 done, 1 running, 5 left | ok 0, infeasible 0, failed 0 | best - | 3.0s, ETA ?"
            ),
            "{}",
            s.line(3.0)
        );
        for (t, st, loss, secs) in [
            (0, Status::Ok, Some(2.0), 10.0),
            (1, Status::Infeasible, None, 10.0),
            (2, Status::Failed, None, 10.0),
            (3, Status::Interrupted, Some(1.0), 10.0),
            (5, Status::Failed, Some(0.5), 10.0),
        ] {
            records.insert(ts[t].id.clone(), record(&ts[t], st, loss, secs));
        }
        // Trial 3 was interrupted: not done, it runs again (4s so far). Trial 5 evaluated
        // at 0.5 and then failed: not the best.
        let s = Snapshot::new(&mine, 6, &records, &[4.0], 2, Metric::BestEvalLoss);
        assert_eq!(
            (s.done, s.running, s.left(), s.ok, s.infeasible, s.failed),
            (4, 1, 1, 1, 1, 2)
        );
        assert_eq!(s.best, Some(("000-x".into(), 2.0)));
        // One left at 10s and 6s of the running one, over 2 slots.
        assert_eq!(s.eta_s, Some((10.0 + 6.0) / 2.0));
        assert_eq!(
            s.line(31.0),
            "sweep: 4/6 done, 1 running, 1 left | ok 1, infeasible 1, failed 2 | best 000-x 2.0000 | 31s, ETA 8.0s"
        );
        records.insert(ts[4].id.clone(), record(&ts[4], Status::Timeout, None, 10.0));
        assert!(Snapshot::new(&mine, 6, &records, &[], 1, Metric::BestEvalLoss)
            .line(0.0)
            .contains("failed 2, timeout 1 |"));
    }

    #[test]
    fn target_is_reached_by_the_metric_in_its_direction() {
        let ts: Vec<Trial> = (0..3).map(trial).collect();
        let mut records = BTreeMap::new();
        let at = |r: &BTreeMap<String, Record>, m, t| target_reached(r, m, t);
        records.insert(ts[0].id.clone(), record(&ts[0], Status::Ok, Some(2.0), 1.0));
        records.insert(ts[1].id.clone(), record(&ts[1], Status::Failed, Some(0.5), 1.0));
        // A failed trial's value (evaluated, then it crashed) is not a result.
        assert_eq!(at(&records, Metric::BestEvalLoss, Some(1.5)), None);
        for st in [Status::Interrupted, Status::Timeout] {
            records.insert(ts[2].id.clone(), record(&ts[2], st, Some(0.5), 1.0));
            assert_eq!(at(&records, Metric::BestEvalLoss, Some(1.5)), None, "{st:?}");
        }
        assert_eq!(at(&records, Metric::BestEvalLoss, None), None);
        // A trial evaluated at a rung (promoted, not finished) counts: it reached the value.
        records.insert(ts[2].id.clone(), record(&ts[2], Status::Promoted, Some(1.5), 1.0));
        assert_eq!(
            at(&records, Metric::BestEvalLoss, Some(1.5)).as_deref(),
            Some("metric.target reached: trial 002-x has best_eval_loss 1.5000 <= 1.5: no new trial starts; running and interrupted trials finish")
        );
        // Maximized (tokens_per_s): reached from above.
        let mut fast = record(&ts[0], Status::Ok, None, 1.0);
        fast.summary.tokens_per_s = Some(900.0);
        let records = BTreeMap::from([(ts[0].id.clone(), fast)]);
        assert_eq!(at(&records, Metric::TokensPerS, Some(1000.0)), None);
        assert!(
            at(&records, Metric::TokensPerS, Some(800.0)).is_some_and(|s| s.contains("tokens_per_s 900.0000 >= 800"))
        );
    }

    #[test]
    fn eta_spreads_work_over_the_slots_it_can_use() {
        let mut p = Pace::new(10);
        assert_eq!(eta(&p, &[1.0], 3, 2), None);
        p.add(10.0);
        assert_eq!(eta(&p, &[], 3, 1), Some(30.0));
        assert_eq!(eta(&p, &[4.0], 0, 4), Some(6.0)); // one trial left running: one slot works
        assert_eq!(eta(&p, &[12.0], 0, 1), Some(0.0)); // past the pace: nothing known left
    }
}
