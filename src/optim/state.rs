//! Owns the optimizer state: its size, its names, saving and restoring it (a sharded one
//! shard by shard).
//! Keeps: no rank gathers the whole of a sharded state: each writes and reads its own shard.
use std::collections::BTreeMap;
use std::path::Path;
use tch::{Kind, TchError, Tensor};

use super::sharding::{agreed, Agreed};
use super::AdamW;
use crate::checkpoint::shards::{self, Reader, MOMENTS};
use crate::checkpoint::{FileSum, ShardLayout};
use crate::error::{Error, Result as OgResult};

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

    /// This rank's shard of the moments as a shard file (`shards::write`): the file's
    /// size and CRC32. Sharded only.
    pub fn write_shard(&self, path: &Path) -> OgResult<FileSum> {
        let z = self
            .zero
            .as_ref()
            .ok_or_else(|| Error::Data("write_shard: the optimizer is not sharded".into()))?;
        let l = &z.layout;
        let meta = BTreeMap::from([
            ("rank".to_string(), l.rank.to_string()),
            ("world".to_string(), l.world.to_string()),
            ("shard".to_string(), l.shard.to_string()),
            ("total".to_string(), l.total.to_string()),
        ]);
        shards::write(path, &[(MOMENTS[0], &z.exp_avg), (MOMENTS[1], &z.exp_avg_sq)], &meta)
    }

    /// The layout a sharded checkpoint of this optimizer records (`None` unsharded).
    pub fn shard_layout(&self) -> Option<ShardLayout> {
        self.zero.as_ref().map(|z| ShardLayout {
            world: z.layout.world,
            shard: z.layout.shard,
            total: z.layout.total,
        })
    }

    /// Sharded, from a sharded checkpoint: this rank's new shard read from the old files'
    /// overlapping ranges, a chunk at a time (every rank calls it; any world size).
    pub fn load_own_shard(&mut self, shards: &mut Reader) -> OgResult<()> {
        self.check_total(shards)?;
        let Some(z) = self.zero.as_ref() else { return Ok(()) };
        let lo = z.layout.rank as i64 * z.layout.shard;
        shards.fill(MOMENTS[0], lo, &z.exp_avg)?;
        shards.fill(MOMENTS[1], lo, &z.exp_avg_sq)
    }

    /// A sharded checkpoint cut the same flat space: the same parameters, in the same order.
    fn check_total(&self, shards: &Reader) -> OgResult<()> {
        let total: i64 = self.all_params().map(|p| p.numel() as i64).sum();
        if shards.layout.total != total {
            return Err(Error::Checkpoint(format!(
                "{}: its optimizer shards hold {} values per moment, this model has {total} parameters",
                shards.dir.join("state.json").display(),
                shards.layout.total
            )));
        }
        Ok(())
    }

    /// The moment buffers and step counts, named `<parameter>.exp_avg|exp_avg_sq|step`.
    /// Sharded: this rank's two moment shards (`zero.exp_avg`, `zero.exp_avg_sq`) and the
    /// step counts.
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
    /// `shards`: a sharded checkpoint's moments (its `saved` then holds only the step
    /// counts); an unsharded optimizer reads all of them, a chunk at a time, and a sharded one
    /// none (`load_own_shard`, on every rank). Sharded: the saved state is checked and kept
    /// until `share_restored`, which every rank calls, hands each its part.
    pub fn load_state(&mut self, saved: &[(String, Tensor)], shards: Option<&mut Reader>) -> OgResult<()> {
        self.last_step = None;
        let by_name: std::collections::HashMap<&str, &Tensor> = saved.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let _no_grad = tch::no_grad_guard();
        let moments: &[&str] = if shards.is_some() {
            &[]
        } else {
            &["exp_avg", "exp_avg_sq"]
        };
        if let Some(s) = &shards {
            self.check_total(s)?;
        }
        if self.zero.is_some() {
            for g in &self.groups {
                for (name, p) in g.names.iter().zip(&g.params) {
                    for key in moments.iter().copied().chain(["step"]) {
                        let shape = if key == "step" { vec![] } else { p.size() };
                        saved_entry(&by_name, &format!("{name}.{key}"), &shape)?;
                    }
                }
            }
            if let Some(z) = self.zero.as_mut() {
                z.restored = Some(saved.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect());
            }
            return Ok(());
        }
        for (name, t) in self.state() {
            if moments.is_empty() && !name.ends_with(".step") {
                continue;
            }
            t.shallow_clone().f_copy_(saved_entry(&by_name, &name, &t.size())?)?;
        }
        let Some(shards) = shards else { return Ok(()) };
        let mut lo = 0;
        for g in &self.groups {
            for (i, p) in g.params.iter().enumerate() {
                shards.fill(MOMENTS[0], lo, &g.exp_avg[i].f_view([-1])?)?;
                shards.fill(MOMENTS[1], lo, &g.exp_avg_sq[i].f_view([-1])?)?;
                lo += p.numel() as i64;
            }
        }
        Ok(())
    }

    /// Sharded, after a resume: rank 0's restored state (`load_state`) to every rank, a
    /// parameter at a time, each keeping its pieces. Every rank calls it. `moments`: false
    /// when each rank read its own from a sharded checkpoint: then only the step counts go.
    pub fn share_restored(&mut self, agree: &Agreed, moments: bool) -> OgResult<()> {
        let Some(z) = self.zero.as_mut() else { return Ok(()) };
        let restored = z.restored.take();
        let z = self.zero.as_ref().expect("sharded");
        let by_name: std::collections::HashMap<String, Tensor> = restored.unwrap_or_default().into_iter().collect();
        let _no_grad = tch::no_grad_guard();
        let index = self.index();
        // One buffer for the largest parameter, agreed before the broadcasts.
        let largest = match moments {
            true => self.all_params().map(|p| p.numel() as i64).max().unwrap_or(0),
            false => 0,
        };
        let device = z.exp_avg.device();
        let tmp = agreed(
            agree,
            Tensor::f_zeros([largest], (Kind::Float, device)).map_err(Error::from),
        )?;
        let mut pieces = z.pieces.iter().peekable();
        for (flat_i, &(g, i)) in index.iter().enumerate() {
            let (name, p) = (&self.groups[g].names[i], &self.groups[g].params[i]);
            let piece = pieces.next_if(|pc| pc.param == flat_i);
            let keys = [("exp_avg", &z.exp_avg), ("exp_avg_sq", &z.exp_avg_sq)];
            for (key, shard) in keys.into_iter().filter(|_| moments) {
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

/// `saved`'s tensor `key`, with `shape`.
fn saved_entry<'a>(
    saved: &std::collections::HashMap<&str, &'a Tensor>,
    key: &str,
    shape: &[i64],
) -> Result<&'a Tensor, TchError> {
    let src = saved
        .get(key)
        .ok_or_else(|| TchError::FileFormat(format!("optimizer state has no `{key}`")))?;
    if src.size() != shape {
        return Err(TchError::Shape(format!(
            "optimizer state `{key}` has shape {:?}, expected {shape:?}",
            src.size()
        )));
    }
    Ok(src)
}
