//! Owns the checkpoint clock (`checkpoint.every_minutes`): when another checkpoint is due.
//! Keeps: checkpoints never take more than `MAX_SHARE` of wall time; rank 0 alone asks and the
//! ranks learn its answer at the step boundary.
use std::time::{Duration, Instant};

/// The most wall time checkpoints may take: the interval is at least their cost / this.
pub const MAX_SHARE: f64 = 0.01;

/// The interval in force: `every_s`, stretched so that a checkpoint costing `cost_s` takes at
/// most `MAX_SHARE` of wall time. None: the clock is off (`every_s` 0).
pub fn interval_s(every_s: f64, cost_s: f64) -> Option<f64> {
    (every_s > 0.0).then(|| every_s.max(cost_s / MAX_SHARE))
}

/// Whether a checkpoint is due, `since_s` after the last one.
pub fn due(since_s: f64, every_s: f64, cost_s: f64) -> bool {
    interval_s(every_s, cost_s).is_some_and(|i| since_s >= i)
}

/// The clock's state on rank 0: when the last checkpoint ended and what it cost.
#[derive(Debug)]
pub struct Clock {
    every_s: f64,
    last: Instant,
    cost_s: f64,
    /// The stretched interval already reported, so that the log says it once per change.
    told_s: Option<f64>,
}

impl Clock {
    pub fn new(every_minutes: f64) -> Clock {
        Clock {
            every_s: every_minutes * 60.0,
            last: Instant::now(),
            cost_s: 0.0,
            told_s: None,
        }
    }

    pub fn is_due(&self) -> bool {
        due(self.last.elapsed().as_secs_f64(), self.every_s, self.cost_s)
    }

    /// A checkpoint (for any reason) just ended, having taken `cost`. Returns the interval in
    /// force, and whether it was newly stretched past `every_minutes`, for the log.
    pub fn checkpointed(&mut self, cost: Duration) -> (Option<f64>, bool) {
        self.last = Instant::now();
        self.cost_s = cost.as_secs_f64();
        let interval = interval_s(self.every_s, self.cost_s);
        let stretched = interval.filter(|&i| i > self.every_s);
        // Said again only when the stretch moves by more than a tenth.
        let news = stretched.is_some_and(|s| self.told_s.is_none_or(|t| (s - t).abs() > 0.1 * t));
        if news {
            self.told_s = stretched;
        }
        (interval, news)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_at_zero() {
        assert_eq!(interval_s(0.0, 5.0), None);
        assert!(!due(1e9, 0.0, 0.0));
    }

    #[test]
    fn due_once_the_interval_has_passed() {
        assert!(!due(599.0, 600.0, 1.0));
        assert!(due(600.0, 600.0, 1.0));
    }

    #[test]
    fn a_slow_checkpoint_stretches_the_interval_to_one_percent() {
        // 10 s a checkpoint: at most every 1000 s, not every 600.
        assert_eq!(interval_s(600.0, 10.0), Some(1000.0));
        assert!(!due(900.0, 600.0, 10.0));
        assert!(due(1000.0, 600.0, 10.0));
        // A cheap one leaves it alone.
        assert_eq!(interval_s(600.0, 2.0), Some(600.0));
    }

    #[test]
    fn a_stretch_is_told_once_until_it_moves() {
        let mut c = Clock::new(1.0); // 60 s
        assert_eq!(c.checkpointed(Duration::from_millis(100)), (Some(60.0), false));
        let (i, news) = c.checkpointed(Duration::from_secs(1));
        assert_eq!((i, news), (Some(100.0), true));
        assert_eq!(c.checkpointed(Duration::from_millis(1050)), (Some(105.0), false));
        assert_eq!(c.checkpointed(Duration::from_secs(2)), (Some(200.0), true));
    }
}
