//! The allocation guard, end to end through the binary, with real libtorch allocation
//! failures under a CPU memory budget (and, in-process, what `time_lost_s` counts). CPU only
//! (the GPU kit runs it to check its binaries against a host's torch; tests/cuda_guard.rs is
//! the CUDA half).
mod common;
use common::*;
use serde_json::Value;
use std::path::Path;

/// (live bytes at step start, peak bytes) of a tiny run at `micro` with no budget.
fn measure(dir: &Path, cfg: &Path, micro: usize) -> (u64, u64) {
    let run = dir.join(format!("measure{micro}"));
    let o = oomguard(
        &[
            "train",
            cfg.to_str().unwrap(),
            "--run-dir",
            run.to_str().unwrap(),
            "--max-steps",
            "1",
            "--memory-budget",
            "none",
            "--set",
            &format!("train.micro_batch_size={micro}"),
            "--set",
            &format!("train.grad_accum_steps={}", 16 / micro),
        ],
        dir,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let r = &records(&run, "step")[0];
    assert_eq!(r["device"], "cpu", "{r}");
    (
        r["memory"]["live_bytes"].as_u64().unwrap(),
        r["memory"]["peak_bytes"].as_u64().unwrap(),
    )
}

fn oom_events(run: &Path) -> Vec<Value> {
    records(run, "oom")
}

/// Forced through two halvings (8 -> 4 -> 2), the run ends with the parameters and the
/// evaluation of a run without a budget, every step on the full global batch, and every
/// recovery back to the step's starting memory.
#[test]
fn equivalence_no_leak_and_eval_guard() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "tiny.yaml",
        &TINY.replace("eval_batch_size: 8", "eval_batch_size: 16"),
    );
    let (_, p2) = measure(dir.path(), &cfg, 2);
    let (_, p4) = measure(dir.path(), &cfg, 4);
    let budget = ((p2 + p4) / 2).to_string();

    let free = train_ok(dir.path(), &cfg, &["--memory-budget", "none"]);
    std::fs::rename(&free, dir.path().join("free")).unwrap();
    let free = dir.path().join("free");
    let guarded = train_ok(
        dir.path(),
        &cfg,
        &["--memory-budget", &budget, "--set", "memory.cooldown_steps=1000"],
    );

    let ooms = oom_events(&guarded);
    let train_ooms: Vec<&Value> = ooms.iter().filter(|e| e["phase"] != "eval").collect();
    assert_eq!(train_ooms.len(), 2, "{ooms:?}");
    assert_eq!(
        (
            train_ooms[0]["old_micro_batch_size"].as_u64(),
            train_ooms[0]["new_micro_batch_size"].as_u64()
        ),
        (Some(8), Some(4))
    );
    assert_eq!(
        (
            train_ooms[1]["old_micro_batch_size"].as_u64(),
            train_ooms[1]["new_micro_batch_size"].as_u64()
        ),
        (Some(4), Some(2))
    );
    for e in &ooms {
        assert_eq!(e["source"], "budget");
        assert!(e["requested_bytes"].as_u64().unwrap() > 0);
        // No leak: cleanup returns live memory exactly to the step's starting level.
        assert_eq!(e["memory_before"], e["memory_after_cleanup"], "{e}");
    }
    // The evaluation shrank under its own guard without touching training's size; its
    // record says the batch asked for and the micro-batch it ran in.
    let shrunk = ooms.iter().rfind(|e| e["phase"] == "eval");
    let shrunk = shrunk.unwrap_or_else(|| panic!("{ooms:?}"))["new_micro_batch_size"].as_u64();
    let eval = &records(&guarded, "eval")[0];
    assert_eq!(
        (eval["eval_batch_size"].as_u64(), eval["eval_micro_batch_size"].as_u64()),
        (Some(16), shrunk),
        "{eval}"
    );

    let steps = records(&guarded, "step");
    assert_eq!(steps.len(), 6);
    // The time lost is part of the step that lost it: the two failed attempts of step 0 and
    // their cleanup took some time, less than the whole step (which also ran the good one).
    let lost: f64 = train_ooms.iter().map(|e| e["time_lost_s"].as_f64().unwrap()).sum();
    let step0 = steps[0]["step_time_s"].as_f64().unwrap();
    assert!(
        train_ooms
            .iter()
            .all(|e| e["step"] == 0 && e["time_lost_s"].as_f64().unwrap() > 0.0),
        "{train_ooms:?}"
    );
    assert!(lost < step0, "{lost} s lost in a step of {step0} s");
    for s in &steps {
        assert_eq!(s["num_samples"], 16);
        assert_eq!(
            (s["micro_batch_size"].as_u64(), s["grad_accum_steps"].as_u64()),
            (Some(2), Some(8))
        );
    }
    let d = max_abs_diff(&weights(&free), &weights(&guarded));
    assert!(d < 1e-5, "parameters differ by {d}");
    let (a, b) = (losses(&free), losses(&guarded));
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
    }
    let val = |run: &Path| records(run, "eval")[0]["val_loss"].as_f64().unwrap();
    assert!((val(&free) - val(&guarded)).abs() < 1e-5);
}

/// Under transient pressure the micro-batch shrinks, then grows back once it lifts.
#[test]
fn grows_back_when_pressure_lifts() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    let (_, p4) = measure(dir.path(), &cfg, 4);
    let (_, p8) = measure(dir.path(), &cfg, 8);
    let delta = p8 - p4;
    let budget = p8 + delta;
    let pressure = delta * 3 / 2; // 8 + pressure > budget; 4 + pressure fits
    let yaml = TINY.replace("max_steps: 6", "max_steps: 14")
        + &format!("memory: {{grow_after_steps: 2, cooldown_steps: 4, grow_headroom: 0.0, pressure: [{{from_step: 0, to_step: 6, size: '{pressure}'}}]}}\n");
    let cfg = write_config(dir.path(), "pressure.yaml", &yaml);
    let run = train_ok(dir.path(), &cfg, &["--memory-budget", &budget.to_string()]);

    let ooms = oom_events(&run);
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    assert_eq!(ooms[0]["step"], 0);
    let grows = records(&run, "grow");
    assert_eq!(grows.len(), 1, "{grows:?}");
    assert_eq!(
        (
            grows[0]["old_micro_batch_size"].as_u64(),
            grows[0]["new_micro_batch_size"].as_u64()
        ),
        (Some(4), Some(8))
    );
    let grew_at = grows[0]["step"].as_u64().unwrap();
    assert!(grew_at >= 6, "grew at step {grew_at}, while the pressure was still on");
    let sizes: Vec<u64> = records(&run, "step")
        .iter()
        .map(|s| s["micro_batch_size"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes[..6], [4; 6]);
    assert_eq!(*sizes.last().unwrap(), 8, "{sizes:?}");
}

/// A step that does not fit even at micro-batch 1 (with the rungs below it turned off):
/// exit code 3, a message saying what to change, the OOM history in metrics.jsonl, and a
/// checkpoint to resume from.
#[test]
fn infeasible_exits_3_with_message_and_weights() {
    let dir = tempfile::tempdir().unwrap();
    let no_rungs = "memory: {allow_activation_checkpointing: false, allow_precision_fallback: false}\n";
    let cfg = write_config(dir.path(), "tiny.yaml", &(TINY.to_string() + no_rungs));
    let (base, p1) = measure(dir.path(), &cfg, 1);
    let budget = (base + (p1 - base) / 2).to_string();
    let run = dir.path().join("run");
    let o = train_at(dir.path(), &cfg, &run, &["--memory-budget", &budget]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("does not fit in memory even at micro-batch 1"), "{err}");
    assert!(
        err.contains("raise memory.budget") && err.contains("model.block_size"),
        "{err}"
    );
    let sizes: Vec<u64> = oom_events(&run)
        .iter()
        .map(|e| e["new_micro_batch_size"].as_u64().unwrap())
        .collect();
    // Halvings to 1, one retry at 1 (memory.retries_at_one), then it gives up.
    assert_eq!(sizes, vec![4, 2, 1, 1, 0]);
    // The weights saved on the way out are the ones of the checkpoint at the step that did
    // not fit (nothing was applied), and that checkpoint resumes (with more memory) to the
    // parameters of a run that never ran out (at micro-batch 1 now, so to 1e-5).
    let ckpt = run.join("checkpoints/step-00000000");
    assert_eq!(
        max_abs_diff(&weights(&run), &safetensors(&ckpt.join("model.safetensors"))),
        0.0
    );
    let o = resume(dir.path(), &cfg, &run, &["--memory-budget", "none"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let clean = train_into(dir.path(), &cfg, "clean", &["--memory-budget", "none"]);
    let d = max_abs_diff(&weights(&run), &weights(&clean));
    assert!(
        d < 1e-5,
        "resumed from the exit's checkpoint, the parameters differ from a clean run's by {d}"
    );
}

/// `time_lost_s` is the failed attempt's time: at least the 50 ms it spent before its
/// allocation failed (a real one, refused by libtorch's allocator), less than the whole
/// step, which also ran the good attempt (50 ms more). In-process; no global state touched.
#[test]
fn time_lost_is_the_failed_attempts() {
    use oomguard::guard::{Guard, GuardEvent};
    use std::time::{Duration, Instant};
    let mut guard = Guard::new(&Default::default(), 8, tch::Device::Cpu);
    let t = Instant::now();
    let sizes = guard.run(
        0,
        &mut Vec::new(),
        |tried: &mut Vec<usize>, mb| {
            tried.push(mb);
            std::thread::sleep(Duration::from_millis(50));
            // 4 PiB at micro-batch 8: no machine has it.
            let elements = if mb == 8 { 1i64 << 50 } else { 1 };
            let _held = tch::Tensor::f_empty([elements], (tch::Kind::Float, tch::Device::Cpu))?;
            Ok(tried.clone())
        },
        |_| {},
    );
    let step = t.elapsed().as_secs_f64();
    assert_eq!(sizes.unwrap(), [8, 4]);
    let lost: Vec<f64> = guard
        .drain_events()
        .into_iter()
        .filter_map(|e| match e {
            GuardEvent::Oom(o) => Some(o.time_lost_s),
            _ => None,
        })
        .collect();
    assert_eq!(lost.len(), 1);
    assert!(
        lost[0] >= 0.05 && lost[0] <= step - 0.05,
        "{} s lost in a step of {step} s",
        lost[0]
    );
}

/// `oomguard train` of TINY plus `extra`, with `env`: exit 2, saying `says`.
fn refused(dir: &std::path::Path, name: &str, extra: &str, env: &[(&str, &str)], says: &str) {
    let cfg = write_config(dir, name, &(TINY.to_string() + extra));
    let o = isolated(&mut std::process::Command::new(common::bin()), dir)
        .args(["train", cfg.to_str().unwrap()])
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains(says), "{}", stderr(&o));
}

#[test]
fn allocator_settings_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    refused(
        dir.path(),
        "a.yaml",
        "memory: {allocator: {expandable_segments: yes}}\n",
        &[],
        "memory.allocator.expandable_segments: `yes` is not a bool libtorch reads; write True or False",
    );
    refused(
        dir.path(),
        "b.yaml",
        "memory: {allocator: {max_split_size: 128}}\n",
        &[],
        "unknown allocator setting `max_split_size`",
    );
    refused(
        dir.path(),
        "c.yaml",
        "",
        &[("PYTORCH_ALLOC_CONF", "expandable_segments:true")],
        "PYTORCH_ALLOC_CONF: expandable_segments: `true` is not a bool",
    );
}

/// backend:cudaMallocAsync is read when libtorch loads: the process restarts itself with
/// the merged settings in its environment, and the run proceeds.
#[test]
fn load_time_allocator_backend_restarts_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "a.yaml",
        &(TINY.to_string() + "memory: {allocator: {backend: cudaMallocAsync, max_split_size_mb: 64}}\n"),
    );
    let run = dir.path().join("run");
    let o = isolated(&mut std::process::Command::new(common::bin()), dir.path())
        .args([
            "train",
            cfg.to_str().unwrap(),
            "--run-dir",
            run.to_str().unwrap(),
            "--max-steps",
            "1",
        ])
        .current_dir(dir.path())
        .env("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(
            "restarting so that libtorch loads with allocator settings `backend:cudaMallocAsync,max_split_size_mb:128`"
        ),
        "{err}"
    );
    assert!(
        err.contains("allocator settings: backend:cudaMallocAsync,max_split_size_mb:128"),
        "{err}"
    );
    assert_eq!(records(&run, "step").len(), 1);
}

/// A model that does not fit at all: exit 3 (never a panic) with what it needs and what
/// would fit, at once, before anything is allocated: a tiny budget, and the 10-million-word
/// vocabulary that took a user's overnight sweep down (../shared/seeds/003).
#[test]
fn a_model_that_cannot_fit_at_start_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let demo = common::root().join("configs/demo.yaml");
    let run = dir.path().join("a");
    let o = train_at(dir.path(), &demo, &run, &["--memory-budget", "1MiB"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("the model does not fit in memory: its weights, gradients and AdamW state alone need 12.9 MiB"),
        "{err}"
    );
    assert!(err.contains("What would fit:") && !err.contains("panicked"), "{err}");

    let t = std::time::Instant::now();
    let run = dir.path().join("b");
    let args = [
        "train",
        demo.to_str().unwrap(),
        "--run-dir",
        run.to_str().unwrap(),
        "--memory-budget",
        "3GiB",
        "--set",
        "model.vocab_size=10000000",
        "--set",
        "model.n_embd=64",
        "--set",
        "model.n_head=4",
    ];
    let o = oomguard(&args, dir.path());
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("(640.21M parameters)") && err.contains("a smaller vocabulary: model.vocab_size"),
        "{err}"
    );
    assert!(
        t.elapsed().as_secs() < 10,
        "the planner should tell before minutes are spent"
    );
}
