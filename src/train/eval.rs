//! Evaluation: the mean loss over fixed held-out batches (the same ones every time), no
//! grad, each batch split by the evaluation guard's current size; one read back from the
//! device per evaluation.
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
    // The batches' weighted losses add up on the device; one read at the end.
    let mut total: Option<Tensor> = None;
    for k in 0..spec.num_batches as u64 {
        let positions = sample_positions(seed, k, batch, spec.samples.num_positions());
        // Each attempt adds its batch to the total so far (a new tensor, inside the guard: an
        // OOM in the addition is retried like any other).
        let so_far = total.as_ref();
        total = Some(guard.run(
            step,
            &mut (),
            |_, mb| {
                let local = (|| {
                    let mut sum: Option<Tensor> = None;
                    crate::memory::snapshot::set_phase(Phase::Eval, None);
                    for part in split_range(shard.clone(), mb) {
                        let (x, y) = spec
                            .samples
                            .batch(&positions[part.clone()], spec.device)
                            .map_err(in_eval)?;
                        let weighted = (|| {
                            let loss = task.eval_loss(&x, &y)?.f_to_kind(Kind::Double)?;
                            let w = crate::ops::mul_scalar(&loss, part.len() as f64 / batch as f64)?;
                            sum.as_ref().map_or(Ok(w.shallow_clone()), |s| s.f_add(&w))
                        })();
                        sum = Some(weighted.map_err(|e| in_eval(e.into()))?);
                    }
                    // An evaluation batch smaller than the ranks leaves some with no sample:
                    // they add nothing (a zero) and still take part in every agreement.
                    let sum = match sum {
                        Some(s) => s,
                        None => Tensor::f_zeros([], (Kind::Double, spec.device)).map_err(|e| in_eval(e.into()))?,
                    };
                    so_far
                        .map_or(Ok(sum.shallow_clone()), |t| t.f_add(&sum))
                        .map_err(|e| in_eval(e.into()))
                })();
                match pg {
                    Some(pg) => pg.agree(Topic::EvalAttempt, local),
                    None => local,
                }
            },
            |_| (),
        )?);
    }
    let total = total
        .map_or(Ok(0.0), |t| crate::ops::read_one(&t))
        .map_err(|e| in_eval(e.into()))?;
    // Each rank's part of every batch, summed over the ranks once.
    let total = match pg {
        Some(pg) => pg.sum_f64(Topic::EvalLosses, total)?,
        None => total,
    };
    Ok(total / spec.num_batches as f64)
}
