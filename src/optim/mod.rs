//! Owns AdamW with parameter groups, the LR schedule and gradient clipping.
//! Keeps: the update is transactional: an OOM leaves parameters, moments and step counts as
//! they were, and a retried step updates each group exactly once.
use std::ffi::c_void;
use tch::{Kind, TchError, Tensor};

use crate::memory::clear_grad;

mod clip;
mod config;
mod sharding;
mod slices;
mod state;
mod update;
pub mod zero;
use zero::Zero;

pub use config::OptimConfig;
pub use sharding::Agreed;
pub use update::Prepared;
pub use zero::{Comm, InFlight, Shard};

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

/// The trainable parameters in a stable order (reproducible kernels), grouped by
/// `no_decay(name, tensor)`, with their step counts and (`moments`) zeroed moments.
fn groups(
    params: Vec<(String, Tensor)>,
    cfg: &OptimConfig,
    no_decay: impl Fn(&str, &Tensor) -> bool,
    moments: bool,
) -> Result<Vec<Group>, TchError> {
    let mut named: Vec<(String, Tensor)> = params.into_iter().filter(|(_, t)| t.requires_grad()).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut groups = Vec::new();
    for (decay, wd) in [(true, cfg.weight_decay), (false, 0.0)] {
        let members: Vec<&(String, Tensor)> = named.iter().filter(|(n, t)| no_decay(n, t) != decay).collect();
        let params: Vec<Tensor> = members.iter().map(|(_, t)| t.shallow_clone()).collect();
        let zeros = |p: &Tensor| -> Result<Tensor, TchError> { p.f_zeros_like() };
        let moment = || {
            if moments {
                params.iter().map(zeros).collect::<Result<Vec<_>, _>>()
            } else {
                Ok(Vec::new())
            }
        };
        groups.push(Group {
            exp_avg: moment()?,
            exp_avg_sq: moment()?,
            steps: params
                .iter()
                .map(|p| Tensor::f_zeros([], (Kind::Float, p.device())))
                .collect::<Result<_, _>>()?,
            names: members.iter().map(|(n, _)| n.clone()).collect(),
            params,
            weight_decay: wd,
        });
    }
    Ok(groups)
}

/// AdamW over a model's trainable parameters.
pub struct AdamW {
    groups: Vec<Group>,
    cfg: OptimConfig,
    /// The last step applied: a step is never applied twice.
    last_step: Option<u64>,
    /// Sharded (ZeRO-1/2) across data-parallel ranks: the groups then hold no moments.
    zero: Option<Zero>,
}

impl AdamW {
    /// Groups the parameters by `no_decay(name, tensor)`; allocates the moment buffers up
    /// front, so that memory is stable from the first step.
    pub fn new(
        params: Vec<(String, Tensor)>,
        cfg: &OptimConfig,
        no_decay: impl Fn(&str, &Tensor) -> bool,
    ) -> Result<AdamW, TchError> {
        Ok(AdamW {
            groups: groups(params, cfg, no_decay, true)?,
            cfg: cfg.clone(),
            last_step: None,
            zero: None,
        })
    }

    /// Every parameter, in the optimizer's order.
    pub fn params(&self) -> Vec<Tensor> {
        self.all_params().map(Tensor::shallow_clone).collect()
    }

    /// Every parameter's name, in the optimizer's order.
    pub fn names(&self) -> Vec<&str> {
        self.groups
            .iter()
            .flat_map(|g| g.names.iter().map(String::as_str))
            .collect()
    }

    fn all_params(&self) -> impl Iterator<Item = &Tensor> {
        self.groups.iter().flat_map(|g| g.params.iter())
    }

    /// Every parameter (in the flat space's order) as a flat view.
    fn flat_params(&self) -> Result<Vec<Tensor>, TchError> {
        self.all_params().map(|p| p.f_view([-1])).collect()
    }

    /// (group, index in it) of each parameter, in the flat space's order.
    fn index(&self) -> Vec<(usize, usize)> {
        self.groups
            .iter()
            .enumerate()
            .flat_map(|(g, grp)| (0..grp.params.len()).map(move |i| (g, i)))
            .collect()
    }

    /// The last step whose update this optimizer applied (or skipped on an fp16 overflow):
    /// the moment of the commit, before any collective that follows it.
    pub fn last_step(&self) -> Option<u64> {
        self.last_step
    }

    /// What the ranks split (`Shard::None` unless sharded).
    pub fn shard(&self) -> Shard {
        self.zero.as_ref().map_or(Shard::None, |z| z.stage)
    }

    /// The gradients there are (for unscaling and reduction); stage 2: this rank's shard
    /// of the summed gradients, once reduced.
    pub fn grads(&self) -> Vec<Tensor> {
        if let Some(g) = self.zero.as_ref().and_then(|z| z.grad.as_ref()) {
            return g.parts();
        }
        self.all_params().map(|p| p.grad()).filter(|g| g.defined()).collect()
    }

    /// Every parameter's own gradient (those defined), whatever a stage-2 shard holds.
    pub fn param_grads(&self) -> Vec<Tensor> {
        self.all_params().map(|p| p.grad()).filter(|g| g.defined()).collect()
    }

    /// Drops every gradient (grad = None): between steps, and after a failed attempt.
    pub fn clear_grads(&self) {
        self.all_params().for_each(clear_grad);
    }

    /// After a failed attempt: stage 2's gradient shard and prepared clipping go too.
    pub fn clear_shard_grads(&mut self) {
        if let Some(z) = self.zero.as_mut() {
            z.grad = None;
            z.clip = None;
        }
    }
}
