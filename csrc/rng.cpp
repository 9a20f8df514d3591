// Random-generator state for exact resume: libtorch's default CPU and CUDA generators
// (dropout), read and restored as byte tensors.
#include "oomguard.h"

#include <ATen/Context.h>
#include <torch/torch.h>

#include <mutex>

namespace {
c10::Device device_of(int cuda_index) {
  return cuda_index < 0 ? c10::Device(c10::DeviceType::CPU)
                        : c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(cuda_index));
}
}  // namespace

extern "C" {

char* og_rng_get_state(int cuda_index, void** out) {
  return oomguard::guarded([&] {
    auto gen = at::globalContext().defaultGenerator(device_of(cuda_index));
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = new at::Tensor(gen.get_state());
  });
}

char* og_rng_set_state(int cuda_index, void* state) {
  return oomguard::guarded([&] {
    auto gen = at::globalContext().defaultGenerator(device_of(cuda_index));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*static_cast<at::Tensor*>(state));
  });
}

}  // extern "C"
