//! The training loop: reads top to bottom.
use std::path::Path;
use std::time::Instant;
use tch::{nn::VarStore, Device, Tensor};

use super::{train_step, StepBatches, TrainModel};
use crate::config::Config;
use crate::data::{sample_offsets, splitmix64, Dataset, Split};
use crate::error::Result;
use crate::memory::{self, human_bytes};
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

/// Trains the config's GPT, writing metrics into `run_dir`.
pub fn train(cfg: &Config, run_dir: &Path) -> Result<Summary> {
    let c = &cfg.raw;
    memory::install_cpu_allocator();
    if let Some(n) = c.train.num_threads {
        tch::set_num_threads(n as i32);
    }
    let device = c.train.device();
    tch::manual_seed(c.train.seed as i64);
    let base = cfg.path.parent().unwrap_or(Path::new("."));
    let block = c.model.block_size as usize;
    let data = Dataset::open(&c.data, base, block)?;
    let vs = VarStore::new(device);
    let model = Gpt::new(&vs.root(), &c.model)?;
    let mut opt = AdamW::new(&vs, &c.optim, no_weight_decay)?;
    let mut metrics = MetricsWriter::open(run_dir)?;

    let global = c.train.global_batch_size();
    let batches = GptBatches { split: &data.train, seed: c.train.seed, global_batch: global, block, vocab: c.model.vocab_size, device };
    let micro = c.train.micro_batch_size;
    tracing::info!(
        "training {:.2}M parameters on {device:?} ({} threads): global batch {global} = {micro} x {}, {} steps",
        c.model.num_params() as f64 / 1e6, tch::get_num_threads(), c.train.grad_accum_steps, c.train.max_steps
    );

    let start = Instant::now();
    let (mut first_loss, mut last_loss, mut val_loss, mut tokens, mut peak, mut eval_s) = (f64::NAN, f64::NAN, None, 0usize, 0u64, 0.0);
    for step in 0..c.train.max_steps {
        let lr = c.optim.lr_at(step, c.train.max_steps);
        memory::reset_peak(device);
        let t0 = Instant::now();
        let stats = train_step(&model, &mut opt, &batches, step, micro, lr, c.optim.grad_clip)?;
        let dt = t0.elapsed().as_secs_f64();
        let mem = memory::stats(device);
        tokens += global * block;
        peak = peak.max(mem.peak_bytes);
        if step == 0 {
            first_loss = stats.loss;
        }
        last_loss = stats.loss;
        let rec = StepRecord {
            step, loss: stats.loss, lr, grad_norm: stats.grad_norm, tokens_per_s: (global * block) as f64 / dt,
            micro_batch_size: micro, grad_accum_steps: stats.num_micro_batches, step_time_s: dt,
            elapsed_s: start.elapsed().as_secs_f64(), memory: mem,
        };
        if step % c.log.every == 0 || step + 1 == c.train.max_steps {
            tracing::info!(
                "step {:>5}/{} | loss {:.4} | lr {:.2e} | {:>7.0} tok/s | mb {}x{} | mem {} (peak {})",
                step + 1, c.train.max_steps, rec.loss, lr, rec.tokens_per_s, micro, rec.grad_accum_steps,
                human_bytes(mem.live_bytes), human_bytes(mem.peak_bytes)
            );
        }
        metrics.write(&Record::Step(rec))?;
        let last = step + 1 == c.train.max_steps;
        if last || (c.train.eval_every > 0 && (step + 1) % c.train.eval_every == 0) {
            let t_eval = Instant::now();
            let v = evaluate(&model, &data.val, c.train.seed, c.train.eval_batch_size, c.train.eval_batches, block, c.model.vocab_size, device)?;
            tracing::info!("eval  {:>5} | val loss {v:.4}", step + 1);
            metrics.write(&Record::Eval(EvalRecord { step, val_loss: v, eval_batch_size: c.train.eval_batch_size }))?;
            val_loss = Some(v);
            eval_s += t_eval.elapsed().as_secs_f64();
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let weights = run_dir.join("model.safetensors");
    vs.save(&weights).map_err(|e| crate::Error::io(format!("cannot write {}", weights.display()), std::io::Error::other(e.to_string())))?;
    Ok(Summary {
        steps: c.train.max_steps, first_loss, final_loss: last_loss, val_loss, wall_s: wall,
        tokens_per_s: tokens as f64 / (wall - eval_s), peak_bytes: peak,
    })
}

/// Mean loss over fixed held-out batches (the same ones at every evaluation), no grad.
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    model: &impl TrainModel, split: &Split, seed: u64, batch: usize, num_batches: usize, block: usize, vocab: i64, device: Device,
) -> Result<f64> {
    let _no_grad = tch::no_grad_guard();
    let eval_seed = splitmix64(seed ^ 0xE7A1);
    let mut total = 0.0;
    for k in 0..num_batches as u64 {
        let offsets = sample_offsets(eval_seed, k, batch, split.num_tokens(), block);
        let (x, y) = split.batch(&offsets, block, vocab, device)?;
        total += model.loss(&x, &y, false)?.f_double_value(&[])?;
    }
    Ok(total / num_batches as f64)
}
