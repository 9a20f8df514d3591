//! Owns the allocation guard: every step and evaluation batch runs inside `Guard::run`.
//! Keeps: after an OOM the step is redone on exactly the same samples; the global batch never
//! changes, only how it is split.
pub mod ladder;
/// The pure policy lives in its own crate (`crates/policy`), shared with the Python extension.
pub use oomguard_policy as policy;

use serde::{Deserialize, Serialize};
use std::time::Instant;
use tch::Device;

pub use policy::{Adjust, LeakWatch, Observation, OnOom, Policy, PolicyConfig};

use crate::error::{Error, OomError, OomSource, Phase, Result};
use crate::memory::snapshot::{self, Dumped, Dumper, OomAt};
use crate::memory::{self, human_bytes, MemoryConfig, MemoryStats};

/// `{"event":"oom", ...}`: one per out-of-memory error the guard recovered from (or not).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OomEvent {
    pub step: u64,
    pub phase: Option<Phase>,
    /// The micro-batch of the step it happened in (0-based), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch_index: Option<usize>,
    pub source: OomSource,
    pub requested_bytes: Option<u64>,
    /// Live bytes when the step started.
    pub memory_before: u64,
    /// Live bytes after cleanup (should equal `memory_before`).
    pub memory_after_cleanup: u64,
    pub limit_bytes: Option<u64>,
    pub old_micro_batch_size: usize,
    /// 0 when the guard gave up.
    pub new_micro_batch_size: usize,
    /// Wall time of the failed attempt and its cleanup.
    pub time_lost_s: f64,
    pub message: String,
    /// What filled memory, in a paragraph (memory.snapshot; absent when off or not written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_summary: Option<String>,
    /// Its folder under the run directory: `oom/NNN`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
}

/// `{"event":"grow", ...}` and `{"event":"shrink", ...}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResizeEvent {
    pub step: u64,
    pub old_micro_batch_size: usize,
    pub new_micro_batch_size: usize,
    pub reason: String,
}

/// `{"event":"leak_warning", ...}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeakEvent {
    pub step: u64,
    pub live_bytes: u64,
    pub growth_bytes_per_step: u64,
}

#[derive(Debug, Clone)]
pub enum GuardEvent {
    Oom(OomEvent),
    Grow(ResizeEvent),
    Shrink(ResizeEvent),
    Leak(LeakEvent),
}

/// Data-parallel ranks agreeing on the guard's inputs, so that every rank decides the same
/// (the same micro-batch, the same grow-back).
pub trait Agree {
    /// The element-wise maximum over all ranks, in place.
    fn max(&self, values: &mut [f64]) -> Result<()>;
}

pub struct Guard {
    pub policy: Policy,
    /// Other ranks to agree with (data parallel).
    agree: Option<std::rc::Rc<dyn Agree>>,
    cfg: PolicyConfig,
    enabled: bool,
    device: Device,
    leak: LeakWatch,
    leak_steps: u32,
    /// `Phase::Eval` for the evaluation guard: OOMs are tagged so, and it never grows.
    eval: bool,
    events: Vec<GuardEvent>,
    /// Memory right after the last successful attempt (read once, for the policy and the
    /// caller's step record).
    last_memory: MemoryStats,
    /// Writes RUN_DIR/oom/NNN/ at each OOM (shared by the training and evaluation guards).
    snapshot: Option<SharedDumper>,
}

pub type SharedDumper = std::rc::Rc<std::cell::RefCell<Dumper>>;

impl Guard {
    pub fn new(cfg: &MemoryConfig, micro_batch_size: usize, device: Device) -> Guard {
        Guard {
            policy: Policy::new(micro_batch_size),
            agree: None,
            cfg: PolicyConfig {
                grow_after_steps: cfg.grow_after_steps,
                grow_headroom: cfg.grow_headroom,
                cooldown_steps: cfg.cooldown_steps,
                thrash_steps: cfg.thrash_steps,
                retries_at_one: cfg.retries_at_one,
            },
            enabled: cfg.guard,
            device,
            leak: LeakWatch::default(),
            leak_steps: cfg.leak_steps,
            eval: false,
            events: Vec::new(),
            last_memory: MemoryStats::default(),
            snapshot: None,
        }
    }

    /// Dump what filled memory at each OOM.
    pub fn with_snapshot(mut self, dumper: Option<SharedDumper>) -> Guard {
        self.snapshot = dumper;
        self
    }

    /// A guard for evaluation batches: halves on OOM, never grows, leaves training alone.
    pub fn for_eval(cfg: &MemoryConfig, eval_batch_size: usize, device: Device) -> Guard {
        let mut g = Guard::new(
            &MemoryConfig {
                grow_after_steps: u64::MAX,
                thrash_steps: 0,
                leak_steps: 0,
                ..cfg.clone()
            },
            eval_batch_size,
            device,
        );
        g.eval = true;
        g
    }

    /// Agree with other ranks on every decision.
    pub fn with_agreement(mut self, agree: Option<std::rc::Rc<dyn Agree>>) -> Guard {
        self.agree = agree;
        self
    }

    /// `values` maximised over the ranks (as they are, alone).
    fn agreed<const N: usize>(&self, mut values: [f64; N]) -> Result<[f64; N]> {
        if let Some(a) = &self.agree {
            a.max(&mut values)?;
        }
        Ok(values)
    }

    pub fn micro_batch_size(&self) -> usize {
        self.policy.current
    }

    /// Memory as it stood right after the last successful attempt.
    pub fn last_memory(&self) -> MemoryStats {
        self.last_memory
    }

    /// Events since the last call, for metrics.jsonl.
    pub fn drain_events(&mut self) -> Vec<GuardEvent> {
        std::mem::take(&mut self.events)
    }

    /// Runs `attempt(ctx, micro_batch_size)` until it succeeds, shrinking on OOM.
    /// `cleanup(ctx)` must drop what a failed attempt left behind (gradients). Errors other
    /// than OOM pass through; an OOM at micro-batch 1 is `Error::Infeasible`.
    pub fn run<C, T>(
        &mut self,
        step: u64,
        ctx: &mut C,
        mut attempt: impl FnMut(&mut C, usize) -> Result<T>,
        mut cleanup: impl FnMut(&mut C),
    ) -> Result<T> {
        let baseline = memory::stats(self.device).live_bytes;
        if let Some(growth) = self.leak.observe(step, baseline, self.leak_steps) {
            tracing::warn!(
                "live memory at step start has grown {} steps in a row, by {} per step (now {}): is a tensor or graph kept across steps?",
                self.leak_steps, human_bytes(growth), human_bytes(baseline)
            );
            self.events.push(GuardEvent::Leak(LeakEvent {
                step,
                live_bytes: baseline,
                growth_bytes_per_step: growth,
            }));
        }
        loop {
            let mb = self.policy.current;
            memory::reset_peak(self.device);
            if self.snapshot.is_some() {
                snapshot::mark_attempt(step);
            }
            let t0 = Instant::now();
            let oom = match attempt(ctx, mb) {
                Ok(out) => {
                    self.observe(step, baseline)?;
                    return Ok(out);
                }
                Err(Error::Oom(oom)) if self.enabled => oom,
                Err(Error::Oom(oom)) => {
                    // The guard is off: the run ends, explained all the same.
                    if let Some(d) = self.dump(step, &oom, mb) {
                        tracing::warn!("{} ({}/)", d.text, d.folder);
                    }
                    return Err(Error::Oom(oom));
                }
                Err(e) => return Err(e),
            };
            // Before cleanup: the failed attempt's gradients still show as gradients.
            let dumped = self.dump(step, &oom, mb);
            // Every tensor of the attempt is dropped by now (it returned); gradients are not.
            cleanup(ctx);
            memory::empty_cache(self.device)?;
            let after = memory::stats(self.device).live_bytes;
            let leftover = after.saturating_sub(baseline);
            let severe = policy::left_behind(leftover, baseline);
            if severe {
                tracing::warn!(
                    "after cleanup {} more is live than at step start; shrinking harder",
                    human_bytes(leftover)
                );
            }
            // Ranks that did not run out cleaned up too, and all decide on the same inputs.
            let [severe, sig] = self.agreed([severe as u8 as f64, (signature(&oom) >> 11) as f64])?;
            let decision = self
                .policy
                .on_oom(step, severe > 0.0, Some(sig as u64), self.cfg.retries_at_one);
            let new = match decision {
                OnOom::Retry { micro_batch_size } => micro_batch_size,
                OnOom::GiveUp => 0,
            };
            let mut event = self.oom_event(step, &oom, baseline, after, mb, new, t0.elapsed().as_secs_f64());
            tracing::warn!(
                "OOM at step {step} ({} phase): {}; micro-batch {mb} -> {}{}",
                event
                    .phase
                    .map_or("unknown".into(), |p| format!("{p:?}").to_lowercase()),
                oom.message,
                if new == 0 {
                    "none left".to_string()
                } else {
                    new.to_string()
                },
                // What `oomguard launch` reads to relaunch at half, should the process die later.
                if new == 0 {
                    String::new()
                } else {
                    format!("; micro_batch_size={new}")
                },
            );
            if let Some(d) = &dumped {
                tracing::warn!("{} ({}/)", d.text, d.folder);
                event.memory_summary = Some(d.text.clone());
                event.snapshot = Some(d.folder.clone());
            }
            self.events.push(GuardEvent::Oom(event));
            if decision == OnOom::GiveUp {
                let what = dumped
                    .map(|d| format!(" What filled memory ({}/): {}", d.folder, d.text))
                    .unwrap_or_default();
                return Err(Error::Infeasible(format!(
                    "{}{what}",
                    infeasible_message(step, &oom, baseline, self.eval)
                )));
            }
        }
    }

    /// Records an OOM that was handled outside the policy (a checkpoint write retried): the
    /// micro-batch is unchanged.
    pub fn note_oom(&mut self, step: u64, oom: &OomError, phase: Phase) {
        let live = memory::stats(self.device).live_bytes;
        let mb = self.policy.current;
        let mut event = self.oom_event(step, oom, live, live, mb, mb, 0.0);
        event.phase = Some(phase);
        self.events.push(GuardEvent::Oom(event));
    }

    /// RUN_DIR/oom/NNN/ for this OOM, if snapshots are on (a failure is only a warning).
    fn dump(&self, step: u64, oom: &OomError, mb: usize) -> Option<Dumped> {
        let at = OomAt {
            step,
            phase: if self.eval { Some(Phase::Eval) } else { oom.phase },
            micro_batch_index: oom.micro_batch,
            micro_batch_size: mb,
            requested_bytes: oom.requested_bytes,
        };
        self.snapshot.as_ref()?.borrow_mut().on_oom(&at)
    }

    #[allow(clippy::too_many_arguments)]
    fn oom_event(
        &self,
        step: u64,
        oom: &OomError,
        before: u64,
        after: u64,
        old: usize,
        new: usize,
        lost: f64,
    ) -> OomEvent {
        OomEvent {
            step,
            phase: if self.eval { Some(Phase::Eval) } else { oom.phase },
            micro_batch_index: oom.micro_batch,
            source: oom.source,
            requested_bytes: oom.requested_bytes,
            memory_before: before,
            memory_after_cleanup: after,
            limit_bytes: oom.capacity_bytes.or(memory::stats(self.device).limit_bytes),
            old_micro_batch_size: old,
            new_micro_batch_size: new,
            time_lost_s: lost,
            message: oom.message.clone(),
            memory_summary: None,
            snapshot: None,
        }
    }

    fn observe(&mut self, step: u64, baseline: u64) -> Result<()> {
        let mem = memory::stats(self.device);
        self.last_memory = mem;
        // The tightest rank's figures (the largest peak, the smallest limit) for everyone.
        let limit = mem.limit_bytes.map_or(f64::NEG_INFINITY, |l| -(l as f64));
        let retries = mem.alloc_retries.map_or(-1.0, |r| r as f64);
        let [peak, base, limit, retries] = self.agreed([mem.peak_bytes as f64, baseline as f64, limit, retries])?;
        let obs = Observation {
            baseline_bytes: base as u64,
            peak_bytes: peak as u64,
            limit_bytes: limit.is_finite().then(|| (-limit) as u64),
            alloc_retries: (retries >= 0.0).then_some(retries as u64),
        };
        let old = self.policy.current;
        match self.policy.after_step(step, obs, &self.cfg) {
            Adjust::Keep => {}
            Adjust::Grow { micro_batch_size } => {
                tracing::info!(
                    "memory allows: micro-batch {old} -> {micro_batch_size} from step {}; micro_batch_size={micro_batch_size}",
                    step + 1
                );
                self.events.push(GuardEvent::Grow(ResizeEvent {
                    step,
                    old_micro_batch_size: old,
                    new_micro_batch_size: micro_batch_size,
                    reason: "headroom".into(),
                }));
            }
            Adjust::Shrink { micro_batch_size } => {
                tracing::warn!(
                    "allocator retries rising: micro-batch {old} -> {micro_batch_size} before a hard OOM; \
                     micro_batch_size={micro_batch_size}"
                );
                self.events.push(GuardEvent::Shrink(ResizeEvent {
                    step,
                    old_micro_batch_size: old,
                    new_micro_batch_size: micro_batch_size,
                    reason: "alloc_retries".into(),
                }));
            }
        }
        Ok(())
    }
}

/// Where an OOM happened, as exactly as the error says: a step that does not fit fails at
/// the same allocation (phase, micro-batch, bytes asked, bytes free) every time.
fn signature(oom: &OomError) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (
        oom.phase.map(|p| p as u8),
        oom.micro_batch,
        oom.requested_bytes,
        oom.free_bytes,
        oom.source as u8,
    )
        .hash(&mut h);
    h.finish()
}

fn infeasible_message(step: u64, oom: &OomError, baseline: u64, eval: bool) -> String {
    let what = if eval { "an evaluation batch" } else { "a training step" };
    let limit = oom
        .capacity_bytes
        .map(|c| format!(" of {}", human_bytes(c)))
        .unwrap_or_default();
    let wanted = oom
        .requested_bytes
        .map(|r| format!(", the failed allocation wanted {}", human_bytes(r)))
        .unwrap_or_default();
    format!(
        "step {step}: {what} does not fit in memory even at micro-batch 1: {} is in use before the step (model, gradients, optimizer state){limit}{wanted}. \
         To fit: raise memory.budget or use a device with more memory, shorten model.block_size, \
         or shrink the model (model.n_layer, model.n_embd, model.vocab_size). libtorch said: {}",
        human_bytes(baseline), oom.message
    )
}
