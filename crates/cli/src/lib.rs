//! Owns the command line both binaries share: `oomguard` runs `launch`, `sweep` and `report`
//! itself and hands every other command to `oomguard-torch` by exec.
//! Keeps: one definition of every command and flag, so both binaries parse alike.
//!
//! ```
//! use clap::Parser;
//! use oomguard_cli::{Cli, Command};
//!
//! let cli = Cli::try_parse_from(["oomguard", "train", "configs/demo.yaml", "--max-steps", "50"])?;
//! let Command::Train(train) = cli.command else { unreachable!() };
//! assert_eq!(train.max_steps, Some(50));
//! // torchrun's spellings, as `oomguard launch` takes them.
//! let cli = Cli::try_parse_from(["oomguard", "launch", "--nproc_per_node=2", "train.py"])?;
//! assert!(matches!(cli.command, Command::Launch(l) if l.nproc_per_node == "2"));
//! # Ok::<(), clap::Error>(())
//! ```
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::io::IsTerminal;
use std::path::PathBuf;
use tracing_subscriber::{fmt, prelude::*, EnvFilter};

use oomguard_console::{logfile, progress, ConfigError};
use oomguard_launch::{self as launch, LaunchSpec};

pub use oomguard_console::ExitCode;
pub use oomguard_launch::LaunchArgs;

#[derive(Debug, Parser)]
#[command(
    name = "oomguard",
    version,
    about = "A training runtime that never dies of an out-of-memory error"
)]
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
    /// Train a model (the built-in GPT, your PyTorch module, or a TorchScript one) from a YAML config.
    Train(TrainArgs),
    /// Launch a distributed job: a drop-in for torchrun.
    Launch(Box<LaunchArgs>),
    /// Print the memory a config needs and the largest micro-batch that fits.
    Plan(PlanArgs),
    /// Run a hyper-parameter sweep (ours or a W&B sweep file): one guarded `oomguard train`
    /// per trial, resumable; grid, random or model-based (TPE) search, early stopping (ASHA).
    Sweep(oomguard_sweep::SweepArgs),
    /// Draw a run (loss, tokens/s, memory, micro-batch, OOM events) or a sweep (its trials).
    Report(ReportArgs),
}

/// `oomguard report`
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// A run directory (with metrics.jsonl) or a sweep directory (with results.jsonl), or that
    /// file itself.
    #[arg(value_name = "RUN_DIR|SWEEP_DIR")]
    pub dir: PathBuf,
    /// The picture: FILE.png, FILE.svg or FILE.html (a self-contained page) [default: DIR/report.png].
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// `oomguard plan`
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The YAML config.
    pub config: PathBuf,
    /// Override a config key: --set model.block_size=512
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    pub set: Vec<String>,
    /// Memory to fit: a size (24GiB) or a card: T4 (16GiB), L4 (24GiB), A100-40GB, A100 /
    /// A100-80GB, H100 (80GiB), H200 (140GiB). Default: the CPU memory budget for CPU configs.
    #[arg(long, value_name = "SIZE|CARD")]
    pub device_memory: Option<String>,
    /// Precision to plan for: fp32, or bf16/fp16 (activations at half size but the residual stream). Default: what
    /// train would run, train.precision on the planned device (auto: bf16 on a card
    /// --device-memory names that runs it natively, not a T4, or given by size, or on an
    /// Ampere or newer GPU here; else fp32).
    #[arg(long, value_parser = ["fp32", "bf16", "fp16"])]
    pub precision: Option<String>,
    /// Data-parallel ranks: also plan each `train.shard` stage per rank (none, optimizer,
    /// gradients), and which fits at what micro-batch.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub nproc_per_node: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `oomguard train`
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The YAML config (see configs/). Resuming, leave it out to continue the run as its
    /// run directory stored it (RUN_DIR/config.yaml).
    #[arg(required_unless_present_any = ["resume", "resume_from"])]
    pub config: Option<PathBuf>,
    /// Override a config key, typed and validated like the file: --set train.max_steps=50
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    pub set: Vec<String>,
    // `help =`, not a doc comment: rustdoc would read `<config name>` as an HTML tag.
    #[arg(
        long,
        help = "Where the resolved config, metrics.jsonl and train.log go [default: runs/<config name>/NNN]"
    )]
    pub run_dir: Option<PathBuf>,
    /// Shorthand for --set train.max_steps=N.
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Continue from the newest valid checkpoint in --run-dir (from step 0 if it has none yet),
    /// in the precision it recorded unless --set train.precision=... is given.
    #[arg(long, requires = "run_dir", conflicts_with = "resume_from")]
    pub resume: bool,
    /// Continue from this checkpoint folder (run_dir/checkpoints/step-N).
    #[arg(long, value_name = "PATH")]
    pub resume_from: Option<PathBuf>,
    /// Resuming: accept a config that changes the run (model, data, seed, optimizer, schedule,
    /// global batch); recorded as a config_changed event, the earlier config kept as
    /// RUN_DIR/config.NNN.yaml. Without it such a resume exits 2 and touches nothing.
    #[arg(long)]
    pub allow_change: bool,
    /// Memory budget (auto, none, or a size like 2GiB; on CUDA it caps the caching allocator);
    /// shorthand for --set memory.budget=SIZE.
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// Data parallel on this machine: shorthand for `oomguard launch --standalone
    /// --nproc-per-node N --no-python oomguard train ...` (N, auto, cpu or gpu; a free port
    /// on loopback). Several nodes: use `launch`.
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", value_name = "N")]
    pub nproc_per_node: Option<String>,
    /// Validate the config (with every --set), its data files and allocator settings, and build
    /// a model other than the built-in GPT (Python, TorchScript) and Python data as the run
    /// would, with model.init_from, then exit: 0 valid, 2 not. Nothing is trained or written.
    #[arg(long)]
    pub check: bool,
    /// Testing and chaos tool: make COUNT allocations fail with a real out-of-memory error,
    /// at seeded random allocations from the first training step on (CPU runs). The run must
    /// still finish with the parameters of a clean run (with model.dropout 0: a step retried
    /// at a smaller micro-batch draws its masks over other shapes).
    #[arg(long, value_name = "COUNT[:SEED]")]
    pub inject_oom: Option<String>,
}

/// Runs `oomguard launch`.
pub fn launch(args: LaunchArgs) -> anyhow::Result<()> {
    let spec = LaunchSpec::from_args(&args)?;
    if args.check {
        return check_launch(&spec);
    }
    match launch::run(&spec)? {
        0 => Ok(()),
        code => Err(ExitCode(code).into()),
    }
}

/// `oomguard launch --check`: a script that is not a file is bad input (exit 2); else the
/// command each worker runs.
fn check_launch(spec: &LaunchSpec) -> anyhow::Result<()> {
    let runs_a_file = spec.python && !spec.program.iter().any(|w| w == "-m");
    if let Some(script) = spec
        .program
        .iter()
        .skip(1)
        .find(|w| w.ends_with(".py"))
        .filter(|_| runs_a_file)
    {
        if !std::path::Path::new(script).is_file() {
            return Err(ConfigError {
                origin: "oomguard launch".into(),
                line_col: None,
                key: String::new(),
                message: format!("{script}: no such script"),
            }
            .into());
        }
    }
    println!(
        "valid: {} worker(s) a node, {} node(s), each running: {}",
        spec.nproc_per_node,
        spec.nnodes,
        spec.program.join(" ")
    );
    Ok(())
}

/// Runs `oomguard report`: warnings (lines skipped) on stderr, the figures or the sweep's
/// table on stdout.
pub fn report(args: ReportArgs) -> anyhow::Result<()> {
    let outcome = oomguard_report::report(&args.dir, args.out.as_deref())?;
    for w in &outcome.warnings {
        tracing::warn!("{w}");
    }
    print!("{}", outcome.text);
    tracing::info!("wrote {}", outcome.out.display());
    Ok(())
}

/// Exit codes for this crate's errors: 2 for bad input, a worker's own code for a failed job.
pub fn exit_code(err: &anyhow::Error) -> Option<i32> {
    if let Some(code) = err.downcast_ref::<ExitCode>() {
        return Some(code.0);
    }
    if let Some(e) = err.downcast_ref::<oomguard_report::Error>() {
        return Some(e.exit_code());
    }
    match err.downcast_ref::<launch::LaunchError>() {
        Some(launch::LaunchError::Config(_) | launch::LaunchError::Start(_)) => Some(2),
        Some(launch::LaunchError::Io { .. }) => Some(1),
        Some(launch::LaunchError::Signaled(sig)) => Some(128 + sig),
        Some(launch::LaunchError::Stopped { code, .. }) => Some(*code),
        None => err.downcast_ref::<ConfigError>().map(|_| 2),
    }
}

/// Logs a failure (not a worker's exit code: its summary is printed) and returns the code.
pub fn finish(result: anyhow::Result<()>, code_of: impl Fn(&anyhow::Error) -> i32) -> i32 {
    match result {
        Ok(()) => 0,
        Err(err) => {
            let code = code_of(&err);
            if err.downcast_ref::<ExitCode>().is_none() {
                tracing::error!("{err:#}");
                // Exit 3 marked as the Python guard marks it: the launcher then knows it from
                // a script's own exit 3.
                let mark = if code == 3 { launch::INFEASIBLE } else { "" };
                write_error_file(&format!("{mark}{err:#}"));
            }
            code
        }
    }
}

/// Under a launcher (`TORCHELASTIC_ERROR_FILE`, torchelastic's contract): the error, a
/// Python model's traceback included, for the launcher's failure summary. A file the
/// process already wrote (a user's `@record`) is kept.
fn write_error_file(message: &str) {
    let Some(path) = std::env::var_os("TORCHELASTIC_ERROR_FILE").map(std::path::PathBuf::from) else {
        return;
    };
    if path.exists() {
        return;
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let v = serde_json::json!({"message": {"message": message, "extraInfo": {"timestamp": secs.to_string()}}});
    let _ = std::fs::write(&path, v.to_string());
}

/// Replaces this process with `oomguard-torch` from the same folder, same arguments.
pub fn exec_torch_binary() -> anyhow::Error {
    use anyhow::Context;
    use std::os::unix::process::CommandExt;
    let exe = match std::env::current_exe().context("locating this executable") {
        Ok(e) => e.with_file_name("oomguard-torch"),
        Err(e) => return e,
    };
    let err = std::process::Command::new(&exe)
        .args(std::env::args_os().skip(1))
        .exec();
    let why = format!(
        "cannot run {} (install it beside oomguard): `train` and `plan` need oomguard-torch, the build that links \
         libtorch; in a clone of the repository, `make build` puts both in target/release/ (torch 2.13), `make gpu-kit \
         TORCH=VERSION` in gpu-kit/bin/ against another torch, a GPU host's (docs/getting-started.md, docs/gpu-and-docker.md)",
        exe.display()
    );
    anyhow::Error::new(err).context(why)
}

/// Logs to stderr (human or JSON; colour and live bars where `Console` allows them) and,
/// once a run directory is known, to its log file.
pub fn init_tracing(format: LogFormat) {
    let filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let file = fmt::layer()
        .with_ansi(false)
        .with_target(false)
        .with_writer(|| logfile::LogFileWriter);
    let registry = tracing_subscriber::registry().with(file.with_filter(filter()));
    let console = progress::Console::decide(format == LogFormat::Json, std::io::stderr().is_terminal(), &|v| {
        std::env::var(v).ok()
    });
    progress::allow_bars(console.bar);
    let stderr = fmt::layer()
        .with_writer(progress::StderrWriter::default())
        .with_target(false)
        .with_ansi(console.colour);
    // try_init: a program that trains several times in one process initialises once.
    let _ = match format {
        LogFormat::Human => registry.with(stderr.with_filter(filter())).try_init(),
        LogFormat::Json => registry.with(stderr.json().with_filter(filter())).try_init(),
    };
}
