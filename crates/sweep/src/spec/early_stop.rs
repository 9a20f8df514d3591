//! Owns early stopping: ours (`early_stop: asha`) or W&B's hyperband, as rungs at training steps.
//! Keeps: rungs increase and end at the trials' max_steps (the whole run).
use oomguard_console::ConfigError;
use serde_json::Value;
use std::path::Path;

use super::{Domain, Metric, RawEarlyTerminate, RawSweep};

/// What ASHA compares at a rung: the evaluation's loss there, or the step's training loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RungMetric {
    ValLoss,
    Loss,
}

/// Asynchronous successive halving (Li et al., "A System for Massively Parallel
/// Hyperparameter Tuning", MLSys 2020): rungs at min_steps * eta^k below max_steps, or at
/// W&B's hyperband bands max_iter / eta^k (k = 1..s) below max_steps; then max_steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EarlyStop {
    pub metric: RungMetric,
    /// The first rung.
    pub min_steps: u64,
    pub eta: u64,
    pub max_steps: u64,
    /// W&B's `max_iter` and `s`, when the file gives them (the rungs are then W&B's bands).
    pub max_iter: Option<(u64, u64)>,
}

/// W&B's hyperband bands from max_iter and s (hyperband_stopping.py): max_iter / eta,
/// max_iter / eta^2, ... s of them, each truncated, none below 1; ascending.
pub fn hyperband_bands(max_iter: u64, s: u64, eta: u64) -> Vec<u64> {
    let mut band = max_iter as f64;
    let mut bands = vec![];
    for _ in 0..s {
        band /= eta as f64;
        if band < 1.0 {
            break;
        }
        bands.push(band as u64);
    }
    bands.sort_unstable();
    bands.dedup();
    bands
}

impl EarlyStop {
    pub fn metric_name(&self) -> &'static str {
        match self.metric {
            RungMetric::ValLoss => "val_loss",
            RungMetric::Loss => "loss",
        }
    }

    /// The steps where trials report: min_steps, min_steps * eta, ... (or W&B's bands of
    /// max_iter and s) below max_steps, and max_steps.
    pub fn rungs(&self) -> Vec<u64> {
        let mut r = vec![];
        if let Some((max_iter, s)) = self.max_iter {
            r = hyperband_bands(max_iter, s, self.eta);
            r.retain(|b| *b < self.max_steps);
        } else {
            let mut s = self.min_steps;
            while s < self.max_steps {
                r.push(s);
                s = s.saturating_mul(self.eta);
            }
        }
        r.push(self.max_steps);
        r
    }
}

/// `early_stop` (ours) or W&B's `early_terminate: {type: hyperband, min_iter, eta}` (a W&B
/// iteration is a training step here); max_steps defaults to the trials' train.max_steps.
pub(super) fn early_stop(
    raw: &RawSweep,
    metric: Metric,
    base: &Path,
    domains: &[(String, Domain)],
) -> Result<Option<EarlyStop>, ConfigError> {
    let (key, min_steps, eta, max_steps, rung_metric, max_iter) = match (&raw.early_stop, &raw.early_terminate) {
        (None, None) => return Ok(None),
        (Some(_), Some(_)) => {
            return Err(ConfigError::invalid(
                "early_terminate",
                "and early_stop are two spellings of one setting; give one",
            ))
        }
        (Some(e), None) => {
            if e.kind != "asha" {
                return Err(ConfigError::invalid(
                    "early_stop.type",
                    format!("`{}` is not supported; use asha", e.kind),
                ));
            }
            let m = match e.metric.as_deref() {
                None => None,
                Some("val_loss" | "eval_loss") => Some(RungMetric::ValLoss),
                Some("loss") => Some(RungMetric::Loss),
                Some(other) => {
                    return Err(ConfigError::invalid(
                        "early_stop.metric",
                        format!("`{other}` is not one a rung can compare; these exist: val_loss, loss"),
                    ))
                }
            };
            ("early_stop", e.min_steps, e.reduction_factor, e.max_steps, m, None)
        }
        (None, Some(t)) => {
            let (min, eta, max_iter) = hyperband(t)?;
            ("early_terminate", min, eta, None, None, max_iter)
        }
    };
    let rung_metric = rung_metric.unwrap_or(if metric == Metric::FinalLoss {
        RungMetric::Loss
    } else {
        RungMetric::ValLoss
    });
    let max_steps = match max_steps {
        Some(m) => m,
        None => trials_max_steps(base, domains)
            .or(max_iter.map(|m| m.0))
            .ok_or_else(|| {
                ConfigError::invalid(
                    &format!("{key}.max_steps"),
                    "is needed: the trials' train.max_steps is not one number in the base config or the parameters",
                )
            })?,
    };
    if domains.iter().any(|(k, d)| k == "train.max_steps" && !d.is_constant()) {
        return Err(ConfigError::invalid(
            "parameters.train.max_steps",
            "varies, but early stopping gives every trial the same max_steps",
        ));
    }
    if eta < 2 {
        return Err(ConfigError::invalid(
            &format!("{key}.{}", if key == "early_stop" { "reduction_factor" } else { "eta" }),
            format!("is {eta}; give 2 or more (3 keeps the top third at each rung)"),
        ));
    }
    if let Some((m, s)) = max_iter.filter(|(m, s)| hyperband_bands(*m, *s, eta).iter().all(|b| *b >= max_steps)) {
        return Err(ConfigError::invalid(
            "early_terminate.max_iter",
            format!("({m}, with s {s} and eta {eta}) puts no rung below max_steps {max_steps} (W&B's bands: {:?}); give a max_iter near the trials' \
                train.max_steps, or min_iter", hyperband_bands(m, s, eta)),
        ));
    }
    if min_steps == 0 || min_steps >= max_steps {
        return Err(ConfigError::invalid(
            &format!("{key}.{}", if key == "early_stop" { "min_steps" } else { "min_iter" }),
            format!("is {min_steps}; give 1 or more, below max_steps {max_steps}"),
        ));
    }
    Ok(Some(EarlyStop {
        metric: rung_metric,
        min_steps,
        eta,
        max_steps,
        max_iter,
    }))
}

/// W&B's `early_terminate: {type: hyperband, ...}` checked as W&B's schema and engine check
/// it: `min_iter` (and eta), or `max_iter` with `s` (the engine prefers these when both forms
/// are given). Returns the first rung, eta, and max_iter with s.
/// W&B's hyperband read: the first rung, eta, and max_iter with s (its second form).
pub(super) type Hyperband = (u64, u64, Option<(u64, u64)>);

pub(super) fn hyperband(t: &RawEarlyTerminate) -> Result<Hyperband, ConfigError> {
    let schema = "W&B's schema: early_terminate is not valid under any of the given schemas";
    if t.kind != "hyperband" {
        return Err(ConfigError::invalid(
            "early_terminate.type",
            format!(
                "'{}' is not one of ['hyperband'] (W&B's schema); W&B's hyperband is what oomguard runs (as ASHA)",
                t.kind
            ),
        ));
    }
    if t.eta.is_nan() || t.eta <= 1.0 {
        return Err(ConfigError::invalid(
            "early_terminate.eta",
            format!(
                "is {}; W&B's schema wants a number above 1 ({schema}); give 2 or more",
                t.eta
            ),
        ));
    }
    if t.eta.fract() != 0.0 {
        return Err(ConfigError::invalid(
            "early_terminate.eta",
            format!(
                "is {}; oomguard's rungs take a whole eta: give {} or {}",
                t.eta,
                t.eta.floor().max(2.0),
                t.eta.ceil()
            ),
        ));
    }
    let eta = t.eta as u64;
    if t.strict == Some(false) {
        return Err(ConfigError::invalid(
            "early_terminate.strict",
            "is false (W&B: compare a run's best value so far); oomguard cannot honour it: a \
            rung compares the value at the rung, W&B's strict: true (its default): remove strict or give true",
        ));
    }
    if let Some(m) = t.min_iter.filter(|m| *m < 1) {
        return Err(ConfigError::invalid(
            "early_terminate.min_iter",
            format!("is {m}; W&B's schema wants 1 or more ({schema})"),
        ));
    }
    match (t.max_iter, t.s, t.min_iter) {
        (Some(m), Some(s), _) => {
            if m < 1 {
                return Err(ConfigError::invalid(
                    "early_terminate.max_iter",
                    format!("is {m}; give the last step at which to stop trials, 1 or more"),
                ));
            }
            if s.fract() != 0.0 || s < 1.0 {
                return Err(ConfigError::invalid(
                    "early_terminate.s",
                    format!("is {s}; W&B's engine counts s bands (range(s)): give a whole number, 1 or more"),
                ));
            }
            let bands = hyperband_bands(m as u64, s as u64, eta);
            match bands.first() {
                Some(first) => Ok((*first, eta, Some((m as u64, s as u64)))),
                None => Err(ConfigError::invalid("early_terminate.max_iter", format!("is {m} with eta {eta}: no band (W&B's engine: \"Bands must be an \
                    array of length at least 1. Try increasing s, decreasing eta, or increasing min_iter.\"); give max_iter of eta or more"))),
            }
        }
        (_, _, Some(min)) => Ok((min as u64, eta, None)),
        (Some(_), None, None) => Err(ConfigError::invalid(
            "early_terminate.s",
            format!(
                "is required with max_iter ({schema}): the number of rungs below max_iter, e.g. s: 2; or give min_iter"
            ),
        )),
        (None, _, None) => Err(ConfigError::invalid(
            "early_terminate.min_iter",
            format!("is required (or max_iter with s; {schema}): the first rung, in training steps"),
        )),
    }
}

pub(super) fn base_yaml(base: &Path) -> Option<serde_yaml::Value> {
    serde_yaml::from_str(&std::fs::read_to_string(base).ok()?).ok()
}

pub(super) fn base_has(base: &Path, section: &str, key: &str) -> bool {
    base_yaml(base).is_some_and(|v| v.get(section).and_then(|s| s.get(key)).is_some_and(|v| !v.is_null()))
}

/// train.max_steps of every trial: a constant parameter's, else the base config's.
pub(super) fn trials_max_steps(base: &Path, domains: &[(String, Domain)]) -> Option<u64> {
    if let Some((_, Domain::Values { values, .. })) = domains.iter().find(|(k, _)| k == "train.max_steps") {
        return values.first().and_then(Value::as_u64);
    }
    base_yaml(base)?.get("train")?.get("max_steps")?.as_u64()
}
