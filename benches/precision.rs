//! `make bench` (precision): tokens/s and peak memory of one GPT on this CPU, fp32 against
//! bf16 autocast, and without against with activation checkpointing, alternated, median of
//! 3 runs each. This CPU (AVX2) has no native bf16: bf16 saves memory here, not time.
mod common;
use common::{events, median};
use std::process::Command;

const CONFIG: &str = "
model: {n_layer: 4, n_head: 4, n_embd: 128, block_size: 256, vocab_size: 256}
data: {source: embedded}
train: {micro_batch_size: 16, grad_accum_steps: 1, max_steps: 12, eval_every: 0, eval_batch_size: 4, eval_batches: 1, device: cpu}
memory: {budget: none}
log: {every: 1000}
";

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("p.yaml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let variants: [(&str, &[&str]); 4] = [
        ("fp32", &[]),
        ("bf16", &["train.precision=bf16"]),
        ("fp32 + checkpointing", &["model.activation_checkpointing=blocks"]),
        (
            "bf16 + checkpointing",
            &["train.precision=bf16", "model.activation_checkpointing=blocks"],
        ),
    ];
    let mut results: Vec<Vec<(f64, u64)>> = vec![vec![]; variants.len()];
    for round in 0..3 {
        for (i, (name, sets)) in variants.iter().enumerate() {
            let run = dir.path().join(format!("{round}-{i}"));
            let mut c = Command::new(env!("CARGO_BIN_EXE_oomguard"));
            c.args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
                .env("OOMGUARD_CACHE", dir.path());
            for s in *sets {
                c.args(["--set", s]);
            }
            assert!(
                c.stderr(std::process::Stdio::null()).status().unwrap().success(),
                "{name}"
            );
            let steps: Vec<serde_json::Value> = events(&run, "step").into_iter().skip(2).collect();
            let tps: Vec<f64> = steps.iter().map(|s| s["tokens_per_s"].as_f64().unwrap()).collect();
            let peak = steps
                .iter()
                .map(|s| s["memory"]["peak_bytes"].as_u64().unwrap())
                .max()
                .unwrap();
            results[i].push((median(tps), peak));
        }
    }
    let base = {
        let mut v = results[0].clone();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v[1]
    };
    println!("GPT 4x128, block 256, micro-batch 16, {} threads:", tch_threads());
    for (i, (name, _)) in variants.iter().enumerate() {
        let mut v = results[i].clone();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (tps, peak) = v[1];
        println!(
            "  {name:<22} {tps:>8.0} tok/s ({:.2}x fp32)   peak {:>6.1} MiB ({:.2}x fp32)",
            tps / base.0,
            peak as f64 / (1 << 20) as f64,
            peak as f64 / base.1 as f64
        );
    }
}

fn tch_threads() -> String {
    std::thread::available_parallelism()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}
