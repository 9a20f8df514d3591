// The memory history (csrc/snapshot.cpp, and csrc/snapshot_cuda.cpp on CUDA builds): C ABI
// for src/memory/snapshot/, and the counting allocator's hooks.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

extern "C" {
enum { OG_SNAP_ALLOC = 0, OG_SNAP_FREE = 1, OG_SNAP_OOM = 2 };

// One event, or one live allocation (action ALLOC) with the context it was made in. For an
// OOM event, size is the request and addr the bytes that were free.
typedef struct {
  uint64_t addr;
  int64_t size;
  uint64_t seq;  // the allocation's number (an OOM: the next number)
  int64_t time_us;
  int64_t step;  // -1 outside a step
  int32_t action;
  int32_t op;      // innermost op (an interned name; 0: none)
  int32_t top_op;  // outermost op
  int32_t module;  // the runtime's module scope (interned; 0: none)
  int32_t phase;   // src/memory/snapshot's Phase codes
  int32_t micro_batch;  // -1: none
} og_snap_rec;

typedef struct {
  int64_t request;  // bytes the failed allocation asked for
  int64_t live;     // bytes live at the failure
  int64_t budget;   // -1: none
  uint64_t seq;     // allocations recorded so far
  uint64_t op_seq;  // allocations from this number on were made by the failing op
  uint64_t attempt_seq;  // ... and from this one on by the failing attempt
  uint64_t events_written;  // events ever recorded (the ring keeps the last max_events)
  uint64_t attempt_event;   // events_written when the failing attempt began
  og_snap_rec failing;
} og_snap_info;

// Starts recording (and the op-name callback) with a ring of max_events; again resizes.
// NULL, or the message of what failed (a ring too large to allocate), recording unchanged.
char* og_snap_start(int64_t max_events);
void og_snap_stop();
void og_snap_set_context(int64_t step, int32_t phase, int32_t micro_batch);
// micro_batch < -1 leaves it as it is.
void og_snap_set_phase(int32_t phase, int32_t micro_batch);
int32_t og_snap_intern(const char* name);
// Returns the previous module id.
int32_t og_snap_set_module(int32_t id);
const char* og_snap_name(int32_t id);
// A guarded attempt starts: its allocations are numbered from here; a failure before it is
// forgotten.
void og_snap_mark_attempt();
// last_oom: the copy taken at the last failure (*got = 0 when there is none since the
// attempt began), else the state now. Arrays are malloc'd (free with og_free). NULL, or the
// message of what failed (an allocation for the copies), nothing returned.
char* og_snap_read(int last_oom, int* got, og_snap_info* info, og_snap_rec** live, int64_t* n_live, og_snap_rec** events,
                   int64_t* n_events);
// The Python frames (a Python model's) at the last failure, one per line, innermost first; ""
// when none ran. malloc'd (free with og_free).
char* og_snap_oom_python();
}

namespace oomguard::snap {
extern std::atomic<bool> g_on;
void on_alloc(void* p, size_t n) noexcept;
void on_free(void* p);
// Records the failure and copies the history; never throws (the OOM error follows it).
void on_oom(size_t n, int64_t live, int64_t budget) noexcept;
}  // namespace oomguard::snap
