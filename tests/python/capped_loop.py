"""A plain one-process loop (an MLP 256-1024-256, its own AdamW, 1024 rows a step) whose
address space is capped before step 1, once AdamW's state exists: the shape of a CPU job
that meets its memory limit mid-run. `--guard` puts `import oomguard` in; `--cap-mb` is the
headroom above the process's address space at that point. Prints each step's micro-batch and
saves the final parameters to --out."""

from __future__ import annotations

import argparse
import resource
import sys

import torch

torch.set_num_threads(1)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--guard", action="store_true")
    ap.add_argument("--cap-mb", type=float, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    guard = None
    if args.guard:
        import oomguard

        guard = oomguard.Guard(m, global_batch_size=1024, cache=False)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    for step in range(4):
        if args.cap_mb is not None and step == 1:
            resource.setrlimit(resource.RLIMIT_AS, (vm_size() + int(args.cap_mb * (1 << 20)), hard))
        x = torch.randn(1024, 256, generator=gen)
        if guard is not None:
            guard.backward(x, lambda b: (m(b) - b).square().mean())
            guard.optimizer_step(opt)
        else:
            (m(x) - x).square().mean().backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step} micro_batch {guard.micro_batch_size if guard else 1024}", flush=True)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    torch.save([p.detach().clone() for p in m.parameters()], args.out)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
