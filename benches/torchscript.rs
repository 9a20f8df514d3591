//! `make bench` (torchscript): a scripted PyTorch model (examples/torchscript's MU-SOTA, 4
//! layers, 128-token windows) trained by oomguard in-process against the same model trained
//! by eager PyTorch (benches/scripts/ts_eager.py: the same AdamW settings, fused, and
//! clipping), alternated, 3 runs each, 2 threads each. A step is timed alike on both sides,
//! from making its batch to the end of its update; each run gives the median and the fastest
//! tokens/s of its steps 3.., each round a ratio of each; prints the medians over rounds
//! (oomguard / eager).
mod common;
use common::median;
use std::path::Path;
use std::process::Command;

const LAYERS: &str = "4";
const BLOCK: &str = "128";
const BATCH: usize = 16;
const STEPS: usize = 15;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join(".venv/bin/python3");
    let dir = tempfile::tempdir().unwrap();
    let pt = dir.path().join("m.pt");
    let o = Command::new(&python)
        .arg(root.join("examples/torchscript/mu_sota.py"))
        .args(["--out", pt.to_str().unwrap(), "--layers", LAYERS, "--block-size", BLOCK])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cfg = dir.path().join("ts.yaml");
    std::fs::write(&cfg, format!(
        "model: {{kind: torchscript, path: m.pt, block_size: {BLOCK}}}\ndata: {{source: embedded}}\noptim: {{lr: 1.0e-3, weight_decay: 0.0}}\n\
         train: {{micro_batch_size: {BATCH}, grad_accum_steps: 1, max_steps: {STEPS}, eval_every: 0, eval_batch_size: 4, eval_batches: 1, device: \
         cpu, num_threads: 2}}\n\
         memory: {{budget: none}}\nlog: {{every: 1000}}\n"
    )).unwrap();
    let (mut median_ratios, mut fastest_ratios) = (vec![], vec![]);
    for round in 0..3 {
        let run = dir.path().join(format!("run{round}"));
        let (ours, ours_fastest) = common::train_tokens_per_s(&cfg, &run, &dir.path().join("cache"));
        let o = Command::new(&python)
            .arg(root.join("benches/scripts/ts_eager.py"))
            .args([LAYERS, BLOCK, &BATCH.to_string(), &STEPS.to_string(), "2"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let e = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap();
        let (eager, eager_fastest) = (
            e["tokens_per_s"].as_f64().unwrap(),
            e["fastest_tokens_per_s"].as_f64().unwrap(),
        );
        println!(
            "round {}: median step: oomguard {ours:.0} tok/s, eager {eager:.0} (ratio {:.3}); fastest step: oomguard {ours_fastest:.0}, eager \
                {eager_fastest:.0} (ratio {:.3})",
            round + 1, ours / eager, ours_fastest / eager_fastest
        );
        median_ratios.push(ours / eager);
        fastest_ratios.push(ours_fastest / eager_fastest);
    }
    println!("torchscript: MU-SOTA {LAYERS} layers, {BLOCK}-token windows, batch {BATCH}, 2 threads, eager with fused AdamW, 3 alternated rounds");
    println!(
        "  ratio oomguard / eager, median of the rounds: fastest step {:.3}, median step {:.3}",
        median(fastest_ratios),
        median(median_ratios)
    );
}
