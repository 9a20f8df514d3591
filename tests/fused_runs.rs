//! `model.loss` end to end, through the binary: a fused run that hits injected OOMs ends with
//! the clean run's parameters (and the full loss's), and a GPT configured with `full` that
//! does not fit at micro-batch 1 climbs to the fused loss and trains.
mod common;
use common::*;

/// Injected allocation failures anywhere in a fused run (inside the loss's chunks included)
/// are recovered: the parameters are the clean fused run's, and within 1e-5 of the full
/// loss's clean run.
#[test]
fn fused_run_recovers_from_ooms_with_the_clean_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "tiny.yaml",
        &TINY.replace("vocab_size: 256", "vocab_size: 300"),
    );
    let run = |name: &str, extra: &[&str]| train_into(dir.path(), &cfg, name, extra);
    let full = run("full", &["--set", "model.loss=full"]);
    let clean = run("clean", &["--set", "model.loss=fused"]);
    let injected = run("injected", &["--set", "model.loss=fused", "--inject-oom", "6:3"]);
    assert_eq!(records(&injected, "oom").len(), 6);
    let d = max_abs_diff(&weights(&clean), &weights(&injected));
    assert!(d < 1e-5, "the OOMs changed the parameters by {d}");
    let d = max_abs_diff(&weights(&full), &weights(&clean));
    assert!(d < 1e-5, "fused and full differ by {d}");
    // model.safetensors keeps the configured vocabulary (300, padded to 320 inside).
    let wte = weights(&clean).into_iter().find(|(n, _)| n == "wte").unwrap().1;
    assert_eq!(wte.size(), vec![300, 32]);
    // One read back from the device per step.
    assert!(
        records(&clean, "step").iter().all(|s| s["d2h_reads"] == 1),
        "{:?}",
        records(&clean, "step")
    );
}

/// A GPT on `model.loss: full` whose micro-batch 1 does not fit its budget climbs the
/// cheapest rung, the fused loss, and trains on it (its logits alone would need 48 MiB).
#[test]
fn full_loss_that_does_not_fit_climbs_to_fused() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "model: {n_layer: 1, n_head: 2, n_embd: 64, block_size: 256, vocab_size: 16384, loss: full}\n\
                data: {source: embedded, embedded_bytes: 65536}\n\
                train: {micro_batch_size: 2, grad_accum_steps: 1, max_steps: 2, eval_every: 0, eval_batch_size: 1, eval_batches: 1, seed: 3, device: \
                cpu, num_threads: 1}\n\
                memory: {budget: 50MiB}\n";
    let cfg = write_config(dir.path(), "big_vocab.yaml", yaml);
    let run = train_ok(dir.path(), &cfg, &[]);
    let rungs = records(&run, "rung");
    assert_eq!(rungs.len(), 1, "{rungs:?}");
    assert_eq!(rungs[0]["rung"], "fused_loss");
    let steps = records(&run, "step");
    assert_eq!(steps.len(), 2);
    assert!(
        steps
            .iter()
            .all(|s| s["memory"]["peak_bytes"].as_u64().unwrap() <= 50 << 20),
        "{steps:?}"
    );
}
