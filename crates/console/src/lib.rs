//! Owns what an oomguard process shows its user, with no libtorch: config errors, exit codes,
//! the run's log file, the live progress line, and sizes and durations for people.
//! Keeps: a user's mistake is reported naming the file, the key and the fix, and exits 2.
//!
//! ```
//! use oomguard_console::{units::human_bytes, ConfigError};
//!
//! let mut e = ConfigError::invalid("train.max_steps", "must be at least 1");
//! e.origin = "demo.yaml".into();
//! assert_eq!(e.to_string(), "demo.yaml: train.max_steps: must be at least 1");
//! assert_eq!(human_bytes(3 << 29), "1.5 GiB");
//! ```
mod error;
pub mod logfile;
pub mod progress;
pub mod units;

pub use error::{ConfigError, ExitCode};

/// In the launcher's last ERROR line, between its reason for giving up and the failed
/// worker's own last error line (which `oomguard sweep` records for a failed script trial).
pub const WORKER_SAID: &str = "; the worker's last error: ";
