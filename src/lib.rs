//! oomguard: a tch (libtorch) training runtime that never dies of an out-of-memory error.
//!
//! The flow of one optimizer step: `config` → `data::sample_offsets(seed, step)` picks the
//! samples → `train::train_step` splits them into micro-batches, runs the model's fallible
//! forward and backward and the fused AdamW update → `metrics` records it.
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod data;
pub mod error;
pub mod guard;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod plan;
pub mod signals;
pub mod train;

pub use error::{Error, Result};
