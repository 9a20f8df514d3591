"""A script the kernel's OOM killer kills on its first attempt: it joins the memory cgroup
OOMTEST_TASKS names (a 64 MiB limit the test set) and touches 16 MiB per sample of its
micro-batch. A relaunch prints its size and ends."""
import os
mb = int(os.environ.get("OOMGUARD_MICRO_BATCH_SIZE", "16"))
print(f"oomguard: micro_batch_size={mb}", flush=True)
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    with open(os.environ["OOMTEST_TASKS"], "w") as f:
        f.write(str(os.getpid()))
    held = bytearray(mb << 24)  # zero-filled: every page touched
print("fits", flush=True)
