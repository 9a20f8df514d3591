//! Training data: an embedded synthetic language (the default, no download), a UTF-8 text
//! file read byte by byte, or nanoGPT token files (train.bin/val.bin, little-endian u16).
//!
//! Which samples make up step `s` is `sample_offsets(seed, s, ...)`, a pure function that
//! knows nothing of the micro-batch size: the guard may split a step any way it likes and
//! the step still sees exactly the same samples.
mod embedded;

use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tch::{Device, Tensor};

use crate::config::ConfigError;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataSource {
    Embedded,
    Text,
    Tokens,
}

/// The `data` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    pub source: DataSource,
    /// `text`: the file; `tokens`: the folder holding train.bin and val.bin. Relative paths
    /// are taken from the config file's folder.
    pub path: Option<PathBuf>,
    /// Share held out for evaluation (`embedded` and `text`).
    pub val_fraction: f64,
    /// Size of the embedded corpus in bytes.
    pub embedded_bytes: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig { source: DataSource::Embedded, path: None, val_fraction: 0.1, embedded_bytes: 1 << 20 }
    }
}

impl DataConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.source != DataSource::Embedded && self.path.is_none() {
            return Err(ConfigError::invalid(
                "data.path",
                format!("is required for source {:?}: a text file, or a folder with train.bin and val.bin", self.source),
            ));
        }
        if !(self.val_fraction > 0.0 && self.val_fraction < 1.0) {
            return Err(ConfigError::invalid("data.val_fraction", format!("is {}; it must be in (0, 1)", self.val_fraction)));
        }
        if self.embedded_bytes < 4096 {
            return Err(ConfigError::invalid("data.embedded_bytes", "must be at least 4096"));
        }
        Ok(())
    }

    /// `data.path` resolved against `base` (the config file's folder).
    pub fn resolved_path(&self, base: &Path) -> Option<PathBuf> {
        self.path.as_ref().map(|p| if p.is_absolute() { p.clone() } else { base.join(p) })
    }

    /// Checks that the files the source needs exist, before any run starts.
    pub fn check_files(&self, base: &Path) -> Result<(), ConfigError> {
        let Some(path) = self.resolved_path(base) else { return Ok(()) };
        let needed = match self.source {
            DataSource::Embedded => vec![],
            DataSource::Text => vec![path],
            DataSource::Tokens => vec![path.join("train.bin"), path.join("val.bin")],
        };
        match needed.iter().find(|p| !p.is_file()) {
            Some(p) => Err(ConfigError::invalid(
                "data.path",
                format!("{} does not exist; for source {:?} point data.path at {}", p.display(), self.source,
                    if self.source == DataSource::Text { "a UTF-8 text file" } else { "a folder with train.bin and val.bin" }),
            )),
            None => Ok(()),
        }
    }
}

enum Storage {
    Owned(Vec<u8>),
    Mapped(Mmap),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Owned(v) => v,
            Storage::Mapped(m) => m,
        }
    }
}

/// A contiguous run of tokens (1 or 2 bytes each), owned or memory-mapped.
#[derive(Clone)]
pub struct Split {
    storage: Arc<Storage>,
    start: usize,
    len: usize,
    width: usize,
    name: String,
}

impl Split {
    fn new(storage: Arc<Storage>, width: usize, start: usize, len: usize, name: String) -> Split {
        Split { storage, start, len, width, name }
    }

    pub fn num_tokens(&self) -> usize {
        self.len
    }

    fn token(&self, i: usize) -> i64 {
        let b = self.storage.bytes();
        let at = (self.start + i) * self.width;
        if self.width == 1 { b[at] as i64 } else { u16::from_le_bytes([b[at], b[at + 1]]) as i64 }
    }

    /// Inputs and next-token targets `[n, block]` for the samples starting at `offsets`.
    pub fn batch(&self, offsets: &[usize], block: usize, vocab: i64, device: Device) -> Result<(Tensor, Tensor)> {
        let mut x = Vec::with_capacity(offsets.len() * block);
        let mut y = Vec::with_capacity(offsets.len() * block);
        for &o in offsets {
            for i in o..o + block {
                x.push(self.token(i));
                y.push(self.token(i + 1));
            }
        }
        if let Some((i, t)) = y.iter().enumerate().find(|(_, &t)| t >= vocab) {
            return Err(Error::Data(format!(
                "{}: token id {t} (near sample {}) is not below model.vocab_size {vocab}; raise model.vocab_size",
                self.name,
                i / block
            )));
        }
        let shape = [offsets.len() as i64, block as i64];
        let to = |v: Vec<i64>| Tensor::f_from_slice(&v)?.f_view(shape)?.f_to_device(device);
        Ok((to(x)?, to(y)?))
    }
}

/// Train and validation splits.
pub struct Dataset {
    pub train: Split,
    pub val: Split,
}

impl Dataset {
    /// Opens the data a config names; `base` is the config file's folder.
    pub fn open(cfg: &DataConfig, base: &Path, block_size: usize) -> Result<Dataset> {
        let path = cfg.resolved_path(base).unwrap_or_default();
        let ds = match cfg.source {
            DataSource::Embedded => {
                Self::split_one(Storage::Owned(embedded::corpus(cfg.embedded_bytes)), 1, cfg.val_fraction, "embedded corpus")
            }
            DataSource::Text => {
                Self::split_one(map(&path)?, 1, cfg.val_fraction, &path.display().to_string())
            }
            DataSource::Tokens => {
                let open = |name: &str| -> Result<Split> {
                    let path = path.join(name);
                    let s = map(&path)?;
                    let n = s.bytes().len();
                    if n % 2 != 0 {
                        return Err(Error::Data(format!("{}: {n} bytes is not a whole number of u16 tokens", path.display())));
                    }
                    Ok(Split::new(Arc::new(s), 2, 0, n / 2, path.display().to_string()))
                };
                Dataset { train: open("train.bin")?, val: open("val.bin")? }
            }
        };
        for split in [&ds.train, &ds.val] {
            if split.num_tokens() < block_size + 2 {
                return Err(Error::Data(format!(
                    "{}: {} tokens is too short for model.block_size {block_size}; use more data or a smaller block_size",
                    split.name,
                    split.num_tokens()
                )));
            }
        }
        Ok(ds)
    }

    fn split_one(storage: Storage, width: usize, val_fraction: f64, name: &str) -> Dataset {
        let n = storage.bytes().len() / width;
        let n_val = ((n as f64) * val_fraction).round() as usize;
        let storage = Arc::new(storage);
        Dataset {
            train: Split::new(storage.clone(), width, 0, n - n_val, format!("{name} (train split)")),
            val: Split::new(storage, width, n - n_val, n_val, format!("{name} (validation split)")),
        }
    }
}

fn map(path: &Path) -> Result<Storage> {
    let file = std::fs::File::open(path).map_err(|e| Error::Data(format!("cannot open data file {}: {e}", path.display())))?;
    if file.metadata().map(|m| m.len()).unwrap_or(0) == 0 {
        return Err(Error::Data(format!("{}: the file is empty", path.display())));
    }
    // SAFETY: read-only map of a file we do not modify; a concurrent writer would only
    // change token values, not memory safety of the slice bounds we check.
    let m = unsafe { Mmap::map(&file) }.map_err(|e| Error::Data(format!("cannot map data file {}: {e}", path.display())))?;
    Ok(Storage::Mapped(m))
}

/// SplitMix64: a counter-based generator, so any sample is computed without a sequence.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Start positions of the `global_batch` samples of step `step`: a pure function of
/// (seed, step), independent of how the step is split into micro-batches.
pub fn sample_offsets(seed: u64, step: u64, global_batch: usize, num_tokens: usize, block: usize) -> Vec<usize> {
    let positions = (num_tokens - block - 1) as u64;
    let base = splitmix64(seed ^ splitmix64(step));
    (0..global_batch as u64).map(|i| (splitmix64(base ^ splitmix64(i.wrapping_add(1) << 20)) % positions) as usize).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_pure_and_in_range() {
        let a = sample_offsets(7, 3, 16, 1000, 64);
        assert_eq!(a, sample_offsets(7, 3, 16, 1000, 64));
        assert_ne!(a, sample_offsets(7, 4, 16, 1000, 64));
        assert_ne!(a, sample_offsets(8, 3, 16, 1000, 64));
        assert!(a.iter().all(|&o| o + 64 < 1000));
        // The first k samples of a larger batch are the same samples: prefix-stable.
        assert_eq!(&sample_offsets(7, 3, 32, 1000, 64)[..16], &a[..]);
    }
}
