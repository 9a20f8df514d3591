"""A user's Lightning script: a small regression model (float64) trained by `lightning.Trainer`
on the CPU, as torchrun's ranks (DDP over Gloo) or one process. `--plain`: Lightning's own
automatic optimization with `accumulate_grad_batches` at --micro-batch rows a batch.
Otherwise `oomguard.lightning.GuardedModule`: a step's rows a batch, `guarded_backward` in
`training_step`. Writes the final parameters (--out)."""

from __future__ import annotations

import argparse
import sys
import os

import lightning as L
import torch
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--plain", action="store_true")
ap.add_argument("--rows", type=int, default=32, help="a step's rows on each rank")
ap.add_argument("--micro-batch", type=int, default=16)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--root", required=True)
ap.add_argument("--resume", default=None, help="a checkpoint to resume from")
ap.add_argument("--out", default=None)
a = ap.parse_args()

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
X = torch.randn(1024, 16, generator=g, dtype=torch.float64)
Y = X @ torch.randn(16, 1, generator=g, dtype=torch.float64) + 0.1
data = torch.utils.data.TensorDataset(X, Y)


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).double()


if a.plain:

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

else:
    from oomguard.lightning import GuardedModule

    class Model(GuardedModule):
        oomguard_micro_batch_size = a.micro_batch

        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, idx):
            opt = self.optimizers()
            loss = self.guarded_backward(batch, lambda mb: F.mse_loss(self.net(mb[0]), mb[1]))
            opt.step()
            opt.zero_grad()
            self.print(f"step {self.global_step - 1} loss {float(loss):.6f} micro_batch {self.guard.micro_batch_size}")

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)


world = int(os.environ.get("WORLD_SIZE", "1"))
batch = a.micro_batch if a.plain else a.rows
trainer = L.Trainer(
    accelerator="cpu",
    devices=world,
    strategy="ddp" if world > 1 else "auto",
    max_steps=a.steps,
    accumulate_grad_batches=a.rows // a.micro_batch if a.plain else 1,
    default_root_dir=a.root,
    logger=L.pytorch.loggers.CSVLogger(a.root),
    log_every_n_steps=1,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=True,
)
model = Model()
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False), ckpt_path=a.resume)
if trainer.is_global_zero and a.out:
    torch.save([p.detach().clone() for p in model.parameters()], a.out)

# Everything is written. Leave as a torchrun script does (the group torn down), then without
# the interpreter's teardown: gloo's threads there can abort a rank ("terminate called
# without an active exception", exit -6), with or without oomguard (stop 57's CI: the plain
# Accelerate run); the result is already on disk.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
