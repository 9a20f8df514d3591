//! Owns `model.loss`: the LM head and cross-entropy, `fused` (a chunk at a time) or `full`.
//! Keeps: the padded vocabulary never reaches the loss, checkpoints or `model.safetensors`.
use serde::{Deserialize, Serialize};
use std::ffi::{c_char, c_void};
use tch::{TchError, Tensor};

extern "C" {
    fn og_fused_linear_ce(
        hidden: *mut c_void,
        weight: *mut c_void,
        targets: *mut c_void,
        vp: i64,
        chunk: i64,
        tie: *mut c_void,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn og_tie_new(out: *mut *mut c_void) -> *mut c_char;
    fn og_tie_free(tie: *mut c_void);
    fn og_tied_embedding(weight: *mut c_void, idx: *mut c_void, tie: *mut c_void, out: *mut *mut c_void)
        -> *mut c_char;
}

/// A tied embedding's lookup and the fused head in one graph (csrc/loss.cpp): the lookup's
/// backward adds its rows into the head's gradient in place, so backward holds one
/// embedding-sized gradient, not three. Only for a graph that one backward pass walks whole.
pub struct Tie(*mut c_void);

impl Tie {
    pub fn new() -> Result<Tie, TchError> {
        let mut out: *mut c_void = std::ptr::null_mut();
        crate::memory::check(unsafe { og_tie_new(&mut out) })?;
        Ok(Tie(out))
    }

    /// `weight[idx]`, its backward tied to the fused head's given this `Tie`.
    pub fn embedding(&self, weight: &Tensor, idx: &Tensor) -> Result<Tensor, TchError> {
        let mut out: *mut c_void = std::ptr::null_mut();
        crate::memory::check(unsafe { og_tied_embedding(p(weight), p(idx), self.0, &mut out) })?;
        // SAFETY: on success the C++ side returned a new torch::Tensor* we now own.
        Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
    }
}

impl Drop for Tie {
    fn drop(&mut self) {
        // The graph's nodes keep their own references.
        unsafe { og_tie_free(self.0) }
    }
}

fn p(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    #[default]
    Fused,
    Full,
}

impl LossKind {
    pub fn name(self) -> &'static str {
        match self {
            LossKind::Fused => "fused",
            LossKind::Full => "full",
        }
    }
}

/// The vocabulary rounded up to a multiple of 64 (tensor-core friendly shapes).
pub fn padded_vocab(vocab: i64) -> i64 {
    (vocab + 63) / 64 * 64
}

/// Rows (tokens) per chunk of the fused loss, a pure function of the shapes, never of the
/// memory left (so a run's numbers do not depend on what else is allocated): Liger's rule,
/// the power of two nearest above `N / ceil(vocab / n_embd)`, which makes a chunk's logits
/// about as large as the hidden states they come from; at least 256 tokens (1024 on a GPU)
/// so that each chunk's matmul stays efficient, and at most `N`.
pub fn chunk_rows(n: i64, vocab: i64, n_embd: i64, cuda: bool) -> i64 {
    let liger = (n as u64)
        .div_ceil(((vocab + n_embd - 1) / n_embd).max(1) as u64)
        .next_power_of_two() as i64;
    liger.max(chunk_floor(cuda)).min(n).max(1)
}

/// The fewest rows a chunk of the fused loss has (unless the micro-batch has fewer tokens).
pub fn chunk_floor(cuda: bool) -> i64 {
    if cuda {
        1024
    } else {
        256
    }
}

/// The mean cross-entropy of `hidden [N, C] @ weight[:V]^T` against `targets [N]`, fused
/// (csrc/loss.cpp). `weight`'s storage holds `padded_vocab(V)` rows (or it is padded).
pub fn fused_linear_cross_entropy(hidden: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<Tensor, TchError> {
    fused_linear_cross_entropy_tied(hidden, weight, targets, None)
}

/// As `fused_linear_cross_entropy`, its weight's lookup made through `tie` in this graph.
pub fn fused_linear_cross_entropy_tied(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    tie: Option<&Tie>,
) -> Result<Tensor, TchError> {
    let (n, c) = hidden.size2()?;
    let v = weight.size2()?.0;
    let chunk = chunk_rows(n, padded_vocab(v), c, hidden.device().is_cuda());
    let tie = tie.map_or(std::ptr::null_mut(), |t| t.0);
    let mut out: *mut c_void = std::ptr::null_mut();
    crate::memory::check(unsafe {
        og_fused_linear_ce(p(hidden), p(weight), p(targets), padded_vocab(v), chunk, tie, &mut out)
    })?;
    // SAFETY: on success the C++ side returned a new torch::Tensor* we now own.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_and_chunks() {
        assert_eq!(padded_vocab(50257), 50304);
        assert_eq!(padded_vocab(256), 256);
        assert_eq!(padded_vocab(1), 64);
        // GPT-2 at 8 x 1024: 8192 / 66 -> 128 rows, raised to the GPU's floor of 1024.
        assert_eq!(chunk_rows(8192, 50304, 768, true), 1024);
        assert_eq!(chunk_rows(8192, 50304, 768, false), 256);
        // A small vocabulary: one chunk of logits is as large as the hidden states.
        assert_eq!(chunk_rows(65536, 256, 128, false), 32768);
        assert_eq!(chunk_rows(100, 50304, 768, true), 100);
    }
}
