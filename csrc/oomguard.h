// C ABI between csrc/ and src/memory, src/optim. Tensors are tch's C_tensor, a torch::Tensor*.
// Functions that can fail return NULL on success or a message (free with og_free; never NULL
// after a failure, even when the message could not be copied).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>

extern "C" {
void og_free(char* msg);

// Counting CPU allocator with an optional budget (bytes; < 0 means none).
void og_cpu_install();
void og_cpu_set_budget(int64_t bytes);
void og_cpu_set_footprint_limit(int64_t bytes);
int64_t og_cpu_budget();
int64_t og_cpu_live_bytes();
int64_t og_cpu_peak_bytes();
void og_cpu_reset_peak();
int64_t og_cpu_num_ooms();
// Allocations asked of the counting allocator so far (the fault injector's clock).
uint64_t og_cpu_alloc_count();
// Fault injection: the allocations numbered `at` (by og_cpu_alloc_count's clock) fail with
// c10::OutOfMemoryError, as a real budget overrun does. n = 0 disarms.
void og_inject_arm(const uint64_t* at, int n);
int64_t og_inject_fired();

// Gradients: drop them (grad = undefined), so a failed step's memory goes back.
void og_clear_grad(void* tensor);

// CUDA, through c10's device-allocator interface (no CUDA headers needed).
int og_cuda_available();
char* og_cuda_set_device(int device);
char* og_cuda_empty_cache();
// out: allocated, reserved, peak_allocated, num_alloc_retries, num_ooms, free, total
char* og_cuda_stats(int device, int64_t* out);
char* og_cuda_reset_peak(int device);
// Waits for the device's queued work (errors from it surface here, as a message).
char* og_cuda_synchronize(int device);
// out: free, total (cudaMemGetInfo); needs no allocation, so it may come before the settings.
char* og_cuda_mem_info(int device, int64_t* out);
char* og_set_allocator_settings(const char* settings);

// Optimiser (csrc/optim.cpp): the allocation-free commit of a fused AdamW update over a
// parameter group (next_steps: the step counts after it, allocated beforehand; found_inf:
// fp16's overflow flag or NULL, the update skipped on the device where it is 1).
char* og_adamw_commit(void** params, void** exp_avgs, void** exp_avg_sqs, void** steps,
                      void** next_steps, int n, double lr, double beta1, double beta2,
                      double weight_decay, double eps, void* found_inf);
// Clips on the device; out: the total norm before clipping, a new 0-dim tensor (no sync).
char* og_clip_grad_norm(void** params, int n, double max_norm, void** out);
char* og_zero_missing_grads(void** params, int n);

// TorchScript (csrc/torchscript.cpp). cuda_index < 0 loads onto the CPU.
typedef void (*og_named_cb)(void* ctx, const char* name, void* tensor);
char* og_ts_load(const char* path, int cuda_index, void** out);
void og_ts_free(void* module);
char* og_ts_list(void* module, int what, void* ctx, og_named_cb cb);
int og_ts_has_method(void* module, const char* name);
char* og_ts_train(void* module, int on);
char* og_ts_call(void* module, const char* method, void* inputs, void* targets, void** out);

// Scalar operations (csrc/ops.cpp), fallible without tch's panicking Scalar temporaries.
char* og_mul_scalar(void* tensor, double v, void** out);
char* og_add_scalar(void* tensor, double v, void** out);
char* og_mul_scalar_(void* tensor, double v);
char* og_arange_like(int64_t end, void* like, void** out);
// CUDA's sync-debug mode (warn), its warnings counted; 0 without a CUDA library.
int og_cuda_sync_debug();
int64_t og_cuda_syncs();

// The GPT's head and cross-entropy fused, in chunks of `chunk` rows (csrc/loss.cpp): hidden
// [N, C], weight [V, C] (its storage padded to vp rows), targets [N]; out: the mean loss.
// tie (or null): from og_tie_new, also given to the tied weight's og_tied_embedding in the
// same graph, whose backward then adds into the head's gradient in place; og_tie_free drops
// the caller's reference (the graph keeps its own).
char* og_fused_linear_ce(void* hidden, void* weight, void* targets, int64_t vp, int64_t chunk, void* tie, void** out);
char* og_tie_new(void** out);
void og_tie_free(void* tie);
char* og_tied_embedding(void* weight, void* idx, void* tie, void** out);

// Mixed precision (csrc/amp.cpp): autocast on the CPU or CUDA (half: 0 bf16, 1 fp16), and
// GradScaler's kernels.
int og_cuda_bf16_native();
char* og_autocast_enter(int cuda, int half, int* was_enabled, int* was_dtype);
char* og_autocast_exit(int cuda, int was_enabled, int was_dtype);
char* og_amp_unscale(void** grads, int n, void* found_inf, void* inv_scale);
char* og_amp_update_scale(void* scale, void* growth_tracker, void* found_inf, double growth, double backoff, int64_t interval);

// Data parallel (csrc/dist.cpp): a c10d group (Gloo when cuda_index < 0, with shared memory
// in front when `shm` and every rank maps it; else NCCL), its collectives (op: 0 sum, 1 max,
// 2 min; in place), and its store.
char* og_dist_init(const char* addr, int port, const char* token, int rank, int world, int cuda_index,
                   const char* gloo_host, int64_t timeout_ms, int shm, void** out);
void og_dist_free(void* group);
const char* og_dist_transport(void* group, const char** note);
char* og_dist_all_reduce(void* group, void** tensors, int n, int op);
char* og_dist_broadcast(void* group, void** tensors, int n, int root);
char* og_dist_store_set(void* group, const char* key, const uint8_t* data, int64_t len);
char* og_dist_store_get(void* group, const char* key, uint8_t** out, int64_t* len);

// Default generator state (csrc/rng.cpp); cuda_index < 0 means the CPU generator.
// get_state returns a new torch::Tensor* the caller owns.
char* og_rng_get_state(int cuda_index, void** out);
char* og_rng_set_state(int cuda_index, void* state);
}

namespace oomguard {
// Test-only: OOMGUARD_TEST_CSRC_FAIL=POINT[,POINT...] makes these points fail as an
// allocation there would: `message` (guarded's copy of an error message), `snap_read`
// (og_snap_read's copies), `snap_hook` (the snapshot's copy at a failed allocation).
// Allocation-free: read where it fails, never on a hot path. Compiled in only with the
// `test-hooks` cargo feature (build.rs defines OG_TEST_HOOKS); otherwise never fails.
#ifndef OG_TEST_HOOKS
inline bool test_fails(const char*) { return false; }
#else
inline bool test_fails(const char* point) {
  const char* spec = std::getenv("OOMGUARD_TEST_CSRC_FAIL");
  if (spec == nullptr) return false;
  const size_t n = std::strlen(point);
  for (const char* p = spec;;) {
    const char* end = std::strchr(p, ',');
    const size_t len = end ? static_cast<size_t>(end - p) : std::strlen(p);
    if (len == n && std::strncmp(p, point, n) == 0) return true;
    if (end == nullptr) return false;
    p = end + 1;
  }
}
#endif

// What guarded returns when the copy of a message cannot be made (malloc failed): static,
// never freed (og_free knows it).
inline char* no_message() {
  static char m[] = "a C++ exception whose message could not be copied (no memory left for it)";
  return m;
}

// Runs f, turning a C++ exception (c10::OutOfMemoryError included) into a message for Rust.
// Null means f returned; whatever f threw is a non-null message, the fixed no_message()
// when even its copy cannot be made. Nothing escapes.
template <typename F>
char* guarded(F&& f) noexcept {
  auto dup = [](const char* m) -> char* {
    const size_t n = std::strlen(m) + 1;
    char* out = test_fails("message") ? nullptr : static_cast<char*>(std::malloc(n));
    if (out == nullptr) return no_message();
    std::memcpy(out, m, n);
    return out;
  };
  try {
    f();
    return nullptr;
  } catch (const std::exception& e) {
    return dup(e.what());
  } catch (...) {
    return dup("unknown C++ exception");
  }
}
}  // namespace oomguard
