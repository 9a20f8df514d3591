"""A guarded script that started at the launcher's micro-batch, grew back to 4x it, and then
died of an out-of-memory error there (first attempt only); a relaunch prints its size and
ends."""
import os
mb = int(os.environ.get("OOMGUARD_MICRO_BATCH_SIZE", "8"))
print(f"oomguard: micro_batch_size={mb}", flush=True)
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    print(f"oomguard: micro-batch {mb} -> {4 * mb} (grew back) from step 9; micro_batch_size={4 * mb}", flush=True)
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.57 GiB of which 1.10 GiB is free.")
