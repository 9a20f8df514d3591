//! Owns the rungs below micro-batch 1, applied to a run, and coming back down.
//! Keeps: every rank climbs or leaves a rung together.
use super::*;

impl Run<'_> {
    /// The next rung below micro-batch 1, if one is left and allowed: applied, recorded and
    /// logged. The guard starts again from micro-batch 1 (and may grow back from there).
    pub(super) fn climb(&mut self, step: u64) -> Result<bool> {
        let m = &self.cfg.raw.memory;
        let at = ladder::Footing {
            checkpointing: self.task.activation_checkpointing(),
            precision: self.precision,
            loss: self.task.loss_kind(),
            shard: self.pg.as_ref().map(|_| self.opt.shard()),
        };
        let allowed = ladder::Allowed {
            checkpointing: m.allow_activation_checkpointing,
            precision_fallback: m.allow_precision_fallback,
            bf16_fast: bf16_is_fast(self.device),
            // A sharding rung that ran out of memory re-sharding is not offered again in this
            // step: the rungs after it are.
            sharding: m.allow_sharding && self.shard_oom_at != Some(step),
        };
        let Some(rung) = ladder::next_rung(at, allowed, &self.savings()) else {
            return Ok(false);
        };
        let world = self.world_size();
        match rung {
            Rung::FusedLoss => self.task.set_loss_kind(LossKind::Fused),
            Rung::ActivationCheckpointing => self.task.set_activation_checkpointing(true),
            Rung::Bf16 => self.precision = Precision::Bf16,
            Rung::ShardOptimizer | Rung::ShardGradients => {
                let pg = self.pg.clone().expect("sharding rungs need a group");
                let agree = |r: Result<()>| pg.agree(Topic::ShardClimb, r);
                memory::empty_cache(self.device)?;
                match self.opt.set_shard(
                    rung.shard().expect("a sharding rung"),
                    Some(pg.clone() as Rc<dyn Comm>),
                    &agree,
                ) {
                    Err(Error::Oom(o)) => {
                        // Undone half-way: the first moment was gathered back into new tensors.
                        self.snapshot_follows_state();
                        tracing::warn!(
                            "step {step}: sharding ({rung:?}) ran out of memory while re-sharding ({}); trying the rungs after it",
                            o.message
                        );
                        self.shard_oom_at = Some(step);
                        return self.climb(step);
                    }
                    other => other?,
                }
                self.shard_back = ShardBack {
                    clean_steps: 0,
                    failed_at: Some(step),
                };
                self.snapshot_follows_state();
            }
        }
        for e in self.guard.drain_events() {
            self.write(&Record::from(e))?;
        }
        let what = match rung {
            Rung::FusedLoss => "the fused loss (model.loss: fused: the logits a chunk of tokens at a time)".to_string(),
            Rung::ActivationCheckpointing => "activation checkpointing on (blocks are recomputed in backward)".to_string(),
            Rung::Bf16 => "bf16 autocast (master weights and optimizer state stay fp32)".to_string(),
            Rung::ShardOptimizer => format!("AdamW's state sharded across the {world} ranks (ZeRO-1: each keeps 1/{world} of the moments)"),
            Rung::ShardGradients => format!(
                "the gradients sharded too (ZeRO-2: each bucket's sum kept as this rank's 1/{world} during backward, its gradients dropped)"
            ),
        };
        tracing::warn!("step {step}: micro-batch 1 does not fit; climbing down a rung: {what}; retrying the step");
        self.write(&Record::Rung(RungRecord {
            step,
            rung,
            reason: "micro-batch 1 did not fit".into(),
        }))?;
        self.guard.policy.rung_climbed();
        Ok(true)
    }

    /// What each rung would save on this rank: one sample's activations (the planner's
    /// formula, else the parameters' size as a stand-in), AdamW's moments, the gradients.
    fn savings(&self) -> ladder::Savings {
        let gradients: u64 = self
            .task
            .parameters()
            .iter()
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum();
        let activations = self.task.formula().map_or(gradients, |e| e.per_sample_bytes());
        ladder::Savings {
            activations,
            optimizer_state: self.opt.state_bytes(),
            gradients,
            world: self.world_size() as u64,
            gradients_during_backward: self.reducer.is_some() && self.task.backward_is_one_pass(),
        }
    }

    /// A run that climbed to a sharding rung comes back down a stage when memory allows
    /// (`ladder::unshard`: the micro-batch's hysteresis and cool-down), every rank alike: the
    /// decision is on the ranks' largest peak and smallest limit, and the gather's allocation
    /// is agreed.
    pub(super) fn maybe_unshard(&mut self, step: u64, oomed: bool) -> Result<()> {
        let Some(pg) = self.pg.clone() else { return Ok(()) };
        let configured = self.cfg.raw.train.shard;
        let at = self.opt.shard();
        if at <= configured {
            return Ok(());
        }
        self.shard_back.clean_steps = if oomed { 0 } else { self.shard_back.clean_steps + 1 };
        // The ranks' largest peak and smallest limit: every rank decides on the same figures
        // (with `budget: auto` on the CPU their own limits differ).
        let mem = self.guard.last_memory();
        let mut v = [
            mem.peak_bytes as f64,
            mem.limit_bytes.map_or(f64::NEG_INFINITY, |l| -(l as f64)),
        ];
        pg.exchange(Topic::Shard, &mut v)?;
        let limit = (v[1] > f64::NEG_INFINITY).then_some(-v[1] as u64);
        let world = self.world_size() as u64;
        let saved = match at {
            Shard::Gradients => self.savings().gradients * (world - 1) / world,
            _ => self.opt.state_bytes() * (world - 1),
        };
        let m = &self.cfg.raw.memory;
        let back = ladder::Back {
            at,
            configured,
            clean_steps: self.shard_back.clean_steps,
            failed_at: self.shard_back.failed_at,
            step,
            peak_bytes: v[0] as u64,
            limit_bytes: limit,
            saved_bytes: saved,
        };
        let Some(below) = ladder::unshard(back, m.grow_after_steps, m.cooldown_steps, m.grow_headroom) else {
            return Ok(());
        };
        let agree = |r: Result<()>| pg.agree(Topic::ShardBack, r);
        let left = if at == Shard::Gradients {
            Rung::ShardGradients
        } else {
            Rung::ShardOptimizer
        };
        match self.opt.set_shard(below, Some(pg.clone() as Rc<dyn Comm>), &agree) {
            Ok(()) => {
                self.snapshot_follows_state();
                tracing::info!(
                    "step {step}: memory allows it: back to train.shard: {} (the peak was {})",
                    below.name(),
                    human_bytes(back.peak_bytes)
                );
                self.write(&Record::RungDown(RungRecord {
                    step,
                    rung: left,
                    reason: format!("memory allows shard: {}", below.name()),
                }))?;
                self.shard_back.clean_steps = 0;
            }
            Err(Error::Oom(o)) => {
                tracing::info!(
                    "step {step}: coming back to train.shard: {} ran out of memory ({}); staying sharded",
                    below.name(),
                    o.message
                );
                memory::empty_cache(self.device)?;
                self.shard_back = ShardBack {
                    clean_steps: 0,
                    failed_at: Some(step),
                };
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// The snapshot writer attributes the optimizer state where it lives now.
    fn snapshot_follows_state(&self) {
        if let Some(d) = &self.snapshot {
            let state: Vec<Tensor> = self.opt.state().into_iter().map(|(_, t)| t.shallow_clone()).collect();
            d.borrow_mut().set_optimizer_state(&state);
        }
    }

    /// The planner's view of what does not fit and what would, for models it has a formula
    /// for; with data parallel, what sharding would save per rank.
    pub(super) fn advice(&self) -> String {
        let c = &self.cfg.raw;
        let mut out = match (c.model.kind, memory::stats(self.device).limit_bytes) {
            (ModelKind::Gpt, Some(limit)) => format!(
                " {}",
                plan::advice(
                    &c.model.gpt(),
                    limit,
                    self.device.is_cuda(),
                    self.bucket_bytes as u64,
                    c.train.global_batch_size()
                )
            ),
            _ => String::new(),
        };
        let world = self.world_size() as u64;
        if world > 1 && self.opt.shard() == Shard::None {
            // Only the moments: stage 2 saves nothing at the step's peak (see `ladder`).
            let state = self.savings().optimizer_state;
            let how = if c.memory.allow_sharding {
                "train.shard: optimizer"
            } else {
                "memory.allow_sharding: true (the guard climbs to it), or train.shard: optimizer"
            };
            out.push_str(&format!(
                " Sharding AdamW's state across the {world} ranks (ZeRO-1) would save {} per rank: {how}.",
                human_bytes(state - state / world)
            ));
        }
        out
    }
}
