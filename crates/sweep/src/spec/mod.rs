//! Owns the sweep file: raw (serde, unknown keys refused) to a validated `Sweep`.
//! Keeps: a W&B key means what W&B's engine makes of it, or the file is refused naming the key;
//! trials are expanded by pure functions.
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::command;
pub use super::command::Runner;
pub use super::domain::Domain;
use oomguard_console::ConfigError;

mod early_stop;
mod metric;
mod params;
use early_stop::{base_has, early_stop};
pub use early_stop::{EarlyStop, RungMetric};
use metric::metric;
pub use metric::Metric;
pub use params::fnv1a;
pub use params::{corners, grid, random, trial_of, Trial};
use params::{domain, flatten, MAX_GRID};

/// The sweep file as written: ours, or W&B's (whose keys are read as W&B defines them).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSweep {
    /// The config every trial starts from, relative to the sweep file (not with a `command`
    /// that runs a script through `oomguard launch`).
    base: Option<PathBuf>,
    method: Option<String>,
    /// Random and model-based search: how many trials (W&B: `run_cap`).
    count: Option<usize>,
    run_cap: Option<usize>,
    #[serde(default)]
    seed: u64,
    parameters: BTreeMap<String, RawParam>,
    #[serde(default)]
    trial: RawTrial,
    #[serde(default)]
    metric: RawMetric,
    /// Ask `oomguard plan` before each fresh trial (an infeasible one then costs seconds).
    #[serde(default = "yes")]
    planner: bool,
    /// Memory the planner fits GPU trials into (a size or a card, as `plan --device-memory`).
    device_memory: Option<String>,
    early_stop: Option<RawEarlyStop>,
    /// W&B's spelling of early stopping (hyperband), mapped onto ASHA.
    early_terminate: Option<RawEarlyTerminate>,
    /// W&B's: what its agent runs; `${program}` in `command`, else ignored with a notice.
    program: Option<serde_yaml::Value>,
    /// W&B's: the agent's command line with its macros (command.rs reads it).
    command: Option<serde_yaml::Value>,
    project: Option<serde_yaml::Value>,
    entity: Option<serde_yaml::Value>,
    /// W&B's labels: accepted, shown nowhere here.
    #[allow(dead_code)]
    name: Option<String>,
    #[allow(dead_code)]
    description: Option<String>,
    /// W&B's keys that oomguard cannot honour: refused, each with the nearest thing it does.
    controller: Option<serde_yaml::Value>,
    scheduler: Option<serde_yaml::Value>,
    metrics: Option<serde_yaml::Value>,
    job: Option<serde_yaml::Value>,
    image_uri: Option<serde_yaml::Value>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Method {
    #[default]
    Grid,
    Random,
    /// W&B's name for model-based search: here a Tree-structured Parzen Estimator.
    Bayes,
    Tpe,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawParam {
    value: Option<serde_yaml::Value>,
    values: Option<Vec<serde_yaml::Value>>,
    distribution: Option<String>,
    min: Option<serde_yaml::Value>,
    max: Option<serde_yaml::Value>,
    q: Option<serde_yaml::Value>,
    mu: Option<f64>,
    sigma: Option<f64>,
    probabilities: Option<Vec<f64>>,
    /// W&B's nested parameters: the keys under it extend this one's path (`optim` + `lr`
    /// is the config key `optim.lr`).
    parameters: Option<BTreeMap<String, RawParam>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrial {
    /// Wall-clock limit per trial (`30m`, `2h`); the trial is stopped (SIGTERM: it checkpoints).
    timeout: Option<String>,
    /// After SIGTERM, how long a trial may take to checkpoint and exit before SIGKILL.
    grace: Option<String>,
}

/// `metric: best_eval_loss`, or W&B's `metric: {name: val_loss, goal: minimize}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawMetric {
    Ours(String),
    Wandb(RawWandbMetric),
}

impl Default for RawMetric {
    fn default() -> Self {
        RawMetric::Ours("best_eval_loss".into())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWandbMetric {
    name: String,
    goal: Option<String>,
    /// Stop starting trials once one reaches it (W&B's: the sweep finishes).
    target: Option<f64>,
    impute: Option<String>,
    impute_while_running: Option<serde_yaml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEarlyStop {
    #[serde(rename = "type")]
    kind: String,
    metric: Option<String>,
    min_steps: u64,
    #[serde(default = "three")]
    reduction_factor: u64,
    max_steps: Option<u64>,
}

fn three() -> u64 {
    3
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEarlyTerminate {
    #[serde(rename = "type")]
    kind: String,
    min_iter: Option<i64>,
    /// W&B's schema takes a number above 1; the rungs here take an integer.
    #[serde(default = "three_f")]
    eta: f64,
    /// W&B's second form: rungs at max_iter / eta^k, k = 1..s (hyperband_stopping.py).
    max_iter: Option<i64>,
    s: Option<f64>,
    strict: Option<bool>,
}

fn three_f() -> f64 {
    3.0
}

/// The validated sweep.
#[derive(Debug, Clone)]
pub struct Sweep {
    pub path: PathBuf,
    /// What each trial runs: `oomguard train` of a base config, or a script under launch.
    pub runner: Runner,
    pub method: Method,
    /// Grid and random: every trial, known up front. Model-based: none (proposed as results come).
    pub trials: Vec<Trial>,
    pub domains: Vec<(String, Domain)>,
    /// Trials in all (model-based search: how many it proposes).
    pub count: usize,
    pub seed: u64,
    pub timeout: Option<Duration>,
    pub grace: Duration,
    pub metric: Metric,
    /// W&B's `metric.target`: once a trial's metric reaches it (<= when minimized, >= when
    /// maximized), no new trial starts; running ones finish.
    pub target: Option<f64>,
    pub planner: bool,
    pub device_memory: Option<String>,
    pub early_stop: Option<EarlyStop>,
    /// optim.decay_steps is set (by the base config or a parameter): early stopping's
    /// segments then keep it; else they set it to max_steps, the whole run's schedule.
    pub decay_steps_set: bool,
    /// What was read and how (W&B's program, command, project, entity).
    pub notices: Vec<String>,
    /// W&B's `project` and `entity` as its own variables (WANDB_PROJECT, WANDB_ENTITY) in
    /// each trial's environment: where a trial that logs to W&B logs.
    pub wandb_env: Vec<(String, String)>,
}

impl Sweep {
    pub fn model_based(&self) -> bool {
        matches!(self.method, Method::Bayes | Method::Tpe)
    }
}

/// Reads and validates a sweep file.
pub fn load(path: &Path) -> Result<Sweep, ConfigError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        origin: origin.clone(),
        line_col: None,
        key: String::new(),
        message: format!("cannot read: {e}"),
    })?;
    let raw: RawSweep = serde_yaml::from_str(&text).map_err(|e| ConfigError::from_yaml(&origin, e))?;
    let at = |e: ConfigError| ConfigError {
        origin: origin.clone(),
        ..e
    };
    let method = method(raw.method.as_deref()).map_err(at)?;
    if let Some(m) = raw
        .device_memory
        .as_deref()
        .filter(|m| oomguard_host::memory::device_memory(m).is_none())
    {
        return Err(at(ConfigError::invalid(
            "device_memory",
            format!("`{m}` is neither a size (24GiB, 80 GB) nor a card the planner knows (T4, L4, A10G, A100, A100-40GB, H100, H200)"),
        )));
    }
    let (runner, command_notice) = match (&raw.command, &raw.base) {
        (Some(c), base) => {
            let (r, notice) = command::read(c, raw.program.as_ref(), base.as_deref()).map_err(at)?;
            (r, Some(format!("{origin}: `command` (W&B's) {notice}")))
        }
        (None, Some(b)) => (Runner::Train { base: b.clone() }, None),
        (None, None) => return Err(at(ConfigError::invalid(
            "base",
            "is missing; give the config every trial starts from (relative to the sweep file), or a W&B command that runs your script: command: \
                [oomguard, launch, ${program}, ${args}]",
        ))),
    };
    // `base` is relative to the sweep file. The runner holds it resolved (joined to the sweep
    // file's folder), so that the `--check` pass, the planner and every trial read the file
    // this check found, whatever directory `oomguard sweep` runs in.
    let (runner, base) = match runner {
        Runner::Train { base } => {
            let resolved = path.parent().unwrap_or(Path::new(".")).join(base);
            if !resolved.is_file() {
                return Err(at(ConfigError::invalid(
                    "base",
                    format!(
                        "{} is not a file; give the config every trial starts from, relative to the sweep file",
                        resolved.display()
                    ),
                )));
            }
            (Runner::Train { base: resolved.clone() }, Some(resolved))
        }
        launch @ Runner::Launch { .. } => (launch, None),
    };
    // A W&B file's `log_uniform` takes exponents (W&B's meaning); ours takes values.
    // Why the file reads as W&B's, for a refusal that depends on the reading.
    let read_as_wandb = [
        (matches!(raw.metric, RawMetric::Wandb(_)), "`metric` is a mapping"),
        (raw.program.is_some(), "it sets `program`"),
        (raw.command.is_some(), "it sets `command`"),
        (raw.run_cap.is_some(), "it sets `run_cap`"),
        (raw.early_terminate.is_some(), "it sets `early_terminate`"),
        (
            raw.parameters.values().any(|p| p.parameters.is_some()),
            "it nests `parameters`",
        ),
    ]
    .into_iter()
    .find_map(|(w, why)| w.then_some(why));
    let wandb = read_as_wandb.is_some();
    unhonoured_wandb_keys(&raw).map_err(at)?;
    if base.is_none() {
        script_limits(&raw).map_err(at)?;
    }
    let mut leaves = Vec::new();
    flatten("", &raw.parameters, wandb, &mut leaves).map_err(at)?;
    let mut domains: Vec<(String, Domain)> = Vec::new();
    for (key, p) in leaves {
        if domains.iter().any(|(k, _)| *k == key) {
            return Err(at(ConfigError::invalid(
                &format!("parameters.{key}"),
                "is given twice (once dotted, once nested); give it once",
            )));
        }
        let d = domain(&key, p, read_as_wandb, base.is_some()).map_err(at)?;
        domains.push((key, d));
    }
    if domains.is_empty() {
        return Err(at(ConfigError::invalid(
            "parameters",
            "is empty; give at least one config key, e.g. optim.lr: {values: [1.0e-3, 3.0e-3]}",
        )));
    }
    let (metric, target) = metric(&raw.metric).map_err(at)?;
    let cap = match (raw.count, raw.run_cap) {
        (Some(_), Some(_)) => {
            return Err(at(ConfigError::invalid(
                "run_cap",
                "and count say the same thing; give one",
            )))
        }
        (Some(0), _) | (_, Some(0)) => {
            return Err(at(ConfigError::invalid(
                if raw.count.is_some() { "count" } else { "run_cap" },
                "is 0; give at least 1",
            )))
        }
        (Some(n), _) | (_, Some(n)) if n as u128 > MAX_GRID => {
            return Err(at(ConfigError::invalid(
                if raw.count.is_some() { "count" } else { "run_cap" },
                format!("is {n}: at most {MAX_GRID} trials a sweep (each is a training run)"),
            )))
        }
        (c, r) => c.or(r),
    };
    let trials = match (method, cap) {
        (Method::Grid, _) if raw.count.is_some() => {
            return Err(at(ConfigError::invalid(
                "count",
                "is for method: random, bayes or tpe (a grid runs every combination; run_cap caps it)",
            )))
        }
        (Method::Grid, cap) => {
            let mut t = grid(&domains).map_err(at)?;
            t.truncate(cap.unwrap_or(usize::MAX));
            t
        }
        (_, None) => {
            return Err(at(ConfigError::invalid(
                "count",
                "is required with method: random, bayes or tpe (W&B: run_cap): how many trials, at least 1",
            )))
        }
        (Method::Random, Some(n)) => random(&domains, n, raw.seed),
        (Method::Bayes | Method::Tpe, Some(_)) => vec![],
    };
    let count = if method == Method::Grid || method == Method::Random {
        trials.len()
    } else {
        cap.unwrap_or(0)
    };
    let duration = |key: &str, text: &Option<String>| -> Result<Option<Duration>, ConfigError> {
        text.as_deref()
            .map(|t| {
                humantime::parse_duration(t).map_err(|e| {
                    at(ConfigError::invalid(
                        key,
                        format!("`{t}` is not a duration ({e}); e.g. 90s, 30m, 2h"),
                    ))
                })
            })
            .transpose()
    };
    let (early_stop, decay_steps_set) = match &base {
        Some(base) => (
            early_stop(&raw, metric, base, &domains).map_err(at)?,
            domains.iter().any(|(k, _)| k == "optim.decay_steps") || base_has(base, "optim", "decay_steps"),
        ),
        None => (None, false),
    };
    let mut notices: Vec<String> = command_notice.into_iter().collect();
    let program = raw.program.as_ref().filter(|_| raw.command.is_none());
    if program.is_some() {
        let why = match &base {
            Some(b) => format!("each trial runs `oomguard train {}` with its parameters", b.display()),
            None => "nothing is sent to W&B".into(),
        };
        notices.push(format!("{origin}: `program` (W&B's) is ignored: {why}"));
    }
    let mut wandb_env = Vec::new();
    for (key, var, v) in [
        ("project", "WANDB_PROJECT", &raw.project),
        ("entity", "WANDB_ENTITY", &raw.entity),
    ] {
        let Some(v) = v else { continue };
        let value = match v {
            serde_yaml::Value::String(s) => s.clone(),
            _ => {
                return Err(at(ConfigError::invalid(
                    key,
                    format!("is not a string; W&B's {key} is a name"),
                )))
            }
        };
        notices.push(format!(
            "{origin}: `{key}` (W&B's) is each trial's {var}={value}: trials log there when wandb is \
             a tracker (log.trackers or OOMGUARD_TRACKERS); nothing is sent otherwise"
        ));
        wandb_env.push((var.to_string(), value));
    }
    Ok(Sweep {
        path: path.to_path_buf(),
        runner,
        method,
        trials,
        domains,
        count,
        seed: raw.seed,
        timeout: duration("trial.timeout", &raw.trial.timeout)?,
        grace: duration("trial.grace", &raw.trial.grace)?.unwrap_or(Duration::from_secs(120)),
        metric,
        target,
        // The planner reads oomguard train's config; a script's trials have none.
        planner: raw.planner && base.is_some(),
        device_memory: raw.device_memory,
        early_stop,
        decay_steps_set,
        notices,
        wandb_env,
    })
}

/// `method`: W&B's words (and `tpe`), or refused naming the nearest thing.
fn method(raw: Option<&str>) -> Result<Method, ConfigError> {
    Ok(match raw {
        None | Some("grid") => Method::Grid,
        Some("random") => Method::Random,
        Some("bayes") => Method::Bayes,
        Some("tpe") => Method::Tpe,
        Some("custom") => {
            return Err(ConfigError::invalid(
                "method",
                "is W&B's custom method (a controller of your own proposes each run); oomguard cannot honour it: \
                 give grid, random, or bayes (a TPE here)",
            ))
        }
        Some(m) => {
            return Err(ConfigError::invalid(
                "method",
                format!("`{m}` is not one of grid, random, bayes (W&B's schema) or tpe"),
            ))
        }
    })
}

/// A script's trials (`oomguard launch` in `command`) run it whole: what needs oomguard
/// train's config or checkpoints is refused, naming the nearest thing.
fn script_limits(raw: &RawSweep) -> Result<(), ConfigError> {
    let why = "a script under oomguard launch runs each trial whole (it cannot be paused at a rung and resumed, as oomguard train's trials are): \
        remove it, or run the trials as oomguard train";
    if raw.early_terminate.is_some() {
        return Err(ConfigError::invalid("early_terminate", why));
    }
    if raw.early_stop.is_some() {
        return Err(ConfigError::invalid("early_stop", why));
    }
    if let Some((k, _)) = raw.parameters.iter().find(|(_, p)| p.parameters.is_some()) {
        return Err(ConfigError::invalid(
            &format!("parameters.{k}"),
            "nests parameters, whose W&B value (a dict) oomguard does not pass to a script: give dotted names (KEY.SUBKEY), each passed as --KEY.SUBKEY=VALUE",
        ));
    }
    Ok(())
}

/// W&B's top-level keys that oomguard cannot honour: each an exit-2 error with the nearest
/// thing it does.
fn unhonoured_wandb_keys(raw: &RawSweep) -> Result<(), ConfigError> {
    let keys = [
        (
            "controller",
            raw.controller.is_some(),
            "is W&B's (its controller runs the sweep); oomguard sweep is the controller: remove it",
        ),
        (
            "scheduler",
            raw.scheduler.is_some(),
            "is W&B's custom scheduler (optuna, ax); oomguard cannot honour it: use method: bayes (a TPE) or tpe",
        ),
        (
            "metrics",
            raw.metrics.is_some(),
            "is W&B's multi-objective search; oomguard cannot honour it: give one metric: {name, goal}",
        ),
        (
            "job",
            raw.job.is_some(),
            "is W&B Launch's; oomguard cannot honour it: each trial is `oomguard train` of `base`",
        ),
        (
            "image_uri",
            raw.image_uri.is_some(),
            "is W&B Launch's; oomguard cannot honour it: run oomguard sweep inside the image (docker/)",
        ),
    ];
    match keys.iter().find(|(_, set, _)| *set) {
        Some((k, _, why)) => Err(ConfigError::invalid(k, *why)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::early_stop::hyperband_bands;
    use super::params::scalar;
    use super::*;
    use crate::domain::Scale;
    use serde_json::json;
    use serde_json::Value;

    fn values(v: &[Value]) -> Domain {
        Domain::Values {
            values: v.to_vec(),
            weights: None,
        }
    }

    /// log_uniform_values 1e-4..1e-2.
    fn log_lr() -> Domain {
        Domain::Real {
            scale: Scale::Log,
            lo: 1e-4f64.ln(),
            hi: 1e-2f64.ln(),
            q: None,
        }
    }

    #[test]
    fn corners_put_every_parameter_at_each_end_of_its_range() {
        let d = vec![
            ("optim.lr".to_string(), log_lr()),
            ("model.n_layer".to_string(), values(&[json!(2), json!(3), json!(4)])),
        ];
        let c = corners(&d, 7);
        assert_eq!(c.len(), 3);
        let lr = |t: &Trial| t.params["optim.lr"].as_f64().unwrap();
        assert!(lr(&c[1]) < 1.01e-4 && lr(&c[2]) > 0.99e-2, "{c:?}");
        assert_eq!(
            (&c[1].params["model.n_layer"], &c[2].params["model.n_layer"]),
            (&json!(2), &json!(4))
        );
    }

    #[test]
    fn grid_is_every_combination_in_order() {
        let d = vec![
            ("a.x".to_string(), values(&[json!(1), json!(2)])),
            ("b.y".to_string(), values(&[json!("p"), json!("q"), json!("r")])),
        ];
        let t = grid(&d).unwrap();
        assert_eq!(t.len(), 6);
        assert_eq!(
            t[0].params,
            BTreeMap::from([("a.x".into(), json!(1)), ("b.y".into(), json!("p"))])
        );
        assert_eq!(
            t[5].params,
            BTreeMap::from([("a.x".into(), json!(2)), ("b.y".into(), json!("r"))])
        );
        assert!(t[3].id.starts_with("003-"));
        let ids: std::collections::HashSet<_> = t.iter().map(|t| t.id.clone()).collect();
        assert_eq!(ids.len(), 6);
    }

    #[test]
    fn a_grid_too_large_is_refused_before_it_is_built() {
        let wide = vec![
            ("a.x".to_string(), Domain::Int { min: 1, max: 1000 }),
            (
                "b.y".to_string(),
                Domain::Int {
                    min: i64::MIN,
                    max: i64::MAX,
                },
            ),
        ];
        let e = grid(&wide).unwrap_err().to_string();
        assert!(e.contains("parameters.b.y") && e.contains("at most 1000000"), "{e}");
        assert_eq!(grid(&wide[..1]).unwrap().len(), 1000);
        let d = Domain::Int {
            min: i64::MIN,
            max: i64::MAX,
        };
        assert_eq!(d.ppf(0.0), json!(i64::MIN));
        assert!(d.ppf(0.75).as_i64().is_some_and(|v| v > i64::MAX / 4));
        assert!(d.cdf(&json!(0)).is_some_and(|u| (u - 0.5).abs() < 1e-9));
    }

    #[test]
    fn random_draws_are_seeded_and_in_range() {
        let d = vec![
            ("optim.lr".to_string(), log_lr()),
            ("model.n_layer".to_string(), Domain::Int { min: 1, max: 3 }),
        ];
        let (a, b) = (random(&d, 50, 7), random(&d, 50, 7));
        assert_eq!(a, b);
        assert_ne!(a, random(&d, 50, 8));
        let layers: std::collections::BTreeSet<i64> =
            a.iter().map(|t| t.params["model.n_layer"].as_i64().unwrap()).collect();
        assert_eq!(layers, [1, 2, 3].into());
        assert!(a
            .iter()
            .all(|t| (1e-4..=1e-2).contains(&t.params["optim.lr"].as_f64().unwrap())));
        // The draws (and so the trial ids) of a file written before W&B's distributions came.
        assert_eq!(a[0].params["optim.lr"], json!(0.000602087), "{:?}", a[0]);
    }

    #[test]
    fn values_pass_through_set_as_their_type() {
        assert_eq!(scalar(&json!(0.001)), "0.001");
        assert_eq!(scalar(&json!(64)), "64");
        assert_eq!(scalar(&json!("bf16")), "bf16");
        assert_eq!(scalar(&json!("10")), "'10'"); // a string that reads as a number stays a string
        assert_eq!(scalar(&json!(true)), "true");
    }

    fn load_yaml(yaml: &str) -> Result<Sweep, ConfigError> {
        let dir = std::env::temp_dir().join(format!("oomguard-spec-{}-{}", std::process::id(), yaml.len()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("base.yaml"), "train: {max_steps: 27}\n").unwrap();
        std::fs::write(dir.join("sweep.yaml"), yaml).unwrap();
        let r = load(&dir.join("sweep.yaml"));
        std::fs::remove_dir_all(&dir).unwrap();
        r
    }

    /// W&B's `project` and `entity` go to each trial as W&B's own variables, said once.
    #[test]
    fn a_wandb_project_and_entity_are_the_trials_wandb_variables() {
        let s =
            load_yaml("base: base.yaml\nproject: p1\nentity: team\nparameters:\n  optim.lr: {values: [1]}\n").unwrap();
        let want = [("WANDB_PROJECT", "p1"), ("WANDB_ENTITY", "team")].map(|(k, v)| (k.to_string(), v.to_string()));
        assert_eq!(s.wandb_env, want);
        assert!(
            s.notices
                .iter()
                .any(|n| n.contains("WANDB_PROJECT=p1") && n.contains("tracker")),
            "{:?}",
            s.notices
        );
        let e = load_yaml("base: base.yaml\nproject: [a]\nparameters:\n  optim.lr: {values: [1]}\n").unwrap_err();
        assert_eq!(e.key, "project");
    }

    /// A W&B sweep file as it is: its grid is W&B's (grid_search.py: parameters sorted by
    /// name, the last varying fastest, int_uniform every integer of [min, max], q_uniform
    /// numpy's arange(min, max, q) with max left out, a value written twice taken once).
    #[test]
    fn a_wandb_grid_is_wandbs_set_in_wandbs_order() {
        let s = load_yaml(
            "program: train.py\nmethod: grid\nmetric: {name: val_loss, goal: minimize}\nbase: base.yaml\nparameters:\n  \
             optim.lr: {values: [0.001, 0.01, 1.0e-3]}\n  model.n_layer: {distribution: int_uniform, min: 1, max: 3}\n  \
             optim.weight_decay: {distribution: q_uniform, min: 0.0, max: 0.3, q: 0.1}\n  train.seed: {value: 5}\n  model.n_head: {min: 2, max: 3}\n",
        )
        .unwrap();
        assert_eq!(s.metric, Metric::FinalEvalLoss);
        assert!(s.notices[0].contains("`program` (W&B's) is ignored"), "{:?}", s.notices);
        // W&B's order, written out: itertools.product over the sorted names.
        let mut expected = vec![];
        for n_head in [2, 3] {
            for n_layer in [1, 2, 3] {
                for lr in [0.001, 0.01] {
                    for wd in [0.0, 0.1, 0.2] {
                        expected.push(json!({"model.n_head": n_head, "model.n_layer": n_layer, "optim.lr": lr, "optim.weight_decay": wd, "train.seed": 5}));
                    }
                }
            }
        }
        let got: Vec<Value> = s
            .trials
            .iter()
            .map(|t| serde_json::to_value(&t.params).unwrap())
            .collect();
        assert_eq!(got, expected);
        assert_eq!(s.count, 36);
        // run_cap caps a grid, in its order.
        let capped =
            load_yaml("base: base.yaml\nrun_cap: 4\nparameters:\n  optim.lr: {values: [1, 2, 3, 4, 5]}\n").unwrap();
        assert_eq!(capped.trials.len(), 4);
        // A range that holds no grid value (max excluded) is refused by name, not an empty sweep.
        let e = load_yaml(
            "base: base.yaml\nparameters:\n  optim.weight_decay: {distribution: q_uniform, min: 0.1, max: 0.1, q: 0.05}\n",
        )
        .unwrap_err();
        assert!(
            format!("{e}").contains("parameters.optim.weight_decay: gives the grid no value"),
            "{e}"
        );
    }

    #[test]
    fn wandb_keys_map_or_are_refused_by_name() {
        let s = load_yaml("base: base.yaml\nmethod: bayes\nrun_cap: 20\nmetric: {name: loss}\nearly_terminate: {type: hyperband, min_iter: 3}\n\
            parameters:\n  optim.lr: {distribution: log_uniform_values, min: 1.0e-4, max: 1.0e-2}\n").unwrap();
        assert_eq!((s.method, s.count, s.metric), (Method::Bayes, 20, Metric::FinalLoss));
        assert_eq!(
            s.early_stop,
            Some(EarlyStop {
                metric: RungMetric::Loss,
                min_steps: 3,
                eta: 3,
                max_steps: 27,
                max_iter: None,
            })
        );
        // W&B's log_uniform (exponents) is deprecated: W&B's schema refuses it, in its words.
        let e = load_yaml("base: base.yaml\nmethod: random\nrun_cap: 50\nprogram: x.py\nparameters:\n  optim.lr: {distribution: log_uniform, min: \
            -9.2, max: -4.6}\n").unwrap_err();
        assert!(format!("{e}").contains("optim.lr uses log_uniform, where min/max specify base-e exponents. Use log_uniform_values to specify limit \
            values."), "{e}");
        assert!(
            format!("{e}").contains(
                "read as a W&B sweep file (it sets `program`); in oomguard's own format, log_uniform takes the values \
            themselves"
            ),
            "{e}"
        );
        for (yaml, key) in [
            ("metric: {name: accuracy, goal: maximize}\n", "accuracy"),
            ("metric: {name: val_loss, goal: maximize}\n", "metric.goal"),
            ("metric: {name: val_loss, target: .nan}\n", "metric.target"),
            ("metric: {name: val_loss, impute: best}\n", "metric.impute"),
            (
                "early_terminate: {type: hyperband, max_iter: 27}\n",
                "early_terminate.s",
            ),
            (
                "early_terminate: {type: hyperband, max_iter: 2, s: 2}\n",
                "Bands must be",
            ),
            (
                "early_terminate: {type: hyperband, max_iter: 2700, s: 1}\n",
                "no rung below max_steps 27",
            ),
            (
                "early_terminate: {type: hyperband, min_iter: 3, strict: false}\n",
                "early_terminate.strict",
            ),
            (
                "early_terminate: {type: hyperband, min_iter: 3, eta: 2.5}\n",
                "whole eta",
            ),
            (
                "early_terminate: {type: hyperband, min_iter: 0}\n",
                "W&B's schema wants 1 or more",
            ),
            ("early_terminate: {type: hyperband, min_iter: 3, eta: 1}\n", "above 1"),
            ("early_terminate: {type: envelope}\n", "early_terminate.type"),
            ("scheduler: {engine: optuna}\n", "scheduler"),
            ("method: custom\n", "W&B's custom method"),
            ("method: annealing\n", "`annealing` is not one of grid, random, bayes"),
            (
                "command: [python, train.py, '${args}']\n",
                "neither `oomguard train` nor `oomguard launch`",
            ),
            (
                "command: [oomguard, train, base.yaml, --fast, '${args}']\n",
                "passes `--fast`",
            ),
            ("command: [oomguard, train, '${args_foo}']\n", "not one of W&B's macros"),
            ("command: [oomguard, train]\n", "passes no parameters"),
            (
                "command: ['${env}', '${interpreter}', '${program}', '${args}']\nprogram: train.py\n",
                "runs `train.py ${args}`, which is neither",
            ),
            (
                "run_cap: 2\nparameters:\n  optim.lr: {min: 0.1, max: 0.1}\n",
                "min 0.1 is not less than max 0.1",
            ),
            (
                "run_cap: 2\nparameters:\n  model.n_layer: {distribution: int_uniform, min: 1.0, max: 3}\n",
                "integer min and max",
            ),
            (
                "run_cap: 2\nparameters:\n  optim.lr: {values: [1, 2], probabilities: [0.5, 0.4]}\n",
                "do not sum to 1",
            ),
            (
                "run_cap: 2\nparameters:\n  1optim: {parameters: {lr: {value: 1}}}\n",
                "does not match",
            ),
            (
                "parameters:\n  optim: {values: [1], parameters: {lr: {value: 1}}}\n",
                "a nested parameter takes `parameters` only",
            ),
            (
                "parameters:\n  optim: {parameters: {lr: {value: 1}}}\n  optim.lr: {value: 2}\n",
                "given twice",
            ),
            ("controller: {type: local}\n", "controller"),
            ("parameters:\n  optim.lr: {distribution: beta, a: 1, b: 2}\n", "a"),
            (
                "parameters:\n  optim.lr: {distribution: inv_log_uniform_values, min: 1, max: 2}\n",
                "inv_log_uniform_values",
            ),
            (
                "parameters:\n  model.n_layer: {distribution: int_uniform, min: 1.2, max: 1.8}\n",
                "no integer",
            ),
            (
                "method: random\nparameters:\n  optim.lr: {distribution: uniform, min: 0.1, max: 0.2}\n",
                "count",
            ),
            (
                "parameters:\n  optim.lr: {distribution: uniform, min: 0.1, max: 0.2}\n",
                "a grid takes",
            ),
            (
                "method: random\ncount: 200000000000000000\nparameters:\n  optim.lr: {min: 0.1, max: 0.2}\n",
                "at most 1000000 trials",
            ),
            (
                "method: bayes\nrun_cap: 20000000\nparameters:\n  optim.lr: {min: 0.1, max: 0.2}\n",
                "run_cap",
            ),
        ] {
            let text = if yaml.contains("parameters") {
                format!("base: base.yaml\n{yaml}")
            } else {
                format!("base: base.yaml\n{yaml}parameters:\n  optim.lr: {{values: [1]}}\n")
            };
            let e = load_yaml(&text).unwrap_err();
            assert!(format!("{e}").contains(key), "{yaml}: {e}");
        }
    }

    /// W&B's second hyperband form, metric.target, nested parameters and command, as W&B
    /// defines them (hyperband_stopping.py's bands; params.py's nesting order).
    #[test]
    fn wandb_hyperband_max_iter_target_nesting_and_command() {
        assert_eq!(hyperband_bands(27, 2, 3), [3, 9]);
        assert_eq!(hyperband_bands(100, 3, 3), [3, 11, 33]);
        assert_eq!(hyperband_bands(5, 2, 2), [1, 2]);
        assert_eq!(hyperband_bands(2, 2, 3), Vec::<u64>::new());
        let s = load_yaml(
            "base: base.yaml\nmethod: grid\nmetric: {name: val_loss, goal: minimize, target: 4.5}\n\
             early_terminate: {type: hyperband, max_iter: 27, s: 2}\n\
             command: ['${env}', oomguard, train, '${args_no_hyphens}']\n\
             parameters:\n  optim:\n    parameters:\n      lr: {values: [0.001, 0.01]}\n      beta1: {value: 0.9}\n\
             \x20 model: {parameters: {n_layer: {values: [1, 2]}}}\n",
        )
        .unwrap();
        let es = s.early_stop.unwrap();
        assert_eq!(
            (es.rungs(), es.min_steps, es.max_iter),
            (vec![3, 9, 27], 3, Some((27, 2)))
        );
        assert_eq!(s.target, Some(4.5));
        assert!(
            s.notices[0].contains("`command` (W&B's) is read as `oomguard train base.yaml --set"),
            "{:?}",
            s.notices
        );
        // Nested keys are dotted config keys, in W&B's order (each level sorted).
        let keys: Vec<&str> = s.domains.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["model.n_layer", "optim.beta1", "optim.lr"]);
        assert_eq!(s.trials.len(), 4);
        assert_eq!(
            s.trials[1].overrides(),
            [
                "--set",
                "model.n_layer=1",
                "--set",
                "optim.beta1=0.9",
                "--set",
                "optim.lr=0.01"
            ]
        );
        // max_iter above the trials' steps: its bands below max_steps are the rungs.
        let s = load_yaml("base: base.yaml\nearly_terminate: {type: hyperband, max_iter: 81, s: 3, eta: 3}\nparameters:\n  optim.lr: {values: [1]}\n").unwrap();
        assert_eq!(s.early_stop.unwrap().rungs(), [3, 9, 27]);
        // `program` with a command that runs it through oomguard train is honoured too.
        let s = load_yaml("base: base.yaml\nprogram: oomguard train\ncommand: ['${program}', base.yaml, '${args_json_file}']\nparameters:\n  optim.lr: \
            {values: [1]}\n").unwrap();
        assert_eq!(s.notices.len(), 1, "{:?}", s.notices);
    }

    /// A W&B file whose command runs a script through oomguard launch: no base, parameters
    /// as the script's arguments, and what needs oomguard train refused by key.
    #[test]
    fn a_script_under_launch_is_a_runner_of_its_own() {
        let file = "method: grid\nprogram: train.py\nmetric: {name: val_loss, goal: minimize}\ncommand: ['${env}', '${interpreter}', oomguard, launch, \
            --nproc-per-node, 2, '${program}', '${args}']\nparameters:\n  lr: {values: [0.1, 0.2]}\n  hidden: {value: 8}\n";
        let s = load_yaml(file).unwrap();
        let words: Vec<String> = ["--nproc-per-node", "2", "train.py", "${args}"]
            .map(String::from)
            .to_vec();
        let script = Some(PathBuf::from("train.py"));
        assert_eq!(s.runner, Runner::Launch { words, script });
        assert_eq!((s.trials.len(), s.planner, s.notices.len()), (2, false, 1));
        for (extra, key) in [
            ("early_terminate: {type: hyperband, min_iter: 3}\n", "early_terminate"),
            ("early_stop: {type: asha, min_steps: 3}\n", "early_stop"),
            ("base: base.yaml\n", "base"),
        ] {
            let e = load_yaml(&format!("{file}{extra}")).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
        let nested = file.replace("  hidden: {value: 8}", "  opt: {parameters: {lr: {value: 1}}}");
        let e = load_yaml(&nested).unwrap_err();
        assert!(
            e.key == "parameters.opt" && format!("{e}").contains("--KEY.SUBKEY=VALUE"),
            "{e}"
        );
        let e = load_yaml("method: grid\nparameters:\n  lr: {value: 1}\n").unwrap_err();
        assert!(e.key == "base" && e.message.contains("is missing"), "{e}");
    }

    /// The sweep files the repository ships load as the README says.
    #[test]
    fn shipped_sweep_files_load() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let w = load(&root.join("examples/sweep/wandb-sweep.yaml")).unwrap();
        assert_eq!(
            (w.method, w.count, w.metric),
            (Method::Bayes, 12, Metric::FinalEvalLoss)
        );
        assert_eq!(w.early_stop.unwrap().rungs(), [10, 30, 90, 150]);
        assert!(!w.decay_steps_set && w.notices.len() == 1);
        // `base` is resolved against the sweep file's folder: what each trial is given.
        let demo = root.join("configs/demo.yaml");
        let wandb_base = root.join("examples/sweep/../../configs/demo.yaml");
        assert_eq!(w.runner, Runner::Train { base: wandb_base });
        let d = load(&root.join("configs/demo-sweep.yaml")).unwrap();
        assert_eq!(d.trials.len(), 4);
        assert_eq!(d.runner, Runner::Train { base: demo });
    }
}
