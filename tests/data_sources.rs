//! The three data sources on small real files.
mod common;
use common::*;
use oomguard::data::{sample_offsets, DataConfig, DataSource, Dataset};
use std::path::Path;

#[test]
fn text_file_is_byte_level() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..400).map(|i| format!("line {i}: héllo wörld\n")).collect();
    std::fs::write(dir.path().join("in.txt"), &text).unwrap();
    let cfg = DataConfig { source: DataSource::Text, path: Some("in.txt".into()), val_fraction: 0.25, ..Default::default() };
    let ds = Dataset::open(&cfg, dir.path(), 16).unwrap();
    let n = text.len();
    assert_eq!(ds.train.num_tokens() + ds.val.num_tokens(), n);
    assert_eq!(ds.val.num_tokens(), (n as f64 * 0.25).round() as usize);
    let (x, y) = ds.train.batch(&[5, 100], 16, 256, tch::Device::Cpu).unwrap();
    assert_eq!(x.size(), [2, 16]);
    let x0: Vec<i64> = x.get(0).try_into().unwrap();
    let y1: Vec<i64> = y.get(1).try_into().unwrap();
    let bytes = text.as_bytes();
    assert_eq!(x0, bytes[5..21].iter().map(|&b| b as i64).collect::<Vec<_>>());
    assert_eq!(y1, bytes[101..117].iter().map(|&b| b as i64).collect::<Vec<_>>());
}

fn write_tokens(path: &Path, tokens: &[u16]) {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn nanogpt_token_files_are_memory_mapped_u16() {
    let dir = tempfile::tempdir().unwrap();
    let train: Vec<u16> = (0..1000).map(|i| (i * 37 % 50_000) as u16).collect();
    write_tokens(&dir.path().join("train.bin"), &train);
    write_tokens(&dir.path().join("val.bin"), &train[..200]);
    let cfg = DataConfig { source: DataSource::Tokens, path: Some(dir.path().to_path_buf()), ..Default::default() };
    let ds = Dataset::open(&cfg, Path::new("/"), 8).unwrap();
    assert_eq!((ds.train.num_tokens(), ds.val.num_tokens()), (1000, 200));
    let (x, y) = ds.train.batch(&[990 - 8], 8, 50_304, tch::Device::Cpu).unwrap();
    let x: Vec<i64> = x.get(0).try_into().unwrap();
    let y: Vec<i64> = y.get(0).try_into().unwrap();
    assert_eq!(x, train[982..990].iter().map(|&t| t as i64).collect::<Vec<_>>());
    assert_eq!(y, train[983..991].iter().map(|&t| t as i64).collect::<Vec<_>>());
    // A token outside the vocabulary is an error naming the file, not a crash.
    let err = ds.train.batch(&[0], 8, 100, tch::Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("train.bin") && err.contains("model.vocab_size 100"), "{err}");
}

#[test]
fn odd_sized_token_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("train.bin"), [1u8; 301]).unwrap();
    write_tokens(&dir.path().join("val.bin"), &[1; 100]);
    let cfg = DataConfig { source: DataSource::Tokens, path: Some(dir.path().to_path_buf()), ..Default::default() };
    let err = Dataset::open(&cfg, Path::new("/"), 8).err().unwrap().to_string();
    assert!(err.contains("train.bin") && err.contains("whole number of u16"), "{err}");
}

#[test]
fn step_samples_do_not_depend_on_the_split() {
    // The sampler is a pure function of (seed, step); a 16-sample step cut 8+8 or 4x4 reads
    // the same 16 offsets.
    let all = sample_offsets(3, 11, 16, 10_000, 32);
    let again = sample_offsets(3, 11, 16, 10_000, 32);
    assert_eq!(all, again);
}

#[test]
fn trains_on_a_text_file_through_the_binary() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..300).map(|i| format!("{i} bottles of beer on the wall.\n")).collect();
    std::fs::write(dir.path().join("beer.txt"), text).unwrap();
    let cfg = write_config(dir.path(), "t.yaml", &TINY.replace("{source: embedded, embedded_bytes: 65536}", "{source: text, path: beer.txt}"));
    let run = train_ok(dir.path(), &cfg, &["--max-steps", "2"]);
    assert_eq!(records(&run, "step").len(), 2);
}
