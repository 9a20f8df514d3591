// The CUDA memory history (issue 24), compiled only against a libtorch with CUDA
// (build.rs): libtorch's own recorder (torch::cuda::_record_memory_history) and snapshot in
// PyTorch's pickle format, taken by an OOM observer inside the caching allocator, before
// unwinding frees the failed attempt's blocks. Ran on an H200 (docs/gpu-outcome.md).
#include "oomguard.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>

#include <mutex>
#include <string>

namespace {
std::mutex g_mu;
std::string g_pickled;       // the snapshot taken at the last OOM
int64_t g_info[4] = {0};     // device, allocated, device total, device free
bool g_have = false;
}  // namespace

extern "C" {

char* og_cuda_snap_start(int64_t max_events) {
  return oomguard::guarded([&] {
    // Allocation events with their C++ context off: stacks cost a backtrace per allocation.
    torch::cuda::_record_memory_history("all", "state", "python", static_cast<size_t>(max_events));
    static std::once_flag once;
    std::call_once(once, [] {
      c10::cuda::CUDACachingAllocator::attachOutOfMemoryObserver(
          [](int64_t device, size_t allocated, size_t total, size_t free) {
            std::string s;
            try {
              s = torch::cuda::_memory_snapshot_pickled();
            } catch (...) {
              return;  // the OOM itself is what the caller must see
            }
            std::lock_guard<std::mutex> g(g_mu);
            g_pickled.swap(s);
            g_info[0] = device;
            g_info[1] = static_cast<int64_t>(allocated);
            g_info[2] = static_cast<int64_t>(total);
            g_info[3] = static_cast<int64_t>(free);
            g_have = true;
          });
    });
  });
}

// last_oom: the snapshot the observer took (returns "no snapshot" when none since the
// last take), else one now. *out is malloc'd (og_free); info: device, allocated, total, free.
char* og_cuda_snap_take(int last_oom, char** out, int64_t* len, int64_t* info) {
  return oomguard::guarded([&] {
    std::string s;
    if (last_oom) {
      std::lock_guard<std::mutex> g(g_mu);
      if (!g_have) throw std::runtime_error("no CUDA snapshot was taken at the last OOM");
      s.swap(g_pickled);
      for (int i = 0; i < 4; ++i) info[i] = g_info[i];
      g_have = false;
    } else {
      s = torch::cuda::_memory_snapshot_pickled();
      for (int i = 0; i < 4; ++i) info[i] = -1;
    }
    *out = static_cast<char*>(std::malloc(std::max<size_t>(s.size(), 1)));
    if (!*out) throw std::bad_alloc();
    std::memcpy(*out, s.data(), s.size());
    *len = static_cast<int64_t>(s.size());
  });
}

}  // extern "C"
