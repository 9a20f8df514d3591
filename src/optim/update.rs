//! Owns one optimizer step in two halves: `prepare` and `commit`.
//! Keeps: `prepare` makes every allocation and changes nothing; `commit` allocates nothing.
use std::ffi::{c_char, c_void};
use tch::{Kind, TchError, Tensor};

use super::slices::{self, PieceViews, Slice};
use super::zero::{gathers_in_shard, Buffers, GradShard, Layout, Shard, Zero};
use super::{ptrs, AdamW};
use crate::error::{Error, Result as OgResult};
use crate::memory::check;

extern "C" {
    fn og_adamw_commit(
        params: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        steps: *const *mut c_void,
        next_steps: *const *mut c_void,
        n: i32,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        found_inf: *mut c_void,
    ) -> *mut c_char;
    fn og_adamw_update(
        params: *const *mut c_void,
        grads: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        steps: *const *mut c_void,
        n: i32,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        found_inf: *mut c_void,
    ) -> *mut c_char;
}

/// A step's allocations, made before anything changes (`AdamW::prepare`).
pub struct Prepared {
    step: u64,
    next: Vec<Vec<Tensor>>,
    found_inf: Option<Tensor>,
    /// Sharded: what the all-gather of the updated parameters goes through.
    gather: Option<Gather>,
}

impl Prepared {
    /// The most elements per rank one collective of the all-gather can move here (`None`:
    /// nothing to agree on). The ranks take the least of theirs (`agree_gather`).
    pub fn gather_chunk(&self) -> Option<i64> {
        match &self.gather {
            Some(Gather::Buffers(_, l)) => Some(l.chunk),
            Some(Gather::Grads(spaces, l)) => Some(spaces[0].numel() as i64 / l.world as i64),
            _ => None,
        }
    }

    /// Stage 1 through the spent gradients: its chunks a step and their elements per rank.
    pub fn gathers_through_grads(&self) -> Option<(usize, i64)> {
        match &self.gather {
            Some(Gather::Grads(_, l)) => Some((l.chunks().len(), l.chunk)),
            _ => None,
        }
    }

    /// The chunk every rank can take (the least `gather_chunk` over the ranks): the ranks'
    /// all-gathers are then the same collectives, however each found its memory.
    pub fn agree_gather(&mut self, chunk: i64) {
        // Buffers hold `world x` their chunk: a smaller one agreed fits them too (stage 2's
        // segments may take one below the buffers' on another rank).
        if let Some(Gather::Grads(_, l) | Gather::Buffers(_, l)) = &mut self.gather {
            let chunk = chunk.clamp(1, l.shard.max(1));
            if l.chunk != chunk {
                *l = l.rechunked(chunk);
            }
        }
    }
}

/// The memory a sharded step's all-gather goes through, a chunk at a time.
enum Gather {
    /// Its own buffers (`world x chunk` and one chunk), by the optimizer's layout, or the
    /// smaller chunk the ranks agreed on.
    Buffers(Buffers, Layout),
    /// Stage 2: the gradient shard, whose values the update has used (`Zero::gather_in_grad`).
    Shard,
    /// Stage 1 (and stage 2's segments): the storages only the spent gradients hold (the
    /// reduction's buckets, large gradients), largest first, by a layout of chunks that fill
    /// the largest: fewer collectives, no buffers, and as many at once as the storages hold.
    Grads(Vec<Tensor>, Layout),
}

impl AdamW {
    /// Applies optimizer step `step` (once: a second call for the same step is refused):
    /// `prepare` then `commit`.
    pub fn step(&mut self, step: u64, lr: f64) -> OgResult<()> {
        let prepared = self.prepare(step, None)?;
        self.commit(prepared, lr)
    }

    /// The allocating half of a step, which changes nothing: the step counts after the
    /// update (unchanged where fp16's `found_inf` is 1: the update will be skipped, on the
    /// device). An OOM here leaves the optimizer exactly as it was.
    pub fn prepare(&self, step: u64, found_inf: Option<&Tensor>) -> OgResult<Prepared> {
        if self.last_step.is_some_and(|last| step <= last) {
            return Err(Error::Torch(TchError::Kind(format!(
                "optimizer step {step} was already applied (last: {:?})",
                self.last_step
            ))));
        }
        // Each count plus one; `commit` takes found_inf off in place. Not here: under ZeRO-2
        // the flag is this rank's own shard's until the ranks' MAX, which comes after.
        let next = self
            .groups
            .iter()
            .map(|g| {
                g.steps
                    .iter()
                    .map(|s| crate::ops::add_scalar(s, 1.0))
                    .collect::<Result<_, _>>()
            })
            .collect::<Result<_, TchError>>()?;
        let gather = self.zero.as_ref().map(|z| self.gather_through(z)).transpose()?;
        Ok(Prepared {
            step,
            next,
            found_inf: found_inf.map(Tensor::shallow_clone),
            gather,
        })
    }

    /// The half that changes the parameters, moments and step counts; it allocates nothing,
    /// so once begun it completes.
    pub fn commit(&mut self, prepared: Prepared, lr: f64) -> OgResult<()> {
        let Prepared {
            step,
            next,
            found_inf,
            gather,
        } = prepared;
        if let Some(f) = &found_inf {
            // A skipped update (the ranks' flag, now agreed) does not count: in place.
            for n in next.iter().flatten() {
                let _ = n.shallow_clone().f_sub_(f)?;
            }
        }
        let inf = found_inf
            .as_ref()
            .map_or(std::ptr::null_mut(), |f| f.as_ptr() as *mut c_void);
        if let Some(gather) = gather {
            // This rank's update, and every rank's updated shard to every rank. A failure
            // of a collective (a peer gone): the group restarts from the last checkpoint.
            self.commit_gathering(step, &next, inf, lr, &gather)?;
            self.last_step = Some(step);
            if let Some(z) = self.zero.as_mut() {
                z.grad = None;
            }
            return Ok(());
        }
        for (g, next) in self.groups.iter().zip(&next) {
            let n = g.params.len() as i32;
            let (p, m, v, s, ns) = (
                ptrs(&g.params),
                ptrs(&g.exp_avg),
                ptrs(&g.exp_avg_sq),
                ptrs(&g.steps),
                ptrs(next),
            );
            let done = check(unsafe {
                og_adamw_commit(
                    p.as_ptr(),
                    m.as_ptr(),
                    v.as_ptr(),
                    s.as_ptr(),
                    ns.as_ptr(),
                    n,
                    lr,
                    self.cfg.beta1,
                    self.cfg.beta2,
                    g.weight_decay,
                    self.cfg.eps,
                    inf,
                )
            });
            if let Err(e) = done {
                return Err(partial(step, e));
            }
        }
        self.last_step = Some(step);
        Ok(())
    }

    /// Where the all-gather will go, once the update has used the gradients: stage 2's shard,
    /// or the largest storage of whole gradients (stage 1, or stage 2 whose sums stayed
    /// whole: `Reducer::scatters`), where either takes no more collectives than the buffers
    /// (and `world` chunks fit); else buffers allocated here.
    fn gather_through(&self, z: &Zero) -> Result<Gather, TchError> {
        if z.gathers_in_grad() {
            return Ok(Gather::Shard);
        }
        if let Some(GradShard::Segments { segments, .. }) = &z.grad {
            // Stage 2's segments, largest first, by chunks that fill the largest: no buffers
            // beside them (the shard grew during backward, with none whole to go through).
            let mut spaces: Vec<Tensor> = segments.iter().map(Tensor::shallow_clone).collect();
            spaces.sort_by_key(|s| std::cmp::Reverse(s.numel()));
            let w = z.layout.world as i64;
            if let Some(numel) = spaces.first().map(|s| s.numel() as i64).filter(|&n| n >= w) {
                return Ok(Gather::Grads(spaces, z.layout.rechunked(numel / w)));
            }
        }
        if z.stage == Shard::Optimizer || z.grad.is_none() {
            let spaces = crate::memory::grads_scratch(&self.params())?;
            if let Some(numel) = spaces.first().map(|s| s.numel() as i64) {
                let l = z.layout.rechunked(numel / z.layout.world as i64);
                if gathers_in_shard(&z.layout, &l, numel) {
                    return Ok(Gather::Grads(spaces, l));
                }
            }
        }
        Buffers::new(&z.layout, Kind::Float, z.exp_avg.device()).map(|b| Gather::Buffers(b, z.layout.clone()))
    }

    /// This rank's update and the all-gather of every rank's updated parameters through
    /// `through`, in waves: the next chunks, each in the first of the spaces that holds it
    /// (`world x` its length). The update runs in slices that follow the chunks
    /// (`slices.rs`): a chunk is packed once the slices holding its elements, and those
    /// reading gradients where it will land, have run; its collective starts at once, and
    /// the next wave's slices update while it moves (Gloo's all-gather runs in the
    /// background). Each chunk is unpacked as it arrives; a rank's own segment is not (its
    /// parameters hold it). Every step count advances (the ranks count alike).
    fn commit_gathering(
        &self,
        step: u64,
        next: &[Vec<Tensor>],
        inf: *mut c_void,
        lr: f64,
        through: &Gather,
    ) -> OgResult<()> {
        let z = self.zero.as_ref().expect("sharded");
        let _no_grad = tch::no_grad_guard();
        for (g, next) in self.groups.iter().zip(next) {
            for (s, n) in g.steps.iter().zip(next) {
                s.shallow_clone().f_copy_(n).map_err(|e| partial(step, e))?;
            }
        }
        let flat = self.flat_params()?;
        let (l, spaces) = match (through, &z.grad) {
            (Gather::Buffers(b, l), _) => (l, vec![b.all.shallow_clone()]),
            (Gather::Grads(spaces, l), _) => (l, spaces.iter().map(Tensor::shallow_clone).collect()),
            (Gather::Shard, Some(g)) => (&z.gather_in_grad, g.parts()),
            (Gather::Shard, None) => return Err(Error::Dist("stage 2's all-gather found no gradient shard".into())),
        };
        let chunks = l.chunks();
        let slices = self.slices(z, &chunks, l.chunk).map_err(|e| partial(step, e))?;
        // The spaces this rank's update does not read first (stage 1: the gradients of the
        // other ranks' shards): a chunk landing there waits for no slice but its own. Each
        // rank places its chunks in its own memory; the collectives stay the same.
        let mut spaces = spaces
            .into_iter()
            .map(|s| {
                let bytes = slices::span(&s)?;
                Ok((slices.iter().any(|x| x.reads_in(&bytes)), s))
            })
            .collect::<Result<Vec<_>, TchError>>()?;
        spaces.sort_by_key(|(read, _)| *read);
        let spaces: Vec<Tensor> = spaces.into_iter().map(|(_, s)| s).collect();
        let mut done = vec![false; slices.len()];
        let mut update = |js: &mut dyn Iterator<Item = usize>| -> OgResult<()> {
            for j in js {
                if !std::mem::replace(&mut done[j], true) {
                    self.update_slice(&slices[j], inf, lr).map_err(|e| partial(step, e))?;
                }
            }
            Ok(())
        };
        let w = l.world as i64;
        let mut order = chunks.iter().copied().enumerate().peekable();
        while order.peek().is_some() {
            let mut wave = Vec::new();
            for space in &spaces {
                if let Some((k, c)) = order.next_if(|(_, c)| w * c.1 <= space.numel() as i64) {
                    let all = space.f_narrow(0, 0, w * c.1)?;
                    let lands = slices::span(&all)?;
                    update(&mut slices::needed(&slices, k, c).into_iter())?;
                    update(&mut (0..slices.len()).filter(|&j| slices[j].reads_in(&lands)))?;
                    // This rank's part in its place: the collective sends it from there.
                    let own = all.f_narrow(0, l.rank as i64 * c.1, c.1)?;
                    l.pack(&flat, l.rank as i64 * l.shard + c.0, &own)?;
                    wave.push((c, z.comm.all_gather_start(&own, &all)?, all));
                }
            }
            if wave.is_empty() {
                return Err(Error::Dist("the all-gather's chunk fits none of its spaces".into()));
            }
            // While it moves: the slices the next wave packs. None reads where this one lands.
            let ahead: Vec<_> = order.clone().take(spaces.len()).collect();
            update(&mut ahead.into_iter().flat_map(|(k, c)| slices::needed(&slices, k, c)))?;
            for (c, moving, all) in wave {
                moving.wait()?;
                l.unpack_others(&all, c, &flat)?;
            }
        }
        update(&mut (0..slices.len()))
    }

    /// This rank's pieces cut into the slices of `chunks` (`slices.rs`).
    fn slices(&self, z: &Zero, chunks: &[(i64, i64)], chunk: i64) -> Result<Vec<Slice>, TchError> {
        let index = self.index();
        slices::slices(&z.pieces, chunks, chunk, |k, from, len| {
            let piece = &z.pieces[k];
            let (gi, i) = index[piece.param];
            let param = &self.groups[gi].params[i];
            let grad = match &z.grad {
                Some(grad) => grad.piece(k, piece)?,
                None => param.grad().f_view([-1])?.f_narrow(0, piece.at, piece.len)?,
            };
            Ok(PieceViews {
                group: gi,
                tensors: [
                    param.f_view([-1])?.f_narrow(0, piece.at + from, len)?,
                    grad.f_narrow(0, from, len)?,
                    z.exp_avg.f_narrow(0, piece.in_shard + from, len)?,
                    z.exp_avg_sq.f_narrow(0, piece.in_shard + from, len)?,
                    self.groups[gi].steps[i].shallow_clone(),
                ],
            })
        })
    }

    /// The fused kernel over one slice, a call per parameter group.
    fn update_slice(&self, slice: &Slice, inf: *mut c_void, lr: f64) -> Result<(), TchError> {
        for (g, [p, gr, m, v, s]) in self.groups.iter().zip(&slice.groups) {
            if p.is_empty() {
                continue;
            }
            let (p, gr, m, v, s) = (ptrs(p), ptrs(gr), ptrs(m), ptrs(v), ptrs(s));
            check(unsafe {
                og_adamw_update(
                    p.as_ptr(),
                    gr.as_ptr(),
                    m.as_ptr(),
                    v.as_ptr(),
                    s.as_ptr(),
                    p.len() as i32,
                    lr,
                    self.cfg.beta1,
                    self.cfg.beta2,
                    g.weight_decay,
                    self.cfg.eps,
                    inf,
                )
            })?;
        }
        Ok(())
    }
}

/// A commit that failed part-way: never retried (it is not an OOM to the guard).
fn partial(step: u64, e: impl std::fmt::Display) -> Error {
    Error::PartialUpdate(format!(
        "the optimizer update of step {step} failed part-way ({e}); the parameters may be partly updated, so the run stops here: resume from the last \
            checkpoint"
    ))
}

#[cfg(test)]
mod tests {
    use super::super::zero::Piece;
    use super::*;

    /// The fused kernel over `pieces` of one flat parameter, `steps` times: by slices of
    /// `chunk` (`slices.rs`), or whole (`chunk` None). Returns parameter and moments.
    fn adamw(pieces: &[(i64, i64)], chunk: Option<i64>, steps: i64) -> [Tensor; 3] {
        let total: i64 = pieces.iter().map(|p| p.1).sum();
        tch::manual_seed(3);
        let opts = (Kind::Float, tch::Device::Cpu);
        let [p, m, v] = [0.0, 0.0, 0.0].map(|_| Tensor::randn([total], opts));
        let v = v.abs() * 1e-3;
        let g = Tensor::randn([steps, total], opts) * 10.0;
        let ps: Vec<Piece> = pieces
            .iter()
            .enumerate()
            .map(|(param, &(in_shard, len))| Piece {
                param,
                at: 0,
                len,
                in_shard,
            })
            .collect();
        for s in 1..=steps {
            let count = Tensor::from(s as f32);
            let grad = g.get(s - 1);
            let view = |k: usize, from: i64, len: i64| {
                let at = ps[k].in_shard + from;
                Ok(PieceViews {
                    group: 0,
                    tensors: [&p, &grad, &m, &v]
                        .map(|t| t.narrow(0, at, len))
                        .into_iter()
                        .chain([count.shallow_clone()])
                        .collect::<Vec<_>>()
                        .try_into()
                        .unwrap(),
                })
            };
            let cut: Vec<Slice> = match chunk {
                Some(c) => {
                    let chunks: Vec<_> = (0..total).step_by(c as usize).map(|s| (s, c.min(total - s))).collect();
                    slices::slices(&ps, &chunks, c, view).unwrap()
                }
                None => slices::slices(&ps, &[(0, total)], total, view).unwrap(),
            };
            for slice in &cut {
                for [p, g, m, v, s] in &slice.groups {
                    let (p, g, m, v, s) = (ptrs(p), ptrs(g), ptrs(m), ptrs(v), ptrs(s));
                    check(unsafe {
                        og_adamw_update(
                            p.as_ptr(),
                            g.as_ptr(),
                            m.as_ptr(),
                            v.as_ptr(),
                            s.as_ptr(),
                            p.len() as i32,
                            1e-3,
                            0.9,
                            0.95,
                            0.1,
                            1e-8,
                            std::ptr::null_mut(),
                        )
                    })
                    .unwrap();
                }
            }
        }
        [p, m, v]
    }

    #[test]
    fn a_sliced_update_is_bitwise_the_whole_one() {
        let _t = tch::no_grad_guard();
        let pieces = [(0, 10007), (10007, 37), (10044, 3001), (13045, 1)];
        let whole = adamw(&pieces, None, 3);
        for chunk in [1, 7, 100, 301, 4096, 20000] {
            let sliced = adamw(&pieces, Some(chunk), 3);
            for (a, b) in whole.iter().zip(&sliced) {
                assert!(
                    a.equal(b),
                    "chunk {chunk}: differs by {}",
                    f64::try_from((a - b).abs().max()).unwrap()
                );
            }
        }
    }
}
