"""Your own PyTorch model, as it is (examples/python/tiny_lm.yaml): oomguard calls build(settings)."""
import torch
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab=256, dim=128, layers=2, heads=4, block=64):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(block, dim) * 0.02)
        layer = lambda: nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.0, batch_first=True, norm_first=True)
        self.blocks, self.head = nn.ModuleList(layer() for _ in range(layers)), nn.Linear(dim, vocab)

    def forward(self, x, y):  # a token source's (inputs, targets) -> the mean loss
        h = self.emb(x) + self.pos[: x.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def build(settings):  # model.settings, as a dict
    return TinyLM(**settings)
