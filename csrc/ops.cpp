// Tensor operations that take a scalar, fallible without a panic. tch's generated fallible
// ops (f_mul_scalar, f_add_scalar, f_arange, ...) free their Scalar temporary through a call
// that unwraps libtorch's pending error, so when the operation itself fails (an OOM) that
// unwrap panics before the error is returned. Here the error comes back as a message.
#include "oomguard.h"

#include <dlfcn.h>
#include <torch/torch.h>

#include <atomic>
#include <cstring>

namespace {
at::Tensor& t(void* p) { return *static_cast<at::Tensor*>(p); }

// CUDA's sync-debug mode counted: c10 warns "called a synchronizing CUDA operation" on each
// synchronizing call; this handler counts those and passes every warning on. c10's handler
// is per thread: this counts the training thread's; autograd's device threads warn through
// the default handler to stderr (scripts/gpu_check.py counts those lines too).
std::atomic<int64_t> cuda_syncs{-1};
struct SyncCounter : c10::WarningHandler {
  c10::WarningHandler* next = nullptr;
  void process(const c10::Warning& w) override {
    if (std::strstr(w.msg().c_str(), "synchronizing CUDA operation")) cuda_syncs.fetch_add(1);
    if (next) next->process(w);
  }
};
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

// Page-locked host memory for a copy to the current accelerator (torch >= 2.11 deprecates
// naming the device: tch's f_pin_memory warns once per call).
char* og_pin_memory(void* tensor, void** out) {
  return oomguard::guarded([&] { *out = new at::Tensor(t(tensor).pin_memory()); });
}

char* og_arange_like(int64_t end, void* like, void** out) {
  return oomguard::guarded([&] { *out = new at::Tensor(at::arange(end, t(like).options().dtype(at::kLong))); });
}

// Sync-debug mode on (c10::cuda::warning_state().set_sync_debug_mode(L_WARN)) and its
// warnings counted. The state lives in libc10_cuda, found at run time so that this compiles
// and links without CUDA (the symbol is the function-local static behind warning_state(),
// one int-sized enum: SyncDebugMode::L_WARN is 1). Returns 0 where there is no CUDA library.
int og_cuda_sync_debug() {
  void* state = dlsym(RTLD_DEFAULT, "_ZZN3c104cuda13warning_stateEvE14warning_state_");
  if (!state) return 0;
  static SyncCounter counter;
  if (cuda_syncs.load() < 0) {
    counter.next = c10::WarningUtils::get_warning_handler();
    c10::WarningUtils::set_warning_handler(&counter);
    cuda_syncs.store(0);
  }
  *static_cast<int*>(state) = 1;
  return 1;
}

// Synchronizing calls counted since og_cuda_sync_debug, or -1 if it is off.
int64_t og_cuda_syncs() { return cuda_syncs.load(); }

}  // extern "C"
