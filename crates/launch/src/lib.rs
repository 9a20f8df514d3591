//! The parts of oomguard that need no libtorch: the command line, the torchrun-compatible
//! launcher, allocator settings, config errors and OOM classification. The `oomguard`
//! binary links this crate alone, so it starts in milliseconds; the `oomguard` library
//! (with libtorch) builds on it.
pub mod allocator;
pub mod cli;
pub mod driver;
mod error;
pub mod host;
pub mod launch;
pub mod logfile;
pub mod oom;
pub mod proc;
pub mod progress;
pub mod sweep;
pub mod units;

pub use error::ConfigError;
