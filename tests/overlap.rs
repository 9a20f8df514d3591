//! The gradient reduction overlapped with backward (`train.overlap_grad_reduce`; by default
//! on for CUDA and across machines), through the real launcher over Gloo: at every bucket size, from one smaller
//! than any parameter to one larger than the model, at 2 and 3 ranks and under ZeRO-1 and
//! ZeRO-2 (each bucket's sum scattered into the shard as it arrives), a run
//! ends where one process does; an OOM part-way through one rank's last backward, its first
//! buckets already sent, is agreed and redone on every rank without a hang or a drift.
mod common;
use common::*;
use oomguard::dist::cost::{EXCHANGES_IN_OVERLAPPED_STEP, EXCHANGES_IN_STEP};
use oomguard::dist::exchange::MESSAGE_BYTES;
use std::path::Path;

fn launched(
    dir: &Path,
    cfg: &Path,
    name: &str,
    world: usize,
    env: &[(&str, &str)],
    set: &[&str],
) -> std::path::PathBuf {
    let run = dir.join(name);
    let mut c = train_command(dir, cfg, &run, world);
    // Overlapped unless the case says otherwise (on one machine's CPU it is off by default).
    c.args(["--set", "train.overlap_grad_reduce=true"]);
    for s in set {
        c.args(["--set", s]);
    }
    // Each run its own micro-batch cache: a size one learned must not start the next.
    let o = c
        .envs(env.iter().copied())
        .env("OOMGUARD_CACHE", dir.join(format!("{name}.cache")))
        .output()
        .unwrap();
    assert!(o.status.success(), "{name}: {}", stderr(&o));
    run
}

/// Exchanges a clean step made, from rank 0's records (2 ranks: one message each way).
fn exchanges(run: &Path) -> Vec<u64> {
    let steps = records(run, "step");
    steps
        .iter()
        .map(|s| s["exchange_bytes"].as_u64().unwrap() / (2 * MESSAGE_BYTES))
        .collect()
}

#[test]
fn every_bucket_size_world_and_stage_ends_where_one_process_does() {
    let dir = tempfile::tempdir().unwrap();
    // A global batch of 15: shards of 8 and 7 (5 each at 3 ranks), micro-batches of 4.
    let cfg = uneven_config(dir.path(), 4, "");
    let single = train_ok(dir.path(), &cfg, &[]);
    let w = weights(&single);
    // The tiny GPT's parameters run from 128 bytes (a bias) to 32 KiB (the embedding).
    for (name, world, set) in [
        ("smaller-than-a-bias", 2, vec!["train.bucket_cap_mb=0.00001"]),
        ("default", 2, vec![]),
        ("larger-than-the-model", 2, vec!["train.bucket_cap_mb=1000"]),
        ("three-ranks", 3, vec!["train.bucket_cap_mb=0.01"]),
        ("zero-1", 2, vec!["train.shard=optimizer", "train.bucket_cap_mb=0.01"]),
        ("zero-2", 2, vec!["train.shard=gradients", "train.bucket_cap_mb=0.01"]),
        (
            "zero-2-one-bucket",
            2,
            vec!["train.shard=gradients", "train.bucket_cap_mb=1000"],
        ),
        (
            "zero-2-three-ranks",
            3,
            vec!["train.shard=gradients", "train.bucket_cap_mb=0.00001"],
        ),
        ("after-backward", 2, vec!["train.overlap_grad_reduce=false"]),
    ] {
        let run = launched(dir.path(), &cfg, name, world, &[], &set);
        let d = max_abs_diff(&w, &weights(&run));
        assert!(d < 1e-5, "{name}: {world} ranks differ from 1 process by {d}");
        if world == 2 {
            // One exchange more a step when overlapped: the vote before the last micro-batch.
            let want = if name == "after-backward" {
                EXCHANGES_IN_STEP
            } else {
                EXCHANGES_IN_OVERLAPPED_STEP
            };
            assert!(
                exchanges(&run).iter().all(|&n| n == want),
                "{name}: {:?}",
                exchanges(&run)
            );
        }
    }
}

#[test]
fn an_oom_part_way_through_a_ranks_last_backward_is_redone_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    // One micro-batch a rank (8 and 7 samples): its backward is the armed one.
    let cfg = uneven_config(dir.path(), 4, "");
    let single = train_ok(dir.path(), &cfg, &["--set", "train.micro_batch_size=8"]);
    // ZeRO-2 too: the buckets summed before the OOM are already in the shard, their
    // gradients dropped.
    for (rank, after, stage) in [
        (1, 60, "none"),
        (0, 5, "none"),
        (1, 0, "none"),
        (0, 60, "gradients"),
        (1, 5, "gradients"),
    ] {
        let spec = format!("backward:{rank}:2:{after}");
        let shard = format!("train.shard={stage}");
        let run = launched(
            dir.path(),
            &cfg,
            &format!("r{rank}a{after}{stage}"),
            2,
            &[("OOMGUARD_TEST_OOM_IN", &spec)],
            &["train.micro_batch_size=8", "train.bucket_cap_mb=0.00001", &shard],
        );
        let ooms = records(&run, "oom");
        assert!(
            ooms.len() == 1 && ooms[0]["step"] == 2 && ooms[0]["phase"] == "backward",
            "{spec} {stage}: {ooms:?}"
        );
        let sizes: Vec<u64> = records(&run, "step")
            .iter()
            .map(|s| s["micro_batch_size"].as_u64().unwrap())
            .collect();
        assert_eq!(&sizes[..2], &[8, 8], "{spec}");
        assert!(sizes[2] < 8, "{spec}: {sizes:?}");
        let d = max_abs_diff(&weights(&single), &weights(&run));
        assert!(d < 1e-5, "{spec} {stage}: differs from one process by {d}");
    }
}
