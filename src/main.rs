//! Owns `oomguard`: runs `launch`, `sweep` and `report` itself and hands every other command
//! to oomguard-torch beside it, by exec.
//! Keeps: only the libtorch-free crates are used here, so libtorch is never loaded.
use clap::Parser;
use oomguard_cli::{self as cli, Cli, Command};

fn main() {
    let args = Cli::parse();
    // In the Docker image: refuse at once on a host whose driver is too old for its CUDA.
    if let Err(why) = oomguard_host::driver::check_image() {
        eprintln!("oomguard: {why}");
        std::process::exit(2);
    }
    let result = match args.command {
        Command::Launch(a) => {
            cli::init_tracing(args.log_format);
            cli::launch(*a)
        }
        Command::Sweep(a) => {
            cli::init_tracing(args.log_format);
            oomguard_sweep::run(a)
        }
        Command::Report(a) => {
            cli::init_tracing(args.log_format);
            cli::report(a)
        }
        _ => {
            // exec returns only on failure: say it in one line (tracing is not set up here).
            eprintln!("oomguard: {:#}", cli::exec_torch_binary());
            std::process::exit(2);
        }
    };
    std::process::exit(cli::finish(result, |e| cli::exit_code(e).unwrap_or(1)));
}
