// Mixed precision from the project's C++: autocast for the CPU and CUDA alike (tch's own
// autocast covers CUDA only), and GradScaler's two kernels for fp16 loss scaling.
#include "oomguard.h"

#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/torch.h>

#include <vector>

namespace {
c10::DeviceType device_type(int cuda) { return cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU; }
}  // namespace

extern "C" {

// bf16 runs natively (compute capability 8.0 and up), as torch.cuda.is_bf16_supported says.
int og_cuda_bf16_native() {
  try {
    return at::detail::getCUDAHooks().supportsBFloat16ConvolutionWithCuDNNv8() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

// Turns autocast on for the device with `half` (0 bf16, 1 fp16); `was` receives the previous
// state (enabled, dtype) for og_autocast_exit. Autocast is thread-local.
char* og_autocast_enter(int cuda, int half, int* was_enabled, int* was_dtype) {
  return oomguard::guarded([&] {
    const auto dev = device_type(cuda);
    *was_enabled = at::autocast::is_autocast_enabled(dev) ? 1 : 0;
    *was_dtype = static_cast<int>(at::autocast::get_autocast_dtype(dev));
    at::autocast::set_autocast_dtype(dev, half == 1 ? at::kHalf : at::kBFloat16);
    at::autocast::set_autocast_enabled(dev, true);
    at::autocast::increment_nesting();
  });
}

char* og_autocast_exit(int cuda, int was_enabled, int was_dtype) {
  return oomguard::guarded([&] {
    const auto dev = device_type(cuda);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();  // cached casts of weights
    at::autocast::set_autocast_enabled(dev, was_enabled != 0);
    at::autocast::set_autocast_dtype(dev, static_cast<at::ScalarType>(was_dtype));
  });
}

// grads *= inv_scale in place; found_inf = 1 if any is inf or nan.
char* og_amp_unscale(void** grads, int n, void* found_inf, void* inv_scale) {
  return oomguard::guarded([&] {
    std::vector<at::Tensor> g;
    for (int i = 0; i < n; ++i) g.push_back(*static_cast<at::Tensor*>(grads[i]));
    auto& fi = *static_cast<at::Tensor*>(found_inf);
    at::_amp_foreach_non_finite_check_and_unscale_(g, fi, *static_cast<at::Tensor*>(inv_scale));
  });
}

// GradScaler's update: back off on inf, grow after `interval` clean steps.
char* og_amp_update_scale(void* scale, void* growth_tracker, void* found_inf, double growth, double backoff, int64_t interval) {
  return oomguard::guarded([&] {
    at::_amp_update_scale_(*static_cast<at::Tensor*>(scale), *static_cast<at::Tensor*>(growth_tracker),
                           *static_cast<at::Tensor*>(found_inf), growth, backoff, interval);
  });
}

}  // extern "C"
