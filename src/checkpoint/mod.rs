//! Owns checkpoints: `run_dir/checkpoints/step-NNNNNNNN/` with the model, optimizer, RNG and
//! state.json (the size and CRC32 of every file, a sharded optimizer's files and layout,
//! written last).
//! Keeps: built in a temporary folder and renamed into place, so the previous one stays valid.
pub mod clock;
mod retention;
pub mod shards;

use crate::rng;

pub use clock::Clock;
pub use retention::{retention, Candidate};
pub use shards::ShardLayout;

use oomguard_report::atomic;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::ConfigError;
use crate::error::{Error, Result};
use crate::guard::Policy;
use crate::optim::AdamW;
use crate::task::{tensors, Fingerprint, Task};
use tch::Tensor;

/// The `checkpoint` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Write a checkpoint every this many steps (0: by the clock below only, and when stopped
    /// by a signal, when a step cannot fit, and at the end).
    pub every_steps: u64,
    /// Also write one when this many minutes of wall time have passed since the last (0: off).
    /// Stretched, and said in the log, if checkpoints would take more than 1% of wall time: at
    /// most to 6 x this and to 60 minutes (a longer setting is kept as it is).
    pub every_minutes: f64,
    /// Keep the newest this many checkpoints...
    pub keep: usize,
    /// ...and also the one with the best evaluation loss.
    pub keep_best: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            every_steps: 0,
            every_minutes: 10.0,
            keep: 3,
            keep_best: true,
        }
    }
}

impl CheckpointConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.every_minutes >= 0.0 && self.every_minutes.is_finite()) {
            return Err(ConfigError::invalid(
                "checkpoint.every_minutes",
                format!(
                    "is {}; give minutes of wall time (0 turns the clock off)",
                    self.every_minutes
                ),
            ));
        }
        if self.keep == 0 {
            return Err(ConfigError::invalid(
                "checkpoint.keep",
                "is 0; keep at least 1 checkpoint",
            ));
        }
        Ok(())
    }
}

/// The version of state.json this build writes and reads (2: any model kind, by
/// fingerprint; the evaluation history). A sharded optimizer's checkpoint is
/// `FORMAT_SHARDED`, so that a build that knows only whole states refuses it by its format.
pub const FORMAT: u32 = 2;
pub const FORMAT_SHARDED: u32 = 3;
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
    /// Evaluation losses by the step a checkpoint taken right after would resume at, for
    /// `keep_best` across resumes.
    #[serde(default)]
    pub eval_history: BTreeMap<u64, f64>,
    /// The model's shape: a config whose model differs is refused, naming each difference.
    pub model: Fingerprint,
    /// State a run's own components keep (the fp16 loss scale, ...), by name.
    #[serde(default)]
    pub extra: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    pub files: BTreeMap<String, FileSum>,
    /// A sharded optimizer's layout: one file per rank (`ShardLayout::files`, each in
    /// `files`), and `optimizer.safetensors` holds only the step counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<ShardLayout>,
    /// The manifest's own CRC32: of this state serialised (pretty) without this field, which
    /// `finish` writes last and `verify` checks (a manifest without one, from an older build,
    /// is read as it is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_crc32: Option<u32>,
}

/// The manifest's text with its own CRC32: `body` (the state serialised without
/// `manifest_crc32`, as written) with `"manifest_crc32": CRC` appended as its last field.
fn with_own_crc(body: &str) -> String {
    let crc = crc32fast::hash(body.as_bytes());
    let open = body.trim_end().strip_suffix('}').unwrap_or(body).trim_end();
    format!("{open},\n  \"manifest_crc32\": {crc}\n}}")
}

/// `with_own_crc` undone: the body whose CRC32 the manifest claims, or None when its last
/// field is not that claim exactly (the text was changed there).
fn body_of(text: &str, crc: u32) -> Option<String> {
    let open = text.strip_suffix(&format!(",\n  \"manifest_crc32\": {crc}\n}}"))?;
    Some(format!("{open}\n}}"))
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileSum {
    pub bytes: u64,
    pub crc32: u32,
}

pub fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

/// Writes a checkpoint of `state` atomically; returns its folder. A valid checkpoint of the
/// same step is kept as it is; a corrupt one is replaced (the new one is complete before the
/// old one goes).
/// `opt_state`: the optimizer's `state()` (unsharded: the whole; the sharded path writes
/// the step counts here and each rank's shard with `shards::write`).
pub fn save(
    run_dir: &Path,
    state: &TrainState,
    task: &dyn Task,
    opt_state: &[(String, Tensor)],
    device: tch::Device,
) -> Result<PathBuf> {
    let tmp = private_tmp("step", state.next_step);
    let begun = begin(run_dir, state.next_step, &tmp)?;
    if begun.skip {
        return Ok(begun.final_dir);
    }
    write_common(&begun.tmp, task, opt_state, device)?;
    finish(&begun, state, &[])
}

/// A checkpoint being written: its temporary folder, where it goes, and whether it
/// replaces a corrupt one there (`skip`: a valid one is there already).
pub struct Begun {
    pub tmp: PathBuf,
    pub final_dir: PathBuf,
    replaces: bool,
    pub skip: bool,
}

fn io_err(what: &str, p: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let m = format!("{what} {}", p.display());
    move |e: std::io::Error| Error::io(m, e)
}

/// A temporary folder's name for step `next_step`'s `what`, this writer's alone among every
/// process on every node that shares the run directory (host, process, a count): two
/// survivors saving one step never write into one folder, though containers on two nodes
/// often give their workers the same process id.
fn private_tmp(what: &str, next_step: u64) -> String {
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let host: String = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.')
        .take(64)
        .collect();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!(".tmp-{what}-{next_step:08}-{host}-{}-{nanos}-{n}", std::process::id())
}

/// The temporary folder every rank of a sharded save writes into (all agree on it: the
/// name is the step's), `begin`'s `tmp_name` there.
pub fn shard_tmp(next_step: u64) -> String {
    format!(".tmp-step-{next_step:08}-shards")
}

/// Creates the empty temporary folder `tmp_name` for step `next_step`'s checkpoint.
pub fn begin(run_dir: &Path, next_step: u64, tmp_name: &str) -> Result<Begun> {
    let parent = checkpoints_dir(run_dir);
    let final_dir = parent.join(format!("step-{next_step:08}"));
    let replaces = match final_dir.exists().then(|| verify(&final_dir)) {
        Some(Ok(s)) if s.next_step != next_step => {
            tracing::warn!(
                "replacing {}: it held step {} (copied or renamed), not this step's state",
                final_dir.display(),
                s.next_step
            );
            true
        }
        Some(Ok(_)) => {
            let tmp = parent.join(tmp_name);
            return Ok(Begun {
                tmp,
                final_dir,
                replaces: false,
                skip: true,
            }); // already saved
        }
        Some(Err(e)) => {
            tracing::warn!("replacing a corrupt checkpoint: {e}");
            true
        }
        None => false,
    };
    // A folder, renamed whole into place: tempfile's `NamedTempFile::persist` is for files, and
    // `clean_partial` finds a killed save's leftovers by this `.tmp-` name.
    let tmp = parent.join(tmp_name);
    let _ = std::fs::remove_dir_all(&tmp); // a failed attempt's leftovers
    std::fs::create_dir_all(&tmp).map_err(io_err("cannot create", &tmp))?;
    Ok(Begun {
        tmp,
        final_dir,
        replaces,
        skip: false,
    })
}

/// The model, the optimizer's `opt_state` and the generators into `tmp` (each file fsynced).
pub fn write_common(tmp: &Path, task: &dyn Task, opt_state: &[(String, Tensor)], device: tch::Device) -> Result<()> {
    tensors::save(&task.state(), &tmp.join(FILES[0]))?;
    tensors::save(opt_state, &tmp.join(FILES[1]))?;
    tensors::save(&rng::get_states(device)?, &tmp.join(FILES[2]))
}

/// The manifest, written last (`shard_sums`: the shard files the ranks wrote, with their
/// sizes and CRC32s, as `state.shards` names them), then the folder renamed into place.
pub fn finish(begun: &Begun, state: &TrainState, shard_sums: &[(String, FileSum)]) -> Result<PathBuf> {
    let (tmp, final_dir) = (&begun.tmp, &begun.final_dir);
    let parent = final_dir.parent().unwrap_or(Path::new("."));
    let mut state = state.clone();
    state.format = if state.shards.is_some() { FORMAT_SHARDED } else { FORMAT };
    for f in FILES {
        state.files.insert(f.to_string(), checksum(&tmp.join(f))?);
    }
    for (f, sum) in shard_sums {
        state.files.insert(f.clone(), sum.clone());
    }
    state.manifest_crc32 = None;
    let manifest = tmp.join("state.json");
    let body = serde_json::to_string_pretty(&state).map_err(|e| Error::Data(format!("encoding state.json: {e}")))?;
    let text = with_own_crc(&body);
    std::fs::write(&manifest, text)
        .and_then(|()| atomic::sync(&manifest))
        .map_err(io_err("cannot write", &manifest))?;
    atomic::sync_dir(tmp).map_err(io_err("cannot fsync", tmp))?;
    // A directory cannot be renamed over a non-empty one: the corrupt one steps aside first
    // (a kill between the two renames leaves the new one complete under its .tmp- name).
    let aside = parent.join(private_tmp("corrupt-step", state.next_step));
    if begun.replaces {
        std::fs::rename(final_dir, &aside).map_err(io_err("cannot move aside", final_dir))?;
    }
    if let Err(e) = std::fs::rename(tmp, final_dir) {
        return another_writers(final_dir, tmp, &state).ok_or_else(|| io_err("cannot rename into", final_dir)(e));
    }
    atomic::sync_dir(parent).map_err(io_err("cannot fsync", parent))?;
    if begun.replaces {
        let _ = std::fs::remove_dir_all(&aside);
    }
    Ok(final_dir.clone())
}

/// After a failed rename into `final_dir`: if another process (a survivor on another node)
/// saved the same step there first, its checkpoint stays and this one's `tmp` goes. The
/// next round's rank 0 reads that one and hands it to every rank, so survivors whose bits
/// differ (nodes of different CPUs) still resume as one state; the difference is logged.
fn another_writers(final_dir: &Path, tmp: &Path, ours: &TrainState) -> Option<PathBuf> {
    let theirs = verify(final_dir).ok()?;
    let _ = std::fs::remove_dir_all(tmp);
    let differ: Vec<&str> = FILES
        .into_iter()
        .filter(|f| theirs.files.get(*f) != ours.files.get(*f))
        .collect();
    if !differ.is_empty() {
        tracing::warn!(
            "{}: another process saved this step first, and its {} differ from this one's; the next round \
             resumes from it on every rank",
            final_dir.display(),
            differ.join(", ")
        );
    }
    Some(final_dir.to_path_buf())
}

fn checksum(path: &Path) -> Result<FileSum> {
    let mut f = File::open(path).map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileSum {
        bytes,
        crc32: hasher.finalize(),
    })
}

/// Reads and verifies a checkpoint's manifest and files. The error names the bad file.
pub fn verify(dir: &Path) -> Result<TrainState> {
    let bad = |p: &Path, why: String| Error::Checkpoint(format!("{}: {why}", p.display()));
    let manifest = dir.join("state.json");
    let text = std::fs::read_to_string(&manifest).map_err(|e| {
        bad(
            &manifest,
            format!("cannot read it ({e}); is {} a checkpoint?", dir.display()),
        )
    })?;
    let state: TrainState = serde_json::from_str(&text).map_err(|e| bad(&manifest, format!("corrupt ({e})")))?;
    if let Some(want) = state.manifest_crc32 {
        if body_of(&text, want).is_none_or(|body| crc32fast::hash(body.as_bytes()) != want) {
            return Err(bad(
                &manifest,
                "corrupt: its own CRC32 (manifest_crc32) does not match its contents; resume from another \
                 checkpoint (--resume-from) or delete this one"
                    .into(),
            ));
        }
    }
    let want_format = if state.shards.is_some() { FORMAT_SHARDED } else { FORMAT };
    if state.format != want_format {
        return Err(bad(&manifest, format!("format {} is not {want_format}", state.format)));
    }
    // Every file, the shards included: a missing or corrupt one is refused by name.
    let shard_files = state.shards.map(|l| l.files()).unwrap_or_default();
    for f in FILES.iter().map(|f| f.to_string()).chain(shard_files) {
        let p = dir.join(&f);
        let want = state
            .files
            .get(&f)
            .ok_or_else(|| bad(&manifest, format!("lists no {f}")))?;
        let got = checksum(&p).map_err(|e| bad(&p, e.to_string()))?;
        if got.bytes != want.bytes {
            return Err(bad(
                &p,
                format!("truncated or changed: {} bytes, expected {}", got.bytes, want.bytes),
            ));
        }
        if got.crc32 != want.crc32 {
            return Err(bad(&p, "corrupt: its CRC32 does not match state.json".into()));
        }
    }
    Ok(state)
}

/// Why a checkpoint was written (`metrics.jsonl`'s `checkpoint` event, the log).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// `checkpoint.every_steps`.
    EverySteps,
    /// `checkpoint.every_minutes`: the clock.
    EveryMinutes,
    /// SIGINT or SIGTERM.
    Signal,
    /// A step that cannot fit even at micro-batch 1 (before exit 3).
    Infeasible,
    /// The last step.
    End,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::EverySteps => "every_steps",
            Reason::EveryMinutes => "every_minutes",
            Reason::Signal => "signal",
            Reason::Infeasible => "infeasible",
            Reason::End => "end",
        }
    }
}

/// The bytes a checkpoint folder's files hold on disk.
pub fn size_on_disk(dir: &Path) -> u64 {
    let files = std::fs::read_dir(dir).into_iter().flatten().flatten();
    files.filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum()
}

/// Checkpoint folders in `run_dir`, oldest first, with their steps.
pub fn list(run_dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(checkpoints_dir(run_dir))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((step_named(&e.path())?, e.path())))
        .collect();
    out.sort();
    out
}

/// The step a checkpoint folder's name (`step-N`) says.
pub fn step_named(dir: &Path) -> Option<u64> {
    dir.file_name()?.to_str()?.strip_prefix("step-")?.parse().ok()
}

/// The newest checkpoint that verifies; a corrupt newer one is skipped, saying so, and so
/// is one whose name's step is not its state's (a copy or a rename: resumed, it would prune
/// the checkpoints after the step it holds, valid ones among them).
pub fn newest_valid(run_dir: &Path) -> Result<(PathBuf, TrainState)> {
    let all = list(run_dir);
    let mut newest_error = None;
    for (step, dir) in all.iter().rev() {
        let named = |state: TrainState| match state.next_step == *step {
            true => Ok(state),
            false => Err(Error::Checkpoint(format!(
                "{}: its state.json holds step {}, not the {step} its name says (copied or renamed); \
                 resume from it by name (--resume-from) if it is the one",
                dir.display(),
                state.next_step
            ))),
        };
        match verify(dir).and_then(named) {
            Ok(state) => return Ok((dir.clone(), state)),
            Err(e) => {
                tracing::warn!("skipping checkpoint: {e}; trying an older one");
                newest_error.get_or_insert(e);
            }
        }
    }
    // All corrupt: the error names the newest one's bad file.
    Err(Error::Checkpoint(format!(
        "{}: no valid checkpoint to resume from{}",
        checkpoints_dir(run_dir).display(),
        newest_error.map_or(String::new(), |e| format!(" (none is valid; the newest: {e})"))
    )))
}

/// Loads a verified checkpoint's tensors into the model and optimizer. An OOM while
/// loading comes back as `Error::Oom`; anything else names the file. A sharded checkpoint's
/// moments are read from its shard files a chunk at a time: the whole state by an unsharded
/// optimizer, none by a sharded one (each rank reads its own: `AdamW::load_own_shard`).
pub fn restore(dir: &Path, task: &dyn Task, opt: &mut AdamW, device: tch::Device) -> Result<()> {
    let bad = |f: &str, why: String| Error::Checkpoint(format!("{}: {why}", dir.join(f).display()));
    let read = |f: &str| tensors::read(&dir.join(f)).map_err(|why| oom_or(why, |w| bad(f, w)));
    tensors::copy_into(&read(FILES[0])?, &task.state()).map_err(|why| oom_or(why, |w| bad(FILES[0], w)))?;
    let mut shards = match manifest(dir)?.shards {
        Some(l) => Some(shards::Reader::new(dir, l)?),
        None => None,
    };
    opt.load_state(&read(FILES[1])?, shards.as_mut()).map_err(|e| match e {
        e @ (Error::Oom(_) | Error::Checkpoint(_)) => e,
        e => bad(FILES[1], e.to_string()),
    })?;
    rng::set_states(&read(FILES[2])?, device)
}

/// A checkpoint's state.json, unverified (`verify` checks the files too).
pub fn manifest(dir: &Path) -> Result<TrainState> {
    let p = dir.join("state.json");
    let bad = |why: String| Error::Checkpoint(format!("{}: {why}", p.display()));
    let text = std::fs::read_to_string(&p).map_err(|e| bad(format!("cannot read it ({e})")))?;
    serde_json::from_str(&text).map_err(|e| bad(format!("corrupt ({e})")))
}

/// An OOM message stays an OOM (the caller decides); other failures become `other(why)`.
fn oom_or(why: String, other: impl Fn(String) -> Error) -> Error {
    match crate::error::classify_oom(&why) {
        Some(o) => Error::Oom(o),
        None => other(why),
    }
}

/// Deletes what the retention policy no longer keeps. `valid(step)` says whether a
/// checkpoint verifies (the caller caches it: verifying reads every byte).
pub fn prune(
    run_dir: &Path,
    cfg: &CheckpointConfig,
    eval_history: &BTreeMap<u64, f64>,
    mut valid: impl FnMut(u64, &Path) -> bool,
) {
    let all = list(run_dir);
    let candidates: Vec<retention::Candidate> = all
        .iter()
        .map(|(s, dir)| retention::Candidate {
            step: *s,
            loss: eval_history.get(s).copied(),
            valid: valid(*s, dir),
        })
        .collect();
    for step in retention(&candidates, cfg.keep, cfg.keep_best) {
        if let Some((_, dir)) = all.iter().find(|(s, _)| *s == step) {
            if !candidates.iter().any(|c| c.step == step && c.valid) {
                tracing::warn!("removing corrupt checkpoint {}", dir.display());
            }
            if let Err(e) = std::fs::remove_dir_all(dir) {
                tracing::warn!("cannot remove old checkpoint {}: {e}", dir.display());
            }
        }
    }
}

/// A checkpoint's `extra` key: where the run that wrote it forked (`--resume-from`): the step
/// and the folder it resumed from, carried on by every later start that resumes the fork.
pub const FORKED_FROM: &str = "forked_from";

/// `FORKED_FROM`'s value for a fork from `from` at `step`.
pub fn fork_record(step: u64, from: &Path) -> Option<serde_json::Value> {
    let dir = std::fs::canonicalize(from).ok()?;
    Some(serde_json::json!({"step": step, "dir": dir.display().to_string()}))
}

/// Whether the fork from `from` has written a checkpoint of its own in `run_dir`: its newest
/// checkpoint says it forked from that folder, at an earlier step. A launcher's restart then
/// continues the fork; a first attempt that died before it saved left the old future's
/// checkpoints, which are not the fork's.
pub fn fork_saved(run_dir: &Path, from: &Path) -> bool {
    let Some((step, newest)) = list(run_dir).pop() else {
        return false;
    };
    let Some(theirs) = manifest(&newest).ok().and_then(|s| s.extra.get(FORKED_FROM).cloned()) else {
        return false;
    };
    let ours = fork_record(0, from).and_then(|r| r.get("dir").cloned());
    theirs.get("dir").is_some()
        && theirs.get("dir") == ours.as_ref()
        && theirs["step"].as_u64().is_some_and(|at| step > at)
}

/// Deletes the checkpoints after `step`: a run resumed from an older one forks, and the
/// later ones belong to the future it left (the next `--resume` would load them); never
/// `resumed_from`.
pub fn prune_after(run_dir: &Path, step: u64, resumed_from: &Path) {
    let from = std::fs::canonicalize(resumed_from).ok();
    let others = |dir: &PathBuf| from.is_none() || std::fs::canonicalize(dir).ok() != from;
    for (s, dir) in list(run_dir).into_iter().filter(|(s, dir)| *s > step && others(dir)) {
        tracing::warn!(
            "removing checkpoint {} (step {s}): this run continues from step {step} and forks from it",
            dir.display()
        );
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!("cannot remove {}: {e}", dir.display());
        }
    }
}

/// Removes temporary folders and files a killed writer left behind.
pub fn clean_partial(run_dir: &Path) {
    atomic::remove_leftovers(run_dir);
    for e in std::fs::read_dir(checkpoints_dir(run_dir))
        .into_iter()
        .flatten()
        .flatten()
    {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod own_crc_tests {
    use super::*;

    #[test]
    fn the_manifests_own_crc_is_of_its_text_and_any_change_breaks_it() {
        let body = "{\n  \"format\": 2,\n  \"extra\": {\n    \"loss_scale\": 2048.0\n  }\n}";
        let text = with_own_crc(body);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let crc = v["manifest_crc32"].as_u64().unwrap() as u32;
        assert_eq!(crc, crc32fast::hash(body.as_bytes()));
        assert_eq!(body_of(&text, crc).as_deref(), Some(body));
        let changed = text.replace("2048.0", "2049.0");
        assert_ne!(crc32fast::hash(body_of(&changed, crc).unwrap().as_bytes()), crc);
        assert_eq!(body_of(&text, crc + 1), None, "a claim edited is not the claim");
    }
}
