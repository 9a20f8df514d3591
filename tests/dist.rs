//! Data-parallel training over c10d (Gloo on the CPU, shared memory in front of it for ranks on
//! one host), with real processes under the real launcher, one thread per rank: the same
//! result as one process and over either transport, an OOM on one rank shared
//! by all, two "nodes" over loopback, SIGINT and a resume, a rank killed and the group
//! restarted from the checkpoint.
mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A free port per launch whose next port is free too (several nodes' launchers meet at
/// --master-port + 1).
fn port() -> String {
    port_pair().to_string()
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_oomguard")
}

fn launch(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(bin());
    isolated(dies_with_test(&mut c), dir)
        .arg("launch")
        .args(["--master-port", &port(), "--monitor-interval", "0.05"])
        .args(args)
        .current_dir(dir)
        .env_remove("OMP_NUM_THREADS");
    c
}

fn ok(o: Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    err
}

/// A global batch of 15: shards of 8 and 7, micro-batches of 4 (uneven everywhere).
fn config(dir: &Path, steps: u64, extra: &str) -> PathBuf {
    uneven_config(dir, steps, extra)
}

fn train_args<'a>(cfg: &'a Path, run: &'a Path) -> Vec<&'a str> {
    vec![
        bin(),
        "train",
        cfg.to_str().unwrap(),
        "--run-dir",
        run.to_str().unwrap(),
    ]
}

#[test]
fn two_ranks_end_where_one_process_does() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 6, "memory: {budget: 64MiB}\n");
    let single = train_ok(dir.path(), &cfg, &[]);
    std::fs::rename(&single, dir.path().join("single")).unwrap();
    let run = dir.path().join("two");
    let mut args = vec!["--nproc-per-node", "2", "--no-python"];
    args.extend(train_args(&cfg, &run));
    let err = ok(launch(dir.path(), &args).output().unwrap());
    assert!(err.contains("rank 1 of 2 (shared memory) joined the group"), "{err}");
    let steps = records(&run, "step");
    assert_eq!(steps.len(), 6);
    assert!(
        steps.iter().all(|s| s["world_size"] == 2 && s["num_samples"] == 15),
        "{steps:?}"
    );
    let d = max_abs_diff(&weights(&dir.path().join("single")), &weights(&run));
    assert!(d < 1e-5, "2 ranks differ from 1 process by {d}");
    // The control plane as the cost model (docs/scaling.md) counts it: rank 0 of 2 sends
    // and receives one fixed message per exchange, a clean step's exchanges.
    use oomguard::dist::{cost::EXCHANGES_IN_STEP, exchange::MESSAGE_BYTES};
    let exchanged: Vec<_> = steps.iter().map(|s| s["exchange_bytes"].as_u64()).collect();
    assert!(
        exchanged
            .iter()
            .all(|&b| b == Some(EXCHANGES_IN_STEP * 2 * MESSAGE_BYTES)),
        "{exchanged:?}"
    );
    let (a, b) = (losses(&dir.path().join("single")), losses(&run));
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-5), "{a:?} {b:?}");
    // The shorthand: oomguard train CONFIG --nproc-per-node 2.
    let short = dir.path().join("short");
    let o = train_at(dir.path(), &cfg, &short, &["--nproc-per-node", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(max_abs_diff(&weights(&run), &weights(&short)), 0.0);
    // The same ranks over Gloo's loopback TCP, as across hosts: the same bits (at 2 ranks
    // both transports sum a + b).
    let tcp = dir.path().join("tcp");
    let mut args = vec!["--nproc-per-node", "2", "--no-python"];
    args.extend(train_args(&cfg, &tcp));
    let err = ok(launch(dir.path(), &args)
        .env("OOMGUARD_DIST_SHM", "0")
        .output()
        .unwrap());
    assert!(err.contains("rank 1 of 2 (gloo) joined the group"), "{err}");
    assert_eq!(max_abs_diff(&weights(&run), &weights(&tcp)), 0.0);
}

/// A budget on rank 1 alone: it runs out of memory, both ranks shrink together (no
/// deadlock), and the run ends where one process without a budget does.
#[test]
fn an_oom_on_one_rank_shrinks_both() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, budget) = at_8_with_a_budget_for_4(dir.path(), "");
    let single = train_ok(dir.path(), &cfg, &["--memory-budget", "none"]);
    let run = dir.path().join("two");
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then exec {b} train {c} --run-dir {r} --memory-budget {budget} --set memory.cooldown_steps=1000; else exec {b} train \
            {c} --run-dir {r} --memory-budget none --set memory.cooldown_steps=1000; fi",
        b = bin(), c = cfg.display(), r = run.display()
    );
    let t = Instant::now();
    let err = ok(launch(
        dir.path(),
        &["--nproc-per-node", "2", "--no-python", "sh", "-c", &script],
    )
    .output()
    .unwrap());
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
    assert!(err.contains("[default1]") && err.contains("OOM at step 0"), "{err}");
    let ooms = records(&run, "oom");
    assert!(
        ooms.iter().any(|o| o["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("rank 1 ran out of memory ("))),
        "rank 0 records the shared OOM: {ooms:?}"
    );
    // Both ranks run at the size rank 1 could afford (the step records are rank 0's).
    let sizes: Vec<_> = records(&run, "step")
        .iter()
        .map(|s| s["micro_batch_size"].as_u64().unwrap())
        .collect();
    assert!(sizes.iter().all(|&s| s == sizes[0] && s < 8), "{sizes:?}");
    let d = max_abs_diff(&weights(&single), &weights(&run));
    assert!(d < 1e-5, "differ by {d}");
}

/// The 2-rank config at micro-batch 8 (`extra` appended), and a budget that holds 4 but not 8.
fn at_8_with_a_budget_for_4(dir: &Path, extra: &str) -> (PathBuf, u64) {
    let cfg = config(dir, 4, extra);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let cfg = write_config(
        dir,
        "fixed.yaml",
        &text.replace("micro_batch_size: 4,", "micro_batch_size: 8,"),
    );
    let budget = budget_between_4_and_8(dir, &cfg);
    (cfg, budget)
}

/// A budget that holds micro-batch 4 of `cfg` but not 8.
fn budget_between_4_and_8(dir: &Path, cfg: &Path) -> u64 {
    let peak = |mb: &str| {
        let r = dir.join(format!("p{mb}"));
        let o = train_at(
            dir,
            cfg,
            &r,
            &[
                "--max-steps",
                "1",
                "--memory-budget",
                "none",
                "--set",
                &format!("train.micro_batch_size={mb}"),
            ],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        records(&r, "step")[0]["memory"]["peak_bytes"].as_u64().unwrap()
    };
    (peak("8") + peak("4")) / 2
}

/// Rank 1's micro-batch cache knows that 8 does not fit its budget, rank 0's cache is
/// empty: the ranks start at the smallest size any of them would take (4), with no OOM, and
/// end where one process does.
#[test]
fn ranks_whose_caches_disagree_start_at_the_smallest_size() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, budget) = at_8_with_a_budget_for_4(dir.path(), "memory: {cooldown_steps: 1000}\n");
    let single = train_ok(dir.path(), &cfg, &["--memory-budget", "none"]);
    // Rank 1's cache learns its size from a run under its budget.
    let (cache0, cache1) = (dir.path().join("cache0"), dir.path().join("cache1"));
    let learn = Command::new(bin())
        .args([
            "train",
            cfg.to_str().unwrap(),
            "--run-dir",
            "learn",
            "--max-steps",
            "1",
            "--memory-budget",
            &budget.to_string(),
        ])
        .current_dir(dir.path())
        .env("OOMGUARD_CACHE", &cache1)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        learn.status.success() && !records(&dir.path().join("learn"), "oom").is_empty(),
        "{}",
        stderr(&learn)
    );
    let run = dir.path().join("two");
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then export OOMGUARD_CACHE={c1}; B={budget}; else export OOMGUARD_CACHE={c0}; B=none; fi; exec {b} train {c} --run-dir \
            {r} --memory-budget $B",
        b = bin(), c = cfg.display(), r = run.display(), c0 = cache0.display(), c1 = cache1.display()
    );
    let err = ok(launch(
        dir.path(),
        &["--nproc-per-node", "2", "--no-python", "sh", "-c", &script],
    )
    .output()
    .unwrap());
    assert!(records(&run, "oom").is_empty(), "no rank ran out of memory: {err}");
    let sizes: Vec<_> = records(&run, "step")
        .iter()
        .map(|s| s["micro_batch_size"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [4, 4, 4, 4], "{err}");
    let d = max_abs_diff(&weights(&single), &weights(&run));
    assert!(d < 1e-5, "differ by {d}");
}

/// Two "nodes" (two launchers, one rank each) over loopback.
#[test]
fn two_nodes_over_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 4, "memory: {budget: 64MiB}\n");
    let single = train_ok(dir.path(), &cfg, &[]);
    let run = dir.path().join("nodes");
    // The token the ranks check in the store and at the exchange, given here so that it is
    // known: no launcher's or worker's output, and no file of the run, shows it.
    let secret = "loopback-secret-7c1e93b0a5";
    let nodes = two_node_commands(dir.path(), &cfg, &run, &[], &[], "none").map(|mut c| {
        c.env("OOMGUARD_RUN_TOKEN", secret)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    });
    for node in nodes {
        let o = node.wait_with_output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let err = ok(o);
        assert!(
            !out.contains(secret) && !err.contains(secret),
            "a node printed the token: {err}"
        );
    }
    for f in walk(&run) {
        let text = String::from_utf8_lossy(&std::fs::read(&f).unwrap()).into_owned();
        assert!(!text.contains(secret), "{} holds the token", f.display());
    }
    assert!(records(&run, "step").iter().all(|s| s["world_size"] == 2));
    assert!(max_abs_diff(&weights(&single), &weights(&run)) < 1e-5);
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        match e.path() {
            p if p.is_dir() => out.extend(walk(&p)),
            p => out.push(p),
        }
    }
    out
}

/// Node 0's and node 1's launchers (one rank each) on one port, over loopback.
fn two_nodes(dir: &Path, cfg: &Path, run: &Path, extra: &[&str], train_extra: &[&str], marker: &str) -> [Child; 2] {
    two_node_commands(dir, cfg, run, extra, train_extra, marker).map(|mut c| c.spawn().unwrap())
}

/// The commands of `two_nodes`, to be spawned.
fn two_node_commands(
    dir: &Path,
    cfg: &Path,
    run: &Path,
    extra: &[&str],
    train_extra: &[&str],
    marker: &str,
) -> [Command; 2] {
    let p = port();
    ["0", "1"].map(|rank| {
        let mut args = vec![
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &p,
            "--monitor-interval",
            "0.05",
        ];
        args.extend(extra);
        args.push("--no-python");
        args.extend(train_args(cfg, run));
        args.extend(train_extra);
        let mut c = Command::new(bin());
        isolated(dies_with_test(&mut c), dir)
            .arg("launch")
            .args(&args)
            .current_dir(dir)
            .env("OOMGUARD_TEST_MARKER", marker)
            // Several nodes need a secret of the user's, the same on each (docs/launcher.md).
            .env("OOMGUARD_RUN_TOKEN", "two-nodes-secret-5b2e8f14c9")
            .env("OMP_NUM_THREADS", "1");
        c.stdout(Stdio::null()).stderr(Stdio::piped());
        c
    })
}

/// kill -9 of node 1's worker: both nodes' launchers restart their workers in one round,
/// within seconds (not after the collective timeout), and the run resumes and completes.
#[test]
fn a_worker_death_on_one_node_restarts_every_node_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        40,
        "memory: {budget: 64MiB}\ncheckpoint: {every_steps: 5}\n",
    );
    let run = dir.path().join("nodes");
    let marker = format!("oomguard-nodes-kill-{}", std::process::id());
    let nodes = two_nodes(dir.path(), &cfg, &run, &["--max-restarts", "2"], &["--resume"], &marker);
    wait_for_steps(&run, 12);
    let (old0, old1) = (
        rank_process(&marker, "0").expect("rank 0"),
        rank_process(&marker, "1").expect("rank 1"),
    );
    assert!(Command::new("kill")
        .args(["-KILL", &old1.to_string()])
        .status()
        .unwrap()
        .success());
    let t = Instant::now();
    let fresh = |rank: &str, old: u32| rank_process(&marker, rank).is_some_and(|p| p != old);
    while !(fresh("0", old0) && fresh("1", old1)) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "both nodes' workers were not restarted within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let logs = nodes.map(|n| ok(n.wait_with_output().unwrap()));
    for (node, log) in logs.iter().enumerate() {
        assert!(
            log.contains("attempt 1:") && !log.contains("attempt 2:"),
            "node {node} restarted once: {log}"
        );
    }
    assert!(
        logs[0].contains("restart") && logs[0].contains("node 1"),
        "node 0 names node 1's failure: {}",
        logs[0]
    );
    assert_eq!(records(&run, "resumed").len(), 1);
    let steps: Vec<u64> = records(&run, "step")
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (0..40).collect::<Vec<_>>());
}

/// Ctrl-C on either node stops every node (with 130), and nothing restarts: on node 1, or on
/// node 0, whose launcher hosts the coordinator and stays until the stop is sent.
#[test]
fn ctrl_c_on_one_node_stops_every_node() {
    for victim in [1, 0] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), 200, "memory: {budget: 64MiB}\n");
        let run = dir.path().join("nodes");
        let nodes = two_nodes(dir.path(), &cfg, &run, &["--max-restarts", "3"], &[], "none");
        wait_for_steps(&run, 5);
        assert!(Command::new("kill")
            .args(["-INT", &nodes[victim].id().to_string()])
            .status()
            .unwrap()
            .success());
        let t = Instant::now();
        let outs = nodes.map(|n| n.wait_with_output().unwrap());
        assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
        for (node, o) in outs.iter().enumerate() {
            let log = String::from_utf8_lossy(&o.stderr);
            assert_eq!(
                o.status.code(),
                Some(130),
                "node {node} (signal to node {victim}): {log}"
            );
            assert!(!log.contains("attempt 1:"), "node {node} restarted: {log}");
        }
        let other = String::from_utf8_lossy(&outs[1 - victim].stderr).into_owned();
        assert!(
            other.contains(&format!("node {victim}'s launcher was stopped by a signal")),
            "{other}"
        );
    }
}

fn spawn_launch(dir: &Path, args: &[&str]) -> Child {
    launch(dir, args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// SIGINT to a 2-rank run: the ranks agree on the step to stop at, rank 0 writes one
/// checkpoint, and the resumed run ends bitwise where an uninterrupted one does.
#[test]
fn sigint_then_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 40, "memory: {budget: 64MiB}\n");
    let whole = dir.path().join("whole");
    let mut args = vec!["--nproc-per-node", "2", "--no-python"];
    args.extend(train_args(&cfg, &whole));
    ok(launch(dir.path(), &args).output().unwrap());

    let run = dir.path().join("run");
    let mut args = vec!["--nproc-per-node", "2", "--no-python"];
    args.extend(train_args(&cfg, &run));
    let child = spawn_launch(dir.path(), &args);
    wait_for_steps(&run, 5);
    assert!(Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", String::from_utf8_lossy(&out.stderr));
    let ckpts: Vec<_> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("step-"))
        .collect();
    assert_eq!(ckpts.len(), 1, "one consistent checkpoint");
    assert_eq!(records(&run, "stopped").len(), 1);
    args.push("--resume");
    ok(launch(dir.path(), &args).output().unwrap());
    assert_eq!(
        max_abs_diff(&weights(&whole), &weights(&run)),
        0.0,
        "resume is not exact"
    );
}

/// kill -9 of one rank: the launcher restarts the group, which resumes from the last
/// checkpoint, and the run completes.
#[test]
fn a_killed_rank_restarts_the_group_from_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        60,
        "memory: {budget: 64MiB}\ncheckpoint: {every_steps: 5}\n",
    );
    let run = dir.path().join("run");
    let marker = format!("oomguard-dist-kill-{}", std::process::id());
    let mut args = vec!["--nproc-per-node", "2", "--max-restarts", "2", "--no-python"];
    args.extend(train_args(&cfg, &run));
    args.push("--resume");
    let child = launch(dir.path(), &args)
        .env("OOMGUARD_TEST_MARKER", &marker)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_steps(&run, 12);
    let rank1 = rank_process(&marker, "1").expect("rank 1's process");
    assert!(Command::new("kill")
        .args(["-KILL", &rank1.to_string()])
        .status()
        .unwrap()
        .success());
    let err = ok(child.wait_with_output().unwrap());
    assert!(err.contains("restarting the group"), "{err}");
    let resumed = records(&run, "resumed");
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    let steps = records(&run, "step");
    assert_eq!(
        steps.iter().map(|s| s["step"].as_u64().unwrap()).collect::<Vec<_>>(),
        (0..60).collect::<Vec<_>>()
    );
}

/// The training process (not its shim) of rank `rank` of the launch marked `marker`.
fn rank_process(marker: &str, rank: &str) -> Option<u32> {
    let (m, r) = (format!("OOMGUARD_TEST_MARKER={marker}"), format!("RANK={rank}"));
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
            vars.contains(&m.as_bytes()) && vars.contains(&r.as_bytes())
        })
}
