//! What several benches share: a median, and a run's events from its metrics.jsonl.
#![allow(dead_code)] // each bench uses a part
use std::path::Path;

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The `event` records of a run directory's metrics.jsonl, in order.
pub fn events(run: &Path, event: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["event"] == event)
        .collect()
}

/// `oomguard train CFG --run-dir RUN` (the micro-batch cache under `cache`): the median and
/// the fastest of its steps' tokens_per_s, past the first three.
pub fn train_tokens_per_s(cfg: &Path, run: &Path, cache: &Path) -> (f64, f64) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_oomguard"))
        .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
        .env("OOMGUARD_CACHE", cache)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tps: Vec<f64> = events(run, "step")
        .iter()
        .skip(3)
        .map(|v| v["tokens_per_s"].as_f64().unwrap())
        .collect();
    (median(tps.clone()), tps.iter().copied().fold(0.0, f64::max))
}

/// The GPT the guard and snapshot benches step (n_layer 4, n_head 4, n_embd 256, block 128,
/// vocab 256, on the CPU under the counting allocator), its AdamW and its data.
pub fn bench_gpt() -> (
    oomguard::task::gpt::GptTask,
    oomguard::optim::AdamW,
    oomguard::data::Dataset,
) {
    use oomguard::task::Task;
    oomguard::memory::install_cpu_allocator();
    tch::manual_seed(0);
    let cfg = oomguard::model::GptConfig {
        n_layer: 4,
        n_head: 4,
        n_embd: 256,
        block_size: 128,
        vocab_size: 256,
        dropout: 0.0,
        bias: true,
        loss: Default::default(),
    };
    let shape = oomguard::data::TokenShape {
        block_size: 128,
        vocab_size: Some(256),
    };
    let data =
        oomguard::data::Dataset::open(&oomguard::data::DataConfig::default(), Path::new("."), Some(shape)).unwrap();
    let task = oomguard::task::gpt::GptTask::new(&cfg, tch::Device::Cpu).unwrap();
    let opt = oomguard::optim::AdamW::new(task.parameters(), &oomguard::optim::OptimConfig::default(), |n, t| {
        task.no_weight_decay(n, t)
    })
    .unwrap();
    (task, opt, data)
}

/// The data-parallel benches' run (dist, netns): GPT 4x128 (GptConfig's defaults), global
/// batch 32 in micro-batches of 16, 25 steps, one thread a rank.
pub const DIST_CONFIG: &str = "
model: {n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, vocab_size: 256}
data: {source: embedded}
train: {micro_batch_size: 16, grad_accum_steps: 1, global_batch_size: 32, max_steps: 25, eval_every: 0, eval_batch_size: 4, eval_batches: 1, device: \
    cpu, num_threads: 1}
memory: {budget: none}
log: {every: 1000}
";
