"""A small MLP whose loss is multiplied by a constant, for oomguard's fp16 tests: a huge
multiplier makes every fp16 backward overflow (GradScaler must skip the step and back off),
1.0 trains normally. Writes the scripted module, its initial state_dict and a safetensors
data file of `inputs` and `targets`."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file


class Scaled(nn.Module):
    def __init__(self, multiplier: float):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 3)
        self.multiplier = multiplier

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.relu(self.fc1(inputs))), targets) * self.multiplier


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--init", required=True, help="the initial state_dict (safetensors)")
    ap.add_argument("--data", required=True)
    ap.add_argument("--multiplier", type=float, default=1.0)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = Scaled(a.multiplier)
    torch.jit.save(torch.jit.script(model), a.out)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, a.init)
    x = torch.randn(640, 8)
    save_file({"inputs": x, "targets": (x @ torch.randn(8, 3)).argmax(dim=1)}, a.data)
