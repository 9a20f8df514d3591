//! `make bench` (sweep): the ASHA sweep of tests/sweep_asha.rs (the tiny GPT, 8 learning
//! rates over two decades and 2 that diverge, rungs at steps 3, 9 and 27, eta 3) with and
//! without early stopping, in one run: the steps trained in all (what a GPU would spend),
//! the wall time, and the best final eval loss each found.
use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// The tiny GPT (rungs at steps 3, 9 and 27) and the learning rates, shared with tests/sweep_asha.rs.
const BASE: &str = include_str!("../tests/golden/asha/base.yaml");
const PARAMS: &str = include_str!("../tests/golden/asha/parameters.yaml");

/// (steps in all, wall seconds, best final eval loss and its trial)
fn sweep(dir: &Path, name: &str, early: &str) -> (u64, f64, f64, String) {
    let file = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &file,
        format!("base: base.yaml\nmethod: grid\nplanner: false\nmetric: final_eval_loss\n{early}{PARAMS}"),
    )
    .unwrap();
    let t = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_oomguard"))
        .args(["sweep", file.to_str().unwrap(), "--out", name])
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .env("OOMGUARD_CACHE", dir.join(".cache"))
        .output()
        .unwrap();
    let wall = t.elapsed().as_secs_f64();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(dir.join(name).join("results.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let steps = records.iter().map(|r| r["steps"].as_u64().unwrap()).sum();
    let best = records
        .iter()
        .filter_map(|r| Some((r["final_eval_loss"].as_f64()?, r["trial"].as_str()?.to_string())))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap();
    (steps, wall, best.0, best.1)
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("base.yaml"), BASE).unwrap();
    let asha = sweep(
        dir.path(),
        "asha",
        "early_stop: {type: asha, metric: val_loss, min_steps: 3, reduction_factor: 3}\n",
    );
    let full = sweep(dir.path(), "full", "");
    println!("ASHA sweep: 8 trials of the tiny GPT, rungs at steps 3, 9, 27 (eta 3), 1 slot, OMP_NUM_THREADS=1");
    for (name, (steps, wall, best, trial)) in [("with early stopping", &asha), ("without", &full)] {
        println!("  {name:<20} {steps:>4} steps   {wall:>6.1} s   best final eval loss {best:.4} ({trial})");
    }
    println!(
        "  ratio                {:.2} of the steps, {:.2} of the wall time; best {}",
        asha.0 as f64 / full.0 as f64,
        asha.1 / full.1,
        if asha.2 == full.2 { "identical" } else { "differs" }
    );
}
