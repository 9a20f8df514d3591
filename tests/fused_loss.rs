//! `model.loss: fused` against `full` on the same model and samples, in-process: the loss, every
//! gradient (plain and under activation checkpointing), the padded vocabulary, one step's
//! peak memory by the counting allocator against the planner, the tied lookup's gradient
//! added into the head's, and the step's one read back
//! from the device. Alone in its file, its tests one at a time (`common::exclusive()`): the
//! random generator, the counting allocator and the read counter are process-wide.
//! (End-to-end runs, the forced OOM included, are in tests/fused_runs.rs; every allocation
//! of a fused step failing in turn, in tests/inject_sweep.rs.)
mod common;
use oomguard::data::StepBatches;
use oomguard::memory;
use oomguard::model::{GptConfig, LossKind};
use oomguard::optim::{AdamW, OptimConfig};
use oomguard::plan::{Estimate, Precision};
use oomguard::precision::{Amp, Scaler};
use oomguard::task::{gpt::GptTask, Task};
use oomguard::train::{step_with, Update};
use tch::{Device, Tensor};

fn gpt(loss: LossKind, vocab: i64) -> GptTask {
    tch::manual_seed(11);
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 32,
        vocab_size: vocab,
        dropout: 0.0,
        bias: true,
        loss,
    };
    GptTask::new(&cfg, Device::Cpu).unwrap()
}

fn grads(task: &GptTask) -> Vec<(String, Tensor)> {
    let g = task
        .parameters()
        .into_iter()
        .map(|(n, p)| (n, p.grad().copy()))
        .collect();
    task.parameters().iter().for_each(|(_, p)| memory::clear_grad(p));
    g
}

fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, String) {
    a.iter()
        .zip(b)
        .map(|((n, x), (_, y))| ((x - y).abs().max().double_value(&[]), n.clone()))
        .fold((0.0, String::new()), |m, d| if d.0 > m.0 { d } else { m })
}

/// Loss within 1e-6 and every gradient within 1e-5 (fp32), plain and under activation
/// checkpointing, at a vocabulary that is padded (300 -> 320) and one that is not; the
/// padding is invisible: the embedding keeps the configured rows, its gradient too.
#[test]
fn fused_gives_the_full_loss_and_gradients() {
    let _one_at_a_time = common::exclusive();
    let common::TinyGpt { data, .. } = common::tiny_gpt();
    let batches = common::tiny_batches(&data, 8);
    let (x, y) = batches.micro_batch(0, 0..8).unwrap();
    let amp = Amp::fp32(Device::Cpu);
    for vocab in [300, 256] {
        let (mut full, mut fused) = (gpt(LossKind::Full, vocab), gpt(LossKind::Fused, vocab));
        let wte = &fused.parameters().into_iter().find(|(n, _)| n == "wte").unwrap().1;
        assert_eq!(
            wte.size(),
            vec![vocab, 32],
            "the parameter keeps the configured vocabulary"
        );
        for checkpointing in [false, true] {
            full.set_activation_checkpointing(checkpointing);
            fused.set_activation_checkpointing(checkpointing);
            let a = full.forward_backward(&x, &y, 0.5, &amp).unwrap().double_value(&[]);
            let b = fused.forward_backward(&x, &y, 0.5, &amp).unwrap().double_value(&[]);
            assert!(
                (a - b).abs() < 1e-6,
                "vocab {vocab}, checkpointing {checkpointing}: loss {a} (full) vs {b} (fused)"
            );
            let (d, name) = max_diff(&grads(&full), &grads(&fused));
            assert!(
                d < 1e-5,
                "vocab {vocab}, checkpointing {checkpointing}: {name}'s gradients differ by {d}"
            );
            // The evaluation loss (no grad recorded) too.
            let _no_grad = tch::no_grad_guard();
            let (a, b) = (
                full.eval_loss(&x, &y).unwrap().double_value(&[]),
                fused.eval_loss(&x, &y).unwrap().double_value(&[]),
            );
            assert!((a - b).abs() < 1e-6, "vocab {vocab}: eval loss {a} vs {b}");
        }
    }
}

/// Twenty optimizer steps (2 micro-batches each) end with the same parameters, within 1e-5.
#[test]
fn twenty_steps_end_with_the_same_parameters() {
    let _one_at_a_time = common::exclusive();
    let common::TinyGpt { data, .. } = common::tiny_gpt();
    let batches = common::tiny_batches(&data, 8);
    let run = |loss| {
        let task = gpt(loss, 300);
        let mut opt = AdamW::new(task.parameters(), &OptimConfig::default(), |n, t| {
            task.no_weight_decay(n, t)
        })
        .unwrap();
        let u = Update {
            lr: 3e-3,
            grad_clip: 1.0,
            amp: Amp::fp32(Device::Cpu),
            scaler: None,
        };
        let losses: Vec<f64> = (0..20)
            .map(|step| step_with(&task, &mut opt, &batches, step, 4, &u).unwrap().loss)
            .collect();
        (
            task.parameters()
                .into_iter()
                .map(|(n, p)| (n, p.detach().copy()))
                .collect::<Vec<_>>(),
            losses,
        )
    };
    let ((full, lf), (fused, lu)) = (run(LossKind::Full), run(LossKind::Fused));
    assert!(lf[19] < lf[0] - 0.1, "it trains: {lf:?}");
    let (d, name) = max_diff(&full, &fused);
    assert!(
        d < 1e-5,
        "after 20 steps {name} differs by {d}; losses {lf:?} vs {lu:?}"
    );
}

/// Peak memory of one step at vocabulary 16384, T 256, by the counting allocator: the fused
/// loss at most half the full one's; the planner within 20% of each.
#[test]
fn fused_step_peaks_at_most_half_of_full() {
    let _one_at_a_time = common::exclusive();
    memory::install_cpu_allocator();
    let cfg = |loss| GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 64,
        block_size: 256,
        vocab_size: 16384,
        dropout: 0.0,
        bias: true,
        loss,
    };
    let micro = 4;
    let inputs = Tensor::randint(16384, [micro, 256], (tch::Kind::Int64, Device::Cpu));
    let targets = inputs.roll([-1], [1]);
    let peak = |loss| {
        tch::manual_seed(5);
        let task = GptTask::new(&cfg(loss), Device::Cpu).unwrap();
        let mut opt = AdamW::new(task.parameters(), &OptimConfig::default(), |n, t| {
            task.no_weight_decay(n, t)
        })
        .unwrap();
        let amp = Amp::fp32(Device::Cpu);
        memory::reset_peak(Device::Cpu);
        let _ = task.forward_backward(&inputs, &targets, 1.0, &amp).unwrap();
        let u = Update {
            lr: 1e-3,
            grad_clip: 1.0,
            amp,
            scaler: None,
        };
        oomguard::train::update(&mut opt, 0, &u).unwrap();
        memory::stats(Device::Cpu).peak_bytes as f64
    };
    let (full, fused) = (peak(LossKind::Full), peak(LossKind::Fused));
    println!(
        "one step's peak: full {:.1} MiB, fused {:.1} MiB ({:.2}x)",
        full / 1048576.0,
        fused / 1048576.0,
        fused / full
    );
    assert!(fused <= 0.5 * full, "fused peaks at {fused}, full at {full}");
    for (loss, measured) in [(LossKind::Full, full), (LossKind::Fused, fused)] {
        let planned = Estimate::new(&cfg(loss), Precision::Fp32, false).peak(micro as usize) as f64;
        let err = (planned - measured).abs() / measured;
        assert!(
            err < 0.2,
            "{loss:?}: planned {planned}, measured {measured} ({:.1}% off)",
            err * 100.0
        );
    }
}

/// The fused loss ties the embedding's lookup to the head (`model::loss::Tie`): the lookup's
/// backward adds its rows into the head's gradient in place, so a state-heavy GPT's step
/// holds its embedding's gradient once where `full` holds it three times (the head's, the
/// lookup's and autograd's sum of them): its peak is at least 1.5 embedding gradients lower.
/// Under activation checkpointing (backward in passes) nothing is tied: the lookup's dense
/// gradient is added into the head's, already the parameter's, so it holds two.
#[test]
fn the_tied_lookup_adds_into_the_heads_gradient() {
    let _one_at_a_time = common::exclusive();
    memory::install_cpu_allocator();
    let (vocab, c) = (16384, 64);
    let cfg = |loss| GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: c,
        block_size: 8,
        vocab_size: vocab,
        dropout: 0.0,
        bias: true,
        loss,
    };
    let inputs = Tensor::randint(vocab, [1, 8], (tch::Kind::Int64, Device::Cpu));
    let targets = inputs.roll([-1], [1]);
    let peak = |loss, checkpointing| {
        tch::manual_seed(5);
        let mut task = GptTask::new(&cfg(loss), Device::Cpu).unwrap();
        task.set_activation_checkpointing(checkpointing);
        memory::reset_peak(Device::Cpu);
        let _ = task
            .forward_backward(&inputs, &targets, 1.0, &Amp::fp32(Device::Cpu))
            .unwrap();
        let wte = task.parameters().into_iter().find(|(n, _)| n == "wte").unwrap().1;
        assert!(wte.grad().defined(), "the embedding has its gradient");
        memory::stats(Device::Cpu).peak_bytes as f64
    };
    let tied = (4 * vocab * c) as f64;
    let (full, fused) = (peak(LossKind::Full, false), peak(LossKind::Fused, false));
    println!(
        "peak: full {:.1} MiB, fused {:.1} MiB, the embedding's gradient {:.1} MiB",
        full / 1048576.0,
        fused / 1048576.0,
        tied / 1048576.0
    );
    assert!(full - fused > 1.5 * tied, "full {full}, fused {fused}");
    let checkpointed = peak(LossKind::Fused, true);
    println!("checkpointed fused {:.1} MiB", checkpointed / 1048576.0);
    assert!(
        checkpointed - fused > 0.5 * tied,
        "checkpointed {checkpointed}, fused {fused}"
    );
}

/// A step of 4 micro-batches reads back from the device once (after the update), in fp32
/// and in fp16 (autocast and the loss scaler on the CPU, as the precision tests run them);
/// what it reads is right: the loss is the mean of the micro-batches' losses, and fp16's
/// scale comes back with it.
#[test]
fn a_step_reads_from_the_device_once() {
    let _one_at_a_time = common::exclusive();
    let common::TinyGpt { data, task, mut opt } = common::tiny_gpt();
    let batches = common::tiny_batches(&data, 16);
    let scaler = Scaler::new(&Default::default(), Device::Cpu).unwrap();
    for fp16 in [false, true] {
        let amp = match fp16 {
            false => Amp::fp32(Device::Cpu),
            true => Amp {
                precision: Precision::Fp16,
                device: Device::Cpu,
                loss_scale: Some(&scaler.scale),
            },
        };
        let u = Update {
            lr: 1e-3,
            grad_clip: 1.0,
            amp,
            scaler: fp16.then_some(&scaler),
        };
        let step = fp16 as u64;
        // The reference, read separately: the four micro-batches' mean loss before the step.
        let want: f64 = (0..4)
            .map(|i| {
                let (x, y) = batches.micro_batch(step, i * 4..i * 4 + 4).unwrap();
                let _no_grad = tch::no_grad_guard();
                let _autocast = amp.autocast().unwrap();
                task.loss(&x, &y, true).unwrap().double_value(&[]) / 4.0
            })
            .sum();
        let before = oomguard::ops::d2h_reads();
        let stats = step_with(&task, &mut opt, &batches, step, 4, &u).unwrap();
        assert_eq!(stats.num_micro_batches, 4);
        assert_eq!(oomguard::ops::d2h_reads() - before, 1, "fp16 {fp16}: reads in one step");
        assert!(
            (stats.loss - want).abs() < 1e-5,
            "fp16 {fp16}: loss {} but the micro-batches' mean is {want}",
            stats.loss
        );
        assert!(
            stats.grad_norm.is_finite() && stats.grad_norm > 0.0 && !stats.skipped,
            "{stats:?}"
        );
        assert_eq!(stats.loss_scale, fp16.then_some(65536.0), "{stats:?}");
    }
}

/// fp16 at a 16k vocabulary and 2048 tokens: d loss / d logits is about 1/(V N) = 3e-8 per
/// entry, under fp16's smallest number. The fused loss keeps it scaled until after its
/// matmuls, so its gradients (scaled by the loss scale, as the guard runs them) match fp32's
/// within fp16's tolerance, where flushing them to zero lost most of the weight's gradient.
#[test]
fn fp16_fused_gradients_hold_at_a_large_vocabulary() {
    let _one_at_a_time = common::exclusive();
    tch::manual_seed(5);
    let (n, c, v) = (2048, 32, 16384);
    let hidden = Tensor::randn([n, c], (tch::Kind::Float, Device::Cpu));
    let weight = Tensor::randn([v, c], (tch::Kind::Float, Device::Cpu)) * 0.02;
    let targets = Tensor::randint(v, [n], (tch::Kind::Int64, Device::Cpu));
    let grads = |fp16: bool| {
        let (h, w) = (
            hidden.copy().set_requires_grad(true),
            weight.copy().set_requires_grad(true),
        );
        let scale = if fp16 { 65536.0 } else { 1.0 };
        let loss = {
            let amp = Amp {
                precision: if fp16 { Precision::Fp16 } else { Precision::Fp32 },
                device: Device::Cpu,
                loss_scale: None,
            };
            let _autocast = amp.autocast().unwrap();
            oomguard::model::loss::fused_linear_cross_entropy(&h, &w, &targets).unwrap()
        };
        (loss * scale).f_backward().unwrap();
        [h.grad() / scale, w.grad() / scale]
    };
    let (exact, half) = (grads(false), grads(true));
    for (name, a, b) in [("hidden", &exact[0], &half[0]), ("weight", &exact[1], &half[1])] {
        let rel = (a - b).norm().double_value(&[]) / a.norm().double_value(&[]);
        assert!(rel < 1e-2, "fp16 {name} gradient off by {rel} (relative)");
    }
}

/// A micro-batch whose targets are all ignored (-100): no loss and zero gradients, not 0/0.
#[test]
fn a_micro_batch_of_ignored_targets_gives_zero_gradients() {
    let _one_at_a_time = common::exclusive();
    let h = Tensor::randn([64, 32], (tch::Kind::Float, Device::Cpu)).set_requires_grad(true);
    let w = Tensor::randn([300, 32], (tch::Kind::Float, Device::Cpu)).set_requires_grad(true);
    let targets = Tensor::full([64], -100, (tch::Kind::Int64, Device::Cpu));
    let loss = oomguard::model::loss::fused_linear_cross_entropy(&h, &w, &targets).unwrap();
    assert_eq!(loss.double_value(&[]), 0.0);
    loss.f_backward().unwrap();
    for g in [h.grad(), w.grad()] {
        assert_eq!(g.abs().max().double_value(&[]), 0.0, "finite zeros");
    }
}
