//! Helpers shared by the integration tests: they drive the real binary in temp dirs.
#![allow(dead_code)] // each test file uses a different subset

pub mod elastic;
pub mod netns;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A tiny GPT on the embedded corpus: fast enough for many runs on 2 cores.
pub const TINY: &str = "
model: {n_layer: 2, n_head: 2, n_embd: 32, block_size: 32, vocab_size: 256}
data: {source: embedded, embedded_bytes: 65536}
optim: {lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 2}
train: {micro_batch_size: 8, grad_accum_steps: 2, max_steps: 6, eval_every: 0, eval_batch_size: 8, eval_batches: 2, seed: 7, device: cpu, num_threads: 1}
log: {every: 1}
";

/// The oomguard binary: this build's, or $OOMGUARD_BIN (the GPU kit runs these tests on a
/// host where the build's paths do not exist).
pub fn bin() -> PathBuf {
    std::env::var_os("OOMGUARD_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_oomguard")), PathBuf::from)
}

/// The plain build (`cargo build --release`, `make build`): target/release/oomguard, which the
/// README runs (tests/readme.rs, built without the test hooks, after `make test` has put the
/// plain build back in place of the tests' own).
pub fn plain_bin() -> PathBuf {
    root().join("target/release/oomguard")
}

/// The source tree (configs/, tests/golden/): this build's, or $OOMGUARD_ROOT.
pub fn root() -> PathBuf {
    std::env::var_os("OOMGUARD_ROOT").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

pub fn write_config(dir: &Path, name: &str, yaml: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, yaml).unwrap();
    p
}

/// Makes a spawned process die when the test's thread ends, so a failing test leaves no
/// training run (or launcher) behind.
pub fn dies_with_test(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        })
    }
}

/// Runs started from `cwd` share a micro-batch cache there, not the user's (~/.cache): a
/// size one test's run learned must not change another test's run.
pub fn isolated<'c>(cmd: &'c mut Command, cwd: &Path) -> &'c mut Command {
    cmd.env("OOMGUARD_CACHE", cwd.join(".oomguard-cache"))
}

pub fn oomguard(args: &[&str], cwd: &Path) -> Output {
    let o = isolated(&mut Command::new(bin()), cwd)
        .args(args)
        .current_dir(cwd)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("the oomguard binary runs");
    note_devices(args, cwd);
    o
}

/// With $OOMGUARD_TEST_DEVICES set (scripts/gpu_check.py sets it), every run started here
/// appends `{"test", "run", "devices"}` to that file, the devices read from the run's step
/// records: where tests ran is then known from what ran, not from what a test printed.
fn note_devices(args: &[&str], cwd: &Path) {
    use std::io::Write;
    let Some(out) = std::env::var_os("OOMGUARD_TEST_DEVICES") else {
        return;
    };
    let Some(run) = args
        .iter()
        .position(|a| *a == "--run-dir")
        .and_then(|i| args.get(i + 1))
    else {
        return;
    };
    let run = cwd.join(run);
    let Ok(text) = std::fs::read_to_string(run.join("metrics.jsonl")) else {
        return;
    };
    let mut devices: Vec<String> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .map(|v| v["device"].as_str().unwrap_or("unrecorded").to_string())
        .collect();
    devices.sort();
    devices.dedup();
    let test = std::thread::current().name().unwrap_or("unnamed").to_string();
    let line = serde_json::json!({"test": test, "run": run, "devices": devices});
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&out)
        .expect("$OOMGUARD_TEST_DEVICES can be opened");
    writeln!(f, "{line}").expect("$OOMGUARD_TEST_DEVICES can be written");
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Trains `config` into `dir/run`, asserting success; returns the run directory.
pub fn train_ok(dir: &Path, config: &Path, extra: &[&str]) -> PathBuf {
    train_into(dir, config, "run", extra)
}

/// Trains `config` into `dir/name`, asserting success; returns the run directory.
pub fn train_into(dir: &Path, config: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let run = dir.join(name);
    let o = train_at(dir, config, &run, extra);
    assert!(o.status.success(), "oomguard train failed: {}", stderr(&o));
    run
}

/// `oomguard train CONFIG --run-dir RUN EXTRA...` from `dir`; its output, checked by the
/// caller (a run may be meant to fail).
pub fn train_at(dir: &Path, config: &Path, run: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", config.to_str().unwrap(), "--run-dir", run.to_str().unwrap()];
    args.extend_from_slice(extra);
    oomguard(&args, dir)
}

/// `oomguard train CONFIG --nproc-per-node N --run-dir RUN`, dying with the test, its cache
/// isolated in `dir` (where it runs), for a caller to add flags and environment to.
pub fn train_command(dir: &Path, config: &Path, run: &Path, nproc: usize) -> Command {
    let mut c = Command::new(bin());
    isolated(dies_with_test(&mut c), dir)
        .args([
            "train",
            config.to_str().unwrap(),
            "--nproc-per-node",
            &nproc.to_string(),
        ])
        .args(["--run-dir", run.to_str().unwrap()])
        .current_dir(dir);
    c
}

/// `train_at` with `--resume` first.
pub fn resume(dir: &Path, config: &Path, run: &Path, extra: &[&str]) -> Output {
    train_at(dir, config, run, &[&["--resume"], extra].concat())
}

/// The records of metrics.jsonl with the given `event`.
pub fn records(run: &Path, event: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["event"] == event)
        .collect()
}

pub fn losses(run: &Path) -> Vec<f64> {
    records(run, "step")
        .iter()
        .map(|r| r["loss"].as_f64().unwrap())
        .collect()
}

/// The run's final parameters, by name.
pub fn weights(run: &Path) -> Vec<(String, tch::Tensor)> {
    safetensors(&run.join("model.safetensors"))
}

/// A safetensors file's tensors, sorted by name.
pub fn safetensors(path: &Path) -> Vec<(String, tch::Tensor)> {
    let mut w = tch::Tensor::read_safetensors(path).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// The set-up's python3 (torch 2.13, safetensors), run quietly (torch.jit is deprecated:
/// warnings only); its stdout.
pub fn python(args: &[&str]) -> String {
    let py = root().join(".venv/bin/python3");
    let o = Command::new(&py)
        .args(args)
        .env("PYTHONWARNINGS", "ignore")
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("python3 from the set-up's venv");
    assert!(
        o.status.success(),
        "python {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// PATH with the set-up's venv (python3 with torch, torchrun) first.
pub fn path_with_venv() -> String {
    let venv = root().join(".venv/bin");
    assert!(
        venv.join("python3").exists(),
        "{} is missing: run `make setup`",
        venv.display()
    );
    format!("{}:{}", venv.display(), std::env::var("PATH").unwrap_or_default())
}

/// A file of the source tree, as an argument.
pub fn script(name: &str) -> String {
    root().join(name).display().to_string()
}

pub fn max_abs_diff(a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            (ta - tb).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

/// The middle value (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One in-process test at a time. The tests of a file run on parallel threads, and the global
/// random generator, the counting allocator's peak and the read counter are process-wide: a
/// test that compares seeded builds, a peak or a count takes this first (a neighbour's draw
/// between `manual_seed` and an init gave two "identical" models different weights).
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The tiny GPT in-process, with its data and optimizer, counting CPU memory from the start.
pub struct TinyGpt {
    pub data: oomguard::data::Dataset,
    pub task: oomguard::task::gpt::GptTask,
    pub opt: oomguard::optim::AdamW,
}

pub fn tiny_gpt() -> TinyGpt {
    use oomguard::task::Task;
    use oomguard::{data, model, optim};
    oomguard::memory::install_cpu_allocator();
    tch::manual_seed(0);
    let cfg = model::GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 32,
        vocab_size: 256,
        dropout: 0.0,
        bias: true,
        loss: Default::default(),
    };
    let shape = data::TokenShape {
        block_size: 32,
        vocab_size: Some(256),
    };
    let data = data::Dataset::open(
        &data::DataConfig {
            embedded_bytes: 65536,
            ..Default::default()
        },
        Path::new("."),
        Some(shape),
    )
    .unwrap();
    let task = oomguard::task::gpt::GptTask::new(&cfg, tch::Device::Cpu).unwrap();
    let opt = optim::AdamW::new(task.parameters(), &optim::OptimConfig::default(), |n, t| {
        task.no_weight_decay(n, t)
    })
    .unwrap();
    TinyGpt { data, task, opt }
}

/// A checkpoint's state for `task` at `next_step` (16 samples a step, micro-batch 8,
/// evaluation batch 16, nothing else kept).
pub fn train_state(task: &dyn oomguard::task::Task, next_step: u64) -> oomguard::checkpoint::TrainState {
    use oomguard::guard::Policy;
    oomguard::checkpoint::TrainState {
        format: oomguard::checkpoint::FORMAT,
        next_step,
        samples_seen: 16 * next_step,
        policy: Policy::new(8),
        eval_policy: Policy::new(16),
        val_loss: None,
        eval_history: Default::default(),
        model: task.fingerprint(),
        extra: Default::default(),
        files: Default::default(),
        shards: None,
        manifest_crc32: None,
    }
}

/// The tiny GPT's training samples, `global_batch` a step.
pub fn tiny_batches(data: &oomguard::data::Dataset, global_batch: usize) -> oomguard::data::StepSamples<'_> {
    oomguard::data::StepSamples::new(data.train.as_ref(), 1, global_batch, tch::Device::Cpu)
}

/// `oomguard train CONFIG --nproc-per-node WORLD --run-dir RUN --inject-oom SPEC [extra]`,
/// one thread per rank: it must exit 0 within 120 s (longer is a hang). Returns the
/// failures the ranks injected, as their logs count them.
pub fn train_injected(dir: &Path, cfg: &Path, run: &Path, world: u64, spec: &str, extra: &[&str], what: &str) -> u64 {
    use std::time::{Duration, Instant};
    let mut c = Command::new(bin());
    isolated(dies_with_test(&mut c), dir)
        .args([
            "train",
            cfg.to_str().unwrap(),
            "--nproc-per-node",
            &world.to_string(),
            "--run-dir",
            run.to_str().unwrap(),
            "--inject-oom",
            spec,
        ])
        .args(extra)
        .current_dir(dir)
        .env_remove("OMP_NUM_THREADS")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let t = Instant::now();
    let mut child = c.spawn().unwrap();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("{what}: still running after 120 s (a hang)");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{what}: {err}");
    err.lines()
        .filter_map(|l| l.split("--inject-oom: ").nth(1)?.split(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The injection marathons' config (tests/dist_inject.rs, tests/shard.rs): a global batch
/// of 12 (6+6 on 2 ranks, 4+4+4 on 3), evaluation and checkpoints too. Injected failures
/// look like memory facts: many at micro-batch 1 would climb to bf16, which changes the
/// numbers, so that rung is off (activation checkpointing is exact); the ranks' failures add
/// up within a step, so more retries at micro-batch 1. No memory snapshots (tests/snapshot.rs
/// proves them; hundreds of dumps would only cost time).
pub fn inject_config(dir: &Path) -> PathBuf {
    let yaml = TINY
        .replace("micro_batch_size: 8, grad_accum_steps: 2", "micro_batch_size: 4, global_batch_size: 12")
        .replace("max_steps: 6, eval_every: 0, eval_batch_size: 8", "max_steps: 8, eval_every: 4, eval_batch_size: 12")
        + "checkpoint: {every_steps: 2, keep: 2}\nmemory: {cooldown_steps: 2, grow_after_steps: 1, grow_headroom: 0.0, retries_at_one: 40, \
            allow_precision_fallback: false, snapshot: off}\n";
    write_config(dir, "inject.yaml", &yaml)
}

/// The tiny GPT (`TINY`) at a global batch of 15 in micro-batches of 4 (shards of 8 and 7 at
/// 2 ranks, 5 each at 3: uneven everywhere), over `steps` steps, with `extra` YAML.
pub fn uneven_config(dir: &Path, steps: u64, extra: &str) -> PathBuf {
    let yaml = TINY
        .replace(
            "micro_batch_size: 8, grad_accum_steps: 2",
            "micro_batch_size: 4, global_batch_size: 15",
        )
        .replace("max_steps: 6", &format!("max_steps: {steps}"))
        .replace("warmup_steps: 2}", "warmup_steps: 2, decay_steps: 40}");
    write_config(dir, &format!("c{steps}.yaml"), &(yaml + extra))
}

/// Waits until `run`'s metrics.jsonl holds `n` step records (a minute at most).
pub fn wait_for_steps(run: &Path, n: usize) {
    let t = std::time::Instant::now();
    while std::fs::read_to_string(run.join("metrics.jsonl"))
        .map(|m| m.matches("\"event\":\"step\"").count())
        .unwrap_or(0)
        < n
    {
        assert!(t.elapsed() < std::time::Duration::from_secs(60), "no progress");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A port nothing listens on now (a store's, which rank 0 binds).
pub fn loopback_port() -> String {
    drawn_ports(1).to_string()
}

/// A free port on loopback whose next port is free too (node 0's launcher coordinates the
/// nodes at --master-port + 1).
pub fn port_pair() -> u16 {
    drawn_ports(2)
}

/// The first of `n` ports free now, drawn at random in 10000..20000: below the kernel's
/// ephemeral range, where any process's next outgoing connection could take a port the kernel
/// handed out (binding port 0) before the store listens on it (a CI flake), and below the
/// launcher's own draws (`free_port` there draws from 20000).
pub fn drawn_ports(n: u16) -> u16 {
    use std::hash::BuildHasher;
    let random = std::collections::hash_map::RandomState::new();
    (0u32..)
        .map(|i| 10000 + (random.hash_one((i, std::process::id())) % 10000) as u16)
        .find(|p| (*p..p + n).all(|q| std::net::TcpListener::bind(("0.0.0.0", q)).is_ok()))
        .unwrap()
}

/// Sockets listening on `port` (IPv4 and IPv6), as /proc/net shows them: the local address
/// in the kernel's hex.
pub fn listeners(port: u16) -> Vec<String> {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap_or_default()
                .lines()
                .skip(1)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 3 && f[3] == "0A" && f[1].ends_with(&want)).then(|| f[1].to_string())
        })
        .collect()
}
