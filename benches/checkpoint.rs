//! `make bench` (checkpoint): what one checkpoint costs, from the `checkpoint` events of real
//! `oomguard train` runs on the CPU: the demo (configs/demo.yaml) and GPT-2 small's shape
//! (configs/gpt2-124m.yaml on the embedded data, micro-batch 1 of 64 tokens), each
//! checkpointing every step. Prints the median seconds and bytes, and the share of wall time
//! the default clock (every 10 minutes) would take: the clock keeps it under 1%.
mod common;
use common::{events, median};
use std::path::Path;
use std::process::Command;

const STEPS: &str = "4";

fn measure(name: &str, config: &Path, sets: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oomguard"));
    cmd.args(["train", config.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
        .args([
            "--max-steps",
            STEPS,
            "--set",
            "checkpoint.every_steps=1",
            "--set",
            "checkpoint.keep=2",
        ])
        .args(["--set", "train.device=cpu", "--set", "train.eval_every=0"])
        .env("OOMGUARD_CACHE", dir.path().join("cache"));
    for s in sets {
        cmd.args(["--set", s]);
    }
    let o = cmd.output().expect("oomguard runs");
    assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
    let ticks = events(&run, "checkpoint");
    let seconds: Vec<f64> = ticks.iter().map(|c| c["seconds"].as_f64().unwrap()).collect();
    let bytes = ticks[0]["bytes"].as_u64().unwrap();
    let s = median(seconds.clone());
    println!(
        "{name}: {} checkpoints, median {s:.3} s (all: {}), {:.1} MiB on disk; every 10 min: {:.4}% of wall time",
        ticks.len(),
        seconds.iter().map(|s| format!("{s:.3}")).collect::<Vec<_>>().join(", "),
        bytes as f64 / (1u64 << 20) as f64,
        100.0 * s / 600.0
    );
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    measure(
        "demo (0.8M parameters)",
        &root.join("configs/demo.yaml"),
        &["memory.pressure=[]"],
    );
    measure(
        "gpt2-124m shape (124M parameters)",
        &root.join("configs/gpt2-124m.yaml"),
        &[
            "data.source=embedded",
            "data.path=null",
            "train.micro_batch_size=1",
            "train.grad_accum_steps=1",
            "model.block_size=64",
            "memory.budget=none",
        ],
    );
}
