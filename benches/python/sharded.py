"""`import oomguard` in data-parallel loops on two Gloo ranks: DDP and FSDP2 (`fully_shard` on each
block and the root). What the guard costs a step, what one recovery costs, and the guard's
peak memory against the plain loop's.

1. Overhead: in the same two processes, the plain loop (FSDP2: each micro-batch's backward
   reduce-scattered as FSDP2 does; DDP: `no_sync()` but for the last micro-batch) and the
   guarded one, alternated in rounds; the ratio of the medians of the rounds' step times
   (goal <= 1.01), the guard's checkpoints a step with their time, and one vote's own cost
   (votes back to back) times the votes a step, over the plain step: the part of the ratio
   the rounds' spread on 2 shared cores cannot resolve.
2. One recovery, in steps: an OOM on rank 1 (the guard's hook) in step 8, after its first
   micro-batch's backward (where an OOM at the larger size comes) and after its last (the
   worst place: the whole attempt is lost); that step's time less a normal step at the size
   it settled at, over a normal step (goal <= 0.5).
3. Peak memory: each arm in fresh processes, the rise of its peak resident memory (VmHWM,
   reset once the model and AdamW exist) over the same steps, guard over plain (goal <= 1.02).

Run by `make bench`: .venv/bin/python benches/python/sharded.py [--quick]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

WIDTH, HIDDEN, BLOCKS = 512, 2048, 4
ROWS, MICRO = 64, 32  # a rank's rows a step, and the micro-batch (2 a step)


def model(wrap: str):
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Linear(HIDDEN, WIDTH)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    net = torch.nn.Sequential(*[Block() for _ in range(BLOCKS)], torch.nn.Linear(WIDTH, 1))
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in list(net)[:BLOCKS]:
            fully_shard(b)
        fully_shard(net)
        return net, net
    return net, torch.nn.parallel.DistributedDataParallel(net, process_group=dist.group.WORLD)


def worker(wrap: str, task: str, arm: str, steps: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import oomguard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net, wrapped = model(wrap)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randn(ROWS, WIDTH, generator=gen), torch.randn(ROWS, 1, generator=gen)) for _ in range(8)]

    def loss_fn(b):
        return torch.nn.functional.mse_loss(wrapped(b[0]), b[1])

    run_dir = tempfile.mkdtemp(prefix="oomguard-bench-run-")
    guard = oomguard.Guard(wrapped, global_batch_size=ROWS, micro_batch_size=MICRO, run_dir=run_dir, verbose=False)

    def plain_step(i):
        x, y = batches[i % len(batches)]
        for s in range(0, ROWS, MICRO):
            last = s + MICRO >= ROWS
            ctx = wrapped.no_sync() if wrap == "ddp" and not last else _Null()
            with ctx:
                (loss_fn((x[s : s + MICRO], y[s : s + MICRO])) * (MICRO / ROWS)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def guard_step(i):
        guard.backward(batches[i % len(batches)], loss_fn)
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {}
    if task == "overhead":
        for i in range(3):  # warm-up: AdamW's state, the allocator
            plain_step(i)
            guard_step(i)
        plain, guarded = [], []
        for r in range(rounds):
            for step, times in ((plain_step, plain), (guard_step, guarded))[:: 1 if r % 2 else -1]:
                dist.barrier()
                t0 = time.perf_counter()
                for i in range(steps):
                    step(i)
                times.append((time.perf_counter() - t0) / steps)
        # What one vote costs apart from waiting for the slower rank: votes back to back.
        from oomguard._native import vote

        ranks_ = guard._ranks
        for _ in range(50):
            ranks_.vote(vote(rank))
        t0 = time.perf_counter()
        for _ in range(500):
            ranks_.vote(vote(rank))
        vote_s = (time.perf_counter() - t0) / 500
        recs = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))] if rank == 0 else []
        steps_recs = [r for r in recs if r.get("event") == "step"]
        out = {
            "plain": plain,
            "guard": guarded,
            "checkpoints": statistics.median([r.get("checkpoints", 0) for r in steps_recs]) if steps_recs else 0,
            "agree_s": statistics.median([r.get("agree_s", 0.0) for r in steps_recs]) if steps_recs else 0,
            "vote_s": vote_s,
        }
    elif task == "recovery":
        times = []
        for i in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            guard_step(i)
            times.append(time.perf_counter() - t0)
        out = {"times": times, "settled": guard.micro_batch_size}
    elif task == "peak":
        step = guard_step if arm == "guard" else plain_step
        step(0)  # AdamW's state exists in both arms before the peak is reset
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM starts again from VmRSS (Linux >= 4.0)
        base = _status("VmRSS")
        for i in range(1, steps):
            step(i)
        out = {"rise_kib": _status("VmHWM") - base}
    rises = [None] * dist.get_world_size()
    dist.all_gather_object(rises, out.get("rise_kib"))
    if rank == 0:
        out["rise_kib_ranks"] = rises
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def ranks(wrap: str, task: str, arm: str = "", steps: int = 10, rounds: int = 8, env=None) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        e = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_TEST")}
        e.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        e.update(OMP_NUM_THREADS="1", OOMGUARD_CACHE=tempfile.mkdtemp(prefix="oomguard-bench-cache-"), **(env or {}))
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", wrap, task, arm or "-", str(steps), str(rounds)],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, o in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"a {wrap} {task} rank failed:\n{o}")
    line = next(l for l in outs[0].splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main(quick: bool) -> None:
    import torch

    rounds, steps = (4, 4) if quick else (10, 8)
    print(f"two Gloo ranks on this machine, torch {torch.__version__}; a rank: {BLOCKS} blocks {WIDTH}-{HIDDEN}-{WIDTH}")
    print(f"(+ a head), {ROWS} rows a step in micro-batches of {MICRO}, float32, AdamW, one thread each")
    for wrap in ("ddp", "fsdp2"):
        r = ranks(wrap, "overhead", steps=steps, rounds=rounds)
        p, q = statistics.median(r["plain"]), statistics.median(r["guard"])
        print(f"\n{wrap}: overhead, {rounds} rounds x {steps} steps, alternated in the same processes")
        print(f"  plain loop  median step {p * 1e3:.1f} ms (rounds {min(r['plain']) * 1e3:.1f}..{max(r['plain']) * 1e3:.1f})")
        print(f"  with guard  median step {q * 1e3:.1f} ms (rounds {min(r['guard']) * 1e3:.1f}..{max(r['guard']) * 1e3:.1f})")
        print(f"  ratio guard/plain {q / p:.4f} by the medians, {min(r['guard']) / min(r['plain']):.4f} by the best rounds (goal <= 1.01)")
        print(f"  checkpoints a step {r['checkpoints']:.0f}, their time {r['agree_s'] * 1e3:.2f} ms a step ({r['agree_s'] / q:.2%}),")
        print("  waiting for the slower rank included (the plain loop waits as long in the collective itself)")
        votes = r["checkpoints"] + 1  # and the attempt's own vote
        own = votes * r["vote_s"]
        print(f"  one vote back to back: {r['vote_s'] * 1e6:.0f} us; {votes:.0f} a step are {own * 1e3:.2f} ms, {own / p:.2%} of")
        print(f"  the plain step: ratio {1 + own / p:.4f} (the A/B's rounds spread {max(r['plain']) / min(r['plain']) - 1:.0%} here)")
        # Where an OOM at the larger size comes (its first micro-batch's backward, at the
        # peak), and the worst place (after the last backward: the whole attempt is lost).
        for where, spec in (("step 8's first backward", "1:8:backward"), ("after step 8's last backward", "1:8:backward:2")):
            rec = ranks(wrap, "recovery", steps=14, env={"OOMGUARD_TEST_OOM_AT": spec})
            t = rec["times"]
            normal = statistics.median(t[9:])
            cost = (t[8] - normal) / normal
            print(f"{wrap}: one recovery (rank 1, {where}): step 8 took {t[8] * 1e3:.1f} ms, a normal step")
            print(f"  at {rec['settled']} {normal * 1e3:.1f} ms: the recovery cost {cost:.2f} steps (goal <= 0.5)")
        # Every buffer of 64 KiB and more mapped on its own and unmapped when freed, in both
        # arms: the resident peak then follows the live tensors, not glibc's arenas.
        heap = {"MALLOC_MMAP_THRESHOLD_": "65536"}
        rise = {arm: ranks(wrap, "peak", arm, steps=6, env=heap)["rise_kib_ranks"] for arm in ("plain", "guard")}
        ratio = max(rise["guard"]) / max(rise["plain"])
        print(f"{wrap}: the peak's rise over steps 1-5 (VmHWM reset after step 0), fresh processes:")
        print(f"  plain {max(rise['plain']) / 1024:.1f} MiB (ranks {rise['plain']} KiB), guard {max(rise['guard']) / 1024:.1f} MiB")
        print(f"  (ranks {rise['guard']} KiB): ratio {ratio:.4f} (goal <= 1.02)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main("--quick" in sys.argv)
