//! Fault injection (`oomguard train --inject-oom COUNT[:SEED]`), a testing and chaos tool:
//! chosen allocations of the counting CPU allocator fail with the same
//! `c10::OutOfMemoryError` a real budget overrun raises, so every path that can meet an OOM
//! (data loading, forward, backward, clipping, the optimizer, evaluation, checkpoints) is
//! exercised. The first training step is counted; its allocations set the rate at which
//! the COUNT failures are spread, at seeded random allocations, over the rest of the run.
use std::str::FromStr;

use crate::data::splitmix64;

mod ffi {
    extern "C" {
        pub fn og_cpu_alloc_count() -> u64;
        pub fn og_inject_arm(at: *const u64, n: i32);
        pub fn og_inject_fired() -> i64;
    }
}

/// Allocations asked of the counting CPU allocator so far.
pub fn alloc_count() -> u64 {
    unsafe { ffi::og_cpu_alloc_count() }
}

/// Makes the allocations numbered `at` (by `alloc_count`'s clock) fail; empty disarms.
pub fn arm(at: &[u64]) {
    unsafe { ffi::og_inject_arm(at.as_ptr(), at.len() as i32) }
}

/// Injected failures so far.
pub fn fired() -> u64 {
    unsafe { ffi::og_inject_fired() }.max(0) as u64
}

/// `--inject-oom COUNT[:SEED]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectOom {
    pub count: u32,
    pub seed: u64,
}

impl FromStr for InjectOom {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("`{s}` is not COUNT[:SEED], e.g. 20 or 20:7");
        let (count, seed) = s.split_once(':').map_or((s, None), |(c, d)| (c, Some(d)));
        Ok(InjectOom {
            count: count.trim().parse().map_err(|_| bad())?,
            seed: seed.map(|d| d.trim().parse().map_err(|_| bad())).transpose()?.unwrap_or(0),
        })
    }
}

/// `count` distinct allocation numbers in `from..from + span`, seeded: a pure function.
pub fn positions(count: u32, seed: u64, from: u64, span: u64) -> Vec<u64> {
    let span = span.max(count as u64).max(1);
    let mut out: Vec<u64> = Vec::with_capacity(count as usize);
    let mut x = splitmix64(seed ^ 0x0DD_C0FFEE);
    while out.len() < count as usize {
        x = splitmix64(x);
        let p = from + x % span;
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out.sort_unstable();
    out
}

/// The injection of one run: counts the first step, then arms.
pub struct Injection {
    spec: InjectOom,
    first_step_start: Option<u64>,
    armed: bool,
}

impl Injection {
    pub fn new(spec: InjectOom) -> Injection {
        Injection { spec, first_step_start: None, armed: false }
    }

    pub fn before_step(&mut self) {
        if self.first_step_start.is_none() {
            self.first_step_start = Some(alloc_count());
        }
    }

    /// After a step: the first one sets the rate; the failures are then spread over the
    /// `steps_left` steps' worth of allocations to come.
    pub fn after_step(&mut self, steps_left: u64) {
        let (Some(start), false) = (self.first_step_start, self.armed) else { return };
        let now = alloc_count();
        let per_step = (now - start).max(1);
        let at = positions(self.spec.count, self.spec.seed, now, per_step * steps_left.max(1));
        tracing::info!(
            "--inject-oom: {} allocation failures armed over the next {} allocations (about {} per step)",
            at.len(), per_step * steps_left.max(1), per_step
        );
        arm(&at);
        self.armed = true;
    }

    /// (failures injected, failures asked for).
    pub fn report(&self) -> (u64, u32) {
        (fired(), self.spec.count)
    }
}

impl Drop for Injection {
    /// Nothing stays armed past the run (a library may train again in the same process).
    fn drop(&mut self) {
        arm(&[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_and_positions() {
        assert_eq!("20:7".parse::<InjectOom>(), Ok(InjectOom { count: 20, seed: 7 }));
        assert_eq!("3".parse::<InjectOom>(), Ok(InjectOom { count: 3, seed: 0 }));
        assert!("x".parse::<InjectOom>().is_err() && "2:y".parse::<InjectOom>().is_err());
        let p = positions(10, 1, 100, 1000);
        assert_eq!(p, positions(10, 1, 100, 1000));
        assert_ne!(p, positions(10, 2, 100, 1000));
        assert_eq!(p.len(), 10);
        assert!(p.windows(2).all(|w| w[0] < w[1]) && p.iter().all(|&x| (100..1100).contains(&x)));
        // More failures than allocations to spread them over: still distinct.
        assert_eq!(positions(5, 3, 0, 2).len(), 5);
    }
}
