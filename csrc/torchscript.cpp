// TorchScript modules for training: loaded onto a device, their parameters and buffers under
// PyTorch's own names (tch's TrainableCModule renames `a.b.weight` to `a_b_weight` and drops
// buffers), train/eval mode, and a fallible call of the method that returns the loss.
#include "oomguard.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace {
torch::jit::Module* module(void* m) { return static_cast<torch::jit::Module*>(m); }
}  // namespace

extern "C" {

char* og_ts_load(const char* path, int cuda_index, void** out) {
  return oomguard::guarded([&] {
    const c10::Device device = cuda_index < 0
                                   ? c10::Device(c10::DeviceType::CPU)
                                   : c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(cuda_index));
    *out = new torch::jit::Module(torch::jit::load(std::string(path), device));
  });
}

void og_ts_free(void* m) { delete module(m); }

// Parameters (what = 0), buffers (1) or method names (2, tensor NULL), one callback each;
// tensors are new at::Tensor* the callee owns.
char* og_ts_list(void* m, int what, void* ctx, og_named_cb cb) {
  return oomguard::guarded([&] {
    if (what == 0) {
      for (const auto& p : module(m)->named_parameters(/*recurse=*/true)) cb(ctx, p.name.c_str(), new at::Tensor(p.value));
    } else if (what == 1) {
      for (const auto& b : module(m)->named_buffers(/*recurse=*/true)) cb(ctx, b.name.c_str(), new at::Tensor(b.value));
    } else {
      for (const auto& method : module(m)->get_methods()) cb(ctx, method.name().c_str(), nullptr);
    }
  });
}

int og_ts_has_method(void* m, const char* name) { return module(m)->find_method(name).has_value() ? 1 : 0; }

char* og_ts_train(void* m, int on) {
  return oomguard::guarded([&] { module(m)->train(on != 0); });
}

// method(inputs, targets), which must return a tensor (the mean loss).
char* og_ts_call(void* m, const char* method, void* inputs, void* targets, void** out) {
  return oomguard::guarded([&] {
    std::vector<c10::IValue> args{*static_cast<at::Tensor*>(inputs), *static_cast<at::Tensor*>(targets)};
    c10::IValue result = module(m)->get_method(method)(std::move(args));
    if (!result.isTensor()) {
      throw std::runtime_error(std::string(method) + "(inputs, targets) returned " + result.tagKind() +
                               "; it must return the mean loss as a tensor");
    }
    *out = new at::Tensor(result.toTensor());
  });
}

}  // extern "C"
