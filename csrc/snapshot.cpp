// The CPU memory history (issue 24): the counting allocator's alloc/free/oom events in a
// bounded ring, the live allocations with the context each was made in (the op from a
// RecordFunction callback; step, phase, micro-batch and module from the runtime), and a copy
// of both taken at the moment an allocation fails, before unwinding frees anything.
#include "snapshot.h"

#include "oomguard.h"

#include <ATen/record_function.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <chrono>
#include <deque>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace oomguard::snap {

std::atomic<bool> g_on{false};

namespace {

std::mutex g_mu;  // guards everything below but the context atomics
std::vector<og_snap_rec> g_ring;
size_t g_head = 0;       // next slot
uint64_t g_written = 0;  // events ever recorded
std::atomic<uint64_t> g_seq{0};  // allocations ever recorded
std::unordered_map<uint64_t, og_snap_rec> g_live;
// The copy taken at the last failure (live allocations, then the ring in order).
struct Capture {
  og_snap_info info{};
  std::vector<og_snap_rec> live, events;
};
Capture g_oom;
bool g_have_oom = false;
std::string g_oom_python;  // the Python frames at the last failure ("" without Python)
at::CallbackHandle g_callback = 0;

// Names (ops and modules), interned: id 0 is "". Both maps are keyed by views into g_names,
// so a lookup allocates nothing.
std::mutex g_names_mu;
std::deque<std::string> g_names{""};  // a deque: references stay valid as it grows
std::unordered_map<std::string_view, int32_t> g_ids{{g_names.front(), 0}};

std::atomic<int64_t> g_step{-1};
std::atomic<int32_t> g_phase{0}, g_micro_batch{-1}, g_module{0};
std::atomic<uint64_t> g_attempt_seq{0};
uint64_t g_attempt_event = 0;  // under g_mu

// The thread's op stack (innermost last) and the allocation sequence at which its outermost
// op started: what was allocated since is the failing op's temporaries.
thread_local std::vector<int32_t> t_ops;
thread_local uint64_t t_top_seq = 0;

int64_t now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(steady_clock::now().time_since_epoch()).count();
}

// Called for every op. Names come from a bounded set (about a hundred in a GPT's step), but
// many arrive as fresh heap strings (a backward node's name is built per call): a cache keyed
// by pointer gained a node per new address, and those small long-lived nodes, scattered
// between a step's large buffers, fragmented the heap until RSS grew ~40 MB a step. Keyed by
// content through views, a lookup allocates nothing and the maps stop growing.
int32_t intern(const char* name) {
  const std::string_view key(name);
  thread_local std::unordered_map<std::string_view, int32_t> cache;  // views into g_names
  auto c = cache.find(key);
  if (c != cache.end()) return c->second;
  std::lock_guard<std::mutex> g(g_names_mu);
  auto it = g_ids.find(key);
  int32_t id;
  if (it != g_ids.end()) {
    id = it->second;
  } else {
    id = static_cast<int32_t>(g_names.size());
    g_names.emplace_back(key);
    g_ids.emplace(g_names.back(), id);
  }
  cache.emplace(g_names[id], id);
  return id;
}

std::unique_ptr<at::ObserverContext> op_start(const at::RecordFunction& fn) {
  if (t_ops.empty()) t_top_seq = g_seq.load(std::memory_order_relaxed);
  t_ops.push_back(intern(fn.name()));
  return nullptr;
}

void op_end(const at::RecordFunction&, at::ObserverContext*) {
  if (!t_ops.empty()) t_ops.pop_back();
}

og_snap_rec context(int32_t action, uint64_t addr, int64_t size) {
  og_snap_rec r{};
  r.action = action;
  r.addr = addr;
  r.size = size;
  r.time_us = now_us();
  r.op = t_ops.empty() ? 0 : t_ops.back();
  r.top_op = t_ops.empty() ? 0 : t_ops.front();
  r.module = g_module.load(std::memory_order_relaxed);
  r.step = g_step.load(std::memory_order_relaxed);
  r.phase = g_phase.load(std::memory_order_relaxed);
  r.micro_batch = g_micro_batch.load(std::memory_order_relaxed);
  return r;
}

// Under g_mu.
void push(const og_snap_rec& r) {
  if (g_ring.empty()) return;
  g_ring[g_head] = r;
  g_head = (g_head + 1) % g_ring.size();
  ++g_written;
}

// Under g_mu: live allocations and the ring, oldest event first.
void copy_now(Capture& c) {
  c.live.clear();
  c.live.reserve(g_live.size());
  for (const auto& kv : g_live) c.live.push_back(kv.second);
  const size_t n = std::min<uint64_t>(g_written, g_ring.size());
  c.events.clear();
  c.events.reserve(n);
  const size_t start = (g_head + g_ring.size() - n) % std::max<size_t>(g_ring.size(), 1);
  for (size_t i = 0; i < n; ++i) c.events.push_back(g_ring[(start + i) % g_ring.size()]);
  c.info.events_written = g_written;
  c.info.attempt_seq = g_attempt_seq.load();
  c.info.attempt_event = g_attempt_event;
  c.info.seq = g_seq.load();
}

og_snap_rec* dup(const std::vector<og_snap_rec>& v) {
  auto* out = static_cast<og_snap_rec*>(std::malloc(std::max<size_t>(v.size(), 1) * sizeof(og_snap_rec)));
  if (out && !v.empty()) std::memcpy(out, v.data(), v.size() * sizeof(og_snap_rec));
  return out;
}

}  // namespace

void on_alloc(void* p, size_t n) noexcept {
  og_snap_rec r = context(OG_SNAP_ALLOC, reinterpret_cast<uint64_t>(p), static_cast<int64_t>(n));
  try {
    std::lock_guard<std::mutex> g(g_mu);
    r.seq = g_seq.fetch_add(1);
    g_live[r.addr] = r;
    push(r);
  } catch (...) {
    // No memory for the record: the allocation goes unrecorded (its free is then ignored),
    // rather than failing after its bytes were handed out.
  }
}

void on_free(void* p) {
  const auto addr = reinterpret_cast<uint64_t>(p);
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_live.find(addr);
  if (it == g_live.end()) return;  // made before recording began
  og_snap_rec r = it->second;  // the allocation's own context, so a free can be undone
  r.action = OG_SNAP_FREE;
  r.time_us = now_us();
  g_live.erase(it);
  push(r);
}

namespace {
// A Python model's frames when an allocation fails, innermost first ("file:line in name"),
// through the unwinder torch's Python module registers (none without Python: ""). Taken
// before g_mu: gathering takes the GIL. nn.Module's call plumbing and oomguard's glue are
// left out; site-packages paths are cut to the package.
std::string python_stack() {
  try {
    auto tb = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
    if (!tb) return "";
    auto st = torch::symbolize({tb.get()});
    if (st.tracebacks.empty()) return "";
    std::string out;
    int kept = 0;
    for (auto i : st.tracebacks[0]) {
      const auto& f = st.all_frames.at(i);
      std::string file = f.filename;
      if (file.find("torch/nn/modules/module.py") != std::string::npos || file.find("oomguard_glue") != std::string::npos ||
          file.rfind("<frozen", 0) == 0)
        continue;
      auto site = file.find("site-packages/");
      if (site != std::string::npos) file = file.substr(site + 14);
      if (!out.empty()) out += "\n";
      out += file + ":" + std::to_string(f.lineno) + " in " + f.funcname;
      if (++kept == 8) break;
    }
    return out;
  } catch (...) {
    return "";
  }
}
}  // namespace

// At a failed allocation, before its OOM error is thrown: nothing here may throw in its
// place. Whatever fails (an allocation for the copy, the Python frames) drops the copy: a
// dump then shows the history after unwinding, and the OOM is reported as it is.
void on_oom(size_t n, int64_t live, int64_t budget) noexcept {
  try {
    std::string python = python_stack();
    og_snap_rec r = context(OG_SNAP_OOM, 0, static_cast<int64_t>(n));
    const bool in_op = !t_ops.empty();
    std::lock_guard<std::mutex> g(g_mu);
    g_have_oom = false;  // until this copy is whole
    r.seq = g_seq.load();
    r.addr = budget >= 0 ? static_cast<uint64_t>(std::max<int64_t>(budget - live, 0)) : 0;  // free bytes
    push(r);
    if (test_fails("snap_hook")) throw std::bad_alloc();
    copy_now(g_oom);
    g_oom.info.request = static_cast<int64_t>(n);
    g_oom.info.live = live;
    g_oom.info.budget = budget;
    g_oom.info.failing = r;
    g_oom.info.op_seq = in_op ? t_top_seq : g_seq.load();
    g_oom_python = std::move(python);
    g_have_oom = true;
  } catch (...) {
    try {
      std::lock_guard<std::mutex> g(g_mu);
      g_have_oom = false;  // no earlier failure's copy stands in for this one
    } catch (...) {
    }
  }
}

}  // namespace oomguard::snap

using namespace oomguard::snap;

extern "C" {

char* og_snap_start(int64_t max_events) {
  return oomguard::guarded([&] {
    {
      std::lock_guard<std::mutex> g(g_mu);
      // The ring first: when it cannot be allocated, nothing has changed.
      if (static_cast<int64_t>(g_ring.size()) != max_events) {
        g_ring.assign(static_cast<size_t>(std::max<int64_t>(max_events, 1)), og_snap_rec{});
        g_head = 0;
        g_written = 0;
      }
      if (g_callback == 0) {
        g_callback = at::addGlobalCallback(at::RecordFunctionCallback(&op_start, &op_end)
                                               .needsInputs(false)
                                               .needsOutputs(false)
                                               .needsIds(false)
                                               .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
      }
    }
    g_on.store(true);
  });
}

// Recording and the op-name callback off (what `memory.snapshot: off` never turns on).
void og_snap_stop() {
  g_on.store(false);
  std::lock_guard<std::mutex> g(g_mu);
  if (g_callback != 0) at::removeCallback(g_callback);
  g_callback = 0;
  g_live.clear();
}

void og_snap_set_context(int64_t step, int32_t phase, int32_t micro_batch) {
  g_step.store(step, std::memory_order_relaxed);
  g_phase.store(phase, std::memory_order_relaxed);
  g_micro_batch.store(micro_batch, std::memory_order_relaxed);
}

void og_snap_set_phase(int32_t phase, int32_t micro_batch) {
  g_phase.store(phase, std::memory_order_relaxed);
  if (micro_batch >= -1) g_micro_batch.store(micro_batch, std::memory_order_relaxed);
}

int32_t og_snap_intern(const char* name) { return intern(name); }

int32_t og_snap_set_module(int32_t id) { return g_module.exchange(id, std::memory_order_relaxed); }

const char* og_snap_name(int32_t id) {
  std::lock_guard<std::mutex> g(g_names_mu);
  return id >= 0 && static_cast<size_t>(id) < g_names.size() ? g_names[id].c_str() : "";
}

void og_snap_mark_attempt() {
  std::lock_guard<std::mutex> g(g_mu);
  g_attempt_seq.store(g_seq.load());
  g_attempt_event = g_written;
  g_have_oom = false;
}

char* og_snap_oom_python() {
  std::lock_guard<std::mutex> g(g_mu);
  return strdup(g_oom_python.c_str());
}

char* og_snap_read(int last_oom, int* got, og_snap_info* info, og_snap_rec** live, int64_t* n_live, og_snap_rec** events,
                   int64_t* n_events) {
  *got = 0;
  return oomguard::guarded([&] {
    if (oomguard::test_fails("snap_read")) throw std::bad_alloc();
    Capture now;
    const Capture* c = &now;
    std::lock_guard<std::mutex> g(g_mu);
    if (last_oom) {
      if (!g_have_oom) return;
      g_have_oom = false;
      c = &g_oom;
    } else {
      copy_now(now);
      now.info.live = 0;
      for (const auto& r : now.live) now.info.live += r.size;
      now.info.op_seq = now.info.seq;
      now.info.budget = -1;
    }
    og_snap_rec* l = dup(c->live);
    og_snap_rec* e = l ? dup(c->events) : nullptr;
    if (l == nullptr || e == nullptr) {
      std::free(l);
      throw std::bad_alloc();
    }
    *info = c->info;
    *live = l;
    *n_live = static_cast<int64_t>(c->live.size());
    *events = e;
    *n_events = static_cast<int64_t>(c->events.size());
    *got = 1;
  });
}

}  // extern "C"
