//! Owns the libtorch side of the command line and its exit codes.
//! Keeps: exit codes are a contract (0, 1, 2 bad input, 3 does not fit, 130/143 signals).
pub mod plan;
pub mod train;

pub use oomguard_cli::{exec_torch_binary, init_tracing, Cli, Command, ExitCode, LogFormat};

/// Runs a command in the libtorch binary (every command is available there).
pub fn run_torch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Train(a) => train::exec(a),
        Command::Launch(a) => oomguard_cli::launch(*a),
        Command::Plan(a) => plan::exec(a),
        Command::Sweep(a) => oomguard_sweep::run(a),
        Command::Report(a) => oomguard_cli::report(a),
    }
}

/// Exit codes (a contract): 0 success, 1 other failure, 2 bad input (config, flags, data
/// paths, checkpoints), 3 does not fit in memory even at micro-batch 1, 130/143 stopped by
/// SIGINT/SIGTERM; `launch` passes a failed worker's code through.
pub fn exit_code(err: &anyhow::Error) -> i32 {
    match err.downcast_ref::<crate::Error>() {
        Some(crate::Error::Config(_) | crate::Error::Data(_) | crate::Error::Checkpoint(_)) => 2,
        Some(crate::Error::Infeasible(_)) => 3,
        None if err.downcast_ref::<plan::NothingFits>().is_some() => 3,
        Some(crate::Error::Interrupted { signal, .. }) => signal.exit_code(),
        Some(_) => 1,
        None => oomguard_cli::exit_code(err).unwrap_or(1),
    }
}

/// Logs a failure and returns the process's exit code.
pub fn finish(result: anyhow::Result<()>) -> i32 {
    oomguard_cli::finish(result, exit_code)
}
