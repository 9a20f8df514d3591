//! The examples/ MLP, a Rust program's own model, gets what the built-in GPT gets: the
//! guard under a tight budget, checkpoints, and a resume that ends bitwise where an
//! uninterrupted run ends. In-process, through the library's `train` command.
mod common;
#[path = "../examples/mlp.rs"]
mod mlp;
use common::*;

fn train(args: &[&str]) -> i32 {
    oomguard::cli::train::run_with(std::iter::once("mlp").chain(args.iter().copied()), &mlp::build)
}

#[test]
fn own_model_trains_under_the_guard_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("OOMGUARD_CACHE", dir.path().join("cache")); // this test's alone
    let cfg = common::root().join("examples/mlp.yaml");
    let cfg = cfg.to_str().unwrap();
    // --check builds the program's own model and takes the data it brings.
    assert_eq!(train(&[cfg, "--check"]), 0);
    // ... with its model.init_from loaded into it: a file that is not there is bad input.
    assert_eq!(
        train(&[cfg, "--check", "--set", "model.init_from=nowhere.safetensors"]),
        2
    );
    let full = dir.path().join("full");
    assert_eq!(train(&[cfg, "--run-dir", full.to_str().unwrap()]), 0);
    let ooms = records(&full, "oom");
    assert!(!ooms.is_empty(), "the budget should have forced a shrink");
    let steps = records(&full, "step");
    assert_eq!(steps.len(), 150);
    assert!(steps.iter().all(|s| s["num_samples"] == 512));
    assert!(steps.last().unwrap()["micro_batch_size"].as_u64().unwrap() < 512);
    let l = losses(&full);
    assert!(
        l[145..].iter().sum::<f64>() < 0.7 * l[..5].iter().sum::<f64>(),
        "loss did not fall: {:?} .. {:?}",
        &l[..5],
        &l[145..]
    );

    // Half the run, then --resume for the rest: the same parameters, bit for bit.
    let half = dir.path().join("half");
    assert_eq!(
        train(&[cfg, "--run-dir", half.to_str().unwrap(), "--max-steps", "75"]),
        0
    );
    assert_eq!(train(&[cfg, "--run-dir", half.to_str().unwrap(), "--resume"]), 0);
    assert_eq!(records(&half, "resumed").len(), 1);
    assert_eq!(
        max_abs_diff(&weights(&full), &weights(&half)),
        0.0,
        "resume is not exact"
    );

    // A bad key in the model's own settings is refused, naming it.
    let bad = write_config(
        dir.path(),
        "bad.yaml",
        &std::fs::read_to_string(cfg)
            .unwrap()
            .replace("layers: 2}", "layers: 2, width: 3}"),
    );
    assert_eq!(
        train(&[
            bad.to_str().unwrap(),
            "--run-dir",
            dir.path().join("bad").to_str().unwrap()
        ]),
        2
    );
}
