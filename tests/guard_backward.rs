//! An OOM raised inside autograd's backward pass is recovered in-process, through the
//! library API. Alone in its file: the CPU budget is process-wide.
mod common;
use oomguard::data::StepBatches;
use oomguard::error::Phase;
use oomguard::guard::{Guard, GuardEvent};
use oomguard::memory::{self, MemoryConfig};
use oomguard::task::Task;
use oomguard::train::train_step;
use tch::Device;

#[test]
fn oom_inside_backward_is_recovered() {
    let common::TinyGpt {
        data,
        mut task,
        mut opt,
    } = common::tiny_gpt();
    // The full loss: with the fused one the head's gradients are formed in the forward, which
    // then holds the step's peak, and no budget fails the backward alone.
    task.set_loss_kind(oomguard::model::LossKind::Full);
    let batches = common::tiny_batches(&data, 16);

    // Measure the forward's and the backward's peaks for one micro-batch of 16.
    memory::reset_cpu_peak();
    let (x, y) = batches.micro_batch(0, 0..16).unwrap();
    let loss = task.loss(&x, &y, true).unwrap();
    let forward_peak = memory::cpu_peak_bytes();
    loss.f_backward().unwrap();
    let backward_peak = memory::cpu_peak_bytes();
    drop((x, y, loss));
    opt.clear_grads();
    assert!(backward_peak > forward_peak + 4096, "{forward_peak} {backward_peak}");

    // A budget the forward fits in and the backward does not.
    memory::set_cpu_budget(Some((forward_peak + backward_peak) / 2));
    let mut guard = Guard::new(&MemoryConfig::default(), 16, Device::Cpu);
    let stats = guard.run(
        0,
        &mut opt,
        |opt, mb| train_step(&task, opt, &batches, 0, mb, 1e-3, 1.0),
        |opt| opt.clear_grads(),
    );
    memory::set_cpu_budget(None);
    let stats = stats.unwrap();

    let events = guard.drain_events();
    let GuardEvent::Oom(first) = &events[0] else {
        panic!("{events:?}")
    };
    assert_eq!(first.phase, Some(Phase::Backward));
    assert_eq!(first.memory_before, first.memory_after_cleanup);
    assert_eq!((first.old_micro_batch_size, first.new_micro_batch_size), (16, 8));
    assert_eq!(stats.num_samples, 16);
    assert_eq!(stats.micro_batch_size, guard.micro_batch_size());
    assert!(stats.loss.is_finite());
}
