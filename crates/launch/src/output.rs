//! Owns a worker's stdout and stderr: prefixed on the console, copied to its log file when
//! asked, and its last lines kept for the failure summary and OOM detection.
//! Keeps: each line is written whole with its prefix, so workers' lines never mix mid-line.
use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
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

/// A line's end as the worker wrote it: `\n`, or `\r` alone (a progress bar redrawn).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum End {
    Newline,
    Return,
}

/// The most bytes held for one line: a longer one is passed on in parts.
const MAX_LINE: usize = 1 << 20;

/// Splits a byte stream into lines at `\n` and at a lone `\r` (`\r\n` is one end), any bytes
/// at all: text that is not UTF-8 is shown with U+FFFD, never stops the stream.
#[derive(Default)]
struct Lines {
    line: Vec<u8>,
    /// A `\r` seen last: its line ends with it, unless a `\n` follows.
    cr: bool,
}

impl Lines {
    fn push(&mut self, bytes: &[u8], emit: &mut dyn FnMut(String, End)) {
        for &b in bytes {
            if std::mem::take(&mut self.cr) && b != b'\n' {
                self.end(End::Return, emit);
            }
            match b {
                b'\n' => self.end(End::Newline, emit),
                b'\r' => self.cr = true,
                _ => {
                    self.line.push(b);
                    if self.line.len() >= MAX_LINE {
                        self.end(End::Newline, emit);
                    }
                }
            }
        }
    }

    fn end(&mut self, end: End, emit: &mut dyn FnMut(String, End)) {
        let line = std::mem::take(&mut self.line);
        // `\r` before a progress bar's first draw ends nothing worth a line.
        if end == End::Newline || !line.is_empty() {
            emit(String::from_utf8_lossy(&line).into_owned(), end);
        }
    }

    /// The stream closed: what is left, as a line.
    fn finish(&mut self, emit: &mut dyn FnMut(String, End)) {
        let end = if std::mem::take(&mut self.cr) {
            End::Return
        } else {
            End::Newline
        };
        if !self.line.is_empty() || end == End::Return {
            self.end(end, emit);
        }
    }
}

/// Copies `stream` to its sink on a thread until the worker closes it: each line (ended by
/// `\n`, or by `\r` as a progress bar redraws) as it comes, with its prefix; lines ended by
/// `\n` into the tail.
pub fn pump(mut stream: impl Read + Send + 'static, sink: Sink, tail: Tail) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut file = sink.file.as_ref().and_then(|p| {
            p.parent().map(std::fs::create_dir_all);
            File::create(p)
                .map_err(|e| eprintln!("oomguard launch: cannot create {}: {e}", p.display()))
                .ok()
        });
        let mut emit = |line: String, end: End| {
            let mark = if end == End::Newline { '\n' } else { '\r' };
            if sink.console {
                let out = format!("{}{line}{mark}", sink.prefix);
                // A closed console (e.g. a pipe reader gone) must not stop the worker's output.
                let _ = if sink.is_stderr {
                    std::io::stderr().write_all(out.as_bytes())
                } else {
                    std::io::stdout().write_all(out.as_bytes())
                };
            }
            if let Some(f) = file.as_mut() {
                let _ = write!(f, "{line}{mark}");
            }
            if end == End::Newline {
                if let Ok(mut t) = tail.0 .0.lock() {
                    if t.len() == TAIL_LINES {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            }
        };
        let mut lines = Lines::default();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => lines.push(&buf[..n], &mut emit),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        lines.finish(&mut emit);
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

    fn split(chunks: &[&[u8]]) -> Vec<(String, End)> {
        let mut out = Vec::new();
        let mut lines = Lines::default();
        for c in chunks {
            lines.push(c, &mut |l, e| out.push((l, e)));
        }
        lines.finish(&mut |l, e| out.push((l, e)));
        out
    }

    #[test]
    fn lines_end_at_newlines_and_lone_returns_and_take_any_bytes() {
        use End::*;
        // tqdm's redraws, a CRLF line split across reads, bytes that are not UTF-8, no last end.
        let got = split(&[b"\r 10%\r 20%", b"\r100%\nwin\r", b"\ncaf\xe9\n", b"last"]);
        let want = [
            (" 10%", Return),
            (" 20%", Return),
            ("100%", Newline),
            ("win", Newline),
            ("caf\u{fffd}", Newline),
            ("last", Newline),
        ];
        assert_eq!(got, want.map(|(l, e)| (l.to_string(), e)));
        assert_eq!(
            split(&[b"a\n\nb\r"]),
            [("a".into(), Newline), ("".into(), Newline), ("b".into(), Return)]
        );
    }

    /// `sh -c script`, its stdout pumped into a tail (not shown).
    fn pumped(script: &str) -> (std::process::Child, Tail, JoinHandle<()>) {
        let mut child = Command::new("sh")
            .args(["-c", script])
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
        (child, tail, pumping)
    }

    /// Bytes that are not UTF-8 neither stop the pump nor the worker writing after them.
    #[test]
    fn a_line_that_is_not_utf8_does_not_stop_the_stream() {
        let (mut child, tail, pumping) = pumped("printf 'caf\\351\\n'; echo after");
        assert!(child.wait().unwrap().success());
        pumping.join().unwrap();
        assert_eq!(tail.lines(), ["caf\u{fffd}", "after"]);
    }

    /// A worker's last line can reach the pipe after its exit is seen: the failure summary
    /// (and the Infeasible line that makes exit 3) waits for the stream to close.
    #[test]
    fn a_settled_tail_has_the_streams_last_line() {
        let (mut child, tail, pumping) = pumped("echo first; sleep 0.3; echo last");
        assert!(!tail.lines().contains(&"last".to_string()));
        assert_eq!(tail.settled(Duration::from_secs(10)).lines(), ["first", "last"]);
        child.wait().unwrap();
        pumping.join().unwrap();
    }
}
