//! Owns the memory planner: a GPT step's needs by component, and the largest micro-batch that fits.
//! Keeps: tests/plan.rs holds the estimate within 20% of measurement on several shapes.
mod profile;
mod search;

pub use profile::{measure, Profile};

pub use search::{auto_micro_batch, cached, remember, search, AutoResult, AutoSearch};

use serde::Serialize;

use crate::memory::human_bytes;
use crate::model::loss::{chunk_floor, padded_vocab};
use crate::model::{GptConfig, LossKind};

pub use crate::precision::Precision;

const ACT_PER_LAYER: f64 = 16.0; // values per token per n_embd per layer
                                 // Of those, kept in fp32 under autocast: the residual stream each LayerNorm saves (an H200's
                                 // bf16 GPT-2 124M peaked 10% over a plan that had all 16 in bf16; docs/gpu-outcome.md).
const F32_PER_LAYER: f64 = 2.0;
const LOGITS: f64 = 3.0; // values per token per vocab entry
const EMBED: f64 = 2.3; // values per token per n_embd

/// Memory by component, in bytes; `*_per_sample` terms scale with the micro-batch.
#[derive(Debug, Clone, Serialize)]
pub struct Estimate {
    pub num_params: u64,
    pub params_bytes: u64,
    pub grads_bytes: u64,
    pub optimizer_bytes: u64,
    pub activations_per_layer_per_sample: u64,
    pub n_layer: u64,
    /// bf16/fp16: the half-precision copies of the blocks' weight matrices that autocast
    /// makes in forward and backward keeps (0 in fp32).
    pub cast_weights_bytes: u64,
    /// Fused attention (flash / memory-efficient, as oomguard uses) keeps no B*H*T*T
    /// scores; this is what materialised scores would take, per sample and layer.
    pub attention_scores_if_materialized_per_sample: u64,
    /// What attention keeps of the scores, per sample and layer (in the activations'
    /// term): none when fused; with `model.dropout` on the CPU, whose fused kernel takes no
    /// dropout, the math path keeps three (softmax's output, the dropout mask, the dropped
    /// weights: measured 2.9-3.1 on four shapes).
    pub attention_scores_kept_per_sample: u64,
    /// `model.loss`, and its logits term: per sample, and what does not scale with the
    /// micro-batch (the fused head's weight gradient and smallest chunk).
    pub loss: LossKind,
    pub logits_per_sample: u64,
    pub logits_fixed_bytes: u64,
    /// The other setting's logits term (per sample, fixed), for `oomguard plan` to show both.
    pub other_loss: LossKind,
    pub other_logits_per_sample: u64,
    pub other_logits_fixed_bytes: u64,
    pub embeddings_per_sample: u64,
    /// Share added for the caching allocator's rounding and fragmentation (CUDA).
    pub allocator_overhead: f64,
    /// cuBLAS workspaces (CUDA): one per thread that runs matmuls, the forward's and
    /// autograd's; they come from the caching allocator and stay.
    pub workspace_bytes: u64,
    /// Activation checkpointing: each layer keeps only its input (this many bytes per sample),
    /// and one block is recomputed at a time in backward.
    pub activation_checkpointing: bool,
    pub layer_input_per_sample: u64,
    /// The largest parameter's gradient (the tied embedding's, or an MLP matrix).
    pub largest_grad_bytes: u64,
    /// ZeRO-2's world (1: the gradients are whole on every rank).
    pub grads_shard_world: u64,
    /// The tied embedding's gradient (fp32): backward makes it twice, the head's and the
    /// lookup's (`tied_partial_bytes`).
    pub tied_grad_bytes: u64,
    /// A CUDA device (its lookup's gradient is dense: `tied_partial_bytes`).
    pub cuda: bool,
    /// Data parallel: one bucket of the reduction, made while the gradients are whole.
    pub bucket_bytes: u64,
    /// Data parallel: a bucket's most bytes (`train.bucket_cap_mb`, or its default for the
    /// budget: `TrainConfig::bucket_bytes`).
    pub bucket_cap: u64,
    /// Stage 1's all-gather buffers, where its spent gradients' storages are too small to
    /// gather through (`optim::zero::stage_1_buffers`): made after backward, beside them.
    pub gather_buffers_bytes: u64,
    /// The ranks' collectives complete as they start (one CPU host, through shared
    /// memory): no bucket waits in flight.
    pub shared_memory: bool,
    /// The fused loss's chunk: its rows at the floor size, the tokens of one sample (a
    /// chunk never exceeds the micro-batch's tokens), and bytes per row.
    pub chunk_rows: u64,
    pub tokens_per_sample: u64,
    pub chunk_row_bytes: u64,
    pub other_chunk_row_bytes: u64,
}

/// The share the planner adds for a CUDA caching allocator's rounding and fragmentation.
pub const CUDA_OVERHEAD: f64 = 0.1;

/// Two cuBLAS workspaces of 32 MiB (PyTorch's default on Hopper and later; 8 MiB before):
/// measured on an H100, where a tiny model's backward failed asking for the second one.
pub const CUDA_WORKSPACES: u64 = 2 * (32 << 20);

impl Estimate {
    /// With activation checkpointing: each layer keeps its input, and one block's activations
    /// are alive at a time while it is recomputed.
    pub fn with_checkpointing(self, on: bool) -> Estimate {
        Estimate {
            activation_checkpointing: on,
            ..self
        }
    }

    /// With buckets of at most `bytes` (before `with_shard`, which sizes the bucket by it).
    pub fn with_bucket_cap(self, bytes: u64) -> Estimate {
        Estimate {
            bucket_cap: bytes.max(1),
            ..self
        }
    }

    /// Per rank, with `shard` across `world` data-parallel ranks: AdamW's moments split
    /// (ZeRO-1 and 2), and stage 2's gradients (`grads_at_peak`).
    pub fn with_shard(self, shard: crate::optim::Shard, world: u64) -> Estimate {
        if world <= 1 {
            return self;
        }
        // The small gradients' bucket: a gradient of a bucket's size or more is reduced in place.
        let large = if self.tied_grad_bytes >= self.bucket_cap {
            self.tied_grad_bytes
        } else {
            0
        };
        let bucket_bytes = self.bucket_cap.min(self.grads_bytes - large);
        if shard == crate::optim::Shard::None {
            return Estimate { bucket_bytes, ..self };
        }
        let gather_buffers_bytes = match shard {
            crate::optim::Shard::Optimizer => {
                let space = self.bucket_cap.max(self.largest_grad_bytes) as i64 / 4;
                4 * crate::optim::zero::stage_1_buffers(self.num_params as i64, world as usize, space) as u64
            }
            _ => 0,
        };
        Estimate {
            bucket_bytes,
            gather_buffers_bytes,
            optimizer_bytes: self.optimizer_bytes.div_ceil(world),
            grads_shard_world: if shard == crate::optim::Shard::Gradients {
                world
            } else {
                1
            },
            ..self
        }
    }

    /// The gradients held at backward's end: whole, unless ZeRO-2 reduces them overlapped
    /// with backward (not with activation checkpointing, whose backward runs in passes; only
    /// where backward can wait for its buckets, as `dist::overlap::shards_gradients`
    /// decides): then this rank's shard, made bucket by bucket as the sums arrive, and the
    /// whole gradients in flight (`grads_in_flight`).
    pub fn grads_held(&self) -> u64 {
        if !self.grads_beside_activations() {
            return self.grads_bytes;
        }
        self.grads_shard() + self.grads_in_flight()
    }

    /// The gradients held at backward's end, at least: whole, or ZeRO-2's shard alone.
    pub fn grads_at_least(&self) -> u64 {
        if self.grads_beside_activations() {
            self.grads_shard()
        } else {
            self.grads_bytes
        }
    }

    /// ZeRO-2's shard of the gradients on this rank.
    fn grads_shard(&self) -> u64 {
        self.grads_bytes.div_ceil(self.grads_shard_world)
    }

    /// ZeRO-2 overlapped: the whole gradients held at once, at most: the largest (a tied
    /// embedding's is whole until the embedding's own backward), one bucket being made and
    /// (unless through shared memory) two of the largest in flight.
    fn grads_in_flight(&self) -> u64 {
        let waiting = if self.shared_memory {
            0
        } else {
            2 * self.largest_bucket()
        };
        let most = self.largest_grad_bytes + waiting + self.bucket_cap;
        most.min(self.grads_bytes)
    }

    /// With the ranks on one CPU host reducing through shared memory (`shared_memory`).
    pub fn through_shared_memory(self, on: bool) -> Estimate {
        Estimate {
            shared_memory: on && !self.cuda,
            ..self
        }
    }

    /// Whether backward drops the gradients as it goes (ZeRO-2 overlapped, where its
    /// gradients exceed two of the largest buckets): the shard then grows as the activations
    /// go, beside them, and the whole gradients stay few.
    fn grads_beside_activations(&self) -> bool {
        self.grads_shard_world > 1 && !self.activation_checkpointing && self.grads_bytes > 2 * self.largest_bucket()
    }

    /// The largest bucket of the reduction: a bucket's cap, or a larger gradient alone.
    fn largest_bucket(&self) -> u64 {
        self.largest_grad_bytes.max(self.bucket_cap)
    }

    /// What backward holds beside the tied embedding's gradient while it forms it. The full
    /// loss in one pass: the head's and the lookup's partial gradients, summed into a third.
    /// A checkpointed backward (in passes): the lookup's, added into the head's, already the
    /// parameter's. The fused loss in one pass: the lookup adds its rows into the head's in
    /// place (csrc/loss.cpp), nothing beside; on CUDA through a dense gradient of its own.
    pub fn tied_partial_bytes(&self) -> u64 {
        match (self.loss, self.activation_checkpointing, self.cuda) {
            (_, true, _) | (LossKind::Fused, false, true) => self.tied_grad_bytes,
            (LossKind::Fused, false, false) => 0,
            (LossKind::Full, false, _) => 2 * self.tied_grad_bytes,
        }
    }

    /// The gradients at their peak: those held, with the largest of what comes and goes
    /// around them: the tied embedding's partial gradients while backward forms it,
    /// (data parallel, whole) one bucket being made after backward, or stage 1's all-gather
    /// buffers.
    pub fn grads_at_peak(&self) -> u64 {
        let bucket = if self.grads_beside_activations() {
            0
        } else {
            self.bucket_bytes
        };
        self.grads_held() + bucket.max(self.tied_partial_bytes()).max(self.gather_buffers_bytes)
    }

    /// The logits term at `micro` samples, both parts.
    pub fn logits_at(&self, micro: usize) -> u64 {
        self.logits_per_sample.saturating_mul(micro as u64) + self.logits_fixed(micro)
    }

    /// The logits term that does not scale with the micro-batch, at `micro` samples: the
    /// fused loss's chunk is at most the micro-batch's tokens.
    pub fn logits_fixed(&self, micro: usize) -> u64 {
        let rows = self
            .chunk_rows
            .min((micro as u64).saturating_mul(self.tokens_per_sample));
        self.logits_fixed_bytes - (self.chunk_rows - rows) * self.chunk_row_bytes
    }

    /// The fewest data-parallel ranks (up to 4096) over which the optimizer-sharded state
    /// lets micro-batch 1 fit `memory`, each rank taking its share of a step of `global`
    /// samples (more than one: it accumulates, beside the summed gradients); `None` when no
    /// number does (the parameters, gradients and one sample alone exceed it).
    pub fn ranks_to_fit(&self, memory: u64, global: usize) -> Option<u64> {
        let fits = |w: u64| {
            let share = global.max(1).div_ceil(w as usize);
            self.clone()
                .with_shard(crate::optim::Shard::Optimizer, w)
                .largest_fitting(memory, share)
                >= 1
        };
        if !fits(4096) {
            return None;
        }
        let (mut lo, mut hi) = (1u64, 4096u64); // fits(hi); find the smallest
        while lo < hi {
            let mid = (lo + hi) / 2;
            if fits(mid) {
                hi = mid
            } else {
                lo = mid + 1
            }
        }
        Some(lo)
    }

    /// With the other `model.loss` (the ladder's rung, `oomguard plan`'s second row).
    pub fn with_loss(self, loss: LossKind) -> Estimate {
        if loss == self.loss {
            return self;
        }
        Estimate {
            loss,
            logits_per_sample: self.other_logits_per_sample,
            logits_fixed_bytes: self.other_logits_fixed_bytes,
            other_loss: self.loss,
            other_logits_per_sample: self.logits_per_sample,
            other_logits_fixed_bytes: self.logits_fixed_bytes,
            chunk_row_bytes: self.other_chunk_row_bytes,
            other_chunk_row_bytes: self.chunk_row_bytes,
            ..self
        }
    }

    pub fn new(m: &GptConfig, precision: Precision, cuda: bool) -> Estimate {
        let p = m.num_params() as u64;
        let (t, c, h) = (m.block_size as f64, m.n_embd as f64, m.n_head as f64);
        let a = precision.activation_bytes();
        let terms = |loss| logits_bytes(m, loss, precision, cuda);
        let other = match m.loss {
            LossKind::Fused => LossKind::Full,
            LossKind::Full => LossKind::Fused,
        };
        // Dropout in training: the math path's scores on the CPU (above), and each of a
        // block's two residual dropouts and the embeddings' keeps its mask (the CPU's in the
        // activations' type, measured: 8 bytes a token per n_embd per layer in fp32; CUDA's
        // as bytes).
        let dropout = m.dropout > 0.0;
        let scores_kept = if dropout && !cuda { 3.0 * h * t * t * a } else { 0.0 };
        let mask = match (dropout, cuda) {
            (false, _) => 0.0,
            (true, false) => a,
            (true, true) => 1.0,
        };
        Estimate {
            num_params: p,
            params_bytes: 4 * p,
            grads_bytes: 4 * p,
            optimizer_bytes: 8 * p,
            activations_per_layer_per_sample: (((ACT_PER_LAYER - F32_PER_LAYER) * a + F32_PER_LAYER * 4.0 + 2.0 * mask)
                * t
                * c
                + scores_kept) as u64,
            attention_scores_kept_per_sample: scores_kept as u64,
            n_layer: m.n_layer as u64,
            cast_weights_bytes: if precision == Precision::Fp32 {
                0
            } else {
                (12.0 * c * c * m.n_layer as f64 * a) as u64
            },
            attention_scores_if_materialized_per_sample: (h * t * t * a) as u64,
            loss: m.loss,
            logits_per_sample: terms(m.loss).0,
            logits_fixed_bytes: terms(m.loss).1,
            other_loss: other,
            other_logits_per_sample: terms(other).0,
            other_logits_fixed_bytes: terms(other).1,
            embeddings_per_sample: ((EMBED * a + mask) * t * c) as u64,
            allocator_overhead: if cuda { CUDA_OVERHEAD } else { 0.0 },
            workspace_bytes: if cuda { CUDA_WORKSPACES } else { 0 },
            activation_checkpointing: false,
            layer_input_per_sample: (t * c * 4.0) as u64,
            // The tied embedding, the position embedding (long contexts) or an MLP matrix.
            largest_grad_bytes: 4 * (m.vocab_size.max(m.block_size) * m.n_embd).max(4 * m.n_embd * m.n_embd) as u64,
            grads_shard_world: 1,
            tied_grad_bytes: 4 * (m.vocab_size * m.n_embd) as u64,
            cuda,
            bucket_bytes: 0,
            bucket_cap: crate::dist::DEFAULT_BUCKET_BYTES,
            gather_buffers_bytes: 0,
            shared_memory: false,
            chunk_rows: chunk_floor(cuda) as u64,
            tokens_per_sample: m.block_size as u64,
            chunk_row_bytes: chunk_row_bytes(m, m.loss, precision),
            other_chunk_row_bytes: chunk_row_bytes(m, other, precision),
        }
    }

    /// Weights, optimizer state and cuBLAS workspaces: alive all the time.
    pub fn fixed_bytes(&self) -> u64 {
        self.params_bytes + self.optimizer_bytes + self.workspace_bytes
    }

    pub fn per_sample_bytes(&self) -> u64 {
        // Saturating: the dropout's unfused scores (H x T x T) can pass u64 for a model no
        // machine holds; such a plan says it does not fit rather than wrap.
        let layers = if self.activation_checkpointing {
            // Each layer's input (the fp32 residual stream), plus one block recomputed.
            (self.n_layer.saturating_mul(self.layer_input_per_sample))
                .saturating_add(self.activations_per_layer_per_sample)
        } else {
            self.activations_per_layer_per_sample.saturating_mul(self.n_layer)
        };
        layers
            .saturating_add(self.logits_per_sample)
            .saturating_add(self.embeddings_per_sample)
    }

    /// Peak bytes of one step at `micro` samples per micro-batch, over the fixed part: the
    /// larger of the forward's saved activations (with the fused loss's fixed part) and the
    /// gradients at their peak. ZeRO-2 overlapped: backward frees the activations as its
    /// shard grows, so the larger of the two, with the whole gradients in flight beside.
    pub fn peak(&self, micro: usize) -> u64 {
        self.peak_of(micro, micro)
    }

    /// `peak` at `micro` samples of `global` a step (a rank's): where it takes several
    /// micro-batches, the later ones' forwards run beside the gradients summed so far.
    pub fn peak_of(&self, micro: usize, global: usize) -> u64 {
        let summed = if micro < global { self.grads_bytes } else { 0 };
        let forward = self
            .per_sample_bytes()
            .saturating_mul(micro as u64)
            .saturating_add(self.logits_fixed(micro) + self.cast_weights_bytes + summed);
        let forward = if self.grads_beside_activations() {
            forward.max(self.grads_shard()) + self.grads_in_flight()
        } else {
            forward
        };
        let step = forward.max(self.grads_at_peak());
        (self.fixed_bytes().saturating_add(step) as f64 * (1.0 + self.allocator_overhead)) as u64
    }

    /// The largest micro-batch (at most `max`, the step's samples) whose peak fits `memory`;
    /// 0 if none (`peak_of` grows with the micro-batch, but for the gradients summed across
    /// micro-batches, which `max` itself does without: a bisection below it).
    pub fn largest_fitting(&self, memory: u64, max: usize) -> usize {
        // Every sample adds its bytes: no more than the memory holds of them.
        let most = memory / self.per_sample_bytes().max(1);
        let (mut lo, mut hi) = (0usize, max.min(usize::try_from(most).unwrap_or(usize::MAX)));
        // The whole step in one micro-batch sums nothing: checked first, as the curve
        // drops there.
        if hi == max && max > 0 && self.peak_of(max, max) <= memory {
            return max;
        }
        hi = hi.min(max.saturating_sub(1));
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.peak_of(mid, max) <= memory {
                lo = mid
            } else {
                hi = mid - 1
            }
        }
        lo
    }

    /// The table `oomguard plan` prints.
    pub fn table(&self, micro: usize, global: usize) -> Vec<(String, String)> {
        let b = micro as u64;
        let row = |k: &str, v: u64| (k.to_string(), human_bytes(v));
        let mut rows = vec![
            (
                "parameters".into(),
                format!(
                    "{} ({:.1}M)",
                    human_bytes(self.params_bytes),
                    self.num_params as f64 / 1e6
                ),
            ),
            row("gradients", self.grads_bytes),
            row("  the tied embedding's partial ones", self.tied_partial_bytes()),
            row("optimizer state (AdamW)", self.optimizer_bytes),
            (
                format!("activations per layer (x{})", self.n_layer),
                human_bytes(self.activations_per_layer_per_sample.saturating_mul(b)),
            ),
            (
                "attention scores".into(),
                match self.attention_scores_kept_per_sample {
                    0 => format!(
                        "0 (fused attention; {} per layer if materialised)",
                        human_bytes(self.attention_scores_if_materialized_per_sample.saturating_mul(b))
                    ),
                    kept => format!(
                        "{} per layer, in the activations (dropout on the CPU: not fused)",
                        human_bytes(kept.saturating_mul(b))
                    ),
                },
            ),
            (logits_label(self.loss), human_bytes(self.logits_at(micro))),
            (
                format!("  if model.loss: {}", self.other_loss.name()),
                human_bytes(self.clone().with_loss(self.other_loss).logits_at(micro)),
            ),
            row("embeddings and the rest", self.embeddings_per_sample * b),
            row("cuBLAS workspaces", self.workspace_bytes),
            (
                "allocator overhead".into(),
                format!("{:.0}%", self.allocator_overhead * 100.0),
            ),
            row("peak", self.peak_of(micro, global)),
        ];
        if self.cast_weights_bytes > 0 {
            let at = rows.iter().position(|(k, _)| k.starts_with("attention")).unwrap_or(0);
            rows.insert(at, row("weights cast for autocast", self.cast_weights_bytes));
        }
        rows
    }
}

/// The logits row's name in `oomguard plan`'s table.
fn logits_label(loss: LossKind) -> String {
    match loss {
        LossKind::Full => "logits (full: B x T x vocab x3)".into(),
        LossKind::Fused => "logits (fused: in chunks)".into(),
    }
}

/// The logits term of `loss`: (per sample, fixed) bytes.
/// - `full`: the logits, their log-softmax and gradient, B x T x vocab each, fp32 (cross-entropy
///   runs in fp32 under autocast too).
/// - `fused` (csrc/loss.cpp): the hidden states' gradient, B x T x C in fp32, formed in the
///   forward; a chunk of logits, about as large again (Liger's rule) in fp32, plus its bf16
///   copies under autocast; fixed, the head weight's fp32 gradient (padded vocab x C) and the
///   chunk at its floor size.
fn logits_bytes(m: &GptConfig, loss: LossKind, precision: Precision, cuda: bool) -> (u64, u64) {
    let (t, c, v) = (m.block_size as f64, m.n_embd as f64, m.vocab_size as f64);
    match loss {
        LossKind::Full => ((LOGITS * t * v * 4.0) as u64, 0),
        LossKind::Fused => {
            let vp = padded_vocab(m.vocab_size) as f64;
            let per_logit = if precision == Precision::Fp32 { 4.0 } else { 8.0 };
            let floor = chunk_floor(cuda) as f64;
            (
                (t * c * 4.0 + t * c * per_logit) as u64,
                (vp * c * 4.0 + floor * vp * per_logit) as u64,
            )
        }
    }
}

/// The fused loss's bytes per chunk row (its logits, fp32, and their bf16 copies under
/// autocast); 0 for the full loss.
fn chunk_row_bytes(m: &GptConfig, loss: LossKind, precision: Precision) -> u64 {
    match loss {
        LossKind::Full => 0,
        LossKind::Fused => {
            let per_logit = if precision == Precision::Fp32 { 4 } else { 8 };
            padded_vocab(m.vocab_size) as u64 * per_logit
        }
    }
}

/// Common cards' memory (`--device-memory T4`), else a size like `24GiB`.
pub use oomguard_host::memory::device_memory;

/// When nothing fits: the changes that would, each computed (shorter sequence, fewer
/// layers, a smaller vocabulary, lower precision).
/// `bucket_cap`: the run's gradient buckets (`TrainConfig::bucket_bytes`), for the ranks that
/// would fit. `global`: a step's samples (above 1, micro-batch 1 sums gradients across them).
/// `checkpointing`: the config already checkpoints activations (each change keeps it).
pub fn suggestions(
    m: &GptConfig,
    precision: Precision,
    cuda: bool,
    memory: u64,
    bucket_cap: u64,
    global: usize,
    checkpointing: bool,
) -> Vec<String> {
    let fits = |m: &GptConfig, p: Precision| {
        Estimate::new(m, p, cuda)
            .with_checkpointing(checkpointing)
            .largest_fitting(memory, global)
            >= 1
    };
    let mut out = Vec::new();
    let mut t = m.block_size;
    while t > 1
        && !fits(
            &GptConfig {
                block_size: t,
                ..m.clone()
            },
            precision,
        )
    {
        t /= 2;
    }
    if t < m.block_size
        && fits(
            &GptConfig {
                block_size: t,
                ..m.clone()
            },
            precision,
        )
    {
        out.push(format!(
            "a shorter sequence: model.block_size {t} (from {})",
            m.block_size
        ));
    }
    if let Some(l) = (1..m.n_layer).rev().find(|&l| {
        fits(
            &GptConfig {
                n_layer: l,
                ..m.clone()
            },
            precision,
        )
    }) {
        out.push(format!("fewer layers: model.n_layer {l} (from {})", m.n_layer));
    }
    let mut v = m.vocab_size;
    while v > 256
        && !fits(
            &GptConfig {
                vocab_size: v,
                ..m.clone()
            },
            precision,
        )
    {
        v /= 2;
    }
    if v < m.vocab_size
        && fits(
            &GptConfig {
                vocab_size: v,
                ..m.clone()
            },
            precision,
        )
    {
        out.push(format!(
            "a smaller vocabulary: model.vocab_size {v} (from {})",
            m.vocab_size
        ));
    }
    let fused = GptConfig {
        loss: LossKind::Fused,
        ..m.clone()
    };
    if m.loss == LossKind::Full && fits(&fused, precision) {
        out.push(
            "the fused loss: model.loss: fused (the guard switches to it by itself when micro-batch 1 does not fit)"
                .into(),
        );
    }
    let ckpt = |m: &GptConfig, p: Precision| {
        Estimate::new(m, p, cuda)
            .with_checkpointing(true)
            .largest_fitting(memory, global)
            >= 1
    };
    if !checkpointing && ckpt(m, precision) {
        out.push(
            "activation checkpointing: model.activation_checkpointing: blocks (the guard turns it on by itself unless \
            memory.allow_activation_checkpointing is false)"
                .into(),
        );
    }
    if precision == Precision::Fp32 && fits(m, Precision::Bf16) {
        out.push("lower precision: train.precision: bf16 (the guard falls back to it by itself unless memory.allow_precision_fallback is false)".into());
    } else if precision == Precision::Fp32 && ckpt(m, Precision::Bf16) {
        out.push("activation checkpointing and bf16 together (the guard climbs to both by itself)".into());
    }
    if let Some(w) = Estimate::new(m, precision, cuda)
        .with_checkpointing(checkpointing)
        .with_bucket_cap(bucket_cap)
        .ranks_to_fit(memory, global)
        .filter(|&w| w > 1)
    {
        out.push(format!("data parallel over {w} or more ranks with AdamW's state sharded across them: train.shard: optimizer (ZeRO-1; the guard \
            climbs to it by itself unless memory.allow_sharding is false)"));
    }
    if out.is_empty() {
        out.push(format!(
            "a device with more than {} of memory, or a smaller model",
            human_bytes(memory)
        ));
    }
    out
}

/// Whether a rung the guard climbs to by itself below micro-batch 1 lets micro-batch 1 fit
/// `memory` (of a step of `global` samples): the fused loss, activation checkpointing
/// (`checkpointing`: allowed) or bf16 (`bf16`: allowed), alone or together. A sweep leaves
/// such a trial to the run, which climbs.
pub fn a_rung_fits(
    m: &GptConfig,
    precision: Precision,
    cuda: bool,
    memory: u64,
    global: usize,
    checkpointing: bool,
    bf16: bool,
) -> bool {
    let fused = GptConfig {
        loss: LossKind::Fused,
        ..m.clone()
    };
    let fits = |ckpt: bool, p: Precision| {
        Estimate::new(&fused, p, cuda)
            .with_checkpointing(ckpt)
            .largest_fitting(memory, global)
            >= 1
    };
    let lower = bf16 && precision == Precision::Fp32;
    fits(false, precision)
        || (checkpointing && fits(true, precision))
        || (lower && fits(checkpointing, Precision::Bf16))
}

/// For an infeasible GPT: what its state needs against `memory`, and what would fit (with
/// gradient buckets of `bucket_cap`).
pub fn advice(m: &GptConfig, memory: u64, cuda: bool, bucket_cap: u64, global: usize) -> String {
    let e = Estimate::new(m, Precision::Fp32, cuda);
    format!(
        "The planner: the parameters need {}, their gradients {} and AdamW's state {} ({:.2}M parameters); a step at micro-batch 1 peaks near {} \
            against {}. What would fit: {}.",
        human_bytes(e.params_bytes), human_bytes(e.grads_bytes), human_bytes(e.optimizer_bytes), e.num_params as f64 / 1e6,
        human_bytes(e.peak_of(1, global)), human_bytes(memory), suggestions(m, Precision::Fp32, cuda, memory, bucket_cap, global, false).join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_parallel_terms_follow_what_the_step_holds() {
        use crate::optim::Shard;
        // A state-heavy GPT: a tied vocabulary of 20,736 (5.3 MB), two blocks, 8 tokens.
        let m = GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 64,
            block_size: 8,
            vocab_size: 20736,
            loss: LossKind::Fused,
            ..gpt2()
        };
        let e = Estimate::new(&m, Precision::Fp32, false);
        // One sample's 8 tokens are the fused loss's whole chunk, not its 256-row floor.
        assert_eq!(e.logits_fixed(64) - e.logits_fixed(1), (256 - 8) * e.chunk_row_bytes);
        // The fused loss's lookup adds into the head's gradient: a bucket of the small ones
        // is all that comes and goes; under the full loss (two), checkpointed or on CUDA
        // (one) the tied embedding's partial gradients outweigh it.
        let dp = e.clone().with_shard(Shard::None, 2);
        assert_eq!(dp.grads_at_peak(), dp.grads_bytes + dp.bucket_bytes);
        let full = e.clone().with_loss(LossKind::Full).with_shard(Shard::None, 2);
        assert_eq!(full.grads_at_peak(), full.grads_bytes + 2 * full.tied_grad_bytes);
        let ac = e.clone().with_checkpointing(true).with_shard(Shard::None, 2);
        assert_eq!(ac.grads_at_peak(), ac.grads_bytes + ac.tied_grad_bytes);
        let cuda = Estimate::new(&m, Precision::Fp32, true).with_shard(Shard::None, 2);
        assert_eq!(cuda.grads_at_peak(), cuda.grads_bytes + cuda.tied_grad_bytes);
        assert!(
            dp.bucket_bytes < 1 << 20,
            "the embedding goes in place: {}",
            dp.bucket_bytes
        );
        // Small, its tied embedding the largest bucket: backward never waits, and ZeRO-2
        // holds no more than the whole gradients.
        let small = e.clone().with_shard(Shard::Gradients, 2);
        assert_eq!(small.grads_held(), small.grads_bytes);
        // Deep but small: its shard and the buckets in flight hold more than its gradients.
        let d24 = GptConfig {
            n_layer: 24,
            vocab_size: 256,
            ..m
        };
        let d24 = Estimate::new(&d24, Precision::Fp32, false).with_shard(Shard::Gradients, 2);
        assert!(d24.grads_held() > d24.grads_bytes);
        // Deep and narrow: ZeRO-2's shard grows as the activations go, the buckets in flight
        // beside both.
        let deep = Estimate::new(
            &GptConfig {
                n_layer: 55,
                vocab_size: 256,
                ..m
            },
            Precision::Fp32,
            false,
        );
        let z2 = deep.clone().with_shard(Shard::Gradients, 2);
        assert!(z2.grads_held() < z2.grads_bytes);
        let forward = z2.per_sample_bytes() + z2.logits_fixed(1);
        assert_eq!(
            z2.peak(1),
            z2.fixed_bytes() + forward.max(z2.grads_shard()) + z2.grads_in_flight()
        );
        let z1 = deep.clone().with_shard(Shard::Optimizer, 2);
        assert_eq!(z1.grads_at_peak(), z1.grads_bytes + (1 << 20));
        assert!(z2.peak(1) < z1.peak(1));
        // Smaller buckets (a small budget's): less in flight for ZeRO-2, but stage 1's
        // all-gather no longer goes through them, and its buffers come after backward.
        let small = deep.clone().with_bucket_cap(256 << 10);
        let z2s = small.clone().with_shard(Shard::Gradients, 2);
        assert_eq!(z2.grads_in_flight() - z2s.grads_in_flight(), 3 * (768 << 10));
        let z1s = small.with_shard(Shard::Optimizer, 2);
        assert_eq!(z1.gather_buffers_bytes, 0);
        let chunk = deep.num_params.div_ceil(2).div_ceil(16);
        assert_eq!(z1s.gather_buffers_bytes, 4 * 3 * chunk);
        assert_eq!(z1s.grads_at_peak(), z1s.grads_bytes + z1s.gather_buffers_bytes);
    }

    fn gpt2() -> GptConfig {
        GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab_size: 50304,
            dropout: 0.0,
            bias: true,
            loss: LossKind::Full,
        }
    }

    #[test]
    fn logits_are_b_t_v_bytes_three_times() {
        let e = Estimate::new(&gpt2(), Precision::Fp32, true);
        assert_eq!(e.logits_per_sample, 3 * 1024 * 50304 * 4);
        assert!((e.num_params as f64 - 124.4e6).abs() < 1.5e6, "{}", e.num_params);
    }

    #[test]
    fn largest_fitting_is_monotonic_and_consistent_with_peak() {
        let e = Estimate::new(&gpt2(), Precision::Fp32, true);
        let m = device_memory("A100-40GB").unwrap();
        let b = e.largest_fitting(m, 512);
        assert!(b >= 1);
        assert!(e.peak_of(b, 512) <= m && e.peak_of(b + 1, 512) > m);
        // The whole step at once sums no gradients: it may fit where one sample less does not.
        let whole = e.peak(b + 1);
        assert_eq!(e.largest_fitting(whole, b + 1), b + 1);
        assert!(e.largest_fitting(whole, b + 2) < b + 1);
        assert!(e.largest_fitting(device_memory("H100").unwrap(), 512) > b);
        assert_eq!(e.largest_fitting(1 << 30, 512), 0);
    }

    #[test]
    fn sharding_splits_the_optimizer_state_and_names_the_ranks_that_fit() {
        use crate::optim::Shard;
        let e = Estimate::new(&gpt2(), Precision::Fp32, true);
        assert_eq!(
            e.clone().with_shard(Shard::Optimizer, 4).optimizer_bytes,
            e.optimizer_bytes / 4
        );
        assert_eq!(e.clone().with_shard(Shard::None, 4).optimizer_bytes, e.optimizer_bytes);
        assert_eq!(
            e.clone().with_shard(Shard::Gradients, 1).optimizer_bytes,
            e.optimizer_bytes
        );
        // Between the sharded and the whole state's peaks: some number of ranks fits.
        let m = (e.clone().with_shard(Shard::Optimizer, 8).peak(1) + e.peak(1)) / 2;
        let w = e.ranks_to_fit(m, 1).unwrap();
        assert!(w > 1 && w <= 8, "{w}");
        assert!(e.clone().with_shard(Shard::Optimizer, w).largest_fitting(m, 1) == 1);
        assert!(e.clone().with_shard(Shard::Optimizer, w - 1).largest_fitting(m, 1) == 0);
        // The parameters and gradients alone do not fit: no number of ranks helps.
        assert_eq!(e.ranks_to_fit(e.params_bytes, 1), None);
        // A step of 64 samples: a rank with more than one sample of it accumulates beside
        // the summed gradients, so the answer is the ranks at which each rank's share fits.
        let w = e.ranks_to_fit(m, 64).unwrap();
        let share = |w: u64| 64usize.div_ceil(w as usize);
        assert!(e.clone().with_shard(Shard::Optimizer, w).largest_fitting(m, share(w)) >= 1);
        assert!(
            e.clone()
                .with_shard(Shard::Optimizer, w - 1)
                .largest_fitting(m, share(w - 1))
                == 0
        );
    }

    /// Dropout on the CPU at a context no machine holds: the unfused scores pass u64, and
    /// the plan says nothing fits rather than wrap (or panic, in a debug build).
    #[test]
    fn a_plan_past_u64_saturates() {
        let huge = GptConfig {
            n_layer: 1,
            n_head: 16384,
            n_embd: 65536,
            block_size: 1 << 24,
            dropout: 0.1,
            ..gpt2()
        };
        let e = Estimate::new(&huge, Precision::Fp32, false);
        assert_eq!(e.per_sample_bytes(), u64::MAX);
        assert_eq!(e.largest_fitting(1 << 50, 8), 0);
        let table = e.table(2, 8);
        let row = |k: &str| table.iter().find(|(key, _)| key.starts_with(k)).map(|(_, v)| v.clone());
        assert_eq!(row("activations per layer"), Some(human_bytes(u64::MAX)));
        assert_eq!(
            row("attention scores").map(|v| v.starts_with(&human_bytes(u64::MAX))),
            Some(true)
        );
    }

    #[test]
    fn suggestions_when_nothing_fits() {
        // Weights, gradients and AdamW state alone exceed 2 GiB: only a smaller model helps.
        let s = suggestions(
            &gpt2(),
            Precision::Fp32,
            true,
            2 << 30,
            crate::dist::DEFAULT_BUCKET_BYTES,
            1,
            false,
        );
        assert_eq!(
            Estimate::new(&gpt2(), Precision::Fp32, true).largest_fitting(2 << 30, 512),
            0
        );
        assert!(
            !a_rung_fits(&gpt2(), Precision::Fp32, true, 2 << 30, 1, true, true),
            "no rung sheds the state"
        );
        assert!(
            s.iter().any(|x| x.starts_with("fewer layers")) && s.iter().any(|x| x.starts_with("a smaller vocabulary")),
            "{s:?}"
        );
        assert!(!s.iter().any(|x| x.starts_with("a shorter sequence")), "{s:?}");
        // A long sequence: its activations and logits are what does not fit.
        let long = GptConfig {
            block_size: 8192,
            ..gpt2()
        };
        let s = suggestions(
            &long,
            Precision::Fp32,
            true,
            4 << 30,
            crate::dist::DEFAULT_BUCKET_BYTES,
            1,
            false,
        );
        assert!(
            s.iter()
                .any(|x| x.starts_with("a shorter sequence: model.block_size 1024")),
            "{s:?}"
        );
        // Already checkpointing: the changes keep it, and it is not suggested again.
        let kept = suggestions(
            &long,
            Precision::Fp32,
            true,
            4 << 30,
            crate::dist::DEFAULT_BUCKET_BYTES,
            1,
            true,
        );
        assert!(
            !kept.iter().any(|x| x.starts_with("activation checkpointing")),
            "{kept:?}"
        );
        let block = |s: &[String]| {
            s.iter().find_map(|x| {
                x.strip_prefix("a shorter sequence: model.block_size ")?
                    .split(' ')
                    .next()?
                    .parse::<i64>()
                    .ok()
            })
        };
        let (kept_block, block) = (block(&kept), block(&s).unwrap());
        assert!(kept_block.is_none_or(|k| k > block), "{kept:?} against {s:?}");
        assert_eq!(device_memory("t4"), Some(16 << 30));
        assert_eq!(device_memory("H200"), Some(140 << 30));
        assert_eq!(device_memory("24GiB"), Some(24 << 30));
    }
}
