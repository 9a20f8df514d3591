//! Checkpoints: `run_dir/checkpoints/step-NNNNNNNN/` holding model.safetensors,
//! optimizer.safetensors, rng.safetensors and state.json (training state plus the size and
//! CRC32 of every file, written last). A checkpoint is built in a temporary folder, every
//! file fsynced, then renamed into place and the parent fsynced: a kill at any instant
//! leaves the previous checkpoint valid.
mod retention;
mod rng;

pub use retention::retention;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Tensor};

use crate::config::ConfigError;
use crate::error::{Error, Result};
use crate::guard::Policy;
use crate::model::GptConfig;
use crate::optim::AdamW;

/// The `checkpoint` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Write a checkpoint every this many steps (0: only when stopped by a signal, when a
    /// step cannot fit, and at the end).
    pub every_steps: u64,
    /// Keep the newest this many checkpoints...
    pub keep: usize,
    /// ...and also the one with the best evaluation loss.
    pub keep_best: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { every_steps: 0, keep: 3, keep_best: true }
    }
}

impl CheckpointConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.keep == 0 {
            return Err(ConfigError::invalid("checkpoint.keep", "is 0; keep at least 1 checkpoint"));
        }
        Ok(())
    }
}

/// The version of state.json this build writes and reads.
pub const FORMAT: u32 = 1;
const FILES: [&str; 3] = ["model.safetensors", "optimizer.safetensors", "rng.safetensors"];

/// Everything besides tensors that exact resume needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    pub format: u32,
    /// The step the resumed run starts with (the LR schedule and the data position follow
    /// from it: samples are a pure function of (seed, step)).
    pub next_step: u64,
    pub samples_seen: u64,
    /// The guard: current micro-batch, grow-back state and OOM history.
    pub policy: Policy,
    pub eval_policy: Policy,
    pub val_loss: Option<f64>,
    pub model: GptConfig,
    #[serde(default)]
    pub files: BTreeMap<String, FileSum>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileSum {
    pub bytes: u64,
    pub crc32: u32,
}

pub fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

/// Writes a checkpoint of `state` atomically; returns its folder.
pub fn save(run_dir: &Path, state: &TrainState, vs: &VarStore, opt: &AdamW) -> Result<PathBuf> {
    let parent = checkpoints_dir(run_dir);
    let final_dir = parent.join(format!("step-{:08}", state.next_step));
    if final_dir.exists() {
        return Ok(final_dir); // this step is already saved
    }
    let tmp = parent.join(format!(".tmp-step-{:08}-{}", state.next_step, std::process::id()));
    let io = |what: &str, p: &Path| { let m = format!("{what} {}", p.display()); move |e: std::io::Error| Error::io(m, e) };
    std::fs::create_dir_all(&tmp).map_err(io("cannot create", &tmp))?;
    let torch = |p: &Path| { let m = format!("cannot write {}", p.display()); move |e: tch::TchError| Error::io(m, std::io::Error::other(e.to_string())) };
    let model = tmp.join(FILES[0]);
    vs.save(&model).map_err(torch(&model))?;
    let optim = tmp.join(FILES[1]);
    Tensor::write_safetensors(&opt.state(), &optim).map_err(torch(&optim))?;
    let rng_path = tmp.join(FILES[2]);
    Tensor::write_safetensors(&rng::get_states(vs.device())?, &rng_path).map_err(torch(&rng_path))?;

    let mut state = state.clone();
    for f in FILES {
        let p = tmp.join(f);
        state.files.insert(f.to_string(), checksum(&p)?);
        File::open(&p).and_then(|f| f.sync_all()).map_err(io("cannot fsync", &p))?;
    }
    let manifest = tmp.join("state.json");
    let text = serde_json::to_string_pretty(&state).map_err(|e| Error::Data(format!("encoding state.json: {e}")))?;
    std::fs::write(&manifest, text).map_err(io("cannot write", &manifest))?;
    File::open(&manifest).and_then(|f| f.sync_all()).map_err(io("cannot fsync", &manifest))?;
    File::open(&tmp).and_then(|f| f.sync_all()).map_err(io("cannot fsync", &tmp))?;
    std::fs::rename(&tmp, &final_dir).map_err(io("cannot rename into", &final_dir))?;
    File::open(&parent).and_then(|f| f.sync_all()).map_err(io("cannot fsync", &parent))?;
    Ok(final_dir)
}

fn checksum(path: &Path) -> Result<FileSum> {
    let mut f = File::open(path).map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileSum { bytes, crc32: hasher.finalize() })
}

/// Reads and verifies a checkpoint's manifest and files. The error names the bad file.
pub fn verify(dir: &Path) -> Result<TrainState> {
    let bad = |p: &Path, why: String| Error::Checkpoint(format!("{}: {why}", p.display()));
    let manifest = dir.join("state.json");
    let text = std::fs::read_to_string(&manifest).map_err(|e| bad(&manifest, format!("cannot read it ({e}); is {} a checkpoint?", dir.display())))?;
    let state: TrainState = serde_json::from_str(&text).map_err(|e| bad(&manifest, format!("corrupt ({e})")))?;
    if state.format != FORMAT {
        return Err(bad(&manifest, format!("format {} is not {FORMAT}", state.format)));
    }
    for f in FILES {
        let p = dir.join(f);
        let want = state.files.get(f).ok_or_else(|| bad(&manifest, format!("lists no {f}")))?;
        let got = checksum(&p).map_err(|e| bad(&p, e.to_string()))?;
        if got.bytes != want.bytes {
            return Err(bad(&p, format!("truncated or changed: {} bytes, expected {}", got.bytes, want.bytes)));
        }
        if got.crc32 != want.crc32 {
            return Err(bad(&p, "corrupt: its CRC32 does not match state.json".into()));
        }
    }
    Ok(state)
}

/// Checkpoint folders in `run_dir`, oldest first, with their steps.
pub fn list(run_dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(checkpoints_dir(run_dir))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            Some((name.strip_prefix("step-")?.parse().ok()?, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// The newest checkpoint that verifies; a corrupt newer one is skipped, saying so.
pub fn newest_valid(run_dir: &Path) -> Result<(PathBuf, TrainState)> {
    let all = list(run_dir);
    for (_, dir) in all.iter().rev() {
        match verify(dir) {
            Ok(state) => return Ok((dir.clone(), state)),
            Err(e) => tracing::warn!("skipping checkpoint: {e}; trying an older one"),
        }
    }
    Err(Error::Checkpoint(format!(
        "{}: no valid checkpoint to resume from{}",
        checkpoints_dir(run_dir).display(),
        if all.is_empty() { "" } else { " (all are corrupt)" }
    )))
}

/// Loads a verified checkpoint's tensors into the model and optimizer.
pub fn restore(dir: &Path, vs: &mut VarStore, opt: &mut AdamW) -> Result<()> {
    let named = |f: &str| {
        let p = dir.join(f);
        Tensor::read_safetensors(&p).map_err(|e| Error::Checkpoint(format!("{}: {e}", p.display())))
    };
    let model = dir.join(FILES[0]);
    vs.load(&model).map_err(|e| Error::Checkpoint(format!("{}: {e}", model.display())))?;
    opt.load_state(&named(FILES[1])?).map_err(|e| Error::Checkpoint(format!("{}: {e}", dir.join(FILES[1]).display())))?;
    rng::set_states(&named(FILES[2])?, vs.device())
}

/// Differences in shape between a checkpoint's model and a config's, e.g.
/// `model.n_layer: 2 in the checkpoint, 3 in the config`.
pub fn shape_changes(saved: &GptConfig, now: &GptConfig) -> Vec<String> {
    let fields: [(&str, String, String); 6] = [
        ("n_layer", saved.n_layer.to_string(), now.n_layer.to_string()),
        ("n_head", saved.n_head.to_string(), now.n_head.to_string()),
        ("n_embd", saved.n_embd.to_string(), now.n_embd.to_string()),
        ("block_size", saved.block_size.to_string(), now.block_size.to_string()),
        ("vocab_size", saved.vocab_size.to_string(), now.vocab_size.to_string()),
        ("bias", saved.bias.to_string(), now.bias.to_string()),
    ];
    fields.into_iter().filter(|(_, a, b)| a != b).map(|(k, a, b)| format!("model.{k}: {a} in the checkpoint, {b} in the config")).collect()
}

/// Deletes what the retention policy no longer keeps, and stale temporary folders.
pub fn prune(run_dir: &Path, cfg: &CheckpointConfig, val_losses: &BTreeMap<u64, f64>) {
    let all = list(run_dir);
    let steps: Vec<(u64, Option<f64>)> = all.iter().map(|(s, _)| (*s, val_losses.get(s).copied())).collect();
    for step in retention(&steps, cfg.keep, cfg.keep_best) {
        if let Some((_, dir)) = all.iter().find(|(s, _)| *s == step) {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                tracing::warn!("cannot remove old checkpoint {}: {e}", dir.display());
            }
        }
    }
}

/// Removes temporary folders a killed writer left behind.
pub fn clean_partial(run_dir: &Path) {
    for e in std::fs::read_dir(checkpoints_dir(run_dir)).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

