//! Owns the optimizer state: its size, its names, gathering and restoring it.
//! Keeps: a checkpoint holds the whole state, gathered when sharded.
use tch::{Kind, TchError, Tensor};

use super::sharding::{agreed, gather_into, Agreed};
use super::zero::Buffers;
use super::AdamW;
use crate::error::{Error, Result as OgResult};

/// A gathered copy of the optimizer state in host memory (a sharded optimizer's checkpoint:
/// one format whatever the sharding), outside the device's budget as it would be on a GPU.
pub struct FullState {
    pub tensors: Vec<(String, Tensor)>,
    /// The host memory the tensors of a gathered state view.
    _host: Vec<Vec<f32>>,
}

impl AdamW {
    /// Bytes of AdamW's moments this process holds.
    pub fn state_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        match &self.zero {
            Some(z) => bytes(&z.exp_avg) + bytes(&z.exp_avg_sq),
            None => self
                .groups
                .iter()
                .flat_map(|g| g.exp_avg.iter().chain(&g.exp_avg_sq))
                .map(bytes)
                .sum(),
        }
    }

    /// The whole state as `state()` names it, whatever the sharding: a sharded one is
    /// gathered into host memory (every rank takes part; all get the copy; the buffer's
    /// allocation is agreed before the collectives).
    pub fn full_state(&self, agree: &Agreed) -> OgResult<FullState> {
        let Some(z) = &self.zero else {
            return Ok(FullState {
                tensors: self.state().into_iter().map(|(n, t)| (n, t.shallow_clone())).collect(),
                _host: Vec::new(),
            });
        };
        let _no_grad = tch::no_grad_guard();
        let mut host: Vec<Vec<f32>> = Vec::new();
        let mut views = |p: &Tensor| {
            let mut buf = vec![0f32; p.numel()];
            // SAFETY: `buf` lives in `FullState::_host` as long as the tensor viewing it; a
            // Vec's heap block does not move when the Vec is moved.
            let t = unsafe {
                Tensor::f_from_blob(
                    buf.as_mut_ptr() as *const u8,
                    &p.size(),
                    &[],
                    Kind::Float,
                    tch::Device::Cpu,
                )
            };
            host.push(buf);
            t
        };
        let m: Vec<Tensor> = self.all_params().map(&mut views).collect::<Result<_, _>>()?;
        let v: Vec<Tensor> = self.all_params().map(&mut views).collect::<Result<_, _>>()?;
        let b = agreed(
            agree,
            Buffers::new(&z.layout, Kind::Float, z.exp_avg.device()).map_err(Error::from),
        )?;
        for (shard, full) in [(&z.exp_avg, &m), (&z.exp_avg_sq, &v)] {
            let flat: Vec<Tensor> = full.iter().map(|t| t.f_view([-1])).collect::<Result<_, _>>()?;
            gather_into(z, &b, shard, &flat)?;
        }
        let mut tensors = Vec::new();
        let (mut m, mut v) = (m.into_iter(), v.into_iter());
        for g in &self.groups {
            for (i, name) in g.names.iter().enumerate() {
                tensors.push((format!("{name}.exp_avg"), m.next().expect("one per parameter")));
                tensors.push((format!("{name}.exp_avg_sq"), v.next().expect("one per parameter")));
                tensors.push((format!("{name}.step"), g.steps[i].shallow_clone()));
            }
        }
        Ok(FullState { tensors, _host: host })
    }

    /// The moment buffers and step counts, named `<parameter>.exp_avg|exp_avg_sq|step`.
    /// Sharded: this rank's two moment shards (`zero.exp_avg`, `zero.exp_avg_sq`) and the
    /// step counts; `full_state` has them under the parameters' names.
    pub fn state(&self) -> Vec<(String, &Tensor)> {
        let mut out = Vec::new();
        if let Some(z) = &self.zero {
            out.push(("zero.exp_avg".to_string(), &z.exp_avg));
            out.push(("zero.exp_avg_sq".to_string(), &z.exp_avg_sq));
            for g in &self.groups {
                for (i, name) in g.names.iter().enumerate() {
                    out.push((format!("{name}.step"), &g.steps[i]));
                }
            }
            return out;
        }
        for g in &self.groups {
            for (i, name) in g.names.iter().enumerate() {
                out.push((format!("{name}.exp_avg"), &g.exp_avg[i]));
                out.push((format!("{name}.exp_avg_sq"), &g.exp_avg_sq[i]));
                out.push((format!("{name}.step"), &g.steps[i]));
            }
        }
        out
    }

    /// Copies a saved `state()` back in; every entry must be present with its shape.
    /// Sharded: the whole saved state is checked and kept until `share_restored`, which
    /// every rank calls, hands each its part.
    pub fn load_state(&mut self, saved: &[(String, Tensor)]) -> Result<(), TchError> {
        self.last_step = None;
        let by_name: std::collections::HashMap<&str, &Tensor> = saved.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let _no_grad = tch::no_grad_guard();
        if self.zero.is_some() {
            for g in &self.groups {
                for (name, p) in g.names.iter().zip(&g.params) {
                    for (key, shape) in [("exp_avg", p.size()), ("exp_avg_sq", p.size()), ("step", vec![])] {
                        let k = format!("{name}.{key}");
                        let src = by_name
                            .get(k.as_str())
                            .ok_or_else(|| TchError::FileFormat(format!("optimizer state has no `{k}`")))?;
                        if src.size() != shape {
                            return Err(TchError::Shape(format!(
                                "optimizer state `{k}` has shape {:?}, expected {shape:?}",
                                src.size()
                            )));
                        }
                    }
                }
            }
            if let Some(z) = self.zero.as_mut() {
                z.restored = Some(saved.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect());
            }
            return Ok(());
        }
        let saved = by_name;
        for (name, t) in self.state() {
            let src = saved
                .get(name.as_str())
                .ok_or_else(|| TchError::FileFormat(format!("optimizer state has no `{name}`")))?;
            if src.size() != t.size() {
                return Err(TchError::Shape(format!(
                    "optimizer state `{name}` has shape {:?}, expected {:?}",
                    src.size(),
                    t.size()
                )));
            }
            t.shallow_clone().f_copy_(src)?;
        }
        Ok(())
    }

    /// Sharded, after a resume: rank 0's restored state (`load_state`) to every rank, a
    /// parameter at a time, each keeping its pieces. Every rank calls it.
    pub fn share_restored(&mut self, agree: &Agreed) -> OgResult<()> {
        let Some(z) = self.zero.as_mut() else { return Ok(()) };
        let restored = z.restored.take();
        let z = self.zero.as_ref().expect("sharded");
        let by_name: std::collections::HashMap<String, Tensor> = restored.unwrap_or_default().into_iter().collect();
        let _no_grad = tch::no_grad_guard();
        let index = self.index();
        // One buffer for the largest parameter, agreed before the broadcasts.
        let largest = self.all_params().map(|p| p.numel() as i64).max().unwrap_or(0);
        let device = z.exp_avg.device();
        let tmp = agreed(
            agree,
            Tensor::f_zeros([largest], (Kind::Float, device)).map_err(Error::from),
        )?;
        let mut pieces = z.pieces.iter().peekable();
        for (flat_i, &(g, i)) in index.iter().enumerate() {
            let (name, p) = (&self.groups[g].names[i], &self.groups[g].params[i]);
            let piece = pieces.next_if(|pc| pc.param == flat_i);
            for (key, shard) in [("exp_avg", &z.exp_avg), ("exp_avg_sq", &z.exp_avg_sq)] {
                let full = tmp.f_narrow(0, 0, p.numel() as i64)?.f_view(p.size().as_slice())?;
                if let Some(t) = by_name.get(&format!("{name}.{key}")) {
                    full.shallow_clone().f_copy_(t)?;
                }
                z.comm.broadcast(&full, 0)?;
                if let Some(pc) = piece {
                    shard
                        .f_narrow(0, pc.in_shard, pc.len)?
                        .f_copy_(&full.f_view([-1])?.f_narrow(0, pc.at, pc.len)?)?;
                }
            }
            let step = &self.groups[g].steps[i];
            if let Some(t) = by_name.get(&format!("{name}.step")) {
                step.shallow_clone().f_copy_(t)?;
            }
            z.comm.broadcast(step, 0)?;
        }
        Ok(())
    }
}
