//! `oomguard-torch`: the commands that need libtorch (oomguard hands them over).
use clap::Parser;
use oomguard::cli::{self, Cli};

fn main() {
    let args = Cli::parse();
    cli::init_tracing(args.log_format);
    std::process::exit(cli::finish(cli::run_torch(args.command)));
}
