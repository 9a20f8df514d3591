//! A model of your own under the allocation guard: an MLP classifying synthetic points,
//! trained with a CPU memory budget so small that the guard must shrink the micro-batch.
//!
//! `cargo run --release --example mlp`
use oomguard::guard::Guard;
use oomguard::memory::{self, MemoryConfig};
use oomguard::optim::{AdamW, OptimConfig};
use oomguard::train::{train_step, StepBatches, TrainModel};
use tch::{nn, Device, Kind, Reduction, TchError, Tensor};

/// Any model works: implement `TrainModel::loss` with fallible calls only (`f_*`). tch's
/// `Module::forward` and plain ops panic on an allocation failure instead of returning it.
struct Mlp {
    layers: Vec<nn::Linear>,
}

impl TrainModel for Mlp {
    fn loss(&self, x: &Tensor, y: &Tensor, _train: bool) -> Result<Tensor, TchError> {
        let mut h = x.shallow_clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = h.f_linear(&l.ws, l.bs.as_ref())?;
            if i + 1 < self.layers.len() {
                h = h.f_relu()?;
            }
        }
        h.f_cross_entropy_loss(y, None::<Tensor>, Reduction::Mean, -100, 0.0)
    }
}

/// Step `s` is a fixed set of points (a pure function of s), whatever the micro-batch.
struct Points {
    global_batch: usize,
}

impl StepBatches for Points {
    fn global_batch_size(&self) -> usize {
        self.global_batch
    }
    fn tokens_per_sample(&self) -> usize {
        1
    }
    fn micro_batch(&self, step: u64, samples: std::ops::Range<usize>) -> oomguard::Result<(Tensor, Tensor)> {
        let n = samples.len() as i64;
        let idx = Tensor::f_arange_start(samples.start as i64, samples.end as i64, (Kind::Float, Device::Cpu))?;
        // Points on two interleaved spirals; label = which spiral.
        let t = idx.f_mul_scalar(0.37)?.f_add_scalar(step as f64 * 0.11)?.f_remainder(12.0)?;
        let label = idx.f_remainder(2.0)?;
        let angle = t.f_add(&label.f_mul_scalar(std::f64::consts::PI)?)?;
        let x = Tensor::f_stack(&[angle.f_cos()?.f_mul(&t)?, angle.f_sin()?.f_mul(&t)?], 1)?.f_div_scalar(12.0)?;
        Ok((x.f_view([n, 2])?, label.f_to_kind(Kind::Int64)?))
    }
}

pub struct Report {
    pub first_loss: f64,
    pub last_loss: f64,
    pub num_ooms: u64,
    pub final_micro_batch_size: usize,
}

/// Trains `steps` steps of global batch 512 under `budget` bytes of CPU memory.
pub fn run(steps: u64, budget: Option<u64>) -> oomguard::Result<Report> {
    memory::install_cpu_allocator();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let p = vs.root();
    let dims = [2, 256, 256, 2];
    let layers = (0..3).map(|i| nn::linear(&p / format!("l{i}"), dims[i], dims[i + 1], Default::default())).collect();
    let model = Mlp { layers };
    let mut opt = AdamW::new(&vs, &OptimConfig { lr: 3e-3, weight_decay: 0.0, ..Default::default() }, |_| false)?;
    let data = Points { global_batch: 512 };
    memory::set_cpu_budget(budget.map(|b| b + memory::cpu_live_bytes()));
    let mut guard = Guard::new(&MemoryConfig::default(), 512, Device::Cpu);
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for step in 0..steps {
        let stats = guard.run(step, &mut opt, |opt, mb| train_step(&model, opt, &data, step, mb, 3e-3, 1.0), |opt| opt.clear_grads())?;
        if step == 0 {
            first = stats.loss;
        }
        last = stats.loss;
    }
    memory::set_cpu_budget(None);
    Ok(Report { first_loss: first, last_loss: last, num_ooms: guard.policy.num_ooms, final_micro_batch_size: guard.micro_batch_size() })
}

#[allow(dead_code)] // the test includes this file as a module and calls `run`
fn main() -> oomguard::Result<()> {
    // 1 MiB above the model: 512 points with 256-wide activations need more, so the guard
    // halves the micro-batch until a step fits.
    let r = run(200, Some(1 << 20))?;
    println!(
        "loss {:.3} -> {:.3}; {} OOMs recovered; micro-batch 512 -> {}",
        r.first_loss, r.last_loss, r.num_ooms, r.final_micro_batch_size
    );
    Ok(())
}
