//! Owns how an attempt ended, what comes next, and the failure report.
//! Keeps: one set of pure decisions, shared by the supervisor and the group's rounds.
use serde::{Deserialize, Serialize};

/// What to do after the group failed: a pure decision.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    Restart { micro_batch_size: Option<usize> },
    GiveUp,
}

/// How an attempt ended, from the error that ended it (not from errors it recovered from).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Out of memory.
    Oom,
    /// Exit 3: does not fit even at micro-batch 1. Restarting cannot help.
    CannotFit,
    Other,
}

/// Restart while restarts remain (never after exit 3); after an out-of-memory death, with
/// half the micro-batch; otherwise at the same one.
pub fn after_failure(restarts_done: u32, max_restarts: u32, ended: Ended, micro: Option<usize>) -> Next {
    if restarts_done >= max_restarts || ended == Ended::CannotFit {
        return Next::GiveUp;
    }
    let oom = ended == Ended::Oom;
    let micro_batch_size = match (oom, micro) {
        (true, Some(m)) => Some((m / 2).max(1)),
        (_, m) => m,
    };
    Next::Restart { micro_batch_size }
}

/// What a node's failed attempt tells the coordinator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub rank: usize,
    pub oom: bool,
    /// The micro-batch the attempt ran with, when known.
    pub micro: Option<usize>,
    /// The worker's exit code (as the launcher would exit with it).
    pub code: i32,
    /// It ended with `oomguard.Infeasible` (exit 3 of oomguard's: even micro-batch 1 does
    /// not fit), not with a code 3 of a script's own.
    #[serde(default)]
    pub infeasible: bool,
}

impl Report {
    pub(crate) fn ended(&self) -> Ended {
        if self.infeasible {
            Ended::CannotFit
        } else if self.oom {
            Ended::Oom
        } else {
            Ended::Other
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restart_policy() {
        use Ended::*;
        assert_eq!(after_failure(0, 0, Other, None), Next::GiveUp);
        assert_eq!(
            after_failure(0, 2, Other, Some(8)),
            Next::Restart {
                micro_batch_size: Some(8)
            }
        );
        assert_eq!(
            after_failure(1, 2, Oom, Some(8)),
            Next::Restart {
                micro_batch_size: Some(4)
            }
        );
        assert_eq!(
            after_failure(1, 2, Oom, Some(1)),
            Next::Restart {
                micro_batch_size: Some(1)
            }
        );
        assert_eq!(after_failure(1, 2, Oom, None), Next::Restart { micro_batch_size: None });
        assert_eq!(after_failure(2, 2, Oom, Some(8)), Next::GiveUp);
        assert_eq!(
            after_failure(0, 5, CannotFit, Some(1)),
            Next::GiveUp,
            "exit 3: no restart can help"
        );
    }
}
