//! `model.kind: python` and `data.source: python`: the user's PyTorch modules and datasets,
//! trained in-process by the real binary, checked against eager PyTorch in the set-up's venv
//! (tests/scripts/py_reference.py). The models are transformers' GPT2LMHeadModel and
//! LlamaForCausalLM from tiny configs (no download), a module TorchScript refuses, and a
//! classifier over a map-style dataset (tests/models/).
#![cfg(feature = "python")]
mod common;
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const ARCHS: [&str; 2] = ["gpt2", "llama"];

fn model_file(name: &str) -> String {
    script(&format!("tests/models/{name}"))
}

/// A byte-level corpus the reference reads the same way (data.source: text).
fn corpus(dir: &Path) {
    let text: String = (0..600)
        .map(|i| format!("{} little birds sang {} songs at dawn.\n", i % 17, (i * 7) % 13))
        .collect();
    std::fs::write(dir.join("corpus.txt"), text).unwrap();
}

/// A transformers model over the corpus: global batch 8, 1 thread.
fn hf_config(dir: &Path, arch: &str, steps: u64, extra: &str) -> PathBuf {
    corpus(dir);
    write_config(dir, &format!("{arch}.yaml"), &format!("
model: {{kind: python, path: {file}, loss: loss, settings: {{arch: {arch}, block: 32}}, block_size: 32}}
data: {{source: text, path: corpus.txt, val_fraction: 0.1}}
optim: {{lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 3, decay_steps: 30, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1.0e-8, grad_clip: 1.0}}
train: {{micro_batch_size: 8, grad_accum_steps: 1, max_steps: {steps}, eval_every: 0, eval_batch_size: 8, eval_batches: 1, seed: 5, device: cpu, \
    num_threads: 1}}
log: {{every: 1}}
{extra}", file = model_file("hf.py")))
}

fn reference_config(dir: &Path, steps: u64) -> Value {
    json!({"data": dir.join("corpus.txt"), "block": 32, "val_fraction": 0.1, "seed": 5, "global_batch": 8, "steps": steps,
           "lr": 3e-3, "min_lr": 3e-4, "warmup": 3, "decay_steps": 30, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
           "eps": 1e-8, "grad_clip": 1.0, "eval_batch": 8})
}

fn reference(mode: &str, arch: &str, config: &Value, extra: &[&str]) -> Value {
    let settings = json!({"arch": arch, "block": 32}).to_string();
    let mut args = vec![
        script("tests/scripts/py_reference.py"),
        mode.into(),
        "--file".into(),
        model_file("hf.py"),
        "--settings".into(),
        settings,
        "--config".into(),
        config.to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = python(&args.iter().map(String::as_str).collect::<Vec<_>>());
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

fn close(a: &[f64], b: &[f64], tol: f64) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol)
}

/// Over 10 steps each model's losses are a plain eager PyTorch loop's (same initial weights,
/// samples, AdamW) within 1e-5, and its model.safetensors loads back with `from_pretrained`,
/// every tensor as saved, giving the run's own evaluation loss.
#[test]
fn transformers_models_train_like_eager_pytorch_and_load_with_from_pretrained() {
    for arch in ARCHS {
        let dir = tempfile::tempdir().unwrap();
        let cfg = hf_config(dir.path(), arch, 10, "");
        let run = train_ok(dir.path(), &cfg, &[]);
        let ours = losses(&run);
        let theirs: Vec<f64> = reference("train", arch, &reference_config(dir.path(), 10), &[])["losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert!(
            close(&ours, &theirs, 1e-5),
            "{arch}: oomguard {ours:?}\neager {theirs:?}"
        );
        assert!(ours[9] < ours[0] - 0.5, "{arch} does not train: {ours:?}");
        let weights = run.join("model.safetensors");
        let back = reference(
            "pretrained",
            arch,
            &reference_config(dir.path(), 10),
            &["--weights", weights.to_str().unwrap()],
        );
        assert_eq!(back["max_diff"].as_f64(), Some(0.0), "{arch}: {back}");
        let eval = records(&run, "eval");
        let val = eval.last().unwrap()["val_loss"].as_f64().unwrap();
        assert!(
            (back["val_loss"].as_f64().unwrap() - val).abs() < 1e-5,
            "{arch}: {back} vs {val}"
        );
    }
}

/// An injected OOM (forward, backward, optimizer: wherever it lands) and a real one (a budget
/// the configured micro-batch does not fit in) are recovered with the same samples: each run
/// ends at the clean run's parameters.
#[test]
fn an_injected_and_a_budget_oom_end_at_the_clean_runs_parameters() {
    for arch in ARCHS {
        let dir = tempfile::tempdir().unwrap();
        let cfg = hf_config(dir.path(), arch, 8, "");
        let clean = train_into(dir.path(), &cfg, "clean", &[]);
        let injected = train_into(dir.path(), &cfg, "injected", &["--inject-oom", "3:11"]);
        let budget = hf_config(dir.path(), arch, 8, "memory: {budget: 2MiB}\n");
        let tight = train_into(dir.path(), &budget, "budget", &[]);
        assert!(!records(&tight, "oom").is_empty(), "{arch}: the budget caused no OOM");
        let injected_ooms = records(&injected, "oom").len();
        assert_eq!(injected_ooms, 3, "{arch}");
        // The snapshots of OOMs in the forward name the Python lines it was running.
        let forward: Vec<Value> = [&injected, &tight]
            .iter()
            .flat_map(|run| std::fs::read_dir(run.join("oom")).into_iter().flatten().flatten())
            .map(|d| serde_json::from_str(&std::fs::read_to_string(d.path().join("summary.json")).unwrap()).unwrap())
            .filter(|s: &Value| s["phase"] == "forward")
            .collect();
        assert!(!forward.is_empty(), "{arch}: no OOM in a forward");
        for s in &forward {
            let frames = s["python_stack"].as_array().cloned().unwrap_or_default();
            assert!(
                frames.iter().any(|f| {
                    let f = f.as_str().unwrap();
                    f.starts_with("transformers/models/") || f.contains("tests/models/hf.py:")
                }),
                "{arch}: {frames:?}"
            );
        }
        for (name, run) in [("injected", &injected), ("budget", &tight)] {
            let d = max_abs_diff(&weights(&clean), &weights(run));
            assert!(d < 1e-5, "{arch} {name}: parameters differ from the clean run's by {d}");
            let steps = records(run, "step");
            assert!(steps.iter().all(|s| s["num_samples"] == 8), "{arch} {name}: {steps:?}");
        }
    }
}

fn branchy_config(dir: &Path, steps: u64, extra: &str) -> PathBuf {
    write_config(dir, "branchy.yaml", &format!("
model: {{kind: python, path: {file}, settings: {{dim: 32, depth: 3}}, block_size: 32}}
data: {{source: embedded, embedded_bytes: 65536}}
optim: {{lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 2}}
train: {{micro_batch_size: 8, grad_accum_steps: 2, max_steps: {steps}, eval_every: 0, eval_batch_size: 8, eval_batches: 2, seed: 7, device: cpu, \
    num_threads: 1}}
log: {{every: 1}}
{extra}", file = model_file("branchy.py")))
}

/// SIGINT mid-run, then --resume: the weights are bitwise those of an uninterrupted run, for
/// a module whose forward draws from Python's `random` (stochastic depth) and runs a custom
/// autograd.Function: the checkpoint carries Python's random state.
#[test]
fn sigint_then_resume_is_bitwise_with_pythons_random_state() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = branchy_config(dir.path(), 600, "");
    let whole = train_into(dir.path(), &cfg, "whole", &[]);
    let run = dir.path().join("run");
    let child = isolated(dies_with_test(&mut Command::new(bin())), dir.path())
        .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
        .current_dir(dir.path())
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_steps(&run, 20);
    assert!(Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", String::from_utf8_lossy(&out.stderr));
    let stopped = records(&run, "stopped");
    assert_eq!(stopped.len(), 1);
    let o = oomguard(&["train", "--run-dir", run.to_str().unwrap(), "--resume"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(records(&run, "resumed").len(), 1);
    assert_eq!(
        max_abs_diff(&weights(&whole), &weights(&run)),
        0.0,
        "resume is not exact"
    );
    // The stochastic depth is Python's: without its state restored the runs would part.
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::fs::read_dir(run.join("checkpoints"))
                .unwrap()
                .flatten()
                .find(|e| e.file_name().to_string_lossy().starts_with("step-"))
                .unwrap()
                .path()
                .join("state.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let host = &state["extra"]["host_rng"];
    assert!(
        host["random"].is_array() && host["numpy"].is_array(),
        "{}",
        state["extra"]
    );
}

/// Two ranks over Gloo under the real launcher end where one process does: plain data
/// parallel, and ZeRO-1 and ZeRO-2 (a transformers GPT-2, its head tied to the embedding,
/// every other setting at its default).
#[test]
fn two_ranks_equal_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = hf_config(dir.path(), "gpt2", 6, "");
    let single = train_into(dir.path(), &cfg, "single", &[]);
    for shard in ["none", "optimizer", "gradients"] {
        let two = dir.path().join(format!("two-{shard}"));
        let set = format!("train.shard={shard}");
        let o = train_at(dir.path(), &cfg, &two, &["--nproc-per-node", "2", "--set", &set]);
        assert!(o.status.success(), "{shard}: {}", stderr(&o));
        let steps = records(&two, "step");
        assert!(
            steps.iter().all(|s| s["world_size"] == 2 && s["shard"] == shard),
            "{shard}: {steps:?}"
        );
        let d = max_abs_diff(&weights(&single), &weights(&two));
        assert!(d < 1e-5, "2 ranks ({shard}) differ from 1 process by {d}");
    }
}

/// A module TorchScript refuses trains; `model.init_from` fine-tunes it from the run's
/// weights (its first loss is the trained model's, not a fresh one's); a file of another
/// shape is refused with exit 2, listing the missing, unexpected and mis-shaped keys.
#[test]
fn a_module_torchscript_refuses_trains_and_fine_tunes_from_init_from() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = branchy_config(dir.path(), 30, "");
    let first = train_into(dir.path(), &cfg, "first", &[]);
    let l = losses(&first);
    assert!(l[29] < l[0] - 1.0, "{l:?}");
    let saved = first.join("model.safetensors");
    let tune = branchy_config(dir.path(), 5, "");
    let yaml = std::fs::read_to_string(&tune).unwrap().replace(
        "block_size: 32}",
        &format!("block_size: 32, init_from: {}}}", saved.display()),
    );
    let tune = write_config(dir.path(), "tune.yaml", &yaml);
    let tuned = train_into(dir.path(), &tune, "tuned", &[]);
    let t = losses(&tuned);
    assert!(
        t[0] < l[0] - 1.0,
        "fine-tuning starts where the first run ended: {t:?} vs {l:?}"
    );
    // Another shape: depth 4 and dim 48.
    let other = write_config(
        dir.path(),
        "other.yaml",
        &yaml.replace("{dim: 32, depth: 3}", "{dim: 48, depth: 4}"),
    );
    let o = oomguard(&["train", other.to_str().unwrap(), "--run-dir", "bad"], dir.path());
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for needle in [
        "model.init_from",
        "missing",
        "blocks.3.up.weight",
        "mis-shaped",
        "emb.weight",
    ] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    // Hugging Face's layout leaves out tied weights (lm_head is wte): accepted.
    let hf = hf_config(dir.path(), "gpt2", 3, "");
    let gpt = train_into(dir.path(), &hf, "gpt", &[]);
    let untied = dir.path().join("hf.safetensors");
    python(&[
        "-c",
        &format!(
            "from safetensors.torch import load_file, save_file; d = load_file({:?}); del d['lm_head.weight']; save_file(d, {:?})",
            gpt.join("model.safetensors").display().to_string(),
            untied.display().to_string()
        ),
    ]);
    let yaml = std::fs::read_to_string(&hf).unwrap().replace(
        "block_size: 32}",
        &format!("block_size: 32, init_from: {}}}", untied.display()),
    );
    let from_hf = write_config(dir.path(), "from-hf.yaml", &yaml);
    let resumed = train_into(dir.path(), &from_hf, "from-hf", &[]);
    assert!(losses(&resumed)[0] < losses(&gpt)[0] - 0.1);
}

/// A map-style dataset whose items are (features, int label), batched by the file's
/// collate: the classifier learns (the held-out loss falls below 0.1), and a rank's
/// samples are oomguard's (the step record counts the global batch).
#[test]
fn a_dataset_with_collate_trains_a_classifier() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file("classify.py");
    let cfg = write_config(dir.path(), "cls.yaml", &format!("
model: {{kind: python, path: {file}, settings: {{hidden: 32}}}}
data: {{source: python, path: {file}, build: dataset, settings: {{n: 512}}}}
optim: {{lr: 1.0e-2, min_lr: 1.0e-3, warmup_steps: 2}}
train: {{micro_batch_size: 16, grad_accum_steps: 2, max_steps: 40, eval_every: 20, eval_batch_size: 16, eval_batches: 4, seed: 7, device: cpu, num_threads: 1}}
log: {{every: 1}}
"));
    let run = train_ok(dir.path(), &cfg, &["--inject-oom", "2"]);
    let evals = records(&run, "eval");
    let first = evals.first().unwrap()["val_loss"].as_f64().unwrap();
    let last = evals.last().unwrap()["val_loss"].as_f64().unwrap();
    assert!(last < 0.1 && last <= first, "{evals:?}");
    assert!(records(&run, "step").iter().all(|s| s["num_samples"] == 32));
    assert_eq!(records(&run, "oom").len(), 2);
}

/// Every kind of bad Python input exits 2 naming the file, the config key and the fix, and
/// writes nothing into the run directory.
#[test]
fn bad_python_files_exit_2_naming_the_file_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let ok_model = "import torch\nfrom torch import nn\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.w = \
        nn.Linear(4, 1)\n    def forward(self, x, y):\n        return ((self.w(x.float()) - y.float()) ** 2).mean()\ndef build(s):\n    return M()\n";
    let cases: Vec<(&str, String, &str, Vec<&str>)> =
        vec![
        (
            "missing file",
            String::new(),
            "path: nowhere.py",
            vec!["model.path", "nowhere.py", "does not exist"],
        ),
        (
            "no function",
            ok_model.into(),
            "build: make",
            vec!["model.build", "no function `make`", "build"],
        ),
        (
            "syntax error",
            "def build(s:\n    return 1\n".into(),
            "",
            vec!["model.path", "syntax error", "line 1"],
        ),
        (
            "missing package",
            format!("import not_a_package_xyz\n{ok_model}"),
            "",
            vec!["model.path", "not_a_package_xyz", "pip install not_a_package_xyz"],
        ),
        (
            "build raises",
            "def build(s):\n    raise ValueError('no such size: ' + str(s['size']))\n".into(),
            "settings: {size: 7}",
            vec!["model.build", "ValueError", "no such size: 7"],
        ),
        (
            "not a module",
            "def build(s):\n    return 42\n".into(),
            "",
            vec!["model.build", "returned int", "torch.nn.Module"],
        ),
        (
            "loss not scalar",
            ok_model.replace(
                "return ((self.w(x.float()) - y.float()) ** 2).mean()",
                "return self.w(x.float())",
            ),
            "",
            vec!["model", "scalar"],
        ),
        (
            "loss without gradient",
            ok_model.replace(
                "return ((self.w(x.float()) - y.float()) ** 2).mean()",
                "return ((self.w(x.float()) - y.float()) ** 2).mean().detach()",
            ),
            "",
            vec!["model", "gradient"],
        ),
        (
            "returns a string",
            ok_model.replace("return ((self.w(x.float()) - y.float()) ** 2).mean()", "return 'loss'"),
            "",
            vec!["model.loss", "returned str"],
        ),
        (
            // AdamW's moments are sized at build: the weight would grow under them.
            "lazy parameters",
            ok_model.replace("nn.Linear(4, 1)", "nn.LazyLinear(1)"),
            "",
            vec!["model.build", "lazy parameters (w.weight", "nn.Linear, not nn.LazyLinear"],
        ),
        (
            // A checkpoint (safetensors) cannot hold it: refused before the first step.
            "complex buffer",
            ok_model.replace(
                "nn.Linear(4, 1)\n",
                "nn.Linear(4, 1)\n        self.register_buffer('freqs', torch.polar(torch.ones(4), torch.zeros(4)))\n",
            ),
            "",
            vec!["model.build", "freqs (torch.complex64)", "persistent=False"],
        ),
    ];
    let rows = "import torch\nfrom safetensors.torch import save_file\nsave_file({'inputs': torch.randn(64, 4), 'targets': torch.randn(64, 1)}, \
        'rows.safetensors')\n";
    let here = dir.path().to_str().unwrap().to_string();
    python(&["-c", &format!("import os; os.chdir({here:?})\n{rows}")]);
    for (name, source, extra, needles) in cases {
        let file = dir.path().join("m.py");
        std::fs::write(&file, &source).unwrap();
        let (path, extra) = match extra.strip_prefix("path: ") {
            Some(p) => (p.to_string(), String::new()),
            None => (
                "m.py".to_string(),
                if extra.is_empty() {
                    String::new()
                } else {
                    format!(", {extra}")
                },
            ),
        };
        let cfg = write_config(
            dir.path(),
            "bad.yaml",
            &format!(
                "
model: {{kind: python, path: {path}{extra}}}
data: {{source: tensors, path: rows.safetensors}}
train: {{micro_batch_size: 4, grad_accum_steps: 1, max_steps: 2, eval_every: 0, device: cpu, num_threads: 1}}
"
            ),
        );
        let run = dir.path().join("run");
        let o = train_at(dir.path(), &cfg, &run, &[]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains("bad.yaml"), "{name}: the config file is not named: {err}");
        for n in &needles {
            assert!(err.contains(n), "{name}: `{n}` not in: {err}");
        }
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert!(
            !run.join("checkpoints").exists() && !run.join("model.safetensors").exists(),
            "{name}"
        );
        // `--check` (what a sweep runs on every trial first) builds the model for real: what
        // building finds, it finds, the same way.
        let at_build = [
            "missing file",
            "no function",
            "syntax error",
            "missing package",
            "build raises",
            "not a module",
            "lazy parameters",
            "complex buffer",
        ];
        if at_build.contains(&name) {
            let o = oomguard(&["train", cfg.to_str().unwrap(), "--check"], dir.path());
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "--check, {name}: {err}");
            for n in &needles {
                assert!(err.contains(n), "--check, {name}: `{n}` not in: {err}");
            }
        }
    }
}

/// The guard's activation-checkpointing rung on transformers models, whose configs keep a KV
/// cache in training (`use_cache`): a block recomputed in backward would update it twice. Off
/// while checkpointing: the losses are the run's without it, and the model's memory less.
#[test]
fn transformers_models_checkpoint_their_blocks_as_they_train_without() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["llama", "gpt2"] {
        let cfg = hf_config(dir.path(), arch, 3, "");
        let plain = train_into(dir.path(), &cfg, &format!("{arch}-plain"), &[]);
        let ckpt = train_into(
            dir.path(),
            &cfg,
            &format!("{arch}-ckpt"),
            &["--set", "model.activation_checkpointing=blocks"],
        );
        let losses = |run: &Path| -> Vec<f64> {
            records(run, "step")
                .iter()
                .map(|r| r["loss"].as_f64().unwrap())
                .collect()
        };
        assert!(
            close(&losses(&plain), &losses(&ckpt), 1e-6),
            "{arch}: {:?} {:?}",
            losses(&plain),
            losses(&ckpt)
        );
        assert!(
            records(&ckpt, "step")
                .iter()
                .all(|r| r["activation_checkpointing"] == true),
            "{arch}"
        );
    }
}

/// A module that replaces a buffer with a new tensor in forward (an EMA written
/// `self.ema = self.ema * d + ...`) would train, save and restore the one it dropped: the run
/// stops at its first step, naming the buffer and the in-place fix, and saves nothing.
#[test]
fn a_buffer_replaced_in_forward_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let source = "import torch\nfrom torch import nn\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n        \
        self.w = nn.Linear(4, 1)\n        self.register_buffer('ema', torch.zeros(1))\n    def forward(self, x, y):\n        out = \
        self.w(x.float())\n        if self.training:\n            self.ema = self.ema * 0.9 + 0.1 * out.detach().mean()\n        return \
        ((out - y.float()) ** 2).mean()\ndef build(s):\n    return M()\n";
    std::fs::write(dir.path().join("ema.py"), source).unwrap();
    rows_file(dir.path(), 64, 4);
    let cfg = write_config(
        dir.path(),
        "ema.yaml",
        "
model: {kind: python, path: ema.py}
data: {source: tensors, path: rows.safetensors}
train: {micro_batch_size: 4, grad_accum_steps: 1, max_steps: 2, eval_every: 0, device: cpu, num_threads: 1}
",
    );
    let run = dir.path().join("run");
    let o = train_at(dir.path(), &cfg, &run, &[]);
    let err = stderr(&o);
    assert!(!o.status.success() && !err.contains("panicked"), "{err}");
    assert!(
        err.contains("replaced `ema` with a new tensor") && err.contains("self.ema.copy_(new)"),
        "{err}"
    );
    assert!(!run.join("checkpoints").exists(), "{err}");
}

/// An exception in the module mid-training (not an OOM) exits 1; the Python traceback, with
/// the user's file and line, is in the log and in the launcher's error file.
#[test]
fn an_exception_while_training_exits_1_with_its_traceback() {
    let dir = tempfile::tempdir().unwrap();
    let source = std::fs::read_to_string(model_file("branchy.py")).unwrap().replace(
        "        h = self.emb(x)\n",
        "        h = self.emb(x)\n        if self.training:\n            self.calls = getattr(self, 'calls', 0) + 1\n            if self.calls == \
            7:\n                raise KeyError('the seventh call')\n",
    );
    std::fs::write(dir.path().join("flaky.py"), source).unwrap();
    let yaml = std::fs::read_to_string(branchy_config(dir.path(), 10, "")).unwrap();
    let yaml = yaml.replace(&model_file("branchy.py"), "flaky.py");
    let cfg = write_config(dir.path(), "flaky.yaml", &yaml);
    let run = dir.path().join("run");
    let error_file = dir.path().join("error.json");
    let o = isolated(&mut Command::new(bin()), dir.path())
        .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
        .current_dir(dir.path())
        .env("OMP_NUM_THREADS", "1")
        .env("TORCHELASTIC_ERROR_FILE", &error_file)
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let log = std::fs::read_to_string(run.join("train.log")).unwrap();
    let file = std::fs::read_to_string(&error_file).unwrap();
    for text in [&log, &file] {
        assert!(
            text.contains("flaky.py") && text.contains("the seventh call") && text.contains("KeyError"),
            "{text}"
        );
    }
    assert_eq!(records(&run, "step").len(), 3, "the steps before the error are logged");
}

/// Python's MemoryError raised in the module (a host allocation in Python code: numpy, a
/// collator) is an OOM here as in `import oomguard`: recovered with the same samples, the run
/// ends at the clean run's parameters.
#[test]
fn a_memory_error_in_the_module_is_an_oom_recovered() {
    let dir = tempfile::tempdir().unwrap();
    // Without stochastic depth, so that a retried step draws nothing the clean run does not.
    let steady = std::fs::read_to_string(model_file("branchy.py"))
        .unwrap()
        .replace("random.random() < 0.25", "False");
    let short = steady.replace(
        "        h = self.emb(x)\n",
        "        h = self.emb(x)\n        if self.training:\n            self.calls = getattr(self, 'calls', 0) + 1\n            if self.calls == \
            5:\n                raise MemoryError()\n",
    );
    let yaml = std::fs::read_to_string(branchy_config(dir.path(), 4, "")).unwrap();
    let mut runs = vec![];
    for (name, source) in [("steady", &steady), ("short", &short)] {
        std::fs::write(dir.path().join(format!("{name}.py")), source).unwrap();
        let cfg = write_config(
            dir.path(),
            &format!("{name}.yaml"),
            &yaml.replace(&model_file("branchy.py"), &format!("{name}.py")),
        );
        runs.push(train_into(dir.path(), &cfg, name, &[]));
    }
    let ooms = records(&runs[1], "oom");
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    assert!(
        ooms[0]["message"].as_str().unwrap().starts_with("MemoryError"),
        "{ooms:?}"
    );
    let d = max_abs_diff(&weights(&runs[0]), &weights(&runs[1]));
    assert!(d < 1e-5, "the parameters differ from the clean run's by {d}");
}

/// A sweep varies a Python model's `model.settings.*` and `data.settings.*`: each trial
/// builds the module and the dataset from its own values.
#[test]
fn a_sweep_varies_model_and_data_settings() {
    let dir = tempfile::tempdir().unwrap();
    let file = model_file("classify.py");
    write_config(dir.path(), "base.yaml", &format!("
model: {{kind: python, path: {file}, settings: {{hidden: 32}}}}
data: {{source: python, path: {file}, build: dataset, settings: {{n: 512}}}}
optim: {{lr: 1.0e-2, min_lr: 1.0e-3, warmup_steps: 2}}
train: {{micro_batch_size: 16, grad_accum_steps: 1, max_steps: 6, eval_every: 6, eval_batch_size: 16, eval_batches: 2, seed: 7, device: cpu, num_threads: 1}}
"));
    let sweep = write_config(
        dir.path(),
        "sweep.yaml",
        "
base: base.yaml
method: grid
parameters:
  model.settings.hidden: {values: [4, 64]}
  data.settings.n: {value: 256}
metric: final_eval_loss
",
    );
    let out = dir.path().join("out");
    let o = oomguard(
        &["sweep", sweep.to_str().unwrap(), "--out", out.to_str().unwrap()],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let results = std::fs::read_to_string(out.join("results.jsonl")).unwrap();
    let trials: Vec<Value> = results.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let finished: Vec<&Value> = trials.iter().filter(|t| t["status"] == "ok").collect();
    assert_eq!(finished.len(), 2, "{results}");
    // Each trial's stored config holds its own width.
    for hidden in [4, 64] {
        assert!(
            std::fs::read_dir(out.join("trials")).unwrap().flatten().any(|t| {
                std::fs::read_to_string(t.path().join("config.yaml"))
                    .is_ok_and(|c| c.contains(&format!("hidden: {hidden}")) && c.contains("n: 256"))
            }),
            "no trial with hidden {hidden}"
        );
    }
}

/// A Python data file whose `loss_units(batch)` counts the labels its model's loss averages
/// over (-100s, an SFT's prompt tokens, left out): each micro-batch weighs by its units over
/// the step's, so micro-batch 16, 4 and 1 (whole micro-batches masked) and 2 ranks end with
/// the same parameters and evaluation. Without `loss_units` the split changes them: the test
/// sees it. Each micro-batch is collated and counted once, by its forward: `loss_units` runs
/// once per forward (before, the whole global batch was collated on every rank each step, and
/// each micro-batch twice).
#[test]
fn loss_units_make_masked_labels_exact_whatever_the_split() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("units.log");
    let sft = r#"
import os
import torch
import torch.nn.functional as F
from torch import nn

class Sft(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 32, (n, 8), generator=g)
        self.labels = self.ids.roll(-1, 1).clone()
        for i in range(n):
            self.labels[i, : i % 9] = -100  # sample i masks its first i % 9 labels: i % 9 == 8, all

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}

def dataset(settings, split):
    return Sft(64 if split == "train" else 32, 1 if split == "train" else 2)

def loss_units(batch):
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()}\n")
    return (batch["labels"] != -100).sum()

class Lm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids, labels):
        return F.cross_entropy(self.head(torch.tanh(self.emb(input_ids))).flatten(0, 1), labels.flatten())

def build(settings):
    return Lm()
"#;
    let sft = sft.replace("LOG", &format!("{:?}", log.display().to_string()));
    eprintln!("TB {}", log.display());
    std::fs::write(dir.path().join("sft.py"), &sft).unwrap();
    std::fs::write(dir.path().join("plain.py"), sft.replace("def loss_units", "def unused")).unwrap();
    for file in ["sft.py", "plain.py"] {
        let cfg = write_config(dir.path(), &format!("{file}.yaml"), &format!("
model: {{kind: python, path: {file}}}
data: {{source: python, path: {file}, build: dataset}}
optim: {{lr: 1.0e-2, min_lr: 1.0e-3, warmup_steps: 1}}
train: {{micro_batch_size: 16, grad_accum_steps: 1, max_steps: 3, eval_every: 3, eval_batch_size: 16, eval_batches: 1, seed: 7, device: cpu, num_threads: 1}}
"));
        let run = |name: &str, mb: &str, accum: &str| {
            let (m, a) = (
                format!("train.micro_batch_size={mb}"),
                format!("train.grad_accum_steps={accum}"),
            );
            train_into(dir.path(), &cfg, &format!("{file}-{name}"), &["--set", &m, "--set", &a])
        };
        // `loss_units` calls per process: one per forward.
        let calls = || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let _ = std::fs::remove_file(&log);
            let mut per: std::collections::BTreeMap<String, usize> = Default::default();
            text.lines()
                .for_each(|pid| *per.entry(pid.to_string()).or_default() += 1);
            per.into_values().collect::<Vec<_>>()
        };
        let whole = run("whole", "16", "1");
        let whole_calls = calls();
        let mb4 = run("mb4", "4", "4");
        let mb4_calls = calls();
        let two = dir.path().join(format!("{file}-two"));
        let o = train_at(dir.path(), &cfg, &two, &["--nproc-per-node", "2"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let two_calls = calls();
        let val = |r: &Path| records(r, "eval")[0]["val_loss"].as_f64().unwrap();
        let worst = [mb4, run("mb1", "1", "16"), two]
            .iter()
            .map(|r| max_abs_diff(&weights(&whole), &weights(r)).max((val(&whole) - val(r)).abs()))
            .fold(0.0, f64::max);
        if file == "sft.py" {
            assert!(worst < 1e-5, "loss_units: the split changed the run by {worst}");
            // 3 steps x 1 micro-batch, 1 evaluation part and the start's check of the loss on
            // two samples; 3 x 4 + 1 + 1; on each of 2 ranks (8 rows), 3 x 1 + 1 + 1.
            assert_eq!((whole_calls, mb4_calls, two_calls), (vec![5], vec![14], vec![5, 5]));
        } else {
            assert!(worst > 1e-4, "without loss_units the split should show: {worst}");
        }
    }
}

/// A frozen backbone (a 16 MiB linear layer, `requires_grad=False`, the LoRA and linear-probe
/// case) under a 24 MiB budget: its frozen weights are not buffers, so no step copies them
/// (before, each attempt's snapshot of "buffers" copied the 16 MiB and nothing fit: exit 3).
/// They are saved with the weights, unchanged; the real buffer (BatchNorm's statistics) is
/// still restored and saved.
#[test]
fn a_frozen_backbone_is_not_copied_each_step_and_fits_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("probe.py"),
        "import torch\nfrom torch import nn\nclass Probe(nn.Module):\n    def __init__(self):\n        super().__init__()\n        \
         self.backbone = nn.Linear(2048, 2048, bias=False)\n        self.backbone.weight.requires_grad_(False)\n        \
         self.norm = nn.BatchNorm1d(2048)\n        self.head = nn.Linear(2048, 1)\n    def forward(self, x, y):\n        \
         h = self.norm(self.backbone(x.float()))\n        return ((self.head(h) - y.float()) ** 2).mean()\ndef build(s):\n    \
         torch.manual_seed(0)\n    return Probe()\n",
    )
    .unwrap();
    rows_file(dir.path(), 64, 2048);
    let here = dir.path().to_str().unwrap().to_string();
    let cfg = write_config(
        dir.path(),
        "probe.yaml",
        "
model: {kind: python, path: probe.py}
data: {source: tensors, path: rows.safetensors}
train: {micro_batch_size: 8, grad_accum_steps: 2, max_steps: 3, eval_every: 0, device: cpu, num_threads: 1}
memory: {budget: 24MiB}
",
    );
    let run = train_ok(dir.path(), &cfg, &[]);
    assert_eq!(records(&run, "step").len(), 3);
    let w: std::collections::BTreeMap<String, tch::Tensor> = weights(&run).into_iter().collect();
    // The frozen weight is saved, as built (seed 0), and the BatchNorm statistics moved.
    let built = python(&[
        "-c",
        &format!(
            "import sys, torch; sys.path.insert(0, {here:?}); import probe\n\
             m = probe.build({{}}); print(float(m.backbone.weight.double().sum()))"
        ),
    ]);
    let want: f64 = built.trim().parse().unwrap();
    let got = w["backbone.weight"]
        .to_kind(tch::Kind::Double)
        .sum(tch::Kind::Double)
        .double_value(&[]);
    assert!((got - want).abs() < 1e-6, "the frozen weight changed: {got} vs {want}");
    assert!(w["norm.running_mean"].abs().sum(tch::Kind::Double).double_value(&[]) > 0.0);
    assert!(
        w["norm.num_batches_tracked"].int64_value(&[]) >= 6,
        "2 micro-batches a step, 3 steps"
    );
}

/// A model that draws from Python's `random`, numpy's global generator and torch's, in
/// training and in evaluation: evaluation runs on the side (the generators put back after it),
/// so evaluating every 2 steps or never ends at the same weights, bitwise; numpy is seeded
/// from `train.seed`, so two runs agree; and a resume restores numpy's state too.
#[test]
fn evaluation_never_moves_trainings_generators_and_numpy_is_seeded_and_saved() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("noisy.py"),
        "import random\nimport numpy as np\nimport torch\nfrom torch import nn\nclass Noisy(nn.Module):\n    def __init__(self):\n        \
         super().__init__()\n        self.w = nn.Linear(4, 1)\n    def forward(self, x, y):\n        \
         noise = random.random() + float(np.random.rand()) + float(torch.rand(()))\n        \
         return ((self.w(x.float()) * (1 + 0.1 * noise) - y.float()) ** 2).mean()\ndef build(s):\n    return Noisy()\n",
    )
    .unwrap();
    rows_file(dir.path(), 80, 4);
    let cfg = |name: &str, eval_every: u32, extra: &str| {
        write_config(
            dir.path(),
            name,
            &format!(
                "
model: {{kind: python, path: noisy.py}}
data: {{source: tensors, path: rows.safetensors}}
optim: {{decay_steps: 6}}
train: {{micro_batch_size: 8, grad_accum_steps: 1, max_steps: 6, eval_every: {eval_every}, eval_batch_size: 8, eval_batches: 2, seed: 3, \
device: cpu, num_threads: 1}}
{extra}"
            ),
        )
    };
    let never = train_into(dir.path(), &cfg("never.yaml", 0, ""), "never", &[]);
    let often = train_into(dir.path(), &cfg("often.yaml", 2, ""), "often", &[]);
    assert_eq!(records(&often, "eval").len(), 3);
    let again = train_into(dir.path(), &cfg("never.yaml", 0, ""), "again", &[]);
    let same = |a: &Path, b: &Path| {
        weights(a)
            .iter()
            .zip(weights(b))
            .all(|((n, x), (m, y))| *n == m && x.equal(&y))
    };
    assert!(same(&never, &often), "evaluating moved training's generators");
    assert!(same(&never, &again), "two runs of one seed differ (numpy unseeded?)");
    // Stopped at step 3 (its checkpoint), resumed to 6: the same weights, bitwise.
    let part = cfg("part.yaml", 2, "checkpoint: {every_steps: 3}\n");
    let run = dir.path().join("part");
    let o = train_at(dir.path(), &part, &run, &["--max-steps", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = resume(dir.path(), &part, &run, &["--max-steps", "6"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(same(&never, &run), "the resumed run differs from the one run");
}

/// One process, a model with dropout and draws from Python's `random` and numpy's: a retried
/// attempt draws what the first drew (torch's generators and the host's seeded again), so a run
/// with injected OOMs ends at the clean run's parameters, as `--inject-oom` promises.
#[test]
fn a_retried_attempt_draws_what_the_first_drew() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("drop.py"),
        "import random\nimport numpy as np\nimport torch\nfrom torch import nn\nclass Drop(nn.Module):\n    def __init__(self):\n        \
         super().__init__()\n        self.net = nn.Sequential(nn.Linear(4, 32), nn.Dropout(0.3), nn.Linear(32, 1))\n    \
         def forward(self, x, y):\n        n = x.shape[0]\n        \
         host = [random.random() for _ in range(n)] if self.training else [0.0] * n\n        \
         more = np.random.rand(n) if self.training else np.zeros(n)\n        \
         scale = 1.0 + 0.1 * (torch.tensor(host) + torch.from_numpy(more)).float().unsqueeze(1)\n        \
         return ((self.net(x.float()) * scale - y.float()) ** 2).mean()\ndef build(s):\n    return Drop()\n",
    )
    .unwrap();
    rows_file(dir.path(), 80, 4);
    // Every draw is per row (dropout's mask, a number per row from `random` and numpy), so a
    // split into smaller micro-batches draws the same sequence: only a retry that did not
    // rewind would draw other numbers.
    let cfg = |mb: u32, ga: u32| {
        write_config(
            dir.path(),
            &format!("drop-{mb}.yaml"),
            &format!(
                "
model: {{kind: python, path: drop.py}}
data: {{source: tensors, path: rows.safetensors}}
train: {{micro_batch_size: {mb}, grad_accum_steps: {ga}, max_steps: 6, eval_every: 0, seed: 3, device: cpu, num_threads: 1}}
"
            ),
        )
    };
    let clean = train_into(dir.path(), &cfg(8, 2), "clean", &[]);
    let injected = train_into(dir.path(), &cfg(8, 2), "injected", &["--inject-oom", "3:7"]);
    assert_eq!(records(&injected, "oom").len(), 3);
    let d = max_abs_diff(&weights(&clean), &weights(&injected));
    assert!(
        d < 1e-6,
        "a retried attempt drew other dropout masks or host draws: {d}"
    );
}

/// Python's `random` and numpy's global generator are seeded per (seed, step, rank), as
/// torch's are: each rank draws its own numbers (no identical augmentations on every rank),
/// two runs of one seed draw the same ones, and one process draws rank 0's (so a run resumed
/// at another world size draws what a run at that size would).
#[test]
fn each_rank_draws_its_own_host_numbers_and_runs_repeat() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("draws.py"),
        "import os, random\nimport numpy as np\nimport torch\nfrom torch import nn\nclass Draws(nn.Module):\n    def __init__(self):\n        \
         super().__init__()\n        self.w = nn.Linear(4, 1)\n    def forward(self, x, y):\n        \
         if self.training:\n            with open(os.environ['DRAWS'] + '-' + os.environ.get('RANK', '0'), 'a') as f:\n                \
         f.write(f'{random.random()} {np.random.rand()}\\n')\n        return ((self.w(x.float()) - y.float()) ** 2).mean()\n\
         def build(s):\n    return Draws()\n",
    )
    .unwrap();
    rows_file(dir.path(), 80, 4);
    let cfg = write_config(
        dir.path(),
        "draws.yaml",
        "
model: {kind: python, path: draws.py}
data: {source: tensors, path: rows.safetensors}
train: {micro_batch_size: 8, grad_accum_steps: 1, max_steps: 3, eval_every: 0, seed: 3, device: cpu, num_threads: 1}
",
    );
    let draws = |name: &str, nproc: usize| {
        let prefix = dir.path().join(name);
        let mut c = train_command(dir.path(), &cfg, &dir.path().join(format!("run-{name}")), nproc);
        let o = c.env("DRAWS", &prefix).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        (0..nproc)
            .map(|r| std::fs::read_to_string(format!("{}-{r}", prefix.display())).unwrap())
            .collect::<Vec<_>>()
    };
    let first = draws("a", 2);
    assert_eq!(first[0].lines().count(), 3, "{first:?}");
    for (a, b) in first[0].lines().zip(first[1].lines()) {
        let (a, b): (Vec<&str>, Vec<&str>) = (a.split(' ').collect(), b.split(' ').collect());
        assert!(a[0] != b[0] && a[1] != b[1], "ranks drew the same numbers: {first:?}");
    }
    assert_eq!(draws("b", 2), first, "two runs of one seed drew different numbers");
    assert_eq!(draws("c", 1)[0], first[0], "one process drew other numbers than rank 0");
}

/// `dir/rows.safetensors`: `rows` random inputs of `dim` features and their targets (seeded),
/// for a Python model's `data: {source: tensors}`.
fn rows_file(dir: &Path, rows: usize, dim: usize) {
    let here = dir.to_str().unwrap();
    python(&[
        "-c",
        &format!(
            "import os, torch; os.chdir({here:?})\nfrom safetensors.torch import save_file\n\
             g = torch.Generator().manual_seed(1)\n\
             save_file({{'inputs': torch.randn({rows}, {dim}, generator=g), 'targets': torch.randn({rows}, 1, generator=g)}}, \
             'rows.safetensors')\n"
        ),
    ]);
}
