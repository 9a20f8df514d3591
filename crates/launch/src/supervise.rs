//! Owns running the worker group: spawn, watch, stop, restart, summarise.
//! Keeps: nothing outlives the launcher; each worker's process group dies with it, even on
//! SIGKILL, and every child is waited for.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use super::group::{Group, ToNode};
use super::outcome::Report;
use super::output::{pump, Sink, Tail};
use super::LaunchError as Error;
use super::{worker_env, LaunchSpec, Micro, Streams};
use oomguard_host::oom::classify_oom;
use oomguard_host::proc::{kernel_oom_kills as oom_kills, Signals};

/// How often an attempt is started again on another port when the one the launcher chose was
/// taken before its store listened (`free_port` makes that rare: this is for the rest).
const PORT_REDRAWS: u32 = 3;

struct Worker {
    local_rank: usize,
    rank: usize,
    child: Child,
    done: bool,
    pumps: Vec<JoinHandle<()>>,
    stdout: Tail,
    stderr: Tail,
    error_file: PathBuf,
}

#[derive(Debug, Clone)]
struct Failure {
    local_rank: usize,
    rank: usize,
    pid: u32,
    /// Exit code, or the negated signal number (as torchrun prints it).
    exitcode: i32,
    /// The kernel's OOM killer killed a process of this host while the attempt ran
    /// (`kernel_oom_kills` rose), set once the attempt has ended.
    oom_killed: bool,
    time: SystemTime,
    error_file: PathBuf,
    error_message: Option<String>,
    stdout: Vec<String>,
    stderr: Vec<String>,
}

impl Failure {
    /// It ended with `oomguard.Infeasible` (even micro-batch 1 does not fit: no restart can
    /// help): a Python worker's last line (exit 1), `oomguard train`'s error file (exit 3).
    /// A script's own exit 3 is not that.
    fn infeasible(&self) -> bool {
        let e = self.final_error();
        matches!(self.exitcode, 1 | 3) && e.lines().any(|l| unranked(l).starts_with(crate::INFEASIBLE))
    }

    /// The launcher's exit code for it: 3 where it is `infeasible`, else the worker's own.
    fn exit_code(&self) -> i32 {
        if self.infeasible() {
            3
        } else if self.exitcode < 0 {
            128 - self.exitcode
        } else {
            self.exitcode
        }
    }
    /// The error that ended the attempt: the error file's, else the worker's last error on
    /// stderr (else stdout). Out-of-memory errors it logged and recovered from earlier do not count.
    fn final_error(&self) -> String {
        self.error_message.clone().unwrap_or_else(|| {
            let last = last_error(&self.stderr);
            if last.is_empty() {
                last_error(&self.stdout)
            } else {
                last
            }
        })
    }
    /// Rank 0's store could not listen on `port`: another process holds it (torch's "failed
    /// to listen ... port: P ... address already in use", `oomguard train`'s "cannot listen
    /// on HOST:P (Address already in use)"); the port a whole number in the error.
    fn lost_port(&self, port: u16) -> bool {
        let e = self.final_error().to_lowercase();
        let p = port.to_string();
        let whole = e.match_indices(&p).any(|(i, _)| {
            let digit = |b: Option<&u8>| b.is_some_and(u8::is_ascii_digit);
            !digit(i.checked_sub(1).and_then(|j| e.as_bytes().get(j))) && !digit(e.as_bytes().get(i + p.len()))
        });
        self.rank == 0 && e.contains("listen") && e.contains("address already in use") && whole
    }
    fn is_oom(&self) -> bool {
        let text = self.final_error();
        classify_oom(&text).is_some() || text.contains("MemoryError") || self.killed_for_memory()
    }
    /// Killed by the kernel's OOM killer (a cgroup's limit, the host's memory), which leaves
    /// no message: SIGKILL, or a DataLoader worker killed so, while the kernel's count of
    /// OOM kills rose.
    fn killed_for_memory(&self) -> bool {
        let sigkill = self.exitcode == -libc::SIGKILL || self.exitcode == 128 + libc::SIGKILL; // a shell's 137
        self.oom_killed && (sigkill || self.final_error().contains("is killed by signal: Killed"))
    }
    /// The micro-batch the worker reported (`micro_batch_size=N`, the last mention on
    /// stderr, else on stdout: Python's print writes to stdout). `guards`: only as oomguard's
    /// runtimes say it at each change (`oomguard: micro_batch_size=N`, `...; micro_batch_size=N`,
    /// `at micro_batch_size=N`), not as a script's own print of its arguments would.
    fn reported_micro_batch(&self, guards: bool) -> Option<usize> {
        const KEY: &str = "micro_batch_size=";
        let ours = |before: &str| ["; ", "at ", "oomguard: "].iter().any(|p| before.ends_with(p));
        let last = |lines: &[String]| {
            lines.iter().rev().find_map(|l| {
                let (at, _) = l.rmatch_indices(KEY).find(|(i, _)| !guards || ours(&l[..*i]))?;
                l[at + KEY.len()..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
                    .parse()
                    .ok()
            })
        };
        last(&self.stderr).or_else(|| last(&self.stdout))
    }
}

/// The worker's last error in `lines`: from its last ERROR log line or Python traceback to the
/// end; else its last lines that are not WARN/INFO logs (a recovered OOM is logged at WARN).
pub fn last_error(lines: &[String]) -> String {
    let start = lines
        .iter()
        .rposition(|l| l.contains("ERROR") || unranked(l).starts_with("Traceback (most recent call last)"));
    let tail: Vec<&String> = match start {
        Some(i) => lines[i..].iter().collect(),
        None => {
            let quiet = |l: &&String| {
                ![" WARN ", " INFO ", " DEBUG ", " TRACE ", "WARNING"]
                    .iter()
                    .any(|lvl| l.contains(lvl))
            };
            let kept: Vec<&String> = lines.iter().filter(quiet).collect();
            kept[kept.len().saturating_sub(3)..].to_vec()
        }
    };
    tail.iter().map(|l| l.as_str()).collect::<Vec<_>>().join("\n")
}

/// A line without the `[rankN]: ` that torch.distributed's excepthook puts before each
/// line of a traceback once a process group exists (DDP, FSDP, Accelerate), trimmed.
fn unranked(line: &str) -> &str {
    let l = line.trim_start();
    l.strip_prefix("[rank")
        .and_then(|r| r.split_once("]: "))
        .filter(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .map_or(l, |(_, rest)| rest.trim_start())
}

enum Outcome {
    Succeeded,
    Failed(Failure),
    Signaled(i32),
    /// The group restarts or stops because of another node (the workers are stopped).
    Group(ToNode),
}

/// Runs the job; returns the launcher's exit code. Every attempt is a round of the group
/// (group/): on several nodes, a failure anywhere restarts every node's workers.
pub fn run(spec: &LaunchSpec) -> Result<i32, Error> {
    let signals = Signals::install().map_err(|e| Error::Io {
        context: "installing signal handlers".into(),
        source: e,
    })?;
    let n = spec.nproc_per_node;
    if let Some((per, host)) = &spec.worker_threads {
        tracing::warn!("OMP_NUM_THREADS is unset: setting it to {per} for each of the {n} workers (this host gives {host}), to avoid oversubscribing \
            the CPU; set it yourself to tune");
    }
    if let Some(m) = &spec.worker_memory {
        tracing::info!(
            "host memory: {}; each of the {n} workers gets {}",
            m.describe(),
            oomguard_console::units::human_bytes(m.share(n).0)
        );
    }
    let temp = spec
        .log_dir
        .is_none()
        .then(|| std::env::temp_dir().join(format!("oomguard-launch-{}", std::process::id())));
    let base = spec
        .log_dir
        .clone()
        .or(temp.clone())
        .unwrap_or_default()
        .join(&spec.run_id);
    let (mut group, start) = match Group::join(spec, &signals) {
        Err(Error::Signaled(sig)) => {
            tracing::warn!("received signal {sig} while waiting for the group: no worker was started");
            return Ok(128 + sig);
        }
        joined => joined?,
    };
    // Every node's token is its own: on several nodes, the same secret on each.
    let whole = spec;
    let (mut attempt, mut micro, mut layout) = (start.round, start.micro, start.layout);
    let mut redraws = 0;
    loop {
        // Elastic: this round's place (node rank, nodes, rank 0's store) replaces the flags'.
        let placed = layout.as_ref().map(|l| whole.in_round(l));
        let spec = placed.as_ref().unwrap_or(whole);
        if let Some(l) = &layout {
            let change = l.change.as_ref().map(|c| {
                format!(
                    " after a membership change: {} ({} nodes -> {})",
                    c.cause, c.old_nodes, c.new_nodes
                )
            });
            tracing::info!(
                "round {attempt}: node {} of {}{}",
                l.node_rank,
                l.nnodes,
                change.unwrap_or_default()
            );
        }
        let port = if spec.master_port == 0 {
            super::group::free_port("0.0.0.0").map_err(|source| Error::Io {
                context: "finding a free port".into(),
                source,
            })?
        } else {
            spec.master_port
        };
        let dir = base.join(format!("attempt_{attempt}"));
        let kills = oom_kills();
        let mut workers = (0..spec.nproc_per_node)
            .map(|r| spawn(spec, r, port, attempt, &dir, micro))
            .collect::<Vec<_>>();
        if let Some(Err(e)) = workers.iter().find(|w| w.is_err()) {
            let msg = e.to_string();
            let mut started: Vec<Worker> = workers.into_iter().flatten().collect();
            stop(&mut started, libc::SIGKILL, Duration::ZERO, &signals);
            group.abort(1);
            return Err(Error::Start(msg));
        }
        let mut workers: Vec<Worker> = workers.drain(..).flatten().collect();
        tracing::info!(
            "attempt {attempt}: {} workers (ranks {}..{}), master {}:{port}{}",
            workers.len(),
            workers[0].rank,
            workers[workers.len() - 1].rank,
            spec.master_addr,
            micro.size.map(|m| format!(", micro-batch {m}")).unwrap_or_default()
        );
        let next = match watch(
            &mut workers,
            spec.monitor_interval,
            spec.shutdown_timeout,
            &signals,
            &mut group,
        ) {
            Outcome::Succeeded => {
                group.done();
                temp.map(std::fs::remove_dir_all);
                return Ok(0);
            }
            Outcome::Signaled(sig) => {
                tracing::warn!("received signal {sig}: stopped the workers");
                group.abort(128 + sig);
                return Ok(128 + sig);
            }
            Outcome::Group(ToNode::Restart { round, why }) => {
                tracing::warn!(
                    "{why}: node {} stopped its workers to restart with the group (round {round})",
                    group.node()
                );
                group.stopped(round)
            }
            Outcome::Group(ToNode::Stop { code, why }) => Err((code, why)),
            Outcome::Group(_) => Err((1, "unexpected message from node 0's launcher".into())),
            Outcome::Failed(f) if spec.master_port == 0 && f.lost_port(port) && redraws < PORT_REDRAWS => {
                // The port was free when drawn, and another process took it before rank 0's
                // store listened: not the workers' failure, so no restart is spent on it.
                redraws += 1;
                tracing::warn!(
                    "rank {} could not listen on port {port}: another process took it after the launcher chose it; \
                    starting the attempt again on another port ({redraws}/{PORT_REDRAWS})",
                    f.rank
                );
                continue;
            }
            Outcome::Failed(mut f) => {
                f.oom_killed = kills.is_some() && oom_kills() > kills;
                if f.killed_for_memory() {
                    tracing::warn!(
                        "worker rank {} was killed by the kernel's OOM killer (/proc/vmstat oom_kill rose): out of host \
                         or cgroup memory",
                        f.rank
                    );
                }
                let oom = f.is_oom();
                // The size the worker's guard said last (it may have grown back since it
                // started), else the one this attempt was started at, else a size it printed.
                let known = f
                    .reported_micro_batch(true)
                    .or(micro.size)
                    .or(f.reported_micro_batch(false));
                match group.failed(
                    attempt,
                    Report {
                        rank: f.rank,
                        oom,
                        micro: known,
                        code: f.exit_code(),
                        infeasible: f.infeasible(),
                    },
                ) {
                    Ok(s) => {
                        tracing::warn!(
                            "worker rank {} failed (exit code {}){}; restarting the group ({}/{})",
                            f.rank,
                            f.exitcode,
                            if oom { " out of memory" } else { "" },
                            s.round,
                            spec.max_restarts
                        );
                        Ok(s)
                    }
                    Err((code, why)) => {
                        eprint!("{}", summary(&f, spec));
                        // The error's last line (a Python traceback's is the exception): after
                        // exit 3 what would fit; otherwise the worker's own error, which a sweep
                        // records for the trial.
                        let e = f.final_error();
                        let last = e.lines().rev().map(str::trim).find(|l| !l.is_empty());
                        let why = match last {
                            Some(last) if f.infeasible() => format!("{why}: {last}"),
                            Some(last) => format!("{why}{}{last}", oomguard_console::WORKER_SAID),
                            None => why,
                        };
                        Err((code, why))
                    }
                }
            }
        };
        match next {
            Ok(s) => {
                if s.micro.size != micro.size {
                    match s.micro.size {
                        Some(s) => tracing::warn!("relaunching with {}={s}", super::MICRO_BATCH_VAR),
                        None => tracing::warn!(
                            "cannot halve the micro-batch: its size is unknown (set {} or have the worker print \
                            micro_batch_size=N)",
                            super::MICRO_BATCH_VAR
                        ),
                    }
                }
                (attempt, micro, layout) = (s.round, s.micro, s.layout);
            }
            Err((code, why)) => {
                tracing::error!("{why}");
                return Ok(code);
            }
        }
    }
}

fn streams_of(map: &std::collections::BTreeMap<usize, Streams>, rank: usize) -> Streams {
    map.get(&rank).copied().unwrap_or_default()
}

fn spawn(
    spec: &LaunchSpec,
    local_rank: usize,
    port: u16,
    attempt: u32,
    dir: &Path,
    micro: Micro,
) -> Result<Worker, Error> {
    let rank_dir = dir.join(local_rank.to_string());
    std::fs::create_dir_all(&rank_dir).map_err(|e| Error::Io {
        context: format!("creating {}", rank_dir.display()),
        source: e,
    })?;
    let error_file = rank_dir.join("error.json");
    // A run before this one in the same --log-dir left its error there: it is not this
    // worker's (torchrun starts each attempt's folder empty).
    match std::fs::remove_file(&error_file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(Error::Io {
                context: format!("removing the last run's {}", error_file.display()),
                source: e,
            })
        }
        _ => {}
    }
    let mut cmd = Command::new(&spec.program[0]);
    cmd.args(&spec.program[1..])
        .envs(worker_env(spec, local_rank, port, attempt, &error_file, micro))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = oomguard_host::proc::spawn_shimmed(&mut cmd)
        .map_err(|e| Error::Start(format!("cannot start worker `{}`: {e}", spec.program[0])))?;
    let (redirect, tee) = (
        streams_of(&spec.redirects, local_rank),
        streams_of(&spec.tee, local_rank),
    );
    let shown = spec.console_ranks.as_ref().is_none_or(|r| r.contains(&local_rank));
    let prefix = format!("[{}{local_rank}]:", spec.role);
    let (stdout, stderr) = (Tail::default(), Tail::default());
    let mut pumps = Vec::new();
    if let Some(out) = child.stdout.take() {
        let to_file = redirect.stdout || tee.stdout;
        let sink = Sink {
            prefix: prefix.clone(),
            console: shown && !redirect.stdout,
            is_stderr: false,
            file: to_file.then(|| rank_dir.join("stdout.log")),
        };
        pumps.push(pump(out, sink, stdout.clone()));
    }
    if let Some(err) = child.stderr.take() {
        let to_file = redirect.stderr || tee.stderr;
        let sink = Sink {
            prefix,
            console: shown && !redirect.stderr,
            is_stderr: true,
            file: to_file.then(|| rank_dir.join("stderr.log")),
        };
        pumps.push(pump(err, sink, stderr.clone()));
    }
    Ok(Worker {
        local_rank,
        rank: spec.node_rank * spec.nproc_per_node + local_rank,
        child,
        done: false,
        pumps,
        stdout,
        stderr,
        error_file,
    })
}

fn watch(workers: &mut [Worker], interval: Duration, grace: Duration, signals: &Signals, group: &mut Group) -> Outcome {
    loop {
        if let Some(sig) = signals.received() {
            stop(workers, sig, grace, signals);
            return Outcome::Signaled(sig);
        }
        if let Some(msg) = group.poll() {
            stop(workers, libc::SIGTERM, grace, signals);
            return Outcome::Group(msg);
        }
        let mut failure = None;
        for w in workers.iter_mut().filter(|w| !w.done) {
            let Ok(Some(status)) = w.child.try_wait() else { continue };
            w.done = true;
            if !status.success() && failure.is_none() {
                use std::os::unix::process::ExitStatusExt;
                let exitcode = status.code().unwrap_or_else(|| -status.signal().unwrap_or(0));
                failure = Some((w.local_rank, exitcode, SystemTime::now()));
            }
        }
        if let Some((local_rank, exitcode, time)) = failure {
            stop(workers, libc::SIGTERM, grace, signals);
            let w = &workers[local_rank];
            return Outcome::Failed(Failure {
                local_rank,
                rank: w.rank,
                pid: w.child.id(),
                exitcode,
                time,
                oom_killed: false,
                error_message: read_error_file(&w.error_file),
                error_file: w.error_file.clone(),
                // Its last lines may still be in the pipe when its exit is seen.
                stdout: w.stdout.settled(Duration::from_secs(2)).lines(),
                stderr: w.stderr.settled(Duration::from_secs(2)).lines(),
            });
        }
        if workers.iter().all(|w| w.done) {
            stop(workers, libc::SIGKILL, Duration::ZERO, signals); // their process groups: no stray children
            return Outcome::Succeeded;
        }
        std::thread::sleep(interval);
    }
}

/// Sends `sig` to every worker's process group, waits up to `grace` (a further signal to the
/// launcher cuts it short), then kills what is left; reaps everything and drains output.
fn stop(workers: &mut [Worker], sig: i32, grace: Duration, signals: &Signals) {
    let group = |w: &Worker, s: i32| unsafe { libc::killpg(w.child.id() as i32, s) };
    for w in workers.iter() {
        group(w, sig);
    }
    let seen = signals.count.load(Ordering::SeqCst);
    let t = Instant::now();
    while t.elapsed() < grace && signals.count.load(Ordering::SeqCst) == seen {
        if workers
            .iter_mut()
            .all(|w| w.done || matches!(w.child.try_wait(), Ok(Some(_))))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for w in workers.iter_mut() {
        group(w, libc::SIGKILL);
        let _ = w.child.wait();
        w.done = true;
    }
    // A worker's output ends when the last process holding its pipes does: one that left
    // the worker's process group (setsid, a daemon) may hold them on. Its lines are waited
    // for a while, then left to their thread.
    let t = Instant::now();
    for w in workers.iter_mut() {
        for p in w.pumps.drain(..) {
            while !p.is_finished() && t.elapsed() < PUMPS_DRAIN {
                std::thread::sleep(Duration::from_millis(10));
            }
            if p.is_finished() {
                let _ = p.join();
            } else {
                tracing::warn!(
                    "local rank {}'s output is still open {} s after it exited (a process it started outside its group holds it): \
                     not waiting for it",
                    w.local_rank,
                    PUMPS_DRAIN.as_secs()
                );
            }
        }
    }
}

/// How long a stopped worker's output may stay open before the launcher goes on without it.
const PUMPS_DRAIN: Duration = Duration::from_secs(5);

/// torchelastic's error file: `{"message": {"message": "...", "extraInfo": {...}}}` or
/// `{"message": "..."}`.
fn read_error_file(path: &Path) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    let m = &v["message"];
    m["message"].as_str().or(m.as_str()).map(str::to_string)
}

fn summary(f: &Failure, spec: &LaunchSpec) -> String {
    let line = "=".repeat(60);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let exit = if f.exitcode < 0 {
        let name = match -f.exitcode {
            9 => "SIGKILL",
            15 => "SIGTERM",
            2 => "SIGINT",
            1 => "SIGHUP",
            3 => "SIGQUIT",
            6 => "SIGABRT",
            11 => "SIGSEGV",
            _ => "signal",
        };
        format!("{} ({name}) (pid: {})", f.exitcode, f.pid)
    } else {
        format!("{} (pid: {})", f.exitcode, f.pid)
    };
    let mut s = format!(
        "{line}\n{} FAILED\n{}\nRoot Cause (first observed failure):\n[0]:\n  time      : {}\n  host      : {}\n  rank      : {} (local_rank: {})\n  \
            exitcode  : {exit}\n  error_file: {}\n  traceback : {}\n",
        spec.program.join(" "), "-".repeat(60), humantime::format_rfc3339_seconds(f.time), host.trim(), f.rank, f.local_rank,
        if f.error_message.is_some() { f.error_file.display().to_string() } else { "<N/A>".into() },
        f.error_message.clone().unwrap_or_else(|| "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html".into()),
    );
    if !f.stderr.is_empty() {
        s.push_str("  stderr (last lines):\n");
        for l in f.stderr.iter().rev().take(15).rev() {
            s.push_str(&format!("    {l}\n"));
        }
    }
    if let Some(hint) = missing_torch(f, spec) {
        s.push_str(&format!("  hint      : {hint}\n"));
    }
    s.push_str(&line);
    s.push('\n');
    s
}

/// A worker whose Python has no torch: which interpreter that was (from PATH, as the worker
/// found it), and how to name another.
fn missing_torch(f: &Failure, spec: &LaunchSpec) -> Option<String> {
    let text = format!(
        "{}\n{}",
        f.error_message.as_deref().unwrap_or_default(),
        f.stderr.join("\n")
    );
    if !spec.python || !text.contains("No module named 'torch'") {
        return None;
    }
    let python = &spec.program[0];
    let found = on_path(python, std::env::var_os("PATH").as_deref());
    let shown = found.map_or_else(|| python.clone(), |p| p.display().to_string());
    Some(format!(
        "the workers ran {shown}, which has no torch: set {}=/path/to/python (one with torch), or put it first on PATH",
        super::PYTHON_VAR
    ))
}

/// Where `program` is, as a worker's exec finds it: itself when it names a path, else the
/// first executable of that name on `path`.
fn on_path(program: &str, path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    std::env::split_paths(path?).map(|d| d.join(program)).find(|p| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_error_not_a_recovered_oom() {
        let lines = |t: &str| t.lines().map(String::from).collect::<Vec<_>>();
        let recovered =
            "2026-11-23T10:00:00Z  WARN out of memory (Cpu): can't allocate memory at micro-batch 8: halving\n";
        let e = last_error(&lines(&format!(
            "{recovered}2026-11-23T10:00:01Z ERROR reading data: disk full\n"
        )));
        assert_eq!(e, "2026-11-23T10:00:01Z ERROR reading data: disk full");
        assert!(classify_oom(&e).is_none());
        // A Python script that printed a recovered OOM's traceback, then crashed otherwise.
        let py = "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\nretrying at 8\n\
            Traceback (most recent call last):\n  File \"x.py\"\nValueError: bad batch\n";
        assert!(
            last_error(&lines(py)).ends_with("ValueError: bad batch")
                && !last_error(&lines(py)).contains("OutOfMemory")
        );
        assert!(classify_oom(&last_error(&lines(
            "Traceback (most recent call last):\nRuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        )))
        .is_some());
        // No error line at all (a segfault): the last lines that are not logs of recoveries.
        assert_eq!(last_error(&lines(&format!("step 3\n{recovered}"))), "step 3");
    }

    /// Under a process group torch prefixes each traceback line with `[rankN]: `: the
    /// worker's `oomguard.Infeasible` is still exit 3, and its traceback still the error.
    #[test]
    fn an_infeasible_traceback_behind_a_rank_prefix_is_still_infeasible() {
        let stderr: Vec<String> = "step 1\n[rank1]: Traceback (most recent call last):\n[rank1]:   File \"t.py\"\n\
            [rank1]: oomguard.Infeasible: micro-batch 1 does not fit\n"
            .lines()
            .map(String::from)
            .collect();
        let f = |exitcode, stderr: Vec<String>| Failure {
            local_rank: 1,
            rank: 1,
            pid: 1,
            exitcode,
            oom_killed: false,
            time: SystemTime::now(),
            error_file: PathBuf::new(),
            error_message: None,
            stdout: vec![],
            stderr,
        };
        assert!(last_error(&stderr).starts_with("[rank1]: Traceback"));
        assert_eq!(f(1, stderr.clone()).exit_code(), 3);
        let other = stderr
            .iter()
            .map(|l| l.replace("oomguard.Infeasible", "ValueError"))
            .collect();
        assert_eq!(f(1, other).exit_code(), 1);
        assert_eq!(unranked("[rank12]: x"), "x");
    }

    /// The redraw is for rank 0's store meeting its port taken, nothing else.
    #[test]
    fn a_lost_port_is_rank_0s_store_failing_to_listen_on_it() {
        let f = |rank, line: &str| Failure {
            local_rank: rank,
            rank,
            pid: 1,
            exitcode: 1,
            oom_killed: false,
            time: SystemTime::now(),
            error_file: PathBuf::new(),
            error_message: Some(line.to_string()),
            stdout: vec![],
            stderr: vec![],
        };
        let torch = "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network \
            address. port: 21024, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use";
        let ours = "data parallel: rank 0 of 2 joining the group at 127.0.0.1:21024: Internal torch error: cannot \
            listen on 127.0.0.1:21024 (Address already in use)";
        assert!(f(0, torch).lost_port(21024) && f(0, ours).lost_port(21024));
        assert!(!f(1, torch).lost_port(21024), "only rank 0 listens");
        assert!(!f(0, torch).lost_port(2102), "a number within another");
        assert!(!f(0, "OSError: [Errno 98] Address already in use (pid 210245)").lost_port(21024));
        assert_eq!(unranked("[rankx]: x"), "[rankx]: x");
    }

    /// The size a relaunch halves: the guards' own lines first; a script's print of its
    /// arguments only where nothing else says.
    #[test]
    fn the_guards_own_lines_say_the_micro_batch() {
        let f = |stdout: &[&str]| Failure {
            local_rank: 0,
            rank: 0,
            pid: 1,
            exitcode: 1,
            oom_killed: false,
            time: SystemTime::now(),
            error_file: PathBuf::new(),
            error_message: None,
            stdout: stdout.iter().map(|l| l.to_string()).collect(),
            stderr: vec![],
        };
        let args = "Namespace(lr=0.1, micro_batch_size=64)";
        let grew = "oomguard: micro-batch 8 -> 16 (headroom) from step 9; micro_batch_size=16";
        assert_eq!(f(&[grew, args]).reported_micro_batch(true), Some(16));
        assert_eq!(f(&[args]).reported_micro_batch(true), None);
        assert_eq!(f(&[args]).reported_micro_batch(false), Some(64));
        let rust = "ERROR step 3 ran out of memory at micro_batch_size=4";
        assert_eq!(f(&[rust]).reported_micro_batch(true), Some(4));
        assert_eq!(f(&["micro_batch_size=256"]).reported_micro_batch(false), Some(256));
    }

    /// SIGKILL, or a DataLoader's worker killed, is an OOM when the kernel's OOM kills rose
    /// meanwhile; else it is not (a kill -9 of the user's, a crash).
    #[test]
    fn a_kill_is_an_oom_only_when_the_kernel_counted_one() {
        let f = |exitcode, oom_killed, line: &str| Failure {
            local_rank: 0,
            rank: 0,
            pid: 1,
            exitcode,
            oom_killed,
            time: SystemTime::now(),
            error_file: PathBuf::new(),
            error_message: None,
            stdout: vec![],
            stderr: vec![line.to_string()],
        };
        let loader = "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.";
        assert!(f(-9, true, "").is_oom() && f(137, true, "").is_oom() && f(1, true, loader).is_oom());
        assert!(!f(-9, false, "").is_oom() && !f(1, false, loader).is_oom());
        assert!(!f(-15, true, "").is_oom() && !f(1, true, "ValueError: bad").is_oom());
    }
}
