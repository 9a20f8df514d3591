//! Owns the meaning of the Python guard's agreement vector: what each rank votes after an
//! attempt (or at a checkpoint before a collective inside one), and what the element-wise
//! maximum of every rank's vote says.
//! Keeps: one fixed length for every vote, so any two votes match as collectives; every
//! slot is combined by MAX, so one all-reduce decides and every rank decodes the same.

/// Where in a step a rank was when it failed: the number a vote carries is the place here.
pub const PHASES: [&str; 6] = ["forward", "backward", "sync", "optimizer", "eval", "bookkeeping"];

/// The vector's length: every vote, a checkpoint's too, has exactly this many slots.
pub const SLOTS: usize = 13;

const ERROR: usize = 0; // some rank failed with an error that is not an OOM (1.0)
const ERROR_RANK: usize = 1; // -(lowest such rank)
const FAILED: usize = 2; // some rank ran out of memory (1.0)
const OOM_RANK: usize = 3; // -(lowest such rank)
const SEVERE: usize = 4; // cleanup left memory above the step's start somewhere
const SIGNATURE: usize = 5; // where and how (the policy's "same failure twice")
const PHASE: usize = 6; // 1 + index in PHASES
const INDEX: usize = 7; // micro-batch index
const PEAK: usize = 8; // bytes
const BASELINE: usize = 9; // bytes
const NEG_LIMIT: usize = 10; // -(device limit), so MAX keeps the smallest
const RETRIES: usize = 11; // allocator retries so far, -1 unknown
const MISSING: usize = 12; // some rank lacks a gradient another may have (1.0)

/// An OOM as one rank saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OomVote {
    pub severe: bool,
    pub signature: u32,
    /// Index in `PHASES`.
    pub phase: usize,
    pub index: usize,
}

/// One rank's vote.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Vote {
    pub rank: usize,
    pub oom: Option<OomVote>,
    /// Another error (not an OOM) stopped this rank: every rank stops.
    pub error: bool,
    pub peak_bytes: u64,
    pub baseline_bytes: u64,
    pub limit_bytes: Option<u64>,
    pub alloc_retries: Option<u64>,
    /// Some parameter has no gradient on this rank (unused in its forward): the ranks then
    /// tell each other which, before averaging.
    pub missing_grads: bool,
}

/// What the ranks decided together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agreed {
    /// The lowest rank that failed with another error, if any: every rank stops.
    pub error_rank: Option<usize>,
    /// The lowest rank that ran out of memory, and the OOM (its parts are each the maximum
    /// over the failing ranks': the same on every rank, which is what the policy needs).
    pub oom_rank: Option<usize>,
    pub oom: Option<OomVote>,
    pub peak_bytes: u64,
    pub baseline_bytes: u64,
    pub limit_bytes: Option<u64>,
    pub alloc_retries: Option<u64>,
    pub missing_grads: bool,
}

/// The vote as the vector all-reduced with MAX.
pub fn encode(v: &Vote) -> [f64; SLOTS] {
    let none = f64::NEG_INFINITY;
    let mut a = [0.0; SLOTS];
    a[ERROR_RANK] = none;
    a[OOM_RANK] = none;
    if v.error {
        a[ERROR] = 1.0;
        a[ERROR_RANK] = -(v.rank as f64);
    }
    if let Some(o) = v.oom {
        a[FAILED] = 1.0;
        a[OOM_RANK] = -(v.rank as f64);
        a[SEVERE] = f64::from(u8::from(o.severe));
        a[SIGNATURE] = f64::from(o.signature);
        a[PHASE] = (o.phase.min(PHASES.len() - 1) + 1) as f64;
        a[INDEX] = o.index as f64;
    }
    a[PEAK] = v.peak_bytes as f64;
    a[BASELINE] = v.baseline_bytes as f64;
    a[NEG_LIMIT] = v.limit_bytes.map_or(none, |l| -(l as f64));
    a[RETRIES] = v.alloc_retries.map_or(-1.0, |r| r as f64);
    a[MISSING] = f64::from(u8::from(v.missing_grads));
    a
}

/// Every rank's vote, maximised element-wise, read back. A vector of another length (a
/// rank of another version) is refused.
pub fn decode(a: &[f64]) -> Result<Agreed, String> {
    if a.len() != SLOTS {
        return Err(format!("an agreement vector has {} slots, not {SLOTS}", a.len()));
    }
    let rank = |x: f64| (x.is_finite() && x <= 0.0).then_some((-x) as usize);
    let failed = a[FAILED] > 0.0;
    Ok(Agreed {
        error_rank: if a[ERROR] > 0.0 { rank(a[ERROR_RANK]) } else { None },
        oom_rank: if failed { rank(a[OOM_RANK]) } else { None },
        oom: failed.then(|| OomVote {
            severe: a[SEVERE] > 0.0,
            signature: a[SIGNATURE] as u32,
            phase: (a[PHASE] as usize).clamp(1, PHASES.len()) - 1,
            index: a[INDEX].max(0.0) as usize,
        }),
        peak_bytes: a[PEAK].max(0.0) as u64,
        baseline_bytes: a[BASELINE].max(0.0) as u64,
        limit_bytes: a[NEG_LIMIT].is_finite().then(|| (-a[NEG_LIMIT]).max(0.0) as u64),
        alloc_retries: (a[RETRIES] >= 0.0).then_some(a[RETRIES] as u64),
        missing_grads: a[MISSING] > 0.0,
    })
}

/// The element-wise maximum of votes: what an all-reduce with MAX computes (for tests and
/// for in-process ranks).
pub fn combine(votes: &[[f64; SLOTS]]) -> [f64; SLOTS] {
    let mut out = [f64::NEG_INFINITY; SLOTS];
    for v in votes {
        for (o, x) in out.iter_mut().zip(v) {
            *o = o.max(*x);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom(rank: usize, phase: usize, signature: u32) -> Vote {
        Vote {
            rank,
            oom: Some(OomVote {
                severe: false,
                signature,
                phase,
                index: 1,
            }),
            ..Vote::default()
        }
    }

    #[test]
    fn a_clean_vote_decodes_to_nothing_failed_and_keeps_the_figures() {
        let v = Vote {
            rank: 3,
            peak_bytes: 1 << 30,
            baseline_bytes: 1 << 20,
            limit_bytes: Some(80 << 30),
            alloc_retries: Some(2),
            ..Vote::default()
        };
        let a = decode(&encode(&v)).unwrap();
        assert_eq!((a.error_rank, a.oom_rank, a.oom), (None, None, None));
        assert_eq!((a.peak_bytes, a.baseline_bytes), (1 << 30, 1 << 20));
        assert_eq!((a.limit_bytes, a.alloc_retries), (Some(80 << 30), Some(2)));
    }

    #[test]
    fn the_lowest_failing_rank_is_named_and_every_rank_reads_the_same() {
        let votes = [encode(&Vote::default()), encode(&oom(2, 1, 7)), encode(&oom(1, 0, 9))];
        let a = decode(&combine(&votes)).unwrap();
        assert_eq!(a.oom_rank, Some(1));
        let o = a.oom.unwrap();
        // Each part is the maximum over the failing ranks: the same wherever decoded.
        assert_eq!((o.phase, o.signature), (1, 9));
        assert_eq!(a.error_rank, None);
    }

    #[test]
    fn an_error_on_one_rank_stops_every_rank_and_wins_over_an_oom() {
        let err = Vote {
            rank: 4,
            error: true,
            ..Vote::default()
        };
        let a = decode(&combine(&[encode(&oom(0, 2, 1)), encode(&err)])).unwrap();
        assert_eq!(a.error_rank, Some(4));
        assert_eq!(a.oom_rank, Some(0));
    }

    #[test]
    fn the_smallest_limit_and_unknown_figures_survive_the_maximum() {
        let a = Vote {
            limit_bytes: Some(40),
            ..Vote::default()
        };
        let b = Vote {
            limit_bytes: Some(30),
            ..Vote::default()
        };
        let c = Vote::default();
        let d = decode(&combine(&[encode(&a), encode(&b), encode(&c)])).unwrap();
        assert_eq!((d.limit_bytes, d.alloc_retries), (Some(30), None));
    }

    #[test]
    fn a_vector_of_another_length_is_refused() {
        assert!(decode(&[0.0; 10]).unwrap_err().contains("10 slots"));
    }

    #[test]
    fn one_rank_missing_a_gradient_is_known_to_all() {
        let m = Vote {
            missing_grads: true,
            ..Vote::default()
        };
        let d = decode(&combine(&[encode(&Vote::default()), encode(&m)])).unwrap();
        assert!(d.missing_grads);
        assert!(!decode(&encode(&Vote::default())).unwrap().missing_grads);
    }
}
