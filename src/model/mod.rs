//! The `model` section, and the built-in GPT. `kind` picks what is trained:
//! - `gpt` (the default): oomguard's GPT; the shape keys below describe it;
//! - `torchscript`: a PyTorch module saved with `torch.jit.script` or `torch.jit.trace`
//!   (`path`, and `method` if the loss is not `forward(inputs, targets)`);
//! - `rust`: a model a Rust program brings through the library; its own settings go under
//!   `settings`, which the program reads.
//!
//! The section keeps every key optional, so that each kind refuses the keys of another
//! by name; `gpt()` resolves the GPT's defaults.
mod gpt;
pub mod loss;

pub use gpt::{no_weight_decay, Gpt, GptConfig};
pub use loss::LossKind;

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

use crate::error::ConfigError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    #[default]
    Gpt,
    Torchscript,
    Rust,
}

/// `model.activation_checkpointing`: recompute activations in backward instead of storing
/// them (`blocks`: each transformer block's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivationCheckpointing {
    #[default]
    None,
    Blocks,
}

/// The `model` section as written.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    pub kind: ModelKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_layer: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_head: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_embd: Option<i64>,
    /// Sequence length: the GPT's context, and the window a token source cuts for any model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<ActivationCheckpointing>,
    /// `fused` (default) or `full`: how the GPT's head computes the loss (model/loss.rs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss: Option<LossKind>,
    /// Starting weights (safetensors, named as the model names its parameters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// `torchscript`: the saved module (relative to the config file's folder).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// `torchscript`: the exported method returning the mean loss (default `forward`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// `rust`: the program's own model settings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub settings: Option<serde_yaml::Value>,
}

const GPT_KEYS: [&str; 6] = ["n_layer", "n_head", "n_embd", "vocab_size", "dropout", "bias"];

impl ModelConfig {
    /// The built-in GPT's shape, defaults filled in.
    pub fn gpt(&self) -> GptConfig {
        let d = GptConfig::default();
        GptConfig {
            n_layer: self.n_layer.unwrap_or(d.n_layer),
            n_head: self.n_head.unwrap_or(d.n_head),
            n_embd: self.n_embd.unwrap_or(d.n_embd),
            block_size: self.block_size.unwrap_or(d.block_size),
            vocab_size: self.vocab_size.unwrap_or(d.vocab_size),
            dropout: self.dropout.unwrap_or(d.dropout),
            bias: self.bias.unwrap_or(d.bias),
            loss: self.loss.unwrap_or(d.loss),
        }
    }

    /// The section as it takes effect (the GPT's defaults written out), for config.yaml.
    pub fn resolved(&self) -> ModelConfig {
        if self.kind != ModelKind::Gpt {
            return self.clone();
        }
        let g = self.gpt();
        ModelConfig {
            n_layer: Some(g.n_layer),
            n_head: Some(g.n_head),
            n_embd: Some(g.n_embd),
            block_size: Some(g.block_size),
            vocab_size: Some(g.vocab_size),
            dropout: Some(g.dropout),
            bias: Some(g.bias),
            loss: Some(g.loss),
            activation_checkpointing: Some(self.activation_checkpointing.unwrap_or_default()),
            ..self.clone()
        }
    }

    /// The sequence length, where the model has one.
    pub fn block_size(&self) -> Option<i64> {
        match self.kind {
            ModelKind::Gpt => Some(self.gpt().block_size),
            _ => self.block_size,
        }
    }

    fn set_keys(&self) -> Vec<&'static str> {
        let set = [
            self.n_layer.is_some(),
            self.n_head.is_some(),
            self.n_embd.is_some(),
            self.vocab_size.is_some(),
            self.dropout.is_some(),
            self.bias.is_some(),
        ];
        GPT_KEYS.iter().zip(set).filter(|(_, s)| *s).map(|(k, _)| *k).collect()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let not_for = |key: &str, why: &str| Err(ConfigError::invalid(&format!("model.{key}"), why.to_string()));
        match self.kind {
            ModelKind::Gpt => {
                for (key, set) in [
                    ("path", self.path.is_some()),
                    ("method", self.method.is_some()),
                    ("settings", self.settings.is_some()),
                ] {
                    if set {
                        return not_for(key, "is not a key of the built-in GPT (kind: gpt); did you mean kind: torchscript or kind: rust?");
                    }
                }
                self.gpt().validate()?;
            }
            kind => {
                if let Some(key) = self.set_keys().first() {
                    return not_for(
                        key,
                        "is a key of the built-in GPT; this model's shape comes from the model itself (remove it)",
                    );
                }
                if self.loss.is_some() {
                    return not_for(
                        "loss",
                        "is a key of the built-in GPT (kind: gpt); this model computes its own loss (remove it)",
                    );
                }
                if self
                    .activation_checkpointing
                    .is_some_and(|a| a != ActivationCheckpointing::None)
                {
                    return not_for(
                        "activation_checkpointing",
                        "is available for the built-in GPT only (kind: gpt)",
                    );
                }
                if kind == ModelKind::Torchscript && self.path.is_none() {
                    return not_for(
                        "path",
                        "is required for kind: torchscript: the file saved with torch.jit.save",
                    );
                }
                if kind == ModelKind::Rust && (self.path.is_some() || self.method.is_some()) {
                    return not_for(
                        if self.path.is_some() { "path" } else { "method" },
                        "is a key of kind: torchscript",
                    );
                }
                if let Some(t) = self.block_size.filter(|&t| t < 1) {
                    return not_for("block_size", &format!("is {t}; it must be at least 1"));
                }
                if self.method.as_deref().is_some_and(|m| m.trim().is_empty()) {
                    return not_for(
                        "method",
                        "is empty; name the module's exported method that returns the mean loss",
                    );
                }
            }
        }
        Ok(())
    }
}
