//! Owns the run's log file: tracing writes to it once the run directory is known.
//! Keeps: writes before a file is set are dropped, never an error; the file is only appended to.
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

/// The run's log file, set once the run directory is known; tracing writes to it.
static LOG_FILE: Mutex<Option<File>> = Mutex::new(None);

pub fn set_log_file(path: &Path) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new().create(true).append(true).open(path);
    let f = f.map_err(|e| std::io::Error::new(e.kind(), format!("cannot open log file {}: {e}", path.display())))?;
    if let Ok(mut slot) = LOG_FILE.lock() {
        *slot = Some(f);
    }
    Ok(())
}

/// A `tracing_subscriber` writer into the run's log file (a sink until one is set).
pub struct LogFileWriter;

impl Write for LogFileWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match LOG_FILE.lock().ok().as_mut().and_then(|s| s.as_mut()) {
            Some(f) => f.write(buf),
            None => Ok(buf.len()),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match LOG_FILE.lock().ok().as_mut().and_then(|s| s.as_mut()) {
            Some(f) => f.flush(),
            None => Ok(()),
        }
    }
}
