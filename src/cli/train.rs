//! Owns `oomguard train CONFIG`, and the same command for a Rust program's model (`main_with`).
//! Keeps: a run is never overwritten: a fresh run refuses a directory that already holds one.
use anyhow::Context;
use clap::Parser;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use std::os::unix::process::CommandExt;

pub use oomguard_cli::TrainArgs;

use crate::config::resume::{self, Changed};
use crate::config::{self, ConfigError};
use crate::memory::allocator;
use crate::task::build_from_config;
use crate::train::Builder;
use crate::{metrics, train};

pub fn exec(args: TrainArgs) -> anyhow::Result<()> {
    exec_with(args, &build_from_config)
}

/// `oomguard train` for a Rust program's own model: the same command line (`CONFIG
/// [--run-dir DIR] [--resume] [--set k=v] ...`), run directory, checkpoints, resume, signals,
/// metrics and exit codes, for the model `build` makes. Returns the exit code.
///
/// ```no_run
/// # use oomguard::task::{Built, BuildContext};
/// # fn my_model(ctx: &BuildContext) -> oomguard::Result<Built> { unimplemented!() }
/// fn main() {
///     std::process::exit(oomguard::cli::train::main_with(&my_model));
/// }
/// ```
pub fn main_with(build: Builder) -> i32 {
    run_with(std::env::args_os(), build)
}

/// `main_with` on given arguments (the first is the program's name): the same command line
/// and exit codes, for tests and for programs that build their arguments.
///
/// ```
/// # use oomguard::task::{BuildContext, Built};
/// # fn my_model(_: &BuildContext) -> oomguard::Result<Built> { unreachable!("--help trains nothing") }
/// use oomguard::cli::train::run_with;
/// // `--help` prints the flags (those of `oomguard train`) and exits 0; a bad flag exits 2.
/// assert_eq!(run_with(["my-trainer", "--help"], &my_model), 0);
/// assert_eq!(run_with(["my-trainer", "config.yaml", "--no-such-flag"], &my_model), 2);
/// ```
pub fn run_with(args: impl IntoIterator<Item = impl Into<OsString> + Clone>, build: Builder) -> i32 {
    #[derive(Parser)]
    #[command(about = "Train a model under oomguard's allocation guard")]
    struct Program {
        /// Format of the logs on stderr.
        #[arg(long, value_enum, default_value_t = super::LogFormat::Human)]
        log_format: super::LogFormat,
        #[command(flatten)]
        train: TrainArgs,
    }
    let program = match Program::try_parse_from(args) {
        Ok(p) => p,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    super::init_tracing(program.log_format);
    super::finish(exec_with(program.train, build))
}

pub fn exec_with(args: TrainArgs, build: Builder) -> anyhow::Result<()> {
    let path = args.config.clone();
    config::in_file(train(args, build), path.as_deref())
}

fn train(args: TrainArgs, build: Builder) -> anyhow::Result<()> {
    if let (Some(n), None, false) = (&args.nproc_per_node, std::env::var_os("RANK"), args.check) {
        // One run directory for every rank, chosen here (each rank would pick its own).
        let run_dir = match (&args.run_dir, &args.resume_from) {
            (None, None) => Some(next_run_dir(config_arg(&args)?)?),
            _ => None,
        };
        return launch_self(n, run_dir.as_deref());
    }
    // Data parallel: rank 0 writes the run's files; every rank trains.
    let lead = std::env::var("RANK").map_or(true, |r| r.trim() == "0");
    // The launcher started this command again (an OOM relaunch, a restart): a run that
    // saved since continues from its newest checkpoint, not from --resume-from's again.
    let relaunched = std::env::var("TORCHELASTIC_RESTART_COUNT")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|n| n > 0);
    // Saved since the fork: the newest checkpoint is the fork's own (else it is the future
    // the fork leaves, which its first attempt had not pruned yet).
    let saved_since = |p: &Path| {
        let dir = args.run_dir.clone().or_else(|| resumed_run_dir(p).ok());
        dir.is_some_and(|d| crate::checkpoint::fork_saved(&d, p))
    };
    let resume = match (&args.resume_from, args.resume) {
        (Some(p), _) if relaunched && saved_since(p) => {
            tracing::info!(
                "started again by the launcher: continuing from the newest checkpoint (as --resume), not {}",
                p.display()
            );
            train::Resume::Newest
        }
        (Some(p), _) => train::Resume::From(p.clone()),
        (None, true) => train::Resume::Newest,
        // A later round of an elastic job continues the run, as --resume would: a fresh
        // start would drop what the survivors saved.
        (None, false) if crate::dist::elastic::restarted() => {
            tracing::info!("a later round of an elastic job: continuing from the newest checkpoint (as --resume)");
            train::Resume::Newest
        }
        (None, false) => train::Resume::Fresh,
    };
    let run_dir = match (&args.run_dir, &args.resume_from) {
        (Some(d), _) => d.clone(),
        // run_dir/checkpoints/step-N
        (None, Some(p)) => resumed_run_dir(p)?,
        (None, None) => next_run_dir(config_arg(&args)?)?,
    };
    let mut overrides = args.set.clone();
    if let Some(n) = args.max_steps {
        overrides.push(format!("train.max_steps={n}"));
    }
    if let Some(b) = &args.memory_budget {
        overrides.push(format!("memory.budget={b}"));
    }
    // Resuming with no config file: the run's own.
    let config_path = args.config.clone().unwrap_or_else(|| run_dir.join("config.yaml"));
    if args.config.is_none() && !config_path.exists() {
        return Err(crate::Error::Config(ConfigError {
            origin: "--resume".into(),
            line_col: None,
            key: String::new(),
            message: format!(
                "{} does not exist, so this run's config is unknown; give the config file: \
                 oomguard train CONFIG --run-dir {} --resume",
                config_path.display(),
                run_dir.display()
            ),
        })
        .into());
    }
    let cfg = config::load(&config_path, &overrides).map_err(crate::Error::from)?;
    cfg.check_data_files().map_err(crate::Error::from)?;
    let settings = allocator_settings(&cfg)?;
    cfg.raw.train.check_device().map_err(|e| {
        crate::Error::Config(ConfigError {
            origin: cfg.path.display().to_string(),
            ..e
        })
    })?;
    // A --resume-from that names no checkpoint: refused before a file is written.
    if let train::Resume::From(p) = &resume {
        if !p.join("state.json").is_file() {
            return Err(crate::Error::Config(ConfigError {
                origin: "--resume-from".into(),
                line_col: None,
                key: p.display().to_string(),
                message:
                    "is not a checkpoint (no state.json in it); give a run's checkpoint: RUN_DIR/checkpoints/step-N, \
                          or --resume for the run's newest"
                        .into(),
            })
            .into());
        }
    }
    if args.check {
        // Data parallel: the world `--nproc-per-node` or the launcher's WORLD_SIZE gives.
        let world = args
            .nproc_per_node
            .as_deref()
            .and_then(|n| n.parse().ok())
            .or_else(|| std::env::var("WORLD_SIZE").ok()?.parse().ok());
        if let Some(w) = world.filter(|&w: &usize| w > 1) {
            train::check_world(cfg.raw.train.global_batch_size(), w, &config_path.display().to_string())?;
        }
        check_builds(&cfg, build)?;
        println!("{}: valid", config_path.display());
        return Ok(());
    }
    // Another run's checkpoint, branched into a run directory of its own.
    let source = match &resume {
        train::Resume::From(p) => foreign_source(p, &run_dir)?,
        _ => None,
    };
    let config_changed = match (&resume, &source) {
        (train::Resume::Fresh, _) => None,
        // The config must be that run's (its earlier config stays in its own directory).
        (_, Some(source)) => identity(&cfg, source, args.allow_change)?.map(|c| Changed {
            kept: source.join("config.yaml").display().to_string(),
            ..c
        }),
        _ => identity(&cfg, &run_dir, args.allow_change)?,
    };
    let keep_as = match source {
        Some(_) => None,
        None => config_changed.as_ref().map(|c| c.kept.clone()),
    };
    weights_readable(&cfg)?;
    if lead && matches!(resume, train::Resume::Fresh) {
        prepare_run_dir(&run_dir)?;
    } else {
        create_run_dir(&run_dir)?;
    }
    crate::signals::install().context("installing the SIGINT/SIGTERM handlers")?;
    let inject_oom = args
        .inject_oom
        .as_deref()
        .map(str::parse)
        .transpose()
        .map_err(|e: String| {
            crate::Error::Config(ConfigError {
                origin: "--inject-oom".into(),
                line_col: None,
                key: String::new(),
                message: e,
            })
        })?;
    let files = train::ConfigFiles {
        run_dir: run_dir.clone(),
        resolved: serde_yaml::to_string(&cfg.stored()).context("encoding the resolved config")?,
        keep_as,
    };
    // A fresh run's config now, and a resume's with none stored yet (a sweep trial's first
    // start); otherwise once its checkpoint has loaded (the run goes on).
    // A --resume-from's only after its checkpoint loads: a refused one leaves no config behind
    // for a later --resume to start afresh with.
    let now = match resume {
        train::Resume::Fresh => true,
        train::Resume::Newest => !run_dir.join("config.yaml").exists(),
        train::Resume::From(_) => false,
    };
    if lead {
        if now {
            files.write()?;
        }
        metrics::set_log_file(&run_dir.join("train.log"))?;
    }
    tracing::info!("run directory {}", run_dir.display());

    let precision_set = args
        .set
        .iter()
        .any(|s| s.split_once('=').is_some_and(|(k, _)| k.trim() == "train.precision"));
    let s = train::train_with(
        &cfg,
        &run_dir,
        &settings,
        train::Options {
            resume,
            inject_oom,
            precision_set,
            config_changed,
            config_files: (!now).then_some(files),
        },
        build,
    )?;
    // No step ran: a resume of a finished run.
    if s.first_loss.is_nan() && s.tokens_per_s == 0.0 {
        tracing::info!(
            "done: the run had already reached step {}; nothing left to train",
            s.steps
        );
        return Ok(());
    }
    tracing::info!(
        "done: {} steps in {} wall time | loss {:.4} -> {:.4}{} | {:.0} tok/s | peak memory {} | {} OOMs recovered, micro-batch {} at the end",
        s.steps, oomguard_console::progress::human_duration(s.wall_s), s.first_loss, s.final_loss,
        s.val_loss.map(|v| format!(" | val loss {v:.4}")).unwrap_or_default(),
        s.tokens_per_s, crate::memory::human_bytes(s.peak_bytes), s.num_ooms, s.final_micro_batch_size
    );
    if let Some((fired, asked)) = s.injected {
        tracing::info!("--inject-oom: {fired} of {asked} allocation failures injected, all recovered");
    }
    Ok(())
}

/// The allocator settings in force (config merged with the environment). Settings libtorch
/// reads only at load time (`backend`) re-execute this process with them in the environment.
fn allocator_settings(cfg: &config::Config) -> anyhow::Result<allocator::AllocatorSettings> {
    let from_config = cfg.raw.memory.allocator_settings().map_err(|e| ConfigError {
        origin: cfg.path.display().to_string(),
        ..e
    });
    let settings = allocator::effective(&from_config.map_err(crate::Error::from)?, |v| std::env::var(v).ok())
        .map_err(crate::Error::from)?;
    let started_with = allocator::ENV_VARS.iter().rev().find_map(|v| std::env::var(v).ok());
    if allocator::startup(&settings, started_with.as_deref()) == allocator::Startup::Reexec {
        if std::env::var_os(REEXEC).is_some() {
            anyhow::bail!(
                "allocator backend `{}` was not in effect after restarting with it in the environment",
                settings.get("backend").unwrap_or("native")
            );
        }
        tracing::info!(
            "restarting so that libtorch loads with allocator settings `{}`",
            settings.render()
        );
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

/// `oomguard train ... --nproc-per-node N`: this same command, N times, under the launcher
/// (standalone: a free port on loopback, so runs side by side never meet).
fn launch_self(nproc: &str, run_dir: Option<&Path>) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let mut args: Vec<std::ffi::OsString> = vec![
        "oomguard".into(),
        "launch".into(),
        "--standalone".into(),
        "--nproc-per-node".into(),
        nproc.into(),
        "--no-python".into(),
        exe.into(),
    ];
    let mut skip = false;
    for a in std::env::args_os().skip(1) {
        let text = a.to_string_lossy();
        if std::mem::take(&mut skip) {
            continue;
        }
        match text.as_ref() {
            "--nproc-per-node" | "--nproc_per_node" => skip = true,
            t if t.starts_with("--nproc-per-node=") || t.starts_with("--nproc_per_node=") => {}
            _ => args.push(a),
        }
    }
    if let Some(d) = run_dir {
        args.extend(["--run-dir".into(), d.as_os_str().to_owned()]);
    }
    match super::Cli::try_parse_from(args)
        .context("building the launch command")?
        .command
    {
        super::Command::Launch(l) => oomguard_cli::launch(*l),
        _ => anyhow::bail!("building the launch command"),
    }
}

/// The config file argument, required where no run directory can give one.
fn config_arg(args: &TrainArgs) -> anyhow::Result<&Path> {
    args.config
        .as_deref()
        .context("a config file is needed (only a resume can leave it out)")
}

/// `--check`: the data opened as the run opens it (too short for the block, a token outside
/// the vocabulary, a tensors file that does not fit); and a model other than the built-in
/// GPT (Python, TorchScript, a Rust program's own), or Python data, built for real, on the
/// CPU, as the run would build them (its `model.init_from` loaded into it), so that
/// `build(settings)` raising (a typo in `model.settings`, which a sweep over
/// `model.settings.*` would hit in every trial) or a missing file is found here, naming the
/// config. The GPT is not built (a large one would take the host's memory): its
/// `model.init_from` is opened.
fn check_builds(cfg: &config::Config, build: Builder) -> anyhow::Result<()> {
    let c = &cfg.raw;
    let python = c.data.source == crate::data::DataSource::Python;
    let base = cfg.base_dir();
    if c.model.kind == crate::model::ModelKind::Gpt && !python {
        weights_readable(cfg)?;
        // The data as the run opens it (sizes, the split, token ids against the vocabulary).
        crate::task::data_for(&c.model, &c.data, &base, None)?;
        return Ok(());
    }
    let ctx = crate::task::BuildContext {
        device: tch::Device::Cpu,
        model: &c.model,
        data: &c.data,
        base_dir: &base,
        config_path: &cfg.path,
    };
    let built = crate::task::build_with_weights(&ctx, build)?;
    crate::task::data_for(&c.model, &c.data, &base, built.data)?;
    Ok(())
}

/// `model.init_from`, when set, opens: checked before a run directory is made for it.
fn weights_readable(cfg: &config::Config) -> Result<(), crate::Error> {
    let Some(from) = &cfg.raw.model.init_from else {
        return Ok(());
    };
    let path = cfg.base_dir().join(from);
    match std::fs::File::open(&path) {
        Ok(_) => Ok(()),
        Err(e) => Err(crate::Error::Config(ConfigError::invalid(
            "model.init_from",
            format!("{}: cannot read it: {e}", path.display()),
        ))),
    }
}

/// A resume's config against the run's stored one: a change that alters the run is refused
/// unless `allow`; an accepted change keeps the earlier config as `config.NNN.yaml` (written
/// once the checkpoint has loaded: `train::ConfigFiles`). A run with no checkpoint yet has
/// nothing to keep: any config goes.
fn identity(cfg: &config::Config, run_dir: &Path, allow: bool) -> anyhow::Result<Option<Changed>> {
    let path = run_dir.join("config.yaml");
    if crate::checkpoint::list(run_dir).is_empty() || !path.exists() {
        return Ok(None);
    }
    let stored = config::load(&path, &[]).map_err(crate::Error::from)?;
    // A run directory from before paths were stored absolute: its paths were the config's.
    let changes = resume::compare(&stored.raw.with_paths_from(&cfg.base_dir()), &cfg.stored());
    if changes.is_empty() {
        return Ok(None);
    }
    let alters = changes.iter().any(|c| c.alters);
    if alters && !allow {
        return Err(crate::Error::Config(ConfigError {
            origin: cfg.path.display().to_string(),
            line_col: None,
            key: String::new(),
            message: resume::refusal(&changes, run_dir),
        })
        .into());
    }
    for c in &changes {
        let how = if c.alters { "--allow-change: " } else { "" };
        tracing::info!("{how}resuming with {}: {} in the run, {} now", c.key, c.stored, c.new);
    }
    // Kept under this name once the checkpoint has loaded (`train::ConfigFiles`).
    let kept = (1..1000)
        .map(|i| format!("config.{i:03}.yaml"))
        .find(|n| !run_dir.join(n).exists())
        .context("no free config.NNN.yaml name in the run directory")?;
    Ok(Some(Changed {
        changes,
        allowed: alters,
        kept,
    }))
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

/// A fresh run's directory must be new, or hold no run (metrics, checkpoints): a run is never
/// overwritten, nor its checkpoints taken for the new run's.
fn prepare_run_dir(dir: &Path) -> anyhow::Result<()> {
    let refuse = |what: &str| {
        Err(crate::Error::Config(ConfigError {
            origin: "--run-dir".into(),
            line_col: None,
            key: dir.display().to_string(),
            message: format!("already holds a run ({what}); continue it with --resume, or choose a new --run-dir"),
        })
        .into())
    };
    if dir.join("metrics.jsonl").exists() {
        return refuse("metrics.jsonl");
    }
    let checkpoints = dir.join("checkpoints");
    if std::fs::read_dir(&checkpoints).is_ok_and(|mut d| d.next().is_some()) {
        return refuse("checkpoints/");
    }
    create_run_dir(dir)
}

/// `dir` made (with its parents), or a usage error naming it when a file stands there.
fn create_run_dir(dir: &Path) -> anyhow::Result<()> {
    if dir.exists() && !dir.is_dir() {
        return Err(crate::Error::Config(ConfigError {
            origin: "--run-dir".into(),
            line_col: None,
            key: dir.display().to_string(),
            message: "is a file, not a directory; choose another --run-dir".into(),
        })
        .into());
    }
    // What the run writes into it, checked before the first step, not at the end.
    for (name, want_dir) in [("checkpoints", true), ("metrics.jsonl", false), ("config.yaml", false)] {
        let p = dir.join(name);
        if p.exists() && p.is_dir() != want_dir {
            return Err(crate::Error::Config(ConfigError {
                origin: "--run-dir".into(),
                line_col: None,
                key: p.display().to_string(),
                message: format!(
                    "is a {}, where the run writes its {name}; move it away or choose another --run-dir",
                    if want_dir { "file" } else { "directory" }
                ),
            })
            .into());
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating run directory {}", dir.display()))
}

/// The run `--resume-from`'s checkpoint belongs to, when that is not `run_dir` (a branch
/// into a run directory of its own); refused when `run_dir` holds checkpoints of its own
/// (resuming would mix two runs: the other's state, this one's checkpoints pruned after it).
fn foreign_source(checkpoint: &Path, run_dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let Ok(source) = resumed_run_dir(checkpoint) else {
        return Ok(None); // a folder outside any run's checkpoints/: nothing to compare
    };
    let same = |a: &Path, b: &Path| match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    if same(&source, run_dir) {
        return Ok(None);
    }
    if !crate::checkpoint::list(run_dir).is_empty() {
        return Err(crate::Error::Config(ConfigError {
            origin: "--resume-from".into(),
            line_col: None,
            key: checkpoint.display().to_string(),
            message: format!(
                "is a checkpoint of another run ({}), and --run-dir {} holds checkpoints of its own: resuming \
                 would mix the two runs; continue that run (--run-dir {}), or branch it into a new --run-dir",
                source.display(),
                run_dir.display(),
                source.display()
            ),
        })
        .into());
    }
    Ok(Some(source))
}

/// The run a `--resume-from RUN_DIR/checkpoints/step-N` continues; anything else is refused
/// before a file is written (the run directory would be a guess).
fn resumed_run_dir(p: &Path) -> anyhow::Result<PathBuf> {
    let bad = |why: &str| -> anyhow::Error {
        crate::Error::Config(ConfigError {
            origin: "--resume-from".into(),
            line_col: None,
            key: p.display().to_string(),
            message: format!("{why}; give a run's checkpoint: RUN_DIR/checkpoints/step-N"),
        })
        .into()
    };
    if !p.is_dir() {
        return Err(bad("is not a checkpoint directory (it does not exist, or is a file)"));
    }
    let checkpoints = p.parent().filter(|d| d.file_name().is_some_and(|n| n == "checkpoints"));
    let run = checkpoints.ok_or_else(|| bad("is not inside a run's checkpoints/ folder"))?;
    Ok(match run.parent() {
        Some(r) if !r.as_os_str().is_empty() => r.to_path_buf(),
        _ => PathBuf::from("."),
    })
}
