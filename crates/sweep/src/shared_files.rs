//! Owns the warning about files that script trials write in the sweep's working directory,
//! which every trial shares (a script's relative `ckpt.pt` makes one trial "resume" another).
//! Keeps: a file is named when a second trial writes it, once; the decision is pure
//! (`second_writer`), the directory scan beside it.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

/// Which trial wrote each file first, and the files already warned about.
#[derive(Debug, Default)]
pub struct Writers {
    first: BTreeMap<PathBuf, String>,
    told: BTreeMap<PathBuf, ()>,
}

/// Trial `id` wrote `file`: the trial that wrote it before, when another one did and this file
/// was not named yet.
pub fn second_writer(w: &mut Writers, file: &Path, id: &str) -> Option<String> {
    let first = w
        .first
        .entry(file.to_path_buf())
        .or_insert_with(|| id.to_string())
        .clone();
    if first == id || w.told.contains_key(file) {
        return None;
    }
    w.told.insert(file.to_path_buf(), ());
    Some(first)
}

/// The sweep's working directory and what its trials wrote there.
pub struct SharedFiles {
    cwd: PathBuf,
    /// The sweep's own output (trials/, results.jsonl): not the trials' doing.
    out: PathBuf,
    writers: Mutex<Writers>,
}

impl SharedFiles {
    pub fn new(cwd: PathBuf, out: PathBuf) -> SharedFiles {
        SharedFiles {
            cwd,
            out,
            writers: Mutex::new(Writers::default()),
        }
    }

    /// After trial `id`, which started at `since`: a warning for each file in the working
    /// directory (top level) that it wrote, as an earlier trial did.
    pub fn after(&self, id: &str, since: SystemTime) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.cwd) else {
            return vec![];
        };
        let out = self.out.canonicalize().unwrap_or_else(|_| self.out.clone());
        let written: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.metadata().and_then(|m| m.modified()).is_ok_and(|t| t >= since))
            .map(|e| e.path())
            .filter(|p| p.canonicalize().map_or(true, |c| !out.starts_with(&c) && c != out))
            .collect();
        let mut w = self.writers.lock().unwrap_or_else(|e| e.into_inner());
        written
            .into_iter()
            .filter_map(|p| {
                let before = second_writer(&mut w, &p, id)?;
                Some(format!(
                    "[{id}] wrote {}, as trial {before} did: trials share the sweep's working directory {}, so one \
                     can read another's file (a script that resumes from it would resume another trial's run); write \
                     under $OOMGUARD_RUN_DIR, each trial's own directory",
                    p.display(),
                    self.cwd.display()
                ))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_named_when_a_second_trial_writes_it_once() {
        let mut w = Writers::default();
        let f = Path::new("ckpt.pt");
        assert_eq!(second_writer(&mut w, f, "000-a"), None);
        assert_eq!(second_writer(&mut w, f, "000-a"), None, "the same trial again");
        assert_eq!(second_writer(&mut w, f, "001-b"), Some("000-a".into()));
        assert_eq!(second_writer(&mut w, f, "002-c"), None, "named once");
        assert_eq!(second_writer(&mut w, Path::new("other"), "002-c"), None);
    }
}
