//! Named tensors to and from safetensors files, with fallible calls only: tch's own
//! `VarStore::load` converts with an operator that panics when an allocation fails, and its
//! safetensors writer copies device tensors with an `unwrap`. Here every copy that can
//! allocate happens first, as `Result`s; what is written is already CPU and contiguous.
use std::collections::HashMap;
use std::path::Path;
use tch::{Device, Tensor};

use super::Task;
use crate::error::{ConfigError, Error, Result};

/// Writes `named` to `path` (safetensors), whole or not at all (a temporary file renamed
/// over it): a kill or an OOM mid-write never leaves a torn file.
pub fn save(named: &[(String, Tensor)], path: &Path) -> Result<()> {
    let mut host = Vec::with_capacity(named.len());
    for (name, t) in named {
        // A no-op for CPU tensors that are already contiguous; an `Err` (not a panic) if the
        // copy cannot be allocated.
        let t = t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?;
        host.push((name.as_str(), t));
    }
    let write = |tmp: &Path| Tensor::write_safetensors(&host, tmp).map_err(|e| std::io::Error::other(e.to_string()));
    oomguard_report::atomic::replace_with(path, write)
        .map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
}

/// Reads a safetensors file.
pub fn read(path: &Path) -> Result<Vec<(String, Tensor)>, String> {
    Tensor::read_safetensors(path).map_err(|e| format!("cannot read it as safetensors: {e}"))
}

/// Copies `saved` into `into` by name: every tensor of `into` must be present with its
/// shape (extra saved tensors are refused too, so nothing is silently ignored).
pub fn copy_into(saved: &[(String, Tensor)], into: &[(String, Tensor)]) -> Result<(), String> {
    let by_name: HashMap<&str, &Tensor> = saved.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let missing: Vec<&str> = into
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| !by_name.contains_key(n))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "has no {} (of {} the model needs), e.g. `{}`",
            plural(missing.len(), "tensor"),
            into.len(),
            missing[..missing.len().min(3)].join("`, `")
        ));
    }
    let extra: Vec<&str> = saved
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| !into.iter().any(|(m, _)| m == n))
        .collect();
    if !extra.is_empty() {
        return Err(format!(
            "holds {} the model does not have, e.g. `{}`",
            plural(extra.len(), "tensor"),
            extra[..extra.len().min(3)].join("`, `")
        ));
    }
    let _no_grad = tch::no_grad_guard();
    for (name, t) in into {
        let src = by_name[name.as_str()];
        if src.size() != t.size() {
            return Err(format!(
                "`{name}` has shape {:?}, the model's is {:?}",
                src.size(),
                t.size()
            ));
        }
        t.shallow_clone().f_copy_(src).map_err(|e| format!("`{name}`: {e}"))?;
    }
    Ok(())
}

fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// `model.init_from`: starting weights for the task.
pub fn init_from(task: &dyn Task, path: &Path) -> Result<()> {
    let bad = |why: String| {
        Error::Config(ConfigError::invalid(
            "model.init_from",
            format!("{}: {why}", path.display()),
        ))
    };
    let saved = read(path).map_err(bad)?;
    copy_into(&saved, &task.state()).map_err(bad)?;
    tracing::info!("weights from {}", path.display());
    Ok(())
}
