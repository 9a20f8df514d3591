"""Ranks that differ, as users' data makes them: loss units counted apart (a masked LM), rows
counted apart (FSDP2), DDP syncing BatchNorm's buffers at each forward. Run as torchrun would
(RANK, WORLD_SIZE, MASTER_ADDR/PORT); `--case NAME`. Each rank prints `diff NAME VALUE`: the
largest difference between the guarded step and what it must equal (float64)."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import oomguard

torch.set_default_dtype(torch.float64)


# Every tensor handed to a collective, held to the end: Gloo's worker thread dropping the last
# reference at interpreter exit would need the GIL and abort the process (as `Guard._handed`).
HELD: list = []


def gathered(t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t` (the same shape), concatenated in rank order."""
    parts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    HELD.extend([t, *parts])
    dist.all_gather(parts, t)
    return torch.cat(parts)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def guard(model, n: int, mb: int) -> oomguard.Guard:
    return oomguard.Guard(model, global_batch_size=n, micro_batch_size=mb, verbose=False, cache=False, snapshot=False)


def units(wrap: str) -> None:
    """Rank 0 keeps 3 of its 8 tokens, rank 1 all 8: the gradients must be those of the mean
    over the 11 tokens of both ranks, the same on each rank."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    plain = copy.deepcopy(net)
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net)
    elif wrap == "compiled-ddp":  # PyTorch's recipe: compile the DDP module (aot_eager: no C compiler)
        model = torch.compile(torch.nn.parallel.DistributedDataParallel(net), backend="aot_eager")
    else:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(net)
    torch.manual_seed(10 + rank)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    keep = torch.ones(8, dtype=torch.bool)
    if rank == 0:
        keep[:5] = False

    def loss_fn(b):
        xb, yb, kb = b
        per = F.cross_entropy(model(xb), yb, reduction="none")
        n = int(kb.sum())
        return (per[kb].sum() / max(n, 1), n)

    g = guard(model, 8, 2)
    for _ in range(2):  # the second step weighs by the first's units (FSDP2's: the same everywhere)
        net.zero_grad(set_to_none=True)
        g.backward((x, y, keep), loss_fn)
    X, Y, K = gathered(x), gathered(y), gathered(keep)
    F.cross_entropy(plain(X), Y, reduction="none")[K].mean().backward()
    got = torch.cat([full(p.grad).flatten() for p in net.parameters()])
    want = torch.cat([p.grad.flatten() for p in plain.parameters()])
    print(f"diff units-{wrap} {(got - want).abs().max().item():.3e}", flush=True)
    print(f"diff units-{wrap}-ranks {(gathered(got)[: got.numel()] - gathered(got)[got.numel():]).abs().max().item():.3e}")


def units_nosync() -> None:
    """FSDP2 with loss units and the user's own accumulation across calls (the sync off
    for the first): the waiting gradients cannot be divided by their call's units, so every
    rank refuses, naming the way that works, none left waiting."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model = fully_shard(net)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def loss_fn(b):
        per = F.cross_entropy(model(b[0]), b[1], reduction="none")
        return (per.sum() / len(per), len(per))

    g = guard(model, 8, 2)
    model.set_requires_gradient_sync(False)
    try:
        g.backward((x, y), loss_fn)
    except ValueError as e:
        print(f"refused {e}", flush=True)


def rows(short: bool) -> None:
    """FSDP2, rank 0 with 6 rows and rank 1 with 4 (or 2): at micro-batches of 2 every rank
    runs 3, and the step equals plain FSDP2's (each rank's mean, averaged); with 2 rows a rank
    cannot run 3, and every rank is refused, none left waiting."""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    plain = fully_shard(copy.deepcopy(net))
    model = fully_shard(net)
    n = 6 if rank == 0 else (2 if short else 4)
    torch.manual_seed(10 + rank)
    x, y = torch.randn(n, 4), torch.randn(n, 1)
    g = guard(model, 8, 2)
    try:
        loss = g.backward((x, y), lambda b: F.mse_loss(model(b[0]), b[1]))
    except ValueError as e:
        print(f"refused {e}", flush=True)
        return
    F.mse_loss(plain(x), y).backward()
    got = torch.cat([full(p.grad).flatten() for p in net.parameters()])
    want = torch.cat([full(p.grad).flatten() for p in plain.parameters()])
    print(f"diff rows {(got - want).abs().max().item():.3e}", flush=True)
    print(f"diff rows-loss {abs(loss - F.mse_loss(net(x), y).item()):.3e}", flush=True)
    evaluated = g.evaluate((x, y), lambda b: F.mse_loss(model(b[0]), b[1]))
    print(f"diff rows-eval {abs(evaluated - F.mse_loss(plain(x), y).item()):.3e}", flush=True)


def ddp_pair():
    """The same small net twice, each under DDP: (net, plain_net, ddp(net), ddp(plain_net))."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    plain_net = copy.deepcopy(net)
    ddp = torch.nn.parallel.DistributedDataParallel
    return net, plain_net, ddp(net), ddp(plain_net)


def print_diff(name: str, net, plain_net) -> None:
    """`diff NAME X`: the largest difference between the two nets' gradients."""
    got = torch.cat([p.grad.flatten() for p in net.parameters()])
    want = torch.cat([p.grad.flatten() for p in plain_net.parameters()])
    print(f"diff {name} {(got - want).abs().max().item():.3e}", flush=True)


def rows_ddp() -> None:
    """DDP, rank 0 with 6 rows and rank 1 with 4, and a collective of the user's own in
    `loss_fn` (a count all-reduced, as a token count is): at micro-batches of 2 every rank runs
    3, so each rank's all_reduce meets its peer's (with 3 against 2 they met the other rank's
    vote or gradient sum instead); the step equals plain DDP's, each rank's mean averaged."""
    rank = dist.get_rank()
    net, plain_net, model, plain = ddp_pair()
    n = 6 if rank == 0 else 4
    torch.manual_seed(10 + rank)
    x, y = torch.randn(n, 4), torch.randn(n, 1)
    counts = []

    def loss_fn(b):
        count = torch.tensor([float(len(b[0]))])
        HELD.append(count)
        dist.all_reduce(count)
        counts.append(count.item())
        return F.mse_loss(model(b[0]), b[1])

    guard(model, 8, 2).backward((x, y), loss_fn)
    F.mse_loss(plain(x), y).backward()
    print_diff("rows-ddp", net, plain_net)
    print(f"counts {counts}", flush=True)


def freed() -> None:
    """DDP, a weight larger than a gradient bucket (summed in place, in `.grad` itself): after
    the optimizer's step, `zero_grad(set_to_none=True)` frees it, as under plain DDP, before
    an evaluation or a save (the guard held it to the next step)."""
    import gc
    import weakref

    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = guard(model, 8, 4)
    x, y = torch.randn(8, 1024), torch.randn(8, 1)
    g.backward((x, y), lambda b: F.mse_loss(model(b[0]), b[1]))
    opt.step()
    grad = weakref.ref(net[0].weight.grad)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    print(f"freed {grad() is None}", flush=True)


def raw_ddp() -> None:
    """nanoGPT's pattern: `model = DDP(net); raw_model = model.module`, the guard given
    `raw_model` and `loss_fn` calling `model`. An OOM in rank 1's backward: the guard runs the
    wrapper under `no_sync()` (its all-reduces in every backward once met the failed rank's
    vote), and the step equals plain DDP's."""
    rank = dist.get_rank()
    net, plain_net, model, plain = ddp_pair()
    raw_model = model.module
    torch.manual_seed(10 + rank)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    os.environ["OOMGUARD_TEST_OOM_AT"] = "1:0:backward"
    guard(raw_model, 8, 4).backward((x, y), lambda b: F.mse_loss(model(b[0]), b[1]))
    F.mse_loss(plain(x), y).backward()
    print_diff("raw-ddp", net, plain_net)


def nograd() -> None:
    """FSDP2 over blocks and a root, with forwards under no_grad (a sanity check before the
    guard is made, an evaluation after each step), which leave the root unsharded: an OOM in
    backward on rank 1, then a step with loss units counted apart, equal plain FSDP2's."""
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()

    def make():
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
        )
        fully_shard(net[2])
        return fully_shard(net)

    net, plain = make(), make()
    torch.manual_seed(10 + rank)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    keep = torch.rand(8) < (0.4 if rank == 0 else 0.9)
    for m in (net, plain):
        with torch.no_grad():
            m(x)
    os.environ["OOMGUARD_TEST_OOM_AT"] = "1:0:backward"
    g = guard(net, 8, 8)
    for step in range(2):
        for m in (net, plain):
            m.zero_grad(set_to_none=True)
        if step == 0:
            g.backward((x, y), lambda b: F.cross_entropy(net(b[0]), b[1]))
            F.cross_entropy(plain(x), y).backward()
        else:

            def loss_fn(b):
                n = b[2].sum()
                return F.cross_entropy(net(b[0])[b[2]], b[1][b[2]], reduction="sum") / n.clamp(min=1), n

            g.backward((x, y, keep), loss_fn)
            total = keep.sum().double()
            dist.all_reduce(total)
            (F.cross_entropy(plain(x)[keep], y[keep], reduction="sum") / (total / world)).backward()
        got = torch.cat([full(p.grad).flatten() for p in net.parameters()])
        want = torch.cat([full(p.grad).flatten() for p in plain.parameters()])
        print(f"diff nograd {(got - want).abs().max().item():.3e}", flush=True)
        for m in (net, plain):
            with torch.no_grad():
                m(x)


def buffers() -> None:
    """DDP syncing buffers at each forward (BatchNorm's running statistics): three guarded
    steps leave them where three plain DDP steps do, on every rank."""
    rank = dist.get_rank()
    ends = []
    for guarded in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        try:
            ddp = torch.nn.parallel.DistributedDataParallel(net, forward_sync_buffers=True)
        except TypeError:  # before torch 2.13: broadcast_buffers, True by default
            ddp = torch.nn.parallel.DistributedDataParallel(net)
        g = guard(ddp, 8, 8) if guarded else None
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            torch.manual_seed(100 * step + rank)
            x, y = torch.randn(8, 4) + rank, torch.randn(8, 1)
            if g is not None:
                g.backward((x, y), lambda b: F.mse_loss(ddp(b[0]), b[1]))
            else:
                F.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        ends.append(torch.cat([b.flatten().double() for b in net.buffers()] + [p.detach().flatten() for p in net.parameters()]))
    print(f"diff buffers {(ends[0] - ends[1]).abs().max().item():.3e}", flush=True)


def bad_first() -> None:
    """The first step: rank 1 hands over too many rows (ValueError), rank 0 reads that in the
    micro-batch cache's vote; both catch it and go on, and the next step runs on both alike."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    g = oomguard.Guard(ddp, global_batch_size=8, micro_batch_size=8, verbose=False, snapshot=False)
    step = lambda b: F.mse_loss(ddp(b[0]), b[1])  # noqa: E731
    rows = 16 if rank == 1 else 8
    try:
        g.backward((torch.randn(rows, 4), torch.randn(rows, 1)), step)
    except (ValueError, RuntimeError) as e:
        print(f"stopped {type(e).__name__}", flush=True)
    torch.manual_seed(10 + rank)
    g.backward((torch.randn(8, 4), torch.randn(8, 1)), step)
    grads = torch.cat([p.grad.flatten() for p in net.parameters()])
    both = gathered(grads)
    print(f"diff bad-first {(both[: grads.numel()] - both[grads.numel():]).abs().max().item():.3e}", flush=True)


def comm_hook() -> None:
    """A DDP communication hook (fp16 compression) is named as not run, and the guarded step
    gives the plain, uncompressed average."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1).double()
    plain = copy.deepcopy(net)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    g = guard(ddp, 8, 4)
    torch.manual_seed(10 + rank)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    g.backward((x, y), lambda b: F.mse_loss(ddp(b[0]), b[1]))
    F.mse_loss(plain(x), y).backward()
    for p in plain.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    got = torch.cat([p.grad.flatten() for p in net.parameters()])
    want = torch.cat([p.grad.flatten() for p in plain.parameters()])
    print(f"diff comm-hook {(got - want).abs().max().item():.3e}", flush=True)


CHATTER = 400


def background() -> None:
    """A thread of the user's own runs collectives on a group of its own (as `dcp.async_save`
    does) all through three guarded DDP steps, one of them redone after an OOM on rank 1: its
    collectives are not the attempt's, so they pass unvoted, and the steps equal plain DDP's."""
    import threading

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    plain = copy.deepcopy(net)
    ddp, plain_ddp = torch.nn.parallel.DistributedDataParallel(net), torch.nn.parallel.DistributedDataParallel(plain)
    g = guard(ddp, 8, 8)
    side = dist.new_group(backend="gloo")
    sums: list = []

    def chatter() -> None:
        # As many on each rank, so that every one is matched, spanning the steps.
        for _ in range(CHATTER):
            t = torch.ones(1)
            HELD.append(t)
            dist.all_reduce(t, group=side)
            sums.append(t.item())
            time.sleep(0.001)

    def slow(b):
        time.sleep(0.03)  # an attempt long enough for the thread's collectives to land in it
        return F.mse_loss(ddp(b[0]), b[1])

    th = threading.Thread(target=chatter)
    th.start()
    opt, plain_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        g.backward((x, y), slow)
        F.mse_loss(plain_ddp(x), y).backward()
        for o in (opt, plain_opt):
            o.step()
            o.zero_grad()
    overlapped = len(sums) < CHATTER  # the steps ended while the thread still ran
    th.join()
    got = torch.cat([p.detach().flatten() for p in net.parameters()])
    want = torch.cat([p.detach().flatten() for p in plain.parameters()])
    assert set(sums) == {float(dist.get_world_size())}, set(sums)
    print(f"diff background {(got - want).abs().max().item():.3e} ooms {g.oom_count} overlapped {overlapped}", flush=True)


def slow_rank() -> None:
    """Rank 0 spends SLOW_S seconds alone between two steps (a save or an evaluation of its
    own), while rank 1 waits in the next step's first vote: as long as the process group's
    timeout, as a collective would. Prints `done` or `stopped TYPE: MESSAGE`, then exits
    (a timed-out group cannot meet at a barrier)."""
    import time

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    g = oomguard.Guard(ddp, global_batch_size=8, micro_batch_size=4, verbose=False, snapshot=False, cache=False)
    step = lambda b: F.mse_loss(ddp(b[0]), b[1])  # noqa: E731
    try:
        g.backward((torch.randn(8, 4), torch.randn(8, 1)), step)
        if rank == 0:
            time.sleep(float(os.environ["SLOW_S"]))
        g.backward((torch.randn(8, 4), torch.randn(8, 1)), step)
        print(f"done {rank}", flush=True)
    except Exception as e:  # noqa: BLE001 - what stopped it is the output
        print(f"stopped {type(e).__name__}: {e}", flush=True)
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    case = ap.parse_args().case
    import datetime

    # The group's timeout, when the test sets one (else torch's default).
    given = os.environ.get("PG_TIMEOUT_S")
    dist.init_process_group("gloo", **({"timeout": datetime.timedelta(seconds=float(given))} if given else {}))
    {
        "units-ddp": lambda: units("ddp"),
        "units-fsdp": lambda: units("fsdp"),
        "units-compiled-ddp": lambda: units("compiled-ddp"),
        "units-fsdp-nosync": units_nosync,
        "rows": lambda: rows(False),
        "rows-short": lambda: rows(True),
        "rows-ddp": rows_ddp,
        "freed": freed,
        "raw-ddp": raw_ddp,
        "buffers": buffers,
        "nograd": nograd,
        "bad-first": bad_first,
        "comm-hook": comm_hook,
        "slow-rank": slow_rank,
        "background": background,
    }[case]()
    dist.barrier()
    dist.destroy_process_group()
    # Then without the interpreter's teardown, where Gloo's threads can abort a rank after
    # everything is printed (as tests/python/hf_train.py ends).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
