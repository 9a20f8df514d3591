//! Tensor operations that take a scalar, fallible without a panic (csrc/ops.cpp). Use these
//! instead of tch's `f_mul_scalar`, `f_add_scalar`, `f_arange`, ... anywhere an allocation
//! can fail: those free their `Scalar` argument through a call that unwraps libtorch's
//! pending error, so an out-of-memory error in the operation panics instead of coming back
//! as `Err` (tch 0.26). Every tch operation with a scalar parameter (`S: Into<Scalar>`) has
//! the flaw; tensor-tensor operations do not.
use std::ffi::{c_char, c_void};
use tch::{TchError, Tensor};

use crate::memory::check;

extern "C" {
    fn og_mul_scalar(t: *mut c_void, v: f64, out: *mut *mut c_void) -> *mut c_char;
    fn og_add_scalar(t: *mut c_void, v: f64, out: *mut *mut c_void) -> *mut c_char;
    fn og_mul_scalar_(t: *mut c_void, v: f64) -> *mut c_char;
    fn og_arange_like(end: i64, like: *mut c_void, out: *mut *mut c_void) -> *mut c_char;
}

fn new_tensor(f: impl FnOnce(*mut *mut c_void) -> *mut c_char) -> Result<Tensor, TchError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    check(f(&mut out))?;
    // SAFETY: on success the C++ side returned a new torch::Tensor* we now own.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

fn ptr(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

/// `t * v`.
pub fn mul_scalar(t: &Tensor, v: f64) -> Result<Tensor, TchError> {
    new_tensor(|out| unsafe { og_mul_scalar(ptr(t), v, out) })
}

/// `t + v`.
pub fn add_scalar(t: &Tensor, v: f64) -> Result<Tensor, TchError> {
    new_tensor(|out| unsafe { og_add_scalar(ptr(t), v, out) })
}

/// `t *= v`, in place.
pub fn mul_scalar_(t: &Tensor, v: f64) -> Result<(), TchError> {
    check(unsafe { og_mul_scalar_(ptr(t), v) })
}

/// `0..end` as int64, on `like`'s device.
pub fn arange_like(end: i64, like: &Tensor) -> Result<Tensor, TchError> {
    new_tensor(|out| unsafe { og_arange_like(end, ptr(like), out) })
}

/// A 0-dim tensor holding `v`.
pub fn scalar(v: f64, kind: tch::Kind, device: tch::Device) -> Result<Tensor, TchError> {
    Tensor::f_from_slice(&[v])?.f_to_kind(kind)?.f_view([] as [i64; 0])?.f_to_device(device)
}
