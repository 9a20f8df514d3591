//! The training loop: reads top to bottom.
use std::path::Path;
use std::time::Instant;
use tch::{nn::VarStore, Device, Tensor};

use super::{micro_batches, train_step, StepBatches, TrainModel};
use crate::config::Config;
use crate::data::{sample_offsets, splitmix64, Dataset, Split};
use crate::error::{Error, Phase, Result};
use crate::guard::Guard;
use crate::memory::{self, allocator, human_bytes, PressureSchedule};
use crate::metrics::{EvalRecord, MetricsWriter, Record, StepRecord};
use crate::model::{no_weight_decay, Gpt};
use crate::optim::AdamW;

/// What a finished run reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub steps: u64,
    pub first_loss: f64,
    pub final_loss: f64,
    pub val_loss: Option<f64>,
    pub wall_s: f64,
    /// Training throughput, evaluation time excluded.
    pub tokens_per_s: f64,
    pub peak_bytes: u64,
    pub num_ooms: u64,
    pub final_micro_batch_size: usize,
}

/// A GPT's samples: `sample_offsets(seed, step)` into a split, cut into micro-batches.
pub struct GptBatches<'a> {
    pub split: &'a Split,
    pub seed: u64,
    pub global_batch: usize,
    pub block: usize,
    pub vocab: i64,
    pub device: Device,
}

impl StepBatches for GptBatches<'_> {
    fn global_batch_size(&self) -> usize {
        self.global_batch
    }
    fn tokens_per_sample(&self) -> usize {
        self.block
    }
    fn micro_batch(&self, step: u64, samples: std::ops::Range<usize>) -> Result<(Tensor, Tensor)> {
        let offsets = sample_offsets(self.seed, step, self.global_batch, self.split.num_tokens(), self.block);
        self.split.batch(&offsets[samples], self.block, self.vocab, self.device)
    }
}

/// Trains the config's GPT, writing metrics into `run_dir`. Memory must be prepared with
/// `settings` (the allocator settings in force) before anything is allocated.
pub fn train(cfg: &Config, run_dir: &Path, settings: &allocator::AllocatorSettings) -> Result<Summary> {
    let c = &cfg.raw;
    let device = c.train.device();
    memory::prepare(&c.memory, settings, device)?;
    if let Some(n) = c.train.num_threads {
        tch::set_num_threads(n as i32);
    }
    tch::manual_seed(c.train.seed as i64);
    let block = c.model.block_size as usize;
    let data = Dataset::open(&c.data, cfg.path.parent().unwrap_or(Path::new(".")), block)?;
    let vs = VarStore::new(device);
    let model = Gpt::new(&vs.root(), &c.model)?;
    let mut opt = AdamW::new(&vs, &c.optim, no_weight_decay)?;
    let mut metrics = MetricsWriter::open(run_dir)?;
    let global = c.train.global_batch_size();
    let batches = GptBatches { split: &data.train, seed: c.train.seed, global_batch: global, block, vocab: c.model.vocab_size, device };
    let mut guard = Guard::new(&c.memory, c.train.micro_batch_size, device);
    let mut eval_guard = Guard::for_eval(&c.memory, c.train.eval_batch_size, device);
    let mut pressure = PressureSchedule::new(&c.memory.pressure, device);
    tracing::info!(
        "training {:.2}M parameters on {device:?} ({} threads): global batch {global} = {} x {}, {} steps",
        c.model.num_params() as f64 / 1e6, tch::get_num_threads(), c.train.micro_batch_size, c.train.grad_accum_steps, c.train.max_steps
    );

    let start = Instant::now();
    let mut s = Summary { steps: c.train.max_steps, first_loss: f64::NAN, final_loss: f64::NAN, val_loss: None, wall_s: 0.0, tokens_per_s: 0.0, peak_bytes: 0, num_ooms: 0, final_micro_batch_size: 0 };
    let mut eval_s = 0.0;
    for step in 0..c.train.max_steps {
        pressure.update(step);
        let lr = c.optim.lr_at(step, c.train.max_steps);
        let t0 = Instant::now();
        let result = guard.run(step, &mut opt, |opt, mb| train_step(&model, opt, &batches, step, mb, lr, c.optim.grad_clip), |opt| opt.clear_grads());
        write_events(&mut metrics, &mut guard)?;
        let stats = result.inspect_err(|e| save_on_infeasible(e, &vs, run_dir))?;
        let dt = t0.elapsed().as_secs_f64();
        let mem = memory::stats(device);
        let mb = stats.micro_batch_size;
        let rec = StepRecord {
            step, loss: stats.loss, lr, grad_norm: stats.grad_norm, tokens_per_s: (global * block) as f64 / dt,
            micro_batch_size: mb, grad_accum_steps: stats.num_micro_batches, num_samples: stats.num_samples, step_time_s: dt, elapsed_s: start.elapsed().as_secs_f64(), memory: mem,
        };
        if step % c.log.every == 0 || step + 1 == c.train.max_steps {
            tracing::info!(
                "step {:>5}/{} | loss {:.4} | lr {:.2e} | {:>7.0} tok/s | mb {}x{} | mem {} (peak {})",
                step + 1, c.train.max_steps, rec.loss, lr, rec.tokens_per_s, mb, rec.grad_accum_steps, human_bytes(mem.live_bytes), human_bytes(mem.peak_bytes)
            );
        }
        metrics.write(&Record::Step(rec))?;
        (s.first_loss, s.final_loss, s.peak_bytes) = (if step == 0 { stats.loss } else { s.first_loss }, stats.loss, s.peak_bytes.max(mem.peak_bytes));
        if step + 1 == c.train.max_steps || (c.train.eval_every > 0 && (step + 1) % c.train.eval_every == 0) {
            let t_eval = Instant::now();
            let ev = evaluate(&model, &data.val, c.train.seed, c.train.eval_batch_size, c.train.eval_batches, &batches, &mut eval_guard, step);
            write_events(&mut metrics, &mut eval_guard)?;
            let v = ev.inspect_err(|e| save_on_infeasible(e, &vs, run_dir))?;
            tracing::info!("eval  {:>5} | val loss {v:.4}", step + 1);
            metrics.write(&Record::Eval(EvalRecord { step, val_loss: v, eval_batch_size: c.train.eval_batch_size }))?;
            s.val_loss = Some(v);
            eval_s += t_eval.elapsed().as_secs_f64();
        }
    }
    s.wall_s = start.elapsed().as_secs_f64();
    s.tokens_per_s = (c.train.max_steps as usize * global * block) as f64 / (s.wall_s - eval_s);
    s.num_ooms = guard.policy.num_ooms + eval_guard.policy.num_ooms;
    s.final_micro_batch_size = guard.micro_batch_size();
    save_weights(&vs, run_dir)?;
    Ok(s)
}

fn write_events(metrics: &mut MetricsWriter, guard: &mut Guard) -> Result<()> {
    guard.drain_events().into_iter().try_for_each(|e| metrics.write(&Record::from(e)))
}

fn save_weights(vs: &VarStore, run_dir: &Path) -> Result<()> {
    let path = run_dir.join("model.safetensors");
    vs.save(&path).map_err(|e| Error::io(format!("cannot write {}", path.display()), std::io::Error::other(e.to_string())))
}

/// Before exiting with code 3, keep the weights trained so far.
fn save_on_infeasible(e: &Error, vs: &VarStore, run_dir: &Path) {
    if matches!(e, Error::Infeasible(_)) {
        match save_weights(vs, run_dir) {
            Ok(()) => tracing::info!("saved the weights trained so far to {}", run_dir.join("model.safetensors").display()),
            Err(err) => tracing::error!("{err}"),
        }
    }
}

/// Mean loss over fixed held-out batches (the same ones at every evaluation), no grad,
/// each batch split by the evaluation guard's current size.
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    model: &impl TrainModel, split: &Split, seed: u64, batch: usize, num_batches: usize, like: &GptBatches, guard: &mut Guard, step: u64,
) -> Result<f64> {
    let _no_grad = tch::no_grad_guard();
    let eval_seed = splitmix64(seed ^ 0xE7A1);
    let mut total = 0.0;
    for k in 0..num_batches as u64 {
        let offsets = sample_offsets(eval_seed, k, batch, split.num_tokens(), like.block);
        total += guard.run(step, &mut (), |_, mb| {
            let mut sum = 0.0;
            for part in micro_batches(batch, mb) {
                let (x, y) = split.batch(&offsets[part.clone()], like.block, like.vocab, like.device)?;
                let loss = model.loss(&x, &y, false).map_err(|e| Error::from(e).in_phase(Phase::Eval))?;
                sum += loss.f_double_value(&[])? * part.len() as f64 / batch as f64;
            }
            Ok(sum)
        }, |_| ())?;
    }
    Ok(total / num_batches as f64)
}
