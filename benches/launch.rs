//! `make bench` (launch): whole-process wall time and the launcher's own peak memory
//! (VmHWM) of `oomguard launch` against torchrun, 2 workers running a trivial Python script,
//! in one run (median of 5). The launcher loads no torch; aims: 50 ms and 20 MiB.
mod common;
use common::median;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn peak_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// (wall seconds, launcher peak KiB) of one run.
fn measure(cmd: &mut Command) -> (f64, u64) {
    let t = Instant::now();
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("launcher starts");
    let mut peak = 0;
    loop {
        if let Some(p) = peak_kib(child.id()) {
            peak = peak.max(p);
        }
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{cmd:?} failed");
            return (t.elapsed().as_secs_f64(), peak);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let venv = root.join(".venv/bin");
    let path = format!("{}:{}", venv.display(), std::env::var("PATH").unwrap_or_default());
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("trivial.py");
    std::fs::write(&script, "pass\n").unwrap();
    let script = script.to_str().unwrap();
    let ours = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_oomguard"));
        c.args(["launch", "--nproc-per-node", "2", "--monitor-interval", "0.01", script])
            .env("PATH", &path);
        c
    };
    let bare = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_oomguard"));
        c.args([
            "launch",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.01",
            "--no-python",
            "true",
        ]);
        c
    };
    let torchrun = || {
        let mut c = Command::new(venv.join("python3"));
        c.args([
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.01",
            script,
        ])
        .env("PATH", &path);
        c
    };
    let mut rows = vec![];
    for (name, make) in [
        ("oomguard launch", &ours as &dyn Fn() -> Command),
        ("oomguard launch --no-python true", &bare),
        ("torchrun", &torchrun),
    ] {
        let runs: Vec<(f64, u64)> = (0..5).map(|_| measure(&mut make())).collect();
        let wall = median(runs.iter().map(|r| r.0).collect());
        let peak = median(runs.iter().map(|r| r.1 as f64).collect());
        println!(
            "{name:<34} wall {:>7.1} ms   launcher peak memory {:>7.1} MiB",
            wall * 1e3,
            peak / 1024.0
        );
        rows.push((wall, peak));
    }
    println!(
        "oomguard launch / torchrun: wall {:.3}, launcher memory {:.3}; launcher-only overhead (no Python workers): {:.1} ms, {:.1} MiB (aims: 50 ms, 20 MiB)",
        rows[0].0 / rows[2].0, rows[0].1 / rows[2].1, rows[1].0 * 1e3, rows[1].1 / 1024.0
    );
}
