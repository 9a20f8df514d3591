//! Nothing lost by default, nothing changed silently: the checkpoint clock (on by default)
//! and a resume that keeps the run's identity, through the binary: real processes, real
//! kills, real files.
mod common;
use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Every file under `dir`, by relative path, with its bytes.
fn tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.insert(p.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

fn resume(dir: &Path, run: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["train"];
    args.extend_from_slice(extra);
    args.extend(["--run-dir", run.to_str().unwrap(), "--resume"]);
    oomguard(&args, dir)
}

/// A run with every checkpoint setting at its default but a fast clock, killed with
/// kill -9 after the clock fired, resumes from the clock's checkpoint with no config file,
/// and ends bitwise where an uninterrupted run ends.
#[test]
fn a_clock_checkpoint_survives_kill_9_and_a_bare_resume_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY
        .replace("max_steps: 6", "max_steps: 400")
        .replace("log: {every: 1}", "log: {every: 50}");
    let cfg = write_config(dir.path(), "tiny.yaml", &yaml);
    let clean = train_into(dir.path(), &cfg, "clean", &["--set", "checkpoint.every_minutes=0"]);
    assert!(records(&clean, "checkpoint").iter().all(|c| c["reason"] == "end"));

    let run = dir.path().join("run");
    let mut child = isolated(dies_with_test(&mut Command::new(bin())), dir.path())
        .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
        .args(["--set", "checkpoint.every_minutes=0.002"])
        .current_dir(dir.path())
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let fired = loop {
        let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("\"every_minutes\"")) {
            break serde_json::from_str::<serde_json::Value>(line).unwrap();
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before its clock fired"
        );
        assert!(t.elapsed() < Duration::from_secs(60), "the clock never fired");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(
        Command::new("kill")
            .args(["-9", &child.id().to_string()])
            .status()
            .unwrap()
            .success(),
        "kill -9"
    );
    child.wait().unwrap();
    let next = fired["next_step"].as_u64().unwrap();
    assert!(next > 0 && next < 400, "{fired}");
    assert!(
        fired["seconds"].as_f64().unwrap() > 0.0 && fired["bytes"].as_u64().unwrap() > 10_000,
        "{fired}"
    );
    assert!(
        fired["interval_s"].as_f64().unwrap() >= 0.12,
        "the clock's interval is every_minutes' or longer: {fired}"
    );
    // The newest checkpoint on disk is the clock's (or a later tick of it).
    let newest = records(&run, "checkpoint").last().unwrap().clone();
    assert_eq!(newest["reason"], "every_minutes", "{newest}");

    let o = resume(dir.path(), &run, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let resumed = records(&run, "resumed");
    assert_eq!(resumed.len(), 1);
    assert_eq!(resumed[0]["step"], newest["next_step"]);
    assert_eq!(max_abs_diff(&weights(&clean), &weights(&run)), 0.0, "parameters differ");
    assert_eq!(losses(&clean), losses(&run));
}

/// Two ranks, a clock that fires many times: the checkpoint is a collective, so a rank
/// that checkpointed at another step would fail the run (the exchanges would not match).
#[test]
fn the_clock_fires_at_the_same_step_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY
        .replace("max_steps: 6", "max_steps: 120")
        .replace("log: {every: 1}", "log: {every: 40}");
    let cfg = write_config(dir.path(), "tiny.yaml", &yaml);
    let run = dir.path().join("two");
    let o = train_at(
        dir.path(),
        &cfg,
        &run,
        &["--nproc-per-node", "2", "--set", "checkpoint.every_minutes=0.0001"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let ticks: Vec<u64> = records(&run, "checkpoint")
        .iter()
        .filter(|c| c["reason"] == "every_minutes")
        .map(|c| c["next_step"].as_u64().unwrap())
        .collect();
    // Its interval stretches to 100 checkpoints' cost (tens of ms here, more under load): it
    // fires at least once, and steps run after it at the world the ranks agreed.
    assert!(!ticks.is_empty() && ticks[0] < 120, "the clock fired {ticks:?}");
    assert_eq!(records(&run, "step").len(), 120);
    assert!(ticks.windows(2).all(|w| w[0] < w[1]), "{ticks:?}");
}

/// A 4-step run with a checkpoint, to resume.
fn four_steps(dir: &Path) -> (PathBuf, PathBuf) {
    let cfg = write_config(dir, "tiny.yaml", TINY);
    let run = train_ok(dir, &cfg, &["--max-steps", "4", "--set", "optim.decay_steps=6"]);
    (cfg, run)
}

/// Every key that alters the run is refused with exit 2, naming the key, both values and
/// the flag; the run directory is byte for byte as it was.
#[test]
fn a_resume_that_would_change_the_run_is_refused_and_touches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, run) = four_steps(dir.path());
    let before = tree(&run);
    let cases: [(&str, &str, &str); 7] = [
        ("train.seed=8", "train.seed", "7 in the run, 8 now"),
        ("optim.lr=0.001", "optim.lr", "0.003 in the run, 0.001 now"),
        ("model.n_embd=64", "model.n_embd", "32 in the run, 64 now"),
        (
            "data.embedded_bytes=32768",
            "data.embedded_bytes",
            "65536 in the run, 32768 now",
        ),
        ("train.grad_accum_steps=4", "the global batch", "16 in the run, 32 now"),
        ("optim.decay_steps=12", "(optim.decay_steps)", "6 in the run, 12 now"),
        ("optim.warmup_steps=3", "optim.warmup_steps", "2 in the run, 3 now"),
    ];
    for (set, key, values) in cases {
        let o = resume(
            dir.path(),
            &run,
            &[cfg.to_str().unwrap(), "--set", set, "--max-steps", "4"],
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "--set {set}: {err}");
        assert!(err.contains(&format!("{key}: {values}")), "--set {set}: {err}");
        assert!(err.contains("--allow-change"), "{err}");
        assert!(tree(&run) == before, "--set {set} changed the run directory");
    }
    // The schedule that follows max_steps (decay_steps unset) cannot be stretched either.
    let follows = write_config(dir.path(), "follows.yaml", TINY);
    let run2 = train_into(dir.path(), &follows, "run2", &["--max-steps", "4"]);
    let o = resume(dir.path(), &run2, &[follows.to_str().unwrap()]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("4 (train.max_steps) in the run, 6 (train.max_steps) now"),
        "{err}"
    );
    assert!(err.contains("--set optim.decay_steps=4"), "{err}");
}

/// --allow-change goes on with the new config, records every key, keeps the old config.
#[test]
fn allow_change_records_the_change_and_keeps_the_earlier_config() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, run) = four_steps(dir.path());
    let old = std::fs::read(run.join("config.yaml")).unwrap();
    let o = resume(
        dir.path(),
        &run,
        &[
            cfg.to_str().unwrap(),
            "--set",
            "optim.lr=0.001",
            "--set",
            "log.every=2",
            "--allow-change",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(run.join("config.001.yaml")).unwrap(), old);
    let now = std::fs::read_to_string(run.join("config.yaml")).unwrap();
    assert!(now.contains("lr: 0.001"), "{now}");
    let changed = records(&run, "config_changed");
    assert_eq!(changed.len(), 1, "{changed:?}");
    let c = &changed[0];
    assert_eq!(
        (c["step"].as_u64(), c["allowed"].as_bool(), c["kept"].as_str()),
        (Some(4), Some(true), Some("config.001.yaml"))
    );
    let keys: Vec<(String, bool)> = c["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| (k["key"].as_str().unwrap().to_string(), k["alters"].as_bool().unwrap()))
        .collect();
    // max_steps 4 -> 6 and decay_steps 6 -> unset keep the schedule (6 steps long): free.
    let want = [
        ("log.every", false),
        ("optim.decay_steps", false),
        ("optim.lr", true),
        ("train.max_steps", false),
    ];
    assert_eq!(keys, want.map(|(k, a)| (k.to_string(), a)));
    assert_eq!(records(&run, "step").len(), 6);
    assert_eq!(records(&run, "step")[5]["lr"].as_f64().map(|l| l <= 0.001), Some(true));
}

/// Keys that do not alter the trajectory change without the flag, logged and recorded; the
/// run ends bitwise where an uninterrupted one does.
#[test]
fn free_changes_resume_without_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, run) = four_steps(dir.path());
    let full = train_into(dir.path(), &cfg, "full", &["--set", "optim.decay_steps=6"]);
    let o = resume(
        dir.path(),
        &run,
        &[
            cfg.to_str().unwrap(),
            "--set",
            "optim.decay_steps=6",
            "--set",
            "checkpoint.keep=2",
            "--set",
            "log.every=3",
            "--memory-budget",
            "1GiB",
        ],
    );
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("resuming with train.max_steps: 4 in the run, 6 now"),
        "{err}"
    );
    let c = &records(&run, "config_changed")[0];
    assert_eq!(c["allowed"], false);
    assert!(
        c["changes"].as_array().unwrap().iter().all(|k| k["alters"] == false),
        "{c}"
    );
    assert_eq!(max_abs_diff(&weights(&full), &weights(&run)), 0.0);
}

/// Resuming without a config file where the run stored none says what to give.
#[test]
fn a_bare_resume_without_a_stored_config_says_what_to_give() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("empty");
    std::fs::create_dir_all(&run).unwrap();
    let o = resume(dir.path(), &run, &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("config.yaml does not exist") && err.contains("give the config file"),
        "{err}"
    );
}

/// Resumed from an older checkpoint, the run forks: the later checkpoints (another future)
/// are deleted, so that the next --resume continues this run.
#[test]
fn a_resume_from_an_older_checkpoint_forks_and_the_next_resume_follows_it() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY
        .replace("max_steps: 6", "max_steps: 8")
        .replace("warmup_steps: 2}", "warmup_steps: 2, decay_steps: 8}");
    let cfg = write_config(
        dir.path(),
        "tiny.yaml",
        &(yaml + "checkpoint: {every_steps: 2, keep: 5}\n"),
    );
    let run = train_ok(dir.path(), &cfg, &[]);
    let step4 = run.join("checkpoints/step-00000004");
    let o = oomguard(
        &[
            "train",
            cfg.to_str().unwrap(),
            "--resume-from",
            step4.to_str().unwrap(),
            "--max-steps",
            "5",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let mut left: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["step-00000002", "step-00000004", "step-00000005"]);
    // The next bare resume starts where the fork ended, not at the old step 8.
    let o = resume(dir.path(), &run, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(records(&run, "resumed").last().unwrap()["step"], 5);
}
