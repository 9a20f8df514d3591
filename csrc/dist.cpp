// Data-parallel training over libtorch's own c10d: a TCPStore rendezvous (rank 0 serves it),
// ProcessGroupGloo on the CPU and ProcessGroupNCCL on CUDA (csrc/dist_nccl.cpp), and the few
// collectives the trainer uses. Every call returns NULL or a message; a peer that dies
// makes a collective fail (after the group's timeout at the latest), never hang forever.
#include "oomguard.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <string>
#include <vector>

c10::intrusive_ptr<c10d::Backend> og_make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                               std::chrono::milliseconds timeout);
c10::intrusive_ptr<c10d::Backend> og_make_shm(const c10::intrusive_ptr<c10d::Store>& store,
                                              c10::intrusive_ptr<c10d::Backend> gloo, const std::string& token,
                                              int port, int rank, int world, std::chrono::milliseconds timeout,
                                              std::string& why);

namespace {
struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  // Gloo (the CPU): ZeRO's collectives as in-place all-reduces (below).
  bool gloo = false;
  // The backend lacks the flat reduce-scatter / all-gather (learnt at the first call, the
  // same on every rank: an unsupported collective throws before any traffic).
  bool no_reduce_scatter = false, no_all_gather = false;
  // The transport: "gloo", "shared memory" (csrc/shm.cpp, in front of Gloo) or "nccl"; and
  // why shared memory was asked for and not used.
  std::string transport, note;
};

bool unsupported(const std::exception& e) {
  const std::string m = e.what();
  return m.find("does not support") != std::string::npos || m.find("not supported") != std::string::npos;
}

Group* group(void* p) { return static_cast<Group*>(p); }

// Runs a collective's flat form unless the backend lacks it (`missing`: learnt at the first
// call, the same on every rank); whether it ran.
template <typename F>
bool flat_form(bool& missing, F&& run) {
  if (missing) return false;
  try {
    run();
    return true;
  } catch (const std::exception& e) {
    if (!unsupported(e)) throw;
    missing = true;
    return false;
  }
}

std::vector<at::Tensor> tensors(void** ptrs, int n) {
  std::vector<at::Tensor> out;
  for (int i = 0; i < n; ++i) out.push_back(*static_cast<at::Tensor*>(ptrs[i]));
  return out;
}

}  // namespace

// Gloo's worker drops its reference to a work (and its tensors) just after marking it
// complete: wait for that (at most 1 s), so that the tensors are this caller's alone when
// it goes on (a failed attempt's buffers freed before the guard measures what is live; a
// bucket's gradients free to be ZeRO-1's gather space), not a moment later on that thread.
void og_let_go_of(c10d::Backend* backend, const c10::intrusive_ptr<c10d::Work>& w) {
  if (!w || (backend->getBackendName() != "gloo" && backend->getBackendName() != "oomguard-shm")) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (w.use_count() > 1 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
}

namespace {
// Waits for every work, then for the backend to let go of them.
void wait_all(c10d::Backend* backend, const std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  for (auto& w : works) w->wait();
  for (auto& w : works) og_let_go_of(backend, w);
}

// Collectives issued and not yet waited for (og_dist_all_gather_start).
struct Started {
  c10d::Backend* backend;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
};

// One collective per tensor, all issued before any is waited for (they overlap).
template <typename F>
void each_then_wait(c10d::Backend* backend, const std::vector<at::Tensor>& ts, F&& issue) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const auto& t : ts) {
    std::vector<at::Tensor> one{t};
    works.push_back(issue(one));
  }
  wait_all(backend, works);
}
// Rank 0's store socket, bound to MASTER_ADDR's own interface rather than every one: a
// loopback address (--standalone, one node) stays on this machine.
int bound_listener(const char* addr, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(addr, service.c_str(), &hints, &res); rc != 0) {
    throw std::runtime_error(std::string("MASTER_ADDR ") + addr + " does not resolve: " + gai_strerror(rc));
  }
  std::string why = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 2048) == 0) {
      freeaddrinfo(res);
      return fd;
    }
    why = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(res);
  throw std::runtime_error(std::string("cannot listen on ") + addr + ":" + service + " (" + why + ")");
}

}  // namespace

// The group's backend, for csrc/overlap.cpp's reducer (which the group outlives).
c10d::Backend* og_group_backend(void* g) { return group(g)->backend.get(); }

extern "C" {

// shm: the ranks all run on this host; try shared memory in front of Gloo (csrc/shm.cpp).
char* og_dist_init(const char* addr, int port, const char* token, int rank, int world, int cuda_index,
                   const char* gloo_host, int64_t timeout_ms, int shm, void** out) {
  return oomguard::guarded([&] {
    const auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(port);
    opts.isServer = rank == 0;
    opts.numWorkers = static_cast<size_t>(world);
    opts.waitWorkers = true;
    opts.timeout = timeout;
    if (rank == 0) opts.masterListenFd = bound_listener(addr, port);
    auto g = std::make_unique<Group>();
    g->store = c10::make_intrusive<c10d::TCPStore>(std::string(addr), opts);
    // Before the backend touches the store: a rank of another run that reached the same
    // address and port stops here instead of joining (or disturbing) that run's group. The
    // token is a key's name, never a value: the store answers whether a key exists but lists
    // none, so a client that does not know the token cannot read it.
    const std::string marker = "oomguard/run", mine = std::string("oomguard/run/") + token;
    if (rank == 0) {
      g->store->set(mine, std::vector<uint8_t>{1});
      g->store->set(marker, std::vector<uint8_t>{1});
    }
    g->store->get(marker);
    if (!g->store->check({mine})) {
      throw std::runtime_error("the group at " + std::string(addr) + ":" + std::to_string(port) +
                               " belongs to another run (its token is not this rank's): two runs share the address and port; "
                               "give each its own --master-port");
    }
    if (cuda_index < 0) {
      auto o = c10d::ProcessGroupGloo::Options::create();
      o->timeout = timeout;
      // Gloo's own sockets: the interface asked for, else this host's address on the route to
      // MASTER_ADDR (gloo_host; loopback when the store is there). Never Gloo's default, the
      // hostname's address, which /etc/hosts often maps to loopback on a multi-node job.
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      o->devices.push_back(ifname ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
                                  : c10d::ProcessGroupGloo::createDeviceForHostname(gloo_host));
      g->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(g->store, rank, world, o);
      g->gloo = true;
      g->transport = "gloo";
      if (shm) {
        if (auto s = og_make_shm(g->store, g->backend, token, port, rank, world, timeout, g->note)) {
          g->backend = s;
          g->transport = "shared memory";
        }
      }
    } else {
      g->backend = og_make_nccl(g->store, rank, world, timeout);
      g->transport = "nccl";
    }
    *out = g.release();
  });
}

void og_dist_free(void* g) { delete group(g); }

// The group's transport, and why shared memory was asked for and not used ("" if it was not
// asked for or is used); both live as long as the group.
const char* og_dist_transport(void* g, const char** note) {
  *note = group(g)->note.c_str();
  return group(g)->transport.c_str();
}

// op: 0 sum, 1 max, 2 min; in place.
char* og_dist_all_reduce(void* g, void** ts, int n, int op) {
  return oomguard::guarded([&] {
    c10d::AllreduceOptions o;
    o.reduceOp = op == 1 ? c10d::ReduceOp::MAX : op == 2 ? c10d::ReduceOp::MIN : c10d::ReduceOp::SUM;
    auto* b = group(g)->backend.get();
    each_then_wait(b, tensors(ts, n), [&](std::vector<at::Tensor>& one) { return b->allreduce(one, o); });
  });
}

char* og_dist_broadcast(void* g, void** ts, int n, int root) {
  return oomguard::guarded([&] {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    auto* b = group(g)->backend.get();
    each_then_wait(b, tensors(ts, n), [&](std::vector<at::Tensor>& one) { return b->broadcast(one, o); });
  });
}

// ZeRO's collectives over flat buffers. Reduce-scatter: out[S] = the sum over ranks of
// in[rank*S, (rank+1)*S); `in` (W*S) is scratch. A collective runs after the ranks agreed,
// so it must not allocate: an OOM inside it would fail one rank mid-collective. Gloo's flat
// forms allocate temporaries from the process's allocator, so on Gloo (and where a backend
// has no flat form) both are in-place all-reduces, which allocate nothing: here of `in`,
// then this rank's slice. *fallback: 2 Gloo by design, 1 unsupported, 0 the flat form.
char* og_dist_reduce_scatter(void* g, void* in, void* out, int* fallback) {
  return oomguard::guarded([&] {
    auto* G = group(g);
    auto& input = *static_cast<at::Tensor*>(in);
    auto& output = *static_cast<at::Tensor*>(out);
    if (!G->gloo && flat_form(G->no_reduce_scatter, [&] {
          G->backend->_reduce_scatter_base(output, input, c10d::ReduceScatterOptions())->wait();
        })) {
      *fallback = 0;
      return;
    }
    std::vector<at::Tensor> one{input};
    G->backend->allreduce(one, c10d::AllreduceOptions())->wait();
    const int64_t S = output.numel();
    output.copy_(input.narrow(0, G->backend->getRank() * S, S));
    *fallback = G->gloo ? 2 : 1;
  });
}

// One all-gather: out[r*S, (r+1)*S) = rank r's in[S], on every rank; `in` may be this
// rank's slice of `out` itself. On Gloo: this rank's slice in place, then one in-place
// broadcast from each rank (an all-gather's bytes, allocating nothing), issued and left in
// flight: *started holds them until og_dist_gathered (the caller packs and unpacks other
// chunks meanwhile), *fallback 3. Elsewhere done here (*started null): the flat form, or
// where a backend has none, the other slices zeroed and summed over the ranks (x + 0 is x
// exactly), *fallback 1.
char* og_dist_all_gather_start(void* g, void* in, void* out, int* fallback, void** started) {
  *started = nullptr;
  return oomguard::guarded([&] {
    auto* G = group(g);
    const int rank = G->backend->getRank();
    const int world = G->backend->getSize();
    auto& input = *static_cast<at::Tensor*>(in);
    auto& output = *static_cast<at::Tensor*>(out);
    const int64_t S = input.numel();
    auto ours = output.narrow(0, rank * S, S);
    const bool in_place = ours.data_ptr() == input.data_ptr();
    if (G->gloo) {
      if (!in_place) ours.copy_(input);
      auto s = std::make_unique<Started>(Started{G->backend.get(), {}});
      for (int r = 0; r < world; ++r) {
        std::vector<at::Tensor> one{output.narrow(0, r * S, S)};
        c10d::BroadcastOptions o;
        o.rootRank = r;
        s->works.push_back(G->backend->broadcast(one, o));
      }
      *fallback = 3;
      *started = s.release();
      return;
    }
    if (flat_form(G->no_all_gather, [&] { G->backend->_allgather_base(output, input, c10d::AllgatherOptions())->wait(); })) {
      *fallback = 0;
      return;
    }
    if (!in_place) ours.copy_(input);
    output.narrow(0, 0, rank * S).zero_();
    output.narrow(0, (rank + 1) * S, (world - rank - 1) * S).zero_();
    std::vector<at::Tensor> one{output};
    G->backend->allreduce(one, c10d::AllreduceOptions())->wait();
    *fallback = 1;
  });
}

// Frees a started all-gather (null: nothing in flight), having waited for it when `wait`
// (also when that fails). Unwaited (the step failed already), its works stay the backend's.
char* og_dist_gathered(void* started, int wait) {
  std::unique_ptr<Started> s(static_cast<Started*>(started));
  if (!s || !wait) return nullptr;
  return oomguard::guarded([&] { wait_all(s->backend, s->works); });
}

// The store, for small state every rank needs (rank 0's resume point).
char* og_dist_store_set(void* g, const char* key, const uint8_t* data, int64_t len) {
  return oomguard::guarded([&] { group(g)->store->set(key, std::vector<uint8_t>(data, data + len)); });
}

// Waits for the key; *out is malloc'd (free with og_free).
char* og_dist_store_get(void* g, const char* key, uint8_t** out, int64_t* len) {
  return oomguard::guarded([&] {
    auto v = group(g)->store->get(key);
    *out = static_cast<uint8_t*>(std::malloc(v.size() ? v.size() : 1));
    std::copy(v.begin(), v.end(), *out);
    *len = static_cast<int64_t>(v.size());
  });
}

}  // extern "C"
