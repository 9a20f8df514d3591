//! Activation checkpointing's gradients, and the fp16 loss scaler, in-process. Alone in its
//! file: the random generators and the counting allocator are process-wide, so its tests take
//! `common::exclusive()` too.
mod common;
use oomguard::data::StepBatches;
use oomguard::model::GptConfig;
use oomguard::precision::{Amp, Precision, Scaler};
use oomguard::task::{gpt::GptTask, Task};
use oomguard::train::{update, Update};
use tch::{Device, Tensor};

fn grads(task: &GptTask) -> Vec<(String, Tensor)> {
    task.parameters()
        .into_iter()
        .map(|(n, p)| (n, p.grad().copy()))
        .collect()
}

/// Recomputing each block in backward gives the plain path's gradients (to 1e-5), dropout
/// included: the masks are replayed.
#[test]
fn checkpointing_gives_the_same_gradients() {
    let _one_at_a_time = common::exclusive();
    let common::TinyGpt { data, .. } = common::tiny_gpt();
    let batches = common::tiny_batches(&data, 8);
    for dropout in [0.0, 0.1] {
        tch::manual_seed(3);
        let cfg = GptConfig {
            n_layer: 3,
            n_head: 2,
            n_embd: 32,
            block_size: 32,
            vocab_size: 256,
            dropout,
            bias: true,
            loss: Default::default(),
        };
        let mut task = GptTask::new(&cfg, Device::Cpu).unwrap();
        let (x, y) = batches.micro_batch(0, 0..8).unwrap();
        let amp = Amp::fp32(Device::Cpu);
        tch::manual_seed(5);
        let l1 = task.forward_backward(&x, &y, 0.5, &amp).unwrap().double_value(&[]);
        let plain = grads(&task);
        task.parameters()
            .iter()
            .for_each(|(_, p)| oomguard::memory::clear_grad(p));
        task.set_activation_checkpointing(true);
        tch::manual_seed(5);
        let l2 = task.forward_backward(&x, &y, 0.5, &amp).unwrap().double_value(&[]);
        let ckpt = grads(&task);
        assert!((l1 - l2).abs() < 1e-6, "dropout {dropout}: loss {l1} vs {l2}");
        for ((n, a), (_, b)) in plain.iter().zip(&ckpt) {
            let d = (a - b).abs().max().double_value(&[]);
            assert!(d < 1e-5, "dropout {dropout}: {n}: gradients differ by {d}");
        }
    }
}

/// GradScaler's semantics: a step whose gradients hold an inf is skipped (no parameter
/// moves), the scale halves; a clean step applies and keeps the scale.
#[test]
fn fp16_scaler_skips_an_overflowing_step_and_backs_off() {
    let _one_at_a_time = common::exclusive();
    let common::TinyGpt { data, task, mut opt } = common::tiny_gpt();
    let batches = common::tiny_batches(&data, 4);
    let scaler = Scaler::new(&Default::default(), Device::Cpu).unwrap();
    assert_eq!(scaler.value(), 65536.0);
    let amp = Amp {
        precision: Precision::Fp16,
        device: Device::Cpu,
        loss_scale: Some(&scaler.scale),
    };
    let u = Update {
        lr: 1e-3,
        grad_clip: 1.0,
        amp,
        scaler: Some(&scaler),
    };
    let before: Vec<Tensor> = task.parameters().iter().map(|(_, p)| p.copy()).collect();

    let (x, y) = batches.micro_batch(0, 0..4).unwrap();
    let _ = task.forward_backward(&x, &y, 1.0, &amp).unwrap();
    let _ = task.parameters()[0].1.grad().fill_(f64::INFINITY); // an overflow
    let (_, skipped) = update(&mut opt, 0, &u).unwrap();
    assert!(skipped);
    assert_eq!(scaler.value(), 32768.0);
    for ((n, p), b) in task.parameters().iter().zip(&before) {
        assert_eq!(
            (p - b).abs().max().double_value(&[]),
            0.0,
            "{n} moved on a skipped step"
        );
    }

    let _ = task.forward_backward(&x, &y, 1.0, &amp).unwrap();
    let (norm, skipped) = update(&mut opt, 1, &u).unwrap();
    assert!(!skipped && norm.is_finite());
    assert_eq!(scaler.value(), 32768.0, "no growth before 2000 clean steps");
    let moved = task
        .parameters()
        .iter()
        .zip(&before)
        .any(|((_, p), b)| (p - b).abs().max().double_value(&[]) > 0.0);
    assert!(moved, "a clean step updates");
}
