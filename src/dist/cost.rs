//! Owns the cost model of a data-parallel step at a world size: each rank's memory for the
//! training state, its bytes on the wire and its host work a step (docs/scaling.md's tables).
//! Keeps: every figure comes from the code's own constants and layout (the exchange's message
//! and tree, `zero::Layout`'s chunks and plan); tests check it against measured small worlds.
pub use super::exchange::busiest_neighbours;
use super::exchange::MESSAGE_BYTES;
use super::overlap::{buffer_bytes, layout, DEFAULT_BUCKET_MB};
use crate::optim::zero::{gathers_in_shard, Layout, BUCKET_BYTES};
use crate::optim::Shard;

/// Exchanges inside a clean step of `oomguard train` (what a step record's `exchange_bytes`
/// counts; a real run checks it) with the gradients reduced after backward (plain and
/// ZeRO-1 CPU ranks on one machine by default, or `train.overlap_grad_reduce: false`): the attempt's
/// agreement, the update's, the losses' sum, the guard's inputs.
pub const EXCHANGES_IN_STEP: u64 = 4;
/// With the reduction overlapped (by default on CUDA, across machines, which this model is
/// for, and under ZeRO-2): one more, before the last micro-batch.
pub const EXCHANGES_IN_OVERLAPPED_STEP: u64 = EXCHANGES_IN_STEP + 1;
/// And the boundary's before each step (a stop signal, the checkpoint clock).
pub const EXCHANGES_PER_STEP: u64 = EXCHANGES_IN_STEP + 1;

/// One rank's costs in one step, in bytes or counts.
#[derive(Debug, Clone, PartialEq)]
pub struct Cost {
    /// fp32 parameters, replicated.
    pub params: u64,
    /// fp32 gradients at their peak: all of them after backward; ZeRO-2 (overlapped): the
    /// shard, the largest gradient and two buckets.
    pub grads: u64,
    /// AdamW's two moments: this rank's shard of them, or all.
    pub moments: u64,
    /// ZeRO's collective buffers (`world x chunk` and one chunk), and the overlapped
    /// reduction's: one shared bucket while it is made (`buffer_bytes`).
    pub buffers: u64,
    /// Gradient and parameter collectives' bytes sent by this rank (ring algorithms: NCCL's
    /// flat forms; on Gloo ZeRO's gradient sum is an all-reduce, as here, and its all-gather
    /// a broadcast from each rank: the same bytes).
    pub wire: u64,
    /// The busiest rank's exchange bytes (sent and received) a step.
    pub control: u64,
    /// Collective calls a step (ZeRO: one per chunk and direction, ZeRO-2's reduction one per
    /// bucket; plain and ZeRO-1: buckets aside, 1).
    pub collectives: u64,
    /// Host-side copies a step between the parameters and ZeRO's buffers (the plan's blocks).
    pub host_copies: u64,
}

impl Cost {
    /// Memory for the training state at its peak (activations aside).
    pub fn peak(&self) -> u64 {
        self.params + self.grads + self.moments + self.buffers
    }
}

/// One rank's step with parameters of sizes `numels` (fp32, AdamW) over `world` ranks.
pub fn cost(numels: &[i64], world: usize, shard: Shard) -> Cost {
    let p: u64 = numels.iter().map(|&n| n as u64).sum();
    let w = world as u64;
    let ring = |bytes: u64| bytes * (w - 1) / w;
    let control = |exchanges: u64| (exchanges + 1) * 2 * MESSAGE_BYTES * busiest_neighbours(world);
    let sizes: Vec<(usize, ())> = numels.iter().map(|&n| (4 * n as usize, ())).collect();
    let cap = (DEFAULT_BUCKET_MB * (1u64 << 20) as f64) as usize;
    let plain = Cost {
        params: 4 * p,
        grads: 4 * p,
        moments: 8 * p,
        buffers: if world < 2 { 0 } else { buffer_bytes(&sizes, cap) as u64 },
        wire: 2 * ring(4 * p),
        control: control(EXCHANGES_IN_OVERLAPPED_STEP),
        collectives: 1,
        host_copies: 0,
    };
    if shard == Shard::None || world < 2 {
        return plain;
    }
    let l = Layout::new(numels, 0, world, BUCKET_BYTES / 4);
    let chunks = l.chunks().len() as u64;
    let blocks = l.blocks() as u64;
    let sharded = Cost {
        moments: 8 * l.shard as u64,
        buffers: 4 * (w + 1) * l.chunk as u64,
        ..plain
    };
    let buckets = layout(&(0..sizes.len()).rev().collect::<Vec<_>>(), &sizes, cap);
    let largest_bucket = buckets
        .iter()
        .map(|b| b.iter().map(|&i| sizes[i].0).sum::<usize>())
        .max()
        .unwrap_or(0) as u64;
    let largest_grad = sizes.iter().map(|s| s.0).max().unwrap_or(0) as u64;
    match shard {
        // The gradients all-reduced whole, then the updated shard all-gathered through the
        // spent gradients' largest storage (a bucket, or a gradient larger than one) where
        // that takes no more collectives than the buffers, else through the buffers.
        Shard::Optimizer => {
            let g = Layout::with_chunk(numels, 0, world, largest_bucket as i64 / 4 / w as i64);
            let (buffers, chunks, blocks) = match gathers_in_shard(&l, &g, largest_bucket as i64 / 4) {
                true => (0, g.chunks().len() as u64, g.blocks() as u64),
                false => (sharded.buffers, chunks, blocks),
            };
            Cost {
                buffers,
                wire: 2 * ring(4 * p) + ring(4 * p),
                collectives: 1 + chunks,
                host_copies: blocks + chunks,
                ..sharded
            }
        }
        // Overlapped with backward: each bucket all-reduced as it completes, this rank's
        // pieces kept and its gradients dropped (at most two buckets in flight, and the
        // largest gradient whole while backward makes it); then the all-gather, a chunk at
        // a time, through the plan.
        // The all-gather through the gradient shard where that takes no more collectives
        // (no buffers of its own), else through the buffers.
        _ => {
            let g = Layout::with_chunk(numels, 0, world, l.shard / w as i64);
            let (gather_buffers, gather_chunks, gather_blocks) = if gathers_in_shard(&l, &g, l.shard) {
                (0, g.chunks().len() as u64, g.blocks() as u64)
            } else {
                (sharded.buffers, chunks, blocks)
            };
            Cost {
                grads: 4 * l.shard as u64 + largest_grad + 2 * largest_bucket,
                buffers: gather_buffers + buffer_bytes(&sizes, cap) as u64,
                wire: 2 * ring(4 * p) + ring(4 * p),
                collectives: buckets.len() as u64 + gather_chunks,
                host_copies: gather_blocks + gather_chunks,
                ..sharded
            }
        }
    }
}

/// GPT-2 124M's parameters in the optimizer's order (the LM head tied to the embedding).
pub fn gpt2_124m() -> Vec<i64> {
    let (d, v, ctx) = (768i64, 50257i64, 1024i64);
    let mut n = vec![v * d, ctx * d];
    for _ in 0..12 {
        n.extend([d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]);
    }
    n.extend([d, d]);
    n
}

/// A 7B decoder (LLaMA-2 7B's shapes: 32 layers, width 4096, MLP 11008, vocabulary 32000,
/// an untied head).
pub fn llama_7b() -> Vec<i64> {
    let (d, f, v) = (4096i64, 11008i64, 32000i64);
    let mut n = vec![v * d];
    for _ in 0..32 {
        n.extend([d, d * d, d * d, d * d, d * d, d, f * d, f * d, d * f]);
    }
    n.extend([d, v * d]);
    n
}

fn gib(b: u64) -> String {
    let g = b as f64 / (1u64 << 30) as f64;
    if g >= 10.0 {
        format!("{g:.0} GiB")
    } else if g >= 0.1 {
        format!("{g:.1} GiB")
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

fn count(n: u64) -> String {
    match n {
        0..10_000 => n.to_string(),
        10_000..10_000_000 => format!("{:.0}k", n as f64 / 1e3),
        _ => format!("{:.1}M", n as f64 / 1e6),
    }
}

/// docs/scaling.md's table: both models at 8, 64, 512 and 4,096 ranks, plain and ZeRO-2.
pub fn table() -> String {
    let mut out = String::from(
        "| model | ranks | state per rank, plain | ZeRO-2 | wire a step | exchange a step | ZeRO-2 collectives | host copies |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for (name, numels) in [("GPT-2 124M", gpt2_124m()), ("7B", llama_7b())] {
        for world in [8, 64, 512, 4096] {
            let (a, z) = (
                cost(&numels, world, Shard::None),
                cost(&numels, world, Shard::Gradients),
            );
            out += &format!(
                "| {name} | {world} | {} | {} | {} | {} B | {} | {} |\n",
                gib(a.peak()),
                gib(z.peak()),
                gib(z.wire),
                z.control,
                count(z.collectives),
                count(z.host_copies),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_plane_is_constant_and_the_state_shrinks_with_the_world() {
        let n = gpt2_124m();
        assert_eq!(n.iter().sum::<i64>(), 124_439_808);
        assert!((llama_7b().iter().sum::<i64>() - 6_738_415_616).abs() < 1_000);
        let (at8, at4096) = (cost(&n, 8, Shard::Gradients), cost(&n, 4096, Shard::Gradients));
        assert_eq!(at8.control, at4096.control);
        assert_eq!(busiest_neighbours(2), 1);
        assert_eq!(busiest_neighbours(3), 2);
        assert_eq!(busiest_neighbours(4096), 3);
        assert!(at4096.moments * 512 <= at8.moments + 8 * 512);
    }

    #[test]
    fn docs_scaling_md_holds_the_models_table() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/scaling.md")).unwrap();
        assert!(
            doc.contains(&table()),
            "docs/scaling.md's table is not the model's; it is now:\n{}",
            table()
        );
    }
}
