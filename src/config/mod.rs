//! Configuration in two stages: `RawConfig` is what the YAML says (serde, unknown keys
//! refused); `Config` is the validated runtime config the trainer uses. Each component owns
//! its section's struct and its checks.
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
            origin: set_origin.clone(), line_col: None, key: String::new(), message: m,
        })?;
        let _: RawConfig = serde_yaml::from_value(value.clone()).map_err(|e| {
            let err = yaml_error(&set_origin, e);
            // from_value does not track paths; the override names its own key.
            let key = if err.key.is_empty() { o.split('=').next().unwrap_or_default().to_string() } else { err.key };
            ConfigError { key, ..err }
        })?;
    }
    let raw: RawConfig = serde_yaml::from_value(value).map_err(|e| yaml_error(&origin, e))?;
    raw.validate().map_err(|e| ConfigError { origin, ..e })?;
    Ok(Config { raw, path: path.to_path_buf() })
}

impl Config {
    /// The config file's folder: relative paths in it (data, model files) start there.
    pub fn base_dir(&self) -> PathBuf {
        self.path.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
    }

    /// The config as it takes effect, every default written out (the run's config.yaml).
    pub fn resolved(&self) -> RawConfig {
        RawConfig { model: self.raw.model.resolved(), ..self.raw.clone() }
    }

    /// When the run evaluates and checkpoints (the loop and its ETA ask the same).
    pub fn schedule(&self) -> oomguard_launch::progress::Schedule {
        let r = &self.raw;
        oomguard_launch::progress::Schedule { max_steps: r.train.max_steps, eval_every: r.train.eval_every, checkpoint_every: r.checkpoint.every_steps }
    }

    /// Checks that the data files exist (training needs them; planning does not).
    pub fn check_data_files(&self) -> Result<(), ConfigError> {
        let base = self.path.parent().unwrap_or(Path::new("."));
        self.raw.data.check_files(base).map_err(|e| ConfigError { origin: self.path.display().to_string(), ..e })
    }
}

impl RawConfig {
    /// Checks that span sections, then each section's own.
    pub fn validate(&self) -> Result<(), ConfigError> {
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
                format!("is {} but byte-level text needs 256; set model.vocab_size: 256", self.model.gpt().vocab_size),
            ));
        }
        if self.model.kind == ModelKind::Torchscript && self.data.is_tokens() && self.model.block_size.is_none() {
            return Err(ConfigError::invalid(
                "model.block_size",
                format!("is required: data.source {} cuts a token stream into samples of model.block_size tokens for the model", self.data.source.name()),
            ));
        }
        Ok(())
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
    let parsed: serde_yaml::Value = serde_yaml::from_str(raw_value)
        .unwrap_or_else(|_| serde_yaml::Value::String(raw_value.to_string()));
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
        node = map.entry(key).or_insert_with(|| serde_yaml::Value::Mapping(Default::default()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
    fn overrides_are_typed_and_validated() {
        let c = load_str("train:\n  max_steps: 5\n", &["train.max_steps=7", "model.bias=false"]).unwrap();
        assert_eq!(c.raw.train.max_steps, 7);
        assert_eq!(c.raw.model.bias, Some(false));
        let e = load_str("", &["model.n_layerz=3"]).unwrap_err();
        assert_eq!(e.origin, "--set model.n_layerz=3");
        assert!(e.message.contains("unknown key `n_layerz`"), "{e}");
        let e = load_str("", &["train.micro_batch_size=0"]).unwrap_err();
        assert_eq!(e.key, "train.micro_batch_size");
    }

    #[test]
    fn grad_scaler_defaults_are_gradscalers_and_are_validated() {
        let c = load_str("train: {grad_scaler: {growth_interval: 3}}\n", &[]).unwrap();
        let g = &c.raw.train.grad_scaler;
        assert_eq!((g.init_scale, g.growth_factor, g.backoff_factor, g.growth_interval), (65536.0, 2.0, 0.5, 3));
        for (set, key) in [
            ("train.grad_scaler.growth_interval=0", "train.grad_scaler.growth_interval"),
            ("train.grad_scaler.backoff_factor=1.0", "train.grad_scaler.backoff_factor"),
            ("train.grad_scaler.growth_factor=0.5", "train.grad_scaler.growth_factor"),
            ("train.grad_scaler.init_scale=0", "train.grad_scaler.init_scale"),
        ] {
            assert_eq!(load_str("", &[set]).unwrap_err().key, key, "{set}");
        }
        let e = load_str("train: {grad_scaler: {interval: 3}}\n", &[]).unwrap_err();
        assert!(e.message.contains("unknown key `interval`"), "{e}");
    }
}
