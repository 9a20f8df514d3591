//! Owns `memory.snapshot`: `on_oom` (default), `off`, `always`, or the long form.
//! Keeps: the raw value is validated here, so a bad one is refused naming its key.
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// The ring's default length: a dump of it takes well under 2 s (benches/snapshot.rs).
pub const DEFAULT_MAX_EVENTS: usize = 50_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotMode {
    Off,
    OnOom,
    Always,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotConfig {
    pub mode: SnapshotMode,
    pub max_events: usize,
}

impl Default for SnapshotConfig {
    fn default() -> Self {
        SnapshotConfig {
            mode: SnapshotMode::OnOom,
            max_events: DEFAULT_MAX_EVENTS,
        }
    }
}

fn mode(v: &serde_yaml::Value) -> Result<SnapshotMode, ConfigError> {
    let text = v
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| serde_yaml::to_string(v).unwrap_or_default().trim().to_string());
    serde_yaml::from_value(v.clone()).map_err(|_| {
        ConfigError::invalid(
            "memory.snapshot",
            format!("`{text}` is not a mode; use on_oom (the default), off or always"),
        )
    })
}

impl SnapshotConfig {
    /// The long form, as the resolved config.yaml writes it.
    pub fn to_raw(&self) -> serde_yaml::Value {
        let mut m = serde_yaml::Mapping::new();
        m.insert("mode".into(), serde_yaml::to_value(self.mode).unwrap_or_default());
        m.insert("max_events".into(), (self.max_events as u64).into());
        serde_yaml::Value::Mapping(m)
    }

    /// The validated form of `memory.snapshot` as written (`None`: absent).
    pub fn from_raw(raw: Option<&serde_yaml::Value>) -> Result<SnapshotConfig, ConfigError> {
        let Some(v) = raw else {
            return Ok(SnapshotConfig::default());
        };
        let serde_yaml::Value::Mapping(m) = v else {
            return Ok(SnapshotConfig {
                mode: mode(v)?,
                ..Default::default()
            });
        };
        let mut cfg = SnapshotConfig::default();
        for (k, v) in m {
            match k.as_str().unwrap_or("") {
                "mode" => cfg.mode = mode(v)?,
                "max_events" => {
                    cfg.max_events = v.as_u64().filter(|&n| n >= 1).ok_or_else(|| {
                        let shown = serde_yaml::to_string(v).unwrap_or_default();
                        ConfigError::invalid(
                            "memory.snapshot.max_events",
                            format!("is {}; it must be a whole number of events, at least 1", shown.trim()),
                        )
                    })? as usize
                }
                other => {
                    return Err(ConfigError::invalid(
                        &format!("memory.snapshot.{other}"),
                        "is not a setting of memory.snapshot; it takes mode (on_oom, off, always) and max_events",
                    ))
                }
            }
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(y: &str) -> Result<SnapshotConfig, ConfigError> {
        SnapshotConfig::from_raw(Some(&serde_yaml::from_str(y).unwrap()))
    }

    #[test]
    fn shorthand_long_form_and_refusals() {
        assert_eq!(SnapshotConfig::from_raw(None).unwrap(), SnapshotConfig::default());
        assert_eq!(
            SnapshotConfig::from_raw(Some(&SnapshotConfig::default().to_raw())).unwrap(),
            SnapshotConfig::default()
        );
        assert_eq!(parse("always").unwrap().mode, SnapshotMode::Always);
        assert_eq!(parse("off").unwrap().mode, SnapshotMode::Off);
        assert_eq!(
            parse("{mode: off, max_events: 7}").unwrap(),
            SnapshotConfig {
                mode: SnapshotMode::Off,
                max_events: 7
            }
        );
        assert_eq!(
            parse("{max_events: 9}").unwrap(),
            SnapshotConfig {
                mode: SnapshotMode::OnOom,
                max_events: 9
            }
        );
        assert_eq!(parse("sometimes").unwrap_err().key, "memory.snapshot");
        assert_eq!(parse("{mode: sometimes}").unwrap_err().key, "memory.snapshot");
        assert_eq!(parse("{max_events: -1}").unwrap_err().key, "memory.snapshot.max_events");
        assert_eq!(parse("{max_events: 0}").unwrap_err().key, "memory.snapshot.max_events");
        assert_eq!(
            parse("{mode: on_oom, every: 3}").unwrap_err().key,
            "memory.snapshot.every"
        );
    }
}
