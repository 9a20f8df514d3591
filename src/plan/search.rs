//! Owns `train.micro_batch_size: auto`: the largest micro-batch that fits, by real trial steps.
//! Keeps: the search starts from the planner's estimate and its result is remembered.
use serde::{Deserialize, Serialize};
use std::time::Instant;

use crate::data::StepBatches;
use crate::error::{Error, Result};
use crate::memory;
use crate::precision::Amp;
use crate::task::Task;

/// Largest `m` in 1..=max with `fits(m)`, probing from `start`: doubling up (or halving
/// down) to bracket it, then bisecting until within 1/16. Returns (size or 0, trials).
pub fn search(start: usize, max: usize, mut fits: impl FnMut(usize) -> Result<bool>) -> Result<(usize, u32)> {
    let mut trials = 0;
    let mut probe = |m: usize| {
        trials += 1;
        fits(m)
    };
    let (mut lo, mut hi) = (0usize, max + 1); // lo fits, hi fails
    let first = start.clamp(1, max);
    if probe(first)? {
        lo = first;
        while lo < max {
            let m = (lo * 2).min(max);
            if probe(m)? {
                lo = m;
            } else {
                hi = m;
                break;
            }
        }
    } else {
        hi = first;
        while hi > 1 {
            let m = hi / 2;
            if probe(m)? {
                lo = m;
                break;
            }
            hi = m;
        }
    }
    while lo > 0 && hi - lo > (lo / 16).max(1) {
        let mid = lo + (hi - lo) / 2;
        if probe(mid)? {
            lo = mid
        } else {
            hi = mid
        }
    }
    Ok((lo, trials))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AutoResult {
    /// The step the search ran before (a resumed run keeps this record).
    #[serde(default)]
    pub step: u64,
    /// What training starts with: the largest size found, less the safety margin.
    pub micro_batch_size: usize,
    pub largest_fitting: usize,
    pub trials: u32,
    pub from_cache: bool,
    pub search_s: f64,
    pub cache_key: String,
}

/// The largest micro-batch known to fit for `key` (a model, memory and device).
pub fn cached(key: &str) -> Option<usize> {
    oomguard_runfiles::cache::cached(key)
}

/// Records that `size` fits for `key` (the file shared with sweeps and Python guards:
/// oomguard_runfiles::cache).
pub fn remember(key: &str, size: usize) {
    if let Err(e) = oomguard_runfiles::cache::remember(key, size) {
        let at = oomguard_runfiles::cache::path()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        tracing::warn!("cannot write the micro-batch cache {at}: {e}");
    }
}

/// What to search for: the cache key, where to start (the planner's estimate), the most to
/// try (the global batch), and the safety margin taken off the result.
pub struct AutoSearch {
    pub key: String,
    pub start: usize,
    pub max: usize,
    pub margin: f64,
}

/// Resolves `auto`: the cache if it knows the key, else a search by trial steps on step
/// 0's samples.
pub fn auto_micro_batch(
    task: &dyn Task,
    data: &dyn StepBatches,
    clear_grads: impl Fn(),
    amp: &Amp,
    spec: AutoSearch,
) -> Result<AutoResult> {
    let device = amp.device;
    let AutoSearch {
        key,
        start,
        max,
        margin,
    } = spec;
    let with_margin = |m: usize| (((m as f64) * (1.0 - margin)).floor() as usize).max(1);
    if let Some(found) = cached(&key) {
        return Ok(AutoResult {
            step: 0,
            micro_batch_size: with_margin(found.min(max)),
            largest_fitting: found,
            trials: 0,
            from_cache: true,
            search_s: 0.0,
            cache_key: key,
        });
    }
    let t = Instant::now();
    let (found, trials) = search(start, max, |m| {
        let outcome = (|| -> Result<()> {
            let (x, y) = data.micro_batch(0, 0..m)?;
            // Below the global batch a step accumulates: its second micro-batch runs beside
            // the first one's gradients, as `profile`'s trials count them.
            for _ in 0..if m < max { 2 } else { 1 } {
                let _ = task.forward_backward(&x, &y, 1.0, amp)?;
            }
            Ok(())
        })();
        clear_grads();
        memory::empty_cache(device)?;
        match outcome {
            Ok(()) => Ok(true),
            Err(Error::Oom(_)) => Ok(false),
            Err(e) => Err(e),
        }
    })?;
    if found == 0 {
        return Err(Error::Infeasible("micro_batch_size: auto found no size that fits: even one sample runs out of memory. Run `oomguard plan` on this \
            config for what would fit".into()));
    }
    remember(&key, found);
    Ok(AutoResult {
        step: 0,
        micro_batch_size: with_margin(found),
        largest_fitting: found,
        trials,
        from_cache: false,
        search_s: t.elapsed().as_secs_f64(),
        cache_key: key,
    })
}

#[cfg(test)]
mod tests {
    use super::search;

    #[test]
    fn finds_the_largest_within_a_sixteenth_in_few_trials() {
        for (start, truth, max) in [
            (1, 37, 64),
            (64, 37, 64),
            (8, 8, 64),
            (100, 1, 256),
            (3, 200, 256),
            (16, 256, 256),
            (5, 1000, 1024),
        ] {
            let (found, trials) = search(start, max, |m| Ok(m <= truth)).unwrap();
            assert!(
                found <= truth && found as f64 >= truth as f64 * (1.0 - 1.0 / 16.0) - 1.0,
                "truth {truth}: found {found}"
            );
            // About 2 log2(size) from a good estimate; a far-off start adds its distance.
            let bound = 2.0 * (truth.max(start).max(2) as f64).log2().ceil() + 2.0;
            assert!(trials as f64 <= bound, "truth {truth}: {trials} trials > {bound}");
        }
        assert_eq!(search(8, 64, |_| Ok(false)).unwrap().0, 0);
    }
}
