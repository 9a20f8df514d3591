//! Owns the checkpoint clock (`checkpoint.every_minutes`): when another checkpoint is due.
//! Keeps: checkpoints take at most `MAX_SHARE` of wall time while that costs a stretch of at
//! most `MAX_STRETCH` x `every_minutes` and `CEILING_S`; past that, what a kill can lose wins
//! over what saving costs. Rank 0 alone asks and the ranks learn its answer at the step
//! boundary.
use std::time::{Duration, Instant};

/// The share of wall time checkpoints may take before the interval stretches: the interval is
/// at least their cost / this...
pub const MAX_SHARE: f64 = 0.01;
/// ...but a stretch waits at most this many times `every_minutes`...
pub const MAX_STRETCH: f64 = 6.0;
/// ...and never past this (60 minutes); an `every_minutes` longer than it is kept as it is.
pub const CEILING_S: f64 = 3600.0;

/// The interval in force: `every_s`, stretched so that a checkpoint costing `cost_s` takes at
/// most `MAX_SHARE` of wall time, the stretch capped at `MAX_STRETCH` x `every_s` and at
/// `CEILING_S` (never below `every_s`). None: the clock is off (`every_s` 0).
pub fn interval_s(every_s: f64, cost_s: f64) -> Option<f64> {
    let stretch = (cost_s / MAX_SHARE).min(every_s * MAX_STRETCH).min(CEILING_S);
    (every_s > 0.0).then(|| every_s.max(stretch))
}

/// The share of wall time checkpoints costing `cost_s` take at `interval_s` (the interval runs
/// from one checkpoint's end to the next one's start).
pub fn share(interval_s: f64, cost_s: f64) -> f64 {
    cost_s / (interval_s + cost_s)
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

/// The log's line for a newly stretched interval `interval_s` (checkpoints cost `cost_s`,
/// `every_minutes` asked for): within the share, or capped, and then what checkpoints cost and what
/// a kill can lose.
pub fn stretch_note(every_minutes: f64, interval_s: f64, cost_s: f64) -> String {
    let head = format!(
        "checkpoint.every_minutes: a checkpoint takes {cost_s:.1} s, so the clock waits {:.1} min instead of {}",
        interval_s / 60.0,
        every_minutes
    );
    let s = share(interval_s, cost_s);
    if s <= MAX_SHARE * 1.0001 {
        return format!("{head}, keeping checkpoints under {}% of wall time", MAX_SHARE * 100.0);
    }
    format!(
        "{head} (a stretch is capped at {MAX_STRETCH} x every_minutes and {} min, so that a kill loses at most {:.1} min): \
         checkpoints take {:.1}% of wall time; a cheaper checkpoint (fewer or smaller files, faster storage) or a longer \
         every_minutes trades the other way",
        CEILING_S / 60.0,
        (interval_s + cost_s) / 60.0,
        s * 100.0
    )
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

    /// Issue #54: a 6-minute sharded save stretched the default 10-minute clock to 10 hours
    /// (100 x its cost), so a kill could lose 10 hours. The stretch is capped at 6 x
    /// every_minutes and at 60 minutes.
    #[test]
    fn a_slow_checkpoint_stretches_the_clock_at_most_to_the_cap() {
        // 6 minutes a checkpoint at the default 10: 60 min, not 600.
        assert_eq!(interval_s(600.0, 360.0), Some(3600.0));
        assert!(!due(3599.0, 600.0, 360.0));
        assert!(due(3600.0, 600.0, 360.0));
        // 6 x every_minutes binds first for a short clock: 2 min and a 60 s save wait 12 min.
        assert_eq!(interval_s(120.0, 60.0), Some(720.0));
        // The 60-minute ceiling binds a longer one: 20 min and a 10-minute save wait 60, not 120.
        assert_eq!(interval_s(1200.0, 600.0), Some(3600.0));
        // An every_minutes past the ceiling is the user's own: kept, never shortened.
        assert_eq!(interval_s(7200.0, 360.0), Some(7200.0));
        assert_eq!(interval_s(7200.0, 1.0), Some(7200.0));
    }

    /// The table of docs/checkpoints.md ("The checkpoint clock"), at the default 10 minutes:
    /// a checkpoint's cost, the interval, the share of wall time checkpoints take, and the most
    /// a kill loses (the interval and a checkpoint), in minutes.
    #[test]
    fn the_documented_trade() {
        let rows = [
            (0.019, 10.0, 0.003, 10.0),
            (4.1, 10.0, 0.68, 10.1),
            (9.1, 15.2, 0.99, 15.3),
            (60.0, 60.0, 1.6, 61.0),
            (360.0, 60.0, 9.1, 66.0),
            (900.0, 60.0, 20.0, 75.0),
        ];
        for (cost, minutes, percent, loses) in rows {
            let i = interval_s(600.0, cost).unwrap();
            let round = |x: f64, digits: i32| (x * 10f64.powi(digits)).round() / 10f64.powi(digits);
            let digits = if percent < 0.01 {
                3
            } else if percent < 1.0 {
                2
            } else {
                1
            };
            assert_eq!(
                (
                    round(i / 60.0, 1),
                    round(share(i, cost) * 100.0, digits),
                    round((i + cost) / 60.0, 1)
                ),
                (minutes, percent, loses),
                "a {cost} s checkpoint"
            );
        }
    }

    #[test]
    fn the_log_says_when_the_cap_binds_and_what_it_costs() {
        let within = stretch_note(10.0, interval_s(600.0, 9.1).unwrap(), 9.1);
        assert_eq!(
            within,
            "checkpoint.every_minutes: a checkpoint takes 9.1 s, so the clock waits 15.2 min instead of 10, keeping \
             checkpoints under 1% of wall time"
        );
        let capped = stretch_note(10.0, interval_s(600.0, 360.0).unwrap(), 360.0);
        assert!(
            capped.starts_with(
                "checkpoint.every_minutes: a checkpoint takes 360.0 s, so the clock waits 60.0 min instead of 10 (a stretch \
                 is capped at 6 x every_minutes and 60 min, so that a kill loses at most 66.0 min): checkpoints take 9.1% \
                 of wall time"
            ),
            "{capped}"
        );
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
