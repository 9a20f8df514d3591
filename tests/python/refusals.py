"""What the guard refuses, in one Gloo process (world 1): each case prints one JSON line
{"case", "error", "message"} for test_own_loop.py to read."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import oomguard

torch.set_num_threads(1)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("gloo", rank=0, world_size=1)


def case(name, make):
    try:
        make()
        print(json.dumps({"case": name, "error": None, "message": ""}), flush=True)
    except Exception as e:  # noqa: BLE001 - what the guard raised is the result
        print(json.dumps({"case": name, "error": type(e).__name__, "message": str(e)}), flush=True)


def tensor_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    parallelize_module(m, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel()})
    oomguard.Guard(m, global_batch_size=2)


def fsdp1():
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(torch.nn.Linear(4, 4), device_id=torch.device("cpu"))
    oomguard.Guard(wrapped, global_batch_size=2)


def hsdp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = torch.nn.Linear(4, 4)
    fully_shard(m, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
    oomguard.Guard(m, global_batch_size=2)


def send_in_loss_fn():
    m = torch.nn.Linear(4, 1)
    guard = oomguard.Guard(m, global_batch_size=2, verbose=False)

    def loss_fn(b):
        dist.send(torch.zeros(1), dst=0)
        return m(b).mean()

    before = [p.grad for p in m.parameters()]
    try:
        guard.backward(torch.ones(2, 4), loss_fn)
    finally:
        assert [p.grad for p in m.parameters()] == before


def all_reduce_in_loss_fn():
    # A collective every rank makes is agreed on like FSDP2's: allowed, and it works.
    m = torch.nn.Linear(4, 1)
    guard = oomguard.Guard(m, global_batch_size=2, verbose=False)

    def loss_fn(b):
        n = torch.tensor([float(len(b))])
        dist.all_reduce(n)
        return m(b).sum() / n[0]

    guard.backward(torch.ones(2, 4), loss_fn)


for name, make in [
    ("tensor parallel", tensor_parallel),
    ("fsdp1", fsdp1),
    ("hsdp", hsdp),
    ("send in loss_fn", send_in_loss_fn),
    ("all_reduce in loss_fn", all_reduce_in_loss_fn),
]:
    case(name, make)
dist.destroy_process_group()
