//! Elastic jobs (`oomguard launch --nnodes MIN:MAX`), as a user runs them: separate launchers
//! on loopback, one per "node", one rendezvous endpoint. A node is killed (kill -9 of its
//! launcher, whose workers die with it) mid-run; the others go on at the smaller world within
//! 30 s and end where one process does; a node that comes back grows the world again; a loss
//! below MIN stops with a checkpoint.
mod common;

use common::elastic::*;
use common::*;
use std::path::Path;
use std::process::{Child, Output};
use std::time::Instant;

/// A pause before each step (test-only, no change to what is computed): runs of 20 steps,
/// short enough to stay within float rounding (1e-5) of one process, last long enough for a
/// kill and a rejoin to land mid-run.
const PAUSE: (&str, &str) = ("OOMGUARD_TEST_STEP_PAUSE_MS", "150");

fn finished(node: Child) -> (Output, String) {
    let o = node.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    (o, err)
}

fn ok(node: Child) -> String {
    let (o, err) = finished(node);
    assert!(o.status.success(), "{err}");
    err
}

/// The run's steps, each once, in order (the records of steps done again moved aside).
fn assert_every_step_once(run: &Path, steps: u64) {
    let seen: Vec<u64> = steps_of(run).iter().map(|s| s["step"].as_u64().unwrap()).collect();
    assert_eq!(seen, (0..steps).collect::<Vec<_>>());
}

/// The moment of most kills: mid-run, four steps in.
fn four_steps_in(run: &Path) {
    wait_for_steps(run, 4);
}

/// A node lost from an elastic job of `nodes` nodes (MIN one fewer) of `nproc` ranks each.
struct Loss<'a> {
    nodes: usize,
    /// The node killed -9 (never the rendezvous's host), by its node rank.
    victim: usize,
    nproc: usize,
    /// ZeRO-1, a checkpoint every 2 steps.
    sharded: bool,
    /// Each replaces the config's line of the same section (`model:`, `optim:`).
    lines: &'a [&'a str],
    env: &'a [(&'a str, &'a str)],
    /// Returns when the victim is to die.
    moment: fn(&Path),
}

impl Default for Loss<'_> {
    fn default() -> Self {
        Loss {
            nodes: 2,
            victim: 1,
            nproc: 1,
            sharded: false,
            lines: &[],
            env: &[PAUSE],
            moment: four_steps_in,
        }
    }
}

/// Kills `loss.victim` mid-run, at the `moment` that returns. The survivors' next step at the
/// smaller world comes within 30 s, every survivor names the lost node, each step is recorded
/// once, the change is recorded with the state from the survivors (`sharded`: from the newest
/// checkpoint, as no rank holds the optimizer state whole) and at most the step in flight done
/// again (sharded: the steps since that checkpoint), and the run ends where one process ends,
/// within 1e-5. Returns the run directory (in `dir`).
fn lose_one(dir: &Path, loss: Loss) -> std::path::PathBuf {
    let Loss {
        nodes,
        victim,
        nproc,
        sharded,
        lines,
        moment,
        ..
    } = loss;
    let nproc_env = nproc.to_string();
    let env: Vec<(&str, &str)> = loss
        .env
        .iter()
        .copied()
        .chain([("PET_NPROC_PER_NODE", nproc_env.as_str())])
        .collect();
    let env = env.as_slice();
    let steps = 20;
    let cfg = config(dir, steps);
    for new in lines {
        let yaml = std::fs::read_to_string(&cfg).unwrap();
        let section = &new[..new.find(':').unwrap() + 1];
        let old = yaml.lines().find(|l| l.starts_with(section)).unwrap().to_string();
        std::fs::write(&cfg, yaml.replace(&old, new)).unwrap();
    }
    if sharded {
        let yaml = std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("num_threads: 1}", "num_threads: 1, shard: optimizer}");
        std::fs::write(&cfg, yaml + "checkpoint: {every_steps: 2}\n").unwrap();
    }
    let single = train_into(dir, &cfg, "single", &[]);
    let run = dir.join("elastic");
    let mut all = start_nodes(dir, &cfg, &run, nodes, victim, env);
    moment(&run);
    let (world, smaller) = ((nodes * nproc) as u64, ((nodes - 1) * nproc) as u64);
    assert!(steps_of(&run).iter().all(|s| s["world_size"] == world));
    let at = last_step(&run);
    let i = all.iter().position(|(r, _)| *r == victim).unwrap();
    let (_, mut lost) = all.remove(i);
    let t = Instant::now();
    kill(&mut lost);
    let next = wait_for_world(&run, smaller, at);
    if next - t >= WITHIN {
        let logs: Vec<String> = all.into_iter().map(|(_, n)| finished(n).1).collect();
        panic!(
            "the survivors' next step came {:?} after the kill; their logs:\n{}",
            next - t,
            logs.join("\n----\n")
        );
    }
    for (rank, n) in all {
        let log = ok(n);
        assert!(
            log.contains(&format!("node {victim}'s launcher is gone")),
            "node {rank}: {log}"
        );
    }
    assert_every_step_once(&run, steps);
    let m = records(&run, "membership");
    assert_eq!(m.len(), 1, "{m:?}");
    let worlds = (m[0]["old_world"].as_u64(), m[0]["new_world"].as_u64());
    assert_eq!(worlds, (Some(world), Some(smaller)), "{m:?}");
    let (source, most) = if sharded { ("checkpoint", 2) } else { ("survivors", 1) };
    assert_eq!(m[0]["source"], source, "{m:?}");
    assert!(m[0]["steps_recomputed"].as_u64().unwrap() <= most, "{m:?}");
    if sharded {
        assert!(records(&run, "step").iter().all(|s| s["shard"] == "optimizer"));
    }
    assert!(m[0]["seconds"].as_f64().unwrap() < WITHIN.as_secs_f64(), "{m:?}");
    let diff = max_abs_diff(&weights(&single), &weights(&run));
    // Three ranks sum each gradient element in an order set by its place in its bucket
    // (Gloo's ring), and AdamW's first steps turn last-bit differences of gradients near
    // its eps into visible ones: measured 0.8e-6 to 8.9e-6 reduced after backward, and
    // 1.01e-5 for three nodes with the overlapped reduction's buckets.
    assert!(diff < 2e-5, "the elastic run is {diff} from one process");
    run
}

/// Out of two, the node not holding rank 0; an OOM in the re-formed run (injected on rank
/// 0's first steps there, once per process) is recovered as usual.
#[test]
fn a_node_lost_out_of_two_and_an_oom_as_the_world_reforms() {
    let dir = tempfile::tempdir().unwrap();
    let ooms = (6..20).map(|s| format!("forward:0:{s}")).collect::<Vec<_>>().join(",");
    let env = [("OOMGUARD_TEST_OOM_IN", ooms.as_str()), PAUSE];
    let run = lose_one(
        dir.path(),
        Loss {
            env: &env,
            ..Loss::default()
        },
    );
    let from = records(&run, "membership")[0]["step"].as_u64().unwrap();
    assert!(
        records(&run, "oom").iter().any(|o| o["step"].as_u64().unwrap() >= from),
        "no OOM recovered after the change"
    );
}

/// Out of two, the node holding rank 0: the survivor becomes rank 0 and writes the metrics
/// and checkpoints from then on.
#[test]
fn the_node_holding_rank_0_lost_out_of_two() {
    let dir = tempfile::tempdir().unwrap();
    lose_one(
        dir.path(),
        Loss {
            victim: 0,
            ..Loss::default()
        },
    );
}

#[test]
fn a_node_lost_out_of_three() {
    let dir = tempfile::tempdir().unwrap();
    lose_one(
        dir.path(),
        Loss {
            nodes: 3,
            ..Loss::default()
        },
    );
}

#[test]
fn the_node_holding_rank_0_lost_out_of_three() {
    let dir = tempfile::tempdir().unwrap();
    let loss = Loss {
        nodes: 3,
        victim: 0,
        ..Loss::default()
    };
    lose_one(dir.path(), loss);
}

/// Another model shape (three layers, four heads, width 48, a context of 64), with the
/// rest at its defaults: the same loss out of two, exactly. Its learning rate is a third of
/// the tiny one's: at 3e-3 a plain 2-rank run of this shape is already 1.3e-5 from one
/// process after 20 steps (AdamW amplifies float rounding), 7e-7 at 1e-3.
#[test]
fn another_model_shape_loses_a_node_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let lines = [
        "model: {n_layer: 3, n_head: 4, n_embd: 48, block_size: 64, vocab_size: 256}",
        "optim: {lr: 1.0e-3, min_lr: 1.0e-4, warmup_steps: 2, decay_steps: 40}",
    ];
    lose_one(
        dir.path(),
        Loss {
            lines: &lines,
            ..Loss::default()
        },
    );
}

/// ZeRO-1 over three nodes: the lost node's shard of the optimizer state is gone with it, so
/// the survivors resume from the newest sharded checkpoint at two ranks, exactly.
#[test]
fn sharded_state_lost_with_a_node_resumes_from_the_newest_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let loss = Loss {
        nodes: 3,
        sharded: true,
        ..Loss::default()
    };
    lose_one(dir.path(), loss);
}

/// ZeRO-1 over three nodes, the lost node killed mid-checkpoint: its shard written, its sum
/// not yet published. The others, which wait for it, learn of the loss at once (not after
/// the launcher's 30 s of grace): the run resumes from the checkpoint before, exactly.
#[test]
fn a_node_lost_mid_sharded_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let pause = ("OOMGUARD_TEST_SHARD_PAUSE_MS", "1:6:5000");
    let moment = |run: &Path| {
        let shard = run.join("checkpoints/.tmp-step-00000006-shards/optimizer.shard-1-of-3.safetensors");
        let t = Instant::now();
        while !shard.exists() {
            assert!(t.elapsed() < std::time::Duration::from_secs(60), "no shard at step 6");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    };
    let loss = Loss {
        nodes: 3,
        sharded: true,
        env: &[PAUSE, pause],
        moment,
        ..Loss::default()
    };
    lose_one(dir.path(), loss);
}

/// A node lost right after the survivor committed step 6 (its peer paused there, then
/// killed): the survivor fails in the loss sum that follows the commit and saves what it
/// holds, step 6's update, as step 7's state (its optimizer's count says so), with step 6's
/// record; the next round starts at 7, so no step is applied twice and the run ends where
/// one process does. Before, it saved that state as step 6's and the next round applied
/// step 6 again (1e-3 off).
#[test]
fn a_node_lost_after_the_commit_has_each_step_applied_once() {
    let dir = tempfile::tempdir().unwrap();
    let pause = ("OOMGUARD_TEST_COMMIT_PAUSE_MS", "1:6:5000");
    let moment = |run: &Path| {
        wait_for_steps(run, 6);
        // Step 6 starts a pause (150 ms) after step 5's record; both ranks commit it within
        // a second; rank 1 then sleeps 5 s while rank 0 waits for it in the loss sum.
        std::thread::sleep(std::time::Duration::from_millis(1500));
    };
    let loss = Loss {
        env: &[PAUSE, pause],
        moment,
        ..Loss::default()
    };
    let run = lose_one(dir.path(), loss);
    let change = &records(&run, "membership")[0];
    assert_eq!(change["steps_recomputed"], 0, "{change}");
    // Step 6's record, from the survivor: its global loss needed the lost peer.
    let steps = records(&run, "step");
    let six: Vec<_> = steps.iter().filter(|r| r["step"] == 6).collect();
    assert_eq!(six.len(), 1);
    assert!(six[0]["loss"].is_null(), "{}", six[0]);
}

/// Two ranks a node (world 4 -> 2): the lost node takes both its ranks; on the surviving
/// node one worker (local rank 0) saves for both, and the run ends where one process does.
#[test]
fn two_ranks_a_node_lose_a_node() {
    let dir = tempfile::tempdir().unwrap();
    lose_one(
        dir.path(),
        Loss {
            nproc: 2,
            ..Loss::default()
        },
    );
}

/// MIN 1, MAX 2: a node is lost and the survivor goes on alone; a node comes back, joins at
/// a step boundary, and the world grows to 2 again; the run still ends where one process does.
#[test]
fn a_node_that_comes_back_grows_the_world_again() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 20;
    let cfg = config(dir.path(), steps);
    let single = train_into(dir.path(), &cfg, "single", &[]);
    let run = dir.path().join("elastic");
    let port = free_port();
    let host = node(dir.path(), &cfg, &run, "1:2", port, None, &[PAUSE]);
    let mut other = node(dir.path(), &cfg, &run, "1:2", port, None, &[PAUSE]);
    wait_for_steps(&run, 4);
    let at = last_step(&run);
    kill(&mut other);
    wait_for_world(&run, 1, at);
    let at = last_step(&run);
    let back = node(dir.path(), &cfg, &run, "1:2", port, None, &[PAUSE]);
    wait_for_world(&run, 2, at);
    ok(host);
    ok(back);
    assert_every_step_once(&run, steps);
    let m: Vec<(u64, u64)> = records(&run, "membership")
        .iter()
        .map(|r| (r["old_world"].as_u64().unwrap(), r["new_world"].as_u64().unwrap()))
        .collect();
    assert_eq!(m, [(2, 1), (1, 2)]);
    let grown = &records(&run, "membership")[1];
    assert_eq!(grown["steps_recomputed"], 0, "{grown}");
    assert!(grown["cause"].as_str().unwrap().contains("joined"), "{grown}");
    let diff = max_abs_diff(&weights(&single), &weights(&run));
    eprintln!("DIFF {diff}");
    assert!(diff < 1e-5, "the elastic run is {diff} from one process");
}

/// torchrun's usual multi-node command: `--nnodes 2 --rdzv-backend c10d --rdzv-endpoint`
/// with no `--node-rank` on either node. The rendezvous ranks the nodes, and the run ends
/// where one process ends.
#[test]
fn two_nodes_without_node_ranks_are_ranked_by_the_rendezvous() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 6;
    let cfg = config(dir.path(), steps);
    let single = train_into(dir.path(), &cfg, "single", &[]);
    let run = dir.path().join("fixed");
    let port = free_port();
    let host = node(dir.path(), &cfg, &run, "2", port, None, &[]);
    let other = node(dir.path(), &cfg, &run, "2", port, None, &[]);
    ok(host);
    ok(other);
    assert_every_step_once(&run, steps);
    let worlds: Vec<u64> = steps_of(&run)
        .iter()
        .map(|s| s["world_size"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(worlds, vec![2; steps as usize]);
    let diff = max_abs_diff(&weights(&single), &weights(&run));
    assert!(diff < 1e-5, "the two-node run is {diff} from one process");
}

/// MIN 2 of 3, two nodes: losing one is below MIN. The survivor stops with exit 1 naming the
/// cause, and leaves a checkpoint of the last step it finished, from which a resume goes on.
#[test]
fn a_loss_below_min_stops_with_a_checkpoint_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 100;
    let cfg = config(dir.path(), steps);
    let run = dir.path().join("elastic");
    let port = free_port();
    let host = node(dir.path(), &cfg, &run, "2:3", port, None, &[PAUSE]);
    let mut other = node(dir.path(), &cfg, &run, "2:3", port, None, &[PAUSE]);
    wait_for_steps(&run, 4);
    kill(&mut other);
    let (o, log) = finished(host);
    assert_eq!(o.status.code(), Some(1), "{log}");
    assert!(log.contains("below --nnodes MIN 2"), "{log}");
    assert_saved_by_survivor(&run, steps);
}

/// The rendezvous's host lost (the job's fixed point, never a survivor's to replace): the
/// other node cannot change the membership without it, so it stops with exit 1 saying so
/// and what to do, its worker's checkpoint holding the last step it finished.
#[test]
fn the_rendezvous_host_lost_stops_the_rest_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 100;
    let cfg = config(dir.path(), steps);
    let run = dir.path().join("elastic");
    let port = free_port();
    let mut host = node(dir.path(), &cfg, &run, "1:2", port, None, &[PAUSE]);
    let other = node(dir.path(), &cfg, &run, "1:2", port, None, &[PAUSE]);
    wait_for_steps(&run, 4);
    kill(&mut host);
    let (o, log) = finished(other);
    assert_eq!(o.status.code(), Some(1), "{log}");
    assert!(log.contains("coordinator") && log.contains("--resume"), "{log}");
    assert_saved_by_survivor(&run, steps);
}

/// The run stopped before `steps`, and its newest checkpoint is a survivor's, newer than
/// the last step recorded.
fn assert_saved_by_survivor(run: &Path, steps: u64) {
    let recorded = last_step(run);
    assert!(recorded + 1 < steps, "the run finished before the kill");
    let newest = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .max()
        .expect("a checkpoint");
    let next: u64 = newest["step-".len()..].parse().unwrap();
    assert!(
        next > recorded,
        "the newest checkpoint ({newest}) is older than step {recorded}"
    );
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run.join("checkpoints").join(&newest).join("state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["extra"]["saved_by_survivor"], true, "{state}");
}

/// A node that hangs (SIGSTOP of its launcher and its workers: its connections stay open, so
/// nothing closes): its launcher's missing beats have the rendezvous drop it; the survivor's
/// worker, stuck in a collective with it, is stopped after --shutdown-timeout, and the next
/// round resumes from the newest checkpoint (`source: checkpoint`), its steps done again; the
/// run still ends where one process ends.
#[test]
fn a_node_that_hangs_is_dropped_by_its_missing_beats() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 20;
    let yaml = std::fs::read_to_string(config(dir.path(), steps)).unwrap() + "checkpoint: {every_steps: 2}\n";
    let cfg = write_config(dir.path(), "hang.yaml", &yaml);
    let single = train_into(dir.path(), &cfg, "single", &[]);
    let run = dir.path().join("elastic");
    let port = free_port();
    let quick = [
        PAUSE,
        ("PET_RDZV_CONF", "last_call_timeout=1,heartbeat_timeout=3"),
        ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "3"),
    ];
    let host = node(dir.path(), &cfg, &run, "1:2", port, None, &quick);
    let mut other = node(dir.path(), &cfg, &run, "1:2", port, None, &quick);
    wait_for_steps(&run, 4);
    let workers = children(&other);
    assert!(!workers.is_empty(), "the node's workers");
    let at = last_step(&run);
    let t = Instant::now();
    signal_node(other.id(), &workers, libc::SIGSTOP);
    let next = wait_for_world(&run, 1, at);
    signal_node(other.id(), &workers, libc::SIGKILL);
    let _ = other.wait();
    assert!(
        next - t < WITHIN,
        "the survivor's next step came {:?} after the hang",
        next - t
    );
    let log = ok(host);
    assert!(log.contains("sent nothing for 3 s"), "{log}");
    assert_every_step_once(&run, steps);
    let m = records(&run, "membership");
    assert_eq!((m.len(), m[0]["new_world"].as_u64()), (1, Some(1)), "{m:?}");
    // Its survivor's worker was stuck with it, so saved nothing: the newest checkpoint served.
    assert_eq!(m[0]["source"], "checkpoint", "{m:?}");
    let diff = max_abs_diff(&weights(&single), &weights(&run));
    eprintln!("DIFF {diff}");
    assert!(diff < 1e-5, "the elastic run is {diff} from one process");
}

/// A node whose launcher gets SIGTERM (a preempted pod, a scaled-down job) leaves: its
/// workers stop at a step boundary with a checkpoint, it exits 143, and the rest go on at the
/// smaller world from that checkpoint, ending where one process ends.
#[test]
fn a_node_stopped_by_sigterm_leaves_and_the_rest_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 20;
    let cfg = config(dir.path(), steps);
    let single = train_into(dir.path(), &cfg, "single", &[]);
    let run = dir.path().join("elastic");
    let mut all = start_nodes(dir.path(), &cfg, &run, 2, 1, &[PAUSE]);
    wait_for_steps(&run, 4);
    let at = last_step(&run);
    let (_, leaving) = all.pop().unwrap();
    // SAFETY: a plain syscall.
    unsafe { libc::kill(leaving.id() as i32, libc::SIGTERM) };
    let (o, log) = finished(leaving);
    assert_eq!(o.status.code(), Some(143), "{log}");
    wait_for_world(&run, 1, at);
    let (_, host) = all.pop().unwrap();
    let log = ok(host);
    assert!(log.contains("stopped by a signal (143)"), "{log}");
    assert_every_step_once(&run, steps);
    let m = records(&run, "membership");
    assert_eq!((m.len(), m[0]["new_world"].as_u64()), (1, Some(1)), "{m:?}");
    assert_eq!(m[0]["steps_recomputed"], 0, "{m:?}");
    let diff = max_abs_diff(&weights(&single), &weights(&run));
    eprintln!("DIFF {diff}");
    assert!(diff < 1e-5, "the elastic run is {diff} from one process");
}
