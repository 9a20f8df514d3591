//! An out-of-memory error at every single allocation, one at a time, of one optimizer step,
//! one evaluation, one checkpoint write and one restore of the tiny GPT: the step still ends
//! with the parameters of a clean step and every optimizer group updated exactly once; the
//! evaluation gives the same loss; a write or restore fails cleanly and succeeds when tried
//! again. In-process, through the library; alone in its file (the injector is process-wide).
mod common;
use oomguard::checkpoint;
use oomguard::data::{Samples, StepSamples};
use oomguard::error::Error;
use oomguard::guard::{Guard, GuardEvent};
use oomguard::memory::{inject, MemoryConfig};
use oomguard::optim::AdamW;
use oomguard::precision::Amp;
use oomguard::task::{tensors, Task};
use oomguard::train::{evaluate, train_step, EvalSpec};
use std::collections::BTreeSet;
use tch::{Device, Tensor};

fn copies(named: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    named.into_iter().map(|(n, t)| (n, t.detach().copy())).collect()
}

/// The largest difference of two parameter sets, and the parameter it is in.
fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, String) {
    a.iter()
        .zip(b)
        .map(|((n, x), (_, y))| ((x - y).abs().max().double_value(&[]), n.clone()))
        .fold((0.0, String::new()), |m, d| if d.0 > m.0 { d } else { m })
}

/// Runs `f` with the allocation `k` allocations from now made to fail; returns its result
/// and whether the failure fired.
fn with_failure_at<T>(k: u64, f: impl FnOnce() -> T) -> (T, bool) {
    let fired = inject::fired();
    inject::arm(&[inject::alloc_count() + k]);
    let out = f();
    inject::arm(&[]);
    (out, inject::fired() == fired + 1)
}

/// How many allocations `f` makes.
fn allocations(f: impl FnOnce()) -> u64 {
    let before = inject::alloc_count();
    f();
    inject::alloc_count() - before
}

#[test]
fn an_oom_at_every_allocation_changes_nothing() {
    // One thread: the clean steps and the recovered ones sum in one order, on any machine.
    tch::set_num_threads(1);
    let common::TinyGpt { data, task, mut opt } = common::tiny_gpt();
    let batches = common::tiny_batches(&data, 16);
    let (start_params, start_opt) = (
        copies(task.state()),
        copies(opt.state().into_iter().map(|(n, t)| (n, t.shallow_clone())).collect()),
    );
    let reset = |opt: &mut AdamW| {
        tensors::copy_into(&start_params, &task.state()).unwrap();
        opt.load_state(&start_opt, None).unwrap();
    };
    // One step from micro-batch `mb`: its result, the guard's events, where it ended.
    let step_from = |opt: &mut AdamW, mb: usize| {
        let mut guard = Guard::new(&MemoryConfig::default(), mb, Device::Cpu);
        let r = guard.run(
            0,
            opt,
            |opt, mb| train_step(&task, opt, &batches as &StepSamples, 0, mb, 1e-3, 1.0),
            |o| o.clear_grads(),
        );
        (r, guard.drain_events(), guard.micro_batch_size())
    };

    // 1. Every allocation of one optimizer step (2 micro-batches of 8, clipping, AdamW).
    // A recovered step is held to the clean step at the micro-batch size it ended on: the
    // same samples split otherwise sum in another order, and AdamW's first step turns the
    // last bits of a gradient near its eps into visible differences (tests/training.rs
    // holds the splits to each other over whole runs).
    let n = allocations(|| step_from(&mut opt, 8).0.map(|_| ()).unwrap());
    let mut clean = std::collections::BTreeMap::from([(8, copies(task.state()))]);
    let mut phases = BTreeSet::new();
    for k in 0..n {
        reset(&mut opt);
        let ((r, events, mb), fired) = with_failure_at(k, || step_from(&mut opt, 8));
        assert!(fired, "allocation {k} of {n}: no failure injected");
        let stats = r.unwrap_or_else(|e| panic!("allocation {k} of {n}: the step failed: {e}"));
        assert_eq!(stats.num_samples, 16);
        for e in events {
            if let GuardEvent::Oom(o) = e {
                phases.insert(format!("{:?}", o.phase.unwrap()));
            }
        }
        for (name, t) in opt.state() {
            if name.ends_with(".step") {
                assert_eq!(
                    t.double_value(&[]),
                    1.0,
                    "allocation {k}: {name}: updated other than exactly once"
                );
            }
        }
        let recovered = copies(task.state());
        if let std::collections::btree_map::Entry::Vacant(e) = clean.entry(mb) {
            reset(&mut opt);
            let (r, _, ended) = step_from(&mut opt, mb);
            assert!(r.is_ok() && ended == mb, "a clean step at micro-batch {mb}");
            e.insert(copies(task.state()));
        }
        let (d, name) = max_diff(&clean[&mb], &recovered);
        assert!(
            d < 1e-5,
            "allocation {k} of {n}: {name} differs from a clean step at micro-batch {mb} by {d}"
        );
    }
    for p in ["Data", "Forward", "Backward", "Clip", "Optimizer"] {
        assert!(phases.contains(p), "no failure landed in {p}: {phases:?}");
    }
    println!("step: an OOM at each of its {n} allocations recovered ({phases:?})");

    // 2. Every allocation of one evaluation (2 batches of 16).
    let spec = EvalSpec {
        samples: data.val.as_ref() as &dyn Samples,
        seed: 1,
        batch_size: 16,
        num_batches: 2,
        device: Device::Cpu,
    };
    let eval = || {
        evaluate(
            &task,
            &spec,
            &mut Guard::for_eval(&MemoryConfig::default(), 16, Device::Cpu),
            0,
            &Amp::fp32(Device::Cpu),
            None,
        )
    };
    let reference = eval().unwrap();
    let m = allocations(|| {
        eval().unwrap();
    });
    for k in 0..m {
        let (v, fired) = with_failure_at(k, eval);
        assert!(fired);
        let v = v.unwrap_or_else(|e| panic!("evaluation allocation {k} of {m}: {e}"));
        assert!(
            (v - reference).abs() < 1e-6,
            "evaluation allocation {k}: {v} != {reference}"
        );
    }

    // 3. Every allocation of a checkpoint write, then of a restore: an OOM error (never a
    // panic), and a retry that succeeds with the same tensors.
    let dir = tempfile::tempdir().unwrap();
    let state = common::train_state(&task, 1);
    let full: Vec<(String, Tensor)> = opt.state().into_iter().map(|(n, t)| (n, t.shallow_clone())).collect();
    let save = || checkpoint::save(dir.path(), &state, &task, &full, Device::Cpu);
    let saved = save().unwrap();
    let w = allocations(|| {
        std::fs::remove_dir_all(&saved).unwrap();
        save().unwrap();
    });
    for k in 0..w {
        std::fs::remove_dir_all(&saved).unwrap();
        let (r, fired) = with_failure_at(k, save);
        assert!(
            fired && matches!(r, Err(Error::Oom(_))),
            "checkpoint allocation {k} of {w}: {r:?}"
        );
        assert!(!saved.exists(), "a failed write left a checkpoint behind");
        save().unwrap();
        checkpoint::verify(&saved).unwrap();
    }
    let before = copies(task.state());
    let r_allocs = allocations(|| checkpoint::restore(&saved, &task, &mut opt, Device::Cpu).unwrap());
    for k in 0..r_allocs {
        let (r, fired) = with_failure_at(k, || checkpoint::restore(&saved, &task, &mut opt, Device::Cpu));
        assert!(
            fired && matches!(r, Err(Error::Oom(_))),
            "restore allocation {k} of {r_allocs}: {r:?}"
        );
        checkpoint::restore(&saved, &task, &mut opt, Device::Cpu).unwrap();
        assert_eq!(max_diff(&before, &task.state()).0, 0.0);
    }
    println!("evaluation: {m} allocations, checkpoint write: {w}, restore: {r_allocs}; an OOM at each recovered");
}
