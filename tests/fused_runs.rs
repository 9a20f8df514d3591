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

/// Masked targets (-100, an SFT's prompt tokens, in a `tensors` file): a micro-batch weighs
/// its valid tokens over the step's, so the split does not change the gradient. Micro-batch
/// 16, 4 and 1 (whole micro-batches then fully masked), a run re-split by OOMs and two
/// data-parallel ranks end with the same parameters, on the full loss and the fused one,
/// and evaluate alike.
#[test]
fn masked_targets_weigh_by_valid_tokens_whatever_the_split() {
    use tch::{Device, Kind, Tensor};
    let dir = tempfile::tempdir().unwrap();
    tch::manual_seed(3);
    let inputs = Tensor::randint(64, [40, 16], (Kind::Int64, Device::Cpu));
    let targets = inputs.roll([-1], [1]);
    for i in 0..40 {
        // Row i ignores its first i % 17 targets: row 16 all of them.
        let _ = targets.narrow(0, i, 1).narrow(1, 0, i % 17).fill_(-100);
    }
    Tensor::write_safetensors(
        &[("inputs", &inputs), ("targets", &targets)],
        dir.path().join("d.safetensors"),
    )
    .unwrap();
    let cfg = write_config(
        dir.path(),
        "sft.yaml",
        "
model: {n_layer: 1, n_head: 2, n_embd: 32, block_size: 16, vocab_size: 64}
data: {source: tensors, path: d.safetensors, val_fraction: 0.2}
optim: {lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 1}
train: {micro_batch_size: 16, grad_accum_steps: 1, max_steps: 3, eval_every: 3, eval_batch_size: 8, eval_batches: 1, seed: 7, device: cpu, num_threads: 1}
",
    );
    for loss in ["full", "fused"] {
        let set = format!("model.loss={loss}");
        let run = |name: &str, extra: &[&str]| {
            let mut args = vec!["--set", set.as_str()];
            args.extend_from_slice(extra);
            train_into(dir.path(), &cfg, &format!("{loss}-{name}"), &args)
        };
        let whole = run("whole", &[]);
        let val = |r: &std::path::Path| records(r, "eval")[0]["val_loss"].as_f64().unwrap();
        assert!(val(&whole).is_finite(), "{:?}", records(&whole, "eval"));
        for (name, extra) in [
            (
                "mb4",
                vec!["--set", "train.micro_batch_size=4", "--set", "train.grad_accum_steps=4"],
            ),
            (
                "mb1",
                vec![
                    "--set",
                    "train.micro_batch_size=1",
                    "--set",
                    "train.grad_accum_steps=16",
                ],
            ),
            ("ooms", vec!["--inject-oom", "4:5"]),
            ("2ranks", vec!["--nproc-per-node", "2"]),
        ] {
            let r = run(name, &extra);
            let d = max_abs_diff(&weights(&whole), &weights(&r));
            assert!(d < 1e-5, "{loss} {name}: the split changed the parameters by {d}");
            let (a, b) = (val(&whole), val(&r));
            assert!((a - b).abs() < 1e-5, "{loss} {name}: val loss {a} against {b}");
            if name == "ooms" {
                assert!(!records(&r, "oom").is_empty(), "no OOM was injected");
            }
        }
    }
}
