//! `oomguard train CONFIG`
use anyhow::Context;
use clap::Args;
use std::path::{Path, PathBuf};

use oomguard::config::{self, ConfigError};
use oomguard::{metrics, train};

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The YAML config (see configs/).
    pub config: PathBuf,
    /// Override a config key, typed and validated like the file: --set train.max_steps=50
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    pub set: Vec<String>,
    /// Where the resolved config, metrics.jsonl and train.log go [default: runs/<config name>/NNN].
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Shorthand for --set train.max_steps=N.
    #[arg(long)]
    pub max_steps: Option<u64>,
}

pub fn exec(args: TrainArgs) -> anyhow::Result<()> {
    let mut overrides = args.set.clone();
    if let Some(n) = args.max_steps {
        overrides.push(format!("train.max_steps={n}"));
    }
    let cfg = config::load(&args.config, &overrides).map_err(oomguard::Error::from)?;
    let run_dir = match args.run_dir {
        Some(d) => d,
        None => next_run_dir(&args.config)?,
    };
    prepare_run_dir(&run_dir)?;
    let resolved = serde_yaml::to_string(&cfg.raw).context("encoding the resolved config")?;
    std::fs::write(run_dir.join("config.yaml"), resolved).with_context(|| format!("writing {}/config.yaml", run_dir.display()))?;
    metrics::set_log_file(&run_dir.join("train.log"))?;
    tracing::info!("run directory {}", run_dir.display());

    let s = train::train(&cfg, &run_dir)?;
    tracing::info!(
        "done: {} steps in {:.1}s | loss {:.4} -> {:.4}{} | {:.0} tok/s | peak memory {}",
        s.steps, s.wall_s, s.first_loss, s.final_loss,
        s.val_loss.map(|v| format!(" | val loss {v:.4}")).unwrap_or_default(),
        s.tokens_per_s, oomguard::memory::human_bytes(s.peak_bytes)
    );
    Ok(())
}

/// `runs/<config stem>/NNN`, the first number not taken.
fn next_run_dir(config: &Path) -> anyhow::Result<PathBuf> {
    let stem = config.file_stem().and_then(|s| s.to_str()).unwrap_or("run");
    let parent = Path::new("runs").join(stem);
    (1..100_000)
        .map(|i| parent.join(format!("{i:03}")))
        .find(|p| !p.exists())
        .context("no free run directory under runs/")
}

/// A run directory must be new or empty of metrics: a finished run is never overwritten.
fn prepare_run_dir(dir: &Path) -> anyhow::Result<()> {
    if dir.join("metrics.jsonl").exists() {
        return Err(oomguard::Error::Config(ConfigError {
            origin: "--run-dir".into(),
            line_col: None,
            key: dir.display().to_string(),
            message: "already holds a run (metrics.jsonl); choose a new --run-dir".into(),
        })
        .into());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating run directory {}", dir.display()))
}
