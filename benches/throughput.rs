//! `make bench`: tokens/s of oomguard's training loop against a minimal hand-written tch
//! loop (same GPT, same samples, tch's own AdamW, no accumulation, no metrics), measured in
//! one process, interleaved, best of 3 each. Prints the ratio (floor: 0.97).
use std::time::Instant;
use tch::nn::{self, OptimizerConfig};

use oomguard::config::{Config, RawConfig};
use oomguard::data::{Dataset, StepBatches, StepSamples, TokenShape};
use oomguard::model::{Gpt, ModelConfig};

const STEPS: u64 = 30;

fn config() -> RawConfig {
    let model = ModelConfig { n_layer: Some(4), n_head: Some(4), n_embd: Some(256), block_size: Some(128), vocab_size: Some(256), ..Default::default() };
    let mut c = RawConfig { model, ..Default::default() };
    c.train.micro_batch_size = oomguard::train::MicroBatch::Size(16);
    c.train.grad_accum_steps = 1;
    c.train.max_steps = STEPS;
    c.train.eval_every = 0;
    c.train.eval_batches = 1;
    c.train.device = "cpu".into();
    c.log.every = 1000;
    c
}

fn hand_loop(c: &RawConfig) -> f64 {
    tch::manual_seed(c.train.seed as i64);
    let block = 128;
    let shape = TokenShape { block_size: block, vocab_size: Some(256) };
    let data = Dataset::open(&c.data, std::path::Path::new("."), Some(shape)).unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = Gpt::new(&vs.root(), &c.model.gpt()).unwrap();
    let mut opt = nn::AdamW::default().build(&vs, c.optim.lr).unwrap();
    let batch = c.train.global_batch_size();
    let batches = StepSamples::new(data.train.as_ref(), c.train.seed, batch, tch::Device::Cpu);
    let start = Instant::now();
    for step in 0..STEPS {
        let (x, y) = batches.micro_batch(step, 0..batch).unwrap();
        let loss = model.loss(&x, &y, true).unwrap();
        opt.backward_step(&loss);
    }
    (STEPS as usize * batch * block) as f64 / start.elapsed().as_secs_f64()
}

fn oomguard_loop(c: &RawConfig) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config { raw: c.clone(), path: dir.path().join("bench.yaml") };
    oomguard::train::train(&cfg, dir.path(), &Default::default(), Default::default()).unwrap().tokens_per_s
}

fn main() {
    let c = config();
    oomguard::memory::install_cpu_allocator();
    println!("GPT n_layer 4, n_head 4, n_embd 256, block 128, vocab 256, batch 16; {STEPS} steps, {} threads", tch::get_num_threads());
    let (mut hand, mut ours) = (0.0f64, 0.0f64);
    for round in 1..=3 {
        let h = hand_loop(&c);
        let o = oomguard_loop(&c);
        println!("round {round}: hand-written {h:.0} tok/s, oomguard {o:.0} tok/s");
        hand = hand.max(h);
        ours = ours.max(o);
    }
    println!("throughput ratio oomguard / hand-written: {:.3} (floor 0.97)", ours / hand);
}
