//! `./target/release/oomguard`, the binary the README runs, is the plain build: the tests'
//! own build, with the test hooks, is target/test-hooks/ (the `test-hooks` cargo profile).
mod common;

use std::path::Path;
use std::process::Command;

/// metrics.jsonl's records of `run` with the given event, the lines a writer has finished.
fn events(run: &Path, event: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == event)
        .collect()
}

fn steps(run: &Path) -> Vec<u64> {
    events(run, "step")
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect()
}

/// `./target/release/oomguard`, which the README runs, is the plain build: a test hook
/// (OOMGUARD_TEST_OOM_IN, an OOM in step 1's forward) that fails an allocation in the tests'
/// build (target/test-hooks/) does nothing there.
#[test]
fn the_readmes_binary_is_the_plain_build() {
    let plain = common::plain_bin();
    assert!(
        plain.is_file(),
        "{} is missing: `cargo build --release`",
        plain.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::write_config(dir.path(), "tiny.yaml", common::TINY);
    let ooms = |bin: &Path, name: &str| {
        let run = dir.path().join(name);
        let o = Command::new(bin)
            .args(["train", cfg.to_str().unwrap(), "--max-steps", "2", "--run-dir"])
            .arg(&run)
            .env("OOMGUARD_CACHE", dir.path().join("cache"))
            .env("OOMGUARD_TEST_OOM_IN", "forward:0:1")
            .env("OMP_NUM_THREADS", "1")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}: {}", bin.display(), common::stderr(&o));
        (events(&run, "oom").len(), steps(&run))
    };
    assert_eq!(
        ooms(&common::bin(), "hooks"),
        (1, vec![0, 1]),
        "the tests' build honours the hook"
    );
    assert_eq!(
        ooms(&plain, "plain"),
        (0, vec![0, 1]),
        "{} honours a test hook: it is a test-hooks build (`cargo test --release --features oomguard/test-hooks` writes one there); \
         `cargo build --release` makes it the plain build again",
        plain.display()
    );
}
