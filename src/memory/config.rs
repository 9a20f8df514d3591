//! The `memory` config section.
use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {}

impl MemoryConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}
