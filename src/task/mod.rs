//! Owns `Task`: the one door every model comes through (GPT, TorchScript, Python, Rust).
//! Keeps: the loop, guard, checkpoints and data parallel serve every `Task` alike.
pub mod gpt;
#[cfg(feature = "python")]
pub mod python;
pub mod tensors;
pub mod torchscript;

use std::path::Path;
use tch::{Device, TchError, Tensor};

use crate::data::{DataConfig, Dataset};
use crate::error::{Error, Result};
use crate::model::{ModelConfig, ModelKind};
use crate::plan::Estimate;
use crate::precision::Amp;

/// What identifies a model's shape, as ordered (key, value) pairs: a checkpoint of another
/// shape is refused naming each difference, and the micro-batch cache keys on it.
pub type Fingerprint = Vec<(String, String)>;

/// A model as the trainer sees it: its named parameters and buffers and the fallible loss
/// of a micro-batch. Everything else has a default (autocast and backward, evaluation, weight
/// decay, the shape fingerprint), so a model implements two methods. Use only fallible calls
/// (`f_*`; [`crate::ops`] for scalar arithmetic): an allocation failure must come back as
/// `Err`, which the guard recovers from, never as a panic.
///
/// ```
/// use oomguard::task::Task;
/// use tch::{Device, Kind, Reduction, TchError, Tensor};
///
/// /// Least squares: one weight matrix, the mean squared error.
/// struct Linear {
///     w: Tensor,
/// }
///
/// impl Task for Linear {
///     fn parameters(&self) -> Vec<(String, Tensor)> {
///         vec![("w".into(), self.w.shallow_clone())]
///     }
///     fn loss(&self, x: &Tensor, y: &Tensor, _train: bool) -> Result<Tensor, TchError> {
///         x.f_matmul(&self.w)?.f_mse_loss(y, Reduction::Mean)
///     }
/// }
///
/// let cpu = (Kind::Float, Device::Cpu);
/// let model = Linear { w: Tensor::f_zeros([3, 1], cpu)?.f_set_requires_grad(true)? };
/// let (x, y) = (Tensor::f_ones([4, 3], cpu)?, Tensor::f_ones([4, 1], cpu)?);
/// assert_eq!(model.loss(&x, &y, true)?.f_double_value(&[])?, 1.0);
/// // The defaults: 1-D parameters get no weight decay, the fingerprint is every shape.
/// assert!(!model.no_weight_decay("w", &model.w));
/// assert_eq!(model.fingerprint(), [("parameter w".to_string(), "[3, 1]".to_string())]);
/// # Ok::<(), TchError>(())
/// ```
///
/// To train it, hand a builder that makes it to [`crate::cli::train::main_with`]
/// (`examples/mlp.rs` is a whole program).
pub trait Task {
    /// The trainable parameters by name (PyTorch's names where the model has them), each
    /// tensor once, in a stable order.
    fn parameters(&self) -> Vec<(String, Tensor)>;
    /// The state a step may change besides the parameters, saved and restored with the weights
    /// (BatchNorm's running statistics): snapshotted before an attempt, put back after a failed
    /// one, and rank 0's broadcast after each step. Not frozen parameters: those go in
    /// `state()` only.
    fn buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
    /// The mean loss over the micro-batch's samples. Fallible calls only: an allocation
    /// failure must come back as `Err`, never a panic.
    fn loss(&self, inputs: &Tensor, targets: &Tensor, train: bool) -> Result<Tensor, TchError>;
    /// A micro-batch's forward and backward: gradients accumulate into the parameters,
    /// weighted by `weight` (its share of the global batch). Returns the weighted loss, a
    /// detached scalar left on the device (never read here: the step reads its losses back
    /// once, after the update; see `ops::read`). By default the loss under autocast, then
    /// backward (scaled for fp16); a model that recomputes activations in backward does both
    /// itself. Errors are tagged with their phase (forward or backward).
    fn forward_backward(&self, inputs: &Tensor, targets: &Tensor, weight: f64, amp: &Amp) -> Result<Tensor> {
        let loss = forward(|| self.loss(inputs, targets, true), amp)?;
        backward(&loss, weight, amp)
    }
    /// The units the loss of this model's last forward averaged over, when its data counts
    /// them on the batch that forward built (`Samples::counted_in_forward`); else None.
    fn last_units(&self) -> Option<usize> {
        None
    }
    /// A micro-batch's forward, then its backward weighted by `weight(units)`, where units
    /// are what the forward counted (`last_units`); no backward when `weight` says None (no
    /// unit counts: the mean is undefined). Returns the weighted loss, as `forward_backward`.
    fn forward_backward_counted(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        amp: &Amp,
        weight: &mut dyn FnMut(usize) -> Option<f64>,
    ) -> Result<Option<Tensor>> {
        let loss = forward(|| self.loss(inputs, targets, true), amp)?;
        let units = self.last_units().ok_or_else(|| {
            Error::Data(format!(
                "{}: the data counts its loss units, but this model does not report them",
                self.describe()
            ))
        })?;
        weight(units).map(|w| backward(&loss, w, amp)).transpose()
    }
    /// Whether activation checkpointing is on; `None` if the model cannot do it.
    fn activation_checkpointing(&self) -> Option<bool> {
        None
    }
    /// Turns activation checkpointing on or off (models that can).
    fn set_activation_checkpointing(&mut self, _on: bool) {}
    /// Whether `forward_backward` accumulates each parameter's gradient at most once a
    /// micro-batch (one backward pass, or passes over disjoint parameters), so that data
    /// parallel may send a bucket as soon as its gradients are in. The default's does; a model
    /// whose passes touch a parameter twice (recomputation with tied weights) says false.
    /// (One that says true wrongly stops with an error naming this method, never trains on.)
    fn backward_is_one_pass(&self) -> bool {
        true
    }
    /// How the loss is computed (`model.loss`); `None` if the model has no such choice.
    fn loss_kind(&self) -> Option<crate::model::LossKind> {
        None
    }
    /// Changes `model.loss` (models that have the choice).
    fn set_loss_kind(&mut self, _loss: crate::model::LossKind) {}
    /// The evaluation loss (no grad is recorded around it); by default the loss in eval mode.
    fn eval_loss(&self, inputs: &Tensor, targets: &Tensor) -> Result<Tensor, TchError> {
        self.loss(inputs, targets, false)
    }
    /// Parameters AdamW applies no weight decay to; by default biases and norms (1-D).
    fn no_weight_decay(&self, _name: &str, param: &Tensor) -> bool {
        param.dim() < 2
    }
    /// The model's shape; by default every parameter's name and size.
    fn fingerprint(&self) -> Fingerprint {
        self.parameters()
            .iter()
            .map(|(n, t)| (format!("parameter {n}"), format!("{:?}", t.size())))
            .collect()
    }
    /// A line for the log: what is being trained.
    fn describe(&self) -> String {
        let n: i64 = self.parameters().iter().map(|(_, t)| t.numel() as i64).sum();
        format!("a model of {:.2}M parameters", n as f64 / 1e6)
    }
    /// The planner's formula for this model, where one exists (the GPT); other models are
    /// planned by measuring trial steps.
    fn formula(&self) -> Option<Estimate> {
        None
    }
    /// Random state the model keeps outside libtorch's generators (a Python model: Python's
    /// `random`), saved with checkpoints so that a resume continues it exactly.
    fn host_rng_state(&self) -> Option<serde_json::Value> {
        None
    }
    /// Puts back what `host_rng_state` returned.
    fn set_host_rng_state(&self, _state: &serde_json::Value) -> Result<()> {
        Ok(())
    }
    /// At each attempt of a step: the host generators seeded as torch's are, from
    /// (seed, step, rank): each rank its own stream, a retry the same draws, a resume nothing
    /// to restore.
    fn seed_host_rng(&self, _seed: u64) -> Result<()> {
        Ok(())
    }
    /// Everything `model.safetensors` and checkpoints hold: the parameters (under every name
    /// the model gives them: tied weights appear under each) and the buffers.
    fn state(&self) -> Vec<(String, Tensor)> {
        let mut all = self.parameters();
        all.extend(self.buffers());
        all
    }
}

/// Shallow copies of named tensors (the same tensors under the same names), as the `Task`
/// methods hand out what a model holds.
pub fn shallow(named: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    named.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
}

/// `f` under autocast; an error is tagged as the forward's.
pub fn forward(f: impl FnOnce() -> Result<Tensor, TchError>, amp: &Amp) -> Result<Tensor> {
    let _autocast = amp.autocast()?;
    f().map_err(|e| Error::from(e).in_phase(crate::error::Phase::Forward))
}

/// Backward of `loss x weight` (scaled for fp16); returns the weighted loss, detached, on
/// the device. An error is tagged as the backward's.
pub fn backward(loss: &Tensor, weight: f64, amp: &Amp) -> Result<Tensor> {
    crate::memory::snapshot::set_phase(crate::error::Phase::Backward, None);
    let run = || -> Result<Tensor, TchError> {
        let weighted = crate::ops::mul_scalar(loss, weight)?;
        amp.scale(&weighted)?.f_backward()?;
        weighted.f_detach()
    };
    run().map_err(|e| Error::from(e).in_phase(crate::error::Phase::Backward))
}

/// Differences between a checkpoint's fingerprint and the model's, e.g.
/// `model.n_layer: 2 in the checkpoint, 3 in the config`.
pub fn shape_changes(saved: &Fingerprint, now: &Fingerprint) -> Vec<String> {
    let get = |f: &Fingerprint, k: &str| {
        f.iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| "absent".into())
    };
    let mut keys: Vec<&String> = saved.iter().map(|(k, _)| k).collect();
    keys.extend(
        now.iter()
            .map(|(k, _)| k)
            .filter(|k| !saved.iter().any(|(s, _)| s == *k)),
    );
    keys.into_iter()
        .filter_map(|k| {
            let (a, b) = (get(saved, k), get(now, k));
            (a != b).then(|| format!("{k}: {a} in the checkpoint, {b} in the config"))
        })
        .collect()
}

/// The line of an error that says what went wrong: libtorch wraps TorchScript errors under
/// "The following operation failed in the TorchScript interpreter." and a traceback, and
/// C++ errors carry a backtrace; the last `...Error: ...` line is the cause.
pub fn error_line(message: &str) -> String {
    let lines: Vec<&str> = message.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let cause = lines.iter().rev().find(|l| {
        let head = l.split(':').next().unwrap_or("");
        head.ends_with("Error") && !head.contains(' ')
    });
    cause
        .or(lines.first())
        .map_or_else(|| message.to_string(), |l| l.to_string())
}

/// A short stable digest of a fingerprint, for cache keys.
pub fn fingerprint_key(f: &Fingerprint) -> String {
    let text: String = f.iter().map(|(k, v)| format!("{k}={v};")).collect();
    format!("{:08x}", crc32fast::hash(text.as_bytes()))
}

/// What a model is built from: the device, the `model` and `data` sections, the config
/// file's folder (relative paths). A Rust program's builder receives one and returns a
/// [`Built`].
pub struct BuildContext<'a> {
    pub device: Device,
    pub model: &'a ModelConfig,
    /// The `data` section (a Python model builds `data.source: python` itself).
    pub data: &'a DataConfig,
    pub base_dir: &'a Path,
    pub config_path: &'a Path,
}

impl BuildContext<'_> {
    /// The `model.settings` a Rust program's model reads, into its own (serde) type: give
    /// it `#[serde(deny_unknown_fields)]`, and a bad key is refused naming the file and key.
    pub fn settings<T: serde::de::DeserializeOwned + Default>(&self) -> Result<T> {
        let Some(value) = &self.model.settings else {
            return Ok(T::default());
        };
        serde_yaml::from_value(value.clone()).map_err(|e| {
            let msg = e.to_string().replace("unknown field", "unknown key");
            Error::Config(crate::error::ConfigError {
                origin: self.config_path.display().to_string(),
                line_col: None,
                key: "model.settings".into(),
                message: msg,
            })
        })
    }
}

/// A task and, for a model that brings its own, its data (else the config's `data` section
/// is used).
///
/// ```
/// use oomguard::task::{BuildContext, Built, Task};
/// use tch::{Device, Kind, TchError, Tensor};
///
/// struct Mean(Tensor);
/// impl Task for Mean {
///     fn parameters(&self) -> Vec<(String, Tensor)> {
///         vec![("mean".into(), self.0.shallow_clone())]
///     }
///     fn loss(&self, x: &Tensor, _y: &Tensor, _train: bool) -> Result<Tensor, TchError> {
///         x.f_sub(&self.0)?.f_square()?.f_mean(Kind::Float)
///     }
/// }
///
/// /// A builder, as `main_with` takes it: the device comes from the config.
/// fn build(ctx: &BuildContext) -> oomguard::Result<Built> {
///     Ok(Built::new(Mean(Tensor::f_zeros([1], (Kind::Float, ctx.device))?)))
/// }
/// # let (model, dir) = (oomguard::model::ModelConfig::default(), std::path::Path::new("."));
/// # let data = oomguard::data::DataConfig::default();
/// # let ctx = BuildContext { device: Device::Cpu, model: &model, data: &data, base_dir: dir, config_path: dir };
/// let built = build(&ctx)?;
/// assert_eq!(built.task.parameters().len(), 1);
/// assert!(built.data.is_none());
/// # Ok::<(), oomguard::Error>(())
/// ```
pub struct Built {
    pub task: Box<dyn Task>,
    pub data: Option<Dataset>,
}

impl Built {
    pub fn new(task: impl Task + 'static) -> Built {
        Built {
            task: Box::new(task),
            data: None,
        }
    }
    pub fn with_data(self, data: Dataset) -> Built {
        Built {
            data: Some(data),
            ..self
        }
    }
}

/// The data a run trains on: what the model brought, or the config's `data` section
/// (relative paths from `base_dir`, the config file's folder) cut to the model's sequence
/// length.
pub fn data_for(m: &ModelConfig, data: &DataConfig, base_dir: &Path, brought: Option<Dataset>) -> Result<Dataset> {
    if let Some(d) = brought {
        return Ok(d);
    }
    let shape = m.block_size().map(|t| crate::data::TokenShape {
        block_size: t as usize,
        vocab_size: (m.kind == ModelKind::Gpt).then(|| m.gpt().vocab_size),
    });
    Dataset::open(data, base_dir, shape)
}

/// Builds the model a config names (`gpt`, `torchscript` or `python`; `rust` models come
/// through the library with their own builder).
pub fn build_from_config(ctx: &BuildContext) -> Result<Built> {
    let task: Box<dyn Task> = match ctx.model.kind {
        ModelKind::Gpt => Box::new(gpt::GptTask::new(&ctx.model.gpt(), ctx.device)?),
        ModelKind::Torchscript => Box::new(torchscript::TorchScriptTask::load(ctx)?),
        #[cfg(feature = "python")]
        ModelKind::Python => return python::build(ctx),
        #[cfg(not(feature = "python"))]
        ModelKind::Python => {
            return Err(Error::Config(crate::error::ConfigError {
                origin: ctx.config_path.display().to_string(),
                line_col: None,
                key: "model.kind".into(),
                message: "this oomguard was built without Python models (cargo feature `python`, on by default; the GPU kit leaves it out): use kind \
                    torchscript, or a build with the feature".into(),
            }))
        }
        ModelKind::Rust => {
            return Err(Error::Config(crate::error::ConfigError {
                origin: ctx.config_path.display().to_string(),
                line_col: None,
                key: "model.kind".into(),
                message: "rust models are trained by a Rust program that links oomguard and brings its model (see examples/mlp.rs); `oomguard train` \
                    trains kind gpt, python or torchscript".into(),
            }))
        }
    };
    Ok(Built { task, data: None })
}

/// `build` (any model's builder: the config's, or a Rust program's own), then the starting
/// weights `model.init_from` names loaded into it.
pub fn build_with_weights(ctx: &BuildContext, build: &dyn Fn(&BuildContext) -> Result<Built>) -> Result<Built> {
    let built = build(ctx)?;
    init_from(ctx, built.task.as_ref())?;
    Ok(built)
}

/// `model.init_from`, when set: the starting weights.
fn init_from(ctx: &BuildContext, task: &dyn Task) -> Result<()> {
    if let Some(from) = &ctx.model.init_from {
        let path = if from.is_absolute() {
            from.clone()
        } else {
            ctx.base_dir.join(from)
        };
        tensors::init_from(task, &path)?;
    }
    Ok(())
}
