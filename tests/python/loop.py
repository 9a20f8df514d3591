"""A user's own training loop (its own AdamW), with or without `import oomguard`, optionally
under an address-space cap (RLIMIT_AS, as a small host would be): the program the tests run
in real subprocesses. Writes the final parameters to --out (torch.save of a list).

Data parallel when WORLD_SIZE > 1 (Gloo, from the launcher's or torchrun's environment):
the model is wrapped in DistributedDataParallel and each rank takes its rows of the batch.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch

torch.set_num_threads(1)

WIDTH = 2048


class Net(torch.nn.Module):
    """Wide and cheap: activations of WIDTH doubles per sample (several saved for backward),
    few parameters, so the micro-batch decides memory and the step stays fast."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, WIDTH, dtype=torch.float64)
        self.down = torch.nn.Linear(WIDTH, 1, dtype=torch.float64)
        self.norm = torch.nn.BatchNorm1d(16, dtype=torch.float64) if batchnorm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        h = self.up(x)
        h = torch.tanh(h) * torch.sigmoid(h) + h * 0.1
        return self.down(h)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--guard", action="store_true", help="backward through oomguard.Guard")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=1024, help="rows per step, all ranks together")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--cap-mb", type=float, default=None, help="RLIMIT_AS: this much above the VM size after set-up")
    ap.add_argument("--cap-rank", type=int, default=None, help="the cap on this rank only (default: every rank)")
    ap.add_argument("--sample-mb", type=float, default=0.0, help="loss_fn allocates this much per sample besides")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument(
        "--oom-outside-at",
        type=int,
        default=None,
        help="the first attempt dies of an OOM at this step, outside the guard",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--checkpoint",
        default=None,
        help="rank 0 saves the state here after each step; a start resumes from it (an elastic round)",
    )
    ap.add_argument("--step-pause", type=float, default=0.0, help="seconds of sleep before each step")
    ap.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d first (DDP broadcasts its buffers)")
    ap.add_argument("--error-at", default=None, help="rank:step: loss_fn raises ValueError there (not an OOM)")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = Net(args.batchnorm)
    model = net
    if world > 1:
        # DDP's default broadcast_buffers=True: rank 0's buffers are broadcast at each forward.
        model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    rows = args.global_batch // world
    gen = torch.Generator().manual_seed(1)

    error_rank, error_step = map(int, args.error_at.split(":")) if args.error_at else (-1, -1)
    current = {"step": 0}

    def loss_fn(batch):
        x, y = batch
        if rank == error_rank and current["step"] == error_step:
            raise ValueError(f"a bug in rank {rank}'s loss_fn at step {error_step}")
        if args.sample_mb:
            # Memory that scales with the micro-batch and is really touched.
            torch.ones(int(x.shape[0] * args.sample_mb * (1 << 20) / 8), dtype=torch.float64).sum()
        return torch.nn.functional.mse_loss(model(x), y)

    guard = None
    if args.guard:
        import oomguard

        guard = oomguard.Guard(
            model, global_batch_size=rows, micro_batch_size=args.micro_batch, run_dir=args.run_dir, tokens_per_sample=1
        )
    capped = args.cap_mb is not None and args.cap_rank in (None, rank)
    if capped:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + int(args.cap_mb * (1 << 20)), hard))
    first = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        # A later round of an elastic job (any world): the state the last finished step left.
        state = torch.load(args.checkpoint)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        if guard is not None:
            guard.load_state_dict(state["guard"])
        first = state["step"]
        print(f"resumed at step {first} on {world} rank(s)", flush=True)
    t0 = time.perf_counter()
    for step in range(first, args.steps):
        current["step"] = step
        time.sleep(args.step_pause)
        x = torch.randn(args.global_batch, 16, generator=gen, dtype=torch.float64)
        y = x[:, :1].sin() + 0.1 * torch.randn(args.global_batch, 1, generator=gen, dtype=torch.float64)
        mine = (x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
        if guard is not None:
            loss = guard.backward(mine, loss_fn)
        else:
            t = loss_fn(mine)
            t.backward()
            loss = t.item()
        if step == args.oom_outside_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            # Where no guard is: the launcher's relaunch at half the micro-batch is the fallback.
            raise RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4194304 bytes. "
                "Error code 12 (Cannot allocate memory)"
            )
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.checkpoint and rank == 0:
            state = {"step": step + 1, "net": net.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state()}
            if guard is not None:
                state["guard"] = guard.state_dict()
            torch.save(state, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
        print(f"step {step} loss {loss:.6f}" + (f" micro_batch {guard.micro_batch_size}" if guard else ""), flush=True)
    elapsed = time.perf_counter() - t0
    if capped:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    print(f"train_s {elapsed:.3f}", flush=True)
    if args.out and rank == 0:
        torch.save([t.detach().clone() for t in [*net.parameters(), *net.buffers()]], args.out)
    if guard is not None:
        guard.close()  # the trackers' runs end (os._exit below skips atexit)
    # Everything is written: leave without the interpreter's teardown. A Gloo rank that ran
    # out of memory inside the guard sometimes aborts there ("terminate called without an
    # active exception", exit -6), destroy_process_group or not; cause not yet found.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
