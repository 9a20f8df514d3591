//! `make bench` (eager_gpt): oomguard's built-in GPT trained by `oomguard train` (its default
//! `model.loss: fused`, one read back per step) against the same GPT in eager PyTorch
//! (benches/scripts/gpt_eager.py: full logits and F.cross_entropy, fused AdamW, clipping, the
//! loss read with .item() each step), at 1 and at 2 threads, alternated in one run (which
//! goes first alternates by round), 3 rounds per thread count. A step is timed alike on both
//! sides, from making its batch to the end of its update; each run gives the median and the
//! fastest tokens/s of its steps 3..; prints each round's ratios and their medians
//! (oomguard / eager; aim >= 1.0).
mod common;
use common::median;
use std::path::Path;
use std::process::Command;

const SHAPE: [usize; 5] = [4, 4, 256, 128, 256]; // layers, heads, embd, block, vocab
const BATCH: usize = 16;
const STEPS: usize = 15;
const ROUNDS: usize = 3;

fn oomguard(dir: &Path, round: usize, threads: usize) -> (f64, f64) {
    let [l, h, c, t, v] = SHAPE;
    let cfg = dir.join(format!("gpt{threads}.yaml"));
    std::fs::write(&cfg, format!(
        "model: {{n_layer: {l}, n_head: {h}, n_embd: {c}, block_size: {t}, vocab_size: {v}}}\ndata: {{source: embedded}}\n\
         train: {{micro_batch_size: {BATCH}, grad_accum_steps: 1, max_steps: {STEPS}, eval_every: 0, eval_batch_size: 4, eval_batches: 1, device: \
         cpu, num_threads: {threads}}}\n\
         memory: {{budget: none}}\nlog: {{every: 1000}}\n"
    )).unwrap();
    let run = dir.join(format!("run{threads}-{round}"));
    common::train_tokens_per_s(&cfg, &run, &dir.join("cache"))
}

fn eager(root: &Path, threads: usize) -> (f64, f64) {
    let args: Vec<String> = SHAPE
        .iter()
        .chain(&[BATCH, STEPS, threads])
        .map(|n| n.to_string())
        .collect();
    let o = Command::new(root.join(".venv/bin/python3"))
        .arg(root.join("benches/scripts/gpt_eager.py"))
        .args(&args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let e = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap();
    (
        e["tokens_per_s"].as_f64().unwrap(),
        e["fastest_tokens_per_s"].as_f64().unwrap(),
    )
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let [l, h, c, t, v] = SHAPE;
    println!("GPT n_layer {l}, n_head {h}, n_embd {c}, block {t}, vocab {v}, batch {BATCH}, {STEPS} steps; tokens/s of steps 3..");
    for threads in [1, 2] {
        let (mut med, mut fast) = (vec![], vec![]);
        for round in 0..ROUNDS {
            let ((ours, ours_fastest), (theirs, theirs_fastest)) = if round % 2 == 0 {
                let o = oomguard(dir.path(), round, threads);
                (o, eager(root, threads))
            } else {
                let e = eager(root, threads);
                (oomguard(dir.path(), round, threads), e)
            };
            println!(
                "{threads} thread(s), round {}: median step: oomguard {ours:.0} tok/s, eager {theirs:.0} (ratio {:.3}); fastest step: oomguard \
                    {ours_fastest:.0}, eager {theirs_fastest:.0} (ratio {:.3})",
                round + 1, ours / theirs, ours_fastest / theirs_fastest
            );
            med.push(ours / theirs);
            fast.push(ours_fastest / theirs_fastest);
        }
        println!("{threads} thread(s): ratio oomguard / eager, median of {ROUNDS} rounds: median step {:.3}, fastest step {:.3} (aim >= \
            1.0)", median(med), median(fast));
    }
}
