"""A user's DDP loop (gloo) where rank 1's loss asks for 256 GiB a sample: no micro-batch
fits there. The guard halves to 1 on both ranks, then raises oomguard.Infeasible, whose
traceback torch's process-group excepthook prints behind `[rank1]: `."""

import os

import torch

import oomguard

torch.manual_seed(0)
torch.set_num_threads(1)
torch.distributed.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(batch):
    x, y = batch
    if os.environ["RANK"] == "1":
        torch.empty(len(x), 2**36)
    return torch.nn.functional.mse_loss(model(x), y)


guard = oomguard.Guard(model, global_batch_size=8, cache=False)
x = torch.randn(8, 16)
for step in range(2):
    guard.backward((x, x.sum(1, keepdim=True)), loss_fn)
    opt.step()
    opt.zero_grad(set_to_none=True)
