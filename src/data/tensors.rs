//! Owns `data.source: tensors`: `inputs` and `targets` from a safetensors file, along dim 0.
//! Keeps: the last `val_fraction` of the rows is held out; a sample's position is its row.
use std::path::Path;
use tch::{Device, Tensor};

use super::{Dataset, Samples, IGNORE_INDEX};
use crate::error::{Error, Result};

struct Rows {
    inputs: Tensor,
    targets: Tensor,
    name: String,
    /// Integer targets holding IGNORE_INDEX somewhere: the loss averages over fewer units
    /// than the samples hold, so a step weighs its micro-batches by their valid units.
    masked: bool,
}

impl Samples for Rows {
    fn num_positions(&self) -> usize {
        self.inputs.size().first().copied().unwrap_or(0) as usize
    }
    fn batch(&self, positions: &[usize], device: Device) -> Result<(Tensor, Tensor)> {
        let idx: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let idx = Tensor::f_from_slice(&idx)?;
        let pick = |t: &Tensor| crate::ops::upload(&t.f_index_select(0, &idx)?, device);
        Ok((pick(&self.inputs)?, pick(&self.targets)?))
    }
    fn valid_units(&self, positions: &[usize]) -> Result<Option<usize>> {
        if !self.masked {
            return Ok(None);
        }
        let idx: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let picked = self.targets.f_index_select(0, &Tensor::f_from_slice(&idx)?)?;
        // Not tch's scalar `ne`: its Scalar's drop panics after a failed allocation.
        let ignore = crate::ops::scalar(IGNORE_INDEX as f64, picked.kind(), picked.device())?;
        let valid = picked
            .f_ne_tensor(&ignore)?
            .f_sum(tch::Kind::Int64)?
            .f_int64_value(&[])?;
        Ok(Some(valid as usize))
    }
    fn name(&self) -> String {
        self.name.clone()
    }
}

/// `gpt`: the GPT's vocabulary, which token ids (inputs, and targets other than the ignored
/// -100) must fall in, and its context, which a row of `inputs` must fit.
pub(super) fn open(path: &Path, val_fraction: f64, gpt: Option<(i64, i64)>) -> Result<Dataset> {
    let vocab = gpt.map(|(v, _)| v);
    let bad = |why: String| Error::Data(format!("{}: {why}", path.display()));
    let named = Tensor::read_safetensors(path).map_err(|e| match Error::from(e) {
        Error::Oom(o) => Error::Oom(o), // too big for the memory: the caller says so (exit 3)
        e => bad(format!("cannot read it as safetensors ({e})")),
    })?;
    let get = |name: &str| {
        named.iter().find(|(n, _)| n == name).map(|(_, t)| t.shallow_clone()).ok_or_else(|| {
            let have: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
            bad(format!("has no tensor `{name}` (it has {have:?}); data.source tensors needs `inputs` and `targets`, samples along dim 0"))
        })
    };
    let (inputs, targets) = (get("inputs")?, get("targets")?);
    let rows = |t: &Tensor| t.size().first().copied().unwrap_or(0);
    if inputs.dim() == 0 || targets.dim() == 0 || rows(&inputs) != rows(&targets) {
        return Err(bad(format!(
            "`inputs` {:?} and `targets` {:?} must have the same number of samples along dim 0",
            inputs.size(),
            targets.size()
        )));
    }
    if let Some((_, block)) = gpt {
        let len = inputs.size().get(1).copied().unwrap_or(1);
        if len > block {
            return Err(bad(format!(
                "rows of `inputs` hold {len} tokens, past the GPT's context model.block_size {block}: cut them to \
                 {block} or fewer, or raise model.block_size"
            )));
        }
    }
    let n = rows(&inputs);
    let n_val = ((n as f64) * val_fraction).round() as i64;
    if n_val < 1 || n - n_val < 1 {
        return Err(bad(format!(
            "{n} samples cannot be split into training and validation by data.val_fraction {val_fraction}"
        )));
    }
    let part = |t: &Tensor, start: i64, len: i64| t.f_narrow(0, start, len);
    let name = path.display().to_string();
    let integer = matches!(
        targets.kind(),
        tch::Kind::Int64 | tch::Kind::Int | tch::Kind::Int16 | tch::Kind::Int8
    );
    // How many targets are ignored: some (the loss averages over fewer units), or all.
    let ignored = match integer {
        // Tensor against tensor: tch's scalar forms panic on an allocation failure.
        true => targets
            .f_eq_tensor(&like(&targets, IGNORE_INDEX)?)?
            .f_sum(tch::Kind::Int64)?
            .f_int64_value(&[])?,
        false => 0,
    };
    let masked = ignored > 0;
    if integer && ignored == targets.numel() as i64 {
        return Err(bad(format!(
            "every one of `targets` is {IGNORE_INDEX} (ignored): there is nothing to learn from; is the mask inverted?"
        )));
    }
    // A split whose every target is ignored scores nothing: its loss would read 0 (the
    // validation's, kept as the best) or train on weight decay alone.
    if masked {
        for (which, start, len) in [("training", 0, n - n_val), ("validation", n - n_val, n_val)] {
            let kept = part(&targets, start, len)?
                .f_ne_tensor(&like(&targets, IGNORE_INDEX)?)?
                .f_sum(tch::Kind::Int64)?
                .f_int64_value(&[])?;
            if kept == 0 {
                return Err(bad(format!(
                    "every target of the {which} split (the {} rows from row {start}; data.val_fraction \
                     {val_fraction} holds out the last rows) is {IGNORE_INDEX} (ignored): there is nothing to \
                     score; shuffle the rows, or change data.val_fraction",
                    len
                )));
            }
        }
    }
    if let Some(v) = vocab {
        check_ids(&inputs, "inputs", v, false).map_err(bad)?;
        check_ids(&targets, "targets", v, true).map_err(bad)?;
    }
    let split = |start: i64, len: i64, which: &str| -> Result<Rows> {
        Ok(Rows {
            inputs: part(&inputs, start, len)?,
            targets: part(&targets, start, len)?,
            name: format!("{name} ({which} split)"),
            masked,
        })
    };
    Ok(Dataset {
        train: Box::new(split(0, n - n_val, "train")?),
        val: Box::new(split(n - n_val, n_val, "validation")?),
    })
}

/// `v` as a 0-d tensor of `t`'s kind and device, to compare `t` with.
fn like(t: &Tensor, v: i64) -> std::result::Result<Tensor, tch::TchError> {
    crate::ops::scalar(v as f64, t.kind(), t.device())
}

/// Token ids for a GPT: integers in [0, vocab) (`masked`: or the ignored -100). The why, or
/// a libtorch error as text.
fn check_ids(t: &Tensor, name: &str, vocab: i64, masked: bool) -> std::result::Result<(), String> {
    use tch::Kind::*;
    if !matches!(t.kind(), Int64 | Int | Int16 | Int8 | Uint8) {
        return Err(format!(
            "`{name}` holds {:?}; a GPT (model.kind gpt) takes integer token ids: save them as int64",
            t.kind()
        ));
    }
    let outside = (|| -> std::result::Result<Option<(i64, i64)>, tch::TchError> {
        // Two reductions first (no temporary the tensor's size): in range, nothing to find.
        let (lo, hi) = (t.f_min()?.f_int64_value(&[])?, t.f_max()?.f_int64_value(&[])?);
        if lo >= 0 && hi < vocab {
            return Ok(None);
        }
        // As int64, where vocab and -100 are exact (uint8 ids would wrap them).
        let t = t.f_flatten(0, -1)?.f_to_kind(Int64)?;
        let mut bad = t
            .f_lt_tensor(&like(&t, 0)?)?
            .f_logical_or(&t.f_ge_tensor(&like(&t, vocab)?)?)?;
        if masked {
            bad = bad.f_logical_and(&t.f_ne_tensor(&like(&t, IGNORE_INDEX)?)?)?;
        }
        let at = bad.f_nonzero()?;
        if at.size()[0] == 0 {
            return Ok(None);
        }
        let i = at.f_int64_value(&[0, 0])?;
        Ok(Some((i, t.f_int64_value(&[i])?)))
    })()
    .map_err(|e| e.to_string())?;
    match outside {
        None => Ok(()),
        Some((i, id)) => Err(format!(
            "`{name}` holds token id {id} (element {i}, flattened), not in [0, model.vocab_size {vocab}){}; raise model.vocab_size or re-tokenize",
            if masked { " nor the ignored -100" } else { "" }
        )),
    }
}
