//! Owns tensor operations that take a scalar, fallible without a panic (csrc/ops.cpp).
//! Keeps: an OOM comes back as `Err`; tch's scalar ops must not be used where allocation can fail.
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use tch::{Device, Kind, TchError, Tensor};

use crate::memory::check;

extern "C" {
    fn og_mul_scalar(t: *mut c_void, v: f64, out: *mut *mut c_void) -> *mut c_char;
    fn og_add_scalar(t: *mut c_void, v: f64, out: *mut *mut c_void) -> *mut c_char;
    fn og_mul_scalar_(t: *mut c_void, v: f64) -> *mut c_char;
    fn og_pin_memory(t: *mut c_void, out: *mut *mut c_void) -> *mut c_char;
    fn og_arange_like(end: i64, like: *mut c_void, out: *mut *mut c_void) -> *mut c_char;
    fn og_cuda_sync_debug() -> i32;
    fn og_cuda_syncs() -> i64;
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
    Tensor::f_from_slice(&[v])?
        .f_to_kind(kind)?
        .f_view([] as [i64; 0])?
        .f_to_device(device)
}

/// A host tensor onto `device` with no sync: on CUDA through pinned memory, copied without
/// blocking (a copy from pageable memory waits for the device's queue to drain, once per
/// micro-batch). Elsewhere a plain `to`.
pub fn upload(t: &Tensor, device: Device) -> Result<Tensor, TchError> {
    match device {
        Device::Cuda(_) if t.device() == Device::Cpu => {
            new_tensor(|out| unsafe { og_pin_memory(ptr(t), out) })?.f_to_device_(device, t.kind(), true, false)
        }
        _ => t.f_to_device(device),
    }
}

/// Device-to-host reads made through `read` and `read_one` so far, in this process.
static D2H_READS: AtomicU64 = AtomicU64::new(0);

/// Every value the runtime brings back from the device comes through here, and is counted:
/// on a GPU each read waits for the queue to drain, and the host then cannot queue the next
/// kernels ahead. The training step makes at most one per optimizer step (after the update
/// is queued), evaluation one per evaluation. Returns the values as f64, in order.
pub fn read(t: &Tensor) -> Result<Vec<f64>, TchError> {
    D2H_READS.fetch_add(1, Ordering::Relaxed);
    // No copy when `t` is already a contiguous f64 CPU tensor (the step's read-out is).
    let host = t.f_to_device(Device::Cpu)?.f_to_kind(Kind::Double)?.f_contiguous()?;
    let n = host.numel();
    let mut out = vec![0.0; n];
    host.f_copy_data(&mut out, n)?;
    Ok(out)
}

/// `read` of a one-element tensor.
pub fn read_one(t: &Tensor) -> Result<f64, TchError> {
    read(t)?
        .first()
        .copied()
        .ok_or_else(|| TchError::Shape(format!("read_one: an empty tensor {:?}", t.size())))
}

/// How many reads `read` and `read_one` have made.
pub fn d2h_reads() -> u64 {
    D2H_READS.load(Ordering::Relaxed)
}

/// CUDA's own count of synchronizing calls (`OOMGUARD_CUDA_SYNC_DEBUG=1`, csrc/ops.cpp):
/// `None` unless sync-debug mode is on (it needs libtorch's CUDA library).
pub fn cuda_syncs() -> Option<u64> {
    let n = unsafe { og_cuda_syncs() };
    (n >= 0).then_some(n as u64)
}

/// Turns CUDA's sync-debug mode on (warn) and starts counting its warnings; false where the
/// process has no CUDA library.
pub fn cuda_sync_debug() -> bool {
    unsafe { og_cuda_sync_debug() == 1 }
}
