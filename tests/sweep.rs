//! `oomguard sweep`: real sweeps of tiny trials, driven through the binary in temp dirs.
mod common;

use common::{dies_with_test, isolated, write_config, TINY};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn sweep_cmd(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(common::bin());
    isolated(&mut cmd, dir)
        .arg("sweep")
        .args(args)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1");
    dies_with_test(&mut cmd);
    cmd
}

fn sweep(dir: &Path, args: &[&str]) -> Output {
    sweep_cmd(dir, args).output().unwrap()
}

fn results(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("results.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A tiny base config (with a CPU budget) and a sweep file over it.
fn setup(dir: &Path, sweep_yaml: &str) -> PathBuf {
    write_config(dir, "base.yaml", &format!("{TINY}memory: {{budget: 256MiB}}\n"));
    write_config(dir, "sweep.yaml", sweep_yaml)
}

#[test]
fn an_infeasible_trial_is_recorded_and_the_sweep_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    // One value cannot fit (a 10M vocabulary: ~2.5 GiB of weights); the planner says so.
    let file = setup(dir.path(), "base: base.yaml\nparameters:\n  model.vocab_size: {values: [256, 10000000]}\n  optim.lr: {values: [1.0e-3, 3.0e-3]}\n");
    // Two slots at once (the CPU's cores split between them).
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out", "--parallel", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = dir.path().join("out");
    let r = results(&out);
    assert_eq!(r.len(), 4);
    for rec in &r {
        let big = rec["params"]["model.vocab_size"] == 10000000;
        assert_eq!(rec["status"], if big { "infeasible" } else { "ok" }, "{rec}");
        if big {
            assert_eq!(rec["told_by"], "planner");
            assert!(rec["message"].as_str().unwrap().contains("vocab"), "{rec}");
        } else {
            assert_eq!(rec["steps"], 6);
            assert!(rec["final_eval_loss"].as_f64().unwrap() > 0.0);
            assert!(rec["tokens_per_s"].as_f64().unwrap() > 0.0);
            assert_eq!(rec["final_micro_batch_size"], 8);
            let run = out.join(rec["run_dir"].as_str().unwrap());
            let cfg = std::fs::read_to_string(run.join("config.yaml")).unwrap();
            assert!(
                cfg.contains(&format!("lr: {}", rec["params"]["optim.lr"])),
                "the trial's value reached its config: {cfg}"
            );
        }
    }
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains("best by best_eval_loss"), "{table}");
    assert!(table.contains("infeasible (planner)"), "{table}");

    // Without the planner the run itself tells (exit 3, before allocating), and says so.
    let file = write_config(
        dir.path(),
        "sweep2.yaml",
        "base: base.yaml\nplanner: false\nparameters:\n  model.vocab_size: {value: 10000000}\n",
    );
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = results(&dir.path().join("out2"));
    assert_eq!(
        (
            r[0]["status"].as_str(),
            r[0]["told_by"].as_str(),
            r[0]["exit_code"].as_i64()
        ),
        (Some("infeasible"), Some("run"), Some(3))
    );

    // --status reads the same table back.
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out2", "--status"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("1 of 1 trials finished"));
}

/// W&B's metric.target, nested parameters and a command with W&B's macros, through the
/// binary: the first trial reaches the target, so the other two never start.
#[test]
fn metric_target_reached_starts_no_new_trial_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let file = setup(
        dir.path(),
        "base: base.yaml\nmethod: grid\ncommand: ['${env}', oomguard, train, '${args}']\nmetric: {name: loss, goal: minimize, target: 1.0e9}\n\
            parameters:\n  optim:\n    parameters:\n      lr: {values: [1.0e-3, 2.0e-3, 3.0e-3]}\n",
    );
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = dir.path().join("out");
    let r = results(&out);
    assert_eq!(r.len(), 1, "one trial ran: {r:?}");
    assert_eq!(
        (r[0]["status"].as_str(), r[0]["params"]["optim.lr"].as_f64()),
        (Some("ok"), Some(1.0e-3))
    );
    let loss = r[0]["final_loss"].as_f64().unwrap();
    let log = std::fs::read_to_string(out.join("sweep.log")).unwrap();
    let said = format!(
        "metric.target reached: trial {} has final_loss {loss:.4} <= 1000000000",
        r[0]["trial"].as_str().unwrap()
    );
    assert!(log.contains(&format!("sweep stopped early: {said}")), "{log}");
    assert!(log.contains("`command` (W&B's) is read as `oomguard train"), "{log}");
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out", "--status"]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&said),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // Started again, it starts nothing.
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(results(&out).len(), 1);
    // The second trial was running when the sweep stopped (a signal): it resumes past the
    // target and finishes, its value never counted while interrupted; the third never starts.
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out", "--status"]);
    let table = String::from_utf8_lossy(&o.stdout).into_owned();
    let second = table
        .split_whitespace()
        .find(|w| w.starts_with("001-"))
        .unwrap_or_else(|| panic!("{table}"));
    let mut stopped = r[0].clone();
    stopped["trial"] = json!(second);
    stopped["index"] = json!(1);
    stopped["params"] = json!({"optim.lr": 2.0e-3});
    stopped["status"] = json!("interrupted");
    stopped["exit_code"] = json!(143);
    stopped["final_loss"] = json!(0.0);
    stopped["run_dir"] = json!(format!("trials/{second}"));
    let lines = format!("{}\n{}\n", r[0], stopped);
    std::fs::write(out.join("results.jsonl"), lines).unwrap();
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = results(&out);
    assert_eq!(
        r.iter()
            .map(|t| (t["trial"].as_str().unwrap(), t["status"].as_str().unwrap()))
            .collect::<Vec<_>>(),
        [(r[0]["trial"].as_str().unwrap(), "ok"), (second, "ok")],
        "{r:?}"
    );
    assert!(r[1]["final_loss"].as_f64().unwrap() > 0.0, "its own run's value: {r:?}");
}

#[test]
fn a_trial_past_its_timeout_is_stopped_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let file = setup(
        dir.path(),
        "base: base.yaml\ntrial: {timeout: 3s}\nparameters:\n  train.max_steps: {value: 1000000}\n",
    );
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = results(&dir.path().join("out"));
    assert_eq!(r[0]["status"], "timeout", "{}", r[0]);
    assert!(r[0]["steps"].as_u64().unwrap() > 0);
    let run = dir.path().join("out").join(r[0]["run_dir"].as_str().unwrap());
    assert!(
        std::fs::read_dir(run.join("checkpoints")).unwrap().count() > 0,
        "SIGTERM made the trial checkpoint"
    );
}

#[test]
fn kill_9_mid_trial_then_restart_runs_every_trial_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = setup(
        dir.path(),
        "base: base.yaml\nparameters:\n  optim.lr: {values: [1.0e-3, 2.0e-3, 3.0e-3]}\n  train.max_steps: {value: 60}\n  checkpoint.every_steps: {value: 5}\n",
    );
    let out = dir.path().join("out");
    let mut child = sweep_cmd(dir.path(), &[file.to_str().unwrap(), "--out", "out"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the second trial is past its second checkpoint: one trial done, one mid-way.
    let t = Instant::now();
    let second_steps = || -> usize {
        let Ok(d) = std::fs::read_dir(out.join("trials")) else {
            return 0;
        };
        let Some(run) = d
            .flatten()
            .find(|e| e.file_name().to_string_lossy().starts_with("001-"))
        else {
            return 0;
        };
        std::fs::read_to_string(run.path().join("metrics.jsonl"))
            .unwrap_or_default()
            .matches("\"event\":\"step\"")
            .count()
    };
    while second_steps() < 12 {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the second trial never got going"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert_eq!(results(&out).len(), 1, "only the first trial had finished");
    // The trial's processes died with the sweep (its shim kills the group).
    std::thread::sleep(Duration::from_millis(500));
    let ps = Command::new("pgrep")
        .args(["-f", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        ps.stdout.is_empty(),
        "a trial outlived the sweep: {}",
        String::from_utf8_lossy(&ps.stdout)
    );

    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = results(&out);
    assert_eq!(r.len(), 3, "each trial once: {r:?}");
    let ids: std::collections::BTreeSet<_> = r.iter().map(|x| x["trial"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids.len(), 3);
    for rec in &r {
        assert_eq!(
            (rec["status"].as_str(), rec["steps"].as_u64()),
            (Some("ok"), Some(60)),
            "{rec}"
        );
    }
    // The interrupted trial resumed from its checkpoint instead of starting over.
    let second = out.join(r[1]["run_dir"].as_str().unwrap());
    let metrics = std::fs::read_to_string(second.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"event\":\"resumed\""), "trial 1 resumed");
    assert!(
        !String::from_utf8_lossy(&o.stderr).contains("[000-"),
        "the finished trial was not run again"
    );
}

#[test]
fn concurrent_shards_are_disjoint_and_together_complete() {
    let dir = tempfile::tempdir().unwrap();
    let file = setup(dir.path(), "base: base.yaml\nparameters:\n  optim.lr: {values: [1.0e-3, 2.0e-3, 3.0e-3, 4.0e-3, 5.0e-3]}\n  train.max_steps: \
        {value: 3}\n");
    let spawn = |s: &str| sweep_cmd(dir.path(), &[file.to_str().unwrap(), "--out", "out", "--shard", s]).output();
    let (a, b) = std::thread::scope(|sc| {
        let a = sc.spawn(|| spawn("0/2").unwrap());
        let b = sc.spawn(|| spawn("1/2").unwrap());
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(
        a.status.success() && b.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&a.stderr),
        String::from_utf8_lossy(&b.stderr)
    );
    let r = results(&dir.path().join("out"));
    assert_eq!(
        r.iter().map(|x| x["index"].as_u64().unwrap()).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
    for rec in &r {
        let shard = format!("{}/2", rec["index"].as_u64().unwrap() % 2);
        assert_eq!(
            (rec["status"].as_str(), rec["shard"].as_str()),
            (Some("ok"), Some(shard.as_str())),
            "{rec}"
        );
    }
}

/// `base:` is relative to the sweep file, whatever directory the sweep runs in (the README's
/// `oomguard sweep configs/demo-sweep.yaml`, from the repository root): the `--check` pass,
/// the planner and the trials all read the base beside the sweep file, not a file of that
/// name in the working directory (here a decoy of 3 steps against the base's 6), in oomguard's
/// format and in W&B's (`command`), and as Slurm and Kubernetes shards.
#[test]
fn base_is_found_beside_the_sweep_file_from_another_directory() {
    let dir = tempfile::tempdir().unwrap();
    let sweeps = dir.path().join("sweeps");
    std::fs::create_dir(&sweeps).unwrap();
    setup(
        &sweeps,
        "base: base.yaml\nparameters:\n  model.vocab_size: {values: [256, 10000000]}\n",
    );
    write_config(
        &sweeps,
        "wandb.yaml",
        "base: base.yaml\nmethod: grid\ncommand: ['${env}', oomguard, train, '${args}']\nmetric: {name: loss, goal: minimize}\n\
         parameters:\n  optim.lr: {values: [1.0e-3, 2.0e-3]}\n",
    );
    let decoy = TINY.replace("max_steps: 6", "max_steps: 3");
    write_config(dir.path(), "base.yaml", &format!("{decoy}memory: {{budget: 256MiB}}\n"));

    // oomguard's format: the ok trial trained the sweep folder's base (6 steps), and the
    // planner read it too (a 10M vocabulary does not fit its budget: told by the planner).
    let o = sweep(dir.path(), &["sweeps/sweep.yaml", "--out", "grid"]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let r = results(&dir.path().join("grid"));
    let outcome = |rec: &Value| (rec["status"].clone(), rec["told_by"].clone(), rec["steps"].clone());
    assert_eq!(
        r.iter().map(outcome).collect::<Vec<_>>(),
        [
            (json!("ok"), Value::Null, json!(6)),
            (json!("infeasible"), json!("planner"), json!(0))
        ],
        "{r:?}"
    );
    // The same parameters over the other base (the decoy's 3 steps), into the same folder:
    // the same trial ids, so refused rather than reported as the first sweep's results.
    let other = write_config(
        dir.path(),
        "other.yaml",
        "base: base.yaml\nparameters:\n  model.vocab_size: {values: [256, 10000000]}\n",
    );
    let o = sweep(dir.path(), &[other.to_str().unwrap(), "--out", "grid"]);
    assert_eq!(o.status.code(), Some(2), "{}", common::stderr(&o));
    assert!(
        common::stderr(&o).contains("holds the trials of a sweep whose base config (or command) differs"),
        "{}",
        common::stderr(&o)
    );
    assert_eq!(results(&dir.path().join("grid")).len(), 2);
    let again = sweep(dir.path(), &["sweeps/sweep.yaml", "--out", "grid"]);
    assert!(again.status.success(), "{}", common::stderr(&again));

    // W&B's format, one trial per shard: shard 0 as a Kubernetes indexed Job's pod, shard 1
    // as a Slurm array task (examples/sweep/k8s-job.yaml and slurm.sbatch run `oomguard
    // sweep FILE` so).
    let k8s = sweep_cmd(dir.path(), &["sweeps/wandb.yaml", "--out", "wandb", "--shards", "2"])
        .env("JOB_COMPLETION_INDEX", "0")
        .output()
        .unwrap();
    assert!(k8s.status.success(), "{}", common::stderr(&k8s));
    let slurm = sweep_cmd(dir.path(), &["sweeps/wandb.yaml", "--out", "wandb"])
        .envs([
            ("SLURM_ARRAY_TASK_ID", "1"),
            ("SLURM_ARRAY_TASK_MIN", "0"),
            ("SLURM_ARRAY_TASK_COUNT", "2"),
        ])
        .output()
        .unwrap();
    assert!(slurm.status.success(), "{}", common::stderr(&slurm));
    let r = results(&dir.path().join("wandb"));
    assert_eq!(
        r.iter()
            .map(|rec| (rec["shard"].clone(), rec["status"].clone(), rec["steps"].clone()))
            .collect::<Vec<_>>(),
        [
            (json!("0/2"), json!("ok"), json!(6)),
            (json!("1/2"), json!("ok"), json!(6))
        ],
        "{r:?}"
    );
}

#[test]
fn a_bad_sweep_file_exits_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path(), "");
    let cases = [
        ("base: base.yaml\nparamters: {}\n", "paramters"),
        ("base: base.yaml\nparameters:\n  optim.lr: {values: []}\n", "parameters.optim.lr"),
        ("base: base.yaml\nmethod: random\nparameters:\n  optim.lr: {distribution: log_uniform, min: 1.0e-4, max: 1}\n", "count"),
        ("base: nope.yaml\nparameters:\n  optim.lr: {value: 1}\n", "base"),
        ("base: base.yaml\ntrial: {timeout: soon}\nparameters:\n  optim.lr: {value: 1}\n", "trial.timeout"),
        ("base: base.yaml\nmethod: random\ncount: 2\nparameters:\n  model.n_layer: {distribution: int_uniform, min: 1.2, max: 1.8}\n", "no integer in \
            [min, max]"),
        ("base: base.yaml\nmetric: {name: accuracy, goal: maximize}\nparameters:\n  optim.lr: {value: 1}\n", "these exist: val_loss, loss, tokens_per_s"),
        ("base: base.yaml\nearly_terminate: {type: hyperband, min_iter: 3, strict: false}\nparameters:\n  optim.lr: {value: 1}\n", "early_terminate.strict"),
        ("base: base.yaml\ncommand: [python, train.py, '${args}']\nparameters:\n  optim.lr: {value: 1}\n", "command"),
        ("base: base.yaml\ndevice_memory: banana\nparameters:\n  optim.lr: {value: 1}\n", "device_memory: `banana` is neither a size"),
        // A script's command: the launcher's options are checked before any trial runs (every
        // trial ran and failed, and the sweep exited 0).
        ("program: base.yaml\ncommand: [oomguard, launch, --nproc-per-nod, 2, '${program}', '${args}']\nparameters:\n  lr: {value: 1}\n", "command: trial \
            000-"),
        // A key the config does not have: every trial is checked before the first runs.
        ("base: base.yaml\nparameters:\n  model.n_embdd: {values: [32]}\n", "n_embdd"),
        // Nested (W&B's) the same: the error names the dotted path.
        ("base: base.yaml\nparameters:\n  model: {parameters: {n_embdd: {values: [32]}}}\n", "model.n_embdd"),
    ];
    for (yaml, key) in cases {
        let file = write_config(dir.path(), "bad.yaml", yaml);
        let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{yaml}: {err}");
        assert!(
            err.contains("bad.yaml") && err.contains(key),
            "{yaml}: the error names the file and {key}: {err}"
        );
        assert!(!dir.path().join("out/results.jsonl").exists(), "nothing ran");
        assert!(
            !dir.path().join("out/sweep.yaml").exists(),
            "a refused file is not kept as what ran"
        );
    }
}

#[test]
fn sigterm_stops_the_trials_with_checkpoints_and_records_them_interrupted() {
    let dir = tempfile::tempdir().unwrap();
    let file = setup(
        dir.path(),
        "base: base.yaml\nparameters:\n  train.max_steps: {value: 1000000}\n",
    );
    let out = dir.path().join("out");
    let child = sweep_cmd(dir.path(), &[file.to_str().unwrap(), "--out", "out"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let steps = || {
        std::fs::read_dir(out.join("trials"))
            .ok()
            .and_then(|mut d| d.next())
            .and_then(|e| std::fs::read_to_string(e.ok()?.path().join("metrics.jsonl")).ok())
            .map_or(0, |m| m.lines().count())
    };
    while steps() < 3 {
        assert!(t.elapsed() < Duration::from_secs(60), "the trial never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(143), "{}", String::from_utf8_lossy(&o.stderr));
    let r = results(&out);
    assert_eq!(
        (r[0]["status"].as_str(), r[0]["exit_code"].as_i64()),
        (Some("interrupted"), Some(143)),
        "{}",
        r[0]
    );
    let run = out.join(r[0]["run_dir"].as_str().unwrap());
    assert!(
        std::fs::read_dir(run.join("checkpoints")).unwrap().count() > 0,
        "the trial checkpointed on SIGTERM"
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("interrupted"),
        "the table says so"
    );
}

/// A status line after each trial: done / running / left and the outcomes so far match the
/// trials finished, through a trial the planner finds infeasible and one that fails.
#[test]
fn status_lines_count_through_infeasible_and_failed_trials() {
    let dir = tempfile::tempdir().unwrap();
    // Targets of another length than the inputs' rows: they pass `train --check` (an empty
    // file, or rows longer than the block, no longer do) and fail once the model runs.
    let ids = |len: i64| tch::Tensor::randint(256, [16, len], (tch::Kind::Int64, tch::Device::Cpu));
    tch::Tensor::write_safetensors(
        &[("inputs", &ids(32)), ("targets", &ids(16))],
        dir.path().join("long.safetensors"),
    )
    .unwrap();
    // embedded: runs; those samples: fail; a 10M vocabulary: infeasible.
    let file = setup(
        dir.path(),
        "base: base.yaml\nparameters:\n  data.source: {values: [embedded, tensors]}\n  model.vocab_size: {values: [256, 10000000]}\n  data.path: {value: \
            long.safetensors}\n",
    );
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains('\x1b'), "plain lines off a terminal: {err:?}");
    let mut r = results(&dir.path().join("out"));
    r.sort_by_key(|x| x["index"].as_u64());
    let statuses: Vec<&str> = r.iter().map(|x| x["status"].as_str().unwrap()).collect();
    assert_eq!(
        {
            let mut s = statuses.clone();
            s.sort();
            s
        },
        ["failed", "infeasible", "infeasible", "ok"],
        "{r:?}"
    );
    // One line after each trial; one slot: trials finish in index order, so after D of them
    // the counts are theirs.
    let lines: Vec<&str> = err
        .lines()
        .filter_map(|l| l.split_once("sweep: ").map(|(_, s)| s))
        .filter(|l| l.contains(" done, "))
        .collect();
    assert_eq!(
        lines.iter().map(|l| l.split('/').next().unwrap()).collect::<Vec<_>>(),
        ["1", "2", "3", "4"],
        "{err}"
    );
    for l in &lines {
        let num = |after: &str| -> usize {
            l.split(after)
                .nth(1)
                .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("`{after}` in {l}"))
        };
        let done: usize = l.split('/').next().unwrap().parse().unwrap();
        let (running, left) = (num("done, "), num("running, "));
        assert_eq!(
            (l.split('/').nth(1).unwrap().split(' ').next(), done + running + left),
            (Some("4"), 4),
            "{l}"
        );
        let so_far = &statuses[..done];
        let n = |s: &str| so_far.iter().filter(|x| **x == s).count();
        assert_eq!(
            (num("| ok "), num("infeasible "), num("failed ")),
            (n("ok"), n("infeasible"), n("failed")),
            "{l}"
        );
        assert!(!l.ends_with("ETA ?") || done == 0, "an ETA once a trial finished: {l}");
    }
    let last = lines.last().unwrap();
    assert!(
        last.starts_with("4/4 done, 0 running, 0 left | ok 1, infeasible 2, failed 1 | best "),
        "{last}"
    );
    let ok = r.iter().find(|x| x["status"] == "ok").unwrap();
    assert!(
        last.contains(&format!("best {} ", ok["trial"].as_str().unwrap())),
        "the best so far is the one that trained: {last}"
    );
    // sweep.log keeps the same lines.
    let log = std::fs::read_to_string(dir.path().join("out/sweep.log")).unwrap();
    assert!(log.contains(last), "{log}");
}

/// Two sweeps started together on one directory, same shard: every trial runs exactly once
/// (each started by one process, never resumed or run again), each recorded once.
#[test]
fn two_sweeps_on_one_directory_run_every_trial_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = setup(
        dir.path(),
        "base: base.yaml\nplanner: false\nparameters:\n  optim.lr: {values: [1.0e-3, 2.0e-3, 3.0e-3, 4.0e-3]}\n  \
        train.max_steps: {value: 3}\n",
    );
    let run = || {
        sweep_cmd(dir.path(), &[file.to_str().unwrap(), "--out", "out"])
            .output()
            .unwrap()
    };
    let (a, b) = std::thread::scope(|sc| {
        let a = sc.spawn(run);
        let b = sc.spawn(run);
        (a.join().unwrap(), b.join().unwrap())
    });
    let (ea, eb) = (String::from_utf8_lossy(&a.stderr), String::from_utf8_lossy(&b.stderr));
    assert!(a.status.success() && b.status.success(), "{ea}\n{eb}");
    let out = dir.path().join("out");
    let r = results(&out);
    assert_eq!(r.len(), 4, "{r:?}");
    for rec in &r {
        let id = rec["trial"].as_str().unwrap();
        assert_eq!(
            (rec["status"].as_str(), rec["steps"].as_u64()),
            (Some("ok"), Some(3)),
            "{rec}"
        );
        let starts = format!("{ea}{eb}").matches(&format!("[{id}] start")).count()
            + format!("{ea}{eb}").matches(&format!("[{id}] resume")).count();
        assert_eq!(starts, 1, "{id} started once: {ea}\n{eb}");
        let metrics =
            std::fs::read_to_string(out.join(rec["run_dir"].as_str().unwrap()).join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.matches("\"event\":\"step\"").count(), 3, "{id}: {metrics}");
        assert!(!metrics.contains("\"event\":\"resumed\""), "{id} ran once");
    }
}

/// `--status` takes no lock and creates nothing: called in a loop through a whole sweep, the
/// sweep runs exactly as it would alone.
#[test]
fn status_in_a_loop_has_no_effect_on_a_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let file = setup(dir.path(), "base: base.yaml\nplanner: false\nparameters:\n  optim.lr: {values: [1.0e-3, 2.0e-3, 3.0e-3]}\n  train.max_steps: \
        {value: 4}\n");
    let status = || sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out", "--status"]);
    let o = status();
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("0 of 3 trials finished"),
        "{o:?}"
    );
    assert!(!dir.path().join("out").exists(), "--status created nothing");
    let mut child = sweep_cmd(dir.path(), &[file.to_str().unwrap(), "--out", "out"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut polls = 0;
    let mut saw_running = false;
    while child.try_wait().unwrap().is_none() {
        let o = status();
        assert!(o.status.success(), "{o:?}");
        saw_running |= String::from_utf8_lossy(&o.stdout).contains(" running ");
        polls += 1;
    }
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && polls > 3, "{polls} polls: {err}");
    assert!(saw_running, "--status saw a trial running (from /proc/locks)");
    assert!(!err.contains("requeued") && !err.contains("] resume"), "{err}");
    for rec in results(&dir.path().join("out")) {
        assert_eq!(
            (rec["status"].as_str(), rec["steps"].as_u64()),
            (Some("ok"), Some(4)),
            "{rec}"
        );
    }
}

/// A line of results.jsonl that does not parse is kept in results.corrupt.jsonl, with a warning.
#[test]
fn a_corrupt_results_line_survives_in_results_corrupt_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let file = setup(
        dir.path(),
        "base: base.yaml\nplanner: false\nparameters:\n  train.max_steps: {value: 2}\n",
    );
    std::fs::create_dir_all(dir.path().join("out")).unwrap();
    std::fs::write(
        dir.path().join("out/results.jsonl"),
        "{\"trial\": \"999-edited by hand\", \n",
    )
    .unwrap();
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("not a trial record") && err.contains("results.corrupt.jsonl"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out/results.corrupt.jsonl")).unwrap(),
        "{\"trial\": \"999-edited by hand\", \n"
    );
    assert_eq!(results(&dir.path().join("out")).len(), 1);
}

/// Model-based search end to end: each proposal is kept in results.jsonl before it runs; an
/// infeasible proposal is recorded as such; the same command again runs nothing.
#[test]
fn a_tpe_sweep_runs_count_trials_and_a_restart_runs_none() {
    let dir = tempfile::tempdir().unwrap();
    let file = setup(
        dir.path(),
        "base: base.yaml\nmethod: tpe\ncount: 5\nseed: 3\nmetric: final_loss\nparameters:\n  optim.lr: {distribution: log_uniform_values, min: \
            1.0e-3, max: 1.0e-2}\n  model.vocab_size: {values: [256, 10000000]}\n  train.max_steps: {value: 2}\n",
    );
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = results(&dir.path().join("out"));
    assert_eq!(
        r.iter().map(|x| x["index"].as_u64().unwrap()).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
    for rec in &r {
        let big = rec["params"]["model.vocab_size"] == 10000000;
        assert_eq!(rec["status"], if big { "infeasible" } else { "ok" }, "{rec}");
        assert!(
            (1.0e-3..=1.0e-2).contains(&rec["params"]["optim.lr"].as_f64().unwrap()),
            "{rec}"
        );
    }
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && !err.contains("] start") && !err.contains("] resume"),
        "{err}"
    );
    assert_eq!(results(&dir.path().join("out")), r, "nothing ran again");
}

/// A W&B sweep of the user's own script (examples/sweep/script/): each trial runs it under
/// `oomguard launch` with W&B's `--KEY=VALUE` arguments, its guard's metrics.jsonl and
/// `log_eval` land in the trial's directory and give the metric; a trial that does not fit
/// even at micro-batch 1 (a real allocation failure, `oomguard.Infeasible`) is exit 3,
/// recorded infeasible, and the sweep goes on. Two trials run side by side (each launcher
/// on a port of its own).
#[test]
fn a_script_of_ones_own_is_swept_through_oomguard_launch() {
    let root = common::root();
    let dir = tempfile::tempdir().unwrap();
    let run_with = |file: &Path, out: &Path, extra: &[&str]| {
        let mut cmd = Command::new(common::bin());
        isolated(&mut cmd, dir.path())
            .args([
                "sweep",
                &file.display().to_string(),
                "--out",
                &out.display().to_string(),
            ])
            .args(extra)
            .current_dir(&root)
            .env("PATH", common::path_with_venv())
            .env("OMP_NUM_THREADS", "1");
        dies_with_test(&mut cmd).output().unwrap()
    };
    let run = |file: &Path, out: &Path| run_with(file, out, &[]);
    // The example as it ships.
    let out = dir.path().join("example");
    let o = run(&root.join("examples/sweep/script/sweep.yaml"), &out);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let rs = results(&out);
    assert_eq!(rs.len(), 4);
    for r in &rs {
        assert_eq!(
            (r["status"].as_str(), r["steps"].as_u64()),
            (Some("ok"), Some(20)),
            "{r}"
        );
        assert!(r["final_eval_loss"].as_f64().is_some_and(f64::is_finite), "{r}");
        let log = std::fs::read_to_string(out.join(r["run_dir"].as_str().unwrap()).join("trial.log")).unwrap();
        let lr = r["params"]["lr"].as_f64().unwrap();
        assert!(log.contains(&format!("'lr': {lr}")), "the script got its --lr: {log}");
    }
    // A trial that cannot fit, beside one that can.
    let file = dir.path().join("sweep.yaml");
    let script = root.join("examples/sweep/script/train.py");
    std::fs::write(&file, format!("program: {}\ncommand: [oomguard, launch, '${{program}}', '${{args}}']\nmetric: {{name: loss, goal: minimize}}\n\
        parameters:\n  scratch_mib: {{values: [0, 1.0e9]}}\n  steps: {{value: 3}}\n", script.display())).unwrap();
    let out = dir.path().join("infeasible");
    let o = run(&file, &out);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let rs = results(&out);
    let by = |mib: f64| {
        rs.iter()
            .find(|r| r["params"]["scratch_mib"].as_f64() == Some(mib))
            .unwrap()
    };
    assert_eq!(
        (by(0.0)["status"].as_str(), by(0.0)["steps"].as_u64()),
        (Some("ok"), Some(3)),
        "{rs:?}"
    );
    let bad = by(1e9);
    assert_eq!(
        (bad["status"].as_str(), bad["exit_code"].as_i64()),
        (Some("infeasible"), Some(3)),
        "{bad}"
    );
    assert!(bad["message"].as_str().unwrap().contains("micro-batch 1"), "{bad}");
    // A script that fails: the trial records the worker's own last error line, not the
    // launcher's "failed (exit code 1)".
    let failing = dir.path().join("fails.py");
    std::fs::write(&failing, "import sys\nraise ValueError(f'{sys.argv[1]} is too big')\n").unwrap();
    let file = dir.path().join("failing.yaml");
    std::fs::write(&file, format!("program: {}\ncommand: [oomguard, launch, '${{program}}', '${{args}}']\nmetric: {{name: loss, goal: minimize}}\n\
        parameters:\n  lr: {{value: 7}}\n", failing.display())).unwrap();
    let out = dir.path().join("failing");
    let o = run(&file, &out);
    let rs = results(&out);
    assert_eq!(
        (rs[0]["status"].as_str(), rs[0]["message"].as_str()),
        (Some("failed"), Some("ValueError: --lr=7 is too big")),
        "{rs:?}\n{}",
        common::stderr(&o)
    );
    // The script mended: a rerun keeps the record; --retry-failed runs the trial again.
    std::fs::write(&failing, "print('fine')\n").unwrap();
    run(&file, &out);
    assert_eq!(results(&out)[0]["status"], "failed");
    let o = run_with(&file, &out, &["--retry-failed"]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    assert_eq!(results(&out)[0]["status"], "ok", "{}", common::stderr(&o));
    // Two trials that write the same relative file in the working directory they share: the
    // second is named, with the fix (each trial's own OOMGUARD_RUN_DIR).
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let writes = work.join("writes.py");
    std::fs::write(&writes, "open('ckpt.pt', 'w').write('mine')\n").unwrap();
    std::fs::write(
        work.join("writes.yaml"),
        "program: writes.py\ncommand: [oomguard, launch, '${program}', '${args}']\n\
        metric: {name: loss, goal: minimize}\nparameters:\n  lr: {values: [1, 2]}\n",
    )
    .unwrap();
    let mut cmd = Command::new(common::bin());
    isolated(&mut cmd, dir.path())
        .args(["sweep", "writes.yaml", "--out", "out"])
        .current_dir(&work)
        .env("PATH", common::path_with_venv())
        .env("OMP_NUM_THREADS", "1");
    let o = dies_with_test(&mut cmd).output().unwrap();
    let err = common::stderr(&o);
    assert_eq!(err.matches("ckpt.pt, as trial 000-").count(), 1, "{err}");
    assert!(err.contains("write under $OOMGUARD_RUN_DIR"), "{err}");
}

/// The planner finds micro-batch 1 too big, but a rung the guard climbs to by itself (here
/// the fused loss) would fit: the trial is left to the run, which climbs and finishes (the
/// planner recorded it infeasible without running it).
#[test]
fn a_trial_a_rung_would_fit_is_left_to_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let file = setup(
        dir.path(),
        "base: base.yaml\nparameters:\n  model.vocab_size: {value: 50000}\n  model.loss: {value: full}\n  memory.budget: {value: 40MiB}\n  \
            train.max_steps: {value: 2}\n",
    );
    let o = sweep(dir.path(), &[file.to_str().unwrap(), "--out", "out"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let r = results(&dir.path().join("out"));
    assert_eq!(
        (r[0]["status"].as_str(), r[0]["steps"].as_u64()),
        (Some("ok"), Some(2)),
        "{r:?}\n{err}"
    );
    let run = dir.path().join("out").join(r[0]["run_dir"].as_str().unwrap());
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains(r#""rung":"fused_loss""#), "{metrics}");
}
