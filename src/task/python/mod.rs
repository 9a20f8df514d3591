//! Owns `model.kind: python` and `data.source: python`: a user's module, run in-process.
//! Keeps: the GIL is held only while Python runs, never during backward; a Python OOM comes back
//! as an OOM, its traceback dropped so the guard can free the attempt.
use pyo3::prelude::*;
use pyo3::types::{PyList, PyModule, PyTuple};
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tch::{Device, TchError, Tensor};

use super::{BuildContext, Built, Task};
use crate::data::{DataSource, Dataset, Samples};
use crate::error::{ConfigError, Error, Result};

const GLUE: &str = include_str!("glue.py");

/// The site-packages whose torch this binary links (set by build.rs), unless
/// OOMGUARD_SITE_PACKAGES names one (a GPU host's own torch, where the GPU kit runs) or
/// OOMGUARD_VENV names a venv (either with the same torch version).
fn site_packages() -> std::result::Result<PathBuf, String> {
    if let Some(site) = std::env::var_os("OOMGUARD_SITE_PACKAGES").map(PathBuf::from) {
        return match site.join("torch").is_dir() {
            true => Ok(site),
            false => Err(format!(
                "OOMGUARD_SITE_PACKAGES is {}, which holds no torch: point it at the site-packages folder torch is in",
                site.display()
            )),
        };
    }
    let Some(venv) = std::env::var_os("OOMGUARD_VENV").map(PathBuf::from) else {
        return Ok(PathBuf::from(env!("OOMGUARD_BUILD_SITE_PACKAGES")));
    };
    let lib = venv.join("lib");
    let found = std::fs::read_dir(&lib).ok().and_then(|d| {
        d.flatten()
            .map(|e| e.path().join("site-packages"))
            .find(|p| p.is_dir() && p.parent().is_some_and(|l| l.to_string_lossy().contains("python3")))
    });
    found.ok_or_else(|| {
        format!(
            "OOMGUARD_VENV is {}, which has no lib/python3.*/site-packages: point it at a venv (python3 -m venv DIR)",
            venv.display()
        )
    })
}

/// The embedded interpreter, started once: the venv's site-packages first on sys.path, torch
/// imported and checked against the libtorch this binary links, and the glue loaded.
fn glue(py: Python<'_>) -> Result<Bound<'_, PyModule>> {
    static GLUE_MODULE: OnceLock<std::result::Result<Py<PyModule>, String>> = OnceLock::new();
    let module = GLUE_MODULE.get_or_init(|| start(py).map_err(|e| e.to_string()));
    match module {
        Ok(m) => Ok(m.bind(py).clone()),
        Err(why) => Err(Error::Config(ConfigError::invalid("model.kind", why.clone()))),
    }
}

fn start(py: Python<'_>) -> std::result::Result<Py<PyModule>, String> {
    let site = site_packages()?;
    // Through the API, not generated code: any path (quotes, non-ASCII) passes as it is.
    let setup = || -> PyResult<()> {
        let dir = site.display().to_string();
        let sys = py.import("sys")?;
        sys.getattr("path")?.call_method1("insert", (0, &dir))?;
        py.import("site")?.call_method1("addsitedir", (&dir,))?;
        py.import("os")?
            .getattr("environ")?
            .set_item("OOMGUARD_PYTHON_SITE_PACKAGES", &dir)?;
        sys.setattr("argv", vec!["oomguard-torch"])?;
        // A model's print() reaches a file or a pipe (Slurm's log, a launcher's) line by line:
        // the embedded interpreter is never finalised, so nothing flushes its buffers at exit.
        py.run(
            c"import sys\nfor s in (sys.stdout, sys.stderr):\n    try:\n        s.reconfigure(line_buffering=True)\n    except Exception:\n        pass\n",
            None,
            None,
        )?;
        // site-packages -> lib/pythonX.Y -> lib -> the prefix holding bin/python3.
        let prefix = site.ancestors().nth(3).unwrap_or(&site);
        sys.setattr("executable", prefix.join("bin/python3").display().to_string())?;
        Ok(())
    };
    setup().map_err(|e| format!("cannot start Python: {e}"))?;
    let torch = py.import("torch").map_err(|e| {
        format!(
            "cannot import torch from {}: {e}; run `make setup`, or point OOMGUARD_VENV at a venv with torch {}",
            site.display(),
            torch_version()
        )
    })?;
    let version: String = torch
        .getattr("__version__")
        .and_then(|v| v.str()?.extract())
        .unwrap_or_default();
    let wanted = torch_version();
    if version.split('+').next() != wanted.split('+').next() {
        return Err(format!(
            "{} has torch {version}, but oomguard-torch links torch {wanted}: install torch=={} there, or unset OOMGUARD_VENV and OOMGUARD_SITE_PACKAGES",
            site.display(),
            wanted.split('+').next().unwrap_or_default()
        ));
    }
    torch
        .call_method0("initial_seed")
        .and_then(|seed| py.import("random")?.call_method1("seed", (seed,)))
        .map_err(|e| format!("cannot seed Python's random: {e}"))?;
    let code = CString::new(GLUE).expect("glue.py has no NUL");
    let m = PyModule::from_code(py, &code, c"oomguard_glue.py", c"oomguard_glue")
        .map_err(|e| format!("oomguard's Python glue failed to load: {e}"))?;
    torch
        .call_method0("initial_seed")
        .and_then(|seed| m.call_method1("seed_host", (seed,)))
        .map_err(|e| format!("cannot seed numpy's global generator: {e}"))?;
    Ok(m.unbind())
}

/// The torch version this binary was built against (build.rs read it from torch/version.py).
fn torch_version() -> String {
    env!("OOMGUARD_BUILD_TORCH_VERSION").to_string()
}

/// A Python exception as oomguard sees it: an OOM keeps the allocator's message (which
/// `classify_oom` reads); anything else is the traceback of the user's frames. The exception
/// (and its frames) is dropped here, and on an OOM the cycle collector runs, so nothing of
/// the failed attempt stays alive.
fn to_tch(py: Python<'_>, e: PyErr) -> TchError {
    let value = e.value(py);
    let text = value.str().map(|s| s.to_string()).unwrap_or_default();
    let oom_type = py
        .import("torch")
        .and_then(|t| t.getattr("OutOfMemoryError"))
        .is_ok_and(|ty| value.is_instance(&ty).unwrap_or(false));
    let runtime = value.is_instance_of::<pyo3::exceptions::PyRuntimeError>();
    // Python's MemoryError is an OOM on both fronts (the classifier reads it by its name).
    let memory = value.is_instance_of::<pyo3::exceptions::PyMemoryError>();
    let text = if memory { format!("MemoryError: {text}") } else { text };
    let oom = oom_type || memory || (runtime && crate::error::classify_oom(&text).is_some());
    let message = if oom {
        text
    } else {
        let user = glue(py)
            .ok()
            .and_then(|g| g.getattr("UserError").ok())
            .is_some_and(|ty| value.is_instance(&ty).unwrap_or(false));
        let traceback = glue(py)
            .ok()
            .and_then(|g| g.call_method1("_short_traceback", (value, e.traceback(py))).ok())
            .and_then(|t| t.extract::<String>().ok());
        match traceback {
            Some(t) if !user => format!("Python: {t}"),
            _ => format!(
                "{}: {text}",
                value.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ),
        }
    };
    drop(e);
    if oom {
        let _ = py.import("gc").and_then(|gc| gc.call_method0("collect"));
        TchError::Torch(message)
    } else {
        // Not `Torch`: its message must not be read as an OOM's.
        TchError::Io(std::io::Error::other(message))
    }
}

/// A Python error while building: the glue's `UserError` names its config key (exit 2);
/// an OOM stays an OOM; anything else is refused under `key`.
fn build_error(py: Python<'_>, e: PyErr, origin: &Path, key: &str) -> Error {
    let user = glue(py).ok().and_then(|g| {
        let ty = g.getattr("UserError").ok()?;
        let v = e.value(py);
        v.is_instance(&ty).ok()?.then(|| {
            let k: String = v
                .getattr("key")
                .and_then(|k| k.extract())
                .unwrap_or_else(|_| key.into());
            let m: String = v.getattr("message").and_then(|m| m.extract()).unwrap_or_default();
            (k, m)
        })
    });
    let (key, message) = match user {
        Some(km) => km,
        None => match Error::from(to_tch(py, e)) {
            Error::Oom(o) => return Error::Oom(o),
            other => (key.to_string(), other.to_string()),
        },
    };
    Error::Config(ConfigError {
        origin: origin.display().to_string(),
        line_col: None,
        key,
        message,
    })
}

fn wrap<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    let ptr = t
        .pyobject_wrap()
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    // SAFETY: pyobject_wrap returns a new reference to a torch.Tensor.
    Ok(unsafe { Bound::from_owned_ptr(py, ptr as *mut pyo3::ffi::PyObject) })
}

fn unwrap(ob: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    // SAFETY: a borrowed PyObject*; unpack checks that it is a tensor.
    let t = unsafe { Tensor::pyobject_unpack(ob.as_ptr() as *mut tch::python::CPyObject) }
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    t.ok_or_else(|| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "expected a torch.Tensor, got {}",
            ob.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })
}

fn named(list: &Bound<'_, PyAny>) -> PyResult<Vec<(String, Tensor)>> {
    list.try_iter()?
        .map(|item| {
            let (name, t): (String, Bound<'_, PyAny>) = item?.extract()?;
            Ok((name, unwrap(&t)?))
        })
        .collect()
}

fn settings_dict<'py>(py: Python<'py>, v: Option<&serde_yaml::Value>) -> PyResult<Bound<'py, PyAny>> {
    let json = serde_json::to_string(&v.cloned().unwrap_or(serde_yaml::Value::Mapping(Default::default())))
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    py.import("json")?.call_method1("loads", (json,))
}

fn device_name(d: Device) -> String {
    match d {
        Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".into(),
    }
}

fn resolve(base: &Path, p: &Option<PathBuf>) -> PathBuf {
    let p = p.clone().unwrap_or_default();
    if p.is_absolute() {
        p
    } else {
        base.join(p)
    }
}

/// The Python model.
pub struct PythonTask {
    model: Py<PyAny>,
    data: Option<Py<PyAny>>,
    path: PathBuf,
    build: String,
    blocks: Option<String>,
    params: Vec<(String, Tensor)>,
    state: Vec<(String, Tensor)>,
    /// The persistent buffers only: a step may change them (snapshot, undo, broadcast); frozen
    /// parameters, which it never changes, are in `state` alone (saved, broadcast once).
    buffers: Vec<(String, Tensor)>,
    checkpointing: Option<bool>,
    /// The data file defines `loss_units`: each forward counts its batch's, kept here
    /// (-1: none yet) for `last_units`.
    counts_units: bool,
    last_units: std::sync::atomic::AtomicI64,
}

/// Builds the model (and, for `data.source: python`, the data) a config names.
pub fn build(ctx: &BuildContext) -> Result<Built> {
    let m = ctx.model;
    let path = resolve(ctx.base_dir, &m.path);
    let origin = ctx.config_path;
    let missing = |key: &str, p: &Path, what: &str| {
        Error::Config(ConfigError {
            origin: origin.display().to_string(),
            line_col: None,
            key: key.into(),
            message: format!("{} does not exist; {what}", p.display()),
        })
    };
    if !path.is_file() {
        return Err(missing(
            "model.path",
            &path,
            "point model.path at the .py file whose build(settings) returns the torch.nn.Module",
        ));
    }
    let data_path = (ctx.data.source == DataSource::Python).then(|| resolve(ctx.base_dir, &ctx.data.path));
    if let Some(p) = data_path.as_ref().filter(|p| !p.is_file()) {
        return Err(missing(
            "data.path",
            p,
            "point data.path at the .py file whose build(settings, split) returns a dataset",
        ));
    }
    let build_fn = m.build.clone().unwrap_or_else(|| "build".into());
    pyo3::prepare_freethreaded_python();
    Python::with_gil(|py| {
        let g = glue(py)?;
        let model = g
            .call_method1(
                "build_model",
                (
                    path.display().to_string(),
                    &build_fn,
                    m.loss.as_ref().map(|l| l.name().to_string()),
                    settings_dict(py, m.settings.as_ref()).map_err(|e| build_error(py, e, origin, "model.settings"))?,
                    device_name(ctx.device),
                ),
            )
            .map_err(|e| build_error(py, e, origin, "model.build"))?;
        // The module's named tensors, as the glue lists them (`parameters`, `state`).
        let tensors = |method: &str| {
            model
                .call_method0(method)
                .and_then(|list| named(&list))
                .map_err(|e| build_error(py, e, origin, "model.path"))
        };
        let params = tensors("parameters")?;
        if params.is_empty() {
            return Err(Error::Config(ConfigError {
                origin: origin.display().to_string(),
                line_col: None,
                key: "model.build".into(),
                message: format!(
                    "{}: {build_fn}(settings) returned a module with no trainable parameters (none requires grad)",
                    path.display()
                ),
            }));
        }
        let state = tensors("state")?;
        let buffers = tensors("buffers")?;
        let data = match &data_path {
            None => None,
            Some(p) => Some(
                g.call_method1(
                    "Data",
                    (
                        p.display().to_string(),
                        ctx.data.build.clone().unwrap_or_else(|| "build".into()),
                        settings_dict(py, ctx.data.settings.as_ref())
                            .map_err(|e| build_error(py, e, origin, "data.settings"))?,
                    ),
                )
                .map_err(|e| build_error(py, e, origin, "data.build"))?,
            ),
        };
        let dataset = match (&data, &data_path) {
            (Some(d), Some(p)) => Some(dataset(py, d, p)?),
            _ => None,
        };
        let blocks: usize = model
            .call_method1("find_blocks", (m.blocks.clone(),))
            .and_then(|b| b.len())
            .map_err(|e| build_error(py, e, origin, "model.blocks"))?;
        if let (Some(class), 0) = (&m.blocks, blocks) {
            return Err(Error::Config(ConfigError {
                origin: origin.display().to_string(),
                line_col: None,
                key: "model.blocks".into(),
                message: format!(
                    "the module {build_fn}(settings) built has no submodule of class `{class}`: name the class of its repeated blocks"
                ),
            }));
        }
        let task = PythonTask {
            model: model.unbind(),
            data: data.as_ref().map(|d| d.clone().unbind()),
            path: path.clone(),
            build: build_fn.clone(),
            blocks: m.blocks.clone(),
            params,
            state,
            buffers,
            checkpointing: (blocks > 0).then_some(false),
            counts_units: data
                .as_ref()
                .is_some_and(|d| d.getattr("units").is_ok_and(|u| !u.is_none())),
            last_units: std::sync::atomic::AtomicI64::new(-1),
        };
        let built = Built::new(task);
        Ok(match dataset {
            Some(d) => built.with_data(d),
            None => built,
        })
    })
}

fn dataset(py: Python<'_>, data: &Bound<'_, PyAny>, path: &Path) -> Result<Dataset> {
    let split = |s: i64, name: &str| -> Result<Box<dyn Samples>> {
        let len: usize = data.call_method1("len", (s,)).and_then(|n| n.extract()).map_err(|e| {
            Error::Data(format!(
                "{}: len of the {name} dataset: {}",
                path.display(),
                to_tch(py, e)
            ))
        })?;
        Ok(Box::new(PythonSamples {
            split: s,
            len,
            name: format!("{} ({name})", path.display()),
            counted: data.getattr("units").is_ok_and(|u| !u.is_none()),
        }))
    };
    Ok(Dataset {
        train: split(0, "train")?,
        val: split(1, "val")?,
    })
}

/// A Python dataset's samples, as the trainer addresses them: a batch is the samples'
/// indices (inputs) and the split (targets, each the split's number), on the CPU. The
/// Python model collates the items itself (the dataset's `collate`, or stacking each field),
/// so the sampler stays oomguard's: seeded, sharded across ranks, exact on resume.
struct PythonSamples {
    split: i64,
    len: usize,
    name: String,
    /// The data file defines `loss_units`: the model's forward counts them on its batch.
    counted: bool,
}

impl Samples for PythonSamples {
    fn num_positions(&self) -> usize {
        self.len
    }
    fn batch(&self, positions: &[usize], _device: Device) -> Result<(Tensor, Tensor)> {
        let idx: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let x = Tensor::f_from_slice(&idx)?;
        // Not f_full: tch's scalar forms panic on an allocation failure.
        let y = Tensor::f_from_slice(&vec![self.split; idx.len()])?;
        Ok((x, y))
    }
    /// With `loss_units` in the data file, its loss is a mean over those units (masked
    /// tokens left out), counted by the model's forward on the batch it builds, once.
    fn counted_in_forward(&self) -> bool {
        self.counted
    }
    fn name(&self) -> String {
        self.name.clone()
    }
}

impl PythonTask {
    fn batch<'py>(&self, py: Python<'py>, inputs: &Tensor, targets: &Tensor) -> PyResult<Bound<'py, PyAny>> {
        let tch_err = |e: TchError| pyo3::exceptions::PyValueError::new_err(e.to_string());
        match &self.data {
            Some(data) => {
                let split = targets.f_int64_value(&[0]).map_err(tch_err)?;
                let idx = Vec::<i64>::try_from(inputs).map_err(tch_err)?;
                data.bind(py).call_method1("batch", (split, PyList::new(py, idx)?))
            }
            None => Ok(PyTuple::new(py, [wrap(py, inputs)?, wrap(py, targets)?])?.into_any()),
        }
    }
}

impl PythonTask {
    /// The glue's `name(seed)` (or `name()`) on the host generators; a failure is the step's
    /// (forward).
    fn call_glue(&self, name: &str, seed: Option<u64>) -> Result<()> {
        Python::with_gil(|py| {
            let g = glue(py)?;
            let called = match seed {
                Some(s) => g.call_method1(name, (s,)),
                None => g.call_method0(name),
            };
            called
                .map(drop)
                .map_err(|e| Error::from(to_tch(py, e)).in_phase(crate::error::Phase::Forward))
        })
    }
}

impl Task for PythonTask {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        super::shallow(&self.params)
    }
    /// The module's persistent buffers (`named_buffers` that its `state_dict` saves), never a
    /// frozen parameter: those no step changes.
    fn buffers(&self) -> Vec<(String, Tensor)> {
        super::shallow(&self.buffers)
    }
    /// The module's `state_dict`: tied weights under each name, buffers, frozen parameters.
    fn state(&self) -> Vec<(String, Tensor)> {
        super::shallow(&self.state)
    }
    /// `module.train(train)`; the batch's fields go to the module (or to `model.loss`).
    fn loss(&self, inputs: &Tensor, targets: &Tensor, train: bool) -> Result<Tensor, TchError> {
        Python::with_gil(|py| {
            let run = || -> PyResult<Tensor> {
                let batch = self.batch(py, inputs, targets)?;
                if let (true, Some(data)) = (self.counts_units, &self.data) {
                    // Counted on the batch the loss is computed on, before it: one collation.
                    let n: usize = data.bind(py).call_method1("count_units", (&batch,))?.extract()?;
                    self.last_units.store(n as i64, std::sync::atomic::Ordering::Relaxed);
                }
                unwrap(&self.model.bind(py).call_method1("loss", (batch, train))?)
            };
            run().map_err(|e| to_tch(py, e))
        })
    }
    fn last_units(&self) -> Option<usize> {
        let n = self.last_units.load(std::sync::atomic::Ordering::Relaxed);
        (self.counts_units && n >= 0).then_some(n as usize)
    }
    fn activation_checkpointing(&self) -> Option<bool> {
        self.checkpointing
    }
    /// Recomputation may run a backward of its own per wrapped block, and a block may share
    /// a weight with the rest (tied embeddings): reduced after backward then.
    fn backward_is_one_pass(&self) -> bool {
        self.checkpointing != Some(true)
    }
    fn set_activation_checkpointing(&mut self, on: bool) {
        let n = Python::with_gil(|py| {
            self.model
                .bind(py)
                .call_method1("set_checkpointing", (on, self.blocks.clone()))
                .and_then(|n| n.extract::<usize>())
                .map_err(|e| to_tch(py, e))
        });
        match n {
            Ok(0) => tracing::warn!(
                "activation checkpointing: {} has no repeated blocks to wrap (name their class in model.blocks)",
                self.path.display()
            ),
            Ok(n) => {
                tracing::info!("activation checkpointing {}: {n} blocks", if on { "on" } else { "off" });
                self.checkpointing = Some(on);
            }
            Err(e) => tracing::warn!("activation checkpointing could not be set: {e}"),
        }
    }
    fn describe(&self) -> String {
        let n: i64 = self.params.iter().map(|(_, t)| t.numel() as i64).sum();
        format!(
            "{} (Python, {}; {:.2}M parameters)",
            self.path.display(),
            self.build,
            n as f64 / 1e6
        )
    }
    fn host_rng_state(&self) -> Option<serde_json::Value> {
        Python::with_gil(|py| {
            let state = glue(py).ok()?.call_method0("python_rng_state").ok()?;
            let text: String = py
                .import("json")
                .ok()?
                .call_method1("dumps", (state,))
                .ok()?
                .extract()
                .ok()?;
            serde_json::from_str(&text).ok()
        })
    }
    fn seed_host_rng(&self, seed: u64) -> Result<()> {
        self.call_glue("seed_host_all", Some(seed))
    }
    fn set_host_rng_state(&self, state: &serde_json::Value) -> Result<()> {
        Python::with_gil(|py| {
            let run = || -> PyResult<()> {
                let v = py.import("json")?.call_method1("loads", (state.to_string(),))?;
                glue(py)
                    .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?
                    .call_method1("set_python_rng_state", (v,))?;
                Ok(())
            };
            run().map_err(|e| Error::Checkpoint(format!("Python's random state: {}", to_tch(py, e))))
        })
    }
}
