//! Every OOM explains itself (issue 24), on the CPU, through the binary: RUN_DIR/oom/NNN/
//! with a snapshot PyTorch's own reader takes, a summary whose categories add up and match
//! the model's shapes, the paragraph in the `oom` event, and dumps that survive a kill.
mod common;
use common::*;
use serde_json::Value;
use std::path::Path;

fn summary(run: &Path, n: u32) -> Value {
    let p = run.join(format!("oom/{n:03}/summary.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

fn category(s: &Value, name: &str) -> u64 {
    s["categories"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no category {name}: {}", s["categories"]))
}

/// The number in a line of `_memory_viz stats` such as `total_allocated: 1.2MiB`, in bytes,
/// and its unit (it prints one decimal).
fn viz_bytes(out: &str, key: &str) -> (f64, f64) {
    let line = out
        .lines()
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("no {key} in {out}"));
    let v = line.split(':').nth(1).unwrap().trim();
    let split = v.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(v.len());
    let unit = match &v[split..] {
        "B" | "" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        u => panic!("unit {u} in {line}"),
    };
    (v[..split].parse::<f64>().unwrap() * unit, unit)
}

/// A budget between the first micro-batch's peak and the second's: the second (with every
/// gradient alive) runs out, so the summary must hold all of them.
#[test]
fn a_budget_oom_writes_a_snapshot_pytorch_reads_and_every_byte_is_accounted_for() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", &TINY.replace("max_steps: 6", "max_steps: 2"));
    let free = train_into(
        dir.path(),
        &cfg,
        "free",
        &["--memory-budget", "none", "--max-steps", "1"],
    );
    let peak = records(&free, "step")[0]["memory"]["peak_bytes"].as_u64().unwrap();
    // Parameters of the tiny GPT: wte 256x32, wpe 32x32, per block 2 LayerNorms, qkv, proj, fc, proj.
    let (c, v, t, l) = (32u64, 256u64, 32u64, 2u64);
    let per_block = 2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c);
    let num_params = v * c + t * c + l * per_block + 2 * c;
    let tensors = 2 + l * 12 + 2;
    let grads = 4 * num_params;
    let budget = peak - grads / 2;
    let run = train_into(dir.path(), &cfg, "run", &["--memory-budget", &budget.to_string()]);

    let oom = &records(&run, "oom")[0];
    assert_eq!(oom["snapshot"], "oom/001", "{oom}");
    let text = oom["memory_summary"]
        .as_str()
        .expect("the oom event carries the paragraph");
    let s = summary(&run, 1);
    assert_eq!(s["text"], text);
    assert_eq!(
        std::fs::read_to_string(run.join("oom/001/summary.txt")).unwrap().trim(),
        text
    );
    assert_eq!(s["micro_batch_index"], 1, "{s}");
    // Every live byte in exactly one category; the parameters, gradients and AdamW state as the
    // shapes say (moments: 2 x 4 bytes per parameter, plus a 4-byte step count per tensor).
    let sum: u64 = s["categories"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(sum, s["live_bytes"].as_u64().unwrap(), "{}", s["categories"]);
    assert_eq!(category(&s, "parameters"), 4 * num_params);
    assert_eq!(category(&s, "gradients"), grads);
    assert_eq!(category(&s, "optimizer_state"), 8 * num_params + 4 * tensors);
    assert!(
        category(&s, "activations") > 0 && category(&s, "loss_logits") > 0,
        "{}",
        s["categories"]
    );
    assert_eq!(s["request_bytes"], oom["requested_bytes"]);
    assert_eq!(s["limit_bytes"].as_u64(), Some(budget));
    assert!(s["live_bytes"].as_u64().unwrap() + s["request_bytes"].as_u64().unwrap() > budget);
    assert_eq!(
        s["plan"]["parameters"].as_u64(),
        Some(4 * num_params),
        "the plan beside it: {}",
        s["plan"]
    );
    assert!(
        s["largest"][0]["op"]
            .as_str()
            .is_some_and(|o| o.starts_with("aten::") || o.contains("Backward")),
        "{}",
        s["largest"]
    );
    assert!(
        text.contains("gradients") && text.contains("The failing op: "),
        "{text}"
    );

    // PyTorch's own reader: the pickle loads, and stats/segsum and trace run on it.
    let snap = run.join("oom/001/snapshot.pickle");
    let snap = snap.to_str().unwrap();
    let keys = python(&["-c", "import pickle,sys; d = pickle.load(open(sys.argv[1], 'rb')); print(sorted(d), len(d['segments']), sum(b['size'] for s \
        in d['segments'] for b in s['blocks']))", snap]);
    assert!(
        keys.starts_with("['allocator_settings', 'device_traces', 'segments']"),
        "{keys}"
    );
    let total: u64 = keys.split_whitespace().last().unwrap().parse().unwrap();
    assert_eq!(total, s["live_bytes"].as_u64().unwrap(), "{keys}");
    assert_eq!(
        keys.split_whitespace().nth(3).unwrap().parse::<u64>().unwrap(),
        s["live_allocations"].as_u64().unwrap()
    );
    let stats = python(&["-m", "torch.cuda._memory_viz", "stats", snap]);
    let live = s["live_bytes"].as_u64().unwrap() as f64;
    for key in ["total_allocated", "total_reserved"] {
        let (b, unit) = viz_bytes(&stats, key);
        assert!(
            (b - live).abs() <= (0.01 * live).max(0.05 * unit),
            "{key}: {b} vs summary's {live}: {stats}"
        );
    }
    let trace = python(&["-m", "torch.cuda._memory_viz", "trace", snap]);
    assert!(
        trace.contains(&format!(
            "{} entries",
            s["events_kept"].as_u64().unwrap() + count_frees(&trace)
        )),
        "{}",
        &trace[..200.min(trace.len())]
    );
    assert!(trace.contains("raise OutOfMemoryError"), "the trace ends at the OOM");

    // The report: a panel per OOM (the timeline by category, the largest allocations with
    // their op and module), inline in the HTML page; the paragraph in what it prints.
    let html = dir.path().join("report.html");
    let o = oomguard(
        &["report", run.to_str().unwrap(), "--out", html.to_str().unwrap()],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains(&format!("oom/001              {text}")));
    let page = std::fs::read_to_string(&html).unwrap();
    for want in [
        "oom/001 (out of memory)",
        "largest live allocations",
        "allocation events of the failing attempt",
        "gradients",
        "aten::",
    ] {
        assert!(page.contains(want), "the report has no {want:?}");
    }
}

/// `trace` prints each free twice (requested, completed): the entries are the events plus
/// the frees.
fn count_frees(trace: &str) -> u64 {
    trace.lines().filter(|l| l.starts_with("del ")).count() as u64
}

/// Seed 002's shape, scaled down: a vocabulary far wider than the model, so the logits (B x
/// T x vocab x 4 bytes, and their softmax and gradient) fill memory.
#[test]
fn a_logits_dominated_model_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY
        .replace(
            "n_layer: 2, n_head: 2, n_embd: 32, block_size: 32, vocab_size: 256",
            "n_layer: 1, n_head: 2, n_embd: 16, block_size: 64, vocab_size: 8192",
        )
        .replace("max_steps: 6", "max_steps: 1")
        .replace("vocab_size: 8192}", "vocab_size: 8192, loss: full}");
    // The plain loss: the fused one (the default) never holds the logits whole.
    let cfg = write_config(dir.path(), "logits.yaml", &yaml);
    // Logits of micro-batch 8 are 8 x 64 x 8192 x 4 bytes = 16 MiB: they fit, their
    // log-softmax (as much again) does not.
    let run = train_into(dir.path(), &cfg, "run", &["--memory-budget", "26MiB"]);
    let s = summary(&run, 1);
    let cats = s["categories"].as_object().unwrap();
    let (largest, _) = cats.iter().max_by_key(|(_, v)| v.as_u64().unwrap()).unwrap();
    assert_eq!(largest, "loss_logits", "{cats:?}");
    assert!(s["text"].as_str().unwrap().contains(": loss/logits "), "{}", s["text"]);
}

/// A kill while oom/002 is being written leaves oom/001 whole, no torn oom/002, and a run
/// that resumes (and numbers its next dump after the last whole one).
#[test]
fn a_kill_mid_dump_leaves_earlier_dumps_and_a_resumable_run() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY.to_string() + "checkpoint: {every_steps: 1, keep: 2}\n";
    let cfg = write_config(dir.path(), "tiny.yaml", &yaml);
    let run = dir.path().join("run");
    let mut child = dies_with_test(isolated(&mut std::process::Command::new(bin()), dir.path()))
        .args([
            "train",
            cfg.to_str().unwrap(),
            "--run-dir",
            run.to_str().unwrap(),
            "--inject-oom",
            "6:3",
        ])
        .env("OMP_NUM_THREADS", "1")
        .env("OOMGUARD_TEST_DUMP_PAUSE_MS", "1500")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let oom = run.join("oom");
    let mid_second = || {
        oom.join("001").exists()
            && std::fs::read_dir(&oom)
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(".002."))
    };
    let t0 = std::time::Instant::now();
    while !mid_second() {
        assert!(t0.elapsed().as_secs() < 120, "no second dump began");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before its second dump"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!oom.join("002").exists());
    let first = summary(&run, 1);
    python(&[
        "-c",
        "import pickle,sys; pickle.load(open(sys.argv[1], 'rb'))",
        run.join("oom/001/snapshot.pickle").to_str().unwrap(),
    ]);

    let o = resume(dir.path(), &cfg, &run, &["--inject-oom", "2:5"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(summary(&run, 1), first, "oom/001 unchanged");
    assert!(
        oom.join("002/summary.json").exists(),
        "the resumed run's first dump is 002"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&oom)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn bad_settings_exit_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (yaml, key) in [
        ("memory: {snapshot: sometimes}\n", "memory.snapshot"),
        (
            "memory: {snapshot: {mode: on_oom, max_events: -1}}\n",
            "memory.snapshot.max_events",
        ),
    ] {
        let cfg = write_config(dir.path(), "bad.yaml", &(TINY.to_string() + yaml));
        let o = train_at(dir.path(), &cfg, &dir.path().join("bad"), &[]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains(key), "{key}: {}", stderr(&o));
    }
}

/// A history too large for the machine (max_events 10^15: 64 PB, beyond any address space):
/// its allocation fails inside C++, and that comes back as an error. The run trains without
/// the history, saying so, instead of aborting on an exception thrown across the C ABI.
#[test]
fn a_history_too_large_to_allocate_is_an_error_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY.replace("max_steps: 6", "max_steps: 2")
        + "memory: {snapshot: {mode: on_oom, max_events: 1000000000000000}}\n";
    let cfg = write_config(dir.path(), "huge.yaml", &yaml);
    let run = dir.path().join("run");
    let o = train_at(dir.path(), &cfg, &run, &[]);
    let err = stderr(&o);
    assert!(o.status.success(), "{:?}: {err}", o.status);
    assert!(err.contains("CPU memory history not started"), "{err}");
    assert_eq!(records(&run, "step").len(), 2);
}

/// Trains TINY with one injected OOM and `OOMGUARD_TEST_CSRC_FAIL=point`, asserting success;
/// returns the run and its stderr.
fn train_failing_at(dir: &Path, point: &str) -> (std::path::PathBuf, String) {
    let cfg = write_config(dir, "tiny.yaml", TINY);
    let run = dir.join("run");
    let o = isolated(&mut std::process::Command::new(bin()), dir)
        .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
        .args(["--inject-oom", "1:3"])
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .env("OOMGUARD_TEST_CSRC_FAIL", point)
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{:?}: {err}", o.status);
    (run, err)
}

/// The dump's copy of the history failing (an allocation in og_snap_read) is an error the
/// dump reports, not an abort: the OOM is recovered and the run completes.
#[test]
fn a_dump_whose_copy_cannot_be_allocated_is_skipped_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let (run, err) = train_failing_at(dir.path(), "snap_read");
    let ooms = records(&run, "oom");
    assert_eq!(ooms.len(), 1, "{err}");
    assert!(ooms[0]["requested_bytes"].as_u64().is_some(), "{}", ooms[0]);
    assert!(err.contains("could not write the memory snapshot"), "{err}");
    assert!(!run.join("oom/001").exists());
    assert_eq!(records(&run, "step").len(), 6);
}

/// An allocation failing inside the history's hook at the failed allocation (its copy)
/// drops the copy, not the OOM: the guard still sees an out-of-memory error and recovers.
#[test]
fn a_failure_inside_the_oom_hook_leaves_the_oom_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let (run, err) = train_failing_at(dir.path(), "snap_hook");
    let ooms = records(&run, "oom");
    assert_eq!(ooms.len(), 1, "{err}");
    assert!(ooms[0]["requested_bytes"].as_u64().is_some(), "{}", ooms[0]);
    assert_eq!(records(&run, "step").len(), 6);
}
