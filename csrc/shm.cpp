// Collectives through shared memory, for a group whose ranks all run on one host (the
// launcher's LOCAL_WORLD_SIZE is its WORLD_SIZE): a c10d backend in front of Gloo that does
// the all-reduces (sum, max, min) and broadcasts of one contiguous CPU tensor itself, on the
// calling thread, and hands every other collective to Gloo. Over Gloo's loopback TCP each
// message waits for its helper thread to be scheduled on cores busy with training (a
// millisecond or more a hop on 2 cores); here a rank copies its chunk in, meets the others
// at a barrier in the segment, and sums every rank's chunk itself.
// Keeps: every rank sums the ranks' chunks in rank order, so all hold the same bits, run to
// run; a rank never touches a buffer set another may still read (two sets, alternating, and
// a barrier between uses); a peer that exits or stops answering fails the collective (after
// the group's timeout at the latest) and every later one, never a hang; nothing allocates
// from the process's allocator once the group is up.
#pragma GCC optimize("O3")
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>

#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace {
constexpr uint64_t kMagic = 0x6f6f6d67756172ULL;  // "oomguar"
// A rank's buffer in each of the two sets: chunks of this many bytes go through it.
constexpr int64_t kSlotBytes = 256 << 10;

struct alignas(64) RankState {
  std::atomic<uint64_t> arrived;  // the last barrier this rank reached
  std::atomic<int32_t> pid;
};

struct alignas(64) Header {
  std::atomic<uint64_t> magic;
  int32_t world;
  int64_t slot_bytes;
  alignas(64) std::atomic<uint32_t> epoch;  // futex word: bumped at every arrival
  std::atomic<int32_t> sleepers;
};

int64_t header_bytes(int world) {
  return ((sizeof(Header) + world * sizeof(RankState) + 4095) / 4096) * 4096;
}

int64_t segment_bytes(int world) { return header_bytes(world) + 2 * world * kSlotBytes; }

// A process that has exited (gone, or a zombie not yet reaped). Without a /proc to read,
// none has: a dead peer is then found by the group's timeout.
bool exited(int pid) {
  static const bool proc = access("/proc/self/stat", R_OK) == 0;
  if (!proc) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');
  return !close || close[1] == 0 || close[2] == 'Z' || close[2] == 'X';
}

template <typename T, typename F>
void combine(T* dst, const T* a, const T* b, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f(a[i], b[i]);
}

// dst = a (op) b, element-wise; false for a dtype this backend leaves to Gloo.
bool reduce_into(void* dst, const void* a, const void* b, int64_t n, at::ScalarType t, c10d::ReduceOp::RedOpType op) {
  bool ok = true;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    auto* d = static_cast<T*>(dst);
    auto* x = static_cast<const T*>(a);
    auto* y = static_cast<const T*>(b);
    switch (op) {
      case c10d::ReduceOp::SUM:
        combine(d, x, y, n, [](T p, T q) { return static_cast<T>(p + q); });
        break;
      case c10d::ReduceOp::MAX:
        combine(d, x, y, n, [](T p, T q) { return p < q ? q : p; });
        break;
      case c10d::ReduceOp::MIN:
        combine(d, x, y, n, [](T p, T q) { return q < p ? q : p; });
        break;
      default:
        ok = false;
    }
  };
  switch (t) {
    case at::kFloat: run(float{}); break;
    case at::kDouble: run(double{}); break;
    case at::kLong: run(int64_t{}); break;
    case at::kInt: run(int32_t{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: ok = false;
  }
  return ok;
}

bool reducible(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kLong || t == at::kInt || t == at::kBFloat16 ||
         t == at::kHalf;
}

// A collective that finished on the calling thread (its error, if any, comes from wait()).
struct Done : c10d::Work {
  explicit Done(std::exception_ptr e = nullptr) { finish(e); }
};

class ShmBackend : public c10d::Backend {
 public:
  ShmBackend(c10::intrusive_ptr<c10d::Backend> gloo, Header* h, int64_t bytes, int rank, int world,
             std::chrono::milliseconds timeout)
      : Backend(rank, world), gloo_(std::move(gloo)), h_(h), bytes_(bytes), timeout_(timeout) {
    ranks_ = reinterpret_cast<RankState*>(reinterpret_cast<char*>(h) + sizeof(Header));
    slots_ = reinterpret_cast<char*>(h) + header_bytes(world);
#ifdef OG_TEST_HOOKS
    // Test hook OOMGUARD_TEST_SHM_EXIT=RANK:N: rank RANK dies (as kill -9 would) at its
    // N-th barrier, before arriving: the others are inside the collective.
    int r = -1;
    unsigned long long n = 0;
    if (const char* v = std::getenv("OOMGUARD_TEST_SHM_EXIT"); v && std::sscanf(v, "%d:%llu", &r, &n) == 2 && r == rank) {
      exit_at_ = n;
    }
#endif
  }
  ~ShmBackend() override { munmap(h_, bytes_); }

  const std::string getBackendName() const override { return "oomguard-shm"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    const auto op = o.reduceOp.op_;
    if (ts.size() != 1 || !mine(ts[0]) || !reducible(ts[0].scalar_type()) ||
        (op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::MAX && op != c10d::ReduceOp::MIN)) {
      return gloo_->allreduce(ts, o);
    }
    return run([&] { all_reduce(ts[0], op); });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) override {
    if (ts.size() != 1 || !mine(ts[0])) return gloo_->broadcast(ts, o);
    return run([&] { broadcast_from(ts[0], static_cast<int>(o.rootRank)); });
  }

  // The rest is Gloo's.
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o) override {
    return gloo_->allgather(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    return gloo_->_allgather_base(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    return gloo_->_reduce_scatter_base(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override { return gloo_->barrier(o); }

 private:
  // Decided from the tensor alone, so every rank makes the same choice.
  static bool mine(const at::Tensor& t) { return t.device().is_cpu() && t.is_contiguous() && !t.is_sparse(); }

  template <typename F>
  c10::intrusive_ptr<c10d::Work> run(F&& f) {
    try {
      if (!broken_.empty()) throw std::runtime_error(broken_);
      f();
      return c10::make_intrusive<Done>();
    } catch (const std::exception& e) {
      if (broken_.empty()) broken_ = std::string("shared-memory collective: ") + e.what();
      return c10::make_intrusive<Done>(std::make_exception_ptr(std::runtime_error(broken_)));
    }
  }

  char* slot(int set, int r) const { return slots_ + (static_cast<int64_t>(set) * getSize() + r) * kSlotBytes; }

  void all_reduce(at::Tensor& t, c10d::ReduceOp::RedOpType op) {
    const int64_t elem = t.element_size(), per = kSlotBytes / elem;
    char* data = static_cast<char*>(t.data_ptr());
    const int W = getSize();
    if (W == 1) return;
    for (int64_t off = 0; off < t.numel(); off += per) {
      const int64_t n = std::min(per, t.numel() - off);
      char* mine = data + off * elem;
      const int set = static_cast<int>(seq_ & 1);
      std::memcpy(slot(set, getRank()), mine, n * elem);
      meet();
      reduce_into(mine, slot(set, 0), slot(set, 1), n, t.scalar_type(), op);
      for (int r = 2; r < W; ++r) reduce_into(mine, mine, slot(set, r), n, t.scalar_type(), op);
    }
  }

  void broadcast_from(at::Tensor& t, int root) {
    const int64_t bytes = t.numel() * t.element_size();
    char* data = static_cast<char*>(t.data_ptr());
    if (getSize() == 1) return;
    for (int64_t off = 0; off < bytes; off += kSlotBytes) {
      const int64_t n = std::min(kSlotBytes, bytes - off);
      const int set = static_cast<int>(seq_ & 1);
      if (getRank() == root) std::memcpy(slot(set, root), data + off, n);
      meet();
      if (getRank() != root) std::memcpy(data + off, slot(set, root), n);
    }
  }

  bool all_arrived(uint64_t s) const {
    for (int r = 0; r < getSize(); ++r) {
      if (ranks_[r].arrived.load(std::memory_order_acquire) < s) return false;
    }
    return true;
  }

  // The barrier: this rank's chunk is in; waits for every rank's. Spins a few tens of
  // microseconds (a peer on its own core is that close), then sleeps on the futex.
  void meet() {
    const uint64_t s = ++seq_;
    if (s == exit_at_) _exit(137);
    ranks_[getRank()].arrived.store(s, std::memory_order_release);
    h_->epoch.fetch_add(1);
    if (h_->sleepers.load() > 0) syscall(SYS_futex, &h_->epoch, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 4096; ++i) {
      if (all_arrived(s)) return;
      _mm_pause();
      if ((i & 255) == 255 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(50)) break;
    }
    auto check = start;
    for (;;) {
      h_->sleepers.fetch_add(1);
      const uint32_t e = h_->epoch.load();
      if (all_arrived(s)) {
        h_->sleepers.fetch_sub(1);
        return;
      }
      timespec ts{0, 20 * 1000 * 1000};
      syscall(SYS_futex, &h_->epoch, FUTEX_WAIT, e, &ts, nullptr, 0);
      h_->sleepers.fetch_sub(1);
      if (all_arrived(s)) return;
      const auto now = std::chrono::steady_clock::now();
      if (now - check < std::chrono::milliseconds(100)) continue;
      check = now;
      for (int r = 0; r < getSize(); ++r) {
        if (ranks_[r].arrived.load() >= s) continue;
        const int pid = ranks_[r].pid.load();
        if (exited(pid)) {
          throw std::runtime_error("rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                                   ") exited in the middle of a collective");
        }
        if (now - start > timeout_) {
          throw std::runtime_error("rank " + std::to_string(r) + " did not reach the collective within the group's timeout (" +
                                   std::to_string(timeout_.count() / 1000) + " s)");
        }
      }
    }
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
  Header* h_;
  int64_t bytes_;
  std::chrono::milliseconds timeout_;
  RankState* ranks_;
  char* slots_;
  uint64_t seq_ = 0;
  uint64_t exit_at_ = 0;  // the test hook's barrier (0: never)
  std::string broken_;
};

std::string segment_name(const std::string& token, int port) {
  std::string safe;
  for (char c : token) {
    if (std::isalnum(static_cast<unsigned char>(c)) && safe.size() < 48) safe += c;
  }
  return "/oomguard-" + safe + "-" + std::to_string(port);
}

// This rank's mapping of the segment (rank 0 makes it), or null with `why` said.
Header* map_segment(const std::string& name, int rank, int world, std::string& why) {
  const int64_t bytes = segment_bytes(world);
  const int fd = rank == 0 ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600) : shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    why = "shm_open " + name + ": " + std::strerror(errno);
    return nullptr;
  }
  struct stat st{};
  // posix_fallocate: a full /dev/shm fails here, not with SIGBUS at the first write.
  if (rank == 0 && (ftruncate(fd, bytes) != 0 || posix_fallocate(fd, 0, bytes) != 0)) {
    why = "sizing " + name + " to " + std::to_string(bytes) + " bytes: " + std::strerror(errno) + " (/dev/shm full?)";
    close(fd);
    return nullptr;
  }
  if (fstat(fd, &st) != 0 || st.st_size != bytes) {
    why = name + " is not " + std::to_string(bytes) + " bytes";
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    why = std::string("mmap: ") + std::strerror(errno);
    return nullptr;
  }
  auto* h = static_cast<Header*>(p);
  if (rank == 0) {
    h->world = world;
    h->slot_bytes = kSlotBytes;
    h->magic.store(kMagic);
  } else if (h->magic.load() != kMagic || h->world != world || h->slot_bytes != kSlotBytes) {
    why = name + " was made for another group";
    munmap(p, bytes);
    return nullptr;
  }
  auto* ranks = reinterpret_cast<RankState*>(reinterpret_cast<char*>(h) + sizeof(Header));
  ranks[rank].pid.store(getpid());
  return h;
}
}  // namespace

// The group's backend over shared memory in front of `gloo`, when every rank maps the
// segment (they learn it through the store, so all decide the same); else null, `why` said.
c10::intrusive_ptr<c10d::Backend> og_make_shm(const c10::intrusive_ptr<c10d::Store>& store,
                                              c10::intrusive_ptr<c10d::Backend> gloo, const std::string& token,
                                              int port, int rank, int world, std::chrono::milliseconds timeout,
                                              std::string& why) {
  const std::string name = segment_name(token, port);
  const std::string made = "oomguard/shm/made";
  Header* h = nullptr;
  if (rank == 0) {
    shm_unlink(name.c_str());  // a crashed run's
    h = map_segment(name, 0, world, why);
    store->set(made, std::vector<uint8_t>{static_cast<uint8_t>(h != nullptr)});
  } else if (store->get(made).at(0) == 1) {
    h = map_segment(name, rank, world, why);
  } else {
    why = "rank 0 could not make the segment";
  }
  store->set("oomguard/shm/" + std::to_string(rank), std::vector<uint8_t>{static_cast<uint8_t>(h != nullptr)});
  bool all = true;
  for (int r = 0; r < world; ++r) {
    if (store->get("oomguard/shm/" + std::to_string(r)).at(0) != 1) {
      all = false;
      if (why.empty()) why = "rank " + std::to_string(r) + " could not map the segment";
    }
  }
  // Every rank has mapped it or never will: the name can go (the mappings stay).
  if (rank == 0) shm_unlink(name.c_str());
  if (!all) {
    if (h) munmap(h, segment_bytes(world));
    return {};
  }
  return c10::make_intrusive<ShmBackend>(std::move(gloo), h, segment_bytes(world), rank, world, timeout);
}
