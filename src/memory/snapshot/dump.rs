//! Owns writing `RUN_DIR/oom/NNN/`.
//! Keeps: a kill mid-dump leaves no torn folder, and a failed dump is a warning that never
//! changes what the run does or its exit code.
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

use super::summary::{self, Breakdown, Category, Context, Roles};
use super::{Capture, SnapshotConfig, SnapshotMode};
use crate::error::Phase;
use crate::memory;
use crate::plan::Estimate;
use oomguard_report::atomic;

/// Where an OOM happened, as the guard knows it.
#[derive(Debug, Clone, Default)]
pub struct OomAt {
    pub step: u64,
    pub phase: Option<Phase>,
    pub micro_batch_index: Option<usize>,
    pub micro_batch_size: usize,
    pub requested_bytes: Option<u64>,
}

/// A dump written: its folder relative to the run directory, and the paragraph.
#[derive(Debug, Clone)]
pub struct Dumped {
    pub folder: String,
    pub text: String,
    pub summary: Breakdown,
}

pub struct Dumper {
    run_dir: PathBuf,
    cfg: SnapshotConfig,
    device: Device,
    next: u32,
    /// `.rankR` for a data-parallel rank other than 0.
    suffix: String,
    params: Vec<Tensor>,
    /// The optimizer state's addresses, not its tensors: holding them would keep state that
    /// a sharding rung frees alive (`set_optimizer_state` follows every change).
    optimizer_state: Vec<u64>,
    plan: Option<Estimate>,
}

/// A defined tensor's data address (none for an empty one).
fn address(t: &Tensor) -> Option<u64> {
    t.defined().then(|| t.data_ptr() as u64).filter(|&p| p != 0)
}

impl Dumper {
    /// Starts recording; `None` with `memory.snapshot: off`. `params` (shallow copies) and
    /// `optimizer_state` name the tensors whose bytes are attributed by address.
    pub fn new(
        run_dir: &Path,
        cfg: SnapshotConfig,
        device: Device,
        params: Vec<Tensor>,
        optimizer_state: &[Tensor],
        plan: Option<Estimate>,
        rank: Option<usize>,
    ) -> Option<Dumper> {
        if cfg.mode == SnapshotMode::Off {
            return None;
        }
        begin(cfg, device);
        let dir = run_dir.join("oom");
        if rank.unwrap_or(0) == 0 {
            remove_unfinished(&dir);
        }
        let next = existing(&dir) + 1;
        let suffix = rank.filter(|&r| r > 0).map(|r| format!(".rank{r}")).unwrap_or_default();
        Some(Dumper {
            run_dir: run_dir.to_path_buf(),
            cfg,
            device,
            next,
            suffix,
            params,
            optimizer_state: optimizer_state.iter().filter_map(address).collect(),
            plan,
        })
    }

    pub fn mode(&self) -> SnapshotMode {
        self.cfg.mode
    }

    /// The optimizer state now (after a sharding rung moved it).
    pub fn set_optimizer_state(&mut self, state: &[Tensor]) {
        self.optimizer_state = state.iter().filter_map(address).collect();
    }

    /// The roles' addresses now: the failed attempt's gradients are still alive.
    fn roles(&self) -> Roles {
        Roles {
            parameters: self.params.iter().filter_map(address).collect(),
            gradients: self.params.iter().filter_map(|p| address(&p.grad())).collect(),
            optimizer_state: self.optimizer_state.clone(),
        }
    }

    fn plan_at(&self, micro: Option<usize>) -> Option<BTreeMap<Category, u64>> {
        let (e, m) = (self.plan.as_ref()?, micro? as u64);
        let layers = if e.activation_checkpointing {
            e.n_layer * e.layer_input_per_sample + e.activations_per_layer_per_sample
        } else {
            e.n_layer * e.activations_per_layer_per_sample
        };
        let step = e.peak(micro?) as f64 / (1.0 + e.allocator_overhead);
        Some(BTreeMap::from([
            (Category::Parameters, e.params_bytes),
            (Category::Gradients, e.grads_bytes),
            (Category::OptimizerState, e.optimizer_bytes),
            (Category::Activations, (layers + e.embeddings_per_sample) * m),
            (Category::LossLogits, e.logits_per_sample * m),
            (
                Category::AllocatorReserve,
                (step * e.allocator_overhead) as u64 + e.workspace_bytes,
            ),
        ]))
    }

    /// Right after a failed attempt, before its cleanup: the capture taken at the failure.
    pub fn on_oom(&mut self, at: &OomAt) -> Option<Dumped> {
        let ctx = Context {
            step: Some(at.step),
            phase: at.phase,
            micro_batch_index: at.micro_batch_index,
            micro_batch_size: Some(at.micro_batch_size),
            request_bytes: Some(at.requested_bytes.unwrap_or(0)),
            ..Default::default()
        };
        self.dump(ctx, true)
    }

    /// `always`: the memory as it is at the end of the run.
    pub fn at_end(&mut self, step: u64, micro_batch_size: usize) -> Option<Dumped> {
        if self.cfg.mode != SnapshotMode::Always {
            return None;
        }
        self.dump(
            Context {
                step: Some(step),
                micro_batch_size: Some(micro_batch_size),
                ..Default::default()
            },
            false,
        )
    }

    fn dump(&mut self, mut ctx: Context, oom: bool) -> Option<Dumped> {
        let t0 = std::time::Instant::now();
        let result = self.capture(&mut ctx, oom).and_then(|(summary, pickle)| {
            let folder = self.write(&summary, &pickle)?;
            Ok(Dumped {
                folder,
                text: summary.text.clone(),
                summary,
            })
        });
        match result {
            Ok(d) => {
                tracing::info!(
                    "memory snapshot: {} ({:.2} s)",
                    self.run_dir.join(&d.folder).display(),
                    t0.elapsed().as_secs_f64()
                );
                Some(d)
            }
            Err(e) => {
                tracing::warn!(
                    "could not write the memory snapshot under {}: {e} (the run goes on as it would have)",
                    self.run_dir.join("oom").display()
                );
                None
            }
        }
    }

    fn capture(&self, ctx: &mut Context, oom: bool) -> io::Result<(Breakdown, Vec<u8>)> {
        let names = |id: i32| super::name(id);
        ctx.device = format!("{:?}", self.device).to_lowercase();
        let cap = match self.device {
            #[cfg(oomguard_cuda_snapshot)]
            Device::Cuda(_) => {
                return super::cuda::capture(ctx, oom, &self.roles(), self.plan_at(ctx.micro_batch_size))
            }
            #[cfg(not(oomguard_cuda_snapshot))]
            Device::Cuda(_) => {
                return Err(io::Error::other(
                    "this build has no CUDA memory snapshot (built against a libtorch without CUDA)",
                ))
            }
            _ => {
                let cap = if oom {
                    super::take_oom().map_err(io::Error::other)?
                } else {
                    None
                };
                match cap {
                    Some(cap) => cap,
                    None => super::now().map_err(io::Error::other)?,
                }
            }
        };
        fill_cpu(ctx, &cap);
        let summary = summary::breakdown(&cap, &self.roles(), ctx, &names, self.plan_at(ctx.micro_batch_size));
        let pickle = super::pickle::pickled(&cap, &names, self.cfg.max_events).map_err(io::Error::other)?;
        Ok((summary, pickle))
    }

    /// Writes `oom/NNN/` whole; returns `oom/NNN`.
    fn write(&mut self, summary: &Breakdown, pickle: &[u8]) -> io::Result<String> {
        let oom = self.run_dir.join("oom");
        std::fs::create_dir_all(&oom)?;
        let name = format!("{:03}{}", self.next, self.suffix);
        // A folder renamed whole into place (tempfile's `persist` is for files): its leftovers
        // are found by this `.NAME.PID.tmp` name.
        let tmp = oom.join(format!(".{name}.{}.tmp", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir(&tmp)?;
        let json = serde_json::to_vec_pretty(summary).map_err(io::Error::other)?;
        atomic::write(&tmp.join("snapshot.pickle"), pickle)?;
        if let Some(ms) = test_hook!("OOMGUARD_TEST_DUMP_PAUSE_MS").and_then(|v| v.parse().ok()) {
            // Tests kill a run here, mid-dump.
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        atomic::write(&tmp.join("summary.json"), &json)?;
        atomic::write(&tmp.join("summary.txt"), format!("{}\n", summary.text).as_bytes())?;
        std::fs::rename(&tmp, oom.join(&name))?;
        atomic::sync_dir(&oom)?;
        self.next += 1;
        Ok(format!("oom/{name}"))
    }
}

/// The CPU's figures: the budget, what it leaves free, and what asked.
fn fill_cpu(ctx: &mut Context, cap: &Capture) {
    if ctx.request_bytes.is_some() && cap.info.request > 0 {
        ctx.request_bytes = Some(cap.info.request as u64);
    }
    ctx.limit_bytes = u64::try_from(cap.info.budget).ok().or(memory::cpu_budget());
}

/// Starts recording (again: nothing changes), unless `off`. Before the model is made, so
/// that its parameters and the optimizer state are in the history.
pub fn begin(cfg: SnapshotConfig, device: Device) {
    if cfg.mode == SnapshotMode::Off {
        return;
    }
    // The CPU's history records on every device: batches and offloaded state live there.
    if let Err(e) = super::start(cfg.max_events) {
        tracing::warn!(
            "CPU memory history not started (memory.snapshot.max_events {}): {e}",
            cfg.max_events
        );
    }
    #[cfg(oomguard_cuda_snapshot)]
    if let Device::Cuda(_) = device {
        if let Err(e) = super::cuda::start(cfg.max_events) {
            tracing::warn!("CUDA memory history not started: {e}");
        }
    }
    let _ = device;
}

/// The highest `NNN` under `oom/` (0 when none).
fn existing(dir: &Path) -> u32 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.split('.').next().and_then(|d| d.parse::<u32>().ok()))
        })
        .max()
        .unwrap_or(0)
}

/// Temporary folders a killed dump left.
fn remove_unfinished(dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_name()
            .to_str()
            .is_some_and(|n| n.starts_with('.') && n.ends_with(".tmp"))
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}
