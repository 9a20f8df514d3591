//! AdamW with parameter groups (no weight decay where the model says so), the LR schedule
//! and gradient clipping. The update is one fused libtorch kernel per group (csrc/optim.cpp)
//! and every call is fallible. It is transactional: every allocation happens before
//! anything changes, so an OOM leaves parameters, moments and step counts as they were, and
//! a retried step updates each group exactly once.
use serde::{Deserialize, Serialize};
use std::ffi::{c_char, c_void};
use tch::{Kind, TchError, Tensor};

use crate::error::{ConfigError, Error, Result as OgResult};
use crate::memory::{check, clear_grad};

extern "C" {
    fn og_adamw_commit(
        params: *const *mut c_void, exp_avgs: *const *mut c_void, exp_avg_sqs: *const *mut c_void,
        steps: *const *mut c_void, next_steps: *const *mut c_void, n: i32, lr: f64, beta1: f64, beta2: f64,
        weight_decay: f64, eps: f64, found_inf: *mut c_void,
    ) -> *mut c_char;
    fn og_clip_grad_norm(params: *const *mut c_void, n: i32, max_norm: f64, out: *mut *mut c_void) -> *mut c_char;
    fn og_zero_missing_grads(params: *const *mut c_void, n: i32) -> *mut c_char;
}

/// The `optim` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    /// Steps of cosine decay from `lr` to `min_lr`; defaults to `train.max_steps`.
    pub decay_steps: Option<u64>,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Clip the global gradient norm to this (0 disables).
    pub grad_clip: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 1e-3, min_lr: 1e-4, warmup_steps: 20, decay_steps: None, weight_decay: 0.1,
            beta1: 0.9, beta2: 0.95, eps: 1e-8, grad_clip: 1.0,
        }
    }
}

impl OptimConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [("optim.lr", self.lr), ("optim.eps", self.eps)];
        for (k, v) in positive {
            if !(v > 0.0 && v.is_finite()) {
                return Err(ConfigError::invalid(k, format!("is {v}; it must be a positive number")));
            }
        }
        if !(0.0..=self.lr).contains(&self.min_lr) {
            return Err(ConfigError::invalid("optim.min_lr", format!("is {}; it must be in [0, optim.lr = {}]", self.min_lr, self.lr)));
        }
        for (k, v) in [("optim.beta1", self.beta1), ("optim.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(ConfigError::invalid(k, format!("is {v}; it must be in [0, 1)")));
            }
        }
        for (k, v) in [("optim.weight_decay", self.weight_decay), ("optim.grad_clip", self.grad_clip)] {
            if v < 0.0 || !v.is_finite() {
                return Err(ConfigError::invalid(k, format!("is {v}; it must be 0 or more")));
            }
        }
        Ok(())
    }

    /// Linear warmup to `lr`, then cosine decay to `min_lr` over `decay_steps`.
    pub fn lr_at(&self, step: u64, max_steps: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let decay = self.decay_steps.unwrap_or(max_steps).max(self.warmup_steps + 1);
        if step >= decay {
            return self.min_lr;
        }
        let progress = (step - self.warmup_steps) as f64 / (decay - self.warmup_steps) as f64;
        self.min_lr + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (self.lr - self.min_lr)
    }
}

struct Group {
    names: Vec<String>,
    params: Vec<Tensor>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    steps: Vec<Tensor>,
    weight_decay: f64,
}

fn ptrs(ts: &[Tensor]) -> Vec<*mut c_void> {
    ts.iter().map(|t| t.as_ptr() as *mut c_void).collect()
}

/// A step's allocations, made before anything changes (`AdamW::prepare`).
pub struct Prepared {
    step: u64,
    next: Vec<Vec<Tensor>>,
    found_inf: Option<Tensor>,
}

/// AdamW over a model's trainable parameters.
pub struct AdamW {
    groups: Vec<Group>,
    cfg: OptimConfig,
    /// The last step applied: a step is never applied twice.
    last_step: Option<u64>,
}

impl AdamW {
    /// Groups the parameters by `no_decay(name, tensor)`; allocates the moment buffers up
    /// front, so that memory is stable from the first step.
    pub fn new(params: Vec<(String, Tensor)>, cfg: &OptimConfig, no_decay: impl Fn(&str, &Tensor) -> bool) -> Result<AdamW, TchError> {
        let mut named: Vec<(String, Tensor)> = params.into_iter().filter(|(_, t)| t.requires_grad()).collect();
        named.sort_by(|a, b| a.0.cmp(&b.0)); // a stable order for reproducible kernels
        let mut groups = Vec::new();
        for (decay, wd) in [(true, cfg.weight_decay), (false, 0.0)] {
            let members: Vec<&(String, Tensor)> = named.iter().filter(|(n, t)| no_decay(n, t) != decay).collect();
            let params: Vec<Tensor> = members.iter().map(|(_, t)| t.shallow_clone()).collect();
            let zeros = |p: &Tensor| -> Result<Tensor, TchError> { p.f_zeros_like() };
            groups.push(Group {
                exp_avg: params.iter().map(zeros).collect::<Result<_, _>>()?,
                exp_avg_sq: params.iter().map(zeros).collect::<Result<_, _>>()?,
                steps: params.iter().map(|p| Tensor::f_zeros([], (Kind::Float, p.device()))).collect::<Result<_, _>>()?,
                names: members.iter().map(|(n, _)| n.clone()).collect(),
                params,
                weight_decay: wd,
            });
        }
        Ok(AdamW { groups, cfg: cfg.clone(), last_step: None })
    }

    fn all_params(&self) -> impl Iterator<Item = &Tensor> {
        self.groups.iter().flat_map(|g| g.params.iter())
    }

    /// The gradients there are (for unscaling and reduction).
    pub fn grads(&self) -> Vec<Tensor> {
        self.all_params().map(|p| p.grad()).filter(|g| g.defined()).collect()
    }

    /// Zeros for the gradients this process's step left undefined (a parameter unused by
    /// its samples): data-parallel ranks then reduce the same list.
    pub fn zero_missing_grads(&self) -> Result<(), TchError> {
        let params: Vec<Tensor> = self.all_params().map(Tensor::shallow_clone).collect();
        check(unsafe { og_zero_missing_grads(ptrs(&params).as_ptr(), params.len() as i32) })
    }

    /// Scales gradients so their global norm is at most `max_norm` (0: no clipping), on the
    /// device; returns the norm before, a 0-dim tensor there (read with the step's read-out).
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<Tensor, TchError> {
        let params: Vec<Tensor> = self.all_params().filter(|p| p.grad().defined()).map(|p| p.shallow_clone()).collect();
        let max = if max_norm > 0.0 { max_norm } else { f64::INFINITY };
        let mut out: *mut c_void = std::ptr::null_mut();
        check(unsafe { og_clip_grad_norm(ptrs(&params).as_ptr(), params.len() as i32, max, &mut out) })?;
        // SAFETY: on success the C++ side returned a new torch::Tensor* we now own.
        Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
    }

    /// Applies optimizer step `step` (once: a second call for the same step is refused):
    /// `prepare` then `commit`.
    pub fn step(&mut self, step: u64, lr: f64) -> OgResult<()> {
        let prepared = self.prepare(step, None)?;
        self.commit(prepared, lr)
    }

    /// The allocating half of a step, which changes nothing: the step counts after the
    /// update (unchanged where fp16's `found_inf` is 1: the update will be skipped, on the
    /// device). An OOM here leaves the optimizer exactly as it was.
    pub fn prepare(&self, step: u64, found_inf: Option<&Tensor>) -> OgResult<Prepared> {
        if self.last_step.is_some_and(|last| step <= last) {
            return Err(Error::Torch(TchError::Kind(format!("optimizer step {step} was already applied (last: {:?})", self.last_step))));
        }
        // 1 - found_inf: 1 for an update, 0 for a skipped one.
        let increment = found_inf.map(|f| crate::ops::add_scalar(&f.f_neg()?, 1.0)).transpose()?;
        let next_count = |s: &Tensor| match &increment {
            Some(i) => s.f_add(i),
            None => crate::ops::add_scalar(s, 1.0),
        };
        let next = self.groups.iter().map(|g| g.steps.iter().map(next_count).collect::<Result<_, _>>()).collect::<Result<_, TchError>>()?;
        Ok(Prepared { step, next, found_inf: found_inf.map(Tensor::shallow_clone) })
    }

    /// The half that changes the parameters, moments and step counts; it allocates nothing,
    /// so once begun it completes.
    pub fn commit(&mut self, prepared: Prepared, lr: f64) -> OgResult<()> {
        let Prepared { step, next, found_inf } = prepared;
        let inf = found_inf.as_ref().map_or(std::ptr::null_mut(), |f| f.as_ptr() as *mut c_void);
        for (g, next) in self.groups.iter().zip(&next) {
            let n = g.params.len() as i32;
            let (p, m, v, s, ns) = (ptrs(&g.params), ptrs(&g.exp_avg), ptrs(&g.exp_avg_sq), ptrs(&g.steps), ptrs(next));
            let done = check(unsafe {
                og_adamw_commit(p.as_ptr(), m.as_ptr(), v.as_ptr(), s.as_ptr(), ns.as_ptr(), n, lr, self.cfg.beta1, self.cfg.beta2, g.weight_decay, self.cfg.eps, inf)
            });
            if let Err(e) = done {
                // Never retried (it is not an OOM to the guard): a group may be half updated.
                return Err(Error::PartialUpdate(format!(
                    "the optimizer update of step {step} failed part-way ({e}); the parameters may be partly updated, so the run stops here: resume from the last checkpoint"
                )));
            }
        }
        self.last_step = Some(step);
        Ok(())
    }

    /// Drops every gradient (grad = None): between steps, and after a failed attempt.
    pub fn clear_grads(&self) {
        self.all_params().for_each(clear_grad);
    }

    /// The moment buffers and step counts, named `<parameter>.exp_avg|exp_avg_sq|step`.
    pub fn state(&self) -> Vec<(String, &Tensor)> {
        let mut out = Vec::new();
        for g in &self.groups {
            for (i, name) in g.names.iter().enumerate() {
                out.push((format!("{name}.exp_avg"), &g.exp_avg[i]));
                out.push((format!("{name}.exp_avg_sq"), &g.exp_avg_sq[i]));
                out.push((format!("{name}.step"), &g.steps[i]));
            }
        }
        out
    }

    /// Copies a saved `state()` back in; every entry must be present with its shape.
    pub fn load_state(&mut self, saved: &[(String, Tensor)]) -> Result<(), TchError> {
        self.last_step = None;
        let saved: std::collections::HashMap<&str, &Tensor> = saved.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let _no_grad = tch::no_grad_guard();
        for (name, t) in self.state() {
            let src = saved.get(name.as_str()).ok_or_else(|| TchError::FileFormat(format!("optimizer state has no `{name}`")))?;
            if src.size() != t.size() {
                return Err(TchError::Shape(format!("optimizer state `{name}` has shape {:?}, expected {:?}", src.size(), t.size())));
            }
            t.shallow_clone().f_copy_(src)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let c = OptimConfig { lr: 1.0, min_lr: 0.1, warmup_steps: 10, decay_steps: Some(110), ..Default::default() };
        assert!((c.lr_at(0, 0) - 0.1).abs() < 1e-12);
        assert!((c.lr_at(9, 0) - 1.0).abs() < 1e-12);
        assert!((c.lr_at(10, 0) - 1.0).abs() < 1e-12);
        assert!((c.lr_at(60, 0) - 0.55).abs() < 1e-12);
        assert_eq!(c.lr_at(110, 0), 0.1);
        assert_eq!(c.lr_at(5000, 0), 0.1);
        let d = OptimConfig { decay_steps: None, ..c };
        assert!((d.lr_at(60, 110) - 0.55).abs() < 1e-12);
    }
}
