//! Owns a sharded update cut into slices that follow the all-gather's chunks, so that each
//! chunk's parameters can leave for the other ranks while the next slice updates.
//! Keeps: every element of this rank's pieces is in exactly one slice, and a slice boundary
//! lies a multiple of `ALIGN` elements into its piece: the fused kernel then runs its vector
//! and scalar paths on the same elements as over the whole piece, so the result is bitwise
//! the unsliced update's (`update.rs`: `a_sliced_update_is_bitwise_the_whole_one`).
use std::ops::Range;
use tch::{TchError, Tensor};

use super::zero::Piece;

/// Elements a slice boundary falls on, counted from its piece's start: a multiple of the
/// fused AdamW kernel's cache-line task unit (16 f32, 32 bf16) and of its vector width.
const ALIGN: i64 = 64;

/// One slice: by parameter group, the kernel's lists (parameters, gradients, moments,
/// step counts), and the bytes of gradient memory it reads.
#[derive(Default)]
pub struct Slice {
    pub groups: Vec<[Vec<Tensor>; 5]>,
    /// `[lo, hi)` inside the shard, over its parts (empty: lo == hi).
    pub range: (i64, i64),
    reads: Vec<Range<usize>>,
}

/// The views of one piece's `[from, from + len)` (relative to the piece) for a slice.
pub struct PieceViews {
    pub group: usize,
    /// Parameter, gradient, first and second moment, step count.
    pub tensors: [Tensor; 5],
}

impl Slice {
    /// Whether its kernel reads gradient memory in `bytes`.
    pub fn reads_in(&self, bytes: &Range<usize>) -> bool {
        self.reads.iter().any(|r| r.start < bytes.end && bytes.start < r.end)
    }

    fn add(&mut self, at: (i64, i64), v: PieceViews) -> Result<(), TchError> {
        if self.groups.len() <= v.group {
            self.groups.resize_with(v.group + 1, Default::default);
        }
        self.reads.push(span(&v.tensors[1])?);
        let (lo, hi) = at;
        self.range = match self.range {
            (a, b) if a < b => (a.min(lo), b.max(hi)),
            _ => (lo, hi),
        };
        for (list, t) in self.groups[v.group].iter_mut().zip(v.tensors) {
            list.push(t);
        }
        Ok(())
    }
}

/// The slices of this rank's pieces, one per chunk (`chunks`: (start inside the shard,
/// length), in order, of `chunk` elements but the last); `views(k, from, len)` gives piece
/// k's views. A piece's part in slice u ends where the next chunk starts, rounded down to
/// `ALIGN` into the piece.
pub fn slices(
    pieces: &[Piece],
    chunks: &[(i64, i64)],
    chunk: i64,
    mut views: impl FnMut(usize, i64, i64) -> Result<PieceViews, TchError>,
) -> Result<Vec<Slice>, TchError> {
    let mut out: Vec<Slice> = (0..chunks.len()).map(|_| Slice::default()).collect();
    let last = chunks.len().saturating_sub(1);
    let chunk = chunk.max(1);
    for (k, p) in pieces.iter().enumerate() {
        let (start, end) = (p.in_shard, p.in_shard + p.len);
        let cut = |b: i64| match b {
            b if b <= start => start,
            b if b >= end => end,
            b => start + (b - start) / ALIGN * ALIGN,
        };
        let first = ((start / chunk) as usize).min(last);
        let through = (((end - 1).max(start) / chunk + 1) as usize).min(last);
        for (u, slice) in out.iter_mut().enumerate().take(through + 1).skip(first) {
            let lo = if u == 0 { start } else { cut(chunks[u].0) };
            let hi = match chunks.get(u + 1) {
                Some(next) => cut(next.0),
                None => end,
            };
            if lo < hi {
                slice.add((lo, hi), views(k, lo - start, hi - lo)?)?;
            }
        }
    }
    Ok(out)
}

/// The slices chunk `c` (`[c.0, c.0 + c.1)`, the k-th) needs updated before it is packed:
/// those from k on whose parts meet it.
pub fn needed(slices: &[Slice], k: usize, c: (i64, i64)) -> Vec<usize> {
    let end = c.0 + c.1;
    (k..slices.len())
        .take_while(|&j| slices[j].range.0 < end || slices[j].range.0 == slices[j].range.1)
        .filter(|&j| slices[j].range.0 < slices[j].range.1 && slices[j].range.1 > c.0)
        .collect()
}

/// The bytes a tensor's elements span in memory.
pub fn span(t: &Tensor) -> Result<Range<usize>, TchError> {
    let start = t.data_ptr() as usize;
    let numel = t.numel();
    if numel == 0 {
        return Ok(start..start);
    }
    let (size, stride) = (t.size(), t.stride());
    let last: i64 = size.iter().zip(&stride).map(|(n, s)| (n - 1) * s.abs()).sum();
    Ok(start..start + (last as usize + 1) * t.kind().elt_size_in_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(param: usize, in_shard: i64, len: i64) -> Piece {
        Piece {
            param,
            at: 0,
            len,
            in_shard,
        }
    }

    /// One view as all five of a piece's tensors.
    fn five(t: Tensor, group: usize) -> PieceViews {
        let c = || t.shallow_clone();
        PieceViews {
            group,
            tensors: [c(), c(), c(), c(), c()],
        }
    }

    /// Each piece's elements, by slice: (piece, from, len).
    fn cut(pieces: &[Piece], shard: i64, chunk: i64) -> Vec<Vec<(usize, i64, i64)>> {
        let chunks: Vec<_> = (0..shard)
            .step_by(chunk as usize)
            .map(|s| (s, chunk.min(shard - s)))
            .collect();
        let data = Tensor::zeros([shard], (tch::Kind::Float, tch::Device::Cpu));
        let s = slices(pieces, &chunks, chunk, |k, from, len| {
            Ok(five(data.narrow(0, pieces[k].in_shard + from, len), k % 2))
        })
        .unwrap();
        s.iter()
            .map(|sl| {
                let mut v: Vec<_> = sl
                    .groups
                    .iter()
                    .flat_map(|g| g[0].iter())
                    .map(|t| {
                        let at = (t.data_ptr() as i64 - data.data_ptr() as i64) / 4;
                        let k = pieces
                            .iter()
                            .position(|p| p.in_shard <= at && at < p.in_shard + p.len)
                            .unwrap();
                        (k, at - pieces[k].in_shard, t.numel() as i64)
                    })
                    .collect();
                v.sort();
                v
            })
            .collect()
    }

    #[test]
    fn slices_cover_each_piece_once_at_aligned_cuts() {
        let pieces = [
            piece(0, 0, 100),
            piece(1, 100, 1000),
            piece(2, 1100, 7),
            piece(3, 1107, 300),
        ];
        for chunk in [1, 10, 64, 100, 333, 1407, 5000] {
            let by_slice = cut(&pieces, 1407, chunk);
            let mut seen = vec![0i64; 4];
            for parts in &by_slice {
                for &(k, from, len) in parts {
                    assert_eq!(from, seen[k], "chunk {chunk}: piece {k} in order, no gap");
                    assert!(from % ALIGN == 0, "chunk {chunk}: cut {from} into piece {k}");
                    seen[k] += len;
                }
            }
            assert_eq!(seen, vec![100, 1000, 7, 300], "chunk {chunk}");
        }
    }

    #[test]
    fn a_chunk_needs_the_slices_that_hold_its_elements() {
        let pieces = [piece(0, 0, 1000)];
        let chunks: Vec<_> = (0..1000).step_by(100).map(|s| (s, 100)).collect();
        let data = Tensor::zeros([1000], (tch::Kind::Float, tch::Device::Cpu));
        let s = slices(&pieces, &chunks, 100, |_, from, len| {
            Ok(five(data.narrow(0, from, len), 0))
        })
        .unwrap();
        // Cuts at 64, 192, 256, 384, ...: chunk 1 ([100, 200)) lies in slices 1 and 2.
        assert_eq!(s[1].range, (64, 192));
        assert_eq!(needed(&s, 1, (100, 100)), vec![1, 2]);
        assert_eq!(needed(&s, 9, (900, 100)), vec![9]);
        let g = span(&data.narrow(0, 100, 10)).unwrap();
        assert!(s[1].reads_in(&g) && !s[3].reads_in(&g));
    }
}
