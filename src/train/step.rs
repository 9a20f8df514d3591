//! One optimizer step: the global batch split into micro-batches, each micro-batch's loss
//! weighted by its share of the global batch, then clipping and the AdamW update. Only
//! fallible tch calls: any failure, an OOM included, returns `Err` with nothing applied.
use std::ops::Range;

use super::{StepBatches, TrainModel};
use crate::error::{Error, Phase, Result};
use crate::optim::AdamW;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Mean loss over the global batch.
    pub loss: f64,
    pub grad_norm: f64,
    pub micro_batch_size: usize,
    pub num_micro_batches: usize,
    /// Samples the step trained on: always the global batch, whatever the split.
    pub num_samples: usize,
}

/// Splits `global` samples into micro-batches of at most `micro` (the last may be smaller:
/// 24 at 5 is 5+5+5+5+4). Together they cover `0..global` exactly once.
pub fn micro_batches(global: usize, micro: usize) -> Vec<Range<usize>> {
    assert!(micro >= 1, "micro-batch size must be at least 1");
    let ranges: Vec<Range<usize>> = (0..global).step_by(micro).map(|s| s..(s + micro).min(global)).collect();
    debug_assert_eq!(ranges.iter().map(|r| r.len()).sum::<usize>(), global, "global-batch invariant");
    ranges
}

pub fn train_step(
    model: &impl TrainModel,
    opt: &mut AdamW,
    data: &impl StepBatches,
    step: u64,
    micro_batch_size: usize,
    lr: f64,
    grad_clip: f64,
) -> Result<StepStats> {
    let global = data.global_batch_size();
    let parts = micro_batches(global, micro_batch_size);
    let (mut loss_sum, mut num_samples) = (0.0, 0);
    for part in &parts {
        let weight = part.len() as f64 / global as f64;
        let (x, y) = data.micro_batch(step, part.clone()).map_err(|e| e.in_phase(Phase::Data))?;
        let loss = model.loss(&x, &y, true).and_then(|l| l.f_mul_scalar(weight)).map_err(|e| Error::from(e).in_phase(Phase::Forward))?;
        loss.f_backward().map_err(|e| Error::from(e).in_phase(Phase::Backward))?;
        loss_sum += loss.f_double_value(&[])?;
        num_samples += part.len();
    }
    assert_eq!(num_samples, global, "global-batch invariant: every sample exactly once");
    let in_opt = |e: tch::TchError| Error::from(e).in_phase(Phase::Optimizer);
    let grad_norm = opt.clip_grad_norm(grad_clip).map_err(in_opt)?;
    opt.step(lr).map_err(in_opt)?;
    opt.clear_grads();
    Ok(StepStats { loss: loss_sum, grad_norm, micro_batch_size, num_micro_batches: parts.len(), num_samples })
}

#[cfg(test)]
mod tests {
    use super::micro_batches;

    #[test]
    fn uneven_splits_cover_the_global_batch() {
        let r = micro_batches(24, 5);
        assert_eq!(r.iter().map(|r| r.len()).collect::<Vec<_>>(), vec![5, 5, 5, 5, 4]);
        assert_eq!(micro_batches(16, 16), vec![0..16]);
        assert_eq!(micro_batches(16, 1).len(), 16);
        assert_eq!(micro_batches(3, 8), vec![0..3]);
    }
}
