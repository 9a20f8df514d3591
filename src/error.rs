//! Owns the crate's error type, with OOM typed.
//! Keeps: every libtorch error passes through `From<TchError>`, which asks `classify_oom`.
use std::ffi::{c_char, CStr};
use tch::TchError;

extern "C" {
    fn og_free(msg: *mut c_char);
}

/// Turns a message returned by csrc/ into a `TchError`, so that OOM classification sees
/// errors from our C++ exactly as it sees tch's.
pub(crate) fn check(msg: *mut c_char) -> Result<(), TchError> {
    if msg.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string malloc'd by csrc/, ours to free.
    let text = unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned();
    unsafe { og_free(msg) };
    Err(TchError::Torch(text))
}

/// Config errors live in this leaf module's reach (the torch-free oomguard-console), so that the
/// component sections and config/ never import each other.
pub use oomguard_console::ConfigError;
pub use oomguard_host::oom::{classify_oom, OomError, OomSource, Phase};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Oom(OomError),
    #[error("libtorch: {0}")]
    Torch(TchError),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error("{0}")]
    Data(String),
    /// The step does not fit even at micro-batch 1 (exit code 3).
    #[error("{0}")]
    Infeasible(String),
    /// A collective failed (a peer died, a timeout): the launcher restarts the group.
    #[error("data parallel: {0}")]
    Dist(String),
    /// The optimizer's commit failed after it began (never an OOM: it allocates nothing).
    #[error("{0}")]
    PartialUpdate(String),
    /// A checkpoint that cannot be used (missing, corrupt, truncated, another model).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// Stopped by a signal after checkpointing (exit code 130 or 143).
    #[error("stopped by {} at step {step}; resume with --resume", signal.name())]
    Interrupted { signal: crate::signals::Signal, step: u64 },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
    pub fn is_oom(&self) -> bool {
        matches!(self, Error::Oom(_))
    }
    /// Tags an OOM with the phase of the step it happened in.
    pub fn in_phase(self, phase: Phase) -> Self {
        match self {
            Error::Oom(o) => Error::Oom(OomError {
                phase: Some(phase),
                ..o
            }),
            e => e,
        }
    }
    /// Tags an OOM with the micro-batch of the step it happened in.
    pub fn at_micro_batch(self, index: usize) -> Self {
        match self {
            Error::Oom(o) => Error::Oom(OomError {
                micro_batch: Some(index),
                ..o
            }),
            e => e,
        }
    }
}

impl From<TchError> for Error {
    fn from(e: TchError) -> Self {
        let msg = match &e {
            TchError::Torch(m) => m.as_str(),
            _ => return Error::Torch(e),
        };
        match classify_oom(msg) {
            Some(oom) => Error::Oom(oom),
            None => Error::Torch(e),
        }
    }
}
