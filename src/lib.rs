//! Owns the runtime: a tch (libtorch) trainer that never dies of an out-of-memory error.
//! Keeps: every sample of the global batch is trained exactly once per step, whatever the guard
//! does to the micro-batch.
//!
//! The flow of one optimizer step: `config` → a `task::Task` (the GPT, a TorchScript module or
//! a Rust program's own model) → `data::sample_positions(seed, step)` picks the samples →
//! `train::train_step` splits them into micro-batches, runs the task's fallible forward and
//! backward and the transactional fused AdamW update, inside `guard::Guard::run` → `metrics`
//! records it.

/// A test-only environment variable (docs/environment.md, "Test hooks"): its value in a
/// build with the `test-hooks` feature (the one `make test` runs); `None` in any other build,
/// whose binary then holds neither the read nor the name.
macro_rules! test_hook {
    ($name:literal) => {{
        #[cfg(feature = "test-hooks")]
        let value = std::env::var($name).ok();
        #[cfg(not(feature = "test-hooks"))]
        let value: Option<String> = None;
        value
    }};
}

/// A `RANK:STEP:MS` test hook's value (`test_hook!`): sleeps MS when this is rank RANK at step
/// STEP, so that a test can kill a process at exactly that point.
pub(crate) fn pause_at(hook: Option<String>, rank: usize, step: u64) {
    let v: Vec<u64> = (hook.iter().flat_map(|v| v.split(':')))
        .filter_map(|p| p.parse().ok())
        .collect();
    if let [r, s, ms] = v[..] {
        if r == rank as u64 && s == step {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    }
}

pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod data;
pub mod dist;
pub mod error;
pub mod guard;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod optim;
pub mod plan;
pub mod precision;
pub mod rng;
pub mod signals;
pub mod task;
pub mod trackers;
pub mod train;

pub use error::{Error, Result};
