//! `make bench` (shard): ZeRO-1 and ZeRO-2 against plain data parallel on this machine, 2
//! ranks with one thread each, the same GPT and global batch:
//! - step time of each stage over plain, 5 rounds in an order that turns each round, the
//!   median of the rounds' ratios (floors: stage 1 at most 1.15x, stage 2 at most 1.25x);
//!   and by phase: plain's step with its reduction, agreements and update (`comm_s`,
//!   `update_s`) swapped for the stage's, which takes out the VM's swings in forward and
//!   backward (the same work in every stage);
//! - per-rank peak memory of each stage over plain (medians over the rounds);
//! - the largest model that trains at micro-batch 1 under a fixed per-rank budget, for each
//!   stage, over plain (goal: 1.6x at 2 ranks for ZeRO-2), grown two ways: by its vocabulary
//!   (a tied embedding, one gradient that is whole on every rank at some point of backward)
//!   and by its depth (many matrices, which ZeRO-2 sums bucket by bucket and drops); with
//!   what `oomguard plan` predicts for each.
mod common;
use common::{events, median};
use std::path::Path;
use std::process::{Command, Stdio};

const STAGES: [&str; 3] = ["none", "optimizer", "gradients"];

/// Rounds of the step-time comparison (each runs every stage once).
const ROUNDS: usize = 5;

const CONFIG: &str = "
model: {n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, vocab_size: 256}
data: {source: embedded}
train: {micro_batch_size: 16, grad_accum_steps: 1, global_batch_size: 32, max_steps: 25, eval_every: 0, eval_batch_size: 4, eval_batches: 1, device: \
    cpu, num_threads: 1}
memory: {budget: none, snapshot: off}
log: {every: 1000}
";

/// A state-heavy GPT (a short sequence), one sample per rank, grown by `grow`.
fn heavy(grow: Grow, size: u64) -> String {
    let (layers, vocab) = match grow {
        Grow::Vocab => (2, size),
        Grow::Depth => (size, 256),
    };
    format!(
        "model: {{n_layer: {layers}, n_head: 2, n_embd: 64, block_size: 8, vocab_size: {vocab}}}
data: {{source: embedded}}
train: {{micro_batch_size: 1, global_batch_size: 2, max_steps: 2, eval_every: 0, eval_batch_size: 1, eval_batches: 1, device: cpu, num_threads: 1}}
memory: {{budget: {BUDGET}, snapshot: off, allow_sharding: false, allow_activation_checkpointing: false, allow_precision_fallback: false}}
checkpoint: {{every_steps: 0}}
"
    )
}

/// How the largest-model search grows the heavy GPT.
#[derive(Clone, Copy, PartialEq)]
enum Grow {
    /// The vocabulary, in steps of 64 from 256 (GPT 2x64).
    Vocab,
    /// The layers, from 1 (GPT Lx64, vocabulary 256).
    Depth,
}

impl Grow {
    fn range(self) -> (u64, u64) {
        match self {
            Grow::Vocab => (4, 4096),
            Grow::Depth => (1, 512),
        }
    }
    fn size(self, unit: u64) -> u64 {
        match self {
            Grow::Vocab => unit * 64,
            Grow::Depth => unit,
        }
    }
    /// Parameters of the heavy GPT (tied embeddings, biases).
    fn params(self, size: u64) -> u64 {
        let (c, t) = (64u64, 8u64);
        let (l, v) = match self {
            Grow::Vocab => (2, size),
            Grow::Depth => (size, 256),
        };
        v * c + t * c + l * (12 * c * c + 13 * c) + 2 * c
    }
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

/// Median step time (steps 5..), the median seconds a step spends beyond forward and
/// backward (`comm_s`: the reduction's exposed part and the agreements; `update_s`: the
/// update with ZeRO's all-gather), and the run's peak bytes (rank 0).
fn measure(run: &Path) -> (f64, f64, f64) {
    let steps: Vec<serde_json::Value> = events(run, "step").into_iter().skip(5).collect();
    let of = |f: &dyn Fn(&serde_json::Value) -> f64| median(steps.iter().map(f).collect());
    let t = of(&|s| s["step_time_s"].as_f64().unwrap());
    let beyond = of(&|s| s["comm_s"].as_f64().unwrap() + s["update_s"].as_f64().unwrap());
    let peak = steps
        .iter()
        .map(|s| s["memory"]["peak_bytes"].as_f64().unwrap())
        .fold(0.0, f64::max);
    (t, beyond, peak)
}

/// The largest size (`Grow`) whose model trains 2 steps at micro-batch 1 under BUDGET at
/// `shard`, with no rung to climb; with `plan`, the largest `oomguard plan` says fits.
fn largest(bin: &str, dir: &Path, grow: Grow, shard: &str, plan: bool) -> u64 {
    let fits = |size: u64| {
        let cfg = dir.join(format!("heavy-{size}.yaml"));
        std::fs::write(&cfg, heavy(grow, size)).unwrap();
        if plan {
            return plans_to_fit(bin, &cfg, shard);
        }
        let run = dir.join(format!("heavy-{shard}-{size}"));
        let ok = train(bin, &cfg, &run, shard, dir) && events(&run, "step").len() == 2;
        let _ = std::fs::remove_dir_all(&run);
        ok
    };
    let (mut lo, mut hi) = grow.range();
    assert!(fits(grow.size(lo)), "the smallest model does not fit {BUDGET}");
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(grow.size(mid)) {
            lo = mid
        } else {
            hi = mid - 1
        }
    }
    grow.size(lo)
}

/// Whether `oomguard plan` says micro-batch 1 fits at `shard` on 2 ranks (the config's
/// `memory.budget`, BUDGET, is what it plans against on the CPU).
fn plans_to_fit(bin: &str, cfg: &Path, shard: &str) -> bool {
    let out = Command::new(bin)
        .args(["plan", cfg.to_str().unwrap(), "--nproc-per-node", "2", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["shards"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["shard"] == shard))
        .is_some_and(|r| r["largest_micro_batch_size"].as_u64().unwrap_or(0) >= 1)
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("dp.yaml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let bin = env!("CARGO_BIN_EXE_oomguard");
    let (mut time, mut beyond, mut peak) = (vec![vec![]; 3], vec![vec![]; 3], vec![vec![]; 3]);
    for round in 0..ROUNDS {
        // The order turns each round, so that no stage always runs first or last.
        for k in 0..STAGES.len() {
            let i = (k + round) % STAGES.len();
            let s = STAGES[i];
            let run = dir.path().join(format!("{s}{round}"));
            assert!(train(bin, &cfg, &run, s, dir.path()), "shard {s} failed");
            let (t, b, p) = measure(&run);
            time[i].push(t);
            beyond[i].push(b);
            peak[i].push(p);
        }
        println!(
            "round {round}: step time none {:.3}s, optimizer {:.3}s ({:.3}x), gradients {:.3}s ({:.3}x)",
            time[0][round],
            time[1][round],
            time[1][round] / time[0][round],
            time[2][round],
            time[2][round] / time[0][round]
        );
    }
    // Each stage over plain within a round (minutes apart at most, so the VM's slow
    // stretches fall on both sides), then the median over the rounds, and their range.
    let over = |i: usize| -> (f64, f64, f64) {
        let r: Vec<f64> = time[i].iter().zip(&time[0]).map(|(t, p)| t / p).collect();
        let (lo, hi) = (
            r.iter().cloned().fold(f64::INFINITY, f64::min),
            r.iter().cloned().fold(0.0, f64::max),
        );
        (median(r), lo, hi)
    };
    // By phase: plain's step with its reduction, agreements and update swapped for the
    // stage's (forward and backward are the same work in every stage, so this takes out
    // the VM's swings in them; stage 2's overlapped reduction runs inside its backward, so
    // only its exposed part is counted).
    let by_phase = |i: usize| -> (f64, f64) {
        let r: Vec<f64> = (0..ROUNDS)
            .map(|k| (time[0][k] - beyond[0][k] + beyond[i][k]) / time[0][k])
            .collect();
        let ms: Vec<f64> = (0..ROUNDS).map(|k| 1e3 * (beyond[i][k] - beyond[0][k])).collect();
        (median(r), median(ms))
    };
    let p: Vec<f64> = peak.into_iter().map(median).collect();
    println!("2 ranks, 1 thread each, GPT 4x128, global batch 32 (shared memory in front of Gloo, one host; the reduce-scatter as an in-place all-reduce, the all-gather as in-place broadcasts):");
    let ((o, olo, ohi), (g, glo, ghi)) = (over(1), over(2));
    println!(
        "  step time over plain data parallel (median of the rounds' ratios): optimizer {o:.3}x (floor 1.15; rounds {olo:.3}..{ohi:.3}), gradients \
         {g:.3}x (floor 1.25; rounds {glo:.3}..{ghi:.3})"
    );
    let ((o, oms), (g, gms)) = (by_phase(1), by_phase(2));
    println!(
        "  by phase (plain's forward and backward, each stage's reduction, agreements and update with its all-gather): optimizer \
         {o:.3}x ({oms:+.1} ms a step), gradients {g:.3}x ({gms:+.1} ms; its reduction during backward not counted)"
    );
    println!(
        "  per-rank peak memory over plain: optimizer {:.3}x, gradients {:.3}x ({:.1} MiB plain)",
        p[1] / p[0],
        p[2] / p[0],
        p[0] / 1048576.0
    );
    for (grow, what) in [
        (Grow::Vocab, "GPT 2x64, block 8, the vocabulary grown"),
        (Grow::Depth, "GPT Lx64, block 8, vocabulary 256, the layers grown"),
    ] {
        let v: Vec<u64> = STAGES
            .iter()
            .map(|s| largest(bin, dir.path(), grow, s, false))
            .collect();
        let planned: Vec<u64> = STAGES.iter().map(|s| largest(bin, dir.path(), grow, s, true)).collect();
        println!("largest model at micro-batch 1 under {BUDGET} per rank (2 ranks; {what}):");
        for ((s, &size), &plan) in STAGES.iter().zip(&v).zip(&planned) {
            let name = if grow == Grow::Vocab { "vocabulary" } else { "layers" };
            println!(
                "  train.shard: {s:<10} {name} {size:>6}: {:.2}M parameters, {:.2}x plain (goal for gradients 1.6x); oomguard plan: {name} {plan}, {:.2}M",
                grow.params(size) as f64 / 1e6,
                grow.params(size) as f64 / grow.params(v[0]) as f64,
                grow.params(plan) as f64 / 1e6,
            );
        }
    }
}
