//! Owns a worker's part in an elastic job (`oomguard launch --nnodes MIN:MAX`): what the
//! launcher tells it (OOMGUARD_ELASTIC, OOMGUARD_MEMBERSHIP) and the record of a change.
//! Keeps: the decisions are pure (`steps_recomputed`, `source`); the environment is read in
//! one place.
use std::path::Path;

use oomguard_launch::{ELASTIC_VAR, MEMBERSHIP_VAR};
use serde::Deserialize;

/// Whether this worker runs in an elastic job: then a peer's death is a membership change
/// the launcher recovers from, and the worker saves what it holds before it exits.
pub fn enabled() -> bool {
    std::env::var(ELASTIC_VAR).is_ok_and(|v| !v.trim().is_empty())
}

/// Whether this is a later round of an elastic job (the launcher restarted the workers):
/// the run continues from its newest checkpoint, as `--resume` does.
pub fn restarted() -> bool {
    enabled()
        && std::env::var("TORCHELASTIC_RESTART_COUNT")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0)
}

/// The membership change that began this round, as the launcher describes it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Change {
    pub old_world: usize,
    pub new_world: usize,
    pub cause: String,
    pub detected_unix_ms: u64,
}

/// OOMGUARD_MEMBERSHIP, when this round followed a change (one the worker cannot read is
/// logged and left out of the records: it changes nothing in training).
pub fn change() -> Option<Change> {
    let raw = std::env::var(MEMBERSHIP_VAR).ok()?;
    serde_json::from_str(&raw)
        .inspect_err(|e| {
            tracing::warn!("{MEMBERSHIP_VAR} is not the launcher's description of a change ({e}): not recorded")
        })
        .ok()
}

/// Seconds since `unix_ms` (0 for a time in the future: another host's clock).
pub fn seconds_since(unix_ms: u64) -> f64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    now.saturating_sub(unix_ms) as f64 / 1000.0
}

/// Steps the run had done (`last_recorded`, the last step record's) that it does again from
/// `next_step`.
pub fn steps_recomputed(last_recorded: Option<u64>, next_step: u64) -> u64 {
    last_recorded.map_or(0, |m| (m + 1).saturating_sub(next_step))
}

/// Where a round's state came from: a survivor's save (its checkpoint's `saved_by`), or the
/// newest regular checkpoint.
pub fn source(saved_by_survivor: bool) -> &'static str {
    if saved_by_survivor {
        "survivors"
    } else {
        "checkpoint"
    }
}

/// The last step record's step in `run_dir/metrics.jsonl`, before a resume rewrites it.
pub fn last_step_recorded(run_dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).ok()?;
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .filter_map(|v| v["step"].as_u64())
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recomputed_steps_and_the_source() {
        assert_eq!(steps_recomputed(None, 5), 0);
        assert_eq!(
            steps_recomputed(Some(9), 10),
            0,
            "the survivors saved the last step done"
        );
        assert_eq!(steps_recomputed(Some(9), 8), 2, "from an older checkpoint");
        assert_eq!(
            steps_recomputed(Some(9), 11),
            0,
            "a survivor finished the step rank 0 died in"
        );
        assert_eq!((source(true), source(false)), ("survivors", "checkpoint"));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("metrics.jsonl"),
            "{\"event\":\"step\",\"step\":3}\n{\"event\":\"oom\",\"step\":7}\n{\"event\":\"step\",\"step\":4}\ntorn",
        )
        .unwrap();
        assert_eq!(last_step_recorded(dir.path()), Some(4));
    }
}
