//! Owns the `model` section (`kind`: gpt, torchscript, python or rust) and the built-in GPT.
//! Keeps: every key is optional, so each kind refuses another kind's keys by name.
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
    Python,
    Rust,
}

/// `model.loss`: the GPT's head (`fused` or `full`), or, for `kind: python`, the name of the
/// file's function `loss(module, batch)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LossSetting {
    Kind(LossKind),
    Function(String),
}

impl LossSetting {
    /// The name as written.
    pub fn name(&self) -> &str {
        match self {
            LossSetting::Kind(k) => k.name(),
            LossSetting::Function(f) => f,
        }
    }
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
    /// `fused` (default) or `full`: how the GPT's head computes the loss (model/loss.rs);
    /// `python`: the file's loss function, `loss(module, batch)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss: Option<LossSetting>,
    /// Starting weights (safetensors, named as the model names its parameters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// `torchscript`: the saved module; `python`: the file that builds it (relative to the
    /// config file's folder).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// `torchscript`: the exported method returning the mean loss (default `forward`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// `python`: the file's function `build(settings) -> torch.nn.Module` (default `build`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub build: Option<String>,
    /// `python`: the class of the module's repeated blocks, which activation checkpointing
    /// wraps (default: the blocks of the module's longest list of same-class children).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocks: Option<String>,
    /// `rust`: the program's own model settings; `python`: the dict `build` receives.
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
            loss: match &self.loss {
                Some(LossSetting::Kind(k)) => *k,
                _ => d.loss,
            },
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
            loss: Some(LossSetting::Kind(g.loss)),
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
                    ("build", self.build.is_some()),
                    ("blocks", self.blocks.is_some()),
                ] {
                    if set {
                        return not_for(key, "is not a key of the built-in GPT (kind: gpt); did you mean kind: python, torchscript or rust?");
                    }
                }
                if let Some(LossSetting::Function(f)) = &self.loss {
                    return not_for("loss", &format!("is `{f}`; the built-in GPT's loss is fused or full"));
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
                let python = kind == ModelKind::Python;
                if self.loss.is_some() && !python {
                    return not_for(
                        "loss",
                        "is a key of the built-in GPT (kind: gpt) and of kind: python; this model computes its own loss (remove it)",
                    );
                }
                if !python
                    && self
                        .activation_checkpointing
                        .is_some_and(|a| a != ActivationCheckpointing::None)
                {
                    return not_for(
                        "activation_checkpointing",
                        "is available for the built-in GPT and Python models only (kind: gpt or python)",
                    );
                }
                for (key, set) in [("build", self.build.is_some()), ("blocks", self.blocks.is_some())] {
                    if set && !python {
                        return not_for(key, "is a key of kind: python");
                    }
                }
                if python {
                    if self.path.is_none() {
                        return not_for(
                            "path",
                            "is required for kind: python: the .py file whose build(settings) returns the torch.nn.Module",
                        );
                    }
                    if self.method.is_some() {
                        return not_for(
                            "method",
                            "is a key of kind: torchscript; a Python model's loss is its output, or model.loss names a loss(module, batch) function",
                        );
                    }
                    for (key, name) in [
                        ("build", self.build.as_deref()),
                        ("loss", self.loss.as_ref().map(|l| l.name())),
                        ("blocks", self.blocks.as_deref()),
                    ] {
                        if let Some(n) = name.filter(|n| !is_identifier(n)) {
                            return not_for(
                                key,
                                &format!("is `{n}`; it must name a Python function or class (an identifier)"),
                            );
                        }
                    }
                    if self.settings.as_ref().is_some_and(|v| !v.is_mapping()) {
                        return not_for("settings", "must be a mapping (build receives it as a dict)");
                    }
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

/// A Python identifier (ASCII letters, digits and `_`, not starting with a digit).
fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}
