//! One optimizer step: this process's samples of the global batch split into micro-batches,
//! each micro-batch's loss weighted by its share of the global batch, then clipping and the
//! AdamW update. Only fallible tch calls: any failure, an OOM included, returns `Err`, and
//! the parameters are updated either exactly once or not at all.
use std::ops::Range;

use crate::data::StepBatches;
use crate::dist::{Buckets, ProcessGroup, Topic};
use crate::error::{Error, Phase, Result};
use crate::memory::snapshot;
use crate::optim::AdamW;
use crate::precision::{Amp, Scaler};
use crate::task::Task;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Mean loss over the global batch.
    pub loss: f64,
    pub grad_norm: f64,
    pub micro_batch_size: usize,
    pub num_micro_batches: usize,
    /// Samples the step trained on: always the global batch (over all ranks), whatever the
    /// split.
    pub num_samples: usize,
    /// fp16: the gradients held inf or nan, so the update was skipped (the scale backs off).
    pub skipped: bool,
    /// Data parallel: seconds spent in the ranks' agreements and the gradient all-reduce.
    pub comm_s: Option<f64>,
}

/// How a step updates: learning rate, clipping, precision.
#[derive(Clone, Copy)]
pub struct Update<'a> {
    pub lr: f64,
    pub grad_clip: f64,
    pub amp: Amp<'a>,
    pub scaler: Option<&'a Scaler>,
}

/// Splits `samples` into micro-batches of at most `micro` (the last may be smaller: 24 at 5
/// is 5+5+5+5+4). Together they cover the range exactly once.
pub fn split_range(samples: Range<usize>, micro: usize) -> Vec<Range<usize>> {
    assert!(micro >= 1, "micro-batch size must be at least 1");
    let ranges: Vec<Range<usize>> = samples.clone().step_by(micro).map(|s| s..(s + micro).min(samples.end)).collect();
    debug_assert_eq!(ranges.iter().map(|r| r.len()).sum::<usize>(), samples.len(), "global-batch invariant");
    ranges
}

/// `split_range(0..global, micro)`.
pub fn micro_batches(global: usize, micro: usize) -> Vec<Range<usize>> {
    split_range(0..global, micro)
}

/// Forward and backward over this process's samples: gradients accumulate, weighted so that
/// their sum over all micro-batches (and ranks) is the gradient of the global batch's mean
/// loss. Returns (the weighted loss sum, micro-batches run).
pub fn accumulate(task: &dyn Task, data: &dyn StepBatches, step: u64, micro_batch_size: usize, amp: &Amp) -> Result<(f64, usize)> {
    let global = data.global_batch_size();
    let parts = split_range(data.shard(), micro_batch_size);
    let mut loss_sum = 0.0;
    for (i, part) in parts.iter().enumerate() {
        let weight = part.len() as f64 / global as f64;
        let at = |phase: Phase| move |e: Error| e.in_phase(phase).at_micro_batch(i);
        snapshot::set_phase(Phase::Data, Some(i));
        let (x, y) = data.micro_batch(step, part.clone()).map_err(at(Phase::Data))?;
        snapshot::set_phase(Phase::Forward, None);
        // One call (a model may recompute in backward); it tags forward or backward.
        loss_sum += task.forward_backward(&x, &y, weight, amp).map_err(|e| e.at_micro_batch(i))?;
    }
    assert_eq!(parts.iter().map(|p| p.len()).sum::<usize>(), data.shard().len(), "global-batch invariant: every sample exactly once");
    Ok((loss_sum, parts.len()))
}

/// What `prepare_update` decided: apply (with the optimizer's allocations made and the
/// gradient norm), or skip (fp16 overflow).
pub struct Ready {
    grad_norm: f64,
    prepared: Option<crate::optim::Prepared>,
}

/// The allocating half of the update, which changes no parameter: unscaling (fp16; an
/// overflow means skip), clipping, the optimizer's allocations. Gradients are already
/// accumulated (and reduced across ranks).
pub fn prepare_update(opt: &mut AdamW, step: u64, u: &Update) -> Result<Ready> {
    let clip = |e: tch::TchError| Error::from(e).in_phase(Phase::Clip);
    snapshot::set_phase(Phase::Clip, None);
    if let Some(scaler) = u.scaler {
        if scaler.unscale(&opt.grads()).map_err(clip)? {
            return Ok(Ready { grad_norm: f64::INFINITY, prepared: None });
        }
    }
    let grad_norm = opt.clip_grad_norm(u.grad_clip).map_err(clip)?;
    snapshot::set_phase(Phase::Optimizer, None);
    let prepared = opt.prepare(step).map_err(|e| e.in_phase(Phase::Optimizer))?;
    Ok(Ready { grad_norm, prepared: Some(prepared) })
}

/// The half that changes things: the loss scale's update and the optimizer's commit, neither
/// of which allocates. Returns (gradient norm, skipped).
pub fn commit_update(opt: &mut AdamW, ready: Ready, u: &Update) -> Result<(f64, bool)> {
    if let Some(scaler) = u.scaler {
        scaler.update().map_err(|e| Error::from(e).in_phase(Phase::Optimizer))?;
    }
    let skipped = ready.prepared.is_none();
    if let Some(p) = ready.prepared {
        opt.commit(p, u.lr)?;
    }
    opt.clear_grads();
    Ok((ready.grad_norm, skipped))
}

/// `prepare_update` then `commit_update`: every allocation comes before anything changes,
/// so a retried attempt never applies (or counts) anything twice.
pub fn update(opt: &mut AdamW, step: u64, u: &Update) -> Result<(f64, bool)> {
    let ready = prepare_update(opt, step, u)?;
    commit_update(opt, ready, u)
}

/// A whole optimizer step in one process, with `u`'s precision.
pub fn step_with(task: &dyn Task, opt: &mut AdamW, data: &dyn StepBatches, step: u64, micro_batch_size: usize, u: &Update) -> Result<StepStats> {
    let (loss, num_micro_batches) = accumulate(task, data, step, micro_batch_size, &u.amp)?;
    let (grad_norm, skipped) = update(opt, step, u)?;
    Ok(StepStats { loss, grad_norm, micro_batch_size, num_micro_batches, num_samples: data.global_batch_size(), skipped, comm_s: None })
}

/// Gradients travel in buckets of this size (as PyTorch DDP's default).
const BUCKET_BYTES: usize = 25 << 20;

/// A data-parallel step: this rank's shard, then the ranks agree (any OOM anywhere drops
/// the attempt everywhere) before the bucketed gradient all-reduce; after the update's
/// allocations they agree again, then every rank commits.
pub fn dist_step(pg: &ProcessGroup, task: &dyn Task, opt: &mut AdamW, data: &dyn StepBatches, step: u64, micro_batch_size: usize, u: &Update) -> Result<StepStats> {
    let local = accumulate(task, data, step, micro_batch_size, &u.amp).and_then(|r| {
        opt.zero_missing_grads().map_err(|e| Error::from(e).in_phase(Phase::Backward))?;
        let grads = opt.grads();
        let buckets = Buckets::pack(&grads, BUCKET_BYTES).map_err(|e| Error::from(e).in_phase(Phase::Backward))?;
        Ok((r, grads, buckets))
    });
    let t = std::time::Instant::now();
    let ((loss, num_micro_batches), grads, buckets) = pg.agree(local)?;
    buckets.reduce_into(pg, &grads)?;
    drop(buckets);
    let loss = pg.sum_f64(Topic::Losses, loss)?;
    let mut comm_s = t.elapsed().as_secs_f64();
    let ready = prepare_update(opt, step, u);
    let t = std::time::Instant::now();
    let ready = pg.agree(ready)?;
    comm_s += t.elapsed().as_secs_f64();
    let (grad_norm, skipped) = commit_update(opt, ready, u)?;
    Ok(StepStats { loss, grad_norm, micro_batch_size, num_micro_batches, num_samples: data.global_batch_size(), skipped, comm_s: Some(comm_s) })
}

/// A whole fp32 optimizer step in one process.
pub fn train_step(task: &dyn Task, opt: &mut AdamW, data: &dyn StepBatches, step: u64, micro_batch_size: usize, lr: f64, grad_clip: f64) -> Result<StepStats> {
    let u = Update { lr, grad_clip, amp: Amp::fp32(tch::Device::Cpu), scaler: None };
    step_with(task, opt, data, step, micro_batch_size, &u)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_splits_cover_the_global_batch() {
        let r = micro_batches(24, 5);
        assert_eq!(r.iter().map(|r| r.len()).collect::<Vec<_>>(), vec![5, 5, 5, 5, 4]);
        assert_eq!(micro_batches(16, 16), vec![0..16]);
        assert_eq!(micro_batches(16, 1).len(), 16);
        assert_eq!(micro_batches(3, 8), vec![0..3]);
        assert_eq!(split_range(8..13, 2), vec![8..10, 10..12, 12..13]);
    }
}
