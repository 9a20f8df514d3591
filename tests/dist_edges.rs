//! Data parallel at its edges, with real processes over Gloo (one thread per rank): a
//! global batch smaller than the world, a parameter some ranks leave unused, dropout
//! resumed exactly, and a deliberate collective mismatch that fails fast, naming both views.
mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_oomguard")
}

/// `oomguard train CONFIG --nproc-per-node 2 ARGS` (the launcher picks a free port).
fn two_ranks(dir: &Path, cfg: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(bin());
    isolated(dies_with_test(&mut c), dir)
        .args(["train", cfg.to_str().unwrap(), "--nproc-per-node", "2"])
        .args(args)
        .current_dir(dir)
        .env_remove("OMP_NUM_THREADS");
    c
}

/// Rank `rank` of 2 started by hand (no launcher) at `port`, its stderr piped.
fn by_hand(dir: &Path, cfg: &Path, port: &str, rank: &str, timeout_s: u32) -> Command {
    let mut c = Command::new(bin());
    isolated(dies_with_test(&mut c), dir)
        .args(["train", cfg.to_str().unwrap(), "--run-dir", "r", "--set"])
        .arg(format!("train.dist_timeout_s={timeout_s}"))
        .envs([
            ("RANK", rank),
            ("LOCAL_RANK", rank),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port),
            ("OMP_NUM_THREADS", "1"),
        ])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tiny(dir: &Path, name: &str, edit: impl Fn(String) -> String) -> PathBuf {
    write_config(dir, name, &edit(TINY.to_string()))
}

#[test]
fn a_global_batch_smaller_than_the_world_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), "one.yaml", |t| {
        t.replace(
            "micro_batch_size: 8, grad_accum_steps: 2",
            "micro_batch_size: 1, grad_accum_steps: 1",
        )
    });
    let o = two_ranks(dir.path(), &cfg, &["--check"]).output().unwrap();
    let err = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("train.global_batch_size") && err.contains("use a global batch of at least 2"),
        "{err}"
    );
    // Run for real, every rank refuses alike before any collective: no abort, no hang.
    let t = Instant::now();
    let o = two_ranks(dir.path(), &cfg, &["--run-dir", "r"]).output().unwrap();
    let err = text(&o);
    assert!(!o.status.success() && t.elapsed() < Duration::from_secs(60), "{err}");
    assert!(
        err.contains("use a global batch of at least 2")
            && !err.contains("SIGABRT")
            && !err.contains("size doesn't match"),
        "{err}"
    );
    // No stray run directories from the other rank.
    let o = two_ranks(
        dir.path(),
        &tiny(dir.path(), "two.yaml", |t| t.replace("max_steps: 6", "max_steps: 1")),
        &[],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let runs: Vec<_> = std::fs::read_dir(dir.path().join("runs/two"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(runs.len(), 1, "one run directory for both ranks: {runs:?}");
}

#[test]
fn dropout_resumes_exactly_on_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), "drop.yaml", |t| {
        t.replace("vocab_size: 256}", "vocab_size: 256, dropout: 0.1}")
            .replace("max_steps: 6", "max_steps: 8")
    });
    let whole = dir.path().join("whole");
    let o = two_ranks(dir.path(), &cfg, &["--run-dir", whole.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let run = dir.path().join("run");
    let o = two_ranks(
        dir.path(),
        &cfg,
        &[
            "--run-dir",
            run.to_str().unwrap(),
            "--max-steps",
            "3",
            "--set",
            "optim.decay_steps=8",
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let o = two_ranks(dir.path(), &cfg, &["--run-dir", run.to_str().unwrap(), "--resume"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        max_abs_diff(&weights(&whole), &weights(&run)),
        0.0,
        "resume with dropout is not exact"
    );
    assert_eq!(losses(&whole)[3..], losses(&run)[3..]);
}

/// A TorchScript model and its data from tests/scripts/NAME.py, and a config training it on
/// the CPU with `train` (the config's `train:` line).
fn torchscript_config(dir: &Path, name: &str, train: &str) -> PathBuf {
    let script = root().join(format!("tests/scripts/{name}.py"));
    let (model, data) = (format!("{name}.pt"), format!("{name}.safetensors"));
    let o = Command::new(root().join(".venv/bin/python3"))
        .arg(&script)
        .args(["--out", &model, "--data", &data])
        .current_dir(dir)
        .env("PYTHONWARNINGS", "ignore")
        .output()
        .expect("python3 from the set-up's venv");
    assert!(o.status.success(), "{}", text(&o));
    write_config(dir, &format!("{name}.yaml"), &format!(
        "model: {{kind: torchscript, path: {model}}}\ndata: {{source: tensors, path: {data}, val_fraction: 0.2}}\noptim: {{lr: 1.0e-2, warmup_steps: \
            2, decay_steps: 10}}\ntrain: {train}\n"
    ))
}

#[test]
fn a_parameter_unused_on_some_ranks_is_reduced_as_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = torchscript_config(
        dir.path(),
        "ts_branch",
        "{micro_batch_size: 2, global_batch_size: 8, max_steps: 10, eval_every: 0, eval_batch_size: \
        8, eval_batches: 1, seed: 3, device: cpu, num_threads: 1}",
    );
    let t = Instant::now();
    let o = two_ranks(dir.path(), &cfg, &["--run-dir", "r"])
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(t.elapsed() < Duration::from_secs(120));
    assert_eq!(records(&dir.path().join("r"), "step").len(), 10);
}

/// BatchNorm on 2 ranks, each rank's shard of different data: rank 0's running statistics
/// reach every rank after each step (DDP's broadcast_buffers), so after training both ranks
/// hold the same buffers and parameters, and evaluation and checkpoints see one set.
#[test]
fn batchnorm_buffers_are_equal_on_both_ranks_after_training() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = torchscript_config(
        dir.path(),
        "ts_bn",
        "{micro_batch_size: 4, global_batch_size: 16, max_steps: 8, eval_every: 4, eval_batch_size: 8, \
        eval_batches: 1, seed: 3, device: cpu, num_threads: 1}",
    );
    let o = two_ranks(dir.path(), &cfg, &["--run-dir", "r"])
        .env("OOMGUARD_TEST_RANK_WEIGHTS", "1")
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let run = dir.path().join("r");
    let (rank0, rank1) = (weights(&run), safetensors(&run.join("model.rank-1.safetensors")));
    let names: Vec<&str> = rank0.iter().map(|(n, _)| n.as_str()).collect();
    assert!(
        names.contains(&"bn.running_mean") && names.contains(&"bn.running_var"),
        "{names:?}"
    );
    let mean = &rank0.iter().find(|(n, _)| n == "bn.running_mean").unwrap().1;
    assert!(
        mean.abs().sum(tch::Kind::Double).double_value(&[]) > 0.0,
        "the statistics moved"
    );
    assert_eq!(
        max_abs_diff(&rank0, &rank1),
        0.0,
        "the ranks' parameters or buffers differ"
    );
}

#[test]
fn a_collective_mismatch_fails_fast_naming_both_views() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), "c.yaml", |t| t.replace("max_steps: 6", "max_steps: 4"));
    let t = Instant::now();
    // Rank 1 claims the next exchange at its third, as a rank that skipped one would.
    let o = two_ranks(dir.path(), &cfg, &["--run-dir", "r"])
        .env("OOMGUARD_TEST_MISALIGN", "1:3")
        .output()
        .unwrap();
    let err = text(&o);
    assert!(!o.status.success(), "{err}");
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}: {err}", t.elapsed());
    assert!(
        err.contains("collective mismatch: this rank is at exchange 3")
            && err.contains("the ranks are at exchanges 3..4"),
        "{err}"
    );
}

#[test]
fn the_store_listens_on_loopback_only_and_a_second_run_on_its_port_cannot_join() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), "long.yaml", |t| t.replace("max_steps: 6", "max_steps: 400"));
    let port = 29700 + (std::process::id() % 200) as u16;
    let launch = |run: &str| {
        let mut c = Command::new(bin());
        isolated(dies_with_test(&mut c), dir.path())
            .args([
                "launch",
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port.to_string(),
                "--no-python",
                bin(),
                "train",
            ])
            .args([cfg.to_str().unwrap(), "--run-dir", run])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    };
    let first = launch("a").spawn().unwrap();
    let t = Instant::now();
    while std::fs::read_to_string(dir.path().join("a/metrics.jsonl"))
        .map_or(true, |m| !m.contains("\"event\":\"step\""))
    {
        assert!(t.elapsed() < Duration::from_secs(60), "the first run never stepped");
        std::thread::sleep(Duration::from_millis(50));
    }
    let l = listeners(port);
    assert!(
        !l.is_empty() && l.iter().all(|a| a == &format!("0100007F:{port:04X}")),
        "the store listens beyond loopback: {l:?}"
    );
    // A second run on the same port: its rank 0 cannot listen, its rank 1 meets the first
    // run's store, sees another run's token and stops.
    let t = Instant::now();
    let o = launch("b").output().unwrap();
    let err = text(&o);
    assert!(!o.status.success() && t.elapsed() < Duration::from_secs(60), "{err}");
    assert!(
        err.contains("belongs to another run") || err.contains("cannot listen on 127.0.0.1"),
        "{err}"
    );
    let o = first.wait_with_output().unwrap();
    assert!(o.status.success(), "the first run suffered: {}", text(&o));
    assert_eq!(records(&dir.path().join("a"), "step").len(), 400);
}

/// Resume at another world size: the same parameters and optimizer state, the same samples
/// per step (the global batch is split anew), so without dropout the run ends where one
/// process does.
#[test]
fn a_run_resumes_at_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), "w.yaml", |t| {
        t.replace(
            "micro_batch_size: 8, grad_accum_steps: 2",
            "micro_batch_size: 2, global_batch_size: 12",
        )
        .replace("warmup_steps: 2}", "warmup_steps: 2, decay_steps: 6}")
    });
    let single = train_ok(dir.path(), &cfg, &[]);
    let run = dir.path().join("grown");
    let o = two_ranks(
        dir.path(),
        &cfg,
        &["--run-dir", run.to_str().unwrap(), "--max-steps", "3"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let mut three = train_command(dir.path(), &cfg, &run, 3);
    three.arg("--resume").env_remove("OMP_NUM_THREADS");
    let o = three.output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let worlds: Vec<_> = records(&run, "step")
        .iter()
        .map(|s| s["world_size"].as_u64().unwrap())
        .collect();
    assert_eq!(worlds, [2, 2, 2, 3, 3, 3]);
    let d = max_abs_diff(&weights(&single), &weights(&run));
    assert!(d < 1e-5, "2 then 3 ranks differ from one process by {d}");
}

/// A rank waiting for a peer that never comes (its node's launcher stops it for a group
/// restart): SIGTERM before the first step exits at once with 143, rather than after the
/// collective timeout, since there is nothing to save yet.
#[test]
fn a_signal_before_the_first_step_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), "c.yaml", |t| t);
    let port = loopback_port();
    let child = by_hand(dir.path(), &cfg, &port, "0", 20).spawn().unwrap();
    // Rank 0 is waiting for rank 1 once its store listens.
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())).is_err() {
        assert!(t.elapsed() < Duration::from_secs(60), "rank 0's store never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let t = Instant::now();
    let o = child.wait_with_output().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    assert_eq!(o.status.code(), Some(143), "{}", text(&o));
}

/// An evaluation batch smaller than the world (1 sample, 2 ranks): the rank with no sample
/// adds nothing and still takes part in every agreement; the loss is one process's.
#[test]
fn an_evaluation_batch_smaller_than_the_world_is_evaluated_by_the_ranks_that_have_samples() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), "e.yaml", |t| {
        t.replace(
            "eval_every: 0, eval_batch_size: 8, eval_batches: 2",
            "eval_every: 3, eval_batch_size: 1, eval_batches: 2",
        )
    });
    let single = train_ok(dir.path(), &cfg, &[]);
    let o = two_ranks(dir.path(), &cfg, &["--run-dir", "two"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let val = |r: &Path| {
        records(r, "eval")
            .iter()
            .map(|e| e["val_loss"].as_f64().unwrap())
            .collect::<Vec<_>>()
    };
    let (a, b) = (val(&single), val(&dir.path().join("two")));
    assert_eq!(a.len(), 2);
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-5), "{a:?} {b:?}");
}

/// Ranks on one host reduce through shared memory (csrc/shm.cpp). A rank that dies inside
/// one of its collectives (the test hook exits it at its 12th barrier, before it arrives,
/// and this test leaves it unreaped, a zombie) fails the rank waiting there at once, naming
/// it, not after the group's timeout (here 600 s).
#[test]
fn a_rank_that_dies_inside_a_shared_memory_collective_fails_the_other_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), "c.yaml", |t| t.replace("max_steps: 6", "max_steps: 20"));
    let port = loopback_port();
    let rank = |r: &str| {
        by_hand(dir.path(), &cfg, &port, r, 600)
            .envs([("LOCAL_WORLD_SIZE", "2"), ("OOMGUARD_TEST_SHM_EXIT", "1:12")])
            .spawn()
            .unwrap()
    };
    let (r0, mut r1) = (rank("0"), rank("1"));
    let t = Instant::now();
    let o = r0.wait_with_output().unwrap();
    let took = t.elapsed();
    let err = text(&o);
    assert!(took < Duration::from_secs(60), "took {took:?}: {err}");
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("(shared memory) joined the group"), "{err}");
    assert!(
        err.contains("rank 1 (pid ") && err.contains(") exited in the middle of a collective"),
        "{err}"
    );
    assert_eq!(r1.wait().unwrap().code(), Some(137));
}

/// Data parallel under a budget where ZeRO-1 (the first rung offered there) runs out of
/// memory while re-sharding: the rungs after it are still climbed, and it is said (the
/// ladder ended there silently, exit 3 with no rung tried).
#[test]
fn a_sharding_rung_that_runs_out_re_sharding_leaves_the_rungs_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    let o = two_ranks(dir.path(), &cfg, &["--memory-budget", "450KiB", "--run-dir", "r"])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(
        err.contains("ran out of memory while re-sharding (") && err.contains("trying the rungs after it"),
        "{err}"
    );
    let rungs: Vec<String> = records(&dir.path().join("r"), "rung")
        .iter()
        .map(|r| r["rung"].as_str().unwrap().to_string())
        .collect();
    assert!(
        rungs.contains(&"activation_checkpointing".to_string()),
        "{rungs:?}\n{err}"
    );
}
