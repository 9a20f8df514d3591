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
