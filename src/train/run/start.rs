//! Owns how a run starts: device, group, model, data, optimizer and its starting point.
//! Keeps: every rank agrees where it starts, and what cannot run is refused before any step.
use super::*;

impl<'a> Run<'a> {
    pub fn start(
        cfg: &'a Config,
        run_dir: &Path,
        settings: &allocator::AllocatorSettings,
        options: &Options,
        build: Builder,
    ) -> Result<Run<'a>> {
        let c = &cfg.raw;
        let mut device = c.train.device();
        if let (Device::Cuda(_), Some(local_rank)) = (device, crate::dist::local_rank()?) {
            // Each rank's own GPU before any CUDA call: the budget and allocator settings
            // apply to it, and no rank makes a context on GPU 0.
            device = Device::Cuda(local_rank);
            memory::cuda_set_device(local_rank).map_err(Error::Torch)?;
        }
        memory::prepare(&c.memory, settings, device)?;
        if device.is_cuda()
            && std::env::var("OOMGUARD_CUDA_SYNC_DEBUG").is_ok_and(|v| v == "1")
            && !crate::ops::cuda_sync_debug()
        {
            tracing::warn!(
                "OOMGUARD_CUDA_SYNC_DEBUG=1: this libtorch has no CUDA sync-debug state to set; syncs are not counted"
            );
        }
        if let (Device::Cpu, Some(rank), Some(world)) = (device, crate::dist::local_rank()?, crate::dist::local_world())
        {
            // Before the thread count: the rank's own cores are its CPU share.
            if let Some(cpus) = crate::dist::bind::bind_rank(rank, world) {
                tracing::info!(
                    "rank {rank} of {world} on this node bound to CPU cores {cpus:?} (OOMGUARD_CPU_BIND=0: unbound)"
                );
            }
        }
        // Threads from this process's CPU share (affinity, cgroup quota, Slurm), unless set.
        let threads = match c.train.num_threads {
            Some(n) => Threads {
                n,
                why: "train.num_threads".into(),
            },
            None => Threads::of_self(),
        };
        tch::set_num_threads(threads.n as i32);
        tch::manual_seed(c.train.seed as i64);
        let pg = ProcessGroup::from_env(device, Duration::from_secs(c.train.dist_timeout_s))?.map(Rc::new);
        if let Some(pg) = &pg {
            device = pg.device(); // cuda:LOCAL_RANK
        }
        let lead = pg.as_ref().is_none_or(|p| p.rank == 0);
        if let Some(pg) = &pg {
            // Every rank refuses alike, before any collective: none is left waiting.
            check_world(c.train.global_batch_size(), pg.world, &cfg.path.display().to_string())?;
        }
        refuse_what_cannot_fit(cfg, device, pg.as_ref().map_or(1, |p| p.world))?;
        let base = cfg.base_dir();
        let ctx = BuildContext {
            device,
            model: &c.model,
            data: &c.data,
            base_dir: &base,
            config_path: &cfg.path,
        };
        let Built { mut task, data } =
            task::build_with_weights(&ctx, build).map_err(|e| init_failure(e, cfg, device, "creating the model"))?;
        if c.model.activation_checkpointing == Some(ActivationCheckpointing::Blocks) {
            task.set_activation_checkpointing(true);
        }
        let mut precision = c.train.precision.resolve(device);
        let data = task::data_for(&cfg.raw.model, &cfg.raw.data, &cfg.base_dir(), data)
            .map_err(|e| init_failure(e, cfg, device, "loading the data"))?;
        let (mut opt, init_rung) = new_optimizer(cfg, task.as_ref(), pg.as_ref(), device)?;
        check_loss(task.as_ref(), &data, device, cfg, precision)?;
        if lead {
            checkpoint::clean_partial(run_dir);
        }

        let global = c.train.global_batch_size();
        let limit = memory::stats(device).limit_bytes;
        let cache_key = micro_key(task.as_ref(), &data, precision, device, opt.shard());
        // Where to start: rank 0 decides (and reads the checkpoint); the others learn it.
        let agree = |r: Result<()>| match &pg {
            Some(pg) => pg.agree(Topic::StartPoint, r),
            None => r,
        };
        let from = match &pg {
            None => resolve(run_dir, options.resume.clone())?,
            Some(pg) => shared_start(pg, run_dir, &options.resume)?,
        };
        // Elastic: the change that began this round, recorded after its first step (the steps
        // done again are counted before the resume moves their records aside).
        let membership = crate::dist::elastic::change().filter(|_| lead).map(|change| {
            let seen = change.detected_unix_ms;
            let next = from.as_ref().map_or(0, |(_, s)| s.next_step);
            let survivor = from
                .as_ref()
                .is_some_and(|(_, s)| s.extra.contains_key(SAVED_BY_SURVIVOR));
            let record = MembershipRecord {
                step: next,
                old_world: change.old_world,
                new_world: change.new_world,
                cause: change.cause,
                seconds: 0.0, // from `seen`, once the first step is done
                steps_recomputed: crate::dist::elastic::steps_recomputed(
                    crate::dist::elastic::last_step_recorded(run_dir),
                    next,
                ),
                source: crate::dist::elastic::source(survivor).into(),
            };
            (record, seen)
        });
        // The checkpoint loads before anything in the run directory changes (its records set
        // aside, later checkpoints pruned): a refusal or a failure leaves the run as it was.
        if let Some((dir, state)) = &from {
            let changes = task::shape_changes(&state.model, &task.fingerprint());
            if !changes.is_empty() {
                return Err(Error::Checkpoint(format!(
                    "{}: the model's shape changed since this checkpoint: {}",
                    dir.display(),
                    changes.join("; ")
                )));
            }
            // A sharding rung climbed before the checkpoint stays climbed (it may come
            // back down); any checkpoint loads into any sharding and world size.
            let saved_shard: Option<Shard> = state
                .extra
                .get("shard")
                .and_then(|v| serde_json::from_value(v.clone()).ok());
            if let (Some(s), Some(pg)) = (saved_shard, &pg) {
                if s > opt.shard() {
                    opt.set_shard(s, Some(pg.clone() as Rc<dyn Comm>), &agree)?;
                }
            }
            if lead {
                checkpoint::restore(dir, task.as_ref(), &mut opt, device)
                    .map_err(|e| init_failure(e, cfg, device, "restoring the checkpoint"))?;
            }
            if let Some(rng) = state.extra.get("host_rng") {
                task.set_host_rng_state(rng)?;
            }
            // Rungs climbed before the checkpoint stay climbed.
            if state.extra.get("activation_checkpointing").and_then(|v| v.as_bool()) == Some(true) {
                task.set_activation_checkpointing(true);
            }
            if state.extra.get("loss").and_then(|v| v.as_str()) == Some(LossKind::Fused.name()) {
                task.set_loss_kind(LossKind::Fused);
            }
        }
        if let (true, Some(files)) = (lead, &options.config_files) {
            files.write()?;
        }
        let metrics = lead
            .then(|| MetricsWriter::resume(run_dir, from.as_ref().map_or(0, |(_, s)| s.next_step)))
            .transpose()?;
        let metrics = metrics.map(|m| m.with_tensorboard(c.log.tensorboard, run_dir));
        let config_json = serde_json::to_string(c).unwrap_or_default();
        let mut metrics = metrics
            .map(|m| {
                let resumed = matches!(options.resume, Resume::Newest);
                m.with_trackers(
                    &c.log.trackers,
                    run_dir,
                    &config_json,
                    &cfg.path.display().to_string(),
                    resumed,
                )
            })
            .transpose()?;
        if let (true, Some((dir, s))) = (lead, &from) {
            // Resumed from an older checkpoint, the run forks: the later ones are another
            // future, which the next --resume must not load (the one it came from, even
            // misnamed, stays).
            checkpoint::prune_after(run_dir, s.next_step, dir);
        }
        // A fork's checkpoints say where it forked, and so do those of the starts that go on
        // from them (`checkpoint::fork_saved`).
        let forked_from = match (&options.resume, &from) {
            (Resume::From(_), Some((dir, s))) => checkpoint::fork_record(s.next_step, dir),
            (_, Some((_, s))) => s.extra.get(checkpoint::FORKED_FROM).cloned(),
            _ => None,
        };
        // A sharded checkpoint: every rank of a sharded run reads its own part of it.
        let own_shards = from.as_ref().and_then(|(dir, s)| Some((dir.clone(), s.shards?)));
        let mut eval_guard = Guard::for_eval(&c.memory, c.train.eval_batch_size, device);
        let mut resumed_extra = BTreeMap::new();
        let (mut guard, next_step, eval_history) = match from {
            None => {
                let guard = match c.train.micro_batch_size {
                    MicroBatch::Size(m) => {
                        // Never above the configured size; it may grow back to it.
                        let mut guard = Guard::new(&c.memory, m, device);
                        guard.policy.current = known_good(&cache_key, m);
                        guard
                    }
                    MicroBatch::Auto => {
                        let mut r = auto_search(
                            cfg,
                            task.as_ref(),
                            &opt,
                            &data,
                            &Amp {
                                precision,
                                device,
                                loss_scale: None,
                            },
                            &cache_key,
                            limit,
                            pg.as_ref().map_or(1, |p| p.world),
                        )?;
                        if let Some(pg) = &pg {
                            // One micro-batch for all ranks: the smallest any rank found.
                            r.micro_batch_size = pg.min_f64(Topic::Start, r.micro_batch_size as f64)? as usize;
                        }
                        if let Some(m) = metrics.as_mut() {
                            m.write(&Record::AutoMicroBatch(r.clone()))?;
                        }
                        Guard::new(&c.memory, r.micro_batch_size, device)
                    }
                };
                (guard, 0, BTreeMap::new())
            }
            Some((dir, state)) => {
                let saved: Option<Precision> = state
                    .extra
                    .get("precision")
                    .and_then(|v| serde_json::from_value(v.clone()).ok());
                let precision_from = resumed_precision(&mut precision, saved, options.precision_set);
                let configured = match c.train.micro_batch_size {
                    MicroBatch::Size(m) => m,
                    MicroBatch::Auto => state.policy.configured,
                };
                let mut guard = Guard::new(&c.memory, configured, device);
                guard.policy = Policy::resumed(state.policy, configured);
                eval_guard.policy = Policy::resumed(state.eval_policy, c.train.eval_batch_size);
                if let Some(m) = metrics.as_mut() {
                    m.write(&Record::Resumed {
                        step: state.next_step,
                        checkpoint: dir.display().to_string(),
                        precision: Some(precision),
                        precision_from: Some(precision_from.into()),
                        checkpoint_precision: saved,
                    })?;
                    if let Some(changed) = &options.config_changed {
                        m.write(&Record::ConfigChanged {
                            step: state.next_step,
                            changes: changed.changes.clone(),
                            allowed: changed.allowed,
                            kept: changed.kept.clone(),
                        })?;
                    }
                }
                tracing::info!(
                    "resumed from {} at step {} (micro-batch {})",
                    dir.display(),
                    state.next_step,
                    guard.micro_batch_size()
                );
                resumed_extra = state.extra.clone();
                (guard, state.next_step, state.eval_history)
            }
        };
        if let Some(pg) = &pg {
            // Rank 0's parameters (its initial ones, or the checkpoint's) and optimizer state
            // (sharded: each rank's part of the checkpoint's; a fresh one is zeros).
            pg.broadcast(&task.state().into_iter().map(|(_, t)| t).collect::<Vec<_>>(), 0)?;
            if opt.shard() == Shard::None {
                pg.broadcast(
                    &opt.state()
                        .into_iter()
                        .map(|(_, t)| t.shallow_clone())
                        .collect::<Vec<_>>(),
                    0,
                )?;
            } else if next_step > 0 {
                if let Some((dir, layout)) = &own_shards {
                    let r = checkpoint::shards::Reader::new(dir, *layout).and_then(|mut r| opt.load_own_shard(&mut r));
                    agree(r.map_err(|e| init_failure(e, cfg, device, "restoring the checkpoint")))?;
                }
                opt.share_restored(&agree, own_shards.is_none())?;
            }
        }
        if let (Some(rung), Some(m)) = (init_rung, metrics.as_mut()) {
            m.write(&Record::Rung(RungRecord {
                step: next_step,
                rung,
                reason: "the optimizer state did not fit".into(),
            }))?;
        }
        if let Some(mb) = launcher_micro_batch(MICRO_BATCH_VAR)? {
            let failed = launcher_micro_batch(FAILED_MICRO_BATCH_VAR)?;
            guard.policy.relaunched(failed, mb, next_step);
            tracing::info!(
                "{MICRO_BATCH_VAR}={mb}: starting at micro-batch {}{}",
                guard.policy.current,
                failed
                    .map(|f| format!(" ({f} ran out of memory before the relaunch: it cools down)"))
                    .unwrap_or_default()
            );
        }
        if let Some(pg) = &pg {
            // One starting micro-batch for all ranks: the smallest any would take (their
            // micro-batch caches may differ).
            let agreed = pg.min_f64(Topic::Start, guard.policy.current as f64)? as usize;
            if agreed != guard.policy.current {
                tracing::info!(
                    "starting at micro-batch {agreed}, the smallest any rank would take (this rank's was {})",
                    guard.policy.current
                );
                guard.policy.current = agreed;
            }
        }
        let agree = pg.clone().map(|p| p as Rc<dyn Agree>);
        let snapshot = snapshot_dumper(cfg, run_dir, device, task.as_ref(), &opt, pg.as_ref().map(|p| p.rank))?;
        let (guard, eval_guard) = (
            guard.with_agreement(agree.clone()).with_snapshot(snapshot.clone()),
            eval_guard.with_agreement(agree).with_snapshot(snapshot.clone()),
        );
        let scaler = (precision == Precision::Fp16)
            .then(|| Scaler::new(&c.train.grad_scaler, device))
            .transpose()
            .map_err(|e| init_failure(e.into(), cfg, device, "creating the loss scaler"))?;
        if let (Some(s), Some(scale)) = (&scaler, resumed_extra.get("loss_scale").and_then(|v| v.as_f64())) {
            s.load_state(
                scale,
                resumed_extra
                    .get("growth_tracker")
                    .and_then(|v| v.as_i64())
                    .unwrap_or(0),
            )?;
        }
        let mb = guard.micro_batch_size();
        tracing::info!(
            "training {} on {device:?} ({threads}, {}{}{}): global batch {global} = {mb} x {}, {} steps",
            task.describe(),
            precision.name(),
            if task.activation_checkpointing() == Some(true) {
                ", activation checkpointing"
            } else {
                ""
            },
            pg.as_ref()
                .map(|p| format!(
                    ", data parallel: rank {} of {}, samples {:?} of each step",
                    p.rank,
                    p.world,
                    p.shard(global)
                ))
                .unwrap_or_default(),
            pg.as_ref().map_or(global, |p| p.shard(global).len()).div_ceil(mb),
            c.train.max_steps
        );
        let best = eval_history
            .values()
            .copied()
            .fold(None, |b: Option<f64>, v| Some(b.map_or(v, |b| b.min(v))));
        let bucket_bytes = bucket_bytes(c, pg.as_deref())?;
        let reducer = pg
            .as_ref()
            .and_then(|pg| reducer(c, pg, task.as_ref(), &opt, device, bucket_bytes));
        Ok(Run {
            cfg,
            run_dir: run_dir.to_path_buf(),
            device,
            units_per_step: global * data.train.units_per_sample(),
            task,
            data,
            opt,
            precision,
            scaler,
            guard,
            eval_guard,
            pressure: PressureSchedule::new(&c.memory.pressure, device),
            metrics,
            next_step,
            first_step: next_step,
            eval_history,
            verified: BTreeMap::new(),
            checkpointed: None,
            remember_micro: options.inject_oom.is_none(),
            reducer,
            bucket_bytes,
            pg,
            lead,
            summary: Summary {
                steps: c.train.max_steps,
                first_loss: f64::NAN,
                best_val_loss: best,
                ..Default::default()
            },
            progress: Progress::new(cfg.schedule(), next_step, lead),
            snapshot,
            shard_back: ShardBack::default(),
            clock: checkpoint::Clock::new(c.checkpoint.every_minutes),
            membership,
            handover: false,
            diverged_at: None,
            shard_oom_at: None,
            forked_from,
        })
    }
}

/// The overlapped reduction's hooks on the parameters, unless `train.overlap_grad_reduce:
/// false`. It runs in every step when the key says true (unset: on CUDA, or when the ranks
/// span several machines), otherwise under ZeRO-2 only; none where a parameter carries a
/// hook of its own (reduced after backward then).
fn reducer(
    c: &crate::config::RawConfig,
    pg: &ProcessGroup,
    task: &dyn Task,
    opt: &AdamW,
    device: Device,
    cap: usize,
) -> Option<Reducer> {
    // Several machines when the launcher (or torchrun) says fewer ranks run here than in
    // all; ranks started by hand, without LOCAL_WORLD_SIZE, reduce after backward.
    let several_machines = || {
        let local = std::env::var("LOCAL_WORLD_SIZE")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok());
        local.is_some_and(|l| l < pg.world)
    };
    let always = match c.train.overlap_grad_reduce {
        Some(false) => return None,
        Some(true) => true,
        None => device.is_cuda() || several_machines(),
    };
    Reducer::new(pg, &opt.params(), &backward_order(task, opt), cap, always)
        .inspect_err(|e| match always {
            true => tracing::warn!("gradients are reduced after backward: {e}"),
            false => tracing::info!("ZeRO-2 reduces after backward: {e}"),
        })
        .ok()
}

/// A gradient bucket's most bytes (`TrainConfig::bucket_bytes`), the least over the ranks:
/// each sizes it by its own budget (a rank's `--memory-budget` may differ), and ranks that
/// cut their buckets apart would wait on different collectives.
fn bucket_bytes(c: &crate::config::RawConfig, pg: Option<&ProcessGroup>) -> Result<usize> {
    let own = c.train.bucket_bytes(&c.memory);
    let Some(pg) = pg else {
        return Ok(own);
    };
    let cap = pg.min_f64(Topic::Buckets, own as f64)? as usize;
    let human = crate::memory::human_bytes;
    if cap < own {
        // Another rank's budget (or its own key) made them smaller than this rank's.
        tracing::info!(
            "gradient buckets of {} (another rank's train.bucket_cap_mb or memory.budget; this rank's own would be {}): the ranks take the least",
            human(cap as u64),
            human(own as u64)
        );
    } else if c.train.bucket_cap_mb.is_none() && (cap as u64) < crate::dist::DEFAULT_BUCKET_BYTES {
        tracing::info!(
            "gradient buckets of {} (1/{} of the least memory.budget; train.bucket_cap_mb sets them)",
            human(cap as u64),
            crate::dist::overlap::BUDGET_PER_BUCKET
        );
    }
    Ok(cap)
}

/// The order a run's first backward is expected to complete the gradients in, as indices
/// into the optimizer's order: the model's own order reversed (a Python model's definition
/// order; the GPT's too), as DDP's first buckets (the reducer adds any not named). The optimizer's order is no guide: it
/// groups parameters by weight decay, so every block's biases would share the first bucket.
fn backward_order(task: &dyn Task, opt: &AdamW) -> Vec<usize> {
    let at: std::collections::HashMap<&str, usize> = opt.names().into_iter().enumerate().map(|(i, n)| (n, i)).collect();
    task.parameters()
        .iter()
        .rev()
        .filter_map(|(n, _)| at.get(n.as_str()).copied())
        .collect()
}

/// AdamW as `train.shard` asks (data parallel only). When even its state does not fit,
/// and `memory.allow_sharding` allows it, the ranks shard it together; returns the rung
/// so climbed at start.
fn new_optimizer(
    cfg: &Config,
    task: &dyn Task,
    pg: Option<&Rc<ProcessGroup>>,
    device: Device,
) -> Result<(AdamW, Option<Rung>)> {
    let c = &cfg.raw;
    let no_decay = |n: &str, t: &Tensor| task.no_weight_decay(n, t);
    let Some(pg) = pg else {
        if c.train.shard != Shard::None {
            tracing::info!(
                "train.shard: {}: a single process has nothing to split it with; ignored",
                c.train.shard.name()
            );
        }
        return AdamW::new(task.parameters(), &c.optim, no_decay)
            .map(|o| (o, None))
            .map_err(|e| init_failure(e.into(), cfg, device, "creating the optimizer state"));
    };
    let mut stage = c.train.shard;
    loop {
        let opt = AdamW::sharded(
            task.parameters(),
            &c.optim,
            no_decay,
            stage,
            Some(pg.clone() as Rc<dyn Comm>),
        );
        match pg.agree(Topic::OptimizerState, opt) {
            Ok(opt) => return Ok((opt, (stage != c.train.shard).then_some(Rung::ShardOptimizer))),
            Err(Error::Oom(o)) if c.memory.allow_sharding && stage == Shard::None => {
                tracing::warn!(
                    "the optimizer state does not fit on every rank ({}); sharding it across the {} ranks (ZeRO-1)",
                    o.message,
                    pg.world
                );
                memory::empty_cache(device)?;
                stage = Shard::Optimizer;
            }
            Err(e) => return Err(init_failure(e, cfg, device, "creating the optimizer state")),
        }
    }
}

/// Data parallel needs a sample for every rank: a smaller global batch is a config error
/// (exit 2) naming the smallest that works.
pub fn check_world(global: usize, world: usize, origin: &str) -> Result<()> {
    if global >= world {
        return Ok(());
    }
    Err(ConfigError {
        origin: origin.into(),
        line_col: None,
        key: "train.global_batch_size".into(),
        message: format!("is {global}, smaller than the {world} ranks: each rank needs at least one sample of every step; use a global batch of at \
            least {world} (or fewer ranks)"),
    }
    .into())
}

/// What an allocation failure while a run is being set up means: the model (or its state)
/// does not fit at all (exit 3), with the planner's figures where it has them.
fn init_failure(e: Error, cfg: &Config, device: Device, doing: &str) -> Error {
    let Error::Oom(oom) = e else { return e };
    let c = &cfg.raw;
    let stats = memory::stats(device);
    let limit = stats.limit_bytes.or(oom.capacity_bytes);
    let of = limit.map(|l| format!(" of {}", human_bytes(l))).unwrap_or_default();
    let advice = match (c.model.kind, limit) {
        (ModelKind::Gpt, Some(l)) => format!(
            " {}",
            plan::advice(
                &c.model.gpt(),
                l,
                device.is_cuda(),
                c.train.bucket_bytes(&c.memory) as u64,
                c.train.global_batch_size()
            )
        ),
        _ => " To fit: raise memory.budget or use a device with more memory, or a smaller model.".into(),
    };
    Error::Infeasible(format!(
        "the model does not fit in memory ({doing} ran out; {} in use{of}).{advice} libtorch said: {}",
        human_bytes(stats.live_bytes),
        oom.message
    ))
}

/// A GPT whose weights, gradients and AdamW state alone exceed the memory (exact sizes,
/// no estimate; the state split over `world` ranks where sharding is configured or allowed)
/// is refused before anything is allocated, as `oomguard plan` would.
fn refuse_what_cannot_fit(cfg: &Config, device: Device, world: usize) -> Result<()> {
    let c = &cfg.raw;
    let stats = memory::stats(device);
    let (ModelKind::Gpt, Some(limit)) = (c.model.kind, stats.limit_bytes) else {
        return Ok(());
    };
    let shard = start_shard(world, c.train.shard, c.memory.allow_sharding);
    let est = plan::Estimate::new(&c.model.gpt(), plan::Precision::Fp32, device.is_cuda())
        .with_bucket_cap(c.train.bucket_bytes(&c.memory) as u64)
        .with_shard(shard, world as u64);
    let state = est.params_bytes + est.grads_at_least() + est.optimizer_bytes;
    if stats.live_bytes + state <= limit {
        return Ok(());
    }
    Err(Error::Infeasible(format!(
        "the model does not fit in memory: its weights, gradients and AdamW state alone need {} and {} is in use, of {} (nothing was allocated). {}",
        human_bytes(state), human_bytes(stats.live_bytes), human_bytes(limit), plan::advice(&c.model.gpt(), limit, device.is_cuda(), c.train.bucket_bytes(&c.memory) as u64, c.train.global_batch_size())
    )))
}

/// The most a rank's state can be split at the start's check: the stage configured, or
/// what the guard climbs to by itself (ZeRO-1) where that is more; nothing in one process.
fn start_shard(world: usize, configured: Shard, allow_sharding: bool) -> Shard {
    match world {
        1 => Shard::None,
        _ if allow_sharding => configured.max(Shard::Optimizer),
        _ => configured,
    }
}

/// One sample through the loss, before training: a model that cannot take the data (a
/// wrong dtype or shape, a missing method) is bad input (exit 2), said before any step.
fn check_loss(task: &dyn Task, data: &Dataset, device: Device, cfg: &Config, precision: Precision) -> Result<()> {
    let _no_grad = tch::no_grad_guard();
    let _autocast = crate::precision::Autocast::enter(precision, device)?;
    let describe = |t: &Tensor| format!("{:?} {:?}", t.size(), t.kind());
    let bad = |message: String| {
        Error::Config(ConfigError {
            origin: cfg.path.display().to_string(),
            line_col: None,
            key: "model".into(),
            message,
        })
    };
    // Two samples where there are two: a per-sample loss of one sample looks like a scalar.
    let first: &[usize] = if data.train.num_positions() > 1 { &[0, 1] } else { &[0] };
    let samples = if first.len() == 1 { "one sample" } else { "two samples" };
    let (x, y) = match data.train.batch(first, device) {
        Ok(b) => b,
        Err(Error::Oom(_)) => return Ok(()), // the guard will deal with memory
        Err(e) => return Err(e),
    };
    // A user's module (Python, TorchScript) is checked with autograd on, in eval mode (no
    // dropout, no BatchNorm update, no random draw): a loss cut off from the parameters
    // (detached, under no_grad) is refused now rather than failing in backward.
    let users = matches!(cfg.raw.model.kind, ModelKind::Python | ModelKind::Torchscript);
    let float = |l: &Tensor| matches!(l.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16);
    let loss = match users {
        true => tch::with_grad(|| task.eval_loss(&x, &y)),
        false => task.eval_loss(&x, &y),
    };
    match loss.map_err(Error::from) {
        Ok(loss) if loss.numel() == 1 && float(&loss) && users && !loss.requires_grad() => Err(bad(format!(
            "{}: the loss on {samples} has no gradient (it does not depend on the parameters through autograd: detached, computed under no_grad, or \
                converted with .item()); return the loss tensor as computed",
            task.describe()
        ))),
        Ok(loss) if loss.numel() == 1 && float(&loss) => Ok(()),
        Ok(loss) => Err(bad(format!(
            "{}: the loss on {} (inputs {}, targets {}) is a tensor {}; it must be the mean loss, a floating-point scalar",
            task.describe(), samples, describe(&x), describe(&y), describe(&loss)
        ))),
        Err(Error::Oom(_)) => Ok(()),
        Err(e) => Err(bad(format!(
            "{} cannot compute the loss of {samples} of {} (inputs {}, targets {}): {}",
            task.describe(), data.train.name(), describe(&x), describe(&y), task::error_line(&e.to_string())
        ))),
    }
}

/// The precision a resumed run trains in: the checkpoint's (a rung climbed stays climbed),
/// unless `--set train.precision` on the resuming command says otherwise. Said either way
/// when it differs from the config; returns where it came from, for the `resumed` event.
fn resumed_precision(precision: &mut Precision, saved: Option<Precision>, set: bool) -> &'static str {
    let configured = *precision;
    match saved {
        _ if set => {
            if let Some(s) = saved.filter(|&s| s != configured) {
                tracing::info!(
                    "precision {}: --set train.precision wins over the checkpoint's {}",
                    configured.name(),
                    s.name()
                );
            }
            "--set"
        }
        Some(s) => {
            if s != configured {
                tracing::info!(
                    "precision {}, as in the checkpoint (train.precision says {}); --set train.precision={} on this command to change it",
                    s.name(), configured.name(), configured.name()
                );
            }
            *precision = s;
            "checkpoint"
        }
        None => "config",
    }
}

/// The micro-batch cache's key: what sets a micro-batch's memory, as the run stands (the
/// model, its loss (the full logits or none), the sample, precision, recomputation,
/// sharding, device and limit). A resume or a rung climbed since the start changes it.
pub(super) fn micro_key(task: &dyn Task, data: &Dataset, precision: Precision, device: Device, shard: Shard) -> String {
    let limit = memory::stats(device).limit_bytes;
    format!(
        "{}{}|u{}|{}{}{}|{device:?}|{}",
        fingerprint_key(&task.fingerprint()),
        task.loss_kind().map_or(String::new(), |l| format!("+{}", l.name())),
        data.train.units_per_sample(),
        precision.name(),
        if task.activation_checkpointing() == Some(true) {
            "+ckpt"
        } else {
            ""
        },
        match shard {
            Shard::None => "",
            Shard::Optimizer => "+zero1",
            Shard::Gradients => "+zero2",
        },
        limit.map_or(0, crate::guard::policy::memory_step)
    )
}

/// A fixed micro-batch, lowered to a size the micro-batch cache knows fits (one learned by
/// an earlier run or sweep trial of the same model, memory and device).
fn known_good(key: &str, configured: usize) -> usize {
    match plan::cached(key) {
        Some(known) if known < configured => {
            tracing::info!("starting at micro-batch {known}, not {configured}: an earlier run of this model on this memory ran out above it (the \
                micro-batch cache)");
            known
        }
        _ => configured,
    }
}

/// `micro_batch_size: auto`: the cache, or a search from the planner's estimate, up to a
/// rank's share of the step (of `world` ranks).
#[allow(clippy::too_many_arguments)]
fn auto_search(
    cfg: &Config,
    task: &dyn Task,
    opt: &AdamW,
    data: &Dataset,
    amp: &Amp,
    key: &str,
    limit: Option<u64>,
    world: usize,
) -> Result<AutoResult> {
    let device = amp.device;
    let c = &cfg.raw;
    let global = c.train.global_batch_size();
    let share = global.div_ceil(world.max(1)); // a rank at its share accumulates nothing
    let batches = StepSamples::new(data.train.as_ref(), c.train.seed, global, device);
    // The planner's estimate: its formula, or a line fitted through a few measured trials.
    let start = match (task.formula(), limit) {
        (Some(est), Some(l)) => est.largest_fitting(l, share).max(1),
        (None, Some(l)) => plan::measure(task, &batches, &|| opt.clear_grads(), amp, plan::CUDA_OVERHEAD)?
            .map_or(1, |p| p.largest_fitting(l, share).max(1)),
        _ => share,
    };
    let spec = AutoSearch {
        key: key.to_string(),
        start,
        max: share,
        margin: c.memory.auto_margin,
    };
    let r = plan::auto_micro_batch(task, &batches, || opt.clear_grads(), amp, spec)?;
    if r.from_cache {
        tracing::info!(
            "micro_batch_size auto: {} (cached: {} fits; {} margin)",
            r.micro_batch_size,
            r.largest_fitting,
            c.memory.auto_margin
        );
    } else {
        tracing::info!(
            "micro_batch_size auto: {} ({} fits, found in {} trial steps, {:.2}s, starting from {start}; {} margin)",
            r.micro_batch_size,
            r.largest_fitting,
            r.trials,
            r.search_s,
            c.memory.auto_margin
        );
    }
    Ok(r)
}

/// A micro-batch size from `oomguard launch` (after a worker died of an OOM).
fn launcher_micro_batch(var: &str) -> Result<Option<usize>> {
    match std::env::var(var) {
        Err(_) => Ok(None),
        Ok(v) => v
            .trim()
            .parse()
            .ok()
            .filter(|&m: &usize| m >= 1)
            .map(Some)
            .ok_or_else(|| {
                let e = ConfigError::invalid(
                    var,
                    format!("`{v}` is not a micro-batch size (a whole number, at least 1)"),
                );
                Error::Config(ConfigError {
                    origin: "environment".into(),
                    ..e
                })
            }),
    }
}

/// Where a data-parallel run starts: rank 0 resolves it and publishes it (or its error) in
/// the group's store; the other ranks read it, so no rank needs the run directory's files.
fn shared_start(pg: &ProcessGroup, run_dir: &Path, resume: &Resume) -> Result<Option<(PathBuf, TrainState)>> {
    const KEY: &str = "oomguard/start";
    if pg.rank == 0 {
        let r = resolve(run_dir, resume.clone());
        let msg = match &r {
            Ok(None) => serde_json::json!({ "start": null }),
            Ok(Some((dir, state))) => serde_json::json!({ "start": { "dir": dir, "state": state } }),
            // A checkpoint refused (missing, corrupt): every rank exits with its code (2).
            Err(Error::Checkpoint(m)) => serde_json::json!({ "checkpoint": m }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        };
        pg.share(KEY, Some(msg.to_string().as_bytes()))?;
        return r;
    }
    let msg: serde_json::Value =
        serde_json::from_slice(&pg.share(KEY, None)?).map_err(|e| Error::Dist(format!("rank 0's start: {e}")))?;
    if let Some(m) = msg["checkpoint"].as_str() {
        return Err(Error::Checkpoint(m.to_string()));
    }
    if let Some(e) = msg["error"].as_str() {
        return Err(Error::Dist(format!("rank 0 could not start: {e}")));
    }
    match &msg["start"] {
        serde_json::Value::Null => Ok(None),
        s => Ok(Some((
            serde_json::from_value(s["dir"].clone()).map_err(|e| Error::Dist(format!("rank 0's start: {e}")))?,
            serde_json::from_value(s["state"].clone()).map_err(|e| Error::Dist(format!("rank 0's start: {e}")))?,
        ))),
    }
}

fn resolve(run_dir: &Path, resume: Resume) -> Result<Option<(PathBuf, TrainState)>> {
    match resume {
        Resume::Fresh => Ok(None),
        // Nothing saved yet (e.g. a relaunch after a death before the first checkpoint):
        // start over, keeping the earlier attempt's metrics in metrics.replaced.jsonl.
        Resume::Newest if checkpoint::list(run_dir).is_empty() => {
            tracing::info!(
                "--resume: no checkpoint in {} yet; starting from step 0",
                run_dir.display()
            );
            Ok(None)
        }
        Resume::Newest => checkpoint::newest_valid(run_dir).map(Some),
        Resume::From(dir) => checkpoint::verify(&dir).map(|s| Some((dir, s))),
    }
}

/// The snapshot writer for this run (none with `memory.snapshot: off`): the parameters and
/// optimizer state it attributes by address, and the planner's formula where there is one.
fn snapshot_dumper(
    cfg: &Config,
    run_dir: &Path,
    device: Device,
    task: &dyn Task,
    opt: &AdamW,
    rank: Option<usize>,
) -> Result<Option<SharedDumper>> {
    let params = task.parameters().into_iter().map(|(_, t)| t).collect();
    let state: Vec<Tensor> = opt.state().into_iter().map(|(_, t)| t.shallow_clone()).collect();
    let d = memory::snapshot::Dumper::new(
        run_dir,
        cfg.raw.memory.snapshot()?,
        device,
        params,
        &state,
        task.formula(),
        rank,
    );
    Ok(d.map(|d| Rc::new(std::cell::RefCell::new(d))))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configured ZeRO-2 is what the start's check counts (its gradients a shard), not the
    /// ZeRO-1 the guard would climb to: a model whose stage-2 state fits is not refused.
    #[test]
    fn the_start_check_counts_the_stage_configured_or_the_one_climbed_to() {
        assert_eq!(start_shard(2, Shard::Gradients, true), Shard::Gradients);
        assert_eq!(start_shard(2, Shard::None, true), Shard::Optimizer);
        assert_eq!(start_shard(2, Shard::Optimizer, false), Shard::Optimizer);
        assert_eq!(start_shard(2, Shard::None, false), Shard::None);
        assert_eq!(start_shard(1, Shard::Gradients, true), Shard::None);
    }
}
