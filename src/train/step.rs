//! Owns one optimizer step: micro-batches weighted by their share, clipping and the update.
//! Keeps: the parameters are updated exactly once or not at all, and the host reads the device
//! once per step.
use std::ops::Range;
use tch::{Kind, Tensor};

use crate::data::StepBatches;
use crate::dist::{Buckets, ProcessGroup, Reducer, Topic};
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
    /// Data parallel: of those, seconds in the agreements (and the loss's sum), waiting for
    /// the slowest rank included.
    pub agree_s: Option<f64>,
    /// Data parallel: seconds in the optimizer's update (its allocations, the fused AdamW,
    /// ZeRO's all-gather of the parameters, waiting for the other ranks there included).
    pub update_s: Option<f64>,
    /// fp16: the loss scale after the step.
    pub loss_scale: Option<f64>,
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
    let ranges: Vec<Range<usize>> = samples
        .clone()
        .step_by(micro)
        .map(|s| s..(s + micro).min(samples.end))
        .collect();
    debug_assert_eq!(
        ranges.iter().map(|r| r.len()).sum::<usize>(),
        samples.len(),
        "global-batch invariant"
    );
    ranges
}

/// `split_range(0..global, micro)`.
pub fn micro_batches(global: usize, micro: usize) -> Vec<Range<usize>> {
    split_range(0..global, micro)
}

/// Loss units counted by the forward passes (`StepBatches::counted_in_forward`): this
/// rank's, and the total its micro-batches were weighted against before the real one was
/// known (the first counted micro-batch's units per sample, times the global batch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Counted {
    pub units: usize,
    pub assumed: f64,
}

impl Counted {
    /// What this rank's gradients and loss are multiplied by once the global batch's units
    /// (`total`) are known: each micro-batch then weighs its units / `total`.
    pub fn rescale(&self, total: f64) -> f64 {
        if total > 0.0 && self.assumed > 0.0 {
            self.assumed / total
        } else {
            0.0 // no unit anywhere (or none here): nothing was learned
        }
    }
}

/// What `accumulate` leaves: the weighted loss sum (an f64 scalar on the device), the
/// micro-batches run, and the units counted when the forward passes count them.
pub struct Accumulated {
    pub loss: Tensor,
    pub micro_batches: usize,
    pub counted: Option<Counted>,
}

/// Forward and backward over this process's samples: gradients accumulate, weighted so that
/// their sum over all micro-batches (and ranks) is the gradient of the global batch's mean
/// loss. Keeps: the gradient does not depend on the split.
/// - With masked targets (IGNORE_INDEX) a micro-batch's loss is the mean over its valid
///   units, so it weighs valid / the global batch's valid units (counted from the targets
///   alone, by every rank: no exchange); one with none runs no forward and adds nothing.
/// - With units the forward counts (a data file's `loss_units`) each micro-batch is built
///   and counted once, by its forward; it weighs units / an assumed total, and the caller
///   rescales by `Counted::rescale` once the ranks' units are summed. One with none runs
///   no backward.
pub fn accumulate(
    task: &dyn Task,
    data: &dyn StepBatches,
    step: u64,
    micro_batch_size: usize,
    amp: &Amp,
) -> Result<Accumulated> {
    accumulate_with(task, data, step, micro_batch_size, amp, &mut || Ok(()))
}

/// `accumulate`, calling `before_last` just before the last micro-batch (an error from it
/// ends the accumulation).
pub fn accumulate_with(
    task: &dyn Task,
    data: &dyn StepBatches,
    step: u64,
    micro_batch_size: usize,
    amp: &Amp,
    before_last: &mut dyn FnMut() -> Result<()>,
) -> Result<Accumulated> {
    let global = data.global_batch_size();
    let parts = split_range(data.shard(), micro_batch_size);
    snapshot::set_phase(Phase::Data, None);
    let data_err = |e: Error| e.in_phase(Phase::Data);
    let mut counted = data.counted_in_forward().then_some(Counted { units: 0, assumed: 0.0 });
    let valid_in_batch = match counted {
        Some(_) => None,
        None => data.valid_units(step, 0..global).map_err(data_err)?,
    };
    let mut loss_sum: Option<Tensor> = None;
    for (i, part) in parts.iter().enumerate() {
        if i + 1 == parts.len() {
            before_last()?;
        }
        let weight = match valid_in_batch {
            None => part.len() as f64 / global as f64,
            Some(total) => match data.valid_units(step, part.clone()).map_err(data_err)? {
                Some(valid) if valid > 0 => valid as f64 / total as f64,
                _ => continue,
            },
        };
        let at = |phase: Phase| move |e: Error| e.in_phase(phase).at_micro_batch(i);
        snapshot::set_phase(Phase::Data, Some(i));
        let (x, y) = data.micro_batch(step, part.clone()).map_err(at(Phase::Data))?;
        snapshot::set_phase(Phase::Forward, None);
        // One call (a model may recompute in backward); it tags forward or backward.
        let loss = match counted.as_mut() {
            None => task.forward_backward(&x, &y, weight, amp),
            Some(c) => {
                let rows = part.len() as f64;
                let mut weigh = |units: usize| {
                    c.units += units;
                    if units == 0 {
                        return None;
                    }
                    if c.assumed == 0.0 {
                        c.assumed = units as f64 / rows * global as f64;
                    }
                    Some(units as f64 / c.assumed)
                };
                match task.forward_backward_counted(&x, &y, amp, &mut weigh) {
                    Ok(Some(loss)) => Ok(loss),
                    Ok(None) => continue,
                    Err(e) => Err(e),
                }
            }
        }
        .map_err(|e| e.at_micro_batch(i))?;
        let add = || {
            loss_sum.as_ref().map_or_else(
                || loss.f_to_kind(Kind::Double),
                |s| s.f_add(&loss.f_to_kind(Kind::Double)?),
            )
        };
        loss_sum = Some(add().map_err(|e| at(Phase::Backward)(e.into()))?);
    }
    assert_eq!(
        parts.iter().map(|p| p.len()).sum::<usize>(),
        data.shard().len(),
        "global-batch invariant: every sample exactly once"
    );
    let loss_sum = match loss_sum {
        Some(l) => l,
        // Every target of this shard is ignored: nothing to learn from it.
        None => Tensor::f_zeros([], (Kind::Double, amp.device)).map_err(|e| data_err(e.into()))?,
    };
    Ok(Accumulated {
        loss: loss_sum,
        micro_batches: parts.len(),
        counted,
    })
}

/// Multiplies `grads` and `loss` in place by `s` (the counted units' rescale); allocates
/// nothing.
fn rescale(grads: &[Tensor], loss: &Tensor, s: f64) -> Result<()> {
    let _no_grad = tch::no_grad_guard();
    for g in grads.iter().chain([loss]) {
        crate::ops::mul_scalar_(g, s).map_err(|e| Error::from(e).in_phase(Phase::Backward))?;
    }
    Ok(())
}

/// The optimizer's allocations made, and the step's read-out: `[loss, gradient norm,
/// found_inf, loss scale]` as f64 on the device, allocated here so that the commit
/// allocates nothing.
pub struct Ready {
    prepared: crate::optim::Prepared,
    readout: Tensor,
}

/// What the step's one read brought back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub loss: f64,
    /// Before clipping; infinite on a skipped step.
    pub grad_norm: f64,
    /// fp16: the gradients held inf or nan, and the update was skipped.
    pub skipped: bool,
    pub loss_scale: Option<f64>,
}

/// The allocating half of the update, which changes no parameter: unscaling (fp16: the
/// overflow flag stays on the device), clipping, the optimizer's allocations and the
/// read-out holding `loss` (the step's loss sum, on the device). Gradients are already
/// accumulated (and reduced across ranks).
pub fn prepare_update(opt: &mut AdamW, step: u64, u: &Update, loss: &Tensor) -> Result<Ready> {
    let clip = |e: Error| e.in_phase(Phase::Clip);
    snapshot::set_phase(Phase::Clip, None);
    let found_inf = match u.scaler {
        Some(scaler) => {
            scaler.unscale(&opt.grads()).map_err(|e| clip(e.into()))?;
            Some(scaler.found_inf())
        }
        None => None,
    };
    let grad_norm = opt.clip_grad_norm(u.grad_clip).map_err(clip)?;
    snapshot::set_phase(Phase::Optimizer, None);
    let prepared = opt.prepare(step, found_inf).map_err(|e| e.in_phase(Phase::Optimizer))?;
    let readout = (|| {
        let f64_of = |t: &Tensor| t.f_to_kind(Kind::Double)?.f_view([1]);
        let zero = loss.f_zeros_like()?.f_to_kind(Kind::Double)?.f_view([1])?;
        let inf = found_inf.map(f64_of).transpose()?.unwrap_or(zero.shallow_clone());
        Tensor::f_cat(&[f64_of(loss)?, f64_of(&grad_norm)?, inf, zero], 0)
    })()
    .map_err(|e| Error::from(e).in_phase(Phase::Optimizer))?;
    Ok(Ready { prepared, readout })
}

/// The half that changes things: the loss scale's update and the optimizer's commit
/// (skipped on the device if fp16 overflowed), neither of which allocates; then the step's
/// one read.
pub fn commit_update(opt: &mut AdamW, ready: Ready, u: &Update) -> Result<Outcome> {
    let Ready { prepared, readout } = ready;
    let optimizer = |e: tch::TchError| Error::from(e).in_phase(Phase::Optimizer);
    // Stage 2: the ranks' norm and overflow flag, summed from their shards, into the read-out.
    if let Some(norm) = opt.shard_stats(u.scaler.map(|s| s.found_inf()))? {
        readout
            .f_select(0, 1)
            .and_then(|slot| slot.shallow_clone().f_copy_(&norm))
            .map_err(optimizer)?;
        if let Some(s) = u.scaler {
            readout
                .f_select(0, 2)
                .and_then(|slot| slot.shallow_clone().f_copy_(s.found_inf()))
                .map_err(optimizer)?;
        }
    }
    if let Some(scaler) = u.scaler {
        scaler.update().map_err(optimizer)?;
        readout
            .f_select(0, 3)
            .and_then(|slot| slot.shallow_clone().f_copy_(&scaler.scale))
            .map_err(optimizer)?;
    }
    opt.commit(prepared, u.lr)?;
    opt.clear_grads();
    let v = crate::ops::read(&readout).map_err(optimizer)?;
    let skipped = v[2] > 0.0;
    Ok(Outcome {
        loss: v[0],
        grad_norm: if skipped { f64::INFINITY } else { v[1] },
        skipped,
        loss_scale: u.scaler.map(|_| v[3]),
    })
}

/// `prepare_update` then `commit_update` with no loss to report: every allocation comes
/// before anything changes, so a retried attempt never applies (or counts) anything twice.
/// Returns (gradient norm, skipped).
pub fn update(opt: &mut AdamW, step: u64, u: &Update) -> Result<(f64, bool)> {
    let zero = Tensor::f_zeros([], (Kind::Double, u.amp.device)).map_err(Error::from)?;
    let ready = prepare_update(opt, step, u, &zero)?;
    let out = commit_update(opt, ready, u)?;
    Ok((out.grad_norm, out.skipped))
}

/// A whole optimizer step in one process, with `u`'s precision.
pub fn step_with(
    task: &dyn Task,
    opt: &mut AdamW,
    data: &dyn StepBatches,
    step: u64,
    micro_batch_size: usize,
    u: &Update,
) -> Result<StepStats> {
    let Accumulated {
        loss,
        micro_batches: num_micro_batches,
        counted,
    } = accumulate(task, data, step, micro_batch_size, &u.amp)?;
    if let Some(c) = counted {
        rescale(&opt.param_grads(), &loss, c.rescale(c.units as f64))?;
    }
    let ready = prepare_update(opt, step, u, &loss)?;
    let out = commit_update(opt, ready, u)?;
    Ok(StepStats {
        loss: out.loss,
        grad_norm: out.grad_norm,
        micro_batch_size,
        num_micro_batches,
        num_samples: data.global_batch_size(),
        skipped: out.skipped,
        comm_s: None,
        agree_s: None,
        update_s: None,
        loss_scale: out.loss_scale,
    })
}

/// A data-parallel step: this rank's shard, then its gradients summed over the ranks, then
/// after the update's allocations the ranks agree again and every rank commits. Any OOM
/// anywhere drops the attempt everywhere, before anything is committed.
/// - Overlapped (`reducer`, when it runs at this stage and the step can be: no loss units counted in the
///   forward, a model whose backward is one pass): the ranks agree before the last
///   micro-batch, whose backward starts each bucket's all-reduce as its gradients complete.
/// - Otherwise the ranks agree after backward, then the all-reduce of buckets of at most
///   `bucket_bytes` (or ZeRO-2's reduce-scatter) runs.
#[allow(clippy::too_many_arguments)]
pub fn dist_step(
    pg: &ProcessGroup,
    reducer: Option<&Reducer>,
    bucket_bytes: usize,
    task: &dyn Task,
    opt: &mut AdamW,
    data: &dyn StepBatches,
    step: u64,
    micro_batch_size: usize,
    u: &Update,
) -> Result<StepStats> {
    let overlap =
        reducer.filter(|r| r.runs_under(opt.shard()) && !data.counted_in_forward() && task.backward_is_one_pass());
    let mut t = Times::default();
    let work = Work {
        task,
        data,
        step,
        micro_batch_size,
        u,
    };
    let acc = match overlap {
        Some(r) => overlapped(pg, r, opt, work, &mut t)?,
        None => reduced_after(pg, opt, work, bucket_bytes, &mut t)?,
    };
    let ready = timed(&mut t.update, || prepare_update(opt, step, u, &acc.loss));
    // ZeRO's all-gather goes in the chunks every rank can take: the least (as -x under MAX).
    let mut chunk = [ready
        .as_ref()
        .ok()
        .and_then(|r| r.prepared.gather_chunk())
        .map_or(f64::NEG_INFINITY, |c| -(c as f64))];
    let mut ready = timed(&mut t.agree, || pg.agree_with(Topic::UpdateReady, ready, &mut chunk))?;
    if chunk[0].is_finite() {
        ready.prepared.agree_gather(-chunk[0] as i64);
    }
    if let Some((chunks, elems)) = ready.prepared.gathers_through_grads().filter(|_| pg.rank == 0) {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::info!(
                "sharding: the all-gather goes through the spent gradients' storages, no buffers of its own: {chunks} chunks of {elems} elements a rank"
            )
        });
    }
    let out = timed(&mut t.update, || commit_update(opt, ready, u))?;
    committed_pause(pg.rank, step);
    // This rank's loss came back with the read-out; the global batch's is their sum.
    let loss = timed(&mut t.agree, || pg.sum_f64(Topic::Losses, out.loss))?;
    if let Some(r) = reducer {
        r.settle(pg)?;
    }
    Ok(StepStats {
        loss,
        grad_norm: out.grad_norm,
        micro_batch_size,
        num_micro_batches: acc.micro_batches,
        num_samples: data.global_batch_size(),
        skipped: out.skipped,
        comm_s: Some(t.agree + t.reduce),
        agree_s: Some(t.agree),
        update_s: Some(t.update),
        loss_scale: out.loss_scale,
    })
}

/// What one attempt of a data-parallel step trains: the model, its batches and settings.
#[derive(Clone, Copy)]
struct Work<'a> {
    task: &'a dyn Task,
    data: &'a dyn StepBatches,
    step: u64,
    micro_batch_size: usize,
    u: &'a Update<'a>,
}

impl Work<'_> {
    /// Its micro-batches' forward and backward (`before_last`: as `accumulate_with`).
    fn accumulate(&self, before_last: &mut dyn FnMut() -> Result<()>) -> Result<Accumulated> {
        accumulate_with(
            self.task,
            self.data,
            self.step,
            self.micro_batch_size,
            &self.u.amp,
            before_last,
        )
    }
}

/// Seconds of a data-parallel step in the ranks' agreements, waiting for the gradients'
/// reduction (its exposed part, when overlapped), and in the optimizer's update.
#[derive(Default)]
struct Times {
    agree: f64,
    reduce: f64,
    update: f64,
}

/// Backward, then the agreement, then the reduction.
fn reduced_after(
    pg: &ProcessGroup,
    opt: &mut AdamW,
    w: Work,
    bucket_bytes: usize,
    t: &mut Times,
) -> Result<Accumulated> {
    let local = w.accumulate(&mut || Ok(())).and_then(|r| {
        let backward = |e: tch::TchError| Error::from(e).in_phase(Phase::Backward);
        opt.zero_missing_grads().map_err(backward)?;
        // Stage 2 reduce-scatters into this rank's shard where that frees memory; otherwise
        // every gradient is summed.
        let params = opt.params();
        let sizes = params.iter().map(|p| p.numel() * p.kind().elt_size_in_bytes());
        let scatter = match crate::dist::overlap::shards_gradients(sizes, bucket_bytes) {
            true => opt.scatter_buffers().map_err(backward)?,
            false => None,
        };
        let reduce = match scatter {
            Some(bufs) => Reduce::Scatter(bufs),
            None => {
                let buckets = Buckets::pack(&params, bucket_bytes).map_err(backward)?;
                Reduce::All(buckets)
            }
        };
        Ok((r, reduce))
    });
    let (acc, reduce) = timed(&mut t.agree, || pg.agree(Topic::Agreement, local))?;
    if let Some(c) = acc.counted {
        // The global batch's units, summed over the ranks' forward passes; each rank's
        // gradients (packed or not yet) take its own rescale before they are summed.
        let total = timed(&mut t.agree, || pg.sum_f64(Topic::LossUnits, c.units as f64))?;
        let s = c.rescale(total);
        match &reduce {
            Reduce::All(buckets) => rescale(buckets.parts(), &acc.loss, s)?,
            Reduce::Scatter(_) => rescale(&opt.param_grads(), &acc.loss, s)?,
        }
    }
    timed(&mut t.reduce, || match reduce {
        Reduce::All(buckets) => buckets.reduce(pg),
        Reduce::Scatter(bufs) => opt.reduce_scatter_grads(bufs),
    })?;
    Ok(acc)
}

/// The overlapped reduction. Every rank votes once before its last micro-batch (a rank that
/// failed earlier votes its failure there): a failure then drops the attempt everywhere
/// before any gradient leaves. Past it, a rank whose last micro-batch fails still starts
/// every bucket (garbage) and waits for them, and the agreement after backward drops the
/// attempt everywhere: no collective is left unmatched, none is started twice.
fn overlapped(pg: &ProcessGroup, r: &Reducer, opt: &mut AdamW, w: Work, t: &mut Times) -> Result<Accumulated> {
    // ZeRO-2: where each bucket's sum goes.
    let target = opt.scatter_target();
    let arm = |agree_s: &mut f64, local: Result<()>| {
        let armed = local.and_then(|()| r.arm(target.as_deref()));
        let armed = timed(agree_s, || pg.agree(Topic::Armed, armed));
        if armed.is_err() {
            r.disarm();
        }
        armed
    };
    let (mut voted, mut armed) = (false, false);
    let local = w.accumulate(&mut || {
        voted = true;
        arm(&mut t.agree, Ok(()))?;
        armed = true;
        Ok(())
    });
    let local = match (voted, local) {
        // Failed before the last micro-batch, or had none: this rank's vote.
        (false, Ok(acc)) => arm(&mut t.agree, Ok(())).map(|()| acc),
        (false, Err(e)) => {
            return arm(&mut t.agree, Err(e)).and_then(|()| Err(Error::Dist("a failure agreed as none".into())))
        }
        // The agreement before the last micro-batch failed: every rank has that outcome.
        (true, Err(e)) if !armed => return Err(e),
        (true, local) => local,
    };
    // A parameter backward did not reach gets zeros there (its bucket's), not here: under
    // ZeRO-2 the gradients already summed are gone.
    let local = match r.launch_rest(local.is_err())? {
        (_, Some(oom)) if local.is_ok() => Err(oom),
        (true, _) if local.is_ok() => Err(Error::Torch(tch::TchError::Torch(format!(
            "{}: a gradient was accumulated twice in one micro-batch's backward, so the overlapped \
             reduction sent it before it was whole; this model's backward_is_one_pass must say false",
            w.task.describe()
        )))),
        _ => local,
    };
    let agreed = timed(&mut t.agree, || pg.agree(Topic::Agreement, local));
    let pieces = target.as_ref().map_or(0, Vec::len);
    if let Some(shard) = timed(&mut t.reduce, || r.wait(agreed.is_ok(), pieces))? {
        opt.take_scattered(shard)?;
    }
    if agreed.is_err() {
        timed(&mut t.reduce, || r.restore_trashed(pg, &opt.params()))?;
    }
    agreed
}

/// Test hook `OOMGUARD_TEST_COMMIT_PAUSE_MS=RANK:STEP:MS`: rank RANK sleeps MS right after
/// committing step STEP, before the collectives that follow (tests kill it there).
fn committed_pause(rank: usize, step: u64) {
    crate::pause_at(test_hook!("OOMGUARD_TEST_COMMIT_PAUSE_MS"), rank, step);
}

/// How a data-parallel step sums its gradients.
enum Reduce {
    All(Buckets),
    Scatter((crate::optim::zero::Buffers, Tensor)),
}

/// Runs `f`, adding the seconds it took to `acc`.
fn timed<T>(acc: &mut f64, f: impl FnOnce() -> T) -> T {
    let t = std::time::Instant::now();
    let out = f();
    *acc += t.elapsed().as_secs_f64();
    out
}

/// A whole fp32 optimizer step in one process.
pub fn train_step(
    task: &dyn Task,
    opt: &mut AdamW,
    data: &dyn StepBatches,
    step: u64,
    micro_batch_size: usize,
    lr: f64,
    grad_clip: f64,
) -> Result<StepStats> {
    let u = Update {
        lr,
        grad_clip,
        amp: Amp::fp32(tch::Device::Cpu),
        scaler: None,
    };
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
