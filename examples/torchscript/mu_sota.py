"""A tiny version of the "MU-SOTA" model from one of our users' OOM write-ups: every layer
runs a separate causal attention over each semantic block of the hidden state (here 4 blocks
of 16 dims), then one cross-block attention over all of it, then a feed-forward network.
17 attentions per layer at full size is what ran that user out of memory.

Export it for oomguard (TorchScript: the loss comes from `forward(inputs, targets)`):

    python3 examples/torchscript/mu_sota.py --out examples/torchscript/mu_sota.pt
    oomguard train examples/torchscript/mu_sota.yaml
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        # No bias (as in LLaMA): a key bias has an exactly zero gradient (softmax ignores a
        # per-query constant), so Adam would turn its rounding noise into full-size steps.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Layer(nn.Module):
    def __init__(self, blocks: int, block_dim: int, dropout: float):
        super().__init__()
        dim = blocks * block_dim
        self.block_dim = block_dim
        self.ln_blocks = nn.LayerNorm(dim)
        self.block_attn = nn.ModuleList([Attention(block_dim, 2, dropout) for _ in range(blocks)])
        self.ln_cross = nn.LayerNorm(dim)
        self.cross_attn = Attention(dim, 4, dropout)
        self.ln_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.ln_blocks(x).split(self.block_dim, dim=2)
        outs = []
        for i, attn in enumerate(self.block_attn):
            outs.append(attn(parts[i]))
        x = x + torch.cat(outs, dim=2)
        x = x + self.cross_attn(self.ln_cross(x))
        return x + self.mlp(self.ln_mlp(x))


class MuSota(nn.Module):
    def __init__(self, vocab: int = 256, block_size: int = 64, layers: int = 2, blocks: int = 4, block_dim: int = 16, dropout: float = 0.0):
        super().__init__()
        dim = blocks * block_dim
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.layers = nn.ModuleList([Layer(blocks, block_dim, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    @torch.jit.export
    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(inputs.shape[1], device=inputs.device)
        x = self.tok(inputs) + self.pos(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy: what oomguard trains on."""
        logits = self.logits(inputs)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="mu_sota.pt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    model = MuSota(block_size=a.block_size, layers=a.layers, dropout=a.dropout)
    torch.jit.save(torch.jit.script(model), a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved {a.out}: {n / 1e6:.2f}M parameters, {a.layers} layers x (4 block attentions + 1 cross-block attention)")


if __name__ == "__main__":
    main()
