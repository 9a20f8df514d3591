// The memory layer: a counting CPU allocator with a budget, and CUDA cache/stats through
// c10's device-allocator interface (so no CUDA headers are needed to build).
#include "oomguard.h"
#include "snapshot.h"

#include <c10/core/AllocatorConfig.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

namespace {

using oomguard::guarded;

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_budget{-1};
// The process's footprint limit (RssAnon, bytes; -1: none): under a memory cgroup the
// kernel counts the heap the allocator keeps, not only live tensors. Allocations of
// kFootprintCheck and more read RssAnon first (/proc/self/statm: a few microseconds).
std::atomic<int64_t> g_footprint_limit{-1};
constexpr size_t kFootprintCheck = 1 << 20;
std::atomic<int64_t> g_ooms{0};

// RssAnon in bytes (statm's resident minus shared pages), or -1. No heap allocation.
int64_t rss_anon() {
  const int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[160];
  const ssize_t k = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (k <= 0) return -1;
  buf[k] = 0;
  long long size = 0, resident = 0, shared = 0;
  if (std::sscanf(buf, "%lld %lld %lld", &size, &resident, &shared) != 3) return -1;
  return static_cast<int64_t>(resident - shared) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}
// Every allocation asked of the counting allocator, numbered from 0 (the fault injector's
// clock), and the allocations the injector fails: sorted, written only while armed from a
// quiet point between steps, read concurrently.
std::atomic<uint64_t> g_allocs{0};
std::vector<uint64_t> g_inject_at;
std::atomic<int64_t> g_injected{0};

// The size lives in a header before the data. The header keeps the base allocator's
// 64-byte alignment, and data doubles as the DataPtr's context: oneDNN's raw_allocate
// requires data == context.
constexpr size_t kHeader = 64;

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    const int64_t want = static_cast<int64_t>(n);
    const uint64_t index = g_allocs.fetch_add(1);
    int64_t live = g_live.load();
    if (!g_inject_at.empty() && std::binary_search(g_inject_at.begin(), g_inject_at.end(), index)) {
      g_injected.fetch_add(1);
      g_ooms.fetch_add(1);
      const int64_t budget = g_budget.load();
      if (oomguard::snap::g_on.load(std::memory_order_relaxed)) oomguard::snap::on_oom(n, live, budget);
      // The same error, and the same message shape, as a real budget overrun.
      if (budget >= 0) {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "oomguard memory budget exceeded: tried to allocate ", n,
                         " bytes with ", live, " bytes in use of a budget of ", budget, " bytes (",
                         budget - live, " bytes free); injected by --inject-oom");
      }
      TORCH_CHECK_WITH(OutOfMemoryError, false, "oomguard memory budget exceeded: tried to allocate ", n,
                       " bytes with ", live, " bytes in use; injected by --inject-oom");
    }
    const int64_t footprint = g_footprint_limit.load(std::memory_order_relaxed);
    if (footprint >= 0 && n >= kFootprintCheck) {
      const int64_t rss = rss_anon();
      if (rss >= 0 && rss + want > footprint) {
        g_ooms.fetch_add(1);
        if (oomguard::snap::g_on.load(std::memory_order_relaxed)) oomguard::snap::on_oom(n, live, footprint);
        TORCH_CHECK_WITH(OutOfMemoryError, false,
                         "oomguard memory budget exceeded (host footprint): tried to allocate ", n, " bytes with ",
                         rss, " bytes resident (RssAnon) of a limit of ", footprint,
                         " bytes under the memory cgroup; live tensors are ", live,
                         " bytes of it, the rest is heap the allocator kept");
      }
    }
    for (;;) {
      const int64_t budget = g_budget.load();
      if (budget >= 0 && live + want > budget) {
        g_ooms.fetch_add(1);
        // The history's copy, before unwinding frees the failed attempt's tensors.
        if (oomguard::snap::g_on.load(std::memory_order_relaxed)) oomguard::snap::on_oom(n, live, budget);
        TORCH_CHECK_WITH(OutOfMemoryError, false,
                         "oomguard memory budget exceeded: tried to allocate ", n,
                         " bytes with ", live, " bytes in use of a budget of ", budget,
                         " bytes (", budget - live, " bytes free)");
      }
      if (g_live.compare_exchange_weak(live, live + want)) break;
    }
    int64_t peak = g_peak.load();
    while (live + want > peak && !g_peak.compare_exchange_weak(peak, live + want)) {
    }
    void* base = nullptr;
    try {
      base = base_->raw_allocate(n + kHeader);
    } catch (...) {
      g_live.fetch_sub(want);  // the bytes were never handed out
      throw;
    }
    *static_cast<size_t*>(base) = n;
    void* data = static_cast<char*>(base) + kHeader;
    if (oomguard::snap::g_on.load(std::memory_order_relaxed)) oomguard::snap::on_alloc(data, n);
    return {data, data, &CountingAllocator::free, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::free; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  static void free(void* data) {
    if (!data) return;
    void* base = static_cast<char*>(data) - kHeader;
    if (oomguard::snap::g_on.load(std::memory_order_relaxed)) oomguard::snap::on_free(data);
    g_live.fetch_sub(static_cast<int64_t>(*static_cast<size_t*>(base)));
    instance_base()->raw_deallocate(base);
  }
  static c10::Allocator*& instance_base() {
    static c10::Allocator* base = nullptr;
    return base;
  }
  c10::Allocator* base_;
  friend void install_counting();
};

void install_counting() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::Allocator* base = c10::GetCPUAllocator();
    CountingAllocator::instance_base() = base;
    static CountingAllocator counting(base);
    c10::SetCPUAllocator(&counting, /*priority=*/100);
  });
}

c10::DeviceAllocator* cuda_allocator() {
  return c10::getDeviceAllocator(c10::DeviceType::CUDA);
}

}  // namespace

extern "C" {

void og_free(char* msg) {
  if (msg != oomguard::no_message()) std::free(msg);
}

void og_cpu_install() { install_counting(); }
void og_cpu_set_budget(int64_t bytes) { g_budget.store(bytes); }
void og_cpu_set_footprint_limit(int64_t bytes) { g_footprint_limit.store(bytes); }
int64_t og_cpu_budget() { return g_budget.load(); }
int64_t og_cpu_live_bytes() { return g_live.load(); }
int64_t og_cpu_peak_bytes() { return g_peak.load(); }
void og_cpu_reset_peak() { g_peak.store(g_live.load()); }
int64_t og_cpu_num_ooms() { return g_ooms.load(); }
uint64_t og_cpu_alloc_count() { return g_allocs.load(); }

void og_inject_arm(const uint64_t* at, int n) {
  std::vector<uint64_t> v(at, at + (n > 0 ? n : 0));
  std::sort(v.begin(), v.end());
  g_inject_at.swap(v);
}
int64_t og_inject_fired() { return g_injected.load(); }

void og_clear_grad(void* tensor) {
  static_cast<torch::Tensor*>(tensor)->mutable_grad().reset();
}

// The parameter's gradient becomes `grad` (a view of a bucket): its old one is let go.
void og_set_grad(void* tensor, void* grad) {
  static_cast<torch::Tensor*>(tensor)->mutable_grad() = *static_cast<torch::Tensor*>(grad);
}

// The storages that only the gradients of `params` hold, each whole as one flat tensor,
// largest first (*count of them, at most n, into out): scratch once those gradients are
// spent (ZeRO-1's all-gather after its update). Only where nothing else holds the storage,
// a gradient or the bucket a gradient is a view of (a live bucket, a user's reference, a
// saved tensor): nothing but spent gradients is ever overwritten. Allocates no tensor
// memory.
char* og_grads_scratch(void** params, int n, void** out, int* count) {
  return guarded([&] {
    *count = 0;
    if (n <= 0) return;
    const auto& like = *static_cast<torch::Tensor*>(params[0]);
    // Per storage: the tensors that hold it (gradients, and the bases they are views of),
    // each with the references it may have (1 for a gradient: its parameter's slot).
    struct Holder {
      const c10::TensorImpl* impl;
      int64_t refs;
      size_t expected;
    };
    struct Held {
      c10::Storage storage;
      std::vector<Holder> holders;
      void add(const at::TensorBase& t, size_t expected) {
        for (auto& h : holders) {
          if (h.impl == t.unsafeGetTensorImpl()) {
            h.expected += expected;
            return;
          }
        }
        holders.push_back({t.unsafeGetTensorImpl(), static_cast<int64_t>(t.use_count()), expected});
      }
    };
    std::vector<Held> held;
    for (int i = 0; i < n; ++i) {
      const auto& g = static_cast<torch::Tensor*>(params[i])->grad();
      if (!g.defined() || !g.has_storage() || g.scalar_type() != like.scalar_type() || g.device() != like.device()) {
        continue;
      }
      auto it = std::find_if(held.begin(), held.end(), [&](const Held& h) { return h.storage.is_alias_of(g.storage()); });
      if (it == held.end()) it = held.insert(held.end(), Held{g.storage(), {}});
      it->add(g, 1);
      if (g.is_view()) it->add(g._base(), 1);
    }
    std::vector<const c10::Storage*> only;
    for (const auto& h : held) {
      bool alone = h.storage.use_count() == h.holders.size() + 1;  // + `held`'s own copy
      for (const auto& x : h.holders) alone = alone && x.refs == static_cast<int64_t>(x.expected);
      if (alone && h.storage.nbytes() >= static_cast<size_t>(like.element_size())) only.push_back(&h.storage);
    }
    std::stable_sort(only.begin(), only.end(), [](auto a, auto b) { return a->nbytes() > b->nbytes(); });
    torch::NoGradGuard no_grad;
    for (const auto* st : only) {
      const auto numel = static_cast<int64_t>(st->nbytes() / like.element_size());
      auto flat = at::empty({0}, like.options().requires_grad(false));
      flat.set_(*st, 0, {numel}, {1});
      out[(*count)++] = new torch::Tensor(flat);
    }
  });
}

int og_cuda_available() { return torch::cuda::is_available() ? 1 : 0; }

// Data parallel on CUDA: the rank's own GPU becomes the current device before any CUDA
// work, so no rank makes a context on GPU 0 (through the device-generic guard: no CUDA
// headers needed here).
char* og_cuda_set_device(int device) {
  return guarded([&] {
    c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  });
}

char* og_cuda_empty_cache() {
  return guarded([] { cuda_allocator()->emptyCache(); });
}

char* og_cuda_stats(int device, int64_t* out) {
  return guarded([&] {
    auto* a = cuda_allocator();
    const auto idx = static_cast<c10::DeviceIndex>(device);
    const auto s = a->getDeviceStats(idx);
    constexpr size_t agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    const auto [free, total] = a->getMemoryInfo(idx);
    out[0] = s.allocated_bytes[agg].current;
    out[1] = s.reserved_bytes[agg].current;
    out[2] = s.allocated_bytes[agg].peak;
    out[3] = s.num_alloc_retries;
    out[4] = s.num_ooms;
    out[5] = static_cast<int64_t>(free);
    out[6] = static_cast<int64_t>(total);
  });
}

// The device's free and total bytes (cudaMemGetInfo), usable before the allocator's first
// allocation: the allocator settings that depend on the total are applied after it.
char* og_cuda_mem_info(int device, int64_t* out) {
  return guarded([&] {
    const auto [free, total] = cuda_allocator()->getMemoryInfo(static_cast<c10::DeviceIndex>(device));
    out[0] = static_cast<int64_t>(free);
    out[1] = static_cast<int64_t>(total);
  });
}

char* og_cuda_reset_peak(int device) {
  return guarded([&] { cuda_allocator()->resetPeakStats(static_cast<c10::DeviceIndex>(device)); });
}

char* og_cuda_synchronize(int device) {
  return guarded([&] { torch::cuda::synchronize(device); });
}

char* og_set_allocator_settings(const char* settings) {
  return guarded([&] { c10::CachingAllocator::setAllocatorSettings(settings); });
}

}  // extern "C"
