//! Owns metrics.jsonl, the `log` section and the run's log file.
//! Keeps: each line is flushed as written, so a crash loses nothing already recorded.
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

pub use oomguard_console::logfile::{set_log_file, LogFileWriter};

use crate::error::ConfigError;
use crate::error::{Error, Result};
use crate::guard::{GuardEvent, LeakEvent, OomEvent, ResizeEvent};
use crate::memory::MemoryStats;
use oomguard_report::tensorboard::EventWriter;

/// The `log` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// A progress line every this many steps.
    pub every: u64,
    /// Also write TensorBoard scalars into RUN_DIR/tensorboard/ (rank 0).
    pub tensorboard: bool,
    /// Also log rank 0's records to these trackers (`wandb`, `mlflow`), under HF Trainer's
    /// metric names (crate::trackers).
    pub trackers: Vec<String>,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            every: 10,
            tensorboard: false,
            trackers: Vec::new(),
        }
    }
}

impl LogConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.every == 0 {
            return Err(ConfigError::invalid("log.every", "is 0; it must be at least 1"));
        }
        for name in &self.trackers {
            crate::trackers::check(name, "log.trackers")?;
        }
        Ok(())
    }
}

/// `{"event":"step", ...}`: one per optimizer step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub micro_batch_size: usize,
    pub grad_accum_steps: usize,
    /// Samples trained on in this step (the global batch, over all ranks).
    pub num_samples: usize,
    /// Data-parallel processes that trained the step together (1: a single process).
    pub world_size: usize,
    pub step_time_s: f64,
    pub elapsed_s: f64,
    /// Seconds the rest of the run should take (steps, evaluations, checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_s: Option<f64>,
    pub memory: MemoryStats,
    /// Where the step ran (`cpu`, `cuda:0`): what a reader such as scripts/gpu_check.py
    /// checks, rather than the config's `auto`.
    #[serde(default)]
    pub device: String,
    /// The forward's precision (fp32, bf16 or fp16) and whether blocks are recomputed.
    pub precision: crate::precision::Precision,
    pub activation_checkpointing: bool,
    /// fp16: the loss scale after the step, and whether the update was skipped (overflow).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// Data parallel: seconds in the ranks' agreements and the gradient all-reduce.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_s: Option<f64>,
    /// Data parallel: of `comm_s`, seconds in the ranks' agreements.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agree_s: Option<f64>,
    /// Data parallel: seconds in the optimizer's update, ZeRO's all-gather of the
    /// parameters included (not in `comm_s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_s: Option<f64>,
    /// Data parallel: what the ranks split (`none`, `optimizer`, `gradients`): the
    /// configured `train.shard`, or a rung climbed.
    #[serde(default)]
    pub shard: crate::optim::Shard,
    /// Device-to-host reads the step made (`ops::read`; 1, more only after an OOM retry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub d2h_reads: Option<u64>,
    /// `OOMGUARD_CUDA_SYNC_DEBUG=1`: CUDA's count of synchronizing calls so far on the
    /// training thread (sync-debug mode), to check `d2h_reads` against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_syncs: Option<u64>,
    /// Data parallel: bytes this rank sent and received on the ranks' exchange during the
    /// step (the control plane; a fixed message, at most three neighbours: docs/scaling.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange_bytes: Option<u64>,
}

/// A device as step records name it: `cpu`, `cuda:N`.
pub fn device_label(device: tch::Device) -> String {
    match device {
        tch::Device::Cuda(i) => format!("cuda:{i}"),
        d => format!("{d:?}").to_lowercase(),
    }
}

/// `{"event":"rung", ...}`: the guard climbed below micro-batch 1.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RungRecord {
    pub step: u64,
    pub rung: crate::guard::ladder::Rung,
    pub reason: String,
}

/// `{"event":"membership", ...}`: an elastic job's world changed before this attempt (a
/// node lost or joined; `cause` says which). `seconds`: from the change's detection to the
/// end of the first step at the new world; `steps_recomputed`: steps done before the change
/// and done again; `source`: where the state came from, `survivors` (saved from a survivor's
/// memory as it saw the change, or at the step boundary a joining node waited for) or
/// `checkpoint` (the newest regular one: sharded state whose owner died).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MembershipRecord {
    pub step: u64,
    pub old_world: usize,
    pub new_world: usize,
    pub cause: String,
    pub seconds: f64,
    pub steps_recomputed: u64,
    pub source: String,
}

/// `{"event":"eval", ...}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalRecord {
    pub step: u64,
    pub val_loss: f64,
    /// The configured evaluation batch (`train.eval_batch_size`).
    pub eval_batch_size: usize,
    /// The micro-batch it ran in (smaller after an OOM in evaluation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_micro_batch_size: Option<usize>,
}

/// Every line of metrics.jsonl, tagged by `event`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Record {
    Step(StepRecord),
    /// The run stopped on a signal (after its checkpoint).
    Stopped {
        step: u64,
        signal: String,
    },
    /// `micro_batch_size: auto` resolved (searched or cached).
    AutoMicroBatch(crate::plan::AutoResult),
    /// The run resumed from a checkpoint, in `precision`, which came from `precision_from`:
    /// `checkpoint` (the precision it recorded, a rung climbed included), `--set` (given on
    /// the resuming command, which wins) or `config` (a checkpoint that recorded none).
    Resumed {
        step: u64,
        checkpoint: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        precision: Option<crate::precision::Precision>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        precision_from: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint_precision: Option<crate::precision::Precision>,
    },
    Eval(EvalRecord),
    Oom(OomEvent),
    Grow(ResizeEvent),
    Shrink(ResizeEvent),
    LeakWarning(LeakEvent),
    Rung(RungRecord),
    /// A sharding rung left when memory allowed (`rung`: the one left).
    RungDown(RungRecord),
    Membership(MembershipRecord),
    /// A checkpoint written: after `step`, resuming at `next_step`, for `reason`; what it
    /// cost (`seconds`, `bytes` on disk) and the clock's interval in force (`interval_s`,
    /// absent with the clock off).
    Checkpoint {
        step: u64,
        next_step: u64,
        reason: crate::checkpoint::Reason,
        seconds: f64,
        bytes: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        interval_s: Option<f64>,
        /// The most any rank's resident host memory rose above where it was while writing
        /// it (VmHWM; absent where the kernel cannot reset it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host_peak_rise_bytes: Option<u64>,
    },
    /// A resume whose config differs from the run's stored one: every key that changed,
    /// with its stored and new value; `allowed` when a change that alters the run was
    /// accepted with `--allow-change`; `kept`: the earlier config's copy.
    ConfigChanged {
        step: u64,
        changes: Vec<crate::config::resume::Change>,
        allowed: bool,
        kept: String,
    },
}

impl From<GuardEvent> for Record {
    fn from(e: GuardEvent) -> Record {
        match e {
            GuardEvent::Oom(o) => Record::Oom(o),
            GuardEvent::Grow(r) => Record::Grow(r),
            GuardEvent::Shrink(r) => Record::Shrink(r),
            GuardEvent::Leak(l) => Record::LeakWarning(l),
        }
    }
}

pub struct MetricsWriter {
    out: BufWriter<File>,
    path: String,
    tensorboard: Option<EventWriter>,
    /// Last in the struct: dropped after the file is flushed, it reads to the end.
    trackers: Option<crate::trackers::Follower>,
}

/// A record's TensorBoard scalars (`log.tensorboard`): its step and (tag, value)s.
fn tensorboard_scalars(record: &Record) -> Option<(u64, Vec<(&'static str, f64)>)> {
    Some(match record {
        Record::Step(r) => {
            let mut v = vec![
                ("train/loss", r.loss),
                ("train/lr", r.lr),
                ("train/grad_norm", r.grad_norm),
                ("train/tokens_per_s", r.tokens_per_s),
                ("train/micro_batch_size", r.micro_batch_size as f64),
                ("train/grad_accum_steps", r.grad_accum_steps as f64),
                ("memory/live_bytes", r.memory.live_bytes as f64),
                ("memory/peak_bytes", r.memory.peak_bytes as f64),
            ];
            v.extend(r.memory.limit_bytes.map(|l| ("memory/limit_bytes", l as f64)));
            v.extend(
                r.memory
                    .host_rss_anon_bytes
                    .map(|b| ("memory/host_rss_anon_bytes", b as f64)),
            );
            (r.step, v)
        }
        Record::Eval(e) => (e.step, vec![("eval/val_loss", e.val_loss)]),
        Record::Oom(o) => (
            o.step,
            vec![
                ("guard/oom", 1.0),
                ("guard/oom_new_micro_batch_size", o.new_micro_batch_size as f64),
            ],
        ),
        Record::Shrink(r) => (
            r.step,
            vec![("guard/shrink_micro_batch_size", r.new_micro_batch_size as f64)],
        ),
        Record::Grow(r) => (
            r.step,
            vec![("guard/grow_micro_batch_size", r.new_micro_batch_size as f64)],
        ),
        Record::Resumed { step, .. } => (*step, vec![("guard/resumed", 1.0)]),
        _ => return None,
    })
}

impl MetricsWriter {
    /// For a run resuming at `next_step`: records of later steps (work the resumed run
    /// redoes) and any torn last line move to metrics.replaced.jsonl, so metrics.jsonl
    /// reads as one uninterrupted run and nothing written is lost.
    pub fn resume(dir: &Path, next_step: u64) -> Result<MetricsWriter> {
        oomguard_runfiles::metrics::resume(dir, next_step).map_err(|e| {
            Error::io(
                format!(
                    "cannot set aside {}'s later records",
                    dir.join("metrics.jsonl").display()
                ),
                e,
            )
        })?;
        Self::open(dir)
    }

    /// Appends to `dir/metrics.jsonl`.
    pub fn open(dir: &Path) -> Result<MetricsWriter> {
        let path = dir.join("metrics.jsonl");
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path);
        let file = file.map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
        Ok(MetricsWriter {
            out: BufWriter::new(file),
            path: path.display().to_string(),
            tensorboard: None,
            trackers: None,
        })
    }

    /// `log.trackers` (and OOMGUARD_TRACKERS): the records written from now on also go to
    /// those trackers. One that cannot start is a config error, before the first step.
    /// `origin`: the config file, which errors name; `resumed`: as `Follower::start` takes it.
    pub fn with_trackers(
        mut self,
        configured: &[String],
        dir: &Path,
        config_json: &str,
        origin: &str,
        resumed: bool,
    ) -> Result<MetricsWriter> {
        let named = |e: ConfigError| match e.origin.is_empty() {
            true => ConfigError {
                origin: origin.into(),
                ..e
            },
            false => e,
        };
        let names = crate::trackers::chosen(configured).map_err(named)?;
        if !names.is_empty() {
            let offset = std::fs::metadata(dir.join("metrics.jsonl")).map_or(0, |m| m.len());
            let follower =
                crate::trackers::Follower::start(&names, dir, offset, config_json, resumed).map_err(named)?;
            self.trackers = Some(follower);
        }
        Ok(self)
    }

    /// `log.tensorboard`: every record also goes to `dir/tensorboard/` as scalars. TensorBoard
    /// is a convenience: failing to write it warns and never stops the run.
    pub fn with_tensorboard(mut self, enabled: bool, dir: &Path) -> MetricsWriter {
        if enabled {
            match EventWriter::create(&dir.join("tensorboard")) {
                Ok(w) => self.tensorboard = Some(w),
                Err(e) => tracing::warn!(
                    "log.tensorboard: cannot create an event file in {}: {e}; metrics.jsonl only",
                    dir.join("tensorboard").display()
                ),
            }
        }
        self
    }

    /// metrics.jsonl on disk (fsync): before a checkpoint names a step, the records up to it
    /// are kept through a power loss too, so a resume finds the evaluations it will not redo.
    pub fn sync(&mut self) -> Result<()> {
        self.out
            .flush()
            .and_then(|_| self.out.get_ref().sync_data())
            .map_err(|e| Error::io(format!("cannot write {}", self.path), e))
    }

    pub fn write(&mut self, record: &Record) -> Result<()> {
        let line =
            serde_json::to_string(record).map_err(|e| Error::Data(format!("cannot encode a metrics record: {e}")))?;
        writeln!(self.out, "{line}")
            .and_then(|_| self.out.flush())
            .map_err(|e| Error::io(format!("cannot write {}", self.path), e))?;
        if let (Some(tb), Some((step, scalars))) = (self.tensorboard.as_mut(), tensorboard_scalars(record)) {
            if let Err(e) = tb.scalars(step, &scalars) {
                tracing::warn!(
                    "log.tensorboard: cannot write {}: {e}; TensorBoard logging stops, metrics.jsonl goes on",
                    tb.path().display()
                );
                self.tensorboard = None;
            }
        }
        Ok(())
    }
}
