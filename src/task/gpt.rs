//! Owns the built-in GPT as a `Task`: a VarStore, the formula planner, its shape as fingerprint.
//! Keeps: its fingerprint is exactly its shape keys; its parameters come in definition order.
use tch::{nn::VarStore, Device, TchError, Tensor};

use super::{Fingerprint, Task};
use crate::model::{no_weight_decay, Gpt, GptConfig, LossKind};
use crate::plan::{Estimate, Precision};
use crate::precision::Amp;

pub struct GptTask {
    pub vs: VarStore,
    pub model: Gpt,
    /// `model.activation_checkpointing: blocks`, or turned on by the guard's ladder.
    pub checkpointing: bool,
}

impl GptTask {
    pub fn new(cfg: &GptConfig, device: Device) -> Result<GptTask, TchError> {
        let vs = VarStore::new(device);
        let model = Gpt::new(&vs.root(), cfg)?;
        Ok(GptTask {
            vs,
            model,
            checkpointing: false,
        })
    }
}

/// Where a parameter of the GPT comes in its definition (and forward): the embeddings, the
/// blocks by number, the final norm. The order the gradients' first buckets are laid out
/// in, reversed; "h.10" after "h.9".
fn definition_order(name: &str) -> (u8, u64, String) {
    let mut parts = name.splitn(3, '.');
    match (parts.next(), parts.next()) {
        (Some("wte"), _) => (0, 0, String::new()),
        (Some("wpe"), _) => (1, 0, String::new()),
        (Some("h"), Some(i)) => (2, i.parse().unwrap_or(u64::MAX), parts.next().unwrap_or("").to_string()),
        _ => (3, 0, name.to_string()),
    }
}

impl Task for GptTask {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut named: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        named.sort_by_cached_key(|(n, _)| definition_order(n));
        named
    }
    fn loss(&self, inputs: &Tensor, targets: &Tensor, train: bool) -> Result<Tensor, TchError> {
        self.model.loss(inputs, targets, train)
    }
    fn forward_backward(&self, inputs: &Tensor, targets: &Tensor, weight: f64, amp: &Amp) -> crate::Result<Tensor> {
        if self.checkpointing {
            return self.model.checkpointed_forward_backward(inputs, targets, weight, amp);
        }
        let loss = super::forward(|| self.model.loss(inputs, targets, true), amp)?;
        super::backward(&loss, weight, amp)
    }
    fn activation_checkpointing(&self) -> Option<bool> {
        Some(self.checkpointing)
    }
    fn set_activation_checkpointing(&mut self, on: bool) {
        self.checkpointing = on;
    }
    /// Recomputation back-propagates the head and the embedding in passes of their own, and
    /// they share the tied embedding's weight.
    fn backward_is_one_pass(&self) -> bool {
        !self.checkpointing
    }
    fn loss_kind(&self) -> Option<LossKind> {
        Some(self.model.config().loss)
    }
    fn set_loss_kind(&mut self, loss: LossKind) {
        self.model.set_loss(loss);
    }
    fn no_weight_decay(&self, name: &str, _param: &Tensor) -> bool {
        no_weight_decay(name)
    }
    fn fingerprint(&self) -> Fingerprint {
        let m = self.model.config();
        [
            ("n_layer", m.n_layer.to_string()),
            ("n_head", m.n_head.to_string()),
            ("n_embd", m.n_embd.to_string()),
            ("block_size", m.block_size.to_string()),
            ("vocab_size", m.vocab_size.to_string()),
            ("bias", m.bias.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (format!("model.{k}"), v))
        .collect()
    }
    fn describe(&self) -> String {
        format!(
            "a GPT of {:.2}M parameters",
            self.model.config().num_params() as f64 / 1e6
        )
    }
    fn formula(&self) -> Option<Estimate> {
        Some(
            Estimate::new(self.model.config(), Precision::Fp32, self.vs.device().is_cuda())
                .with_checkpointing(self.checkpointing),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::definition_order;

    #[test]
    fn parameters_sort_in_definition_order() {
        let mut names = [
            "ln_f.weight",
            "h.10.ln_1.weight",
            "wpe",
            "h.2.mlp.c_fc.weight",
            "wte",
            "h.2.attn.c_attn.weight",
        ];
        names.sort_by_key(|n| definition_order(n));
        assert_eq!(
            names,
            [
                "wte",
                "wpe",
                "h.2.attn.c_attn.weight",
                "h.2.mlp.c_fc.weight",
                "h.10.ln_1.weight",
                "ln_f.weight"
            ]
        );
    }
}
