//! Owns configuration: `RawConfig` is what the YAML says, `Config` the validated one.
//! Keeps: unknown keys are refused, and nothing runs before every section's checks pass.
pub mod resume;

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub use crate::error::ConfigError;

use crate::checkpoint::CheckpointConfig;
use crate::data::DataConfig;
use crate::memory::MemoryConfig;
use crate::metrics::LogConfig;
use crate::model::{ModelConfig, ModelKind};
use crate::optim::OptimConfig;
use crate::train::TrainConfig;

/// A config file exactly as written: every section optional, every key known.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    pub model: ModelConfig,
    pub data: DataConfig,
    pub optim: OptimConfig,
    pub train: TrainConfig,
    pub memory: MemoryConfig,
    pub checkpoint: CheckpointConfig,
    pub log: LogConfig,
}

/// The validated configuration of a run.
#[derive(Debug, Clone)]
pub struct Config {
    pub raw: RawConfig,
    /// The file it came from (relative data paths are resolved against its folder).
    pub path: PathBuf,
}

/// A config error raised past loading (a model's or a data file's check, which knows the key
/// but not the file) names `path`, the config it came from.
pub fn in_file<T>(r: anyhow::Result<T>, path: Option<&Path>) -> anyhow::Result<T> {
    r.map_err(|mut e| {
        if let (Some(crate::Error::Config(c)), Some(p)) = (e.downcast_mut::<crate::Error>(), path) {
            // A flag's error (`--inject-oom`) is not the file's.
            if c.origin.is_empty() && !c.key.starts_with('-') {
                c.origin = p.display().to_string();
            }
        }
        e
    })
}

/// Reads, overrides (`key.path=value`) and validates a config file.
pub fn load(path: &Path, overrides: &[String]) -> Result<Config, ConfigError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        origin: origin.clone(),
        line_col: None,
        key: String::new(),
        message: format!("cannot read the config file: {e}"),
    })?;
    // The file alone first, from its text, so that its errors point at its lines.
    if !text.trim().is_empty() {
        let _: RawConfig = serde_yaml::from_str(&text).map_err(|e| yaml_error(&origin, e))?;
    }
    let mut value: serde_yaml::Value = serde_yaml::from_str(&text).map_err(|e| yaml_error(&origin, e))?;
    if value.is_null() {
        value = serde_yaml::Value::Mapping(Default::default());
    }
    for o in overrides {
        let set_origin = format!("--set {o}");
        apply_override(&mut value, o).map_err(|m| ConfigError {
            origin: set_origin.clone(),
            line_col: None,
            key: String::new(),
            message: m,
        })?;
        let _: RawConfig = serde_yaml::from_value(value.clone()).map_err(|e| {
            let err = yaml_error(&set_origin, e);
            // from_value does not track paths; the override names its own key.
            let key = if err.key.is_empty() {
                o.split('=').next().unwrap_or_default().to_string()
            } else {
                err.key
            };
            ConfigError { key, ..err }
        })?;
    }
    let raw: RawConfig = serde_yaml::from_value(value).map_err(|e| yaml_error(&origin, e))?;
    raw.validate().map_err(|e| {
        // The line of the key, unless a --set gave the value: then that --set (the last).
        let set = overrides
            .iter()
            .rev()
            .find(|o| o.split('=').next().map(str::trim) == Some(e.key.as_str()));
        match set {
            Some(o) => ConfigError {
                origin: format!("--set {o}"),
                line_col: None,
                ..e
            },
            None => {
                let line_col = e.line_col.or_else(|| locate(&text, &e.key));
                ConfigError { origin, line_col, ..e }
            }
        }
    })?;
    Ok(Config {
        raw,
        path: path.to_path_buf(),
    })
}

/// Where `key` (`model.loss`) is written in a config file, best effort: block mappings by
/// their indentation, and a flow mapping (`model: {loss: x}`) on its line. None when the
/// key is not written there (a default that fails with another key).
fn locate(text: &str, key: &str) -> Option<(usize, usize)> {
    let parts: Vec<&str> = key.split('.').collect();
    // The indentation of each matched section, and of its children once seen.
    let mut sections: Vec<(usize, Option<usize>)> = vec![];
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let indent = line.len() - trimmed.len();
        while sections.last().is_some_and(|&(d, _)| indent <= d) {
            sections.pop();
        }
        if let Some((_, child)) = sections.last_mut() {
            if *child.get_or_insert(indent) != indent {
                continue; // deeper than the section's own keys
            }
        } else if indent != 0 {
            continue;
        }
        let depth = sections.len();
        let Some(rest) = parts
            .get(depth)
            .and_then(|want| trimmed.strip_prefix(&format!("{want}:")))
        else {
            continue;
        };
        if depth + 1 == parts.len() {
            return Some((i + 1, indent + 1));
        }
        if rest.trim_start().starts_with('{') {
            // A flow mapping: the key's column on this line, if it is there.
            let leaf = format!("{}:", parts[parts.len() - 1]);
            return rest.find(&leaf).map(|c| (i + 1, line.len() - rest.len() + c + 1));
        }
        sections.push((indent, None));
    }
    None
}

impl Config {
    /// The config file's folder: relative paths in it (data, model files) start there.
    /// A bare file name's folder is `.` (its parent is the empty path, which
    /// `std::path::absolute` refuses: the stored paths stayed relative).
    pub fn base_dir(&self) -> PathBuf {
        self.path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    }

    /// The config as it takes effect, every default written out (the run's config.yaml).
    pub fn resolved(&self) -> RawConfig {
        RawConfig {
            model: self.raw.model.resolved(),
            ..self.raw.clone()
        }
    }

    /// What a run directory stores (`RUN_DIR/config.yaml`): the resolved config, with file
    /// paths made absolute so that a resume from the run directory alone finds them.
    pub fn stored(&self) -> RawConfig {
        self.resolved().with_paths_from(&self.base_dir())
    }

    /// When the run evaluates and checkpoints (the loop and its ETA ask the same).
    pub fn schedule(&self) -> oomguard_console::progress::Schedule {
        let r = &self.raw;
        oomguard_console::progress::Schedule {
            max_steps: r.train.max_steps,
            eval_every: r.train.eval_every,
            checkpoint_every: r.checkpoint.every_steps,
        }
    }

    /// Checks that the data files exist (training needs them; planning does not).
    pub fn check_data_files(&self) -> Result<(), ConfigError> {
        self.raw.data.check_files(&self.base_dir()).map_err(|e| ConfigError {
            origin: self.path.display().to_string(),
            ..e
        })
    }
}

impl RawConfig {
    /// The config with its relative file paths (data, model files) made absolute from `base`.
    pub fn with_paths_from(&self, base: &Path) -> RawConfig {
        let mut raw = self.clone();
        let base = std::path::absolute(base).unwrap_or_else(|_| base.to_path_buf());
        for p in [&mut raw.data.path, &mut raw.model.path, &mut raw.model.init_from] {
            if let Some(p) = p.as_mut().filter(|p| p.is_relative()) {
                *p = base.join(&*p);
            }
        }
        raw
    }

    /// Checks that span sections, then each section's own.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_floats()?;
        self.model.validate()?;
        self.data.validate()?;
        self.optim.validate()?;
        self.train.validate()?;
        self.memory.validate()?;
        self.checkpoint.validate()?;
        self.log.validate()?;
        let gpt = self.model.kind == ModelKind::Gpt;
        if gpt && self.data.source == crate::data::DataSource::Text && self.model.gpt().vocab_size < 256 {
            return Err(ConfigError::invalid(
                "model.vocab_size",
                format!(
                    "is {} but byte-level text needs 256; set model.vocab_size: 256",
                    self.model.gpt().vocab_size
                ),
            ));
        }
        if self.data.source == crate::data::DataSource::Python && self.model.kind != ModelKind::Python {
            return Err(ConfigError::invalid(
                "data.source",
                "is python, which serves Python models only: set model.kind: python, or pick embedded, text, tokens or tensors",
            ));
        }
        let own_shape = matches!(self.model.kind, ModelKind::Torchscript | ModelKind::Python);
        if own_shape && self.data.is_tokens() && self.model.block_size.is_none() {
            return Err(ConfigError::invalid(
                "model.block_size",
                format!("is required: data.source {} cuts a token stream into samples of model.block_size tokens for the model", self.data.source.name()),
            ));
        }
        Ok(())
    }
}

impl RawConfig {
    /// Every float key reaches libtorch as a 32-bit float (a tensor's scalar, AdamW's and the
    /// scaler's factors): a value that overflows it (1e+308) or that rounds to 0 (1e-60)
    /// would die later with exit 1 (`value cannot be converted to type float without
    /// overflow`), so it is an exit-2 error now, naming the key. Found by walking the
    /// serialized config: a float key added later is covered.
    fn check_floats(&self) -> Result<(), ConfigError> {
        let value = serde_json::to_value(self).map_err(|e| ConfigError::invalid("", e.to_string()))?;
        let mut floats = vec![];
        float_keys(&value, String::new(), &mut floats);
        for (key, v) in floats {
            let single = v as f32;
            if !v.is_finite() || single.is_infinite() {
                return Err(ConfigError::invalid(
                    &key,
                    format!(
                        "is {v:e}; libtorch holds it as a 32-bit float, at most {:e} in size",
                        f32::MAX
                    ),
                ));
            }
            if v != 0.0 && single == 0.0 {
                return Err(ConfigError::invalid(
                    &key,
                    format!(
                        "is {v:e}; as a 32-bit float (libtorch's) it is 0; give 0 or at least {:e}",
                        f32::from_bits(1)
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The float leaves of a serialized config, by key path (`optim.grad_clip`, `memory.pressure[0].x`).
fn float_keys(v: &serde_json::Value, path: String, out: &mut Vec<(String, f64)>) {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => out.push((path, n.as_f64().unwrap_or(f64::NAN))),
        serde_json::Value::Object(m) => m.iter().for_each(|(k, v)| {
            float_keys(
                v,
                if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                },
                out,
            )
        }),
        serde_json::Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, v)| float_keys(v, format!("{path}[{i}]"), out)),
        _ => {}
    }
}

fn yaml_error(origin: &str, e: serde_yaml::Error) -> ConfigError {
    ConfigError::from_yaml(origin, e)
}

/// Sets `a.b.c` to `value`, parsed as a YAML scalar (`10` is a number, `true` a bool).
fn apply_override(root: &mut serde_yaml::Value, assignment: &str) -> Result<(), String> {
    let (path, raw_value) = assignment
        .split_once('=')
        .ok_or_else(|| "expected key.path=value, e.g. --set train.max_steps=100".to_string())?;
    let parsed: serde_yaml::Value =
        serde_yaml::from_str(raw_value).unwrap_or_else(|_| serde_yaml::Value::String(raw_value.to_string()));
    let mut node = root;
    let parts: Vec<&str> = path.trim().split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(format!("`{path}` is not a key path; expected e.g. model.n_layer"));
    }
    for (i, part) in parts.iter().enumerate() {
        let map = node
            .as_mapping_mut()
            .ok_or_else(|| format!("`{}` is not a section", parts[..i].join(".")))?;
        let key = serde_yaml::Value::String(part.to_string());
        if i + 1 == parts.len() {
            map.insert(key, parsed);
            return Ok(());
        }
        node = map
            .entry(key)
            .or_insert_with(|| serde_yaml::Value::Mapping(Default::default()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn locate_finds_a_key_in_block_and_flow_mappings() {
        let text =
            "# c\ntrain:\n  loss: 1\nmodel:\n  settings:\n    loss: 2\n  loss: chunked\ndata: {source: x, path: y}\n";
        assert_eq!(locate(text, "model.loss"), Some((7, 3)));
        assert_eq!(locate(text, "model.settings"), Some((5, 3)));
        assert_eq!(locate(text, "data.path"), Some((8, 19)));
        assert_eq!(locate(text, "model.kind"), None);
        assert_eq!(locate(text, "optim.lr"), None);
    }

    use super::*;

    fn load_str(yaml: &str, overrides: &[&str]) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, yaml).unwrap();
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        load(&p, &o)
    }

    #[test]
    fn unknown_key_names_file_line_key_and_choices() {
        let e = load_str("model:\n  n_layer: 2\n  n_layerz: 3\n", &[]).unwrap_err();
        assert_eq!(e.line_col.map(|l| l.0), Some(3));
        assert_eq!(e.key, "model");
        assert!(e.message.contains("unknown key `n_layerz`, expected one of"), "{e}");
        assert!(e.message.contains("`n_head`"), "{e}");
    }

    #[test]
    fn wrong_type_and_bad_value() {
        let e = load_str("train:\n  max_steps: lots\n", &[]).unwrap_err();
        assert_eq!(e.key, "train.max_steps");
        assert!(e.message.contains("invalid type"), "{e}");
        let e = load_str("model:\n  n_embd: 100\n  n_head: 3\n", &[]).unwrap_err();
        assert_eq!(e.key, "model.n_embd");
    }

    #[test]
    fn a_list_or_a_scalar_where_a_mapping_goes_says_so_in_the_readers_words() {
        for (yaml, at) in [("- a\n- b\n", ""), ("model: 3\n", "model")] {
            let e = load_str(yaml, &[]).unwrap_err();
            assert!(e.message.contains("expected a mapping (key: value lines)"), "{e}");
            assert!(!e.to_string().contains("struct"), "{e}");
            assert_eq!(e.key, at);
        }
    }

    #[test]
    fn overrides_are_typed_and_validated() {
        let c = load_str("train:\n  max_steps: 5\n", &["train.max_steps=7", "model.bias=false"]).unwrap();
        assert_eq!(c.raw.train.max_steps, 7);
        assert_eq!(c.raw.model.bias, Some(false));
        let e = load_str("", &["model.n_layerz=3"]).unwrap_err();
        assert_eq!(e.origin, "--set model.n_layerz=3");
        assert!(e.message.contains("unknown key `n_layerz`"), "{e}");
        let e = load_str("", &["train.micro_batch_size=0"]).unwrap_err();
        assert_eq!(e.key, "train.micro_batch_size");
        // A value check fails on the --set that gave it, not the file (which has no such line).
        let e = load_str("train:\n  max_steps: 5\n", &["train.max_steps=0"]).unwrap_err();
        assert_eq!((e.origin.as_str(), e.line_col), ("--set train.max_steps=0", None));
        let e = load_str("train:\n  max_steps: 0\n", &[]).unwrap_err();
        assert_eq!(e.line_col.map(|l| l.0), Some(2), "{e}");
        // A bucket from a byte to 1 TiB; past that the planner's sums would overflow.
        for (mb, ok) in [
            ("0", false),
            ("-1", false),
            ("1e-6", true),
            ("1048576", true),
            ("2e6", false),
        ] {
            let c = load_str("", &[&format!("train.bucket_cap_mb={mb}")]);
            assert_eq!(c.is_ok(), ok, "bucket_cap_mb={mb}: {:?}", c.err());
            if let Err(e) = c {
                assert_eq!(e.key, "train.bucket_cap_mb", "{e}");
            }
        }
    }

    /// Every float key of the config (found by walking it, as the check does), set beyond
    /// what a 32-bit float holds, is refused naming that key; grad_clip as the fuzzer found.
    #[test]
    fn every_float_key_is_checked_against_libtorchs_range() {
        let mut floats = vec![];
        float_keys(
            &serde_json::to_value(load_str("model: {dropout: 0.1}\n", &[]).unwrap().raw).unwrap(),
            String::new(),
            &mut floats,
        );
        let keys: Vec<&str> = floats.iter().map(|(k, _)| k.as_str()).collect();
        for k in [
            "optim.lr",
            "optim.grad_clip",
            "optim.eps",
            "optim.weight_decay",
            "train.grad_scaler.init_scale",
            "model.dropout",
            "data.val_fraction",
            "memory.auto_margin",
        ] {
            assert!(keys.contains(&k), "{k} in {keys:?}");
        }
        for key in &keys {
            for bad in ["1e+308", "-1e+308", "1e-60"] {
                let e = load_str("model: {dropout: 0.1}\n", &[&format!("{key}={bad}")]).unwrap_err();
                assert_eq!(e.key, *key, "{key}={bad}: {e}");
            }
        }
        let e = load_str("optim: {grad_clip: 1e+308}\n", &[]).unwrap_err();
        assert!(e.key == "optim.grad_clip" && e.message.contains("32-bit float"), "{e}");
        assert!(
            load_str("optim: {grad_clip: 0, weight_decay: 0.0}\n", &[]).is_ok(),
            "0 is exact in any float"
        );
    }

    #[test]
    fn grad_scaler_defaults_are_gradscalers_and_are_validated() {
        let c = load_str("train: {grad_scaler: {growth_interval: 3}}\n", &[]).unwrap();
        let g = &c.raw.train.grad_scaler;
        assert_eq!(
            (g.init_scale, g.growth_factor, g.backoff_factor, g.growth_interval),
            (65536.0, 2.0, 0.5, 3)
        );
        for (set, key) in [
            (
                "train.grad_scaler.growth_interval=0",
                "train.grad_scaler.growth_interval",
            ),
            (
                "train.grad_scaler.backoff_factor=1.0",
                "train.grad_scaler.backoff_factor",
            ),
            ("train.grad_scaler.growth_factor=0.5", "train.grad_scaler.growth_factor"),
            ("train.grad_scaler.init_scale=0", "train.grad_scaler.init_scale"),
        ] {
            assert_eq!(load_str("", &[set]).unwrap_err().key, key, "{set}");
        }
        let e = load_str("train: {grad_scaler: {interval: 3}}\n", &[]).unwrap_err();
        assert!(e.message.contains("unknown key `interval`"), "{e}");
    }
}
