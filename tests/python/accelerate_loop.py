"""A user's Accelerate loop (GPT-2 from a tiny config, float64, fixed-length token rows), as
torchrun's ranks or one process. `--plain`: Accelerate's own gradient accumulation
(`accumulate`, `accelerator.backward`) at --micro-batch rows a backward. Otherwise the guard:
each step's rows in one batch, `guard.backward` inside Accelerate's prepared DDP model.
Writes the final parameters (--out)."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import transformers
from accelerate import Accelerator

ap = argparse.ArgumentParser()
ap.add_argument("--plain", action="store_true")
ap.add_argument("--rows", type=int, default=16, help="a step's rows on each rank")
ap.add_argument("--micro-batch", type=int, default=8)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--run-dir", default=None)
ap.add_argument("--out", default=None)
a = ap.parse_args()

torch.manual_seed(0)
cfg = transformers.GPT2Config(
    vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)
model = transformers.GPT2LMHeadModel(cfg).double()
ids = torch.randint(0, 256, (512, 16), generator=torch.Generator().manual_seed(1))
rows = [{"input_ids": r, "labels": r.clone()} for r in ids]
accumulation = a.rows // a.micro_batch if a.plain else 1
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
loader = torch.utils.data.DataLoader(rows, batch_size=a.micro_batch if a.plain else a.rows)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

if a.plain:
    batches = iter(loader)
    for step in range(a.steps):
        for _ in range(accumulation):
            with accelerator.accumulate(model):
                accelerator.backward(model(**next(batches)).loss)
                optimizer.step()
                optimizer.zero_grad()
else:
    import oomguard

    guard = oomguard.Guard(model, global_batch_size=a.rows, micro_batch_size=a.micro_batch, run_dir=a.run_dir)
    for step, batch in zip(range(a.steps), loader):
        loss = guard.backward(batch, lambda mb: model(**mb).loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step} loss {loss:.6f} micro_batch {guard.micro_batch_size}")
if accelerator.is_main_process and a.out:
    torch.save([p.detach().clone() for p in accelerator.unwrap_model(model).parameters()], a.out)

# Everything is written. Leave as a torchrun script does (the group torn down), then without
# the interpreter's teardown: gloo's threads there can abort a rank ("terminate called
# without an active exception", exit -6), with or without oomguard (stop 57's CI: the plain
# Accelerate run); the result is already on disk.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
