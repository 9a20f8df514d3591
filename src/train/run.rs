//! A run's state between steps, for any `Task`: how it starts (fresh or resumed), one
//! guarded step, evaluation, checkpoints and the final weights. The loop in trainer.rs
//! calls these in order.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

use super::eval::{evaluate, EvalSpec};
use super::progress::{Other, Progress};
use super::step::{dist_step, step_with, Update};
use super::{MicroBatch, Options, Resume, StepStats, Summary};
use crate::checkpoint::{self, TrainState};
use crate::config::Config;
use crate::data::{Dataset, StepSamples};
use crate::error::{ConfigError, Error, Phase, Result};
use crate::guard::ladder::{self, Rung};
use crate::dist::{ProcessGroup, Topic};
use crate::guard::{Agree, Guard, GuardEvent, Policy, SharedDumper};
use crate::memory::{self, allocator, human_bytes, PressureSchedule};
use crate::metrics::{device_label, EvalRecord, MetricsWriter, Record, RungRecord, StepRecord};
use crate::model::{ActivationCheckpointing, LossKind, ModelKind};
use crate::optim::{AdamW, Comm, FullState, Shard};
use crate::plan::{self, AutoResult, AutoSearch};
use crate::precision::{bf16_is_fast, Amp, Precision, Scaler};
use crate::task::{self, fingerprint_key, BuildContext, Built, Task};
use oomguard_launch::host::Threads;
use oomguard_launch::launch::{FAILED_MICRO_BATCH_VAR, MICRO_BATCH_VAR};
use oomguard_launch::progress;

/// Attempts at writing a checkpoint or the final weights when they run out of memory.
const WRITE_ATTEMPTS: u32 = 4;

/// Builds the model a run trains (a config's kind, or a Rust program's own model).
pub type Builder<'b> = &'b dyn Fn(&BuildContext) -> Result<Built>;

pub(super) struct Run<'a> {
    pub cfg: &'a Config,
    pub run_dir: PathBuf,
    pub device: Device,
    pub task: Box<dyn Task>,
    pub data: Dataset,
    pub opt: AdamW,
    /// The forward's precision (a rung may lower it), and fp16's loss scaler.
    pub precision: Precision,
    scaler: Option<Scaler>,
    pub guard: Guard,
    pub eval_guard: Guard,
    pub pressure: PressureSchedule,
    /// Rank 0 (or a single process) writes metrics, checkpoints and weights.
    metrics: Option<MetricsWriter>,
    pg: Option<Rc<ProcessGroup>>,
    lead: bool,
    pub next_step: u64,
    pub first_step: u64,
    pub units_per_step: usize,
    /// Evaluation losses by the step a checkpoint right after would resume at.
    eval_history: BTreeMap<u64, f64>,
    /// Checkpoints known to verify (or not), so pruning reads each at most once.
    verified: BTreeMap<u64, bool>,
    /// The step the last checkpoint this run wrote resumes at: the final checkpoint is not
    /// written (nor logged) again when the last periodic one already is it.
    checkpointed: Option<u64>,
    /// The micro-batch cache's key for this model, memory and device; `None` when this run
    /// must not teach it (its failures are injected, not facts about memory).
    cache_key: Option<String>,
    pub summary: Summary,
    /// Elapsed time, the ETA and the live bar.
    pub progress: Progress,
    /// RUN_DIR/oom/NNN/ writer (memory.snapshot), shared with both guards.
    snapshot: Option<SharedDumper>,
    /// A sharding rung's way back down.
    shard_back: ShardBack,
}

/// Clean steps since the sharding last changed, and when a lower stage last failed.
#[derive(Debug, Clone, Copy, Default)]
struct ShardBack {
    clean_steps: u64,
    failed_at: Option<u64>,
}

impl<'a> Run<'a> {
    pub fn start(cfg: &'a Config, run_dir: &Path, settings: &allocator::AllocatorSettings, options: &Options, build: Builder) -> Result<Run<'a>> {
        let c = &cfg.raw;
        let mut device = c.train.device();
        if let (Device::Cuda(_), Some(local_rank)) = (device, crate::dist::local_rank()?) {
            // Each rank's own GPU before any CUDA call: the budget and allocator settings
            // apply to it, and no rank makes a context on GPU 0.
            device = Device::Cuda(local_rank);
            memory::cuda_set_device(local_rank).map_err(Error::Torch)?;
        }
        memory::prepare(&c.memory, settings, device)?;
        if device.is_cuda() && std::env::var("OOMGUARD_CUDA_SYNC_DEBUG").is_ok_and(|v| v == "1") && !crate::ops::cuda_sync_debug() {
            tracing::warn!("OOMGUARD_CUDA_SYNC_DEBUG=1: this libtorch has no CUDA sync-debug state to set; syncs are not counted");
        }
        if let (Device::Cpu, Some(rank), Some(world)) = (device, crate::dist::local_rank()?, crate::dist::local_world()) {
            // Before the thread count: the rank's own cores are its CPU share.
            if let Some(cpus) = crate::dist::bind::bind_rank(rank, world) {
                tracing::info!("rank {rank} of {world} on this node bound to CPU cores {cpus:?} (OOMGUARD_CPU_BIND=0: unbound)");
            }
        }
        // Threads from this process's CPU share (affinity, cgroup quota, Slurm), unless set.
        let threads = match c.train.num_threads {
            Some(n) => Threads { n, why: "train.num_threads".into() },
            None => Threads::of_self(),
        };
        tch::set_num_threads(threads.n as i32);
        tch::manual_seed(c.train.seed as i64);
        let pg = ProcessGroup::from_env(device, Duration::from_secs(c.train.dist_timeout_s))?.map(Rc::new);
        if let Some(pg) = &pg {
            device = pg.device(); // cuda:LOCAL_RANK
        }
        let lead = pg.as_ref().is_none_or(|p| p.rank == 0);
        if let Some(pg) = &pg {
            // Every rank refuses alike, before any collective: none is left waiting.
            check_world(c.train.global_batch_size(), pg.world, &cfg.path.display().to_string())?;
        }
        refuse_what_cannot_fit(cfg, device, pg.as_ref().map_or(1, |p| p.world))?;
        let base = cfg.base_dir();
        let ctx = BuildContext { device, model: &c.model, base_dir: &base, config_path: &cfg.path };
        let Built { mut task, data } = build(&ctx).map_err(|e| init_failure(e, cfg, device, "creating the model"))?;
        if c.model.activation_checkpointing == Some(ActivationCheckpointing::Blocks) {
            task.set_activation_checkpointing(true);
        }
        let mut precision = c.train.precision.resolve(device);
        let data = task::data_for(cfg, data).map_err(|e| init_failure(e, cfg, device, "loading the data"))?;
        let (mut opt, init_rung) = new_optimizer(cfg, task.as_ref(), pg.as_ref(), device)?;
        check_loss(task.as_ref(), &data, device, cfg, precision)?;
        if lead {
            checkpoint::clean_partial(run_dir);
        }

        let global = c.train.global_batch_size();
        let limit = memory::stats(device).limit_bytes;
        let cache_key = format!(
            "{}|u{}|{}{}|{device:?}|{}",
            fingerprint_key(&task.fingerprint()),
            data.train.units_per_sample(),
            precision.name(),
            if task.activation_checkpointing() == Some(true) { "+ckpt" } else { "" },
            limit.map_or(0, |l| l >> 26) // in 64 MiB steps: an auto budget moves a little
        );
        // Where to start: rank 0 decides (and reads the checkpoint); the others learn it.
        let agree = |r: Result<()>| match &pg {
            Some(pg) => pg.agree(r),
            None => r,
        };
        let from = match &pg {
            None => resolve(run_dir, options.resume.clone())?,
            Some(pg) => shared_start(pg, run_dir, &options.resume)?,
        };
        let metrics = lead.then(|| MetricsWriter::resume(run_dir, from.as_ref().map_or(0, |(_, s)| s.next_step))).transpose()?;
        let mut metrics = metrics.map(|m| m.with_tensorboard(c.log.tensorboard, run_dir));
        let mut eval_guard = Guard::for_eval(&c.memory, c.train.eval_batch_size, device);
        let mut resumed_extra = BTreeMap::new();
        let (mut guard, next_step, eval_history) = match from {
            None => {
                let guard = match c.train.micro_batch_size {
                    MicroBatch::Size(m) => {
                        // Never above the configured size; it may grow back to it.
                        let mut guard = Guard::new(&c.memory, m, device);
                        guard.policy.current = known_good(&cache_key, m);
                        guard
                    }
                    MicroBatch::Auto => {
                        let mut r = auto_search(cfg, task.as_ref(), &opt, &data, &Amp { precision, device, loss_scale: None }, &cache_key, limit)?;
                        if let Some(pg) = &pg {
                            // One micro-batch for all ranks: the smallest any rank found.
                            let mut v = [-(r.micro_batch_size as f64)];
                            pg.exchange(Topic::Start, &mut v)?;
                            r.micro_batch_size = (-v[0]) as usize;
                        }
                        if let Some(m) = metrics.as_mut() {
                            m.write(&Record::AutoMicroBatch(r.clone()))?;
                        }
                        Guard::new(&c.memory, r.micro_batch_size, device)
                    }
                };
                (guard, 0, BTreeMap::new())
            }
            Some((dir, state)) => {
                let changes = task::shape_changes(&state.model, &task.fingerprint());
                if !changes.is_empty() {
                    return Err(Error::Checkpoint(format!("{}: the model's shape changed since this checkpoint: {}", dir.display(), changes.join("; "))));
                }
                // A sharding rung climbed before the checkpoint stays climbed (it may come
                // back down); the checkpoint's state is whole, whatever the sharding.
                let saved_shard: Option<Shard> = state.extra.get("shard").and_then(|v| serde_json::from_value(v.clone()).ok());
                if let (Some(s), Some(pg)) = (saved_shard, &pg) {
                    if s > opt.shard() {
                        opt.set_shard(s, Some(pg.clone() as Rc<dyn Comm>), &agree)?;
                    }
                }
                if lead {
                    checkpoint::restore(&dir, task.as_ref(), &mut opt, device).map_err(|e| init_failure(e, cfg, device, "restoring the checkpoint"))?;
                }
                // Rungs climbed before the checkpoint stay climbed.
                if state.extra.get("activation_checkpointing").and_then(|v| v.as_bool()) == Some(true) {
                    task.set_activation_checkpointing(true);
                }
                if state.extra.get("loss").and_then(|v| v.as_str()) == Some(LossKind::Fused.name()) {
                    task.set_loss_kind(LossKind::Fused);
                }
                let saved: Option<Precision> = state.extra.get("precision").and_then(|v| serde_json::from_value(v.clone()).ok());
                let precision_from = resumed_precision(&mut precision, saved, options.precision_set);
                let configured = match c.train.micro_batch_size {
                    MicroBatch::Size(m) => m,
                    MicroBatch::Auto => state.policy.configured,
                };
                let mut guard = Guard::new(&c.memory, configured, device);
                guard.policy = Policy::resumed(state.policy, configured);
                eval_guard.policy = Policy::resumed(state.eval_policy, c.train.eval_batch_size);
                if let Some(m) = metrics.as_mut() {
                    m.write(&Record::Resumed {
                        step: state.next_step, checkpoint: dir.display().to_string(), precision: Some(precision),
                        precision_from: Some(precision_from.into()), checkpoint_precision: saved,
                    })?;
                }
                tracing::info!("resumed from {} at step {} (micro-batch {})", dir.display(), state.next_step, guard.micro_batch_size());
                resumed_extra = state.extra.clone();
                (guard, state.next_step, state.eval_history)
            }
        };
        if let Some(pg) = &pg {
            // Rank 0's parameters (its initial ones, or the checkpoint's) and optimizer state
            // (sharded: each rank's part of the checkpoint's; a fresh one is zeros).
            pg.broadcast(&task.state().into_iter().map(|(_, t)| t).collect::<Vec<_>>(), 0)?;
            if opt.shard() == Shard::None {
                pg.broadcast(&opt.state().into_iter().map(|(_, t)| t.shallow_clone()).collect::<Vec<_>>(), 0)?;
            } else if next_step > 0 {
                opt.share_restored(&agree)?;
            }
        }
        if let (Some(rung), Some(m)) = (init_rung, metrics.as_mut()) {
            m.write(&Record::Rung(RungRecord { step: next_step, rung, reason: "the optimizer state did not fit".into() }))?;
        }
        if let Some(mb) = launcher_micro_batch(MICRO_BATCH_VAR)? {
            let failed = launcher_micro_batch(FAILED_MICRO_BATCH_VAR)?;
            guard.policy.relaunched(failed, mb, next_step);
            tracing::info!(
                "{MICRO_BATCH_VAR}={mb}: starting at micro-batch {}{}", guard.policy.current,
                failed.map(|f| format!(" ({f} ran out of memory before the relaunch: it cools down)")).unwrap_or_default()
            );
        }
        if let Some(pg) = &pg {
            // One starting micro-batch for all ranks: the smallest any would take (their
            // micro-batch caches may differ).
            let mut v = [-(guard.policy.current as f64)];
            pg.exchange(Topic::Start, &mut v)?;
            let agreed = (-v[0]) as usize;
            if agreed != guard.policy.current {
                tracing::info!("starting at micro-batch {agreed}, the smallest any rank would take (this rank's was {})", guard.policy.current);
                guard.policy.current = agreed;
            }
        }
        let agree = pg.clone().map(|p| p as Rc<dyn Agree>);
        let snapshot = snapshot_dumper(cfg, run_dir, device, task.as_ref(), &opt, pg.as_ref().map(|p| p.rank))?;
        let (guard, eval_guard) = (
            guard.with_agreement(agree.clone()).with_snapshot(snapshot.clone()),
            eval_guard.with_agreement(agree).with_snapshot(snapshot.clone()),
        );
        let scaler = (precision == Precision::Fp16).then(|| Scaler::new(&c.train.grad_scaler, device)).transpose().map_err(|e| init_failure(e.into(), cfg, device, "creating the loss scaler"))?;
        if let (Some(s), Some(scale)) = (&scaler, resumed_extra.get("loss_scale").and_then(|v| v.as_f64())) {
            s.load_state(scale, resumed_extra.get("growth_tracker").and_then(|v| v.as_i64()).unwrap_or(0))?;
        }
        let mb = guard.micro_batch_size();
        tracing::info!(
            "training {} on {device:?} ({threads}, {}{}{}): global batch {global} = {mb} x {}, {} steps",
            task.describe(), precision.name(),
            if task.activation_checkpointing() == Some(true) { ", activation checkpointing" } else { "" },
            pg.as_ref().map(|p| format!(", data parallel: rank {} of {}, samples {:?} of each step", p.rank, p.world, p.shard(global))).unwrap_or_default(),
            pg.as_ref().map_or(global, |p| p.shard(global).len()).div_ceil(mb), c.train.max_steps
        );
        let best = eval_history.values().copied().fold(None, |b: Option<f64>, v| Some(b.map_or(v, |b| b.min(v))));
        Ok(Run {
            cfg, run_dir: run_dir.to_path_buf(), device, units_per_step: global * data.train.units_per_sample(), task, data, opt,
            precision, scaler, guard, eval_guard, pressure: PressureSchedule::new(&c.memory.pressure, device), metrics, next_step, first_step: next_step,
            eval_history, verified: BTreeMap::new(), checkpointed: None, cache_key: options.inject_oom.is_none().then_some(cache_key), pg, lead,
            summary: Summary { steps: c.train.max_steps, first_loss: f64::NAN, best_val_loss: best, ..Default::default() },
            progress: Progress::new(cfg.schedule(), next_step, lead),
            snapshot,
            shard_back: ShardBack::default(),
        })
    }

    /// `memory.snapshot: always`: what is in memory at the end, in oom/NNN/ too.
    pub fn snapshot_at_end(&self) {
        if let Some(d) = &self.snapshot {
            d.borrow_mut().at_end(self.next_step, self.guard.micro_batch_size());
        }
    }

    /// One optimizer step under the guard, recorded and logged. When even micro-batch 1
    /// does not fit, the run climbs a rung (activation checkpointing, bf16) and tries again
    /// before it gives up.
    pub fn step(&mut self, step: u64) -> Result<StepStats> {
        let c = &self.cfg.raw;
        let lr = c.optim.lr_at(step, c.train.max_steps);
        let t0 = Instant::now();
        let reads_before = crate::ops::d2h_reads();
        memory::inject::targeted::at(self.rank(), step);
        let ooms_before = self.guard.policy.num_ooms;
        let result = loop {
            let mut batches = StepSamples::new(self.data.train.as_ref(), c.train.seed, c.train.global_batch_size(), self.device);
            if let Some(pg) = &self.pg {
                batches.shard = pg.shard(batches.global_batch);
            }
            let pg = self.pg.as_deref();
            if let Some(pg) = pg {
                pg.at_step(step);
            }
            let amp = Amp { precision: self.precision, device: self.device, loss_scale: self.scaler.as_ref().map(|s| &s.scale) };
            let u = Update { lr, grad_clip: c.optim.grad_clip, amp, scaler: self.scaler.as_ref() };
            let task = self.task.as_ref();
            let has_buffers = !task.buffers().is_empty();
            let mut ctx = StepCtx { opt: &mut self.opt, buffers: None };
            let result = self.guard.run(
                step,
                &mut ctx,
                |ctx, mb| {
                    match pg {
                        Some(pg) => {
                            if has_buffers {
                                // The snapshot's OOM is agreed like any other.
                                pg.agree(ctx.snapshot_buffers(task))?;
                            }
                            crate::rng::seed_rank_step(c.train.seed, step, pg.rank);
                            dist_step(pg, task, ctx.opt, &batches, step, mb, &u)
                        }
                        None => {
                            ctx.snapshot_buffers(task)?;
                            step_with(task, ctx.opt, &batches, step, mb, &u)
                        }
                    }
                },
                |ctx| ctx.undo(task),
            );
            match result {
                Err(Error::Infeasible(_)) if self.climb(step)? => continue,
                other => break other,
            }
        };
        let stats = self.after_guarded(result, step)?;
        self.maybe_unshard(step, self.guard.policy.num_ooms != ooms_before)?;
        // The step's time is the time to run it, not to queue it: its one read (after the
        // update) waited for everything queued before it. No separate synchronize: that
        // would be a second sync per step.
        if let Some(pg) = &self.pg {
            // Rank 0's buffers (BatchNorm statistics) for every rank after each step, as
            // DDP's broadcast_buffers: evaluation, checkpoints and the next step see one set.
            let buffers: Vec<Tensor> = self.task.buffers().into_iter().map(|(_, b)| b).collect();
            if !buffers.is_empty() {
                pg.broadcast(&buffers, 0)?;
            }
        }
        let dt = t0.elapsed().as_secs_f64();
        let eta = self.progress.step_done(step);
        let mem = self.guard.last_memory();
        let rec = StepRecord {
            step, loss: stats.loss, lr, grad_norm: stats.grad_norm, tokens_per_s: self.units_per_step as f64 / dt,
            micro_batch_size: stats.micro_batch_size, grad_accum_steps: stats.num_micro_batches, num_samples: stats.num_samples,
            world_size: self.world_size(), step_time_s: dt, elapsed_s: self.progress.elapsed(), eta_s: eta, memory: mem, device: device_label(self.device),
            precision: self.precision, activation_checkpointing: self.task.activation_checkpointing() == Some(true),
            loss_scale: stats.loss_scale, skipped: stats.skipped, comm_s: stats.comm_s, agree_s: stats.agree_s,
            d2h_reads: Some(crate::ops::d2h_reads() - reads_before), cuda_syncs: crate::ops::cuda_syncs(), shard: self.opt.shard(),
        };
        if stats.skipped {
            tracing::warn!("step {step}: fp16 gradients overflowed: update skipped, loss scale now {}", rec.loss_scale.unwrap_or(f64::NAN));
        }
        if self.lead && (step.is_multiple_of(c.log.every) || step + 1 == c.train.max_steps) {
            // Scripts parse `step N/M | loss ...`: fields are added at the end, never moved.
            tracing::info!(
                target: progress::TARGET,
                "step {:>5}/{} | loss {:.4} | lr {:.2e} | {:>7.0} tok/s | mb {}x{} | mem {} (peak {}) | {}",
                step + 1, c.train.max_steps, rec.loss, lr, rec.tokens_per_s, rec.micro_batch_size, rec.grad_accum_steps,
                human_bytes(mem.live_bytes), human_bytes(mem.peak_bytes), progress::elapsed_eta(rec.elapsed_s, eta)
            );
        }
        if self.lead {
            self.progress.show(step, eta, rec.loss, rec.micro_batch_size, rec.grad_accum_steps);
        }
        self.write(&Record::Step(rec))?;
        self.summary.peak_bytes = self.summary.peak_bytes.max(mem.peak_bytes);
        self.next_step = step + 1;
        Ok(stats)
    }

    /// Records the guard's events (a size that worked after an OOM goes to the micro-batch
    /// cache); on an infeasible step, checkpoints before failing and says what would fit.
    fn after_guarded<T>(&mut self, result: Result<T>, step: u64) -> Result<T> {
        let mut shrank = false;
        let events: Vec<GuardEvent> = self.guard.drain_events().into_iter().chain(self.eval_guard.drain_events()).collect();
        for e in events {
            shrank |= matches!(&e, GuardEvent::Oom(o) if o.phase != Some(Phase::Eval) && o.new_micro_batch_size > 0);
            self.write(&Record::from(e))?;
        }
        if let (true, true, Some(key)) = (shrank, result.is_ok(), &self.cache_key) {
            plan::remember(key, self.guard.micro_batch_size());
        }
        match result {
            Err(Error::Oom(oom)) => {
                // Unrecovered (guard off): `oomguard launch` reads this to relaunch at half.
                tracing::error!("step {step} ran out of memory at micro_batch_size={}", self.guard.micro_batch_size());
                Err(Error::Oom(oom))
            }
            Err(Error::Infeasible(msg)) => {
                self.checkpoint(step)?;
                self.save_weights()?;
                let advice = self.advice();
                Err(Error::Infeasible(format!("{msg}{advice}")))
            }
            other => other,
        }
    }

    /// The next rung below micro-batch 1, if one is left and allowed: applied, recorded and
    /// logged. The guard starts again from micro-batch 1 (and may grow back from there).
    fn climb(&mut self, step: u64) -> Result<bool> {
        let m = &self.cfg.raw.memory;
        let at = ladder::Footing {
            checkpointing: self.task.activation_checkpointing(), precision: self.precision, loss: self.task.loss_kind(),
            shard: self.pg.as_ref().map(|_| self.opt.shard()),
        };
        let allowed = ladder::Allowed {
            checkpointing: m.allow_activation_checkpointing, precision_fallback: m.allow_precision_fallback, bf16_fast: bf16_is_fast(self.device),
            sharding: m.allow_sharding,
        };
        let Some(rung) = ladder::next_rung(at, allowed, &self.savings()) else { return Ok(false) };
        let world = self.world_size();
        match rung {
            Rung::FusedLoss => self.task.set_loss_kind(LossKind::Fused),
            Rung::ActivationCheckpointing => self.task.set_activation_checkpointing(true),
            Rung::Bf16 => self.precision = Precision::Bf16,
            Rung::ShardOptimizer | Rung::ShardGradients => {
                let pg = self.pg.clone().expect("sharding rungs need a group");
                let agree = |r: Result<()>| pg.agree(r);
                memory::empty_cache(self.device)?;
                match self.opt.set_shard(rung.shard().expect("a sharding rung"), Some(pg.clone() as Rc<dyn Comm>), &agree) {
                    Err(Error::Oom(_)) => return Ok(false),
                    other => other?,
                }
                self.shard_back = ShardBack { clean_steps: 0, failed_at: Some(step) };
            }
        }
        for e in self.guard.drain_events() {
            self.write(&Record::from(e))?;
        }
        let what = match rung {
            Rung::FusedLoss => "the fused loss (model.loss: fused: the logits a chunk of tokens at a time)".to_string(),
            Rung::ActivationCheckpointing => "activation checkpointing on (blocks are recomputed in backward)".to_string(),
            Rung::Bf16 => "bf16 autocast (master weights and optimizer state stay fp32)".to_string(),
            Rung::ShardOptimizer => format!("AdamW's state sharded across the {world} ranks (ZeRO-1: each keeps 1/{world} of the moments)"),
            Rung::ShardGradients => format!("the gradients sharded too (ZeRO-2: a reduce-scatter; each rank keeps 1/{world} of the summed gradients)"),
        };
        tracing::warn!("step {step}: micro-batch 1 does not fit; climbing down a rung: {what}; retrying the step");
        self.write(&Record::Rung(RungRecord { step, rung, reason: "micro-batch 1 did not fit".into() }))?;
        self.guard.policy.rung_climbed();
        Ok(true)
    }

    /// What each rung would save on this rank: one sample's activations (the planner's
    /// formula, else the parameters' size as a stand-in), AdamW's moments, the gradients.
    fn savings(&self) -> ladder::Savings {
        let gradients: u64 = self.task.parameters().iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum();
        let activations = self.task.formula().map_or(gradients, |e| e.per_sample_bytes());
        ladder::Savings { activations, optimizer_state: self.opt.state_bytes(), gradients, world: self.world_size() as u64 }
    }

    /// A run that climbed to a sharding rung comes back down a stage when memory allows
    /// (`ladder::unshard`: the micro-batch's hysteresis and cool-down), every rank alike: the
    /// decision is on the ranks' largest peak, and the gather's allocation is agreed.
    fn maybe_unshard(&mut self, step: u64, oomed: bool) -> Result<()> {
        let Some(pg) = self.pg.clone() else { return Ok(()) };
        let configured = self.cfg.raw.train.shard;
        let at = self.opt.shard();
        if at <= configured {
            return Ok(());
        }
        self.shard_back.clean_steps = if oomed { 0 } else { self.shard_back.clean_steps + 1 };
        let mem = self.guard.last_memory();
        let mut peak = [mem.peak_bytes as f64];
        pg.exchange(Topic::Shard, &mut peak)?;
        let world = self.world_size() as u64;
        let saved = match at {
            Shard::Gradients => self.savings().gradients * (world - 1) / world,
            _ => self.opt.state_bytes() * (world - 1),
        };
        let m = &self.cfg.raw.memory;
        let back = ladder::Back {
            at, configured, clean_steps: self.shard_back.clean_steps, failed_at: self.shard_back.failed_at, step,
            peak_bytes: peak[0] as u64, limit_bytes: mem.limit_bytes, saved_bytes: saved,
        };
        let Some(below) = ladder::unshard(back, m.grow_after_steps, m.cooldown_steps, m.grow_headroom) else { return Ok(()) };
        let agree = |r: Result<()>| pg.agree(r);
        let left = if at == Shard::Gradients { Rung::ShardGradients } else { Rung::ShardOptimizer };
        match self.opt.set_shard(below, Some(pg.clone() as Rc<dyn Comm>), &agree) {
            Ok(()) => {
                tracing::info!("step {step}: memory allows it: back to train.shard: {} (the peak was {})", below.name(), human_bytes(back.peak_bytes));
                self.write(&Record::RungDown(RungRecord { step, rung: left, reason: format!("memory allows shard: {}", below.name()) }))?;
                self.shard_back.clean_steps = 0;
            }
            Err(Error::Oom(o)) => {
                tracing::info!("step {step}: coming back to train.shard: {} ran out of memory ({}); staying sharded", below.name(), o.message);
                memory::empty_cache(self.device)?;
                self.shard_back = ShardBack { clean_steps: 0, failed_at: Some(step) };
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// The planner's view of what does not fit and what would, for models it has a formula
    /// for; with data parallel, what sharding would save per rank.
    fn advice(&self) -> String {
        let c = &self.cfg.raw;
        let mut out = match (c.model.kind, memory::stats(self.device).limit_bytes) {
            (ModelKind::Gpt, Some(limit)) => format!(" {}", plan::advice(&c.model.gpt(), limit, self.device.is_cuda())),
            _ => String::new(),
        };
        let world = self.world_size() as u64;
        if world > 1 && self.opt.shard() < Shard::Gradients {
            let s = self.savings();
            let state = if self.opt.shard() == Shard::None { s.optimizer_state } else { 0 };
            let saved = (state + s.gradients) - (state + s.gradients) / world;
            let how = if c.memory.allow_sharding { "train.shard: gradients" } else { "memory.allow_sharding: true (the guard climbs to it), or train.shard: optimizer / gradients" };
            out.push_str(&format!(
                " Sharding AdamW's state and the gradients across the {world} ranks (ZeRO-1/2) would save up to {} per rank: {how}.",
                human_bytes(saved)
            ));
        }
        out
    }

    pub fn evaluate(&mut self, step: u64) -> Result<()> {
        let c = &self.cfg.raw;
        let spec = EvalSpec {
            samples: self.data.val.as_ref(), seed: c.train.seed, batch_size: c.train.eval_batch_size,
            num_batches: c.train.eval_batches, device: self.device,
        };
        let amp = Amp { precision: self.precision, device: self.device, loss_scale: None };
        let v = evaluate(self.task.as_ref(), &spec, &mut self.eval_guard, step, &amp, self.pg.as_deref());
        let v = self.after_guarded(v, step)?;
        if self.lead {
            tracing::info!("eval  {:>5} | val loss {v:.4}", step + 1);
        }
        self.write(&Record::Eval(EvalRecord { step, val_loss: v, eval_batch_size: c.train.eval_batch_size }))?;
        self.eval_history.insert(step + 1, v);
        self.summary.val_loss = Some(v);
        self.summary.best_val_loss = Some(self.summary.best_val_loss.map_or(v, |b| b.min(v)));
        self.progress.other_done(Other::Eval);
        Ok(())
    }

    /// A checkpoint from which the run resumes at `next_step`; old ones are pruned. Rank 0
    /// writes it; the ranks wait for it together.
    pub fn checkpoint(&mut self, next_step: u64) -> Result<()> {
        // Every rank knows it: all skip together, before the barrier.
        if self.checkpointed == Some(next_step) {
            return Ok(());
        }
        // Sharded: every rank takes part in gathering the whole state.
        let full = self.gathered_state(next_step)?;
        let written = if self.lead { self.write_checkpoint(next_step, &full) } else { Ok(()) };
        // Agreed, not a bare barrier: a write that failed on rank 0 (an OOM past its retries
        // included) fails every rank alike, at once.
        match &self.pg {
            Some(pg) => pg.agree(written)?,
            None => written?,
        }
        self.checkpointed = Some(next_step);
        self.progress.other_done(Other::Checkpoint);
        Ok(())
    }

    /// The optimizer's whole state, for a checkpoint (a sharded one gathered, its buffer's
    /// allocation agreed and retried like a write).
    fn gathered_state(&mut self, step: u64) -> Result<FullState> {
        let pg = self.pg.clone();
        let agree = |r: Result<()>| match &pg {
            Some(pg) => pg.agree(r),
            None => r,
        };
        self.retrying_oom(step, |run| run.opt.full_state(&agree))
    }

    fn write_checkpoint(&mut self, next_step: u64, opt_state: &FullState) -> Result<()> {
        let c = &self.cfg.raw;
        let state = TrainState {
            format: checkpoint::FORMAT, next_step, samples_seen: next_step * c.train.global_batch_size() as u64,
            policy: self.guard.policy.clone(), eval_policy: self.eval_guard.policy.clone(), val_loss: self.summary.val_loss,
            eval_history: self.eval_history.clone(), model: self.task.fingerprint(), extra: self.extra_state(), files: Default::default(),
        };
        let dir = self.retrying_oom(next_step, |run| checkpoint::save(&run.run_dir, &state, run.task.as_ref(), &opt_state.tensors, run.device))?;
        tracing::info!("checkpoint {}", dir.display());
        self.verified.insert(next_step, true);
        let verified = &mut self.verified;
        checkpoint::prune(&self.run_dir, &c.checkpoint, &self.eval_history, |step, dir| {
            *verified.entry(step).or_insert_with(|| checkpoint::verify(dir).is_ok())
        });
        Ok(())
    }

    /// The rungs climbed and the loss scale, for checkpoints.
    fn extra_state(&self) -> BTreeMap<String, serde_json::Value> {
        let mut extra = BTreeMap::new();
        extra.insert("precision".into(), serde_json::json!(self.precision));
        extra.insert("activation_checkpointing".into(), serde_json::json!(self.task.activation_checkpointing() == Some(true)));
        if self.opt.shard() != Shard::None {
            extra.insert("shard".into(), serde_json::json!(self.opt.shard()));
        }
        // The fused-loss rung, when climbed (a configured loss is the config's to change).
        if self.cfg.raw.model.kind == ModelKind::Gpt && self.task.loss_kind().is_some_and(|l| l != self.cfg.raw.model.gpt().loss) {
            extra.insert("loss".into(), serde_json::json!(LossKind::Fused.name()));
        }
        if let Some((scale, tracker)) = self.scaler.as_ref().map(Scaler::state) {
            extra.insert("loss_scale".into(), serde_json::json!(scale));
            extra.insert("growth_tracker".into(), serde_json::json!(tracker));
        }
        extra
    }

    /// The final weights, `model.safetensors` (parameters and buffers, by name).
    pub fn save_weights(&mut self) -> Result<()> {
        // Test-only: `OOMGUARD_TEST_RANK_WEIGHTS=1` has every other rank write its own copy,
        // `model.rank-R.safetensors`, so a test can see that the ranks hold one set.
        let path = match self.pg.as_ref().map(|p| p.rank) {
            Some(r) if r > 0 && std::env::var_os("OOMGUARD_TEST_RANK_WEIGHTS").is_some() => self.run_dir.join(format!("model.rank-{r}.safetensors")),
            _ if !self.lead => return Ok(()),
            _ => self.run_dir.join("model.safetensors"),
        };
        let step = self.next_step;
        self.retrying_oom(step, |run| task::tensors::save(&run.task.state(), &path))
    }

    /// Runs a write that allocates (copies to the CPU, RNG state) again after an OOM,
    /// recording each one.
    fn retrying_oom<T>(&mut self, step: u64, mut write: impl FnMut(&Self) -> Result<T>) -> Result<T> {
        let mut attempt = 1;
        loop {
            match write(self) {
                Err(Error::Oom(oom)) if attempt < WRITE_ATTEMPTS => {
                    tracing::warn!("out of memory writing at step {step} (attempt {attempt} of {WRITE_ATTEMPTS}): {}; retrying", oom.message);
                    self.guard.note_oom(step, &oom, Phase::Checkpoint);
                    memory::empty_cache(self.device)?;
                    for e in self.guard.drain_events() {
                        self.write(&Record::from(e))?;
                    }
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// A metrics.jsonl record (rank 0 writes them).
    pub fn write(&mut self, record: &Record) -> Result<()> {
        match self.metrics.as_mut() {
            Some(m) => m.write(record),
            None => Ok(()),
        }
    }

    /// A SIGINT/SIGTERM, agreed by the ranks so that all stop at the same step.
    pub fn stop_requested(&self) -> Result<Option<crate::signals::Signal>> {
        use crate::signals::Signal;
        let local = crate::signals::requested();
        let Some(pg) = &self.pg else { return Ok(local) };
        let mut v = [local.map_or(0.0, |s| s.exit_code() as f64)];
        pg.exchange(Topic::Stop, &mut v)?;
        Ok([Signal::Int, Signal::Term].into_iter().find(|s| s.exit_code() as f64 == v[0]))
    }

    /// This process's rank (0 alone).
    pub fn rank(&self) -> usize {
        self.pg.as_ref().map_or(0, |p| p.rank)
    }

    pub fn world_size(&self) -> usize {
        self.pg.as_ref().map_or(1, |p| p.world)
    }
}

/// The step's mutable context: the optimizer and, for models with buffers (BatchNorm
/// statistics), their values before the step, put back after a failed attempt.
struct StepCtx<'o> {
    opt: &'o mut AdamW,
    buffers: Option<Vec<Tensor>>,
}

impl StepCtx<'_> {
    fn snapshot_buffers(&mut self, task: &dyn Task) -> Result<()> {
        if self.buffers.is_none() {
            let copies = task.buffers().iter().map(|(_, b)| b.f_detach_copy()).collect::<Result<Vec<_>, _>>();
            self.buffers = Some(copies.map_err(|e| Error::from(e).in_phase(Phase::Forward))?);
        }
        Ok(())
    }

    /// After a failed attempt: no gradients, buffers as they were. The snapshot goes too (the
    /// next attempt takes its own), so that live memory is back to the step's start: kept,
    /// the guard would count it as a leak and halve twice.
    fn undo(&mut self, task: &dyn Task) {
        self.opt.clear_grads();
        self.opt.clear_shard_grads();
        if let Some(saved) = self.buffers.take() {
            let _no_grad = tch::no_grad_guard();
            for ((name, b), s) in task.buffers().iter().zip(&saved) {
                if let Err(e) = b.shallow_clone().f_copy_(s) {
                    tracing::warn!("could not restore buffer {name} after a failed attempt: {e}");
                }
            }
        }
    }
}

/// AdamW as `train.shard` asks (data parallel only). When even its state does not fit,
/// and `memory.allow_sharding` allows it, the ranks shard it together; returns the rung
/// so climbed at start.
fn new_optimizer(cfg: &Config, task: &dyn Task, pg: Option<&Rc<ProcessGroup>>, device: Device) -> Result<(AdamW, Option<Rung>)> {
    let c = &cfg.raw;
    let no_decay = |n: &str, t: &Tensor| task.no_weight_decay(n, t);
    let Some(pg) = pg else {
        if c.train.shard != Shard::None {
            tracing::info!("train.shard: {}: a single process has nothing to split it with; ignored", c.train.shard.name());
        }
        return AdamW::new(task.parameters(), &c.optim, no_decay).map(|o| (o, None)).map_err(|e| init_failure(e.into(), cfg, device, "creating the optimizer state"));
    };
    let mut stage = c.train.shard;
    loop {
        let opt = AdamW::sharded(task.parameters(), &c.optim, no_decay, stage, Some(pg.clone() as Rc<dyn Comm>));
        match pg.agree(opt) {
            Ok(opt) => return Ok((opt, (stage != c.train.shard).then_some(Rung::ShardOptimizer))),
            Err(Error::Oom(o)) if c.memory.allow_sharding && stage == Shard::None => {
                tracing::warn!("the optimizer state does not fit on every rank ({}); sharding it across the {} ranks (ZeRO-1)", o.message, pg.world);
                memory::empty_cache(device)?;
                stage = Shard::Optimizer;
            }
            Err(e) => return Err(init_failure(e, cfg, device, "creating the optimizer state")),
        }
    }
}

/// Data parallel needs a sample for every rank: a smaller global batch is a config error
/// (exit 2) naming the smallest that works.
pub fn check_world(global: usize, world: usize, origin: &str) -> Result<()> {
    if global >= world {
        return Ok(());
    }
    Err(ConfigError {
        origin: origin.into(),
        line_col: None,
        key: "train.global_batch_size".into(),
        message: format!("is {global}, smaller than the {world} ranks: each rank needs at least one sample of every step; use a global batch of at least {world} (or fewer ranks)"),
    }
    .into())
}

/// What an allocation failure while a run is being set up means: the model (or its state)
/// does not fit at all (exit 3), with the planner's figures where it has them.
fn init_failure(e: Error, cfg: &Config, device: Device, doing: &str) -> Error {
    let Error::Oom(oom) = e else { return e };
    let c = &cfg.raw;
    let stats = memory::stats(device);
    let limit = stats.limit_bytes.or(oom.capacity_bytes);
    let of = limit.map(|l| format!(" of {}", human_bytes(l))).unwrap_or_default();
    let advice = match (c.model.kind, limit) {
        (ModelKind::Gpt, Some(l)) => format!(" {}", plan::advice(&c.model.gpt(), l, device.is_cuda())),
        _ => " To fit: raise memory.budget or use a device with more memory, or a smaller model.".into(),
    };
    Error::Infeasible(format!(
        "the model does not fit in memory ({doing} ran out; {} in use{of}).{advice} libtorch said: {}",
        human_bytes(stats.live_bytes), oom.message
    ))
}

/// A GPT whose weights, gradients and AdamW state alone exceed the memory (exact sizes,
/// no estimate; the state split over `world` ranks where sharding is configured or allowed)
/// is refused before anything is allocated, as `oomguard plan` would.
fn refuse_what_cannot_fit(cfg: &Config, device: Device, world: usize) -> Result<()> {
    let c = &cfg.raw;
    let stats = memory::stats(device);
    let (ModelKind::Gpt, Some(limit)) = (c.model.kind, stats.limit_bytes) else { return Ok(()) };
    let shard = if world > 1 && c.memory.allow_sharding { Shard::Gradients } else if world > 1 { c.train.shard } else { Shard::None };
    let est = plan::Estimate::new(&c.model.gpt(), plan::Precision::Fp32, device.is_cuda()).with_shard(shard, world as u64);
    let state = est.params_bytes + est.grads_bytes + est.optimizer_bytes;
    if stats.live_bytes + state <= limit {
        return Ok(());
    }
    Err(Error::Infeasible(format!(
        "the model does not fit in memory: its weights, gradients and AdamW state alone need {} and {} is in use, of {} (nothing was allocated). {}",
        human_bytes(state), human_bytes(stats.live_bytes), human_bytes(limit), plan::advice(&c.model.gpt(), limit, device.is_cuda())
    )))
}

/// One sample through the loss, before training: a model that cannot take the data (a
/// wrong dtype or shape, a missing method) is bad input (exit 2), said before any step.
fn check_loss(task: &dyn Task, data: &Dataset, device: Device, cfg: &Config, precision: Precision) -> Result<()> {
    let _no_grad = tch::no_grad_guard();
    let _autocast = crate::precision::Autocast::enter(precision, device)?;
    let describe = |t: &Tensor| format!("{:?} {:?}", t.size(), t.kind());
    let bad = |message: String| Error::Config(ConfigError { origin: cfg.path.display().to_string(), line_col: None, key: "model".into(), message });
    let (x, y) = match data.train.batch(&[0], device) {
        Ok(b) => b,
        Err(Error::Oom(_)) => return Ok(()), // the guard will deal with memory
        Err(e) => return Err(e),
    };
    match task.eval_loss(&x, &y).map_err(Error::from) {
        Ok(loss) if loss.numel() == 1 && matches!(loss.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16) => Ok(()),
        Ok(loss) => Err(bad(format!(
            "{}: the loss on one sample (inputs {}, targets {}) is a tensor {}; it must be the mean loss, a floating-point scalar",
            task.describe(), describe(&x), describe(&y), describe(&loss)
        ))),
        Err(Error::Oom(_)) => Ok(()),
        Err(e) => Err(bad(format!(
            "{} cannot compute the loss of one sample of {} (inputs {}, targets {}): {}",
            task.describe(), data.train.name(), describe(&x), describe(&y), task::error_line(&e.to_string())
        ))),
    }
}

/// The precision a resumed run trains in: the checkpoint's (a rung climbed stays climbed),
/// unless `--set train.precision` on the resuming command says otherwise. Said either way
/// when it differs from the config; returns where it came from, for the `resumed` event.
fn resumed_precision(precision: &mut Precision, saved: Option<Precision>, set: bool) -> &'static str {
    let configured = *precision;
    match saved {
        _ if set => {
            if let Some(s) = saved.filter(|&s| s != configured) {
                tracing::info!("precision {}: --set train.precision wins over the checkpoint's {}", configured.name(), s.name());
            }
            "--set"
        }
        Some(s) => {
            if s != configured {
                tracing::info!(
                    "precision {}, as in the checkpoint (train.precision says {}); --set train.precision={} on this command to change it",
                    s.name(), configured.name(), configured.name()
                );
            }
            *precision = s;
            "checkpoint"
        }
        None => "config",
    }
}

/// A fixed micro-batch, lowered to a size the micro-batch cache knows fits (one learned by
/// an earlier run or sweep trial of the same model, memory and device).
fn known_good(key: &str, configured: usize) -> usize {
    match plan::cached(key) {
        Some(known) if known < configured => {
            tracing::info!("starting at micro-batch {known}, not {configured}: an earlier run of this model on this memory ran out above it (the micro-batch cache)");
            known
        }
        _ => configured,
    }
}

/// `micro_batch_size: auto`: the cache, or a search from the planner's estimate.
fn auto_search(cfg: &Config, task: &dyn Task, opt: &AdamW, data: &Dataset, amp: &Amp, key: &str, limit: Option<u64>) -> Result<AutoResult> {
    let device = amp.device;
    let c = &cfg.raw;
    let global = c.train.global_batch_size();
    let batches = StepSamples::new(data.train.as_ref(), c.train.seed, global, device);
    // The planner's estimate: its formula, or a line fitted through a few measured trials.
    let start = match (task.formula(), limit) {
        (Some(est), Some(l)) => est.largest_fitting(l, global).max(1),
        (None, Some(l)) => plan::measure(task, &batches, &|| opt.clear_grads(), amp, plan::CUDA_OVERHEAD)?.map_or(1, |p| p.largest_fitting(l, global).max(1)),
        _ => global,
    };
    let spec = AutoSearch { key: key.to_string(), start, max: global, margin: c.memory.auto_margin };
    let r = plan::auto_micro_batch(task, &batches, || opt.clear_grads(), amp, spec)?;
    if r.from_cache {
        tracing::info!("micro_batch_size auto: {} (cached: {} fits; {} margin)", r.micro_batch_size, r.largest_fitting, c.memory.auto_margin);
    } else {
        tracing::info!(
            "micro_batch_size auto: {} ({} fits, found in {} trial steps, {:.2}s, starting from {start}; {} margin)",
            r.micro_batch_size, r.largest_fitting, r.trials, r.search_s, c.memory.auto_margin
        );
    }
    Ok(r)
}

/// A micro-batch size from `oomguard launch` (after a worker died of an OOM).
fn launcher_micro_batch(var: &str) -> Result<Option<usize>> {
    match std::env::var(var) {
        Err(_) => Ok(None),
        Ok(v) => v.trim().parse().ok().filter(|&m: &usize| m >= 1).map(Some).ok_or_else(|| {
            let e = ConfigError::invalid(var, format!("`{v}` is not a micro-batch size (a whole number, at least 1)"));
            Error::Config(ConfigError { origin: "environment".into(), ..e })
        }),
    }
}

/// Where a data-parallel run starts: rank 0 resolves it and publishes it (or its error) in
/// the group's store; the other ranks read it, so no rank needs the run directory's files.
fn shared_start(pg: &ProcessGroup, run_dir: &Path, resume: &Resume) -> Result<Option<(PathBuf, TrainState)>> {
    const KEY: &str = "oomguard/start";
    if pg.rank == 0 {
        let r = resolve(run_dir, resume.clone());
        let msg = match &r {
            Ok(None) => serde_json::json!({ "start": null }),
            Ok(Some((dir, state))) => serde_json::json!({ "start": { "dir": dir, "state": state } }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        };
        pg.share(KEY, Some(msg.to_string().as_bytes()))?;
        return r;
    }
    let msg: serde_json::Value = serde_json::from_slice(&pg.share(KEY, None)?).map_err(|e| Error::Dist(format!("rank 0's start: {e}")))?;
    if let Some(e) = msg["error"].as_str() {
        return Err(Error::Dist(format!("rank 0 could not start: {e}")));
    }
    match &msg["start"] {
        serde_json::Value::Null => Ok(None),
        s => Ok(Some((
            serde_json::from_value(s["dir"].clone()).map_err(|e| Error::Dist(format!("rank 0's start: {e}")))?,
            serde_json::from_value(s["state"].clone()).map_err(|e| Error::Dist(format!("rank 0's start: {e}")))?,
        ))),
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

/// The snapshot writer for this run (none with `memory.snapshot: off`): the parameters and
/// optimizer state it attributes by address, and the planner's formula where there is one.
fn snapshot_dumper(cfg: &Config, run_dir: &Path, device: Device, task: &dyn Task, opt: &AdamW, rank: Option<usize>) -> Result<Option<SharedDumper>> {
    let params = task.parameters().into_iter().map(|(_, t)| t).collect();
    let state = opt.state().into_iter().map(|(_, t)| t.shallow_clone()).collect();
    let d = memory::snapshot::Dumper::new(run_dir, cfg.raw.memory.snapshot()?, device, params, state, task.formula(), rank);
    Ok(d.map(|d| Rc::new(std::cell::RefCell::new(d))))
}
