//! Owns token streams: the embedded corpus, a byte-level text file, or nanoGPT's u16 files.
//! Keeps: a sample is a window of `block_size` tokens and its next-token targets.
use memmap2::Mmap;
use std::path::Path;
use std::sync::Arc;
use tch::{Device, Tensor};

use super::{embedded, DataConfig, DataSource, Dataset, Samples, TokenShape};
use crate::error::{Error, Result};

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
        Split {
            storage,
            start,
            len,
            width,
            name,
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.len
    }

    fn token(&self, i: usize) -> i64 {
        let b = self.storage.bytes();
        let at = (self.start + i) * self.width;
        if self.width == 1 {
            b[at] as i64
        } else {
            u16::from_le_bytes([b[at], b[at + 1]]) as i64
        }
    }

    /// The first token at or above `vocab` (its index in the file, and its id): a scan at
    /// open, so a bad id is refused before the first step, not at the batch that holds it.
    fn first_outside(&self, vocab: i64) -> Option<(usize, i64)> {
        let b = &self.storage.bytes()[self.start * self.width..(self.start + self.len) * self.width];
        let width = self.width;
        // The largest id a MiB at a time first (a plain loop the compiler vectorizes); where
        // the token is, only in a MiB that holds one.
        let chunk = (1 << 20) / width * width;
        let (at, part) = b
            .chunks(chunk)
            .enumerate()
            .find(|(_, c)| largest_id(c, width) >= vocab)?;
        let found = ids(part, width)
            .enumerate()
            .find(|&(_, t)| t >= vocab)
            .map(|(i, t)| (at * chunk / width + i, t));
        found.map(|(i, t)| (self.start + i, t))
    }

    /// Inputs and next-token targets `[n, block]` for the windows starting at `offsets`.
    pub fn batch(
        &self,
        offsets: &[usize],
        block: usize,
        vocab: Option<i64>,
        device: Device,
    ) -> Result<(Tensor, Tensor)> {
        let mut x = Vec::with_capacity(offsets.len() * block);
        let mut y = Vec::with_capacity(offsets.len() * block);
        for &o in offsets {
            for i in o..o + block {
                x.push(self.token(i));
                y.push(self.token(i + 1));
            }
        }
        if let Some((i, t)) = vocab.and_then(|v| y.iter().enumerate().find(|(_, &t)| t >= v)) {
            return Err(Error::Data(format!(
                "{}: token id {t} (near sample {}) is not below model.vocab_size {}; raise model.vocab_size",
                self.name,
                i / block,
                vocab.unwrap_or_default()
            )));
        }
        let shape = [offsets.len() as i64, block as i64];
        let to = |v: Vec<i64>| crate::ops::upload(&Tensor::f_from_slice(&v)?.f_view(shape)?, device);
        Ok((to(x)?, to(y)?))
    }
}

/// Token ids of `width` bytes each (1: bytes; 2: little-endian u16).
fn ids(b: &[u8], width: usize) -> impl Iterator<Item = i64> + '_ {
    b.chunks_exact(width).map(|c| match c {
        [t] => *t as i64,
        c => u16::from_le_bytes([c[0], c[1]]) as i64,
    })
}

/// The largest token id in `b`, 0 when it is empty.
fn largest_id(b: &[u8], width: usize) -> i64 {
    match width {
        1 => b.iter().copied().max().unwrap_or(0) as i64,
        _ => b
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .max()
            .unwrap_or(0) as i64,
    }
}

/// Windows of `block_size` tokens from a split.
pub struct TokenSamples {
    pub split: Split,
    pub shape: TokenShape,
}

impl Samples for TokenSamples {
    fn num_positions(&self) -> usize {
        self.split.num_tokens() - self.shape.block_size - 1
    }
    fn batch(&self, positions: &[usize], device: Device) -> Result<(Tensor, Tensor)> {
        self.split
            .batch(positions, self.shape.block_size, self.shape.vocab_size, device)
    }
    fn units_per_sample(&self) -> usize {
        self.shape.block_size
    }
    fn name(&self) -> String {
        self.split.name.clone()
    }
}

/// Why `bytes` are not nanoGPT's uint16 tokens, where that shows in their first MiB:
/// llm.c's header (its magic number), or 32-bit ids (every second u16 of many a zero: read
/// as u16 they train on every other token 0, all below any vocabulary).
fn not_u16(bytes: &[u8]) -> Option<String> {
    let first = |i: usize| {
        bytes
            .get(4 * i..4 * i + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if matches!(first(0), Some(20240520 | 20240801)) {
        return Some("it starts with llm.c's header (magic number), not tokens".into());
    }
    let head: Vec<u16> = bytes[..bytes.len().min(1 << 20)]
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let odd_zero = head.iter().skip(1).step_by(2).all(|&t| t == 0);
    let even_set = head.iter().step_by(2).any(|&t| t != 0);
    (head.len() >= 256 && odd_zero && even_set)
        .then(|| "every second uint16 of its start is 0: these look like 32-bit token ids".into())
}

pub(super) fn open(cfg: &DataConfig, path: &Path, shape: TokenShape) -> Result<Dataset> {
    if let (DataSource::Embedded, Some(p)) = (cfg.source, &cfg.path) {
        // Not refused: a sweep may vary data.source over one base's data.path.
        tracing::warn!(
            "data.path {} is not read: data.source is embedded (the default); set data.source (text, tokens, \
             tensors or python) to train on it",
            p.display()
        );
    }
    let (train, val) = match cfg.source {
        DataSource::Embedded => split_one(
            Storage::Owned(embedded::corpus(cfg.embedded_bytes)),
            cfg.val_fraction,
            "embedded corpus",
        ),
        DataSource::Text => split_one(map(path)?, cfg.val_fraction, &path.display().to_string()),
        DataSource::Tokens => {
            let open = |name: &str| -> Result<Split> {
                let path = path.join(name);
                let s = map(&path)?;
                let n = s.bytes().len();
                if n % 2 != 0 {
                    return Err(Error::Data(format!(
                        "{}: {n} bytes is not a whole number of u16 tokens: oomguard reads nanoGPT's token files \
                         (little-endian uint16, no header: np.array(ids, np.uint16).tofile(...))",
                        path.display()
                    )));
                }
                if let Some(why) = not_u16(s.bytes()) {
                    return Err(Error::Data(format!(
                        "{}: {why}; oomguard reads nanoGPT's token files (little-endian uint16, no header: \
                         np.array(ids, np.uint16).tofile(...)): write them so",
                        path.display()
                    )));
                }
                Ok(Split::new(Arc::new(s), 2, 0, n / 2, path.display().to_string()))
            };
            (open("train.bin")?, open("val.bin")?)
        }
        DataSource::Tensors | DataSource::Python => unreachable!("opened by data::tensors and task::python"),
    };
    // A split of one file can also move its border.
    let one_file = !matches!(cfg.source, DataSource::Tokens);
    for (split, border) in [(&train, "a smaller"), (&val, "a larger")] {
        if split.num_tokens() < shape.block_size + 2 {
            let fraction = one_file.then(|| format!(", or {border} data.val_fraction (now {})", cfg.val_fraction));
            let more = match cfg.source {
                DataSource::Embedded => format!("a larger data.embedded_bytes (now {})", cfg.embedded_bytes),
                _ => "more data".into(),
            };
            return Err(Error::Data(format!(
                "{}: {} tokens is too short for model.block_size {} (at least {} needed); use {more}, a smaller block_size{}",
                split.name,
                split.num_tokens(),
                shape.block_size,
                shape.block_size + 2,
                fraction.unwrap_or_default()
            )));
        }
    }
    for split in [&train, &val] {
        if let Some((at, t)) = shape.vocab_size.and_then(|v| split.first_outside(v)) {
            return Err(Error::Data(format!(
                "{}: token id {t} (token {at} of the file) is not below model.vocab_size {}; raise model.vocab_size \
                 or re-tokenize",
                split.name,
                shape.vocab_size.unwrap_or_default()
            )));
        }
    }
    Ok(Dataset {
        train: Box::new(TokenSamples { split: train, shape }),
        val: Box::new(TokenSamples { split: val, shape }),
    })
}

fn split_one(storage: Storage, val_fraction: f64, name: &str) -> (Split, Split) {
    let n = storage.bytes().len();
    let n_val = ((n as f64) * val_fraction).round() as usize;
    let storage = Arc::new(storage);
    (
        Split::new(storage.clone(), 1, 0, n - n_val, format!("{name} (train split)")),
        Split::new(storage, 1, n - n_val, n_val, format!("{name} (validation split)")),
    )
}

fn map(path: &Path) -> Result<Storage> {
    let file =
        std::fs::File::open(path).map_err(|e| Error::Data(format!("cannot open data file {}: {e}", path.display())))?;
    if file.metadata().map(|m| m.len()).unwrap_or(0) == 0 {
        return Err(Error::Data(format!("{}: the file is empty", path.display())));
    }
    // SAFETY: read-only map of a file we do not modify; a concurrent writer would only
    // change token values, not memory safety of the slice bounds we check.
    let m = unsafe { Mmap::map(&file) }
        .map_err(|e| Error::Data(format!("cannot map data file {}: {e}", path.display())))?;
    Ok(Storage::Mapped(m))
}
