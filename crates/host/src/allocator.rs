//! Owns the caching-allocator settings (`PYTORCH_ALLOC_CONF`): the one place that knows their keys.
//! Keeps: settings are merged with the environment and validated before anything runs.
use std::collections::BTreeMap;

use oomguard_console::ConfigError;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    Bool,
    /// A whole number of MiB (or threads).
    Count,
    /// A number in (0, 1) (`inclusive`: (0, 1]).
    Fraction {
        inclusive: bool,
    },
    /// An integer, or a list `[64:8,256:4,>:1]`.
    Divisions,
    Backend,
}

const KEYS: &[(&str, Kind)] = &[
    ("backend", Kind::Backend),
    ("expandable_segments", Kind::Bool),
    ("max_split_size_mb", Kind::Count),
    ("max_non_split_rounding_mb", Kind::Count),
    ("large_segment_size_mb", Kind::Count),
    ("garbage_collection_threshold", Kind::Fraction { inclusive: false }),
    ("roundup_power2_divisions", Kind::Divisions),
    ("per_process_memory_fraction", Kind::Fraction { inclusive: true }),
    ("release_lock_on_cudamalloc", Kind::Bool),
    ("pinned_use_cuda_host_register", Kind::Bool),
    ("pinned_num_register_threads", Kind::Count),
    ("pinned_use_background_threads", Kind::Bool),
    ("pinned_reserve_segment_size_mb", Kind::Count),
    ("pinned_free_catch_all", Kind::Bool),
    ("graph_capture_record_stream_reuse", Kind::Bool),
    ("throw_on_cudamalloc_oom", Kind::Bool),
];

/// Read by libtorch; PYTORCH_CUDA_ALLOC_CONF wins inside libtorch when both are set.
pub const ENV_VARS: [&str; 2] = ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"];

/// Validated settings, in libtorch's spelling (`True`, `False`, numbers, lists).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AllocatorSettings(BTreeMap<String, String>);

impl AllocatorSettings {
    /// `key:value,key:value`, as libtorch parses it.
    pub fn render(&self) -> String {
        self.0
            .iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// These settings with `key` set to `value` (validated as the config's would be).
    pub fn with(mut self, key: &str, value: &str) -> Result<AllocatorSettings, ConfigError> {
        let (k, text) =
            validate(key, value).map_err(|m| ConfigError::invalid(&format!("memory.allocator.{key}"), m))?;
        self.0.insert(k, text);
        Ok(self)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Settings from the config's `memory.allocator` map (YAML bools become True/False).
    pub fn from_config(map: &BTreeMap<String, serde_yaml::Value>) -> Result<AllocatorSettings, ConfigError> {
        let mut out = BTreeMap::new();
        for (k, v) in map {
            let text = match v {
                serde_yaml::Value::Sequence(items) => {
                    format!("[{}]", items.iter().map(scalar).collect::<Vec<_>>().join(","))
                }
                v => scalar(v),
            };
            let (k, text) =
                validate(k, &text).map_err(|m| ConfigError::invalid(&format!("memory.allocator.{k}"), m))?;
            out.insert(k, text);
        }
        Ok(AllocatorSettings(out))
    }

    /// Parses `key:value,...` from an environment variable's text.
    pub fn parse(text: &str, origin: &str) -> Result<AllocatorSettings, ConfigError> {
        let mut out = BTreeMap::new();
        let mut rest = text.trim();
        while !rest.is_empty() {
            // A value may be a bracketed list containing commas.
            let (item, tail) = match (rest.find('['), rest.find(',')) {
                (Some(b), Some(c)) if b < c => {
                    let close = rest
                        .find(']')
                        .ok_or_else(|| bad_env(origin, rest, "an unclosed `[` list"))?;
                    let next = rest[close..].find(',').map(|i| close + i);
                    (&rest[..next.unwrap_or(rest.len())], next.map_or("", |i| &rest[i + 1..]))
                }
                (_, Some(c)) => (&rest[..c], &rest[c + 1..]),
                _ => (rest, ""),
            };
            let (k, v) = item.split_once(':').ok_or_else(|| bad_env(origin, item, "key:value"))?;
            let (k, v) = validate(k.trim(), v.trim()).map_err(|m| ConfigError {
                origin: origin.to_string(),
                line_col: None,
                key: k.trim().to_string(),
                message: m,
            })?;
            out.insert(k, v);
            rest = tail.trim();
        }
        Ok(AllocatorSettings(out))
    }

    /// `over`'s keys replace ours.
    pub fn merged_with(mut self, over: &AllocatorSettings) -> AllocatorSettings {
        self.0.extend(over.0.clone());
        self
    }
}

/// A YAML scalar as libtorch spells it (bools as True/False).
fn scalar(v: &serde_yaml::Value) -> String {
    match v {
        serde_yaml::Value::Bool(b) => {
            if *b {
                "True".into()
            } else {
                "False".into()
            }
        }
        serde_yaml::Value::Number(n) => n.to_string(),
        serde_yaml::Value::String(s) => s.clone(),
        _ => String::new(),
    }
}

fn bad_env(origin: &str, item: &str, what: &str) -> ConfigError {
    ConfigError {
        origin: origin.into(),
        line_col: None,
        key: String::new(),
        message: format!("`{item}` is not {what}"),
    }
}

/// Checks one setting; returns it in libtorch's spelling.
fn validate(key: &str, value: &str) -> Result<(String, String), String> {
    let Some(&(_, kind)) = KEYS.iter().find(|(k, _)| *k == key) else {
        let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
        return Err(format!(
            "unknown allocator setting `{key}`, expected one of {}",
            known.join(", ")
        ));
    };
    let ok = match kind {
        Kind::Bool => value == "True" || value == "False",
        Kind::Count => value.parse::<u64>().is_ok(),
        Kind::Fraction { inclusive } => value
            .parse::<f64>()
            .is_ok_and(|f| f > 0.0 && (f < 1.0 || (inclusive && f == 1.0))),
        Kind::Divisions => {
            value.parse::<u64>().is_ok()
                || (value.starts_with('[')
                    && value.ends_with(']')
                    && value[1..value.len() - 1].split(',').all(|p| {
                        p.split_once(':')
                            .is_some_and(|(a, b)| (a == ">" || a.parse::<u64>().is_ok()) && b.parse::<u64>().is_ok())
                    }))
        }
        Kind::Backend => value == "native" || value == "cudaMallocAsync",
    };
    if ok {
        return Ok((key.to_string(), value.to_string()));
    }
    Err(match kind {
        Kind::Bool => format!("`{value}` is not a bool libtorch reads; write True or False"),
        Kind::Count => format!("`{value}` is not a whole number"),
        Kind::Fraction { inclusive: false } => format!("`{value}` must be a number in (0, 1)"),
        Kind::Fraction { inclusive: true } => format!("`{value}` must be a number in (0, 1]"),
        Kind::Divisions => format!("`{value}` must be a number or a list like [256:1,512:2,>:4]"),
        Kind::Backend => format!("`{value}` is not a backend; use native or cudaMallocAsync"),
    })
}

/// The settings in force: the config's, overridden key by key by the environment (the
/// variable libtorch itself would read: PYTORCH_CUDA_ALLOC_CONF if set, else
/// PYTORCH_ALLOC_CONF).
pub fn effective(
    config: &AllocatorSettings,
    env: impl Fn(&str) -> Option<String>,
) -> Result<AllocatorSettings, ConfigError> {
    let from_env = ENV_VARS
        .iter()
        .rev()
        .find_map(|v| env(v).filter(|s| !s.trim().is_empty()).map(|s| (v, s)));
    match from_env {
        Some((var, text)) => Ok(config.clone().merged_with(&AllocatorSettings::parse(&text, var)?)),
        None => Ok(config.clone()),
    }
}

/// What starting up needs to do about settings that libtorch reads only when it loads.
#[derive(Debug, PartialEq)]
pub enum Startup {
    Ready,
    /// Re-execute with the settings in the environment (`backend` is read at load time).
    Reexec,
}

/// `backend:cudaMallocAsync` takes effect only if it was in the environment when the
/// process started; `started_with` is that environment's effective text.
pub fn startup(settings: &AllocatorSettings, started_with: Option<&str>) -> Startup {
    let wanted = settings.get("backend").unwrap_or("native");
    let had = started_with
        .and_then(|s| AllocatorSettings::parse(s, "").ok())
        .and_then(|s| s.get("backend").map(str::to_string))
        .unwrap_or_else(|| "native".into());
    if wanted == had {
        Startup::Ready
    } else {
        Startup::Reexec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml_map(y: &str) -> BTreeMap<String, serde_yaml::Value> {
        serde_yaml::from_str(y).unwrap()
    }

    #[test]
    fn config_values_become_libtorch_spelling() {
        let s = AllocatorSettings::from_config(&yaml_map(
            "expandable_segments: true\nmax_split_size_mb: 128\ngarbage_collection_threshold: 0.8\nroundup_power2_divisions: ['256:1', '>:4']",
        ))
        .unwrap();
        assert_eq!(
            s.render(),
            "expandable_segments:True,garbage_collection_threshold:0.8,max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]"
        );
    }

    #[test]
    fn unknown_keys_and_misspelt_bools_are_refused() {
        let e = AllocatorSettings::from_config(&yaml_map("expandable_segmentz: true")).unwrap_err();
        assert_eq!(e.key, "memory.allocator.expandable_segmentz");
        assert!(e.message.contains("expected one of backend, expandable_segments"));
        let e = AllocatorSettings::parse("expandable_segments:true", "PYTORCH_ALLOC_CONF").unwrap_err();
        assert_eq!(
            (e.origin.as_str(), e.key.as_str()),
            ("PYTORCH_ALLOC_CONF", "expandable_segments")
        );
        assert!(e.message.contains("write True or False"));
        assert!(AllocatorSettings::parse("garbage_collection_threshold:1.5", "X").is_err());
        assert!(AllocatorSettings::parse("per_process_memory_fraction:1.0", "X").is_ok());
        assert!(AllocatorSettings::parse("backend:jemalloc", "X").is_err());
        assert!(AllocatorSettings::parse("max_split_size_mb", "X").is_err());
    }

    #[test]
    fn environment_overrides_config_and_cuda_variable_wins() {
        let cfg =
            AllocatorSettings::from_config(&yaml_map("expandable_segments: true\nmax_split_size_mb: 64")).unwrap();
        let env = |v: &str| match v {
            "PYTORCH_ALLOC_CONF" => Some("max_split_size_mb:256".to_string()),
            "PYTORCH_CUDA_ALLOC_CONF" => Some("roundup_power2_divisions:[64:8,>:1],max_split_size_mb:512".to_string()),
            _ => None,
        };
        let s = effective(&cfg, env).unwrap();
        assert_eq!(
            s.render(),
            "expandable_segments:True,max_split_size_mb:512,roundup_power2_divisions:[64:8,>:1]"
        );
        let only_alloc = |v: &str| (v == "PYTORCH_ALLOC_CONF").then(|| "max_split_size_mb:256".to_string());
        assert_eq!(
            effective(&cfg, only_alloc).unwrap().get("max_split_size_mb"),
            Some("256")
        );
    }

    #[test]
    fn async_backend_needs_a_restart_unless_already_in_the_environment() {
        let s = AllocatorSettings::parse("backend:cudaMallocAsync", "X").unwrap();
        assert_eq!(startup(&s, None), Startup::Reexec);
        assert_eq!(startup(&s, Some("backend:cudaMallocAsync")), Startup::Ready);
        assert_eq!(startup(&AllocatorSettings::default(), None), Startup::Ready);
        assert_eq!(
            startup(&AllocatorSettings::default(), Some("backend:cudaMallocAsync")),
            Startup::Reexec
        );
    }
}
