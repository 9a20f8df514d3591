"""A small non-language model with BatchNorm (running statistics are buffers), and a
safetensors data file of `inputs` and `targets`, for oomguard's TorchScript tests."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file


class BnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.relu(self.bn(self.fc1(inputs)))), targets)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--float-targets", action="store_true", help="a wrong dtype, on purpose")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(BnNet()), a.out)
    x = torch.randn(640, 8)
    y = (x @ torch.randn(8, 3)).argmax(dim=1)
    save_file({"inputs": x, "targets": y.float() if a.float_targets else y}, a.data)
