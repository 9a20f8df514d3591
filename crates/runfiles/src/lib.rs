//! Owns the files that `oomguard train` and `import oomguard` both write, so that each rule
//! exists once: whole-file rewrites (atomic), the micro-batch cache (cache), and metrics.jsonl
//! when a run resumes at an earlier step (metrics).
//! Keeps: no libtorch and no Python: the runtime links it, and so does `oomguard._native`.
pub mod atomic;
pub mod cache;
pub mod metrics;
