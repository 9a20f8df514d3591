// The fallible optimiser step: one fused AdamW kernel per parameter group, and gradient
// clipping. Errors (an OOM included) come back as messages instead of exceptions.
#include "oomguard.h"

#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <vector>

namespace {
std::vector<at::Tensor> tensors(void** ptrs, int n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) out.push_back(*static_cast<at::Tensor*>(ptrs[i]));
  return out;
}

// Like torch.optim.AdamW(fused=True): the kernel reads the already-incremented step.
void fused_adamw(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& m,
                 const std::vector<at::Tensor>& v, const std::vector<at::Tensor>& s, double lr, double beta1, double beta2,
                 double weight_decay, double eps, void* found_inf) {
  if (p.empty()) return;
  std::optional<at::Tensor> inf;
  if (found_inf) inf = *static_cast<at::Tensor*>(found_inf);
  at::_fused_adamw_(p, g, m, v, {}, s, lr, beta1, beta2, weight_decay, eps,
                    /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, inf);
}
}  // namespace

extern "C" {

// The commit half of a transactional AdamW step: `next_steps` (the step counts after this
// update, allocated by the caller beforehand) are copied in and the fused kernel updates
// parameters and moments in place. Neither allocates, so once this starts it completes;
// every allocation of the step happened before, while nothing had changed yet. `found_inf`
// (fp16's overflow flag, on the device; may be NULL): where it is 1 the kernel leaves
// parameters and moments as they are (the step counts were prepared unchanged), decided on
// the device with no read back to the host, as torch's fused AdamW with a GradScaler does.
char* og_adamw_commit(void** params, void** exp_avgs, void** exp_avg_sqs, void** steps,
                      void** next_steps, int n, double lr, double beta1, double beta2,
                      double weight_decay, double eps, void* found_inf) {
  return oomguard::guarded([&] {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> p, g, m, v, s;
    for (int i = 0; i < n; ++i) {
      const auto& param = *static_cast<at::Tensor*>(params[i]);
      if (!param.grad().defined()) continue;  // unused in this step: no update, as in torch
      p.push_back(param);
      g.push_back(param.grad());
      m.push_back(*static_cast<at::Tensor*>(exp_avgs[i]));
      v.push_back(*static_cast<at::Tensor*>(exp_avg_sqs[i]));
      s.push_back(*static_cast<at::Tensor*>(steps[i]));
      s.back().copy_(*static_cast<at::Tensor*>(next_steps[i]));
    }
    fused_adamw(p, g, m, v, s, lr, beta1, beta2, weight_decay, eps, found_inf);
  });
}

// The same kernel over explicit tensors (ZeRO: views of this rank's pieces of the
// parameters, their gradients and the moments' shard); the step counts are already set.
char* og_adamw_update(void** params, void** grads, void** exp_avgs, void** exp_avg_sqs, void** steps, int n,
                      double lr, double beta1, double beta2, double weight_decay, double eps, void* found_inf) {
  return oomguard::guarded([&] {
    torch::NoGradGuard no_grad;
    fused_adamw(tensors(params, n), tensors(grads, n), tensors(exp_avgs, n), tensors(exp_avg_sqs, n), tensors(steps, n), lr,
                beta1, beta2, weight_decay, eps, found_inf);
  });
}

// Data parallel: every rank reduces every parameter's gradient each step, so a parameter
// this rank did not use gets zeros (as DDP does), and the ranks' gradient lists stay equal.
char* og_zero_missing_grads(void** params, int n) {
  return oomguard::guarded([&] {
    for (int i = 0; i < n; ++i) {
      auto& p = *static_cast<at::Tensor*>(params[i]);
      if (p.requires_grad() && !p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    }
  });
}

// torch::nn::utils::clip_grad_norm_'s arithmetic (per-gradient norms, the norm of those,
// coefficient max_norm / (norm + 1e-6) clamped to 1) without its final .item(): the norm
// stays on the device (out: a new tensor) and the coefficient is applied there, so clipping
// adds no host sync. An infinite max_norm only measures.
char* og_clip_grad_norm(void** params, int n, double max_norm, void** out) {
  return oomguard::guarded([&] {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    const auto ps = tensors(params, n);
    for (const auto& p : ps)
      if (p.grad().defined()) grads.push_back(p.grad());
    if (grads.empty()) {
      *out = new at::Tensor(at::zeros({}, ps.empty() ? at::TensorOptions(at::kFloat) : ps[0].options().dtype(at::kFloat)));
      return;
    }
    std::vector<at::Tensor> norms;
    norms.reserve(grads.size());
    for (const auto& g : grads) norms.push_back(g.norm(2));
    at::Tensor total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(2);
    if (std::isfinite(max_norm)) {
      at::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
      for (auto& g : grads) g.mul_(coef);
    }
    *out = new at::Tensor(total);
  });
}

}  // extern "C"
