//! Owns one trial: the planner's verdict, the guarded `oomguard train` child, and what its run
//! directory says when it ends.
//! Keeps: each trial is its own child process, so no trial can take the sweep down.
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::spec::{Runner, Trial};
use crate::record::{Status, Summary};
use oomguard_console::units::human_bytes;

/// Reads a run directory's metrics.jsonl (missing or torn lines are skipped).
pub fn summarize(run_dir: &Path) -> Summary {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default();
    let mut s = Summary::default();
    let mut rates = vec![];
    for v in text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()) {
        match v["event"].as_str() {
            Some("step") => {
                s.steps = s.steps.max(v["step"].as_u64().map_or(0, |n| n + 1));
                s.final_micro_batch_size = v["micro_batch_size"].as_u64().map(|m| m as usize);
                s.final_loss = v["loss"].as_f64();
                rates.extend(v["tokens_per_s"].as_f64());
            }
            Some("eval") => {
                let l = v["val_loss"].as_f64();
                s.final_eval_loss = l;
                s.best_eval_loss = match (s.best_eval_loss, l) {
                    (Some(b), Some(l)) => Some(b.min(l)),
                    (b, l) => b.or(l),
                };
            }
            Some("oom") => s.ooms += 1,
            _ => {}
        }
    }
    s.tokens_per_s = (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64);
    s
}

/// How a trial's process ended, as a status (`stopping`: why the sweep stopped it, if it did).
pub fn status_of(code: i32, stopping: Option<Stop>) -> Status {
    match (code, stopping) {
        (0, _) => Status::Ok,
        (3, _) => Status::Infeasible,
        (_, Some(Stop::Timeout)) => Status::Timeout,
        // Stopped by a signal (the sweep's, or anyone's: SIGINT, SIGTERM, and SIGHUP and
        // SIGQUIT, which the launcher forwards alike): resumable.
        (129 | 130 | 131 | 143, _) | (_, Some(Stop::Sweep)) => Status::Interrupted,
        _ => Status::Failed,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    Timeout,
    Sweep,
}

/// The environment and arguments a trial runs with.
pub struct Launch<'a> {
    pub exe: &'a Path,
    pub runner: &'a Runner,
    pub trial: &'a Trial,
    pub run_dir: PathBuf,
    /// CPU threads (several slots share the CPU), or None to leave the defaults.
    pub threads: Option<usize>,
    /// More environment (the slot's share of the host's memory).
    pub env: &'a [(String, String)],
    /// CUDA_VISIBLE_DEVICES for this slot.
    pub gpu: Option<String>,
    /// More `oomguard train` arguments (an early-stopping segment's max_steps).
    pub extra: Vec<String>,
}

impl Launch<'_> {
    /// `oomguard SUB` with the trial's environment; `oomguard train`'s config and overrides
    /// when the runner is oomguard train (a script's arguments come from `spawn`).
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(self.exe);
        cmd.args(args)
            .stdin(Stdio::null())
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Runner::Train { base } = self.runner {
            cmd.arg(base).args(self.trial.overrides()).args(&self.extra);
        }
        if let Some(n) = self.threads {
            cmd.env("OMP_NUM_THREADS", n.to_string());
            let train = matches!(self.runner, Runner::Train { .. });
            if train && !self.trial.params.contains_key("train.num_threads") {
                cmd.args(["--set", &format!("train.num_threads={n}")]);
            }
        }
        if let Some(g) = &self.gpu {
            cmd.env("CUDA_VISIBLE_DEVICES", g);
        }
        cmd
    }

    /// `oomguard train --check`: the trial's config is valid (else the child's message). A
    /// script's: `oomguard launch --check` of its command (the launcher's options; the
    /// script's own arguments are its to check), run where no trial's files are.
    pub fn check(&self) -> std::io::Result<Result<(), String>> {
        let o = match self.runner {
            Runner::Launch { words, .. } => {
                let scratch = tempfile::tempdir()?;
                let args = Runner::launch_args(words, self.trial, scratch.path())?;
                self.command(&["launch", "--check"]).args(args).output()?
            }
            Runner::Train { .. } => self.command(&["train", "--check"]).output()?,
        };
        Ok(if o.status.success() {
            Ok(())
        } else {
            Err(last_error_line(&String::from_utf8_lossy(&o.stderr)))
        })
    }

    /// `oomguard plan --json`: Some(why) when nothing fits even at micro-batch 1. The planner
    /// that cannot tell (no budget known, say) says nothing: the run decides.
    pub fn planner_says_infeasible(&self, device_memory: Option<&str>) -> std::io::Result<Option<String>> {
        let mut cmd = self.command(&["plan", "--json"]);
        if let Some(m) = device_memory {
            cmd.args(["--device-memory", m]);
        }
        let o = cmd.output()?;
        if o.status.code() != Some(3) {
            return Ok(None);
        }
        let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        // A rung the guard climbs to by itself (the fused loss, activation checkpointing,
        // bf16, as its memory.allow_* keys let it) would fit: the run decides, climbing.
        if v["a_rung_fits"].as_bool() == Some(true) {
            return Ok(None);
        }
        let mut why = match (v["peak_bytes"].as_u64(), v["memory_bytes"].as_u64()) {
            (Some(p), Some(m)) => format!("even micro-batch 1 needs {} of {}", human_bytes(p), human_bytes(m)),
            _ => last_error_line(&String::from_utf8_lossy(&o.stderr)),
        };
        if let Some(s) = v["suggestions"].as_array().filter(|s| !s.is_empty()) {
            why.push_str("; what would fit: ");
            why.push_str(&s.iter().filter_map(Value::as_str).collect::<Vec<_>>().join("; "));
        }
        Ok(Some(why))
    }

    /// Starts `oomguard train ... --run-dir DIR --resume` (resumes from the newest
    /// checkpoint, or starts fresh), or the script under `oomguard launch --run-dir DIR`
    /// (run again whole after an interruption: resuming is the script's), its output
    /// appended to DIR/trial.log.
    pub fn spawn(&self) -> std::io::Result<Child> {
        std::fs::create_dir_all(&self.run_dir)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let mut cmd = match self.runner {
            Runner::Train { .. } => {
                let mut cmd = self.command(&["train"]);
                cmd.arg("--run-dir").arg(&self.run_dir).arg("--resume");
                cmd
            }
            Runner::Launch { words, .. } => {
                let mut cmd = self.command(&["launch"]);
                // Port 0: each attempt on a free port, so trials side by side never share
                // one (a --master-port in the command still wins).
                cmd.env("PET_MASTER_PORT", "0");
                cmd.args(Runner::launch_args(words, self.trial, &self.run_dir)?);
                cmd
            }
        };
        cmd.stdout(log.try_clone()?).stderr(log);
        oomguard_host::proc::spawn_shimmed(&mut cmd)
    }

    pub fn log_path(&self) -> PathBuf {
        self.run_dir.join("trial.log")
    }
}

/// Why a trial failed, from its log: the last error line; a script's under `oomguard launch`
/// is the worker's own, which the launcher's last line carries after `WORKER_SAID`.
pub fn failure_line(log: &str) -> String {
    let line = last_error_line(log);
    match line.split_once(oomguard_console::WORKER_SAID) {
        Some((_, worker)) => worker.trim().to_string(),
        None => line,
    }
}

/// The last line that reports an error, else the last line (log prefixes dropped).
pub fn last_error_line(text: &str) -> String {
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let line = lines
        .iter()
        .rev()
        .find(|l| l.contains("ERROR") || l.contains("error:"))
        .or(lines.last())
        .copied()
        .unwrap_or("");
    // A log line's timestamp and level go (a level word later in the message stays).
    let message = ["ERROR", "WARN"]
        .iter()
        .filter_map(|level| line.split_once(level))
        .find(|(stamp, _)| !stamp.trim().contains(char::is_whitespace))
        .map_or(line, |(_, m)| m);
    message.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_map_to_statuses() {
        assert_eq!(status_of(0, None), Status::Ok);
        assert_eq!(status_of(3, None), Status::Infeasible);
        assert_eq!(status_of(143, Some(Stop::Timeout)), Status::Timeout);
        assert_eq!(status_of(137, Some(Stop::Timeout)), Status::Timeout);
        assert_eq!(status_of(143, Some(Stop::Sweep)), Status::Interrupted);
        assert_eq!(status_of(143, None), Status::Interrupted);
        assert_eq!(
            status_of(129, None),
            Status::Interrupted,
            "SIGHUP, forwarded by the launcher"
        );
        assert_eq!(
            status_of(131, None),
            Status::Interrupted,
            "SIGQUIT, forwarded by the launcher"
        );
        assert_eq!(status_of(1, None), Status::Failed);
        assert_eq!(status_of(2, None), Status::Failed);
        assert_eq!(status_of(3, Some(Stop::Sweep)), Status::Infeasible);
    }

    #[test]
    fn summary_of_a_run() {
        let dir = std::env::temp_dir().join(format!("oomguard-summary-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lines = [
            r#"{"event":"oom","step":0}"#,
            r#"{"event":"step","step":0,"micro_batch_size":8,"tokens_per_s":100.0}"#,
            r#"{"event":"eval","step":0,"val_loss":3.0}"#,
            r#"{"event":"step","step":1,"micro_batch_size":4,"tokens_per_s":300.0}"#,
            r#"{"event":"eval","step":1,"val_loss":2.0}"#,
            r#"{"event":"eval","step":1,"val_loss":2.5}"#,
            r#"{"event":"ste"#,
        ];
        std::fs::write(dir.join("metrics.jsonl"), lines.join("\n")).unwrap();
        let s = summarize(&dir);
        assert_eq!(
            s,
            Summary {
                final_eval_loss: Some(2.5),
                best_eval_loss: Some(2.0),
                final_loss: None,
                tokens_per_s: Some(200.0),
                final_micro_batch_size: Some(4),
                ooms: 1,
                steps: 2
            }
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn error_lines() {
        assert_eq!(
            last_error_line("a\n2026 ERROR x.yaml: model.n_embd: bad\n"),
            "x.yaml: model.n_embd: bad"
        );
        assert_eq!(last_error_line("only\n"), "only");
        assert_eq!(
            last_error_line("2026-11-29T22:52:02Z  WARN received signal 3: stopped the workers\n"),
            "received signal 3: stopped the workers"
        );
        assert_eq!(
            last_error_line("RuntimeError: NCCL WARN x\n"),
            "RuntimeError: NCCL WARN x",
            "a level word inside the message"
        );
        // A script trial: the launcher's give-up line carries the worker's own last error.
        let log = "[default0]:Traceback (most recent call last):\n[default0]:ValueError: lr 7 is too big\n\
                   2026 ERROR worker rank 0 on node 0 failed (exit code 1); no restarts left (--max-restarts 0); \
                   the worker's last error: ValueError: lr 7 is too big\n";
        assert_eq!(failure_line(log), "ValueError: lr 7 is too big");
        assert_eq!(failure_line("a\n2026 ERROR x.yaml: bad\n"), "x.yaml: bad");
    }
}
