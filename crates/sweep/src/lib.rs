//! Owns `oomguard sweep`: one guarded `oomguard train` child per trial, recorded in results.jsonl.
//! Keeps: a sweep killed at any moment starts again where it was: finished trials skipped,
//! unfinished ones resumed from their checkpoints.
//!
//! ```
//! // A grid over two keys: every combination, each trial a base config with overrides.
//! let dir = std::env::temp_dir().join(format!("oomguard-sweep-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir)?;
//! std::fs::write(dir.join("base.yaml"), "train: {max_steps: 10}\n")?;
//! let sweep_file = "base: base.yaml\nmethod: grid\nparameters:\n  \
//!     optim.lr: {values: [1.0e-3, 3.0e-3]}\n  model.n_layer: {values: [2, 4]}\n";
//! std::fs::write(dir.join("sweep.yaml"), sweep_file)?;
//! let sweep = oomguard_sweep::load(&dir.join("sweep.yaml"))?;
//! assert_eq!(sweep.trials.len(), 4);
//! // A key the file format does not know is refused, naming the file and the key (exit 2).
//! std::fs::write(dir.join("bad.yaml"), "base: base.yaml\nmethdo: grid\n")?;
//! let e = oomguard_sweep::load(&dir.join("bad.yaml")).unwrap_err();
//! assert!(e.to_string().contains("methdo"), "{e}");
//! std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
mod asha;
mod command;
mod domain;
mod record;
mod shared_files;
mod spec;
mod status;
mod store;
mod sweeper;
mod table;
mod tpe;
mod trial;
#[cfg(test)]
mod wandb_oracle;

pub use record::{Record, Status};
pub use spec::{load, Metric, Sweep, Trial};
pub use store::Store;

use anyhow::Context;
use std::path::{Path, PathBuf};

use oomguard_console::units::human_bytes;
use oomguard_console::ConfigError;
use oomguard_host::proc::Signals;
use oomguard_host::{HostMemory, Threads};
use store::TrialLock;
use sweeper::Sweeper;

/// `oomguard sweep`
#[derive(Debug, clap::Args)]
pub struct SweepArgs {
    /// The sweep file: a base config and the parameters to vary (see configs/demo-sweep.yaml);
    /// a W&B sweep file is read as it is, with `base:` added (examples/sweep/wandb-sweep.yaml),
    /// or with a command that runs your script under oomguard launch (examples/sweep/script/).
    /// Grid, random or model-based (bayes/tpe) search; early stopping (ASHA) with early_stop
    /// or W&B's early_terminate.
    pub sweep: PathBuf,
    // `help =`, not a doc comment: rustdoc would read `<sweep file name>` as an HTML tag.
    #[arg(
        long,
        help = "The sweep directory: results.jsonl, sweep.log and trials/ID/ (each trial's run directory) [default: runs/<sweep file name>]"
    )]
    pub out: Option<PathBuf>,
    /// Trials at once: one GPU each where there are GPUs; on the CPU the cores are split
    /// between them.
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Run only the trials whose index is I modulo N (0-based), for N machines sharing --out.
    /// Default: from SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT, or JOB_COMPLETION_INDEX with
    /// --shards, else all trials.
    #[arg(long, value_name = "I/N")]
    pub shard: Option<String>,
    /// Shards in all when the index comes from JOB_COMPLETION_INDEX (a Kubernetes indexed
    /// Job: its completions).
    #[arg(long, value_name = "N")]
    pub shards: Option<usize>,
    /// Print the table of trials (finished, running, pending) and exit: takes no lock,
    /// creates nothing.
    #[arg(long)]
    pub status: bool,
    /// Run again this shard's trials recorded `failed` (after a fix to the script or the
    /// environment), each as an interrupted one: from its newest checkpoint, a script's whole.
    #[arg(long)]
    pub retry_failed: bool,
}

/// Which share of the trials this process runs: `(index, count)`. A pure function of the
/// flags and the environment.
pub fn shard(
    flag: Option<&str>,
    shards: Option<usize>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(usize, usize), ConfigError> {
    let bad = |key: &str, m: String| ConfigError {
        origin: key.into(),
        line_col: None,
        key: String::new(),
        message: m,
    };
    if let Some(text) = flag {
        let parsed = text
            .split_once('/')
            .and_then(|(i, n)| Some((i.trim().parse::<usize>().ok()?, n.trim().parse::<usize>().ok()?)));
        return match parsed {
            Some((i, n)) if n > 0 && i < n => Ok((i, n)),
            _ => Err(bad("--shard", format!("`{text}` is not I/N with 0 <= I < N, e.g. 0/4"))),
        };
    }
    let num = |var: &str| -> Result<Option<usize>, ConfigError> {
        env(var)
            .map(|v| v.trim().parse().map_err(|_| bad(var, format!("`{v}` is not a number"))))
            .transpose()
    };
    if let (Some(id), Some(count)) = (num("SLURM_ARRAY_TASK_ID")?, num("SLURM_ARRAY_TASK_COUNT")?) {
        // Arrays may start anywhere (--array=1-4): the index counts from the first task.
        let i = id.saturating_sub(num("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0));
        return if i < count && count > 0 {
            Ok((i, count))
        } else {
            Err(bad(
                "SLURM_ARRAY_TASK_ID",
                format!("{id} is outside the array's {count} tasks"),
            ))
        };
    }
    if let Some(i) = num("JOB_COMPLETION_INDEX")? {
        return match shards {
            Some(n) if i < n => Ok((i, n)),
            Some(n) => Err(bad(
                "--shards",
                format!("is {n} but JOB_COMPLETION_INDEX is {i}; give the Job's completions"),
            )),
            None => Err(bad(
                "--shards",
                "is required with JOB_COMPLETION_INDEX: give the indexed Job's completions, e.g. --shards 4".into(),
            )),
        };
    }
    Ok((0, 1))
}

/// The GPUs a slot can take: CUDA_VISIBLE_DEVICES's list, else every GPU the driver shows.
fn visible_gpus() -> Vec<String> {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => v
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
        Err(_) => (0..oomguard_host::num_gpus()).map(|i| i.to_string()).collect(),
    }
}

pub fn run(args: SweepArgs) -> anyhow::Result<()> {
    let sweep = spec::load(&args.sweep)?;
    let stem = args
        .sweep
        .file_stem()
        .map_or("sweep".into(), |s| s.to_string_lossy().into_owned());
    let out = args.out.clone().unwrap_or_else(|| Path::new("runs").join(stem));
    let (index, count) = shard(args.shard.as_deref(), args.shards, &|v| std::env::var(v).ok())?;
    let store = Store::new(&out);
    let mut records = store
        .read()
        .with_context(|| format!("reading {}", store.path().display()))?;
    if args.status {
        // Reads only: no lock taken, nothing created. Every shard's trials.
        let trials = sweeper::known(&sweep, &records, (0, 1));
        print!(
            "{}",
            table::render(&trials, &records, &|t| open_state(&out, t), sweep.metric, sweep.count)
        );
        if let Some(why) = status::target_reached(&records, sweep.metric, sweep.target) {
            println!("{why}");
        }
        return Ok(());
    }
    // --retry-failed: this shard's failed trials count as interrupted (recorded so once the
    // checks below pass; a refused sweep file changes nothing).
    let retried: Vec<String> = records
        .values_mut()
        .filter(|r| args.retry_failed && r.status == record::Status::Failed && r.index % count == index)
        .map(|r| {
            r.status = record::Status::Interrupted;
            r.trial.clone()
        })
        .collect();
    if args.parallel == 0 {
        return Err(ConfigError {
            origin: "--parallel".into(),
            line_col: None,
            key: String::new(),
            message: "is 0; give at least 1".into(),
        }
        .into());
    }
    let gpus = visible_gpus();
    if !gpus.is_empty() && args.parallel > gpus.len() {
        let m = format!(
            "is {} but {} GPUs are visible: each slot takes one GPU",
            args.parallel,
            gpus.len()
        );
        return Err(ConfigError {
            origin: "--parallel".into(),
            line_col: None,
            key: String::new(),
            message: m,
        }
        .into());
    }
    std::fs::create_dir_all(out.join("trials")).with_context(|| format!("creating {}", out.display()))?;
    oomguard_console::logfile::set_log_file(&out.join("sweep.log"))?;
    for n in &sweep.notices {
        tracing::info!("{n}");
    }
    let spec_text = std::fs::read(&args.sweep).with_context(|| format!("reading {}", args.sweep.display()))?;
    // Slots share this host: each gets its part of the CPU threads and of the memory.
    let host_threads = Threads::of_self();
    let host_memory = (args.parallel > 1).then(HostMemory::of_self).flatten();
    let exe = std::env::current_exe()
        .context("locating this executable")?
        .with_file_name("oomguard");
    let before = records
        .iter()
        .filter(|(_, r)| !r.status.is_final())
        .map(|(k, r)| (k.clone(), r.duration_s))
        .collect();
    let s = Sweeper {
        sweep: &sweep,
        out: out.clone(),
        exe,
        store,
        shard: (index, count),
        threads: (args.parallel > 1).then(|| host_threads.share(args.parallel)),
        env: host_memory
            .as_ref()
            .map(|m| m.share_env(args.parallel).to_vec())
            .unwrap_or_default()
            .into_iter()
            .chain(sweep.wandb_env.iter().cloned())
            .collect(),
        gpus,
        before,
        shared: shared_files::SharedFiles::new(std::env::current_dir().unwrap_or_default(), out.clone()),
    };
    let mine = sweeper::known(&sweep, &records, (index, count));
    let todo: Vec<&Trial> = mine
        .iter()
        .filter(|t| !records.get(&t.id).is_some_and(|r| r.status.is_final()))
        .collect();
    let finished = mine.len() - todo.len();
    tracing::info!(
        "sweep {}: {} trials, {} to run in shard {index}/{count}, {} at a time, into {}{}",
        sweep.path.display(),
        sweep.count,
        sweeper::total(&sweep, (index, count)) - finished,
        args.parallel,
        out.display(),
        sweep
            .early_stop
            .map(|e| format!("; early stopping (ASHA) at steps {:?}, eta {}", e.rungs(), e.eta))
            .unwrap_or_default()
    );
    if let Some(n) = s.threads {
        tracing::info!(
            "each trial gets {n} CPU thread{} (this host gives {host_threads})",
            if n == 1 { "" } else { "s" }
        );
    }
    if let Some(m) = &host_memory {
        tracing::info!(
            "host memory: {}; each of the {} slots gets {}",
            m.describe(),
            args.parallel,
            human_bytes(m.share(args.parallel).0)
        );
    }
    if let spec::Runner::Launch {
        script: Some(script), ..
    } = &sweep.runner
    {
        if !script.is_file() {
            return Err(ConfigError {
                origin: sweep.path.display().to_string(),
                line_col: None,
                key: "program".into(),
                message: format!(
                    "{} is not a file; `program` is relative to the directory oomguard sweep runs in, as for W&B's agent",
                    script.display()
                ),
            }
            .into());
        }
    }
    // Every trial's config is checked before the first one runs: a typo fails in seconds
    // (model-based search: a draw, and every parameter at each end of its range).
    let drawn = spec::corners(&sweep.domains, sweep.seed);
    let checks: Vec<&Trial> = if sweep.model_based() {
        drawn.iter().collect()
    } else {
        todo
    };
    for t in checks {
        if let Err(why) = s.launch(t, None).check().context("running oomguard train --check")? {
            let (key, what) = match sweep.runner {
                spec::Runner::Launch { .. } => ("command", "oomguard launch refuses its command"),
                spec::Runner::Train { .. } => ("parameters", "is not a valid config"),
            };
            let message = format!("trial {} ({}) {what}: {why}", t.id, t.describe());
            return Err(ConfigError {
                origin: sweep.path.display().to_string(),
                line_col: None,
                key: key.into(),
                message,
            }
            .into());
        }
    }
    // A trial's id hashes its parameters only: the trials here must train what this sweep
    // trains (another sweep file of the same name, or an edited base, would mix results in).
    same_runner(&sweep, &out)?;
    // The copy of what ran, once every check passed: a refused file leaves the last one.
    oomguard_report::atomic::write(&out.join("sweep.yaml"), &spec_text)
        .with_context(|| format!("copying {} into {}", args.sweep.display(), out.display()))?;
    if !retried.is_empty() {
        s.store.update(|all| {
            for (id, r) in all.iter_mut() {
                if retried.contains(id) && r.status == record::Status::Failed {
                    r.status = record::Status::Interrupted;
                }
            }
        })?;
        tracing::info!(
            "--retry-failed: running {} failed trial(s) again: {}",
            retried.len(),
            retried.join(", ")
        );
    }
    let signals = Signals::install().context("installing signal handlers")?;
    let mut reporter = status::Reporter::new(sweeper::total(&sweep, (index, count)), args.parallel, sweep.metric);
    let stopped = s.schedule(args.parallel, &signals, &mut reporter)?;
    if stopped.is_none() {
        reporter.finish();
    }
    drop(reporter);
    let records = s.store.read()?;
    if let Some(why) = status::target_reached(&records, sweep.metric, sweep.target) {
        tracing::info!("sweep stopped early: {why}");
    }
    let trials = sweeper::known(&sweep, &records, (0, 1));
    print!(
        "{}",
        table::render(&trials, &records, &|t| open_state(&out, t), sweep.metric, sweep.count)
    );
    match stopped {
        Some(sig) => Err(oomguard_console::ExitCode(128 + sig).into()),
        None => Ok(()),
    }
}

/// Running or pending, from the trial lock's entry in /proc/locks: `--status` takes no lock.
fn open_state(out: &Path, t: &Trial) -> table::Open {
    if TrialLock::held(&out.join("trials").join(&t.id)) {
        table::Open::Running
    } else {
        table::Open::Pending
    }
}

/// What every trial of `sweep` runs, as a hash: its base config's text (or the launch
/// command's words), the part of a trial its id does not name.
fn runner_hash(sweep: &spec::Sweep) -> String {
    let text = match &sweep.runner {
        spec::Runner::Train { base } => {
            format!(
                "train\n{}",
                std::fs::read_to_string(base).unwrap_or_else(|_| base.display().to_string())
            )
        }
        spec::Runner::Launch { words, .. } => format!("launch\n{}", words.join("\n")),
    };
    format!("{:08x}", spec::fnv1a(&text))
}

/// `out/sweep.runs` names what its trials run (`runner_hash`): written by the first sweep
/// there, refused (exit 2) when another runs something else into it. A directory from before
/// the file takes it.
fn same_runner(sweep: &spec::Sweep, out: &Path) -> anyhow::Result<()> {
    let file = out.join("sweep.runs");
    let now = runner_hash(sweep);
    match std::fs::read_to_string(&file) {
        Ok(was) if was.trim() != now => Err(ConfigError {
            origin: sweep.path.display().to_string(),
            line_col: None,
            key: "base".into(),
            message: format!(
                "{} holds the trials of a sweep whose base config (or command) differs from this one's: a trial's id \
                 names its parameters only, so their results would mix. Give another --out; or, to go on there with \
                 this base (its finished trials kept as they are), remove {}",
                out.display(),
                file.display()
            ),
        }
        .into()),
        Ok(_) => Ok(()),
        Err(_) => oomguard_report::atomic::write(&file, format!("{now}\n").as_bytes())
            .with_context(|| format!("writing {}", file.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn shards_from_flags_slurm_and_kubernetes() {
        assert_eq!(shard(None, None, &env(&[])).unwrap(), (0, 1));
        assert_eq!(
            shard(Some("1/4"), None, &env(&[("SLURM_ARRAY_TASK_ID", "3")])).unwrap(),
            (1, 4)
        );
        assert!(shard(Some("4/4"), None, &env(&[])).is_err());
        assert!(shard(Some("x"), None, &env(&[])).is_err());
        let slurm = [
            ("SLURM_ARRAY_TASK_ID", "3"),
            ("SLURM_ARRAY_TASK_COUNT", "4"),
            ("SLURM_ARRAY_TASK_MIN", "1"),
        ];
        assert_eq!(shard(None, None, &env(&slurm)).unwrap(), (2, 4));
        assert_eq!(
            shard(None, Some(3), &env(&[("JOB_COMPLETION_INDEX", "2")])).unwrap(),
            (2, 3)
        );
        assert!(shard(None, None, &env(&[("JOB_COMPLETION_INDEX", "2")])).is_err());
        assert!(shard(None, Some(2), &env(&[("JOB_COMPLETION_INDEX", "2")])).is_err());
    }
}
