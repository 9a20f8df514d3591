//! Owns the built-in GPT (decoder-only, as in nanoGPT), with its LM head tied to the embedding.
//! Keeps: every op is fallible (`f_*`): an OOM inside the forward is an `Err`, never a panic.
use serde::{Deserialize, Serialize};
use tch::{nn, Kind, Reduction, TchError, Tensor};

use super::loss::{fused_linear_cross_entropy_tied, padded_vocab, LossKind, Tie};
use crate::error::ConfigError;
use crate::memory::snapshot;
use crate::precision::Amp;

/// A GPT's shape (the `model` section of kind `gpt`, defaults filled in).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    pub n_layer: i64,
    pub n_head: i64,
    pub n_embd: i64,
    pub block_size: i64,
    pub vocab_size: i64,
    pub dropout: f64,
    pub bias: bool,
    /// `model.loss`: the fused head and cross-entropy, or the full logits.
    #[serde(default)]
    pub loss: LossKind,
}

impl Default for GptConfig {
    fn default() -> Self {
        GptConfig {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 128,
            vocab_size: 256,
            dropout: 0.0,
            bias: true,
            loss: LossKind::Fused,
        }
    }
}

impl GptConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (key, v) in [
            ("model.n_layer", self.n_layer),
            ("model.n_head", self.n_head),
            ("model.n_embd", self.n_embd),
            ("model.block_size", self.block_size),
            ("model.vocab_size", self.vocab_size),
        ] {
            if v < 1 {
                return Err(ConfigError::invalid(key, format!("is {v}; it must be at least 1")));
            }
        }
        // Far beyond any model that trains, and far from overflowing the planner's sums.
        for (key, v, most) in [
            ("model.n_layer", self.n_layer, 1 << 16),
            ("model.n_head", self.n_head, 1 << 16),
            ("model.n_embd", self.n_embd, 1 << 20),
            ("model.block_size", self.block_size, 1 << 24),
            ("model.vocab_size", self.vocab_size, 1 << 28),
        ] {
            if v > most {
                return Err(ConfigError::invalid(key, format!("is {v}; it must be at most {most}")));
            }
        }
        // Together, too: each within its bound, their products could still wrap the planner's
        // byte counts. Far past any machine (GPT-3's are near 2^31 and 2^38).
        let volume = self.n_layer as i128 * self.n_embd as i128 * self.block_size as i128;
        if volume > 1 << 40 {
            return Err(ConfigError::invalid(
                "model",
                format!(
                    "n_layer x n_embd x block_size is {volume}, past any machine (at most 2^40): a smaller model, or a shorter block_size"
                ),
            ));
        }
        if self.num_params() > 1 << 44 {
            return Err(ConfigError::invalid(
                "model",
                format!(
                    "has {} parameters, past any machine (at most 2^44): a smaller model",
                    self.num_params()
                ),
            ));
        }
        if self.n_embd % self.n_head != 0 {
            return Err(ConfigError::invalid(
                "model.n_embd",
                format!(
                    "{} is not divisible by model.n_head {}; pick n_embd a multiple of n_head",
                    self.n_embd, self.n_head
                ),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ConfigError::invalid(
                "model.dropout",
                format!("is {}; it must be in [0, 1)", self.dropout),
            ));
        }
        Ok(())
    }

    /// Number of parameters (the LM head is tied to the token embedding).
    pub fn num_params(&self) -> i64 {
        let (c, l, v, t) = (self.n_embd, self.n_layer, self.vocab_size, self.block_size);
        let b = if self.bias { 1 } else { 0 };
        let per_layer =
            2 * (c + b * c) + (3 * c * c + b * 3 * c) + (c * c + b * c) + (4 * c * c + b * 4 * c) + (4 * c * c + b * c);
        v * c + t * c + l * per_layer + (c + b * c)
    }
}

/// A trainable variable under `p`, initialised with fallible calls only (tch's `f_var`
/// scales its random init with an operator that panics when the allocation fails).
fn var(p: &nn::Path, name: &str, dims: &[i64], init: Init) -> Result<Tensor, TchError> {
    let opts = (Kind::Float, p.device());
    let t = match init {
        Init::Normal(std) => {
            let t = Tensor::f_randn(dims, opts)?;
            crate::ops::mul_scalar_(&t, std)?;
            t
        }
        Init::Zeros => Tensor::f_zeros(dims, opts)?,
        Init::Ones => Tensor::f_ones(dims, opts)?,
    };
    Ok(p.add(name, t, true))
}

/// The token embedding `[vocab, C]`, drawn exactly as an unpadded one (the same random
/// draws, so nothing else's initialisation moves), in a storage of `padded_vocab` rows whose
/// padding is zero: the fused head's matmuls see the padded shape without a copy
/// (csrc/loss.cpp); the parameter, its gradient, AdamW's state and every saved file keep the
/// configured vocabulary.
fn padded_var(p: &nn::Path, name: &str, vocab: i64, c: i64, std: f64) -> Result<Tensor, TchError> {
    let vp = padded_vocab(vocab);
    if vp == vocab {
        return var(p, name, &[vocab, c], Init::Normal(std));
    }
    let drawn = Tensor::f_randn([vocab, c], (Kind::Float, p.device()))?;
    crate::ops::mul_scalar_(&drawn, std)?;
    let storage = Tensor::f_zeros([vp, c], (Kind::Float, p.device()))?;
    let rows = storage.f_narrow(0, 0, vocab)?;
    rows.shallow_clone().f_copy_(&drawn)?;
    Ok(p.add(name, rows.f_detach()?, true))
}

#[derive(Clone, Copy)]
enum Init {
    Normal(f64),
    Zeros,
    Ones,
}

struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    fn new(p: nn::Path, n_in: i64, n_out: i64, bias: bool, std: f64) -> Result<Linear, TchError> {
        Ok(Linear {
            weight: var(&p, "weight", &[n_out, n_in], Init::Normal(std))?,
            bias: bias.then(|| var(&p, "bias", &[n_out], Init::Zeros)).transpose()?,
        })
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        x.f_linear(&self.weight, self.bias.as_ref())
    }
}

struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    n: i64,
}

impl LayerNorm {
    fn new(p: nn::Path, n: i64, bias: bool) -> Result<LayerNorm, TchError> {
        Ok(LayerNorm {
            weight: var(&p, "weight", &[n], Init::Ones)?,
            bias: bias.then(|| var(&p, "bias", &[n], Init::Zeros)).transpose()?,
            n,
        })
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        x.f_layer_norm([self.n], Some(&self.weight), self.bias.as_ref(), 1e-5, true)
    }
}

struct Block {
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
}

pub struct Gpt {
    cfg: GptConfig,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
}

impl Gpt {
    /// Creates the parameters under `p` with GPT-2's initialisation (residual projections
    /// scaled by 1/sqrt(2 n_layer)).
    pub fn new(p: &nn::Path, cfg: &GptConfig) -> Result<Gpt, TchError> {
        let c = cfg.n_embd;
        let std = 0.02;
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
        let init = Init::Normal(std);
        let blocks = (0..cfg.n_layer)
            .map(|i| {
                let b = p / "h" / i;
                Ok(Block {
                    ln_1: LayerNorm::new(&b / "ln_1", c, cfg.bias)?,
                    c_attn: Linear::new(&b / "attn" / "c_attn", c, 3 * c, cfg.bias, std)?,
                    attn_proj: Linear::new(&b / "attn" / "c_proj", c, c, cfg.bias, proj_std)?,
                    ln_2: LayerNorm::new(&b / "ln_2", c, cfg.bias)?,
                    c_fc: Linear::new(&b / "mlp" / "c_fc", c, 4 * c, cfg.bias, std)?,
                    mlp_proj: Linear::new(&b / "mlp" / "c_proj", 4 * c, c, cfg.bias, proj_std)?,
                })
            })
            .collect::<Result<_, TchError>>()?;
        Ok(Gpt {
            cfg: cfg.clone(),
            wte: padded_var(p, "wte", cfg.vocab_size, c, std)?,
            wpe: var(p, "wpe", &[cfg.block_size, c], init)?,
            blocks,
            ln_f: LayerNorm::new(p / "ln_f", c, cfg.bias)?,
        })
    }

    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Token and position embeddings (with dropout); the token lookup through `tie`, if any.
    fn embed(&self, idx: &Tensor, train: bool, tie: Option<&Tie>) -> Result<Tensor, TchError> {
        let pos = crate::ops::arange_like(idx.size2()?.1, idx)?;
        let tok = match tie {
            Some(tie) => tie.embedding(&self.wte, idx)?,
            None => Tensor::f_embedding(&self.wte, idx, -1, false, false)?,
        };
        tok.f_add(&Tensor::f_embedding(&self.wpe, &pos, -1, false, false)?)?
            .f_dropout(self.cfg.dropout, train)
    }

    /// One pre-LN block: attention, then the MLP, each added to the residual stream.
    fn block(&self, block: &Block, x: &Tensor, train: bool) -> Result<Tensor, TchError> {
        let (b, t, _) = x.size3()?;
        let x = x.f_add(&self.attention(block, &block.ln_1.forward(x)?, b, t, train)?)?;
        let h = block.c_fc.forward(&block.ln_2.forward(&x)?)?.f_gelu("tanh")?;
        x.f_add(&block.mlp_proj.forward(&h)?.f_dropout(self.cfg.dropout, train)?)
    }

    /// Logits `[B, T, vocab]` from the last block's output: the LM head tied to the embedding.
    fn head(&self, x: &Tensor) -> Result<Tensor, TchError> {
        self.ln_f.forward(x)?.f_linear(&self.wte, None::<Tensor>)
    }

    /// The last block's output `[B, T, C]` for token ids `[B, T]`.
    fn trunk(&self, idx: &Tensor, train: bool, tie: Option<&Tie>) -> Result<Tensor, TchError> {
        let mut x = {
            let _s = snapshot::scope("embed");
            self.embed(idx, train, tie)?
        };
        for (i, block) in self.blocks.iter().enumerate() {
            let _s = snapshot::scope(&format!("block.{i}"));
            x = self.block(block, &x, train)?;
        }
        Ok(x)
    }

    /// Logits `[B, T, vocab]` for token ids `[B, T]`.
    pub fn logits(&self, idx: &Tensor, train: bool) -> Result<Tensor, TchError> {
        let x = self.trunk(idx, train, None)?;
        let _s = snapshot::scope("logits");
        self.head(&x)
    }

    /// The mean loss from the last block's output, as `model.loss` says (the fused head
    /// tied to the lookup made through `tie`, if any).
    fn head_loss(&self, x: &Tensor, targets: &Tensor, tie: Option<&Tie>) -> Result<Tensor, TchError> {
        match self.cfg.loss {
            LossKind::Full => {
                let logits = {
                    let _s = snapshot::scope("logits");
                    self.head(x)?
                };
                let _s = snapshot::scope("loss");
                self.cross_entropy(&logits, targets)
            }
            LossKind::Fused => {
                let h = self.ln_f.forward(x)?;
                let _s = snapshot::scope("loss");
                let (h, y) = (h.f_view([-1, self.cfg.n_embd])?, targets.f_view([-1])?);
                fused_linear_cross_entropy_tied(&h, &self.wte, &y, tie)
            }
        }
    }

    /// `model.loss` from now on (the guard's ladder turns `fused` on).
    pub fn set_loss(&mut self, loss: LossKind) {
        self.cfg.loss = loss;
    }

    fn attention(&self, block: &Block, x: &Tensor, b: i64, t: i64, train: bool) -> Result<Tensor, TchError> {
        let (c, nh) = (self.cfg.n_embd, self.cfg.n_head);
        let heads = |t_: &Tensor| t_.f_view([b, t, nh, c / nh])?.f_transpose(1, 2);
        let qkv = block.c_attn.forward(x)?.f_split(c, 2)?;
        let (q, k, v) = (heads(&qkv[0])?, heads(&qkv[1])?, heads(&qkv[2])?);
        let p = if train { self.cfg.dropout } else { 0.0 };
        let y = Tensor::f_scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, p, true, None, false)?;
        let y = y.f_transpose(1, 2)?.f_contiguous()?.f_view([b, t, c])?;
        block.attn_proj.forward(&y)?.f_dropout(self.cfg.dropout, train)
    }

    /// Mean cross-entropy of next-token predictions, one graph that one backward pass walks
    /// whole: under the fused loss, the tied embedding's lookup adds its gradient into the
    /// head's in place (`Tie`).
    pub fn loss(&self, idx: &Tensor, targets: &Tensor, train: bool) -> Result<Tensor, TchError> {
        let tie = match self.cfg.loss {
            LossKind::Fused => Some(Tie::new()?),
            LossKind::Full => None,
        };
        self.head_loss(&self.trunk(idx, train, tie.as_ref())?, targets, tie.as_ref())
    }

    fn cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor, TchError> {
        logits.f_view([-1, self.cfg.vocab_size])?.f_cross_entropy_loss(
            &targets.f_view([-1])?,
            None::<Tensor>,
            Reduction::Mean,
            -100,
            0.0,
        )
    }

    /// Activation checkpointing: the forward keeps only each block's input (no graph), then
    /// the backward walks the blocks in reverse, recomputing each from its input with grad
    /// and back-propagating the surrogate `(output * upstream_grad).sum()`, which yields the
    /// block's parameter gradients and its input's gradient. Activation memory drops to about
    /// one block's worth plus the block inputs; the gradients are the plain path's. Dropout
    /// masks are replayed (the generators' states are kept per block). Returns the weighted
    /// loss (on the device), like `task::backward`.
    pub fn checkpointed_forward_backward(
        &self,
        idx: &Tensor,
        targets: &Tensor,
        weight: f64,
        amp: &Amp,
    ) -> crate::Result<Tensor> {
        let (inputs, last, rng) = self
            .checkpointed_forward(idx, amp)
            .map_err(|e| crate::Error::from(e).in_phase(crate::error::Phase::Forward))?;
        snapshot::set_phase(crate::error::Phase::Backward, None);
        self.recomputing_backward(idx, targets, weight, amp, inputs, last, rng)
            .map_err(|e| crate::Error::from(e).in_phase(crate::error::Phase::Backward))
    }

    /// The forward without a graph: each block's input (and the generators' state before it,
    /// when dropout draws), the last block's output, and the generators' states at the
    /// embedding and after the forward.
    #[allow(clippy::type_complexity)]
    fn checkpointed_forward(
        &self,
        idx: &Tensor,
        amp: &Amp,
    ) -> Result<(Vec<(Tensor, Option<Vec<Tensor>>)>, Tensor, [Option<Vec<Tensor>>; 2]), TchError> {
        let device = idx.device();
        let replay = self.cfg.dropout > 0.0;
        let rng_now = || {
            if replay {
                crate::rng::capture(device).map(Some)
            } else {
                Ok(None)
            }
        };
        let at_embed = rng_now()?;
        let mut inputs = Vec::with_capacity(self.blocks.len());
        let last = {
            let _no_grad = tch::no_grad_guard();
            let _autocast = amp.autocast()?;
            let mut x = self.embed(idx, true, None)?;
            for block in &self.blocks {
                inputs.push((x.shallow_clone(), rng_now()?));
                x = self.block(block, &x, true)?;
            }
            x
        };
        Ok((inputs, last, [at_embed, rng_now()?]))
    }

    #[allow(clippy::too_many_arguments)]
    fn recomputing_backward(
        &self,
        idx: &Tensor,
        targets: &Tensor,
        weight: f64,
        amp: &Amp,
        inputs: Vec<(Tensor, Option<Vec<Tensor>>)>,
        last: Tensor,
        rng: [Option<Vec<Tensor>>; 2],
    ) -> Result<Tensor, TchError> {
        let device = idx.device();
        let [at_embed, after_forward] = rng;
        let last = last.f_detach()?.set_requires_grad(true);
        let loss = {
            let _autocast = amp.autocast()?;
            self.head_loss(&last, targets, None)?
        };
        let weighted = crate::ops::mul_scalar(&loss, weight)?;
        amp.scale(&weighted)?.f_backward()?;
        let mut grad = last.grad();
        for ((input, state), block) in inputs.iter().zip(&self.blocks).rev() {
            if let Some(s) = state {
                crate::rng::restore(s, device)?;
            }
            let x = input.f_detach()?.set_requires_grad(true);
            let out = {
                let _autocast = amp.autocast()?;
                self.block(block, &x, true)?
            };
            out.f_mul(&grad)?.f_sum(out.kind())?.f_backward()?;
            grad = x.grad();
        }
        if let Some(s) = &at_embed {
            crate::rng::restore(s, device)?;
        }
        let x0 = {
            let _autocast = amp.autocast()?;
            self.embed(idx, true, None)?
        };
        x0.f_mul(&grad)?.f_sum(x0.kind())?.f_backward()?;
        if let Some(s) = &after_forward {
            crate::rng::restore(s, device)?; // where the plain path leaves the generators
        }
        weighted.f_detach()
    }
}

/// True for parameters that get no weight decay: biases, norms and embeddings.
pub fn no_weight_decay(name: &str) -> bool {
    name.ends_with(".bias") || name.contains("ln_") || name == "wte" || name == "wpe"
}
