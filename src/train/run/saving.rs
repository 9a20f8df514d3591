//! Owns what a run leaves on disk: checkpoints and the final weights.
//! Keeps: rank 0 writes, the ranks agree; each write is retried after an OOM.
use super::*;

/// Attempts at writing a checkpoint or the final weights when they run out of memory.
const WRITE_ATTEMPTS: u32 = 4;

impl Run<'_> {
    /// A checkpoint from which the run resumes at `next_step`, written for `reason`; old ones
    /// are pruned. Rank 0 writes it and records what it cost; the ranks wait for it together.
    pub fn checkpoint(&mut self, next_step: u64, reason: checkpoint::Reason) -> Result<()> {
        // Every rank knows it: all skip together, before the barrier.
        if self.checkpointed == Some(next_step) {
            return Ok(());
        }
        let started = Instant::now();
        // Sharded: every rank takes part in gathering the whole state.
        let full = self.gathered_state(next_step)?;
        let written = if self.lead {
            self.write_checkpoint(next_step, &full)
        } else {
            Ok(None)
        };
        // Agreed, not a bare barrier: a write that failed on rank 0 (an OOM past its retries
        // included) fails every rank alike, at once.
        let dir = match &self.pg {
            Some(pg) => pg.agree(Topic::CheckpointWrite, written)?,
            None => written?,
        };
        self.checkpointed = Some(next_step);
        self.progress.other_done(Other::Checkpoint);
        let cost = started.elapsed();
        let (interval_s, stretched) = self.clock.checkpointed(cost);
        let Some(dir) = dir else { return Ok(()) };
        let bytes = checkpoint::size_on_disk(&dir);
        tracing::info!(
            "checkpoint {} ({}, {:.2} s, {})",
            dir.display(),
            reason.name(),
            cost.as_secs_f64(),
            memory::human_bytes(bytes)
        );
        if let (true, Some(i)) = (stretched, interval_s) {
            tracing::warn!(
                "checkpoint.every_minutes: a checkpoint takes {:.1} s, so the clock waits {:.1} min \
                 instead of {}, keeping checkpoints under 1% of wall time",
                cost.as_secs_f64(),
                i / 60.0,
                self.cfg.raw.checkpoint.every_minutes
            );
        }
        self.write(&Record::Checkpoint {
            step: next_step.saturating_sub(1),
            next_step,
            reason,
            seconds: cost.as_secs_f64(),
            bytes,
            interval_s,
        })
    }

    /// The optimizer's whole state, for a checkpoint (a sharded one gathered, its buffer's
    /// allocation agreed and retried like a write).
    fn gathered_state(&mut self, step: u64) -> Result<FullState> {
        let pg = self.pg.clone();
        let agree = |r: Result<()>| match &pg {
            Some(pg) => pg.agree(Topic::StateGather, r),
            None => r,
        };
        self.retrying_oom(step, |run| run.opt.full_state(&agree))
    }

    /// Rank 0's write; returns the checkpoint's folder.
    fn write_checkpoint(&mut self, next_step: u64, opt_state: &FullState) -> Result<Option<PathBuf>> {
        let c = &self.cfg.raw;
        let state = TrainState {
            format: checkpoint::FORMAT,
            next_step,
            samples_seen: next_step * c.train.global_batch_size() as u64,
            policy: self.guard.policy.clone(),
            eval_policy: self.eval_guard.policy.clone(),
            val_loss: self.summary.val_loss,
            eval_history: self.eval_history.clone(),
            model: self.task.fingerprint(),
            extra: self.extra_state(),
            files: Default::default(),
        };
        let dir = self.retrying_oom(next_step, |run| {
            checkpoint::save(&run.run_dir, &state, run.task.as_ref(), &opt_state.tensors, run.device)
        })?;
        self.verified.insert(next_step, true);
        let verified = &mut self.verified;
        checkpoint::prune(&self.run_dir, &c.checkpoint, &self.eval_history, |step, dir| {
            *verified.entry(step).or_insert_with(|| checkpoint::verify(dir).is_ok())
        });
        Ok(Some(dir))
    }

    /// The rungs climbed and the loss scale, for checkpoints.
    fn extra_state(&self) -> BTreeMap<String, serde_json::Value> {
        let mut extra = BTreeMap::new();
        extra.insert("precision".into(), serde_json::json!(self.precision));
        extra.insert(
            "activation_checkpointing".into(),
            serde_json::json!(self.task.activation_checkpointing() == Some(true)),
        );
        if self.opt.shard() != Shard::None {
            extra.insert("shard".into(), serde_json::json!(self.opt.shard()));
        }
        // The fused-loss rung, when climbed (a configured loss is the config's to change).
        if self.cfg.raw.model.kind == ModelKind::Gpt
            && self
                .task
                .loss_kind()
                .is_some_and(|l| l != self.cfg.raw.model.gpt().loss)
        {
            extra.insert("loss".into(), serde_json::json!(LossKind::Fused.name()));
        }
        if let Some(state) = self.task.host_rng_state() {
            extra.insert("host_rng".into(), state);
        }
        if let Some((scale, tracker)) = self.scaler.as_ref().map(Scaler::state) {
            extra.insert("loss_scale".into(), serde_json::json!(scale));
            extra.insert("growth_tracker".into(), serde_json::json!(tracker));
        }
        extra
    }

    /// The final weights, `model.safetensors` (parameters and buffers, by name).
    pub fn save_weights(&mut self) -> Result<()> {
        // Test-only: `OOMGUARD_TEST_RANK_WEIGHTS=1` has every other rank write its own copy,
        // `model.rank-R.safetensors`, so a test can see that the ranks hold one set.
        let path = match self.pg.as_ref().map(|p| p.rank) {
            Some(r) if r > 0 && test_hook!("OOMGUARD_TEST_RANK_WEIGHTS").is_some() => {
                self.run_dir.join(format!("model.rank-{r}.safetensors"))
            }
            _ if !self.lead => return Ok(()),
            _ => self.run_dir.join("model.safetensors"),
        };
        let step = self.next_step;
        self.retrying_oom(step, |run| task::tensors::save(&run.task.state(), &path))
    }

    /// Runs a write that allocates (copies to the CPU, RNG state) again after an OOM,
    /// recording each one.
    fn retrying_oom<T>(&mut self, step: u64, mut write: impl FnMut(&Self) -> Result<T>) -> Result<T> {
        let mut attempt = 1;
        loop {
            match write(self) {
                Err(Error::Oom(oom)) if attempt < WRITE_ATTEMPTS => {
                    tracing::warn!(
                        "out of memory writing at step {step} (attempt {attempt} of {WRITE_ATTEMPTS}): {}; retrying",
                        oom.message
                    );
                    self.guard.note_oom(step, &oom, Phase::Checkpoint);
                    memory::empty_cache(self.device)?;
                    for e in self.guard.drain_events() {
                        self.write(&Record::from(e))?;
                    }
                    attempt += 1;
                }
                other => return other,
            }
        }
    }
}
