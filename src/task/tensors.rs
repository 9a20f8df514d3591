//! Owns named tensors to and from safetensors files, with fallible calls only.
//! Keeps: every copy that can allocate happens first, as a `Result`; nothing here panics on OOM.
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use tch::{Device, Kind, Tensor};

use super::Task;
use crate::error::{ConfigError, Error, Result};

/// Writes `named` to `path` (safetensors), whole or not at all (a temporary file renamed
/// over it): a kill or an OOM mid-write never leaves a torn file. One tensor at a time: the
/// header first (from the shapes alone), then each tensor's bytes, so a device's tensors take
/// one host copy of the largest, never the whole state at once (a contiguous CPU tensor is
/// written from its own memory). The metadata says `format: pt`, as PyTorch's writers do.
pub fn save(named: &[(String, Tensor)], path: &Path) -> Result<()> {
    let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let head = header(&refs, serde_json::json!({"format": "pt"}))?;
    // The first failure of a copy (an OOM on the host, as a `Result`), kept whole for the
    // caller (the checkpoint's retries tell an OOM from the rest).
    let mut failed: Option<tch::TchError> = None;
    let write = |tmp: &Path| -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(tmp)?);
        f.write_all(&(head.len() as u64).to_le_bytes())?;
        f.write_all(&head)?;
        let _no_grad = tch::no_grad_guard();
        for (_, t) in named {
            let host = match t
                .f_detach()
                .and_then(|t| t.f_to_device(Device::Cpu))
                .and_then(|t| t.f_contiguous())
            {
                Ok(h) => h,
                Err(e) => {
                    let msg = e.to_string();
                    failed = Some(e);
                    return Err(std::io::Error::other(msg));
                }
            };
            let len = host.numel() * host.kind().elt_size_in_bytes();
            if len > 0 {
                // SAFETY: `host` is a contiguous CPU tensor of `len` bytes, alive here.
                let bytes = unsafe { std::slice::from_raw_parts(host.data_ptr() as *const u8, len) };
                f.write_all(bytes)?;
            }
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    let written = oomguard_report::atomic::replace_with(path, write);
    if let Some(e) = failed {
        return Err(e.into());
    }
    written.map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
}

/// safetensors' header for `named` (their bytes in that order, after it), with `meta` as its
/// `__metadata__`, padded to 8 bytes as the format asks; the shard files' writer uses it too.
pub fn header(named: &[(&str, &Tensor)], meta: serde_json::Value) -> Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), meta);
    let mut offset = 0usize;
    for (name, t) in named {
        let dtype = safetensors_dtype(t.kind())
            .ok_or_else(|| Error::Data(format!("`{name}`: safetensors has no dtype for {:?}", t.kind())))?;
        let bytes = t.numel() * t.kind().elt_size_in_bytes();
        let info = serde_json::json!({"dtype": dtype, "shape": t.size(), "data_offsets": [offset, offset + bytes]});
        if map.insert(name.to_string(), info).is_some() {
            return Err(Error::Data(format!("`{name}` is named twice in one safetensors file")));
        }
        offset += bytes;
    }
    let mut head = serde_json::to_vec(&map).map_err(|e| Error::Data(format!("encoding a safetensors header: {e}")))?;
    head.resize(head.len().div_ceil(8) * 8, b' ');
    Ok(head)
}

fn safetensors_dtype(k: Kind) -> Option<&'static str> {
    Some(match k {
        Kind::Float => "F32",
        Kind::Double => "F64",
        Kind::Half => "F16",
        Kind::BFloat16 => "BF16",
        Kind::Int64 => "I64",
        Kind::Int => "I32",
        Kind::Int16 => "I16",
        Kind::Int8 => "I8",
        Kind::Uint8 => "U8",
        Kind::Bool => "BOOL",
        _ => return None,
    })
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
