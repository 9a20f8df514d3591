//! Which checkpoints to keep: a pure function, tested in place.

/// Given checkpoints as (step, eval loss at that step if any), returns the steps to delete:
/// everything but the newest `keep` and, with `keep_best`, the one with the lowest loss.
pub fn retention(checkpoints: &[(u64, Option<f64>)], keep: usize, keep_best: bool) -> Vec<u64> {
    let mut steps: Vec<u64> = checkpoints.iter().map(|(s, _)| *s).collect();
    steps.sort_unstable();
    let newest: Vec<u64> = steps.iter().rev().take(keep.max(1)).copied().collect();
    let best = keep_best
        .then(|| checkpoints.iter().filter_map(|(s, l)| l.filter(|l| l.is_finite()).map(|l| (*s, l))).min_by(|a, b| a.1.total_cmp(&b.1)))
        .flatten()
        .map(|(s, _)| s);
    steps.into_iter().filter(|s| !newest.contains(s) && Some(*s) != best).collect()
}

#[cfg(test)]
mod tests {
    use super::retention;

    #[test]
    fn keeps_the_newest_and_the_best() {
        let c = [(10, Some(3.0)), (20, Some(1.0)), (30, Some(2.0)), (40, None), (50, Some(2.5))];
        assert_eq!(retention(&c, 2, true), vec![10, 30]);
        assert_eq!(retention(&c, 2, false), vec![10, 20, 30]);
        assert_eq!(retention(&c, 10, true), Vec::<u64>::new());
        // The best being among the newest keeps nothing extra.
        assert_eq!(retention(&[(1, Some(5.0)), (2, Some(1.0))], 1, true), vec![1]);
        assert_eq!(retention(&[], 3, true), Vec::<u64>::new());
    }
}
