// Data parallel's gradient reduction overlapped with backward: DDP's reducer, cut down to
// what the trainer needs. Owns the buckets (laid out by src/dist/overlap.rs) and, while
// armed (an attempt's last micro-batch), a post-accumulate-grad hook per parameter; a
// bucket whose gradients are all in starts its all-reduce at once, asynchronously.
// Keeps: buckets start in index order, the same on every rank, each exactly once an armed
// pass (`launch_rest` starts what backward did not, garbage included after a failure), so
// the ranks issue the same collectives in the same order whatever failed.
// Memory: a parameter larger than a bucket is reduced in its own gradient. The others'
// bucket is made when its last gradient is in, and the gradients become views of it (as
// DDP's gradient_as_bucket_view), so a bucket costs a bucket's bytes for a moment, not a
// copy of the gradients. A rank must send every bucket whatever failed: a bucket left
// without a buffer (its making failed, or backward never made a large gradient) goes, on a
// rank whose attempt failed, from a stand-in allocated then, once the attempt's memory is
// freed (or, where even that fails, from a gradient the failure made garbage, and at last
// from a parameter, which the ranks then restore: `trashed`); none is held through forward
// and backward.
// ZeRO-2: as each bucket's sum arrives, this rank's pieces of it go into its shard of the
// summed gradients and the bucket's gradients are dropped, during backward: the whole
// gradients are never all held at once on the last micro-batch.
#include "oomguard.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

c10d::Backend* og_group_backend(void* group);
void og_let_go_of(c10d::Backend* backend, const c10::intrusive_ptr<c10d::Work>& w);

namespace {
struct Bucket {
  std::vector<size_t> members;   // parameter indices, in the order their slots follow
  std::vector<int64_t> offsets;  // each member's first element in `flat`
  int64_t numel = 0;
  bool in_place = false;  // one contiguous parameter: its own gradient is reduced
  at::Tensor flat;        // the others': made when complete, the gradients views of it
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
  // What buckets with no buffer of their own send (their rank failed): from `launch_rest`.
  std::vector<at::Tensor> scratch;
  // Parameters a failed rank sent from, for want of memory, as (parameter, bucket, elements
  // from its start): garbage now, restored by the ranks together (src/dist/overlap.rs).
  std::vector<std::array<int64_t, 3>> trashed;
  // ZeRO-2 (from `arm` to `wait`): this rank's shard of the summed gradients (its size; made
  // at the first sum, so that it is not held through forward); each parameter's pieces of
  // it (where in the flattened parameter, how long, where in the shard); the buckets whose
  // sums are in it; whether this pass's sums are garbage.
  int64_t shard_numel = -1;
  at::Tensor shard;
  std::vector<std::vector<std::array<int64_t, 3>>> pieces;
  size_t scattered = 0;
  int64_t inflight = 0;  // bytes of the buckets started and not yet scattered
  int64_t largest = 0;   // bytes of the largest bucket (set with the layout)
  bool garbage = false;
  std::string error;  // of a work that failed, found while scattering

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
    largest = 0;
    for (const auto& b : buckets) largest = std::max(largest, bytes(b));
  }

  // What a failed rank sends for a bucket with no buffer: a new one (the failed attempt's
  // memory is free by now), else any garbage of the pass large enough (a gradient, the shard).
  at::Tensor stand_in(const at::Tensor& like, int64_t numel, size_t bucket) {
    for (auto& t : scratch) {
      if (t.scalar_type() == like.scalar_type() && t.device() == like.device() && t.numel() >= numel) {
        return t.narrow(0, 0, numel);
      }
    }
    try {
      scratch.push_back(at::empty({numel}, like.options().requires_grad(false)));
      return scratch.back();
    } catch (const std::exception&) {
    }
    std::vector<at::Tensor> garbage_{shard};
    for (auto& p : params) garbage_.push_back(p.grad());
    for (auto& t : garbage_) {
      if (t.defined() && t.is_contiguous() && t.scalar_type() == like.scalar_type() && t.device() == like.device() &&
          t.numel() >= numel) {
        return t.reshape({-1}).narrow(0, 0, numel);
      }
    }
    // At last a parameter: every rank holds the same values, so the ranks restore it after
    // the agreement drops the attempt (from a rank that kept it, or, where every rank sent
    // it for this bucket, from the sum of their copies).
    for (size_t k = 0; k < params.size(); ++k) {
      const auto& t = params[k];
      const bool taken = std::any_of(trashed.begin(), trashed.end(), [&](const auto& x) { return x[0] == static_cast<int64_t>(k); });
      if (!taken && t.is_contiguous() && t.scalar_type() == like.scalar_type() && t.device() == like.device() && t.numel() >= numel) {
        trashed.push_back({static_cast<int64_t>(k), static_cast<int64_t>(bucket), numel});
        return t.detach().reshape({-1}).narrow(0, 0, numel);
      }
    }
    throw std::runtime_error("no memory for a bucket this rank must send (" + std::to_string(numel) +
                             " elements) and nothing to send it from: the other ranks will time out");
  }

  // A shared bucket's buffer: its members' gradients (zeros where one has none), which
  // then become views of it.
  void build(Bucket& b) {
    torch::NoGradGuard no_grad;
    const auto& first = params[b.members[0]];
    auto flat = at::empty({b.numel}, first.options().requires_grad(false));
    for (size_t k = 0; k < b.members.size(); ++k) {
      auto& p = params[b.members[k]];
      auto to = flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        to.copy_(p.grad());
      } else {
        to.zero_();
      }
    }
    for (size_t k = 0; k < b.members.size(); ++k) {
      auto& p = params[b.members[k]];
      p.mutable_grad() = flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
    }
    b.flat = flat;
  }

  void start(size_t i) {
    auto& b = buckets[i];
    const auto& first = params[b.members[0]];
    at::Tensor t = b.flat;
    if (b.in_place && first.grad().defined()) t = first.grad();
    if (!t.defined()) t = stand_in(first, b.numel, i);
    std::vector<at::Tensor> one{t};
    works.push_back(backend->allreduce(one, c10d::AllreduceOptions()));
    inflight += bytes(b);
  }

  // Starts every complete bucket that is next in line.
  void start_ready() {
    while (next < buckets.size() && buckets[next].pending == 0) start(next++);
  }

  // A failed allocation here fails this rank's backward: its bucket goes later, from the
  // stand-in, with the others.
  void accumulated(size_t i) {
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
    if (--b.pending == 0 && !b.in_place) build(b);
    start_ready();
    if (shard_numel >= 0 && !garbage) {
      scatter_arrived(false);
      throttle();
    }
  }

  // ZeRO-2's shard, zeros, once (an allocation before the ranks' agreement after backward:
  // a failure here is this rank's backward's).
  void make_shard() {
    if (shard.defined() || shard_numel < 0) return;
    shard = at::zeros({shard_numel}, params[0].options().requires_grad(false));
  }

  // ZeRO-2: bucket i's sums (complete) into the shard, and its gradients dropped.
  void scatter(size_t i) {
    auto& b = buckets[i];
    torch::NoGradGuard no_grad;
    for (auto m : b.members) {
      auto& p = params[m];
      if (!p.grad().defined()) continue;
      auto g = p.grad().reshape({-1});
      for (const auto& pc : pieces[m]) shard.narrow(0, pc[2], pc[1]).copy_(g.narrow(0, pc[0], pc[1]));
      p.mutable_grad() = at::Tensor();
    }
    b.flat = at::Tensor();
  }

  // ZeRO-2: every bucket whose sum has arrived, in order (`all`: every one started, their
  // works waited for). Its work goes too: Gloo's holds the bucket's tensors until freed.
  // Before the shard is made, only once the arrived buckets hold as many bytes as it: made
  // sooner, it would hold more than it frees (a small model's shard, beside all but its
  // first bucket's gradients, at the tied embedding's sum). The throttle still makes it.
  void scatter_arrived(bool all) {
    if (!all && !shard.defined() && arrived_bytes() < shard_bytes()) return;
    while (scattered < works.size() && (all || works[scattered]->isCompleted())) scatter_next();
  }

  // Bytes of the buckets, from the next to scatter, whose sums have arrived.
  int64_t arrived_bytes() const {
    int64_t n = 0;
    for (size_t k = scattered; k < works.size() && works[k]->isCompleted(); ++k) n += bytes(buckets[k]);
    return n;
  }

  // ZeRO-2: while the buckets sent but not yet in the shard hold more than two of the
  // largest, backward waits for the oldest: what the last micro-batch holds of the whole
  // gradients stays bounded however the network keeps up.
  void throttle() {
    while (scattered < works.size() && inflight > 2 * largest) scatter_next();
  }

  int64_t shard_bytes() const { return shard_numel * static_cast<int64_t>(params[0].element_size()); }

  void scatter_next() {
    auto& w = works[scattered];
    try {
      w->wait();
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
      garbage = true;
    }
    // A failed allocation of the shard leaves this bucket's work for `wait`.
    if (!garbage && shard_numel >= 0) {
      make_shard();
      scatter(scattered);
    }
    inflight -= bytes(buckets[scattered]);
    let_go_of(w);
    w.reset();
    ++scattered;
  }

  int64_t bytes(const Bucket& b) const {
    return b.numel * static_cast<int64_t>(params[b.members[0]].element_size());
  }

  // The buffers go; `views`: so do the gradients that are views of them (sums the ranks
  // dropped), so that a failed attempt leaves nothing behind.
  void release(bool views) {
    for (auto& b : buckets) {
      for (size_t k = 0; views && b.flat.defined() && k < b.members.size(); ++k) {
        params[b.members[k]].mutable_grad() = at::Tensor();
      }
      b.flat = at::Tensor();
    }
    scratch.clear();
    shard = at::Tensor();
    shard_numel = -1;
  }

  void let_go_of(const c10::intrusive_ptr<c10d::Work>& w) { og_let_go_of(backend, w); }
};

struct Hook : torch::autograd::PostAccumulateGradHook {
  Reducer* r;
  size_t i;
  Hook(Reducer* r, size_t i) : r(r), i(i) {}
  void operator()(const torch::autograd::Variable&) override { r->accumulated(i); }
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

// Before the last micro-batch (nothing is allocated here). ZeRO-2:
// this rank's shard's elements (-1 otherwise) and its n pieces, 4 numbers each: the
// parameter, where in it (flattened), how long, where in the shard.
char* og_reducer_arm(void* p, int64_t shard_numel, const int64_t* pieces, int n) {
  return oomguard::guarded([&] {
    auto* r = reducer(p);
    std::lock_guard<std::mutex> lock(r->mu);
    r->release(false);
    r->pieces.assign(r->params.size(), {});
    for (int k = 0; k < n; ++k) {
      const int64_t* pc = pieces + 4 * k;
      r->pieces.at(static_cast<size_t>(pc[0])).push_back({pc[1], pc[2], pc[3]});
    }
    for (auto& b : r->buckets) b.pending = b.members.size();
    std::fill(r->in.begin(), r->in.end(), 0);
    r->next = 0;
    r->twice = false;
    r->works.clear();
    r->scattered = 0;
    r->inflight = 0;
    r->garbage = false;
    r->error.clear();
    r->trashed.clear();
    r->shard_numel = shard_numel;
    r->armed = true;
  });
}

// Not armed after all (the ranks' agreement before the last micro-batch failed): the
// buffers go, nothing was started.
void og_reducer_disarm(void* p) {
  auto* r = reducer(p);
  std::lock_guard<std::mutex> lock(r->mu);
  r->armed = false;
  r->release(true);
}

// After backward: starts every bucket not started yet, in order. `failed`: this rank's
// attempt failed, and the buckets go as they are (their sums are dropped everywhere);
// otherwise the gradients backward did not reach (zeros where a parameter has none) go
// into their buckets first; if that fails, this rank has failed (*oom: the error) and the
// rest go from the stand-in. *twice: some gradient was accumulated twice in the pass.
char* og_reducer_launch_rest(void* p, int failed, int* twice, char** oom) {
  return oomguard::guarded([&] {
    auto* r = reducer(p);
    std::lock_guard<std::mutex> lock(r->mu);
    *oom = nullptr;
    if (!r->armed) return;
    torch::NoGradGuard no_grad;
    for (size_t i = r->next; i < r->buckets.size(); ++i) {
      auto& b = r->buckets[i];
      auto& first = r->params[b.members[0]];
      try {
        if (!failed && !b.in_place && !b.flat.defined()) r->build(b);
        if (!failed && b.in_place && !first.grad().defined()) first.mutable_grad() = at::zeros_like(first);
      } catch (const std::exception& e) {
        *oom = strdup(e.what());
        failed = 1;
      }
      r->start(i);
    }
    if (!failed) {
      try {
        r->make_shard();
      } catch (const std::exception& e) {
        *oom = strdup(e.what());
        failed = 1;
      }
    }
    r->garbage = r->garbage || failed;
    r->next = r->buckets.size();
    r->armed = false;
    *twice = r->twice ? 1 : 0;
  });
}

// Waits for every bucket started; `keep`: the sums are the gradients (views of the
// buckets; ZeRO-2: *shard_out, a new tensor the caller owns). Otherwise they go. The
// stand-in goes either way.
char* og_reducer_wait(void* p, int keep, void** shard_out) {
  return oomguard::guarded([&] {
    auto* r = reducer(p);
    std::lock_guard<std::mutex> lock(r->mu);
    *shard_out = nullptr;
    std::string first_error = r->error;
    for (auto& w : r->works) {
      try {
        if (w) w->wait();
      } catch (const std::exception& e) {
        if (first_error.empty()) first_error = e.what();
      }
    }
    if (first_error.empty() && keep && r->shard.defined()) {
      r->scatter_arrived(true);
      *shard_out = new at::Tensor(r->shard);
    }
    for (auto& w : r->works) r->let_go_of(w);
    r->works.clear();
    r->release(!first_error.empty() || !keep);
    if (!first_error.empty()) throw std::runtime_error(first_error);
  });
}

// The parameters this rank sent from in its last armed pass (at most `cap`), 3 numbers
// each: the parameter, the bucket, the elements from its start. Returns how many.
int og_reducer_trashed(void* p, int64_t* out, int cap) {
  auto* r = reducer(p);
  std::lock_guard<std::mutex> lock(r->mu);
  int n = 0;
  for (const auto& t : r->trashed) {
    if (n >= cap) break;
    std::copy(t.begin(), t.end(), out + 3 * n);
    ++n;
  }
  return n;
}

}  // extern "C"
