//! Owns which checkpoints to keep: a pure function, tested in place.
//! Keeps: the newest valid checkpoint is never deleted.

/// A checkpoint as retention sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub step: u64,
    /// The evaluation loss at that step, if there was one.
    pub loss: Option<f64>,
    /// Whether it verifies.
    pub valid: bool,
}

/// The steps to delete: every corrupt checkpoint, and every valid one but the newest `keep`
/// valid ones and, with `keep_best`, the valid one with the lowest loss. The newest valid
/// checkpoint is never deleted, whatever corrupt ones lie beside it.
pub fn retention(checkpoints: &[Candidate], keep: usize, keep_best: bool) -> Vec<u64> {
    let mut valid: Vec<&Candidate> = checkpoints.iter().filter(|c| c.valid).collect();
    valid.sort_by_key(|c| c.step);
    let newest: Vec<u64> = valid.iter().rev().take(keep.max(1)).map(|c| c.step).collect();
    let best = keep_best
        .then(|| {
            valid
                .iter()
                .filter_map(|c| c.loss.filter(|l| l.is_finite()).map(|l| (c.step, l)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
        })
        .flatten()
        .map(|(s, _)| s);
    let mut delete: Vec<u64> = checkpoints
        .iter()
        .map(|c| c.step)
        .filter(|s| !newest.contains(s) && Some(*s) != best)
        .collect();
    delete.sort_unstable();
    delete
}

#[cfg(test)]
mod tests {
    use super::{retention, Candidate};

    fn c(step: u64, loss: Option<f64>) -> Candidate {
        Candidate {
            step,
            loss,
            valid: true,
        }
    }

    #[test]
    fn keeps_the_newest_and_the_best() {
        let cs = [
            c(10, Some(3.0)),
            c(20, Some(1.0)),
            c(30, Some(2.0)),
            c(40, None),
            c(50, Some(2.5)),
        ];
        assert_eq!(retention(&cs, 2, true), vec![10, 30]);
        assert_eq!(retention(&cs, 2, false), vec![10, 20, 30]);
        assert_eq!(retention(&cs, 10, true), Vec::<u64>::new());
        // The best being among the newest keeps nothing extra.
        assert_eq!(retention(&[c(1, Some(5.0)), c(2, Some(1.0))], 1, true), vec![1]);
        assert_eq!(retention(&[], 3, true), Vec::<u64>::new());
    }

    #[test]
    fn corrupt_ones_go_and_never_cost_the_newest_valid() {
        let bad = |step| Candidate {
            step,
            loss: Some(0.1),
            valid: false,
        };
        // Two corrupt newer checkpoints: the only valid one stays, the corrupt ones go.
        assert_eq!(retention(&[c(10, None), bad(20), bad(30)], 1, true), vec![20, 30]);
        // keep 2 counts valid checkpoints only; a corrupt one is never "the best".
        assert_eq!(
            retention(&[c(10, Some(2.0)), c(20, Some(3.0)), bad(30), c(40, None)], 2, true),
            vec![30]
        );
        assert_eq!(
            retention(&[c(10, Some(2.0)), c(20, Some(3.0)), bad(30), c(40, None)], 1, true),
            vec![20, 30]
        );
    }
}
