//! `make bench` (netns): two "nodes" in network namespaces of their own (tests/common/netns.rs),
//! one rank each, over a veth pair at its own speed and held to 1 Gbit/s by `tc tbf`: plain
//! data parallel and ZeRO-2 train the same GPT, the two links alternated over 4 rounds. For
//! each: the median step time at both speeds and the step's exposed reduction (`comm_s` less
//! the agreements); the bytes rank 0 sent a step, counted by the kernel on its link (a
//! 25-step run less a 5-step one, so the start's broadcast drops out), against the cost
//! model's (`dist::cost`'s wire bytes: on Gloo ZeRO's gradient sum is an all-reduce, its
//! all-gather a broadcast from each rank) and its transfer time at
//! 1 Gbit/s; and the share of that transfer hidden behind computation, 1 - exposed / transfer
//! (at least 0), where the communication exposed at 1 Gbit/s is the step time the slow link
//! adds plus the exposed reduction on the veth (ZeRO's parameter all-gather runs in the
//! update, outside `comm_s`: the step time sees it). Data parallel runs with its reduction
//! after the whole backward (`train.overlap_grad_reduce=false`, the baseline) and overlapped
//! with it (the default) at three bucket sizes; ZeRO-2 after backward and overlapped (its
//! default), at 1 MiB.
//! Root only (the namespaces); they go on every exit path.
mod common;
#[path = "../tests/common/mod.rs"]
mod tests_common;

use common::DIST_CONFIG;

use oomguard::dist::cost::cost;
use oomguard::optim::Shard;
use oomguard::task::Task;
use std::path::Path;
use tests_common::netns::{self, Nodes};
use tests_common::{median, records, stderr, write_config};

const RATE_BITS: f64 = 1e9;
const ROUNDS: usize = 4;

/// Rank 0's steps 5.. of a run: their step times and exposed reductions (comm_s less the
/// agreements).
fn measure(run: &Path) -> (Vec<f64>, Vec<f64>) {
    let steps: Vec<serde_json::Value> = records(run, "step").into_iter().skip(5).collect();
    let of = |f: &dyn Fn(&serde_json::Value) -> f64| steps.iter().map(f).collect();
    (
        of(&|s| s["step_time_s"].as_f64().unwrap()),
        of(&|s| s["comm_s"].as_f64().unwrap_or(0.0) - s["agree_s"].as_f64().unwrap_or(0.0)),
    )
}

fn main() {
    if !netns::available() {
        println!("netns: skipped (network namespaces need root and iproute2)");
        return;
    }
    let bin = Path::new(env!("CARGO_BIN_EXE_oomguard"));
    let dir = tempfile::tempdir().unwrap();
    // The dist bench's GPT at GPT-2's 12 layers, a micro-batch of 8 a rank: the gradients of
    // the block backward reaches last (and the embeddings) are what no overlap can hide, a
    // twelfth of the model here, and the transfer at 1 Gbit/s is under backward's time.
    let config = DIST_CONFIG
        .replace("n_layer: 4", "n_layer: 12")
        .replace("micro_batch_size: 16", "micro_batch_size: 8")
        .replace("global_batch_size: 32", "global_batch_size: 16");
    let cfg = write_config(dir.path(), "gpt.yaml", &config);
    let gpt = oomguard::model::GptConfig {
        n_layer: 12,
        ..Default::default()
    };
    let task = oomguard::task::gpt::GptTask::new(&gpt, tch::Device::Cpu).unwrap();
    let numels: Vec<i64> = task.parameters().iter().map(|(_, t)| t.numel() as i64).collect();
    let fast = Nodes::new("f", None);
    let slow = Nodes::new("s", Some("1gbit"));
    println!(
        "2 nodes (network namespaces, 1 rank and 1 thread each), GPT 12x128 ({:.2}M parameters), global batch 16 (one micro-batch of 8 a rank), 25 steps; link: veth, and tc tbf at 1 Gbit/s",
        numels.iter().sum::<i64>() as f64 / 1e6
    );
    let after = "train.overlap_grad_reduce=false";
    for (name, shard, sets) in [
        (
            "data parallel, after backward",
            Shard::None,
            [after, "train.shard=none"],
        ),
        (
            "data parallel, overlapped, 0.25 MiB buckets",
            Shard::None,
            ["train.bucket_cap_mb=0.25", "train.shard=none"],
        ),
        (
            "data parallel, overlapped, 1 MiB buckets",
            Shard::None,
            ["train.bucket_cap_mb=1", "train.shard=none"],
        ),
        (
            "data parallel, overlapped, 32 MiB buckets (one: the model is 9.7 MB)",
            Shard::None,
            ["train.bucket_cap_mb=32", "train.shard=none"],
        ),
        (
            "ZeRO-2, after backward",
            Shard::Gradients,
            [after, "train.shard=gradients"],
        ),
        (
            "ZeRO-2, overlapped, 1 MiB buckets",
            Shard::Gradients,
            ["train.bucket_cap_mb=1", "train.shard=gradients"],
        ),
    ] {
        let tag_of = sets.join("-").replace('=', "-");
        let set: Vec<&str> = sets.iter().flat_map(|s| ["--set", s]).collect();
        let train = |nodes: &Nodes, tag: &str, extra: &[&str]| {
            let run = dir.path().join(format!("{tag_of}-{tag}"));
            let outs = nodes.train(bin, dir.path(), &cfg, &run, &[&set[..], extra].concat());
            for (r, o) in outs.iter().enumerate() {
                assert!(o.status.success(), "{name} {tag}: node {r}: {}", stderr(o));
            }
            run
        };
        // [veth, 1 Gbit/s]: every step's time and exposed reduction, over the rounds.
        let mut at: [(Vec<f64>, Vec<f64>); 2] = Default::default();
        for round in 0..ROUNDS {
            for (i, nodes) in [&fast, &slow].into_iter().enumerate() {
                let (t, r) = measure(&train(nodes, &format!("{i}-{round}"), &[]));
                at[i].0.extend(t);
                at[i].1.extend(r);
            }
        }
        let sent = |steps: &str| {
            let before = slow.tx_bytes(0);
            train(
                &slow,
                &format!("bytes-{steps}"),
                &["--set", &format!("train.max_steps={steps}")],
            );
            (slow.tx_bytes(0) - before) as f64
        };
        let per_step = (sent("25") - sent("5")) / 20.0;
        // On Gloo ZeRO's gradient sum is an all-reduce (a reduce-scatter after backward, a
        // bucket's all-reduce overlapped) and the all-gather a broadcast from each rank: the
        // cost model's bytes.
        let wire = cost(&numels, 2, shard).wire as f64;
        let transfer = wire * 8.0 / RATE_BITS;
        let [(step_f, red_f), (step_s, red_s)] = at.map(|(t, r)| (median(t), median(r)));
        println!(
            "{name}: step {:.1} ms on the veth, {:.1} ms at 1 Gbit/s; exposed reduction {:.1} ms and {:.1} ms; computation (step less reduction, backward about two thirds of it) {:.1} ms",
            step_f * 1e3,
            step_s * 1e3,
            red_f * 1e3,
            red_s * 1e3,
            (step_s - red_s) * 1e3
        );
        println!(
            "{name}: rank 0 sent {:.2} MB a step (the kernel's count), the cost model says {:.2} MB ({:.2}x): {:.1} ms at 1 Gbit/s",
            per_step / 1e6,
            wire / 1e6,
            per_step / wire,
            transfer * 1e3
        );
        let exposed = step_s - step_f + red_f;
        println!(
            "{name}: communication exposed at 1 Gbit/s {:.1} ms (the step time added, {:.1} ms, plus the veth's exposed reduction); hidden behind computation: {:.0}% of the transfer",
            exposed * 1e3,
            (step_s - step_f) * 1e3,
            (1.0 - exposed / transfer).clamp(0.0, 1.0) * 100.0
        );
        if shard != Shard::None {
            // The gradients' sum alone: its transfer (the plain all-reduce's bytes) against
            // its exposed wait at 1 Gbit/s; the all-gather follows the update, not backward.
            let reduction = cost(&numels, 2, Shard::None).wire as f64 * 8.0 / RATE_BITS;
            println!(
                "{name}: the gradients' reduction alone: {:.1} ms of transfer, {:.1} ms of it exposed at 1 Gbit/s; hidden behind backward: {:.0}% (the all-gather's {:.1} ms follow the update)",
                reduction * 1e3,
                red_s * 1e3,
                (1.0 - red_s / reduction).clamp(0.0, 1.0) * 100.0,
                (transfer - reduction) * 1e3
            );
        }
    }
}
