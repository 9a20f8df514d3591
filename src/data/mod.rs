//! Owns training data: the embedded language, text, nanoGPT tokens, safetensors or Python.
//! Keeps: step `s`'s samples are `sample_positions(seed, s, ...)`, independent of the micro-batch
//! and the ranks, so a step split any way sees exactly the same samples.
mod embedded;
mod tensors;
mod tokens;

use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

pub use tokens::{Split, TokenSamples};

use crate::error::{ConfigError, Result};
// Its home is crate::rng; this path stays for programs that named it here.
pub use crate::rng::splitmix64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataSource {
    Embedded,
    Text,
    Tokens,
    Tensors,
    Python,
}

/// The `data` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    pub source: DataSource,
    /// `text`: the file; `tokens`: the folder holding train.bin and val.bin; `tensors`: a
    /// safetensors file with `inputs` and `targets`; `python`: the .py file whose
    /// `build(settings, split)` returns a map-style dataset. Relative to the config file's folder.
    pub path: Option<PathBuf>,
    /// `python`: the file's dataset function (default `build`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub build: Option<String>,
    /// `python`: the dict `build` receives.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub settings: Option<serde_yaml::Value>,
    /// Share held out for evaluation (`embedded`, `text` and `tensors`).
    pub val_fraction: f64,
    /// Size of the embedded corpus in bytes.
    pub embedded_bytes: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            source: DataSource::Embedded,
            path: None,
            build: None,
            settings: None,
            val_fraction: 0.1,
            embedded_bytes: 1 << 20,
        }
    }
}

impl DataConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.source != DataSource::Embedded && self.path.is_none() {
            return Err(ConfigError::invalid(
                "data.path",
                format!("is required for source {}: {}", self.source.name(), self.source.wants()),
            ));
        }
        if !(self.val_fraction > 0.0 && self.val_fraction < 1.0) {
            return Err(ConfigError::invalid(
                "data.val_fraction",
                format!("is {}; it must be in (0, 1)", self.val_fraction),
            ));
        }
        if self.source != DataSource::Python {
            for (key, set) in [("build", self.build.is_some()), ("settings", self.settings.is_some())] {
                if set {
                    return Err(ConfigError::invalid(
                        &format!("data.{key}"),
                        "is a key of data.source: python",
                    ));
                }
            }
        }
        if self.settings.as_ref().is_some_and(|v| !v.is_mapping()) {
            return Err(ConfigError::invalid(
                "data.settings",
                "must be a mapping (build receives it as a dict)",
            ));
        }
        if !(4096..=1 << 32).contains(&self.embedded_bytes) {
            return Err(ConfigError::invalid(
                "data.embedded_bytes",
                format!("is {}; it must be from 4096 to 4294967296 (4 GiB)", self.embedded_bytes),
            ));
        }
        Ok(())
    }

    /// `data.path` resolved against `base` (the config file's folder).
    pub fn resolved_path(&self, base: &Path) -> Option<PathBuf> {
        self.path
            .as_ref()
            .map(|p| if p.is_absolute() { p.clone() } else { base.join(p) })
    }

    /// Checks that the files the source needs exist, before any run starts.
    pub fn check_files(&self, base: &Path) -> Result<(), ConfigError> {
        let Some(path) = self.resolved_path(base) else {
            return Ok(());
        };
        let needed = match self.source {
            DataSource::Embedded => vec![],
            DataSource::Text | DataSource::Tensors | DataSource::Python => vec![path],
            DataSource::Tokens => vec![path.join("train.bin"), path.join("val.bin")],
        };
        match needed.iter().find(|p| !p.is_file()) {
            Some(p) => Err(ConfigError::invalid(
                "data.path",
                format!(
                    "{} {}; for source {} point data.path at {}",
                    p.display(),
                    if p.is_dir() {
                        "is a folder, not a file"
                    } else {
                        "does not exist"
                    },
                    self.source.name(),
                    self.source.wants()
                ),
            )),
            None => Ok(()),
        }
    }

    /// Whether samples are windows of a token stream (which need `model.block_size`).
    pub fn is_tokens(&self) -> bool {
        !matches!(self.source, DataSource::Tensors | DataSource::Python)
    }
}

impl DataSource {
    pub fn name(self) -> &'static str {
        match self {
            DataSource::Embedded => "embedded",
            DataSource::Text => "text",
            DataSource::Tokens => "tokens",
            DataSource::Tensors => "tensors",
            DataSource::Python => "python",
        }
    }
    fn wants(self) -> &'static str {
        match self {
            DataSource::Embedded => "nothing",
            DataSource::Text => "a UTF-8 text file",
            DataSource::Tokens => "a folder with train.bin and val.bin",
            DataSource::Tensors => "a safetensors file with `inputs` and `targets` (samples along dim 0)",
            DataSource::Python => "a .py file whose build(settings, split) returns a map-style dataset",
        }
    }
}

/// A set of samples addressed by position: a token window's start, a row of a tensor file,
/// or whatever a user's data numbers its samples by.
pub trait Samples {
    /// How many distinct positions there are (samples are drawn from `0..num_positions`).
    fn num_positions(&self) -> usize;
    /// Inputs and targets for the samples at `positions`, stacked along dim 0, on `device`.
    fn batch(&self, positions: &[usize], device: Device) -> Result<(Tensor, Tensor)>;
    /// Units the loss averages over in one sample (tokens for a language model), for
    /// throughput figures.
    fn units_per_sample(&self) -> usize {
        1
    }
    /// How many of the target units of the samples at `positions` count in the loss (those
    /// that are not IGNORE_INDEX), or None when every unit counts (no target is ignored).
    fn valid_units(&self, _positions: &[usize]) -> Result<Option<usize>> {
        Ok(None)
    }
    /// The loss is a mean over units that the model's forward counts on the batch it builds
    /// (a data file's `loss_units`; `Task::last_units`): a step weighs its micro-batches
    /// after their forward, instead of counting them first (`valid_units`).
    fn counted_in_forward(&self) -> bool {
        false
    }
    /// Where the samples come from, for messages.
    fn name(&self) -> String;
}

/// The target value a cross-entropy loss skips (PyTorch's default `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// Train and validation samples.
pub struct Dataset {
    pub train: Box<dyn Samples>,
    pub val: Box<dyn Samples>,
}

/// What the model fixes about token data: the sequence length, and (when the model knows
/// it) the vocabulary every token must fall in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenShape {
    pub block_size: usize,
    pub vocab_size: Option<i64>,
}

impl Dataset {
    /// Opens the data a config names; `base` is the config file's folder. Token sources need
    /// `shape` (the model's sequence length).
    pub fn open(cfg: &DataConfig, base: &Path, shape: Option<TokenShape>) -> Result<Dataset> {
        let path = cfg.resolved_path(base).unwrap_or_default();
        if cfg.source == DataSource::Tensors {
            let gpt = shape.and_then(|s| Some((s.vocab_size?, s.block_size as i64)));
            return tensors::open(&path, cfg.val_fraction, gpt);
        }
        if cfg.source == DataSource::Python {
            return Err(
                ConfigError::invalid("data.source", "python serves Python models only (model.kind: python)").into(),
            );
        }
        let shape = shape.ok_or_else(|| {
            ConfigError::invalid(
                "model.block_size",
                format!(
                    "is needed: data.source {} cuts a token stream into samples of model.block_size tokens",
                    cfg.source.name()
                ),
            )
        })?;
        tokens::open(cfg, &path, shape)
    }
}

/// Positions of the `count` samples of step `step`, each in `0..num_positions`: a pure
/// function of (seed, step), prefix-stable, independent of how the step is split.
pub fn sample_positions(seed: u64, step: u64, count: usize, num_positions: usize) -> Vec<usize> {
    let positions = num_positions.max(1) as u64;
    let base = splitmix64(seed ^ splitmix64(step));
    (0..count as u64)
        .map(|i| (splitmix64(base ^ splitmix64(i.wrapping_add(1) << 20)) % positions) as usize)
        .collect()
}

/// Start offsets of a step's token windows of `block` tokens (with their next-token
/// targets) in a stream of `num_tokens`.
pub fn sample_offsets(seed: u64, step: u64, global_batch: usize, num_tokens: usize, block: usize) -> Vec<usize> {
    sample_positions(seed, step, global_batch, num_tokens - block - 1)
}

/// The seed evaluation draws its fixed held-out batches from.
pub fn eval_seed(seed: u64) -> u64 {
    splitmix64(seed ^ 0xE7A1)
}

/// The samples of each optimizer step, cut into micro-batches. `micro_batch(step, r)` returns
/// the same samples for the same (step, index) whatever the ranges asked for: that is what
/// lets the guard re-split a step without skipping or repeating a sample.
pub trait StepBatches {
    fn global_batch_size(&self) -> usize;
    /// The samples of the global batch this process trains on (all of them, or a
    /// data-parallel rank's shard).
    fn shard(&self) -> Range<usize> {
        0..self.global_batch_size()
    }
    /// Units the loss averages over in one sample (tokens), for throughput.
    fn units_per_sample(&self) -> usize;
    fn micro_batch(&self, step: u64, samples: Range<usize>) -> Result<(Tensor, Tensor)>;
    /// `Samples::valid_units` of these samples of step `step`'s global batch.
    fn valid_units(&self, _step: u64, _samples: Range<usize>) -> Result<Option<usize>> {
        Ok(None)
    }
    /// `Samples::counted_in_forward`.
    fn counted_in_forward(&self) -> bool {
        false
    }
}

/// `sample_positions(seed, step)` into a set of samples, `global_batch` a step.
pub struct StepSamples<'a> {
    pub samples: &'a dyn Samples,
    pub seed: u64,
    pub global_batch: usize,
    pub device: Device,
    /// This process's part of each global batch.
    pub shard: Range<usize>,
}

impl<'a> StepSamples<'a> {
    pub fn new(samples: &'a dyn Samples, seed: u64, global_batch: usize, device: Device) -> StepSamples<'a> {
        StepSamples {
            samples,
            seed,
            global_batch,
            device,
            shard: 0..global_batch,
        }
    }
}

impl StepBatches for StepSamples<'_> {
    fn global_batch_size(&self) -> usize {
        self.global_batch
    }
    fn shard(&self) -> Range<usize> {
        self.shard.clone()
    }
    fn units_per_sample(&self) -> usize {
        self.samples.units_per_sample()
    }
    fn micro_batch(&self, step: u64, samples: Range<usize>) -> Result<(Tensor, Tensor)> {
        let positions = sample_positions(self.seed, step, samples.end, self.samples.num_positions());
        self.samples.batch(&positions[samples], self.device)
    }
    fn valid_units(&self, step: u64, samples: Range<usize>) -> Result<Option<usize>> {
        let positions = sample_positions(self.seed, step, samples.end, self.samples.num_positions());
        self.samples.valid_units(&positions[samples])
    }
    fn counted_in_forward(&self) -> bool {
        self.samples.counted_in_forward()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_pure_and_in_range() {
        let a = sample_offsets(7, 3, 16, 1000, 64);
        assert_eq!(a, sample_offsets(7, 3, 16, 1000, 64));
        assert_ne!(a, sample_offsets(7, 4, 16, 1000, 64));
        assert_ne!(a, sample_offsets(8, 3, 16, 1000, 64));
        assert!(a.iter().all(|&o| o + 64 < 1000));
        // The first k samples of a larger batch are the same samples: prefix-stable.
        assert_eq!(&sample_offsets(7, 3, 32, 1000, 64)[..16], &a[..]);
    }
}
