//! A GPT (decoder-only transformer, as in nanoGPT): token and position embeddings, pre-LN
//! blocks with causal scaled-dot-product attention and a GELU MLP, a final LayerNorm and an
//! LM head tied to the token embedding. Every op is fallible (`f_*`): an OOM inside the
//! forward is an `Err`, never a panic.
use tch::{nn, Kind, Reduction, TchError, Tensor};

use super::GptConfig;

struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    fn new(p: nn::Path, n_in: i64, n_out: i64, bias: bool, std: f64) -> Result<Linear, TchError> {
        Ok(Linear {
            weight: p.f_var("weight", &[n_out, n_in], nn::Init::Randn { mean: 0.0, stdev: std })?,
            bias: bias.then(|| p.f_var("bias", &[n_out], nn::Init::Const(0.0))).transpose()?,
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
            weight: p.f_var("weight", &[n], nn::Init::Const(1.0))?,
            bias: bias.then(|| p.f_var("bias", &[n], nn::Init::Const(0.0))).transpose()?,
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
        let init = nn::Init::Randn { mean: 0.0, stdev: std };
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
            wte: p.f_var("wte", &[cfg.vocab_size, c], init)?,
            wpe: p.f_var("wpe", &[cfg.block_size, c], init)?,
            blocks,
            ln_f: LayerNorm::new(p / "ln_f", c, cfg.bias)?,
        })
    }

    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Logits `[B, T, vocab]` for token ids `[B, T]`.
    pub fn logits(&self, idx: &Tensor, train: bool) -> Result<Tensor, TchError> {
        let (b, t) = idx.size2()?;
        let pos = Tensor::f_arange(t, (Kind::Int64, idx.device()))?;
        let tok = Tensor::f_embedding(&self.wte, idx, -1, false, false)?;
        let mut x = tok.f_add(&Tensor::f_embedding(&self.wpe, &pos, -1, false, false)?)?;
        x = x.f_dropout(self.cfg.dropout, train)?;
        for block in &self.blocks {
            x = x.f_add(&self.attention(block, &block.ln_1.forward(&x)?, b, t, train)?)?;
            let h = block.c_fc.forward(&block.ln_2.forward(&x)?)?.f_gelu("tanh")?;
            x = x.f_add(&block.mlp_proj.forward(&h)?.f_dropout(self.cfg.dropout, train)?)?;
        }
        self.ln_f.forward(&x)?.f_linear(&self.wte, None::<Tensor>)
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

    /// Mean cross-entropy of next-token predictions.
    pub fn loss(&self, idx: &Tensor, targets: &Tensor, train: bool) -> Result<Tensor, TchError> {
        let logits = self.logits(idx, train)?;
        logits
            .f_view([-1, self.cfg.vocab_size])?
            .f_cross_entropy_loss(&targets.f_view([-1])?, None::<Tensor>, Reduction::Mean, -100, 0.0)
    }
}

/// True for parameters that get no weight decay: biases, norms and embeddings.
pub fn no_weight_decay(name: &str) -> bool {
    name.ends_with(".bias") || name.contains("ln_") || name == "wte" || name == "wpe"
}
