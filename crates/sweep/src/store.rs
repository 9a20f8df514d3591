//! Owns results.jsonl: one record per trial.
//! Keeps: every change is a whole-file rewrite under an exclusive lock, so the file is never torn
//! and concurrent shards never lose each other's records nor hold a trial twice.
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::record::Record;

pub struct Store {
    path: PathBuf,
    lock: PathBuf,
}

impl Store {
    pub fn new(dir: &Path) -> Store {
        Store {
            path: dir.join("results.jsonl"),
            lock: dir.join("results.lock"),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The records, by trial id; lines that do not parse are left out with a warning (the
    /// next rewrite moves them to results.corrupt.jsonl). Takes no lock, creates nothing.
    pub fn read(&self) -> std::io::Result<BTreeMap<String, Record>> {
        let (records, corrupt) = self.read_all()?;
        for (n, line, e) in &corrupt {
            tracing::warn!(
                "{}:{n}: not a trial record ({e}): `{}`; it is kept in {}",
                self.path.display(),
                shorten(line),
                self.corrupt_path().display()
            );
        }
        Ok(records)
    }

    /// The records and the lines that do not parse.
    fn read_all(&self) -> std::io::Result<(BTreeMap<String, Record>, Vec<Corrupt>)> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        let (mut out, mut corrupt) = (BTreeMap::new(), vec![]);
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            match serde_json::from_str::<Record>(line) {
                Ok(r) => {
                    out.insert(r.trial.clone(), r);
                }
                Err(e) => corrupt.push((n + 1, line.to_string(), e.to_string())),
            }
        }
        Ok((out, corrupt))
    }

    /// Where lines of results.jsonl that do not parse are moved, never dropped.
    pub fn corrupt_path(&self) -> PathBuf {
        self.path.with_file_name("results.corrupt.jsonl")
    }

    /// Writes `record`, replacing any earlier record of the same trial.
    pub fn put(&self, record: &Record) -> anyhow::Result<()> {
        self.update(|all| {
            all.insert(record.trial.clone(), record.clone());
        })
    }

    /// Changes the records under the lock and rewrites the file whole; lines that do not
    /// parse are appended to results.corrupt.jsonl first.
    pub fn update(&self, change: impl FnOnce(&mut BTreeMap<String, Record>)) -> anyhow::Result<()> {
        let _lock = exclusive(&self.lock, false)?
            .ok_or_else(|| anyhow::anyhow!("{}: a blocking lock came back unheld", self.lock.display()))?;
        let (mut all, corrupt) = self.read_all()?;
        if !corrupt.is_empty() {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.corrupt_path())?;
            for (n, line, e) in &corrupt {
                tracing::warn!(
                    "{}:{n}: not a trial record ({e}): moved to {}",
                    self.path.display(),
                    self.corrupt_path().display()
                );
                writeln!(f, "{line}")?;
            }
            f.sync_all()?;
        }
        change(&mut all);
        let mut sorted: Vec<&Record> = all.values().collect();
        sorted.sort_by(|a, b| (a.index, &a.trial).cmp(&(b.index, &b.trial)));
        let mut text = String::new();
        for r in sorted {
            text.push_str(&serde_json::to_string(r)?);
            text.push('\n');
        }
        Ok(oomguard_report::atomic::write(&self.path, text.as_bytes())?)
    }
}

fn shorten(line: &str) -> String {
    if line.chars().count() > 80 {
        format!("{}...", line.chars().take(80).collect::<String>())
    } else {
        line.to_string()
    }
}

/// A line of results.jsonl that does not parse: its line number, its text, why.
type Corrupt = (usize, String, String);

/// An exclusive flock on `path` (created if missing): None when `nonblocking` and another
/// process holds it. A filesystem without flock (Lustre mounted without `-o flock`, some
/// NFS set-ups) is an error naming the fix, exit 2: the sweep never runs without the lock
/// that keeps each trial once.
fn exclusive(path: &Path, nonblocking: bool) -> anyhow::Result<Option<File>> {
    let f = File::options().create(true).truncate(false).write(true).open(path)?;
    // std's file locks are flock(2) on Linux (what /proc/locks shows, `held_in` below); an
    // error keeps its errno, so a filesystem without flock is still told apart.
    if !nonblocking {
        f.lock().map_err(|e| lock_error(path, e))?;
        return Ok(Some(f));
    }
    match f.try_lock() {
        Ok(()) => Ok(Some(f)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(lock_error(path, e)),
    }
}

/// Why a flock failed, with the fix where the filesystem lacks flock.
pub fn lock_error(path: &Path, e: std::io::Error) -> anyhow::Error {
    match e.raw_os_error() {
        Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL) => oomguard_console::ConfigError {
            origin: path.display().to_string(), line_col: None, key: String::new(),
            message: format!(
                "cannot take a lock here ({e}): this filesystem does not support flock, which the sweep needs so that no trial runs twice; \
                 mount it with flock (Lustre: -o flock; NFS: not -o nolock), or give --out a directory on a filesystem that has it"
            ),
        }
        .into(),
        _ => anyhow::Error::new(e).context(format!("locking {}", path.display())),
    }
}

/// A trial's own lock (trials/ID/.lock), held while a sweep runs it: a second sweep on the
/// same directory skips the trial instead of running it twice. The kernel drops it when the
/// holder dies, kill -9 included.
pub struct TrialLock(#[allow(dead_code)] File);

impl TrialLock {
    /// None: another process holds it.
    pub fn try_take(dir: &Path) -> anyhow::Result<Option<TrialLock>> {
        std::fs::create_dir_all(dir)?;
        Ok(exclusive(&dir.join(".lock"), true)?.map(TrialLock))
    }

    /// Whether a process of this host holds the trial's lock, read from /proc/locks: no
    /// lock taken, nothing created (`--status`). Another host's lock is not visible here.
    pub fn held(dir: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        let Ok(meta) = std::fs::metadata(dir.join(".lock")) else {
            return false;
        };
        let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
        held_in(&locks, meta.ino())
    }
}

/// Whether /proc/locks's text shows a flock on inode `ino` (`1: FLOCK ADVISORY WRITE PID MAJ:MIN:INO 0 EOF`).
fn held_in(locks: &str, ino: u64) -> bool {
    locks.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.get(1) == Some(&"FLOCK")
            && f.get(5)
                .and_then(|d| d.rsplit(':').next())
                .and_then(|i| i.parse::<u64>().ok())
                == Some(ino)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Status, Summary};

    fn record(trial: &str, index: usize, status: Status) -> Record {
        Record {
            summary: Summary {
                final_eval_loss: Some(1.0),
                best_eval_loss: Some(0.9),
                final_loss: None,
                tokens_per_s: Some(10.0),
                final_micro_batch_size: Some(4),
                ooms: 0,
                steps: 3,
            },
            duration_s: 1.0,
            run_dir: format!("trials/{trial}"),
            ..Record::of(trial, index, status)
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
        // A line that does not parse is left out of the records, then moved aside by the next
        // rewrite, never dropped.
        std::fs::write(s.path(), format!("{text}{{\"trial\":\n")).unwrap();
        assert_eq!(s.read().unwrap().len(), 2);
        assert!(!s.corrupt_path().exists(), "a read changes nothing");
        s.put(&record("002-c", 2, Status::Ok)).unwrap();
        assert_eq!(std::fs::read_to_string(s.corrupt_path()).unwrap(), "{\"trial\":\n");
        assert_eq!(std::fs::read_to_string(s.path()).unwrap().lines().count(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_filesystem_without_flock_is_exit_2_with_the_fix() {
        for errno in [libc::ENOLCK, libc::EOPNOTSUPP] {
            let e = lock_error(
                Path::new("/lustre/out/results.lock"),
                std::io::Error::from_raw_os_error(errno),
            );
            let c = e
                .downcast_ref::<oomguard_console::ConfigError>()
                .expect("a config error: exit 2");
            assert!(
                c.message.contains("-o flock") && c.origin.contains("/lustre/out"),
                "{c}"
            );
        }
        assert!(lock_error(Path::new("x"), std::io::Error::from_raw_os_error(libc::EIO))
            .downcast_ref::<oomguard_console::ConfigError>()
            .is_none());
    }

    #[test]
    fn a_held_trial_lock_shows_in_proc_locks_without_taking_one() {
        let dir = std::env::temp_dir().join(format!("oomguard-trial-lock-{}", std::process::id()));
        assert!(!TrialLock::held(&dir) && !dir.exists(), "nothing created");
        let lock = TrialLock::try_take(&dir).unwrap().unwrap();
        assert!(TrialLock::held(&dir));
        assert!(
            TrialLock::try_take(&dir).unwrap().is_none(),
            "flock is per open file: a second take fails"
        );
        drop(lock);
        assert!(!TrialLock::held(&dir));
        assert!(held_in(
            "1: FLOCK  ADVISORY  WRITE 23286 fe:00:10010629 0 EOF\n2: POSIX  ADVISORY  WRITE 1 fe:00:7 0 EOF",
            10010629
        ));
        assert!(!held_in("2: POSIX  ADVISORY  WRITE 1 fe:00:7 0 EOF", 7));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
