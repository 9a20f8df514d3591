// Data parallel's gradient reduction overlapped with backward: DDP's reducer, cut down to
// what the trainer needs. Owns the buckets (laid out by src/dist/overlap.rs) and, while
// armed (an attempt's last micro-batch), a post-accumulate-grad hook per parameter; a
// bucket whose gradients are all in starts its all-reduce at once, asynchronously.
// Keeps: buckets start in index order, the same on every rank, each exactly once an armed
// pass (`launch_rest` starts what backward did not, garbage included after a failure), so
// the ranks issue the same collectives in the same order whatever failed.
// Memory: a parameter larger than a bucket is reduced in its own gradient. The others'
// bucket is made at its first gradient, and each gradient, as it comes, is copied in and
// becomes a view of it (as DDP's gradient_as_bucket_view), so a bucket costs one gradient's
// bytes beyond its own for a moment, not a copy of the gradients. A rank must send every bucket whatever failed: a bucket left
// without a buffer (its making failed, or backward never made a large gradient) goes, on a
// rank whose attempt failed, from a stand-in allocated then, once the attempt's memory is
// freed (or, where even that fails, from a gradient the failure made garbage, and at last
// from a parameter, which the ranks then restore: `trashed`); none is held through forward
// and backward.
// ZeRO-2: as each bucket's sum arrives, this rank's pieces of it go into a segment made for
// them then (the bucket's part of this rank's shard) and the bucket's gradients are
// dropped, during backward: the whole gradients are never all held at once on the last
// micro-batch, and the shard grows as the activations go instead of standing beside them
// all from backward's start.
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
  std::vector<size_t> slot_of;  // each parameter's place among its bucket's members
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
  // ZeRO-2 (from `arm` to `wait`): whether it shards; each parameter's pieces of this rank's
  // shard (where in the flattened parameter, how long, the piece's index); each bucket's
  // segment (its pieces, in its members' order, made as its sum arrives); where each piece
  // lies (its bucket, where in the segment); the buckets whose sums are in their segments;
  // whether this pass's sums are garbage.
  bool sharding = false;
  std::vector<std::vector<std::array<int64_t, 3>>> pieces;
  std::vector<at::Tensor> segs;
  std::vector<std::array<int64_t, 2>> where;
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
        slot_of[i] = bucket.members.size() - 1;
      }
      bucket.in_place = bucket.members.size() == 1 && params[bucket.members[0]].is_contiguous();
      buckets.push_back(std::move(bucket));
    }
    largest = 0;
    for (const auto& b : buckets) largest = std::max(largest, bytes(b));
  }

  // What a failed rank sends for a bucket with no buffer: a new one (the failed attempt's
  // memory is free by now), else a gradient of the pass, garbage now, large enough.
  at::Tensor stand_in(const at::Tensor& like, int64_t numel, size_t bucket) {
    for (auto& t : scratch) {
      if (t.scalar_type() == like.scalar_type() && t.device() == like.device() && t.numel() >= numel) {
        return t.narrow(0, 0, numel);
      }
    }
    for (int tries = 0; tries < 2; ++tries) {
      try {
        scratch.push_back(at::empty({numel}, like.options().requires_grad(false)));
        return scratch.back();
      } catch (const std::exception&) {
      }
      // This pass is garbage: what it made for the buckets not sent yet, and the segments,
      // go first (the buckets sent keep theirs until their works are done).
      drop_unsent(bucket);
    }
    for (auto& p : params) {
      const auto t = p.grad();
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

  // A failed pass: the buffers and gradients of buckets `from` on, and the segments, go.
  void drop_unsent(size_t from) {
    for (size_t i = from; i < buckets.size(); ++i) {
      buckets[i].flat = at::Tensor();
      for (auto m : buckets[i].members) params[m].mutable_grad() = at::Tensor();
    }
    segs.assign(segs.size(), at::Tensor());
  }

  // Member k of shared bucket b into the bucket's buffer (made at its first): its gradient
  // (zeros where it has none) copied in, and the gradient a view of it from then on, so
  // that a bucket costs its bytes and one gradient's while it fills, not twice its bytes.
  void put(Bucket& b, size_t k) {
    torch::NoGradGuard no_grad;
    auto& p = params[b.members[k]];
    if (!b.flat.defined()) b.flat = at::empty({b.numel}, p.options().requires_grad(false));
    auto to = b.flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
    if (p.grad().defined()) {
      to.copy_(p.grad());
    } else {
      to.zero_();
    }
    p.mutable_grad() = to;
  }

  // After backward: the members of shared bucket b backward did not reach, into its buffer.
  void complete(Bucket& b) {
    for (size_t k = 0; k < b.members.size(); ++k) {
      if (!in[b.members[k]]) put(b, k);
    }
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
    if (!b.in_place) put(b, slot_of[i]);
    --b.pending;
    start_ready();
    if (sharding && !garbage) {
      scatter_arrived(false);
      throttle();
    }
  }

  // ZeRO-2: bucket i's segment (an allocation before the ranks' agreement after backward:
  // a failure here is this rank's backward's).
  void make_segment(size_t i) {
    if (segs[i].defined() || aliases(i)) return;
    if (const auto n = mine(i); n > 0) {
      segs[i] = at::empty({n}, params[buckets[i].members[0]].options().requires_grad(false));
    }
  }

  // ZeRO-2: the elements of this rank's pieces of bucket i.
  int64_t mine(size_t i) const {
    int64_t n = 0;
    for (auto m : buckets[i].members) {
      for (const auto& pc : pieces[m]) n += pc[1];
    }
    return n;
  }

  // Bucket i's buffer: the shared one, or its one gradient.
  at::Tensor sums(size_t i) const {
    const auto& b = buckets[i];
    return b.in_place ? params[b.members[0]].grad() : b.flat;
  }

  // ZeRO-2: whether this rank's pieces of bucket i are most of it (7/8 or more), in one
  // buffer: then its sums are its segment as they are, kept whole, with no copy (a copy of
  // most of a bucket would stand beside it for a moment; the rest kept is less).
  bool aliases(size_t i) const {
    const auto t = sums(i);
    return 8 * mine(i) >= 7 * buckets[i].numel && t.defined() && t.is_contiguous();
  }

  // ZeRO-2: bucket i's sums (complete) into its segment, and its gradients dropped.
  void scatter(size_t i) {
    auto& b = buckets[i];
    if (!segs[i].defined() && aliases(i)) {
      segs[i] = sums(i).reshape({-1});
      for (size_t k = 0; k < b.members.size(); ++k) {
        for (const auto& pc : pieces[b.members[k]]) {
          where[static_cast<size_t>(pc[2])] = {static_cast<int64_t>(i), b.offsets[k] + pc[0]};
        }
        params[b.members[k]].mutable_grad() = at::Tensor();
      }
      b.flat = at::Tensor();
      return;
    }
    make_segment(i);
    torch::NoGradGuard no_grad;
    int64_t off = 0;
    for (auto m : b.members) {
      auto& p = params[m];
      const auto g = p.grad().defined() ? p.grad().reshape({-1}) : at::Tensor();
      for (const auto& pc : pieces[m]) {
        auto to = segs[i].narrow(0, off, pc[1]);
        if (g.defined()) {
          to.copy_(g.narrow(0, pc[0], pc[1]));
        } else {
          to.zero_();
        }
        where[static_cast<size_t>(pc[2])] = {static_cast<int64_t>(i), off};
        off += pc[1];
      }
      p.mutable_grad() = at::Tensor();
    }
    b.flat = at::Tensor();
  }

  // ZeRO-2: every bucket whose sum has arrived, in order (`all`: every one started, their
  // works waited for). Its work goes too: Gloo's holds the bucket's tensors until freed.
  void scatter_arrived(bool all) {
    while (scattered < works.size() && (all || works[scattered]->isCompleted())) scatter_next();
  }

  // ZeRO-2: while the buckets sent but not yet in their segments hold more than two of the
  // largest, backward waits for the oldest: what the last micro-batch holds of the whole
  // gradients stays bounded however the network keeps up.
  void throttle() {
    while (scattered < works.size() && inflight > 2 * largest) scatter_next();
  }

  void scatter_next() {
    auto& w = works[scattered];
    try {
      w->wait();
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
      garbage = true;
    }
    // A failed allocation of the segment leaves this bucket's work for `wait`.
    if (!garbage && sharding) scatter(scattered);
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
    segs.assign(buckets.size(), at::Tensor());
    sharding = false;
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
    r->slot_of.assign(r->params.size(), 0);
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

// Before the last micro-batch (nothing is allocated here). ZeRO-2 (`shard`): this rank's n
// pieces of its shard, 3 numbers each: the parameter, where in it (flattened), how long.
char* og_reducer_arm(void* p, int shard, const int64_t* pieces, int n) {
  return oomguard::guarded([&] {
    auto* r = reducer(p);
    std::lock_guard<std::mutex> lock(r->mu);
    r->release(false);
    r->pieces.assign(r->params.size(), {});
    for (int k = 0; k < n; ++k) {
      const int64_t* pc = pieces + 3 * k;
      r->pieces.at(static_cast<size_t>(pc[0])).push_back({pc[1], pc[2], k});
    }
    r->where.assign(static_cast<size_t>(n), {-1, 0});
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
    r->sharding = shard != 0;
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
        if (!failed && !b.in_place) r->complete(b);
        if (!failed && b.in_place && !first.grad().defined()) first.mutable_grad() = at::zeros_like(first);
      } catch (const std::exception& e) {
        *oom = strdup(e.what());
        failed = 1;
      }
      r->start(i);
    }
    // ZeRO-2: the segments of the buckets whose sums are still to come, now, so that what
    // follows the ranks' agreement allocates nothing.
    if (!failed && r->sharding) {
      try {
        for (size_t i = r->scattered; i < r->buckets.size(); ++i) r->make_segment(i);
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
// buckets; ZeRO-2: this rank's shard of them, *nsegs segments, new tensors the caller
// owns, in segs_out (room for one a bucket), and where each piece lies, 2 numbers each in
// where_out: its segment, where in it). Otherwise they go. The stand-in goes either way.
char* og_reducer_wait(void* p, int keep, void** segs_out, int* nsegs, int64_t* where_out) {
  return oomguard::guarded([&] {
    auto* r = reducer(p);
    std::lock_guard<std::mutex> lock(r->mu);
    *nsegs = -1;
    std::string first_error = r->error;
    for (auto& w : r->works) {
      try {
        if (w) w->wait();
      } catch (const std::exception& e) {
        if (first_error.empty()) first_error = e.what();
      }
    }
    if (first_error.empty() && keep && r->sharding) {
      r->scatter_arrived(true);
      std::vector<int64_t> out_of(r->segs.size(), -1);
      int n = 0;
      for (size_t i = 0; i < r->segs.size(); ++i) {
        if (r->segs[i].defined()) out_of[i] = n++;
      }
      for (size_t k = 0; k < r->where.size(); ++k) {
        const auto [b, off] = r->where[k];
        if (b < 0) throw std::runtime_error("piece " + std::to_string(k) + " of the gradient shard was never filled");
        where_out[2 * k] = out_of[static_cast<size_t>(b)];
        where_out[2 * k + 1] = off;
      }
      for (size_t i = 0; i < r->segs.size(); ++i) {
        if (r->segs[i].defined()) segs_out[out_of[i]] = new at::Tensor(r->segs[i]);
      }
      *nsegs = n;
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
