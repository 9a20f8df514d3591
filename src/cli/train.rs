//! `oomguard train CONFIG`
use anyhow::Context;
use std::path::{Path, PathBuf};

use std::os::unix::process::CommandExt;

pub use oomguard_launch::cli::TrainArgs;

use crate::config::{self, ConfigError};
use crate::memory::allocator;
use crate::{metrics, train};

pub fn exec(args: TrainArgs) -> anyhow::Result<()> {
    let mut overrides = args.set.clone();
    if let Some(n) = args.max_steps {
        overrides.push(format!("train.max_steps={n}"));
    }
    if let Some(b) = &args.memory_budget {
        overrides.push(format!("memory.budget={b}"));
    }
    let cfg = config::load(&args.config, &overrides).map_err(crate::Error::from)?;
    cfg.check_data_files().map_err(crate::Error::from)?;
    let settings = allocator_settings(&cfg)?;
    let resume = match (&args.resume_from, args.resume) {
        (Some(p), _) => train::Resume::From(p.clone()),
        (None, true) => train::Resume::Newest,
        (None, false) => train::Resume::Fresh,
    };
    let run_dir = match (args.run_dir, &args.resume_from) {
        (Some(d), _) => d,
        // run_dir/checkpoints/step-N
        (None, Some(p)) => p.parent().and_then(Path::parent).map(Path::to_path_buf).context("--resume-from needs a path like RUN_DIR/checkpoints/step-N")?,
        (None, None) => next_run_dir(&args.config)?,
    };
    if matches!(resume, train::Resume::Fresh) {
        prepare_run_dir(&run_dir)?;
    } else {
        std::fs::create_dir_all(&run_dir).with_context(|| format!("creating run directory {}", run_dir.display()))?;
    }
    crate::signals::install().context("installing the SIGINT/SIGTERM handlers")?;
    let resolved = serde_yaml::to_string(&cfg.raw).context("encoding the resolved config")?;
    std::fs::write(run_dir.join("config.yaml"), resolved).with_context(|| format!("writing {}/config.yaml", run_dir.display()))?;
    metrics::set_log_file(&run_dir.join("train.log"))?;
    tracing::info!("run directory {}", run_dir.display());

    let s = train::train(&cfg, &run_dir, &settings, resume)?;
    tracing::info!(
        "done: {} steps in {:.1}s | loss {:.4} -> {:.4}{} | {:.0} tok/s | peak memory {} | {} OOMs recovered, micro-batch {} at the end",
        s.steps, s.wall_s, s.first_loss, s.final_loss,
        s.val_loss.map(|v| format!(" | val loss {v:.4}")).unwrap_or_default(),
        s.tokens_per_s, crate::memory::human_bytes(s.peak_bytes), s.num_ooms, s.final_micro_batch_size
    );
    Ok(())
}

/// The allocator settings in force (config merged with the environment). Settings libtorch
/// reads only at load time (`backend`) re-execute this process with them in the environment.
fn allocator_settings(cfg: &config::Config) -> anyhow::Result<allocator::AllocatorSettings> {
    let from_config = cfg.raw.memory.allocator_settings().map_err(|e| ConfigError { origin: cfg.path.display().to_string(), ..e });
    let settings = allocator::effective(&from_config.map_err(crate::Error::from)?, |v| std::env::var(v).ok())
        .map_err(crate::Error::from)?;
    let started_with = allocator::ENV_VARS.iter().rev().find_map(|v| std::env::var(v).ok());
    if allocator::startup(&settings, started_with.as_deref()) == allocator::Startup::Reexec {
        if std::env::var_os(REEXEC).is_some() {
            anyhow::bail!("allocator backend `{}` was not in effect after restarting with it in the environment", settings.get("backend").unwrap_or("native"));
        }
        tracing::info!("restarting so that libtorch loads with allocator settings `{}`", settings.render());
        let exe = std::env::current_exe().context("locating this executable to restart it")?;
        let err = std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .envs(allocator::ENV_VARS.map(|v| (v, settings.render())))
            .env(REEXEC, "1")
            .exec();
        return Err(err).context("restarting with the allocator settings");
    }
    Ok(settings)
}

const REEXEC: &str = "OOMGUARD_REEXECUTED";

/// `runs/<config stem>/NNN`, the first number not taken.
fn next_run_dir(config: &Path) -> anyhow::Result<PathBuf> {
    let stem = config.file_stem().and_then(|s| s.to_str()).unwrap_or("run");
    let parent = Path::new("runs").join(stem);
    (1..100_000)
        .map(|i| parent.join(format!("{i:03}")))
        .find(|p| !p.exists())
        .context("no free run directory under runs/")
}

/// A fresh run's directory must be new or empty of metrics: a run is never overwritten.
fn prepare_run_dir(dir: &Path) -> anyhow::Result<()> {
    if dir.join("metrics.jsonl").exists() {
        return Err(crate::Error::Config(ConfigError {
            origin: "--run-dir".into(),
            line_col: None,
            key: dir.display().to_string(),
            message: "already holds a run (metrics.jsonl); continue it with --resume, or choose a new --run-dir".into(),
        })
        .into());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating run directory {}", dir.display()))
}
