//! `make bench` (python_model): a GPT-2-small-shaped transformers model
//! (benches/scripts/gpt2_small.py: GPT2LMHeadModel, 12 layers, 768 wide, 50257 tokens)
//! trained by oomguard as `model.kind: python` against the same model file trained by a plain
//! eager PyTorch loop in the same venv (benches/scripts/py_eager.py), on the same token file
//! and the same samples, fused AdamW and clipping on both sides, alternated, 3 rounds each at
//! 1 and at 2 threads. A step is timed alike on both sides, from making its batch to the end
//! of its update; each run gives the median and the fastest tokens/s of its steps 2..; prints
//! the ratios (oomguard / eager). Then the Python-side overhead per micro-batch: the same
//! comparison on a model so small (1 layer, 64 wide, 16 tokens) that a step is almost nothing
//! but fixed costs, one micro-batch a step; the median step times' difference is what
//! oomguard adds to each micro-batch (the glue's calls, the batch crossing, the GIL, and the
//! runtime's own step machinery).
mod common;
use common::{events, median};
use std::path::Path;
use std::process::Command;

const SEED: u64 = 3;
const ROUNDS: usize = 3;

struct Shape {
    settings: &'static str,
    block: usize,
    batch: usize,
    steps: usize,
}

/// One round: oomguard then eager. Returns (ours, eager) as (median tok/s, fastest tok/s,
/// median step s).
fn round(dir: &Path, tokens: &Path, s: &Shape, threads: usize, name: &str) -> [(f64, f64, f64); 2] {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = root.join("benches/scripts/gpt2_small.py");
    let cfg = dir.join(format!("{name}.yaml"));
    std::fs::write(&cfg, format!(
        "model: {{kind: python, path: {}, loss: loss, settings: {}, block_size: {}}}\n\
         data: {{source: tokens, path: {}}}\noptim: {{lr: 1.0e-4, weight_decay: 0.0, warmup_steps: 0}}\n\
         train: {{micro_batch_size: {}, grad_accum_steps: 1, max_steps: {}, eval_every: 0, eval_batch_size: 1, eval_batches: 1, seed: {SEED}, device: \
         cpu, num_threads: {threads}}}\n\
         memory: {{budget: none}}\ncheckpoint: {{every_minutes: 0}}\nlog: {{every: 100000}}\n",
        model.display(), s.settings, s.block, tokens.display(), s.batch, s.steps
    )).unwrap();
    let run = dir.join(name);
    let o = Command::new(env!("CARGO_BIN_EXE_oomguard"))
        .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
        .env("OOMGUARD_CACHE", dir.join("cache"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let steps = events(&run, "step");
    let field = |k: &str| -> Vec<f64> { steps.iter().skip(2).map(|v| v[k].as_f64().unwrap()).collect() };
    let tps = field("tokens_per_s");
    let ours = (
        median(tps.clone()),
        tps.iter().copied().fold(0.0, f64::max),
        median(field("step_time_s")),
    );
    let o = Command::new(root.join(".venv/bin/python3"))
        .arg(root.join("benches/scripts/py_eager.py"))
        .arg(&model)
        .arg(s.settings)
        .arg(tokens)
        .args([s.block, s.batch, s.steps, threads].map(|n| n.to_string()))
        .arg(SEED.to_string())
        .env("OMP_NUM_THREADS", threads.to_string())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let e = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap();
    let get = |k: &str| e[k].as_f64().unwrap();
    [ours, (get("tokens_per_s"), get("fastest_tokens_per_s"), get("step_s"))]
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    // One token file for both sides: 2M tokens below GPT-2's vocabulary (and below 256 for
    // the small model's, by taking them modulo its vocabulary: see `small`).
    let tokens = |vocab: u64, name: &str| {
        let path = dir.path().join(name);
        std::fs::create_dir_all(&path).unwrap();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let bytes: Vec<u8> = (0..2_000_000)
            .flat_map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (((state >> 33) % vocab) as u16).to_le_bytes()
            })
            .collect();
        for f in ["train.bin", "val.bin"] {
            std::fs::write(path.join(f), &bytes).unwrap();
        }
        path
    };
    let gpt2 = Shape {
        settings: "{\"block\": 256}",
        block: 256,
        batch: 2,
        steps: 7,
    };
    let big = tokens(50257, "tokens");
    println!("python_model: GPT2LMHeadModel at GPT-2 small's shape (124M parameters), {}-token windows, batch {}, {} steps a run (steps 2.. timed), \
        eager with fused AdamW, {ROUNDS} alternated rounds", gpt2.block, gpt2.batch, gpt2.steps);
    for threads in [1, 2] {
        let (mut med, mut fast) = (vec![], vec![]);
        for r in 0..ROUNDS {
            let [ours, eager] = round(dir.path(), &big, &gpt2, threads, &format!("gpt2-{threads}-{r}"));
            println!(
                "{threads} thread(s), round {}: median step: oomguard {:.0} tok/s, eager {:.0} (ratio {:.3}); fastest step: oomguard {:.0}, eager \
                    {:.0} (ratio {:.3})",
                r + 1, ours.0, eager.0, ours.0 / eager.0, ours.1, eager.1, ours.1 / eager.1
            );
            med.push(ours.0 / eager.0);
            fast.push(ours.1 / eager.1);
        }
        println!(
            "  {threads} thread(s): ratio oomguard / eager, median of the rounds: median step {:.3}, fastest step {:.3}",
            median(med),
            median(fast)
        );
    }
    let small = Shape {
        settings: "{\"block\": 16, \"layers\": 1, \"heads\": 2, \"width\": 64, \"vocab\": 256}",
        block: 16,
        batch: 1,
        steps: 80,
    };
    let few = tokens(256, "small-tokens");
    println!("overhead: the same model file at 1 layer, 64 wide, vocabulary 256, 16-token windows, batch 1 (one micro-batch a step), {} steps a run, \
        1 thread", small.steps);
    let mut added = vec![];
    for r in 0..ROUNDS {
        let [ours, eager] = round(dir.path(), &few, &small, 1, &format!("small-{r}"));
        let ms = 1e3 * (ours.2 - eager.2);
        println!(
            "round {}: median step oomguard {:.2} ms, eager {:.2} ms: oomguard adds {ms:+.2} ms a micro-batch",
            r + 1,
            1e3 * ours.2,
            1e3 * eager.2
        );
        added.push(ms);
    }
    println!(
        "  added per micro-batch, median of the rounds: {:+.2} ms",
        median(added)
    );
}
