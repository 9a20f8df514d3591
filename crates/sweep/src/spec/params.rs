//! Owns parameters: each key's domain and the trials they expand to (a grid, or seeded draws).
//! Keeps: a trial's id is its index and a hash of its parameters.
use oomguard_console::ConfigError;
use serde_json::Value;
use std::collections::BTreeMap;

use super::RawParam;
use crate::domain::{same, Domain, Quantum, Scale, SplitMix};

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
        self.params
            .iter()
            .flat_map(|(k, v)| ["--set".to_string(), format!("{k}={}", scalar(v))])
            .collect()
    }
    /// `key=value key=value`, for logs and tables.
    pub fn describe(&self) -> String {
        self.params
            .iter()
            .map(|(k, v)| format!("{k}={}", scalar(v)))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// A value as `--set` parses it (YAML scalar syntax; strings that read as another type quoted).
pub fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => serde_yaml::to_string(s)
            .map(|t| t.trim_end().to_string())
            .unwrap_or_else(|_| s.clone()),
        other => other.to_string(),
    }
}

/// W&B's parameter names (its schema's propertyNames pattern `^[A-Za-z_][A-Za-z0-9_.-]*$`).
pub(super) fn wandb_name(name: &str) -> bool {
    let mut c = name.chars();
    c.next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || "_.-".contains(x))
}

/// The parameters' leaves in W&B's order (each level's names sorted, a nested one's keys
/// in its place), each under its dotted path: `optim: {parameters: {lr: ...}}` is `optim.lr`.
pub(super) fn flatten<'a>(
    prefix: &str,
    params: &'a BTreeMap<String, RawParam>,
    wandb: bool,
    out: &mut Vec<(String, &'a RawParam)>,
) -> Result<(), ConfigError> {
    for (name, p) in params {
        let path = format!("{prefix}{name}");
        if wandb && !wandb_name(name) {
            return Err(ConfigError::invalid(
                &format!("parameters.{path}"),
                format!("'{name}' does not match '^[A-Za-z_][A-Za-z0-9_.-]*$' (W&B's schema); name the config key, e.g. optim.lr"),
            ));
        }
        match &p.parameters {
            None => out.push((path, p)),
            Some(nested) => {
                let alone = p.value.is_none()
                    && p.values.is_none()
                    && p.distribution.is_none()
                    && p.min.is_none()
                    && p.max.is_none()
                    && p.q.is_none()
                    && p.mu.is_none()
                    && p.sigma.is_none()
                    && p.probabilities.is_none();
                if !alone {
                    return Err(ConfigError::invalid(
                        &format!("parameters.{path}"),
                        "holds nested `parameters` and a distribution of its own; a nested \
                        parameter takes `parameters` only (W&B's schema: not valid under any of the given schemas)",
                    ));
                }
                if nested.is_empty() {
                    return Err(ConfigError::invalid(
                        &format!("parameters.{path}.parameters"),
                        "is empty; W&B's schema wants at least one (minProperties 1)",
                    ));
                }
                flatten(&format!("{path}."), nested, wandb, out)?;
            }
        }
    }
    Ok(())
}

/// One parameter's domain, by W&B's rules where W&B defines the key: `value` constant,
/// `values` categorical, `min`/`max` int_uniform when both are integers else uniform.
/// `read_as_wandb`: why the file is read as a W&B sweep file, if it is. `config_key`: the
/// key names an `oomguard train` config key (section.key), not a script's argument.
pub(super) fn domain(
    key: &str,
    p: &RawParam,
    read_as_wandb: Option<&str>,
    config_key: bool,
) -> Result<Domain, ConfigError> {
    let wandb = read_as_wandb.is_some();
    let k = format!("parameters.{key}");
    if config_key && (key.split('.').count() < 2 || key.split('.').any(str::is_empty)) {
        return Err(ConfigError::invalid(
            &k,
            "is not a config key path; use section.key, e.g. optim.lr or model.n_embd",
        ));
    }
    let json = |v: &serde_yaml::Value| -> Result<Value, ConfigError> {
        match v {
            serde_yaml::Value::Bool(_) | serde_yaml::Value::Number(_) | serde_yaml::Value::String(_) => {
                serde_json::to_value(v).map_err(|e| ConfigError::invalid(&k, e.to_string()))
            }
            serde_yaml::Value::Mapping(_) => Err(ConfigError::invalid(
                &k,
                "a value that is a mapping cannot be set as one config key; give each key \
                its own parameter (optim.lr), or nest them under `parameters:` as W&B does",
            )),
            _ => Err(ConfigError::invalid(&k, "values must be numbers, strings or booleans")),
        }
    };
    let num = |name: &str, v: &Option<serde_yaml::Value>| -> Result<Option<(f64, bool)>, ConfigError> {
        match v {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some((x, v.as_i64().is_some()))),
                _ => Err(ConfigError::invalid(&format!("{k}.{name}"), "must be a number")),
            },
        }
    };
    let (min, max, q) = (num("min", &p.min)?, num("max", &p.max)?, num("q", &p.q)?);
    let dist = match (&p.distribution, &p.value, &p.values, min, max) {
        (Some(d), ..) => d.as_str(),
        (None, Some(_), None, None, None) => "constant",
        (None, None, Some(_), None, None) => "categorical",
        (None, None, None, Some((_, true)), Some((_, true))) => "int_uniform",
        (None, None, None, Some(_), Some(_)) => "uniform",
        (None, None, None, None, None) if p.mu.is_some() || p.sigma.is_some() => "normal",
        _ => {
            return Err(ConfigError::invalid(
                &k,
                "give exactly one of value, values, or a distribution (min and max; or mu and sigma)",
            ))
        }
    };
    let unused = |allowed: &[&str]| -> Result<(), ConfigError> {
        let given = [
            ("value", p.value.is_some()),
            ("values", p.values.is_some()),
            ("min", min.is_some()),
            ("max", max.is_some()),
            ("q", q.is_some()),
            ("mu", p.mu.is_some()),
            ("sigma", p.sigma.is_some()),
            ("probabilities", p.probabilities.is_some()),
        ];
        match given.iter().find(|(n, set)| *set && !allowed.contains(n)) {
            Some((n, _)) => Err(ConfigError::invalid(
                &format!("{k}.{n}"),
                format!(
                    "does not go with distribution {dist} (it takes {})",
                    if allowed.is_empty() {
                        "nothing more".into()
                    } else {
                        allowed.join(", ")
                    }
                ),
            )),
            None => Ok(()),
        }
    };
    let bounds = |log: bool| -> Result<(f64, f64), ConfigError> {
        let (Some((lo, _)), Some((hi, _))) = (min, max) else {
            return Err(ConfigError::invalid(
                &k,
                format!("distribution {dist} needs min and max"),
            ));
        };
        if wandb && lo >= hi {
            return Err(ConfigError::invalid(
                &k,
                format!(
                    "{key}: min {lo} is not less than max {hi} (W&B's schema); give min < max, or value: for one value"
                ),
            ));
        }
        if lo > hi {
            return Err(ConfigError::invalid(
                &k,
                format!("min {lo} is above max {hi}; give min <= max"),
            ));
        }
        if log && lo <= 0.0 {
            return Err(ConfigError::invalid(
                &format!("{k}.min"),
                format!("is {lo}; {dist} takes values above 0"),
            ));
        }
        Ok(if log { (lo.ln(), hi.ln()) } else { (lo, hi) })
    };
    // W&B's q defaults to 1 (integers).
    let quantum = || -> Result<Option<Quantum>, ConfigError> {
        let (q, int) = q.unwrap_or((1.0, true));
        if q <= 0.0 {
            return Err(ConfigError::invalid(
                &format!("{k}.q"),
                format!("is {q}; give a step above 0"),
            ));
        }
        Ok(Some(Quantum { q, int }))
    };
    let normal = |scale: Scale, quantized: bool| -> Result<Domain, ConfigError> {
        unused(if quantized {
            &["mu", "sigma", "q"]
        } else {
            &["mu", "sigma"]
        })?;
        let (mu, sigma) = (p.mu.unwrap_or(0.0), p.sigma.unwrap_or(1.0));
        if !(sigma > 0.0 && sigma.is_finite() && mu.is_finite()) {
            return Err(ConfigError::invalid(
                &format!("{k}.sigma"),
                format!("is {sigma}; give a spread above 0"),
            ));
        }
        Ok(Domain::Normal {
            scale,
            mu,
            sigma,
            q: if quantized { quantum()? } else { None },
        })
    };
    let real = |scale: Scale, log_bounds: bool, quantized: bool| -> Result<Domain, ConfigError> {
        unused(if quantized {
            &["min", "max", "q"]
        } else {
            &["min", "max"]
        })?;
        let (lo, hi) = bounds(log_bounds)?;
        Ok(Domain::Real {
            scale,
            lo,
            hi,
            q: if quantized { quantum()? } else { None },
        })
    };
    match dist {
        "constant" => {
            unused(&["value"])?;
            let v = p.value.as_ref().ok_or_else(|| ConfigError::invalid(&k, "distribution constant needs value"))?;
            Ok(Domain::Values { values: vec![json(v)?], weights: None })
        }
        "categorical" => {
            unused(&["values", "probabilities"])?;
            let vs = p.values.as_ref().ok_or_else(|| ConfigError::invalid(&k, "distribution categorical needs values"))?;
            if vs.is_empty() {
                return Err(ConfigError::invalid(&k, "values is empty; give at least one"));
            }
            let mut values: Vec<Value> = vec![];
            for v in vs {
                let v = json(v)?;
                // W&B's grid takes each value once (3000000.0 is 3000000).
                if !values.iter().any(|x| same(x, &v)) {
                    values.push(v);
                }
            }
            let bad = |why: String| Err(ConfigError::invalid(&format!("{k}.probabilities"), why));
            let sum = |w: &[f64]| w.iter().sum::<f64>();
            let weights = match &p.probabilities {
                None => None,
                Some(w) if wandb && w.len() != vs.len() => {
                    let (n, m) = (vs.len(), w.len());
                    return bad(format!(
                        "Parameter {key}: values and probabilities are not the same length ({n} and {m}; W&B's schema)"
                    ));
                }
                Some(w) if wandb && (sum(w) - 1.0).abs() > 1e-8 + 1e-5 => {
                    return bad(format!("Parameter {key}: Probabilities {w:?} do not sum to 1 (W&B's schema)"));
                }
                Some(w)
                    if w.len() == vs.len()
                        && values.len() == vs.len()
                        && w.iter().all(|x| *x >= 0.0)
                        && (sum(w) - 1.0).abs() < 1e-6 =>
                {
                    Some(w.clone())
                }
                Some(_) => return bad("give one probability of 0 or more per distinct value, summing to 1".into()),
            };
            Ok(Domain::Values { values, weights })
        }
        "int_uniform" => {
            unused(&["min", "max"])?;
            if wandb && !(min.is_some_and(|m| m.1) && max.is_some_and(|m| m.1)) {
                return Err(ConfigError::invalid(&k, "int_uniform takes integer min and max (W&B's schema: not valid under any of the given schemas); \
                    write them as integers, or use uniform"));
            }
            let (lo, hi) = bounds(false)?;
            let (lo, hi) = (lo.ceil(), hi.floor());
            if lo > hi {
                return Err(ConfigError::invalid(&k, format!("int_uniform has no integer in [min, max] = [{}, {}]; widen it to hold \
                    one", min.unwrap_or_default().0, max.unwrap_or_default().0)));
            }
            Ok(Domain::Int { min: lo as i64, max: hi as i64 })
        }
        "uniform" => real(Scale::Linear, false, false),
        "q_uniform" => real(Scale::Linear, false, true),
        "log_uniform_values" => real(Scale::Log, true, false),
        "q_log_uniform_values" => real(Scale::Log, true, true),
        // W&B's log_uniform (exponents as bounds) is deprecated: its schema refuses it, and so
        // does a W&B file here, with its words. Ours takes values.
        "log_uniform" | "q_log_uniform" | "inv_log_uniform" if wandb => Err(ConfigError::invalid(
            &format!("{k}.distribution"),
            format!(
                "{key} uses {dist}, where min/max specify base-e exponents. Use {dist}_values to specify limit values. \
                 (W&B's schema){}. This file is read as a W&B sweep file ({}); in oomguard's own format, log_uniform \
                 takes the values themselves",
                if dist == "inv_log_uniform" {
                    "; oomguard has no inv_log_uniform_values either: use log_uniform_values"
                } else {
                    ""
                },
                read_as_wandb.unwrap_or_default()
            ),
        )),
        "log_uniform" => real(Scale::Log, true, false),
        "normal" => normal(Scale::Linear, false),
        "q_normal" => normal(Scale::Linear, true),
        "log_normal" => normal(Scale::Log, false),
        "q_log_normal" => normal(Scale::Log, true),
        other => Err(ConfigError::invalid(
            &format!("{k}.distribution"),
            format!("`{other}` is not supported; use constant, categorical, int_uniform, uniform, q_uniform, log_uniform_values, q_log_uniform_values, \
                normal, q_normal, log_normal or q_log_normal"),
        )),
    }
}

/// FNV-1a (32 bits) of `text`: stable across versions and machines.
pub fn fnv1a(text: &str) -> u32 {
    text.bytes()
        .fold(0x811c9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x01000193))
}

pub(super) fn trial(index: usize, params: BTreeMap<String, Value>) -> Trial {
    // Over the parameters' JSON.
    let hash = fnv1a(&serde_json::to_string(&params).unwrap_or_default());
    Trial {
        index,
        id: format!("{index:03}-{hash:08x}"),
        params,
    }
}

/// A trial of the given parameters at `index` (model-based search's proposals).
pub fn trial_of(index: usize, params: BTreeMap<String, Value>) -> Trial {
    trial(index, params)
}

/// The most trials a grid may have: past it a typo (`q: 0.0001`) would fill the memory.
pub const MAX_GRID: u128 = 1_000_000;

/// Every combination in W&B's order (grid_search.py: keys sorted, the last varying fastest,
/// each distinct combination once).
pub fn grid(domains: &[(String, Domain)]) -> Result<Vec<Trial>, ConfigError> {
    let mut combos: Vec<BTreeMap<String, Value>> = vec![BTreeMap::new()];
    let mut size: u128 = 1;
    for (key, d) in domains {
        let at = format!("parameters.{key}");
        let n = d.grid_len().ok_or_else(|| {
            ConfigError::invalid(
                &at,
                "a grid takes value, values (without probabilities), int_uniform or q_uniform; other \
                distributions need method: random, bayes or tpe",
            )
        })?;
        if n == 0 {
            return Err(ConfigError::invalid(
                &at,
                "gives the grid no value (q_uniform's range takes numpy's arange(min, max, q): max excluded, so min \
                 equal to max holds none); widen the range, or give it as value: X",
            ));
        }
        size = size.saturating_mul(n);
        if size > MAX_GRID {
            return Err(ConfigError::invalid(
                &at,
                format!(
                    "the grid reaches {size} trials here (at most {MAX_GRID}): \
                narrow this range or coarsen its q, or use method: random, bayes or tpe"
                ),
            ));
        }
        let values = d.grid_values().unwrap_or_default();
        combos = combos
            .into_iter()
            .flat_map(|c| {
                values.iter().map(move |v| {
                    let mut c = c.clone();
                    c.insert(key.clone(), v.clone());
                    c
                })
            })
            .collect();
    }
    Ok(combos.into_iter().enumerate().map(|(i, p)| trial(i, p)).collect())
}

/// `count` draws from a generator seeded by `seed` (the same file always gives the same trials).
/// What a model-based search can propose, checked before it runs: a random draw, and every
/// parameter at the low end of its range, then at the high end (a constraint between keys,
/// such as `optim.min_lr` <= `optim.lr`, fails at a corner where one draw may pass).
pub fn corners(domains: &[(String, Domain)], seed: u64) -> Vec<Trial> {
    let at = |i: usize, u: f64| trial(i, domains.iter().map(|(k, d)| (k.clone(), d.ppf(u))).collect());
    let mut out = random(domains, 1, seed);
    out.extend([at(1, 1e-3), at(2, 1.0 - 1e-3)]); // 3 sigmas for a normal
    out
}

pub fn random(domains: &[(String, Domain)], count: usize, seed: u64) -> Vec<Trial> {
    let mut rng = SplitMix(seed);
    (0..count)
        .map(|i| {
            let params = domains.iter().map(|(k, d)| (k.clone(), d.ppf(rng.unit()))).collect();
            trial(i, params)
        })
        .collect()
}
