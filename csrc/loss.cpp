// The GPT's LM head and cross-entropy fused (Liger Kernel's FusedLinearCrossEntropy): the
// tokens go through in chunks of rows, so no more than one chunk of logits is ever alive
// (never the whole B x T x vocab, nor its log-softmax and gradient). Each chunk's gradients
// of the hidden states and of the head's weight are formed in the forward, while its logits
// are at hand; backward only scales them by the upstream gradient: the same FLOPs as the
// plain path, nothing recomputed. Under autocast the chunk's matmuls run in the autocast
// dtype (bf16 or fp16 logits, as eager's linear does), softmax and the loss in fp32, and the
// weight's gradient accumulates over the chunks in fp32. An OOM inside a chunk is an
// ordinary exception, returned as a message like every other.
#include "oomguard.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>

namespace {
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kIgnore = -100;  // cross_entropy's ignore_index

// The weight [V, C] seen as [vp, C]: its storage holds vp rows (model/gpt.rs pads it, the
// padding rows zero); a weight without them gets a zero-padded copy.
Tensor padded(const Tensor& weight, int64_t vp) {
  const int64_t v = weight.size(0), c = weight.size(1);
  if (vp == v) return weight;
  const auto need = (weight.storage_offset() + vp * c) * static_cast<int64_t>(weight.element_size());
  if (weight.is_contiguous() && static_cast<int64_t>(weight.storage().nbytes()) >= need)
    return weight.as_strided({vp, c}, {c, 1}, weight.storage_offset());
  return at::cat({weight, at::zeros({vp - v, c}, weight.options())});
}

struct Result {
  Tensor loss, grad_h, grad_w;
};

// Mean cross-entropy of hidden [N, C] @ weight^T against targets [N]; with `grads`, also
// d loss / d hidden [N, C] and d loss / d weight [V, C] (fp32).
Result compute(const Tensor& hidden, const Tensor& weight_in, const Tensor& targets, int64_t vp, int64_t chunk, bool grads) {
  const auto dev = hidden.device().type();
  const auto cdt = at::autocast::is_autocast_enabled(dev) ? at::autocast::get_autocast_dtype(dev) : hidden.scalar_type();
  // Every cast below is explicit; autocast must not add its own.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const Tensor weight = weight_in.detach();
  const int64_t n = hidden.size(0), v = weight.size(0), c = weight.size(1);
  const Tensor w = padded(weight, vp).to(cdt);
  const auto f32 = hidden.options().dtype(at::kFloat);
  // 1 / the valid tokens, on the device (no sync); a chunk of only ignored tokens gives 0
  // loss and 0 gradients, not 0/0.
  const Tensor inv = targets.ne(kIgnore).sum().clamp_min(1).to(at::kFloat).reciprocal();
  // fp16's range: d loss / d logits is kept as (softmax - one_hot) * k in fp16, and the 1/N
  // applied after the matmuls in fp32. Divided first, entries below 6e-8 (a 50k vocabulary
  // at 8k tokens: most of them) would flush to zero. k keeps the weight gradient's sum over
  // a chunk's rows below fp16's maximum.
  const bool half = cdt == at::kHalf;
  const double k = half ? std::min(1.0, 1024.0 / static_cast<double>(chunk)) : 1.0;
  Tensor loss = at::zeros({}, f32.dtype(at::kDouble));
  Result r;
  if (grads) {
    r.grad_h = at::empty_like(hidden);
    r.grad_w = at::zeros({vp, c}, f32);
  }
  for (int64_t s = 0; s < n; s += chunk) {
    const int64_t m = std::min(chunk, n - s);
    const Tensor h = hidden.narrow(0, s, m).to(cdt);
    Tensor z = h.mm(w.t());
    if (z.scalar_type() != at::kFloat) z = z.to(at::kFloat);
    if (vp > v) z.narrow(1, v, vp - v).fill_(-std::numeric_limits<float>::infinity());  // padding masked out
    const Tensor t = targets.narrow(0, s, m);
    const Tensor valid = t.ne(kIgnore);
    const Tensor idx = t.masked_fill(valid.logical_not(), 0).unsqueeze(1);
    // log-sum-exp and softmax in place: the chunk's logits are its only [rows, vocab] buffer.
    const Tensor target_logit = z.gather(1, idx).squeeze(1);
    const Tensor max = z.amax(1, /*keepdim=*/true);
    z.sub_(max).exp_();
    const Tensor sum = z.sum(1, /*keepdim=*/true);
    const Tensor lse = (sum.log() + max).squeeze(1);
    loss.add_(at::where(valid, lse - target_logit, 0.0).sum(at::kDouble));
    if (!grads) continue;
    // softmax - one_hot(target) over the valid tokens: d loss / d logits, / N here, or (fp16)
    // times k, / N after the matmuls.
    z.div_(sum);
    z.scatter_add_(1, idx, -valid.to(at::kFloat).unsqueeze(1));
    z.mul_((half ? valid.to(at::kFloat) * k : valid.to(at::kFloat) * inv).unsqueeze(1));
    const Tensor g = z.to(cdt);
    if (half)
      r.grad_h.narrow(0, s, m).copy_(g.mm(w).to(at::kFloat).mul_(inv).div_(k));
    else
      r.grad_h.narrow(0, s, m).copy_(g.mm(w));
    if (cdt == at::kFloat)
      r.grad_w.addmm_(g.t(), h);
    else
      r.grad_w.add_(g.t().mm(h));
  }
  r.loss = (loss * inv).to(at::kFloat);
  if (grads) r.grad_w = r.grad_w.narrow(0, 0, v);
  if (grads && half) r.grad_w.mul_(inv).div_(k);
  return r;
}

struct FusedLinearCrossEntropy : torch::autograd::Function<FusedLinearCrossEntropy> {
  static Tensor forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight, const Tensor& targets, int64_t vp, int64_t chunk) {
    Result r = compute(hidden, weight, targets, vp, chunk, true);
    ctx->saved_data["grad_h"] = r.grad_h;
    ctx->saved_data["grad_w"] = r.grad_w.to(weight.scalar_type());
    return r.loss;
  }

  // Only scales what the forward formed (in place: nothing allocated), and lets it go.
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const Tensor& g = grad_out[0];
    Tensor gh = ctx->saved_data["grad_h"].toTensor();
    Tensor gw = ctx->saved_data["grad_w"].toTensor();
    ctx->saved_data.clear();
    gh.mul_(g);
    gw.mul_(g);
    return {gh, gw, Tensor(), Tensor(), Tensor()};
  }
};

at::Tensor& t(void* p) { return *static_cast<at::Tensor*>(p); }
}  // namespace

extern "C" {

char* og_fused_linear_ce(void* hidden, void* weight, void* targets, int64_t vp, int64_t chunk, void** out) {
  return oomguard::guarded([&] {
    const Tensor &h = t(hidden), &w = t(weight), &y = t(targets);
    TORCH_CHECK(h.dim() == 2 && w.dim() == 2 && y.dim() == 1 && h.size(0) == y.size(0) && h.size(1) == w.size(1),
                "fused linear cross-entropy: hidden [N, C], weight [V, C], targets [N]; got ", h.sizes(), ", ", w.sizes(), ", ", y.sizes());
    TORCH_CHECK(vp >= w.size(0) && chunk >= 1, "fused linear cross-entropy: padded vocabulary ", vp, ", chunk ", chunk);
    const bool grads = torch::autograd::GradMode::is_enabled() && (h.requires_grad() || w.requires_grad());
    Tensor loss = grads ? FusedLinearCrossEntropy::apply(h, w, y, vp, chunk) : compute(h, w, y, vp, chunk, false).loss;
    *out = new Tensor(loss);
  });
}

}  // extern "C"
