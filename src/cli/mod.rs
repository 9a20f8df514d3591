//! Command-line interface: one subcommand, one file. Each `exec` calls the library.
pub mod train;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(name = "oomguard", version, about = "A training runtime that never dies of an out-of-memory error")]
pub struct Cli {
    /// Format of the logs on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Human,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a GPT from a YAML config.
    Train(train::TrainArgs),
}

/// Exit codes (a contract): 0 success, 1 other failure, 2 bad input (config, flags, data
/// paths, checkpoints), 3 does not fit in memory even at micro-batch 1, 130/143 stopped by SIGINT/SIGTERM.
pub fn exit_code(err: &anyhow::Error) -> i32 {
    match err.downcast_ref::<oomguard::Error>() {
        Some(oomguard::Error::Config(_) | oomguard::Error::Data(_) | oomguard::Error::Checkpoint(_)) => 2,
        Some(oomguard::Error::Infeasible(_)) => 3,
        Some(oomguard::Error::Interrupted { signal, .. }) => signal.exit_code(),
        _ => 1,
    }
}
