//! Owns the `optim` section and the learning-rate schedule.
//! Keeps: the learning rate is a pure function of the step and max_steps.
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// The `optim` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    /// The step at which the cosine decay from `lr` reaches `min_lr`, warmup included (nanoGPT's
    /// `lr_decay_iters`); defaults to `train.max_steps`.
    pub decay_steps: Option<u64>,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Clip the global gradient norm to this (0 disables).
    pub grad_clip: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 20,
            decay_steps: None,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
        }
    }
}

impl OptimConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [("optim.lr", self.lr), ("optim.eps", self.eps)];
        for (k, v) in positive {
            if !(v > 0.0 && v.is_finite()) {
                return Err(ConfigError::invalid(k, format!("is {v}; it must be a positive number")));
            }
        }
        if !(0.0..=self.lr).contains(&self.min_lr) {
            return Err(ConfigError::invalid(
                "optim.min_lr",
                format!("is {}; it must be in [0, optim.lr = {}]", self.min_lr, self.lr),
            ));
        }
        for (k, v) in [("optim.beta1", self.beta1), ("optim.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(ConfigError::invalid(k, format!("is {v}; it must be in [0, 1)")));
            }
        }
        for (k, v) in [
            ("optim.weight_decay", self.weight_decay),
            ("optim.grad_clip", self.grad_clip),
        ] {
            if v < 0.0 || !v.is_finite() {
                return Err(ConfigError::invalid(k, format!("is {v}; it must be 0 or more")));
            }
        }
        Ok(())
    }

    /// Linear warmup to `lr`, then cosine decay to `min_lr` over `decay_steps`.
    pub fn lr_at(&self, step: u64, max_steps: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let decay = self.decay_steps.unwrap_or(max_steps).max(self.warmup_steps + 1);
        if step >= decay {
            return self.min_lr;
        }
        let progress = (step - self.warmup_steps) as f64 / (decay - self.warmup_steps) as f64;
        self.min_lr + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (self.lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let c = OptimConfig {
            lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 10,
            decay_steps: Some(110),
            ..Default::default()
        };
        assert!((c.lr_at(0, 0) - 0.1).abs() < 1e-12);
        assert!((c.lr_at(9, 0) - 1.0).abs() < 1e-12);
        assert!((c.lr_at(10, 0) - 1.0).abs() < 1e-12);
        assert!((c.lr_at(60, 0) - 0.55).abs() < 1e-12);
        assert_eq!(c.lr_at(110, 0), 0.1);
        assert_eq!(c.lr_at(5000, 0), 0.1);
        let d = OptimConfig { decay_steps: None, ..c };
        assert!((d.lr_at(60, 110) - 0.55).abs() < 1e-12);
    }
}
