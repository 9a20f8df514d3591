//! Owns the sweep in progress: which trial or segment runs next, starting, watching, stopping
//! and recording it.
//! Keeps: a trial is started exactly once (its lock taken, then its record read again).
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant, SystemTime};

use super::asha;
use super::spec::{self, Metric, Sweep, Trial};
use super::status;
use super::store::{Store, TrialLock};
use super::tpe::{self, Observation, Outcome};
use super::trial::{self, Launch, Stop};
use crate::record::{Decision, Record, Rung, Status};
use oomguard_host::proc::{signal_group, Signals};

/// This shard's trials known so far: every one of a grid or random sweep; for model-based
/// search, those proposed (their parameters are in their records).
pub fn known(sweep: &Sweep, records: &BTreeMap<String, Record>, (index, count): (usize, usize)) -> Vec<Trial> {
    if !sweep.model_based() {
        return sweep
            .trials
            .iter()
            .filter(|t| t.index % count == index)
            .cloned()
            .collect();
    }
    let mut t: Vec<Trial> = records
        .values()
        .filter(|r| r.index % count == index)
        .map(|r| Trial {
            index: r.index,
            id: r.trial.clone(),
            params: r.params.clone(),
        })
        .collect();
    t.sort_by_key(|t| t.index);
    t
}

/// This shard's trials in all.
pub fn total(sweep: &Sweep, (index, count): (usize, usize)) -> usize {
    (0..sweep.count).filter(|i| i % count == index).count()
}

pub struct Running {
    trial: Trial,
    slot: usize,
    child: Child,
    started: Instant,
    /// When it started, by the wall clock (the files it wrote are those modified since).
    started_at: std::time::SystemTime,
    stopping: Option<(Stop, Instant)>,
    /// Early stopping: the rung this segment ends at.
    target: Option<u64>,
    _lock: TrialLock,
}

/// What became of a trial the scheduler tried to start.
enum Started {
    Running(Running),
    /// Recorded without running (the planner, a failed start), or already done elsewhere.
    Settled,
    /// Another sweep process holds its lock (its id): asked again later, it may not finish it.
    Held(String),
}

/// How a trial ended, for its record.
struct Ending {
    status: Status,
    told_by: Option<&'static str>,
    exit_code: Option<i32>,
    message: Option<String>,
    /// Early stopping: the rungs after this segment (None: as they were).
    rungs: Option<Vec<Rung>>,
}

impl Ending {
    fn of(status: Status, exit_code: Option<i32>, message: Option<String>) -> Ending {
        Ending {
            status,
            told_by: None,
            exit_code,
            message,
            rungs: None,
        }
    }
}

pub struct Sweeper<'a> {
    pub sweep: &'a Sweep,
    pub out: PathBuf,
    pub exe: PathBuf,
    pub store: Store,
    pub shard: (usize, usize),
    pub threads: Option<usize>,
    /// Each trial's environment: its share of the host's memory (several slots), W&B's
    /// project and entity.
    pub env: Vec<(String, String)>,
    pub gpus: Vec<String>,
    /// Seconds trials already ran before this start (an unfinished record's).
    pub before: BTreeMap<String, f64>,
    /// What script trials wrote in the working directory they share.
    pub shared: crate::shared_files::SharedFiles,
}

impl<'a> Sweeper<'a> {
    pub fn launch<'t>(&'t self, t: &'t Trial, slot: Option<usize>) -> Launch<'t> {
        Launch {
            exe: &self.exe,
            runner: &self.sweep.runner,
            trial: t,
            run_dir: self.run_dir(t),
            threads: self.threads,
            env: &self.env,
            gpu: slot.and_then(|s| self.gpus.get(s).cloned()),
            extra: vec![],
        }
    }

    fn run_dir(&self, t: &Trial) -> PathBuf {
        self.out.join("trials").join(&t.id)
    }

    /// Runs trials in `parallel` slots until none is left or a signal; returns the signal.
    /// A failure of the sweep's own (results.jsonl unwritable, a fork refused) stops the
    /// running trials as a signal would, with their checkpoints, before it is returned.
    pub fn schedule(
        &self,
        parallel: usize,
        signals: &Signals,
        reporter: &mut status::Reporter,
    ) -> anyhow::Result<Option<i32>> {
        let mut running: Vec<Running> = vec![];
        let out = self.schedule_into(parallel, signals, reporter, &mut running);
        if out.is_err() && !running.is_empty() {
            tracing::error!(
                "the sweep failed: stopping its {} running trials, which save checkpoints first",
                running.len()
            );
            self.stop_after_error(&mut running);
        }
        out
    }

    /// `schedule`, with the running trials in `running`.
    fn schedule_into(
        &self,
        parallel: usize,
        signals: &Signals,
        reporter: &mut status::Reporter,
        running: &mut Vec<Running>,
    ) -> anyhow::Result<Option<i32>> {
        let mut waiting = BTreeSet::new();
        // W&B's metric.target: once reached, said once; nothing new starts.
        let mut target_said = false;
        self.report(reporter, running, false);
        loop {
            if let Some(sig) = signals.received() {
                self.stop_all(running, signals)?;
                tracing::warn!(
                    "received signal {sig}: trials stopped with checkpoints; run the same command to resume"
                );
                return Ok(Some(sig));
            }
            if self.reap(running)? > 0 {
                self.report(reporter, running, true);
            }
            running.iter_mut().for_each(|r| self.enforce_timeout(r));
            // Held by another process this round: asked again after a pause, not dropped.
            let mut held = BTreeSet::new();
            // A signal ends the filling at once; the loop above stops what runs.
            while running.len() < parallel && signals.received().is_none() {
                let busy: BTreeSet<String> = running
                    .iter()
                    .map(|r| r.trial.id.clone())
                    .chain(held.iter().cloned())
                    .collect();
                let records = self.store.read()?;
                // Past the target only an interrupted trial starts again: it was running.
                let reached = status::target_reached(&records, self.sweep.metric, self.sweep.target);
                if let Some(why) = &reached {
                    if !target_said {
                        tracing::info!("{why} ({} running)", running.len());
                        target_said = true;
                    }
                }
                let job = self.next_job(&records, &busy, reached.is_some());
                let Some((t, target)) = job else {
                    break;
                };
                let slot = (0..parallel)
                    .find(|s| running.iter().all(|r| r.slot != *s))
                    .unwrap_or(0);
                match self.start(t, target, slot)? {
                    Started::Running(r) => {
                        running.push(r);
                        self.report(reporter, running, false);
                    }
                    Started::Settled => self.report(reporter, running, true),
                    Started::Held(id) => {
                        if waiting.insert(id.clone()) {
                            tracing::info!("[{id}] is being run by another sweep process: requeued");
                        }
                        held.insert(id);
                    }
                }
            }
            if reporter.due() {
                self.report(reporter, running, false);
            }
            // Nothing running, nothing held elsewhere, and no job left to start: done.
            if running.is_empty() && held.is_empty() {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The next trial to run (and, with early stopping, the rung its segment ends at): a
    /// pure function of the records, so a restart picks what was running. None: nothing left.
    /// `only_resume` (past `metric.target`): an interrupted one only.
    fn next_job(
        &self,
        records: &BTreeMap<String, Record>,
        busy: &BTreeSet<String>,
        only_resume: bool,
    ) -> Option<(Trial, Option<u64>)> {
        let resumes = |t: &Trial| !only_resume || records.get(&t.id).is_some_and(|r| r.status == Status::Interrupted);
        let mut mine = known(self.sweep, records, self.shard);
        if self.sweep.model_based() && !only_resume {
            let (index, count) = self.shard;
            if let Some(i) = (0..self.sweep.count)
                .filter(|i| i % count == index)
                .find(|i| !mine.iter().any(|t| t.index == *i))
            {
                mine.push(self.propose(i, records));
            }
        }
        let refs: Vec<&Trial> = mine.iter().collect();
        match &self.sweep.early_stop {
            Some(es) => {
                // Past the target, ASHA's picks that are not interrupted are passed over.
                let mut passed = busy.clone();
                loop {
                    // A rung's value is a loss (`es.metric`), lower better, whatever the sweep ranks by.
                    let job = asha::next(es, &refs, records, &passed, false)?;
                    let t = mine.iter().find(|t| t.index == job.index)?;
                    if resumes(t) {
                        return Some((t.clone(), Some(job.target)));
                    }
                    if !passed.insert(t.id.clone()) {
                        return None;
                    }
                }
            }
            None => mine
                .into_iter()
                .find(|t| {
                    !busy.contains(&t.id) && !records.get(&t.id).is_some_and(|r| r.status.is_final()) && resumes(t)
                })
                .map(|t| (t, None)),
        }
    }

    /// Model-based search's proposal for trial `index`, from every finished trial's result.
    fn propose(&self, index: usize, records: &BTreeMap<String, Record>) -> Trial {
        let sweep = self.sweep;
        let mut done: Vec<&Record> = records
            .values()
            .filter(|r| r.status.is_final() && r.status != Status::Interrupted)
            .collect();
        done.sort_by_key(|r| r.index);
        let observations: Vec<Observation> = done
            .iter()
            .map(|r| {
                let value = super::table::value(r, sweep.metric).filter(|v| v.is_finite());
                let outcome = match (r.status, value) {
                    (Status::Ok | Status::StoppedEarly | Status::Timeout, Some(v)) => {
                        Outcome::Value(if sweep.metric.maximize() { -v } else { v })
                    }
                    _ => Outcome::Bad,
                };
                Observation {
                    at: sweep
                        .domains
                        .iter()
                        .map(|(k, d)| r.params.get(k).and_then(|v| d.cdf(v)))
                        .collect(),
                    outcome,
                }
            })
            .collect();
        spec::trial_of(
            index,
            tpe::propose(&sweep.domains, &observations, sweep.seed, index, sweep.count),
        )
    }

    /// Starts a trial unless another process holds it or has done it: its record is read
    /// again once its lock is held, so two sweeps on one directory run it once.
    fn start(&self, t: Trial, target: Option<u64>, slot: usize) -> anyhow::Result<Started> {
        let dir = self.run_dir(&t);
        let Some(lock) = TrialLock::try_take(&dir)? else {
            return Ok(Started::Held(t.id));
        };
        let record = self.store.read()?.remove(&t.id);
        let due = match (&self.sweep.early_stop, &record) {
            (_, None) => true,
            (None, Some(r)) => !r.status.is_final(),
            (Some(_), Some(r)) => {
                target.is_some_and(|s| r.rungs.last().is_none_or(|g| g.step < s))
                    && matches!(
                        r.status,
                        Status::StoppedEarly | Status::Promoted | Status::Interrupted | Status::Proposed
                    )
            }
        };
        if !due {
            tracing::info!("[{}] was done by another sweep process: skipped", t.id);
            return Ok(Started::Settled);
        }
        if self.sweep.model_based() && record.is_none() {
            // Kept before it runs: a restart runs these parameters, not a new proposal.
            self.put(&t, Ending::of(Status::Proposed, None, None), 0.0)?;
        }
        let mut launch = self.launch(&t, Some(slot));
        if let (Some(es), Some(step)) = (&self.sweep.early_stop, target) {
            // A segment to the rung, on the learning-rate schedule of the whole run.
            launch.extra = vec!["--set".into(), format!("train.max_steps={step}")];
            if !self.sweep.decay_steps_set {
                launch
                    .extra
                    .extend(["--set".into(), format!("optim.decay_steps={}", es.max_steps)]);
            }
        }
        let fresh = !dir.join("checkpoints").is_dir();
        if self.sweep.planner && fresh {
            if let Some(why) = launch.planner_says_infeasible(self.sweep.device_memory.as_deref())? {
                tracing::warn!("[{}] infeasible, says the planner: {why}", t.id);
                self.put(
                    &t,
                    Ending {
                        told_by: Some("planner"),
                        ..Ending::of(Status::Infeasible, Some(3), Some(why))
                    },
                    0.0,
                )?;
                return Ok(Started::Settled);
            }
        }
        let segment = target.map(|s| format!(" to step {s}")).unwrap_or_default();
        tracing::info!(
            "[{}] {}{segment} {}",
            t.id,
            if fresh { "start" } else { "resume" },
            t.describe()
        );
        match launch.spawn() {
            Ok(child) => Ok(Started::Running(Running {
                trial: t,
                slot,
                child,
                started: Instant::now(),
                started_at: std::time::SystemTime::now(),
                stopping: None,
                target,
                _lock: lock,
            })),
            Err(e) => {
                let why = format!("cannot start {}: {e}", self.exe.display());
                self.put(&t, Ending::of(Status::Failed, None, Some(why)), 0.0)?;
                Ok(Started::Settled)
            }
        }
    }

    /// The sweep's status line (`finished`: a trial just got its record). A status that
    /// cannot be read is left out: it never stops the sweep.
    fn report(&self, reporter: &mut status::Reporter, running: &[Running], finished: bool) {
        match self.store.read() {
            Ok(records) => {
                let ran: Vec<f64> = running
                    .iter()
                    .map(|r| r.started.elapsed().as_secs_f64() + self.before.get(&r.trial.id).copied().unwrap_or(0.0))
                    .collect();
                let mine = known(self.sweep, &records, self.shard);
                reporter.report(&mine, &records, &ran, finished);
            }
            Err(e) => tracing::warn!("status: cannot read {}: {e}", self.store.path().display()),
        }
    }

    /// Records the trials that have exited; returns how many.
    fn reap(&self, running: &mut Vec<Running>) -> anyhow::Result<usize> {
        let mut done = 0;
        let mut i = 0;
        while i < running.len() {
            match running[i].child.try_wait()? {
                Some(status) => {
                    let r = running.swap_remove(i);
                    self.finish(r, exit_code(status))?;
                    done += 1;
                }
                None => i += 1,
            }
        }
        Ok(done)
    }

    fn enforce_timeout(&self, r: &mut Running) {
        match (self.sweep.timeout, r.stopping) {
            (Some(limit), None) if r.started.elapsed() > limit => {
                tracing::warn!(
                    "[{}] ran past trial.timeout ({}): stopping it",
                    r.trial.id,
                    humantime::format_duration(limit)
                );
                signal_group(&r.child, libc::SIGTERM);
                r.stopping = Some((Stop::Timeout, Instant::now()));
            }
            (_, Some((_, since))) if since.elapsed() > self.sweep.grace => signal_group(&r.child, libc::SIGKILL),
            _ => {}
        }
    }

    /// After the sweep's own failure: each trial is asked to stop (SIGTERM: it checkpoints),
    /// given the grace period, then killed; their records as far as they can be written.
    fn stop_after_error(&self, running: &mut Vec<Running>) {
        for r in running.iter_mut() {
            signal_group(&r.child, libc::SIGTERM);
            r.stopping = Some((Stop::Sweep, Instant::now()));
        }
        let t = Instant::now();
        while running.iter_mut().any(|r| matches!(r.child.try_wait(), Ok(None))) && t.elapsed() < self.sweep.grace {
            std::thread::sleep(Duration::from_millis(50));
        }
        running.iter().for_each(|r| signal_group(&r.child, libc::SIGKILL));
        if let Err(e) = self.reap(running) {
            tracing::warn!("the stopped trials' records could not be written either ({e:#}): a rerun resumes them");
        }
    }

    /// SIGTERM to every trial (each checkpoints), SIGKILL after the grace or a second signal.
    fn stop_all(&self, running: &mut Vec<Running>, signals: &Signals) -> anyhow::Result<()> {
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
            self.reap(running)?;
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
            Status::Timeout => Some(format!(
                "stopped after trial.timeout {}",
                self.sweep
                    .timeout
                    .map(|d| humantime::format_duration(d).to_string())
                    .unwrap_or_default()
            )),
            _ => Some(trial::failure_line(
                &std::fs::read_to_string(self.launch(&r.trial, None).log_path()).unwrap_or_default(),
            )),
        };
        let mut ending = Ending {
            told_by: (status == Status::Infeasible).then_some("run"),
            ..Ending::of(status, Some(code), message)
        };
        if let (Some(es), Some(step), Status::Ok) = (&self.sweep.early_stop, r.target, status) {
            // The segment reached its rung: decide, from the values reported there so far.
            let records = self.store.read()?;
            let metrics = std::fs::read_to_string(self.run_dir(&r.trial).join("metrics.jsonl")).unwrap_or_default();
            let value = asha::value_at(&metrics, step, es.metric);
            let decision = asha::decide(
                es,
                step,
                value,
                &asha::reported_at(records.values(), step, &r.trial.id),
                false, // a loss at every rung (`es.metric`), whatever the sweep ranks by
            );
            let previous = records.get(&r.trial.id).map(|p| p.rungs.clone()).unwrap_or_default();
            ending.rungs = Some(asha::after_segment(&previous, step, value, decision));
            ending.status = match decision {
                Decision::Continue => Status::Promoted,
                Decision::Stop => Status::StoppedEarly,
                Decision::Done | Decision::Promoted => Status::Ok,
            };
            tracing::info!(
                "[{}] step {step}: {} {}: {}",
                r.trial.id,
                es.metric_name(),
                value.map_or("-".into(), |v| format!("{v:.4}")),
                match decision {
                    Decision::Continue => "in the top 1/eta: goes on",
                    Decision::Stop => "below the top 1/eta: stopped early (it may be promoted later)",
                    _ => "done",
                }
            );
        }
        if matches!(self.sweep.runner, crate::command::Runner::Launch { .. }) {
            for warning in self.shared.after(&r.trial.id, r.started_at) {
                tracing::warn!("{warning}");
            }
        }
        let record = self.put(&r.trial, ending, r.started.elapsed().as_secs_f64())?;
        let metric = self.sweep.metric;
        if record.status == Status::Ok && crate::table::value(&record, metric).is_none() {
            let how = match metric {
                Metric::TokensPerS => {
                    "a script's guard records tokens/s when given the sample's length: \
                     oomguard.Guard(model, ..., tokens_per_sample=N)"
                }
                Metric::FinalLoss => "its step records carry no loss",
                Metric::BestEvalLoss | Metric::FinalEvalLoss => {
                    "a script logs an evaluation with guard.log_eval(val_loss); \
                     oomguard.hf.Trainer and oomguard.lightning log theirs when they evaluate"
                }
            };
            tracing::warn!(
                "[{}] finished without the sweep's metric {}: its {}/metrics.jsonl has no such value, so it cannot be \
                 ranked ({how})",
                r.trial.id,
                metric.name(),
                record.run_dir
            );
        }
        tracing::info!(
            "[{}] {} (exit {code}) in {:.0}s: best eval {}, {} tok/s, micro-batch {}, {} OOMs",
            r.trial.id,
            record.status.name(),
            record.duration_s,
            record.summary.best_eval_loss.map_or("-".into(), |l| format!("{l:.4}")),
            record.summary.tokens_per_s.map_or("-".into(), |t| format!("{t:.0}")),
            record
                .summary
                .final_micro_batch_size
                .map_or("-".into(), |m| m.to_string()),
            record.summary.ooms
        );
        Ok(())
    }

    /// Writes the trial's record: its run directory's summary, its time over every start
    /// (an earlier record's added) and its rungs (kept unless this ending brings new ones).
    fn put(&self, t: &Trial, e: Ending, secs: f64) -> anyhow::Result<Record> {
        let dir = self.run_dir(t);
        let mut written = None;
        self.store.update(|all| {
            let previous = all.get(&t.id);
            let rungs = e
                .rungs
                .clone()
                .unwrap_or_else(|| previous.map(|p| p.rungs.clone()).unwrap_or_default());
            let record = Record {
                trial: t.id.clone(),
                index: t.index,
                params: t.params.clone(),
                status: e.status,
                told_by: e.told_by.map(String::from),
                exit_code: e.exit_code,
                summary: trial::summarize(&dir),
                duration_s: secs + previous.map_or(0.0, |p| p.duration_s),
                run_dir: dir.strip_prefix(&self.out).unwrap_or(&dir).display().to_string(),
                message: e.message.clone(),
                shard: format!("{}/{}", self.shard.0, self.shard.1),
                finished_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
                metric: Some(self.sweep.metric.name().into()),
                rung: (e.status == Status::StoppedEarly)
                    .then(|| rungs.last().map(|g| g.step))
                    .flatten(),
                rungs,
            };
            all.insert(t.id.clone(), record.clone());
            written = Some(record);
        })?;
        written.ok_or_else(|| anyhow::anyhow!("the record of {} was not written", t.id))
    }
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}
