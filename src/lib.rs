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
pub mod train;

pub use error::{Error, Result};
