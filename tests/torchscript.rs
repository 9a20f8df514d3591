//! A PyTorch model, trained by oomguard: modules exported with torch.jit.script by the set-up's
//! Python, trained through the binary, and checked against eager PyTorch on the same weights
//! and samples (tests/scripts/ts_reference.py).
mod common;
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// examples/torchscript/mu_sota.py's model (block 32) and a text corpus, with a config.
fn mu_sota(dir: &Path, extra: &str) -> PathBuf {
    python(&[
        &script("examples/torchscript/mu_sota.py"),
        "--out",
        dir.join("model.pt").to_str().unwrap(),
        "--block-size",
        "32",
    ]);
    let text: String = (0..600)
        .map(|i| format!("{} little birds sang {} songs at dawn.\n", i % 17, (i * 7) % 13))
        .collect();
    std::fs::write(dir.join("corpus.txt"), text).unwrap();
    write_config(dir, "ts.yaml", &format!("
model: {{kind: torchscript, path: model.pt, block_size: 32}}
data: {{source: text, path: corpus.txt, val_fraction: 0.1}}
optim: {{lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 3, decay_steps: 30, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1.0e-8, grad_clip: 1.0}}
train: {{micro_batch_size: 8, grad_accum_steps: 1, max_steps: 30, eval_every: 0, eval_batch_size: 8, eval_batches: 2, seed: 5, device: cpu, num_threads: 1}}
log: {{every: 10}}
{extra}"))
}

fn reference(dir: &Path, mode: &str, model: &str, weights: &Path, config: Value) -> Value {
    let out = python(&[
        &script("tests/scripts/ts_reference.py"),
        mode,
        "--model",
        model,
        "--config",
        &config.to_string(),
        "--weights",
        weights.to_str().unwrap(),
    ]);
    let _ = dir;
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

/// The run's last evaluation loss equals the Python reference's with the run's final
/// model.safetensors, within 1e-5; returns the reference's answer.
fn same_eval_as_python(dir: &Path, model: &str, run: &Path, config: Value) -> Value {
    let ours = records(run, "eval").last().unwrap()["val_loss"].as_f64().unwrap();
    let py = reference(dir, "eval", model, &run.join("model.safetensors"), config);
    let theirs = py["val_loss"].as_f64().unwrap();
    assert!(
        (ours - theirs).abs() < 1e-5,
        "eval loss: oomguard {ours}, Python with model.safetensors {theirs}"
    );
    py
}

fn mu_sota_reference_config(dir: &Path, steps: u64) -> Value {
    json!({"data": dir.join("corpus.txt"), "block": 32, "val_fraction": 0.1, "seed": 5, "global_batch": 8, "steps": steps,
           "lr": 3e-3, "min_lr": 3e-4, "warmup": 3, "decay_steps": 30, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
           "eps": 1e-8, "grad_clip": 1.0, "eval_batch": 8, "eval_batches": 2})
}

fn run(dir: &Path, cfg: &Path, name: &str, extra: &[&str]) -> PathBuf {
    train_into(dir, cfg, name, extra)
}

/// It trains (its loss falls), its first 5 losses are eager PyTorch's to 1e-5, and the weights
/// it saves load into the Python module with strict=True and give the same eval loss there.
#[test]
fn trains_like_eager_pytorch_and_its_weights_load_in_python() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = mu_sota(dir.path(), "");
    let r = run(dir.path(), &cfg, "run", &[]);
    let ours = losses(&r);
    let eager = reference(
        dir.path(),
        "train",
        "mu_sota",
        &dir.path().join("model.pt"),
        mu_sota_reference_config(dir.path(), 5),
    );
    let eager: Vec<f64> = serde_json::from_value(eager["losses"].clone()).unwrap();
    for (s, (a, b)) in ours.iter().zip(&eager).enumerate() {
        assert!(
            (a - b).abs() < 1e-5,
            "step {s}: oomguard {a}, eager PyTorch {b}\n{ours:?}\n{eager:?}"
        );
    }
    let (head, tail) = (
        ours[..3].iter().sum::<f64>() / 3.0,
        ours[27..].iter().sum::<f64>() / 3.0,
    );
    assert!(tail < 0.8 * head, "loss did not fall: {head} -> {tail}");

    let py = same_eval_as_python(dir.path(), "mu_sota", &r, mu_sota_reference_config(dir.path(), 0));
    assert!(py["load"].as_str().unwrap().contains("All keys matched"), "{py}");
}

/// Under a budget the scripted forward runs out of memory, the guard halves the micro-batch,
/// and the run ends with the parameters of a run without the budget.
#[test]
fn an_oom_inside_the_scripted_model_is_recovered_with_the_same_result() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = mu_sota(dir.path(), "");
    let peak = |micro: usize| {
        let r = run(
            dir.path(),
            &cfg,
            &format!("m{micro}"),
            &[
                "--max-steps",
                "1",
                "--memory-budget",
                "none",
                "--set",
                &format!("train.micro_batch_size={micro}"),
                "--set",
                &format!("train.grad_accum_steps={}", 8 / micro),
            ],
        );
        records(&r, "step")[0]["memory"]["peak_bytes"].as_u64().unwrap()
    };
    let budget = ((peak(4) + peak(8)) / 2).to_string();
    let free = run(
        dir.path(),
        &cfg,
        "free",
        &["--max-steps", "6", "--memory-budget", "none"],
    );
    let guarded = run(
        dir.path(),
        &cfg,
        "guarded",
        &[
            "--max-steps",
            "6",
            "--memory-budget",
            &budget,
            "--set",
            "memory.cooldown_steps=1000",
        ],
    );
    let ooms: Vec<Value> = records(&guarded, "oom")
        .into_iter()
        .filter(|e| e["phase"] != "eval")
        .collect();
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    assert_eq!(
        (
            ooms[0]["old_micro_batch_size"].as_u64(),
            ooms[0]["new_micro_batch_size"].as_u64()
        ),
        (Some(8), Some(4))
    );
    assert!(
        ooms[0]["message"]
            .as_str()
            .unwrap()
            .contains("oomguard memory budget exceeded"),
        "{}",
        ooms[0]
    );
    assert_eq!(ooms[0]["memory_before"], ooms[0]["memory_after_cleanup"]);
    assert!(records(&guarded, "step")
        .iter()
        .all(|s| s["num_samples"] == 8 && s["micro_batch_size"] == 4));
    let d = max_abs_diff(&weights(&free), &weights(&guarded));
    assert!(d < 1e-5, "parameters differ by {d}");
}

/// tests/scripts/ts_bn.py's model (with BatchNorm) and data, and a config training it at
/// micro-batch 32, the whole global batch: (config, data file).
fn bn_model(dir: &Path) -> (PathBuf, PathBuf) {
    let data = bn_files(dir, &[]);
    let cfg = write_config(dir, "bn.yaml", "
model: {kind: torchscript, path: bn.pt}
data: {source: tensors, path: bn.safetensors, val_fraction: 0.2}
optim: {lr: 1.0e-2, warmup_steps: 2, decay_steps: 10}
train: {micro_batch_size: 32, grad_accum_steps: 1, max_steps: 10, eval_every: 0, eval_batch_size: 32, eval_batches: 2, seed: 3, device: cpu, num_threads: 1}
");
    (cfg, data)
}

/// tests/scripts/ts_bn.py's module and data, written to `dir`/bn.pt and bn.safetensors (with
/// the script's `extra` flags); returns the data's path.
fn bn_files(dir: &Path, extra: &[&str]) -> PathBuf {
    let (model, data) = (dir.join("bn.pt"), dir.join("bn.safetensors"));
    let script = script("tests/scripts/ts_bn.py");
    let mut args = vec![
        script.as_str(),
        "--out",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ];
    args.extend(extra);
    python(&args);
    data
}

fn tensor<'t>(w: &'t [(String, tch::Tensor)], name: &str) -> &'t tch::Tensor {
    &w.iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no {name}"))
        .1
}

/// Resume is bitwise exact, BatchNorm's running statistics (buffers) included, and those
/// buffers reach Python: the eval loss there (eval mode uses them) is oomguard's.
#[test]
fn resume_is_exact_and_buffers_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, data) = bn_model(dir.path());
    let full = run(dir.path(), &cfg, "full", &[]);
    let half = run(dir.path(), &cfg, "half", &["--max-steps", "5"]);
    run(dir.path(), &cfg, "half", &["--resume"]);
    let (a, b) = (weights(&full), weights(&half));
    assert!(
        a.iter().any(|(n, _)| n == "bn.running_mean") && a.iter().any(|(n, _)| n == "bn.num_batches_tracked"),
        "{:?}",
        a.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    assert_eq!(max_abs_diff(&a, &b), 0.0, "resume is not exact");
    assert_eq!(
        tensor(&a, "bn.num_batches_tracked").int64_value(&[]),
        10,
        "one BatchNorm update per step (failed attempts are undone)"
    );

    let cfg = json!({"data": data, "val_fraction": 0.2, "seed": 3, "eval_batch": 32, "eval_batches": 2});
    same_eval_as_python(dir.path(), "bn", &full, cfg);
}

/// BatchNorm normalises each forward's batch, so split into micro-batches its statistics are
/// each micro-batch's, as with gradient accumulation in PyTorch: a run at 16 x 2 is eager
/// PyTorch accumulating over the same two halves (to 1e-5), not the run at 32 x 1; its
/// running statistics get one update per micro-batch; it resumes exactly; and a guard that
/// halves 32 to 16 (once: the undo's snapshot of the buffers is no leak) trains on exactly
/// as the 16 x 2 run does.
#[test]
fn batchnorm_statistics_follow_the_micro_batch() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, data) = bn_model(dir.path());
    let at16 = [
        "--set",
        "train.micro_batch_size=16",
        "--set",
        "train.grad_accum_steps=2",
    ];
    let whole = run(dir.path(), &cfg, "whole", &[]);
    let split = run(dir.path(), &cfg, "split", &at16);
    assert!(records(&split, "step")
        .iter()
        .all(|s| s["micro_batch_size"] == 16 && s["grad_accum_steps"] == 2 && s["num_samples"] == 32));

    let eager = dir.path().join("eager.safetensors");
    let cfg_json = json!({"data": data, "val_fraction": 0.2, "seed": 3, "global_batch": 32, "micro_batch": 16, "steps": 10,
                          "lr": 1e-2, "min_lr": 1e-4, "warmup": 2, "decay_steps": 10, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
                          "eps": 1e-8, "grad_clip": 1.0});
    let py = python(&[
        &script("tests/scripts/ts_reference.py"),
        "train",
        "--model",
        "bn",
        "--config",
        &cfg_json.to_string(),
        "--weights",
        dir.path().join("bn.pt").to_str().unwrap(),
        "--out",
        eager.to_str().unwrap(),
    ]);
    let eager_losses: Vec<f64> =
        serde_json::from_value(serde_json::from_str::<Value>(py.lines().last().unwrap()).unwrap()["losses"].clone())
            .unwrap();
    let ours = losses(&split);
    for (s, (a, b)) in ours.iter().zip(&eager_losses).enumerate() {
        assert!(
            (a - b).abs() < 1e-5,
            "step {s}: oomguard {a}, eager PyTorch {b}\n{ours:?}\n{eager_losses:?}"
        );
    }
    // fc1.bias feeds BatchNorm, which subtracts it out: its gradient is float noise, which
    // AdamW scales up to steps of about lr either way, so it (and the running mean it shifts)
    // differs between any two implementations. Every other tensor is compared.
    let conditioned = |w: &[(String, tch::Tensor)]| -> Vec<(String, tch::Tensor)> {
        w.iter()
            .filter(|(n, _)| n != "fc1.bias" && n != "bn.running_mean")
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    };
    let (w_split, w_whole) = (weights(&split), weights(&whole));
    let d = max_abs_diff(&conditioned(&w_split), &conditioned(&safetensors(&eager)));
    assert!(d < 1e-5, "16 x 2 against eager PyTorch accumulating over 16 x 2: {d}");
    let d = max_abs_diff(&conditioned(&w_split), &conditioned(&w_whole));
    assert!(
        d > 1e-2,
        "16 x 2 and 32 x 1 should differ (batch statistics of 16, not 32): {d}"
    );
    assert_eq!(
        tensor(&w_split, "bn.num_batches_tracked").int64_value(&[]),
        20,
        "one running-statistics update per micro-batch"
    );

    let half = run(
        dir.path(),
        &cfg,
        "half",
        &[at16.as_slice(), &["--max-steps", "5"]].concat(),
    );
    run(dir.path(), &cfg, "half", &[at16.as_slice(), &["--resume"]].concat());
    assert_eq!(
        max_abs_diff(&weights(&half), &w_split),
        0.0,
        "resume at 16 x 2 is not exact"
    );

    // Under a budget between the two sizes' peaks the guard halves 32 to 16 at step 0.
    let peak = |r: &Path| records(r, "step")[0]["memory"]["peak_bytes"].as_u64().unwrap();
    let budget = ((peak(&split) + peak(&whole)) / 2).to_string();
    let guarded = run(
        dir.path(),
        &cfg,
        "guarded",
        &["--memory-budget", &budget, "--set", "memory.cooldown_steps=1000"],
    );
    let ooms: Vec<Value> = records(&guarded, "oom")
        .into_iter()
        .filter(|e| e["phase"] != "eval")
        .collect();
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    assert_eq!(
        (ooms[0]["step"].as_u64(), ooms[0]["new_micro_batch_size"].as_u64()),
        (Some(0), Some(16))
    );
    // The buffers' snapshot, taken for the undo, is not mistaken for a leak (which halves twice).
    assert_eq!(ooms[0]["memory_before"], ooms[0]["memory_after_cleanup"], "{}", ooms[0]);
    assert_eq!(
        max_abs_diff(&weights(&guarded), &w_split),
        0.0,
        "the guarded run is the 16 x 2 run"
    );
}

/// What is not a usable model is bad input (exit 2), named with what was expected.
#[test]
fn bad_models_exit_2_saying_what_was_expected() {
    let dir = tempfile::tempdir().unwrap();
    let fails = |cfg: &Path, wants: &[&str]| {
        let o = train_at(dir.path(), cfg, &dir.path().join("r"), &[]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        for w in wants {
            assert!(err.contains(w), "expected {w:?} in {err}");
        }
        let _ = std::fs::remove_dir_all(dir.path().join("r"));
    };
    std::fs::write(dir.path().join("junk.pt"), b"not a module at all").unwrap();
    let base = "data: {source: tensors, path: bn.safetensors}\ntrain: {device: cpu, max_steps: 1}\n";
    bn_files(dir.path(), &["--float-targets"]);
    let junk = write_config(
        dir.path(),
        "junk.yaml",
        &format!("model: {{kind: torchscript, path: junk.pt}}\n{base}"),
    );
    fails(&junk, &["model.path", "junk.pt is not a TorchScript module"]);
    let missing = write_config(
        dir.path(),
        "nope.yaml",
        &format!("model: {{kind: torchscript, path: bn.pt, method: loss}}\n{base}"),
    );
    fails(
        &missing,
        &["model.method", "has no method `loss` (its methods: forward"],
    );
    let dtype = write_config(
        dir.path(),
        "dtype.yaml",
        &format!("model: {{kind: torchscript, path: bn.pt}}\n{base}"),
    );
    fails(
        &dtype,
        &["cannot compute the loss of two samples", "targets [2] Float", "bn.pt"],
    );
    let gpt_key = write_config(
        dir.path(),
        "key.yaml",
        &format!("model: {{kind: torchscript, path: bn.pt, n_layer: 2}}\n{base}"),
    );
    fails(&gpt_key, &["model.n_layer: is a key of the built-in GPT"]);
}

/// The planner for a model without a formula measures trial steps at micro-batches 1..8 and
/// extrapolates: at micro-batch 32 it lands within 20% of a real step's measured peak; and
/// `micro_batch_size: auto` finds a size under a budget and trains at it.
#[test]
fn measured_planner_and_auto_micro_batch() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = mu_sota(dir.path(), "memory: {budget: 1GiB}\n");
    let o = oomguard(
        &[
            "plan",
            cfg.to_str().unwrap(),
            "--json",
            "--set",
            "train.micro_batch_size=32",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let plan: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(plan["method"], "measured");
    let planned = plan["configured_peak_bytes"].as_f64().unwrap();
    // Planned per rank for the built-in GPT only: said, not ignored.
    let o = oomguard(&["plan", cfg.to_str().unwrap(), "--nproc-per-node", "2"], dir.path());
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--nproc-per-node: plans each rank's share for the built-in GPT only; a torchscript model"),
        "{}",
        stderr(&o)
    );
    let r = run(
        dir.path(),
        &cfg,
        "real",
        &["--max-steps", "2", "--set", "train.micro_batch_size=32"],
    );
    let measured = records(&r, "step")[1]["memory"]["peak_bytes"].as_f64().unwrap();
    let err = (planned - measured).abs() / measured;
    assert!(
        err < 0.2,
        "planned {planned}, measured {measured}: {:.1}% off",
        err * 100.0
    );

    let auto = write_config(
        dir.path(),
        "auto.yaml",
        &std::fs::read_to_string(&cfg)
            .unwrap()
            .replace(
                "micro_batch_size: 8, grad_accum_steps: 1",
                "micro_batch_size: auto, global_batch_size: 32",
            )
            .replace("budget: 1GiB", &format!("budget: {}", (measured * 0.6) as u64)),
    );
    let r = run(dir.path(), &auto, "auto", &["--max-steps", "2"]);
    let a = &records(&r, "auto_micro_batch")[0];
    let found = a["largest_fitting"].as_u64().unwrap();
    assert!((4..32).contains(&found), "{a}");
    assert!(records(&r, "step")
        .iter()
        .all(|s| s["num_samples"] == 32 && s["micro_batch_size"] == a["micro_batch_size"]));
}

/// A budget too small at each stage of start-up (loading the module, the optimizer state,
/// reading the data file) is exit 3 naming the stage: never a panic.
#[test]
fn too_small_budgets_exit_3_at_every_stage() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = mu_sota(dir.path(), "");
    bn_files(dir.path(), &[]);
    let bn = write_config(
        dir.path(),
        "bn.yaml",
        "model: {kind: torchscript, path: bn.pt}\ndata: {source: tensors, path: bn.safetensors}\ntrain: \
        {device: cpu, max_steps: 1}\n",
    );
    for (cfg, budget, stage) in [
        (&cfg, "64KiB", "creating the model ran out"),
        (&cfg, "1MiB", "creating the optimizer state ran out"),
        (&bn, "24KiB", "loading the data ran out"),
    ] {
        let o = train_at(dir.path(), cfg, &dir.path().join("r"), &["--memory-budget", budget]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(3), "{budget}: {err}");
        assert!(
            err.contains("the model does not fit in memory") && err.contains(stage),
            "{budget}: {err}"
        );
        let _ = std::fs::remove_dir_all(dir.path().join("r"));
    }
}
