//! What the host gives a run, through the real binary: CPU threads from the process's own
//! share (affinity mask, Slurm) and a memory budget from its own cgroup, for `train`,
//! `launch` and `sweep`. The memory tests make a real child memory cgroup and limit it;
//! the kernel, not oomguard, would kill a run that ignored it.
mod common;

use common::{dies_with_test, isolated, records, write_config, TINY};
use oomguard_host::cgroup::Cgroup;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn run(cmd: &mut Command) -> (Output, String) {
    let o = dies_with_test(cmd).output().expect("the command runs");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    (o, err)
}

fn oomguard(dir: &Path) -> Command {
    let mut c = Command::new(common::bin());
    isolated(&mut c, dir)
        .current_dir(dir)
        .env_remove("OMP_NUM_THREADS")
        .env_remove("SLURM_CPUS_PER_TASK");
    c
}

/// `cmd` with its CPU affinity narrowed to CPU 0, as Slurm's task/affinity or `taskset` do.
fn on_one_cpu(cmd: &Command) -> Command {
    let mut c = Command::new("taskset");
    c.args(["-c", "0"])
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .current_dir(cmd.get_current_dir().unwrap());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    c
}

/// TINY with the thread count left to the host.
fn untuned(dir: &Path) -> PathBuf {
    write_config(
        dir,
        "c.yaml",
        &TINY
            .replace(", num_threads: 1", "")
            .replace("max_steps: 6", "max_steps: 2"),
    )
}

#[test]
fn train_takes_its_threads_from_the_affinity_mask_and_from_slurm() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = untuned(dir.path());
    let mut train = oomguard(dir.path());
    train.args(["train", cfg.to_str().unwrap(), "--run-dir", "a"]);
    let (o, err) = run(&mut on_one_cpu(&train));
    assert!(o.status.success(), "{err}");
    assert!(err.contains("(1 thread (affinity mask of 1 CPU),"), "{err}");

    let mut slurm = oomguard(dir.path());
    slurm
        .args(["train", cfg.to_str().unwrap(), "--run-dir", "b"])
        .env("SLURM_CPUS_PER_TASK", "1");
    let (o, err) = run(&mut slurm);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("(1 thread (SLURM_CPUS_PER_TASK=1),"), "{err}");

    // OMP_NUM_THREADS, set by the user, wins over both.
    let mut omp = oomguard(dir.path());
    omp.args(["train", cfg.to_str().unwrap(), "--run-dir", "c"])
        .env("SLURM_CPUS_PER_TASK", "1")
        .env("OMP_NUM_THREADS", "2");
    let (o, err) = run(&mut on_one_cpu(&omp));
    assert!(o.status.success(), "{err}");
    assert!(err.contains("(2 threads (OMP_NUM_THREADS=2),"), "{err}");
}

#[test]
fn sweep_trials_get_their_share_of_the_affinity_mask_and_of_slurm() {
    let dir = tempfile::tempdir().unwrap();
    untuned(dir.path());
    let file = write_config(
        dir.path(),
        "s.yaml",
        "base: c.yaml\nparameters:\n  optim.lr: {values: [1.0e-3, 3.0e-3]}\n",
    );
    for (name, slurm, parallel) in [("taskset", None, "1"), ("slurm", Some("1"), "2")] {
        let mut sweep = oomguard(dir.path());
        sweep.args(["sweep", file.to_str().unwrap(), "--out", name, "--parallel", parallel]);
        let mut cmd = match slurm {
            None => on_one_cpu(&sweep),
            Some(n) => {
                sweep.env("SLURM_CPUS_PER_TASK", n);
                sweep
            }
        };
        let (o, err) = run(&mut cmd);
        assert!(o.status.success(), "{name}: {err}");
        let trials: Vec<PathBuf> = std::fs::read_dir(dir.path().join(name).join("trials"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(trials.len(), 2);
        for t in trials {
            let log = std::fs::read_to_string(t.join("trial.log")).unwrap();
            let want = if slurm.is_some() {
                "(1 thread (train.num_threads),"
            } else {
                "(1 thread (affinity mask of 1 CPU),"
            };
            assert!(log.contains(want), "{name}: {log}");
        }
        if slurm.is_some() {
            assert!(
                err.contains("each trial gets 1 CPU thread (this host gives 1 thread (SLURM_CPUS_PER_TASK=1))"),
                "{err}"
            );
        }
    }
}

/// A child of this test's own memory cgroup, limited; removed when dropped.
struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    /// None (and says why) where this machine does not let the test make one.
    fn make(name: &str, limit: u64) -> Option<MemoryCgroup> {
        let own = Cgroup::of_self("memory")?;
        let dir = own.dir().join(format!("oomguard-test-{name}-{}", std::process::id()));
        let limit_file = if own.v2 { "memory.max" } else { "memory.limit_in_bytes" };
        let made = std::fs::create_dir(&dir).and_then(|_| std::fs::write(dir.join(limit_file), limit.to_string()));
        match made {
            Ok(()) => Some(MemoryCgroup { dir, v2: own.v2 }),
            Err(e) => {
                eprintln!("SKIPPED: cannot make a memory cgroup under {} here ({e}); this test needs root and a writable cgroup", own.dir().display());
                let _ = std::fs::remove_dir(&dir);
                None
            }
        }
    }

    /// `cmd`, started inside this cgroup (the shell joins it, then execs the command).
    fn wrap(&self, cmd: &Command) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", "echo $$ > \"$0\" && exec \"$@\""])
            .arg(self.dir.join("cgroup.procs"))
            .arg(cmd.get_program())
            .args(cmd.get_args());
        c.current_dir(cmd.get_current_dir().unwrap());
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        c
    }

    /// Kills the kernel's OOM killer made here (v1 memory.oom_control, v2 memory.events).
    fn oom_kills(&self) -> u64 {
        let file = if self.v2 { "memory.events" } else { "memory.oom_control" };
        let text = std::fs::read_to_string(self.dir.join(file)).unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

const MIB: u64 = 1 << 20;

/// A GPT whose configured micro-batch needs about 1.6 GiB (its full logits: 64 x 256 tokens
/// x 8192 words, `model.loss: full`), far above the cgroups below: only the budget's OOMs
/// keep it alive.
fn hungry(dir: &Path, steps: u64) -> PathBuf {
    write_config(
        dir,
        "hungry.yaml",
        &format!(
            "model: {{n_layer: 1, n_head: 2, n_embd: 32, block_size: 256, vocab_size: 8192, loss: full}}\n\
             data: {{source: embedded, embedded_bytes: 65536}}\n\
             optim: {{lr: 1.0e-3, warmup_steps: 1}}\n\
             train: {{micro_batch_size: 64, grad_accum_steps: 1, max_steps: {steps}, eval_every: 0, eval_batch_size: 4, eval_batches: 1, seed: 3, \
             device: cpu, num_threads: 1}}\n\
             log: {{every: 1}}\n"
        ),
    )
}

/// Runs `cmd` in `cg`; asserts it ends with exit 0 and no kernel kill there.
fn survives(cg: &MemoryCgroup, name: &str, cmd: &Command) -> String {
    let (o, err) = run(&mut cg.wrap(cmd));
    assert_eq!(
        cg.oom_kills(),
        0,
        "{name}: the kernel killed a process in the cgroup\n{err}"
    );
    assert!(o.status.success(), "{name}: {:?}\n{err}", o.status);
    err
}

fn ooms(run: &Path) -> usize {
    records(run, "oom").len()
}

#[test]
fn a_run_inside_a_small_memory_cgroup_adapts_instead_of_being_killed() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = hungry(dir.path(), 3);
    let mut train = oomguard(dir.path());
    train.args(["train", cfg.to_str().unwrap(), "--run-dir", "run"]);
    let Some(cg) = MemoryCgroup::make("train", 700 * MIB) else {
        return;
    };
    let err = survives(&cg, "train", &train);
    let rd = dir.path().join("run");
    assert!(
        err.contains("free under the cgroup limit 700.0 MiB at /"),
        "the budget names the cgroup:\n{err}"
    );
    assert!(
        ooms(&rd) > 0,
        "the budget, not the kernel, stopped the configured micro-batch"
    );
    assert_eq!(records(&rd, "step").len(), 3);
    // `oomguard plan` plans with the same figure.
    let (o, err) = run(&mut cg.wrap(oomguard(dir.path()).args(["plan", cfg.to_str().unwrap()])));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("free under the cgroup limit 700.0 MiB"), "{out}\n{err}");
}

/// Micro-batch 128 of 256 tokens on a 4 x 256 GPT: its activations dominate.
fn activations(dir: &Path) -> Command {
    let cfg = write_config(
        dir,
        "activations.yaml",
        "model: {n_layer: 4, n_head: 4, n_embd: 256, block_size: 256, vocab_size: 256}\n\
         data: {source: embedded}\n\
         train: {micro_batch_size: 128, grad_accum_steps: 1, max_steps: 1, eval_every: 0, eval_batch_size: 4, \
         eval_batches: 1, seed: 3, device: cpu, num_threads: 2}\n",
    );
    let mut train = oomguard(dir);
    train.args(["train", cfg.to_str().unwrap(), "--run-dir", "run"]);
    train
}

/// Activations dominate, everything else at its default: the budget from the cgroup is
/// right and the guard recovers its OOMs, but glibc kept the failed attempts' freed buffers
/// resident and the kernel killed the run at step 0 (137) until the heap returned them (a
/// fixed mmap threshold under a cgroup, and malloc_trim when an OOM is cleaned up).
#[test]
fn a_run_whose_activations_dominate_is_not_killed_by_its_heap() {
    let dir = tempfile::tempdir().unwrap();
    let train = activations(dir.path());
    let Some(cg) = MemoryCgroup::make("heap", 700 * MIB) else {
        return;
    };
    let err = survives(&cg, "train", &train);
    assert!(err.contains("under a memory cgroup: freed buffers of 4.0 MiB"), "{err}");
    let rd = dir.path().join("run");
    assert!(ooms(&rd) > 0, "the budget, not the kernel, stopped micro-batch 128");
    assert_eq!(records(&rd, "step").len(), 1);
}

/// The same run with the user's own MALLOC_MMAP_THRESHOLD_ (1 GiB: every buffer from the
/// heap, which oomguard leaves as set): the heap keeps what the failed attempts freed, and
/// only the footprint limit (RssAnon against the cgroup, checked on allocations of a MiB
/// and more) turns that into an OOM the guard recovers, instead of the kernel's kill.
#[test]
fn a_heap_that_keeps_its_buffers_is_an_oom_not_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let mut train = activations(dir.path());
    train.env("MALLOC_MMAP_THRESHOLD_", (1u64 << 30).to_string());
    let Some(cg) = MemoryCgroup::make("footprint", 700 * MIB) else {
        return;
    };
    let err = survives(&cg, "train", &train);
    assert!(err.contains("host footprint limit"), "{err}");
    let rd = dir.path().join("run");
    assert_eq!(records(&rd, "step").len(), 1);
    let footprint = records(&rd, "oom")
        .iter()
        .filter(|o| o["message"].as_str().is_some_and(|m| m.contains("(host footprint)")))
        .count();
    assert!(footprint > 0, "{:?}", records(&rd, "oom"));
}

#[test]
fn launched_workers_and_parallel_trials_each_get_their_share_of_the_cgroup() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = hungry(dir.path(), 2);
    let bin = common::bin();
    let mut launch = oomguard(dir.path());
    launch
        .args([
            "launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.05",
            "--no-python",
        ])
        .arg(&bin)
        .args(["train", cfg.to_str().unwrap(), "--run-dir", "dp"]);
    let Some(cg) = MemoryCgroup::make("launch", 1000 * MIB) else {
        return;
    };
    let err = survives(&cg, "launch", &launch);
    assert!(err.contains("each of the 2 workers gets"), "{err}");
    assert!(
        err.contains("free of this process's share"),
        "each worker's budget is its share:\n{err}"
    );
    let dp = dir.path().join("dp");
    assert!(ooms(&dp) > 0);
    assert_eq!(records(&dp, "step").len(), 2);

    // Its own directory: a micro-batch cache of its own, so the trials find their sizes.
    let dir = dir.path().join("sweep");
    std::fs::create_dir(&dir).unwrap();
    hungry(&dir, 2);
    let file = write_config(
        &dir,
        "s.yaml",
        "base: hungry.yaml\nparameters:\n  optim.lr: {values: [1.0e-3, 3.0e-3]}\n",
    );
    let mut sweep = oomguard(&dir);
    sweep.args(["sweep", file.to_str().unwrap(), "--out", "sweep", "--parallel", "2"]);
    let Some(cg) = MemoryCgroup::make("sweep", 1000 * MIB) else {
        return;
    };
    let err = survives(&cg, "sweep", &sweep);
    assert!(err.contains("each of the 2 slots gets"), "{err}");
    let results = std::fs::read_to_string(dir.join("sweep/results.jsonl")).unwrap();
    let results: Vec<serde_json::Value> = results.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(results.len(), 2);
    for r in &results {
        assert_eq!(r["status"], "ok", "{r}");
        assert!(
            r["final_micro_batch_size"].as_u64().unwrap() < 64,
            "the configured micro-batch does not fit a share: {r}"
        );
        let log =
            std::fs::read_to_string(dir.join("sweep").join(r["run_dir"].as_str().unwrap()).join("trial.log")).unwrap();
        assert!(log.contains("free of this process's share"), "{log}");
    }
    // A trial may start at a size the other already found (the shared cache); not both.
    assert!(
        results.iter().map(|r| r["ooms"].as_u64().unwrap()).sum::<u64>() > 0,
        "{results:?}"
    );
}
