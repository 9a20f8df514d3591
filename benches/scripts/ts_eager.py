"""The eager half of benches/torchscript.rs: the same MU-SOTA model (not scripted), trained by
a plain PyTorch loop on random windows of the embedded-sized vocabulary: AdamW (fused=False,
foreach, as on the CPU), clipping, `steps` steps of `batch` windows. Prints the median
tokens/s of steps 3.. as JSON."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torchscript"))
from mu_sota import MuSota  # noqa: E402

layers, block, batch, steps, threads = (int(a) for a in sys.argv[1:6])
torch.set_num_threads(threads)
torch.manual_seed(0)
model = MuSota(block_size=block, layers=layers)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
rates = []
for _ in range(steps):
    x = torch.randint(0, 256, (batch, block))
    t = time.perf_counter()
    loss = model(x, x.roll(-1, 1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    rates.append(batch * block / (time.perf_counter() - t))
rates = sorted(rates[3:])
print(json.dumps({"tokens_per_s": rates[len(rates) // 2]}))
