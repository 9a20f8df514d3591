//! The data sources on small real files.
mod common;
use common::*;
use oomguard::data::{sample_offsets, DataConfig, DataSource, Dataset, TokenShape};
use tch::{Device, Kind, Tensor};

fn shape(block_size: usize, vocab: i64) -> Option<TokenShape> {
    Some(TokenShape {
        block_size,
        vocab_size: Some(vocab),
    })
}
use std::path::Path;

#[test]
fn text_file_is_byte_level() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..400).map(|i| format!("line {i}: héllo wörld\n")).collect();
    std::fs::write(dir.path().join("in.txt"), &text).unwrap();
    let cfg = DataConfig {
        source: DataSource::Text,
        path: Some("in.txt".into()),
        val_fraction: 0.25,
        ..Default::default()
    };
    let ds = Dataset::open(&cfg, dir.path(), shape(16, 256)).unwrap();
    let n = text.len();
    let n_val = (n as f64 * 0.25).round() as usize;
    // Windows of 16 tokens and their next-token targets start at 0..tokens - 17.
    assert_eq!(
        (ds.train.num_positions(), ds.val.num_positions()),
        (n - n_val - 17, n_val - 17)
    );
    assert_eq!(ds.train.units_per_sample(), 16);
    let (x, y) = ds.train.batch(&[5, 100], Device::Cpu).unwrap();
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
    let cfg = DataConfig {
        source: DataSource::Tokens,
        path: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    let ds = Dataset::open(&cfg, Path::new("/"), shape(8, 50_304)).unwrap();
    assert_eq!((ds.train.num_positions(), ds.val.num_positions()), (1000 - 9, 200 - 9));
    let (x, y) = ds.train.batch(&[990 - 8], Device::Cpu).unwrap();
    let x: Vec<i64> = x.get(0).try_into().unwrap();
    let y: Vec<i64> = y.get(0).try_into().unwrap();
    assert_eq!(x, train[982..990].iter().map(|&t| t as i64).collect::<Vec<_>>());
    assert_eq!(y, train[983..991].iter().map(|&t| t as i64).collect::<Vec<_>>());
    // A token outside the vocabulary is an error naming the file and the token's place, at
    // open (it was at the batch that held it, after the steps before were lost).
    let err = Dataset::open(&cfg, Path::new("/"), shape(8, 100))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("train.bin: token id 111 (token 3 of the file)") && err.contains("model.vocab_size 100"),
        "{err}"
    );
    let mut late = train.iter().map(|t| t % 100).collect::<Vec<_>>();
    late[997] = 100;
    write_tokens(&dir.path().join("train.bin"), &late);
    let err = Dataset::open(&cfg, Path::new("/"), shape(8, 100))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("token id 100 (token 997 of the file)"), "{err}");
}

#[test]
fn odd_sized_token_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("train.bin"), [1u8; 301]).unwrap();
    write_tokens(&dir.path().join("val.bin"), &[1; 100]);
    let cfg = DataConfig {
        source: DataSource::Tokens,
        path: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    let err = Dataset::open(&cfg, Path::new("/"), shape(8, 256))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("train.bin") && err.contains("whole number of u16"),
        "{err}"
    );
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
    let text: String = (0..300)
        .map(|i| format!("{i} bottles of beer on the wall.\n"))
        .collect();
    std::fs::write(dir.path().join("beer.txt"), text).unwrap();
    let cfg = write_config(
        dir.path(),
        "t.yaml",
        &TINY.replace(
            "{source: embedded, embedded_bytes: 65536}",
            "{source: text, path: beer.txt}",
        ),
    );
    let run = train_ok(dir.path(), &cfg, &["--max-steps", "2"]);
    assert_eq!(records(&run, "step").len(), 2);
    // The config named by its bare file name, from its folder: the run stores the data's path
    // absolute, so a resume from another folder with no config finds it (it looked in the
    // run directory).
    let o = oomguard(
        &[
            "train",
            "t.yaml",
            "--run-dir",
            "bare",
            "--max-steps",
            "1",
            "--set",
            "optim.decay_steps=2",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let elsewhere = tempfile::tempdir().unwrap();
    let bare = dir.path().join("bare");
    let o = oomguard(
        &[
            "train",
            "--run-dir",
            bare.to_str().unwrap(),
            "--resume",
            "--max-steps",
            "2",
        ],
        elsewhere.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(records(&bare, "step").len(), 2);
}

/// `data.source: tensors`: rows of `inputs` and `targets`, the last val_fraction held out,
/// a sample's position its row; bad files name what is wrong.
#[test]
fn tensor_files_hold_samples_along_dim_0() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = Tensor::arange(40 * 3, (Kind::Float, Device::Cpu)).view([40, 3]);
    let targets = Tensor::arange(40, (Kind::Int64, Device::Cpu));
    let path = dir.path().join("d.safetensors");
    Tensor::write_safetensors(&[("inputs", &inputs), ("targets", &targets)], &path).unwrap();
    let cfg = DataConfig {
        source: DataSource::Tensors,
        path: Some("d.safetensors".into()),
        val_fraction: 0.25,
        ..Default::default()
    };
    let ds = Dataset::open(&cfg, dir.path(), None).unwrap();
    assert_eq!((ds.train.num_positions(), ds.val.num_positions()), (30, 10));
    let (x, y) = ds.train.batch(&[2, 29], Device::Cpu).unwrap();
    assert_eq!(
        Vec::<f32>::try_from(x.view([-1])).unwrap(),
        vec![6.0, 7.0, 8.0, 87.0, 88.0, 89.0]
    );
    assert_eq!(Vec::<i64>::try_from(y).unwrap(), vec![2, 29]);
    let (_, y) = ds.val.batch(&[0], Device::Cpu).unwrap();
    assert_eq!(Vec::<i64>::try_from(y).unwrap(), vec![30]);

    Tensor::write_safetensors(&[("inputs", &inputs)], &path).unwrap();
    let err = Dataset::open(&cfg, dir.path(), None).err().unwrap().to_string();
    assert!(
        err.contains("d.safetensors") && err.contains("has no tensor `targets`"),
        "{err}"
    );
    Tensor::write_safetensors(&[("inputs", &inputs), ("targets", &targets.narrow(0, 0, 7))], &path).unwrap();
    let err = Dataset::open(&cfg, dir.path(), None).err().unwrap().to_string();
    assert!(err.contains("same number of samples along dim 0"), "{err}");
    // For a GPT (its vocabulary known): integer ids within it, and something to learn from;
    // refused at open, so `--check` and the run's start say it (not a step that meets it).
    let gpt = Some(TokenShape {
        block_size: 3,
        vocab_size: Some(64),
    });
    let ids = Tensor::arange(40 * 3, (Kind::Int64, Device::Cpu))
        .view([40, 3])
        .remainder(64);
    let outside = targets.remainder(64);
    let _ = outside.get(5).fill_(100);
    let cases = [
        (
            &inputs,
            &targets,
            "`inputs` holds Float; a GPT (model.kind gpt) takes integer token ids",
        ),
        (&ids, &outside, "`targets` holds token id 100 (element 5, flattened)"),
        (
            &ids,
            &targets.full_like(-100),
            "every one of `targets` is -100 (ignored)",
        ),
    ];
    for (i, t, wants) in cases {
        Tensor::write_safetensors(&[("inputs", i), ("targets", t)], &path).unwrap();
        let err = Dataset::open(&cfg, dir.path(), gpt).err().unwrap().to_string();
        assert!(err.contains("d.safetensors") && err.contains(wants), "{err}");
    }
    // Rows longer than the GPT's context: named at open, not libtorch's index error at a step.
    let long = Tensor::arange(40 * 4, (Kind::Int64, Device::Cpu))
        .view([40, 4])
        .remainder(64);
    Tensor::write_safetensors(&[("inputs", &long), ("targets", &long)], &path).unwrap();
    let err = Dataset::open(&cfg, dir.path(), gpt).err().unwrap().to_string();
    assert!(
        err.contains("rows of `inputs` hold 4 tokens, past the GPT's context model.block_size 3"),
        "{err}"
    );
    let masked = targets.remainder(64).where_scalarother(&targets.fmod(2).ne(0), -100);
    Tensor::write_safetensors(&[("inputs", &ids), ("targets", &masked)], &path).unwrap();
    assert!(
        Dataset::open(&cfg, dir.path(), gpt).is_ok(),
        "ids in range, some masked"
    );
    // The held-out rows (the last 10 of 40) all masked: their loss would read 0, kept as the best.
    let tail_masked = masked.copy();
    let _ = tail_masked.narrow(0, 30, 10).fill_(-100);
    Tensor::write_safetensors(&[("inputs", &ids), ("targets", &tail_masked)], &path).unwrap();
    let err = Dataset::open(&cfg, dir.path(), gpt).err().unwrap().to_string();
    assert!(
        err.contains("every target of the validation split") && err.contains("data.val_fraction"),
        "{err}"
    );
}

/// Token ids written as uint32 (every second u16 a zero) or llm.c's files (a header first)
/// are refused, naming the format oomguard reads: read as u16 they trained on garbage.
#[test]
fn token_files_of_another_format_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = (0..1000).map(|i| (i * 37 % 50_000) as u32).collect();
    let wide: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(dir.path().join("train.bin"), &wide).unwrap();
    write_tokens(&dir.path().join("val.bin"), &[1; 100]);
    let cfg = DataConfig {
        source: DataSource::Tokens,
        path: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    let err = Dataset::open(&cfg, Path::new("/"), shape(8, 50_304))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("train.bin") && err.contains("32-bit token ids") && err.contains("np.uint16"),
        "{err}"
    );
    let mut llmc = 20240520u32.to_le_bytes().to_vec();
    llmc.extend(std::iter::repeat_n(1u8, 2046));
    std::fs::write(dir.path().join("train.bin"), &llmc).unwrap();
    let err = Dataset::open(&cfg, Path::new("/"), shape(8, 50_304))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("llm.c's header"), "{err}");
}
