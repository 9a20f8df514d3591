//! Owns a run's state between steps and what one step does with it.
//! Keeps: signals and the checkpoint clock are agreed by the ranks, so all stop or checkpoint
//! at the same step.
mod rungs;
mod saving;
mod start;

pub use start::check_world;

// The imports of the step and of start.rs, rungs.rs and saving.rs (`use super::*`).
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
use crate::dist::{ProcessGroup, Reducer, Topic};
use crate::error::{ConfigError, Error, Phase, Result};
use crate::guard::ladder::{self, Rung};
use crate::guard::{Agree, Guard, GuardEvent, Policy, SharedDumper};
use crate::memory::{self, allocator, human_bytes, MemoryStats, PressureSchedule};
use crate::metrics::{device_label, EvalRecord, MembershipRecord, MetricsWriter, Record, RungRecord, StepRecord};
use crate::model::{ActivationCheckpointing, LossKind, ModelKind};
use crate::optim::{AdamW, Comm, Shard};
use crate::plan::{self, AutoResult, AutoSearch};
use crate::precision::{bf16_is_fast, Amp, Precision, Scaler};
use crate::task::{self, fingerprint_key, BuildContext, Built, Task};
use oomguard_console::progress;
use oomguard_host::Threads;
use oomguard_launch::{FAILED_MICRO_BATCH_VAR, MICRO_BATCH_VAR};

/// Builds the model a run trains (a config's kind, or a Rust program's own model).
pub type Builder<'b> = &'b dyn Fn(&BuildContext) -> Result<Built>;

/// A checkpoint's `extra` key: a survivor of an elastic job saved it (`save_as_survivor`).
const SAVED_BY_SURVIVOR: &str = "saved_by_survivor";

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
    /// The overlapped gradient reduction's hooks (data parallel); dropped before the group.
    reducer: Option<Reducer>,
    /// A gradient bucket's most bytes, the same on every rank (`start::bucket_bytes`).
    bucket_bytes: usize,
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
    /// Whether this run teaches the micro-batch cache (`start::micro_key`, as the run stands
    /// when it learns); not when its failures are injected, not facts about memory.
    remember_micro: bool,
    pub summary: Summary,
    /// Elapsed time, the ETA and the live bar.
    pub progress: Progress,
    /// RUN_DIR/oom/NNN/ writer (memory.snapshot), shared with both guards.
    snapshot: Option<SharedDumper>,
    /// A sharding rung's way back down.
    shard_back: ShardBack,
    /// `checkpoint.every_minutes` (rank 0 decides; the ranks learn it at the step boundary).
    clock: checkpoint::Clock,
    /// Elastic (rank 0): the change that began this round, and when it was seen (ms since
    /// the epoch), recorded once its first step is done.
    membership: Option<(MembershipRecord, u64)>,
    /// Elastic: the checkpoint being written hands the run to the next round (a survivor's
    /// save, or the stop a membership change asked for): marked SAVED_BY_SURVIVOR.
    handover: bool,
    /// The first step whose loss was not a number (said once).
    diverged_at: Option<u64>,
    /// The step at which a sharding rung ran out of memory re-sharding (not offered again
    /// in it).
    shard_oom_at: Option<u64>,
    /// A `--resume-from` fork's record (`checkpoint::FORKED_FROM`), in each checkpoint it writes.
    forked_from: Option<serde_json::Value>,
}

/// What the ranks agreed at a step's boundary, before it runs.
pub struct Boundary {
    /// A SIGINT/SIGTERM: checkpoint and stop.
    pub signal: Option<crate::signals::Signal>,
    /// The checkpoint clock fired on rank 0.
    pub clock: bool,
}

/// Clean steps since the sharding last changed, and when a lower stage last failed.
#[derive(Debug, Clone, Copy, Default)]
struct ShardBack {
    clean_steps: u64,
    failed_at: Option<u64>,
}

impl<'a> Run<'a> {
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
        let exchanged_before = self.pg.as_ref().map(|pg| pg.exchange_bytes());
        memory::inject::targeted::at(self.rank(), step);
        let ooms_before = self.guard.policy.num_ooms;
        let result = loop {
            let mut batches = StepSamples::new(
                self.data.train.as_ref(),
                c.train.seed,
                c.train.global_batch_size(),
                self.device,
            );
            if let Some(pg) = &self.pg {
                batches.shard = pg.shard(batches.global_batch);
            }
            let pg = self.pg.as_deref();
            if let Some(pg) = pg {
                pg.at_step(step);
            }
            let amp = Amp {
                precision: self.precision,
                device: self.device,
                loss_scale: self.scaler.as_ref().map(|s| &s.scale),
            };
            let u = Update {
                lr,
                grad_clip: c.optim.grad_clip,
                amp,
                scaler: self.scaler.as_ref(),
            };
            let task = self.task.as_ref();
            let reducer = self.reducer.as_ref();
            let has_buffers = !task.buffers().is_empty();
            let mut ctx = StepCtx {
                opt: &mut self.opt,
                buffers: None,
            };
            let rank = pg.map_or(0, |pg| pg.rank);
            let result = self.guard.run(
                step,
                &mut ctx,
                |ctx, mb| {
                    match pg {
                        // The snapshot's OOM is agreed like any other.
                        Some(pg) if has_buffers => pg.agree(Topic::BufferSnapshot, ctx.snapshot_buffers(task))?,
                        _ => ctx.snapshot_buffers(task)?,
                    }
                    // Every generator the model draws from, seeded from (seed, step, rank) at
                    // each attempt: a retry draws what the first drew, each rank its own.
                    crate::rng::seed_rank_step(c.train.seed, step, rank);
                    task.seed_host_rng(crate::rng::rank_step_seed(c.train.seed, step, rank))?;
                    match pg {
                        Some(pg) => dist_step(pg, reducer, self.bucket_bytes, task, ctx.opt, &batches, step, mb, &u),
                        None => step_with(task, ctx.opt, &batches, step, mb, &u),
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
        // The update is applied: the state is step + 1's now (a survivor's save, should a
        // collective below fail, is of that step).
        self.next_step = step + 1;
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
        let mem = MemoryStats {
            host_rss_anon_bytes: oomguard_host::memory::own_anonymous_bytes(),
            ..self.guard.last_memory()
        };
        let rec = StepRecord {
            step,
            loss: stats.loss,
            lr,
            grad_norm: stats.grad_norm,
            tokens_per_s: self.units_per_step as f64 / dt,
            micro_batch_size: stats.micro_batch_size,
            grad_accum_steps: stats.num_micro_batches,
            num_samples: stats.num_samples,
            world_size: self.world_size(),
            step_time_s: dt,
            elapsed_s: self.progress.elapsed(),
            eta_s: eta,
            memory: mem,
            device: device_label(self.device),
            precision: self.precision,
            activation_checkpointing: self.task.activation_checkpointing() == Some(true),
            loss_scale: stats.loss_scale,
            skipped: stats.skipped,
            comm_s: stats.comm_s,
            agree_s: stats.agree_s,
            update_s: stats.update_s,
            d2h_reads: Some(crate::ops::d2h_reads() - reads_before),
            cuda_syncs: crate::ops::cuda_syncs(),
            shard: self.opt.shard(),
            exchange_bytes: self
                .pg
                .as_ref()
                .zip(exchanged_before)
                .map(|(pg, b)| pg.exchange_bytes() - b),
        };
        if stats.skipped {
            tracing::warn!(
                "step {step}: fp16 gradients overflowed: update skipped, loss scale now {}",
                rec.loss_scale.unwrap_or(f64::NAN)
            );
        }
        if !rec.loss.is_finite() && !stats.skipped && self.diverged_at.is_none() {
            self.diverged_at = Some(step);
            tracing::warn!(
                "step {step}: the loss is {} (metrics.jsonl records it as null): the run is diverging; lower optim.lr \
                 or set optim.grad_clip, and resume from a checkpoint before step {step} (--resume-from)",
                rec.loss
            );
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
            self.progress
                .show(step, eta, rec.loss, rec.micro_batch_size, rec.grad_accum_steps);
        }
        self.write(&Record::Step(rec))?;
        if let Some((mut m, seen)) = self.membership.take() {
            m.seconds = crate::dist::elastic::seconds_since(seen);
            tracing::info!(
                "membership: world {} -> {} ({}); the first step at the new world came {:.1} s after it was seen; \
                 {} step(s) recomputed; state from the {}",
                m.old_world,
                m.new_world,
                m.cause,
                m.seconds,
                m.steps_recomputed,
                m.source
            );
            self.write(&Record::Membership(m))?;
        }
        self.summary.peak_bytes = self.summary.peak_bytes.max(mem.peak_bytes);
        Ok(stats)
    }

    /// Records the guard's events (a size that worked after an OOM goes to the micro-batch
    /// cache); on an infeasible step, checkpoints before failing and says what would fit.
    fn after_guarded<T>(&mut self, result: Result<T>, step: u64) -> Result<T> {
        let mut shrank = false;
        let events: Vec<GuardEvent> = self
            .guard
            .drain_events()
            .into_iter()
            .chain(self.eval_guard.drain_events())
            .collect();
        for e in events {
            shrank |= matches!(&e, GuardEvent::Oom(o) if o.phase != Some(Phase::Eval) && o.new_micro_batch_size > 0);
            self.write(&Record::from(e))?;
        }
        if shrank && result.is_ok() && self.remember_micro {
            let key = start::micro_key(
                self.task.as_ref(),
                &self.data,
                self.precision,
                self.device,
                self.opt.shard(),
            );
            plan::remember(&key, self.guard.micro_batch_size());
        }
        match result {
            Err(Error::Oom(oom)) => {
                // Unrecovered (guard off): `oomguard launch` reads this to relaunch at half.
                tracing::error!(
                    "step {step} ran out of memory at micro_batch_size={}",
                    self.guard.micro_batch_size()
                );
                Err(Error::Oom(oom))
            }
            Err(Error::Infeasible(msg)) => {
                // The state's own step: `step` in a training step, `step + 1` in the evaluation
                // after one (its update applied; a checkpoint at `step` would apply it twice).
                self.checkpoint(self.next_step, checkpoint::Reason::Infeasible)?;
                self.save_weights()?;
                let advice = self.advice();
                Err(Error::Infeasible(format!("{msg}{advice}")))
            }
            other => other,
        }
    }

    pub fn evaluate(&mut self, step: u64) -> Result<()> {
        let c = &self.cfg.raw;
        let spec = EvalSpec {
            samples: self.data.val.as_ref(),
            seed: c.train.seed,
            batch_size: c.train.eval_batch_size,
            num_batches: c.train.eval_batches,
            device: self.device,
        };
        let amp = Amp {
            precision: self.precision,
            device: self.device,
            loss_scale: None,
        };
        // Evaluation may draw from the generators as it likes: every attempt of a training
        // step seeds them anew from (seed, step, rank), so the `train.eval_*` keys change
        // nothing but the evaluations.
        let v = evaluate(
            self.task.as_ref(),
            &spec,
            &mut self.eval_guard,
            step,
            &amp,
            self.pg.as_deref(),
        );
        let v = self.after_guarded(v, step)?;
        if self.lead {
            tracing::info!("eval  {:>5} | val loss {v:.4}", step + 1);
        }
        self.write(&Record::Eval(EvalRecord {
            step,
            val_loss: v,
            eval_batch_size: c.train.eval_batch_size,
            eval_micro_batch_size: Some(self.eval_guard.micro_batch_size()),
        }))?;
        self.eval_history.insert(step + 1, v);
        self.summary.val_loss = Some(v);
        self.summary.best_val_loss = Some(self.summary.best_val_loss.map_or(v, |b| b.min(v)));
        self.progress.other_done(Other::Eval);
        Ok(())
    }

    /// Step `step`, committed on this rank, whose peers were lost before its record was
    /// written: recorded with what this rank knows (the global loss and gradient norm, which
    /// needed the lost peers, are null), so that every step done has its one record.
    pub(crate) fn record_committed(&mut self, step: u64) {
        let c = &self.cfg.raw;
        let rec = StepRecord {
            step,
            loss: f64::NAN,
            lr: c.optim.lr_at(step, c.train.max_steps),
            grad_norm: f64::NAN,
            tokens_per_s: 0.0,
            micro_batch_size: self.guard.micro_batch_size(),
            grad_accum_steps: 0,
            num_samples: c.train.global_batch_size(),
            world_size: self.world_size(),
            step_time_s: 0.0,
            elapsed_s: self.progress.elapsed(),
            eta_s: None,
            memory: MemoryStats::default(),
            device: device_label(self.device),
            precision: self.precision,
            activation_checkpointing: self.task.activation_checkpointing() == Some(true),
            loss_scale: None,
            skipped: false,
            comm_s: None,
            agree_s: None,
            update_s: None,
            d2h_reads: None,
            cuda_syncs: None,
            shard: self.opt.shard(),
            exchange_bytes: None,
        };
        if let Err(e) = self.write(&Record::Step(rec)) {
            tracing::warn!("step {step}'s record (committed before the peers were lost): {e}");
        }
    }

    /// A metrics.jsonl record (rank 0 writes them).
    pub fn write(&mut self, record: &Record) -> Result<()> {
        match self.metrics.as_mut() {
            Some(m) => m.write(record),
            None => Ok(()),
        }
    }

    /// A SIGINT/SIGTERM on any rank, and rank 0's checkpoint clock, agreed by the ranks so
    /// that all stop, or checkpoint, at the same step.
    pub fn boundary(&self) -> Result<Boundary> {
        use crate::signals::Signal;
        let local = crate::signals::requested();
        let clock = self.lead && self.clock.is_due();
        let Some(pg) = &self.pg else {
            return Ok(Boundary { signal: local, clock });
        };
        let mut v = [local.map_or(0.0, |s| s.exit_code() as f64), f64::from(u8::from(clock))];
        pg.exchange(Topic::Stop, &mut v)?;
        Ok(Boundary {
            signal: [Signal::Int, Signal::Term]
                .into_iter()
                .find(|s| s.exit_code() as f64 == v[0]),
            clock: v[1] > 0.0,
        })
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
            let copies = task
                .buffers()
                .iter()
                .map(|(_, b)| b.f_detach_copy())
                .collect::<Result<Vec<_>, _>>();
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
