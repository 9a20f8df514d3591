"""The eager half of benches/python_model.rs: the same transformers model file
(benches/scripts/gpt2_small.py), trained by a plain PyTorch loop in the same venv on the same
token file and the same samples (SplitMix64 positions of (seed, step), as oomguard draws
them), doing what oomguard's step does: AdamW (betas 0.9/0.95, weight decay 0, fused),
clipping at 1.0. A step is timed from making its batch to the end of its update, as
oomguard's step records are. Prints the median and the fastest tokens/s of steps 2.. and their median step time as JSON.
  py_eager.py MODEL_FILE SETTINGS_JSON TOKENS_DIR BLOCK BATCH STEPS THREADS SEED"""
import importlib.util
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "scripts"))
from ts_reference import positions  # noqa: E402

path, settings, tokens, block, batch, steps, threads, seed = sys.argv[1:9]
block, batch, steps, threads, seed = int(block), int(batch), int(steps), int(threads), int(seed)
spec = importlib.util.spec_from_file_location("model_file", path)
f = importlib.util.module_from_spec(spec)
spec.loader.exec_module(f)
torch.set_num_threads(threads)
torch.manual_seed(seed)
model = f.build(json.loads(settings))
model.train()
data = torch.from_numpy(np.memmap(os.path.join(tokens, "train.bin"), dtype=np.uint16, mode="r").astype(np.int64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
rates, times = [], []
for step in range(steps):
    t = time.perf_counter()
    pos = torch.tensor(positions(seed, step, batch, len(data) - block - 1))
    idx = pos[:, None] + torch.arange(block)
    x, y = data[idx], data[idx + 1]
    loss = f.loss(model, (x, y))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t)
    rates.append(batch * block / times[-1])
rates, times = sorted(rates[2:]), sorted(times[2:])
print(json.dumps({"tokens_per_s": rates[len(rates) // 2], "fastest_tokens_per_s": rates[-1],
                  "step_s": times[len(times) // 2]}))
