//! Owns the training loop, for any `Task`; `Run` (run.rs) holds what it works with.
//! Keeps: a run stops or checkpoints only at a step boundary, and ends with a checkpoint.
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::run::{Builder, Run};
use crate::checkpoint::Reason;
use crate::config::Config;
use crate::error::{ConfigError, Error, Result};
use crate::memory::allocator::AllocatorSettings;
use crate::memory::inject::{InjectOom, Injection};
use crate::metrics::Record;
use crate::task::build_from_config;

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

/// How to run, besides the config.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub resume: Resume,
    /// `--inject-oom COUNT[:SEED]`: allocation failures injected on purpose (CPU runs).
    pub inject_oom: Option<InjectOom>,
    /// `--set train.precision=...` was given: on resume it wins over the precision the
    /// checkpoint recorded (which may be a rung the run climbed to).
    pub precision_set: bool,
    /// A resume whose config differs from the stored one (recorded once resumed).
    pub config_changed: Option<crate::config::resume::Changed>,
    /// A resume's config files, which rank 0 writes once the checkpoint has loaded.
    pub config_files: Option<ConfigFiles>,
}

/// The run directory's config files: `config.yaml` (the resolved config) and, where a
/// resume changed it, the earlier one kept as `config.NNN.yaml`. A resume writes them once
/// its checkpoint has loaded, so a refused or failed resume leaves them as they were.
#[derive(Debug, Clone, Default)]
pub struct ConfigFiles {
    pub run_dir: PathBuf,
    pub resolved: String,
    /// `config.NNN.yaml`: the name the earlier config is kept under.
    pub keep_as: Option<String>,
}

impl ConfigFiles {
    pub fn write(&self) -> Result<()> {
        use oomguard_report::atomic;
        let path = self.run_dir.join("config.yaml");
        if let Some(kept) = &self.keep_as {
            let to = self.run_dir.join(kept);
            let text = std::fs::read(&path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
            atomic::write(&to, &text)
                .map_err(|e| Error::io(format!("keeping the earlier config as {}", to.display()), e))?;
        }
        atomic::write(&path, self.resolved.as_bytes()).map_err(|e| Error::io(format!("writing {}", path.display()), e))
    }
}

/// What a finished run reports.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Summary {
    pub steps: u64,
    pub first_loss: f64,
    pub final_loss: f64,
    pub val_loss: Option<f64>,
    pub best_val_loss: Option<f64>,
    pub wall_s: f64,
    /// Training throughput, evaluation time excluded.
    pub tokens_per_s: f64,
    pub peak_bytes: u64,
    pub num_ooms: u64,
    pub final_micro_batch_size: usize,
    /// `--inject-oom`: (failures injected, failures asked for).
    pub injected: Option<(u64, u32)>,
}

/// Trains the model the config describes (`kind: gpt` or `torchscript`) into `run_dir`.
/// `settings` are the allocator settings in force.
pub fn train(cfg: &Config, run_dir: &Path, settings: &AllocatorSettings, options: Options) -> Result<Summary> {
    train_with(cfg, run_dir, settings, options, &build_from_config)
}

/// Trains the model `build` makes (a Rust program's own, or a config's) into `run_dir`.
pub fn train_with(
    cfg: &Config,
    run_dir: &Path,
    settings: &AllocatorSettings,
    options: Options,
    build: Builder,
) -> Result<Summary> {
    let c = &cfg.raw;
    if options.inject_oom.is_some() && c.train.device().is_cuda() {
        return Err(ConfigError::invalid(
            "--inject-oom",
            "injects failures into the CPU allocator; it needs train.device: cpu",
        )
        .into());
    }
    let mut run = Run::start(cfg, run_dir, settings, &options, build)?;
    // Each rank draws its own failures from (SEED, rank): they land on any subset of ranks.
    let mut inject = options.inject_oom.map(|i| Injection::new(i.for_rank(run.rank())));
    let mut eval_s = 0.0;
    crate::signals::training_started();
    let trained = steps(&mut run, &mut inject, &mut eval_s);
    // Elastic: a peer is gone. What this rank holds is the run as of its last step done.
    if let (Err(e @ Error::Dist(_)), true) = (&trained, crate::dist::elastic::enabled()) {
        run.save_as_survivor(e);
    }
    trained?;
    run.save_weights()?;
    run.snapshot_at_end();
    run.progress.finish();
    let s = &mut run.summary;
    s.wall_s = run.progress.elapsed();
    s.tokens_per_s =
        (c.train.max_steps.saturating_sub(run.first_step) as usize * run.units_per_step) as f64 / (s.wall_s - eval_s);
    s.num_ooms = run.guard.policy.num_ooms + run.eval_guard.policy.num_ooms;
    s.final_micro_batch_size = run.guard.micro_batch_size();
    s.injected = inject.map(|i| i.report());
    Ok(run.summary)
}

/// The loop, from the run's next step to its end checkpoint.
fn steps(run: &mut Run<'_>, inject: &mut Option<Injection>, eval_s: &mut f64) -> Result<()> {
    let cfg: &Config = run.cfg;
    let c = &cfg.raw;
    let schedule = run.progress.schedule;
    let pause = test_hook!("OOMGUARD_TEST_STEP_PAUSE_MS").and_then(|ms| ms.parse().ok());
    for step in run.next_step..c.train.max_steps {
        if let Some(ms) = pause {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        let at = run.boundary()?;
        if let Some(signal) = at.signal {
            run.checkpoint(step, Reason::Signal)?;
            run.write(&Record::Stopped {
                step: step.saturating_sub(1),
                signal: signal.name().into(),
            })?;
            return Err(Error::Interrupted { signal, step });
        }
        if at.clock {
            run.checkpoint(step, Reason::EveryMinutes)?;
        }
        run.pressure.update(step);
        let evaluates = schedule.evaluates(step);
        if let Some(i) = inject.as_mut() {
            i.before_step(step, c.train.max_steps, evaluates);
        }
        let stats = run.step(step)?;
        run.summary.first_loss = if step == run.first_step {
            stats.loss
        } else {
            run.summary.first_loss
        };
        run.summary.final_loss = stats.loss;
        if evaluates {
            if let Some(i) = inject.as_mut() {
                i.before_eval(step);
            }
            let t = Instant::now();
            run.evaluate(step)?;
            *eval_s += t.elapsed().as_secs_f64();
        }
        if schedule.checkpoints(step) {
            run.checkpoint(step + 1, Reason::EverySteps)?;
        }
    }
    // A run resumed past a lowered max_steps ran no step: its state is still next_step's (whose
    // checkpoint, on disk, is kept), never max_steps'.
    run.checkpoint(run.next_step.max(c.train.max_steps), Reason::End)
}
