//! What an oomguard process shows its user, with no libtorch: errors that name the file,
//! the key and the fix (exit 2) and the exit codes passed through, the run's log file, the
//! live progress line, and sizes and durations for people.
mod error;
pub mod logfile;
pub mod progress;
pub mod units;

pub use error::{ConfigError, ExitCode};
