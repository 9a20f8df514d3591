//! Owns the planner for any model: trial steps at small micro-batches, fitted by a line.
//! Keeps: trial steps run forward and backward twice, so accumulated gradients are counted.
use serde::Serialize;

use crate::data::StepBatches;
use crate::error::{Error, Result};
use crate::memory;
use crate::precision::Amp;
use crate::task::Task;

#[derive(Debug, Clone, Serialize)]
pub struct Profile {
    /// Weights, gradients, optimizer state and whatever else does not grow with the batch.
    pub fixed_bytes: u64,
    pub per_sample_bytes: u64,
    /// (micro-batch, measured peak bytes) of each trial.
    pub measured: Vec<(usize, u64)>,
    /// Share added for a caching allocator's rounding and fragmentation (CUDA).
    pub allocator_overhead: f64,
}

impl Profile {
    pub fn peak(&self, micro: usize) -> u64 {
        ((self.fixed_bytes + self.per_sample_bytes * micro as u64) as f64 * (1.0 + self.allocator_overhead)) as u64
    }

    /// The largest micro-batch (at most `max`) whose peak fits `memory`; 0 if none.
    pub fn largest_fitting(&self, memory: u64, max: usize) -> usize {
        let room = memory as f64 / (1.0 + self.allocator_overhead) - self.fixed_bytes as f64;
        if room < self.per_sample_bytes as f64 {
            return 0;
        }
        ((room / self.per_sample_bytes.max(1) as f64) as usize).min(max)
    }
}

/// The peak of trial steps at `micro` samples: `Ok(None)` when it ran out of memory.
fn trial(
    task: &dyn Task,
    data: &dyn StepBatches,
    clear_grads: &dyn Fn(),
    amp: &Amp,
    micro: usize,
) -> Result<Option<u64>> {
    let device = amp.device;
    memory::reset_peak(device);
    let outcome = (|| -> Result<()> {
        for _ in 0..2 {
            let (x, y) = data.micro_batch(0, 0..micro)?;
            let _ = task.forward_backward(&x, &y, 1.0, amp)?;
        }
        Ok(())
    })();
    let peak = memory::stats(device).peak_bytes;
    clear_grads();
    memory::empty_cache(device)?;
    match outcome {
        Ok(()) => Ok(Some(peak)),
        Err(Error::Oom(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Measures the model at micro-batches 1, 2, 4 (and 8 where the global batch allows), as far
/// as memory lets it, and fits the line. `None` when even one sample does not fit.
pub fn measure(
    task: &dyn Task,
    data: &dyn StepBatches,
    clear_grads: &dyn Fn(),
    amp: &Amp,
    cuda_overhead: f64,
) -> Result<Option<Profile>> {
    let device = amp.device;
    let max = data.global_batch_size();
    let mut measured = Vec::new();
    for micro in [1, 2, 4, 8].into_iter().filter(|&m| m <= max.max(2)) {
        match trial(task, data, clear_grads, amp, micro)? {
            Some(peak) => measured.push((micro, peak)),
            None => break,
        }
    }
    let Some(&(m0, p0)) = measured.first() else {
        return Ok(None);
    };
    let (fixed, slope) = if measured.len() < 2 {
        (0.0, p0 as f64 / m0 as f64) // one point: all of it scales (an upper bound)
    } else {
        fit(&measured)
    };
    Ok(Some(Profile {
        fixed_bytes: fixed.max(0.0) as u64,
        per_sample_bytes: slope.max(1.0) as u64,
        measured,
        allocator_overhead: if device.is_cuda() { cuda_overhead } else { 0.0 },
    }))
}

/// Least squares: (intercept, slope) of peak against micro-batch.
fn fit(points: &[(usize, u64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), &(x, y)| (a + x as f64, b + y as f64));
    let (mx, my) = (sx / n, sy / n);
    let (sxy, sxx) = points.iter().fold((0.0, 0.0), |(a, b), &(x, y)| {
        (a + (x as f64 - mx) * (y as f64 - my), b + (x as f64 - mx).powi(2))
    });
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - slope * mx, slope)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_through_the_peaks_and_what_fits() {
        let (a, b) = fit(&[(1, 1100), (2, 1200), (4, 1400)]);
        assert!((a - 1000.0).abs() < 1e-6 && (b - 100.0).abs() < 1e-6);
        let p = Profile {
            fixed_bytes: 1000,
            per_sample_bytes: 100,
            measured: vec![],
            allocator_overhead: 0.0,
        };
        assert_eq!(p.peak(10), 2000);
        assert_eq!(p.largest_fitting(2050, 64), 10);
        assert_eq!(p.largest_fitting(2050, 8), 8);
        assert_eq!(p.largest_fitting(1050, 64), 0);
    }
}
