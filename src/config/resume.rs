//! Owns a resume's identity check: the resuming config against `RUN_DIR/config.yaml`.
//! Keeps: a change that alters the trajectory is refused unless `--allow-change`; any other
//! change passes and is logged. Pure, tested below.
use serde::{Deserialize, Serialize};
use std::path::Path;

use super::RawConfig;

/// One key that differs between the stored config and the resuming one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Change {
    pub key: String,
    pub stored: String,
    pub new: String,
    /// It alters the run's trajectory (refused without `--allow-change`).
    pub alters: bool,
}

/// The changes a resume goes on with, for the `config_changed` event.
#[derive(Debug, Clone, PartialEq)]
pub struct Changed {
    pub changes: Vec<Change>,
    /// `--allow-change` accepted changes that alter the run.
    pub allowed: bool,
    /// The earlier config's copy in the run directory (`config.NNN.yaml`).
    pub kept: String,
}

/// Keys (or sections, ending in '.') that never alter the trajectory: where and how the run
/// reports, saves and fits in memory, and what moves it between machines (resume handles
/// those exactly or records them).
const FREE: &[&str] = &[
    "log.",
    "checkpoint.",
    "memory.",
    "train.eval_every",
    "train.eval_batch_size",
    "train.eval_batches",
    "train.device",
    "train.num_threads",
    "train.dist_timeout_s",
    "train.overlap_grad_reduce",
    "train.bucket_cap_mb",
    "train.shard",
    "train.precision",
    "model.activation_checkpointing",
    "model.loss",
];

/// Keys compared through what they decide (the global batch, the schedule's length), so
/// that `micro_batch_size` x `grad_accum_steps` may be re-cut and `max_steps` extended
/// while `optim.decay_steps` pins the schedule (the sweeps' ASHA segments do this).
const DERIVED: &[&str] = &[
    "train.micro_batch_size",
    "train.grad_accum_steps",
    "train.global_batch_size",
    "train.max_steps",
    "optim.decay_steps",
];

fn is_free(key: &str) -> bool {
    FREE.iter().any(|f| match f.strip_suffix('.') {
        Some(section) => key.starts_with(f) || key == section,
        None => key == *f || key.starts_with(&format!("{f}.")),
    })
}

/// Every key that differs, in key order; derived keys last.
pub fn compare(stored: &RawConfig, new: &RawConfig) -> Vec<Change> {
    let (mut a, mut b) = (vec![], vec![]);
    leaves(&serde_json::to_value(stored).unwrap_or_default(), String::new(), &mut a);
    leaves(&serde_json::to_value(new).unwrap_or_default(), String::new(), &mut b);
    let a: std::collections::BTreeMap<_, _> = a.into_iter().collect();
    let b: std::collections::BTreeMap<_, _> = b.into_iter().collect();
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let unset = serde_json::Value::Null;
    let mut out: Vec<Change> = keys
        .into_iter()
        .filter_map(|k| {
            let (x, y) = (a.get(k).unwrap_or(&unset), b.get(k).unwrap_or(&unset));
            (x != y).then(|| Change {
                key: k.clone(),
                stored: render(x),
                new: render(y),
                alters: !is_free(k) && !DERIVED.contains(&k.as_str()),
            })
        })
        .collect();
    let (g0, g1) = (stored.train.global_batch_size(), new.train.global_batch_size());
    if g0 != g1 {
        out.push(Change {
            key: "the global batch".into(),
            stored: g0.to_string(),
            new: g1.to_string(),
            alters: true,
        });
    }
    let decay = |c: &RawConfig| c.optim.decay_steps.unwrap_or(c.train.max_steps);
    if decay(stored) != decay(new) {
        let say = |c: &RawConfig| match c.optim.decay_steps {
            Some(d) => d.to_string(),
            None => format!("{} (train.max_steps)", c.train.max_steps),
        };
        out.push(Change {
            key: format!("{SCHEDULE} (optim.decay_steps)"),
            stored: say(stored),
            new: say(new),
            alters: true,
        });
    }
    out
}

const SCHEDULE: &str = "the schedule's length";

/// The exit-2 message for changes that alter the run, naming each and the ways on.
pub fn refusal(changes: &[Change], run_dir: &Path) -> String {
    let mut m = format!(
        "resuming would change the run in {0}, whose own config is {0}/config.yaml:",
        run_dir.display()
    );
    for c in changes.iter().filter(|c| c.alters) {
        m.push_str(&format!("\n  {}: {} in the run, {} now", c.key, c.stored, c.new));
    }
    // The schedule's length as a number (the raw key's own entry may say `unset`).
    if let Some(c) = changes.iter().find(|c| c.key.starts_with(SCHEDULE)) {
        m.push_str(&format!(
            "\n  (to run longer on the same schedule, pin it: --set optim.decay_steps={})",
            c.stored.split(' ').next().unwrap_or("")
        ));
    }
    m.push_str(&format!(
        "\nContinue the run as it was with `oomguard train --run-dir {} --resume` (no config file), \
         or accept the change with --allow-change (recorded in metrics.jsonl; the earlier config \
         is kept as config.NNN.yaml)",
        run_dir.display()
    ));
    m
}

/// The leaves of a serialized config by dotted key; a list is one leaf.
fn leaves(v: &serde_json::Value, path: String, out: &mut Vec<(String, serde_json::Value)>) {
    match v {
        serde_json::Value::Object(m) => m.iter().for_each(|(k, v)| {
            let p = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            leaves(v, p, out)
        }),
        other => out.push((path, other.clone())),
    }
}

fn render(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "unset".into(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(yaml: &str) -> RawConfig {
        serde_yaml::from_str(yaml).unwrap()
    }

    fn keys(changes: &[Change]) -> Vec<(&str, bool)> {
        changes.iter().map(|c| (c.key.as_str(), c.alters)).collect()
    }

    #[test]
    fn the_same_config_changes_nothing() {
        let c = raw("train: {max_steps: 10, seed: 3}");
        assert_eq!(compare(&c, &c.clone()), vec![]);
    }

    #[test]
    fn seed_optimizer_model_and_data_alter_the_run() {
        let a = raw("train: {seed: 1}\noptim: {lr: 0.001}\nmodel: {n_layer: 2}\ndata: {val_fraction: 0.1}");
        let b = raw("train: {seed: 2}\noptim: {lr: 0.002}\nmodel: {n_layer: 3}\ndata: {val_fraction: 0.2}");
        assert_eq!(
            keys(&compare(&a, &b)),
            [
                ("data.val_fraction", true),
                ("model.n_layer", true),
                ("optim.lr", true),
                ("train.seed", true)
            ]
        );
    }

    #[test]
    fn cadence_memory_threads_precision_and_sharding_are_free() {
        let a = raw("log: {every: 1}\ncheckpoint: {every_steps: 5}\nmemory: {budget: 1GiB}\ntrain: {num_threads: 1}");
        let b = raw(
            "log: {every: 9}\ncheckpoint: {every_steps: 7}\nmemory: {budget: 2GiB}\n\
             train: {num_threads: 2, precision: bf16, shard: optimizer, eval_every: 3}",
        );
        let c = compare(&a, &b);
        assert!(c.iter().all(|c| !c.alters), "{c:?}");
        assert_eq!(c.len(), 7, "{c:?}");
    }

    #[test]
    fn the_global_batch_may_be_recut_but_not_resized() {
        let a = raw("train: {micro_batch_size: 8, grad_accum_steps: 2}");
        let recut = raw("train: {micro_batch_size: 4, grad_accum_steps: 4}");
        assert!(compare(&a, &recut).iter().all(|c| !c.alters));
        let resized = raw("train: {micro_batch_size: 8, grad_accum_steps: 4}");
        let c = compare(&a, &resized);
        assert_eq!(c.iter().filter(|c| c.alters).count(), 1);
        assert_eq!(
            (c[1].key.as_str(), c[1].stored.as_str(), c[1].new.as_str()),
            ("the global batch", "16", "32")
        );
    }

    #[test]
    fn max_steps_extends_freely_only_while_decay_steps_pins_the_schedule() {
        let follows = compare(&raw("train: {max_steps: 50}"), &raw("train: {max_steps: 300}"));
        assert_eq!(
            keys(&follows),
            [
                ("train.max_steps", false),
                ("the schedule's length (optim.decay_steps)", true)
            ]
        );
        let pinned = compare(
            &raw("train: {max_steps: 10}\noptim: {decay_steps: 90}"),
            &raw("train: {max_steps: 30}\noptim: {decay_steps: 90}"),
        );
        assert_eq!(keys(&pinned), [("train.max_steps", false)]);
        // Pinning it at the length it already had is no change to the schedule.
        let pinned_now = compare(
            &raw("train: {max_steps: 50}"),
            &raw("train: {max_steps: 50}\noptim: {decay_steps: 50}"),
        );
        assert!(pinned_now.iter().all(|c| !c.alters), "{pinned_now:?}");
    }

    #[test]
    fn the_refusal_names_each_key_both_values_and_the_flag() {
        let c = compare(
            &raw("train: {seed: 1, max_steps: 50}"),
            &raw("train: {seed: 2, max_steps: 300}"),
        );
        let m = refusal(&c, Path::new("runs/x"));
        assert!(m.contains("train.seed: 1 in the run, 2 now"), "{m}");
        assert!(
            m.contains("50 (train.max_steps) in the run, 300 (train.max_steps) now"),
            "{m}"
        );
        assert!(m.contains("--set optim.decay_steps=50"), "{m}");
        assert!(m.contains("--allow-change"), "{m}");
        assert!(!m.contains("train.max_steps: "), "a free key is not refused: {m}");
        // The run's schedule was max_steps long: the pin is that number, not the raw key's
        // `unset` (which --set refuses).
        let c = compare(
            &raw("train: {max_steps: 6}"),
            &raw("train: {max_steps: 10}\noptim: {decay_steps: 8}"),
        );
        let m = refusal(&c, Path::new("runs/x"));
        assert!(m.contains("--set optim.decay_steps=6)"), "{m}");
    }
}
