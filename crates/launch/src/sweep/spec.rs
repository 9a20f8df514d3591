//! The sweep file: raw (serde, unknown keys refused) → a validated `Sweep`, whose trials are
//! expanded by pure functions (a grid, or seeded random draws).
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::ConfigError;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSweep {
    /// The config every trial starts from, relative to the sweep file.
    base: PathBuf,
    #[serde(default)]
    method: Method,
    /// Random draws: how many trials.
    count: Option<usize>,
    #[serde(default)]
    seed: u64,
    parameters: BTreeMap<String, RawParam>,
    #[serde(default)]
    trial: RawTrial,
    #[serde(default)]
    metric: Metric,
    /// Ask `oomguard plan` before each fresh trial (an infeasible one then costs seconds).
    #[serde(default = "yes")]
    planner: bool,
    /// Memory the planner fits GPU trials into (a size or a card, as `plan --device-memory`).
    device_memory: Option<String>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    #[default]
    Grid,
    Random,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawParam {
    value: Option<serde_yaml::Value>,
    values: Option<Vec<serde_yaml::Value>>,
    distribution: Option<Distribution>,
    min: Option<f64>,
    max: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Distribution {
    Uniform,
    LogUniform,
    IntUniform,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrial {
    /// Wall-clock limit per trial (`30m`, `2h`); the trial is stopped (SIGTERM: it checkpoints).
    timeout: Option<String>,
    /// After SIGTERM, how long a trial may take to checkpoint and exit before SIGKILL.
    grace: Option<String>,
}

/// Which trial is best.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    #[default]
    BestEvalLoss,
    FinalEvalLoss,
    TokensPerS,
}

impl Metric {
    pub fn name(self) -> &'static str {
        match self {
            Metric::BestEvalLoss => "best_eval_loss",
            Metric::FinalEvalLoss => "final_eval_loss",
            Metric::TokensPerS => "tokens_per_s",
        }
    }
    pub fn maximize(self) -> bool {
        self == Metric::TokensPerS
    }
}

/// One parameter's domain.
#[derive(Debug, Clone, PartialEq)]
pub enum Domain {
    Values(Vec<Value>),
    Range { distribution: Distribution, min: f64, max: f64 },
}

/// One trial: its place in the sweep and the config keys it sets.
#[derive(Debug, Clone, PartialEq)]
pub struct Trial {
    pub index: usize,
    /// `NNN-hash`: the index and a hash of the parameters, so an edited sweep file never
    /// mistakes one trial's results for another's.
    pub id: String,
    pub params: BTreeMap<String, Value>,
}

impl Trial {
    /// `--set key=value` arguments for `oomguard train`.
    pub fn overrides(&self) -> Vec<String> {
        self.params.iter().flat_map(|(k, v)| ["--set".to_string(), format!("{k}={}", scalar(v))]).collect()
    }
    /// `key=value key=value`, for logs and tables.
    pub fn describe(&self) -> String {
        self.params.iter().map(|(k, v)| format!("{k}={}", scalar(v))).collect::<Vec<_>>().join(" ")
    }
}

/// A value as `--set` parses it (YAML scalar syntax; strings that read as another type quoted).
pub fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => serde_yaml::to_string(s).map(|t| t.trim_end().to_string()).unwrap_or_else(|_| s.clone()),
        other => other.to_string(),
    }
}

/// The validated sweep.
#[derive(Debug, Clone)]
pub struct Sweep {
    pub path: PathBuf,
    pub base: PathBuf,
    pub method: Method,
    pub trials: Vec<Trial>,
    pub timeout: Option<Duration>,
    pub grace: Duration,
    pub metric: Metric,
    pub planner: bool,
    pub device_memory: Option<String>,
}

/// Reads and validates a sweep file.
pub fn load(path: &Path) -> Result<Sweep, ConfigError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError { origin: origin.clone(), line_col: None, key: String::new(), message: format!("cannot read: {e}") })?;
    let raw: RawSweep = serde_yaml::from_str(&text).map_err(|e| ConfigError::from_yaml(&origin, e))?;
    let at = |e: ConfigError| ConfigError { origin: origin.clone(), ..e };
    let base = path.parent().unwrap_or(Path::new(".")).join(&raw.base);
    if !base.is_file() {
        return Err(at(ConfigError::invalid("base", format!("{} is not a file; give the config every trial starts from, relative to the sweep file", base.display()))));
    }
    let mut domains = Vec::new();
    for (key, p) in &raw.parameters {
        domains.push((key.clone(), domain(key, p, raw.method).map_err(at)?));
    }
    if domains.is_empty() {
        return Err(at(ConfigError::invalid("parameters", "is empty; give at least one config key, e.g. optim.lr: {values: [1.0e-3, 3.0e-3]}")));
    }
    let trials = match (raw.method, raw.count) {
        (Method::Grid, Some(_)) => return Err(at(ConfigError::invalid("count", "is for method: random (a grid runs every combination)"))),
        (Method::Grid, None) => grid(&domains),
        (Method::Random, None | Some(0)) => return Err(at(ConfigError::invalid("count", "is required with method: random: how many trials to draw, at least 1"))),
        (Method::Random, Some(n)) => random(&domains, n, raw.seed),
    };
    let duration = |key: &str, text: &Option<String>| -> Result<Option<Duration>, ConfigError> {
        text.as_deref()
            .map(|t| humantime::parse_duration(t).map_err(|e| at(ConfigError::invalid(key, format!("`{t}` is not a duration ({e}); e.g. 90s, 30m, 2h")))))
            .transpose()
    };
    Ok(Sweep {
        path: path.to_path_buf(),
        base,
        method: raw.method,
        trials,
        timeout: duration("trial.timeout", &raw.trial.timeout)?,
        grace: duration("trial.grace", &raw.trial.grace)?.unwrap_or(Duration::from_secs(120)),
        metric: raw.metric,
        planner: raw.planner,
        device_memory: raw.device_memory,
    })
}

fn domain(key: &str, p: &RawParam, method: Method) -> Result<Domain, ConfigError> {
    let k = format!("parameters.{key}");
    if key.split('.').count() < 2 || key.split('.').any(str::is_empty) {
        return Err(ConfigError::invalid(&k, "is not a config key path; use section.key, e.g. optim.lr or model.n_embd"));
    }
    let json = |v: &serde_yaml::Value| -> Result<Value, ConfigError> {
        match v {
            serde_yaml::Value::Bool(_) | serde_yaml::Value::Number(_) | serde_yaml::Value::String(_) => {
                serde_json::to_value(v).map_err(|e| ConfigError::invalid(&k, e.to_string()))
            }
            _ => Err(ConfigError::invalid(&k, "values must be numbers, strings or booleans")),
        }
    };
    match (&p.value, &p.values, p.distribution) {
        (Some(v), None, None) => Ok(Domain::Values(vec![json(v)?])),
        (None, Some(vs), None) if !vs.is_empty() => Ok(Domain::Values(vs.iter().map(json).collect::<Result<_, _>>()?)),
        (None, Some(_), None) => Err(ConfigError::invalid(&k, "values is empty; give at least one")),
        (None, None, Some(_)) if method == Method::Grid => {
            Err(ConfigError::invalid(&k, "a distribution needs method: random (a grid takes value or values)"))
        }
        (None, None, Some(distribution)) => {
            let (Some(min), Some(max)) = (p.min, p.max) else {
                return Err(ConfigError::invalid(&k, "a distribution needs min and max"));
            };
            if min > max || !min.is_finite() || !max.is_finite() {
                return Err(ConfigError::invalid(&k, format!("min {min} is above max {max}; give min <= max")));
            }
            if distribution == Distribution::LogUniform && min <= 0.0 {
                return Err(ConfigError::invalid(&k, "log_uniform needs min > 0"));
            }
            Ok(Domain::Range { distribution, min, max })
        }
        _ => Err(ConfigError::invalid(&k, "give exactly one of value, values, or distribution (with min and max)")),
    }
}

fn trial(index: usize, params: BTreeMap<String, Value>) -> Trial {
    // FNV-1a over the parameters' JSON: stable across versions and machines.
    let text = serde_json::to_string(&params).unwrap_or_default();
    let hash = text.bytes().fold(0x811c9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x01000193));
    Trial { index, id: format!("{index:03}-{hash:08x}"), params }
}

/// Every combination, the last key varying fastest.
pub fn grid(domains: &[(String, Domain)]) -> Vec<Trial> {
    let mut combos: Vec<BTreeMap<String, Value>> = vec![BTreeMap::new()];
    for (key, d) in domains {
        let Domain::Values(values) = d else { continue };
        combos = combos.into_iter().flat_map(|c| values.iter().map(move |v| {
            let mut c = c.clone();
            c.insert(key.clone(), v.clone());
            c
        })).collect();
    }
    combos.into_iter().enumerate().map(|(i, p)| trial(i, p)).collect()
}

/// `count` draws from a generator seeded by `seed` (the same file always gives the same trials).
pub fn random(domains: &[(String, Domain)], count: usize, seed: u64) -> Vec<Trial> {
    let mut rng = SplitMix(seed);
    (0..count)
        .map(|i| {
            let params = domains.iter().map(|(k, d)| (k.clone(), draw(d, &mut rng))).collect();
            trial(i, params)
        })
        .collect()
}

fn draw(d: &Domain, rng: &mut SplitMix) -> Value {
    let u = rng.unit();
    match *d {
        Domain::Values(ref vs) => vs[((u * vs.len() as f64) as usize).min(vs.len() - 1)].clone(),
        Domain::Range { distribution: Distribution::IntUniform, min, max } => {
            let (lo, hi) = (min.ceil() as i64, max.floor() as i64);
            Value::from(lo + ((u * (hi - lo + 1) as f64) as i64).min(hi - lo))
        }
        Domain::Range { distribution, min, max } => {
            let x = match distribution {
                Distribution::LogUniform => (min.ln() + u * (max.ln() - min.ln())).exp(),
                _ => min + u * (max - min),
            };
            // Six significant digits: readable in tables, exact through --set.
            let x: f64 = format!("{x:.5e}").parse().unwrap_or(x);
            Value::from(x)
        }
    }
}

/// A small, well-known generator: the draws must not change with a crate's version.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn values(v: &[Value]) -> Domain {
        Domain::Values(v.to_vec())
    }

    #[test]
    fn grid_is_every_combination_in_order() {
        let d = vec![("a.x".to_string(), values(&[json!(1), json!(2)])), ("b.y".to_string(), values(&[json!("p"), json!("q"), json!("r")]))];
        let t = grid(&d);
        assert_eq!(t.len(), 6);
        assert_eq!(t[0].params, BTreeMap::from([("a.x".into(), json!(1)), ("b.y".into(), json!("p"))]));
        assert_eq!(t[5].params, BTreeMap::from([("a.x".into(), json!(2)), ("b.y".into(), json!("r"))]));
        assert!(t[3].id.starts_with("003-"));
        let ids: std::collections::HashSet<_> = t.iter().map(|t| t.id.clone()).collect();
        assert_eq!(ids.len(), 6);
    }

    #[test]
    fn random_draws_are_seeded_and_in_range() {
        let d = vec![
            ("optim.lr".to_string(), Domain::Range { distribution: Distribution::LogUniform, min: 1e-4, max: 1e-2 }),
            ("model.n_layer".to_string(), Domain::Range { distribution: Distribution::IntUniform, min: 1.0, max: 3.0 }),
        ];
        let (a, b) = (random(&d, 50, 7), random(&d, 50, 7));
        assert_eq!(a, b);
        assert_ne!(a, random(&d, 50, 8));
        let layers: std::collections::BTreeSet<i64> = a.iter().map(|t| t.params["model.n_layer"].as_i64().unwrap()).collect();
        assert_eq!(layers, [1, 2, 3].into());
        assert!(a.iter().all(|t| (1e-4..=1e-2).contains(&t.params["optim.lr"].as_f64().unwrap())));
    }

    #[test]
    fn values_pass_through_set_as_their_type() {
        assert_eq!(scalar(&json!(0.001)), "0.001");
        assert_eq!(scalar(&json!(64)), "64");
        assert_eq!(scalar(&json!("bf16")), "bf16");
        assert_eq!(scalar(&json!("10")), "'10'"); // a string that reads as a number stays a string
        assert_eq!(scalar(&json!(true)), "true");
    }
}
