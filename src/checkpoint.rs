//! The `checkpoint` section (checkpoints themselves arrive with the checkpoint issue).
use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {}

impl CheckpointConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}
