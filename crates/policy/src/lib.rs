//! Owns the guard's decisions (shrink, grow back, cool-downs, thrash, leaks) for both guards.
//! Keeps: no I/O, no clock, no libtorch, so the same inputs decide alike on every rank; and
//! `Policy`'s serde form is what checkpoints hold.
use serde::{Deserialize, Serialize};

pub mod agreement;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyConfig {
    pub grow_after_steps: u64,
    pub grow_headroom: f64,
    pub cooldown_steps: u64,
    pub thrash_steps: u32,
    /// Failures at micro-batch 1 within one step that are retried before giving up (a
    /// failure that repeats exactly gives up at once).
    pub retries_at_one: u32,
}

/// What a successful step showed about memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// Live bytes when the step started.
    pub baseline_bytes: u64,
    /// Peak live bytes during the step.
    pub peak_bytes: u64,
    /// The budget or device capacity, if known.
    pub limit_bytes: Option<u64>,
    /// CUDA allocator retries so far (cumulative), if known.
    pub alloc_retries: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnOom {
    Retry {
        micro_batch_size: usize,
    },
    /// Already at micro-batch 1.
    GiveUp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adjust {
    Keep,
    Grow {
        micro_batch_size: usize,
    },
    /// Allocator thrash: shrink before a hard OOM.
    Shrink {
        micro_batch_size: usize,
    },
}

/// The micro-batch size and its history (saved with checkpoints).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    pub configured: usize,
    pub current: usize,
    pub clean_steps: u64,
    /// (size, step) of each failure still cooling down.
    pub failed: Vec<(usize, u64)>,
    pub retry_streak: u32,
    pub last_retries: Option<u64>,
    pub num_ooms: u64,
    /// Failures at micro-batch 1 in the current step, and the last one's signature.
    #[serde(default)]
    pub ones_failed: u32,
    #[serde(default)]
    pub last_one_signature: Option<u64>,
}

impl PolicyConfig {
    /// The defaults of the `memory.*` keys of the same names (oomguard train's config), used
    /// by the Python guard.
    pub const DEFAULT: PolicyConfig = PolicyConfig {
        grow_after_steps: 20,
        grow_headroom: 0.1,
        cooldown_steps: 100,
        thrash_steps: 3,
        retries_at_one: 8,
    };
}

impl Policy {
    pub fn new(configured: usize) -> Policy {
        Policy {
            configured,
            current: configured,
            clean_steps: 0,
            failed: Vec::new(),
            retry_streak: 0,
            last_retries: None,
            num_ooms: 0,
            ones_failed: 0,
            last_one_signature: None,
        }
    }

    /// After a relaunch by `oomguard launch`: the process died of an OOM at `failed`, and
    /// restarts at `now`. The failed size cools down as if it had failed here at `step`.
    pub fn relaunched(&mut self, failed: Option<usize>, now: usize, step: u64) {
        self.current = now.clamp(1, self.configured);
        self.clean_steps = 0;
        if let Some(f) = failed.filter(|&f| f > self.current) {
            self.failed.push((f, step));
        }
    }

    /// A saved policy, continued under a configured size that may have changed since.
    pub fn resumed(saved: Policy, configured: usize) -> Policy {
        Policy {
            configured,
            current: saved.current.min(configured),
            ..saved
        }
    }

    /// An OOM at the current size: halve (quarter when cleanup left memory behind). At
    /// micro-batch 1 the guard gives up when the failure repeats exactly (`signature`: the
    /// same phase, micro-batch, size asked and memory free: a step that does not fit fails
    /// at the same allocation every time); a different one (a passing spike, another tenant)
    /// is retried, up to `retries_at_one` times in a step.
    pub fn on_oom(&mut self, step: u64, severe: bool, signature: Option<u64>, retries_at_one: u32) -> OnOom {
        self.num_ooms += 1;
        self.clean_steps = 0;
        if self.current == 1 {
            self.ones_failed += 1;
            let repeated = signature.is_some() && signature == self.last_one_signature;
            self.last_one_signature = signature;
            if repeated || self.ones_failed > retries_at_one {
                self.ones_failed = 0;
                self.last_one_signature = None;
                return OnOom::GiveUp;
            }
            return OnOom::Retry { micro_batch_size: 1 };
        }
        self.failed.push((self.current, step));
        let divisor = if severe { 4 } else { 2 };
        self.current = self.current.div_ceil(divisor).max(1);
        OnOom::Retry {
            micro_batch_size: self.current,
        }
    }

    /// After a rung below micro-batch 1 was climbed: memory is used differently now, so the
    /// sizes that failed before are not held against it.
    pub fn rung_climbed(&mut self) {
        self.current = 1;
        self.failed.clear();
        self.clean_steps = 0;
        self.ones_failed = 0;
        self.last_one_signature = None;
    }

    /// After a successful step: grow back, shrink on thrash, or keep.
    pub fn after_step(&mut self, step: u64, obs: Observation, cfg: &PolicyConfig) -> Adjust {
        self.failed
            .retain(|&(_, at)| step.saturating_sub(at) < cfg.cooldown_steps);
        self.clean_steps += 1;
        self.ones_failed = 0;
        self.last_one_signature = None;
        if self.thrashing(obs.alloc_retries, cfg.thrash_steps) && self.current > 1 {
            self.failed.push((self.current, step));
            self.current = self.current.div_ceil(2);
            self.clean_steps = 0;
            return Adjust::Shrink {
                micro_batch_size: self.current,
            };
        }
        let next = (self.current * 2).min(self.configured);
        let grow = next > self.current
            && self.clean_steps >= cfg.grow_after_steps
            && !self.failed.iter().any(|&(size, _)| next >= size)
            && fits(&obs, self.current, next, cfg.grow_headroom);
        if grow {
            self.current = next;
            self.clean_steps = 0;
            return Adjust::Grow { micro_batch_size: next };
        }
        Adjust::Keep
    }

    fn thrashing(&mut self, retries: Option<u64>, thrash_steps: u32) -> bool {
        let Some(r) = retries else { return false };
        let rising = self.last_retries.is_some_and(|last| r > last);
        self.last_retries = Some(r);
        self.retry_streak = if rising { self.retry_streak + 1 } else { 0 };
        if thrash_steps > 0 && self.retry_streak >= thrash_steps {
            self.retry_streak = 0;
            return true;
        }
        false
    }
}

/// Whether `next` is predicted to fit: the step's own memory (peak over baseline) scales
/// with the micro-batch, and must leave `headroom` of the limit free.
pub fn fits(obs: &Observation, current: usize, next: usize, headroom: f64) -> bool {
    let Some(limit) = obs.limit_bytes else { return true };
    let step_bytes = obs.peak_bytes.saturating_sub(obs.baseline_bytes) as f64;
    let predicted = obs.baseline_bytes as f64 + step_bytes * next as f64 / current as f64;
    predicted <= limit as f64 * (1.0 - headroom)
}

/// Whether what stays live after an OOM's cleanup, beyond the attempt's start and what is
/// kept on purpose (`leftover`), is enough to shrink harder (`on_oom`'s `severe`): over a
/// 64th of the start's live bytes and over 64 MiB. Less is what a smaller size would not
/// give back either: a loss sum, a scaler's flag, the allocator's rounding, and cuBLAS's
/// workspaces (32 MiB each on Hopper), made by the first backward on autograd's thread
/// (most likely the 33 MiB left on an H200, docs/gpu-outcome.md). Both guards use it.
pub fn left_behind(leftover: u64, baseline: u64) -> bool {
    leftover > (baseline / 64).max(64 << 20)
}

/// The micro-batch cache's memory key: the device's limit in steps of 3% (an auto budget
/// moves a little between runs), so that what one budget learned never shrinks a run whose
/// budget is more than a step larger. Both guards key by it.
pub fn memory_step(limit: u64) -> u64 {
    ((limit.max(1) as f64).ln() / 1.03f64.ln()).floor() as u64
}

/// Live memory at step starts growing step after step: a graph or tensor kept alive
/// across steps.
#[derive(Debug, Clone, Default)]
pub struct LeakWatch {
    first: Option<(u64, u64)>,
    last: Option<u64>,
    streak: u32,
}

impl LeakWatch {
    /// Feeds the live bytes at the start of `step`; returns the mean growth per step when
    /// it has grown for `steps` steps in a row (then every `steps` steps while it goes on).
    pub fn observe(&mut self, step: u64, live: u64, steps: u32) -> Option<u64> {
        let grew = self.last.is_some_and(|l| live > l);
        self.last = Some(live);
        if !grew {
            self.first = Some((step, live));
            self.streak = 0;
            return None;
        }
        self.streak += 1;
        let (s0, l0) = self.first?;
        (steps > 0 && self.streak.is_multiple_of(steps)).then(|| (live - l0) / (step - s0).max(1))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn budgets_a_few_percent_apart_share_a_cache_key_and_others_do_not() {
        let mib = |m: f64| (m * 1048576.0) as u64;
        assert_ne!(super::memory_step(mib(64.0)), super::memory_step(mib(100.0)));
        assert_ne!(super::memory_step(mib(64.0)), super::memory_step(mib(68.0)));
        assert!(super::memory_step(mib(101.0)) < super::memory_step(mib(104.5)));
        assert!(super::memory_step(mib(101.0)) - super::memory_step(mib(100.0)) <= 1);
    }

    use super::*;

    const CFG: PolicyConfig = PolicyConfig {
        grow_after_steps: 3,
        grow_headroom: 0.1,
        cooldown_steps: 10,
        thrash_steps: 2,
        retries_at_one: 0,
    };

    fn obs(baseline: u64, peak: u64, limit: u64) -> Observation {
        Observation {
            baseline_bytes: baseline,
            peak_bytes: peak,
            limit_bytes: Some(limit),
            alloc_retries: None,
        }
    }

    #[test]
    fn halves_down_to_one_then_gives_up() {
        let mut p = Policy::new(24);
        let sizes: Vec<OnOom> = (0..6).map(|s| p.on_oom(s, false, None, 0)).collect();
        assert_eq!(
            sizes,
            [12, 6, 3, 2, 1]
                .iter()
                .map(|&m| OnOom::Retry { micro_batch_size: m })
                .chain([OnOom::GiveUp])
                .collect::<Vec<_>>()
        );
        assert_eq!(p.num_ooms, 6);
    }

    #[test]
    fn at_one_a_repeated_failure_gives_up_a_different_one_is_retried() {
        let mut p = Policy::new(2);
        assert_eq!(p.on_oom(0, false, Some(7), 3), OnOom::Retry { micro_batch_size: 1 });
        // A failure elsewhere (a spike): retried.
        assert_eq!(p.on_oom(0, false, Some(8), 3), OnOom::Retry { micro_batch_size: 1 });
        // The same allocation failing again: this step does not fit.
        assert_eq!(p.on_oom(0, false, Some(8), 3), OnOom::GiveUp);
        // A step that succeeds resets the count: a later spike is retried again, up to the cap.
        p.on_oom(1, false, Some(1), 3);
        assert_eq!(p.after_step(1, obs(0, 1, 100), &CFG), Adjust::Keep);
        for sig in 2..5 {
            assert_eq!(
                p.on_oom(2, false, Some(sig), 3),
                OnOom::Retry { micro_batch_size: 1 },
                "{sig}"
            );
        }
        assert_eq!(p.on_oom(2, false, Some(9), 3), OnOom::GiveUp);
    }

    #[test]
    fn a_relaunch_cools_the_size_that_died() {
        let mut p = Policy::new(16);
        p.relaunched(Some(16), 8, 5);
        assert_eq!(p.current, 8);
        let roomy = obs(0, 1, u64::MAX);
        // 16 killed the process at step 5: not tried again before step 15 (cooldown 10).
        for s in 5..15 {
            assert_eq!(p.after_step(s, roomy, &CFG), Adjust::Keep, "step {s}");
        }
        assert_eq!(p.after_step(15, roomy, &CFG), Adjust::Grow { micro_batch_size: 16 });
    }

    #[test]
    fn only_memory_that_matters_is_left_behind() {
        assert!(!left_behind(0, 0));
        assert!(!left_behind(512, 1 << 30), "a scalar's block");
        assert!(!left_behind(34_603_008, 570_445_824), "a cuBLAS workspace (an H200)");
        assert!(!left_behind(64 << 20, 0));
        assert!(left_behind((64 << 20) + 1, 0));
        assert!(!left_behind(128 << 20, 8 << 30), "a 64th of 8 GiB is 128 MiB");
        assert!(left_behind((128 << 20) + 1, 8 << 30));
    }

    #[test]
    fn severe_oom_quarters() {
        let mut p = Policy::new(16);
        assert_eq!(p.on_oom(0, true, None, 0), OnOom::Retry { micro_batch_size: 4 });
    }

    #[test]
    fn grows_back_after_clean_steps_with_headroom_and_cooldown() {
        let mut p = Policy::new(16);
        p.on_oom(0, false, None, 0); // 16 failed at step 0 -> 8
        let roomy = obs(100, 200, 10_000);
        // Clean steps 1..=3 are enough, but 16 is cooling down until step 10.
        for s in 1..10 {
            assert_eq!(p.after_step(s, roomy, &CFG), Adjust::Keep, "step {s}");
        }
        assert_eq!(p.after_step(10, roomy, &CFG), Adjust::Grow { micro_batch_size: 16 });
        assert_eq!(p.current, 16);
        // Never above the configured size.
        for s in 11..30 {
            assert_eq!(p.after_step(s, roomy, &CFG), Adjust::Keep);
        }
    }

    #[test]
    fn does_not_grow_without_headroom() {
        let mut p = Policy::new(16);
        p.on_oom(0, false, None, 0);
        // Step memory 600 at 8 predicts 100 + 1200 at 16: over 90% of 1400.
        for s in 1..40 {
            assert_eq!(p.after_step(s, obs(100, 700, 1400), &CFG), Adjust::Keep);
        }
        assert_eq!(
            p.after_step(40, obs(100, 500, 1400), &CFG),
            Adjust::Grow { micro_batch_size: 16 }
        );
    }

    #[test]
    fn grows_in_doublings_capped_at_configured() {
        let mut p = Policy::new(12);
        for s in 0..3 {
            p.on_oom(s, false, None, 0); // 6, 3, 2
        }
        let roomy = obs(0, 1, u64::MAX);
        let mut sizes = vec![];
        for s in 100..130 {
            if let Adjust::Grow { micro_batch_size } = p.after_step(s, roomy, &CFG) {
                sizes.push(micro_batch_size);
            }
        }
        assert_eq!(sizes, vec![4, 8, 12]);
    }

    #[test]
    fn rising_alloc_retries_shrink() {
        let mut p = Policy::new(8);
        let with = |r| Observation {
            alloc_retries: Some(r),
            ..obs(0, 1, u64::MAX)
        };
        assert_eq!(p.after_step(0, with(0), &CFG), Adjust::Keep);
        assert_eq!(p.after_step(1, with(2), &CFG), Adjust::Keep);
        assert_eq!(p.after_step(2, with(5), &CFG), Adjust::Shrink { micro_batch_size: 4 });
        assert_eq!(p.after_step(3, with(5), &CFG), Adjust::Keep);
    }

    #[test]
    fn leak_watch_reports_growth_per_step() {
        let mut w = LeakWatch::default();
        assert_eq!(w.observe(0, 1000, 3), None);
        assert_eq!(w.observe(1, 1100, 3), None);
        assert_eq!(w.observe(2, 1200, 3), None);
        assert_eq!(w.observe(3, 1300, 3), Some(100));
        assert_eq!(w.observe(4, 1300, 3), None); // flat: streak over
        for s in 5..8 {
            assert_eq!(
                w.observe(s, 1300 + (s - 4) * 10, 3),
                if s == 7 { Some(10) } else { None }
            );
        }
    }
}
