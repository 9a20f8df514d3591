//! Owns fault injection (`--inject-oom COUNT[:SEED]`): chosen CPU allocations fail as a real
//! budget overrun does.
//! Keeps: the failures are seeded and reproducible; a failure a step did not reach moves on.
use std::str::FromStr;

use crate::rng::splitmix64;

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
            seed: seed
                .map(|d| d.trim().parse().map_err(|_| bad()))
                .transpose()?
                .unwrap_or(0),
        })
    }
}

/// Test-only: `OOMGUARD_TEST_OOM_IN=PHASE:RANK:STEP[:AFTER][,...]` fails the first
/// allocation made after that phase begins on that rank at that step (or the AFTER-th one
/// after it), once each: a real OOM from the counting allocator where random injection
/// rarely lands (the update's allocations come last in a step, after the attempts that
/// failed earlier; a backward part-way, its first buckets sent). Not with `--inject-oom`.
pub mod targeted {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, OnceLock};

    static RANK: AtomicU64 = AtomicU64::new(0);
    static STEP: AtomicU64 = AtomicU64::new(0);

    #[allow(clippy::type_complexity)]
    fn targets() -> &'static Mutex<Vec<(String, u64, u64, u64)>> {
        static T: OnceLock<Mutex<Vec<(String, u64, u64, u64)>>> = OnceLock::new();
        T.get_or_init(|| {
            let spec = test_hook!("OOMGUARD_TEST_OOM_IN").unwrap_or_default();
            let parse = |t: &str| {
                let mut f = t.split(':');
                Some((
                    f.next()?.trim().to_string(),
                    f.next()?.trim().parse().ok()?,
                    f.next()?.trim().parse().ok()?,
                    f.next().map_or(Some(0), |a| a.trim().parse().ok())?,
                ))
            };
            Mutex::new(spec.split(',').filter_map(parse).collect())
        })
    }

    /// Whether any target was given (so the hot path costs one load otherwise).
    pub fn wanted() -> bool {
        static W: OnceLock<bool> = OnceLock::new();
        *W.get_or_init(|| test_hook!("OOMGUARD_TEST_OOM_IN").is_some())
    }

    pub fn at(rank: usize, step: u64) {
        RANK.store(rank as u64, Ordering::Relaxed);
        STEP.store(step, Ordering::Relaxed);
    }

    /// `phase` (its snake_case name) begins on the training thread.
    pub fn phase_begins(phase: &str) {
        let Ok(mut t) = targets().lock() else { return };
        let (r, s) = (RANK.load(Ordering::Relaxed), STEP.load(Ordering::Relaxed));
        if let Some(i) = t.iter().position(|(p, tr, ts, _)| p == phase && *tr == r && *ts == s) {
            let (.., after) = t.remove(i);
            super::arm(&[super::alloc_count() + after]);
        }
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

impl InjectOom {
    /// Rank `rank`'s own draw (rank 0, and a single process, keep SEED as it is).
    pub fn for_rank(self, rank: usize) -> InjectOom {
        match rank {
            0 => self,
            r => InjectOom {
                seed: self.seed ^ splitmix64(r as u64 ^ 0x005E_ED0F_4A4C),
                ..self
            },
        }
    }
}

/// The injection of one run: counts the first step, then arms each step's share.
pub struct Injection {
    spec: InjectOom,
    /// The first step of this process, and the failures assigned to each later step.
    first: Option<u64>,
    /// Failures due at each step after the first (by its offset), where any are.
    share: std::collections::BTreeMap<u64, u32>,
    /// The allocation clock when the current step started, whether an evaluation ends it,
    /// and the allocations of the last step without and with one (checkpoint included) in
    /// which no failure fired.
    step_start: u64,
    evaluates: bool,
    window: [u64; 2],
    smallest: u64,
    /// Failures assigned and not yet fired, and the fired count when they were armed.
    pending: u64,
    fired_at_arming: u64,
    /// The failure of this step kept for the evaluation that ends it (`before_eval`).
    eval_due: u32,
}

impl Injection {
    pub fn new(spec: InjectOom) -> Injection {
        Injection {
            spec,
            first: None,
            share: Default::default(),
            step_start: 0,
            evaluates: false,
            window: [0, 0],
            smallest: u64::MAX,
            pending: 0,
            fired_at_arming: fired(),
            eval_due: 0,
        }
    }

    /// Before step `step` of a run of `max_steps` (`evaluates`: an evaluation follows it):
    /// arms this step's failures.
    pub fn before_step(&mut self, step: u64, max_steps: u64, evaluates: bool) {
        let now = alloc_count();
        let fired_since = fired() - self.fired_at_arming;
        if fired_since == 0 && self.first.is_some() {
            let w = (now - self.step_start).max(1); // retries inflate a window with failures
            self.window[self.evaluates as usize] = w;
            self.smallest = self.smallest.min(w);
        }
        self.step_start = now;
        self.evaluates = evaluates;
        let Some(first) = self.first else {
            self.first = Some(step);
            self.share = shares(self.spec, max_steps.saturating_sub(step + 1));
            return;
        };
        // Unmeasured windows are 0 (with an evaluation after every step, a step without one
        // never comes): the last step takes half the smallest measured, any other its kind's,
        // else a plain step's, else the smallest.
        let smallest = (self.smallest != u64::MAX).then_some(self.smallest);
        let known = |w: u64| (w > 0).then_some(w);
        let window = match known(self.window[evaluates as usize]) {
            _ if step + 1 == max_steps => (smallest.unwrap_or(1) / 2).max(1),
            Some(w) => w,
            None => known(self.window[0]).or(smallest).unwrap_or(1),
        };
        let mut due = self.share.get(&(step - first - 1)).copied().unwrap_or(0) as u64;
        // Of two or more, one waits for the evaluation: the windows cannot reach it reliably
        // (a step's window is measured on steps whose failures all missed).
        self.eval_due = (evaluates && due >= 2) as u32;
        due -= self.eval_due as u64;
        self.pending = self.pending.saturating_sub(fired_since) + due;
        self.fired_at_arming = fired();
        arm(&positions(
            self.pending as u32,
            self.spec.seed ^ splitmix64(step),
            now,
            window,
        ));
    }

    /// Before the evaluation that ends step `step`: arms the failure kept for it among its
    /// first allocations (an evaluation makes more than that many), so that evaluation is
    /// always covered. Failures of the step not reached yet carry over as ever.
    pub fn before_eval(&mut self, step: u64) {
        if self.eval_due == 0 {
            return;
        }
        let fired_since = fired() - self.fired_at_arming;
        self.pending = self.pending.saturating_sub(fired_since) + self.eval_due as u64;
        self.fired_at_arming = fired();
        self.eval_due = 0;
        arm(&positions(
            1,
            self.spec.seed ^ splitmix64(step ^ 0xE7A1),
            alloc_count(),
            16,
        ));
    }

    /// (failures injected, failures asked for).
    pub fn report(&self) -> (u64, u32) {
        (fired(), self.spec.count)
    }
}

/// COUNT failures assigned to `steps` steps, uniformly at random from the seed: each step's
/// offset that gets any, with how many (as many entries as failures at most, whatever
/// `train.max_steps`).
fn shares(spec: InjectOom, steps: u64) -> std::collections::BTreeMap<u64, u32> {
    let mut share = std::collections::BTreeMap::new();
    if steps > 0 {
        for i in 0..spec.count as u64 {
            *share
                .entry(splitmix64(spec.seed ^ splitmix64(i + 1)) % steps)
                .or_insert(0) += 1;
        }
    }
    share
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
        let s = shares(InjectOom { count: 100, seed: 4 }, 10);
        assert_eq!(s.values().sum::<u32>(), 100);
        assert_eq!(
            s.keys().copied().collect::<Vec<_>>(),
            (0..10).collect::<Vec<_>>(),
            "{s:?}"
        );
        // A run of 10^15 steps: 3 entries, not a vector of them.
        assert!(shares(InjectOom { count: 3, seed: 4 }, 1_000_000_000_000_000).len() <= 3);
        assert!(shares(InjectOom { count: 3, seed: 4 }, 0).is_empty());
    }
}
