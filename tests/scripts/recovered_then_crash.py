"""Recovers from an out-of-memory error (its traceback on stderr, as a script that catches
it prints it), then fails for another reason on the first attempt; fine on the next."""
import os, sys, traceback
mb = int(os.environ.get("OOMGUARD_MICRO_BATCH_SIZE", "16"))
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"attempt {attempt} micro_batch_size={mb}", flush=True)
try:
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.57 GiB of which 1.10 GiB is free.")
except RuntimeError:
    traceback.print_exc()
    print(f"recovered: retrying the step at micro_batch_size={mb // 2} with twice the accumulation", file=sys.stderr, flush=True)
if attempt == "0":
    raise ValueError("the data loader lost its file")
