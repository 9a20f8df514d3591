"""A classifier and its map-style dataset (data.source: python): items are (features, label)
with the label a Python int; collate(items) makes the batch. The module returns a mapping
with "loss" (and the logits)."""
import torch
import torch.nn.functional as F
from torch import nn

CLASSES, FEATURES = 3, 8


class Blobs(torch.utils.data.Dataset):
    """Three Gaussian blobs, the same points for a given seed and split."""

    def __init__(self, n, seed):
        centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)) * 3
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        self.points = centers[self.labels] + torch.randn(n, FEATURES, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.points[i], int(self.labels[i])


def dataset(settings, split):
    return Blobs(settings.get("n", 512) if split == "train" else 128, 1 if split == "train" else 2)


def collate(items):
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


class Mlp(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))

    def forward(self, x, y):
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits}


def build(settings):
    return Mlp(settings.get("hidden", 32))
