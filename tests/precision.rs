//! The rungs below micro-batch 1, through the binary: bf16 autocast on the CPU, fp16 with
//! GradScaler's loss scaling (backoff, growth, exact resume), activation checkpointing, the
//! guard climbing to them by itself when even one sample does not fit, and the precision a
//! resumed run keeps. Peaks are the counting allocator's.
mod common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A GPT whose activations dominate its memory: 6 layers, 128-token windows.
const DEEP: &str = "
model: {n_layer: 6, n_head: 2, n_embd: 32, block_size: 128, vocab_size: 256}
data: {source: embedded, embedded_bytes: 131072}
optim: {lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 2, decay_steps: 40}
train: {micro_batch_size: 4, grad_accum_steps: 1, max_steps: 4, eval_every: 0, eval_batch_size: 4, eval_batches: 1, seed: 11, device: cpu, num_threads: 1}
log: {every: 1}
";

fn run(dir: &Path, cfg: &Path, name: &str, extra: &[&str]) -> PathBuf {
    train_into(dir, cfg, name, extra)
}

fn peak(run: &Path) -> u64 {
    records(run, "step")
        .iter()
        .map(|s| s["memory"]["peak_bytes"].as_u64().unwrap())
        .max()
        .unwrap()
}

#[test]
fn bf16_on_the_cpu_stays_close_to_fp32() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", &TINY.replace("max_steps: 6", "max_steps: 20"));
    let fp32 = run(dir.path(), &cfg, "fp32", &[]);
    let bf16 = run(dir.path(), &cfg, "bf16", &["--set", "train.precision=bf16"]);
    assert!(
        records(&bf16, "step").iter().all(|s| s["precision"] == "bf16")
            && records(&fp32, "step")[0]["precision"] == "fp32"
    );
    let (a, b) = (losses(&fp32), losses(&bf16));
    for (s, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() / x < 0.02, "step {s}: fp32 {x}, bf16 {y}");
    }
    assert!(b[19] < 0.8 * b[0], "bf16 learns: {b:?}");
}

/// fp16 trains the GPT: its loss falls as fp32's does.
#[test]
fn fp16_trains_with_a_loss_scale() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", &TINY.replace("max_steps: 6", "max_steps: 12"));
    let r = run(dir.path(), &cfg, "fp16", &["--set", "train.precision=fp16"]);
    assert!(records(&r, "step").iter().all(|s| s["precision"] == "fp16"));
    let l = losses(&r);
    assert!(l[11] < 0.85 * l[0], "{l:?}");
}

/// tests/scripts/ts_scaled.py's MLP, its loss times `multiplier`, trained in fp16 with
/// `grad_scaler` (a flow mapping's contents): (config, the initial weights).
fn scaled_model(dir: &Path, multiplier: &str, grad_scaler: &str) -> (PathBuf, PathBuf) {
    let [model, init, data] = ["scaled.pt", "init.safetensors", "scaled.safetensors"].map(|f| dir.join(f));
    python(&[
        &script("tests/scripts/ts_scaled.py"),
        "--out",
        model.to_str().unwrap(),
        "--init",
        init.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--multiplier",
        multiplier,
    ]);
    let cfg = write_config(dir, "scaled.yaml", &format!("
model: {{kind: torchscript, path: scaled.pt}}
data: {{source: tensors, path: scaled.safetensors, val_fraction: 0.2}}
optim: {{lr: 1.0e-2, warmup_steps: 2, decay_steps: 8}}
train: {{micro_batch_size: 32, grad_accum_steps: 1, max_steps: 8, eval_every: 0, eval_batch_size: 32, eval_batches: 1, seed: 3, device: cpu, \
    num_threads: 1, precision: fp16, grad_scaler: {{{grad_scaler}}}}}
"));
    (cfg, init)
}

fn scales(run: &Path) -> Vec<f64> {
    records(run, "step")
        .iter()
        .map(|s| s["loss_scale"].as_f64().unwrap())
        .collect()
}

/// GradScaler's backoff: a loss multiplied by 1e12 overflows fp16's backward at every step,
/// so each step is skipped (`skipped: true`, the parameters exactly the initial ones) and the
/// scale halves from GradScaler's 65536 each time.
#[test]
fn fp16_overflow_skips_the_step_and_halves_the_scale() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, init) = scaled_model(dir.path(), "1e12", "");
    let r = dir.path().join("r");
    let o = train_at(dir.path(), &cfg, &r, &["--max-steps", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("step 0: fp16 gradients overflowed: update skipped, loss scale now 32768"),
        "{}",
        stderr(&o)
    );
    let steps = records(&r, "step");
    assert!(
        steps.iter().all(|s| s["precision"] == "fp16" && s["skipped"] == true),
        "{steps:?}"
    );
    assert_eq!(scales(&r), [32768.0, 16384.0, 8192.0, 4096.0]);
    assert_eq!(
        max_abs_diff(&weights(&r), &safetensors(&init)),
        0.0,
        "a skipped step moved the parameters"
    );
}

/// GradScaler's growth: with `growth_interval: 3` the scale doubles after every third clean
/// step in a row. The scale and the growth tracker are checkpointed: stopped after 5 steps
/// (two clean ones since the last growth) and resumed, the next growth comes one step
/// later, as in the uninterrupted run, and the parameters are bitwise that run's.
#[test]
fn fp16_scale_grows_every_growth_interval_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _) = scaled_model(dir.path(), "1.0", "init_scale: 1024, growth_interval: 3");
    let full = run(dir.path(), &cfg, "full", &[]);
    let expected = [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0, 4096.0, 4096.0];
    assert_eq!(scales(&full), expected);
    assert!(records(&full, "step").iter().all(|s| s.get("skipped").is_none()));

    let half = run(dir.path(), &cfg, "half", &["--max-steps", "5"]);
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(half.join("checkpoints/step-00000005/state.json")).unwrap())
            .unwrap();
    assert_eq!(
        (
            state["extra"]["loss_scale"].as_f64(),
            state["extra"]["growth_tracker"].as_i64()
        ),
        (Some(2048.0), Some(2)),
        "{}",
        state["extra"]
    );
    let o = resume(dir.path(), &cfg, &half, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(scales(&half), expected);
    assert_eq!(
        max_abs_diff(&weights(&full), &weights(&half)),
        0.0,
        "fp16 resume is not exact"
    );
}

/// A resumed run keeps the precision its checkpoint recorded (a rung it climbed, here a
/// first run in bf16), saying so; `--set train.precision` on the resuming command wins,
/// with a notice. Both are in the `resumed` events.
#[test]
fn resume_keeps_the_checkpoints_precision_unless_set() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "tiny.yaml",
        &TINY.replace("warmup_steps: 2}", "warmup_steps: 2, decay_steps: 6}"),
    );
    let r = run(
        dir.path(),
        &cfg,
        "r",
        &["--max-steps", "2", "--set", "train.precision=bf16"],
    );
    let resume = |extra: &[&str]| {
        let mut args = vec![
            "train",
            cfg.to_str().unwrap(),
            "--run-dir",
            r.to_str().unwrap(),
            "--resume",
        ];
        args.extend_from_slice(extra);
        let o = oomguard(&args, dir.path());
        assert!(o.status.success(), "{}", stderr(&o));
        stderr(&o)
    };
    let err = resume(&["--max-steps", "4"]);
    assert!(err.contains("precision bf16, as in the checkpoint (train.precision says fp32); --set train.precision=fp32 on this command to change it"), "{err}");
    let err = resume(&["--set", "train.precision=fp32"]);
    assert!(
        err.contains("precision fp32: --set train.precision wins over the checkpoint's bf16"),
        "{err}"
    );

    let precisions: Vec<String> = records(&r, "step")
        .iter()
        .map(|s| s["precision"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(precisions, ["bf16", "bf16", "bf16", "bf16", "fp32", "fp32"]);
    let resumed: Vec<Value> = records(&r, "resumed")
        .iter()
        .map(|e| {
            serde_json::json!([
                e["step"],
                e["precision"],
                e["precision_from"],
                e["checkpoint_precision"]
            ])
        })
        .collect();
    assert_eq!(
        resumed,
        [
            serde_json::json!([2, "bf16", "checkpoint", "bf16"]),
            serde_json::json!([4, "fp32", "--set", "bf16"])
        ]
    );
}

/// Peak memory falls with each rung: activation checkpointing, bf16, and both.
#[test]
fn each_rung_lowers_peak_memory() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "deep.yaml", DEEP);
    let one = ["--max-steps", "2", "--memory-budget", "none"];
    let with = |name: &str, sets: &[&str]| {
        let mut args: Vec<&str> = one.to_vec();
        for s in sets {
            args.extend(["--set", s]);
        }
        peak(&run(dir.path(), &cfg, name, &args))
    };
    let fp32 = with("fp32", &[]);
    let ckpt = with("ckpt", &["model.activation_checkpointing=blocks"]);
    let bf16 = with("bf16", &["train.precision=bf16"]);
    let both = with(
        "both",
        &["model.activation_checkpointing=blocks", "train.precision=bf16"],
    );
    println!("peak bytes: fp32 {fp32}, checkpointing {ckpt}, bf16 {bf16}, both {both}");
    assert!(ckpt < fp32 * 8 / 10, "checkpointing: {ckpt} vs {fp32}");
    assert!(bf16 < fp32 * 9 / 10, "bf16: {bf16} vs {fp32}");
    assert!(both < ckpt && both < bf16, "both: {both}");
}

/// A budget in which micro-batch 1 does not fit in fp32: the guard turns activation
/// checkpointing on by itself (recorded), and the run ends with the parameters of a plain
/// run (checkpointing is exact). Tighter still, it also falls back to bf16. A resumed run
/// keeps the rungs.
#[test]
fn the_guard_climbs_down_the_rungs_when_one_sample_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    // Wide blocks, so that bf16 still saves memory once blocks are recomputed.
    let yaml = DEEP
        .replace("micro_batch_size: 4", "micro_batch_size: 1")
        .replace("grad_accum_steps: 1", "grad_accum_steps: 4")
        .replace(
            "n_layer: 6, n_head: 2, n_embd: 32, block_size: 128",
            "n_layer: 3, n_head: 4, n_embd: 64, block_size: 256",
        )
        .replace("embedded_bytes: 131072", "embedded_bytes: 262144");
    let cfg = write_config(dir.path(), "wide.yaml", &yaml);
    let one = |name: &str, sets: &[&str]| {
        let mut args = vec!["--max-steps", "2", "--memory-budget", "none"];
        for s in sets {
            args.extend(["--set", s]);
        }
        peak(&run(dir.path(), &cfg, name, &args))
    };
    let (p_plain, p_ckpt, p_both) = (
        one("p", &[]),
        one("c", &["model.activation_checkpointing=blocks"]),
        one("b", &["model.activation_checkpointing=blocks", "train.precision=bf16"]),
    );
    assert!(p_both < p_ckpt && p_ckpt < p_plain);

    let plain = run(dir.path(), &cfg, "plain", &["--memory-budget", "none"]);
    let budget = ((p_ckpt + p_plain) / 2).to_string();
    let climbed = run(
        dir.path(),
        &cfg,
        "climbed",
        &["--memory-budget", &budget, "--max-steps", "2"],
    );
    let rungs: Vec<Value> = records(&climbed, "rung");
    assert_eq!(rungs.len(), 1, "{rungs:?}");
    assert_eq!(
        (rungs[0]["rung"].as_str(), rungs[0]["step"].as_u64()),
        (Some("activation_checkpointing"), Some(0))
    );
    assert!(records(&climbed, "step")
        .iter()
        .all(|s| s["activation_checkpointing"] == true && s["precision"] == "fp32"));
    let o = resume(dir.path(), &cfg, &climbed, &["--memory-budget", &budget]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("activation checkpointing"),
        "the resumed run keeps the rung: {}",
        stderr(&o)
    );
    assert_eq!(records(&climbed, "rung").len(), 1, "no second climb after the resume");
    let d = max_abs_diff(&weights(&plain), &weights(&climbed));
    assert!(d < 1e-5, "checkpointing changed the parameters by {d}");

    let budget = ((p_both + p_ckpt) / 2).to_string();
    let both = run(
        dir.path(),
        &cfg,
        "both",
        &["--memory-budget", &budget, "--max-steps", "2"],
    );
    let rungs: Vec<String> = records(&both, "rung")
        .iter()
        .map(|r| r["rung"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(rungs, ["activation_checkpointing", "bf16"]);
    assert!(records(&both, "step").iter().all(|s| s["precision"] == "bf16"));
}
