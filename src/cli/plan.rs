//! `oomguard plan CONFIG [--device-memory SIZE|CARD] [--precision fp32|bf16] [--json]`
use crate::config;
use crate::memory::{budget, human_bytes};
use crate::plan::{device_memory, suggestions, Estimate, Precision};
use crate::Error;

pub use oomguard_launch::cli::PlanArgs;

/// Nothing fits: exit code 3, the message already printed.
#[derive(Debug, thiserror::Error)]
#[error("nothing fits in {0}")]
pub struct NothingFits(pub String);

pub fn exec(args: PlanArgs) -> anyhow::Result<()> {
    let cfg = config::load(&args.config, &args.set).map_err(Error::from)?;
    let c = &cfg.raw;
    let precision = if args.precision == "bf16" { Precision::Bf16 } else { Precision::Fp32 };
    let cuda_config = c.train.device.starts_with("cuda");
    let (memory, cuda, what) = match &args.device_memory {
        Some(text) => {
            let bytes = device_memory(text).ok_or_else(|| Error::Config(config::ConfigError {
                origin: "--device-memory".into(), line_col: None, key: String::new(),
                message: format!("`{text}` is not a size (24GiB) or a known card (T4, L4, A100-40GB, A100-80GB, H100)"),
            }))?;
            // A device's memory, by card name or by size alike: its caching allocator's overhead
            // applies either way.
            (bytes, true, text.clone())
        }
        None if !cuda_config => {
            let b = budget::resolve(c.memory.budget()?, 0, budget::available_bytes())
                .ok_or_else(|| anyhow::anyhow!("memory.budget is none: give --device-memory"))?;
            (b, false, format!("the CPU budget (memory.budget: {})", c.memory.budget))
        }
        None => anyhow::bail!("train.device is {}: give --device-memory (a size or a card such as A100)", c.train.device),
    };
    let model = c.model.gpt();
    let estimate = Estimate::new(&model, precision, cuda);
    let global = c.train.global_batch_size();
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
            "peak_bytes_at": shown, "peak_bytes": estimate.peak(shown), "estimate": estimate,
            "configured_peak_bytes": configured.map(|m| estimate.peak(m)),
            "suggestions": if fit == 0 { suggestions(&model, precision, cuda, memory) } else { vec![] },
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{} at micro-batch {shown}, {precision:?}, against {} ({what}):", args.config.display(), human_bytes(memory));
        for (k, v) in estimate.table(shown) {
            println!("  {k:<34} {v}");
        }
        if fit > 0 {
            println!(
                "largest micro-batch that fits: {fit} -> micro_batch_size: {fit}, grad_accum_steps: {} (global batch {global})",
                global.div_ceil(fit)
            );
        } else {
            println!("nothing fits: even micro-batch 1 needs {} of {}. What would fit:", human_bytes(estimate.peak(1)), human_bytes(memory));
            for s in suggestions(&model, precision, cuda, memory) {
                println!("  - {s}");
            }
        }
    }
    if fit == 0 {
        return Err(NothingFits(human_bytes(memory)).into());
    }
    Ok(())
}
