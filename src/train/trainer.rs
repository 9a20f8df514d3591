//! The training loop (`train`) reads top to bottom; `Run` holds what it works with.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{nn::VarStore, Device, Tensor};

use super::{micro_batches, train_step, StepBatches, StepStats, TrainModel};
use crate::checkpoint::{self, TrainState};
use crate::config::Config;
use crate::data::{sample_offsets, splitmix64, Dataset, Split};
use crate::error::{Error, Phase, Result};
use crate::guard::{Guard, Policy};
use crate::memory::{self, allocator, human_bytes, PressureSchedule};
use crate::metrics::{EvalRecord, MetricsWriter, Record, StepRecord};
use crate::model::{no_weight_decay, Gpt};
use crate::optim::AdamW;
use crate::plan::{auto_micro_batch, AutoResult, AutoSearch, Estimate, Precision};
use super::MicroBatch;
use crate::signals;
use oomguard_launch::launch::MICRO_BATCH_VAR;

/// Where a run starts.
#[derive(Debug, Clone, Default)]
pub enum Resume {
    #[default]
    Fresh,
    /// The newest valid checkpoint in the run directory.
    Newest,
    /// This checkpoint folder.
    From(PathBuf),
}

/// What a finished run reports.
#[derive(Debug, Clone, Default, serde::Serialize)]
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

/// Trains the config's GPT into `run_dir`. `settings` are the allocator settings in force.
pub fn train(cfg: &Config, run_dir: &Path, settings: &allocator::AllocatorSettings, resume: Resume) -> Result<Summary> {
    let c = &cfg.raw;
    let data = Dataset::open(&c.data, cfg.path.parent().unwrap_or(Path::new(".")), c.model.block_size as usize)?;
    let mut run = Run::start(cfg, run_dir, settings, &data, resume)?;
    let start = Instant::now();
    let mut eval_s = 0.0;
    for step in run.next_step..c.train.max_steps {
        if let Some(signal) = signals::requested() {
            run.checkpoint(step)?;
            run.metrics.write(&Record::Stopped { step: step.saturating_sub(1), signal: signal.name().into() })?;
            return Err(Error::Interrupted { signal, step });
        }
        run.pressure.update(step);
        let stats = run.step(step)?;
        run.summary.first_loss = if step == run.first_step { stats.loss } else { run.summary.first_loss };
        run.summary.final_loss = stats.loss;
        if step + 1 == c.train.max_steps || (c.train.eval_every > 0 && (step + 1).is_multiple_of(c.train.eval_every)) {
            let t = Instant::now();
            run.evaluate(step)?;
            eval_s += t.elapsed().as_secs_f64();
        }
        if c.checkpoint.every_steps > 0 && (step + 1).is_multiple_of(c.checkpoint.every_steps) {
            run.checkpoint(step + 1)?;
        }
    }
    run.checkpoint(c.train.max_steps)?;
    run.save_weights()?;
    let s = &mut run.summary;
    s.wall_s = start.elapsed().as_secs_f64();
    s.tokens_per_s = (c.train.max_steps.saturating_sub(run.first_step) as usize * run.tokens_per_step) as f64 / (s.wall_s - eval_s);
    s.num_ooms = run.guard.policy.num_ooms + run.eval_guard.policy.num_ooms;
    s.final_micro_batch_size = run.guard.micro_batch_size();
    Ok(run.summary)
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

/// The state of a run between steps.
struct Run<'a> {
    cfg: &'a Config,
    run_dir: PathBuf,
    vs: VarStore,
    model: Gpt,
    opt: AdamW,
    batches: GptBatches<'a>,
    val: &'a Split,
    guard: Guard,
    eval_guard: Guard,
    pressure: PressureSchedule,
    metrics: MetricsWriter,
    next_step: u64,
    first_step: u64,
    tokens_per_step: usize,
    val_losses: BTreeMap<u64, f64>,
    summary: Summary,
    start: Instant,
}

impl<'a> Run<'a> {
    fn start(cfg: &'a Config, run_dir: &Path, settings: &allocator::AllocatorSettings, data: &'a Dataset, resume: Resume) -> Result<Run<'a>> {
        let c = &cfg.raw;
        let device = c.train.device();
        memory::prepare(&c.memory, settings, device)?;
        if let Some(n) = c.train.num_threads {
            tch::set_num_threads(n as i32);
        }
        tch::manual_seed(c.train.seed as i64);
        let mut vs = VarStore::new(device);
        let model = Gpt::new(&vs.root(), &c.model)?;
        let mut opt = AdamW::new(&vs, &c.optim, no_weight_decay)?;
        let global = c.train.global_batch_size();
        let block = c.model.block_size as usize;
        let batches = GptBatches { split: &data.train, seed: c.train.seed, global_batch: global, block, vocab: c.model.vocab_size, device };
        let mut eval_guard = Guard::for_eval(&c.memory, c.train.eval_batch_size, device);
        checkpoint::clean_partial(run_dir);
        let (next_step, metrics, mut guard) = match resolve(run_dir, resume)? {
            None => {
                let mut metrics = MetricsWriter::resume(run_dir, 0)?;
                let micro = match c.train.micro_batch_size {
                    MicroBatch::Size(m) => m,
                    MicroBatch::Auto => {
                        let r = auto_search(c, &model, &opt, &batches, device)?;
                        metrics.write(&Record::AutoMicroBatch(r.clone()))?;
                        r.micro_batch_size
                    }
                };
                (0, metrics, Guard::new(&c.memory, micro, device))
            }
            Some((dir, state)) => {
                let changes = checkpoint::shape_changes(&state.model, &c.model);
                if !changes.is_empty() {
                    return Err(Error::Checkpoint(format!("{}: the model's shape changed since this checkpoint: {}", dir.display(), changes.join("; "))));
                }
                checkpoint::restore(&dir, &mut vs, &mut opt)?;
                let configured = match c.train.micro_batch_size {
                    MicroBatch::Size(m) => m,
                    MicroBatch::Auto => state.policy.configured,
                };
                let mut guard = Guard::new(&c.memory, configured, device);
                guard.policy = Policy::resumed(state.policy, configured);
                eval_guard.policy = Policy::resumed(state.eval_policy, c.train.eval_batch_size);
                let mut metrics = MetricsWriter::resume(run_dir, state.next_step)?;
                metrics.write(&Record::Resumed { step: state.next_step, checkpoint: dir.display().to_string() })?;
                tracing::info!("resumed from {} at step {} (micro-batch {})", dir.display(), state.next_step, guard.micro_batch_size());
                (state.next_step, metrics, guard)
            }
        };
        if let Some(mb) = launcher_micro_batch()? {
            guard.policy.current = mb.min(guard.policy.configured);
            tracing::info!("{MICRO_BATCH_VAR}={mb}: starting at micro-batch {}", guard.policy.current);
        }
        let mb = guard.micro_batch_size();
        tracing::info!(
            "training {:.2}M parameters on {device:?} ({} threads): global batch {global} = {mb} x {}, {} steps",
            c.model.num_params() as f64 / 1e6, tch::get_num_threads(), global.div_ceil(mb), c.train.max_steps
        );
        Ok(Run {
            cfg, run_dir: run_dir.to_path_buf(), model, opt,
            batches, val: &data.val, guard, eval_guard, pressure: PressureSchedule::new(&c.memory.pressure, device), metrics,
            next_step, first_step: next_step, tokens_per_step: global * block, val_losses: BTreeMap::new(),
            summary: Summary { steps: c.train.max_steps, first_loss: f64::NAN, ..Default::default() }, start: Instant::now(), vs,
        })
    }

    /// One optimizer step under the guard, recorded and logged.
    fn step(&mut self, step: u64) -> Result<StepStats> {
        let c = &self.cfg.raw;
        let lr = c.optim.lr_at(step, c.train.max_steps);
        let t0 = Instant::now();
        let (model, batches) = (&self.model, &self.batches);
        let result = self.guard.run(step, &mut self.opt, |opt, mb| train_step(model, opt, batches, step, mb, lr, c.optim.grad_clip), |opt| opt.clear_grads());
        let stats = self.after_guarded(result, step)?;
        let dt = t0.elapsed().as_secs_f64();
        let mem = self.guard.last_memory();
        let rec = StepRecord {
            step, loss: stats.loss, lr, grad_norm: stats.grad_norm, tokens_per_s: self.tokens_per_step as f64 / dt,
            micro_batch_size: stats.micro_batch_size, grad_accum_steps: stats.num_micro_batches, num_samples: stats.num_samples,
            step_time_s: dt, elapsed_s: self.start.elapsed().as_secs_f64(), memory: mem,
        };
        if step.is_multiple_of(c.log.every) || step + 1 == c.train.max_steps {
            tracing::info!(
                "step {:>5}/{} | loss {:.4} | lr {:.2e} | {:>7.0} tok/s | mb {}x{} | mem {} (peak {})",
                step + 1, c.train.max_steps, rec.loss, lr, rec.tokens_per_s, rec.micro_batch_size, rec.grad_accum_steps,
                human_bytes(mem.live_bytes), human_bytes(mem.peak_bytes)
            );
        }
        self.metrics.write(&Record::Step(rec))?;
        self.summary.peak_bytes = self.summary.peak_bytes.max(mem.peak_bytes);
        self.next_step = step + 1;
        Ok(stats)
    }

    /// Records the guard's events; on an infeasible step, checkpoints before failing.
    fn after_guarded<T>(&mut self, result: Result<T>, step: u64) -> Result<T> {
        for guard in [&mut self.guard, &mut self.eval_guard] {
            for e in guard.drain_events() {
                self.metrics.write(&Record::from(e))?;
            }
        }
        if let Err(Error::Oom(_)) = &result {
            // Unrecovered (guard off): `oomguard launch` reads this to relaunch at half.
            tracing::error!("step {step} ran out of memory at micro_batch_size={}", self.guard.micro_batch_size());
        }
        if let Err(Error::Infeasible(_)) = &result {
            self.checkpoint(step)?;
            self.save_weights()?;
        }
        result
    }

    fn evaluate(&mut self, step: u64) -> Result<()> {
        let c = &self.cfg.raw;
        let v = evaluate(&self.model, self.val, c.train.seed, c.train.eval_batch_size, c.train.eval_batches, &self.batches, &mut self.eval_guard, step);
        let v = self.after_guarded(v, step)?;
        tracing::info!("eval  {:>5} | val loss {v:.4}", step + 1);
        self.metrics.write(&Record::Eval(EvalRecord { step, val_loss: v, eval_batch_size: c.train.eval_batch_size }))?;
        self.val_losses.insert(step + 1, v);
        self.summary.val_loss = Some(v);
        Ok(())
    }

    /// A checkpoint from which the run resumes at `next_step`; old ones are pruned.
    fn checkpoint(&mut self, next_step: u64) -> Result<()> {
        let c = &self.cfg.raw;
        let state = TrainState {
            format: checkpoint::FORMAT, next_step, samples_seen: next_step * c.train.global_batch_size() as u64,
            policy: self.guard.policy.clone(), eval_policy: self.eval_guard.policy.clone(),
            val_loss: self.summary.val_loss, model: c.model.clone(), files: Default::default(),
        };
        let dir = checkpoint::save(&self.run_dir, &state, &self.vs, &self.opt)?;
        tracing::info!("checkpoint {}", dir.display());
        checkpoint::prune(&self.run_dir, &c.checkpoint, &self.val_losses);
        Ok(())
    }

    fn save_weights(&self) -> Result<()> {
        let path = self.run_dir.join("model.safetensors");
        self.vs.save(&path).map_err(|e| Error::io(format!("cannot write {}", path.display()), std::io::Error::other(e.to_string())))
    }
}

/// `micro_batch_size: auto`: the cache, or a search from the planner's estimate.
fn auto_search(c: &crate::config::RawConfig, model: &Gpt, opt: &AdamW, batches: &GptBatches, device: Device) -> Result<AutoResult> {
    let limit = memory::stats(device).limit_bytes;
    let global = c.train.global_batch_size();
    let estimate = Estimate::new(&c.model, Precision::Fp32, device.is_cuda());
    let start = limit.map_or(global, |l| estimate.largest_fitting(l, global).max(1));
    let m = &c.model;
    let key = format!(
        "gpt-L{}-H{}-C{}-V{}-bias{}|T{}|fp32|{device:?}|{}",
        m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.bias, m.block_size, limit.unwrap_or(0)
    );
    let spec = AutoSearch { key, start, max: global, margin: c.memory.auto_margin };
    let r = auto_micro_batch(model, batches, || opt.clear_grads(), device, spec)?;
    if r.from_cache {
        tracing::info!("micro_batch_size auto: {} (cached: {} fits; {} margin)", r.micro_batch_size, r.largest_fitting, c.memory.auto_margin);
    } else {
        tracing::info!(
            "micro_batch_size auto: {} ({} fits, found in {} trial steps, {:.2}s, starting from the planner's {start}; {} margin)",
            r.micro_batch_size, r.largest_fitting, r.trials, r.search_s, c.memory.auto_margin
        );
    }
    Ok(r)
}

/// A micro-batch set by `oomguard launch` after a worker died of an OOM.
fn launcher_micro_batch() -> Result<Option<usize>> {
    match std::env::var(MICRO_BATCH_VAR) {
        Err(_) => Ok(None),
        Ok(v) => v.trim().parse().ok().filter(|&m: &usize| m >= 1).map(Some).ok_or_else(|| {
            let e = crate::config::ConfigError::invalid(MICRO_BATCH_VAR, format!("`{v}` is not a micro-batch size (a whole number, at least 1)"));
            Error::Config(crate::config::ConfigError { origin: "environment".into(), ..e })
        }),
    }
}

fn resolve(run_dir: &Path, resume: Resume) -> Result<Option<(PathBuf, TrainState)>> {
    match resume {
        Resume::Fresh => Ok(None),
        // Nothing saved yet (e.g. a relaunch after a death before the first checkpoint):
        // start over, keeping the earlier attempt's metrics in metrics.replaced.jsonl.
        Resume::Newest if checkpoint::list(run_dir).is_empty() => {
            tracing::info!("--resume: no checkpoint in {} yet; starting from step 0", run_dir.display());
            Ok(None)
        }
        Resume::Newest => checkpoint::newest_valid(run_dir).map(Some),
        Resume::From(dir) => checkpoint::verify(&dir).map(|s| Some((dir, s))),
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
