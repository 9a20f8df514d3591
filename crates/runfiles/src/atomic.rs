//! Owns writing files whole or not at all: every file oomguard rewrites goes through here.
//! Keeps: a kill, an OOM or a full disk at any instant leaves the old file or the new one,
//! never a torn one (temporary file, fsync, rename, fsync of the folder).
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Replaces `path` with `bytes`.
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp = temp_file(path)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    sync_dir(&folder(path))
}

/// Replaces `path` with what `fill` writes to the temporary path it is given (for writers
/// that take a path, such as a safetensors writer). On any error the temporary file is
/// removed (when the `NamedTempFile` drops) and `path` is untouched.
pub fn replace_with(path: &Path, fill: impl FnOnce(&Path) -> io::Result<()>) -> io::Result<()> {
    let tmp = temp_file(path)?;
    fill(tmp.path())?;
    // The writer may have replaced the file at that path: flush what is there now.
    sync(tmp.path())?;
    tmp.persist(path).map_err(|e| e.error)?;
    sync_dir(&folder(path))
}

/// Flushes a file's contents to the disk.
pub fn sync(path: &Path) -> io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}

/// Flushes a folder's entries (a rename into it) to the disk.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Removes the temporary files a killed writer left in `dir` (only for a folder no other
/// process is writing into, such as a run directory at its start).
pub fn remove_leftovers(dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.ends_with(".tmp") && e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// A new `.NAME.XXXXXX.tmp` beside `path` (hidden, unique, removed when dropped unpersisted),
/// created as `std::fs::write` would create it (0o666 less the umask), so that the file that
/// replaces `path` has the permissions a plain write would have given it.
fn temp_file(path: &Path) -> io::Result<tempfile::NamedTempFile> {
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .permissions(std::fs::Permissions::from_mode(0o666))
        .tempfile_in(folder(path))
}

/// The folder `path` is in (`.` for a bare file name).
fn folder(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        let names = || -> Vec<String> {
            std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        };
        write(&p, b"old").unwrap();
        write(&p, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        // A writer that fails half-way: the old file stays, the temporary file goes.
        let e = replace_with(&p, |tmp| {
            std::fs::write(tmp, b"ha")?;
            Err(io::Error::other("disk full"))
        });
        assert_eq!(e.unwrap_err().to_string(), "disk full");
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(names(), ["a.json"]);
        // The new file has the permissions a plain write gives (not the temporary file's 0o600).
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode();
        assert_eq!(mode(&p), mode(&plain));
        std::fs::remove_file(&plain).unwrap();
        // What a killed writer leaves behind goes; the file stays.
        std::fs::write(dir.path().join(".a.json.Xy12z9.tmp"), b"torn").unwrap();
        remove_leftovers(dir.path());
        assert_eq!(names(), ["a.json"]);
    }

    #[test]
    fn a_bare_file_name_is_in_the_current_folder() {
        assert_eq!(folder(Path::new("out.png")), PathBuf::from("."));
        assert_eq!(folder(Path::new("/r/model.safetensors")), PathBuf::from("/r"));
    }
}
