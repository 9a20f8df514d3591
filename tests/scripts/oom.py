"""Dies of an out-of-memory error unless OOMGUARD_MICRO_BATCH_SIZE is small enough."""
import os
mb = int(os.environ["OOMGUARD_MICRO_BATCH_SIZE"])
print(f"rank {os.environ['RANK']} micro-batch {mb}", flush=True)
if mb > 4:
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.57 GiB of which 1.10 GiB is free.")
