"""A TorchScript model with a data-dependent branch: each micro-batch uses one of two heads,
so on some steps a rank leaves a parameter without a gradient. A data file of `inputs` and
`targets`, for oomguard's data-parallel tests."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 3)
        self.head_b = nn.Linear(16, 3)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.body(inputs))
        if bool(inputs[0, 0] > 0):
            out = self.head_a(h)
        else:
            out = self.head_b(h)
        return F.cross_entropy(out, targets)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(Branchy()), a.out)
    x = torch.randn(400, 8)
    y = (x @ torch.randn(8, 3)).argmax(dim=1)
    save_file({"inputs": x, "targets": y}, a.data)
