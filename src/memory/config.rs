//! Owns the `memory` section: the CPU budget, allocator settings and the guard's knobs.
//! Keeps: every value is validated here, a bad one refused naming its key.
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::allocator::AllocatorSettings;
use super::parse_size;
use crate::error::ConfigError;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// Memory budget for tensors: `auto` (on the CPU a share of the memory available to the
    /// process, cgroup limits included; on CUDA the whole card), `none`, or a size such as
    /// `2GiB` (or bytes; on CUDA it becomes `per_process_memory_fraction`).
    #[serde(deserialize_with = "size_text")]
    pub budget: String,
    /// The share of available memory `auto` takes.
    pub budget_fraction: f64,
    /// Caching-allocator settings (PYTORCH_ALLOC_CONF keys), e.g. `expandable_segments: true`.
    pub allocator: BTreeMap<String, serde_yaml::Value>,
    /// Turn the allocation guard off (an OOM then ends the run like any error).
    pub guard: bool,
    /// Clean steps at a reduced micro-batch before trying a larger one.
    pub grow_after_steps: u64,
    /// A larger micro-batch is tried only if its predicted peak leaves this share of the
    /// limit free.
    pub grow_headroom: f64,
    /// Steps before a micro-batch size that failed may be tried again.
    pub cooldown_steps: u64,
    /// CUDA: allocator retries rising this many steps in a row shrink the micro-batch.
    pub thrash_steps: u32,
    /// Live memory growing this many steps in a row is reported as a likely leak.
    pub leak_steps: u32,
    /// Failures at micro-batch 1 within one step that are retried (a passing spike, another
    /// tenant) before the guard climbs a rung or gives up. A failure that repeats exactly
    /// (same phase, micro-batch, size and free memory) is not retried.
    pub retries_at_one: u32,
    /// Below micro-batch 1: turn on activation checkpointing (models that can).
    pub allow_activation_checkpointing: bool,
    /// Below micro-batch 1: fall back from fp32 to bf16 autocast.
    pub allow_precision_fallback: bool,
    /// Data parallel, below micro-batch 1: shard AdamW's state across the ranks (ZeRO-1).
    pub allow_sharding: bool,
    /// `micro_batch_size: auto` trains at the largest size found less this share.
    pub auto_margin: f64,
    /// Simulated memory pressure: real allocations held during a range of steps, as another
    /// tenant would (for demos and tests).
    pub pressure: Vec<Pressure>,
    /// What every OOM leaves in RUN_DIR/oom/NNN/: `on_oom` (default), `off`, `always` (also
    /// at the end), or `{mode: on_oom, max_events: 50000}` (see snapshot/config.rs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<serde_yaml::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pressure {
    pub from_step: u64,
    pub to_step: u64,
    #[serde(deserialize_with = "size_text")]
    pub size: String,
}

/// A size as text: `2GiB`, or a plain number of bytes.
fn size_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
        // Refused by name where the text is parsed (a negative or fractional byte count).
        Number(f64),
    }
    Ok(match Size::deserialize(d)? {
        Size::Bytes(b) => b.to_string(),
        Size::Text(t) => t,
        Size::Number(n) => n.to_string(),
    })
}

impl Default for MemoryConfig {
    fn default() -> Self {
        let mut allocator = BTreeMap::new();
        allocator.insert("expandable_segments".to_string(), serde_yaml::Value::Bool(true));
        MemoryConfig {
            budget: "auto".into(),
            budget_fraction: 0.8,
            allocator,
            guard: true,
            grow_after_steps: 20,
            grow_headroom: 0.1,
            cooldown_steps: 100,
            thrash_steps: 3,
            leak_steps: 10,
            retries_at_one: 8,
            allow_activation_checkpointing: true,
            allow_precision_fallback: true,
            allow_sharding: true,
            auto_margin: 0.1,
            pressure: Vec::new(),
            snapshot: Some(super::snapshot::SnapshotConfig::default().to_raw()),
        }
    }
}

/// The CPU budget a config asks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    Auto { fraction: f64 },
    None,
    Bytes(u64),
}

impl MemoryConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.budget()?;
        self.allocator_settings()?;
        self.snapshot()?;
        if !(self.budget_fraction > 0.0 && self.budget_fraction <= 1.0) {
            return Err(ConfigError::invalid(
                "memory.budget_fraction",
                format!("is {}; it must be in (0, 1]", self.budget_fraction),
            ));
        }
        if !(0.0..1.0).contains(&self.auto_margin) {
            return Err(ConfigError::invalid(
                "memory.auto_margin",
                format!("is {}; it must be in [0, 1)", self.auto_margin),
            ));
        }
        if !(0.0..1.0).contains(&self.grow_headroom) {
            return Err(ConfigError::invalid(
                "memory.grow_headroom",
                format!("is {}; it must be in [0, 1)", self.grow_headroom),
            ));
        }
        for (i, p) in self.pressure.iter().enumerate() {
            let key = format!("memory.pressure[{i}]");
            parse_size(&p.size).ok_or_else(|| {
                ConfigError::invalid(&format!("{key}.size"), format!("`{}` is not a size like 64MiB", p.size))
            })?;
            if p.to_step <= p.from_step {
                return Err(ConfigError::invalid(
                    &format!("{key}.to_step"),
                    "must be greater than from_step",
                ));
            }
        }
        Ok(())
    }

    pub fn budget(&self) -> Result<Budget, ConfigError> {
        match self.budget.trim() {
            "auto" => Ok(Budget::Auto {
                fraction: self.budget_fraction,
            }),
            "none" => Ok(Budget::None),
            s => parse_size(s).filter(|&b| b > 0).map(Budget::Bytes).ok_or_else(|| {
                ConfigError::invalid(
                    "memory.budget",
                    format!("`{s}` is not a size; use auto, none or a size like 2GiB"),
                )
            }),
        }
    }

    pub fn snapshot(&self) -> Result<super::snapshot::SnapshotConfig, ConfigError> {
        super::snapshot::SnapshotConfig::from_raw(self.snapshot.as_ref())
    }

    pub fn allocator_settings(&self) -> Result<AllocatorSettings, ConfigError> {
        AllocatorSettings::from_config(&self.allocator)
    }
}
