//! Evaluation: the mean loss over fixed held-out batches (the same ones every time), no
//! grad, each batch split by the evaluation guard's current size.
use tch::Device;

use super::step::split_range;
use crate::dist::{ProcessGroup, Topic};
use crate::data::{eval_seed, sample_positions, Samples};
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
pub fn evaluate(task: &dyn Task, spec: &EvalSpec, guard: &mut Guard, step: u64, amp: &Amp, pg: Option<&ProcessGroup>) -> Result<f64> {
    let _no_grad = tch::no_grad_guard();
    let _autocast = amp.autocast()?;
    let seed = eval_seed(spec.seed);
    let batch = spec.batch_size;
    let shard = pg.map_or(0..batch, |p| p.shard(batch));
    let mut total = 0.0;
    for k in 0..spec.num_batches as u64 {
        let positions = sample_positions(seed, k, batch, spec.samples.num_positions());
        total += guard.run(
            step,
            &mut (),
            |_, mb| {
                let local = (|| {
                    let mut sum = 0.0;
                    crate::memory::snapshot::set_phase(Phase::Eval, None);
                    for part in split_range(shard.clone(), mb) {
                        let in_eval = |e: Error| e.in_phase(Phase::Eval);
                        let (x, y) = spec.samples.batch(&positions[part.clone()], spec.device).map_err(in_eval)?;
                        let loss = task.eval_loss(&x, &y).map_err(|e| in_eval(e.into()))?;
                        sum += loss.f_double_value(&[]).map_err(|e| in_eval(e.into()))? * part.len() as f64 / batch as f64;
                    }
                    Ok(sum)
                })();
                let Some(pg) = pg else { return local };
                let sum = pg.agree(local)?;
                pg.sum_f64(Topic::EvalLosses, sum)
            },
            |_| (),
        )?;
    }
    Ok(total / spec.num_batches as f64)
}
