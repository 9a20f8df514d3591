//! Owns `oomguard._native`: the runtime's guard policy for the Python guard, and the glibc
//! calls that hand freed heap back after an OOM.
//! Keeps: no torch state and no libtorch; the decisions are `oomguard_policy::Policy`'s, unchanged.
use oomguard_policy::{Adjust, Observation, OnOom, Policy as Inner, PolicyConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The micro-batch size and its history: halve on OOM, grow back after clean steps, cool a
/// failed size down, give up at micro-batch 1.
#[pyclass(module = "oomguard._native")]
struct Policy {
    inner: Inner,
    cfg: PolicyConfig,
}

#[pymethods]
impl Policy {
    #[new]
    #[pyo3(signature = (micro_batch_size, grow_after_steps=None, grow_headroom=None, cooldown_steps=None, thrash_steps=None, retries_at_one=None))]
    fn new(
        micro_batch_size: usize,
        grow_after_steps: Option<u64>,
        grow_headroom: Option<f64>,
        cooldown_steps: Option<u64>,
        thrash_steps: Option<u32>,
        retries_at_one: Option<u32>,
    ) -> PyResult<Policy> {
        if micro_batch_size == 0 {
            return Err(PyValueError::new_err("micro_batch_size must be at least 1"));
        }
        let d = PolicyConfig::DEFAULT;
        let cfg = PolicyConfig {
            grow_after_steps: grow_after_steps.unwrap_or(d.grow_after_steps),
            grow_headroom: grow_headroom.unwrap_or(d.grow_headroom),
            cooldown_steps: cooldown_steps.unwrap_or(d.cooldown_steps),
            thrash_steps: thrash_steps.unwrap_or(d.thrash_steps),
            retries_at_one: retries_at_one.unwrap_or(d.retries_at_one),
        };
        if !(0.0..1.0).contains(&cfg.grow_headroom) {
            return Err(PyValueError::new_err(format!(
                "grow_headroom is {}; it must be in [0, 1)",
                cfg.grow_headroom
            )));
        }
        Ok(Policy {
            inner: Inner::new(micro_batch_size),
            cfg,
        })
    }

    /// The micro-batch size the next attempt runs with.
    #[getter]
    fn current(&self) -> usize {
        self.inner.current
    }

    #[setter]
    fn set_current(&mut self, size: usize) {
        self.inner.current = size.clamp(1, self.inner.configured);
    }

    /// The size it was created with: it never grows above it.
    #[getter]
    fn configured(&self) -> usize {
        self.inner.configured
    }

    #[getter]
    fn num_ooms(&self) -> u64 {
        self.inner.num_ooms
    }

    /// An OOM at the current size (`severe`: cleanup left memory behind; `signature`: where
    /// it failed). Returns the size to retry with, 0 when even micro-batch 1 does not fit.
    #[pyo3(signature = (step, severe, signature=None))]
    fn on_oom(&mut self, step: u64, severe: bool, signature: Option<u64>) -> usize {
        match self.inner.on_oom(step, severe, signature, self.cfg.retries_at_one) {
            OnOom::Retry { micro_batch_size } => micro_batch_size,
            OnOom::GiveUp => 0,
        }
    }

    /// After a successful step: `("keep" | "grow" | "shrink", size)`.
    #[pyo3(signature = (step, baseline_bytes=0, peak_bytes=0, limit_bytes=None, alloc_retries=None))]
    fn after_step(
        &mut self,
        step: u64,
        baseline_bytes: u64,
        peak_bytes: u64,
        limit_bytes: Option<u64>,
        alloc_retries: Option<u64>,
    ) -> (&'static str, usize) {
        let obs = Observation {
            baseline_bytes,
            peak_bytes,
            limit_bytes,
            alloc_retries,
        };
        match self.inner.after_step(step, obs, &self.cfg) {
            Adjust::Keep => ("keep", self.inner.current),
            Adjust::Grow { micro_batch_size } => ("grow", micro_batch_size),
            Adjust::Shrink { micro_batch_size } => ("shrink", micro_batch_size),
        }
    }

    /// After a relaunch by `oomguard launch`: died at `failed`, restarting at `now`.
    #[pyo3(signature = (failed, now, step=0))]
    fn relaunched(&mut self, failed: Option<usize>, now: usize, step: u64) {
        self.inner.relaunched(failed, now, step);
    }

    /// The policy's state as JSON (the serde form `oomguard train`'s checkpoints hold).
    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.inner).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Continues a state from `to_json` (under this policy's configured size).
    fn load_json(&mut self, text: &str) -> PyResult<()> {
        let saved: Inner = serde_json::from_str(text).map_err(|e| PyValueError::new_err(e.to_string()))?;
        self.inner = Inner::resumed(saved, self.inner.configured);
        Ok(())
    }
}

/// `(source, line, requested_bytes, capacity_bytes, free_bytes)`.
type Classified = (&'static str, String, Option<u64>, Option<u64>, Option<u64>);

/// Whether an error message is an out-of-memory error, as the runtime classifies them
/// (oomguard_host::oom, one function for every caller), plus oneDNN's "could not create a
/// primitive", which is how an allocation failure inside oneDNN surfaces on the CPU.
/// Returns `(source, line, requested_bytes, capacity_bytes, free_bytes)` or None.
#[pyfunction]
fn classify_oom(message: &str) -> Option<Classified> {
    use oomguard_host::oom::OomSource;
    if let Some(o) = oomguard_host::oom::classify_oom(message) {
        let source = match o.source {
            OomSource::Cuda => "cuda",
            OomSource::CudaRuntime => "cuda_runtime",
            OomSource::Cpu => "cpu",
            OomSource::Budget => "budget",
        };
        return Some((source, o.message, o.requested_bytes, o.capacity_bytes, o.free_bytes));
    }
    let line = message
        .lines()
        .find(|l| l.to_ascii_lowercase().contains(ONEDNN_MARKER))?;
    Some(("cpu", line.trim().to_string(), None, None, None))
}

const ONEDNN_MARKER: &str = "could not create a primitive";

/// Hands the heap's free pages back to the system (glibc's `malloc_trim(0)`, the runtime's
/// own `return_freed_memory`); True when memory was released, False off glibc.
#[pyfunction]
fn malloc_trim() -> bool {
    oomguard_host::memory::return_freed_memory()
}

/// The micro-batch cache's memory key for a device limit (the runtime's own steps).
#[pyfunction]
fn memory_step(limit: u64) -> u64 {
    oomguard_policy::memory_step(limit)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Policy>()?;
    m.add_function(wrap_pyfunction!(malloc_trim, m)?)?;
    m.add_function(wrap_pyfunction!(classify_oom, m)?)?;
    m.add_function(wrap_pyfunction!(memory_step, m)?)?;
    Ok(())
}
