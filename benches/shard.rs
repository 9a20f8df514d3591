//! `make bench` (shard): ZeRO-1 and ZeRO-2 against plain data parallel on this machine, 2
//! ranks with one thread each, the same GPT and global batch, alternated, median of 3:
//! - step time of each stage over plain (floors: stage 1 at most 1.15x, stage 2 at most 1.25x);
//! - per-rank peak memory of each stage over plain;
//! - the largest model (parameters, by its vocabulary) that trains at micro-batch 1 under
//!   a fixed per-rank budget, for each stage, over plain (aim: 1.8x at 2 ranks).
mod common;
use common::{events, median};
use std::path::Path;
use std::process::{Command, Stdio};

const STAGES: [&str; 3] = ["none", "optimizer", "gradients"];

const CONFIG: &str = "
model: {n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, vocab_size: 256}
data: {source: embedded}
train: {micro_batch_size: 16, grad_accum_steps: 1, global_batch_size: 32, max_steps: 25, eval_every: 0, eval_batch_size: 4, eval_batches: 1, device: \
    cpu, num_threads: 1}
memory: {budget: none, snapshot: off}
log: {every: 1000}
";

/// A state-heavy GPT (a large vocabulary, a short sequence), one sample per rank.
fn heavy(vocab: u64) -> String {
    format!(
        "model: {{n_layer: 2, n_head: 2, n_embd: 64, block_size: 8, vocab_size: {vocab}}}
data: {{source: embedded}}
train: {{micro_batch_size: 1, global_batch_size: 2, max_steps: 2, eval_every: 0, eval_batch_size: 1, eval_batches: 1, device: cpu, num_threads: 1}}
memory: {{budget: {BUDGET}, snapshot: off, allow_sharding: false, allow_activation_checkpointing: false, allow_precision_fallback: false}}
checkpoint: {{every_steps: 0}}
"
    )
}

/// The fixed per-rank budget of the largest-model search.
const BUDGET: &str = "32MiB";

fn train(bin: &str, cfg: &Path, run: &Path, shard: &str, cache: &Path) -> bool {
    Command::new(bin)
        .args([
            "train",
            cfg.to_str().unwrap(),
            "--run-dir",
            run.to_str().unwrap(),
            "--nproc-per-node",
            "2",
            "--set",
            &format!("train.shard={shard}"),
        ])
        .env("OMP_NUM_THREADS", "1")
        .env("OOMGUARD_CACHE", cache)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// Median step time (steps 5..) and the run's peak bytes (rank 0).
fn measure(run: &Path) -> (f64, f64) {
    let steps: Vec<serde_json::Value> = events(run, "step").into_iter().skip(5).collect();
    let t = median(steps.iter().map(|s| s["step_time_s"].as_f64().unwrap()).collect());
    let peak = steps
        .iter()
        .map(|s| s["memory"]["peak_bytes"].as_f64().unwrap())
        .fold(0.0, f64::max);
    (t, peak)
}

/// The largest vocabulary (a multiple of 64, at least the 256 bytes) whose model trains 2 steps at micro-batch 1
/// under BUDGET at `shard`, with no rung to climb.
fn largest_vocab(bin: &str, dir: &Path, shard: &str) -> u64 {
    let fits = |v: u64| {
        let cfg = dir.join(format!("heavy-{v}.yaml"));
        std::fs::write(&cfg, heavy(v)).unwrap();
        let run = dir.join(format!("heavy-{shard}-{v}"));
        let ok = train(bin, &cfg, &run, shard, dir) && events(&run, "step").len() == 2;
        let _ = std::fs::remove_dir_all(&run);
        ok
    };
    let (mut lo, mut hi) = (4u64, 4096u64); // in units of 64, from the byte vocabulary (256)
    assert!(fits(lo * 64), "the smallest model does not fit {BUDGET}");
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(mid * 64) {
            lo = mid
        } else {
            hi = mid - 1
        }
    }
    lo * 64
}

/// Parameters of the heavy GPT at `vocab` (tied embeddings, biases).
fn params(vocab: u64) -> u64 {
    let (c, t, l) = (64u64, 8u64, 2u64);
    vocab * c + t * c + l * (12 * c * c + 13 * c) + 2 * c
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("dp.yaml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let bin = env!("CARGO_BIN_EXE_oomguard");
    let (mut time, mut peak) = (vec![vec![]; 3], vec![vec![]; 3]);
    for round in 0..3 {
        for (i, s) in STAGES.iter().enumerate() {
            let run = dir.path().join(format!("{s}{round}"));
            assert!(train(bin, &cfg, &run, s, dir.path()), "shard {s} failed");
            let (t, p) = measure(&run);
            time[i].push(t);
            peak[i].push(p);
        }
        println!(
            "round {round}: step time none {:.3}s, optimizer {:.3}s, gradients {:.3}s",
            time[0][round], time[1][round], time[2][round]
        );
    }
    let t: Vec<f64> = time.into_iter().map(median).collect();
    let p: Vec<f64> = peak.into_iter().map(median).collect();
    println!("2 ranks, 1 thread each, GPT 4x128, global batch 32 (Gloo; its reduce-scatter and all-gather as in-place all-reduces):");
    println!(
        "  step time over plain data parallel: optimizer {:.3}x (floor 1.15), gradients {:.3}x (floor 1.25)",
        t[1] / t[0],
        t[2] / t[0]
    );
    println!(
        "  per-rank peak memory over plain: optimizer {:.3}x, gradients {:.3}x ({:.1} MiB plain)",
        p[1] / p[0],
        p[2] / p[0],
        p[0] / 1048576.0
    );
    let v: Vec<u64> = STAGES.iter().map(|s| largest_vocab(bin, dir.path(), s)).collect();
    println!(
        "largest model at micro-batch 1 under {BUDGET} per rank (2 ranks; GPT 2x64, block 8, the vocabulary grown):"
    );
    for (s, &vocab) in STAGES.iter().zip(&v) {
        println!(
            "  train.shard: {s:<10} vocabulary {vocab:>6}: {:.2}M parameters, {:.2}x plain (aim 1.8x)",
            params(vocab) as f64 / 1e6,
            params(vocab) as f64 / params(v[0]) as f64
        );
    }
}
