"""Which CPU AdamW benches/scripts/ts_eager.py should use: `step()` of PyTorch's fused,
foreach and single-tensor AdamW over the MU-SOTA bench model's parameters (4 layers, 128-token
windows, the same gradients for each), alternated round by round in one process so that a
busy machine slows all three alike. Prints the median time of each and the ratios.

    .venv/bin/python benches/scripts/adamw_impls.py
"""
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torchscript"))
from mu_sota import MuSota  # noqa: E402

ROUNDS, WARM = 60, 5
torch.set_num_threads(2)
torch.manual_seed(0)
base = MuSota(block_size=128, layers=4)
x = torch.randint(0, 256, (16, 128))
base(x, x.roll(-1, 1)).backward()
impls = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single-tensor": {"foreach": False}}
opts = {}
for name, kw in impls.items():
    m = copy.deepcopy(base)
    for p, q in zip(m.parameters(), base.parameters()):
        p.grad = q.grad.clone()
    opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, **kw)
times = {name: [] for name in impls}
for _ in range(ROUNDS):
    for name, opt in opts.items():
        t = time.perf_counter()
        opt.step()
        times[name].append(time.perf_counter() - t)
med = {name: statistics.median(v[WARM:]) for name, v in times.items()}
print(f"AdamW.step() over {sum(p.numel() for p in base.parameters())} parameters, 2 threads, {ROUNDS} alternated rounds, median of the last {ROUNDS - WARM}")
for name in impls:
    print(f"  {name:13s} {med[name] * 1e3:8.2f} ms (fastest {min(times[name][WARM:]) * 1e3:.2f} ms)")
print(f"  foreach / fused: {med['foreach'] / med['fused']:.2f}x the time; single-tensor / fused: {med['single-tensor'] / med['fused']:.2f}x")
