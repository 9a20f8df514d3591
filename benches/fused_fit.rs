//! `make bench` (fused_fit): the largest micro-batch whose forward and backward fit a fixed
//! memory budget (the counting CPU allocator's, real allocation failures), with `model.loss:
//! fused` against `full`, at GPT-2's vocabulary (50257) and T 256 on a small GPT (2 layers,
//! n_embd 64), found by the same search `micro_batch_size: auto` runs (from the planner's
//! estimate, doubling or halving, then bisecting to within 1/16). Prints each size, the
//! planner's, and the ratio fused / full (aim >= 2).
use std::time::Instant;
use tch::{Device, Kind, Tensor};

use oomguard::memory;
use oomguard::model::{GptConfig, LossKind};
use oomguard::plan::{search, Estimate, Precision};
use oomguard::precision::Amp;
use oomguard::task::{gpt::GptTask, Task};

const BUDGET: u64 = 384 << 20;
const VOCAB: i64 = 50257;
const BLOCK: i64 = 256;
const MAX: usize = 1024;

fn largest(loss: LossKind) -> (usize, usize, u32, f64) {
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 64,
        block_size: BLOCK,
        vocab_size: VOCAB,
        dropout: 0.0,
        bias: true,
        loss,
    };
    tch::manual_seed(0);
    let task = GptTask::new(&cfg, Device::Cpu).unwrap();
    // The optimizer's state is allocated up front, as in a run.
    let opt = oomguard::optim::AdamW::new(task.parameters(), &Default::default(), |n, t| {
        task.no_weight_decay(n, t)
    })
    .unwrap();
    let planned = Estimate::new(&cfg, Precision::Fp32, false).largest_fitting(BUDGET, MAX);
    let amp = Amp::fp32(Device::Cpu);
    let t = Instant::now();
    memory::set_cpu_budget(Some(BUDGET));
    let (found, trials) = search(planned.max(1), MAX, |m| {
        let x = Tensor::f_randint(VOCAB, [m as i64, BLOCK], (Kind::Int64, Device::Cpu))?;
        let fits = match task.forward_backward(&x, &x.f_roll([-1], [1])?, 1.0, &amp) {
            Ok(_) => true,
            Err(oomguard::Error::Oom(_)) => false,
            Err(e) => return Err(e),
        };
        opt.clear_grads();
        Ok(fits)
    })
    .unwrap();
    memory::set_cpu_budget(None);
    (found, planned, trials, t.elapsed().as_secs_f64())
}

fn main() {
    memory::install_cpu_allocator();
    println!(
        "GPT n_layer 2, n_head 2, n_embd 64, block {BLOCK}, vocab {VOCAB}, fp32, {} threads; budget {} MiB (weights, gradients, AdamW state and the step)",
        tch::get_num_threads(), BUDGET >> 20
    );
    let mut found = vec![];
    for loss in [LossKind::Full, LossKind::Fused] {
        let (m, planned, trials, s) = largest(loss);
        println!(
            "model.loss {}: largest micro-batch that fits {m} (planner: {planned}; {trials} trial steps, {s:.1}s)",
            loss.name()
        );
        found.push(m as f64);
    }
    println!(
        "largest micro-batch, fused / full: {:.1}x (aim >= 2)",
        found[1] / found[0]
    );
}
