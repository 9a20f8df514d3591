//! Checkpoints, exact resume and signals, through the binary: real processes, real files,
//! real signals.
mod common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `oomguard train CFG --run-dir RUN [extra]` in the background, its stderr piped.
fn spawn(cwd: &Path, cfg: &Path, run: &Path, extra: &[&str]) -> Child {
    spawn_with(cwd, &[], cfg, run, extra)
}

/// `spawn`, the command after `before` (`launch ... oomguard`: the same run under a launcher).
fn spawn_with(cwd: &Path, before: &[&str], cfg: &Path, run: &Path, extra: &[&str]) -> Child {
    isolated(dies_with_test(&mut Command::new(common::bin())), cwd)
        .args(before)
        .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
        .args(extra)
        .current_dir(cwd)
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn signal(child: &Child, sig: &str) {
    assert!(Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success());
}

fn wait_for_steps(run: &Path, n: usize, child: &mut Child) {
    let t = Instant::now();
    while std::fs::read_to_string(run.join("metrics.jsonl"))
        .map(|m| m.matches("\"event\":\"step\"").count())
        .unwrap_or(0)
        < n
    {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(t.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn checkpoints(run: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with("step-"))
        .collect();
    v.sort();
    v
}

/// The fields of step records that must match between runs (not the timings).
fn step_fields(run: &Path) -> Vec<Value> {
    records(run, "step")
        .into_iter()
        .map(|r| {
            serde_json::json!([
                r["step"],
                r["loss"],
                r["lr"],
                r["grad_norm"],
                r["micro_batch_size"],
                r["grad_accum_steps"],
                r["num_samples"]
            ])
        })
        .collect()
}

fn assert_same_weights(a: &Path, b: &Path) {
    assert_eq!(max_abs_diff(&weights(a), &weights(b)), 0.0, "parameters differ");
}

/// N steps, and N/2 steps resumed for N/2 more, end bitwise identical with identical
/// metrics. Dropout is on, so the random generator's state must resume too.
#[test]
fn exact_resume() {
    let dir = tempfile::tempdir().unwrap();
    // decay_steps fixed: the 4-step run must follow the 8-step run's LR schedule.
    let yaml = TINY
        .replace("vocab_size: 256}", "vocab_size: 256, dropout: 0.1}")
        .replace("max_steps: 6", "max_steps: 8")
        .replace("warmup_steps: 2}", "warmup_steps: 2, decay_steps: 8}");
    let cfg = write_config(dir.path(), "tiny.yaml", &yaml);
    let full = train_ok(dir.path(), &cfg, &[]);
    std::fs::rename(&full, dir.path().join("full")).unwrap();
    let full = dir.path().join("full");
    let half = train_ok(dir.path(), &cfg, &["--max-steps", "4"]);
    assert_eq!(checkpoints(&half).last().unwrap().file_name().unwrap(), "step-00000004");
    let o = resume(dir.path(), &cfg, &half, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resumed from"), "{}", stderr(&o));
    assert_same_weights(&full, &half);
    assert_eq!(step_fields(&full), step_fields(&half));
    assert_eq!(
        records(&full, "eval").last().unwrap()["val_loss"],
        records(&half, "eval").last().unwrap()["val_loss"]
    ); // Resumed with max_steps lowered below the step it stands at: nothing trains, and no
       // checkpoint claims a step its state is past (step-2 holding step 8's weights).
    let before = checkpoints(&half);
    let o = resume(
        dir.path(),
        &cfg,
        &half,
        &["--max-steps", "2", "--set", "checkpoint.keep=20"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(checkpoints(&half), before, "{}", stderr(&o));
}

/// An evaluation that fits at no size (after step 1's update) ends the run with exit 3 and a
/// checkpoint of the state it holds, step 2's: resumed, the run ends bitwise where an
/// uninterrupted one does (a checkpoint named step 1 would apply step 1 twice).
#[test]
fn an_evaluation_that_fits_nowhere_checkpoints_the_updated_state() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY.replace("eval_every: 0", "eval_every: 2");
    let cfg = write_config(dir.path(), "tiny.yaml", &yaml);
    let full = train_into(dir.path(), &cfg, "full", &[]);
    let run = dir.path().join("run");
    // Every evaluation attempt at step 1 fails: 8, 4, 2, 1 and on.
    let o = isolated(&mut Command::new(bin()), dir.path())
        .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
        .env("OMP_NUM_THREADS", "1")
        .env("OOMGUARD_TEST_OOM_IN", ["eval:0:1"; 8].join(","))
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let names: Vec<String> = checkpoints(&run)
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["step-00000002"], "{}", stderr(&o));
    let o = resume(dir.path(), &cfg, &run, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(records(&run, "resumed")[0]["step"], 2);
    assert_same_weights(&full, &run);
}

/// SIGTERM mid-run: a checkpoint at the next step boundary, metrics flushed, exit 143;
/// resuming finishes with exactly the parameters of an uninterrupted run.
#[test]
fn sigterm_then_resume() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", &TINY.replace("max_steps: 6", "max_steps: 300"));
    let run = dir.path().join("run");
    let mut child = spawn(dir.path(), &cfg, &run, &[]);
    wait_for_steps(&run, 20, &mut child);
    signal(&child, "-TERM");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert!(err.contains("stopped by SIGTERM"), "{err}");
    let stopped = records(&run, "stopped");
    assert_eq!(stopped.len(), 1);
    assert_eq!(checkpoints(&run).len(), 1);
    let steps_done = records(&run, "step").len();
    assert!(steps_done < 300);
    assert_eq!(stopped[0]["step"].as_u64().unwrap() as usize, steps_done - 1);

    let o = resume(dir.path(), &cfg, &run, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::rename(&run, dir.path().join("stopped")).unwrap();
    let run = dir.path().join("stopped");
    let whole = train_ok(dir.path(), &cfg, &[]);
    assert_same_weights(&whole, &run);
    assert_eq!(step_fields(&whole), step_fields(&run));
}

/// Steps of about two seconds on this machine, a checkpoint after each.
fn slow_steps(dir: &Path) -> PathBuf {
    let yaml = TINY
        .replace("n_embd: 32, block_size: 32", "n_embd: 256, block_size: 256")
        .replace("embedded_bytes: 65536", "embedded_bytes: 262144")
        .replace("max_steps: 6", "max_steps: 100")
        .replace(
            "micro_batch_size: 8, grad_accum_steps: 2",
            "micro_batch_size: 16, grad_accum_steps: 8",
        )
        + "checkpoint: {every_steps: 1}\n";
    write_config(dir, "slow.yaml", &yaml)
}

/// A second signal exits at once (no checkpoint, no "stopped" record), and what was on disk
/// is intact: the run resumes from its last periodic checkpoint.
#[test]
fn second_signal_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    // The second signal lands inside the step the first came in.
    let cfg = slow_steps(dir.path());
    let run = dir.path().join("run");
    let mut child = spawn(dir.path(), &cfg, &run, &[]);
    wait_for_steps(&run, 2, &mut child);
    // Past step 2's checkpoint (a slow disk or a busy machine can take longer than a step to
    // write it: a signal inside the write would stop the run before the second arrives),
    // then inside step 3.
    let written = run.join("checkpoints/step-00000002");
    let t = std::time::Instant::now();
    while !written.exists() && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    signal(&child, "-INT");
    // Past the 0.5 s in which a repeat is the same signal delivered twice.
    std::thread::sleep(Duration::from_millis(700));
    signal(&child, "-INT");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        records(&run, "stopped").is_empty(),
        "the second signal should not wait for the checkpoint"
    );
    // Shorter, on the same schedule.
    let o = resume(
        dir.path(),
        &cfg,
        &run,
        &["--max-steps", "3", "--set", "optim.decay_steps=100"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
}

/// "resumed" records ever written. Counted in both files (a resume from the same
/// checkpoint moves the previous one to metrics.replaced.jsonl), line by line: a kill can
/// leave a torn last line.
/// Slurm's `--signal=TERM@120` reaches every process of the job step: the launcher, which
/// forwards it to its worker, and the worker itself. The worker takes the two as one request:
/// it finishes the step, checkpoints and records the stop; the launcher exits 143.
#[test]
fn a_signal_to_the_launcher_and_its_worker_alike_stops_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = slow_steps(dir.path());
    let run = dir.path().join("run");
    let bin = common::bin();
    let launch = ["launch", "--nproc-per-node", "1", "--no-python", bin.to_str().unwrap()];
    let mut launcher = spawn_with(dir.path(), &launch, &cfg, &run, &[]);
    wait_for_steps(&run, 1, &mut launcher);
    // The launcher's child is the worker's shim; the worker is the shim's child.
    let child_of = |pid: &str| {
        let o = Command::new("pgrep").args(["-P", pid]).output().unwrap();
        let c = String::from_utf8_lossy(&o.stdout).trim().to_string();
        assert!(!c.is_empty() && !c.contains('\n'), "one child of {pid}: {c:?}");
        c
    };
    let shim = child_of(&launcher.id().to_string());
    let worker = child_of(&shim);
    // Inside step 1 (past step 0's checkpoint), so the launcher's forward comes mid-step.
    std::thread::sleep(Duration::from_millis(500));
    // The worker (and its shim) first, as Slurm's signal reaches them before the launcher's
    // forward does.
    assert!(Command::new("kill")
        .args(["-TERM", &worker, &shim])
        .status()
        .unwrap()
        .success());
    signal(&launcher, "-TERM");
    let out = launcher.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert_eq!(records(&run, "stopped").len(), 1, "{err}");
    let stopped = records(&run, "stopped")[0]["step"].as_u64().unwrap();
    assert!(
        run.join(format!("checkpoints/step-{:08}", stopped + 1)).is_dir(),
        "{err}"
    );
}

fn resumes(run: &Path) -> usize {
    ["metrics.jsonl", "metrics.replaced.jsonl"]
        .iter()
        .map(|f| {
            std::fs::read_to_string(run.join(f))
                .unwrap_or_default()
                .matches("\"event\":\"resumed\"")
                .count()
        })
        .sum()
}

/// kill -9 at 20 random instants while checkpoints are being written (every step) never
/// leaves the run unresumable: each kill is followed by a resume that must start.
#[test]
fn kill_9_during_checkpoint_writes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "tiny.yaml",
        &(TINY.replace("max_steps: 6", "max_steps: 100000") + "checkpoint: {every_steps: 1, keep: 2}\n"),
    );
    let run = dir.path().join("run");
    let mut child = spawn(dir.path(), &cfg, &run, &[]);
    wait_for_steps(&run, 3, &mut child);
    let mut rng = 0x5EEDu64;
    for i in 0..20 {
        rng = oomguard::rng::splitmix64(rng);
        std::thread::sleep(Duration::from_millis(20 + rng % 180));
        assert!(
            child.try_wait().unwrap().is_none(),
            "kill {i}: the resumed run had already exited: {:?}",
            child
                .wait_with_output()
                .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
        );
        signal(&child, "-KILL");
        child.wait().unwrap();
        // It must get through start-up (checkpoint verified and loaded) to training again.
        let before = resumes(&run);
        child = spawn(dir.path(), &cfg, &run, &["--resume"]);
        let t = Instant::now();
        while resumes(&run) == before {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "kill {i}: resume failed ({status}): {}",
                    String::from_utf8_lossy(&child.wait_with_output().unwrap().stderr)
                );
            }
            assert!(t.elapsed() < Duration::from_secs(30));
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    signal(&child, "-KILL");
    child.wait().unwrap();
    assert!(checkpoints(&run).len() <= 3);
}

/// Files in `run` (not in folders) whose names start with a dot: temporary files.
fn hidden_files(run: &Path) -> Vec<String> {
    std::fs::read_dir(run)
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

/// A corrupt or truncated checkpoint is named; --resume falls back to the newest valid one.
/// Each checkpoint is written and logged once (the last periodic one is the final one), and
/// what a killed writer leaves behind is cleared on resume.
#[test]
fn corrupt_and_truncated_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "tiny.yaml",
        // decay_steps pinned: the resumes below run on to step 8 on the same schedule.
        &(TINY.replace("warmup_steps: 2}", "warmup_steps: 2, decay_steps: 8}")
            + "checkpoint: {every_steps: 2, keep: 3}\n"),
    );
    let run = dir.path().join("run");
    let o = train_at(dir.path(), &cfg, &run, &[]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let ckpts = checkpoints(&run);
    assert_eq!(
        ckpts
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
            .collect::<Vec<_>>(),
        ["step-00000002", "step-00000004", "step-00000006"]
    );
    for c in &ckpts {
        assert_eq!(
            err.matches(&format!("checkpoint {} (", c.display())).count(),
            1,
            "{err}"
        );
    }
    assert_eq!(
        hidden_files(&run),
        Vec::<String>::new(),
        "every file is renamed into place"
    );

    // Flip a byte in the newest optimizer state; truncate the next one's weights.
    let opt = ckpts[2].join("optimizer.safetensors");
    let mut bytes = std::fs::read(&opt).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xFF;
    std::fs::write(&opt, bytes).unwrap();
    let model = ckpts[1].join("model.safetensors");
    let len = std::fs::metadata(&model).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap()
        .set_len(len / 2)
        .unwrap();

    for (ckpt, named) in [
        (&ckpts[2], "step-00000006/optimizer.safetensors: corrupt"),
        (&ckpts[1], "step-00000004/model.safetensors: truncated"),
    ] {
        let o = oomguard(
            &[
                "train",
                cfg.to_str().unwrap(),
                "--resume-from",
                ckpt.to_str().unwrap(),
                "--max-steps",
                "8",
            ],
            dir.path(),
        );
        assert_eq!(o.status.code(), Some(2));
        assert!(stderr(&o).contains(named), "{}", stderr(&o));
    }

    // A final weights file a kill interrupted mid-write: the temporary file, never the real one.
    std::fs::write(run.join(".model.safetensors.99999.tmp"), b"half a file").unwrap();
    let o = resume(dir.path(), &cfg, &run, &["--max-steps", "8"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(hidden_files(&run), Vec::<String>::new());
    assert!(
        err.contains("skipping checkpoint") && err.contains("resumed from") && err.contains("step-00000002 at step 2"),
        "{err}"
    );
    // The resumed run replaced steps 2.. and kept the earlier records.
    assert_eq!(
        records(&run, "step")
            .iter()
            .map(|r| r["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
    assert!(run.join("metrics.replaced.jsonl").is_file());
    // Passing steps 4 and 6 again, it replaced the truncated and the corrupt checkpoints
    // there (atomically): both load now.
    for ckpt in &ckpts[1..] {
        let o = oomguard(
            &[
                "train",
                cfg.to_str().unwrap(),
                "--resume-from",
                ckpt.to_str().unwrap(),
                "--max-steps",
                "8",
            ],
            dir.path(),
        );
        assert!(o.status.success(), "{}", stderr(&o));
    }
}

/// state.json carries a CRC32 of its own: a manifest changed on disk and still valid JSON (its
/// `next_step` edited, as a flipped digit would) is refused by name (exit 2), and `--resume`
/// falls back to the newest checkpoint that verifies.
#[test]
fn a_changed_state_json_is_refused_by_its_own_crc() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "tiny.yaml",
        &(TINY.replace("warmup_steps: 2}", "warmup_steps: 2, decay_steps: 6}")
            + "checkpoint: {every_steps: 2, keep: 3}\n"),
    );
    let run = dir.path().join("run");
    let o = train_at(dir.path(), &cfg, &run, &["--max-steps", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpts = checkpoints(&run);
    let manifest = ckpts[1].join("state.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    assert!(text.contains("\"manifest_crc32\""), "{text}");
    std::fs::write(&manifest, text.replace("\"next_step\": 4", "\"next_step\": 5")).unwrap();
    let o = oomguard(
        &[
            "train",
            cfg.to_str().unwrap(),
            "--resume-from",
            ckpts[1].to_str().unwrap(),
            "--max-steps",
            "6",
        ],
        dir.path(),
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("step-00000004/state.json: corrupt: its own CRC32 (manifest_crc32) does not match"),
        "{}",
        stderr(&o)
    );
    let o = resume(dir.path(), &cfg, &run, &["--max-steps", "6"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("skipping checkpoint") && err.contains("step-00000002 at step 2"),
        "{err}"
    );
}

/// The best checkpoint by evaluation loss survives a resume: its loss is in the
/// checkpoint's state, not only in the memory of the run that measured it.
#[test]
fn keep_best_across_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY
        .replace("max_steps: 6, eval_every: 0", "max_steps: 4, eval_every: 2")
        .replace("warmup_steps: 2}", "warmup_steps: 2, decay_steps: 40}")
        + "checkpoint: {every_steps: 2, keep: 1, keep_best: true}\n";
    let cfg = write_config(dir.path(), "tiny.yaml", &yaml);
    let run = train_ok(dir.path(), &cfg, &[]);
    let best_before = records(&run, "eval")
        .iter()
        .map(|e| e["val_loss"].as_f64().unwrap())
        .fold(f64::MAX, f64::min);
    // Resumed with a learning rate that wrecks the model: every later evaluation is worse.
    let o = resume(
        dir.path(),
        &cfg,
        &run,
        &[
            "--max-steps",
            "10",
            "--set",
            "optim.lr=50.0",
            "--set",
            "optim.min_lr=50.0",
            "--allow-change",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let later: Vec<f64> = records(&run, "eval")
        .iter()
        .filter(|e| e["step"].as_u64().unwrap() >= 4)
        .map(|e| e["val_loss"].as_f64().unwrap())
        .collect();
    assert!(later.iter().all(|&l| l > best_before), "{later:?} vs {best_before}");
    let names: Vec<String> = checkpoints(&run)
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    assert_eq!(
        names,
        ["step-00000004", "step-00000010"],
        "the newest and the best (step 4, from before the resume)"
    );
}

/// `micro_batch_size: auto` ran before step 0; a resumed run keeps its record in
/// metrics.jsonl (it does not search again).
#[test]
fn auto_micro_batch_record_survives_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY
        .replace(
            "micro_batch_size: 8, grad_accum_steps: 2",
            "micro_batch_size: auto, global_batch_size: 16",
        )
        .replace("warmup_steps: 2}", "warmup_steps: 2, decay_steps: 6}");
    let cfg = write_config(dir.path(), "auto.yaml", &yaml);
    let run = train_ok(dir.path(), &cfg, &["--max-steps", "3", "--memory-budget", "64MiB"]);
    let o = resume(dir.path(), &cfg, &run, &["--memory-budget", "64MiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(records(&run, "auto_micro_batch").len(), 1);
    let replaced = std::fs::read_to_string(run.join("metrics.replaced.jsonl")).unwrap_or_default();
    assert!(!replaced.contains("auto_micro_batch"), "{replaced}");
}

#[test]
fn changed_model_shape_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    let run = train_ok(dir.path(), &cfg, &["--max-steps", "2"]);
    // Accepted as a config change (--allow-change), the checkpoint's shape still refuses it.
    let extra = ["--set", "model.n_layer=3", "--set", "model.n_embd=64", "--allow-change"];
    let o = resume(dir.path(), &cfg, &run, &extra);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("the model's shape changed since this checkpoint: model.n_layer: 2 in the checkpoint, 3 in the config; model.n_embd: 32 in \
        the checkpoint, 64 in the config"), "{err}");
}

/// What a run directory holds that a resume could change: its checkpoints' names, its records
/// and its config files.
fn run_files(run: &Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| (e.unwrap().file_name().to_string_lossy().into_owned(), String::new()))
        .collect();
    for e in std::fs::read_dir(run).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if name.starts_with("config") || name.starts_with("metrics") {
            out.push((name.clone(), std::fs::read_to_string(run.join(&name)).unwrap()));
        }
    }
    out.sort();
    out
}

/// A resume refused or failing before its first step leaves the run as it was: no checkpoint
/// pruned, no record set aside, its config files untouched (a refused `--resume-from` of an
/// older checkpoint deleted the newer ones and rewrote config.yaml, so no resume worked after
/// it). A copied or renamed checkpoint (its name's step not its state's) is skipped by
/// `--resume`; another run's checkpoint into a run with checkpoints of its own is refused.
#[test]
fn a_refused_or_failed_resume_leaves_the_run_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    // Checkpoints at steps 2 and 4 of a schedule 6 steps long.
    let ckpt = ["--set", "checkpoint.every_steps=2", "--set", "optim.decay_steps=6"];
    let run = train_ok(dir.path(), &cfg, &[&["--max-steps", "4"], &ckpt[..]].concat());
    let before = run_files(&run);
    assert!(before.iter().any(|(n, _)| n == "step-00000004"), "{before:?}");
    let older = run.join("checkpoints/step-00000002");
    let (r, o) = (run.to_str().unwrap(), older.to_str().unwrap());
    // The model's shape changed: refused, after --allow-change accepted the config change.
    let shape = ["--set", "model.n_layer=3", "--allow-change"];
    let out = oomguard(
        &[&["train", "--run-dir", r, "--resume-from", o], &shape[..]].concat(),
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("the model's shape changed"), "{}", stderr(&out));
    assert_eq!(run_files(&run), before);
    // A free config change, and every checkpoint corrupt: exit 2, and the config unchanged.
    let broken = dir.path().join("broken");
    copy_dir(&run, &broken);
    for s in ["step-00000002", "step-00000004"] {
        std::fs::write(broken.join("checkpoints").join(s).join("model.safetensors"), b"garbage").unwrap();
    }
    let was = run_files(&broken);
    let free = [&["--max-steps", "4", "--set", "log.every=3"], &ckpt[..]].concat();
    let out = resume(dir.path(), &cfg, &broken, &free);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("no valid checkpoint"), "{}", stderr(&out));
    assert_eq!(run_files(&broken), was, "{}", stderr(&out));
    // Another run's checkpoint into this run: refused, naming both.
    let other = train_into(
        dir.path(),
        &cfg,
        "other",
        &[&["--max-steps", "2", "--set", "train.seed=99"], &ckpt[..]].concat(),
    );
    let theirs = other.join("checkpoints/step-00000002");
    let out = oomguard(
        &["train", "--run-dir", r, "--resume-from", theirs.to_str().unwrap()],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("is a checkpoint of another run"),
        "{}",
        stderr(&out)
    );
    assert_eq!(run_files(&run), before);
    // Branched into a new directory, with that run's config; the same command started again
    // by the launcher once the branch saved continues the branch, not the fork again.
    let branch = dir.path().join("branch");
    let mut cmd = vec!["train", cfg.to_str().unwrap(), "--run-dir", branch.to_str().unwrap()];
    cmd.extend(["--set", "train.seed=99"]);
    cmd.extend(ckpt);
    let again_from = |from: &Path, max: &str, restart: &str| {
        let o = isolated(&mut Command::new(bin()), dir.path())
            .args(&cmd)
            .args(["--resume-from", from.to_str().unwrap(), "--max-steps", max])
            .env("OMP_NUM_THREADS", "1")
            .env("TORCHELASTIC_RESTART_COUNT", restart)
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        records(&branch, "resumed").last().unwrap()["step"].clone()
    };
    let again = |max: &str, restart: &str| again_from(&theirs, max, restart);
    assert_eq!(again("4", "0"), 2);
    assert_eq!(again("6", "1"), 4, "the branch's own newest");
    assert_eq!(
        again("8", "2"),
        6,
        "a later restart: the branch's newest again, not the fork"
    );
    // The branch forked again at step 4 by a restart whose first attempt died before it pruned
    // steps 6 and 8 (the future it leaves, whose checkpoints say they forked from `theirs`):
    // the restart forks from step 4 again instead of going on from that future.
    assert_eq!(again_from(&branch.join("checkpoints/step-00000004"), "6", "1"), 4);
    assert_eq!(
        again_from(&branch.join("checkpoints/step-00000004"), "8", "2"),
        6,
        "and then the new fork's own"
    );
    // A copy of step 2 named step 8: skipped; the run goes on from step 4, bitwise as before.
    copy_dir(&older, &run.join("checkpoints/step-00000008"));
    let out = resume(dir.path(), &cfg, &run, &[&["--max-steps", "6"], &ckpt[..]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("holds step 2, not the 8 its name says"),
        "{}",
        stderr(&out)
    );
    assert_eq!(records(&run, "resumed")[0]["step"], 4);
    assert!(run.join("checkpoints/step-00000006").is_dir());
    // On to step 8 (the copy went with the future the resume from 4 dropped): the next
    // resume starts at the run's own step 8.
    let out = resume(dir.path(), &cfg, &run, &[&["--max-steps", "8"], &ckpt[..]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let out = resume(dir.path(), &cfg, &run, &[&["--max-steps", "9"], &ckpt[..]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(records(&run, "resumed").last().unwrap()["step"], 8);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}
