//! `make bench` (torchscript): a scripted PyTorch model (examples/torchscript's MU-SOTA, 4
//! layers, 128-token windows) trained by oomguard in-process against the same model trained
//! by eager PyTorch (benches/scripts/ts_eager.py), alternated, 3 runs each, median tokens/s of
//! steps 3.. of each run, 2 threads each. Ratio = oomguard / eager.
mod common;
use common::{events, median};
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
    let o = Command::new(&python).arg(root.join("examples/torchscript/mu_sota.py")).args(["--out", pt.to_str().unwrap(), "--layers", LAYERS, "--block-size", BLOCK]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cfg = dir.path().join("ts.yaml");
    std::fs::write(&cfg, format!(
        "model: {{kind: torchscript, path: m.pt, block_size: {BLOCK}}}\ndata: {{source: embedded}}\noptim: {{lr: 1.0e-3, weight_decay: 0.0}}\n\
         train: {{micro_batch_size: {BATCH}, grad_accum_steps: 1, max_steps: {STEPS}, eval_every: 0, eval_batch_size: 4, eval_batches: 1, device: cpu, num_threads: 2}}\n\
         memory: {{budget: none}}\nlog: {{every: 1000}}\n"
    )).unwrap();
    let (mut ours, mut eager) = (vec![], vec![]);
    for round in 0..3 {
        let run = dir.path().join(format!("run{round}"));
        let o = Command::new(env!("CARGO_BIN_EXE_oomguard"))
            .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
            .env("OOMGUARD_CACHE", dir.path().join("cache")).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let tps: Vec<f64> = events(&run, "step").iter().skip(3).map(|v| v["tokens_per_s"].as_f64().unwrap()).collect();
        ours.push(median(tps));
        let o = Command::new(&python).arg(root.join("benches/scripts/ts_eager.py"))
            .args([LAYERS, BLOCK, &BATCH.to_string(), &STEPS.to_string(), "2"]).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        eager.push(serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["tokens_per_s"].as_f64().unwrap());
    }
    let (a, b) = (median(ours.clone()), median(eager.clone()));
    println!("torchscript: MU-SOTA {LAYERS} layers, {BLOCK}-token windows, batch {BATCH}, 2 threads, median of 3 alternated runs");
    println!("  oomguard (scripted, in-process): {a:.0} tok/s {ours:.0?}");
    println!("  eager PyTorch:                   {b:.0} tok/s {eager:.0?}");
    println!("  ratio oomguard / eager: {:.3}", a / b);
}
