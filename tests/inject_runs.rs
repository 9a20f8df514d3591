//! `oomguard train --inject-oom COUNT:SEED`, many seeded runs: at least 1,000 injected
//! out-of-memory errors in all, landing wherever the seeds put them (data loading, forward,
//! backward, clipping, the optimizer, evaluation, checkpoints). Every run must finish with
//! exit 0, every step on its full global batch, each step once, and the parameters of the
//! clean run.
mod common;
use common::*;
use std::collections::BTreeMap;

const RUNS: u64 = 50;
const PER_RUN: u64 = 20;

#[test]
fn a_thousand_injected_ooms_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // Injected failures are not memory facts: a short cool-down lets sizes grow back, as after
    // a passing spike, so evaluation keeps a fair share of the allocations. No memory
    // snapshots: tests/snapshot.rs proves them, and a thousand dumps would triple the time.
    let yaml = TINY.replace("max_steps: 6, eval_every: 0, eval_batch_size: 8, eval_batches: 2", "max_steps: 24, eval_every: 2, eval_batch_size: 32, \
        eval_batches: 4")
        + "checkpoint: {every_steps: 1, keep: 2}\nmemory: {cooldown_steps: 2, grow_after_steps: 1, grow_headroom: 0.0, snapshot: off}\n";
    let cfg = write_config(dir.path(), "tiny.yaml", &yaml);
    let clean = train_ok(dir.path(), &cfg, &[]);
    std::fs::rename(&clean, dir.path().join("clean")).unwrap();
    let clean = dir.path().join("clean");

    // Two runs at a time (one thread each, on 2 cores).
    let one = |seed: u64| -> Vec<String> {
        let run = dir.path().join(format!("run{seed}"));
        let o = train_at(dir.path(), &cfg, &run, &["--inject-oom", &format!("{PER_RUN}:{seed}")]);
        let err = stderr(&o);
        assert!(o.status.success(), "seed {seed}: {err}");
        assert!(
            err.contains(&format!(
                "--inject-oom: {PER_RUN} of {PER_RUN} allocation failures injected"
            )),
            "seed {seed}: {err}"
        );
        let steps = records(&run, "step");
        assert_eq!(
            steps.iter().map(|s| s["step"].as_u64().unwrap()).collect::<Vec<_>>(),
            (0..24).collect::<Vec<_>>(),
            "seed {seed}: each step once"
        );
        assert!(
            steps.iter().all(|s| s["num_samples"] == 16),
            "seed {seed}: a step without its full global batch"
        );
        let ooms = records(&run, "oom");
        assert_eq!(ooms.len() as u64, PER_RUN, "seed {seed}: {ooms:?}");
        let d = max_abs_diff(&weights(&clean), &weights(&run));
        assert!(d < 1e-5, "seed {seed}: parameters differ from the clean run by {d}");
        std::fs::remove_dir_all(&run).unwrap();
        ooms.iter()
            .map(|e| e["phase"].as_str().unwrap_or("none").to_string())
            .collect()
    };
    let phases_of_all: Vec<String> = std::thread::scope(|s| {
        let halves: Vec<_> = (0..2)
            .map(|h| s.spawn(move || (h..RUNS).step_by(2).flat_map(one).collect::<Vec<_>>()))
            .collect();
        halves.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let injected = phases_of_all.len() as u64;
    let mut phases = BTreeMap::<String, u64>::new();
    for p in phases_of_all {
        *phases.entry(p).or_default() += 1;
    }
    println!("{injected} injected OOMs over {RUNS} runs, all recovered: {phases:?}");
    assert!(injected >= 1000);
    // (Checkpoint writing makes one allocation on the CPU, the random generators' state: a
    // run may not hit it; tests/inject_sweep.rs fails every allocation of a write in turn.)
    for p in ["data", "forward", "backward", "clip", "optimizer", "eval"] {
        assert!(
            phases.get(p).is_some_and(|&n| n > 0),
            "no injection landed in {p}: {phases:?}"
        );
    }
}

/// An evaluation after every step: no step without one is ever measured. The last step's
/// failures were all armed at its first allocation then (half of an unmeasured window of
/// 1), repeated exactly at every retry, and the guard climbed to bf16 (2.6e-5 off the clean
/// run) or exited 3.
#[test]
fn injected_ooms_with_an_evaluation_after_every_step_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY.replace("max_steps: 6, eval_every: 0", "max_steps: 12, eval_every: 1");
    let cfg = write_config(dir.path(), "tiny.yaml", &yaml);
    let clean = train_ok(dir.path(), &cfg, &[]);
    for count in [24, 40] {
        let run = dir.path().join(format!("run{count}"));
        let o = train_at(dir.path(), &cfg, &run, &["--inject-oom", &format!("{count}:9")]);
        assert!(o.status.success(), "{count}: {}", stderr(&o));
        assert!(
            records(&run, "rung").is_empty(),
            "{count}: a rung climbed: {}",
            stderr(&o)
        );
        let d = max_abs_diff(&weights(&clean), &weights(&run));
        assert!(d < 1e-5, "{count}: parameters differ from the clean run by {d}");
    }
}
