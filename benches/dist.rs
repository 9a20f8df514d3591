//! `make bench` (dist): 2-rank data-parallel scaling on this machine, one thread per rank,
//! against one rank with one thread: the same GPT, global batch and steps, alternated, 7
//! rounds. Efficiency = tokens/s with 2 ranks / (2 x tokens/s with 1) (floor 0.85), taken
//! within each round (the runs a few seconds apart, so the VM's slow stretches, which last
//! minutes, fall on both sides of the ratio), the median of the rounds' and their range. Also
//! the all-reduce and agreement time per step against the step's time, the agreements'
//! share alone, and 3 ranks (1 thread each, more ranks than cores) as a correctness-under-load
//! run, not a speed figure: its parameters against one process's. And the machine's own
//! ceiling: two independent one-rank runs at once against one alone (no communication at
//! all), so the efficiency can be read against what two busy cores give here, the ranks
//! left unbound to cores (OOMGUARD_CPU_BIND=0), and the ranks' collectives over Gloo's
//! loopback TCP instead of shared memory (OOMGUARD_DIST_SHM=0). And the lock-step ceiling:
//! two independent runs of one rank's share (half the global batch, the same optimizer) at
//! once, each step counted at the slower run's time: what a synchronous step with free
//! communication gives on this machine, so that what data parallel's own code costs is read
//! apart from what the VM's per-step noise costs any lock-step schedule.
mod common;
use common::{events, median};
use std::path::Path;
use std::process::Command;

use common::DIST_CONFIG as CONFIG;

/// Median tokens/s and the mean shares of a step spent communicating and in the agreements
/// alone, steps 5.. of a run.
fn measure(run: &Path) -> (f64, f64, f64) {
    let steps: Vec<serde_json::Value> = events(run, "step").into_iter().skip(5).collect();
    let tps: Vec<f64> = steps.iter().map(|s| s["tokens_per_s"].as_f64().unwrap()).collect();
    let share = |key: &str| {
        let v: Vec<f64> = steps
            .iter()
            .filter_map(|s| Some(s[key].as_f64()? / s["step_time_s"].as_f64()?))
            .collect();
        if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    (median(tps), share("comm_s"), share("agree_s"))
}

fn launch(bin: &str, nproc: &str, cfg: &Path, run: &Path, cache: &Path) {
    launch_with(bin, nproc, cfg, run, cache, &[]);
}

/// `env`: e.g. OOMGUARD_CPU_BIND=0 (the ranks' cores left to the scheduler).
fn launch_with(bin: &str, nproc: &str, cfg: &Path, run: &Path, cache: &Path, env: &[(&str, &str)]) {
    let ok = Command::new(bin)
        .envs(env.iter().copied())
        .args([
            "launch",
            "--nproc-per-node",
            nproc,
            "--master-port",
            "0",
            "--standalone",
            "--no-python",
            bin,
            "train",
            cfg.to_str().unwrap(),
            "--run-dir",
            run.to_str().unwrap(),
        ])
        .env("OMP_NUM_THREADS", "1")
        .env("OOMGUARD_CACHE", cache)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(ok.success());
}

/// Each step's (tokens, seconds), steps 5.. of a run.
fn step_times(run: &Path) -> Vec<(f64, f64)> {
    let steps = events(run, "step").into_iter().skip(5);
    steps
        .map(|s| {
            let t = s["step_time_s"].as_f64().unwrap();
            (s["tokens_per_s"].as_f64().unwrap() * t, t)
        })
        .collect()
}

/// Two runs' steps in lock-step: the median over steps of both runs' tokens over the slower
/// run's time (steps of the same index ran at about the same moment: both started together).
fn lock_step(a: &Path, b: &Path) -> f64 {
    let tps = step_times(a)
        .into_iter()
        .zip(step_times(b))
        .map(|((na, ta), (nb, tb))| (na + nb) / ta.max(tb));
    median(tps.collect())
}

/// The largest difference between two runs' final parameters.
fn max_diff(a: &Path, b: &Path) -> f64 {
    let read = |p: &Path| {
        let mut w = tch::Tensor::read_safetensors(p.join("model.safetensors")).unwrap();
        w.sort_by(|x, y| x.0.cmp(&y.0));
        w
    };
    read(a)
        .iter()
        .zip(read(b))
        .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

const ROUNDS: usize = 7;

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("ddp.yaml");
    std::fs::write(&cfg, CONFIG).unwrap();
    // One rank's share: half the global batch, one micro-batch and one update a step.
    let share_cfg = dir.path().join("share.yaml");
    let share = CONFIG.replace("global_batch_size: 32", "global_batch_size: 16");
    assert_ne!(share, CONFIG, "the share's config must halve the global batch");
    std::fs::write(&share_cfg, share).unwrap();
    let bin = env!("CARGO_BIN_EXE_oomguard");
    let (mut one, mut two, mut comm, mut agree, mut pair, mut unbound) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let (mut tcp, mut tcp_comm) = (vec![], vec![]);
    let (mut locked, mut loose) = (vec![], vec![]);
    for round in 0..ROUNDS {
        let run1 = dir.path().join(format!("one{round}"));
        let ok = Command::new(bin)
            .args(["train", cfg.to_str().unwrap(), "--run-dir", run1.to_str().unwrap()])
            .env("OMP_NUM_THREADS", "1")
            .env("OOMGUARD_CACHE", dir.path())
            .status()
            .unwrap();
        assert!(ok.success());
        one.push(measure(&run1).0);
        // Two independent single-rank runs at once: what two busy cores give, no collective.
        let solo = |name: String, cfg: &Path| {
            let run = dir.path().join(name);
            let child = Command::new(bin)
                .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
                .env("OMP_NUM_THREADS", "1")
                .env("OOMGUARD_CACHE", dir.path())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            (run, child)
        };
        let (mut a, mut b) = (solo(format!("pa{round}"), &cfg), solo(format!("pb{round}"), &cfg));
        assert!(a.1.wait().unwrap().success() && b.1.wait().unwrap().success());
        pair.push(measure(&a.0).0 + measure(&b.0).0);
        let (mut a, mut b) = (
            solo(format!("sa{round}"), &share_cfg),
            solo(format!("sb{round}"), &share_cfg),
        );
        assert!(a.1.wait().unwrap().success() && b.1.wait().unwrap().success());
        locked.push(lock_step(&a.0, &b.0));
        loose.push(measure(&a.0).0 + measure(&b.0).0);
        let run2 = dir.path().join(format!("two{round}"));
        launch(bin, "2", &cfg, &run2, dir.path());
        let (t, c, a) = measure(&run2);
        two.push(t);
        comm.push(c);
        agree.push(a);
        let run_u = dir.path().join(format!("unbound{round}"));
        launch_with(bin, "2", &cfg, &run_u, dir.path(), &[("OOMGUARD_CPU_BIND", "0")]);
        unbound.push(measure(&run_u).0);
        let run_t = dir.path().join(format!("tcp{round}"));
        launch_with(bin, "2", &cfg, &run_t, dir.path(), &[("OOMGUARD_DIST_SHM", "0")]);
        let (t, c, _) = measure(&run_t);
        tcp.push(t);
        tcp_comm.push(c);
        println!(
            "round {round}: 1 rank {:.0} tok/s, 2 ranks {:.0} tok/s, efficiency {:.2}, ceiling {:.2}, against it {:.2}; \
            lock-step ceiling {:.2}, against it {:.2}",
            one[round],
            two[round],
            two[round] / (2.0 * one[round]),
            pair[round] / (2.0 * one[round]),
            two[round] / pair[round],
            locked[round] / (2.0 * one[round]),
            two[round] / locked[round]
        );
    }
    // Each round's ratio over its own one-rank run.
    let ratio = |x: &[f64]| -> Vec<f64> { x.iter().zip(&one).map(|(x, a)| x / (2.0 * a)).collect() };
    let range = |v: &[f64]| {
        (
            v.iter().cloned().fold(f64::INFINITY, f64::min),
            v.iter().cloned().fold(0.0, f64::max),
        )
    };
    let eff = ratio(&two);
    let (lo, hi) = range(&eff);
    let e = median(eff);
    println!("2-rank scaling efficiency (1 thread per rank, GPT 4x128, global batch 32): {e:.2} (floor 0.85; rounds {lo:.2}..{hi:.2})");
    println!(
        "  the same with the ranks' cores left to the scheduler (OOMGUARD_CPU_BIND=0): {:.2}",
        median(ratio(&unbound))
    );
    println!(
        "  the same over Gloo's loopback TCP instead of shared memory (OOMGUARD_DIST_SHM=0): {:.2}, all-reduce and agreements {:.1}% of a step",
        median(ratio(&tcp)),
        100.0 * median(tcp_comm)
    );
    let ceiling = median(ratio(&pair));
    // Against the ceiling within each round (the pair and the 2 ranks run a few seconds apart).
    let against: Vec<f64> = two.iter().zip(&pair).map(|(t, p)| t / p).collect();
    let (alo, ahi) = range(&against);
    println!(
        "the machine's ceiling (two independent 1-thread runs at once over 2 x one alone): {ceiling:.2}; the efficiency against it: {:.2} \
        (each round's 2 ranks over its pair; rounds {alo:.2}..{ahi:.2})",
        median(against)
    );
    let against: Vec<f64> = two.iter().zip(&locked).map(|(t, l)| t / l).collect();
    let (llo, lhi) = range(&against);
    println!(
        "the lock-step ceiling (two independent runs of one rank's share at once, 16 rows and one update a step, each step at the \
        slower run's time: a synchronous step with free communication): {:.2} of 2 x one alone, the same two runs unsynchronized \
        {:.2}; the efficiency against it: {:.2} (rounds {llo:.2}..{lhi:.2})",
        median(ratio(&locked)),
        median(ratio(&loose)),
        median(against)
    );
    println!("all-reduce and agreements: {:.1}% of a data-parallel step, of which the agreements (waiting for the slower rank included) \
        {:.1}%", 100.0 * median(comm), 100.0 * median(agree));
    let run3 = dir.path().join("three");
    launch(bin, "3", &cfg, &run3, dir.path());
    let steps = events(&run3, "step").len();
    println!("3 ranks on 2 cores (1 thread each; correctness under load, not speed): {steps} steps, parameters within {:.1e} of one \
        process", max_diff(&dir.path().join("one0"), &run3));
}
