//! `make bench`: tokens/s of oomguard's training loop against a minimal hand-written tch
//! loop doing the same work: the same GPT and samples, oomguard's fused AdamW (its weight
//! decay groups and LR schedule), clipping at the configured norm, the loss read each step.
//! Both are timed over the same window, steps 1..STEPS (wall clock from the end of step 0 to
//! the end of the last step): oomguard's from its metrics.jsonl step records, so its set-up
//! and the end of run (evaluation, checkpoint, weights), which the hand loop does not do, stay
//! outside it. 5 rounds in one process, each running both, which goes first alternating;
//! prints each round's ratios and their medians (floor: 0.97), by the fastest step (steady on
//! a shared machine) and over the whole window.
mod common;
use std::time::Instant;
use tch::nn;

use oomguard::config::{Config, RawConfig};
use oomguard::data::{Dataset, StepBatches, StepSamples, TokenShape};
use oomguard::model::{no_weight_decay, Gpt, ModelConfig};
use oomguard::optim::AdamW;

const STEPS: u64 = 20;
const ROUNDS: usize = 5;
const BLOCK: i64 = 128;

fn config(threads: usize) -> RawConfig {
    let model = ModelConfig {
        n_layer: Some(4),
        n_head: Some(4),
        n_embd: Some(256),
        block_size: Some(BLOCK),
        vocab_size: Some(256),
        ..Default::default()
    };
    let mut c = RawConfig {
        model,
        ..Default::default()
    };
    c.train.micro_batch_size = oomguard::train::MicroBatch::Size(16);
    c.train.grad_accum_steps = 1;
    c.train.max_steps = STEPS;
    c.train.eval_every = 0;
    c.train.eval_batches = 1;
    c.train.device = "cpu".into();
    c.train.num_threads = Some(threads);
    c.log.every = 1000;
    c
}

/// Tokens/s from the times at which each step ended, by two rules applied alike to both
/// loops: over the whole window of steps 1.. (wall clock from the end of step 0 to the end of
/// the last step), and over its fastest step (the one least slowed by other work on a shared
/// machine).
#[derive(Clone, Copy)]
struct Rate {
    window: f64,
    best_step: f64,
}

fn rates(ends: &[f64], tokens_per_step: usize) -> Rate {
    let fastest = ends.windows(2).map(|w| w[1] - w[0]).fold(f64::INFINITY, f64::min);
    Rate {
        window: ((ends.len() - 1) * tokens_per_step) as f64 / (ends[ends.len() - 1] - ends[0]),
        best_step: tokens_per_step as f64 / fastest,
    }
}

fn hand_loop(c: &RawConfig) -> Rate {
    tch::manual_seed(c.train.seed as i64);
    let shape = TokenShape {
        block_size: BLOCK as usize,
        vocab_size: Some(256),
    };
    let data = Dataset::open(&c.data, std::path::Path::new("."), Some(shape)).unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = Gpt::new(&vs.root(), &c.model.gpt()).unwrap();
    let mut opt = AdamW::new(vs.variables().into_iter().collect(), &c.optim, |n, _| {
        no_weight_decay(n)
    })
    .unwrap();
    let batch = c.train.global_batch_size();
    let batches = StepSamples::new(data.train.as_ref(), c.train.seed, batch, tch::Device::Cpu);
    let start = Instant::now();
    let mut ends = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batches.micro_batch(step, 0..batch).unwrap();
        let loss = model.loss(&x, &y, true).unwrap();
        loss.backward();
        std::hint::black_box(loss.double_value(&[]));
        let _ = opt.clip_grad_norm(c.optim.grad_clip).unwrap();
        opt.step(step, c.optim.lr_at(step, STEPS)).unwrap();
        opt.clear_grads();
        ends.push(start.elapsed().as_secs_f64());
    }
    rates(&ends, batch * BLOCK as usize)
}

fn oomguard_loop(c: &RawConfig) -> Rate {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config {
        raw: c.clone(),
        path: dir.path().join("bench.yaml"),
    };
    oomguard::train::train(&cfg, dir.path(), &Default::default(), Default::default()).unwrap();
    let ends: Vec<f64> = common::events(dir.path(), "step")
        .iter()
        .map(|s| s["elapsed_s"].as_f64().unwrap())
        .collect();
    assert_eq!(ends.len(), STEPS as usize);
    rates(&ends, c.train.global_batch_size() * BLOCK as usize)
}

fn main() {
    let threads = tch::get_num_threads() as usize;
    let c = config(threads);
    oomguard::memory::install_cpu_allocator();
    println!("GPT n_layer 4, n_head 4, n_embd 256, block {BLOCK}, vocab 256, batch 16; tokens/s over steps 1..{STEPS}, {threads} threads");
    let (mut window, mut best) = (Vec::new(), Vec::new());
    for round in 1..=ROUNDS {
        // Which goes first alternates, so a machine getting busier or quieter hits both alike.
        let (h, o) = if round % 2 == 1 {
            let h = hand_loop(&c);
            (h, oomguard_loop(&c))
        } else {
            let o = oomguard_loop(&c);
            (hand_loop(&c), o)
        };
        println!(
            "round {round}: window: hand-written {:.0} tok/s, oomguard {:.0} tok/s, ratio {:.3}; fastest step: hand-written {:.0}, oomguard {:.0}, ratio {:.3}",
            h.window, o.window, o.window / h.window, h.best_step, o.best_step, o.best_step / h.best_step
        );
        window.push(o.window / h.window);
        best.push(o.best_step / h.best_step);
    }
    println!("throughput ratio oomguard / hand-written, median of {ROUNDS} rounds: fastest step {:.3}, whole window {:.3} (floor \
        0.97)", common::median(best), common::median(window));
}
