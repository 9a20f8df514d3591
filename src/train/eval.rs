//! Owns evaluation: the mean loss over fixed held-out batches, no grad.
//! Keeps: the same batches every time, and one device read per evaluation.
use tch::{Device, Kind, Tensor};

use super::step::split_range;
use crate::data::{eval_seed, sample_positions, Samples};
use crate::dist::{ProcessGroup, Topic};
use crate::error::{Error, Phase, Result};
use crate::guard::Guard;
use crate::precision::Amp;
use crate::task::Task;

/// What to evaluate on.
pub struct EvalSpec<'a> {
    pub samples: &'a dyn Samples,
    pub seed: u64,
    pub batch_size: usize,
    pub num_batches: usize,
    pub device: Device,
}

/// With data-parallel ranks (`pg`), each rank evaluates its shard of every batch; the ranks
/// agree (an OOM anywhere shrinks everyone's evaluation batch) and sum their parts.
pub fn evaluate(
    task: &dyn Task,
    spec: &EvalSpec,
    guard: &mut Guard,
    step: u64,
    amp: &Amp,
    pg: Option<&ProcessGroup>,
) -> Result<f64> {
    let _no_grad = tch::no_grad_guard();
    let _autocast = amp.autocast()?;
    let seed = eval_seed(spec.seed);
    let batch = spec.batch_size;
    let shard = pg.map_or(0..batch, |p| p.shard(batch));
    let in_eval = |e: Error| e.in_phase(Phase::Eval);
    // Masked targets (IGNORE_INDEX): a part weighs its valid units over the evaluation's
    // (times the batches, divided out at the end), so the loss is the mean over valid units.
    // Counted inside the guard (its allocations may fail like any other), once.
    let positions_of = |k: u64| sample_positions(seed, k, batch, spec.samples.num_positions());
    let count_valid = || -> Result<Option<usize>> {
        let mut all = Some(0);
        for k in 0..spec.num_batches as u64 {
            let v = spec.samples.valid_units(&positions_of(k)).map_err(in_eval)?;
            all = all.zip(v).map(|(a, b)| a + b);
        }
        Ok(all)
    };
    let weight_of = |valid_in_all: Option<usize>, positions: &[usize]| -> Result<Option<f64>> {
        Ok(match valid_in_all {
            None => Some(positions.len() as f64 / batch as f64),
            Some(all) => match spec.samples.valid_units(positions).map_err(in_eval)? {
                Some(v) if v > 0 => Some(v as f64 * spec.num_batches as f64 / all as f64),
                _ => None,
            },
        })
    };
    // Units the forward passes count (a data file's `loss_units`): each part's mean loss
    // weighs its units, counted once on the batch it is computed on; their sum over the
    // batches and ranks divides at the end.
    let counted = spec.samples.counted_in_forward();
    let mut units = 0usize;
    // The batches' weighted losses add up on the device; one read at the end.
    let mut total: Option<Tensor> = None;
    // The valid units of all batches, counted once.
    let mut valid_in_all: Option<Option<usize>> = None;
    for k in 0..spec.num_batches as u64 {
        let positions = positions_of(k);
        // Each attempt adds its batch to the total so far (a new tensor, inside the guard: an
        // OOM in the addition is retried like any other).
        let so_far = total.as_ref();
        let (batch_total, batch_units) = guard.run(
            step,
            &mut valid_in_all,
            |valid_in_all, mb| {
                let local = (|| {
                    let valid = match (*valid_in_all, counted) {
                        (_, true) => None,
                        (Some(v), false) => v,
                        (None, false) => *valid_in_all.insert(count_valid()?),
                    };
                    let mut sum: Option<Tensor> = None;
                    let mut here = 0usize;
                    crate::memory::snapshot::set_phase(Phase::Eval, None);
                    for part in split_range(shard.clone(), mb) {
                        let weight = match counted {
                            true => Some(1.0), // times the units, once the forward has counted them
                            false => weight_of(valid, &positions[part.clone()])?,
                        };
                        let Some(weight) = weight else {
                            continue; // every target ignored: nothing to average
                        };
                        let (x, y) = spec
                            .samples
                            .batch(&positions[part.clone()], spec.device)
                            .map_err(in_eval)?;
                        let weighted = (|| {
                            let loss = task.eval_loss(&x, &y)?.f_to_kind(Kind::Double)?;
                            let weight = match (counted, task.last_units().unwrap_or(0)) {
                                (false, _) => weight,
                                (true, 0) => return Ok(None), // no unit counts: its mean is undefined
                                (true, n) => {
                                    here += n;
                                    n as f64
                                }
                            };
                            let w = crate::ops::mul_scalar(&loss, weight)?;
                            sum.as_ref().map_or(Ok(w.shallow_clone()), |s| s.f_add(&w)).map(Some)
                        })();
                        if let Some(s) = weighted.map_err(|e| in_eval(e.into()))? {
                            sum = Some(s);
                        }
                    }
                    // An evaluation batch smaller than the ranks leaves some with no sample:
                    // they add nothing (a zero) and still take part in every agreement.
                    let sum = match sum {
                        Some(s) => s,
                        None => Tensor::f_zeros([], (Kind::Double, spec.device)).map_err(|e| in_eval(e.into()))?,
                    };
                    let total = so_far
                        .map_or(Ok(sum.shallow_clone()), |t| t.f_add(&sum))
                        .map_err(|e| in_eval(e.into()))?;
                    Ok((total, here))
                })();
                match pg {
                    Some(pg) => pg.agree(Topic::EvalAttempt, local),
                    None => local,
                }
            },
            |_| (),
        )?;
        total = Some(batch_total);
        units += batch_units;
    }
    let total = total
        .map_or(Ok(0.0), |t| crate::ops::read_one(&t))
        .map_err(|e| in_eval(e.into()))?;
    // Each rank's part of every batch, summed over the ranks once.
    let total = match pg {
        Some(pg) => pg.sum_f64(Topic::EvalLosses, total)?,
        None => total,
    };
    // No target scored anywhere (every one ignored, or no unit counted): no mean, NaN (null in
    // metrics.jsonl), never a 0 that retention and sweeps would keep as the best.
    let unscored = || {
        tracing::warn!(
            "evaluation after step {step}: its batches hold no target to score (every one ignored): val loss NaN"
        );
        Ok(f64::NAN)
    };
    if counted {
        let units = match pg {
            Some(pg) => pg.sum_f64(Topic::EvalUnits, units as f64)?,
            None => units as f64,
        };
        return if units > 0.0 { Ok(total / units) } else { unscored() };
    }
    if valid_in_all == Some(Some(0)) {
        return unscored();
    }
    Ok(total / spec.num_batches as f64)
}
