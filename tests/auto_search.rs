//! Under a budget, `micro_batch_size: auto` lands within 10% of the true largest size that
//! fits, which this test finds by brute force with real training steps. Alone in its file:
//! the CPU budget is process-wide.
mod common;
use oomguard::memory;
use oomguard::plan::{auto_micro_batch, AutoSearch};
use oomguard::train::train_step;
use tch::Device;

#[test]
fn search_lands_within_10_percent_of_brute_force() {
    let cache = tempfile::tempdir().unwrap();
    std::env::set_var("OOMGUARD_CACHE", cache.path());
    let common::TinyGpt { data, task, mut opt } = common::tiny_gpt();
    const GLOBAL: usize = 64;
    let batches = common::tiny_batches(&data, GLOBAL);
    memory::set_cpu_budget(Some(memory::cpu_live_bytes() + (3 << 20)));

    // Brute force: the largest micro-batch at which a whole real training step succeeds
    // (each probe is its own step: the optimizer applies a step once).
    let mut truth = 0;
    for m in 1..=GLOBAL {
        match train_step(&task, &mut opt, &batches, m as u64, m, 1e-6, 1.0) {
            Ok(_) => truth = m,
            Err(e) if e.is_oom() => {
                opt.clear_grads();
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        truth > 4 && truth < GLOBAL,
        "the budget should cut somewhere inside: {truth}"
    );

    let spec = AutoSearch {
        key: "test".into(),
        start: 2,
        max: GLOBAL,
        margin: 0.1,
    };
    let r = auto_micro_batch(
        &task,
        &batches,
        || opt.clear_grads(),
        &oomguard::precision::Amp::fp32(Device::Cpu),
        spec,
    )
    .unwrap();
    memory::set_cpu_budget(None);
    let found = r.largest_fitting;
    assert!(
        found <= truth + truth / 10 && found as f64 >= 0.9 * truth as f64,
        "found {found}, truth {truth}"
    );
    assert!(
        r.trials as f64 <= 2.0 * (truth as f64).log2().ceil() + 2.0,
        "{} trials",
        r.trials
    );
    assert_eq!(r.micro_batch_size, ((found as f64) * 0.9).floor() as usize);
}
