//! Owns TorchScript models (`model: {kind: torchscript, path: model.pt}`).
//! Keeps: parameters keep PyTorch's names, so saved weights load back into the Python module
//! with `load_state_dict(strict=True)`.
use std::cell::Cell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use tch::{TchError, Tensor};

use super::{error_line, BuildContext, Task};
use crate::error::{ConfigError, Error, Result};
use crate::memory::check;

type NamedCb = extern "C" fn(ctx: *mut c_void, name: *const c_char, tensor: *mut c_void);

extern "C" {
    fn og_ts_load(path: *const c_char, cuda_index: i32, out: *mut *mut c_void) -> *mut c_char;
    fn og_ts_free(module: *mut c_void);
    fn og_ts_list(module: *mut c_void, what: i32, ctx: *mut c_void, cb: NamedCb) -> *mut c_char;
    fn og_ts_has_method(module: *mut c_void, name: *const c_char) -> i32;
    fn og_ts_train(module: *mut c_void, on: i32) -> *mut c_char;
    fn og_ts_call(
        module: *mut c_void,
        method: *const c_char,
        inputs: *mut c_void,
        targets: *mut c_void,
        out: *mut *mut c_void,
    ) -> *mut c_char;
}

/// A loaded `torch::jit::Module`, freed on drop.
struct Module(*mut c_void);

impl Drop for Module {
    fn drop(&mut self) {
        unsafe { og_ts_free(self.0) }
    }
}

extern "C" fn collect(ctx: *mut c_void, name: *const c_char, tensor: *mut c_void) {
    // SAFETY: ctx is the Vec `list` passed in; name is a NUL-terminated string; a non-null
    // tensor is a new torch::Tensor* we now own.
    let out = unsafe { &mut *(ctx as *mut Vec<(String, Option<Tensor>)>) };
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    let tensor = (!tensor.is_null()).then(|| unsafe { Tensor::from_ptr(tensor as *mut torch_sys::C_tensor) });
    out.push((name, tensor));
}

impl Module {
    fn list(&self, what: i32) -> Result<Vec<(String, Option<Tensor>)>, TchError> {
        let mut out: Vec<(String, Option<Tensor>)> = Vec::new();
        check(unsafe { og_ts_list(self.0, what, &mut out as *mut _ as *mut c_void, collect) })?;
        Ok(out)
    }
    fn tensors(&self, what: i32) -> Result<Vec<(String, Tensor)>, TchError> {
        Ok(self
            .list(what)?
            .into_iter()
            .filter_map(|(n, t)| t.map(|t| (n, t)))
            .collect())
    }
}

pub struct TorchScriptTask {
    module: Module,
    path: PathBuf,
    method: CString,
    /// Each parameter once, under the first name it appears under.
    params: Vec<(String, Tensor)>,
    /// Every (name, parameter), tied ones under each name, for what is saved.
    named: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
    training: Cell<Option<bool>>,
}

impl TorchScriptTask {
    pub fn load(ctx: &BuildContext) -> Result<TorchScriptTask> {
        let m = ctx.model;
        let rel = m.path.clone().unwrap_or_default();
        let path = if rel.is_absolute() { rel } else { ctx.base_dir.join(rel) };
        let origin = ctx.config_path.display().to_string();
        let bad = |key: &str, message: String| {
            Error::Config(ConfigError {
                origin: origin.clone(),
                line_col: None,
                key: key.into(),
                message,
            })
        };
        if !path.is_file() {
            return Err(bad(
                "model.path",
                format!(
                    "{} does not exist; save the module with torch.jit.save(torch.jit.script(model), path)",
                    path.display()
                ),
            ));
        }
        let cpath =
            CString::new(path.display().to_string()).map_err(|_| bad("model.path", "contains a NUL byte".into()))?;
        let cuda = match ctx.device {
            tch::Device::Cuda(i) => i as i32,
            _ => -1,
        };
        let mut ptr: *mut c_void = std::ptr::null_mut();
        if let Err(e) = check(unsafe { og_ts_load(cpath.as_ptr(), cuda, &mut ptr) }) {
            return Err(match Error::from(e) {
                Error::Oom(o) => Error::Oom(o),
                e => bad("model.path", format!(
                    "{} is not a TorchScript module that loads here ({}); save one with torch.jit.save(torch.jit.script(model), path) or torch.jit.trace",
                    path.display(), error_line(&e.to_string())
                )),
            });
        }
        let module = Module(ptr);
        let method_name = m.method.clone().unwrap_or_else(|| "forward".into());
        let method =
            CString::new(method_name.clone()).map_err(|_| bad("model.method", "contains a NUL byte".into()))?;
        if unsafe { og_ts_has_method(module.0, method.as_ptr()) } == 0 {
            let methods: Vec<String> = module.list(2)?.into_iter().map(|(n, _)| n).collect();
            return Err(bad("model.method", format!(
                "{} has no method `{method_name}` (its methods: {}); export the method that returns the mean loss with @torch.jit.export",
                path.display(), methods.join(", ")
            )));
        }
        let named = module.tensors(0)?;
        let mut params: Vec<(String, Tensor)> = Vec::new();
        for (name, t) in &named {
            // Tied weights (an LM head sharing the embedding) are one tensor under two names.
            if !params
                .iter()
                .any(|(_, p)| p.data_ptr() == t.data_ptr() && p.size() == t.size())
            {
                params.push((name.clone(), t.shallow_clone()));
            }
        }
        if !params.iter().any(|(_, t)| t.requires_grad()) {
            return Err(bad(
                "model.path",
                format!("{} has no trainable parameters (none requires grad)", path.display()),
            ));
        }
        let buffers = module.tensors(1)?;
        Ok(TorchScriptTask {
            module,
            path,
            method,
            params,
            named,
            buffers,
            training: Cell::new(None),
        })
    }

    fn set_training(&self, on: bool) -> Result<(), TchError> {
        if self.training.get() != Some(on) {
            check(unsafe { og_ts_train(self.module.0, on as i32) })?;
            self.training.set(Some(on));
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Task for TorchScriptTask {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        super::shallow(&self.params)
    }
    fn buffers(&self) -> Vec<(String, Tensor)> {
        super::shallow(&self.buffers)
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = super::shallow(&self.named);
        all.extend(self.buffers());
        all
    }
    /// Dropout and BatchNorm follow train and eval mode.
    fn loss(&self, inputs: &Tensor, targets: &Tensor, train: bool) -> Result<Tensor, TchError> {
        self.set_training(train)?;
        let mut out: *mut c_void = std::ptr::null_mut();
        check(unsafe {
            og_ts_call(
                self.module.0,
                self.method.as_ptr(),
                inputs.as_ptr() as *mut c_void,
                targets.as_ptr() as *mut c_void,
                &mut out,
            )
        })?;
        // SAFETY: on success og_ts_call returns a new torch::Tensor* we now own.
        Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
    }
    fn describe(&self) -> String {
        let n: i64 = self.params.iter().map(|(_, t)| t.numel() as i64).sum();
        format!(
            "{} (TorchScript, {}; {:.2}M parameters)",
            self.path.display(),
            self.method.to_string_lossy(),
            n as f64 / 1e6
        )
    }
}
