//! Owns a sharded checkpoint's optimizer files: each rank's slice of AdamW's flat moments
//! (`optimizer.shard-R-of-W.safetensors`), written and read a bounded chunk at a time, and
//! which byte ranges of the old files fill a new layout's range (pure).
//! Keeps: no rank holds more than its shard plus one chunk of `CHUNK` elements; the files are
//! plain safetensors (a header, then the bytes), so any slice is one seek away.
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

use super::FileSum;
use crate::error::{Error, Result};

/// The two moments in each shard file, as `AdamW::state` names a shard's.
pub const MOMENTS: [&str; 2] = ["zero.exp_avg", "zero.exp_avg_sq"];
/// Elements moved per read or write (1 MiB of f32): the most a save or load holds besides
/// the shard itself.
pub const CHUNK: i64 = 1 << 18;

/// How a sharded checkpoint cut the flat parameter space (the parameters flattened in the
/// optimizer's order): rank r's file holds elements `[r * shard, (r + 1) * shard)`, zeros
/// past `total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardLayout {
    /// The ranks that wrote it: one file each.
    pub world: usize,
    /// Elements per file.
    pub shard: i64,
    /// Elements of all parameters.
    pub total: i64,
}

/// One ranged read: `len` elements from `rank`'s file at `start` (inside its shard), into
/// the destination at `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Read1 {
    pub rank: usize,
    pub start: i64,
    pub len: i64,
    pub at: i64,
}

impl ShardLayout {
    /// Rank `rank`'s file name.
    pub fn file(&self, rank: usize) -> String {
        format!("optimizer.shard-{rank}-of-{}.safetensors", self.world)
    }

    pub fn files(&self) -> Vec<String> {
        (0..self.world).map(|r| self.file(r)).collect()
    }

    /// The reads that fill flat `[lo, lo + len)`, in order; the part past `total` (a new
    /// layout's padding) has none.
    pub fn reads(&self, lo: i64, len: i64) -> Vec<Read1> {
        let hi = (lo + len).min(self.total);
        let mut out = Vec::new();
        let mut at = lo.max(0);
        while at < hi && self.shard > 0 {
            let rank = (at / self.shard) as usize;
            let end = hi.min((rank as i64 + 1) * self.shard);
            out.push(Read1 {
                rank,
                start: at - rank as i64 * self.shard,
                len: end - at,
                at: at - lo,
            });
            at = end;
        }
        out
    }
}

/// Writes 1-D fp32 tensors (on any device) as a safetensors file, a chunk at a time through
/// one host buffer, fsynced; returns its size and CRC32, computed as it is written.
pub fn write(path: &Path, tensors: &[(&str, &Tensor)], meta: &BTreeMap<String, String>) -> Result<FileSum> {
    let io = |e: std::io::Error| Error::io(format!("cannot write {}", path.display()), e);
    if let Some((name, _)) = tensors.iter().find(|(_, t)| t.kind() != Kind::Float || t.dim() != 1) {
        return Err(Error::Data(format!("{name}: a shard file holds 1-D fp32 tensors")));
    }
    let head = crate::task::tensors::header(tensors, serde_json::json!(meta))?;
    let mut f = File::create(path).map_err(io)?;
    let mut sum = Summed::default();
    sum.put(&mut f, &(head.len() as u64).to_le_bytes()).map_err(io)?;
    sum.put(&mut f, &head).map_err(io)?;
    let most = tensors.iter().map(|(_, t)| t.numel() as i64).max().unwrap_or(0);
    let buf = Tensor::f_empty([CHUNK.min(most).max(1)], (Kind::Float, Device::Cpu))?;
    let _no_grad = tch::no_grad_guard();
    for (_, t) in tensors {
        let n = t.numel() as i64;
        for s in (0..n).step_by(CHUNK as usize) {
            let len = CHUNK.min(n - s);
            let part = buf.f_narrow(0, 0, len)?;
            part.shallow_clone().f_copy_(&t.f_narrow(0, s, len)?)?;
            // SAFETY: `part` is a contiguous CPU fp32 tensor of `len` elements, alive here.
            let bytes = unsafe { std::slice::from_raw_parts(part.data_ptr() as *const u8, len as usize * 4) };
            sum.put(&mut f, bytes).map_err(io)?;
        }
    }
    f.sync_all().map_err(io)?;
    Ok(sum.done())
}

/// A writer's running size and CRC32.
#[derive(Default)]
struct Summed {
    hasher: crc32fast::Hasher,
    bytes: u64,
}

impl Summed {
    fn put(&mut self, f: &mut File, b: &[u8]) -> std::io::Result<()> {
        self.hasher.update(b);
        self.bytes += b.len() as u64;
        f.write_all(b)
    }
    fn done(self) -> FileSum {
        FileSum {
            bytes: self.bytes,
            crc32: self.hasher.finalize(),
        }
    }
}

/// One opened shard file: where each tensor's bytes start, and its length in elements.
struct Opened {
    path: PathBuf,
    file: File,
    tensors: HashMap<String, (u64, i64)>,
}

fn bad(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{}: {why}", path.display()))
}

impl Opened {
    fn open(path: PathBuf) -> Result<Opened> {
        let mut file = File::open(&path).map_err(|e| bad(&path, format!("cannot read it ({e})")))?;
        let mut n = [0u8; 8];
        file.read_exact(&mut n)
            .map_err(|e| bad(&path, format!("no safetensors header ({e})")))?;
        let n = u64::from_le_bytes(n);
        let len = file.metadata().map_err(|e| bad(&path, e))?.len();
        if n > len.saturating_sub(8) || n > 1 << 24 {
            return Err(bad(&path, format!("a header of {n} bytes does not fit the file")));
        }
        let mut head = vec![0u8; n as usize];
        file.read_exact(&mut head).map_err(|e| bad(&path, e))?;
        let head: BTreeMap<String, serde_json::Value> =
            serde_json::from_slice(&head).map_err(|e| bad(&path, format!("corrupt header ({e})")))?;
        let mut tensors = HashMap::new();
        for name in MOMENTS {
            let t = head.get(name).ok_or_else(|| bad(&path, format!("holds no `{name}`")))?;
            let (a, b) = (t["data_offsets"][0].as_u64(), t["data_offsets"][1].as_u64());
            let (Some(a), Some(b), Some("F32")) = (a, b, t["dtype"].as_str()) else {
                return Err(bad(&path, format!("`{name}` is not an fp32 tensor")));
            };
            if b < a || 8 + n + b > len {
                return Err(bad(&path, format!("`{name}` runs past the end of the file")));
            }
            tensors.insert(name.to_string(), (8 + n + a, ((b - a) / 4) as i64));
        }
        Ok(Opened { path, file, tensors })
    }

    /// `dst.numel()` elements of `name` from `start` into `dst` (1-D fp32, any device),
    /// through `buf` (a CPU fp32 chunk).
    fn read_into(&mut self, name: &str, start: i64, dst: &Tensor, buf: &Tensor) -> Result<()> {
        let (base, numel) = self.tensors[name];
        let n = dst.numel() as i64;
        if start + n > numel {
            let why = format!("`{name}` holds {numel} values, a read needs {}", start + n);
            return Err(bad(&self.path, why));
        }
        let path = self.path.clone();
        let io = |e: std::io::Error| bad(&path, format!("cannot read it ({e})"));
        self.file.seek(SeekFrom::Start(base + start as u64 * 4)).map_err(io)?;
        for s in (0..n).step_by(CHUNK as usize) {
            let len = CHUNK.min(n - s);
            let part = buf.f_narrow(0, 0, len)?;
            // SAFETY: `part` is a contiguous CPU fp32 tensor of `len` elements, alive here.
            let bytes = unsafe { std::slice::from_raw_parts_mut(part.data_ptr() as *mut u8, len as usize * 4) };
            self.file.read_exact(bytes).map_err(io)?;
            dst.f_narrow(0, s, len)?.f_copy_(&part)?;
        }
        Ok(())
    }
}

/// Reads slices of a sharded checkpoint's moments, opening each file once.
pub struct Reader {
    pub dir: PathBuf,
    pub layout: ShardLayout,
    open: HashMap<usize, Opened>,
    buf: Tensor,
}

impl Reader {
    pub fn new(dir: &Path, layout: ShardLayout) -> Result<Reader> {
        Ok(Reader {
            dir: dir.to_path_buf(),
            layout,
            open: HashMap::new(),
            buf: Tensor::f_empty([CHUNK.min(layout.shard).max(1)], (Kind::Float, Device::Cpu))?,
        })
    }

    /// Moment `name`'s flat `[lo, lo + dst.numel())` into `dst` (1-D); zeros past `total`.
    pub fn fill(&mut self, name: &str, lo: i64, dst: &Tensor) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let n = dst.numel() as i64;
        let covered = (self.layout.total - lo).clamp(0, n);
        if covered < n {
            let _ = dst.f_narrow(0, covered, n - covered)?.f_zero_()?;
        }
        for r in self.layout.reads(lo, n) {
            let f = match self.open.entry(r.rank) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Opened::open(self.dir.join(self.layout.file(r.rank)))?)
                }
            };
            f.read_into(name, r.start, &dst.f_narrow(0, r.at, r.len)?, &self.buf)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of a new range comes from the one old file that holds it, at its place.
    #[test]
    fn reads_cover_a_range_once_from_the_files_that_hold_it() {
        let old = ShardLayout {
            world: 3,
            shard: 6,
            total: 17,
        };
        for (lo, len) in [(0, 17), (0, 9), (9, 9), (5, 2), (6, 6), (16, 4), (17, 3), (4, 13)] {
            let reads = old.reads(lo, len);
            let mut seen = vec![None; len as usize];
            for r in &reads {
                assert!(r.start + r.len <= old.shard, "{r:?}");
                for k in 0..r.len {
                    let flat = r.rank as i64 * old.shard + r.start + k;
                    assert_eq!(flat, lo + r.at + k, "{r:?}");
                    seen[(r.at + k) as usize] = Some(flat);
                }
            }
            let want: Vec<_> = (lo..lo + len).map(|e| (e < 17).then_some(e)).collect();
            assert_eq!(seen, want, "[{lo}, {}): {reads:?}", lo + len);
        }
        assert_eq!(
            old.reads(5, 8),
            vec![
                Read1 {
                    rank: 0,
                    start: 5,
                    len: 1,
                    at: 0
                },
                Read1 {
                    rank: 1,
                    start: 0,
                    len: 6,
                    at: 1
                },
                Read1 {
                    rank: 2,
                    start: 0,
                    len: 1,
                    at: 7
                },
            ]
        );
    }

    #[test]
    fn a_file_written_in_chunks_reads_back_in_any_slice() {
        let dir = tempfile::tempdir().unwrap();
        let n = 2 * CHUNK + 5;
        let a = Tensor::arange(n, (Kind::Float, Device::Cpu));
        let b = -&a;
        let path = dir.path().join("optimizer.shard-1-of-2.safetensors");
        let sum = write(&path, &[(MOMENTS[0], &a), (MOMENTS[1], &b)], &BTreeMap::new()).unwrap();
        assert_eq!(sum.bytes, std::fs::metadata(&path).unwrap().len());
        // Plain safetensors: libtorch's reader agrees.
        let back = Tensor::read_safetensors(&path).unwrap();
        assert!(back.iter().any(|(k, t)| k == MOMENTS[1] && t.equal(&b)));
        let layout = ShardLayout {
            world: 2,
            shard: n,
            total: 2 * n - 3,
        };
        std::fs::copy(&path, dir.path().join(layout.file(0))).unwrap();
        let mut r = Reader::new(dir.path(), layout).unwrap();
        let dst = Tensor::full([CHUNK + 10], 7.0, (Kind::Float, Device::Cpu));
        r.fill(MOMENTS[1], n - 4, &dst).unwrap();
        // Four from the end of rank 0's file, then rank 1's from its start.
        let want = Tensor::cat(&[b.narrow(0, n - 4, 4), b.narrow(0, 0, CHUNK + 6)], 0);
        assert!(dst.equal(&want));
        // Past `total`: zeros.
        let tail = Tensor::full([6], 7.0, (Kind::Float, Device::Cpu));
        r.fill(MOMENTS[0], 2 * n - 5, &tail).unwrap();
        let got: Vec<f32> = Vec::try_from(&tail).unwrap();
        assert_eq!(got, vec![(n - 5) as f32, (n - 4) as f32, 0.0, 0.0, 0.0, 0.0]);
    }
}
