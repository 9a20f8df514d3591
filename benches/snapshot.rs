//! `make bench` (snapshot): what `memory.snapshot` costs (issue 24).
//! 1. Overhead: tokens/s of steps with the history recording (`on_oom`, and `always`, which
//!    records the same) against steps with it off, alternating step by step in one process
//!    (goals: on_oom at most 1% slower, always at most 3% with its dump at the end).
//! 2. One dump at the default `max_events` with the ring full: its time and its size
//!    (goal: under 2 s).
//! 3. The process's host memory (RssAnon) over those steps: flat (it once grew ~40 MiB a
//!    step with recording on, a cost that alternating steps could not show as time).
mod common;
use std::time::Instant;
use tch::Device;

use oomguard::data::StepSamples;
use oomguard::memory::snapshot;
use oomguard::optim::AdamW;
use oomguard::task::Task;
use oomguard::train::train_step;

const GLOBAL: usize = 16;
const STEPS: usize = 30;

fn main() {
    let (task, mut opt, data) = common::bench_gpt();
    let batches = StepSamples::new(data.train.as_ref(), 1, GLOBAL, Device::Cpu);
    let defaults = snapshot::SnapshotConfig::default();
    println!(
        "GPT n_layer 4, n_head 4, n_embd 256, block 128, vocab 256, global batch {GLOBAL} (micro-batch 8), {} threads, max_events {}",
        tch::get_num_threads(),
        defaults.max_events
    );
    let mut step_no = 0u64;
    let mut step = |opt: &mut AdamW| {
        step_no += 1;
        snapshot::mark_attempt(step_no);
        train_step(&task, opt, &batches, step_no, 8, 1e-4, 1.0).unwrap();
    };
    step(&mut opt); // warm-up

    // 1. Off and recording alternate, so machine drift hits both alike.
    let rss = || oomguard_host::memory::own_anonymous_bytes().unwrap_or(0) as f64 / (1 << 20) as f64;
    let mut rss_seen = vec![];
    let (mut off, mut on) = (0.0, 0.0);
    for _ in 0..STEPS {
        snapshot::stop();
        let t = Instant::now();
        step(&mut opt);
        off += t.elapsed().as_secs_f64();
        snapshot::start(defaults.max_events).expect("the history starts");
        let t = Instant::now();
        step(&mut opt);
        on += t.elapsed().as_secs_f64();
        rss_seen.push(rss());
    }
    // Medians of the first and last ten: glibc returns memory in bursts of tens of MiB.
    let (rss_before, rss_after) = (
        common::median(rss_seen[..10].to_vec()),
        common::median(rss_seen[STEPS - 10..].to_vec()),
    );
    let events = snapshot::now().expect("the history reads").events.len();
    println!("recording (on_oom, always): {:.4} x the step time with it off, over {STEPS} alternating steps each ({:.3} s vs {:.3} s a step; goal at \
        most 1.01)", on / off, on / STEPS as f64, off / STEPS as f64);

    let per_step = (rss_after - rss_before) / (2 * (STEPS - 10)) as f64;
    println!("host memory (RssAnon) over those {} steps, median of the first and last ten pairs: {rss_before:.1} -> {rss_after:.1} MiB, \
        {per_step:+.2} MiB a step (goal: flat, under 0.1)", 2 * STEPS);

    // 2. One dump with the ring as full as the steps made it.
    let dir = tempfile::tempdir().unwrap();
    let params = task.parameters().into_iter().map(|(_, t)| t).collect();
    let state: Vec<tch::Tensor> = opt.state().into_iter().map(|(_, t)| t.shallow_clone()).collect();
    let always = snapshot::SnapshotConfig {
        mode: snapshot::SnapshotMode::Always,
        ..defaults
    };
    let mut dumper =
        snapshot::Dumper::new(dir.path(), always, Device::Cpu, params, &state, task.formula(), None).unwrap();
    let t = Instant::now();
    let d = dumper.at_end(step_no, 8).expect("the dump is written");
    let dump_s = t.elapsed().as_secs_f64();
    let size = std::fs::metadata(dir.path().join(&d.folder).join("snapshot.pickle"))
        .unwrap()
        .len();
    println!(
        "one dump: {dump_s:.3} s, snapshot.pickle {:.1} MiB, {events} events in the ring (goal under 2 s)",
        size as f64 / (1 << 20) as f64
    );
    let run_s = 1000.0 * off / STEPS as f64;
    println!("always over a 1000-step run: {:.4} x (recording, plus the dump's {dump_s:.3} s over {run_s:.0} s of steps; goal at most \
        1.03)", on / off + dump_s / run_s);
}
