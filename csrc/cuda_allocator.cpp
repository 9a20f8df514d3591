// The CUDA caching allocator's start (compiled only against a libtorch with CUDA, like
// snapshot_cuda.cpp). Keeps: once a run's allocator settings are applied, the device's
// allocator exists and holds them: libtorch reads per_process_memory_fraction only where it
// creates a device's allocator, and the recorder and OOM observer reach only allocators that
// exist, so all three wait for this.
#include "oomguard.h"

#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>

extern "C" {

// CUDA's lazy start (the caching allocator's devices made), then `fraction` (0 < f <= 1) of
// `device`'s memory as its limit (below 1), whether or not its allocator existed before.
char* og_cuda_start(int device, double fraction) {
  return oomguard::guarded([&] {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    if (fraction < 1.0) {
      c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device));
    }
  });
}

// The limit in force on `device`, as a fraction of its memory.
char* og_cuda_memory_fraction(int device, double* out) {
  return oomguard::guarded([&] {
    *out = c10::cuda::CUDACachingAllocator::getMemoryFraction(static_cast<c10::DeviceIndex>(device));
  });
}

}  // extern "C"
