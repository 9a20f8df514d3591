"""A model TorchScript refuses: a custom autograd.Function, Python control flow on tensor
values, a dataclass config, **kwargs, and Python's `random` (stochastic depth), which a
resume must continue exactly. forward(inputs, targets) returns the mean loss."""
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class ScaledTanh(torch.autograd.Function):
    """tanh(x) * scale, with its own backward."""

    @staticmethod
    def forward(ctx, x, scale):
        y = torch.tanh(x) * scale
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (ctx.scale - y * y / ctx.scale), None


@dataclass
class Shape:
    vocab: int = 256
    dim: int = 32
    depth: int = 3


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, h, **kwargs):
        return h + self.down(ScaledTanh.apply(self.up(self.norm(h)), kwargs.get("scale", 1.0)))


class Branchy(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.emb = nn.Embedding(shape.vocab, shape.dim)
        self.blocks = nn.ModuleList(Block(shape.dim) for _ in range(shape.depth))
        self.head = nn.Linear(shape.dim, shape.vocab)

    def forward(self, x, y):
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            if self.training and i > 0 and random.random() < 0.25:
                continue  # stochastic depth, drawn from Python's random
            h = block(h, scale=1.5)
            if h.abs().mean() < 0.5:  # control flow on a value
                h = block(h, scale=0.5)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def build(settings):
    return Branchy(Shape(**settings))
