//! What a person watching a run sees: plain lines with elapsed time and an ETA that comes
//! true when stderr is a file, a live bar and then the summary on a terminal (a real
//! pseudo-terminal, its screen rebuilt from the bytes the run wrote).
mod common;

use common::{dies_with_test, isolated, median, write_config, TINY};
use std::io::{BufRead, BufReader, Read};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

/// `4.7s`, `47s`, `3m05s`, `2h07m`, `3d04h` in seconds.
fn seconds(text: &str) -> Option<f64> {
    let (mut total, mut number) = (0.0, String::new());
    for c in text.chars() {
        let unit = match c {
            'd' => 86400.0,
            'h' => 3600.0,
            'm' => 60.0,
            's' => 1.0,
            _ => {
                number.push(c);
                continue;
            }
        };
        total += number.parse::<f64>().ok()? * unit;
        number.clear();
    }
    number.is_empty().then_some(total)
}

/// A progress line's step, steps in all, elapsed seconds and ETA seconds.
fn progress_line(line: &str) -> Option<(u64, u64, f64, f64)> {
    let rest = line.split_once("step ")?.1.trim_start();
    let (k, rest) = rest.split_once('/')?;
    let (n, _) = rest.split_once(" | loss ")?;
    let (elapsed, eta) = line.rsplit(" | ").next()?.split_once(", ETA ")?;
    Some((
        k.parse().ok()?,
        n.parse().ok()?,
        seconds(elapsed)?,
        seconds(eta.trim())?,
    ))
}

fn train_cmd(dir: &Path, config: &Path, run: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(common::bin());
    isolated(&mut cmd, dir)
        .args(["train", config.to_str().unwrap(), "--run-dir", run])
        .args(extra)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1");
    for v in ["NO_COLOR", "RANK", "LOCAL_RANK"] {
        cmd.env_remove(v);
    }
    dies_with_test(&mut cmd);
    cmd
}

/// stderr into a pipe, each line stamped as it arrives; a line stamped when the summary came.
fn lines_as_they_come(mut cmd: Command) -> Vec<(Instant, Vec<u8>)> {
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let err = BufReader::new(child.stderr.take().unwrap());
    let lines: Vec<(Instant, Vec<u8>)> = err.split(b'\n').map(|l| (Instant::now(), l.unwrap())).collect();
    let status = child.wait().unwrap();
    let text: Vec<String> = lines
        .iter()
        .map(|(_, l)| String::from_utf8_lossy(l).into_owned())
        .collect();
    assert!(status.success(), "{}", text.join("\n"));
    lines
}

/// Uniform steps (the tiny GPT, one thread), evaluations and checkpoints every 80: the ETA
/// printed mid-run must come true within 25%. The median over the middle's lines keeps one
/// slow moment of a busy machine from deciding; a run whose pace changed for good while
/// it ran (another process took a core) is measured again, up to four runs. The file's tests
/// run one at a time: a neighbour's run on the other core changed this one's pace mid-run
/// (CI: 1.36 of the true time, the ETA learnt while the neighbour ran).
#[test]
fn a_run_into_a_file_prints_plain_lines_whose_eta_comes_true() {
    let _one = common::exclusive();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "tiny.yaml",
        &TINY
            .replace("max_steps: 6, eval_every: 0", "max_steps: 240, eval_every: 80")
            .replace("log: {every: 1}", "log: {every: 5}\ncheckpoint: {every_steps: 80}"),
    );
    let mut ratios_seen = vec![];
    for attempt in 0..4 {
        let run = format!("run{attempt}");
        let lines = lines_as_they_come(train_cmd(dir.path(), &cfg, &run, &[]));
        let raw: Vec<u8> = lines
            .iter()
            .flat_map(|(_, l)| l.iter().copied().chain([b'\n']))
            .collect();
        assert!(
            !raw.contains(&0x1b) && !raw.contains(&b'\r'),
            "control characters on a non-terminal:\n{}",
            String::from_utf8_lossy(&raw)
        );
        let text = |l: &[u8]| String::from_utf8_lossy(l).into_owned();
        let (done_at, done) = lines
            .iter()
            .find(|(_, l)| text(l).contains("done: 240 steps in "))
            .map(|(t, l)| (*t, text(l)))
            .expect("a summary");
        assert!(done.contains(" wall time | loss "), "{done}");
        let mut progress = vec![];
        for (at, l) in &lines {
            let l = text(l);
            if l.contains(" step ") && l.contains(" | loss ") {
                let parsed =
                    progress_line(&l).unwrap_or_else(|| panic!("a progress line without elapsed and ETA fields: {l}"));
                progress.push((*at, parsed));
            }
        }
        // Every 5th step and the last, each one parsed.
        assert_eq!(
            progress.iter().map(|(_, p)| p.0).collect::<Vec<_>>(),
            (0..240)
                .filter(|s| s % 5 == 0 || *s == 239)
                .map(|s| s + 1)
                .collect::<Vec<_>>()
        );
        assert!(
            progress.windows(2).all(|w| w[0].1 .2 <= w[1].1 .2),
            "elapsed never goes back"
        );
        let ratios: Vec<f64> = progress
            .iter()
            .filter(|(_, (k, ..))| (48..=192).contains(k))
            .map(|(at, (_, _, _, eta))| eta / done_at.duration_since(*at).as_secs_f64())
            .collect();
        let m = median(ratios.clone());
        ratios_seen.push(m);
        // metrics.jsonl carries the same, as new fields.
        let steps = common::records(&dir.path().join(&run), "step");
        assert!(
            steps
                .iter()
                .all(|r| r["elapsed_s"].as_f64().is_some() && r["eta_s"].as_f64().is_some()),
            "{:?}",
            steps[0]
        );
        if (0.75..=1.25).contains(&m) {
            return;
        }
        eprintln!("attempt {attempt}: ETA / true remaining time, median {m:.2} of {ratios:.2?}");
    }
    panic!("the ETA mid-run was off by more than 25% (medians of ETA / true remaining: {ratios_seen:.2?})");
}

/// A pseudo-terminal of `cols` x 50: the bytes the command writes to it, and its exit status.
fn in_pty(mut cmd: Command, cols: u16) -> (std::process::ExitStatus, Vec<u8>) {
    let (mut master, mut slave) = (0, 0);
    let size = libc::winsize {
        ws_row: 50,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes two descriptors we then own.
    let rc = unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), &size) };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: fresh descriptors from openpty, owned once each.
    let (master, slave) = unsafe { (std::fs::File::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    cmd.stdin(Stdio::null())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave);
    let mut child = cmd.spawn().unwrap();
    drop(cmd); // the last copy of the slave here: reads end (EIO) when the child's close
    let reader = std::thread::spawn(move || {
        let (mut master, mut out, mut buf) = (master, vec![], [0u8; 8192]);
        while let Ok(n @ 1..) = master.read(&mut buf) {
            out.extend_from_slice(&buf[..n]);
        }
        out
    });
    let status = child.wait().unwrap();
    (status, reader.join().unwrap())
}

/// The screen a terminal `cols` wide shows after `bytes`: text (wrapping as a terminal does,
/// once a character comes past the last column: indicatif counts on it), CR, LF and the
/// escapes indicatif and tracing write (cursor up and column, erase line and below; colours
/// and the rest ignored).
fn screen(bytes: &[u8], cols: usize) -> Vec<String> {
    let mut lines: Vec<Vec<char>> = vec![vec![]];
    let (mut row, mut col) = (0usize, 0usize);
    let text = String::from_utf8_lossy(bytes);
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\r' => col = 0,
            '\n' => {
                row += 1;
                col = 0;
            }
            '\x1b' => {
                if chars.clone().next() != Some('[') {
                    chars.next();
                    continue;
                }
                chars.next();
                let mut params = String::new();
                let end = chars.by_ref().find(|d| {
                    let last = d.is_ascii_alphabetic() || *d == '~';
                    if !last {
                        params.push(*d);
                    }
                    last
                });
                let n: usize = params
                    .trim_start_matches('?')
                    .split(';')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(0);
                match end {
                    Some('A') => row = row.saturating_sub(n.max(1)),
                    Some('B') => row += n.max(1),
                    Some('G') => col = n.max(1) - 1,
                    Some('K') if n == 2 => lines[row].clear(),
                    Some('K') => lines[row].truncate(col),
                    Some('J') => {
                        lines[row].truncate(col);
                        lines.truncate(row + 1);
                    }
                    _ => {}
                }
            }
            c if !c.is_control() => {
                if col >= cols {
                    row += 1;
                    col = 0;
                    if lines.len() <= row {
                        lines.resize(row + 1, vec![]);
                    }
                }
                let line = &mut lines[row];
                line.resize(line.len().max(col), ' ');
                match line.get_mut(col) {
                    Some(cell) => *cell = c,
                    None => line.push(c),
                }
                col += 1;
            }
            _ => {}
        }
        if lines.len() <= row {
            lines.resize(row + 1, vec![]);
        }
    }
    lines
        .into_iter()
        .map(|l| l.into_iter().collect::<String>().trim_end().to_string())
        .collect()
}

#[test]
fn a_terminal_shows_a_live_bar_then_the_summary() {
    let _one = common::exclusive();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "tiny.yaml",
        &TINY
            .replace("max_steps: 6, eval_every: 0", "max_steps: 300, eval_every: 150")
            .replace("log: {every: 1}", "log: {every: 10}\ncheckpoint: {every_steps: 100}"),
    );
    let mut cmd = train_cmd(dir.path(), &cfg, "run", &[]);
    cmd.env("TERM", "xterm-256color");
    let (status, raw) = in_pty(cmd, 200);
    let text = String::from_utf8_lossy(&raw);
    assert!(status.success(), "{text}");
    let screen = screen(&raw, 200);
    let last: Vec<&String> = screen.iter().rev().take(50).rev().filter(|l| !l.is_empty()).collect();
    let bar = last
        .iter()
        .position(|l| l.starts_with("300/300 [") && l.contains(" it/s | loss ") && l.contains("| mb 8x2"));
    let done = last.iter().position(|l| l.contains("done: 300 steps in "));
    assert!(
        matches!((bar, done), (Some(b), Some(d)) if b < d),
        "the last screen shows the bar at 300/300, then the summary:\n{}",
        last.iter().map(|l| l.as_str()).collect::<Vec<_>>().join("\n")
    );
    assert_eq!(done, Some(last.len() - 1), "the summary is the last line");
    // The bar was redrawn as the run went (not one final draw), with log lines above it.
    assert!(text.matches("/300 [").count() > 10, "{text}");
    for line in ["eval    150 | val loss", "eval    300 | val loss", "checkpoint "] {
        let at = screen
            .iter()
            .position(|l| l.contains(line))
            .unwrap_or_else(|| panic!("`{line}` is a line of its own:\n{}", screen.join("\n")));
        assert!(at < screen.len() - 2, "{line} printed above the bar");
    }
    // The bar shows what progress lines would: the terminal has none, train.log has them all.
    assert!(
        !screen.iter().any(|l| progress_line(l).is_some()),
        "{}",
        screen.join("\n")
    );
    let log = std::fs::read_to_string(dir.path().join("run/train.log")).unwrap();
    assert_eq!(log.lines().filter(|l| progress_line(l).is_some()).count(), 31, "{log}");
    assert!(!log.contains('\x1b'), "the log file has no escapes");
}

#[test]
fn no_color_term_dumb_and_json_are_honoured_on_a_terminal() {
    let _one = common::exclusive();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", &TINY.replace("max_steps: 6", "max_steps: 20"));
    let sgr = |t: &str| {
        t.split('\x1b').skip(1).any(|e| {
            e.starts_with('[')
                && e[1..]
                    .trim_start_matches(|c: char| c.is_ascii_digit() || c == ';')
                    .starts_with('m')
        })
    };
    // NO_COLOR: the bar, no colours.
    let mut cmd = train_cmd(dir.path(), &cfg, "no-color", &[]);
    cmd.env("TERM", "xterm-256color").env("NO_COLOR", "1");
    let (status, raw) = in_pty(cmd, 200);
    let text = String::from_utf8_lossy(&raw);
    assert!(status.success() && text.contains("20/20 [") && !sgr(&text), "{text:?}");
    // Without it, the same run is coloured: the check above can see colours.
    let mut cmd = train_cmd(dir.path(), &cfg, "colour", &[]);
    cmd.env("TERM", "xterm-256color");
    let (_, raw) = in_pty(cmd, 200);
    assert!(sgr(&String::from_utf8_lossy(&raw)));
    // TERM=dumb, and JSON logs: no bar, no escapes, the plain lines.
    for (name, term, extra) in [
        ("dumb", "dumb", vec![]),
        ("json", "xterm-256color", vec!["--log-format", "json"]),
    ] {
        let mut cmd = train_cmd(dir.path(), &cfg, name, &extra);
        cmd.env("TERM", term);
        let (status, raw) = in_pty(cmd, 200);
        let text = String::from_utf8_lossy(&raw).replace("\r\n", "\n");
        assert!(
            status.success() && !text.contains('\x1b') && !text.contains('\r'),
            "{name}: {text:?}"
        );
        let messages: Vec<String> = match name {
            "json" => text
                .lines()
                .map(|l| {
                    serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"))["fields"]
                        ["message"]
                        .as_str()
                        .unwrap_or("")
                        .to_string()
                })
                .collect(),
            _ => text.lines().map(String::from).collect(),
        };
        let lines: Vec<&String> = messages
            .iter()
            .filter(|l| l.contains(" | loss ") && !l.contains("done: "))
            .collect();
        assert_eq!(lines.len(), 20, "{name}: every progress line:\n{text}");
        assert!(lines.iter().all(|l| progress_line(l).is_some()), "{name}: {lines:?}");
    }
}
