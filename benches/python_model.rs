//! `make bench` (python_model): a GPT-2-small-shaped transformers model
//! (benches/scripts/gpt2_small.py: GPT2LMHeadModel, 12 layers, 768 wide, 50257 tokens)
//! trained by oomguard as `model.kind: python` against the same model file trained by a plain
//! eager PyTorch loop in the same venv (benches/scripts/py_eager.py), on the same token file
//! and the same samples, fused AdamW and clipping on both sides, alternated, 2 rounds each at
//! 1 and at 2 threads. A step is timed alike on both sides, from making its batch to the end
//! of its update; each run gives the median and the fastest tokens/s of its steps 2..; prints
//! the ratios (oomguard / eager) and the step time oomguard adds per micro-batch (the
//! Python-side overhead: the glue's calls, the batch crossing, the GIL, at one micro-batch a
//! step).
mod common;
use common::{events, median};
use std::path::Path;
use std::process::Command;

const BLOCK: usize = 256;
const BATCH: usize = 2;
const STEPS: usize = 7;
const SEED: u64 = 3;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join(".venv/bin/python3");
    let model = root.join("benches/scripts/gpt2_small.py");
    let dir = tempfile::tempdir().unwrap();
    // One token file for both sides: 2M tokens below GPT-2's vocabulary.
    let tokens = dir.path().join("tokens");
    std::fs::create_dir_all(&tokens).unwrap();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let bytes: Vec<u8> = (0..2_000_000)
        .flat_map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (((state >> 33) % 50257) as u16).to_le_bytes()
        })
        .collect();
    for f in ["train.bin", "val.bin"] {
        std::fs::write(tokens.join(f), &bytes).unwrap();
    }
    let settings = format!("{{\"block\": {BLOCK}}}");
    println!("python_model: GPT2LMHeadModel at GPT-2 small's shape (124M parameters), {BLOCK}-token windows, batch {BATCH}, {STEPS} steps a run (steps 2.. timed), eager with fused AdamW, alternated rounds");
    for threads in [1, 2] {
        let cfg = dir.path().join(format!("py{threads}.yaml"));
        std::fs::write(&cfg, format!(
            "model: {{kind: python, path: {}, loss: loss, settings: {settings}, block_size: {BLOCK}}}\n\
             data: {{source: tokens, path: {}}}\noptim: {{lr: 1.0e-4, weight_decay: 0.0, warmup_steps: 0}}\n\
             train: {{micro_batch_size: {BATCH}, grad_accum_steps: 1, max_steps: {STEPS}, eval_every: 0, eval_batch_size: 1, eval_batches: 1, seed: {SEED}, device: cpu, num_threads: {threads}}}\n\
             memory: {{budget: none}}\ncheckpoint: {{every_minutes: 0}}\nlog: {{every: 1000}}\n",
            model.display(), tokens.display()
        )).unwrap();
        let (mut median_ratios, mut fastest_ratios, mut overheads) = (vec![], vec![], vec![]);
        for round in 0..2 {
            let run = dir.path().join(format!("run{threads}-{round}"));
            let o = Command::new(env!("CARGO_BIN_EXE_oomguard"))
                .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
                .env("OOMGUARD_CACHE", dir.path().join("cache"))
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let tps: Vec<f64> = events(&run, "step")
                .iter()
                .skip(2)
                .map(|v| v["tokens_per_s"].as_f64().unwrap())
                .collect();
            let (ours, ours_fastest) = (median(tps.clone()), tps.iter().copied().fold(0.0, f64::max));
            let o = Command::new(&python)
                .arg(root.join("benches/scripts/py_eager.py"))
                .arg(&model)
                .arg(&settings)
                .arg(&tokens)
                .args([BLOCK, BATCH, STEPS, threads].map(|n| n.to_string()))
                .arg(SEED.to_string())
                .env("OMP_NUM_THREADS", threads.to_string())
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let e = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap();
            let (eager, eager_fastest) = (
                e["tokens_per_s"].as_f64().unwrap(),
                e["fastest_tokens_per_s"].as_f64().unwrap(),
            );
            let tokens_per_step = (BLOCK * BATCH) as f64;
            let overhead_ms = 1e3 * (tokens_per_step / ours - tokens_per_step / eager);
            println!(
                "{threads} thread(s), round {}: median step: oomguard {ours:.0} tok/s, eager {eager:.0} (ratio {:.3}); fastest step: oomguard {ours_fastest:.0}, eager {eager_fastest:.0} (ratio {:.3}); oomguard adds {overhead_ms:+.1} ms a micro-batch",
                round + 1, ours / eager, ours_fastest / eager_fastest
            );
            median_ratios.push(ours / eager);
            fastest_ratios.push(ours_fastest / eager_fastest);
            overheads.push(overhead_ms);
        }
        println!(
            "  {threads} thread(s): ratio oomguard / eager, median of the rounds: median step {:.3}, fastest step {:.3}; added per micro-batch {:+.1} ms",
            median(median_ratios),
            median(fastest_ratios),
            median(overheads)
        );
    }
}
