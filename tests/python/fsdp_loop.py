"""A user's own FSDP2 loop (`fully_shard` on each block and on the root, its own AdamW), with
or without `import oomguard`, optionally under an address-space cap on one rank: the program
the FSDP2 tests run as real Gloo ranks. Writes the final parameters, gathered whole, to --out.

Models: `mlp` (blocks of wide MLPs: activations decide memory, float64 so that results
compare to float rounding) or `gpt2` (transformers' GPT2LMHeadModel from a tiny config, no
download; each transformer block sharded).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

torch.set_num_threads(1)


class Block(torch.nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden, dtype=torch.float64)
        self.down = torch.nn.Linear(hidden, width, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return x + self.down(torch.tanh(h) * torch.sigmoid(h))


class Net(torch.nn.Module):
    def __init__(self, blocks: int, width: int = 16, hidden: int = 1024) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width, hidden) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--guard", action="store_true")
    ap.add_argument("--model", choices=("mlp", "gpt2"), default="mlp")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=256, help="rows per step, all ranks together")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--reshard-after-forward", type=int, default=1)
    ap.add_argument("--cap-mb", type=float, default=None)
    ap.add_argument("--cap-rank", type=int, default=None)
    ap.add_argument("--cap-at-step", type=int, default=1, help="the cap starts before this step (threads and AdamW's state exist)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--compile", action="store_true", help="each block compiled (inductor) before it is sharded")
    ap.add_argument("--guard-step", action="store_true", help="the optimizer's step through guard.optimizer_step")
    ap.add_argument(
        "--calls", type=int, default=1, help="guard.backward calls a step, FSDP2's gradient sync off on all but the last"
    )
    ap.add_argument("--scaler", action="store_true", help="a GradScaler scales the loss and steps the optimizer")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    seq = 16
    if args.model == "mlp":
        net = Net(args.blocks, hidden=args.hidden)
        blocks = list(net.blocks)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=args.blocks, n_head=2, n_embd=32, n_positions=seq, vocab_size=64)
        cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
        net = GPT2LMHeadModel(cfg).double()
        blocks = list(net.transformer.h)
    for b in blocks:
        if args.compile:
            b.compile()  # torchtitan's order: compile each block, then shard it
        fully_shard(b, reshard_after_forward=bool(args.reshard_after_forward))
    fully_shard(net, reshard_after_forward=bool(args.reshard_after_forward))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    rows = args.global_batch // world
    gen = torch.Generator().manual_seed(1)
    scaler = torch.amp.GradScaler("cpu") if args.scaler else None

    def loss_fn(batch):
        if args.model == "mlp":
            return torch.nn.functional.mse_loss(net(batch["x"]), batch["y"])
        return net(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    guard = None
    if args.guard:
        import oomguard

        guard = oomguard.Guard(net, global_batch_size=rows, micro_batch_size=args.micro_batch, run_dir=args.run_dir)
    micro = args.micro_batch or rows
    capped = args.cap_mb is not None and args.cap_rank in (None, rank)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    t0 = time.perf_counter()
    for step in range(args.steps):
        if capped and step == args.cap_at_step:
            resource.setrlimit(resource.RLIMIT_AS, (vm_size() + int(args.cap_mb * (1 << 20)), hard))
        if args.model == "mlp":
            x = torch.randn(args.global_batch, 16, generator=gen, dtype=torch.float64)
            y = x[:, :1].sin() + 0.1 * torch.randn(args.global_batch, 1, generator=gen, dtype=torch.float64)
            batch = {"x": x[rank * rows : (rank + 1) * rows], "y": y[rank * rows : (rank + 1) * rows]}
        else:
            ids = torch.randint(0, 64, (args.global_batch, seq), generator=gen)
            mine = ids[rank * rows : (rank + 1) * rows]
            batch = {"input_ids": mine, "labels": mine.clone()}
        if guard is not None and args.calls > 1:  # the user's own accumulation across calls
            per, loss = rows // args.calls, 0.0
            for i in range(args.calls):
                net.set_requires_gradient_sync(i == args.calls - 1)
                part = {k: v[i * per : (i + 1) * per] for k, v in batch.items()}
                loss += guard.backward(part, lambda b: loss_fn(b) / args.calls, scaler)
        elif guard is not None:
            loss = guard.backward(batch, loss_fn, scaler)
        else:  # the plain loop: accumulation over micro-batches of `micro`, FSDP2 reducing each
            loss = 0.0
            for s in range(0, rows, micro):
                part = {k: v[s : s + micro] for k, v in batch.items()}
                t = loss_fn(part) * (len(part["labels" if "labels" in part else "y"]) / rows)
                (scaler.scale(t) if scaler else t).backward()
                loss += t.item()
        if guard is not None and args.guard_step:
            guard.optimizer_step(opt, scaler)
        elif scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss:.6f}" + (f" micro_batch {guard.micro_batch_size}" if guard else ""), flush=True)
    elapsed = time.perf_counter() - t0
    if capped:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    print(f"train_s {elapsed:.3f}", flush=True)
    full = [p.full_tensor().detach().clone() for p in net.parameters()]
    if args.out and rank == 0:
        torch.save(full, args.out)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
