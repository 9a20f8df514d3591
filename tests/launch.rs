//! `oomguard launch` with real processes: a real torch.distributed job exactly as under
//! torchrun, crashes and restarts, signals, and relaunch after an out-of-memory death.
mod common;
use common::{dies_with_test, listeners, path_with_venv, port_pair};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    common::root()
}

fn script(name: &str) -> String {
    root().join("tests/scripts").join(name).display().to_string()
}

/// `oomguard train CONFIG --run-dir RUN EXTRA...` as the launcher's only worker, up to 3
/// restarts, with a micro-batch cache of its own under `dir`.
fn train_under_launch(dir: &std::path::Path, cfg: &std::path::Path, run: &std::path::Path, extra: &[&str]) -> Output {
    let bin = common::bin();
    let mut args = vec![
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.05",
        "--no-python",
        bin.to_str().unwrap(),
    ];
    args.extend(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()]);
    args.extend_from_slice(extra);
    launcher(&args)
        .env("OOMGUARD_CACHE", dir.join(".cache"))
        .output()
        .unwrap()
}

fn launcher(args: &[&str]) -> Command {
    let mut c = Command::new(common::bin());
    dies_with_test(&mut c);
    c.arg("launch")
        .args(args)
        .env("PATH", path_with_venv())
        .env_remove("OMP_NUM_THREADS")
        .stdin(Stdio::null());
    c
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The workers' RESULT objects, wherever they fall: without prefixes (torchrun) two workers'
/// writes can share a line.
fn results(stdout: &str) -> BTreeSet<String> {
    stdout
        .split("RESULT ")
        .skip(1)
        .filter_map(|r| {
            r.find("\"world\": ").map(|i| &r[..i]).and_then(|head| {
                let tail = &r[head.len()..];
                tail.find('}').map(|j| format!("{head}{}", &tail[..=j]))
            })
        })
        .collect()
}

#[test]
fn ddp_script_runs_exactly_as_under_torchrun() {
    let args = ["--nproc-per-node", "2", "--rdzv-id", "job1", &script("ddp.py")];
    let ours = launcher(&["--master-port", &port_pair().to_string()])
        .args(args)
        .output()
        .unwrap();
    let (out, err) = text(&ours);
    assert!(ours.status.success(), "{out}\n{err}");
    assert!(
        out.contains("[default0]:RESULT") && out.contains("[default1]:RESULT"),
        "per-rank prefixes: {out}"
    );
    assert!(err.contains("OMP_NUM_THREADS is unset: setting it to 1"), "{err}");

    let torchrun = Command::new(root().join(".venv/bin/python3"))
        .args(["-m", "torch.distributed.run", "--master-port", &port_pair().to_string()])
        .args(args)
        .env("PATH", path_with_venv())
        .env_remove("OMP_NUM_THREADS")
        .output()
        .unwrap();
    let (tout, terr) = text(&torchrun);
    assert!(torchrun.status.success(), "{tout}\n{terr}");
    let (a, b) = (results(&out), results(&tout));
    assert_eq!(a.len(), 2, "{out}");
    assert_eq!(a, b, "oomguard launch and torchrun gave the workers different results");
}

/// One node and no --master-port (torchrun 2.13's free port): a job starts while another
/// process holds 29500, as a second job on the host would, where a fixed port failed with
/// EADDRINUSE.
#[test]
fn a_job_while_29500_is_taken_rendezvous_at_a_free_port() {
    // Held here for the whole run (if another process holds it already, so much the better).
    let _held = std::net::TcpListener::bind("127.0.0.1:29500");
    let o = launcher(&["--nproc-per-node", "2", &script("ddp.py")])
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert_eq!(results(&out).len(), 2, "{out}");
    assert!(!err.contains("master 127.0.0.1:29500"), "{err}");
}

/// The port the launcher chose is taken by another process before rank 0's store listens
/// (a process here binds it at the first attempt's start): the attempt starts again on another
/// port, with no restart spent (--max-restarts 0), where it failed with EADDRINUSE.
#[test]
fn a_port_taken_before_the_store_listens_is_drawn_again() {
    let dir = tempfile::tempdir().unwrap();
    let hold = "import os, socket, time\n\
        s = socket.socket(); s.bind(('0.0.0.0', int(os.environ['MASTER_PORT']))); s.listen()\n\
        open('held', 'w').close(); time.sleep(120)\n";
    std::fs::write(dir.path().join("hold.py"), hold).unwrap();
    let worker = format!(
        "if [ \"$RANK\" = 0 ] && [ ! -e taken ]; then touch taken; python3 hold.py & \
            while [ ! -e held ]; do sleep 0.05; done; fi; exec python3 {}",
        script("ddp.py")
    );
    let o = launcher(&[
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--no-python",
        "sh",
        "-c",
        &worker,
    ])
    .current_dir(dir.path())
    .output()
    .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(dir.path().join("held").exists(), "the port was taken: {err}");
    assert!(
        err.contains("another process took it after the launcher chose it"),
        "{err}"
    );
    assert_eq!(results(&out).len(), 2, "{out}");
}

/// $OOMGUARD_PYTHON is the workers' interpreter (the wheel's `oomguard` sets it to its own);
/// one without torch is named in the failure summary, with the fix.
#[test]
fn the_workers_python_is_oomguard_python_and_named_when_it_lacks_torch() {
    let dir = tempfile::tempdir().unwrap();
    let show = dir.path().join("show.py");
    std::fs::write(&show, "import sys, torch; print('python', sys.executable)").unwrap();
    let venv_python = root().join(".venv/bin/python3");
    let o = launcher(&[show.to_str().unwrap()])
        .env("OOMGUARD_PYTHON", &venv_python)
        .env("PATH", "/usr/bin:/bin")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains(&format!("python {}", venv_python.display())), "{out}");

    let bare = dir.path().join("bare");
    let made = Command::new(&venv_python)
        .args(["-m", "venv", "--without-pip", bare.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(made.success());
    let bare_python = bare.join("bin/python3");
    let o = launcher(&[show.to_str().unwrap()])
        .env("OOMGUARD_PYTHON", &bare_python)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    let hint = format!(
        "hint      : the workers ran {}, which has no torch: set OOMGUARD_PYTHON=",
        bare_python.display()
    );
    assert!(err.contains(&hint), "{err}");
}

/// The default --max-restarts 0 and a worker dead of an OOM: the launcher says that a relaunch
/// at half was possible, and how to allow one.
#[test]
fn an_oom_death_with_no_restarts_says_a_relaunch_at_half_was_possible() {
    let o = launcher(&["--monitor-interval", "0.05", &script("oom.py")])
        .env("OOMGUARD_MICRO_BATCH_SIZE", "16")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    assert!(
        err.contains(
            "no restarts left (--max-restarts 0). It ran out of memory: a relaunch at micro-batch 8 (half of 16) \
             was possible; allow one with --max-restarts 1 (or more)"
        ),
        "{err}"
    );
}

#[test]
fn crash_restarts_then_summary_with_first_failure() {
    let logs = tempfile::tempdir().unwrap();
    let o = launcher(&[
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.05",
        "--log-dir",
        logs.path().to_str().unwrap(),
        "--tee",
        "3",
        &script("crash.py"),
    ])
    .output()
    .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(7), "{out}\n{err}");
    for attempt in 0..3 {
        assert!(out.contains(&format!("attempt {attempt} rank 1")), "{out}");
    }
    assert!(
        err.contains("restarting the group (1/2)") && err.contains("restarting the group (2/2)"),
        "{err}"
    );
    assert!(err.contains("Root Cause (first observed failure)"), "{err}");
    assert!(
        err.contains("rank      : 1 (local_rank: 1)") && err.contains("exitcode  : 7"),
        "{err}"
    );
    assert!(err.contains("traceback : ValueError: rank 1 is broken"), "{err}");
    assert!(err.contains("about to fail"), "stderr tail in the summary: {err}");
    // Per-rank log files under --log-dir, one folder per attempt.
    let log = logs.path().join("none/attempt_2/1/stderr.log");
    assert!(std::fs::read_to_string(&log).unwrap().contains("about to fail"));
    assert!(logs.path().join("none/attempt_0/0/stdout.log").is_file());
}

#[test]
fn oom_death_relaunches_with_half_the_micro_batch() {
    let o = launcher(&[
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.05",
        &script("oom.py"),
    ])
    .env("OOMGUARD_MICRO_BATCH_SIZE", "16")
    .output()
    .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    // Whichever rank dies first stops the other, maybe before it printed: either will do.
    for mb in [16, 8, 4] {
        assert!(out.contains(&format!(" micro-batch {mb}\n")), "{out}");
    }
    assert!(!out.contains("micro-batch 2"), "{out}");
    assert!(
        err.contains("relaunching with OOMGUARD_MICRO_BATCH_SIZE=8") && err.contains("OOMGUARD_MICRO_BATCH_SIZE=4"),
        "{err}"
    );
}

/// A script that prints its micro-batch on stdout (Python's print) is understood: after its
/// out-of-memory death the relaunch halves that size, until it fits.
#[test]
fn micro_batch_printed_on_stdout_is_halved_after_an_oom() {
    let o = launcher(&[
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.05",
        &script("oom_print.py"),
    ])
    .env_remove("OOMGUARD_MICRO_BATCH_SIZE")
    .output()
    .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        err.contains("relaunching with OOMGUARD_MICRO_BATCH_SIZE=128") && err.contains("OOMGUARD_MICRO_BATCH_SIZE=64"),
        "{err}"
    );
    assert!(out.contains("micro_batch_size=64"), "{out}");
}

/// A worker that grew back past the launcher's micro-batch and then died of an OOM there is
/// relaunched at half the size it last reported, not half the one the launcher set.
#[test]
fn an_oom_after_growing_back_halves_the_size_reported_last() {
    let o = launcher(&[
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.05",
        &script("oom_grew.py"),
    ])
    .env("OOMGUARD_MICRO_BATCH_SIZE", "8")
    .output()
    .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("relaunching with OOMGUARD_MICRO_BATCH_SIZE=16"), "{err}");
    assert!(out.contains("oomguard: micro_batch_size=16\n"), "{out}");
}

/// A memory cgroup of `limit` bytes under this process's own, as (its folder, the file a
/// process joins it through); None where this process cannot make one (not root, no memory
/// controller).
fn memory_cgroup(limit: u64) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let name = format!("oomguard-test-{}", std::process::id());
    // cgroup v1's memory controller, else v2's (where memory is delegated to children).
    if let Some(path) = own
        .lines()
        .find_map(|l| l.split_once(":memory:").map(|(_, p)| p.to_string()))
    {
        let dir = std::path::Path::new("/sys/fs/cgroup/memory")
            .join(path.trim_start_matches('/'))
            .join(name);
        std::fs::create_dir(&dir).ok()?;
        if std::fs::write(dir.join("memory.limit_in_bytes"), limit.to_string()).is_err() {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        return Some((dir.clone(), dir.join("tasks")));
    }
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let parent = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    if !std::fs::read_to_string(parent.join("cgroup.subtree_control"))
        .ok()?
        .contains("memory")
    {
        return None;
    }
    let dir = parent.join(name);
    std::fs::create_dir(&dir).ok()?;
    if std::fs::write(dir.join("memory.max"), limit.to_string()).is_err() {
        let _ = std::fs::remove_dir(&dir);
        return None;
    }
    Some((dir.clone(), dir.join("cgroup.procs")))
}

/// A worker the kernel's OOM killer kills (its cgroup's limit: no message, only SIGKILL) is
/// an out-of-memory death: relaunched at half its micro-batch, not as a crash at the same
/// size. Needs a memory cgroup this test can make (root, as CI runs).
#[test]
fn a_worker_the_kernels_oom_killer_kills_is_relaunched_at_half_the_micro_batch() {
    let Some((dir, tasks)) = memory_cgroup(64 << 20) else {
        eprintln!("skipped: no memory cgroup can be made here (not root, or no memory controller)");
        return;
    };
    let o = launcher(&[
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.05",
        &script("oom_killed.py"),
    ])
    .env("OOMGUARD_MICRO_BATCH_SIZE", "16")
    .env("OOMTEST_TASKS", &tasks)
    .output()
    .unwrap();
    let _ = std::fs::remove_dir(&dir);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("was killed by the kernel's OOM killer"), "{err}");
    assert!(err.contains("relaunching with OOMGUARD_MICRO_BATCH_SIZE=8"), "{err}");
    assert!(
        out.contains("oomguard: micro_batch_size=8\n") && out.contains("fits"),
        "{out}"
    );
}

/// Processes whose environment holds OOMGUARD_TEST_MARKER=`marker` (inherited by the
/// launcher, its workers and theirs).
fn processes_with(marker: &str) -> Vec<u32> {
    let needle = format!("OOMGUARD_TEST_MARKER={marker}");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|c| String::from_utf8_lossy(&c).contains(&needle))
                .unwrap_or(false)
        })
        .collect()
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Two workers that each start two children of their own; then the launcher is signalled
/// (or killed), or one worker crashes. Nothing may be left behind.
fn leaves_nothing_behind(how: &str, marker: &str) {
    let crash = "sleep 300 & sleep 301 & if [ \"$LOCAL_RANK\" = 1 ]; then sleep 0.2; exit 3; fi; wait";
    let body = if how == "crash" {
        crash
    } else {
        "sleep 300 & sleep 301 & wait"
    };
    let mut child = launcher(&[
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.05",
        "--no-python",
        "sh",
        "-c",
        body,
    ])
    .env("OOMGUARD_TEST_MARKER", marker)
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    // The launcher, and for each worker its shim, the shell and the shell's two children.
    wait_until("the workers", || processes_with(marker).len() >= 9);
    if how != "crash" {
        Command::new("kill")
            .args([how, &child.id().to_string()])
            .status()
            .unwrap();
    }
    let status = child.wait().unwrap();
    match how {
        "-TERM" => assert_eq!(status.code(), Some(143)),
        "-INT" => assert_eq!(status.code(), Some(130)),
        "crash" => assert_eq!(status.code(), Some(3)),
        _ => {}
    }
    wait_until(&format!("every process of case {marker} ({how}) to be gone"), || {
        processes_with(marker).is_empty()
    });
}

/// 50 cases of launcher kill -9, SIGTERM, SIGINT and a worker crash, with workers that start
/// processes of their own: 0 processes left behind. (On SIGKILL the launcher can do nothing:
/// each worker's shim sees it die and kills the worker's whole process group.)
#[test]
fn launcher_deaths_and_worker_crashes_leave_no_process_behind() {
    for case in 0..50 {
        let how = ["-KILL", "-TERM", "-INT", "crash"][case % 4];
        leaves_nothing_behind(how, &format!("oomguard-test-marker-{}-{case}", std::process::id()));
    }
}

/// torchrun's default `--signals-to-handle` (SIGINT, SIGTERM, SIGHUP, SIGQUIT): each reaches
/// every worker, which can act on it (a trap here), and the launcher exits with 128 + it.
#[test]
fn each_forwarded_signal_reaches_every_worker() {
    for (sig, name) in [(libc::SIGHUP, "HUP"), (libc::SIGQUIT, "QUIT"), (libc::SIGTERM, "TERM")] {
        let dir = tempfile::tempdir().unwrap();
        // The trap runs once the shell's foreground `sleep` ends (the group's signal ends it).
        let body = format!(
            "trap 'echo {name} > got-$LOCAL_RANK; exit 0' {name}; touch up-$LOCAL_RANK; while :; do sleep 0.05; done"
        );
        let mut child = launcher(&["--nproc-per-node", "2", "--no-python", "sh", "-c", &body])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let up = |r: u32| dir.path().join(format!("up-{r}")).exists();
        wait_until("both workers' traps", || up(0) && up(1));
        unsafe { libc::kill(child.id() as i32, sig) };
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(128 + sig), "SIG{name}");
        for r in 0..2 {
            let got = std::fs::read_to_string(dir.path().join(format!("got-{r}")));
            assert_eq!(
                got.ok().as_deref(),
                Some(format!("{name}\n").as_str()),
                "SIG{name}, rank {r}"
            );
        }
    }
}

#[test]
fn python_script_and_module_modes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("hello.py"),
        "import os; print('hello', os.environ['RANK'])",
    )
    .unwrap();
    let o = launcher(&["--nproc_per_node=2", "hello.py"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("[default0]:hello 0") && out.contains("[default1]:hello 1"),
        "{out}"
    );
    let o = launcher(&["-m", "hello"])
        .current_dir(dir.path())
        .env("PYTHONPATH", dir.path())
        .env("PET_NPROC_PER_NODE", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(
        text(&o).0.contains("[default0]:hello 0") && !text(&o).0.contains("hello 1"),
        "{:?}",
        text(&o)
    );
}

/// `oomguard train` with the guard off dies of a real OOM under its budget; the launcher
/// relaunches it with half the micro-batch, which it honours, and the run completes.
#[test]
fn oomguard_train_relaunched_at_half_after_an_unrecovered_oom() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tiny.yaml");
    std::fs::write(&cfg, "
model: {n_layer: 2, n_head: 2, n_embd: 32, block_size: 32, vocab_size: 256}
data: {source: embedded, embedded_bytes: 65536}
train: {micro_batch_size: 8, grad_accum_steps: 2, max_steps: 4, eval_every: 0, eval_batch_size: 2, eval_batches: 1, seed: 7, device: cpu, num_threads: 1}
memory: {guard: false, budget: 1275000}
").unwrap();
    let run = dir.path().join("run");
    let o = train_under_launch(dir.path(), &cfg, &run, &["--resume"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("ran out of memory at micro_batch_size=8"), "{err}");
    assert!(err.contains("relaunching with OOMGUARD_MICRO_BATCH_SIZE=4"), "{err}");
    // The relaunched run knows which size killed its predecessor, and lets it cool down.
    assert!(
        err.contains("starting at micro-batch 4 (8 ran out of memory before the relaunch: it cools down)"),
        "{err}"
    );
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["event"] == "step")
        .collect();
    assert_eq!(steps.len(), 4);
    assert!(steps
        .iter()
        .all(|s| s["micro_batch_size"].as_u64().unwrap() <= 4 && s["num_samples"] == 16));
}

/// A worker that recovered from an OOM (its traceback printed, 16 -> 8) and later failed
/// for another reason is relaunched at the micro-batch it was running at, not half of it:
/// only the error that ended it counts.
#[test]
fn a_recovered_oom_then_another_crash_restarts_at_the_same_micro_batch() {
    let o = launcher(&[
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.05",
        &script("recovered_then_crash.py"),
    ])
    .env("OOMGUARD_MICRO_BATCH_SIZE", "16")
    .output()
    .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("attempt 1 micro_batch_size=8"), "{out}\n{err}");
    assert!(
        err.contains("restarting the group (1/2)")
            && !err.contains("out of memory; restarting")
            && err.contains("relaunching with OOMGUARD_MICRO_BATCH_SIZE=8")
            && !err.contains("OOMGUARD_MICRO_BATCH_SIZE=4"),
        "{err}"
    );
}

/// Exit 3 (does not fit even at micro-batch 1) is not restarted: restarts cannot help.
#[test]
fn exit_3_is_not_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("huge.yaml");
    std::fs::write(&cfg, "
model: {n_layer: 2, n_head: 2, n_embd: 32, block_size: 32, vocab_size: 10000000}
data: {source: embedded, embedded_bytes: 65536}
train: {micro_batch_size: 8, grad_accum_steps: 2, max_steps: 4, eval_every: 0, eval_batch_size: 2, eval_batches: 1, seed: 7, device: cpu, num_threads: 1}
memory: {budget: 256MiB}
").unwrap();
    let o = train_under_launch(dir.path(), &cfg, &dir.path().join("run"), &[]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(3), "{out}\n{err}");
    assert!(!err.contains("restarting the group"), "{err}");
    assert!(
        err.contains("exited 3: it does not fit in memory even at micro-batch 1"),
        "{err}"
    );
    assert!(
        err.contains("vocab"),
        "the planner's message (what would fit) is shown: {err}"
    );
}

/// SIGTERM to the launcher: the workers get --shutdown-timeout to finish (a checkpoint being
/// written) before SIGKILL; torchrun's default is 30 s, 0 kills at once.
#[test]
fn workers_get_the_shutdown_timeout_after_sigterm() {
    for (timeout, written) in [("10", true), ("0", false)] {
        let dir = tempfile::tempdir().unwrap();
        let done = dir.path().join("done");
        let child = launcher(&[
            "--shutdown-timeout",
            timeout,
            "--monitor-interval",
            "0.05",
            &script("slow_exit.py"),
        ])
        .env("SLOW_EXIT_S", "1.5")
        .env("DONE_FILE", &done)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        let pid = child.id();
        let ready = dir.path().join("done.ready");
        wait_until("the worker's SIGTERM handler", || ready.exists());
        Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(143), "{:?}", text(&o));
        assert_eq!(done.exists(), written, "--shutdown-timeout {timeout}: {:?}", text(&o));
    }
}

/// A worker that writes its OOMGUARD_RUN_TOKEN to OUT/token.NODE.LOCAL_RANK and chats on both
/// streams (so the launcher's output and the log files have something to be grepped).
const TOKEN_WORKER: &str = r#"printf %s "$OOMGUARD_RUN_TOKEN" > "$OUT/token.$GROUP_RANK.$LOCAL_RANK"; echo "rank $RANK up"; echo "rank $RANK err" >&2"#;

/// The tokens the workers of a launch wrote under `dir`, by file name.
fn tokens(dir: &std::path::Path) -> std::collections::BTreeMap<String, String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("token."))
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read_to_string(e.path()).unwrap(),
            )
        })
        .collect()
}

/// Every file under `dir`, read, with its path.
fn files_under(dir: &std::path::Path) -> Vec<(PathBuf, String)> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push((
                p.clone(),
                String::from_utf8_lossy(&std::fs::read(&p).unwrap()).into_owned(),
            ));
        }
    }
    out
}

/// A token the launcher made: 64 hex digits (256 bits), and nothing of the --rdzv-id.
fn assert_random(token: &str, id: &str) {
    assert!(
        token.len() >= 32 && token.chars().all(|c| c.is_ascii_hexdigit()) && !token.contains(id),
        "not a random token: {token:?}"
    );
}

/// No token given: each launch makes its own, the same for its workers, different from the
/// last launch's, never the --rdzv-id, and never printed.
#[test]
fn each_launch_gets_a_random_token_that_is_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    let mut seen = vec![];
    for launch in ["a", "b"] {
        let out = dir.path().join(launch);
        std::fs::create_dir(&out).unwrap();
        let o = launcher(&[
            "--nproc-per-node",
            "2",
            "--rdzv-id",
            "job-7",
            "--no-python",
            "sh",
            "-c",
            TOKEN_WORKER,
        ])
        .env("OUT", &out)
        .env_remove("OOMGUARD_RUN_TOKEN")
        .output()
        .unwrap();
        let (stdout, stderr) = text(&o);
        assert!(o.status.success(), "{stderr}");
        assert!(stdout.contains("rank 1 up"), "{stdout}");
        let t = tokens(&out);
        assert_eq!(t.keys().collect::<Vec<_>>(), ["token.0.0", "token.0.1"], "{stderr}");
        assert_eq!(t["token.0.0"], t["token.0.1"], "one launch, one token");
        assert_random(&t["token.0.0"], "job-7");
        assert!(!stdout.contains(&t["token.0.0"]) && !stderr.contains(&t["token.0.0"]));
        seen.push(t["token.0.0"].clone());
    }
    assert_ne!(seen[0], seen[1], "two launches, one token");
}

/// One node's launcher of a 2-node run on loopback at `port`, its workers running TOKEN_WORKER
/// into `out`, logs (tee'd) under `out/logs.NODE`.
fn node(rank: &str, port: u16, out: &std::path::Path, token: Option<&str>) -> Command {
    let logs = out.join(format!("logs.{rank}"));
    let port = port.to_string();
    let mut c = launcher(&[
        "--nnodes",
        "2",
        "--node-rank",
        rank,
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port,
        "--rdzv-id",
        "job-9",
        "--monitor-interval",
        "0.05",
        "--tee",
        "3",
        "--log-dir",
        logs.to_str().unwrap(),
        "--no-python",
        "sh",
        "-c",
        TOKEN_WORKER,
    ]);
    c.env("OUT", out).stdout(Stdio::piped()).stderr(Stdio::piped());
    match token {
        Some(t) => c.env("OOMGUARD_RUN_TOKEN", t),
        None => c.env_remove("OOMGUARD_RUN_TOKEN"),
    };
    c
}

/// The secret two nodes' launchers share in the tests (OOMGUARD_RUN_TOKEN), as a user's would
/// be: several nodes need one.
const SECRET: &str = "Our-Own-Secret-4f9c2a71d0";

/// Two nodes on loopback with the same OOMGUARD_RUN_TOKEN: all four workers get it, and it
/// shows in no output or log file. The coordinator listens on --master-addr only. Strangers
/// at its port (garbage, one that leaves without a word, a hello without the proof that it
/// knows the secret, with this run's id or another's) are refused and logged with their
/// address; what they hear names the variable but neither the run's id nor the secret; the
/// run goes on.
#[test]
fn two_nodes_share_the_token_and_strangers_are_refused() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let port = port_pair();
    let node0 = node("0", port, dir.path(), Some(SECRET)).spawn().unwrap();
    let connect = || std::net::TcpStream::connect(("127.0.0.1", port + 1));
    wait_until("node 0's coordinator", || !listeners(port + 1).is_empty());
    let l = listeners(port + 1);
    assert!(
        l.iter().all(|a| a == &format!("0100007F:{:04X}", port + 1)),
        "the coordinator listens beyond --master-addr: {l:?}"
    );
    let mut garbage = connect().unwrap();
    garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let silent = connect().unwrap();
    let mut heard = vec![];
    let mut strangers = vec![];
    for id in ["another-job", "job-9"] {
        let mut s = connect().unwrap();
        s.write_all(format!("{{\"msg\":\"hello\",\"id\":\"{id}\",\"node\":1,\"micro\":null}}\n").as_bytes())
            .unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut h = String::new();
        s.read_to_string(&mut h).unwrap();
        assert!(h.contains("refused") && h.contains("OOMGUARD_RUN_TOKEN"), "{id}: {h}");
        assert!(!h.contains("job-9") && !h.contains("welcome"), "{id}: {h}");
        heard.push(h);
        strangers.push(s);
    }
    // The silent one leaves; the others stay connected while the run goes on.
    let quiet = silent.local_addr().unwrap().to_string();
    drop(silent);
    let node1 = node("1", port, dir.path(), Some(SECRET)).spawn().unwrap();
    let outs = [node0, node1].map(|n| n.wait_with_output().unwrap());
    for (i, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "node {i}: {:?}", text(o));
    }
    let t = tokens(dir.path());
    assert_eq!(t.len(), 4, "{t:?}");
    assert!(t.values().all(|v| v == SECRET), "the nodes' workers disagree: {t:?}");
    assert!(heard.iter().all(|h| !h.contains(SECRET)), "a stranger heard the token");
    let (_, log0) = text(&outs[0]);
    let addr = |s: &std::net::TcpStream| s.local_addr().unwrap().to_string();
    for (what, at) in [
        ("garbage", addr(&garbage)),
        ("silent", quiet),
        ("another run", addr(&strangers[0])),
        ("this run's id", addr(&strangers[1])),
    ] {
        assert!(
            log0.lines().any(|l| l.contains("WARN") && l.contains(&at)),
            "no warning names the {what} stranger at {at}: {log0}"
        );
    }
    let logs = files_under(dir.path());
    assert!(
        logs.iter()
            .any(|(p, f)| p.ends_with("stdout.log") && f.contains("rank 3 up")),
        "{logs:?}"
    );
    for (i, o) in outs.iter().enumerate() {
        let (stdout, stderr) = text(o);
        assert!(stdout.contains("up"), "node {i}: {stdout}");
        assert!(
            !stdout.contains(SECRET) && !stderr.contains(SECRET),
            "node {i} printed the token"
        );
    }
    for (p, f) in logs
        .iter()
        .filter(|(p, _)| !p.file_name().unwrap().to_string_lossy().starts_with("token."))
    {
        assert!(!f.contains(SECRET), "{} holds the token", p.display());
    }
}

/// OOMGUARD_RUN_TOKEN in the launchers' environment is the token on every node, and node 0's
/// coordinator requires proof of it: a node without one is refused at its start (exit 2,
/// naming the fix), a node with another is refused by node 0 (exit 2, naming the variable,
/// neither value), before any worker starts, and the run goes on with the node that has it.
/// A token that cannot be one exits 2.
#[test]
fn a_token_given_in_the_environment_is_every_nodes_and_required() {
    let dir = tempfile::tempdir().unwrap();
    let port = port_pair();
    let node0 = node("0", port, dir.path(), Some(SECRET)).spawn().unwrap();
    let bare = node("1", port, dir.path(), None).output().unwrap();
    let (_, err) = text(&bare);
    assert_eq!(bare.status.code(), Some(2), "{err}");
    assert!(
        err.contains("OOMGUARD_RUN_TOKEN: is unset, and a job over several nodes (--nnodes 2) needs it")
            && err.contains("export OOMGUARD_RUN_TOKEN=$(openssl rand -hex 32)"),
        "{err}"
    );
    let other = "Another-Secret-77d3e1c0b2";
    let wrong = node("1", port, dir.path(), Some(other)).output().unwrap();
    let (_, err) = text(&wrong);
    assert_eq!(wrong.status.code(), Some(2), "{err}");
    assert!(
        err.contains("node 0's launcher refused this node")
            && err.contains("does not prove that it knows")
            && err.contains("OOMGUARD_RUN_TOKEN"),
        "{err}"
    );
    assert!(
        !err.contains(SECRET) && !err.contains(other),
        "the refusal names a token: {err}"
    );
    assert!(
        tokens(dir.path()).is_empty(),
        "workers started: {:?}",
        tokens(dir.path())
    );
    let node1 = node("1", port, dir.path(), Some(SECRET)).spawn().unwrap();
    let outs = [node0, node1].map(|n| n.wait_with_output().unwrap());
    for (i, o) in outs.iter().enumerate() {
        let (stdout, stderr) = text(o);
        assert!(o.status.success(), "node {i}: {stderr}");
        assert!(
            !stdout.contains(SECRET) && !stderr.contains(SECRET),
            "node {i} printed the token"
        );
    }
    let (_, log0) = text(&outs[0]);
    assert!(!log0.contains(other), "node 0 logged the other token: {log0}");
    let t = tokens(dir.path());
    assert_eq!(t.len(), 4, "{t:?}");
    assert!(t.values().all(|v| v == SECRET), "{t:?}");
    for bad in ["", "short", "two words and more text"] {
        let o = launcher(&["--no-python", "true"])
            .env("OOMGUARD_RUN_TOKEN", bad)
            .output()
            .unwrap();
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {err}");
        assert!(err.contains("OOMGUARD_RUN_TOKEN"), "{err}");
        assert!(bad.is_empty() || !err.contains(bad), "{err}");
    }
}

/// A job over several nodes without OOMGUARD_RUN_TOKEN is refused at its start, on every node
/// and elastic too: exit 2, naming the variable and how to make one, no worker started and
/// nothing listening. One node (`--nnodes 1`, `--standalone`) needs none, as before.
#[test]
fn several_nodes_without_the_secret_are_refused_at_start() {
    let port = port_pair();
    let (p, endpoint) = (port.to_string(), format!("127.0.0.1:{port}"));
    let elastic = [
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
    ];
    let cases: [&[&str]; 3] = [
        &["--nnodes", "2", "--node-rank", "0", "--master-port", &p],
        &["--nnodes", "2", "--node-rank", "1", "--master-port", &p],
        &elastic,
    ];
    for flags in cases {
        let mut args = flags.to_vec();
        args.extend(["--nproc-per-node", "1", "--no-python", "sh", "-c", "echo started"]);
        let o = launcher(&args).env_remove("OOMGUARD_RUN_TOKEN").output().unwrap();
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {err}");
        assert!(
            err.contains(&format!(
                "OOMGUARD_RUN_TOKEN: is unset, and a job over several nodes (--nnodes {}) needs it",
                flags[1]
            )) && err.contains("export OOMGUARD_RUN_TOKEN=$(openssl rand -hex 32)"),
            "{flags:?}: {err}"
        );
        assert!(!out.contains("started"), "{flags:?}: a worker started: {out}");
        assert_eq!(
            (listeners(port), listeners(port + 1)),
            (vec![], vec![]),
            "{flags:?}: something listens"
        );
    }
    for flags in [&["--nnodes", "1"][..], &["--standalone"]] {
        let mut args = flags.to_vec();
        args.extend(["--no-python", "sh", "-c", "echo started"]);
        let o = launcher(&args).env_remove("OOMGUARD_RUN_TOKEN").output().unwrap();
        let (out, err) = text(&o);
        assert!(o.status.success() && out.contains("started"), "{flags:?}: {err}");
    }
}

/// Everything `from` sends until it closes the connection (30 s at most), as lines.
fn heard_all(mut from: &std::net::TcpStream) -> Vec<String> {
    use std::io::Read;
    from.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut heard = String::new();
    from.read_to_string(&mut heard).unwrap();
    heard.lines().map(str::to_string).collect()
}

/// An elastic job (`--nnodes 1:2`, the default --rdzv-id `none`) running at world 1, and
/// strangers at its rendezvous as a short client would be: one sends a launcher's hello at
/// once (the run's id, a port of its own: before this, that was enough to be handed the
/// run's token, a node rank and the workers' store address, and to restart the job at world
/// 2), one answers the challenge with a made-up proof, one opens with another message. Each
/// hears the challenge and at most a refusal naming OOMGUARD_RUN_TOKEN: no welcome, no go,
/// no rank, no store address, not the secret. The job is not restarted (its one worker
/// started once, at world 1) and ends 0; node 0's log names each stranger's address.
#[test]
fn a_stranger_at_an_elastic_rendezvous_gets_nothing_and_restarts_nothing() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let port = port_pair();
    let worker = r#"echo "$TORCHELASTIC_RESTART_COUNT $WORLD_SIZE $GROUP_RANK" >> "$OUT/starts"; while [ ! -e "$OUT/go-on" ]; do sleep 0.05; done"#;
    let endpoint = format!("127.0.0.1:{port}");
    let host = launcher(&[
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--nproc-per-node",
        "1",
        "--monitor-interval",
        "0.05",
        "--no-python",
        "sh",
        "-c",
        worker,
    ])
    .env("OUT", dir.path())
    .env("OOMGUARD_RUN_TOKEN", SECRET)
    .env("PET_RDZV_CONF", "last_call_timeout=1")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let starts = dir.path().join("starts");
    wait_until("the first round's worker", || starts.exists());
    let connect = || std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let eager = connect();
    (&eager)
        .write_all(b"{\"msg\":\"hello\",\"id\":\"none\",\"node\":0,\"micro\":null,\"port\":40000}\n")
        .unwrap();
    let polite = connect();
    let mut challenge = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(&polite), &mut challenge).unwrap();
    assert!(
        challenge.starts_with("{\"msg\":\"challenge\",\"nonce\":\""),
        "{challenge}"
    );
    let made_up = format!(
        "{{\"msg\":\"hello\",\"id\":\"none\",\"node\":0,\"micro\":null,\"port\":40001,\"nonce\":\"{}\",\"proof\":\"{}\"}}\n",
        "ab".repeat(32),
        "cd".repeat(32)
    );
    (&polite).write_all(made_up.as_bytes()).unwrap();
    let other = connect();
    (&other)
        .write_all(b"{\"msg\":\"stopped\",\"round\":1,\"port\":40002}\n")
        .unwrap();
    let mut heard = vec![];
    for (what, s) in [
        ("eager", &eager),
        ("made-up proof", &polite),
        ("another message", &other),
    ] {
        let mut lines = heard_all(s);
        if what == "made-up proof" {
            lines.insert(0, challenge.trim_end().to_string()); // read above
        }
        let kinds: Vec<String> = lines
            .iter()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["msg"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        let want: &[&str] = match what {
            "another message" => &["challenge"],
            _ => &["challenge", "refused"],
        };
        assert_eq!(kinds, want, "{what}: {lines:?}");
        let all = lines.concat();
        for never in [SECRET, "token", "welcome", "layout", "master_addr", "node_rank"] {
            assert!(!all.contains(never), "{what} heard {never:?}: {all}");
        }
        if want.len() == 2 {
            assert!(
                all.contains("does not prove that it knows") && all.contains("OOMGUARD_RUN_TOKEN"),
                "{all}"
            );
        }
        heard.push((what, s.local_addr().unwrap().to_string()));
    }
    // Room for a restart to show, had one begun; then the worker ends.
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::write(dir.path().join("go-on"), "").unwrap();
    let o = host.wait_with_output().unwrap();
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(
        std::fs::read_to_string(&starts).unwrap(),
        "0 1 0\n",
        "the job restarted: {err}"
    );
    assert!(!err.contains("a node joined") && !err.contains("round 1"), "{err}");
    for (what, at) in heard {
        assert!(
            err.lines().any(|l| l.contains("WARN") && l.contains(&at)),
            "no warning names the {what} stranger at {at}: {err}"
        );
    }
    assert!(!err.contains(SECRET), "{err}");
}

/// The threads of process `pid` now (/proc/PID/task).
fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count())
}

/// The most connections node 0's coordinator holds at once that have not proven that they
/// know the run's secret, each with its thread while it waits (crates/launch's MAX_PENDING,
/// docs/launcher.md).
const MAX_PENDING: usize = 64;

/// A flood of 300 idle connections (opened and held, never a byte) at node 0's coordinator
/// while it waits for node 1: once it is in, node 0 has exactly MAX_PENDING threads more (a
/// thread a connection, before: 300), and while it came in at most 8 more than that (threads
/// that gave their share back and that the OS was still tearing down: 2 at most seen); node 1, started into the flood, joins (every worker of both nodes started)
/// within a few seconds, and the run ends 0. Node 0's log warns about the flood in a bounded
/// number of lines, not one a connection.
#[test]
fn a_flood_of_idle_connections_neither_grows_threads_nor_delays_a_node() {
    let dir = tempfile::tempdir().unwrap();
    let port = port_pair();
    let node0 = node("0", port, dir.path(), Some(SECRET)).spawn().unwrap();
    let pid = node0.id();
    wait_until("node 0's coordinator", || !listeners(port + 1).is_empty());
    // Node 0's own launcher joins its coordinator: its threads settle.
    let t = Instant::now();
    let base = loop {
        let a = threads(pid);
        std::thread::sleep(Duration::from_millis(300));
        if a == threads(pid) {
            break a;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "node 0's threads never settle");
    };
    let mut most = base;
    let flood: Vec<std::net::TcpStream> = (0..300)
        .map(|i| {
            if i % 10 == 0 {
                most = most.max(threads(pid));
            }
            std::net::TcpStream::connect(("127.0.0.1", port + 1)).unwrap()
        })
        .collect();
    // Once the flood is in, idle: node 0 holds exactly MAX_PENDING of it, a thread each.
    let t = Instant::now();
    let held = loop {
        let a = threads(pid);
        most = most.max(a);
        std::thread::sleep(Duration::from_millis(300));
        if a == threads(pid) {
            break a;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "node 0's threads never settle");
    };
    assert_eq!(
        held,
        base + MAX_PENDING,
        "node 0 went from {base} threads to {held} under a flood of {} idle connections",
        flood.len()
    );
    assert!(
        most <= base + MAX_PENDING + 8,
        "node 0 peaked at {most} threads (from {base}) while the flood came in"
    );
    let t = Instant::now();
    let node1 = node("1", port, dir.path(), Some(SECRET)).spawn().unwrap();
    while tokens(dir.path()).len() < 4 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "node 1 did not join within 5 s of a flood: {:?}",
            tokens(dir.path())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let joined = t.elapsed();
    let outs = [node0, node1].map(|n| n.wait_with_output().unwrap());
    for (i, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "node {i}: {:?}", text(o));
    }
    let (_, log0) = text(&outs[0]);
    let warned: Vec<&str> = log0
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("launchers' coordinator"))
        .collect();
    assert!(
        warned
            .iter()
            .any(|l| l.contains("dropped a connection from 127.0.0.1:") && l.contains("the most it holds")),
        "{log0}"
    );
    // At most 10 lines every 10 s and a count of the others, over the flood's few seconds.
    assert!(
        warned.len() <= 2 * 11,
        "{} warnings about the flood: {log0}",
        warned.len()
    );
    eprintln!("base {base} threads, {held} under the idle flood, at most {most} while it came in; node 1 joined in {joined:?}");
    drop(flood);
}

/// A node's launcher checks the coordinator too: one at node 0's address that does not know
/// the secret (it answers the hello with a made-up welcome and a go) gets the hello's proof
/// and nothing else: not the secret, not a worker (exit 2, naming OOMGUARD_RUN_TOKEN).
#[test]
fn a_node_starts_nothing_for_a_coordinator_without_the_secret() {
    use std::io::{BufRead, Write};
    let dir = tempfile::tempdir().unwrap();
    let port = port_pair();
    let fake = std::net::TcpListener::bind(("127.0.0.1", port + 1)).unwrap();
    let node1 = node("1", port, dir.path(), Some(SECRET)).spawn().unwrap();
    let (s, _) = fake.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    (&s).write_all(format!("{{\"msg\":\"challenge\",\"nonce\":\"{}\"}}\n", "ef".repeat(32)).as_bytes())
        .unwrap();
    let mut hello = String::new();
    std::io::BufReader::new(&s).read_line(&mut hello).unwrap();
    let h: serde_json::Value = serde_json::from_str(&hello).unwrap();
    assert_eq!(
        (h["msg"].as_str(), h["id"].as_str(), h["node"].as_u64()),
        (Some("hello"), Some("job-9"), Some(1))
    );
    assert_eq!(h["proof"].as_str().map(str::len), Some(64), "{hello}");
    assert!(!hello.contains(SECRET) && !hello.contains("token"), "{hello}");
    (&s).write_all(
        format!(
            "{{\"msg\":\"welcome\",\"proof\":\"{}\"}}\n{{\"msg\":\"go\",\"round\":0,\"size\":null,\"failed\":null}}\n",
            "00".repeat(32)
        )
        .as_bytes(),
    )
    .unwrap();
    let o = node1.wait_with_output().unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("did not prove that it knows the run's secret (OOMGUARD_RUN_TOKEN)"),
        "{err}"
    );
    assert!(
        tokens(dir.path()).is_empty(),
        "workers started: {:?}",
        tokens(dir.path())
    );
}

/// Node 0's coordinator listens on --master-addr's address or not at all: an address that is
/// not this host's is a clear error (exit 2), not a listener on every interface.
#[test]
fn the_coordinator_does_not_listen_beyond_master_addr() {
    let port = port_pair().to_string();
    let o = launcher(&[
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "192.0.2.1",
        "--master-port",
        &port,
        "--no-python",
        "true",
    ])
    .env("OOMGUARD_RUN_TOKEN", SECRET)
    .output()
    .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cannot listen on 192.0.2.1") && err.contains("--master-addr must be an address of node 0's"),
        "{err}"
    );
}

/// A launcher waiting for the group (node 0 for its other node, node 1 for node 0, an elastic
/// node in its last call for more) ends at once on SIGTERM (143) or SIGINT (130), not after
/// the join timeout, and starts no worker.
#[test]
fn a_signal_ends_a_wait_for_the_group_at_once() {
    let port = port_pair().to_string();
    let endpoint = format!("127.0.0.1:{port}");
    let cases: [(&[&str], i32, i32); 3] = [
        (&["--nnodes", "2", "--master-port", &port], libc::SIGTERM, 143),
        (
            &["--nnodes", "2", "--node-rank", "1", "--master-port", &port],
            libc::SIGINT,
            130,
        ),
        (
            &[
                "--nnodes",
                "1:2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                &endpoint,
            ],
            libc::SIGTERM,
            143,
        ),
    ];
    for (flags, sig, code) in cases {
        let mut args = flags.to_vec();
        args.extend(["--nproc-per-node", "1", "--no-python", "sh", "-c", "echo started"]);
        let child = launcher(&args)
            .env("OOMGUARD_RUN_TOKEN", SECRET)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_until("the launcher's signal handlers", || catches(child.id(), sig));
        // SAFETY: a plain syscall.
        unsafe { libc::kill(child.id() as i32, sig) };
        let t = Instant::now();
        let o = child.wait_with_output().unwrap();
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(code), "{flags:?}: {err}");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{flags:?}: took {:?}",
            t.elapsed()
        );
        assert!(
            err.contains("while waiting for the group") && !out.contains("started"),
            "{err}"
        );
    }
}

/// Node 1 joined and waits with node 0 for a third node; node 1's launcher is stopped by
/// SIGTERM: node 0's stops at once with the same code (143: a requeue keyed on it works), not
/// 2 (bad input) nor after the join timeout, and neither starts a worker.
#[test]
fn a_signal_to_one_waiting_node_stops_the_others_with_its_code() {
    use std::io::BufRead;
    let port = port_pair().to_string();
    let spawn = |rank: &str| {
        launcher(&[
            "--nnodes",
            "3",
            "--node-rank",
            rank,
            "--master-port",
            &port,
            "--nproc-per-node",
            "1",
            "--no-python",
            "sh",
            "-c",
            "echo started",
        ])
        .env("OOMGUARD_RUN_TOKEN", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
    };
    let mut node0 = spawn("0");
    let mut node1 = spawn("1");
    let err1 = std::io::BufReader::new(node1.stderr.take().unwrap());
    let mut said = String::new();
    for line in err1.lines().map_while(Result::ok) {
        said.push_str(&line);
        said.push('\n');
        if line.contains("node 1 of 3: joined") {
            break;
        }
    }
    assert!(said.contains("node 1 of 3: joined"), "{said}");
    // SAFETY: a plain syscall.
    unsafe { libc::kill(node1.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    assert_eq!(node1.wait().unwrap().code(), Some(143));
    while node0.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = node0.kill(); // still waiting: the assertion below says how long
    let o = node0.wait_with_output().unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(143), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
    assert!(
        err.contains("the group stopped before it started")
            && err.contains("stopped by a signal")
            && !out.contains("started"),
        "{err}"
    );
}

/// Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc).
fn catches(pid: u32, sig: i32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mask = status.lines().find_map(|l| l.strip_prefix("SigCgt:")).map(str::trim);
    mask.and_then(|m| u64::from_str_radix(m, 16).ok())
        .is_some_and(|m| m & (1 << (sig - 1)) != 0)
}

/// What torchrun users' scripts do to the streams and the log folder: bytes that are not
/// UTF-8 and a progress bar redrawn with `\r` reach the console as they come (the worker
/// writes on after them); PET_* switches are `1` as torchrun reads them; a --log-dir used
/// by an earlier run that died of an OOM does not make this run's failure an OOM.
#[test]
fn any_bytes_a_redrawn_bar_numeric_switches_and_a_reused_log_dir() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("bytes.py"),
        "import sys\nsys.stdout.buffer.write(b'caf\\xe9\\n'); sys.stdout.flush()\n\
         for i in range(3): sys.stderr.write(f'\\r{i}/3'); sys.stderr.flush()\n\
         sys.stderr.write('\\n'); print('after', __name__, flush=True)\n",
    )
    .unwrap();
    let logs = dir.path().join("logs");
    let o = launcher(&["--log-dir", logs.to_str().unwrap(), "bytes.py"])
        .current_dir(dir.path())
        .env("PET_RUN_PATH", "1")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.contains("[default0]:caf\u{fffd}\n") && out.contains("[default0]:after __main__"),
        "{out}"
    );
    assert!(
        err.contains("[default0]:0/3\r[default0]:1/3\r[default0]:2/3\n"),
        "{err:?}"
    );

    let stale = logs.join("none/attempt_0/0/error.json");
    let oom = r#"{"message": {"message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}}"#;
    std::fs::write(&stale, oom).unwrap();
    std::fs::write(dir.path().join("fails.py"), "import sys; sys.exit(1)").unwrap();
    let o = launcher(&["--log-dir", logs.to_str().unwrap(), "fails.py"])
        .current_dir(dir.path())
        .env("OOMGUARD_MICRO_BATCH_SIZE", "16")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    assert!(
        !err.contains("out of memory") && !err.contains("Tried to allocate"),
        "{err}"
    );
}

/// A script's own exit 3 is not oomguard's "does not fit": it is restarted as any failure
/// (torchrun restarts it), and the launcher exits with it once no restart is left.
#[test]
fn a_scripts_own_exit_3_is_restarted() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("three.py"), "import sys; sys.exit(3)").unwrap();
    let o = launcher(&["--max-restarts", "1", "--monitor-interval", "0.05", "three.py"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(3), "{out}\n{err}");
    assert!(err.contains("restarting the group (1/1)"), "{err}");
    assert!(!err.contains("does not fit"), "{err}");
}
