//! Owns the gradient reduction overlapped with backward (csrc/overlap.cpp): buckets of
//! parameters whose all-reduces start from backward's hooks on an attempt's last micro-batch.
//! Keeps: in every armed pass each rank starts the same buckets in the same order, whatever
//! failed where, and waits for them before the attempt's outcome is acted on.
use std::ffi::{c_char, c_void};
use tch::Tensor;

use super::ProcessGroup;
use crate::error::{check, Error, Phase, Result};

extern "C" {
    fn og_reducer_new(
        group: *mut c_void,
        params: *const *mut c_void,
        n: i32,
        order: *const i64,
        starts: *const i64,
        nb: i32,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn og_reducer_free(r: *mut c_void);
    fn og_reducer_buckets(r: *mut c_void) -> i32;
    fn og_reducer_observed(r: *mut c_void, out: *mut i64, n: *mut i32);
    fn og_reducer_relayout(r: *mut c_void, order: *const i64, starts: *const i64, nb: i32) -> *mut c_char;
    fn og_reducer_arm(r: *mut c_void, shard: i32, pieces: *const i64, n: i32) -> *mut c_char;
    fn og_reducer_disarm(r: *mut c_void);
    fn og_reducer_launch_rest(r: *mut c_void, failed: i32, twice: *mut i32, oom: *mut *mut c_char) -> *mut c_char;
    fn og_reducer_wait(r: *mut c_void, keep: i32, segs: *mut *mut c_void, nsegs: *mut i32, at: *mut i64)
        -> *mut c_char;
    fn og_reducer_trashed(r: *mut c_void, out: *mut i64, cap: i32) -> i32;
}

/// DDP's default bucket size is 25 MiB, sized for GPUs and NCCL. Here it is measured
/// (docs/measurements/bench-netns-2026-11-27b.txt, two nodes at 1 Gbit/s): 1 MiB hid 84% of
/// the transfer at no cost on the fast link; 0.25 MiB hid 88% but its many small
/// collectives cost 9% on the fast link; one bucket hides nothing. A parameter larger than a
/// bucket is reduced alone, in place, so the size only groups the small ones.
pub const DEFAULT_BUCKET_MB: f64 = 1.0;
/// The same, in bytes.
pub const DEFAULT_BUCKET_BYTES: u64 = 1 << 20;

/// The largest `train.bucket_cap_mb` taken (1 TiB: larger than any model's gradients, and
/// small enough that the planner's sums of buckets cannot overflow).
pub const MAX_BUCKET_MB: f64 = (1u64 << 20) as f64;

/// Under a fixed `memory.budget`, a default bucket is at most this share of it: the buckets
/// held at once (one being filled, two in flight) then stay a few percent of the memory,
/// where a model sized to a small budget would otherwise spend its last megabytes on them
/// (ZeRO-2's largest model, bench-shard-2026-11-29c.txt).
pub const BUDGET_PER_BUCKET: u64 = 128;

/// The smallest default bucket (a budget this small trains only toy models).
const MIN_DEFAULT_BUCKET: u64 = 4 << 10;

/// A bucket's most bytes: `cap_mb` where the user set it; else 1 MiB, or 1/128 of a fixed
/// budget where that is less. Pure, and the same on every rank for the same config.
pub fn bucket_bytes(cap_mb: Option<f64>, fixed_budget: Option<u64>) -> usize {
    match cap_mb {
        Some(mb) => ((mb * (1u64 << 20) as f64) as usize).max(1),
        None => {
            let share = fixed_budget.map_or(u64::MAX, |b| b / BUDGET_PER_BUCKET);
            DEFAULT_BUCKET_BYTES.min(share.max(MIN_DEFAULT_BUCKET)) as usize
        }
    }
}

/// The reducer of one process group's parameters; its hooks stay on the parameters until
/// it is dropped (inert unless armed). Its first buckets follow the parameters' reverse
/// order; after its first step (overlapped or not) they follow the order backward produced the
/// gradients in (rank 0's, as DDP rebuilds its buckets), so that the first bucket is
/// complete early.
pub struct Reducer {
    ptr: *mut c_void,
    /// Bytes and dtype-and-device of each parameter.
    sizes: Vec<(usize, String)>,
    /// The first step's order (`new`).
    first: Vec<usize>,
    cap: usize,
    settled: std::cell::Cell<bool>,
    always: bool,
}

/// ZeRO-2's shard of the summed gradients as the overlapped reduction made it: a segment for
/// each bucket it has pieces of, and where each piece lies (its segment, where in it), in
/// the order the pieces were armed.
pub struct Segments {
    pub segments: Vec<Tensor>,
    pub at: Vec<(usize, i64)>,
}

impl Drop for Reducer {
    fn drop(&mut self) {
        unsafe { og_reducer_free(self.ptr) }
    }
}

fn torch_error(what: &'static str) -> impl Fn(tch::TchError) -> Error {
    move |e| Error::Dist(format!("{what}: {}", crate::task::error_line(&e.to_string())))
}

impl Reducer {
    /// Buckets of at most `bucket_bytes` over `params` (see `layout`), a hook on each, in
    /// `first`: the order the first backward is expected to complete them in (indices into
    /// `params`, each once; the rest follow, last first). Fails where a parameter already
    /// carries a post-accumulate-grad hook of its own. `always`: for every stage (otherwise
    /// under ZeRO-2 only, see `runs_under`).
    pub fn new(
        pg: &ProcessGroup,
        params: &[Tensor],
        first: &[usize],
        bucket_bytes: usize,
        always: bool,
    ) -> Result<Reducer> {
        let sizes: Vec<(usize, String)> = params
            .iter()
            .map(|t| {
                (
                    t.numel() * t.kind().elt_size_in_bytes(),
                    format!("{:?} {:?}", t.kind(), t.device()),
                )
            })
            .collect();
        let first = complete(first, sizes.len());
        let (order, starts) = flat(&layout(&first, &sizes, bucket_bytes));
        let p: Vec<*mut c_void> = params.iter().map(|t| t.as_ptr() as *mut c_void).collect();
        let mut ptr = std::ptr::null_mut();
        let nb = starts.len() as i32 - 1;
        check(unsafe {
            og_reducer_new(
                pg.ptr,
                p.as_ptr(),
                p.len() as i32,
                order.as_ptr(),
                starts.as_ptr(),
                nb,
                &mut ptr,
            )
        })
        .map_err(torch_error("the overlapped reduction's hooks"))?;
        Ok(Reducer {
            ptr,
            sizes,
            first,
            cap: bucket_bytes,
            settled: std::cell::Cell::new(false),
            always,
        })
    }

    /// Whether a step at this stage overlaps: always when so made, else under ZeRO-2 where it
    /// shards the gradients (`shards_gradients`), whose memory it is (each bucket's
    /// gradients dropped once summed into the shard, during backward, instead of every
    /// gradient held until the end).
    pub fn runs_under(&self, stage: crate::optim::Shard) -> bool {
        self.always || (stage == crate::optim::Shard::Gradients && self.scatters())
    }

    /// Once, after the first step every rank completed (overlapped or not: the hooks see
    /// every backward): the buckets in the order this run's backward produced the gradients
    /// (rank 0's order, broadcast; parameters that had none last). Every rank calls it at the
    /// same point. Until then (a run's first step) the buckets follow the order `new` was
    /// given: the model's own order reversed, as DDP's first iteration.
    pub fn settle(&self, pg: &ProcessGroup) -> Result<()> {
        if self.settled.replace(true) {
            return Ok(());
        }
        let n = self.sizes.len();
        let (mut seen, mut count) = (vec![0i64; n], 0i32);
        unsafe { og_reducer_observed(self.ptr, seen.as_mut_ptr(), &mut count) };
        seen.truncate(count as usize);
        let mut order: Vec<usize> = seen.iter().map(|&i| i as usize).collect();
        order.extend(self.first.iter().filter(|&&i| !seen.contains(&(i as i64))));
        let t = Tensor::from_slice(&order.iter().map(|&i| i as i64).collect::<Vec<_>>())
            .f_to_device(pg.device())
            .map_err(torch_error("the gradients' order"))?;
        pg.broadcast(std::slice::from_ref(&t), 0)?;
        let order: Vec<usize> = t
            .f_to_device(tch::Device::Cpu)
            .and_then(|t| Vec::<i64>::try_from(&t))
            .map_err(torch_error("the gradients' order"))?
            .into_iter()
            .map(|i| i as usize)
            .collect();
        let (order, starts) = flat(&layout(&order, &self.sizes, self.cap));
        let nb = starts.len() as i32 - 1;
        check(unsafe { og_reducer_relayout(self.ptr, order.as_ptr(), starts.as_ptr(), nb) })
            .map_err(torch_error("the overlapped reduction's buckets"))
    }

    /// `shards_gradients` for these parameters and buckets.
    pub fn scatters(&self) -> bool {
        shards_gradients(self.sizes.iter().map(|s| s.0), self.cap)
    }

    /// Collectives an armed pass starts.
    pub fn buckets(&self) -> usize {
        unsafe { og_reducer_buckets(self.ptr) as usize }
    }

    /// Before the last micro-batch (nothing is allocated here); then the hooks start buckets
    /// as gradients complete. ZeRO-2 (`scatter`): this rank's pieces of its shard,
    /// `[parameter, where in it, how long]`: as each bucket's sum arrives, the pieces become
    /// its segment (the bucket's own buffer where they are most of it, else a copy), and its
    /// gradients are dropped.
    /// Whole (ZeRO-2 only where `scatters`): the sums stay the gradients, as data parallel's.
    pub fn arm(&self, scatter: Option<&[[i64; 3]]>) -> Result<()> {
        let pieces = scatter.filter(|_| self.scatters());
        let flat = pieces.map_or(vec![], |p| p.concat());
        let n = (flat.len() / 3) as i32;
        check(unsafe { og_reducer_arm(self.ptr, pieces.is_some() as i32, flat.as_ptr(), n) })
            .map_err(|e| Error::from(e).in_phase(Phase::Backward))
    }

    /// The ranks did not agree to go on: nothing was started; the stand-in goes.
    pub fn disarm(&self) {
        unsafe { og_reducer_disarm(self.ptr) }
    }

    /// After backward: starts the buckets the hooks did not. `failed`: as they are (their sums
    /// will be dropped). Returns whether some gradient was accumulated twice in the pass (a
    /// model whose backward runs in several passes; its sums are wrong), and the error of a
    /// bucket that could not be made (this rank has failed: its buckets went as garbage).
    pub fn launch_rest(&self, failed: bool) -> Result<(bool, Option<Error>)> {
        let (mut twice, mut oom) = (0, std::ptr::null_mut());
        check(unsafe { og_reducer_launch_rest(self.ptr, failed as i32, &mut twice, &mut oom) })
            .map_err(torch_error("starting the gradient all-reduce"))?;
        let oom = check(oom).err().map(|e| Error::from(e).in_phase(Phase::Backward));
        Ok((twice != 0, oom))
    }

    /// Waits for every bucket started; `keep`: the sums are the gradients (ZeRO-2, armed with
    /// `pieces` of them: returned, this rank's shard of them, the gradients dropped);
    /// otherwise the gradients that are views of the buckets go.
    pub fn wait(&self, keep: bool, pieces: usize) -> Result<Option<Segments>> {
        let mut segs = vec![std::ptr::null_mut(); self.buckets()];
        let (mut n, mut at) = (-1i32, vec![0i64; 2 * pieces]);
        check(unsafe { og_reducer_wait(self.ptr, keep as i32, segs.as_mut_ptr(), &mut n, at.as_mut_ptr()) })
            .map_err(torch_error("gradient all-reduce"))?;
        if n < 0 {
            return Ok(None);
        }
        // SAFETY: the first n slots hold new torch::Tensor*s the C++ side handed over.
        let segments = segs[..n as usize]
            .iter()
            .map(|&p| unsafe { Tensor::from_ptr(p as *mut torch_sys::C_tensor) })
            .collect();
        let at = at.chunks(2).map(|w| (w[0] as usize, w[1])).collect();
        Ok(Some(Segments { segments, at }))
    }

    /// After an armed pass the ranks dropped, every rank: the parameters a failed rank sent a
    /// bucket from, for want of any other memory (`og_reducer_trashed`), restored. Each from
    /// the lowest rank that kept it; where every rank sent it for the same bucket, it holds
    /// the sum of their identical copies, divided by the world (exact at 2, 4, 8... ranks;
    /// within rounding, and the same on every rank, at others). One small all-reduce, and a
    /// broadcast per parameter restored.
    pub fn restore_trashed(&self, pg: &ProcessGroup, params: &[Tensor]) -> Result<()> {
        let n = self.sizes.len();
        let mut out = vec![0i64; 3 * n];
        let k = unsafe { og_reducer_trashed(self.ptr, out.as_mut_ptr(), n as i32) } as usize;
        let mine: Vec<Option<(i64, i64)>> = (0..n)
            .map(|i| {
                out[..3 * k]
                    .chunks(3)
                    .find(|t| t[0] == i as i64)
                    .map(|t| (t[1] + 1, t[2]))
            })
            .collect();
        let (rank, world) = (pg.rank as i64, pg.world as i64);
        // Per parameter, the ranks' least of: its bucket + 1 (0: kept), the same negated (the
        // most), and its rank where kept (else the world).
        let v: Vec<i64> = mine
            .iter()
            .flat_map(|m| match m {
                Some((b, _)) => [*b, -b, world],
                None => [0, 0, rank],
            })
            .collect();
        let t = Tensor::from_slice(&v)
            .f_to_device(pg.device())
            .map_err(torch_error("the parameters' restore"))?;
        pg.all_reduce(std::slice::from_ref(&t), super::Op::Min)?;
        let v = t
            .f_to_device(tch::Device::Cpu)
            .and_then(|t| Vec::<i64>::try_from(&t))
            .map_err(torch_error("the parameters' restore"))?;
        let _no_grad = tch::no_grad_guard();
        for (i, m) in v.chunks(3).enumerate() {
            let (least, most, root) = (m[0], -m[1], m[2]);
            if most == 0 {
                continue;
            }
            let Some(p) = params.get(i).map(Tensor::detach) else {
                return Err(Error::Dist(format!(
                    "parameter {i} to restore is not among the optimizer's"
                )));
            };
            if root < world {
                pg.broadcast(std::slice::from_ref(&p), root as usize)?;
            } else if least == most {
                let numel = mine[i].map_or(0, |(_, e)| e);
                p.f_view([-1])
                    .and_then(|f| f.f_narrow(0, 0, numel))
                    .and_then(|sent| crate::ops::mul_scalar_(&sent, 1.0 / world as f64))
                    .map_err(torch_error("the parameters' restore"))?;
            } else {
                return Err(Error::Dist(format!(
                    "parameter {i} was sent as a stand-in for different buckets on every rank (no memory for them) \
                     and no rank kept it: resume from the last checkpoint"
                )));
            }
        }
        if k > 0 {
            tracing::warn!("data parallel: {k} parameter(s) sent as a stand-in for want of memory, restored");
        }
        Ok(())
    }
}

/// Whether ZeRO-2 shards the gradients of parameters of these byte sizes, buckets of at most
/// `cap` bytes: only where backward can wait for its buckets, the gradients exceeding two of
/// the largest (as `oomguard plan` counts them). Otherwise they are whole at backward's end
/// whatever was sent, and a shard made beside them would hold more than dropping them frees
/// (a small model, or one that is mostly its tied embedding: a 2-layer GPT with a tied
/// vocabulary of 8192 peaked 0.85 MB above stage 1). There the sums stay the gradients and
/// the step reads this rank's pieces from them, as stage 1 does. Shapes alone decide, so
/// every rank takes the same path.
pub fn shards_gradients(sizes: impl Iterator<Item = usize>, cap: usize) -> bool {
    let (total, largest) = sizes.fold((0, cap), |(t, l), s| (t + s, l.max(s)));
    total > 2 * largest
}

/// Every parameter, last first: the order backward completes gradients in, before it is
/// observed.
fn reversed(n: usize) -> Vec<usize> {
    (0..n).rev().collect()
}

/// `first` with every other parameter of `n` after it, last first; each once.
fn complete(first: &[usize], n: usize) -> Vec<usize> {
    let mut seen = vec![false; n];
    let mut order: Vec<usize> = first
        .iter()
        .copied()
        .filter(|&i| i < n && !std::mem::replace(&mut seen[i], true))
        .collect();
    order.extend(reversed(n).into_iter().filter(|&i| !seen[i]));
    order
}

/// The buckets as csrc/overlap.cpp takes them: their members one after another, and where
/// each bucket starts (and the last ends).
fn flat(buckets: &[Vec<usize>]) -> (Vec<i64>, Vec<i64>) {
    let order = buckets.iter().flatten().map(|&i| i as i64).collect();
    let mut starts = vec![0i64];
    for b in buckets {
        starts.push(starts[starts.len() - 1] + b.len() as i64);
    }
    (order, starts)
}

/// The buckets, in the order they start: parameters in `order` (the order backward
/// completes their gradients, every parameter once), consecutive ones together while their
/// bytes stay within `cap` and they share a dtype and device (`sizes`: bytes and that key,
/// per parameter). A parameter over `cap` is a bucket alone. Every parameter is in exactly
/// one bucket.
pub fn layout<K: PartialEq>(order: &[usize], sizes: &[(usize, K)], cap: usize) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = vec![];
    let mut bytes = 0usize;
    for &i in order {
        let (size, key) = &sizes[i];
        let joins = buckets
            .last()
            .is_some_and(|b| bytes.saturating_add(*size) <= cap && sizes[b[0]].1 == *key);
        if !joins {
            buckets.push(vec![]);
            bytes = 0;
        }
        buckets.last_mut().expect("a bucket was just pushed").push(i);
        bytes += size;
    }
    buckets
}

/// Bytes an armed pass holds beyond the gradients: one shared bucket while it is made (its
/// gradients copied in, then freed). A failed rank's stand-ins come after its attempt's
/// memory is freed.
pub fn buffer_bytes<K: PartialEq>(sizes: &[(usize, K)], cap: usize) -> usize {
    layout(&reversed(sizes.len()), sizes, cap)
        .iter()
        .filter(|b| b.len() > 1)
        .map(|b| b.iter().map(|&i| sizes[i].0).sum::<usize>())
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::{bucket_bytes, complete, flat, layout, reversed};

    #[test]
    fn a_bucket_is_the_users_cap_or_a_small_share_of_a_fixed_budget() {
        let mib = 1usize << 20;
        assert_eq!(bucket_bytes(None, None), mib);
        assert_eq!(bucket_bytes(None, Some(80 << 30)), mib);
        assert_eq!(bucket_bytes(None, Some(128 << 20)), mib);
        assert_eq!(bucket_bytes(None, Some(32 << 20)), mib / 4);
        assert_eq!(bucket_bytes(None, Some(1 << 10)), 4 << 10);
        // The user's cap is kept, whatever the budget.
        assert_eq!(bucket_bytes(Some(4.0), Some(32 << 20)), 4 * mib);
        assert_eq!(bucket_bytes(Some(1e-9), None), 1);
    }

    #[test]
    fn the_first_order_names_each_parameter_once() {
        assert_eq!(complete(&[2, 0, 2, 9], 4), vec![2, 0, 3, 1]);
        assert_eq!(complete(&[], 3), reversed(3));
    }

    #[test]
    fn buckets_cover_every_parameter_once_in_order_within_the_cap() {
        let sizes: Vec<(usize, u8)> = [4, 4, 16, 4, 4, 4, 40, 4].iter().map(|&b| (b, 0)).collect();
        let b = layout(&reversed(8), &sizes, 12);
        assert_eq!(b, vec![vec![7], vec![6], vec![5, 4, 3], vec![2], vec![1, 0]]);
        assert_eq!(flat(&b).1, vec![0, 1, 2, 5, 6, 8]);
        let one = layout(&reversed(8), &sizes, usize::MAX);
        assert_eq!(one, vec![(0..8).rev().collect::<Vec<_>>()]);
        assert_eq!(layout(&reversed(8), &sizes, 1).len(), 8);
        let mixed = layout(&[2, 1, 0], &[(4, 'f'), (4, 'h'), (4, 'h')], 100);
        assert_eq!(mixed, vec![vec![2, 1], vec![0]]);
        // An observed order: the embedding (0) last, as backward reaches it.
        assert_eq!(
            layout(&[3, 1, 2, 0], &sizes[..4], 8),
            vec![vec![3, 1], vec![2], vec![0]]
        );
    }
}
