//! Owns libtorch's default generators: saved with checkpoints, replayed by recomputation.
//! Keeps: a resumed run and a recomputed block draw the same dropout masks as the first time.
use std::ffi::{c_char, c_void};
use tch::{Device, TchError, Tensor};

use crate::error::check;
use crate::error::Result;

extern "C" {
    fn og_rng_get_state(cuda_index: i32, out: *mut *mut c_void) -> *mut c_char;
    fn og_rng_set_state(cuda_index: i32, state: *mut c_void) -> *mut c_char;
}

fn generators(device: Device) -> Vec<(String, i32)> {
    let mut g = vec![("cpu".to_string(), -1)];
    if let Device::Cuda(i) = device {
        g.push((format!("cuda:{i}"), i as i32));
    }
    g
}

pub fn get_states(device: Device) -> Result<Vec<(String, Tensor)>> {
    Ok(capture(device)?
        .into_iter()
        .zip(generators(device))
        .map(|(t, (name, _))| (name, t))
        .collect())
}

/// The generators' states now (CPU, then the CUDA device's).
pub fn capture(device: Device) -> Result<Vec<Tensor>, TchError> {
    generators(device)
        .into_iter()
        .map(|(_, index)| {
            let mut out: *mut c_void = std::ptr::null_mut();
            check(unsafe { og_rng_get_state(index, &mut out) })?;
            // SAFETY: on success og_rng_get_state returns a new torch::Tensor* we now own.
            Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
        })
        .collect()
}

/// Puts back states from `capture`.
pub fn restore(states: &[Tensor], device: Device) -> Result<(), TchError> {
    for (t, (_, index)) in states.iter().zip(generators(device)) {
        check(unsafe { og_rng_set_state(index, t.as_ptr() as *mut c_void) })?;
    }
    Ok(())
}

/// A generator the file lacks (saved on another device: a CPU run resumed on a GPU, or
/// `cuda:1` resumed as rank 0 on `cuda:0`) is left as it is: every attempt of every step
/// seeds them all from (seed, step, rank) anyway (`seed_rank_step`).
pub fn set_states(saved: &[(String, Tensor)], device: Device) -> Result<()> {
    for (name, index) in generators(device) {
        let Some((_, t)) = saved.iter().find(|(n, _)| *n == name) else {
            tracing::debug!("rng.safetensors has no `{name}` generator state (saved on another device): left unset");
            continue;
        };
        check(unsafe { og_rng_set_state(index, t.as_ptr() as *mut c_void) })?;
    }
    Ok(())
}

/// Each rank's generators (one process: rank 0's) at the start of each attempt of a step,
/// a pure function of (seed, step, rank). Dropout masks differ by rank, a retried attempt
/// draws what the first drew, and a resume at any world size needs no saved state.
pub fn seed_rank_step(seed: u64, step: u64, rank: usize) {
    tch::manual_seed(rank_step_seed(seed, step, rank) as i64);
}

/// The seed of (seed, step, rank): torch's generators' and, for a model with host
/// generators (Python's `random`, numpy's), theirs (`Task::seed_host_rng`).
pub fn rank_step_seed(seed: u64, step: u64, rank: usize) -> u64 {
    splitmix64(seed ^ splitmix64(step ^ splitmix64(rank as u64 ^ 0xD15C0))) >> 1
}

/// SplitMix64: a counter-based generator, so any sample is computed without a sequence.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}
