//! `make bench` (guard): what the allocation guard costs.
//! 1. Overhead: tokens/s of steps run through `Guard::run` against the same steps called
//!    directly, alternating step by step in one process (floor: at most 2% slower).
//! 2. Recovery: the wall time one OOM recovery adds to a step, in units of the step's normal
//!    time at the size it falls back to (floor: at most 1.5 steps), with the budget placed so
//!    that the failure comes early (mid-forward) and late (just under the full step's peak).
//!    Every timed step must have had exactly that one OOM, or there is no recovery to time.
mod common;
use std::time::Instant;
use tch::Device;

use oomguard::data::StepSamples;
use oomguard::guard::{Guard, GuardEvent};
use oomguard::memory::{self, MemoryConfig};
use oomguard::optim::AdamW;
use oomguard::train::train_step;

const GLOBAL: usize = 16;

fn main() {
    let (task, mut opt, data) = common::bench_gpt();
    let batches = StepSamples::new(data.train.as_ref(), 1, GLOBAL, Device::Cpu);
    let mem_cfg = MemoryConfig::default();
    let mut step_no = 0u64;
    let mut step = |opt: &mut AdamW, mb: usize| {
        step_no += 1;
        train_step(&task, opt, &batches, step_no, mb, 1e-4, 1.0)
    };
    println!(
        "GPT n_layer 4, n_head 4, n_embd 256, block 128, vocab 256, global batch {GLOBAL}, {} threads",
        tch::get_num_threads()
    );

    // 1. Overhead: direct and guarded steps alternate, so machine drift hits both alike.
    const STEPS: usize = 40;
    let (mut direct, mut guarded) = (0.0, 0.0);
    let mut guard = Guard::new(&mem_cfg, GLOBAL, Device::Cpu);
    step(&mut opt, GLOBAL).unwrap(); // warm-up
    for s in 0..STEPS as u64 {
        let t = Instant::now();
        step(&mut opt, GLOBAL).unwrap();
        direct += t.elapsed().as_secs_f64();
        let t = Instant::now();
        guard.run(s, &mut opt, &mut step, |o| o.clear_grads()).unwrap();
        guarded += t.elapsed().as_secs_f64();
    }
    println!(
        "guard overhead: guarded/direct tokens/s = {:.3} over {STEPS} alternating steps each (floor 0.98)",
        direct / guarded
    );

    // 2. Recovery cost. Peaks of a full step at 16 and at 8.
    let peak = |opt: &mut AdamW, mb: usize, step: &mut dyn FnMut(&mut AdamW, usize) -> oomguard::Result<_>| {
        memory::reset_cpu_peak();
        step(opt, mb).unwrap();
        memory::cpu_peak_bytes()
    };
    let (p16, p8) = (peak(&mut opt, 16, &mut step), peak(&mut opt, 8, &mut step));
    let t = Instant::now();
    for _ in 0..5 {
        step(&mut opt, 8).unwrap();
    }
    let step8 = t.elapsed().as_secs_f64() / 5.0;
    for (name, budget) in [
        ("early (mid-forward)", (p8 + p16) / 2),
        ("late (just under the full step's peak)", p16 - (p16 - p8) / 20),
    ] {
        memory::set_cpu_budget(Some(budget));
        let (mut total, mut lost, n) = (0.0, 0.0, 5);
        for i in 0..n {
            let mut guard = Guard::new(&mem_cfg, GLOBAL, Device::Cpu);
            let t = Instant::now();
            guard.run(i, &mut opt, &mut step, |o| o.clear_grads()).unwrap();
            total += t.elapsed().as_secs_f64();
            let mut ooms = 0;
            for e in guard.drain_events() {
                if let GuardEvent::Oom(o) = e {
                    ooms += 1;
                    lost += o.time_lost_s;
                    assert_eq!(o.new_micro_batch_size, 8, "the budget should fail 16 and fit 8");
                }
            }
            assert_eq!(ooms, 1, "failure {name}: a budget of {budget} bytes (peaks: {p16} at 16, {p8} at 8) should fail micro-batch 16 exactly once");
        }
        memory::set_cpu_budget(None);
        println!(
            "one OOM recovery, failure {name}: {:.2} steps added to the step (time lost in the failed attempt and cleanup: {:.2} steps; floor 1.5)",
            (total / n as f64 - step8) / step8,
            lost / n as f64 / step8
        );
    }
}
