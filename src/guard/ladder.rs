//! The rungs below micro-batch 1: when even one sample does not fit, the run switches a GPT
//! configured with `model.loss: full` to the fused loss, turns on activation checkpointing
//! and falls back to bf16 before it gives up, cheapest first. A pure decision, tested in
//! place.
use serde::{Deserialize, Serialize};

use crate::model::LossKind;
use crate::precision::Precision;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rung {
    /// `model.loss: fused`: the head and cross-entropy a chunk of tokens at a time, never the
    /// whole logits; the same gradients and the same FLOPs, so always the cheapest rung.
    FusedLoss,
    /// Recompute each block in backward instead of keeping its activations: the same
    /// gradients, about a third more compute.
    ActivationCheckpointing,
    /// bf16 autocast: half the activation memory, lower precision (master weights stay fp32).
    Bf16,
}

/// Where a run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footing {
    /// `None`: the model cannot checkpoint activations.
    pub checkpointing: Option<bool>,
    pub precision: Precision,
    /// `None`: the model has no choice of loss (not the built-in GPT).
    pub loss: Option<LossKind>,
}

/// What the run may do (memory.allow_*), and whether bf16 is fast on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowed {
    pub checkpointing: bool,
    pub precision_fallback: bool,
    pub bf16_fast: bool,
}

/// The next rung, or `None` when none is left. Cheapest first: where bf16 is native (an
/// Ampere or newer GPU) it is faster as well as smaller, so it comes first; elsewhere (this
/// CPU emulates bf16) checkpointing, which keeps the gradients exact, costs less.
pub fn next_rung(at: Footing, allowed: Allowed) -> Option<Rung> {
    if at.loss == Some(LossKind::Full) {
        return Some(Rung::FusedLoss);
    }
    let ckpt = (allowed.checkpointing && at.checkpointing == Some(false)).then_some(Rung::ActivationCheckpointing);
    let bf16 = (allowed.precision_fallback && at.precision == Precision::Fp32).then_some(Rung::Bf16);
    if allowed.bf16_fast { bf16.or(ckpt) } else { ckpt.or(bf16) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Allowed = Allowed { checkpointing: true, precision_fallback: true, bf16_fast: false };

    #[test]
    fn fused_loss_first_for_a_gpt_on_the_full_loss() {
        let full = Footing { checkpointing: Some(false), precision: Precision::Fp32, loss: Some(LossKind::Full) };
        assert_eq!(next_rung(full, ALL), Some(Rung::FusedLoss));
        assert_eq!(next_rung(full, Allowed { bf16_fast: true, ..ALL }), Some(Rung::FusedLoss));
        assert_eq!(next_rung(Footing { loss: Some(LossKind::Fused), ..full }, ALL), Some(Rung::ActivationCheckpointing));
    }

    #[test]
    fn cheapest_first_then_none() {
        let fp32 = Footing { checkpointing: Some(false), precision: Precision::Fp32, loss: None };
        assert_eq!(next_rung(fp32, ALL), Some(Rung::ActivationCheckpointing));
        assert_eq!(next_rung(Footing { checkpointing: Some(true), ..fp32 }, ALL), Some(Rung::Bf16));
        assert_eq!(next_rung(Footing { checkpointing: Some(true), precision: Precision::Bf16, loss: None }, ALL), None);
        // On a GPU with native bf16, bf16 is the cheaper rung.
        assert_eq!(next_rung(fp32, Allowed { bf16_fast: true, ..ALL }), Some(Rung::Bf16));
    }

    #[test]
    fn only_what_is_allowed_and_possible() {
        let fp32 = Footing { checkpointing: Some(false), precision: Precision::Fp32, loss: None };
        assert_eq!(next_rung(fp32, Allowed { checkpointing: false, ..ALL }), Some(Rung::Bf16));
        assert_eq!(next_rung(fp32, Allowed { precision_fallback: false, checkpointing: false, ..ALL }), None);
        // A model that cannot checkpoint (a TorchScript module): only precision.
        assert_eq!(next_rung(Footing { checkpointing: None, precision: Precision::Fp32, loss: None }, ALL), Some(Rung::Bf16));
        // fp16 already halves activations: no precision rung.
        assert_eq!(next_rung(Footing { checkpointing: None, precision: Precision::Fp16, loss: None }, ALL), None);
    }
}
