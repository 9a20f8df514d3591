//! Owns asynchronous successive halving (ASHA), as pure functions of the trials' records.
//! Keeps: every decision is written into the trial's record and read back, never made again, so
//! a restarted sweep replays them.
use std::collections::{BTreeMap, BTreeSet};

use super::spec::{EarlyStop, RungMetric, Trial};
use crate::record::{Decision, Record, Rung, Status};

/// The next segment to run: trial `index` up to `target` steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Job {
    pub index: usize,
    pub target: u64,
}

/// Whether a value of rank `rank` (0 is best) among `n` at a rung is in the top 1/eta: the
/// best floor(n / eta) (Li et al.'s promotion rule).
pub fn in_top(rank: usize, n: usize, eta: u64) -> bool {
    rank < n / eta as usize
}

/// `a` better than `b` (a missing or non-finite value is worse than any number).
fn better(a: Option<f64>, b: Option<f64>, maximize: bool) -> bool {
    match (a.filter(|v| v.is_finite()), b.filter(|v| v.is_finite())) {
        (Some(x), Some(y)) => {
            if maximize {
                x > y
            } else {
                x < y
            }
        }
        (Some(_), None) => true,
        _ => false,
    }
}

/// The rank of `value` among `others` (the values already reported at the rung): how many
/// are strictly better.
fn rank(value: Option<f64>, others: &[Option<f64>], maximize: bool) -> usize {
    others.iter().filter(|o| better(**o, value, maximize)).count()
}

/// The decision for a trial that reached rung `step` with `value`, given the values other
/// trials reported there before.
pub fn decide(es: &EarlyStop, step: u64, value: Option<f64>, others: &[Option<f64>], maximize: bool) -> Decision {
    if step >= es.max_steps {
        return Decision::Done;
    }
    let finite = value.is_some_and(f64::is_finite);
    if finite && in_top(rank(value, others, maximize), others.len() + 1, es.eta) {
        Decision::Continue
    } else {
        Decision::Stop
    }
}

/// The values reported at rung `step` by every trial but `except`.
pub fn reported_at<'a>(records: impl IntoIterator<Item = &'a Record>, step: u64, except: &str) -> Vec<Option<f64>> {
    records
        .into_iter()
        .filter(|r| r.trial != except)
        .filter_map(|r| r.rungs.iter().find(|g| g.step == step).map(|g| g.value))
        .collect()
}

/// The rung after `step` (max_steps after the last).
pub fn next_rung(es: &EarlyStop, step: u64) -> u64 {
    es.rungs().into_iter().find(|r| *r > step).unwrap_or(es.max_steps)
}

/// Where a trial's record leaves it: the steps it reached (0: none) and whether it may run on.
fn position(r: Option<&Record>) -> (u64, bool) {
    match r {
        None => (0, true),
        Some(r) => {
            let reached = r.rungs.last().map_or(0, |g| g.step);
            let open = matches!(r.status, Status::Promoted | Status::Interrupted | Status::Proposed);
            (reached, open)
        }
    }
}

/// The next segment to run, a pure function of the records (so a restart picks what was
/// running): a trial that was going on (continued, or interrupted mid-segment) first, then
/// the best promotable stopped trial of the highest rung, then a new trial in index order.
/// `trials`: this shard's; `busy`: running here or held by another process. When nothing
/// else is left and no trial has reached max_steps, the best at the highest rung goes on, so
/// a finite sweep always trains one trial in full.
pub fn next(
    es: &EarlyStop,
    trials: &[&Trial],
    records: &BTreeMap<String, Record>,
    busy: &BTreeSet<String>,
    maximize: bool,
) -> Option<Job> {
    let free = |t: &&&Trial| !busy.contains(&t.id);
    for t in trials.iter().filter(free) {
        let (reached, open) = position(records.get(&t.id));
        // A trial past this sweep's max_steps (lowered since it ran) has nothing left.
        let target = next_rung(es, reached);
        if open && records.contains_key(&t.id) && target > reached {
            return Some(Job { index: t.index, target });
        }
    }
    if let Some(job) = promotion(es, trials, records, busy, maximize, false) {
        return Some(job);
    }
    if let Some(t) = trials.iter().filter(free).find(|t| !records.contains_key(&t.id)) {
        return Some(Job {
            index: t.index,
            target: es.rungs()[0],
        });
    }
    let running_or_new = trials.iter().any(|t| busy.contains(&t.id));
    let finished = records
        .values()
        .any(|r| r.rungs.last().is_some_and(|g| g.decision == Decision::Done));
    if running_or_new || finished {
        return None;
    }
    promotion(es, trials, records, busy, maximize, true)
}

/// The best stopped trial of the highest rung that is in the top 1/eta there (`drain`: the
/// best there, whatever its rank).
fn promotion(
    es: &EarlyStop,
    trials: &[&Trial],
    records: &BTreeMap<String, Record>,
    busy: &BTreeSet<String>,
    maximize: bool,
    drain: bool,
) -> Option<Job> {
    for step in es.rungs().into_iter().rev().skip(1) {
        let all = reported_at(records.values(), step, "");
        let mut stopped: Vec<(&Trial, Option<f64>)> = trials
            .iter()
            .filter(|t| !busy.contains(&t.id))
            .filter_map(|t| {
                let r = records.get(&t.id)?;
                let last = r.rungs.last()?;
                (r.status == Status::StoppedEarly && last.step == step && last.decision == Decision::Stop)
                    .then_some((*t, last.value))
            })
            .collect();
        stopped.sort_by(|a, b| {
            if better(a.1, b.1, maximize) {
                std::cmp::Ordering::Less
            } else if better(b.1, a.1, maximize) {
                std::cmp::Ordering::Greater
            } else {
                a.0.index.cmp(&b.0.index)
            }
        });
        if let Some((t, v)) = stopped.first() {
            let others: Vec<Option<f64>> = all.iter().copied().filter(|o| better(*o, *v, maximize)).collect();
            let top = v.is_some_and(f64::is_finite) && (drain || in_top(others.len(), all.len(), es.eta));
            if top {
                return Some(Job {
                    index: t.index,
                    target: next_rung(es, step),
                });
            }
        }
    }
    None
}

/// A rung's value from a run directory's metrics.jsonl: the evaluation after step `step`
/// (its record's `step` is step - 1), or that step's training loss.
pub fn value_at(metrics: &str, step: u64, metric: RungMetric) -> Option<f64> {
    let (event, field) = match metric {
        RungMetric::ValLoss => ("eval", "val_loss"),
        RungMetric::Loss => ("step", "loss"),
    };
    metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .rfind(|v| v["event"] == event && v["step"].as_u64() == Some(step.saturating_sub(1)))
        .and_then(|v| v[field].as_f64())
        .filter(|v| v.is_finite())
}

/// The rungs after a segment ended at `step` with `value`: a stopped rung it left is now
/// promoted; the new rung carries its decision.
pub fn after_segment(previous: &[Rung], step: u64, value: Option<f64>, decision: Decision) -> Vec<Rung> {
    let mut rungs: Vec<Rung> = previous.iter().filter(|g| g.step < step).cloned().collect();
    if let Some(last) = rungs.last_mut().filter(|g| g.decision == Decision::Stop) {
        last.decision = Decision::Promoted;
    }
    rungs.push(Rung { step, value, decision });
    rungs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn es() -> EarlyStop {
        EarlyStop {
            metric: RungMetric::ValLoss,
            min_steps: 3,
            eta: 3,
            max_steps: 27,
            max_iter: None,
        }
    }

    fn trial(i: usize) -> Trial {
        Trial {
            index: i,
            id: format!("{i:03}-x"),
            params: BTreeMap::new(),
        }
    }

    fn record(i: usize, status: Status, rungs: Vec<Rung>) -> Record {
        Record {
            rungs,
            ..Record::of(&format!("{i:03}-x"), i, status)
        }
    }

    fn rung(step: u64, value: f64, decision: Decision) -> Rung {
        Rung {
            step,
            value: Some(value),
            decision,
        }
    }

    #[test]
    fn rungs_and_decisions() {
        assert_eq!(es().rungs(), [3, 9, 27]);
        assert_eq!(EarlyStop { max_steps: 20, ..es() }.rungs(), [3, 9, 20]);
        assert_eq!(next_rung(&es(), 0), 3);
        assert_eq!(next_rung(&es(), 9), 27);
        // Fewer than eta reported: none is in the top third yet (it may be promoted later).
        assert_eq!(decide(&es(), 3, Some(2.0), &[], false), Decision::Stop);
        assert_eq!(
            decide(&es(), 3, Some(2.0), &[Some(3.0), Some(4.0)], false),
            Decision::Continue
        );
        assert_eq!(
            decide(&es(), 3, Some(3.5), &[Some(3.0), Some(4.0)], false),
            Decision::Stop
        );
        assert_eq!(
            decide(&es(), 3, Some(5.0), &[Some(3.0), Some(4.0)], true),
            Decision::Continue,
            "maximized"
        );
        // Diverged (NaN is recorded as no value): stopped whatever the others did.
        assert_eq!(
            decide(&es(), 3, None, &[None, None, None, None, None], false),
            Decision::Stop
        );
        assert_eq!(
            decide(&es(), 3, Some(f64::NAN), &[None, None, None, None, None], false),
            Decision::Stop
        );
        assert_eq!(decide(&es(), 27, Some(9.0), &[Some(1.0)], false), Decision::Done);
        assert!(in_top(1, 6, 3) && !in_top(2, 6, 3) && !in_top(0, 2, 3));
    }

    /// A trial promoted past a max_steps lowered since (rungs 3, 9, 27 then max_steps 8) has
    /// nothing left: no job for it, so the scheduler cannot pick it again and again.
    #[test]
    fn a_trial_past_a_lowered_max_steps_gets_no_job() {
        let ts: Vec<Trial> = (0..1).map(trial).collect();
        let mine: Vec<&Trial> = ts.iter().collect();
        let mut records = BTreeMap::new();
        records.insert(
            "000-x".into(),
            record(0, Status::Promoted, vec![rung(9, 1.0, Decision::Continue)]),
        );
        let lowered = EarlyStop { max_steps: 8, ..es() };
        assert_eq!(next(&lowered, &mine, &records, &BTreeSet::new(), false), None);
        assert_eq!(
            next(&es(), &mine, &records, &BTreeSet::new(), false),
            Some(Job { index: 0, target: 27 })
        );
    }

    #[test]
    fn next_job_continues_promotes_then_starts_new_then_drains() {
        let ts: Vec<Trial> = (0..4).map(trial).collect();
        let mine: Vec<&Trial> = ts.iter().collect();
        let none = BTreeSet::new();
        let mut records = BTreeMap::new();
        assert_eq!(
            next(&es(), &mine, &records, &none, false),
            Some(Job { index: 0, target: 3 })
        );
        // 0 and 1 stopped at rung 3 (too few to judge); 2 is the best of three: it went on.
        records.insert(
            "000-x".into(),
            record(0, Status::StoppedEarly, vec![rung(3, 2.0, Decision::Stop)]),
        );
        records.insert(
            "001-x".into(),
            record(1, Status::StoppedEarly, vec![rung(3, 3.0, Decision::Stop)]),
        );
        records.insert(
            "002-x".into(),
            record(2, Status::Promoted, vec![rung(3, 1.0, Decision::Continue)]),
        );
        assert_eq!(
            next(&es(), &mine, &records, &none, false),
            Some(Job { index: 2, target: 9 }),
            "a continued trial first"
        );
        let busy: BTreeSet<String> = ["002-x".to_string()].into();
        // 2 is running: 0 is not in the top floor(3/3) = 1 (2 is better): a new trial.
        assert_eq!(
            next(&es(), &mine, &records, &busy, false),
            Some(Job { index: 3, target: 3 })
        );
        // Trial 3 reports the worst value: six would make 0 promotable; with four it is not.
        records.insert(
            "003-x".into(),
            record(3, Status::StoppedEarly, vec![rung(3, 9.0, Decision::Stop)]),
        );
        assert_eq!(
            next(&es(), &mine, &records, &busy, false),
            None,
            "wait for the running trial"
        );
        // Trial 2 stopped at rung 9 too; nothing runs, nothing reached max_steps: the best at
        // the highest rung (2, at 9) goes on to 27.
        records.insert(
            "002-x".into(),
            record(
                2,
                Status::StoppedEarly,
                vec![rung(3, 1.0, Decision::Continue), rung(9, 0.5, Decision::Stop)],
            ),
        );
        assert_eq!(
            next(&es(), &mine, &records, &none, false),
            Some(Job { index: 2, target: 27 })
        );
        records.insert(
            "002-x".into(),
            record(
                2,
                Status::Ok,
                vec![
                    rung(3, 1.0, Decision::Continue),
                    rung(9, 0.5, Decision::Promoted),
                    rung(27, 0.2, Decision::Done),
                ],
            ),
        );
        assert_eq!(
            next(&es(), &mine, &records, &none, false),
            None,
            "one trial trained in full: done"
        );
        // Six reports at rung 3 make the top two promotable: 2 went on, 0 is second.
        let ts: Vec<Trial> = (0..6).map(trial).collect();
        let mine: Vec<&Trial> = ts.iter().collect();
        records.insert(
            "004-x".into(),
            record(4, Status::StoppedEarly, vec![rung(3, 8.0, Decision::Stop)]),
        );
        records.insert(
            "005-x".into(),
            record(5, Status::StoppedEarly, vec![rung(3, 7.0, Decision::Stop)]),
        );
        assert_eq!(
            next(&es(), &mine, &records, &none, false),
            Some(Job { index: 0, target: 9 })
        );
    }

    #[test]
    fn rung_values_and_history() {
        let m = "{\"event\":\"step\",\"step\":2,\"loss\":4.5}\n{\"event\":\"eval\",\"step\":2,\"val_loss\":4.25}\n\
            {\"event\":\"eval\",\"step\":8,\"val_loss\":null}\n";
        assert_eq!(value_at(m, 3, RungMetric::ValLoss), Some(4.25));
        assert_eq!(value_at(m, 3, RungMetric::Loss), Some(4.5));
        assert_eq!(value_at(m, 9, RungMetric::ValLoss), None, "NaN is written as null");
        let h = after_segment(&[rung(3, 2.0, Decision::Stop)], 9, Some(1.0), Decision::Continue);
        assert_eq!(h, [rung(3, 2.0, Decision::Promoted), rung(9, 1.0, Decision::Continue)]);
    }
}
