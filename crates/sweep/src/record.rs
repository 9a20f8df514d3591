//! Owns what results.jsonl says about a trial: status, summary and early-stopping rungs.
//! Keeps: a contract; fields are added, never renamed.
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    /// Does not fit even at micro-batch 1 (exit 3), told by the planner or the run.
    Infeasible,
    /// Exited with another code; `message` says why.
    Failed,
    /// Ran past `trial.timeout` (stopped with a checkpoint).
    Timeout,
    /// The sweep (or someone) stopped it: the next start of the sweep resumes it.
    Interrupted,
    /// Early stopping: below the top 1/eta at its rung (`rung`); it may be promoted later.
    StoppedEarly,
    /// Early stopping: in the top at its rung, going on to the next (not final).
    Promoted,
    /// Model-based search proposed it (its parameters kept for a restart); not run to its end yet.
    Proposed,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Infeasible => "infeasible",
            Status::Failed => "failed",
            Status::Timeout => "timeout",
            Status::Interrupted => "interrupted",
            Status::StoppedEarly => "stopped_early",
            Status::Promoted => "promoted",
            Status::Proposed => "proposed",
        }
    }
    /// Its metric is a value the sweep's schedule asked for: at the end (ok) or at an
    /// early-stopping rung. A failed, timed-out or interrupted trial's is not (W&B's
    /// `metric.target` counts these).
    pub fn reached_on_schedule(self) -> bool {
        matches!(self, Status::Ok | Status::StoppedEarly | Status::Promoted)
    }
    /// Finished (a stopped_early trial unless promoted later): a restarted sweep skips it.
    pub fn is_final(self) -> bool {
        !matches!(self, Status::Interrupted | Status::Promoted | Status::Proposed)
    }
}

/// One line of results.jsonl (a contract: fields are added, never renamed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub trial: String,
    pub index: usize,
    pub params: BTreeMap<String, Value>,
    pub status: Status,
    /// Infeasible: "planner" (before the trial ran) or "run" (the run exited 3).
    pub told_by: Option<String>,
    pub exit_code: Option<i32>,
    /// What its metrics.jsonl says: eval losses, tokens/s, final micro-batch, OOMs, steps.
    #[serde(flatten)]
    pub summary: Summary,
    /// Wall-clock seconds, over every start of the trial.
    pub duration_s: f64,
    /// Relative to the sweep directory.
    pub run_dir: String,
    pub message: Option<String>,
    /// `I/N`: the shard that ran it.
    pub shard: String,
    pub finished_at: String,
    /// The sweep's metric (its record field's name, e.g. `final_eval_loss`), which `oomguard
    /// report` ranks the trials by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric: Option<String>,
    /// Early stopping: the rung (its step) where a `stopped_early` trial stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rung: Option<u64>,
    /// Early stopping: what it reported at each rung and the decision (replayed on restart).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rungs: Vec<Rung>,
}

#[cfg(test)]
impl Record {
    /// A record for the tests: `trial` at `index` with `status`, exit 0, shard `0/1`, the
    /// rest empty; a test sets what it needs with `Record { field, ..Record::of(...) }`.
    pub(crate) fn of(trial: &str, index: usize, status: Status) -> Record {
        Record {
            trial: trial.into(),
            index,
            params: BTreeMap::new(),
            status,
            told_by: None,
            exit_code: Some(0),
            summary: Summary::default(),
            duration_s: 0.0,
            run_dir: String::new(),
            message: None,
            shard: "0/1".into(),
            finished_at: String::new(),
            metric: None,
            rung: None,
            rungs: vec![],
        }
    }
}

/// What a trial's metrics.jsonl says (the record's fields of the same names).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The last evaluation's loss, and the lowest.
    pub final_eval_loss: Option<f64>,
    pub best_eval_loss: Option<f64>,
    /// The last step's training loss.
    #[serde(default)]
    pub final_loss: Option<f64>,
    /// Mean over the trial's steps.
    pub tokens_per_s: Option<f64>,
    pub final_micro_batch_size: Option<usize>,
    pub ooms: u64,
    /// Optimizer steps done.
    pub steps: u64,
}

/// What a trial reported at a rung, and what was decided.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rung {
    pub step: u64,
    /// The rung's metric (None: not a finite number, a diverged trial).
    pub value: Option<f64>,
    pub decision: Decision,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// In the top 1/eta at its rung: on to the next.
    Continue,
    /// Below it: stopped here.
    Stop,
    /// Stopped here, promoted later.
    Promoted,
    /// The last rung: max_steps.
    Done,
}
