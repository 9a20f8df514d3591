//! Owns `log.trackers`: the follower that mirrors rank 0's metrics.jsonl to W&B or MLflow.
//! It is python/oomguard/_trackers.py (the Python guard's own), run as `python3 -c` beside
//! the run. Keeps: the run waits on it only at its start (a named tracker that cannot open
//! a run is a config error, exit 2) and, bounded, at its end; once started, nothing a
//! tracker does can stop training or lose a metrics.jsonl line.
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::ConfigError;

/// The trackers oomguard logs to.
pub const KNOWN: [&str; 2] = ["wandb", "mlflow"];
/// Names trackers for every door, beside `log.trackers` (e.g. `wandb,mlflow`).
pub const ENV: &str = "OOMGUARD_TRACKERS";
const SOURCE: &str = include_str!("../python/oomguard/_trackers.py");
/// How long the run's end waits for the trackers to finish their runs.
const DRAIN: Duration = Duration::from_secs(120);

/// Checks one tracker name (`where`: the key or variable it came from).
pub fn check(name: &str, key: &str) -> Result<(), ConfigError> {
    if KNOWN.contains(&name) {
        return Ok(());
    }
    Err(ConfigError::invalid(
        key,
        format!("names {name:?}, which is not a tracker oomguard knows; the trackers are: wandb, mlflow"),
    ))
}

/// The trackers a run logs to: `log.trackers`, then OOMGUARD_TRACKERS's, each once.
pub fn chosen(configured: &[String]) -> Result<Vec<String>, ConfigError> {
    let env = std::env::var(ENV).unwrap_or_default();
    let mut out: Vec<String> = Vec::new();
    for (name, key) in configured
        .iter()
        .map(|n| (n.trim().to_lowercase(), "log.trackers"))
        .chain(env.split(',').map(|n| (n.trim().to_lowercase(), ENV)))
    {
        if name.is_empty() || out.contains(&name) {
            continue;
        }
        check(&name, key).map_err(|e| match key {
            ENV => ConfigError {
                origin: "the environment".into(),
                ..e
            },
            _ => e,
        })?;
        out.push(name);
    }
    Ok(out)
}

/// The running follower; dropping it ends it (its stdin closes, it logs what is left).
pub struct Follower {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Follower {
    /// Starts the follower on `run_dir/metrics.jsonl` from byte `offset` (the records this
    /// run writes). `resumed`: the run goes on from its newest checkpoint, in the trackers'
    /// runs that trackers.json names, sending no step they were sent before (the steps redone
    /// are the same); else new runs (a fresh start, or a fork). Returns once the trackers'
    /// runs are open; Err says why they are not.
    pub fn start(
        names: &[String],
        run_dir: &Path,
        offset: u64,
        config_json: &str,
        resumed: bool,
    ) -> Result<Follower, ConfigError> {
        let python = std::env::var_os(oomguard_launch::PYTHON_VAR).unwrap_or_else(|| "python3".into());
        let shown = python.to_string_lossy().into_owned();
        let fail = |why: String| ConfigError::invalid("log.trackers", why);
        let mut child = Command::new(&python)
            .arg("-c")
            .arg(SOURCE)
            .arg("follow")
            .arg(run_dir)
            .arg(names.join(","))
            .arg(offset.to_string())
            .arg(config_json)
            .arg("")
            .arg(if resumed { "resume" } else { "new" })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                fail(format!(
                    "names {}, which oomguard logs to through Python, but {shown} cannot run: {e} \
                     (set {} to the interpreter that has them)",
                    names.join(", "),
                    oomguard_launch::PYTHON_VAR
                ))
            })?;
        let mut line = String::new();
        let _ = child.stdout.take().map(|out| BufReader::new(out).read_line(&mut line));
        let mut stderr = child.stderr.take();
        if line.trim() != "ready" {
            let mut said = String::new();
            if let Some(err) = stderr.as_mut() {
                let _ = err.read_to_string(&mut said);
            }
            let _ = child.wait();
            let last = said.lines().rev().find(|l| !l.trim().is_empty());
            let last = last.map_or("it exited without saying why".into(), |l| l.trim().to_string());
            return Err(fail(format!(
                "{last} (the trackers run under {shown}; {} names another interpreter)",
                oomguard_launch::PYTHON_VAR
            )));
        }
        if let Some(err) = stderr {
            // The trackers' own lines (W&B's banner, warnings), passed on as they come.
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    eprintln!("{line}");
                }
            });
        }
        let stdin = child.stdin.take();
        Ok(Follower { child, stdin })
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let start = Instant::now();
        while start.elapsed() < DRAIN {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        tracing::warn!(
            "log.trackers: the trackers did not finish within {} s; stopped (metrics.jsonl has every record)",
            DRAIN.as_secs()
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tracker_name_is_checked_against_the_known_ones() {
        assert!(check("wandb", "log.trackers").is_ok());
        assert!(check("mlflow", "log.trackers").is_ok());
        let e = check("tensorbaord", "log.trackers").unwrap_err();
        assert_eq!(e.key, "log.trackers");
        assert!(e.message.contains("wandb, mlflow"), "{}", e.message);
    }

    #[test]
    fn the_follower_is_the_python_guards_own_file() {
        assert!(SOURCE.contains("def follow("));
        assert!(SOURCE.contains("KNOWN = (\"wandb\", \"mlflow\")"));
    }
}
