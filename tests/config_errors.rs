//! Bad configs exit with code 2 and a message naming the file, line, key and the fix.
mod common;
use common::*;

fn fails_with(yaml: &str, extra: &[&str], wants: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "bad.yaml", yaml);
    let mut args = vec!["train", cfg.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = oomguard(&args, dir.path());
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for w in wants {
        assert!(err.contains(w), "expected {w:?} in:\n{err}");
    }
    assert!(!dir.path().join("runs").exists(), "a bad config must not start a run");
}

#[test]
fn unknown_key() {
    fails_with(
        "model:\n  n_layer: 2\n  n_layerz: 3\n",
        &[],
        &[
            "bad.yaml:3:3",
            "model: unknown key `n_layerz`, expected one of `kind`, `n_layer`, `n_head`",
        ],
    );
}

#[test]
fn unknown_section() {
    fails_with(
        "trian:\n  max_steps: 3\n",
        &[],
        &["bad.yaml:1:1", "unknown key `trian`", "`train`"],
    );
}

#[test]
fn wrong_type() {
    fails_with(
        "train:\n  max_steps: lots\n",
        &[],
        &["bad.yaml:2:14", "train.max_steps: invalid type: string \"lots\""],
    );
}

#[test]
fn bad_value() {
    fails_with(
        "model:\n  n_embd: 100\n  n_head: 3\n",
        &[],
        &["bad.yaml", "model.n_embd: 100 is not divisible by model.n_head 3"],
    );
    fails_with(
        "train:\n  device: tpu\n",
        &[],
        &["train.device: `tpu` is not a device; use auto, cpu, cuda or cuda:N"],
    );
}

#[test]
fn bad_override() {
    fails_with(
        "",
        &["--set", "train.max_stepz=3"],
        &["--set train.max_stepz=3", "unknown key `max_stepz`"],
    );
    fails_with(
        "",
        &["--set", "train.max_steps=-1"],
        &["--set train.max_steps=-1", "train.max_steps: invalid value"],
    );
    fails_with("", &["--set", "nonsense"], &["expected key.path=value"]);
}

#[test]
fn missing_file() {
    fails_with(
        "",
        &["--set", "data.source=text", "--set", "data.path=nope.txt"],
        &["nope.txt"],
    );
}

/// A float libtorch cannot hold as a 32-bit float is refused at --check, naming the key (it
/// used to pass and die later with exit 1).
#[test]
fn float_beyond_libtorch() {
    fails_with(
        "optim:\n  grad_clip: 1e+308\n",
        &["--check"],
        &[
            "bad.yaml",
            "optim.grad_clip: is 1e308; libtorch holds it as a 32-bit float",
        ],
    );
    fails_with("", &["--check", "--set", "optim.eps=1e-60"], &["optim.eps", "it is 0"]);
}

/// `model.loss` takes `fused` or `full`; anything else is refused by `--check`, naming the key.
#[test]
fn bad_model_loss() {
    fails_with(
        "model:\n  loss: chunked\n",
        &["--check"],
        &[
            "bad.yaml:2",
            "model.loss: is `chunked`; the built-in GPT's loss is fused or full",
        ],
    );
    fails_with(
        "model:\n  kind: torchscript\n  path: m.pt\n  loss: full\n",
        &["--check"],
        &["model.loss", "is a key of the built-in GPT"],
    );
}

/// `oomguard` alone (as a wheel installs it, with no libtorch build beside it): `train` and
/// `plan` say in one line what is missing and how to get it (exit 2); `report` needs none.
#[test]
fn train_without_oomguard_torch_beside_it_says_how_to_get_one() {
    let dir = tempfile::tempdir().unwrap();
    let alone = dir.path().join("oomguard");
    std::fs::copy(bin(), &alone).unwrap();
    for args in [&["train", "configs/demo.yaml"][..], &["plan", "configs/demo.yaml"]] {
        let o = std::process::Command::new(&alone).args(args).output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        let want = format!(
            "oomguard: cannot run {}-torch (install it beside oomguard): ",
            alone.display()
        );
        assert!(err.starts_with(&want) && err.contains("make build"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    let o = std::process::Command::new(&alone)
        .args(["report", "--help"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `oomguard ARGS` in `cwd` exits 2 saying `wants`.
fn refused(args: &[&str], cwd: &std::path::Path, wants: &str) {
    let o = oomguard(args, cwd);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains(wants), "expected {wants:?} in:\n{}", stderr(&o));
}

/// Sizes past any run, which overflowed, aborted or hung before: refused by key, with the
/// bound, before anything is written. A usage error is exit 2, and so are the flags'.
#[test]
fn sizes_past_any_run_are_refused_by_key() {
    for (set, wants) in [
        (
            "train.micro_batch_size=18446744073709551615",
            "train.micro_batch_size: is 18446744073709551615; it must be at most 16777216",
        ),
        (
            "train.eval_batch_size=99999999999",
            "train.eval_batch_size: is 99999999999; it must be at most 16777216",
        ),
        (
            "train.grad_accum_steps=10000000",
            "train.grad_accum_steps: makes a global batch of 8 x 10000000",
        ),
        (
            "data.embedded_bytes=100000000000",
            "data.embedded_bytes: is 100000000000; it must be from 4096",
        ),
        (
            "model.n_layer=4294967295",
            "model.n_layer: is 4294967295; it must be at most 65536",
        ),
        (
            "model.vocab_size=9223372036854775807",
            "model.vocab_size: is 9223372036854775807; it must be at most",
        ),
        (
            "train.micro_batch_size=-3",
            "`-3` is not a micro-batch size; use a whole number of samples from 1, or auto",
        ),
        ("memory.budget=-1", "memory.budget: `-1` is not a size"),
        (
            "train.dist_timeout_s=10000000000000000000",
            "train.dist_timeout_s: is 10000000000000000000; it must be 1 to 1000000000 seconds",
        ),
        ("train.dist_timeout_s=0", "train.dist_timeout_s: is 0"),
        (
            "train.num_threads=4294967296",
            "train.num_threads: is 4294967296; it must be 1 to 4096",
        ),
    ] {
        fails_with("", &["--set", set], &[wants]);
    }
    // Each within its bound, but together past any machine (the planner's sums would wrap).
    fails_with(
        "",
        &[
            "--set",
            "model.n_layer=65536",
            "--set",
            "model.n_embd=1048576",
            "--set",
            "model.n_head=1",
        ],
        &["bad.yaml: model: n_layer x n_embd x block_size is 8796093022208, past any machine"],
    );
    let dir = tempfile::tempdir().unwrap();
    let launch = ["launch", "--nproc-per-node", "100000", "--no-python", "/bin/true"];
    refused(
        &launch,
        dir.path(),
        "--nproc-per-node: is 100000; give 1 to 4096 workers",
    );
}

/// A check past loading (starting weights that are not there) names the config file, the key
/// and the file, with --check as in a run.
#[test]
fn missing_starting_weights_name_the_config() {
    for extra in [&["--check"][..], &[]] {
        fails_with(
            "model:\n  init_from: nowhere.safetensors\n",
            extra,
            &["bad.yaml: model.init_from: ", "nowhere.safetensors"],
        );
    }
}

/// `train.device: cuda` where PyTorch sees no GPU: the key and the fix, not libtorch's trace.
#[test]
fn a_cuda_device_without_a_gpu_is_refused_by_key() {
    if oomguard_probe_cuda() {
        return; // a GPU host: the device exists (tests/cuda_guard.rs runs there)
    }
    fails_with(
        "train:\n  device: cuda\n",
        &["--check"],
        &["bad.yaml: train.device: is cuda but PyTorch sees 0 CUDA device(s) here; use auto (a GPU when there is one) or cpu"],
    );
}

fn oomguard_probe_cuda() -> bool {
    std::process::Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|o| o.status.success() && !o.stdout.is_empty())
}

/// `--resume-from` that is not RUN_DIR/checkpoints/step-N is refused before a file is written
/// (a two-part path once made the current folder the run and rewrote its config.yaml); a fresh
/// run into a folder holding another run's checkpoints is refused (it took them for its own).
#[test]
fn a_resume_or_run_dir_that_is_not_a_run_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    let cfg = cfg.to_str().unwrap();
    std::fs::write(dir.path().join("config.yaml"), "# the user's own\n").unwrap();
    let here = dir.path();
    refused(
        &["train", cfg, "--resume-from", "runs/ok"],
        here,
        "--resume-from: runs/ok: is not a checkpoint directory",
    );
    std::fs::create_dir_all(here.join("a/b")).unwrap();
    refused(
        &["train", cfg, "--resume-from", "a/b"],
        here,
        "is not inside a run's checkpoints/ folder",
    );
    let mine = std::fs::read_to_string(here.join("config.yaml")).unwrap();
    assert_eq!(mine, "# the user's own\n");
    assert!(!here.join("train.log").exists() && !here.join("a/train.log").exists());

    let old = here.join("old");
    std::fs::create_dir_all(old.join("checkpoints/step-00000002")).unwrap();
    let run = ["train", cfg, "--run-dir", old.to_str().unwrap()];
    refused(&run, here, "already holds a run (checkpoints/)");
    assert!(!old.join("config.yaml").exists());
    std::fs::write(here.join("afile"), "").unwrap();
    let run = ["train", cfg, "--run-dir", "afile"];
    refused(&run, here, "--run-dir: afile: is a file, not a directory");
    // What the run writes into it, checked before the first step (it trained every step,
    // then exited 1 at the last checkpoint).
    let odd = here.join("odd");
    std::fs::create_dir_all(&odd).unwrap();
    std::fs::write(odd.join("checkpoints"), "").unwrap();
    let run = ["train", cfg, "--run-dir", odd.to_str().unwrap()];
    refused(
        &run,
        here,
        "checkpoints: is a file, where the run writes its checkpoints",
    );
    assert!(!odd.join("metrics.jsonl").exists());
}

/// A text file whose validation split is too short for the block: the fix names both keys
/// (data.val_fraction moves the split's border), exit 2, and no run is started.
#[test]
fn a_split_too_short_for_the_block_names_the_fraction_that_moves_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tiny.txt"),
        "the quick brown fox jumps over the lazy dog. ".repeat(8),
    )
    .unwrap();
    let cfg = write_config(
        dir.path(),
        "short.yaml",
        "data: {source: text, path: tiny.txt}\nmodel: {block_size: 64}\ntrain: {max_steps: 1}\n",
    );
    // `--check` opens the data as the run does (it said "valid" before).
    for check in [&[][..], &["--check"]] {
        let o = oomguard(&[&["train", cfg.to_str().unwrap()], check].concat(), dir.path());
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        for w in [
            "tiny.txt (validation split): 36 tokens is too short for model.block_size 64",
            "a larger data.val_fraction (now 0.1)",
        ] {
            assert!(err.contains(w), "expected {w:?} in:\n{err}");
        }
    }
}
