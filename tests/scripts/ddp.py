"""A real torch.distributed job: gloo, env:// rendezvous, DDP and all_reduce.
Each rank prints one JSON line with what it saw."""
import json, os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
x = torch.full((8, 4), float(rank + 1))
model(x).sum().backward()
torch.optim.SGD(model.parameters(), lr=0.1).step()
keys = ["RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS"]
import sys
sys.stdout.write("RESULT " + json.dumps({
    "env": {k: os.environ.get(k) for k in keys},
    "has_error_file": bool(os.environ.get("TORCHELASTIC_ERROR_FILE")),
    "rank": rank, "world": world, "all_reduce": t.item(),
    "weight": [round(v, 6) for v in model.module.weight.detach().flatten().tolist()],
}, sort_keys=True) + "\n")  # one write: less interleaving
sys.stdout.flush()
dist.barrier()  # both ranks done before gloo tears down
dist.destroy_process_group()
# torch 2.13's Gloo sometimes aborts in interpreter teardown even after destroy_process_group
# ("terminate called without an active exception", -6, under torchrun as under oomguard launch):
# the results are out, so both launchers' workers leave without it.
os._exit(0)
