//! Owns what a run leaves on disk: checkpoints (sharded: a shard per rank) and the final
//! weights.
//! Keeps: rank 0 writes (sharded: each rank its shard, rank 0 the manifest last), the ranks
//! agree; each write is retried after an OOM.
use super::*;
use crate::checkpoint::FileSum;

/// Attempts at writing a checkpoint or the final weights when they run out of memory.
const WRITE_ATTEMPTS: u32 = 4;

/// Sharded checkpoints written by this process: every rank writes each one, in the same
/// order, so the count names a write's store keys alike on every rank.
static SHARDED_WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Run<'_> {
    /// A checkpoint from which the run resumes at `next_step`, written for `reason`; old ones
    /// are pruned. Rank 0 writes it (sharded: each rank writes its own shard of the moments
    /// too) and records what it cost; the ranks wait for it together.
    pub fn checkpoint(&mut self, next_step: u64, reason: checkpoint::Reason) -> Result<()> {
        // Every rank knows it: all skip together, before the barrier.
        if self.checkpointed == Some(next_step) {
            return Ok(());
        }
        let started = Instant::now();
        // Freed heap pages go back first, so that what the save touches shows as a rise.
        oomguard_host::memory::return_freed_memory();
        let resident = oomguard_host::memory::reset_peak_resident();
        // The records the checkpoint's step follows, on disk before it is (a failure warns:
        // the ranks must reach the agreement below alike; the checkpoint's own write decides).
        if let Some(Err(e)) = self.metrics.as_mut().map(MetricsWriter::sync) {
            tracing::warn!("{e}");
        }
        // Elastic: a stop on a signal is the launcher's, for a membership change; the next
        // round's state comes from this checkpoint, at the step boundary.
        self.handover = reason == checkpoint::Reason::Signal && crate::dist::elastic::enabled();
        let written = if self.opt.shard() != Shard::None && self.pg.is_some() {
            self.write_sharded(next_step)
        } else if self.lead {
            self.write_checkpoint(next_step).map(Some)
        } else {
            Ok(None)
        };
        let rise = resident
            .zip(oomguard_host::memory::peak_resident())
            .map(|(a, b)| b.saturating_sub(a));
        // Agreed, not a bare barrier: a write that failed on rank 0 (an OOM past its retries
        // included) fails every rank alike, at once.
        let (dir, rise) = match &self.pg {
            Some(pg) => {
                let dir = pg.agree(Topic::CheckpointWrite, written)?;
                // The most any rank's resident memory rose (-1: unknown there).
                let mut v = [rise.map_or(-1.0, |r| r as f64)];
                pg.exchange(Topic::CheckpointWrite, &mut v)?;
                (dir, (v[0] >= 0.0).then_some(v[0] as u64))
            }
            None => (written?, rise),
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
                "{}",
                checkpoint::clock::stretch_note(self.cfg.raw.checkpoint.every_minutes, i, cost.as_secs_f64())
            );
        }
        self.write(&Record::Checkpoint {
            step: next_step.saturating_sub(1),
            next_step,
            reason,
            seconds: cost.as_secs_f64(),
            bytes,
            interval_s,
            host_peak_rise_bytes: rise,
        })
    }

    /// Elastic: a peer is gone (`cause`). A rank that holds the whole state (parameters and
    /// optimizer state replicated: no sharding) saves it alone, as of the last step it
    /// finished, with no collective (its peers may be gone), so that the next round loses at
    /// most the step in flight; one rank a node writes (LOCAL_RANK 0), and the newest save
    /// wins at resume. Sharded state is not whole on any rank: the next round resumes from
    /// the newest checkpoint. Failing here changes nothing: it is logged.
    pub fn save_as_survivor(&mut self, cause: &Error) {
        // The step this rank committed is recorded the moment it committed (the optimizer's
        // own count): a peer lost in a collective after the commit (the loss sum, the guard's
        // inputs) leaves this rank holding step k's update, which it saves as k + 1's state,
        // never as k's (the next round would apply k twice).
        let committed = self.opt.last_step().map_or(0, |s| s + 1);
        if committed > self.next_step {
            self.record_committed(self.next_step);
            self.next_step = committed;
        }
        let next_step = self.next_step;
        if self.opt.shard() != Shard::None {
            tracing::warn!(
                "{cause}: the optimizer state is sharded, so no rank holds it whole; the next round resumes \
                 from the newest checkpoint"
            );
            return;
        }
        if crate::dist::local_rank().ok().flatten().unwrap_or(0) != 0 || self.checkpointed == Some(next_step) {
            return;
        }
        self.handover = true;
        // Survivors on other nodes may save the same step at once: the first one's stays
        // (`checkpoint::save`), and the next round's rank 0 hands it to every rank.
        match self.save_whole(next_step) {
            Ok(d) => tracing::warn!(
                "{cause}: saved this rank's state at step {next_step} for the next round: {}",
                d.display()
            ),
            Err(e) => tracing::error!("{cause}: could not save this rank's state for the next round: {e}"),
        }
    }

    /// Rank 0's write of a whole checkpoint; returns its folder.
    fn write_checkpoint(&mut self, next_step: u64) -> Result<PathBuf> {
        let dir = self.save_whole(next_step)?;
        Ok(self.written(next_step, dir))
    }

    /// The whole state, this rank's, as a checkpoint resuming at `next_step` (retried after
    /// an OOM); returns its folder.
    fn save_whole(&mut self, next_step: u64) -> Result<PathBuf> {
        let state = self.train_state(next_step);
        self.retrying_oom(next_step, |run| {
            let opt: Vec<(String, Tensor)> = (run.opt.state().into_iter())
                .map(|(n, t)| (n, t.shallow_clone()))
                .collect();
            checkpoint::save(&run.run_dir, &state, run.task.as_ref(), &opt, run.device)
        })
    }

    /// Sharded: every rank writes its shard of the moments into one temporary folder (named
    /// by the step: `checkpoint::shard_tmp`), rank 0 the model, the step counts and the
    /// generators, and, once every shard is fsynced and agreed, the manifest naming each
    /// shard with its size and CRC32; then rank 0 renames the folder into place. No rank
    /// gathers the state: each holds its shard and one chunk (`shards::CHUNK`).
    fn write_sharded(&mut self, next_step: u64) -> Result<Option<PathBuf>> {
        let pg = self
            .pg
            .clone()
            .ok_or_else(|| Error::Dist("a sharded checkpoint without a process group".into()))?;
        let tmp_name = checkpoint::shard_tmp(next_step);
        memory::snapshot::set_phase(Phase::Checkpoint, None);
        // 1. Rank 0: the folder (or the step's valid checkpoint, kept) and its own files.
        let begun = match self.lead {
            true => self
                .retrying_oom(next_step, |run| run.begin_sharded(next_step, &tmp_name))
                .map(Some),
            false => Ok(None),
        };
        let begun = pg.agree(Topic::CheckpointWrite, begun)?;
        let mut skip = [begun.as_ref().map_or(f64::NEG_INFINITY, |b| b.skip as u8 as f64)];
        pg.exchange(Topic::CheckpointWrite, &mut skip)?;
        if skip[0] == 1.0 {
            return Ok(begun.map(|b| self.written(next_step, b.final_dir)));
        }
        // 2. Every rank: its shard, fsynced, its size and CRC32 computed as it is written.
        let layout = (self.opt.shard_layout())
            .ok_or_else(|| Error::Dist("a sharded checkpoint of an optimizer that is not sharded".into()))?;
        let tmp = checkpoint::checkpoints_dir(&self.run_dir).join(&tmp_name);
        let path = tmp.join(layout.file(pg.rank));
        let sum = self
            .retrying_oom(next_step, |run| run.opt.write_shard(&path))
            .and_then(|s| {
                oomguard_report::atomic::sync_dir(&tmp)
                    .map(|()| s)
                    .map_err(|e| Error::io(format!("cannot fsync {}", tmp.display()), e))
            });
        // 3. Every shard's size and CRC32 to rank 0 through the store, a key per rank and
        // write (O(1) bytes for every other rank, whatever the world), so that no file is
        // read twice. Each rank publishes before the ranks agree: once they have, every key
        // is there, and rank 0 never waits in the store (which cannot tell it a rank died)
        // for one that a rank lost after the agreement would never write.
        let write = SHARDED_WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = |r: usize| format!("oomguard/checkpoint/{write}/{r}");
        shard_written_pause(pg.rank, next_step);
        let sum = sum.and_then(|s| {
            pg.share(&key(pg.rank), Some(format!("{} {}", s.bytes, s.crc32).as_bytes()))
                .map(|_| s)
        });
        pg.agree(Topic::CheckpointWrite, sum)?;
        let Some(begun) = begun else { return Ok(None) };
        // 4. Rank 0: the manifest, written last, and the rename.
        let files = (0..pg.world)
            .map(|r| {
                let got = String::from_utf8_lossy(&pg.share(&key(r), None)?).into_owned();
                let sum = got
                    .split_once(' ')
                    .and_then(|(b, c)| {
                        Some(FileSum {
                            bytes: b.parse().ok()?,
                            crc32: c.parse().ok()?,
                        })
                    })
                    .ok_or_else(|| {
                        Error::Dist(format!(
                            "rank {r}'s shard sum in the store is `{got}`, not a size and a CRC32"
                        ))
                    })?;
                Ok((layout.file(r), sum))
            })
            .collect::<Result<Vec<(String, FileSum)>>>()?;
        let mut state = self.train_state(next_step);
        state.shards = Some(layout);
        let dir = checkpoint::finish(&begun, &state, &files)?;
        Ok(Some(self.written(next_step, dir)))
    }

    /// Rank 0's part of a sharded checkpoint before the shards: the folder, the model, the
    /// step counts (the replicated part of the optimizer state) and the generators.
    fn begin_sharded(&self, next_step: u64, tmp_name: &str) -> Result<checkpoint::Begun> {
        let begun = checkpoint::begin(&self.run_dir, next_step, tmp_name)?;
        if !begun.skip {
            let steps: Vec<(String, Tensor)> = (self.opt.state().into_iter())
                .filter(|(n, _)| n.ends_with(".step"))
                .map(|(n, t)| (n, t.shallow_clone()))
                .collect();
            checkpoint::write_common(&begun.tmp, self.task.as_ref(), &steps, self.device)?;
        }
        Ok(begun)
    }

    /// What a checkpoint at `next_step` records besides its files.
    fn train_state(&self, next_step: u64) -> TrainState {
        let c = &self.cfg.raw;
        let mut extra = self.extra_state();
        if self.handover {
            extra.insert(SAVED_BY_SURVIVOR.into(), serde_json::json!(true));
        }
        TrainState {
            format: checkpoint::FORMAT,
            next_step,
            samples_seen: next_step * c.train.global_batch_size() as u64,
            policy: self.guard.policy.clone(),
            eval_policy: self.eval_guard.policy.clone(),
            val_loss: self.summary.val_loss,
            eval_history: self.eval_history.clone(),
            model: self.task.fingerprint(),
            extra,
            files: Default::default(),
            shards: None,
            manifest_crc32: None,
        }
    }

    /// A checkpoint written (rank 0): it verifies; older ones the retention drops go.
    fn written(&mut self, next_step: u64, dir: PathBuf) -> PathBuf {
        self.verified.insert(next_step, true);
        let verified = &mut self.verified;
        checkpoint::prune(
            &self.run_dir,
            &self.cfg.raw.checkpoint,
            &self.eval_history,
            |step, dir| *verified.entry(step).or_insert_with(|| checkpoint::verify(dir).is_ok()),
        );
        dir
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
        if let Some(f) = &self.forked_from {
            extra.insert(checkpoint::FORKED_FROM.into(), f.clone());
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

/// Test hook `OOMGUARD_TEST_SHARD_PAUSE_MS=RANK:STEP:MS`: rank RANK sleeps MS between writing
/// its shard of the checkpoint that resumes at STEP and publishing its sum (tests kill it
/// there).
fn shard_written_pause(rank: usize, next_step: u64) {
    crate::pause_at(test_hook!("OOMGUARD_TEST_SHARD_PAUSE_MS"), rank, next_step);
}
