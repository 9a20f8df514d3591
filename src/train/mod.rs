//! Owns training for any `Task`: the config section, the step, evaluation, the run and the loop.
//! Keeps: the global batch and its samples per step never depend on the micro-batch.
mod eval;
mod progress;
mod run;
mod step;
mod trainer;

pub use eval::{evaluate, EvalSpec};
pub use run::{check_world, Builder};
pub use step::{
    accumulate, commit_update, dist_step, micro_batches, prepare_update, split_range, step_with, train_step, update,
    Outcome, StepStats, Update,
};
pub use trainer::{train, train_with, ConfigFiles, Options, Resume, Summary};

use serde::{Deserialize, Serialize};
use tch::Device;

use crate::error::{ConfigError, Result};

/// `train.micro_batch_size`: a number, or `auto` (the largest that fits, found at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MicroBatch {
    Auto,
    Size(usize),
}

impl Serialize for MicroBatch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            MicroBatch::Auto => s.serialize_str("auto"),
            MicroBatch::Size(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for MicroBatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Size(usize),
            Text(String),
            Other(serde_yaml::Value),
        }
        let what = match Raw::deserialize(d)? {
            Raw::Size(n) => return Ok(MicroBatch::Size(n)),
            Raw::Text(t) if t == "auto" => return Ok(MicroBatch::Auto),
            Raw::Text(t) => t,
            Raw::Other(v) => serde_yaml::to_string(&v).unwrap_or_default().trim().to_string(),
        };
        Err(serde::de::Error::custom(format!(
            "`{what}` is not a micro-batch size; use a whole number of samples from 1, or auto"
        )))
    }
}

/// The `train` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    pub micro_batch_size: MicroBatch,
    pub grad_accum_steps: usize,
    /// Samples per optimizer step. Required with `micro_batch_size: auto`; otherwise it
    /// defaults to micro_batch_size x grad_accum_steps (given with grad_accum_steps, it must
    /// equal it; given alone, micro-batches of micro_batch_size cut it, the last maybe smaller).
    pub global_batch_size: Option<usize>,
    pub max_steps: u64,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_every: u64,
    pub eval_batch_size: usize,
    pub eval_batches: usize,
    pub seed: u64,
    /// `auto` (CUDA when present), `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Intra-op threads; unset: this process's CPU share (OMP_NUM_THREADS, else the
    /// smallest of the affinity mask, cgroup CPU quota and SLURM_CPUS_PER_TASK).
    pub num_threads: Option<usize>,
    /// `auto` (bf16 on a GPU that runs it natively, else fp32), `fp32`, `bf16` or `fp16`.
    pub precision: crate::precision::PrecisionConfig,
    /// fp16's loss scaling (GradScaler's arguments).
    pub grad_scaler: crate::precision::GradScalerConfig,
    /// Data parallel: how long a collective may wait for the other ranks (seconds).
    pub dist_timeout_s: u64,
    /// Data parallel: `none`, `optimizer` (ZeRO-1: AdamW's moments split across the ranks)
    /// or `gradients` (ZeRO-2: the summed gradients too). A single process ignores it.
    pub shard: crate::optim::Shard,
    /// Data parallel: the gradients' all-reduce starts from backward, bucket by bucket, as
    /// each bucket's gradients complete on an attempt's last micro-batch (false: after
    /// backward). Unset: on for CUDA, for ranks on several machines, and under ZeRO-2 (where
    /// it is what frees the gradients during backward); off otherwise for CPU ranks that all
    /// share one machine, where the transfer is CPU work that would compete with their own.
    pub overlap_grad_reduce: Option<bool>,
    /// Data parallel: the most MiB of gradients a bucket holds, overlapped or after backward
    /// (a parameter larger than that is a bucket alone, reduced in place). Unset: 1 MiB, or
    /// less under a small fixed `memory.budget` (`dist::overlap::bucket_bytes`).
    pub bucket_cap_mb: Option<f64>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            micro_batch_size: MicroBatch::Size(8),
            grad_accum_steps: 1,
            global_batch_size: None,
            max_steps: 100,
            eval_every: 50,
            eval_batch_size: 16,
            eval_batches: 4,
            seed: 1337,
            device: "auto".into(),
            num_threads: None,
            precision: Default::default(),
            grad_scaler: Default::default(),
            dist_timeout_s: 1800,
            shard: Default::default(),
            overlap_grad_reduce: None,
            bucket_cap_mb: None,
        }
    }
}

/// The most samples a batch setting takes (`micro_batch_size`, `global_batch_size`, ...):
/// beyond any step that trains, and far from overflowing the sums of sizes.
pub const MAX_ROWS: usize = 1 << 24;

impl TrainConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        /// About 31 years: past it, a deadline of `Instant::now()` plus it can overflow.
        const MAX_TIMEOUT_S: u64 = 1_000_000_000;
        for (k, v) in [
            (
                "train.micro_batch_size",
                if let MicroBatch::Size(m) = self.micro_batch_size {
                    m
                } else {
                    1
                },
            ),
            ("train.grad_accum_steps", self.grad_accum_steps),
            ("train.global_batch_size", self.global_batch_size.unwrap_or(1)),
            ("train.eval_batch_size", self.eval_batch_size),
            ("train.eval_batches", self.eval_batches),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(k, "is 0; it must be at least 1"));
            }
            if v > MAX_ROWS {
                return Err(ConfigError::invalid(
                    k,
                    format!("is {v}; it must be at most {MAX_ROWS} (2^24)"),
                ));
            }
        }
        if let MicroBatch::Size(m) = self.micro_batch_size {
            if m * self.grad_accum_steps > MAX_ROWS {
                return Err(ConfigError::invalid(
                    "train.grad_accum_steps",
                    format!(
                        "makes a global batch of {m} x {} = {} samples; it must be at most {MAX_ROWS} (2^24)",
                        self.grad_accum_steps,
                        m * self.grad_accum_steps
                    ),
                ));
            }
        }
        match (self.micro_batch_size, self.global_batch_size) {
            (MicroBatch::Auto, None) => {
                return Err(ConfigError::invalid(
                    "train.global_batch_size",
                    "is required with micro_batch_size: auto (the samples per optimizer step)",
                ));
            }
            // With grad_accum_steps left at 1, the global batch is split into micro-batches of at
            // most micro_batch_size (the last may be smaller).
            (MicroBatch::Size(m), Some(g)) if self.grad_accum_steps > 1 && m * self.grad_accum_steps != g => {
                return Err(ConfigError::invalid(
                    "train.global_batch_size",
                    format!("is {g} but micro_batch_size x grad_accum_steps is {m} x {} = {}; make them agree, or leave grad_accum_steps \
                        out", self.grad_accum_steps, m * self.grad_accum_steps),
                ));
            }
            _ => {}
        }
        if self.max_steps == 0 {
            return Err(ConfigError::invalid("train.max_steps", "is 0; it must be at least 1"));
        }
        if let Some(n) = self
            .num_threads
            .filter(|n| !(1..=oomguard_host::threads::MAX_THREADS).contains(n))
        {
            return Err(ConfigError::invalid(
                "train.num_threads",
                format!(
                    "is {n}; it must be 1 to {}, or left unset for this process's CPU share (affinity, cgroup \
                     quota, Slurm)",
                    oomguard_host::threads::MAX_THREADS
                ),
            ));
        }
        if !(1..=MAX_TIMEOUT_S).contains(&self.dist_timeout_s) {
            return Err(ConfigError::invalid(
                "train.dist_timeout_s",
                format!(
                    "is {}; it must be 1 to {MAX_TIMEOUT_S} seconds (default 1800)",
                    self.dist_timeout_s
                ),
            ));
        }
        let most = crate::dist::overlap::MAX_BUCKET_MB;
        if let Some(mb) = self.bucket_cap_mb.filter(|mb| !(*mb > 0.0 && *mb <= most)) {
            return Err(ConfigError::invalid(
                "train.bucket_cap_mb",
                format!(
                    "is {mb}; it must be a positive number of MiB up to {most} (1 TiB), or left out (default {} MiB, less under a small memory.budget)",
                    crate::dist::overlap::DEFAULT_BUCKET_MB
                ),
            ));
        }
        parse_device(&self.device)?;
        self.grad_scaler.validate()
    }

    /// A bucket's most bytes: `bucket_cap_mb` where set, else the default for `memory`'s
    /// budget (the same on every rank: a fixed budget is the config's, never measured).
    pub fn bucket_bytes(&self, memory: &crate::memory::MemoryConfig) -> usize {
        let fixed = match memory.budget() {
            Ok(crate::memory::Budget::Bytes(b)) => Some(b),
            _ => None,
        };
        crate::dist::overlap::bucket_bytes(self.bucket_cap_mb, fixed)
    }

    /// The global batch: samples per optimizer step, whatever the micro-batch.
    pub fn global_batch_size(&self) -> usize {
        match (self.global_batch_size, self.micro_batch_size) {
            (Some(g), _) => g,
            (None, MicroBatch::Size(m)) => m * self.grad_accum_steps,
            (None, MicroBatch::Auto) => self.grad_accum_steps, // refused by validate()
        }
    }

    /// An explicit CUDA device where PyTorch sees none (or fewer): refused before anything
    /// runs. Call it after the allocator settings, as `device`.
    pub fn check_device(&self) -> Result<(), ConfigError> {
        if let Ok(Some(Device::Cuda(i))) = parse_device(&self.device) {
            let n = if crate::memory::cuda_available() {
                tch::Cuda::device_count()
            } else {
                0
            };
            if i as i64 >= n {
                return Err(ConfigError::invalid(
                    "train.device",
                    format!(
                        "is {} but PyTorch sees {n} CUDA device(s) here; use auto (a GPU when there is one){}",
                        self.device,
                        if n > 0 {
                            format!(", cpu, or cuda:0 to cuda:{}", n - 1)
                        } else {
                            " or cpu".into()
                        }
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The device to train on; `auto` asks whether CUDA is present, so call it when the run
    /// starts (after the allocator settings), not while validating.
    pub fn device(&self) -> Device {
        match parse_device(&self.device) {
            Ok(Some(d)) => d,
            Ok(None) if crate::memory::cuda_available() => Device::Cuda(0),
            _ => Device::Cpu,
        }
    }
}

/// A device name: `None` for `auto`.
fn parse_device(s: &str) -> Result<Option<Device>, ConfigError> {
    let bad = || {
        ConfigError::invalid(
            "train.device",
            format!("`{s}` is not a device; use auto, cpu, cuda or cuda:N"),
        )
    };
    Ok(match s {
        "auto" => None,
        "cpu" => Some(Device::Cpu),
        "cuda" => Some(Device::Cuda(0)),
        _ => Some(Device::Cuda(
            s.strip_prefix("cuda:").and_then(|i| i.parse().ok()).ok_or_else(bad)?,
        )),
    })
}
