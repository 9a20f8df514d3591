//! Owns `oomguard-torch`: the binary that links libtorch and runs every command.
//! Keeps: exit codes are `cli::exit_code`'s, the same contract as `oomguard`'s.
use clap::Parser;
use oomguard::cli::{self, Cli};

fn main() {
    let args = Cli::parse();
    cli::init_tracing(args.log_format);
    std::process::exit(cli::finish(cli::run_torch(args.command)));
}
