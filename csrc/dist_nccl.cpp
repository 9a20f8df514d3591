// ProcessGroupNCCL for data-parallel training on CUDA. It compiles always (nccl.h and the
// CUDA headers come with the pip nvidia packages) and runs where a GPU is present.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

c10::intrusive_ptr<c10d::Backend> og_make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                               std::chrono::milliseconds timeout) {
  auto o = c10d::ProcessGroupNCCL::Options::create();
  o->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, o);
}
