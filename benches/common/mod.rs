//! What several benches share: a median, and a run's events from its metrics.jsonl.
#![allow(dead_code)] // each bench uses a part
use std::path::Path;

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The `event` records of a run directory's metrics.jsonl, in order.
pub fn events(run: &Path, event: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|v| v["event"] == event).collect()
}
