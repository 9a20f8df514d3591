//! Early stopping (ASHA) on a sweep of the tiny GPT: 8 learning rates over two decades and
//! 2 that diverge on purpose, written as a W&B sweep file (`early_terminate: hyperband`),
//! against the same sweep without early stopping; then kill -9 mid-way and a restart.
mod common;

use common::{dies_with_test, isolated, write_config};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The tiny GPT (rungs at steps 3, 9 and 27) and the learning rates, shared with benches/sweep.rs.
const BASE: &str = include_str!("golden/asha/base.yaml");
const PARAMS: &str = include_str!("golden/asha/parameters.yaml");

fn sweep_cmd(dir: &Path, file: &Path, out: &str) -> Command {
    let mut cmd = Command::new(common::bin());
    isolated(&mut cmd, dir)
        .arg("sweep")
        .arg(file)
        .args(["--out", out])
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1");
    dies_with_test(&mut cmd);
    cmd
}

fn results(out: &Path) -> BTreeMap<String, Value> {
    let text = std::fs::read_to_string(out.join("results.jsonl")).unwrap_or_default();
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|r| (r["trial"].as_str().unwrap().to_string(), r))
        .collect()
}

fn run(dir: &Path, file: &Path, out: &str) -> BTreeMap<String, Value> {
    let o = sweep_cmd(dir, file, out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    results(&dir.join(out))
}

fn lr(r: &Value) -> f64 {
    r["params"]["optim.lr"].as_f64().unwrap()
}

/// What must not change between two sweeps that decided the same: status, steps, rungs
/// (steps, values, decisions) and the final metrics.
fn decisions(r: &BTreeMap<String, Value>) -> Vec<Value> {
    r.values()
        .map(|x| {
            serde_json::json!([
                x["trial"],
                x["status"],
                x["steps"],
                x["rung"],
                x["rungs"],
                x["final_eval_loss"],
                x["best_eval_loss"]
            ])
        })
        .collect()
}

#[test]
fn asha_stops_the_hopeless_trials_early_and_replays_its_decisions_after_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_config(d, "base.yaml", BASE);
    let wandb = write_config(
        d,
        "asha.yaml",
        &format!("program: train.py\nbase: base.yaml\nmethod: grid\nplanner: false\nmetric: {{name: val_loss, goal: minimize}}\nearly_terminate: \
            {{type: hyperband, min_iter: 3, eta: 3}}\n{PARAMS}"),
    );
    let full = write_config(
        d,
        "full.yaml",
        &format!("base: base.yaml\nmethod: grid\nplanner: false\nmetric: final_eval_loss\n{PARAMS}"),
    );

    let t = Instant::now();
    let asha = run(d, &wandb, "asha");
    let asha_s = t.elapsed().as_secs_f64();
    // Two slots (a thread each): the same per-trial results, in half the time.
    let o = sweep_cmd(d, &full, "full").args(["--parallel", "2"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let all = results(&d.join("full"));
    assert_eq!((asha.len(), all.len()), (8, 8));
    let steps = |r: &BTreeMap<String, Value>| r.values().map(|x| x["steps"].as_u64().unwrap()).sum::<u64>();
    println!(
        "ASHA: {} steps in {asha_s:.1}s; without early stopping: {} steps",
        steps(&asha),
        steps(&all)
    );
    assert!(
        steps(&asha) * 2 <= steps(&all),
        "ASHA spent {} steps, the full sweep {}",
        steps(&asha),
        steps(&all)
    );
    for r in asha.values().filter(|r| lr(r) >= 30.0) {
        assert_eq!(
            (r["status"].as_str(), r["rung"].as_u64(), r["steps"].as_u64()),
            (Some("stopped_early"), Some(3), Some(3)),
            "diverging: {r}"
        );
        assert_eq!(r["rungs"].as_array().unwrap().len(), 1, "{r}");
    }
    // The best trial (by the sweep's metric) ran to max_steps, and its result is the one it
    // has in the full sweep: the same losses, bit for bit the same weights.
    let best = asha
        .values()
        .filter(|r| r["final_eval_loss"].is_number())
        .min_by(|a, b| {
            a["final_eval_loss"]
                .as_f64()
                .unwrap()
                .total_cmp(&b["final_eval_loss"].as_f64().unwrap())
        })
        .unwrap();
    assert_eq!(
        (best["status"].as_str(), best["steps"].as_u64()),
        (Some("ok"), Some(27)),
        "{best}"
    );
    let same = &all[best["trial"].as_str().unwrap()];
    assert_eq!(
        (&best["final_eval_loss"], &best["best_eval_loss"]),
        (&same["final_eval_loss"], &same["best_eval_loss"]),
        "{best}\n{same}"
    );
    let weights = |out: &str, r: &Value| {
        std::fs::read(
            d.join(out)
                .join(r["run_dir"].as_str().unwrap())
                .join("model.safetensors"),
        )
        .unwrap()
    };
    assert!(
        weights("asha", best) == weights("full", same),
        "the best trial's weights differ from its full run's"
    );
    let out =
        String::from_utf8_lossy(&sweep_cmd(d, &wandb, "asha").arg("--status").output().unwrap().stdout).into_owned();
    assert!(out.contains("stopped_early (step 3)"), "{out}");

    // kill -9 mid-way (a trial mid-segment or between decisions), then the same command:
    // the same decisions, the same results.
    let mut child = sweep_cmd(d, &wandb, "again")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while results(&d.join("again"))
        .values()
        .filter(|r| r["rungs"].is_array())
        .count()
        < 4
    {
        assert!(t.elapsed() < Duration::from_secs(120), "the sweep never got going");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(700));
    child.kill().unwrap();
    child.wait().unwrap();
    let partial = results(&d.join("again"));
    assert!(
        partial.len() < 8
            || partial
                .values()
                .any(|r| r["status"] != "ok" && r["status"] != "stopped_early"),
        "killed before the end"
    );
    let again = run(d, &wandb, "again");
    assert_eq!(decisions(&again), decisions(&asha));
}

/// A sweep ranked by a metric it maximizes (tokens_per_s) still stops by loss: a rung's value
/// is a loss, lower better, so the diverging trials stop at the first rung and the sane one
/// goes on (they were kept, the sane one stopped, when the rung took the sweep's direction).
#[test]
fn early_stopping_keeps_the_lowest_losses_when_the_sweep_maximizes_another_metric() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_config(d, "base.yaml", BASE);
    let spec = write_config(
        d,
        "fast.yaml",
        "program: train.py\nbase: base.yaml\nmethod: grid\nplanner: false\nmetric: {name: tokens_per_s, goal: maximize}\n\
         early_terminate: {type: hyperband, min_iter: 3, eta: 3}\nparameters:\n  optim.lr: {values: [1.0e-2, 30.0, 100.0]}\n",
    );
    let r = run(d, &spec, "fast");
    let by_lr: Vec<(f64, Option<&str>, Option<u64>)> = r
        .values()
        .map(|x| (lr(x), x["status"].as_str(), x["steps"].as_u64()))
        .collect();
    for (l, status, steps) in &by_lr {
        let want = if *l >= 30.0 {
            (Some("stopped_early"), Some(3))
        } else {
            (Some("ok"), Some(27))
        };
        assert_eq!((*status, *steps), want, "lr {l}: {by_lr:?}");
    }
}
