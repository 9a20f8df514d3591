//! Models trained by oomguard. Anything whose loss on a batch is fallible can be trained
//! under the guard (see `train::TrainModel`); the GPT is the built-in one.
mod gpt;

pub use gpt::{no_weight_decay, Gpt};

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// The `model` section: a GPT's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GptConfig {
    pub n_layer: i64,
    pub n_head: i64,
    pub n_embd: i64,
    pub block_size: i64,
    pub vocab_size: i64,
    pub dropout: f64,
    pub bias: bool,
}

impl Default for GptConfig {
    fn default() -> Self {
        GptConfig { n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, vocab_size: 256, dropout: 0.0, bias: true }
    }
}

impl GptConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (key, v) in [
            ("model.n_layer", self.n_layer),
            ("model.n_head", self.n_head),
            ("model.n_embd", self.n_embd),
            ("model.block_size", self.block_size),
            ("model.vocab_size", self.vocab_size),
        ] {
            if v < 1 {
                return Err(ConfigError::invalid(key, format!("is {v}; it must be at least 1")));
            }
        }
        if self.n_embd % self.n_head != 0 {
            return Err(ConfigError::invalid(
                "model.n_embd",
                format!("{} is not divisible by model.n_head {}; pick n_embd a multiple of n_head", self.n_embd, self.n_head),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ConfigError::invalid("model.dropout", format!("is {}; it must be in [0, 1)", self.dropout)));
        }
        Ok(())
    }

    /// Number of parameters (the LM head is tied to the token embedding).
    pub fn num_params(&self) -> i64 {
        let (c, l, v, t) = (self.n_embd, self.n_layer, self.vocab_size, self.block_size);
        let b = if self.bias { 1 } else { 0 };
        let per_layer = 2 * (c + b * c) + (3 * c * c + b * 3 * c) + (c * c + b * c) + (4 * c * c + b * 4 * c) + (4 * c * c + b * c);
        v * c + t * c + l * per_layer + (c + b * c)
    }
}
