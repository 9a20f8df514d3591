//! The oomguard binary: parse, set up logging, dispatch, map errors to exit codes.
mod cli;

use clap::Parser;
use std::io::IsTerminal;
use tracing_subscriber::{fmt, prelude::*, EnvFilter};

fn main() {
    let args = cli::Cli::parse();
    init_tracing(args.log_format);
    let result = match args.command {
        cli::Command::Train(a) => cli::train::exec(a),
    };
    if let Err(err) = result {
        tracing::error!("{err:#}");
        std::process::exit(cli::exit_code(&err));
    }
}

fn init_tracing(format: cli::LogFormat) {
    let filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let file = fmt::layer().with_ansi(false).with_target(false).with_writer(|| oomguard::metrics::LogFileWriter);
    let registry = tracing_subscriber::registry().with(file.with_filter(filter()));
    let ansi = std::io::stderr().is_terminal();
    let stderr = fmt::layer().with_writer(std::io::stderr).with_target(false).with_ansi(ansi);
    match format {
        cli::LogFormat::Human => registry.with(stderr.with_filter(filter())).init(),
        cli::LogFormat::Json => registry.with(stderr.json().with_filter(filter())).init(),
    }
}
