"""A user's loop whose own `opt.step()` runs out of memory: AdamW makes its state (two copies
of a 16 MiB parameter) on the first step, under an address-space cap a few MiB above the
process's. The guard is in the loop (for the backward); the optimizer's step is not guarded."""

import resource

import torch

import oomguard

torch.set_num_threads(1)
m = torch.nn.Linear(2048, 2048)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
guard = oomguard.Guard(m, global_batch_size=4, cache=False)
x = torch.randn(4, 2048)
guard.backward(x, lambda b: m(b).square().mean())
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (8 << 20), resource.RLIM_INFINITY))
print(f"micro_batch_size={guard.micro_batch_size}", flush=True)
opt.step()
