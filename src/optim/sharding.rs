//! Owns AdamW's moments sharded across data-parallel ranks (ZeRO-1/2), and gathered back.
//! Keeps: each change of layout is agreed by every rank first.
use std::rc::Rc;
use tch::{Kind, TchError, Tensor};

use super::zero::{Buffers, GradShard, Layout, Zero};
use super::{groups, AdamW, Comm, Group, OptimConfig, Shard};
use crate::error::{Error, Result as OgResult};
use crate::memory::clear_grad;

impl AdamW {
    /// `new` with the moments sharded from the start (`Shard::None`: `new`), so that the
    /// whole state is never allocated on one rank.
    pub fn sharded(
        params: Vec<(String, Tensor)>,
        cfg: &OptimConfig,
        no_decay: impl Fn(&str, &Tensor) -> bool,
        stage: Shard,
        comm: Option<Rc<dyn Comm>>,
    ) -> OgResult<AdamW> {
        let (Some(comm), true) = (comm, stage != Shard::None) else {
            return Ok(AdamW::new(params, cfg, no_decay)?);
        };
        // Groups without moments first, then the shard's.
        let mut opt = AdamW {
            groups: groups(params, cfg, no_decay, false)?,
            cfg: cfg.clone(),
            last_step: None,
            zero: None,
        };
        opt.zero = Some(opt.new_zero(stage, comm, true)?);
        Ok(opt)
    }

    /// An empty shard of the moments for this layout (zeros: a fresh state).
    fn new_zero(&self, stage: Shard, comm: Rc<dyn Comm>, fresh: bool) -> OgResult<Zero> {
        let params: Vec<&Tensor> = self.all_params().collect();
        if let Some(p) = params.iter().find(|p| p.kind() != Kind::Float) {
            return Err(Error::Torch(TchError::Kind(format!(
                "sharding needs fp32 parameters; this model has a {:?} one",
                p.kind()
            ))));
        }
        let numels: Vec<i64> = params.iter().map(|p| p.numel() as i64).collect();
        let layout = Layout::new(&numels, comm.rank(), comm.world(), super::zero::BUCKET_BYTES / 4);
        let device = params.first().map_or(tch::Device::Cpu, |p| p.device());
        let zeros = |n: i64| Tensor::f_zeros([n], (Kind::Float, device));
        // A fresh state's shards; empty when `set_shard` fills them from whole moments.
        let n = if fresh { layout.shard } else { 0 };
        let world = comm.world() as i64;
        let gather_in_grad = Layout::with_chunk(&numels, comm.rank(), comm.world(), layout.shard / world);
        Ok(Zero {
            stage,
            gather_in_grad,
            pieces: layout.pieces(),
            exp_avg: zeros(n)?,
            exp_avg_sq: zeros(n)?,
            layout,
            comm,
            grad: None,
            restored: None,
            clip: None,
        })
    }

    /// Stage 2: the reduce-scatter's buffers and the gradient shard it fills, allocated
    /// before the ranks agree (`None` unless sharding gradients).
    pub fn scatter_buffers(&self) -> Result<Option<(Buffers, Tensor)>, TchError> {
        let Some(z) = self.zero.as_ref().filter(|z| z.stage == Shard::Gradients) else {
            return Ok(None);
        };
        let device = z.exp_avg.device();
        Ok(Some((
            Buffers::new(&z.layout, Kind::Float, device)?,
            Tensor::f_zeros([z.layout.shard], (Kind::Float, device))?,
        )))
    }

    /// Stage 2, overlapped with backward (src/dist/overlap.rs): this rank's pieces of its
    /// shard of the summed gradients, as `[parameter, where in it, how long]`.
    pub fn scatter_target(&self) -> Option<Vec<[i64; 3]>> {
        let z = self.zero.as_ref().filter(|z| z.stage == Shard::Gradients)?;
        Some(z.pieces.iter().map(|p| [p.param as i64, p.at, p.len]).collect())
    }

    /// Stage 2: the segments the overlapped reduction filled become the step's gradients
    /// (each piece a view of its segment); any whole gradient left goes.
    pub fn take_scattered(&mut self, s: crate::dist::Segments) -> Result<(), TchError> {
        if let Some(z) = self.zero.as_mut() {
            let lens: Vec<i64> = z.pieces.iter().map(|p| p.len).collect();
            let view = |(seg, at, len): (usize, i64, i64)| match s.segments.get(seg) {
                Some(t) => t.f_narrow(0, at, len),
                None => Err(TchError::Kind(format!("stage 2's gradient shard has no segment {seg}"))),
            };
            let pieces = s.at.iter().zip(&lens).map(|(&(seg, at), &len)| view((seg, at, len)));
            let pieces = pieces.collect::<Result<_, _>>()?;
            let parts = runs(&s.at, &lens).into_iter().map(view).collect::<Result<_, _>>()?;
            z.grad = Some(GradShard::Segments {
                segments: s.segments,
                pieces,
                parts,
            });
        }
        self.all_params().for_each(clear_grad);
        Ok(())
    }

    /// Stage 2: sums the ranks' gradients into this rank's shard, a chunk at a time, then
    /// drops the full gradients (the memory stage 2 saves).
    pub fn reduce_scatter_grads(&mut self, (bufs, grad): (Buffers, Tensor)) -> OgResult<()> {
        let flat: Vec<Tensor> = self
            .all_params()
            .map(|p| p.grad().f_view([-1]))
            .collect::<Result<_, _>>()?;
        let z = self.zero.as_mut().expect("stage 2");
        let w = z.layout.world as i64;
        for c in z.layout.chunks() {
            let all = bufs.all.f_narrow(0, 0, w * c.1)?;
            z.layout.pack_all(&flat, c, &all)?;
            z.comm.reduce_scatter(&all, &grad.f_narrow(0, c.0, c.1)?)?;
        }
        drop(flat);
        z.grad = Some(GradShard::Flat(grad));
        self.all_params().for_each(clear_grad);
        Ok(())
    }

    /// Changes what is sharded, all ranks together (a rung climbed, or come back down).
    /// Every allocation comes first, then `agree` (the ranks' outcomes: an OOM anywhere is
    /// an OOM everywhere), then the collectives: an OOM leaves the optimizer as it was.
    pub fn set_shard(&mut self, stage: Shard, comm: Option<Rc<dyn Comm>>, agree: &Agreed) -> OgResult<()> {
        let _no_grad = tch::no_grad_guard();
        match (self.zero.as_mut(), stage) {
            (None, Shard::None) => Ok(()),
            (Some(z), s) if s != Shard::None => {
                z.stage = s;
                if s != Shard::Gradients {
                    z.grad = None;
                }
                Ok(())
            }
            (None, s) => {
                let comm =
                    comm.ok_or_else(|| Error::Torch(TchError::Kind("sharding needs a data-parallel group".into())))?;
                let mut z = agreed(agree, self.new_zero(s, comm, false))?;
                // One moment at a time: its shard is allocated (agreed), filled, and its whole
                // tensors freed before the next one's, so that the climb's peak holds half a
                // shard-set more than the state, not a whole one: a rank whose state alone
                // leaves less than one shard free can still climb.
                let (n, device) = (z.layout.shard, z.exp_avg.device());
                let zeros = || Tensor::f_zeros([n], (Kind::Float, device)).map_err(Error::from);
                let avg = agreed(agree, zeros())?;
                self.fill_shard(&z, &avg, |g| &mut g.exp_avg)?;
                z.exp_avg = avg;
                match agreed(agree, zeros()) {
                    Ok(sq) => {
                        self.fill_shard(&z, &sq, |g| &mut g.exp_avg_sq)?;
                        z.exp_avg_sq = sq;
                        self.zero = Some(z);
                        Ok(())
                    }
                    Err(e) => {
                        // Half-way: the first moment comes back whole, as before the climb.
                        self.unshard_avg(&z, agree).map_err(|u| {
                            Error::Torch(TchError::Kind(format!(
                                "sharding AdamW's state failed half-way ({e}) and could not be undone ({u})"
                            )))
                        })?;
                        Err(e)
                    }
                }
            }
            (Some(_), _) => {
                // Back to whole moments on every rank: gathered, chunk by chunk.
                let z = self.zero.as_ref().expect("sharded");
                let zeros = |p: &Tensor| p.f_zeros_like();
                let (m, v, b) = agreed(
                    agree,
                    (|| {
                        let m: Vec<Tensor> = self.all_params().map(zeros).collect::<Result<_, _>>()?;
                        let v: Vec<Tensor> = self.all_params().map(zeros).collect::<Result<_, _>>()?;
                        Ok((m, v, Buffers::new(&z.layout, Kind::Float, z.exp_avg.device())?))
                    })(),
                )?;
                for (shard, full) in [(&z.exp_avg, &m), (&z.exp_avg_sq, &v)] {
                    let flat: Vec<Tensor> = full.iter().map(|t| t.f_view([-1])).collect::<Result<_, _>>()?;
                    gather_into(z, &b, shard, &flat)?;
                }
                let (mut m, mut v) = (m.into_iter(), v.into_iter());
                for g in &mut self.groups {
                    g.exp_avg = m.by_ref().take(g.params.len()).collect();
                    g.exp_avg_sq = v.by_ref().take(g.params.len()).collect();
                }
                self.zero = None;
                Ok(())
            }
        }
    }

    /// This rank's pieces of one whole moment into `shard`; the whole tensors are freed.
    fn fill_shard(
        &mut self,
        z: &Zero,
        shard: &Tensor,
        moment: impl Fn(&mut Group) -> &mut Vec<Tensor>,
    ) -> OgResult<()> {
        let index = self.index();
        for p in &z.pieces {
            let (g, i) = index[p.param];
            let full = &moment(&mut self.groups[g])[i];
            shard
                .f_narrow(0, p.in_shard, p.len)?
                .f_copy_(&full.f_view([-1])?.f_narrow(0, p.at, p.len)?)?;
        }
        for g in &mut self.groups {
            moment(g).clear();
        }
        Ok(())
    }

    /// A climb that failed half-way: the first moment gathered back whole (every rank
    /// takes part; the allocation is agreed).
    fn unshard_avg(&mut self, z: &Zero, agree: &Agreed) -> OgResult<()> {
        let (m, b) = agreed(
            agree,
            (|| {
                let m: Vec<Tensor> = self.all_params().map(|p| p.f_zeros_like()).collect::<Result<_, _>>()?;
                Ok((m, Buffers::new(&z.layout, Kind::Float, z.exp_avg.device())?))
            })(),
        )?;
        let flat: Vec<Tensor> = m.iter().map(|t| t.f_view([-1])).collect::<Result<_, _>>()?;
        gather_into(z, &b, &z.exp_avg, &flat)?;
        let mut m = m.into_iter();
        for g in &mut self.groups {
            g.exp_avg = m.by_ref().take(g.params.len()).collect();
        }
        Ok(())
    }
}

/// The ranks' agreement on an outcome (`ProcessGroup::agree`): every rank returns the same.
pub type Agreed<'a> = dyn Fn(OgResult<()>) -> OgResult<()> + 'a;

/// `r`, agreed: a failure on any rank fails every rank alike.
pub(super) fn agreed<T>(agree: &Agreed, r: OgResult<T>) -> OgResult<T> {
    match r {
        Ok(v) => agree(Ok(())).map(|()| v),
        Err(e) => Err(agree(Err(e))
            .err()
            .unwrap_or_else(|| Error::Dist("an agreement on a failure came back as a success".into()))),
    }
}

/// The sharded moments' values into whole flat tensors (one per parameter), chunk by chunk.
pub(super) fn gather_into(z: &Zero, b: &Buffers, shard: &Tensor, flat: &[Tensor]) -> OgResult<()> {
    let w = z.layout.world as i64;
    for c in z.layout.chunks() {
        let all = b.all.f_narrow(0, 0, w * c.1)?;
        z.comm
            .all_gather(&[(shard.f_narrow(0, c.0, c.1)?, all.shallow_clone())])?;
        z.layout.unpack_all(&all, c, flat)?;
    }
    Ok(())
}

/// Pieces `(segment, where in it)` of `lens` elements, as runs `(segment, where, length)`:
/// those that follow each other in a segment merged, each element once.
fn runs(at: &[(usize, i64)], lens: &[i64]) -> Vec<(usize, i64, i64)> {
    let mut pieces: Vec<(usize, i64, i64)> = at.iter().zip(lens).map(|(&(s, a), &n)| (s, a, n)).collect();
    pieces.sort_unstable();
    let mut out: Vec<(usize, i64, i64)> = Vec::with_capacity(pieces.len());
    for (s, a, n) in pieces {
        match out.last_mut() {
            Some(last) if last.0 == s && last.1 + last.2 == a => last.2 += n,
            _ => out.push((s, a, n)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn pieces_that_follow_each_other_in_a_segment_merge() {
        // Segment 0: [0, 4) and [4, 6) follow each other, [8, 9) does not; segment 1 alone.
        let at = [(0, 4), (1, 0), (0, 0), (0, 8)];
        let lens = [2, 5, 4, 1];
        assert_eq!(runs(&at, &lens), vec![(0, 0, 6), (0, 8, 1), (1, 0, 5)]);
        assert_eq!(runs(&[], &[]), vec![]);
    }
}
