"""The eager half of benches/torchscript.rs: the same MU-SOTA model (not scripted), trained by
a plain PyTorch loop on random windows of the embedded-sized vocabulary, doing what oomguard's
step does: AdamW with oomguard's settings (betas 0.9/0.95, the bench's weight decay 0), `impl`
`fused` (the default: faster than `foreach` on the 2-core AVX2 machine, see
docs/measurements/) or `foreach`, clipping at 1.0, `steps` steps of `batch` windows. A step is
timed from making its batch to the end of its update, as oomguard's step records are. Prints
the median and the fastest tokens/s of steps 3.. as JSON."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torchscript"))
from mu_sota import MuSota  # noqa: E402

layers, block, batch, steps, threads = (int(a) for a in sys.argv[1:6])
impl = sys.argv[6] if len(sys.argv) > 6 else "fused"
torch.set_num_threads(threads)
torch.manual_seed(0)
model = MuSota(block_size=block, layers=layers)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, **{impl: True})
rates = []
for _ in range(steps):
    t = time.perf_counter()
    x = torch.randint(0, 256, (batch, block))
    loss = model(x, x.roll(-1, 1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    rates.append(batch * block / (time.perf_counter() - t))
rates = sorted(rates[3:])
print(json.dumps({"tokens_per_s": rates[len(rates) // 2], "fastest_tokens_per_s": rates[-1], "adamw": impl}))
