"""Eager PyTorch doing what oomguard does, for the TorchScript tests: the same samples
(SplitMix64 positions of (seed, step)), AdamW in two groups (no decay on 1-D parameters),
linear warmup then cosine, global-norm clipping. Prints JSON on stdout.

  train: the per-step losses of `steps` steps from the scripted module's initial weights,
         each step's samples in micro-batches of `micro_batch` (default: the whole step),
         each loss weighted by its share, as gradient accumulation in PyTorch; `--out`
         saves the final state_dict (parameters and buffers)
  eval:  the evaluation loss of weights saved by oomguard, loaded with strict=True
"""
import argparse
import json
import math
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torchscript"))
sys.path.insert(0, os.path.dirname(__file__))
from mu_sota import MuSota  # noqa: E402
from ts_bn import BnNet  # noqa: E402

M = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)


def positions(seed, step, count, n):
    base = splitmix64(seed ^ splitmix64(step))
    return [splitmix64(base ^ splitmix64(((i + 1) << 20) & M)) % n for i in range(count)]


def rust_round(x):
    return math.floor(x + 0.5)


class Text:
    """Byte-level windows of `block` tokens, as data.source: text."""

    def __init__(self, path, block, val_fraction):
        data = open(path, "rb").read()
        n_val = rust_round(len(data) * val_fraction)
        self.splits = {"train": data[: len(data) - n_val], "val": data[len(data) - n_val:]}
        self.block = block

    def count(self, split):
        return len(self.splits[split]) - self.block - 1

    def batch(self, split, pos):
        d = self.splits[split]
        x = torch.tensor([list(d[p: p + self.block]) for p in pos], dtype=torch.int64)
        y = torch.tensor([list(d[p + 1: p + 1 + self.block]) for p in pos], dtype=torch.int64)
        return x, y


class Rows:
    """Rows of `inputs` and `targets`, as data.source: tensors."""

    def __init__(self, path, val_fraction):
        t = load_file(path)
        n = t["inputs"].shape[0]
        n_val = rust_round(n * val_fraction)
        self.splits = {s: (t["inputs"][a:b], t["targets"][a:b]) for s, (a, b) in {"train": (0, n - n_val), "val": (n - n_val, n)}.items()}

    def count(self, split):
        return self.splits[split][0].shape[0]

    def batch(self, split, pos):
        x, y = self.splits[split]
        idx = torch.tensor(pos, dtype=torch.int64)
        return x[idx], y[idx]


def lr_at(step, c):
    if step < c["warmup"]:
        return c["lr"] * (step + 1) / c["warmup"]
    decay = max(c["decay_steps"], c["warmup"] + 1)
    if step >= decay:
        return c["min_lr"]
    progress = (step - c["warmup"]) / (decay - c["warmup"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * progress)) * (c["lr"] - c["min_lr"])


def train(model, named, data, c, loss_of=lambda m, b: m(*b)):
    """oomguard's steps in eager PyTorch: AdamW in two groups (no decay on 1-D parameters),
    each step's samples in micro-batches of c["micro_batch"] (default: the whole step), each
    loss weighted by its share, global-norm clipping, the schedule. Returns the step losses."""
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": c["weight_decay"]},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=c["lr"], betas=(c["beta1"], c["beta2"]), eps=c["eps"], fused=True)
    losses = []
    gb, mb = c["global_batch"], c.get("micro_batch", c["global_batch"])
    for step in range(c["steps"]):
        x, y = data.batch("train", positions(c["seed"], step, gb, data.count("train")))
        loss = 0.0
        for i in range(0, gb, mb):
            part = loss_of(model, (x[i: i + mb], y[i: i + mb])) * (min(mb, gb - i) / gb)
            part.backward()
            loss += part.item()
        losses.append(loss)
        torch.nn.utils.clip_grad_norm_([p for _, p in named], c["grad_clip"])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, c)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "eval"])
    ap.add_argument("--model", choices=["mu_sota", "bn"], required=True)
    ap.add_argument("--config", required=True, help="JSON: data, seed, global_batch, ...")
    ap.add_argument("--weights", help="train: the scripted module (initial weights); eval: model.safetensors")
    ap.add_argument("--out", help="train: where to save the final state_dict (safetensors)")
    a = ap.parse_args()
    c = json.loads(a.config)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(False)
    model = MuSota(block_size=c["block"]) if a.model == "mu_sota" else BnNet()
    data = Text(c["data"], c["block"], c["val_fraction"]) if a.model == "mu_sota" else Rows(c["data"], c["val_fraction"])
    if a.mode == "eval":
        missing = model.load_state_dict(load_file(a.weights), strict=True)
        model.eval()
        seed = splitmix64(c["seed"] ^ 0xE7A1)
        total = 0.0
        with torch.no_grad():
            for k in range(c["eval_batches"]):
                x, y = data.batch("val", positions(seed, k, c["eval_batch"], data.count("val")))
                total += model(x, y).item()
        print(json.dumps({"val_loss": total / c["eval_batches"], "load": str(missing)}))
        return
    model.load_state_dict(torch.jit.load(a.weights).state_dict(), strict=True)
    model.train()
    named = sorted(model.named_parameters())
    losses = train(model, named, data, c)
    if a.out:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, a.out)
    print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
