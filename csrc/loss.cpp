// The GPT's LM head and cross-entropy fused (Liger Kernel's FusedLinearCrossEntropy): the
// tokens go through in chunks of rows, so no more than one chunk of logits is ever alive
// (never the whole B x T x vocab, nor its log-softmax and gradient). Each chunk's gradients
// of the hidden states and of the head's weight are formed in the forward, while its logits
// are at hand; backward only scales them by the upstream gradient: the same FLOPs as the
// plain path, nothing recomputed. Under autocast the chunk's matmuls run in the autocast
// dtype (bf16 or fp16 logits, as eager's linear does), softmax and the loss in fp32, and the
// weight's gradient accumulates over the chunks in fp32. An OOM inside a chunk is an
// ordinary exception, returned as a message like every other.
//
// A tied embedding's lookup can go through `TiedEmbedding` with the same `Tie`: its backward
// then adds its rows into the head's gradient in place (index_add_), while that gradient
// waits in autograd's buffer for the weight, instead of making a dense [V, C] gradient of
// its own for autograd to sum into a third. Backward holds one embedding-sized gradient,
// not three (two on CUDA, below). Keeps: only within one graph (one backward pass), where the engine runs the
// weight's accumulation after both uses; anything else takes the dense path.
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

// What the head's backward hands the lookup's: the weight's gradient it returned, until the
// lookup's backward has added into it (or the graph is freed).
struct Tie : torch::CustomClassHolder {
  Tensor grad_w;
};
using TiePtr = c10::intrusive_ptr<Tie>;

c10::IValue capsule(const TiePtr& tie) {
  return tie ? c10::IValue::make_capsule(tie) : c10::IValue();
}

TiePtr tie_of(AutogradContext* ctx) {
  auto it = ctx->saved_data.find("tie");
  if (it == ctx->saved_data.end() || !it->second.isCapsule()) return TiePtr();
  return c10::static_intrusive_pointer_cast<Tie>(it->second.toCapsule());
}

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
  static Tensor forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight, const Tensor& targets, int64_t vp, int64_t chunk,
                        TiePtr tie) {
    Result r = compute(hidden, weight, targets, vp, chunk, true);
    ctx->saved_data["grad_h"] = r.grad_h;
    ctx->saved_data["grad_w"] = r.grad_w.to(weight.scalar_type());
    ctx->saved_data["tie"] = capsule(tie);
    return r.loss;
  }

  // Only scales what the forward formed (in place: nothing allocated), and lets it go.
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const Tensor& g = grad_out[0];
    Tensor gh = ctx->saved_data["grad_h"].toTensor();
    Tensor gw = ctx->saved_data["grad_w"].toTensor();
    TiePtr tie = tie_of(ctx);
    ctx->saved_data.clear();
    gh.mul_(g);
    gw.mul_(g);
    if (tie && !torch::autograd::GradMode::is_enabled()) tie->grad_w = gw;
    return {gh, gw, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// The lookup `weight[idx]`; its backward adds into the tied head's gradient when the head's
// backward left one (above), else returns the dense gradient as embedding's does.
struct TiedEmbedding : torch::autograd::Function<TiedEmbedding> {
  static Tensor forward(AutogradContext* ctx, const Tensor& weight, const Tensor& idx, TiePtr tie) {
    ctx->saved_data["idx"] = idx;
    ctx->saved_data["rows"] = weight.size(0);
    ctx->saved_data["tie"] = capsule(tie);
    return at::embedding(weight, idx);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const Tensor idx = ctx->saved_data["idx"].toTensor();
    const int64_t rows = ctx->saved_data["rows"].toInt();
    TiePtr tie = tie_of(ctx);
    ctx->saved_data.clear();
    const Tensor& g = grad_out[0];
    Tensor into = tie ? std::move(tie->grad_w) : Tensor();  // the tie lets go of it
    const int64_t c = g.size(-1);
    if (into.defined() && !torch::autograd::GradMode::is_enabled() && into.dim() == 2 && into.size(0) == rows &&
        into.size(1) == c && into.device() == g.device()) {
      // Still in the engine's buffer for the weight: it becomes the weight's gradient after
      // this node (the only other use), with these rows added. On the CPU row by row (in
      // index order: deterministic); on CUDA, where index_add_ is not, through the dense
      // gradient, added in place: two buffers, not three.
      if (g.is_cpu())
        into.index_add_(0, idx.reshape({-1}), g.reshape({-1, c}).to(into.scalar_type()));
      else
        into.add_(at::embedding_backward(g, idx, rows, -1, false, false));
      return {Tensor(), Tensor(), Tensor()};
    }
    return {at::embedding_backward(g, idx, rows, -1, false, false), Tensor(), Tensor()};
  }
};

at::Tensor& t(void* p) { return *static_cast<at::Tensor*>(p); }
}  // namespace

extern "C" {

char* og_tie_new(void** out) {
  return oomguard::guarded([&] { *out = new TiePtr(c10::make_intrusive<Tie>()); });
}

void og_tie_free(void* tie) {
  delete static_cast<TiePtr*>(tie);
}

char* og_tied_embedding(void* weight, void* idx, void* tie, void** out) {
  return oomguard::guarded([&] {
    const Tensor &w = t(weight), &i = t(idx);
    TORCH_CHECK(w.dim() == 2, "tied embedding: weight [V, C]; got ", w.sizes());
    const TiePtr ti = tie ? *static_cast<TiePtr*>(tie) : TiePtr();
    const bool grads = torch::autograd::GradMode::is_enabled() && w.requires_grad();
    *out = new Tensor(grads ? TiedEmbedding::apply(w, i, ti) : at::embedding(w, i));
  });
}

char* og_fused_linear_ce(void* hidden, void* weight, void* targets, int64_t vp, int64_t chunk, void* tie, void** out) {
  return oomguard::guarded([&] {
    const Tensor &h = t(hidden), &w = t(weight), &y = t(targets);
    TORCH_CHECK(h.dim() == 2 && w.dim() == 2 && y.dim() == 1 && h.size(0) == y.size(0) && h.size(1) == w.size(1),
                "fused linear cross-entropy: hidden [N, C], weight [V, C], targets [N]; got ", h.sizes(), ", ", w.sizes(), ", ", y.sizes());
    TORCH_CHECK(vp >= w.size(0) && chunk >= 1, "fused linear cross-entropy: padded vocabulary ", vp, ", chunk ", chunk);
    const bool grads = torch::autograd::GradMode::is_enabled() && (h.requires_grad() || w.requires_grad());
    const TiePtr ti = tie ? *static_cast<TiePtr*>(tie) : TiePtr();
    Tensor loss = grads ? FusedLinearCrossEntropy::apply(h, w, y, vp, chunk, ti) : compute(h, w, y, vp, chunk, false).loss;
    *out = new Tensor(loss);
  });
}

}  // extern "C"
