"""`import oomguard` in a plain PyTorch loop: what the guard costs and what one recovery costs.

1. Overhead: the same loop (an MLP, its own AdamW) with `loss.backward()` and with
   `guard.backward(batch, loss_fn)` (whole batch, one micro-batch, metrics.jsonl written),
   alternated in rounds in one process; the ratio of the medians of the rounds' step times
   (goal <= 1.01).
2. One recovery, in steps: the same loop in a subprocess under RLIMIT_AS so the whole batch
   does not fit: the step that ran out, minus a normal step at the size it settled at, over a
   normal step at that size (goal <= 0.5).

Run by `make bench` (the set-up's venv): .venv/bin/python benches/python/own_loop.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
# A micro-batch cache of its own: a recovery the user's cache remembered would start the next
# bench at the settled size, without the OOM it measures.
os.environ["OOMGUARD_CACHE"] = tempfile.mkdtemp(prefix="oomguard-bench-cache-")
import torch  # noqa: E402

import oomguard  # noqa: E402

torch.set_num_threads(1)


def make(width: int, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 10),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def overhead(cost: float, rounds: int = 12, steps: int = 15, batch: int = 64, width: int = 1024) -> None:
    model, opt = make(width)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 256, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def loss_fn(b):
        return torch.nn.functional.cross_entropy(model(b[0]), b[1])

    with tempfile.TemporaryDirectory() as run_dir:
        guard = oomguard.Guard(model, global_batch_size=batch, run_dir=run_dir, verbose=False)

        def plain_step():
            loss = loss_fn((x, y))
            loss.backward()
            loss.item()  # what a loop logs; the guard returns the float too
            opt.step()
            opt.zero_grad(set_to_none=True)

        def guard_step():
            guard.backward((x, y), loss_fn)
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(5):  # warm-up: AdamW's state, the allocator
            plain_step()
            guard_step()
        plain, guarded = [], []
        for r in range(rounds):
            for arm, step, times in (("plain", plain_step, plain), ("guard", guard_step, guarded))[
                :: 1 if r % 2 else -1
            ]:
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                times.append((time.perf_counter() - t0) / steps)
    p, q = statistics.median(plain), statistics.median(guarded)
    print(f"overhead: MLP 256-{width}-{width}-10, batch {batch}, {rounds} rounds x {steps} steps, alternated")
    print(f"  plain loop  median step {p * 1e3:.3f} ms (rounds {min(plain) * 1e3:.3f}..{max(plain) * 1e3:.3f})")
    print(f"  with guard  median step {q * 1e3:.3f} ms (rounds {min(guarded) * 1e3:.3f}..{max(guarded) * 1e3:.3f})")
    print(f"  ratio guard/plain {q / p:.4f} by the medians, {min(guarded) / min(plain):.4f} by the best rounds")
    print("  (goal <= 1.01; the rounds' spread is the machine's noise)")
    print(f"  the guard's own work ({cost * 1e6:.1f} us) is {cost / p:.2%} of the plain step: ratio {1 + cost / p:.4f}")


def own_cost(calls: int = 3000) -> None:
    """The guard's own work per step, apart from the model's: a one-parameter model, so the
    difference between the arms is the guard's bookkeeping (split, scale, policy, record)."""
    w = torch.nn.Parameter(torch.ones(1))
    x = torch.ones(4, 1)

    def loss_fn(b):
        return (b * w).mean()

    with tempfile.TemporaryDirectory() as run_dir:
        guard = oomguard.Guard([w], global_batch_size=4, run_dir=run_dir, verbose=False)
        arms = {
            "plain": lambda: loss_fn(x).backward() or w.grad.sum().item(),
            "guard": lambda: guard.backward(x, loss_fn),
        }
        best = {}
        for _ in range(5):
            for name, f in arms.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                    w.grad = None
                best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) / calls)
    cost = best["guard"] - best["plain"]
    print(f"own cost: a one-parameter model, best of 5 x {calls} calls")
    print(
        f"  plain {best['plain'] * 1e6:.1f} us, guard {best['guard'] * 1e6:.1f} us: "
        f"the guard's own work {cost * 1e6:.1f} us a step"
    )
    return cost


CHILD = r"""
import os, resource, sys, time, json
import torch, oomguard
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
from own_loop import make
cap_mb, batch, width, steps = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model, opt = make(width)
g = torch.Generator().manual_seed(1)
x = torch.randn(batch, 256, generator=g); y = torch.randint(0, 10, (batch,), generator=g)
loss_fn = lambda b: torch.nn.functional.cross_entropy(model(b[0]), b[1])
guard = oomguard.Guard(model, global_batch_size=batch, verbose=False)
for _ in range(2):  # AdamW's state before the cap
    loss_fn((x[:8], y[:8])).backward(); opt.step(); opt.zero_grad(set_to_none=True)
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + int(cap_mb * (1 << 20)), resource.getrlimit(resource.RLIMIT_AS)[1]))
rows = []
for s in range(steps):
    ooms, t0 = guard.policy.num_ooms, time.perf_counter()
    guard.backward((x, y), loss_fn)
    opt.step(); opt.zero_grad(set_to_none=True)
    n = guard.policy.num_ooms - ooms
    rows.append([time.perf_counter() - t0, guard.micro_batch_size, n, guard.last_cleanup_s if n else 0.0])
print(json.dumps(rows))
"""


def recovery(cap_mb: float = 60, batch: int = 4096, width: int = 1024, steps: int = 16) -> None:
    # 60 MiB: the guard fixes glibc's mmap threshold under a cap (docs/own-loop.md), so the
    # batch that ran out 90 MiB above the set-up before 2026-11-26 fits there now.
    here = os.path.abspath(__file__)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, here, str(cap_mb), str(batch), str(width), str(steps)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if out.returncode != 0:
        print(out.stdout, out.stderr)
        raise SystemExit("recovery run failed")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"recovery: MLP 256-{width}-{width}-10, batch {batch}, {steps} steps,")
    print(f"  RLIMIT_AS {cap_mb:.0f} MiB above the set-up's address space")
    costs = []
    for i, (t, size, ooms, cleanup) in enumerate(rows):
        if not ooms:
            continue
        clean = [r[0] for r in rows if r[1] == size and not r[2]]
        if not clean:
            print(f"  step {i}: {ooms} OOM(s), ran at {size}: no step ran at {size} without one, to compare with")
            continue
        normal = statistics.median(clean)
        costs.append((t - normal) / normal / ooms)
        print(
            f"  step {i}: {ooms} OOM(s), ran at {size}: {t * 1e3:.1f} ms against {normal * 1e3:.1f} ms "
            f"for a normal step at {size} (the last cleanup, gc and malloc_trim: {cleanup * 1e3:.1f} ms): "
            f"{costs[-1]:.2f} steps per recovery"
        )
    if not costs:
        raise SystemExit("no OOM: lower the cap")
    print(f"  one recovery costs {statistics.mean(costs):.2f} steps on average (goal <= 0.5)")


if __name__ == "__main__":
    print(f"# torch {torch.__version__}, oomguard {oomguard.__version__}, {torch.get_num_threads()} thread")
    cost = own_cost()
    overhead(cost)
    recovery()
