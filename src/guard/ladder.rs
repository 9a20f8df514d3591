//! Owns the rungs below micro-batch 1: fused loss, activation checkpointing, bf16, ZeRO-1/2.
//! Keeps: pure decisions; the rung chosen saves the most memory for what it costs.
use serde::{Deserialize, Serialize};

use crate::model::LossKind;
use crate::optim::Shard;
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
    /// Data parallel: AdamW's moments split across the ranks (ZeRO-1).
    ShardOptimizer,
    /// Data parallel: the summed gradients split too (ZeRO-2).
    ShardGradients,
}

impl Rung {
    /// The sharding a rung stands for.
    pub fn shard(self) -> Option<Shard> {
        match self {
            Rung::ShardOptimizer => Some(Shard::Optimizer),
            Rung::ShardGradients => Some(Shard::Gradients),
            _ => None,
        }
    }
}

/// Where a run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footing {
    /// `None`: the model cannot checkpoint activations.
    pub checkpointing: Option<bool>,
    pub precision: Precision,
    /// `None`: the model has no choice of loss (not the built-in GPT).
    pub loss: Option<LossKind>,
    /// `None`: a single process (nothing to shard with).
    pub shard: Option<Shard>,
}

/// What the run may do (memory.allow_*), and whether bf16 is fast on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowed {
    pub checkpointing: bool,
    pub precision_fallback: bool,
    pub bf16_fast: bool,
    pub sharding: bool,
}

/// Bytes per rank each rung would save, from the planner's figures (the activations of
/// one sample: its formula, or what the last step measured) and the optimizer's own sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Savings {
    pub activations: u64,
    /// AdamW's moments on this rank, and the ranks.
    pub optimizer_state: u64,
    pub gradients: u64,
    pub world: u64,
    /// Whether ZeRO-2 would reduce during backward (the overlapped reduction, a backward in
    /// one pass): only then does it save its gradients at the peak.
    pub gradients_during_backward: bool,
}

/// What each rung costs, as a share of a step's time. Checkpointing recomputes each
/// block's forward (about a third of a step); bf16 is faster where the device runs it
/// natively and several times slower where it is emulated (this CPU); sharding adds the
/// all-gather of the parameters (stage 1) and moves each bucket's sum into the shard as it
/// arrives (stage 2), a few per cent of a data-parallel step (`make bench`, sharding).
fn cost(rung: Rung, bf16_fast: bool) -> f64 {
    match rung {
        Rung::FusedLoss => 0.0,
        Rung::ActivationCheckpointing => 0.33,
        Rung::Bf16 if bf16_fast => 0.0,
        Rung::Bf16 => 1.0,
        Rung::ShardOptimizer => 0.05,
        Rung::ShardGradients => 0.10,
    }
}

/// The next rung, or `None` when none is left: the fused loss first (it saves the logits
/// for nothing), then the allowed rung that saves the most bytes per unit of cost.
pub fn next_rung(at: Footing, allowed: Allowed, s: &Savings) -> Option<Rung> {
    if at.loss == Some(LossKind::Full) {
        return Some(Rung::FusedLoss);
    }
    let split = |bytes: u64| bytes - bytes / s.world.max(1);
    let candidates = [
        (allowed.checkpointing && at.checkpointing == Some(false))
            .then_some((Rung::ActivationCheckpointing, s.activations * 2 / 3)),
        (allowed.precision_fallback && at.precision == Precision::Fp32).then_some((Rung::Bf16, s.activations / 2)),
        (allowed.sharding && at.shard == Some(Shard::None)).then_some((Rung::ShardOptimizer, split(s.optimizer_state))),
        // Stage 2 after stage 1, where it drops each bucket's gradients during backward;
        // reduced after backward, every gradient is whole at the peak and it saves nothing.
        (allowed.sharding && at.shard == Some(Shard::Optimizer) && s.gradients_during_backward)
            .then_some((Rung::ShardGradients, split(s.gradients))),
    ];
    let score = |&(r, saved): &(Rung, u64)| saved.max(1) as f64 / cost(r, allowed.bf16_fast).max(0.01);
    candidates
        .into_iter()
        .flatten()
        .max_by(|a, b| score(a).total_cmp(&score(b)))
        .map(|(r, _)| r)
}

/// A sharded run's way back: after `grow_after` clean steps since it last changed, and
/// when the peak plus what the rung saved still leaves `headroom` of the limit free, it
/// unshards one stage (gradients, then the optimizer state), never below the configured
/// stage and never back into a stage that failed within `cooldown` steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Back {
    pub at: Shard,
    pub configured: Shard,
    pub clean_steps: u64,
    /// The step a stage below the current one last failed (it cools down).
    pub failed_at: Option<u64>,
    pub step: u64,
    pub peak_bytes: u64,
    pub limit_bytes: Option<u64>,
    /// What the current stage saves against the one below it, per rank.
    pub saved_bytes: u64,
}

pub fn unshard(b: Back, grow_after: u64, cooldown: u64, headroom: f64) -> Option<Shard> {
    let below = match b.at {
        Shard::Gradients => Shard::Optimizer,
        Shard::Optimizer => Shard::None,
        Shard::None => return None,
    };
    let limit = b.limit_bytes?;
    let cooled = b.failed_at.is_none_or(|f| b.step.saturating_sub(f) >= cooldown);
    let fits = (b.peak_bytes + b.saved_bytes) as f64 <= limit as f64 * (1.0 - headroom);
    (below >= b.configured && b.clean_steps >= grow_after && cooled && fits).then_some(below)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Allowed = Allowed {
        checkpointing: true,
        precision_fallback: true,
        bf16_fast: false,
        sharding: true,
    };
    /// Activations dominate: the single-process rungs first.
    const S: Savings = Savings {
        activations: 1 << 30,
        optimizer_state: 8 << 20,
        gradients: 4 << 20,
        world: 2,
        gradients_during_backward: true,
    };

    fn next_rung(at: Footing, allowed: Allowed) -> Option<Rung> {
        super::next_rung(at, allowed, &S)
    }

    #[test]
    fn fused_loss_first_for_a_gpt_on_the_full_loss() {
        let full = Footing {
            checkpointing: Some(false),
            precision: Precision::Fp32,
            loss: Some(LossKind::Full),
            shard: None,
        };
        assert_eq!(next_rung(full, ALL), Some(Rung::FusedLoss));
        assert_eq!(
            next_rung(full, Allowed { bf16_fast: true, ..ALL }),
            Some(Rung::FusedLoss)
        );
        assert_eq!(
            next_rung(
                Footing {
                    loss: Some(LossKind::Fused),
                    ..full
                },
                ALL
            ),
            Some(Rung::ActivationCheckpointing)
        );
    }

    #[test]
    fn cheapest_first_then_none() {
        let fp32 = Footing {
            checkpointing: Some(false),
            precision: Precision::Fp32,
            loss: None,
            shard: None,
        };
        assert_eq!(next_rung(fp32, ALL), Some(Rung::ActivationCheckpointing));
        assert_eq!(
            next_rung(
                Footing {
                    checkpointing: Some(true),
                    ..fp32
                },
                ALL
            ),
            Some(Rung::Bf16)
        );
        assert_eq!(
            next_rung(
                Footing {
                    checkpointing: Some(true),
                    precision: Precision::Bf16,
                    loss: None,
                    shard: None
                },
                ALL
            ),
            None
        );
        // On a GPU with native bf16, bf16 is the cheaper rung.
        assert_eq!(next_rung(fp32, Allowed { bf16_fast: true, ..ALL }), Some(Rung::Bf16));
    }

    #[test]
    fn only_what_is_allowed_and_possible() {
        let fp32 = Footing {
            checkpointing: Some(false),
            precision: Precision::Fp32,
            loss: None,
            shard: None,
        };
        assert_eq!(
            next_rung(
                fp32,
                Allowed {
                    checkpointing: false,
                    ..ALL
                }
            ),
            Some(Rung::Bf16)
        );
        assert_eq!(
            next_rung(
                fp32,
                Allowed {
                    precision_fallback: false,
                    checkpointing: false,
                    ..ALL
                }
            ),
            None
        );
        // A model that cannot checkpoint (a TorchScript module): only precision.
        assert_eq!(
            next_rung(
                Footing {
                    checkpointing: None,
                    precision: Precision::Fp32,
                    loss: None,
                    shard: None
                },
                ALL
            ),
            Some(Rung::Bf16)
        );
        // fp16 already halves activations: no precision rung.
        assert_eq!(
            next_rung(
                Footing {
                    checkpointing: None,
                    precision: Precision::Fp16,
                    loss: None,
                    shard: None
                },
                ALL
            ),
            None
        );
    }

    #[test]
    fn sharding_when_the_state_is_what_does_not_fit() {
        // A large model at micro-batch 1: its state dwarfs one sample's activations.
        let big = Savings {
            activations: 16 << 20,
            optimizer_state: 2 << 30,
            gradients: 1 << 30,
            world: 2,
            gradients_during_backward: false,
        };
        let dp = Footing {
            checkpointing: Some(false),
            precision: Precision::Fp32,
            loss: None,
            shard: Some(Shard::None),
        };
        assert_eq!(super::next_rung(dp, ALL, &big), Some(Rung::ShardOptimizer));
        let s1 = Footing {
            shard: Some(Shard::Optimizer),
            ..dp
        };
        // Stage 2 reduced after backward saves nothing at the peak: never climbed, however
        // large the gradients; reduced during backward it is the next rung.
        assert_eq!(super::next_rung(s1, ALL, &big), Some(Rung::ActivationCheckpointing));
        let during = Savings {
            gradients_during_backward: true,
            ..big
        };
        assert_eq!(super::next_rung(s1, ALL, &during), Some(Rung::ShardGradients));
        assert_eq!(super::next_rung(dp, ALL, &during), Some(Rung::ShardOptimizer));
        let s2 = Footing {
            shard: Some(Shard::Gradients),
            ..dp
        };
        assert_eq!(super::next_rung(s2, ALL, &big), Some(Rung::ActivationCheckpointing));
        // Not allowed, or a single process: never.
        assert_eq!(
            super::next_rung(dp, Allowed { sharding: false, ..ALL }, &big),
            Some(Rung::ActivationCheckpointing)
        );
        assert_eq!(
            super::next_rung(Footing { shard: None, ..dp }, ALL, &big),
            Some(Rung::ActivationCheckpointing)
        );
        // Activations dominate: checkpointing saves more for its cost.
        assert_eq!(next_rung(dp, ALL), Some(Rung::ActivationCheckpointing));
    }

    #[test]
    fn sharding_comes_back_down_with_hysteresis_and_cooldown() {
        let b = Back {
            at: Shard::Gradients,
            configured: Shard::None,
            clean_steps: 20,
            failed_at: None,
            step: 100,
            peak_bytes: 600,
            limit_bytes: Some(1000),
            saved_bytes: 200,
        };
        assert_eq!(unshard(b, 20, 100, 0.1), Some(Shard::Optimizer));
        assert_eq!(
            unshard(
                Back {
                    at: Shard::Optimizer,
                    ..b
                },
                20,
                100,
                0.1
            ),
            Some(Shard::None)
        );
        assert_eq!(
            unshard(Back { clean_steps: 19, ..b }, 20, 100, 0.1),
            None,
            "not before grow_after clean steps"
        );
        assert_eq!(
            unshard(Back { saved_bytes: 301, ..b }, 20, 100, 0.1),
            None,
            "it would not leave the headroom"
        );
        assert_eq!(
            unshard(
                Back {
                    failed_at: Some(50),
                    ..b
                },
                20,
                100,
                0.1
            ),
            None,
            "the stage below is cooling down"
        );
        assert_eq!(
            unshard(
                Back {
                    failed_at: Some(0),
                    ..b
                },
                20,
                100,
                0.1
            ),
            Some(Shard::Optimizer)
        );
        assert_eq!(
            unshard(
                Back {
                    configured: Shard::Gradients,
                    ..b
                },
                20,
                100,
                0.1
            ),
            None,
            "never below the configured stage"
        );
        assert_eq!(
            unshard(Back { limit_bytes: None, ..b }, 20, 100, 0.1),
            None,
            "no limit known: stay"
        );
    }
}
