//! Owns the errors in what a user wrote: a config file, an override, a flag.
//! Keeps: each error names where it came from and the key; the CLI maps it to exit code 2.
use std::fmt;

/// A bad config: where it is, which key, and what would be valid.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct ConfigError {
    /// The file, or `--set ...` for an override.
    pub origin: String,
    pub line_col: Option<(usize, usize)>,
    pub key: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.origin)?;
        if let Some((l, c)) = self.line_col {
            write!(f, ":{l}:{c}")?;
        }
        if self.key.is_empty() {
            write!(f, ": {}", self.message)
        } else {
            write!(f, ": {}: {}", self.key, self.message)
        }
    }
}

impl ConfigError {
    /// An invalid value for `key` (a section-qualified path such as `train.max_steps`).
    pub fn invalid(key: &str, message: impl Into<String>) -> Self {
        ConfigError {
            origin: String::new(),
            line_col: None,
            key: key.into(),
            message: message.into(),
        }
    }

    /// A serde_yaml error in `origin`, with its line and column and the key serde_yaml names.
    pub fn from_yaml(origin: &str, e: serde_yaml::Error) -> Self {
        let line_col = e.location().map(|l| (l.line(), l.column()));
        let mut message = e.to_string().replace("unknown field", "unknown key");
        if let Some(i) = message.rfind(" at line ") {
            message.truncate(i);
        }
        // `expected struct RawConfig`: our type's name means nothing to the reader.
        if let Some(i) = message.find("expected struct ") {
            let rest = &message[i + "expected struct ".len()..];
            let end = rest
                .find(|c: char| !c.is_alphanumeric() && c != '_')
                .unwrap_or(rest.len());
            message = format!("{}expected a mapping (key: value lines){}", &message[..i], &rest[end..]);
        }
        // serde_yaml prefixes the path (`model: ...`); keep it as the key.
        let (key, message) = match message.split_once(": ") {
            Some((k, m)) if !k.contains(' ') => (k.to_string(), m.to_string()),
            _ => (String::new(), message),
        };
        ConfigError {
            origin: origin.to_string(),
            line_col,
            key,
            message,
        }
    }
}

/// A child's exit code passed through as this process's own (its summary is already
/// printed, so nothing more is logged).
#[derive(Debug, thiserror::Error)]
#[error("exit code {0}")]
pub struct ExitCode(pub i32);
