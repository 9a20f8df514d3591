// The fallible optimiser step: one fused AdamW kernel per parameter group, and gradient
// clipping. Errors (an OOM included) come back as messages instead of exceptions.
#include "oomguard.h"

#include <torch/torch.h>

#include <vector>

namespace {
std::vector<at::Tensor> tensors(void** ptrs, int n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) out.push_back(*static_cast<at::Tensor*>(ptrs[i]));
  return out;
}
}  // namespace

extern "C" {

// The commit half of a transactional AdamW step: `next_steps` (the step counts after this
// update, allocated by the caller beforehand) are copied in and the fused kernel updates
// parameters and moments in place. Neither allocates, so once this starts it completes;
// every allocation of the step happened before, while nothing had changed yet.
char* og_adamw_commit(void** params, void** exp_avgs, void** exp_avg_sqs, void** steps,
                      void** next_steps, int n, double lr, double beta1, double beta2,
                      double weight_decay, double eps) {
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
    if (p.empty()) return;
    // Like torch.optim.AdamW(fused=True): the kernel reads the already-incremented step.
    at::_fused_adamw_(p, g, m, v, {}, s, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false);
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

char* og_clip_grad_norm(void** params, int n, double max_norm, double* total_norm) {
  return oomguard::guarded([&] {
    *total_norm = torch::nn::utils::clip_grad_norm_(tensors(params, n), max_norm);
  });
}

}  // extern "C"
