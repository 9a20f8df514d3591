//! `cargo bench --bench elastic`: an elastic job's recovery on loopback, as a user runs it.
//! N nodes (a launcher each, one rank each, `--nnodes N-1:N`) train the tiny GPT; one is
//! killed -9 mid-run (the node holding rank 0 on every other trial; never the rendezvous's
//! host, the job's fixed point). Measured: the seconds from the kill to the survivors' first
//! step record at the smaller world, and the membership record's steps recomputed and source,
//! over 10 kills at 2 and at 3 nodes; then the median and the worst case.
#[path = "../tests/common/mod.rs"]
mod tests_common;

use std::time::Instant;
use tests_common::elastic::*;
use tests_common::{records, wait_for_steps};

const KILLS: usize = 10;

/// One kill among `nodes` nodes: (seconds to the next step, steps recomputed, source).
fn trial(nodes: usize, kill_rank0: bool) -> (f64, u64, String) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2000);
    let run = dir.path().join("run");
    // Node ranks by --node-rank: the victim holds rank 0, or the last one.
    let victim = if kill_rank0 { 0 } else { nodes - 1 };
    let mut all = start_nodes(dir.path(), &cfg, &run, nodes, victim, &[]);
    wait_for_steps(&run, 8);
    let at = last_step(&run);
    let i = all.iter().position(|(r, _)| *r == victim).unwrap();
    let t = Instant::now();
    kill(&mut all[i].1);
    let next = wait_for_world(&run, nodes as u64 - 1, at);
    let seconds = (next - t).as_secs_f64();
    let m = loop {
        if let Some(m) = records(&run, "membership").pop() {
            break m;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    for (_, n) in all.iter_mut() {
        let _ = n.kill();
        let _ = n.wait();
    }
    (
        seconds,
        m["steps_recomputed"].as_u64().unwrap_or(u64::MAX),
        m["source"].as_str().unwrap_or("?").to_string(),
    )
}

fn main() {
    for nodes in [2, 3] {
        let (mut secs, mut recomputed) = (vec![], vec![]);
        for k in 0..KILLS {
            let rank0 = k % 2 == 0;
            let (s, r, source) = trial(nodes, rank0);
            println!(
                "elastic nodes={nodes} kill={} killed={} kill_to_next_step_s={s:.2} steps_recomputed={r} source={source}",
                k + 1,
                if rank0 { "rank0" } else { "other" }
            );
            secs.push(s);
            recomputed.push(r as f64);
        }
        let worst = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        println!(
            "elastic nodes={nodes} kills={KILLS} median_s={:.2} worst_s={:.2} recomputed_median={} recomputed_worst={}",
            tests_common::median(secs.clone()),
            worst(&secs),
            tests_common::median(recomputed.clone()),
            worst(&recomputed)
        );
    }
}
