//! A model of your own, trained by oomguard: an MLP classifying points on two interleaved
//! spirals. It gets everything `oomguard train` gives the built-in GPT: the allocation
//! guard, checkpoints and exact resume, SIGINT/SIGTERM handling, metrics.jsonl, evaluation,
//! `micro_batch_size: auto` and the exit codes.
//!
//! `cargo run --release --example mlp -- examples/mlp.yaml --run-dir runs/mlp`
//! (then `--resume` continues from its newest checkpoint).
use oomguard::data::{Dataset, Samples};
use oomguard::task::{BuildContext, Built, Task};
use serde::Deserialize;
use tch::{nn, Device, Kind, Reduction, TchError, Tensor};

/// The model's own settings, `model.settings` in the config.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MlpSettings {
    pub hidden: i64,
    pub layers: usize,
}

impl Default for MlpSettings {
    fn default() -> Self {
        MlpSettings { hidden: 256, layers: 2 }
    }
}

/// Implement `Task` with fallible calls only (`f_*`): tch's `Module::forward`, plain
/// operators and `nn::linear`'s initialisation panic when an allocation fails.
pub struct Mlp {
    vs: nn::VarStore,
    layers: Vec<(Tensor, Tensor)>,
}

impl Task for Mlp {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut named: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    }
    fn loss(&self, x: &Tensor, y: &Tensor, _train: bool) -> Result<Tensor, TchError> {
        let mut h = x.shallow_clone();
        for (i, (w, b)) in self.layers.iter().enumerate() {
            h = h.f_linear(w, Some(b))?;
            if i + 1 < self.layers.len() {
                h = h.f_relu()?;
            }
        }
        h.f_cross_entropy_loss(y, None::<Tensor>, Reduction::Mean, -100, 0.0)
    }
    fn describe(&self) -> String {
        format!("an MLP of {} layers", self.layers.len())
    }
}

/// Points on two interleaved spirals: sample `p` is a pure function of `p` (the trainer picks
/// positions per step from (seed, step), so resume and re-splitting stay exact).
pub struct Spirals {
    from: usize,
    len: usize,
}

impl Spirals {
    /// `len` samples from position `from` on (training and validation take apart ranges).
    pub fn new(from: usize, len: usize) -> Spirals {
        Spirals { from, len }
    }
}

impl Samples for Spirals {
    fn num_positions(&self) -> usize {
        self.len
    }
    fn batch(&self, positions: &[usize], device: Device) -> oomguard::Result<(Tensor, Tensor)> {
        // Computed in Rust, then one fallible copy each: tch's scalar ops (f_mul_scalar, ...)
        // panic when their allocation fails; see oomguard::ops.
        let (mut x, mut y) = (
            Vec::with_capacity(2 * positions.len()),
            Vec::with_capacity(positions.len()),
        );
        for &p in positions {
            let i = (p + self.from) as f64;
            let (t, label) = ((i * 0.0137) % 12.0, (i % 2.0) as i64);
            let angle = t + label as f64 * std::f64::consts::PI;
            x.extend([(angle.cos() * t / 12.0) as f32, (angle.sin() * t / 12.0) as f32]);
            y.push(label);
        }
        let x = Tensor::f_from_slice(&x)?.f_view([positions.len() as i64, 2])?;
        Ok((x.f_to_device(device)?, Tensor::f_from_slice(&y)?.f_to_device(device)?))
    }
    fn name(&self) -> String {
        "spirals".into()
    }
}

/// Builds the model (after oomguard has set up memory and the device) and its data.
pub fn build(ctx: &BuildContext) -> oomguard::Result<Built> {
    let s: MlpSettings = ctx.settings()?;
    let vs = nn::VarStore::new(ctx.device);
    let p = vs.root();
    let dims: Vec<i64> = std::iter::once(2)
        .chain(std::iter::repeat_n(s.hidden, s.layers))
        .chain([2])
        .collect();
    let mut layers = Vec::new();
    for (i, w) in dims.windows(2).enumerate() {
        let bound = 1.0 / (w[0] as f64).sqrt();
        let weight = Tensor::f_empty([w[1], w[0]], (Kind::Float, ctx.device))?.f_uniform_(-bound, bound)?;
        let bias = Tensor::f_zeros([w[1]], (Kind::Float, ctx.device))?;
        let layer = &p / format!("l{i}");
        layers.push((layer.add("weight", weight, true), layer.add("bias", bias, true)));
    }
    let data = Dataset {
        train: Box::new(Spirals::new(0, 1 << 20)),
        val: Box::new(Spirals::new(1 << 20, 4096)),
    };
    Ok(Built::new(Mlp { vs, layers }).with_data(data))
}

#[allow(dead_code)] // tests/example_mlp.rs includes this file as a module
fn main() {
    std::process::exit(oomguard::cli::train::main_with(&build));
}
