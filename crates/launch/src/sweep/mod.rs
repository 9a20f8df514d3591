//! `oomguard sweep SWEEP.yaml [--parallel N] [--shard I/N] [--status]`: one guarded
//! `oomguard train` child per trial, so no trial can take the sweep down; results.jsonl holds
//! one record per trial; a sweep killed at any moment (kill -9 too) starts again where it
//! was: finished trials skipped, unfinished ones resumed from their checkpoints.
mod spec;
mod status;
mod store;
mod table;
mod trial;

pub use spec::{load, Metric, Sweep, Trial};
pub use store::{Record, Status, Store};

use anyhow::Context;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant, SystemTime};

use crate::host::{HostMemory, Threads};
use crate::proc::{signal_group, Signals};
use crate::units::human_bytes;
use crate::ConfigError;
use store::TrialLock;
use trial::{Launch, Stop};

/// `oomguard sweep`
#[derive(Debug, clap::Args)]
pub struct SweepArgs {
    /// The sweep file: a base config and the parameters to vary (see configs/demo-sweep.yaml).
    pub sweep: PathBuf,
    /// The sweep directory: results.jsonl, sweep.log and trials/ID/ (each trial's run
    /// directory) [default: runs/<sweep file name>].
    #[arg(long)]
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
    /// Print the table of trials (finished, running, pending) and exit.
    #[arg(long)]
    pub status: bool,
}

/// Which share of the trials this process runs: `(index, count)`. A pure function of the
/// flags and the environment.
pub fn shard(flag: Option<&str>, shards: Option<usize>, env: &dyn Fn(&str) -> Option<String>) -> Result<(usize, usize), ConfigError> {
    let bad = |key: &str, m: String| ConfigError { origin: key.into(), line_col: None, key: String::new(), message: m };
    if let Some(text) = flag {
        let parsed = text.split_once('/').and_then(|(i, n)| Some((i.trim().parse::<usize>().ok()?, n.trim().parse::<usize>().ok()?)));
        return match parsed {
            Some((i, n)) if n > 0 && i < n => Ok((i, n)),
            _ => Err(bad("--shard", format!("`{text}` is not I/N with 0 <= I < N, e.g. 0/4"))),
        };
    }
    let num = |var: &str| -> Result<Option<usize>, ConfigError> {
        env(var).map(|v| v.trim().parse().map_err(|_| bad(var, format!("`{v}` is not a number")))).transpose()
    };
    if let (Some(id), Some(count)) = (num("SLURM_ARRAY_TASK_ID")?, num("SLURM_ARRAY_TASK_COUNT")?) {
        // Arrays may start anywhere (--array=1-4): the index counts from the first task.
        let i = id.saturating_sub(num("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0));
        return if i < count && count > 0 { Ok((i, count)) } else { Err(bad("SLURM_ARRAY_TASK_ID", format!("{id} is outside the array's {count} tasks"))) };
    }
    if let Some(i) = num("JOB_COMPLETION_INDEX")? {
        return match shards {
            Some(n) if i < n => Ok((i, n)),
            Some(n) => Err(bad("--shards", format!("is {n} but JOB_COMPLETION_INDEX is {i}; give the Job's completions"))),
            None => Err(bad("--shards", "is required with JOB_COMPLETION_INDEX: give the indexed Job's completions, e.g. --shards 4".into())),
        };
    }
    Ok((0, 1))
}

/// The GPUs a slot can take: CUDA_VISIBLE_DEVICES's list, else every GPU the driver shows.
fn visible_gpus() -> Vec<String> {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect(),
        Err(_) => (0..crate::launch::num_gpus()).map(|i| i.to_string()).collect(),
    }
}

struct Running<'a> {
    trial: &'a Trial,
    slot: usize,
    child: Child,
    started: Instant,
    stopping: Option<(Stop, Instant)>,
    _lock: TrialLock,
}

/// The sweep in progress: its settings and where results go.
struct Sweeper<'a> {
    sweep: &'a Sweep,
    out: PathBuf,
    exe: PathBuf,
    store: Store,
    shard: String,
    threads: Option<usize>,
    /// Each trial's share of the host's memory (several slots).
    memory_share: Vec<(String, String)>,
    gpus: Vec<String>,
    /// Seconds trials already ran before this start (an interrupted record's).
    before: std::collections::BTreeMap<String, f64>,
}

pub fn run(args: SweepArgs) -> anyhow::Result<()> {
    let sweep = spec::load(&args.sweep)?;
    let stem = args.sweep.file_stem().map_or("sweep".into(), |s| s.to_string_lossy().into_owned());
    let out = args.out.clone().unwrap_or_else(|| Path::new("runs").join(stem));
    let (index, count) = shard(args.shard.as_deref(), args.shards, &|v| std::env::var(v).ok())?;
    let store = Store::new(&out);
    let records = store.read().with_context(|| format!("reading {}", store.path().display()))?;
    if args.status {
        print!("{}", table::render(&sweep.trials, &records, &|t| open_state(&out, t), sweep.metric));
        return Ok(());
    }
    if args.parallel == 0 {
        return Err(ConfigError { origin: "--parallel".into(), line_col: None, key: String::new(), message: "is 0; give at least 1".into() }.into());
    }
    let gpus = visible_gpus();
    if !gpus.is_empty() && args.parallel > gpus.len() {
        let m = format!("is {} but {} GPUs are visible: each slot takes one GPU", args.parallel, gpus.len());
        return Err(ConfigError { origin: "--parallel".into(), line_col: None, key: String::new(), message: m }.into());
    }
    std::fs::create_dir_all(out.join("trials")).with_context(|| format!("creating {}", out.display()))?;
    crate::logfile::set_log_file(&out.join("sweep.log"))?;
    let spec_text = std::fs::read(&args.sweep).with_context(|| format!("reading {}", args.sweep.display()))?;
    oomguard_report::atomic::write(&out.join("sweep.yaml"), &spec_text).with_context(|| format!("copying {} into {}", args.sweep.display(), out.display()))?;
    // Slots share this host: each gets its part of the CPU threads and of the memory.
    let host_threads = Threads::of_self();
    let host_memory = (args.parallel > 1).then(HostMemory::of_self).flatten();
    let exe = std::env::current_exe().context("locating this executable")?.with_file_name("oomguard");
    let before = records.iter().filter(|(_, r)| !r.status.is_final()).map(|(k, r)| (k.clone(), r.duration_s)).collect();
    let s = Sweeper {
        sweep: &sweep, out: out.clone(), exe, store, shard: format!("{index}/{count}"),
        threads: (args.parallel > 1).then(|| host_threads.share(args.parallel)),
        memory_share: host_memory.as_ref().map(|m| m.share_env(args.parallel).to_vec()).unwrap_or_default(), gpus, before,
    };
    let todo: Vec<&Trial> = sweep.trials.iter().filter(|t| t.index % count == index && !records.get(&t.id).is_some_and(|r| r.status.is_final())).collect();
    tracing::info!(
        "sweep {}: {} trials, {} to run in shard {}, {} at a time, into {}",
        sweep.path.display(), sweep.trials.len(), todo.len(), s.shard, args.parallel, out.display()
    );
    if let Some(n) = s.threads {
        tracing::info!("each trial gets {n} CPU thread{} (this host gives {host_threads})", if n == 1 { "" } else { "s" });
    }
    if let Some(m) = &host_memory {
        tracing::info!("host memory: {}; each of the {} slots gets {}", m.describe(), args.parallel, human_bytes(m.share(args.parallel).0));
    }
    // Every trial's config is checked before the first one runs: a typo fails in seconds.
    for t in &todo {
        if let Err(why) = s.launch(t, None).check().context("running oomguard train --check")? {
            let message = format!("trial {} ({}) is not a valid config: {why}", t.id, t.describe());
            return Err(ConfigError { origin: sweep.path.display().to_string(), line_col: None, key: "parameters".into(), message }.into());
        }
    }
    let signals = Signals::install().context("installing signal handlers")?;
    let mine: Vec<&Trial> = sweep.trials.iter().filter(|t| t.index % count == index).collect();
    let mut reporter = status::Reporter::new(mine, args.parallel, sweep.metric);
    let stopped = s.schedule(todo, args.parallel, &signals, &mut reporter)?;
    if stopped.is_none() {
        reporter.finish();
    }
    drop(reporter);
    let records = s.store.read()?;
    print!("{}", table::render(&sweep.trials, &records, &|t| open_state(&out, t), sweep.metric));
    match stopped {
        Some(sig) => Err(crate::cli::ExitCode(128 + sig).into()),
        None => Ok(()),
    }
}

fn open_state(out: &Path, t: &Trial) -> table::Open {
    match TrialLock::try_take(&out.join("trials").join(&t.id)) {
        Ok(None) => table::Open::Running,
        _ => table::Open::Pending,
    }
}

impl<'a> Sweeper<'a> {
    fn launch(&self, t: &'a Trial, slot: Option<usize>) -> Launch<'_> {
        Launch {
            exe: &self.exe, base: &self.sweep.base, trial: t, run_dir: self.run_dir(t),
            threads: self.threads, env: &self.memory_share, gpu: slot.and_then(|s| self.gpus.get(s).cloned()),
        }
    }

    fn run_dir(&self, t: &Trial) -> PathBuf {
        self.out.join("trials").join(&t.id)
    }

    /// Runs `todo` in `parallel` slots until done or a signal; returns the signal.
    fn schedule(&self, todo: Vec<&'a Trial>, parallel: usize, signals: &Signals, reporter: &mut status::Reporter) -> anyhow::Result<Option<i32>> {
        let mut queue: std::collections::VecDeque<&Trial> = todo.into();
        let mut running: Vec<Running> = vec![];
        self.report(reporter, &running, false);
        loop {
            if let Some(sig) = signals.received() {
                self.stop_all(&mut running, signals)?;
                tracing::warn!("received signal {sig}: trials stopped with checkpoints; run the same command to resume");
                return Ok(Some(sig));
            }
            let mut i = 0;
            while i < running.len() {
                let done = running[i].child.try_wait()?;
                match done {
                    Some(status) => {
                        let r = running.swap_remove(i);
                        self.finish(r, exit_code(status))?;
                        self.report(reporter, &running, true);
                    }
                    None => {
                        self.enforce_timeout(&mut running[i]);
                        i += 1;
                    }
                }
            }
            while running.len() < parallel {
                let Some(t) = queue.pop_front() else { break };
                let slot = (0..parallel).find(|s| running.iter().all(|r| r.slot != *s)).unwrap_or(0);
                match self.start(t, slot)? {
                    Some(r) => {
                        running.push(r);
                        self.report(reporter, &running, false);
                    }
                    None => self.report(reporter, &running, true), // recorded without running (the planner), or run elsewhere
                }
            }
            if reporter.due() {
                self.report(reporter, &running, false);
            }
            if running.is_empty() && queue.is_empty() {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts a trial (None: it is running elsewhere, or the planner or a failed start
    /// already recorded it).
    fn start(&self, t: &'a Trial, slot: usize) -> anyhow::Result<Option<Running<'a>>> {
        let dir = self.run_dir(t);
        let Some(lock) = TrialLock::try_take(&dir)? else {
            tracing::warn!("[{}] is being run by another sweep process: skipped", t.id);
            return Ok(None);
        };
        let launch = self.launch(t, Some(slot));
        let fresh = !dir.join("checkpoints").is_dir();
        if self.sweep.planner && fresh {
            if let Some(why) = launch.planner_says_infeasible(self.sweep.device_memory.as_deref())? {
                tracing::warn!("[{}] infeasible, says the planner: {why}", t.id);
                self.put(t, Status::Infeasible, Some("planner"), Some(3), 0.0, Some(why))?;
                return Ok(None);
            }
        }
        tracing::info!("[{}] {} {}", t.id, if fresh { "start" } else { "resume" }, t.describe());
        match launch.spawn() {
            Ok(child) => Ok(Some(Running { trial: t, slot, child, started: Instant::now(), stopping: None, _lock: lock })),
            Err(e) => {
                self.put(t, Status::Failed, None, None, 0.0, Some(format!("cannot start {}: {e}", self.exe.display())))?;
                Ok(None)
            }
        }
    }

    /// The sweep's status line (`finished`: a trial just got its record). A status that
    /// cannot be read is left out: it never stops the sweep.
    fn report(&self, reporter: &mut status::Reporter, running: &[Running], finished: bool) {
        match self.store.read() {
            Ok(records) => {
                let ran: Vec<f64> = running.iter().map(|r| r.started.elapsed().as_secs_f64() + self.before.get(&r.trial.id).copied().unwrap_or(0.0)).collect();
                reporter.report(&records, &ran, finished);
            }
            Err(e) => tracing::warn!("status: cannot read {}: {e}", self.store.path().display()),
        }
    }

    fn enforce_timeout(&self, r: &mut Running) {
        match (self.sweep.timeout, r.stopping) {
            (Some(limit), None) if r.started.elapsed() > limit => {
                tracing::warn!("[{}] ran past trial.timeout ({}): stopping it", r.trial.id, humantime::format_duration(limit));
                signal_group(&r.child, libc::SIGTERM);
                r.stopping = Some((Stop::Timeout, Instant::now()));
            }
            (_, Some((_, since))) if since.elapsed() > self.sweep.grace => signal_group(&r.child, libc::SIGKILL),
            _ => {}
        }
    }

    /// SIGTERM to every trial (each checkpoints), SIGKILL after the grace or a second signal.
    fn stop_all(&self, running: &mut Vec<Running<'a>>, signals: &Signals) -> anyhow::Result<()> {
        for r in running.iter_mut() {
            signal_group(&r.child, libc::SIGTERM);
            r.stopping = Some((Stop::Sweep, Instant::now()));
        }
        let seen = signals.count.load(std::sync::atomic::Ordering::SeqCst);
        let t = Instant::now();
        while !running.is_empty() {
            if t.elapsed() > self.sweep.grace || signals.count.load(std::sync::atomic::Ordering::SeqCst) != seen {
                running.iter().for_each(|r| signal_group(&r.child, libc::SIGKILL));
            }
            let mut i = 0;
            while i < running.len() {
                match running[i].child.try_wait()? {
                    Some(status) => {
                        let r = running.swap_remove(i);
                        self.finish(r, exit_code(status))?;
                    }
                    None => i += 1,
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn finish(&self, r: Running, code: i32) -> anyhow::Result<()> {
        // Nothing of the trial's group may outlive it.
        signal_group(&r.child, libc::SIGKILL);
        let status = trial::status_of(code, r.stopping.map(|s| s.0));
        let message = match status {
            Status::Ok | Status::Interrupted => None,
            Status::Timeout => Some(format!("stopped after trial.timeout {}", self.sweep.timeout.map(|d| humantime::format_duration(d).to_string()).unwrap_or_default())),
            _ => Some(trial::last_error_line(&std::fs::read_to_string(self.launch(r.trial, None).log_path()).unwrap_or_default())),
        };
        let told_by = (status == Status::Infeasible).then_some("run");
        let record = self.put(r.trial, status, told_by, Some(code), r.started.elapsed().as_secs_f64(), message)?;
        tracing::info!(
            "[{}] {} (exit {code}) in {:.0}s: best eval {}, {} tok/s, micro-batch {}, {} OOMs",
            r.trial.id, status.name(), record.duration_s, record.summary.best_eval_loss.map_or("-".into(), |l| format!("{l:.4}")),
            record.summary.tokens_per_s.map_or("-".into(), |t| format!("{t:.0}")), record.summary.final_micro_batch_size.map_or("-".into(), |m| m.to_string()), record.summary.ooms
        );
        Ok(())
    }

    fn put(&self, t: &Trial, status: Status, told_by: Option<&str>, exit_code: Option<i32>, secs: f64, message: Option<String>) -> anyhow::Result<Record> {
        let dir = self.run_dir(t);
        let record = Record {
            trial: t.id.clone(), index: t.index, params: t.params.clone(), status, told_by: told_by.map(String::from), exit_code,
            summary: trial::summarize(&dir),
            duration_s: secs + self.before.get(&t.id).copied().unwrap_or(0.0),
            run_dir: dir.strip_prefix(&self.out).unwrap_or(&dir).display().to_string(), message, shard: self.shard.clone(),
            finished_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        };
        self.store.put(&record).with_context(|| format!("writing {}", self.store.path().display()))?;
        Ok(record)
    }
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
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
        assert_eq!(shard(Some("1/4"), None, &env(&[("SLURM_ARRAY_TASK_ID", "3")])).unwrap(), (1, 4));
        assert!(shard(Some("4/4"), None, &env(&[])).is_err());
        assert!(shard(Some("x"), None, &env(&[])).is_err());
        let slurm = [("SLURM_ARRAY_TASK_ID", "3"), ("SLURM_ARRAY_TASK_COUNT", "4"), ("SLURM_ARRAY_TASK_MIN", "1")];
        assert_eq!(shard(None, None, &env(&slurm)).unwrap(), (2, 4));
        assert_eq!(shard(None, Some(3), &env(&[("JOB_COMPLETION_INDEX", "2")])).unwrap(), (2, 3));
        assert!(shard(None, None, &env(&[("JOB_COMPLETION_INDEX", "2")])).is_err());
        assert!(shard(None, Some(2), &env(&[("JOB_COMPLETION_INDEX", "2")])).is_err());
    }
}
