"""A plain PyTorch-style script: says its micro-batch with print (stdout), then dies of an
out-of-memory error unless it is small enough."""
import os
mb = int(os.environ.get("OOMGUARD_MICRO_BATCH_SIZE", "256"))
print(f"micro_batch_size={mb}", flush=True)
if mb > 64:
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.57 GiB of which 1.10 GiB is free.")
