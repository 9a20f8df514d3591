//! Owns `oomguard._native`: what the Python guard shares with `oomguard train`, in Rust:
//! the policy, the meaning of the ranks' agreement vector, the OOM classifier, the
//! micro-batch cache, metrics.jsonl's replacement on a resume, and the glibc calls that hand
//! freed heap back after an OOM.
//! Keeps: no torch state and no libtorch; every rule is the shared crates', unchanged.
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

/// The ranks' exchange, the one `oomguard train` agrees over (crates/exchange: a binary tree
/// of TCP connections, a fixed 176-byte message, each exchange's sequence checked): the
/// Python guard's votes go through it instead of a c10d all-reduce, which costs ~0.5 ms on
/// two ranks of this machine and grows with the world.
#[pyclass(module = "oomguard._native")]
struct Exchange {
    inner: std::sync::Mutex<oomguard_exchange::Exchange>,
}

#[pymethods]
impl Exchange {
    /// Connects `rank` of `world` to its tree neighbours: listeners on `addr`'s interface,
    /// published and read through `share(key, value_or_None) -> bytes` (the job's c10d store:
    /// set, or wait for a key), hellos carrying `token`, `timeout_s` to connect.
    #[new]
    fn new(
        py: Python<'_>,
        rank: usize,
        world: usize,
        addr: &str,
        token: &str,
        timeout_s: f64,
        share: PyObject,
    ) -> PyResult<Exchange> {
        use oomguard_exchange::{Channel, ExchangeError, PAYLOAD};
        let share = |key: &str, value: Option<&[u8]>| -> Result<Vec<u8>, ExchangeError> {
            let got = share.call1(py, (key, value.map(|v| pyo3::types::PyBytes::new(py, v))));
            got.and_then(|v| v.extract::<Vec<u8>>(py))
                .map_err(|e| ExchangeError(format!("the store, at {key}: {e}")))
        };
        let timeout = std::time::Duration::from_secs_f64(timeout_s.max(0.001));
        let channel = Channel::open(rank, world, addr, token, timeout, share)
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.0))?;
        Ok(Exchange {
            inner: std::sync::Mutex::new(oomguard_exchange::Exchange::new(channel, PAYLOAD)),
        })
    }

    /// How long each exchange from here on waits for a neighbour, in seconds (the connecting
    /// had `timeout_s`).
    fn set_timeout(&self, timeout_s: f64) -> PyResult<()> {
        let x = self
            .inner
            .lock()
            .map_err(|_| pyo3::exceptions::PyRuntimeError::new_err("the exchange's lock is poisoned"))?;
        let t = std::time::Duration::try_from_secs_f64(timeout_s)
            .map_err(|_| pyo3::exceptions::PyValueError::new_err(format!("{timeout_s} is not a number of seconds")))?;
        x.set_timeout(t).map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.0))
    }

    /// Every rank's `values`, maximised element-wise (the GIL released meanwhile). Raises
    /// when a rank is gone or the ranks are at different exchanges (named).
    fn max(&self, py: Python<'_>, values: Vec<f64>) -> PyResult<Vec<f64>> {
        self.run(py, oomguard_exchange::Topic::GuardVote, values, oomguard_exchange::Reduce::Max)
    }

    /// The sum over the ranks of their loss units, added in the tree's fixed order (the same
    /// bits on every rank).
    fn units(&self, py: Python<'_>, units: f64) -> PyResult<f64> {
        let v = self.run(py, oomguard_exchange::Topic::LossUnits, vec![units], oomguard_exchange::Reduce::Sum)?;
        Ok(v[0])
    }
}

impl Exchange {
    /// One exchange of `values` under `topic` (the GIL released meanwhile). Raises when a rank
    /// is gone or the ranks are at different exchanges (named).
    fn run(
        &self,
        py: Python<'_>,
        topic: oomguard_exchange::Topic,
        values: Vec<f64>,
        how: oomguard_exchange::Reduce,
    ) -> PyResult<Vec<f64>> {
        let mut v = values;
        py.allow_threads(|| {
            let x = self.inner.lock().map_err(|_| "the exchange's lock is poisoned".to_string())?;
            x.run_as(topic, &mut v, how).map_err(|e| e.0)
        })
        .map_err(pyo3::exceptions::PyRuntimeError::new_err)?;
        Ok(v)
    }
}

/// `(source, line, requested_bytes, capacity_bytes, free_bytes)`.
type Classified = (&'static str, String, Option<u64>, Option<u64>, Option<u64>);

/// Whether an error message is an out-of-memory error, as the runtime classifies them
/// (oomguard_host::oom, one function for every caller: libtorch's allocators, CUDA, oneDNN's
/// "could not create a primitive", Python's `MemoryError: ...`).
/// Returns `(source, line, requested_bytes, capacity_bytes, free_bytes)` or None.
#[pyfunction]
fn classify_oom(message: &str) -> Option<Classified> {
    use oomguard_host::oom::OomSource;
    let o = oomguard_host::oom::classify_oom(message)?;
    let source = match o.source {
        OomSource::Cuda => "cuda",
        OomSource::CudaRuntime => "cuda_runtime",
        OomSource::Cpu => "cpu",
        OomSource::Budget => "budget",
    };
    Some((source, o.message, o.requested_bytes, o.capacity_bytes, o.free_bytes))
}

/// One rank's vote as the vector the ranks all-reduce with MAX (oomguard_policy::agreement):
/// `oom` is `(severe, signature, phase, micro_batch_index)` or None; `phase` names one of
/// `PHASES`.
#[pyfunction]
#[pyo3(signature = (rank, oom=None, error=false, peak_bytes=0, baseline_bytes=0, limit_bytes=None, alloc_retries=None, missing_grads=false))]
fn vote(
    rank: usize,
    oom: Option<(bool, u32, String, usize)>,
    error: bool,
    peak_bytes: u64,
    baseline_bytes: u64,
    limit_bytes: Option<u64>,
    alloc_retries: Option<u64>,
    missing_grads: bool,
) -> PyResult<Vec<f64>> {
    use oomguard_policy::agreement::{encode, OomVote, Vote, PHASES};
    let oom = match oom {
        None => None,
        Some((severe, signature, phase, index)) => {
            let phase = PHASES
                .iter()
                .position(|p| *p == phase.as_str())
                .ok_or_else(|| PyValueError::new_err(format!("phase {phase:?} is not one of {PHASES:?}")))?;
            Some(OomVote {
                severe,
                signature,
                phase,
                index,
            })
        }
    };
    let v = Vote {
        rank,
        oom,
        error,
        peak_bytes,
        baseline_bytes,
        limit_bytes,
        alloc_retries,
        missing_grads,
    };
    Ok(encode(&v).to_vec())
}

/// What the all-reduced votes say: a dict with `error_rank`, `oom_rank`, `oom` (`(severe,
/// signature, phase, micro_batch_index)` or None), `peak_bytes`, `baseline_bytes`,
/// `limit_bytes`, `alloc_retries`.
#[pyfunction]
fn agreed<'py>(py: Python<'py>, vector: Vec<f64>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    use oomguard_policy::agreement::{decode, PHASES};
    let a = decode(&vector).map_err(PyValueError::new_err)?;
    let d = pyo3::types::PyDict::new(py);
    d.set_item("error_rank", a.error_rank)?;
    d.set_item("oom_rank", a.oom_rank)?;
    d.set_item(
        "oom",
        a.oom.map(|o| (o.severe, o.signature, PHASES[o.phase], o.index)),
    )?;
    d.set_item("peak_bytes", a.peak_bytes)?;
    d.set_item("baseline_bytes", a.baseline_bytes)?;
    d.set_item("limit_bytes", a.limit_bytes)?;
    d.set_item("alloc_retries", a.alloc_retries)?;
    d.set_item("missing_grads", a.missing_grads)?;
    Ok(d)
}

/// The micro-batch cache's size for `key` (the file `oomguard train` and sweeps share).
#[pyfunction]
fn cached_micro_batch(key: &str) -> Option<usize> {
    oomguard_runfiles::cache::cached(key)
}

/// Records that `size` fits for `key`, under the cache's lock, the file replaced whole.
/// Returns None, or the reason it could not be written (only ever a warning).
#[pyfunction]
fn remember_micro_batch(key: &str, size: usize) -> Option<String> {
    oomguard_runfiles::cache::remember(key, size).err().map(|e| {
        let at = oomguard_runfiles::cache::path().map(|p| p.display().to_string()).unwrap_or_default();
        format!("cannot write the micro-batch cache {at}: {e}")
    })
}

/// A run resuming at `next_step`: later records of `run_dir`/metrics.jsonl move to
/// metrics.replaced.jsonl, as `oomguard train` does. Returns how many lines moved.
#[pyfunction]
fn metrics_resume(run_dir: &str, next_step: u64) -> PyResult<usize> {
    oomguard_runfiles::metrics::resume(std::path::Path::new(run_dir), next_step)
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("{run_dir}/metrics.jsonl: {e}")))
}

/// Fixes glibc's mmap threshold (buffers of `threshold` bytes and more, default the
/// runtime's 4 MiB, are mapped on their own and unmapped when freed), as the runtime does
/// under a memory cap, so that a capped process gets a failed attempt's memory back.
/// Returns the threshold, or None when left alone (MALLOC_MMAP_THRESHOLD_ set by the user,
/// or not glibc).
#[pyfunction]
#[pyo3(signature = (threshold=None))]
fn bound_heap(threshold: Option<usize>) -> Option<usize> {
    match threshold {
        Some(t) => oomguard_host::memory::bound_heap_at(t),
        None => oomguard_host::memory::bound_heap(),
    }
}

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

/// Whether memory left live after an OOM's cleanup calls for shrinking harder (both guards'
/// rule).
#[pyfunction]
fn left_behind(leftover: u64, baseline: u64) -> bool {
    oomguard_policy::left_behind(leftover, baseline)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Policy>()?;
    m.add_class::<Exchange>()?;
    m.add_function(wrap_pyfunction!(malloc_trim, m)?)?;
    m.add_function(wrap_pyfunction!(classify_oom, m)?)?;
    m.add_function(wrap_pyfunction!(memory_step, m)?)?;
    m.add_function(wrap_pyfunction!(left_behind, m)?)?;
    m.add_function(wrap_pyfunction!(vote, m)?)?;
    m.add_function(wrap_pyfunction!(agreed, m)?)?;
    m.add_function(wrap_pyfunction!(cached_micro_batch, m)?)?;
    m.add_function(wrap_pyfunction!(remember_micro_batch, m)?)?;
    m.add_function(wrap_pyfunction!(metrics_resume, m)?)?;
    m.add_function(wrap_pyfunction!(bound_heap, m)?)?;
    m.add("PHASES", oomguard_policy::agreement::PHASES.to_vec())?;
    Ok(())
}
