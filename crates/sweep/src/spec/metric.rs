//! Owns the sweep's metric: which record a trial is judged by, W&B's names mapped onto ours.
//! Keeps: a name is one of METRIC_NAMES, and a W&B goal never contradicts its direction.
use oomguard_console::ConfigError;
use serde::Deserialize;

use super::RawMetric;

/// Which trial is best.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    #[default]
    BestEvalLoss,
    FinalEvalLoss,
    /// The last step's training loss (W&B's `loss`).
    FinalLoss,
    TokensPerS,
}

/// Metric names a sweep file may give, and what each means here (W&B's names first: a
/// W&B sweep's metric is the run's last logged value).
pub(super) const METRIC_NAMES: [(&str, Metric); 7] = [
    ("val_loss", Metric::FinalEvalLoss),
    ("loss", Metric::FinalLoss),
    ("tokens_per_s", Metric::TokensPerS),
    ("best_eval_loss", Metric::BestEvalLoss),
    ("final_eval_loss", Metric::FinalEvalLoss),
    ("final_loss", Metric::FinalLoss),
    ("eval_loss", Metric::FinalEvalLoss),
];

impl Metric {
    pub fn name(self) -> &'static str {
        match self {
            Metric::BestEvalLoss => "best_eval_loss",
            Metric::FinalEvalLoss => "final_eval_loss",
            Metric::FinalLoss => "final_loss",
            Metric::TokensPerS => "tokens_per_s",
        }
    }
    pub fn maximize(self) -> bool {
        self == Metric::TokensPerS
    }
    fn parse(key: &str, name: &str) -> Result<Metric, ConfigError> {
        METRIC_NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, m)| *m)
            .ok_or_else(|| {
                let known: Vec<&str> = METRIC_NAMES.iter().map(|(n, _)| *n).collect();
                ConfigError::invalid(
                    key,
                    format!(
                        "`{name}` is not a metric oomguard records; these exist: {}",
                        known.join(", ")
                    ),
                )
            })
    }
}

pub(super) fn metric(raw: &RawMetric) -> Result<(Metric, Option<f64>), ConfigError> {
    match raw {
        RawMetric::Ours(name) => Ok((Metric::parse("metric", name)?, None)),
        RawMetric::Wandb(w) => {
            let m = Metric::parse("metric.name", &w.name)?;
            if let Some(t) = w.target.filter(|t| !t.is_finite()) {
                return Err(ConfigError::invalid("metric.target", format!("is {t}; give a number")));
            }
            match w.impute.as_deref() {
                None | Some("worst") => {}
                Some(i @ ("latest" | "best")) => return Err(ConfigError::invalid("metric.impute", format!("is {i}; oomguard cannot honour it: \
                    model-based search counts a failed or infeasible trial as bad (W&B's worst): remove impute or give worst"))),
                Some(i) => return Err(ConfigError::invalid("metric.impute", format!("'{i}' is not one of ['latest', 'best', 'worst'] (W&B's schema)"))),
            }
            match &w.impute_while_running {
                None => {}
                Some(serde_yaml::Value::Bool(false)) => {}
                Some(serde_yaml::Value::String(v)) if v == "false" => {}
                Some(_) => {
                    return Err(ConfigError::invalid(
                        "metric.impute_while_running",
                        "is W&B's; oomguard cannot honour it (a trial's metric is read when it ends): remove it",
                    ))
                }
            }
            let want = if m.maximize() { "maximize" } else { "minimize" };
            match w.goal.as_deref() {
                None => Ok((m, w.target)),
                Some(g) if g == want => Ok((m, w.target)),
                Some(g @ ("minimize" | "maximize")) => Err(ConfigError::invalid(
                    "metric.goal",
                    format!("is {g} but {} is one to {want}; oomguard cannot honour it", w.name),
                )),
                Some(g) => Err(ConfigError::invalid(
                    "metric.goal",
                    format!("'{g}' is not one of ['minimize', 'maximize'] (W&B's schema)"),
                )),
            }
        }
    }
}
