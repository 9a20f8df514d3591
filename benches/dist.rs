//! `make bench` (dist): 2-rank data-parallel scaling on this machine, one thread per rank,
//! against one rank with one thread: the same GPT, global batch and steps, alternated, median
//! of 3 each. Efficiency = tokens/s with 2 ranks / (2 x tokens/s with 1) (floor 0.8). Also
//! the all-reduce and agreement time per step against the step's time.
mod common;
use common::{events, median};
use std::path::Path;
use std::process::Command;

const CONFIG: &str = "
model: {n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, vocab_size: 256}
data: {source: embedded}
train: {micro_batch_size: 16, grad_accum_steps: 1, global_batch_size: 32, max_steps: 25, eval_every: 0, eval_batch_size: 4, eval_batches: 1, device: cpu, num_threads: 1}
memory: {budget: none}
log: {every: 1000}
";

/// Median tokens/s and the mean share of a step spent communicating, steps 5.. of a run.
fn measure(run: &Path) -> (f64, Option<f64>) {
    let steps: Vec<serde_json::Value> = events(run, "step").into_iter().skip(5).collect();
    let tps: Vec<f64> = steps.iter().map(|s| s["tokens_per_s"].as_f64().unwrap()).collect();
    let comm: Vec<f64> = steps.iter().filter_map(|s| Some(s["comm_s"].as_f64()? / s["step_time_s"].as_f64()?)).collect();
    (median(tps), (!comm.is_empty()).then(|| comm.iter().sum::<f64>() / comm.len() as f64))
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("ddp.yaml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let bin = env!("CARGO_BIN_EXE_oomguard");
    let (mut one, mut two, mut comm) = (vec![], vec![], vec![]);
    for round in 0..3 {
        let run1 = dir.path().join(format!("one{round}"));
        let ok = Command::new(bin).args(["train", cfg.to_str().unwrap(), "--run-dir", run1.to_str().unwrap()]).env("OMP_NUM_THREADS", "1").env("OOMGUARD_CACHE", dir.path()).status().unwrap();
        assert!(ok.success());
        one.push(measure(&run1).0);
        let run2 = dir.path().join(format!("two{round}"));
        let ok = Command::new(bin)
            .args(["launch", "--nproc-per-node", "2", "--master-port", "29811", "--no-python", bin, "train", cfg.to_str().unwrap(), "--run-dir", run2.to_str().unwrap()])
            .env("OMP_NUM_THREADS", "1").env("OOMGUARD_CACHE", dir.path()).stdout(std::process::Stdio::null()).status().unwrap();
        assert!(ok.success());
        let (t, c) = measure(&run2);
        two.push(t);
        comm.push(c.unwrap_or(f64::NAN));
        println!("round {round}: 1 rank {:.0} tok/s, 2 ranks {:.0} tok/s", one[round], two[round]);
    }
    let (a, b, c) = (median(one), median(two), median(comm));
    println!("2-rank scaling efficiency (1 thread per rank, GPT 4x128, global batch 32): {:.2} (floor 0.8)", b / (2.0 * a));
    println!("all-reduce and agreements: {:.1}% of a data-parallel step", 100.0 * c);
}
