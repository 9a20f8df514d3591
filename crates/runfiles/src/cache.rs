//! Owns the micro-batch cache: `micro_batch.json`, a JSON map from a key (a model, its
//! samples, the device and its memory) to the largest micro-batch known to fit there.
//! Keeps: runs, sweep trials and Python guards share the file; a lock makes each
//! read-modify-write whole and the file is always replaced whole, so no reader sees a torn
//! file and no writer loses another's key.
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The cache's file: OOMGUARD_CACHE, else XDG_CACHE_HOME/oomguard, else ~/.cache/oomguard;
/// None without any of them.
pub fn path() -> Option<PathBuf> {
    let base = std::env::var_os("OOMGUARD_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|c| PathBuf::from(c).join("oomguard")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/oomguard")))?;
    Some(base.join("micro_batch.json"))
}

fn read_all() -> BTreeMap<String, usize> {
    path()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// The largest micro-batch known to fit for `key`.
pub fn cached(key: &str) -> Option<usize> {
    read_all().get(key).copied().filter(|&s| s > 0)
}

/// Records that `size` fits for `key`, under the file's lock (micro_batch.lock beside it).
pub fn remember(key: &str, size: usize) -> std::io::Result<PathBuf> {
    let path = path().ok_or_else(|| std::io::Error::other("no cache folder (OOMGUARD_CACHE, XDG_CACHE_HOME, HOME)"))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path.with_extension("lock"))?;
    lock.lock()?;
    let mut all = read_all();
    all.insert(key.to_string(), size);
    let text = serde_json::to_string_pretty(&all).map_err(std::io::Error::other)?;
    crate::atomic::write(&path, text.as_bytes())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_kept_side_by_side_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        // The only test in this crate that sets the variable.
        std::env::set_var("OOMGUARD_CACHE", dir.path());
        remember("python:a", 8).unwrap();
        remember("gpt:b", 16).unwrap();
        remember("python:a", 4).unwrap();
        assert_eq!(
            (cached("python:a"), cached("gpt:b"), cached("c")),
            (Some(4), Some(16), None)
        );
        let text = std::fs::read_to_string(dir.path().join("micro_batch.json")).unwrap();
        let map: BTreeMap<String, usize> = serde_json::from_str(&text).unwrap();
        assert_eq!(map.len(), 2);
    }
}
