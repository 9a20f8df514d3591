//! Owns gradient clipping (across ranks' shards in stage 2) and zeros for undefined gradients.
//! Keeps: with sharded gradients the norm is the norm of all ranks' shards together.
use std::ffi::{c_char, c_void};
use tch::{TchError, Tensor};

use super::{ptrs, zero, AdamW};
use crate::error::{Error, Result as OgResult};
use crate::memory::check;

extern "C" {
    fn og_clip_grad_norm(params: *const *mut c_void, n: i32, max_norm: f64, out: *mut *mut c_void) -> *mut c_char;
    fn og_zero_missing_grads(params: *const *mut c_void, n: i32) -> *mut c_char;
}

impl AdamW {
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
            // Dot products, not square-then-sum: no temporary the shard's size.
            let mut sq = Tensor::f_zeros([], (tch::Kind::Float, z.exp_avg.device()))?;
            for g in z.grad.as_ref().expect("stage 2 gradients").parts() {
                let _ = sq.f_add_(&g.f_dot(&g)?)?;
            }
            let one = sq.f_ones_like()?;
            let clip = zero::Clip {
                norm: sq.f_zeros_like()?,
                coef: sq.f_zeros_like()?,
                eps: crate::ops::mul_scalar(&one, 1e-6)?,
                one,
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

    /// Stage 2, once the ranks agreed on the update's allocations: the global gradient norm
    /// from the shards' sums of squares, clipping, and (fp16) an overflow in any shard
    /// skipping the update everywhere. Allocates nothing. Returns the norm (`None` unless
    /// stage 2), which `clip_grad_norm` returned unset.
    pub fn shard_stats(&mut self, found_inf: Option<&Tensor>) -> OgResult<Option<Tensor>> {
        let Some(z) = self.zero.as_mut() else { return Ok(None) };
        let Some(clip) = z.clip.take() else { return Ok(None) };
        let parts = z.grad.as_ref().expect("stage 2 gradients").parts();
        if let Some(f) = found_inf {
            z.comm.all_reduce_max(f)?;
        }
        z.comm.all_reduce_sum(&clip.sq)?;
        let _ = clip.sq.f_sqrt_out(&clip.norm)?;
        if clip.max_norm > 0.0 {
            // min(max_norm / (norm + 1e-6), 1), in place, by the fallible scalar op
            // (src/ops.rs) and the constants allocated with the rest.
            let mut coef = clip.coef.shallow_clone();
            coef.f_copy_(&clip.norm)?;
            let _ = coef.f_add_(&clip.eps)?;
            let _ = coef.f_reciprocal_()?;
            crate::ops::mul_scalar_(&coef, clip.max_norm)?;
            let _ = coef.f_clamp_max_tensor_(&clip.one)?;
            for g in &parts {
                let _ = g.shallow_clone().f_mul_(&coef)?;
            }
        }
        Ok(Some(clip.norm))
    }
}
