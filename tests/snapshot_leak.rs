//! Seed 002's kept graph, in a Rust model of its own: it keeps every step's loss and the
//! hidden activation it came from (for a metric it means to compute later), so each step
//! leaves its activations alive. The OOM summaries show that category growing, as activations
//! kept from earlier steps, and the guard's `leak_warning` fires. In-process, through the
//! library's `train` command.
mod common;
#[path = "../examples/mlp.rs"]
mod mlp;
use common::*;
use oomguard::data::Dataset;
use oomguard::task::{BuildContext, Built, Task};
use std::cell::RefCell;
use tch::{nn, Kind, Reduction, TchError, Tensor};

struct Leaky {
    vs: nn::VarStore,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    /// The bug: (hidden, loss) of every training forward, kept across steps.
    kept: RefCell<Vec<(Tensor, Tensor)>>,
}

impl Task for Leaky {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut named: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    }
    fn loss(&self, x: &Tensor, y: &Tensor, train: bool) -> Result<Tensor, TchError> {
        // A wide layer (a step's own working memory), then a narrow one whose output is kept.
        let wide = x.f_linear(&self.w1, None::<Tensor>)?.f_relu()?;
        let h = wide.f_linear(&self.w2, None::<Tensor>)?.f_relu()?;
        let loss = h.f_linear(&self.w3, None::<Tensor>)?.f_cross_entropy_loss(
            y,
            None::<Tensor>,
            Reduction::Mean,
            -100,
            0.0,
        )?;
        if train {
            self.kept.borrow_mut().push((h, loss.shallow_clone()));
        }
        Ok(loss)
    }
}

fn build(ctx: &BuildContext) -> oomguard::Result<Built> {
    let vs = nn::VarStore::new(ctx.device);
    let p = vs.root();
    let w1 = p.add("w1", Tensor::f_randn([256, 2], (Kind::Float, ctx.device))?, true);
    let w2 = p.add("w2", Tensor::f_randn([8, 256], (Kind::Float, ctx.device))?, true);
    let w3 = p.add("w3", Tensor::f_randn([2, 8], (Kind::Float, ctx.device))?, true);
    let data = Dataset {
        train: Box::new(mlp::Spirals::new(0, 1 << 20)),
        val: Box::new(mlp::Spirals::new(1 << 20, 4096)),
    };
    Ok(Built::new(Leaky {
        vs,
        w1,
        w2,
        w3,
        kept: RefCell::new(Vec::new()),
    })
    .with_data(data))
}

#[test]
fn a_kept_graph_grows_in_successive_summaries_and_warns() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("OOMGUARD_CACHE", dir.path().join("cache"));
    let cfg = write_config(
        dir.path(),
        "leaky.yaml",
        "model: {kind: rust}\n\
         optim: {lr: 1.0e-2, warmup_steps: 1}\n\
         train: {micro_batch_size: 256, grad_accum_steps: 1, max_steps: 120, eval_every: 0, device: cpu, num_threads: 1}\n\
         memory: {budget: 1MiB, leak_steps: 3, grow_after_steps: 1000, allow_precision_fallback: false}\n",
    );
    let run = dir.path().join("run");
    let code = oomguard::cli::train::run_with(
        ["leaky", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()],
        &build,
    );
    assert_eq!(code, 3, "memory runs out for good at step 75: exit 3");
    assert!(!records(&run, "leak_warning").is_empty(), "no leak_warning");
    let ooms = records(&run, "oom");
    assert!(ooms.len() >= 2, "{ooms:?}");
    let kept: Vec<(u64, u64)> = ooms
        .iter()
        .map(|e| {
            let folder = e["snapshot"].as_str().expect("every oom event names its snapshot");
            let s: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(run.join(folder).join("summary.json")).unwrap()).unwrap();
            (
                s["step"].as_u64().unwrap(),
                s["activations_from_earlier_steps_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    // Later steps' summaries hold more of the earlier steps' activations.
    let first = kept.first().unwrap();
    let last = kept.last().unwrap();
    assert!(last.0 > first.0 && last.1 > first.1 && first.1 > 0, "{kept:?}");
    assert!(
        kept.windows(2).all(|w| w[0].0 == w[1].0 || w[1].1 >= w[0].1),
        "{kept:?}"
    );
    let text = ooms.last().unwrap()["memory_summary"].as_str().unwrap().to_string();
    assert!(text.contains("kept from earlier steps"), "{text}");
    let log = std::fs::read_to_string(run.join("train.log")).unwrap();
    assert!(
        log.contains("What filled memory (oom/"),
        "the exit-3 message carries the summary"
    );
}
