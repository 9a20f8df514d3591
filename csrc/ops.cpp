// Tensor operations that take a scalar, fallible without a panic. tch's generated fallible
// ops (f_mul_scalar, f_add_scalar, f_arange, ...) free their Scalar temporary through a call
// that unwraps libtorch's pending error, so when the operation itself fails (an OOM) that
// unwrap panics before the error is returned. Here the error comes back as a message.
#include "oomguard.h"

#include <torch/torch.h>

namespace {
at::Tensor& t(void* p) { return *static_cast<at::Tensor*>(p); }
}  // namespace

extern "C" {

char* og_mul_scalar(void* tensor, double v, void** out) {
  return oomguard::guarded([&] { *out = new at::Tensor(t(tensor).mul(v)); });
}

char* og_add_scalar(void* tensor, double v, void** out) {
  return oomguard::guarded([&] { *out = new at::Tensor(t(tensor).add(v)); });
}

char* og_mul_scalar_(void* tensor, double v) {
  return oomguard::guarded([&] { t(tensor).mul_(v); });
}

char* og_arange_like(int64_t end, void* like, void** out) {
  return oomguard::guarded([&] { *out = new at::Tensor(at::arange(end, t(like).options().dtype(at::kLong))); });
}

}  // extern "C"
