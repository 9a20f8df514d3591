// Data parallel's gradient reduction overlapped with backward: DDP's reducer, cut down to
// what the trainer needs. Owns the buckets (laid out by src/dist/overlap.rs) and, while armed (an attempt's last micro-batch), a
// post-accumulate-grad hook per parameter that puts its gradient into its bucket; a bucket
// whose gradients are all in starts its all-reduce at once, asynchronously.
// Keeps: buckets start in index order, the same on every rank, each exactly once an armed
// pass (`launch_rest` starts what backward did not, garbage included after a failure), so
// the ranks issue the same collectives in the same order whatever failed; nothing is
// allocated between `arm` and `wait` (the buffers come at `arm`, before the ranks agree).
#include "oomguard.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

c10d::Backend* og_group_backend(void* group);

namespace {
struct Bucket {
  std::vector<size_t> members;   // parameter indices, in the order their slots follow
  std::vector<int64_t> offsets;  // each member's first element in `flat`
  int64_t numel = 0;
  bool in_place = false;  // one contiguous parameter: its own gradient is reduced
  at::Tensor flat;        // the others' buffer, from `arm` to `wait`
  size_t pending = 0;
};

struct Reducer {
  c10d::Backend* backend;
  std::vector<at::Tensor> params;
  std::vector<size_t> bucket_of;
  std::vector<Bucket> buckets;
  std::mutex mu;  // hooks run on autograd's threads (one per device on CUDA)
  bool armed = false;
  bool twice = false;  // a gradient was accumulated twice in one armed pass
  size_t next = 0;     // the next bucket to start
  std::vector<char> in;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  // The order gradients first arrive in, recorded until `og_reducer_observed` reads it.
  bool observing = true;
  std::vector<int64_t> arrival;
  std::vector<char> arrived;

  void lay_out(const int64_t* order, const int64_t* starts, int nb) {
    buckets.clear();
    for (int b = 0; b < nb; ++b) {
      Bucket bucket;
      for (int64_t k = starts[b]; k < starts[b + 1]; ++k) {
        const auto i = static_cast<size_t>(order[k]);
        bucket.members.push_back(i);
        bucket.offsets.push_back(bucket.numel);
        bucket.numel += params[i].numel();
        bucket_of[i] = static_cast<size_t>(b);
      }
      bucket.in_place = bucket.members.size() == 1 && params[bucket.members[0]].is_contiguous();
      buckets.push_back(std::move(bucket));
    }
  }

  at::Tensor slot(const Bucket& b, size_t k) {
    const auto& p = params[b.members[k]];
    return b.flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
  }

  // Where a parameter reduced in place that has no gradient yet (no accumulation before
  // the last micro-batch) sends from if its rank fails before backward makes one: one
  // buffer per dtype and device, of the largest such parameter, allocated at `arm`.
  std::vector<at::Tensor> scratch;

  at::Tensor stand_in(const at::Tensor& p) {
    for (auto& t : scratch) {
      if (t.scalar_type() == p.scalar_type() && t.device() == p.device() && t.numel() >= p.numel()) {
        return t.narrow(0, 0, p.numel()).view(p.sizes());
      }
    }
    throw std::runtime_error("no stand-in buffer for a gradient backward did not make");
  }

  void start(size_t i) {
    auto& b = buckets[i];
    at::Tensor t = b.flat;
    if (b.in_place) {
      const auto& p = params[b.members[0]];
      t = p.grad().defined() ? p.grad() : stand_in(p);
    }
    std::vector<at::Tensor> one{t};
    works.push_back(backend->allreduce(one, c10d::AllreduceOptions()));
  }

  // Starts every complete bucket that is next in line.
  void start_ready() {
    while (next < buckets.size() && buckets[next].pending == 0) start(next++);
  }

  void accumulated(size_t i, const at::Tensor& grad) {
    std::lock_guard<std::mutex> lock(mu);
    if (observing && !arrived[i]) {
      arrived[i] = 1;
      arrival.push_back(static_cast<int64_t>(i));
    }
    if (!armed) return;
    if (in[i]) {
      twice = true;
      return;
    }
    in[i] = 1;
    auto& b = buckets[bucket_of[i]];
    if (!b.in_place) {
      size_t k = 0;
      while (b.members[k] != i) ++k;
      torch::NoGradGuard no_grad;
      slot(b, k).copy_(grad);
    }
    --b.pending;
    start_ready();
  }
};

struct Hook : torch::autograd::PostAccumulateGradHook {
  Reducer* r;
  size_t i;
  Hook(Reducer* r, size_t i) : r(r), i(i) {}
  void operator()(const torch::autograd::Variable& p) override { r->accumulated(i, p.grad()); }
};

Reducer* reducer(void* p) { return static_cast<Reducer*>(p); }
}  // namespace

extern "C" {

// Buckets as src/dist/overlap.rs laid them out: bucket b holds the parameters
// order[starts[b]..starts[b+1]], and starts in that place; a hook on every parameter. Fails
// if a parameter already has a post-accumulate-grad hook (its slot holds one).
char* og_reducer_new(void* group, void** params, int n, const int64_t* order, const int64_t* starts, int nb,
                     void** out) {
  return oomguard::guarded([&] {
    auto r = std::make_unique<Reducer>();
    r->backend = og_group_backend(group);
    for (int i = 0; i < n; ++i) {
      r->params.push_back(*static_cast<at::Tensor*>(params[i]));
      if (torch::autograd::impl::post_acc_grad_hooks(r->params.back())) {
        throw std::runtime_error("parameter " + std::to_string(i) + " already has a post-accumulate-grad hook");
      }
    }
    r->bucket_of.assign(r->params.size(), 0);
    r->in.assign(r->params.size(), 0);
    r->arrived.assign(r->params.size(), 0);
    r->lay_out(order, starts, nb);
    for (size_t i = 0; i < r->params.size(); ++i) {
      torch::autograd::impl::set_post_acc_grad_hooks(r->params[i], std::make_unique<Hook>(r.get(), i));
    }
    *out = r.release();
  });
}

void og_reducer_free(void* p) {
  auto* r = reducer(p);
  for (auto& t : r->params) torch::autograd::impl::set_post_acc_grad_hooks(t, nullptr);
  delete r;
}

int og_reducer_buckets(void* p) { return static_cast<int>(reducer(p)->buckets.size()); }

// The parameters in the order their gradients first arrived (out: room for every
// parameter; *n: how many arrived); recording stops.
void og_reducer_observed(void* p, int64_t* out, int* n) {
  auto* r = reducer(p);
  std::lock_guard<std::mutex> lock(r->mu);
  r->observing = false;
  std::copy(r->arrival.begin(), r->arrival.end(), out);
  *n = static_cast<int>(r->arrival.size());
}

// New buckets (as og_reducer_new's), between armed passes.
char* og_reducer_relayout(void* p, const int64_t* order, const int64_t* starts, int nb) {
  return oomguard::guarded([&] {
    auto* r = reducer(p);
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->armed) throw std::runtime_error("the reducer's buckets cannot change while it is armed");
    r->lay_out(order, starts, nb);
  });
}

// Before the last micro-batch: the buffers, and the stand-in for parameters reduced in place
// that have no gradient yet, so that nothing is allocated once the ranks agreed.
char* og_reducer_arm(void* p) {
  return oomguard::guarded([&] {
    auto* r = reducer(p);
    std::lock_guard<std::mutex> lock(r->mu);
    torch::NoGradGuard no_grad;
    r->scratch.clear();
    std::vector<std::pair<at::Tensor, int64_t>> need;  // a parameter of each dtype and device, the largest numel
    for (auto& b : r->buckets) {
      const auto& first = r->params[b.members[0]];
      b.pending = b.members.size();
      if (!b.in_place) {
        if (!b.flat.defined()) b.flat = at::empty({b.numel}, first.options().requires_grad(false));
        continue;
      }
      if (first.grad().defined()) continue;
      bool known = false;
      for (auto& n : need) {
        if (n.first.scalar_type() == first.scalar_type() && n.first.device() == first.device()) {
          n.second = std::max(n.second, first.numel());
          known = true;
        }
      }
      if (!known) need.emplace_back(first, first.numel());
    }
    for (const auto& n : need) r->scratch.push_back(at::empty({n.second}, n.first.options().requires_grad(false)));
    std::fill(r->in.begin(), r->in.end(), 0);
    r->next = 0;
    r->twice = false;
    r->works.clear();
    r->armed = true;
  });
}

// Not armed after all (the ranks' agreement before the last micro-batch failed): the
// buffers go, nothing was started.
void og_reducer_disarm(void* p) {
  auto* r = reducer(p);
  std::lock_guard<std::mutex> lock(r->mu);
  r->armed = false;
  for (auto& b : r->buckets) b.flat = at::Tensor();
  r->scratch.clear();
}

// After backward: starts every bucket not started yet, in order. `failed`: this rank's
// attempt failed, and the buckets go as they are (their sums are dropped everywhere);
// otherwise the gradients backward did not reach (zeros where a parameter has none) go
// into their slots first. *twice: some gradient was accumulated twice in the armed pass.
char* og_reducer_launch_rest(void* p, int failed, int* twice) {
  return oomguard::guarded([&] {
    auto* r = reducer(p);
    std::lock_guard<std::mutex> lock(r->mu);
    if (!r->armed) return;
    torch::NoGradGuard no_grad;
    for (size_t i = r->next; i < r->buckets.size(); ++i) {
      auto& b = r->buckets[i];
      for (size_t k = 0; k < b.members.size() && !failed && !b.in_place; ++k) {
        if (r->in[b.members[k]]) continue;
        const auto& g = r->params[b.members[k]].grad();
        if (g.defined()) {
          r->slot(b, k).copy_(g);
        } else {
          r->slot(b, k).zero_();
        }
      }
      r->start(i);
    }
    r->next = r->buckets.size();
    r->armed = false;
    *twice = r->twice ? 1 : 0;
  });
}

// Waits for every bucket started; `unpack`: the sums go back into the gradients. The
// buffers go either way.
char* og_reducer_wait(void* p, int unpack) {
  return oomguard::guarded([&] {
    auto* r = reducer(p);
    std::lock_guard<std::mutex> lock(r->mu);
    std::string first_error;
    for (auto& w : r->works) {
      try {
        w->wait();
      } catch (const std::exception& e) {
        if (first_error.empty()) first_error = e.what();
      }
    }
    r->works.clear();
    if (first_error.empty() && unpack) {
      torch::NoGradGuard no_grad;
      for (auto& b : r->buckets) {
        if (b.in_place || !b.flat.defined()) continue;
        for (size_t k = 0; k < b.members.size(); ++k) r->params[b.members[k]].mutable_grad().copy_(r->slot(b, k));
      }
    }
    for (auto& b : r->buckets) b.flat = at::Tensor();
    r->scratch.clear();
    if (!first_error.empty()) throw std::runtime_error(first_error);
  });
}

}  // extern "C"
