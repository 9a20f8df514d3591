//! Owns a worker's stdout and stderr: prefixed on the console, copied to its log file when
//! asked, and its last lines kept for the failure summary and OOM detection.
//! Keeps: each line is written whole with its prefix, so workers' lines never mix mid-line.
use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const TAIL_LINES: usize = 50;

/// Where one stream goes.
pub struct Sink {
    pub prefix: String,
    pub console: bool,
    pub is_stderr: bool,
    pub file: Option<PathBuf>,
}

/// The last lines of a stream, and whether the worker has closed it.
#[derive(Clone, Default)]
pub struct Tail(Arc<(Mutex<VecDeque<String>>, AtomicBool)>);

impl Tail {
    pub fn lines(&self) -> Vec<String> {
        self.0
             .0
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Waits until the stream is closed, at most `limit` (a process the worker started may
    /// hold it open): a worker that just exited may still have lines in the pipe, its last
    /// error among them.
    pub fn settled(&self, limit: Duration) -> &Tail {
        let t = Instant::now();
        while !self.0 .1.load(Ordering::Acquire) && t.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(5));
        }
        self
    }
}

/// Copies `stream` to its sink on a thread until the worker closes it.
pub fn pump(stream: impl Read + Send + 'static, sink: Sink, tail: Tail) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut file = sink.file.as_ref().and_then(|p| {
            p.parent().map(std::fs::create_dir_all);
            File::create(p)
                .map_err(|e| eprintln!("oomguard launch: cannot create {}: {e}", p.display()))
                .ok()
        });
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if sink.console {
                let out = format!("{}{line}\n", sink.prefix);
                // A closed console (e.g. a pipe reader gone) must not stop the worker's output.
                let _ = if sink.is_stderr {
                    std::io::stderr().write_all(out.as_bytes())
                } else {
                    std::io::stdout().write_all(out.as_bytes())
                };
            }
            if let Some(f) = file.as_mut() {
                let _ = writeln!(f, "{line}");
            }
            if let Ok(mut t) = tail.0 .0.lock() {
                if t.len() == TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(line);
            }
        }
        if let Some(f) = file.as_mut() {
            let _ = f.flush();
        }
        tail.0 .1.store(true, Ordering::Release);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    /// A worker's last line can reach the pipe after its exit is seen: the failure summary
    /// (and the Infeasible line that makes exit 3) waits for the stream to close.
    #[test]
    fn a_settled_tail_has_the_streams_last_line() {
        let mut child = Command::new("sh")
            .args(["-c", "echo first; sleep 0.3; echo last"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let tail = Tail::default();
        let sink = Sink {
            prefix: String::new(),
            console: false,
            is_stderr: false,
            file: None,
        };
        let pumping = pump(child.stdout.take().unwrap(), sink, tail.clone());
        assert!(!tail.lines().contains(&"last".to_string()));
        assert_eq!(tail.settled(Duration::from_secs(10)).lines(), ["first", "last"]);
        child.wait().unwrap();
        pumping.join().unwrap();
    }
}
