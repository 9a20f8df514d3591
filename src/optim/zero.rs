//! Owns ZeRO stages 1 and 2: the flat parameter space cut into one equal shard per rank.
//! Keeps: each rank keeps only its shard's state, and no buffer is ever the model's size.
use serde::{Deserialize, Serialize};
use std::rc::Rc;
use tch::{Kind, TchError, Tensor};

use crate::error::Result;

/// `train.shard`: what data-parallel ranks split between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Shard {
    /// Every rank holds the whole optimizer state and gradients (plain data parallel).
    #[default]
    None,
    /// ZeRO-1: AdamW's moments, 8 bytes per parameter, split across the ranks.
    Optimizer,
    /// ZeRO-2: the moments and the summed gradients.
    Gradients,
}

impl Shard {
    pub fn name(self) -> &'static str {
        match self {
            Shard::None => "none",
            Shard::Optimizer => "optimizer",
            Shard::Gradients => "gradients",
        }
    }
}

/// The collectives sharding needs; `ProcessGroup` implements them (this module stays a
/// leaf).
pub trait Comm {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    fn all_reduce_sum(&self, t: &Tensor) -> Result<()>;
    fn all_reduce_max(&self, t: &Tensor) -> Result<()>;
    /// `out` (S values) becomes the sum over ranks of their `input[rank*S..]`.
    fn reduce_scatter(&self, input: &Tensor, out: &Tensor) -> Result<()>;
    /// Starts an all-gather: `out[r*S..(r+1)*S]` becomes rank r's `input` (S values) once
    /// waited for; `input` may be this rank's slice of `out`. Several in flight overlap.
    fn all_gather_start(&self, input: &Tensor, out: &Tensor) -> Result<Box<dyn InFlight>>;
    /// For each (input, out), as `all_gather_start`, all started before any is waited for.
    fn all_gather(&self, pairs: &[(Tensor, Tensor)]) -> Result<()> {
        let started: Vec<_> = pairs
            .iter()
            .map(|(i, o)| self.all_gather_start(i, o))
            .collect::<Result<_>>()?;
        started.into_iter().try_for_each(|s| s.wait())
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<()>;
}

/// A collective in flight; `wait` completes it (an error: a peer failed or went).
pub trait InFlight {
    fn wait(self: Box<Self>) -> Result<()>;
}

/// The most bytes one of sharding's collectives moves over all ranks (f32 elements: a
/// quarter of it).
pub const BUCKET_BYTES: i64 = 25 << 20;

/// The fewest collectives a shard is moved in.
const CHUNKS_PER_SHARD: i64 = 16;

/// Where each parameter lies in the flat space, and which part is whose.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    pub rank: usize,
    pub world: usize,
    offsets: Vec<i64>,
    numels: Vec<i64>,
    /// Elements of all parameters.
    pub total: i64,
    /// Elements per rank: the flat space is padded to `world x shard`.
    pub shard: i64,
    /// Elements per rank in one collective (its buffer holds `world x chunk`).
    pub chunk: i64,
    /// Each chunk's copies between the parameters and a `world x len` buffer, worked out
    /// once per layout: a step's host work is then O(parameters x chunks), whatever the world.
    plan: Vec<ChunkPlan>,
}

/// Copies of `count` segments of `len` elements: parameter `param` (flattened) from `at`, a
/// segment every `shard` elements, to or from the buffer at `rel`, a segment every `len`
/// elements (one strided copy, however many ranks' segments it covers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub param: usize,
    pub at: i64,
    pub rel: i64,
    pub len: i64,
    pub count: i64,
}

/// One chunk's blocks, and where its zero padding (past the last parameter) starts in the
/// buffer.
#[derive(Debug, Clone, PartialEq)]
struct ChunkPlan {
    /// The chunk: (start inside the shard, length).
    chunk: (i64, i64),
    blocks: Vec<Block>,
    zeros_from: i64,
}

/// A parameter's part in this rank's shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub param: usize,
    /// Where it starts inside the parameter (flattened), and how long it is.
    pub at: i64,
    pub len: i64,
    /// Where it starts inside the shard.
    pub in_shard: i64,
}

impl Layout {
    /// `numels`: the parameters' sizes in the optimizer's order; `bucket_elems`: the most
    /// elements one collective moves over all ranks.
    pub fn new(numels: &[i64], rank: usize, world: usize, bucket_elems: i64) -> Layout {
        let total: i64 = numels.iter().sum();
        Layout::with_chunk(numels, rank, world, default_chunk(total, world, bucket_elems))
    }

    /// The same space moved in chunks of `chunk` elements per rank (at least 1, at most the
    /// shard).
    pub fn with_chunk(numels: &[i64], rank: usize, world: usize, chunk: i64) -> Layout {
        let mut offsets = Vec::with_capacity(numels.len());
        let mut total = 0;
        for n in numels {
            offsets.push(total);
            total += n;
        }
        let shard = (total + world as i64 - 1) / world as i64;
        let chunk = chunk.clamp(1, shard.max(1));
        let mut l = Layout {
            rank,
            world,
            offsets,
            numels: numels.to_vec(),
            total,
            shard,
            chunk,
            plan: vec![],
        };
        l.plan = l.chunks().into_iter().map(|c| l.plan_chunk(c)).collect();
        l
    }

    /// The blocks moving shard chunk `(start, len)` of every rank: for each parameter, the
    /// ranks whose segment lies wholly inside it in one strided block, and a partial segment
    /// at either end.
    fn plan_chunk(&self, (start, len): (i64, i64)) -> ChunkPlan {
        let (shard, last) = (self.shard, self.world as i64 - 1);
        let mut blocks = Vec::new();
        for (i, (&o, &n)) in self.offsets.iter().zip(&self.numels).enumerate() {
            // Ranks whose segment [r*shard + start, +len) meets [o, o + n).
            let lo = ((o - start - len).div_euclid(shard) + 1).max(0);
            let hi = (o + n - start - 1).div_euclid(shard).min(last);
            let seg = |r: i64| r * shard + start;
            let whole = |r: i64| seg(r) >= o && seg(r) + len <= o + n;
            let mut part = |r: i64| {
                let (a, b) = (seg(r).max(o), (seg(r) + len).min(o + n));
                blocks.push(Block {
                    param: i,
                    at: a - o,
                    rel: r * len + a - seg(r),
                    len: b - a,
                    count: 1,
                });
            };
            if lo > hi {
                continue;
            }
            let (mut first, mut end) = (lo, hi);
            if !whole(lo) {
                part(lo);
                first += 1;
            }
            if hi >= first && !whole(hi) {
                part(hi);
                end -= 1;
            }
            if end >= first {
                let at = seg(first) - o;
                blocks.push(Block {
                    param: i,
                    at,
                    rel: first * len,
                    len,
                    count: end - first + 1,
                });
            }
        }
        // Segments past the last parameter: the first rank's whose segment ends past `total`
        // from there on, and every later rank's whole segment.
        let zeros_from = (0..=last)
            .find(|&r| seg_end(r, shard, start, len) > self.total)
            .map_or(self.world as i64 * len, |r| {
                r * len + (self.total - (r * shard + start)).max(0)
            });
        ChunkPlan {
            chunk: (start, len),
            blocks,
            zeros_from,
        }
    }

    /// The parts of parameters in flat `[lo, lo + len)`: (parameter, start inside it,
    /// length, start relative to `lo`).
    fn within(&self, lo: i64, len: i64) -> impl Iterator<Item = (usize, i64, i64, i64)> + '_ {
        let hi = lo + len;
        // The first parameter ending past `lo`: O(log parameters) to find, then only those met.
        let first = self.offsets.partition_point(|&o| o <= lo).saturating_sub(1);
        (first..self.numels.len())
            .map_while(move |i| (self.offsets[i] < hi).then_some(i))
            .filter_map(move |i| {
                let (o, n) = (self.offsets[i], self.numels[i]);
                let (a, b) = (lo.max(o), hi.min(o + n));
                (a < b).then_some((i, a - o, b - a, a - lo))
            })
    }

    /// This rank's pieces, in shard order.
    pub fn pieces(&self) -> Vec<Piece> {
        let lo = self.rank as i64 * self.shard;
        self.within(lo, self.shard)
            .map(|(param, at, len, in_shard)| Piece {
                param,
                at,
                len,
                in_shard,
            })
            .collect()
    }

    /// The same space and rank, moved in chunks of `chunk` elements per rank.
    pub fn rechunked(&self, chunk: i64) -> Layout {
        Layout::with_chunk(&self.numels, self.rank, self.world, chunk)
    }

    /// The collectives' chunks of a shard: (start inside the shard, length).
    pub fn chunks(&self) -> Vec<(i64, i64)> {
        (0..self.shard)
            .step_by(self.chunk.max(1) as usize)
            .map(|s| (s, self.chunk.min(self.shard - s)))
            .collect()
    }

    /// Copies flat `[lo, lo + dst.numel())` of `flat` (one flattened view per parameter)
    /// into `dst`; zeros past the last parameter. Allocates nothing.
    pub fn pack(&self, flat: &[Tensor], lo: i64, dst: &Tensor) -> std::result::Result<(), TchError> {
        let len = dst.numel() as i64;
        let mut covered = 0;
        for (i, at, n, rel) in self.within(lo, len) {
            dst.f_narrow(0, rel, n)?.f_copy_(&flat[i].f_narrow(0, at, n)?)?;
            covered = covered.max(rel + n);
        }
        if covered < len {
            let _ = dst.f_narrow(0, covered, len - covered)?.f_zero_()?;
        }
        Ok(())
    }

    /// The reverse of `pack`: `src`'s values into the parameters' flat `[lo, ..)`.
    pub fn unpack(&self, src: &Tensor, lo: i64, flat: &[Tensor]) -> std::result::Result<(), TchError> {
        for (i, at, n, rel) in self.within(lo, src.numel() as i64) {
            flat[i].f_narrow(0, at, n)?.f_copy_(&src.f_narrow(0, rel, n)?)?;
        }
        Ok(())
    }

    /// Shard chunk `(start, len)` (one of `chunks()`) of every rank in a `world x len`
    /// buffer, by the layout's plan; zeros past the last parameter. Allocates nothing.
    pub fn pack_all(&self, flat: &[Tensor], chunk: (i64, i64), buf: &Tensor) -> std::result::Result<(), TchError> {
        let plan = self.plan_of(chunk)?;
        for b in &plan.blocks {
            let (param, mut ours) = self.block_views(b, flat, buf)?;
            ours.f_copy_(&param)?;
        }
        let end = self.world as i64 * chunk.1;
        if plan.zeros_from < end {
            let _ = buf.f_narrow(0, plan.zeros_from, end - plan.zeros_from)?.f_zero_()?;
        }
        Ok(())
    }

    /// The reverse of `pack_all`: a `world x len` buffer's values into the parameters.
    pub fn unpack_all(&self, buf: &Tensor, chunk: (i64, i64), flat: &[Tensor]) -> std::result::Result<(), TchError> {
        self.unpack_except(buf, chunk, flat, None)
    }

    /// `unpack_all` but for this rank's own segment, which its parameters hold already
    /// (the update wrote them in place, and they were packed from there).
    pub fn unpack_others(&self, buf: &Tensor, chunk: (i64, i64), flat: &[Tensor]) -> std::result::Result<(), TchError> {
        self.unpack_except(buf, chunk, flat, Some(self.rank as i64))
    }

    /// A block covers ranks `rel / len ..` (one segment each): all but `except`'s copied.
    fn unpack_except(
        &self,
        buf: &Tensor,
        (start, len): (i64, i64),
        flat: &[Tensor],
        except: Option<i64>,
    ) -> std::result::Result<(), TchError> {
        for b in &self.plan_of((start, len))?.blocks {
            let (param, ours) = self.block_views(b, flat, buf)?;
            let skip = except
                .map(|r| r - b.rel / len.max(1))
                .filter(|i| (0..b.count).contains(i));
            let rows = match skip {
                None => vec![(0, b.count)],
                Some(i) => vec![(0, i), (i + 1, b.count - i - 1)],
            };
            for (at, n) in rows.into_iter().filter(|r| r.1 > 0) {
                param.f_narrow(0, at, n)?.f_copy_(&ours.f_narrow(0, at, n)?)?;
            }
        }
        Ok(())
    }

    /// The plan of one of `chunks()`.
    fn plan_of(&self, (start, len): (i64, i64)) -> std::result::Result<&ChunkPlan, TchError> {
        let i = (start / self.chunk.max(1)) as usize;
        match self.plan.get(i) {
            Some(p) if p.chunk == (start, len) => Ok(p),
            _ => Err(TchError::Shape(format!(
                "({start}, {len}) is not a chunk of this layout"
            ))),
        }
    }

    /// A block's two sides as `[count, len]` views: the parameter's (a segment every
    /// `shard` elements) and the buffer's.
    fn block_views(&self, b: &Block, flat: &[Tensor], buf: &Tensor) -> std::result::Result<(Tensor, Tensor), TchError> {
        let span = (b.count - 1) * self.shard + b.len;
        let param = flat[b.param]
            .f_narrow(0, b.at, span)?
            .f_unfold(0, b.len, self.shard.max(1))?;
        let ours = buf.f_narrow(0, b.rel, b.count * b.len)?.f_view([b.count, b.len])?;
        Ok((param, ours))
    }

    /// Blocks per step (pack and unpack each), for the scale bench and the cost model.
    pub fn blocks(&self) -> usize {
        self.plan.iter().map(|p| p.blocks.len()).sum()
    }
}

fn seg_end(r: i64, shard: i64, start: i64, len: i64) -> i64 {
    r * shard + start + len
}

/// A sharded optimizer's own state: the layout, this rank's moments and (stage 2) its
/// gradient shard.
pub struct Zero {
    pub stage: Shard,
    pub layout: Layout,
    pub pieces: Vec<Piece>,
    pub comm: Rc<dyn Comm>,
    /// `[shard]` each: this rank's part of AdamW's moments.
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    /// Stage 2: this rank's part of the summed gradients, from the reduce-scatter to the
    /// update.
    pub grad: Option<GradShard>,
    /// Stage 2's all-gather, through the gradient shard's memory once the update has used
    /// it: `world` chunks of shard / world (and the remainder), so `world x chunk` fits the
    /// shard. Few collectives, each their latency (about a millisecond on Gloo here), and
    /// no buffer of its own.
    pub gather_in_grad: Layout,
    /// A checkpoint's full state read on rank 0, until `AdamW::share_restored` hands each
    /// rank its part.
    pub restored: Option<Vec<(String, Tensor)>>,
    /// Stage 2: the clipping prepared for the ranks' agreement.
    pub clip: Option<Clip>,
}

impl Zero {
    /// Whether the all-gather goes through the gradient shard: stage 2's flat one, where that
    /// takes no more collectives than the buffers' chunks (up to 16 ranks) and the shard holds
    /// `world` chunks (not for a model of fewer elements than ranks).
    pub fn gathers_in_grad(&self) -> bool {
        matches!(&self.grad, Some(GradShard::Flat(g)) if gathers_in_shard(&self.layout, &self.gather_in_grad, g.numel() as i64))
    }
}

/// Stage 2's shard of the summed gradients: one tensor (the reduce-scatter after backward),
/// or the segments the overlapped reduction made bucket by bucket during backward (so that
/// no whole shard stands beside backward's first activations; a segment may be a bucket
/// kept whole, others' sums beside this rank's), with each piece's view of them.
pub enum GradShard {
    Flat(Tensor),
    /// `parts`: the pieces' views with those that follow each other in a segment merged.
    Segments {
        segments: Vec<Tensor>,
        pieces: Vec<Tensor>,
        parts: Vec<Tensor>,
    },
}

impl GradShard {
    /// Piece `k` (`p`, the k-th of the layout's pieces) of the summed gradients.
    pub fn piece(&self, k: usize, p: &Piece) -> std::result::Result<Tensor, TchError> {
        match self {
            GradShard::Flat(g) => g.f_narrow(0, p.in_shard, p.len),
            GradShard::Segments { pieces, .. } => pieces
                .get(k)
                .map(Tensor::shallow_clone)
                .ok_or_else(|| TchError::Kind(format!("stage 2's gradient shard has no piece {k}"))),
        }
    }

    /// Its elements, each once, in as few views as they lie in (a segment may hold more: a
    /// bucket kept whole).
    pub fn parts(&self) -> Vec<Tensor> {
        match self {
            GradShard::Flat(g) => vec![g.shallow_clone()],
            GradShard::Segments { parts, .. } => parts.iter().map(Tensor::shallow_clone).collect(),
        }
    }
}

/// The elements per rank of one collective over `total` parameters (`Layout::new`): a
/// sixteenth of the shard at most, so that the buffers ((world + 1) x chunk) stay small
/// against what sharding saves, even for a model smaller than one bucket.
pub fn default_chunk(total: i64, world: usize, bucket_elems: i64) -> i64 {
    let shard = (total + world as i64 - 1) / world as i64;
    (bucket_elems / world as i64).min((shard + CHUNKS_PER_SHARD - 1) / CHUNKS_PER_SHARD)
}

/// Stage 1's all-gather buffers, in elements, where its largest spent gradient storage of
/// `space` elements would take more collectives than they (`gathers_in_shard`); 0 where it
/// goes through that storage. What `AdamW::prepare` allocates, for the planner.
pub fn stage_1_buffers(total: i64, world: usize, space: i64) -> i64 {
    let shard = (total + world as i64 - 1) / world as i64;
    let chunk = default_chunk(total, world, BUCKET_BYTES / 4).clamp(1, shard.max(1));
    let through = (space / world as i64).clamp(1, shard.max(1));
    match goes_through(chunk, through, world, space) {
        true => 0,
        false => (world as i64 + 1) * chunk,
    }
}

/// Whether the all-gather of `layout`'s space goes through a shard of `shard_numel` elements
/// by `in_shard` (its chunks no smaller than the buffers' and `world` of them fit).
pub fn gathers_in_shard(layout: &Layout, in_shard: &Layout, shard_numel: i64) -> bool {
    goes_through(layout.chunk, in_shard.chunk, in_shard.world, shard_numel)
}

/// Chunks of `through` elements a rank in a storage of `space` take no more collectives
/// than the buffers' chunks of `chunk`, and `world` of them fit it.
fn goes_through(chunk: i64, through: i64, world: usize, space: i64) -> bool {
    through >= chunk && world as i64 * through <= space
}

/// Stage 2's clipping, allocated before the ranks agree: this shard's sum of squares, and
/// the norm and coefficient it becomes once summed over the ranks.
pub struct Clip {
    pub sq: Tensor,
    pub norm: Tensor,
    pub coef: Tensor,
    /// 1e-6 and 1 as 0-dim tensors: the clipping's constants, so that it allocates nothing
    /// once the ranks agreed.
    pub eps: Tensor,
    pub one: Tensor,
    pub max_norm: f64,
}

/// A collective's buffers: `world x chunk` and one chunk.
pub struct Buffers {
    pub all: Tensor,
    pub own: Tensor,
}

impl Buffers {
    pub fn new(layout: &Layout, kind: Kind, device: tch::Device) -> std::result::Result<Buffers, TchError> {
        Ok(Buffers {
            all: Tensor::f_empty([layout.world as i64 * layout.chunk], (kind, device))?,
            own: Tensor::f_empty([layout.chunk], (kind, device))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_flat_space_once() {
        let numels = [5, 3, 8, 1];
        for world in 1..=5 {
            let mut seen = vec![0; 17];
            for rank in 0..world {
                let l = Layout::new(&numels, rank, world, 4);
                assert_eq!(l.shard, (17 + world as i64 - 1) / world as i64);
                let mut at_shard = 0;
                for p in l.pieces() {
                    assert_eq!(p.in_shard, at_shard, "pieces are contiguous in the shard");
                    at_shard += p.len;
                    let o: i64 = numels[..p.param].iter().sum();
                    for e in o + p.at..o + p.at + p.len {
                        seen[e as usize] += 1;
                    }
                }
                let chunks = l.chunks();
                assert_eq!(chunks.iter().map(|c| c.1).sum::<i64>(), l.shard);
                // Stage 2's gather through the gradient shard: world chunks and the rest.
                let g = Layout::with_chunk(&numels, rank, world, l.shard / world as i64);
                assert_eq!(g.chunks().iter().map(|c| c.1).sum::<i64>(), l.shard);
                assert!(world as i64 * g.chunk <= l.shard || l.shard < world as i64);
                assert!(chunks.iter().all(|c| c.1 <= l.chunk));
            }
            assert!(seen.iter().all(|&s| s == 1), "world {world}: {seen:?}");
        }
    }

    #[test]
    fn pack_and_unpack_round_trip_with_padding() {
        let params: Vec<Tensor> = [5i64, 3, 8, 1]
            .iter()
            .map(|&n| Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) + 100 * n)
            .collect();
        let l = Layout::new(&[5, 3, 8, 1], 1, 3, 6);
        let buf = Tensor::zeros([l.world as i64 * l.chunk], (Kind::Float, tch::Device::Cpu));
        let out: Vec<Tensor> = params.iter().map(|p| p.zeros_like()).collect();
        for c in l.chunks() {
            let b = buf.narrow(0, 0, l.world as i64 * c.1);
            l.pack_all(&params, c, &b).unwrap();
            l.unpack_all(&b, c, &out).unwrap();
        }
        for (p, o) in params.iter().zip(&out) {
            assert!(p.equal(o));
        }
        // The last rank's shard runs past the parameters: zeros there.
        let last = Layout::new(&[5, 3, 8, 1], 2, 3, 100);
        let t = Tensor::ones([last.shard], (Kind::Float, tch::Device::Cpu));
        last.pack(&params, 2 * last.shard, &t).unwrap();
        assert_eq!(t.narrow(0, 5, 1).double_value(&[0]), 0.0);
        assert_eq!(t.narrow(0, 4, 1).double_value(&[0]), 100.0); // the last parameter's one value
        assert_eq!(t.narrow(0, 0, 1).double_value(&[0]), 804.0); // the third's fifth
    }

    #[test]
    fn the_plan_moves_what_each_rank_by_rank_copy_would() {
        let opts = (Kind::Float, tch::Device::Cpu);
        for numels in [vec![5i64, 3, 8, 1], vec![1; 7], vec![40, 2, 2, 33, 1, 9], vec![100]] {
            let total: i64 = numels.iter().sum();
            let params: Vec<Tensor> = numels
                .iter()
                .scan(0, |o, &n| {
                    *o += n;
                    Some(Tensor::arange(n, opts) + (*o - n + 1))
                })
                .collect();
            for world in 1..=9 {
                for bucket in [1, 4, 6, 13, 1000] {
                    let l = Layout::new(&numels, 0, world, bucket);
                    let padded = Tensor::cat(
                        &[
                            Tensor::cat(&params, 0),
                            Tensor::zeros([l.world as i64 * l.shard - total], opts),
                        ],
                        0,
                    );
                    let back: Vec<Tensor> = params.iter().map(|p| p.zeros_like()).collect();
                    for (start, len) in l.chunks() {
                        let buf = Tensor::full([l.world as i64 * len], -7.0, opts);
                        l.pack_all(&params, (start, len), &buf).unwrap();
                        let want = padded
                            .view([l.world as i64, l.shard])
                            .narrow(1, start, len)
                            .reshape([-1]);
                        assert!(
                            buf.equal(&want),
                            "{numels:?} world {world} bucket {bucket} chunk ({start}, {len})"
                        );
                        l.unpack_all(&buf, (start, len), &back).unwrap();
                    }
                    for (p, b) in params.iter().zip(&back) {
                        assert!(p.equal(b), "{numels:?} world {world} bucket {bucket}: unpacked {b:?}");
                    }
                    // Each rank's unpack of the others' segments: every value but its own shard's.
                    for rank in 0..world {
                        let l = Layout::new(&numels, rank, world, bucket);
                        let others: Vec<Tensor> = params.iter().map(|p| p.full_like(-1.0)).collect();
                        for (start, len) in l.chunks() {
                            let buf = Tensor::f_empty([l.world as i64 * len], opts).unwrap();
                            l.pack_all(&params, (start, len), &buf).unwrap();
                            l.unpack_others(&buf, (start, len), &others).unwrap();
                        }
                        let (got, want) = (Tensor::cat(&others, 0), Tensor::cat(&params, 0));
                        let lo = (rank as i64 * l.shard).min(total);
                        let _ = want.narrow(0, lo, (lo + l.shard).min(total) - lo).fill_(-1.0);
                        assert!(got.equal(&want), "{numels:?} world {world} bucket {bucket} rank {rank}");
                    }
                    // A step's copies do not grow with the world: at most three per parameter a chunk.
                    assert!(l.blocks() <= 3 * numels.len() * l.chunks().len(), "{}", l.blocks());
                }
            }
        }
    }
}
