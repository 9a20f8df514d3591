//! Owns named tensors to and from safetensors files, with fallible calls only.
//! Keeps: every copy that can allocate happens first, as a `Result`; nothing here panics on OOM.
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
/// shape (extra saved tensors are refused too, so nothing is silently ignored). A tied
/// weight (one tensor under two names, an LM head sharing the embedding) needs only one of
/// its names, as Hugging Face's files keep it. The error lists every missing, unexpected and
/// mis-shaped name at once.
pub fn copy_into(saved: &[(String, Tensor)], into: &[(String, Tensor)]) -> Result<(), String> {
    let by_name: HashMap<&str, &Tensor> = saved.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let same = |a: &Tensor, b: &Tensor| a.data_ptr() == b.data_ptr() && a.size() == b.size();
    // A name of `into` is covered when the file has it, or has a name tied to it.
    let source = |name: &str, t: &Tensor| -> Option<&Tensor> {
        by_name.get(name).copied().or_else(|| {
            into.iter()
                .find(|(m, u)| m != name && same(u, t) && by_name.contains_key(m.as_str()))
                .map(|(m, _)| by_name[m.as_str()])
        })
    };
    let missing: Vec<String> = into
        .iter()
        .filter(|(n, t)| source(n, t).is_none())
        .map(|(n, _)| format!("`{n}`"))
        .collect();
    let unexpected: Vec<String> = saved
        .iter()
        .filter(|(n, _)| !into.iter().any(|(m, _)| m == n))
        .map(|(n, _)| format!("`{n}`"))
        .collect();
    let misshaped: Vec<String> = into
        .iter()
        .filter_map(|(n, t)| {
            let s = source(n, t)?;
            (s.size() != t.size()).then(|| format!("`{n}` ({:?} in the file, {:?} in the model)", s.size(), t.size()))
        })
        .collect();
    let mut parts = vec![];
    for (what, names) in [
        ("missing", &missing),
        ("unexpected", &unexpected),
        ("mis-shaped", &misshaped),
    ] {
        if !names.is_empty() {
            let shown = names[..names.len().min(8)].join(", ");
            let more = if names.len() > 8 {
                format!(" and {} more", names.len() - 8)
            } else {
                String::new()
            };
            parts.push(format!("{} {what}: {shown}{more}", plural(names.len(), "tensor")));
        }
    }
    if !parts.is_empty() {
        return Err(format!(
            "does not match the model's {} tensors: {}",
            into.len(),
            parts.join("; ")
        ));
    }
    let _no_grad = tch::no_grad_guard();
    for (name, t) in into {
        let src = source(name, t).expect("checked above");
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
