//! End-to-end training through the binary: golden losses, learning, and the same samples
//! giving the same result however the global batch is split.
mod common;
use common::*;

/// Per-step losses of the tiny run match tests/golden/: `tiny_losses.json` with
/// `model.loss: full` (the values from before the fused loss existed), `tiny_losses_fused.json`
/// with `fused` (the default). Regenerate with OOMGUARD_BLESS=1 after a deliberate change to
/// the model, data or optimiser.
#[test]
fn golden_losses() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    for (loss, file) in [("full", "tiny_losses.json"), ("fused", "tiny_losses_fused.json")] {
        let run = train_into(dir.path(), &cfg, loss, &["--set", &format!("model.loss={loss}")]);
        let got = losses(&run);
        let golden = common::root().join("tests/golden").join(file);
        if std::env::var_os("OOMGUARD_BLESS").is_some() {
            std::fs::write(&golden, serde_json::to_string_pretty(&got).unwrap()).unwrap();
        }
        let want: Vec<f64> = serde_json::from_str(&std::fs::read_to_string(&golden).unwrap()).unwrap();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() < 1e-4, "{loss}: step {i}: loss {g} but golden {w}");
        }
    }
}

#[test]
fn demo_learns() {
    let dir = tempfile::tempdir().unwrap();
    let demo = common::root().join("configs/demo.yaml");
    let run = train_ok(
        dir.path(),
        &demo,
        &[
            "--max-steps",
            "40",
            "--set",
            "train.eval_every=20",
            "--set",
            "optim.warmup_steps=5",
        ],
    );
    let l = losses(&run);
    let head: f64 = l[..3].iter().sum::<f64>() / 3.0;
    let tail: f64 = l[l.len() - 3..].iter().sum::<f64>() / 3.0;
    assert!(tail < 0.6 * head, "loss did not fall clearly: {head:.3} -> {tail:.3}");
    let evals = records(&run, "eval");
    assert_eq!(evals.len(), 2);
    assert!(evals[1]["val_loss"].as_f64().unwrap() < 0.7 * head);
    // Every step record carries the contract fields.
    for r in records(&run, "step") {
        for k in [
            "step",
            "loss",
            "lr",
            "tokens_per_s",
            "micro_batch_size",
            "grad_accum_steps",
            "memory",
        ] {
            assert!(!r[k].is_null(), "{k} missing in {r}");
        }
        assert!(r["memory"]["peak_bytes"].as_u64().unwrap() > 0);
    }
    assert!(run.join("config.yaml").is_file() && run.join("train.log").is_file());
    let log = std::fs::read_to_string(run.join("train.log")).unwrap();
    assert!(log.contains("step    40/40"), "{log}");
}

/// Same samples, same result: 8 x 2 and 4 x 4 end with the same parameters.
#[test]
fn micro_batch_split_does_not_change_the_result() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    let a = train_ok(dir.path(), &cfg, &[]);
    std::fs::rename(&a, dir.path().join("a")).unwrap();
    let b = train_ok(
        dir.path(),
        &cfg,
        &["--set", "train.micro_batch_size=4", "--set", "train.grad_accum_steps=4"],
    );
    assert_eq!(records(&b, "step")[0]["grad_accum_steps"], 4);
    let d = max_abs_diff(&weights(&dir.path().join("a")), &weights(&b));
    assert!(d < 1e-5, "parameters differ by {d}");
}

#[test]
fn run_dir_with_a_run_is_not_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    let run = train_ok(dir.path(), &cfg, &["--max-steps", "1"]);
    let before = std::fs::read(run.join("metrics.jsonl")).unwrap();
    let o = train_at(dir.path(), &cfg, &run, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("already holds a run"));
    assert_eq!(std::fs::read(run.join("metrics.jsonl")).unwrap(), before);
}
