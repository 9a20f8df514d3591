//! Owns `oomguard plan`: the memory a config needs and the largest micro-batch that fits.
//! Keeps: nothing is written to disk; when nothing fits, the exit code is 3.
use crate::config::{self, Config};
use crate::data::StepSamples;
use crate::memory::{self, budget, human_bytes};
use crate::model::{ActivationCheckpointing, ModelKind};
use crate::optim::AdamW;
use crate::plan::{device_memory, measure, suggestions, Estimate, Precision, CUDA_OVERHEAD};
use crate::task::{self, BuildContext};
use crate::Error;
use oomguard_host::memory::card_has_native_bf16;

pub use oomguard_cli::PlanArgs;

/// Nothing fits: exit code 3, the message already printed.
#[derive(Debug, thiserror::Error)]
#[error("nothing fits in {0}")]
pub struct NothingFits(pub String);

pub fn exec(args: PlanArgs) -> anyhow::Result<()> {
    let path = args.config.clone();
    config::in_file(plan(args), Some(&path))
}

fn plan(args: PlanArgs) -> anyhow::Result<()> {
    let cfg = config::load(&args.config, &args.set).map_err(Error::from)?;
    let c = &cfg.raw;
    // What `train` would run: the device `train.device` resolves to (auto: a GPU where there
    // is one), and `train.precision` on it, or on the card `--device-memory` names.
    let device = c.train.device();
    let cuda_config = device.is_cuda();
    let auto_on_a_card = args.device_memory.is_some() && c.train.precision == crate::precision::PrecisionConfig::Auto;
    let precision = match args.precision.as_deref() {
        Some("fp32") => Precision::Fp32,
        Some("fp16") => Precision::Fp16,
        Some(_) => Precision::Bf16,
        // A card by name: bf16 where it runs natively (not a T4's); a bare size, bf16 assumed.
        None if auto_on_a_card => match args.device_memory.as_deref().and_then(card_has_native_bf16) {
            Some(false) => Precision::Fp32,
            _ => Precision::Bf16,
        },
        None => c.train.precision.resolve(device),
    };
    let (memory, cuda, what) = match &args.device_memory {
        Some(text) => {
            let bytes = device_memory(text).ok_or_else(|| {
                Error::Config(config::ConfigError {
                    origin: "--device-memory".into(),
                    line_col: None,
                    key: String::new(),
                    message: format!(
                        "`{text}` is not a size (24GiB) or a known card (T4, L4, A100-40GB, A100-80GB, H100, H200)"
                    ),
                })
            })?;
            // A device's memory, by card name or by size alike: its caching allocator's overhead
            // applies either way.
            (bytes, true, text.clone())
        }
        None if !cuda_config => {
            let (b, why) =
                budget::resolve_described(c.memory.budget()?, &c.memory.budget, 0, budget::host_memory().as_ref())
                    .ok_or_else(|| plan_needs_memory(&cfg, "memory.budget", "is none"))?;
            (b, false, format!("the CPU budget ({why})"))
        }
        None => return Err(plan_needs_memory(&cfg, "train.device", &format!("is {}", c.train.device)).into()),
    };
    if c.model.kind != ModelKind::Gpt {
        if args.nproc_per_node > 1 {
            return Err(Error::Config(config::ConfigError {
                origin: "--nproc-per-node".into(),
                line_col: None,
                key: String::new(),
                message: format!(
                    "plans each rank's share for the built-in GPT only; a {} model is measured in one process: leave \
                     --nproc-per-node out (a rank of data parallel holds what one process does, with ZeRO sharding less)",
                    format!("{:?}", c.model.kind).to_lowercase()
                ),
            })
            .into());
        }
        return measured(&cfg, &args, memory, cuda, &what, precision);
    }
    let model = c.model.gpt();
    // The buckets a run of this config would make (data parallel).
    let ckpt = c.model.activation_checkpointing == Some(ActivationCheckpointing::Blocks);
    let estimate = Estimate::new(&model, precision, cuda)
        .with_checkpointing(ckpt)
        .with_bucket_cap(c.train.bucket_bytes(&c.memory) as u64);
    let global = c.train.global_batch_size();
    if args.nproc_per_node > 1 {
        return per_rank(&args, &estimate, memory, global, &what);
    }
    let fit = estimate.largest_fitting(memory, global);
    let shown = fit.max(1);
    let configured = match c.train.micro_batch_size {
        crate::train::MicroBatch::Size(m) => Some(m),
        crate::train::MicroBatch::Auto => None,
    };
    if args.json {
        let report = serde_json::json!({
            "memory_bytes": memory, "precision": precision, "global_batch_size": global,
            "largest_micro_batch_size": fit, "grad_accum_steps": if fit > 0 { Some(global.div_ceil(fit)) } else { None },
            "peak_bytes_at": shown, "peak_bytes": estimate.peak_of(shown, global), "estimate": estimate,
            "configured_peak_bytes": configured.map(|m| estimate.peak_of(m, global)),
            "suggestions": if fit == 0 { suggestions(&model, precision, cuda, memory, estimate.bucket_cap, global, ckpt) } else { vec![] },
            "a_rung_fits": fit == 0 && crate::plan::a_rung_fits(&model, precision, cuda, memory, global,
                c.memory.allow_activation_checkpointing || ckpt, c.memory.allow_precision_fallback),
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{} at micro-batch {shown}, {precision:?}, against {} ({what}):",
            args.config.display(),
            human_bytes(memory)
        );
        for (k, v) in estimate.table(shown, global) {
            println!("  {k:<34} {v}");
        }
        if fit > 0 {
            println!("largest micro-batch that fits: {fit} -> {}", batch_setting(fit, global));
        } else {
            println!(
                "nothing fits: even micro-batch 1 needs {} of {}. What would fit:",
                human_bytes(estimate.peak_of(1, global)),
                human_bytes(memory)
            );
            for s in suggestions(&model, precision, cuda, memory, estimate.bucket_cap, global, ckpt) {
                println!("  - {s}");
            }
        }
    }
    if fit == 0 {
        return Err(NothingFits(human_bytes(memory)).into());
    }
    Ok(())
}

/// The config lines for micro-batches of `fit` in a step of `global` samples: accumulation
/// where `fit` divides it, else the global batch (the last micro-batch smaller), which is
/// what the run does with them.
fn batch_setting(fit: usize, global: usize) -> String {
    let n = global.div_ceil(fit);
    if global.is_multiple_of(fit) {
        format!("micro_batch_size: {fit}, grad_accum_steps: {n} (global batch {global})")
    } else {
        format!(
            "micro_batch_size: {fit}, global_batch_size: {global} ({n} micro-batches, the last of {})",
            global - fit * (n - 1)
        )
    }
}

/// `--nproc-per-node N`: each `train.shard` stage per rank, which fits at what micro-batch,
/// and when none does, how many ranks would.
fn per_rank(args: &PlanArgs, estimate: &Estimate, memory: u64, global: usize, what: &str) -> anyhow::Result<()> {
    use crate::optim::Shard;
    let n = args.nproc_per_node;
    // As `oomguard train` refuses it: every rank needs a sample of each step.
    crate::train::check_world(global, n as usize, &args.config.display().to_string())?;
    let samples = global.div_ceil(n as usize); // the largest rank's share of a step
    let stages: Vec<(Shard, Estimate, usize)> = [Shard::None, Shard::Optimizer, Shard::Gradients]
        .into_iter()
        .map(|s| {
            // The ranks of `--nproc-per-node` share one host.
            let shm = crate::dist::shared_memory_allowed();
            let e = estimate.clone().through_shared_memory(shm).with_shard(s, n);
            let fit = e.largest_fitting(memory, samples);
            (s, e, fit)
        })
        .collect();
    let best = stages.iter().find(|(_, _, fit)| *fit > 0);
    let ranks = estimate.ranks_to_fit(memory, global);
    if args.json {
        let rows: Vec<_> = stages.iter().map(|(s, e, fit)| serde_json::json!({
            "shard": s, "optimizer_bytes": e.optimizer_bytes, "peak_bytes_at_1": e.peak_of(1, samples), "largest_micro_batch_size": fit,
        })).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "memory_bytes": memory, "nproc_per_node": n, "global_batch_size": global, "samples_per_rank": samples,
                "bucket_bytes": estimate.bucket_cap,
                "shards": rows, "fits": best.map(|b| b.0), "ranks_to_fit": ranks,
            }))?
        );
    } else {
        println!(
            "{} over {n} ranks ({samples} samples each per step), per rank, against {} ({what}):",
            args.config.display(),
            human_bytes(memory)
        );
        for (s, e, fit) in &stages {
            println!(
                "  train.shard: {:<10} AdamW's state {:>10}, micro-batch 1 peaks near {:>10}, largest micro-batch {fit}",
                s.name(), human_bytes(e.optimizer_bytes), human_bytes(e.peak_of(1, samples))
            );
        }
        println!("  (gradients: each bucket's sums become this rank's part of the shard during backward, the rest dropped, so the shard grows as the \
            activations go and beside it stand the largest gradient and the buckets being summed; with activation checkpointing or \
            train.overlap_grad_reduce: false every gradient is whole, as under optimizer)");
        println!(
            "  (gradient buckets of at most {}: train.bucket_cap_mb, else 1 MiB or 1/128 of a fixed memory.budget where less, at least 4 KiB)",
            human_bytes(estimate.bucket_cap)
        );
        match best {
            Some((s, _, fit)) => println!(
                "fits: train.shard: {} at micro-batch {fit}{}", s.name(),
                if *s == Shard::None { String::new() } else { " (the guard climbs to it by itself unless memory.allow_sharding is false)".into() }
            ),
            None => match ranks {
                Some(w) => println!("nothing fits on {n} ranks, even sharded; {w} ranks with train.shard: optimizer would fit micro-batch 1"),
                None => println!("nothing fits on any number of ranks: the parameters, their gradients and one sample alone need more than \
                    {}", human_bytes(memory)),
            },
        }
    }
    match best {
        Some(_) => Ok(()),
        None => Err(NothingFits(human_bytes(memory)).into()),
    }
}

/// A model without a formula: measured by trial steps (on the CPU, or the config's GPU
/// where there is one), a line fitted, extrapolated to `memory`.
fn measured(
    cfg: &Config,
    args: &PlanArgs,
    memory: u64,
    cuda: bool,
    what: &str,
    precision: Precision,
) -> anyhow::Result<()> {
    let c = &cfg.raw;
    let device = if c.train.device().is_cuda() {
        c.train.device()
    } else {
        tch::Device::Cpu
    };
    memory::install_cpu_allocator();
    tch::manual_seed(c.train.seed as i64);
    let base = cfg.base_dir();
    let built = task::build_from_config(&BuildContext {
        device,
        model: &c.model,
        data: &c.data,
        base_dir: &base,
        config_path: &cfg.path,
    })?;
    let data = task::data_for(&cfg.raw.model, &cfg.raw.data, &cfg.base_dir(), built.data)?;
    let t = built.task;
    let opt = AdamW::new(t.parameters(), &c.optim, |n, p| t.no_weight_decay(n, p))?;
    let global = c.train.global_batch_size();
    let batches = StepSamples::new(data.train.as_ref(), c.train.seed, global, device);
    let amp = crate::precision::Amp {
        precision,
        device,
        loss_scale: None,
    };
    let Some(mut profile) = measure(t.as_ref(), &batches, &|| opt.clear_grads(), &amp, CUDA_OVERHEAD)? else {
        anyhow::bail!(
            "even one sample ran out of memory while measuring {} on this machine",
            t.describe()
        );
    };
    profile.allocator_overhead = if cuda { CUDA_OVERHEAD } else { 0.0 };
    if cuda && !device.is_cuda() {
        // Measured on the CPU for a card: cuBLAS's workspaces there, which the CPU has none of.
        profile.fixed_bytes += crate::plan::CUDA_WORKSPACES;
    }
    let fit = profile.largest_fitting(memory, global);
    let configured = match c.train.micro_batch_size {
        crate::train::MicroBatch::Size(m) => Some(m),
        crate::train::MicroBatch::Auto => None,
    };
    if args.json {
        let report = serde_json::json!({
            "method": "measured", "memory_bytes": memory, "precision": precision, "global_batch_size": global,
            "largest_micro_batch_size": fit, "grad_accum_steps": if fit > 0 { Some(global.div_ceil(fit)) } else { None },
            "peak_bytes_at": fit.max(1), "peak_bytes": profile.peak(fit.max(1)),
            "configured_peak_bytes": configured.map(|m| profile.peak(m)), "profile": profile,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{} ({}), measured on {device:?} in {precision:?}, against {} ({what}):",
            args.config.display(),
            t.describe(),
            human_bytes(memory)
        );
        for (m, p) in &profile.measured {
            println!("  {:<34} {}", format!("trial step at micro-batch {m}"), human_bytes(*p));
        }
        println!(
            "  {:<34} {}",
            "fixed (weights, grads, AdamW, ...)",
            human_bytes(profile.fixed_bytes)
        );
        println!("  {:<34} {}", "per sample", human_bytes(profile.per_sample_bytes));
        println!(
            "  {:<34} {:.0}%",
            "allocator overhead",
            profile.allocator_overhead * 100.0
        );
        if fit > 0 {
            println!("largest micro-batch that fits: {fit} -> {}", batch_setting(fit, global));
        } else {
            println!(
                "nothing fits: even micro-batch 1 needs {} of {}. What would fit: more memory, a shorter model.block_size, or a smaller model",
                human_bytes(profile.peak(1)), human_bytes(memory)
            );
        }
    }
    if fit == 0 {
        return Err(NothingFits(human_bytes(memory)).into());
    }
    Ok(())
}

/// `oomguard plan` with no memory to plan against: the config's key and the flag that gives it.
fn plan_needs_memory(cfg: &config::Config, key: &str, what: &str) -> Error {
    Error::Config(config::ConfigError {
        origin: cfg.path.display().to_string(),
        line_col: None,
        key: key.into(),
        message: format!("{what}, so there is no memory to plan against: give --device-memory (a size such as 24GiB, or a card such as A100)"),
    })
}
