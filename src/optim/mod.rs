//! AdamW with parameter groups (no weight decay where the model says so), the LR schedule
//! and gradient clipping. The update is one fused libtorch kernel per group (csrc/optim.cpp)
//! and every call is fallible. It is transactional: every allocation happens before
//! anything changes, so an OOM leaves parameters, moments and step counts as they were, and
//! a retried step updates each group exactly once.
use serde::{Deserialize, Serialize};
use std::ffi::{c_char, c_void};
use std::rc::Rc;
use tch::{Kind, TchError, Tensor};

use crate::error::{ConfigError, Error, Result as OgResult};
use crate::memory::{check, clear_grad};

pub mod zero;
use zero::{Buffers, Layout, Zero};
pub use zero::{Comm, Shard};

/// ZeRO's collectives move at most this much at a time (all ranks' chunks together).
const ZERO_BUCKET_BYTES: i64 = 25 << 20;

extern "C" {
    fn og_adamw_commit(
        params: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        steps: *const *mut c_void,
        next_steps: *const *mut c_void,
        n: i32,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        found_inf: *mut c_void,
    ) -> *mut c_char;
    fn og_adamw_update(
        params: *const *mut c_void,
        grads: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        steps: *const *mut c_void,
        n: i32,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        found_inf: *mut c_void,
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
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 20,
            decay_steps: None,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
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
            return Err(ConfigError::invalid(
                "optim.min_lr",
                format!("is {}; it must be in [0, optim.lr = {}]", self.min_lr, self.lr),
            ));
        }
        for (k, v) in [("optim.beta1", self.beta1), ("optim.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(ConfigError::invalid(k, format!("is {v}; it must be in [0, 1)")));
            }
        }
        for (k, v) in [
            ("optim.weight_decay", self.weight_decay),
            ("optim.grad_clip", self.grad_clip),
        ] {
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

/// A step's allocations, made before anything changes (`AdamW::prepare`).
pub struct Prepared {
    step: u64,
    next: Vec<Vec<Tensor>>,
    found_inf: Option<Tensor>,
    /// Sharded: the all-gather's buffers for the updated parameters.
    gather: Option<Buffers>,
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

/// A gathered copy of the optimizer state in host memory (a sharded optimizer's checkpoint:
/// one format whatever the sharding), outside the device's budget as it would be on a GPU.
pub struct FullState {
    pub tensors: Vec<(String, Tensor)>,
    /// The host memory the tensors of a gathered state view.
    _host: Vec<Vec<f32>>,
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

    /// `new` with the moments sharded from the start (`Shard::None`: `new`), so that the
    /// whole state is never allocated on one rank.
    pub fn sharded(
        params: Vec<(String, Tensor)>,
        cfg: &OptimConfig,
        no_decay: impl Fn(&str, &Tensor) -> bool,
        stage: Shard,
        comm: Option<Rc<dyn Comm>>,
    ) -> OgResult<AdamW> {
        let (Some(comm), true) = (comm, stage != Shard::None) else {
            return Ok(AdamW::new(params, cfg, no_decay)?);
        };
        // Groups without moments first, then the shard's.
        let mut opt = AdamW {
            groups: groups(params, cfg, no_decay, false)?,
            cfg: cfg.clone(),
            last_step: None,
            zero: None,
        };
        opt.zero = Some(opt.new_zero(stage, comm, true)?);
        Ok(opt)
    }

    /// An empty shard of the moments for this layout (zeros: a fresh state).
    fn new_zero(&self, stage: Shard, comm: Rc<dyn Comm>, fresh: bool) -> OgResult<Zero> {
        let params: Vec<&Tensor> = self.all_params().collect();
        if let Some(p) = params.iter().find(|p| p.kind() != Kind::Float) {
            return Err(Error::Torch(TchError::Kind(format!(
                "sharding needs fp32 parameters; this model has a {:?} one",
                p.kind()
            ))));
        }
        let numels: Vec<i64> = params.iter().map(|p| p.numel() as i64).collect();
        let layout = Layout::new(&numels, comm.rank(), comm.world(), ZERO_BUCKET_BYTES / 4);
        let device = params.first().map_or(tch::Device::Cpu, |p| p.device());
        let zeros = |n: i64| Tensor::f_zeros([n], (Kind::Float, device));
        // A fresh state's shards; empty when `set_shard` fills them from whole moments.
        let n = if fresh { layout.shard } else { 0 };
        Ok(Zero {
            stage,
            pieces: layout.pieces(),
            exp_avg: zeros(n)?,
            exp_avg_sq: zeros(n)?,
            layout,
            comm,
            grad: None,
            restored: None,
            clip: None,
        })
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

    /// What the ranks split (`Shard::None` unless sharded).
    pub fn shard(&self) -> Shard {
        self.zero.as_ref().map_or(Shard::None, |z| z.stage)
    }

    /// Bytes of AdamW's moments this process holds.
    pub fn state_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        match &self.zero {
            Some(z) => bytes(&z.exp_avg) + bytes(&z.exp_avg_sq),
            None => self
                .groups
                .iter()
                .flat_map(|g| g.exp_avg.iter().chain(&g.exp_avg_sq))
                .map(bytes)
                .sum(),
        }
    }

    /// The gradients there are (for unscaling and reduction); stage 2: this rank's shard
    /// of the summed gradients, once reduced.
    pub fn grads(&self) -> Vec<Tensor> {
        if let Some(g) = self.zero.as_ref().and_then(|z| z.grad.as_ref()) {
            return vec![g.shallow_clone()];
        }
        self.all_params().map(|p| p.grad()).filter(|g| g.defined()).collect()
    }

    /// Stage 2: the reduce-scatter's buffers and the gradient shard it fills, allocated
    /// before the ranks agree (`None` unless sharding gradients).
    pub fn scatter_buffers(&self) -> Result<Option<(Buffers, Tensor)>, TchError> {
        let Some(z) = self.zero.as_ref().filter(|z| z.stage == Shard::Gradients) else {
            return Ok(None);
        };
        let device = z.exp_avg.device();
        Ok(Some((
            Buffers::new(&z.layout, Kind::Float, device)?,
            Tensor::f_zeros([z.layout.shard], (Kind::Float, device))?,
        )))
    }

    /// Stage 2: sums the ranks' gradients into this rank's shard, a chunk at a time, then
    /// drops the full gradients (the memory stage 2 saves).
    pub fn reduce_scatter_grads(&mut self, (bufs, grad): (Buffers, Tensor)) -> OgResult<()> {
        let flat: Vec<Tensor> = self
            .all_params()
            .map(|p| p.grad().f_view([-1]))
            .collect::<Result<_, _>>()?;
        let z = self.zero.as_mut().expect("stage 2");
        let w = z.layout.world as i64;
        for c in z.layout.chunks() {
            let all = bufs.all.f_narrow(0, 0, w * c.1)?;
            z.layout.pack_all(&flat, c, &all)?;
            z.comm.reduce_scatter(&all, &grad.f_narrow(0, c.0, c.1)?)?;
        }
        drop(flat);
        z.grad = Some(grad);
        self.all_params().for_each(clear_grad);
        Ok(())
    }

    /// Stage 2, once the ranks agreed on the update's allocations: the global gradient norm
    /// from the shards' sums of squares, clipping, and (fp16) an overflow in any shard
    /// skipping the update everywhere. Allocates nothing. Returns the norm (`None` unless
    /// stage 2), which `clip_grad_norm` returned unset.
    pub fn shard_stats(&mut self, found_inf: Option<&Tensor>) -> OgResult<Option<Tensor>> {
        let Some(z) = self.zero.as_mut() else { return Ok(None) };
        let Some(clip) = z.clip.take() else { return Ok(None) };
        let g = z.grad.as_ref().expect("stage 2 gradients");
        if let Some(f) = found_inf {
            z.comm.all_reduce_max(f)?;
        }
        z.comm.all_reduce_sum(&clip.sq)?;
        let _ = clip.sq.f_sqrt_out(&clip.norm)?;
        if clip.max_norm > 0.0 {
            let mut coef = clip.coef.shallow_clone();
            let _ = coef.f_copy_(&clip.norm)?;
            let _ = coef.f_add_scalar_(1e-6)?;
            let _ = coef.f_reciprocal_()?;
            let _ = coef.f_mul_scalar_(clip.max_norm)?;
            let _ = coef.f_clamp_max_(1.0)?;
            let _ = g.shallow_clone().f_mul_(&coef)?;
        }
        Ok(Some(clip.norm))
    }

    /// Zeros for the gradients this process's step left undefined (a parameter unused by
    /// its samples): data-parallel ranks then reduce the same list.
    pub fn zero_missing_grads(&self) -> Result<(), TchError> {
        let params: Vec<Tensor> = self.all_params().map(Tensor::shallow_clone).collect();
        check(unsafe { og_zero_missing_grads(ptrs(&params).as_ptr(), params.len() as i32) })
    }

    /// Scales gradients so their global norm is at most `max_norm` (0: no clipping), on the
    /// device; returns the norm before, a 0-dim tensor there (read with the step's read-out).
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> OgResult<Tensor> {
        if let Some(z) = self.zero.as_mut().filter(|z| z.grad.is_some()) {
            // Stage 2: the norm is the ranks' together. Only the allocations here (this
            // shard's sum of squares, the norm's and coefficient's scalars); the collective
            // and the clipping wait for the ranks' agreement (`shard_stats`).
            let g = z.grad.as_ref().expect("stage 2 gradients");
            let sq = g.f_square()?.f_sum(Kind::Float)?;
            let clip = zero::Clip {
                norm: sq.f_zeros_like()?,
                coef: sq.f_zeros_like()?,
                sq,
                max_norm,
            };
            let norm = clip.norm.shallow_clone();
            z.clip = Some(clip);
            return Ok(norm);
        }
        let params: Vec<Tensor> = self
            .all_params()
            .filter(|p| p.grad().defined())
            .map(|p| p.shallow_clone())
            .collect();
        let max = if max_norm > 0.0 { max_norm } else { f64::INFINITY };
        let mut out: *mut c_void = std::ptr::null_mut();
        check(unsafe { og_clip_grad_norm(ptrs(&params).as_ptr(), params.len() as i32, max, &mut out) })
            .map_err(Error::from)?;
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
            return Err(Error::Torch(TchError::Kind(format!(
                "optimizer step {step} was already applied (last: {:?})",
                self.last_step
            ))));
        }
        // Each count plus one; `commit` takes found_inf off in place. Not here: under ZeRO-2
        // the flag is this rank's own shard's until the ranks' MAX, which comes after.
        let next = self
            .groups
            .iter()
            .map(|g| {
                g.steps
                    .iter()
                    .map(|s| crate::ops::add_scalar(s, 1.0))
                    .collect::<Result<_, _>>()
            })
            .collect::<Result<_, TchError>>()?;
        let gather = self
            .zero
            .as_ref()
            .map(|z| Buffers::new(&z.layout, Kind::Float, z.exp_avg.device()))
            .transpose()?;
        Ok(Prepared {
            step,
            next,
            found_inf: found_inf.map(Tensor::shallow_clone),
            gather,
        })
    }

    /// The half that changes the parameters, moments and step counts; it allocates nothing,
    /// so once begun it completes.
    pub fn commit(&mut self, prepared: Prepared, lr: f64) -> OgResult<()> {
        let Prepared {
            step,
            next,
            found_inf,
            gather,
        } = prepared;
        if let Some(f) = &found_inf {
            // A skipped update (the ranks' flag, now agreed) does not count: in place.
            for n in next.iter().flatten() {
                let _ = n.shallow_clone().f_sub_(f)?;
            }
        }
        let inf = found_inf
            .as_ref()
            .map_or(std::ptr::null_mut(), |f| f.as_ptr() as *mut c_void);
        if let Some(gather) = gather {
            self.commit_shard(&next, inf, lr).map_err(|e| partial(step, e))?;
            // Every rank's updated shard to every rank. A failure here is a collective's
            // (a peer gone): the group restarts from the last checkpoint.
            self.gather_params(&gather)?;
            self.last_step = Some(step);
            if let Some(z) = self.zero.as_mut() {
                z.grad = None;
            }
            return Ok(());
        }
        for (g, next) in self.groups.iter().zip(&next) {
            let n = g.params.len() as i32;
            let (p, m, v, s, ns) = (
                ptrs(&g.params),
                ptrs(&g.exp_avg),
                ptrs(&g.exp_avg_sq),
                ptrs(&g.steps),
                ptrs(next),
            );
            let done = check(unsafe {
                og_adamw_commit(
                    p.as_ptr(),
                    m.as_ptr(),
                    v.as_ptr(),
                    s.as_ptr(),
                    ns.as_ptr(),
                    n,
                    lr,
                    self.cfg.beta1,
                    self.cfg.beta2,
                    g.weight_decay,
                    self.cfg.eps,
                    inf,
                )
            });
            if let Err(e) = done {
                return Err(partial(step, e));
            }
        }
        self.last_step = Some(step);
        Ok(())
    }

    /// The fused kernel over this rank's pieces; every step count advances (the ranks count
    /// alike).
    fn commit_shard(&self, next: &[Vec<Tensor>], inf: *mut c_void, lr: f64) -> Result<(), TchError> {
        let z = self.zero.as_ref().expect("sharded");
        for (g, next) in self.groups.iter().zip(next) {
            for (s, n) in g.steps.iter().zip(next) {
                s.shallow_clone().f_copy_(n)?;
            }
        }
        let index = self.index();
        for (gi, g) in self.groups.iter().enumerate() {
            let (mut p, mut gr, mut m, mut v, mut s) = (vec![], vec![], vec![], vec![], vec![]);
            for piece in z.pieces.iter().filter(|pc| index[pc.param].0 == gi) {
                let param = &g.params[index[piece.param].1];
                p.push(param.f_view([-1])?.f_narrow(0, piece.at, piece.len)?);
                gr.push(match &z.grad {
                    Some(grad) => grad.f_narrow(0, piece.in_shard, piece.len)?,
                    None => param.grad().f_view([-1])?.f_narrow(0, piece.at, piece.len)?,
                });
                m.push(z.exp_avg.f_narrow(0, piece.in_shard, piece.len)?);
                v.push(z.exp_avg_sq.f_narrow(0, piece.in_shard, piece.len)?);
                s.push(g.steps[index[piece.param].1].shallow_clone());
            }
            let (p, gr, m, v, s) = (ptrs(&p), ptrs(&gr), ptrs(&m), ptrs(&v), ptrs(&s));
            check(unsafe {
                og_adamw_update(
                    p.as_ptr(),
                    gr.as_ptr(),
                    m.as_ptr(),
                    v.as_ptr(),
                    s.as_ptr(),
                    p.len() as i32,
                    lr,
                    self.cfg.beta1,
                    self.cfg.beta2,
                    g.weight_decay,
                    self.cfg.eps,
                    inf,
                )
            })?;
        }
        Ok(())
    }

    /// The all-gather of the updated parameters, a chunk at a time.
    fn gather_params(&self, b: &Buffers) -> OgResult<()> {
        let z = self.zero.as_ref().expect("sharded");
        let _no_grad = tch::no_grad_guard();
        let flat = self.flat_params()?;
        let (l, w) = (&z.layout, z.layout.world as i64);
        for c in l.chunks() {
            let own = b.own.f_narrow(0, 0, c.1)?;
            l.pack(&flat, l.rank as i64 * l.shard + c.0, &own)?;
            let all = b.all.f_narrow(0, 0, w * c.1)?;
            z.comm.all_gather(&own, &all)?;
            l.unpack_all(&all, c, &flat)?;
        }
        Ok(())
    }

    /// Changes what is sharded, all ranks together (a rung climbed, or come back down).
    /// Every allocation comes first, then `agree` (the ranks' outcomes: an OOM anywhere is
    /// an OOM everywhere), then the collectives: an OOM leaves the optimizer as it was.
    pub fn set_shard(&mut self, stage: Shard, comm: Option<Rc<dyn Comm>>, agree: &Agreed) -> OgResult<()> {
        let _no_grad = tch::no_grad_guard();
        match (self.zero.as_mut(), stage) {
            (None, Shard::None) => Ok(()),
            (Some(z), s) if s != Shard::None => {
                z.stage = s;
                if s != Shard::Gradients {
                    z.grad = None;
                }
                Ok(())
            }
            (None, s) => {
                let comm =
                    comm.ok_or_else(|| Error::Torch(TchError::Kind("sharding needs a data-parallel group".into())))?;
                let mut z = agreed(agree, self.new_zero(s, comm, false))?;
                // One moment at a time: its shard is allocated (agreed), filled, and its whole
                // tensors freed before the next one's, so that the climb's peak holds half a
                // shard-set more than the state, not a whole one: a rank whose state alone
                // leaves less than one shard free can still climb.
                let (n, device) = (z.layout.shard, z.exp_avg.device());
                let zeros = || Tensor::f_zeros([n], (Kind::Float, device)).map_err(Error::from);
                let avg = agreed(agree, zeros())?;
                self.fill_shard(&z, &avg, |g| &mut g.exp_avg)?;
                z.exp_avg = avg;
                match agreed(agree, zeros()) {
                    Ok(sq) => {
                        self.fill_shard(&z, &sq, |g| &mut g.exp_avg_sq)?;
                        z.exp_avg_sq = sq;
                        self.zero = Some(z);
                        Ok(())
                    }
                    Err(e) => {
                        // Half-way: the first moment comes back whole, as before the climb.
                        self.unshard_avg(&z, agree).map_err(|u| {
                            Error::Torch(TchError::Kind(format!(
                                "sharding AdamW's state failed half-way ({e}) and could not be undone ({u})"
                            )))
                        })?;
                        Err(e)
                    }
                }
            }
            (Some(_), _) => {
                // Back to whole moments on every rank: gathered, chunk by chunk.
                let z = self.zero.as_ref().expect("sharded");
                let zeros = |p: &Tensor| p.f_zeros_like();
                let (m, v, b) = agreed(
                    agree,
                    (|| {
                        let m: Vec<Tensor> = self.all_params().map(zeros).collect::<Result<_, _>>()?;
                        let v: Vec<Tensor> = self.all_params().map(zeros).collect::<Result<_, _>>()?;
                        Ok((m, v, Buffers::new(&z.layout, Kind::Float, z.exp_avg.device())?))
                    })(),
                )?;
                for (shard, full) in [(&z.exp_avg, &m), (&z.exp_avg_sq, &v)] {
                    let flat: Vec<Tensor> = full.iter().map(|t| t.f_view([-1])).collect::<Result<_, _>>()?;
                    gather_into(z, &b, shard, &flat)?;
                }
                let (mut m, mut v) = (m.into_iter(), v.into_iter());
                for g in &mut self.groups {
                    g.exp_avg = m.by_ref().take(g.params.len()).collect();
                    g.exp_avg_sq = v.by_ref().take(g.params.len()).collect();
                }
                self.zero = None;
                Ok(())
            }
        }
    }

    /// This rank's pieces of one whole moment into `shard`; the whole tensors are freed.
    fn fill_shard(
        &mut self,
        z: &Zero,
        shard: &Tensor,
        moment: impl Fn(&mut Group) -> &mut Vec<Tensor>,
    ) -> OgResult<()> {
        let index = self.index();
        for p in &z.pieces {
            let (g, i) = index[p.param];
            let full = &moment(&mut self.groups[g])[i];
            shard
                .f_narrow(0, p.in_shard, p.len)?
                .f_copy_(&full.f_view([-1])?.f_narrow(0, p.at, p.len)?)?;
        }
        for g in &mut self.groups {
            moment(g).clear();
        }
        Ok(())
    }

    /// A climb that failed half-way: the first moment gathered back whole (every rank
    /// takes part; the allocation is agreed).
    fn unshard_avg(&mut self, z: &Zero, agree: &Agreed) -> OgResult<()> {
        let (m, b) = agreed(
            agree,
            (|| {
                let m: Vec<Tensor> = self.all_params().map(|p| p.f_zeros_like()).collect::<Result<_, _>>()?;
                Ok((m, Buffers::new(&z.layout, Kind::Float, z.exp_avg.device())?))
            })(),
        )?;
        let flat: Vec<Tensor> = m.iter().map(|t| t.f_view([-1])).collect::<Result<_, _>>()?;
        gather_into(z, &b, &z.exp_avg, &flat)?;
        let mut m = m.into_iter();
        for g in &mut self.groups {
            g.exp_avg = m.by_ref().take(g.params.len()).collect();
        }
        Ok(())
    }

    /// The whole state as `state()` names it, whatever the sharding: a sharded one is
    /// gathered into host memory (every rank takes part; all get the copy; the buffer's
    /// allocation is agreed before the collectives).
    pub fn full_state(&self, agree: &Agreed) -> OgResult<FullState> {
        let Some(z) = &self.zero else {
            return Ok(FullState {
                tensors: self.state().into_iter().map(|(n, t)| (n, t.shallow_clone())).collect(),
                _host: Vec::new(),
            });
        };
        let _no_grad = tch::no_grad_guard();
        let mut host: Vec<Vec<f32>> = Vec::new();
        let mut views = |p: &Tensor| {
            let mut buf = vec![0f32; p.numel()];
            // SAFETY: `buf` lives in `FullState::_host` as long as the tensor viewing it; a
            // Vec's heap block does not move when the Vec is moved.
            let t = unsafe {
                Tensor::f_from_blob(
                    buf.as_mut_ptr() as *const u8,
                    &p.size(),
                    &[],
                    Kind::Float,
                    tch::Device::Cpu,
                )
            };
            host.push(buf);
            t
        };
        let m: Vec<Tensor> = self.all_params().map(&mut views).collect::<Result<_, _>>()?;
        let v: Vec<Tensor> = self.all_params().map(&mut views).collect::<Result<_, _>>()?;
        let b = agreed(
            agree,
            Buffers::new(&z.layout, Kind::Float, z.exp_avg.device()).map_err(Error::from),
        )?;
        for (shard, full) in [(&z.exp_avg, &m), (&z.exp_avg_sq, &v)] {
            let flat: Vec<Tensor> = full.iter().map(|t| t.f_view([-1])).collect::<Result<_, _>>()?;
            gather_into(z, &b, shard, &flat)?;
        }
        let mut tensors = Vec::new();
        let (mut m, mut v) = (m.into_iter(), v.into_iter());
        for g in &self.groups {
            for (i, name) in g.names.iter().enumerate() {
                tensors.push((format!("{name}.exp_avg"), m.next().expect("one per parameter")));
                tensors.push((format!("{name}.exp_avg_sq"), v.next().expect("one per parameter")));
                tensors.push((format!("{name}.step"), g.steps[i].shallow_clone()));
            }
        }
        Ok(FullState { tensors, _host: host })
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

    /// The moment buffers and step counts, named `<parameter>.exp_avg|exp_avg_sq|step`.
    /// Sharded: this rank's two moment shards (`zero.exp_avg`, `zero.exp_avg_sq`) and the
    /// step counts; `full_state` has them under the parameters' names.
    pub fn state(&self) -> Vec<(String, &Tensor)> {
        let mut out = Vec::new();
        if let Some(z) = &self.zero {
            out.push(("zero.exp_avg".to_string(), &z.exp_avg));
            out.push(("zero.exp_avg_sq".to_string(), &z.exp_avg_sq));
            for g in &self.groups {
                for (i, name) in g.names.iter().enumerate() {
                    out.push((format!("{name}.step"), &g.steps[i]));
                }
            }
            return out;
        }
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
    /// Sharded: the whole saved state is checked and kept until `share_restored`, which
    /// every rank calls, hands each its part.
    pub fn load_state(&mut self, saved: &[(String, Tensor)]) -> Result<(), TchError> {
        self.last_step = None;
        let by_name: std::collections::HashMap<&str, &Tensor> = saved.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let _no_grad = tch::no_grad_guard();
        if self.zero.is_some() {
            for g in &self.groups {
                for (name, p) in g.names.iter().zip(&g.params) {
                    for (key, shape) in [("exp_avg", p.size()), ("exp_avg_sq", p.size()), ("step", vec![])] {
                        let k = format!("{name}.{key}");
                        let src = by_name
                            .get(k.as_str())
                            .ok_or_else(|| TchError::FileFormat(format!("optimizer state has no `{k}`")))?;
                        if src.size() != shape {
                            return Err(TchError::Shape(format!(
                                "optimizer state `{k}` has shape {:?}, expected {shape:?}",
                                src.size()
                            )));
                        }
                    }
                }
            }
            if let Some(z) = self.zero.as_mut() {
                z.restored = Some(saved.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect());
            }
            return Ok(());
        }
        let saved = by_name;
        for (name, t) in self.state() {
            let src = saved
                .get(name.as_str())
                .ok_or_else(|| TchError::FileFormat(format!("optimizer state has no `{name}`")))?;
            if src.size() != t.size() {
                return Err(TchError::Shape(format!(
                    "optimizer state `{name}` has shape {:?}, expected {:?}",
                    src.size(),
                    t.size()
                )));
            }
            t.shallow_clone().f_copy_(src)?;
        }
        Ok(())
    }
}

/// The ranks' agreement on an outcome (`ProcessGroup::agree`): every rank returns the same.
pub type Agreed<'a> = dyn Fn(OgResult<()>) -> OgResult<()> + 'a;

/// `r`, agreed: a failure on any rank fails every rank alike.
fn agreed<T>(agree: &Agreed, r: OgResult<T>) -> OgResult<T> {
    match r {
        Ok(v) => agree(Ok(())).map(|()| v),
        Err(e) => Err(agree(Err(e))
            .err()
            .unwrap_or_else(|| Error::Dist("an agreement on a failure came back as a success".into()))),
    }
}

/// The sharded moments' values into whole flat tensors (one per parameter), chunk by chunk.
fn gather_into(z: &Zero, b: &Buffers, shard: &Tensor, flat: &[Tensor]) -> OgResult<()> {
    let w = z.layout.world as i64;
    for c in z.layout.chunks() {
        let all = b.all.f_narrow(0, 0, w * c.1)?;
        z.comm.all_gather(&shard.f_narrow(0, c.0, c.1)?, &all)?;
        z.layout.unpack_all(&all, c, flat)?;
    }
    Ok(())
}

/// A commit that failed part-way: never retried (it is not an OOM to the guard).
fn partial(step: u64, e: impl std::fmt::Display) -> Error {
    Error::PartialUpdate(format!(
        "the optimizer update of step {step} failed part-way ({e}); the parameters may be partly updated, so the run stops here: resume from the last checkpoint"
    ))
}

impl AdamW {
    /// Sharded, after a resume: rank 0's restored state (`load_state`) to every rank, a
    /// parameter at a time, each keeping its pieces. Every rank calls it.
    pub fn share_restored(&mut self, agree: &Agreed) -> OgResult<()> {
        let Some(z) = self.zero.as_mut() else { return Ok(()) };
        let restored = z.restored.take();
        let z = self.zero.as_ref().expect("sharded");
        let by_name: std::collections::HashMap<String, Tensor> = restored.unwrap_or_default().into_iter().collect();
        let _no_grad = tch::no_grad_guard();
        let index = self.index();
        // One buffer for the largest parameter, agreed before the broadcasts.
        let largest = self.all_params().map(|p| p.numel() as i64).max().unwrap_or(0);
        let device = z.exp_avg.device();
        let tmp = agreed(
            agree,
            Tensor::f_zeros([largest], (Kind::Float, device)).map_err(Error::from),
        )?;
        let mut pieces = z.pieces.iter().peekable();
        for (flat_i, &(g, i)) in index.iter().enumerate() {
            let (name, p) = (&self.groups[g].names[i], &self.groups[g].params[i]);
            let piece = pieces.next_if(|pc| pc.param == flat_i);
            for (key, shard) in [("exp_avg", &z.exp_avg), ("exp_avg_sq", &z.exp_avg_sq)] {
                let full = tmp.f_narrow(0, 0, p.numel() as i64)?.f_view(p.size().as_slice())?;
                if let Some(t) = by_name.get(&format!("{name}.{key}")) {
                    full.shallow_clone().f_copy_(t)?;
                }
                z.comm.broadcast(&full, 0)?;
                if let Some(pc) = piece {
                    shard
                        .f_narrow(0, pc.in_shard, pc.len)?
                        .f_copy_(&full.f_view([-1])?.f_narrow(0, pc.at, pc.len)?)?;
                }
            }
            let step = &self.groups[g].steps[i];
            if let Some(t) = by_name.get(&format!("{name}.step")) {
                step.shallow_clone().f_copy_(t)?;
            }
            z.comm.broadcast(step, 0)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let c = OptimConfig {
            lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 10,
            decay_steps: Some(110),
            ..Default::default()
        };
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
