//! results.jsonl: one record per trial. Every change is a whole-file rewrite under an
//! exclusive lock (flock on results.lock), renamed into place: a kill at any moment leaves
//! the old file or the new, never a torn one, and concurrent sweeps (shards sharing the
//! directory) never lose each other's records nor hold a trial twice.
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::trial::Summary;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    /// Does not fit even at micro-batch 1 (exit 3), told by the planner or the run.
    Infeasible,
    /// Exited with another code; `message` says why.
    Failed,
    /// Ran past `trial.timeout` (stopped with a checkpoint).
    Timeout,
    /// The sweep (or someone) stopped it: the next start of the sweep resumes it.
    Interrupted,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Infeasible => "infeasible",
            Status::Failed => "failed",
            Status::Timeout => "timeout",
            Status::Interrupted => "interrupted",
        }
    }
    /// Finished for good: a restarted sweep skips it.
    pub fn is_final(self) -> bool {
        self != Status::Interrupted
    }
}

/// One line of results.jsonl (a contract: fields are added, never renamed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub trial: String,
    pub index: usize,
    pub params: BTreeMap<String, Value>,
    pub status: Status,
    /// Infeasible: "planner" (before the trial ran) or "run" (the run exited 3).
    pub told_by: Option<String>,
    pub exit_code: Option<i32>,
    /// What its metrics.jsonl says: eval losses, tokens/s, final micro-batch, OOMs, steps.
    #[serde(flatten)]
    pub summary: Summary,
    /// Wall-clock seconds, over every start of the trial.
    pub duration_s: f64,
    /// Relative to the sweep directory.
    pub run_dir: String,
    pub message: Option<String>,
    /// `I/N`: the shard that ran it.
    pub shard: String,
    pub finished_at: String,
}

pub struct Store {
    path: PathBuf,
    lock: PathBuf,
}

impl Store {
    pub fn new(dir: &Path) -> Store {
        Store { path: dir.join("results.jsonl"), lock: dir.join("results.lock") }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The records, by trial id; lines that do not parse are skipped with a warning.
    pub fn read(&self) -> std::io::Result<BTreeMap<String, Record>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        let mut out = BTreeMap::new();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            match serde_json::from_str::<Record>(line) {
                Ok(r) => {
                    out.insert(r.trial.clone(), r);
                }
                Err(e) => tracing::warn!("{}:{}: skipped a line that is not a trial record ({e})", self.path.display(), n + 1),
            }
        }
        Ok(out)
    }

    /// Writes `record`, replacing any earlier record of the same trial.
    pub fn put(&self, record: &Record) -> std::io::Result<()> {
        let lock = File::options().create(true).truncate(false).write(true).open(&self.lock)?;
        // SAFETY: flock on an open descriptor; released when `lock` closes (or the process dies).
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut all = self.read()?;
        all.insert(record.trial.clone(), record.clone());
        let mut sorted: Vec<&Record> = all.values().collect();
        sorted.sort_by(|a, b| (a.index, &a.trial).cmp(&(b.index, &b.trial)));
        let mut text = String::new();
        for r in sorted {
            text.push_str(&serde_json::to_string(r).map_err(std::io::Error::other)?);
            text.push('\n');
        }
        oomguard_report::atomic::write(&self.path, text.as_bytes())
    }
}

/// A trial's own lock (trials/ID/.lock), held while a sweep runs it: a second sweep on the
/// same directory skips the trial instead of running it twice. The kernel drops it when the
/// holder dies, kill -9 included.
pub struct TrialLock(#[allow(dead_code)] File);

impl TrialLock {
    /// None: another process holds it.
    pub fn try_take(dir: &Path) -> std::io::Result<Option<TrialLock>> {
        std::fs::create_dir_all(dir)?;
        let f = File::options().create(true).truncate(false).write(true).open(dir.join(".lock"))?;
        // SAFETY: flock on an open descriptor.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Some(TrialLock(f)));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::WouldBlock { Ok(None) } else { Err(e) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(trial: &str, index: usize, status: Status) -> Record {
        Record {
            trial: trial.into(), index, params: BTreeMap::new(), status, told_by: None, exit_code: Some(0),
            summary: Summary { final_eval_loss: Some(1.0), best_eval_loss: Some(0.9), tokens_per_s: Some(10.0), final_micro_batch_size: Some(4), ooms: 0, steps: 3 },
            duration_s: 1.0, run_dir: format!("trials/{trial}"), message: None, shard: "0/1".into(), finished_at: String::new(),
        }
    }

    #[test]
    fn put_replaces_a_trial_and_keeps_the_others() {
        let dir = std::env::temp_dir().join(format!("oomguard-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = Store::new(&dir);
        s.put(&record("001-a", 1, Status::Interrupted)).unwrap();
        s.put(&record("000-b", 0, Status::Ok)).unwrap();
        s.put(&record("001-a", 1, Status::Ok)).unwrap();
        let text = std::fs::read_to_string(s.path()).unwrap();
        assert_eq!(text.lines().count(), 2);
        assert!(text.lines().next().unwrap().contains("000-b"));
        // A torn last line (a reader's view of a foreign writer) is skipped, not fatal.
        std::fs::write(s.path(), format!("{text}{{\"trial\":")).unwrap();
        assert_eq!(s.read().unwrap().len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
